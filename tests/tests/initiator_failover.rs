//! The initiator library's failure handling against the real daemon: a
//! SIGKILL and restart (and a SIGTERM and restart) of the target under a
//! queue-depth-32 write/verify load, a hung target (SIGSTOP) found by the
//! keep-alive, and a target that never comes back.
//!
//! The sessions ask for 2 queue pairs; a daemon without multi-queue
//! sessions refuses the join and they carry on with one (the library's
//! documented fallback), so these tests pass either way. The log says how
//! many were granted.

#[path = "../../initiator/tests/support/workload.rs"]
mod workload;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rdmablk_initiator::{BlockDevice, ConnectOptions, ErrorKind, MemDevice, Session};
use rdmablk_system_tests::RestartableTarget;
use workload::LoadConfig;

const MIB: u64 = 1 << 20;
const VOLUME: u64 = 64 * MIB;

fn options() -> ConnectOptions {
    ConnectOptions {
        host_id: "failover-test".into(),
        queues: 2,
        connect_timeout: Duration::from_secs(5),
        io_timeout: Duration::from_secs(20),
        keepalive_timeout: Duration::from_secs(2),
        reconnect_delay: Duration::from_millis(100),
        ctrl_loss_timeout: Duration::from_secs(60),
        ..ConnectOptions::default()
    }
}

fn wait_until(what: &str, limit: Duration, mut f: impl FnMut() -> bool) -> Duration {
    let t0 = Instant::now();
    while !f() {
        assert!(t0.elapsed() < limit, "{what}: not within {limit:?}");
        std::thread::sleep(Duration::from_millis(10));
    }
    t0.elapsed()
}

/// Runs the QD-32 load, stops the target with `sig` while it runs, restarts
/// it, and checks that the load saw nothing and every byte verifies.
fn restart_under_load(sig: i32) {
    let mut target = RestartableTarget::start("max_io_size = \"256KiB\"\n", VOLUME);
    let session = Session::connect(target.url(), options()).expect("connect");
    eprintln!("session with {} queue pair(s)", session.queue_count());
    let first_session = session.session_id();
    let vol = Arc::new(session.open("vol0").unwrap());
    let model = Arc::new(MemDevice::new(VOLUME, 4096).unwrap());
    let stop = Arc::new(AtomicBool::new(false));
    // Two threads with 16 requests in flight each: queue depth 32 in all.
    let config = LoadConfig {
        threads: 2,
        depth: 16,
        duration: Duration::from_secs(120),
        min_ops: 200,
        max_blocks: 128,
        sync_every: 50,
        seed: workload::seed(),
    };
    let report = std::thread::scope(|scope| {
        let load = scope.spawn(|| workload::run(&vol, &model, &config, &stop));
        std::thread::sleep(Duration::from_millis(1500));
        let before = session.stats();
        target.stop(sig);
        // Down for a while: reconnection attempts are refused meanwhile.
        std::thread::sleep(Duration::from_millis(500));
        target.restart();
        let took = wait_until("reconnected", Duration::from_secs(30), || {
            session.is_connected() && session.stats().reconnects > before.reconnects
        });
        eprintln!("reconnected {took:?} after the restart");
        std::thread::sleep(Duration::from_millis(1500));
        stop.store(true, Ordering::Relaxed);
        load.join().unwrap()
    });
    let stats = session.stats();
    eprintln!("{report:?}\n{stats:?}");
    assert!(report.errors.is_empty(), "{} errors; first: {:?}", report.errors.len(), report.errors.first());
    assert!(report.reads > 100 && report.writes > 100, "{report:?}");
    assert_eq!(stats.reconnects, 1, "{stats:?}");
    assert_ne!(session.session_id(), first_session, "the restarted target has a new session");
    // Everything the load wrote, and nothing else, is on the volume...
    workload::verify_all(&vol, &model).unwrap();
    vol.flush().unwrap();
    // ...and in the backing file.
    assert!(std::fs::read(target.image()).unwrap() == model.contents(), "the backing file differs from the model");
}

#[test]
fn sigkill_and_restart_under_a_qd32_write_verify_load_is_invisible() {
    restart_under_load(libc::SIGKILL);
}

#[test]
fn sigterm_and_restart_under_a_qd32_write_verify_load_is_invisible() {
    restart_under_load(libc::SIGTERM);
}

#[test]
fn a_hung_target_is_found_by_the_keep_alive_and_lost_after_ctrl_loss_timeout() {
    let target = RestartableTarget::start("max_io_size = \"256KiB\"\n", VOLUME);
    let ka = Duration::from_secs(1);
    let ctrl_loss = Duration::from_secs(3);
    let session = Session::connect(
        target.url(),
        ConnectOptions {
            keepalive_timeout: ka,
            ctrl_loss_timeout: ctrl_loss,
            connect_timeout: Duration::from_secs(1),
            ..options()
        },
    )
    .unwrap();
    let vol = session.open("vol0").unwrap();
    vol.write_at(&[5u8; 8192], 0).unwrap();
    std::thread::sleep(Duration::from_millis(500));
    // SIGSTOP: the connections stay up, nothing answers; no I/O in flight.
    target.target().signal(libc::SIGSTOP);
    let noticed = wait_until("the hung target noticed", Duration::from_secs(10), || !session.is_connected());
    eprintln!("hung target noticed after {noticed:?}");
    assert!(noticed <= ka + Duration::from_millis(500), "noticed after {noticed:?} with keepalive_timeout {ka:?}");
    let t0 = Instant::now();
    let e = vol.read_at(&mut [0u8; 4096], 0).unwrap_err();
    eprintln!("{e} after {:?}", t0.elapsed());
    assert_eq!(e.kind(), ErrorKind::TargetLost, "{e}");
    assert!(t0.elapsed() < ctrl_loss + Duration::from_secs(2), "{:?}", t0.elapsed());
    assert!(session.is_lost());
    target.target().signal(libc::SIGCONT);
}

#[test]
fn requests_fail_with_target_lost_when_the_target_does_not_come_back() {
    let mut target = RestartableTarget::start("max_io_size = \"256KiB\"\n", VOLUME);
    let ctrl_loss = Duration::from_secs(2);
    let session = Session::connect(target.url(), ConnectOptions { ctrl_loss_timeout: ctrl_loss, ..options() }).unwrap();
    let vol = Arc::new(session.open("vol0").unwrap());
    vol.write_at(&[1u8; 4096], 0).unwrap();
    target.stop(libc::SIGKILL);
    let t0 = Instant::now();
    let errors: Vec<_> = std::thread::scope(|scope| {
        let threads: Vec<_> = (0..3u64)
            .map(|i| {
                let vol = vol.clone();
                scope.spawn(move || vol.write_at(&[2u8; 65536], i * 65536).unwrap_err())
            })
            .collect();
        threads.into_iter().map(|t| t.join().unwrap()).collect()
    });
    let took = t0.elapsed();
    for e in &errors {
        assert_eq!(e.kind(), ErrorKind::TargetLost, "{e}");
        assert!(e.to_string().contains("target lost"), "{e}");
    }
    assert!(took < ctrl_loss + Duration::from_secs(2), "callers waited {took:?}");
    let t0 = Instant::now();
    assert_eq!(vol.flush().unwrap_err().kind(), ErrorKind::TargetLost);
    assert!(t0.elapsed() < Duration::from_millis(100), "a lost session fails at once");
}
