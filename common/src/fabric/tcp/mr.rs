//! Protection domains and memory regions.
//!
//! Each protection domain keeps its regions in an immutable [`RegionTable`]
//! published through an `ArcSwap`: the data path loads the current snapshot
//! without taking a lock, registration and deregistration (control path)
//! build a new snapshot under a per-PD writer mutex.
//!
//! A snapshot may outlive a deregistration, so every region also carries a
//! `valid` flag and a `pins` counter. The data path *pins* a region around
//! each syscall that touches its memory: increment `pins`, then re-check
//! `valid`. Deregistration removes the region from the table, clears `valid`,
//! then waits until `pins` is zero. Both sides use sequentially consistent
//! operations, so either the placement sees `valid == false` and backs off,
//! or the deregistration sees the pin and waits for it: once
//! `drop(MemoryRegion)` returns, the provider never touches that memory again.
//! Pins are held only across one nonblocking syscall (or a memcpy into the
//! send backlog), so the wait is short.

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::Relaxed, Ordering::SeqCst};
use std::sync::{Arc, LazyLock, Mutex};

use arc_swap::ArcSwap;
use arrayvec::ArrayVec;

use crate::keymap::KeyMap;
use super::MAX_SGE;
use crate::fabric::{check_registration, lock, Access, FabricError, FabricErrorKind, Lkey, Result, Rkey};

/// Every lkey and rkey currently registered in this process, so that keys
/// are unique process-wide and never reused while registered.
static KEYS: LazyLock<Mutex<HashSet<u32>>> = LazyLock::new(|| Mutex::new(HashSet::new()));

/// Set in the rkey of every memory window and in no region key, so a
/// lookup knows which table to search.
const WINDOW_KEY_BIT: u32 = 1 << 31;

/// A random nonzero region key (window bit clear) not in use. `rand::random`
/// draws from the thread's ChaCha-based CSPRNG, so keys are not predictable
/// from earlier ones.
fn alloc_key(set: &mut HashSet<u32>) -> u32 {
    loop {
        let k: u32 = rand::random::<u32>() & !WINDOW_KEY_BIT;
        if k != 0 && set.insert(k) {
            return k;
        }
    }
}

/// One registered region.
pub(crate) struct Region {
    pub(crate) addr: u64,
    pub(crate) len: u64,
    pub(crate) access: Access,
    pub(crate) lkey: u32,
    pub(crate) rkey: u32,
    valid: AtomicBool,
    pins: AtomicUsize,
}

impl Region {
    /// Whether `[addr, addr + len)` lies inside the region (overflow-safe).
    pub(crate) fn covers(&self, addr: u64, len: u64) -> bool {
        match addr.checked_sub(self.addr) {
            Some(off) => off.checked_add(len).is_some_and(|end| end <= self.len),
            None => false,
        }
    }

    fn try_pin(&self) -> bool {
        self.pins.fetch_add(1, SeqCst);
        if self.valid.load(SeqCst) {
            true
        } else {
            self.pins.fetch_sub(1, SeqCst);
            false
        }
    }

    fn unpin(&self) {
        self.pins.fetch_sub(1, SeqCst);
    }
}

/// An immutable snapshot of a PD's regions.
#[derive(Default, Clone)]
pub(crate) struct RegionTable {
    by_rkey: KeyMap<Arc<Region>>,
    by_lkey: KeyMap<Arc<Region>>,
}

impl RegionTable {
    /// The region `rkey` names, if it grants `need` and covers the range.
    pub(crate) fn remote(&self, rkey: u32, addr: u64, len: u64, need: Access) -> Option<&Region> {
        let r = self.by_rkey.get(&rkey)?;
        (r.access.contains(need) && r.covers(addr, len)).then_some(&**r)
    }

    /// The region `lkey` names, if it grants `need` and covers the range.
    pub(crate) fn local(&self, lkey: u32, addr: u64, len: u64, need: Access) -> Option<&Region> {
        let r = self.by_lkey.get(&lkey)?;
        (r.access.contains(need) && r.covers(addr, len)).then_some(&**r)
    }
}

/// A memory window: remote rights over part of a region registered with
/// `MW_BIND`, under its own rkey, until invalidated.
struct Window {
    addr: u64,
    len: u64,
    access: Access,
    parent: Arc<Region>,
    /// The queue pair it was bound on: the only one whose peer may use it
    /// (as a type-2B window on a NIC).
    qp_num: u32,
    /// Which bind this is (process-wide): the [`TcpWindow`] that made it
    /// removes this entry only, not a later window that drew the same
    /// rkey after the peer invalidated this one.
    bind: u64,
}

/// Numbers the binds of every window in the process.
static NEXT_BIND: AtomicU64 = AtomicU64::new(1);

/// State shared by a PD, its regions and its queue pairs.
pub(crate) struct PdShared {
    pub(crate) table: ArcSwap<RegionTable>,
    writer: Mutex<()>,
    /// Bound windows by rkey. A mutex, not a snapshot: windows come and go
    /// with every command, and a lookup is one short critical section.
    windows: Mutex<KeyMap<Window>>,
}

impl PdShared {
    /// The region the peer of queue pair `qp_num` may touch with `rkey` —
    /// a region granting `need` itself, or the region under a window bound
    /// on that queue pair granting it — if the range is covered. A window's
    /// region is kept alive in `holder`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn remote<'t>(
        &self,
        table: &'t RegionTable,
        holder: &'t mut Option<Arc<Region>>,
        qp_num: u32,
        rkey: u32,
        addr: u64,
        len: u64,
        need: Access,
    ) -> Option<&'t Region> {
        if rkey & WINDOW_KEY_BIT == 0 {
            return table.remote(rkey, addr, len, need);
        }
        let parent = {
            let windows = lock(&self.windows);
            let w = windows.get(&rkey)?;
            let inside = addr.checked_sub(w.addr).and_then(|off| off.checked_add(len)).is_some_and(|end| end <= w.len);
            (w.qp_num == qp_num && w.access.contains(need) && inside).then(|| w.parent.clone())?
        };
        Some(&**holder.insert(parent))
    }
}

/// Most pins one operation holds: one per SGE.
const MAX_PINS: usize = MAX_SGE;

/// Regions pinned for the duration of one syscall; unpinned on drop.
pub(crate) struct Pins<'a> {
    regs: ArrayVec<&'a Region, MAX_PINS>,
}

impl<'a> Pins<'a> {
    pub(crate) fn new() -> Pins<'a> {
        Pins { regs: ArrayVec::new() }
    }

    /// Pins `r`; false if it was deregistered (or, defensively, if too many
    /// pins are held).
    pub(crate) fn pin(&mut self, r: &'a Region) -> bool {
        if self.regs.iter().any(|p| std::ptr::eq(*p, r)) {
            // Already pinned by this holder (a chain of work requests on one
            // region): the region stays valid until the holder drops.
            return true;
        }
        if self.regs.is_full() || !r.try_pin() {
            return false;
        }
        self.regs.push(r);
        true
    }

    /// How many more distinct regions can be pinned.
    pub(crate) fn room(&self) -> usize {
        self.regs.remaining_capacity()
    }

    /// Unpins everything pinned so far.
    pub(crate) fn release(&mut self) {
        for r in self.regs.drain(..) {
            r.unpin();
        }
    }
}

impl Drop for Pins<'_> {
    fn drop(&mut self) {
        self.release();
    }
}

/// A protection domain of the tcp provider.
pub struct TcpPd {
    shared: Arc<PdShared>,
}

impl TcpPd {
    pub(crate) fn new() -> TcpPd {
        TcpPd {
            shared: Arc::new(PdShared {
                table: ArcSwap::from_pointee(RegionTable::default()),
                writer: Mutex::new(()),
                windows: Mutex::new(KeyMap::default()),
            }),
        }
    }

    pub(crate) fn shared(&self) -> &Arc<PdShared> {
        &self.shared
    }

    /// Registers `[addr, addr + len)`.
    ///
    /// # Safety
    /// See [`crate::fabric::ProtectionDomain::register`].
    pub unsafe fn register(&self, addr: *mut u8, len: usize, access: Access) -> Result<TcpMr> {
        check_registration(addr, len, access)?;
        let start = addr as usize as u64;
        let _w = lock(&self.shared.writer);
        let (lkey, rkey) = {
            let mut keys = lock(&KEYS);
            (alloc_key(&mut keys), alloc_key(&mut keys))
        };
        let region = Arc::new(Region {
            addr: start,
            len: len as u64,
            access,
            lkey,
            rkey,
            valid: AtomicBool::new(true),
            pins: AtomicUsize::new(0),
        });
        let mut table = RegionTable::clone(&self.shared.table.load());
        table.by_rkey.insert(rkey, region.clone());
        table.by_lkey.insert(lkey, region.clone());
        self.shared.table.store(Arc::new(table));
        Ok(TcpMr { region, pd: self.shared.clone() })
    }
}

impl PdShared {
    /// Binds a window over `[addr, addr + len)` of the region whose rkey is
    /// `parent`, for the peer of queue pair `qp_num` only, granting
    /// `access` (remote rights only) under a fresh random rkey. The region
    /// must have been registered with `MW_BIND` (and `LOCAL_WRITE` for a
    /// window that grants `REMOTE_WRITE`).
    pub(crate) fn bind_window(self: &Arc<PdShared>, qp_num: u32, parent: Rkey, addr: u64, len: u64, access: Access) -> Result<TcpWindow> {
        self.bind_window_keyed(qp_num, parent, addr, len, access, None)
    }

    /// [`PdShared::bind_window`] under `rkey` (which must have the window
    /// bit and be free): lets a test bind a window under the key of one the
    /// peer invalidated, which a random draw reaches only by chance.
    #[cfg(test)]
    pub(crate) fn bind_window_with_key(
        self: &Arc<PdShared>,
        qp_num: u32,
        parent: Rkey,
        addr: u64,
        len: u64,
        access: Access,
        rkey: u32,
    ) -> Result<TcpWindow> {
        assert!(rkey & WINDOW_KEY_BIT != 0 && !lock(&self.windows).contains_key(&rkey));
        self.bind_window_keyed(qp_num, parent, addr, len, access, Some(rkey))
    }

    fn bind_window_keyed(
        self: &Arc<PdShared>,
        qp_num: u32,
        parent: Rkey,
        addr: u64,
        len: u64,
        access: Access,
        key: Option<u32>,
    ) -> Result<TcpWindow> {
        crate::fabric::check_window_access(access, len)?;
        let invalid = |why: String| Err(FabricError::new(FabricErrorKind::InvalidArgument, format!("bind_window: {why}")));
        let region = {
            let table = self.table.load();
            match table.by_rkey.get(&parent.0) {
                Some(r) => r.clone(),
                None => return invalid(format!("no region with rkey {:#x}", parent.0)),
            }
        };
        if !region.access.contains(Access::MW_BIND) {
            return invalid("the region was not registered with MW_BIND".to_owned());
        }
        if access.contains(Access::REMOTE_WRITE) && !region.access.contains(Access::LOCAL_WRITE) {
            return invalid("REMOTE_WRITE over a region without LOCAL_WRITE".to_owned());
        }
        if !region.covers(addr, len) {
            return invalid(format!("[{addr:#x}, +{len}) is not inside the region"));
        }
        let mut windows = lock(&self.windows);
        let rkey = key.unwrap_or_else(|| loop {
            let k = rand::random::<u32>() | WINDOW_KEY_BIT;
            if !windows.contains_key(&k) {
                break k;
            }
        });
        let bind = NEXT_BIND.fetch_add(1, Relaxed);
        windows.insert(rkey, Window { addr, len, access, parent: region, qp_num, bind });
        Ok(TcpWindow { rkey, bind, pd: self.clone() })
    }
}

/// A bound memory window; dropping it invalidates the rkey. A peer's
/// access that arrives afterwards fails like any access with a bad rkey.
pub struct TcpWindow {
    rkey: u32,
    /// The bind that made it ([`Window::bind`]).
    bind: u64,
    pd: Arc<PdShared>,
}

impl TcpWindow {
    pub fn rkey(&self) -> Rkey {
        Rkey(self.rkey)
    }

    /// Whether the window still grants access: false once the peer's SEND
    /// with Invalidate ended it ([`PdShared::invalidate_window`]) or its
    /// region was deregistered.
    pub(crate) fn is_bound(&self) -> bool {
        lock(&self.pd.windows).get(&self.rkey).is_some_and(|w| w.bind == self.bind)
    }
}

impl PdShared {
    /// A peer's SEND with Invalidate on queue pair `qp_num`: ends the
    /// window `rkey` if it is one bound on that queue pair, as a type-2B
    /// window's remote invalidation does. False if not: a region (like one
    /// from `ibv_reg_mr`, not fast-registered, it cannot be invalidated), a
    /// window of another queue pair, or no key at all (the receive fails,
    /// as on RC hardware). Its [`TcpWindow`] stays with its owner, whose
    /// drop then has nothing left to remove.
    pub(crate) fn invalidate_window(&self, qp_num: u32, rkey: u32) -> bool {
        let mut windows = lock(&self.windows);
        match windows.get(&rkey) {
            Some(w) if w.qp_num == qp_num => {
                windows.remove(&rkey);
                true
            }
            _ => false,
        }
    }
}

impl Drop for TcpWindow {
    fn drop(&mut self) {
        // A placement already past its lookup holds a pin on the region,
        // as it would after the region's own lookup: it completes, as a
        // DMA in progress on a NIC would. A window the peer invalidated is
        // gone already, and its key may name a later bind by now.
        let mut windows = lock(&self.pd.windows);
        if windows.get(&self.rkey).is_some_and(|w| w.bind == self.bind) {
            windows.remove(&self.rkey);
        }
    }
}

/// A registered region; dropping it deregisters.
pub struct TcpMr {
    region: Arc<Region>,
    pd: Arc<PdShared>,
}

impl TcpMr {
    pub fn lkey(&self) -> Lkey {
        Lkey(self.region.lkey)
    }
    pub fn rkey(&self) -> Rkey {
        Rkey(self.region.rkey)
    }
    pub fn addr(&self) -> u64 {
        self.region.addr
    }
    pub fn len(&self) -> usize {
        self.region.len as usize
    }
    pub fn is_empty(&self) -> bool {
        self.region.len == 0
    }
    pub fn access(&self) -> Access {
        self.region.access
    }
}

impl Drop for TcpMr {
    fn drop(&mut self) {
        let r = &self.region;
        {
            let _w = lock(&self.pd.writer);
            let mut table = RegionTable::clone(&self.pd.table.load());
            table.by_rkey.remove(&r.rkey);
            table.by_lkey.remove(&r.lkey);
            self.pd.table.store(Arc::new(table));
            // Windows over the region die with it (verbs: the MR cannot be
            // deregistered while windows are bound; here they are dropped).
            lock(&self.pd.windows).retain(|_, w| !Arc::ptr_eq(&w.parent, r));
        }
        // Snapshots loaded before the store may still name the region: make
        // every later pin fail, then wait out the pins already taken.
        r.valid.store(false, SeqCst);
        let mut spins = 0u32;
        while r.pins.load(SeqCst) != 0 {
            if spins < 64 {
                std::hint::spin_loop();
                spins += 1;
            } else {
                std::thread::yield_now();
            }
        }
        let mut keys = lock(&KEYS);
        keys.remove(&r.lkey);
        keys.remove(&r.rkey);
    }
}
