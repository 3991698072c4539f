//! `tcp_frames`: the tcp provider's frame stream, fed by a plain
//! `std::net::TcpStream` to a live passive endpoint built with the public
//! fabric API only.
//!
//! # Input
//!
//! Byte 0 is a control byte, the rest is written to the socket:
//!
//! | bits | meaning |
//! |---|---|
//! | 0 | write a valid HELLO first (else the input must bring its own) |
//! | 1 | after `accept`, the endpoint posts a SEND, an RDMA WRITE and an RDMA READ (seqs 1, 2, 3) |
//! | 2..5 | number of receives posted before `accept` (0..=7) |
//! | 5 | scatter: every receive, and the endpoint's RDMA READ, uses two SGEs with a gap between them |
//! | 6 | window: after `accept`, the endpoint binds a memory window (remote read and write) over the second half of [`Region::LocalOnly`] |
//!
//! The stream is walked frame by frame (32-byte header, `length` payload
//! for frames that carry one) and every WRITE or READ_REQ whose rkey field
//! is a small index (see [`Region`]; [`WINDOW_INDEX`] names the window) is
//! *relocated*: the rkey becomes that region's (or window's) real rkey and
//! the address field an offset from its start; so is the rkey of a SEND
//! with the INVALIDATE flag (SEND with Invalidate), whose address field is
//! left alone. Keys are random and addresses differ between processes, so
//! without this the fuzzer could never name registered memory; other rkey
//! values pass through unchanged. The bytes after the first frame (the
//! hello) are held back and relocated once the endpoint has accepted, when
//! the window's key is known; the endpoint reads nothing of them before.
//!
//! # What one run does
//!
//! A listener on `tcp://127.0.0.1:0` and one arena of memory live for the
//! whole process. Each run creates a protection domain, registers the
//! arena's regions with different rights, creates a completion queue,
//! connects the raw client, writes the bytes, shuts the client's write side
//! and drives the endpoint (listener, then the CQ) until the connection
//! attempt is dropped, or the queue pair is in the error state and every
//! work request it accepted has completed. Everything but the listener and
//! the arena is dropped at the end of the run.
//!
//! # Invariants checked
//!
//! - No panic, no hang (a run that has not ended after 10 s is a bug: the
//!   client's EOF must always move the queue pair to the error state).
//! - Memory: the arena is filled with a known pattern before each run. After
//!   it, a byte may differ only where a peer or the provider was allowed to
//!   write: anywhere in the region with remote-write rights; in a receive
//!   slot up to `byte_len` of its successful completion, filled SGE by SGE
//!   (all of its SGEs if it failed); in the RDMA READ's SGEs. The guard pages
//!   between regions, the region with only remote-read rights, the region
//!   without rights, the gaps between SGEs and the receive bytes beyond the
//!   posted SGEs never change; the window's bytes only if it was bound.
//! - Completions: every posted work request completes exactly once, with its
//!   own opcode and the queue pair's number, in posting order per queue; a
//!   successful receive reports at most the posted length, a successful READ
//!   exactly the length asked for. Only a successful receive reports an
//!   invalidated key, only the window's, and only once.
//! - The hello private data the listener reports is the one the client sent.

use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::sync::{Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use rdmablk_common::fabric::{
    Access, AlignedBuf, Completion, CompletionQueue, Fabric, FabricUrl, Listener, MemoryRegion, MemoryWindow, Payload,
    ProtectionDomain, QpCaps, QpState, QueuePair, RecvWr, Rkey, SendOp, SendWr, WcOpcode, WcStatus, WrId,
};

/// Frame header length of the tcp provider (common/src/fabric/tcp/wire.rs).
pub const HDR_LEN: usize = 32;
/// Fixed part of a HELLO body.
pub const HELLO_FIXED: usize = 32;
/// Frame types (wire.rs `FrameType`).
pub const TY_HELLO: u8 = 1;
pub const TY_HELLO_REPLY: u8 = 2;
pub const TY_SEND: u8 = 3;
pub const TY_WRITE: u8 = 4;
pub const TY_READ_REQ: u8 = 5;
pub const TY_READ_RESP: u8 = 6;
pub const TY_ACK: u8 = 7;
pub const TY_TERMINATE: u8 = 8;
pub const TY_DISCONNECT: u8 = 9;
/// Header flag: the sender wants an acknowledgement.
pub const FLAG_ACK_REQUESTED: u8 = 1;
/// Header flag (SEND only): a SEND with Invalidate of the rkey field.
pub const FLAG_INVALIDATE: u8 = 2;

/// Control byte bits.
pub const CTL_HELLO: u8 = 1;
pub const CTL_SERVER_SENDS: u8 = 2;
pub const CTL_RECVS_SHIFT: u32 = 2;
const CTL_RECVS_MASK: u8 = 0x7;
pub const CTL_SCATTER: u8 = 0x20;
pub const CTL_WINDOW: u8 = 0x40;
/// Bytes left out between the two SGEs of a scattered receive or READ.
const SCATTER_GAP: usize = 32;

/// The private data of the HELLO the harness writes.
pub const CLIENT_PRIVATE: &[u8] = b"fuzz-client";
const SERVER_PRIVATE: &[u8] = b"fuzz-server";

/// Size of each region and of each guard page around them.
const SECTION: usize = 4096;
/// Receive slots in the receive region, and the length each receive posts
/// (the rest of a slot must never be written).
const SLOT: usize = 256;
pub const RECV_LEN: u32 = 192;
/// The endpoint's own send-queue work requests (control bit 1).
pub const SERVER_SEND_LEN: u32 = 48;
pub const SERVER_WRITE_LEN: u32 = 64;
pub const SERVER_READ_LEN: u32 = 128;
/// The window (control bit 6) covers this part of [`Region::LocalOnly`].
const WINDOW_OFFSET: usize = SECTION / 2;
const WINDOW_LEN: usize = SECTION / 2;
/// The rkey field value that names the window in the fuzz input.
pub const WINDOW_INDEX: u32 = Region::ALL.len() as u32;
/// Where the endpoint's WRITE and READ point in the client's (fake) memory.
const CLIENT_WRITE_ADDR: u64 = 0x10_0000;
const CLIENT_READ_ADDR: u64 = 0x20_0000;
const CLIENT_RKEY: u32 = 0x1234_5678;

/// Most bytes of the endpoint's output kept for [`Outcome::received`].
const MAX_KEPT: usize = 1 << 20;
/// How long one run may take before it counts as a hang.
const RUN_DEADLINE: Duration = Duration::from_secs(10);

/// The registered regions, in arena order. `index` is what the fuzzer
/// writes in the rkey field of a WRITE or READ_REQ to name the region.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Region {
    /// LOCAL_WRITE | REMOTE_WRITE | REMOTE_READ: peers may write anywhere.
    RemoteWrite,
    /// REMOTE_READ only: must never change.
    RemoteRead,
    /// LOCAL_WRITE | MW_BIND: the endpoint's RDMA READ lands at its start;
    /// peers reach its second half only through the window (control bit 6).
    LocalOnly,
    /// No rights (local read): the source of the endpoint's SEND and WRITE.
    NoRights,
    /// LOCAL_WRITE: the receive slots.
    Receives,
}

impl Region {
    /// In rkey-index order.
    pub const ALL: [Region; 5] =
        [Region::RemoteWrite, Region::RemoteRead, Region::LocalOnly, Region::NoRights, Region::Receives];

    fn access(self) -> Access {
        match self {
            Region::RemoteWrite => Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ,
            Region::RemoteRead => Access::REMOTE_READ,
            Region::LocalOnly => Access::LOCAL_WRITE | Access::MW_BIND,
            Region::Receives => Access::LOCAL_WRITE,
            Region::NoRights => Access::NONE,
        }
    }

    /// The rkey field value that names this region in the fuzz input.
    pub fn index(self) -> u32 {
        self as u32
    }

    /// Offset of the region in the arena: guard, region, guard, region, ...
    fn offset(self) -> usize {
        (2 * self as usize + 1) * SECTION
    }
}

const ARENA_LEN: usize = (2 * Region::ALL.len() + 1) * SECTION;

/// What lives for the whole process.
struct Rig {
    fabric: Fabric,
    listener: Listener,
    arena: AlignedBuf,
}

fn rig() -> MutexGuard<'static, Rig> {
    static RIG: OnceLock<Mutex<Rig>> = OnceLock::new();
    let rig = RIG.get_or_init(|| {
        let url = FabricUrl::parse("tcp://127.0.0.1:0").expect("url");
        let fabric = Fabric::open(&url).expect("open the tcp fabric");
        let listener = fabric.listen().expect("listen on 127.0.0.1:0");
        Mutex::new(Rig { fabric, listener, arena: AlignedBuf::new(ARENA_LEN, SECTION) })
    });
    // A failed run panics (the fuzzer stops there), so a poisoned lock only
    // means an earlier test failed; the rig itself is still usable.
    rig.lock().unwrap_or_else(|e| e.into_inner())
}

/// The arena's byte at `i` before every run: varies along the arena so a
/// shifted or misdirected write shows.
fn pattern(i: usize) -> u8 {
    ((i as u32).wrapping_mul(2_654_435_761) >> 24) as u8
}

/// The decoded control byte.
#[derive(Clone, Copy, Debug)]
struct Control {
    hello: bool,
    server_sends: bool,
    recvs: usize,
    scatter: bool,
    window: bool,
}

impl Control {
    fn parse(b: u8) -> Control {
        Control {
            hello: b & CTL_HELLO != 0,
            server_sends: b & CTL_SERVER_SENDS != 0,
            recvs: ((b >> CTL_RECVS_SHIFT) & CTL_RECVS_MASK) as usize,
            scatter: b & CTL_SCATTER != 0,
            window: b & CTL_WINDOW != 0,
        }
    }

    /// The (offset, length) SGEs covering `len` bytes at `base`: one, or
    /// two halves with a gap between them.
    fn sges(self, base: usize, len: u32) -> Vec<(usize, u32)> {
        if self.scatter {
            let first = len / 2;
            vec![(base, first), (base + first as usize + SCATTER_GAP, len - first)]
        } else {
            vec![(base, len)]
        }
    }
}

/// Whether byte `at` receives data when `n` bytes are placed into `sges`
/// in order (`n = None`: a failed operation, whose SGEs are undefined).
fn placed(sges: &[(usize, u32)], n: Option<u32>, at: usize) -> bool {
    let mut left = n.unwrap_or(u32::MAX) as usize;
    for &(offset, len) in sges {
        let filled = left.min(len as usize);
        if (offset..offset + filled).contains(&at) {
            return true;
        }
        left -= filled;
    }
    false
}

/// The control byte for these choices (for seeds and tests).
pub fn control(hello: bool, server_sends: bool, recvs: u8) -> u8 {
    assert!(recvs <= CTL_RECVS_MASK);
    let mut b = recvs << CTL_RECVS_SHIFT;
    if hello {
        b |= CTL_HELLO;
    }
    if server_sends {
        b |= CTL_SERVER_SENDS;
    }
    b
}

/// A frame header (wire.rs layout).
#[derive(Clone, Copy, Debug, Default)]
pub struct Frame {
    pub ty: u8,
    pub flags: u8,
    pub seq: u32,
    pub ack: u32,
    pub length: u32,
    pub remote_addr: u64,
    pub rkey: u32,
    pub aux: u32,
}

impl Frame {
    pub fn new(ty: u8) -> Frame {
        Frame { ty, ..Frame::default() }
    }

    /// The 32 header bytes.
    pub fn encode(&self) -> [u8; HDR_LEN] {
        let mut b = [0u8; HDR_LEN];
        b[0] = self.ty;
        b[1] = self.flags;
        b[4..8].copy_from_slice(&self.seq.to_le_bytes());
        b[8..12].copy_from_slice(&self.ack.to_le_bytes());
        b[12..16].copy_from_slice(&self.length.to_le_bytes());
        b[16..24].copy_from_slice(&self.remote_addr.to_le_bytes());
        b[24..28].copy_from_slice(&self.rkey.to_le_bytes());
        b[28..32].copy_from_slice(&self.aux.to_le_bytes());
        b
    }
}

/// A HELLO frame with default queue sizes and `private` data.
pub fn hello(private: &[u8]) -> Vec<u8> {
    let body_len = HELLO_FIXED + private.len();
    let mut out = Frame { length: body_len as u32, ..Frame::new(TY_HELLO) }.encode().to_vec();
    out.extend_from_slice(b"RDBK");
    out.extend_from_slice(&1u16.to_le_bytes());
    out.extend_from_slice(&(private.len() as u16).to_le_bytes());
    out.extend_from_slice(&0u32.to_le_bytes());
    let caps = QpCaps::default();
    for c in [caps.max_send_wr, caps.max_recv_wr, caps.max_send_sge, caps.max_recv_sge, caps.max_inline_data] {
        out.extend_from_slice(&c.to_le_bytes());
    }
    out.extend_from_slice(private);
    out
}

/// Rewrites WRITE and READ_REQ frames that name a region (or the window)
/// by index, and the rkey of SEND with Invalidate frames (see the module
/// doc). `regions[i]` is index i's (start address, rkey).
fn relocate(stream: &mut [u8], regions: &[(u64, u32)]) {
    let u32_at = |b: &[u8], o: usize| u32::from_le_bytes([b[o], b[o + 1], b[o + 2], b[o + 3]]);
    let mut pos = 0usize;
    while pos.checked_add(HDR_LEN).is_some_and(|end| end <= stream.len()) {
        let h = &mut stream[pos..pos + HDR_LEN];
        let ty = h[0];
        let length = u32_at(h, 12) as usize;
        let named = regions.get(u32_at(h, 24) as usize).copied();
        if ty == TY_WRITE || ty == TY_READ_REQ {
            if let Some((base, rkey)) = named {
                let mut offset = [0u8; 8];
                offset.copy_from_slice(&h[16..24]);
                let addr = base.wrapping_add(u64::from_le_bytes(offset));
                h[16..24].copy_from_slice(&addr.to_le_bytes());
                h[24..28].copy_from_slice(&rkey.to_le_bytes());
            }
        } else if ty == TY_SEND && h[1] & FLAG_INVALIDATE != 0 {
            if let Some((_, rkey)) = named {
                h[24..28].copy_from_slice(&rkey.to_le_bytes());
            }
        }
        let payload = match ty {
            TY_HELLO | TY_HELLO_REPLY | TY_SEND | TY_WRITE | TY_READ_RESP => length,
            _ => 0,
        };
        pos = pos.saturating_add(HDR_LEN).saturating_add(payload);
    }
}

/// Work request ids: receives are `RECV_BASE + slot`.
const WR_SEND: u64 = 1;
const WR_WRITE: u64 = 2;
const WR_READ: u64 = 3;
const RECV_BASE: u64 = 100;

/// Where the first frame (the hello the listener reads) ends in `stream`:
/// the bytes after it are held back until the endpoint accepted.
fn first_frame_end(stream: &[u8]) -> usize {
    if stream.len() < HDR_LEN {
        return stream.len();
    }
    let length = u32::from_le_bytes([stream[12], stream[13], stream[14], stream[15]]) as usize;
    HDR_LEN.saturating_add(length).min(stream.len())
}

/// The per-run fabric objects. Field order is drop order: the window and
/// the queue pair go first, then the regions, the domain and the CQ.
struct Endpoint {
    window: Option<MemoryWindow>,
    qp: Option<QueuePair>,
    regions: Vec<MemoryRegion>,
    pd: ProtectionDomain,
    cq: CompletionQueue,
}

/// What the run posted and saw complete.
#[derive(Default)]
struct Ledger {
    posted_sends: Vec<u64>,
    posted_recvs: Vec<u64>,
    completions: Vec<Completion>,
    /// The window's rkey, once bound.
    window: Option<Rkey>,
}

impl Ledger {
    fn all_complete(&self) -> bool {
        self.completions.len() == self.posted_sends.len() + self.posted_recvs.len()
    }

    fn completion(&self, wr: u64) -> Option<&Completion> {
        self.completions.iter().find(|c| c.wr_id == WrId(wr))
    }
}

/// What a run did, for the tests that check the harness reaches the
/// states it aims at.
#[derive(Debug, Default)]
pub struct Outcome {
    /// The listener produced a connection request and the endpoint accepted.
    pub connected: bool,
    /// Every completion, in the order polled.
    pub completions: Vec<Completion>,
    /// The bytes the endpoint sent to the raw client (frames).
    pub received: Vec<u8>,
    /// Contents of the regions after the run, in [`Region::ALL`] order.
    pub regions: Vec<Vec<u8>>,
}

/// The harness.
pub fn run(data: &[u8]) {
    run_with_outcome(data);
}

/// The harness, returning what happened.
pub fn run_with_outcome(data: &[u8]) -> Outcome {
    let Some((&ctl, rest)) = data.split_first() else { return Outcome::default() };
    let ctl = Control::parse(ctl);
    let rig = rig();

    // SAFETY: no region of the arena is registered between runs (every run
    // drops its regions before it returns), so nothing else accesses it.
    let arena = unsafe { rig.arena.as_mut_slice() };
    for (i, b) in arena.iter_mut().enumerate() {
        *b = pattern(i);
    }

    let pd = rig.fabric.alloc_pd().expect("alloc_pd");
    let cq = rig.fabric.create_cq(64).expect("create_cq");
    let mut regions = Vec::with_capacity(Region::ALL.len());
    for r in Region::ALL {
        // SAFETY: the range lies inside the arena, which lives for the whole
        // process; the region is dropped at the end of this run, and the
        // arena is only read or written here while no region is registered.
        let mr = unsafe { pd.register(rig.arena.as_ptr().add(r.offset()), SECTION, r.access()) }
            .unwrap_or_else(|e| panic!("registering {r:?}: {e}"));
        regions.push(mr);
    }
    let mut ep = Endpoint { window: None, qp: None, regions, pd, cq };

    let mut stream = if ctl.hello { hello(CLIENT_PRIVATE) } else { Vec::new() };
    stream.extend_from_slice(rest);
    let held = stream.split_off(first_frame_end(&stream));

    let mut ledger = Ledger::default();
    let mut received = Vec::new();
    drive(&rig, &mut ep, stream, held, ctl, &mut ledger, &mut received);

    let qp_num = ep.qp.as_ref().map(|qp| qp.qp_num());
    // The window goes before the last poll, as a host drops it once the
    // peer is done: a receive that reported it invalidated lets the drop
    // post nothing.
    drop(ep.window.take());
    // One more poll: nothing may complete twice or late.
    let mut out = [Completion::EMPTY; 16];
    let late = ep.cq.poll(&mut out).expect("poll");
    assert_eq!(late, 0, "completions after every work request completed: {:?}", &out[..late]);
    drop(ep);

    check_completions(&ledger, qp_num);
    // SAFETY: every region of this run is dropped (deregistered), so the
    // provider no longer touches the arena.
    let arena = unsafe { rig.arena.as_slice() };
    check_memory(arena, &ledger, ctl);
    Outcome {
        connected: qp_num.is_some(),
        regions: Region::ALL.iter().map(|r| arena[r.offset()..r.offset() + SECTION].to_vec()).collect(),
        completions: ledger.completions,
        received,
    }
}

/// Writes the stream (`stream`, then `held` once the endpoint accepted,
/// relocated) and drives the endpoint until the run is over.
fn drive(
    rig: &Rig,
    ep: &mut Endpoint,
    mut stream: Vec<u8>,
    held: Vec<u8>,
    ctl: Control,
    ledger: &mut Ledger,
    received: &mut Vec<u8>,
) {
    let mut client = TcpStream::connect(rig.listener.local_url().host_port()).expect("connect the raw client");
    client.set_nonblocking(true).expect("O_NONBLOCK on the client");
    let deadline = Instant::now() + RUN_DEADLINE;
    let mut held = Some(held).filter(|h| !h.is_empty());
    let mut written = 0;
    let mut shut = false;
    let mut client_eof = false;
    loop {
        if let Some(mut rest) = held.take_if(|_| ep.qp.is_some()) {
            // Accepted (and the window bound): the keys are all known.
            let mut keys: Vec<(u64, u32)> = ep.regions.iter().map(|m| (m.addr(), m.rkey().0)).collect();
            let base = ep.regions[Region::LocalOnly as usize].addr() + WINDOW_OFFSET as u64;
            keys.extend(ep.window.as_ref().map(|w| (base, w.rkey().0)));
            relocate(&mut rest, &keys);
            stream.extend_from_slice(&rest);
        }
        // Client: write what the socket takes, then EOF; drain what comes back.
        if written < stream.len() {
            match client.write(&stream[written..]) {
                Ok(n) => written += n,
                Err(e) if e.kind() == ErrorKind::WouldBlock || e.kind() == ErrorKind::Interrupted => {}
                // The endpoint closed on us: the rest cannot be delivered.
                Err(_) => written = stream.len(),
            }
        }
        if written == stream.len() && held.is_none() && !shut {
            let _ = client.shutdown(Shutdown::Write);
            shut = true;
        }
        client_eof |= drain(&mut client, received);

        match &ep.qp {
            None => {
                if let Some(req) = rig.listener.poll_request().expect("poll_request") {
                    check_private_data(&stream, ctl, req.private_data());
                    let caps =
                        QpCaps { max_send_wr: 8, max_recv_wr: 8, max_send_sge: 2, max_recv_sge: 2, max_inline_data: 64 };
                    let qp = req.into_queue_pair(&ep.pd, &ep.cq, caps).expect("into_queue_pair");
                    open(ep, qp, ctl, ledger);
                } else if client_eof {
                    // The listener dropped the connection during the hello
                    // (a whole first frame always makes it decide, so bytes
                    // held back behind it never leave it waiting).
                    return;
                }
            }
            Some(qp) => {
                let mut out = [Completion::EMPTY; 16];
                let n = ep.cq.poll(&mut out).expect("poll");
                ledger.completions.extend_from_slice(&out[..n]);
                if qp.state() == QpState::Error && ledger.all_complete() {
                    // What the last poll sent (a READ_RESP, a TERMINATE).
                    drain(&mut client, received);
                    return;
                }
            }
        }
        assert!(
            Instant::now() < deadline,
            "run did not end within {RUN_DEADLINE:?}: written {written}/{} bytes, client EOF {client_eof}, qp {:?}, \
             {} of {} work requests completed",
            stream.len(),
            ep.qp.as_ref().map(|q| q.state()),
            ledger.completions.len(),
            ledger.posted_sends.len() + ledger.posted_recvs.len(),
        );
    }
}

/// Reads what the endpoint sent so far without blocking; true at EOF (or
/// a reset).
fn drain(client: &mut TcpStream, received: &mut Vec<u8>) -> bool {
    let mut sink = [0u8; 4096];
    loop {
        match client.read(&mut sink) {
            Ok(0) => return true,
            Ok(n) => {
                if received.len() < MAX_KEPT {
                    received.extend_from_slice(&sink[..n]);
                }
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock => return false,
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(_) => return true,
        }
    }
}

/// The private data of the hello the listener accepted must be the one in
/// the first frame of the stream.
fn check_private_data(stream: &[u8], ctl: Control, private: &[u8]) {
    if ctl.hello {
        assert_eq!(private, CLIENT_PRIVATE, "listener reports other private data than the client sent");
    } else {
        let body = stream.get(HDR_LEN + HELLO_FIXED..).unwrap_or(&[]);
        assert!(body.starts_with(private), "listener reports private data that is not in the client's hello");
    }
}

/// Posts the receives, accepts, then posts the endpoint's own requests.
fn open(ep: &mut Endpoint, qp: QueuePair, ctl: Control, ledger: &mut Ledger) {
    let recv_mr = &ep.regions[Region::Receives as usize];
    for slot in 0..ctl.recvs {
        let wr = RECV_BASE + slot as u64;
        let sges: Vec<_> = ctl.sges(slot * SLOT, RECV_LEN).into_iter().map(|(o, l)| recv_mr.sge(o, l)).collect();
        if qp.post_recv(&[RecvWr { wr_id: WrId(wr), sges: &sges }]).is_ok() {
            ledger.posted_recvs.push(wr);
        }
    }
    // A failed accept leaves the queue pair in the error state; the run
    // then waits for the flushes like any other.
    let accepted = qp.accept(SERVER_PRIVATE).is_ok();
    if ctl.window && accepted {
        let parent = &ep.regions[Region::LocalOnly as usize];
        let access = Access::REMOTE_READ | Access::REMOTE_WRITE;
        let w = qp.bind_window(parent.rkey(), parent.addr() + WINDOW_OFFSET as u64, WINDOW_LEN as u64, access);
        let w = w.expect("bind the window over LocalOnly");
        ledger.window = Some(w.rkey());
        ep.window = Some(w);
    }
    if ctl.server_sends {
        let src = &ep.regions[Region::NoRights as usize];
        let dst = &ep.regions[Region::LocalOnly as usize];
        let send_sge = [src.sge(0, SERVER_SEND_LEN)];
        let write_sge = [src.sge(256, SERVER_WRITE_LEN)];
        let read_sge: Vec<_> = ctl.sges(0, SERVER_READ_LEN).into_iter().map(|(o, l)| dst.sge(o, l)).collect();
        let wrs = [
            (WR_SEND, SendOp::Send, &send_sge[..]),
            (WR_WRITE, SendOp::RdmaWrite { remote_addr: CLIENT_WRITE_ADDR, rkey: Rkey(CLIENT_RKEY) }, &write_sge[..]),
            (WR_READ, SendOp::RdmaRead { remote_addr: CLIENT_READ_ADDR, rkey: Rkey(CLIENT_RKEY) }, &read_sge[..]),
        ];
        for (wr, op, sges) in wrs {
            let req = SendWr { wr_id: WrId(wr), op, payload: Payload::Sges(sges), signaled: true };
            if qp.post_send(&[req]).is_ok() {
                ledger.posted_sends.push(wr);
            }
        }
    }
    ep.qp = Some(qp);
}

fn check_completions(ledger: &Ledger, qp_num: Option<rdmablk_common::fabric::QpNum>) {
    let mut seen_sends = Vec::new();
    let mut seen_recvs = Vec::new();
    let mut invalidations = 0;
    for c in &ledger.completions {
        assert_eq!(Some(c.qp_num), qp_num, "completion of another queue pair: {c:?}");
        if c.invalidated_rkey.is_some() {
            assert!(c.opcode == WcOpcode::Recv && c.status == WcStatus::Success, "an invalidated key on {c:?}");
            assert_eq!(c.invalidated_rkey, ledger.window, "an invalidated key that is not the window's: {c:?}");
            invalidations += 1;
            assert_eq!(invalidations, 1, "the window reported invalidated twice: {:?}", ledger.completions);
        }
        let wr = c.wr_id.0;
        let expected_opcode = match wr {
            WR_SEND => WcOpcode::Send,
            WR_WRITE => WcOpcode::RdmaWrite,
            WR_READ => WcOpcode::RdmaRead,
            _ => WcOpcode::Recv,
        };
        assert_eq!(c.opcode, expected_opcode, "wrong opcode: {c:?}");
        if c.opcode == WcOpcode::Recv {
            assert!(ledger.posted_recvs.contains(&wr), "completion of a receive never posted: {c:?}");
            assert!(!seen_recvs.contains(&wr), "receive completed twice: {c:?}");
            seen_recvs.push(wr);
            if c.status == WcStatus::Success {
                assert!(c.byte_len <= RECV_LEN, "receive of {} bytes into {RECV_LEN}: {c:?}", c.byte_len);
            }
        } else {
            assert!(ledger.posted_sends.contains(&wr), "completion of a send never posted: {c:?}");
            assert!(!seen_sends.contains(&wr), "send completed twice: {c:?}");
            seen_sends.push(wr);
            if c.opcode == WcOpcode::RdmaRead && c.status == WcStatus::Success {
                assert_eq!(c.byte_len, SERVER_READ_LEN, "READ byte_len: {c:?}");
            }
        }
    }
    assert_eq!(seen_sends, ledger.posted_sends, "send queue completions out of posting order (or missing)");
    assert_eq!(seen_recvs, ledger.posted_recvs, "receive completions out of posting order (or missing)");
}

/// Which bytes of the arena may differ from the pattern after the run.
fn may_change(i: usize, ledger: &Ledger, ctl: Control) -> bool {
    let section = i / SECTION;
    let within = i % SECTION;
    let region = Region::ALL.into_iter().find(|r| r.offset() / SECTION == section);
    match region {
        // Guards.
        None => false,
        Some(Region::RemoteWrite) => true,
        Some(Region::RemoteRead | Region::NoRights) => false,
        Some(Region::LocalOnly) => {
            (ledger.posted_sends.contains(&WR_READ) && placed(&ctl.sges(0, SERVER_READ_LEN), None, within))
                || (ledger.window.is_some() && (WINDOW_OFFSET..WINDOW_OFFSET + WINDOW_LEN).contains(&within))
        }
        Some(Region::Receives) => {
            let (slot, offset) = (within / SLOT, within % SLOT);
            let sges = ctl.sges(0, RECV_LEN);
            match ledger.completion(RECV_BASE + slot as u64) {
                None => false,
                Some(c) if c.status == WcStatus::Success => placed(&sges, Some(c.byte_len), offset),
                // A failed receive's buffer is undefined, as in verbs, but
                // only within its SGEs.
                Some(_) => placed(&sges, None, offset),
            }
        }
    }
}

fn check_memory(arena: &[u8], ledger: &Ledger, ctl: Control) {
    for (i, &b) in arena.iter().enumerate() {
        if b != pattern(i) && !may_change(i, ledger, ctl) {
            let section = i / SECTION;
            let region = Region::ALL.into_iter().find(|r| r.offset() / SECTION == section);
            panic!(
                "arena byte {i} ({} + {}) changed from {:#04x} to {b:#04x}; completions {:?}",
                region.map_or_else(|| "guard page".to_owned(), |r| format!("{r:?}")),
                i % SECTION,
                pattern(i),
                ledger.completions,
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn relocation_rewrites_only_indexed_writes_and_reads() {
        let regions = [(0x1000u64, 0xAAAA_AAAAu32), (0x2000, 0xBBBB_BBBB)];
        let write = Frame { length: 4, remote_addr: 8, rkey: 1, ..Frame::new(TY_WRITE) };
        let read = Frame { remote_addr: 16, rkey: 0, aux: 4, ..Frame::new(TY_READ_REQ) };
        let raw = Frame { remote_addr: 16, rkey: 77, ..Frame::new(TY_READ_REQ) };
        // A SEND whose payload looks like a WRITE header must be skipped.
        let decoy = Frame { rkey: 0, ..Frame::new(TY_WRITE) }.encode();
        let send = Frame { length: HDR_LEN as u32, ..Frame::new(TY_SEND) };
        let mut stream = Vec::new();
        stream.extend_from_slice(&write.encode());
        stream.extend_from_slice(b"abcd");
        stream.extend_from_slice(&send.encode());
        stream.extend_from_slice(&decoy);
        stream.extend_from_slice(&read.encode());
        stream.extend_from_slice(&raw.encode());
        let before = stream.clone();
        relocate(&mut stream, &regions);

        let field = |s: &[u8], frame: usize, at: usize, n: usize| {
            let mut v = [0u8; 8];
            v[..n].copy_from_slice(&s[frame + at..frame + at + n]);
            u64::from_le_bytes(v)
        };
        assert_eq!(field(&stream, 0, 16, 8), 0x2008);
        assert_eq!(field(&stream, 0, 24, 4), 0xBBBB_BBBB);
        let send_at = HDR_LEN + 4;
        assert_eq!(stream[send_at..send_at + 2 * HDR_LEN], before[send_at..send_at + 2 * HDR_LEN]);
        let read_at = send_at + 2 * HDR_LEN;
        assert_eq!(field(&stream, read_at, 16, 8), 0x1010);
        assert_eq!(field(&stream, read_at, 24, 4), 0xAAAA_AAAA);
        assert_eq!(stream[read_at + HDR_LEN..], before[read_at + HDR_LEN..]);

        // A SEND with Invalidate gets the key, not an address; a plain
        // SEND's rkey field is left alone.
        let invalidating = Frame { flags: FLAG_INVALIDATE, rkey: 1, remote_addr: 8, ..Frame::new(TY_SEND) };
        let plain = Frame { rkey: 1, ..Frame::new(TY_SEND) };
        let mut stream = [invalidating.encode(), plain.encode()].concat();
        relocate(&mut stream, &regions);
        assert_eq!((field(&stream, 0, 24, 4), field(&stream, 0, 16, 8)), (0xBBBB_BBBB, 8));
        assert_eq!(field(&stream, HDR_LEN, 24, 4), 1);
    }

    #[test]
    fn the_first_frame_ends_where_its_length_says() {
        let hello = hello(b"x");
        assert_eq!(first_frame_end(&hello), hello.len());
        assert_eq!(first_frame_end(&[hello.clone(), vec![9; 40]].concat()), hello.len());
        assert_eq!(first_frame_end(&hello[..20]), 20, "a partial header: all of it");
        let huge = Frame { length: u32::MAX, ..Frame::new(TY_HELLO) }.encode();
        assert_eq!(first_frame_end(&huge), HDR_LEN, "a length past the end: all of it");
    }

    fn seed(name: &str) -> Vec<u8> {
        crate::seeds::all()
            .into_iter()
            .find(|s| s.target == "tcp_frames" && s.name == name)
            .unwrap_or_else(|| panic!("no seed {name}"))
            .bytes
    }

    /// The endpoint's output as (type, seq, aux, payload) per frame.
    fn frames_sent(out: &[u8]) -> Vec<(u8, u32, u32, Vec<u8>)> {
        let u32_at = |o: usize| u32::from_le_bytes(out[o..o + 4].try_into().unwrap());
        let mut frames = Vec::new();
        let mut pos = 0;
        while pos + HDR_LEN <= out.len() {
            let (ty, seq, len, aux) = (out[pos], u32_at(pos + 4), u32_at(pos + 12) as usize, u32_at(pos + 28));
            let payload = if ty == TY_READ_REQ || ty == TY_ACK || ty == TY_TERMINATE { 0 } else { len };
            let end = (pos + HDR_LEN + payload).min(out.len());
            frames.push((ty, seq, aux, out[pos + HDR_LEN..end].to_vec()));
            pos = end;
        }
        frames
    }

    fn status(o: &Outcome, wr: u64) -> Option<(WcStatus, u32)> {
        o.completions.iter().find(|c| c.wr_id == WrId(wr)).map(|c| (c.status, c.byte_len))
    }

    fn terminate_code(o: &Outcome) -> Option<u32> {
        frames_sent(&o.received).into_iter().find(|f| f.0 == TY_TERMINATE).map(|f| f.2)
    }

    /// The seeds reach the provider states they are named after: the
    /// harness's relocation and control byte work, so the fuzzer starts deep.
    #[test]
    fn seeds_reach_the_states_they_name() {
        let o = run_with_outcome(&seed("handshake-only"));
        assert!(o.connected);
        let first = &frames_sent(&o.received)[0];
        assert_eq!(first.0, TY_HELLO_REPLY);
        assert!(first.3.ends_with(SERVER_PRIVATE));
        assert!(run_with_outcome(&seed("raw-hello")).connected);

        let o = run_with_outcome(&seed("send"));
        assert_eq!(status(&o, RECV_BASE), Some((WcStatus::Success, 13)));
        assert_eq!(&o.regions[Region::Receives as usize][..13], b"hello, target");

        let o = run_with_outcome(&seed("write"));
        assert!(o.regions[Region::RemoteWrite as usize][100..164].iter().all(|&b| b == 0xee));
        assert_eq!(terminate_code(&o), None);

        let o = run_with_outcome(&seed("write-then-read"));
        let resp = frames_sent(&o.received).into_iter().find(|f| f.0 == TY_READ_RESP).expect("READ_RESP");
        assert_eq!((resp.2, resp.3.as_slice()), (2, &b"payload"[..]));

        let o = run_with_outcome(&seed("read"));
        let resp = frames_sent(&o.received).into_iter().find(|f| f.0 == TY_READ_RESP).expect("READ_RESP");
        assert_eq!(resp.3, o.regions[Region::RemoteRead as usize][..256]);

        for denied in ["write-read-only-region", "write-no-rights-region", "write-past-end", "read-no-rights"] {
            assert_eq!(terminate_code(&run_with_outcome(&seed(denied))), Some(1), "{denied}: REMOTE_ACCESS");
        }
        assert_eq!(terminate_code(&run_with_outcome(&seed("send-no-receive"))), Some(3), "RNR");
        let o = run_with_outcome(&seed("send-too-long"));
        assert_eq!(status(&o, RECV_BASE).map(|s| s.0), Some(WcStatus::LocalLengthError));

        // The window: reachable through its key, and no more once the
        // peer's SEND with Invalidate ended it (the receive says so).
        let o = run_with_outcome(&seed("write-window"));
        let window = &o.regions[Region::LocalOnly as usize][WINDOW_OFFSET..];
        assert!(window[..64].iter().all(|&b| b == 0xee));
        assert_eq!(terminate_code(&o), None);
        let o = run_with_outcome(&seed("send-invalidate-window"));
        let c = o.completions.iter().find(|c| c.wr_id == WrId(RECV_BASE)).expect("the receive");
        assert_eq!((c.status, c.byte_len), (WcStatus::Success, 4));
        assert!(c.invalidated_rkey.is_some());
        assert_eq!(terminate_code(&o), Some(1), "a WRITE through the invalidated window: REMOTE_ACCESS");
        let window = &o.regions[Region::LocalOnly as usize][WINDOW_OFFSET..];
        assert!(!window[..16].iter().all(|&b| b == 0xee), "the WRITE after the invalidation placed");
        // Keys that are no window: IBTA's class J, the receiver's alone.
        for name in ["send-invalidate-region", "send-invalidate-no-window"] {
            let o = run_with_outcome(&seed(name));
            assert_eq!(status(&o, RECV_BASE).map(|s| s.0), Some(WcStatus::RemoteInvalidRequest), "{name}");
            assert_eq!(terminate_code(&o), None, "{name}");
            assert!(frames_sent(&o.received).iter().any(|f| f.0 == TY_ACK), "{name}: the SEND is acknowledged");
        }

        let o = run_with_outcome(&seed("server-sends-acked"));
        assert_eq!(status(&o, WR_SEND), Some((WcStatus::Success, 0)));
        assert_eq!(status(&o, WR_WRITE), Some((WcStatus::Success, 0)));
        assert_eq!(status(&o, WR_READ), Some((WcStatus::Success, SERVER_READ_LEN)));
        let landed: Vec<u8> = (0..SERVER_READ_LEN).map(|i| i as u8).collect();
        assert_eq!(o.regions[Region::LocalOnly as usize][..SERVER_READ_LEN as usize], landed[..]);

        // Two SGEs with a gap: the data is split between them and the gap
        // keeps the pattern (the harness checks the gap itself).
        let o = run_with_outcome(&seed("scatter-send"));
        assert_eq!(status(&o, RECV_BASE), Some((WcStatus::Success, 150)));
        let slot = &o.regions[Region::Receives as usize][..SLOT];
        let message: Vec<u8> = (0..150).map(|i| i as u8).collect();
        assert_eq!(slot[..96], message[..96]);
        assert_eq!(slot[96 + SCATTER_GAP..96 + SCATTER_GAP + 54], message[96..]);
        let o = run_with_outcome(&seed("scatter-server-read"));
        assert_eq!(status(&o, WR_READ), Some((WcStatus::Success, SERVER_READ_LEN)));
        let local = &o.regions[Region::LocalOnly as usize];
        assert_eq!(local[..64], landed[..64]);
        assert_eq!(local[64 + SCATTER_GAP..128 + SCATTER_GAP], landed[64..]);
    }

    #[test]
    fn placement_follows_the_sges() {
        let sges = [(0, 4), (10, 4)];
        let hit: Vec<usize> = (0..16).filter(|&i| placed(&sges, Some(6), i)).collect();
        assert_eq!(hit, [0, 1, 2, 3, 10, 11]);
        let all: Vec<usize> = (0..16).filter(|&i| placed(&sges, None, i)).collect();
        assert_eq!(all, [0, 1, 2, 3, 10, 11, 12, 13]);
    }

    #[test]
    fn control_byte_round_trips() {
        let c = Control::parse(control(true, false, 5));
        assert!(c.hello && !c.server_sends && !c.window);
        assert_eq!(c.recvs, 5);
        assert!(Control::parse(CTL_WINDOW).window);
    }

    /// The memory check can fail: a write into the remote-read-only region
    /// that bypassed the provider is caught.
    #[test]
    #[should_panic(expected = "RemoteRead")]
    fn memory_check_catches_a_stray_write() {
        let mut arena: Vec<u8> = (0..ARENA_LEN).map(pattern).collect();
        arena[Region::RemoteRead.offset() + 10] ^= 0xFF;
        check_memory(&arena, &Ledger::default(), Control::parse(0));
    }

    #[test]
    fn memory_check_allows_a_received_message() {
        let mut arena: Vec<u8> = (0..ARENA_LEN).map(pattern).collect();
        let slot1 = Region::Receives.offset() + SLOT;
        arena[slot1..slot1 + 10].iter_mut().for_each(|b| *b = !*b);
        let ledger = Ledger {
            posted_recvs: vec![RECV_BASE, RECV_BASE + 1],
            completions: vec![Completion {
                wr_id: WrId(RECV_BASE + 1),
                opcode: WcOpcode::Recv,
                byte_len: 10,
                ..Completion::EMPTY
            }],
            ..Ledger::default()
        };
        check_memory(&arena, &ledger, Control::parse(control(true, false, 2)));
    }
}
