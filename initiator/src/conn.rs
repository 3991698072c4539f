//! One queue pair and everything that belongs to it: receive slots, send
//! slots, the command-slot table, progress, waiting and keep-alive
//! ([`Conn`]), and how one attempt of a request on it ends ([`Outcome`]).
//! The bottom layer: authentication (`auth.rs`) runs on a `Conn`, the
//! per-queue bounce pool and request splitting (`queue.rs`) on top of it.
//!
//! # Progress and waiting
//! Nothing moves unless [`Conn::progress`] runs: it polls the completion
//! queue (which, for the tcp provider, is also what moves data), and when
//! nothing is ready it arms the CQ, polls once more to close the race, and
//! sleeps on the completion channel for at most one wait slice. A command
//! whose deadline passes closes the connection (the target might still
//! write into the command's buffer, so the queue pair has to go to the
//! error state before the buffer can be handed back); its owner reports
//! [`Error::Timeout`], everybody else on the queue sees a broken connection
//! and retries after the session reconnected.
//!
//! # Keep-alive
//! Whoever drives progress (a caller waiting for its command, or the
//! session's monitor thread for an idle queue, see `Conn::tick`) also
//! sends a KEEP_ALIVE when no response arrived for the idle interval, in a
//! command slot reserved for it (so it never competes with I/O and never
//! exceeds the queue depth). A keep-alive without an answer within its wait
//! time closes the connection like any other command timeout.
//!
//! # Generations
//! Each connection carries the generation of the session's connection set
//! it belongs to. The session dooms a generation through the queue's
//! [`Alarm`] (one atomic, no lock) when any of its connections failed; a
//! connection of a doomed generation closes itself the next time it is
//! used, so callers waiting on a healthy-looking queue pair of a dead
//! session notice within one wait slice.

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rdmablk_common::fabric::{
    Access, Completion, CompletionQueue, Invalidation, Lkey, MemoryWindow, Payload, QueuePair, RecvWr, Rkey, SendOp, SendWr, Sge,
    WcOpcode, WcStatus, WrId,
};
use rdmablk_common::protocol::{
    CommandCapsule, CommandId, Opcode, ResponseCapsule, Status, COMMAND_CAPSULE_SIZE, MAX_RESPONSE_DATA, RESPONSE_CAPSULE_SIZE,
    RESPONSE_SLOT_SIZE,
};

use crate::buffer::Region;
use crate::domain::Domain;
use crate::error::{fmt_duration, op_name, Error, Result};

/// What else ends a sleep on a connection's completion channel
/// ([`Conn::progress_or`]).
#[derive(Clone, Copy)]
pub(crate) enum AlsoWake<'a> {
    Nothing,
    /// An [`crate::IoWaker`]'s eventfd: drained when it fired.
    Waker(&'a Wake),
    /// A descriptor the caller reads itself (an NBD connection's socket):
    /// `fired` is set when it was readable.
    Readable { fd: std::os::fd::BorrowedFd<'a>, fired: &'a std::cell::Cell<bool> },
}

/// The eventfd behind [`IoWaker`](crate::IoWaker): `pending` says a
/// wake-up is due; the fd makes a sleep on the completion channel end.
/// Whoever sees the fd readable drains it, so a wake-up that raced with a
/// drain costs at most one early return, never a busy loop.
#[derive(Debug)]
pub(crate) struct Wake {
    fd: OwnedFd,
    pending: AtomicBool,
}

impl Wake {
    pub(crate) fn new() -> Result<Wake> {
        use rustix::event::{eventfd, EventfdFlags};
        let fd = eventfd(0, EventfdFlags::CLOEXEC | EventfdFlags::NONBLOCK)
            .map_err(|e| Error::io("creating the I/O queue's wake-up eventfd", e.into()))?;
        Ok(Wake { fd, pending: AtomicBool::new(false) })
    }

    pub(crate) fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    /// Empties the eventfd (it is nonblocking: nothing to read is fine).
    pub(crate) fn drain(&self) {
        let mut b = [0u8; 8];
        let _ = rustix::io::read(&self.fd, &mut b);
    }

    /// Makes the sleeper's wait return: [`IoWaker::wake`](crate::IoWaker::wake).
    pub(crate) fn wake(&self) {
        // A wake-up already pending has written the eventfd (or is about
        // to), and the waiter has not consumed it yet: its `take` comes
        // after this call's work was made visible, so it will see that
        // work too. Only the first wake-up of a cycle costs a system call.
        if !self.pending.swap(true, Ordering::AcqRel) {
            // A full counter (2^64 - 2 wake-ups unread) is still readable: nothing is lost.
            let _ = rustix::io::write(&self.fd, &1u64.to_ne_bytes());
        }
    }

    pub(crate) fn take(&self) -> bool {
        if self.pending.swap(false, Ordering::AcqRel) {
            self.drain();
            true
        } else {
            false
        }
    }
}

/// Most commands one `post_send` of a batch carries (see `flush_batch`).
const POST_CHUNK: usize = 16;
/// The unused second entry of a SEND's gather list (`Conn::send_gather`).
const NO_SGE: Sge = Sge { addr: 0, length: 0, lkey: Lkey(0) };
const TAG_SEND: u64 = 1 << 32;
const TAG_RECV: u64 = 2 << 32;
/// The invalidation of a command's memory window (verbs).
const TAG_INVALIDATE: u64 = 3 << 32;
/// How long to poll for pending window invalidations before sleeping.
const INVALIDATION_SPIN: Duration = Duration::from_micros(50);
const TAG_MASK: u64 = !0xffff_ffff;

/// Longest slice of one sleep on the completion channel. Deadlines, the
/// keep-alive and the session's doom signal are checked at least this often.
pub(crate) const MAX_WAIT_SLICE: Duration = Duration::from_millis(100);

/// A response as received: the capsule and its reply data.
#[derive(Clone)]
pub(crate) struct Response {
    pub(crate) capsule: ResponseCapsule,
    data: [u8; MAX_RESPONSE_DATA],
    data_len: usize,
}

impl Response {
    pub(crate) fn data(&self) -> &[u8] {
        &self.data[..self.data_len]
    }
}

#[derive(Clone)]
struct Slot {
    /// The SEND of this slot's capsule has not completed yet.
    send_pending: bool,
    /// The command is outstanding or its response not yet taken.
    awaiting: bool,
    response: Option<Response>,
    deadline: Instant,
    timeout: Duration,
    op: Opcode,
    /// Owned by an `IoQueue` under this ticket: its response is moved out
    /// on arrival and the slot freed (see [`Conn::detach`]).
    detached: Option<u64>,
    /// The response, held back until a local completion: the invalidation
    /// of the command's memory window (until then the target could still
    /// write the buffer), or for a `gathered` command its SEND's.
    held: Option<Response>,
    /// The SEND gathers a range of its owner's registered buffer
    /// ([`Conn::submit_gathered`]), which goes back with the response: the
    /// response is `held` until the SEND has completed, as a NIC may read
    /// that range again (to retransmit) until then. The Linux NVMe/RDMA
    /// host ends a request after both the same way. Such a command has no
    /// window (its descriptor is empty), so the two holds never meet.
    gathered: bool,
}

impl Slot {
    fn idle() -> Slot {
        Slot {
            send_pending: false,
            awaiting: false,
            response: None,
            deadline: Instant::now(),
            timeout: Duration::ZERO,
            op: Opcode::KeepAlive,
            detached: None,
            held: None,
            gathered: false,
        }
    }

    /// Whether the command still waits for something from the wire.
    fn outstanding(&self) -> bool {
        self.send_pending || (self.awaiting && self.response.is_none())
    }
}

/// Counters shared by a session's queues.
#[derive(Default, Debug)]
pub(crate) struct Stats {
    pub(crate) commands: AtomicU64,
    pub(crate) bounce_copies: AtomicU64,
    pub(crate) bounce_bytes: AtomicU64,
    pub(crate) inline_writes: AtomicU64,
    pub(crate) inline_bytes: AtomicU64,
    pub(crate) zero_copy_bytes: AtomicU64,
    pub(crate) keep_alives: AtomicU64,
    pub(crate) reconnects: AtomicU64,
    pub(crate) retries: AtomicU64,
    pub(crate) timeouts: AtomicU64,
}

impl Stats {
    pub(crate) fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Ordering::Relaxed);
    }

    /// Adds every counter of `self` to `sum`.
    pub(crate) fn sum_into(&self, sum: &mut [u64; 10]) {
        let all = [
            &self.commands,
            &self.bounce_copies,
            &self.bounce_bytes,
            &self.inline_writes,
            &self.inline_bytes,
            &self.zero_copy_bytes,
            &self.keep_alives,
            &self.reconnects,
            &self.retries,
            &self.timeouts,
        ];
        for (s, c) in sum.iter_mut().zip(all) {
            *s += c.load(Ordering::Relaxed);
        }
    }
}

/// Registered memory for `count` command slots of `size` bytes each
/// (capsule plus inline data).
pub(crate) struct SendSlots {
    pub(crate) region: Region,
    pub(crate) count: usize,
    pub(crate) size: usize,
}

/// The session's lock-free signal to one queue: every connection of a
/// generation at or below `doomed` must close.
#[derive(Default, Debug)]
pub(crate) struct Alarm {
    doomed: AtomicU32,
}

impl Alarm {
    /// Dooms every connection of generation `gen` and older.
    pub(crate) fn doom(&self, gen: u32) {
        self.doomed.fetch_max(gen, Ordering::AcqRel);
    }

    fn is_doomed(&self, gen: u32) -> bool {
        self.doomed.load(Ordering::Acquire) >= gen
    }
}

/// Keep-alive timing of a connection: a KEEP_ALIVE goes out when no
/// response arrived for `idle`, and must be answered within `wait`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct KeepAliveTiming {
    pub(crate) idle: Duration,
    pub(crate) wait: Duration,
}

/// What a connection negotiated and how it waits.
#[derive(Clone, Copy, Debug)]
pub(crate) struct ConnParams {
    /// Largest data transfer of one command.
    pub(crate) max_io: u32,
    /// Largest write sent inline.
    pub(crate) inline_limit: usize,
    /// Deadline of each I/O command.
    pub(crate) io_timeout: Duration,
    pub(crate) keepalive: Option<KeepAliveTiming>,
    /// Longest single sleep on the completion channel.
    pub(crate) wait_slice: Duration,
    /// How long to keep polling before sleeping (`ConnectOptions::busy_poll`).
    pub(crate) busy_poll: Duration,
    /// The session has other gateways: a command answered `NotOwner` closes
    /// the connection and is retried on another gateway instead of failing.
    pub(crate) failover: bool,
}

/// Where the data descriptor sits in an encoded command capsule
/// (docs/PROTOCOL.md): address, length, rkey.
const DESCRIPTOR_ADDR: std::ops::Range<usize> = 24..32;
const DESCRIPTOR_LEN: std::ops::Range<usize> = 32..36;
const DESCRIPTOR_RKEY: std::ops::Range<usize> = 36..40;

/// A connected queue pair with its command slots.
pub(crate) struct Conn {
    // Field order is drop order: the queue pair goes first (no more work on
    // the regions), then the regions, the CQ, and last the domain (PD and
    // fabric) they were created from.
    qp: QueuePair,
    recv: Region,
    send: Region,
    cq: CompletionQueue,
    domain: Arc<Domain>,
    recv_count: usize,
    send_slot_size: usize,
    slots: Vec<Slot>,
    free: Vec<u16>,
    wc: Vec<Completion>,
    broken: Option<String>,
    peer: String,
    stats: Arc<Stats>,
    /// The generation of the session's connection set this belongs to.
    pub(crate) gen: u32,
    alarm: Arc<Alarm>,
    /// Slot reserved for KEEP_ALIVE (when the depth allows one).
    ka_slot: Option<u16>,
    /// The outstanding keep-alive, if any.
    ka_out: Option<CommandId>,
    last_rx: Instant,
    pub(crate) params: ConnParams,
    /// Slots held by [`IoQueue`](crate::IoQueue)s (commands on the wire
    /// or responses not yet taken). Capped so that one slot always stays
    /// for synchronous callers, who may be the very threads that would
    /// take those responses.
    pub(crate) async_held: usize,
    /// While set, [`submit_raw`](Conn::submit_raw) fills the slot and
    /// leaves the SEND to [`flush_batch`](Conn::flush_batch), which posts
    /// every batched command in one call (one `sendmsg` on tcp).
    batching: bool,
    /// Batched commands: slot index, capsule-plus-inline length, and the
    /// registered range a gathered write's data is sent from.
    batch: Vec<(usize, usize, Option<Sge>)>,
    /// Per slot: the memory window the target may use for that command's
    /// data, dropped (invalidated) when the response arrives.
    windows: Vec<Option<MemoryWindow>>,
    /// Slots whose response is held until their window's invalidation
    /// completes.
    invalidations_pending: usize,
    /// Responses of detached commands, by ticket, until their owner takes them.
    detached_done: Vec<(u64, Response)>,
    next_ticket: u64,
}

impl Conn {
    /// Wraps a queue pair whose receives are not posted yet: posts one
    /// receive per [`RESPONSE_SLOT_SIZE`] bytes of `recv` and uses `send` as
    /// the command slots. Keep-alive stays off until
    /// [`replace_send_slots`](Conn::replace_send_slots).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        domain: Arc<Domain>,
        qp: QueuePair,
        cq: CompletionQueue,
        recv: Region,
        send: SendSlots,
        stats: Arc<Stats>,
        gen: u32,
        alarm: Arc<Alarm>,
        params: ConnParams,
    ) -> Result<Conn> {
        let recv_count = recv.len() / RESPONSE_SLOT_SIZE;
        let SendSlots { region, count, size } = send;
        assert!(count > 0 && count <= usize::from(u16::MAX) + 1 && region.len() >= count * size);
        let peer = qp.peer();
        let conn = Conn {
            qp,
            recv,
            send: region,
            cq,
            domain,
            recv_count,
            send_slot_size: size,
            slots: vec![Slot::idle(); count],
            free: (0..count as u32).rev().map(|i| i as u16).collect(),
            wc: vec![Completion::EMPTY; 32],
            broken: None,
            peer,
            stats,
            gen,
            alarm,
            ka_slot: None,
            ka_out: None,
            last_rx: Instant::now(),
            params: ConnParams { keepalive: None, ..params },
            async_held: 0,
            batching: false,
            batch: Vec::with_capacity(count),
            windows: (0..count).map(|_| None).collect(),
            invalidations_pending: 0,
            detached_done: Vec::new(),
            next_ticket: 1,
        };
        for i in 0..recv_count {
            conn.post_recv(i).map_err(|e| Error::fabric("posting receive buffers", e))?;
        }
        Ok(conn)
    }

    pub(crate) fn qp(&self) -> &QueuePair {
        &self.qp
    }

    pub(crate) fn domain(&self) -> &Arc<Domain> {
        &self.domain
    }

    /// The counters of this connection's queue.
    pub(crate) fn stats(&self) -> &Arc<Stats> {
        &self.stats
    }

    /// Command slots available to requests (the negotiated depth, minus
    /// the slot reserved for keep-alives).
    pub(crate) fn user_depth(&self) -> usize {
        self.slots.len() - usize::from(self.ka_slot.is_some())
    }

    /// Most slots `IoQueue`s may hold at once: all but one of the user slots.
    pub(crate) fn async_limit(&self) -> usize {
        self.user_depth().saturating_sub(1).max(1)
    }

    /// Most inline bytes one send slot can carry after the capsule.
    pub(crate) fn inline_capacity(&self) -> usize {
        self.send_slot_size - COMMAND_CAPSULE_SIZE
    }

    /// Replaces the send slots (after CONNECT negotiated the depth), reserves
    /// one for keep-alives when there are at least two, and turns the
    /// keep-alive on with `params`. Waits for every outstanding send first.
    pub(crate) fn replace_send_slots(&mut self, send: SendSlots, params: ConnParams) -> Result<()> {
        let SendSlots { region, count, size } = send;
        assert!(count > 0 && count <= usize::from(u16::MAX) + 1 && region.len() >= count * size);
        while self.slots.iter().any(|s| s.send_pending || s.awaiting) {
            self.progress()?;
        }
        self.send = region;
        self.send_slot_size = size;
        self.slots = vec![Slot::idle(); count];
        self.windows = (0..count).map(|_| None).collect();
        self.ka_slot = (count >= 2).then(|| (count - 1) as u16);
        let user = count - usize::from(self.ka_slot.is_some());
        self.free = (0..user as u32).rev().map(|i| i as u16).collect();
        self.params = params;
        self.params.inline_limit = self.params.inline_limit.min(self.inline_capacity());
        self.last_rx = Instant::now();
        Ok(())
    }

    fn post_recv(&self, index: usize) -> rdmablk_common::fabric::Result<()> {
        let sge = [self.recv.sge(index * RESPONSE_SLOT_SIZE, RESPONSE_SLOT_SIZE)];
        self.qp.post_recv(&[RecvWr { wr_id: WrId(TAG_RECV | index as u64), sges: &sge }])
    }

    /// Fails with [`Error::Disconnected`] once the connection is closed.
    pub(crate) fn check_alive(&self) -> Result<()> {
        match &self.broken {
            Some(reason) => Err(Error::Disconnected { reason: reason.clone() }),
            None => Ok(()),
        }
    }

    /// [`check_alive`](Conn::check_alive), and closes the connection if
    /// the session doomed its generation.
    pub(crate) fn check_usable(&mut self) -> Result<()> {
        self.check_alive()?;
        if self.alarm.is_doomed(self.gen) {
            return Err(self.fail("the session lost a connection and is reconnecting"));
        }
        Ok(())
    }

    pub(crate) fn is_broken(&self) -> bool {
        self.broken.is_some()
    }

    /// Why the connection closed, if it did.
    pub(crate) fn broken_reason(&self) -> Option<&str> {
        self.broken.as_deref()
    }

    /// Closes the connection: the queue pair goes to the error state, after
    /// which the provider touches none of the buffers again.
    pub(crate) fn fail(&mut self, reason: impl Into<String>) -> Error {
        if self.broken.is_none() {
            let reason = reason.into();
            tracing::warn!(peer = %self.peer, gen = self.gen, %reason, "closing connection");
            self.broken = Some(reason);
            self.qp.disconnect();
            // Whatever the target still sends for these commands is refused.
            self.windows.iter_mut().for_each(|w| *w = None);
            // Held responses are never delivered now: their commands fail.
            self.invalidations_pending = 0;
        }
        Error::Disconnected { reason: self.broken.clone().unwrap_or_default() }
    }

    /// A free command slot, if any.
    pub(crate) fn try_acquire(&mut self) -> Option<CommandId> {
        self.free.pop().map(CommandId)
    }

    /// A free command slot, waiting for one if needed. Only for a fresh
    /// connection that nobody else uses (connect, re-open).
    pub(crate) fn acquire(&mut self) -> Result<CommandId> {
        loop {
            self.check_alive()?;
            if let Some(cid) = self.try_acquire() {
                return Ok(cid);
            }
            if !self.progress()? {
                return Err(Error::invalid("no command slot is free and none is outstanding"));
            }
        }
    }

    fn release_slot(&mut self, index: usize) {
        if self.ka_slot != Some(index as u16) {
            self.free.push(index as u16);
        }
    }

    /// Gives back a slot acquired but never submitted.
    pub(crate) fn release_unused(&mut self, cid: CommandId) {
        let slot = &self.slots[usize::from(cid.0)];
        debug_assert!(!slot.awaiting && !slot.send_pending);
        self.release_slot(usize::from(cid.0));
    }

    /// Sends a command in slot `cid` (which must have been acquired): the
    /// 64-byte capsule (its command id is set to `cid`) followed by `inline`.
    /// Its `timeout` counts from `now`, the caller's clock reading (an
    /// [`IoQueue`](crate::IoQueue) reads the clock once for a batch, and
    /// its own deadline for the command is the same).
    pub(crate) fn submit_raw(
        &mut self,
        cid: CommandId,
        capsule: &[u8; COMMAND_CAPSULE_SIZE],
        inline: &[u8],
        op: Opcode,
        timeout: Duration,
        now: Instant,
    ) -> Result<()> {
        self.post_command(cid, capsule, inline, None, op, timeout, now)
    }

    /// [`submit_at`](Conn::submit_at) for a WRITE whose inline data
    /// (`capsule.inline_len` bytes) is `data`, a range of a registered
    /// buffer that the SEND gathers after the capsule: nothing is copied,
    /// and the caller keeps the buffer unchanged until the response.
    pub(crate) fn submit_gathered(
        &mut self,
        cid: CommandId,
        capsule: &CommandCapsule,
        data: Sge,
        timeout: Duration,
        now: Instant,
    ) -> Result<()> {
        debug_assert_eq!(capsule.inline_len, data.length);
        self.post_command(cid, &capsule.to_bytes(), &[], Some(data), capsule.opcode, timeout, now)
    }

    /// Fills command slot `cid` with the capsule (and `inline`, copied) and
    /// sends it, with `gathered` as a second piece of the SEND.
    #[allow(clippy::too_many_arguments)]
    fn post_command(
        &mut self,
        cid: CommandId,
        capsule: &[u8; COMMAND_CAPSULE_SIZE],
        inline: &[u8],
        gathered: Option<Sge>,
        op: Opcode,
        timeout: Duration,
        now: Instant,
    ) -> Result<()> {
        let index = usize::from(cid.0);
        if let Err(e) = self.check_alive() {
            self.release_slot(index);
            return Err(e);
        }
        let inline_len = inline.len() + gathered.map_or(0, |g| g.length as usize);
        if inline_len > self.inline_capacity() {
            self.release_slot(index);
            return Err(Error::invalid(format!(
                "{inline_len} bytes of inline data do not fit the {}-byte send slot",
                self.inline_capacity()
            )));
        }
        let base = index * self.send_slot_size;
        let total = COMMAND_CAPSULE_SIZE + inline.len();
        let window = match self.scope(capsule, op) {
            Ok(w) => w,
            Err(e) => {
                self.release_slot(index);
                return Err(e);
            }
        };
        {
            // No work request references this slot: it was free.
            let slot = self.send.bytes_mut(base..base + total);
            slot[..COMMAND_CAPSULE_SIZE].copy_from_slice(capsule);
            slot[2..4].copy_from_slice(&cid.0.to_le_bytes());
            if let Some(w) = &window {
                slot[DESCRIPTOR_RKEY].copy_from_slice(&w.rkey().0.to_le_bytes());
            }
            slot[COMMAND_CAPSULE_SIZE..].copy_from_slice(inline);
        }
        self.windows[index] = window;
        let slot = &mut self.slots[index];
        *slot = Slot {
            send_pending: true,
            awaiting: true,
            response: None,
            deadline: now.checked_add(timeout).unwrap_or(now + Duration::from_secs(365 * 86400)),
            timeout,
            op,
            detached: None,
            held: None,
            gathered: gathered.is_some(),
        };
        Stats::add(&self.stats.commands, 1);
        if self.batching {
            self.batch.push((index, total, gathered));
            return Ok(());
        }
        let (sges, used) = self.send_gather(index, total, gathered);
        let wr = SendWr {
            wr_id: WrId(TAG_SEND | index as u64),
            op: SendOp::Send,
            payload: Payload::Sges(&sges[..used]),
            signaled: true,
        };
        if let Err(e) = self.qp.post_send(&[wr]) {
            self.fail(format!("posting a {} command failed: {e}", op_name(op)));
            return Err(Error::fabric(format!("sending a {} command to {}", op_name(op), self.peer), e));
        }
        Ok(())
    }

    /// With scoping, a memory window over the descriptor of a command that
    /// moves data, granting the target the one right the opcode needs.
    fn scope(&self, capsule: &[u8; COMMAND_CAPSULE_SIZE], op: Opcode) -> Result<Option<MemoryWindow>> {
        let access = match op {
            // The target RDMA-WRITEs into the descriptor.
            Opcode::Read | Opcode::ListVolumes => Access::REMOTE_WRITE,
            // The target RDMA-READs from it.
            Opcode::Write => Access::REMOTE_READ,
            _ => return Ok(None),
        };
        let field = |r: std::ops::Range<usize>| capsule[r].iter().rev().fold(0u64, |v, &b| v << 8 | u64::from(b));
        let (addr, len, rkey) = (field(DESCRIPTOR_ADDR), field(DESCRIPTOR_LEN), field(DESCRIPTOR_RKEY) as u32);
        if !self.domain.scoped() || len == 0 {
            return Ok(None);
        }
        self.qp
            .bind_window(Rkey(rkey), addr, len, access)
            .map(Some)
            .map_err(|e| Error::fabric(format!("binding a memory window for a {} command", op_name(op)), e))
    }

    /// Starts a batch: commands submitted until [`flush_batch`] are posted
    /// together.
    ///
    /// [`flush_batch`]: Conn::flush_batch
    pub(crate) fn begin_batch(&mut self) {
        self.batching = true;
    }

    /// The gather list of command slot `index`'s SEND and how many of its
    /// entries the SEND uses: the slot's first `total` bytes (the capsule
    /// and any copied inline data), then a gathered write's data.
    fn send_gather(&self, index: usize, total: usize, gathered: Option<Sge>) -> ([Sge; 2], usize) {
        let slot = self.send.sge(index * self.send_slot_size, total);
        match gathered {
            Some(data) => ([slot, data], 2),
            None => ([slot, NO_SGE], 1),
        }
    }

    /// Posts the batched commands in one `post_send` call and ends the batch.
    /// On failure the connection is closed (its commands are then resent or
    /// failed by their owners, as for any broken connection).
    pub(crate) fn flush_batch(&mut self) -> Result<()> {
        self.batching = false;
        if self.batch.is_empty() {
            return Ok(());
        }
        let n = self.batch.len();
        // Posted a chunk at a time from the stack: no allocation per
        // flush. A chunk is what one `sendmsg` carries on tcp anyway (its
        // batch holds 16 frames), as the target's TX_CHUNK.
        let mut posted = Ok(());
        for chunk in self.batch.chunks(POST_CHUNK) {
            let mut sges = [([NO_SGE; 2], 0); POST_CHUNK];
            for (sge, &(i, total, gathered)) in sges.iter_mut().zip(chunk) {
                *sge = self.send_gather(i, total, gathered);
            }
            let mut wrs = [SendWr { wr_id: WrId(0), op: SendOp::Send, payload: Payload::Sges(&[]), signaled: true }; POST_CHUNK];
            for ((wr, (sge, used)), &(i, _, _)) in wrs.iter_mut().zip(&sges).zip(chunk) {
                *wr = SendWr {
                    wr_id: WrId(TAG_SEND | i as u64),
                    op: SendOp::Send,
                    payload: Payload::Sges(&sge[..*used]),
                    signaled: true,
                };
            }
            posted = self.qp.post_send(&wrs[..chunk.len()]);
            if posted.is_err() {
                break;
            }
        }
        self.batch.clear();
        if let Err(e) = posted {
            self.fail(format!("posting {n} commands failed: {e}"));
            return Err(Error::fabric(format!("sending {n} commands to {}", self.peer), e));
        }
        Ok(())
    }

    /// [`submit_raw`](Conn::submit_raw) for a typed capsule.
    pub(crate) fn submit(
        &mut self,
        cid: CommandId,
        capsule: &CommandCapsule,
        inline: &[u8],
        timeout: Duration,
    ) -> Result<()> {
        self.submit_at(cid, capsule, inline, timeout, Instant::now())
    }

    /// [`submit`](Conn::submit) with the timeout counted from `now` (see
    /// [`submit_raw`](Conn::submit_raw)).
    pub(crate) fn submit_at(
        &mut self,
        cid: CommandId,
        capsule: &CommandCapsule,
        inline: &[u8],
        timeout: Duration,
        now: Instant,
    ) -> Result<()> {
        self.submit_raw(cid, &capsule.to_bytes(), inline, capsule.opcode, timeout, now)
    }

    /// Hands command `cid` (just submitted) to an `IoQueue`: its response
    /// will be kept under the returned ticket for
    /// [`take_detached`](Conn::take_detached), and its slot freed as soon as
    /// the response arrives, whether or not the owner is there to take it.
    /// Counted in `async_held` until then.
    pub(crate) fn detach(&mut self, cid: CommandId) -> u64 {
        let ticket = self.next_ticket;
        self.next_ticket += 1;
        self.slots[usize::from(cid.0)].detached = Some(ticket);
        self.async_held += 1;
        ticket
    }

    /// The response of the detached command `ticket`, if it has arrived.
    pub(crate) fn take_detached(&mut self, ticket: u64) -> Option<Response> {
        let i = self.detached_done.iter().position(|(t, _)| *t == ticket)?;
        Some(self.detached_done.swap_remove(i).1)
    }

    /// The response of `cid`, if it has arrived. Taking it ends the command.
    pub(crate) fn take(&mut self, cid: CommandId) -> Option<Response> {
        let index = usize::from(cid.0);
        let slot = &mut self.slots[index];
        let response = slot.response.take()?;
        slot.awaiting = false;
        if !slot.send_pending {
            self.release_slot(index);
        }
        Some(response)
    }

    /// Whether `cid` missed its deadline without a response: the error its
    /// owner reports once the connection closed because of it.
    pub(crate) fn timed_out(&self, cid: CommandId) -> Option<Error> {
        let s = self.slots.get(usize::from(cid.0))?;
        (s.awaiting && s.response.is_none() && Instant::now() >= s.deadline)
            .then(|| Error::Timeout { what: format!("{} command to {}", op_name(s.op), self.peer), after: s.timeout })
    }

    /// Submits one command and waits for its response (fresh connections).
    pub(crate) fn execute(&mut self, capsule: &CommandCapsule, inline: &[u8], timeout: Duration) -> Result<Response> {
        let cid = self.acquire()?;
        self.submit(cid, capsule, inline, timeout)?;
        self.wait_for(cid)
    }

    /// Waits for the response of a submitted command.
    pub(crate) fn wait_for(&mut self, cid: CommandId) -> Result<Response> {
        loop {
            if let Some(r) = self.take(cid) {
                return Ok(r);
            }
            if let Err(e) = self.progress() {
                return Err(self.timed_out(cid).unwrap_or(e));
            }
        }
    }

    /// Makes progress: processes completions or waits for one for at most
    /// one wait slice. `Ok(true)`: something happened or time passed while
    /// commands were outstanding; `Ok(false)`: nothing is outstanding that
    /// could complete (every slot is free or holds a response not yet
    /// taken). Fails with [`Error::Disconnected`] when the connection is, or
    /// gets, closed: by the peer, by a missed deadline (then
    /// [`timed_out`](Conn::timed_out) names the command) or by the session.
    pub(crate) fn progress(&mut self) -> Result<bool> {
        self.progress_or(AlsoWake::Nothing, Instant::now())
    }

    /// [`progress`](Conn::progress), except that a sleep on the completion
    /// channel also ends when `also` is woken (see [`crate::IoWaker`]) or
    /// readable.
    /// `now`: the caller's clock reading, taken just before (keep-alives,
    /// deadlines and the wait slice go by it; one read per wait, not two).
    pub(crate) fn progress_or(&mut self, also: AlsoWake<'_>, now: Instant) -> Result<bool> {
        self.check_usable()?;
        // A caller that will sleep need not poll before it arms: the poll
        // after arming finds the same completions (tcp: the wait after it
        // returns at once for them), one system call fewer per wait. One
        // that spins polls first.
        let sleeper = self.params.busy_poll.is_zero() && self.invalidations_pending == 0;
        if !sleeper && self.poll_once()? > 0 {
            return Ok(true);
        }
        self.keepalive(now)?;
        let Some((deadline, outstanding)) = self.check_deadlines(now)? else {
            return Ok(false);
        };
        // A response held for its window's invalidation is a local work
        // request away (microseconds): poll for it rather than sleep and
        // take a wake-up per command.
        let spin = if self.invalidations_pending > 0 {
            self.params.busy_poll.max(INVALIDATION_SPIN)
        } else {
            self.params.busy_poll
        };
        if !spin.is_zero() {
            let until = now + spin.min(deadline.saturating_duration_since(now));
            while Instant::now() < until {
                if self.poll_once()? > 0 {
                    return Ok(true);
                }
                std::hint::spin_loop();
            }
        }
        if let Err(e) = self.cq.arm() {
            self.fail(format!("arming the completion queue failed: {e}"));
            return Err(Error::fabric("arming the completion queue", e));
        }
        if self.cq.needs_poll_after_arm() && self.poll_once()? > 0 {
            self.cq.disarm();
            return Ok(true);
        }
        let slice = (deadline - now).min(self.params.wait_slice).max(Duration::from_millis(1));
        let waited = match also {
            // With one command outstanding, its answer is one frame: the
            // sleep takes it in its own receive (the connection's thread is
            // the only user of its CQ and queue pair; the monitor visits
            // only queues no caller holds). With more, the sleep on the fd
            // and the read after it gather more answers per wake-up
            // (measured: null 4 KiB at QD32 ran 4% slower with the receive).
            AlsoWake::Nothing if outstanding == 1 => self.cq.wait_alone(Some(slice)).map(|_| ()),
            AlsoWake::Nothing => self.cq.wait(Some(slice)).map(|_| ()),
            AlsoWake::Waker(w) => self.cq.wait_or(Some(slice), w.fd()).map(|woken| {
                if woken {
                    w.drain();
                }
            }),
            AlsoWake::Readable { fd, fired } => self.cq.wait_or(Some(slice), fd).map(|readable| fired.set(readable)),
        };
        if let Err(e) = waited {
            self.fail(format!("waiting on the completion channel failed: {e}"));
            return Err(Error::fabric("waiting on the completion channel", e));
        }
        self.poll_once()?;
        Ok(true)
    }

    /// One non-blocking round for an idle queue (the session monitor):
    /// polls, sends a keep-alive if due, and enforces deadlines.
    pub(crate) fn tick(&mut self) -> Result<()> {
        self.check_usable()?;
        self.poll_once()?;
        let now = Instant::now();
        self.keepalive(now)?;
        self.check_deadlines(now)?;
        Ok(())
    }

    /// Closes the connection if an outstanding command missed its deadline;
    /// otherwise returns the earliest deadline and how many commands are
    /// outstanding, if any is.
    fn check_deadlines(&mut self, now: Instant) -> Result<Option<(Instant, usize)>> {
        let mut earliest: Option<(usize, Instant)> = None;
        let mut outstanding = 0;
        for (i, s) in self.slots.iter().enumerate().filter(|(_, s)| s.outstanding()) {
            outstanding += 1;
            if earliest.is_none_or(|(_, d)| s.deadline < d) {
                earliest = Some((i, s.deadline));
            }
        }
        let Some((index, deadline)) = earliest else {
            return Ok(None);
        };
        if now < deadline {
            return Ok(Some((deadline, outstanding)));
        }
        let slot = &self.slots[index];
        let after = fmt_duration(slot.timeout);
        let reason = if slot.op == Opcode::KeepAlive && self.ka_out == Some(CommandId(index as u16)) {
            format!("the target did not answer a keep-alive within {after}")
        } else {
            Stats::add(&self.stats.timeouts, 1);
            format!("{} command (id {index}) to {} got no response within {after}", op_name(slot.op), self.peer)
        };
        Err(self.fail(reason))
    }

    /// Consumes an answered keep-alive and sends a new one when due.
    fn keepalive(&mut self, now: Instant) -> Result<()> {
        let Some(ka) = self.params.keepalive else {
            return Ok(());
        };
        if let Some(cid) = self.ka_out {
            match self.take(cid) {
                Some(resp) => {
                    self.ka_out = None;
                    if resp.capsule.status != Status::Success {
                        return Err(self.fail(format!(
                            "the target answered a keep-alive with {} ({:?})",
                            resp.capsule.status.describe(),
                            resp.capsule.status
                        )));
                    }
                }
                None => return Ok(()),
            }
        }
        if now.saturating_duration_since(self.last_rx) < ka.idle {
            return Ok(());
        }
        let cid = match self.ka_slot {
            Some(s) if !self.slots[usize::from(s)].awaiting && !self.slots[usize::from(s)].send_pending => CommandId(s),
            Some(_) => return Ok(()),
            None => match self.try_acquire() {
                Some(cid) => cid,
                None => return Ok(()),
            },
        };
        self.submit(cid, &CommandCapsule::new(Opcode::KeepAlive, CommandId(0)), &[], ka.wait)?;
        self.ka_out = Some(cid);
        // The next one is due `idle` after this one's answer at the earliest.
        self.last_rx = now;
        Stats::add(&self.stats.keep_alives, 1);
        Ok(())
    }

    /// Polls the CQ once and handles what it returns.
    fn poll_once(&mut self) -> Result<usize> {
        let n = match self.cq.poll(&mut self.wc) {
            Ok(n) => n,
            Err(e) => {
                self.fail(format!("polling the completion queue failed: {e}"));
                return Err(Error::fabric("polling the completion queue", e));
            }
        };
        for i in 0..n {
            let wc = self.wc[i];
            self.handle(wc);
        }
        self.check_alive()?;
        Ok(n)
    }

    fn handle(&mut self, wc: Completion) {
        let index = (wc.wr_id.0 & !TAG_MASK) as usize;
        if wc.status != WcStatus::Success {
            if self.broken.is_some() {
                return; // flushes after we closed the connection
            }
            let reason = match (wc.status, wc.opcode) {
                (WcStatus::WrFlushError, _) => "the connection was closed by the target or lost".to_owned(),
                (WcStatus::TransportError, _) => "the connection to the target was lost".to_owned(),
                (WcStatus::RnrRetryExceeded, _) => {
                    "the target had no receive posted for a command (RNR retry exceeded)".to_owned()
                }
                (status, WcOpcode::Send) => {
                    let op = self.slots.get(index).map(|s| op_name(s.op)).unwrap_or("unknown");
                    format!("sending a {op} command failed with {status:?}")
                }
                (status, opcode) => format!("a {opcode:?} work request failed with {status:?}"),
            };
            self.fail(reason);
            return;
        }
        match (wc.wr_id.0 & TAG_MASK, wc.opcode) {
            (TAG_RECV, WcOpcode::Recv) if index < self.recv_count => self.handle_response(index, wc.byte_len as usize),
            (TAG_INVALIDATE, WcOpcode::LocalInvalidate)
                if self.slots.get(index).is_some_and(|s| s.held.is_some() && !s.gathered) =>
            {
                if let Some(response) = self.slots[index].held.take() {
                    self.invalidations_pending -= 1;
                    self.deliver(index, response);
                }
            }
            (TAG_SEND, WcOpcode::Send) if index < self.slots.len() && self.slots[index].send_pending => {
                let slot = &mut self.slots[index];
                slot.send_pending = false;
                // A gathered command's response waited for this.
                let waited = if slot.gathered { slot.held.take() } else { None };
                if let Some(response) = waited {
                    self.deliver(index, response);
                } else if !slot.awaiting {
                    self.release_slot(index);
                }
            }
            _ => {
                self.fail(format!("unexpected completion {wc:?}"));
            }
        }
    }

    fn handle_response(&mut self, index: usize, len: usize) {
        if len > RESPONSE_SLOT_SIZE {
            self.fail(format!("protocol error: a {len}-byte response overflows the receive slot"));
            return;
        }
        let base = index * RESPONSE_SLOT_SIZE;
        // The receive completed and is not reposted until below.
        let decoded = {
            let bytes = self.recv.bytes(base..base + len);
            ResponseCapsule::decode(bytes).map(|capsule| {
                let mut data = [0u8; MAX_RESPONSE_DATA];
                let data_len = capsule.data_len as usize;
                data[..data_len].copy_from_slice(&bytes[RESPONSE_CAPSULE_SIZE..][..data_len]);
                Response { capsule, data, data_len }
            })
        };
        let response = match decoded {
            Ok(r) => r,
            Err(e) => {
                self.fail(format!("protocol error: undecodable response: {e}"));
                return;
            }
        };
        let cid = usize::from(response.capsule.command_id.0);
        match self.slots.get(cid) {
            Some(slot) if slot.awaiting && slot.response.is_none() && slot.held.is_none() => {}
            _ => {
                self.fail(format!("protocol error: response for command id {cid}, which is not outstanding"));
                return;
            }
        }
        // The target is done with the command's data: its window's rkey is
        // refused from now on, or once the invalidation completes, and the
        // response (so the buffer) goes to its owner only then.
        let pending = match self.windows[cid].take() {
            None => Ok(Invalidation::Done),
            Some(window) => self.qp.invalidate_window(window, WrId(TAG_INVALIDATE | cid as u64)),
        };
        match pending {
            Ok(Invalidation::Done) => self.deliver(cid, response),
            Ok(Invalidation::Pending) => {
                self.slots[cid].held = Some(response);
                self.invalidations_pending += 1;
            }
            Err(e) => {
                self.fail(format!("invalidating the memory window of command id {cid} failed: {e}"));
                return;
            }
        }
        // A keep-alive's own answer does not restart the idle clock: its
        // send did. An idle queue's answers are taken only at the monitor's
        // visits, so counting them would space keep-alives up to two visits
        // further apart than `idle`, past a target's `idle_timeout`.
        if self.ka_out != Some(CommandId(cid as u16)) {
            self.last_rx = Instant::now();
        }
        if let Err(e) = self.post_recv(index) {
            self.fail(format!("reposting a receive failed: {e}"));
        }
    }

    /// Hands a response to the command's owner (once a SEND that gathered
    /// the owner's buffer has completed).
    fn deliver(&mut self, cid: usize, response: Response) {
        let slot = &mut self.slots[cid];
        if slot.gathered && slot.send_pending {
            slot.held = Some(response);
            return;
        }
        if let Some(ticket) = slot.detached.take() {
            // An IoQueue's command: its owner may be busy elsewhere (even
            // waiting for a slot of this very queue), so the response waits
            // aside and the slot is free at once.
            slot.awaiting = false;
            let release = !slot.send_pending;
            self.detached_done.push((ticket, response));
            self.async_held = self.async_held.saturating_sub(1);
            if release {
                self.release_slot(cid);
            }
        } else {
            slot.response = Some(response);
        }
    }

    /// Runs `pieces` commands with at most `lanes` (and at most the usable
    /// queue depth) outstanding. `issue(piece, lane)` builds piece `piece`
    /// using lane `lane` (an index below `lanes` that no outstanding piece
    /// uses, e.g. a bounce chunk) and returns its capsule and inline data;
    /// `complete(piece, lane, response)` consumes its response (any status).
    ///
    /// On the first error no new piece is issued, the outstanding ones are
    /// waited for, and the error is returned as [`Outcome::Failed`]. A
    /// [`PieceError::Retry`] closes the connection at once. Returns only
    /// when no command of this call is outstanding, or after the connection
    /// was closed ([`Outcome::Broken`], or [`Outcome::Failed`] with
    /// [`Error::Timeout`] when one of this call's commands missed its
    /// deadline). [`Outcome::Busy`]: no slot could be had and nothing this
    /// queue pair waits for could free one (other users hold them with
    /// responses they have not taken yet).
    pub(crate) fn pipeline<'d>(
        &mut self,
        pieces: usize,
        lanes: usize,
        timeout: Duration,
        mut issue: impl FnMut(usize, usize) -> Result<(CommandCapsule, &'d [u8])>,
        mut complete: impl FnMut(usize, usize, &Response) -> Result<(), PieceError>,
    ) -> Outcome {
        let lanes = lanes.min(self.user_depth()).max(1);
        let run = catch_unwind(AssertUnwindSafe(|| {
            let mut next = 0usize;
            let mut inflight: Vec<(CommandId, usize, usize)> = Vec::with_capacity(lanes.min(pieces));
            let mut free_lanes: Vec<usize> = (0..lanes.min(pieces)).rev().collect();
            let mut first_err: Option<Error> = None;
            loop {
                while first_err.is_none() && next < pieces && !free_lanes.is_empty() {
                    let Some(cid) = self.try_acquire() else { break };
                    let lane = free_lanes.pop().expect("checked non-empty");
                    match issue(next, lane) {
                        Ok((capsule, inline)) => match self.submit(cid, &capsule, inline, timeout) {
                            Ok(()) => {
                                inflight.push((cid, next, lane));
                                next += 1;
                            }
                            Err(e) => {
                                free_lanes.push(lane);
                                if self.is_broken() {
                                    return self.broken_outcome(&inflight);
                                }
                                first_err = Some(e);
                            }
                        },
                        Err(e) => {
                            self.release_unused(cid);
                            free_lanes.push(lane);
                            first_err = Some(e);
                        }
                    }
                }
                let mut reaped = false;
                let mut i = 0;
                while i < inflight.len() {
                    let (cid, piece, lane) = inflight[i];
                    if let Some(resp) = self.take(cid) {
                        inflight.swap_remove(i);
                        reaped = true;
                        match complete(piece, lane, &resp) {
                            Ok(()) => {}
                            Err(PieceError::Fatal(e)) => {
                                first_err.get_or_insert(e);
                            }
                            Err(PieceError::Retry(reason)) => {
                                self.fail(reason);
                                return Outcome::Broken;
                            }
                        }
                        free_lanes.push(lane);
                    } else {
                        i += 1;
                    }
                }
                if inflight.is_empty() && (first_err.is_some() || next == pieces) {
                    return first_err.map_or(Outcome::Done(()), Outcome::Failed);
                }
                if !reaped {
                    match self.progress() {
                        Ok(true) => {}
                        Ok(false) if inflight.is_empty() => return Outcome::Busy,
                        Ok(false) => {}
                        Err(_) => return self.broken_outcome(&inflight),
                    }
                }
            }
        }));
        match run {
            Ok(outcome) => outcome,
            Err(panic) => {
                // Commands of this call may still be outstanding and name the
                // caller's buffers, which unwinding is about to release.
                self.fail("a request was abandoned by a panic");
                resume_unwind(panic)
            }
        }
    }

    /// The outcome of a pipeline whose connection closed: a timeout of one
    /// of its own commands is final, anything else is retried.
    fn broken_outcome(&self, inflight: &[(CommandId, usize, usize)]) -> Outcome {
        match inflight.iter().find_map(|&(cid, _, _)| self.timed_out(cid)) {
            Some(e) => Outcome::Failed(e),
            None => Outcome::Broken,
        }
    }
}

impl Drop for Conn {
    fn drop(&mut self) {
        if self.broken.is_none() {
            self.qp.disconnect();
        }
    }
}

/// How one attempt of a request on one connection ended.
pub(crate) enum Outcome<T = ()> {
    /// Finished; the value.
    Done(T),
    /// Finished with an error that retrying cannot fix (a target status, a
    /// timeout of this request's own command, a bad argument).
    Failed(Error),
    /// The connection closed under the request; the parts not done are
    /// retried once the session has reconnected.
    Broken,
    /// No command slot free: try again after others released some.
    Busy,
}

impl<T> Outcome<T> {
    pub(crate) fn map<U>(self, f: impl FnOnce(T) -> U) -> Outcome<U> {
        match self {
            Outcome::Done(v) => Outcome::Done(f(v)),
            Outcome::Failed(e) => Outcome::Failed(e),
            Outcome::Broken => Outcome::Broken,
            Outcome::Busy => Outcome::Busy,
        }
    }
}

/// Why a piece's response ends a pipeline.
pub(crate) enum PieceError {
    /// The request fails with this error.
    Fatal(Error),
    /// The connection must be replaced and the piece retried (the target
    /// is shutting down, or a gateway of several lost the volume).
    Retry(String),
}

/// The status check every data command's response goes through.
/// `failover`: the session has other gateways ([`ConnParams::failover`]),
/// so `NotOwner` retries there instead of failing the request.
pub(crate) fn piece_status(
    op: Opcode,
    resp: &ResponseCapsule,
    volume: &str,
    offset: Option<u64>,
    length: Option<u64>,
    failover: bool,
) -> Result<(), PieceError> {
    match resp.status {
        Status::Success => Ok(()),
        Status::ShuttingDown => Err(PieceError::Retry("the target is shutting down".into())),
        Status::NotOwner if failover => Err(PieceError::Retry(status_error(op, resp, Some(volume), offset, length).to_string())),
        _ => Err(PieceError::Fatal(status_error(op, resp, Some(volume), offset, length))),
    }
}

/// Why a response to a command without data (OPEN, FLUSH, LIST...) means
/// the connection must be replaced and the command sent again: the target
/// is shutting down, or (`failover`) a gateway of several lost the volume.
pub(crate) fn retry_reason(op: Opcode, resp: &ResponseCapsule, volume: Option<&str>, failover: bool) -> Option<String> {
    match resp.status {
        Status::ShuttingDown => Some("the target is shutting down".into()),
        Status::NotOwner if failover => Some(status_error(op, resp, volume, None, None).to_string()),
        _ => None,
    }
}

pub(crate) fn status_error(
    op: Opcode,
    r: &ResponseCapsule,
    volume: Option<&str>,
    offset: Option<u64>,
    length: Option<u64>,
) -> Error {
    Error::Target { op, status: r.status, detail: r.detail, volume: volume.map(str::to_owned), offset, length }
}
