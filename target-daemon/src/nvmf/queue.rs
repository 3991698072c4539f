//! One NVMe queue's commands, whatever the transport: the slab (its index
//! is the engine tag and the NVMe/TCP transfer tag), the data each command
//! carries in either direction, the engine operations, and the answers.
//!
//! The transport hands in decoded capsules and placed data and takes out
//! [`Action`]s: completions, data to send, data to ask for. It never looks
//! inside a command; this file never touches the wire.

use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rdmablk_common::nvme::cqe::CompletionEntry;
use rdmablk_common::nvme::sqe::{admin_opcode, Sgl, SubmissionEntry};
use rdmablk_common::nvme::status::Status;
use rdmablk_common::protocol::Opcode;

use super::io_cmd::{self, ByteRanges, IoPlan};
use super::{
    admin_cmd, fabrics_cmd, CloseReason, Controller, HostView, Namespace, NvmeStats, QueueCloser, Subsystem, ADMIN_TICK, MAX_TRANSFER,
    QUEUE_CHUNKS, QUEUE_FILE_SLOTS,
};
use crate::config::NvmeTransport;
use crate::engine::BlockEngine;
use crate::engine::pool::Pool;
use crate::engine::uring::UringOptions;
use crate::error::{Error, ErrorKind};
use crate::engine::pool::ChunkId;

/// Where a command's data lives.
#[derive(Debug)]
pub enum Buf {
    None,
    /// A pool chunk: disk data goes to and from it directly.
    Chunk(ChunkId),
    /// Heap memory: admin data, DSM ranges, in-capsule writes that found no
    /// free chunk (a write whose data comes when asked waits for a chunk
    /// before it asks, with no buffer).
    Heap(Vec<u8>),
}

/// What the transport must do next.
#[derive(Debug)]
pub enum Action {
    /// Send this completion. The SGL is the answered command's, where it
    /// had one that moved data: NVMe/RDMA invalidates its key with the
    /// completion when the host asked for that ([`Sgl::Keyed`] `invalidate`).
    Respond(CompletionEntry, Option<Sgl>),
    /// Send `len` bytes of `buf` to the host for command `cid`, to where
    /// its SGL `to` says (NVMe/RDMA: an RDMA WRITE to the keyed address;
    /// NVMe/TCP: C2HData), then the completion. A chunk is given back with
    /// [`Queue::sent`].
    SendData { cid: u16, buf: Buf, len: u32, to: Sgl, then: CompletionEntry },
    /// Ask the host for `len` bytes of command `cid`'s data, tagged `ttag`
    /// (the slot: NVMe/RDMA reads them from [`Queue::sgl`]).
    RequestData { cid: u16, ttag: u16, len: u32 },
    /// Close the connection (after sending what is queued).
    Close(CloseReason),
}

/// Why an H2CData PDU was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum H2cRefusal {
    UnknownTag,
    /// The command id does not match the transfer tag's command.
    WrongCommand,
    /// The command asked for no (more) data.
    NotRequested,
    /// The data is not where the next bytes asked for start, or runs past them.
    OutOfRange,
}

impl std::fmt::Display for H2cRefusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            H2cRefusal::UnknownTag => "no command has this transfer tag",
            H2cRefusal::WrongCommand => "the command id does not match the transfer tag",
            H2cRefusal::NotRequested => "no data was asked for this command",
            H2cRefusal::OutOfRange => "the data is not within what was asked for, in order",
        })
    }
}

/// A command's answer from a handler that needs no disk.
pub enum Reply {
    Done { status: Status, result: u64 },
    Data { data: Vec<u8> },
    /// Held (Asynchronous Event Request); answered later.
    Held,
}

impl Reply {
    pub fn ok() -> Reply {
        Reply::Done { status: Status::SUCCESS, result: 0 }
    }
    pub fn status(status: Status) -> Reply {
        Reply::Done { status, result: 0 }
    }
    pub fn error(e: &Error) -> Reply {
        Reply::Done { status: e.nvme_status(false), result: 0 }
    }
}

#[derive(Debug)]
struct Cmd {
    sqe: SubmissionEntry,
    buf: Buf,
    /// Bytes of host data the command carries, and how many arrived.
    expect: u32,
    received: u32,
    plan: Option<IoPlan>,
    /// Engine operations not yet reaped.
    pending_ops: u32,
    failed: Option<Status>,
    /// Byte ranges the command writes: their write epochs move when its
    /// disk work starts and again when it is done (see `WriteEpochs`).
    written: ByteRanges,
    /// When an I/O command arrived, if it is timed (`metrics::clock_is_cheap`).
    started: Option<Instant>,
}

impl Cmd {
    /// Whether the command carries data it has not asked for yet: it
    /// waits for a chunk to receive it into (and has no buffer until then).
    fn data_waits_for_chunk(&self) -> bool {
        self.expect > 0 && matches!(self.buf, Buf::None)
    }
}

/// A descriptor of the queue's (not its transport's) that wakes its thread.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WakeSource {
    Engine,
    Controller,
}

/// The queue's place in its association.
pub struct Connected {
    pub qid: u16,
    pub ctrl: Arc<Controller>,
    pub host: HostView,
}

pub struct Queue {
    pub sub: Arc<Subsystem>,
    /// The transport the queue's capsules come over: what SGLs it accepts.
    pub transport: NvmeTransport,
    /// The listener's port id (discovery log) and the connection's ends.
    pub port: u16,
    pub local: SocketAddr,
    pub peer: SocketAddr,
    pub conn: Option<Connected>,
    /// How the controller's teardown closes this queue's connection.
    pub closer: Option<QueueCloser>,
    /// The transport's epoll descriptor, for the engine's ring sleep.
    pub wake_fd: Option<std::os::fd::RawFd>,
    /// The transport's socket and its receive buffer size, for an I/O
    /// queue's engine to receive through its ring.
    pub socket_fd: Option<(std::os::fd::RawFd, usize)>,
    pub sq_entries: u32,
    sq_head: u32,
    pub engine: Option<BlockEngine>,
    cmds: Vec<Option<Cmd>>,
    free: Vec<u16>,
    by_cid: HashMap<u16, u16>,
    waiting_chunk: VecDeque<u16>,
    pub actions: Vec<Action>,
    /// The buffer `actions` is swapped with while the transport carries a
    /// batch out ([`Queue::take_actions`]). Kept, as `reaped` is, with its
    /// capacity: a turn of the per-I/O path allocates nothing.
    spare_actions: Vec<Action>,
    /// The engine's completions, between its reap and their answers.
    reaped: Vec<(u64, i32)>,
    ns_cache: (u64, Vec<Namespace>),
    /// Admin queue: held AERs, changed namespaces not yet read, whether
    /// namespace notices wait for the log to be read, what the host saw.
    pub aers: Vec<u16>,
    pub changed_nsids: Vec<u32>,
    pub aen_masked: bool,
    known: (u64, Vec<(u32, u64, bool)>),
    pub keep_alive_due: Option<Instant>,
}

impl Queue {
    pub fn new(sub: Arc<Subsystem>, transport: NvmeTransport, port: u16, local: SocketAddr, peer: SocketAddr) -> Queue {
        Queue {
            sub,
            transport,
            port,
            local,
            peer,
            conn: None,
            closer: None,
            wake_fd: None,
            socket_fd: None,
            sq_entries: 0,
            sq_head: 0,
            engine: None,
            cmds: Vec::new(),
            free: Vec::new(),
            by_cid: HashMap::new(),
            waiting_chunk: VecDeque::new(),
            actions: Vec::new(),
            spare_actions: Vec::new(),
            reaped: Vec::new(),
            ns_cache: (u64::MAX, Vec::new()),
            aers: Vec::new(),
            changed_nsids: Vec::new(),
            aen_masked: false,
            known: (u64::MAX, Vec::new()),
            keep_alive_due: None,
        }
    }

    /// A second handle on the connection, for the controller's table.
    pub fn closer_clone(&self) -> Option<QueueCloser> {
        self.closer.as_ref()?.try_clone()
    }

    pub fn qid(&self) -> Option<u16> {
        self.conn.as_ref().map(|c| c.qid)
    }

    pub fn is_admin(&self) -> bool {
        self.qid() == Some(0)
    }

    /// Bytes of in-capsule data this queue accepts.
    pub fn in_capsule_limit(&self) -> u32 {
        match self.qid() {
            Some(q) if q > 0 => super::IO_IN_CAPSULE,
            _ => super::ADMIN_IN_CAPSULE,
        }
    }

    /// The namespaces the connected host sees now.
    pub fn namespaces(&mut self) -> &[Namespace] {
        let generation = self.sub.registry.generation();
        if self.ns_cache.0 != generation {
            let set = self.sub.registry.volumes();
            let list = match &self.conn {
                Some(c) => super::namespaces(&set, &c.host),
                None => Vec::new(),
            };
            self.ns_cache = (set.generation, list);
        }
        &self.ns_cache.1
    }

    fn completion(&mut self, cid: u16, status: Status, result: u64) -> CompletionEntry {
        if !status.is_success() {
            NvmeStats::add(&self.sub.stats.errors, 1);
        }
        CompletionEntry { result, sq_head: self.sq_head as u16, sq_id: self.qid().unwrap_or(0), cid, status }
    }

    /// Answers a command that has no slot (refused on arrival).
    fn respond(&mut self, cid: u16, status: Status, result: u64) {
        let c = self.completion(cid, status, result);
        self.actions.push(Action::Respond(c, None));
    }

    /// Frees command `slot` and answers it.
    fn respond_slot(&mut self, slot: u16, status: Status, result: u64) {
        let sqe = self.cmds[slot as usize].as_ref().expect("live command").sqe;
        self.release_slot(slot);
        let c = self.completion(sqe.cid, status, result);
        self.actions.push(Action::Respond(c, sqe.sgl().ok()));
    }

    /// The actions made so far, for the transport to carry out in order;
    /// the ones made meanwhile go to the spare buffer. Hand the batch back
    /// with [`Queue::actions_done`]: the two buffers take turns and keep
    /// their capacity (taking `actions` itself would leave it without, and
    /// the next answer would allocate).
    pub fn take_actions(&mut self) -> Vec<Action> {
        let spare = std::mem::take(&mut self.spare_actions);
        std::mem::replace(&mut self.actions, spare)
    }

    /// A batch from [`Queue::take_actions`] was carried out (what is left
    /// of it, after a close, is dropped): its buffer is the next spare.
    pub fn actions_done(&mut self, mut batch: Vec<Action>) {
        batch.clear();
        self.spare_actions = batch;
    }

    /// The SGL of command `slot` (checked when it arrived).
    pub fn sgl(&self, slot: u16) -> Sgl {
        let cmd = self.cmds[slot as usize].as_ref().expect("live command");
        cmd.sqe.sgl().expect("checked on arrival")
    }

    /// The pool chunk command `slot`'s data is in, if it is in one (else
    /// it is in heap memory, which `data_mut` reaches).
    pub fn data_chunk(&self, slot: u16) -> Option<ChunkId> {
        match self.cmds[slot as usize].as_ref().expect("live command").buf {
            Buf::Chunk(c) => Some(c),
            _ => None,
        }
    }

    /// A command capsule arrived with `in_capsule` bytes of data to follow.
    /// Returns the slot the in-capsule data goes to; `None` when there is
    /// none to place: the command was answered (its data, if any, is
    /// discarded), runs, or asked for its data ([`Action::RequestData`]).
    pub fn command(&mut self, sqe: SubmissionEntry, in_capsule: u32) -> Option<u16> {
        if self.sq_entries > 0 {
            self.sq_head = (self.sq_head + 1) % self.sq_entries;
        }
        let cid = sqe.cid;
        // An I/O command (planned against the namespaces), not a Fabrics one.
        let io = self.qid().is_some_and(|q| q > 0) && sqe.opcode != admin_opcode::FABRICS;
        NvmeStats::add(&self.sub.stats.commands[NvmeStats::class(io, sqe.opcode)], 1);
        let is_connect = sqe.opcode == admin_opcode::FABRICS && sqe.fctype() == rdmablk_common::nvme::fabrics::fctype::CONNECT;
        if self.conn.is_none() && !is_connect {
            self.respond(cid, Status::COMMAND_SEQUENCE_ERROR, 0);
            return None;
        }
        if let Err(e) = sqe.validate() {
            tracing::debug!("nvme queue {:?} from {}: {e}", self.qid(), self.peer);
            self.respond(cid, Status::INVALID_FIELD, 0);
            return None;
        }
        if self.by_cid.contains_key(&cid) {
            self.respond(cid, Status::COMMAND_ID_CONFLICT, 0);
            return None;
        }
        let live = self.cmds.len() - self.free.len();
        if self.sq_entries > 0 && live >= self.sq_entries as usize {
            // The host sent more than its queue holds.
            self.respond(cid, Status::COMMAND_SEQUENCE_ERROR, 0);
            return None;
        }
        let sgl = match sqe.sgl() {
            Ok(s) => s,
            Err(_) => {
                self.respond(cid, Status::SGL_TYPE_INVALID, 0);
                return None;
            }
        };
        let h2c = data_direction(&sqe) & 0b01 != 0;
        let expect = match sgl {
            Sgl::InCapsule { offset, length } => {
                if offset != 0 {
                    self.respond(cid, Status::SGL_OFFSET_INVALID, 0);
                    return None;
                }
                if length != in_capsule || !h2c {
                    self.respond(cid, Status::SGL_DATA_LENGTH_INVALID, 0);
                    return None;
                }
                length
            }
            // Data the transport moves: NVMe/TCP by R2T and data PDUs,
            // NVMe/RDMA by RDMA READ and WRITE under the host's key.
            Sgl::Transport { length } | Sgl::Keyed { length, .. }
                if in_capsule == 0 && matches!(sgl, Sgl::Keyed { .. }) == (self.transport == NvmeTransport::Rdma) =>
            {
                if h2c {
                    length
                } else {
                    0
                }
            }
            _ => {
                self.respond(cid, Status::SGL_TYPE_INVALID, 0);
                return None;
            }
        };
        // I/O commands are planned (validated) before any data is asked for.
        let mut plan = None;
        if io {
            self.namespaces();
            match io_cmd::plan(&sqe, &self.ns_cache.1, sgl.length()) {
                Ok(p) => plan = Some(p),
                Err(e) => {
                    self.respond(cid, e.nvme_status(false), 0);
                    return None;
                }
            }
        }
        if expect > MAX_TRANSFER {
            // Only admin data can get here: I/O plans stop at MDTS.
            self.respond(cid, Status::SGL_DATA_LENGTH_INVALID, 0);
            return None;
        }
        let slot = self.alloc_slot();
        let started = if plan.is_some() && crate::metrics::clock_is_cheap() { Some(Instant::now()) } else { None };
        let mut cmd = Cmd { sqe, buf: Buf::None, expect, received: 0, plan, pending_ops: 0, failed: None, written: ByteRanges::None, started };
        if expect > 0 {
            cmd.buf = if cmd.plan.as_ref().is_some_and(|p| p.uses_chunk()) {
                match self.engine.as_mut().and_then(|e| e.alloc()) {
                    Some(c) => Buf::Chunk(c),
                    // In-capsule data is already on its way: held in heap
                    // memory (at most IO_IN_CAPSULE) until a chunk frees.
                    None if in_capsule > 0 => Buf::Heap(vec![0; expect as usize]),
                    // Data the host sends when asked is asked for when a
                    // chunk frees, so the queue's memory stays its chunks.
                    None => Buf::None,
                }
            } else {
                Buf::Heap(vec![0; expect as usize])
            };
        }
        let waits_for_chunk = cmd.data_waits_for_chunk();
        self.cmds[slot as usize] = Some(cmd);
        self.by_cid.insert(cid, slot);
        if in_capsule > 0 {
            return Some(slot);
        }
        if waits_for_chunk {
            self.waiting_chunk.push_back(slot);
            return None;
        }
        if expect > 0 {
            // The data comes in H2CData PDUs tagged with the slot.
            self.actions.push(Action::RequestData { cid, ttag: slot, len: expect });
            return None;
        }
        self.execute(slot);
        None
    }

    fn alloc_slot(&mut self) -> u16 {
        match self.free.pop() {
            Some(s) => s,
            None => {
                self.cmds.push(None);
                (self.cmds.len() - 1) as u16
            }
        }
    }

    fn release_slot(&mut self, slot: u16) {
        if let Some(c) = self.cmds[slot as usize].take() {
            if self.by_cid.get(&c.sqe.cid) == Some(&slot) {
                self.by_cid.remove(&c.sqe.cid);
            }
            if let Buf::Chunk(ch) = c.buf {
                self.give_back(ch);
            }
        }
        self.free.push(slot);
    }

    fn give_back(&mut self, c: ChunkId) {
        if let Some(e) = self.engine.as_mut() {
            e.release(c);
        }
        if let Some(next) = self.waiting_chunk.pop_front() {
            self.chunk_freed_for(next);
        }
    }

    /// A chunk is free for command `slot`, which waited for one: a write
    /// whose data was not asked for yet asks for it into that chunk; any
    /// other command runs.
    fn chunk_freed_for(&mut self, slot: u16) {
        let cmd = self.cmds[slot as usize].as_mut().expect("live command");
        if !cmd.data_waits_for_chunk() {
            self.run_io(slot);
            return;
        }
        let Some(c) = self.engine.as_mut().and_then(|e| e.alloc()) else {
            self.waiting_chunk.push_front(slot);
            return;
        };
        cmd.buf = Buf::Chunk(c);
        let (cid, len) = (cmd.sqe.cid, cmd.expect);
        self.actions.push(Action::RequestData { cid, ttag: slot, len });
    }

    /// A chunk the transport finished sending.
    pub fn sent(&mut self, c: ChunkId) {
        self.give_back(c);
    }

    /// Where `len` bytes of command `slot`'s data at `offset` go. The
    /// caller checked the range against what the command expects.
    pub fn data_mut(&mut self, slot: u16, offset: u32, len: u32) -> &mut [u8] {
        let cmd = self.cmds[slot as usize].as_mut().expect("live command");
        let (o, n) = (offset as usize, len as usize);
        match &mut cmd.buf {
            Buf::Chunk(c) => &mut self.engine.as_mut().expect("engine").bytes_mut(*c)[o..o + n],
            Buf::Heap(v) => &mut v[o..o + n],
            Buf::None => panic!("command without a data buffer"),
        }
    }

    /// Checks an H2CData PDU against the command it names: the transfer
    /// tag, the command id, and the range asked for. Returns the slot.
    pub fn check_h2c(&self, ttag: u16, cccid: u16, offset: u32, len: u32) -> Result<u16, H2cRefusal> {
        let Some(Some(cmd)) = self.cmds.get(ttag as usize) else { return Err(H2cRefusal::UnknownTag) };
        if cmd.sqe.cid != cccid {
            return Err(H2cRefusal::WrongCommand);
        }
        // A command waiting for a chunk has not asked.
        if cmd.expect == 0
            || cmd.received >= cmd.expect
            || cmd.data_waits_for_chunk()
            || matches!(cmd.sqe.sgl(), Ok(Sgl::InCapsule { .. }))
        {
            return Err(H2cRefusal::NotRequested);
        }
        if offset != cmd.received || offset as u64 + len as u64 > cmd.expect as u64 {
            return Err(H2cRefusal::OutOfRange);
        }
        Ok(ttag)
    }

    /// `len` more bytes of command `slot`'s data were placed; `last`: the
    /// host says they were the last. Runs the command once all arrived.
    pub fn data_placed(&mut self, slot: u16, len: u32, last: bool) -> Result<(), &'static str> {
        let cmd = self.cmds[slot as usize].as_mut().expect("live command");
        cmd.received += len;
        let done = cmd.received == cmd.expect;
        if last != done {
            return Err(if last { "LAST_PDU before all data arrived" } else { "all data arrived without LAST_PDU" });
        }
        if done {
            self.execute(slot);
        }
        Ok(())
    }

    /// A command's data digest was wrong: its data is thrown away and the
    /// command fails with Transient Transport Error, which the host retries
    /// (the connection goes on, as with SPDK's target and Linux nvmet).
    pub fn data_corrupt(&mut self, slot: u16) {
        self.respond_slot(slot, Status::TRANSIENT_TRANSPORT_ERROR, 0);
    }

    /// Runs a command whose data (if any) has arrived.
    fn execute(&mut self, slot: u16) {
        let cmd = self.cmds[slot as usize].as_mut().expect("live command");
        let sqe = cmd.sqe;
        if cmd.plan.is_some() {
            self.run_io(slot);
            return;
        }
        let data = match std::mem::replace(&mut cmd.buf, Buf::None) {
            Buf::Heap(v) => v,
            Buf::Chunk(_) | Buf::None => Vec::new(),
        };
        let reply = if sqe.opcode == admin_opcode::FABRICS {
            fabrics_cmd::handle(self, &sqe, &data)
        } else if self.is_admin() {
            admin_cmd::handle(self, &sqe, &data)
        } else {
            Reply::status(Status::INVALID_OPCODE)
        };
        self.finish(slot, reply);
    }

    fn finish(&mut self, slot: u16, reply: Reply) {
        let cid = self.cmds[slot as usize].as_ref().expect("live command").sqe.cid;
        match reply {
            // A notice may already be waiting for a request to carry it.
            Reply::Held => self.send_events(),
            Reply::Done { status, result } => self.respond_slot(slot, status, result),
            Reply::Data { data } => {
                let sqe = self.cmds[slot as usize].as_ref().expect("live command").sqe;
                self.release_slot(slot);
                // The command defines how much it returns (Identify 4 KiB,
                // a log page NUMD dwords); a longer SGL gets that much, a
                // shorter one is refused, as Linux nvmet does.
                let room = sqe.sgl().map(|s| s.length()).unwrap_or(0) as usize;
                if room < data.len() {
                    self.respond(cid, Status::SGL_DATA_LENGTH_INVALID, 0);
                    return;
                }
                let then = self.completion(cid, Status::SUCCESS, 0);
                let len = data.len() as u32;
                let to = sqe.sgl().expect("checked on arrival");
                self.actions.push(Action::SendData { cid, buf: Buf::Heap(data), len, to, then });
            }
        }
    }

    /// Answers a held command (an AER) now.
    pub fn answer_held(&mut self, cid: u16, status: Status, result: u64) {
        if let Some(slot) = self.by_cid.get(&cid).copied() {
            self.respond_slot(slot, status, result);
        }
    }

    /// Starts (or continues, once a chunk is free) an I/O command's engine work.
    fn run_io(&mut self, slot: u16) {
        let Some(engine) = self.engine.as_mut() else { return };
        let cmd = self.cmds[slot as usize].as_mut().expect("live command");
        let plan = cmd.plan.clone().expect("planned");
        let tag = slot as u64;
        if plan.uses_chunk() && !matches!(cmd.buf, Buf::Chunk(_)) {
            let Some(c) = engine.alloc() else {
                self.waiting_chunk.push_back(slot);
                return;
            };
            if let Buf::Heap(v) = &cmd.buf {
                engine.bytes_mut(c)[..v.len()].copy_from_slice(v);
            }
            cmd.buf = Buf::Chunk(c);
        }
        let r = match &plan {
            IoPlan::Read { ns, offset, len } => {
                let Buf::Chunk(c) = cmd.buf else { unreachable!("a chunk was taken above") };
                engine.read(&ns.volume, c, *len, *offset, tag).map(|()| cmd.pending_ops = 1)
            }
            IoPlan::Write { ns, offset, len, fua } => {
                let Buf::Chunk(c) = cmd.buf else { unreachable!("a chunk was taken above") };
                ns.volume.writes.bump(*offset, *len as u64);
                cmd.written = ByteRanges::One((*offset, *len as u64));
                engine.write(&ns.volume, c, *len, *offset, *fua, tag).map(|()| cmd.pending_ops = 1)
            }
            IoPlan::Flush { ns } => engine.flush(&ns.volume, tag).map(|()| cmd.pending_ops = 1),
            IoPlan::Range { ns, op, ranges } => submit_ranges(engine, cmd, ns, *op, ranges.clone(), tag),
            IoPlan::Deallocate { ns, op, ranges: count } => {
                let ranges = match &cmd.buf {
                    Buf::Heap(v) => io_cmd::dsm_ranges(v, *count, ns),
                    _ => Err(Error::new(ErrorKind::Internal, "DSM ranges not in heap memory")),
                };
                match ranges {
                    Err(e) => {
                        self.record_io(slot, false);
                        self.finish(slot, Reply::error(&e));
                        return;
                    }
                    Ok(ranges) if ranges.is_empty() => {
                        self.record_io(slot, true);
                        self.finish(slot, Reply::ok());
                        return;
                    }
                    Ok(ranges) => submit_ranges(engine, cmd, ns, *op, ByteRanges::Many(ranges), tag),
                }
            }
        };
        if let Err(e) = r {
            tracing::error!("nvme queue {:?}: engine: {e}", self.qid());
            let cmd = self.cmds[slot as usize].as_mut().expect("live command");
            cmd.failed = Some(Status::INTERNAL_ERROR);
            // Nothing of it reached the engine: nothing will complete it.
            if cmd.pending_ops == 0 {
                self.io_done(slot);
            }
        }
    }

    /// Reaps the engine and turns finished operations into answers.
    pub fn reap(&mut self) -> usize {
        let Some(mut engine) = self.engine.take() else { return 0 };
        // Into the kept buffer: taken out meanwhile, as `op_done` needs the
        // whole queue.
        let mut done = std::mem::take(&mut self.reaped);
        let n = engine.reap(|tag, res| done.push((tag, res)));
        self.engine = Some(engine);
        for &(tag, res) in &done {
            self.op_done(tag as u16, res);
        }
        done.clear();
        self.reaped = done;
        n
    }

    fn op_done(&mut self, slot: u16, res: i32) {
        let qid = self.qid();
        let Some(cmd) = self.cmds.get_mut(slot as usize).and_then(|c| c.as_mut()) else { return };
        cmd.pending_ops = cmd.pending_ops.saturating_sub(1);
        let plan = cmd.plan.clone().expect("an engine operation belongs to an I/O command");
        if res < 0 && cmd.failed.is_none() {
            let reading = matches!(plan, IoPlan::Read { .. });
            let e = Error::new(ErrorKind::DeviceIo(-res), format!("{}: errno {}", plan.name(), -res));
            tracing::warn!("nvme queue {:?}: {} of namespace {} failed: {e}", qid, plan.name(), plan.nsid());
            cmd.failed = Some(e.nvme_status(reading));
        }
        if cmd.pending_ops == 0 {
            self.io_done(slot);
        }
    }

    /// Counts a finished I/O command in its volume's metrics.
    fn record_io(&self, slot: u16, ok: bool) {
        let cmd = self.cmds[slot as usize].as_ref().expect("live command");
        let Some(plan) = &cmd.plan else { return };
        let (op, bytes) = match plan {
            IoPlan::Read { len, .. } => (Opcode::Read, *len as u64),
            IoPlan::Write { len, .. } => (Opcode::Write, *len as u64),
            IoPlan::Flush { .. } => (Opcode::Flush, 0),
            IoPlan::Range { .. } => (Opcode::WriteZeroes, cmd.written.iter().map(|r| r.1).sum()),
            IoPlan::Deallocate { .. } => (Opcode::Discard, cmd.written.iter().map(|r| r.1).sum()),
        };
        let i = crate::metrics::op_index(op).expect("an I/O opcode");
        plan.namespace().volume.stats.shared().ops[i].record_shared(bytes, ok, cmd.started.map(|t| t.elapsed()));
    }

    /// An I/O command has nothing left in the engine: its written ranges'
    /// epochs move again and it is answered.
    fn io_done(&mut self, slot: u16) {
        self.record_io(slot, self.cmds[slot as usize].as_ref().is_some_and(|c| c.failed.is_none()));
        let cmd = self.cmds[slot as usize].as_mut().expect("live command");
        let plan = cmd.plan.clone().expect("an I/O command");
        for &(offset, len) in cmd.written.iter() {
            plan.namespace().volume.writes.bump(offset, len);
        }
        let cid = cmd.sqe.cid;
        match (cmd.failed, &plan) {
            (None, IoPlan::Read { len, .. }) => {
                let len = *len;
                NvmeStats::add(&self.sub.stats.bytes_read, len as u64);
                let buf = std::mem::replace(&mut cmd.buf, Buf::None);
                let to = cmd.sqe.sgl().expect("checked on arrival");
                let then = self.completion(cid, Status::SUCCESS, 0);
                self.release_slot(slot);
                self.actions.push(Action::SendData { cid, buf, len, to, then });
            }
            (failed, _) => {
                if let (None, IoPlan::Write { len, .. }) = (failed, &plan) {
                    NvmeStats::add(&self.sub.stats.bytes_written, *len as u64);
                }
                self.respond_slot(slot, failed.unwrap_or(Status::SUCCESS), 0);
            }
        }
    }

    /// Whether disk operations are still in flight.
    pub fn busy(&self) -> bool {
        self.engine.as_ref().is_some_and(|e| e.inflight() > 0)
    }

    /// Makes this an I/O queue's engine (at its Connect).
    pub fn start_engine(&mut self, qid: u16) -> crate::Result<()> {
        let chunks = QUEUE_CHUNKS.min(self.sq_entries.max(1));
        let entries = (self.sq_entries.max(8)).next_power_of_two();
        let pool = Pool::new(chunks as usize * MAX_TRANSFER as usize, MAX_TRANSFER as usize);
        let opts = UringOptions {
            entries,
            file_slots: QUEUE_FILE_SLOTS,
            wake_fd: self.wake_fd,
            socket_fd: self.socket_fd.map(|s| s.0),
            recv_buffer: self.socket_fd.map_or(0, |s| s.1),
            ..UringOptions::default()
        };
        self.engine = Some(BlockEngine::new(pool, opts, 1000 + qid as usize)?);
        Ok(())
    }

    /// Admin queue, every turn: keep-alive expiry and namespace changes.
    pub fn tick(&mut self, now: Instant) {
        let Some(conn) = &self.conn else { return };
        if conn.qid != 0 || conn.ctrl.discovery {
            return;
        }
        let ctrl = Arc::clone(&conn.ctrl);
        if let Some(due) = self.keep_alive_due {
            if now >= due {
                let kato = ctrl.state.lock().unwrap_or_else(|e| e.into_inner()).kato_ms;
                NvmeStats::add(&self.sub.stats.keep_alive_timeouts, 1);
                ctrl.tear_down(&CloseReason::fault(format!("no keep-alive within {kato} ms")));
                self.actions.push(Action::Close(CloseReason::fault("keep-alive timeout")));
                return;
            }
        }
        self.watch_namespaces();
    }

    /// Any admin command restarts the keep-alive timer.
    pub fn kept_alive(&mut self) {
        let Some(conn) = &self.conn else { return };
        let kato = conn.ctrl.state.lock().unwrap_or_else(|e| e.into_inner()).kato_ms;
        self.keep_alive_due = (kato > 0).then(|| Instant::now() + Duration::from_millis(kato as u64));
    }

    /// Compares the namespaces with what the host saw and raises a
    /// namespace-attribute-changed event for the difference.
    fn watch_namespaces(&mut self) {
        let generation = self.sub.registry.generation();
        if self.known.0 == generation {
            return;
        }
        let now: Vec<(u32, u64, bool)> = self.namespaces().iter().map(|n| (n.nsid, n.volume.blocks(), n.read_only)).collect();
        let first = self.known.0 == u64::MAX;
        let before = std::mem::replace(&mut self.known, (generation, now.clone())).1;
        if first {
            return;
        }
        let mut changed: Vec<u32> = now.iter().filter(|n| !before.contains(n)).map(|n| n.0).collect();
        changed.extend(before.iter().filter(|b| !now.iter().any(|n| n.0 == b.0)).map(|b| b.0));
        changed.sort_unstable();
        changed.dedup();
        if changed.is_empty() {
            return;
        }
        tracing::info!("nvme controller {}: namespaces changed: {changed:?}", self.conn.as_ref().map_or(0, |c| c.ctrl.id));
        for n in changed {
            if !self.changed_nsids.contains(&n) {
                self.changed_nsids.push(n);
            }
        }
        self.send_events();
    }

    /// Completes a held AER for a pending namespace notice, if enabled.
    pub fn send_events(&mut self) {
        let Some(conn) = &self.conn else { return };
        let enabled = conn.ctrl.state.lock().unwrap_or_else(|e| e.into_inner()).aen_config & super::identify::AEN_NS_ATTR != 0;
        if !enabled || self.aen_masked || self.changed_nsids.is_empty() {
            return;
        }
        let Some(cid) = self.aers.pop() else { return };
        self.aen_masked = true;
        // Event type 2 (notice), information 0 (namespace attribute
        // changed), log page 0x04 (changed namespace list).
        self.answer_held(cid, Status::SUCCESS, 0x0004_0002);
    }

    /// Drops every command (the connection is closing).
    pub fn drop_commands(&mut self) {
        for slot in 0..self.cmds.len() as u16 {
            let pending = self.cmds[slot as usize].as_ref().is_some_and(|c| c.pending_ops > 0);
            if self.cmds[slot as usize].is_some() && !pending {
                self.release_slot(slot);
            }
        }
        self.waiting_chunk.clear();
    }

    /// Before a queue thread sleeps, whatever its transport: how long it
    /// may (the handshake's deadline before Connect, the keep-alive's and
    /// the namespace checks' on the admin queue; an I/O queue has no
    /// deadline and reads no clock, which on some virtual machines is a
    /// system call), or why the queue must close now (its association
    /// was torn down, the target is stopping, no Connect came in time).
    pub fn sleep_limit(&self, handshake_due: Instant) -> Result<Option<Duration>, String> {
        let Some(conn) = &self.conn else {
            if self.stopping() {
                return Err("the target is stopping".into());
            }
            let now = Instant::now();
            if now >= handshake_due {
                return Err(format!("no Connect within {:?}", self.sub.cfg.handshake_timeout));
            }
            return Ok(Some(handshake_due.saturating_duration_since(now).min(ADMIN_TICK)));
        };
        if conn.ctrl.is_dead() {
            return Err("the controller was torn down".into());
        }
        if conn.qid != 0 {
            return Ok(None);
        }
        let ka = self.keep_alive_due.map_or(ADMIN_TICK, |d| d.saturating_duration_since(Instant::now()));
        Ok(Some(ka.min(ADMIN_TICK)))
    }

    /// The descriptors a queue thread watches once they exist: the
    /// engine's (its ring's eventfd, its blocking worker's) and, on the
    /// admin queue, the controller's wake-up.
    /// An iterator, not a list: the transports ask every turn.
    pub fn wake_sources(&self) -> impl Iterator<Item = (std::os::fd::RawFd, WakeSource)> + '_ {
        let engine = self.engine.iter().flat_map(|e| e.wait_fds().map(|fd| (fd, WakeSource::Engine)));
        let controller = self.conn.as_ref().filter(|c| c.qid == 0).map(|c| (c.ctrl.wake.fd(), WakeSource::Controller));
        engine.chain(controller)
    }

    /// Consumes the wake-up of `source` after it fired.
    pub fn woken_by(&mut self, source: WakeSource) {
        match source {
            WakeSource::Engine => {
                if let Some(e) = self.engine.as_mut() {
                    e.clear_wake();
                }
            }
            WakeSource::Controller => {
                if let Some(c) = &self.conn {
                    c.ctrl.wake.drain();
                }
            }
        }
    }

    /// The connection is gone (the transport stopped using it): drops the
    /// queued commands, waits for the disk operations (only then is the
    /// queue out of the fence) and leaves the controller; the admin queue
    /// closing ends the association.
    pub fn close(&mut self, why: &CloseReason) {
        self.drop_commands();
        let started = Instant::now();
        while self.busy() && started.elapsed() < Duration::from_secs(60) {
            self.reap();
            std::thread::sleep(Duration::from_millis(1));
        }
        drop(self.engine.take());
        let Some(conn) = self.conn.take() else {
            tracing::debug!("{} {}: closed before Connect: {why}", self.transport.scheme(), self.peer);
            return;
        };
        self.sub.stats.queues.fetch_sub(1, Ordering::Relaxed);
        let ctrl = conn.ctrl;
        if conn.qid == 0 {
            ctrl.tear_down(&why.map(|w| format!("admin queue closed: {w}")));
        } else {
            ctrl.queues.lock().unwrap_or_else(|e| e.into_inner()).remove(conn.qid);
            tracing::debug!("nvme controller {} queue {} closed: {why}", ctrl.id, conn.qid);
        }
        if ctrl.live_queues.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.sub.remove_controller(ctrl.id);
            tracing::info!("nvme controller {} of host {:?} is gone", ctrl.id, ctrl.host_nqn);
        }
    }

    pub fn stopping(&self) -> bool {
        self.sub.stopping.load(Ordering::Acquire)
    }
}

/// Starts a command's deallocate or zeroing ranges, each its own engine
/// operation tagged `tag`, moving their write epochs first.
fn submit_ranges(
    engine: &mut BlockEngine,
    cmd: &mut Cmd,
    ns: &Namespace,
    op: crate::backend::RangeOp,
    ranges: ByteRanges,
    tag: u64,
) -> crate::Result<()> {
    let mut r = Ok(());
    for &(offset, len) in ranges.iter() {
        ns.volume.writes.bump(offset, len);
        match engine.range(&ns.volume, op, offset, len, tag) {
            Ok(()) => cmd.pending_ops += 1,
            Err(e) => {
                r = Err(e);
                break;
            }
        }
    }
    cmd.written = ranges;
    r
}

/// The data direction of a command: bits 1:0 of its opcode (of FCTYPE for
/// a Fabrics command): 01 host to controller, 10 controller to host.
pub fn data_direction(sqe: &SubmissionEntry) -> u8 {
    if sqe.opcode == admin_opcode::FABRICS {
        sqe.fctype() & 0b11
    } else {
        sqe.opcode & 0b11
    }
}

#[cfg(test)]
mod tests {
    use rdmablk_common::nvme::fabrics::{ConnectData, Property, CONNECT_DATA_SIZE};
    use rdmablk_common::nvme::sqe::{admin_opcode, Sgl};

    use super::*;
    use crate::auth::AccessPolicy;
    use crate::backend::{open_volumes, VolumeSet};
    use crate::config::Config;
    use crate::session::Registry;

    const HOST: &str = "nqn.2014-08.org.example:host";

    fn subsystem(volumes: &[&str]) -> (Arc<Subsystem>, Config) {
        let mut text = "[target]\nname = \"t\"\nlisten = [\"nvme+tcp://127.0.0.1:0\"]\n".to_owned();
        for v in volumes {
            text += &format!("[[volume]]\nname = \"{v}\"\nbackend = \"memory\"\nsize = \"1MiB\"\nblock_size = 512\nallow_any_host = true\n");
        }
        let config = Config::parse(&text, "test").unwrap();
        let set = VolumeSet::new(1, open_volumes(&config).unwrap()).with_access(Arc::new(AccessPolicy::load(&config).unwrap()));
        let registry = Arc::new(Registry::new(set, 1));
        (Arc::new(Subsystem::new(&config.target, registry)), config)
    }

    fn queue(sub: &Arc<Subsystem>) -> Queue {
        let a = "127.0.0.1:4420".parse().unwrap();
        Queue::new(Arc::clone(sub), NvmeTransport::Tcp, 1, a, a)
    }

    /// Runs one command (with its data, if any) and returns what it answered.
    fn run(q: &mut Queue, mut sqe: SubmissionEntry, data: &[u8]) -> Vec<Action> {
        if !data.is_empty() {
            sqe.set_sgl(Sgl::InCapsule { offset: 0, length: data.len() as u32 });
        }
        if let Some(slot) = q.command(sqe, data.len() as u32) {
            q.data_mut(slot, 0, data.len() as u32).copy_from_slice(data);
            q.data_placed(slot, data.len() as u32, true).unwrap();
        }
        std::mem::take(&mut q.actions)
    }

    fn status(actions: &[Action]) -> (Status, u64) {
        match actions.last() {
            Some(Action::Respond(c, _)) => (c.status, c.result),
            Some(Action::SendData { then, .. }) => (then.status, then.result),
            other => panic!("no answer: {other:?}"),
        }
    }

    fn data(actions: &[Action]) -> Vec<u8> {
        match actions.last() {
            Some(Action::SendData { buf: Buf::Heap(v), .. }) => v.clone(),
            other => panic!("no data: {other:?}"),
        }
    }

    fn connect(q: &mut Queue, subnqn: &str, kato_ms: u32) -> (Status, u64) {
        connect_queue(q, subnqn, 0, 0xffff, kato_ms)
    }

    /// Connect of queue `qid` (0: admin, with controller id 0xffff).
    fn connect_queue(q: &mut Queue, subnqn: &str, qid: u16, cntlid: u16, kato_ms: u32) -> (Status, u64) {
        connect_queue_sized(q, subnqn, qid, cntlid, kato_ms, 31)
    }

    /// [`connect_queue`] with a 0-based `sqsize`.
    fn connect_queue_sized(q: &mut Queue, subnqn: &str, qid: u16, cntlid: u16, kato_ms: u32, sqsize: u16) -> (Status, u64) {
        let c = rdmablk_common::nvme::fabrics::Connect { recfmt: 0, qid, sqsize, cattr: 0, kato_ms };
        let mut d = [0u8; CONNECT_DATA_SIZE];
        ConnectData { host_id: [7; 16], controller_id: cntlid, subsystem_nqn: subnqn.into(), host_nqn: HOST.into() }.encode(&mut d).unwrap();
        status(&run(q, c.to_entry(1), &d))
    }

    fn admin(sub: &Arc<Subsystem>) -> Queue {
        admin_of_controller(sub).0
    }

    /// An enabled admin queue and its controller id.
    fn admin_of_controller(sub: &Arc<Subsystem>) -> (Queue, u16) {
        let mut q = queue(sub);
        let (st, cntlid) = connect(&mut q, &sub.nqn.clone(), 0);
        assert_eq!(st, Status::SUCCESS);
        let cc = Property { offset: 0x14, wide: false, value: 0x0046_0001 };
        assert_eq!(status(&run(&mut q, cc.to_entry(2, true), &[])).0, Status::SUCCESS);
        let csts = Property { offset: 0x1c, wide: false, value: 0 };
        assert_eq!(status(&run(&mut q, csts.to_entry(3, false), &[])), (Status::SUCCESS, 1), "CSTS.RDY");
        (q, cntlid as u16)
    }

    fn identify(cns: u32, nsid: u32) -> SubmissionEntry {
        let mut e = SubmissionEntry::new(admin_opcode::IDENTIFY, 9);
        e.nsid = nsid;
        e.cdw[0] = cns;
        e.set_sgl(Sgl::Transport { length: 4096 });
        e
    }

    #[test]
    fn a_command_before_connect_is_a_sequence_error() {
        let (sub, _) = subsystem(&["a"]);
        let mut q = queue(&sub);
        assert_eq!(status(&run(&mut q, identify(1, 0), &[])).0, Status::COMMAND_SEQUENCE_ERROR);
    }

    #[test]
    fn connect_checks_the_subsystem_and_hands_out_a_controller_id() {
        let (sub, _) = subsystem(&["a"]);
        let mut q = queue(&sub);
        let (st, _) = connect(&mut q, "nqn.2014-08.org.example:other", 0);
        assert_eq!(st, Status::CONNECT_INVALID_PARAMETERS);
        let (st, id) = connect(&mut q, &sub.nqn.clone(), 0);
        assert_eq!(st, Status::SUCCESS);
        assert!(sub.controller(id as u16).is_some());
        assert_eq!(connect(&mut q, &sub.nqn.clone(), 0).0, Status::COMMAND_SEQUENCE_ERROR, "a second Connect");
    }

    #[test]
    fn identify_reports_the_controller_and_the_namespaces() {
        let (sub, _) = subsystem(&["a", "b"]);
        let mut q = admin(&sub);
        let c = data(&run(&mut q, identify(1, 0), &[]));
        assert_eq!(&c[24..38], b"rdmablk-target");
        assert_eq!(c[77], super::super::MDTS);
        assert_eq!(u32::from_le_bytes(c[80..84].try_into().unwrap()), super::super::identify::VERSION);
        assert_eq!(u32::from_le_bytes(c[1792..1796].try_into().unwrap()), (64 + 16384) / 16, "IOCCSZ");
        assert_eq!(u16::from_le_bytes([c[1804], c[1805]]), 1, "OFCS: Disconnect supported");
        assert!(u16::from_le_bytes(c[514..516].try_into().unwrap()) > 0, "MAXCMD");
        assert_eq!(&c[768..768 + sub.nqn.len()], sub.nqn.as_bytes());
        let list = data(&run(&mut q, identify(2, 0), &[]));
        assert_eq!(&list[..12], &[1, 0, 0, 0, 2, 0, 0, 0, 0, 0, 0, 0]);
        let list = data(&run(&mut q, identify(2, 1), &[]));
        assert_eq!(&list[..8], &[2, 0, 0, 0, 0, 0, 0, 0], "ids after 1");
        let ns = data(&run(&mut q, identify(0, 2), &[]));
        assert_eq!(u64::from_le_bytes(ns[0..8].try_into().unwrap()), 2048);
        assert_eq!(ns[130], 9, "LBADS of 512-byte blocks");
        let inactive = data(&run(&mut q, identify(0, 3), &[]));
        assert!(inactive.iter().all(|&b| b == 0));
        let descs = data(&run(&mut q, identify(3, 1), &[]));
        assert_eq!((descs[0], descs[1]), (2, 16), "NGUID first");
        assert_eq!(status(&run(&mut q, identify(3, 9), &[])).0, Status::INVALID_NAMESPACE);
        assert_eq!(status(&run(&mut q, identify(0x1f, 0), &[])).0, Status::INVALID_FIELD);
    }

    #[test]
    fn the_discovery_controller_identifies_as_one_with_commands_allowed() {
        let (sub, _) = subsystem(&["a"]);
        let mut q = queue(&sub);
        assert_eq!(connect(&mut q, rdmablk_common::nvme::fabrics::DISCOVERY_NQN, 0).0, Status::SUCCESS);
        let c = data(&run(&mut q, identify(1, 0), &[]));
        assert_eq!(c[111], 2, "CNTRLTYPE: discovery");
        assert!(u16::from_le_bytes(c[514..516].try_into().unwrap()) > 0, "MAXCMD (Linux: 'Firmware bug' when 0)");
        assert_eq!(&c[768..768 + 36], rdmablk_common::nvme::fabrics::DISCOVERY_NQN.as_bytes());
    }

    #[test]
    fn unknown_admin_commands_and_log_pages_get_errors_not_silence() {
        let (sub, _) = subsystem(&["a"]);
        let mut q = admin(&sub);
        assert_eq!(status(&run(&mut q, SubmissionEntry::new(0xc0, 4), &[])).0, Status::INVALID_OPCODE);
        let mut log = SubmissionEntry::new(admin_opcode::GET_LOG_PAGE, 5);
        log.cdw[0] = 0x7f | (127 << 16);
        log.set_sgl(Sgl::Transport { length: 512 });
        assert_eq!(status(&run(&mut q, log, &[])).0, Status::INVALID_LOG_PAGE);
        log.cdw[0] = 0x02 | (127 << 16);
        assert_eq!(data(&run(&mut q, log, &[])).len(), 512, "SMART / health");
    }

    #[test]
    fn a_new_namespace_raises_an_event_and_shows_in_the_changed_list() {
        let (sub, _) = subsystem(&["a"]);
        let mut q = admin(&sub);
        let mut aec = SubmissionEntry::new(admin_opcode::SET_FEATURES, 6);
        aec.cdw[0] = 0x0b;
        aec.cdw[1] = super::super::identify::AEN_NS_ATTR;
        assert_eq!(status(&run(&mut q, aec, &[])).0, Status::SUCCESS);
        assert!(run(&mut q, SubmissionEntry::new(admin_opcode::ASYNC_EVENT_REQUEST, 7), &[]).is_empty(), "held");
        q.tick(Instant::now());
        assert!(q.actions.is_empty(), "nothing changed yet");
        // A reload adds volume b (id 2).
        let (_, bigger) = subsystem(&["a", "b"]);
        let mut volumes = sub.registry.volumes().volumes.clone();
        volumes.push(open_volumes(&bigger).unwrap().pop().unwrap());
        let set = VolumeSet::new(2, volumes).with_access(Arc::new(AccessPolicy::load(&bigger).unwrap()));
        sub.registry.publish(&sub.registry.admin(), set);
        q.tick(Instant::now());
        let actions = std::mem::take(&mut q.actions);
        assert_eq!(status(&actions), (Status::SUCCESS, 0x0004_0002));
        let mut log = SubmissionEntry::new(admin_opcode::GET_LOG_PAGE, 8);
        log.cdw[0] = 0x04 | (1023 << 16);
        log.set_sgl(Sgl::Transport { length: 4096 });
        let page = data(&run(&mut q, log, &[]));
        assert_eq!(&page[..8], &[2, 0, 0, 0, 0, 0, 0, 0]);
        let page = data(&run(&mut q, log, &[]));
        assert!(page.iter().all(|&b| b == 0), "reading the log cleared it");
    }

    #[test]
    fn admin_data_is_as_long_as_the_command_defines_whatever_the_sgl_says() {
        let (sub, _) = subsystem(&["a"]);
        let mut q = admin(&sub);
        // A 4 GiB SGL on Identify: 4,096 bytes are sent, nothing more is allocated.
        let mut id = identify(1, 0);
        id.set_sgl(Sgl::Transport { length: u32::MAX });
        let actions = run(&mut q, id, &[]);
        assert!(matches!(actions.last(), Some(Action::SendData { len: 4096, .. })), "{actions:?}");
        assert_eq!(data(&actions).len(), 4096);
        // Shorter than the data: refused.
        id.set_sgl(Sgl::Transport { length: 100 });
        assert_eq!(status(&run(&mut q, id, &[])).0, Status::SGL_DATA_LENGTH_INVALID);
    }

    #[test]
    fn connect_data_errors_name_the_field_at_fault() {
        let (sub, _) = subsystem(&["a"]);
        let mut q = queue(&sub);
        let c = rdmablk_common::nvme::fabrics::Connect { recfmt: 0, qid: 0, sqsize: 31, cattr: 0, kato_ms: 0 };
        let mut d = [0u8; CONNECT_DATA_SIZE];
        ConnectData { host_id: [7; 16], controller_id: 0xffff, subsystem_nqn: sub.nqn.clone(), host_nqn: HOST.into() }.encode(&mut d).unwrap();
        d[512..768].fill(b'x');
        assert_eq!(status(&run(&mut q, c.to_entry(1), &d)), (Status::CONNECT_INVALID_PARAMETERS, 0x1_0200), "HOSTNQN");
    }

    #[test]
    fn a_silent_host_loses_its_controller_after_kato() {
        let (sub, _) = subsystem(&["a"]);
        let mut q = queue(&sub);
        let (_, id) = connect(&mut q, &sub.nqn.clone(), 100);
        q.tick(Instant::now());
        assert!(!sub.controller(id as u16).unwrap().is_dead());
        q.tick(Instant::now() + Duration::from_millis(150));
        assert!(sub.controller(id as u16).unwrap().is_dead());
        assert!(matches!(q.actions.last(), Some(Action::Close(_))));
    }

    /// An enabled admin queue and I/O queue 1 of one controller.
    fn io_queue(sub: &Arc<Subsystem>) -> (Queue, Queue) {
        io_queue_sized(sub, 31)
    }

    /// An admin queue and I/O queue 1 of its controller, of `sqsize + 1` entries.
    fn io_queue_sized(sub: &Arc<Subsystem>, sqsize: u16) -> (Queue, Queue) {
        let (admin, cntlid) = admin_of_controller(sub);
        let mut q = queue(sub);
        // The controller keeps a handle on each I/O queue's socket (for its teardown).
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        q.closer = Some(QueueCloser::Tcp(std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap()));
        assert_eq!(connect_queue_sized(&mut q, &sub.nqn.clone(), 1, cntlid, 0, sqsize).0, Status::SUCCESS);
        assert!(q.engine.is_some(), "an I/O queue has an engine");
        (admin, q)
    }

    /// Submits and reaps until the queue answers something.
    fn reap_until_answered(q: &mut Queue) -> Vec<Action> {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            q.engine.as_mut().expect("engine").submit().unwrap();
            q.reap();
            if !q.actions.is_empty() {
                return std::mem::take(&mut q.actions);
            }
            assert!(Instant::now() < deadline, "no answer within 10 s");
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    #[test]
    fn reads_and_writes_keep_the_queues_buffers_from_turn_to_turn() {
        use rdmablk_common::nvme::sqe::io_opcode;
        let (sub, _) = subsystem(&["v"]);
        let (_admin, mut q) = io_queue(&sub);
        let block: Vec<u8> = (0..512u32).map(|i| i as u8).collect();
        // Driven as a transport does: a command, then turns of submitting
        // and reaping until the answers come, taken and handed back.
        let turn = |q: &mut Queue, sqe: SubmissionEntry, data: &[u8]| -> Action {
            if let Some(slot) = q.command(sqe, data.len() as u32) {
                q.data_mut(slot, 0, data.len() as u32).copy_from_slice(data);
                q.data_placed(slot, data.len() as u32, true).unwrap();
            }
            let deadline = Instant::now() + Duration::from_secs(10);
            while q.actions.is_empty() {
                assert!(Instant::now() < deadline, "no answer within 10 s");
                q.engine.as_mut().expect("engine").submit().unwrap();
                q.reap();
            }
            let mut batch = q.take_actions();
            assert_eq!(batch.len(), 1, "{batch:?}");
            let a = batch.pop().expect("one");
            q.actions_done(batch);
            a
        };
        for round in 0..3u16 {
            if round > 0 {
                // Both action buffers and the reaped list kept what they
                // grew to: the next answer and completion allocate nothing.
                assert!(q.actions.capacity() > 0 && q.spare_actions.capacity() > 0, "round {round}");
                assert!(q.reaped.capacity() > 0, "round {round}");
            }
            let mut write = SubmissionEntry::new(io_opcode::WRITE, 40 + 2 * round);
            write.nsid = 1;
            write.set_rw(8, 1, false);
            write.set_sgl(Sgl::InCapsule { offset: 0, length: 512 });
            let a = turn(&mut q, write, &block);
            assert!(matches!(a, Action::Respond(c, _) if c.status == Status::SUCCESS), "{a:?}");
            let mut read = SubmissionEntry::new(io_opcode::READ, 41 + 2 * round);
            read.nsid = 1;
            read.set_rw(8, 1, false);
            read.set_sgl(Sgl::Transport { length: 512 });
            match turn(&mut q, read, &[]) {
                Action::SendData { buf: Buf::Chunk(c), len: 512, then, .. } => {
                    assert_eq!(then.status, Status::SUCCESS);
                    assert_eq!(&q.engine.as_ref().expect("engine").bytes(c)[..512], &block[..]);
                    q.sent(c);
                }
                other => panic!("round {round}: {other:?}"),
            }
        }
    }

    #[test]
    fn a_write_that_finds_every_chunk_in_use_asks_for_its_data_only_when_one_frees() {
        use rdmablk_common::nvme::sqe::io_opcode;
        let (sub, _) = subsystem(&["v"]);
        // 64 entries: more than the queue's 32 chunks.
        let (_admin, mut q) = io_queue_sized(&sub, 63);
        assert_eq!(q.sq_entries, 64);
        // Reads take every chunk of the queue (their disk work is queued,
        // not yet submitted).
        for cid in 0..QUEUE_CHUNKS as u16 {
            let mut read = SubmissionEntry::new(io_opcode::READ, 100 + cid);
            read.nsid = 1;
            read.set_rw(cid as u64, 1, false);
            read.set_sgl(Sgl::Transport { length: 512 });
            assert_eq!(q.command(read, 0), None);
        }
        // A write whose data the host sends when asked (R2T): no chunk is
        // free, so it is not asked for, and none is accepted unasked.
        let mut write = SubmissionEntry::new(io_opcode::WRITE, 7);
        write.nsid = 1;
        write.set_rw(900, 1, false);
        write.set_sgl(Sgl::Transport { length: 512 });
        assert_eq!(q.command(write, 0), None);
        assert!(q.actions.is_empty(), "asked for data with every chunk in use: {:?}", q.actions);
        for ttag in 0..64 {
            assert!(q.check_h2c(ttag, 7, 0, 512).is_err(), "data for the waiting write accepted under tag {ttag}");
        }
        // The reads finish; the first chunk sent back goes to the write.
        let mut sent = Vec::new();
        let deadline = Instant::now() + Duration::from_secs(10);
        while sent.len() < QUEUE_CHUNKS as usize {
            assert!(Instant::now() < deadline, "reads unanswered after 10 s: {} of {QUEUE_CHUNKS}", sent.len());
            for a in reap_until_answered(&mut q) {
                match a {
                    Action::SendData { buf: Buf::Chunk(c), then, .. } if then.status == Status::SUCCESS => sent.push(c),
                    other => panic!("a read answered {other:?}"),
                }
            }
        }
        assert!(q.actions.is_empty(), "{:?}", q.actions);
        q.sent(sent.pop().unwrap());
        let ttag = match std::mem::take(&mut q.actions).as_slice() {
            [Action::RequestData { cid: 7, ttag, len: 512 }] => *ttag,
            other => panic!("the write's data was not asked for when a chunk freed: {other:?}"),
        };
        assert!(q.data_chunk(ttag).is_some(), "the write's data goes to the chunk that freed");
        let block = [0x5au8; 512];
        assert_eq!(q.check_h2c(ttag, 7, 0, 512), Ok(ttag));
        q.data_mut(ttag, 0, 512).copy_from_slice(&block);
        q.data_placed(ttag, 512, true).unwrap();
        assert_eq!(status(&reap_until_answered(&mut q)).0, Status::SUCCESS);
        for c in sent {
            q.sent(c);
        }
        let mut read = SubmissionEntry::new(io_opcode::READ, 8);
        read.nsid = 1;
        read.set_rw(900, 1, false);
        read.set_sgl(Sgl::Transport { length: 512 });
        assert_eq!(q.command(read, 0), None);
        match reap_until_answered(&mut q).as_slice() {
            [Action::SendData { buf: Buf::Chunk(c), .. }] => assert_eq!(&q.engine.as_ref().expect("engine").bytes(*c)[..512], &block[..]),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn write_zeroes_and_deallocate_move_the_write_epochs_when_they_start_and_again_when_done() {
        use rdmablk_common::nvme::sqe::{io_opcode, DsmRange, DSM_RANGE_SIZE};
        let (sub, _) = subsystem(&["v"]);
        let (_admin, mut q) = io_queue(&sub);
        let vol = Arc::clone(&q.namespaces()[0].volume);
        // A chunk read ahead while the command runs carries the epoch of
        // its start; only a second move when it is done tells a reader
        // that the chunk may hold the old bytes (`WriteEpochs`).
        let mut zeroes = SubmissionEntry::new(io_opcode::WRITE_ZEROES, 20);
        zeroes.nsid = 1;
        zeroes.set_rw(0, 8, false);
        let mut ranges = [0u8; DSM_RANGE_SIZE];
        DsmRange { attributes: 0, blocks: 8, slba: 16 }.encode(&mut ranges);
        let mut dealloc = SubmissionEntry::new(io_opcode::DATASET_MANAGEMENT, 21);
        dealloc.nsid = 1;
        dealloc.cdw[1] = 1 << 2;
        for (what, sqe, data, at) in [("write zeroes", zeroes, &[][..], 0), ("deallocate", dealloc, &ranges[..], 16 * 512)] {
            let before = vol.writes.of(at, 4096);
            assert!(run(&mut q, sqe, data).is_empty(), "{what}: answered before its disk work");
            let started = vol.writes.of(at, 4096);
            assert_ne!(started, before, "{what}: the epoch moves when it starts");
            assert_eq!(status(&reap_until_answered(&mut q)).0, Status::SUCCESS, "{what}");
            assert_ne!(vol.writes.of(at, 4096), started, "{what}: the epoch moves again when it is done");
        }
    }
}
