//! A peer that stops reading holds the buffer pool (issue 18): eight
//! connections from one address CONNECT with queue depth 128, OPEN a
//! volume, post 128 one-MiB READs each and then never read their socket, so
//! they acknowledge nothing and the target's RDMA WRITEs of the data never
//! complete. Every chunk they got stays theirs. A legitimate initiator from
//! another address must still list, write and read back within a couple of
//! seconds of the attack's start (before any transport timeout could end
//! the attackers' queue pairs), and the daemon must give back what the
//! attack took once it ends.

use std::sync::mpsc;
use std::time::{Duration, Instant};

use rand::RngCore;
use rdmablk_common::protocol::{BlockCount, CommandCapsule, CommandId, Lba, Opcode};
use rdmablk_initiator::{BlockDevice, ConnectOptions, Session};
use rdmablk_system_tests::wire;
use rdmablk_system_tests::{file_volume, open_fds, rss_bytes, sample, scrape, sparse_file, wait_until, TargetProcess, WireConn};

const MIB: u64 = 1 << 20;
/// Attacking connections, all from one address.
const ATTACKERS: usize = 8;
/// Each one's queue depth, and the READs it posts.
const DEPTH: u32 = 128;

fn target(extra: &str, dir: &std::path::Path) -> TargetProcess {
    let file = sparse_file(dir, "vol.img", 64 * MIB);
    let config = format!(
        "[target]\nlisten = [\"tcp://127.0.0.1:0\"]\nreactors = 2\npin_reactors = false\nmetrics = \"127.0.0.1:0\"\n{extra}\n{}",
        file_volume("vol", &file, 64 * MIB, false)
    );
    TargetProcess::start(&config)
}

fn options(host: &str) -> ConnectOptions {
    ConnectOptions { host_id: host.into(), queues: 2, ..ConnectOptions::default() }
}

/// A verified 1 MiB write and read through the real initiator library.
fn legit_io(url: &str, offset: u64) {
    let session = Session::connect(url, options("legit-host")).expect("the legitimate initiator connects");
    let vol = session.open("vol").expect("open");
    let mut data = vec![0u8; MIB as usize];
    rand::thread_rng().fill_bytes(&mut data);
    vol.write_at(&data, offset).expect("write");
    let mut back = vec![0u8; data.len()];
    vol.read_at(&mut back, offset).expect("read");
    assert!(back == data, "the legitimate initiator read back other bytes");
    session.close();
}

/// What `rdmablk list` does, then a verified write and read: in a thread,
/// so that a client the attack starves fails the test in seconds rather
/// than after its own timeouts. Returns how long it took.
fn legit_client_within(url: &str, limit: Duration) -> Result<Duration, String> {
    let (tx, rx) = mpsc::channel();
    let url = url.to_owned();
    std::thread::spawn(move || {
        let t0 = Instant::now();
        let session = Session::connect(url.as_str(), options("legit-host")).expect("the legitimate initiator connects");
        assert_eq!(session.list_volumes().expect("list").len(), 1);
        session.close();
        legit_io(&url, 8 * MIB);
        let _ = tx.send(t0.elapsed());
    });
    match rx.recv_timeout(limit) {
        Ok(took) => Ok(took),
        Err(mpsc::RecvTimeoutError::Timeout) => Err(format!("not done within {limit:?}")),
        Err(mpsc::RecvTimeoutError::Disconnected) => Err("it failed (see its panic above)".into()),
    }
}

/// Per reactor: (pool chunks in use, commands waiting for a chunk).
fn pool(t: &TargetProcess) -> Vec<(u64, u64)> {
    let m = scrape(&t.metrics_addr());
    (0..2)
        .map(|r| {
            let r = r.to_string();
            let get = |name| sample(&m, name, &[("reactor", &r)]).unwrap_or_else(|| panic!("metric {name} missing")) as u64;
            (get("rdmablk_buffer_pool_chunks_in_use"), get("rdmablk_buffer_pool_waiting_commands"))
        })
        .collect()
}

fn sessions(t: &TargetProcess) -> f64 {
    sample(&scrape(&t.metrics_addr()), "rdmablk_sessions_connected", &[]).expect("rdmablk_sessions_connected")
}

/// One attacking connection from `source`: HELLO, CONNECT (queue depth
/// 128), OPEN, then 128 one-MiB READs. It reads nothing after that.
fn reader_that_stops_reading(url: &str, source: std::net::Ipv4Addr, i: usize) -> WireConn {
    let mut c = WireConn::raw_from(url, source);
    c.send(&wire::hello());
    let (h, body) = c.read_frame(Duration::from_secs(10)).expect("a HELLO_REPLY");
    assert_eq!(h.ty, wire::HELLO_REPLY);
    assert_eq!(u32::from_le_bytes(body[8..12].try_into().unwrap()), 0, "HELLO accepted");
    let reply = c.connect(&format!("reader-{i}"), DEPTH);
    assert_eq!(reply.queue_depth, DEPTH);
    let vol = c.open_volume("vol");
    let blocks = (MIB / vol.block_size as u64) as u32;
    for k in 0..DEPTH as u64 {
        let mut cmd = CommandCapsule::new(Opcode::Read, CommandId(0));
        cmd.volume_id = vol.volume_id;
        cmd.start_block = Lba((k % 64) * blocks as u64);
        cmd.block_count = BlockCount(blocks);
        cmd.descriptor = c.descriptor(0, MIB as u32);
        c.post(cmd, &[]);
    }
    c
}

/// Starts the attack from `source` and waits until every one of its READs
/// holds chunks or waits for one.
fn attack(t: &TargetProcess, source: std::net::Ipv4Addr) -> Vec<WireConn> {
    let t0 = Instant::now();
    let held: Vec<WireConn> = (0..ATTACKERS).map(|i| reader_that_stops_reading(&t.url, source, i)).collect();
    let posted = (ATTACKERS as u32 * DEPTH) as u64;
    wait_until("the attack's READs hold chunks or wait", Duration::from_secs(10), || {
        let p = pool(t);
        // A READ holds at most 8 chunks of 128 KiB.
        p.iter().map(|&(used, waiting)| used.div_ceil(8) + waiting).sum::<u64>() >= posted - 2
    });
    eprintln!(
        "{ATTACKERS} connections from {source} posted {posted} 1 MiB READs in {:?}: (chunks in use, commands waiting) per reactor {:?}, of 512 chunks each",
        t0.elapsed(),
        pool(t)
    );
    held
}

#[test]
fn readers_that_stop_reading_do_not_hold_the_whole_pool() {
    let attacker: std::net::Ipv4Addr = "127.0.0.2".parse().unwrap();
    let dir = tempfile::tempdir().unwrap();
    // The defaults: two reactors of 512 chunks of 128 KiB (64 MiB each).
    let t = target("", dir.path());
    let pid = t.pid();
    // Settle (rings, a first session) for the baseline. The pool's pages
    // are resident from the start: io_uring pins its fixed buffers.
    legit_io(&t.url, 0);
    wait_until("the first session is gone", Duration::from_secs(10), || sessions(&t) == 0.0);
    let (fds_base, rss_base) = (open_fds(pid), rss_bytes(pid));

    let attack_start = Instant::now();
    let held = attack(&t, attacker);
    // The legitimate initiator, from 127.0.0.1, meanwhile.
    let took = legit_client_within(&t.url, Duration::from_secs(5));
    let since_attack = attack_start.elapsed();
    let (fds_during, rss_during) = (open_fds(pid), rss_bytes(pid));
    let still = pool(&t);
    eprintln!(
        "the legitimate initiator (list, 1 MiB write and read back): {took:?}, done {since_attack:?} after the attack started; pool then {still:?}; daemon fds {fds_base} -> {fds_during}, RSS {} KiB -> {} KiB",
        rss_base / 1024,
        rss_during / 1024
    );
    let took = took.unwrap_or_else(|e| panic!("the legitimate initiator during the attack: {e}; pool {still:?}"));
    assert!(took < Duration::from_secs(2), "the legitimate initiator took {took:?}");
    // The attack was in force all along: every attacker still connected and
    // holding chunks (no timeout had ended them).
    assert!(sessions(&t) >= ATTACKERS as f64, "the attackers are still connected");
    assert!(still.iter().all(|&(used, _)| used > 0), "the attackers still hold chunks: {still:?}");

    // When the attack ends, what it took comes back.
    drop(held);
    wait_until("the attack's descriptors are gone", Duration::from_secs(15), || open_fds(pid) <= fds_base + 2);
    wait_until("the attack's chunks are back", Duration::from_secs(15), || pool(&t).iter().all(|&p| p == (0, 0)));
    let (fds_after, rss_after) = (open_fds(pid), rss_bytes(pid));
    eprintln!("after the attack: daemon fds {fds_after} (base {fds_base}), RSS {} KiB (base {} KiB)", rss_after / 1024, rss_base / 1024);
    assert!(rss_after <= rss_base + 8 * MIB, "daemon RSS {} KiB after the attack, {} KiB before", rss_after / 1024, rss_base / 1024);
    legit_io(&t.url, 16 * MIB);
    t.assert_no_panic();
}
