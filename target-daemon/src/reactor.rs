//! Reactor threads: each owns an io_uring, a buffer pool, one completion
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
//! epoll which one fired. Otherwise it blocks in `epoll_wait`, the
//! ring's eventfd being in the set too. (On an iopoll ring, which cannot
//! carry the wake poll, the reactor keeps polling while disk I/O is in
//! flight.)
//!
//! Queue pairs of one session may live on different reactors. What they
//! share (the opened volumes) is read lock-free through the session's
//! [`SharedSession`]; the reactor keeps its own snapshot of the published
//! volume set, with each volume's descriptor in a slot of the ring's
//! fixed-file table, and refreshes it when the registry's generation moves.
//! A removed volume keeps its slot until this reactor's last command on it
//! finished.

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
use crate::blocking::{BlockingWorker, Job, JobKind};
use crate::command::{self, IoPlan, Limits, Plan, SessionState, WriteSource};
use crate::config::{TargetConfig, MAX_VOLUMES};
use crate::error::{Error, ErrorKind, Result};
use crate::metrics::{self, ReactorStats};
use crate::pool::{ChunkId, Pool, PoolRegion, SlotBuf};
use crate::readahead::{self, Readahead, Serve};
use crate::session::{Admission, ConnectionSlot, HandshakeSlot, OpenSet, Registry, SharedSession};
use crate::sys::{self, Epoll, EventFd};
use crate::uring::{Uring, UringOptions};

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
/// the response to carry it: longer than a disk read usually takes, so that
/// the reactor does not send an ACK frame of its own for every command that
/// waits for the disk (and the initiator is not woken for it). A reactor
/// asleep meanwhile is woken by the CQ's timer when the hold ends. The
/// initiator needs the acknowledgement only to reuse the command's slot,
/// which waits for the response anyway.
const ACK_HOLD: Duration = Duration::from_millis(1);
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
    /// The ring's fixed-file slot points at the backend's descriptor.
    registered: bool,
    /// The ring could not register it: its commands fail with InternalError.
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
    blocking: Option<BlockingWorker>,
    uring: Uring,
    pool: Pool,
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
    /// A completion queue of fabric `fi` with room for `reserve` more
    /// entries beside the pool's RDMA operations, created if none has.
    fn cq_with_room(&mut self, fi: usize, reserve: u32) -> Result<usize> {
        let chunks = self.pool.capacity() as u32;
        let f = &self.fabrics[fi];
        if let Some(ci) = f.cqs.iter().position(|c| c.reserved + reserve <= c.capacity.saturating_sub(chunks)) {
            return Ok(ci);
        }
        let ci = f.cqs.len();
        let cq = new_cq(&f.fabric, &self.epoll, fi, ci, chunks, self.queue_depth)?;
        tracing::info!(
            "reactor {}: {}: completion queue {} of {} entries created ({} queue pairs served)",
            self.id,
            f.fabric.url(),
            ci + 1,
            cq.capacity,
            self.stats.queue_pairs.get()
        );
        self.fabrics[fi].cqs.push(cq);
        Ok(ci)
    }

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
        let uring = Uring::new(
            &[],
            &pool,
            UringOptions {
                entries,
                sqpoll_idle_ms: cfg.sqpoll.then_some(100),
                iopoll: cfg.iopoll,
                file_slots: RING_FILE_SLOTS,
                // The ring watches the epoll set while the reactor sleeps in it.
                wake_fd: Some(epoll.fd()),
            },
        )?;
        let features = uring.features();
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
            let pool_mr = pool.register(&pd).map_err(|e| Error::fabric(format!("{url}: cannot register the buffer pool"), e))?;
            // The first completion queue now, so that a device too small
            // for one queue pair stops the daemon at start.
            let first = new_cq(f, &epoll, fi, 0, chunks, cfg.queue_depth)?;
            fabrics.push(FabricCtx { pool_mr, cqs: vec![first], pd, fabric: Arc::clone(f) });
        }
        let cq_capacity = fabrics.first().map_or(0, |f| f.cqs[0].capacity);
        // Only when the reactor sleeps in epoll: sleeping in the ring, a
        // completion ends the sleep itself.
        if let Some(fd) = uring.eventfd() {
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
            blocking: None,
            chunk_use: vec![ChunkUse::default(); pool.capacity()],
            uring,
            pool,
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
        let mut turn_start = Instant::now();
        loop {
            let mut work = if std::mem::take(&mut self.fabrics_quiet) { 0 } else { self.poll_fabrics()? };
            work += self.reap_uring();
            work += self.reap_blocking();
            self.pump_waitq();
            work += self.control();
            self.check_fences();
            self.check_deadlines();
            self.flush_sends();
            // A turn followed by a sleep in the ring leaves its SQEs to the
            // sleep's io_uring_enter, a few microseconds later (its arm and
            // poll), which submits and waits in one system call.
            let sleeps_next = self.uring.features().ring_sleep && self.busy_poll.is_zero();
            if !sleeps_next {
                self.uring.submit()?;
            }
            self.stats.heartbeat.add(1);
            // Readahead's chunks are a cache it gives back on demand: counted apart.
            let taken = self.pool.capacity() - self.pool.free_count();
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
                self.stats.busy_ns.add(now.saturating_duration_since(turn_start).as_nanos() as u64);
                self.last_work = now;
            }
            if !self.uring.needs_polling() && now.saturating_duration_since(self.last_work) >= self.busy_poll {
                self.idle_wait()?;
                turn_start = Instant::now();
                continue;
            }
            turn_start = now;
        }
    }

    fn finished(&self) -> bool {
        self.shutdown.is_some()
            && self.sessions.iter().all(|s| s.s.is_none())
            && self.uring.inflight() == 0
            && self.blocking.as_ref().is_none_or(|b| b.inflight() == 0)
    }

    // ---------------------------------------------------------------- volumes

    /// Picks up a newly published volume set, if there is one.
    #[inline]
    fn maybe_refresh(&mut self) {
        if self.registry.generation() != self.vols.generation {
            self.refresh_volumes();
        }
    }

    /// Applies the published volume set: new volumes get a fixed-file slot,
    /// reopened ones get their new descriptor in the same slot, removed ones
    /// retire and free their slot after their last command.
    fn refresh_volumes(&mut self) {
        let set = self.registry.volumes();
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
                        let fd = v.backend.uring_fd();
                        match self.uring.set_file(slot as u32, fd) {
                            Ok(()) => {
                                lv.registered = fd.is_some();
                                lv.broken = false;
                            }
                            Err(e) => {
                                tracing::error!("reactor {}: volume {}: {e}", self.id, v.name);
                                lv.broken = true;
                            }
                        }
                    }
                    slot
                }
                None => match self.vols.slots.iter().position(Option::is_none) {
                    None => {
                        tracing::error!("reactor {}: volume {}: no free fixed-file slot; its commands will fail", self.id, v.name);
                        by_index.push(NONE16);
                        continue;
                    }
                    Some(slot) => {
                        let fd = v.backend.uring_fd();
                        let mut lv = LocalVolume { vol: Arc::clone(v), registered: false, broken: false, inflight: 0, retiring: false };
                        if fd.is_some() {
                            match self.uring.set_file(slot as u32, fd) {
                                Ok(()) => lv.registered = true,
                                Err(e) => {
                                    tracing::error!("reactor {}: volume {}: {e}", self.id, v.name);
                                    lv.broken = true;
                                }
                            }
                        }
                        self.vols.slots[slot] = Some(lv);
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

    /// Frees a retired volume's slot once nothing of this reactor uses it.
    fn maybe_release_volume(&mut self, slot: u16) {
        let Some(lv) = self.vols.slots[slot as usize].as_ref() else { return };
        if !lv.retiring || lv.inflight > 0 {
            return;
        }
        if lv.registered {
            if let Err(e) = self.uring.set_file(slot as u32, None) {
                tracing::error!("reactor {}: volume {}: {e}", self.id, lv.vol.name);
            }
        }
        tracing::debug!("reactor {}: volume {} released", self.id, lv.vol.name);
        self.vols.slots[slot as usize] = None;
    }

    fn volume(&self, slot: u16) -> &Arc<Volume> {
        &self.vols.slots[slot as usize].as_ref().expect("live volume slot").vol
    }

    /// Starts the blocking worker on first use.
    fn blocking(&mut self) -> Result<&mut BlockingWorker> {
        if self.blocking.is_none() {
            let w = BlockingWorker::start(self.id)?;
            self.epoll.add(w.fd(), TOKEN_BLOCKING).map_err(|e| Error::os("epoll_ctl", e))?;
            self.blocking = Some(w);
        }
        Ok(self.blocking.as_mut().expect("just started"))
    }

    fn reap_blocking(&mut self) -> usize {
        let Some(w) = self.blocking.as_mut() else { return 0 };
        if w.inflight() == 0 {
            return 0;
        }
        let mut done = std::mem::take(&mut self.uring_done);
        let n = w.reap(|u, r| done.push((u, r)));
        for &(u, r) in &done {
            self.on_uring(u, r);
        }
        done.clear();
        self.uring_done = done;
        n
    }

    /// Sleeps until there is something to do (or returns at once if the
    /// last poll finds some), in the ring or in epoll (see the module docs).
    fn idle_wait(&mut self) -> Result<()> {
        if self.uring.features().ring_sleep {
            self.idle_wait_in_ring()
        } else {
            self.idle_wait_in_epoll()
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
    /// sleep at once, or a busy turn reaped it and it is handled here
    /// before anything is armed. The wake poll's SQE is submitted by the
    /// same `io_uring_enter` that sleeps, before it sleeps (with `sqpoll`
    /// the kernel's thread picks it up a little later, and the readiness
    /// check when it arms covers whatever happened in between).
    fn idle_wait_in_ring(&mut self) -> Result<()> {
        // A busy turn reaped the wake poll: handle what is ready before the
        // CQs are armed again (acknowledging a CQ event after arming it
        // would disarm it on tcp) and let a turn read the control channel
        // after its eventfd is drained. The next idle turn sleeps.
        if self.uring.take_wake_poll_fired() {
            // The turn's SQEs wait for no sleep: submit them now.
            self.uring.submit()?;
            return self.clear_wake_sources();
        }
        if self.arm_cqs()? && self.poll_fabrics()? > 0 {
            self.uring.submit()?;
            self.disarm_cqs();
            return Ok(());
        }
        let timeout = self.next_deadline().map(|d| d.saturating_duration_since(Instant::now()));
        self.stats.idle_waits.add(1);
        if !self.uring.wake_poll_armed() {
            self.uring.arm_wake_poll();
        }
        self.uring.sleep(timeout)?;
        let woke = Instant::now();
        if self.reap_uring() > 0 {
            // Work as a turn's would be: counted busy, and `busy_poll`
            // runs from here.
            let now = Instant::now();
            self.stats.busy_ns.add(now.saturating_duration_since(woke).as_nanos() as u64);
            self.last_work = now;
        }
        if self.uring.take_wake_poll_fired() {
            self.clear_wake_sources()?;
        } else {
            self.fabrics_quiet = true;
        }
        Ok(())
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
        if let Some(w) = &self.blocking {
            w.clear_wake();
        }
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
                TOKEN_URING => self.uring.clear_eventfd(),
                TOKEN_CTRL => {
                    self.wake.drain();
                }
                _ if t < TOKEN_URING => {
                    let (fi, ci) = split_cq_token(t);
                    self.fabrics[fi].cqs[ci].cq.ack_event().map_err(|e| Error::fabric("cannot acknowledge CQ event", e))?;
                }
                TOKEN_BLOCKING => {
                    if let Some(w) = &self.blocking {
                        w.clear_wake();
                    }
                }
                _ => {}
            }
        }
        self.tokens = tokens;
        r.map_err(|e| Error::os("epoll_wait", e))
    }

    /// Whether `target.idle_timeout` applies to a queue pair: connected (a
    /// handshake has its own deadline), live, and nothing of it in flight
    /// (a command waiting for the disk or a chunk is not the peer's silence).
    fn may_idle_out(s: &Session) -> bool {
        s.closing.is_none() && s.handshake.is_none() && s.fence.is_none() && s.live_cmds == 0
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
        let now = Instant::now();
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

    /// Destroys a queue pair whose work requests did not all flush. Chunks
    /// lent to it come back; commands still waiting for io_uring stay until done.
    fn force_teardown(&mut self, si: u16) {
        for c in 0..self.pool.capacity() {
            let chunk = ChunkId(c as u16);
            if !self.pool.is_lent_to_fabric(chunk) {
                continue;
            }
            let ci = self.chunk_use[c].cmd;
            if self.cmds.get(ci as usize).and_then(|c| c.as_ref()).is_some_and(|cmd| cmd.sess == si) {
                self.pool.return_from_fabric(chunk);
                self.pool.release(chunk);
                if let Some(cmd) = self.cmds[ci as usize].as_mut() {
                    cmd.inflight -= 1;
                }
            }
        }
        let s = self.sessions[si as usize].s.as_mut().expect("live session");
        s.res = None;
        s.sq_used = 0;
        s.recv_posted = 0;
        s.noslot_sends = 0;
        for ci in 0..self.cmds.len() {
            if let Some(cmd) = self.cmds[ci].as_mut() {
                if cmd.sess == si {
                    cmd.send_inflight = false;
                }
            }
        }
        self.free_session_cmds(si);
        self.maybe_free_session(si);
    }

    fn add_session(&mut self, req: ConnectRequest, fi: usize, admission: Admission) {
        let Admission { handshake, connection } = admission;
        let peer = req.peer();
        if self.shutdown.is_some() {
            req.reject(b"target shutting down");
            return;
        }
        let qd = self.queue_depth;
        let chunks = self.pool.capacity() as u32;
        let reserve = CQ_ENTRIES_PER_DEPTH * qd;
        // Admission by what the device's completion queue really holds, so
        // that it can never overrun.
        let ci = match self.cq_with_room(fi, reserve) {
            Ok(ci) => ci,
            Err(e) => {
                tracing::warn!("reactor {}: refusing connection from {peer}: {e}", self.id);
                req.reject(b"target busy: cannot create a completion queue");
                return;
            }
        };
        if self.free_sessions.is_empty() && self.sessions.len() >= u16::MAX as usize {
            req.reject(b"target busy");
            return;
        }
        let sq_cap = send_queue_depth(qd, chunks);
        let caps = QpCaps { max_send_wr: sq_cap, max_recv_wr: qd, max_send_sge: 1, max_recv_sge: 1, max_inline_data: 256 };
        let f = &self.fabrics[fi];
        let qp = match req.into_queue_pair(&f.pd, &f.cqs[ci].cq, caps) {
            Ok(qp) => qp,
            Err(e) => {
                tracing::warn!("cannot create a queue pair for {peer}: {e}");
                return;
            }
        };
        let got = qp.caps();
        if got.max_send_wr < sq_cap || got.max_recv_wr < qd {
            tracing::warn!("queue pair for {peer} got {got:?}, need {caps:?}; dropping the connection");
            return;
        }
        let mut res = QpRes {
            qp,
            recv: SlotBuf::new(qd as usize, self.recv_slot_size),
            resp: SlotBuf::new(response_slots(qd) as usize, RESPONSE_SLOT_SIZE),
        };
        if let Err(e) = res.recv.register(&f.pd, Access::LOCAL_WRITE).and_then(|()| res.resp.register(&f.pd, Access::NONE)) {
            tracing::warn!("cannot register buffers for {peer}: {e}");
            return;
        }
        let si = match self.free_sessions.pop() {
            Some(si) => si,
            None => {
                self.sessions.push(SessionSlot { gen: 0, s: None });
                (self.sessions.len() - 1) as u16
            }
        };
        let gen = self.sessions[si as usize].gen;
        let slot_size = self.recv_slot_size as u32;
        let sges: Vec<Sge> = (0..qd as usize).map(|i| res.recv.lend(i, slot_size)).collect();
        let wrs: Vec<RecvWr<'_>> =
            sges.iter().enumerate().map(|(i, sge)| RecvWr { wr_id: wr_id(K_RECV, gen, si, i as u16, 0), sges: std::slice::from_ref(sge) }).collect();
        let posted = res.qp.post_recv(&wrs);
        drop(wrs);
        let discard = |this: &mut Reactor| {
            this.sessions[si as usize].gen = this.sessions[si as usize].gen.wrapping_add(1);
            this.free_sessions.push(si);
        };
        if let Err(e) = posted {
            tracing::warn!("cannot post receives for {peer}: {e}");
            discard(self);
            return;
        }
        if let Err(e) = res.qp.accept(&[]) {
            tracing::warn!("cannot accept connection from {peer}: {e}");
            discard(self);
            return;
        }
        self.fabrics[fi].cqs[ci].reserved += reserve;
        let session = Session {
            qp_num: res.qp.qp_num(),
            max_inline: got.max_inline_data,
            res: Some(res),
            fabric: fi,
            cq: ci,
            peer: peer.clone(),
            state: SessionState { shutting_down: self.shutdown.is_some(), ..SessionState::new() },
            shared: None,
            queue_index: 0,
            free_resp: (0..response_slots(qd) as u16).rev().collect(),
            sq_used: 0,
            sq_cap,
            recv_posted: qd,
            noslot_sends: 0,
            slots: qd,
            cq_reserved: reserve,
            closing: None,
            close_deadline: None,
            handshake: Some((handshake, Instant::now() + self.handshake_timeout)),
            _connection: connection,
            tx: Vec::new(),
            fence: None,
            live_cmds: 0,
            resp_wait: VecDeque::new(),
            last_heard: Instant::now(),
        };
        self.sessions[si as usize].s = Some(session);
        self.stats.queue_pairs.add(1);
        tracing::debug!("reactor {}: accepted connection from {peer}", self.id);
    }

    // ---------------------------------------------------------------- fabric completions

    fn poll_fabrics(&mut self) -> Result<usize> {
        let mut total = 0;
        for fi in 0..self.fabrics.len() {
            for ci in 0..self.fabrics[fi].cqs.len() {
                for _ in 0..CQ_ROUNDS {
                    let cq = &self.fabrics[fi].cqs[ci].cq;
                    let n = cq.poll(&mut self.wcs).map_err(|e| Error::fabric("completion queue poll failed", e))?;
                    for i in 0..n {
                        let wc = self.wcs[i];
                        self.on_completion(wc);
                    }
                    total += n;
                    if n < self.wcs.len() {
                        break;
                    }
                }
            }
        }
        Ok(total)
    }

    fn session(&mut self, si: u16) -> &mut Session {
        self.sessions[si as usize].s.as_mut().expect("live session")
    }

    fn on_completion(&mut self, wc: Completion) {
        let (kind, gen, si, a, b) = split_wr_id(wc.wr_id);
        let live = self.sessions.get(si as usize).is_some_and(|slot| {
            slot.gen & 0xfff == gen && slot.s.as_ref().is_some_and(|s| s.res.is_some() && s.qp_num == wc.qp_num)
        });
        if !live {
            tracing::trace!("stale completion {wc:?}");
            return;
        }
        match kind {
            K_RECV => self.on_recv(si, a, wc),
            K_SEND => self.on_send(si, a, b, wc),
            K_RDMA => self.on_rdma(si, a, ChunkId(b), wc),
            K_SEND_NOSLOT => {
                let s = self.session(si);
                s.sq_used -= 1;
                s.noslot_sends -= 1;
                if wc.status != WcStatus::Success {
                    self.fail_session(si, completion_reason("response SEND", wc.status));
                }
            }
            _ => tracing::error!("completion with unknown wr_id {:#x}", wc.wr_id.0),
        }
        if self.sessions[si as usize].s.as_ref().is_some_and(|s| !s.resp_wait.is_empty()) {
            // A send completion made room for answers that waited.
            self.post_waiting_responses(si);
        }
        self.maybe_free_session(si);
    }

    fn on_recv(&mut self, si: u16, slot: u16, wc: Completion) {
        let start = Instant::now();
        let s = self.sessions[si as usize].s.as_mut().expect("live session");
        s.recv_posted -= 1;
        s.last_heard = start;
        let res = s.res.as_mut().expect("live queue pair");
        res.recv.reclaim(slot as usize);
        if wc.status != WcStatus::Success {
            let reason = if wc.status == WcStatus::WrFlushError {
                "disconnected".to_owned()
            } else {
                completion_reason("receive", wc.status)
            };
            self.fail_session(si, reason);
            return;
        }
        if s.closing.is_some() {
            // A dead queue pair executes nothing more.
            if let Some(sh) = &s.shared {
                sh.count_dropped(1);
            }
            return;
        }
        if s.shared.as_ref().is_some_and(|sh| sh.is_retired()) {
            // Retired by a reconnect fence that this reactor has not acted on yet.
            if let Some(sh) = &s.shared {
                sh.count_dropped(1);
            }
            self.retire_queue_pairs();
            return;
        }
        self.stats.commands.add(1);
        if s.state.outstanding >= s.slots {
            // The initiator ignores the queue depth: answer without a slot.
            let cid = command::command_id_of(&res.recv.slot(slot as usize)[..(wc.byte_len as usize).min(4)]);
            self.repost_recv(si, slot);
            self.send_queue_full(si, cid);
            return;
        }
        // A volume another reactor's queue pair just opened after a reload
        // is in the published set by now (publication happened before that
        // OPEN was answered): one load tells.
        self.maybe_refresh();
        let len = (wc.byte_len as usize).min(self.recv_slot_size);
        let (cid, plan) = self.plan_msg(si, slot, len);
        let plan = match plan {
            Ok(p) => p,
            Err(e) if e.kind() == ErrorKind::QueueFull => {
                let s = self.session(si);
                tracing::debug!("peer {} host {}: command {} refused: {e}", s.peer, s.host(), cid.0);
                self.repost_recv(si, slot);
                self.send_queue_full(si, cid);
                return;
            }
            Err(e) => return self.refuse(si, slot, len, cid, e, start),
        };
        match plan {
            Plan::Connect { negotiated, host_id, join, replaces, reply } => {
                let access = Arc::clone(&self.vols.set.access);
                let s = self.session(si);
                if let Err(e) = crate::auth::check_connect(&s.state.auth, &access, &host_id, join) {
                    tracing::warn!("connect refused: host={host_id} peer={} reason={e}", s.peer);
                    return self.refuse(si, slot, len, cid, e, start);
                }
                self.repost_recv(si, slot);
                let pending = PendingConnect { cid, start, negotiated, host_id, join, reply };
                match replaces {
                    Some(old) => self.fence(si, old, pending),
                    None => self.connect_session(si, pending, None),
                }
            }
            Plan::AuthNegotiate { host_id, session_id } => {
                let name = self.limits.target_name.clone();
                let s = self.session(si);
                let challenge = crate::auth::negotiate(&mut s.state.auth, &host_id, session_id, &name);
                tracing::debug!("authentication started: host={host_id} peer={} session={:#x}", s.peer, session_id.0);
                self.answer_auth(si, slot, len, cid, start, challenge.map(|c| c.to_vec()));
            }
            Plan::AuthReply { response } => {
                let (name, access) = (self.limits.target_name.clone(), Arc::clone(&self.vols.set.access));
                let s = self.session(si);
                let claimed = match &s.state.auth {
                    crate::auth::AuthState::Challenged { host_id, .. } => host_id.clone(),
                    _ => "-".to_owned(),
                };
                let proof = crate::auth::reply(&mut s.state.auth, &access, &response, &name);
                match &proof {
                    Ok(_) => tracing::info!("authenticated: host={claimed} peer={}", s.peer),
                    Err(e) => tracing::warn!("authentication failed: host={claimed} peer={} reason={e}", s.peer),
                }
                self.answer_auth(si, slot, len, cid, start, proof.map(|p| p.to_vec()));
            }
            Plan::Open { volume, grant } => {
                // Under the admin lock, so that a reload cannot remove the
                // volume between this check and marking it open.
                let registry = Arc::clone(&self.registry);
                let admin = registry.admin();
                let (mut volume, mut grant) = (volume, grant);
                if registry.generation() != self.vols.generation {
                    self.refresh_volumes();
                    match self.plan_msg(si, slot, len).1 {
                        Ok(Plan::Open { volume: v, grant: g }) => (volume, grant) = (v, g),
                        Ok(_) => unreachable!("the same capsule plans the same command"),
                        Err(e) => {
                            drop(admin);
                            return self.refuse(si, slot, len, cid, e, start);
                        }
                    }
                }
                let meta = self.vols.set.table.get(volume);
                let (id, info) = (meta.id, meta.info_for(grant).to_bytes());
                let read_only_grant = grant == crate::auth::Grant::ReadOnly;
                if read_only_grant {
                    let s = self.session(si);
                    tracing::info!("volume {} opened read-only: host={} peer={} (read_only_hosts)", id, s.host(), s.peer);
                }
                if let Some(shared) = self.session(si).shared.clone() {
                    shared.mark_open_with_grant(&admin, id, read_only_grant);
                }
                drop(admin);
                self.repost_recv(si, slot);
                if let Some(ci) = self.new_cmd(si, cid, CmdKind::Immediate, start) {
                    match info {
                        Ok(d) => {
                            self.cmd(ci).result = id.0 as u64;
                            self.respond(ci, &d, None)
                        }
                        Err(e) => {
                            tracing::error!("cannot encode volume info: {e}");
                            self.cmd(ci).error = Some(ErrorKind::Internal);
                            self.respond(ci, &[], None);
                        }
                    }
                }
            }
            Plan::Close { volume } => {
                let id = self.vols.set.table.get(volume).id;
                if let Some(shared) = self.session(si).shared.clone() {
                    let registry = Arc::clone(&self.registry);
                    let admin = registry.admin();
                    shared.mark_closed(&admin, id);
                }
                self.repost_recv(si, slot);
                if let Some(ci) = self.new_cmd(si, cid, CmdKind::Immediate, start) {
                    self.respond(ci, &[], None);
                }
            }
            Plan::KeepAlive => {
                self.repost_recv(si, slot);
                if let Some(ci) = self.new_cmd(si, cid, CmdKind::Immediate, start) {
                    self.respond(ci, &[], None);
                }
            }
            Plan::ListVolumes { dest, entries, total } => {
                self.repost_recv(si, slot);
                let kind = if entries == 0 { CmdKind::Immediate } else { CmdKind::List };
                if let Some(ci) = self.new_cmd(si, cid, kind, start) {
                    let cmd = self.cmd(ci);
                    cmd.result = total as u64;
                    cmd.remote = dest;
                    cmd.list_entries = entries;
                    if entries == 0 {
                        self.respond(ci, &[], None);
                    } else {
                        self.pump(ci);
                    }
                }
            }
            Plan::Io(io) => self.start_io(si, slot, cid, io, start),
        }
    }

    /// Answers a command whose receive slot is already reposted with the
    /// failure `e`.
    fn answer_error(&mut self, si: u16, cid: CommandId, e: Error, start: Instant) {
        if let Some(ci) = self.new_cmd(si, cid, CmdKind::Immediate, start) {
            self.cmd(ci).error = Some(e.kind());
            self.respond(ci, &[], None);
        }
    }

    /// The reconnect fence: a CONNECT creating a session names the earlier
    /// session `old` of the same host that it replaces. That session is
    /// retired on every reactor (its queue pairs stop reading and drop what
    /// they have not submitted to the disk), and this CONNECT is answered
    /// only once its last queue pair, and so its last disk I/O, is gone, or
    /// with `FenceTimeout` after `target.fence_timeout`.
    fn fence(&mut self, si: u16, old: SessionId, pending: PendingConnect) {
        let registry = Arc::clone(&self.registry);
        let retired = registry.retire(&mut registry.admin(), old, &pending.host_id);
        let old = match retired {
            Err(e) => {
                let s = self.session(si);
                tracing::warn!("connect refused: host={} peer={} reason={e}", pending.host_id, s.peer);
                return self.answer_error(si, pending.cid, e, pending.start);
            }
            // Gone already: nothing of it can land any more.
            Ok(None) => return self.connect_session(si, pending, Some(old)),
            Ok(Some(shared)) => shared,
        };
        // This reactor's queue pairs of the old session stop now; the
        // others' at their next turn (the registry woke them).
        self.retire_queue_pairs();
        if old.has_ended() {
            self.log_fence(&old, Duration::ZERO);
            return self.connect_session(si, pending, Some(old.id));
        }
        let now = Instant::now();
        let deadline = now + self.fence_timeout;
        let s = self.session(si);
        tracing::info!(
            "fence: host={} peer={} replaces session {:#x}: waiting for its disk I/O to finish",
            pending.host_id,
            s.peer,
            old.id.0
        );
        s.fence = Some(Fence { old, since: now, deadline, connect: pending });
        self.fences_waiting += 1;
    }

    /// Stops every queue pair of this reactor whose session was retired.
    fn retire_queue_pairs(&mut self) {
        self.fence_generation = self.registry.fence_generation();
        for si in 0..self.sessions.len() {
            let retired = self.sessions[si]
                .s
                .as_ref()
                .is_some_and(|s| s.closing.is_none() && s.shared.as_ref().is_some_and(|sh| sh.is_retired()));
            if retired {
                self.fail_session(si as u16, "retired: a newer session of this host replaced it (reconnect fence)".into());
            }
        }
    }

    /// Per turn: retires queue pairs when the fence generation moved, and
    /// answers the CONNECTs whose fence is over (or timed out).
    fn check_fences(&mut self) {
        if self.registry.fence_generation() != self.fence_generation {
            self.retire_queue_pairs();
        }
        if self.fences_waiting == 0 {
            return;
        }
        let now = Instant::now();
        for si in 0..self.sessions.len() {
            let Some(s) = self.sessions[si].s.as_mut() else { continue };
            let Some(f) = s.fence.as_ref() else { continue };
            let closing = s.closing.is_some();
            if !closing && !f.old.has_ended() && now < f.deadline {
                continue;
            }
            let f = s.fence.take().expect("checked");
            self.fences_waiting -= 1;
            let si = si as u16;
            if closing {
                continue;
            }
            if f.old.has_ended() {
                self.log_fence(&f.old, now.saturating_duration_since(f.since));
                self.connect_session(si, f.connect, Some(f.old.id));
            } else {
                self.registry.counters.fence_timeouts.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let e = Error::new(
                    ErrorKind::FenceTimeout,
                    format!(
                        "session {:#x} still has disk I/O in flight after {:?} (target.fence_timeout)",
                        f.old.id.0, self.fence_timeout
                    ),
                );
                tracing::warn!("fence: host={} replacing session {:#x}: {e}; answered FenceTimeout", f.connect.host_id, f.old.id.0);
                self.answer_error(si, f.connect.cid, e, f.connect.start);
            }
        }
    }

    fn log_fence(&self, old: &SharedSession, took: Duration) {
        let dropped = old.dropped();
        self.registry.counters.fence_dropped_commands.fetch_add(dropped, std::sync::atomic::Ordering::Relaxed);
        tracing::info!(
            "fence: session {:#x} of host {} retired in {took:?}: {dropped} commands dropped before reaching the disk, every disk I/O it had submitted completed",
            old.id.0,
            old.host_id
        );
    }

    /// Creates or joins the session of a CONNECT (its receive slot is
    /// reposted already) and answers it.
    fn connect_session(&mut self, si: u16, c: PendingConnect, replaced: Option<SessionId>) {
        let PendingConnect { cid, start, negotiated, host_id, join, mut reply } = c;
        let registry = Arc::clone(&self.registry);
        let joined = {
            let mut admin = registry.admin();
            match join {
                None => registry.create(&mut admin, &host_id, self.id),
                Some(id) => registry.join(&mut admin, id, &host_id, self.id),
            }
        };
        let joined = match joined {
            Ok(j) => j,
            Err(e) => {
                let id = self.id;
                let s = self.session(si);
                if e.kind() == ErrorKind::LimitReached {
                    tracing::warn!("session refused: host={host_id} peer={} reactor={id} reason={e}", s.peer);
                } else {
                    tracing::info!("session join refused: host={host_id} peer={} reactor={id} reason={e}", s.peer);
                }
                return self.answer_error(si, cid, e, start);
            }
        };
        reply.session_id = joined.session.id;
        reply.queue_index = joined.queue_index;
        let id = self.id;
        let s = self.session(si);
        let how = match (joined.created, replaced) {
            (false, _) => " (joined)".to_owned(),
            (true, None) => " (new session)".to_owned(),
            (true, Some(old)) => format!(" (new session, replaces {:#x})", old.0),
        };
        tracing::info!(
            "session connected: host={host_id} session={:#x} queue={} reactor={id} peer={} queue_depth={} max_io_size={}{how}",
            joined.session.id.0,
            joined.queue_index,
            s.peer,
            negotiated.queue_depth,
            negotiated.max_io_size,
        );
        s.state.connected = Some(negotiated);
        s.state.host_id = Some(host_id);
        // Past its handshake: the slot goes back for the next connection.
        s.handshake = None;
        s.shared = Some(joined.session);
        s.queue_index = joined.queue_index;
        let data = reply.to_bytes();
        if let Some(ci) = self.new_cmd(si, cid, CmdKind::Immediate, start) {
            match data {
                Ok(d) => self.respond(ci, &d, None),
                Err(e) => {
                    tracing::error!("cannot encode CONNECT reply: {e}");
                    self.cmd(ci).error = Some(ErrorKind::Internal);
                    self.respond(ci, &[], None);
                }
            }
        }
    }

    /// Answers AUTH_NEGOTIATE or AUTH_REPLY: the reply data, or the
    /// failure's status (the same `AuthFailed` for every failed check).
    fn answer_auth(&mut self, si: u16, slot: u16, len: usize, cid: CommandId, start: Instant, reply: Result<Vec<u8>>) {
        let data = match reply {
            Ok(d) => d,
            Err(e) => return self.refuse(si, slot, len, cid, e, start),
        };
        self.repost_recv(si, slot);
        if let Some(ci) = self.new_cmd(si, cid, CmdKind::Immediate, start) {
            self.respond(ci, &data, None);
        }
    }

    /// Validates the capsule in receive slot `slot` against this reactor's
    /// volume snapshot and the session's opened set (read lock-free).
    fn plan_msg(&self, si: u16, slot: u16, len: usize) -> (CommandId, Result<command::Plan>) {
        let s = self.sessions[si as usize].s.as_ref().expect("live session");
        let res = s.res.as_ref().expect("live queue pair");
        let msg = &res.recv.slot(slot as usize)[..len];
        match &s.shared {
            Some(shared) => command::plan(msg, &self.vols.set.table, &self.limits, &s.state, &shared.open()),
            None => command::plan(msg, &self.vols.set.table, &self.limits, &s.state, &OpenSet::EMPTY),
        }
    }

    /// Answers a command that failed validation with its status (and counts
    /// it against its volume when it names one).
    fn refuse(&mut self, si: u16, slot: u16, len: usize, cid: CommandId, e: Error, start: Instant) {
        let target = {
            let s = self.sessions[si as usize].s.as_ref().expect("live session");
            command::io_target(&s.res.as_ref().expect("live queue pair").recv.slot(slot as usize)[..len])
        };
        let s = self.session(si);
        match e.kind() {
            ErrorKind::VersionMismatch => tracing::warn!("peer {}: {e}", s.peer),
            ErrorKind::AccessDenied | ErrorKind::ReadOnly => {
                tracing::info!("refused: host={} peer={} command={}: {e}", s.host(), s.peer, cid.0)
            }
            _ => tracing::debug!("peer {} host {}: command {} refused: {e}", s.peer, s.host(), cid.0),
        }
        if let Some((op, vid)) = target {
            let vslot = self.vols.set.table.index_of(vid).and_then(|i| self.vols.by_index.get(i).copied());
            if let (Some(vslot), Some(oi)) = (vslot.filter(|&v| v != NONE16), metrics::op_index(op)) {
                self.volume(vslot).stats.reactor(self.id).ops[oi].record(0, false, start.elapsed());
            }
        }
        self.repost_recv(si, slot);
        if let Some(ci) = self.new_cmd(si, cid, CmdKind::Immediate, start) {
            self.cmd(ci).error = Some(e.kind());
            self.respond(ci, &[], None);
        }
    }

    fn start_io(&mut self, si: u16, slot: u16, cid: CommandId, io: IoPlan, start: Instant) {
        let (kind, volume, offset, len, falloc_len, remote, fua, inline, op) = match io {
            IoPlan::Read { volume, offset, len, dest } => {
                (CmdKind::Read, volume, offset, len, 0, dest, false, false, rdmablk_common::protocol::Opcode::Read)
            }
            IoPlan::Write { volume, offset, len, source, fua } => match source {
                WriteSource::Descriptor(d) => {
                    (CmdKind::Write, volume, offset, len, 0, d, fua, false, rdmablk_common::protocol::Opcode::Write)
                }
                WriteSource::Inline => (
                    CmdKind::WriteInline,
                    volume,
                    offset,
                    len,
                    0,
                    DataDescriptor::default(),
                    fua,
                    true,
                    rdmablk_common::protocol::Opcode::Write,
                ),
            },
            IoPlan::Flush { volume } => {
                (CmdKind::Flush, volume, 0, 0, 0, DataDescriptor::default(), false, false, rdmablk_common::protocol::Opcode::Flush)
            }
            IoPlan::Discard { volume, offset, len } => {
                (CmdKind::Range, volume, offset, 0, len, DataDescriptor::default(), false, false, rdmablk_common::protocol::Opcode::Discard)
            }
            IoPlan::WriteZeroes { volume, offset, len } => (
                CmdKind::Range,
                volume,
                offset,
                0,
                len,
                DataDescriptor::default(),
                false,
                false,
                rdmablk_common::protocol::Opcode::WriteZeroes,
            ),
        };
        let vslot = self.vols.by_index.get(volume).copied().unwrap_or(NONE16);
        if !inline {
            self.repost_recv(si, slot);
        }
        let Some(ci) = self.new_cmd(si, cid, kind, start) else {
            if inline {
                self.repost_recv(si, slot);
            }
            return;
        };
        let broken = vslot == NONE16 || self.vols.slots[vslot as usize].as_ref().is_none_or(|lv| lv.broken);
        {
            let cmd = self.cmd(ci);
            cmd.op = metrics::op_index(op).map_or(NO_OP, |i| i as u8);
            cmd.offset = offset;
            cmd.len = len;
            cmd.falloc_len = falloc_len;
            cmd.remote = remote;
            cmd.fua = fua;
        }
        if broken {
            if inline {
                self.repost_recv(si, slot);
            }
            self.cmd(ci).error = Some(ErrorKind::Internal);
            self.respond(ci, &[], None);
            return;
        }
        let lv = self.vols.slots[vslot as usize].as_mut().expect("live volume slot");
        lv.inflight += 1;
        let backend = Arc::clone(&lv.vol.backend);
        let null = matches!(*backend, Backend::Null);
        let cmd = self.cmd(ci);
        cmd.vslot = vslot;
        cmd.null = null;
        if inline {
            cmd.held_recv = Some(slot);
        }
        let file = vslot as u32;
        match kind {
            CmdKind::Write | CmdKind::WriteInline | CmdKind::Range => self.begin_write(ci),
            CmdKind::Read if matches!(*backend, Backend::File(_)) => self.read_ahead(vslot, offset, len, start),
            _ => {}
        }
        match kind {
            CmdKind::Flush if !backend.needs_flush() => self.respond(ci, &[], None),
            CmdKind::Flush if self.uring.features().fsync => {
                self.cmd(ci).inflight += 1;
                self.cmd(ci).at_disk = true;
                self.uring.fsync(file, ud(U_FSYNC, ci, NONE16));
            }
            CmdKind::Flush => self.submit_blocking(ci, U_FSYNC, JobKind::Fdatasync, backend, 0, 0),
            CmdKind::Range => {
                let how = if op == rdmablk_common::protocol::Opcode::Discard { backend.discard() } else { backend.write_zeroes() };
                match how {
                    // Validation refused volumes without support already.
                    None => {
                        self.cmd(ci).error = Some(ErrorKind::NotSupported);
                        self.respond(ci, &[], None);
                    }
                    Some(RangeOp::Nothing) => self.respond(ci, &[], None),
                    Some(RangeOp::Fallocate(mode)) if self.uring.features().fallocate => {
                        self.cmd(ci).inflight += 1;
                        self.cmd(ci).at_disk = true;
                        self.uring.fallocate(file, mode, offset, falloc_len, ud(U_FALLOC, ci, NONE16));
                    }
                    // An iopoll ring (or a kernel without the opcode): the worker does it.
                    Some(RangeOp::Fallocate(mode)) => {
                        self.submit_blocking(ci, U_FALLOC, JobKind::Fallocate(mode), backend, offset, falloc_len)
                    }
                    Some(RangeOp::BlkDiscard) => self.submit_blocking(ci, U_BLKDEV, JobKind::Discard, backend, offset, falloc_len),
                    Some(RangeOp::BlkZeroout) => self.submit_blocking(ci, U_BLKDEV, JobKind::ZeroOut, backend, offset, falloc_len),
                }
            }
            CmdKind::WriteInline if null => {
                // Dropped: nothing to copy, nothing to write.
                self.cmd(ci).held_recv = None;
                self.repost_recv(si, slot);
                self.cmd(ci).done = len;
                self.respond(ci, &[], None);
            }
            _ => self.pump(ci),
        }
    }

    /// Hands an operation to the blocking worker; its result comes back
    /// through `on_uring` like a ring completion.
    fn submit_blocking(&mut self, ci: u16, ukind: u64, kind: JobKind, backend: Arc<Backend>, offset: u64, len: u64) {
        let job = Job { user_data: ud(ukind, ci, NONE16), kind, backend, offset, len };
        match self.blocking() {
            Ok(w) => {
                w.submit(job);
                self.cmd(ci).inflight += 1;
                self.cmd(ci).at_disk = true;
            }
            Err(e) => {
                tracing::error!("reactor {}: {e}", self.id);
                self.cmd(ci).error = Some(ErrorKind::Internal);
                self.respond(ci, &[], None);
            }
        }
    }

    fn repost_recv(&mut self, si: u16, slot: u16) {
        let gen = self.sessions[si as usize].gen;
        let size = self.recv_slot_size as u32;
        let s = self.session(si);
        if s.closing.is_some() {
            return;
        }
        let res = s.res.as_mut().expect("live queue pair");
        let sge = res.recv.lend(slot as usize, size);
        let wr = RecvWr { wr_id: wr_id(K_RECV, gen, si, slot, 0), sges: &[sge] };
        // A failed post may still have posted part of the list (as in verbs),
        // so the slot stays lent and counted; FLUSH_TIMEOUT covers the rest.
        let posted = res.qp.post_recv(&[wr]);
        s.recv_posted += 1;
        if let Err(e) = posted {
            self.fail_session(si, format!("cannot post a receive: {e}"));
        }
    }

    /// QUEUE_FULL for a command that got no slot: inline SEND from the stack.
    fn send_queue_full(&mut self, si: u16, cid: CommandId) {
        let gen = self.sessions[si as usize].gen;
        let s = self.session(si);
        if s.closing.is_some() {
            return;
        }
        if s.noslot_sends >= s.slots || s.max_inline < RESPONSE_CAPSULE_SIZE as u32 || s.sq_used >= s.sq_cap {
            self.fail_session(si, "protocol violation: initiator exceeds the queue depth".into());
            return;
        }
        let (status, detail) = Error::new(ErrorKind::QueueFull, "").wire_status();
        let bytes = ResponseCapsule::failure(cid, status, detail).to_bytes();
        let wr = SendWr {
            wr_id: wr_id(K_SEND_NOSLOT, gen, si, NONE16, NONE16),
            op: SendOp::Send,
            payload: Payload::Inline(&bytes),
            signaled: true,
        };
        // The capsule is on this stack (inline): post it now, after what
        // this turn queued before it.
        if !s.tx.is_empty() {
            self.flush_session_sends(si);
        }
        let s = self.session(si);
        if s.closing.is_some() {
            return;
        }
        s.sq_used += 1;
        s.noslot_sends += 1;
        let res = s.res.as_ref().expect("live queue pair");
        let posted = res.qp.post_send(&[wr]);
        if let Err(e) = posted {
            self.fail_session(si, format!("cannot post a response: {e}"));
        }
    }

    fn on_send(&mut self, si: u16, slot: u16, ci: u16, wc: Completion) {
        let s = self.session(si);
        s.sq_used -= 1;
        let res = s.res.as_mut().expect("live queue pair");
        res.resp.reclaim(slot as usize);
        s.free_resp.push(slot);
        if let Some(cmd) = self.cmds.get_mut(ci as usize).and_then(|c| c.as_mut()).filter(|c| c.sess == si) {
            cmd.send_inflight = false;
        }
        if wc.status != WcStatus::Success {
            self.fail_session(si, completion_reason("response SEND", wc.status));
        }
        self.maybe_free_cmd(ci);
        self.post_waiting_responses(si);
    }

    fn on_rdma(&mut self, si: u16, ci: u16, c: ChunkId, wc: Completion) {
        self.session(si).sq_used -= 1;
        let valid = (c.0 as usize) < self.pool.capacity()
            && self.pool.is_lent_to_fabric(c)
            && self.chunk_use[c.0 as usize].cmd == ci
            && self.cmds.get(ci as usize).and_then(|x| x.as_ref()).is_some_and(|cmd| cmd.sess == si);
        if !valid {
            tracing::error!("RDMA completion for a chunk not lent: {wc:?}");
            return;
        }
        self.pool.return_from_fabric(c);
        let use_ = self.chunk_use[c.0 as usize];
        let cmd = self.cmd(ci);
        cmd.inflight -= 1;
        let kind = cmd.kind;
        let ok = wc.status == WcStatus::Success && (kind != CmdKind::Write || wc.byte_len == use_.len);
        if !ok {
            self.pool.release(c);
            let what = if kind == CmdKind::Write { "RDMA READ" } else { "RDMA WRITE" };
            let usable = wc.status != WcStatus::WrFlushError
                && self.session(si).res.as_ref().is_some_and(|r| r.qp.state() == QpState::Ready);
            if usable {
                tracing::warn!("command {}: {what} failed ({:?}, {} bytes); queue pair still usable", self.cmd(ci).cid.0, wc.status, wc.byte_len);
                self.cmd(ci).error.get_or_insert(ErrorKind::Transfer);
                self.progress(ci);
            } else {
                self.fail_session(si, completion_reason(what, wc.status));
                self.maybe_free_cmd(ci);
            }
            return;
        }
        let closing = self.session(si).closing.is_some();
        let cmd = self.cmd(ci);
        if kind == CmdKind::Write && !closing && cmd.error.is_none() && cmd.null {
            // The data crossed the fabric; the null backend drops it.
            cmd.done += use_.len;
            self.pool.release(c);
            self.progress(ci);
            return;
        }
        if kind == CmdKind::Write && !closing && cmd.error.is_none() {
            cmd.inflight += 1;
            self.write_chunk(ci, c);
            return;
        }
        self.pool.release(c);
        self.progress(ci);
    }

    // ---------------------------------------------------------------- io_uring completions

    fn reap_uring(&mut self) -> usize {
        // The ring's eventfd (sleeping in epoll; sleeping in the ring there
        // is none) is cleared in `idle_wait` when it fired, not here:
        // reading it every turn cost a syscall per turn.
        let mut done = std::mem::take(&mut self.uring_done);
        let n = self.uring.reap(&mut self.pool, |u, r| done.push((u, r)));
        for &(u, r) in &done {
            self.on_uring(u, r);
        }
        done.clear();
        self.uring_done = done;
        n
    }

    fn on_uring(&mut self, user_data: u64, res: i32) {
        let (kind, ci, c) = split_ud(user_data);
        if kind == U_READAHEAD {
            return self.readahead_done(ci, ChunkId(c), res);
        }
        let Some(cmd) = self.cmds.get_mut(ci as usize).and_then(|x| x.as_mut()) else {
            tracing::error!("io_uring completion for a free command slot {ci}");
            return;
        };
        cmd.inflight -= 1;
        let si = cmd.sess;
        let closing = self.sessions[si as usize].s.as_ref().is_none_or(|s| s.closing.is_some() || s.res.is_none());
        if res < 0 {
            let errno = -res;
            let unsupported = matches!(kind, U_FALLOC | U_BLKDEV) && matches!(errno, libc::EOPNOTSUPP | libc::ENOTTY);
            let err = if unsupported { ErrorKind::NotSupported } else { ErrorKind::DeviceIo(errno) };
            let what = match kind {
                U_READ => "read",
                U_WRITE => "write",
                U_FSYNC => "fdatasync",
                U_BLKDEV => "BLKDISCARD/BLKZEROOUT",
                _ => "fallocate",
            };
            let vslot = cmd.vslot;
            let vol = &self.vols.slots[vslot as usize].as_ref().expect("live volume slot").vol.name;
            let cmd = self.cmds[ci as usize].as_mut().expect("live command");
            if err == ErrorKind::NotSupported {
                tracing::debug!("volume {vol}: {what} not supported");
            } else {
                tracing::warn!("volume {vol}: {what} failed: {}", std::io::Error::from_raw_os_error(errno));
            }
            cmd.error.get_or_insert(err);
            if kind == U_READ || kind == U_WRITE {
                self.pool.release(ChunkId(c));
            }
            self.progress(ci);
            return;
        }
        match kind {
            U_READ => {
                let chunk = ChunkId(c);
                if closing || cmd.error.is_some() {
                    self.pool.release(chunk);
                    self.progress(ci);
                    return;
                }
                self.read_chunk_done(si, ci, chunk);
                self.progress(ci);
            }
            U_WRITE => {
                self.pool.release(ChunkId(c));
                cmd.done += self.chunk_use[c as usize].len;
                self.progress(ci);
            }
            // The held write was at the disk all along: it lands now,
            // whatever became of its session meanwhile.
            U_HOLD => {
                cmd.inflight += 1;
                self.submit_write(ci, ChunkId(c));
            }
            _ => self.progress(ci),
        }
    }

    // ---------------------------------------------------------------- commands

    fn cmd(&mut self, ci: u16) -> &mut Cmd {
        self.cmds[ci as usize].as_mut().expect("live command")
    }

    fn new_cmd(&mut self, si: u16, cid: CommandId, kind: CmdKind, start: Instant) -> Option<u16> {
        let ci = match self.free_cmds.pop() {
            Some(ci) => ci,
            None if self.cmds.len() < NONE16 as usize => {
                self.cmds.push(None);
                (self.cmds.len() - 1) as u16
            }
            None => {
                tracing::warn!("reactor {}: command slab full", self.id);
                self.send_queue_full(si, cid);
                return None;
            }
        };
        self.cmds[ci as usize] = Some(Cmd {
            sess: si,
            cid,
            kind,
            vslot: NONE16,
            op: NO_OP,
            start,
            null: false,
            offset: 0,
            len: 0,
            falloc_len: 0,
            remote: DataDescriptor::default(),
            fua: false,
            next: 0,
            done: 0,
            inflight: 0,
            error: None,
            held_recv: None,
            at_disk: false,
            in_waitq: false,
            waiting_since: start,
            responded: false,
            write_epoch_open: false,
            answer_waits: false,
            send_inflight: false,
            result: 0,
            list_entries: 0,
        });
        let s = self.session(si);
        s.state.outstanding += 1;
        s.live_cmds += 1;
        Some(ci)
    }

    fn session_closing(&self, si: u16) -> bool {
        self.sessions[si as usize].s.as_ref().is_none_or(|s| s.closing.is_some() || s.res.is_none())
    }

    fn wants_chunk(&self, ci: u16) -> bool {
        let Some(cmd) = self.cmds.get(ci as usize).and_then(|c| c.as_ref()) else { return false };
        if cmd.error.is_some() || cmd.responded || self.session_closing(cmd.sess) {
            return false;
        }
        match cmd.kind {
            CmdKind::Read | CmdKind::Write => cmd.next < cmd.len && cmd.inflight < CHUNK_WINDOW,
            CmdKind::WriteInline | CmdKind::List => cmd.next == 0,
            _ => false,
        }
    }

    /// The pool accounts a command's chunks are charged to on this reactor
    /// (its session's and its host's, the peer's source address), and
    /// whether either holds its whole share already (`session_pool_share`,
    /// `host_pool_share`).
    fn pool_accounts(&self, ci: u16) -> ([Option<Arc<crate::pool::PoolAccount>>; 2], bool) {
        let si = self.cmds[ci as usize].as_ref().expect("live command").sess;
        let Some(s) = self.sessions[si as usize].s.as_ref() else { return ([None, None], false) };
        let session = s.shared.as_ref().and_then(|sh| sh.pool_account(self.id));
        let host = s._connection.host_pool_account(self.id);
        let at_share = session.is_some_and(|a| a.held() >= self.pool_share) || host.is_some_and(|a| a.held() >= self.host_pool_share);
        ([session.cloned(), host.cloned()], at_share)
    }

    /// Issues chunks for a command while it wants them, the pool has them
    /// and its session and host are under their shares; otherwise queues it
    /// (FIFO) for the next free chunk.
    fn pump(&mut self, ci: u16) {
        while self.wants_chunk(ci) {
            let first_in_line = self.waitq.is_empty() || self.waitq.front() == Some(&ci);
            let (accounts, at_share) = self.pool_accounts(ci);
            if !first_in_line || at_share || !self.chunk_for_command() {
                if !self.cmd(ci).in_waitq {
                    self.wait_for_chunk(ci, Instant::now());
                }
                return;
            }
            if self.waitq.front() == Some(&ci) {
                self.waitq.pop_front();
                self.cmd(ci).in_waitq = false;
            }
            let [session, host] = &accounts;
            let c = self.pool.alloc_charged([session.as_ref(), host.as_ref()]).expect("free chunk");
            self.issue(ci, c);
        }
    }

    /// Hands free chunks to waiting commands in order. A command whose
    /// session or host holds its whole share goes to the back of the line,
    /// so it never holds up other sessions' or hosts' commands behind it.
    fn pump_waitq(&mut self) {
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
            let (accounts, at_share) = self.pool_accounts(ci);
            if at_share {
                let since = self.cmd(ci).waiting_since;
                self.wait_for_chunk(ci, since);
                passed_over += 1;
                continue;
            }
            passed_over = 0;
            let [session, host] = &accounts;
            let c = self.pool.alloc_charged([session.as_ref(), host.as_ref()]).expect("free chunk");
            self.issue(ci, c);
            if self.cmds[ci as usize].is_some() && self.wants_chunk(ci) {
                // It got a chunk: its wait for the next starts now.
                self.wait_for_chunk(ci, now);
            }
        }
    }

    /// Puts a command at the back of the line for a chunk, waiting since `since`.
    fn wait_for_chunk(&mut self, ci: u16, since: Instant) {
        let was_empty = self.waitq.is_empty();
        let cmd = self.cmd(ci);
        cmd.in_waitq = true;
        cmd.waiting_since = since;
        self.waitq.push_back(ci);
        self.waitq_oldest = match self.waitq_oldest {
            Some(oldest) if !was_empty => Some(oldest.min(since)),
            _ => Some(since),
        };
    }

    /// When the next sweep for commands past `target.chunk_wait_timeout`
    /// is due, if any command waits for a chunk.
    fn chunk_wait_due(&self) -> Option<Instant> {
        if self.waitq.is_empty() {
            return None;
        }
        self.waitq_oldest.map(|oldest| (oldest + self.chunk_wait_timeout).max(self.chunk_sweep_after))
    }

    /// Gives up every command that has waited for a chunk longer than
    /// `target.chunk_wait_timeout` (since it queued, or since its last
    /// chunk): it is answered `OutOfBuffers`, once, after the chunks it
    /// has in flight have finished (`progress`, as any failed command).
    /// The pool cannot serve it in time: its session's or host's chunks
    /// do not come back (a peer that stopped reading), or others hold the
    /// whole pool.
    fn expire_chunk_waits(&mut self, now: Instant) {
        if self.chunk_wait_due().is_none_or(|due| now < due) {
            return;
        }
        let timeout = self.chunk_wait_timeout;
        let mut q = std::mem::take(&mut self.waitq);
        let mut expired = std::mem::take(&mut self.chunk_expired);
        let mut oldest: Option<Instant> = None;
        q.retain(|&ci| {
            // One that no longer wants a chunk (failed, answered, its queue
            // pair closing) waits for no deadline; `pump_waitq` drops it.
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
        let (si, cid, kind, since) = {
            let cmd = self.cmds[first as usize].as_ref().expect("live command");
            (cmd.sess, cmd.cid, cmd.kind, cmd.waiting_since)
        };
        let s = self.sessions[si as usize].s.as_ref().expect("live session");
        tracing::warn!(
            "reactor {}: {} commands waited more than {timeout:?} for a pool chunk (target.chunk_wait_timeout) and are answered OutOfBuffers; {} of {} chunks in use, {} commands still waiting; the first: command {} ({kind:?}, waited {:?}) of host={} peer={}",
            self.id,
            expired.len(),
            self.pool.capacity() - self.pool.free_count(),
            self.pool.capacity(),
            self.waitq.len(),
            cid.0,
            now.saturating_duration_since(since),
            s.host(),
            s.peer
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

    fn issue(&mut self, ci: u16, c: ChunkId) {
        let chunk_size = self.pool.chunk_size() as u32;
        let cmd = self.cmd(ci);
        let si = cmd.sess;
        match cmd.kind {
            CmdKind::Read | CmdKind::Write => {
                let off = cmd.next;
                let len = chunk_size.min(cmd.len - off);
                cmd.next += len;
                let (kind, null) = (cmd.kind, cmd.null);
                self.chunk_use[c.0 as usize] = ChunkUse { cmd: ci, off, len, zero: null && kind == CmdKind::Read };
                if kind == CmdKind::Read && null {
                    // Zeroes, sent from the zero chunk; the chunk only
                    // accounts for the work request (back-pressure, SQ room).
                    self.read_chunk_done(si, ci, c);
                } else if kind == CmdKind::Read {
                    self.read_piece(ci, c);
                } else {
                    // Counted in flight once posted.
                    self.post_rdma(si, ci, c, true);
                }
            }
            CmdKind::WriteInline => {
                let len = cmd.len;
                let slot = cmd.held_recv.take().expect("inline data held");
                cmd.next = len;
                cmd.inflight += 1;
                // wants_chunk() made sure the session is live.
                let res = self.sessions[si as usize].s.as_ref().and_then(|s| s.res.as_ref()).expect("live queue pair");
                let src = &res.recv.slot(slot as usize)[COMMAND_CAPSULE_SIZE..COMMAND_CAPSULE_SIZE + len as usize];
                self.pool.bytes_mut(c)[..len as usize].copy_from_slice(src);
                self.repost_recv(si, slot);
                self.chunk_use[c.0 as usize] = ChunkUse { cmd: ci, off: 0, len, zero: false };
                self.write_chunk(ci, c);
            }
            CmdKind::List => {
                let entries = cmd.list_entries as usize;
                cmd.next = 1;
                let buf = self.pool.bytes_mut(c);
                let who = self.sessions[si as usize].s.as_ref().map(|s| s.state.identity());
                let visible = who.into_iter().flat_map(|who| self.vols.set.table.visible_to(who));
                for (i, (m, grant)) in visible.take(entries).enumerate() {
                    match m.info_for(grant).to_bytes() {
                        Ok(b) => buf[i * VOLUME_INFO_SIZE..(i + 1) * VOLUME_INFO_SIZE].copy_from_slice(&b),
                        Err(e) => tracing::error!("cannot encode volume info: {e}"),
                    }
                }
                self.chunk_use[c.0 as usize] = ChunkUse { cmd: ci, off: 0, len: (entries * VOLUME_INFO_SIZE) as u32, zero: false };
                self.respond(ci, &[], Some(c));
            }
            _ => {
                self.pool.release(c);
            }
        }
    }

    /// Writes a chunk of a WRITE command to the disk (through the ring),
    /// unless fault injection holds its session's writes (test-only). The
    /// caller has counted the write in flight.
    fn write_chunk(&mut self, ci: u16, c: ChunkId) {
        self.cmd(ci).at_disk = true;
        if crate::fault::enabled() {
            let (si, vslot) = (self.cmd(ci).sess, self.cmd(ci).vslot);
            let session = self.sessions[si as usize].s.as_ref().and_then(|s| s.shared.as_ref()).map(|sh| sh.id);
            if let Some(session) = session.filter(|&id| crate::fault::holds(id)) {
                let backend = Arc::clone(&self.volume(vslot).backend);
                let job = Job { user_data: ud(U_HOLD, ci, c.0), kind: JobKind::HoldWrite(session), backend, offset: 0, len: 0 };
                match self.blocking() {
                    Ok(w) => return w.submit(job),
                    Err(e) => tracing::error!("reactor {}: cannot hold a write: {e}", self.id),
                }
            }
        }
        self.submit_write(ci, c);
    }

    /// Queues a chunk's disk write on the ring (counted in flight by the caller).
    fn submit_write(&mut self, ci: u16, c: ChunkId) {
        let use_ = self.chunk_use[c.0 as usize];
        let cmd = self.cmd(ci);
        let (file, offset, fua) = (cmd.vslot as u32, cmd.offset + use_.off as u64, cmd.fua);
        self.uring.write_fixed(&mut self.pool, file, c, 0, use_.len, offset, fua, ud(U_WRITE, ci, c.0));
    }

    /// Posts one RDMA op for a chunk: RDMA READ into it (WRITE command) or
    /// RDMA WRITE from it (READ command).
    fn post_rdma(&mut self, si: u16, ci: u16, c: ChunkId, read: bool) {
        let gen = self.sessions[si as usize].gen;
        let use_ = self.chunk_use[c.0 as usize];
        let remote = self.cmd(ci).remote;
        let s = self.sessions[si as usize].s.as_mut().expect("live session");
        if s.sq_used >= s.sq_cap {
            self.pool.release(c);
            self.fail_session(si, "send queue overflow (internal error)".into());
            return;
        }
        let mr = &self.fabrics[s.fabric].pool_mr;
        let sge = if use_.zero { mr.zero_sge(use_.len) } else { mr.sge(c, 0, use_.len) };
        let addr = remote.remote_addr.wrapping_add(use_.off as u64);
        let op = if read {
            SendOp::RdmaRead { remote_addr: addr, rkey: Rkey(remote.rkey) }
        } else {
            SendOp::RdmaWrite { remote_addr: addr, rkey: Rkey(remote.rkey) }
        };
        let wr = QueuedWr { wr_id: wr_id(K_RDMA, gen, si, ci, c.0), op, sge, inline: false };
        self.pool.lend_to_fabric(c);
        // If the post fails the work request may or may not be posted: keep
        // the chunk lent and counted; the flush (or FLUSH_TIMEOUT) returns it.
        s.sq_used += 1;
        self.queue_send(si, &[wr]);
        if let Some(cmd) = self.cmds[ci as usize].as_mut() {
            cmd.inflight += 1;
        }
    }

    /// Decides what a command does next after one of its operations finished.
    fn progress(&mut self, ci: u16) {
        let Some(cmd) = self.cmds.get(ci as usize).and_then(|c| c.as_ref()) else { return };
        let si = cmd.sess;
        // An answer waiting for a response slot is decided already: a late
        // completion of the same command (an earlier chunk's RDMA WRITE
        // failing) must not answer it a second time.
        if cmd.responded || cmd.answer_waits || self.session_closing(si) {
            self.maybe_free_cmd(ci);
            return;
        }
        if cmd.error.is_some() {
            if cmd.inflight == 0 {
                if cmd.in_waitq {
                    self.waitq.retain(|&x| x != ci);
                    self.cmd(ci).in_waitq = false;
                }
                if let Some(slot) = self.cmd(ci).held_recv.take() {
                    self.repost_recv(si, slot);
                }
                self.respond(ci, &[], None);
            }
            return;
        }
        match cmd.kind {
            CmdKind::Write | CmdKind::WriteInline if cmd.done == cmd.len && cmd.inflight == 0 => self.respond(ci, &[], None),
            CmdKind::Flush | CmdKind::Range if cmd.inflight == 0 => self.respond(ci, &[], None),
            _ => self.pump(ci),
        }
    }

    /// Posts the response (after an optional RDMA WRITE of `chain` in the same post).
    fn respond(&mut self, ci: u16, data: &[u8], chain: Option<ChunkId>) {
        self.end_write(ci);
        let (si, ok) = {
            let cmd = self.cmds[ci as usize].as_ref().expect("live command");
            (cmd.sess, cmd.error.is_none())
        };
        self.record_io(ci, ok);
        if self.session_closing(si) {
            if let Some(c) = chain {
                self.pool.release(c);
            }
            self.mark_responded(ci);
            self.maybe_free_cmd(ci);
            return;
        }
        let s = self.sessions[si as usize].s.as_mut().expect("live session");
        let need = 1 + chain.is_some() as u32;
        if !s.resp_wait.is_empty() || s.free_resp.is_empty() || s.sq_used + need > s.sq_cap {
            // Every response slot or send-queue entry is taken by answers
            // whose send completions have not come back yet (they may come
            // after the initiator's next commands): this answer waits for
            // one, in order. The command still counts against the queue
            // depth, as the initiator has not seen its answer.
            s.resp_wait.push_back(WaitingResponse { ci, data: data.to_vec(), chain });
            self.cmd(ci).answer_waits = true;
            self.stats.answers_delayed.add(1);
            return;
        }
        self.post_response(ci, data, chain);
    }

    /// Answers the responses that waited for a response slot, while there
    /// are slots and send-queue room (after a send completion).
    fn post_waiting_responses(&mut self, si: u16) {
        loop {
            let Some(s) = self.sessions[si as usize].s.as_mut() else { return };
            let Some(w) = s.resp_wait.front() else { return };
            let need = 1 + w.chain.is_some() as u32;
            if s.closing.is_some() || s.free_resp.is_empty() || s.sq_used + need > s.sq_cap {
                return;
            }
            let w = s.resp_wait.pop_front().expect("checked");
            self.post_response(w.ci, &w.data, w.chain);
        }
    }

    /// The answer to a command: the initiator may reuse its slot once it
    /// holds it, so from here on the command no longer counts against the
    /// queue depth (its slab entry lives until its send completion).
    fn mark_responded(&mut self, ci: u16) {
        let cmd = self.cmds[ci as usize].as_mut().expect("live command");
        if cmd.responded {
            return;
        }
        cmd.responded = true;
        let si = cmd.sess;
        if let Some(s) = self.sessions[si as usize].s.as_mut() {
            s.state.outstanding -= 1;
        }
    }

    /// Posts the response (after an optional RDMA WRITE of `chain` in the
    /// same post); a response slot and send-queue room are free.
    fn post_response(&mut self, ci: u16, data: &[u8], chain: Option<ChunkId>) {
        let gen;
        let si;
        let (status, detail, result, remote, cid) = {
            let cmd = self.cmds[ci as usize].as_ref().expect("live command");
            si = cmd.sess;
            gen = self.sessions[si as usize].gen;
            let (status, detail) = match cmd.error {
                Some(k) => Error::new(k, "").wire_status(),
                None => (Status::Success, 0),
            };
            (status, detail, cmd.result, cmd.remote, cmd.cid)
        };
        let data = if status == Status::Success { data } else { &[][..] };
        let rc = ResponseCapsule {
            command_id: cid,
            status,
            detail,
            result: if status == Status::Success { result } else { 0 },
            data_len: data.len() as u32,
        };
        let s = self.sessions[si as usize].s.as_mut().expect("live session");
        let need = 1 + chain.is_some() as u32;
        let slot = s.free_resp.pop().expect("the caller checked for a free response slot");
        let res = s.res.as_mut().expect("live queue pair");
        let total = RESPONSE_CAPSULE_SIZE + data.len();
        {
            let buf = res.resp.slot_mut(slot as usize);
            let head: &mut [u8; RESPONSE_CAPSULE_SIZE] = (&mut buf[..RESPONSE_CAPSULE_SIZE]).try_into().expect("32 bytes");
            rc.encode(head);
            buf[RESPONSE_CAPSULE_SIZE..total].copy_from_slice(data);
        }
        let send = QueuedWr {
            wr_id: wr_id(K_SEND, gen, si, slot, ci),
            op: SendOp::Send,
            sge: res.resp.lend(slot as usize, total as u32),
            inline: total as u32 <= s.max_inline,
        };
        // If the post fails part of the chain may be posted (as in verbs):
        // account for all of it; the flush (or FLUSH_TIMEOUT) settles the rest.
        s.sq_used += need;
        match chain {
            None => self.queue_send(si, &[send]),
            Some(c) => {
                let use_ = self.chunk_use[c.0 as usize];
                let mr = &self.fabrics[s.fabric].pool_mr;
                let sge = if use_.zero { mr.zero_sge(use_.len) } else { mr.sge(c, 0, use_.len) };
                self.pool.lend_to_fabric(c);
                let write = QueuedWr {
                    wr_id: wr_id(K_RDMA, gen, si, ci, c.0),
                    op: SendOp::RdmaWrite {
                        remote_addr: remote.remote_addr.wrapping_add(use_.off as u64),
                        rkey: Rkey(remote.rkey),
                    },
                    sge,
                    inline: false,
                };
                self.queue_send(si, &[write, send]);
            }
        }
        self.mark_responded(ci);
        let cmd = self.cmds[ci as usize].as_mut().expect("live command");
        cmd.answer_waits = false;
        cmd.send_inflight = true;
        if chain.is_some() {
            cmd.inflight += 1;
        }
    }

    /// Queues send work requests for the end of this turn (`flush_sends`).
    fn queue_send(&mut self, si: u16, wrs: &[QueuedWr]) {
        let s = self.session(si);
        let first = s.tx.is_empty();
        s.tx.extend_from_slice(wrs);
        if first {
            self.tx_pending.push(si);
        }
    }

    /// Posts every session's queued work requests, in order, a chunk per
    /// `post_send`. Runs at the end of each turn and before a session
    /// fails (so what it queued is flushed like everything else posted).
    fn flush_sends(&mut self) {
        while let Some(si) = self.tx_pending.pop() {
            self.flush_session_sends(si);
        }
    }

    fn flush_session_sends(&mut self, si: u16) {
        let Some(s) = self.sessions[si as usize].s.as_mut() else { return };
        let Some(res) = s.res.as_ref() else {
            s.tx.clear();
            return;
        };
        let mut failed = None;
        for chunk in s.tx.chunks(TX_CHUNK) {
            let mut wrs = [SendWr { wr_id: WrId(0), op: SendOp::Send, payload: Payload::Sges(&[]), signaled: true }; TX_CHUNK];
            for (wr, q) in wrs.iter_mut().zip(chunk) {
                // An inline response is copied from its (lent) slot at post time.
                let payload =
                    if q.inline { Payload::Inline(res.resp.lent_bytes(&q.sge)) } else { Payload::Sges(std::slice::from_ref(&q.sge)) };
                *wr = SendWr { wr_id: q.wr_id, op: q.op, payload, signaled: true };
            }
            if let Err(e) = res.qp.post_send(&wrs[..chunk.len()]) {
                failed = Some(e);
                break;
            }
        }
        s.tx.clear();
        if let Some(e) = failed {
            self.fail_session(si, format!("cannot post to the send queue: {e}"));
        }
    }

    fn maybe_free_cmd(&mut self, ci: u16) {
        let Some(cmd) = self.cmds.get(ci as usize).and_then(|c| c.as_ref()) else { return };
        let si = cmd.sess;
        let closing = self.session_closing(si);
        if cmd.inflight > 0 || cmd.send_inflight || !(cmd.responded || closing) {
            return;
        }
        self.end_write(ci);
        let cmd = self.cmds[ci as usize].as_ref().expect("live command");
        if cmd.in_waitq {
            self.waitq.retain(|&x| x != ci);
        }
        let (vslot, dropped, responded) = (cmd.vslot, !cmd.responded && !cmd.at_disk, cmd.responded);
        self.cmds[ci as usize] = None;
        self.free_cmds.push(ci);
        if dropped {
            if let Some(sh) = self.sessions[si as usize].s.as_ref().and_then(|s| s.shared.as_ref()) {
                sh.count_dropped(1);
            }
        }
        if vslot != NONE16 {
            if let Some(lv) = self.vols.slots[vslot as usize].as_mut() {
                lv.inflight -= 1;
                if lv.retiring && lv.inflight == 0 {
                    self.maybe_release_volume(vslot);
                }
            }
        }
        if let Some(s) = self.sessions[si as usize].s.as_mut() {
            if !responded {
                s.state.outstanding -= 1;
            }
            s.live_cmds -= 1;
        }
        self.maybe_free_session(si);
    }

    /// Counts a finished I/O command in its volume's metrics (once).
    fn record_io(&mut self, ci: u16, ok: bool) {
        let cmd = self.cmds[ci as usize].as_ref().expect("live command");
        if cmd.op == NO_OP || cmd.vslot == NONE16 || cmd.responded || cmd.answer_waits {
            return;
        }
        let bytes = match cmd.kind {
            CmdKind::Read | CmdKind::Write | CmdKind::WriteInline => cmd.len as u64,
            CmdKind::Range => cmd.falloc_len,
            _ => 0,
        };
        let (op, latency) = (cmd.op as usize, cmd.start.elapsed());
        self.volume(cmd.vslot).stats.reactor(self.id).ops[op].record(bytes, ok, latency);
    }

    /// A read chunk is in the pool buffer (or, for the null backend, is
    /// zeroes): send it, chained with the response if it is the last.
    fn read_chunk_done(&mut self, si: u16, ci: u16, chunk: ChunkId) {
        let use_ = self.chunk_use[chunk.0 as usize];
        let cmd = self.cmd(ci);
        cmd.done += use_.len;
        if cmd.done == cmd.len {
            // The last chunk: its RDMA WRITE and the response in one chain.
            self.respond(ci, &[], Some(chunk));
        } else {
            self.post_rdma(si, ci, chunk, false);
        }
    }

    // ---------------------------------------------------------------- readahead

    /// Counts a READ of a file volume in its stream and, once the stream
    /// is sequential, reads chunks ahead of it: never a chunk a command
    /// waits for, and never the last quarter of the pool.
    fn read_ahead(&mut self, vslot: u16, offset: u64, len: u32, now: Instant) {
        if !self.readahead.on_read(vslot, offset, len, now) {
            return;
        }
        let lv = self.vols.slots[vslot as usize].as_ref().expect("live volume slot");
        if !lv.registered || lv.retiring {
            return;
        }
        let size = lv.vol.size;
        while self.waitq.is_empty() && self.pool.free_count() > self.pool.capacity() / 4 {
            let Some((at, n)) = self.readahead.want(vslot, size) else { break };
            let c = self.pool.alloc().expect("free chunk");
            // Taken before the read is submitted: a write that starts
            // later moves it.
            let epoch = self.volume(vslot).writes.of(at, n);
            self.readahead.issued(vslot, at, n, c, epoch);
            // The read holds the volume's slot (its fixed file) until it completes.
            self.vols.slots[vslot as usize].as_mut().expect("live volume slot").inflight += 1;
            self.uring.read_fixed(&mut self.pool, vslot as u32, c, 0, n, at, ud(U_READAHEAD, vslot, c.0));
        }
    }

    /// Reads a READ command's piece (`chunk_use[c]`) into its chunk `c`:
    /// from chunks read ahead when they hold it (waiting for their read if
    /// it is in flight), else from the disk.
    fn read_piece(&mut self, ci: u16, c: ChunkId) {
        let use_ = self.chunk_use[c.0 as usize];
        let cmd = self.cmds[ci as usize].as_ref().expect("live command");
        let (si, vslot, offset) = (cmd.sess, cmd.vslot, cmd.offset + use_.off as u64);
        let writes = &self.vols.slots[vslot as usize].as_ref().expect("live volume slot").vol.writes;
        let serve = self.readahead.lookup(vslot, offset, use_.len, c, |at, n| writes.of(at, n));
        match serve {
            Serve::Miss | Serve::Wait => {
                let cmd = self.cmd(ci);
                cmd.inflight += 1;
                cmd.at_disk = true;
                if serve == Serve::Miss {
                    self.uring.read_fixed(&mut self.pool, vslot as u32, c, 0, use_.len, offset, ud(U_READ, ci, c.0));
                }
            }
            Serve::Take(ahead) => {
                // Zero copy: the chunk read ahead takes the place (and the
                // pool charge) of the command's own.
                self.pool.move_charge(c, ahead);
                self.pool.release(c);
                self.chunk_use[ahead.0 as usize] = use_;
                self.read_chunk_done(si, ci, ahead);
            }
            Serve::Copy(parts) => {
                for p in parts.into_iter().flatten() {
                    self.pool.copy_between(p.chunk, p.from as usize, c, p.to as usize, p.len as usize);
                }
                self.read_chunk_done(si, ci, c);
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
            cmd.inflight -= 1;
            let (si, failed) = (cmd.sess, cmd.error.is_some());
            if failed || self.session_closing(si) {
                self.pool.release(w);
            } else {
                self.read_piece(ci, w);
            }
            self.progress(ci);
        }
        waiters.clear();
        self.readahead_waiters = waiters;
        if let Some(lv) = self.vols.slots[vslot as usize].as_mut() {
            lv.inflight -= 1;
            if lv.retiring && lv.inflight == 0 {
                self.maybe_release_volume(vslot);
            }
        }
    }

    /// Gives the chunks readahead let go of back to the pool.
    fn release_readahead(&mut self) {
        while let Some(c) = self.readahead.take_released() {
            self.pool.release(c);
        }
    }

    /// Whether the pool has a chunk for a command, after giving back the
    /// oldest chunk cached by readahead if it had none.
    fn chunk_for_command(&mut self) -> bool {
        if self.pool.free_count() > 0 {
            return true;
        }
        let evicted = self.readahead.evict();
        self.release_readahead();
        evicted
    }

    /// The range a WRITE, WRITE_ZEROES or DISCARD changes.
    fn write_range(&self, ci: u16) -> (u16, u64, u64) {
        let cmd = self.cmds[ci as usize].as_ref().expect("live command");
        let len = if cmd.kind == CmdKind::Range { cmd.falloc_len } else { cmd.len as u64 };
        (cmd.vslot, cmd.offset, len)
    }

    /// A write starts, before any of its disk I/O is submitted: what was
    /// read ahead of its range, on this reactor or any other, is unusable
    /// from now on (`backend::WriteEpochs`).
    fn begin_write(&mut self, ci: u16) {
        let (vslot, offset, len) = self.write_range(ci);
        self.volume(vslot).writes.bump(offset, len);
        self.cmd(ci).write_epoch_open = true;
        self.readahead.invalidate(vslot, offset, len);
        self.release_readahead();
    }

    /// A write has nothing in flight any more (answered, or given up with
    /// its queue pair): its range's epoch moves again, so that what was
    /// read ahead while it was in flight is not served after it.
    fn end_write(&mut self, ci: u16) {
        let cmd = self.cmds[ci as usize].as_ref().expect("live command");
        if !cmd.write_epoch_open || cmd.inflight > 0 {
            return;
        }
        let (vslot, offset, len) = self.write_range(ci);
        self.volume(vslot).writes.bump(offset, len);
        self.cmd(ci).write_epoch_open = false;
    }

    fn publish_readahead_stats(&self) {
        let c = self.readahead.counters;
        self.stats.readahead_issued.set(c.issued);
        self.stats.readahead_hits.set(c.hits);
        self.stats.readahead_unused.set(c.unused);
        self.stats.readahead_invalidated.set(c.invalidated);
        self.stats.readahead_chunks.set(self.readahead.held() as u64);
    }

    fn free_session_cmds(&mut self, si: u16) {
        for ci in 0..self.cmds.len() {
            if self.cmds[ci].as_ref().is_some_and(|c| c.sess == si) {
                self.maybe_free_cmd(ci as u16);
            }
        }
    }

    /// Stops using a queue pair: disconnects it, and frees it once every
    /// work request has flushed and its commands' io_uring ops completed.
    fn fail_session(&mut self, si: u16, reason: String) {
        let Some(s) = self.sessions[si as usize].s.as_ref() else { return };
        if s.closing.is_some() {
            return;
        }
        if !s.tx.is_empty() {
            // Posted before the disconnect, they flush and settle their
            // accounting like everything else outstanding. (A failed post
            // fails the session itself.)
            self.flush_session_sends(si);
        }
        let Some(s) = self.sessions[si as usize].s.as_mut() else { return };
        if s.closing.is_some() {
            return;
        }
        match &s.shared {
            Some(sh) => tracing::info!(
                "session disconnected: host={} session={:#x} queue={} reactor={} peer={} reason={reason}",
                s.host(),
                sh.id.0,
                s.queue_index,
                self.id,
                s.peer
            ),
            None => tracing::info!("session disconnected: host={} reactor={} peer={} reason={reason}", s.host(), self.id, s.peer),
        }
        s.closing = Some(reason);
        s.close_deadline = Some(Instant::now() + FLUSH_TIMEOUT);
        // Answers that waited for a response slot are never sent.
        let waiting = std::mem::take(&mut s.resp_wait);
        if let Some(res) = &s.res {
            res.qp.disconnect();
        }
        for w in waiting {
            if let Some(c) = w.chain {
                self.pool.release(c);
            }
        }
        self.free_session_cmds(si);
        self.maybe_free_session(si);
    }

    fn maybe_free_session(&mut self, si: u16) {
        let slot = &mut self.sessions[si as usize];
        let Some(s) = slot.s.as_ref() else { return };
        if s.closing.is_none() || s.live_cmds > 0 || s.sq_used > 0 || s.recv_posted > 0 {
            return;
        }
        let s = slot.s.take().expect("live session");
        slot.gen = slot.gen.wrapping_add(1);
        if s.fence.is_some() {
            self.fences_waiting -= 1;
        }
        self.fabrics[s.fabric].cqs[s.cq].reserved -= s.cq_reserved;
        self.free_sessions.push(si);
        self.stats.queue_pairs.set(self.stats.queue_pairs.get().saturating_sub(1));
        tracing::debug!("queue pair {} freed", s.peer);
        if let Some(shared) = &s.shared {
            if self.registry.leave(shared, self.id) {
                tracing::info!(
                    "session ended: host={} session={:#x} (its last queue pair is gone; {} commands dropped before reaching the disk)",
                    shared.host_id,
                    shared.id.0,
                    shared.dropped()
                );
            }
        }
        drop(s);
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
