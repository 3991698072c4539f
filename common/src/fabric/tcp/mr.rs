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

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::SeqCst};
use std::sync::{Arc, LazyLock, Mutex, MutexGuard};

use arc_swap::ArcSwap;

use super::MAX_SGE;
use crate::fabric::{check_registration, Access, Lkey, Result, Rkey};

/// Every lkey and rkey currently registered in this process, so that keys
/// are unique process-wide and never reused while registered.
static KEYS: LazyLock<Mutex<HashSet<u32>>> = LazyLock::new(|| Mutex::new(HashSet::new()));

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// A random nonzero key not in use. `rand::random` draws from the thread's
/// ChaCha-based CSPRNG, so keys are not predictable from earlier ones.
fn alloc_key(set: &mut HashSet<u32>) -> u32 {
    loop {
        let k: u32 = rand::random();
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
    by_rkey: HashMap<u32, Arc<Region>>,
    by_lkey: HashMap<u32, Arc<Region>>,
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

/// State shared by a PD, its regions and its queue pairs.
pub(crate) struct PdShared {
    pub(crate) table: ArcSwap<RegionTable>,
    writer: Mutex<()>,
}

/// Most pins one operation holds: one per SGE.
const MAX_PINS: usize = MAX_SGE;

/// Regions pinned for the duration of one syscall; unpinned on drop.
pub(crate) struct Pins<'a> {
    regs: [Option<&'a Region>; MAX_PINS],
    n: usize,
}

impl<'a> Pins<'a> {
    pub(crate) fn new() -> Pins<'a> {
        Pins { regs: [None; MAX_PINS], n: 0 }
    }

    /// Pins `r`; false if it was deregistered (or, defensively, if too many
    /// pins are held).
    pub(crate) fn pin(&mut self, r: &'a Region) -> bool {
        if self.n == MAX_PINS || !r.try_pin() {
            return false;
        }
        self.regs[self.n] = Some(r);
        self.n += 1;
        true
    }
}

impl Drop for Pins<'_> {
    fn drop(&mut self) {
        for r in self.regs[..self.n].iter().flatten() {
            r.unpin();
        }
    }
}

/// A protection domain of the tcp provider.
pub struct TcpPd {
    shared: Arc<PdShared>,
}

impl TcpPd {
    pub(crate) fn new() -> TcpPd {
        TcpPd {
            shared: Arc::new(PdShared { table: ArcSwap::from_pointee(RegionTable::default()), writer: Mutex::new(()) }),
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
