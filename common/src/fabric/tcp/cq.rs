//! Completion queues: a completion ring, the epoll set over the sockets of
//! the attached queue pairs, and the eventfd used as completion channel.

use std::collections::{HashMap, VecDeque};
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use super::qp::{self, QpShared};
use super::sys;
use crate::fabric::{lock, Completion, FabricError, Result};

/// Epoll token of the completion eventfd (queue pairs use their qp_num).
const EVENTFD_TOKEN: u64 = u64::MAX;

/// `CqShared::ack_hold_ns` when standalone ACKs are not held back.
const ACKS_NOT_HELD: u64 = u64::MAX;

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
    qps: Mutex<HashMap<u32, Weak<QpShared>>>,
    /// How long a standalone ACK may be held back, in nanoseconds;
    /// `ACKS_NOT_HELD` when coalescing is off (see
    /// `CompletionQueue::set_ack_coalescing`).
    ack_hold_ns: AtomicU64,
    /// Queue pairs owing a standalone ACK, oldest first, with the moment it
    /// was deferred (see `qp::progress`).
    deferred_acks: Mutex<VecDeque<(u32, Instant)>>,
    capacity: u32,
}

impl CqShared {
    /// Queues a completion; if the CQ is armed, fires the channel.
    pub(crate) fn push(&self, c: Completion) {
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
        lock(&self.deferred_acks).push_back((qp_num, Instant::now()));
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
                let mut held = |since: Instant| now.get_or_insert_with(Instant::now).saturating_duration_since(since) < hold;
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
        Ok(TcpCq {
            shared: Arc::new(CqShared {
                epfd,
                evfd,
                queue: Mutex::new(VecDeque::with_capacity(capacity.clamp(1, 1 << 16) as usize)),
                armed: AtomicBool::new(false),
                signaled: AtomicBool::new(false),
                qps: Mutex::new(HashMap::new()),
                ack_hold_ns: AtomicU64::new(ACKS_NOT_HELD),
                deferred_acks: Mutex::new(VecDeque::new()),
                capacity,
            }),
        })
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
    /// first, which sends all of them.
    pub fn poll(&self, out: &mut [Completion]) -> Result<usize> {
        let sh = &*self.shared;
        sh.send_deferred_acks(false);
        let mut events = [sys::EMPTY_EVENT; EVENTS_PER_POLL];
        let n = sys::epoll_wait(sh.epfd(), &mut events, 0)
            .map_err(|e| FabricError::io("epoll_wait on a completion queue", e))?;
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
            let qp = lock(&sh.qps).get(&(token as u32)).and_then(Weak::upgrade);
            if let Some(qp) = qp {
                qp::progress(&qp, flags);
            }
        }
        let k = {
            let mut queue = lock(&sh.queue);
            let k = out.len().min(queue.len());
            for (slot, c) in out.iter_mut().zip(queue.drain(..k)) {
                *slot = c;
            }
            k
        };
        Ok(k)
    }

    pub fn fd(&self) -> RawFd {
        self.shared.epfd()
    }

    /// The capacity asked for (a hint: this CQ never overruns).
    pub fn capacity(&self) -> u32 {
        self.shared.capacity
    }

    /// Arms the channel for the next completion; fires it at once if
    /// completions are already queued.
    pub fn arm(&self) -> Result<()> {
        let sh = &*self.shared;
        sh.send_deferred_acks(true);
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

    /// Consumes a wake-up. It also disarms: the owner is awake now and
    /// polls before it sleeps again, after arming. A CQ left armed would
    /// write the eventfd at the owner's first completion and make its next
    /// poll read it back: two system calls for a wake-up nobody waits for.
    pub fn ack_event(&self) -> Result<()> {
        let sh = &*self.shared;
        sh.armed.store(false, Ordering::Release);
        sh.drain_channel();
        Ok(())
    }
}
