//! State shared between reactors: the published set of volumes and the
//! sessions (a host's queue pairs, which may live on different reactors).
//!
//! The per-I/O path takes no lock. A reactor checks a command against its
//! own snapshot of the volume set (refreshed when the generation changes)
//! and against the session's opened set, an [`ArcSwap`] snapshot read
//! lock-free. The admin lock ([`Registry::admin`]) is taken only by
//! CONNECT, OPEN, CLOSE, queue pair teardown, metrics scrapes and reloads,
//! so that a reload's "is this volume open anywhere?" and an OPEN of that
//! volume cannot interleave.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use arc_swap::ArcSwap;
use rdmablk_common::protocol::{SessionId, VolumeId};

use crate::backend::VolumeSet;
use crate::error::{Error, ErrorKind, Result};

/// The volumes a session has opened, by id (a bitmap).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct OpenSet {
    bits: Vec<u64>,
}

impl OpenSet {
    /// Nothing open (a queue pair before CONNECT).
    pub const EMPTY: OpenSet = OpenSet { bits: Vec::new() };

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
        OpenSet { bits }
    }

    /// A copy with `id` removed.
    pub fn without(&self, id: VolumeId) -> OpenSet {
        let i = id.0 as usize;
        let mut bits = self.bits.clone();
        if let Some(w) = bits.get_mut(i / 64) {
            *w &= !(1 << (i % 64));
        }
        OpenSet { bits }
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
    open: ArcSwap<OpenSet>,
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

    /// Marks `id` closed. Call with the admin lock held.
    pub fn mark_closed(&self, _admin: &Admin, id: VolumeId) {
        let cur = self.open.load_full();
        self.open.store(Arc::new(cur.without(id)));
    }
}

struct SessionEntry {
    shared: Arc<SharedSession>,
    next_queue: u32,
    /// Live queue pairs per reactor.
    queue_pairs: Vec<u32>,
}

/// What the admin lock guards.
pub struct Admin {
    sessions: HashMap<SessionId, SessionEntry>,
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

/// The state reactors and the control thread share.
pub struct Registry {
    volumes: ArcSwap<VolumeSet>,
    generation: AtomicU64,
    admin: Mutex<Admin>,
    reactors: usize,
}

impl Registry {
    /// A registry publishing `volumes`, for `reactors` reactors.
    pub fn new(volumes: VolumeSet, reactors: usize) -> Registry {
        let generation = AtomicU64::new(volumes.generation);
        Registry {
            volumes: ArcSwap::from_pointee(volumes),
            generation,
            admin: Mutex::new(Admin { sessions: HashMap::new() }),
            reactors,
        }
    }

    /// Takes the admin lock (never on the per-I/O path).
    pub fn admin(&self) -> MutexGuard<'_, Admin> {
        self.admin.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Generation of the published volume set: one relaxed load per loop turn.
    #[inline]
    pub fn generation(&self) -> u64 {
        self.generation.load(Ordering::Acquire)
    }

    /// The published volume set.
    pub fn volumes(&self) -> Arc<VolumeSet> {
        self.volumes.load_full()
    }

    /// Publishes a new volume set. Call with the admin lock held, so that no
    /// OPEN sees the old set after the caller's checks.
    pub fn publish(&self, _admin: &Admin, set: VolumeSet) {
        let generation = set.generation;
        self.volumes.store(Arc::new(set));
        self.generation.store(generation, Ordering::Release);
    }

    /// Creates a session for `host_id` (CONNECT with session id 0).
    pub fn create(&self, admin: &mut Admin, host_id: &str, reactor: usize) -> Joined {
        let id = loop {
            let id = SessionId(rand::random());
            if id.0 != 0 && !admin.sessions.contains_key(&id) {
                break id;
            }
        };
        let shared = Arc::new(SharedSession { id, host_id: host_id.to_owned(), open: ArcSwap::from_pointee(OpenSet::default()) });
        let mut queue_pairs = vec![0; self.reactors];
        queue_pairs[reactor] = 1;
        admin.sessions.insert(id, SessionEntry { shared: Arc::clone(&shared), next_queue: 1, queue_pairs });
        Joined { session: shared, queue_index: 0, created: true }
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
            true
        } else {
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn open_sets() {
        let s = OpenSet::default();
        assert!(s.is_empty() && !s.contains(VolumeId(3)));
        let s = s.with(VolumeId(3)).with(VolumeId(130));
        assert!(s.contains(VolumeId(3)) && s.contains(VolumeId(130)) && !s.contains(VolumeId(4)));
        assert_eq!(s.ids().collect::<Vec<_>>(), vec![VolumeId(3), VolumeId(130)]);
        let s = s.without(VolumeId(3)).without(VolumeId(999));
        assert_eq!(s.ids().collect::<Vec<_>>(), vec![VolumeId(130)]);
    }

    #[test]
    fn create_join_leave() {
        let r = Registry::new(VolumeSet::new(1, Vec::new()), 2);
        let a = {
            let mut admin = r.admin();
            r.create(&mut admin, "host-a", 0)
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
}
