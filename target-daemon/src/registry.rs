//! What the reactors and the control thread share, whatever protocol their
//! queues speak: the published volume set, the connection admission (the
//! handshake budgets of each protocol, connections per source address, the
//! pool accounts of each address), the reactors' wake-ups and turn counts,
//! and the fence generation that tells every reactor that another queue's
//! association changed (a session retired, a controller torn down).
//!
//! The per-I/O path takes no lock: a reactor checks a command against its
//! own snapshot of the volume set, refreshed when the generation (one
//! atomic load) moved. The locks here are taken at accepts and teardowns.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use crate::backend::{Publication, VolumeSet};
use crate::engine::pool::PoolAccount;
pub use crate::metrics::LimitCounters;
use crate::sys::EventFd;

/// The connection limits of `[target]` the registry enforces.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AdmissionLimits {
    /// `target.max_handshakes`, each protocol's.
    pub max_handshakes: u32,
    /// `target.max_handshakes_per_address`: of those, most from one source
    /// address, so that one peer cannot keep every other from starting.
    pub max_handshakes_per_address: u32,
    /// `target.max_connections_per_address`: connections (queue pairs, in
    /// their handshake or connected, any protocol) from one source address.
    pub max_connections_per_address: u32,
}

impl AdmissionLimits {
    /// No limits (library use and unit tests).
    pub const NONE: AdmissionLimits =
        AdmissionLimits { max_handshakes: u32::MAX, max_handshakes_per_address: u32::MAX, max_connections_per_address: u32::MAX };
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

/// The state reactors and the control thread share.
pub struct Registry {
    publication: Arc<Publication>,
    reactors: usize,
    limits: AdmissionLimits,
    /// What the limits refused, for metrics.
    pub counters: LimitCounters,
    /// Moves whenever an association changed that queues on any reactor
    /// must act on (a session retired or ended, a controller torn down or
    /// gone), so a reactor notices with one load per turn.
    fence_generation: AtomicU64,
    /// The reactors' wake-up eventfds: a fence concerns queues on any
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
        Registry {
            publication: Arc::new(Publication::new(volumes)),
            reactors,
            limits: AdmissionLimits::NONE,
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

    /// The same registry, enforcing `limits`.
    pub fn with_limits(mut self, limits: AdmissionLimits) -> Registry {
        self.limits = limits;
        self
    }

    /// The published volume set, for whoever follows it (the reactors'
    /// executors).
    pub fn publication(&self) -> &Arc<Publication> {
        &self.publication
    }

    /// Publishes a new volume set. The caller holds the locks of the front
    /// ends that must not see the old set after its checks (v1's session
    /// table lock, so that no OPEN slips in).
    pub fn publish(&self, set: VolumeSet) {
        self.publication.publish(set);
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

    /// Each reactor's turns so far, in reactor order ([`Registry::reactors`] of them).
    pub fn turns(&self) -> impl Iterator<Item = u64> + '_ {
        self.turns.iter().map(|t| t.load(Ordering::Acquire))
    }

    /// The limits in force.
    pub fn limits(&self) -> AdmissionLimits {
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

    /// Generation of the published volume set: one load.
    #[inline]
    pub fn generation(&self) -> u64 {
        self.publication.generation()
    }

    /// The published volume set.
    pub fn volumes(&self) -> Arc<VolumeSet> {
        self.publication.volumes()
    }
}


/// The registry's generations a front end last acted on: each turn it
/// asks [`Seen::news`] what moved since.
#[derive(Clone, Copy, Debug, Default)]
pub struct Seen {
    fences: u64,
    volumes: u64,
}

/// What moved since a front end's last turn: the fence (a controller or
/// session torn down or gone) and the published volume set.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct News {
    pub fences: bool,
    pub volumes: bool,
}

impl Seen {
    /// What moved since the last call; two loads.
    #[inline]
    pub fn news(&mut self, registry: &Registry) -> News {
        let now = Seen { fences: registry.fence_generation(), volumes: registry.generation() };
        let news = News { fences: now.fences != self.fences, volumes: now.volumes != self.volumes };
        *self = now;
        news
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn handshake_slots_come_back_when_dropped() {
        let limits = AdmissionLimits { max_handshakes: 2, ..AdmissionLimits::NONE };
        let r = Arc::new(Registry::new(VolumeSet::new(1, Vec::new()), 2).with_limits(limits));
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
    fn handshakes_are_bounded_per_source_address_too() {
        let limits = AdmissionLimits { max_handshakes: 4, max_handshakes_per_address: 2, ..AdmissionLimits::NONE };
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
        let limits = AdmissionLimits { max_handshakes: 3, max_handshakes_per_address: 2, ..AdmissionLimits::NONE };
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
        let limits = AdmissionLimits { max_connections_per_address: 2, ..AdmissionLimits::NONE };
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
}
