//! The development Ceph cluster (scripts/ceph-dev-cluster.sh, through
//! `rdmablk_system_tests::ceph`) is a real one, usable the way a gateway
//! uses Ceph (issue 54):
//!
//! - an image is created, filled with `rbd import` and read back identical
//!   with `rbd export`, its objects seen by `rados`, and removed;
//! - fio's rbd engine, librbd as client.rdmablk, writes an image and reads
//!   it back with verification;
//! - client.rdmablk (mon 'profile rbd') can blocklist a client instance, as
//!   breaking a dead owner's exclusive lock does, and list the blocklist;
//!   it cannot remove an entry (client.admin does);
//! - client.rdmablk breaks the exclusive lock of a client that died while
//!   writing an image, and that client is blocklisted by it;
//! - clients get rbd_cache = false and rbd_blocklist_on_break_lock = true.
//!
//! The first of these in a run may start the cluster (about 10 s).

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use rand::SeedableRng;
use rdmablk_system_tests::ceph::cluster;
use rdmablk_system_tests::random_bytes;

const MIB: u64 = 1 << 20;

fn seed() -> u64 {
    std::env::var("RDMABLK_TEST_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or_else(rand::random)
}

fn stderr(out: &std::process::Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
fn an_image_is_created_written_read_back_and_removed() {
    let c = cluster();
    let seed = seed();
    eprintln!("seed {seed}");
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let tmp = tempfile::tempdir().unwrap();

    // An empty image of a given size.
    let empty = c.unique_name("dev-cluster-empty");
    assert!(!c.image_exists(&empty));
    c.create_image(&empty, 8 * MIB);
    assert!(c.image_exists(&empty));
    assert_eq!(c.image_size(&empty), 8 * MIB);
    let out = c.rbd(&["create", "--size", "1M", &c.spec(&empty)]);
    assert!(!out.status.success(), "a second image of the same name was created");
    let zeros = tmp.path().join("empty.out");
    c.export_image(&empty, &zeros);
    let read = std::fs::read(&zeros).unwrap();
    assert_eq!(read.len() as u64, 8 * MIB);
    assert!(read.iter().all(|&b| b == 0), "a new image reads back non-zero");
    c.remove_image(&empty);
    assert!(!c.image_exists(&empty));

    // Data spanning two 4 MiB objects and a part of a third, with a tail of
    // 512 bytes: written with rbd import, read back with rbd export.
    let name = c.unique_name("dev-cluster-data");
    let data = random_bytes(&mut rng, (9 * MIB + 512) as usize);
    let input = tmp.path().join("in");
    std::fs::write(&input, &data).unwrap();
    c.import_image(&input, &name);
    assert_eq!(c.image_size(&name), data.len() as u64);
    let output = tmp.path().join("out");
    c.export_image(&name, &output);
    let back = std::fs::read(&output).unwrap();
    assert!(back == data, "rbd export read back other bytes than rbd import wrote ({} bytes back of {})", back.len(), data.len());

    // The image's data objects are in the pool, as client.rdmablk sees it
    // with rados: three of them, named after the image's block_name_prefix.
    let info = c.rbd(&["info", &c.spec(&name)]);
    assert!(info.status.success(), "rbd info: {}", stderr(&info));
    let info = String::from_utf8_lossy(&info.stdout).into_owned();
    let prefix = info
        .lines()
        .find_map(|l| l.trim().strip_prefix("block_name_prefix: "))
        .unwrap_or_else(|| panic!("no block_name_prefix in rbd info:\n{info}"))
        .to_owned();
    let ls = c.rados(&["-p", c.pool, "ls"]);
    assert!(ls.status.success(), "rados ls: {}", stderr(&ls));
    let objects = String::from_utf8_lossy(&ls.stdout).lines().filter(|l| l.starts_with(&format!("{prefix}."))).count();
    assert_eq!(objects, 3, "data objects of {name} ({prefix}.*) in pool {}", c.pool);

    c.remove_image(&name);
    assert!(!c.image_exists(&name));
}

#[test]
fn fio_rbd_engine_writes_and_verifies_as_client_rdmablk() {
    let c = cluster();
    let name = c.unique_name("dev-cluster-fio");
    c.create_image(&name, 16 * MIB);
    // fio saves its verify state in its working directory: a temporary one,
    // not the source tree.
    let work = tempfile::tempdir().unwrap();
    let out = Command::new("fio")
        .current_dir(work.path())
        .env("CEPH_CONF", &c.conf)
        .args([
            "--name=dev-cluster",
            "--ioengine=rbd",
            &format!("--clientname={}", c.client),
            &format!("--pool={}", c.pool),
            &format!("--rbdname={name}"),
            "--rw=randwrite",
            "--bs=4k",
            "--iodepth=16",
            "--size=16M",
            "--verify=crc32c",
            "--do_verify=1",
            "--verify_fatal=1",
            "--output-format=terse",
            "--terse-version=3",
        ])
        .output()
        .expect("run fio (scripts/test.sh installs it)");
    assert!(
        out.status.success(),
        "fio failed ({}):\n{}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        stderr(&out)
    );
    // Terse v3: field 5 is the error, 6 the KiB read (the verify pass), 47 the KiB written.
    let terse = String::from_utf8_lossy(&out.stdout).into_owned();
    let line = terse.lines().find(|l| l.starts_with("3;")).unwrap_or_else(|| panic!("no terse line in fio output:\n{terse}"));
    let fields: Vec<&str> = line.split(';').collect();
    assert_eq!(fields[4], "0", "fio error field: {line}");
    assert_eq!(fields[46], "16384", "KiB written: {line}");
    assert_eq!(fields[5], "16384", "KiB read back for verification: {line}");
    c.remove_image(&name);
}

#[test]
fn client_rdmablk_blocklists_a_client_instance_and_admin_removes_it() {
    let c = cluster();
    // An address no client has: 127.0.0.1, port 0, a nonce of this process.
    let entry = format!("127.0.0.1:0/{}", 1_000_000 + std::process::id());
    let listed = |who: &str| {
        let out = if who == "admin" { c.ceph_admin(&["osd", "blocklist", "ls"]) } else { c.ceph(&["osd", "blocklist", "ls"]) };
        assert!(out.status.success(), "ceph --id {who} osd blocklist ls: {}", stderr(&out));
        String::from_utf8_lossy(&out.stdout).lines().any(|l| l.split_whitespace().next() == Some(entry.as_str()))
    };
    assert!(!listed("rdmablk"), "{entry} is blocklisted before the test");

    let out = c.ceph(&["osd", "blocklist", "add", &entry, "600"]);
    assert!(out.status.success(), "client.rdmablk: osd blocklist add {entry}: {}", stderr(&out));
    assert!(listed("rdmablk"), "{entry} not listed after client.rdmablk added it");
    assert!(listed("admin"), "{entry} not listed for client.admin");

    // 'profile rbd' grants add of ADDR/NONCE only: no rm, no whole address.
    let out = c.ceph(&["osd", "blocklist", "rm", &entry]);
    assert!(!out.status.success(), "client.rdmablk removed a blocklist entry; its caps are wider than 'profile rbd'");
    assert!(stderr(&out).contains("EACCES"), "client.rdmablk's rm failed otherwise than with EACCES: {}", stderr(&out));
    let out = c.ceph(&["osd", "blocklist", "add", "127.0.0.1:0"]);
    assert!(!out.status.success(), "client.rdmablk blocklisted a whole address");
    assert!(listed("rdmablk"), "{entry} left the blocklist after a denied rm");

    let out = c.ceph_admin(&["osd", "blocklist", "rm", &entry]);
    assert!(out.status.success(), "client.admin: osd blocklist rm {entry}: {}", stderr(&out));
    assert!(!listed("rdmablk"), "{entry} still listed after client.admin removed it");
}

/// A child process killed (SIGKILL) and reaped on drop.
struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn client_rdmablk_breaks_a_dead_clients_lock_and_blocklists_it() {
    let c = cluster();
    let name = c.unique_name("dev-cluster-lock");
    c.create_image(&name, 64 * MIB);
    let locks = || -> Vec<serde_json::Value> {
        let out = c.rbd(&["lock", "ls", "--format", "json", &c.spec(&name)]);
        assert!(out.status.success(), "rbd lock ls: {}", stderr(&out));
        serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("rbd lock ls json: {e}: {}", String::from_utf8_lossy(&out.stdout)))
    };

    // A writer as client.rdmablk takes the image's exclusive lock ...
    let mut writer = Killed(
        Command::new("rbd")
            .arg("-c")
            .arg(&c.conf)
            .args(["--id", c.client, "bench", "--io-type", "write", "--io-total", "64G", &c.spec(&name)])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn rbd bench"),
    );
    let deadline = Instant::now() + Duration::from_secs(30);
    let lock = loop {
        if let Some(lock) = locks().pop() {
            break lock;
        }
        assert!(writer.0.try_wait().unwrap().is_none(), "rbd bench on {name} ended before it took the lock");
        assert!(Instant::now() < deadline, "rbd bench took no lock on {name} within 30 s");
        std::thread::sleep(Duration::from_millis(200));
    };
    // ... and dies holding it.
    drop(writer);
    let field = |key: &str| lock[key].as_str().unwrap_or_else(|| panic!("no {key} in lock {lock}")).to_owned();
    let (id, locker, address) = (field("id"), field("locker"), field("address"));
    assert_eq!(locks().len(), 1, "the dead writer's lock is gone before anyone broke it");

    // Breaking the lock blocklists the dead owner (rbd_blocklist_on_break_lock), with client.rdmablk's own caps.
    let out = c.rbd(&["lock", "rm", &c.spec(&name), &id, &locker]);
    assert!(out.status.success(), "client.rdmablk: rbd lock rm {name} {id} {locker}: {}", stderr(&out));
    assert!(locks().is_empty(), "the lock of {locker} on {name} is still there after rbd lock rm");
    let out = c.ceph(&["osd", "blocklist", "ls"]);
    assert!(out.status.success(), "osd blocklist ls: {}", stderr(&out));
    let blocklisted = String::from_utf8_lossy(&out.stdout).lines().any(|l| l.split_whitespace().next() == Some(address.as_str()));
    assert!(blocklisted, "{locker} at {address} is not blocklisted after its lock was broken");

    // Its watch went with the blocklisting: the image can be removed.
    c.remove_image(&name);
    let out = c.ceph_admin(&["osd", "blocklist", "rm", &address]);
    assert!(out.status.success(), "client.admin: osd blocklist rm {address}: {}", stderr(&out));
}

#[test]
fn clients_read_no_cache_and_blocklist_on_lock_break() {
    let c = cluster();
    let lookup = |key: &str| {
        let out = Command::new("ceph-conf")
            .arg("-c")
            .arg(&c.conf)
            .args(["--name", &format!("client.{}", c.client), "--show-config-value", key])
            .output()
            .expect("run ceph-conf");
        assert!(out.status.success(), "ceph-conf {key}: {}", stderr(&out));
        String::from_utf8_lossy(&out.stdout).trim().to_owned()
    };
    assert_eq!(lookup("rbd_cache"), "false");
    assert_eq!(lookup("rbd_blocklist_on_break_lock"), "true");
    assert_eq!(lookup("keyring"), c.dir.join("ceph.client.rdmablk.keyring").to_str().unwrap());
}

/// A second cluster on a monitor port another process holds (the tests'
/// cluster is on the default one) fails at once, naming the port and the
/// variable that moves it, instead of a monitor that "did not start".
#[test]
fn a_start_on_a_taken_monitor_port_names_the_port_and_how_to_move_it() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port();
    let dir = tempfile::tempdir().unwrap();
    let t0 = Instant::now();
    let out = Command::new("bash")
        .arg(rdmablk_system_tests::ceph::script())
        .args(["start", dir.path().to_str().unwrap()])
        .env("CEPH_DEV_MON_PORT", port.to_string())
        .output()
        .unwrap();
    let err = stderr(&out);
    assert!(!out.status.success(), "a start on a taken port succeeded: {err}");
    assert!(err.contains(&format!("127.0.0.1:{port} is in use")) && err.contains("CEPH_DEV_MON_PORT"), "unclear error: {err}");
    assert!(t0.elapsed() < Duration::from_secs(10), "took {:?} to fail", t0.elapsed());
    assert!(!dir.path().join("mon.a").exists(), "a monitor was created anyway");
}
