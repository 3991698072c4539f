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
use std::net::IpAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use arc_swap::ArcSwap;
use rdmablk_common::protocol::{SessionId, VolumeId};

use crate::backend::VolumeSet;
use crate::error::{Error, ErrorKind, Result};
use crate::engine::pool::PoolAccount;
use crate::sys::EventFd;

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
    open: ArcSwap<OpenSet>,
    /// Pool chunks the session holds, one account per reactor (charged by
    /// that reactor's pool only), for `target.session_pool_share`.
    pool_accounts: Box<[Arc<PoolAccount>]>,
    /// A newer session of the same host replaced this one (the reconnect
    /// fence): its queue pairs stop reading and executing.
    retired: AtomicBool,
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

    /// Whether a newer session replaced this one (one load per command).
    #[inline]
    pub fn is_retired(&self) -> bool {
        self.retired.load(Ordering::Acquire)
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

/// The connection limits of `[target]` that the registry enforces.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SessionLimits {
    /// `target.max_sessions`.
    pub max_sessions: u32,
    /// `target.max_queues_per_session`.
    pub max_queues_per_session: u32,
    /// `target.max_handshakes`.
    pub max_handshakes: u32,
    /// `target.max_handshakes_per_address`: of those, most from one source
    /// address, so that one peer cannot keep every other from starting.
    pub max_handshakes_per_address: u32,
    /// `target.max_connections_per_address`: connections (queue pairs, in
    /// their handshake or connected) from one source address at once.
    pub max_connections_per_address: u32,
}

impl SessionLimits {
    /// No limits (library use and unit tests).
    pub const NONE: SessionLimits =
        SessionLimits {
            max_sessions: u32::MAX,
            max_queues_per_session: u32::MAX,
            max_handshakes: u32::MAX,
            max_handshakes_per_address: u32::MAX,
            max_connections_per_address: u32::MAX,
        };
}

/// Counters of the limits, for the metrics endpoint (several writers).
#[derive(Debug, Default)]
pub struct LimitCounters {
    /// Connections accepted and not yet past CONNECT, now.
    pub handshakes: AtomicU64,
    /// Connections dropped because CONNECT did not succeed in time.
    pub handshakes_timed_out: AtomicU64,
    /// Connected queue pairs torn down by `target.idle_timeout`.
    pub idle_timeouts: AtomicU64,
    /// Connections refused because `max_handshakes` were in progress.
    pub refused_handshakes: AtomicU64,
    /// Connections refused because `max_handshakes_per_address` from their
    /// source address were in progress.
    pub refused_handshakes_per_address: AtomicU64,
    /// Connections refused because `max_connections_per_address` from their
    /// source address were open.
    pub refused_connections_per_address: AtomicU64,
    /// CONNECTs refused by `max_sessions`.
    pub refused_sessions: AtomicU64,
    /// Joins refused by `max_queues_per_session`.
    pub refused_queues: AtomicU64,
    /// Sessions retired by the reconnect fence (a newer session replaced them).
    pub fences: AtomicU64,
    /// CONNECTs answered `FenceTimeout`: the replaced session had disk I/O
    /// in flight for longer than `target.fence_timeout`.
    pub fence_timeouts: AtomicU64,
    /// Commands of retired sessions dropped before they reached the disk.
    pub fence_dropped_commands: AtomicU64,
}

/// The protocol a connection speaks: each has its own handshake budget,
/// so that a flood of one cannot keep the other's hosts from starting.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Protocol {
    /// rdmablk v1 (`tcp://`, `rdma://`).
    V1 = 0,
    /// NVMe-oF (`nvme+tcp://`, `nvme+rdma://`).
    Nvme = 1,
}

impl Protocol {
    pub fn name(self) -> &'static str {
        match self {
            Protocol::V1 => "rdmablk",
            Protocol::Nvme => "NVMe-oF",
        }
    }
}

/// One connection in its handshake (accepted, CONNECT not yet successful):
/// counts against its protocol's `max_handshakes` until dropped.
#[derive(Debug)]
pub struct HandshakeSlot {
    registry: Arc<Registry>,
    protocol: Protocol,
    /// The source address it counts against (`None`: not an IP peer).
    address: Option<IpAddr>,
}

impl Drop for HandshakeSlot {
    fn drop(&mut self) {
        self.registry.counters.handshakes.fetch_sub(1, Ordering::AcqRel);
        self.registry.handshakes_of[self.protocol as usize].fetch_sub(1, Ordering::AcqRel);
        if let Some(a) = self.address {
            self.registry.handshakes_by_address[self.protocol as usize].release(a);
        }
    }
}

/// The pool chunks one host (a source address) holds, one account per
/// reactor, for `target.host_pool_share`: every connection from that
/// address shares it, whatever host id its sessions declare.
#[derive(Debug)]
pub struct HostPool {
    accounts: Box<[Arc<PoolAccount>]>,
}

impl HostPool {
    fn new(address: IpAddr, reactors: usize) -> HostPool {
        HostPool { accounts: (0..reactors).map(|_| Arc::new(PoolAccount::named(format!("peer={address}")))).collect() }
    }

    /// The host's account on `reactor`.
    #[inline]
    pub fn account(&self, reactor: usize) -> Option<&Arc<PoolAccount>> {
        self.accounts.get(reactor)
    }
}

/// One open connection from a source address: counts against
/// `max_connections_per_address` until dropped (with its queue pair), and
/// carries that address's pool accounts.
#[derive(Debug)]
pub struct ConnectionSlot {
    registry: Arc<Registry>,
    address: Option<IpAddr>,
    /// `None` when the peer has no IP address.
    host_pool: Option<Arc<HostPool>>,
}

impl ConnectionSlot {
    /// The pool account of this connection's host (source address) on
    /// `reactor`; `None` for a peer without an IP address.
    #[inline]
    pub fn host_pool_account(&self, reactor: usize) -> Option<&Arc<PoolAccount>> {
        self.host_pool.as_ref().and_then(|h| h.account(reactor))
    }
}

impl Drop for ConnectionSlot {
    fn drop(&mut self) {
        if let Some(a) = self.address {
            self.registry.connections_by_address.release(a);
            // The address's accounts are forgotten with its last connection
            // (a newer one holds a clone, taken under the same lock).
            drop(self.host_pool.take());
            let mut pools = self.registry.host_pools.lock().unwrap_or_else(|e| e.into_inner());
            if pools.get(&a).is_some_and(|p| Arc::strong_count(p) == 1) {
                pools.remove(&a);
            }
        }
    }
}

/// Counts by source address, for the per-address limits (taken and given
/// back at accepts and teardowns only, never on the I/O path).
#[derive(Debug, Default)]
struct AddressCounts(Mutex<HashMap<IpAddr, u32>>);

impl AddressCounts {
    fn lock(&self) -> MutexGuard<'_, HashMap<IpAddr, u32>> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Gives back one count of `a` (an address with none left is forgotten).
    fn release(&self, a: IpAddr) {
        let mut by = self.lock();
        if let Some(n) = by.get_mut(&a) {
            *n -= 1;
            if *n == 0 {
                by.remove(&a);
            }
        }
    }
}

/// What a new connection takes: a handshake slot (given back at its first
/// successful CONNECT) and a connection slot (given back with the queue pair).
#[derive(Debug)]
pub struct Admission {
    pub handshake: HandshakeSlot,
    pub connection: ConnectionSlot,
}

/// Why [`Registry::begin_handshake`] refused a connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HandshakeRefusal {
    /// `max_handshakes` connections are in their handshake.
    Total,
    /// `max_handshakes_per_address` of them come from this address.
    PerAddress,
    /// `max_connections_per_address` connections from this address are open.
    ConnectionsPerAddress,
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
    limits: SessionLimits,
    /// What the limits refused, for metrics.
    pub counters: LimitCounters,
    /// Moves whenever a session is retired or a retired session ends, so a
    /// reactor notices with one load per turn.
    fence_generation: AtomicU64,
    /// The reactors' wake-up eventfds: a fence concerns queue pairs on any
    /// reactor, and whoever waits for it.
    wakers: Mutex<Vec<Arc<EventFd>>>,
    /// Loop turns of each reactor, for a barrier: a reactor that turned
    /// has handled what its sockets and completion queues had before.
    turns: Box<[AtomicU64]>,
    /// Connections in their handshake, per protocol, and by source address.
    handshakes_of: [AtomicU64; 2],
    handshakes_by_address: [AddressCounts; 2],
    /// Open connections by source address.
    connections_by_address: AddressCounts,
    /// The pool accounts of each source address with open connections.
    host_pools: Mutex<HashMap<IpAddr, Arc<HostPool>>>,
}

impl std::fmt::Debug for Registry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Registry").field("reactors", &self.reactors).field("limits", &self.limits).finish_non_exhaustive()
    }
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
            limits: SessionLimits::NONE,
            counters: LimitCounters::default(),
            fence_generation: AtomicU64::new(0),
            wakers: Mutex::new(Vec::new()),
            turns: (0..reactors).map(|_| AtomicU64::new(0)).collect(),
            handshakes_of: [AtomicU64::new(0), AtomicU64::new(0)],
            handshakes_by_address: [AddressCounts::default(), AddressCounts::default()],
            connections_by_address: AddressCounts::default(),
            host_pools: Mutex::new(HashMap::new()),
        }
    }

    /// Registers a reactor's wake-up eventfd (at its start).
    pub fn add_waker(&self, wake: Arc<EventFd>) {
        self.wakers.lock().unwrap_or_else(|e| e.into_inner()).push(wake);
    }

    /// The fence generation: one load per reactor turn.
    #[inline]
    pub fn fence_generation(&self) -> u64 {
        self.fence_generation.load(Ordering::Acquire)
    }

    /// Moves the fence generation and wakes every reactor: something a
    /// front end's queues on any reactor must act on changed (a session
    /// retired or ended, a controller torn down or gone).
    pub fn fence_moved(&self) {
        self.fence_generation.fetch_add(1, Ordering::AcqRel);
        self.wake_reactors();
    }

    /// Wakes every reactor for one loop turn.
    pub fn wake_reactors(&self) {
        for w in self.wakers.lock().unwrap_or_else(|e| e.into_inner()).iter() {
            w.notify();
        }
    }

    /// The number of reactors.
    pub fn reactors(&self) -> usize {
        self.reactors
    }

    /// Reactor `reactor` turned once more (one relaxed store per turn).
    #[inline]
    pub fn turned(&self, reactor: usize) {
        if let Some(t) = self.turns.get(reactor) {
            t.store(t.load(Ordering::Relaxed) + 1, Ordering::Release);
        }
    }

    /// Each reactor's turns so far.
    pub fn turns(&self) -> impl Iterator<Item = u64> + '_ {
        self.turns.iter().map(|t| t.load(Ordering::Acquire))
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
            self.counters.fences.fetch_add(1, Ordering::Relaxed);
        }
        self.fence_moved();
        Ok(Some(shared))
    }

    /// The same registry, enforcing `limits`.
    pub fn with_limits(mut self, limits: SessionLimits) -> Registry {
        self.limits = limits;
        self
    }

    /// The limits in force.
    pub fn limits(&self) -> SessionLimits {
        self.limits
    }

    /// Takes a handshake slot of `protocol` for a new connection from
    /// `from` (its source address, when it has one), unless
    /// `max_connections_per_address` connections from that address are
    /// open, or `max_handshakes` connections of the protocol, or
    /// `max_handshakes_per_address` of it from that address, are in their
    /// handshake already. Each protocol has its own handshake budget.
    /// Counts the refusal.
    pub fn begin_handshake(self: &Arc<Self>, protocol: Protocol, from: Option<IpAddr>) -> std::result::Result<Admission, HandshakeRefusal> {
        let p = protocol as usize;
        // Slots are taken only here, under these locks, so the checks and
        // the increments cannot interleave with another taker (drops only free).
        let mut by = self.handshakes_by_address[p].lock();
        let mut open = self.connections_by_address.lock();
        if let Some(a) = from {
            if open.get(&a).copied().unwrap_or(0) >= self.limits.max_connections_per_address {
                self.counters.refused_connections_per_address.fetch_add(1, Ordering::Relaxed);
                return Err(HandshakeRefusal::ConnectionsPerAddress);
            }
        }
        if self.handshakes_of[p].load(Ordering::Acquire) >= self.limits.max_handshakes as u64 {
            self.counters.refused_handshakes.fetch_add(1, Ordering::Relaxed);
            return Err(HandshakeRefusal::Total);
        }
        if let Some(a) = from {
            let n = by.entry(a).or_insert(0);
            if *n >= self.limits.max_handshakes_per_address {
                self.counters.refused_handshakes_per_address.fetch_add(1, Ordering::Relaxed);
                return Err(HandshakeRefusal::PerAddress);
            }
            *n += 1;
        }
        self.handshakes_of[p].fetch_add(1, Ordering::AcqRel);
        self.counters.handshakes.fetch_add(1, Ordering::AcqRel);
        let host_pool = from.map(|a| {
            *open.entry(a).or_insert(0) += 1;
            let mut pools = self.host_pools.lock().unwrap_or_else(|e| e.into_inner());
            Arc::clone(pools.entry(a).or_insert_with(|| Arc::new(HostPool::new(a, self.reactors))))
        });
        Ok(Admission {
            handshake: HandshakeSlot { registry: Arc::clone(self), protocol, address: from },
            connection: ConnectionSlot { registry: Arc::clone(self), address: from, host_pool },
        })
    }

    /// The refusal of [`Registry::begin_handshake`] in words (with the key
    /// that set the limit), for logs.
    pub fn refusal_reason(&self, protocol: Protocol, why: HandshakeRefusal) -> String {
        let l = &self.limits;
        match why {
            HandshakeRefusal::Total => format!(
                "{n} {} connections are in their handshake (target.max_handshakes = {n})",
                protocol.name(),
                n = l.max_handshakes
            ),
            HandshakeRefusal::PerAddress => format!(
                "{n} {} connections from its address are in their handshake (target.max_handshakes_per_address = {n})",
                protocol.name(),
                n = l.max_handshakes_per_address
            ),
            HandshakeRefusal::ConnectionsPerAddress => {
                format!("{n} connections from its address are open (target.max_connections_per_address = {n})", n = l.max_connections_per_address)
            }
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

    /// Creates a session for `host_id` (CONNECT with session id 0), unless
    /// `max_sessions` sessions exist.
    pub fn create(&self, admin: &mut Admin, host_id: &str, reactor: usize) -> Result<Joined> {
        if admin.sessions.len() >= self.limits.max_sessions as usize {
            self.counters.refused_sessions.fetch_add(1, Ordering::Relaxed);
            return Err(Error::new(
                ErrorKind::LimitReached,
                format!(
                    "host {host_id:?} asked for a new session; {} sessions exist (target.max_sessions = {})",
                    admin.sessions.len(),
                    self.limits.max_sessions
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
            open: ArcSwap::from_pointee(OpenSet::default()),
            pool_accounts: (0..self.reactors).map(|_| Arc::new(PoolAccount::named(format!("host={host_id} session={:#x}", id.0)))).collect(),
            retired: AtomicBool::new(false),
            ended: AtomicBool::new(false),
            dropped: AtomicU64::new(0),
        });
        let mut queue_pairs = vec![0; self.reactors];
        queue_pairs[reactor] = 1;
        admin.sessions.insert(id, SessionEntry { shared: Arc::clone(&shared), next_queue: 1, queue_pairs });
        Ok(Joined { session: shared, queue_index: 0, created: true })
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
            self.counters.refused_queues.fetch_add(1, Ordering::Relaxed);
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
            drop(admin);
            session.ended.store(true, Ordering::Release);
            if session.is_retired() {
                // Whoever waits for this fence is woken.
                self.fence_moved();
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
    fn create_join_leave() {
        let r = Registry::new(VolumeSet::new(1, Vec::new()), 2);
        let a = {
            let mut admin = r.admin();
            r.create(&mut admin, "host-a", 0).ok().unwrap()
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
        let limits = SessionLimits { max_sessions: 2, max_queues_per_session: 2, max_handshakes: 2, ..SessionLimits::NONE };
        let r = Arc::new(Registry::new(VolumeSet::new(1, Vec::new()), 2).with_limits(limits));
        let (a, _b) = {
            let mut admin = r.admin();
            (r.create(&mut admin, "a", 0).ok().unwrap(), r.create(&mut admin, "b", 1).ok().unwrap())
        };
        {
            let mut admin = r.admin();
            let e = r.create(&mut admin, "c", 0).err().unwrap();
            assert_eq!(e.kind(), ErrorKind::LimitReached);
            assert!(e.to_string().contains("target.max_sessions = 2"), "{e}");
            assert!(r.join(&mut admin, a.session.id, "a", 1).is_ok(), "the second queue pair fits");
            let e = r.join(&mut admin, a.session.id, "a", 0).err().unwrap();
            assert_eq!(e.kind(), ErrorKind::LimitReached);
            assert!(e.to_string().contains("target.max_queues_per_session = 2"), "{e}");
        }
        assert_eq!(r.counters.refused_sessions.load(Ordering::Relaxed), 1);
        assert_eq!(r.counters.refused_queues.load(Ordering::Relaxed), 1);
        // A queue pair leaving makes room for another join.
        assert!(!r.leave(&a.session, 1));
        assert!(r.join(&mut r.admin(), a.session.id, "a", 1).is_ok());

        // Handshake slots: two at once, released on drop.
        let h1 = r.begin_handshake(Protocol::V1, None).expect("first").handshake;
        let h2 = r.begin_handshake(Protocol::V1, None).expect("second").handshake;
        assert_eq!(r.begin_handshake(Protocol::V1, None).err(), Some(HandshakeRefusal::Total), "a third is over max_handshakes");
        drop(h1);
        let h3 = r.begin_handshake(Protocol::V1, None).expect("a slot came back").handshake;
        assert_eq!(r.counters.handshakes.load(Ordering::Relaxed), 2);
        drop((h2, h3));
        assert_eq!(r.counters.handshakes.load(Ordering::Relaxed), 0);
    }

    #[test]
    fn retiring_a_session_stops_joins_and_ends_with_its_last_queue_pair() {
        let r = Registry::new(VolumeSet::new(1, Vec::new()), 2);
        let wake = Arc::new(EventFd::new().unwrap());
        r.add_waker(Arc::clone(&wake));
        let old = r.create(&mut r.admin(), "h", 0).ok().unwrap().session;
        r.join(&mut r.admin(), old.id, "h", 1).ok().unwrap();
        let g0 = r.fence_generation();
        // Another host cannot retire it; an unknown id is nothing to wait for.
        assert_eq!(r.retire(&mut r.admin(), old.id, "other").err().unwrap().kind(), ErrorKind::UnknownSession);
        assert!(r.retire(&mut r.admin(), SessionId(old.id.0 ^ 1), "h").unwrap().is_none());
        assert!(!old.is_retired() && r.fence_generation() == g0);
        let got = r.retire(&mut r.admin(), old.id, "h").unwrap().expect("the session exists");
        assert!(Arc::ptr_eq(&got, &old) && old.is_retired() && !old.has_ended());
        assert!(r.fence_generation() > g0 && wake.drain(), "every reactor is told");
        assert_eq!(r.counters.fences.load(Ordering::Relaxed), 1);
        let e = r.join(&mut r.admin(), old.id, "h", 0).err().unwrap();
        assert_eq!(e.kind(), ErrorKind::UnknownSession, "a retired session takes no new queue pairs");
        let g1 = r.fence_generation();
        assert!(!r.leave(&old, 0));
        assert!(!old.has_ended());
        assert!(r.leave(&old, 1));
        assert!(old.has_ended() && r.fence_generation() > g1, "the end of a retired session wakes the fence's waiter");
    }

    #[test]
    fn handshakes_are_bounded_per_source_address_too() {
        let limits = SessionLimits { max_handshakes: 4, max_handshakes_per_address: 2, ..SessionLimits::NONE };
        // (An admission's connection slot is held with its handshake slot here.)
        let r = Arc::new(Registry::new(VolumeSet::new(1, Vec::new()), 1).with_limits(limits));
        let (a, b): (IpAddr, IpAddr) = ("127.0.0.2".parse().unwrap(), "127.0.0.1".parse().unwrap());
        let a1 = r.begin_handshake(Protocol::V1, Some(a)).unwrap();
        let _a2 = r.begin_handshake(Protocol::V1, Some(a)).unwrap();
        assert_eq!(r.begin_handshake(Protocol::V1, Some(a)).err(), Some(HandshakeRefusal::PerAddress));
        let _b1 = r.begin_handshake(Protocol::V1, Some(b)).expect("another address still starts");
        drop(a1);
        let _a3 = r.begin_handshake(Protocol::V1, Some(a)).expect("a slot of that address came back");
        let _b2 = r.begin_handshake(Protocol::V1, Some(b)).unwrap();
        let c: IpAddr = "10.0.0.3".parse().unwrap();
        assert_eq!(r.begin_handshake(Protocol::V1, Some(c)).err(), Some(HandshakeRefusal::Total), "the total still holds");
        assert_eq!(r.counters.refused_handshakes_per_address.load(Ordering::Relaxed), 1);
        assert_eq!(r.counters.refused_handshakes.load(Ordering::Relaxed), 1);
    }

    #[test]
    fn each_protocol_has_its_own_handshake_budget() {
        let limits = SessionLimits { max_handshakes: 3, max_handshakes_per_address: 2, ..SessionLimits::NONE };
        let r = Arc::new(Registry::new(VolumeSet::new(1, Vec::new()), 1).with_limits(limits));
        let a: IpAddr = "127.0.0.2".parse().unwrap();
        // NVMe-oF connections that never finish their handshake take every
        // NVMe-oF slot, of the address and in total...
        let mut flood: Vec<_> = (0..2).map(|_| r.begin_handshake(Protocol::Nvme, Some(a)).unwrap()).collect();
        assert_eq!(r.begin_handshake(Protocol::Nvme, Some(a)).err(), Some(HandshakeRefusal::PerAddress));
        flood.push(r.begin_handshake(Protocol::Nvme, None).unwrap());
        assert_eq!(r.begin_handshake(Protocol::Nvme, None).err(), Some(HandshakeRefusal::Total));
        // ...and none of rdmablk v1's, from the same address or another.
        let v1 = r.begin_handshake(Protocol::V1, Some(a)).expect("v1 starts beside an NVMe-oF flood");
        let _v1b = r.begin_handshake(Protocol::V1, None).expect("and another");
        assert_eq!(r.counters.handshakes.load(Ordering::Relaxed), 5, "the gauge counts both");
        drop((flood, v1));
        assert_eq!(r.counters.handshakes.load(Ordering::Relaxed), 1);
        assert!(r.begin_handshake(Protocol::Nvme, Some(a)).is_ok(), "NVMe-oF slots came back");
    }

    #[test]
    fn connections_are_bounded_per_source_address_for_as_long_as_they_live() {
        let limits = SessionLimits { max_connections_per_address: 2, ..SessionLimits::NONE };
        let r = Arc::new(Registry::new(VolumeSet::new(1, Vec::new()), 1).with_limits(limits));
        let a: IpAddr = "127.0.0.2".parse().unwrap();
        let first = r.begin_handshake(Protocol::V1, Some(a)).unwrap();
        let second = r.begin_handshake(Protocol::V1, Some(a)).unwrap();
        // Past their handshakes (a CONNECT succeeded), they still count.
        drop((first.handshake, second.handshake));
        assert_eq!(r.begin_handshake(Protocol::V1, Some(a)).err(), Some(HandshakeRefusal::ConnectionsPerAddress));
        assert!(r.begin_handshake(Protocol::V1, Some("127.0.0.1".parse().unwrap())).is_ok(), "another address connects");
        drop(first.connection);
        assert!(r.begin_handshake(Protocol::V1, Some(a)).is_ok(), "a closed connection gives its slot back");
        assert_eq!(r.counters.refused_connections_per_address.load(Ordering::Relaxed), 1);
    }

    #[test]
    fn connections_from_one_address_share_its_pool_accounts_while_any_is_open() {
        let r = Arc::new(Registry::new(VolumeSet::new(1, Vec::new()), 2));
        let (a, b): (IpAddr, IpAddr) = ("127.0.0.2".parse().unwrap(), "127.0.0.1".parse().unwrap());
        let a1 = r.begin_handshake(Protocol::V1, Some(a)).unwrap().connection;
        let a2 = r.begin_handshake(Protocol::V1, Some(a)).unwrap().connection;
        let b1 = r.begin_handshake(Protocol::V1, Some(b)).unwrap().connection;
        let none = r.begin_handshake(Protocol::V1, None).unwrap().connection;
        assert!(Arc::ptr_eq(a1.host_pool_account(1).unwrap(), a2.host_pool_account(1).unwrap()), "one address, one account");
        assert!(!Arc::ptr_eq(a1.host_pool_account(0).unwrap(), a1.host_pool_account(1).unwrap()), "one per reactor");
        assert!(!Arc::ptr_eq(a1.host_pool_account(0).unwrap(), b1.host_pool_account(0).unwrap()), "another address, another");
        assert!(a1.host_pool_account(2).is_none() && none.host_pool_account(0).is_none());
        let before = Arc::clone(a1.host_pool_account(0).unwrap());
        drop(a1);
        let a3 = r.begin_handshake(Protocol::V1, Some(a)).unwrap().connection;
        assert!(Arc::ptr_eq(&before, a3.host_pool_account(0).unwrap()), "kept while a connection of the address is open");
        drop((a2, a3));
        assert!(!r.host_pools.lock().unwrap().contains_key(&a), "forgotten with the address's last connection");
        assert!(r.host_pools.lock().unwrap().contains_key(&b));
        drop(b1);
        assert!(r.host_pools.lock().unwrap().is_empty());
    }

    #[test]
    fn one_pool_account_per_reactor() {
        let r = Registry::new(VolumeSet::new(1, Vec::new()), 2);
        let s = r.create(&mut r.admin(), "h", 0).ok().unwrap().session;
        let (a0, a1) = (s.pool_account(0).unwrap(), s.pool_account(1).unwrap());
        assert!(!Arc::ptr_eq(a0, a1));
        assert!(s.pool_account(2).is_none());
    }
}
