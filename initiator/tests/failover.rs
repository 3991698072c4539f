//! Failure handling against the fake target: keep-alive, io_timeout,
//! reconnection with re-issue (volume ids remapped), ctrl_loss_timeout,
//! closing while reconnecting.

mod support;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rdmablk_common::protocol::Opcode;
use rdmablk_initiator::{BlockDevice, ConnectOptions, ErrorKind, IoRequest, MemDevice, Session};
use support::workload::{self, LoadConfig};
use support::{pattern, FakeConfig, FakeTarget, FakeVolume};

const MIB: usize = 1 << 20;

fn options() -> ConnectOptions {
    ConnectOptions {
        host_id: "failover-host".into(),
        queues: 2,
        connect_timeout: Duration::from_secs(2),
        io_timeout: Duration::from_secs(10),
        keepalive_timeout: Duration::from_secs(2),
        reconnect_delay: Duration::from_millis(50),
        ctrl_loss_timeout: Duration::from_secs(20),
        ..ConnectOptions::default()
    }
}

fn wait_until(what: &str, limit: Duration, mut f: impl FnMut() -> bool) -> Duration {
    let t0 = Instant::now();
    while !f() {
        assert!(t0.elapsed() < limit, "{what}: not within {limit:?}");
        std::thread::sleep(Duration::from_millis(5));
    }
    t0.elapsed()
}

#[test]
fn restarts_under_a_queue_depth_32_write_verify_load_are_invisible() {
    let size = 16 * MIB;
    let target = FakeTarget::start(
        FakeConfig { queue_depth: 64, max_io: 128 << 10, ..FakeConfig::default() },
        vec![FakeVolume::new("vol0", size, 4096)],
    );
    let s = Session::connect(&target.url, options()).unwrap();
    let first_session = s.session_id();
    let vol = Arc::new(s.open("vol0").unwrap());
    let old_id = vol.id();
    let model = Arc::new(MemDevice::new(size as u64, 4096).unwrap());
    let stop = Arc::new(AtomicBool::new(false));
    let config = LoadConfig {
        threads: 2,
        depth: 16,
        duration: Duration::from_secs(60),
        min_ops: 100,
        max_blocks: 64,
        sync_every: 25,
        seed: workload::seed(),
    };
    let report = std::thread::scope(|scope| {
        let load = scope.spawn(|| workload::run(&vol, &model, &config, &stop));
        std::thread::sleep(Duration::from_millis(400));
        // A restart with the target away for a while: attempts are refused.
        target.set_down(true);
        target.restart();
        std::thread::sleep(Duration::from_millis(300));
        target.set_down(false);
        wait_until("reconnected", Duration::from_secs(10), || s.is_connected() && s.stats().reconnects >= 1);
        std::thread::sleep(Duration::from_millis(300));
        // And one that comes back at once.
        target.restart();
        std::thread::sleep(Duration::from_millis(500));
        stop.store(true, Ordering::Relaxed);
        load.join().unwrap()
    });
    eprintln!("{report:?} {:?}", s.stats());
    assert!(report.errors.is_empty(), "{} errors, first: {:?}", report.errors.len(), report.errors.first());
    assert!(s.stats().reconnects >= 2, "{:?}", s.stats());
    assert!(s.stats().retries > 0, "nothing was re-issued: {:?}", s.stats());
    assert_ne!(s.session_id(), first_session, "a restarted target gives a new session");
    assert_ne!(vol.id(), old_id, "the fake changes volume ids at restart");
    assert_eq!(vol.id(), target.volume_id(0));
    workload::verify_all(&vol, &model).unwrap();
    assert!(target.volume_data(0) == model.contents());
}

#[test]
fn a_synchronous_request_in_flight_across_a_restart_completes() {
    let target = FakeTarget::start(
        FakeConfig { max_io: 64 << 10, ..FakeConfig::default() },
        vec![FakeVolume::new("vol0", 8 * MIB, 4096)],
    );
    let s = Session::connect(&target.url, ConnectOptions { queues: 1, ..options() }).unwrap();
    let vol = s.open("vol0").unwrap();
    let data = pattern(4 * MIB, 9);
    vol.write_at(&data, 0).unwrap();
    let mut buf = s.alloc_buffer(4 * MIB).unwrap();
    target.set_hang(true);
    std::thread::scope(|scope| {
        let read = scope.spawn(|| vol.read_into(&mut buf, 0, 4 * MIB, 0));
        std::thread::sleep(Duration::from_millis(200));
        assert!(!read.is_finished(), "the read should be stuck on the hung target");
        target.restart();
        target.set_hang(false);
        read.join().unwrap().unwrap();
    });
    assert!(buf.as_slice() == &data[..], "re-issued read returned other bytes");
    assert!(s.stats().retries >= 1 && s.stats().reconnects == 1, "{:?}", s.stats());
}

#[test]
fn keep_alive_finds_a_hung_target_with_no_io_in_flight() {
    let target = FakeTarget::start(FakeConfig::default(), vec![FakeVolume::new("vol0", MIB, 4096)]);
    let ka = Duration::from_millis(400);
    let ctrl_loss = Duration::from_millis(1500);
    let s = Session::connect(
        &target.url,
        ConnectOptions { keepalive_timeout: ka, ctrl_loss_timeout: ctrl_loss, ..options() },
    )
    .unwrap();
    let vol = s.open("vol0").unwrap();
    vol.read_at(&mut [0u8; 4096], 0).unwrap();
    std::thread::sleep(Duration::from_millis(300));
    // Like SIGSTOP: the connections stay up but nothing is processed, and
    // new connections are not served.
    target.set_hang(true);
    target.set_down(true);
    let noticed = wait_until("the hang noticed", Duration::from_secs(5), || !s.is_connected());
    eprintln!("hung target noticed after {noticed:?}");
    assert!(noticed <= ka + Duration::from_millis(300), "noticed only after {noticed:?} (keepalive_timeout {ka:?})");
    // A request now waits for the reconnection, then fails: target lost.
    let t0 = Instant::now();
    let e = vol.read_at(&mut [0u8; 4096], 0).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::TargetLost, "{e}");
    assert!(e.to_string().contains("target lost") && e.to_string().contains("1.500s"), "{e}");
    assert!(t0.elapsed() < ctrl_loss + Duration::from_secs(1), "{:?}", t0.elapsed());
    assert!(s.is_lost());
    // Final: later requests fail at once.
    let t0 = Instant::now();
    assert_eq!(vol.write_at(&[1u8; 4096], 0).unwrap_err().kind(), ErrorKind::TargetLost);
    assert!(t0.elapsed() < Duration::from_millis(100));
    target.set_hang(false);
}

#[test]
fn keep_alives_flow_on_idle_queues_and_keep_the_session() {
    let target = FakeTarget::start(FakeConfig::default(), vec![FakeVolume::new("vol0", MIB, 4096)]);
    let s =
        Session::connect(&target.url, ConnectOptions { keepalive_timeout: Duration::from_millis(200), ..options() })
            .unwrap();
    std::thread::sleep(Duration::from_millis(1200));
    let kas = target.keep_alives();
    assert!(kas >= 2 * 4, "{kas} keep-alives in 1.2 s on 2 idle queues");
    assert!(s.is_connected());
    assert_eq!(s.stats().reconnects, 0);
    // Counted when sent; at most one per queue may still be on its way.
    let sent = s.stats().keep_alives as usize;
    assert!(sent >= kas && sent <= kas + 2, "sent {sent}, the target saw {kas}");
    // Nothing but the CONNECTs and the keep-alives was sent.
    assert!(target.commands().iter().all(|c| c.opcode == Opcode::Connect));
}

#[test]
fn an_io_timeout_fails_only_the_stuck_command_and_io_carries_on() {
    let target = FakeTarget::start(
        FakeConfig { stall: Some(Opcode::Flush), ..FakeConfig::default() },
        vec![FakeVolume::new("vol0", 8 * MIB, 4096)],
    );
    let s =
        Session::connect(&target.url, ConnectOptions { io_timeout: Duration::from_millis(500), ..options() }).unwrap();
    let vol = Arc::new(s.open("vol0").unwrap());
    let stop = AtomicBool::new(false);
    std::thread::scope(|scope| {
        let io = scope.spawn(|| {
            let mut rounds = 0u64;
            while !stop.load(Ordering::Relaxed) || rounds < 5 {
                let data = pattern(256 << 10, rounds as u8);
                let off = (rounds % 16) * (256 << 10);
                vol.write_at(&data, off).unwrap();
                let mut back = vec![0u8; data.len()];
                vol.read_at(&mut back, off).unwrap();
                assert_eq!(back, data);
                rounds += 1;
            }
            rounds
        });
        let t0 = Instant::now();
        let e = vol.flush().unwrap_err();
        let took = t0.elapsed();
        assert_eq!(e.kind(), ErrorKind::Timeout, "{e}");
        assert!(e.to_string().contains("flush") && e.to_string().contains("500ms"), "{e}");
        assert!(took >= Duration::from_millis(500) && took < Duration::from_secs(3), "{took:?}");
        std::thread::sleep(Duration::from_millis(300));
        stop.store(true, Ordering::Relaxed);
        let rounds = io.join().unwrap();
        eprintln!("{rounds} rounds of I/O alongside the stuck flush");
    });
    wait_until("reconnected", Duration::from_secs(5), || s.is_connected());
    assert!(s.stats().reconnects >= 1 && s.stats().timeouts >= 1, "{:?}", s.stats());
    vol.read_at(&mut [0u8; 4096], 0).unwrap();
}

#[test]
fn requests_fail_with_target_lost_after_ctrl_loss_timeout_and_nothing_hangs() {
    let target = FakeTarget::start(FakeConfig::default(), vec![FakeVolume::new("vol0", 4 * MIB, 4096)]);
    let ctrl_loss = Duration::from_secs(1);
    let s = Session::connect(&target.url, ConnectOptions { ctrl_loss_timeout: ctrl_loss, ..options() }).unwrap();
    let vol = s.open("vol0").unwrap();
    let mut q = s.io_queue();
    target.set_down(true);
    target.set_hang(true);
    for i in 0..8u64 {
        q.submit(IoRequest::read(&vol, i * 65536, s.alloc_buffer(65536).unwrap()), i);
    }
    let t0 = Instant::now();
    target.drop_connections();
    let e = vol.read_at(&mut vec![0u8; 65536], 0).unwrap_err();
    let took = t0.elapsed();
    assert_eq!(e.kind(), ErrorKind::TargetLost, "{e}");
    assert!(took >= ctrl_loss - Duration::from_millis(100) && took < ctrl_loss + Duration::from_secs(2), "{took:?}");
    let mut done = Vec::new();
    q.wait(&mut done, 8, Some(Duration::from_secs(5)));
    assert_eq!(done.len(), 8, "queued requests end too");
    for c in &done {
        assert_eq!(c.result.as_ref().unwrap_err().kind(), ErrorKind::TargetLost);
        assert!(c.buffer.is_some());
    }
    q.submit(IoRequest::flush(&vol), 99);
    q.wait(&mut done, 1, Some(Duration::from_secs(1)));
    assert_eq!(done.last().unwrap().result.as_ref().unwrap_err().kind(), ErrorKind::TargetLost);
    assert!(s.is_lost());
    target.set_hang(false);
}

#[test]
fn a_volume_gone_after_a_restart_fails_its_requests_and_others_continue() {
    let target = FakeTarget::start(
        FakeConfig::default(),
        vec![FakeVolume::new("a", MIB, 4096), FakeVolume::new("b", MIB, 4096)],
    );
    let s = Session::connect(&target.url, options()).unwrap();
    let a = s.open("a").unwrap();
    let b = s.open("b").unwrap();
    a.write_at(&pattern(8192, 1), 0).unwrap();
    target.volumes.lock().unwrap()[1].name = "b-renamed".into();
    target.restart();
    let e = b.read_at(&mut [0u8; 4096], 0).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::UnknownVolume, "{e}");
    assert!(e.to_string().contains("\"b\""), "{e}");
    let mut back = vec![0u8; 8192];
    a.read_at(&mut back, 0).unwrap();
    assert_eq!(back, pattern(8192, 1));
}

#[test]
fn closing_during_reconnection_ends_waiting_requests_at_once() {
    let target = FakeTarget::start(FakeConfig::default(), vec![FakeVolume::new("vol0", MIB, 4096)]);
    let s = Session::connect(&target.url, options()).unwrap();
    let vol = s.open("vol0").unwrap();
    target.set_down(true);
    target.drop_connections();
    std::thread::scope(|scope| {
        let read = scope.spawn(|| {
            let t0 = Instant::now();
            (vol.read_at(&mut [0u8; 4096], 0), t0.elapsed())
        });
        std::thread::sleep(Duration::from_millis(300));
        assert!(!read.is_finished(), "the read waits while the session reconnects");
        s.close();
        let (r, took) = read.join().unwrap();
        let e = r.unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Disconnected, "{e}");
        assert!(e.to_string().contains("closed by this initiator"), "{e}");
        assert!(took < Duration::from_secs(2), "{took:?}");
    });
    assert!(s.is_lost() && !s.is_connected());
}
