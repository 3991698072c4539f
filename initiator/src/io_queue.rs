//! The completion-based submission API: [`IoQueue`], [`IoRequest`],
//! [`IoCompletion`].
//!
//! An `IoQueue` submits requests without waiting for them and hands back
//! their completions in batches, each with the caller's tag, so one thread
//! can keep many requests in flight. It works on one of the session's queue
//! pairs (shared with the synchronous calls of threads on the same queue).
//!
//! # Ownership of buffers
//! A read or write request owns its [`IoBuffer`] from submission until its
//! completion hands it back ([`IoCompletion::buffer`]): the target places
//! data into it (or takes data from it) while nobody else can touch it. No
//! copy is made. A buffer comes back only when no command naming it is
//! outstanding, or after the queue pair that carried such a command went to
//! the error state.
//!
//! # Queue depth
//! [`IoQueue::submit`] never blocks and never refuses for lack of room:
//! pieces that find no free command slot wait in the `IoQueue` (in software)
//! and are sent as slots free up, during [`IoQueue::poll`] and
//! [`IoQueue::wait`]. The number of commands on the wire never exceeds the
//! negotiated queue depth. Use [`IoQueue::outstanding`] for back-pressure.
//!
//! # Waking a waiting queue
//! [`IoQueue::waker`] gives an [`IoWaker`] that another thread uses to make
//! a [`IoQueue::wait`] in progress (or the next one) return early, so one
//! thread can sleep on the queue's completions and still take new work
//! that other threads hand it (the ublk server's queue threads do).
//! [`IoQueue::wait_or_readable`] also returns when a descriptor the caller
//! reads itself is readable (the NBD server's connection socket).
//!
//! # Failures
//! After a connection failure the pieces that had not completed are sent
//! again once the session has reconnected; a piece that missed
//! `io_timeout` fails its request with [`Error::Timeout`]. When the session
//! is lost, every request completes with [`Error::TargetLost`].

use std::collections::VecDeque;
use std::fmt;
use std::os::fd::BorrowedFd;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rdmablk_common::fabric::{Rkey, Sge};
use rdmablk_common::protocol::{
    BlockCount, CommandCapsule, CommandId, DataDescriptor, Lba, Opcode, Status, FLAG_FUA, FLAG_INLINE_DATA,
};

use crate::buffer::IoBuffer;
use crate::conn::{status_error, AlsoWake, Conn, Response, Stats, Wake};
use crate::connection_set::{lock, Phase, Shared, VolumeEntry};
use crate::device::max_piece;
use crate::error::{op_name, Error, Result};
use crate::queue::ZEROES_PIECE;
use crate::session::{Session, Volume};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Read,
    Write { fua: bool },
    Flush,
    Discard,
    WriteZeroes,
}

impl Kind {
    fn opcode(self) -> Opcode {
        match self {
            Kind::Read => Opcode::Read,
            Kind::Write { .. } => Opcode::Write,
            Kind::Flush => Opcode::Flush,
            Kind::Discard => Opcode::Discard,
            Kind::WriteZeroes => Opcode::WriteZeroes,
        }
    }
}

/// One request for an [`IoQueue`]: build it with the constructors, submit
/// it with [`IoQueue::submit`].
///
/// Alignment: `offset` and the length must be multiples of the volume's
/// block size and inside the volume; a buffer offset may be anything. A
/// request that breaks a rule completes at once with the error (its buffer
/// handed back) and sends nothing.
pub struct IoRequest {
    kind: Kind,
    shared: Arc<Shared>,
    entry: Arc<VolumeEntry>,
    offset: u64,
    len: u64,
    buffer: Option<IoBuffer>,
    buf_offset: usize,
    /// WRITE_ZEROES that must leave the range allocated.
    no_hole: bool,
}

impl IoRequest {
    fn new(kind: Kind, volume: &Volume, offset: u64, len: u64, buffer: Option<IoBuffer>) -> IoRequest {
        IoRequest {
            kind,
            shared: Arc::clone(&volume.session().shared),
            entry: Arc::clone(&volume.entry),
            offset,
            len,
            buffer,
            buf_offset: 0,
            no_hole: false,
        }
    }

    /// Reads `buffer.len()` bytes at `offset` into `buffer`, zero-copy.
    pub fn read(volume: &Volume, offset: u64, buffer: IoBuffer) -> IoRequest {
        let len = buffer.len() as u64;
        IoRequest::new(Kind::Read, volume, offset, len, Some(buffer))
    }

    /// Writes the whole of `buffer` at `offset`, zero-copy: the target
    /// RDMA-READs it, or, for a piece of at most the negotiated inline data
    /// size, the command's SEND gathers it after the capsule.
    pub fn write(volume: &Volume, offset: u64, buffer: IoBuffer) -> IoRequest {
        let len = buffer.len() as u64;
        IoRequest::new(Kind::Write { fua: false }, volume, offset, len, Some(buffer))
    }

    /// Makes every write completed before this request is submitted durable.
    pub fn flush(volume: &Volume) -> IoRequest {
        IoRequest::new(Kind::Flush, volume, 0, 0, None)
    }

    /// Deallocates `[offset, offset + len)` (a no-op on volumes without
    /// DISCARD).
    pub fn discard(volume: &Volume, offset: u64, len: u64) -> IoRequest {
        IoRequest::new(Kind::Discard, volume, offset, len, None)
    }

    /// Sets `[offset, offset + len)` to zeroes (written from a registered
    /// zero region on volumes without WRITE_ZEROES).
    pub fn write_zeroes(volume: &Volume, offset: u64, len: u64) -> IoRequest {
        IoRequest::new(Kind::WriteZeroes, volume, offset, len, None)
    }

    /// Limits a read or write to `buffer[buf_offset..][..len]`.
    pub fn with_range(mut self, buf_offset: usize, len: usize) -> IoRequest {
        self.buf_offset = buf_offset;
        self.len = len as u64;
        self
    }

    /// Force Unit Access for a write: durable before it completes.
    pub fn with_fua(mut self) -> IoRequest {
        if let Kind::Write { fua } = &mut self.kind {
            *fua = true;
        }
        self
    }

    /// For a write-zeroes request: the range must stay allocated (NBD's
    /// `NO_HOLE`, a thick zeroing). The target's WRITE_ZEROES may punch a
    /// hole on some backends (a memory volume, a file system without
    /// zero-range), so such a request is carried out as writes from the
    /// session's registered zero region instead. No effect on other kinds.
    pub fn with_no_hole(mut self) -> IoRequest {
        self.no_hole = self.kind == Kind::WriteZeroes;
        self
    }

    /// The buffer, if the request has one.
    pub fn into_buffer(self) -> Option<IoBuffer> {
        self.buffer
    }

    fn validate(&self, shared: &Arc<Shared>) -> Result<()> {
        let op = self.kind.opcode();
        if !Arc::ptr_eq(&self.shared, shared) {
            return Err(Error::invalid("the volume of the request was opened by another session than the queue's"));
        }
        let info = &self.entry.info;
        if let Some(buf) = &self.buffer {
            if !Arc::ptr_eq(buf.domain(), &shared.domain) {
                return Err(Error::invalid(
                    "the I/O buffer was allocated by another session; its keys are not valid here",
                ));
            }
            let end = usize::try_from(self.len).ok().and_then(|l| self.buf_offset.checked_add(l));
            if end.is_none_or(|e| e > buf.len()) {
                return Err(Error::invalid(format!(
                    "{} of {} bytes at buffer offset {} overruns the {}-byte I/O buffer",
                    op_name(op),
                    self.len,
                    self.buf_offset,
                    buf.len()
                )));
            }
        }
        if op != Opcode::Flush {
            crate::device::check_request(op, self.offset, self.len, info.block_size, info.size_bytes)?;
        }
        if !matches!(op, Opcode::Read | Opcode::Flush) && info.read_only() {
            return Err(Error::ReadOnly { op, volume: info.name.clone() });
        }
        Ok(())
    }
}

impl fmt::Debug for IoRequest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IoRequest")
            .field("kind", &self.kind)
            .field("volume", &self.entry.name)
            .field("offset", &self.offset)
            .field("len", &self.len)
            .field("buffer", &self.buffer)
            .finish()
    }
}

/// The end of a request submitted to an [`IoQueue`].
#[derive(Debug)]
pub struct IoCompletion {
    /// The tag given at submission.
    pub tag: u64,
    /// How it ended. Errors carry the target's status with the volume,
    /// offset and length of the failing piece.
    pub result: Result<()>,
    /// The request's buffer, back to the caller (reads: holding the data).
    pub buffer: Option<IoBuffer>,
}

impl IoCompletion {
    /// The buffer, for the next request.
    pub fn into_buffer(self) -> Option<IoBuffer> {
        self.buffer
    }
}

struct Req {
    tag: u64,
    kind: Kind,
    entry: Arc<VolumeEntry>,
    buffer: Option<IoBuffer>,
    addr: u64,
    rkey: Rkey,
    offset: u64,
    /// WRITE_ZEROES carried out as writes from the zero region.
    emulated: bool,
    /// Pieces not finished (queued or on the wire).
    remaining: usize,
    error: Option<Error>,
}

#[derive(Clone, Copy, Debug)]
struct Piece {
    req: usize,
    rel: u64,
    len: u64,
}

struct Flight {
    piece: Piece,
    gen: u32,
    /// The connection's ticket for this command (see `Conn::detach`).
    ticket: u64,
    deadline: Instant,
}

/// A completion-based submission queue: submit many requests without
/// waiting, each with a tag, and reap their completions in batches.
///
/// Create one per thread with [`Session::io_queue`]; it is `Send` (move it
/// to another thread) but used through `&mut self`. Each request produces
/// exactly one [`IoCompletion`]. Dropping the queue abandons requests not
/// yet sent and waits for those on the wire (bounded by `io_timeout`).
///
/// ```no_run
/// use rdmablk_initiator::{ConnectOptions, IoRequest, Session};
///
/// # fn main() -> rdmablk_initiator::Result<()> {
/// let session = Session::connect("tcp://127.0.0.1:7420", ConnectOptions::default())?;
/// let vol = session.open("vol0")?;
/// let mut queue = session.io_queue();
/// // 64 reads of 128 KiB in flight at once, each into its own registered buffer.
/// for i in 0..64u64 {
///     let buf = session.alloc_buffer(128 << 10)?;
///     queue.submit(IoRequest::read(&vol, i * (128 << 10), buf), i);
/// }
/// let mut done = Vec::new();
/// while queue.outstanding() > 0 {
///     queue.wait(&mut done, 1, None);
///     for c in done.drain(..) {
///         c.result?;
///         let data = c.buffer.expect("reads hand their buffer back");
///         println!("request {} read {} bytes", c.tag, data.len());
///     }
/// }
/// # Ok(())
/// # }
/// ```
pub struct IoQueue {
    session: Session,
    home: usize,
    reqs: Vec<Option<Req>>,
    free_reqs: Vec<usize>,
    pending: VecDeque<Piece>,
    inflight: Vec<Flight>,
    done: VecDeque<IoCompletion>,
    /// Submitted and not yet handed back.
    outstanding: usize,
    /// Dropping: pieces of dead connections are not sent again.
    draining: bool,
    /// The queue every piece on the wire was sent on (all on one
    /// connection); chosen afresh only when nothing is on the wire.
    bound: usize,
    /// Set up by the first [`IoQueue::waker`].
    wake: Option<Arc<Wake>>,
}

impl Session {
    /// A completion-based submission queue on one of the session's queue
    /// pairs (the next one, round-robin). See [`IoQueue`].
    pub fn io_queue(&self) -> IoQueue {
        IoQueue::new(self.clone())
    }
}

impl IoQueue {
    pub(crate) fn new(session: Session) -> IoQueue {
        let home = session.shared.next_home();
        IoQueue {
            session,
            home,
            reqs: Vec::new(),
            free_reqs: Vec::new(),
            pending: VecDeque::new(),
            inflight: Vec::new(),
            done: VecDeque::new(),
            outstanding: 0,
            draining: false,
            bound: 0,
            wake: None,
        }
    }

    /// A handle that makes a [`wait`](IoQueue::wait) of this queue return
    /// early from another thread: the wait in progress, or the next one if
    /// none is. Waking costs one `write` to an eventfd that the waiting
    /// thread sleeps on together with the completion channel.
    pub fn waker(&mut self) -> Result<IoWaker> {
        if self.wake.is_none() {
            self.wake = Some(Arc::new(Wake::new()?));
        }
        Ok(IoWaker { wake: Arc::clone(self.wake.as_ref().expect("just set")) })
    }

    /// Consumes a pending wake-up; true if there was one.
    fn take_wake(&self) -> bool {
        self.wake.as_ref().is_some_and(|w| w.take())
    }

    /// Requests submitted whose completion has not been handed back yet.
    pub fn outstanding(&self) -> usize {
        self.outstanding
    }

    /// Commands of this queue on the wire now (never more than the queue depth).
    pub fn in_flight(&self) -> usize {
        self.inflight.len()
    }

    /// Pieces waiting for a free command slot (or for reconnection).
    pub fn queued(&self) -> usize {
        self.pending.len()
    }

    /// Submits `request` with `tag` and sends as much as the queue depth
    /// allows, without waiting. An invalid request (misaligned, out of
    /// range, read-only volume, foreign buffer) completes at once with its
    /// error. Requests larger than the max I/O size are split; the
    /// completion comes when every piece is done.
    pub fn submit(&mut self, request: IoRequest, tag: u64) {
        if self.enqueue(request, tag) {
            self.drive(0, None);
        }
    }

    /// Submits several requests (each with its tag) and sends as many as
    /// the queue depth allows in one post — one `sendmsg` on tcp instead of
    /// one per request — without waiting and without polling for
    /// completions. Otherwise as [`submit`](IoQueue::submit).
    pub fn submit_batch(&mut self, requests: impl IntoIterator<Item = (IoRequest, u64)>) {
        let mut any = false;
        for (request, tag) in requests {
            any |= self.enqueue(request, tag);
        }
        if any {
            self.drive_with(0, None, false);
        }
    }

    /// Validates a request and queues it to be sent; false if it completed
    /// at once (invalid, or nothing to do).
    fn enqueue(&mut self, request: IoRequest, tag: u64) -> bool {
        self.outstanding += 1;
        let shared = Arc::clone(&self.session.shared);
        if let Err(e) = request.validate(&shared) {
            self.done.push_back(IoCompletion { tag, result: Err(e), buffer: request.buffer });
            return false;
        }
        let IoRequest { kind, entry, offset, len, buffer, buf_offset, no_hole, .. } = request;
        let info = &entry.info;
        let flags_ok = match kind {
            Kind::Discard => info.flags & rdmablk_common::protocol::VOLUME_FLAG_DISCARD != 0,
            _ => true,
        };
        let nothing_to_do = (len == 0 && kind != Kind::Flush) || !flags_ok || (kind == Kind::Flush && info.read_only());
        if nothing_to_do {
            self.done.push_back(IoCompletion { tag, result: Ok(()), buffer });
            return false;
        }
        let emulated = kind == Kind::WriteZeroes
            && (no_hole || info.flags & rdmablk_common::protocol::VOLUME_FLAG_WRITE_ZEROES == 0);
        let (addr, rkey) = match &buffer {
            Some(b) => (b.region().addr() + buf_offset as u64, b.region().rkey()),
            None => (0, Rkey(0)),
        };
        let req = Req { tag, kind, entry, buffer, addr, rkey, offset, emulated, remaining: 1, error: None };
        let index = match self.free_reqs.pop() {
            Some(i) => {
                self.reqs[i] = Some(req);
                i
            }
            None => {
                self.reqs.push(Some(req));
                self.reqs.len() - 1
            }
        };
        self.pending.push_back(Piece { req: index, rel: 0, len });
        true
    }

    /// Moves completions that are ready into `out` without blocking (after
    /// sending what can be sent and polling the queue pair once); returns
    /// how many.
    pub fn poll(&mut self, out: &mut Vec<IoCompletion>) -> usize {
        self.drive(usize::MAX, None);
        self.hand_out(out, usize::MAX)
    }

    /// Blocks until at least `min` completions are ready (fewer if fewer
    /// requests are outstanding) or `timeout` passes (roughly: checked every
    /// wait slice of at most 100 ms; `None`: no timeout, though requests
    /// themselves end within `io_timeout`, or `ctrl_loss_timeout` while the
    /// session reconnects), or an [`IoWaker`] of this queue wakes it. Moves
    /// every ready completion into `out`; returns how many.
    pub fn wait(&mut self, out: &mut Vec<IoCompletion>, min: usize, timeout: Option<Duration>) -> usize {
        let want = min.min(self.outstanding);
        let until = timeout.map_or_else(|| Instant::now() + Duration::from_secs(365 * 86400), |t| Instant::now() + t);
        self.drive(want, Some(until));
        self.hand_out(out, usize::MAX)
    }

    /// [`wait`](IoQueue::wait) that also returns when `fd` is readable (an
    /// NBD connection's socket, which the caller reads itself: the thread
    /// that serves a connection sleeps for its next request and for its
    /// answers in one `poll`). Returns how many completions it moved into
    /// `out`, and whether `fd` was readable. Without outstanding requests
    /// it returns at once; sleep on the descriptor itself then. An
    /// [`IoWaker`] of this queue does not end this wait.
    pub fn wait_or_readable(
        &mut self,
        out: &mut Vec<IoCompletion>,
        min: usize,
        timeout: Option<Duration>,
        fd: BorrowedFd<'_>,
    ) -> (usize, bool) {
        let want = min.min(self.outstanding);
        let until = timeout.map_or_else(|| Instant::now() + Duration::from_secs(365 * 86400), |t| Instant::now() + t);
        let fired = std::cell::Cell::new(false);
        self.drive_full(want, Some(until), true, Some((fd, &fired)));
        (self.hand_out(out, usize::MAX), fired.get())
    }

    fn hand_out(&mut self, out: &mut Vec<IoCompletion>, max: usize) -> usize {
        let n = self.done.len().min(max);
        out.extend(self.done.drain(..n));
        self.outstanding -= n;
        n
    }

    /// The engine: sends pending pieces, harvests responses, follows
    /// reconnections. Returns when `want` completions are ready, nothing is
    /// left to do, or (`until` given) the time is up; without `until` it
    /// does one non-blocking round.
    fn drive(&mut self, want: usize, until: Option<Instant>) {
        self.drive_with(want, until, true);
    }

    /// [`drive`](IoQueue::drive); without `poll_fabric`, a non-blocking round
    /// only sends (and takes responses already received).
    fn drive_with(&mut self, want: usize, until: Option<Instant>, poll_fabric: bool) {
        self.drive_full(want, until, poll_fabric, None);
    }

    /// [`drive_with`](IoQueue::drive_with); with `readable`, a sleep also
    /// ends (and so does the drive) when its descriptor is readable, which
    /// sets its cell.
    fn drive_full(
        &mut self,
        want: usize,
        until: Option<Instant>,
        poll_fabric: bool,
        readable: Option<(BorrowedFd<'_>, &std::cell::Cell<bool>)>,
    ) {
        let shared = Arc::clone(&self.session.shared);
        loop {
            if let Some(e) = shared.final_error() {
                self.abandon(&shared, e);
                return;
            }
            if self.inflight.is_empty() && self.pending.is_empty() {
                return;
            }
            if shared.phase() == Phase::Reconnecting {
                let Some(until) = until else { return };
                match shared.wait_ready(Some(until)) {
                    Ok(true) => continue,
                    Ok(false) => return,
                    Err(e) => {
                        self.abandon(&shared, e);
                        return;
                    }
                }
            }
            // Everything on the wire is on one connection: look there.
            let index = if self.inflight.is_empty() { self.home % shared.active_queues().max(1) } else { self.bound };
            let slot = &shared.queues[index];
            let mut q = lock(&slot.q);
            let Some(conn) = q.conn.as_mut() else {
                // The connection was closed and dropped: pieces on it are dead.
                self.requeue(|_| true);
                drop(q);
                if until.is_none() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(1));
                continue;
            };
            if self.inflight.first().is_some_and(|f| f.gen != conn.gen) {
                // The connection was replaced (and the old one dropped):
                // send them again, on whichever queue is ours now.
                self.requeue(|_| true);
                drop(q);
                continue;
            }
            self.bound = index;
            if conn.check_usable().is_err() {
                let (gen, reason) = (conn.gen, conn.broken_reason().unwrap_or_default().to_owned());
                // The queue pair is in the error state: pieces on it are dead.
                let held = self.inflight.iter().filter(|f| f.gen == gen).count();
                conn.async_held = conn.async_held.saturating_sub(held);
                self.requeue(|f| f.gen <= gen);
                drop(q);
                shared.report_failure(gen, &reason);
                if until.is_none() {
                    return;
                }
                continue;
            }
            let mut reaped = self.harvest(conn, &shared);
            self.issue(conn, &shared);
            let tick = if until.is_none() && poll_fabric { conn.tick() } else { Ok(()) };
            reaped |= self.harvest(conn, &shared);
            if tick.is_err() || conn.is_broken() {
                drop(q);
                slot.notify_freed();
                continue;
            }
            let finished = self.done.len() >= want || (self.inflight.is_empty() && self.pending.is_empty());
            let Some(until) = until else {
                drop(q);
                if reaped {
                    slot.notify_freed();
                }
                return;
            };
            // One clock read serves the time limit and the wait below.
            let awake = (!finished).then(Instant::now).filter(|&now| now < until && !self.take_wake());
            let Some(now) = awake else {
                drop(q);
                if reaped {
                    slot.notify_freed();
                }
                return;
            };
            if self.inflight.is_empty() {
                // Everything waits for a slot that other users of the queue hold.
                let wait = until.saturating_duration_since(now).min(Duration::from_millis(5));
                drop(slot.wait_freed(q, wait));
                continue;
            }
            let also = match (readable, self.wake.as_deref()) {
                (Some((fd, fired)), _) => AlsoWake::Readable { fd, fired },
                (None, Some(w)) => AlsoWake::Waker(w),
                (None, None) => AlsoWake::Nothing,
            };
            let _ = conn.progress_or(also, now);
            drop(q);
            if reaped {
                slot.notify_freed();
            }
            if readable.is_some_and(|(_, fired)| fired.get()) {
                // The caller's descriptor: take what came with it, and return.
                self.drive_with(usize::MAX, None, false);
                return;
            }
        }
    }

    /// Takes the responses of pieces on `conn`; true if any arrived.
    fn harvest(&mut self, conn: &mut Conn, shared: &Shared) -> bool {
        let mut any = false;
        let mut i = 0;
        while i < self.inflight.len() {
            let f = &self.inflight[i];
            if f.gen != conn.gen {
                i += 1;
                continue;
            }
            match conn.take_detached(f.ticket) {
                Some(resp) => {
                    let f = self.inflight.swap_remove(i);
                    any = true;
                    if let Some(reason) = self.complete_piece(f.piece, &resp, conn, shared) {
                        // The target is shutting down, or a gateway of several
                        // lost the volume: replace the connection.
                        conn.fail(reason);
                        let gen = conn.gen;
                        let held = self.inflight.iter().filter(|f| f.gen == gen).count();
                        conn.async_held = conn.async_held.saturating_sub(held);
                        self.requeue(|_| true);
                        return true;
                    }
                }
                None => i += 1,
            }
        }
        any
    }

    /// Handles one piece's response; `Some(why)` if it must be sent again on
    /// a new connection.
    fn complete_piece(&mut self, piece: Piece, resp: &Response, conn: &Conn, shared: &Shared) -> Option<String> {
        let req = self.reqs[piece.req].as_mut().expect("a live request");
        let op = if req.emulated { Opcode::WriteZeroes } else { req.kind.opcode() };
        match resp.capsule.status {
            Status::Success => {
                if matches!(req.kind, Kind::Read | Kind::Write { .. }) {
                    Stats::add(&conn.stats().zero_copy_bytes, piece.len);
                }
            }
            Status::ShuttingDown if self.draining => {}
            Status::ShuttingDown => {
                self.pending.push_front(piece);
                return Some("the target is shutting down".into());
            }
            Status::NotOwner if conn.params.failover && !self.draining => {
                let range = (op != Opcode::Flush).then_some((req.offset + piece.rel, piece.len));
                let e = status_error(op, &resp.capsule, Some(&req.entry.name), range.map(|r| r.0), range.map(|r| r.1));
                self.pending.push_front(piece);
                return Some(e.to_string());
            }
            Status::TooLarge
                if matches!(req.kind, Kind::Discard | Kind::WriteZeroes)
                    && !req.emulated
                    && piece.len > u64::from(conn.params.max_io)
                    && !self.draining =>
            {
                // Idempotent: send it again in max-I/O-size pieces.
                shared.small_zeroes.store(true, Ordering::Relaxed);
                self.pending.push_front(piece);
                return None;
            }
            _ => {
                let (off, len) = (req.offset + piece.rel, piece.len);
                let name = req.entry.name.clone();
                let e = if op == Opcode::Flush {
                    status_error(op, &resp.capsule, Some(&name), None, None)
                } else {
                    status_error(op, &resp.capsule, Some(&name), Some(off), Some(len))
                };
                self.fail_piece(piece, e);
                return None;
            }
        }
        self.piece_done(piece.req);
        None
    }

    /// Records a piece's failure: the request fails with the first error,
    /// and its pieces not yet sent are dropped.
    fn fail_piece(&mut self, piece: Piece, e: Error) {
        let req = self.reqs[piece.req].as_mut().expect("a live request");
        req.error.get_or_insert(e);
        let before = self.pending.len();
        self.pending.retain(|p| p.req != piece.req);
        let dropped = before - self.pending.len();
        let req = self.reqs[piece.req].as_mut().expect("a live request");
        req.remaining -= dropped;
        self.piece_done(piece.req);
    }

    /// One piece of request `index` ended; completes the request after its last.
    fn piece_done(&mut self, index: usize) {
        let req = self.reqs[index].as_mut().expect("a live request");
        req.remaining -= 1;
        if req.remaining > 0 {
            return;
        }
        let req = self.reqs[index].take().expect("a live request");
        self.free_reqs.push(index);
        let result = match req.error {
            Some(e) => Err(e),
            None => Ok(()),
        };
        self.done.push_back(IoCompletion { tag: req.tag, result, buffer: req.buffer });
    }

    /// Sends pending pieces while command slots are free, in one post.
    fn issue(&mut self, conn: &mut Conn, shared: &Shared) {
        conn.begin_batch();
        self.issue_each(conn, shared);
        // A failed post closes the connection; `drive` then resends.
        let _ = conn.flush_batch();
    }

    fn issue_each(&mut self, conn: &mut Conn, shared: &Shared) {
        let gen = conn.gen;
        // One clock read for the batch: every command's deadline (the
        // connection's and the flight's) counts from it.
        let mut sent_at = None;
        while let Some(&piece) = self.pending.front() {
            let req = self.reqs[piece.req].as_ref().expect("a live request");
            if req.error.is_some() {
                self.pending.pop_front();
                self.piece_done(piece.req);
                continue;
            }
            let (kind, emulated, offset, addr, rkey) = (req.kind, req.emulated, req.offset, req.addr, req.rkey);
            let bs = req.entry.info.block_size;
            let id = req.entry.remote_id(gen);
            let id = match id {
                Ok(id) => id,
                Err(Some(e)) => {
                    self.pending.pop_front();
                    self.fail_piece(piece, e);
                    continue;
                }
                Err(None) => {
                    let name = req.entry.name.clone();
                    conn.fail(format!("volume {name:?} is not open on this connection"));
                    return;
                }
            };
            let max_io = u64::from(conn.params.max_io);
            let limit = match kind {
                Kind::Read | Kind::Write { .. } => max_io,
                Kind::WriteZeroes if emulated => max_io.min(shared.zero.len() as u64),
                Kind::Discard | Kind::WriteZeroes if shared.small_zeroes.load(Ordering::Relaxed) => max_io,
                Kind::Discard | Kind::WriteZeroes => ZEROES_PIECE,
                Kind::Flush => u64::MAX,
            };
            let max = match max_piece(limit, bs) {
                Ok(m) => m,
                Err(e) => {
                    self.pending.pop_front();
                    self.fail_piece(piece, e);
                    continue;
                }
            };
            if conn.async_held >= conn.async_limit() {
                return;
            }
            let Some(cid) = conn.try_acquire() else { return };
            self.pending.pop_front();
            let mut piece = piece;
            if kind != Kind::Flush && piece.len > max {
                // Split lazily: send the head, queue the rest first in line.
                let rest = Piece { req: piece.req, rel: piece.rel + max, len: piece.len - max };
                piece.len = max;
                self.pending.push_front(rest);
                self.reqs[piece.req].as_mut().expect("a live request").remaining += 1;
            }
            let bs = u64::from(bs);
            let mut c = CommandCapsule::new(kind.opcode(), CommandId(0));
            c.volume_id = id;
            if kind != Kind::Flush {
                c.start_block = Lba((offset + piece.rel) / bs);
                c.block_count = BlockCount((piece.len / bs) as u32);
            }
            // A write of at most the negotiated inline size rides in its
            // command's SEND, gathered from the registered buffer after the
            // capsule (as NVMe-oF hosts send small writes in-capsule): an
            // RDMA READ would cost a round trip from the target and back
            // before its disk write. The target pulls larger ones.
            let gathered = match kind {
                Kind::Write { .. } if piece.len as usize <= conn.params.inline_limit => {
                    Some(piece_sge(&self.reqs, piece))
                }
                _ => None,
            };
            if kind == (Kind::Write { fua: true }) {
                c.flags |= FLAG_FUA;
            }
            match kind {
                Kind::Write { .. } if gathered.is_some() => {
                    c.flags |= FLAG_INLINE_DATA;
                    c.inline_len = piece.len as u32;
                }
                Kind::Read | Kind::Write { .. } => {
                    c.descriptor =
                        DataDescriptor { remote_addr: addr + piece.rel, length: piece.len as u32, rkey: rkey.0 };
                }
                Kind::WriteZeroes if emulated => {
                    c.opcode = Opcode::Write;
                    c.descriptor = DataDescriptor {
                        remote_addr: shared.zero.addr(),
                        length: piece.len as u32,
                        rkey: shared.zero.rkey().0,
                    };
                }
                _ => {}
            }
            let timeout = conn.params.io_timeout;
            let now = *sent_at.get_or_insert_with(Instant::now);
            let submitted = match gathered {
                Some(data) => conn.submit_gathered(cid, &c, data, timeout, now),
                None => conn.submit_at(cid, &c, &[], timeout, now),
            };
            match submitted {
                Ok(()) => {
                    let ticket = conn.detach(cid);
                    if gathered.is_some() {
                        Stats::add(&conn.stats().inline_writes, 1);
                        Stats::add(&conn.stats().inline_bytes, piece.len);
                    }
                    self.inflight.push(Flight { piece, gen, ticket, deadline: now + timeout });
                }
                Err(_) => {
                    // The slot went back; the connection is broken.
                    self.pending.push_front(piece);
                    return;
                }
            }
        }
    }

    /// Takes the pieces on the wire that `dead` selects off the wire: a
    /// piece past its deadline fails its request with a timeout, the others
    /// are sent again after reconnection (or dropped while draining).
    fn requeue(&mut self, dead: impl Fn(&Flight) -> bool) {
        let now = Instant::now();
        let mut i = self.inflight.len();
        while i > 0 {
            i -= 1;
            if !dead(&self.inflight[i]) {
                continue;
            }
            let f = self.inflight.swap_remove(i);
            let req = self.reqs[f.piece.req].as_ref().expect("a live request");
            if now >= f.deadline {
                let op = if req.emulated { Opcode::WriteZeroes } else { req.kind.opcode() };
                let what = format!(
                    "{} of {} bytes at offset {} on volume {:?}",
                    op_name(op),
                    f.piece.len,
                    req.offset + f.piece.rel,
                    req.entry.name
                );
                let after = self.session.shared.options.io_timeout;
                self.fail_piece(f.piece, Error::Timeout { what, after });
            } else if self.draining {
                self.piece_done(f.piece.req);
            } else {
                Stats::add(&self.session.shared.stats.retries, 1);
                self.pending.push_front(f.piece);
            }
        }
    }

    /// The session is lost or closed: every request ends with `e`. Queue
    /// pairs that might still carry our commands go to the error state first.
    fn abandon(&mut self, shared: &Shared, e: Error) {
        if !self.inflight.is_empty() {
            for slot in shared.queues.iter() {
                let mut q = lock(&slot.q);
                if let Some(c) = q.conn.as_mut() {
                    if self.inflight.iter().any(|f| f.gen == c.gen) {
                        c.fail("the session is lost");
                    }
                }
            }
        }
        let pieces: Vec<Piece> = self.inflight.drain(..).map(|f| f.piece).chain(self.pending.drain(..)).collect();
        for p in pieces {
            if self.reqs[p.req].is_none() {
                continue;
            }
            let err = clone_error(&e);
            let req = self.reqs[p.req].as_mut().expect("checked");
            req.error.get_or_insert(err);
            self.piece_done(p.req);
        }
    }
}

/// Wakes an [`IoQueue`] that waits (see [`IoQueue::waker`]). `Send +
/// Sync + Clone`; waking a queue that is not waiting makes its next
/// [`wait`](IoQueue::wait) return at once.
#[derive(Clone, Debug)]
pub struct IoWaker {
    wake: Arc<Wake>,
}

impl IoWaker {
    /// Makes the queue's wait return (after taking the completions that
    /// are ready).
    pub fn wake(&self) {
        self.wake.wake();
    }
}

/// Where `piece` lies in its request's registered buffer (a read or write
/// has one), as a gather entry for a SEND.
fn piece_sge(reqs: &[Option<Req>], piece: Piece) -> Sge {
    let req = reqs[piece.req].as_ref().expect("a live request");
    let region = req.buffer.as_ref().expect("a read or write has a buffer").region();
    region.sge((req.addr - region.addr() + piece.rel) as usize, piece.len as usize)
}

/// A copy of a session-level error for each request it ends.
fn clone_error(e: &Error) -> Error {
    match e {
        Error::TargetLost { reason, after } => Error::TargetLost { reason: reason.clone(), after: *after },
        Error::Disconnected { reason } => Error::Disconnected { reason: reason.clone() },
        other => Error::Disconnected { reason: other.one_line() },
    }
}

impl Drop for IoQueue {
    fn drop(&mut self) {
        // Pieces not sent are abandoned; commands on the wire name our
        // buffers, so they must end first (or their queue pair must fail).
        self.draining = true;
        let pending: Vec<Piece> = self.pending.drain(..).collect();
        for p in pending {
            if self.reqs[p.req].is_some() {
                self.piece_done(p.req);
            }
        }
        let shared = Arc::clone(&self.session.shared);
        let limit = Instant::now() + shared.options.io_timeout + Duration::from_secs(1);
        // On a healthy connection, wait for the commands to end (a missed
        // deadline closes the queue pair, so this ends). Otherwise their
        // queue pairs are doomed anyway: close them instead of waiting.
        while !self.inflight.is_empty() && Instant::now() < limit && shared.phase() == Phase::Connected {
            self.drive(usize::MAX, Some((Instant::now() + Duration::from_millis(100)).min(limit)));
        }
        if !self.inflight.is_empty() {
            self.abandon(&shared, Error::Disconnected { reason: "the I/O queue was dropped".into() });
        }
    }
}

impl fmt::Debug for IoQueue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IoQueue")
            .field("outstanding", &self.outstanding)
            .field("in_flight", &self.inflight.len())
            .field("queued", &self.pending.len())
            .finish()
    }
}
