//! Per-command memory-key scoping, against a malicious target.
//!
//! A fake target in the harness speaks the protocol well enough for the
//! initiator library to connect and open a volume, then abuses the data
//! descriptor of a READ: it RDMA-WRITEs outside the command's bytes, after
//! its response, and with the rkey of an earlier command. Every attempt
//! must fail at the initiator's provider (the target's WRITE completes with
//! a remote access error) and leave every byte of the initiator's buffer as
//! it was.

use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::Duration;

use rdmablk_common::fabric::WcStatus;
use rdmablk_common::protocol::{
    CommandCapsule, ConnectReply, DataDescriptor, Opcode, SessionId, Status, VolumeId, VolumeInfo, PROTOCOL_VERSION,
};
use rdmablk_initiator::{ConnectOptions, IoBuffer, IoQueue, IoRequest, Session, Volume};
use rdmablk_system_tests::raw::RawTarget;

const WAIT: Duration = Duration::from_secs(10);
/// What the initiator's buffer holds before anything is placed.
const UNTOUCHED: u8 = 0x5A;
/// What the fake target legitimately places for a READ.
const DATA: u8 = 0xC3;
/// What the fake target tries to sneak in.
const EVIL: u8 = 0xEE;

/// Answers the setup commands (CONNECT, OPEN_VOLUME) until an I/O command
/// arrives, and returns it.
fn next_io(t: &mut RawTarget) -> CommandCapsule {
    loop {
        let (cap, _inline) = t.next_command(WAIT).expect("a command from the initiator");
        match cap.opcode {
            Opcode::Connect => {
                let reply = ConnectReply {
                    version: PROTOCOL_VERSION,
                    queue_depth: cap.queue_depth.min(8),
                    max_io_size: 1 << 20,
                    inline_data_size: 0,
                    target_name: "evil".into(),
                    session_id: SessionId(7),
                    queue_index: 0,
                };
                t.respond(cap.command_id, Status::Success, &reply.to_bytes().unwrap());
            }
            Opcode::OpenVolume => {
                let info = VolumeInfo {
                    volume_id: VolumeId(1),
                    block_size: 4096,
                    size_bytes: 1 << 20,
                    flags: 0,
                    name: "v".into(),
                };
                t.respond(cap.command_id, Status::Success, &info.to_bytes().unwrap());
            }
            // The session monitor's keep-alives (they also drive the
            // initiator's provider while nothing else polls it).
            Opcode::KeepAlive => t.respond(cap.command_id, Status::Success, &[]),
            _ => return cap,
        }
    }
}

/// Runs `script` as a fake target on its own thread; returns its URL and
/// the thread (which yields the script's result).
fn fake_target<R: Send + 'static>(script: impl FnOnce(&mut RawTarget) -> R + Send + 'static) -> (String, JoinHandle<R>) {
    let (tx, rx) = mpsc::channel();
    let h = std::thread::spawn(move || {
        let mut t = RawTarget::accept_one(tx, WAIT).expect("the initiator connects");
        script(&mut t)
    });
    (rx.recv_timeout(WAIT).expect("the fake target listens"), h)
}

fn connect(url: &str) -> (Session, Volume, IoQueue, IoBuffer) {
    let options = ConnectOptions {
        queues: 1,
        // The monitor polls idle queue pairs (every keepalive_timeout / 8):
        // what makes the initiator's provider see a late write at all.
        keepalive_timeout: Duration::from_secs(2),
        ctrl_loss_timeout: Duration::ZERO,
        ..ConnectOptions::default()
    };
    assert!(options.rkey_scoping, "scoping is on by default");
    let session = Session::connect(url, options).expect("connect to the fake target");
    let vol = session.open("v").expect("open");
    let mut buf = session.alloc_buffer(8192).expect("buffer");
    buf.as_mut_slice().fill(UNTOUCHED);
    let q = session.io_queue();
    (session, vol, q, buf)
}

/// Submits a 4 KiB READ into `[at, at + 4096)` of `buf` and waits for it.
fn read(q: &mut IoQueue, vol: &Volume, buf: IoBuffer, at: usize) -> (rdmablk_initiator::Result<()>, IoBuffer) {
    q.submit(IoRequest::read(vol, 0, buf).with_range(at, 4096), 1);
    let mut out = Vec::new();
    q.wait(&mut out, 1, Some(WAIT));
    let c = out.pop().expect("the READ completes (with or without an error)");
    (c.result, c.buffer.expect("the buffer comes back"))
}

fn desc(cap: &CommandCapsule) -> DataDescriptor {
    assert_eq!(cap.opcode, Opcode::Read);
    assert_eq!(cap.descriptor.length, 4096);
    cap.descriptor
}

fn all(bytes: &[u8], value: u8) -> bool {
    bytes.iter().all(|&b| b == value)
}

#[test]
fn a_write_outside_the_command_fails_and_changes_nothing() {
    let (url, target) = fake_target(|t| {
        let d = desc(&next_io(t));
        // The other half of the same registered buffer, with the command's own key.
        let past = t.rdma_write(d.remote_addr + 4096, d.rkey, &[EVIL; 4096]);
        (past, d)
    });
    let (_s, vol, mut q, buf) = connect(&url);
    let (result, buf) = read(&mut q, &vol, buf, 0);
    let (status, d) = target.join().unwrap();
    assert_eq!(status, WcStatus::RemoteAccessError, "the initiator's provider must refuse the write");
    assert!(result.is_err(), "the READ cannot succeed: the connection was torn down");
    assert!(all(buf.as_slice(), UNTOUCHED), "no byte of the buffer may change");
    assert_ne!(d.rkey, 0);
}

#[test]
fn a_write_after_the_response_fails_and_changes_nothing() {
    let (go_tx, go_rx) = mpsc::channel::<()>();
    let (url, target) = fake_target(move |t| {
        let cmd = next_io(t);
        let d = desc(&cmd);
        let legit = t.rdma_write(d.remote_addr, d.rkey, &[DATA; 4096]);
        t.respond(cmd.command_id, Status::Success, &[]);
        go_rx.recv_timeout(WAIT).expect("the test says when the initiator has the completion");
        let late = t.rdma_write(d.remote_addr, d.rkey, &[EVIL; 4096]);
        (legit, late)
    });
    let (_s, vol, mut q, buf) = connect(&url);
    let (result, buf) = read(&mut q, &vol, buf, 0);
    result.expect("the READ itself succeeds");
    assert!(all(&buf.as_slice()[..4096], DATA) && all(&buf.as_slice()[4096..], UNTOUCHED));
    go_tx.send(()).unwrap();
    let (legit, late) = target.join().unwrap();
    assert_eq!(legit, WcStatus::Success);
    assert_eq!(late, WcStatus::RemoteAccessError, "the window died with the response");
    assert!(all(&buf.as_slice()[..4096], DATA), "the late write changed the completed READ's data");
    assert!(all(&buf.as_slice()[4096..], UNTOUCHED));
}

#[test]
fn a_write_with_an_earlier_commands_key_fails_and_changes_nothing() {
    let (url, target) = fake_target(|t| {
        let first = next_io(t);
        let d1 = desc(&first);
        let legit = t.rdma_write(d1.remote_addr, d1.rkey, &[DATA; 4096]);
        t.respond(first.command_id, Status::Success, &[]);
        let second = next_io(t);
        let d2 = desc(&second);
        // The first command's key, into the first command's bytes.
        let old = t.rdma_write(d1.remote_addr, d1.rkey, &[EVIL; 4096]);
        (legit, old, d1.rkey != d2.rkey)
    });
    let (_s, vol, mut q, buf) = connect(&url);
    let (first, buf) = read(&mut q, &vol, buf, 0);
    first.expect("the first READ succeeds");
    let (second, buf) = read(&mut q, &vol, buf, 4096);
    let (legit, old, fresh_key) = target.join().unwrap();
    assert_eq!(legit, WcStatus::Success);
    assert!(fresh_key, "every command gets a fresh key");
    assert_eq!(old, WcStatus::RemoteAccessError, "an earlier command's key must be dead");
    assert!(second.is_err(), "the second READ cannot succeed: the connection was torn down");
    assert!(all(&buf.as_slice()[..4096], DATA) && all(&buf.as_slice()[4096..], UNTOUCHED));
}
