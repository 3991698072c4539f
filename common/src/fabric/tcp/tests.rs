//! Unit tests of the tcp provider internals: the frame decoder, and live
//! sockets driven by a hand-written peer that misbehaves.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use proptest::prelude::*;

use super::listener::TcpListener;
use super::wire::{self, decode_hello_body, encode_hello, seq_le, seq_next, DecodeError, FrameType, Header, HDR_LEN};
use super::{TcpCq, TcpFabric, TcpMr, TcpPd, TcpQp, TcpWindow};
use crate::fabric::{
    Access, AlignedBuf, Completion, FabricErrorKind, FabricOptions, FabricUrl, Payload, QpCaps, QpState, RecvWr, Rkey,
    SendOp, SendWr, WcOpcode, WcStatus, WrId,
};

// ------------------------------------------------------------- decoder --

fn sample() -> Header {
    Header {
        ty: FrameType::Write,
        flags: wire::FLAG_ACK_REQUESTED,
        seq: 0x0102_0304,
        ack: 0x0506_0708,
        length: 4096,
        remote_addr: 0x1122_3344_5566_7788,
        rkey: 0xdead_beef,
        aux: 0x99,
    }
}

#[test]
fn header_roundtrip_and_layout() {
    let h = sample();
    let b = h.encode();
    assert_eq!(b.len(), HDR_LEN);
    assert_eq!(b[0], FrameType::Write as u8);
    assert_eq!(b[1], 1);
    assert_eq!(&b[2..4], &[0, 0]);
    assert_eq!(&b[4..8], &0x0102_0304u32.to_le_bytes());
    assert_eq!(&b[12..16], &4096u32.to_le_bytes());
    assert_eq!(&b[16..24], &0x1122_3344_5566_7788u64.to_le_bytes());
    assert_eq!(&b[28..32], &0x99u32.to_le_bytes());
    assert_eq!(Header::decode(&b), Ok(h));
}

#[test]
fn decoder_refuses_malformed_headers() {
    let good = sample().encode();
    let with = |f: &dyn Fn(&mut [u8; HDR_LEN])| {
        let mut b = good;
        f(&mut b);
        Header::decode(&b)
    };
    for t in [0u8, 10, 0x7f, 0xff] {
        assert_eq!(with(&|b| b[0] = t), Err(DecodeError::UnknownType(t)));
    }
    assert_eq!(with(&|b| b[1] = 0x82), Err(DecodeError::UnknownFlags(0x82)));
    assert_eq!(with(&|b| b[3] = 1), Err(DecodeError::ReservedNotZero(0x100)));
    assert_eq!(
        with(&|b| b[12..16].copy_from_slice(&u32::MAX.to_le_bytes())),
        Err(DecodeError::TooLong(u32::MAX))
    );
    assert_eq!(
        with(&|b| b[12..16].copy_from_slice(&(wire::MAX_PAYLOAD + 1).to_le_bytes())),
        Err(DecodeError::TooLong(wire::MAX_PAYLOAD + 1))
    );
    for t in [FrameType::Ack, FrameType::Terminate, FrameType::Disconnect, FrameType::ReadReq] {
        assert_eq!(with(&|b| b[0] = t as u8), Err(DecodeError::UnexpectedPayload(t, 4096)));
    }
    let read_req = |aux: u32| {
        with(&|b| {
            b[0] = FrameType::ReadReq as u8;
            b[12..16].copy_from_slice(&0u32.to_le_bytes());
            b[28..32].copy_from_slice(&aux.to_le_bytes());
        })
    };
    assert!(read_req(wire::MAX_PAYLOAD).is_ok());
    assert_eq!(read_req(wire::MAX_PAYLOAD + 1), Err(DecodeError::BadReadLength(wire::MAX_PAYLOAD + 1)));
    for (len, ok) in [(0u32, false), (31, false), (32, true), (288, true), (289, false)] {
        let r = with(&|b| {
            b[0] = FrameType::Hello as u8;
            b[12..16].copy_from_slice(&len.to_le_bytes());
        });
        assert_eq!(r.is_ok(), ok, "hello of {len} bytes: {r:?}");
    }
}

proptest! {
    #[test]
    fn decoder_never_panics(bytes in proptest::array::uniform32(any::<u8>())) {
        if let Ok(h) = Header::decode(&bytes) {
            prop_assert_eq!(h.encode(), bytes);
            prop_assert!(h.length <= wire::MAX_PAYLOAD);
        }
    }

    #[test]
    fn hello_decoder_never_panics(body in proptest::collection::vec(any::<u8>(), 0..400)) {
        let _ = decode_hello_body(&body);
    }
}

#[test]
fn hello_roundtrip_and_validation() {
    let caps = QpCaps { max_send_wr: 1, max_recv_wr: 2, max_send_sge: 3, max_recv_sge: 4, max_inline_data: 5 };
    let f = encode_hello(FrameType::HelloReply, wire::STATUS_REJECT, &caps, b"why not");
    let bytes = f.as_bytes();
    let mut raw = [0u8; HDR_LEN];
    raw.copy_from_slice(&bytes[..HDR_LEN]);
    let h = Header::decode(&raw).unwrap();
    assert_eq!(h.ty, FrameType::HelloReply);
    assert_eq!(h.length as usize, bytes.len() - HDR_LEN);
    let body = decode_hello_body(&bytes[HDR_LEN..]).unwrap();
    assert_eq!(body.status, wire::STATUS_REJECT);
    assert_eq!(body.caps, caps);
    assert_eq!(body.private, b"why not");

    let good = bytes[HDR_LEN..].to_vec();
    let broken = |f: &dyn Fn(&mut Vec<u8>)| {
        let mut b = good.clone();
        f(&mut b);
        decode_hello_body(&b).is_err()
    };
    assert!(broken(&|b| b[0] ^= 1), "bad magic");
    assert!(broken(&|b| b[4] = 9), "bad version");
    assert!(broken(&|b| b[6] = 200), "private length beyond the body");
    assert!(broken(&|b| b.truncate(20)), "short body");
    assert!(broken(&|b| b[8] = 7), "unknown status");
    assert!(broken(&|b| b.push(0)), "trailing byte");
    // Private data is capped at 256 bytes.
    let long = encode_hello(FrameType::Hello, 0, &caps, &[7u8; 300]);
    assert_eq!(decode_hello_body(&long.as_bytes()[HDR_LEN..]).unwrap().private.len(), wire::MAX_PRIVATE_DATA);
}

#[test]
fn serial_numbers_wrap_and_skip_zero() {
    assert_eq!(seq_next(1), 2);
    assert_eq!(seq_next(u32::MAX), 1);
    assert!(seq_le(5, 5));
    assert!(seq_le(u32::MAX - 2, 3));
    assert!(!seq_le(3, u32::MAX - 2));
    assert!(seq_le(0, 0));
}

// ------------------------------------------------------- live helpers --

const DEADLINE: Duration = Duration::from_secs(20);

fn url() -> FabricUrl {
    FabricUrl::parse("tcp://127.0.0.1:0").unwrap()
}

struct Mem {
    mr: TcpMr,
    buf: AlignedBuf,
}

fn mem(pd: &TcpPd, len: usize, access: Access) -> Mem {
    let buf = AlignedBuf::new(len, 4096);
    // SAFETY: the region (first field) drops before the buffer.
    let mr = unsafe { pd.register(buf.as_ptr(), len, access) }.unwrap();
    Mem { mr, buf }
}

fn poll_until(cq: &TcpCq, comps: &mut Vec<Completion>, what: &str, mut pred: impl FnMut(&[Completion]) -> bool) {
    let deadline = Instant::now() + DEADLINE;
    loop {
        let mut out = [Completion::EMPTY; 16];
        let n = cq.poll(&mut out).unwrap();
        comps.extend_from_slice(&out[..n]);
        if pred(comps) {
            return;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}: {comps:?}");
        std::thread::sleep(Duration::from_millis(1));
    }
}

fn status_of(comps: &[Completion], wr: u64) -> Option<WcStatus> {
    comps.iter().find(|c| c.wr_id == WrId(wr)).map(|c| c.status)
}

fn read_frame(s: &mut TcpStream) -> (Header, Vec<u8>) {
    let mut raw = [0u8; HDR_LEN];
    s.read_exact(&mut raw).expect("frame header");
    let h = Header::decode(&raw).expect("valid header");
    let mut body = vec![0u8; h.length as usize];
    s.read_exact(&mut body).expect("frame payload");
    (h, body)
}

/// Reads frames until one of type `ty` arrives.
fn read_until(s: &mut TcpStream, ty: FrameType) -> Header {
    loop {
        let (h, _) = read_frame(s);
        if h.ty == ty {
            return h;
        }
    }
}

fn expect_eof(s: &mut TcpStream) {
    let mut b = [0u8; 256];
    loop {
        match s.read(&mut b) {
            Ok(0) => return,
            Ok(_) => continue,
            Err(e) => panic!("expected EOF, got {e}"),
        }
    }
}

/// Waits for the listener to close `s`, calling `poll_request` meanwhile as
/// its owner would (each call does the work that is due: a loaded machine
/// may leave part of it to the next call). Nothing may be accepted.
fn expect_eof_while_polling(listener: &TcpListener, s: &mut TcpStream) {
    s.set_read_timeout(Some(Duration::from_millis(10))).unwrap();
    let deadline = Instant::now() + DEADLINE;
    let mut b = [0u8; 256];
    loop {
        assert!(listener.poll_request().unwrap().is_none(), "a bad client was accepted");
        match s.read(&mut b) {
            Ok(0) => break,
            Ok(_) => {}
            Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {}
            Err(e) => panic!("expected EOF, got {e}"),
        }
        assert!(Instant::now() < deadline, "the listener did not close the connection within {DEADLINE:?}");
    }
    s.set_read_timeout(Some(DEADLINE)).unwrap();
}

/// Our listener and a hand-written client that completed the hello: the
/// server QP has one receive posted and is accepted.
struct PassiveRig {
    _fabric: TcpFabric,
    pd: TcpPd,
    cq: TcpCq,
    _listener: TcpListener,
    qp: TcpQp,
    raw: TcpStream,
    _rx: Mem,
}

fn passive_rig() -> PassiveRig {
    passive_rig_with(FabricOptions::default())
}

/// [`passive_rig`] with queue pairs that follow `options`.
fn passive_rig_with(options: FabricOptions) -> PassiveRig {
    let fabric = TcpFabric::open_with(&url(), options).unwrap();
    let pd = fabric.alloc_pd().unwrap();
    let cq = fabric.create_cq(64).unwrap();
    let listener = fabric.listen().unwrap();
    let (qp, raw, rx) = accept_raw(&listener, &pd, &cq);
    PassiveRig { _fabric: fabric, pd, cq, _listener: listener, qp, raw, _rx: rx }
}

/// A raw client connected to `listener`, accepted as a queue pair on
/// `pd`/`cq` with one 64-byte receive posted (wr_id 100).
fn accept_raw(listener: &TcpListener, pd: &TcpPd, cq: &TcpCq) -> (TcpQp, TcpStream, Mem) {
    let mut raw = TcpStream::connect(listener.local_url().host_port()).unwrap();
    raw.set_read_timeout(Some(DEADLINE)).unwrap();
    raw.write_all(encode_hello(FrameType::Hello, 0, &QpCaps::default(), b"raw client").as_bytes()).unwrap();
    let deadline = Instant::now() + DEADLINE;
    let req = loop {
        if let Some(r) = listener.poll_request().unwrap() {
            break r;
        }
        assert!(Instant::now() < deadline);
        std::thread::sleep(Duration::from_millis(1));
    };
    assert_eq!(req.private_data(), b"raw client");
    let qp = req.into_queue_pair(pd, cq, QpCaps::default()).unwrap();
    let rx = mem(pd, 4096, Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ);
    qp.post_recv(&[RecvWr { wr_id: WrId(100), sges: &[rx.mr_sge(0, 64)] }]).unwrap();
    qp.accept(b"ok").unwrap();
    let (h, body) = read_frame(&mut raw);
    assert_eq!(h.ty, FrameType::HelloReply);
    let reply = decode_hello_body(&body).unwrap();
    assert_eq!(reply.status, wire::STATUS_ACCEPT);
    assert_eq!(reply.private, b"ok");
    (qp, raw, rx)
}

impl Mem {
    fn mr_sge(&self, off: usize, len: u32) -> crate::fabric::Sge {
        crate::fabric::Sge { addr: self.mr.addr() + off as u64, length: len, lkey: self.mr.lkey() }
    }
}

/// Feeds `bytes` to an accepted passive QP and checks it errors, flushes its
/// receive and answers with TERMINATE; returns that TERMINATE.
fn feed_passive(bytes: &[u8]) -> Header {
    let mut rig = passive_rig();
    rig.raw.write_all(bytes).unwrap();
    let mut comps = Vec::new();
    let qp = &rig.qp;
    poll_until(&rig.cq, &mut comps, "error after bad input", |c| {
        qp.state() == QpState::Error && status_of(c, 100).is_some()
    });
    assert_eq!(status_of(&comps, 100), Some(WcStatus::WrFlushError));
    let t = read_until(&mut rig.raw, FrameType::Terminate);
    // The provider shuts its write side after TERMINATE, then drains.
    expect_eof(&mut rig.raw);
    drop(rig.raw);
    // With the peer gone, the socket leaves the epoll set: the CQ goes idle.
    let deadline = Instant::now() + DEADLINE;
    loop {
        let mut out = [Completion::EMPTY; 4];
        assert_eq!(rig.cq.poll(&mut out).unwrap(), 0);
        let mut pfd = libc::pollfd { fd: rig.cq.fd(), events: libc::POLLIN, revents: 0 };
        // SAFETY: valid pollfd for the call.
        if unsafe { libc::poll(&mut pfd, 1, 10) } == 0 {
            break;
        }
        assert!(Instant::now() < deadline, "CQ fd stays readable after the peer left");
    }
    let _ = &rig.pd;
    t
}

// ---------------------------------------------------------- live tests --

#[test]
fn garbage_after_handshake_terminates_the_qp() {
    let t = feed_passive(&[0xEE; 64]);
    assert_eq!(t.aux, wire::TERM_INVALID_REQUEST);
    assert_eq!(t.seq, 0);
}

#[test]
fn absurd_length_terminates_without_allocating() {
    let mut h = Header::new(FrameType::Send);
    h.seq = 1;
    let mut b = h.encode();
    b[12..16].copy_from_slice(&0xFFFF_FFF0u32.to_le_bytes());
    let t = feed_passive(&b);
    assert_eq!(t.aux, wire::TERM_INVALID_REQUEST);
}

#[test]
fn nonzero_reserved_terminates() {
    let mut b = Header { seq: 1, ..Header::new(FrameType::Ack) }.encode();
    b[2] = 1;
    assert_eq!(feed_passive(&b).aux, wire::TERM_INVALID_REQUEST);
}

#[test]
fn out_of_order_seq_terminates() {
    let h = Header { seq: 5, length: 0, ..Header::new(FrameType::Send) };
    let t = feed_passive(&h.encode());
    assert_eq!(t.aux, wire::TERM_INVALID_REQUEST);
    assert_eq!(t.seq, 5);
}

#[test]
fn ack_of_unsent_seq_terminates() {
    let h = Header { ack: 3, ..Header::new(FrameType::Ack) };
    assert_eq!(feed_passive(&h.encode()).aux, wire::TERM_INVALID_REQUEST);
}

#[test]
fn hello_after_handshake_terminates() {
    let f = encode_hello(FrameType::Hello, 0, &QpCaps::default(), b"again");
    assert_eq!(feed_passive(f.as_bytes()).aux, wire::TERM_INVALID_REQUEST);
}

#[test]
fn unsolicited_read_response_terminates() {
    let h = Header { length: 8, aux: 1, ..Header::new(FrameType::ReadResp) };
    let mut b = h.encode().to_vec();
    b.extend_from_slice(&[1; 8]);
    assert_eq!(feed_passive(&b).aux, wire::TERM_INVALID_REQUEST);
}

#[test]
fn huge_write_with_bad_rkey_is_refused_before_payload() {
    // 1 GiB announced, no payload sent: the rkey check must not wait for it.
    let h = Header { seq: 1, length: wire::MAX_PAYLOAD, rkey: 12345, remote_addr: 0x1000, ..Header::new(FrameType::Write) };
    let t = feed_passive(&h.encode());
    assert_eq!(t.aux, wire::TERM_REMOTE_ACCESS);
    assert_eq!(t.seq, 1);
}

#[test]
fn partial_frames_are_reassembled() {
    // A valid zero-length SEND dribbled in byte by byte completes the receive.
    let mut rig = passive_rig();
    let h = ack_requested_send(1);
    let mut comps = Vec::new();
    for b in h {
        rig.raw.write_all(&[b]).unwrap();
        std::thread::sleep(Duration::from_millis(1));
        let mut out = [Completion::EMPTY; 4];
        let n = rig.cq.poll(&mut out).unwrap();
        comps.extend_from_slice(&out[..n]);
    }
    poll_until(&rig.cq, &mut comps, "the receive", |c| status_of(c, 100).is_some());
    assert_eq!(status_of(&comps, 100), Some(WcStatus::Success));
    // The requested acknowledgement arrives as a standalone ACK.
    let a = read_until(&mut rig.raw, FrameType::Ack);
    assert_eq!(a.ack, 1);
    assert_eq!(rig.qp.state(), QpState::Ready);
}

/// A SEND frame that asks for an acknowledgement.
fn ack_requested_send(seq: u32) -> [u8; HDR_LEN] {
    Header { seq, flags: wire::FLAG_ACK_REQUESTED, ..Header::new(FrameType::Send) }.encode()
}

/// A passive rig whose CQ holds ACKs back for `hold`, after it received
/// SEND 1, which asks for one (into receive 100).
fn rig_holding_an_ack(hold: Duration) -> PassiveRig {
    let mut rig = passive_rig();
    rig.cq.set_ack_coalescing(Some(hold));
    rig.raw.write_all(&ack_requested_send(1)).unwrap();
    poll_until(&rig.cq, &mut Vec::new(), "the receive", |c| status_of(c, 100).is_some());
    rig
}

/// A hold no test run outlives: only an answer, arm or turning coalescing
/// off can release the ACK.
const FOREVER: Duration = Duration::from_secs(3600);

#[test]
fn a_held_ack_rides_on_the_answer_across_polls() {
    let mut rig = rig_holding_an_ack(FOREVER);
    let tx = mem(&rig.pd, 4096, Access::LOCAL_WRITE);

    // A SEND the application answers only after several more polls, and
    // after it armed the CQ (to sleep while the answer is at the disk): no
    // standalone ACK precedes the answer, which carries the ack.
    for _ in 0..5 {
        let mut out = [Completion::EMPTY; 4];
        rig.cq.poll(&mut out).unwrap();
        std::thread::sleep(Duration::from_millis(1));
    }
    rig.cq.arm().unwrap();
    rig.qp
        .post_send(&[SendWr { wr_id: WrId(1), op: SendOp::Send, payload: Payload::Sges(&[tx.mr_sge(0, 8)]), signaled: true }])
        .unwrap();
    let (h, body) = read_frame(&mut rig.raw);
    assert_eq!((h.ty, h.ack, body.len()), (FrameType::Send, 1, 8), "the answer comes first and carries the ack");
}

/// Whether `fd` becomes readable within `timeout`.
fn readable_within(fd: std::os::fd::RawFd, timeout: Duration) -> bool {
    let mut pfd = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
    // SAFETY: `pfd` is a valid pollfd for the duration of the call.
    let rc = unsafe { libc::poll(&mut pfd, 1, timeout.as_millis() as i32) };
    rc == 1
}

#[test]
fn an_armed_cq_wakes_its_owner_when_the_hold_ends_and_the_ack_leaves() {
    // A SEND the application does not answer, and an owner that arms the
    // CQ and sleeps on its channel: the channel becomes readable when the
    // hold ends (not at arm, which would send an ACK frame for every
    // command that waits for the disk), and the owner's poll then sends it.
    let hold = Duration::from_millis(300);
    let mut rig = rig_holding_an_ack(hold);
    let held_since = Instant::now();
    rig.cq.arm().unwrap();
    rig.raw.set_read_timeout(Some(Duration::from_millis(50))).unwrap();
    let mut byte = [0u8; 1];
    assert!(rig.raw.read(&mut byte).is_err(), "nothing is sent at arm, within the hold");
    assert!(readable_within(rig.cq.fd(), Duration::from_secs(5)), "the channel fires when the hold ends");
    assert!(held_since.elapsed() >= hold - Duration::from_millis(60), "not before the hold ends: {:?}", held_since.elapsed());
    rig.cq.ack_event().unwrap();
    let mut out = [Completion::EMPTY; 4];
    rig.cq.poll(&mut out).unwrap();
    rig.raw.set_read_timeout(None).unwrap();
    let a = read_until(&mut rig.raw, FrameType::Ack);
    assert_eq!(a.ack, 1);
    assert_eq!(rig.qp.state(), QpState::Ready);
}

#[test]
fn an_ack_the_answer_carried_sets_no_timer() {
    // The answer carried the ack before the owner armed: the channel stays
    // quiet (no wake-up for an ACK nobody owes).
    let mut rig = rig_holding_an_ack(Duration::from_millis(20));
    let tx = mem(&rig.pd, 4096, Access::LOCAL_WRITE);
    rig.qp
        .post_send(&[SendWr { wr_id: WrId(1), op: SendOp::Send, payload: Payload::Sges(&[tx.mr_sge(0, 8)]), signaled: true }])
        .unwrap();
    let (h, _) = read_frame(&mut rig.raw);
    assert_eq!((h.ty, h.ack), (FrameType::Send, 1));
    rig.cq.arm().unwrap();
    assert!(!readable_within(rig.cq.fd(), Duration::from_millis(200)), "no wake-up for a carried ACK");
}

#[test]
fn a_held_ack_leaves_at_the_first_poll_after_the_hold() {
    let mut rig = rig_holding_an_ack(Duration::from_millis(2));
    std::thread::sleep(Duration::from_millis(10));
    let mut out = [Completion::EMPTY; 4];
    rig.cq.poll(&mut out).unwrap();
    let a = read_until(&mut rig.raw, FrameType::Ack);
    assert_eq!(a.ack, 1);
}

#[test]
fn turning_coalescing_off_releases_the_held_acks() {
    let mut rig = rig_holding_an_ack(FOREVER);
    rig.cq.set_ack_coalescing(None);
    let a = read_until(&mut rig.raw, FrameType::Ack);
    assert_eq!(a.ack, 1);
}

#[test]
fn a_chain_leaves_in_order_with_every_frame_whole() {
    // The frames of one post_send call are batched into one sendmsg; the
    // peer must still see each frame whole and in posting order.
    let mut rig = passive_rig();
    let tx = mem(&rig.pd, 8192, Access::LOCAL_WRITE);
    let sges: Vec<_> = (0..40u32).map(|i| tx.mr_sge(i as usize * 8, (i % 5) * 16)).collect();
    let wrs: Vec<SendWr<'_>> = (0..40u64)
        .map(|i| SendWr {
            wr_id: WrId(i),
            op: if i % 2 == 0 {
                SendOp::RdmaWrite { remote_addr: 0x1000 + i, rkey: crate::fabric::Rkey(7) }
            } else {
                SendOp::Send
            },
            payload: Payload::Sges(std::slice::from_ref(&sges[i as usize])),
            signaled: i == 39,
        })
        .collect();
    rig.qp.post_send(&wrs).unwrap();
    for i in 0..40u64 {
        let (h, body) = read_frame(&mut rig.raw);
        assert_eq!(h.seq, i as u32 + 1);
        assert_eq!(h.ty, if i % 2 == 0 { FrameType::Write } else { FrameType::Send });
        assert_eq!(body.len() as u64, (i % 5) * 16);
    }
}

#[test]
fn active_qp_fed_garbage_errors() {
    let raw_listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = raw_listener.local_addr().unwrap().port();
    let fabric = TcpFabric::open(&FabricUrl::parse(&format!("tcp://127.0.0.1:{port}")).unwrap()).unwrap();
    let pd = fabric.alloc_pd().unwrap();
    let cq = fabric.create_cq(16).unwrap();
    let qp = fabric.create_qp(&pd, &cq, QpCaps::default()).unwrap();
    let rx = mem(&pd, 4096, Access::LOCAL_WRITE);
    qp.post_recv(&[RecvWr { wr_id: WrId(7), sges: &[rx.mr_sge(0, 64)] }]).unwrap();
    let server = std::thread::spawn(move || {
        let (mut s, _) = raw_listener.accept().unwrap();
        let (h, body) = read_frame(&mut s);
        assert_eq!(h.ty, FrameType::Hello);
        assert_eq!(decode_hello_body(&body).unwrap().private, b"hi");
        s.write_all(encode_hello(FrameType::HelloReply, 0, &QpCaps::default(), b"yo").as_bytes()).unwrap();
        s.write_all(&[0x42; 100]).unwrap();
        s
    });
    assert_eq!(qp.connect(b"hi", DEADLINE).unwrap(), b"yo");
    let mut s = server.join().unwrap();
    let mut comps = Vec::new();
    poll_until(&cq, &mut comps, "error", |c| qp.state() == QpState::Error && status_of(c, 7).is_some());
    assert_eq!(status_of(&comps, 7), Some(WcStatus::WrFlushError));
    s.set_read_timeout(Some(DEADLINE)).unwrap();
    assert_eq!(read_until(&mut s, FrameType::Terminate).aux, wire::TERM_INVALID_REQUEST);
}

#[test]
fn active_connect_bad_reply_and_silence() {
    // A reply that is not a hello reply.
    let raw_listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = raw_listener.local_addr().unwrap().port();
    let fabric = TcpFabric::open(&FabricUrl::parse(&format!("tcp://127.0.0.1:{port}")).unwrap()).unwrap();
    let pd = fabric.alloc_pd().unwrap();
    let cq = fabric.create_cq(16).unwrap();
    let server = std::thread::spawn(move || {
        let (mut s, _) = raw_listener.accept().unwrap();
        s.write_all(&[0xAB; 64]).unwrap();
        let (silent, _) = raw_listener.accept().unwrap();
        (s, silent)
    });
    let qp = fabric.create_qp(&pd, &cq, QpCaps::default()).unwrap();
    let e = qp.connect(b"", DEADLINE).unwrap_err();
    assert_eq!(e.kind, FabricErrorKind::ConnectFailed, "{e}");
    // A peer that never answers: the timeout holds.
    let qp = fabric.create_qp(&pd, &cq, QpCaps::default()).unwrap();
    let t0 = Instant::now();
    let e = qp.connect(b"", Duration::from_millis(300)).unwrap_err();
    assert_eq!(e.kind, FabricErrorKind::Timeout, "{e}");
    assert!(t0.elapsed() < Duration::from_secs(5));
    let _ = server.join().unwrap();
    // A QP can connect only once.
    let e = qp.connect(b"", DEADLINE).unwrap_err();
    assert_eq!(e.kind, FabricErrorKind::InvalidState, "{e}");
}

#[test]
fn peer_eof_gives_transport_error() {
    let raw_listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = raw_listener.local_addr().unwrap().port();
    let fabric = TcpFabric::open(&FabricUrl::parse(&format!("tcp://127.0.0.1:{port}")).unwrap()).unwrap();
    let pd = fabric.alloc_pd().unwrap();
    let cq = fabric.create_cq(16).unwrap();
    let qp = fabric.create_qp(&pd, &cq, QpCaps::default()).unwrap();
    let buf = mem(&pd, 4096, Access::LOCAL_WRITE);
    qp.post_recv(&[RecvWr { wr_id: WrId(9), sges: &[buf.mr_sge(0, 64)] }]).unwrap();
    let server = std::thread::spawn(move || {
        let (mut s, _) = raw_listener.accept().unwrap();
        let _ = read_frame(&mut s);
        s.write_all(encode_hello(FrameType::HelloReply, 0, &QpCaps::default(), b"").as_bytes()).unwrap();
        s
    });
    qp.connect(b"", DEADLINE).unwrap();
    let s = server.join().unwrap();
    let sge = [buf.mr_sge(0, 16)];
    let wr = |id: u64| SendWr { wr_id: WrId(id), op: SendOp::Send, payload: Payload::Sges(&sge), signaled: true };
    qp.post_send(&[wr(1), wr(2)]).unwrap();
    drop(s); // EOF (or RST) without a word
    let mut comps = Vec::new();
    poll_until(&cq, &mut comps, "transport error", |c| c.len() == 3);
    assert_eq!(status_of(&comps, 1), Some(WcStatus::TransportError));
    assert_eq!(status_of(&comps, 2), Some(WcStatus::WrFlushError));
    assert_eq!(status_of(&comps, 9), Some(WcStatus::WrFlushError));
    assert_eq!(comps.iter().find(|c| c.wr_id == WrId(1)).unwrap().opcode, WcOpcode::Send);
    assert_eq!(qp.state(), QpState::Error);
}

#[test]
fn listener_is_not_blocked_by_bad_or_silent_clients() {
    let fabric = TcpFabric::open(&url()).unwrap();
    let pd = fabric.alloc_pd().unwrap();
    let cq = fabric.create_cq(16).unwrap();
    let listener = TcpListener::bind(&url(), Duration::from_millis(300), FabricOptions::default()).unwrap();
    let addr = listener.local_url().host_port();
    let mut silent = TcpStream::connect(&addr).unwrap();
    let mut garbage = TcpStream::connect(&addr).unwrap();
    garbage.write_all(&[0x99; 32]).unwrap();
    let mut huge = TcpStream::connect(&addr).unwrap();
    huge.write_all(&Header { length: 100_000, ..Header::new(FrameType::Hello) }.encode()).unwrap();
    let mut half = TcpStream::connect(&addr).unwrap();
    half.write_all(&encode_hello(FrameType::Hello, 0, &QpCaps::default(), b"x").as_bytes()[..40]).unwrap();
    for s in [&silent, &garbage, &huge, &half] {
        s.set_read_timeout(Some(DEADLINE)).unwrap();
    }
    std::thread::sleep(Duration::from_millis(50));
    let t0 = Instant::now();
    assert!(listener.poll_request().unwrap().is_none());
    assert!(t0.elapsed() < Duration::from_millis(100), "poll_request blocked");
    expect_eof_while_polling(&listener, &mut garbage);
    expect_eof_while_polling(&listener, &mut huge);

    // A well-behaved client still gets through.
    let client_fabric = TcpFabric::open(&listener.local_url()).unwrap();
    let cpd = client_fabric.alloc_pd().unwrap();
    let ccq = client_fabric.create_cq(16).unwrap();
    let cqp = client_fabric.create_qp(&cpd, &ccq, QpCaps::default()).unwrap();
    let connecting = std::thread::spawn(move || {
        let r = cqp.connect(b"good", DEADLINE);
        (cqp, r)
    });
    let deadline = Instant::now() + DEADLINE;
    let req = loop {
        if let Some(r) = listener.poll_request().unwrap() {
            break r;
        }
        assert!(Instant::now() < deadline);
        std::thread::sleep(Duration::from_millis(1));
    };
    assert_eq!(req.private_data(), b"good");
    let qp = req.into_queue_pair(&pd, &cq, QpCaps::default()).unwrap();
    qp.accept(b"").unwrap();
    let (_cqp, r) = connecting.join().unwrap();
    r.unwrap();

    // The slow ones expire; the listener's timer wakes the caller for it.
    let mut pfd = libc::pollfd { fd: listener.fd(), events: libc::POLLIN, revents: 0 };
    // SAFETY: valid pollfd for the call.
    assert_eq!(unsafe { libc::poll(&mut pfd, 1, 5000) }, 1, "listener fd did not wake for the deadline");
    assert!(listener.poll_request().unwrap().is_none());
    expect_eof_while_polling(&listener, &mut silent);
    expect_eof_while_polling(&listener, &mut half);
    // Nothing left to do: the fd is quiet.
    // SAFETY: as above.
    assert_eq!(unsafe { libc::poll(&mut pfd, 1, 50) }, 0, "idle listener fd is readable");
}

#[test]
fn backlog_is_flushed_by_later_polls() {
    // Post far more than the socket buffers hold; the peer polls later.
    let fabric = TcpFabric::open(&url()).unwrap();
    let listener = fabric.listen().unwrap();
    let spd = fabric.alloc_pd().unwrap();
    let scq = fabric.create_cq(64).unwrap();
    let cfab = TcpFabric::open(&listener.local_url()).unwrap();
    let cpd = cfab.alloc_pd().unwrap();
    let ccq = cfab.create_cq(64).unwrap();
    let cqp = cfab.create_qp(&cpd, &ccq, QpCaps::default()).unwrap();
    let connecting = std::thread::spawn(move || {
        let r = cqp.connect(b"", DEADLINE);
        (cqp, r)
    });
    let req = loop {
        if let Some(r) = listener.poll_request().unwrap() {
            break r;
        }
        std::thread::sleep(Duration::from_millis(1));
    };
    let sqp = req.into_queue_pair(&spd, &scq, QpCaps::default()).unwrap();
    sqp.accept(b"").unwrap();
    let (cqp, r) = connecting.join().unwrap();
    r.unwrap();
    const LEN: usize = 8 << 20;
    let remote = mem(&spd, LEN, Access::LOCAL_WRITE | Access::REMOTE_WRITE);
    let local = mem(&cpd, LEN, Access::LOCAL_WRITE);
    // SAFETY: nothing in flight yet.
    unsafe { local.buf.as_mut_slice() }.iter_mut().enumerate().for_each(|(i, b)| *b = (i % 251) as u8);
    let sge = [local.mr_sge(0, LEN as u32)];
    let wr = SendWr {
        wr_id: WrId(1),
        op: SendOp::RdmaWrite { remote_addr: remote.mr.addr(), rkey: remote.mr.rkey() },
        payload: Payload::Sges(&sge),
        signaled: true,
    };
    cqp.post_send(&[wr]).unwrap();
    // The local buffer may be reused at once: the rest sits in the backlog.
    // SAFETY: the provider copied what the socket did not take.
    unsafe { local.buf.as_mut_slice() }.fill(0);
    let (mut cc, mut sc) = (Vec::new(), Vec::new());
    let deadline = Instant::now() + DEADLINE;
    while status_of(&cc, 1).is_none() {
        let mut out = [Completion::EMPTY; 4];
        let n = scq.poll(&mut out).unwrap();
        sc.extend_from_slice(&out[..n]);
        let n = ccq.poll(&mut out).unwrap();
        cc.extend_from_slice(&out[..n]);
        assert!(Instant::now() < deadline, "8 MiB WRITE did not complete");
    }
    assert_eq!(status_of(&cc, 1), Some(WcStatus::Success));
    // SAFETY: the WRITE completed; nothing in flight.
    let got = unsafe { remote.buf.as_slice() };
    assert!(got.iter().enumerate().all(|(i, &b)| b == (i % 251) as u8), "payload differs");
    assert!(sc.is_empty());
    assert_eq!(sqp.state(), QpState::Ready);
}

#[test]
fn deregistration_waits_for_pins() {
    use super::mr::Pins;
    let pd = TcpPd::new();
    let buf = AlignedBuf::new(4096, 4096);
    let all = Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ;
    // SAFETY: `buf` outlives the region (joined below before it drops).
    let mr = unsafe { pd.register(buf.as_ptr(), 4096, all) }.unwrap();
    let (rkey, addr) = (mr.rkey().0, mr.addr());
    // A data-path snapshot taken before deregistration, and a pin on it.
    let snapshot = pd.shared().table.load_full();
    let region = snapshot.remote(rkey, addr, 16, Access::REMOTE_WRITE).unwrap();
    let mut pins = Pins::new();
    assert!(pins.pin(region));
    let (tx, rx) = std::sync::mpsc::channel();
    let dropper = std::thread::spawn(move || {
        drop(mr);
        tx.send(()).unwrap();
    });
    // The drop cannot return while the pin is held...
    assert!(rx.recv_timeout(Duration::from_millis(200)).is_err(), "deregistration ignored a pin");
    // ...but the region is already unreachable: new lookups miss it and a
    // stale snapshot cannot pin it any more.
    assert!(pd.shared().table.load().remote(rkey, addr, 16, Access::REMOTE_WRITE).is_none());
    let mut late = Pins::new();
    assert!(!late.pin(region), "pinned a region being deregistered");
    drop(pins);
    rx.recv_timeout(DEADLINE).expect("deregistration finished after the pin was released");
    dropper.join().unwrap();
}

#[test]
fn region_deregistered_mid_payload() {
    let mut rig = passive_rig();
    let target = AlignedBuf::new(8192, 4096);
    let all = Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ;
    // SAFETY: `target` outlives the region, dropped below.
    let mr = unsafe { rig.pd.register(target.as_ptr(), 8192, all) }.unwrap();
    let h = Header { seq: 1, length: 8192, rkey: mr.rkey().0, remote_addr: mr.addr(), ..Header::new(FrameType::Write) };
    rig.raw.write_all(&h.encode()).unwrap();
    rig.raw.write_all(&[0xAA; 4096]).unwrap();
    // Placement happens only inside poll, on this thread: between polls the
    // bytes can be read.
    let deadline = Instant::now() + DEADLINE;
    loop {
        let mut out = [Completion::EMPTY; 4];
        assert_eq!(rig.cq.poll(&mut out).unwrap(), 0);
        // SAFETY: no poll is running, so nothing writes the buffer.
        if unsafe { target.as_slice() }[4095] == 0xAA {
            break;
        }
        assert!(Instant::now() < deadline, "first half never placed");
        std::thread::sleep(Duration::from_millis(1));
    }
    drop(mr);
    // SAFETY: deregistered: the memory is ours alone.
    unsafe { target.as_mut_slice() }.fill(0x11);
    rig.raw.write_all(&[0xBB; 4096]).unwrap();
    let mut comps = Vec::new();
    let qp = &rig.qp;
    poll_until(&rig.cq, &mut comps, "error", |c| qp.state() == QpState::Error && status_of(c, 100).is_some());
    let t = read_until(&mut rig.raw, FrameType::Terminate);
    assert_eq!((t.aux, t.seq), (wire::TERM_REMOTE_ACCESS, 1));
    // SAFETY: as above.
    assert!(unsafe { target.as_slice() }.iter().all(|&b| b == 0x11), "memory touched after deregistration");
}

// The facade's thread-safety contract, checked at compile time.
const _: () = {
    const fn send<T: Send>() {}
    const fn send_sync<T: Send + Sync>() {}
    send::<crate::fabric::QueuePair>();
    send::<crate::fabric::CompletionQueue>();
    send::<crate::fabric::ConnectRequest>();
    send::<crate::fabric::Listener>();
    send_sync::<crate::fabric::Fabric>();
    send_sync::<crate::fabric::ProtectionDomain>();
    send_sync::<crate::fabric::MemoryRegion>();
};

/// A connected pair of tcp queue pairs: (client pd, cq, qp), (server pd, cq, qp).
struct Pair {
    cpd: TcpPd,
    ccq: TcpCq,
    cqp: TcpQp,
    spd: TcpPd,
    scq: TcpCq,
    sqp: TcpQp,
    _listener: TcpListener,
}

fn pair() -> Pair {
    pair_with(FabricOptions::default())
}

#[test]
fn read_destination_deregistered_before_the_response() {
    let p = pair();
    let remote = mem(&p.spd, 1 << 20, Access::LOCAL_WRITE | Access::REMOTE_READ);
    let local_buf = AlignedBuf::new(1 << 20, 4096);
    // SAFETY: `local_buf` outlives the region, dropped below.
    let local = unsafe { p.cpd.register(local_buf.as_ptr(), 1 << 20, Access::LOCAL_WRITE) }.unwrap();
    let sge = [crate::fabric::Sge { addr: local.addr(), length: 1 << 20, lkey: local.lkey() }];
    let op = SendOp::RdmaRead { remote_addr: remote.mr.addr(), rkey: remote.mr.rkey() };
    p.cqp.post_send(&[SendWr { wr_id: WrId(1), op, payload: Payload::Sges(&sge), signaled: true }]).unwrap();
    // Manual progress: the server has not served the READ yet.
    drop(local);
    // SAFETY: deregistered: the memory is ours alone.
    unsafe { local_buf.as_mut_slice() }.fill(0x5C);
    let (mut cc, mut sc) = (Vec::new(), Vec::new());
    let deadline = Instant::now() + DEADLINE;
    while status_of(&cc, 1).is_none() {
        let mut out = [Completion::EMPTY; 4];
        let n = p.scq.poll(&mut out).unwrap();
        sc.extend_from_slice(&out[..n]);
        let n = p.ccq.poll(&mut out).unwrap();
        cc.extend_from_slice(&out[..n]);
        assert!(Instant::now() < deadline, "{cc:?} {sc:?}");
    }
    assert_eq!(status_of(&cc, 1), Some(WcStatus::LocalProtectionError));
    assert_eq!(p.cqp.state(), QpState::Error);
    // A local fault: as on RC hardware the responder is not told.
    let end = Instant::now() + Duration::from_millis(50);
    while Instant::now() < end {
        let mut out = [Completion::EMPTY; 4];
        let n = p.scq.poll(&mut out).unwrap();
        sc.extend_from_slice(&out[..n]);
        let n = p.ccq.poll(&mut out).unwrap();
        cc.extend_from_slice(&out[..n]);
    }
    assert_eq!(p.sqp.state(), QpState::Ready, "{sc:?}");
    // SAFETY: the client QP is in error and the server served the READ; nothing is in flight.
    assert!(unsafe { local_buf.as_slice() }.iter().all(|&b| b == 0x5C), "READ placed into a dropped region");
}

#[test]
fn dropping_a_qp_detaches_and_closes() {
    let mut rig = passive_rig();
    let fd = rig.cq.fd();
    let qp = std::mem::replace(&mut rig.qp, {
        // A placeholder QP that never connects.
        let f = TcpFabric::open(&url()).unwrap();
        f.create_qp(&rig.pd, &rig.cq, QpCaps::default()).unwrap()
    });
    drop(qp);
    // The peer sees the close...
    expect_eof(&mut rig.raw);
    // ...and whatever it sends no longer wakes the CQ.
    let _ = rig.raw.write_all(&[0u8; 64]);
    let mut out = [Completion::EMPTY; 4];
    assert_eq!(rig.cq.poll(&mut out).unwrap(), 0, "a dropped QP produced completions");
    let mut pfd = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
    // SAFETY: valid pollfd for the call.
    assert_eq!(unsafe { libc::poll(&mut pfd, 1, 50) }, 0, "CQ fd readable after its only QP was dropped");
}

#[test]
fn many_outstanding_operations_complete_in_order() {
    // Mixed SEND/WRITE/READ traffic in both directions, signaled every
    // fourth WR, checks posting-order completion and slot accounting.
    let p = pair();
    let all = Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ;
    let cmem = mem(&p.cpd, 1 << 16, all);
    let smem = mem(&p.spd, 1 << 16, all);
    let rsges: Vec<[crate::fabric::Sge; 1]> = (0..64).map(|i| [smem.mr_sge(i * 256, 256)]).collect();
    for (i, s) in rsges.iter().enumerate() {
        p.sqp.post_recv(&[RecvWr { wr_id: WrId(1000 + i as u64), sges: s }]).unwrap();
    }
    let ssge = [cmem.mr_sge(0, 100)];
    let wsge = [cmem.mr_sge(4096, 4096)];
    let rsge = [cmem.mr_sge(8192, 4096)];
    let mut posted = 0u64;
    let mut sends = 0u64;
    let (mut cc, mut sc) = (Vec::<Completion>::new(), Vec::<Completion>::new());
    let deadline = Instant::now() + DEADLINE;
    while posted < 400 {
        let signaled = posted % 4 == 3;
        let (op, sges): (SendOp, &[crate::fabric::Sge]) = match posted % 3 {
            0 if sends < 64 => {
                sends += 1;
                (SendOp::Send, &ssge)
            }
            1 => (SendOp::RdmaRead { remote_addr: smem.mr.addr() + 16384, rkey: smem.mr.rkey() }, &rsge),
            _ => (SendOp::RdmaWrite { remote_addr: smem.mr.addr() + 32768, rkey: smem.mr.rkey() }, &wsge),
        };
        let wr = SendWr { wr_id: WrId(posted), op, payload: Payload::Sges(sges), signaled };
        match p.cqp.post_send(&[wr]) {
            Ok(()) => posted += 1,
            Err(e) => assert_eq!(e.kind, FabricErrorKind::QueueFull),
        }
        let mut out = [Completion::EMPTY; 16];
        let n = p.scq.poll(&mut out).unwrap();
        sc.extend_from_slice(&out[..n]);
        let n = p.ccq.poll(&mut out).unwrap();
        cc.extend_from_slice(&out[..n]);
        assert!(Instant::now() < deadline);
    }
    while cc.len() < 100 {
        let mut out = [Completion::EMPTY; 16];
        let n = p.scq.poll(&mut out).unwrap();
        sc.extend_from_slice(&out[..n]);
        let n = p.ccq.poll(&mut out).unwrap();
        cc.extend_from_slice(&out[..n]);
        assert!(Instant::now() < deadline, "{} of 100 completions", cc.len());
    }
    let ids: Vec<u64> = cc.iter().map(|c| c.wr_id.0).collect();
    assert_eq!(ids, (0..400).filter(|i| i % 4 == 3).collect::<Vec<_>>());
    assert!(cc.iter().all(|c| c.status == WcStatus::Success), "{cc:?}");
    assert!(sc.iter().all(|c| c.status == WcStatus::Success && c.byte_len == 100));
    assert_eq!(sc.len() as u64, sends);
    assert_eq!(p.cqp.state(), QpState::Ready);
    assert_eq!(p.sqp.state(), QpState::Ready);
}

// ------------------------------------------------------------ memory windows --

/// A rig whose peer-facing buffer is reachable only through windows: an
/// 8 KiB region registered LOCAL_WRITE | MW_BIND, filled with 0x11.
fn window_rig() -> (PassiveRig, Mem) {
    let rig = passive_rig();
    let target = mem(&rig.pd, 8192, Access::LOCAL_WRITE | Access::MW_BIND);
    // SAFETY: no poll runs; nothing else writes the buffer.
    unsafe { target.buf.as_mut_slice() }.fill(0x11);
    (rig, target)
}

/// Sends an RDMA WRITE of `len` bytes of 0xEE at `addr` under `rkey` and
/// returns the TERMINATE code it earned, or None if it was placed.
fn write_through(rig: &mut PassiveRig, seq: u32, rkey: u32, addr: u64, len: u32) -> Option<u32> {
    let h = Header { seq, flags: wire::FLAG_ACK_REQUESTED, length: len, rkey, remote_addr: addr, ..Header::new(FrameType::Write) };
    rig.raw.write_all(&h.encode()).unwrap();
    rig.raw.write_all(&vec![0xEE; len as usize]).unwrap();
    let mut comps = Vec::new();
    let deadline = Instant::now() + DEADLINE;
    loop {
        let mut out = [Completion::EMPTY; 4];
        let n = rig.cq.poll(&mut out).unwrap();
        comps.extend_from_slice(&out[..n]);
        if rig.qp.state() == QpState::Error {
            return Some(read_until(&mut rig.raw, FrameType::Terminate).aux);
        }
        // Placed and acknowledged: the provider acks what it processed.
        let mut probe = [0u8; HDR_LEN];
        rig.raw.set_nonblocking(true).unwrap();
        let got = rig.raw.peek(&mut probe);
        rig.raw.set_nonblocking(false).unwrap();
        if matches!(got, Ok(n) if n == HDR_LEN) {
            let (a, _) = read_frame(&mut rig.raw);
            if a.ty == FrameType::Ack && a.ack == seq {
                return None;
            }
        }
        assert!(Instant::now() < deadline, "WRITE neither placed nor refused");
        std::thread::sleep(Duration::from_millis(1));
    }
}

fn bytes_of(m: &Mem) -> Vec<u8> {
    // SAFETY: called between polls: nothing writes the buffer meanwhile.
    unsafe { m.buf.as_slice() }.to_vec()
}

#[test]
fn region_with_mw_bind_only_is_not_reachable_by_its_own_rkey() {
    let (mut rig, target) = window_rig();
    assert_eq!(write_through(&mut rig, 1, target.mr.rkey().0, target.mr.addr(), 64), Some(wire::TERM_REMOTE_ACCESS));
    assert!(bytes_of(&target).iter().all(|&b| b == 0x11));
}

#[test]
fn window_allows_its_range_and_direction_until_dropped() {
    let (mut rig, target) = window_rig();
    let base = target.mr.addr();
    let w = rig.qp.bind_window(target.mr.rkey(), base + 4096, 4096, Access::REMOTE_WRITE).unwrap();
    assert_ne!(w.rkey(), target.mr.rkey());
    assert_eq!(write_through(&mut rig, 1, w.rkey().0, base + 4096, 4096), None, "inside the window");
    let b = bytes_of(&target);
    assert!(b[..4096].iter().all(|&x| x == 0x11) && b[4096..].iter().all(|&x| x == 0xEE));
    // After the window is gone, its rkey is refused and nothing changes.
    let old = w.rkey();
    drop(w);
    // SAFETY: between polls.
    unsafe { target.buf.as_mut_slice() }.fill(0x11);
    assert_eq!(write_through(&mut rig, 2, old.0, base + 4096, 64), Some(wire::TERM_REMOTE_ACCESS));
    assert!(bytes_of(&target).iter().all(|&x| x == 0x11), "write through a dropped window placed");
}

#[test]
fn window_refuses_late_outside_and_wrong_direction_accesses() {
    // Late: a WRITE with the rkey of a dropped window.
    let (mut rig, target) = window_rig();
    let base = target.mr.addr();
    let old = rig.qp.bind_window(target.mr.rkey(), base, 4096, Access::REMOTE_WRITE).unwrap().rkey();
    assert_eq!(write_through(&mut rig, 1, old.0, base, 64), Some(wire::TERM_REMOTE_ACCESS));
    assert!(bytes_of(&target).iter().all(|&b| b == 0x11), "late write placed");

    // Outside: inside the region, past the window.
    let (mut rig, target) = window_rig();
    let base = target.mr.addr();
    let w = rig.qp.bind_window(target.mr.rkey(), base, 4096, Access::REMOTE_WRITE).unwrap();
    assert_eq!(write_through(&mut rig, 1, w.rkey().0, base + 4000, 200), Some(wire::TERM_REMOTE_ACCESS));
    assert!(bytes_of(&target).iter().all(|&b| b == 0x11), "write past the window placed");

    // Wrong direction: a READ window written to, and read through a WRITE window.
    let (mut rig, target) = window_rig();
    let base = target.mr.addr();
    let r = rig.qp.bind_window(target.mr.rkey(), base, 4096, Access::REMOTE_READ).unwrap();
    assert_eq!(write_through(&mut rig, 1, r.rkey().0, base, 64), Some(wire::TERM_REMOTE_ACCESS));
    assert!(bytes_of(&target).iter().all(|&b| b == 0x11));
    let (mut rig, target) = window_rig();
    let w = rig.qp.bind_window(target.mr.rkey(), target.mr.addr(), 4096, Access::REMOTE_WRITE).unwrap();
    let h = Header { seq: 1, aux: 64, rkey: w.rkey().0, remote_addr: target.mr.addr(), ..Header::new(FrameType::ReadReq) };
    rig.raw.write_all(&h.encode()).unwrap();
    let mut comps = Vec::new();
    let qp = &rig.qp;
    poll_until(&rig.cq, &mut comps, "error", |_| qp.state() == QpState::Error);
    assert_eq!(read_until(&mut rig.raw, FrameType::Terminate).aux, wire::TERM_REMOTE_ACCESS);
}

#[test]
fn bind_window_checks_its_arguments() {
    let rig = passive_rig();
    let pd = &rig.qp;
    let plain = mem(&rig.pd, 4096, Access::LOCAL_WRITE | Access::REMOTE_WRITE);
    let bindable = mem(&rig.pd, 4096, Access::MW_BIND);
    let kind = |r: crate::fabric::Result<TcpWindow>| r.err().map(|e| e.kind);
    let bad = Some(FabricErrorKind::InvalidArgument);
    assert_eq!(kind(pd.bind_window(plain.mr.rkey(), plain.mr.addr(), 64, Access::REMOTE_WRITE)), bad, "no MW_BIND");
    assert_eq!(kind(pd.bind_window(bindable.mr.rkey(), bindable.mr.addr(), 64, Access::REMOTE_WRITE)), bad, "no LOCAL_WRITE");
    assert_eq!(kind(pd.bind_window(bindable.mr.rkey(), bindable.mr.addr(), 4097, Access::REMOTE_READ)), bad, "past the end");
    assert_eq!(kind(pd.bind_window(bindable.mr.rkey(), bindable.mr.addr(), 0, Access::REMOTE_READ)), bad, "empty");
    assert_eq!(kind(pd.bind_window(bindable.mr.rkey(), bindable.mr.addr(), 64, Access::LOCAL_WRITE)), bad, "local right");
    assert_eq!(kind(pd.bind_window(crate::fabric::Rkey(1), 0x1000, 64, Access::REMOTE_READ)), bad, "unknown region");
    let a = pd.bind_window(bindable.mr.rkey(), bindable.mr.addr(), 64, Access::REMOTE_READ).unwrap();
    let b = pd.bind_window(bindable.mr.rkey(), bindable.mr.addr(), 64, Access::REMOTE_READ).unwrap();
    assert_ne!(a.rkey(), b.rkey(), "every bind gets a fresh key");
    assert_ne!(a.rkey(), bindable.mr.rkey());
}

#[test]
fn a_window_serves_only_the_peer_of_the_queue_pair_it_was_bound_on() {
    let (mut rig, target) = window_rig();
    let base = target.mr.addr();
    let w = rig.qp.bind_window(target.mr.rkey(), base, 4096, Access::REMOTE_WRITE).unwrap();
    // A second queue pair in the same protection domain and CQ.
    let (other_qp, mut other_raw, _rx) = accept_raw(&rig._listener, &rig.pd, &rig.cq);
    let h = Header { seq: 1, flags: wire::FLAG_ACK_REQUESTED, length: 64, rkey: w.rkey().0, remote_addr: base, ..Header::new(FrameType::Write) };
    other_raw.write_all(&h.encode()).unwrap();
    other_raw.write_all(&[EVIL_BYTE; 64]).unwrap();
    let mut comps = Vec::new();
    poll_until(&rig.cq, &mut comps, "the other queue pair's error", |_| other_qp.state() == QpState::Error);
    assert_eq!(read_until(&mut other_raw, FrameType::Terminate).aux, wire::TERM_REMOTE_ACCESS);
    assert!(bytes_of(&target).iter().all(|&b| b == 0x11), "a window served another queue pair's peer");
    // Its own peer may use it.
    assert_eq!(write_through(&mut rig, 1, w.rkey().0, base, 64), None);
    assert!(bytes_of(&target)[..64].iter().all(|&b| b == 0xEE));
}

const EVIL_BYTE: u8 = 0x66;

// ------------------------------------------------ SEND with Invalidate --

/// The raw peer's SEND `seq` with Invalidate of `rkey` (into receive 100),
/// asking for an acknowledgement.
fn send_invalidating(seq: u32, rkey: u32, payload: &[u8]) -> Vec<u8> {
    let flags = wire::FLAG_ACK_REQUESTED | wire::FLAG_INVALIDATE;
    let h = Header { seq, flags, rkey, length: payload.len() as u32, ..Header::new(FrameType::Send) };
    let mut out = h.encode().to_vec();
    out.extend_from_slice(payload);
    out
}

#[test]
fn the_invalidate_flag_belongs_to_send_frames_only() {
    let send = Header { flags: wire::FLAG_INVALIDATE, rkey: 0x8000_0001, length: 8, ..Header::new(FrameType::Send) };
    assert_eq!(Header::decode(&send.encode()), Ok(send));
    for ty in [FrameType::Write, FrameType::ReadReq, FrameType::ReadResp, FrameType::Ack, FrameType::Terminate] {
        let h = Header { flags: wire::FLAG_INVALIDATE, ..Header::new(ty) };
        assert_eq!(Header::decode(&h.encode()), Err(DecodeError::UnknownFlags(wire::FLAG_INVALIDATE)), "{ty:?}");
    }
}

#[test]
fn a_send_with_invalidate_leaves_as_a_flagged_send_and_completes_as_a_send() {
    let mut rig = passive_rig();
    let tx = mem(&rig.pd, 4096, Access::LOCAL_WRITE);
    let sge = [tx.mr_sge(0, 8)];
    let op = SendOp::SendWithInvalidate { rkey: Rkey(0x8765_4321) };
    rig.qp.post_send(&[SendWr { wr_id: WrId(1), op, payload: Payload::Sges(&sge), signaled: true }]).unwrap();
    let (h, body) = read_frame(&mut rig.raw);
    assert_eq!((h.ty, h.seq, h.rkey, body.len()), (FrameType::Send, 1, 0x8765_4321, 8));
    assert_eq!(h.flags, wire::FLAG_ACK_REQUESTED | wire::FLAG_INVALIDATE);
    rig.raw.write_all(&standalone_ack(1)).unwrap();
    let mut comps = Vec::new();
    poll_until(&rig.cq, &mut comps, "the send completion", |c| !c.is_empty());
    assert_eq!(order(&comps), [(WcOpcode::Send, 1, WcStatus::Success)]);
    assert_eq!(comps[0].invalidated_rkey, None);
}

/// The peer's SEND with Invalidate of a window bound on the queue pair
/// ends the window before the receive completes, which reports the key;
/// a WRITE through it afterwards is refused. An empty SEND does it too.
#[test]
fn a_peers_send_with_invalidate_ends_its_window_and_reports_the_key() {
    for payload in [&b"done"[..], b""] {
        let (mut rig, target) = window_rig();
        let base = target.mr.addr();
        let w = rig.qp.bind_window(target.mr.rkey(), base, 4096, Access::REMOTE_WRITE).unwrap();
        let key = w.rkey().0;
        rig.raw.write_all(&send_invalidating(1, key, payload)).unwrap();
        let mut comps = Vec::new();
        await_ack(&mut rig, &mut comps, 1);
        poll_until(&rig.cq, &mut comps, "the receive", |c| status_of(c, 100).is_some());
        let c = comps.iter().find(|c| c.wr_id == WrId(100)).unwrap();
        assert_eq!((c.status, c.byte_len, c.invalidated_rkey), (WcStatus::Success, payload.len() as u32, Some(Rkey(key))));
        assert_eq!(write_through(&mut rig, 2, key, base, 64), Some(wire::TERM_REMOTE_ACCESS));
        assert!(bytes_of(&target).iter().all(|&b| b == 0x11), "a WRITE through an invalidated window placed");
        drop(w);
    }
}

/// A key the queue pair cannot invalidate is IBTA's class J error, which
/// RC hardware (rxe's responder, checked) reports to the receiver only: the
/// SEND is acknowledged (the sender's work request succeeds), the receive
/// completes with `RemoteInvalidRequest`, and the receiving queue pair
/// fails without telling the peer (no TERMINATE; the stream stays open
/// until the application disconnects). Nothing is invalidated.
#[test]
fn a_send_with_invalidate_of_a_key_that_is_no_window_of_the_queue_pair_fails_only_the_receiver() {
    for case in ["region", "unknown window", "another queue pair's window"] {
        let (mut rig, target) = window_rig();
        let base = target.mr.addr();
        let open = mem(&rig.pd, 4096, Access::LOCAL_WRITE | Access::REMOTE_WRITE);
        let other = accept_raw(&rig._listener, &rig.pd, &rig.cq);
        let w = other.0.bind_window(target.mr.rkey(), base, 4096, Access::REMOTE_WRITE).unwrap();
        let key = match case {
            "region" => open.mr.rkey().0,
            "unknown window" => w.rkey().0 ^ 1,
            _ => w.rkey().0,
        };
        rig.raw.write_all(&send_invalidating(1, key, b"bye")).unwrap();
        let mut comps = Vec::new();
        let (qp, num) = (&rig.qp, rig.qp.qp_num());
        let ours = |c: &[Completion]| c.iter().find(|c| c.wr_id == WrId(100) && c.qp_num == num).copied();
        poll_until(&rig.cq, &mut comps, "the receive", |c| ours(c).is_some() && qp.state() == QpState::Error);
        let c = ours(&comps).unwrap();
        assert_eq!((c.status, c.invalidated_rkey), (WcStatus::RemoteInvalidRequest, None), "{case}");
        let (h, _) = read_frame(&mut rig.raw);
        assert_eq!((h.ty, h.ack), (FrameType::Ack, 1), "{case}: the SEND is acknowledged");
        rig.raw.set_read_timeout(Some(Duration::from_millis(50))).unwrap();
        let mut b = [0u8; 1];
        let e = rig.raw.read(&mut b).expect_err("no TERMINATE, no EOF while the application keeps the queue pair");
        assert!(matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut), "{case}: {e}");
        rig.raw.set_read_timeout(Some(DEADLINE)).unwrap();
        // The other queue pair's window still serves its own peer.
        let (other_qp, mut other_raw, _rx) = other;
        let h = Header { seq: 1, flags: wire::FLAG_ACK_REQUESTED, length: 64, rkey: w.rkey().0, remote_addr: base, ..Header::new(FrameType::Write) };
        other_raw.write_all(&h.encode()).unwrap();
        other_raw.write_all(&[0xEE; 64]).unwrap();
        poll_until(&rig.cq, &mut comps, "the write through the window", |_| {
            // SAFETY: read between polls: nothing writes the buffer meanwhile.
            let placed = unsafe { target.buf.as_slice() };
            placed[63] == 0xEE
        });
        assert_eq!(other_qp.state(), QpState::Ready, "{case}");
        // The application's disconnect ends the lingering stream.
        rig.qp.disconnect();
        poll_until(&rig.cq, &mut comps, "the disconnect", |_| true);
        assert_eq!(read_until(&mut rig.raw, FrameType::Disconnect).ty, FrameType::Disconnect);
        drop(w);
    }
}

/// A window the peer invalidated and its owner drops only later: a window
/// bound meanwhile under the same rkey (tcp draws keys at random, so it
/// may) must outlive that drop.
#[test]
fn dropping_a_window_the_peer_invalidated_spares_a_later_window_with_its_key() {
    let (mut rig, target) = window_rig();
    let base = target.mr.addr();
    let w = rig.qp.bind_window(target.mr.rkey(), base, 4096, Access::REMOTE_WRITE).unwrap();
    let key = w.rkey().0;
    rig.raw.write_all(&send_invalidating(1, key, b"")).unwrap();
    let mut comps = Vec::new();
    await_ack(&mut rig, &mut comps, 1);
    let again = rig
        .pd
        .shared()
        .bind_window_with_key(rig.qp.qp_num().0, target.mr.rkey(), base, 4096, Access::REMOTE_WRITE, key)
        .unwrap();
    drop(w);
    assert_eq!(write_through(&mut rig, 2, key, base, 64), None, "the later window was taken by the old one's drop");
    drop(again);
}

// ------------------------------------------------------ receive staging --

/// Appends a WRITE frame (header and payload) to `out`.
fn push_write(out: &mut Vec<u8>, seq: u32, ack_req: bool, rkey: u32, addr: u64, payload: &[u8]) {
    let flags = if ack_req { wire::FLAG_ACK_REQUESTED } else { 0 };
    let h = Header { seq, flags, length: payload.len() as u32, rkey, remote_addr: addr, ..Header::new(FrameType::Write) };
    out.extend_from_slice(&h.encode());
    out.extend_from_slice(payload);
}

/// Appends a SEND frame (header and payload) to `out`.
fn push_send(out: &mut Vec<u8>, seq: u32, ack_req: bool, payload: &[u8]) {
    let flags = if ack_req { wire::FLAG_ACK_REQUESTED } else { 0 };
    let h = Header { seq, flags, length: payload.len() as u32, ..Header::new(FrameType::Send) };
    out.extend_from_slice(&h.encode());
    out.extend_from_slice(payload);
}

/// Polls the rig's CQ until the raw peer has an ACK covering `seq`;
/// panics if the queue pair fails first.
fn await_ack(rig: &mut PassiveRig, comps: &mut Vec<Completion>, seq: u32) {
    let deadline = Instant::now() + DEADLINE;
    loop {
        let mut out = [Completion::EMPTY; 16];
        let n = rig.cq.poll(&mut out).unwrap();
        comps.extend_from_slice(&out[..n]);
        assert_eq!(rig.qp.state(), QpState::Ready, "{comps:?}");
        let mut probe = [0u8; HDR_LEN];
        rig.raw.set_nonblocking(true).unwrap();
        let got = rig.raw.peek(&mut probe);
        rig.raw.set_nonblocking(false).unwrap();
        if matches!(got, Ok(n) if n == HDR_LEN) {
            let (h, _) = read_frame(&mut rig.raw);
            assert_ne!(h.ty, FrameType::Terminate, "{h:?}");
            if h.ty == FrameType::Ack && seq_le(seq, h.ack) {
                return;
            }
        }
        assert!(Instant::now() < deadline, "no ACK of seq {seq}: {comps:?}");
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Polls until `buf[at]` reads `byte` (the placement happens inside poll,
/// so the buffer is read between polls).
fn poll_until_byte(rig: &PassiveRig, buf: &AlignedBuf, at: usize, byte: u8) {
    let deadline = Instant::now() + DEADLINE;
    loop {
        let mut out = [Completion::EMPTY; 4];
        assert_eq!(rig.cq.poll(&mut out).unwrap(), 0, "{:?}", &out[..1]);
        // SAFETY: no poll is running, so nothing writes the buffer.
        if unsafe { buf.as_slice() }[at] == byte {
            return;
        }
        assert!(Instant::now() < deadline, "byte {at} never became {byte:#x}");
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Writes `bytes` to the raw peer's socket from a thread, so that polls can
/// drain the socket meanwhile (a large stream fills the socket buffers).
fn write_in_background(raw: &TcpStream, bytes: Vec<u8>) -> std::thread::JoinHandle<()> {
    let mut w = raw.try_clone().unwrap();
    std::thread::spawn(move || w.write_all(&bytes).unwrap())
}

fn pattern(seed: usize, i: usize) -> u8 {
    ((seed * 31 + i) % 251) as u8
}

#[test]
fn many_frames_in_one_segment_are_all_processed_in_order() {
    // Eight WRITE + SEND pairs sent with one write: the queue pair reads
    // them together and must place every payload and complete every
    // receive in order, each SEND scattered over two SGEs.
    let mut rig = passive_rig();
    let region = mem(&rig.pd, 4096, Access::LOCAL_WRITE | Access::REMOTE_WRITE);
    let rx = &rig._rx;
    let sges: Vec<[crate::fabric::Sge; 2]> = (0..8).map(|i| [rx.mr_sge(i * 64, 20), rx.mr_sge(2048 + i * 64, 44)]).collect();
    // wr_id 100, posted by the rig over rx[0..64], is the first of them.
    for (i, s) in sges.iter().enumerate().skip(1) {
        rig.qp.post_recv(&[RecvWr { wr_id: WrId(100 + i as u64), sges: s }]).unwrap();
    }
    let mut segment = Vec::new();
    let mut seq = 0;
    for i in 0..8usize {
        seq += 1;
        let write: Vec<u8> = (0..200).map(|j| pattern(i, j)).collect();
        push_write(&mut segment, seq, false, region.mr.rkey().0, region.mr.addr() + i as u64 * 200, &write);
        seq += 1;
        let send: Vec<u8> = (0..1 + i * 9).map(|j| pattern(100 + i, j)).collect();
        push_send(&mut segment, seq, i == 7, &send);
    }
    rig.raw.write_all(&segment).unwrap();
    let mut comps = Vec::new();
    await_ack(&mut rig, &mut comps, seq);
    poll_until(&rig.cq, &mut comps, "eight receives", |c| c.len() == 8);
    let ids: Vec<u64> = comps.iter().map(|c| c.wr_id.0).collect();
    assert_eq!(ids, (100..108).collect::<Vec<_>>(), "receives complete in posting order");
    for (i, c) in comps.iter().enumerate() {
        assert_eq!((c.status, c.opcode, c.byte_len), (WcStatus::Success, WcOpcode::Recv, 1 + i as u32 * 9));
    }
    let placed = bytes_of(&region);
    let got_rx = bytes_of(&rig._rx);
    for i in 0..8usize {
        assert!((0..200).all(|j| placed[i * 200 + j] == pattern(i, j)), "WRITE {i} misplaced");
        let len = 1 + i * 9;
        let received: Vec<u8> =
            got_rx[i * 64..i * 64 + 20].iter().chain(&got_rx[2048 + i * 64..2048 + i * 64 + 44]).take(len).copied().collect();
        assert_eq!(received, (0..len).map(|j| pattern(100 + i, j)).collect::<Vec<_>>(), "SEND {i} misplaced");
    }
    assert!(placed[1600..].iter().all(|&b| b == 0), "bytes past the WRITEs changed");
}

#[test]
fn frames_straddling_the_staging_buffer_are_reassembled() {
    // 600 frames of 133 bytes (over 64 KiB, more than one staging buffer):
    // headers and payloads fall across read boundaries at every offset.
    let mut rig = passive_rig();
    let region = mem(&rig.pd, 600 * 101, Access::LOCAL_WRITE | Access::REMOTE_WRITE);
    let mut stream = Vec::new();
    for i in 0..600usize {
        let payload: Vec<u8> = (0..101).map(|j| pattern(i, j)).collect();
        push_write(&mut stream, i as u32 + 1, i == 599, region.mr.rkey().0, region.mr.addr() + i as u64 * 101, &payload);
    }
    let writer = write_in_background(&rig.raw, stream);
    let mut comps = Vec::new();
    await_ack(&mut rig, &mut comps, 600);
    writer.join().unwrap();
    let placed = bytes_of(&region);
    for i in 0..600usize {
        assert!((0..101).all(|j| placed[i * 101 + j] == pattern(i, j)), "WRITE {i} misplaced");
    }
    assert!(comps.is_empty(), "{comps:?}");
}

#[test]
fn a_payload_arriving_in_parts_is_placed_in_order() {
    // A WRITE whose payload arrives in three parts (the first with its
    // header, the others alone), then a SEND behind it.
    let mut rig = passive_rig();
    let region = mem(&rig.pd, 10_000, Access::LOCAL_WRITE | Access::REMOTE_WRITE);
    let payload: Vec<u8> = (0..10_000).map(|j| pattern(7, j)).collect();
    let mut frame = Vec::new();
    push_write(&mut frame, 1, false, region.mr.rkey().0, region.mr.addr(), &payload);
    let (first, rest) = frame.split_at(HDR_LEN + 3000);
    let (second, third) = rest.split_at(4000);
    rig.raw.write_all(first).unwrap();
    poll_until_byte(&rig, &region.buf, 2999, pattern(7, 2999));
    // SAFETY: between polls.
    assert!(unsafe { region.buf.as_slice() }[3000..].iter().all(|&b| b == 0), "placed beyond what arrived");
    rig.raw.write_all(second).unwrap();
    poll_until_byte(&rig, &region.buf, 6999, pattern(7, 6999));
    let mut tail = third.to_vec();
    push_send(&mut tail, 2, true, b"behind the write");
    rig.raw.write_all(&tail).unwrap();
    let mut comps = Vec::new();
    await_ack(&mut rig, &mut comps, 2);
    poll_until(&rig.cq, &mut comps, "the receive", |c| status_of(c, 100).is_some());
    assert_eq!(comps[0].byte_len, 16);
    assert_eq!(bytes_of(&region), payload);
    assert_eq!(&bytes_of(&rig._rx)[..16], b"behind the write");
}

#[test]
fn a_large_payload_and_the_frames_behind_it_are_placed() {
    // A 1 MiB WRITE (read straight into the region) followed by small
    // frames that arrive in the same reads, and another large WRITE.
    let mut rig = passive_rig();
    const LEN: usize = 1 << 20;
    let region = mem(&rig.pd, 2 * LEN, Access::LOCAL_WRITE | Access::REMOTE_WRITE);
    let first: Vec<u8> = (0..LEN).map(|j| pattern(1, j)).collect();
    let second: Vec<u8> = (0..LEN - 7).map(|j| pattern(2, j)).collect();
    let mut stream = Vec::new();
    push_write(&mut stream, 1, false, region.mr.rkey().0, region.mr.addr(), &first);
    push_send(&mut stream, 2, false, b"between");
    push_write(&mut stream, 3, false, region.mr.rkey().0, region.mr.addr() + LEN as u64, &second);
    push_write(&mut stream, 4, true, region.mr.rkey().0, region.mr.addr() + 2 * LEN as u64 - 7, &[9; 7]);
    let writer = write_in_background(&rig.raw, stream);
    let mut comps = Vec::new();
    await_ack(&mut rig, &mut comps, 4);
    writer.join().unwrap();
    poll_until(&rig.cq, &mut comps, "the receive", |c| status_of(c, 100).is_some());
    assert_eq!((comps[0].status, comps[0].byte_len), (WcStatus::Success, 7));
    assert_eq!(&bytes_of(&rig._rx)[..7], b"between");
    let placed = bytes_of(&region);
    assert!(placed[..LEN] == first[..], "first WRITE differs");
    assert!(placed[LEN..2 * LEN - 7] == second[..], "second WRITE differs");
    assert_eq!(&placed[2 * LEN - 7..], &[9; 7]);
}

#[test]
fn a_window_invalidated_between_two_parts_of_a_payload_stops_placement() {
    // The first part is placed; after the window is dropped, not one byte
    // of the rest may land. Small (copied out of staging) and large (read
    // directly) first parts.
    for (len, first) in [(6000usize, 2000usize), (48 << 10, 20 << 10)] {
        let mut rig = passive_rig();
        let target = mem(&rig.pd, 64 << 10, Access::LOCAL_WRITE | Access::MW_BIND);
        // SAFETY: no poll runs; nothing else writes the buffer.
        unsafe { target.buf.as_mut_slice() }.fill(0x11);
        let base = target.mr.addr();
        let w = rig.qp.bind_window(target.mr.rkey(), base, 64 << 10, Access::REMOTE_WRITE).unwrap();
        let mut frame = Vec::new();
        push_write(&mut frame, 1, true, w.rkey().0, base, &vec![0xEE; len]);
        let (part1, _) = frame.split_at(HDR_LEN + first);
        rig.raw.write_all(part1).unwrap();
        poll_until_byte(&rig, &target.buf, first - 1, 0xEE);
        drop(w);
        rig.raw.write_all(&vec![EVIL_BYTE; len - first]).unwrap();
        let mut comps = Vec::new();
        let qp = &rig.qp;
        poll_until(&rig.cq, &mut comps, "error", |c| qp.state() == QpState::Error && status_of(c, 100).is_some());
        let t = read_until(&mut rig.raw, FrameType::Terminate);
        assert_eq!((t.aux, t.seq), (wire::TERM_REMOTE_ACCESS, 1), "{len}");
        let b = bytes_of(&target);
        assert!(b[..first].iter().all(|&x| x == 0xEE), "{len}: first part not placed");
        assert!(b[first..].iter().all(|&x| x == 0x11), "{len}: placed after the window was dropped");
    }
}

#[test]
fn frames_staged_behind_a_fault_are_not_executed() {
    // One segment: a WRITE with a bad rkey, then a valid WRITE and a SEND.
    // The queue pair fails at the first; the others were read with it but
    // must have no effect.
    let mut rig = passive_rig();
    let region = mem(&rig.pd, 4096, Access::LOCAL_WRITE | Access::REMOTE_WRITE);
    let mut segment = Vec::new();
    push_write(&mut segment, 1, false, 0xBAD, region.mr.addr(), &[EVIL_BYTE; 64]);
    push_write(&mut segment, 2, false, region.mr.rkey().0, region.mr.addr(), &[EVIL_BYTE; 64]);
    push_send(&mut segment, 3, true, &[EVIL_BYTE; 16]);
    rig.raw.write_all(&segment).unwrap();
    let mut comps = Vec::new();
    let qp = &rig.qp;
    poll_until(&rig.cq, &mut comps, "error", |c| qp.state() == QpState::Error && status_of(c, 100).is_some());
    assert_eq!(status_of(&comps, 100), Some(WcStatus::WrFlushError));
    let t = read_until(&mut rig.raw, FrameType::Terminate);
    assert_eq!((t.aux, t.seq), (wire::TERM_REMOTE_ACCESS, 1));
    assert!(bytes_of(&region).iter().all(|&b| b == 0), "a WRITE behind the fault was placed");
    assert!(bytes_of(&rig._rx).iter().all(|&b| b == 0), "a SEND behind the fault was placed");
}

#[test]
fn requests_staged_behind_an_rnr_nak_are_dropped() {
    // One segment: a SEND that takes the only receive, a SEND that finds
    // none (answered with the receiver-not-ready NAK) and a WRITE behind
    // it, which must be read and dropped, not placed.
    let mut rig = passive_rig();
    let region = mem(&rig.pd, 4096, Access::LOCAL_WRITE | Access::REMOTE_WRITE);
    let mut segment = Vec::new();
    push_send(&mut segment, 1, false, b"first");
    push_send(&mut segment, 2, false, &[EVIL_BYTE; 40]);
    push_write(&mut segment, 3, false, region.mr.rkey().0, region.mr.addr(), &[EVIL_BYTE; 3000]);
    rig.raw.write_all(&segment).unwrap();
    let mut comps = Vec::new();
    poll_until(&rig.cq, &mut comps, "the first receive", |c| status_of(c, 100).is_some());
    let t = read_until(&mut rig.raw, FrameType::Terminate);
    assert_eq!((t.aux, t.seq), (wire::TERM_RNR, 2));
    // A later poll has nothing to add: the dropped frames leave no trace.
    let mut out = [Completion::EMPTY; 4];
    assert_eq!(rig.cq.poll(&mut out).unwrap(), 0);
    assert_eq!(rig.qp.state(), QpState::Ready);
    assert_eq!((comps[0].status, comps[0].byte_len), (WcStatus::Success, 5));
    assert_eq!(&bytes_of(&rig._rx)[..6], b"first\0");
    assert!(bytes_of(&region).iter().all(|&b| b == 0), "a WRITE behind the NAK was placed");
}

// ------------------------------------------------- late send completions --

/// Posts a signaled 8-byte SEND `wr` and reads its frame (seq `seq`) at the
/// raw peer.
fn send_and_read(rig: &mut PassiveRig, tx: &Mem, wr: u64, seq: u32) {
    let sge = [tx.mr_sge(0, 8)];
    rig.qp.post_send(&[SendWr { wr_id: WrId(wr), op: SendOp::Send, payload: Payload::Sges(&sge), signaled: true }]).unwrap();
    let (h, _) = read_frame(&mut rig.raw);
    assert_eq!((h.ty, h.seq), (FrameType::Send, seq));
}

/// The raw peer's SEND `seq` (into receive 100), acknowledging our `ack`.
fn send_acking(seq: u32, ack: u32, payload: &[u8]) -> Vec<u8> {
    let h = Header { seq, ack, length: payload.len() as u32, ..Header::new(FrameType::Send) };
    let mut out = h.encode().to_vec();
    out.extend_from_slice(payload);
    out
}

fn standalone_ack(ack: u32) -> [u8; HDR_LEN] {
    Header { ack, ..Header::new(FrameType::Ack) }.encode()
}

/// Polls for `d` and asserts that nothing completes meanwhile.
fn poll_nothing_for(cq: &TcpCq, d: Duration) {
    let until = Instant::now() + d;
    while Instant::now() < until {
        let mut out = [Completion::EMPTY; 4];
        let n = cq.poll(&mut out).unwrap();
        assert_eq!(n, 0, "{:?}", &out[..n]);
        std::thread::sleep(Duration::from_millis(1));
    }
}

fn order(comps: &[Completion]) -> Vec<(WcOpcode, u64, WcStatus)> {
    comps.iter().map(|c| (c.opcode, c.wr_id.0, c.status)).collect()
}

/// The order of our SEND's completion and the receive of the peer's next
/// SEND, when that SEND carries the acknowledgement of ours.
fn order_when_the_answer_carries_the_ack(late: bool) -> Vec<(WcOpcode, u64, WcStatus)> {
    let mut rig = passive_rig();
    rig.cq.set_late_send_completions(late).unwrap();
    rig.cq.set_late_send_hold(FOREVER);
    let tx = mem(&rig.pd, 4096, Access::LOCAL_WRITE);
    send_and_read(&mut rig, &tx, 1, 1);
    rig.raw.write_all(&send_acking(1, 1, b"next command")).unwrap();
    let mut comps = Vec::new();
    poll_until(&rig.cq, &mut comps, "both completions", |c| c.len() == 2);
    order(&comps)
}

#[test]
fn late_send_completions_come_after_the_peers_next_message() {
    use WcOpcode::{Recv, Send};
    use WcStatus::Success;
    // Off (the default): the ack is processed at the frame's header, so the
    // SEND completes before the receive of that frame's payload.
    assert_eq!(order_when_the_answer_carries_the_ack(false), [(Send, 1, Success), (Recv, 100, Success)]);
    assert_eq!(order_when_the_answer_carries_the_ack(true), [(Recv, 100, Success), (Send, 1, Success)]);
}

#[test]
fn a_late_send_completion_waits_for_the_next_send_not_for_the_ack() {
    use WcOpcode::{Recv, RdmaWrite, Send};
    use WcStatus::Success;
    let mut rig = passive_rig();
    rig.cq.set_late_send_completions(true).unwrap();
    rig.cq.set_late_send_hold(FOREVER);
    let tx = mem(&rig.pd, 4096, Access::LOCAL_WRITE);
    let sge = [tx.mr_sge(0, 8)];
    let write = |id: u64| SendWr {
        wr_id: WrId(id),
        op: SendOp::RdmaWrite { remote_addr: 0x1000, rkey: crate::fabric::Rkey(7) },
        payload: Payload::Sges(&sge),
        signaled: true,
    };
    send_and_read(&mut rig, &tx, 1, 1);
    // A WRITE behind the held SEND waits with it: one send queue completes
    // in posting order.
    rig.qp.post_send(&[write(2)]).unwrap();
    assert_eq!(read_frame(&mut rig.raw).0.ty, FrameType::Write);
    rig.raw.write_all(&standalone_ack(2)).unwrap();
    poll_nothing_for(&rig.cq, Duration::from_millis(30));
    rig.raw.write_all(&send_acking(1, 2, b"next")).unwrap();
    let mut comps = Vec::new();
    poll_until(&rig.cq, &mut comps, "the three completions", |c| c.len() == 3);
    assert_eq!(order(&comps), [(Recv, 100, Success), (Send, 1, Success), (RdmaWrite, 2, Success)]);
    // A WRITE on its own is not held.
    rig.qp.post_send(&[write(3)]).unwrap();
    assert_eq!(read_frame(&mut rig.raw).0.seq, 3);
    rig.raw.write_all(&standalone_ack(3)).unwrap();
    let mut comps = Vec::new();
    poll_until(&rig.cq, &mut comps, "the WRITE", |c| !c.is_empty());
    assert_eq!(order(&comps), [(RdmaWrite, 3, Success)]);
}

#[test]
fn a_failing_queue_pair_flushes_held_send_completions() {
    // The peer leaves: the acknowledged, held SENDs are flushed; the
    // transport error goes to the first SEND the peer did not acknowledge.
    let mut rig = passive_rig();
    rig.cq.set_late_send_completions(true).unwrap();
    rig.cq.set_late_send_hold(FOREVER);
    let tx = mem(&rig.pd, 4096, Access::LOCAL_WRITE);
    for i in 1..=3 {
        send_and_read(&mut rig, &tx, i, i as u32);
    }
    rig.raw.write_all(&standalone_ack(2)).unwrap();
    poll_nothing_for(&rig.cq, Duration::from_millis(30));
    drop(rig.raw);
    let mut comps = Vec::new();
    poll_until(&rig.cq, &mut comps, "the flush", |c| c.len() == 4);
    assert_eq!(status_of(&comps, 1), Some(WcStatus::WrFlushError));
    assert_eq!(status_of(&comps, 2), Some(WcStatus::WrFlushError));
    assert_eq!(status_of(&comps, 3), Some(WcStatus::TransportError));
    assert_eq!(status_of(&comps, 100), Some(WcStatus::WrFlushError));
    assert_eq!(rig.qp.state(), QpState::Error);

    // The application disconnects: flushed as well.
    let mut rig = passive_rig();
    rig.cq.set_late_send_completions(true).unwrap();
    rig.cq.set_late_send_hold(FOREVER);
    let tx = tx_of(&rig);
    send_and_read(&mut rig, &tx, 1, 1);
    rig.raw.write_all(&standalone_ack(1)).unwrap();
    poll_nothing_for(&rig.cq, Duration::from_millis(30));
    rig.qp.disconnect();
    let mut comps = Vec::new();
    poll_until(&rig.cq, &mut comps, "the flush", |c| c.len() == 2);
    assert_eq!(status_of(&comps, 1), Some(WcStatus::WrFlushError));
    assert_eq!(status_of(&comps, 100), Some(WcStatus::WrFlushError));
}

fn tx_of(rig: &PassiveRig) -> Mem {
    mem(&rig.pd, 4096, Access::LOCAL_WRITE)
}

#[test]
fn a_held_send_completion_is_released_after_the_bound_and_wakes_the_owner() {
    let mut rig = passive_rig();
    rig.cq.set_late_send_completions(true).unwrap();
    let tx = tx_of(&rig);
    send_and_read(&mut rig, &tx, 1, 1);
    let acked = Instant::now();
    rig.raw.write_all(&standalone_ack(1)).unwrap();
    let mut comps = Vec::new();
    loop {
        let mut out = [Completion::EMPTY; 4];
        let n = rig.cq.poll(&mut out).unwrap();
        comps.extend_from_slice(&out[..n]);
        if !comps.is_empty() {
            break;
        }
        // Asleep on the channel, as a reactor: the timer must wake it.
        rig.cq.arm().unwrap();
        let mut pfd = libc::pollfd { fd: rig.cq.fd(), events: libc::POLLIN, revents: 0 };
        // SAFETY: valid pollfd for the call.
        let rc = unsafe { libc::poll(&mut pfd, 1, DEADLINE.as_millis() as i32) };
        assert_eq!(rc, 1, "the CQ's channel never fired");
        rig.cq.ack_event().unwrap();
    }
    assert!(acked.elapsed() >= Duration::from_millis(50), "released after {:?}", acked.elapsed());
    assert_eq!(order(&comps), [(WcOpcode::Send, 1, WcStatus::Success)]);
    assert_eq!(rig.qp.state(), QpState::Ready);
}

#[test]
fn turning_late_send_completions_off_releases_them() {
    let mut rig = passive_rig();
    rig.cq.set_late_send_completions(true).unwrap();
    rig.cq.set_late_send_hold(FOREVER);
    let tx = tx_of(&rig);
    send_and_read(&mut rig, &tx, 1, 1);
    rig.raw.write_all(&standalone_ack(1)).unwrap();
    poll_nothing_for(&rig.cq, Duration::from_millis(30));
    rig.cq.set_late_send_completions(false).unwrap();
    let mut comps = Vec::new();
    poll_until(&rig.cq, &mut comps, "the SEND", |c| !c.is_empty());
    assert_eq!(order(&comps), [(WcOpcode::Send, 1, WcStatus::Success)]);
}

// ---------------------------------------------------------------- inline --

#[test]
fn an_inline_payload_is_exactly_the_given_bytes() {
    let mut rig = passive_rig();
    // Never registered: inline bytes need no region.
    let bytes: Vec<u8> = (0..37u8).map(|i| i.wrapping_mul(7) ^ 0x5a).collect();
    let write = SendOp::RdmaWrite { remote_addr: 0x2000, rkey: crate::fabric::Rkey(9) };
    rig.qp
        .post_send(&[
            SendWr { wr_id: WrId(1), op: SendOp::Send, payload: Payload::Inline(&bytes), signaled: true },
            SendWr { wr_id: WrId(2), op: write, payload: Payload::Inline(&bytes[..5]), signaled: false },
            SendWr { wr_id: WrId(3), op: SendOp::Send, payload: Payload::Inline(&[]), signaled: true },
        ])
        .unwrap();
    let (h, body) = read_frame(&mut rig.raw);
    assert_eq!((h.ty, h.seq, h.length), (FrameType::Send, 1, 37));
    assert_eq!(body, bytes);
    let (h, body) = read_frame(&mut rig.raw);
    assert_eq!((h.ty, h.seq, h.length, h.remote_addr, h.rkey), (FrameType::Write, 2, 5, 0x2000, 9));
    assert_eq!(body, &bytes[..5]);
    let (h, body) = read_frame(&mut rig.raw);
    assert_eq!((h.ty, h.seq, h.length), (FrameType::Send, 3, 0));
    assert!(body.is_empty());

    // The argument rules: no more than max_inline_data, no inline READ.
    let big = vec![0u8; rig.qp.caps().max_inline_data as usize + 1];
    let e = rig
        .qp
        .post_send(&[SendWr { wr_id: WrId(4), op: SendOp::Send, payload: Payload::Inline(&big), signaled: true }])
        .unwrap_err();
    assert_eq!(e.kind, FabricErrorKind::InvalidArgument, "{e}");
    let read = SendOp::RdmaRead { remote_addr: 0x2000, rkey: crate::fabric::Rkey(9) };
    let e =
        rig.qp.post_send(&[SendWr { wr_id: WrId(5), op: read, payload: Payload::Inline(&big[..8]), signaled: true }]).unwrap_err();
    assert_eq!(e.kind, FabricErrorKind::InvalidArgument, "{e}");
    assert_eq!(rig.qp.state(), QpState::Ready);
}

#[test]
fn an_sge_send_outside_registered_memory_fails_with_a_local_protection_error() {
    let outside = [0xAAu8; 64];
    for what in ["a bad lkey", "memory its region does not cover"] {
        let mut rig = passive_rig();
        let tx = mem(&rig.pd, 4096, Access::LOCAL_WRITE);
        let sges = [if what == "a bad lkey" {
            crate::fabric::Sge { addr: tx.mr.addr(), length: 64, lkey: crate::fabric::Lkey(tx.mr.lkey().0 ^ 0x4000_0100) }
        } else {
            crate::fabric::Sge { addr: outside.as_ptr() as u64, length: outside.len() as u32, lkey: tx.mr.lkey() }
        }];
        let wr = SendWr { wr_id: WrId(1), op: SendOp::Send, payload: Payload::Sges(&sges), signaled: true };
        rig.qp.post_send(&[wr]).unwrap();
        let mut comps = Vec::new();
        poll_until(&rig.cq, &mut comps, what, |c| c.len() == 2);
        assert_eq!(status_of(&comps, 1), Some(WcStatus::LocalProtectionError), "{what}");
        assert_eq!(status_of(&comps, 100), Some(WcStatus::WrFlushError), "{what}");
        assert_eq!(rig.qp.state(), QpState::Error, "{what}");
        // Nothing left for the peer: a local fault is not its business.
        rig.raw.set_read_timeout(Some(Duration::from_millis(50))).unwrap();
        let mut b = [0u8; 1];
        let got = rig.raw.read(&mut b);
        assert!(
            matches!(&got, Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut)),
            "{what}: {got:?}"
        );
    }
}

// ------------------------------------------------------------- timeouts --

/// The transport timeout of the timeout tests.
const TRANSPORT_TIMEOUT: Duration = Duration::from_secs(1);
/// The frame timeout of the timeout tests.
const FRAME_TIMEOUT: Duration = Duration::from_secs(1);
/// How late past its timeout a failure may be noticed on a loaded machine.
const SLACK: Duration = Duration::from_secs(10);

fn short_timeouts() -> FabricOptions {
    FabricOptions { transport_timeout: TRANSPORT_TIMEOUT, frame_timeout: FRAME_TIMEOUT }
}

/// Drives `cq` as a reactor does until `pred` holds: polls while there is
/// work, and when a poll finds nothing, arms the CQ, polls once more and
/// sleeps on its fd (up to [`DEADLINE`]) until it is woken.
fn sleep_on_cq_until(cq: &TcpCq, comps: &mut Vec<Completion>, what: &str, pred: impl Fn(&[Completion]) -> bool) {
    let deadline = Instant::now() + DEADLINE;
    loop {
        let mut out = [Completion::EMPTY; 16];
        let n = cq.poll(&mut out).unwrap();
        comps.extend_from_slice(&out[..n]);
        if pred(comps) {
            return;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}: {comps:?}");
        if n > 0 {
            continue;
        }
        cq.arm().unwrap();
        let n = cq.poll(&mut out).unwrap();
        comps.extend_from_slice(&out[..n]);
        if n == 0 {
            let left = deadline.saturating_duration_since(Instant::now());
            let mut pfd = libc::pollfd { fd: cq.fd(), events: libc::POLLIN, revents: 0 };
            // SAFETY: valid pollfd for the call.
            let rc = unsafe { libc::poll(&mut pfd, 1, left.as_millis() as i32) };
            assert_eq!(rc, 1, "nothing woke the owner asleep on the CQ while waiting for {what}: {comps:?}");
        }
        cq.ack_event().unwrap();
    }
}

/// Reads what the peer still finds in its socket, up to the end of the
/// stream: EOF, or the reset of a connection given up on.
fn expect_end(s: &mut TcpStream) {
    let mut b = vec![0u8; 1 << 16];
    loop {
        match s.read(&mut b) {
            Ok(0) => return,
            Ok(_) => continue,
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return,
            Err(e) => panic!("expected the end of the stream, got {e}"),
        }
    }
}

#[test]
fn a_peer_that_stops_reading_fails_the_write_with_a_transport_error_after_the_timeout() {
    // A peer that takes nothing off its socket: RDMA WRITEs far larger than
    // the socket buffers stay queued in the provider. The owner sleeps on
    // the CQ between polls, as a reactor does: the timeout must wake it.
    let mut rig = passive_rig_with(short_timeouts());
    const LEN: usize = 8 << 20;
    let src = mem(&rig.pd, LEN, Access::LOCAL_WRITE);
    let sge = [src.mr_sge(0, LEN as u32)];
    let write = |id: u64| SendWr {
        wr_id: WrId(id),
        op: SendOp::RdmaWrite { remote_addr: 0x1000, rkey: Rkey(7) },
        payload: Payload::Sges(&sge),
        signaled: true,
    };
    let posted = Instant::now();
    rig.qp.post_send(&[write(1)]).unwrap();
    rig.qp.post_send(&[write(2)]).unwrap();
    let mut comps = Vec::new();
    sleep_on_cq_until(&rig.cq, &mut comps, "the transport timeout", |c| c.len() == 3);
    let took = posted.elapsed();
    assert_eq!(
        order(&comps),
        [
            (WcOpcode::RdmaWrite, 1, WcStatus::TransportError),
            (WcOpcode::RdmaWrite, 2, WcStatus::WrFlushError),
            (WcOpcode::Recv, 100, WcStatus::WrFlushError)
        ]
    );
    assert_eq!(rig.qp.state(), QpState::Error);
    assert!(took >= TRANSPORT_TIMEOUT, "failed after {took:?}, before the timeout");
    assert!(took < TRANSPORT_TIMEOUT + SLACK, "failed after {took:?}");
    // What is posted later is flushed.
    rig.qp.post_send(&[write(3)]).unwrap();
    let mut comps = Vec::new();
    poll_until(&rig.cq, &mut comps, "the flush", |c| !c.is_empty());
    assert_eq!(order(&comps), [(WcOpcode::RdmaWrite, 3, WcStatus::WrFlushError)]);
    // The peer sees the connection end too.
    expect_end(&mut rig.raw);
}

#[test]
fn a_send_or_read_the_peer_takes_but_never_answers_fails_after_the_timeout() {
    for (op, opcode) in [
        (SendOp::Send, WcOpcode::Send),
        (SendOp::RdmaRead { remote_addr: 0x1000, rkey: Rkey(7) }, WcOpcode::RdmaRead),
    ] {
        let mut rig = passive_rig_with(short_timeouts());
        let buf = mem(&rig.pd, 4096, Access::LOCAL_WRITE);
        let sge = [buf.mr_sge(0, 64)];
        let posted = Instant::now();
        rig.qp.post_send(&[SendWr { wr_id: WrId(1), op, payload: Payload::Sges(&sge), signaled: true }]).unwrap();
        // The peer reads the request; a READ's it even acknowledges, but
        // the response never comes.
        let (h, _) = read_frame(&mut rig.raw);
        assert_eq!(h.seq, 1);
        if opcode == WcOpcode::RdmaRead {
            rig.raw.write_all(&standalone_ack(1)).unwrap();
        }
        let mut comps = Vec::new();
        sleep_on_cq_until(&rig.cq, &mut comps, "the transport timeout", |c| c.len() == 2);
        let took = posted.elapsed();
        assert_eq!(order(&comps), [(opcode, 1, WcStatus::TransportError), (WcOpcode::Recv, 100, WcStatus::WrFlushError)]);
        assert!(took >= TRANSPORT_TIMEOUT, "{opcode:?} failed after {took:?}, before the timeout");
        assert!(took < TRANSPORT_TIMEOUT + SLACK, "{opcode:?} failed after {took:?}");
        assert_eq!(rig.qp.state(), QpState::Error);
        expect_end(&mut rig.raw);
    }
}

#[test]
fn a_deadline_due_when_the_socket_woke_the_owner_is_enforced_by_the_next_poll() {
    // The first poll after a wake-up reads a lone queue pair's socket
    // without asking epoll; a deadline check that fell due meanwhile waits
    // for the poll an owner makes before it sleeps again, and no longer.
    let mut rig = passive_rig_with(short_timeouts());
    let buf = mem(&rig.pd, 4096, Access::LOCAL_WRITE);
    let sge = [buf.mr_sge(0, 64)];
    rig.qp.post_send(&[SendWr { wr_id: WrId(1), op: SendOp::Send, payload: Payload::Sges(&sge), signaled: true }]).unwrap();
    let (h, _) = read_frame(&mut rig.raw);
    assert_eq!(h.seq, 1);
    // Nobody polls while the timeout passes; then the peer sends a SEND
    // that does not acknowledge ours, and the owner wakes for both.
    std::thread::sleep(TRANSPORT_TIMEOUT + Duration::from_millis(200));
    let mut frame = Vec::new();
    push_send(&mut frame, 1, false, b"late");
    rig.raw.write_all(&frame).unwrap();
    std::thread::sleep(Duration::from_millis(50));
    assert!(readable_within(rig.cq.fd(), DEADLINE), "the CQ fd is not readable");
    rig.cq.ack_event().unwrap();
    let mut out = [Completion::EMPTY; 16];
    let mut comps = Vec::new();
    for _ in 0..2 {
        let n = rig.cq.poll(&mut out).unwrap();
        comps.extend_from_slice(&out[..n]);
    }
    let got = order(&comps);
    assert_eq!(got.first(), Some(&(WcOpcode::Recv, 100, WcStatus::Success)), "{got:?}");
    assert!(got.contains(&(WcOpcode::Send, 1, WcStatus::TransportError)), "the due deadline was not enforced within two polls: {got:?}");
    assert_eq!(rig.qp.state(), QpState::Error);
}

/// A connected pair whose queue pairs follow `options`.
fn pair_with(options: FabricOptions) -> Pair {
    let fabric = TcpFabric::open_with(&url(), options).unwrap();
    let listener = fabric.listen().unwrap();
    let spd = fabric.alloc_pd().unwrap();
    let scq = fabric.create_cq(64).unwrap();
    let cfab = TcpFabric::open_with(&listener.local_url(), options).unwrap();
    let cpd = cfab.alloc_pd().unwrap();
    let ccq = cfab.create_cq(64).unwrap();
    let cqp = cfab.create_qp(&cpd, &ccq, QpCaps::default()).unwrap();
    let connecting = std::thread::spawn(move || {
        let r = cqp.connect(b"", DEADLINE);
        (cqp, r)
    });
    let deadline = Instant::now() + DEADLINE;
    let req = loop {
        if let Some(r) = listener.poll_request().unwrap() {
            break r;
        }
        assert!(Instant::now() < deadline);
        std::thread::sleep(Duration::from_millis(1));
    };
    let sqp = req.into_queue_pair(&spd, &scq, QpCaps::default()).unwrap();
    sqp.accept(b"").unwrap();
    let (cqp, r) = connecting.join().unwrap();
    r.unwrap();
    Pair { cpd, ccq, cqp, spd, scq, sqp, _listener: listener }
}

#[test]
fn a_peer_that_polls_only_every_500_ms_never_trips_the_transport_timeout() {
    // The server's owner polls twice a second, so its provider takes the
    // client's RDMA WRITEs and SENDs off the socket and acknowledges them
    // only then; for six seconds the client keeps four 1 MiB WRITEs and a
    // SEND outstanding. A slow peer that keeps up is not a dead one.
    let timeout = Duration::from_secs(2);
    let p = pair_with(FabricOptions { transport_timeout: timeout, ..short_timeouts() });
    const LEN: usize = 1 << 20;
    let all = Access::LOCAL_WRITE | Access::REMOTE_WRITE;
    let src = mem(&p.cpd, LEN, Access::LOCAL_WRITE);
    let dst = mem(&p.spd, LEN, all);
    for i in 0..8 {
        p.sqp.post_recv(&[RecvWr { wr_id: WrId(1000 + i), sges: &[dst.mr_sge(0, 64)] }]).unwrap();
    }
    let (raddr, rkey) = (dst.mr.addr(), dst.mr.rkey());
    let Pair { ccq, cqp, scq, sqp, .. } = p;
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let server = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let mut sc = Vec::new();
            let mut next_recv = 1008;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                std::thread::sleep(Duration::from_millis(500));
                let mut out = [Completion::EMPTY; 64];
                let n = scq.poll(&mut out).unwrap();
                for c in &out[..n] {
                    // Each delivered SEND gets its receive back.
                    if c.opcode == WcOpcode::Recv && c.status == WcStatus::Success {
                        sqp.post_recv(&[RecvWr { wr_id: WrId(next_recv), sges: &[dst.mr_sge(0, 64)] }]).unwrap();
                        next_recv += 1;
                    }
                }
                sc.extend_from_slice(&out[..n]);
            }
            (sc, sqp.state(), dst)
        })
    };
    let sge = [src.mr_sge(0, LEN as u32)];
    let send_sge = [src.mr_sge(0, 64)];
    let (mut cc, mut next, mut outstanding) = (Vec::new(), 0u64, 0usize);
    let end = Instant::now() + Duration::from_secs(6);
    while Instant::now() < end {
        while outstanding < 5 {
            let (op, payload) = if next % 5 == 4 {
                (SendOp::Send, Payload::Sges(&send_sge))
            } else {
                (SendOp::RdmaWrite { remote_addr: raddr, rkey }, Payload::Sges(&sge))
            };
            cqp.post_send(&[SendWr { wr_id: WrId(next), op, payload, signaled: true }]).unwrap();
            next += 1;
            outstanding += 1;
        }
        let mut out = [Completion::EMPTY; 16];
        let n = ccq.poll(&mut out).unwrap();
        cc.extend_from_slice(&out[..n]);
        outstanding -= n;
        assert!(cc.iter().all(|c| c.status == WcStatus::Success), "{cc:?}");
        std::thread::sleep(Duration::from_millis(1));
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let (sc, server_state, _dst) = server.join().unwrap();
    assert!(cc.len() >= 10, "only {} completions in 6 s", cc.len());
    assert_eq!(cqp.state(), QpState::Ready);
    assert_eq!(server_state, QpState::Ready, "{sc:?}");
    assert!(sc.iter().all(|c| c.status == WcStatus::Success), "{sc:?}");
}

#[test]
fn a_peer_that_reads_slowly_never_trips_the_transport_timeout() {
    // A peer that takes 64 KiB off its socket every 200 ms: one 2 MiB RDMA
    // WRITE takes more than six transport timeouts to reach it whole, and
    // is acknowledged only then. It is reading all along, so the queue
    // pair must wait for it. Its receive buffer is fixed at 128 KiB (no
    // autotuning), so that its reads keep opening its TCP window and TCP
    // acknowledges more of the stream: what the provider can see of a
    // peer's reading (with a large autotuned buffer that shows in bursts).
    let rig = passive_rig_with(short_timeouts());
    let rcvbuf: libc::c_int = 64 << 10; // the kernel doubles it
    // SAFETY: `rcvbuf` is valid for reads of its size during the call.
    let rc = unsafe {
        libc::setsockopt(
            std::os::fd::AsRawFd::as_raw_fd(&rig.raw),
            libc::SOL_SOCKET,
            libc::SO_RCVBUF,
            (&rcvbuf as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    assert_eq!(rc, 0);
    const LEN: usize = 2 << 20;
    let src = mem(&rig.pd, LEN, Access::LOCAL_WRITE);
    let sge = [src.mr_sge(0, LEN as u32)];
    let mut r = rig.raw.try_clone().unwrap();
    let reader = std::thread::spawn(move || {
        let total = HDR_LEN + LEN;
        let mut buf = vec![0u8; 64 << 10];
        let (mut got, mut first) = (0, Vec::new());
        while got < total {
            std::thread::sleep(Duration::from_millis(200));
            let n = r.read(&mut buf[..(64 << 10).min(total - got)]).unwrap();
            assert!(n > 0, "EOF after {got} bytes");
            if first.len() < HDR_LEN {
                first.extend_from_slice(&buf[..n.min(HDR_LEN - first.len())]);
            }
            got += n;
        }
        let h = Header::decode(first[..HDR_LEN].try_into().unwrap()).unwrap();
        assert_eq!((h.ty, h.seq, h.length as usize), (FrameType::Write, 1, LEN));
        r.write_all(&standalone_ack(1)).unwrap();
    });
    let posted = Instant::now();
    rig.qp
        .post_send(&[SendWr {
            wr_id: WrId(1),
            op: SendOp::RdmaWrite { remote_addr: 0x1000, rkey: Rkey(7) },
            payload: Payload::Sges(&sge),
            signaled: true,
        }])
        .unwrap();
    let mut comps = Vec::new();
    sleep_on_cq_until(&rig.cq, &mut comps, "the WRITE", |c| !c.is_empty());
    let took = posted.elapsed();
    assert_eq!(order(&comps), [(WcOpcode::RdmaWrite, 1, WcStatus::Success)], "after {took:?}");
    assert!(took > 3 * TRANSPORT_TIMEOUT, "the reader was not slow: {took:?}");
    reader.join().unwrap();
    assert_eq!(rig.qp.state(), QpState::Ready);
}

#[test]
fn a_peer_that_stops_in_the_middle_of_a_frame_fails_the_queue_pair_after_the_frame_timeout() {
    // Half a header, or a whole header and part of its payload, and then
    // nothing: on RC such a message never arrives. The connection is lost:
    // our outstanding SEND fails with TransportError, the receive flushes,
    // and the peer sees the connection end. The transport timeout is long,
    // so only the frame timeout can fire.
    let options = FabricOptions { transport_timeout: Duration::from_secs(3600), frame_timeout: FRAME_TIMEOUT };
    for (what, payload) in [("half a header", None), ("a header and 1000 bytes of its 4096", Some(1000))] {
        let mut rig = passive_rig_with(options);
        let write = Header {
            seq: 1,
            flags: wire::FLAG_ACK_REQUESTED,
            length: 4096,
            rkey: rig._rx.mr.rkey().0,
            remote_addr: rig._rx.mr.addr(),
            ..Header::new(FrameType::Write)
        }
        .encode();
        let bytes = match payload {
            None => write[..16].to_vec(),
            Some(n) => [&write[..], &vec![0xAB; n]].concat(),
        };
        let tx = tx_of(&rig);
        send_and_read(&mut rig, &tx, 1, 1);
        rig.raw.write_all(&bytes).unwrap();
        let sent = Instant::now();
        let mut comps = Vec::new();
        sleep_on_cq_until(&rig.cq, &mut comps, what, |c| c.len() == 2);
        let took = sent.elapsed();
        assert_eq!(
            order(&comps),
            [(WcOpcode::Send, 1, WcStatus::TransportError), (WcOpcode::Recv, 100, WcStatus::WrFlushError)],
            "{what}"
        );
        assert!(took >= FRAME_TIMEOUT, "{what}: failed after {took:?}, before the timeout");
        assert!(took < FRAME_TIMEOUT + SLACK, "{what}: failed after {took:?}");
        assert_eq!(rig.qp.state(), QpState::Error);
        expect_end(&mut rig.raw);
    }
}

#[test]
fn a_peer_idle_between_whole_frames_or_slow_within_one_keeps_its_queue_pair() {
    // Whole frames with pauses of twice the frame timeout between them, and
    // a frame that arrives in parts over half of it: nothing is late.
    let mut rig = passive_rig_with(short_timeouts());
    rig.qp.post_recv(&[RecvWr { wr_id: WrId(101), sges: &[rig._rx.mr_sge(64, 64)] }]).unwrap();
    rig.qp.post_recv(&[RecvWr { wr_id: WrId(102), sges: &[rig._rx.mr_sge(128, 64)] }]).unwrap();
    let mut comps = Vec::new();
    let mut frame = Vec::new();
    push_send(&mut frame, 1, true, b"first");
    rig.raw.write_all(&frame).unwrap();
    sleep_on_cq_until(&rig.cq, &mut comps, "the first SEND", |c| status_of(c, 100).is_some());
    let until = Instant::now() + 2 * FRAME_TIMEOUT;
    while Instant::now() < until {
        let mut out = [Completion::EMPTY; 4];
        let n = rig.cq.poll(&mut out).unwrap();
        comps.extend_from_slice(&out[..n]);
        std::thread::sleep(Duration::from_millis(10));
    }
    let mut frame = Vec::new();
    push_send(&mut frame, 2, true, b"second, in parts");
    for part in frame.chunks(7) {
        rig.raw.write_all(part).unwrap();
        let mut out = [Completion::EMPTY; 4];
        let n = rig.cq.poll(&mut out).unwrap();
        comps.extend_from_slice(&out[..n]);
        std::thread::sleep(FRAME_TIMEOUT / 16);
    }
    sleep_on_cq_until(&rig.cq, &mut comps, "the second SEND", |c| status_of(c, 101).is_some());
    std::thread::sleep(2 * FRAME_TIMEOUT);
    let mut frame = Vec::new();
    push_send(&mut frame, 3, true, b"third");
    rig.raw.write_all(&frame).unwrap();
    sleep_on_cq_until(&rig.cq, &mut comps, "the third SEND", |c| status_of(c, 102).is_some());
    assert_eq!(
        order(&comps),
        [(WcOpcode::Recv, 100, WcStatus::Success), (WcOpcode::Recv, 101, WcStatus::Success), (WcOpcode::Recv, 102, WcStatus::Success)]
    );
    assert_eq!(rig.qp.state(), QpState::Ready);
}

#[test]
fn an_idle_queue_pair_does_not_wake_its_owner() {
    // After an exchange, the owner sleeps on the CQ: the deadline check
    // queued while the peer owed an acknowledgement may wake it once, and
    // then nothing does.
    let mut rig = passive_rig_with(short_timeouts());
    let tx = tx_of(&rig);
    send_and_read(&mut rig, &tx, 1, 1);
    rig.raw.write_all(&standalone_ack(1)).unwrap();
    let mut comps = Vec::new();
    sleep_on_cq_until(&rig.cq, &mut comps, "the SEND", |c| !c.is_empty());
    let mut wakes = 0;
    let until = Instant::now() + 3 * TRANSPORT_TIMEOUT;
    loop {
        let mut out = [Completion::EMPTY; 4];
        assert_eq!(rig.cq.poll(&mut out).unwrap(), 0);
        rig.cq.arm().unwrap();
        let left = until.saturating_duration_since(Instant::now());
        if left.is_zero() {
            break;
        }
        let mut pfd = libc::pollfd { fd: rig.cq.fd(), events: libc::POLLIN, revents: 0 };
        // SAFETY: valid pollfd for the call.
        if unsafe { libc::poll(&mut pfd, 1, left.as_millis() as i32) } == 1 {
            wakes += 1;
        }
        rig.cq.ack_event().unwrap();
    }
    assert!(wakes <= 1, "an idle queue pair woke its owner {wakes} times in {:?}", 3 * TRANSPORT_TIMEOUT);
    assert_eq!(rig.qp.state(), QpState::Ready);
}

#[test]
fn a_frames_deadline_grows_with_its_payload() {
    use super::qp::frame_deadline;
    let t0 = Instant::now();
    let ten = Duration::from_secs(10);
    assert_eq!(frame_deadline(t0, ten, 0), Some(t0 + ten));
    assert_eq!(frame_deadline(t0, ten, 1 << 20), Some(t0 + ten + Duration::from_secs(1)));
    assert_eq!(frame_deadline(t0, ten, wire::MAX_PAYLOAD), Some(t0 + ten + Duration::from_secs(1024)));
    assert_eq!(frame_deadline(t0, Duration::MAX, 64), None, "Duration::MAX is never");
}

#[test]
fn the_first_poll_after_a_wake_up_reads_the_queue_pair_that_brought_completions_last_and_the_next_poll_the_others() {
    // Two queue pairs on one CQ, as on a reactor that holds an idle
    // session besides a busy one. The first poll after a wake-up reads the
    // socket of the last completion's queue pair without asking epoll; a SEND
    // that arrived on the other socket meanwhile is not lost but comes with
    // the next poll (level-triggered epoll still reports it).
    let mut rig = passive_rig();
    let (busy, mut busy_raw, busy_rx) = accept_raw(&rig._listener, &rig.pd, &rig.cq);
    // Small frames leave at once (no Nagle wait for the ACK of the last).
    busy_raw.set_nodelay(true).unwrap();
    rig.raw.set_nodelay(true).unwrap();
    busy.post_recv(&[RecvWr { wr_id: WrId(101), sges: &[busy_rx.mr_sge(64, 64)] }]).unwrap();
    let mut frame = Vec::new();
    push_send(&mut frame, 1, false, b"first");
    busy_raw.write_all(&frame).unwrap();
    let mut comps = Vec::new();
    poll_until(&rig.cq, &mut comps, "the busy queue pair's first SEND", |c| !c.is_empty());
    assert_eq!(comps.iter().map(|c| (c.qp_num, c.wr_id.0)).collect::<Vec<_>>(), [(busy.qp_num(), 100)]);

    // The owner sleeps; the other queue pair's SEND arrives first, then
    // the busy one's, and the owner wakes.
    rig.cq.arm().unwrap();
    let mut frame = Vec::new();
    push_send(&mut frame, 1, false, b"other");
    rig.raw.write_all(&frame).unwrap();
    std::thread::sleep(Duration::from_millis(20));
    let mut frame = Vec::new();
    push_send(&mut frame, 2, false, b"second");
    busy_raw.write_all(&frame).unwrap();
    std::thread::sleep(Duration::from_millis(20));
    assert!(readable_within(rig.cq.fd(), DEADLINE), "the CQ fd is not readable");
    rig.cq.ack_event().unwrap();
    let mut out = [Completion::EMPTY; 16];
    let n = rig.cq.poll(&mut out).unwrap();
    let first: Vec<_> = out[..n].iter().map(|c| (c.qp_num, c.wr_id.0)).collect();
    let n = rig.cq.poll(&mut out).unwrap();
    let next: Vec<_> = out[..n].iter().map(|c| (c.qp_num, c.wr_id.0)).collect();
    assert_eq!(first, [(busy.qp_num(), 101)], "the first poll after the wake-up did not read the busy socket alone");
    assert_eq!(next, [(rig.qp.qp_num(), 100)], "the other queue pair's SEND did not come with the next poll");
}

// ---------------------------------------------- the receiving wait --

/// Polls `cq` into `comps` until `wr` completed, waiting in
/// `TcpCq::wait_receiving` between polls; every wait must be one (`None`
/// would mean the CQ fell back to its fd).
fn receive_until(cq: &TcpCq, comps: &mut Vec<Completion>, wr: u64) {
    let deadline = Instant::now() + DEADLINE;
    while status_of(comps, wr).is_none() {
        assert!(Instant::now() < deadline, "no completion of {wr}: {comps:?}");
        assert!(cq.wait_receiving(Some(DEADLINE)).is_some(), "the CQ could not wait in a receive");
        let mut out = [Completion::EMPTY; 16];
        let n = cq.poll(&mut out).unwrap();
        comps.extend_from_slice(&out[..n]);
    }
}

#[test]
fn a_receiving_wait_takes_each_answer_in_its_receive() {
    // Request and answer, as the initiator runs them: the client SENDs,
    // sleeps in the socket's receive, and the answer lands in its buffer
    // in the same call; the poll after it hands out the completions.
    let p = pair();
    let csrc = mem(&p.cpd, 4096, Access::LOCAL_WRITE);
    let cdst = mem(&p.cpd, 4096, Access::LOCAL_WRITE);
    let sbuf = mem(&p.spd, 4096, Access::LOCAL_WRITE);
    for round in 0..5u64 {
        p.cqp.post_recv(&[RecvWr { wr_id: WrId(100 + round), sges: &[cdst.mr_sge(0, 64)] }]).unwrap();
        p.sqp.post_recv(&[RecvWr { wr_id: WrId(200 + round), sges: &[sbuf.mr_sge(0, 64)] }]).unwrap();
        let sge = [csrc.mr_sge(0, 16)];
        let wr = SendWr { wr_id: WrId(300 + round), op: SendOp::Send, payload: Payload::Sges(&sge), signaled: true };
        p.cqp.post_send(&[wr]).unwrap();
        let mut sc = Vec::new();
        poll_until(&p.scq, &mut sc, "the request", |c| status_of(c, 200 + round).is_some());
        // SAFETY: the buffers are ours between operations.
        unsafe { sbuf.buf.as_mut_slice()[..32].fill(0xA0 + round as u8) };
        let answer = [sbuf.mr_sge(0, 32)];
        let wr = SendWr { wr_id: WrId(400 + round), op: SendOp::Send, payload: Payload::Sges(&answer), signaled: false };
        p.sqp.post_send(&[wr]).unwrap();
        let mut cc = Vec::new();
        receive_until(&p.ccq, &mut cc, 100 + round);
        assert_eq!(status_of(&cc, 100 + round), Some(WcStatus::Success), "{cc:?}");
        assert_eq!(cc.iter().find(|c| c.wr_id == WrId(100 + round)).unwrap().byte_len, 32);
        // SAFETY: the receive completed; nothing else writes the buffer.
        assert!(unsafe { cdst.buf.as_slice() }[..32].iter().all(|&b| b == 0xA0 + round as u8));
        // The answer carried the acknowledgement of the request.
        receive_until(&p.ccq, &mut cc, 300 + round);
        assert_eq!(status_of(&cc, 300 + round), Some(WcStatus::Success), "{cc:?}");
    }
}

#[test]
fn a_receiving_wait_ends_at_its_timeout_and_falls_back_when_that_is_too_short() {
    let p = pair();
    let cdst = mem(&p.cpd, 4096, Access::LOCAL_WRITE);
    p.cqp.post_recv(&[RecvWr { wr_id: WrId(1), sges: &[cdst.mr_sge(0, 64)] }]).unwrap();
    assert_eq!(p.ccq.wait_receiving(Some(Duration::from_millis(40))), Some(false));
    let mut out = [Completion::EMPTY; 4];
    assert_eq!(p.ccq.poll(&mut out).unwrap(), 0);
    // Below the kernel tick's reach: the caller sleeps on the fd instead.
    assert_eq!(p.ccq.wait_receiving(Some(Duration::from_millis(5))), None);
    // A completion already queued ends the wait before any receive: a
    // poll with no room leaves the receive's completion queued.
    let sbuf = mem(&p.spd, 4096, Access::LOCAL_WRITE);
    // SAFETY: nothing else uses the buffer yet.
    unsafe { sbuf.buf.as_mut_slice() }.fill(0x77);
    let sge = [sbuf.mr_sge(0, 8)];
    p.sqp.post_send(&[SendWr { wr_id: WrId(2), op: SendOp::Send, payload: Payload::Sges(&sge), signaled: false }]).unwrap();
    let deadline = Instant::now() + DEADLINE;
    while cdst_filled(&cdst) == 0 {
        assert!(Instant::now() < deadline, "the SEND never arrived");
        p.ccq.poll(&mut []).unwrap();
    }
    assert_eq!(p.ccq.wait_receiving(Some(DEADLINE)), Some(true));
    let mut out = [Completion::EMPTY; 4];
    assert_eq!(p.ccq.poll(&mut out).unwrap(), 1);
    assert_eq!((out[0].wr_id, out[0].status, out[0].byte_len), (WrId(1), WcStatus::Success, 8));
}

/// How many of the first 8 bytes of `m` are not zero (the client's
/// buffer before and after the peer's SEND of non-zero bytes).
fn cdst_filled(m: &Mem) -> usize {
    // SAFETY: a racy read of bytes the provider may be placing: only
    // used to see that they arrived.
    let bytes = unsafe { m.buf.as_slice() };
    bytes[..8].iter().filter(|&&b| b != 0).count()
}

#[test]
fn a_receiving_wait_wakes_when_the_peer_leaves() {
    let p = pair();
    let cdst = mem(&p.cpd, 4096, Access::LOCAL_WRITE);
    p.cqp.post_recv(&[RecvWr { wr_id: WrId(1), sges: &[cdst.mr_sge(0, 64)] }]).unwrap();
    let Pair { ccq, cqp, sqp, .. } = p;
    let leaver = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(50));
        drop(sqp);
    });
    // Woken by the end of the stream, not by the (longer) timeout.
    assert_eq!(ccq.wait_receiving(Some(DEADLINE)), Some(true));
    leaver.join().unwrap();
    let mut cc = Vec::new();
    poll_until(&ccq, &mut cc, "the flushed receive", |c| status_of(c, 1).is_some());
    assert_eq!(status_of(&cc, 1), Some(WcStatus::WrFlushError));
    assert_eq!(cqp.state(), QpState::Error);
}

#[test]
fn a_receiving_wait_leaves_a_due_deadline_check_to_the_fd() {
    // The client's SEND is never acknowledged (the server's owner never
    // polls). Its transport timeout is due sooner than a receive's timeout
    // can be trusted to end, so the CQ refuses to sleep in the receive:
    // the check's timer on the fd must wake the owner.
    let p = pair_with(FabricOptions { transport_timeout: Duration::from_millis(10), ..short_timeouts() });
    let csrc = mem(&p.cpd, 4096, Access::LOCAL_WRITE);
    let sge = [csrc.mr_sge(0, 16)];
    p.cqp.post_send(&[SendWr { wr_id: WrId(1), op: SendOp::Send, payload: Payload::Sges(&sge), signaled: true }]).unwrap();
    assert_eq!(p.ccq.wait_receiving(Some(DEADLINE)), None);
    let mut cc = Vec::new();
    poll_until(&p.ccq, &mut cc, "the transport error", |c| status_of(c, 1).is_some());
    assert_eq!(status_of(&cc, 1), Some(WcStatus::TransportError));
}

#[test]
fn a_receiving_wait_needs_a_cq_with_one_queue_pair() {
    let p = pair();
    // A second queue pair on the client's CQ, connected to the same server.
    let fabric = TcpFabric::open(&p._listener.local_url()).unwrap();
    let second = fabric.create_qp(&p.cpd, &p.ccq, QpCaps::default()).unwrap();
    let connecting = std::thread::spawn(move || {
        let r = second.connect(b"", DEADLINE);
        (second, r)
    });
    let deadline = Instant::now() + DEADLINE;
    let req = loop {
        if let Some(r) = p._listener.poll_request().unwrap() {
            break r;
        }
        assert!(Instant::now() < deadline);
        std::thread::sleep(Duration::from_millis(1));
    };
    let server_side = req.into_queue_pair(&p.spd, &p.scq, QpCaps::default()).unwrap();
    server_side.accept(b"").unwrap();
    let (second, r) = connecting.join().unwrap();
    r.unwrap();
    assert_eq!(p.ccq.wait_receiving(Some(Duration::from_millis(40))), None, "two queue pairs, one receive");
    drop(second);
    assert_eq!(p.ccq.wait_receiving(Some(Duration::from_millis(40))), Some(false), "one queue pair again");
    // The passive side's socket does not block: its CQ sleeps on the fd.
    assert_eq!(p.scq.wait_receiving(Some(Duration::from_millis(40))), None);
}

#[test]
fn the_poll_after_a_receiving_wait_leaves_the_answers_ack_to_the_next_request() {
    // The initiator's CQ holds ACKs with a zero hold: the ACK of an answer
    // rides on the next request. The poll that hands out what a receiving
    // wait brought must not send it on its own first (a frame and a
    // wake-up of the peer per I/O).
    let p = pair();
    p.ccq.set_ack_coalescing(Some(Duration::ZERO));
    let cbuf = mem(&p.cpd, 4096, Access::LOCAL_WRITE);
    let sbuf = mem(&p.spd, 4096, Access::LOCAL_WRITE);
    p.cqp.post_recv(&[RecvWr { wr_id: WrId(1), sges: &[cbuf.mr_sge(0, 64)] }]).unwrap();
    p.sqp.post_recv(&[RecvWr { wr_id: WrId(2), sges: &[sbuf.mr_sge(0, 64)] }]).unwrap();
    // The answer is signaled: its send completes when the client ACKs it.
    let answer = [sbuf.mr_sge(0, 16)];
    p.sqp.post_send(&[SendWr { wr_id: WrId(3), op: SendOp::Send, payload: Payload::Sges(&answer), signaled: true }]).unwrap();
    let mut cc = Vec::new();
    receive_until(&p.ccq, &mut cc, 1);
    let mut sc = Vec::new();
    let quiet_until = Instant::now() + Duration::from_millis(50);
    while Instant::now() < quiet_until {
        let mut out = [Completion::EMPTY; 4];
        let n = p.scq.poll(&mut out).unwrap();
        sc.extend_from_slice(&out[..n]);
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(status_of(&sc, 3), None, "the answer's ACK left on its own: {sc:?}");
    // The next request carries it.
    let request = [cbuf.mr_sge(0, 16)];
    p.cqp.post_send(&[SendWr { wr_id: WrId(4), op: SendOp::Send, payload: Payload::Sges(&request), signaled: false }]).unwrap();
    poll_until(&p.scq, &mut sc, "the request and the answer's completion", |c| {
        status_of(c, 2).is_some() && status_of(c, 3).is_some()
    });
    assert_eq!(status_of(&sc, 3), Some(WcStatus::Success));
}
