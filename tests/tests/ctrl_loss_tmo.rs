//! `--ctrl_loss_tmo` with the real binaries: `rdmablk-bench` with
//! `--verify=crc32c` rides out a SIGKILL and restart of the target (same
//! port, same config, same backing file) with zero errors, and counts the
//! reconnection in its JSON; without the option the same kill ends the run
//! with an error that says so. The `rdmablk` CLI accepts the nvme-cli
//! spelling.
//!
//! Not vacuous: the kill is sent while the target's metrics show the
//! benchmark's reads and writes going on, and the benchmark is still
//! running; an I/O in flight at the kill waited through the outage (its
//! latency is at least the time the target was down); reads and writes go
//! on after the reconnection (the restarted target's metrics); and every
//! block of the volume is afterwards either untouched or a complete block
//! as the benchmark stamps it (magic, length, offset, CRC32C), most of them
//! written.

use std::io::Read;
use std::path::Path;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use rdmablk_system_tests::{
    bin, memory_volume, rdmablk, sample, scrape, target_section, wait_until, RestartableTarget, TargetProcess,
};
use serde_json::Value;

const MIB: u64 = 1 << 20;
const VOLUME: u64 = 64 * MIB;
/// The benchmark's region: the first 16 MiB, 4096 blocks of 4 KiB.
const REGION: u64 = 16 * MIB;
const BS: u64 = 4096;
const IODEPTH: u64 = 16;
/// The benchmark's runtime: long enough for I/O after a reconnection that
/// takes a few seconds (the library's backoff) on a slow machine.
const RUNTIME_S: u64 = 10;
/// How long the target stays down.
const DOWN: Duration = Duration::from_millis(500);
/// A benchmark that has not finished by then is stuck.
const BENCH_LIMIT: Duration = Duration::from_secs(RUNTIME_S + 90);

/// Reads and writes the running target finished on vol0 (its metrics).
fn ops(target: &RestartableTarget) -> (f64, f64) {
    let m = scrape(&target.target().metrics_addr());
    let op = |op| sample(&m, "rdmablk_volume_ops_total", &[("volume", "vol0"), ("op", op)]).unwrap_or(0.0);
    (op("read"), op("write"))
}

/// `rdmablk-bench` as a child process, its output collected.
struct Bench {
    child: Child,
    stdout: Option<JoinHandle<Vec<u8>>>,
    stderr: Option<JoinHandle<Vec<u8>>>,
}

/// What the benchmark left.
struct Finished {
    status: ExitStatus,
    json: Value,
    stderr: String,
}

impl Bench {
    /// A QD-16 random 50/50 read/write mix of 4 KiB blocks with crc32c
    /// verify over the first 16 MiB of vol0, time based, JSON report.
    fn spawn(url: &str, extra: &[&str]) -> Bench {
        let mut child = Command::new(bin("rdmablk-bench"))
            .args([
                &format!("--target={url}"),
                "--volume=vol0",
                "--host-id=ctrl-loss-test",
                "--name=failover",
                "--rw=randrw",
                "--bs=4k",
                &format!("--iodepth={IODEPTH}"),
                &format!("--size={REGION}"),
                &format!("--runtime={RUNTIME_S}s"),
                "--time_based",
                "--verify=crc32c",
                "--output-format=json",
                "--eta=never",
            ])
            .args(extra)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn rdmablk-bench");
        let drain = |mut r: Box<dyn Read + Send>| {
            std::thread::spawn(move || {
                let mut v = Vec::new();
                let _ = r.read_to_end(&mut v);
                v
            })
        };
        let stdout = Some(drain(Box::new(child.stdout.take().expect("stdout"))));
        let stderr = Some(drain(Box::new(child.stderr.take().expect("stderr"))));
        Bench { child, stdout, stderr }
    }

    fn running(&mut self) -> bool {
        self.child.try_wait().expect("try_wait").is_none()
    }

    /// Waits for the benchmark to exit (killing it after `limit`).
    fn finish(mut self, limit: Duration) -> Finished {
        let t0 = Instant::now();
        let status = loop {
            if let Some(s) = self.child.try_wait().expect("try_wait") {
                break s;
            }
            if t0.elapsed() > limit {
                let _ = self.child.kill();
                let _ = self.child.wait();
                let err = String::from_utf8_lossy(&self.stderr.take().unwrap().join().unwrap()).into_owned();
                panic!("rdmablk-bench did not finish within {limit:?}; stderr:\n{err}");
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        let stdout = self.stdout.take().unwrap().join().unwrap();
        let stderr = String::from_utf8_lossy(&self.stderr.take().unwrap().join().unwrap()).into_owned();
        let json = serde_json::from_slice(&stdout).unwrap_or_else(|e| {
            panic!("rdmablk-bench's output is not JSON ({e}); exit {status}\nstdout:\n{}\nstderr:\n{stderr}", String::from_utf8_lossy(&stdout))
        });
        Finished { status, json, stderr }
    }
}

impl Drop for Bench {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts the benchmark on a fresh target, waits until its reads and
/// writes are flowing (at least 1.5 s in, both counters rising over the
/// last 100 ms while it runs), SIGKILLs the target, restarts it after
/// [`DOWN`] on the same port and config, and returns the target, the
/// benchmark, and the target's counters just before the kill.
fn kill_and_restart_under_the_benchmark(extra: &[&str]) -> (RestartableTarget, Bench, (f64, f64)) {
    let mut target = RestartableTarget::start("metrics = \"127.0.0.1:0\"\n", VOLUME);
    let url = target.target().url.clone();
    let mut bench = Bench::spawn(&url, extra);
    let t0 = Instant::now();
    // The benchmark connects, then I/O starts; a slow machine takes its time.
    let mut last = (0.0, 0.0);
    let mut before = last;
    wait_until("the benchmark's reads and writes flowing, 1.5 s in", Duration::from_secs(60), || {
        std::thread::sleep(Duration::from_millis(100));
        assert!(bench.running(), "rdmablk-bench exited before the kill");
        before = ops(&target);
        let flowing = before.0 > last.0 && before.1 > last.1 && last.0 > 0.0;
        last = before;
        flowing && t0.elapsed() >= Duration::from_millis(1500)
    });
    // Both counters rose over the last 100 ms: kill now.
    target.kill();
    eprintln!("killed the target {:?} after the benchmark started, at {before:?} reads/writes", t0.elapsed());
    std::thread::sleep(DOWN);
    target.restart();
    (target, bench, before)
}

/// Sum of a job's `read` and `write` `total_ios`.
fn total_ios(job: &Value) -> (u64, u64) {
    let n = |d: &str| job[d]["total_ios"].as_u64().unwrap_or_else(|| panic!("{d}.total_ios in {job}"));
    (n("read"), n("write"))
}

/// The longest latency of the job's reads and writes.
fn max_latency(job: &Value) -> Duration {
    let ns = |d: &str| job[d]["lat_ns"]["max"].as_u64().unwrap_or_else(|| panic!("{d}.lat_ns.max in {job}"));
    Duration::from_nanos(ns("read").max(ns("write")))
}

/// CRC32C (Castagnoli), bitwise table built once.
fn crc32c(data: &[u8], table: &[u32; 256], init: u32) -> u32 {
    let mut c = !init;
    for &b in data {
        c = table[((c ^ u32::from(b)) & 0xff) as usize] ^ (c >> 8);
    }
    !c
}

fn crc32c_table() -> [u32; 256] {
    let mut t = [0u32; 256];
    for (i, e) in t.iter_mut().enumerate() {
        let mut c = i as u32;
        for _ in 0..8 {
            c = if c & 1 != 0 { (c >> 1) ^ 0x82f6_3b78 } else { c >> 1 };
        }
        *e = c;
    }
    t
}

/// Checks every block of the benchmark's region in the backing file: all
/// zero (never written) or a whole block as rdmablk-bench stamps it
/// (bench/src/verify.rs: magic `RBV1`, length, offset, CRC32C over bytes
/// 0..28 and 32..). Returns how many are stamped.
fn stamped_blocks(image: &Path) -> u64 {
    let table = crc32c_table();
    assert_eq!(crc32c(b"123456789", &table, 0), 0xe306_9283, "CRC32C check value");
    let data = std::fs::read(image).unwrap();
    let mut stamped = 0;
    for (i, block) in data[..REGION as usize].chunks(BS as usize).enumerate() {
        let offset = i as u64 * BS;
        if block.iter().all(|&b| b == 0) {
            continue;
        }
        let u32_at = |at: usize| u32::from_le_bytes(block[at..at + 4].try_into().unwrap());
        assert_eq!(&block[0..4], b"RBV1", "block at offset {offset}: no header");
        assert_eq!(u32_at(4), BS as u32, "block at offset {offset}: length");
        assert_eq!(u64::from_le_bytes(block[8..16].try_into().unwrap()), offset, "block at offset {offset}: misplaced");
        let crc = crc32c(&block[32..], &table, crc32c(&block[..28], &table, 0));
        assert_eq!(u32_at(28), crc, "block at offset {offset}: torn or corrupt (CRC)");
        stamped += 1;
    }
    stamped
}

#[test]
fn the_benchmark_with_ctrl_loss_tmo_rides_out_a_sigkill_and_restart_of_the_target_with_verify() {
    let t0 = Instant::now();
    let (target, bench, before) = kill_and_restart_under_the_benchmark(&["--ctrl_loss_tmo=30"]);
    eprintln!("restarted {:?} after the start", t0.elapsed());
    let done = bench.finish(BENCH_LIMIT);
    let v = &done.json;
    let job = &v["jobs"][0];
    eprintln!("benchmark exit {} after {:?}; job: {}\nstderr:\n{}", done.status, t0.elapsed(), job["rdmablk"], done.stderr);
    assert!(done.status.success(), "exit {}; stderr:\n{}", done.status, done.stderr);
    assert_eq!(job["error"], 0, "{}", job["rdmablk"]);
    assert_eq!(job["rdmablk"]["io_errors"], 0, "{}", job["rdmablk"]);
    assert_eq!(job["rdmablk"]["verify_errors"], 0, "{}", job["rdmablk"]);
    let reconnects = job["rdmablk"]["reconnects"].as_u64().expect("jobs[0].rdmablk.reconnects");
    assert!(reconnects >= 1, "{}", job["rdmablk"]);
    assert_eq!(v["rdmablk"]["reconnects"].as_u64(), Some(reconnects), "the total of the only job");
    assert_eq!(job["job options"]["ctrl_loss_tmo"], "30");

    // The I/O in flight at the kill waited for the restarted target.
    let longest = max_latency(job);
    eprintln!("the longest I/O took {longest:?}");
    assert!(longest >= DOWN, "the longest I/O took {longest:?}; the target was down for {DOWN:?}");
    // Reads and writes went on after the reconnection: far more of each
    // than the re-issued ones (at most the queue depth, 16) reached the
    // new target.
    let after = ops(&target);
    eprintln!("the restarted target finished {after:?} reads/writes; the first {before:?}");
    assert!(after.0 >= 100.0 && after.1 >= 100.0, "after the reconnection: {after:?} reads/writes");
    let (reads, writes) = total_ios(job);
    assert!(reads as f64 >= before.0 && writes as f64 >= before.1, "the report ({reads}, {writes}) misses I/O the target saw: {before:?}, {after:?}");

    // On disk: no torn or misplaced block, and most of the region written.
    let stamped = stamped_blocks(target.image());
    eprintln!("{stamped} of {} blocks written", REGION / BS);
    assert!(stamped >= REGION / BS / 2, "only {stamped} blocks written");
    target.target().assert_no_panic();
}

#[test]
fn without_ctrl_loss_tmo_the_benchmark_reports_the_lost_target() {
    let (target, bench, _) = kill_and_restart_under_the_benchmark(&[]);
    let done = bench.finish(BENCH_LIMIT);
    let job = &done.json["jobs"][0];
    eprintln!("benchmark exit {}; job: {}\nstderr:\n{}", done.status, job["rdmablk"], done.stderr);
    assert_eq!(done.status.code(), Some(1), "stderr:\n{}", done.stderr);
    assert_eq!(job["error"], 5, "fio's EIO: {}", job["rdmablk"]);
    assert!(job["rdmablk"]["io_errors"].as_u64().unwrap() >= 1, "{}", job["rdmablk"]);
    assert_eq!(job["rdmablk"]["verify_errors"], 0, "{}", job["rdmablk"]);
    assert_eq!(job["rdmablk"]["reconnects"], 0, "{}", job["rdmablk"]);
    assert_eq!(done.json["rdmablk"]["reconnects"], 0);
    let url = &target.target().url;
    let want = format!("lost the connection to the target {url}; not reconnecting (ctrl_loss_tmo=0)");
    let msg = job["rdmablk"]["error_message"].as_str().expect("error_message");
    assert!(msg.starts_with(&want) && msg.contains("--ctrl_loss_tmo=SECONDS"), "{msg}");
    assert!(done.stderr.contains(&format!("failover: {want}")), "stderr:\n{}", done.stderr);
    // It stopped at the loss: the restarted target never saw it.
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(target.target().count_log("session connected"), 0, "{}", target.target().log().join("\n"));
    assert_eq!(ops(&target), (0.0, 0.0));
    // What was written before the loss is intact.
    assert!(stamped_blocks(target.image()) > 0);
}

#[test]
fn the_cli_takes_ctrl_loss_tmo() {
    let target = TargetProcess::start(&format!("{}{}", target_section(), memory_volume("m", MIB, false)));
    for opt in [["--ctrl_loss_tmo=30"].as_slice(), &["--ctrl_loss_tmo", "0"], &["--ctrl-loss-timeout=2m"]] {
        let mut args = vec!["--target", target.url.as_str()];
        args.extend(opt);
        args.push("list");
        let out = rdmablk(&args, None);
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "{args:?}: {}", String::from_utf8_lossy(&out.stderr));
        let rows: Vec<Vec<&str>> = stdout.lines().map(|l| l.split_whitespace().collect()).collect();
        assert!(rows.len() == 2 && rows[0][0] == "NAME", "{args:?}: a header: {stdout}");
        assert!(rows[1][0] == "m" && rows[1][1..4] == ["1.0", "MiB", "1048576"], "{args:?}: {stdout}");
    }
    let out = rdmablk(&["--target", &target.url, "--ctrl_loss_tmo=-1", "list"], None);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(stderr.starts_with("rdmablk: error: ") && stderr.contains("\"-1\"") && stderr.contains("negative"), "{stderr}");
}
