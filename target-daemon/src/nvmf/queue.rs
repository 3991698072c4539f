//! One NVMe queue's commands, whatever the transport: the slab (its index
//! is the NVMe/TCP transfer tag and, with the queue's key, the executor
//! tag), the data each command carries in either direction, the Fabrics
//! and admin handlers' answers, and the I/O commands handed to the
//! reactor's executor.
//!
//! The transport hands in decoded capsules, placed data and the
//! executor's news, and takes out [`Action`]s: completions, data to send,
//! data to ask for. It never looks inside a command; this file never
//! touches the wire.
//!
//! An I/O command's disk side is the executor's. A read's pieces come
//! back in chunks and leave as [`Action::SendData`] (the last with the
//! completion); a write's pieces are asked for chunk by chunk
//! ([`Action::RequestData`] when the executor has a chunk for one, so a
//! host's queue depth costs no memory beyond the chunks the executor
//! grants), or copied from the in-capsule data the transport placed in
//! the command's staging buffer. A command's slot and command id are free
//! again as soon as its completion is made; the executor's part may end
//! later (its last chunk leaves with the completion), and the queue
//! counts those parts until they are done ([`Queue::exec_live`]).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use arrayvec::ArrayVec;
use rdmablk_common::nvme::ana::AnaLog;
use rdmablk_common::nvme::cqe::CompletionEntry;
use rdmablk_common::nvme::sqe::{admin_opcode, Sgl, SubmissionEntry};
use rdmablk_common::nvme::status::Status;
use rdmablk_common::protocol::Opcode;

use super::io_cmd::{self, ByteRanges, IoPlan};
use super::{admin_cmd, ana, auth_cmd, fabrics_cmd, CloseReason, Controller, HostView, Namespace, NvmeStats, Subsystem, MAX_HEAP_DATA};
use crate::config::NvmeTransport;
use crate::engine::exec::{self, Accounts, CmdId, Event, Executor, Owner, Request};
use crate::backend::VolumeSet;
use crate::engine::pool::{ChunkId, PoolAccount};
use crate::error::{Error, ErrorKind};
use crate::metrics::ReactorStats;

/// Where data to send lives.
#[derive(Debug)]
pub enum Buf {
    /// A pool chunk (an executor read's piece); the transport gives it
    /// back with `Executor::sent` once it left.
    Chunk(ChunkId),
    /// Zeroes (the `null` backend's reads): sent from the pool's zero
    /// chunk; the chunk that stands for them goes back like any.
    Zero(ChunkId),
    /// Heap memory: admin data.
    Heap(Vec<u8>),
}

/// What the transport must do next.
#[derive(Debug)]
pub enum Action {
    /// Send this completion. The SGL is the answered command's, where it
    /// had one that moved data: NVMe/RDMA invalidates its key with the
    /// completion when the host asked for that ([`Sgl::Keyed`] `invalidate`).
    Respond(CompletionEntry, Option<Sgl>),
    /// Send `len` bytes of `buf` as bytes `off..off + len` of command
    /// `cid`'s data, to where its SGL `to` says (NVMe/RDMA: an RDMA WRITE
    /// to the keyed address plus `off`; NVMe/TCP: C2HData at `off`), then,
    /// when this is the last piece, the completion `then`.
    SendData { cid: u16, buf: Buf, off: u32, len: u32, to: Sgl, then: Option<CompletionEntry> },
    /// Ask the host for bytes `off..off + len` of command `cid`'s data,
    /// tagged `ttag` (the slot: NVMe/RDMA reads them from [`Queue::sgl`]
    /// into [`Queue::fetch_target`]).
    RequestData { cid: u16, ttag: u16, off: u32, len: u32 },
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
    /// A Connect the fence holds: the same host's old association still
    /// has queues (and their disk writes) to finish, or the reactors have
    /// yet to turn twice (`for_turns`, as [`Fence::Wait`] says). Tried
    /// again on each turn of its transport, until `target.fence_timeout`.
    Fence { for_turns: bool },
    /// An authentication command whose Diffie-Hellman computation runs on
    /// the authentication worker (`auth_cmd`): run again on each turn of
    /// its transport (the worker wakes the reactors) until it answers.
    Working,
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

/// A write's piece the executor has a chunk for.
#[derive(Clone, Copy, Debug)]
struct Fetch {
    chunk: ChunkId,
    /// Where the piece lies in the command's data.
    off: u32,
    len: u32,
    /// Bytes of it placed so far.
    received: u32,
}

#[derive(Debug)]
struct Cmd {
    sqe: SubmissionEntry,
    /// Heap data: an admin command's, or an I/O write's in-capsule data
    /// staged until the executor has a chunk for it.
    buf: Option<Vec<u8>>,
    /// Bytes of host data the command carries in its capsule or asks for
    /// into `buf` (admin data), and how many arrived.
    expect: u32,
    received: u32,
    plan: Option<IoPlan>,
    /// Its executor command, until the executor's `Done`.
    exec: Option<CmdId>,
    /// The write piece being fetched (asked for, its data arriving), and
    /// the pieces waiting for their turn (one request per command at a
    /// time, as a host allows one outstanding R2T unless it says more), in
    /// order: no more than the executor lends one command at once, so a
    /// command allocates nothing for them.
    fetch: Option<Fetch>,
    fetch_next: ArrayVec<Fetch, { exec::CHUNK_WINDOW as usize }>,
}

impl Cmd {
    /// Gives every write piece the command holds back to the executor
    /// unwritten: the one being fetched and those waiting their turn. Its
    /// executor command then fails, and ends once nothing else of it is in
    /// flight (a piece kept back would keep it, and its queue, forever).
    fn give_back_pieces(&mut self, exec: &mut Executor) {
        for f in self.fetch.take().into_iter().chain(self.fetch_next.drain(..)) {
            exec.placed(f.chunk, false);
        }
    }
}

/// The queue's place in its association.
pub struct Connected {
    pub qid: u16,
    pub ctrl: Arc<Controller>,
    pub host: HostView,
}

/// A Connect the fence holds, and when it gives up.
#[derive(Debug)]
struct HeldConnect {
    slot: u16,
    deadline: Instant,
    /// The reactors' turn counts when it arrived, one per reactor: it is
    /// decided once each has turned twice since (and so looked at its
    /// sockets: a reset of the old association's connections is seen
    /// before the answer).
    turns: Box<[u64]>,
}

/// What a queue's deadlines ask of its transport ([`Queue::check_deadlines`]).
#[derive(Debug)]
pub enum Due {
    Nothing,
    /// The queue has actions to carry out.
    Flush,
    /// The queue must close.
    Close(CloseReason),
}

/// Where a controller without keep-alive stands for `target.idle_timeout`
/// ([`Queue::idleness`]).
#[derive(Clone, Copy, Debug)]
enum Idleness {
    /// It has I/O queues: not idle; its admin queue looks again later.
    IoQueues,
    /// Idle since then.
    Since(Instant),
}

/// What the fence says of an admin Connect ([`Queue::fence`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fence {
    /// Held: answered later. `for_turns`: the barrier (every reactor
    /// turned twice since the Connect came) had not passed when the fence
    /// looked, so the reactors are woken to turn, the Connect's own too,
    /// for the next try. Otherwise only an old association is busy, and
    /// its end (fence news) or the deadline brings the next try.
    Wait { for_turns: bool },
    /// Nothing of an old association can land any more: go on.
    Go,
    /// `target.fence_timeout` passed with an old association still busy.
    GaveUp,
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
    /// In-band authentication, when the host must (`[[host]] dhchap_key_file`).
    pub auth: Option<Box<auth_cmd::QueueAuth>>,
    pub sq_entries: u32,
    sq_head: u32,
    /// The transport and its key for this queue: executor tags are the
    /// key in the upper 16 bits and the slot below.
    owner: (u8, u16),
    /// The reactor the queue runs on, and its host's pool account there
    /// (the peer's source address, shared by its connections).
    reactor: usize,
    host_account: Option<Arc<PoolAccount>>,
    /// Its reactor's counters (its executor's, taken at its first command:
    /// every count follows one), written by that reactor alone.
    stats: Option<Arc<ReactorStats>>,
    cmds: Vec<Option<Cmd>>,
    free: Vec<u16>,
    by_cid: HashMap<u16, u16>,
    /// Executor commands of this queue not yet done (answered ones too).
    exec_live: u32,
    pub actions: Vec<Action>,
    /// The buffer `actions` is swapped with while the transport carries a
    /// batch out ([`Queue::take_actions`]). Kept with its capacity: a turn
    /// of the per-I/O path allocates nothing.
    spare_actions: Vec<Action>,
    /// Staging buffers of in-capsule writes, kept for reuse.
    spare_bufs: Vec<Vec<u8>>,
    ns_cache: (u64, Vec<Namespace>),
    /// Admin queue: held AERs, changed namespaces not yet read, whether
    /// namespace notices wait for the log to be read, what the host saw.
    pub aers: Vec<u16>,
    pub changed_nsids: Vec<u32>,
    pub aen_masked: bool,
    known: (u64, Vec<(u32, u64, bool)>),
    /// Admin queue: the ANA state it last reported of each namespace, and
    /// when it looks again (while it has a shared namespace).
    ana: ana::Watch,
    ana_due: Option<Instant>,
    pub keep_alive_due: Option<Instant>,
    /// The Connect must come by then (`target.handshake_timeout` after the
    /// queue was accepted).
    pub handshake_due: Instant,
    /// When the last command arrived (or the queue was accepted): for
    /// `target.idle_timeout` of a controller without keep-alive.
    pub last_heard: Instant,
    /// Admin queue: when a look at the deadlines last found its controller
    /// (without keep-alive) busy with I/O queues.
    idle_looked: Instant,
    held_connect: Option<HeldConnect>,
    /// The authentication command waiting for the worker ([`Reply::Working`]).
    held_auth: Option<u16>,
    /// When each command arrived (the transport's turn clock), for the
    /// executor's latency counts.
    pub now: Instant,
}

impl Queue {
    pub fn new(sub: Arc<Subsystem>, transport: NvmeTransport, port: u16, local: SocketAddr, peer: SocketAddr) -> Queue {
        let now = Instant::now();
        let handshake_timeout = sub.cfg.handshake_timeout;
        Queue {
            sub,
            transport,
            port,
            local,
            peer,
            conn: None,
            auth: None,
            sq_entries: 0,
            sq_head: 0,
            owner: (0, 0),
            reactor: 0,
            host_account: None,
            stats: None,
            cmds: Vec::new(),
            free: Vec::new(),
            by_cid: HashMap::new(),
            exec_live: 0,
            actions: Vec::new(),
            spare_actions: Vec::new(),
            spare_bufs: Vec::new(),
            ns_cache: (u64::MAX, Vec::new()),
            aers: Vec::new(),
            changed_nsids: Vec::new(),
            aen_masked: false,
            known: (u64::MAX, Vec::new()),
            ana: ana::Watch::default(),
            ana_due: None,
            keep_alive_due: None,
            handshake_due: now + handshake_timeout,
            last_heard: now,
            idle_looked: now,
            held_connect: None,
            held_auth: None,
            now,
        }
    }

    /// Where the queue runs: on reactor `reactor`, in transport
    /// `transport`, whose key for it is `key` (its executor commands'
    /// owner), its host charged to `host_account`.
    pub fn place(&mut self, reactor: usize, transport: usize, key: u16, host_account: Option<Arc<PoolAccount>>) {
        self.owner = (transport as u8, key);
        self.reactor = reactor;
        self.host_account = host_account;
    }

    /// The slot an executor tag of this queue names.
    pub fn slot_of_tag(tag: u32) -> u16 {
        tag as u16
    }

    /// The queue key an executor tag names.
    pub fn key_of_tag(tag: u32) -> u16 {
        (tag >> 16) as u16
    }

    pub fn qid(&self) -> Option<u16> {
        self.conn.as_ref().map(|c| c.qid)
    }

    pub fn is_admin(&self) -> bool {
        self.qid() == Some(0)
    }

    /// Executor commands of this queue not yet done: the queue may leave
    /// its controller (and free its key) only when there are none.
    pub fn exec_live(&self) -> u32 {
        self.exec_live
    }

    /// Commands that wait for something (not held AERs).
    pub fn busy_commands(&self) -> usize {
        self.cmds.len() - self.free.len() - self.aers.len()
    }

    /// Bytes of in-capsule data this queue accepts.
    pub fn in_capsule_limit(&self) -> u32 {
        match self.qid() {
            Some(q) if q > 0 => super::IO_IN_CAPSULE,
            _ => super::ADMIN_IN_CAPSULE,
        }
    }

    /// The namespaces the connected host sees in the published volume set
    /// (for admin commands and namespace notices).
    pub fn namespaces(&mut self) -> &[Namespace] {
        if self.ns_cache.0 != self.sub.registry.generation() {
            let set = self.sub.registry.volumes();
            self.cache_namespaces(&set);
        }
        &self.ns_cache.1
    }

    /// The namespaces the connected host sees in the executor's snapshot
    /// of the volume set, picked up first if a newer one was published (one
    /// load): what I/O commands are planned against, each namespace's
    /// volume found by its index in that snapshot, as rdmablk v1 finds its
    /// volumes. A command handled in the turn of a reload, before the
    /// reactor's own step picks the new set up, sees the volumes the
    /// executor serves.
    fn io_namespaces(&mut self, exec: &mut Executor) -> &[Namespace] {
        exec.maybe_refresh();
        if self.ns_cache.0 != exec.volume_set().generation {
            let set = Arc::clone(exec.volume_set());
            self.cache_namespaces(&set);
        }
        &self.ns_cache.1
    }

    fn cache_namespaces(&mut self, set: &VolumeSet) {
        let list = match &self.conn {
            Some(c) => super::namespaces(set, &c.host),
            None => Vec::new(),
        };
        self.ns_cache = (set.generation, list);
    }

    fn completion(&mut self, cid: u16, status: Status, result: u64) -> CompletionEntry {
        if !status.is_success() {
            if let Some(s) = &self.stats {
                s.nvme.errors.add(1);
            }
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

    /// Where the data a [`Action::RequestData`] asked for goes: the pool
    /// chunk of the write's piece being fetched, or `None` when it goes
    /// to heap memory (admin data; reach it with [`Queue::data_mut`]).
    pub fn fetch_target(&self, slot: u16) -> Option<ChunkId> {
        self.cmds[slot as usize].as_ref().expect("live command").fetch.map(|f| f.chunk)
    }

    /// Where byte `offset` of command `slot`'s data lies in the chunk of
    /// the piece being fetched ([`Queue::fetch_target`]).
    pub fn fetch_offset(&self, slot: u16, offset: u32) -> usize {
        let f = self.cmds[slot as usize].as_ref().expect("live command").fetch.expect("a piece being fetched");
        (offset - f.off) as usize
    }

    /// A command capsule arrived with `in_capsule` bytes of data to follow.
    /// Returns the slot the in-capsule data goes to; `None` when there is
    /// none to place: the command was answered (its data, if any, is
    /// discarded), runs, or waits for the executor.
    pub fn command(&mut self, exec: &mut Executor, sqe: SubmissionEntry, in_capsule: u32) -> Option<u16> {
        if self.sq_entries > 0 {
            self.sq_head = (self.sq_head + 1) % self.sq_entries;
        }
        self.last_heard = self.now;
        if self.stats.is_none() {
            self.stats = Some(Arc::clone(exec.stats()));
        }
        let cid = sqe.cid;
        if self.conn.as_ref().is_some_and(|c| c.ctrl.is_dead()) {
            // The association was torn down: nothing more of it runs (the
            // transport closes the connection at its next turn).
            return None;
        }
        // An I/O command (planned against the namespaces), not a Fabrics one.
        let io = self.qid().is_some_and(|q| q > 0) && sqe.opcode != admin_opcode::FABRICS;
        let stats = self.stats.as_ref().expect("taken above");
        stats.commands.add(1);
        stats.nvme.commands[NvmeStats::class(io, sqe.opcode)].add(1);
        let is_connect = sqe.opcode == admin_opcode::FABRICS && sqe.fctype() == rdmablk_common::nvme::fabrics::fctype::CONNECT;
        if self.conn.is_none() && !is_connect {
            self.respond(cid, Status::COMMAND_SEQUENCE_ERROR, 0);
            return None;
        }
        if self.auth.as_ref().is_some_and(|a| !a.authenticated) && !auth_cmd::allowed_before_auth(&sqe) {
            self.respond(cid, Status::AUTHENTICATION_REQUIRED, 0);
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
        let direction = data_direction(&sqe);
        let h2c = direction & 0b01 != 0;
        let sgl = match sqe.sgl() {
            Ok(s) => Some(s),
            // A command that moves no data may carry any SGL of no length
            // (Property Get and Set define these bytes as reserved; Linux
            // nvmet accepts it): be liberal in what is accepted.
            Err(_) if direction == 0 && in_capsule == 0 && sgl_bytes_name_no_data(&sqe) => None,
            Err(_) => {
                self.respond(cid, Status::SGL_TYPE_INVALID, 0);
                return None;
            }
        };
        let expect = match sgl {
            None => 0,
            Some(Sgl::InCapsule { offset, length }) => {
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
            Some(s @ (Sgl::Transport { length } | Sgl::Keyed { length, .. }))
                if in_capsule == 0 && matches!(s, Sgl::Keyed { .. }) == (self.transport == NvmeTransport::Rdma) =>
            {
                if h2c {
                    length
                } else {
                    0
                }
            }
            // Any descriptor of no length on a command that moves none.
            Some(s) if direction == 0 && in_capsule == 0 && s.length() == 0 => 0,
            _ => {
                self.respond(cid, Status::SGL_TYPE_INVALID, 0);
                return None;
            }
        };
        // I/O commands are planned (validated) before any data is asked for.
        let mut plan = None;
        if io {
            let (sgl_len, max_transfer) = (sgl.map_or(0, |s| s.length()), self.sub.max_transfer);
            match io_cmd::plan_within(&sqe, self.io_namespaces(exec), sgl_len, max_transfer) {
                Ok(p) => plan = Some(p),
                Err(e) => {
                    self.respond(cid, e.nvme_status(false), 0);
                    return None;
                }
            }
        }
        // A write's data not in the capsule goes to pool chunks piece by
        // piece (up to MDTS, which its plan checked); anything else to heap
        // memory, which stays small whatever MDTS is.
        let writes_by_fetch = plan.as_ref().is_some_and(|p| matches!(p, IoPlan::Write { .. })) && in_capsule == 0;
        if expect > MAX_HEAP_DATA && !writes_by_fetch {
            // Only admin data can get here: in-capsule data stops at
            // IOCCSZ and DSM ranges at 4 KiB.
            self.respond(cid, Status::SGL_DATA_LENGTH_INVALID, 0);
            return None;
        }
        let slot = self.alloc_slot();
        let buf = (expect > 0 && !writes_by_fetch).then(|| {
            let mut v = self.spare_bufs.pop().unwrap_or_default();
            v.clear();
            v.resize(expect as usize, 0);
            v
        });
        let cmd = Cmd { sqe, buf, expect, received: 0, plan, exec: None, fetch: None, fetch_next: ArrayVec::new() };
        self.cmds[slot as usize] = Some(cmd);
        self.by_cid.insert(cid, slot);
        if in_capsule > 0 {
            return Some(slot);
        }
        if expect > 0 && !writes_by_fetch {
            // Admin data the host sends when asked, into heap memory.
            self.actions.push(Action::RequestData { cid, ttag: slot, off: 0, len: expect });
            return None;
        }
        self.execute(exec, slot);
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
            if let Some(b) = c.buf {
                self.spare_bufs.push(b);
            }
        }
        self.free.push(slot);
    }

    /// Where `len` bytes of command `slot`'s data at `offset` go: the
    /// chunk of the write's piece being fetched, or its heap memory. The
    /// caller checked the range ([`Queue::check_h2c`], or the capsule's
    /// length).
    pub fn data_mut<'a>(&'a mut self, exec: &'a mut Executor, slot: u16, offset: u32, len: u32) -> &'a mut [u8] {
        let cmd = self.cmds[slot as usize].as_mut().expect("live command");
        match (&cmd.fetch, &mut cmd.buf) {
            (Some(f), _) => {
                let at = (offset - f.off) as usize;
                &mut exec.bytes_mut(f.chunk)[at..at + len as usize]
            }
            (None, Some(v)) => &mut v[offset as usize..(offset + len) as usize],
            (None, None) => panic!("command without a data buffer"),
        }
    }

    /// Checks an H2CData PDU against the command it names: the transfer
    /// tag, the command id, and the range asked for. Returns the slot.
    pub fn check_h2c(&self, ttag: u16, cccid: u16, offset: u32, len: u32) -> Result<u16, H2cRefusal> {
        let Some(Some(cmd)) = self.cmds.get(ttag as usize) else { return Err(H2cRefusal::UnknownTag) };
        if cmd.sqe.cid != cccid {
            return Err(H2cRefusal::WrongCommand);
        }
        if matches!(cmd.sqe.sgl(), Ok(Sgl::InCapsule { .. })) {
            return Err(H2cRefusal::NotRequested);
        }
        let (start, end, received) = match (&cmd.fetch, &cmd.buf) {
            (Some(f), _) => (f.off, f.off + f.len, f.received),
            // Admin data asked for into heap memory.
            (None, Some(_)) if cmd.received < cmd.expect => (0, cmd.expect, cmd.received),
            // A write whose next piece waits for a chunk has not asked.
            _ => return Err(H2cRefusal::NotRequested),
        };
        if offset != start + received || offset as u64 + len as u64 > end as u64 {
            return Err(H2cRefusal::OutOfRange);
        }
        Ok(ttag)
    }

    /// `len` more bytes of command `slot`'s data were placed; `last`: the
    /// host says they were the last of what was asked for (in-capsule data
    /// arrives whole). Moves the command on once all arrived.
    pub fn data_placed(&mut self, exec: &mut Executor, slot: u16, len: u32, last: bool) -> Result<(), &'static str> {
        let cmd = self.cmds[slot as usize].as_mut().expect("live command");
        if let Some(f) = cmd.fetch.as_mut() {
            f.received += len;
            let done = f.received == f.len;
            if last != done {
                return Err(if last { "LAST_PDU before all data arrived" } else { "all data arrived without LAST_PDU" });
            }
            if done {
                let chunk = f.chunk;
                cmd.fetch = None;
                exec.placed(chunk, true);
                self.next_fetch(slot);
            }
            return Ok(());
        }
        cmd.received += len;
        let done = cmd.received == cmd.expect;
        if last != done {
            return Err(if last { "LAST_PDU before all data arrived" } else { "all data arrived without LAST_PDU" });
        }
        if done {
            self.execute(exec, slot);
        }
        Ok(())
    }

    /// The data of the write's piece being fetched could not be had (an
    /// RDMA READ failed): the command fails, every piece it holds given back.
    pub fn fetch_failed(&mut self, exec: &mut Executor, slot: u16) {
        let Some(cmd) = self.cmds.get_mut(slot as usize).and_then(|c| c.as_mut()) else { return };
        cmd.give_back_pieces(exec);
    }

    /// A command's data digest was wrong: its data is thrown away and the
    /// command fails with Transient Transport Error, which the host retries
    /// (the connection goes on, as with SPDK's target and Linux nvmet).
    pub fn data_corrupt(&mut self, exec: &mut Executor, slot: u16) {
        let cmd = self.cmds[slot as usize].as_mut().expect("live command");
        if let Some(id) = cmd.exec {
            // Its pieces go back unwritten; the executor drops the rest.
            cmd.give_back_pieces(exec);
            exec.abandon(id);
        }
        self.respond_slot(slot, Status::TRANSIENT_TRANSPORT_ERROR, 0);
    }

    /// Asks for the next piece of command `slot`'s data, if one waits.
    fn next_fetch(&mut self, slot: u16) {
        let cmd = self.cmds[slot as usize].as_mut().expect("live command");
        if cmd.fetch.is_some() {
            return;
        }
        if cmd.fetch_next.is_empty() {
            return;
        }
        let f = cmd.fetch_next.remove(0);
        cmd.fetch = Some(f);
        let cid = cmd.sqe.cid;
        self.actions.push(Action::RequestData { cid, ttag: slot, off: f.off, len: f.len });
    }

    /// Runs a command whose data (if any) has arrived.
    fn execute(&mut self, exec: &mut Executor, slot: u16) {
        let cmd = self.cmds[slot as usize].as_mut().expect("live command");
        let sqe = cmd.sqe;
        if cmd.plan.is_some() {
            self.submit_io(exec, slot);
            return;
        }
        let data = cmd.buf.as_deref().unwrap_or(&[]).to_vec();
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
            Reply::Fence { for_turns } => self.hold_connect(slot, for_turns),
            Reply::Working => self.held_auth = Some(slot),
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
                self.actions.push(Action::SendData { cid, buf: Buf::Heap(data), off: 0, len, to, then: Some(then) });
            }
        }
    }

    /// Answers a held command (an AER) now.
    pub fn answer_held(&mut self, cid: u16, status: Status, result: u64) {
        if let Some(slot) = self.by_cid.get(&cid).copied() {
            self.respond_slot(slot, status, result);
        }
    }

    // ---------------------------------------------------------------- the fence

    /// Holds the Connect in `slot` until the fence lets it through: its
    /// deadline and barrier are those of its first try. `for_turns`: the
    /// fence waits for the barrier, so every reactor is woken to turn (and
    /// so look at its sockets), this one too, to try it again. That is
    /// the fence's look, not a second one here: the reactors may have
    /// turned in between, and a hold that then woke nobody would leave the
    /// Connect unanswered until a deadline.
    fn hold_connect(&mut self, slot: u16, for_turns: bool) {
        if self.held_connect.is_none() {
            let turns = self.sub.registry.turns().collect();
            self.held_connect = Some(HeldConnect { slot, deadline: Instant::now() + self.sub.cfg.fence_timeout, turns });
        }
        if for_turns {
            self.sub.registry.wake_reactors();
        }
    }

    /// Whether every reactor turned twice since the Connect came: each has
    /// then handled what its sockets had before (an old connection's
    /// reset among it).
    fn barrier_passed(&self, h: &HeldConnect) -> bool {
        self.sub.registry.turns().zip(h.turns.iter()).all(|(now, &then)| now >= then + 2)
    }

    /// The deadline of a Connect the fence holds, or of an authentication
    /// command held for the worker (the queue's authentication deadline):
    /// the transport tries either again each turn ([`Queue::retry_connect`]).
    pub fn connect_deadline(&self) -> Option<Instant> {
        let auth = self.held_auth.and(self.auth.as_ref()).map(|a| a.due);
        [self.held_connect.as_ref().map(|h| h.deadline), auth].into_iter().flatten().min()
    }

    /// Tries a held Connect again (each turn of the transport): answered
    /// now, or held on (true).
    pub fn retry_connect(&mut self, exec: &mut Executor) -> bool {
        if let Some(slot) = self.held_auth.take() {
            // Held again (`Reply::Working`) while the worker is not done.
            self.execute(exec, slot);
        }
        let Some(slot) = self.held_connect.as_ref().map(|h| h.slot) else { return self.held_auth.is_some() };
        self.execute(exec, slot);
        if self.cmds[slot as usize].is_none() {
            self.held_connect = None;
        }
        self.held_connect.is_some() || self.held_auth.is_some()
    }

    /// The fence, for an admin Connect of `host_nqn`: whether it must wait,
    /// may go on, or waited in vain (the deadline passed with an old
    /// association still busy). It waits while a torn-down controller of
    /// the host still has queues (and so possibly disk writes) left. When
    /// the host has other controllers that are not torn down, it also
    /// waits until every reactor has turned twice: a reset of an old
    /// association's connections that came before this Connect is then
    /// seen, and its controller torn down, before the answer. (A host may
    /// also keep several live controllers, one per path: those stay.)
    pub fn fence(&self, host_nqn: &str) -> Fence {
        let (live, busy) = self.sub.controllers_of(host_nqn);
        // A first look: the barrier starts with the hold.
        let Some(h) = &self.held_connect else { return if live > 0 || busy { Fence::Wait { for_turns: true } } else { Fence::Go } };
        let before_deadline = Instant::now() < h.deadline;
        match (self.barrier_passed(h), busy) {
            (false, _) if before_deadline => Fence::Wait { for_turns: true },
            (_, false) => Fence::Go,
            (_, true) if before_deadline => Fence::Wait { for_turns: false },
            (_, true) => Fence::GaveUp,
        }
    }

    // ---------------------------------------------------------------- I/O

    /// Hands an I/O command to the executor.
    fn submit_io(&mut self, exec: &mut Executor, slot: u16) {
        let cmd = self.cmds[slot as usize].as_mut().expect("live command");
        let mut plan = cmd.plan.clone().expect("planned");
        if plan.namespace().generation != exec.volume_set().generation {
            // The executor took a newer volume set since the command was
            // planned (its data came in a later turn): planned again, as if
            // it came now, against the namespaces of that set.
            let (sqe, sgl_len, max_transfer) = (cmd.sqe, cmd.sqe.sgl().map_or(0, |s| s.length()), self.sub.max_transfer);
            match io_cmd::plan_within(&sqe, self.io_namespaces(exec), sgl_len, max_transfer) {
                Ok(p) => plan = p,
                Err(e) => return self.respond_slot(slot, e.nvme_status(false), 0),
            }
            self.cmds[slot as usize].as_mut().expect("live command").plan = Some(plan.clone());
        }
        let cmd = self.cmds[slot as usize].as_ref().expect("live command");
        let ns = plan.namespace();
        // A volume the executor could not take (no fixed-file slot) has
        // none; one whose descriptor failed ends its command InternalError.
        let Some(vslot) = exec.slot_of_index(ns.index) else {
            tracing::error!("nvme queue {:?}: namespace {}: its volume is not served by this reactor", self.qid(), ns.nsid);
            return self.respond_slot(slot, Status::INTERNAL_ERROR, 0);
        };
        let (op, offset, len, metric) = match &plan {
            IoPlan::Read { offset, len, .. } => (exec::Op::Read, *offset, *len, Opcode::Read),
            IoPlan::Write { offset, len, fua, .. } => (exec::Op::Write { fua: *fua }, *offset, *len, Opcode::Write),
            IoPlan::Flush { .. } => (exec::Op::Flush, 0, 0, Opcode::Flush),
            IoPlan::Range { op, ranges, .. } => (exec::Op::Range { op: *op, ranges: ranges.clone() }, 0, 0, Opcode::WriteZeroes),
            IoPlan::Deallocate { op, ranges: count, .. } => {
                let ranges = match &cmd.buf {
                    Some(v) => io_cmd::dsm_ranges(v, *count, ns),
                    None => Err(Error::new(ErrorKind::Internal, "DSM ranges not in heap memory")),
                };
                match ranges {
                    Err(e) => return self.respond_slot(slot, e.nvme_status(false), 0),
                    Ok(r) if r.is_empty() => return self.respond_slot(slot, Status::SUCCESS, 0),
                    Ok(r) => (exec::Op::Range { op: *op, ranges: ByteRanges::Many(r) }, 0, 0, Opcode::Discard),
                }
            }
        };
        let req = Request {
            op,
            vslot,
            offset,
            len,
            metric: crate::metrics::op_index(metric).map(|i| i as u8),
            start: self.now,
            timed: crate::metrics::clock_is_cheap(),
            accounts: self.accounts(),
            hold_key: None,
        };
        let owner = Owner { transport: self.owner.0, tag: (self.owner.1 as u32) << 16 | slot as u32 };
        match exec.submit(owner, req) {
            Some(id) => {
                self.exec_live += 1;
                self.cmds[slot as usize].as_mut().expect("live command").exec = Some(id);
            }
            None => self.respond_slot(slot, Status::INTERNAL_ERROR, 0),
        }
    }

    /// The pool accounts this queue's commands are charged to: its
    /// controller's (as a v1 session's) and its host's (the peer's address).
    fn accounts(&self) -> Accounts {
        let controller = self.conn.as_ref().and_then(|c| c.ctrl.pool_account(self.reactor)).cloned();
        [controller, self.host_account.clone()]
    }

    /// The executor's news of one of this queue's commands (tag's slot).
    pub fn exec_event(&mut self, exec: &mut Executor, slot: u16, id: CmdId, ev: Event) {
        let live = self.cmds.get(slot as usize).and_then(|c| c.as_ref()).is_some_and(|c| c.exec == Some(id));
        if !live {
            // The command was answered (a read with its last piece) or
            // given up with its connection: give back what it lends.
            match ev {
                Event::Read { chunk, .. } | Event::Buffer { chunk } => exec.sent(chunk),
                Event::Fetch { chunk, .. } => exec.placed(chunk, false),
                Event::Done { .. } => self.exec_live -= 1,
            }
            return;
        }
        match ev {
            Event::Read { chunk, off, len, zero, last } => {
                let cmd = self.cmds[slot as usize].as_ref().expect("live command");
                let (cid, to) = (cmd.sqe.cid, cmd.sqe.sgl().expect("checked on arrival"));
                let total = cmd.plan.as_ref().map_or(0, |p| if let IoPlan::Read { len, .. } = p { *len } else { 0 });
                let buf = if zero { Buf::Zero(chunk) } else { Buf::Chunk(chunk) };
                let then = if last {
                    if let Some(s) = &self.stats {
                        s.nvme.bytes_read.add(total as u64);
                    }
                    Some(self.completion(cid, Status::SUCCESS, 0))
                } else {
                    None
                };
                if then.is_some() {
                    // Answered: the slot and command id are free again;
                    // the executor's part ends when this chunk is back.
                    self.release_slot(slot);
                }
                self.actions.push(Action::SendData { cid, buf, off, len, to, then });
            }
            Event::Fetch { chunk, off, len } => {
                let cmd = self.cmds[slot as usize].as_mut().expect("live command");
                if let Some(staged) = &cmd.buf {
                    // In-capsule data, staged: copied into the chunk.
                    exec.bytes_mut(chunk)[..len as usize].copy_from_slice(&staged[off as usize..(off + len) as usize]);
                    exec.placed(chunk, true);
                    return;
                }
                if let Err(full) = cmd.fetch_next.try_push(Fetch { chunk, off, len, received: 0 }) {
                    // Never: the executor lends a command at most CHUNK_WINDOW chunks.
                    tracing::error!("nvme queue {:?}: more write pieces at once than the executor lends", self.qid());
                    exec.placed(full.element().chunk, false);
                    return;
                }
                self.next_fetch(slot);
            }
            Event::Buffer { chunk } => exec.sent(chunk),
            Event::Done { result, .. } => {
                self.exec_live -= 1;
                let cmd = self.cmds[slot as usize].as_mut().expect("live command");
                cmd.exec = None;
                let plan = cmd.plan.clone().expect("an I/O command");
                let status = match result {
                    Ok(()) => {
                        if let IoPlan::Write { len, .. } = plan {
                            if let Some(s) = &self.stats {
                                s.nvme.bytes_written.add(len as u64);
                            }
                        }
                        Status::SUCCESS
                    }
                    Err(k) => {
                        let reading = matches!(plan, IoPlan::Read { .. });
                        if let ErrorKind::DeviceIo(errno) = k {
                            tracing::warn!(
                                host = self.conn.as_ref().map(|c| tracing::field::display(&c.ctrl.host_nqn)),
                                peer = %self.peer,
                                queue = self.qid(),
                                nsid = plan.nsid(),
                                "nvme {} failed: errno {errno}",
                                plan.name()
                            );
                        }
                        Error::new(k, "").nvme_status(reading)
                    }
                };
                self.respond_slot(slot, status, 0);
            }
        }
    }

    // ---------------------------------------------------------------- deadlines

    /// The earliest deadline of an open queue (a closing one's is its
    /// transport's): the Connect's, a held Connect's, the keep-alive's or,
    /// for a controller without keep-alive, `target.idle_timeout`'s.
    pub fn deadline(&self) -> Option<Instant> {
        let mut earliest = self.connect_deadline();
        let mut min = |t: Instant| earliest = Some(earliest.map_or(t, |e: Instant| e.min(t)));
        if self.conn.is_none() {
            min(self.handshake_due);
        }
        if let Some(a) = self.auth.as_ref().filter(|a| !a.authenticated) {
            min(a.due);
        }
        if self.is_admin() {
            if let Some(due) = self.ana_due {
                min(due);
            }
            if let Some(due) = self.keep_alive_due {
                min(due);
            } else {
                match self.idleness() {
                    // A look again: no later than the controller could have
                    // been idle that long, however soon its last I/O queue
                    // leaves (the look that found it busy came before).
                    Some(Idleness::IoQueues) => min(self.last_heard.max(self.idle_looked) + self.sub.cfg.idle_timeout),
                    Some(Idleness::Since(since)) => min(since + self.sub.cfg.idle_timeout),
                    None => {}
                }
            }
        }
        earliest
    }

    /// Where the controller stands for `target.idle_timeout`, if it
    /// applies to it (an admin queue whose controller has no keep-alive,
    /// KATO 0, and nothing in flight, held AERs aside): busy with I/O
    /// queues, or idle since its last command or its last I/O queue's
    /// leaving, whichever came later. Two loads, no lock: the queue's
    /// transport computes its deadline from it whenever it looks, and
    /// nobody tells it when the last I/O queue leaves.
    fn idleness(&self) -> Option<Idleness> {
        let conn = self.conn.as_ref()?;
        if conn.qid != 0 || self.keep_alive_due.is_some() || self.busy_commands() != 0 || self.exec_live != 0 {
            return None;
        }
        if conn.ctrl.io_queues() != 0 {
            return Some(Idleness::IoQueues);
        }
        Some(Idleness::Since(conn.ctrl.last_io_left().map_or(self.last_heard, |left| left.max(self.last_heard))))
    }

    /// The check of an open queue's deadlines at `now` (`stopping`: the
    /// target is stopping): what its transport must do about them. A
    /// keep-alive's expiry or a namespace notice comes as actions
    /// ([`Due::Flush`]); a missed Connect or an idle controller closes the
    /// queue, the idle one's controller torn down first.
    pub fn check_deadlines(&mut self, now: Instant, stopping: bool) -> Due {
        if self.conn.is_none() && (stopping || now >= self.handshake_due) {
            if stopping {
                return Due::Close(CloseReason::fault("the target is stopping"));
            }
            self.sub.registry.counters.handshakes_timed_out.fetch_add(1, Ordering::Relaxed);
            return Due::Close(CloseReason::fault(format!(
                "no Connect within {:?} (target.handshake_timeout)",
                self.sub.cfg.handshake_timeout
            )));
        }
        if self.auth.as_ref().is_some_and(|a| !a.authenticated && now >= a.due) {
            return Due::Close(CloseReason::fault(auth_cmd::timed_out(self)));
        }
        if self.connect_deadline().is_some_and(|d| now >= d) {
            return Due::Flush;
        }
        if !self.is_admin() {
            return Due::Nothing;
        }
        self.tick(now);
        if !self.actions.is_empty() {
            return Due::Flush;
        }
        let since = match self.idleness() {
            None => return Due::Nothing,
            Some(Idleness::IoQueues) => {
                self.idle_looked = now;
                return Due::Nothing;
            }
            Some(Idleness::Since(since)) => since,
        };
        let quiet = now.saturating_duration_since(since);
        if quiet >= self.sub.cfg.idle_timeout {
            let ctrl = Arc::clone(&self.conn.as_ref().expect("an admin queue is connected").ctrl);
            NvmeStats::add(&self.sub.stats.idle_timeouts, 1);
            let why = CloseReason::fault(format!("idle: KATO 0, no I/O queue and no command for {quiet:?} (target.idle_timeout)"));
            ctrl.tear_down(&self.sub, &why);
            return Due::Close(why);
        }
        Due::Nothing
    }

    // ---------------------------------------------------------------- admin queue

    /// The published volume set changed: an admin queue looks at its
    /// namespaces now (true: it may have notices to send).
    pub fn volumes_changed(&mut self, now: Instant) -> bool {
        if !self.is_admin() {
            return false;
        }
        self.tick(now);
        true
    }

    /// Admin queue, at each check: keep-alive expiry and namespace changes.
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
                ctrl.tear_down(&self.sub, &CloseReason::fault(format!("no keep-alive within {kato} ms")));
                self.actions.push(Action::Close(CloseReason::fault("keep-alive timeout")));
                return;
            }
        }
        self.watch_namespaces();
        self.watch_ana(now);
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

    /// Compares the namespaces' ANA states with what the host was told
    /// and raises an ANA change notice for a difference; looks again in
    /// [`ana::POLL`] while a namespace's access may move.
    fn watch_ana(&mut self, now: Instant) {
        if !self.look_ana(now) {
            return;
        }
        let cntlid = self.conn.as_ref().map_or(0, |c| c.ctrl.id);
        let states: Vec<String> = self.ana.log().groups.iter().map(|g| format!("{:?} {}", g.nsids, g.state.name())).collect();
        tracing::info!("nvme controller {cntlid}: ANA states changed: {}", states.join(", "));
        self.send_events();
    }

    /// The ANA log page as of now, for Get Log Page (`retain`: Retain
    /// Asynchronous Event): a change the host reads here needs no notice.
    pub fn ana_log(&mut self, retain: bool) -> AnaLog {
        self.look_ana(self.now);
        self.ana.read(retain);
        self.ana.log()
    }

    /// Takes the namespaces' ANA states into the watch (true: a notice is
    /// due) and sets when to look again.
    fn look_ana(&mut self, now: Instant) -> bool {
        let nss = self.namespaces();
        let shared = nss.iter().any(ana::shared);
        let views = ana::views(nss);
        self.ana_due = shared.then(|| now + ana::POLL);
        self.ana.update(views)
    }

    /// Completes held AERs for pending notices the host enabled: the
    /// namespace attribute notice, then the ANA change notice.
    pub fn send_events(&mut self) {
        let Some(conn) = &self.conn else { return };
        let enabled = conn.ctrl.state.lock().unwrap_or_else(|e| e.into_inner()).aen_config;
        if enabled & super::identify::AEN_NS_ATTR != 0 && !self.aen_masked && !self.changed_nsids.is_empty() {
            let Some(cid) = self.aers.pop() else { return };
            self.aen_masked = true;
            // Event type 2 (notice), information 0 (namespace attribute
            // changed), log page 0x04 (changed namespace list).
            self.answer_held(cid, Status::SUCCESS, 0x0004_0002);
        }
        if enabled & super::identify::AEN_ANA_CHANGE != 0 && self.ana.notice_due() {
            let Some(cid) = self.aers.pop() else { return };
            self.ana.notice_sent();
            // Event type 2 (notice), information 3 (ANA change), log page
            // 0x0c (asymmetric namespace access).
            self.answer_held(cid, Status::SUCCESS, 0x000c_0302);
        }
    }

    // ---------------------------------------------------------------- closing

    /// The connection is gone (the transport stopped using it): every
    /// command is dropped, and what waits for the executor is abandoned
    /// there (what reached the disk runs to its end). The queue leaves its
    /// controller with [`Queue::leave`] once [`Queue::exec_live`] is 0.
    pub fn drop_commands(&mut self, exec: &mut Executor) {
        for slot in 0..self.cmds.len() as u16 {
            let Some(cmd) = self.cmds[slot as usize].as_mut() else { continue };
            cmd.give_back_pieces(exec);
            if let Some(id) = cmd.exec {
                exec.abandon(id);
            }
            self.release_slot(slot);
        }
        self.aers.clear();
        self.held_connect = None;
        self.held_auth = None;
    }

    /// Leaves the controller (after [`Queue::drop_commands`] and once no
    /// executor command of the queue is left): the admin queue leaving
    /// ends the association; the controller is forgotten with its last
    /// queue, which lets a fence waiting for it go on.
    pub fn leave(&mut self, why: &CloseReason) {
        debug_assert_eq!(self.exec_live, 0, "a queue leaves with executor commands in flight");
        let Some(conn) = self.conn.take() else {
            tracing::debug!("{} {}: closed before Connect: {why}", self.transport.scheme(), self.peer);
            return;
        };
        self.sub.stats.queues.fetch_sub(1, Ordering::Relaxed);
        let ctrl = conn.ctrl;
        if conn.qid == 0 {
            ctrl.tear_down(&self.sub, &why.map(|w| format!("admin queue closed: {w}")));
        } else {
            // Its admin queue, on whatever reactor, finds out without a
            // word when it looks at its deadline (`Queue::deadline`).
            ctrl.remove_queue(conn.qid);
            tracing::debug!("nvme controller {} queue {} closed: {why}", ctrl.id, conn.qid);
        }
        if ctrl.live_queues.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.sub.remove_controller(ctrl.id);
            tracing::info!(host = %ctrl.host_nqn, controller = ctrl.id, "nvme controller {} is gone", ctrl.id);
        }
    }
}

/// Whether a command's SGL (bytes 24..40) names no data: its length field
/// (bytes 8..12 of the descriptor, whatever its type) is 0, as when the
/// bytes are all zero. Linux nvmet maps no data for such a descriptor.
fn sgl_bytes_name_no_data(sqe: &SubmissionEntry) -> bool {
    sqe.dptr[8..12] == [0; 4]
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
    use crate::registry::Registry;
    /// The executor's chunk size in these tests.
    const CHUNK_SIZE: usize = 128 << 10;

    const HOST: &str = "nqn.2014-08.org.example:host";

    fn subsystem(volumes: &[&str]) -> (Arc<Subsystem>, Config) {
        subsystem_on(volumes, 1)
    }

    /// [`subsystem`] on a registry of `reactors` reactors.
    fn subsystem_on(volumes: &[&str], reactors: usize) -> (Arc<Subsystem>, Config) {
        let mut text = "[target]\nname = \"t\"\nlisten = [\"nvme+tcp://127.0.0.1:0\"]\n".to_owned();
        for v in volumes {
            text += &format!("[[volume]]\nname = \"{v}\"\nbackend = \"memory\"\nsize = \"1MiB\"\nblock_size = 512\nallow_any_host = true\n");
        }
        let config = Config::parse(&text, "test").unwrap();
        let set = VolumeSet::new(1, open_volumes(&config).unwrap()).with_access(Arc::new(AccessPolicy::load(&config).unwrap()));
        let registry = Arc::new(Registry::new(set, reactors));
        (Arc::new(Subsystem::new(&config.target, registry)), config)
    }

    fn queue(sub: &Arc<Subsystem>) -> Queue {
        let a = "127.0.0.1:4420".parse().unwrap();
        let mut q = Queue::new(Arc::clone(sub), NvmeTransport::Tcp, 1, a, a);
        q.place(0, 1, 7, None);
        q
    }

    /// An executor of 32 chunks of 128 KiB for the queues of `sub`.
    fn executor(sub: &Arc<Subsystem>) -> Executor {
        Executor::standalone(Arc::clone(sub.registry.publication()), 32 * CHUNK_SIZE, CHUNK_SIZE).unwrap()
    }

    thread_local! {
        /// The executor of tests that run only admin commands.
        static ADMIN_EXEC: std::cell::RefCell<Option<Executor>> = const { std::cell::RefCell::new(None) };
    }

    /// Runs one command (with its data, if any) and returns what it answered.
    fn run(q: &mut Queue, sqe: SubmissionEntry, data: &[u8]) -> Vec<Action> {
        ADMIN_EXEC.with_borrow_mut(|e| {
            let exec = e.get_or_insert_with(|| executor(&q.sub));
            run_on(q, exec, sqe, data)
        })
    }

    /// [`run`] on a given executor.
    fn run_on(q: &mut Queue, exec: &mut Executor, mut sqe: SubmissionEntry, data: &[u8]) -> Vec<Action> {
        if !data.is_empty() {
            sqe.set_sgl(Sgl::InCapsule { offset: 0, length: data.len() as u32 });
        }
        if let Some(slot) = q.command(exec, sqe, data.len() as u32) {
            q.data_mut(exec, slot, 0, data.len() as u32).copy_from_slice(data);
            q.data_placed(exec, slot, data.len() as u32, true).unwrap();
        }
        std::mem::take(&mut q.actions)
    }

    /// Hands the executor's news to the queue (as the reactor does).
    fn dispatch(q: &mut Queue, exec: &mut Executor) {
        while let Some((owner, id, ev)) = exec.pop_event() {
            q.exec_event(exec, Queue::slot_of_tag(owner.tag), id, ev);
        }
    }

    fn status(actions: &[Action]) -> (Status, u64) {
        match actions.last() {
            Some(Action::Respond(c, _)) => (c.status, c.result),
            Some(Action::SendData { then: Some(then), .. }) => (then.status, then.result),
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
        assert_eq!(c[77], 8, "MDTS: the default max_io_size, 1 MiB in 4 KiB pages");
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
        sub.registry.publish(set);
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
        let (c, mut d) = admin_connect_of(&sub);
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
        assert_eq!(connect_queue_sized(&mut q, &sub.nqn.clone(), 1, cntlid, 0, sqsize).0, Status::SUCCESS);
        (admin, q)
    }

    /// Submits, reaps and hands the news to the queue until it answers something.
    fn reap_until_answered(q: &mut Queue, exec: &mut Executor) -> Vec<Action> {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            exec.engine_mut().submit().unwrap();
            exec.reap();
            exec.pump_waitq();
            dispatch(q, exec);
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
        let mut exec = executor(&sub);
        let block: Vec<u8> = (0..512u32).map(|i| i as u8).collect();
        // Driven as a transport does: a command, then turns of submitting
        // and reaping until the answers come, taken and handed back.
        let turn = |q: &mut Queue, exec: &mut Executor, sqe: SubmissionEntry, data: &[u8]| -> Action {
            if let Some(slot) = q.command(exec, sqe, data.len() as u32) {
                q.data_mut(exec, slot, 0, data.len() as u32).copy_from_slice(data);
                q.data_placed(exec, slot, data.len() as u32, true).unwrap();
            }
            let deadline = Instant::now() + Duration::from_secs(10);
            while q.actions.is_empty() {
                assert!(Instant::now() < deadline, "no answer within 10 s");
                exec.engine_mut().submit().unwrap();
                exec.reap();
                dispatch(q, exec);
            }
            let mut batch = q.take_actions();
            assert_eq!(batch.len(), 1, "{batch:?}");
            let a = batch.pop().expect("one");
            q.actions_done(batch);
            a
        };
        for round in 0..3u16 {
            if round > 0 {
                // Both action buffers kept what they grew to: the next
                // answer allocates nothing.
                assert!(q.actions.capacity() > 0 && q.spare_actions.capacity() > 0, "round {round}");
                assert!(!q.spare_bufs.is_empty(), "round {round}: the in-capsule staging buffer is kept");
            }
            let mut write = SubmissionEntry::new(io_opcode::WRITE, 40 + 2 * round);
            write.nsid = 1;
            write.set_rw(8, 1, false);
            write.set_sgl(Sgl::InCapsule { offset: 0, length: 512 });
            let a = turn(&mut q, &mut exec, write, &block);
            assert!(matches!(a, Action::Respond(c, _) if c.status == Status::SUCCESS), "{a:?}");
            let mut read = SubmissionEntry::new(io_opcode::READ, 41 + 2 * round);
            read.nsid = 1;
            read.set_rw(8, 1, false);
            read.set_sgl(Sgl::Transport { length: 512 });
            match turn(&mut q, &mut exec, read, &[]) {
                Action::SendData { buf: Buf::Chunk(c), off: 0, len: 512, then: Some(then), .. } => {
                    assert_eq!(then.status, Status::SUCCESS);
                    assert_eq!(&exec.bytes(c)[..512], &block[..]);
                    exec.sent(c);
                    dispatch(&mut q, &mut exec);
                }
                other => panic!("round {round}: {other:?}"),
            }
            assert_eq!(q.exec_live(), 0, "round {round}: the read's executor part ended with its chunk");
        }
    }

    #[test]
    fn a_write_that_finds_every_chunk_in_use_asks_for_its_data_only_when_one_frees() {
        use rdmablk_common::nvme::sqe::io_opcode;
        const CHUNKS: u16 = 32;
        let (sub, _) = subsystem(&["v"]);
        // 64 entries: more than the executor's 32 chunks.
        let (_admin, mut q) = io_queue_sized(&sub, 63);
        let mut exec = executor(&sub);
        assert_eq!(q.sq_entries, 64);
        // Reads take every chunk the queue's controller may hold, its fair
        // share as the only holder: half of them (their disk work is
        // queued, not yet submitted).
        const HELD: u16 = CHUNKS / 2;
        for cid in 0..HELD {
            let mut read = SubmissionEntry::new(io_opcode::READ, 100 + cid);
            read.nsid = 1;
            read.set_rw(cid as u64, 1, false);
            read.set_sgl(Sgl::Transport { length: 512 });
            assert_eq!(q.command(&mut exec, read, 0), None);
        }
        // A write whose data the host sends when asked (R2T): no chunk is
        // free to it, so it is not asked for, and none is accepted unasked.
        let mut write = SubmissionEntry::new(io_opcode::WRITE, 7);
        write.nsid = 1;
        write.set_rw(900, 1, false);
        write.set_sgl(Sgl::Transport { length: 512 });
        assert_eq!(q.command(&mut exec, write, 0), None);
        dispatch(&mut q, &mut exec);
        assert!(q.actions.is_empty(), "asked for data with every chunk in use: {:?}", q.actions);
        for ttag in 0..64 {
            assert!(q.check_h2c(ttag, 7, 0, 512).is_err(), "data for the waiting write accepted under tag {ttag}");
        }
        // The reads finish; the first chunk sent back goes to the write.
        let mut sent = Vec::new();
        let deadline = Instant::now() + Duration::from_secs(10);
        while sent.len() < HELD as usize {
            assert!(Instant::now() < deadline, "reads unanswered after 10 s: {} of {HELD}", sent.len());
            for a in reap_until_answered(&mut q, &mut exec) {
                match a {
                    Action::SendData { buf: Buf::Chunk(c), then: Some(then), .. } if then.status == Status::SUCCESS => sent.push(c),
                    other => panic!("a read answered {other:?}"),
                }
            }
        }
        assert!(q.actions.is_empty(), "{:?}", q.actions);
        exec.sent(sent.pop().unwrap());
        exec.pump_waitq();
        dispatch(&mut q, &mut exec);
        let ttag = match std::mem::take(&mut q.actions).as_slice() {
            [Action::RequestData { cid: 7, ttag, off: 0, len: 512 }] => *ttag,
            other => panic!("the write's data was not asked for when a chunk freed: {other:?}"),
        };
        assert!(q.fetch_target(ttag).is_some(), "the write's data goes to the chunk that freed");
        let block = [0x5au8; 512];
        assert_eq!(q.check_h2c(ttag, 7, 0, 512), Ok(ttag));
        q.data_mut(&mut exec, ttag, 0, 512).copy_from_slice(&block);
        q.data_placed(&mut exec, ttag, 512, true).unwrap();
        assert_eq!(status(&reap_until_answered(&mut q, &mut exec)).0, Status::SUCCESS);
        for c in sent {
            exec.sent(c);
        }
        dispatch(&mut q, &mut exec);
        let mut read = SubmissionEntry::new(io_opcode::READ, 8);
        read.nsid = 1;
        read.set_rw(900, 1, false);
        read.set_sgl(Sgl::Transport { length: 512 });
        assert_eq!(q.command(&mut exec, read, 0), None);
        match reap_until_answered(&mut q, &mut exec).as_slice() {
            [Action::SendData { buf: Buf::Chunk(c), .. }] => assert_eq!(&exec.bytes(*c)[..512], &block[..]),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn write_zeroes_and_deallocate_move_the_write_epochs_when_they_start_and_again_when_done() {
        use rdmablk_common::nvme::sqe::{io_opcode, DsmRange, DSM_RANGE_SIZE};
        let (sub, _) = subsystem(&["v"]);
        let (_admin, mut q) = io_queue(&sub);
        let mut exec = executor(&sub);
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
            assert!(run_on(&mut q, &mut exec, sqe, data).is_empty(), "{what}: answered before its disk work");
            let started = vol.writes.of(at, 4096);
            assert_ne!(started, before, "{what}: the epoch moves when it starts");
            assert_eq!(status(&reap_until_answered(&mut q, &mut exec)).0, Status::SUCCESS, "{what}");
            assert_ne!(vol.writes.of(at, 4096), started, "{what}: the epoch moves again when it is done");
        }
    }

    #[test]
    fn a_data_digest_error_on_a_write_in_several_pieces_gives_every_piece_back() {
        use rdmablk_common::nvme::sqe::io_opcode;
        const CHUNK: usize = 64 << 10;
        let (sub, _) = subsystem(&["v"]);
        let (_admin, mut q) = io_queue(&sub);
        // 64 KiB chunks: a 128 KiB write is two pieces, both handed out at
        // once (one asked for, the other waiting its turn).
        let mut exec = Executor::standalone(Arc::clone(sub.registry.publication()), 32 * CHUNK, CHUNK).unwrap();
        let mut write = SubmissionEntry::new(io_opcode::WRITE, 5);
        write.nsid = 1;
        write.set_rw(0, 256, false);
        write.set_sgl(Sgl::Transport { length: 128 << 10 });
        assert_eq!(q.command(&mut exec, write, 0), None);
        dispatch(&mut q, &mut exec);
        let ttag = match std::mem::take(&mut q.actions).as_slice() {
            [Action::RequestData { cid: 5, ttag, off: 0, len }] if *len == CHUNK as u32 => *ttag,
            other => panic!("the first piece was not asked for alone: {other:?}"),
        };
        assert_eq!(exec.engine().pool().capacity() - exec.engine().pool().free_count(), 2, "both pieces have their chunk");
        // The first piece's data digest is wrong: the command fails, the
        // host may retry it.
        q.data_corrupt(&mut exec, ttag);
        assert_eq!(status(&std::mem::take(&mut q.actions)).0, Status::TRANSIENT_TRANSPORT_ERROR);
        let deadline = Instant::now() + Duration::from_secs(10);
        while q.exec_live() > 0 {
            assert!(Instant::now() < deadline, "the write's executor command never ended");
            exec.engine_mut().submit().unwrap();
            exec.reap();
            exec.pump_waitq();
            dispatch(&mut q, &mut exec);
            std::thread::sleep(Duration::from_millis(1));
        }
        assert_eq!(exec.live(), 0);
        assert_eq!(exec.engine().pool().free_count(), exec.engine().pool().capacity(), "every chunk back in the pool");
        assert!(q.actions.is_empty(), "{:?}", q.actions);
    }

    /// An admin Connect (KATO 0) of HOST and its data.
    fn admin_connect_of(sub: &Subsystem) -> (rdmablk_common::nvme::fabrics::Connect, [u8; CONNECT_DATA_SIZE]) {
        let c = rdmablk_common::nvme::fabrics::Connect { recfmt: 0, qid: 0, sqsize: 31, cattr: 0, kato_ms: 0 };
        let mut d = [0u8; CONNECT_DATA_SIZE];
        ConnectData { host_id: [7; 16], controller_id: 0xffff, subsystem_nqn: sub.nqn.clone(), host_nqn: HOST.into() }.encode(&mut d).unwrap();
        (c, d)
    }

    /// A new queue whose admin Connect of HOST the fence holds (HOST has
    /// a live controller already).
    fn held_admin_connect(sub: &Arc<Subsystem>, exec: &mut Executor) -> Queue {
        let mut q = queue(sub);
        let (c, d) = admin_connect_of(sub);
        assert!(run_on(&mut q, exec, c.to_entry(1), &d).is_empty(), "the Connect is held");
        q
    }

    #[test]
    fn a_held_connect_waits_for_every_reactor_to_turn_twice_however_many_there_are() {
        const REACTORS: usize = 100;
        let (sub, _) = subsystem_on(&["a"], REACTORS);
        let mut exec = executor(&sub);
        // The host's first controller stays live (another path, or an old
        // association whose reset a reactor has not seen yet)...
        let _first = admin(&sub);
        // ...so its next admin Connect waits until every reactor turned twice.
        let mut q = held_admin_connect(&sub, &mut exec);
        let turn = |reactors: std::ops::Range<usize>| {
            for r in reactors {
                sub.registry.turned(r);
                sub.registry.turned(r);
            }
        };
        turn(0..64);
        assert!(q.retry_connect(&mut exec), "answered before reactors 64.. turned");
        assert!(q.actions.is_empty(), "{:?}", q.actions);
        turn(64..REACTORS - 1);
        assert!(q.retry_connect(&mut exec), "answered before the last reactor turned");
        turn(REACTORS - 1..REACTORS);
        assert!(!q.retry_connect(&mut exec), "still held once every reactor turned twice");
        assert_eq!(status(&std::mem::take(&mut q.actions)).0, Status::SUCCESS);
    }

    /// A held Connect is tried again on each turn of its reactor; a try
    /// that finds the barrier not passed wakes every reactor (its own
    /// too) for the next. The other reactors may complete their turns
    /// between the fence's look and the hold: the hold must still wake its
    /// reactor for one more try, or nothing does until a deadline (an
    /// admin Connect answered seconds late: seen as a flaky
    /// `controllers_are_bounded_...` system test, 1 run in ~40).
    #[test]
    fn a_held_connect_whose_barrier_passes_while_it_is_held_again_is_tried_once_more() {
        let (sub, _) = subsystem_on(&["a"], 2);
        let wake = Arc::new(crate::sys::EventFd::new().unwrap());
        sub.registry.add_waker(Arc::clone(&wake));
        let mut exec = executor(&sub);
        let _first = admin(&sub);
        let mut q = held_admin_connect(&sub, &mut exec);
        assert!(wake.drain(), "holding it woke no reactor");
        // A try on the next turn: the fence looks before the reactors turned...
        let slot = q.held_connect.as_ref().expect("held").slot;
        let fence = q.fence(HOST);
        assert_eq!(fence, Fence::Wait { for_turns: true });
        // ...and they turn twice before the Connect is held again.
        for r in 0..2 {
            sub.registry.turned(r);
            sub.registry.turned(r);
        }
        q.hold_connect(slot, true);
        assert!(wake.drain(), "held again without a wake-up: nothing tries it until a deadline");
        let answered = Instant::now();
        assert!(!q.retry_connect(&mut exec), "the next try answers it");
        assert_eq!(status(&std::mem::take(&mut q.actions)).0, Status::SUCCESS);
        // The controller (KATO 0) is idle from its creation, not from the
        // Connect's arrival, which the fence may have held for longer
        // than idle_timeout (it was then torn down as idle at once).
        let idle = sub.cfg.idle_timeout;
        assert!(q.deadline().expect("an idle deadline") >= answered + idle, "idle from before the controller existed");
    }

    #[test]
    fn io_in_the_turn_of_a_reload_that_reopens_a_volume_under_its_nsid_reaches_the_new_volume() {
        use rdmablk_common::nvme::sqe::io_opcode;
        use rdmablk_common::protocol::VolumeId;
        let (sub, config) = subsystem(&["v"]);
        let (_admin, mut q) = io_queue(&sub);
        let mut exec = executor(&sub);
        let read = |cid: u16| {
            let mut read = SubmissionEntry::new(io_opcode::READ, cid);
            read.nsid = 1;
            read.set_rw(0, 1, false);
            read.set_sgl(Sgl::Transport { length: 512 });
            read
        };
        assert_eq!(q.command(&mut exec, read(1), 0), None);
        match reap_until_answered(&mut q, &mut exec).as_slice() {
            [Action::SendData { buf: Buf::Chunk(c), then: Some(then), .. }] if then.status == Status::SUCCESS => exec.sent(*c),
            other => panic!("{other:?}"),
        }
        dispatch(&mut q, &mut exec);
        // A reload reopens the volume (a new id) under the same nsid. The
        // reactor's executor picks the new set up in its control step; a
        // command handled earlier in that turn must reach the new volume.
        let mut vc = config.volumes[0].clone();
        vc.nsid = Some(1);
        let reopened = crate::backend::Volume::open(&config.source, &vc, VolumeId(2), 1, false).unwrap();
        let set = VolumeSet::new(2, vec![Arc::new(reopened)]).with_access(Arc::new(AccessPolicy::load(&config).unwrap()));
        sub.registry.publish(set);
        assert_eq!(q.command(&mut exec, read(2), 0), None, "{:?}", q.actions);
        match reap_until_answered(&mut q, &mut exec).as_slice() {
            [Action::SendData { buf: Buf::Chunk(c), then: Some(then), .. }] if then.status == Status::SUCCESS => exec.sent(*c),
            other => panic!("the read in the turn of the reload: {other:?}"),
        }
        dispatch(&mut q, &mut exec);
        assert_eq!(q.exec_live(), 0);
    }

    #[test]
    fn a_write_whose_data_comes_after_a_reload_is_planned_again_against_the_new_set() {
        use rdmablk_common::nvme::sqe::io_opcode;
        use rdmablk_common::protocol::VolumeId;
        let (sub, config) = subsystem(&["v"]);
        let (_admin, mut q) = io_queue(&sub);
        let mut exec = executor(&sub);
        let mut write = SubmissionEntry::new(io_opcode::WRITE, 3);
        write.nsid = 1;
        write.set_rw(0, 1, false);
        write.set_sgl(Sgl::InCapsule { offset: 0, length: 512 });
        let slot = q.command(&mut exec, write, 512).expect("its in-capsule data is awaited");
        // Before the data comes, a reload puts a new volume (nsid 2) first
        // and reopens v (nsid 1) second, and the reactor picks it up.
        let (_, two) = subsystem(&["v", "w"]);
        let mut vc = config.volumes[0].clone();
        vc.nsid = Some(1);
        let v = Arc::new(crate::backend::Volume::open(&config.source, &vc, VolumeId(3), 1, false).unwrap());
        let w = open_volumes(&two).unwrap().pop().unwrap();
        let set = VolumeSet::new(2, vec![Arc::clone(&w), Arc::clone(&v)]).with_access(Arc::new(AccessPolicy::load(&two).unwrap()));
        sub.registry.publish(set);
        exec.maybe_refresh();
        let block = [0x3cu8; 512];
        q.data_mut(&mut exec, slot, 0, 512).copy_from_slice(&block);
        q.data_placed(&mut exec, slot, 512, true).unwrap();
        assert_eq!(status(&reap_until_answered(&mut q, &mut exec)).0, Status::SUCCESS);
        // It landed on namespace 1's new volume, not on the volume now first in the set.
        for (cid, nsid, want) in [(4, 1, block), (5, 2, [0; 512])] {
            let mut read = SubmissionEntry::new(io_opcode::READ, cid);
            read.nsid = nsid;
            read.set_rw(0, 1, false);
            read.set_sgl(Sgl::Transport { length: 512 });
            assert_eq!(q.command(&mut exec, read, 0), None);
            match reap_until_answered(&mut q, &mut exec).as_slice() {
                [Action::SendData { buf: Buf::Chunk(c), then: Some(then), .. }] if then.status == Status::SUCCESS => {
                    assert!(exec.bytes(*c)[..512] == want[..], "namespace {nsid} reads {:#x}s", exec.bytes(*c)[0]);
                    exec.sent(*c);
                }
                other => panic!("namespace {nsid}: {other:?}"),
            }
            dispatch(&mut q, &mut exec);
        }
    }

    /// Allocations `f` makes on this thread (allocation-counter replaces the
    /// test binary's global allocator and counts per thread): tests of the
    /// per-I/O path (ARCHITECTURE.md: a turn of it allocates nothing).
    fn allocations_of(f: impl FnOnce()) -> u64 {
        allocation_counter::measure(f).count_total
    }

    #[test]
    fn a_write_fetched_in_several_pieces_allocates_nothing_once_the_queue_is_warm() {
        use rdmablk_common::nvme::sqe::io_opcode;
        const CHUNK: usize = 32 << 10;
        let (sub, _) = subsystem(&["v"]);
        let (_admin, mut q) = io_queue(&sub);
        let mut exec = Executor::standalone(Arc::clone(sub.registry.publication()), 32 * CHUNK, CHUNK).unwrap();
        // A 128 KiB write by R2T: four pieces handed out at once, asked
        // for one after another, driven as a transport does.
        let round = |q: &mut Queue, exec: &mut Executor, cid: u16| {
            let mut write = SubmissionEntry::new(io_opcode::WRITE, cid);
            write.nsid = 1;
            write.set_rw(0, 256, false);
            write.set_sgl(Sgl::Transport { length: 128 << 10 });
            assert_eq!(q.command(exec, write, 0), None);
            let deadline = Instant::now() + Duration::from_secs(10);
            let mut pieces = 0;
            loop {
                assert!(Instant::now() < deadline, "no answer within 10 s");
                exec.engine_mut().submit().unwrap();
                exec.reap();
                exec.pump_waitq();
                dispatch(q, exec);
                let batch = q.take_actions();
                let mut done = false;
                for a in batch.iter() {
                    match *a {
                        Action::RequestData { ttag, off, len, .. } => {
                            q.data_mut(exec, ttag, off, len).fill(cid as u8);
                            q.data_placed(exec, ttag, len, true).unwrap();
                            pieces += 1;
                        }
                        Action::Respond(c, _) if c.status == Status::SUCCESS => done = true,
                        ref other => panic!("{other:?}"),
                    }
                }
                q.actions_done(batch);
                if done {
                    break;
                }
            }
            assert_eq!(pieces, 4);
            dispatch(q, exec);
            assert_eq!(q.exec_live(), 0);
        };
        for cid in 0..4 {
            round(&mut q, &mut exec, cid);
        }
        let n = allocations_of(|| {
            for cid in 4..8 {
                round(&mut q, &mut exec, cid);
            }
        });
        assert_eq!(n, 0, "allocations of 4 writes in 4 pieces each");
    }

    #[test]
    fn a_kato_zero_controller_ends_idle_timeout_after_its_last_io_queue_left_without_a_fence_move() {
        let (sub, _) = subsystem(&["a"]);
        let idle = sub.cfg.idle_timeout;
        let (mut admin, mut io) = io_queue(&sub);
        let ctrl = Arc::clone(&admin.conn.as_ref().expect("connected").ctrl);
        // With an I/O queue, the admin queue (KATO 0) still has a deadline
        // within idle_timeout: a look, which finds the controller busy and
        // looks again idle_timeout later.
        let due = admin.deadline().expect("a deadline while the controller has an I/O queue");
        assert!(due <= Instant::now() + idle, "{due:?}");
        assert!(matches!(admin.check_deadlines(due, false), Due::Nothing));
        assert!(!ctrl.is_dead(), "torn down with an I/O queue");
        assert_eq!(admin.deadline(), Some(due + idle), "looked at again idle_timeout later");
        // The I/O queue leaves: no fence move (it would wake every reactor).
        let fence = sub.registry.fence_generation();
        ADMIN_EXEC.with_borrow_mut(|e| io.drop_commands(e.get_or_insert_with(|| executor(&sub))));
        let before = Instant::now();
        io.leave(&CloseReason::host_closed());
        let left = Instant::now();
        assert_eq!(sub.registry.fence_generation(), fence, "the last I/O queue's leaving moved the fence");
        // Without I/O queues, the controller ends idle_timeout after the
        // last of them left (its admin queue was silent longer), not sooner.
        let end = admin.deadline().expect("an idle deadline");
        assert!(end >= before + idle && end <= left + idle, "{end:?}: not idle_timeout after the leaving ({before:?}..{left:?})");
        assert!(matches!(admin.check_deadlines(end - Duration::from_millis(1), false), Due::Nothing));
        assert!(!ctrl.is_dead());
        assert!(matches!(admin.check_deadlines(end, false), Due::Close(_)));
        assert!(ctrl.is_dead(), "an idle controller is torn down");
    }

    #[test]
    fn nvme_commands_count_in_their_reactors_counters() {
        use rdmablk_common::nvme::sqe::io_opcode;
        let (sub, _) = subsystem(&["v"]);
        let (_admin, mut q) = io_queue(&sub);
        // The queues' commands so far ran on this thread's admin executor:
        // the I/O commands run there too, as on one reactor.
        ADMIN_EXEC.with_borrow_mut(|e| {
            let exec = e.as_mut().expect("the executor the queues' Connects ran on");
            let stats = Arc::clone(exec.stats());
            let n = &stats.nvme;
            let count = || (stats.commands.get(), n.commands[0].get(), n.commands[1].get(), n.errors.get(), n.bytes_read.get(), n.bytes_written.get());
            let before = count();
            let mut write = SubmissionEntry::new(io_opcode::WRITE, 20);
            write.nsid = 1;
            write.set_rw(0, 1, false);
            assert!(run_on(&mut q, exec, write, &[0x11; 512]).is_empty(), "answered with its disk write");
            assert_eq!(status(&reap_until_answered(&mut q, exec)).0, Status::SUCCESS);
            let mut read = SubmissionEntry::new(io_opcode::READ, 21);
            read.nsid = 1;
            read.set_rw(0, 1, false);
            read.set_sgl(Sgl::Transport { length: 512 });
            assert_eq!(q.command(exec, read, 0), None);
            match reap_until_answered(&mut q, exec).as_slice() {
                [Action::SendData { buf: Buf::Chunk(c), then: Some(_), .. }] => exec.sent(*c),
                other => panic!("{other:?}"),
            }
            let mut bad = SubmissionEntry::new(io_opcode::READ, 22);
            bad.nsid = 9;
            bad.set_rw(0, 1, false);
            bad.set_sgl(Sgl::Transport { length: 512 });
            assert_eq!(status(&run_on(&mut q, exec, bad, &[])).0, Status::INVALID_NAMESPACE);
            let after = count();
            assert_eq!(after.0 - before.0, 3, "the reactor's count of commands received");
            assert_eq!((after.1 - before.1, after.2 - before.2), (2, 1), "NVMe reads and writes");
            assert_eq!((after.3 - before.3, after.4 - before.4, after.5 - before.5), (1, 512, 512), "errors, bytes read and written");
        });
    }

    /// [`subsystem`] with `extra` in `[target]`.
    fn subsystem_with(extra: &str, volumes: &[&str]) -> Arc<Subsystem> {
        let mut text = format!("[target]\nname = \"t\"\nlisten = [\"nvme+tcp://127.0.0.1:0\"]\n{extra}\n");
        for v in volumes {
            text += &format!("[[volume]]\nname = \"{v}\"\nbackend = \"memory\"\nsize = \"1MiB\"\nblock_size = 512\nallow_any_host = true\n");
        }
        let config = Config::parse(&text, "test").unwrap();
        let set = VolumeSet::new(1, open_volumes(&config).unwrap()).with_access(Arc::new(AccessPolicy::load(&config).unwrap()));
        Arc::new(Subsystem::new(&config.target, Arc::new(Registry::new(set, 1))))
    }

    /// An admin Connect of host `host` (each host its own: no fence between them).
    fn connect_as(q: &mut Queue, subnqn: &str, host: &str) -> (Status, u64) {
        let c = rdmablk_common::nvme::fabrics::Connect { recfmt: 0, qid: 0, sqsize: 31, cattr: 0, kato_ms: 0 };
        let mut d = [0u8; CONNECT_DATA_SIZE];
        ConnectData { host_id: [9; 16], controller_id: 0xffff, subsystem_nqn: subnqn.into(), host_nqn: host.into() }.encode(&mut d).unwrap();
        status(&run(q, c.to_entry(1), &d))
    }

    /// Get Log Page `lid` of `bytes` bytes; `cdw10` adds LSP and RAE bits.
    fn log_page(lid: u8, bytes: u32, cdw10: u32) -> SubmissionEntry {
        let mut e = SubmissionEntry::new(admin_opcode::GET_LOG_PAGE, 11);
        e.nsid = u32::MAX;
        e.cdw[0] = lid as u32 | cdw10 | ((bytes / 4 - 1) & 0xffff) << 16;
        e.cdw[1] = (bytes / 4 - 1) >> 16;
        e.set_sgl(Sgl::Transport { length: bytes });
        e
    }

    fn u32_at(d: &[u8], at: usize) -> u32 {
        u32::from_le_bytes(d[at..at + 4].try_into().unwrap())
    }

    #[test]
    fn controller_ids_come_from_the_configured_range_in_turn() {
        let sub = subsystem_with("nvme_cntlid_min = 100\nnvme_cntlid_max = 102", &["a"]);
        let nqn = sub.nqn.clone();
        let mut qs: Vec<Queue> = (0..4).map(|_| queue(&sub)).collect();
        let ids: Vec<(Status, u64)> = qs.iter_mut().enumerate().map(|(i, q)| connect_as(q, &nqn, &format!("{HOST}{i}"))).collect();
        assert_eq!(&ids[..3], &[(Status::SUCCESS, 100), (Status::SUCCESS, 101), (Status::SUCCESS, 102)]);
        assert_eq!(ids[3].0, Status::CONNECT_CONTROLLER_BUSY, "every id of the range is taken");
        // Controller 100 goes: the next Connect wraps around to it.
        sub.remove_controller(100);
        let mut q = queue(&sub);
        assert_eq!(connect_as(&mut q, &nqn, "nqn.2014-08.org.example:other"), (Status::SUCCESS, 100));
        // A default range starts at 1.
        let (sub, _) = subsystem(&["a"]);
        assert_eq!(connect_as(&mut queue(&sub), &sub.nqn.clone(), HOST), (Status::SUCCESS, 1));
    }

    #[test]
    fn identify_reports_ana_and_a_subsystem_of_several_controllers() {
        use rdmablk_common::nvme::fabrics::DISCOVERY_NQN;
        let (sub, _) = subsystem(&["a", "b"]);
        let mut q = admin(&sub);
        let c = data(&run(&mut q, identify(1, 0), &[]));
        assert_eq!(c[76], 0b1011, "CMIC: multi-port, multi-controller, ANA reporting");
        let oaes = u32_at(&c, 92);
        assert_eq!(oaes & (1 << 8 | 1 << 11), 1 << 8 | 1 << 11, "OAES: namespace attribute and ANA change notices");
        assert_eq!(c[342], 10, "ANATT");
        assert_eq!(c[343], 0b0100_0111, "ANACAP: optimized, non-optimized, inaccessible; ANAGRPID fixed while attached");
        let (anagrpmax, nanagrpid, nn, mnan) = (u32_at(&c, 344), u32_at(&c, 348), u32_at(&c, 516), u32_at(&c, 540));
        assert_eq!((anagrpmax, nanagrpid, nn, mnan), (65535, 256, 65535, 256));
        // What a Linux host checks: 0 < MNAN <= NN, NANAGRPID <= ANAGRPMAX, and
        // its ANA log buffer (header, NANAGRPID descriptors, MNAN NSIDs) within MDTS.
        assert!(mnan > 0 && mnan <= nn && nanagrpid <= anagrpmax);
        assert!(16 + 32 * nanagrpid + 4 * mnan <= 4096 << c[77]);
        let ns = data(&run(&mut q, identify(0, 2), &[]));
        assert_eq!(ns[30], 1, "NMIC: shared");
        assert_eq!(u32_at(&ns, 92), 2, "ANAGRPID: the NSID");
        assert_eq!(ns[16..24], ns[0..8], "NUSE = NSZE while optimized");
        // The discovery controller reports none of it.
        let mut dq = queue(&sub);
        assert_eq!(connect(&mut dq, DISCOVERY_NQN, 0).0, Status::SUCCESS);
        let d = data(&run(&mut dq, identify(1, 0), &[]));
        assert_eq!((d[76], u32_at(&d, 92), d[343], u32_at(&d, 540)), (0, 0, 0, 0));
        assert_eq!(status(&run(&mut dq, log_page(0x0c, 4096, 0), &[])).0, Status::INVALID_LOG_PAGE);
    }

    #[test]
    fn the_ana_log_lists_each_namespace_in_its_own_group_and_rgo_leaves_them_out() {
        use rdmablk_common::nvme::ana::{AnaLog, AnaState};
        let (sub, _) = subsystem(&["a", "b"]);
        let mut q = admin(&sub);
        // What a Linux host asks: 16 + 32 x NANAGRPID + 4 x MNAN bytes.
        let page = data(&run(&mut q, log_page(0x0c, 9232, 0), &[]));
        assert_eq!(page.len(), 9232);
        let log = AnaLog::decode(&page).unwrap();
        assert_eq!(log.change_count, 0);
        let groups: Vec<_> = log.groups.iter().map(|g| (g.group, g.state, g.nsids.clone())).collect();
        assert_eq!(groups, [(1, AnaState::Optimized, vec![1]), (2, AnaState::Optimized, vec![2])]);
        assert!(page[16 + 2 * 36..].iter().all(|&b| b == 0), "zeroes after the last group");
        // Return Groups Only (LSP bit 0, CDW10 bit 8): descriptors without NSIDs.
        let page = data(&run(&mut q, log_page(0x0c, 4096, 1 << 8), &[]));
        let log = AnaLog::decode(&page).unwrap();
        assert_eq!(log.groups.iter().map(|g| (g.group, g.nsids.len())).collect::<Vec<_>>(), [(1, 0), (2, 0)]);
        assert_eq!(u32_at(&page, 16 + 32), 2, "the second descriptor follows the first at once");
        // A part of it at an offset (LPO), as a host may read a long page.
        let mut at = log_page(0x0c, 32, 0);
        at.cdw[2] = 16;
        let part = data(&run(&mut q, at, &[]));
        assert_eq!((u32_at(&part, 0), u32_at(&part, 4)), (1, 1), "group 1's descriptor");
        // In 4 KiB pieces up to the size a host computes (libnvme, nvme-cli's
        // ana-log), Retain Asynchronous Event on all but the last: every
        // offset below that size is valid.
        let mut whole = Vec::new();
        for (offset, rae) in [(0u32, true), (4096, true), (8192, false)] {
            let mut piece = log_page(0x0c, 4096, if rae { 1 << 15 } else { 0 });
            piece.cdw[2] = offset;
            whole.extend(data(&run(&mut q, piece, &[])));
        }
        let log = AnaLog::decode(&whole).unwrap();
        assert_eq!(log.groups.iter().map(|g| (g.group, g.nsids.clone())).collect::<Vec<_>>(), [(1, vec![1]), (2, vec![2])]);
        assert!(whole[16 + 2 * 36..].iter().all(|&b| b == 0));
        let mut past = log_page(0x0c, 4096, 0);
        past.cdw[2] = 9232 + 4;
        assert_eq!(status(&run(&mut q, past, &[])).0, Status::INVALID_FIELD, "an offset past the page");
    }

    #[test]
    fn an_ana_change_raises_one_notice_masked_until_the_log_is_read() {
        use rdmablk_common::nvme::ana::{AnaLog, AnaState};
        let (sub, _) = subsystem(&["a", "b"]);
        let mut q = admin(&sub);
        let mut aec = SubmissionEntry::new(admin_opcode::SET_FEATURES, 6);
        aec.cdw[0] = 0x0b;
        // Bit 30 (no such notice here) is ignored.
        aec.cdw[1] = 1 << 8 | 1 << 11 | 1 << 30;
        assert_eq!(status(&run(&mut q, aec, &[])).0, Status::SUCCESS);
        let mut get = SubmissionEntry::new(admin_opcode::GET_FEATURES, 6);
        get.cdw[0] = 0x0b;
        assert_eq!(status(&run(&mut q, get, &[])).1, 1 << 8 | 1 << 11, "only the notices this controller sends");
        assert!(run(&mut q, SubmissionEntry::new(admin_opcode::ASYNC_EVENT_REQUEST, 7), &[]).is_empty(), "held");
        q.tick(Instant::now());
        assert!(q.actions.is_empty(), "nothing changed");
        assert_eq!(q.ana_due, None, "no shared namespace: nothing to poll");
        // Volume b is fenced off (what the RBD backend's Ownership does; no
        // backend here has one, so the view is set as a look would find it).
        let fenced = vec![
            ana::View { nsid: 1, group: 1, state: AnaState::Optimized, generation: 0 },
            ana::View { nsid: 2, group: 2, state: AnaState::Inaccessible, generation: 1 },
        ];
        assert!(q.ana.update(fenced));
        q.send_events();
        let actions = std::mem::take(&mut q.actions);
        assert_eq!(status(&actions), (Status::SUCCESS, 0x000c_0302), "notice, ANA change, log page 0Ch");
        // The next change waits for the log to be read: the volume is its
        // owner again (the look below finds it so), and the new AER is held.
        assert!(run(&mut q, SubmissionEntry::new(admin_opcode::ASYNC_EVENT_REQUEST, 8), &[]).is_empty());
        q.tick(Instant::now());
        assert!(q.actions.is_empty(), "masked");
        // Read with RAE: still masked.
        let page = data(&run(&mut q, log_page(0x0c, 4096, 1 << 15), &[]));
        let log = AnaLog::decode(&page).unwrap();
        assert_eq!(log.change_count, 2, "two changes: fenced, then owner again");
        assert_eq!((log.groups[1].state, log.groups[1].change_count, log.groups[0].change_count), (AnaState::Optimized, 2, 0));
        assert!(q.ana.update(vec![
            ana::View { nsid: 1, group: 1, state: AnaState::NonOptimized, generation: 1 },
            ana::View { nsid: 2, group: 2, state: AnaState::Optimized, generation: 0 },
        ]));
        q.send_events();
        assert!(q.actions.is_empty(), "retained: still masked");
        // Read without RAE: unmasked, and the change it showed needs no notice.
        let log = AnaLog::decode(&data(&run(&mut q, log_page(0x0c, 4096, 0), &[]))).unwrap();
        assert_eq!((log.change_count, log.groups[0].state), (4, AnaState::Optimized), "the look at the read found volume a its owner again");
        q.tick(Instant::now());
        assert!(q.actions.is_empty(), "nothing new since the read");
        // A notice the host did not enable is not sent.
        let mut aec = SubmissionEntry::new(admin_opcode::SET_FEATURES, 9);
        aec.cdw[0] = 0x0b;
        aec.cdw[1] = 1 << 8;
        assert_eq!(status(&run(&mut q, aec, &[])).0, Status::SUCCESS);
        assert!(q.ana.update(vec![
            ana::View { nsid: 1, group: 1, state: AnaState::Inaccessible, generation: 1 },
            ana::View { nsid: 2, group: 2, state: AnaState::Optimized, generation: 0 },
        ]));
        q.send_events();
        assert!(q.actions.is_empty(), "ANA change notices are disabled");
    }
}
