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
        Self::start_with_env(config, &[], &[])
    }

    /// Starts the daemon on an existing config file.
    pub fn start_with_path(path: &Path) -> TargetProcess {
        Self::spawn(path, &[], &[])
    }

    /// Starts the real daemon on `path` with extra environment and arguments,
    /// collects its log, and waits until it reports its listen URL.
    fn spawn(path: &Path, env: &[(&str, &str)], args: &[&str]) -> TargetProcess {
        let mut cmd = Command::new(bin("rdmablk-target"));
        cmd.arg("--config")
            .arg(path)
            .args(args)
            .env("RUST_LOG", std::env::var("RDMABLK_TEST_LOG").unwrap_or_else(|_| "info".to_owned()))
            .env_remove("NOTIFY_SOCKET")
            .env_remove("WATCHDOG_USEC")
            .env_remove("WATCHDOG_PID");
        for (k, v) in env {
            cmd.env(k, v);
        }
        let mut child = cmd.stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::piped()).spawn().expect("spawn rdmablk-target");
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

// ---------------------------------------------------------------------------
// Daemon-level helpers (production daemon tests).

impl TargetProcess {
    /// Like [`TargetProcess::start`], with extra environment variables for
    /// the daemon (`NOTIFY_SOCKET`, `WATCHDOG_USEC`...) and extra arguments.
    pub fn start_with_env(config: &str, env: &[(&str, &str)], args: &[&str]) -> TargetProcess {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("target.toml");
        std::fs::write(&path, config).expect("write config");
        let mut t = Self::spawn(&path, env, args);
        t._dir = Some(dir);
        t
    }

    /// The metrics endpoint's `host:port`, from the "metrics endpoint:" log line.
    pub fn metrics_addr(&self) -> String {
        let line = self.wait_for_log("metrics endpoint: http://", Duration::from_secs(10));
        let at = line.find("http://").expect("url") + "http://".len();
        let rest = &line[at..];
        rest[..rest.find("/metrics").expect("/metrics")].to_owned()
    }

    /// Rewrites the configuration file and sends SIGHUP; waits for the
    /// reload's summary line and returns it.
    pub fn reload(&self, config: &str) -> String {
        let before = self.log().iter().filter(|l| l.contains("reload complete") || l.contains("reload failed")).count();
        std::fs::write(&self.config_path, config).expect("write config");
        self.signal(libc::SIGHUP);
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let done: Vec<String> =
                self.log().into_iter().filter(|l| l.contains("reload complete") || l.contains("reload failed")).collect();
            if done.len() > before {
                return done[before].clone();
            }
            assert!(Instant::now() < deadline, "no reload summary; log:\n{}", self.log().join("\n"));
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// A `memory` volume config block.
pub fn memory_volume(name: &str, size: u64, read_only: bool) -> String {
    format!("[[volume]]\nname = \"{name}\"\nbackend = \"memory\"\nsize = {size}\nread_only = {read_only}\n")
}

/// A `null` volume config block.
pub fn null_volume(name: &str, size: u64) -> String {
    format!("[[volume]]\nname = \"{name}\"\nbackend = \"null\"\nsize = {size}\n")
}

/// GETs `path` from `addr` (HTTP/1.1) and returns (status code, body).
pub fn http_get(addr: &str, path: &str) -> (u16, String) {
    use std::io::Write;
    let mut s = std::net::TcpStream::connect(addr).expect("connect to the metrics endpoint");
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(s, "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n").unwrap();
    let mut resp = String::new();
    s.read_to_string(&mut resp).expect("read response");
    let (head, body) = resp.split_once("\r\n\r\n").expect("HTTP head and body");
    let code = head.split_whitespace().nth(1).and_then(|c| c.parse().ok()).expect("status code");
    if let Some(len) = head.lines().find_map(|l| l.strip_prefix("Content-Length: ")) {
        assert_eq!(len.trim().parse::<usize>().unwrap(), body.len(), "Content-Length");
    }
    (code, body.to_owned())
}

/// One Prometheus sample.
#[derive(Clone, Debug, PartialEq)]
pub struct Sample {
    pub name: String,
    pub labels: std::collections::BTreeMap<String, String>,
    pub value: f64,
}

/// Parses the Prometheus text format (what a scrape returns); panics on a
/// malformed line, so a test that parses also checks the format.
pub fn parse_prometheus(text: &str) -> Vec<Sample> {
    let mut out = Vec::new();
    let mut typed = std::collections::HashSet::new();
    for line in text.lines() {
        if line.is_empty() {
            continue;
        }
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let mut p = rest.split_whitespace();
            let name = p.next().expect("TYPE name");
            let kind = p.next().expect("TYPE kind");
            assert!(["counter", "gauge", "histogram", "summary", "untyped"].contains(&kind), "{line}");
            typed.insert(name.to_owned());
            continue;
        }
        if line.starts_with('#') {
            continue;
        }
        let (series, value) = line.rsplit_once(' ').unwrap_or_else(|| panic!("no value: {line}"));
        let value: f64 = match value {
            "+Inf" => f64::INFINITY,
            "-Inf" => f64::NEG_INFINITY,
            v => v.parse().unwrap_or_else(|_| panic!("bad value: {line}")),
        };
        let (name, labels) = match series.split_once('{') {
            None => (series.to_owned(), Default::default()),
            Some((name, rest)) => {
                let body = rest.strip_suffix('}').unwrap_or_else(|| panic!("unclosed labels: {line}"));
                let mut labels = std::collections::BTreeMap::new();
                let mut chars = body.chars().peekable();
                while chars.peek().is_some() {
                    let key: String = chars.by_ref().take_while(|&c| c != '=').collect();
                    assert_eq!(chars.next(), Some('"'), "label value not quoted: {line}");
                    let mut val = String::new();
                    while let Some(c) = chars.next() {
                        match c {
                            '\\' => match chars.next() {
                                Some('n') => val.push('\n'),
                                Some(c) => val.push(c),
                                None => panic!("dangling escape: {line}"),
                            },
                            '"' => break,
                            c => val.push(c),
                        }
                    }
                    labels.insert(key.trim().to_owned(), val);
                    if chars.peek() == Some(&',') {
                        chars.next();
                    }
                }
                (name.to_owned(), labels)
            }
        };
        assert!(
            name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':'),
            "bad metric name: {line}"
        );
        let family = ["_bucket", "_sum", "_count"].iter().find_map(|s| name.strip_suffix(s)).filter(|f| typed.contains(*f));
        assert!(typed.contains(&name) || family.is_some(), "sample without # TYPE: {line}");
        out.push(Sample { name, labels, value });
    }
    out
}

/// The value of the sample `name` whose labels include every `(key, value)`.
pub fn sample(samples: &[Sample], name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    samples
        .iter()
        .find(|s| s.name == name && labels.iter().all(|(k, v)| s.labels.get(*k).map(String::as_str) == Some(*v)))
        .map(|s| s.value)
}

/// Scrapes `/metrics` from a running target and parses it.
pub fn scrape(addr: &str) -> Vec<Sample> {
    let (code, body) = http_get(addr, "/metrics");
    assert_eq!(code, 200, "{body}");
    parse_prometheus(&body)
}

/// A TCP port on the test host that nothing listens on right now, for a
/// target that must come back on the same address after a restart.
pub fn free_port() -> u16 {
    let listener = std::net::TcpListener::bind((listen_host().as_str(), 0)).expect("bind port 0");
    listener.local_addr().expect("local_addr").port()
}

/// A `[target]` section listening on a fixed `port` of the test host.
pub fn target_section_at(port: u16) -> String {
    let host = listen_host();
    let host = if host.contains(':') { format!("[{host}]") } else { host };
    format!("[target]\nlisten = [\"{}://{host}:{port}\"]\n", scheme())
}
