//! Queue pairs: work queues, the frame engine and the progress routine.
//!
//! All mutable state of a queue pair sits in one [`QpInner`] behind a mutex
//! shared by the [`TcpQp`] handle (post, connect, accept, disconnect) and the
//! completion queue's progress routine. The target and the initiator use a
//! queue pair and its CQ from one thread, so the lock is uncontended; it
//! plays the role of mlx5's per-QP spinlock.

use std::collections::VecDeque;
use std::io::{self, Write};
use std::net::{Shutdown, SocketAddr, TcpStream, ToSocketAddrs};
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use arrayvec::ArrayVec;

use super::cq::{CqShared, TcpCq};
use super::mr::{PdShared, Pins, Region, RegionTable, TcpPd, TcpWindow};
use super::sys::{self, EMPTY_IOV};
use super::wire::{
    self, seq_le, seq_next, FrameType, Header, FLAG_ACK_REQUESTED, HDR_LEN, HELLO_MAX, MAX_PAYLOAD, MAX_PRIVATE_DATA,
};
use super::{grant_caps, MAX_SGE};
use crate::fabric::{
    lock, Access, Completion, FabricError, FabricErrorKind, FabricOptions, FabricUrl, Payload, QpCaps, QpNum, QpState,
    RecvWr, Result, Rkey, SendOp, SendWr, Sge, WcOpcode, WcStatus, WrId,
};

static NEXT_QP_NUM: AtomicU32 = AtomicU32::new(1);

/// Most receive syscalls one progress round spends on one queue pair; a
/// busier socket stays readable and is served by the next round.
const RX_BUDGET: usize = 256;
/// Size of a queue pair's receive staging buffer: one `read` takes up to
/// this much of the stream, many small frames at once.
const STAGING_LEN: usize = 64 << 10;
/// A payload at least this long is bulk data, and the frames around it
/// are likely bulk too: staging reads shrink to [`BULK_STAGING_READ`] for
/// a few frames, so that the next large payload is read straight into its
/// destination rather than into staging and then copied.
const LARGE_PAYLOAD: u32 = 16 << 10;
/// What a staging read takes while bulk data flows: room for the small
/// frames between payloads and the next header, little payload to copy.
const BULK_STAGING_READ: usize = 4 << 10;
/// How many frames after a large payload staging reads stay small.
const BULK_FRAMES: u8 = 4;
/// Scratch size for discarding input in the error state.
const DRAIN_CHUNK: usize = 4096;

fn err(kind: FabricErrorKind, context: impl Into<String>) -> FabricError {
    FabricError::new(kind, context)
}

fn is_would_block(e: &io::Error) -> bool {
    e.kind() == io::ErrorKind::WouldBlock
}

// ---------------------------------------------------------------- queues --

/// A send-queue slot.
struct SqEntry {
    wr_id: WrId,
    opcode: WcOpcode,
    seq: u32,
    signaled: bool,
    /// Acknowledged (SEND, WRITE) or response placed (READ).
    done: bool,
    /// Set when the work request itself failed locally.
    fault: Option<WcStatus>,
    /// Total length (READ: bytes requested).
    len: u32,
    /// READ: the local destination, re-checked at placement. Capacity is
    /// reserved at creation, so posting never allocates.
    sges: Vec<Sge>,
}

impl SqEntry {
    /// Acknowledged (SEND, WRITE) or answered (READ), given the peer's
    /// cumulative ack `acked`.
    fn finished(&self, acked: u32) -> bool {
        self.done
            || (self.opcode != WcOpcode::RdmaRead && self.fault.is_none() && self.seq != 0 && seq_le(self.seq, acked))
    }
}

/// The send queue: a ring of `max_send_wr` slots addressed by absolute
/// indices. `[head, cursor)` are finished unsignaled work requests whose
/// slots stay occupied until a later signaled one completes (as in verbs);
/// `[cursor, tail)` are outstanding.
struct SendQueue {
    slots: Vec<SqEntry>,
    head: u64,
    cursor: u64,
    tail: u64,
}

impl SendQueue {
    fn new(cap: u32, max_sge: u32) -> SendQueue {
        let slots = (0..cap)
            .map(|_| SqEntry {
                wr_id: WrId(0),
                opcode: WcOpcode::Send,
                seq: 0,
                signaled: false,
                done: false,
                fault: None,
                len: 0,
                sges: Vec::with_capacity(max_sge as usize),
            })
            .collect();
        SendQueue { slots, head: 0, cursor: 0, tail: 0 }
    }
    fn is_full(&self) -> bool {
        self.tail - self.head >= self.slots.len() as u64
    }
    fn idx(&self, abs: u64) -> usize {
        (abs % self.slots.len() as u64) as usize
    }
    fn get(&self, abs: u64) -> &SqEntry {
        &self.slots[self.idx(abs)]
    }
    fn get_mut(&mut self, abs: u64) -> &mut SqEntry {
        let i = self.idx(abs);
        &mut self.slots[i]
    }
    /// Claims the next slot (the caller checked `is_full`).
    fn push(&mut self) -> (u64, &mut SqEntry) {
        let abs = self.tail;
        self.tail += 1;
        (abs, self.get_mut(abs))
    }
}

/// A receive-queue slot.
struct RqEntry {
    wr_id: WrId,
    sges: Vec<Sge>,
}

/// The receive queue: a FIFO ring of `max_recv_wr` slots.
struct RecvQueue {
    slots: Vec<RqEntry>,
    head: u64,
    tail: u64,
}

impl RecvQueue {
    fn new(cap: u32, max_sge: u32) -> RecvQueue {
        let slots = (0..cap).map(|_| RqEntry { wr_id: WrId(0), sges: Vec::with_capacity(max_sge as usize) }).collect();
        RecvQueue { slots, head: 0, tail: 0 }
    }
    fn is_empty(&self) -> bool {
        self.head == self.tail
    }
    fn is_full(&self) -> bool {
        self.tail - self.head >= self.slots.len() as u64
    }
    fn slot(&self, abs: u64) -> &RqEntry {
        &self.slots[(abs % self.slots.len() as u64) as usize]
    }
    fn front(&self) -> &RqEntry {
        self.slot(self.head)
    }
    fn push(&mut self, wr: &RecvWr<'_>) {
        let i = (self.tail % self.slots.len() as u64) as usize;
        let e = &mut self.slots[i];
        e.wr_id = wr.wr_id;
        e.sges.clear();
        e.sges.extend_from_slice(wr.sges);
        self.tail += 1;
    }
}

// --------------------------------------------------------------- backlog --

/// Bytes accepted by `post_send` (or generated by the responder) that the
/// socket did not take yet. Flushed by later progress rounds on EPOLLOUT.
#[derive(Default)]
struct Backlog {
    buf: Vec<u8>,
    off: usize,
}

impl Backlog {
    fn is_empty(&self) -> bool {
        self.off == self.buf.len()
    }

    /// Bytes not sent yet.
    fn len(&self) -> usize {
        self.buf.len() - self.off
    }

    fn clear(&mut self) {
        self.buf.clear();
        self.off = 0;
    }

    /// Copies the iovecs, minus their first `skip` bytes, to the end.
    ///
    /// # Safety
    /// Every iovec must describe memory valid for reads (pinned registered
    /// memory, the caller's inline buffer, or a local buffer).
    unsafe fn append(&mut self, iov: &[libc::iovec], mut skip: usize) {
        for v in iov {
            if skip >= v.iov_len {
                skip -= v.iov_len;
                continue;
            }
            let n = v.iov_len - skip;
            let old = self.buf.len();
            self.buf.reserve(n);
            // SAFETY: the caller guarantees `v` is readable; `reserve` made
            // room for `n` more bytes after `old`, and the ranges cannot
            // overlap (the backlog is never registered or handed out). Raw
            // copies rather than slices: registered memory may be written by
            // its owner concurrently, like DMA.
            unsafe {
                std::ptr::copy_nonoverlapping((v.iov_base as *const u8).add(skip), self.buf.as_mut_ptr().add(old), n);
                self.buf.set_len(old + n);
            }
            skip = 0;
        }
    }

    /// Sends as much as the socket takes. Ok even if bytes remain.
    fn flush(&mut self, fd: RawFd) -> io::Result<()> {
        while !self.is_empty() {
            let rest = &self.buf[self.off..];
            let v = [sys::iov(rest.as_ptr() as usize as u64, rest.len())];
            // SAFETY: `v` describes the live, initialised tail of `buf`.
            match unsafe { sys::sendv(fd, &v) } {
                Ok(n) => self.off += n,
                Err(e) if is_would_block(&e) => break,
                Err(e) => return Err(e),
            }
        }
        if self.is_empty() {
            self.clear();
            if self.buf.capacity() > 8 << 20 {
                self.buf.shrink_to(1 << 20);
            }
        } else if self.off >= (1 << 20) && self.off * 2 >= self.buf.len() {
            self.buf.drain(..self.off);
            self.off = 0;
        }
        Ok(())
    }
}

// --------------------------------------------------------------- tx batch --

/// Most frames one `sendmsg` of a `post_send` call carries.
const BATCH_FRAMES: usize = 16;
/// Most iovecs (headers and payload SGEs) one batch holds.
const BATCH_IOV: usize = 64;

/// One iovec of a batch: a header of the batch, or payload memory.
#[derive(Clone, Copy)]
enum Seg {
    Header(usize),
    Memory { addr: u64, len: usize },
}

/// The frames of one `post_send` call, so that a chain (an RDMA WRITE and
/// the SEND behind it) leaves in one `sendmsg` instead of one per work
/// request. Lives on the caller's stack for the call only: payload regions
/// stay pinned until the batch is sent. Its lists are `ArrayVec`s, not
/// zeroed arrays: zeroing them cost every `post_send` about 2.3 KiB of
/// stores, a few hundred instructions per I/O on each side (callgrind).
struct TxBatch<'t> {
    headers: ArrayVec<[u8; HDR_LEN], BATCH_FRAMES>,
    segs: ArrayVec<Seg, BATCH_IOV>,
    pins: Pins<'t>,
}

impl<'t> TxBatch<'t> {
    fn new() -> TxBatch<'t> {
        TxBatch { headers: ArrayVec::new(), segs: ArrayVec::new(), pins: Pins::new() }
    }

    fn is_empty(&self) -> bool {
        self.headers.is_empty()
    }

    /// Whether a frame with `sges` payload SGEs fits (iovecs and pins).
    fn has_room(&self, sges: usize) -> bool {
        !self.headers.is_full() && self.segs.len() + 1 + sges <= BATCH_IOV && self.pins.room() >= sges
    }

    fn push(&mut self, header: [u8; HDR_LEN], payload: &[libc::iovec]) {
        self.segs.push(Seg::Header(self.headers.len()));
        self.headers.push(header);
        for v in payload {
            self.segs.push(Seg::Memory { addr: v.iov_base as usize as u64, len: v.iov_len });
        }
    }

    /// Appends the batch's iovecs, in order, to `out` (filled in place: an
    /// `ArrayVec` returned by value is copied whole, unused capacity too).
    fn iovecs(&self, out: &mut ArrayVec<libc::iovec, BATCH_IOV>) {
        out.extend(self.segs.iter().map(|seg| match *seg {
            Seg::Header(i) => sys::iov(self.headers[i].as_ptr() as usize as u64, HDR_LEN),
            Seg::Memory { addr, len } => sys::iov(addr, len),
        }));
    }

    fn clear(&mut self) {
        self.headers.clear();
        self.segs.clear();
        self.pins.release();
    }
}

// ------------------------------------------------------------ rx engine --

/// The frame whose payload is being received.
#[derive(Clone, Copy, Debug)]
enum Job {
    None,
    /// RDMA WRITE into the region `rkey` at `addr`.
    Write { seq: u32, rkey: u32, addr: u64, len: u32, done: u32, ack_req: bool },
    /// SEND into the oldest posted receive.
    /// `invalidated`: a SEND with Invalidate, whose window is already gone.
    Send { seq: u32, len: u32, done: u32, ack_req: bool, invalidated: Option<u32> },
    /// READ_RESP into the SGEs of send-queue entry `abs`.
    ReadResp { abs: u64, len: u32, done: u32 },
    /// A request after one answered with a receiver-not-ready NAK: read
    /// and dropped (the peer's queue pair is in error and never resends it).
    Discard { len: u32, done: u32 },
}

impl Job {
    fn len_done(&self) -> (u32, u32) {
        match *self {
            Job::None => (0, 0),
            Job::Write { len, done, .. }
            | Job::Send { len, done, .. }
            | Job::ReadResp { len, done, .. }
            | Job::Discard { len, done } => (len, done),
        }
    }
    fn advance(&mut self, n: u32) {
        match self {
            Job::None => {}
            Job::Write { done, .. } | Job::Send { done, .. } | Job::ReadResp { done, .. } | Job::Discard { done, .. } => {
                *done += n
            }
        }
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Step {
    Go,
    Stop,
}

/// What one receive syscall brought.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Received {
    /// Every byte asked for: more may be waiting.
    Full,
    /// Fewer bytes than asked for: the socket is drained for now, and
    /// (level-triggered) epoll reports whatever arrives next.
    Short,
    /// Nothing (it would block), or the stream ended or broke.
    Nothing,
}

/// Why a queue pair enters the error state.
#[derive(Clone, Copy, Debug)]
enum Failure {
    /// Detected here: tell the peer with TERMINATE(code, seq). `seq` names
    /// the peer's offending request, 0 if none is at fault.
    Fault { code: u32, seq: u32 },
    /// The peer sent TERMINATE.
    Terminated { code: u32, seq: u32 },
    /// The peer sent DISCONNECT.
    Disconnected,
    /// The stream broke: EOF, reset or another socket error.
    Transport,
    /// The peer made no progress on an outstanding work request for the
    /// transport timeout (a NIC's RETRY_EXC_ERR): the connection is reset.
    Timeout,
    /// The peer stopped in the middle of a frame for the frame timeout:
    /// the connection is treated as lost, and reset.
    FrameTimeout,
    /// The application called `disconnect`.
    User,
    /// This side failed on its own (a bad local SGE, a SEND with Invalidate
    /// of a key it cannot invalidate): as on RC hardware the peer is not
    /// told and stays Ready.
    Local,
}

/// Builds iovecs scattering `want` bytes over `sges`, starting `skip` bytes
/// in, checking each touched SGE (lkey, access, bounds) and pinning its
/// region. `None` on any violation.
fn scatter<'t, const N: usize>(
    table: &'t RegionTable,
    sges: &[Sge],
    mut skip: u64,
    mut want: u64,
    need: Access,
    pins: &mut Pins<'t>,
    iov: &mut ArrayVec<libc::iovec, N>,
) -> Option<()> {
    for sge in sges {
        if want == 0 {
            break;
        }
        let l = sge.length as u64;
        if skip >= l {
            skip -= l;
            continue;
        }
        let take = (l - skip).min(want);
        let r = table.local(sge.lkey.0, sge.addr, l, need)?;
        if iov.len() == MAX_SGE.min(N) || !pins.pin(r) {
            return None;
        }
        iov.push(sys::iov(sge.addr + skip, take as usize));
        want -= take;
        skip = 0;
    }
    (want == 0).then_some(())
}

/// Receive staging: bytes read from the socket ahead of the frame engine,
/// many frames per `read`. `buf[start..end]` are received and not yet
/// processed. Between progress rounds it holds at most a partial header.
struct RxStaging {
    buf: Box<[u8]>,
    start: usize,
    end: usize,
    /// Frames since the last one with a large payload (saturating).
    since_large: u8,
}

impl RxStaging {
    fn new() -> RxStaging {
        RxStaging { buf: vec![0; STAGING_LEN].into_boxed_slice(), start: 0, end: 0, since_large: BULK_FRAMES }
    }

    /// Notes the payload length of a frame whose header was taken.
    fn note_frame(&mut self, payload: u32) {
        self.since_large = if payload >= LARGE_PAYLOAD { 0 } else { self.since_large.saturating_add(1) };
    }

    /// How many bytes the next read may stage. Small while bulk data flows,
    /// so that big payloads go to their destination directly rather than
    /// through staging and a copy.
    fn read_limit(&self) -> usize {
        let limit = if self.since_large < BULK_FRAMES { BULK_STAGING_READ } else { STAGING_LEN };
        limit.min(self.buf.len() - self.end)
    }

    fn len(&self) -> usize {
        self.end - self.start
    }

    fn is_empty(&self) -> bool {
        self.start == self.end
    }

    fn clear(&mut self) {
        self.start = 0;
        self.end = 0;
    }

    /// Drops the first `n` staged bytes.
    fn consume(&mut self, n: usize) {
        debug_assert!(n <= self.len());
        self.start += n;
        if self.start == self.end {
            self.clear();
        }
    }

    /// Takes a whole frame header off the front, if one is staged.
    fn take_header(&mut self) -> Option<[u8; HDR_LEN]> {
        if self.len() < HDR_LEN {
            return None;
        }
        let mut raw = [0; HDR_LEN];
        raw.copy_from_slice(&self.buf[self.start..self.start + HDR_LEN]);
        self.consume(HDR_LEN);
        Some(raw)
    }

    /// Moves the staged bytes (a partial header at most, when called
    /// between frames) to the front, so the whole rest is free.
    fn compact(&mut self) {
        if self.start > 0 {
            self.buf.copy_within(self.start..self.end, 0);
            self.end -= self.start;
            self.start = 0;
        }
    }

    /// The space the next read may fill (never empty: staging holds at most
    /// a partial header when a read is due); [`RxStaging::commit`] accounts
    /// what landed.
    fn spare(&mut self) -> &mut [u8] {
        self.compact();
        let limit = self.read_limit();
        &mut self.buf[self.end..self.end + limit]
    }

    /// [`RxStaging::spare`] as an iovec, for a `readv` whose earlier iovecs
    /// take a payload directly.
    fn spare_iov(&mut self) -> libc::iovec {
        let free = self.spare();
        sys::iov(free.as_mut_ptr() as usize as u64, free.len())
    }

    /// `n` bytes were received into the space [`RxStaging::spare`] named.
    fn commit(&mut self, n: usize) {
        debug_assert!(self.end + n <= self.buf.len());
        self.end += n;
    }

    /// Copies the first `n` staged bytes over `iov`, in order (it does not
    /// consume them).
    ///
    /// # Safety
    /// Every iovec must describe memory valid for writes that does not
    /// overlap this buffer, and `n` must not exceed the staged bytes.
    unsafe fn copy_to(&self, iov: &[libc::iovec], n: usize) {
        let mut src = &self.buf[self.start..self.start + n];
        for v in iov {
            let k = v.iov_len.min(src.len());
            // SAFETY: the caller guarantees `v` is writable and disjoint from
            // `src`. A raw copy rather than a slice: registered memory may be
            // accessed by its owner concurrently, like DMA.
            unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), v.iov_base.cast::<u8>(), k) };
            src = &src[k..];
        }
    }
}

// ------------------------------------------------------------- the QP --

/// Immutable parts of a queue pair plus its locked state.
pub(crate) struct QpShared {
    qp_num: u32,
    caps: QpCaps,
    pd: Arc<PdShared>,
    cq: Arc<CqShared>,
    /// Active side: where `connect` goes.
    url: Option<FabricUrl>,
    /// The transport and frame timeouts.
    options: FabricOptions,
    inner: Mutex<QpInner>,
}

impl QpShared {
    fn lock(&self) -> MutexGuard<'_, QpInner> {
        lock(&self.inner)
    }
    fn complete(&self, wr_id: WrId, opcode: WcOpcode, status: WcStatus, byte_len: u32) {
        self.complete_invalidating(wr_id, opcode, status, byte_len, None);
    }

    fn complete_invalidating(&self, wr_id: WrId, opcode: WcOpcode, status: WcStatus, byte_len: u32, invalidated: Option<u32>) {
        let invalidated_rkey = invalidated.map(Rkey);
        self.cq.push(Completion { wr_id, qp_num: QpNum(self.qp_num), opcode, status, byte_len, invalidated_rkey });
    }
}

pub(crate) struct QpInner {
    state: QpState,
    passive: bool,
    sock: Option<TcpStream>,
    fd: RawFd,
    peer: String,
    /// In the CQ's table and epoll set.
    attached: bool,
    /// Events currently registered with the CQ's epoll (0: not registered).
    interest: u32,
    rx_open: bool,
    tx_open: bool,

    sq: SendQueue,
    rq: RecvQueue,
    /// Send-queue indices of READs awaiting their response, oldest first.
    pending_reads: VecDeque<u64>,
    /// Seq of the last WR-bearing frame sent (0: none yet).
    last_sent_seq: u32,
    /// Highest of our seqs the peer acknowledged.
    peer_acked: u32,

    /// Next peer seq expected.
    rx_expected: u32,
    /// Highest peer seq fully processed (what we acknowledge).
    rx_processed: u32,
    /// The ack value carried by our last outgoing frame.
    last_ack_sent: u32,
    /// A frame with ACK_REQUESTED was processed this round.
    ack_needed: bool,
    /// A standalone ACK is owed and this queue pair is on the CQ's list.
    ack_deferred: bool,
    /// Received bytes not yet processed.
    staging: RxStaging,
    job: Job,

    backlog: Backlog,
    /// In the error state, keep the stream open (no FIN) until the
    /// application disconnects or drops the queue pair: the failure was
    /// local, or the peer reported it, and RC hardware would not tell the
    /// peer either.
    linger: bool,
    /// A SEND found no receive: its NAK was sent, and the peer's later
    /// requests are dropped unexecuted (the peer's queue pair is in error).
    rnr_nakked: bool,
    /// Test-only late send completions (`TcpCq::set_late_send_completions`):
    /// the acknowledged SEND at `sq.cursor` waits for the peer's next SEND,
    /// or until this moment. Always `None` when the mode is off.
    held_until: Option<Instant>,
    /// The peer's SENDs delivered since the hold began.
    held_recvs: u32,

    /// While the peer owes us progress (`awaiting_peer`): when it last
    /// made some (acknowledged a request, sent READ response bytes), or
    /// when the wait began. The transport timeout runs from here.
    tx_since: Instant,
    /// The peer made progress in this round (`tx_since` moves at its end).
    tx_progress: bool,
    /// How many bytes of the stream the peer's TCP had acknowledged at the
    /// last transport deadline that found bytes still queued to the peer:
    /// if it acknowledged more by the next one, the peer is reading.
    tcp_mark: Option<u64>,
    /// Frame headers taken so far: numbers the frame being received.
    rx_headers: u64,
    /// The frame a progress round ended in the middle of: its number, and
    /// when its first byte was received. The frame timeout runs from here.
    rx_partial: Option<(u64, Instant)>,
    /// When this queue pair's next deadline check is queued on the CQ
    /// (`None`: none is): earlier entries are stale, and a deadline no
    /// earlier than this one needs no entry of its own.
    check_at: Option<Instant>,
    /// The socket has no `O_NONBLOCK` (the active side's): every other
    /// receive and send passes `MSG_DONTWAIT`, and only
    /// [`wait_receiving`] sleeps in a receive.
    blocking_socket: bool,
    /// The socket's `SO_RCVTIMEO` as last set (`None`: never set).
    recv_timeout: Option<Duration>,
}

/// A reliable-connected queue pair of the tcp provider.
pub struct TcpQp {
    shared: Arc<QpShared>,
}

impl TcpQp {
    pub(crate) fn new(
        pd: &TcpPd,
        cq: &TcpCq,
        caps: QpCaps,
        url: Option<FabricUrl>,
        stream: Option<(TcpStream, String)>,
        options: FabricOptions,
    ) -> Result<TcpQp> {
        let caps = grant_caps(caps)?;
        let passive = stream.is_some();
        let (sock, peer) = match stream {
            Some((s, p)) => (Some(s), p),
            None => (None, url.as_ref().map(|u| u.host_port()).unwrap_or_default()),
        };
        let fd = sock.as_ref().map_or(-1, |s| s.as_raw_fd());
        let mut pending_reads = VecDeque::new();
        pending_reads.reserve(caps.max_send_wr as usize);
        let inner = QpInner {
            state: QpState::Init,
            passive,
            sock,
            fd,
            peer,
            attached: false,
            interest: 0,
            rx_open: true,
            tx_open: true,
            sq: SendQueue::new(caps.max_send_wr, caps.max_send_sge),
            rq: RecvQueue::new(caps.max_recv_wr, caps.max_recv_sge),
            pending_reads,
            last_sent_seq: 0,
            peer_acked: 0,
            rx_expected: 1,
            rx_processed: 0,
            last_ack_sent: 0,
            ack_needed: false,
            ack_deferred: false,
            staging: RxStaging::new(),
            job: Job::None,
            backlog: Backlog::default(),
            linger: false,
            rnr_nakked: false,
            held_until: None,
            held_recvs: 0,
            tx_since: Instant::now(),
            tx_progress: false,
            tcp_mark: None,
            rx_headers: 0,
            rx_partial: None,
            check_at: None,
            blocking_socket: false,
            recv_timeout: None,
        };
        let qp_num = loop {
            let n = NEXT_QP_NUM.fetch_add(1, Ordering::Relaxed);
            if n != 0 {
                break n;
            }
        };
        Ok(TcpQp {
            shared: Arc::new(QpShared {
                qp_num,
                caps,
                pd: pd.shared().clone(),
                cq: cq.shared().clone(),
                url,
                options,
                inner: Mutex::new(inner),
            }),
        })
    }

    pub fn qp_num(&self) -> QpNum {
        QpNum(self.shared.qp_num)
    }

    pub fn state(&self) -> QpState {
        self.shared.lock().state
    }

    pub fn caps(&self) -> QpCaps {
        self.shared.caps
    }

    pub fn peer(&self) -> String {
        self.shared.lock().peer.clone()
    }

    /// Active side: TCP connect, HELLO, wait for HELLO_REPLY. Blocks up to
    /// `timeout` (holding the QP lock, so other calls on this QP wait).
    pub fn connect(&self, private_data: &[u8], timeout: Duration) -> Result<Vec<u8>> {
        self.connect_with(private_data, timeout, false)
    }

    /// The hello carries its own length: raw private data is the same
    /// bytes; only a reject's reason is shown as hex.
    pub fn connect_raw(&self, private_data: &[u8], timeout: Duration) -> Result<Vec<u8>> {
        self.connect_with(private_data, timeout, true)
    }

    pub fn accept_raw(&self, private_data: &[u8]) -> Result<()> {
        self.accept(private_data)
    }

    fn connect_with(&self, private_data: &[u8], timeout: Duration, raw: bool) -> Result<Vec<u8>> {
        let sh = &*self.shared;
        if private_data.len() > MAX_PRIVATE_DATA {
            return Err(err(FabricErrorKind::InvalidArgument, format!("private data over {MAX_PRIVATE_DATA} bytes")));
        }
        let mut g = sh.lock();
        let q = &mut *g;
        let url = match &sh.url {
            Some(u) if q.state == QpState::Init && !q.passive && q.sock.is_none() => u,
            _ => return Err(err(FabricErrorKind::InvalidState, "connect needs an unconnected active-side queue pair")),
        };
        match handshake(url, private_data, &sh.caps, timeout, raw) {
            Ok((stream, peer_addr, reply)) => {
                q.fd = stream.as_raw_fd();
                q.sock = Some(stream);
                q.blocking_socket = true;
                q.peer = peer_addr.to_string();
                q.state = QpState::Ready;
                sh.cq.attach(sh.qp_num, Arc::downgrade(&self.shared));
                q.attached = true;
                q.update_interest(sh);
                Ok(reply)
            }
            Err(e) => {
                // Like a failed rdma_connect: the QP is unusable; its
                // receives are flushed.
                q.fail(sh, Failure::Transport);
                Err(e)
            }
        }
    }

    /// Passive side: sends HELLO_REPLY(accept) and starts the data phase.
    pub fn accept(&self, private_data: &[u8]) -> Result<()> {
        let sh = &*self.shared;
        if private_data.len() > MAX_PRIVATE_DATA {
            return Err(err(FabricErrorKind::InvalidArgument, format!("private data over {MAX_PRIVATE_DATA} bytes")));
        }
        let mut g = sh.lock();
        let q = &mut *g;
        if q.state != QpState::Init || !q.passive || q.sock.is_none() {
            return Err(err(FabricErrorKind::InvalidState, "accept needs a queue pair made from a connect request"));
        }
        let reply = wire::encode_hello(FrameType::HelloReply, wire::STATUS_ACCEPT, &sh.caps, private_data);
        let bytes = reply.as_bytes();
        q.state = QpState::Ready;
        sh.cq.attach(sh.qp_num, Arc::downgrade(&self.shared));
        q.attached = true;
        let v = [sys::iov(bytes.as_ptr() as usize as u64, bytes.len())];
        // SAFETY: `v` describes the live reply buffer.
        let ok = unsafe { q.tx_iov(&v) };
        if !ok {
            q.fail(sh, Failure::Transport);
            q.update_interest(sh);
            return Err(err(FabricErrorKind::ConnectFailed, format!("{}: connection lost while accepting", q.peer)));
        }
        q.update_interest(sh);
        Ok(())
    }

    pub fn post_send(&self, wrs: &[SendWr<'_>]) -> Result<()> {
        let sh = &*self.shared;
        let mut g = sh.lock();
        let q = &mut *g;
        if q.state == QpState::Init {
            return Err(err(FabricErrorKind::InvalidState, "post_send on a queue pair that is not connected"));
        }
        let table = sh.pd.table.load();
        let mut batch = TxBatch::new();
        let mut res = Ok(());
        let was_awaiting = q.awaiting_peer();
        for wr in wrs {
            let total = match validate_send(&sh.caps, wr) {
                Ok(t) => t,
                Err(e) => {
                    res = Err(e);
                    break;
                }
            };
            if q.state == QpState::Error {
                sh.complete(wr.wr_id, opcode_of(&wr.op), WcStatus::WrFlushError, 0);
                continue;
            }
            if q.sq.is_full() {
                res = Err(err(
                    FabricErrorKind::QueueFull,
                    format!("send queue full ({} work requests outstanding)", sh.caps.max_send_wr),
                ));
                break;
            }
            q.post_one(sh, &table, &mut batch, wr, total);
        }
        q.tx_batch(sh, &mut batch);
        q.update_interest(sh);
        if !was_awaiting && q.awaiting_peer() {
            // The transport timeout starts.
            q.peer_progressed(sh, Instant::now());
        }
        res
    }

    pub fn post_recv(&self, wrs: &[RecvWr<'_>]) -> Result<()> {
        let sh = &*self.shared;
        let mut g = sh.lock();
        let q = &mut *g;
        for wr in wrs {
            if wr.sges.len() > sh.caps.max_recv_sge as usize {
                return Err(err(
                    FabricErrorKind::InvalidArgument,
                    format!("{} SGEs in a receive, max_recv_sge is {}", wr.sges.len(), sh.caps.max_recv_sge),
                ));
            }
            if q.state == QpState::Error {
                sh.complete(wr.wr_id, WcOpcode::Recv, WcStatus::WrFlushError, 0);
                continue;
            }
            if q.rq.is_full() {
                return Err(err(
                    FabricErrorKind::QueueFull,
                    format!("receive queue full ({} receives posted)", sh.caps.max_recv_wr),
                ));
            }
            q.rq.push(wr);
        }
        Ok(())
    }

    /// Binds a memory window over part of a region of this queue pair's
    /// protection domain, usable by this queue pair's peer only.
    pub fn bind_window(&self, parent: Rkey, addr: u64, len: u64, access: Access) -> Result<TcpWindow> {
        let sh = &*self.shared;
        sh.pd.bind_window(sh.qp_num, parent, addr, len, access)
    }

    pub fn disconnect(&self) {
        let sh = &*self.shared;
        let mut g = sh.lock();
        if g.state == QpState::Error {
            g.end_linger(sh);
        } else {
            g.fail(sh, Failure::User);
        }
    }
}

impl Drop for TcpQp {
    fn drop(&mut self) {
        let sh = &*self.shared;
        {
            let mut q = sh.lock();
            if q.interest != 0 {
                sys::epoll_del(sh.cq.epfd(), q.fd);
                q.interest = 0;
            }
            q.attached = false;
            q.sock = None;
            q.fd = -1;
        }
        sh.cq.detach(sh.qp_num);
    }
}

fn opcode_of(op: &SendOp) -> WcOpcode {
    match op {
        SendOp::Send | SendOp::SendWithInvalidate { .. } => WcOpcode::Send,
        SendOp::RdmaWrite { .. } => WcOpcode::RdmaWrite,
        SendOp::RdmaRead { .. } => WcOpcode::RdmaRead,
    }
}

/// The verbs argument rules; returns the total length.
fn validate_send(caps: &QpCaps, wr: &SendWr<'_>) -> Result<u32> {
    let invalid = |why: String| Err(err(FabricErrorKind::InvalidArgument, why));
    if let Payload::Sges(sges) = wr.payload {
        if sges.len() > caps.max_send_sge as usize {
            return invalid(format!("{} SGEs in a send, max_send_sge is {}", sges.len(), caps.max_send_sge));
        }
    }
    let total = wr.payload.byte_len();
    if total > MAX_PAYLOAD as u64 {
        return invalid(format!("work request of {total} bytes exceeds {MAX_PAYLOAD}"));
    }
    if let Payload::Inline(_) = wr.payload {
        if matches!(wr.op, SendOp::RdmaRead { .. }) {
            return invalid("inline RDMA READ".to_owned());
        }
        if total > caps.max_inline_data as u64 {
            return invalid(format!("{total} inline bytes, max_inline_data is {}", caps.max_inline_data));
        }
    }
    Ok(total as u32)
}

/// Active-side handshake: returns the nonblocking stream, the peer address
/// and the reply's private data. `raw`: a reject's private data is shown
/// as hex bytes (a stock peer's binary reject), not as text.
fn handshake(
    url: &FabricUrl,
    private_data: &[u8],
    caps: &QpCaps,
    timeout: Duration,
    raw_private: bool,
) -> Result<(TcpStream, SocketAddr, Vec<u8>)> {
    let deadline = Instant::now() + timeout;
    let timed_out = || err(FabricErrorKind::Timeout, format!("connecting to {url}: no answer within {timeout:?}"));
    let remaining = || deadline.checked_duration_since(Instant::now()).filter(|d| !d.is_zero()).ok_or_else(timed_out);
    let failed = |what: &str, e: io::Error| {
        if matches!(e.kind(), io::ErrorKind::TimedOut | io::ErrorKind::WouldBlock) {
            FabricError { kind: FabricErrorKind::Timeout, context: format!("{what} {url}"), source: Some(e) }
        } else {
            FabricError { kind: FabricErrorKind::ConnectFailed, context: format!("{what} {url}"), source: Some(e) }
        }
    };
    let addrs = url.host_port().to_socket_addrs().map_err(|e| failed("resolving", e))?;
    let mut last = None;
    let mut stream = None;
    for a in addrs {
        match TcpStream::connect_timeout(&a, remaining()?) {
            Ok(s) => {
                stream = Some(s);
                break;
            }
            Err(e) => last = Some(e),
        }
    }
    let stream = match (stream, last) {
        (Some(s), _) => s,
        (None, Some(e)) => return Err(failed("connecting to", e)),
        (None, None) => return Err(err(FabricErrorKind::ConnectFailed, format!("{url}: no address"))),
    };
    let peer = stream.peer_addr().map_err(|e| failed("connecting to", e))?;
    stream.set_nodelay(true).map_err(|e| failed("TCP_NODELAY for", e))?;
    let hello = wire::encode_hello(FrameType::Hello, wire::STATUS_ACCEPT, caps, private_data);
    stream.set_write_timeout(Some(remaining()?)).map_err(|e| failed("configuring", e))?;
    (&stream).write_all(hello.as_bytes()).map_err(|e| failed("sending hello to", e))?;

    let read_exact = |buf: &mut [u8]| -> Result<()> {
        let mut got = 0;
        while got < buf.len() {
            stream.set_read_timeout(Some(remaining()?)).map_err(|e| failed("configuring", e))?;
            match io::Read::read(&mut &stream, &mut buf[got..]) {
                Ok(0) => {
                    return Err(err(FabricErrorKind::ConnectFailed, format!("{url}: peer closed during the handshake")))
                }
                Ok(n) => got += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(failed("awaiting the reply of", e)),
            }
        }
        Ok(())
    };
    let mut raw = [0u8; HDR_LEN];
    read_exact(&mut raw)?;
    let h = Header::decode(&raw)
        .map_err(|e| err(FabricErrorKind::ConnectFailed, format!("{url}: malformed reply header: {e}")))?;
    if h.ty != FrameType::HelloReply {
        return Err(err(FabricErrorKind::ConnectFailed, format!("{url}: expected a hello reply, got {:?}", h.ty)));
    }
    let mut body = [0u8; HELLO_MAX];
    let body = &mut body[..h.length as usize]; // decode bounds a hello at HELLO_MAX
    read_exact(body)?;
    let reply = wire::decode_hello_body(body)
        .map_err(|e| err(FabricErrorKind::ConnectFailed, format!("{url}: malformed reply: {e}")))?;
    if reply.status == wire::STATUS_REJECT {
        return Err(err(
            FabricErrorKind::ConnectFailed,
            format!("{url}: {}", crate::fabric::rejected_by_peer(reply.private, raw_private)),
        ));
    }
    // The socket stays blocking: the provider's receives and sends pass
    // `MSG_DONTWAIT`, except the one an owner waiting alone sleeps in
    // (`wait_receiving`), which takes its answer in the same call.
    let configure = || -> io::Result<()> {
        stream.set_read_timeout(None)?;
        stream.set_write_timeout(None)
    };
    configure().map_err(|e| failed("configuring", e))?;
    let private = reply.private.to_vec();
    Ok((stream, peer, private))
}

/// One progress round for a queue pair whose socket epoll reported ready:
/// flush the backlog, receive and process frames, acknowledge.
pub(crate) fn progress(sh: &QpShared, _events: u32) {
    let mut g = sh.lock();
    g.progress(sh);
}

/// The owner's sleep merged with its first receive (see
/// `TcpCq::wait_receiving`): sleeps in a receive on the socket for at most
/// `timeout` (the kernel rounds it up to its tick), then processes what
/// came as a progress round does. `None` when this queue pair cannot wait
/// so (the socket is not blocking, a frame is half received or a backlog
/// waits for the socket to drain, or it is not connected): the caller
/// sleeps on the CQ's fd instead. `Some(false)`: the timeout passed (or
/// a signal came) and nothing arrived. The queue pair's lock is held
/// while it sleeps, so only an owner that is the sole user of the queue
/// pair may call it: another thread's post or disconnect would wait.
pub(crate) fn wait_receiving(sh: &QpShared, timeout: Duration) -> Option<bool> {
    let mut g = sh.lock();
    g.wait_receiving(sh, timeout)
}

/// The CQ's deadline check that this queue pair queued for `at` is due
/// (`now`). Stale checks (the queue pair queued another since) do nothing.
pub(crate) fn check_deadlines(sh: &QpShared, at: Instant, now: Instant) {
    let mut g = sh.lock();
    let q = &mut *g;
    if q.check_at != Some(at) {
        return;
    }
    q.check_at = None;
    if q.state != QpState::Ready || q.sock.is_none() {
        return;
    }
    q.check_frame_timeout(sh, now);
    if q.state == QpState::Ready {
        q.check_transport_timeout(sh, now);
    }
}

/// When a frame whose first byte arrived at `since`, with a payload of
/// `len` bytes (0 while its header is incomplete), is late: `timeout`
/// after its first byte, plus one second per MiB of payload (a 1 GiB frame
/// may arrive at 1 MiB/s). `None`: never.
pub(crate) fn frame_deadline(since: Instant, timeout: Duration, len: u32) -> Option<Instant> {
    let allowance = Duration::from_nanos((len as u64 * 1_000_000_000) >> 20);
    since.checked_add(timeout)?.checked_add(allowance)
}

/// Late send completions: completes the send completions `sh` holds back
/// if their hold ended by `now` (any hold with `None`).
pub(crate) fn release_held_sends(sh: &QpShared, now: Option<Instant>) {
    let mut g = sh.lock();
    let q = &mut *g;
    if q.held_until.is_some_and(|until| now.is_none_or(|now| until <= now)) {
        q.release_held_sends(sh);
    }
}

/// Whether the standalone ACK deferred by [`progress`] is still owed: no
/// frame sent since carried the acknowledgement. One that was carried is
/// forgotten here (the queue pair may defer the next one).
pub(crate) fn owes_deferred_ack(sh: &QpShared) -> bool {
    let mut g = sh.lock();
    let q = &mut *g;
    if q.ack_deferred && q.state == QpState::Ready && q.sock.is_some() && q.last_ack_sent != q.rx_processed {
        return true;
    }
    q.ack_deferred = false;
    false
}

/// Sends the standalone ACK deferred by [`progress`], unless a frame sent
/// since then carried the acknowledgement.
pub(crate) fn send_deferred_ack(sh: &QpShared) {
    let mut g = sh.lock();
    let q = &mut *g;
    if !q.ack_deferred {
        return;
    }
    q.ack_deferred = false;
    if q.state == QpState::Ready && q.sock.is_some() && q.last_ack_sent != q.rx_processed {
        let mut h = Header::new(FrameType::Ack);
        if !q.tx_ctrl(&mut h) {
            q.tx_broken(sh);
        }
        q.update_interest(sh);
    }
}

impl QpInner {
    /// One progress round: flush the backlog, receive and process frames,
    /// acknowledge.
    fn progress(&mut self, sh: &QpShared) {
        self.progress_after(sh, None);
    }

    /// See [`wait_receiving`]. Between frames only: the receive lands in
    /// staging, as a progress round's first read would.
    fn wait_receiving(&mut self, sh: &QpShared, timeout: Duration) -> Option<bool> {
        let between_frames = matches!(self.job, Job::None) && self.staging.len() < HDR_LEN;
        let usable = self.sock.is_some() && self.attached && self.blocking_socket && self.state == QpState::Ready;
        if !usable || !between_frames || !self.rx_open || !self.tx_open || !self.backlog.is_empty() {
            return None;
        }
        if self.recv_timeout != Some(timeout) {
            if let Err(e) = sys::set_recv_timeout(self.fd, timeout) {
                tracing::debug!(qp = sh.qp_num, error = %e, "SO_RCVTIMEO failed; waiting on the CQ's fd");
                return None;
            }
            self.recv_timeout = Some(timeout);
        }
        let spare = self.staging.spare();
        let asked = spare.len();
        let received = match sys::recv_blocking(self.fd, spare) {
            Err(e) if is_would_block(&e) || e.kind() == io::ErrorKind::Interrupted => return Some(false),
            r => match self.rx_result(sh, r, asked) {
                Some((n, received)) => {
                    self.staging.commit(n);
                    received
                }
                // The stream ended or broke: the round below reports it.
                None => Received::Nothing,
            },
        };
        self.progress_after(sh, Some(received));
        Some(true)
    }

    /// A progress round, after the receive `first` if the caller made one
    /// (its bytes are staged).
    fn progress_after(&mut self, sh: &QpShared, first: Option<Received>) {
        if self.sock.is_none() || !self.attached {
            return;
        }
        if self.tx_open && !self.backlog.is_empty() && self.backlog.flush(self.fd).is_err() {
            self.tx_broken(sh);
        }
        if self.rx_open {
            self.rx_pump(sh, first);
        }
        if self.state == QpState::Ready && self.ack_needed && self.last_ack_sent != self.rx_processed && !self.ack_deferred {
            if sh.cq.coalesces_acks() {
                // Not sent now: the application usually answers what it just
                // received soon, and its frame carries the ack. The CQ sends
                // the ACK if nothing did within its hold, or when armed.
                self.ack_deferred = true;
                sh.cq.defer_ack(sh.qp_num);
            } else {
                let mut h = Header::new(FrameType::Ack);
                if !self.tx_ctrl(&mut h) {
                    self.tx_broken(sh);
                }
            }
        }
        self.ack_needed = false;
        self.maybe_shutdown_wr();
        self.update_interest(sh);
        if std::mem::take(&mut self.tx_progress) && self.awaiting_peer() {
            self.peer_progressed(sh, Instant::now());
        }
        self.note_partial_frame(sh);
    }

    /// At the end of a round: whether the stream stopped in the middle of a
    /// frame (its payload pending, or part of the next header staged), and
    /// if that frame is new, when it began.
    fn note_partial_frame(&mut self, sh: &QpShared) {
        let pending = !matches!(self.job, Job::None);
        if self.state != QpState::Ready || (!pending && self.staging.is_empty()) {
            self.rx_partial = None;
            return;
        }
        // The frame whose header came last, or the next one, whose header
        // is partly staged.
        let frame = if pending { self.rx_headers } else { self.rx_headers + 1 };
        if self.rx_partial.is_some_and(|(f, _)| f == frame) {
            return;
        }
        self.rx_partial = Some((frame, Instant::now()));
        if let Some(deadline) = self.frame_deadline(sh) {
            self.schedule_check(sh, deadline);
        }
    }

    /// When the frame the stream stopped in is late (`None`: no such
    /// frame, or never).
    fn frame_deadline(&self, sh: &QpShared) -> Option<Instant> {
        let (_, since) = self.rx_partial?;
        frame_deadline(since, sh.options.frame_timeout, self.job.len_done().0)
    }

    /// The frame timeout, checked at `now`: a frame still partial after
    /// serving the socket, and late, fails the queue pair.
    fn check_frame_timeout(&mut self, sh: &QpShared, now: Instant) {
        let Some(deadline) = self.frame_deadline(sh) else { return };
        if now < deadline {
            return self.schedule_check(sh, deadline);
        }
        self.progress(sh);
        match self.frame_deadline(sh) {
            Some(deadline) if deadline <= now => self.fail(sh, Failure::FrameTimeout),
            Some(deadline) => self.schedule_check(sh, deadline),
            None => {}
        }
    }

    /// The peer made progress at `now` (or the wait for it began): the
    /// transport timeout starts again. The check queued for the old
    /// deadline finds the new one.
    fn peer_progressed(&mut self, sh: &QpShared, now: Instant) {
        self.tx_since = now;
        self.tcp_mark = None;
        if let Some(deadline) = self.tx_deadline(sh) {
            self.schedule_check(sh, deadline);
        }
    }

    /// The transport timeout, checked at `now`. At the deadline the socket
    /// is served first (an owner that did not poll for a while must not
    /// blame the peer for what is waiting in it). A peer that still made
    /// no progress fails the queue pair, unless bytes are still queued to
    /// it and its TCP acknowledged more of them since the last deadline: it
    /// is reading, slowly (a payload is acknowledged only when it is whole).
    /// Without a mark from the last deadline the peer gets one more timeout
    /// to show that.
    fn check_transport_timeout(&mut self, sh: &QpShared, now: Instant) {
        if !self.awaiting_peer() {
            return;
        }
        let Some(deadline) = self.tx_deadline(sh) else { return };
        if now < deadline {
            return self.schedule_check(sh, deadline);
        }
        self.progress(sh);
        if !self.awaiting_peer() || self.tx_deadline(sh).is_some_and(|d| d > now) {
            // Served, or progress came in: `progress` queued the next check.
            return;
        }
        let queued = self.backlog.len() + sys::unacked_bytes(self.fd).unwrap_or(0);
        match (queued, self.tcp_mark, sys::tcp_bytes_acked(self.fd)) {
            // Everything sent is with the peer's TCP: only the peer's
            // provider can progress, and it did not.
            (0, _, _) => self.fail(sh, Failure::Timeout),
            (_, Some(mark), Some(acked)) if acked > mark => {
                self.peer_progressed(sh, now);
                self.tcp_mark = Some(acked);
            }
            (_, None, Some(acked)) => {
                self.tcp_mark = Some(acked);
                if let Some(probe) = now.checked_add(sh.options.transport_timeout) {
                    self.schedule_check(sh, probe);
                }
            }
            _ => self.fail(sh, Failure::Timeout),
        }
    }

    /// Whether the peer owes this queue pair progress: a work request it
    /// has not acknowledged, or a READ it has not answered.
    fn awaiting_peer(&self) -> bool {
        self.state == QpState::Ready && (self.peer_acked != self.last_sent_seq || !self.pending_reads.is_empty())
    }

    /// When the transport timeout expires (`None`: never).
    fn tx_deadline(&self, sh: &QpShared) -> Option<Instant> {
        self.tx_since.checked_add(sh.options.transport_timeout)
    }

    /// Makes sure a deadline check runs by `at`.
    fn schedule_check(&mut self, sh: &QpShared, at: Instant) {
        if self.check_at.is_none_or(|queued| at < queued) {
            self.check_at = Some(at);
            sh.cq.schedule_check(sh.qp_num, at);
        }
    }

    // ------------------------------------------------------------ tx --

    /// Sends iovecs in order after any backlog; what the socket does not take
    /// is copied into the backlog. False if the socket failed.
    ///
    /// # Safety
    /// Every iovec must describe memory valid for reads during the call.
    unsafe fn tx_iov(&mut self, iov: &[libc::iovec]) -> bool {
        if !self.tx_open || self.fd < 0 {
            return false;
        }
        if !self.backlog.is_empty() && self.backlog.flush(self.fd).is_err() {
            return false;
        }
        let sent = if self.backlog.is_empty() {
            // SAFETY: forwarded from the caller.
            match unsafe { sys::sendv(self.fd, iov) } {
                Ok(n) => n,
                Err(e) if is_would_block(&e) => 0,
                Err(_) => return false,
            }
        } else {
            0
        };
        // SAFETY: forwarded from the caller.
        unsafe { self.backlog.append(iov, sent) };
        true
    }

    /// Sends a header-only frame (ACK, TERMINATE, DISCONNECT, READ_REQ).
    fn tx_ctrl(&mut self, hdr: &mut Header) -> bool {
        // SAFETY: no payload iovecs.
        unsafe { self.tx_frame(hdr, &[]) }
    }

    /// Sends a frame: `hdr` (its ack field filled in here) plus payload.
    ///
    /// # Safety
    /// Every payload iovec must describe memory valid for reads during the
    /// call: a pinned region, or a buffer the caller vouches for.
    unsafe fn tx_frame(&mut self, hdr: &mut Header, payload: &[libc::iovec]) -> bool {
        hdr.ack = self.rx_processed;
        self.last_ack_sent = self.rx_processed;
        let raw = hdr.encode();
        let mut iov = ArrayVec::<libc::iovec, { MAX_SGE + 1 }>::new();
        iov.push(sys::iov(raw.as_ptr() as usize as u64, HDR_LEN));
        iov.extend(payload.iter().take(MAX_SGE).copied());
        // SAFETY: `raw` lives on this stack frame; the payload iovecs are
        // readable per this function's contract.
        unsafe { self.tx_iov(&iov) }
    }

    /// The socket failed while sending.
    fn tx_broken(&mut self, sh: &QpShared) {
        if self.state == QpState::Error {
            self.tx_open = false;
            self.backlog.clear();
        } else {
            self.fail(sh, Failure::Transport);
        }
    }

    /// A lingering queue pair in error: tell the peer now (DISCONNECT, FIN).
    fn end_linger(&mut self, sh: &QpShared) {
        if !self.linger {
            return;
        }
        self.linger = false;
        if self.tx_open && self.sock.is_some() {
            let mut h = Header::new(FrameType::Disconnect);
            if !self.tx_ctrl(&mut h) {
                self.tx_open = false;
                self.backlog.clear();
            }
        }
        self.maybe_shutdown_wr();
        self.update_interest(sh);
    }

    /// Gives up on the connection: closes the socket with a reset
    /// (SO_LINGER 0), so that the peer sees the end at once, however much
    /// is still queued for it (it would arrive after the failure), and the
    /// kernel frees the connection without waiting for the peer to read.
    fn reset(&mut self, sh: &QpShared) {
        self.backlog.clear();
        self.rx_open = false;
        self.tx_open = false;
        if self.interest != 0 {
            sys::epoll_del(sh.cq.epfd(), self.fd);
            self.interest = 0;
        }
        if let Some(s) = self.sock.take() {
            if let Err(e) = sys::set_linger_zero(s.as_raw_fd()) {
                tracing::debug!(qp = sh.qp_num, error = %e, "SO_LINGER on a socket being reset failed");
            }
        }
        self.fd = -1;
    }

    /// In the error state, sends FIN once the last frame (TERMINATE or
    /// DISCONNECT) has left, unless the queue pair lingers.
    fn maybe_shutdown_wr(&mut self) {
        if self.state == QpState::Error && !self.linger && self.tx_open && self.backlog.is_empty() {
            if let Some(s) = &self.sock {
                let _ = s.shutdown(Shutdown::Write);
            }
            self.tx_open = false;
        }
    }

    /// Registers the socket with the CQ's epoll for what is needed now:
    /// input while the stream is open, output while a backlog exists.
    fn update_interest(&mut self, sh: &QpShared) {
        if !self.attached || self.fd < 0 {
            return;
        }
        let mut want = 0u32;
        if self.rx_open {
            want |= libc::EPOLLIN as u32;
        }
        if self.tx_open && !self.backlog.is_empty() {
            want |= libc::EPOLLOUT as u32;
        }
        if want == self.interest {
            return;
        }
        let op = if self.interest == 0 {
            libc::EPOLL_CTL_ADD
        } else if want == 0 {
            libc::EPOLL_CTL_DEL
        } else {
            libc::EPOLL_CTL_MOD
        };
        match sys::epoll_ctl(sh.cq.epfd(), op, self.fd, want, sh.qp_num as u64) {
            Ok(()) => self.interest = want,
            Err(e) => tracing::warn!(qp = sh.qp_num, error = %e, "epoll_ctl on a queue pair socket failed"),
        }
    }

    /// Queues the frame of one work request in `batch` (sent by
    /// [`QpInner::tx_batch`] at the end of the `post_send` call, or earlier
    /// when the batch is full).
    fn post_one<'t>(&mut self, sh: &QpShared, table: &'t RegionTable, batch: &mut TxBatch<'t>, wr: &SendWr<'_>, total: u32) {
        let (sges, inline): (&[Sge], &[u8]) = match wr.payload {
            Payload::Sges(sges) => (sges, &[]),
            Payload::Inline(bytes) => (&[], bytes),
        };
        if !batch.has_room(if inline.is_empty() { sges.len() } else { 1 }) {
            self.tx_batch(sh, batch);
            if self.state == QpState::Error {
                sh.complete(wr.wr_id, opcode_of(&wr.op), WcStatus::WrFlushError, 0);
                return;
            }
        }
        let pins = &mut batch.pins;
        let mut iov = ArrayVec::<libc::iovec, MAX_SGE>::new();
        let mut fault = false;
        let is_read = matches!(wr.op, SendOp::RdmaRead { .. });
        for sge in sges {
            if sge.length == 0 {
                continue;
            }
            let len = sge.length as u64;
            if is_read {
                // The destination is written at placement (checked again then).
                if table.local(sge.lkey.0, sge.addr, len, Access::LOCAL_WRITE).is_none() {
                    fault = true;
                    break;
                }
            } else {
                match table.local(sge.lkey.0, sge.addr, len, Access::NONE) {
                    Some(r) if pins.pin(r) => {}
                    _ => {
                        fault = true;
                        break;
                    }
                }
                iov.push(sys::iov(sge.addr, sge.length as usize));
            }
        }
        if !inline.is_empty() {
            // The caller's slice, borrowed for this `post_send` call, which
            // sends the batch (or copies it to the backlog) before it returns.
            iov.clear();
            iov.push(sys::iov(inline.as_ptr() as usize as u64, inline.len()));
        }
        let seq = if fault {
            0
        } else {
            self.last_sent_seq = seq_next(self.last_sent_seq);
            self.last_sent_seq
        };
        let (abs, e) = self.sq.push();
        e.wr_id = wr.wr_id;
        e.opcode = opcode_of(&wr.op);
        e.seq = seq;
        e.signaled = wr.signaled;
        e.done = false;
        e.fault = fault.then_some(WcStatus::LocalProtectionError);
        e.len = total;
        e.sges.clear();
        if is_read {
            e.sges.extend_from_slice(sges);
        }
        if fault {
            // The work requests before this one leave first, as they would
            // have on a NIC that processes the chain in order.
            self.tx_batch(sh, batch);
            self.fail(sh, Failure::Local);
            return;
        }
        let flags = if wr.signaled { FLAG_ACK_REQUESTED } else { 0 };
        let mut h = match wr.op {
            SendOp::Send => Header { flags, seq, length: total, ..Header::new(FrameType::Send) },
            SendOp::SendWithInvalidate { rkey } => Header {
                flags: flags | wire::FLAG_INVALIDATE,
                seq,
                length: total,
                rkey: rkey.0,
                ..Header::new(FrameType::Send)
            },
            SendOp::RdmaWrite { remote_addr, rkey } => {
                Header { flags, seq, length: total, remote_addr, rkey: rkey.0, ..Header::new(FrameType::Write) }
            }
            SendOp::RdmaRead { remote_addr, rkey } => {
                self.pending_reads.push_back(abs);
                Header { seq, aux: total, remote_addr, rkey: rkey.0, ..Header::new(FrameType::ReadReq) }
            }
        };
        h.ack = self.rx_processed;
        self.last_ack_sent = self.rx_processed;
        batch.push(h.encode(), &iov);
    }

    /// Sends the batched frames with one `sendmsg` (what the socket does not
    /// take goes to the backlog) and releases their pins.
    fn tx_batch(&mut self, sh: &QpShared, batch: &mut TxBatch<'_>) {
        if batch.is_empty() {
            return;
        }
        let mut iov = ArrayVec::new();
        batch.iovecs(&mut iov);
        // SAFETY: the iovecs are the batch's headers (alive in `batch` during
        // the call), payload SGEs checked against their regions (lkey,
        // bounds) and pinned by `batch.pins`, and inline payloads: slices
        // borrowed by the `post_send` call this batch belongs to, which
        // sends it (or copies it to the backlog) before returning.
        let ok = unsafe { self.tx_iov(&iov) };
        batch.clear();
        if !ok {
            self.fail(sh, Failure::Transport);
        }
    }

    /// Completes finished send-queue entries in order.
    fn advance_sq(&mut self, sh: &QpShared) {
        self.complete_sq(sh, false);
    }

    /// Late send completions: the peer's next SEND was delivered, or the
    /// hold ended. Completes the held SENDs and what finished behind them.
    fn release_held_sends(&mut self, sh: &QpShared) {
        self.held_until = None;
        self.held_recvs = 0;
        self.complete_sq(sh, true);
    }

    /// Completes finished send-queue entries in order; in the late mode, a
    /// signaled SEND (and what follows it) only with `release`.
    fn complete_sq(&mut self, sh: &QpShared, release: bool) {
        let acked = self.peer_acked;
        while self.sq.cursor < self.sq.tail {
            let abs = self.sq.cursor;
            let e = self.sq.get_mut(abs);
            if !e.finished(acked) {
                break;
            }
            e.done = true;
            let (signaled, wr_id, opcode, len) = (e.signaled, e.wr_id, e.opcode, e.len);
            if signaled && opcode == WcOpcode::Send && !release && sh.cq.late_send_completions() {
                // Test-only: held back until the peer's next SEND is
                // delivered (`complete_recv`), or the hold ends.
                if self.held_until.is_none() {
                    let until = Instant::now() + sh.cq.late_send_hold();
                    self.held_until = Some(until);
                    sh.cq.hold_sends(sh.qp_num, until);
                }
                break;
            }
            self.sq.cursor += 1;
            if signaled {
                let byte_len = if opcode == WcOpcode::RdmaRead { len } else { 0 };
                sh.complete(wr_id, opcode, WcStatus::Success, byte_len);
                // This completion retires the unsignaled entries before it.
                self.sq.head = self.sq.cursor;
            }
        }
    }

    /// Moves to the error state: completes the faulting work request with its
    /// status, flushes every other outstanding one, tells the peer.
    fn fail(&mut self, sh: &QpShared, why: Failure) {
        if self.state == QpState::Error {
            return;
        }
        let connected = self.state == QpState::Ready && self.sock.is_some();
        self.state = QpState::Error;
        match why {
            // The peer broke the rules (bad rkey, range, right or frame):
            // worth a line at the default level, naming the peer.
            Failure::Fault { code, seq } => tracing::warn!(
                qp = sh.qp_num,
                peer = %self.peer,
                seq,
                "peer request refused ({}): queue pair terminated",
                wire::term_name(code)
            ),
            Failure::Timeout => tracing::warn!(
                qp = sh.qp_num,
                peer = %self.peer,
                timeout = ?sh.options.transport_timeout,
                "the peer made no progress on an outstanding request within the transport timeout: \
                 queue pair fails, connection reset"
            ),
            Failure::FrameTimeout => tracing::warn!(
                qp = sh.qp_num,
                peer = %self.peer,
                timeout = ?sh.options.frame_timeout,
                "the peer stopped in the middle of a frame for longer than the frame timeout: \
                 queue pair fails, connection reset"
            ),
            _ => tracing::debug!(qp = sh.qp_num, peer = %self.peer, ?why, "queue pair enters the error state"),
        }
        let named = match why {
            Failure::Terminated { code, seq } if seq != 0 => Some((seq, wire::remote_status(code))),
            _ => None,
        };
        let mut first = matches!(why, Failure::Transport | Failure::Timeout | Failure::FrameTimeout) && connected;
        let mut abs = self.sq.cursor;
        // Late send completions: the SEND at `cursor` was acknowledged and
        // its completion held back, and so may be some behind it. They are
        // flushed like the rest; the transport error goes to the first
        // request not finished. (With the mode off, `held` is false.)
        let held = self.held_until.take().is_some();
        self.held_recvs = 0;
        while abs < self.sq.tail {
            let e = self.sq.get(abs);
            let finished = held && e.finished(self.peer_acked);
            let status = match (e.fault, named) {
                _ if finished => WcStatus::WrFlushError,
                (Some(f), _) => f,
                (None, Some((seq, st))) if seq == e.seq => st,
                _ if first => WcStatus::TransportError,
                _ => WcStatus::WrFlushError,
            };
            first &= finished;
            sh.complete(e.wr_id, e.opcode, status, 0);
            abs += 1;
        }
        self.sq.head = self.sq.tail;
        self.sq.cursor = self.sq.tail;
        self.pending_reads.clear();
        while !self.rq.is_empty() {
            sh.complete(self.rq.front().wr_id, WcOpcode::Recv, WcStatus::WrFlushError, 0);
            self.rq.head += 1;
        }
        self.job = Job::None;
        self.ack_needed = false;
        if connected {
            match why {
                Failure::Fault { code, seq } => {
                    let mut h = Header { seq, aux: code, ..Header::new(FrameType::Terminate) };
                    if !self.tx_ctrl(&mut h) {
                        self.tx_open = false;
                        self.backlog.clear();
                    }
                }
                Failure::User => {
                    let mut h = Header::new(FrameType::Disconnect);
                    if !self.tx_ctrl(&mut h) {
                        self.tx_open = false;
                        self.backlog.clear();
                    }
                }
                // The peer is leaving: what we still had queued for it is moot.
                Failure::Disconnected => self.backlog.clear(),
                // The peer is not told (Local), or told us (Terminated) and
                // may stay Ready (receiver not ready): frames already queued
                // still go out whole, so the stream stays parseable, and the
                // stream stays open until the application disconnects.
                Failure::Terminated { .. } | Failure::Local => self.linger = true,
                Failure::Transport => {
                    self.backlog.clear();
                    self.rx_open = false;
                    self.tx_open = false;
                }
                Failure::Timeout | Failure::FrameTimeout => self.reset(sh),
            }
            self.maybe_shutdown_wr();
        }
        self.update_interest(sh);
    }

    // ------------------------------------------------------------ rx --

    /// Receives and processes frames until the socket is drained or the
    /// budget of receive syscalls is spent. What one read brings is
    /// processed before the next read (or the end of the round), so a round
    /// never leaves a whole frame waiting in staging: level-triggered epoll
    /// would not report it. A short read ends the round without a further
    /// read that would only fail with EAGAIN.
    fn rx_pump(&mut self, sh: &QpShared, first: Option<Received>) {
        let mut reads = usize::from(first.is_some());
        let mut drained = matches!(first, Some(Received::Short | Received::Nothing));
        loop {
            if !self.rx_open {
                return;
            }
            if self.state != QpState::Ready {
                // Frames staged behind the failure are never executed.
                self.staging.clear();
                self.rx_drain();
                return;
            }
            self.rx_parse(sh);
            if !self.rx_open || self.state != QpState::Ready {
                continue;
            }
            if drained || reads == RX_BUDGET {
                return;
            }
            reads += 1;
            // A payload still pending is not staged (staging was emptied
            // into it): it is read directly, with staging behind it.
            let received = if self.payload_remaining() > 0 { self.rx_direct(sh) } else { self.rx_fill(sh) };
            match received {
                Received::Full => {}
                Received::Short => drained = true,
                Received::Nothing => return,
            }
        }
    }

    /// Payload bytes of the current frame still to be placed (0 between
    /// frames; a discarded payload is never placed directly).
    fn payload_remaining(&self) -> usize {
        match self.job {
            Job::None | Job::Discard { .. } => 0,
            job => {
                let (len, done) = job.len_done();
                (len - done) as usize
            }
        }
    }

    /// Error state: read and discard until EOF, so the peer never blocks on
    /// us and its final frames are not lost to a reset.
    fn rx_drain(&mut self) {
        let mut scratch = [0u8; DRAIN_CHUNK];
        for _ in 0..RX_BUDGET {
            match sys::read(self.fd, &mut scratch) {
                Ok(0) => {
                    self.rx_open = false;
                    return;
                }
                Ok(_) => {}
                Err(e) if is_would_block(&e) => return,
                Err(_) => {
                    self.rx_open = false;
                    return;
                }
            }
        }
    }

    fn rx_closed(&mut self, sh: &QpShared) {
        if self.state == QpState::Ready {
            self.fail(sh, Failure::Transport);
        }
        self.rx_open = false;
    }

    /// The outcome of a receive syscall that asked for `asked` bytes: the
    /// byte count, or `None` when the round stops (nothing to read, or the
    /// stream ended or broke).
    fn rx_result(&mut self, sh: &QpShared, r: io::Result<usize>, asked: usize) -> Option<(usize, Received)> {
        match r {
            Ok(0) => {
                self.rx_closed(sh);
                None
            }
            Ok(n) => Some((n, if n < asked { Received::Short } else { Received::Full })),
            Err(e) if is_would_block(&e) => None,
            Err(_) => {
                self.rx_closed(sh);
                None
            }
        }
    }

    /// Processes what staging holds: whole headers, and payload bytes
    /// placed into their destinations. Leaves at most a partial header.
    fn rx_parse(&mut self, sh: &QpShared) {
        while self.state == QpState::Ready {
            if matches!(self.job, Job::None) {
                let Some(raw) = self.staging.take_header() else { return };
                self.rx_headers += 1;
                self.on_header(sh, &raw);
            } else if self.staging.is_empty() || self.rx_place_staged(sh) == Step::Stop {
                return;
            }
        }
    }

    /// Reads whatever the socket holds into staging.
    fn rx_fill(&mut self, sh: &QpShared) -> Received {
        let spare = self.staging.spare();
        let asked = spare.len();
        let r = sys::read(self.fd, spare);
        let Some((n, received)) = self.rx_result(sh, r, asked) else { return Received::Nothing };
        self.staging.commit(n);
        received
    }

    /// Copies the staged bytes of the current payload to its destination,
    /// checked and pinned as for a direct read.
    fn rx_place_staged(&mut self, sh: &QpShared) -> Step {
        let (len, done) = self.job.len_done();
        let n = ((len - done) as usize).min(self.staging.len());
        if !matches!(self.job, Job::Discard { .. }) {
            let table = sh.pd.table.load();
            let mut window_region = None;
            let mut pins = Pins::new();
            let mut iov = ArrayVec::<libc::iovec, MAX_SGE>::new();
            if self.payload_dest(sh, &table, &mut window_region, &mut pins, n as u64, &mut iov).is_none() {
                drop(pins);
                self.placement_fault(sh);
                return Step::Stop;
            }
            // SAFETY: the iovecs cover exactly `n` bytes in regions checked
            // just above (valid, registered with LOCAL_WRITE/REMOTE_WRITE,
            // covering the range) and pinned until `pins` drops after the
            // copy; staging holds at least `n` bytes and is this QP's own
            // buffer, never registered, so the ranges do not overlap.
            unsafe { self.staging.copy_to(&iov, n) };
        }
        self.staging.consume(n);
        self.job.advance(n as u32);
        self.tx_progress |= matches!(self.job, Job::ReadResp { .. });
        if done as usize + n == len as usize {
            self.finish_job(sh);
        }
        Step::Go
    }

    /// Receives the rest of the current payload straight into its
    /// destination, and what follows it into staging:
    /// `readv([destination..., staging])`. Staging is empty here (a
    /// pending payload took every staged byte).
    fn rx_direct(&mut self, sh: &QpShared) -> Received {
        let want = self.payload_remaining();
        let table = sh.pd.table.load();
        let mut window_region = None;
        let mut pins = Pins::new();
        let mut iov = ArrayVec::<libc::iovec, { MAX_SGE + 1 }>::new();
        let built = self.payload_dest(sh, &table, &mut window_region, &mut pins, want as u64, &mut iov);
        if built.is_none() {
            drop(pins);
            self.placement_fault(sh);
            return Received::Nothing;
        }
        let spare = self.staging.spare_iov();
        let asked = want + spare.iov_len;
        iov.push(spare);
        // SAFETY: all but the last iovec lie in regions that are pinned
        // (valid, registered with LOCAL_WRITE/REMOTE_WRITE and covering the
        // range, checked just above) until `pins` drops after the call; the
        // last is the free part of staging, which no reference aliases
        // during the call.
        let r = unsafe { sys::readv(self.fd, &iov) };
        drop(pins);
        let Some((n, received)) = self.rx_result(sh, r, asked) else { return Received::Nothing };
        let placed = n.min(want);
        self.staging.commit(n - placed);
        self.job.advance(placed as u32);
        self.tx_progress |= placed > 0 && matches!(self.job, Job::ReadResp { .. });
        if placed == want {
            self.finish_job(sh);
        }
        received
    }

    /// Builds iovecs over the next `want` bytes of the current payload's
    /// destination, checking it as at the header and pinning its regions.
    /// `None` if the destination is no longer valid. Called for every
    /// placement, so a window invalidated (or a region deregistered)
    /// mid-payload stops the rest of it.
    fn payload_dest<'t, const N: usize>(
        &self,
        sh: &QpShared,
        table: &'t RegionTable,
        window_region: &'t mut Option<Arc<Region>>,
        pins: &mut Pins<'t>,
        want: u64,
        iov: &mut ArrayVec<libc::iovec, N>,
    ) -> Option<()> {
        let (_, done) = self.job.len_done();
        match self.job {
            Job::Write { rkey, addr, .. } => {
                // addr + len was bounds-checked against the region at the
                // header, so this cannot overflow.
                let cur = addr + done as u64;
                let r = sh.pd.remote(table, window_region, sh.qp_num, rkey, cur, want, Access::REMOTE_WRITE)?;
                if !pins.pin(r) {
                    return None;
                }
                iov.push(sys::iov(cur, want as usize));
                Some(())
            }
            Job::Send { .. } => scatter(table, &self.rq.front().sges, done as u64, want, Access::LOCAL_WRITE, pins, iov),
            Job::ReadResp { abs, .. } => {
                scatter(table, &self.sq.get(abs).sges, done as u64, want, Access::LOCAL_WRITE, pins, iov)
            }
            Job::None | Job::Discard { .. } => Some(()),
        }
    }

    /// A destination became invalid (deregistered, or never valid).
    fn placement_fault(&mut self, sh: &QpShared) {
        match self.job {
            Job::None => {}
            Job::Write { seq, .. } => self.fail(sh, Failure::Fault { code: wire::TERM_REMOTE_ACCESS, seq }),
            Job::Send { seq, .. } => {
                self.complete_recv(sh, WcStatus::LocalProtectionError, 0);
                self.fail(sh, Failure::Fault { code: wire::TERM_REMOTE_OPERATION, seq });
            }
            Job::ReadResp { abs, .. } => {
                self.sq.get_mut(abs).fault = Some(WcStatus::LocalProtectionError);
                self.fail(sh, Failure::Local);
            }
            Job::Discard { .. } => {}
        }
    }

    fn finish_job(&mut self, sh: &QpShared) {
        match std::mem::replace(&mut self.job, Job::None) {
            Job::None => {}
            Job::Write { seq, ack_req, .. } => self.processed(seq, ack_req),
            Job::Send { seq, len, ack_req, invalidated, .. } => {
                self.complete_recv_invalidating(sh, WcStatus::Success, len, invalidated);
                self.processed(seq, ack_req);
            }
            Job::ReadResp { abs, .. } => {
                self.sq.get_mut(abs).done = true;
                self.pending_reads.pop_front();
                self.advance_sq(sh);
            }
            Job::Discard { .. } => {}
        }
    }

    /// Pops the oldest receive with a completion.
    fn complete_recv(&mut self, sh: &QpShared, status: WcStatus, byte_len: u32) {
        self.complete_recv_invalidating(sh, status, byte_len, None);
    }

    fn complete_recv_invalidating(&mut self, sh: &QpShared, status: WcStatus, byte_len: u32, invalidated: Option<u32>) {
        if !self.rq.is_empty() {
            sh.complete_invalidating(self.rq.front().wr_id, WcOpcode::Recv, status, byte_len, invalidated);
            self.rq.head += 1;
            if self.held_until.is_some() && status == WcStatus::Success {
                // Late send completions: the peer's next SEND (or the
                // N-th, `late_sends_after`) is delivered.
                self.held_recvs += 1;
                if self.held_recvs >= sh.cq.late_sends_after() {
                    self.release_held_sends(sh);
                }
            }
        }
    }

    /// The peer's request `seq` is fully processed.
    fn processed(&mut self, seq: u32, ack_req: bool) {
        self.rx_processed = seq;
        self.ack_needed |= ack_req;
    }

    fn protocol_error(&mut self, sh: &QpShared, seq: u32, what: String) {
        tracing::warn!(qp = sh.qp_num, peer = %self.peer, "protocol error from peer: {what}");
        self.fail(sh, Failure::Fault { code: wire::TERM_INVALID_REQUEST, seq });
    }

    fn on_header(&mut self, sh: &QpShared, raw: &[u8; HDR_LEN]) {
        let h = match Header::decode(raw) {
            Ok(h) => h,
            Err(e) => return self.protocol_error(sh, 0, e.to_string()),
        };
        self.staging.note_frame(h.length);
        let wr_seq = if h.ty.carries_wr() { h.seq } else { 0 };
        if h.ty.carries_wr() && h.seq != self.rx_expected {
            let due = self.rx_expected;
            return self.protocol_error(sh, wr_seq, format!("seq {} where {due} was due", h.seq));
        }
        if !(seq_le(self.peer_acked, h.ack) && seq_le(h.ack, self.last_sent_seq)) {
            let (lo, hi) = (self.peer_acked, self.last_sent_seq);
            return self.protocol_error(sh, wr_seq, format!("ack {} outside [{lo}, {hi}]", h.ack));
        }
        if h.ack != self.peer_acked {
            self.peer_acked = h.ack;
            self.tx_progress = true;
        }
        self.advance_sq(sh);
        if h.ty.carries_wr() {
            self.rx_expected = seq_next(h.seq);
            if self.rnr_nakked {
                // Behind a NAKed SEND: never executed, never acknowledged.
                if h.ty != FrameType::ReadReq && h.length > 0 {
                    self.job = Job::Discard { len: h.length, done: 0 };
                }
                return;
            }
        }
        let ack_req = h.flags & FLAG_ACK_REQUESTED != 0;
        match h.ty {
            FrameType::Hello | FrameType::HelloReply => {
                self.protocol_error(sh, 0, format!("{:?} after the handshake", h.ty))
            }
            FrameType::Ack => {}
            FrameType::Terminate => self.fail(sh, Failure::Terminated { code: h.aux, seq: h.seq }),
            FrameType::Disconnect => self.fail(sh, Failure::Disconnected),
            FrameType::Write => {
                let table = sh.pd.table.load();
                let mut window_region = None;
                if h.length > 0
                    && sh
                        .pd
                        .remote(&table, &mut window_region, sh.qp_num, h.rkey, h.remote_addr, h.length as u64, Access::REMOTE_WRITE)
                        .is_none()
                {
                    return self.fail(sh, Failure::Fault { code: wire::TERM_REMOTE_ACCESS, seq: h.seq });
                }
                if h.length == 0 {
                    return self.processed(h.seq, ack_req);
                }
                self.job =
                    Job::Write { seq: h.seq, rkey: h.rkey, addr: h.remote_addr, len: h.length, done: 0, ack_req };
            }
            FrameType::Send => {
                if self.rq.is_empty() {
                    return self.rnr_nak(sh, &h);
                }
                let room: u64 = self.rq.front().sges.iter().map(|s| s.length as u64).sum();
                if h.length as u64 > room {
                    self.complete_recv(sh, WcStatus::LocalLengthError, 0);
                    return self.fail(sh, Failure::Fault { code: wire::TERM_INVALID_REQUEST, seq: h.seq });
                }
                // SEND with Invalidate: the window goes before the receive
                // completes (and before the peer's next request is read).
                let invalidated = (h.flags & wire::FLAG_INVALIDATE != 0).then_some(h.rkey);
                if let Some(rkey) = invalidated {
                    if !sh.pd.invalidate_window(sh.qp_num, rkey) {
                        return self.invalidation_refused(sh, &h);
                    }
                }
                if h.length == 0 {
                    self.complete_recv_invalidating(sh, WcStatus::Success, 0, invalidated);
                    return self.processed(h.seq, ack_req);
                }
                self.job = Job::Send { seq: h.seq, len: h.length, done: 0, ack_req, invalidated };
            }
            FrameType::ReadReq => self.serve_read(sh, &h),
            FrameType::ReadResp => {
                let Some(&abs) = self.pending_reads.front() else {
                    return self.protocol_error(sh, 0, "READ_RESP without an outstanding READ".to_owned());
                };
                let e = self.sq.get(abs);
                if e.seq != h.aux {
                    let expected = e.seq;
                    return self.protocol_error(sh, 0, format!("READ_RESP for seq {} where {expected} was due", h.aux));
                }
                if h.length != e.len {
                    tracing::warn!(qp = sh.qp_num, "READ_RESP of {} bytes for a {}-byte READ", h.length, e.len);
                    self.sq.get_mut(abs).fault = Some(WcStatus::LocalLengthError);
                    return self.fail(sh, Failure::Fault { code: wire::TERM_INVALID_REQUEST, seq: 0 });
                }
                self.job = Job::ReadResp { abs, len: h.length, done: 0 };
                self.tx_progress = true;
                if h.length == 0 {
                    self.finish_job(sh);
                }
            }
        }
    }

    /// A SEND found no posted receive. As on RC hardware with no RNR
    /// retries, the requester's work request fails with RNR_RETRY_EXC_ERR
    /// and its queue pair enters the error state, while this queue pair only
    /// answers with the NAK (TERMINATE naming the SEND) and stays Ready; the
    /// requests that follow the SEND are dropped.
    fn rnr_nak(&mut self, sh: &QpShared, h: &Header) {
        tracing::debug!(qp = sh.qp_num, peer = %self.peer, seq = h.seq, "SEND with no receive posted: RNR NAK");
        self.rnr_nakked = true;
        if h.length > 0 {
            self.job = Job::Discard { len: h.length, done: 0 };
        }
        let mut t = Header { seq: h.seq, aux: wire::TERM_RNR, ..Header::new(FrameType::Terminate) };
        if !self.tx_ctrl(&mut t) {
            self.fail(sh, Failure::Transport);
        }
    }

    /// A SEND with Invalidate named a key this queue pair cannot invalidate
    /// (no window bound on it): IBTA's class J error. As RC hardware does
    /// (rxe's responder, checked), the SEND is acknowledged, so the
    /// sender's work request succeeds, while the receive completes with
    /// `RemoteInvalidRequest` (rxe's `IB_WC_REM_INV_REQ_ERR`) and this
    /// queue pair fails without a word to the peer, as for a local fault:
    /// the peer learns of it as of any responder that stopped answering.
    /// Nothing is invalidated, and the SEND's payload is dropped.
    fn invalidation_refused(&mut self, sh: &QpShared, h: &Header) {
        tracing::warn!(
            qp = sh.qp_num,
            peer = %self.peer,
            seq = h.seq,
            rkey = format_args!("{:#x}", h.rkey),
            "peer's SEND with Invalidate names a key that is no memory window of this queue pair: queue pair fails"
        );
        self.complete_recv(sh, WcStatus::RemoteInvalidRequest, 0);
        self.processed(h.seq, true);
        let mut ack = Header::new(FrameType::Ack);
        if !self.tx_ctrl(&mut ack) {
            return self.fail(sh, Failure::Transport);
        }
        self.fail(sh, Failure::Local);
    }

    /// Responder side of RDMA READ: check, then send READ_RESP with the
    /// payload taken straight from the registered region.
    fn serve_read(&mut self, sh: &QpShared, h: &Header) {
        let table = sh.pd.table.load();
        let mut window_region = None;
        let mut pins = Pins::new();
        let len = h.aux; // decode bounds it at MAX_PAYLOAD
        let mut iov = [EMPTY_IOV; 1];
        let mut n = 0;
        if len > 0 {
            match sh.pd.remote(&table, &mut window_region, sh.qp_num, h.rkey, h.remote_addr, len as u64, Access::REMOTE_READ) {
                Some(r) if pins.pin(r) => {
                    iov[0] = sys::iov(h.remote_addr, len as usize);
                    n = 1;
                }
                _ => {
                    drop(pins);
                    return self.fail(sh, Failure::Fault { code: wire::TERM_REMOTE_ACCESS, seq: h.seq });
                }
            }
        }
        self.processed(h.seq, false);
        let mut resp = Header { length: len, aux: h.seq, ..Header::new(FrameType::ReadResp) };
        // SAFETY: the range was checked against the region (REMOTE_READ,
        // bounds) and the region stays pinned until `pins` drops.
        let ok = unsafe { self.tx_frame(&mut resp, &iov[..n]) };
        drop(pins);
        if !ok {
            self.fail(sh, Failure::Transport);
        }
    }
}
