//! The reactor runtime: one thread per core, each running every queue of
//! every protocol it was handed, as SPDK's poll groups and nvmet's per-CPU
//! workers do. A reactor owns one [`Executor`] (its io_uring, buffer pool,
//! fixed files, blocking worker, and the commands on them), its resources
//! on each fabric (protection domain, pool region, completion queues:
//! [`fabric`]), an epoll set, and its [`Transport`]s: one per protocol
//! front end (rdmablk v1, NVMe/TCP, NVMe/RDMA), each holding that
//! protocol's queues on this reactor.
//!
//! One loop turn: poll the fabric completion queues (each completion goes
//! to the transport that owns the fabric), reap the engine (disk
//! completions to the executor, socket receives to their transport), hand
//! free chunks to waiting commands, take control messages (new
//! connections, shutdown), let each transport do its per-turn work and
//! check deadlines, post what the transports queued, and submit the ring
//! once. Whatever the executor has to tell a command's owner is handed to
//! that transport as soon as the step that produced it ends.
//!
//! When nothing happened: arm the CQs, poll once more, then sleep until a
//! disk completion, a socket receive, a CQ event, a ready descriptor of a
//! transport, a blocking-worker result, a control message or the next
//! deadline. Where the kernel allows it (see [`crate::engine::uring`]) the
//! reactor sleeps in the ring itself: a one-shot poll on the epoll fd (the
//! wake poll) rides on the ring, so one `io_uring_enter` both submits and
//! waits, and a disk completion or socket receive wakes it without an
//! eventfd; a fired wake poll is answered by clearing every source (free
//! on tcp, see `clear_wake_sources`) rather than by asking epoll which one
//! fired, unless a transport has descriptors of its own in the set; while
//! the ring holds nothing (no disk I/O, no receive, no wake poll armed)
//! it sleeps in `epoll_wait` on the same set, which is cheaper for
//! whoever wakes it (see `idle_wait`). Otherwise it blocks in
//! `epoll_wait`, the ring's eventfd being in the set too. (On an iopoll
//! ring, which cannot carry the wake poll, the reactor keeps polling
//! while disk I/O is in flight.)
//!
//! The runtime knows no wire: a transport is whatever implements
//! [`Transport`], built for each reactor by the factory the control thread
//! passes in, and a new connection reaches it as an opaque hand-off.

use std::any::Any;
use std::sync::{mpsc, Arc};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use rdmablk_common::fabric::{release_free_heap, Completion, Fabric};

use crate::config::{TargetConfig, MAX_VOLUMES};
use crate::engine::exec::{self, CmdId, Event, Executor};
use crate::engine::uring::UringOptions;
use crate::engine::BlockEngine;
use crate::engine::pool::Pool;
use crate::error::{Error, ErrorKind, Result};
use crate::metrics::ReactorStats;
use crate::registry::Registry;
use crate::sys::{self, Epoll, EventFd};

pub mod fabric;

pub use fabric::{CqCtx, FabricCtx, CQ_ENTRIES_PER_DEPTH, QPS_PER_CQ};

/// Size of each ring's fixed-file table: room for every volume plus as many
/// removed ones still finishing their last commands.
pub const RING_FILE_SLOTS: u32 = 2 * MAX_VOLUMES as u32;

/// Sockets each ring can receive from (NVMe/TCP connections): one armed
/// receive each, their bytes read in the ring's sleep instead of by a
/// readiness wake-up and a `recv`. Connections beyond them are read on
/// epoll readiness.
pub const RING_SOCKET_SLOTS: u32 = 1024;
const CQ_BATCH: usize = 64;
const CQ_ROUNDS: usize = 4;

/// Queues (of every protocol) whose closing makes a reactor give the
/// heap's free memory back to the kernel ([`release_free_heap`]) before
/// its next sleep: once its queue count is this far below its highest
/// since it last did. A v1 queue pair's large buffers are mappings of
/// their own and go back when freed; the rest of a queue's state (the tcp
/// provider's send and receive queues and staging, 150 KiB at the default
/// depth; an NVMe/TCP queue's buffers) is heap the allocator would keep,
/// as much as the most queues ever open at once held.
const RELEASE_AFTER_CLOSES: u64 = 64;

/// Epoll tokens: a completion queue's is below `TOKEN_RUNTIME` (see
/// `fabric::cq_token`); the runtime's own descriptors follow; a
/// transport's descriptors have the top bit set, the transport's index in
/// bits 56 to 62 and the transport's own key below.
const TOKEN_RUNTIME: u64 = 1 << 40;
const TOKEN_URING: u64 = TOKEN_RUNTIME;
const TOKEN_CTRL: u64 = TOKEN_RUNTIME + 1;
const TOKEN_BLOCKING: u64 = TOKEN_RUNTIME + 2;
const TOKEN_TRANSPORT: u64 = 1 << 63;
const TRANSPORT_KEY_BITS: u32 = 56;

/// What a protocol front end provides to run its queues on a reactor (the
/// role of Linux nvmet's `nvmet_fabrics_ops` and SPDK's
/// `spdk_nvmf_transport_ops` with its poll group): one instance per
/// reactor holds all of that protocol's queues there. Every method runs
/// on the reactor's thread, with the [`Runtime`] it shares with the
/// other transports. Nothing here may block.
pub trait Transport {
    /// Takes a new connection the control thread handed over: whatever
    /// that transport's listener produces (its own type, downcast here).
    fn adopt(&mut self, rt: &mut Runtime, conn: Box<dyn Any + Send>);
    /// A work completion of one of its queue pairs on fabric `fi` (a
    /// fabric this transport owns).
    fn completion(&mut self, _rt: &mut Runtime, _fi: usize, _wc: Completion) {}
    /// A descriptor it put in the reactor's epoll set ([`Runtime::watch`])
    /// is ready.
    fn ready(&mut self, _rt: &mut Runtime, _key: u64) {}
    /// An engine completion with one of its tags ([`Runtime::engine_tag`]):
    /// a socket receive through the ring.
    fn engine_completion(&mut self, _rt: &mut Runtime, _key: u64, _res: i32) {}
    /// News of one of its commands from the executor: `tag` is what it
    /// submitted it with ([`exec::Owner::tag`]).
    fn exec_event(&mut self, rt: &mut Runtime, tag: u32, id: CmdId, ev: Event);
    /// Once per turn, after completions, reaps and control messages: its
    /// own per-turn work (fences, teardowns other threads asked for).
    fn turn(&mut self, _rt: &mut Runtime) {}
    /// At the end of every turn: posts what it queued this turn.
    fn flush(&mut self, _rt: &mut Runtime) {}
    /// The earliest moment [`Transport::check_deadlines`] has something to do.
    fn next_deadline(&self, rt: &Runtime) -> Option<Instant>;
    /// Deadlines that passed by `now` (the turn's start: deadlines are of
    /// seconds): handshakes, idle queues, keep-alives, flushes, shutdown.
    fn check_deadlines(&mut self, rt: &mut Runtime, now: Instant);
    /// The target stops (`rt.shutdown` is set): answer new commands as
    /// shutting down, and end every queue once its commands are done or
    /// the deadline passed (in `check_deadlines`).
    fn shutdown(&mut self, rt: &mut Runtime);
    /// Queues (connections) it still holds, closing ones included.
    fn live(&self) -> usize;
}

/// Messages from the control thread.
pub(crate) enum Control {
    /// A new connection for transport `transport` (its listener's product).
    Connect { transport: usize, conn: Box<dyn Any + Send> },
    /// Finish in-flight commands (until `deadline`), disconnect everything, exit.
    Shutdown { deadline: Instant },
}

/// Builds a reactor's transports on its own thread, in index order (a
/// transport's index is what its fabrics, epoll tokens and commands name).
pub type TransportFactory = Box<dyn FnOnce(&mut Runtime) -> Result<Vec<Box<dyn Transport>>> + Send>;

/// What a reactor thread is started with.
pub(crate) struct ReactorSpec {
    pub id: usize,
    pub cfg: TargetConfig,
    pub registry: Arc<Registry>,
    /// The fabrics its transports' queue pairs live on, each with the
    /// index of the transport that owns it, and the queue depth its
    /// completion queues are sized for.
    pub fabrics: Vec<(Arc<Fabric>, usize, u32)>,
    pub transports: TransportFactory,
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
    pub stats: Arc<ReactorStats>,
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

    /// Hands a new connection to transport `transport`. Returns it back
    /// if the reactor is gone.
    pub fn hand_off(&self, transport: usize, conn: Box<dyn Any + Send>) -> std::result::Result<(), Box<dyn Any + Send>> {
        match self.send(Control::Connect { transport, conn }) {
            Ok(()) => Ok(()),
            Err(Control::Connect { conn, .. }) => Err(conn),
            Err(Control::Shutdown { .. }) => unreachable!("a Connect was sent"),
        }
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

/// The reactor least loaded by queues (ties: the next after `*next`, so
/// that equal reactors take turns): where a new connection goes.
pub(crate) fn least_loaded(reactors: &[ReactorHandle], next: &mut usize) -> usize {
    let n = reactors.len();
    let start = *next % n;
    let best = (0..n).map(|k| (start + k) % n).min_by_key(|&i| reactors[i].stats.queue_pairs.get()).expect("a reactor");
    *next = best + 1;
    best
}

/// Starts a reactor thread and waits until it is initialised.
pub(crate) fn spawn(spec: ReactorSpec) -> Result<ReactorHandle> {
    let id = spec.id;
    let (tx, rx) = mpsc::channel();
    let wake = Arc::new(EventFd::new().map_err(|e| Error::os("eventfd", e))?);
    let (ready_tx, ready_rx) = mpsc::sync_channel::<Result<()>>(1);
    let wake2 = Arc::clone(&wake);
    let stats = Arc::clone(&spec.stats);
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
    let mut handle = ReactorHandle { id, tx, wake, stats, thread: Some(thread) };
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

/// What the transports of a reactor share: the executor, the fabric
/// resources, the epoll set, and the turn's clock.
pub struct Runtime {
    pub id: usize,
    /// The reactor's commands on its block engine.
    pub exec: Executor,
    /// Per fabric: protection domain, pool region, completion queues.
    pub fabrics: Vec<FabricCtx>,
    pub registry: Arc<Registry>,
    pub stats: Arc<ReactorStats>,
    pub cfg: TargetConfig,
    /// When this turn began (the wake-up, or the end of the turn before):
    /// the clock of what the turn does that needs no finer one (when a
    /// command arrived, deadlines of seconds), so a command costs no clock
    /// read of its own before its answer leaves.
    pub turn_start: Instant,
    /// Set once the target stops: the deadline for in-flight commands.
    pub shutdown: Option<Instant>,
    epoll: Epoll,
    /// Descriptors of transports in the epoll set: while there are any, a
    /// fired wake poll asks epoll which descriptor fired.
    watched: usize,
}

impl Runtime {
    /// Puts a transport's descriptor in the reactor's epoll set for
    /// `events` (`sys::READABLE`, `sys::WRITABLE`); it then hears
    /// [`Transport::ready`] with `key` (below 2^56).
    pub fn watch(&mut self, transport: usize, fd: std::os::fd::RawFd, key: u64, events: u32) -> std::io::Result<()> {
        debug_assert!(key < 1 << TRANSPORT_KEY_BITS);
        self.epoll.add_events(fd, transport_token(transport, key), events)?;
        self.watched += 1;
        Ok(())
    }

    /// Changes the events a watched descriptor is watched for.
    pub fn rewatch(&self, transport: usize, fd: std::os::fd::RawFd, key: u64, events: u32) -> std::io::Result<()> {
        self.epoll.modify(fd, transport_token(transport, key), events)
    }

    /// Takes a descriptor out of the epoll set (before it is closed).
    pub fn unwatch(&mut self, fd: std::os::fd::RawFd) {
        if self.epoll.remove(fd).is_ok() {
            self.watched -= 1;
        }
    }

    /// An engine tag for transport `transport` with its `key` (below
    /// 2^56): its completion comes to [`Transport::engine_completion`].
    pub fn engine_tag(transport: usize, key: u64) -> u64 {
        debug_assert!(transport < 8 && key < 1 << TRANSPORT_KEY_BITS);
        (8 | transport as u64) << 60 | key
    }

    /// A completion queue of fabric `fi` with room for `reserve` more
    /// entries beside the pool's RDMA operations, created if none has.
    pub fn cq_with_room(&mut self, fi: usize, reserve: u32) -> Result<usize> {
        let chunks = self.exec.engine().pool().capacity() as u32;
        let f = &self.fabrics[fi];
        if let Some(ci) = f.cqs.iter().position(|c| c.reserved + reserve <= c.capacity.saturating_sub(chunks)) {
            return Ok(ci);
        }
        let ci = f.cqs.len();
        let cq = fabric::new_cq(&f.fabric, &self.epoll, fi, ci, chunks, f.queue_depth)?;
        tracing::info!(
            "reactor {}: {}: completion queue {} of {} entries created ({} queues served)",
            self.id,
            f.fabric.url(),
            ci + 1,
            cq.capacity,
            self.stats.queue_pairs.get()
        );
        self.fabrics[fi].cqs.push(cq);
        Ok(ci)
    }
}

fn transport_token(transport: usize, key: u64) -> u64 {
    TOKEN_TRANSPORT | (transport as u64) << TRANSPORT_KEY_BITS | key
}

struct Reactor {
    // Field order is drop order: the transports' queues, then the runtime
    // (fabric resources, then the executor, whose ring waits for its
    // in-flight operations, then the pool).
    transports: Vec<Box<dyn Transport>>,
    rt: Runtime,
    rx: mpsc::Receiver<Control>,
    wake: Arc<EventFd>,
    wcs: Vec<Completion>,
    tokens: Vec<u64>,
    foreign: Vec<(u64, i32)>,
    /// `[target] busy_poll`, and when the last turn with work ended.
    busy_poll: Duration,
    last_work: Instant,
    /// The last sleep in the ring ended without the wake poll firing (a
    /// disk completion, a receive, or the timeout): the CQs, armed before
    /// it, had nothing, or the epoll fd would have been readable. The next
    /// turn skips polling them; the sleep after it arms them (and polls
    /// those that need it, see `arm_cqs`), so a completion that lands
    /// meanwhile ends that sleep at once or is found by that poll.
    fabrics_quiet: bool,
    /// The most queues this reactor served since it last gave the heap's
    /// free memory back (sampled before each sleep).
    queues_high: u64,
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
            socket_slots: RING_SOCKET_SLOTS,
            // The ring watches the epoll set while the reactor sleeps in it.
            wake_fd: Some(epoll.fd()),
        };
        let engine = BlockEngine::new(pool, opts, spec.id)?;
        let features = engine.features();
        if spec.id == 0 {
            let sockets = if engine.receives() { RING_SOCKET_SLOTS } else { 0 };
            tracing::info!(
                "io_uring: ring of {entries} entries per reactor, {} fixed-file slots, {chunks} fixed buffers of {} bytes, {sockets} socket receive slots; opcodes: {features}",
                RING_FILE_SLOTS,
                cfg.chunk_size
            );
        }
        if !features.fallocate && !features.iopoll {
            tracing::warn!("io_uring has no FALLOCATE: DISCARD and WRITE_ZEROES of files and RAM volumes will fail with NOT_SUPPORTED");
        }
        let mut fabrics = Vec::with_capacity(spec.fabrics.len());
        for (fi, (f, owner, queue_depth)) in spec.fabrics.iter().enumerate() {
            let url = f.url().to_string();
            let pd = f.alloc_pd().map_err(|e| Error::fabric(format!("{url}: cannot allocate a protection domain"), e))?;
            let pool_mr = engine.pool().register(&pd).map_err(|e| Error::fabric(format!("{url}: cannot register the buffer pool"), e))?;
            // The first completion queue now, so that a device too small
            // for one queue pair stops the daemon at start.
            let first = fabric::new_cq(f, &epoll, fi, 0, chunks, *queue_depth)?;
            fabrics.push(FabricCtx { pool_mr, cqs: vec![first], pd, fabric: Arc::clone(f), owner: *owner, queue_depth: *queue_depth });
        }
        let cq_capacity = fabrics.first().map_or(0, |f| f.cqs[0].capacity);
        // Only when the reactor sleeps in epoll: sleeping in the ring, a
        // completion ends the sleep itself.
        if let Some(fd) = engine.wait_fds().next() {
            epoll.add(fd, TOKEN_URING).map_err(|e| Error::os("epoll_ctl", e))?;
        }
        epoll.add(wake.fd(), TOKEN_CTRL).map_err(|e| Error::os("epoll_ctl", e))?;
        let settings = exec::Settings {
            id: spec.id,
            volume_slots: RING_FILE_SLOTS,
            pool_share: cfg.session_pool_share.chunks(chunks, cfg.chunk_size),
            host_pool_share: cfg.host_pool_share.chunks(chunks, cfg.chunk_size),
            chunk_wait_timeout: cfg.chunk_wait_timeout,
            readahead: cfg.readahead,
        };
        let exec = Executor::new(engine, settings, Arc::clone(spec.registry.publication()), Arc::clone(&spec.stats));
        tracing::debug!("reactor {} ready: {} chunks of {} bytes, ring of {entries}, CQ of {cq_capacity}", spec.id, chunks, cfg.chunk_size);
        let mut rt = Runtime {
            id: spec.id,
            exec,
            fabrics,
            registry: spec.registry,
            stats: spec.stats,
            cfg: spec.cfg.clone(),
            turn_start: Instant::now(),
            shutdown: None,
            epoll,
            watched: 0,
        };
        let transports = (spec.transports)(&mut rt)?;
        rt.registry.add_waker(Arc::clone(&wake));
        Ok(Reactor {
            transports,
            busy_poll: rt.cfg.busy_poll,
            rt,
            rx,
            wake,
            wcs: vec![Completion::EMPTY; CQ_BATCH],
            tokens: Vec::with_capacity(32),
            foreign: Vec::new(),
            last_work: Instant::now(),
            fabrics_quiet: false,
            queues_high: 0,
        })
    }

    fn run(mut self) -> Result<()> {
        self.rt.turn_start = Instant::now();
        loop {
            let mut work = if std::mem::take(&mut self.fabrics_quiet) { 0 } else { self.poll_fabrics()? };
            work += self.reap_engine();
            self.rt.exec.pump_waitq();
            self.dispatch();
            work += self.control();
            for t in self.transports.iter_mut() {
                t.turn(&mut self.rt);
            }
            self.dispatch();
            self.check_deadlines();
            // Chunks a flush sent go back at once (a socket write): their
            // commands may be done, and answered in the same turn.
            loop {
                self.flush();
                if !self.rt.exec.has_events() {
                    break;
                }
                self.dispatch();
            }
            // A turn followed by a sleep in the ring leaves its SQEs to the
            // sleep's io_uring_enter, a few microseconds later (its arm and
            // poll), which submits and waits in one system call.
            let sleeps_next = self.rt.exec.engine().sleeps_in_ring() && self.busy_poll.is_zero();
            if !sleeps_next {
                self.rt.exec.engine_mut().submit()?;
            }
            self.watch_worker();
            self.rt.stats.heartbeat.add(1);
            self.rt.registry.turned(self.rt.id);
            self.rt.exec.publish_stats();
            if self.finished() {
                tracing::debug!("reactor {} done", self.rt.id);
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
                self.rt.stats.busy_ns.add(now.saturating_duration_since(self.rt.turn_start).as_nanos() as u64);
                self.last_work = now;
            }
            if !self.rt.exec.engine().needs_polling() && now.saturating_duration_since(self.last_work) >= self.busy_poll {
                self.release_memory();
                self.rt.turn_start = self.idle_wait()?;
                continue;
            }
            self.rt.turn_start = now;
        }
    }

    /// On the way to sleep: after [`RELEASE_AFTER_CLOSES`] queues closed,
    /// gives the heap's free memory back to the kernel, so that what a
    /// burst of connections held does not stay with the process.
    fn release_memory(&mut self) {
        let queues = self.rt.stats.queue_pairs.get();
        self.queues_high = self.queues_high.max(queues);
        if self.queues_high - queues < RELEASE_AFTER_CLOSES {
            return;
        }
        let closed = self.queues_high - queues;
        self.queues_high = queues;
        let t0 = Instant::now();
        let released = release_free_heap();
        tracing::debug!(
            "reactor {}: {closed} queues closed: free heap memory {} the kernel in {:?}",
            self.rt.id,
            if released { "given back to" } else { "already with" },
            t0.elapsed()
        );
    }

    fn finished(&self) -> bool {
        self.rt.shutdown.is_some()
            && self.transports.iter().all(|t| t.live() == 0)
            && self.rt.exec.live() == 0
            && self.rt.exec.engine().inflight() == 0
    }

    /// Hands the executor's news to the transports that own the commands.
    #[inline]
    fn dispatch(&mut self) {
        while let Some((owner, id, ev)) = self.rt.exec.pop_event() {
            self.transports[owner.transport as usize].exec_event(&mut self.rt, owner.tag, id, ev);
        }
    }

    /// Posts what every transport queued this turn.
    fn flush(&mut self) {
        for t in self.transports.iter_mut() {
            t.flush(&mut self.rt);
        }
    }

    /// After a turn that may have started the blocking worker: its results
    /// wake this reactor's epoll set.
    fn watch_worker(&mut self) {
        while let Some(fd) = self.rt.exec.engine_mut().started_worker_fd() {
            if let Err(e) = self.rt.epoll.add(fd, TOKEN_BLOCKING) {
                tracing::error!("reactor {}: epoll_ctl: {e}", self.rt.id);
            }
        }
    }

    fn poll_fabrics(&mut self) -> Result<usize> {
        let mut total = 0;
        for fi in 0..self.rt.fabrics.len() {
            let owner = self.rt.fabrics[fi].owner;
            for ci in 0..self.rt.fabrics[fi].cqs.len() {
                for _ in 0..CQ_ROUNDS {
                    let cq = &self.rt.fabrics[fi].cqs[ci].cq;
                    let n = cq.poll(&mut self.wcs).map_err(|e| Error::fabric("completion queue poll failed", e))?;
                    for i in 0..n {
                        let wc = self.wcs[i];
                        self.transports[owner].completion(&mut self.rt, fi, wc);
                    }
                    total += n;
                    self.dispatch();
                    if n < self.wcs.len() {
                        break;
                    }
                }
            }
        }
        Ok(total)
    }

    /// Reaps the engine: disk completions go to the executor (and its news
    /// to the owners), the others to the transport whose tag they carry.
    fn reap_engine(&mut self) -> usize {
        // The ring's eventfd (sleeping in epoll; sleeping in the ring there
        // is none) is cleared in `idle_wait` when it fired, not here:
        // reading it every turn cost a syscall per turn.
        let n = self.rt.exec.reap();
        self.rt.exec.take_foreign(&mut self.foreign);
        let mut foreign = std::mem::take(&mut self.foreign);
        for &(tag, res) in &foreign {
            let transport = ((tag >> 60) & 7) as usize;
            let key = tag & ((1 << TRANSPORT_KEY_BITS) - 1);
            match self.transports.get_mut(transport) {
                Some(t) => t.engine_completion(&mut self.rt, key, res),
                None => tracing::error!("reactor {}: engine completion {tag:#x} for no transport", self.rt.id),
            }
        }
        foreign.clear();
        self.foreign = foreign;
        self.dispatch();
        n
    }

    fn control(&mut self) -> usize {
        // The wake eventfd is drained in `idle_wait` when it fired; the
        // channel is checked every turn without a syscall.
        self.rt.exec.maybe_refresh();
        let mut n = 0;
        while let Ok(msg) = self.rx.try_recv() {
            n += 1;
            match msg {
                Control::Connect { transport, conn } => match self.transports.get_mut(transport) {
                    Some(t) => t.adopt(&mut self.rt, conn),
                    None => tracing::error!("reactor {}: a connection for transport {transport}, which it does not run", self.rt.id),
                },
                Control::Shutdown { deadline } => {
                    if self.rt.shutdown.is_none() {
                        tracing::debug!("reactor {}: shutting down", self.rt.id);
                        self.rt.shutdown = Some(deadline);
                        for t in self.transports.iter_mut() {
                            t.shutdown(&mut self.rt);
                        }
                    }
                }
            }
        }
        self.dispatch();
        n
    }

    fn check_deadlines(&mut self) {
        // Deadlines here are of seconds (handshake, idle, shutdown) or a
        // readahead chunk's life: the turn's start is clock enough.
        let now = self.rt.turn_start;
        self.rt.exec.check_deadlines(now);
        self.dispatch();
        for t in self.transports.iter_mut() {
            t.check_deadlines(&mut self.rt, now);
        }
        self.dispatch();
    }

    /// The earliest moment the executor or a transport has something to do.
    fn next_deadline(&self) -> Option<Instant> {
        let mut d = self.rt.exec.next_deadline();
        for t in &self.transports {
            if let Some(t) = t.next_deadline(&self.rt) {
                d = Some(d.map_or(t, |x: Instant| x.min(t)));
            }
        }
        d
    }

    // ---------------------------------------------------------------- sleeping

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
    /// on the null volume: docs/perf-log/issue-20-looks.md, "Issue 20, sixth look"). A wake
    /// poll still armed from a sleep in the ring (the file volume at QD1:
    /// the reactor slept for the disk, answered, and has nothing in
    /// flight) is withdrawn first, one `io_uring_enter` after the answer
    /// went out, off the next command's path ("Issue 20, eighth look"),
    /// unless it already fired (`BlockEngine::withdraw_wake_poll`).
    /// If it fired before the withdrawal caught it, the wake-up is handled
    /// as a sleep's would be; if its end is not reaped yet, the reactor
    /// sleeps in the ring, where that end wakes it.
    fn idle_wait(&mut self) -> Result<Instant> {
        let engine = self.rt.exec.engine_mut();
        if engine.sleeps_in_ring() && engine.inflight() == 0 && engine.recvs_armed() == 0 && engine.wake_poll_armed() {
            engine.withdraw_wake_poll()?;
        }
        // A busy turn (or the withdrawal) reaped the wake poll: handle what
        // is ready before the CQs are armed again (acknowledging a CQ event
        // after arming it would disarm it on tcp) and let a turn read the
        // control channel after its eventfd is drained. The next idle turn
        // sleeps.
        if self.rt.exec.engine_mut().take_wake() {
            // The turn's SQEs wait for no sleep: submit them now.
            self.rt.exec.engine_mut().submit()?;
            self.clear_wake_sources()?;
            return Ok(Instant::now());
        }
        let engine = self.rt.exec.engine();
        if engine.sleeps_in_ring() && (engine.inflight() > 0 || engine.recvs_armed() > 0 || engine.wake_poll_armed()) {
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
        for c in self.rt.fabrics.iter().flat_map(|f| &f.cqs) {
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
        for c in self.rt.fabrics.iter().flat_map(|f| &f.cqs) {
            c.cq.disarm();
        }
    }

    /// Sleeps in `io_uring_enter`, woken by a ring completion, by the wake
    /// poll on the epoll fd, or at the timeout.
    ///
    /// Why nothing is missed. The ring: completions posted since the last
    /// reap sit in the completion queue, and the kernel checks it before it
    /// sleeps, so a disk completion or a socket receive at any moment ends
    /// the sleep. The CQs: they are armed before the last poll, so a
    /// completion the poll missed makes the CQ fd, and thereby the epoll fd,
    /// readable (tcp CQs are not polled after the arm: their fd is
    /// level-triggered on what a poll would find, and `arm` fires it for
    /// completions already queued). A transport's descriptors are in the
    /// epoll set, level-triggered. The control and blocking-worker
    /// eventfds are written after the message or result is queued, and the
    /// channels are read on every turn after their eventfd was drained
    /// (`clear_wake_sources` is always followed by a turn), so a write the
    /// last turn did not see leaves the epoll fd readable.
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
            self.rt.exec.engine_mut().submit()?;
            self.disarm_cqs();
            return Ok(Instant::now());
        }
        let timeout = self.next_deadline().map(|d| d.saturating_duration_since(Instant::now()));
        self.rt.stats.idle_waits.add(1);
        self.rt.exec.engine_mut().sleep(timeout)?;
        let mut woke = Instant::now();
        self.rt.turn_start = woke;
        if self.reap_engine() > 0 {
            // Work as a turn's would be: counted busy, and `busy_poll`
            // runs from here (the next turn's time from here too).
            let now = Instant::now();
            self.rt.stats.busy_ns.add(now.saturating_duration_since(woke).as_nanos() as u64);
            self.last_work = now;
            woke = now;
        }
        if self.rt.exec.engine_mut().take_wake() {
            self.clear_wake_sources()?;
        } else {
            self.fabrics_quiet = true;
        }
        Ok(woke)
    }

    /// After the wake poll fired: makes every source in the epoll set
    /// unready again. Without descriptors of transports in the set, it
    /// does not ask epoll which one fired (an `epoll_wait` per wake-up):
    /// acknowledging a CQ costs no system call on tcp (it disarms, and
    /// reads its channel only if it was written) and one non-blocking read
    /// on verbs; the control eventfd is read only when it was notified.
    /// What made a CQ's fd readable besides its channel (a socket, a
    /// timer) is consumed by the next turn's poll, and the blocking
    /// worker's eventfd by its reap. With transport descriptors in the
    /// set, epoll is asked (without waiting) and each ready one handled.
    fn clear_wake_sources(&mut self) -> Result<()> {
        if self.rt.watched > 0 {
            return self.wait_epoll(Some(Duration::ZERO));
        }
        for c in self.rt.fabrics.iter().flat_map(|f| &f.cqs) {
            c.cq.ack_event().map_err(|e| Error::fabric("cannot acknowledge CQ event", e))?;
        }
        self.wake.drain_if_notified();
        self.rt.exec.engine_mut().clear_wake();
        Ok(())
    }

    /// Blocks in `epoll_wait` on the CQ fds and the eventfds (the ring's too).
    fn idle_wait_in_epoll(&mut self) -> Result<()> {
        if self.arm_cqs()? && self.poll_fabrics()? > 0 {
            self.disarm_cqs();
            return Ok(());
        }
        let timeout = self.next_deadline().map(|d| d.saturating_duration_since(Instant::now()));
        self.rt.stats.idle_waits.add(1);
        self.wait_epoll(timeout)
    }

    /// Waits up to `timeout` (`None`: no limit) for the epoll set and
    /// handles what is ready: acknowledges CQ events, drains the control
    /// eventfd and the ring's, and tells transports their descriptors are
    /// ready. The caller returns to a loop turn after it.
    fn wait_epoll(&mut self, timeout: Option<Duration>) -> Result<()> {
        let mut tokens = std::mem::take(&mut self.tokens);
        let r = self.rt.epoll.wait(&mut tokens, timeout);
        if r.is_ok() {
            self.rt.turn_start = Instant::now();
        }
        for &t in &tokens {
            match t {
                // Cleared before the next turn reaps, so no completion
                // posted after the clear goes unnoticed.
                TOKEN_URING | TOKEN_BLOCKING => self.rt.exec.engine_mut().clear_wake(),
                TOKEN_CTRL => {
                    self.wake.drain();
                }
                _ if t & TOKEN_TRANSPORT != 0 => {
                    let transport = ((t & !TOKEN_TRANSPORT) >> TRANSPORT_KEY_BITS) as usize;
                    let key = t & ((1 << TRANSPORT_KEY_BITS) - 1);
                    if let Some(tr) = self.transports.get_mut(transport) {
                        tr.ready(&mut self.rt, key);
                    }
                }
                _ if t < TOKEN_RUNTIME => {
                    let (fi, ci) = fabric::split_cq_token(t);
                    self.rt.fabrics[fi].cqs[ci].cq.ack_event().map_err(|e| Error::fabric("cannot acknowledge CQ event", e))?;
                }
                _ => {}
            }
        }
        self.tokens = tokens;
        self.dispatch();
        r.map_err(|e| Error::os("epoll_wait", e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_and_tags_keep_their_spaces_apart() {
        let t = transport_token(2, (1 << TRANSPORT_KEY_BITS) - 1);
        assert!(t & TOKEN_TRANSPORT != 0 && (t & !TOKEN_TRANSPORT) >> TRANSPORT_KEY_BITS == 2);
        assert!(fabric::cq_token(7, 0xf_ffff) < TOKEN_RUNTIME);
        assert_eq!(fabric::split_cq_token(fabric::cq_token(7, 12)), (7, 12));
        let tag = Runtime::engine_tag(3, 42);
        assert!(!crate::engine::exec::is_executor_tag(tag));
        assert_eq!(((tag >> 60) & 7, tag & ((1 << TRANSPORT_KEY_BITS) - 1)), (3, 42));
    }
}
