//! The configured limits are the real limits: a target serves
//! `max_sessions` sessions whatever its reactor count and its fabric's
//! completion-queue size, and refuses the next one with `LimitReached`.
//!
//! Uses the initiator library, so it runs over `rdma://` too
//! (`RDMABLK_TEST_SCHEME`), where Soft-RoCE's completion queues hold at
//! most 32767 entries: about 60 queue pairs of queue depth 128 each.

use std::time::Duration;

use rdmablk_initiator::{BlockDevice, ConnectOptions, Session};
use rdmablk_system_tests::{
    file_volume, rss_bytes, sample, scrape, sparse_file, target_section, wait_until, TargetProcess,
};

const MIB: u64 = 1 << 20;
/// More than a two-reactor target could serve before (64 queue pairs per
/// reactor), and more than one Soft-RoCE completion queue holds per reactor.
const SESSIONS: usize = 160;

fn small_session(url: &str, i: usize) -> Result<Session, rdmablk_initiator::Error> {
    let options = ConnectOptions {
        host_id: format!("capacity-{i}"),
        queues: 1,
        queue_depth: 4,
        max_io_size: 64 << 10,
        bounce_pool_size: 256 << 10,
        ..ConnectOptions::default()
    };
    Session::connect(url, options)
}

#[test]
fn max_sessions_single_queue_sessions_are_all_served_and_the_next_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let file = sparse_file(dir.path(), "vol.img", 64 * MIB);
    let config = format!(
        "{}reactors = 2\nmax_sessions = {SESSIONS}\nmax_connections_per_address = {}\nmetrics = \"127.0.0.1:0\"\n{}",
        target_section(),
        SESSIONS + 16,
        file_volume("vol", &file, 64 * MIB, false)
    );
    let t = TargetProcess::start(&config);
    let rss_base = rss_bytes(t.pid());
    let mut sessions = Vec::with_capacity(SESSIONS);
    for i in 0..SESSIONS {
        match small_session(&t.url, i) {
            Ok(s) => sessions.push(s),
            Err(e) => panic!("session {i} of max_sessions = {SESSIONS} was refused: {e}"),
        }
    }
    let connected = sample(&scrape(&t.metrics_addr()), "rdmablk_sessions_connected", &[]).unwrap();
    assert_eq!(connected, SESSIONS as f64);
    let rss = rss_bytes(t.pid());
    eprintln!(
        "{SESSIONS} sessions: daemon RSS {} MiB before, {} MiB with them ({} KiB per queue pair)",
        rss_base >> 20,
        rss >> 20,
        rss.saturating_sub(rss_base) / 1024 / SESSIONS as u64
    );

    // At least one reactor serves more queue pairs than one completion
    // queue is sized for, and grew a second one.
    t.wait_for_log("completion queue 2 of", Duration::from_secs(5));

    // One more is refused by the configured limit, not by a table size.
    let Err(e) = small_session(&t.url, SESSIONS) else { panic!("session {} beyond max_sessions was accepted", SESSIONS + 1) };
    assert!(e.to_string().contains("limit"), "{e}");
    t.wait_for_log_all(&["session refused", &format!("target.max_sessions = {SESSIONS}")], Duration::from_secs(5));

    // Every one of them is served: each writes its own block and reads it back.
    let vols: Vec<_> = sessions.iter().map(|s| s.open("vol").expect("open")).collect();
    for (i, vol) in vols.iter().enumerate() {
        vol.write_at(&[i as u8 ^ 0xa5; 4096], i as u64 * 4096).expect("write");
    }
    for (i, vol) in vols.iter().enumerate() {
        let mut back = [0u8; 4096];
        vol.read_at(&mut back, i as u64 * 4096).expect("read");
        assert_eq!(back, [i as u8 ^ 0xa5; 4096], "session {i} read back other bytes");
    }
    drop(vols);
    for s in sessions {
        s.close();
    }
    wait_until("every session ended", Duration::from_secs(20), || {
        sample(&scrape(&t.metrics_addr()), "rdmablk_sessions_connected", &[]) == Some(0.0)
    });
    t.assert_no_panic();
}
