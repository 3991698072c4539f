//! Reactor threads: each owns a block engine ([`crate::engine`]: an
//! io_uring, a buffer pool, fixed files, a blocking worker), one completion
//! queue per fabric, its queue pairs and a slab of in-flight commands.
//!
//! A command's slab index is encoded into the io_uring `user_data` and into
//! the fabric `wr_id` (with the queue pair slot and its generation), so every
//! completion finds its command in O(1).
//!
//! One loop turn: poll the fabric CQs in batches, reap io_uring (and
//! blocking-worker) completions, hand free chunks to waiting commands, take
//! control messages, submit the io_uring batch once. When nothing happened:
//! arm the CQs, poll once more, then sleep until a disk completion, a CQ
//! event, a blocking-worker result, a control message or the next deadline.
//! The reactor's epoll set watches the CQ fds, the blocking worker's
//! eventfd and the control eventfd. Where the kernel allows it (see
//! [`crate::uring`]) the reactor sleeps in the ring itself: a one-shot poll
//! on the epoll fd (the wake poll) rides on the ring, so one
//! `io_uring_enter` both submits and waits, a disk completion wakes it
//! without an eventfd, and a fired wake poll is answered by clearing every
//! source (free on tcp, see `clear_wake_sources`) rather than by asking
//! epoll which one fired; while the ring holds nothing (no disk I/O, no
//! wake poll armed) it sleeps in `epoll_wait` on the same set, which is
//! cheaper for whoever wakes it (see `idle_wait`). Otherwise it blocks in
//! `epoll_wait`, the ring's eventfd being in the set too. (On an iopoll ring, which cannot
//! carry the wake poll, the reactor keeps polling while disk I/O is in
//! flight.)
//!
//! Queue pairs of one session may live on different reactors. What they
//! share (the opened volumes) is read lock-free through the session's
//! [`SharedSession`]; the reactor keeps its own snapshot of the published
//! volume set (each volume's descriptor attached to the engine's fixed-file
//! table) and refreshes it when the registry's generation moves. A removed
//! volume keeps its slot until this reactor's last command on it finished.
//!
//! The reactor is the rdmablk v1 front end over a block engine, in files by
//! concern (one `Reactor` type, one `impl` per file):
//! - this file: the thread, its loop, sleeping and waking, control
//!   messages, deadlines;
//! - `v1`: what the v1 wire asks: sessions, capsules and their plans
//!   (`crate::command`), CONNECT, the fence, authentication, answers;
//! - `fabric_io`: the completion queues and the RDMA READ/WRITE/SEND
//!   work that moves data between the initiator and the pool;
//! - `disk`: the commands' disk side: command slab, pool chunks and their
//!   waits, the engine operations they issue and their completions,
//!   readahead, volume slots, per-volume counters. Nothing there reads or
//!   writes the v1 wire.

use std::collections::VecDeque;
use std::sync::{mpsc, Arc};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use rdmablk_common::fabric::{
    Access, Completion, CompletionQueue, ConnectRequest, Fabric, Payload, ProtectionDomain, QpCaps, QpNum, QpState,
    QueuePair, RecvWr, Rkey, SendOp, SendWr, Sge, WcStatus, WrId,
};
use rdmablk_common::protocol::{
    CommandId, ConnectReply, DataDescriptor, ResponseCapsule, SessionId, Status, COMMAND_CAPSULE_SIZE, CONNECT_INLINE_MAX, MAX_NAME_LEN,
    RESPONSE_CAPSULE_SIZE, RESPONSE_SLOT_SIZE, VOLUME_INFO_SIZE,
};

use crate::backend::{Backend, RangeOp, Volume, VolumeSet};
use crate::engine::BlockEngine;
use crate::command::{self, IoPlan, Limits, Plan, SessionState, WriteSource};
use crate::config::{TargetConfig, MAX_VOLUMES};
use crate::error::{Error, ErrorKind, Result};
use crate::metrics::{self, ReactorStats};
use crate::pool::{ChunkId, Pool, PoolRegion, SlotBuf};
use crate::readahead::{self, Readahead, Serve};
use crate::session::{Admission, ConnectionSlot, HandshakeSlot, OpenSet, Registry, SharedSession};
use crate::sys::{self, Epoll, EventFd};
use crate::uring::UringOptions;

mod disk;
mod fabric_io;
mod v1;

/// Most pool chunks one command may have in flight at once.
pub const CHUNK_WINDOW: u32 = 8;
/// Queue pairs one completion queue is sized for. A reactor creates
/// another completion queue when its queues are full, so this bounds the
/// size of each (and a device's `max_cqe`), not how many queue pairs a
/// reactor serves: that is up to `target.max_sessions` and
/// `target.max_queues_per_session`.
pub const QPS_PER_CQ: u32 = 64;
/// How long a failed queue pair may take to flush its work requests
/// before it is destroyed regardless.
pub const FLUSH_TIMEOUT: Duration = Duration::from_secs(5);
/// Size of each ring's fixed-file table: room for every volume plus as many
/// removed ones still finishing their last commands.
pub const RING_FILE_SLOTS: u32 = 2 * MAX_VOLUMES as u32;
/// How long the tcp provider may hold a command's acknowledgement back for
/// the response to carry it: far longer than a disk read usually takes, so
/// that the reactor does not send an ACK frame of its own for every command
/// that waits for the disk (and the initiator is not woken for it). A
/// reactor asleep meanwhile is woken by the CQ's timer when the hold ends.
/// The initiator needs the acknowledgement only to reuse the command's
/// slot, which waits for the response anyway, and to know the target is
/// alive, which its transport timeout (4 s by default) asks 200 times later.
/// The timer is set when the reactor sleeps with an ACK held and nothing
/// armed, and fires once per hold while commands keep coming (one carried
/// since only costs that wake-up): with a 1 ms hold that was a
/// `timerfd_settime` of about 10 µs (a VM exit to reprogram the timer) ahead
/// of the disk read on one in eight I/Os at file QD1, and a wake-up per
/// millisecond (BENCHMARKS.md, "Issue 20, tenth look").
const ACK_HOLD: Duration = Duration::from_millis(20);
/// Least time between two sweeps of the wait line for commands past
/// `target.chunk_wait_timeout` (each is a pass over the line and a log
/// line): the first one due is answered on time, later ones within this.
const CHUNK_SWEEP_INTERVAL: Duration = Duration::from_millis(250);
const CQ_BATCH: usize = 64;
const CQ_ROUNDS: usize = 4;
const NONE16: u16 = u16::MAX;
/// `Cmd::op` of admin commands (not counted per volume).
const NO_OP: u8 = u8::MAX;

// wr_id layout: kind:4 | session generation:12 | session slot:16 | a:16 | b:16
const K_RECV: u64 = 1; // a = receive slot
const K_SEND: u64 = 2; // a = response slot, b = command
const K_RDMA: u64 = 3; // a = command, b = chunk
const K_SEND_NOSLOT: u64 = 4; // inline QUEUE_FULL response without a slot

fn wr_id(kind: u64, gen: u16, sess: u16, a: u16, b: u16) -> WrId {
    WrId(kind << 60 | ((gen as u64) & 0xfff) << 48 | (sess as u64) << 32 | (a as u64) << 16 | b as u64)
}

fn split_wr_id(w: WrId) -> (u64, u16, u16, u16, u16) {
    let v = w.0;
    (v >> 60, ((v >> 48) & 0xfff) as u16, (v >> 32) as u16, (v >> 16) as u16, v as u16)
}

// io_uring user_data layout: kind:4 | command:16 | chunk:16
const U_READ: u64 = 1;
const U_WRITE: u64 = 2;
const U_FSYNC: u64 = 3;
const U_FALLOC: u64 = 4;
/// BLKDISCARD / BLKZEROOUT on the blocking worker.
const U_BLKDEV: u64 = 5;
/// A disk write held by fault injection (`crate::fault`), on the blocking
/// worker; the write goes to the ring when the hold ends.
const U_HOLD: u64 = 6;
/// A read ahead (`crate::readahead`): no command; the command field holds
/// the volume slot.
const U_READAHEAD: u64 = 7;

fn ud(kind: u64, cmd: u16, chunk: u16) -> u64 {
    kind << 60 | (cmd as u64) << 16 | chunk as u64
}

fn split_ud(u: u64) -> (u64, u16, u16) {
    (u >> 60, (u >> 16) as u16, u as u16)
}

/// The epoll token of completion queue `ci` of fabric `fi` (below
/// `TOKEN_URING`, which is in the set only when the reactor sleeps in
/// epoll rather than in the ring).
fn cq_token(fi: usize, ci: usize) -> u64 {
    (fi as u64) << 20 | ci as u64
}

fn split_cq_token(t: u64) -> (usize, usize) {
    ((t >> 20) as usize, (t & 0xf_ffff) as usize)
}

const TOKEN_URING: u64 = 1 << 40;
const TOKEN_CTRL: u64 = (1 << 40) + 1;
const TOKEN_BLOCKING: u64 = (1 << 40) + 2;

/// Messages from the control thread.
pub(crate) enum Control {
    /// A connection request to accept (boxed: it is much larger than the
    /// other messages).
    Connect(Box<Accept>),
    /// Finish in-flight commands (until `deadline`), disconnect everything, exit.
    Shutdown { deadline: Instant },
}

/// A connection request to accept on fabric `fabric`; it holds one of the
/// `max_handshakes` slots until its CONNECT succeeds.
pub(crate) struct Accept {
    pub req: ConnectRequest,
    pub fabric: usize,
    pub admission: Admission,
}

/// What a reactor thread is started with.
pub(crate) struct ReactorSpec {
    pub id: usize,
    pub cfg: TargetConfig,
    pub registry: Arc<Registry>,
    pub fabrics: Vec<Arc<Fabric>>,
    pub cpu: Option<usize>,
    /// Notified when the reactor thread exits.
    pub exited: Arc<EventFd>,
    pub stats: Arc<ReactorStats>,
}

/// The control thread's handle on a reactor.
pub(crate) struct ReactorHandle {
    pub id: usize,
    pub tx: mpsc::Sender<Control>,
    pub wake: Arc<EventFd>,
    pub thread: Option<JoinHandle<Result<()>>>,
}

impl ReactorHandle {
    /// Sends a message and wakes the reactor. Returns the message back if
    /// the reactor is gone.
    pub fn send(&self, msg: Control) -> std::result::Result<(), Control> {
        self.tx.send(msg).map_err(|e| e.0)?;
        self.wake.notify();
        Ok(())
    }

    /// Wakes the reactor for one loop turn (it then picks up a new volume
    /// set and advances its heartbeat).
    pub fn wake(&self) {
        self.wake.notify();
    }

    /// Waits for the thread; a panic becomes an internal error.
    pub fn join(&mut self) -> Result<()> {
        match self.thread.take() {
            None => Ok(()),
            Some(t) => t
                .join()
                .unwrap_or_else(|_| Err(Error::new(ErrorKind::Internal, format!("reactor {} panicked", self.id)))),
        }
    }
}

/// Starts a reactor thread and waits until it is initialised.
pub(crate) fn spawn(spec: ReactorSpec) -> Result<ReactorHandle> {
    let id = spec.id;
    let (tx, rx) = mpsc::channel();
    let wake = Arc::new(EventFd::new().map_err(|e| Error::os("eventfd", e))?);
    let (ready_tx, ready_rx) = mpsc::sync_channel::<Result<()>>(1);
    let wake2 = Arc::clone(&wake);
    let thread = std::thread::Builder::new()
        .name(format!("rdmablk-r{id}"))
        .spawn(move || {
            let exited = Arc::clone(&spec.exited);
            let _notify = NotifyOnDrop(exited);
            let reactor = match Reactor::new(spec, rx, wake2) {
                Ok(r) => r,
                Err(e) => {
                    let _ = ready_tx.send(Err(e));
                    return Ok(());
                }
            };
            let _ = ready_tx.send(Ok(()));
            reactor.run()
        })
        .map_err(|e| Error::os("cannot spawn reactor thread", e))?;
    let mut handle = ReactorHandle { id, tx, wake, thread: Some(thread) };
    match ready_rx.recv() {
        Ok(Ok(())) => Ok(handle),
        Ok(Err(e)) => {
            let _ = handle.join();
            Err(e)
        }
        Err(_) => Err(handle.join().err().unwrap_or_else(|| Error::new(ErrorKind::Internal, "reactor failed to start"))),
    }
}

struct NotifyOnDrop(Arc<EventFd>);

impl Drop for NotifyOnDrop {
    fn drop(&mut self) {
        self.0.notify();
    }
}

/// Per-fabric resources of a reactor. Field order is drop order: the pool
/// region before the protection domain.
struct FabricCtx {
    pool_mr: PoolRegion,
    /// Created as queue pairs arrive (`Reactor::cq_with_room`); never fewer
    /// than one.
    cqs: Vec<CqCtx>,
    pd: ProtectionDomain,
    fabric: Arc<Fabric>,
}

/// One completion queue of a fabric and the entries its queue pairs may
/// fill. Every completion queue also keeps room for an RDMA operation of
/// every pool chunk, since any one queue pair may have all of them.
struct CqCtx {
    cq: CompletionQueue,
    /// Entries reserved by live queue pairs.
    reserved: u32,
    /// Entries it really holds (a device may allow fewer than asked for:
    /// rxe's `max_cqe` is 32767).
    capacity: u32,
}

/// A queue pair and its registered buffers. Field order is drop order: the
/// queue pair is destroyed before its buffers are deregistered.
struct QpRes {
    qp: QueuePair,
    recv: SlotBuf,
    resp: SlotBuf,
}

/// A queue pair (the reactor's view of one connection of a session).
struct Session {
    res: Option<QpRes>,
    fabric: usize,
    /// Index of its completion queue in `FabricCtx::cqs`.
    cq: usize,
    peer: String,
    qp_num: QpNum,
    state: SessionState,
    /// Set by CONNECT: the session this queue pair belongs to.
    shared: Option<Arc<SharedSession>>,
    queue_index: u16,
    free_resp: Vec<u16>,
    sq_used: u32,
    sq_cap: u32,
    max_inline: u32,
    recv_posted: u32,
    noslot_sends: u32,
    /// Receive slots (= configured queue depth).
    slots: u32,
    cq_reserved: u32,
    closing: Option<String>,
    close_deadline: Option<Instant>,
    /// Until CONNECT succeeds: the handshake slot and when it expires.
    handshake: Option<(HandshakeSlot, Instant)>,
    /// Counts against `max_connections_per_address` while it lives, and
    /// holds its source address's pool accounts (`host_pool_share`).
    _connection: ConnectionSlot,
    /// Send work requests of this turn, posted together at its end (one
    /// `post_send`: one `sendmsg` on tcp, one doorbell on verbs).
    tx: Vec<QueuedWr>,
    /// A CONNECT waiting for the session it replaces to be retired.
    fence: Option<Fence>,
    /// Commands of this queue pair in the slab (answered ones included,
    /// until their send completion).
    live_cmds: u32,
    /// Answers waiting for a response slot or send-queue room, in order.
    resp_wait: VecDeque<WaitingResponse>,
    /// When its last command (a keep-alive included) arrived, or it was
    /// accepted: for `target.idle_timeout`.
    last_heard: Instant,
}

/// An answer that found every response slot busy.
struct WaitingResponse {
    ci: u16,
    data: Vec<u8>,
    chain: Option<ChunkId>,
}

/// A CONNECT that passed its checks and has not been answered yet.
struct PendingConnect {
    cid: CommandId,
    start: Instant,
    negotiated: command::Negotiated,
    host_id: String,
    join: Option<SessionId>,
    reply: ConnectReply,
}

/// A CONNECT held by the reconnect fence until `old` has ended.
struct Fence {
    old: Arc<SharedSession>,
    since: Instant,
    deadline: Instant,
    connect: PendingConnect,
}

/// A send-queue work request waiting for the end of the reactor turn. Its
/// memory (a response slot or a pool chunk) stays reserved until its
/// completion, as when posted at once.
#[derive(Clone, Copy)]
struct QueuedWr {
    wr_id: WrId,
    op: SendOp,
    sge: Sge,
    inline: bool,
}

/// Work requests per `post_send` when a turn's queue is flushed.
const TX_CHUNK: usize = 16;

impl Session {
    fn host(&self) -> &str {
        self.state.host_id.as_deref().unwrap_or("-")
    }
}

struct SessionSlot {
    gen: u16,
    s: Option<Session>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum CmdKind {
    /// Answered right away (admin commands and validation failures).
    Immediate,
    List,
    Read,
    Write,
    WriteInline,
    Flush,
    /// DISCARD or WRITE_ZEROES.
    Range,
}

struct Cmd {
    sess: u16,
    cid: CommandId,
    kind: CmdKind,
    /// Local volume slot (= fixed-file slot); NONE16 for admin commands.
    vslot: u16,
    /// Index in [`metrics::IO_OPS`], or `NO_OP`.
    op: u8,
    /// When the capsule arrived.
    start: Instant,
    /// The volume's backend is `null`: no disk I/O.
    null: bool,
    offset: u64,
    len: u32,
    falloc_len: u64,
    remote: DataDescriptor,
    fua: bool,
    /// Bytes handed to chunks so far.
    next: u32,
    /// Bytes finished (READ: read from disk; WRITE: written to disk).
    done: u32,
    /// Chunks or operations in flight (io_uring or fabric).
    inflight: u32,
    error: Option<ErrorKind>,
    /// Receive slot still holding inline data.
    held_recv: Option<u16>,
    /// Part of it went to the disk (or the blocking worker): a command
    /// freed unanswered without this was dropped before the disk.
    at_disk: bool,
    in_waitq: bool,
    /// While `in_waitq`: since when it has been waiting for a chunk (it
    /// queued, or got its last chunk), for `target.chunk_wait_timeout`.
    waiting_since: Instant,
    /// Answered (or given up with its queue pair): no longer counted
    /// against the queue depth.
    responded: bool,
    /// A WRITE, WRITE_ZEROES or DISCARD that bumped its range's write epoch
    /// when it started and bumps it again once nothing of it is in flight
    /// (`end_write`), before it is answered.
    write_epoch_open: bool,
    /// Its answer waits for a response slot (`Session::resp_wait`).
    answer_waits: bool,
    send_inflight: bool,
    result: u64,
    list_entries: u32,
}

#[derive(Clone, Copy, Default)]
struct ChunkUse {
    cmd: u16,
    off: u32,
    len: u32,
    /// Send zeroes (the `null` backend's reads) instead of the chunk's bytes.
    zero: bool,
}

/// A volume as this reactor serves it.
struct LocalVolume {
    vol: Arc<Volume>,
    /// The engine could not register its descriptor: its commands fail
    /// with InternalError.
    broken: bool,
    /// Commands of this reactor on this volume, not yet finished.
    inflight: u32,
    /// Gone from the published set; released when `inflight` drops to 0.
    retiring: bool,
}

/// This reactor's snapshot of the published volume set.
struct LocalVolumes {
    generation: u64,
    set: Arc<VolumeSet>,
    /// Index = fixed-file slot.
    slots: Vec<Option<LocalVolume>>,
    /// Position in `set` → slot (NONE16 if it has none).
    by_index: Vec<u16>,
}

struct Reactor {
    // Field order is drop order: queue pairs, then fabric resources, then the
    // ring (which waits for in-flight operations), then the pool.
    sessions: Vec<SessionSlot>,
    /// Sessions with work requests queued this turn.
    tx_pending: Vec<u16>,
    free_sessions: Vec<u16>,
    fabrics: Vec<FabricCtx>,
    /// The ring, the pool, the fixed files and the blocking worker.
    engine: BlockEngine,
    id: usize,
    registry: Arc<Registry>,
    vols: LocalVolumes,
    stats: Arc<ReactorStats>,
    limits: Limits,
    queue_depth: u32,
    /// `target.handshake_timeout`: time from accept to a successful CONNECT.
    handshake_timeout: Duration,
    /// `target.session_pool_share` in chunks of this reactor's pool.
    pool_share: u32,
    /// `target.host_pool_share` in chunks of this reactor's pool.
    host_pool_share: u32,
    recv_slot_size: usize,
    cmds: Vec<Option<Cmd>>,
    free_cmds: Vec<u16>,
    waitq: VecDeque<u16>,
    /// No command in `waitq` has waited since before this (a lower bound:
    /// exact after each sweep, `None` when none waits for a deadline).
    waitq_oldest: Option<Instant>,
    /// `target.chunk_wait_timeout`.
    chunk_wait_timeout: Duration,
    /// The next sweep for commands past the timeout runs no earlier.
    chunk_sweep_after: Instant,
    /// Scratch list of the commands a sweep gives up (kept for its capacity).
    chunk_expired: Vec<u16>,
    chunk_use: Vec<ChunkUse>,
    rx: mpsc::Receiver<Control>,
    wake: Arc<EventFd>,
    epoll: Epoll,
    shutdown: Option<Instant>,
    wcs: Vec<Completion>,
    tokens: Vec<u64>,
    uring_done: Vec<(u64, i32)>,
    /// `[target] busy_poll`, and when the last turn with work ended.
    busy_poll: Duration,
    last_work: Instant,
    /// When this turn began (the wake-up, or the end of the turn before):
    /// the clock of what the turn does that needs no finer one (when a
    /// command arrived, deadlines of seconds), so a command costs no clock
    /// read of its own before its answer leaves.
    turn_start: Instant,
    /// The last sleep in the ring ended without the wake poll firing (a
    /// disk completion, or the timeout): the CQs, armed before it, had
    /// nothing, or the epoll fd would have been readable. The next turn
    /// skips polling them; the sleep after it arms them (and polls those
    /// that need it, see `arm_cqs`), so a completion that lands meanwhile
    /// ends that sleep at once or is found by that poll.
    fabrics_quiet: bool,
    /// `target.fence_timeout`.
    fence_timeout: Duration,
    /// `target.idle_timeout`.
    idle_timeout: Duration,
    /// The registry's fence generation this reactor has acted on.
    fence_generation: u64,
    /// Queue pairs with a CONNECT held by the fence.
    fences_waiting: u32,
    /// Sequential streams and the chunks read ahead of them.
    readahead: Readahead,
    /// Scratch list of the pieces that waited for a read ahead (kept for its capacity).
    readahead_waiters: Vec<ChunkId>,
}

/// Receive slot size: a capsule plus the largest inline payload any command may carry.
pub fn recv_slot_size(inline_data_size: u32) -> usize {
    let inline = (inline_data_size as usize).max(CONNECT_INLINE_MAX).max(MAX_NAME_LEN);
    (COMMAND_CAPSULE_SIZE + inline).div_ceil(64) * 64
}

/// Response slots per queue pair: twice the queue depth. The initiator may
/// send its next command as soon as it holds an answer, which can be before
/// the answer's send completion reaches the target (Soft-RoCE on Linux 6.12
/// and busy NICs report it late), so up to `queue_depth` unanswered
/// commands meet answers still waiting for their completions. An answer
/// that finds no free slot waits for one (`Session::resp_wait`).
pub fn response_slots(queue_depth: u32) -> u32 {
    2 * queue_depth
}

/// Completion-queue entries one queue pair may have outstanding, per unit
/// of queue depth: its receives, its responses and its inline QUEUE_FULL
/// answers (RDMA operations are bounded by the pool, counted once).
const CQ_ENTRIES_PER_DEPTH: u32 = 4;

/// Send queue depth requested per queue pair: responses, inline QUEUE_FULL
/// answers, and RDMA operations of every chunk that may be in flight.
pub fn send_queue_depth(queue_depth: u32, pool_chunks: u32) -> u32 {
    response_slots(queue_depth) + queue_depth + pool_chunks.min(queue_depth * CHUNK_WINDOW)
}

/// Creates completion queue `ci` of fabric `fi`, sized for `QPS_PER_CQ`
/// queue pairs of queue depth `queue_depth` beside `chunks` pool chunks,
/// and adds it to the reactor's epoll set. Fails if the device's largest
/// completion queue has no room for even one queue pair.
fn new_cq(f: &Fabric, epoll: &Epoll, fi: usize, ci: usize, chunks: u32, queue_depth: u32) -> Result<CqCtx> {
    let url = f.url();
    let want = (chunks + CQ_ENTRIES_PER_DEPTH * queue_depth * QPS_PER_CQ).min(1 << 20);
    let cq = f.create_cq(want).map_err(|e| Error::fabric(format!("{url}: cannot create a completion queue"), e))?;
    // The reactor keeps polling while it has work and arms before it
    // sleeps, so acknowledgements can ride on its responses.
    cq.set_ack_coalescing(Some(ACK_HOLD));
    let capacity = cq.capacity().min(want);
    if capacity < chunks + CQ_ENTRIES_PER_DEPTH * queue_depth {
        return Err(Error::new(
            ErrorKind::Fabric,
            format!(
                "{url}: a completion queue of {capacity} entries has no room for one queue pair beside {chunks} pool chunks; lower target.queue_depth or target.buffer_pool"
            ),
        ));
    }
    epoll.add(cq.fd(), cq_token(fi, ci)).map_err(|e| Error::os("epoll_ctl", e))?;
    Ok(CqCtx { cq, reserved: 0, capacity })
}

impl Reactor {
    fn new(spec: ReactorSpec, rx: mpsc::Receiver<Control>, wake: Arc<EventFd>) -> Result<Reactor> {
        let cfg = &spec.cfg;
        spec.stats.tid.store(sys::gettid(), std::sync::atomic::Ordering::Relaxed);
        if let Some(cpu) = spec.cpu {
            match sys::pin_current_thread(cpu) {
                Ok(()) => {
                    spec.stats.cpu.store(cpu as i32, std::sync::atomic::Ordering::Relaxed);
                    tracing::debug!("reactor {} pinned to CPU {cpu}", spec.id)
                }
                Err(e) => tracing::warn!("reactor {}: cannot pin to CPU {cpu}: {e}", spec.id),
            }
        }
        let pool = Pool::new(cfg.buffer_pool as usize, cfg.chunk_size as usize);
        let chunks = pool.capacity() as u32;
        spec.stats.pool_chunks.set(chunks as u64);
        let entries = (chunks + 64).next_power_of_two().clamp(64, 4096);
        let epoll = Epoll::new().map_err(|e| Error::os("epoll_create", e))?;
        let opts = UringOptions {
            entries,
            sqpoll_idle_ms: cfg.sqpoll.then_some(100),
            iopoll: cfg.iopoll,
            file_slots: RING_FILE_SLOTS,
            // The ring watches the epoll set while the reactor sleeps in it.
            wake_fd: Some(epoll.fd()),
            ..UringOptions::default()
        };
        let engine = BlockEngine::new(pool, opts, spec.id)?;
        let features = engine.features();
        if spec.id == 0 {
            tracing::info!(
                "io_uring: ring of {entries} entries per reactor, {} fixed-file slots, {chunks} fixed buffers of {} bytes; opcodes: {features}",
                RING_FILE_SLOTS,
                cfg.chunk_size
            );
        }
        if !features.fallocate && !features.iopoll {
            tracing::warn!("io_uring has no FALLOCATE: DISCARD and WRITE_ZEROES of files and RAM volumes will fail with NOT_SUPPORTED");
        }
        let mut fabrics = Vec::with_capacity(spec.fabrics.len());
        for (fi, f) in spec.fabrics.iter().enumerate() {
            let url = f.url().to_string();
            let pd = f.alloc_pd().map_err(|e| Error::fabric(format!("{url}: cannot allocate a protection domain"), e))?;
            let pool_mr = engine.pool().register(&pd).map_err(|e| Error::fabric(format!("{url}: cannot register the buffer pool"), e))?;
            // The first completion queue now, so that a device too small
            // for one queue pair stops the daemon at start.
            let first = new_cq(f, &epoll, fi, 0, chunks, cfg.queue_depth)?;
            fabrics.push(FabricCtx { pool_mr, cqs: vec![first], pd, fabric: Arc::clone(f) });
        }
        let cq_capacity = fabrics.first().map_or(0, |f| f.cqs[0].capacity);
        // Only when the reactor sleeps in epoll: sleeping in the ring, a
        // completion ends the sleep itself.
        if let Some(fd) = engine.wait_fds().next() {
            epoll.add(fd, TOKEN_URING).map_err(|e| Error::os("epoll_ctl", e))?;
        }
        epoll.add(wake.fd(), TOKEN_CTRL).map_err(|e| Error::os("epoll_ctl", e))?;
        let set = spec.registry.volumes();
        let limits = Limits {
            target_name: cfg.name.clone(),
            queue_depth: cfg.queue_depth,
            max_io_size: cfg.max_io_size,
            inline_data_size: cfg.inline_data_size,
            chunk_size: cfg.chunk_size,
        };
        tracing::debug!(
            "reactor {} ready: {} chunks of {} bytes, ring of {entries}, CQ of {cq_capacity}",
            spec.id,
            chunks,
            cfg.chunk_size
        );
        let mut r = Reactor {
            sessions: Vec::new(),
            tx_pending: Vec::new(),
            free_sessions: Vec::new(),
            fabrics,
            chunk_use: vec![ChunkUse::default(); chunks as usize],
            engine,
            id: spec.id,
            registry: spec.registry,
            vols: LocalVolumes {
                generation: u64::MAX,
                set,
                slots: (0..RING_FILE_SLOTS).map(|_| None).collect(),
                by_index: Vec::new(),
            },
            stats: spec.stats,
            limits,
            queue_depth: cfg.queue_depth,
            handshake_timeout: cfg.handshake_timeout,
            pool_share: cfg.session_pool_share.chunks(chunks, cfg.chunk_size),
            host_pool_share: cfg.host_pool_share.chunks(chunks, cfg.chunk_size),
            recv_slot_size: recv_slot_size(cfg.inline_data_size),
            cmds: Vec::new(),
            free_cmds: Vec::new(),
            waitq: VecDeque::new(),
            waitq_oldest: None,
            chunk_wait_timeout: cfg.chunk_wait_timeout,
            chunk_sweep_after: Instant::now(),
            chunk_expired: Vec::new(),
            rx,
            wake,
            epoll,
            shutdown: None,
            wcs: vec![Completion::EMPTY; CQ_BATCH],
            tokens: Vec::with_capacity(32),
            uring_done: Vec::with_capacity(256),
            busy_poll: cfg.busy_poll,
            last_work: Instant::now(),
            turn_start: Instant::now(),
            fabrics_quiet: false,
            fence_timeout: cfg.fence_timeout,
            idle_timeout: cfg.idle_timeout,
            fence_generation: 0,
            fences_waiting: 0,
            readahead: Readahead::new(
                readahead::Settings::new(cfg.chunk_size, cfg.readahead, chunks as usize),
                RING_FILE_SLOTS as usize,
            ),
            readahead_waiters: Vec::new(),
        };
        r.registry.add_waker(Arc::clone(&r.wake));
        r.refresh_volumes();
        Ok(r)
    }

    fn run(mut self) -> Result<()> {
        self.turn_start = Instant::now();
        loop {
            let mut work = if std::mem::take(&mut self.fabrics_quiet) { 0 } else { self.poll_fabrics()? };
            work += self.reap_engine();
            self.pump_waitq();
            work += self.control();
            self.check_fences();
            self.check_deadlines();
            self.flush_sends();
            // A turn followed by a sleep in the ring leaves its SQEs to the
            // sleep's io_uring_enter, a few microseconds later (its arm and
            // poll), which submits and waits in one system call.
            let sleeps_next = self.engine.sleeps_in_ring() && self.busy_poll.is_zero();
            if !sleeps_next {
                self.engine.submit()?;
            }
            self.stats.heartbeat.add(1);
            // Readahead's chunks are a cache it gives back on demand: counted apart.
            let taken = self.engine.pool().capacity() - self.engine.pool().free_count();
            self.stats.pool_in_use.set(taken.saturating_sub(self.readahead.held()) as u64);
            self.stats.pool_waiting.set(self.waitq.len() as u64);
            self.publish_readahead_stats();
            if self.finished() {
                tracing::debug!("reactor {} done", self.id);
                return Ok(());
            }
            // An iopoll ring finds completions only when polled; with
            // busy_poll the reactor keeps polling for that long after its
            // last work, which saves two wake-ups per command at low depth.
            // Without it (the default) a busy turn goes straight to the
            // sleep: its arm-then-poll finds whatever came meanwhile, so a
            // turn that would only find nothing (a poll of every CQ, a
            // system call each) is saved.
            let now = Instant::now();
            if work > 0 {
                self.stats.busy_ns.add(now.saturating_duration_since(self.turn_start).as_nanos() as u64);
                self.last_work = now;
            }
            if !self.engine.needs_polling() && now.saturating_duration_since(self.last_work) >= self.busy_poll {
                self.turn_start = self.idle_wait()?;
                continue;
            }
            self.turn_start = now;
        }
    }

    fn finished(&self) -> bool {
        self.shutdown.is_some()
            && self.sessions.iter().all(|s| s.s.is_none())
            && self.engine.inflight() == 0
    }

    // ---------------------------------------------------------------- volumes

    /// Sleeps until there is something to do (or returns at once if the
    /// last poll finds some), in the ring or in epoll (see the module docs).
    /// Returns when it woke: the next turn's start.
    ///
    /// A ring with nothing in flight has no completion to bring: the
    /// reactor then sleeps in `epoll_wait` on the same descriptor the wake
    /// poll would watch. One wake-up per command either way, but a
    /// command's arrival then wakes the reactor straight from the epoll
    /// set instead of through a poll request and its task work, which the
    /// sender pays for on loopback (about 1.5 us of `lat` per I/O at QD1
    /// on the null volume: BENCHMARKS.md, "Issue 20, sixth look"). A wake
    /// poll still armed from a sleep in the ring (the file volume at QD1:
    /// the reactor slept for the disk, answered, and has nothing in
    /// flight) is withdrawn first, one `io_uring_enter` after the answer
    /// went out, off the next command's path ("Issue 20, eighth look"),
    /// unless it already fired (`BlockEngine::withdraw_wake_poll`).
    /// If it fired before the withdrawal caught it, the wake-up is handled
    /// as a sleep's would be; if its end is not reaped yet, the reactor
    /// sleeps in the ring, where that end wakes it.
    fn idle_wait(&mut self) -> Result<Instant> {
        if self.engine.sleeps_in_ring() && self.engine.inflight() == 0 && self.engine.wake_poll_armed() {
            self.engine.withdraw_wake_poll()?;
        }
        // A busy turn (or the withdrawal) reaped the wake poll: handle what
        // is ready before the CQs are armed again (acknowledging a CQ event
        // after arming it would disarm it on tcp) and let a turn read the
        // control channel after its eventfd is drained. The next idle turn
        // sleeps.
        if self.engine.take_wake() {
            // The turn's SQEs wait for no sleep: submit them now.
            self.engine.submit()?;
            self.clear_wake_sources()?;
            return Ok(Instant::now());
        }
        if self.engine.sleeps_in_ring() && (self.engine.inflight() > 0 || self.engine.wake_poll_armed()) {
            self.idle_wait_in_ring()
        } else {
            self.idle_wait_in_epoll()?;
            Ok(Instant::now())
        }
    }

    /// Arms every CQ; returns whether one of them must be polled once more
    /// before the reactor sleeps (verbs; tcp's fd misses nothing after
    /// `arm`, see `CompletionQueue::needs_poll_after_arm`).
    fn arm_cqs(&self) -> Result<bool> {
        let mut poll_after = false;
        for c in self.fabrics.iter().flat_map(|f| &f.cqs) {
            c.cq.arm().map_err(|e| Error::fabric("cannot arm completion queue", e))?;
            poll_after |= c.cq.needs_poll_after_arm();
        }
        Ok(poll_after)
    }

    /// The reactor stays awake after all (the poll after arming found
    /// work): disarms the CQs, so that completions its next turns poll
    /// anyway do not fire the channel (on tcp a write to an eventfd, and a
    /// read to drain it).
    fn disarm_cqs(&self) {
        for c in self.fabrics.iter().flat_map(|f| &f.cqs) {
            c.cq.disarm();
        }
    }

    /// Sleeps in `io_uring_enter`, woken by a ring completion, by the wake
    /// poll on the epoll fd, or at the timeout.
    ///
    /// Why nothing is missed. The ring: completions posted since the last
    /// reap sit in the completion queue, and the kernel checks it before it
    /// sleeps, so a disk completion at any moment ends the sleep. The CQs:
    /// they are armed before the last poll, so a completion the poll missed
    /// makes the CQ fd, and thereby the epoll fd, readable (tcp CQs are not
    /// polled after the arm: their fd is level-triggered on what a poll
    /// would find, and `arm` fires it for completions already queued). The control
    /// and blocking-worker eventfds are written after the message or result
    /// is queued, and the channels are read on every turn after their
    /// eventfd was drained (`clear_wake_sources` is always followed by a
    /// turn), so a write the last turn did not see leaves the epoll fd
    /// readable.
    /// The wake poll watches exactly that: armed now, the kernel checks the
    /// epoll fd's readiness when it arms it (after hooking onto its wait
    /// queue, so there is no gap) and completes at once if it is readable;
    /// armed at an earlier sleep and not fired, it is still on the wait
    /// queue; fired since, its completion is in the queue and ends the
    /// sleep at once, or a busy turn reaped it and `idle_wait` handled it
    /// before anything is armed. The wake poll's SQE is submitted by the
    /// same `io_uring_enter` that sleeps, before it sleeps (with `sqpoll`
    /// the kernel's thread picks it up a little later, and the readiness
    /// check when it arms covers whatever happened in between).
    fn idle_wait_in_ring(&mut self) -> Result<Instant> {
        if self.arm_cqs()? && self.poll_fabrics()? > 0 {
            self.engine.submit()?;
            self.disarm_cqs();
            return Ok(Instant::now());
        }
        let timeout = self.next_deadline().map(|d| d.saturating_duration_since(Instant::now()));
        self.stats.idle_waits.add(1);
        self.engine.sleep(timeout)?;
        let mut woke = Instant::now();
        if self.reap_engine() > 0 {
            // Work as a turn's would be: counted busy, and `busy_poll`
            // runs from here (the next turn's time from here too).
            let now = Instant::now();
            self.stats.busy_ns.add(now.saturating_duration_since(woke).as_nanos() as u64);
            self.last_work = now;
            woke = now;
        }
        if self.engine.take_wake() {
            self.clear_wake_sources()?;
        } else {
            self.fabrics_quiet = true;
        }
        Ok(woke)
    }

    /// After the wake poll fired: makes every source in the epoll set
    /// unready again, without asking epoll which one fired (an
    /// `epoll_wait` per wake-up). Acknowledging a CQ costs no system call
    /// on tcp (it disarms, and reads its channel only if it was written)
    /// and one non-blocking read on verbs; the control eventfd is read
    /// only when it was notified. What made a CQ's fd readable besides its
    /// channel (a socket, a timer) is consumed by the next turn's poll,
    /// and the blocking worker's eventfd by its reap.
    fn clear_wake_sources(&mut self) -> Result<()> {
        for c in self.fabrics.iter().flat_map(|f| &f.cqs) {
            c.cq.ack_event().map_err(|e| Error::fabric("cannot acknowledge CQ event", e))?;
        }
        self.wake.drain_if_notified();
        self.engine.clear_wake();
        Ok(())
    }

    /// Blocks in `epoll_wait` on the CQ fds and the eventfds (the ring's too).
    fn idle_wait_in_epoll(&mut self) -> Result<()> {
        if self.arm_cqs()? && self.poll_fabrics()? > 0 {
            self.disarm_cqs();
            return Ok(());
        }
        let timeout = self.next_deadline().map(|d| d.saturating_duration_since(Instant::now()));
        self.stats.idle_waits.add(1);
        self.wait_epoll(timeout)
    }

    /// Waits up to `timeout` (`None`: no limit) for the epoll set and
    /// handles what is ready: acknowledges CQ events, drains the control
    /// eventfd and the ring's. The caller returns to a loop turn after it.
    fn wait_epoll(&mut self, timeout: Option<Duration>) -> Result<()> {
        let mut tokens = std::mem::take(&mut self.tokens);
        let r = self.epoll.wait(&mut tokens, timeout);
        for &t in &tokens {
            match t {
                // Cleared before the next turn reaps, so no completion
                // posted after the clear goes unnoticed.
                TOKEN_URING | TOKEN_BLOCKING => self.engine.clear_wake(),
                TOKEN_CTRL => {
                    self.wake.drain();
                }
                _ if t < TOKEN_URING => {
                    let (fi, ci) = split_cq_token(t);
                    self.fabrics[fi].cqs[ci].cq.ack_event().map_err(|e| Error::fabric("cannot acknowledge CQ event", e))?;
                }
                _ => {}
            }
        }
        self.tokens = tokens;
        r.map_err(|e| Error::os("epoll_wait", e))
    }

    /// The earliest moment `check_deadlines` has something to do.
    fn next_deadline(&self) -> Option<Instant> {
        let mut d = None;
        let mut min = |t: Instant| d = Some(d.map_or(t, |x: Instant| x.min(t)));
        for s in self.sessions.iter().filter_map(|slot| slot.s.as_ref()) {
            if s.closing.is_none() {
                if let Some(sd) = self.shutdown {
                    min(sd);
                }
                if let Some(f) = &s.fence {
                    min(f.deadline);
                } else if let Some((_, hd)) = &s.handshake {
                    min(*hd);
                } else if Self::may_idle_out(s) {
                    min(s.last_heard + self.idle_timeout);
                }
            } else if s.res.is_some() && (s.sq_used > 0 || s.recv_posted > 0) {
                if let Some(cd) = s.close_deadline {
                    min(cd);
                }
            }
        }
        if let Some(due) = self.chunk_wait_due() {
            min(due);
        }
        if let Some(due) = self.readahead.next_deadline() {
            min(due);
        }
        d
    }

    // ---------------------------------------------------------------- control

    fn control(&mut self) -> usize {
        // The wake eventfd is drained in `idle_wait` when it fired; the
        // channel is checked every turn without a syscall.
        self.maybe_refresh();
        let mut n = 0;
        while let Ok(msg) = self.rx.try_recv() {
            n += 1;
            match msg {
                Control::Connect(a) => {
                    let Accept { req, fabric, admission } = *a;
                    self.add_session(req, fabric, admission)
                }
                Control::Shutdown { deadline } => {
                    if self.shutdown.is_none() {
                        tracing::debug!("reactor {}: shutting down", self.id);
                        self.shutdown = Some(deadline);
                        for slot in &mut self.sessions {
                            if let Some(s) = &mut slot.s {
                                s.state.shutting_down = true;
                            }
                        }
                    }
                }
            }
        }
        n
    }

    fn check_deadlines(&mut self) {
        // Deadlines here are of seconds (handshake, idle, shutdown) or a
        // readahead chunk's life: the turn's start is clock enough.
        let now = self.turn_start;
        self.expire_chunk_waits(now);
        if self.readahead.next_deadline().is_some_and(|due| now >= due) {
            self.readahead.expire(now);
            self.release_readahead();
        }
        if let Some(deadline) = self.shutdown {
            let idle = self.sessions.iter().all(|s| s.s.as_ref().is_none_or(|s| s.live_cmds == 0));
            if idle || now >= deadline {
                if !idle {
                    tracing::warn!("shutdown timeout reached with commands in flight; disconnecting");
                }
                for si in 0..self.sessions.len() {
                    if self.sessions[si].s.as_ref().is_some_and(|s| s.closing.is_none()) {
                        self.fail_session(si as u16, "target shutting down".into());
                    }
                }
            }
        }
        for si in 0..self.sessions.len() {
            let Some(s) = &self.sessions[si].s else { continue };
            // A CONNECT held by the fence has the fence's deadline instead.
            if s.closing.is_none() && s.fence.is_none() && s.handshake.as_ref().is_some_and(|(_, d)| now >= *d) {
                let why = format!("no successful CONNECT within {:?} (target.handshake_timeout)", self.handshake_timeout);
                tracing::warn!("reactor {}: dropping connection from {}: {why}", self.id, s.peer);
                self.registry.counters.handshakes_timed_out.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                self.fail_session(si as u16, why);
                continue;
            }
            if Self::may_idle_out(s) && now.saturating_duration_since(s.last_heard) >= self.idle_timeout {
                let why = format!(
                    "idle: no command and no keep-alive for {:?} (target.idle_timeout)",
                    now.saturating_duration_since(s.last_heard)
                );
                tracing::warn!("reactor {}: dropping connection from {} host={}: {why}", self.id, s.peer, s.host());
                self.registry.counters.idle_timeouts.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                self.fail_session(si as u16, why);
                continue;
            }
            if s.res.is_none() || s.close_deadline.is_none_or(|d| now < d) {
                continue;
            }
            if s.sq_used == 0 && s.recv_posted == 0 {
                continue;
            }
            tracing::warn!(
                "session {}: {} sends and {} receives not flushed {:?} after disconnect; destroying the queue pair",
                s.peer,
                s.sq_used,
                s.recv_posted,
                FLUSH_TIMEOUT
            );
            self.force_teardown(si as u16);
        }
    }
}

fn completion_reason(what: &str, status: WcStatus) -> String {
    let why = match status {
        WcStatus::Success => "success",
        WcStatus::LocalLengthError => "local length error (message larger than the receive buffer?)",
        WcStatus::LocalProtectionError => "local protection error",
        WcStatus::WrFlushError => "flushed",
        WcStatus::RemoteAccessError => "remote access error (bad rkey, range or rights)",
        WcStatus::RemoteInvalidRequest => "remote invalid request",
        WcStatus::RnrRetryExceeded => "receiver not ready (initiator posted no receive)",
        WcStatus::TransportError => "transport error (connection lost)",
        WcStatus::RemoteOperationError => "remote operation error (the initiator failed the request)",
        WcStatus::LocalQpOperationError => "local queue pair operation error",
        WcStatus::GeneralError => "general error",
    };
    format!("{what} failed: {why}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_roundtrip() {
        let w = wr_id(K_RDMA, 0xabc, 0xfffe, 0x1234, 0xffff);
        assert_eq!(split_wr_id(w), (K_RDMA, 0xabc, 0xfffe, 0x1234, 0xffff));
        let w = wr_id(K_RECV, 0x1abc, 1, 2, 3);
        assert_eq!(split_wr_id(w), (K_RECV, 0xabc, 1, 2, 3), "generation keeps 12 bits");
        assert_eq!(split_ud(ud(U_FALLOC, 0xfffe, NONE16)), (U_FALLOC, 0xfffe, NONE16));
    }

    #[test]
    fn sizes() {
        assert_eq!(recv_slot_size(4096), 64 + 4096);
        assert_eq!(recv_slot_size(0), 64 + 256, "room for a CONNECT host id");
        assert_eq!(send_queue_depth(128, 512), 3 * 128 + 512);
        assert_eq!(send_queue_depth(4, 512), 12 + 32);
    }
}
