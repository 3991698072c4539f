//! Helpers for system tests that start the real rdmablk binaries.
//!
//! The binaries come from the same cargo target directory as the test
//! executable (`target/<profile>/`), or from `RDMABLK_BIN_DIR` when set (the
//! Soft-RoCE VM stage runs prebuilt binaries). Build them first:
//! `cargo build --workspace --bins`.

pub mod backing;
pub mod ceph;
pub mod nvme_tcp;
pub mod raw;
pub mod read_gate;
pub mod stamp;

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

    /// The NVMe/TCP listener's address, from the daemon's "listening on
    /// nvme+tcp://IP:PORT" line (a port-0 listen's real port).
    pub fn nvme_tcp_addr(&self) -> std::net::SocketAddr {
        use std::net::ToSocketAddrs;
        let line = self.wait_for_log("listening on nvme+tcp://", Duration::from_secs(10));
        let at = line.find("nvme+tcp://").unwrap() + "nvme+tcp://".len();
        let hp: String = line[at..].chars().take_while(|c| !c.is_whitespace() && *c != '"' && *c != ',').collect();
        hp.to_socket_addrs().unwrap_or_else(|e| panic!("{hp:?} from {line:?}: {e}")).next().expect("an address")
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
        if std::thread::panicking() {
            // A failed test shows what the daemon said (its last lines).
            let log = self.log.lock().unwrap_or_else(|e| e.into_inner());
            let from = log.len().saturating_sub(80);
            eprintln!("---- rdmablk-target's log ({} lines, the last {}):\n{}", log.len(), log.len() - from, log[from..].join("\n"));
        }
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
        "[[volume]]\nname = \"{name}\"\nbackend = \"file\"\npath = \"{}\"\nsize = {size}\nread_only = {read_only}\nallow_any_host = true\n",
        path.display()
    )
}

/// A legitimate initiator's verified 1 MiB write and read of volume `vol`
/// at `offset`, as host `legit-host` with two queues, through the real
/// library: what the attack tests (`limits.rs`, `pool_attack.rs`) check
/// still works while they run.
pub fn legit_io(url: &str, offset: u64) {
    use rdmablk_initiator::BlockDevice;
    let options = rdmablk_initiator::ConnectOptions { host_id: "legit-host".into(), queues: 2, ..Default::default() };
    let session = rdmablk_initiator::Session::connect(url, options).expect("the legitimate initiator connects");
    let vol = session.open("vol").expect("open");
    let mut data = vec![0u8; 1 << 20];
    rand::RngCore::fill_bytes(&mut rand::thread_rng(), &mut data);
    vol.write_at(&data, offset).expect("write");
    let mut back = vec![0u8; data.len()];
    vol.read_at(&mut back, offset).expect("read");
    assert!(back == data, "the legitimate initiator read back other bytes");
    session.close();
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
    format!("[[volume]]\nname = \"{name}\"\nbackend = \"memory\"\nsize = {size}\nread_only = {read_only}\nallow_any_host = true\n")
}

/// A `null` volume config block.
pub fn null_volume(name: &str, size: u64) -> String {
    format!("[[volume]]\nname = \"{name}\"\nbackend = \"null\"\nsize = {size}\nallow_any_host = true\n")
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

// --- model/crash helpers ---

/// Polls `condition` every 10 ms until it holds; panics naming `what` when
/// `timeout` passes first. Returns how long it took.
pub fn wait_until(what: &str, timeout: Duration, mut condition: impl FnMut() -> bool) -> Duration {
    let t0 = Instant::now();
    while !condition() {
        assert!(t0.elapsed() < timeout, "{what}: not within {timeout:?}");
        std::thread::sleep(Duration::from_millis(10));
    }
    t0.elapsed()
}

/// Threads that keep every CPU busy (two per CPU) until dropped: a race
/// whose window is a thread losing its CPU shows far more often under them.
pub struct BusyCpus {
    stop: Arc<std::sync::atomic::AtomicBool>,
    spinners: Vec<std::thread::JoinHandle<()>>,
}

impl BusyCpus {
    pub fn start() -> BusyCpus {
        use std::sync::atomic::{AtomicBool, Ordering};
        let stop = Arc::new(AtomicBool::new(false));
        let spinners = (0..2 * std::thread::available_parallelism().map_or(2, |n| n.get()))
            .map(|_| {
                let stop = Arc::clone(&stop);
                std::thread::spawn(move || {
                    while !stop.load(Ordering::Relaxed) {
                        std::hint::spin_loop();
                    }
                })
            })
            .collect();
        BusyCpus { stop, spinners }
    }
}

impl Drop for BusyCpus {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        for s in self.spinners.drain(..) {
            let _ = s.join();
        }
    }
}

impl TargetProcess {
    /// Panics with the whole log when the daemon logged a Rust panic.
    pub fn assert_no_panic(&self) {
        let log = self.log();
        assert!(
            !log.iter().any(|l| l.contains("panicked")),
            "rdmablk-target panicked; log:\n{}",
            log.join("\n")
        );
    }

    /// SIGKILLs the daemon and waits until the process is gone (reaped), so
    /// that its listening port and its file are free again.
    pub fn kill_and_wait(&mut self) {
        self.signal(libc::SIGKILL);
        let code = self.wait_exit(Duration::from_secs(10));
        assert_eq!(code, None, "a SIGKILLed daemon has no exit code");
    }
}

/// Open file descriptors of process `pid` (entries of /proc/PID/fd).
pub fn open_fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd")).expect("read /proc/PID/fd").count()
}

/// Resident set size of process `pid` in bytes (VmRSS of /proc/PID/status).
pub fn rss_bytes(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("read /proc/PID/status");
    let kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmRSS in /proc/PID/status");
    kib * 1024
}

/// Per reactor (of the first `reactors`): (pool chunks in use, commands
/// waiting for a chunk), from the daemon's metrics.
pub fn pool_use(t: &TargetProcess, reactors: usize) -> Vec<(u64, u64)> {
    let m = scrape(&t.metrics_addr());
    (0..reactors)
        .map(|r| {
            let r = r.to_string();
            let get = |name| sample(&m, name, &[("reactor", &r)]).unwrap_or_else(|| panic!("metric {name} missing")) as u64;
            (get("rdmablk_buffer_pool_chunks_in_use"), get("rdmablk_buffer_pool_waiting_commands"))
        })
        .collect()
}

/// The sum over every series of `name` (all label sets), 0 when absent.
pub fn sample_sum(samples: &[Sample], name: &str) -> f64 {
    samples.iter().filter(|s| s.name == name).map(|s| s.value).sum()
}

// --- hostile/limits helpers ---

/// The tcp provider's framing, built by hand from docs/PROTOCOL.md ("The tcp
/// provider's framing") and `common/src/fabric/tcp/wire.rs`, so that tests
/// can put on the wire what no provider would.
pub mod wire {
    /// Every frame header.
    pub const HDR_LEN: usize = 32;
    pub const HELLO: u8 = 1;
    pub const HELLO_REPLY: u8 = 2;
    pub const SEND: u8 = 3;
    pub const WRITE: u8 = 4;
    pub const READ_REQ: u8 = 5;
    pub const READ_RESP: u8 = 6;
    pub const ACK: u8 = 7;
    pub const TERMINATE: u8 = 8;
    pub const DISCONNECT: u8 = 9;
    /// Flags bit 0.
    pub const FLAG_ACK_REQUESTED: u8 = 1;
    /// "RDBK", little-endian.
    pub const MAGIC: u32 = u32::from_le_bytes(*b"RDBK");
    /// Provider wire version.
    pub const VERSION: u16 = 1;
    /// TERMINATE codes.
    pub const TERM_REMOTE_ACCESS: u32 = 1;
    pub const TERM_INVALID_REQUEST: u32 = 2;
    pub const TERM_RNR: u32 = 3;

    /// A frame header, field by field.
    #[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
    pub struct Frame {
        pub ty: u8,
        pub flags: u8,
        pub reserved: u16,
        pub seq: u32,
        pub ack: u32,
        pub length: u32,
        pub addr: u64,
        pub rkey: u32,
        pub aux: u32,
    }

    impl Frame {
        /// A header of type `ty`, every other field zero.
        pub fn new(ty: u8) -> Frame {
            Frame { ty, ..Default::default() }
        }

        /// The 32 wire bytes.
        pub fn encode(&self) -> [u8; HDR_LEN] {
            let mut b = [0u8; HDR_LEN];
            b[0] = self.ty;
            b[1] = self.flags;
            b[2..4].copy_from_slice(&self.reserved.to_le_bytes());
            b[4..8].copy_from_slice(&self.seq.to_le_bytes());
            b[8..12].copy_from_slice(&self.ack.to_le_bytes());
            b[12..16].copy_from_slice(&self.length.to_le_bytes());
            b[16..24].copy_from_slice(&self.addr.to_le_bytes());
            b[24..28].copy_from_slice(&self.rkey.to_le_bytes());
            b[28..32].copy_from_slice(&self.aux.to_le_bytes());
            b
        }

        /// Parses 32 bytes (no validation: tests look at what came).
        pub fn decode(b: &[u8; HDR_LEN]) -> Frame {
            let u32_at = |o: usize| u32::from_le_bytes([b[o], b[o + 1], b[o + 2], b[o + 3]]);
            let mut addr = [0u8; 8];
            addr.copy_from_slice(&b[16..24]);
            Frame {
                ty: b[0],
                flags: b[1],
                reserved: u16::from_le_bytes([b[2], b[3]]),
                seq: u32_at(4),
                ack: u32_at(8),
                length: u32_at(12),
                addr: u64::from_le_bytes(addr),
                rkey: u32_at(24),
                aux: u32_at(28),
            }
        }
    }

    /// A HELLO frame (header and body) with the given magic, provider
    /// version, queue sizes and private data.
    pub fn hello_with(magic: u32, version: u16, caps: [u32; 5], private: &[u8]) -> Vec<u8> {
        let body_len = 32 + private.len();
        let mut h = Frame::new(HELLO);
        h.length = body_len as u32;
        let mut out = h.encode().to_vec();
        out.extend_from_slice(&magic.to_le_bytes());
        out.extend_from_slice(&version.to_le_bytes());
        out.extend_from_slice(&(private.len() as u16).to_le_bytes());
        out.extend_from_slice(&0u32.to_le_bytes());
        for c in caps {
            out.extend_from_slice(&c.to_le_bytes());
        }
        out.extend_from_slice(private);
        out
    }

    /// A well-formed HELLO: 64 send and receive work requests, one SGE each.
    pub fn hello() -> Vec<u8> {
        hello_with(MAGIC, VERSION, [64, 64, 1, 1, 0], &[])
    }
}

/// What a [`WireConn`] saw while waiting.
#[derive(Debug)]
pub enum WireEvent {
    /// A response capsule and its reply data.
    Response(rdmablk_common::protocol::ResponseCapsule, Vec<u8>),
    /// The daemon sent TERMINATE with this error code, naming our frame `seq`.
    Terminated { code: u32, seq: u32 },
    /// The daemon sent DISCONNECT, closed the stream or reset it.
    Closed(String),
    /// Nothing within the timeout.
    Silence,
}

/// A hand-driven tcp:// connection: a minimal software NIC in the test, over
/// a plain `TcpStream`. It sends frames exactly as told, acknowledges the
/// daemon's SENDs, and plays the initiator's memory for the daemon's RDMA
/// READ and WRITE (one region, `mem`, with rkey `mem_rkey` at `mem_addr`).
pub struct WireConn {
    pub stream: std::net::TcpStream,
    /// This end's address as the daemon logs it (`127.0.0.1:PORT`).
    pub peer: String,
    next_seq: u32,
    /// Highest daemon sequence number processed (our cumulative ack).
    rx_processed: u32,
    pub mem: Vec<u8>,
    pub mem_addr: u64,
    pub mem_rkey: u32,
    /// Answer the daemon's RDMA READs at once (else they wait in `read_reqs`).
    pub serve_reads: bool,
    /// READ_REQ frames not answered yet.
    pub read_reqs: std::collections::VecDeque<wire::Frame>,
    events: std::collections::VecDeque<WireEvent>,
    next_cid: u16,
    /// This end refused one of the daemon's requests (as a NIC's queue pair
    /// in the error state, it executes and acknowledges nothing more).
    faulted: bool,
}

/// A TCP connection to the daemon at `url` (IPv4) from the local address
/// `source`, bound before it connects.
pub fn tcp_from(url: &str, source: std::net::Ipv4Addr) -> std::net::TcpStream {
    let dest = socket_addr_of(url);
    try_tcp_from(dest, source).unwrap_or_else(|e| panic!("connect from {source} to {dest}: {e}"))
}

/// A TCP connection to `dest` (IPv4) from the local address `source` (any
/// of 127/8 on loopback), bound before it connects; the error of bind(2)
/// or connect(2) when either fails.
pub fn try_tcp_from(dest: std::net::SocketAddr, source: std::net::Ipv4Addr) -> std::io::Result<std::net::TcpStream> {
    try_tcp_from_within(dest, source, None)
}

/// [`try_tcp_from`] that gives up (`TimedOut`) when the connection is not
/// established within `timeout`: a listener whose accept queue is full
/// drops SYNs, and the kernel retries them only after 1, 3, 7... s.
pub fn try_tcp_from_within(
    dest: std::net::SocketAddr,
    source: std::net::Ipv4Addr,
    timeout: Option<Duration>,
) -> std::io::Result<std::net::TcpStream> {
    use std::os::fd::FromRawFd;
    let std::net::SocketAddr::V4(dest) = dest else { panic!("{dest}: an IPv4 address is needed") };
    let sockaddr = |ip: std::net::Ipv4Addr, port: u16| libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: port.to_be(),
        sin_addr: libc::in_addr { s_addr: u32::from(ip).to_be() },
        sin_zero: [0; 8],
    };
    let len = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
    // SAFETY: socket(2) takes plain integers; a valid descriptor it returns
    // is owned by the TcpStream from here on (closed on drop).
    let stream = unsafe {
        let fd = libc::socket(libc::AF_INET, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0);
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        std::net::TcpStream::from_raw_fd(fd)
    };
    let fd = std::os::fd::AsRawFd::as_raw_fd(&stream);
    let (src, dst) = (sockaddr(source, 0), sockaddr(*dest.ip(), dest.port()));
    // SAFETY: the addresses are live sockaddr_in values of `len` bytes, and
    // `fd` is the stream's open socket.
    if unsafe { libc::bind(fd, (&src as *const libc::sockaddr_in).cast(), len) } != 0 {
        let e = std::io::Error::last_os_error();
        return Err(std::io::Error::new(e.kind(), format!("bind to {source}: {e}")));
    }
    let Some(timeout) = timeout else {
        // SAFETY: as above.
        if unsafe { libc::connect(fd, (&dst as *const libc::sockaddr_in).cast(), len) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        stream.set_nodelay(true)?;
        return Ok(stream);
    };
    stream.set_nonblocking(true)?;
    // SAFETY: as above.
    if unsafe { libc::connect(fd, (&dst as *const libc::sockaddr_in).cast(), len) } != 0 {
        let e = std::io::Error::last_os_error();
        if e.raw_os_error() != Some(libc::EINPROGRESS) {
            return Err(e);
        }
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let mut pfd = libc::pollfd { fd, events: libc::POLLOUT, revents: 0 };
            // SAFETY: one live pollfd.
            let n = unsafe { libc::poll(&mut pfd, 1, left.as_millis().min(i32::MAX as u128) as i32) };
            if n > 0 {
                break;
            }
            if n < 0 && std::io::Error::last_os_error().kind() != std::io::ErrorKind::Interrupted {
                return Err(std::io::Error::last_os_error());
            }
            if n == 0 && Instant::now() >= deadline {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!("TCP connect from {source} to {dest} not established within {timeout:?}"),
                ));
            }
        }
        if let Some(e) = stream.take_error()? {
            return Err(e);
        }
    }
    stream.set_nonblocking(false)?;
    stream.set_nodelay(true)?;
    Ok(stream)
}

/// The address `tcp://host:port` names.
pub fn socket_addr_of(url: &str) -> std::net::SocketAddr {
    use std::net::ToSocketAddrs;
    let hp = url.split("://").nth(1).expect("scheme://host:port");
    hp.to_socket_addrs().expect("resolve").next().expect("an address")
}

impl WireConn {
    /// A TCP connection to the daemon, nothing sent.
    pub fn tcp(url: &str) -> std::net::TcpStream {
        let s = std::net::TcpStream::connect(socket_addr_of(url)).expect("TCP connect to the daemon");
        s.set_nodelay(true).unwrap();
        s
    }

    /// A TCP connection with nothing sent yet, wrapped (for framing attacks
    /// that start before the HELLO).
    pub fn raw(url: &str) -> WireConn {
        Self::on_stream(Self::tcp(url))
    }

    /// A TCP connection from the local address `source` (any of 127/8 on
    /// loopback), nothing sent: another peer as the daemon sees it.
    pub fn raw_from(url: &str, source: std::net::Ipv4Addr) -> WireConn {
        Self::on_stream(tcp_from(url, source))
    }

    fn on_stream(stream: std::net::TcpStream) -> WireConn {
        let peer = stream.local_addr().unwrap().to_string();
        WireConn {
            stream,
            peer,
            next_seq: 1,
            rx_processed: 0,
            mem: vec![0; 1 << 20],
            mem_addr: 0x7f00_0000_0000,
            mem_rkey: 0x1234_5678,
            serve_reads: true,
            read_reqs: Default::default(),
            events: Default::default(),
            next_cid: 1,
            faulted: false,
        }
    }

    /// Connects and completes the HELLO exchange; panics on a reject.
    pub fn hello(url: &str) -> WireConn {
        let mut c = Self::raw(url);
        c.send(&wire::hello());
        let (h, body) = c.read_frame(std::time::Duration::from_secs(10)).expect("HELLO_REPLY");
        assert_eq!(h.ty, wire::HELLO_REPLY, "expected HELLO_REPLY, got {h:?}");
        let status = u32::from_le_bytes(body[8..12].try_into().unwrap());
        assert_eq!(status, 0, "the daemon rejected the HELLO: {:?}", String::from_utf8_lossy(&body[32..]));
        c
    }

    /// Writes bytes as they are.
    pub fn send(&mut self, bytes: &[u8]) {
        use std::io::Write;
        self.stream.write_all(bytes).expect("write to the daemon");
    }

    /// Sends one frame (its ack field set to ours unless `keep_ack`) and payload.
    pub fn send_frame(&mut self, mut h: wire::Frame, payload: &[u8], keep_ack: bool) {
        if !keep_ack {
            h.ack = self.rx_processed;
        }
        let mut out = h.encode().to_vec();
        out.extend_from_slice(payload);
        self.send(&out);
    }

    /// The sequence number the next work-request frame must carry.
    pub fn take_seq(&mut self) -> u32 {
        let s = self.next_seq;
        self.next_seq = self.next_seq.wrapping_add(1).max(1);
        s
    }

    /// Sends `bytes` as one SEND (a capsule and its inline data).
    pub fn send_message(&mut self, bytes: &[u8]) {
        let seq = self.take_seq();
        let h = wire::Frame { ty: wire::SEND, flags: wire::FLAG_ACK_REQUESTED, seq, length: bytes.len() as u32, ..Default::default() };
        self.send_frame(h, bytes, false);
    }

    /// Sends a capsule (a fresh command id unless it has one) and inline
    /// data as one SEND; returns the command id.
    pub fn post(&mut self, mut c: rdmablk_common::protocol::CommandCapsule, inline: &[u8]) -> rdmablk_common::protocol::CommandId {
        if c.command_id.0 == 0 {
            c.command_id = rdmablk_common::protocol::CommandId(self.next_cid);
            self.next_cid = self.next_cid.wrapping_add(1).max(1);
        }
        c.inline_len = inline.len() as u32;
        let mut msg = c.to_bytes().to_vec();
        msg.extend_from_slice(inline);
        self.send_message(&msg);
        c.command_id
    }

    /// Sends a capsule and waits for its response; panics on anything else.
    pub fn command(
        &mut self,
        c: rdmablk_common::protocol::CommandCapsule,
        inline: &[u8],
    ) -> (rdmablk_common::protocol::ResponseCapsule, Vec<u8>) {
        let id = self.post(c, inline);
        match self.next_event(std::time::Duration::from_secs(10)) {
            WireEvent::Response(r, d) if r.command_id == id => (r, d),
            other => panic!("expected the response to command {}, got {other:?}", id.0),
        }
    }

    /// A valid CONNECT for `host` (protocol v1, queue depth `depth`).
    pub fn connect(&mut self, host: &str, depth: u32) -> rdmablk_common::protocol::ConnectReply {
        use rdmablk_common::protocol::*;
        let mut c = CommandCapsule::new(Opcode::Connect, CommandId(0));
        c.version = PROTOCOL_VERSION;
        c.queue_depth = depth;
        c.max_io_size = 1 << 20;
        let (r, data) = self.command(c, host.as_bytes());
        assert_eq!(r.status, Status::Success, "CONNECT: {r:?}");
        ConnectReply::decode(&data).expect("connect reply")
    }

    /// OPENs `name`; returns the volume info.
    pub fn open_volume(&mut self, name: &str) -> rdmablk_common::protocol::VolumeInfo {
        use rdmablk_common::protocol::*;
        let (r, data) = self.command(CommandCapsule::new(Opcode::OpenVolume, CommandId(0)), name.as_bytes());
        assert_eq!(r.status, Status::Success, "OPEN {name}: {r:?}");
        VolumeInfo::decode(&data).expect("volume info")
    }

    /// A descriptor for `[offset, offset + len)` of `mem`.
    pub fn descriptor(&self, offset: u64, len: u32) -> rdmablk_common::protocol::DataDescriptor {
        rdmablk_common::protocol::DataDescriptor { remote_addr: self.mem_addr + offset, length: len, rkey: self.mem_rkey }
    }

    /// The next event: a response, a TERMINATE, the end of the stream, or
    /// silence for `timeout`. Serves the daemon's RDMA operations meanwhile.
    pub fn next_event(&mut self, timeout: std::time::Duration) -> WireEvent {
        let deadline = std::time::Instant::now() + timeout;
        loop {
            if let Some(e) = self.events.pop_front() {
                return e;
            }
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() {
                return WireEvent::Silence;
            }
            match self.read_frame(left) {
                Ok((h, payload)) => self.on_frame(h, payload),
                Err(e) if e == "timeout" => return WireEvent::Silence,
                Err(e) => return WireEvent::Closed(e),
            }
        }
    }

    /// Reads frames until the daemon closes the stream; true if it did
    /// within `timeout` (a TERMINATE or responses before it are fine).
    pub fn wait_closed(&mut self, timeout: std::time::Duration) -> bool {
        let deadline = std::time::Instant::now() + timeout;
        loop {
            match self.next_event(deadline.saturating_duration_since(std::time::Instant::now())) {
                WireEvent::Closed(_) => return true,
                WireEvent::Silence => return false,
                _ => {}
            }
        }
    }

    fn on_frame(&mut self, h: wire::Frame, payload: Vec<u8>) {
        if self.faulted && !matches!(h.ty, wire::TERMINATE | wire::DISCONNECT) {
            return;
        }
        match h.ty {
            wire::SEND => {
                self.rx_processed = h.seq;
                match rdmablk_common::protocol::ResponseCapsule::decode(&payload) {
                    Ok(r) => self.events.push_back(WireEvent::Response(r, payload[32..].to_vec())),
                    Err(e) => self.events.push_back(WireEvent::Closed(format!("undecodable response: {e}"))),
                }
                if h.flags & wire::FLAG_ACK_REQUESTED != 0 {
                    self.send_frame(wire::Frame::new(wire::ACK), &[], false);
                }
            }
            wire::WRITE => {
                let off = h.addr.wrapping_sub(self.mem_addr);
                if h.rkey == self.mem_rkey && off.checked_add(h.length as u64).is_some_and(|end| end <= self.mem.len() as u64) {
                    self.mem[off as usize..off as usize + payload.len()].copy_from_slice(&payload);
                    self.rx_processed = h.seq;
                    if h.flags & wire::FLAG_ACK_REQUESTED != 0 {
                        self.send_frame(wire::Frame::new(wire::ACK), &[], false);
                    }
                } else {
                    self.refuse_remote_access(h.seq);
                }
            }
            wire::READ_REQ if self.serve_reads => self.serve_read(h),
            wire::READ_REQ => self.read_reqs.push_back(h),
            wire::TERMINATE => self.events.push_back(WireEvent::Terminated { code: h.aux, seq: h.seq }),
            wire::DISCONNECT => self.events.push_back(WireEvent::Closed("DISCONNECT".into())),
            _ => {}
        }
    }

    /// Answers one RDMA READ of the daemon from `mem` (TERMINATE with
    /// REMOTE_ACCESS when it names anything else, as a NIC would).
    pub fn serve_read(&mut self, h: wire::Frame) {
        let off = h.addr.wrapping_sub(self.mem_addr);
        if h.rkey == self.mem_rkey && off.checked_add(h.aux as u64).is_some_and(|end| end <= self.mem.len() as u64) {
            let data = self.mem[off as usize..off as usize + h.aux as usize].to_vec();
            self.rx_processed = h.seq;
            let r = wire::Frame { ty: wire::READ_RESP, length: h.aux, aux: h.seq, ..Default::default() };
            self.send_frame(r, &data, false);
        } else {
            self.refuse_remote_access(h.seq);
        }
    }

    /// Refuses the daemon's request `seq` as a NIC does a bad rkey or range:
    /// TERMINATE naming it, never acknowledged, nothing executed after it.
    fn refuse_remote_access(&mut self, seq: u32) {
        self.faulted = true;
        let t = wire::Frame { ty: wire::TERMINATE, seq, aux: wire::TERM_REMOTE_ACCESS, ..Default::default() };
        self.send_frame(t, &[], false);
    }

    /// Reads one frame: Err("timeout"), or Err(why) when the stream ended.
    pub fn read_frame(&mut self, timeout: std::time::Duration) -> std::result::Result<(wire::Frame, Vec<u8>), String> {
        let mut hdr = [0u8; wire::HDR_LEN];
        self.read_exact_within(&mut hdr, timeout)?;
        let h = wire::Frame::decode(&hdr);
        assert!(h.length <= 16 << 20, "the daemon sent a {}-byte frame", h.length);
        let mut payload = vec![0u8; h.length as usize];
        self.read_exact_within(&mut payload, std::time::Duration::from_secs(10))?;
        Ok((h, payload))
    }

    fn read_exact_within(&mut self, buf: &mut [u8], timeout: std::time::Duration) -> std::result::Result<(), String> {
        use std::io::Read;
        let deadline = std::time::Instant::now() + timeout;
        let mut got = 0;
        while got < buf.len() {
            let left = deadline.saturating_duration_since(std::time::Instant::now()).max(Duration::from_millis(1));
            self.stream.set_read_timeout(Some(left)).unwrap();
            match self.stream.read(&mut buf[got..]) {
                Ok(0) => return Err("EOF".into()),
                Ok(n) => got += n,
                Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {
                    if std::time::Instant::now() >= deadline {
                        if got == 0 {
                            return Err("timeout".into());
                        }
                        return Err(format!("timeout after {got} of {} bytes", buf.len()));
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e.to_string()),
            }
        }
        Ok(())
    }
}

impl TargetProcess {
    /// Waits until one log line contains every needle; returns it.
    pub fn wait_for_log_all(&self, needles: &[&str], timeout: Duration) -> String {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(l) = self.log.lock().unwrap().iter().find(|l| needles.iter().all(|n| l.contains(n))) {
                return l.clone();
            }
            assert!(
                Instant::now() < deadline,
                "no log line containing all of {needles:?}; log:\n{}",
                self.log().join("\n")
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// How many log lines contain `needle`.
    pub fn count_log(&self, needle: &str) -> usize {
        self.log.lock().unwrap().iter().filter(|l| l.contains(needle)).count()
    }
}

/// The soft RLIMIT_NOFILE of this process, from /proc/self/limits.
pub fn nofile_limit() -> u64 {
    let text = std::fs::read_to_string("/proc/self/limits").expect("read /proc/self/limits");
    let line = text.lines().find(|l| l.starts_with("Max open files")).expect("Max open files line");
    let soft = line["Max open files".len()..].split_whitespace().next().expect("soft limit");
    if soft == "unlimited" {
        u64::MAX
    } else {
        soft.parse().expect("a number")
    }
}

/// FNV-1a of bytes, the same digest [`file_digest`] computes of a file.
pub fn bytes_digest(data: &[u8]) -> u64 {
    data.iter().fold(0xcbf29ce484222325u64, |h, &b| (h ^ b as u64).wrapping_mul(0x100000001b3))
}

/// A target on a fixed port of the test host with one file volume, `vol0`,
/// that can be stopped and started again on the same config, port and
/// backing file (failover tests).
pub struct RestartableTarget {
    _dir: tempfile::TempDir,
    config: PathBuf,
    image: PathBuf,
    target: Option<TargetProcess>,
}

impl RestartableTarget {
    /// Starts it; `extra` goes into `[target]` (lines ending in a newline).
    pub fn start(extra: &str, volume_size: u64) -> RestartableTarget {
        let dir = tempfile::tempdir().expect("tempdir");
        let image = sparse_file(dir.path(), "vol0.img", volume_size);
        let config = dir.path().join("target.toml");
        let text = format!("{}{extra}{}", target_section_at(free_port()), file_volume("vol0", &image, volume_size, false));
        std::fs::write(&config, text).expect("write config");
        let target = Some(TargetProcess::start_with_path(&config));
        RestartableTarget { _dir: dir, config, image, target }
    }

    /// The running daemon.
    pub fn target(&self) -> &TargetProcess {
        self.target.as_ref().expect("running")
    }

    /// Its URL (the same after a restart).
    pub fn url(&self) -> String {
        self.target().url.clone()
    }

    /// The backing file of `vol0`.
    pub fn image(&self) -> &Path {
        &self.image
    }

    /// Sends `sig` and waits for the process to be gone.
    pub fn stop(&mut self, sig: i32) {
        let mut t = self.target.take().expect("running");
        t.signal(sig);
        t.wait_exit(Duration::from_secs(30));
    }

    /// SIGKILLs it and waits until it is reaped.
    pub fn kill(&mut self) {
        let mut t = self.target.take().expect("running");
        t.kill_and_wait();
    }

    /// Starts it again on the same config.
    pub fn restart(&mut self) {
        assert!(self.target.is_none(), "still running");
        self.target = Some(TargetProcess::start_with_path(&self.config));
    }
}

/// The names (`comm`) of every thread of process `pid` (/proc/PID/task).
pub fn thread_names(pid: u32) -> Vec<String> {
    let mut names = Vec::new();
    for entry in std::fs::read_dir(format!("/proc/{pid}/task")).expect("read /proc/PID/task") {
        let Ok(entry) = entry else { continue };
        // A thread may end between the listing and the read.
        if let Ok(comm) = std::fs::read_to_string(entry.path().join("comm")) {
            names.push(comm.trim_end().to_owned());
        }
    }
    names
}

/// Raises this process's soft RLIMIT_NOFILE to `want` (at most the hard
/// limit); returns the soft limit in force afterwards.
pub fn raise_nofile_limit(want: u64) -> u64 {
    let mut rl = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit and setrlimit read and write the one rlimit value.
    unsafe {
        assert_eq!(libc::getrlimit(libc::RLIMIT_NOFILE, &mut rl), 0, "getrlimit: {}", std::io::Error::last_os_error());
        if rl.rlim_cur < want {
            let new = libc::rlimit { rlim_cur: want.min(rl.rlim_max), rlim_max: rl.rlim_max };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &new) == 0 {
                rl.rlim_cur = new.rlim_cur;
            }
        }
    }
    rl.rlim_cur
}
