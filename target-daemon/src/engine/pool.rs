//! Registered memory: the per-reactor chunk pool and the per-queue-pair slot
//! buffers (receive capsules, responses).
//!
//! The pool is one [`AlignedBuf`] (backed by transparent huge pages where
//! the kernel allows: the disk reads into it, see
//! [`AlignedBuf::new_huge_backed`]) cut into `chunk_size` chunks. It is
//! registered once with io_uring as fixed buffers (one iovec
//! per chunk, `buf_index` = chunk index) and once per fabric protection
//! domain as one memory region with `LOCAL_WRITE` only: the target never
//! exposes its memory, RDMA READ sinks need only local write.
//!
//! One extra chunk after the last follows them: the *zero chunk*. It is
//! never handed out, never given to io_uring and never the sink of an RDMA
//! READ, so it stays zero; RDMA WRITEs of the `null` backend's reads send
//! from it.
//!
//! Ownership of every chunk and slot is tracked: a chunk is free, held by
//! the CPU, lent to the kernel (an io_uring op) or lent to the fabric (a
//! posted work request). Safe byte access is only granted while the CPU
//! holds it, which is what makes the raw-pointer sharing with the kernel
//! and the provider sound as long as lending is paired with completions.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use rdmablk_common::fabric::{Access, AlignedBuf, FabricError, MemoryRegion, ProtectionDomain, Sge};

/// Alignment of pool and slot memory (O_DIRECT needs block alignment).
pub const ALIGN: usize = crate::config::PAGE as usize;

/// Index of a pool chunk; also its io_uring fixed-buffer index.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ChunkId(pub u16);

/// The memory behind a pool. Shared (through `Arc`) by the pool, the
/// io_uring engine and the fabric registrations so that it outlives all of them.
#[derive(Debug)]
pub struct PoolMemory {
    buf: AlignedBuf,
    chunk_size: usize,
    chunks: usize,
}

impl PoolMemory {
    /// Address of a chunk.
    pub fn chunk_ptr(&self, c: ChunkId) -> *mut u8 {
        assert!((c.0 as usize) < self.chunks, "chunk {} out of range", c.0);
        // SAFETY: the offset is within the allocation (checked above).
        unsafe { self.buf.as_ptr().add(c.0 as usize * self.chunk_size) }
    }

    /// Address of the zero chunk (just after the last chunk).
    pub fn zero_ptr(&self) -> *const u8 {
        // SAFETY: the allocation holds `chunks + 1` chunks (see `Pool::new`).
        unsafe { self.buf.as_ptr().add(self.chunks * self.chunk_size) }
    }

    /// One iovec per chunk, for `io_uring_register_buffers` (the zero chunk is not included).
    pub fn iovecs(&self) -> Vec<libc::iovec> {
        (0..self.chunks)
            .map(|i| libc::iovec { iov_base: self.chunk_ptr(ChunkId(i as u16)).cast(), iov_len: self.chunk_size })
            .collect()
    }

    /// Chunk size in bytes.
    pub fn chunk_size(&self) -> usize {
        self.chunk_size
    }

    /// Number of chunks.
    pub fn chunks(&self) -> usize {
        self.chunks
    }

    /// Total bytes, including the zero chunk.
    pub fn len(&self) -> usize {
        self.buf.len()
    }

    /// Never empty.
    pub fn is_empty(&self) -> bool {
        false
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum ChunkState {
    Free,
    Cpu,
    Kernel,
    Fabric,
}

/// The chunks one holder (a session, or a host, on one reactor) has taken
/// from a pool and not returned. Only that reactor's pool changes it. Its
/// name says whose it is in logs (`host=... session=...`, `peer=ADDR`).
#[derive(Debug, Default)]
pub struct PoolAccount {
    held: AtomicU32,
    /// Of `held`, chunks of control commands' answers (v1's LIST); the
    /// executor counts them.
    buffers: AtomicU32,
    name: String,
}

impl PoolAccount {
    /// An account named `name` (how logs name its holder).
    pub fn named(name: impl Into<String>) -> PoolAccount {
        PoolAccount { held: AtomicU32::new(0), buffers: AtomicU32::new(0), name: name.into() }
    }

    /// Chunks held for control commands' answers.
    #[inline]
    pub fn buffers(&self) -> u32 {
        self.buffers.load(Ordering::Relaxed)
    }

    /// Single writer (the executor of the pool's reactor).
    pub fn add_buffers(&self, delta: i32) {
        let v = self.buffers.load(Ordering::Relaxed);
        self.buffers.store(v.saturating_add_signed(delta), Ordering::Relaxed);
    }

    /// Chunks held now.
    #[inline]
    pub fn held(&self) -> u32 {
        self.held.load(Ordering::Relaxed)
    }

    /// Whose account it is.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Single writer (the pool's thread): a plain load and store. Returns
    /// the chunks held before.
    fn add(&self, delta: i32) -> u32 {
        let v = self.held.load(Ordering::Relaxed);
        self.held.store(v.saturating_add_signed(delta), Ordering::Relaxed);
        v
    }
}

/// The accounts one chunk is charged to: its session's and its host's.
pub type Charge<'a> = [Option<&'a Arc<PoolAccount>>; 2];

/// A reactor's buffer pool: free list of chunk indices (O(1), no allocation
/// per I/O) plus the ownership state of each chunk and the accounts it is
/// charged to.
#[derive(Debug)]
pub struct Pool {
    mem: Arc<PoolMemory>,
    free: Vec<u16>,
    state: Vec<ChunkState>,
    owner: Vec<[Option<Arc<PoolAccount>>; 2]>,
    /// Accounts in the first place of a charge (sessions, controllers)
    /// that hold at least one chunk: the executor's fair share divides the
    /// pool among them.
    holders: u32,
}

impl Pool {
    /// Allocates `size` bytes (a multiple of `chunk_size`, at most 65536 chunks).
    pub fn new(size: usize, chunk_size: usize) -> Pool {
        assert!(chunk_size > 0 && chunk_size % ALIGN == 0, "chunk size must be a multiple of {ALIGN}");
        assert!(size >= chunk_size && size % chunk_size == 0, "pool size must be a multiple of the chunk size");
        let chunks = size / chunk_size;
        assert!(chunks < u16::MAX as usize, "too many chunks");
        // One more chunk for the zero chunk; the allocation is zeroed.
        let mem = Arc::new(PoolMemory { buf: AlignedBuf::new_huge_backed(size + chunk_size), chunk_size, chunks });
        // Hand out low indices first (pop from the end).
        let free = (0..chunks as u32).rev().map(|i| i as u16).collect();
        Pool { mem, free, state: vec![ChunkState::Free; chunks], owner: vec![[None, None]; chunks], holders: 0 }
    }

    /// The shared memory, for io_uring and fabric registration.
    pub fn memory(&self) -> &Arc<PoolMemory> {
        &self.mem
    }

    /// Chunk size in bytes.
    pub fn chunk_size(&self) -> usize {
        self.mem.chunk_size
    }

    /// Number of chunks.
    pub fn capacity(&self) -> usize {
        self.mem.chunks
    }

    /// Number of free chunks.
    pub fn free_count(&self) -> usize {
        self.free.len()
    }

    /// Takes a free chunk; the CPU holds it.
    pub fn alloc(&mut self) -> Option<ChunkId> {
        let i = self.free.pop()?;
        debug_assert_eq!(self.state[i as usize], ChunkState::Free);
        self.state[i as usize] = ChunkState::Cpu;
        Some(ChunkId(i))
    }

    /// Takes a free chunk charged to each account of `charge` until it is
    /// released.
    pub fn alloc_charged(&mut self, charge: Charge<'_>) -> Option<ChunkId> {
        let c = self.alloc()?;
        for (place, (owner, a)) in self.owner[c.0 as usize].iter_mut().zip(charge).enumerate() {
            if let Some(a) = a {
                if a.add(1) == 0 && place == 0 {
                    self.holders += 1;
                }
                *owner = Some(Arc::clone(a));
            }
        }
        Some(c)
    }

    /// Returns a chunk the CPU holds to the free list (and uncharges its accounts).
    pub fn release(&mut self, c: ChunkId) {
        self.transition(c, ChunkState::Cpu, ChunkState::Free);
        let [first, second] = std::mem::take(&mut self.owner[c.0 as usize]);
        if first.is_some_and(|a| a.add(-1) == 1) {
            self.holders -= 1;
        }
        if let Some(a) = second {
            a.add(-1);
        }
        self.free.push(c.0);
    }

    /// How many accounts in the first place of a charge (sessions,
    /// controllers) hold at least one chunk.
    pub fn holders(&self) -> u32 {
        self.holders
    }

    /// Moves the accounts chunk `from` is charged to over to chunk `to`,
    /// which is charged to none: `to` takes `from`'s place (a chunk read
    /// ahead handed to the command that allocated `from`), and releasing
    /// `from` then uncharges nobody.
    pub fn move_charge(&mut self, from: ChunkId, to: ChunkId) {
        assert!(self.owner[to.0 as usize].iter().all(Option::is_none), "chunk {} is charged already", to.0);
        self.owner[to.0 as usize] = std::mem::take(&mut self.owner[from.0 as usize]);
    }

    /// Copies `len` bytes from chunk `src` at `src_off` to chunk `dst` at
    /// `dst_off`. Panics unless the CPU holds both and they differ.
    pub fn copy_between(&mut self, src: ChunkId, src_off: usize, dst: ChunkId, dst_off: usize, len: usize) {
        assert_ne!(src, dst, "copy within one chunk");
        assert!(src_off + len <= self.mem.chunk_size && dst_off + len <= self.mem.chunk_size, "copy beyond a chunk");
        for c in [src, dst] {
            assert_eq!(self.state[c.0 as usize], ChunkState::Cpu, "chunk {} not held by the CPU", c.0);
        }
        // SAFETY: both ranges lie within their chunks of the live allocation
        // (checked above); the chunks differ, so the ranges do not overlap;
        // neither chunk is lent to the kernel or the fabric, and `&mut self`
        // rules out a Rust reference into either.
        unsafe { std::ptr::copy_nonoverlapping(self.mem.chunk_ptr(src).add(src_off), self.mem.chunk_ptr(dst).add(dst_off), len) }
    }

    /// The zero chunk's bytes (the `null` backend's reads go out of it).
    pub fn zero_bytes(&self) -> &[u8] {
        // SAFETY: the zero chunk lies just past the chunks in the live
        // allocation; it is never handed out, never written (zeroed at
        // allocation, registered with the fabric for sending only: never
        // an RDMA READ sink) and never lent to the kernel.
        unsafe { std::slice::from_raw_parts(self.mem.zero_ptr(), self.mem.chunk_size) }
    }

    /// Whether the CPU holds the chunk (it is neither free nor lent).
    pub fn is_held(&self, c: ChunkId) -> bool {
        self.state[c.0 as usize] == ChunkState::Cpu
    }

    /// Whether the chunk is lent to the fabric.
    pub fn is_lent_to_fabric(&self, c: ChunkId) -> bool {
        self.state[c.0 as usize] == ChunkState::Fabric
    }

    /// The chunk's bytes. Panics unless the CPU holds it.
    pub fn bytes(&self, c: ChunkId) -> &[u8] {
        assert_eq!(self.state[c.0 as usize], ChunkState::Cpu, "chunk {} not held by the CPU", c.0);
        // SAFETY: the chunk lies within the live allocation and is neither lent
        // to the kernel nor to the fabric, so nothing else accesses it.
        unsafe { std::slice::from_raw_parts(self.mem.chunk_ptr(c), self.mem.chunk_size) }
    }

    /// The chunk's bytes, mutably. Panics unless the CPU holds it.
    pub fn bytes_mut(&mut self, c: ChunkId) -> &mut [u8] {
        assert_eq!(self.state[c.0 as usize], ChunkState::Cpu, "chunk {} not held by the CPU", c.0);
        // SAFETY: as in `bytes`; `&mut self` rules out another Rust reference.
        unsafe { std::slice::from_raw_parts_mut(self.mem.chunk_ptr(c), self.mem.chunk_size) }
    }

    /// Marks a chunk as in use by a posted work request until
    /// [`return_from_fabric`](Pool::return_from_fabric).
    pub fn lend_to_fabric(&mut self, c: ChunkId) {
        self.transition(c, ChunkState::Cpu, ChunkState::Fabric);
    }

    /// The work request that used the chunk has completed.
    pub fn return_from_fabric(&mut self, c: ChunkId) {
        self.transition(c, ChunkState::Fabric, ChunkState::Cpu);
    }

    pub(crate) fn lend_to_kernel(&mut self, c: ChunkId) {
        self.transition(c, ChunkState::Cpu, ChunkState::Kernel);
    }

    pub(crate) fn return_from_kernel(&mut self, c: ChunkId) {
        self.transition(c, ChunkState::Kernel, ChunkState::Cpu);
    }

    fn transition(&mut self, c: ChunkId, from: ChunkState, to: ChunkState) {
        let s = &mut self.state[c.0 as usize];
        assert_eq!(*s, from, "chunk {}: expected {from:?}, is {s:?}", c.0);
        *s = to;
    }

    /// Registers the whole pool with a protection domain as one region.
    pub fn register(&self, pd: &ProtectionDomain) -> Result<PoolRegion, FabricError> {
        // SAFETY: the memory stays allocated while the region lives because the
        // region holds an `Arc` to it (and drops the region first). Only
        // LOCAL_WRITE is granted, so the provider writes only into chunks we
        // lend to it for RDMA READ, which the CPU does not touch meanwhile.
        let mr = unsafe { pd.register(self.mem.buf.as_ptr(), self.mem.buf.len(), Access::LOCAL_WRITE)? };
        Ok(PoolRegion { mr, _mem: Arc::clone(&self.mem) })
    }
}

/// The pool registered with one protection domain.
pub struct PoolRegion {
    // Field order matters: the region is deregistered before the memory is freed.
    mr: MemoryRegion,
    _mem: Arc<PoolMemory>,
}

impl PoolRegion {
    /// An SGE covering `[off, off + len)` of chunk `c`.
    pub fn sge(&self, c: ChunkId, off: u32, len: u32) -> Sge {
        let chunk_size = self._mem.chunk_size;
        assert!((c.0 as usize) < self._mem.chunks, "chunk {} out of range", c.0);
        assert!(off as usize + len as usize <= chunk_size);
        self.mr.sge(c.0 as usize * chunk_size + off as usize, len)
    }

    /// An SGE covering the first `len` bytes of the zero chunk. Only for the
    /// source of RDMA WRITEs: the provider reads it, nothing ever writes it.
    pub fn zero_sge(&self, len: u32) -> Sge {
        assert!(len as usize <= self._mem.chunk_size);
        self.mr.sge(self._mem.chunks * self._mem.chunk_size, len)
    }

    /// The memory region.
    pub fn mr(&self) -> &MemoryRegion {
        &self.mr
    }
}

/// A buffer of equal slots registered with a protection domain: the receive
/// slots or the response slots of one queue pair.
pub struct SlotBuf {
    // Field order matters: deregister before freeing.
    mr: Option<MemoryRegion>,
    buf: AlignedBuf,
    slot_size: usize,
    lent: Vec<bool>,
}

impl SlotBuf {
    /// Allocates `slots` zeroed slots of `slot_size` bytes (not yet registered).
    pub fn new(slots: usize, slot_size: usize) -> SlotBuf {
        assert!(slots > 0 && slot_size > 0);
        SlotBuf { mr: None, buf: AlignedBuf::new(slots * slot_size, ALIGN), slot_size, lent: vec![false; slots] }
    }

    /// Registers the whole buffer as one region.
    pub fn register(&mut self, pd: &ProtectionDomain, access: Access) -> Result<(), FabricError> {
        assert!(self.mr.is_none(), "already registered");
        // SAFETY: the buffer is owned by `self` and outlives the region, which
        // is dropped first (field order). Peers get no remote rights; the
        // provider touches only slots lent to it, which the CPU then does not access.
        self.mr = Some(unsafe { pd.register(self.buf.as_ptr(), self.buf.len(), access)? });
        Ok(())
    }

    /// Number of slots.
    pub fn slots(&self) -> usize {
        self.lent.len()
    }

    /// Size of one slot.
    pub fn slot_size(&self) -> usize {
        self.slot_size
    }

    /// Lends slot `i` to the provider for a work request and returns the SGE
    /// for its first `len` bytes. Panics if not registered or already lent.
    pub fn lend(&mut self, i: usize, len: u32) -> Sge {
        assert!(len as usize <= self.slot_size);
        assert!(!self.lent[i], "slot {i} already lent");
        let mr = self.mr.as_ref().expect("slot buffer not registered");
        self.lent[i] = true;
        mr.sge(i * self.slot_size, len)
    }

    /// The work request that used slot `i` completed (or was flushed).
    pub fn reclaim(&mut self, i: usize) {
        assert!(self.lent[i], "slot {i} not lent");
        self.lent[i] = false;
    }

    /// Whether slot `i` is lent.
    pub fn is_lent(&self, i: usize) -> bool {
        self.lent[i]
    }

    /// Slot `i`'s bytes. Panics while it is lent.
    pub fn slot(&self, i: usize) -> &[u8] {
        assert!(!self.lent[i], "slot {i} is lent to the provider");
        // SAFETY: the slot lies within the live buffer and the provider does
        // not access it (not lent).
        unsafe { std::slice::from_raw_parts(self.buf.as_ptr().add(i * self.slot_size), self.slot_size) }
    }

    /// The bytes named by an SGE from [`SlotBuf::lend`], while lent: for a
    /// SEND whose provider copies them at post time (inline). Only for a
    /// buffer registered without `LOCAL_WRITE`, which the provider never
    /// writes (the response slots). Panics otherwise, or if the SGE is not
    /// the start of a lent slot of this buffer.
    pub fn lent_bytes(&self, sge: &Sge) -> &[u8] {
        let mr = self.mr.as_ref().expect("slot buffer not registered");
        assert!(!mr.access().contains(Access::LOCAL_WRITE), "the provider may write this slot buffer");
        assert_eq!(sge.lkey, mr.lkey(), "SGE of another region");
        let off = sge.addr.checked_sub(mr.addr()).expect("SGE before the slot buffer") as usize;
        let i = off / self.slot_size;
        assert!(off % self.slot_size == 0 && i < self.lent.len() && self.lent[i], "SGE is not a lent slot");
        assert!(sge.length as usize <= self.slot_size);
        // SAFETY: the range lies within slot `i` of the live buffer (checked
        // above). The provider never writes this buffer: registered without
        // LOCAL_WRITE, and REMOTE_WRITE requires it. The CPU writes only
        // through `slot_mut`, which needs `&mut self`, excluded while the
        // returned borrow lives.
        unsafe { std::slice::from_raw_parts(self.buf.as_ptr().add(off), sge.length as usize) }
    }

    /// Slot `i`'s bytes, mutably. Panics while it is lent.
    pub fn slot_mut(&mut self, i: usize) -> &mut [u8] {
        assert!(!self.lent[i], "slot {i} is lent to the provider");
        // SAFETY: as in `slot`; `&mut self` rules out other Rust references.
        unsafe { std::slice::from_raw_parts_mut(self.buf.as_ptr().add(i * self.slot_size), self.slot_size) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn charged_chunks_count_against_their_account_until_released() {
        let mut p = Pool::new(8 * 4096, 4096);
        let (a, b) = (Arc::new(PoolAccount::default()), Arc::new(PoolAccount::default()));
        // Sessions a and b of one host h.
        let h = Arc::new(PoolAccount::default());
        let c1 = p.alloc_charged([Some(&a), Some(&h)]).unwrap();
        let c2 = p.alloc_charged([Some(&a), Some(&h)]).unwrap();
        let c3 = p.alloc_charged([Some(&b), Some(&h)]).unwrap();
        let c4 = p.alloc_charged([None, None]).unwrap();
        assert_eq!((a.held(), b.held(), h.held()), (2, 1, 3));
        assert_eq!(p.holders(), 2, "sessions a and b hold chunks");
        // Lending to the kernel or the fabric keeps the charge.
        p.lend_to_fabric(c1);
        p.return_from_fabric(c1);
        assert_eq!(a.held(), 2);
        p.release(c1);
        p.release(c3);
        p.release(c4);
        assert_eq!((a.held(), b.held(), h.held()), (1, 0, 1));
        assert_eq!(p.holders(), 1, "b holds none any more");
        // A chunk reused by someone else is charged to them only.
        let c5 = p.alloc_charged([Some(&b), None]).unwrap();
        assert_eq!((a.held(), b.held(), h.held()), (1, 1, 1));
        p.release(c2);
        p.release(c5);
        assert_eq!((a.held(), b.held(), h.held()), (0, 0, 0));
        assert_eq!(p.holders(), 0);
        assert_eq!(p.free_count(), 8);
    }

    #[test]
    fn a_moved_charge_follows_the_chunk_that_takes_the_place() {
        let mut p = Pool::new(4 * 4096, 4096);
        let a = Arc::new(PoolAccount::default());
        let own = p.alloc_charged([Some(&a), None]).unwrap();
        let ahead = p.alloc().unwrap();
        p.bytes_mut(ahead).fill(7);
        p.copy_between(ahead, 100, own, 0, 50);
        assert!(p.bytes(own)[..50].iter().all(|&b| b == 7));
        p.move_charge(own, ahead);
        p.release(own);
        assert_eq!(a.held(), 1, "the chunk that took its place is charged");
        p.release(ahead);
        assert_eq!(a.held(), 0);
        assert_eq!(p.free_count(), 4);
    }

    #[test]
    fn pool_accounting() {
        let mut p = Pool::new(16 * 4096, 4096);
        assert_eq!(p.capacity(), 16);
        assert_eq!(p.free_count(), 16);
        let a = p.alloc().unwrap();
        assert_eq!(a, ChunkId(0));
        let mut held = vec![a];
        while let Some(c) = p.alloc() {
            held.push(c);
        }
        assert_eq!(held.len(), 16);
        assert_eq!(p.free_count(), 0);
        let mut sorted = held.clone();
        sorted.sort();
        sorted.dedup();
        assert_eq!(sorted.len(), 16, "no chunk handed out twice");
        p.bytes_mut(held[3]).fill(0xab);
        assert!(p.bytes(held[3]).iter().all(|&b| b == 0xab));
        p.lend_to_fabric(held[3]);
        assert!(p.is_lent_to_fabric(held[3]));
        p.return_from_fabric(held[3]);
        for c in held {
            p.release(c);
        }
        assert_eq!(p.free_count(), 16);
    }

    #[test]
    fn zero_chunk_is_outside_the_chunks_and_zero() {
        let mut p = Pool::new(4 * 4096, 4096);
        let mem = Arc::clone(p.memory());
        assert_eq!(mem.len(), 5 * 4096);
        assert_eq!(mem.iovecs().len(), 4, "the zero chunk is not an io_uring buffer");
        while let Some(c) = p.alloc() {
            p.bytes_mut(c).fill(0xff);
            assert_ne!(mem.chunk_ptr(c) as *const u8, mem.zero_ptr());
        }
        // SAFETY: test-only read of the zero chunk, which nothing writes.
        let zero = unsafe { std::slice::from_raw_parts(mem.zero_ptr(), 4096) };
        assert!(zero.iter().all(|&b| b == 0));
    }

    #[test]
    fn chunks_are_aligned_and_disjoint() {
        let p = Pool::new(8 * 8192, 8192);
        let iov = p.memory().iovecs();
        assert_eq!(iov.len(), 8);
        for (i, v) in iov.iter().enumerate() {
            assert_eq!(v.iov_base as usize % ALIGN, 0);
            assert_eq!(v.iov_len, 8192);
            if i > 0 {
                assert_eq!(v.iov_base as usize - iov[i - 1].iov_base as usize, 8192);
            }
        }
    }

    #[test]
    #[should_panic(expected = "not held by the CPU")]
    fn no_access_while_lent() {
        let mut p = Pool::new(4096, 4096);
        let c = p.alloc().unwrap();
        p.lend_to_fabric(c);
        let _ = p.bytes(c);
    }

    #[test]
    #[should_panic(expected = "expected Cpu")]
    fn double_release_panics() {
        let mut p = Pool::new(4096, 4096);
        let c = p.alloc().unwrap();
        p.release(c);
        p.release(c);
    }

    #[test]
    fn slot_buffer_slots() {
        let mut s = SlotBuf::new(4, 256);
        s.slot_mut(2)[..3].copy_from_slice(b"abc");
        assert_eq!(&s.slot(2)[..3], b"abc");
        assert_eq!(s.slots(), 4);
        assert!(!s.is_lent(2));
    }
}
