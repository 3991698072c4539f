//! The executor: a reactor's commands on its block engine, whatever
//! protocol they came in by. One per reactor, shared by every transport
//! on it (rdmablk v1, NVMe/TCP, NVMe/RDMA), as SPDK's poll group shares
//! its bdev channels and nvmet its per-CPU workers.
//!
//! A front end decodes and checks a command, then hands the executor a
//! [`Request`] (read, write, flush, a range operation, or a chunk for its
//! own answer data) under an [`Owner`]: the transport and that
//! transport's own tag for the command. The executor owns the rest of the
//! disk side: the pool chunks and their waits (a FIFO line with the
//! session and host shares, `chunk_wait_timeout`), the pipelining of
//! large commands chunk by chunk (at most [`CHUNK_WINDOW`] chunks in
//! flight each), readahead, the write epochs, the volume snapshot with
//! its fixed-file slots, and the per-volume counters. It never touches a
//! wire: what must cross one comes back to the owner as an [`Event`]:
//!
//! - [`Event::Read`]: a piece of a read's data is in a chunk; the owner
//!   sends it and gives the chunk back with [`Executor::sent`];
//! - [`Event::Fetch`]: a write's piece wants its data in a chunk; the owner
//!   places it (in-capsule bytes, an RDMA READ, R2T and data PDUs) and
//!   calls [`Executor::placed`];
//! - [`Event::Buffer`]: a chunk for the owner's own data (v1's LIST answer),
//!   given back with [`Executor::sent`];
//! - [`Event::Done`]: nothing of the command is in flight any more, on the
//!   disk or with the owner: its result. It comes exactly once, last, and
//!   the command's id is free afterwards.
//!
//! Ordering: a write's data is on the disk (durable with `fua`) when its
//! `Done(Ok)` comes; a read's pieces come in offset order, whichever the
//! disk (or readahead) finished first, and the last with `last`: NVMe/TCP
//! must send C2HData in order (Linux's host places it in arrival order).
//! Commands are independent of one another, as on a disk. An owner that loses interest
//! (its connection failed) calls [`Executor::abandon`]: what has not
//! reached the disk is dropped, what has runs to completion, and `Done`
//! says whether any of it reached the disk.
//!
//! A command's id is encoded into the engine's tags (with the chunk), so
//! every disk completion finds its command in O(1).

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use arrayvec::ArrayVec;
use rdmablk_common::protocol::SessionId;

use super::pool::{ChunkId, PoolAccount};
use super::readahead::{self, Readahead, Serve};
use super::BlockEngine;
use crate::backend::{Backend, ByteRanges, Publication, RangeOp, Volume, VolumeSet};
use crate::error::{Error, ErrorKind, Result};
use crate::metrics::ReactorStats;

/// Most pool chunks one command may have in flight at once.
pub const CHUNK_WINDOW: u32 = 8;
/// Least time between two sweeps of the wait line for commands past
/// `target.chunk_wait_timeout` (each is a pass over the line and a log
/// line): the first one due is answered on time, later ones within this.
const CHUNK_SWEEP_INTERVAL: Duration = Duration::from_millis(250);
/// Chunks of a reactor's pool that only control commands' answer data
/// (v1's LIST) may take, at most: a command of a session that holds no
/// chunk takes any but these, and a Buffer any at all.
const CONTROL_RESERVE: u32 = 2;

/// The pool's max-min fair rule: whether a session that holds `held`
/// chunks of a pool of `capacity` may take one more, with `available`
/// chunks free (or held by readahead, which gives them back on demand) and
/// `holders` sessions holding at least one (itself included when `held` >
/// 0).
///
/// A session that holds none takes one whenever one is left beyond the
/// control reserve: a host with nothing in flight is served within one
/// chunk's service time, however many others hold theirs. A session that
/// holds some takes one more only while it holds less than the fair share
/// `capacity / (holders + 1)` (the "+ 1" is the next newcomer) and more
/// than a quarter of the pool stays available: that quarter goes to
/// newcomers a chunk at a time. Sessions that never give their chunks
/// back (peers that stop reading), arriving in any order, keep at most
/// the share they got, until the transport timeout ends them, and cannot
/// lock out the next newcomer before a quarter of the pool's chunks are
/// each held by a different one of them (128 sessions on a default
/// reactor; `max_sessions` and the per-address limits stand before that).
/// Without contention one session may hold half the pool (the static
/// `session_pool_share` is smaller by default).
pub(crate) fn fair_take(capacity: u32, available: u32, holders: u32, held: u32) -> bool {
    let reserve = CONTROL_RESERVE.min(capacity / 16);
    if held == 0 {
        return available > reserve;
    }
    let fair = (capacity / (holders.max(1) + 1)).max(1);
    held < fair && available > (capacity / 4).max(reserve)
}

/// A volume slot that names no volume (a Buffer request).
pub const NO_VOLUME: u16 = u16::MAX;

// Engine tag layout: kind:4 | command:32 | chunk:16. Kinds 8 and up are
// the runtime's (its transports' socket receives), never the executor's.
const U_READ: u64 = 1;
const U_WRITE: u64 = 2;
const U_FSYNC: u64 = 3;
const U_FALLOC: u64 = 4;
/// BLKDISCARD / BLKZEROOUT on the blocking worker.
const U_BLKDEV: u64 = 5;
/// A disk write held by fault injection (`crate::fault`), on the blocking
/// worker; the write goes to the ring when the hold ends.
const U_HOLD: u64 = 6;
/// A read ahead (`readahead`): no command; the command field holds the
/// volume slot.
const U_READAHEAD: u64 = 7;
const NO_CHUNK: u16 = u16::MAX;

fn tag(kind: u64, cmd: u32, chunk: u16) -> u64 {
    kind << 60 | (cmd as u64) << 16 | chunk as u64
}

fn split_tag(t: u64) -> (u64, u32, u16) {
    (t >> 60, (t >> 16) as u32, t as u16)
}

/// Whether an engine tag is one of the executor's (else the runtime's).
pub fn is_executor_tag(t: u64) -> bool {
    (1..8).contains(&(t >> 60))
}

/// A command's id, valid from [`Executor::submit`] until its
/// [`Event::Done`] has been handed out.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct CmdId(pub u32);

/// Who a command belongs to: a transport of the reactor (its index in the
/// runtime) and that transport's own tag for it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Owner {
    pub transport: u8,
    pub tag: u32,
}

/// The pool accounts a command's chunks are charged to: its session's (or
/// controller's) and its host's (the peer's source address) on this
/// reactor, for `session_pool_share` and `host_pool_share`.
pub type Accounts = [Option<Arc<PoolAccount>>; 2];

/// What a command asks of the disk.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Op {
    /// `len` bytes at `offset`, piece by piece into chunks ([`Event::Read`]).
    Read,
    /// `len` bytes at `offset`, each piece fetched into a chunk first
    /// ([`Event::Fetch`]); durably with `fua`.
    Write { fua: bool },
    /// Makes the volume's completed writes durable.
    Flush,
    /// Deallocates or zeroes byte ranges the volume's way (`op`, from
    /// `Backend::discard` or `write_zeroes`).
    Range { op: RangeOp, ranges: ByteRanges },
    /// One chunk for the owner's own data ([`Event::Buffer`]); no disk.
    Buffer,
}

/// A command for the executor.
#[derive(Debug)]
pub struct Request {
    pub op: Op,
    /// The volume's slot in this executor ([`Executor::slot_of_index`]);
    /// [`NO_VOLUME`] for a Buffer. A volume whose descriptor the engine
    /// could not take ends the command with its `Done`, InternalError.
    pub vslot: u16,
    pub offset: u64,
    pub len: u32,
    /// Index in `metrics::IO_OPS` to count it under, if it is counted.
    pub metric: Option<u8>,
    /// When the command arrived (its latency runs from here).
    pub start: Instant,
    /// Whether its latency is measured (a clock read when it ends).
    pub timed: bool,
    pub accounts: Accounts,
    /// The rdmablk v1 session whose disk writes fault injection may hold
    /// (`crate::fault`, test builds only).
    pub hold_key: Option<SessionId>,
}

/// What the executor tells a command's owner.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Event {
    /// Bytes `off..off + len` of the read's data are in `chunk` (zeroes,
    /// to be sent from the zero chunk, if `zero`); `last`: the read has
    /// every byte now. The chunk is the owner's until [`Executor::sent`].
    Read { chunk: ChunkId, off: u32, len: u32, zero: bool, last: bool },
    /// Place bytes `off..off + len` of the write's data into `chunk`, then
    /// call [`Executor::placed`].
    Fetch { chunk: ChunkId, off: u32, len: u32 },
    /// A chunk for the owner's data, until [`Executor::sent`].
    Buffer { chunk: ChunkId },
    /// Nothing of the command is in flight any more: its result, and
    /// whether any of it reached the disk (or the blocking worker).
    Done { result: std::result::Result<(), ErrorKind>, reached_disk: bool },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Read,
    Write,
    Flush,
    Range,
    Buffer,
}

struct Cmd {
    owner: Owner,
    kind: Kind,
    /// The range operation and its ranges (Range only).
    range: Option<(RangeOp, ByteRanges)>,
    vslot: u16,
    /// The volume's backend is `null`: no disk I/O.
    null: bool,
    offset: u64,
    len: u32,
    fua: bool,
    metric: Option<u8>,
    start: Instant,
    timed: bool,
    accounts: Accounts,
    hold_key: Option<SessionId>,
    /// Bytes handed to chunks so far.
    next: u32,
    /// Bytes finished (read from the disk; written to it).
    done: u32,
    /// A read's bytes handed to the owner ([`Event::Read`]), in order.
    emitted: u32,
    /// A read's pieces finished ahead of an earlier one, held (still in
    /// flight) until the pieces before them were handed out.
    early: ArrayVec<ChunkId, { CHUNK_WINDOW as usize }>,
    /// Chunks or operations in flight: on the disk, on the blocking
    /// worker, or lent to the owner (a read's piece being sent, a write's
    /// being fetched, a buffer).
    inflight: u32,
    error: Option<ErrorKind>,
    abandoned: bool,
    /// Part of it went to the disk (or the blocking worker).
    at_disk: bool,
    in_waitq: bool,
    /// While `in_waitq`: since when it has been waiting for a chunk (it
    /// queued, or got its last chunk), for `target.chunk_wait_timeout`.
    waiting_since: Instant,
    /// A write that bumped its ranges' write epochs when it started and
    /// bumps them again once nothing of it is in flight (`end_write`).
    write_epoch_open: bool,
    /// Counted in the volume's metrics already.
    recorded: bool,
}

#[derive(Clone, Copy, Default)]
struct ChunkUse {
    cmd: u32,
    off: u32,
    len: u32,
    /// Zeroes (the `null` backend's reads) instead of the chunk's bytes.
    zero: bool,
}

/// A volume as this executor serves it.
struct LocalVolume {
    vol: Arc<Volume>,
    /// The engine could not register its descriptor: its commands fail
    /// with InternalError.
    broken: bool,
    /// Commands (and reads ahead) on this volume, not yet finished.
    inflight: u32,
    /// Gone from the published set; released when `inflight` drops to 0.
    retiring: bool,
}

/// This executor's snapshot of the published volume set.
struct LocalVolumes {
    generation: u64,
    set: Arc<VolumeSet>,
    /// Index = fixed-file slot.
    slots: Vec<Option<LocalVolume>>,
    /// Position in `set` → slot (NO_VOLUME if it has none).
    by_index: Vec<u16>,
}

/// Settings an executor is built with.
pub struct Settings {
    pub id: usize,
    /// Fixed-file slots of the engine: the most volumes served at once.
    pub volume_slots: u32,
    /// `target.session_pool_share` and `host_pool_share`, in chunks.
    pub pool_share: u32,
    pub host_pool_share: u32,
    pub chunk_wait_timeout: Duration,
    /// `target.readahead`.
    pub readahead: u64,
}

/// A reactor's commands on its block engine.
pub struct Executor {
    // Field order is drop order: the engine (whose ring waits for its
    // in-flight operations) goes last.
    cmds: Vec<Option<Cmd>>,
    free_cmds: Vec<u32>,
    /// Commands waiting for a chunk, in order.
    waitq: VecDeque<u32>,
    /// No command in `waitq` has waited since before this (a lower bound:
    /// exact after each sweep, `None` when none waits for a deadline).
    waitq_oldest: Option<Instant>,
    chunk_wait_timeout: Duration,
    /// The next sweep for commands past the timeout runs no earlier.
    chunk_sweep_after: Instant,
    /// Scratch list of the commands a sweep gives up (kept for its capacity).
    chunk_expired: Vec<u32>,
    chunk_use: Vec<ChunkUse>,
    vols: LocalVolumes,
    readahead: Readahead,
    /// Scratch list of the pieces that waited for a read ahead.
    readahead_waiters: Vec<ChunkId>,
    /// The engine's completions of one reap (kept for its capacity).
    reaped: Vec<(u64, i32)>,
    /// Completions of the engine that are not the executor's (the
    /// runtime's socket receives), for the runtime to route.
    foreign: Vec<(u64, i32)>,
    events: VecDeque<(Owner, CmdId, Event)>,
    pool_share: u32,
    host_pool_share: u32,
    id: usize,
    /// The published volume set this executor follows.
    publication: Arc<Publication>,
    stats: Arc<ReactorStats>,
    engine: BlockEngine,
}

impl Executor {
    pub fn new(engine: BlockEngine, settings: Settings, publication: Arc<Publication>, stats: Arc<ReactorStats>) -> Executor {
        let chunks = engine.pool().capacity();
        let chunk_size = engine.chunk_size() as u32;
        let set = publication.volumes();
        let mut exec = Executor {
            cmds: Vec::new(),
            free_cmds: Vec::new(),
            waitq: VecDeque::new(),
            waitq_oldest: None,
            chunk_wait_timeout: settings.chunk_wait_timeout,
            chunk_sweep_after: Instant::now(),
            chunk_expired: Vec::new(),
            chunk_use: vec![ChunkUse::default(); chunks],
            vols: LocalVolumes {
                generation: u64::MAX,
                set,
                slots: (0..settings.volume_slots).map(|_| None).collect(),
                by_index: Vec::new(),
            },
            readahead: Readahead::new(
                readahead::Settings::new(chunk_size, settings.readahead, chunks),
                settings.volume_slots as usize,
            ),
            readahead_waiters: Vec::new(),
            reaped: Vec::with_capacity(256),
            foreign: Vec::new(),
            events: VecDeque::with_capacity(64),
            pool_share: settings.pool_share,
            host_pool_share: settings.host_pool_share,
            id: settings.id,
            publication,
            stats,
            engine,
        };
        exec.refresh_volumes();
        exec
    }

    /// An executor of its own, on no reactor: a small ring (no wake
    /// descriptor: reap it after `submit`) and a pool of `pool` bytes in
    /// chunks of `chunk`. For tests and harnesses that drive a front end's
    /// queue directly.
    pub fn standalone(publication: Arc<Publication>, pool: usize, chunk: usize) -> Result<Executor> {
        Executor::standalone_with_readahead(publication, pool, chunk, 0)
    }

    /// [`Executor::standalone`] reading up to `readahead` bytes ahead of
    /// sequential streams of file volumes.
    pub fn standalone_with_readahead(publication: Arc<Publication>, pool: usize, chunk: usize, readahead: u64) -> Result<Executor> {
        let opts = super::uring::UringOptions { entries: 64, file_slots: 64, ..Default::default() };
        let engine = BlockEngine::new(super::pool::Pool::new(pool, chunk), opts, 0)?;
        let settings = Settings {
            id: 0,
            volume_slots: 64,
            pool_share: u32::MAX,
            host_pool_share: u32::MAX,
            chunk_wait_timeout: Duration::from_secs(5),
            readahead,
        };
        Ok(Executor::new(engine, settings, publication, Arc::new(ReactorStats::default())))
    }

    pub fn engine(&self) -> &BlockEngine {
        &self.engine
    }

    pub fn engine_mut(&mut self) -> &mut BlockEngine {
        &mut self.engine
    }

    /// The counters of the reactor it runs on (the runtime's), which the
    /// front ends' queues on that reactor write too.
    pub fn stats(&self) -> &Arc<ReactorStats> {
        &self.stats
    }

    /// The next event for an owner, in the order they happened. A command's
    /// id is free again once its `Done` was handed out here (not before:
    /// news of an earlier command must never reach a newer one that took
    /// its id while the news waited).
    #[inline]
    pub fn pop_event(&mut self) -> Option<(Owner, CmdId, Event)> {
        let e = self.events.pop_front()?;
        if matches!(e.2, Event::Done { .. }) {
            self.free_cmds.push(e.1 .0);
        }
        Some(e)
    }

    /// Whether news waits for an owner.
    #[inline]
    pub fn has_events(&self) -> bool {
        !self.events.is_empty()
    }

    /// Commands not yet done (waiting, on the disk, with their owner, or
    /// their `Done` not yet handed out).
    pub fn live(&self) -> usize {
        self.cmds.len() - self.free_cmds.len()
    }

    // ---------------------------------------------------------------- volumes

    /// The published volume set as this executor last saw it.
    pub fn volume_set(&self) -> &Arc<VolumeSet> {
        &self.vols.set
    }

    /// Picks up a newly published volume set, if there is one (one load).
    #[inline]
    pub fn maybe_refresh(&mut self) {
        if self.publication.generation() != self.vols.generation {
            self.refresh_volumes();
        }
    }

    /// The slot of the volume at `index` of [`Executor::volume_set`].
    #[inline]
    pub fn slot_of_index(&self, index: usize) -> Option<u16> {
        self.vols.by_index.get(index).copied().filter(|&s| s != NO_VOLUME)
    }

    /// The volume in `slot`.
    pub fn volume(&self, slot: u16) -> &Arc<Volume> {
        &self.vols.slots[slot as usize].as_ref().expect("live volume slot").vol
    }

    /// Whether the volume in `slot` can take commands (its descriptor is
    /// registered with the engine); [`Executor::submit`] ends the commands
    /// of one that cannot with InternalError.
    fn usable(&self, slot: u16) -> bool {
        self.vols.slots.get(slot as usize).and_then(|s| s.as_ref()).is_some_and(|lv| !lv.broken)
    }

    /// Whether the volume in `slot` has the `null` backend (no disk).
    #[inline]
    pub fn is_null(&self, slot: u16) -> bool {
        matches!(*self.volume(slot).backend, Backend::Null)
    }

    /// Counts a command its front end finished without the executor (a
    /// `null` volume's write whose data was in hand) against the volume
    /// in `slot`.
    pub fn count_done(&self, slot: u16, metric: Option<u8>, bytes: u64, start: Instant) {
        if let Some(m) = metric {
            self.volume(slot).stats.reactor(self.id).ops[m as usize].record(bytes, true, Some(start.elapsed()));
        }
    }

    /// Counts a command refused before it reached the executor against
    /// the volume in `slot` (a validation failure of an I/O opcode).
    pub fn count_refused(&self, slot: u16, metric: usize, start: Instant) {
        self.volume(slot).stats.reactor(self.id).ops[metric].record(0, false, Some(start.elapsed()));
    }

    /// Applies the published volume set: new volumes get a fixed-file slot,
    /// reopened ones get their new descriptor in the same slot, removed ones
    /// retire and free their slot after their last command.
    pub fn refresh_volumes(&mut self) {
        let set = self.publication.volumes();
        let mut seen = vec![false; self.vols.slots.len()];
        let mut by_index = Vec::with_capacity(set.volumes.len());
        for v in &set.volumes {
            let existing = self.vols.slots.iter().position(|s| s.as_ref().is_some_and(|lv| lv.vol.id == v.id));
            let slot = match existing {
                Some(slot) => {
                    let lv = self.vols.slots[slot].as_mut().expect("live slot");
                    if !Arc::ptr_eq(&lv.vol, v) || lv.retiring {
                        // Reloaded: what was read ahead may be of another file.
                        self.readahead.drop_volume(slot as u16);
                    }
                    let same_backend = Arc::ptr_eq(&lv.vol.backend, &v.backend);
                    lv.vol = Arc::clone(v);
                    lv.retiring = false;
                    if !same_backend {
                        let broken = self.attach_fails(v);
                        self.vols.slots[slot].as_mut().expect("live slot").broken = broken;
                    }
                    slot
                }
                None => match self.vols.slots.iter().position(Option::is_none) {
                    None => {
                        tracing::error!("reactor {}: volume {}: no free fixed-file slot; its commands will fail", self.id, v.name);
                        by_index.push(NO_VOLUME);
                        continue;
                    }
                    Some(slot) => {
                        let broken = self.attach_fails(v);
                        self.vols.slots[slot] = Some(LocalVolume { vol: Arc::clone(v), broken, inflight: 0, retiring: false });
                        slot
                    }
                },
            };
            seen[slot] = true;
            by_index.push(slot as u16);
        }
        for (slot, lv) in self.vols.slots.iter_mut().enumerate() {
            if let Some(lv) = lv {
                if !seen[slot] && !lv.retiring {
                    tracing::debug!("reactor {}: volume {} retiring ({} commands in flight)", self.id, lv.vol.name, lv.inflight);
                    lv.retiring = true;
                    self.readahead.drop_volume(slot as u16);
                }
            }
        }
        self.release_readahead();
        self.vols.generation = set.generation;
        self.vols.set = set;
        self.vols.by_index = by_index;
        for slot in 0..self.vols.slots.len() {
            self.maybe_release_volume(slot as u16);
        }
    }

    /// Gives the engine `v`'s descriptor now (a new volume, or a new
    /// backend after a reload), so that a failure shows before its first
    /// command: whether it failed (its commands then fail InternalError).
    fn attach_fails(&mut self, v: &Volume) -> bool {
        match self.engine.attach(v) {
            Ok(()) => false,
            Err(e) => {
                tracing::error!("reactor {}: volume {}: {e}", self.id, v.name);
                true
            }
        }
    }

    /// Frees a retired volume's slot once nothing of this executor uses it.
    fn maybe_release_volume(&mut self, slot: u16) {
        let Some(lv) = self.vols.slots[slot as usize].as_ref() else { return };
        if !lv.retiring || lv.inflight > 0 {
            return;
        }
        // Nothing to give back for a volume without a descriptor, or one
        // whose attach failed: the engine holds no file for it.
        if let Err(e) = self.engine.detach(lv.vol.id) {
            tracing::error!("reactor {}: volume {}: {e}", self.id, lv.vol.name);
        }
        tracing::debug!("reactor {}: volume {} released", self.id, lv.vol.name);
        self.vols.slots[slot as usize] = None;
    }

    fn volume_done(&mut self, vslot: u16) {
        if let Some(lv) = self.vols.slots[vslot as usize].as_mut() {
            lv.inflight -= 1;
            if lv.retiring && lv.inflight == 0 {
                self.maybe_release_volume(vslot);
            }
        }
    }

    // ---------------------------------------------------------------- commands

    fn cmd(&mut self, ci: u32) -> &mut Cmd {
        self.cmds[ci as usize].as_mut().expect("live command")
    }

    fn emit(&mut self, ci: u32, ev: Event) {
        let owner = self.cmds[ci as usize].as_ref().expect("live command").owner;
        self.events.push_back((owner, CmdId(ci), ev));
    }

    /// Starts a command. `None` when the executor holds as many commands as
    /// it can number (the caller answers the command busy). A command the
    /// volume cannot take (its descriptor failed, the operation is not
    /// supported) still gets an id and ends with its `Done` error.
    pub fn submit(&mut self, owner: Owner, req: Request) -> Option<CmdId> {
        let ci = match self.free_cmds.pop() {
            Some(ci) => ci,
            None if self.cmds.len() < u32::MAX as usize => {
                self.cmds.push(None);
                (self.cmds.len() - 1) as u32
            }
            None => return None,
        };
        let Request { op, vslot, offset, len, metric, start, timed, accounts, hold_key } = req;
        let (kind, range, fua) = match op {
            Op::Read => (Kind::Read, None, false),
            Op::Write { fua } => (Kind::Write, None, fua),
            Op::Flush => (Kind::Flush, None, false),
            Op::Range { op, ranges } => (Kind::Range, Some((op, ranges)), false),
            Op::Buffer => (Kind::Buffer, None, false),
        };
        let usable = vslot == NO_VOLUME || self.usable(vslot);
        let backend = (vslot != NO_VOLUME && usable).then(|| Arc::clone(&self.volume(vslot).backend));
        let null = backend.as_deref().is_some_and(|b| matches!(b, Backend::Null));
        self.cmds[ci as usize] = Some(Cmd {
            owner,
            kind,
            range,
            vslot: if usable { vslot } else { NO_VOLUME },
            null,
            offset,
            len,
            fua,
            metric,
            start,
            timed,
            accounts,
            hold_key,
            next: 0,
            done: 0,
            emitted: 0,
            early: ArrayVec::new(),
            inflight: 0,
            error: None,
            abandoned: false,
            at_disk: false,
            in_waitq: false,
            waiting_since: start,
            write_epoch_open: false,
            recorded: false,
        });
        let id = CmdId(ci);
        if !usable {
            self.cmd(ci).error = Some(ErrorKind::Internal);
            self.progress(ci);
            return Some(id);
        }
        if let Some(backend) = &backend {
            self.vols.slots[vslot as usize].as_mut().expect("live volume slot").inflight += 1;
            match kind {
                Kind::Write | Kind::Range => self.begin_write(ci),
                Kind::Read if matches!(**backend, Backend::File(_)) => self.read_ahead(vslot, offset, len),
                _ => {}
            }
        }
        match kind {
            Kind::Flush => self.submit_disk(ci, U_FSYNC, |engine, vol, t| engine.flush(vol, t)),
            Kind::Range => {
                let (op, ranges) = self.cmds[ci as usize].as_ref().and_then(|c| c.range.clone()).expect("a range command");
                if op == RangeOp::Nothing {
                    self.progress(ci);
                    return Some(id);
                }
                let kind = if matches!(op, RangeOp::Fallocate(_)) { U_FALLOC } else { U_BLKDEV };
                for &(offset, len) in ranges.iter() {
                    self.submit_disk(ci, kind, |engine, vol, t| engine.range(vol, op, offset, len, t));
                    if self.cmd(ci).error.is_some() {
                        break;
                    }
                }
                self.progress(ci);
            }
            _ => self.pump(ci),
        }
        Some(id)
    }

    /// A chunk of a read ([`Event::Read`]) or a buffer ([`Event::Buffer`])
    /// is back from its owner: the chunk returns to the pool.
    pub fn sent(&mut self, chunk: ChunkId) {
        let ci = self.chunk_use[chunk.0 as usize].cmd;
        self.engine.pool_mut().release(chunk);
        let Some(cmd) = self.cmds.get_mut(ci as usize).and_then(|c| c.as_mut()) else {
            tracing::error!("reactor {}: chunk {} sent for a free command", self.id, chunk.0);
            return;
        };
        cmd.inflight -= 1;
        self.progress(ci);
    }

    /// The data of a write's piece ([`Event::Fetch`]) is in `chunk`
    /// (`ok`), or could not be fetched (the command fails with `Transfer`).
    pub fn placed(&mut self, chunk: ChunkId, ok: bool) {
        let ci = self.chunk_use[chunk.0 as usize].cmd;
        let Some(cmd) = self.cmds.get_mut(ci as usize).and_then(|c| c.as_mut()) else {
            tracing::error!("reactor {}: chunk {} placed for a free command", self.id, chunk.0);
            self.engine.pool_mut().release(chunk);
            return;
        };
        if !ok {
            cmd.error.get_or_insert(ErrorKind::Transfer);
        }
        if cmd.error.is_some() || cmd.abandoned {
            cmd.inflight -= 1;
            self.engine.pool_mut().release(chunk);
            self.progress(ci);
            return;
        }
        if cmd.null {
            // The data crossed the fabric; the null backend drops it.
            cmd.done += self.chunk_use[chunk.0 as usize].len;
            cmd.inflight -= 1;
            self.engine.pool_mut().release(chunk);
            self.progress(ci);
            return;
        }
        self.write_chunk(ci, chunk);
    }

    /// The owner lost interest (its connection failed, its session was
    /// retired): what has not reached the disk is dropped, what has runs
    /// to completion; [`Event::Done`] follows once nothing is in flight.
    pub fn abandon(&mut self, id: CmdId) {
        let Some(cmd) = self.cmds.get_mut(id.0 as usize).and_then(|c| c.as_mut()) else { return };
        if cmd.abandoned {
            return;
        }
        cmd.abandoned = true;
        self.progress(id.0);
    }

    /// The command a chunk serves and its owner, if the chunk is one a
    /// live command holds (for a transport that must take its chunks back
    /// from a queue pair it destroys).
    pub fn chunk_owner(&self, c: ChunkId) -> Option<(Owner, CmdId)> {
        let ci = self.chunk_use.get(c.0 as usize)?.cmd;
        let cmd = self.cmds.get(ci as usize)?.as_ref()?;
        Some((cmd.owner, CmdId(ci)))
    }

    /// The bytes of a chunk the owner holds.
    pub fn bytes(&self, c: ChunkId) -> &[u8] {
        self.engine.bytes(c)
    }

    /// The bytes of a chunk the owner holds, to fill.
    pub fn bytes_mut(&mut self, c: ChunkId) -> &mut [u8] {
        self.engine.bytes_mut(c)
    }

    /// Queues a command's disk operation without a chunk (a flush, a
    /// range), tagged `kind`: `op` gets the engine, the volume and the tag.
    fn submit_disk(&mut self, ci: u32, kind: u64, op: impl FnOnce(&mut BlockEngine, &Volume, u64) -> Result<()>) {
        let vol = Arc::clone(self.volume(self.cmds[ci as usize].as_ref().expect("live command").vslot));
        match op(&mut self.engine, &vol, tag(kind, ci, NO_CHUNK)) {
            Ok(()) => {
                let cmd = self.cmd(ci);
                cmd.inflight += 1;
                cmd.at_disk = true;
            }
            Err(e) => self.engine_refused(ci, &e),
        }
    }

    /// Fails command `ci` whose disk operation could not be queued (the
    /// blocking worker did not start, a fixed file could not be set).
    fn engine_refused(&mut self, ci: u32, e: &Error) {
        tracing::error!("reactor {}: {e}", self.id);
        self.cmd(ci).error.get_or_insert(ErrorKind::Internal);
    }

    /// Reports every finished disk operation (ring, blocking worker, and
    /// those that needed no disk); returns how many completed. Completions
    /// that are not the executor's are kept for [`Executor::take_foreign`].
    pub fn reap(&mut self) -> usize {
        let mut done = std::mem::take(&mut self.reaped);
        let n = self.engine.reap(|t, r| done.push((t, r)));
        for &(t, r) in &done {
            if is_executor_tag(t) {
                self.on_disk_done(t, r);
            } else {
                self.foreign.push((t, r));
            }
        }
        done.clear();
        self.reaped = done;
        n
    }

    /// The last reap's completions that are not the executor's.
    pub fn take_foreign(&mut self, into: &mut Vec<(u64, i32)>) {
        into.append(&mut self.foreign);
    }

    fn on_disk_done(&mut self, t: u64, res: i32) {
        let (kind, ci, c) = split_tag(t);
        if kind == U_READAHEAD {
            return self.readahead_done(ci as u16, ChunkId(c), res);
        }
        let Some(cmd) = self.cmds.get_mut(ci as usize).and_then(|x| x.as_mut()) else {
            tracing::error!("io_uring completion for a free command slot {ci}");
            return;
        };
        cmd.inflight -= 1;
        if res < 0 {
            let errno = -res;
            let unsupported = matches!(kind, U_FALLOC | U_BLKDEV) && matches!(errno, libc::EOPNOTSUPP | libc::ENOTTY);
            let shared = &self.vols.slots[cmd.vslot as usize].as_ref().expect("live volume slot").vol;
            // An rbd gateway that another one fenced off (its client
            // blocklisted): the host must go to the image's owner.
            let fenced = errno == crate::backend::rbd::EBLOCKLISTED && shared.backend.ownership().is_some();
            let err = if unsupported {
                ErrorKind::NotSupported
            } else if fenced {
                ErrorKind::NotOwner
            } else {
                ErrorKind::DeviceIo(errno)
            };
            let what = match kind {
                U_READ => "read",
                U_WRITE | U_HOLD => "write",
                U_FSYNC => "fdatasync",
                U_BLKDEV => "BLKDISCARD/BLKZEROOUT",
                _ => "fallocate",
            };
            let vol = &self.vols.slots[cmd.vslot as usize].as_ref().expect("live volume slot").vol.name;
            if err == ErrorKind::NotSupported {
                tracing::debug!("volume {vol}: {what} not supported");
            } else if err == ErrorKind::NotOwner {
                tracing::debug!("volume {vol}: {what} refused: this gateway was fenced off (answered NotOwner)");
            } else {
                tracing::warn!("volume {vol}: {what} failed: {}", std::io::Error::from_raw_os_error(errno));
            }
            cmd.error.get_or_insert(err);
            if c != NO_CHUNK {
                self.engine.pool_mut().release(ChunkId(c));
            }
            self.progress(ci);
            return;
        }
        match kind {
            U_READ => {
                let chunk = ChunkId(c);
                if cmd.abandoned || cmd.error.is_some() {
                    self.engine.pool_mut().release(chunk);
                } else {
                    // From the disk to the owner: still in flight.
                    cmd.inflight += 1;
                    self.read_chunk_done(ci, chunk);
                }
                self.progress(ci);
            }
            U_WRITE => {
                self.engine.pool_mut().release(ChunkId(c));
                cmd.done += self.chunk_use[c as usize].len;
                self.progress(ci);
            }
            // The held write was at the disk all along: it lands now,
            // whatever became of its owner meanwhile.
            U_HOLD => {
                cmd.inflight += 1;
                self.submit_write(ci, ChunkId(c));
            }
            _ => self.progress(ci),
        }
    }

    fn wants_chunk(&self, ci: u32) -> bool {
        let Some(cmd) = self.cmds.get(ci as usize).and_then(|c| c.as_ref()) else { return false };
        if cmd.error.is_some() || cmd.abandoned {
            return false;
        }
        match cmd.kind {
            Kind::Read | Kind::Write => cmd.next < cmd.len && cmd.inflight < CHUNK_WINDOW,
            Kind::Buffer => cmd.next == 0,
            Kind::Flush | Kind::Range => false,
        }
    }

    /// Whether command `ci` may take a chunk now, if the pool has one: a
    /// Buffer (a control command's answer data) whenever its session holds
    /// no other (else by the fair rule: a peer that posts LISTs and never
    /// reads their answers holds one chunk for them, not the pool); a
    /// read's or a write's piece by the static caps (`session_pool_share`,
    /// `host_pool_share`) and the fair rule ([`fair_take`]) for its session.
    fn may_take(&self, ci: u32) -> bool {
        let cmd = self.cmds[ci as usize].as_ref().expect("live command");
        let [session, host] = &cmd.accounts;
        if cmd.kind == Kind::Buffer && session.as_ref().is_none_or(|a| a.buffers() == 0) {
            return true;
        }
        if session.as_ref().is_some_and(|a| a.held() >= self.pool_share) || host.as_ref().is_some_and(|a| a.held() >= self.host_pool_share) {
            return false;
        }
        let Some(session) = session else { return true };
        let pool = self.engine.pool();
        let available = (pool.free_count() + self.readahead.held()) as u32;
        fair_take(pool.capacity() as u32, available, pool.holders(), session.held())
    }

    fn alloc_for(&mut self, ci: u32) -> ChunkId {
        let [session, host] = &self.cmds[ci as usize].as_ref().expect("live command").accounts;
        let charge = [session.as_ref(), host.as_ref()];
        self.engine.pool_mut().alloc_charged(charge).expect("free chunk")
    }

    /// Issues chunks for a command while it wants them, the pool has them
    /// and its session and host are under their shares; otherwise queues it
    /// (FIFO) for the next free chunk.
    fn pump(&mut self, ci: u32) {
        while self.wants_chunk(ci) {
            // A control command's buffer does not queue behind data.
            let first_in_line = self.waitq.is_empty() || self.waitq.front() == Some(&ci) || self.cmd(ci).kind == Kind::Buffer;
            if !first_in_line || !self.may_take(ci) || !self.chunk_for_command() {
                if !self.cmd(ci).in_waitq {
                    self.wait_for_chunk(ci, Instant::now());
                }
                return;
            }
            if self.waitq.front() == Some(&ci) {
                self.waitq.pop_front();
                self.cmd(ci).in_waitq = false;
            }
            let c = self.alloc_for(ci);
            self.issue(ci, c);
        }
    }

    /// Hands free chunks to waiting commands in order (once per turn). A
    /// command whose session or host holds its whole share goes to the
    /// back of the line, so it never holds up other sessions' or hosts'
    /// commands behind it.
    pub fn pump_waitq(&mut self) {
        if self.waitq.is_empty() || !self.chunk_for_command() {
            return;
        }
        let now = Instant::now();
        let mut passed_over = 0;
        while passed_over < self.waitq.len() && self.chunk_for_command() {
            let Some(ci) = self.waitq.pop_front() else { break };
            let Some(cmd) = self.cmds.get_mut(ci as usize).and_then(|c| c.as_mut()) else { continue };
            cmd.in_waitq = false;
            if !self.wants_chunk(ci) {
                continue;
            }
            if !self.may_take(ci) {
                let since = self.cmd(ci).waiting_since;
                self.wait_for_chunk(ci, since);
                passed_over += 1;
                continue;
            }
            passed_over = 0;
            let c = self.alloc_for(ci);
            self.issue(ci, c);
            if self.cmds[ci as usize].is_some() && self.wants_chunk(ci) {
                // It got a chunk: its wait for the next starts now.
                self.wait_for_chunk(ci, now);
            }
        }
    }

    /// Puts a command at the back of the line for a chunk (a control
    /// command's buffer at the front), waiting since `since`.
    fn wait_for_chunk(&mut self, ci: u32, since: Instant) {
        let was_empty = self.waitq.is_empty();
        let cmd = self.cmd(ci);
        cmd.in_waitq = true;
        cmd.waiting_since = since;
        if cmd.kind == Kind::Buffer {
            self.waitq.push_front(ci);
        } else {
            self.waitq.push_back(ci);
        }
        self.waitq_oldest = match self.waitq_oldest {
            Some(oldest) if !was_empty => Some(oldest.min(since)),
            _ => Some(since),
        };
    }

    /// When the executor next has something to do on its own: the sweep
    /// for commands past `target.chunk_wait_timeout`, readahead's expiry.
    pub fn next_deadline(&self) -> Option<Instant> {
        let sweep = (!self.waitq.is_empty())
            .then(|| self.waitq_oldest.map(|oldest| (oldest + self.chunk_wait_timeout).max(self.chunk_sweep_after)))
            .flatten();
        [sweep, self.readahead.next_deadline()].into_iter().flatten().min()
    }

    /// Deadlines due at `now` (the turn's start is clock enough: seconds).
    pub fn check_deadlines(&mut self, now: Instant) {
        self.expire_chunk_waits(now);
        if self.readahead.next_deadline().is_some_and(|due| now >= due) {
            self.readahead.expire(now);
            self.release_readahead();
        }
    }

    /// Gives up every command that has waited for a chunk longer than
    /// `target.chunk_wait_timeout` (since it queued, or since its last
    /// chunk): it fails `OutOfBuffers`, once, after the chunks it has in
    /// flight have finished. The pool cannot serve it in time: its
    /// session's or host's chunks do not come back (a peer that stopped
    /// reading), or others hold the whole pool.
    fn expire_chunk_waits(&mut self, now: Instant) {
        let due = (!self.waitq.is_empty()).then(|| self.waitq_oldest.map(|o| (o + self.chunk_wait_timeout).max(self.chunk_sweep_after)));
        if due.flatten().is_none_or(|due| now < due) {
            return;
        }
        let timeout = self.chunk_wait_timeout;
        let mut q = std::mem::take(&mut self.waitq);
        let mut expired = std::mem::take(&mut self.chunk_expired);
        let mut oldest: Option<Instant> = None;
        q.retain(|&ci| {
            // One that no longer wants a chunk (failed, abandoned) waits for
            // no deadline; `pump_waitq` drops it.
            let Some(cmd) = self.cmds.get(ci as usize).and_then(|c| c.as_ref()).filter(|_| self.wants_chunk(ci)) else {
                return true;
            };
            if now.saturating_duration_since(cmd.waiting_since) >= timeout {
                expired.push(ci);
                return false;
            }
            oldest = Some(oldest.map_or(cmd.waiting_since, |o| o.min(cmd.waiting_since)));
            true
        });
        self.waitq = q;
        self.waitq_oldest = oldest;
        self.chunk_sweep_after = now + CHUNK_SWEEP_INTERVAL;
        let Some(&first) = expired.first() else {
            self.chunk_expired = expired;
            return;
        };
        let (kind, since, who) = {
            let cmd = self.cmds[first as usize].as_ref().expect("live command");
            let who: Vec<&str> = cmd.accounts.iter().flatten().map(|a| a.name()).collect();
            (cmd.kind, cmd.waiting_since, if who.is_empty() { "-".to_owned() } else { who.join(" ") })
        };
        let pool = self.engine.pool();
        tracing::warn!(
            "reactor {}: {} commands waited more than {timeout:?} for a pool chunk (target.chunk_wait_timeout) and are answered OutOfBuffers; {} of {} chunks in use, {} commands still waiting; the first: a {kind:?} of {who} that waited {:?}",
            self.id,
            expired.len(),
            pool.capacity() - pool.free_count(),
            pool.capacity(),
            self.waitq.len(),
            now.saturating_duration_since(since)
        );
        self.stats.chunk_wait_timeouts.add(expired.len() as u64);
        for &ci in &expired {
            let cmd = self.cmd(ci);
            cmd.in_waitq = false;
            let waited = now.saturating_duration_since(cmd.waiting_since).as_millis().min(u32::MAX as u128) as u32;
            cmd.error.get_or_insert(ErrorKind::OutOfBuffers(waited));
            self.progress(ci);
        }
        expired.clear();
        self.chunk_expired = expired;
    }

    fn issue(&mut self, ci: u32, c: ChunkId) {
        let chunk_size = self.engine.chunk_size() as u32;
        let cmd = self.cmd(ci);
        match cmd.kind {
            Kind::Read | Kind::Write => {
                let off = cmd.next;
                let len = chunk_size.min(cmd.len - off);
                cmd.next += len;
                cmd.inflight += 1;
                let (kind, null) = (cmd.kind, cmd.null);
                self.chunk_use[c.0 as usize] = ChunkUse { cmd: ci, off, len, zero: null && kind == Kind::Read };
                if kind == Kind::Read && null {
                    // Zeroes, sent from the zero chunk; the chunk only
                    // accounts for the work (back-pressure, SQ room).
                    self.read_chunk_done(ci, c);
                } else if kind == Kind::Read {
                    self.read_piece(ci, c);
                } else {
                    self.emit(ci, Event::Fetch { chunk: c, off, len });
                }
            }
            Kind::Buffer => {
                cmd.next = 1;
                cmd.inflight += 1;
                if let Some(a) = &cmd.accounts[0] {
                    a.add_buffers(1);
                }
                self.chunk_use[c.0 as usize] = ChunkUse { cmd: ci, off: 0, len: chunk_size, zero: false };
                self.emit(ci, Event::Buffer { chunk: c });
            }
            Kind::Flush | Kind::Range => self.engine.pool_mut().release(c),
        }
    }

    /// A read's chunk holds its piece (or, for the null backend, stands for
    /// zeroes): the owner sends it, once every piece before it went (a
    /// piece finished early waits in `early`). Stays counted in flight
    /// until `sent`.
    fn read_chunk_done(&mut self, ci: u32, chunk: ChunkId) {
        let ChunkUse { off, len, .. } = self.chunk_use[chunk.0 as usize];
        let cmd = self.cmd(ci);
        cmd.done += len;
        if off != cmd.emitted {
            // At most CHUNK_WINDOW pieces are in flight, this one among them.
            cmd.early.push(chunk);
            return;
        }
        self.emit_read(ci, chunk);
        loop {
            let cmd = self.cmds[ci as usize].as_ref().expect("live command");
            let Some(i) = cmd.early.iter().position(|c| self.chunk_use[c.0 as usize].off == cmd.emitted) else { break };
            let next = self.cmd(ci).early.swap_remove(i);
            self.emit_read(ci, next);
        }
    }

    /// Hands a read's next piece in order to its owner.
    fn emit_read(&mut self, ci: u32, chunk: ChunkId) {
        let use_ = self.chunk_use[chunk.0 as usize];
        let cmd = self.cmd(ci);
        cmd.emitted += use_.len;
        let last = cmd.emitted == cmd.len;
        if last {
            self.record_io(ci, true);
        }
        self.emit(ci, Event::Read { chunk, off: use_.off, len: use_.len, zero: use_.zero, last });
    }

    /// Writes a chunk of a write to the disk (through the ring), unless
    /// fault injection holds its session's writes (test-only). The chunk
    /// stays counted in flight.
    fn write_chunk(&mut self, ci: u32, c: ChunkId) {
        let cmd = self.cmd(ci);
        cmd.at_disk = true;
        if crate::fault::enabled() {
            let (vslot, key) = (cmd.vslot, cmd.hold_key);
            if let Some(session) = key.filter(|&id| crate::fault::holds(id)) {
                let vol = Arc::clone(self.volume(vslot));
                match self.engine.hold_write(&vol, session, tag(U_HOLD, ci, c.0)) {
                    Ok(()) => return,
                    Err(e) => tracing::error!("reactor {}: cannot hold a write: {e}", self.id),
                }
            }
        }
        self.submit_write(ci, c);
    }

    /// Queues a chunk's disk write (counted in flight by the caller).
    fn submit_write(&mut self, ci: u32, c: ChunkId) {
        let use_ = self.chunk_use[c.0 as usize];
        let cmd = self.cmds[ci as usize].as_ref().expect("live command");
        let (offset, fua) = (cmd.offset + use_.off as u64, cmd.fua);
        let vol = Arc::clone(self.volume(cmd.vslot));
        if let Err(e) = self.engine.write(&vol, c, use_.len, offset, fua, tag(U_WRITE, ci, c.0)) {
            self.engine.pool_mut().release(c);
            self.cmd(ci).inflight -= 1;
            self.engine_refused(ci, &e);
            self.progress(ci);
        }
    }

    /// Decides what a command does next after one of its operations finished.
    fn progress(&mut self, ci: u32) {
        let Some(cmd) = self.cmds.get(ci as usize).and_then(|c| c.as_ref()) else { return };
        if cmd.error.is_some() || cmd.abandoned {
            // The pieces held for an earlier one that failed (or whose
            // owner left) are never sent.
            while let Some(c) = self.cmd(ci).early.pop() {
                self.cmd(ci).inflight -= 1;
                self.engine.pool_mut().release(c);
            }
            if self.cmd(ci).in_waitq {
                self.waitq.retain(|&x| x != ci);
                self.cmd(ci).in_waitq = false;
            }
            if self.cmds[ci as usize].as_ref().is_some_and(|c| c.inflight == 0) {
                self.finish(ci);
            }
            return;
        }
        let finished = match cmd.kind {
            Kind::Read | Kind::Write => cmd.done == cmd.len && cmd.inflight == 0,
            Kind::Buffer => cmd.next == 1 && cmd.inflight == 0,
            Kind::Flush | Kind::Range => cmd.inflight == 0,
        };
        if finished {
            self.finish(ci);
        } else {
            self.pump(ci);
        }
    }

    /// Nothing of the command is in flight: its write epochs move again,
    /// it is counted, its owner hears `Done`, and its id is free.
    fn finish(&mut self, ci: u32) {
        self.end_write(ci);
        let cmd = self.cmds[ci as usize].as_ref().expect("live command");
        let ok = cmd.error.is_none() && !cmd.abandoned;
        if !cmd.abandoned {
            self.record_io(ci, ok);
        }
        // The id is free once its owner took the `Done` (`pop_event`).
        let cmd = self.cmds[ci as usize].take().expect("live command");
        if let (Kind::Buffer, 1, Some(a)) = (cmd.kind, cmd.next, &cmd.accounts[0]) {
            // Its chunk is back (a command ends with nothing in flight).
            a.add_buffers(-1);
        }
        if cmd.in_waitq {
            self.waitq.retain(|&x| x != ci);
        }
        if cmd.vslot != NO_VOLUME {
            self.volume_done(cmd.vslot);
        }
        let result = match (cmd.error, cmd.abandoned) {
            (Some(k), _) => Err(k),
            (None, true) => Err(ErrorKind::ShuttingDown),
            (None, false) => Ok(()),
        };
        self.events.push_back((cmd.owner, CmdId(ci), Event::Done { result, reached_disk: cmd.at_disk }));
    }

    /// Counts a finished I/O command in its volume's metrics (once).
    fn record_io(&mut self, ci: u32, ok: bool) {
        let id = self.id;
        let cmd = self.cmds[ci as usize].as_mut().expect("live command");
        let Some(op) = cmd.metric.filter(|_| !cmd.recorded && cmd.vslot != NO_VOLUME) else { return };
        cmd.recorded = true;
        let bytes = match (&cmd.kind, &cmd.range) {
            (Kind::Read | Kind::Write, _) => cmd.len as u64,
            (Kind::Range, Some((_, ranges))) => ranges.iter().map(|r| r.1).sum(),
            _ => 0,
        };
        let (vslot, latency) = (cmd.vslot, cmd.timed.then(|| cmd.start.elapsed()));
        self.volume(vslot).stats.reactor(id).ops[op as usize].record(bytes, ok, latency);
    }

    // ---------------------------------------------------------------- readahead

    /// Counts a READ of a file volume in its stream and, once the stream
    /// is sequential, reads chunks ahead of it: never a chunk a command
    /// waits for, and never the last quarter of the pool.
    fn read_ahead(&mut self, vslot: u16, offset: u64, len: u32) {
        if !self.readahead.on_read(vslot, offset, len) {
            return;
        }
        let lv = self.vols.slots[vslot as usize].as_ref().expect("live volume slot");
        // Readahead serves file volumes only: they all have a descriptor.
        if lv.broken || lv.retiring {
            return;
        }
        let size = lv.vol.size;
        while self.waitq.is_empty() && self.engine.pool().free_count() > self.engine.pool().capacity() / 4 {
            let Some((at, n)) = self.readahead.want(vslot, size) else { break };
            let c = self.engine.pool_mut().alloc().expect("free chunk");
            // Taken before the read is submitted: a write that starts
            // later moves it.
            let epoch = self.volume(vslot).writes.of(at, n);
            self.readahead.issued(vslot, at, n, c, epoch);
            // The read holds the volume's slot (its fixed file) until it completes.
            self.vols.slots[vslot as usize].as_mut().expect("live volume slot").inflight += 1;
            let vol = Arc::clone(self.volume(vslot));
            if let Err(e) = self.engine.read(&vol, c, n, at, tag(U_READAHEAD, vslot as u32, c.0)) {
                tracing::debug!("reactor {}: no read ahead: {e}", self.id);
                self.readahead_done(vslot, c, -libc::EIO);
                break;
            }
        }
    }

    /// Reads a read's piece (`chunk_use[c]`) into its chunk `c`: from
    /// chunks read ahead when they hold it (waiting for their read if it is
    /// in flight), else from the disk. The piece stays counted in flight.
    fn read_piece(&mut self, ci: u32, c: ChunkId) {
        let use_ = self.chunk_use[c.0 as usize];
        let cmd = self.cmds[ci as usize].as_ref().expect("live command");
        let (vslot, offset) = (cmd.vslot, cmd.offset + use_.off as u64);
        let writes = &self.vols.slots[vslot as usize].as_ref().expect("live volume slot").vol.writes;
        let serve = self.readahead.lookup(vslot, offset, use_.len, c, |at, n| writes.of(at, n));
        match serve {
            Serve::Miss | Serve::Wait => {
                self.cmd(ci).at_disk = true;
                if serve == Serve::Miss {
                    let vol = Arc::clone(self.volume(vslot));
                    if let Err(e) = self.engine.read(&vol, c, use_.len, offset, tag(U_READ, ci, c.0)) {
                        self.engine.pool_mut().release(c);
                        self.cmd(ci).inflight -= 1;
                        self.engine_refused(ci, &e);
                        self.progress(ci);
                    }
                }
            }
            Serve::Take(ahead) => {
                // Zero copy: the chunk read ahead takes the place (and the
                // pool charge) of the command's own.
                self.engine.pool_mut().move_charge(c, ahead);
                self.engine.pool_mut().release(c);
                self.chunk_use[ahead.0 as usize] = use_;
                self.read_chunk_done(ci, ahead);
            }
            Serve::Copy(parts) => {
                for p in parts.into_iter().flatten() {
                    self.engine.pool_mut().copy_between(p.chunk, p.from as usize, c, p.to as usize, p.len as usize);
                }
                self.read_chunk_done(ci, c);
            }
        }
        // After the copy: chunks read through (or found stale) go back.
        self.release_readahead();
    }

    /// A read ahead completed: its chunk is cached (or dropped if it failed
    /// or became unusable meanwhile), and the pieces that waited for it are
    /// served again, from it or from the disk.
    fn readahead_done(&mut self, vslot: u16, c: ChunkId, res: i32) {
        if res < 0 {
            tracing::debug!("reactor {}: a read ahead failed: {}", self.id, std::io::Error::from_raw_os_error(-res));
        }
        let mut waiters = std::mem::take(&mut self.readahead_waiters);
        self.readahead.completed(vslot, c, res, Instant::now(), &mut waiters);
        self.release_readahead();
        for &w in &waiters {
            let ci = self.chunk_use[w.0 as usize].cmd;
            let cmd = self.cmd(ci);
            if cmd.error.is_some() || cmd.abandoned {
                cmd.inflight -= 1;
                self.engine.pool_mut().release(w);
                self.progress(ci);
            } else {
                self.read_piece(ci, w);
            }
        }
        waiters.clear();
        self.readahead_waiters = waiters;
        self.volume_done(vslot);
    }

    /// Gives the chunks readahead let go of back to the pool.
    fn release_readahead(&mut self) {
        while let Some(c) = self.readahead.take_released() {
            self.engine.pool_mut().release(c);
        }
    }

    /// Whether the pool has a chunk for a command, after giving back the
    /// oldest chunk cached by readahead if it had none.
    fn chunk_for_command(&mut self) -> bool {
        if self.engine.pool().free_count() > 0 {
            return true;
        }
        let evicted = self.readahead.evict();
        self.release_readahead();
        evicted
    }

    /// A write starts, before any of its disk I/O is submitted: what was
    /// read ahead of its ranges, by this executor or any other, is
    /// unusable from now on (`backend::WriteEpochs`).
    fn begin_write(&mut self, ci: u32) {
        let cmd = self.cmds[ci as usize].as_ref().expect("live command");
        let vslot = cmd.vslot;
        let ranges = self.ranges_of(ci);
        let vol = Arc::clone(self.volume(vslot));
        for &(offset, len) in ranges.iter() {
            vol.writes.bump(offset, len);
            self.readahead.invalidate(vslot, offset, len);
        }
        self.cmd(ci).write_epoch_open = true;
        self.release_readahead();
    }

    /// A write has nothing in flight any more (done, or abandoned): its
    /// ranges' epochs move again, so that what was read ahead while it was
    /// in flight is not served after it.
    fn end_write(&mut self, ci: u32) {
        let cmd = self.cmds[ci as usize].as_ref().expect("live command");
        if !cmd.write_epoch_open || cmd.inflight > 0 {
            return;
        }
        let vol = Arc::clone(self.volume(cmd.vslot));
        for &(offset, len) in self.ranges_of(ci).iter() {
            vol.writes.bump(offset, len);
        }
        self.cmd(ci).write_epoch_open = false;
    }

    /// The byte ranges a write or range command changes.
    fn ranges_of(&self, ci: u32) -> ByteRanges {
        let cmd = self.cmds[ci as usize].as_ref().expect("live command");
        match &cmd.range {
            Some((_, ranges)) => ranges.clone(),
            None => ByteRanges::One((cmd.offset, cmd.len as u64)),
        }
    }

    /// Publishes the executor's gauges (once per turn).
    pub fn publish_stats(&self) {
        let pool = self.engine.pool();
        // Readahead's chunks are a cache it gives back on demand: counted apart.
        let taken = pool.capacity() - pool.free_count();
        self.stats.pool_in_use.set(taken.saturating_sub(self.readahead.held()) as u64);
        self.stats.pool_waiting.set(self.waitq.len() as u64);
        let c = self.readahead.counters;
        self.stats.readahead_issued.set(c.issued);
        self.stats.readahead_hits.set(c.hits);
        self.stats.readahead_unused.set(c.unused);
        self.stats.readahead_invalidated.set(c.invalidated);
        self.stats.readahead_chunks.set(self.readahead.held() as u64);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::auth::AccessPolicy;
    use crate::backend::open_volumes;
    use crate::config::Config;

    /// An executor over one memory volume of 1 MiB, and the volume's slot.
    fn executor() -> (Executor, u16) {
        let text = "[target]\nlisten = [\"tcp://127.0.0.1:0\"]\n[[volume]]\nname = \"m\"\nbackend = \"memory\"\nsize = \"1MiB\"\nallow_any_host = true\n";
        let config = Config::parse(text, "test").unwrap();
        let set = VolumeSet::new(1, open_volumes(&config).unwrap()).with_access(Arc::new(AccessPolicy::load(&config).unwrap()));
        let exec = Executor::standalone(Arc::new(Publication::new(set)), 4 << 17, 1 << 17).unwrap();
        let slot = exec.slot_of_index(0).unwrap();
        (exec, slot)
    }

    fn request(op: Op, vslot: u16, offset: u64, len: u32) -> Request {
        Request { op, vslot, offset, len, metric: None, start: Instant::now(), timed: false, accounts: [None, None], hold_key: None }
    }

    /// Reaps until `n` events wait (submitting what is queued).
    fn events(exec: &mut Executor, n: usize) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while exec.events.len() < n {
            assert!(Instant::now() < deadline, "{} of {n} events after 10 s", exec.events.len());
            exec.engine_mut().submit().unwrap();
            exec.reap();
            exec.pump_waitq();
        }
    }

    #[test]
    fn an_id_is_not_given_again_before_its_done_was_handed_out() {
        let (mut exec, vslot) = executor();
        let owner = Owner { transport: 1, tag: 1 };
        let first = exec.submit(owner, request(Op::Flush, vslot, 0, 0)).unwrap();
        events(&mut exec, 1);
        // Its Done waits for its owner; a new command meanwhile gets another
        // id, so that the Done cannot be taken for the new command's.
        let second = exec.submit(owner, request(Op::Flush, vslot, 0, 0)).unwrap();
        assert_ne!(first, second, "an id given again while its Done waited");
        assert!(matches!(exec.pop_event(), Some((_, id, Event::Done { result: Ok(()), .. })) if id == first));
        events(&mut exec, 1);
        assert!(matches!(exec.pop_event(), Some((_, id, Event::Done { .. })) if id == second));
        // Both handed out: the ids are free again.
        assert_eq!(exec.live(), 0);
        let third = exec.submit(owner, request(Op::Flush, vslot, 0, 0)).unwrap();
        assert!(third == first || third == second, "a freed id is used again");
    }

    #[test]
    fn a_write_is_fetched_written_and_read_back_piece_by_piece() {
        let (mut exec, vslot) = executor();
        let owner = Owner { transport: 1, tag: 9 };
        // Three chunks' worth: pieces of 128 KiB, each fetched before it is written.
        let len = 3 << 17;
        let w = exec.submit(owner, request(Op::Write { fua: false }, vslot, 0, len)).unwrap();
        let mut fetched = 0;
        while fetched < 3 {
            events(&mut exec, 1);
            match exec.pop_event() {
                Some((o, id, Event::Fetch { chunk, off, len })) => {
                    assert_eq!((o, id), (owner, w));
                    exec.bytes_mut(chunk)[..len as usize].fill(off as u8 + 1);
                    exec.placed(chunk, true);
                    fetched += 1;
                }
                other => panic!("{other:?}"),
            }
        }
        events(&mut exec, 1);
        assert!(matches!(exec.pop_event(), Some((_, id, Event::Done { result: Ok(()), reached_disk: true })) if id == w));
        let r = exec.submit(owner, request(Op::Read, vslot, 0, len)).unwrap();
        let mut seen = 0;
        loop {
            events(&mut exec, 1);
            match exec.pop_event() {
                Some((_, id, Event::Read { chunk, off, len, zero: false, last })) => {
                    assert_eq!(id, r);
                    assert!(exec.bytes(chunk)[..len as usize].iter().all(|&b| b == off as u8 + 1), "piece at {off}");
                    seen += len;
                    exec.sent(chunk);
                    if last {
                        break;
                    }
                }
                other => panic!("{other:?}"),
            }
        }
        assert_eq!(seen, len);
        events(&mut exec, 1);
        assert!(matches!(exec.pop_event(), Some((_, id, Event::Done { result: Ok(()), .. })) if id == r));
    }

    /// An executor with readahead (4 MiB) over a file volume of `size`
    /// bytes of random content; returns the content too.
    fn executor_on_file(dir: &std::path::Path, size: usize) -> (Executor, u16, Vec<u8>) {
        use rand::RngCore;
        let mut content = vec![0u8; size];
        rand::rngs::OsRng.fill_bytes(&mut content);
        let path = dir.join("vol.img");
        std::fs::write(&path, &content).unwrap();
        let text = format!(
            "[target]\nlisten = [\"tcp://127.0.0.1:0\"]\n[[volume]]\nname = \"f\"\nbackend = \"file\"\npath = \"{}\"\nsize = {size}\nallow_any_host = true\n",
            path.display()
        );
        let config = Config::parse(&text, "test").unwrap();
        let set = VolumeSet::new(1, open_volumes(&config).unwrap()).with_access(Arc::new(AccessPolicy::load(&config).unwrap()));
        let exec = Executor::standalone_with_readahead(Arc::new(Publication::new(set)), 64 << 17, 1 << 17, 4 << 20).unwrap();
        let slot = exec.slot_of_index(0).unwrap();
        (exec, slot, content)
    }

    /// Reads `len` at `offset` to its Done, giving each piece back; returns
    /// the pieces' (offset, bytes) as they came.
    fn read_all(exec: &mut Executor, vslot: u16, offset: u64, len: u32) -> Vec<(u32, Vec<u8>)> {
        let r = exec.submit(Owner { transport: 1, tag: 2 }, request(Op::Read, vslot, offset, len)).unwrap();
        let mut pieces = Vec::new();
        loop {
            events(exec, 1);
            match exec.pop_event() {
                Some((_, id, Event::Read { chunk, off, len, .. })) if id == r => {
                    pieces.push((off, exec.bytes(chunk)[..len as usize].to_vec()));
                    exec.sent(chunk);
                }
                Some((_, id, Event::Done { result: Ok(()), .. })) if id == r => return pieces,
                other => panic!("{other:?}"),
            }
        }
    }

    /// A read of 144 KiB at 2.5 chunks, after `stream_with_chunks_read_ahead`:
    /// piece 0 (2.5 to 3.5 chunks) is read from the disk, piece 1 (3.5 to
    /// 3.625) comes from the chunk read ahead at 3, at once.
    const SPLIT_READ: (u64, u32) = (5 << 16, (1 << 17) + (16 << 10));

    /// Three reads of a chunk from 0 make a sequential stream; returns once
    /// the chunks read ahead of it (from 3 chunks on) are in.
    fn stream_with_chunks_read_ahead(exec: &mut Executor, vslot: u16) {
        for k in 0..3u64 {
            read_all(exec, vslot, k << 17, 1 << 17);
        }
        assert!(exec.readahead.counters.issued > 0, "the stream read nothing ahead");
        let deadline = Instant::now() + Duration::from_secs(10);
        while exec.vols.slots[vslot as usize].as_ref().expect("live volume slot").inflight > 0 {
            assert!(Instant::now() < deadline, "reads ahead still in flight after 10 s");
            exec.engine_mut().submit().unwrap();
            exec.reap();
        }
    }

    #[test]
    fn a_reads_pieces_come_in_order_when_a_later_one_was_read_ahead() {
        let dir = tempfile::tempdir().unwrap();
        let (mut exec, vslot, content) = executor_on_file(dir.path(), 4 << 20);
        stream_with_chunks_read_ahead(&mut exec, vslot);
        let hits = exec.readahead.counters.hits;
        let (offset, len) = SPLIT_READ;
        let pieces = read_all(&mut exec, vslot, offset, len);
        assert_eq!(exec.readahead.counters.hits, hits + 1, "the second piece was not served from readahead");
        let offsets: Vec<u32> = pieces.iter().map(|p| p.0).collect();
        assert_eq!(offsets, [0, 1 << 17], "the pieces' order");
        let got: Vec<u8> = pieces.into_iter().flat_map(|p| p.1).collect();
        assert!(got == content[offset as usize..][..len as usize], "the read's bytes");
    }

    #[test]
    fn an_abandoned_read_gives_back_a_piece_held_for_an_earlier_one() {
        let dir = tempfile::tempdir().unwrap();
        let (mut exec, vslot, _) = executor_on_file(dir.path(), 4 << 20);
        stream_with_chunks_read_ahead(&mut exec, vslot);
        let hits = exec.readahead.counters.hits;
        let r = exec.submit(Owner { transport: 1, tag: 4 }, request(Op::Read, vslot, SPLIT_READ.0, SPLIT_READ.1)).unwrap();
        // Piece 1 is in, held for piece 0, which is at the disk.
        assert_eq!(exec.readahead.counters.hits, hits + 1);
        assert!(exec.pop_event().is_none(), "a piece handed out before the one ahead of it");
        exec.abandon(r);
        events(&mut exec, 1);
        assert!(matches!(exec.pop_event(), Some((_, id, Event::Done { result: Err(ErrorKind::ShuttingDown), .. })) if id == r));
        assert_eq!(exec.live(), 0);
        // Both pieces' chunks are back: every chunk is free or readahead's.
        let pool = exec.engine().pool();
        assert_eq!(pool.free_count() + exec.readahead.held(), pool.capacity());
    }

    #[test]
    fn an_abandoned_command_drops_what_has_not_reached_the_disk() {
        let (mut exec, vslot) = executor();
        let owner = Owner { transport: 1, tag: 3 };
        let w = exec.submit(owner, request(Op::Write { fua: false }, vslot, 0, 4096)).unwrap();
        events(&mut exec, 1);
        let Some((_, _, Event::Fetch { chunk, .. })) = exec.pop_event() else { panic!("a fetch") };
        // The owner's connection fails before the data came: the piece
        // comes back unplaced and nothing reaches the disk.
        exec.abandon(w);
        exec.placed(chunk, false);
        events(&mut exec, 1);
        assert!(matches!(exec.pop_event(), Some((_, id, Event::Done { result: Err(_), reached_disk: false })) if id == w));
        assert_eq!(exec.engine().pool().free_count(), exec.engine().pool().capacity(), "every chunk back");
    }

    #[test]
    fn sessions_that_never_give_chunks_back_leave_a_newcomer_its_chunk_whatever_their_order() {
        // Sessions arrive one after another, each takes what the rule lets
        // it and gives nothing back (peers that stop reading).
        for capacity in [8u32, 64, 512, 4096] {
            let (mut available, mut holders) = (capacity, 0u32);
            let mut held = Vec::new();
            while available > CONTROL_RESERVE.min(capacity / 16) {
                let mut mine = 0;
                while fair_take(capacity, available, holders + u32::from(mine > 0), mine) {
                    mine += 1;
                    available -= 1;
                }
                assert!(mine >= 1, "capacity {capacity}: session {} got nothing with {available} available", held.len());
                held.push(mine);
                holders += 1;
                // Every session keeps no more than its fair share when it arrived.
                assert!(mine <= (capacity / holders).max(1), "capacity {capacity}: session {} holds {mine}", holders);
            }
            // Only once a quarter of the pool's chunks are each held by
            // another session does a newcomer find none.
            assert!(held.len() as u32 >= capacity / 4, "capacity {capacity}: {} sessions locked the pool: {held:?}", held.len());
        }
        // Alone, a session may take half the pool.
        assert!(fair_take(512, 257, 1, 255) && !fair_take(512, 256, 1, 256));
        // Past the newcomers' quarter, a session that holds chunks gets no more.
        assert!(!fair_take(512, 128, 5, 1) && fair_take(512, 128, 5, 0));
        assert!(fair_take(512, 512, 0, 0));
        // A newcomer may not take the control reserve.
        assert!(!fair_take(512, 2, 40, 0) && fair_take(512, 3, 40, 0));
    }

    #[test]
    fn a_newcomer_and_a_control_buffer_get_chunks_while_others_hold_theirs() {
        let (mut exec, vslot) = executor(); // 4 chunks of 128 KiB
        let account = |name: &str| Some(Arc::new(PoolAccount::named(name)));
        let read = |who: &Option<Arc<PoolAccount>>, len: u32| Request { accounts: [who.clone(), None], ..request(Op::Read, vslot, 0, len) };
        let (a, b, c) = (account("a"), account("b"), account("c"));
        // a's 512 KiB read: it takes its share (half) and waits for the rest;
        // its owner never sends what it read.
        let ra = exec.submit(Owner { transport: 1, tag: 1 }, read(&a, 512 << 10)).unwrap();
        events(&mut exec, 2);
        assert_eq!(a.as_ref().unwrap().held(), 2);
        // b, a newcomer, gets a chunk at once although a waits in line first.
        let rb = exec.submit(Owner { transport: 1, tag: 2 }, read(&b, 512 << 10)).unwrap();
        events(&mut exec, 3);
        assert_eq!(b.as_ref().unwrap().held(), 1);
        assert_eq!(exec.engine().pool().free_count(), 1);
        // A control command's buffer goes ahead of both.
        let buffer = Request { op: Op::Buffer, vslot: NO_VOLUME, accounts: [c.clone(), None], ..request(Op::Buffer, NO_VOLUME, 0, 0) };
        let rc = exec.submit(Owner { transport: 1, tag: 3 }, buffer).unwrap();
        events(&mut exec, 4);
        let mut got = Vec::new();
        while let Some((_, id, ev)) = exec.pop_event() {
            got.push((id, matches!(ev, Event::Buffer { .. })));
        }
        assert_eq!(got.iter().filter(|(id, _)| *id == ra).count(), 2, "{got:?}");
        assert_eq!(got.iter().filter(|(id, _)| *id == rb).count(), 1, "{got:?}");
        assert!(got.contains(&(rc, true)), "the buffer: {got:?}");
        assert_eq!(exec.engine().pool().free_count(), 0);
    }

    #[test]
    fn a_session_that_never_takes_its_list_answers_holds_no_more_than_its_share() {
        let (mut exec, _) = executor(); // 4 chunks
        let buffer = |who: &Arc<PoolAccount>| Request { accounts: [Some(Arc::clone(who)), None], ..request(Op::Buffer, NO_VOLUME, 0, 0) };
        let (c, d) = (Arc::new(PoolAccount::named("c")), Arc::new(PoolAccount::named("d")));
        // c posts four LISTs and never sends their answers back.
        for tag in 0..4 {
            exec.submit(Owner { transport: 1, tag }, buffer(&c)).unwrap();
        }
        events(&mut exec, 2);
        assert_eq!((c.held(), c.buffers()), (2, 2), "its fair share as the only holder: half");
        // Another session's LIST gets a chunk at once.
        exec.submit(Owner { transport: 1, tag: 9 }, buffer(&d)).unwrap();
        events(&mut exec, 3);
        assert_eq!((d.held(), d.buffers()), (1, 1));
        // When c's answers go back, its other LISTs are served, and every
        // count returns to zero.
        while c.held() + d.held() > 0 || exec.live() > 0 {
            match exec.pop_event() {
                Some((_, _, Event::Buffer { chunk })) => exec.sent(chunk),
                Some(_) => {}
                None => {
                    exec.pump_waitq();
                    events(&mut exec, 1);
                }
            }
        }
        assert_eq!((c.buffers(), d.buffers()), (0, 0));
        assert_eq!(exec.engine().pool().free_count(), 4);
    }

    #[test]
    fn tags_roundtrip_and_leave_the_runtimes_kinds_alone() {
        let t = tag(U_FALLOC, 0xfffe_fffe, NO_CHUNK);
        assert_eq!(split_tag(t), (U_FALLOC, 0xfffe_fffe, NO_CHUNK));
        assert!(is_executor_tag(t) && is_executor_tag(tag(U_READAHEAD, 1, 2)));
        assert!(!is_executor_tag(8 << 60 | 5) && !is_executor_tag(0));
    }
}
