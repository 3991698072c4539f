//! Multi-thread stress of the initiator library against the real daemon:
//! 4 threads, each with an `IoQueue` keeping 16 random reads and writes in
//! flight (plus occasional synchronous plain-slice requests), every read
//! checked against an in-memory model, then the whole volume and the
//! backing file compared with the model.
//!
//! Duration: `RDMABLK_STRESS_SECS` (default 20). Seed: `RDMABLK_TEST_SEED`.
//! The session asks for 4 queue pairs; a daemon without multi-queue
//! sessions grants one, and the threads then share it.

#[path = "../../initiator/tests/support/workload.rs"]
mod workload;

use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Duration;

use rdmablk_initiator::{BlockDevice, ConnectOptions, MemDevice, Session};
use rdmablk_system_tests::{file_volume, sparse_file, target_section, TargetProcess};
use workload::LoadConfig;

const MIB: u64 = 1 << 20;
const VOLUME: u64 = 128 * MIB;

#[test]
fn four_threads_at_queue_depth_16_random_read_write_verified_against_a_model() {
    let duration = workload::duration_from_env("RDMABLK_STRESS_SECS", Duration::from_secs(20));
    let dir = tempfile::tempdir().unwrap();
    let img = sparse_file(dir.path(), "stress.img", VOLUME);
    // A small max I/O size so that many requests are split.
    let config = format!("{}max_io_size = \"256KiB\"\n{}", target_section(), file_volume("vol0", &img, VOLUME, false));
    let target = TargetProcess::start(&config);
    let session = Session::connect(
        &target.url,
        ConnectOptions { host_id: "stress-test".into(), queues: 4, ..ConnectOptions::default() },
    )
    .expect("connect");
    eprintln!("session with {} queue pair(s), limits {:?}", session.queue_count(), session.limits());
    let vol = Arc::new(session.open("vol0").unwrap());
    let model = Arc::new(MemDevice::new(VOLUME, vol.block_size()).unwrap());
    let load = LoadConfig {
        threads: 4,
        depth: 16,
        duration,
        min_ops: 100,
        max_blocks: 160, // up to 640 KiB: up to 3 pieces
        sync_every: 64,
        seed: workload::seed(),
    };
    let report = workload::run(&vol, &model, &load, &Arc::new(AtomicBool::new(false)));
    let stats = session.stats();
    eprintln!("{report:?}\n{stats:?}");
    assert!(report.errors.is_empty(), "{} errors; first: {:?}", report.errors.len(), report.errors.first());
    assert!(report.reads > 0 && report.writes > 0 && report.sync_ops > 0, "{report:?}");
    assert_eq!(stats.reconnects, 0, "the session reconnected during the stress: {stats:?}");
    workload::verify_all(&vol, &model).unwrap();
    vol.flush().unwrap();
    assert!(std::fs::read(&img).unwrap() == model.contents(), "the backing file differs from the model");
}

/// Needs a daemon that joins queue pairs to sessions: fails until then.
#[test]
fn a_session_gets_all_its_queue_pairs_from_the_daemon() {
    let dir = tempfile::tempdir().unwrap();
    let img = sparse_file(dir.path(), "mq.img", 16 * MIB);
    let target = TargetProcess::start(&format!("{}\n{}", target_section(), file_volume("vol0", &img, 16 * MIB, false)));
    let session =
        Session::connect(&target.url, ConnectOptions { queues: 4, ..ConnectOptions::default() }).expect("connect");
    assert_eq!(session.queue_count(), 4, "the daemon refused to join queue pairs to the session");
    let vol = Arc::new(session.open("vol0").unwrap());
    std::thread::scope(|scope| {
        for t in 0..4u8 {
            let vol = vol.clone();
            scope.spawn(move || {
                let data = vec![t + 1; 1 << 20];
                let off = u64::from(t) * 4 * MIB;
                vol.write_at(&data, off).unwrap();
                let mut back = vec![0u8; data.len()];
                vol.read_at(&mut back, off).unwrap();
                assert!(back == data);
            });
        }
    });
}
