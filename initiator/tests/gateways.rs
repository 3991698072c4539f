//! A volume served by several gateways, against fake targets that share
//! their volumes (as gateways of shared storage do): connecting to the
//! first that answers, failing over in list order (the next gateway after
//! the lost one), a fresh CONNECT at each gateway (the fence names only a
//! session of that same gateway), `NotOwner` answers retried on another
//! gateway, and the errors when no gateway will do.

mod support;

use std::time::{Duration, Instant};

use rdmablk_common::protocol::{Opcode, SessionId, Status};
use rdmablk_initiator::{BlockDevice, ConnectOptions, ErrorKind, IoRequest, Session, Targets};
use support::{pattern, FakeConfig, FakeTarget, FakeVolume};

const MIB: usize = 1 << 20;

fn options() -> ConnectOptions {
    ConnectOptions {
        host_id: "gateways-host".into(),
        queues: 2,
        connect_timeout: Duration::from_secs(1),
        io_timeout: Duration::from_secs(10),
        keepalive_timeout: Duration::from_secs(1),
        reconnect_delay: Duration::from_millis(50),
        ctrl_loss_timeout: Duration::from_secs(20),
        ..ConnectOptions::default()
    }
}

fn config(name: &str) -> FakeConfig {
    FakeConfig { name: name.into(), ..FakeConfig::default() }
}

/// `n` fakes serving the same volume, `vol0` of 4 MiB.
fn gateways(n: usize) -> Vec<FakeTarget> {
    let first = FakeTarget::start(config("gw1"), vec![FakeVolume::new("vol0", 4 * MIB, 4096)]);
    let mut all = vec![];
    for i in 1..n {
        all.push(FakeTarget::start_sharing(config(&format!("gw{}", i + 1)), first.volumes.clone()));
    }
    all.insert(0, first);
    all
}

fn list(fakes: &[&FakeTarget]) -> String {
    fakes.iter().map(|f| f.url.as_str()).collect::<Vec<_>>().join(",")
}

fn wait_until(what: &str, limit: Duration, mut f: impl FnMut() -> bool) -> Duration {
    let t0 = Instant::now();
    while !f() {
        assert!(t0.elapsed() < limit, "{what}: not within {limit:?}");
        std::thread::sleep(Duration::from_millis(5));
    }
    t0.elapsed()
}

/// Commands of `op` a fake received.
fn count(f: &FakeTarget, op: Opcode) -> usize {
    f.commands().iter().filter(|c| c.opcode == op).count()
}

#[test]
fn connects_to_the_first_gateway_that_answers_in_list_order() {
    let g = gateways(3);
    let s = Session::connect(list(&[&g[0], &g[1], &g[2]]), options()).unwrap();
    assert_eq!(s.url().to_string(), g[0].url);
    assert_eq!(s.target_name(), "gw1");
    assert_eq!(s.targets().len(), 3);
    assert_eq!(g[1].created_sessions().len() + g[2].created_sessions().len(), 0, "the others are not touched");
    drop(s);

    g[0].set_down(true);
    let s = Session::connect(list(&[&g[0], &g[1], &g[2]]), options()).unwrap();
    assert_eq!(s.url().to_string(), g[1].url, "the first one refuses: the second");
    assert_eq!(s.target_name(), "gw2");
    let vol = s.open("vol0").unwrap();
    vol.write_at(&pattern(8192, 3), 0).unwrap();
    assert_eq!(&g[0].volume_data(0)[..8192], &pattern(8192, 3)[..], "the gateways share the volume");
    assert!(g[2].created_sessions().is_empty());
}

#[test]
fn no_gateway_answering_names_each_and_what_went_wrong() {
    let g = gateways(2);
    g[0].set_down(true);
    g[1].set_down(true);
    let e = Session::connect(list(&[&g[0], &g[1]]), options()).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::NoGateway, "{e}");
    let m = e.one_line();
    assert!(m.starts_with("none of the 2 gateways could be used: "), "{m}");
    for f in &g {
        assert!(m.contains(&format!("{}: connecting to {}", f.url, f.url)), "{m}");
    }
    // A single URL fails as it always did: its own error, not a list.
    let e = Session::connect(g[0].url.as_str(), options()).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Fabric, "{e}");
}

#[test]
fn bad_lists_are_refused_before_connecting() {
    for (bad, want) in [
        ("tcp://127.0.0.1:1,,tcp://127.0.0.1:2", "gateway 2 of 3 is empty"),
        ("tcp://127.0.0.1:1,udp://x", "gateway 2 of 2: \"udp://x\": unknown scheme"),
        ("tcp://127.0.0.1:1,rdma://127.0.0.1:2", "is not of the scheme of gateway 1"),
        ("tcp://127.0.0.1:1,tcp://127.0.0.1:1", "is gateway 1 again"),
    ] {
        let e = Session::connect(bad, options()).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Fabric, "{bad}: {e}");
        assert!(e.to_string().contains(want), "{bad}: {e}");
    }
}

#[test]
fn a_lost_gateway_fails_over_to_the_next_one_and_requests_carry_on() {
    let g = gateways(3);
    let s = Session::connect(list(&[&g[0], &g[1], &g[2]]), options()).unwrap();
    let vol = s.open("vol0").unwrap();
    vol.write_at(&pattern(65536, 1), 0).unwrap();

    // The first gateway goes away: the next one, not the third.
    g[0].set_down(true);
    g[0].drop_connections();
    vol.write_at(&pattern(65536, 2), 65536).unwrap();
    assert_eq!(s.url().to_string(), g[1].url);
    assert_eq!(s.target_name(), "gw2");
    assert!(g[2].created_sessions().is_empty(), "the third gateway was not tried");
    let mut back = vec![0u8; 131072];
    vol.read_at(&mut back, 0).unwrap();
    assert_eq!(&back[..65536], &pattern(65536, 1)[..]);
    assert_eq!(&back[65536..], &pattern(65536, 2)[..]);

    // The second goes away while the first is back: the one after the
    // second (the third), not the first again.
    g[0].set_down(false);
    g[1].set_down(true);
    g[1].drop_connections();
    vol.write_at(&pattern(4096, 3), 0).unwrap();
    assert_eq!(s.url().to_string(), g[2].url);
    assert_eq!(g[0].created_sessions().len(), 1, "the first gateway was not tried again");
    vol.read_at(&mut back[..4096], 0).unwrap();
    assert_eq!(&back[..4096], &pattern(4096, 3)[..]);
    assert_eq!(s.stats().reconnects, 2, "{:?}", s.stats());
}

#[test]
fn a_hung_gateway_is_found_by_the_keep_alive_and_left() {
    let g = gateways(2);
    let s = Session::connect(list(&[&g[0], &g[1]]), options()).unwrap();
    let vol = s.open("vol0").unwrap();
    vol.write_at(&pattern(4096, 7), 0).unwrap();
    g[0].set_hang(true);
    let t0 = Instant::now();
    wait_until("failed over to the second gateway", Duration::from_secs(5), || {
        s.is_connected() && s.url().to_string() == g[1].url
    });
    let mut back = vec![0u8; 4096];
    vol.read_at(&mut back, 0).unwrap();
    assert_eq!(back, pattern(4096, 7));
    eprintln!("failed over in {:?}", t0.elapsed());
    g[0].set_hang(false);
}

#[test]
fn the_fence_names_a_session_only_at_the_gateway_that_had_it() {
    let g = gateways(2);
    let s = Session::connect(list(&[&g[0], &g[1]]), options()).unwrap();
    let vol = s.open("vol0").unwrap();
    let at_a = s.session_id();
    assert_eq!(g[0].created_sessions(), [at_a]);

    // To B: a fresh CONNECT, naming no session (A's id means nothing to B).
    g[0].set_down(true);
    g[0].drop_connections();
    vol.write_at(&pattern(4096, 1), 0).unwrap();
    assert_eq!(s.url().to_string(), g[1].url);
    assert_eq!(g[1].replaced_sessions(), [SessionId(0)]);
    let at_b = s.session_id();
    assert_ne!(at_b, at_a);

    // Back to A: the session it had there is the one to retire.
    g[0].set_down(false);
    g[1].set_down(true);
    g[1].drop_connections();
    vol.write_at(&pattern(4096, 2), 0).unwrap();
    assert_eq!(s.url().to_string(), g[0].url);
    assert_eq!(g[0].replaced_sessions(), [SessionId(0), at_a]);

    // Connecting replacing a session at B names it only there.
    drop(vol);
    s.close();
    let b_url = s.targets().urls()[1].clone();
    let s2 = Session::connect_replacing_at(list(&[&g[0], &g[1]]), options(), SessionId(0x77), &b_url).unwrap();
    assert_eq!(s2.url().to_string(), g[0].url);
    assert_eq!(g[0].replaced_sessions().last(), Some(&SessionId(0)), "B's session is not named at A");
    let elsewhere = rdmablk_common::fabric::FabricUrl::parse("tcp://127.0.0.1:1").unwrap();
    let e = Session::connect_replacing_at(list(&[&g[0], &g[1]]), options(), SessionId(1), &elsewhere).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
}

#[test]
fn a_not_owner_answer_fails_over_and_the_command_is_retried_there() {
    let g = gateways(2);
    let s = Session::connect(list(&[&g[0], &g[1]]), options()).unwrap();
    let vol = s.open("vol0").unwrap();
    vol.write_at(&pattern(8192, 1), 0).unwrap();

    // A loses the volume to B: the write is answered NotOwner by A, and
    // done by B; the caller sees nothing.
    g[0].set_not_owner(true);
    vol.write_at(&pattern(8192, 2), 8192).unwrap();
    assert_eq!(s.url().to_string(), g[1].url);
    assert_eq!(count(&g[0], Opcode::Write), 2, "the second write reached A, which refused it");
    assert_eq!(count(&g[1], Opcode::Write), 1, "and was retried on B");
    assert_eq!(count(&g[1], Opcode::OpenVolume), 1, "B re-opened the volume by name");
    let mut back = vec![0u8; 16384];
    vol.read_at(&mut back, 0).unwrap();
    assert_eq!(&back[..8192], &pattern(8192, 1)[..]);
    assert_eq!(&back[8192..], &pattern(8192, 2)[..]);
    assert_eq!(s.stats().reconnects, 1);

    // The same through the asynchronous queue, and a flush: B loses it back to A.
    g[0].set_not_owner(false);
    g[1].set_not_owner(true);
    let mut q = s.io_queue();
    let mut buf = s.alloc_buffer(65536).unwrap();
    buf.as_mut_slice().copy_from_slice(&pattern(65536, 9));
    q.submit(IoRequest::write(&vol, 65536, buf), 1);
    q.submit(IoRequest::flush(&vol), 2);
    let mut done = Vec::new();
    q.wait(&mut done, 2, Some(Duration::from_secs(10)));
    assert_eq!(done.len(), 2);
    for c in &done {
        assert!(c.result.is_ok(), "tag {}: {:?}", c.tag, c.result);
    }
    assert_eq!(s.url().to_string(), g[0].url);
    assert_eq!(&g[0].volume_data(0)[65536..131072], &pattern(65536, 9)[..]);
    vol.flush().unwrap();
    // Opening another volume handle where OPEN itself says NotOwner.
    g[0].set_not_owner(true);
    g[1].set_not_owner(false);
    let again = s.open("vol0").unwrap();
    assert_eq!(s.url().to_string(), g[1].url);
    again.read_at(&mut back[..4096], 0).unwrap();
    assert_eq!(&back[..4096], &pattern(4096, 1)[..]);
}

#[test]
fn every_gateway_answering_not_owner_fails_after_ctrl_loss_naming_each() {
    let g = gateways(2);
    let ctrl_loss = Duration::from_secs(2);
    let s = Session::connect(list(&[&g[0], &g[1]]), ConnectOptions { ctrl_loss_timeout: ctrl_loss, ..options() }).unwrap();
    let vol = s.open("vol0").unwrap();
    g[0].set_not_owner(true);
    g[1].set_not_owner(true);
    let t0 = Instant::now();
    let e = vol.write_at(&pattern(4096, 1), 0).unwrap_err();
    let took = t0.elapsed();
    assert_eq!(e.kind(), ErrorKind::TargetLost, "{e}");
    assert!(took >= ctrl_loss - Duration::from_millis(100) && took < ctrl_loss + Duration::from_secs(3), "{took:?}");
    let m = e.one_line();
    for f in &g {
        assert!(m.contains(&format!("{}: ", f.url)), "{m}");
    }
    assert_eq!(m.matches("(NotOwner)").count(), 2, "{m}");
    assert!(s.is_lost());
}

#[test]
fn a_single_gateway_answering_not_owner_fails_the_command_as_any_status() {
    let g = gateways(1);
    let s = Session::connect(g[0].url.as_str(), options()).unwrap();
    let vol = s.open("vol0").unwrap();
    g[0].set_not_owner(true);
    let e = vol.write_at(&pattern(4096, 1), 0).unwrap_err();
    assert_eq!(e.status(), Some(Status::NotOwner), "{e}");
    assert_eq!(s.stats().reconnects, 0);
    assert!(s.is_connected());
}

#[test]
fn another_size_on_the_next_gateway_ends_the_session() {
    let a = FakeTarget::start(config("a"), vec![FakeVolume::new("vol0", 4 * MIB, 4096)]);
    let b = FakeTarget::start(config("b"), vec![FakeVolume::new("vol0", 2 * MIB, 4096)]);
    let s = Session::connect(list(&[&a, &b]), options()).unwrap();
    let vol = s.open("vol0").unwrap();
    a.set_down(true);
    a.drop_connections();
    let e = vol.read_at(&mut [0u8; 4096], 0).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::VolumeChanged, "{e}");
    let m = e.to_string();
    assert!(m.contains(&format!("gateway {} serves volume \"vol0\" with another size", b.url)), "{m}");
    assert!(m.contains("2097152 bytes in 4096-byte blocks, where it was opened with 4194304 bytes"), "{m}");
    assert!(s.is_lost());
}

#[test]
fn targets_and_urls_name_the_same_gateways() {
    let g = gateways(2);
    let t = Targets::parse(&list(&[&g[0], &g[1]])).unwrap();
    let s = Session::connect(&t, options()).unwrap();
    assert_eq!(s.targets(), &t);
    assert_eq!(s.url(), &t.urls()[0]);
}
