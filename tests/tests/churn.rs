//! Queue pair churn against the real daemon: opening and closing hundreds
//! of rdmablk v1 queue pairs, round after round, must not grow its memory.
//!
//! Each round opens 600 queue pairs (75 sessions of 8, each queue pair from
//! one of 249 source addresses, 127.0.0.2 to 127.0.0.250, so that no
//! per-address limit refuses them), does verified I/O on some, closes them
//! all, waits until the daemon reports no session and its descriptors are
//! back, and records its RSS. A daemon that kept something per queue pair
//! (a leak) or whose allocator kept what the queue pairs freed (retention)
//! grew round after round: 238 MiB after the first round, 383 to 409 MiB
//! after the eighth (retention: glibc's reactor arenas held 300 MiB free
//! with under 2 MiB in use, and the RSS with the queue pairs open stayed at
//! 573 MiB from the third round on). The same churn of NVMe/TCP queues (75
//! controllers of an admin queue and 7 I/O queues) must not grow either.

use std::net::{Ipv4Addr, SocketAddr};
use std::time::{Duration, Instant};

use rdmablk_common::nvme::sqe::io_opcode;
use rdmablk_common::nvme::tcp::Digests;
use rdmablk_common::protocol::{BlockCount, CommandCapsule, CommandId, Lba, Opcode, SessionId, Status, PROTOCOL_VERSION};
use rdmablk_system_tests::nvme_tcp::{rw_entry, NvmeTcpConn};
use rdmablk_system_tests::{
    file_volume, legit_io, open_fds, raise_nofile_limit, rss_bytes, sample, sample_sum, scrape, sparse_file, wait_until, Sample,
    TargetProcess, WireConn,
};

const MIB: u64 = 1 << 20;
const ROUNDS: usize = 8;
/// rdmablk v1 sessions, or NVMe-oF controllers, of a round.
const SESSIONS: usize = 75;
/// Queue pairs of a v1 session; queues of a controller (its admin queue
/// and 7 I/O queues).
const QUEUES_PER_SESSION: usize = 8;
const QUEUE_PAIRS: usize = SESSIONS * QUEUES_PER_SESSION;
/// Source addresses 127.0.0.2 ..= 127.0.0.250.
const ADDRESSES: usize = 249;
/// Threads that open a round's queue pairs.
const OPENERS: usize = 4;
/// What the last round's RSS may exceed the first round's by.
const RSS_SLACK: u64 = 64 * MIB;
const SUBNQN: &str = "nqn.2026-12.io.rdmablk.test:churn";
const NO_DIGESTS: Digests = Digests { header: false, data: false };

fn source(k: usize) -> Ipv4Addr {
    Ipv4Addr::new(127, 0, 0, 2 + (k % ADDRESSES) as u8)
}

fn metric(t: &TargetProcess, name: &str) -> f64 {
    sample(&scrape(&t.metrics_addr()), name, &[]).unwrap_or_else(|| panic!("metric {name} missing"))
}

/// A CONNECT as `host` joining `session` (0: a new one), on a connection
/// that completed its HELLO; the session it joined.
fn connect(c: &mut WireConn, host: &str, session: SessionId) -> SessionId {
    let mut cap = CommandCapsule::new(Opcode::Connect, CommandId(0));
    cap.version = PROTOCOL_VERSION;
    cap.queue_depth = 128;
    cap.max_io_size = 1 << 20;
    cap.session_id = session;
    let (r, data) = c.command(cap, host.as_bytes());
    assert_eq!(r.status, Status::Success, "CONNECT of {host} from {}: {r:?}", c.peer);
    rdmablk_common::protocol::ConnectReply::decode(&data).expect("connect reply").session_id
}

fn hello_from(url: &str, from: Ipv4Addr) -> WireConn {
    let mut c = WireConn::raw_from(url, from);
    c.send(&rdmablk_system_tests::wire::hello());
    let (h, body) = c.read_frame(Duration::from_secs(10)).expect("a HELLO_REPLY");
    assert_eq!(h.ty, rdmablk_system_tests::wire::HELLO_REPLY);
    assert_eq!(u32::from_le_bytes(body[8..12].try_into().unwrap()), 0, "HELLO refused: {}", String::from_utf8_lossy(&body[32..]));
    c
}

/// A verified 64 KiB WRITE (the daemon's RDMA READ from `c.mem`) and READ
/// (its RDMA WRITE into it) at block `lba` of volume `vol`.
fn verified_io(c: &mut WireConn, lba: u64, fill: u8) {
    let info = c.open_volume("vol");
    let len = 64 * 1024;
    c.mem[..len].fill(fill);
    let io = |op: Opcode, c: &WireConn, off: u64| {
        let mut cap = CommandCapsule::new(op, CommandId(0));
        cap.volume_id = info.volume_id;
        cap.start_block = Lba(lba);
        cap.block_count = BlockCount(len as u32 / 4096);
        cap.descriptor = c.descriptor(off, len as u32);
        cap
    };
    let w = io(Opcode::Write, c, 0);
    let (r, _) = c.command(w, &[]);
    assert_eq!(r.status, Status::Success, "WRITE: {r:?}");
    let rd = io(Opcode::Read, c, 1 << 19);
    let (r, _) = c.command(rd, &[]);
    assert_eq!(r.status, Status::Success, "READ: {r:?}");
    assert!(c.mem[1 << 19..(1 << 19) + len].iter().all(|&b| b == fill), "READ brought back other bytes");
}

/// The queue pairs of `sessions` (of the round's 75), with their I/O.
fn open_sessions(url: &str, round: usize, sessions: std::ops::Range<usize>) -> Vec<WireConn> {
    let mut conns = Vec::with_capacity(sessions.len() * QUEUES_PER_SESSION);
    for s in sessions {
        let host = format!("churn-{round}-{s}");
        let mut id = SessionId(0);
        for q in 0..QUEUES_PER_SESSION {
            let mut c = hello_from(url, source(s * QUEUES_PER_SESSION + q));
            let joined = connect(&mut c, &host, id);
            if q == 0 {
                id = joined;
            }
            // A little I/O on some: the first queue of every fifth session.
            if q == 0 && s % 5 == 0 {
                verified_io(&mut c, (s * 16) as u64, (round * SESSIONS + s) as u8 | 1);
            }
            conns.push(c);
        }
    }
    conns
}

/// The queues of controllers `controllers` (of the round's 75): an admin
/// queue (KATO 0: it ends with its connection) and 7 I/O queues of 128
/// entries each, with a verified 4 KiB write (its data in the capsule)
/// and read on each I/O queue: what an NVMe/TCP queue holds beyond its
/// socket comes with its first commands.
fn open_controllers(addr: SocketAddr, round: usize, controllers: std::ops::Range<usize>) -> Vec<NvmeTcpConn> {
    let mut conns = Vec::with_capacity(controllers.len() * QUEUES_PER_SESSION);
    for c in controllers {
        let hostnqn = format!("nqn.2026-12.io.rdmablk.test:churn-host-{round}-{c}");
        let from = |q: usize| source(c * QUEUES_PER_SESSION + q);
        let mut admin = NvmeTcpConn::connect_from(addr, from(0), NO_DIGESTS);
        let cntlid = admin.admin_connect(SUBNQN, &hostnqn, 0).unwrap_or_else(|s| panic!("admin Connect of {hostnqn}: {s}"));
        admin.enable();
        conns.push(admin);
        for qid in 1..QUEUES_PER_SESSION as u16 {
            let mut io = NvmeTcpConn::connect_from(addr, from(qid as usize), NO_DIGESTS);
            io.io_connect_sized(cntlid, qid, 127, SUBNQN, &hostnqn).unwrap_or_else(|s| panic!("I/O Connect of {hostnqn} queue {qid}: {s}"));
            {
                let block = vec![(round * SESSIONS + c) as u8 | 1; 4096];
                let lba = (c * 16 + qid as usize) as u64;
                io.exec_ok(rw_entry(io_opcode::WRITE, 1, lba, 1, false), &block, &[], 0).expect("NVMe Write");
                let back = io.exec_ok(rw_entry(io_opcode::READ, 1, lba, 1, false), &[], &[], 4096).expect("NVMe Read").data;
                assert!(back == block, "NVMe Read brought back other bytes");
            }
            conns.push(io);
        }
    }
    conns
}

/// A target with the default pool on two reactors, listening on `listen`
/// (`tcp` or `nvme+tcp`), with a 64 MiB file volume (namespace 1).
fn start_target(dir: &std::path::Path, listen: &str) -> TargetProcess {
    let file = sparse_file(dir, "vol.img", 64 * MIB);
    let config = format!(
        "[target]\nlisten = [\"{listen}://127.0.0.1:0\"]\nnqn = \"{SUBNQN}\"\nreactors = 2\npin_reactors = false\n\
         metrics = \"127.0.0.1:0\"\n{}nsid = 1\n",
        file_volume("vol", &file, 64 * MIB, false)
    );
    TargetProcess::start(&config)
}

/// Eight rounds: `open` opens a round's queues (in `OPENERS` threads, each
/// given a range of the round's 75 sessions or controllers), `open_now`
/// checks the daemon holds them all; they are closed, and once `gone` says
/// the daemon let them go and its descriptors are back, its RSS is taken.
/// Returns the RSS after each round.
fn churn<C: Send>(
    t: &TargetProcess,
    what: &str,
    open: impl Fn(usize, std::ops::Range<usize>) -> Vec<C> + Sync,
    open_now: impl Fn(&[Sample]) -> bool,
    gone: impl Fn(&[Sample]) -> bool,
) -> Vec<u64> {
    let pid = t.pid();
    let (fds_base, rss_base) = (open_fds(pid), rss_bytes(pid));
    eprintln!("{what}: baseline {fds_base} fds, RSS {} MiB", rss_base / MIB);
    let t0 = Instant::now();
    let mut after = Vec::new();
    let mut fds_after = None;
    for round in 0..ROUNDS {
        let r0 = Instant::now();
        let per = SESSIONS.div_ceil(OPENERS);
        let conns: Vec<C> = std::thread::scope(|scope| {
            let open = &open;
            let openers: Vec<_> = (0..OPENERS).map(|o| scope.spawn(move || open(round, o * per..((o + 1) * per).min(SESSIONS)))).collect();
            openers.into_iter().flat_map(|h| h.join().expect("an opener panicked")).collect()
        });
        assert_eq!(conns.len(), QUEUE_PAIRS);
        let m = scrape(&t.metrics_addr());
        assert!(open_now(&m), "round {round}: the daemon does not report the round's {QUEUE_PAIRS} queues");
        assert_eq!(sample_sum(&m, "rdmablk_reactor_queue_pairs"), QUEUE_PAIRS as f64);
        let (fds_open, rss_open) = (open_fds(pid), rss_bytes(pid));
        drop(conns);
        wait_until("every queue is gone", Duration::from_secs(20), || {
            let m = scrape(&t.metrics_addr());
            gone(&m) && sample_sum(&m, "rdmablk_reactor_queue_pairs") == 0.0
        });
        // The reactors keep the completion queues they made for a round
        // (one per 64 queue pairs, a few descriptors each): the first
        // round's count is what the later ones come back to.
        let fds_limit = *fds_after.get_or_insert_with(|| {
            wait_until("the first round's sockets are gone", Duration::from_secs(20), || open_fds(pid) <= fds_base + 64);
            std::thread::sleep(Duration::from_millis(200));
            open_fds(pid)
        });
        wait_until("the round's descriptors are gone", Duration::from_secs(20), || open_fds(pid) <= fds_limit + 2);
        let rss = rss_bytes(pid);
        eprintln!(
            "{what} round {round}: {QUEUE_PAIRS} queues open: {fds_open} fds, RSS {} MiB; all closed: {} fds, RSS {} MiB ({:?})",
            rss_open / MIB,
            open_fds(pid),
            rss / MIB,
            r0.elapsed()
        );
        after.push(rss);
    }
    eprintln!("{what}: RSS after each round (MiB): {:?}, in {:?}", after.iter().map(|r| r / MIB).collect::<Vec<_>>(), t0.elapsed());
    after
}

fn assert_bounded(what: &str, after: &[u64]) {
    let (first, last) = (after[0], after[after.len() - 1]);
    assert!(
        last <= first + RSS_SLACK,
        "{what}: RSS grew from {} MiB after the first round to {} MiB after the last (each round: {:?} MiB)",
        first / MIB,
        last / MIB,
        after.iter().map(|r| r / MIB).collect::<Vec<_>>()
    );
}

#[test]
fn queue_pair_churn_does_not_grow_memory() {
    // 600 connections of ours at once, and the daemon's.
    raise_nofile_limit(4096);
    let dir = tempfile::tempdir().unwrap();
    let t = start_target(dir.path(), "tcp");
    legit_io(&t.url, 0);
    wait_until("the first session is gone", Duration::from_secs(10), || metric(&t, "rdmablk_sessions_connected") == 0.0);
    let after = churn(
        &t,
        "rdmablk v1",
        |round, sessions| open_sessions(&t.url, round, sessions),
        |m| sample(m, "rdmablk_sessions_connected", &[]) == Some(SESSIONS as f64),
        |m| sample(m, "rdmablk_sessions_connected", &[]) == Some(0.0),
    );
    assert_bounded("rdmablk v1", &after);
    // The daemon still serves.
    legit_io(&t.url, 32 * MIB);
    t.assert_no_panic();
}

#[test]
fn nvme_tcp_queue_churn_does_not_grow_memory() {
    raise_nofile_limit(4096);
    let dir = tempfile::tempdir().unwrap();
    let t = start_target(dir.path(), "nvme+tcp");
    let addr = t.nvme_tcp_addr();
    // One association first, so that one-time allocations are in the baseline.
    drop(open_controllers(addr, ROUNDS, 0..1));
    wait_until("the first controller is gone", Duration::from_secs(10), || metric(&t, "rdmablk_nvme_controllers") == 0.0);
    let after = churn(
        &t,
        "NVMe/TCP",
        |round, controllers| open_controllers(addr, round, controllers),
        |m| sample(m, "rdmablk_nvme_controllers", &[]) == Some(SESSIONS as f64),
        |m| sample(m, "rdmablk_nvme_controllers", &[]) == Some(0.0) && sample(m, "rdmablk_nvme_queues", &[]) == Some(0.0),
    );
    assert_bounded("NVMe/TCP", &after);
    // The daemon still serves.
    drop(open_controllers(addr, ROUNDS + 1, 0..1));
    t.assert_no_panic();
}
