//! Helpers for system tests that start the real rdmablk binaries.
//!
//! The binaries come from the same cargo target directory as the test
//! executable (`target/<profile>/`), or from `RDMABLK_BIN_DIR` when set (the
//! Soft-RoCE VM stage runs prebuilt binaries). Build them first:
//! `cargo build --workspace --bins`.

pub mod raw;

use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Where the project's binaries live.
pub fn bin_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("RDMABLK_BIN_DIR") {
        return PathBuf::from(dir);
    }
    let exe = std::env::current_exe().expect("current_exe");
    // target/<profile>/deps/<test> → target/<profile>
    let dir = exe.parent().and_then(Path::parent).expect("test binary lives in target/<profile>/deps");
    dir.to_path_buf()
}

/// Path of one of the project's binaries; panics with a hint when it is missing.
pub fn bin(name: &str) -> PathBuf {
    let path = bin_dir().join(name);
    assert!(
        path.exists(),
        "{} does not exist: run `cargo build --workspace --bins` before the system tests",
        path.display()
    );
    path
}

/// The fabric scheme system tests use: `tcp` unless `RDMABLK_TEST_SCHEME` says otherwise.
pub fn scheme() -> String {
    std::env::var("RDMABLK_TEST_SCHEME").unwrap_or_else(|_| "tcp".to_owned())
}

/// Address system tests listen on; the VM stage sets its rxe address.
pub fn listen_host() -> String {
    std::env::var("RDMABLK_TEST_HOST").unwrap_or_else(|_| "127.0.0.1".to_owned())
}

/// A running `rdmablk-target` process, killed on drop.
pub struct TargetProcess {
    child: Child,
    /// The URL the target actually listens on (port 0 resolved).
    pub url: String,
    log: Arc<Mutex<Vec<String>>>,
    _dir: Option<tempfile::TempDir>,
    pub config_path: PathBuf,
}

impl TargetProcess {
    /// Writes `config` to a temporary file and starts the real daemon on it.
    /// Waits until it logs its listen URL.
    pub fn start(config: &str) -> TargetProcess {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("target.toml");
        std::fs::write(&path, config).expect("write config");
        let mut t = Self::start_with_path(&path);
        t._dir = Some(dir);
        t
    }

    /// Starts the daemon on an existing config file.
    pub fn start_with_path(path: &Path) -> TargetProcess {
        let mut child = Command::new(bin("rdmablk-target"))
            .arg("--config")
            .arg(path)
            .env("RUST_LOG", std::env::var("RDMABLK_TEST_LOG").unwrap_or_else(|_| "info".to_owned()))
            .env_remove("NOTIFY_SOCKET")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn rdmablk-target");
        let stderr = child.stderr.take().expect("stderr piped");
        let log = Arc::new(Mutex::new(Vec::new()));
        let (tx, rx) = std::sync::mpsc::channel();
        let sink = log.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines() {
                let Ok(line) = line else { break };
                if std::env::var_os("RDMABLK_TEST_ECHO").is_some() {
                    eprintln!("[target] {line}");
                }
                if let Some(url) = listen_url_in(&line) {
                    let _ = tx.send(url);
                }
                sink.lock().unwrap().push(line);
            }
        });
        let url = match rx.recv_timeout(Duration::from_secs(30)) {
            Ok(url) => url,
            Err(_) => {
                let _ = child.kill();
                let _ = child.wait();
                panic!("rdmablk-target did not report a listen URL; log:\n{}", log.lock().unwrap().join("\n"));
            }
        };
        TargetProcess { child, url, log, _dir: None, config_path: path.to_path_buf() }
    }

    /// Every log line so far.
    pub fn log(&self) -> Vec<String> {
        self.log.lock().unwrap().clone()
    }

    /// Waits until a log line contains `needle`, or panics after `timeout`.
    pub fn wait_for_log(&self, needle: &str, timeout: Duration) -> String {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(l) = self.log.lock().unwrap().iter().find(|l| l.contains(needle)) {
                return l.clone();
            }
            assert!(Instant::now() < deadline, "no log line containing {needle:?}; log:\n{}", self.log().join("\n"));
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// The process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Sends a signal to the daemon.
    pub fn signal(&self, sig: i32) {
        // SAFETY: kill(2) takes plain integers; the pid is our own child.
        let rc = unsafe { libc::kill(self.child.id() as i32, sig) };
        assert_eq!(rc, 0, "kill({sig}) failed");
    }

    /// Waits for exit (with a timeout) and returns the exit code.
    pub fn wait_exit(&mut self, timeout: Duration) -> Option<i32> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.child.try_wait().expect("try_wait") {
                return status.code();
            }
            if Instant::now() > deadline {
                let _ = self.child.kill();
                panic!("rdmablk-target did not exit within {timeout:?}; log:\n{}", self.log().join("\n"));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for TargetProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Extracts the URL from a "listening on <url>" log line.
fn listen_url_in(line: &str) -> Option<String> {
    let at = line.find("listening on ")?;
    let rest = &line[at + "listening on ".len()..];
    let url: String = rest.chars().take_while(|c| !c.is_whitespace() && *c != '"' && *c != ',').collect();
    url.contains("://").then_some(url)
}

/// Runs the `rdmablk` CLI with `args` and optional stdin; returns its output.
pub fn rdmablk(args: &[&str], stdin: Option<&[u8]>) -> Output {
    let mut child = Command::new(bin("rdmablk"))
        .args(args)
        .stdin(if stdin.is_some() { Stdio::piped() } else { Stdio::null() })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn rdmablk");
    if let Some(data) = stdin {
        use std::io::Write;
        let mut pipe = child.stdin.take().expect("stdin");
        let data = data.to_vec();
        std::thread::spawn(move || {
            let _ = pipe.write_all(&data);
        });
    }
    let mut out = Vec::new();
    let mut err = Vec::new();
    let mut so = child.stdout.take().expect("stdout");
    let mut se = child.stderr.take().expect("stderr");
    let t = std::thread::spawn(move || {
        let _ = se.read_to_end(&mut err);
        err
    });
    so.read_to_end(&mut out).expect("read stdout");
    let err = t.join().expect("stderr thread");
    let status = child.wait().expect("wait rdmablk");
    Output { status, stdout: out, stderr: err }
}

/// A sparse backing file of `size` bytes in `dir`.
pub fn sparse_file(dir: &Path, name: &str, size: u64) -> PathBuf {
    let path = dir.join(name);
    let f = std::fs::File::create(&path).expect("create backing file");
    f.set_len(size).expect("set_len");
    path
}

/// A file volume config block.
pub fn file_volume(name: &str, path: &Path, size: u64, read_only: bool) -> String {
    format!(
        "[[volume]]\nname = \"{name}\"\nbackend = \"file\"\npath = \"{}\"\nsize = {size}\nread_only = {read_only}\n",
        path.display()
    )
}

/// A `[target]` section listening on port 0 of the test host.
pub fn target_section() -> String {
    format!("[target]\nlisten = [\"{}://{}:0\"]\n", scheme(), listen_host())
}

/// Reads `len` bytes at `offset` straight from a backing file.
pub fn file_bytes(path: &Path, offset: u64, len: usize) -> Vec<u8> {
    use std::os::unix::fs::FileExt;
    let f = std::fs::File::open(path).expect("open backing file");
    let mut buf = vec![0u8; len];
    f.read_exact_at(&mut buf, offset).expect("read backing file");
    buf
}

/// A cheap checksum of a whole file, to prove a volume was not touched.
pub fn file_digest(path: &Path) -> u64 {
    let data = std::fs::read(path).expect("read backing file");
    // FNV-1a: no dependency, and collisions are irrelevant for this purpose.
    data.iter().fold(0xcbf29ce484222325u64, |h, &b| (h ^ b as u64).wrapping_mul(0x100000001b3))
}

/// Deterministic pseudo-random bytes.
pub fn random_bytes(rng: &mut impl rand::RngCore, len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    rng.fill_bytes(&mut v);
    v
}
