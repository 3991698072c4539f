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

use rdmablk_common::protocol::{BlockCount, CommandCapsule, CommandId, Lba, Opcode, Status};
use rdmablk_initiator::{ConnectOptions, Session};
use rdmablk_system_tests::raw::{io_command, RawQueue};
use rdmablk_system_tests::{
    file_bytes, file_volume, legit_io, open_fds, pool_use, rss_bytes, sample, scrape, sparse_file, wait_until, wire, TargetProcess,
    WireConn, WireEvent,
};

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
        let p = pool_use(t, 2);
        // A READ holds at most 8 chunks of 128 KiB.
        p.iter().map(|&(used, waiting)| used.div_ceil(8) + waiting).sum::<u64>() >= posted - 2
    });
    eprintln!(
        "{ATTACKERS} connections from {source} posted {posted} 1 MiB READs in {:?}: (chunks in use, commands waiting) per reactor {:?}, of 512 chunks each",
        t0.elapsed(),
        pool_use(t, 2)
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
    let still = pool_use(&t, 2);
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
    wait_until("the attack's chunks are back", Duration::from_secs(15), || pool_use(&t, 2).iter().all(|&p| p == (0, 0)));
    let (fds_after, rss_after) = (open_fds(pid), rss_bytes(pid));
    eprintln!("after the attack: daemon fds {fds_after} (base {fds_base}), RSS {} KiB (base {} KiB)", rss_after / 1024, rss_base / 1024);
    assert!(rss_after <= rss_base + 8 * MIB, "daemon RSS {} KiB after the attack, {} KiB before", rss_after / 1024, rss_base / 1024);
    legit_io(&t.url, 16 * MIB);
    t.assert_no_panic();
}

/// The same attack, held: the attackers keep their sockets open and never
/// read them. The tcp provider's transport timeout (the analog of an RC
/// NIC's retry limit) fails their queue pairs, which gives every chunk back
/// while they still hold their connections; the target logs why.
#[test]
fn a_held_attack_loses_its_chunks_at_the_transport_timeout() {
    let attacker: std::net::Ipv4Addr = "127.0.0.2".parse().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let t = target("transport_timeout = \"1s\"", dir.path());
    legit_io(&t.url, 0);
    wait_until("the first session is gone", Duration::from_secs(10), || sessions(&t) == 0.0);
    let t0 = Instant::now();
    let held = attack(&t, attacker);
    // One timeout, or two while bytes stay queued to a peer that reads
    // nothing (the first deadline only takes a mark of its progress), plus
    // slack for a loaded machine.
    let took = wait_until("the attackers' chunks are back while they hold their sockets", Duration::from_secs(10), || {
        pool_use(&t, 2).iter().all(|&p| p == (0, 0))
    });
    eprintln!("the held attack's chunks were back {:?} after it started ({took:?} of waiting)", t0.elapsed());
    assert_eq!(sessions(&t), 0.0, "the attackers' sessions ended");
    t.wait_for_log("no progress on an outstanding request within the transport timeout", Duration::from_secs(5));
    // The target reset them: each attacker finds its connection gone.
    for mut c in held {
        c.stream.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let mut buf = [0u8; 1 << 16];
        loop {
            match std::io::Read::read(&mut c.stream, &mut buf) {
                Ok(0) | Err(_) => break,
                Ok(_) => continue,
            }
        }
    }
    legit_io(&t.url, 16 * MIB);
    t.assert_no_panic();
}

/// A command the pool cannot serve is not kept waiting forever: after
/// `chunk_wait_timeout` it is answered `OutOfBuffers`, once, after the
/// chunks it has in flight (a READ that got part of its chunks) finished;
/// the reactor wakes for that deadline by itself; a WRITE so answered
/// wrote nothing; the library says what happened. The pool's three chunks
/// are held by three sessions, one each: the fair share lets a session
/// that holds one chunk of three take no second while another holds one.
#[test]
fn a_command_that_waits_too_long_for_a_chunk_is_answered_out_of_buffers() {
    const KIB: u32 = 1024;
    let dir = tempfile::tempdir().unwrap();
    let file = sparse_file(dir.path(), "vol.img", 64 * MIB);
    let gate = dir.path().join("hold-writes");
    // One reactor with three chunks; the static share does not limit a session.
    let config = format!(
        "[target]\nlisten = [\"tcp://127.0.0.1:0\"]\nreactors = 1\npin_reactors = false\nmetrics = \"127.0.0.1:0\"\n\
         buffer_pool = \"384KiB\"\nchunk_size = \"128KiB\"\nsession_pool_share = \"100%\"\nchunk_wait_timeout = \"1s\"\n{}",
        file_volume("vol", &file, 64 * MIB, false)
    );
    let t = TargetProcess::start_with_env(&config, &[("RDMABLK_FAULT_HOLD_WRITES", gate.to_str().unwrap())], &[]);
    let m = |name: &str| sample(&scrape(&t.metrics_addr()), name, &[("reactor", "0")]).unwrap_or_else(|| panic!("{name} missing"));

    // The holder's 128 KiB write reaches the disk and is held there: one chunk.
    let (mut holder, reply) = RawQueue::connected(&t.url, MIB as usize);
    std::fs::write(&gate, format!("{:#x}", reply.session_id.0)).unwrap();
    let hvol = holder.open_volume("vol").unwrap();
    holder.data_mut().fill(0xab);
    let held = holder.post(io_command(Opcode::Write, hvol.volume_id, 0, 32, holder.descriptor(0, 128 * KIB)), &[]);
    wait_until("the holder's write is at the disk", Duration::from_secs(10), || {
        let _ = holder.next_response(Duration::from_millis(20));
        m("rdmablk_buffer_pool_chunks_in_use") == 1.0
    });

    // Two readers that do not read their sockets: a 128 KiB READ of one
    // takes a chunk (read, then sent and never acknowledged); the other's
    // 256 KiB READ takes the third chunk and waits for another. Their
    // offsets lie apart: no readahead (whose expiry wakes a reactor).
    let read_of = |reader: &mut WireConn, start: u64, blocks: u32| {
        let vol = reader.open_volume("vol");
        let mut read = CommandCapsule::new(Opcode::Read, CommandId(0));
        read.volume_id = vol.volume_id;
        read.start_block = Lba(start);
        read.block_count = BlockCount(blocks);
        read.descriptor = reader.descriptor(0, blocks * 4 * KIB);
        reader.post(read, &[])
    };
    let mut still = WireConn::hello(&t.url);
    still.connect("still-reader", 8);
    read_of(&mut still, 0, 32);
    wait_until("the first READ holds a chunk", Duration::from_secs(10), || m("rdmablk_buffer_pool_chunks_in_use") == 2.0);
    let mut reader = WireConn::hello(&t.url);
    reader.connect("reader", 8);
    let read = read_of(&mut reader, 1024, 64);
    wait_until("the READ holds the last chunk and waits", Duration::from_secs(10), || {
        m("rdmablk_buffer_pool_chunks_in_use") == 3.0 && m("rdmablk_buffer_pool_waiting_commands") == 1.0
    });

    // A 128 KiB WRITE of another session waits for a chunk too.
    let (mut writer, _) = RawQueue::connected(&t.url, MIB as usize);
    let wvol = writer.open_volume("vol").unwrap();
    writer.data_mut().fill(0xcd);
    let t0 = Instant::now();
    let write = writer.post(io_command(Opcode::Write, wvol.volume_id, 256, 32, writer.descriptor(0, 128 * KIB)), &[]);
    wait_until("the WRITE waits", Duration::from_secs(5), || m("rdmablk_buffer_pool_waiting_commands") == 2.0);
    // Waiting, the reactor sleeps (nothing else wakes it: no keep-alives here).
    let waits = m("rdmablk_reactor_idle_waits_total");
    std::thread::sleep(Duration::from_millis(300));
    let slept = m("rdmablk_reactor_idle_waits_total") - waits;
    assert!(slept <= 5.0, "the reactor woke {slept} times in 300 ms with commands waiting");

    // It wakes for the deadline and answers.
    let r = writer.wait_response(write, Duration::from_secs(10)).expect("the WRITE's answer");
    let took = t0.elapsed();
    eprintln!("the waiting WRITE was answered {:?} after {took:?} (detail {} ms)", r.capsule.status, r.capsule.detail);
    assert_eq!(r.capsule.status, Status::OutOfBuffers);
    assert!(r.capsule.detail >= 1000, "detail: the milliseconds it waited, {}", r.capsule.detail);
    assert!(took >= Duration::from_secs(1) && took < Duration::from_millis(2500), "answered after {took:?}");
    assert_eq!(file_bytes(&file, MIB, (128 * KIB) as usize), vec![0u8; (128 * KIB) as usize], "the WRITE wrote nothing");

    // The READ was given up too, but its answer waits for its chunk in
    // flight: it comes once the reader reads (and acknowledges) the data.
    t.wait_for_log_all(&["answered OutOfBuffers", "target.chunk_wait_timeout", "host=reader"], Duration::from_secs(5));
    let mut answers = Vec::new();
    loop {
        match reader.next_event(Duration::from_millis(500)) {
            WireEvent::Response(r, _) => answers.push((r.command_id, r.status)),
            WireEvent::Silence => break,
            other => panic!("the reader got {other:?}"),
        }
    }
    assert_eq!(answers, vec![(read, Status::OutOfBuffers)], "one answer to the READ");
    assert_eq!(m("rdmablk_chunk_wait_timeouts_total"), 2.0);

    // With the pool full again (a READ of the reader that it does not
    // read either), the library's LIST waits and reports it.
    read_of(&mut reader, 4096, 32);
    wait_until("every chunk is held", Duration::from_secs(10), || m("rdmablk_buffer_pool_chunks_in_use") == 3.0);
    let session = Session::connect(t.url.as_str(), options("lister")).expect("connect");
    let e = session.list_volumes().expect_err("LIST cannot get a chunk");
    eprintln!("the library's LIST: {e}");
    assert_eq!(e.status(), Some(Status::OutOfBuffers));
    assert!(e.to_string().contains("target out of buffers") && e.to_string().contains("for a pool chunk"), "{e}");
    session.close();
    assert_eq!(m("rdmablk_chunk_wait_timeouts_total"), 3.0);

    // The held write lands when the gate opens, and succeeds.
    std::fs::remove_file(&gate).unwrap();
    let r = holder.wait_response(held, Duration::from_secs(10)).expect("the holder's answer");
    assert_eq!(r.capsule.status, Status::Success);
    assert!(file_bytes(&file, 0, (128 * KIB) as usize).iter().all(|&b| b == 0xab));
    assert_eq!(file_bytes(&file, MIB, (128 * KIB) as usize), vec![0u8; (128 * KIB) as usize]);
    // The readers' chunks come back once they read their data.
    for c in [&mut still, &mut reader] {
        while !matches!(c.next_event(Duration::from_millis(300)), WireEvent::Silence) {}
    }
    wait_until("every chunk is back", Duration::from_secs(5), || m("rdmablk_buffer_pool_chunks_in_use") == 0.0);
    // The other sessions still work.
    let r = writer.command(io_command(Opcode::Write, wvol.volume_id, 256, 32, writer.descriptor(0, 128 * KIB)), &[]).unwrap();
    assert_eq!(r.capsule.status, Status::Success);
    assert!(file_bytes(&file, MIB, (128 * KIB) as usize).iter().all(|&b| b == 0xcd));

    // Idle, with nothing waiting: no wake-ups.
    drop((holder, writer, reader, still));
    wait_until("the sessions are gone", Duration::from_secs(10), || {
        sample(&scrape(&t.metrics_addr()), "rdmablk_sessions_connected", &[]) == Some(0.0)
    });
    // A closing connection may wake its reactor for a moment after its
    // session ended; then the reactor sleeps: one quiet second within five.
    let t0 = Instant::now();
    loop {
        let waits = m("rdmablk_reactor_idle_waits_total");
        std::thread::sleep(Duration::from_secs(1));
        let woke = m("rdmablk_reactor_idle_waits_total") - waits;
        if woke <= 1.0 {
            break;
        }
        assert!(t0.elapsed() < Duration::from_secs(5), "an idle reactor still woke {woke} times a second after {:?}", t0.elapsed());
    }
    t.assert_no_panic();
}
