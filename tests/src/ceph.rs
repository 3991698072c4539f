//! A real one-node Ceph cluster for the system tests (issue 54): volumes on
//! RBD need a monitor and an OSD to talk to.
//!
//! [`cluster`] makes sure one cluster runs for every test process of a run
//! (nextest runs each test in a process of its own, in parallel): it starts
//! `scripts/ceph-dev-cluster.sh start` in one fixed directory,
//! `/tmp/rdmablk-ceph-dev` (`RDMABLK_CEPH_DIR` overrides), under an flock on
//! `DIR/tests.lock`, so one process builds the cluster (about 10 s) and the
//! others, waiting on the lock, find it running and reuse it (under 1 s). The
//! cluster is left running after the tests, for the next run to reuse;
//! `scripts/ceph-dev-cluster.sh stop /tmp/rdmablk-ceph-dev` stops it (its
//! memstore OSD then forgets every image). docs/ceph.md says more.
//!
//! Tests speak to it as `client.rdmablk`, a gateway's identity (mon 'profile
//! rbd', osd 'profile rbd pool=rbd'), through the `rbd`, `rados` and `ceph`
//! commands; images get names unique to the test process
//! ([`DevCluster::unique_name`]), since every test of the run shares the pool.

use std::fs::OpenOptions;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::OnceLock;

/// The running development cluster, as a client sees it.
#[derive(Debug)]
pub struct DevCluster {
    /// The directory the cluster lives in (conf, keyrings, logs, data).
    pub dir: PathBuf,
    /// `DIR/ceph.conf`: `-c` for every client; it points each client at its keyring in DIR.
    pub conf: PathBuf,
    /// The gateway's client id: `client.rdmablk` (`--id rdmablk`, fio's `--clientname`).
    pub client: &'static str,
    /// The pool images live in.
    pub pool: &'static str,
}

/// The commands the cluster and the helpers need; without them the tests fail, never skip.
const COMMANDS: [&str; 5] = ["ceph-mon", "ceph-osd", "ceph", "rbd", "rados"];

/// The shared development cluster, started on first use (in this process,
/// or found running from another process or an earlier run).
pub fn cluster() -> &'static DevCluster {
    static CLUSTER: OnceLock<DevCluster> = OnceLock::new();
    CLUSTER.get_or_init(start_or_reuse)
}

/// Where the shared cluster lives: `RDMABLK_CEPH_DIR`, or `/tmp/rdmablk-ceph-dev`.
pub fn cluster_dir() -> PathBuf {
    std::env::var_os("RDMABLK_CEPH_DIR").map(PathBuf::from).unwrap_or_else(|| PathBuf::from("/tmp/rdmablk-ceph-dev"))
}

/// `scripts/ceph-dev-cluster.sh` of this source tree.
pub fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/ceph-dev-cluster.sh")
}

fn on_path(cmd: &str) -> bool {
    std::env::var_os("PATH").is_some_and(|path| std::env::split_paths(&path).any(|dir| dir.join(cmd).is_file()))
}

fn start_or_reuse() -> DevCluster {
    let missing: Vec<&str> = COMMANDS.iter().copied().filter(|c| !on_path(c)).collect();
    assert!(
        missing.is_empty(),
        "the Ceph tests need {missing:?}, which are not installed: run scripts/test.sh (it installs them) or \
         `apt-get install ceph-mon ceph-osd ceph-common`"
    );
    let script = script();
    assert!(script.is_file(), "{} does not exist", script.display());
    let dir = cluster_dir();
    std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("cannot create {}: {e}", dir.display()));

    // One process at a time looks at the cluster and, when it is not
    // running, starts it; the others wait here and then find it running.
    // The lock goes with the file when this function returns. (The script
    // takes its own lock, DIR/.start.lock, for starts by hand; std opens
    // files close-on-exec, so the script does not inherit this one.)
    let lock_path = dir.join("tests.lock");
    let lock = OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&lock_path)
        .unwrap_or_else(|e| panic!("cannot open {}: {e}", lock_path.display()));
    // SAFETY: flock on a file descriptor this function owns, open until `lock` drops.
    let rc = unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX) };
    assert_eq!(rc, 0, "flock {}: {}", lock_path.display(), std::io::Error::last_os_error());

    // `start` reuses a running cluster (it checks `ceph -s` and probes the
    // pool) and otherwise builds one, waiting until the pool takes an image.
    let out = Command::new("bash").arg(&script).arg("start").arg(&dir).output().expect("run scripts/ceph-dev-cluster.sh");
    assert!(
        out.status.success(),
        "scripts/ceph-dev-cluster.sh start {} failed ({}):\n{}{}",
        dir.display(),
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    drop(lock);
    DevCluster { conf: dir.join("ceph.conf"), dir, client: "rdmablk", pool: "rbd" }
}

fn run(mut cmd: Command) -> Output {
    let shown = format!("{cmd:?}");
    cmd.output().unwrap_or_else(|e| panic!("{shown}: {e}"))
}

/// `out`'s stdout, or a panic naming `what`, the exit status and stderr.
fn expect_ok(what: &str, out: Output) -> String {
    assert!(
        out.status.success(),
        "{what} failed ({}):\nstdout: {}\nstderr: {}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

impl DevCluster {
    /// `tool -c CONF --id ID` (tool: rbd, rados, ceph), ready for arguments.
    fn command(&self, tool: &str, id: &str) -> Command {
        let mut cmd = Command::new(tool);
        cmd.arg("-c").arg(&self.conf).arg("--id").arg(id);
        cmd
    }

    /// Runs `rbd` as client.rdmablk; the caller judges the result.
    pub fn rbd(&self, args: &[&str]) -> Output {
        let mut cmd = self.command("rbd", self.client);
        cmd.args(args);
        run(cmd)
    }

    /// Runs `rados` as client.rdmablk; the caller judges the result.
    pub fn rados(&self, args: &[&str]) -> Output {
        let mut cmd = self.command("rados", self.client);
        cmd.args(args);
        run(cmd)
    }

    /// Runs `ceph` as client.rdmablk (what its mon caps allow), bounded in time.
    pub fn ceph(&self, args: &[&str]) -> Output {
        let mut cmd = self.command("ceph", self.client);
        cmd.args(["--connect-timeout", "20"]).args(args);
        run(cmd)
    }

    /// Runs `ceph` as client.admin (all caps), bounded in time.
    pub fn ceph_admin(&self, args: &[&str]) -> Output {
        let mut cmd = self.command("ceph", "admin");
        cmd.args(["--connect-timeout", "20"]).args(args);
        run(cmd)
    }

    /// `pool/name`.
    pub fn spec(&self, name: &str) -> String {
        format!("{}/{name}", self.pool)
    }

    /// The start of a `[[volume]]` block exporting image `image` of the pool
    /// as volume `name`, as a gateway (client.rdmablk) of this cluster; the
    /// caller adds its size, nsid and access lines.
    pub fn volume_block(&self, name: &str, image: &str, lock_at_start: bool) -> String {
        format!(
            "[[volume]]\nname = \"{name}\"\nbackend = \"rbd\"\npool = \"{}\"\nimage = \"{image}\"\nceph_conf = \"{}\"\nclient = \"{}\"\nlock_at_start = {lock_at_start}\n",
            self.pool,
            self.conf.display(),
            self.client
        )
    }

    /// A name no other test process of this run (nor an earlier run) uses:
    /// `prefix-PID-N`, N counting within this process.
    pub fn unique_name(&self, prefix: &str) -> String {
        static NEXT: AtomicU32 = AtomicU32::new(0);
        format!("{prefix}-{}-{}", std::process::id(), NEXT.fetch_add(1, Ordering::Relaxed))
    }

    /// Creates image `name` of `size_bytes` in the pool; panics if rbd fails
    /// (an image of that name exists already, for one).
    pub fn create_image(&self, name: &str, size_bytes: u64) {
        let size = format!("{size_bytes}B");
        expect_ok(&format!("rbd create {}", self.spec(name)), self.rbd(&["create", "--size", &size, &self.spec(name)]));
    }

    /// Removes image `name`; panics if rbd fails (no such image, or a client still has it open).
    pub fn remove_image(&self, name: &str) {
        expect_ok(&format!("rbd rm {}", self.spec(name)), self.rbd(&["rm", "--no-progress", &self.spec(name)]));
    }

    /// Whether image `name` exists; panics on any other rbd failure.
    pub fn image_exists(&self, name: &str) -> bool {
        let out = self.rbd(&["info", &self.spec(name)]);
        if out.status.success() {
            return true;
        }
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains("(2) No such file or directory"), "rbd info {} failed ({}): {stderr}", self.spec(name), out.status);
        false
    }

    /// The image's size in bytes, from `rbd info --format json`.
    pub fn image_size(&self, name: &str) -> u64 {
        let size = &self.image_info(name, &["size"])[0];
        size.parse().unwrap_or_else(|_| panic!("rbd info {}: size {size:?} is no number", self.spec(name)))
    }

    /// Fields `keys` of `rbd info --format json` of image `name` (numbers
    /// and plain strings), in order; panics if rbd fails or a key is missing.
    pub fn image_info(&self, name: &str, keys: &[&str]) -> Vec<String> {
        let out = expect_ok(
            &format!("rbd info {}", self.spec(name)),
            self.rbd(&["info", "--format", "json", &self.spec(name)]),
        );
        // {"name":"x","id":"...","size":1048576,...}: no JSON parser in this crate's dependencies.
        keys.iter()
            .map(|key| {
                let rest = out.split_once(&format!("\"{key}\":")).map(|(_, r)| r).unwrap_or_else(|| panic!("no {key} in rbd info: {out}"));
                rest.trim_start_matches('"').chars().take_while(|ch| ch.is_ascii_alphanumeric() || *ch == '_' || *ch == '.').collect()
            })
            .collect()
    }

    /// Creates image `name` from `file`, its contents and size (`rbd import`; the image must not exist).
    pub fn import_image(&self, file: &Path, name: &str) {
        let file = file.to_str().expect("utf-8 path");
        expect_ok(
            &format!("rbd import {file} {}", self.spec(name)),
            self.rbd(&["import", "--no-progress", file, &self.spec(name)]),
        );
    }

    /// Reads the whole image into `file` (`rbd export`; `file` must not exist).
    pub fn export_image(&self, name: &str, file: &Path) {
        let file = file.to_str().expect("utf-8 path");
        expect_ok(
            &format!("rbd export {} {file}", self.spec(name)),
            self.rbd(&["export", "--no-progress", &self.spec(name), file]),
        );
    }
}
