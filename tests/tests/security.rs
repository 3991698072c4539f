//! Host authentication and per-volume access control against the real
//! daemon, with hostile initiators (raw capsules) and a target impersonator.
//!
//! Target: hosts "alpha" and "beta" with their own key files; volume
//! "secret" for alpha only, volume "shared" read-write for alpha and
//! read-only for beta.
//!
//! The tests of what the grants let into a volume's store run twice: on file
//! volumes, and on RBD volumes, images of the dev Ceph cluster (issue 54),
//! whose bytes are checked as Ceph holds them (`rbd export`).

use std::path::{Path, PathBuf};
use std::time::Duration;

use rdmablk_common::auth::{generate_key_file, AuthKey};
use rdmablk_common::protocol::{
    AuthChallenge, AuthResponse, AuthSuccess, BlockCount, CommandCapsule, CommandId, Lba, Opcode,
    SessionId, Status, VolumeId, VolumeInfo, AUTH_ALGORITHM_HMAC_SHA256, VOLUME_INFO_SIZE,
};
use rdmablk_initiator::{BlockDevice, ConnectOptions, ErrorKind, Session};
use rdmablk_system_tests::raw::{RawQueue, RawTarget};
use rdmablk_system_tests::backing::{Backing, BackingKind};
use rdmablk_system_tests::{bytes_digest, sparse_file, target_section, TargetProcess};

const MIB: u64 = 1 << 20;

struct Fixture {
    target: TargetProcess,
    _dir: tempfile::TempDir,
    alpha_key: PathBuf,
    beta_key: PathBuf,
    secret: Backing,
    shared: Backing,
}

fn volume(name: &str, path: &Path, grants: &str) -> String {
    format!("[[volume]]\nname = \"{name}\"\nbackend = \"file\"\npath = \"{}\"\nsize = {}\n{grants}\n", path.display(), 4 * MIB)
}

fn host(id: &str, key: &Path) -> String {
    format!("[[host]]\nid = \"{id}\"\nkey_file = \"{}\"\n", key.display())
}

fn config(f: &Fixture, secret_grants: &str) -> String {
    config_of([&f.alpha_key, &f.beta_key], [&f.secret, &f.shared], secret_grants)
}

fn config_of([alpha_key, beta_key]: [&Path; 2], [secret, shared]: [&Backing; 2], secret_grants: &str) -> String {
    format!(
        "{}\n{}\n{}\n{}\n{}",
        target_section(),
        host("alpha", alpha_key),
        host("beta", beta_key),
        secret.volume_with_access("secret", 4 * MIB, false, secret_grants),
        shared.volume_with_access("shared", 4 * MIB, false, "allowed_hosts = [\"alpha\"]\nread_only_hosts = [\"beta\"]"),
    )
}

/// A digest of what `store` holds (the file, or the image as Ceph has it).
fn digest(store: &Backing) -> u64 {
    bytes_digest(&store.contents())
}

/// Stops the target with SIGTERM and expects a clean exit (an rbd volume
/// closes its image, so that removing it need not wait out a killed
/// gateway's watch).
fn stop(f: &mut Fixture) {
    f.target.signal(libc::SIGTERM);
    let code = f.target.wait_exit(Duration::from_secs(20));
    assert_eq!(code, Some(0), "the target's exit on SIGTERM; log:\n{}", f.target.log().join("\n"));
}

fn fixture() -> Fixture {
    fixture_on(BackingKind::File)
}

fn fixture_on(kind: BackingKind) -> Fixture {
    let dir = tempfile::tempdir().unwrap();
    let alpha_key = dir.path().join("alpha.key");
    let beta_key = dir.path().join("beta.key");
    generate_key_file(&alpha_key).unwrap();
    generate_key_file(&beta_key).unwrap();
    let secret = Backing::new(kind, dir.path(), "secret.img", 4 * MIB);
    let shared = Backing::new(kind, dir.path(), "shared.img", 4 * MIB);
    for (i, store) in [&secret, &shared].iter().enumerate() {
        let pattern: Vec<u8> = (0..4 * MIB).map(|x| (x as u8).wrapping_mul(13).wrapping_add(i as u8)).collect();
        store.write_at(&pattern, 0);
    }
    let target = TargetProcess::start(&config_of([&alpha_key, &beta_key], [&secret, &shared], "allowed_hosts = [\"alpha\"]"));
    Fixture { target, _dir: dir, alpha_key, beta_key, secret, shared }
}

fn key(path: &Path) -> AuthKey {
    AuthKey::from_file(path).unwrap()
}

/// A raw queue pair authenticated and connected as `host`.
fn raw_as(url: &str, host: &str, key_path: &Path) -> RawQueue {
    let mut q = RawQueue::open(url, 1 << 20);
    let (_, r) = q.authenticate_and_connect(host, &key(key_path), SessionId(0));
    assert_eq!(r.capsule.status, Status::Success, "CONNECT as {host}: {:?}", r.capsule);
    q
}

fn options(host: &str, key_path: Option<&Path>) -> ConnectOptions {
    let o = ConnectOptions {
        host_id: host.into(),
        queues: 1,
        ctrl_loss_timeout: Duration::ZERO,
        connect_timeout: Duration::from_secs(10),
        ..ConnectOptions::default()
    };
    match key_path {
        Some(p) => o.with_key_file(p).unwrap(),
        None => o,
    }
}

/// LIST through a raw queue pair: (total, names written).
fn raw_list(q: &mut RawQueue) -> (u64, Vec<VolumeInfo>) {
    let mut c = CommandCapsule::new(Opcode::ListVolumes, CommandId(0));
    c.descriptor = q.descriptor(0, 8 * VOLUME_INFO_SIZE as u32);
    let r = q.command(c, b"").expect("LIST");
    assert_eq!(r.capsule.status, Status::Success);
    let total = r.capsule.result;
    let infos = (0..total.min(8) as usize)
        .map(|i| VolumeInfo::decode(&q.data()[i * VOLUME_INFO_SIZE..(i + 1) * VOLUME_INFO_SIZE]).unwrap())
        .collect();
    (total, infos)
}

fn raw_write(q: &mut RawQueue, vol: VolumeId, blocks: u32, bs: u32) -> Status {
    q.data_mut()[..(blocks * bs) as usize].fill(0xee);
    let mut c = CommandCapsule::new(Opcode::Write, CommandId(0));
    c.volume_id = vol;
    c.start_block = Lba(0);
    c.block_count = BlockCount(blocks);
    c.descriptor = q.descriptor(0, blocks * bs);
    q.command(c, b"").expect("WRITE").capsule.status
}

#[test]
fn an_unauthorized_host_neither_sees_nor_opens_the_volume_and_is_logged() {
    an_unauthorized_host(BackingKind::File);
}

#[test]
fn an_unauthorized_host_neither_sees_nor_opens_the_volume_and_is_logged_on_rbd() {
    an_unauthorized_host(BackingKind::Rbd);
}

fn an_unauthorized_host(kind: BackingKind) {
    let mut f = fixture_on(kind);
    let before = digest(&f.secret);
    let mut beta = raw_as(&f.target.url, "beta", &f.beta_key);
    let (total, infos) = raw_list(&mut beta);
    assert_eq!(total, 1, "beta sees only the volume it may use");
    assert_eq!(infos.iter().map(|v| v.name.as_str()).collect::<Vec<_>>(), vec!["shared"]);
    let mut alpha = raw_as(&f.target.url, "alpha", &f.alpha_key);
    let (total, _) = raw_list(&mut alpha);
    assert_eq!(total, 2, "alpha sees both");

    assert_eq!(beta.open_volume("secret").unwrap_err(), Status::AccessDenied);
    assert_eq!(beta.open_volume("no-such-volume").unwrap_err(), Status::UnknownVolume, "a distinct status");
    let line = f.target.wait_for_log("refused: host=beta peer=", Duration::from_secs(10));
    assert!(line.contains("secret") && line.contains("may not open"), "{line}");
    assert!(line.contains("peer=127.0.0.1:") || line.contains("peer=["), "{line}");
    // Its I/O to the volume id alpha would get is refused too: never opened.
    let id = alpha.open_volume("secret").unwrap().volume_id;
    assert_eq!(raw_write(&mut beta, id, 1, 4096), Status::VolumeNotOpen);

    // The library sees the same.
    let s = Session::connect(f.target.url.as_str(), options("beta", Some(&f.beta_key))).unwrap();
    let names: Vec<String> = s.list_volumes().unwrap().into_iter().map(|v| v.name).collect();
    assert_eq!(names, vec!["shared"]);
    let e = s.open("secret").err().unwrap();
    assert_eq!(e.status(), Some(Status::AccessDenied), "{e}");
    assert_eq!(digest(&f.secret), before);
    stop(&mut f);
    assert_eq!(digest(&f.secret), before, "the volume changed by the target's exit");
}

#[test]
fn a_read_only_grant_refuses_writes_and_leaves_the_file_unchanged() {
    a_read_only_grant(BackingKind::File);
}

#[test]
fn a_read_only_grant_refuses_writes_and_leaves_the_file_unchanged_on_rbd() {
    a_read_only_grant(BackingKind::Rbd);
}

fn a_read_only_grant(kind: BackingKind) {
    let mut f = fixture_on(kind);
    let before = digest(&f.shared);
    let mut beta = raw_as(&f.target.url, "beta", &f.beta_key);
    let info = beta.open_volume("shared").unwrap();
    assert!(info.read_only(), "OPEN reports the read-only grant");
    for op in [Opcode::Write, Opcode::WriteZeroes, Opcode::Discard] {
        let st = if op == Opcode::Write {
            raw_write(&mut beta, info.volume_id, 4, info.block_size)
        } else {
            let mut c = CommandCapsule::new(op, CommandId(0));
            c.volume_id = info.volume_id;
            c.block_count = BlockCount(4);
            beta.command(c, b"").unwrap().capsule.status
        };
        assert_eq!(st, Status::ReadOnly, "{op:?}");
    }
    // Reads work.
    let mut c = CommandCapsule::new(Opcode::Read, CommandId(0));
    c.volume_id = info.volume_id;
    c.block_count = BlockCount(1);
    c.descriptor = beta.descriptor(0, info.block_size);
    assert_eq!(beta.command(c, b"").unwrap().capsule.status, Status::Success);
    assert_eq!(digest(&f.shared), before, "refused writes change nothing");
    let line = f.target.wait_for_log("refused: host=beta", Duration::from_secs(10));
    assert!(line.contains("read-only grant") && line.contains("peer="), "{line}");

    // The same volume is writable for alpha (the refusal is the grant's).
    let mut alpha = raw_as(&f.target.url, "alpha", &f.alpha_key);
    let a = alpha.open_volume("shared").unwrap();
    assert!(!a.read_only());
    assert_eq!(raw_write(&mut alpha, a.volume_id, 1, a.block_size), Status::Success);
    let written = f.shared.contents();
    assert!(written[..a.block_size as usize].iter().all(|&b| b == 0xee), "alpha's write is in the store");
    assert_ne!(bytes_digest(&written), before);

    // The library reports the volume read-only.
    let s = Session::connect(f.target.url.as_str(), options("beta", Some(&f.beta_key))).unwrap();
    let v = s.open("shared").unwrap();
    assert!(v.read_only());
    assert!(v.write_at(&[0u8; 4096], 0).is_err());
    drop((v, s));
    stop(&mut f);
    assert!(f.shared.contents() == written, "the store after the target's exit holds alpha's write and nothing of beta's");
}

#[test]
fn a_replayed_authentication_exchange_fails_and_is_logged() {
    let f = fixture();
    let mut first = RawQueue::open(&f.target.url, 1 << 20);
    let (captured, r) = first.authenticate_and_connect("alpha", &key(&f.alpha_key), SessionId(0));
    assert_eq!(r.capsule.status, Status::Success);
    assert_eq!(captured.len(), 3, "AUTH_NEGOTIATE, AUTH_REPLY, CONNECT");

    // The same bytes on a new connection: the target's nonce differs.
    let mut replay = RawQueue::open(&f.target.url, 1 << 20);
    let r = replay.send_message(&captured[0]).unwrap();
    assert_eq!(r.capsule.status, Status::Success, "a new challenge");
    let fresh = AuthChallenge::decode(&r.data).unwrap();
    let r = replay.send_message(&captured[1]).unwrap();
    assert_eq!(r.capsule.status, Status::AuthFailed);
    assert_eq!((r.capsule.detail, r.capsule.result, r.data.len()), (0, 0, 0), "nothing more is said");
    let r = replay.send_message(&captured[2]).unwrap();
    assert_eq!(r.capsule.status, Status::AuthRequired, "CONNECT without authentication");
    assert_eq!(replay.open_volume("secret").unwrap_err(), Status::NotConnected);
    let line = f.target.wait_for_log("authentication failed: host=alpha peer=", Duration::from_secs(10));
    assert!(line.contains("MAC does not match"), "{line}");
    f.target.wait_for_log("connect refused: host=alpha", Duration::from_secs(10));

    // Replaying on the original connection after it authenticated fails too.
    let mut again = RawQueue::open(&f.target.url, 1 << 20);
    let r = again.send_message(&captured[1]).unwrap();
    assert_eq!(r.capsule.status, Status::AuthFailed, "AUTH_REPLY without a challenge");

    // An initiator that reflects the target's own nonce back gains nothing either.
    let mut reflect = RawQueue::open(&f.target.url, 1 << 20);
    let ch = AuthChallenge::decode(&reflect.send_message(&captured[0]).unwrap().data).unwrap();
    let r = reflect
        .send_message(&RawQueue::auth_reply_message(7, &AuthResponse { initiator_nonce: ch.target_nonce, mac: [0x11; 32] }))
        .unwrap();
    assert_eq!(r.capsule.status, Status::AuthFailed);
    assert_ne!(fresh.target_nonce, ch.target_nonce, "every challenge has a fresh nonce");
}

/// Starts a target where `host` has the key in `target_key`, connects with
/// `initiator_key`; returns the library's error and the raw wire response.
fn wrong_key_outcome(target_key: &Path, initiator_key: &Path) -> (String, Option<Status>, ErrorKind, (Status, u32, u64, usize)) {
    let dir = tempfile::tempdir().unwrap();
    let img = sparse_file(dir.path(), "v.img", 4 * MIB);
    let t = TargetProcess::start(&format!(
        "{}\n{}\n{}",
        target_section(),
        host("alpha", target_key),
        volume("v", &img, "allowed_hosts = [\"alpha\"]")
    ));
    let Err(e) = Session::connect(t.url.as_str(), options("alpha", Some(initiator_key))) else { panic!("a wrong key must fail") };
    let mut q = RawQueue::open(&t.url, 4096);
    let (_, r) = q.authenticate_and_connect("alpha", &key(initiator_key), SessionId(0));
    t.wait_for_log("authentication failed: host=alpha", Duration::from_secs(10));
    (e.to_string(), e.status(), e.kind(), (r.capsule.status, r.capsule.detail, r.capsule.result, r.data.len()))
}

#[test]
fn a_wrong_key_fails_the_same_way_whichever_side_holds_it() {
    let dir = tempfile::tempdir().unwrap();
    let (right, other) = (dir.path().join("right.key"), dir.path().join("other.key"));
    generate_key_file(&right).unwrap();
    generate_key_file(&other).unwrap();
    // The initiator's key is the wrong one ...
    let initiator_wrong = wrong_key_outcome(&right, &other);
    // ... and the target's.
    let target_wrong = wrong_key_outcome(&other, &right);
    assert_eq!(initiator_wrong, target_wrong);
    assert_eq!(initiator_wrong.1, Some(Status::AuthFailed));
    assert_eq!(initiator_wrong.2, ErrorKind::Authentication);
    assert_eq!(initiator_wrong.3, (Status::AuthFailed, 0, 0, 0));
    // And the right key works (so the failures above are the key's).
    let dir2 = tempfile::tempdir().unwrap();
    let img = sparse_file(dir2.path(), "v.img", 4 * MIB);
    let t = TargetProcess::start(&format!("{}\n{}\n{}", target_section(), host("alpha", &right), volume("v", &img, "allowed_hosts = [\"alpha\"]")));
    let s = Session::connect(t.url.as_str(), options("alpha", Some(&right))).unwrap();
    s.open("v").unwrap();
    // An unknown host id gets the very same answer as a wrong key.
    let mut q = RawQueue::open(&t.url, 4096);
    let (_, r) = q.authenticate_and_connect("mallory", &key(&right), SessionId(0));
    assert_eq!((r.capsule.status, r.capsule.detail, r.capsule.result, r.data.len()), initiator_wrong.3);
    let line = t.wait_for_log("authentication failed: host=mallory", Duration::from_secs(10));
    assert!(line.contains("no [[host]] entry"), "the log (only) says why: {line}");
}

/// A fake target that does not hold the key: it answers the authentication
/// exchange as well as it can and records every opcode it receives.
fn impersonator(behaviour: fn(&mut RawTarget, CommandCapsule, Vec<u8>)) -> (String, std::thread::JoinHandle<Vec<Opcode>>) {
    let (tx, rx) = std::sync::mpsc::channel();
    let h = std::thread::spawn(move || {
        let mut seen = Vec::new();
        let Some(mut t) = RawTarget::accept_one(tx, Duration::from_secs(20)) else { return seen };
        while let Some((cap, inline)) = t.next_command(Duration::from_secs(10)) {
            seen.push(cap.opcode);
            behaviour(&mut t, cap, inline);
        }
        seen
    });
    (rx.recv_timeout(Duration::from_secs(10)).unwrap(), h)
}

fn fake_challenge(t: &mut RawTarget, cap: CommandCapsule) {
    let ch = AuthChallenge { algorithm: AUTH_ALGORITHM_HMAC_SHA256, target_nonce: rdmablk_common::auth::random_nonce(), target_name: "rdmablk".into() };
    t.respond(cap.command_id, Status::Success, &ch.to_bytes().unwrap());
}

#[test]
fn a_target_impersonator_without_the_key_is_rejected_by_the_initiator() {
    let dir = tempfile::tempdir().unwrap();
    let k = dir.path().join("alpha.key");
    generate_key_file(&k).unwrap();

    // 1. It answers with a proof made with some other key.
    let (url, h) = impersonator(|t, cap, _| match cap.opcode {
        Opcode::AuthNegotiate => fake_challenge(t, cap),
        Opcode::AuthReply => {
            let proof = AuthSuccess { mac: rdmablk_common::auth::random_nonce() };
            t.respond(cap.command_id, Status::Success, &proof.to_bytes());
        }
        _ => t.respond(cap.command_id, Status::InvalidOpcode, &[]),
    });
    let Err(e) = Session::connect(url.as_str(), options("alpha", Some(&k))) else { panic!("the impostor must be rejected") };
    assert_eq!(e.kind(), ErrorKind::Authentication, "{e}");
    assert_eq!(e.status(), Some(Status::AuthFailed));
    let seen = h.join().unwrap();
    assert_eq!(seen, vec![Opcode::AuthNegotiate, Opcode::AuthReply], "never CONNECT, never data");

    // The error is the one a real target's refusal gives (nothing tells the cases apart).
    let dir2 = tempfile::tempdir().unwrap();
    let (real_key, img) = (dir2.path().join("real.key"), sparse_file(dir2.path(), "v.img", 4 * MIB));
    generate_key_file(&real_key).unwrap();
    let t = TargetProcess::start(&format!("{}\n{}\n{}", target_section(), host("alpha", &real_key), volume("v", &img, "allow_any_host = true")));
    let refused = Session::connect(t.url.as_str(), options("alpha", Some(&k))).err().unwrap();
    assert_eq!(refused.to_string(), e.to_string());

    // 2. It pretends not to do authentication: no silent downgrade to an
    // unauthenticated CONNECT.
    let (url, h) = impersonator(|t, cap, _| t.respond(cap.command_id, Status::InvalidOpcode, &[]));
    assert!(Session::connect(url.as_str(), options("alpha", Some(&k))).is_err());
    assert_eq!(h.join().unwrap(), vec![Opcode::AuthNegotiate]);

    // 3. It says "authentication succeeded" with no proof at all.
    let (url, h) = impersonator(|t, cap, _| match cap.opcode {
        Opcode::AuthNegotiate => fake_challenge(t, cap),
        _ => t.respond(cap.command_id, Status::Success, &[]),
    });
    let e = Session::connect(url.as_str(), options("alpha", Some(&k))).err().unwrap();
    assert_eq!(e.kind(), ErrorKind::Authentication, "{e}");
    assert_eq!(h.join().unwrap(), vec![Opcode::AuthNegotiate, Opcode::AuthReply]);
}

#[test]
fn a_key_file_others_may_read_is_refused_with_its_name_and_mode() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let k = dir.path().join("loose.key");
    generate_key_file(&k).unwrap();
    std::fs::set_permissions(&k, std::fs::Permissions::from_mode(0o644)).unwrap();
    let img = sparse_file(dir.path(), "v.img", 4 * MIB);
    let cfg = dir.path().join("t.toml");
    std::fs::write(&cfg, format!("{}\n{}\n{}", target_section(), host("alpha", &k), volume("v", &img, "allowed_hosts = [\"alpha\"]"))).unwrap();
    for args in [vec!["--check"], vec![]] {
        let out = std::process::Command::new(rdmablk_system_tests::bin("rdmablk-target"))
            .arg("--config")
            .arg(&cfg)
            .args(&args)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains(&k.display().to_string()) && err.contains("0644") && err.contains("host[0].key_file"), "{err}");
    }
    // The initiator refuses it as well, before connecting anywhere.
    let out = rdmablk_system_tests::rdmablk(&["-t", "tcp://127.0.0.1:9", "--host-id", "alpha", "--key-file", k.to_str().unwrap(), "list"], None);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("loose.key") && err.contains("0644"), "{err}");

    // A reload onto a loose key file changes nothing.
    std::fs::set_permissions(&k, std::fs::Permissions::from_mode(0o600)).unwrap();
    let text = std::fs::read_to_string(&cfg).unwrap();
    let t = TargetProcess::start(&text);
    std::fs::set_permissions(&k, std::fs::Permissions::from_mode(0o640)).unwrap();
    let line = t.reload(&text);
    assert!(line.contains("reload failed") && line.contains("0640"), "{line}");
    std::fs::set_permissions(&k, std::fs::Permissions::from_mode(0o600)).unwrap();
    let s = Session::connect(t.url.as_str(), options("alpha", Some(&k))).unwrap();
    s.open("v").unwrap();
}

#[test]
fn every_queue_pair_of_a_session_authenticates() {
    let f = fixture();
    let url = &f.target.url;
    let mut first = RawQueue::open(url, 4096);
    let (_, r) = first.authenticate_and_connect("alpha", &key(&f.alpha_key), SessionId(0));
    let session = rdmablk_common::protocol::ConnectReply::decode(&r.data).unwrap().session_id;

    // A join without authentication.
    let mut q = RawQueue::open(url, 4096);
    let r = q.connect_to_session(8, 1 << 20, "alpha", session).unwrap();
    assert_eq!(r.capsule.status, Status::AuthRequired);
    // Authenticated for a new session, then CONNECT joining an existing one: the session is bound.
    let mut q = RawQueue::open(url, 4096);
    let r = q.send_message(&RawQueue::auth_negotiate_message(1, "alpha", SessionId(0))).unwrap();
    let ch = AuthChallenge::decode(&r.data).unwrap();
    let ni = rdmablk_common::auth::random_nonce();
    let tr = rdmablk_common::auth::Transcript { host_id: "alpha", target_name: &ch.target_name, session_id: SessionId(0), initiator_nonce: &ni, target_nonce: &ch.target_nonce };
    let mac = rdmablk_common::auth::mac(&key(&f.alpha_key), rdmablk_common::auth::Direction::Initiator, &tr);
    assert_eq!(q.send_message(&RawQueue::auth_reply_message(2, &AuthResponse { initiator_nonce: ni, mac })).unwrap().capsule.status, Status::Success);
    assert_eq!(q.send_message(&RawQueue::connect_message(3, "alpha", session)).unwrap().capsule.status, Status::AuthRequired);
    // Beta, authenticated, may not join alpha's session.
    let mut q = RawQueue::open(url, 4096);
    let (_, r) = q.authenticate_and_connect("beta", &key(&f.beta_key), session);
    assert_eq!(r.capsule.status, Status::UnknownSession);
    // Alpha, authenticated for this session, joins it.
    let mut q = RawQueue::open(url, 4096);
    let (_, r) = q.authenticate_and_connect("alpha", &key(&f.alpha_key), session);
    assert_eq!(r.capsule.status, Status::Success);
    assert_eq!(rdmablk_common::protocol::ConnectReply::decode(&r.data).unwrap().queue_index, 1);

    // The library: several queue pairs, each authenticated.
    let count = || f.target.log().iter().filter(|l| l.contains("authenticated: host=alpha")).count();
    // The raw queue pairs above authenticated as alpha three times (the log arrives asynchronously).
    rdmablk_system_tests::wait_until("3 raw authentications logged", Duration::from_secs(10), || count() >= 3);
    assert_eq!(count(), 3);
    let o = ConnectOptions { queues: 3, ..options("alpha", Some(&f.alpha_key)) };
    let s = Session::connect(url.as_str(), o).unwrap();
    assert_eq!(s.queue_count(), 3);
    let v = s.open("secret").unwrap();
    let mut buf = vec![0u8; 4096];
    v.read_at(&mut buf, 0).unwrap();
    rdmablk_system_tests::wait_until("the library's authentications logged", Duration::from_secs(10), || count() >= 6);
    assert_eq!(count(), 6, "one authentication per queue pair of the library's session");
}

#[test]
fn without_a_key_a_target_with_hosts_refuses_to_connect() {
    let f = fixture();
    let mut q = RawQueue::open(&f.target.url, 4096);
    let r = q.connect_command(rdmablk_common::protocol::PROTOCOL_VERSION, 8, 1 << 20, "alpha").unwrap();
    assert_eq!(r.capsule.status, Status::AuthRequired);
    assert_eq!(q.open_volume("secret").unwrap_err(), Status::NotConnected);
    let e = Session::connect(f.target.url.as_str(), options("alpha", None)).err().unwrap();
    assert_eq!(e.status(), Some(Status::AuthRequired), "{e}");
    f.target.wait_for_log("connect refused: host=alpha peer=", Duration::from_secs(10));
}

#[test]
fn grants_follow_a_reload_for_new_opens_and_open_sessions_keep_theirs() {
    let f = fixture();
    let alpha = Session::connect(f.target.url.as_str(), options("alpha", Some(&f.alpha_key))).unwrap();
    let held = alpha.open("secret").unwrap();
    let line = f.target.reload(&config(&f, "allowed_hosts = [\"beta\"]"));
    assert!(line.contains("reload complete"), "{line}");
    f.target.wait_for_log("volume secret: grants changed", Duration::from_secs(10));
    // The open volume keeps working for the session that opened it...
    held.write_at(&[7u8; 4096], 0).unwrap();
    // ... a new OPEN follows the new grants.
    let again = Session::connect(f.target.url.as_str(), options("alpha", Some(&f.alpha_key))).unwrap();
    assert_eq!(again.open("secret").err().unwrap().status(), Some(Status::AccessDenied));
    let beta = Session::connect(f.target.url.as_str(), options("beta", Some(&f.beta_key))).unwrap();
    beta.open("secret").unwrap();
    assert!(beta.list_volumes().unwrap().iter().any(|v| v.name == "secret"));
}

#[test]
fn without_hosts_only_volumes_open_to_any_host_are_served() {
    let dir = tempfile::tempdir().unwrap();
    let (open_img, closed_img) = (sparse_file(dir.path(), "o.img", 4 * MIB), sparse_file(dir.path(), "c.img", 4 * MIB));
    let t = TargetProcess::start(&format!(
        "{}\n{}\n{}",
        target_section(),
        volume("open", &open_img, "allow_any_host = true"),
        volume("closed", &closed_img, "")
    ));
    let s = Session::connect(t.url.as_str(), options("anyone", None)).unwrap();
    let names: Vec<String> = s.list_volumes().unwrap().into_iter().map(|v| v.name).collect();
    assert_eq!(names, vec!["open"], "default: nobody");
    s.open("open").unwrap().write_at(&[1u8; 4096], 0).unwrap();
    assert_eq!(s.open("closed").err().unwrap().status(), Some(Status::AccessDenied));
    t.wait_for_log("volume closed: no host may open it", Duration::from_secs(10));
    // An initiator with a key never falls back to an unauthenticated session.
    let k = dir.path().join("k.key");
    generate_key_file(&k).unwrap();
    let e = Session::connect(t.url.as_str(), options("anyone", Some(&k))).err().unwrap();
    assert_eq!(e.kind(), ErrorKind::Authentication, "{e}");
}
