//! Queue pair churn against the real daemon: opening and closing hundreds
//! of rdmablk v1 queue pairs, round after round, must not grow its memory.
//!
//! Each round opens 600 queue pairs (75 sessions of 8, each queue pair from
//! one of 249 source addresses, 127.0.0.2 to 127.0.0.250, so that no
//! per-address limit refuses them), does verified I/O on some, closes them
//! all, waits until the daemon reports no session and its descriptors are
//! back, and records its RSS. A daemon that kept something per queue pair
//! (a leak) or whose allocator kept what the queue pairs freed (retention)
//! grew round after round: 231 MiB after the first round, 420 MiB after the
//! eighth.

use std::net::Ipv4Addr;
use std::time::{Duration, Instant};

use rdmablk_common::protocol::{BlockCount, CommandCapsule, CommandId, Lba, Opcode, SessionId, Status, PROTOCOL_VERSION};
use rdmablk_system_tests::{
    file_volume, legit_io, open_fds, raise_nofile_limit, rss_bytes, sample, sample_sum, scrape, sparse_file, wait_until, TargetProcess,
    WireConn,
};

const MIB: u64 = 1 << 20;
const ROUNDS: usize = 8;
const SESSIONS: usize = 75;
const QUEUES_PER_SESSION: usize = 8;
const QUEUE_PAIRS: usize = SESSIONS * QUEUES_PER_SESSION;
/// Source addresses 127.0.0.2 ..= 127.0.0.250.
const ADDRESSES: usize = 249;
/// Threads that open a round's queue pairs.
const OPENERS: usize = 4;
/// What the last round's RSS may exceed the first round's by.
const RSS_SLACK: u64 = 64 * MIB;

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

#[test]
fn queue_pair_churn_does_not_grow_memory() {
    // 600 connections of ours at once, and the daemon's.
    raise_nofile_limit(4096);
    let dir = tempfile::tempdir().unwrap();
    let file = sparse_file(dir.path(), "vol.img", 64 * MIB);
    // The default pool, two reactors; room for a round's 75 sessions.
    let config = format!(
        "[target]\nlisten = [\"tcp://127.0.0.1:0\"]\nreactors = 2\npin_reactors = false\nmetrics = \"127.0.0.1:0\"\n{}",
        file_volume("vol", &file, 64 * MIB, false)
    );
    let t = TargetProcess::start(&config);
    let pid = t.pid();
    legit_io(&t.url, 0);
    wait_until("the first session is gone", Duration::from_secs(10), || metric(&t, "rdmablk_sessions_connected") == 0.0);
    let (fds_base, rss_base) = (open_fds(pid), rss_bytes(pid));
    eprintln!("baseline: {fds_base} fds, RSS {} MiB", rss_base / MIB);

    let t0 = Instant::now();
    let mut after = Vec::new();
    let mut fds_after = None;
    for round in 0..ROUNDS {
        let r0 = Instant::now();
        let per = SESSIONS.div_ceil(OPENERS);
        let conns: Vec<WireConn> = std::thread::scope(|scope| {
            let url = &t.url;
            let openers: Vec<_> = (0..OPENERS)
                .map(|o| scope.spawn(move || open_sessions(url, round, o * per..((o + 1) * per).min(SESSIONS))))
                .collect();
            openers.into_iter().flat_map(|h| h.join().expect("an opener panicked")).collect()
        });
        assert_eq!(conns.len(), QUEUE_PAIRS);
        assert_eq!(metric(&t, "rdmablk_sessions_connected"), SESSIONS as f64);
        let (fds_open, rss_open) = (open_fds(pid), rss_bytes(pid));
        drop(conns);
        wait_until("every queue pair is gone", Duration::from_secs(20), || {
            let m = scrape(&t.metrics_addr());
            sample(&m, "rdmablk_sessions_connected", &[]) == Some(0.0) && sample_sum(&m, "rdmablk_reactor_queue_pairs") == 0.0
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
            "round {round}: {QUEUE_PAIRS} queue pairs open: {fds_open} fds, RSS {} MiB; all closed: {} fds, RSS {} MiB ({:?})",
            rss_open / MIB,
            open_fds(pid),
            rss / MIB,
            r0.elapsed()
        );
        after.push(rss);
    }
    eprintln!("RSS after each round (MiB): {:?}, in {:?}", after.iter().map(|r| r / MIB).collect::<Vec<_>>(), t0.elapsed());
    let (first, last) = (after[0], after[ROUNDS - 1]);
    assert!(
        last <= first + RSS_SLACK,
        "RSS grew from {} MiB after the first round to {} MiB after the last (each round: {:?} MiB)",
        first / MIB,
        last / MIB,
        after.iter().map(|r| r / MIB).collect::<Vec<_>>()
    );
    // The daemon still serves.
    legit_io(&t.url, 32 * MIB);
    t.assert_no_panic();
}
