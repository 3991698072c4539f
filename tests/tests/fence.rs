//! The reconnect fence, against the real daemon: no write of a replaced
//! session lands after the reconnected session's newer writes.
//!
//! The window is made wide and certain with the daemon's test-only fault
//! injection (`RDMABLK_FAULT_HOLD_WRITES`, `target-daemon/src/fault.rs`):
//! the old session's disk writes are held "at the disk" while the target is
//! frozen (SIGSTOP), the initiator's keep-alive expires and the session
//! reconnects; they land when the gate opens. Without a fence the new
//! session rewrites the same blocks first and the held writes then replace
//! the newer data: a stale write the caller never sees until it reads.

#[path = "../../initiator/tests/support/workload.rs"]
mod workload;

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rdmablk_common::protocol::VolumeId;
use rdmablk_initiator::{BlockDevice, ConnectOptions, MemDevice, Session};
use rdmablk_system_tests::{file_volume, sample, scrape, sparse_file, target_section, TargetProcess};
use workload::LoadConfig;

const MIB: u64 = 1 << 20;
/// Small, so that the reconnected session rewrites most of what the old
/// session's held writes cover.
const VOLUME: u64 = 2 * MIB;

fn options() -> ConnectOptions {
    ConnectOptions {
        host_id: "fence-test".into(),
        queues: 2,
        connect_timeout: Duration::from_secs(15),
        io_timeout: Duration::from_secs(30),
        keepalive_timeout: Duration::from_secs(1),
        reconnect_delay: Duration::from_millis(100),
        ctrl_loss_timeout: Duration::from_secs(60),
        ..ConnectOptions::default()
    }
}

/// Polls `f` every 10 ms for up to `limit`; whether it became true.
fn within(limit: Duration, mut f: impl FnMut() -> bool) -> bool {
    let t0 = Instant::now();
    while !f() {
        if t0.elapsed() >= limit {
            return false;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    true
}

/// Sends (without waiting for its answer) an inline WRITE of one 4 KiB
/// block filled with `fill` at `block` of volume `volume`.
fn post_block_write(conn: &mut rdmablk_system_tests::WireConn, volume: VolumeId, block: u64, fill: u8) {
    use rdmablk_common::protocol::{BlockCount, CommandCapsule, CommandId, Lba, Opcode, FLAG_INLINE_DATA};
    let mut c = CommandCapsule::new(Opcode::Write, CommandId(0));
    c.volume_id = volume;
    c.start_block = Lba(block);
    c.block_count = BlockCount(1);
    c.flags = FLAG_INLINE_DATA;
    conn.post(c, &[fill; 4096]);
}

/// One run; `fence_timeout` (seconds) shorter than the hold makes the
/// first CONNECTs time out at the fence, and the initiator retry.
fn stale_write_run(run: usize, fence_timeout: Option<u64>) {
    let dir = tempfile::tempdir().unwrap();
    let image = sparse_file(dir.path(), "vol0.img", VOLUME);
    let gate = dir.path().join("hold-writes");
    let fence = fence_timeout.map(|s| format!("fence_timeout = {s}\n")).unwrap_or_default();
    let config = format!(
        "{}max_io_size = \"128KiB\"\nmetrics = \"127.0.0.1:0\"\n{fence}{}",
        target_section(),
        file_volume("vol0", &image, VOLUME, false)
    );
    let target =
        TargetProcess::start_with_env(&config, &[("RDMABLK_FAULT_HOLD_WRITES", gate.to_str().unwrap())], &[]);
    let session = Session::connect(target.url.clone(), options()).expect("connect");
    let old_session = session.session_id();
    let vol = Arc::new(session.open("vol0").unwrap());
    let model = Arc::new(MemDevice::new(VOLUME, 4096).unwrap());
    let stop = Arc::new(AtomicBool::new(false));
    // Queue depth 32 in all, requests of 1 to 16 blocks.
    let config = LoadConfig {
        threads: 2,
        depth: 16,
        duration: Duration::from_secs(300),
        min_ops: 100,
        max_blocks: 16,
        sync_every: 0,
        seed: workload::seed().wrapping_add(run as u64),
    };
    let (report, reconnected_while_held) = std::thread::scope(|scope| {
        let load = scope.spawn(|| workload::run(&vol, &model, &config, &stop));
        std::thread::sleep(Duration::from_millis(800));
        let before = session.stats();
        // From now on the old session's writes stay at the "disk".
        std::fs::write(&gate, format!("{:#x}", old_session.0)).unwrap();
        std::thread::sleep(Duration::from_millis(300));
        target.signal(libc::SIGSTOP);
        assert!(within(Duration::from_secs(10), || !session.is_connected()), "the keep-alive did not notice the frozen target");
        // Let a reconnection attempt reach the frozen target's listener.
        std::thread::sleep(Duration::from_millis(300));
        target.signal(libc::SIGCONT);
        let reconnected = || session.is_connected() && session.stats().reconnects > before.reconnects;
        // Without a fence the new session starts at once and rewrites the
        // blocks the held writes cover...
        let reconnected_while_held = within(Duration::from_secs(3), reconnected);
        if reconnected_while_held {
            std::thread::sleep(Duration::from_millis(1500));
        }
        // ...and then the held writes land.
        std::fs::remove_file(&gate).unwrap();
        assert!(within(Duration::from_secs(30), reconnected), "no reconnection after the gate opened");
        std::thread::sleep(Duration::from_millis(1000));
        stop.store(true, Ordering::Relaxed);
        (load.join().unwrap(), reconnected_while_held)
    });
    let stats = session.stats();
    eprintln!("run {run}: {report:?}\n{stats:?}\nreconnected while the old writes were held: {reconnected_while_held}");
    assert!(report.errors.is_empty(), "{} errors; first: {:?}", report.errors.len(), report.errors.first());
    // The load ran (under TCG in the VM stage it manages about a hundred writes).
    assert!(report.writes > 50, "{report:?}");
    assert_ne!(session.session_id(), old_session, "the session reconnected");
    // Every block reads back as the last write acknowledged to the caller...
    if let Err(e) = workload::verify_all(&vol, &model) {
        panic!("stale data after the reconnect: {e}");
    }
    vol.flush().unwrap();
    // ...and is in the backing file.
    assert_file_matches(&image, &model);
    assert!(
        !reconnected_while_held,
        "the reconnected session started while a write of the session it replaced was still held at the disk"
    );
    let fence = target.wait_for_log(&format!("fence: session {:#x} of host fence-test retired in", old_session.0), Duration::from_secs(5));
    eprintln!("{fence}");
    assert!(fence.contains("commands dropped before reaching the disk"), "{fence}");
    target.wait_for_log(&format!("(new session, replaces {:#x})", old_session.0), Duration::from_secs(5));
    let samples = scrape(&target.metrics_addr());
    assert_eq!(sample(&samples, "rdmablk_fences_total", &[]), Some(1.0));
    let timeouts = sample(&samples, "rdmablk_fence_timeouts_total", &[]).unwrap();
    if fence_timeout.is_some() {
        assert!(timeouts >= 1.0, "the hold outlasted target.fence_timeout, yet no CONNECT timed out");
        target.wait_for_log("answered FenceTimeout", Duration::from_secs(1));
    } else {
        assert_eq!(timeouts, 0.0);
    }
    target.assert_no_panic();
}

fn assert_file_matches(image: &Path, model: &MemDevice) {
    let file = std::fs::read(image).unwrap();
    let want = model.contents();
    if file != want {
        let first = file.iter().zip(&want).position(|(a, b)| a != b).unwrap_or(0);
        panic!("the backing file differs from the model (first difference at byte {first})");
    }
}

#[test]
fn no_write_of_a_replaced_session_lands_after_the_reconnected_sessions_writes() {
    stale_write_run(0, None);
}

/// The old session's writes are held for about 3 s, longer than a 1 s
/// `fence_timeout`: the target answers `FenceTimeout`, the initiator keeps
/// retrying under `ctrl_loss_timeout`, and still nothing stale lands.
#[test]
fn a_fence_that_times_out_is_retried_and_still_holds() {
    stale_write_run(0, Some(1));
}

/// The same, `RDMABLK_FENCE_RUNS` times in a row (the issue asks for 20 green
/// runs); ignored by default because each run takes several seconds.
#[test]
#[ignore]
fn stale_write_test_repeated() {
    let runs = std::env::var("RDMABLK_FENCE_RUNS").ok().and_then(|v| v.parse().ok()).unwrap_or(20);
    for run in 0..runs {
        stale_write_run(run, None);
    }
}

/// A queue pair that dies executes none of the commands it had queued: with
/// two pool chunks, of which one session gets one (its fair share while it
/// is the only one: half), and the write holding it held at the "disk", the
/// next fifteen inline WRITEs wait for a chunk; the connection then drops.
/// Once the gate opens the held write lands (it was at the disk) and the
/// fifteen never do. Raw frames, so tcp:// only.
#[test]
fn a_dead_queue_pair_executes_none_of_its_queued_commands() {
    if rdmablk_system_tests::scheme() != "tcp" {
        eprintln!("skipped: raw tcp frames");
        return;
    }
    const BS: usize = 4096;
    let dir = tempfile::tempdir().unwrap();
    let image = sparse_file(dir.path(), "vol0.img", VOLUME);
    let gate = dir.path().join("hold-writes");
    let config = format!(
        "{}reactors = 1\nbuffer_pool = \"256KiB\"\nsession_pool_share = \"100%\"\n{}",
        target_section(),
        file_volume("vol0", &image, VOLUME, false)
    );
    let target =
        TargetProcess::start_with_env(&config, &[("RDMABLK_FAULT_HOLD_WRITES", gate.to_str().unwrap())], &[]);
    let mut conn = rdmablk_system_tests::WireConn::hello(&target.url);
    let reply = conn.connect("dead-qp", 32);
    let vol = conn.open_volume("vol0");
    std::fs::write(&gate, format!("{:#x}", reply.session_id.0)).unwrap();
    for block in 0..16u64 {
        post_block_write(&mut conn, vol.volume_id, block, 0xa0 + block as u8);
    }
    // Let the target take all sixteen in (one at the disk, fifteen waiting).
    std::thread::sleep(Duration::from_millis(500));
    drop(conn);
    target.wait_for_log("session disconnected: host=dead-qp", Duration::from_secs(10));
    std::thread::sleep(Duration::from_millis(200));
    std::fs::remove_file(&gate).unwrap();
    let ended = target.wait_for_log("session ended: host=dead-qp", Duration::from_secs(10));
    assert!(ended.contains("15 commands dropped before reaching the disk"), "{ended}");
    let file = std::fs::read(&image).unwrap();
    for block in 0..16usize {
        let got = &file[block * BS..(block + 1) * BS];
        let want = if block < 1 { 0xa0 + block as u8 } else { 0 };
        assert!(got.iter().all(|&b| b == want), "block {block}: expected {want:#x}, found {:#x}", got[0]);
    }
    target.assert_no_panic();
}

/// A process that takes over the work of a dead one (a restarted `rdmablk
/// attach`) names the dead one's session: the target answers its CONNECT
/// only when the writes the dead session had at the disk have landed, so
/// none of them can land after the new session's.
#[test]
fn a_session_that_replaces_a_dead_processes_session_waits_for_its_disk_writes() {
    if rdmablk_system_tests::scheme() != "tcp" {
        eprintln!("skipped: raw tcp frames");
        return;
    }
    const BS: usize = 4096;
    const HOLD: Duration = Duration::from_millis(1500);
    let dir = tempfile::tempdir().unwrap();
    let image = sparse_file(dir.path(), "vol0.img", VOLUME);
    let gate = dir.path().join("hold-writes");
    let config = format!("{}reactors = 1\n{}", target_section(), file_volume("vol0", &image, VOLUME, false));
    let target =
        TargetProcess::start_with_env(&config, &[("RDMABLK_FAULT_HOLD_WRITES", gate.to_str().unwrap())], &[]);
    // The "dead process": its write of block 0 is held at the disk when it dies.
    let mut conn = rdmablk_system_tests::WireConn::hello(&target.url);
    let reply = conn.connect("takeover", 8);
    let vol = conn.open_volume("vol0");
    std::fs::write(&gate, format!("{:#x}", reply.session_id.0)).unwrap();
    post_block_write(&mut conn, vol.volume_id, 0, 0xa0);
    std::thread::sleep(Duration::from_millis(300));
    drop(conn);
    target.wait_for_log("session disconnected: host=takeover", Duration::from_secs(10));
    let released = Instant::now() + HOLD;
    let opener = {
        let gate = gate.clone();
        std::thread::spawn(move || {
            std::thread::sleep(released.saturating_duration_since(Instant::now()));
            std::fs::remove_file(&gate).unwrap();
        })
    };
    let opts = ConnectOptions { host_id: "takeover".into(), queues: 1, ..ConnectOptions::default() };
    let session = Session::connect_replacing(target.url.as_str(), opts, reply.session_id).unwrap();
    let answered = Instant::now();
    assert!(answered >= released, "the CONNECT was answered {:?} before the old write landed", released - answered);
    opener.join().unwrap();
    let v = session.open("vol0").unwrap();
    v.write_at(&[0xbb; BS], 0).unwrap();
    v.flush().unwrap();
    let file = std::fs::read(&image).unwrap();
    assert!(file[..BS].iter().all(|&b| b == 0xbb), "block 0 holds {:#x}: the dead session's write landed last", file[0]);
    let line = target.wait_for_log("fence: session", Duration::from_secs(5));
    assert!(line.contains("retired"), "{line}");
    target.assert_no_panic();
}
