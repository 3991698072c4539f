//! Completion queues: a completion ring, the epoll set over the sockets of
//! the attached queue pairs, and the eventfd used as completion channel.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::{Duration, Instant};

use crate::keymap::KeyMap;
use super::qp::{self, QpShared};
use super::sys;
use crate::fabric::{lock, Completion, FabricError, Result};

/// Epoll token of the completion eventfd (queue pairs use their qp_num).
const EVENTFD_TOKEN: u64 = u64::MAX;
/// Epoll token of the timerfd of late send completions.
const TIMERFD_TOKEN: u64 = u64::MAX - 1;
/// Epoll token of the timerfd of queue pair deadlines.
const DEADLINE_TOKEN: u64 = u64::MAX - 2;
/// Epoll token of the timerfd that ends the hold of deferred ACKs.
const ACK_TIMER_TOKEN: u64 = u64::MAX - 3;

/// The environment variable that turns on late send completions for every
/// CQ the process creates (test-only; see [`TcpCq::set_late_send_completions`]).
pub const LATE_SEND_COMPLETIONS_ENV: &str = "RDMABLK_TCP_LATE_SEND_COMPLETIONS";

/// Longest a send completion is held back in the late mode when no SEND
/// arrives from the peer.
const LATE_SEND_HOLD: Duration = Duration::from_millis(50);

/// `RDMABLK_TCP_LATE_SEND_COMPLETIONS=N`: how many of the peer's SENDs a
/// held send completion waits for (0 or unset: the mode is off). Read once
/// per process.
fn late_send_completions_from_env() -> u32 {
    static FROM_ENV: OnceLock<u32> = OnceLock::new();
    *FROM_ENV.get_or_init(|| {
        std::env::var(LATE_SEND_COMPLETIONS_ENV).ok().and_then(|v| v.trim().parse().ok()).unwrap_or(0)
    })
}

/// `CqShared::recent_qp` before any completion was queued.
const NO_QP: u32 = u32::MAX;

/// `CqShared::ack_hold_ns` when standalone ACKs are not held back.
const ACKS_NOT_HELD: u64 = u64::MAX;

/// Longest sleep of [`TcpCq::wait_receiving`] in one receive; a caller
/// with a longer timeout (or none) gets `false` after it and waits again.
const LONGEST_RECEIVING_WAIT: Duration = Duration::from_secs(1);

/// Shortest one: a sooner timeout or timer is left to `poll`'s millisecond
/// timeout, because the receive's timeout runs on the kernel's tick.
const SHORTEST_RECEIVING_WAIT: Duration = Duration::from_millis(16);

/// Most socket events handled per poll call; the rest stay ready (epoll is
/// level-triggered) and are handled by the next call.
const EVENTS_PER_POLL: usize = 64;

/// State shared by a CQ and the queue pairs attached to it.
pub(crate) struct CqShared {
    epfd: OwnedFd,
    evfd: OwnedFd,
    queue: Mutex<VecDeque<Completion>>,
    armed: AtomicBool,
    /// The eventfd was written and may not be drained yet: an owner woken by
    /// a socket, not by the channel, need not read it (a syscall per wake).
    signaled: AtomicBool,
    /// The owner was woken from a sleep on the channel and has not polled
    /// since (see [`TcpCq::poll`]).
    woken: AtomicBool,
    /// A [`TcpCq::wait_receiving`] queued completions and the owner has
    /// not polled since: its next poll takes them without a system call.
    received: AtomicBool,
    /// The queue pair of the completion queued last (`NO_QP`: none yet):
    /// the first poll after a wake-up reads its socket first.
    recent_qp: AtomicU32,
    qps: Mutex<KeyMap<Weak<QpShared>>>,
    /// How long a standalone ACK may be held back, in nanoseconds;
    /// `ACKS_NOT_HELD` when coalescing is off (see
    /// `CompletionQueue::set_ack_coalescing`).
    ack_hold_ns: AtomicU64,
    /// Queue pairs owing a standalone ACK, oldest first, with the moment it
    /// was deferred (see `qp::progress`); `None` with a zero hold, which
    /// needs no clock (the ACK leaves at the next poll or arm unless a
    /// frame carried it).
    deferred_acks: Mutex<VecDeque<(u32, Option<Instant>)>>,
    /// Fires when the oldest deferred ACK's hold ends, so an owner asleep
    /// on the channel wakes to send it (see [`TcpCq::arm`]).
    ack_timer: OwnedFd,
    /// What `ack_timer` is armed for (`None`: disarmed, or fired).
    ack_timer_at: Mutex<Option<Instant>>,
    /// Test-only: send completions are held back (see
    /// [`TcpCq::set_late_send_completions`]).
    late_sends: AtomicBool,
    /// How many of the peer's SENDs a held completion waits for.
    late_sends_after: std::sync::atomic::AtomicU32,
    /// The hold of the late mode, in nanoseconds ([`LATE_SEND_HOLD`]
    /// unless a unit test changed it).
    late_hold_ns: AtomicU64,
    /// Queue pairs holding send completions back, oldest first, with the
    /// moment the hold ends (see `qp::release_held_sends`).
    held_sends: Mutex<VecDeque<(u32, Instant)>>,
    /// Fires at the end of the oldest hold, so an owner asleep on the
    /// channel wakes to release it. Created when the late mode is first on.
    late_timer: OnceLock<OwnedFd>,
    /// When the attached queue pairs want their deadlines checked (the
    /// transport and frame timeouts, see `qp::check_deadlines`).
    checks: Mutex<Checks>,
    /// Fires at the earliest check, so an owner asleep on the channel
    /// wakes for it. Armed only while some queue pair waits for its peer.
    check_timer: OwnedFd,
    capacity: u32,
}

/// The deadline checks the queue pairs of a CQ asked for.
struct Checks {
    /// `(when, qp_num)`, earliest first. An entry whose queue pair no
    /// longer expects a check at that time is stale and skipped.
    queue: BinaryHeap<Reverse<(Instant, u32)>>,
    /// What the timer is armed for (`None`: disarmed, or fired).
    armed: Option<Instant>,
}

impl CqShared {
    /// Queues a completion; if the CQ is armed, fires the channel.
    pub(crate) fn push(&self, c: Completion) {
        self.recent_qp.store(c.qp_num.0, Ordering::Relaxed);
        lock(&self.queue).push_back(c);
        if self.armed.swap(false, Ordering::AcqRel) {
            self.signal();
        }
    }

    fn signal(&self) {
        self.signaled.store(true, Ordering::Release);
        sys::eventfd_signal(self.evfd.as_raw_fd());
    }

    /// Makes the channel not readable. A write racing with this may be
    /// drained with `signaled` left set, which costs one empty read later,
    /// never a lost wake-up: the owner polls after it arms.
    fn drain_channel(&self) {
        if self.signaled.swap(false, Ordering::AcqRel) {
            sys::counter_drain(self.evfd.as_raw_fd());
        }
    }

    /// Moves up to `out.len()` queued completions to `out`.
    fn take_completions(&self, out: &mut [Completion]) -> usize {
        let mut queue = lock(&self.queue);
        let k = out.len().min(queue.len());
        for (slot, c) in out.iter_mut().zip(queue.drain(..k)) {
            *slot = c;
        }
        k
    }

    /// The queue pair whose socket most likely woke the owner: the only
    /// one attached, or else the one whose completion was queued last (a
    /// reactor's idle sessions do not move it). `None` when nothing was
    /// queued yet, or that queue pair is gone.
    fn likely_waker(&self) -> Option<Arc<QpShared>> {
        let qps = lock(&self.qps);
        if qps.len() == 1 {
            return qps.values().next().and_then(Weak::upgrade);
        }
        qps.get(&self.recent_qp.load(Ordering::Relaxed)).and_then(Weak::upgrade)
    }

    pub(crate) fn epfd(&self) -> RawFd {
        self.epfd.as_raw_fd()
    }

    /// Makes the queue pair reachable from epoll events with token `qp_num`.
    pub(crate) fn attach(&self, qp_num: u32, qp: Weak<QpShared>) {
        lock(&self.qps).insert(qp_num, qp);
    }

    pub(crate) fn detach(&self, qp_num: u32) {
        lock(&self.qps).remove(&qp_num);
    }

    pub(crate) fn coalesces_acks(&self) -> bool {
        self.ack_hold_ns.load(Ordering::Relaxed) != ACKS_NOT_HELD
    }

    pub(crate) fn defer_ack(&self, qp_num: u32) {
        let since = (self.ack_hold_ns.load(Ordering::Relaxed) != 0).then(Instant::now);
        lock(&self.deferred_acks).push_back((qp_num, since));
    }

    /// Sends the deferred ACKs that have been held for the hold time (all of
    /// them with `all`), unless a frame sent since carried them.
    fn send_deferred_acks(&self, all: bool) {
        let hold = Duration::from_nanos(self.ack_hold_ns.load(Ordering::Relaxed));
        let mut now = None;
        loop {
            // One entry at a time: the progress routine takes this lock too.
            let next = {
                let mut deferred = lock(&self.deferred_acks);
                let mut held = |since: Option<Instant>| {
                    since.is_some_and(|since| now.get_or_insert_with(Instant::now).saturating_duration_since(since) < hold)
                };
                match deferred.front() {
                    Some(&(_, since)) if !all && held(since) => None,
                    _ => deferred.pop_front().map(|(qp_num, _)| qp_num),
                }
            };
            let Some(qp_num) = next else { return };
            let qp = lock(&self.qps).get(&qp_num).and_then(Weak::upgrade);
            if let Some(qp) = qp {
                qp::send_deferred_ack(&qp);
            }
        }
    }

    /// Makes sure the owner, asleep on the channel, wakes when the oldest
    /// deferred ACK's hold ends. ACKs a frame carried meanwhile are dropped
    /// from the front first, so an answered command sets no timer. The
    /// timer is only moved earlier, never disarmed: one that fires after
    /// its ACK was carried costs one wake-up, rarer than a timer call per
    /// command.
    fn wake_for_deferred_acks(&self) {
        let hold = Duration::from_nanos(self.ack_hold_ns.load(Ordering::Relaxed));
        let due = loop {
            let front = lock(&self.deferred_acks).front().copied();
            let Some((qp_num, since)) = front else { return };
            let qp = lock(&self.qps).get(&qp_num).and_then(Weak::upgrade);
            if qp.as_deref().is_some_and(qp::owes_deferred_ack) {
                break since.and_then(|since| since.checked_add(hold));
            }
            // Carried by a frame, or its queue pair is gone: forget it.
            // (Only that entry: one pushed meanwhile stays behind it.)
            let mut deferred = lock(&self.deferred_acks);
            if deferred.front() == Some(&(qp_num, since)) {
                deferred.pop_front();
            }
        };
        let Some(due) = due else { return };
        let mut at = lock(&self.ack_timer_at);
        if at.is_none_or(|armed| due < armed) {
            *at = Some(due);
            let after = due.saturating_duration_since(Instant::now());
            if let Err(e) = sys::timerfd_set(self.ack_timer.as_raw_fd(), Some(after)) {
                tracing::warn!(error = %e, "timerfd_settime for deferred ACKs failed");
            }
        }
    }

    /// Whether send completions are held back (the test-only late mode).
    pub(crate) fn late_send_completions(&self) -> bool {
        self.late_sends.load(Ordering::Relaxed)
    }

    /// How many of the peer's SENDs must be delivered before held send
    /// completions are released.
    pub(crate) fn late_sends_after(&self) -> u32 {
        self.late_sends_after.load(Ordering::Relaxed).max(1)
    }

    /// How long the late mode holds a send completion back at most.
    pub(crate) fn late_send_hold(&self) -> Duration {
        Duration::from_nanos(self.late_hold_ns.load(Ordering::Relaxed))
    }

    /// Queue pair `qp_num` holds send completions back until `until` at
    /// the latest.
    pub(crate) fn hold_sends(&self, qp_num: u32, until: Instant) {
        let mut held = lock(&self.held_sends);
        held.push_back((qp_num, until));
        if held.len() == 1 {
            self.set_late_timer(Some(until));
        }
    }

    /// Arms the timer of late completions for `at`, or disarms it.
    fn set_late_timer(&self, at: Option<Instant>) {
        if let Some(fd) = self.late_timer.get() {
            let after = at.map(|t| t.saturating_duration_since(Instant::now()));
            if let Err(e) = sys::timerfd_set(fd.as_raw_fd(), after) {
                tracing::warn!(error = %e, "timerfd_settime for late send completions failed");
            }
        }
    }

    /// Creates the timer of late completions, once, and adds it to epoll.
    fn make_late_timer(&self) -> Result<()> {
        if self.late_timer.get().is_some() {
            return Ok(());
        }
        let fd = sys::timerfd().map_err(|e| FabricError::io("timerfd for late send completions", e))?;
        sys::epoll_add_in(self.epfd(), fd.as_raw_fd(), TIMERFD_TOKEN)
            .map_err(|e| FabricError::io("adding the late-completion timerfd to epoll", e))?;
        // Should another thread have won a race to set it, this fd closes
        // here and so leaves the epoll set.
        let _ = self.late_timer.set(fd);
        Ok(())
    }

    /// Queue pair `qp_num` wants its deadlines checked at `at` (the
    /// queue pair remembers `at`; an earlier entry it forgot is stale).
    /// Rearms the timer only when `at` is earlier than what it waits for.
    pub(crate) fn schedule_check(&self, qp_num: u32, at: Instant) {
        let mut checks = lock(&self.checks);
        checks.queue.push(Reverse((at, qp_num)));
        if checks.armed.is_none_or(|armed| at < armed) {
            checks.armed = Some(at);
            self.set_check_timer(Some(at));
        }
    }

    fn set_check_timer(&self, at: Option<Instant>) {
        let after = at.map(|t| t.saturating_duration_since(Instant::now()));
        if let Err(e) = sys::timerfd_set(self.check_timer.as_raw_fd(), after) {
            tracing::warn!(error = %e, "timerfd_settime for queue pair deadlines failed");
        }
    }

    /// The check timer fired: runs the checks that are due, then arms the
    /// timer for the next one (or leaves it disarmed when none is left).
    fn run_checks(&self) {
        sys::counter_drain(self.check_timer.as_raw_fd());
        let now = Instant::now();
        lock(&self.checks).armed = None;
        loop {
            // One entry at a time: a check takes the queue pair's lock and
            // may schedule the next one.
            let next = {
                let mut checks = lock(&self.checks);
                match checks.queue.peek() {
                    Some(&Reverse((at, qp_num))) if at <= now => {
                        checks.queue.pop();
                        Some((at, qp_num))
                    }
                    _ => None,
                }
            };
            let Some((at, qp_num)) = next else { break };
            let qp = lock(&self.qps).get(&qp_num).and_then(Weak::upgrade);
            if let Some(qp) = qp {
                qp::check_deadlines(&qp, at, now);
            }
        }
        let mut checks = lock(&self.checks);
        let next = checks.queue.peek().map(|&Reverse((at, _))| at);
        if next != checks.armed {
            checks.armed = next;
            self.set_check_timer(next);
        }
    }

    /// Releases the send completions held past their hold (all of them
    /// with `all`), and re-arms the timer for the next hold.
    fn release_held_sends(&self, all: bool) {
        let now = Instant::now();
        loop {
            // One entry at a time: the progress routine takes this lock too.
            let next = {
                let mut held = lock(&self.held_sends);
                match held.front() {
                    Some(&(_, until)) if !all && until > now => {
                        self.set_late_timer(Some(until));
                        None
                    }
                    _ => held.pop_front().map(|(qp_num, _)| qp_num),
                }
            };
            let Some(qp_num) = next else { return };
            let qp = lock(&self.qps).get(&qp_num).and_then(Weak::upgrade);
            if let Some(qp) = qp {
                qp::release_held_sends(&qp, if all { None } else { Some(now) });
            }
        }
    }
}

/// A completion queue of the tcp provider.
pub struct TcpCq {
    shared: Arc<CqShared>,
}

impl TcpCq {
    pub(crate) fn new(capacity: u32) -> Result<TcpCq> {
        let epfd = sys::epoll_create().map_err(|e| FabricError::io("epoll_create1 for a completion queue", e))?;
        let evfd = sys::eventfd().map_err(|e| FabricError::io("eventfd for a completion queue", e))?;
        sys::epoll_add_in(epfd.as_raw_fd(), evfd.as_raw_fd(), EVENTFD_TOKEN)
            .map_err(|e| FabricError::io("adding the completion eventfd to epoll", e))?;
        let check_timer = sys::timerfd().map_err(|e| FabricError::io("timerfd for queue pair deadlines", e))?;
        sys::epoll_add_in(epfd.as_raw_fd(), check_timer.as_raw_fd(), DEADLINE_TOKEN)
            .map_err(|e| FabricError::io("adding the deadline timerfd to epoll", e))?;
        let ack_timer = sys::timerfd().map_err(|e| FabricError::io("timerfd for deferred ACKs", e))?;
        sys::epoll_add_in(epfd.as_raw_fd(), ack_timer.as_raw_fd(), ACK_TIMER_TOKEN)
            .map_err(|e| FabricError::io("adding the deferred-ACK timerfd to epoll", e))?;
        let cq = TcpCq {
            shared: Arc::new(CqShared {
                epfd,
                evfd,
                queue: Mutex::new(VecDeque::with_capacity(capacity.clamp(1, 1 << 16) as usize)),
                armed: AtomicBool::new(false),
                signaled: AtomicBool::new(false),
                woken: AtomicBool::new(false),
                received: AtomicBool::new(false),
                recent_qp: AtomicU32::new(NO_QP),
                qps: Mutex::new(KeyMap::default()),
                ack_hold_ns: AtomicU64::new(ACKS_NOT_HELD),
                deferred_acks: Mutex::new(VecDeque::new()),
                ack_timer,
                ack_timer_at: Mutex::new(None),
                late_sends: AtomicBool::new(false),
                late_sends_after: std::sync::atomic::AtomicU32::new(1),
                late_hold_ns: AtomicU64::new(LATE_SEND_HOLD.as_nanos() as u64),
                held_sends: Mutex::new(VecDeque::new()),
                late_timer: OnceLock::new(),
                checks: Mutex::new(Checks { queue: BinaryHeap::new(), armed: None }),
                check_timer,
                capacity,
            }),
        };
        let after = late_send_completions_from_env();
        if after > 0 {
            cq.set_late_send_completions_after(after)?;
        }
        Ok(cq)
    }

    pub(crate) fn shared(&self) -> &Arc<CqShared> {
        &self.shared
    }

    /// Drives every attached queue pair whose socket is ready, then returns
    /// up to `out.len()` completions.
    ///
    /// Standalone ACKs held back longer than the hold leave at the start of
    /// the call (the application has had its time to answer with a frame
    /// that carries them). An application that stops polling arms the CQ
    /// first, which sets a timer that wakes it when the oldest hold ends.
    pub fn poll(&self, out: &mut [Completion]) -> Result<usize> {
        let sh = &*self.shared;
        // A receiving wait just processed its socket: what it queued is
        // returned as is. The next poll asks epoll, as always, and sends
        // the ACKs due then: sent now, the ACK of the answer just received
        // would leave on its own, ahead of the next request that carries it.
        if sh.received.swap(false, Ordering::AcqRel) {
            let k = sh.take_completions(out);
            if k > 0 {
                return Ok(k);
            }
        }
        sh.send_deferred_acks(false);
        // The first poll after a wake-up reads the socket that most likely
        // woke the owner (the lone queue pair's, or the one whose completion
        // was queued last, see `likely_waker`) without asking epoll first:
        // a system call per I/O at queue depth 1, on both sides, also on a
        // reactor that holds idle sessions. Only when that brings no
        // completion is epoll asked, as always, so the timers, the channel
        // and the other sockets are still served: at once when the guess
        // was wrong, and by the next poll when it was right (an owner polls
        // again after a poll that brought work; level-triggered epoll keeps
        // reporting them). Never in the late mode (its timer must be seen
        // after the socket) or while busy polling (no wake-up: an empty
        // poll stays one system call).
        if sh.woken.swap(false, Ordering::AcqRel) && !sh.late_send_completions() {
            if let Some(qp) = sh.likely_waker() {
                qp::progress(&qp, 0);
                let k = sh.take_completions(out);
                if k > 0 {
                    return Ok(k);
                }
            }
        }
        let mut events = [sys::EMPTY_EVENT; EVENTS_PER_POLL];
        let n = sys::epoll_wait(sh.epfd(), &mut events, 0)
            .map_err(|e| FabricError::io("epoll_wait on a completion queue", e))?;
        let mut checks_due = false;
        for ev in &events[..n] {
            // Copy out of the (packed) struct before use.
            let (token, flags) = (ev.u64, ev.events);
            if token == EVENTFD_TOKEN {
                // Completions are returned below whether or not it fired;
                // drained here so that a fired channel does not make every
                // later epoll_wait report it again.
                sh.drain_channel();
                continue;
            }
            if token == DEADLINE_TOKEN {
                // Checked below, after the sockets: what they brought may
                // be the progress that meets a deadline.
                checks_due = true;
                continue;
            }
            if token == ACK_TIMER_TOKEN {
                // The hold ended: the ACKs due left at the start of this
                // call (the owner polls after it wakes). `arm` sets the
                // timer again for the next.
                sys::counter_drain(sh.ack_timer.as_raw_fd());
                *lock(&sh.ack_timer_at) = None;
                continue;
            }
            if token == TIMERFD_TOKEN {
                // Expired holds are released below.
                if let Some(fd) = sh.late_timer.get() {
                    sys::counter_drain(fd.as_raw_fd());
                }
                continue;
            }
            let qp = lock(&sh.qps).get(&(token as u32)).and_then(Weak::upgrade);
            if let Some(qp) = qp {
                qp::progress(&qp, flags);
            }
        }
        if sh.late_send_completions() {
            // After the sockets: a SEND that arrived in time releases first.
            sh.release_held_sends(false);
        }
        if checks_due {
            sh.run_checks();
        }
        Ok(sh.take_completions(out))
    }

    pub fn fd(&self) -> RawFd {
        self.shared.epfd()
    }

    /// The capacity asked for (a hint: this CQ never overruns).
    pub fn capacity(&self) -> u32 {
        self.shared.capacity
    }

    /// Arms the channel for the next completion; fires it at once if
    /// completions are already queued. Deferred ACKs whose hold ended
    /// leave now; for the others a timer makes the channel readable when
    /// the oldest hold ends, so an owner that sleeps while the answer is
    /// at the disk still lets the answer carry the ACK, and one that has
    /// nothing to answer sends it a hold later.
    pub fn arm(&self) -> Result<()> {
        let sh = &*self.shared;
        sh.send_deferred_acks(false);
        sh.wake_for_deferred_acks();
        sh.armed.store(true, Ordering::Release);
        let pending = !lock(&sh.queue).is_empty();
        if pending && sh.armed.swap(false, Ordering::AcqRel) {
            sh.signal();
        }
        Ok(())
    }

    pub fn set_ack_coalescing(&self, hold: Option<Duration>) {
        let ns = hold.map_or(ACKS_NOT_HELD, |h| (h.as_nanos() as u64).min(ACKS_NOT_HELD - 1));
        self.shared.ack_hold_ns.store(ns, Ordering::Relaxed);
        if hold.is_none() {
            self.shared.send_deferred_acks(true);
        }
    }

    /// Test-only: turns late send completions on or off for the queue pairs
    /// of this CQ (on for every CQ when the process started with
    /// `RDMABLK_TCP_LATE_SEND_COMPLETIONS=1`).
    ///
    /// In this mode a signaled SEND that the peer acknowledged does not
    /// complete at once: its completion waits until the next SEND from the
    /// peer on that queue pair has been delivered (that receive completion
    /// comes first), or until the queue pair fails (the SEND then completes
    /// with `WrFlushError`, like every other outstanding work request), or
    /// until 50 ms pass with no SEND from the peer (the
    /// channel fires then, so an owner asleep on it wakes). That is the
    /// order Soft-RoCE on Linux 6.12, and busy NICs, report completions in:
    /// an application must not rely on its answer's send completion to
    /// arrive before the peer's next request. The completions of the same
    /// send queue behind a held SEND (RDMA WRITE, READ) wait with it, as
    /// they stay in posting order; they are never held on their own.
    /// Turning the mode off releases every held completion.
    pub fn set_late_send_completions(&self, on: bool) -> Result<()> {
        let sh = &*self.shared;
        if on {
            sh.make_late_timer()?;
        }
        sh.late_sends.store(on, Ordering::Relaxed);
        if !on {
            sh.release_held_sends(true);
            sh.set_late_timer(None);
        }
        Ok(())
    }

    /// The late mode, with held completions waiting for `sends` of the
    /// peer's SENDs instead of one (`RDMABLK_TCP_LATE_SEND_COMPLETIONS=N`):
    /// with two or more, the peer may have answered two of them and sent
    /// two new requests before either completion shows. 0 turns it off.
    pub fn set_late_send_completions_after(&self, sends: u32) -> Result<()> {
        self.shared.late_sends_after.store(sends.max(1), Ordering::Relaxed);
        self.set_late_send_completions(sends > 0)
    }

    /// Changes the late mode's hold (unit tests: a long one shows the
    /// order without racing the bound).
    #[cfg(test)]
    pub(crate) fn set_late_send_hold(&self, hold: Duration) {
        self.shared.late_hold_ns.store(hold.as_nanos() as u64, Ordering::Relaxed);
    }

    /// The owner's sleep and its first receive in one system call, for an
    /// owner that is the only thread using this CQ and its one queue pair
    /// (the initiator's connection): it sleeps in a receive on the
    /// socket, as a bare TCP client does, instead of in `poll` on the fd
    /// followed by a `read`. Returns whether completions may be queued
    /// (`false`: `timeout` passed, or less: at most
    /// `LONGEST_RECEIVING_WAIT`); the next [`poll`](TcpCq::poll) takes
    /// them without a system call.
    ///
    /// `None` when the CQ cannot wait so; the owner then sleeps on the fd
    /// (`CompletionQueue::wait`). That is when more or fewer than one queue
    /// pair is attached, that one cannot (`qp::wait_receiving`), the
    /// late mode is on, a deferred ACK waits for its hold to end, or a
    /// deadline check is due within `SHORTEST_RECEIVING_WAIT`: the wait
    /// sleeps no longer than the next check, so the transport and frame
    /// timeouts still fire. Nothing else can wake it: a completion another
    /// thread queued meanwhile waits for the receive, which is why the
    /// owner must be alone.
    pub fn wait_receiving(&self, timeout: Option<Duration>) -> Option<bool> {
        let sh = &*self.shared;
        if sh.late_send_completions() {
            return None;
        }
        // Disarmed: completions the receive brings are polled next, with no
        // write to the channel (an owner usually arms before it waits).
        self.disarm();
        sh.send_deferred_acks(false);
        if !lock(&sh.deferred_acks).is_empty() {
            return None;
        }
        if !lock(&sh.queue).is_empty() {
            sh.received.store(true, Ordering::Release);
            return Some(true);
        }
        let qp = {
            let qps = lock(&sh.qps);
            if qps.len() != 1 {
                return None;
            }
            qps.values().next().and_then(Weak::upgrade)?
        };
        let mut limit = timeout.unwrap_or(LONGEST_RECEIVING_WAIT).min(LONGEST_RECEIVING_WAIT);
        if let Some(at) = lock(&sh.checks).armed {
            limit = limit.min(at.saturating_duration_since(Instant::now()));
        }
        if limit < SHORTEST_RECEIVING_WAIT {
            return None;
        }
        // Whole milliseconds, halved down to a power of two: the socket's
        // timeout changes (a system call) only when the limit halves.
        let ms = limit.as_millis() as u64;
        let limit = Duration::from_millis(1 << (63 - ms.leading_zeros()));
        let got = qp::wait_receiving(&qp, limit)?;
        if got {
            sh.received.store(true, Ordering::Release);
        }
        Some(got)
    }

    /// Takes back an `arm`: the owner stays awake and polls.
    pub fn disarm(&self) {
        let sh = &*self.shared;
        sh.armed.store(false, Ordering::Release);
        sh.drain_channel();
    }

    /// Consumes a wake-up. It also disarms: the owner is awake now and
    /// polls before it sleeps again, after arming. A CQ left armed would
    /// write the eventfd at the owner's first completion and make its next
    /// poll read it back: two system calls for a wake-up nobody waits for.
    pub fn ack_event(&self) -> Result<()> {
        self.disarm();
        self.shared.woken.store(true, Ordering::Release);
        Ok(())
    }
}
