//! Metrics: per-reactor counters written without locks, aggregated when
//! scraped into the Prometheus text format, and the minimal HTTP/1.1
//! responder that serves them from the control thread.
//!
//! Every counter has exactly one writer, its reactor, which updates it with
//! a relaxed load and store (no locked instruction, no allocation). A scrape
//! reads them all with relaxed loads and sums over reactors; totals may be a
//! few operations apart from each other, never torn.
//!
//! Latency histograms have fixed log2 buckets: bucket `k` counts commands
//! that took at most 2^k microseconds (1 µs .. 2^26 µs ≈ 67 s), plus one
//! overflow bucket. Latency runs from the receive completion of the command
//! capsule to the moment its response is posted.
//!
//! No label takes a new value per session, connection or controller (ids,
//! peer ports): a series per session would grow the scraper's database with
//! every reconnect. Labels name volumes, reactors, opcodes, reasons and host
//! ids, the last capped at [`MAX_HOST_LABELS`] per scrape.

mod process;

pub use process::ProcessStats;

use std::fmt::Write as _;
use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicI32, AtomicU64, Ordering::Relaxed};
use std::time::{Duration, Instant};

use rdmablk_common::protocol::Opcode;

use crate::sys::{Epoll, READABLE, WRITABLE};

/// The I/O opcodes counted per volume, in this order.
pub const IO_OPS: [Opcode; 5] = [Opcode::Read, Opcode::Write, Opcode::Flush, Opcode::Discard, Opcode::WriteZeroes];

/// Index of an I/O opcode in [`IO_OPS`].
pub fn op_index(op: Opcode) -> Option<usize> {
    IO_OPS.iter().position(|&o| o == op)
}

fn op_label(op: Opcode) -> &'static str {
    match op {
        Opcode::Read => "read",
        Opcode::Write => "write",
        Opcode::Flush => "flush",
        Opcode::Discard => "discard",
        Opcode::WriteZeroes => "write_zeroes",
        _ => "other",
    }
}

/// Number of finite latency buckets: upper bounds 2^0 .. 2^(N-1) microseconds.
pub const LATENCY_BUCKETS: usize = 27;

/// The bucket a latency falls in (`LATENCY_BUCKETS` is the overflow bucket).
pub fn latency_bucket(latency: Duration) -> usize {
    let us = latency.as_nanos().div_ceil(1000).min(u64::MAX as u128) as u64;
    let k = if us <= 1 { 0 } else { (64 - (us - 1).leading_zeros()) as usize };
    k.min(LATENCY_BUCKETS)
}

/// A counter or gauge with a single writer.
#[derive(Debug, Default)]
pub struct Counter(AtomicU64);

impl Counter {
    /// Adds `v` (single writer: a plain load and store).
    #[inline]
    pub fn add(&self, v: u64) {
        self.0.store(self.0.load(Relaxed).wrapping_add(v), Relaxed);
    }
    /// Sets the value (gauges).
    #[inline]
    pub fn set(&self, v: u64) {
        self.0.store(v, Relaxed);
    }
    /// The current value.
    pub fn get(&self) -> u64 {
        self.0.load(Relaxed)
    }
}

/// Counters of one opcode on one volume, written by one reactor.
#[derive(Debug, Default)]
pub struct OpCounters {
    pub ops: Counter,
    pub bytes: Counter,
    pub errors: Counter,
    pub latency_ns: Counter,
    pub buckets: [Counter; LATENCY_BUCKETS + 1],
}

impl OpCounters {
    /// Records one finished command: `bytes` moved (0 on failure), and its
    /// latency, or `None` when it was not timed ([`clock_is_cheap`]): it
    /// then counts in the operations, bytes and errors but not in the
    /// histogram.
    #[inline]
    pub fn record(&self, bytes: u64, ok: bool, latency: Option<Duration>) {
        self.ops.add(1);
        if ok {
            self.bytes.add(bytes);
        } else {
            self.errors.add(1);
        }
        if let Some(latency) = latency {
            self.latency_ns.add(latency.as_nanos().min(u64::MAX as u128) as u64);
            self.buckets[latency_bucket(latency)].add(1);
        }
    }
}

/// NVMe-oF counters of what happens to queues and controllers, for the
/// metrics endpoint (every reactor's queues write them, rarely: atomic
/// adds). What each command counts is its reactor's
/// ([`NvmeReactorStats`]).
#[derive(Debug, Default)]
pub struct NvmeStats {
    /// Connected queues (admin and I/O).
    pub queues: AtomicU64,
    /// Connections ended by a termination request for a broken PDU.
    pub terminations: AtomicU64,
    /// Controllers torn down because their host sent no keep-alive.
    pub keep_alive_timeouts: AtomicU64,
    /// Controllers with KATO 0 ended by `target.idle_timeout`: no I/O queue,
    /// nothing in flight, no command for that long.
    pub idle_timeouts: AtomicU64,
    /// Admin Connects refused by `max_controllers` or `max_controllers_per_host`.
    pub controllers_refused: AtomicU64,
    /// Anonymous controllers torn down for hosts that authenticate.
    pub controllers_evicted: AtomicU64,
    /// Queues whose host authenticated (DH-HMAC-CHAP), and the attempts
    /// refused, by [`NvmeStats::AUTH_FAILURES`].
    pub authenticated: AtomicU64,
    pub auth_failures: [AtomicU64; 6],
}

impl NvmeStats {
    pub const CLASSES: [&'static str; 6] = ["read", "write", "flush", "write_zeroes", "dsm", "admin"];
    /// Why an NVMe in-band authentication was refused: a wrong response
    /// (the host does not hold its secret), the host's refusal of the
    /// controller's (FAILURE2), a message out of order, replayed, malformed
    /// or missing, a hash or group the host does not offer, no
    /// authentication within `target.handshake_timeout`, the worker that
    /// computes DH values having 64 waiting.
    pub const AUTH_FAILURES: [&'static str; 6] = ["wrong_response", "refused_by_host", "protocol", "not_usable", "timeout", "busy"];

    /// The class of a command on an I/O queue (`io`) or the admin queue.
    pub fn class(io: bool, opcode: u8) -> usize {
        use rdmablk_common::nvme::sqe::io_opcode;
        match (io, opcode) {
            (true, io_opcode::READ) => 0,
            (true, io_opcode::WRITE) => 1,
            (true, io_opcode::FLUSH) => 2,
            (true, io_opcode::WRITE_ZEROES) => 3,
            (true, io_opcode::DATASET_MANAGEMENT) => 4,
            _ => 5,
        }
    }

    pub fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Relaxed);
    }
}

/// One reactor's counts of the NVMe-oF commands its queues received, with
/// a single writer like the rest of [`ReactorStats`], summed on scrape.
#[derive(Debug, Default)]
pub struct NvmeReactorStats {
    /// Commands received, by [`NvmeStats::CLASSES`].
    pub commands: [Counter; 6],
    /// Commands answered with an error status.
    pub errors: Counter,
    pub bytes_read: Counter,
    pub bytes_written: Counter,
}

/// Counters of the limits, for the metrics endpoint (several writers).
#[derive(Debug, Default)]
pub struct LimitCounters {
    /// Connections accepted and not yet past CONNECT, now.
    pub handshakes: AtomicU64,
    /// Connections dropped because CONNECT did not succeed in time.
    pub handshakes_timed_out: AtomicU64,
    /// Connected queue pairs torn down by `target.idle_timeout`.
    pub idle_timeouts: AtomicU64,
    /// Connections refused because `max_handshakes` were in progress.
    pub refused_handshakes: AtomicU64,
    /// Connections refused because `max_handshakes_per_address` from their
    /// source address were in progress.
    pub refused_handshakes_per_address: AtomicU64,
    /// Connections refused because `max_connections_per_address` from their
    /// source address were open.
    pub refused_connections_per_address: AtomicU64,
    /// CONNECTs refused by `max_sessions`.
    pub refused_sessions: AtomicU64,
    /// CONNECTs refused by `max_anonymous_sessions`.
    pub refused_anonymous_sessions: AtomicU64,
    /// Anonymous sessions evicted from a full table for authenticated ones.
    pub evicted_sessions: AtomicU64,
    /// Joins refused by `max_queues_per_session`.
    pub refused_queues: AtomicU64,
    /// Sessions retired by the reconnect fence (a newer session replaced them).
    pub fences: AtomicU64,
    /// CONNECTs answered `FenceTimeout`: the replaced session had disk I/O
    /// in flight for longer than `target.fence_timeout`.
    pub fence_timeouts: AtomicU64,
    /// Commands of retired sessions dropped before they reached the disk.
    pub fence_dropped_commands: AtomicU64,
}

/// Whether reading the clock costs no system call here: the kernel's
/// clocksource can be read from user space (the vDSO). Where it cannot
/// (`hpet`, `acpi_pm`: some virtual machines), the NVMe-oF front end does
/// not time its commands (a clock read at the answer would be a system
/// call per command).
/// Unknown (no sysfs): assumed cheap. Read once.
pub fn clock_is_cheap() -> bool {
    static CHEAP: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *CHEAP.get_or_init(|| {
        match std::fs::read_to_string("/sys/devices/system/clocksource/clocksource0/current_clocksource") {
            Ok(name) => vdso_clocksource(name.trim()),
            Err(_) => true,
        }
    })
}

/// Whether the vDSO reads clocksource `name` without entering the kernel.
fn vdso_clocksource(name: &str) -> bool {
    matches!(name, "tsc" | "kvm-clock" | "arch_sys_counter" | "hyperv_clocksource_tsc_page" | "riscv_clocksource")
}

/// One reactor's counters for one volume (its own cache lines).
#[derive(Debug, Default)]
#[repr(align(128))]
pub struct VolumeReactorStats {
    pub ops: [OpCounters; IO_OPS.len()],
}

/// A volume's counters: one block per reactor, summed on scrape. Kept when a reload changes only the volume's
/// read-only flag.
#[derive(Debug)]
pub struct VolumeStats {
    per_reactor: Box<[VolumeReactorStats]>,
}

/// Summed counters of one opcode.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct OpTotals {
    pub ops: u64,
    pub bytes: u64,
    pub errors: u64,
    pub latency_ns: u64,
    pub buckets: Vec<u64>,
}

impl VolumeStats {
    /// Counters for `reactors` reactors.
    pub fn new(reactors: usize) -> VolumeStats {
        VolumeStats { per_reactor: (0..reactors.max(1)).map(|_| VolumeReactorStats::default()).collect() }
    }

    /// The block reactor `r` writes.
    #[inline]
    pub fn reactor(&self, r: usize) -> &VolumeReactorStats {
        debug_assert!(r < self.per_reactor.len(), "reactor {r} of {}", self.per_reactor.len());
        &self.per_reactor[r]
    }

    /// The sum over reactors for opcode index `i` of [`IO_OPS`].
    pub fn totals(&self, i: usize) -> OpTotals {
        let mut t = OpTotals { buckets: vec![0; LATENCY_BUCKETS + 1], ..Default::default() };
        for r in self.per_reactor.iter() {
            let c = &r.ops[i];
            t.ops += c.ops.get();
            t.bytes += c.bytes.get();
            t.errors += c.errors.get();
            t.latency_ns += c.latency_ns.get();
            for (b, x) in t.buckets.iter_mut().zip(c.buckets.iter()) {
                *b += x.get();
            }
        }
        t
    }
}

/// What one reactor reports.
#[derive(Debug)]
#[repr(align(128))]
pub struct ReactorStats {
    /// Kernel thread id, for CPU time (0 until the thread started).
    pub tid: AtomicI32,
    /// The CPU it is pinned to, or -1.
    pub cpu: AtomicI32,
    /// Queue pairs it serves now.
    pub queue_pairs: Counter,
    /// Commands received (every opcode, including refused ones; rdmablk v1
    /// and NVMe-oF).
    pub commands: Counter,
    /// NVMe-oF commands, by class, and their errors and bytes.
    pub nvme: NvmeReactorStats,
    /// Pool chunks it owns.
    pub pool_chunks: Counter,
    /// Pool chunks in use by commands (held, with the kernel or with the
    /// fabric); not those readahead holds (`readahead_chunks`).
    pub pool_in_use: Counter,
    /// Commands waiting for a free chunk (back-pressure).
    pub pool_waiting: Counter,
    /// Times it went to sleep (in the ring or in epoll) because it had
    /// nothing to do.
    pub idle_waits: Counter,
    /// Answers that waited for a response slot: every slot held an answer
    /// whose send completion had not come back yet.
    pub answers_delayed: Counter,
    /// Commands answered `OutOfBuffers`: they waited longer than
    /// `target.chunk_wait_timeout` for a pool chunk.
    pub chunk_wait_timeouts: Counter,
    /// Chunks read ahead of sequential streams (`target.readahead`).
    pub readahead_issued: Counter,
    /// Pieces of READs served from chunks read ahead (no disk read of their own).
    pub readahead_hits: Counter,
    /// Chunks read ahead and dropped before they served anything (not read
    /// within a second, given back to a short pool, volume gone, read failed).
    pub readahead_unused: Counter,
    /// Chunks read ahead and dropped because a write overlapped them.
    pub readahead_invalidated: Counter,
    /// Pool chunks readahead holds now (in flight or cached).
    pub readahead_chunks: Counter,
    /// Loop turns; the control thread checks it advances (watchdog).
    pub heartbeat: Counter,
    /// Nanoseconds spent in loop turns that found work. With `busy_poll`
    /// the thread's CPU time is all of its wall time; this is the part that
    /// was not polling for nothing.
    pub busy_ns: Counter,
}

impl Default for ReactorStats {
    fn default() -> Self {
        ReactorStats {
            tid: AtomicI32::new(0),
            cpu: AtomicI32::new(-1),
            queue_pairs: Counter::default(),
            commands: Counter::default(),
            nvme: NvmeReactorStats::default(),
            pool_chunks: Counter::default(),
            pool_in_use: Counter::default(),
            pool_waiting: Counter::default(),
            idle_waits: Counter::default(),
            answers_delayed: Counter::default(),
            chunk_wait_timeouts: Counter::default(),
            readahead_issued: Counter::default(),
            readahead_hits: Counter::default(),
            readahead_unused: Counter::default(),
            readahead_invalidated: Counter::default(),
            readahead_chunks: Counter::default(),
            heartbeat: Counter::default(),
            busy_ns: Counter::default(),
        }
    }
}

/// A volume as the scrape sees it.
pub struct VolumeView<'a> {
    pub name: &'a str,
    pub backend: &'static str,
    pub read_only: bool,
    pub size: u64,
    pub stats: &'a VolumeStats,
}

/// A session as the scrape sees it.
pub struct SessionView {
    /// The host id it connected with.
    pub host: String,
    /// Queue pairs of the session per reactor.
    pub queue_pairs: Vec<(usize, u32)>,
}

/// Everything one scrape renders.
pub struct Scrape<'a> {
    pub target: &'a str,
    pub uptime: Duration,
    pub volumes: Vec<VolumeView<'a>>,
    pub reactors: &'a [std::sync::Arc<ReactorStats>],
    pub chunk_size: u64,
    pub sessions: Vec<SessionView>,
    pub reloads_ok: u64,
    pub reloads_failed: u64,
    /// Handshakes and refusals by the connection limits.
    pub limits: Option<&'a LimitCounters>,
    /// The NVMe-oF front end's counters and live controllers, when it listens.
    pub nvme: Option<(&'a NvmeStats, usize)>,
}

/// What `rdmablk_build_info` reports: this crate's version, the commit and
/// the compiler it was built from (build.rs; `unknown` when there was no
/// git to ask).
pub const BUILD_VERSION: &str = env!("CARGO_PKG_VERSION");
pub const BUILD_GIT_COMMIT: &str = env!("RDMABLK_GIT_COMMIT");
pub const BUILD_RUSTC_VERSION: &str = env!("RDMABLK_RUSTC_VERSION");

/// Most host ids a scrape names in `rdmablk_host_*`: a host id is what the
/// initiator says it is, so anonymous peers could make up a new one per
/// session. The hosts with the most queue pairs keep their names; the rest
/// are summed under [`OTHER_HOSTS`].
pub const MAX_HOST_LABELS: usize = 64;
/// The `host` label of the hosts past [`MAX_HOST_LABELS`].
pub const OTHER_HOSTS: &str = "(other)";

/// Sessions and queue pairs per host id: the `MAX_HOST_LABELS` hosts with
/// the most queue pairs (ties by name), then the rest as [`OTHER_HOSTS`].
fn per_host(sessions: &[SessionView]) -> Vec<(&str, u64, u64)> {
    let mut hosts = std::collections::BTreeMap::<&str, (u64, u64)>::new();
    for sess in sessions {
        let h = hosts.entry(sess.host.as_str()).or_default();
        h.0 += 1;
        h.1 += sess.queue_pairs.iter().map(|&(_, n)| n as u64).sum::<u64>();
    }
    let mut hosts: Vec<(&str, u64, u64)> = hosts.into_iter().map(|(h, (s, q))| (h, s, q)).collect();
    hosts.sort_by(|a, b| b.2.cmp(&a.2).then(a.0.cmp(b.0)));
    if hosts.len() > MAX_HOST_LABELS {
        let (s, q) = hosts.drain(MAX_HOST_LABELS..).fold((0, 0), |(s, q), h| (s + h.1, q + h.2));
        hosts.push((OTHER_HOSTS, s, q));
    }
    hosts
}

/// Escapes a label value.
fn esc(s: &str) -> String {
    s.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n")
}

fn header(out: &mut String, name: &str, kind: &str, help: &str) {
    let _ = writeln!(out, "# HELP {name} {help}");
    let _ = writeln!(out, "# TYPE {name} {kind}");
}

/// Renders the Prometheus text exposition format (version 0.0.4).
pub fn render(s: &Scrape<'_>) -> String {
    let mut out = String::with_capacity(16 << 10);
    header(&mut out, "rdmablk_target_info", "gauge", "Constant 1, labelled with the target name.");
    let _ = writeln!(out, "rdmablk_target_info{{target=\"{}\"}} 1", esc(s.target));
    header(&mut out, "rdmablk_build_info", "gauge", "Constant 1, labelled with the version, git commit and rustc version the target was built from.");
    let _ = writeln!(
        out,
        "rdmablk_build_info{{version=\"{}\",git_commit=\"{}\",rustc=\"{}\"}} 1",
        esc(BUILD_VERSION),
        esc(BUILD_GIT_COMMIT),
        esc(BUILD_RUSTC_VERSION)
    );
    if let Ok(p) = ProcessStats::read() {
        render_process(&mut out, &p);
    }
    header(&mut out, "rdmablk_uptime_seconds", "gauge", "Seconds since the target started.");
    let _ = writeln!(out, "rdmablk_uptime_seconds {:.3}", s.uptime.as_secs_f64());
    header(&mut out, "rdmablk_reloads_total", "counter", "Configuration reloads (SIGHUP), by result.");
    let _ = writeln!(out, "rdmablk_reloads_total{{result=\"ok\"}} {}", s.reloads_ok);
    let _ = writeln!(out, "rdmablk_reloads_total{{result=\"failed\"}} {}", s.reloads_failed);

    header(&mut out, "rdmablk_volume_info", "gauge", "Constant 1 per served volume, with its backend and access.");
    for v in &s.volumes {
        let _ = writeln!(
            out,
            "rdmablk_volume_info{{volume=\"{}\",backend=\"{}\",access=\"{}\"}} 1",
            esc(v.name),
            v.backend,
            if v.read_only { "ro" } else { "rw" }
        );
    }
    header(&mut out, "rdmablk_volume_size_bytes", "gauge", "Volume size.");
    for v in &s.volumes {
        let _ = writeln!(out, "rdmablk_volume_size_bytes{{volume=\"{}\"}} {}", esc(v.name), v.size);
    }
    let totals: Vec<Vec<OpTotals>> =
        s.volumes.iter().map(|v| (0..IO_OPS.len()).map(|i| v.stats.totals(i)).collect()).collect();
    for (name, help, pick) in [
        ("rdmablk_volume_ops_total", "Commands finished, per volume and opcode (rdmablk v1 and NVMe-oF).", 0),
        ("rdmablk_volume_bytes_total", "Bytes transferred by successful commands (discard and write-zeroes: bytes covered).", 1),
        ("rdmablk_volume_errors_total", "Commands that failed, per volume and opcode (including refused ones).", 2),
    ] {
        header(&mut out, name, "counter", help);
        for (v, t) in s.volumes.iter().zip(&totals) {
            for (i, op) in IO_OPS.iter().enumerate() {
                let x = match pick {
                    0 => t[i].ops,
                    1 => t[i].bytes,
                    _ => t[i].errors,
                };
                let _ = writeln!(out, "{name}{{volume=\"{}\",op=\"{}\"}} {x}", esc(v.name), op_label(*op));
            }
        }
    }
    let hist = "rdmablk_volume_latency_seconds";
    header(&mut out, hist, "histogram", "Command latency, from the capsule's arrival to the response (NVMe-oF: to the end of its disk work), per volume and opcode; NVMe-oF commands only where the clock is cheap.");
    for (v, t) in s.volumes.iter().zip(&totals) {
        for (i, op) in IO_OPS.iter().enumerate() {
            let labels = format!("volume=\"{}\",op=\"{}\"", esc(v.name), op_label(*op));
            let mut cum = 0;
            for k in 0..LATENCY_BUCKETS {
                cum += t[i].buckets[k];
                let le = (1u64 << k) as f64 / 1e6;
                let _ = writeln!(out, "{hist}_bucket{{{labels},le=\"{le}\"}} {cum}");
            }
            cum += t[i].buckets[LATENCY_BUCKETS];
            let _ = writeln!(out, "{hist}_bucket{{{labels},le=\"+Inf\"}} {cum}");
            let _ = writeln!(out, "{hist}_sum{{{labels}}} {}", t[i].latency_ns as f64 / 1e9);
            let _ = writeln!(out, "{hist}_count{{{labels}}} {}", t[i].ops);
        }
    }

    if let Some((n, controllers)) = s.nvme {
        use std::sync::atomic::Ordering::Relaxed;
        header(&mut out, "rdmablk_nvme_controllers", "gauge", "NVMe-oF controllers alive (discovery included).");
        let _ = writeln!(out, "rdmablk_nvme_controllers {controllers}");
        header(&mut out, "rdmablk_nvme_queues", "gauge", "NVMe-oF queues connected (admin and I/O).");
        let _ = writeln!(out, "rdmablk_nvme_queues {}", n.queues.load(Relaxed));
        let sum = |f: fn(&NvmeReactorStats) -> &Counter| -> u64 { s.reactors.iter().map(|r| f(&r.nvme).get()).sum() };
        header(&mut out, "rdmablk_nvme_commands_total", "counter", "NVMe-oF commands received, by class.");
        for (i, class) in NvmeStats::CLASSES.iter().enumerate() {
            let n: u64 = s.reactors.iter().map(|r| r.nvme.commands[i].get()).sum();
            let _ = writeln!(out, "rdmablk_nvme_commands_total{{class=\"{class}\"}} {n}");
        }
        for (name, help, v) in [
            ("rdmablk_nvme_errors_total", "NVMe-oF commands answered with an error status.", sum(|n| &n.errors)),
            ("rdmablk_nvme_read_bytes_total", "Bytes read by NVMe-oF hosts.", sum(|n| &n.bytes_read)),
            ("rdmablk_nvme_written_bytes_total", "Bytes written by NVMe-oF hosts.", sum(|n| &n.bytes_written)),
        ] {
            header(&mut out, name, "counter", help);
            let _ = writeln!(out, "{name} {v}");
        }
        for (name, help, v) in [
            ("rdmablk_nvme_terminations_total", "NVMe/TCP connections ended for a broken PDU.", &n.terminations),
            ("rdmablk_nvme_keep_alive_timeouts_total", "NVMe-oF controllers torn down for a missed keep-alive.", &n.keep_alive_timeouts),
            (
                "rdmablk_nvme_controllers_idle_timed_out_total",
                "NVMe-oF controllers with KATO 0 ended by target.idle_timeout (no I/O queue, nothing in flight).",
                &n.idle_timeouts,
            ),
            (
                "rdmablk_nvme_controllers_refused_total",
                "Admin Connects refused by target.max_controllers or max_controllers_per_host.",
                &n.controllers_refused,
            ),
            (
                "rdmablk_nvme_controllers_evicted_total",
                "Anonymous NVMe-oF controllers torn down from a full table (target.max_controllers) for hosts that authenticate.",
                &n.controllers_evicted,
            ),
            ("rdmablk_nvme_authentications_total", "NVMe-oF queues whose host authenticated (DH-HMAC-CHAP).", &n.authenticated),
        ] {
            header(&mut out, name, "counter", help);
            let _ = writeln!(out, "{name} {}", v.load(Relaxed));
        }
        header(&mut out, "rdmablk_nvme_auth_failures_total", "counter", "NVMe-oF in-band authentications refused, by reason.");
        for (i, reason) in NvmeStats::AUTH_FAILURES.iter().enumerate() {
            let _ = writeln!(out, "rdmablk_nvme_auth_failures_total{{reason=\"{reason}\"}} {}", n.auth_failures[i].load(Relaxed));
        }
    }
    header(&mut out, "rdmablk_sessions_connected", "gauge", "Sessions with at least one connected queue pair.");
    let _ = writeln!(out, "rdmablk_sessions_connected {}", s.sessions.len());
    let hosts = per_host(&s.sessions);
    header(&mut out, "rdmablk_host_sessions", "gauge", "Sessions connected, per host id (past 64 hosts, the fewest queue pairs as host=\"(other)\").");
    for (host, sessions, _) in &hosts {
        let _ = writeln!(out, "rdmablk_host_sessions{{host=\"{}\"}} {sessions}", esc(host));
    }
    header(&mut out, "rdmablk_host_queue_pairs", "gauge", "Queue pairs of the sessions of each host id (past 64 hosts, the fewest as host=\"(other)\").");
    for (host, _, qps) in &hosts {
        let _ = writeln!(out, "rdmablk_host_queue_pairs{{host=\"{}\"}} {qps}", esc(host));
    }
    if let Some(l) = s.limits {
        let get = |c: &std::sync::atomic::AtomicU64| c.load(Relaxed);
        header(&mut out, "rdmablk_handshakes_in_progress", "gauge", "Connections accepted and not yet past a successful CONNECT.");
        let _ = writeln!(out, "rdmablk_handshakes_in_progress {}", get(&l.handshakes));
        header(&mut out, "rdmablk_handshakes_timed_out_total", "counter", "Connections dropped by target.handshake_timeout.");
        let _ = writeln!(out, "rdmablk_handshakes_timed_out_total {}", get(&l.handshakes_timed_out));
        header(&mut out, "rdmablk_idle_timeouts_total", "counter", "Connected queue pairs torn down by target.idle_timeout (no command, no keep-alive).");
        let _ = writeln!(out, "rdmablk_idle_timeouts_total {}", get(&l.idle_timeouts));
        header(&mut out, "rdmablk_fences_total", "counter", "Sessions retired by the reconnect fence (a newer session of the host replaced them).");
        let _ = writeln!(out, "rdmablk_fences_total {}", get(&l.fences));
        header(&mut out, "rdmablk_fence_timeouts_total", "counter", "CONNECTs answered FenceTimeout: the replaced session's disk I/O outlasted target.fence_timeout.");
        let _ = writeln!(out, "rdmablk_fence_timeouts_total {}", get(&l.fence_timeouts));
        header(&mut out, "rdmablk_fence_dropped_commands_total", "counter", "Commands of retired sessions dropped before they reached the disk.");
        let _ = writeln!(out, "rdmablk_fence_dropped_commands_total {}", get(&l.fence_dropped_commands));
        header(&mut out, "rdmablk_sessions_evicted_total", "counter", "Anonymous sessions evicted from a full session table for authenticated hosts.");
        let _ = writeln!(out, "rdmablk_sessions_evicted_total {}", get(&l.evicted_sessions));
        header(&mut out, "rdmablk_connections_refused_total", "counter", "Connections and CONNECTs refused by a limit, by the limit.");
        for (reason, c) in [
            ("max_handshakes", &l.refused_handshakes),
            ("max_handshakes_per_address", &l.refused_handshakes_per_address),
            ("max_connections_per_address", &l.refused_connections_per_address),
            ("max_sessions", &l.refused_sessions),
            ("max_anonymous_sessions", &l.refused_anonymous_sessions),
            ("max_queues_per_session", &l.refused_queues),
        ] {
            let _ = writeln!(out, "rdmablk_connections_refused_total{{reason=\"{reason}\"}} {}", get(c));
        }
    }
    let qps: u64 = s.reactors.iter().map(|r| r.queue_pairs.get()).sum();
    header(&mut out, "rdmablk_queue_pairs_connected", "gauge", "Queue pairs connected (including those not yet past CONNECT).");
    let _ = writeln!(out, "rdmablk_queue_pairs_connected {qps}");

    type Gauge = (&'static str, &'static str, &'static str, fn(&ReactorStats) -> u64);
    let per_reactor: [Gauge; 13] = [
        ("rdmablk_reactor_queue_pairs", "gauge", "Queue pairs served by each reactor.", |r| r.queue_pairs.get()),
        ("rdmablk_reactor_commands_total", "counter", "Commands received by each reactor.", |r| r.commands.get()),
        ("rdmablk_buffer_pool_chunks", "gauge", "Registered pool chunks owned by each reactor.", |r| r.pool_chunks.get()),
        (
            "rdmablk_buffer_pool_chunks_in_use",
            "gauge",
            "Pool chunks in use by commands (CPU, kernel or fabric); readahead's are in rdmablk_readahead_chunks.",
            |r| r.pool_in_use.get(),
        ),
        ("rdmablk_buffer_pool_waiting_commands", "gauge", "Commands queued for a free pool chunk.", |r| r.pool_waiting.get()),
        ("rdmablk_reactor_idle_waits_total", "counter", "Times each reactor went to sleep with nothing to do.", |r| r.idle_waits.get()),
        (
            "rdmablk_reactor_answers_delayed_total",
            "counter",
            "Answers that waited for a response slot (every slot's send completion was still outstanding).",
            |r| r.answers_delayed.get(),
        ),
        (
            "rdmablk_chunk_wait_timeouts_total",
            "counter",
            "Commands answered OutOfBuffers: they waited longer than target.chunk_wait_timeout for a pool chunk.",
            |r| r.chunk_wait_timeouts.get(),
        ),
        ("rdmablk_readahead_chunks_issued_total", "counter", "Pool chunks read ahead of sequential READ streams.", |r| r.readahead_issued.get()),
        ("rdmablk_readahead_hits_total", "counter", "READ pieces served from chunks read ahead, without a disk read of their own.", |r| {
            r.readahead_hits.get()
        }),
        (
            "rdmablk_readahead_chunks_unused_total",
            "counter",
            "Chunks read ahead and dropped unused (not read within a second, given back to a short pool, volume gone, read failed).",
            |r| r.readahead_unused.get(),
        ),
        (
            "rdmablk_readahead_chunks_invalidated_total",
            "counter",
            "Chunks read ahead and dropped because a write overlapped them.",
            |r| r.readahead_invalidated.get(),
        ),
        ("rdmablk_readahead_chunks", "gauge", "Pool chunks readahead holds now (reading or cached).", |r| r.readahead_chunks.get()),
    ];
    for (name, kind, help, f) in per_reactor {
        header(&mut out, name, kind, help);
        for (i, r) in s.reactors.iter().enumerate() {
            let _ = writeln!(out, "{name}{{reactor=\"{i}\"}} {}", f(r));
        }
    }
    header(&mut out, "rdmablk_buffer_pool_bytes_in_use", "gauge", "Bytes of the registered buffer pool in use by commands, all reactors (not readahead's).");
    let in_use: u64 = s.reactors.iter().map(|r| r.pool_in_use.get()).sum();
    let _ = writeln!(out, "rdmablk_buffer_pool_bytes_in_use {}", in_use * s.chunk_size);
    header(&mut out, "rdmablk_reactor_busy_seconds_total", "counter", "Time each reactor spent in loop turns that found work (with busy_poll, the CPU time less the empty polls).");
    for (i, r) in s.reactors.iter().enumerate() {
        let _ = writeln!(out, "rdmablk_reactor_busy_seconds_total{{reactor=\"{i}\"}} {:.6}", r.busy_ns.get() as f64 / 1e9);
    }
    header(&mut out, "rdmablk_reactor_cpu_seconds_total", "counter", "CPU time (user + system) of each reactor thread.");
    for (i, r) in s.reactors.iter().enumerate() {
        let tid = r.tid.load(Relaxed);
        let cpu = r.cpu.load(Relaxed);
        let secs = if tid > 0 { crate::sys::thread_cpu_time(tid).map_or(0.0, |d| d.as_secs_f64()) } else { 0.0 };
        let pinned = if cpu >= 0 { cpu.to_string() } else { "none".to_owned() };
        let _ = writeln!(out, "rdmablk_reactor_cpu_seconds_total{{reactor=\"{i}\",cpu=\"{pinned}\"}} {secs:.3}");
    }
    out
}

/// The `process_*` metrics, named and described as the Prometheus client
/// libraries do.
fn render_process(out: &mut String, p: &ProcessStats) {
    header(out, "process_start_time_seconds", "gauge", "Start time of the process since unix epoch in seconds.");
    let _ = writeln!(out, "process_start_time_seconds {:.2}", p.start_time_seconds);
    header(out, "process_cpu_seconds_total", "counter", "Total user and system CPU time spent in seconds.");
    let _ = writeln!(out, "process_cpu_seconds_total {:.2}", p.cpu_seconds);
    header(out, "process_resident_memory_bytes", "gauge", "Resident memory size in bytes.");
    let _ = writeln!(out, "process_resident_memory_bytes {}", p.resident_bytes);
    header(out, "process_virtual_memory_bytes", "gauge", "Virtual memory size in bytes.");
    let _ = writeln!(out, "process_virtual_memory_bytes {}", p.virtual_bytes);
    header(out, "process_open_fds", "gauge", "Number of open file descriptors.");
    let _ = writeln!(out, "process_open_fds {}", p.open_fds);
    header(out, "process_max_fds", "gauge", "Maximum number of open file descriptors.");
    // Prometheus spells an unlimited maximum +Inf.
    let _ = writeln!(out, "process_max_fds {}", p.max_fds.map_or("+Inf".to_owned(), |m| m.to_string()));
}

// ---------------------------------------------------------------------------
// HTTP

/// Most simultaneous scrape connections.
const MAX_CONNS: usize = 32;
/// Longest request head accepted.
const MAX_REQUEST: usize = 8192;
/// A connection that does not finish in this time is dropped.
const CONN_TIMEOUT: Duration = Duration::from_secs(5);

struct Conn {
    stream: TcpStream,
    inbuf: Vec<u8>,
    out: Vec<u8>,
    written: usize,
    deadline: Instant,
}

/// A minimal HTTP/1.1 responder, driven by the caller's epoll: `GET
/// /metrics` answers the scrape, anything else 404 (or 405 for other
/// methods). One request per connection (`Connection: close`).
pub struct HttpServer {
    listener: TcpListener,
    local: SocketAddr,
    conns: Vec<Option<Conn>>,
    token_base: u64,
}

/// What the caller answers for a path.
pub type Handler<'a> = &'a mut dyn FnMut(&str) -> Option<String>;

impl HttpServer {
    /// Binds (nonblocking). Connection `i` gets epoll token `token_base + i`.
    pub fn bind(addr: SocketAddr, token_base: u64) -> io::Result<HttpServer> {
        let listener = TcpListener::bind(addr)?;
        listener.set_nonblocking(true)?;
        let local = listener.local_addr()?;
        Ok(HttpServer { listener, local, conns: (0..MAX_CONNS).map(|_| None).collect(), token_base })
    }

    /// The bound address (port 0 resolved).
    pub fn local_addr(&self) -> SocketAddr {
        self.local
    }

    /// The listening socket, for epoll.
    pub fn fd(&self) -> RawFd {
        self.listener.as_raw_fd()
    }

    /// Whether `token` names one of this server's connections.
    pub fn owns(&self, token: u64) -> bool {
        token >= self.token_base && token < self.token_base + MAX_CONNS as u64
    }

    /// Accepts pending connections.
    pub fn accept(&mut self, epoll: &Epoll) {
        loop {
            match self.listener.accept() {
                Ok((stream, _)) => {
                    let Some(slot) = self.conns.iter().position(Option::is_none) else {
                        drop(stream); // too many scrapers at once
                        continue;
                    };
                    if stream.set_nonblocking(true).is_err()
                        || epoll.add_events(stream.as_raw_fd(), self.token_base + slot as u64, READABLE).is_err()
                    {
                        continue;
                    }
                    self.conns[slot] = Some(Conn {
                        stream,
                        inbuf: Vec::with_capacity(512),
                        out: Vec::new(),
                        written: 0,
                        deadline: Instant::now() + CONN_TIMEOUT,
                    });
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    tracing::debug!("metrics: accept failed: {e}");
                    return;
                }
            }
        }
    }

    /// Makes progress on connection `token`; `handler` renders a path.
    pub fn ready(&mut self, token: u64, epoll: &Epoll, handler: Handler<'_>) {
        let slot = (token - self.token_base) as usize;
        let Some(conn) = self.conns[slot].as_mut() else { return };
        let done = if conn.out.is_empty() { Self::read_request(conn, handler) } else { Some(false) };
        let finished = match done {
            None => true,         // error or EOF: drop
            Some(false) => false, // response staged or still reading
            Some(true) => true,
        };
        if finished {
            self.close(slot, epoll);
            return;
        }
        let conn = self.conns[slot].as_mut().expect("live");
        if conn.out.is_empty() {
            return; // need more of the request
        }
        loop {
            match conn.stream.write(&conn.out[conn.written..]) {
                Ok(0) => break,
                Ok(n) => {
                    conn.written += n;
                    if conn.written == conn.out.len() {
                        let _ = conn.stream.shutdown(std::net::Shutdown::Write);
                        self.close(slot, epoll);
                        return;
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    let _ = epoll.modify(conn.stream.as_raw_fd(), token, WRITABLE);
                    return;
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(_) => break,
            }
        }
        self.close(slot, epoll);
    }

    /// Reads what is there. `None`: drop the connection; `Some(false)`:
    /// keep it (a response may have been staged in `out`).
    fn read_request(conn: &mut Conn, handler: Handler<'_>) -> Option<bool> {
        let mut buf = [0u8; 1024];
        loop {
            match conn.stream.read(&mut buf) {
                Ok(0) => return None,
                Ok(n) => {
                    conn.inbuf.extend_from_slice(&buf[..n]);
                    if conn.inbuf.len() > MAX_REQUEST {
                        conn.out = response(431, "text/plain", "request header too large\n");
                        return Some(false);
                    }
                    if let Some(end) = find(&conn.inbuf, b"\r\n\r\n").or_else(|| find(&conn.inbuf, b"\n\n")) {
                        let head = String::from_utf8_lossy(&conn.inbuf[..end]).into_owned();
                        conn.out = answer(&head, handler);
                        return Some(false);
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Some(false),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(_) => return None,
            }
        }
    }

    fn close(&mut self, slot: usize, epoll: &Epoll) {
        if let Some(conn) = self.conns[slot].take() {
            let _ = epoll.remove(conn.stream.as_raw_fd());
        }
    }

    /// Drops connections past their deadline.
    pub fn expire(&mut self, now: Instant, epoll: &Epoll) {
        for slot in 0..self.conns.len() {
            if self.conns[slot].as_ref().is_some_and(|c| c.deadline <= now) {
                self.close(slot, epoll);
            }
        }
    }

    /// The earliest connection deadline.
    pub fn next_deadline(&self) -> Option<Instant> {
        self.conns.iter().flatten().map(|c| c.deadline).min()
    }
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

fn answer(head: &str, handler: Handler<'_>) -> Vec<u8> {
    let line = head.lines().next().unwrap_or("");
    let mut parts = line.split_whitespace();
    let (method, target) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
    let path = target.split('?').next().unwrap_or("");
    if method != "GET" && method != "HEAD" {
        return response(405, "text/plain", "only GET is served\n");
    }
    let mut r = match handler(path) {
        Some(body) => response(200, "text/plain; version=0.0.4; charset=utf-8", &body),
        None => response(404, "text/plain", "not found; scrape /metrics\n"),
    };
    if method == "HEAD" {
        if let Some(end) = find(&r, b"\r\n\r\n") {
            r.truncate(end + 4);
        }
    }
    r
}

fn response(code: u16, ctype: &str, body: &str) -> Vec<u8> {
    let reason = match code {
        200 => "OK",
        404 => "Not Found",
        405 => "Method Not Allowed",
        _ => "Request Header Fields Too Large",
    };
    let mut r = format!(
        "HTTP/1.1 {code} {reason}\r\nContent-Type: {ctype}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    )
    .into_bytes();
    r.extend_from_slice(body.as_bytes());
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_are_log2_microseconds() {
        assert_eq!(latency_bucket(Duration::from_nanos(0)), 0);
        assert_eq!(latency_bucket(Duration::from_nanos(1000)), 0);
        assert_eq!(latency_bucket(Duration::from_nanos(1001)), 1);
        assert_eq!(latency_bucket(Duration::from_micros(2)), 1);
        assert_eq!(latency_bucket(Duration::from_micros(3)), 2);
        assert_eq!(latency_bucket(Duration::from_micros(1024)), 10);
        assert_eq!(latency_bucket(Duration::from_micros(1025)), 11);
        assert_eq!(latency_bucket(Duration::from_secs(3600)), LATENCY_BUCKETS);
    }

    #[test]
    fn volume_stats_sum_over_reactors() {
        let s = VolumeStats::new(2);
        s.reactor(0).ops[0].record(4096, true, Some(Duration::from_micros(10)));
        s.reactor(1).ops[0].record(8192, true, Some(Duration::from_micros(100)));
        s.reactor(1).ops[0].record(0, false, Some(Duration::from_micros(5)));
        let t = s.totals(0);
        assert_eq!((t.ops, t.bytes, t.errors), (3, 12288, 1));
        assert_eq!(t.buckets.iter().sum::<u64>(), 3);
        assert_eq!(t.buckets[4], 1); // 10 µs ≤ 16
        assert_eq!(t.buckets[7], 1); // 100 µs ≤ 128
        assert_eq!(s.totals(1).ops, 0);
    }

    #[test]
    fn an_untimed_command_counts_everywhere_but_in_the_histogram() {
        let s = VolumeStats::new(1);
        s.reactor(0).ops[0].record(4096, true, Some(Duration::from_micros(3)));
        s.reactor(0).ops[0].record(512, true, None);
        s.reactor(0).ops[0].record(0, false, None);
        let t = s.totals(0);
        assert_eq!((t.ops, t.bytes, t.errors), (3, 4608, 1));
        assert_eq!(t.buckets.iter().sum::<u64>(), 1);
        assert_eq!(t.buckets[2], 1); // 3 µs ≤ 4
    }

    #[test]
    fn only_clocksources_the_vdso_reads_count_as_cheap() {
        assert!(vdso_clocksource("tsc"));
        assert!(vdso_clocksource("kvm-clock"));
        assert!(vdso_clocksource("arch_sys_counter"));
        assert!(!vdso_clocksource("hpet"));
        assert!(!vdso_clocksource("acpi_pm"));
        assert!(!vdso_clocksource("jiffies"));
    }

    #[test]
    fn renders_parseable_text() {
        let vs = VolumeStats::new(1);
        vs.reactor(0).ops[1].record(4096, true, Some(Duration::from_micros(3)));
        let reactors = vec![std::sync::Arc::new(ReactorStats::default()), std::sync::Arc::new(ReactorStats::default())];
        reactors[0].queue_pairs.set(2);
        reactors[0].chunk_wait_timeouts.add(3);
        reactors[0].readahead_hits.add(5);
        let limits = LimitCounters::default();
        limits.refused_sessions.fetch_add(3, Relaxed);
        limits.handshakes.fetch_add(2, Relaxed);
        let nvme = NvmeStats::default();
        // Each reactor counts its queues' commands; the scrape sums them.
        reactors[0].nvme.commands[1].add(3);
        reactors[1].nvme.commands[1].add(2);
        nvme.terminations.store(1, std::sync::atomic::Ordering::Relaxed);
        let text = render(&Scrape {
            target: "t\"x",
            uptime: Duration::from_secs(1),
            volumes: vec![VolumeView { name: "v0", backend: "memory", read_only: false, size: 1 << 20, stats: &vs }],
            reactors: &reactors,
            chunk_size: 4096,
            sessions: vec![
                SessionView { host: "h".into(), queue_pairs: vec![(0, 2)] },
                SessionView { host: "h".into(), queue_pairs: vec![(0, 1), (1, 1)] },
                SessionView { host: "g".into(), queue_pairs: vec![(1, 1)] },
            ],
            reloads_ok: 1,
            reloads_failed: 0,
            limits: Some(&limits),
            nvme: Some((&nvme, 2)),
        });
        assert!(text.contains("rdmablk_target_info{target=\"t\\\"x\"} 1"), "{text}");
        assert!(text.contains("rdmablk_nvme_controllers 2\n"), "{text}");
        assert!(text.contains("rdmablk_nvme_commands_total{class=\"write\"} 5\n"), "{text}");
        assert!(text.contains("rdmablk_nvme_terminations_total 1\n"), "{text}");
        assert!(text.contains("rdmablk_connections_refused_total{reason=\"max_sessions\"} 3"), "{text}");
        assert!(text.contains("rdmablk_connections_refused_total{reason=\"max_handshakes\"} 0"), "{text}");
        assert!(text.contains("rdmablk_handshakes_in_progress 2"), "{text}");
        assert!(text.contains("rdmablk_handshakes_timed_out_total 0"), "{text}");
        assert!(text.contains("rdmablk_fences_total 0"), "{text}");
        assert!(text.contains("rdmablk_fence_timeouts_total 0"), "{text}");
        assert!(text.contains("rdmablk_volume_ops_total{volume=\"v0\",op=\"write\"} 1"));
        assert!(text.contains("rdmablk_volume_bytes_total{volume=\"v0\",op=\"write\"} 4096"));
        assert!(text.contains("rdmablk_volume_latency_seconds_bucket{volume=\"v0\",op=\"write\",le=\"0.000004\"} 1"));
        assert!(text.contains("rdmablk_volume_latency_seconds_bucket{volume=\"v0\",op=\"write\",le=\"0.000002\"} 0"));
        assert!(text.contains("rdmablk_volume_latency_seconds_count{volume=\"v0\",op=\"write\"} 1"));
        assert!(text.contains("rdmablk_sessions_connected 3\n"), "{text}");
        assert!(text.contains("rdmablk_host_sessions{host=\"h\"} 2\n"), "{text}");
        assert!(text.contains("rdmablk_host_queue_pairs{host=\"h\"} 4\n"), "{text}");
        assert!(text.contains("rdmablk_host_queue_pairs{host=\"g\"} 1\n"), "{text}");
        assert!(!text.contains("session="), "{text}");
        assert!(text.contains(&format!("rdmablk_build_info{{version=\"{BUILD_VERSION}\",git_commit=\"{BUILD_GIT_COMMIT}\",")), "{text}");
        assert!(text.contains("\nprocess_open_fds "), "{text}");
        assert!(text.contains("# TYPE process_cpu_seconds_total counter\n"), "{text}");
        assert!(text.contains("rdmablk_queue_pairs_connected 2"));
        assert!(text.contains("rdmablk_chunk_wait_timeouts_total{reactor=\"0\"} 3"), "{text}");
        assert!(text.contains("rdmablk_readahead_hits_total{reactor=\"0\"} 5"), "{text}");
        // Every sample line is `name{labels} value` or `name value` with a number.
        for line in text.lines().filter(|l| !l.starts_with('#')) {
            let v = line.rsplit(' ').next().unwrap();
            assert!(v.parse::<f64>().is_ok(), "{line}");
        }
    }

    #[test]
    fn hosts_past_the_cap_are_summed_as_other() {
        // 100 hosts with 1..=100 queue pairs, one session each, and a second
        // session of host-099.
        let mut sessions: Vec<SessionView> =
            (0..100).map(|i| SessionView { host: format!("host-{i:03}"), queue_pairs: vec![(0, i + 1)] }).collect();
        sessions.push(SessionView { host: "host-099".into(), queue_pairs: vec![(1, 3)] });
        let hosts = per_host(&sessions);
        assert_eq!(hosts.len(), MAX_HOST_LABELS + 1);
        assert_eq!(hosts[0], ("host-099", 2, 103));
        assert_eq!(hosts[1], ("host-098", 1, 99));
        // Named: host-099 ..= host-036; summed: host-000 ..= host-035, 1 + ... + 36 queue pairs.
        assert_eq!(hosts[MAX_HOST_LABELS - 1], ("host-036", 1, 37));
        assert_eq!(hosts[MAX_HOST_LABELS], (OTHER_HOSTS, 36, 36 * 37 / 2));
        assert_eq!(hosts.iter().map(|h| h.1).sum::<u64>(), 101);
        // Under the cap nothing is summed.
        assert_eq!(per_host(&sessions[..3]).iter().map(|h| h.0).collect::<Vec<_>>(), ["host-002", "host-001", "host-000"]);
    }

    #[test]
    fn build_info_names_a_version_commit_and_compiler() {
        assert_eq!(BUILD_VERSION, env!("CARGO_PKG_VERSION"));
        assert!(
            BUILD_GIT_COMMIT == "unknown" || (BUILD_GIT_COMMIT.len() == 40 && BUILD_GIT_COMMIT.bytes().all(|b| b.is_ascii_hexdigit())),
            "{BUILD_GIT_COMMIT}"
        );
        // "1.95.0", "1.96.0-nightly"
        assert!(BUILD_RUSTC_VERSION.split('.').take(2).all(|p| p.parse::<u32>().is_ok()), "{BUILD_RUSTC_VERSION}");
    }

    #[test]
    fn http_answers_metrics_and_404() {
        let epoll = Epoll::new().unwrap();
        let mut srv = HttpServer::bind("127.0.0.1:0".parse().unwrap(), 100).unwrap();
        epoll.add(srv.fd(), 1).unwrap();
        let addr = srv.local_addr();
        let get = |path: &'static str| {
            std::thread::spawn(move || {
                let mut s = TcpStream::connect(addr).unwrap();
                s.write_all(format!("GET {path} HTTP/1.1\r\nHost: x\r\n\r\n").as_bytes()).unwrap();
                let mut r = String::new();
                s.read_to_string(&mut r).unwrap();
                r
            })
        };
        let a = get("/metrics");
        let b = get("/nope");
        let mut tokens = Vec::new();
        let deadline = Instant::now() + Duration::from_secs(5);
        while !(a.is_finished() && b.is_finished()) {
            assert!(Instant::now() < deadline);
            epoll.wait(&mut tokens, Some(Duration::from_millis(20))).unwrap();
            for &t in &tokens {
                if t == 1 {
                    srv.accept(&epoll);
                } else if srv.owns(t) {
                    srv.ready(t, &epoll, &mut |p| (p == "/metrics").then(|| "x 1\n".to_owned()));
                }
            }
        }
        let a = a.join().unwrap();
        let b = b.join().unwrap();
        assert!(a.starts_with("HTTP/1.1 200 OK\r\n") && a.ends_with("\r\n\r\nx 1\n"), "{a}");
        assert!(a.contains("Content-Type: text/plain; version=0.0.4"), "{a}");
        assert!(b.starts_with("HTTP/1.1 404"), "{b}");
    }
}
