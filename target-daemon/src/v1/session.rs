//! rdmablk v1 sessions: a host's queue pairs, which may live on different
//! reactors, and what they share (the volumes opened, the pool accounts,
//! the reconnect fence's state).
//!
//! The per-I/O path takes no lock: a queue pair checks a command against
//! the session's opened set, an [`ArcSwap`] snapshot read lock-free. The
//! session table's lock ([`Sessions::admin`]) is taken only by CONNECT,
//! OPEN, CLOSE, queue pair teardown, metrics scrapes and reloads, so that a
//! reload's "is this volume open anywhere?" and an OPEN of that volume
//! cannot interleave.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use arc_swap::ArcSwap;
use rdmablk_common::protocol::{SessionId, VolumeId};

use crate::engine::pool::PoolAccount;
use crate::error::{Error, ErrorKind, Result};
use crate::registry::Registry;

/// The volumes a session has opened, by id (a bitmap), and those it was
/// granted read-only (a second bitmap, a subset of the first).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct OpenSet {
    bits: Vec<u64>,
    read_only: Vec<u64>,
}

impl OpenSet {
    /// Nothing open (a queue pair before CONNECT).
    pub const EMPTY: OpenSet = OpenSet { bits: Vec::new(), read_only: Vec::new() };

    /// Whether volume `id` is open with a read-only grant (`read_only_hosts`).
    #[inline]
    pub fn is_read_only(&self, id: VolumeId) -> bool {
        let i = id.0 as usize;
        self.read_only.get(i / 64).is_some_and(|w| w & (1 << (i % 64)) != 0)
    }

    /// A copy with `id` added, read-only if `read_only` (a read-write
    /// grant replaces a read-only one and vice versa).
    pub fn with_grant(&self, id: VolumeId, read_only: bool) -> OpenSet {
        let mut set = self.with(id);
        let i = id.0 as usize;
        if set.read_only.len() <= i / 64 {
            set.read_only.resize(i / 64 + 1, 0);
        }
        if read_only {
            set.read_only[i / 64] |= 1 << (i % 64);
        } else {
            set.read_only[i / 64] &= !(1 << (i % 64));
        }
        set
    }

    /// Whether volume `id` is open.
    #[inline]
    pub fn contains(&self, id: VolumeId) -> bool {
        let i = id.0 as usize;
        self.bits.get(i / 64).is_some_and(|w| w & (1 << (i % 64)) != 0)
    }

    /// A copy with `id` added.
    pub fn with(&self, id: VolumeId) -> OpenSet {
        let i = id.0 as usize;
        let mut bits = self.bits.clone();
        if bits.len() <= i / 64 {
            bits.resize(i / 64 + 1, 0);
        }
        bits[i / 64] |= 1 << (i % 64);
        OpenSet { bits, read_only: self.read_only.clone() }
    }

    /// A copy with `id` removed.
    pub fn without(&self, id: VolumeId) -> OpenSet {
        let i = id.0 as usize;
        let mut bits = self.bits.clone();
        let mut read_only = self.read_only.clone();
        for w in [bits.get_mut(i / 64), read_only.get_mut(i / 64)].into_iter().flatten() {
            *w &= !(1 << (i % 64));
        }
        OpenSet { bits, read_only }
    }

    /// The open ids.
    pub fn ids(&self) -> impl Iterator<Item = VolumeId> + '_ {
        self.bits.iter().enumerate().flat_map(|(w, &bits)| {
            (0..64).filter(move |b| bits & (1 << b) != 0).map(move |b| VolumeId((w * 64 + b) as u32))
        })
    }

    /// Whether nothing is open.
    pub fn is_empty(&self) -> bool {
        self.bits.iter().all(|&w| w == 0)
    }
}

/// A session as every one of its queue pairs sees it.
#[derive(Debug)]
pub struct SharedSession {
    pub id: SessionId,
    pub host_id: String,
    /// Its queue pair authenticated as `host_id` at CONNECT (`[[host]]`
    /// key); otherwise an anonymous session.
    pub authenticated: bool,
    open: ArcSwap<OpenSet>,
    /// Pool chunks the session holds, one account per reactor (charged by
    /// that reactor's pool only), for `target.session_pool_share`.
    pool_accounts: Box<[Arc<PoolAccount>]>,
    /// A newer session of the same host replaced this one (the reconnect
    /// fence), or it was evicted: its queue pairs stop reading and executing.
    retired: AtomicBool,
    /// Evicted from a full table for an authenticated host's session.
    evicted: AtomicBool,
    /// Its last queue pair is gone, and with it the last disk I/O.
    ended: AtomicBool,
    /// Commands of this session dropped before they reached the disk,
    /// because their queue pair had failed or the session was retired.
    dropped: AtomicU64,
}

impl SharedSession {
    /// The opened set, read lock-free (the per-I/O check).
    #[inline]
    pub fn open(&self) -> arc_swap::Guard<Arc<OpenSet>> {
        self.open.load()
    }

    /// Marks `id` open. Call with the admin lock held.
    pub fn mark_open(&self, _admin: &Admin, id: VolumeId) {
        let cur = self.open.load_full();
        self.open.store(Arc::new(cur.with(id)));
    }

    /// Marks `id` open with the grant OPEN found: read-only for a host in
    /// the volume's `read_only_hosts`. Call with the admin lock held.
    pub fn mark_open_with_grant(&self, _admin: &Admin, id: VolumeId, read_only: bool) {
        let cur = self.open.load_full();
        self.open.store(Arc::new(cur.with_grant(id, read_only)));
    }

    /// Marks `id` closed. Call with the admin lock held.
    pub fn mark_closed(&self, _admin: &Admin, id: VolumeId) {
        let cur = self.open.load_full();
        self.open.store(Arc::new(cur.without(id)));
    }

    /// The session's pool account on `reactor`.
    #[inline]
    pub fn pool_account(&self, reactor: usize) -> Option<&Arc<PoolAccount>> {
        self.pool_accounts.get(reactor)
    }

    /// Whether a newer session replaced this one, or it was evicted (one
    /// load per command).
    #[inline]
    pub fn is_retired(&self) -> bool {
        self.retired.load(Ordering::Acquire)
    }

    /// Whether it was evicted from a full session table (then also retired).
    pub fn is_evicted(&self) -> bool {
        self.evicted.load(Ordering::Acquire)
    }

    /// Whether the session is over: no queue pair, no command, no disk I/O left.
    pub fn has_ended(&self) -> bool {
        self.ended.load(Ordering::Acquire)
    }

    /// Counts commands dropped unexecuted.
    pub fn count_dropped(&self, n: u64) {
        self.dropped.fetch_add(n, Ordering::Relaxed);
    }

    /// Commands dropped unexecuted so far.
    pub fn dropped(&self) -> u64 {
        self.dropped.load(Ordering::Relaxed)
    }
}

/// The session limits of `[target]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SessionLimits {
    /// `target.max_sessions`.
    pub max_sessions: u32,
    /// `target.max_anonymous_sessions`: of those, most without
    /// authentication.
    pub max_anonymous_sessions: u32,
    /// `target.max_queues_per_session`.
    pub max_queues_per_session: u32,
}

impl SessionLimits {
    /// No limits (library use and unit tests).
    pub const NONE: SessionLimits =
        SessionLimits { max_sessions: u32::MAX, max_anonymous_sessions: u32::MAX, max_queues_per_session: u32::MAX };
}

struct SessionEntry {
    shared: Arc<SharedSession>,
    created: Instant,
    next_queue: u32,
    /// Live queue pairs per reactor.
    queue_pairs: Vec<u32>,
}

/// What the session table's lock guards.
pub struct Admin {
    sessions: HashMap<SessionId, SessionEntry>,
    /// Of `sessions`, those evicted whose queue pairs have not all left
    /// yet: they stay in the table for the reconnect fence (a host that
    /// reconnects waits for their disk I/O) but no longer count as sessions.
    evicted: usize,
    /// Of `sessions`, the live anonymous ones.
    anonymous: usize,
}

impl Admin {
    /// Sessions that count against `max_sessions`.
    fn live(&self) -> usize {
        self.sessions.len() - self.evicted
    }

    /// The anonymous session to evict for an authenticated one: the oldest
    /// without an open volume, else the oldest.
    fn eviction_candidate(&self) -> Option<SessionId> {
        let anonymous = self.sessions.values().filter(|e| !e.shared.authenticated && !e.shared.is_retired());
        let idle = anonymous.clone().filter(|e| e.shared.open.load().is_empty()).min_by_key(|e| e.created);
        idle.or_else(|| anonymous.min_by_key(|e| e.created)).map(|e| e.shared.id)
    }
}

/// A session as a scrape or a reload sees it.
#[derive(Clone, Debug)]
pub struct SessionSummary {
    pub id: SessionId,
    pub host_id: String,
    pub open: Vec<VolumeId>,
    /// (reactor, live queue pairs there), reactors with none left out.
    pub queue_pairs: Vec<(usize, u32)>,
}

impl Admin {
    /// Every session.
    pub fn sessions(&self) -> Vec<SessionSummary> {
        let mut v: Vec<SessionSummary> = self
            .sessions
            .values()
            .map(|e| SessionSummary {
                id: e.shared.id,
                host_id: e.shared.host_id.clone(),
                open: e.shared.open.load().ids().collect(),
                queue_pairs: e.queue_pairs.iter().enumerate().filter(|(_, &n)| n > 0).map(|(r, &n)| (r, n)).collect(),
            })
            .collect();
        v.sort_by_key(|s| s.id);
        v
    }

    /// Hosts of the sessions that have volume `id` open.
    pub fn users_of(&self, id: VolumeId) -> Vec<String> {
        let mut hosts: Vec<String> = self
            .sessions
            .values()
            .filter(|e| e.shared.open.load().contains(id))
            .map(|e| format!("{} (session {:#x})", e.shared.host_id, e.shared.id.0))
            .collect();
        hosts.sort();
        hosts
    }
}

/// What CONNECT got: the session and this queue pair's index in it.
pub struct Joined {
    pub session: Arc<SharedSession>,
    pub queue_index: u16,
    pub created: bool,
}

/// The sessions of every reactor.
pub struct Sessions {
    admin: Mutex<Admin>,
    limits: SessionLimits,
    /// Its fence generation and wake-ups, and the limits' counters.
    registry: Arc<Registry>,
}

impl Sessions {
    /// No sessions yet, within `limits`, for the reactors of `registry`.
    pub fn new(registry: Arc<Registry>, limits: SessionLimits) -> Sessions {
        Sessions { admin: Mutex::new(Admin { sessions: HashMap::new(), evicted: 0, anonymous: 0 }), limits, registry }
    }

    /// Takes the session table's lock (never on the per-I/O path).
    pub fn admin(&self) -> MutexGuard<'_, Admin> {
        self.admin.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The reconnect fence, first step: a new session of `host_id` replaces
    /// session `id`. Marks it retired (its queue pairs stop reading and drop
    /// what they have not submitted to the disk) and wakes every reactor.
    /// `None` when no such session exists any more: nothing to wait for.
    /// A session of another host is refused like an unknown one.
    pub fn retire(&self, admin: &mut Admin, id: SessionId, host_id: &str) -> Result<Option<Arc<SharedSession>>> {
        let Some(e) = admin.sessions.get(&id) else { return Ok(None) };
        if e.shared.host_id != host_id {
            return Err(Error::new(
                ErrorKind::UnknownSession,
                format!("host {host_id:?} asked to replace session {:#x}, which is another host's", id.0),
            ));
        }
        let shared = Arc::clone(&e.shared);
        if !shared.retired.swap(true, Ordering::AcqRel) {
            self.registry.counters.fences.fetch_add(1, Ordering::Relaxed);
        }
        self.registry.fence_moved();
        Ok(Some(shared))
    }

    /// Creates a session for `host_id` (CONNECT with session id 0),
    /// `authenticated` or anonymous. An anonymous one is refused once
    /// `max_anonymous_sessions` anonymous sessions exist; any is refused once
    /// `max_sessions` sessions exist, except an authenticated one: for it
    /// an anonymous session is evicted (the oldest without an open volume,
    /// else the oldest), so anonymous sessions never lock out a host that
    /// proved who it is.
    pub fn create(&self, admin: &mut Admin, host_id: &str, authenticated: bool, reactor: usize) -> Result<Joined> {
        if admin.live() >= self.limits.max_sessions as usize {
            match admin.eviction_candidate().filter(|_| authenticated) {
                Some(victim) => self.evict(admin, victim, host_id),
                None => {
                    self.registry.counters.refused_sessions.fetch_add(1, Ordering::Relaxed);
                    return Err(Error::new(
                        ErrorKind::LimitReached,
                        format!(
                            "host {host_id:?} asked for a new session; {} sessions exist (target.max_sessions = {}){}",
                            admin.live(),
                            self.limits.max_sessions,
                            if authenticated { ", none of them anonymous" } else { "" }
                        ),
                    ));
                }
            }
        }
        if !authenticated && admin.anonymous >= self.limits.max_anonymous_sessions as usize {
            self.registry.counters.refused_anonymous_sessions.fetch_add(1, Ordering::Relaxed);
            return Err(Error::new(
                ErrorKind::LimitReached,
                format!(
                    "host {host_id:?} (unauthenticated) asked for a new session; {} anonymous sessions exist (target.max_anonymous_sessions = {})",
                    admin.anonymous, self.limits.max_anonymous_sessions
                ),
            ));
        }
        let id = loop {
            let id = SessionId(rand::random());
            if id.0 != 0 && !admin.sessions.contains_key(&id) {
                break id;
            }
        };
        let shared = Arc::new(SharedSession {
            id,
            host_id: host_id.to_owned(),
            authenticated,
            open: ArcSwap::from_pointee(OpenSet::default()),
            pool_accounts: (0..self.registry.reactors()).map(|_| Arc::new(PoolAccount::named(format!("host={host_id} session={:#x}", id.0)))).collect(),
            retired: AtomicBool::new(false),
            evicted: AtomicBool::new(false),
            ended: AtomicBool::new(false),
            dropped: AtomicU64::new(0),
        });
        let mut queue_pairs = vec![0; self.registry.reactors()];
        queue_pairs[reactor] = 1;
        admin.sessions.insert(id, SessionEntry { shared: Arc::clone(&shared), created: Instant::now(), next_queue: 1, queue_pairs });
        if !authenticated {
            admin.anonymous += 1;
        }
        Ok(Joined { session: shared, queue_index: 0, created: true })
    }

    /// Evicts anonymous session `victim` for a session of `host_id`: it is
    /// retired (its queue pairs close on every reactor, what reached the
    /// disk completes) and counts no more; it leaves the table with its
    /// last queue pair, so that a reconnect of its host still waits for it.
    fn evict(&self, admin: &mut Admin, victim: SessionId, host_id: &str) {
        let Some(e) = admin.sessions.get(&victim) else { return };
        let shared = Arc::clone(&e.shared);
        shared.evicted.store(true, Ordering::Release);
        shared.retired.store(true, Ordering::Release);
        admin.evicted += 1;
        admin.anonymous -= 1;
        self.registry.counters.evicted_sessions.fetch_add(1, Ordering::Relaxed);
        tracing::warn!(
            "session table full (target.max_sessions = {}): evicting anonymous session {:#x} of host {:?} ({}) for authenticated host {host_id:?}",
            self.limits.max_sessions,
            victim.0,
            shared.host_id,
            if shared.open.load().is_empty() { "no volume open" } else { "the oldest anonymous session; every one has a volume open" }
        );
        self.registry.fence_moved();
    }

    /// Joins session `id` (CONNECT with a session id): it must exist and
    /// belong to `host_id`.
    pub fn join(&self, admin: &mut Admin, id: SessionId, host_id: &str, reactor: usize) -> Result<Joined> {
        let unknown = || {
            Error::new(
                ErrorKind::UnknownSession,
                format!("host {host_id:?} asked to join session {:#x}, which does not exist or is another host's", id.0),
            )
        };
        let e = admin.sessions.get_mut(&id).ok_or_else(unknown)?;
        if e.shared.host_id != host_id {
            return Err(unknown());
        }
        if e.shared.is_retired() {
            return Err(Error::new(
                ErrorKind::UnknownSession,
                format!("host {host_id:?} asked to join session {:#x}, which a newer session replaced", id.0),
            ));
        }
        let live: u32 = e.queue_pairs.iter().sum();
        if live >= self.limits.max_queues_per_session {
            self.registry.counters.refused_queues.fetch_add(1, Ordering::Relaxed);
            return Err(Error::new(
                ErrorKind::LimitReached,
                format!(
                    "host {host_id:?} asked to join session {:#x}, which has {live} queue pairs (target.max_queues_per_session = {})",
                    id.0, self.limits.max_queues_per_session
                ),
            ));
        }
        if e.next_queue > u16::MAX as u32 {
            return Err(Error::new(ErrorKind::UnknownSession, format!("session {:#x} has had 65536 queue pairs", id.0)));
        }
        let queue_index = e.next_queue as u16;
        e.next_queue += 1;
        e.queue_pairs[reactor] += 1;
        Ok(Joined { session: Arc::clone(&e.shared), queue_index, created: false })
    }

    /// A queue pair of `session` on `reactor` is gone. Returns whether it was
    /// the last one (the session is then forgotten and cannot be joined).
    pub fn leave(&self, session: &SharedSession, reactor: usize) -> bool {
        let mut admin = self.admin();
        let Some(e) = admin.sessions.get_mut(&session.id) else { return true };
        e.queue_pairs[reactor] = e.queue_pairs[reactor].saturating_sub(1);
        if e.queue_pairs.iter().all(|&n| n == 0) {
            admin.sessions.remove(&session.id);
            if session.is_evicted() {
                admin.evicted -= 1;
            } else if !session.authenticated {
                admin.anonymous -= 1;
            }
            drop(admin);
            session.ended.store(true, Ordering::Release);
            if session.is_retired() {
                // Whoever waits for this fence is woken.
                self.registry.fence_moved();
            }
            true
        } else {
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::VolumeSet;
    use crate::sys::EventFd;

    /// No sessions yet, on `reactors` reactors, within `limits`.
    fn sessions(reactors: usize, limits: SessionLimits) -> (Arc<Registry>, Sessions) {
        let r = Arc::new(Registry::new(VolumeSet::new(1, Vec::new()), reactors));
        let s = Sessions::new(Arc::clone(&r), limits);
        (r, s)
    }

    #[test]
    fn open_sets() {
        let s = OpenSet::default();
        assert!(s.is_empty() && !s.contains(VolumeId(3)));
        let s = s.with(VolumeId(3)).with(VolumeId(130));
        assert!(s.contains(VolumeId(3)) && s.contains(VolumeId(130)) && !s.contains(VolumeId(4)));
        assert_eq!(s.ids().collect::<Vec<_>>(), vec![VolumeId(3), VolumeId(130)]);
        let s = s.without(VolumeId(3)).without(VolumeId(999));
        assert_eq!(s.ids().collect::<Vec<_>>(), vec![VolumeId(130)]);
        let s = s.with_grant(VolumeId(70), true);
        assert!(s.contains(VolumeId(70)) && s.is_read_only(VolumeId(70)) && !s.is_read_only(VolumeId(130)));
        assert!(!s.with_grant(VolumeId(70), false).is_read_only(VolumeId(70)), "a new grant replaces the old");
        let s = s.without(VolumeId(70));
        assert!(!s.contains(VolumeId(70)) && !s.is_read_only(VolumeId(70)));
        assert!(!s.with(VolumeId(70)).is_read_only(VolumeId(70)), "closing forgets the grant");
    }

    #[test]
    fn anonymous_sessions_are_capped_and_evicted_for_authenticated_ones() {
        let limits = SessionLimits { max_sessions: 3, max_anonymous_sessions: 2, max_queues_per_session: 4 };
        let (reg, r) = sessions(1, limits);
        let mut admin = r.admin();
        let busy = r.create(&mut admin, "busy", false, 0).ok().unwrap().session;
        busy.mark_open(&admin, VolumeId(0));
        let idle = r.create(&mut admin, "idle", false, 0).ok().unwrap().session;
        let e = r.create(&mut admin, "third", false, 0).err().unwrap();
        assert_eq!(e.kind(), ErrorKind::LimitReached);
        assert!(e.to_string().contains("target.max_anonymous_sessions = 2"), "{e}");
        assert_eq!(reg.counters.refused_anonymous_sessions.load(Ordering::Relaxed), 1);
        // The table (3) fills with an authenticated one; the next
        // authenticated one evicts the anonymous session without a volume.
        r.create(&mut admin, "alpha", true, 0).ok().unwrap();
        let generation = reg.fence_generation();
        r.create(&mut admin, "beta", true, 0).ok().unwrap();
        assert!(idle.is_evicted() && idle.is_retired() && !busy.is_retired());
        assert_ne!(reg.fence_generation(), generation, "the reactors hear of it");
        // Then the oldest anonymous one, although it has a volume open.
        r.create(&mut admin, "gamma", true, 0).ok().unwrap();
        assert!(busy.is_evicted());
        // Only authenticated sessions left: the next is refused.
        let e = r.create(&mut admin, "delta", true, 0).err().unwrap();
        assert!(e.to_string().contains("target.max_sessions = 3), none of them anonymous"), "{e}");
        assert_eq!(reg.counters.evicted_sessions.load(Ordering::Relaxed), 2);
        // Evicted sessions stay in the table (for a fence) until they leave,
        // without counting; an anonymous place is free again meanwhile.
        assert_eq!(admin.sessions.len(), 5);
        drop(admin);
        assert!(r.leave(&idle, 0) && r.leave(&busy, 0));
        let admin = r.admin();
        assert_eq!((admin.sessions.len(), admin.evicted, admin.anonymous), (3, 0, 0));
    }

    #[test]
    fn create_join_leave() {
        let (_, r) = sessions(2, SessionLimits::NONE);
        let a = {
            let mut admin = r.admin();
            r.create(&mut admin, "host-a", false, 0).ok().unwrap()
        };
        assert!(a.created && a.queue_index == 0 && a.session.id.0 != 0);
        let id = a.session.id;
        {
            let mut admin = r.admin();
            let b = r.join(&mut admin, id, "host-a", 1).ok().unwrap();
            assert_eq!(b.queue_index, 1);
            assert!(Arc::ptr_eq(&a.session, &b.session));
            let e = r.join(&mut admin, id, "host-b", 1).err().unwrap();
            assert_eq!(e.kind(), ErrorKind::UnknownSession);
            let e = r.join(&mut admin, SessionId(id.0 ^ 1), "host-a", 1).err().unwrap();
            assert_eq!(e.kind(), ErrorKind::UnknownSession);
            a.session.mark_open(&admin, VolumeId(7));
            assert_eq!(admin.users_of(VolumeId(7)).len(), 1);
            let s = admin.sessions();
            assert_eq!(s[0].queue_pairs, vec![(0, 1), (1, 1)]);
        }
        // Opened on one queue pair, visible to the other through the shared snapshot.
        assert!(a.session.open().contains(VolumeId(7)));
        assert!(!r.leave(&a.session, 0));
        assert!(r.leave(&a.session, 1), "the last queue pair ends the session");
        let mut admin = r.admin();
        assert!(r.join(&mut admin, id, "host-a", 0).is_err(), "a finished session cannot be joined");
    }

    #[test]
    fn limits_refuse_with_their_own_kind() {
        let (reg, r) = sessions(2, SessionLimits { max_sessions: 2, max_queues_per_session: 2, ..SessionLimits::NONE });
        let (a, _b) = {
            let mut admin = r.admin();
            (r.create(&mut admin, "a", false, 0).ok().unwrap(), r.create(&mut admin, "b", false, 1).ok().unwrap())
        };
        {
            let mut admin = r.admin();
            let e = r.create(&mut admin, "c", false, 0).err().unwrap();
            assert_eq!(e.kind(), ErrorKind::LimitReached);
            assert!(e.to_string().contains("target.max_sessions = 2"), "{e}");
            assert!(r.join(&mut admin, a.session.id, "a", 1).is_ok(), "the second queue pair fits");
            let e = r.join(&mut admin, a.session.id, "a", 0).err().unwrap();
            assert_eq!(e.kind(), ErrorKind::LimitReached);
            assert!(e.to_string().contains("target.max_queues_per_session = 2"), "{e}");
        }
        assert_eq!(reg.counters.refused_sessions.load(Ordering::Relaxed), 1);
        assert_eq!(reg.counters.refused_queues.load(Ordering::Relaxed), 1);
        // A queue pair leaving makes room for another join.
        assert!(!r.leave(&a.session, 1));
        assert!(r.join(&mut r.admin(), a.session.id, "a", 1).is_ok());

    }

    #[test]
    fn retiring_a_session_stops_joins_and_ends_with_its_last_queue_pair() {
        let (reg, r) = sessions(2, SessionLimits::NONE);
        let wake = Arc::new(EventFd::new().unwrap());
        reg.add_waker(Arc::clone(&wake));
        let old = r.create(&mut r.admin(), "h", false, 0).ok().unwrap().session;
        r.join(&mut r.admin(), old.id, "h", 1).ok().unwrap();
        let g0 = reg.fence_generation();
        // Another host cannot retire it; an unknown id is nothing to wait for.
        assert_eq!(r.retire(&mut r.admin(), old.id, "other").err().unwrap().kind(), ErrorKind::UnknownSession);
        assert!(r.retire(&mut r.admin(), SessionId(old.id.0 ^ 1), "h").unwrap().is_none());
        assert!(!old.is_retired() && reg.fence_generation() == g0);
        let got = r.retire(&mut r.admin(), old.id, "h").unwrap().expect("the session exists");
        assert!(Arc::ptr_eq(&got, &old) && old.is_retired() && !old.has_ended());
        assert!(reg.fence_generation() > g0 && wake.drain(), "every reactor is told");
        assert_eq!(reg.counters.fences.load(Ordering::Relaxed), 1);
        let e = r.join(&mut r.admin(), old.id, "h", 0).err().unwrap();
        assert_eq!(e.kind(), ErrorKind::UnknownSession, "a retired session takes no new queue pairs");
        let g1 = reg.fence_generation();
        assert!(!r.leave(&old, 0));
        assert!(!old.has_ended());
        assert!(r.leave(&old, 1));
        assert!(old.has_ended() && reg.fence_generation() > g1, "the end of a retired session wakes the fence's waiter");
    }

    #[test]
    fn one_pool_account_per_reactor() {
        let (_, r) = sessions(2, SessionLimits::NONE);
        let s = r.create(&mut r.admin(), "h", false, 0).ok().unwrap().session;
        let (a0, a1) = (s.pool_account(0).unwrap(), s.pool_account(1).unwrap());
        assert!(!Arc::ptr_eq(a0, a1));
        assert!(s.pool_account(2).is_none());
    }
}
