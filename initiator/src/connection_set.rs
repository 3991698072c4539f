//! The connection set: the state a session's handles share, and the
//! machinery behind it (the layer between the queue pairs, `conn.rs` and
//! `queue.rs`, and the [`Session`](crate::Session) handle):
//! connecting queue pairs, the control state (connected, reconnecting,
//! lost, closed), the retry loop every request runs in, and the monitor
//! thread that sends keep-alives on idle queues and reconnects.
//!
//! # Locks
//! - One mutex per queue ([`QueueSlot::q`]): the hot path takes only the
//!   calling thread's own queue lock; no lock is shared between queues.
//! - `volumes` (the session's open volumes), cold: OPEN, CLOSE, reconnect.
//! - `ctl` (the control state), cold, a leaf: nothing is locked while it
//!   is held.
//!
//! Order: `volumes` → queue → `ctl`. A thread waiting for reconnection holds
//! no queue lock.
//!
//! # Reconnection
//! Any connection failure (the peer closed it, a missed deadline, a
//! keep-alive without answer, a target shutting down) is reported with the
//! generation of the failed connection. The first report of a generation
//! dooms every queue of it (so callers blocked on other queue pairs give up
//! within one wait slice) and wakes the monitor, which builds a complete new
//! connection set: CONNECT with session id 0 on the first queue pair, joins
//! for the others, then OPEN of every open volume by name (the new ids are
//! mapped per generation). It installs the new connections into the queues
//! and wakes the waiting callers, who re-issue what was not done. Attempts
//! follow each other with a backoff starting at `reconnect_delay`; when
//! `ctrl_loss_timeout` has passed since the failure the session is lost for
//! good.
//!
//! # Several gateways
//! A volume may be served by several gateways ([`Targets`]), one at a time.
//! The session connects to the first that answers, in list order; after a
//! failure each round of attempts tries the gateways after the lost one
//! first and the lost one last ([`rotation`]), with the backoff between
//! rounds. Each gateway knows only its own sessions, so the reconnect fence
//! names the session this initiator last had at the gateway it connects
//! to ([`Gateway::session`]): a fresh CONNECT where it had none. A volume
//! re-opened on another gateway must have the size and block size it was
//! opened with, or the session ends. A command answered `NotOwner` (the
//! gateway lost the volume to another) breaks the connection like a failure
//! and is retried on the next gateway (`ConnParams::failover`).

use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock, TryLockError, Weak};
use std::time::{Duration, Instant};

use rdmablk_common::fabric::{Access, Fabric, FabricErrorKind, FabricUrl, QpCaps};
use rdmablk_common::protocol::{
    CommandCapsule, CommandId, ConnectReply, Opcode, SessionId, Status, VolumeId, VolumeInfo, COMMAND_CAPSULE_SIZE,
    MAX_HOST_ID_LEN, PROTOCOL_VERSION, RESPONSE_SLOT_SIZE,
};

use crate::buffer::Region;
use crate::conn::{status_error, Alarm, Conn, ConnParams, KeepAliveTiming, Outcome, SendSlots, Stats, MAX_WAIT_SLICE};
use crate::domain::Domain;
use crate::duration::spaced_duration;
use crate::error::{fmt_duration, Error, ErrorKind, Result};
use crate::options::{ConnectOptions, NegotiatedLimits};
use crate::queue::Queue;
use crate::targets::{rotation, Targets};

/// Receives posted beyond the requested queue depth.
const RECV_MARGIN: usize = 4;
/// Most inline write data this initiator puts in one command, whatever the
/// target offers (bounds the send slot memory: depth × slot).
const INLINE_CAP: usize = 8192;
/// The `tracing` target of the reconnection's progress (the loss, each
/// attempt, the outcome), which the CLI prints at info level.
pub(crate) const RECONNECT_LOG: &str = "rdmablk::reconnect";

/// Longest pause between reconnection attempts, unless `reconnect_delay`
/// itself is longer.
const MAX_BACKOFF: Duration = Duration::from_secs(5);

pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while a request ran closed its connection (see Conn::pipeline),
    // so the state behind a poisoned lock is consistent.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// One I/O queue of a session.
pub(crate) struct QueueSlot {
    pub(crate) q: Mutex<Queue>,
    /// Notified when a user of the queue gave command slots back.
    pub(crate) freed: Condvar,
    /// Threads waiting on `freed`: a notification without a waiter would
    /// still cost a futex call per reap.
    pub(crate) freed_waiters: AtomicUsize,
    pub(crate) alarm: Arc<Alarm>,
    /// This queue's counters (per queue, so queues share no cache line).
    pub(crate) stats: Arc<Stats>,
}

impl QueueSlot {
    /// Wakes the users of this queue waiting for a command slot, if any.
    pub(crate) fn notify_freed(&self) {
        if self.freed_waiters.load(Ordering::SeqCst) > 0 {
            self.freed.notify_all();
        }
    }

    /// Waits (at most `slice`; a notification may be missed by the waiter
    /// that registers just after it) until a user gives slots back.
    pub(crate) fn wait_freed<'a>(&self, q: MutexGuard<'a, Queue>, slice: Duration) -> MutexGuard<'a, Queue> {
        self.freed_waiters.fetch_add(1, Ordering::SeqCst);
        let q = self.freed.wait_timeout(q, slice).unwrap_or_else(|e| e.into_inner()).0;
        self.freed_waiters.fetch_sub(1, Ordering::SeqCst);
        q
    }
}

/// Where the session stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Phase {
    Connected = 0,
    Reconnecting = 1,
    /// Final: reconnection gave up (or is disabled).
    Lost = 2,
    /// Final: closed by this initiator, or every handle is gone.
    Closed = 3,
}

pub(crate) struct CtlState {
    /// Generation of the current connection set (the one being replaced
    /// while reconnecting).
    pub(crate) gen: u32,
    pub(crate) phase: Phase,
    pub(crate) session_id: SessionId,
    failed_since: Option<Instant>,
    /// The last failure, for messages.
    reason: String,
    /// Set when the session ended because another gateway serves one of its
    /// volumes with another size: (volume, detail), the error requests get.
    mismatch: Option<(String, String)>,
}

/// The control state and its condition variable. The monitor thread holds
/// it strongly and the session only weakly, so it can wait on it.
pub(crate) struct Ctl {
    pub(crate) st: Mutex<CtlState>,
    pub(crate) cv: Condvar,
    /// `st.phase`, readable without the lock: the I/O path checks it on
    /// every request, and must not take a lock all queues share.
    fast: AtomicU8,
}

impl Ctl {
    /// Changes the phase (with `st` locked) and its lock-free mirror.
    fn set_phase(&self, st: &mut CtlState, phase: Phase) {
        st.phase = phase;
        self.fast.store(phase as u8, Ordering::Release);
    }

    fn fast_phase(&self) -> Phase {
        match self.fast.load(Ordering::Acquire) {
            0 => Phase::Connected,
            1 => Phase::Reconnecting,
            2 => Phase::Lost,
            _ => Phase::Closed,
        }
    }
}

/// An open volume of the session, shared by its handles and by requests.
pub(crate) struct VolumeEntry {
    pub(crate) name: String,
    /// What OPEN reported the first time.
    pub(crate) info: VolumeInfo,
    /// `generation << 32 | volume id` of the latest connection set that
    /// opened it.
    remote: AtomicU64,
    /// Set when a reconnection found the volume gone or changed.
    lost: Mutex<Option<Error>>,
    lost_flag: AtomicBool,
}

impl VolumeEntry {
    pub(crate) fn new(info: VolumeInfo, gen: u32) -> VolumeEntry {
        VolumeEntry {
            name: info.name.clone(),
            remote: AtomicU64::new(pack(gen, info.volume_id)),
            info,
            lost: Mutex::new(None),
            lost_flag: AtomicBool::new(false),
        }
    }

    fn set_remote(&self, gen: u32, id: VolumeId) {
        self.remote.store(pack(gen, id), Ordering::Release);
    }

    fn mark_lost(&self, e: Error) {
        tracing::warn!(volume = %self.name, error = %e, "volume unusable after reconnecting");
        *lock(&self.lost) = Some(e);
        self.lost_flag.store(true, Ordering::Release);
    }

    /// The volume's id on connections of generation `gen`. `Err(Some)`: the
    /// volume is gone or changed; `Err(None)`: not opened in that
    /// generation (a stale connection).
    pub(crate) fn remote_id(&self, gen: u32) -> std::result::Result<VolumeId, Option<Error>> {
        let v = self.remote.load(Ordering::Acquire);
        if (v >> 32) as u32 == gen {
            return Ok(VolumeId(v as u32));
        }
        if self.lost_flag.load(Ordering::Acquire) {
            return Err(Some(self.lost_error()));
        }
        Err(None)
    }

    /// The id in the latest connection set.
    pub(crate) fn current_id(&self) -> VolumeId {
        VolumeId(self.remote.load(Ordering::Acquire) as u32)
    }

    fn lost_error(&self) -> Error {
        match &*lock(&self.lost) {
            Some(Error::VolumeChanged { name, detail }) => {
                Error::VolumeChanged { name: name.clone(), detail: detail.clone() }
            }
            _ => Error::UnknownVolume { name: self.name.clone() },
        }
    }
}

fn pack(gen: u32, id: VolumeId) -> u64 {
    (u64::from(gen) << 32) | u64::from(id.0)
}

/// One of the session's gateways.
pub(crate) struct Gateway {
    pub(crate) url: FabricUrl,
    /// The target name of its first CONNECT reply.
    target_name: OnceLock<String>,
    /// The latest session this initiator had at this gateway (0: none), which
    /// a new session there replaces (the reconnect fence). Another gateway
    /// knows nothing of it.
    session: AtomicU64,
}

impl Gateway {
    fn new(url: FabricUrl) -> Gateway {
        Gateway { url, target_name: OnceLock::new(), session: AtomicU64::new(0) }
    }

    /// Connects a set of queue pairs to this gateway (see [`connect_set`]),
    /// replacing this initiator's latest session here.
    #[allow(clippy::too_many_arguments)]
    fn connect_set(
        &self,
        domain: &Arc<Domain>,
        options: &ConnectOptions,
        params: ConnParams,
        alarms: &[Arc<Alarm>],
        stats: &[Arc<Stats>],
        gen: u32,
        deadline: Instant,
    ) -> Result<ConnSet> {
        // The session's memory is registered with the domain's fabric; the
        // queue pairs to another gateway come from a fabric for its address.
        let opened;
        let fabric = if *domain.fabric().url() == self.url {
            domain.fabric()
        } else {
            opened = Fabric::open(&self.url).map_err(|e| Error::fabric(format!("opening the fabric for {}", self.url), e))?;
            &opened
        };
        let mut replaces = SessionId(self.session.load(Ordering::Acquire));
        let set = connect_set(domain, fabric, options, params, alarms, stats, gen, deadline, &mut replaces);
        self.session.store(replaces.0, Ordering::Release);
        set
    }
}

/// A volume open in the session and how many handles use it.
pub(crate) struct VolumeSlot {
    pub(crate) entry: Arc<VolumeEntry>,
    pub(crate) handles: usize,
}

/// Everything a session's handles share.
pub(crate) struct Shared {
    // Field order is drop order: the queues (connections, bounce pools)
    // and the zero region go before the domain they are registered with.
    pub(crate) queues: Box<[QueueSlot]>,
    /// Registered zeroes, never written: the source of emulated WRITE_ZEROES.
    pub(crate) zero: Region,
    pub(crate) domain: Arc<Domain>,
    pub(crate) ctl: Arc<Ctl>,
    pub(crate) volumes: Mutex<HashMap<String, VolumeSlot>>,
    /// Queues with a connection in the current generation (a prefix).
    active: AtomicUsize,
    limits: Mutex<NegotiatedLimits>,
    /// The gateways, as given.
    pub(crate) targets: Targets,
    /// The gateways' state, in the order of `targets`.
    gateways: Box<[Gateway]>,
    /// The gateway of the current connection set (index in `gateways`).
    current: AtomicUsize,
    pub(crate) options: ConnectOptions,
    /// Session-wide counters (reconnections, retries); the I/O counters
    /// are per queue ([`QueueSlot::stats`]).
    pub(crate) stats: Arc<Stats>,
    uid: u64,
    next_home: AtomicUsize,
    /// The target refuses DISCARD / WRITE_ZEROES above the max I/O size.
    pub(crate) small_zeroes: AtomicBool,
    params: ConnParams,
    /// Told each new session id a reconnection creates, before anything is
    /// re-issued on it ([`crate::Session::watch_session_id`]).
    pub(crate) session_watch: Mutex<Option<SessionWatch>>,
}

/// A callback given each new session id and its gateway.
pub(crate) type SessionWatch = Box<dyn Fn(SessionId, &FabricUrl) + Send>;

/// Timing derived from the options; `failover`: the session has several gateways.
fn conn_params(options: &ConnectOptions, failover: bool) -> ConnParams {
    let keepalive = (!options.keepalive_timeout.is_zero())
        .then(|| KeepAliveTiming { idle: options.keepalive_timeout / 4, wait: options.keepalive_timeout / 2 });
    ConnParams {
        max_io: options.max_io_size,
        inline_limit: 0,
        io_timeout: options.io_timeout,
        keepalive,
        wait_slice: monitor_tick(options).unwrap_or(MAX_WAIT_SLICE).min(MAX_WAIT_SLICE),
        busy_poll: options.busy_poll,
        failover,
    }
}

/// How often the monitor visits idle queues: an eighth of the keep-alive
/// timeout, so a silent target is found within the timeout, and at least
/// twice within the shortest transport timeout a target allows (1 s): the
/// visit also sends an idle queue's held-back acknowledgements.
fn monitor_tick(options: &ConnectOptions) -> Option<Duration> {
    (!options.keepalive_timeout.is_zero())
        .then(|| (options.keepalive_timeout / 8).clamp(Duration::from_millis(10), Duration::from_millis(500)))
}

static NEXT_UID: AtomicU64 = AtomicU64::new(1);

thread_local! {
    /// This thread's queue index in each session it used: `(uid, index)`.
    static HOMES: RefCell<Vec<(u64, usize)>> = const { RefCell::new(Vec::new()) };
}

/// A new set of connections, not yet installed.
struct ConnSet {
    conns: Vec<Conn>,
    reply: ConnectReply,
    limits: NegotiatedLimits,
}

impl Shared {
    /// Connects the first set of queue pairs, to the first gateway that
    /// answers (each within `connect_timeout`), and builds the session state.
    /// `replaces`: a session of this host (of an earlier process) at gateway
    /// `replaced_at` that the new one replaces, fenced like a reconnection's
    /// (0: none); named only if the session connects there.
    pub(crate) fn connect(
        targets: Targets,
        options: ConnectOptions,
        replaces: SessionId,
        replaced_at: usize,
    ) -> Result<Arc<Shared>> {
        let gateways: Box<[Gateway]> = targets.urls().iter().map(|u| Gateway::new(u.clone())).collect();
        if let Some(g) = gateways.get(replaced_at) {
            g.session.store(replaces.0, Ordering::Relaxed);
        }
        let stats = Arc::new(Stats::default());
        let queue_stats: Vec<Arc<Stats>> = (0..options.queues).map(|_| Arc::new(Stats::default())).collect();
        let params = conn_params(&options, gateways.len() > 1);
        let alarms: Vec<Arc<Alarm>> = (0..options.queues).map(|_| Arc::new(Alarm::default())).collect();
        let mut domain: Option<Arc<Domain>> = None;
        let mut failures: Vec<(String, Error)> = Vec::new();
        let mut connected = None;
        for (i, gw) in gateways.iter().enumerate() {
            let url = &gw.url;
            let ctx = |what: &str| format!("{what} for {url}");
            if domain.is_none() {
                // The session's memory is registered once, with the first
                // gateway's fabric that opens, and stays valid on the others.
                let opened = Fabric::open(url).map_err(|e| Error::fabric(ctx("opening the fabric"), e)).and_then(|fabric| {
                    let pd = fabric.alloc_pd().map_err(|e| Error::fabric(ctx("allocating a protection domain"), e))?;
                    Ok(Arc::new(Domain::new(pd, fabric, options.rkey_scoping)))
                });
                match opened {
                    Ok(d) => domain = Some(d),
                    Err(e) => {
                        failures.push((url.to_string(), e));
                        continue;
                    }
                }
            }
            let d = domain.as_ref().expect("set above");
            let deadline = Instant::now() + options.connect_timeout;
            match gw.connect_set(d, &options, params, &alarms, &queue_stats, 1, deadline) {
                Ok(set) => {
                    connected = Some((i, set));
                    break;
                }
                Err(e) => {
                    tracing::debug!("{url}: gateway {} of {} did not connect: {}", i + 1, gateways.len(), e.one_line());
                    failures.push((url.to_string(), e));
                }
            }
        }
        let Some((current, set)) = connected else { return Err(Error::no_gateway(failures)) };
        let domain = domain.expect("a connection set has a domain");
        let url = &gateways[current].url;
        let ctx = |what: &str| format!("{what} for {url}");
        if current > 0 {
            // The error when none connects says all this; here, a warning.
            let before: Vec<String> = failures.iter().map(|(u, e)| format!("{u}: {}", e.one_line())).collect();
            let n = gateways.len();
            tracing::warn!(target: RECONNECT_LOG, "connected to {url}, gateway {} of {n}; before it: {}", current + 1, before.join("; "));
        }
        let _ = gateways[current].target_name.set(set.reply.target_name.clone());

        let chunk = set.limits.max_io_size as usize;
        let per_queue = options.bounce_pool_size / options.queues;
        let chunks = (per_queue / chunk).clamp(1, set.limits.queue_depth as usize);
        let all = domain.access_for(Access::REMOTE_WRITE | Access::REMOTE_READ);
        let mut conns = set.conns.into_iter();
        let mut queues = Vec::with_capacity(options.queues);
        for (alarm, qstats) in alarms.into_iter().zip(queue_stats) {
            let bounce = Region::new(domain.pd(), chunk * chunks, all)
                .map_err(|e| Error::fabric(ctx("registering a bounce pool"), e))?;
            queues.push(QueueSlot {
                q: Mutex::new(Queue::new(conns.next(), bounce, chunk, Arc::clone(&qstats))),
                freed: Condvar::new(),
                freed_waiters: AtomicUsize::new(0),
                alarm,
                stats: qstats,
            });
        }
        let active = queues.iter().filter(|s| lock(&s.q).conn.is_some()).count();
        let zero = Region::new(domain.pd(), chunk, domain.access_for(Access::REMOTE_READ))
            .map_err(|e| Error::fabric(ctx("registering the zero region"), e))?;
        let ctl = Arc::new(Ctl {
            st: Mutex::new(CtlState {
                gen: 1,
                phase: Phase::Connected,
                session_id: set.reply.session_id,
                failed_since: None,
                reason: String::new(),
                mismatch: None,
            }),
            cv: Condvar::new(),
            fast: AtomicU8::new(Phase::Connected as u8),
        });
        let shared = Arc::new(Shared {
            queues: queues.into_boxed_slice(),
            zero,
            domain,
            ctl: Arc::clone(&ctl),
            volumes: Mutex::new(HashMap::new()),
            active: AtomicUsize::new(active),
            limits: Mutex::new(set.limits),
            targets,
            gateways,
            current: AtomicUsize::new(current),
            options,
            stats,
            uid: NEXT_UID.fetch_add(1, Ordering::Relaxed),
            next_home: AtomicUsize::new(0),
            small_zeroes: AtomicBool::new(false),
            params,
            session_watch: Mutex::new(None),
        });
        let weak = Arc::downgrade(&shared);
        let tick = monitor_tick(&shared.options);
        std::thread::Builder::new()
            .name("rdmablk-monitor".into())
            .spawn(move || monitor(weak, ctl, tick))
            .map_err(|e| Error::io("starting the session's monitor thread", e))?;
        Ok(shared)
    }

    pub(crate) fn limits(&self) -> NegotiatedLimits {
        *lock(&self.limits)
    }

    /// The gateway of the current connection set.
    pub(crate) fn current_url(&self) -> &FabricUrl {
        &self.gateways[self.current.load(Ordering::Acquire)].url
    }

    /// The target name the current gateway gave at its first CONNECT.
    pub(crate) fn target_name(&self) -> &str {
        self.gateways[self.current.load(Ordering::Acquire)].target_name.get().map_or("", String::as_str)
    }

    /// Queues with a connection now.
    pub(crate) fn active_queues(&self) -> usize {
        self.active.load(Ordering::Acquire)
    }

    /// The phase, without taking the control lock.
    pub(crate) fn phase(&self) -> Phase {
        self.ctl.fast_phase()
    }

    pub(crate) fn session_id(&self) -> SessionId {
        lock(&self.ctl.st).session_id
    }

    pub(crate) fn generation(&self) -> u32 {
        lock(&self.ctl.st).gen
    }

    /// This thread's queue: threads are spread over the queues round-robin
    /// in the order they first use the session.
    pub(crate) fn home_queue(&self) -> usize {
        let home = HOMES.with(|h| {
            let mut h = h.borrow_mut();
            if let Some(&(_, i)) = h.iter().find(|(uid, _)| *uid == self.uid) {
                return i;
            }
            let i = self.next_home.fetch_add(1, Ordering::Relaxed);
            if h.len() >= 32 {
                h.remove(0);
            }
            h.push((self.uid, i));
            i
        });
        home % self.active_queues().max(1)
    }

    /// A fresh home index, for an [`IoQueue`](crate::IoQueue).
    pub(crate) fn next_home(&self) -> usize {
        self.next_home.fetch_add(1, Ordering::Relaxed)
    }

    /// Reports that a connection of generation `gen` failed. The first
    /// report of the current generation starts reconnection (or ends the
    /// session when reconnection is disabled).
    pub(crate) fn report_failure(&self, gen: u32, reason: &str) {
        let mut st = lock(&self.ctl.st);
        if st.gen != gen || st.phase != Phase::Connected {
            return;
        }
        for q in self.queues.iter() {
            q.alarm.doom(gen);
        }
        st.reason = reason.to_owned();
        st.failed_since = Some(Instant::now());
        let lost = self.options.ctrl_loss_timeout.is_zero();
        if lost {
            // Not the CLI's: its error says so, in one line.
            tracing::warn!("{}: connection lost, not reconnecting (ctrl_loss_timeout is 0): {reason}", self.current_url());
            self.ctl.set_phase(&mut st, Phase::Lost);
        } else {
            tracing::warn!(
                target: RECONNECT_LOG,
                "{}: connection lost, reconnecting (up to {}): {reason}",
                self.current_url(),
                spaced_duration(self.options.ctrl_loss_timeout)
            );
            self.ctl.set_phase(&mut st, Phase::Reconnecting);
        }
        self.ctl.cv.notify_all();
        drop(st);
        if lost {
            self.drop_connections();
        }
    }

    /// Closes and drops every connection (the session is over).
    fn drop_connections(&self) {
        for slot in self.queues.iter() {
            let conn = lock(&slot.q).conn.take();
            drop(conn);
            slot.notify_freed();
        }
    }

    fn lost_error(&self, st: &CtlState) -> Error {
        if let Some((name, detail)) = &st.mismatch {
            return Error::VolumeChanged { name: name.clone(), detail: detail.clone() };
        }
        if self.options.ctrl_loss_timeout.is_zero() {
            Error::Disconnected { reason: st.reason.clone() }
        } else {
            Error::TargetLost { reason: st.reason.clone(), after: self.options.ctrl_loss_timeout }
        }
    }

    /// The error for requests when the session is in a final phase.
    pub(crate) fn final_error(&self) -> Option<Error> {
        if matches!(self.phase(), Phase::Connected | Phase::Reconnecting) {
            return None;
        }
        let st = lock(&self.ctl.st);
        match st.phase {
            Phase::Lost => Some(self.lost_error(&st)),
            Phase::Closed => Some(Error::Disconnected { reason: st.reason.clone() }),
            _ => None,
        }
    }

    /// Waits while the session reconnects; fails once it is lost or closed.
    /// Bounded by `ctrl_loss_timeout` (plus a margin, in case the monitor
    /// thread is gone).
    pub(crate) fn wait_ready(&self, until: Option<Instant>) -> Result<bool> {
        if self.phase() == Phase::Connected {
            return Ok(true);
        }
        let mut st = lock(&self.ctl.st);
        loop {
            match st.phase {
                Phase::Connected => return Ok(true),
                Phase::Lost => return Err(self.lost_error(&st)),
                Phase::Closed => return Err(Error::Disconnected { reason: st.reason.clone() }),
                Phase::Reconnecting => {
                    let now = Instant::now();
                    let since = st.failed_since.unwrap_or(now);
                    let limit =
                        since + self.options.ctrl_loss_timeout + self.options.connect_timeout + Duration::from_secs(2);
                    if now >= limit {
                        return Err(self.lost_error(&st));
                    }
                    let limit = until.map_or(limit, |u| u.min(limit));
                    if now >= limit {
                        return Ok(false);
                    }
                    st = self.ctl.cv.wait_timeout(st, limit - now).unwrap_or_else(|e| e.into_inner()).0;
                }
            }
        }
    }

    /// Runs `attempt` on this thread's queue, with a usable connection,
    /// until it is done: after a broken connection it waits for the session
    /// to reconnect and calls `attempt` again (which re-issues what is not
    /// done); when no slot is free it waits for one.
    pub(crate) fn run<T>(&self, mut attempt: impl FnMut(&mut Queue) -> Outcome<T>) -> Result<T> {
        loop {
            self.wait_ready(None)?;
            let slot = &self.queues[self.home_queue()];
            let mut q = lock(&slot.q);
            let gen = match q.conn.as_mut() {
                None => {
                    drop(q);
                    std::thread::sleep(Duration::from_millis(1));
                    continue;
                }
                Some(c) => {
                    if c.check_usable().is_err() {
                        let (gen, reason) = (c.gen, c.broken_reason().unwrap_or_default().to_owned());
                        drop(q);
                        self.report_failure(gen, &reason);
                        continue;
                    }
                    c.gen
                }
            };
            let outcome = attempt(&mut q);
            if let Outcome::Busy = outcome {
                drop(slot.wait_freed(q, Duration::from_millis(5)));
                continue;
            }
            self.after_attempt(slot, q, gen);
            match outcome {
                Outcome::Done(v) => return Ok(v),
                Outcome::Failed(e) => return Err(e),
                Outcome::Broken => Stats::add(&self.stats.retries, 1),
                Outcome::Busy => unreachable!("handled above"),
            }
        }
    }

    /// After an attempt on `slot`'s queue (generation `gen`): releases the
    /// queue, wakes the users waiting for its slots, and reports the
    /// connection if the attempt left it broken.
    fn after_attempt(&self, slot: &QueueSlot, q: MutexGuard<'_, Queue>, gen: u32) {
        let broken = q.conn.as_ref().and_then(|c| c.broken_reason().map(str::to_owned));
        drop(q);
        slot.notify_freed();
        if let Some(reason) = broken {
            self.report_failure(gen, &reason);
        }
    }

    /// One attempt without waiting: `None` if the session is not connected
    /// or the connection broke (for CLOSE, which a new session does not need).
    pub(crate) fn run_once<T>(&self, attempt: impl FnOnce(&mut Queue) -> Outcome<T>) -> Result<Option<T>> {
        if self.phase() != Phase::Connected {
            return Ok(None);
        }
        let slot = &self.queues[self.home_queue()];
        let mut q = lock(&slot.q);
        let gen = match q.conn.as_mut() {
            Some(c) => match c.check_usable() {
                Ok(()) => c.gen,
                Err(_) => return Ok(None),
            },
            None => return Ok(None),
        };
        let outcome = attempt(&mut q);
        self.after_attempt(slot, q, gen);
        match outcome {
            Outcome::Done(v) => Ok(Some(v)),
            Outcome::Failed(e) => Err(e),
            Outcome::Broken | Outcome::Busy => Ok(None),
        }
    }

    /// Closes every connection now; later requests fail with
    /// [`Error::Disconnected`].
    pub(crate) fn close(&self, reason: &str) {
        {
            let mut st = lock(&self.ctl.st);
            if matches!(st.phase, Phase::Closed | Phase::Lost) {
                return;
            }
            self.ctl.set_phase(&mut st, Phase::Closed);
            st.reason = reason.to_owned();
            for q in self.queues.iter() {
                q.alarm.doom(u32::MAX);
            }
            self.ctl.cv.notify_all();
        }
        self.drop_connections();
    }

    /// The monitor's visit of idle queues: polls them, sends keep-alives
    /// and enforces deadlines. Never waits for a queue a caller holds (that
    /// caller drives progress, keep-alives included).
    fn keepalive_tick(&self) {
        for slot in self.queues.iter().take(self.active_queues()) {
            let mut q = match slot.q.try_lock() {
                Ok(q) => q,
                Err(TryLockError::Poisoned(e)) => e.into_inner(),
                Err(TryLockError::WouldBlock) => continue,
            };
            let Some(conn) = q.conn.as_mut() else { continue };
            if conn.tick().is_err() {
                let (gen, reason) = (conn.gen, conn.broken_reason().unwrap_or_default().to_owned());
                drop(q);
                self.report_failure(gen, &reason);
            }
        }
    }

    /// Reconnects until it works or `ctrl_loss_timeout` passes.
    fn reconnect(self: &Arc<Self>) {
        let (failed_gen, since) = {
            let st = lock(&self.ctl.st);
            if st.phase != Phase::Reconnecting {
                return;
            }
            (st.gen, st.failed_since.unwrap_or_else(Instant::now))
        };
        // Close the failed generation's queue pairs now, rather than when
        // someone next touches them: the target then ends the old session at
        // once (and, with manual progress, a queue pair nobody polls would
        // leave the target's transfers on it hanging).
        let reason = lock(&self.ctl.st).reason.clone();
        for slot in self.queues.iter() {
            let mut q = lock(&slot.q);
            if let Some(c) = q.conn.as_mut().filter(|c| c.gen <= failed_gen) {
                c.fail(format!("the session is reconnecting after: {reason}"));
            }
        }
        let deadline = since + self.options.ctrl_loss_timeout;
        let mut delay = self.options.reconnect_delay;
        // The reconnect fence: the new session names the one it replaces,
        // and the target retires that one (stops it and waits for its disk
        // I/O) before it answers, so nothing of it can land after what this
        // session re-issues. An attempt that created a session and failed
        // later makes that session the one to replace. Each gateway keeps
        // its own (`Gateway::session`): another gateway's id means nothing
        // there.
        let n = self.gateways.len();
        let lost_at = self.current.load(Ordering::Acquire);
        // Each gateway's latest failure, for the final error (several gateways).
        let mut failures: Vec<Option<String>> = vec![None; n];
        failures[lost_at] = Some(reason.clone());
        let mut attempts = 0u32;
        loop {
            // A round: the gateways after the lost one, then the lost one.
            let round: Vec<usize> = rotation(n, lost_at).collect();
            for (k, &gw) in round.iter().enumerate() {
                let now = Instant::now();
                if now >= deadline {
                    let mut st = lock(&self.ctl.st);
                    if st.phase == Phase::Reconnecting {
                        if n > 1 {
                            st.reason = gateway_summary(&self.gateways, &failures);
                        }
                        tracing::error!(target: RECONNECT_LOG,
                            "{}: target lost: no connection within ctrl_loss_timeout ({}), {attempts} attempts: {}",
                            self.targets, fmt_duration(self.options.ctrl_loss_timeout), st.reason);
                        self.ctl.set_phase(&mut st, Phase::Lost);
                        self.ctl.cv.notify_all();
                    }
                    drop(st);
                    // Nothing will use the connections of the lost session again.
                    self.drop_connections();
                    return;
                }
                if Arc::strong_count(self) == 1 {
                    return; // every handle is gone; dropping ends the session
                }
                attempts += 1;
                let url = &self.gateways[gw].url;
                let attempt_deadline = (now + self.options.connect_timeout).min(deadline);
                match self.establish(gw, lost_at, failed_gen + 1, attempt_deadline) {
                    Ok(true) => {
                        Stats::add(&self.stats.reconnects, 1);
                        if gw == lost_at {
                            tracing::info!(
                                target: RECONNECT_LOG,
                                "{url}: reconnected at attempt {attempts}, {} after the loss",
                                spaced_duration(since.elapsed())
                            );
                        } else {
                            // One line per failover: both gateways and the cause.
                            tracing::warn!(
                                target: RECONNECT_LOG,
                                "failover from gateway {} to gateway {url} (reconnected at attempt {attempts}, {} after the loss): {reason}",
                                self.gateways[lost_at].url,
                                spaced_duration(since.elapsed())
                            );
                        }
                        return;
                    }
                    Ok(false) => return, // closed meanwhile
                    Err(e) if e.kind() == ErrorKind::VolumeChanged => {
                        // Another gateway serves one of the volumes otherwise:
                        // not the same volume, and no use trying again.
                        let mut st = lock(&self.ctl.st);
                        if st.phase == Phase::Reconnecting {
                            tracing::error!(target: RECONNECT_LOG, "{url}: the session ends: {}", e.one_line());
                            if let Error::VolumeChanged { name, detail } = &e {
                                st.mismatch = Some((name.clone(), detail.clone()));
                            }
                            st.reason = e.one_line();
                            self.ctl.set_phase(&mut st, Phase::Lost);
                            self.ctl.cv.notify_all();
                        }
                        drop(st);
                        self.drop_connections();
                        return;
                    }
                    Err(e) => {
                        let left = deadline.saturating_duration_since(Instant::now());
                        match round.get(k + 1) {
                            Some(&next) => tracing::info!(
                                target: RECONNECT_LOG,
                                "{url}: reconnection attempt {attempts} failed: {}; next: gateway {} now, {} left",
                                e.one_line(),
                                self.gateways[next].url,
                                spaced_duration(left)
                            ),
                            None => tracing::info!(
                                target: RECONNECT_LOG,
                                "{url}: reconnection attempt {attempts} failed: {}; next in {}, {} left",
                                e.one_line(),
                                spaced_duration(delay.min(left)),
                                spaced_duration(left)
                            ),
                        }
                        failures[gw] = Some(e.one_line());
                        lock(&self.ctl.st).reason = e.one_line();
                    }
                }
            }
            let wake = (Instant::now() + delay).min(deadline);
            let mut st = lock(&self.ctl.st);
            while st.phase == Phase::Reconnecting {
                let now = Instant::now();
                if now >= wake {
                    break;
                }
                st = self.ctl.cv.wait_timeout(st, wake - now).unwrap_or_else(|e| e.into_inner()).0;
            }
            if st.phase != Phase::Reconnecting {
                return;
            }
            delay = (delay * 2).min(MAX_BACKOFF.max(self.options.reconnect_delay));
        }
    }

    /// Builds a new connection set of generation `gen` to gateway `gw`,
    /// re-opens the session's volumes on it, installs it and declares the
    /// session connected. `Ok(false)` if the session was closed meanwhile.
    /// `lost_at`: the gateway of the lost connection set; on another one a
    /// volume must have the size and block size it was opened with, or this
    /// fails with [`Error::VolumeChanged`] (which ends the session).
    fn establish(&self, gw: usize, lost_at: usize, gen: u32, deadline: Instant) -> Result<bool> {
        let alarms: Vec<Arc<Alarm>> = self.queues.iter().map(|s| Arc::clone(&s.alarm)).collect();
        let stats: Vec<Arc<Stats>> = self.queues.iter().map(|s| Arc::clone(&s.stats)).collect();
        let gateway = &self.gateways[gw];
        let set = gateway.connect_set(&self.domain, &self.options, self.params, &alarms, &stats, gen, deadline)?;
        let ConnSet { mut conns, reply, limits } = set;
        // Before any request can reach the new session (its connections
        // are installed below), so a watcher's record never lags behind a
        // session that has writes in flight.
        if let Some(watch) = lock(&self.session_watch).as_ref() {
            watch(reply.session_id, &gateway.url);
        }
        let vols = lock(&self.volumes);
        for slot in vols.values() {
            let e = &slot.entry;
            let mut c = CommandCapsule::new(Opcode::OpenVolume, CommandId(0));
            c.inline_len = e.name.len() as u32;
            let resp = conns[0].execute(&c, e.name.as_bytes(), remaining(deadline))?;
            match resp.capsule.status {
                Status::Success if gw != lost_at => {
                    let info = VolumeInfo::decode(resp.data()).map_err(|err| {
                        Error::protocol(format!("the target's OPEN reply for {:?} is invalid: {err}", e.name))
                    })?;
                    if (info.size_bytes, info.block_size) != (e.info.size_bytes, e.info.block_size) {
                        return Err(Error::VolumeChanged {
                            name: e.name.clone(),
                            detail: format!(
                                "gateway {} serves volume {:?} with another size: {} bytes in {}-byte blocks, where it was \
                                 opened with {} bytes in {}-byte blocks",
                                gateway.url, e.name, info.size_bytes, info.block_size, e.info.size_bytes, e.info.block_size
                            ),
                        });
                    }
                    e.set_remote(gen, info.volume_id);
                }
                // Another gateway without the volume is not one of its gateways.
                Status::UnknownVolume if gw != lost_at => return Err(Error::UnknownVolume { name: e.name.clone() }),
                Status::Success => {
                    let info = VolumeInfo::decode(resp.data()).map_err(|err| {
                        Error::protocol(format!("the target's OPEN reply for {:?} is invalid: {err}", e.name))
                    })?;
                    if info.block_size != e.info.block_size {
                        e.mark_lost(Error::VolumeChanged {
                            name: e.name.clone(),
                            detail: format!("block size {} is now {}", e.info.block_size, info.block_size),
                        });
                    } else if info.size_bytes < e.info.size_bytes {
                        e.mark_lost(Error::VolumeChanged {
                            name: e.name.clone(),
                            detail: format!("size {} is now {}", e.info.size_bytes, info.size_bytes),
                        });
                    } else {
                        if info.volume_id != e.current_id() {
                            tracing::info!(volume = %e.name, old = e.current_id().0, new = info.volume_id.0, "volume id changed");
                        }
                        e.set_remote(gen, info.volume_id);
                    }
                }
                Status::UnknownVolume => e.mark_lost(Error::UnknownVolume { name: e.name.clone() }),
                _ => return Err(status_error(Opcode::OpenVolume, &resp.capsule, Some(&e.name), None, None)),
            }
        }
        if lock(&self.ctl.st).phase != Phase::Reconnecting {
            return Ok(false);
        }
        let n = conns.len();
        let mut conns = conns.drain(..);
        for slot in self.queues.iter() {
            let old = std::mem::replace(&mut lock(&slot.q).conn, conns.next());
            drop(old);
            slot.notify_freed();
        }
        self.active.store(n, Ordering::Release);
        *lock(&self.limits) = limits;
        let mut st = lock(&self.ctl.st);
        if st.phase != Phase::Reconnecting {
            drop(st);
            self.drop_connections();
            return Ok(false);
        }
        st.gen = gen;
        st.session_id = reply.session_id;
        let _ = gateway.target_name.set(reply.target_name);
        self.current.store(gw, Ordering::Release);
        self.ctl.set_phase(&mut st, Phase::Connected);
        st.failed_since = None;
        self.ctl.cv.notify_all();
        drop(st);
        drop(vols);
        Ok(true)
    }
}

impl Drop for Shared {
    fn drop(&mut self) {
        let mut st = lock(&self.ctl.st);
        if st.phase != Phase::Lost {
            self.ctl.set_phase(&mut st, Phase::Closed);
            st.reason = "the session was dropped".into();
        }
        self.ctl.cv.notify_all();
    }
}

/// Each gateway and its latest failure, on one line: `url: failure; url: ...`.
fn gateway_summary(gateways: &[Gateway], failures: &[Option<String>]) -> String {
    let each = gateways.iter().zip(failures).map(|(g, f)| format!("{}: {}", g.url, f.as_deref().unwrap_or("not tried")));
    each.collect::<Vec<_>>().join("; ")
}

/// The monitor thread: keep-alives on idle queues and reconnection. Holds
/// the session only weakly, so the session ends when its handles are gone.
fn monitor(weak: Weak<Shared>, ctl: Arc<Ctl>, tick: Option<Duration>) {
    let run = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| loop {
        let phase = {
            let st = lock(&ctl.st);
            let st = match (st.phase, tick) {
                (Phase::Reconnecting, _) => st,
                (_, Some(t)) => ctl.cv.wait_timeout(st, t).unwrap_or_else(|e| e.into_inner()).0,
                (_, None) => ctl.cv.wait(st).unwrap_or_else(|e| e.into_inner()),
            };
            st.phase
        };
        let Some(shared) = weak.upgrade() else { return };
        match phase {
            Phase::Lost | Phase::Closed => return,
            Phase::Reconnecting => shared.reconnect(),
            Phase::Connected => shared.keepalive_tick(),
        }
    }));
    if run.is_err() {
        let mut st = lock(&ctl.st);
        if st.phase != Phase::Closed {
            ctl.set_phase(&mut st, Phase::Lost);
            st.reason = "the session's monitor thread panicked".into();
        }
        ctl.cv.notify_all();
    }
}

fn remaining(deadline: Instant) -> Duration {
    deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1))
}

/// Connects the first queue pair to `fabric`'s URL (a new session,
/// replacing `replaces` unless it is 0) and joins the others to it. A
/// target that refuses joins (`UnknownSession`) leaves a smaller set. Once
/// the target created the new session, `replaces` names it: a later attempt
/// must replace that one.
#[allow(clippy::too_many_arguments)]
fn connect_set(
    domain: &Arc<Domain>,
    fabric: &Fabric,
    options: &ConnectOptions,
    params: ConnParams,
    alarms: &[Arc<Alarm>],
    stats: &[Arc<Stats>],
    gen: u32,
    deadline: Instant,
    replaces: &mut SessionId,
) -> Result<ConnSet> {
    let url = fabric.url();
    let join = Join::Create { replaces: *replaces };
    let (first, reply, limits) = connect_queue(domain, fabric, options, params, join, &alarms[0], &stats[0], gen, deadline)?;
    *replaces = reply.session_id;
    let mut conns = vec![first];
    for (i, alarm) in alarms.iter().enumerate().skip(1) {
        match connect_queue(domain, fabric, options, params, Join::Session(reply.session_id), alarm, &stats[i], gen, deadline) {
            Ok((conn, r, _)) => {
                if r.session_id != reply.session_id {
                    return Err(Error::protocol(format!(
                        "queue {i} asked to join session {:#x} and the target put it in session {:#x}",
                        reply.session_id.0, r.session_id.0
                    )));
                }
                tracing::debug!(queue = i, index = r.queue_index, "queue pair joined the session");
                conns.push(conn);
            }
            Err(e) if e.status() == Some(Status::UnknownSession) => {
                tracing::warn!(
                    url = %url, requested = alarms.len(), granted = i,
                    "the target refused to join a queue pair to the session (no multi-queue sessions?); \
                     continuing with {i} queue(s)"
                );
                break;
            }
            Err(e) if e.status() == Some(Status::LimitReached) => {
                tracing::warn!(
                    url = %url, requested = alarms.len(), granted = i,
                    "the target allows {i} queue pair(s) per session (target.max_queues_per_session); continuing with {i}"
                );
                break;
            }
            Err(e) => return Err(e),
        }
    }
    Ok(ConnSet { conns, reply, limits })
}

/// What a queue pair's CONNECT asks for.
#[derive(Clone, Copy, Debug)]
enum Join {
    /// A new session, replacing an earlier one of this host (0: none).
    Create { replaces: SessionId },
    /// An additional queue pair of this session.
    Session(SessionId),
}

/// Creates, connects and negotiates one queue pair to `fabric`'s URL.
#[allow(clippy::too_many_arguments)]
fn connect_queue(
    domain: &Arc<Domain>,
    fabric: &Fabric,
    options: &ConnectOptions,
    params: ConnParams,
    join: Join,
    alarm: &Arc<Alarm>,
    stats: &Arc<Stats>,
    gen: u32,
    deadline: Instant,
) -> Result<(Conn, ConnectReply, NegotiatedLimits)> {
    let url = fabric.url();
    let ctx = |what: &str| format!("{what} for {url}");
    let pd = domain.pd();
    let depth = options.queue_depth;
    let recv_count = depth as usize + RECV_MARGIN;
    let cq = fabric
        .create_cq(depth + recv_count as u32 + 16)
        .map_err(|e| Error::fabric(ctx("creating a completion queue"), e))?;
    // A caller usually submits again right after it takes a response (its
    // command frame then carries the ACK) or polls (which sends it): no ACK
    // frame of its own between a response and its delivery, and no wake-up
    // of the target for one. A queue left idle sends it at the monitor's
    // next visit (`monitor_tick`), well within the target's transport
    // timeout; without keep-alives there is no monitor, so no hold.
    if !options.busy_poll.is_zero() || monitor_tick(options).is_some() {
        cq.set_ack_coalescing(Some(Duration::ZERO));
    }
    // With scoping, a command may hold three send-queue slots on a
    // provider that binds windows with work requests: the bind, the SEND
    // and the invalidation. A SEND gathers two pieces: the capsule and a
    // small write's data from its registered buffer (`IoQueue`).
    let send_wrs_per_command = if domain.scoped() { 3 } else { 1 };
    let caps = QpCaps {
        max_send_wr: depth * send_wrs_per_command + 1,
        max_recv_wr: recv_count as u32,
        max_send_sge: 2,
        max_recv_sge: 1,
        ..QpCaps::default()
    };
    let qp = fabric.create_qp(pd, &cq, caps).map_err(|e| Error::fabric(ctx("creating a queue pair"), e))?;
    let recv = Region::new(pd, recv_count * RESPONSE_SLOT_SIZE, Access::LOCAL_WRITE)
        .map_err(|e| Error::fabric(ctx("registering receive buffers"), e))?;
    let connect_slot = (COMMAND_CAPSULE_SIZE + MAX_HOST_ID_LEN).next_multiple_of(64);
    let send = Region::new(pd, connect_slot, Access::LOCAL_WRITE)
        .map_err(|e| Error::fabric(ctx("registering send buffers"), e))?;
    let send = SendSlots { region: send, count: 1, size: connect_slot };
    let mut conn =
        Conn::new(Arc::clone(domain), qp, cq, recv, send, Arc::clone(stats), gen, Arc::clone(alarm), params)?;

    conn.qp().connect(&[], remaining(deadline)).map_err(|e| {
        if e.kind == FabricErrorKind::Timeout {
            Error::Timeout { what: format!("connecting to {url}"), after: options.connect_timeout }
        } else {
            Error::fabric(format!("connecting to {url}"), e)
        }
    })?;

    let (session_id, replaces) = match join {
        Join::Create { replaces } => (SessionId(0), replaces),
        Join::Session(id) => (id, SessionId(0)),
    };
    let authenticated_as = match &options.key {
        Some(key) => Some(crate::auth::authenticate(&mut conn, key, &options.host_id, session_id, || remaining(deadline))?),
        None => None,
    };
    let mut c = CommandCapsule::new(Opcode::Connect, CommandId(0));
    c.version = PROTOCOL_VERSION;
    c.queue_depth = depth;
    c.max_io_size = options.max_io_size;
    c.session_id = session_id;
    c.replaces = replaces;
    c.inline_len = options.host_id.len() as u32;
    let resp = conn.execute(&c, options.host_id.as_bytes(), remaining(deadline))?;
    match resp.capsule.status {
        Status::Success => {}
        Status::VersionMismatch => return Err(Error::version_mismatch(resp.capsule.detail)),
        _ => return Err(status_error(Opcode::Connect, &resp.capsule, None, None, None)),
    }
    let reply = ConnectReply::decode(resp.data())
        .map_err(|e| Error::protocol(format!("the target's CONNECT reply is invalid: {e}")))?;
    if reply.version != PROTOCOL_VERSION {
        return Err(Error::version_mismatch(u32::from(reply.version)));
    }
    if authenticated_as.as_ref().is_some_and(|name| *name != reply.target_name) {
        return Err(Error::protocol(format!(
            "the target authenticated as {:?} but its CONNECT reply names {:?}",
            authenticated_as.unwrap_or_default(),
            reply.target_name
        )));
    }
    if reply.queue_depth > depth {
        tracing::warn!(granted = reply.queue_depth, requested = depth, "target granted a deeper queue than requested");
    }
    let limits = NegotiatedLimits {
        queue_depth: reply.queue_depth.min(depth),
        max_io_size: reply.max_io_size.min(options.max_io_size),
        inline_data_size: reply.inline_data_size,
    };
    tracing::debug!(?limits, target = %reply.target_name, session = reply.session_id.0, queue = reply.queue_index, "connected");

    let slots = limits.queue_depth as usize;
    let inline_use = (limits.inline_data_size as usize).min(INLINE_CAP);
    let slot_size = (COMMAND_CAPSULE_SIZE + inline_use.max(MAX_HOST_ID_LEN)).next_multiple_of(64);
    let send = Region::new(pd, slots * slot_size, Access::LOCAL_WRITE)
        .map_err(|e| Error::fabric(ctx("registering send buffers"), e))?;
    let params = ConnParams { max_io: limits.max_io_size, inline_limit: inline_use, ..params };
    conn.replace_send_slots(SendSlots { region: send, count: slots, size: slot_size }, params)?;
    Ok((conn, reply, limits))
}
