//! A connection flood against the real daemon, NVMe/TCP and rdmablk v1
//! listeners side by side on the default limits: no thread per
//! connection, and nobody locked out.
//!
//! From 200 source addresses (127.0.0.2 to 127.0.0.201): 500 admin
//! controllers (a complete admin Connect, KATO 0, each its own random host
//! NQN, then silence), then 2,000 NVMe/TCP connections left in their
//! handshake (500 silent, 500 with half an ICReq, 500 with an ICReq and
//! nothing more, 500 with an ICReq and half a Connect capsule), all held
//! for about 8 s, below the default `handshake_timeout` (10 s). Once the
//! whole flood is in place (or 3 s after its first handshaking connection
//! if it is still opening then), two legitimate clients connect and keep doing
//! verified 4 KiB writes and reads every 50 ms: an NVMe/TCP host from
//! 127.0.0.250 (admin queue with KATO 10 s and keep-alives, one I/O queue)
//! and an rdmablk v1 session through the initiator library (which connects
//! from 127.0.0.1, an address the flood does not use).
//!
//! Measured: the daemon's threads (`/proc/PID/task`), descriptors and RSS
//! before (after a warm-up of both clients, so that one-time allocations
//! are in the baseline), during and after the flood; every legitimate
//! operation's latency and every error. The daemon must keep exactly its
//! baseline threads while it holds the flood, serve both legitimate
//! clients throughout with every operation within 1 s, and give back its
//! threads, descriptors and memory once the flood ends.
//!
//! io_uring's kernel workers (`iou-wrk-*`) are threads of the process too,
//! but the kernel starts and retires them (io-wq, bounded per ring); they
//! are counted apart and only bounded.

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rand::{Rng, RngCore};
use rdmablk_common::nvme::fabrics::{property, Property, ANY_CONTROLLER};
use rdmablk_common::nvme::sqe::{admin_opcode, io_opcode, SubmissionEntry};
use rdmablk_common::nvme::tcp::{Digests, IcReq, Pdu};
use rdmablk_initiator::{BlockDevice, ConnectOptions, Session};
use rdmablk_system_tests::nvme_tcp::{connect_data, connect_entry, rw_entry, NvmeTcpConn, CC_ENABLE};
use rdmablk_system_tests::{
    file_volume, open_fds, raise_nofile_limit, rss_bytes, sample, scrape, thread_names, try_tcp_from_within, TargetProcess,
};

const MIB: u64 = 1 << 20;
const VOL_SIZE: u64 = 16 * MIB;
const BS: usize = 4096;
const SUBNQN: &str = "nqn.2026-11.io.rdmablk.test:flood";
const LEGIT_NQN: &str = "nqn.2026-11.io.rdmablk.test:flood-legit-host";
const NO_DIGESTS: Digests = Digests { header: false, data: false };

/// Flood source addresses 127.0.0.2 ..= 127.0.0.201.
const FLOOD_ADDRESSES: usize = 200;
/// Handshaking connections per flood address.
const PER_ADDRESS: usize = 10;
/// Handshaking connections in all (500 of each of the four states).
const HANDSHAKES: usize = FLOOD_ADDRESSES * PER_ADDRESS;
/// Admin controllers with KATO 0 (2 or 3 per flood address).
const CONTROLLERS: usize = 500;
/// Threads that open the flood.
const OPENERS: usize = 4;
/// From the first handshaking connection to the release: below the default
/// handshake_timeout (10 s), which would otherwise end them itself.
const HOLD: Duration = Duration::from_millis(8500);
/// The legitimate clients' period and the longest any operation may take.
const PERIOD: Duration = Duration::from_millis(50);
const OP_LIMIT: Duration = Duration::from_secs(1);
/// The legitimate clients start once the flood is open, or this long after
/// its first handshaking connection if it is still opening.
const LEGIT_START_BY: Duration = Duration::from_secs(3);
/// The NVMe host's KATO and how often it sends a keep-alive.
const KATO_MS: u32 = 10_000;
const KEEP_ALIVE_EVERY: Duration = Duration::from_secs(1);
/// The legitimate NVMe host's source address.
const LEGIT_NVME_SOURCE: Ipv4Addr = Ipv4Addr::new(127, 0, 0, 250);
/// What the daemon may keep after the flood, beyond its baseline.
const FD_SLACK: usize = 4;
const RSS_SLACK: u64 = 32 * MIB;

fn flood_address(i: usize) -> Ipv4Addr {
    Ipv4Addr::new(127, 0, 0, 2 + (i % FLOOD_ADDRESSES) as u8)
}

fn random_nqn(rng: &mut impl Rng) -> String {
    let b: [u8; 16] = rng.gen();
    let h = |r: std::ops::Range<usize>| b[r].iter().map(|x| format!("{x:02x}")).collect::<String>();
    format!("nqn.2014-08.org.nvmexpress:uuid:{}-{}-{}-{}-{}", h(0..4), h(4..6), h(6..8), h(8..10), h(10..16))
}

// ---------------------------------------------------------------------------
// The daemon, measured from outside

/// Threads, descriptors and memory of the daemon at one moment.
#[derive(Clone, Debug)]
struct Snap {
    /// Threads other than io_uring's kernel workers.
    threads: usize,
    /// io_uring's kernel workers (iou-wrk-*, iou-sqp-*).
    iou: usize,
    fds: usize,
    rss: u64,
    /// Thread names and how many of each.
    names: BTreeMap<String, usize>,
}

fn snap(pid: u32) -> Snap {
    let mut names = BTreeMap::new();
    let (mut threads, mut iou) = (0, 0);
    for n in thread_names(pid) {
        if n.starts_with("iou-") {
            iou += 1;
            *names.entry("iou-*".to_owned()).or_insert(0) += 1;
        } else {
            threads += 1;
            *names.entry(n).or_insert(0) += 1;
        }
    }
    Snap { threads, iou, fds: open_fds(pid), rss: rss_bytes(pid), names }
}

fn mib(b: u64) -> String {
    format!("{:.1} MiB", b as f64 / MIB as f64)
}

fn metric(t: &TargetProcess, name: &str) -> Option<f64> {
    sample(&scrape(&t.metrics_addr()), name, &[])
}

/// `rdmablk_connections_refused_total` by reason.
fn refusals(t: &TargetProcess) -> BTreeMap<String, f64> {
    scrape(&t.metrics_addr())
        .into_iter()
        .filter(|s| s.name == "rdmablk_connections_refused_total")
        .map(|s| (s.labels.get("reason").cloned().unwrap_or_default(), s.value))
        .collect()
}

/// Waits until the daemon's threads and descriptors stay the same for a
/// second (no connection still ending), at most 15 s; returns the snapshot.
fn settled(pid: u32) -> Snap {
    let deadline = Instant::now() + Duration::from_secs(15);
    let mut last = snap(pid);
    let mut since = Instant::now();
    loop {
        std::thread::sleep(Duration::from_millis(100));
        let now = snap(pid);
        if (now.threads, now.fds) != (last.threads, last.fds) {
            since = Instant::now();
        } else if since.elapsed() >= Duration::from_secs(1) {
            return now;
        }
        assert!(
            Instant::now() < deadline,
            "the idle daemon's threads and descriptors did not settle within 15 s: {last:?} then {now:?}"
        );
        last = now;
    }
}

// ---------------------------------------------------------------------------
// The legitimate clients

/// What one legitimate client saw.
#[derive(Default)]
struct LegitLog {
    /// Connection attempts (each a new TCP connection or session).
    attempts: u32,
    /// When it was last connected (ready for I/O).
    connected_at: Option<Instant>,
    /// Operations that completed, and the slowest.
    ops: u64,
    worst: Duration,
    worst_op: String,
    /// Operations slower than OP_LIMIT: (when, what, how long).
    slow: Vec<(Instant, String, Duration)>,
    /// Verified write-and-read rounds: when each ended.
    rounds: Vec<Instant>,
    /// Every error: when and what.
    errors: Vec<(Instant, String)>,
}

impl LegitLog {
    fn op(&mut self, what: &str, took: Duration) {
        self.ops += 1;
        if took > self.worst {
            self.worst = took;
            self.worst_op = what.to_owned();
        }
        if took > OP_LIMIT {
            self.slow.push((Instant::now(), what.to_owned(), took));
        }
    }

    fn rounds_between(&self, from: Instant, to: Instant) -> usize {
        self.rounds.iter().filter(|&&r| r >= from && r <= to).count()
    }

    fn errors_between(&self, from: Instant, to: Instant) -> Vec<String> {
        self.errors.iter().filter(|(at, _)| *at >= from && *at <= to).map(|(at, e)| format!("at +{:.2?}: {e}", *at - from)).collect()
    }
}

type Log = Arc<Mutex<LegitLog>>;

/// Runs `f` as operation `what`: records its latency, and its error.
fn timed<T, E: std::fmt::Display>(log: &Log, what: &str, f: impl FnOnce() -> Result<T, E>) -> Result<T, String> {
    let t0 = Instant::now();
    let r = f();
    log.lock().unwrap().op(what, t0.elapsed());
    r.map_err(|e| format!("{what}: {e}"))
}

/// Sleeps until the next period starts.
fn pace(next: &mut Instant) {
    *next += PERIOD;
    let now = Instant::now();
    if *next > now {
        std::thread::sleep(*next - now);
    } else {
        *next = now;
    }
}

/// One NVMe association from LEGIT_NVME_SOURCE: admin queue (KATO 10 s),
/// enable, one I/O queue, then a verified 4 KiB write and read every 50 ms
/// and a keep-alive every second, until `stop`. Err ends the association.
fn nvme_association(addr: SocketAddr, log: &Log, stop: &AtomicBool) -> Result<(), String> {
    log.lock().unwrap().attempts += 1;
    let connect = || NvmeTcpConn::tcp_from_within(addr, LEGIT_NVME_SOURCE, Duration::from_secs(5));
    let mut admin = timed(log, "TCP connect of the admin queue", connect)?;
    admin.timeout = Duration::from_secs(5);
    timed(log, "ICReq of the admin queue", || admin.try_initialize(NO_DIGESTS))?;
    let data = connect_data(ANY_CONTROLLER, SUBNQN, LEGIT_NQN);
    let c = timed(log, "admin Connect", || admin.try_exec(connect_entry(0, 31, KATO_MS), &data, &[], 0))?;
    let cntlid = c.cqe.result as u16;
    let cc = Property { offset: property::CC, wide: false, value: CC_ENABLE }.to_entry(0, true);
    timed(log, "Property Set CC.EN", || admin.try_exec(cc, &[], &[], 0))?;
    let ready_by = Instant::now() + Duration::from_secs(5);
    loop {
        let csts = Property { offset: property::CSTS, wide: false, value: 0 }.to_entry(0, false);
        let r = timed(log, "Property Get CSTS", || admin.try_exec(csts, &[], &[], 0))?.cqe.result;
        if r & 1 == 1 {
            break;
        }
        if Instant::now() > ready_by {
            return Err(format!("CSTS.RDY not set within 5 s of CC.EN (CSTS {r:#x})"));
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let mut nq = SubmissionEntry::new(admin_opcode::SET_FEATURES, 0);
    nq.cdw[0] = 0x07;
    nq.cdw[1] = 0; // one I/O submission and one completion queue (0-based)
    timed(log, "Set Features number of queues", || admin.try_exec(nq, &[], &[], 0))?;
    let mut io = timed(log, "TCP connect of the I/O queue", connect)?;
    io.timeout = Duration::from_secs(5);
    timed(log, "ICReq of the I/O queue", || io.try_initialize(NO_DIGESTS))?;
    let data = connect_data(cntlid, SUBNQN, LEGIT_NQN);
    timed(log, "I/O queue Connect", || io.try_exec(connect_entry(1, 31, 0), &data, &[], 0))?;
    log.lock().unwrap().connected_at = Some(Instant::now());

    let mut rng = rand::thread_rng();
    let mut last_keep_alive = Instant::now();
    let mut next = Instant::now();
    let mut n = 0u64;
    while !stop.load(Ordering::Relaxed) {
        let lba = 256 + n % 16;
        let mut block = vec![0u8; BS];
        rng.fill_bytes(&mut block);
        timed(log, "NVMe Write", || io.try_exec(rw_entry(io_opcode::WRITE, 1, lba, 1, false), &block, &[], 0))?;
        let back = timed(log, "NVMe Read", || io.try_exec(rw_entry(io_opcode::READ, 1, lba, 1, false), &[], &[], BS))?.data;
        if back != block {
            return Err(format!("NVMe Read of LBA {lba} returned other bytes than the Write before it"));
        }
        log.lock().unwrap().rounds.push(Instant::now());
        if last_keep_alive.elapsed() >= KEEP_ALIVE_EVERY {
            let ka = SubmissionEntry::new(admin_opcode::KEEP_ALIVE, 0);
            timed(log, "Keep Alive", || admin.try_exec(ka, &[], &[], 0))?;
            last_keep_alive = Instant::now();
        }
        n += 1;
        pace(&mut next);
    }
    Ok(())
}

/// One rdmablk v1 session through the initiator library: CONNECT, OPEN,
/// then a verified 4 KiB write and read every 50 ms until `stop`.
fn v1_session(url: &str, log: &Log, stop: &AtomicBool) -> Result<(), String> {
    log.lock().unwrap().attempts += 1;
    let options = ConnectOptions {
        host_id: "flood-legit-v1".into(),
        queues: 1,
        connect_timeout: Duration::from_secs(5),
        io_timeout: Duration::from_secs(5),
        // A failure is an error here, not a silent reconnection.
        ctrl_loss_timeout: Duration::ZERO,
        ..ConnectOptions::default()
    };
    let session = timed(log, "v1 session connect", || Session::connect(url, options))?;
    let vol = timed(log, "v1 OPEN", || session.open("vol"))?;
    log.lock().unwrap().connected_at = Some(Instant::now());
    let mut rng = rand::thread_rng();
    let mut next = Instant::now();
    let mut n = 0u64;
    let result = loop {
        if stop.load(Ordering::Relaxed) {
            break Ok(());
        }
        let offset = 2 * MIB + (n % 16) * BS as u64;
        let mut block = vec![0u8; BS];
        rng.fill_bytes(&mut block);
        if let Err(e) = timed(log, "v1 write", || vol.write_at(&block, offset)) {
            break Err(e);
        }
        let mut back = vec![0u8; BS];
        if let Err(e) = timed(log, "v1 read", || vol.read_at(&mut back, offset)) {
            break Err(e);
        }
        if back != block {
            break Err(format!("v1 read at {offset} returned other bytes than the write before it"));
        }
        log.lock().unwrap().rounds.push(Instant::now());
        n += 1;
        pace(&mut next);
    };
    session.close();
    result
}

/// A legitimate client in a thread: it connects (again 200 ms after each
/// error, which it records) and does I/O until `stop`.
fn start_legit(
    name: &'static str,
    stop: &Arc<AtomicBool>,
    run: impl Fn(&Log, &AtomicBool) -> Result<(), String> + Send + 'static,
) -> (Log, std::thread::JoinHandle<()>) {
    let log: Log = Arc::default();
    let (l, s) = (Arc::clone(&log), Arc::clone(stop));
    let handle = std::thread::Builder::new()
        .name(name.into())
        .spawn(move || {
            while !s.load(Ordering::Relaxed) {
                match run(&l, &s) {
                    Ok(()) => break,
                    Err(e) => {
                        let mut g = l.lock().unwrap();
                        g.connected_at = None;
                        g.errors.push((Instant::now(), e));
                        drop(g);
                        std::thread::sleep(Duration::from_millis(200));
                    }
                }
            }
        })
        .expect("spawn a legitimate client");
    (log, handle)
}

// ---------------------------------------------------------------------------
// The flood

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Kind {
    /// TCP connect only.
    Silent,
    /// 64 of the ICReq's 128 bytes.
    HalfIcReq,
    /// A complete ICReq (its ICResp read), then nothing.
    IcReq,
    /// ICReq, ICResp, then half of an admin Connect capsule.
    HalfConnect,
    /// ICReq, ICResp, a complete admin Connect (KATO 0), then nothing.
    Controller,
}

impl Kind {
    fn of(k: usize) -> Kind {
        [Kind::Silent, Kind::HalfIcReq, Kind::IcReq, Kind::HalfConnect][k % 4]
    }
}

/// One flood connection.
struct Held {
    kind: Kind,
    stream: TcpStream,
    /// ICResp (or, for a controller, the Connect's success) came.
    answered: bool,
}

/// What opening the flood gave: the connections, and why others failed.
#[derive(Default)]
struct Opened {
    held: Vec<Held>,
    /// (kind, what failed) of connections the target closed or refused
    /// while they were being set up, or that could not be opened at all.
    failed: Vec<(Kind, String)>,
}

fn icreq_bytes() -> Vec<u8> {
    Pdu::IcReq(IcReq { pfv: 0, hpda: 0, digests: NO_DIGESTS, maxr2t: 0 }).to_wire(NO_DIGESTS, &[], 0)
}

/// Reads the 128-byte ICResp before `deadline`: Ok(true) when it came,
/// Ok(false) on silence, Err when the target closed or reset the connection.
fn read_icresp(s: &mut TcpStream, deadline: Instant) -> Result<bool, String> {
    let mut buf = [0u8; 128];
    let mut got = 0;
    while got < buf.len() {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Ok(false);
        }
        s.set_read_timeout(Some(left)).unwrap();
        match s.read(&mut buf[got..]) {
            Ok(0) => return Err(format!("closed by the target after {got} bytes of the ICResp")),
            Ok(n) => got += n,
            Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => return Ok(false),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(format!("reading the ICResp: {e}")),
        }
    }
    if buf[0] == 0x01 {
        Ok(true)
    } else {
        Err(format!("not an ICResp: PDU type {:#04x}", buf[0]))
    }
}

/// Opens handshaking connections `range` of the 2,000 (connection k from
/// flood address k / 10, in state k % 4): first every TCP connection (each
/// established by `connect_by`) and its first bytes, then the ICResps (by
/// `answered_by` at the latest), then the half Connects.
fn open_handshakes(addr: SocketAddr, range: std::ops::Range<usize>, connect_by: Instant, answered_by: Instant) -> Opened {
    let icreq = icreq_bytes();
    let mut rng = rand::thread_rng();
    let mut out = Opened::default();
    let mut pending = Vec::new();
    for k in range {
        let kind = Kind::of(k);
        let source = flood_address(k / PER_ADDRESS);
        let left = connect_by.saturating_duration_since(Instant::now());
        if left.is_zero() {
            out.failed.push((kind, "not attempted: the flood took too long to open".into()));
            continue;
        }
        let mut s = match try_tcp_from_within(addr, source, Some(left)) {
            Ok(s) => s,
            Err(e) => {
                out.failed.push((kind, format!("TCP connect from {source}: {e}")));
                continue;
            }
        };
        let first: &[u8] = match kind {
            Kind::Silent => &[],
            Kind::HalfIcReq => &icreq[..icreq.len() / 2],
            _ => &icreq,
        };
        if let Err(e) = s.write_all(first) {
            out.failed.push((kind, format!("sending the first bytes: {e}")));
            continue;
        }
        pending.push(Held { kind, stream: s, answered: false });
    }
    let deadline = (Instant::now() + Duration::from_secs(5)).min(answered_by);
    for mut h in pending {
        if matches!(h.kind, Kind::IcReq | Kind::HalfConnect) {
            match read_icresp(&mut h.stream, deadline) {
                Ok(answered) => h.answered = answered,
                Err(e) => {
                    out.failed.push((h.kind, e));
                    continue;
                }
            }
            if h.kind == Kind::HalfConnect && h.answered {
                let data = connect_data(ANY_CONTROLLER, SUBNQN, &random_nqn(&mut rng));
                let capsule = Pdu::CapsuleCmd(connect_entry(0, 31, 0)).to_wire(NO_DIGESTS, &data, 0);
                if let Err(e) = h.stream.write_all(&capsule[..capsule.len() / 2]) {
                    out.failed.push((h.kind, format!("sending half a Connect: {e}")));
                    continue;
                }
            }
        }
        out.held.push(h);
    }
    out
}

/// Opens admin controllers `range` of the 500 (controller j from flood
/// address j % 200): ICReq, a complete admin Connect with KATO 0 and a
/// random host NQN, its completion; then silence.
fn open_controllers(addr: SocketAddr, range: std::ops::Range<usize>, deadline: Instant) -> Opened {
    let mut rng = rand::thread_rng();
    let mut out = Opened::default();
    for j in range {
        let source = flood_address(j);
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            out.failed.push((Kind::Controller, "not attempted: the controllers took too long to set up".into()));
            continue;
        }
        let mut c = match NvmeTcpConn::tcp_from_within(addr, source, left) {
            Ok(c) => c,
            Err(e) => {
                out.failed.push((Kind::Controller, format!("TCP connect from {source}: {e}")));
                continue;
            }
        };
        c.timeout = Duration::from_secs(3);
        if let Err(e) = c.try_initialize(NO_DIGESTS) {
            out.failed.push((Kind::Controller, format!("ICReq: {e}")));
            continue;
        }
        let data = connect_data(ANY_CONTROLLER, SUBNQN, &random_nqn(&mut rng));
        match c.try_exec(connect_entry(0, 31, 0), &data, &[], 0) {
            Ok(_) => out.held.push(Held { kind: Kind::Controller, stream: c.stream, answered: true }),
            Err(e) => out.failed.push((Kind::Controller, format!("admin Connect: {e}"))),
        }
    }
    out
}

/// Runs `open` on OPENERS threads over `0..n` split in ranges; merges.
fn in_parallel(n: usize, open: impl Fn(std::ops::Range<usize>) -> Opened + Sync) -> Opened {
    let open = &open;
    std::thread::scope(|s| {
        let parts: Vec<_> = (0..OPENERS).map(|i| s.spawn(move || open(i * n / OPENERS..(i + 1) * n / OPENERS))).collect();
        let mut all = Opened::default();
        for p in parts {
            let o = p.join().expect("an opener thread panicked");
            all.held.extend(o.held);
            all.failed.extend(o.failed);
        }
        all
    })
}

/// True when the target has closed or reset `s` (EOF or an error on a
/// non-blocking peek); false while it is open.
fn closed_by_target(s: &TcpStream) -> bool {
    s.set_nonblocking(true).unwrap();
    let mut b = [0u8; 1];
    let closed = match s.peek(&mut b) {
        Ok(0) => true,
        Ok(_) => false,
        Err(e) => e.kind() != std::io::ErrorKind::WouldBlock,
    };
    s.set_nonblocking(false).unwrap();
    closed
}

// ---------------------------------------------------------------------------

fn start_target(dir: &std::path::Path) -> (TargetProcess, SocketAddr, String) {
    // A written (not sparse) file, on disk: O_DIRECT writes into it are
    // overwrites, which io_uring does not hand to its kernel workers.
    let img = dir.join("vol.img");
    let mut f = std::fs::File::create(&img).expect("create the volume file");
    for _ in 0..VOL_SIZE / MIB {
        f.write_all(&[0u8; MIB as usize]).expect("write the volume file");
    }
    f.sync_all().expect("fsync the volume file");
    // The defaults for every limit: they are what is under test.
    let config = format!(
        "[target]\nlisten = [\"nvme+tcp://127.0.0.1:0\", \"tcp://127.0.0.1:0\"]\nnqn = \"{SUBNQN}\"\n\
         reactors = 2\nmetrics = \"127.0.0.1:0\"\n\n{}nsid = 1\n",
        file_volume("vol", &img, VOL_SIZE, false)
    );
    let t = TargetProcess::start(&config);
    let url_of = |scheme: &str| {
        let line = t.wait_for_log(&format!("listening on {scheme}://"), Duration::from_secs(10));
        let at = line.find(&format!("{scheme}://")).unwrap();
        line[at..].chars().take_while(|c| !c.is_whitespace() && *c != '"' && *c != ',').collect::<String>()
    };
    let nvme = url_of("nvme+tcp");
    let hp = nvme.trim_start_matches("nvme+tcp://");
    let addr = hp.to_socket_addrs().unwrap_or_else(|e| panic!("{hp}: {e}")).next().expect("an address");
    let v1 = url_of("tcp");
    (t, addr, v1)
}

fn per_kind(items: impl Iterator<Item = Kind>) -> BTreeMap<Kind, usize> {
    let mut m = BTreeMap::new();
    for k in items {
        *m.entry(k).or_insert(0) += 1;
    }
    m
}

#[test]
fn a_connection_flood_starts_no_thread_per_connection_and_locks_nobody_out() {
    let test_start = Instant::now();
    let need = (HANDSHAKES + CONTROLLERS + 500) as u64;
    let nofile = raise_nofile_limit(need);
    assert!(nofile >= need, "this test holds {} connections: RLIMIT_NOFILE is {nofile}, it needs {need}", HANDSHAKES + CONTROLLERS);

    let dir = tempfile::tempdir().unwrap();
    let (t, addr, url) = start_target(dir.path());
    let pid = t.pid();
    let cpus = std::thread::available_parallelism().map_or(2, |n| n.get());

    // 1. Warm-up: one NVMe association and one v1 session doing the same
    // I/O as the legitimate clients below, then gone. Then the baseline.
    {
        let stop = Arc::new(AtomicBool::new(false));
        let (nvme_log, nvme) = start_legit("warm-up-nvme", &stop, move |l, s| nvme_association(addr, l, s));
        let u = url.clone();
        let (v1_log, v1) = start_legit("warm-up-v1", &stop, move |l, s| v1_session(&u, l, s));
        std::thread::sleep(Duration::from_millis(1500));
        stop.store(true, Ordering::Relaxed);
        nvme.join().unwrap();
        v1.join().unwrap();
        for (name, log) in [("NVMe host", &nvme_log), ("v1 client", &v1_log)] {
            let g = log.lock().unwrap();
            let errors: Vec<&String> = g.errors.iter().map(|(_, e)| e).collect();
            assert!(
                errors.is_empty() && !g.rounds.is_empty(),
                "warm-up of the {name} before any flood: {} verified rounds, errors {errors:?}",
                g.rounds.len()
            );
        }
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    while metric(&t, "rdmablk_sessions_connected").unwrap_or(0.0) != 0.0 || metric(&t, "rdmablk_nvme_queues").unwrap_or(0.0) != 0.0 {
        assert!(
            Instant::now() < deadline,
            "the warm-up's v1 session and NVMe queues were still connected (metrics) 10 s after they closed"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let refused_before = refusals(&t);
    let base = settled(pid);
    eprintln!(
        "baseline (idle, after the warm-up): {} threads {:?}, {} io_uring workers, {} fds, RSS {}",
        base.threads,
        base.names,
        base.iou,
        base.fds,
        mib(base.rss)
    );

    // Sampled from the flood's start to its release.
    let mut samples: Vec<Snap> = Vec::new();
    let sample_now = |samples: &mut Vec<Snap>| samples.push(snap(pid));

    // 3. The flood: the admin controllers first (they hold no handshake
    // slot once connected), then the 2,000 handshaking connections.
    let flood_start = Instant::now();
    let controllers = in_parallel(CONTROLLERS, |r| open_controllers(addr, r, flood_start + Duration::from_secs(15)));
    let controllers_took = flood_start.elapsed();
    sample_now(&mut samples);
    // The handshaking connections open in the background: a listener that
    // falls behind in accepting drops SYNs, and the kernel retries them
    // only after 1, 3, 7 s, so their opening is bounded (each TCP connect
    // by t0 + 6 s, each ICResp by t0 + 7 s) and the legitimate clients do
    // not wait for it past LEGIT_START_BY.
    let t0 = Instant::now(); // the first handshaking connection: HOLD runs from here
    let (opened_tx, opened_rx) = std::sync::mpsc::channel();
    let opener = std::thread::spawn(move || {
        let (connect_by, answered_by) = (t0 + Duration::from_secs(6), t0 + Duration::from_secs(7));
        let o = in_parallel(HANDSHAKES, |r| open_handshakes(addr, r, connect_by, answered_by));
        let _ = opened_tx.send(t0.elapsed());
        o
    });
    let release_at = t0 + HOLD;
    let mut opened_in = None;
    while opened_in.is_none() && t0.elapsed() < LEGIT_START_BY {
        opened_in = opened_rx.recv_timeout(Duration::from_millis(250)).ok();
        sample_now(&mut samples);
    }

    // 2. The legitimate clients connect now, with the flood in place (or
    // still opening, LEGIT_START_BY after its first handshaking connection).
    let stop = Arc::new(AtomicBool::new(false));
    let legit_start = Instant::now();
    let (nvme_log, nvme) = start_legit("legit-nvme", &stop, move |l, s| nvme_association(addr, l, s));
    let u = url.clone();
    let (v1_log, v1) = start_legit("legit-v1", &stop, move |l, s| v1_session(&u, l, s));

    // 4. The hold: sample the daemon every 250 ms.
    while Instant::now() + Duration::from_millis(250) < release_at {
        std::thread::sleep(Duration::from_millis(250));
        sample_now(&mut samples);
    }
    std::thread::sleep(release_at.saturating_duration_since(Instant::now()));
    let handshakes = opener.join().expect("the flood's opener thread panicked");
    let handshakes_took = opened_in.or_else(|| opened_rx.try_recv().ok()).unwrap_or_else(|| t0.elapsed());
    sample_now(&mut samples);
    eprintln!(
        "flood opened: {} admin controllers connected ({} failed) in {controllers_took:.2?}; {} handshaking \
        connections open ({} failed) in {handshakes_took:.2?}",
        controllers.held.len(),
        controllers.failed.len(),
        handshakes.held.len(),
        handshakes.failed.len()
    );

    // Which flood connections the target still holds, just before the release.
    let all: Vec<&Held> = controllers.held.iter().chain(handshakes.held.iter()).collect();
    let closed: Vec<Kind> = all.iter().filter(|h| closed_by_target(&h.stream)).map(|h| h.kind).collect();
    let opened = per_kind(all.iter().map(|h| h.kind));
    let answered = per_kind(all.iter().filter(|h| h.answered).map(|h| h.kind));
    let failed = per_kind(controllers.failed.iter().chain(handshakes.failed.iter()).map(|(k, _)| *k));
    let closed_by_kind = per_kind(closed.iter().copied());
    let held_at_release = all.len() - closed.len();
    let first_failures: Vec<String> =
        controllers.failed.iter().chain(handshakes.failed.iter()).map(|(_, e)| e.clone()).take(3).collect();

    // 5. The release.
    let release = Instant::now();
    drop(all);
    drop(controllers);
    drop(handshakes);
    // The legitimate clients keep going a second after the release, then stop.
    std::thread::sleep(Duration::from_secs(1));
    stop.store(true, Ordering::Relaxed);
    nvme.join().unwrap();
    v1.join().unwrap();
    let stopped = Instant::now();

    // Back to the baseline within 10 s.
    let recovery_deadline = Instant::now() + Duration::from_secs(10);
    let after = loop {
        let s = snap(pid);
        let back = s.threads == base.threads && s.fds <= base.fds + FD_SLACK && s.rss <= base.rss + RSS_SLACK;
        if back || Instant::now() >= recovery_deadline {
            break s;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let recovered_in = stopped.elapsed();
    let refused_after = refusals(&t);
    let refused: BTreeMap<String, f64> = refused_after
        .iter()
        .map(|(k, v)| (k.clone(), v - refused_before.get(k).copied().unwrap_or(0.0)))
        .filter(|(_, v)| *v > 0.0)
        .collect();

    // The summary, before any assertion.
    let peak_threads = samples.iter().max_by_key(|s| s.threads).cloned().expect("samples");
    let peak_fds = samples.iter().map(|s| s.fds).max().unwrap();
    let peak_rss = samples.iter().map(|s| s.rss).max().unwrap();
    let peak_iou = samples.iter().map(|s| s.iou).max().unwrap();
    let thread_samples: Vec<usize> = samples.iter().map(|s| s.threads).collect();
    let (nvme_g, v1_g) = (nvme_log.lock().unwrap(), v1_log.lock().unwrap());
    eprintln!("==== nvme_flood summary ====");
    eprintln!(
        "daemon threads (io_uring workers apart): baseline {}, peak {} {:?}, after {} (samples during the flood {thread_samples:?})",
        base.threads, peak_threads.threads, peak_threads.names, after.threads
    );
    eprintln!("daemon io_uring workers: baseline {}, peak {peak_iou}, after {}", base.iou, after.iou);
    eprintln!(
        "daemon fds: baseline {}, peak {peak_fds}, after {} ({recovered_in:.2?} after the clients stopped)",
        base.fds, after.fds
    );
    eprintln!("daemon RSS: baseline {}, peak {}, after {}", mib(base.rss), mib(peak_rss), mib(after.rss));
    eprintln!(
        "flood: {} connections attempted; per state: opened {opened:?}, answered (ICResp / Connect) {answered:?}, \
        failed while being set up {failed:?}, closed by the target before the release {closed_by_kind:?}; held by \
        the target at the release: {held_at_release}",
        HANDSHAKES + CONTROLLERS
    );
    let failed_total: usize = failed.values().sum();
    eprintln!(
        "flood: accepted and held by the target at the release {held_at_release} of {}; refused or closed by the \
        target {} ({failed_total} while being set up, {} later)",
        HANDSHAKES + CONTROLLERS,
        failed_total + closed.len(),
        closed.len()
    );
    if !first_failures.is_empty() {
        eprintln!("flood: first set-up failures: {first_failures:?}");
    }
    eprintln!(
        "target: connections refused (rdmablk_connections_refused_total during the test) {refused:?}; log lines \
        \"refused a connection\": {}",
        t.count_log("refused a connection")
    );
    eprintln!(
        "timeline: controllers {controllers_took:.2?}, handshakes {handshakes_took:.2?}, legitimate clients \
        started at +{:.2?} and the release at +{:.2?} after the first handshaking connection",
        legit_start - t0,
        release - t0
    );
    for (name, g) in [("legitimate NVMe host (127.0.0.250)", &*nvme_g), ("legitimate v1 client (127.0.0.1)", &*v1_g)] {
        eprintln!(
            "{name}: {} connection attempts, {} operations, {} verified rounds during the flood and {} after, \
            worst latency {:.2?} ({}), {} over {OP_LIMIT:?}, {} errors{}",
            g.attempts,
            g.ops,
            g.rounds_between(legit_start, release),
            g.rounds_between(release, stopped),
            g.worst,
            g.worst_op,
            g.slow.len(),
            g.errors.len(),
            g.errors.first().map(|(at, e)| format!(", the first at +{:.2?}: {e}", *at - legit_start)).unwrap_or_default()
        );
    }
    eprintln!("test run time so far: {:.2?}", test_start.elapsed());

    // 4. No thread per connection while the flood is held.
    assert!(
        thread_samples.iter().all(|&n| n == base.threads),
        "daemon threads (/proc/{pid}/task, io_uring workers apart) while it held the flood of {} connections: \
        {thread_samples:?} in {} samples, peak {} ({:?}); baseline {} ({:?}): the target must not start a thread \
        per connection",
        HANDSHAKES + CONTROLLERS,
        samples.len(),
        peak_threads.threads,
        peak_threads.names,
        base.threads,
        base.names
    );
    let iou_bound = base.iou.max(4 * cpus * 2);
    assert!(
        peak_iou <= iou_bound,
        "daemon io_uring kernel workers during the flood: peak {peak_iou}, baseline {}: more than {iou_bound} \
         (4 per CPU per reactor ring)",
        base.iou
    );
    // The legitimate clients connected after the flood was in place and
    // were served throughout, every operation within OP_LIMIT.
    for (name, g) in [("the legitimate NVMe host (127.0.0.250)", &*nvme_g), ("the legitimate v1 client (127.0.0.1)", &*v1_g)] {
        let errors = g.errors_between(legit_start, release);
        assert!(
            errors.is_empty(),
            "{name}, which started connecting {:.2?} after the flood's first handshaking connection, saw {} errors \
            while the flood was held (times after its start), the first: {:?}",
            legit_start - t0,
            errors.len(),
            &errors[..errors.len().min(3)]
        );
        let rounds = g.rounds_between(legit_start, release);
        assert!(
            rounds >= 10,
            "{name} completed {rounds} verified write-and-read rounds in the {:.2?} it had while the flood was \
            held (one every {PERIOD:?} intended)",
            release - legit_start
        );
        assert!(
            g.worst <= OP_LIMIT,
            "{name}: its slowest operation during the test, {}, took {:.2?}, more than {OP_LIMIT:?} ({} operations over it: {:?})",
            g.worst_op,
            g.worst,
            g.slow.len(),
            g.slow
                .iter()
                .take(3)
                .map(|(at, what, took)| format!("{what} {took:.2?} at +{:.2?}", *at - legit_start))
                .collect::<Vec<_>>()
        );
    }
    // The thread count means something only if the target held the flood.
    let total = HANDSHAKES + CONTROLLERS;
    assert!(
        held_at_release * 10 >= total * 9,
        "the target held {held_at_release} of the {total} flood connections until the release (closed per state: \
        {closed_by_kind:?}; failed while being set up: {failed:?}): at least 90 % must be held, below \
        handshake_timeout, for the thread count to show anything"
    );

    // 5. Everything back after the release.
    assert_eq!(
        after.threads, base.threads,
        "daemon threads 10 s after the flood ended (io_uring workers apart): {} {:?}, baseline {} {:?}",
        after.threads, after.names, base.threads, base.names
    );
    assert!(
        after.fds <= base.fds + FD_SLACK,
        "daemon fds 10 s after the flood ended: {}, baseline {} (at most +{FD_SLACK})",
        after.fds,
        base.fds
    );
    assert!(
        after.rss <= base.rss + RSS_SLACK,
        "daemon RSS 10 s after the flood ended: {}, baseline {} (at most +{})",
        mib(after.rss),
        mib(base.rss),
        mib(RSS_SLACK)
    );
    for (name, g) in [("the legitimate NVMe host", &*nvme_g), ("the legitimate v1 client", &*v1_g)] {
        assert!(
            g.errors.is_empty(),
            "{name} saw {} errors from its start to its stop (including after the release), the first: {:?}",
            g.errors.len(),
            g.errors.iter().take(3).map(|(at, e)| format!("at +{:.2?}: {e}", *at - legit_start)).collect::<Vec<_>>()
        );
    }
    t.assert_no_panic();
    eprintln!("test run time: {:.2?}", test_start.elapsed());
}
