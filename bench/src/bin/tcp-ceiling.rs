//! tcp-ceiling: the best case any block protocol can reach for a READ over
//! loopback TCP on this machine — a floor to compare rdmablk against.
//!
//! A server thread and a client thread talk over one TCP connection on
//! 127.0.0.1. The client keeps `--qd` requests of 64 bytes (a command
//! capsule) in flight; the server answers each with a 16-byte header and
//! `--bs` bytes of payload from a static buffer (the data of a READ and its
//! response). Nothing else: no disk, no checksum, no protocol state, no
//! allocation on the hot path. Everything is batched as far as TCP allows:
//! TCP_NODELAY, one large `read` that takes every message waiting, and one
//! `writev` for all the answers (or all the new requests) that read produced.
//!
//! By default both sides block in `read` (they sleep between bursts, like
//! an interrupt-driven target); `--busy` makes both sockets nonblocking and
//! spins on `read` (like `busy_poll` + `--hipri`).
//!
//! Reports IOPS, payload bandwidth, round-trip percentiles (request written
//! to answer read) and, for the server thread and the client thread
//! separately, CPU microseconds (getrusage RUSAGE_THREAD), `read`/`writev`
//! calls and context switches per operation.
//!
//! `--file PATH` puts the disk in: the server reads each answer's payload
//! from PATH at a random block-aligned offset, with the target's own io_uring
//! engine (`O_DIRECT`, a fixed file, registered buffers), and answers each
//! request when its read completes, a turn's answers together. That is the
//! disk path plus the loopback floor and nothing of rdmablk's protocol: no
//! capsules, no placement, no sessions. Against local fio on the same file
//! it bounds what a block protocol over loopback TCP can reach (for this
//! design of server; its batching variants reach the same).
//!
//! `--place` copies every payload from the read buffer into its request's
//! own buffer (the placement a design with a staging read pays for).
//!
//! `--batch N` caps the messages per `read` and per `writev` on both sides
//! (1: one system call per message each way), to show what the per-message
//! cost is when I/Os do not arrive together.
//!
//! Server and client are two threads of one process by default; with
//! `--server ADDR` and `--connect ADDR` they run as two processes (the
//! phase of the run travels in the requests, so each prints its own side).
//!
//! usage: tcp-ceiling [--bs SIZE] [--qd N] [--runtime TIME] [--ramp TIME] [--busy]
//!                    [--batch N] [--place] [--file PATH] [--json] [--server ADDR | --connect ADDR]

use std::io::{ErrorKind, IoSlice, Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use rdmablk_bench::cpu::{thread_usage, CpuUsage};
use rdmablk_bench::units::{parse_size, parse_time, parse_u64};
use rdmablk_target::engine::pool::{ChunkId, Pool};
use rdmablk_target::sys::{Epoll, READABLE};
use rdmablk_target::engine::uring::{Uring, UringOptions};

/// A request: the size of a command capsule. Bytes 0..8 carry the tag.
const REQUEST_LEN: usize = 64;
/// An answer's header: tag (8 bytes), status (4), payload length (4).
const HEADER_LEN: usize = 16;

const PHASE_RAMP: u8 = 0;
const PHASE_MEASURE: u8 = 1;
const PHASE_END: u8 = 2;

#[derive(Clone, Debug)]
struct Options {
    bs: usize,
    qd: usize,
    runtime: Duration,
    ramp: Duration,
    busy: bool,
    json: bool,
    /// At most this many messages per read and per writev (0: no limit).
    batch: usize,
    /// Copy each answer's payload from the read buffer to its request's own
    /// buffer, as a design with a staging read must to place the data.
    place: bool,
    /// Serve each payload from this file (a disk read per request).
    file: Option<String>,
    role: Role,
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum Role {
    /// Server and client as two threads of this process.
    Both,
    /// Only the server, listening on this address; prints its side at the end.
    Server(String),
    /// Only the client, connecting to this address.
    Client(String),
}

fn usage() -> &'static str {
    "usage: tcp-ceiling [--bs SIZE] [--qd N] [--runtime TIME] [--ramp TIME] [--busy]\n\
     \x20                  [--batch N] [--place] [--file PATH] [--json] [--server ADDR | --connect ADDR]\n\
     defaults: --bs 4k --qd 32 --runtime 10 --ramp 1 --batch 0 (no cap); sleeping reads\n\
     (--busy spins on nonblocking reads); server and client as two threads of one process\n\
     (--server 127.0.0.1:0 prints its address on stderr; --connect runs the client)\n"
}

fn parse_options(args: &[String]) -> Result<Options, String> {
    let mut o = Options {
        bs: 4096,
        qd: 32,
        runtime: Duration::from_secs(10),
        ramp: Duration::from_secs(1),
        busy: false,
        json: false,
        batch: 0,
        place: false,
        file: None,
        role: Role::Both,
    };
    let mut it = args.iter();
    while let Some(arg) = it.next() {
        let (key, inline) = match arg.split_once('=') {
            Some((k, v)) => (k, Some(v.to_string())),
            None => (arg.as_str(), None),
        };
        let mut value = || inline.clone().or_else(|| it.next().cloned()).ok_or(format!("{key} needs a value"));
        match key {
            "--bs" => o.bs = parse_size(&value()?)? as usize,
            "--qd" | "--iodepth" => o.qd = parse_u64(&value()?)? as usize,
            "--runtime" => o.runtime = parse_time(&value()?)?,
            "--ramp" | "--ramp_time" => o.ramp = parse_time(&value()?)?,
            "--busy" => o.busy = true,
            "--json" => o.json = true,
            "--batch" => o.batch = parse_u64(&value()?)? as usize,
            "--place" => o.place = true,
            "--file" | "--filename" => o.file = Some(value()?),
            "--server" => o.role = Role::Server(value()?),
            "--connect" => o.role = Role::Client(value()?),
            "-h" | "--help" => return Err(String::new()),
            other => return Err(format!("unknown argument {other}")),
        }
    }
    if o.qd == 0 || o.qd > 4096 {
        return Err("--qd must be 1..4096".into());
    }
    if o.file.is_some() && (o.bs == 0 || o.bs % 4096 != 0) {
        return Err("--file needs --bs to be a multiple of 4k (O_DIRECT)".into());
    }
    Ok(o)
}

/// What one side did inside the measured window.
#[derive(Clone, Debug, Default)]
struct Side {
    ops: u64,
    reads: u64,
    writes: u64,
    cpu: CpuUsage,
}

/// Counters of a side since it started; `Side` is the difference of two.
#[derive(Clone, Debug, Default)]
struct Counters {
    ops: u64,
    reads: u64,
    writes: u64,
}

impl Counters {
    fn snapshot(&self) -> (Counters, CpuUsage) {
        (self.clone(), thread_usage())
    }

    fn since(&self, start: &(Counters, CpuUsage)) -> Side {
        Side {
            ops: self.ops - start.0.ops,
            reads: self.reads - start.0.reads,
            writes: self.writes - start.0.writes,
            cpu: thread_usage().since(&start.1),
        }
    }
}

/// Reads once; `None` at end of stream. In busy mode spins on WouldBlock.
fn read_some(stream: &mut TcpStream, buf: &mut [u8], counters: &mut Counters) -> Option<usize> {
    loop {
        match stream.read(buf) {
            Ok(0) => return None,
            Ok(n) => {
                counters.reads += 1;
                return Some(n);
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock => std::hint::spin_loop(),
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) => panic!("tcp-ceiling: read: {e}"),
        }
    }
}

/// Writes every slice, with one `writev` when the socket takes it all.
fn write_all(stream: &mut TcpStream, mut slices: &mut [IoSlice<'_>], counters: &mut Counters) {
    while !slices.is_empty() {
        match stream.write_vectored(slices) {
            Ok(0) => panic!("tcp-ceiling: write returned 0"),
            Ok(n) => {
                counters.writes += 1;
                IoSlice::advance_slices(&mut slices, n);
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock => std::hint::spin_loop(),
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) => panic!("tcp-ceiling: writev: {e}"),
        }
    }
}

fn prepare(stream: &TcpStream, busy: bool) {
    stream.set_nodelay(true).expect("TCP_NODELAY");
    stream.set_nonblocking(busy).expect("O_NONBLOCK");
}

/// The server's view of the client's phase, which travels in every request
/// (byte 8): it takes its window's snapshots when it first reads a request
/// of a new phase, and echoes the phase it has seen in each answer (byte 8),
/// so the client keeps it busy until it has seen the end.
#[derive(Default)]
struct ServerPhase {
    seen: u8,
    start: Option<(Counters, CpuUsage)>,
    window: Option<Side>,
}

impl ServerPhase {
    /// Takes the phase of the last complete request of a read.
    fn observe(&mut self, phase: u8, counters: &Counters) {
        if phase == self.seen {
            return;
        }
        if phase >= PHASE_MEASURE && self.start.is_none() {
            self.start = Some(counters.snapshot());
        }
        if phase == PHASE_END && self.window.is_none() {
            self.window = self.start.as_ref().map(|s| counters.since(s));
        }
        self.seen = phase;
    }

    /// The answer header for `request`: its tag, the phase seen, the payload length.
    fn header(&self, request: &[u8], payload_len: usize) -> [u8; HEADER_LEN] {
        let mut h = [0u8; HEADER_LEN];
        h[..8].copy_from_slice(&request[..8]);
        h[8] = self.seen;
        h[12..16].copy_from_slice(&(payload_len as u32).to_le_bytes());
        h
    }
}

/// The server: answers every complete request of a read with one writev.
fn serve(mut stream: TcpStream, o: &Options) -> Side {
    prepare(&stream, o.busy);
    let payload = vec![0xa5u8; o.bs];
    let read_limit = if o.batch == 0 { 64 * 1024 } else { o.batch * REQUEST_LEN };
    let mut inbuf = vec![0u8; read_limit];
    let mut have = 0;
    let mut headers: Vec<[u8; HEADER_LEN]> = Vec::with_capacity(read_limit / REQUEST_LEN);
    let mut counters = Counters::default();
    let mut phase = ServerPhase::default();
    while let Some(n) = read_some(&mut stream, &mut inbuf[have..], &mut counters) {
        have += n;
        let complete = have / REQUEST_LEN;
        if complete == 0 {
            continue;
        }
        phase.observe(inbuf[(complete - 1) * REQUEST_LEN + 8], &counters);
        headers.clear();
        headers.extend(inbuf[..complete * REQUEST_LEN].chunks_exact(REQUEST_LEN).map(|req| phase.header(req, o.bs)));
        inbuf.copy_within(complete * REQUEST_LEN..have, 0);
        have -= complete * REQUEST_LEN;
        let mut slices: Vec<IoSlice<'_>> =
            headers.iter().flat_map(|h| [IoSlice::new(h), IoSlice::new(&payload)]).collect();
        write_all(&mut stream, &mut slices, &mut counters);
        counters.ops += complete as u64;
    }
    phase.window.unwrap_or_default()
}

/// The `--file` server: one loop over the socket and an io_uring, like a
/// reactor. Each complete request starts a read of `bs` bytes at a random
/// block of the file into a registered buffer; the reads a turn starts are
/// submitted together, and the answers of the reads a turn reaps go out in
/// one writev. Sleeping, it waits in epoll on the socket and the ring's
/// eventfd; `--busy` spins over both.
fn serve_file(mut stream: TcpStream, o: &Options, path: &str) -> Side {
    // Nonblocking in both modes: the loop also has the ring to look after.
    prepare(&stream, true);
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(path)
        .unwrap_or_else(|e| fail(&format!("cannot open {path} with O_DIRECT: {e}")));
    let blocks = file.metadata().map(|m| m.len()).unwrap_or(0) / o.bs as u64;
    if blocks == 0 {
        fail(&format!("{path} is smaller than one --bs block"));
    }
    // One buffer per request in flight: the client never has more than qd.
    let mut pool = Pool::new(o.qd * o.bs, o.bs);
    let opts = UringOptions { entries: (o.qd as u32).next_power_of_two().clamp(8, 4096), ..UringOptions::default() };
    let mut ring = Uring::new(&[file.as_raw_fd()], &pool, opts).unwrap_or_else(|e| fail(&e.to_string()));
    let epoll = Epoll::new().unwrap_or_else(|e| fail(&format!("epoll: {e}")));
    // Without a `wake_fd` the ring signals completions through its eventfd.
    let ring_eventfd = ring.eventfd().expect("a ring without wake_fd has an eventfd");
    for (fd, token) in [(stream.as_raw_fd(), 0), (ring_eventfd, 1)] {
        epoll.add_events(fd, token, READABLE).unwrap_or_else(|e| fail(&format!("epoll: {e}")));
    }
    let read_limit = if o.batch == 0 { 64 * 1024 } else { o.batch * REQUEST_LEN };
    let mut inbuf = vec![0u8; read_limit];
    let mut have = 0;
    // The request tag each buffer's read answers.
    let mut tag_of = vec![[0u8; 8]; o.qd];
    let mut answers: Vec<([u8; HEADER_LEN], ChunkId)> = Vec::with_capacity(o.qd);
    let mut ready = Vec::new();
    let mut counters = Counters::default();
    let mut phase = ServerPhase::default();
    let mut rng = 0x9e37_79b9_7f4a_7c15u64;
    let mut eof = false;
    // Whether the eventfd was cleared since the last turn that found work:
    // a turn after clearing must come up empty before the loop may sleep,
    // so that no completion posted before the clear is slept through.
    let mut cleared = false;
    loop {
        let mut work = false;
        if !eof {
            match stream.read(&mut inbuf[have..]) {
                Ok(0) => eof = true,
                Ok(n) => {
                    counters.reads += 1;
                    work = true;
                    have += n;
                    let complete = have / REQUEST_LEN;
                    if complete > 0 {
                        phase.observe(inbuf[(complete - 1) * REQUEST_LEN + 8], &counters);
                    }
                    for req in inbuf[..complete * REQUEST_LEN].chunks_exact(REQUEST_LEN) {
                        let c = pool.alloc().unwrap_or_else(|| fail("more requests in flight than --qd"));
                        tag_of[c.0 as usize].copy_from_slice(&req[..8]);
                        // xorshift64: a uniform random block, as fio's randread.
                        rng ^= rng << 13;
                        rng ^= rng >> 7;
                        rng ^= rng << 17;
                        let offset = (rng % blocks) * o.bs as u64;
                        ring.read_fixed(&mut pool, 0, c, 0, o.bs as u32, offset, c.0 as u64);
                    }
                    inbuf.copy_within(complete * REQUEST_LEN..have, 0);
                    have -= complete * REQUEST_LEN;
                }
                Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::Interrupted) => {}
                Err(e) => fail(&format!("read: {e}")),
            }
        }
        ring.submit().unwrap_or_else(|e| fail(&e.to_string()));
        answers.clear();
        ring.reap(&mut pool, |user_data, res| {
            if res < 0 {
                fail(&format!("read of {path} failed: {}", std::io::Error::from_raw_os_error(-res)));
            }
            let c = ChunkId(user_data as u16);
            answers.push((phase.header(&tag_of[c.0 as usize], o.bs), c));
        });
        if !answers.is_empty() {
            work = true;
            let mut slices: Vec<IoSlice<'_>> =
                answers.iter().flat_map(|(h, c)| [IoSlice::new(h), IoSlice::new(pool.bytes(*c))]).collect();
            write_all(&mut stream, &mut slices, &mut counters);
            for (_, c) in &answers {
                pool.release(*c);
            }
            counters.ops += answers.len() as u64;
        }
        if eof && ring.inflight() == 0 {
            break;
        }
        if work || o.busy {
            cleared = false;
        } else if !cleared {
            ring.clear_eventfd();
            cleared = true;
        } else {
            epoll.wait(&mut ready, None).unwrap_or_else(|e| fail(&format!("epoll_wait: {e}")));
            cleared = false;
        }
    }
    phase.window.unwrap_or_default()
}

fn serve_any(stream: TcpStream, o: &Options) -> Side {
    match &o.file {
        Some(path) => serve_file(stream, o, path),
        None => serve(stream, o),
    }
}

fn fail(msg: &str) -> ! {
    eprintln!("tcp-ceiling: {msg}");
    std::process::exit(1);
}

struct ClientResult {
    side: Side,
    elapsed: Duration,
    hist: Histogram<u64>,
}

/// The client: keeps `qd` requests in flight; every read's completions are
/// replaced with new requests in one writev.
fn drive(mut stream: TcpStream, o: &Options) -> ClientResult {
    prepare(&stream, o.busy);
    let msg_len = HEADER_LEN + o.bs;
    // Large enough to take every answer in flight in one read, up to 4 MiB.
    let read_limit = if o.batch == 0 { (o.qd * msg_len).clamp(64 * 1024, 4 << 20) } else { o.batch * msg_len };
    let mut inbuf = vec![0u8; read_limit];
    let mut requests: Vec<[u8; REQUEST_LEN]> = (0..o.qd)
        .map(|tag| {
            let mut r = [0u8; REQUEST_LEN];
            r[..8].copy_from_slice(&(tag as u64).to_le_bytes());
            r
        })
        .collect();
    let mut sent_at = vec![Instant::now(); o.qd];
    // One buffer per request for --place: where a READ's data belongs.
    let mut placed = vec![0u8; if o.place { o.qd * o.bs } else { 0 }];
    let mut hist = Histogram::<u64>::new_with_bounds(1, 60_000_000_000, 3).expect("histogram bounds");
    let mut counters = Counters::default();
    let mut to_send: Vec<usize> = (0..o.qd).collect();
    let mut in_flight = 0usize;
    let mut header = [0u8; HEADER_LEN];
    let mut in_msg = 0usize; // bytes of the current answer received so far
    let begin = Instant::now();
    let mut phase = PHASE_RAMP;
    let mut measure_from = None;
    let mut window = None;
    let mut issuing = true;
    loop {
        if !to_send.is_empty() {
            let now = Instant::now();
            for &t in &to_send {
                sent_at[t] = now;
                requests[t][8] = phase;
            }
            in_flight += to_send.len();
            let max = if o.batch == 0 { to_send.len() } else { o.batch };
            for chunk in to_send.chunks(max) {
                let mut slices: Vec<IoSlice<'_>> = chunk.iter().map(|&t| IoSlice::new(&requests[t])).collect();
                write_all(&mut stream, &mut slices, &mut counters);
            }
            to_send.clear();
        }
        if in_flight == 0 {
            break;
        }
        let Some(n) = read_some(&mut stream, &mut inbuf, &mut counters) else {
            panic!("tcp-ceiling: server closed the connection");
        };
        let now = Instant::now();
        let measuring = phase == PHASE_MEASURE;
        let data = &inbuf[..n];
        let mut i = 0;
        while i < n {
            if in_msg < HEADER_LEN {
                let take = (HEADER_LEN - in_msg).min(n - i);
                header[in_msg..in_msg + take].copy_from_slice(&data[i..i + take]);
                in_msg += take;
                i += take;
            } else {
                let take = (msg_len - in_msg).min(n - i);
                if o.place {
                    let tag = u64::from_le_bytes(header[..8].try_into().expect("8 bytes")) as usize;
                    let at = tag * o.bs + (in_msg - HEADER_LEN);
                    placed[at..at + take].copy_from_slice(&data[i..i + take]);
                }
                in_msg += take;
                i += take;
            }
            if in_msg == msg_len {
                in_msg = 0;
                let tag = u64::from_le_bytes(header[..8].try_into().expect("8 bytes")) as usize;
                in_flight -= 1;
                counters.ops += 1;
                if measuring {
                    let ns = now.duration_since(sent_at[tag]).as_nanos() as u64;
                    hist.saturating_record(ns.max(1));
                }
                // Keep the server busy until it has seen the end, then drain.
                if header[8] == PHASE_END {
                    issuing = false;
                }
                if issuing {
                    to_send.push(tag);
                }
            }
        }
        // Time and phase are checked once per read, like the server does.
        if phase == PHASE_RAMP && now.duration_since(begin) >= o.ramp {
            measure_from = Some((now, counters.snapshot()));
            phase = PHASE_MEASURE;
        } else if let (PHASE_MEASURE, Some((t0, start))) = (phase, &measure_from) {
            if now.duration_since(*t0) >= o.runtime {
                window = Some((now.duration_since(*t0), counters.since(start)));
                phase = PHASE_END;
            }
        }
    }
    stream.shutdown(Shutdown::Write).ok();
    let (elapsed, side) = window.expect("the run ended after its window");
    std::hint::black_box(&placed);
    ClientResult { side, elapsed, hist }
}

fn per_op(side: &Side) -> serde_json::Value {
    let ops = side.ops.max(1) as f64;
    serde_json::json!({
        "ops": side.ops,
        "cpu_us_per_op": side.cpu.total().as_secs_f64() * 1e6 / ops,
        "usr_us_per_op": side.cpu.usr.as_secs_f64() * 1e6 / ops,
        "sys_us_per_op": side.cpu.sys.as_secs_f64() * 1e6 / ops,
        "reads_per_op": side.reads as f64 / ops,
        "writes_per_op": side.writes as f64 / ops,
        "ctx_per_op": side.cpu.ctx as f64 / ops,
    })
}

fn side_line(name: &str, v: &serde_json::Value) -> String {
    let f = |k: &str| v[k].as_f64().unwrap_or(0.0);
    format!(
        "{name}: {:.2} CPU-us/op (usr {:.2}, sys {:.2}), reads/op {:.2}, writes/op {:.2}, ctx/op {:.2}",
        f("cpu_us_per_op"),
        f("usr_us_per_op"),
        f("sys_us_per_op"),
        f("reads_per_op"),
        f("writes_per_op"),
        f("ctx_per_op"),
    )
}

fn client_report(o: &Options, c: &ClientResult) -> serde_json::Value {
    let secs = c.elapsed.as_secs_f64();
    let iops = c.side.ops as f64 / secs;
    let us = |q: f64| c.hist.value_at_quantile(q) as f64 / 1000.0;
    serde_json::json!({
        "bs": o.bs,
        "qd": o.qd,
        "batch": o.batch,
        "place": o.place,
        "file": o.file,
        "mode": if o.busy { "busy" } else { "sleeping" },
        "runtime_s": secs,
        "iops": iops,
        "mib_s": iops * o.bs as f64 / 1048576.0,
        "p50_us": us(0.50),
        "p99_us": us(0.99),
        "mean_us": c.hist.mean() / 1000.0,
        "client": per_op(&c.side),
    })
}

fn print_report(o: &Options, r: &serde_json::Value) {
    if o.json {
        println!("{r}");
        return;
    }
    if r.get("iops").is_some() {
        let f = |k: &str| r[k].as_f64().unwrap_or(0.0);
        println!(
            "bs={} qd={} batch={}{} {}: {:.0} IOPS, {:.1} MiB/s, round trip p50 {:.1} us, p99 {:.1} us",
            o.bs,
            o.qd,
            o.batch,
            o.file.as_deref().map(|f| format!(" file={f}")).unwrap_or_default(),
            r["mode"].as_str().unwrap_or(""),
            f("iops"),
            f("mib_s"),
            f("p50_us"),
            f("p99_us")
        );
    }
    for name in ["server", "client"] {
        if let Some(v) = r.get(name) {
            println!("  {}", side_line(name, v));
        }
    }
}

fn main() {
    // --file runs the target's io_uring engine, which warns through tracing;
    // the same setup as the other binaries (RUST_LOG, RDMABLK_LOG_FORMAT, journald).
    rdmablk_common::logging::Logging::new("tcp-ceiling", "warn").init();
    let args: Vec<String> = std::env::args().skip(1).collect();
    let o = match parse_options(&args) {
        Ok(o) => o,
        Err(e) => {
            if !e.is_empty() {
                eprintln!("tcp-ceiling: {e}");
            }
            eprint!("{}", usage());
            std::process::exit(if e.is_empty() { 0 } else { 2 });
        }
    };
    match &o.role {
        Role::Server(addr) => {
            let listener = TcpListener::bind(addr.as_str()).expect("bind");
            // The actual address (port 0 picks one) for the script to connect to.
            eprintln!("listening on {}", listener.local_addr().expect("local address"));
            let (stream, _) = listener.accept().expect("accept");
            let s = serve_any(stream, &o);
            print_report(&o, &serde_json::json!({ "server": per_op(&s) }));
        }
        Role::Client(addr) => {
            let stream = TcpStream::connect(addr.as_str()).expect("connect");
            let c = drive(stream, &o);
            print_report(&o, &client_report(&o, &c));
        }
        Role::Both => {
            let listener = TcpListener::bind("127.0.0.1:0").expect("bind 127.0.0.1:0");
            let addr = listener.local_addr().expect("local address");
            let server = {
                let o = o.clone();
                std::thread::Builder::new()
                    .name("ceil-server".into())
                    .spawn(move || serve_any(listener.accept().expect("accept").0, &o))
                    .expect("spawn server")
            };
            let client = {
                let o = o.clone();
                std::thread::Builder::new()
                    .name("ceil-client".into())
                    .spawn(move || drive(TcpStream::connect(addr).expect("connect"), &o))
                    .expect("spawn client")
            };
            let c = client.join().expect("client thread");
            let s = server.join().expect("server thread");
            let mut r = client_report(&o, &c);
            r["server"] = per_op(&s);
            print_report(&o, &r);
        }
    }
}
