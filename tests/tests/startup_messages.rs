//! What an operator reads when the daemon cannot start, or starts exposed
//! (issue 51): a listen address in use or not on this host, too little
//! RLIMIT_MEMLOCK for the buffer pools, a volume file it may not write, and
//! volumes served to unauthenticated hosts on a non-loopback listener. Each
//! message names the problem, the key or path, and the fix.

use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use rdmablk_system_tests::{bin, memory_volume};

const MIB: u64 = 1 << 20;

fn write_config(dir: &tempfile::TempDir, name: &str, text: &str) -> String {
    let path = dir.path().join(name);
    std::fs::write(&path, text).unwrap();
    path.to_str().unwrap().to_owned()
}

/// Runs `cmd` (the daemon, maybe behind a wrapper) and returns its output
/// once it exits; `None` when it is still running after 15 s (it started:
/// killed).
fn run_until_exit(mut cmd: Command) -> Option<Output> {
    let mut child = cmd.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped()).env("RUST_LOG", "info").spawn().unwrap();
    let deadline = Instant::now() + Duration::from_secs(15);
    while child.try_wait().unwrap().is_none() {
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            return None;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Some(child.wait_with_output().unwrap())
}

fn daemon(config: &str, args: &[&str]) -> Command {
    let mut cmd = Command::new(bin("rdmablk-target"));
    cmd.args(["--config", config]).args(args);
    cmd
}

/// The last line of stderr: the one `rdmablk-target: ...` error line.
fn error_line(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).trim().lines().last().unwrap_or("").to_owned()
}

#[test]
fn a_listen_address_in_use_or_not_on_this_host_says_which_and_what_to_do() {
    let dir = tempfile::tempdir().unwrap();
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port();
    let volume = memory_volume("m", 8 * MIB, false);
    let cases = [
        (format!("[target]\nlisten = [\"tcp://127.0.0.1:{port}\"]\n"), format!("tcp://127.0.0.1:{port}"), "address already in use"),
        // 192.0.2.0/24 is TEST-NET-1: never an address of this host.
        (
            "[target]\nlisten = [\"tcp://192.0.2.1:7420\"]\n".to_owned(),
            "tcp://192.0.2.1:7420".to_owned(),
            "address not available on this host",
        ),
        (
            format!("[target]\nlisten = [\"tcp://127.0.0.1:0\", \"nvme+tcp://127.0.0.1:{port}\"]\n"),
            format!("nvme+tcp://127.0.0.1:{port}"),
            "address already in use",
        ),
        (
            "[target]\nlisten = [\"tcp://127.0.0.1:0\", \"nvme+tcp://192.0.2.1:4420\"]\n".to_owned(),
            "nvme+tcp://192.0.2.1:4420".to_owned(),
            "address not available on this host",
        ),
        (
            format!("[target]\nlisten = [\"tcp://127.0.0.1:0\"]\nmetrics = \"127.0.0.1:{port}\"\n"),
            format!("127.0.0.1:{port}"),
            "address already in use",
        ),
    ];
    for (i, (target, url, reason)) in cases.iter().enumerate() {
        let path = write_config(&dir, &format!("l{i}.toml"), &format!("{target}{volume}"));
        let out = run_until_exit(daemon(&path, &[])).unwrap_or_else(|| panic!("{url}: the daemon started"));
        let line = error_line(&out);
        assert_eq!(out.status.code(), Some(1), "{url}: {line}");
        let key = if url.starts_with("127.0.0.1") { "target.metrics" } else { "target.listen" };
        assert!(line.contains(&path) && line.contains(key) && line.contains(url.as_str()), "{url}: file, key or URL missing: {line}");
        assert!(line.contains(reason), "{url}: does not say {reason:?}: {line}");
        let fix = if reason.contains("in use") { "another port" } else { "an address of this host" };
        assert!(line.contains(fix), "{url}: does not say {fix:?}: {line}");
    }
    drop(taken);
}

#[test]
fn too_little_memlock_names_the_bytes_needed_and_the_fix() {
    // Root has CAP_IPC_LOCK, which lifts the limit: drop it (setpriv), then
    // set the limit (prlimit) for the daemon alone.
    let have = |tool: &str| Command::new(tool).arg("--version").output().is_ok_and(|o| o.status.success());
    if !have("prlimit") || !have("setpriv") {
        eprintln!("skipping: prlimit or setpriv is not installed");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let text = format!(
        "[target]\nlisten = [\"tcp://127.0.0.1:0\"]\nreactors = 2\nbuffer_pool = \"4MiB\"\nchunk_size = \"128KiB\"\n{}",
        memory_volume("m", 8 * MIB, false)
    );
    let path = write_config(&dir, "m.toml", &text);
    let mut cmd = Command::new("prlimit");
    cmd.args(["--memlock=65536:65536", "setpriv", "--bounding-set=-ipc_lock", "--inh-caps=-ipc_lock"])
        .arg(bin("rdmablk-target"))
        .args(["--config", &path]);
    let Some(out) = run_until_exit(cmd) else {
        eprintln!("skipping: the daemon started with RLIMIT_MEMLOCK 64 KiB (this kernel does not count registered buffers)");
        return;
    };
    let line = error_line(&out);
    assert_eq!(out.status.code(), Some(1), "{line}");
    // 2 reactors × 4 MiB.
    for want in ["RLIMIT_MEMLOCK", "65536 bytes", "8388608 bytes", "target.buffer_pool", "ulimit -l 8192", "LimitMEMLOCK="] {
        assert!(line.contains(want), "does not say {want:?}: {line}");
    }
}

#[test]
fn a_volume_file_it_may_not_write_hints_at_read_only_and_read_write_paths() {
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("v.img");
    std::fs::write(&img, vec![0u8; MIB as usize]).unwrap();
    std::fs::set_permissions(dir.path(), std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    std::fs::set_permissions(&img, std::os::unix::fs::PermissionsExt::from_mode(0o444)).unwrap();
    let text = format!(
        "[target]\nlisten = [\"tcp://127.0.0.1:0\"]\nreactors = 1\nbuffer_pool = \"4MiB\"\n\
         [[volume]]\nname = \"v\"\nbackend = \"file\"\npath = \"{}\"\nsize = \"1MiB\"\nallow_any_host = true\n",
        img.display()
    );
    let path = write_config(&dir, "v.toml", &text);
    std::fs::set_permissions(&path, std::os::unix::fs::PermissionsExt::from_mode(0o644)).unwrap();
    // Root opens a mode-0444 file read-write: run as nobody.
    let as_nobody = |args: &[&str]| {
        let mut cmd = Command::new("setpriv");
        cmd.args(["--reuid=65534", "--regid=65534", "--clear-groups"]);
        cmd.arg(bin("rdmablk-target")).args(["--config", &path]).args(args);
        cmd
    };
    if Command::new("setpriv").arg("--version").output().is_err() {
        eprintln!("skipping: setpriv is not installed");
        return;
    }
    for args in [&[][..], &["--check"][..]] {
        let out = run_until_exit(as_nobody(args)).expect("the daemon started on a file it may not write");
        let line = error_line(&out);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {line}");
        for want in [path.as_str(), "volume[0].path", img.to_str().unwrap(), "Permission denied", "read_only = true", "ReadWritePaths="] {
            assert!(line.contains(want), "{args:?}: does not say {want:?}: {line}");
        }
    }
}

#[test]
fn unauthenticated_volumes_on_a_non_loopback_listener_are_warned_about() {
    let dir = tempfile::tempdir().unwrap();
    let open = format!(
        "[target]\nlisten = [\"tcp://0.0.0.0:0\", \"nvme+tcp://0.0.0.0:0\"]\n{}{}",
        memory_volume("m", 8 * MIB, false),
        memory_volume("n", 8 * MIB, false)
    );
    let path = write_config(&dir, "open.toml", &open);
    let out = daemon(&path, &["--check"]).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(out.status.code(), Some(0), "{err}");
    let warn: Vec<&str> = err.lines().filter(|l| l.contains("WARN") && l.contains("unauthenticated")).collect();
    assert_eq!(warn.len(), 2, "one WARN line per listener: {err}");
    assert!(warn[0].contains("tcp://0.0.0.0:0") && warn[1].contains("nvme+tcp://0.0.0.0:0"), "{err}");
    for w in &warn {
        assert!(w.contains("m, n") && w.contains("[[host]]") && w.contains("allow_any_host"), "names neither the volumes nor the fix: {w}");
    }

    // The daemon itself warns at startup, with the port it got.
    let target = rdmablk_system_tests::TargetProcess::start_with_path(std::path::Path::new(&path));
    let line = target.wait_for_log("unauthenticated", Duration::from_secs(10));
    assert!(line.contains("WARN") && line.contains("tcp://0.0.0.0:") && line.contains("m, n"), "{line}");
    drop(target);

    // Loopback only: nothing to warn about.
    let local = format!("[target]\nlisten = [\"tcp://127.0.0.1:0\", \"nvme+tcp://[::1]:0\"]\n{}", memory_volume("m", 8 * MIB, false));
    let path = write_config(&dir, "local.toml", &local);
    let out = daemon(&path, &["--check"]).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(out.status.code(), Some(0), "{err}");
    assert!(!err.contains("unauthenticated"), "{err}");
}
