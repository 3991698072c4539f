//! Type-2B memory windows: `ibv_alloc_mw(IBV_MW_TYPE_2)`, bound with an
//! `IBV_WR_BIND_MW` work request and invalidated with `IBV_WR_LOCAL_INV`,
//! both on the queue pair whose peer may use the window.
//!
//! # Ordering, not waiting
//!
//! A bind and an invalidation are work requests: they take effect when the
//! device reaches them in the send queue, in order with the queue pair's
//! other work requests. So a SEND posted after `bind_window` reaches the
//! peer only once the window is valid, and a window can be rebound right
//! after its invalidation is posted. Neither is signaled unless the caller
//! asks ([`QueuePair::invalidate_window`](crate::fabric::QueuePair::invalidate_window)):
//! an unsignaled work request still reports an error, which moves the queue
//! pair to the error state.
//!
//! # Keys
//!
//! A type-2 window's rkey is the device's 24-bit window index and an 8-bit
//! key the binder chooses. Every bind moves the key on by one from the one
//! the device gave at allocation, and free windows are reused oldest first,
//! so an rkey named by an earlier command comes back only after 256 binds
//! of that same window. That is the device's limit; the tcp provider draws
//! 31 random bits.
//!
//! # Invalidated by the peer
//!
//! A peer's SEND with Invalidate may end a window on the device's side
//! (`IBV_WC_WITH_INV` in the receive completion). Such a window must never
//! be invalidated again: rxe (Linux 6.12) dereferences the window's
//! cleared region and queue pair pointers on a second invalidation and the
//! kernel panics, in the NVMe/RDMA host test and by `LOCAL_INV` alike. So
//! the completion queue reports every such key to the receiving queue
//! pair's pool as it translates the completion, before the application
//! sees it, and the window's drop, `invalidate_window` or
//! `window_invalidated_by_peer` then only takes it back: free for the next
//! bind (the device has it FREE, as after a local invalidation) and its
//! region released at once. A key that is no window bound here (a peer on
//! a device that skips the queue pair check, as rxe does) is not recorded.
//! What is not guarded against: dropping a window the peer is still about
//! to invalidate (its SEND not yet received, or not yet polled); a host
//! waits for the command's answer first, as NVMe/RDMA hosts do.
//!
//! # Lifetimes
//!
//! The device refuses to deregister a region while windows are bound over
//! it. A window therefore keeps its region alive until the invalidation has
//! executed, which the send queue's head tells (every slot before the head
//! has completed), and the pool deallocates its windows before the queue
//! pair's regions can go.

use std::collections::{HashMap, HashSet, VecDeque};
use std::ptr::NonNull;
use std::sync::{Arc, Mutex, Weak};

use rdma_mummy_sys as sys;
use sideway::ibverbs::memory_region::MemoryRegion;
use sideway::ibverbs::protection_domain::ProtectionDomain;

use crate::fabric::{lock, Access, FabricError, FabricErrorKind, Result, Rkey};

/// A region that windows may be bound over, as the domain registered it.
pub(crate) struct BindableRegion {
    pub(crate) mr: Weak<MemoryRegion>,
    pub(crate) rkey: u32,
    pub(crate) addr: u64,
    pub(crate) len: u64,
    pub(crate) access: Access,
}

impl BindableRegion {
    fn covers(&self, addr: u64, len: u64) -> bool {
        addr >= self.addr && addr.checked_add(len).is_some_and(|end| end <= self.addr + self.len)
    }
}

/// The domain's regions registered with `MW_BIND`, by lkey. Not by rkey:
/// a region with no remote right of its own may have none (rxe gives them
/// all rkey 0), so a bind finds its parent by rkey and address.
pub(crate) type BindableRegions = Arc<Mutex<HashMap<u32, BindableRegion>>>;

/// A window the queue pair owns; it is either bound (a `VerbsWindow` holds
/// it) or free in the pool. Its `ibv_mw.rkey` is the rkey of its last bind:
/// the device checks the next bind against it.
struct PooledWindow {
    mw: NonNull<sys::ibv_mw>,
}

/// What a bind needs from the pool: the window and its next rkey.
pub(crate) struct Lease {
    pub(crate) mw: NonNull<sys::ibv_mw>,
    pub(crate) rkey: u32,
}

/// One queue pair's memory windows.
pub(crate) struct WindowPool {
    pd: Arc<ProtectionDomain>,
    regions: BindableRegions,
    /// Every window allocated, for deallocation.
    all: Vec<NonNull<sys::ibv_mw>>,
    /// Free windows, oldest first.
    free: VecDeque<PooledWindow>,
    /// Regions whose windows were invalidated by the work request at this
    /// absolute send-queue index; released once the head has passed it.
    /// `u64::MAX`: never executed (the queue pair failed); released with the pool.
    retired: Vec<(u64, Arc<MemoryRegion>)>,
    /// The rkeys of the windows bound now.
    bound: HashSet<u32>,
    /// Bound windows whose rkey a peer's SEND with Invalidate ended (a
    /// receive completion reported it): their owner's drop posts nothing.
    peer_invalidated: HashSet<u32>,
}

// SAFETY: the window pointers are owned by this pool and only passed to
// libibverbs calls, which are thread-safe; the pool is used under a mutex.
unsafe impl Send for WindowPool {}

impl WindowPool {
    pub(crate) fn new(pd: Arc<ProtectionDomain>, regions: BindableRegions) -> WindowPool {
        WindowPool {
            pd,
            regions,
            all: Vec::new(),
            free: VecDeque::new(),
            retired: Vec::new(),
            bound: HashSet::new(),
            peer_invalidated: HashSet::new(),
        }
    }

    /// Checks a bind against the parent region and returns the region and
    /// the device's bind access flags.
    pub(crate) fn parent(&self, parent: Rkey, addr: u64, len: u64, access: Access) -> Result<(Arc<MemoryRegion>, u32)> {
        crate::fabric::check_window_access(access, len)?;
        let invalid = |why: String| Err(FabricError::new(FabricErrorKind::InvalidArgument, format!("bind_window: {why}")));
        let regions = lock(&self.regions);
        let Some(region) = regions.values().find(|r| r.rkey == parent.0 && r.covers(addr, len)) else {
            // Only on the error path: which of the two rules failed.
            if regions.values().any(|r| r.rkey == parent.0) {
                return invalid(format!("[{addr:#x}, +{len}) is not inside the region"));
            }
            return invalid(format!("no region with rkey {:#x} registered with MW_BIND", parent.0));
        };
        if access.contains(Access::REMOTE_WRITE) && !region.access.contains(Access::LOCAL_WRITE) {
            return invalid("REMOTE_WRITE over a region without LOCAL_WRITE".to_owned());
        }
        let Some(mr) = region.mr.upgrade() else {
            return invalid(format!("the region with rkey {:#x} was deregistered", parent.0));
        };
        let mut flags = 0;
        if access.contains(Access::REMOTE_READ) {
            flags |= sys::ibv_access_flags::IBV_ACCESS_REMOTE_READ.0;
        }
        if access.contains(Access::REMOTE_WRITE) {
            flags |= sys::ibv_access_flags::IBV_ACCESS_REMOTE_WRITE.0;
        }
        Ok((mr, flags))
    }

    /// A free window (allocating one when none is free) and the rkey its
    /// next bind gives it. The caller posts the bind, or hands the lease
    /// back with [`WindowPool::abandon`].
    pub(crate) fn lease(&mut self) -> Result<Lease> {
        let w = match self.free.pop_front() {
            Some(w) => w,
            None => {
                // SAFETY: the PD is live (held by this pool, which outlives
                // every window it allocates).
                let raw = unsafe { sys::ibv_alloc_mw(self.pd.pd().as_ptr(), sys::ibv_mw_type::IBV_MW_TYPE_2) };
                let Some(mw) = NonNull::new(raw) else {
                    return Err(FabricError::io("ibv_alloc_mw(type 2)".to_owned(), std::io::Error::last_os_error()));
                };
                self.all.push(mw);
                PooledWindow { mw }
            }
        };
        // SAFETY: `mw` is a live window of this pool.
        let current = unsafe { w.mw.as_ref().rkey };
        Ok(Lease { mw: w.mw, rkey: (current & !0xff) | (current.wrapping_add(1) & 0xff) })
    }

    /// The bind of `lease` was posted: the window's rkey is the new one
    /// from now on (libibverbs leaves tracking it to the binder).
    pub(crate) fn bound(&mut self, lease: &Lease) {
        // SAFETY: a live window of this pool, bound by nobody else: it left
        // the free list in `lease`.
        unsafe { (*lease.mw.as_ptr()).rkey = lease.rkey };
        self.bound.insert(lease.rkey);
        // An old report of this key (its window's 256th bind ago) is moot.
        self.peer_invalidated.remove(&lease.rkey);
    }

    /// A lease whose bind was not posted: the window is free again, and
    /// its rkey did not move.
    pub(crate) fn abandon(&mut self, lease: Lease) {
        self.free.push_front(PooledWindow { mw: lease.mw });
    }

    /// A bound window's invalidation was posted at send-queue index `abs`
    /// (`None`: it could not be posted; the queue pair has failed and the
    /// window stays bound to a dead queue pair until the pool goes).
    pub(crate) fn give_back(&mut self, mw: NonNull<sys::ibv_mw>, mr: Arc<MemoryRegion>, abs: Option<u64>) {
        // SAFETY: a live window of this pool; its rkey is the last bind's.
        self.bound.remove(&unsafe { mw.as_ref().rkey });
        self.retired.push((abs.unwrap_or(u64::MAX), mr));
        if abs.is_some() {
            self.free.push_back(PooledWindow { mw });
        }
    }

    /// A receive completion of this queue pair reported that the peer's
    /// SEND with Invalidate ended `rkey`. Recorded if it is a window bound
    /// here (see the module docs).
    pub(crate) fn invalidated_by_peer(&mut self, rkey: u32) {
        if self.bound.remove(&rkey) {
            self.peer_invalidated.insert(rkey);
        }
    }

    /// Whether the peer ended the bound window `rkey`; if so the window is
    /// forgotten as bound, and the caller hands it back with
    /// [`WindowPool::invalidated_remotely`] instead of invalidating it.
    pub(crate) fn take_peer_invalidated(&mut self, rkey: u32) -> bool {
        self.peer_invalidated.remove(&rkey)
    }

    /// A bound window the peer invalidated: free for the next bind at
    /// once, its region (which the caller drops) no longer held.
    pub(crate) fn invalidated_remotely(&mut self, mw: NonNull<sys::ibv_mw>) {
        self.free.push_back(PooledWindow { mw });
    }

    /// Releases the regions whose invalidations have executed: every send
    /// slot before `sq_head` has completed.
    pub(crate) fn release_retired(&mut self, sq_head: u64) {
        self.retired.retain(|(abs, _)| *abs >= sq_head);
    }
}

impl Drop for WindowPool {
    fn drop(&mut self) {
        for mw in self.all.drain(..) {
            // SAFETY: allocated by ibv_alloc_mw on this pool's PD and
            // deallocated once; no bound `VerbsWindow` remains (each holds
            // the queue pair that owns this pool).
            let rc = unsafe { sys::ibv_dealloc_mw(mw.as_ptr()) };
            if rc != 0 {
                tracing::warn!(rc, "ibv_dealloc_mw failed; a memory window leaks until the device is closed");
            }
        }
        // The regions go only now, after their windows.
        self.free.clear();
        self.retired.clear();
    }
}
