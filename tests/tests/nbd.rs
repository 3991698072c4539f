//! `rdmablk nbd` end to end: the real `rdmablk-target`, the real `rdmablk nbd`
//! process, and real NBD clients from Debian (libnbd-bin: nbdinfo, nbdcopy,
//! nbdfuse; qemu-utils: qemu-io, qemu-img; fio's nbd engine), plus a raw
//! client for what no real client sends. Every check ends with the backing
//! file's bytes.
//!
//! A test whose tool is missing says so and passes (`scripts/test.sh`
//! installs them: libnbd-bin, qemu-utils, fio).

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rand::{RngCore, SeedableRng};
use rdmablk_initiator::nbd::wire::{
    self, Command as Cmd, InfoRequest, OptionHeader, OptionReply, Request, SimpleReply,
};
use rdmablk_system_tests::{bin, file_bytes, file_volume, sparse_file, target_section, TargetProcess};

const MIB: u64 = 1 << 20;
const SIZE: u64 = 64 * MIB;
/// The volume `big`: nbdcopy's image.
const BIG: u64 = 256 * MIB;

/// The path of `tool`, or None after saying that the test is skipped.
fn need(tool: &str, package: &str) -> bool {
    let found =
        std::env::var_os("PATH").map(|p| std::env::split_paths(&p).any(|d| d.join(tool).is_file())).unwrap_or(false);
    if !found {
        eprintln!("skipping: {tool} is not installed (apt-get install {package}; scripts/test.sh does)");
    }
    found
}

/// A target with a 64 MiB file volume `vol0`, a 256 MiB file volume `big`,
/// a read-only memory volume `ro` and (for FUSE) a 128 MiB file volume
/// `v512` with 512-byte blocks. The files are sparse until written.
struct Setup {
    dir: tempfile::TempDir,
    img: PathBuf,
    big: PathBuf,
    target: TargetProcess,
}

fn setup() -> Setup {
    let dir = tempfile::tempdir().unwrap();
    let img = sparse_file(dir.path(), "vol0.img", SIZE);
    let big = sparse_file(dir.path(), "big.img", BIG);
    let img512 = sparse_file(dir.path(), "v512.img", 128 * MIB);
    let config = format!(
        "{}\n{}\n{}\n[[volume]]\nname = \"ro\"\nbackend = \"memory\"\nsize = \"16MiB\"\nread_only = true\nallow_any_host = true\n\n{}block_size = 512\n",
        target_section(),
        file_volume("vol0", &img, SIZE, false),
        file_volume("big", &big, BIG, false),
        file_volume("v512", &img512, 128 * MIB, false),
    );
    let target = TargetProcess::start(&config);
    Setup { dir, img, big, target }
}

/// A running `rdmablk nbd` process on a unix socket.
struct NbdProcess {
    child: Child,
    uri: String,
    socket: PathBuf,
    log: Arc<Mutex<Vec<String>>>,
}

impl NbdProcess {
    fn start(target: &TargetProcess, volume: &str, socket: &Path) -> NbdProcess {
        NbdProcess::start_with(target, volume, socket, &[])
    }

    /// `start` with `extra` arguments after the socket.
    fn start_with(target: &TargetProcess, volume: &str, socket: &Path, extra: &[&str]) -> NbdProcess {
        let mut nbd = NbdProcess::spawn(target, volume, &["--socket".as_ref(), socket.as_os_str()], extra);
        assert_eq!(nbd.uri, format!("nbd+unix:///{volume}?socket={}", socket.display()));
        nbd.socket = socket.to_owned();
        nbd
    }

    /// `start` on a TCP port of 127.0.0.1 (`socket` is empty); the address.
    fn start_tcp(target: &TargetProcess, volume: &str) -> (NbdProcess, SocketAddr) {
        let nbd = NbdProcess::spawn(target, volume, &["--listen".as_ref(), "127.0.0.1:0".as_ref()], &[]);
        let addr = nbd.uri.strip_prefix("nbd://").and_then(|u| u.strip_suffix(&format!("/{volume}"))).map(str::parse);
        let Some(Ok(addr)) = addr else { panic!("not an nbd:// URI of {volume}: {}", nbd.uri) };
        (nbd, addr)
    }

    /// Starts `rdmablk nbd VOLUME` with `listen` (the address options) and
    /// `extra`; waits for the URI it prints.
    fn spawn(target: &TargetProcess, volume: &str, listen: &[&std::ffi::OsStr], extra: &[&str]) -> NbdProcess {
        let mut child = Command::new(bin("rdmablk"))
            .args(["--target", &target.url, "nbd", volume])
            .args(listen)
            .args(extra)
            .env("RDMABLK_LOG", "info")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn rdmablk nbd");
        let log = Arc::new(Mutex::new(Vec::new()));
        let sink = Arc::clone(&log);
        let stderr = child.stderr.take().unwrap();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                if std::env::var_os("RDMABLK_TEST_ECHO").is_some() {
                    eprintln!("[nbd] {line}");
                }
                sink.lock().unwrap().push(line);
            }
        });
        let (tx, rx) = std::sync::mpsc::channel();
        let stdout = child.stdout.take().unwrap();
        std::thread::spawn(move || {
            let mut lines = BufReader::new(stdout).lines();
            if let Some(Ok(line)) = lines.next() {
                let _ = tx.send(line);
            }
            for _ in lines {}
        });
        let uri = match rx.recv_timeout(Duration::from_secs(30)) {
            Ok(uri) => uri,
            Err(_) => {
                let _ = child.kill();
                panic!("rdmablk nbd printed no URI; log:\n{}", log.lock().unwrap().join("\n"));
            }
        };
        NbdProcess { child, uri, socket: PathBuf::new(), log }
    }

    fn log(&self) -> String {
        self.log.lock().unwrap().join("\n")
    }

    fn wait_for_log(&self, needle: &str) -> String {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Some(l) = self.log.lock().unwrap().iter().find(|l| l.contains(needle)) {
                return l.clone();
            }
            assert!(Instant::now() < deadline, "no log line containing {needle:?}; log:\n{}", self.log());
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// SIGTERM, then the exit code.
    fn stop(mut self) -> (Option<i32>, String) {
        if self.child.try_wait().unwrap().is_none() {
            // SAFETY: kill(2) takes plain integers; the pid is our own child.
            unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        }
        self.wait()
    }

    /// Waits (up to 30 s) for the process to exit, sending nothing; the
    /// exit code and the log.
    fn wait(mut self) -> (Option<i32>, String) {
        let deadline = Instant::now() + Duration::from_secs(30);
        let status = loop {
            if let Some(s) = self.child.try_wait().unwrap() {
                break s;
            }
            assert!(Instant::now() < deadline, "rdmablk nbd did not exit after SIGTERM; log:\n{}", self.log());
            std::thread::sleep(Duration::from_millis(20));
        };
        std::thread::sleep(Duration::from_millis(100));
        let log = self.log();
        assert!(!log.contains("panicked"), "rdmablk nbd panicked:\n{log}");
        (status.code(), log)
    }
}

impl Drop for NbdProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn run(cmd: &mut Command) -> std::process::Output {
    let out = cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?} failed ({}):\n{}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// `len` pseudo-random bytes from `seed`, also written to `path`. SplitMix64,
/// not `StdRng`: unoptimised test builds fill nbdcopy's 256 MiB in about a
/// second with it, where ChaCha took over 20.
fn random_file(path: &Path, len: usize, seed: u64) -> Vec<u8> {
    let mut data = vec![0u8; len];
    let mut state = seed;
    for word in data.chunks_mut(8) {
        state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^= z >> 31;
        word.copy_from_slice(&z.to_le_bytes()[..word.len()]);
    }
    std::fs::write(path, &data).unwrap();
    data
}

// ------------------------------------------------------------------ raw client

/// A minimal NBD client for what real clients never send, on a unix
/// socket or (`Raw<TcpStream>`) over TCP.
struct Raw<S = UnixStream> {
    s: S,
}

impl Raw {
    /// Connects and reads the greeting; sends fixed newstyle + no zeroes.
    fn connect(socket: &Path) -> Raw {
        let s = UnixStream::connect(socket).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        Raw::greeted(s)
    }
}

impl Raw<TcpStream> {
    /// `connect` over TCP.
    fn connect_tcp(addr: SocketAddr) -> Raw<TcpStream> {
        let s = TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        s.set_nodelay(true).unwrap();
        Raw::greeted(s)
    }
}

impl<S: Read + Write> Raw<S> {
    /// Reads the greeting on `s`; sends fixed newstyle + no zeroes.
    fn greeted(s: S) -> Raw<S> {
        let mut r = Raw { s };
        let mut g = [0u8; wire::Greeting::SIZE];
        r.s.read_exact(&mut g).unwrap();
        let greeting = wire::Greeting::decode(&g).unwrap();
        assert_eq!(greeting.flags, wire::FLAG_FIXED_NEWSTYLE | wire::FLAG_NO_ZEROES);
        r.s.write_all(&(wire::FLAG_C_FIXED_NEWSTYLE | wire::FLAG_C_NO_ZEROES).to_be_bytes()).unwrap();
        r
    }

    fn option(&mut self, option: u32, data: &[u8]) {
        self.s.write_all(&OptionHeader { option, length: data.len() as u32 }.encode()).unwrap();
        self.s.write_all(data).unwrap();
    }

    fn option_reply(&mut self) -> (OptionReply, Vec<u8>) {
        let mut h = [0u8; OptionReply::SIZE];
        self.s.read_exact(&mut h).unwrap();
        let r = OptionReply::decode(&h).unwrap();
        let mut data = vec![0u8; r.length as usize];
        self.s.read_exact(&mut data).unwrap();
        (r, data)
    }

    /// NBD_OPT_GO for `name`; returns the export's size and flags and the block sizes.
    fn go(&mut self, name: &str) -> (wire::ExportInfo, wire::BlockSizes) {
        let req = InfoRequest { name: name.as_bytes().to_vec(), requests: vec![wire::INFO_BLOCK_SIZE] };
        self.option(wire::OPT_GO, &req.encode());
        let (mut info, mut sizes) = (None, None);
        loop {
            let (r, data) = self.option_reply();
            assert!(!r.is_error(), "NBD_OPT_GO {name:?} failed: {:#x} {}", r.reply, String::from_utf8_lossy(&data));
            match r.reply {
                wire::REP_INFO => {
                    info = info.or(wire::ExportInfo::decode_info(&data));
                    sizes = sizes.or(wire::BlockSizes::decode_info(&data));
                }
                wire::REP_ACK => break,
                other => panic!("unexpected reply {other:#x}"),
            }
        }
        (info.expect("NBD_INFO_EXPORT"), sizes.expect("NBD_INFO_BLOCK_SIZE"))
    }

    fn request(&mut self, command: Cmd, flags: u16, cookie: u64, offset: u64, length: u32, payload: &[u8]) {
        let r = Request { flags, command, cookie, offset, length };
        self.s.write_all(&[&r.encode()[..], payload].concat()).unwrap();
    }

    fn reply(&mut self) -> SimpleReply {
        let mut h = [0u8; SimpleReply::SIZE];
        self.s.read_exact(&mut h).unwrap();
        SimpleReply::decode(&h).unwrap()
    }

    /// One request, its reply's error (and a READ's data).
    fn call(&mut self, command: Cmd, flags: u16, offset: u64, length: u32, payload: &[u8]) -> (u32, Vec<u8>) {
        self.request(command, flags, 7, offset, length, payload);
        let r = self.reply();
        assert_eq!(r.cookie, 7);
        let mut data = Vec::new();
        if command == Cmd::Read && r.error == 0 {
            data = vec![0u8; length as usize];
            self.s.read_exact(&mut data).unwrap();
        }
        (r.error, data)
    }

    /// True once the server closed the connection (anything it sends
    /// first is read and dropped); false if it stays open for 20 s.
    fn closed(&mut self) -> bool {
        let mut b = [0u8; 4096];
        loop {
            match self.s.read(&mut b) {
                Ok(0) => return true,
                Ok(_) => continue,
                Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return true,
                Err(_) => return false,
            }
        }
    }
}

// ------------------------------------------------------------------ tests

#[test]
fn nbdinfo_shows_size_block_sizes_and_flags() {
    if !need("nbdinfo", "libnbd-bin") {
        return;
    }
    let s = setup();
    let nbd = NbdProcess::start(&s.target, "vol0", &s.dir.path().join("vol0.sock"));
    let out = run(Command::new("nbdinfo").args(["--json", &nbd.uri]));
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let e = &json["exports"][0];
    assert_eq!(json["protocol"], "newstyle-fixed");
    assert_eq!(e["export-name"], "vol0");
    assert_eq!(e["export-size"], SIZE);
    assert_eq!((e["block_size_minimum"].as_u64(), e["block_size_preferred"].as_u64()), (Some(4096), Some(4096)));
    assert_eq!(e["block_size_maximum"], 1 << 20);
    for (key, want) in [
        ("is_read_only", false),
        ("can_flush", true),
        ("can_fua", true),
        ("can_trim", true),
        ("can_zero", true),
        ("can_multi_conn", true),
        ("can_df", false),
        ("can_cache", false),
    ] {
        assert_eq!(e[key], want, "{key} in {e}");
    }
    // The default name selects the volume too, and NBD_OPT_LIST names it.
    let default = nbd.uri.replace("///vol0?", "///?");
    let out = run(Command::new("nbdinfo").args(["--size", &default]));
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), SIZE.to_string());
    let out = run(Command::new("nbdinfo").args(["--list", "--json", &nbd.uri]));
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(json["exports"].as_array().map(Vec::len), Some(1));
    assert_eq!(json["exports"][0]["export-name"], "vol0");

    // A read-only volume says so, and offers no trim, zero or FUA.
    let ro = NbdProcess::start(&s.target, "ro", &s.dir.path().join("ro.sock"));
    let out = run(Command::new("nbdinfo").args(["--json", &ro.uri]));
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let e = &json["exports"][0];
    assert_eq!((&e["is_read_only"], &e["can_trim"], &e["can_zero"]), (&true.into(), &false.into(), &false.into()));
    assert_eq!(nbd.stop().0, Some(0));
    assert_eq!(ro.stop().0, Some(0));
}

#[test]
fn nbdcopy_in_and_out_is_byte_identical_with_the_backing_file() {
    if !need("nbdcopy", "libnbd-bin") {
        return;
    }
    let s = setup();
    // A 256 MiB random image through the 256 MiB volume `big`.
    let nbd = NbdProcess::start(&s.target, "big", &s.dir.path().join("big.sock"));
    let input = s.dir.path().join("input.img");
    let data = random_file(&input, BIG as usize, 19);
    // nbdcopy opens several connections (the export allows multi-conn),
    // each with its own IoQueue, each with requests in flight.
    run(Command::new("nbdcopy").args(["--flush", "--requests=16"]).arg(&input).arg(&nbd.uri));
    assert!(std::fs::read(&s.big).unwrap() == data, "the backing file differs from what nbdcopy wrote");
    let output = s.dir.path().join("output.img");
    run(Command::new("nbdcopy").arg(&nbd.uri).arg(&output));
    assert!(std::fs::read(&output).unwrap() == data, "nbdcopy read back other bytes");
    let connections = nbd.log().matches("NBD_OPT_GO: serving").count();
    assert!(connections >= 3, "nbdcopy made {connections} connections; log:\n{}", nbd.log());
    if need("qemu-img", "qemu-utils") {
        run(Command::new("qemu-img").args(["compare", "-f", "raw", "-F", "raw"]).arg(&input).arg(&nbd.uri));
    }
    let (code, log) = nbd.stop();
    assert_eq!(code, Some(0), "{log}");
    assert!(!log.contains("WARN"), "a clean copy logged warnings:\n{log}");
}

/// fio's job file for the verify test: two jobs, one NBD connection each,
/// 32 MiB of 4 KiB random writes at offset 0 and 32 MiB of random writes
/// of 4 KiB to 128 KiB at offset 32 MiB, 32 in flight, each block written
/// once (fio's random map) with a crc32c verify header, then read back and
/// checked (and no verify state file left in the working directory when
/// that fails). `target` is the ioengine's lines (`ioengine=nbd` and
/// `uri=`, or `ioengine=psync` and `filename=` with `verify_only=1`).
fn fio_verify_job(target: &str) -> String {
    format!(
        "[global]\n{target}\nrw=randwrite\niodepth=32\nverify=crc32c\nverify_fatal=1\ndo_verify=1\nverify_state_save=0\n\
         \n[bs4k]\nbs=4k\noffset=0\nsize=32m\n\
         \n[bs4k-128k]\nbsrange=4k-128k\noffset=32m\nsize=32m\n"
    )
}

/// Runs fio on `job`, asserts it succeeded, and returns its JSON's jobs.
fn run_fio(dir: &Path, name: &str, job: &str) -> Vec<serde_json::Value> {
    let job_path = dir.join(format!("{name}.fio"));
    let json_path = dir.join(format!("{name}.json"));
    std::fs::write(&job_path, job).unwrap();
    let out =
        Command::new("fio").args(["--output-format=json", "--output"]).arg(&json_path).arg(&job_path).output().unwrap();
    let json = std::fs::read_to_string(&json_path).unwrap_or_default();
    // fio's notes (verify failures among them) surround its JSON document,
    // whose own lines are indented or braces.
    let notes: Vec<&str> = json.lines().filter(|l| !l.starts_with([' ', '{', '}'])).collect();
    assert!(
        out.status.success(),
        "fio ({name}) failed ({}):\n{}\n{}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
        notes.join("\n")
    );
    let doc: serde_json::Value = serde_json::from_str(&json[json.find('{').expect("fio wrote JSON")..]).unwrap();
    let jobs = doc["jobs"].as_array().expect("fio's jobs").clone();
    assert_eq!(jobs.len(), 2, "{doc}");
    jobs
}

#[test]
fn fio_nbd_random_writes_verify_crc32c_and_the_backing_file_holds_them() {
    if !need("fio", "fio") {
        return;
    }
    let engines = run(Command::new("fio").arg("--enghelp"));
    assert!(
        String::from_utf8_lossy(&engines.stdout).split_whitespace().any(|e| e == "nbd"),
        "this fio has no nbd ioengine (Debian's fio has it)"
    );
    let s = setup();
    let nbd = NbdProcess::start(&s.target, "vol0", &s.dir.path().join("vol0.sock"));
    let jobs = run_fio(s.dir.path(), "nbd", &fio_verify_job(&format!("ioengine=nbd\nuri={}", nbd.uri)));
    for j in &jobs {
        let name = j["jobname"].as_str().unwrap();
        assert_eq!(j["error"], 0, "fio job {name}: {j}");
        assert_eq!(j["write"]["io_bytes"], 32 * MIB, "fio job {name} wrote all of its 32 MiB: {j}");
        // The verify phase read every block back and checked its crc32c
        // (verify_fatal: a mismatch ends fio with an error, caught above).
        assert_eq!(j["read"]["io_bytes"], 32 * MIB, "fio job {name} verified all of its 32 MiB: {j}");
    }
    let small = jobs[0]["write"]["total_ios"].as_u64().unwrap();
    let mixed = jobs[1]["write"]["total_ios"].as_u64().unwrap();
    assert_eq!(small, 32 * MIB / 4096);
    assert!(mixed < small / 4, "bsrange=4k-128k wrote {mixed} blocks: the sizes did not vary");
    let connections = nbd.log().matches("NBD_OPT_GO: serving").count();
    assert!(connections >= 2, "fio's two jobs made {connections} connections; log:\n{}", nbd.log());
    let (code, log) = nbd.stop();
    assert_eq!(code, Some(0), "{log}");
    assert!(!log.contains("WARN"), "fio's verify run logged warnings:\n{log}");
    // The same jobs, verify only, on the backing file itself: every block is
    // where fio wrote it, with the bytes fio wrote (a server that misplaced
    // writes and read them back from the same wrong place fails here).
    let img = s.img.display();
    let job = fio_verify_job(&format!("ioengine=psync\nfilename={img}\nverify_only=1"));
    let jobs = run_fio(s.dir.path(), "file", &job);
    for j in &jobs {
        assert_eq!(j["error"], 0, "fio verify_only on the backing file: {j}");
        assert_eq!(j["read"]["io_bytes"], 32 * MIB, "fio verify_only read the whole backing file: {j}");
    }
}

#[test]
fn qemu_io_reads_writes_discards_and_zeroes() {
    if !need("qemu-io", "qemu-utils") {
        return;
    }
    let s = setup();
    let nbd = NbdProcess::start(&s.target, "vol0", &s.dir.path().join("vol0.sock"));
    let q = |cmds: &[&str]| {
        let mut c = Command::new("qemu-io");
        c.args(["-f", "raw"]);
        for cmd in cmds {
            c.args(["-c", cmd]);
        }
        run(c.arg(&nbd.uri))
    };
    q(&["write -P 0xab 1M 2M", "write -P 0xcd 8M 64k", "flush", "read -P 0xab 1M 2M", "read -P 0xcd 8M 64k"]);
    assert!(file_bytes(&s.img, MIB, 2 * MIB as usize).iter().all(|&b| b == 0xab));
    assert!(file_bytes(&s.img, 8 * MIB, 65536).iter().all(|&b| b == 0xcd));
    // FUA, write-zeroes (with and without unmap), discard.
    q(&["write -f -P 0x11 16M 128k", "write -z 1M 512k", "write -z -u 2M 256k", "discard 8M 64k", "read -P 0 1M 512k"]);
    assert!(file_bytes(&s.img, 16 * MIB, 128 << 10).iter().all(|&b| b == 0x11));
    assert!(file_bytes(&s.img, MIB, 512 << 10).iter().all(|&b| b == 0));
    assert!(file_bytes(&s.img, 2 * MIB, 256 << 10).iter().all(|&b| b == 0));
    assert!(file_bytes(&s.img, 2 * MIB + (256 << 10), 768 << 10).iter().all(|&b| b == 0xab));
    // qemu honours the 4 KiB minimum itself: it reads, modifies and writes
    // whole blocks around an unaligned write.
    q(&["write -P 0x5a 4097 100", "read -P 0x5a 4097 100"]);
    assert!(file_bytes(&s.img, 4097, 100).iter().all(|&b| b == 0x5a));
    assert!(file_bytes(&s.img, 4096, 1) == [0] && file_bytes(&s.img, 4197, 1) == [0]);
    let (code, log) = nbd.stop();
    assert_eq!(code, Some(0), "{log}");
}

#[test]
fn qemu_img_convert_and_compare_over_nbd_unix() {
    if !need("qemu-img", "qemu-utils") {
        return;
    }
    let s = setup();
    let nbd = NbdProcess::start(&s.target, "vol0", &s.dir.path().join("vol0.sock"));
    let input = s.dir.path().join("input.img");
    let mut data = random_file(&input, SIZE as usize, 23);
    // Holes in the input: qemu-img writes zeroes (or skips them) there.
    data[(10 * MIB) as usize..(20 * MIB) as usize].fill(0);
    std::fs::write(&input, &data).unwrap();
    run(Command::new("qemu-img").args(["convert", "-n", "-f", "raw", "-O", "raw"]).arg(&input).arg(&nbd.uri));
    run(Command::new("qemu-img").args(["compare", "-f", "raw", "-F", "raw"]).arg(&input).arg(&nbd.uri));
    assert!(std::fs::read(&s.img).unwrap() == data, "the backing file differs from the converted image");
    let out = run(Command::new("qemu-img").args(["info", "--output=json"]).arg(&nbd.uri));
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(json["virtual-size"], SIZE);
    let (code, log) = nbd.stop();
    assert_eq!(code, Some(0), "{log}");
}

#[test]
fn a_read_only_volume_refuses_writes_with_eperm() {
    let s = setup();
    let nbd = NbdProcess::start(&s.target, "ro", &s.dir.path().join("ro.sock"));
    let mut c = Raw::connect(&nbd.socket);
    let (info, _) = c.go("ro");
    assert_ne!(info.flags & wire::TFLAG_READ_ONLY, 0);
    assert_eq!(c.call(Cmd::Write, 0, 0, 4096, &[1u8; 4096]).0, wire::NBD_EPERM);
    assert_eq!(c.call(Cmd::Trim, 0, 0, 4096, &[]).0, wire::NBD_EPERM);
    assert_eq!(c.call(Cmd::WriteZeroes, 0, 0, 4096, &[]).0, wire::NBD_EPERM);
    let (e, data) = c.call(Cmd::Read, 0, 0, 4096, &[]);
    assert_eq!(e, 0);
    assert!(data.iter().all(|&b| b == 0));
    assert_eq!(c.call(Cmd::Flush, 0, 0, 0, &[]).0, 0);
    nbd.wait_for_log("NBD_CMD_WRITE of 4096 bytes at offset 0 (cookie 0x7) refused with NBD errno 1");
    if need("qemu-io", "qemu-utils") {
        let out = Command::new("qemu-io").args(["-f", "raw", "-c", "write 0 4k", &nbd.uri]).output().unwrap();
        let text = String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() || text.contains("not permitted") || text.contains("failed"), "{text}");
        eprintln!("qemu-io on the read-only export: {}", text.trim());
    }
    drop(c);
    assert_eq!(nbd.stop().0, Some(0));
}

#[test]
fn a_bad_export_name_is_refused() {
    let s = setup();
    let nbd = NbdProcess::start(&s.target, "vol0", &s.dir.path().join("vol0.sock"));
    let mut c = Raw::connect(&nbd.socket);
    for option in [wire::OPT_INFO, wire::OPT_GO] {
        c.option(option, &InfoRequest { name: b"nope".to_vec(), requests: vec![] }.encode());
        let (r, msg) = c.option_reply();
        assert_eq!(r.reply, wire::REP_ERR_UNKNOWN);
        assert!(String::from_utf8_lossy(&msg).contains("\"nope\""));
    }
    // The connection goes on: the default name works.
    let (info, sizes) = c.go("");
    assert_eq!(info.size, SIZE);
    assert_eq!(sizes, wire::BlockSizes { minimum: 4096, preferred: 4096, maximum: 1 << 20 });
    c.request(Cmd::Disc, 0, 1, 0, 0, &[]);
    assert!(c.closed());
    // NBD_OPT_EXPORT_NAME cannot be answered with an error: the server closes.
    let mut c = Raw::connect(&nbd.socket);
    c.option(wire::OPT_EXPORT_NAME, b"nope");
    assert!(c.closed());
    nbd.wait_for_log("NBD_OPT_EXPORT_NAME asks for export \"nope\"");
    if need("nbdinfo", "libnbd-bin") {
        let out = Command::new("nbdinfo").arg(nbd.uri.replace("///vol0?", "///nope?")).output().unwrap();
        assert!(!out.status.success());
    }
    assert_eq!(nbd.stop().0, Some(0));
}

#[test]
fn misbehaving_clients_get_errors_or_are_disconnected_and_others_keep_working() {
    let s = setup();
    let nbd = NbdProcess::start(&s.target, "vol0", &s.dir.path().join("vol0.sock"));
    let mut good = Raw::connect(&nbd.socket);
    good.go("vol0");
    assert_eq!(good.call(Cmd::Write, 0, 0, 8192, &[0x77; 8192]).0, 0);
    let mut before = std::fs::read(&s.img).unwrap();

    // Negotiation: unknown options and bad option data are answered, not fatal.
    let mut c = Raw::connect(&nbd.socket);
    c.option(12345, b"junk");
    assert_eq!(c.option_reply().0.reply, wire::REP_ERR_UNSUP);
    c.option(wire::OPT_STRUCTURED_REPLY, &[]);
    assert_eq!(c.option_reply().0.reply, wire::REP_ERR_UNSUP);
    c.option(wire::OPT_LIST, b"x");
    assert_eq!(c.option_reply().0.reply, wire::REP_ERR_INVALID);
    c.option(wire::OPT_GO, &[0, 0, 0, 9, b'v']);
    assert_eq!(c.option_reply().0.reply, wire::REP_ERR_INVALID);
    let (_, sizes) = c.go("vol0");
    let max = sizes.maximum;
    assert_eq!(max, 1 << 20);

    // Transmission: each bad request gets the spec's error and the connection goes on.
    assert_eq!(c.call(Cmd::Read, 0, SIZE, 4096, &[]).0, wire::NBD_EINVAL, "read beyond the end");
    assert_eq!(c.call(Cmd::Read, 0, SIZE - 4096, 8192, &[]).0, wire::NBD_EINVAL, "read across the end");
    assert_eq!(c.call(Cmd::Write, 0, SIZE - 4096, 8192, &[1; 8192]).0, wire::NBD_ENOSPC, "write across the end");
    assert_eq!(c.call(Cmd::Write, 0, u64::MAX - 4095, 4096, &[1; 4096]).0, wire::NBD_ENOSPC, "offset overflow");
    assert_eq!(c.call(Cmd::WriteZeroes, 0, SIZE, 4096, &[]).0, wire::NBD_ENOSPC, "zeroes beyond the end");
    assert_eq!(c.call(Cmd::Trim, 0, SIZE, 4096, &[]).0, wire::NBD_EINVAL, "trim beyond the end");
    assert_eq!(c.call(Cmd::Read, 0, 512, 4096, &[]).0, wire::NBD_EINVAL, "misaligned offset");
    assert_eq!(c.call(Cmd::Write, 0, 0, 512, &[1; 512]).0, wire::NBD_EINVAL, "misaligned length");
    assert_eq!(c.call(Cmd::Read, 0, 0, wire::MAX_PAYLOAD + 4096, &[]).0, wire::NBD_EINVAL, "read above 32 MiB");
    // Above the advertised maximum but within the spec's default of 32 MiB
    // (the kernel's nbd-client, which asks for no block sizes, sends such
    // writes): served, split by the I/O path.
    let big: Vec<u8> = (0..3 * max as usize).map(|i| (i / 4096) as u8).collect();
    assert_eq!(c.call(Cmd::Write, 0, 16 * MIB, big.len() as u32, &big).0, 0, "a 3 MiB write");
    let (e, data) = c.call(Cmd::Read, 0, 16 * MIB, big.len() as u32, &[]);
    assert!(e == 0 && data == big, "a 3 MiB read");
    let flagged = vec![2u8; 2 * max as usize];
    assert_eq!(
        c.call(Cmd::Write, wire::CMD_FLAG_DF, 0, flagged.len() as u32, &flagged).0,
        wire::NBD_EINVAL,
        "a write refused for its flags: its payload is read and dropped"
    );
    assert_eq!(c.call(Cmd::Other(5), 0, 0, 4096, &[]).0, wire::NBD_EINVAL, "NBD_CMD_CACHE is not served");
    assert_eq!(c.call(Cmd::Other(99), 0, 0, 0, &[]).0, wire::NBD_EINVAL, "unknown command");
    assert_eq!(c.call(Cmd::Read, wire::CMD_FLAG_DF, 0, 4096, &[]).0, wire::NBD_EINVAL, "DF was not offered");
    assert_eq!(
        c.call(Cmd::Write, wire::CMD_FLAG_NO_HOLE, 0, 4096, &[3; 4096]).0,
        wire::NBD_EINVAL,
        "NO_HOLE on a write"
    );
    let (e, data) = c.call(Cmd::Read, wire::CMD_FLAG_FUA, 0, 8192, &[]);
    assert_eq!((e, data), (0, vec![0x77; 8192]), "the connection still works after all that");
    nbd.wait_for_log("NBD_CMD_WRITE of 8192 bytes at offset 67104768 (cookie 0x7) refused with NBD errno 28");

    // Fatal: a bad request magic, a write too long to read and discard.
    let mut bad = Raw::connect(&nbd.socket);
    bad.go("vol0");
    let mut h = Request { flags: 0, command: Cmd::Read, cookie: 1, offset: 0, length: 4096 }.encode();
    h[0] ^= 0xff;
    bad.s.write_all(&h).unwrap();
    assert!(bad.closed(), "a bad request magic must end the connection");
    nbd.wait_for_log("bad request magic 0xda609513");
    let mut huge = Raw::connect(&nbd.socket);
    huge.go("vol0");
    huge.request(Cmd::Write, 0, 2, 0, u32::MAX, &[9u8; 65536]);
    assert!(huge.closed(), "a 4 GiB write must end the connection");
    nbd.wait_for_log("write of 4294967295 bytes is longer than the 33554432 bytes this server serves");
    // A client that vanishes mid-request.
    let mut gone = Raw::connect(&nbd.socket);
    gone.go("vol0");
    gone.request(Cmd::Write, 0, 3, 0, 1 << 20, &[5u8; 1000]);
    drop(gone);
    // A bad handshake: unknown client flags; a bad option magic.
    let mut s1 = UnixStream::connect(&nbd.socket).unwrap();
    s1.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let mut g = [0u8; wire::Greeting::SIZE];
    s1.read_exact(&mut g).unwrap();
    s1.write_all(&0x80u32.to_be_bytes()).unwrap();
    assert!(matches!(s1.read(&mut g), Ok(0) | Err(_)));
    let mut s2 = Raw::connect(&nbd.socket);
    s2.s.write_all(&[0u8; 16]).unwrap();
    assert!(s2.closed());
    nbd.wait_for_log("unknown client flags 0x80");
    nbd.wait_for_log("bad option magic 0x0");

    // The well-behaved client never noticed, and nothing was written.
    let (e, data) = good.call(Cmd::Read, 0, 0, 8192, &[]);
    assert_eq!((e, data), (0, vec![0x77; 8192]));
    assert_eq!(good.call(Cmd::Write, wire::CMD_FLAG_FUA, 4 * MIB, 4096, &[0x42; 4096]).0, 0);
    let mut after = std::fs::read(&s.img).unwrap();
    let range = (16 * MIB) as usize..(19 * MIB) as usize;
    assert!(after[range.clone()] == big[..], "the 3 MiB write is in the file");
    before[range.clone()].copy_from_slice(&big);
    assert!(after[(4 * MIB) as usize..(4 * MIB + 4096) as usize].iter().all(|&b| b == 0x42));
    after[(4 * MIB) as usize..(4 * MIB + 4096) as usize]
        .copy_from_slice(&before[(4 * MIB) as usize..(4 * MIB + 4096) as usize]);
    assert!(after == before, "a refused request changed the volume");
    drop((good, c));
    assert_eq!(nbd.stop().0, Some(0));
}

#[test]
fn requests_of_one_connection_are_in_flight_together_and_sigterm_answers_them_then_exits_zero() {
    let s = setup();
    let nbd = NbdProcess::start(&s.target, "vol0", &s.dir.path().join("vol0.sock"));
    let mut c = Raw::connect(&nbd.socket);
    c.go("vol0");
    // 64 writes of 64 KiB sent before any reply is read: they overlap on the
    // target (replies come back in any order, matched by cookie).
    for i in 0..64u64 {
        c.request(Cmd::Write, 0, 1000 + i, i * 65536, 65536, &vec![i as u8; 65536]);
    }
    let mut cookies: Vec<u64> = (0..64)
        .map(|_| c.reply())
        .map(|r| {
            assert_eq!(r.error, 0);
            r.cookie
        })
        .collect();
    cookies.sort();
    assert_eq!(cookies, (1000..1064).collect::<Vec<_>>());
    // Now 32 more, then SIGTERM before reading a reply: all are answered.
    for i in 0..32u64 {
        c.request(Cmd::Write, 0, 2000 + i, (64 + i) * 65536, 65536, &vec![0x80 | i as u8; 65536]);
    }
    c.request(Cmd::Flush, 0, 3000, 0, 0, &[]);
    std::thread::sleep(Duration::from_millis(200));
    let socket = nbd.socket.clone();
    // SAFETY: kill(2) takes plain integers; the pid is our own child.
    assert_eq!(unsafe { libc::kill(nbd.child.id() as i32, libc::SIGTERM) }, 0);
    let mut answered = 0;
    while answered < 33 {
        let r = c.reply();
        assert_eq!(r.error, 0, "cookie {}", r.cookie);
        answered += 1;
    }
    assert!(c.closed(), "the connection ends once its requests are answered");
    // Already signalled: a second SIGTERM would give up the final flush.
    let (code, log) = nbd.wait();
    assert_eq!(code, Some(0), "{log}");
    assert!(log.contains("SIGTERM: stopping") && log.contains("flushed"), "{log}");
    assert!(!socket.exists(), "the socket file was left behind");
    let file = std::fs::read(&s.img).unwrap();
    for i in 0..96usize {
        let want = if i < 64 { i as u8 } else { 0x80 | (i - 64) as u8 };
        assert!(file[i * 65536..(i + 1) * 65536].iter().all(|&b| b == want), "block {i}");
    }
}

#[test]
fn a_second_sigterm_gives_up_the_final_flush_of_a_lost_target_and_exits_non_zero() {
    a_second_signal_gives_up_the_final_flush_of_a_lost_target(libc::SIGTERM, "SIGTERM");
}

#[test]
fn a_sigint_after_sigterm_gives_up_the_final_flush_of_a_lost_target_too() {
    a_second_signal_gives_up_the_final_flush_of_a_lost_target(libc::SIGINT, "SIGINT");
}

/// With the target gone, SIGTERM says at once that the final flush waits up
/// to ctrl_loss_timeout and that a second signal ends it; `second` then ends
/// the process within seconds, non-zero, saying what may be lost.
fn a_second_signal_gives_up_the_final_flush_of_a_lost_target(second: libc::c_int, second_name: &str) {
    let mut s = setup();
    let nbd = NbdProcess::start_with(&s.target, "vol0", &s.dir.path().join("vol0.sock"), &["--ctrl-loss-timeout", "120"]);
    let mut c = Raw::connect(&nbd.socket);
    c.go("vol0");
    c.request(Cmd::Write, 0, 1, 0, 4096, &[0x5a; 4096]);
    assert_eq!(c.reply().error, 0);
    drop(c);
    s.target.kill_and_wait();
    let pid = nbd.child.id() as i32;
    // SAFETY: kill(2) takes plain integers; the pid is our own child.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGTERM) }, 0);
    let signalled = Instant::now();
    nbd.wait_for_log("SIGTERM: stopping");
    // At once, not when the wait is over: how long it may last and how to end it.
    let warning = nbd.wait_for_log("the final flush wait");
    assert!(signalled.elapsed() < Duration::from_secs(2), "the wait was announced after {:?}", signalled.elapsed());
    for needle in ["120 s", "second SIGINT or SIGTERM", "may be lost"] {
        assert!(warning.contains(needle), "the warning names {needle:?}: {warning}");
    }
    // The final flush waits for the target to come back (up to 120 s).
    std::thread::sleep(Duration::from_secs(2));
    assert!(!nbd.log().contains("flushed"), "{}", nbd.log());
    // SAFETY: as above.
    assert_eq!(unsafe { libc::kill(pid, second) }, 0);
    let given_up = Instant::now();
    let socket = nbd.socket.clone();
    let (code, log) = nbd.wait();
    assert!(given_up.elapsed() < Duration::from_secs(5), "exited {:?} after the {second_name}", given_up.elapsed());
    assert_eq!(code, Some(1), "exit status after giving up; log:\n{log}");
    assert!(log.contains(&format!("{second_name} while stopping")), "the log names the second signal:\n{log}");
    assert!(log.contains("not flushed"), "the log says the volume was not flushed:\n{log}");
    assert!(log.contains("may not be durable"), "the log says what may be lost:\n{log}");
    assert!(!socket.exists(), "the socket file was left behind");
}

#[test]
fn nbd_without_an_address_names_both_socket_and_listen() {
    // Refused before connecting: the target's URL needs no server.
    let out = Command::new(bin("rdmablk")).args(["--target", "tcp://127.0.0.1:1", "nbd", "vol0"]).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(out.stdout.is_empty());
    assert!(err.contains("--socket") && err.contains("--listen"), "the error names both ways to listen: {err}");
    assert_eq!(err.trim_end().lines().count(), 1, "one line: {err}");
}

/// At SIGTERM, a client is pipelining 4 KiB writes (cookie i writes block i)
/// on a unix socket. Every request it sent is answered: the ones already
/// started on the volume complete (their data is in the file), the ones the
/// server had not started get NBD_ESHUTDOWN (and are not written); none goes
/// unanswered, and the server exits 0, flushed.
#[test]
fn at_sigterm_every_request_sent_is_answered_done_or_eshutdown() {
    let s = setup();
    let nbd = NbdProcess::start(&s.target, "vol0", &s.dir.path().join("vol0.sock"));
    let mut c = Raw::connect(&nbd.socket);
    c.go("vol0");
    let w = c.s.try_clone().unwrap();
    every_request_sent_at_sigterm_is_answered(&s, nbd, c, w);
}

/// The same over TCP, where what the client sent may still be on its way
/// when the server stops: it is read and answered too.
#[test]
fn at_sigterm_every_request_sent_over_tcp_is_answered_done_or_eshutdown() {
    let s = setup();
    let (nbd, addr) = NbdProcess::start_tcp(&s.target, "vol0");
    let mut c = Raw::connect_tcp(addr);
    c.go("vol0");
    let w = c.s.try_clone().unwrap();
    every_request_sent_at_sigterm_is_answered(&s, nbd, c, w);
}

/// Pipelines a 4 KiB write per block of vol0 through `w` (the writing half
/// of `c`'s connection), SIGTERMs `nbd` after 300 replies, reads replies
/// until the server closes, and checks them against what was sent and the
/// file.
fn every_request_sent_at_sigterm_is_answered<S: Read + Write + Send + 'static>(s: &Setup, nbd: NbdProcess, mut c: Raw<S>, mut w: S) {
    let blocks = SIZE / 4096;
    let pattern = |i: u64| (i % 251 + 1) as u8;
    let writer = std::thread::spawn(move || {
        let mut sent = 0u64;
        for i in 0..blocks {
            let r = Request { flags: 0, command: Cmd::Write, cookie: i, offset: i * 4096, length: 4096 };
            // Should the server close first, the requests before the
            // failed write were sent whole.
            if w.write_all(&[&r.encode()[..], &[pattern(i); 4096][..]].concat()).is_err() {
                break;
            }
            sent += 1;
        }
        sent
    });
    let mut errors = std::collections::HashMap::new();
    let mut h = [0u8; SimpleReply::SIZE];
    loop {
        match c.s.read_exact(&mut h) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => break,
            Err(e) => panic!("reading replies: {e} after {} replies", errors.len()),
        }
        let r = SimpleReply::decode(&h).unwrap();
        assert!(errors.insert(r.cookie, r.error).is_none(), "cookie {} answered twice", r.cookie);
        if errors.len() == 300 {
            // SAFETY: kill(2) takes plain integers; the pid is our own child.
            assert_eq!(unsafe { libc::kill(nbd.child.id() as i32, libc::SIGTERM) }, 0);
        }
    }
    let sent = writer.join().unwrap();
    drop(c);
    let (code, log) = nbd.wait();
    assert_eq!(code, Some(0), "{log}");
    assert!(log.contains("flushed"), "{log}");
    for cookie in 0..sent {
        let e = errors.get(&cookie).unwrap_or_else(|| panic!("request {cookie} of {sent} sent was not answered; log:\n{log}"));
        assert!(*e == 0 || *e == wire::NBD_ESHUTDOWN, "request {cookie}: error {e}");
    }
    // The request cut short by the server's close may be answered too (it was not sent whole).
    assert!(errors.keys().all(|&k| k <= sent), "replies to requests never sent");
    let refused = errors.values().filter(|&&e| e == wire::NBD_ESHUTDOWN).count();
    assert!(refused > 0, "the requests received after SIGTERM get NBD_ESHUTDOWN, not a late start; log:\n{log}");
    assert!(log.contains(&format!("{refused} request(s) received after the stop answered NBD_ESHUTDOWN")), "{log}");
    let file = std::fs::read(&s.img).unwrap();
    for (&cookie, &e) in &errors {
        let block = &file[(cookie * 4096) as usize..((cookie + 1) * 4096) as usize];
        if e == 0 {
            assert!(block.iter().all(|&b| b == pattern(cookie)), "block {cookie} was answered done but is not in the file");
        } else {
            assert!(block.iter().all(|&b| b == 0), "block {cookie} was refused with NBD_ESHUTDOWN but written");
        }
    }
}

/// The handshake timeout bounds the whole negotiation: a client that sends
/// an option every second, each well within it, is cut off once the
/// negotiation has lasted that long.
#[test]
fn the_handshake_timeout_bounds_the_whole_negotiation() {
    let s = setup();
    let nbd = NbdProcess::start_with(&s.target, "vol0", &s.dir.path().join("vol0.sock"), &["--handshake-timeout", "3s"]);
    let mut c = Raw::connect(&nbd.socket);
    let connected = Instant::now();
    // NBD_OPT_LIST, answered (the export, then an ACK), once a second.
    let list = |c: &mut Raw| -> std::io::Result<()> {
        c.s.write_all(&OptionHeader { option: wire::OPT_LIST, length: 0 }.encode())?;
        loop {
            let mut h = [0u8; OptionReply::SIZE];
            c.s.read_exact(&mut h)?;
            let r = OptionReply::decode(&h).unwrap();
            let mut data = vec![0u8; r.length as usize];
            c.s.read_exact(&mut data)?;
            if r.reply == wire::REP_ACK {
                return Ok(());
            }
            assert_eq!(r.reply, wire::REP_SERVER);
        }
    };
    let cut_off = loop {
        if list(&mut c).is_err() {
            break connected.elapsed();
        }
        assert!(connected.elapsed() < Duration::from_secs(10), "still negotiating after {:?}", connected.elapsed());
        std::thread::sleep(Duration::from_secs(1));
    };
    assert!(cut_off >= Duration::from_millis(2900), "cut off after {cut_off:?}, before the 3 s");
    assert!(cut_off < Duration::from_secs(5), "cut off after {cut_off:?}");
    let line = nbd.wait_for_log("closing during negotiation");
    assert!(line.contains("3 s") && line.contains("handshake timeout"), "{line}");
    // A client that negotiates at once is served as before.
    let mut good = Raw::connect(&nbd.socket);
    good.go("vol0");
    assert_eq!(good.call(Cmd::Write, wire::CMD_FLAG_FUA, 0, 4096, &[9; 4096]).0, 0);
    assert_eq!(nbd.stop().0, Some(0));
}

#[test]
fn the_socket_path_never_replaces_another_file() {
    let s = setup();
    let path = s.dir.path().join("precious");
    std::fs::write(&path, b"data").unwrap();
    let out = Command::new(bin("rdmablk"))
        .args(["--target", &s.target.url, "nbd", "vol0", "--socket"])
        .arg(&path)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("exists and is not a socket"), "{err}");
    assert_eq!(std::fs::read(&path).unwrap(), b"data");
}

#[test]
fn a_file_system_through_nbdfuse_and_a_loop_device_survives_a_remount() {
    if !need("nbdfuse", "libnbd-bin") || !need("mkfs.ext4", "e2fsprogs") || !need("losetup", "mount") {
        return;
    }
    // SAFETY: geteuid(2) takes nothing and cannot fail.
    let root = unsafe { libc::geteuid() } == 0;
    if !Path::new("/dev/fuse").exists() || !root {
        eprintln!("skipping: needs /dev/fuse and root (for mount)");
        return;
    }
    let s = setup();
    // libnbd refuses requests below the minimum block size itself, and the
    // kernel sends 512-byte ones through FUSE: a volume with 512-byte blocks.
    let nbd = NbdProcess::start(&s.target, "v512", &s.dir.path().join("v512.sock"));
    let fuse_dir = s.dir.path().join("fuse");
    let mnt = s.dir.path().join("mnt");
    std::fs::create_dir_all(&fuse_dir).unwrap();
    std::fs::create_dir_all(&mnt).unwrap();
    let pidfile = s.dir.path().join("nbdfuse.pid");
    let disk = fuse_dir.join("disk");
    let mut fuse = Command::new("nbdfuse")
        .arg("-P")
        .arg(&pidfile)
        .arg(&disk)
        .arg(&nbd.uri)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    struct Unmount(Vec<PathBuf>);
    impl Drop for Unmount {
        fn drop(&mut self) {
            for p in &self.0 {
                let _ = Command::new("umount").arg(p).status();
            }
        }
    }
    let _cleanup = Unmount(vec![mnt.clone(), fuse_dir.clone()]);
    let deadline = Instant::now() + Duration::from_secs(20);
    while !pidfile.exists() {
        assert!(Instant::now() < deadline, "nbdfuse did not start");
        assert!(fuse.try_wait().unwrap().is_none(), "nbdfuse exited");
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(std::fs::metadata(&disk).unwrap().len(), 128 * MIB);
    run(Command::new("mkfs.ext4").args(["-q", "-F"]).arg(&disk));
    run(Command::new("mount").args(["-o", "loop"]).arg(&disk).arg(&mnt));
    let mut files = Vec::new();
    let mut rng = rand::rngs::StdRng::seed_from_u64(29);
    for (i, len) in [0usize, 1, 4095, 4096, 65537, 1 << 20, 5 << 20].into_iter().enumerate() {
        let mut data = vec![0u8; len];
        rng.fill_bytes(&mut data);
        let path = mnt.join(format!("f{i}"));
        std::fs::write(&path, &data).unwrap();
        files.push((format!("f{i}"), data));
    }
    std::fs::create_dir(mnt.join("dir")).unwrap();
    std::fs::write(mnt.join("dir/nested"), b"nested file").unwrap();
    run(Command::new("umount").arg(&mnt));
    run(Command::new("mount").args(["-o", "loop"]).arg(&disk).arg(&mnt));
    for (name, data) in &files {
        assert!(std::fs::read(mnt.join(name)).unwrap() == *data, "{name} differs after the remount");
    }
    assert_eq!(std::fs::read(mnt.join("dir/nested")).unwrap(), b"nested file");
    run(Command::new("umount").arg(&mnt));
    if need("e2fsck", "e2fsprogs") {
        run(Command::new("e2fsck").args(["-fn"]).arg(&disk));
    }
    run(Command::new("umount").arg(&fuse_dir));
    let deadline = Instant::now() + Duration::from_secs(20);
    while fuse.try_wait().unwrap().is_none() {
        assert!(Instant::now() < deadline, "nbdfuse did not exit after the unmount");
        std::thread::sleep(Duration::from_millis(50));
    }
    let mut err = String::new();
    fuse.stderr.take().unwrap().read_to_string(&mut err).unwrap();
    assert!(err.is_empty(), "nbdfuse complained:\n{err}");
    let (code, log) = nbd.stop();
    assert_eq!(code, Some(0), "{log}");
    assert!(!log.contains("WARN"), "the file system round trip logged warnings:\n{log}");
}
