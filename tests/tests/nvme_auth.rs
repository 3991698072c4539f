//! NVMe in-band authentication (DH-HMAC-CHAP) against the real daemon,
//! with the suite's NVMe/TCP host (`rdmablk_system_tests::nvme_tcp`, whose
//! host side of the exchange is written from NVMe Base 2.0 section 8.13):
//!
//! - the right secret, with each DH group and the NULL group, on the admin
//!   queue and an I/O queue, then a write read back; bidirectional with the
//!   controller's secret;
//! - refused, logged with the host NQN and peer address and counted by
//!   reason: a wrong secret, the controller's wrong secret (the host's
//!   Failure2), a replayed Reply, messages out of order, a changed
//!   transaction id, commands before authentication, no authentication
//!   within `handshake_timeout` (a refused queue is closed by then, if its
//!   host did not disconnect); and the target goes on serving.

use std::net::SocketAddr;
use std::time::Duration;

use rdmablk_common::nvme::auth::{explanation, DhGroup, HashId, Message, Reply, Secret};
use rdmablk_common::nvme::fabrics::ANY_CONTROLLER;
use rdmablk_common::nvme::status::Status;
use rdmablk_common::nvme::tcp::Digests;
use rdmablk_system_tests::nvme_tcp::{connect_data, connect_entry, write_dhchap_secret, HostAuth, NvmeTcpConn};
use rdmablk_system_tests::{file_volume, listen_host, sample, scrape, TargetProcess};

const SUBNQN: &str = "nqn.2026-12.io.rdmablk.test:auth";
const HOSTNQN: &str = "nqn.2014-08.org.nvmexpress:uuid:5e1f0000-0000-4000-8000-00000000a001";
const NO_DIGESTS: Digests = Digests { header: false, data: false };
const ATR: u64 = 1 << 17;

struct Env {
    target: TargetProcess,
    addr: SocketAddr,
    metrics: String,
    host: Secret,
    ctrl: Secret,
    _dir: tempfile::TempDir,
}

/// A daemon whose one host must authenticate with SHA-256-transformed
/// secrets, the target choosing SHA-384 and `dhgroup`; `handshake_timeout`
/// 2 s unless `extra` sets it.
fn start(dhgroup: &str, extra: &str) -> Env {
    let extra = if extra.contains("handshake_timeout") { extra.to_owned() } else { format!("handshake_timeout = \"2s\"\n{extra}") };
    let dir = tempfile::tempdir().unwrap();
    let host = Secret::generate(Some(HashId::Sha256));
    let ctrl = Secret::generate(None);
    let hk = write_dhchap_secret(dir.path(), "host.key", &host);
    let ck = write_dhchap_secret(dir.path(), "ctrl.key", &ctrl);
    let img = dir.path().join("vol.img");
    let h = listen_host();
    let h = if h.contains(':') { format!("[{h}]") } else { h };
    let config = format!(
        "[target]\nlisten = [\"nvme+tcp://{h}:0\"]\nnqn = \"{SUBNQN}\"\nmetrics = \"127.0.0.1:0\"\n{extra}\n\
         [[host]]\nid = \"h1\"\nnqn = \"{HOSTNQN}\"\ndhchap_key_file = \"{}\"\ndhchap_ctrl_key_file = \"{}\"\n\
         dhchap_hash = \"sha384\"\ndhchap_dhgroup = \"{dhgroup}\"\n\n{}nsid = 1\n",
        hk.display(),
        ck.display(),
        file_volume("vol", &img, 16 << 20, false),
    );
    let path = dir.path().join("target.toml");
    std::fs::write(&path, config).unwrap();
    let target = TargetProcess::start_with_path(&path);
    let addr = target.nvme_tcp_addr();
    let metrics = target.metrics_addr();
    Env { target, addr, metrics, host, ctrl, _dir: dir }
}

/// An admin Connect; returns the connection, the controller id and
/// whether the answer asks for authentication (AUTHREQ.ATR).
fn admin(env: &Env) -> (NvmeTcpConn, u16, bool) {
    let mut c = NvmeTcpConn::connect(env.addr, NO_DIGESTS);
    let r = c.exec_ok(connect_entry(0, 31, 0), &connect_data(ANY_CONTROLLER, SUBNQN, HOSTNQN), &[], 0).expect("admin Connect");
    c.qid = 0;
    (c, r.cqe.result as u16, r.cqe.result & ATR != 0)
}

fn host_auth(env: &Env, bidirectional: bool) -> HostAuth {
    HostAuth::new(env.host.clone(), bidirectional.then(|| env.ctrl.clone()), HOSTNQN, SUBNQN)
}

fn failures(env: &Env, reason: &str) -> f64 {
    sample(&scrape(&env.metrics), "rdmablk_nvme_auth_failures_total", &[("reason", reason)]).unwrap_or(0.0)
}

/// The connection ends (the target closes the refused queue by its
/// `handshake_timeout`) within a few seconds.
fn assert_closed(c: &mut NvmeTcpConn, what: &str) {
    let t = c.wait_for_termination(Duration::from_secs(5));
    assert!(t.closed, "{what}: the target kept the connection open ({})", t.end);
}

/// Authenticates the admin queue, enables it, connects and authenticates
/// I/O queue 1, writes a block and reads it back.
fn round_trip(env: &Env, bidirectional: bool, tid: u16) {
    let (mut a, cntlid, atr) = admin(env);
    assert!(atr, "the admin Connect's answer asks for authentication");
    let run = a.authenticate(&host_auth(env, bidirectional), tid);
    assert_eq!(run.failure, None, "admin queue authentication");
    a.enable();
    a.set_features(0x07, 0).expect("Set Features after authentication");
    let mut io = NvmeTcpConn::connect(env.addr, NO_DIGESTS);
    let r = io.io_connect(cntlid, 1, SUBNQN, HOSTNQN).expect("I/O Connect");
    assert!(r.result & ATR != 0, "the I/O Connect's answer asks for authentication too");
    assert_eq!(io.read(1, 0, 1, 4096), Err(Status::AUTHENTICATION_REQUIRED), "a Read before the I/O queue authenticated");
    assert_eq!(io.authenticate(&host_auth(env, bidirectional), tid + 1).failure, None, "I/O queue authentication");
    let data: Vec<u8> = (0..4096u32).map(|i| (i * 7 + tid as u32) as u8).collect();
    io.write(1, 3, &data, false).expect("write after authentication");
    assert_eq!(io.read(1, 3, 1, 4096).expect("read back"), data);
}

#[test]
fn the_right_secret_authenticates_every_queue_with_each_group_and_both_ways() {
    for group in ["ffdhe2048", "null", "ffdhe8192"] {
        let env = start(group, "");
        round_trip(&env, false, 1);
        round_trip(&env, true, 11);
        let ok = sample(&scrape(&env.metrics), "rdmablk_nvme_authentications_total", &[]).unwrap();
        assert_eq!(ok, 4.0, "{group}: two admin and two I/O queues authenticated");
        env.target.wait_for_log(&format!("nvme host \"{HOSTNQN}\" from"), Duration::from_secs(5));
    }
}

#[test]
fn a_wrong_secret_is_refused_logged_counted_and_the_controller_ends() {
    let env = start("ffdhe2048", "");
    let (mut a, _, _) = admin(&env);
    let mut wrong = host_auth(&env, false);
    wrong.secret = Secret::generate(Some(HashId::Sha256));
    let run = a.authenticate(&wrong, 5);
    let f = run.failure.expect("a wrong secret is refused");
    assert!(f.contains("AUTH_Failure1 after Reply: authentication failed"), "{f}");
    // No second guess on the refused queue: a new Negotiate gets Failure1 too.
    a.auth_send(&wrong.negotiate(6)).expect("Authentication Send");
    assert!(matches!(a.auth_receive(4096), Ok(Message::Failure { first: true, .. })), "a retry on a refused queue");
    assert_eq!(a.identify(1, 0).map(|_| ()), Err(Status::AUTHENTICATION_REQUIRED));
    assert_closed(&mut a, "after Failure1");
    let line = env.target.wait_for_log("nvme authentication refused", Duration::from_secs(5));
    assert!(line.contains(HOSTNQN) && line.contains("wrong response") && line.contains("127.0.0.1"), "{line}");
    assert_eq!(failures(&env, "wrong_response"), 1.0);
    // The right host still gets in.
    round_trip(&env, false, 7);
}

#[test]
fn the_controllers_wrong_secret_is_refused_by_the_host() {
    let env = start("null", "");
    let (mut a, _, _) = admin(&env);
    let mut auth = host_auth(&env, true);
    auth.ctrl_secret = Some(Secret::generate(None));
    let f = a.authenticate(&auth, 5).failure.expect("the host refuses the controller");
    assert!(f.contains("controller's response is wrong"), "{f}");
    assert_eq!(a.identify(1, 0).map(|_| ()), Err(Status::AUTHENTICATION_REQUIRED), "nothing runs after the host's Failure2");
    assert_closed(&mut a, "after Failure2");
    assert_eq!(failures(&env, "refused_by_host"), 1.0);
}

#[test]
fn commands_before_authentication_get_authentication_required() {
    let env = start("null", "");
    let (mut a, _, _) = admin(&env);
    assert_eq!(a.identify(1, 0).map(|_| ()), Err(Status::AUTHENTICATION_REQUIRED));
    assert_eq!(a.keep_alive(), Err(Status::AUTHENTICATION_REQUIRED));
    // Property Get is allowed (the host reads CAP before or after).
    a.property_get(0, true).expect("Property Get before authentication");
    assert_eq!(a.authenticate(&host_auth(&env, false), 3).failure, None);
    a.identify(1, 0).expect("Identify after authentication");
}

#[test]
fn a_replayed_reply_is_refused() {
    let env = start("ffdhe2048", "");
    let (mut a, _, _) = admin(&env);
    let run = a.authenticate(&host_auth(&env, false), 9);
    assert_eq!(run.failure, None);
    // A recorder replays the Reply on a new queue of its own: the
    // challenge is fresh (and so is the DH value), the response does not fit it.
    let (mut b, _, _) = admin(&env);
    b.auth_send(&run.sent[0]).expect("the replayed Negotiate is taken");
    assert!(matches!(b.auth_receive(4096), Ok(Message::Challenge(_))));
    b.auth_send(&run.sent[1]).expect("Authentication Send of the replayed Reply");
    match b.auth_receive(4096) {
        Ok(Message::Failure { first: true, explanation: e, .. }) => assert_eq!(e, explanation::FAILED),
        other => panic!("a replayed Reply: expected AUTH_Failure1, got {other:?}"),
    }
    assert_closed(&mut b, "after a replayed Reply");
    // The NULL group too: the challenge alone is fresh.
    assert_eq!(failures(&env, "wrong_response"), 1.0);
}

#[test]
fn messages_out_of_order_or_of_another_transaction_are_refused() {
    let env = start("null", "");
    let auth = host_auth(&env, false);
    let reply = |tid| Message::Reply(Reply { tid, response: vec![0; 48], c2: None, seqnum: 0, dh_value: vec![] }).encode();
    type Case = (&'static str, Box<dyn Fn(&mut NvmeTcpConn)>);
    let cases: Vec<Case> = vec![
        ("a Reply before Negotiate", Box::new(move |c| c.auth_send(&reply(1)).unwrap())),
        ("a Receive before Negotiate", Box::new(|_| {})),
        (
            "a Reply without receiving the Challenge",
            Box::new(move |c| {
                c.auth_send(&auth.negotiate(1)).unwrap();
                c.auth_send(&reply(1)).unwrap();
            }),
        ),
        (
            "a Reply of another transaction",
            Box::new({
                let auth = host_auth(&env, false);
                move |c| {
                    c.auth_send(&auth.negotiate(1)).unwrap();
                    assert!(matches!(c.auth_receive(4096), Ok(Message::Challenge(_))));
                    c.auth_send(&reply(2)).unwrap();
                }
            }),
        ),
        (
            "Success2 where a Reply was expected",
            Box::new({
                let auth = host_auth(&env, false);
                move |c| {
                    c.auth_send(&auth.negotiate(1)).unwrap();
                    assert!(matches!(c.auth_receive(4096), Ok(Message::Challenge(_))));
                    c.auth_send(&Message::Success2 { tid: 1 }.encode()).unwrap();
                }
            }),
        ),
    ];
    for (i, (what, f)) in cases.iter().enumerate() {
        let (mut c, _, _) = admin(&env);
        f(&mut c);
        match c.auth_receive(4096) {
            Ok(Message::Failure { first: true, .. }) => {}
            other => panic!("{what}: expected AUTH_Failure1, got {other:?}"),
        }
        assert_closed(&mut c, what);
        assert_eq!(failures(&env, "protocol"), (i + 1) as f64, "{what}");
    }
    // A group the target does not choose: the host must offer it.
    let (mut c, _, _) = admin(&env);
    let mut only_dh = host_auth(&env, false);
    only_dh.dh_groups = vec![DhGroup::Ffdhe2048 as u8];
    let f = c.authenticate(&only_dh, 1).failure.expect("refused");
    assert!(f.contains("DH group not usable"), "{f}");
    assert_eq!(failures(&env, "not_usable"), 1.0);
    round_trip(&env, false, 21);
}

#[test]
fn a_host_that_does_not_authenticate_in_time_is_closed() {
    let env = start("null", "handshake_timeout = \"1s\"");
    let (mut a, _, _) = admin(&env);
    // Negotiates, then stops.
    a.auth_send(&host_auth(&env, false).negotiate(1)).unwrap();
    assert_closed(&mut a, "no authentication within handshake_timeout");
    let line = env.target.wait_for_log("not authenticated within", Duration::from_secs(5));
    assert!(line.contains(HOSTNQN), "{line}");
    assert_eq!(failures(&env, "timeout"), 1.0);
    round_trip(&env, false, 31);
}
