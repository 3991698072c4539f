//! One queue pair and everything that belongs to it: receive slots, send
//! slots, the command-slot table, progress and waiting ([`Conn`]), and the
//! bounce pool and request splitting on top of it ([`Queue`]).
//!
//! A [`Queue`] is self-contained: a session holds one today; a multi-queue
//! session would hold one per thread or per core.
//!
//! # Progress and waiting
//! Nothing moves unless [`Conn::progress`] runs: it polls the completion
//! queue (which, for the tcp provider, is also what moves data), and when
//! nothing is ready it arms the CQ, polls once more to close the race, and
//! sleeps on the completion channel until the earliest deadline of the
//! outstanding commands. A command whose deadline passes closes the
//! connection (the target might still write into the command's buffer, so
//! the queue pair has to go to the error state before the buffer can be
//! handed back) and fails with [`Error::Timeout`].

use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rdmablk_common::fabric::{
    Access, Completion, CompletionQueue, QueuePair, RecvWr, Rkey, SendOp, SendWr, WcOpcode, WcStatus, WrId,
};
use rdmablk_common::protocol::{
    BlockCount, CommandCapsule, CommandId, DataDescriptor, Lba, Opcode, ResponseCapsule, Status, VolumeId, VolumeInfo,
    COMMAND_CAPSULE_SIZE, FLAG_FUA, FLAG_INLINE_DATA, MAX_RESPONSE_DATA, RESPONSE_CAPSULE_SIZE, RESPONSE_SLOT_SIZE,
    VOLUME_INFO_SIZE,
};

use crate::buffer::Region;
use crate::device::{max_piece, piece_count, split, WriteFlags};
use crate::error::{fmt_duration, op_name, Error, Result};
use crate::session::Domain;

const TAG_SEND: u64 = 1 << 32;
const TAG_RECV: u64 = 2 << 32;
const TAG_MASK: u64 = !0xffff_ffff;

/// Longest slice of one sleep on the completion channel. Deadlines are
/// checked at least this often even if the channel never fires.
const MAX_WAIT_SLICE: Duration = Duration::from_millis(200);

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
        }
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
}

impl Stats {
    fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Ordering::Relaxed);
    }
}

/// Registered memory for `count` command slots of `size` bytes each
/// (capsule plus inline data).
pub(crate) struct SendSlots {
    pub(crate) region: Region,
    pub(crate) count: usize,
    pub(crate) size: usize,
}

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
}

impl Conn {
    /// Wraps a queue pair whose receives are not posted yet: posts one
    /// receive per [`RESPONSE_SLOT_SIZE`] bytes of `recv` and uses `send` as
    /// the command slots.
    pub(crate) fn new(
        domain: Arc<Domain>,
        qp: QueuePair,
        cq: CompletionQueue,
        recv: Region,
        send: SendSlots,
        stats: Arc<Stats>,
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

    /// Number of command slots (the usable queue depth).
    pub(crate) fn depth(&self) -> usize {
        self.slots.len()
    }

    /// Most inline bytes one send slot can carry after the capsule.
    pub(crate) fn inline_capacity(&self) -> usize {
        self.send_slot_size - COMMAND_CAPSULE_SIZE
    }

    /// Replaces the send slots (after CONNECT negotiated the depth). Waits for
    /// every outstanding send first.
    pub(crate) fn replace_send_slots(&mut self, send: SendSlots) -> Result<()> {
        let SendSlots { region, count, size } = send;
        assert!(count > 0 && count <= usize::from(u16::MAX) + 1 && region.len() >= count * size);
        while self.slots.iter().any(|s| s.send_pending || s.awaiting) {
            self.progress()?;
        }
        self.send = region;
        self.send_slot_size = size;
        self.slots = vec![Slot::idle(); count];
        self.free = (0..count as u32).rev().map(|i| i as u16).collect();
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

    pub(crate) fn is_broken(&self) -> bool {
        self.broken.is_some()
    }

    /// Closes the connection: the queue pair goes to the error state, after
    /// which the provider touches none of the buffers again.
    pub(crate) fn fail(&mut self, reason: impl Into<String>) -> Error {
        if self.broken.is_none() {
            let reason = reason.into();
            tracing::warn!(peer = %self.peer, %reason, "closing connection");
            self.broken = Some(reason);
            self.qp.disconnect();
        }
        Error::Disconnected { reason: self.broken.clone().unwrap_or_default() }
    }

    /// A free command slot, if any.
    pub(crate) fn try_acquire(&mut self) -> Option<CommandId> {
        self.free.pop().map(CommandId)
    }

    /// A free command slot, waiting for one if needed.
    pub(crate) fn acquire(&mut self) -> Result<CommandId> {
        loop {
            self.check_alive()?;
            if let Some(cid) = self.try_acquire() {
                return Ok(cid);
            }
            self.progress()?;
        }
    }

    /// Gives back a slot acquired but never submitted.
    pub(crate) fn release_unused(&mut self, cid: CommandId) {
        debug_assert!(!self.slots[usize::from(cid.0)].awaiting && !self.slots[usize::from(cid.0)].send_pending);
        self.free.push(cid.0);
    }

    /// Sends a command in slot `cid` (which must have been acquired): the
    /// 64-byte capsule (its command id is set to `cid`) followed by `inline`.
    pub(crate) fn submit_raw(
        &mut self,
        cid: CommandId,
        capsule: &[u8; COMMAND_CAPSULE_SIZE],
        inline: &[u8],
        op: Opcode,
        timeout: Duration,
    ) -> Result<()> {
        if let Err(e) = self.check_alive() {
            self.free.push(cid.0);
            return Err(e);
        }
        let index = usize::from(cid.0);
        if inline.len() > self.inline_capacity() {
            self.free.push(cid.0);
            return Err(Error::invalid(format!(
                "{} bytes of inline data do not fit the {}-byte send slot",
                inline.len(),
                self.inline_capacity()
            )));
        }
        let base = index * self.send_slot_size;
        let total = COMMAND_CAPSULE_SIZE + inline.len();
        {
            // No work request references this slot: it was free.
            let slot = self.send.bytes_mut(base..base + total);
            slot[..COMMAND_CAPSULE_SIZE].copy_from_slice(capsule);
            slot[2..4].copy_from_slice(&cid.0.to_le_bytes());
            slot[COMMAND_CAPSULE_SIZE..].copy_from_slice(inline);
        }
        let now = Instant::now();
        let slot = &mut self.slots[index];
        *slot = Slot {
            send_pending: true,
            awaiting: true,
            response: None,
            deadline: now.checked_add(timeout).unwrap_or(now + Duration::from_secs(365 * 86400)),
            timeout,
            op,
        };
        let sge = [self.send.sge(base, total)];
        let wr = SendWr {
            wr_id: WrId(TAG_SEND | index as u64),
            op: SendOp::Send,
            sges: &sge,
            signaled: true,
            inline: false,
        };
        if let Err(e) = self.qp.post_send(&[wr]) {
            self.fail(format!("posting a {} command failed: {e}", op_name(op)));
            return Err(Error::fabric(format!("sending a {} command to {}", op_name(op), self.peer), e));
        }
        Stats::add(&self.stats.commands, 1);
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
        self.submit_raw(cid, &capsule.to_bytes(), inline, capsule.opcode, timeout)
    }

    /// The response of `cid`, if it has arrived. Taking it ends the command.
    pub(crate) fn take(&mut self, cid: CommandId) -> Option<Response> {
        let index = usize::from(cid.0);
        let slot = &mut self.slots[index];
        let response = slot.response.take()?;
        slot.awaiting = false;
        if !slot.send_pending {
            self.free.push(cid.0);
        }
        Some(response)
    }

    /// Submits one command and waits for its response.
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
            self.progress()?;
        }
    }

    /// Processes at least one completion, or fails: with
    /// [`Error::Timeout`] when the earliest outstanding deadline passes, with
    /// [`Error::Disconnected`] when the connection is (or gets) closed.
    pub(crate) fn progress(&mut self) -> Result<()> {
        self.check_alive()?;
        if self.poll_once()? > 0 {
            return Ok(());
        }
        loop {
            let Some((index, deadline)) = self
                .slots
                .iter()
                .enumerate()
                .filter(|(_, s)| s.awaiting || s.send_pending)
                .map(|(i, s)| (i, s.deadline))
                .min_by_key(|&(_, d)| d)
            else {
                // Nothing outstanding: nothing to wait for.
                return Ok(());
            };
            let now = Instant::now();
            if now >= deadline {
                let slot = &self.slots[index];
                let what = format!("{} command (id {index}) to {}", op_name(slot.op), self.peer);
                let after = slot.timeout;
                self.fail(format!("{what} got no response within {}", fmt_duration(after)));
                return Err(Error::Timeout { what, after });
            }
            if let Err(e) = self.cq.arm() {
                self.fail(format!("arming the completion queue failed: {e}"));
                return Err(Error::fabric("arming the completion queue", e));
            }
            if self.poll_once()? > 0 {
                return Ok(());
            }
            let slice = (deadline - now).min(MAX_WAIT_SLICE).max(Duration::from_millis(1));
            if let Err(e) = self.cq.wait(Some(slice)) {
                self.fail(format!("waiting on the completion channel failed: {e}"));
                return Err(Error::fabric("waiting on the completion channel", e));
            }
            if self.poll_once()? > 0 {
                return Ok(());
            }
        }
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
            (TAG_SEND, WcOpcode::Send) if index < self.slots.len() && self.slots[index].send_pending => {
                let slot = &mut self.slots[index];
                slot.send_pending = false;
                if !slot.awaiting {
                    self.free.push(index as u16);
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
        match self.slots.get_mut(cid) {
            Some(slot) if slot.awaiting && slot.response.is_none() => slot.response = Some(response),
            _ => {
                self.fail(format!("protocol error: response for command id {cid}, which is not outstanding"));
                return;
            }
        }
        if let Err(e) = self.post_recv(index) {
            self.fail(format!("reposting a receive failed: {e}"));
        }
    }

    /// Runs `pieces` commands with at most `lanes` (and at most the queue
    /// depth) outstanding. `issue(piece, lane)` builds piece `piece` using
    /// lane `lane` (an index below `lanes` that no outstanding piece uses,
    /// e.g. a bounce chunk) and returns its capsule and inline data;
    /// `complete(piece, lane, response)` consumes its response (any status).
    ///
    /// On the first error no new piece is issued, the outstanding ones are
    /// waited for, and that error is returned. Returns only when no command
    /// of this call is outstanding, or after the connection was closed.
    pub(crate) fn pipeline<'d>(
        &mut self,
        pieces: usize,
        lanes: usize,
        timeout: Duration,
        mut issue: impl FnMut(usize, usize) -> Result<(CommandCapsule, &'d [u8])>,
        mut complete: impl FnMut(usize, usize, &Response) -> Result<()>,
    ) -> Result<()> {
        let lanes = lanes.min(self.depth()).max(1);
        let run = catch_unwind(AssertUnwindSafe(|| {
            let mut next = 0usize;
            let mut inflight: Vec<(CommandId, usize, usize)> = Vec::with_capacity(lanes);
            let mut free_lanes: Vec<usize> = (0..lanes).rev().collect();
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
                                    return Err(e);
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
                        if let Err(e) = complete(piece, lane, &resp) {
                            first_err.get_or_insert(e);
                        }
                        free_lanes.push(lane);
                    } else {
                        i += 1;
                    }
                }
                if inflight.is_empty() && (first_err.is_some() || next == pieces) {
                    return first_err.map_or(Ok(()), Err);
                }
                if !reaped {
                    self.progress()?;
                }
            }
        }));
        match run {
            Ok(result) => result,
            Err(panic) => {
                // Commands of this call may still be outstanding and name the
                // caller's buffers, which unwinding is about to release.
                self.fail("a request was abandoned by a panic");
                resume_unwind(panic)
            }
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

/// What a volume request needs to build capsules and error messages.
#[derive(Clone, Copy)]
pub(crate) struct VolCtx<'a> {
    pub(crate) id: VolumeId,
    pub(crate) name: &'a str,
    pub(crate) block_size: u32,
    pub(crate) supports_write_zeroes: bool,
}

/// Where the data of a transfer lives.
pub(crate) enum Data<'a> {
    /// A plain slice: goes through the bounce pool (or inline for small writes).
    ReadSlice(&'a mut [u8]),
    WriteSlice(&'a [u8]),
    /// A registered buffer range the target reaches directly.
    Registered {
        addr: u64,
        rkey: Rkey,
    },
}

/// The per-queue state: a connection, its bounce pool and the limits.
pub(crate) struct Queue {
    pub(crate) conn: Conn,
    bounce: Region,
    chunk: usize,
    chunks: usize,
    max_io: u32,
    inline_limit: usize,
    io_timeout: Duration,
    /// The target refused a big DISCARD/WRITE_ZEROES as too large once:
    /// split those at the max I/O size from then on.
    small_zeroes: bool,
    stats: Arc<Stats>,
}

/// Most volumes a LIST is allowed to report (bounds the list buffer).
const MAX_VOLUMES: usize = 1 << 20;

/// Largest DISCARD / WRITE_ZEROES piece tried first.
const ZEROES_PIECE: u64 = 1 << 30;

pub(crate) fn status_error(
    op: Opcode,
    r: &ResponseCapsule,
    volume: Option<&str>,
    offset: Option<u64>,
    length: Option<u64>,
) -> Error {
    Error::Target { op, status: r.status, detail: r.detail, volume: volume.map(str::to_owned), offset, length }
}

impl Queue {
    pub(crate) fn new(
        conn: Conn,
        bounce: Region,
        chunk: usize,
        max_io: u32,
        inline_limit: usize,
        io_timeout: Duration,
        stats: Arc<Stats>,
    ) -> Queue {
        let chunks = bounce.len() / chunk;
        assert!(chunks >= 1);
        let inline_limit = inline_limit.min(conn.inline_capacity());
        Queue { conn, bounce, chunk, chunks, max_io, inline_limit, io_timeout, small_zeroes: false, stats }
    }

    pub(crate) fn io_timeout(&self) -> Duration {
        self.io_timeout
    }

    /// Reads or writes `len` bytes at byte `offset` of a volume; the range is
    /// already checked. Splits at the max I/O size and pipelines the pieces.
    pub(crate) fn transfer(
        &mut self,
        vol: VolCtx<'_>,
        op: Opcode,
        data: Data<'_>,
        len: u64,
        offset: u64,
        flags: WriteFlags,
    ) -> Result<()> {
        if len == 0 {
            return Ok(());
        }
        let bs = u64::from(vol.block_size);
        let timeout = self.io_timeout;
        let piece = max_piece(u64::from(self.max_io).min(self.chunk as u64), vol.block_size)?;
        let pieces = usize::try_from(piece_count(len, piece)).expect("piece count fits usize");
        let piece_at = move |i: usize| -> (u64, u64) {
            let start = i as u64 * piece;
            (start, piece.min(len - start))
        };
        let capsule_for = move |rel: u64, plen: u64| {
            let mut c = CommandCapsule::new(op, CommandId(0));
            c.volume_id = vol.id;
            c.start_block = Lba((offset + rel) / bs);
            c.block_count = BlockCount((plen / bs) as u32);
            if op == Opcode::Write && flags.fua {
                c.flags |= FLAG_FUA;
            }
            c
        };
        let failed = move |resp: &Response, rel: u64, plen: u64| -> Result<()> {
            if resp.capsule.status == Status::Success {
                Ok(())
            } else {
                Err(status_error(op, &resp.capsule, Some(vol.name), Some(offset + rel), Some(plen)))
            }
        };
        let stats = Arc::clone(&self.stats);
        let chunk = self.chunk;
        let inline_limit = self.inline_limit;
        let Queue { conn, bounce, chunks, .. } = self;
        match data {
            Data::Registered { addr, rkey } => {
                Stats::add(&stats.zero_copy_bytes, len);
                conn.pipeline(
                    pieces,
                    usize::MAX,
                    timeout,
                    |i, _| {
                        let (rel, plen) = piece_at(i);
                        let mut c = capsule_for(rel, plen);
                        c.descriptor = DataDescriptor { remote_addr: addr + rel, length: plen as u32, rkey: rkey.0 };
                        Ok((c, &[][..]))
                    },
                    |i, _, resp| {
                        let (rel, plen) = piece_at(i);
                        failed(resp, rel, plen)
                    },
                )
            }
            Data::ReadSlice(buf) => {
                let rkey = bounce.rkey();
                let base = bounce.addr();
                // `issue` only reads the bounce pool's address; `complete`
                // copies out of the chunk of a finished piece.
                conn.pipeline(
                    pieces,
                    *chunks,
                    timeout,
                    |i, lane| {
                        let (rel, plen) = piece_at(i);
                        let mut c = capsule_for(rel, plen);
                        c.descriptor = DataDescriptor {
                            remote_addr: base + (lane * chunk) as u64,
                            length: plen as u32,
                            rkey: rkey.0,
                        };
                        Ok((c, &[][..]))
                    },
                    |i, lane, resp| {
                        let (rel, plen) = piece_at(i);
                        failed(resp, rel, plen)?;
                        let (rel, plen) = (rel as usize, plen as usize);
                        // The piece's command is finished: the target no longer writes this chunk.
                        buf[rel..rel + plen].copy_from_slice(bounce.bytes(lane * chunk..lane * chunk + plen));
                        Stats::add(&stats.bounce_copies, 1);
                        Stats::add(&stats.bounce_bytes, plen as u64);
                        Ok(())
                    },
                )
            }
            Data::WriteSlice(buf) => {
                let rkey = bounce.rkey();
                let base = bounce.addr();
                conn.pipeline(
                    pieces,
                    *chunks,
                    timeout,
                    |i, lane| {
                        let (rel, plen) = piece_at(i);
                        let mut c = capsule_for(rel, plen);
                        let src = &buf[rel as usize..(rel + plen) as usize];
                        if src.len() <= inline_limit {
                            c.flags |= FLAG_INLINE_DATA;
                            c.inline_len = src.len() as u32;
                            Stats::add(&stats.inline_writes, 1);
                            Stats::add(&stats.inline_bytes, plen);
                            return Ok((c, src));
                        }
                        // The lane's chunk is not named by any outstanding command.
                        bounce.bytes_mut(lane * chunk..lane * chunk + src.len()).copy_from_slice(src);
                        Stats::add(&stats.bounce_copies, 1);
                        Stats::add(&stats.bounce_bytes, plen);
                        c.descriptor = DataDescriptor {
                            remote_addr: base + (lane * chunk) as u64,
                            length: plen as u32,
                            rkey: rkey.0,
                        };
                        Ok((c, &[][..]))
                    },
                    |i, _, resp| {
                        let (rel, plen) = piece_at(i);
                        failed(resp, rel, plen)
                    },
                )
            }
        }
    }

    /// DISCARD or WRITE_ZEROES over a checked range.
    pub(crate) fn zeroes(&mut self, vol: VolCtx<'_>, op: Opcode, offset: u64, len: u64) -> Result<()> {
        if len == 0 {
            return Ok(());
        }
        if op == Opcode::WriteZeroes && !vol.supports_write_zeroes {
            return self.emulate_write_zeroes(vol, offset, len);
        }
        loop {
            let limit = if self.small_zeroes { u64::from(self.max_io) } else { ZEROES_PIECE };
            let piece = max_piece(limit, vol.block_size)?;
            let bs = u64::from(vol.block_size);
            let pieces: Vec<(u64, u64)> = split(offset, len, piece).collect();
            let mut too_large = false;
            let result = self.conn.pipeline(
                pieces.len(),
                usize::MAX,
                self.io_timeout,
                |i, _| {
                    let (off, plen) = pieces[i];
                    let mut c = CommandCapsule::new(op, CommandId(0));
                    c.volume_id = vol.id;
                    c.start_block = Lba(off / bs);
                    c.block_count = BlockCount((plen / bs) as u32);
                    Ok((c, &[][..]))
                },
                |i, _, resp| {
                    let (off, plen) = pieces[i];
                    match resp.capsule.status {
                        Status::Success => Ok(()),
                        Status::TooLarge if plen > u64::from(self.max_io) => {
                            too_large = true;
                            Err(status_error(op, &resp.capsule, Some(vol.name), Some(off), Some(plen)))
                        }
                        _ => Err(status_error(op, &resp.capsule, Some(vol.name), Some(off), Some(plen))),
                    }
                },
            );
            match result {
                Err(_) if too_large && !self.small_zeroes => {
                    // Idempotent: redo the whole range in max-I/O-size pieces.
                    self.small_zeroes = true;
                }
                other => return other,
            }
        }
    }

    /// WRITE_ZEROES for volumes that do not offer it: writes zeroes from the
    /// bounce pool.
    fn emulate_write_zeroes(&mut self, vol: VolCtx<'_>, offset: u64, len: u64) -> Result<()> {
        // No command is outstanding on the bounce pool between requests.
        self.bounce.bytes_mut(0..self.chunk).fill(0);
        let bs = u64::from(vol.block_size);
        let piece = max_piece(u64::from(self.max_io).min(self.chunk as u64), vol.block_size)?;
        let pieces: Vec<(u64, u64)> = split(offset, len, piece).collect();
        let base = self.bounce.addr();
        let rkey = self.bounce.rkey();
        // Every piece reads from chunk 0 onwards, which stays zero.
        self.conn.pipeline(
            pieces.len(),
            usize::MAX,
            self.io_timeout,
            |i, _| {
                let (off, plen) = pieces[i];
                let mut c = CommandCapsule::new(Opcode::Write, CommandId(0));
                c.volume_id = vol.id;
                c.start_block = Lba(off / bs);
                c.block_count = BlockCount((plen / bs) as u32);
                c.descriptor = DataDescriptor { remote_addr: base, length: plen as u32, rkey: rkey.0 };
                Ok((c, &[][..]))
            },
            |i, _, resp| {
                let (off, plen) = pieces[i];
                if resp.capsule.status == Status::Success {
                    Ok(())
                } else {
                    Err(status_error(Opcode::WriteZeroes, &resp.capsule, Some(vol.name), Some(off), Some(plen)))
                }
            },
        )
    }

    /// A command without data (FLUSH, KEEP_ALIVE, CLOSE...); returns the response.
    pub(crate) fn simple(&mut self, capsule: &CommandCapsule, inline: &[u8]) -> Result<Response> {
        self.conn.execute(capsule, inline, self.io_timeout)
    }

    /// LIST_VOLUMES into the bounce pool (or a bigger temporary region when
    /// the target has more volumes than fit).
    pub(crate) fn list_volumes(&mut self) -> Result<Vec<VolumeInfo>> {
        let mut want = 0usize;
        for _attempt in 0..4 {
            let pool_entries = (self.chunks * self.chunk) / VOLUME_INFO_SIZE;
            let max_entries = (self.max_io as usize / VOLUME_INFO_SIZE).max(1);
            let temp;
            let (region, entries): (&Region, usize) = if want <= pool_entries.min(max_entries) {
                (&self.bounce, pool_entries.min(max_entries))
            } else {
                let entries = want;
                temp = Region::new(
                    self.conn.domain().pd(),
                    entries * VOLUME_INFO_SIZE,
                    Access::LOCAL_WRITE | Access::REMOTE_WRITE,
                )
                .map_err(|e| Error::fabric("registering a buffer for the volume list", e))?;
                (&temp, entries)
            };
            let bytes = entries * VOLUME_INFO_SIZE;
            let mut c = CommandCapsule::new(Opcode::ListVolumes, CommandId(0));
            c.descriptor = DataDescriptor { remote_addr: region.addr(), length: bytes as u32, rkey: region.rkey().0 };
            let resp = self.conn.execute(&c, &[], self.io_timeout)?;
            if resp.capsule.status != Status::Success {
                return Err(status_error(Opcode::ListVolumes, &resp.capsule, None, None, None));
            }
            let total = usize::try_from(resp.capsule.result)
                .map_err(|_| Error::protocol(format!("the target reports {} volumes", resp.capsule.result)))?;
            if total > entries {
                if total > MAX_VOLUMES {
                    return Err(Error::protocol(format!(
                        "the target reports {total} volumes, more than this initiator lists"
                    )));
                }
                want = total;
                continue;
            }
            // The command is finished: the target no longer writes the region.
            let raw = region.bytes(0..total * VOLUME_INFO_SIZE);
            return raw
                .chunks_exact(VOLUME_INFO_SIZE)
                .enumerate()
                .map(|(i, b)| {
                    VolumeInfo::decode(b).map_err(|e| Error::protocol(format!("volume list entry {i} is invalid: {e}")))
                })
                .collect();
        }
        Err(Error::protocol("the volume list kept growing while it was read; gave up after 4 attempts"))
    }
}
