//! Owned, aligned, zeroed memory for registration with the fabric and with
//! io_uring (O_DIRECT needs block-aligned buffers).
//!
//! A buffer of [`MAPPED_MIN`] or more (page-aligned or less) is a mapping
//! of its own rather than a heap allocation: the kernel zeroes its pages
//! as they are first touched, so it is resident only as far as it is used,
//! and dropping it gives it back at once. Per-connection buffers (a
//! target's receive and response slots, 580 KiB for a v1 queue pair at the
//! default depth) come and go with their connections; from the heap, the
//! allocator kept what closed connections had freed (glibc's per-thread
//! arenas return only a free top of the heap), and a target that churned
//! 600 queue pairs a round grew from 238 to about 400 MiB in eight rounds
//! (`tests/tests/churn.rs`). [`release_free_heap`] gives back what smaller
//! allocations left.

use std::alloc::{alloc, alloc_zeroed, dealloc, Layout};
use std::ptr::NonNull;

/// Size of a transparent huge page on x86-64 and aarch64 (4 KiB base pages).
const HUGE_PAGE: usize = 2 << 20;
/// Base page size (x86-64, and aarch64 kernels with 4 KiB pages; a larger
/// page only makes a mapping's alignment larger than asked).
const PAGE: usize = 4096;
/// Buffers at least this long are mappings of their own (see the module
/// documentation): below it, a mapping's system calls and its page-rounded
/// tail cost more than the heap keeps.
pub const MAPPED_MIN: usize = 64 << 10;

/// Memory with a chosen alignment (a heap allocation, or from [`MAPPED_MIN`]
/// bytes on a mapping of its own). It hands out raw pointers only:
/// once registered, a peer or the kernel may write into it at any time, so
/// safe slices are offered through `unsafe` accessors whose callers promise
/// that no such write is in flight.
pub struct AlignedBuf {
    ptr: NonNull<u8>,
    layout: Layout,
    /// A mapping of its own (`mmap`), not a heap allocation.
    mapped: bool,
}

// SAFETY: the buffer is plain memory owned by this value; moving it between
// threads moves ownership, and shared access only hands out raw pointers.
unsafe impl Send for AlignedBuf {}
// SAFETY: as above; `&AlignedBuf` exposes no safe way to read or write the bytes.
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    /// Allocates `len` zeroed bytes aligned to `align` (a power of two).
    /// From [`MAPPED_MIN`] bytes on (and `align` at most a page) the buffer
    /// is a mapping of its own, untouched until used and unmapped on drop.
    /// Panics if `len` is zero or the layout is invalid; aborts on OOM.
    pub fn new(len: usize, align: usize) -> Self {
        assert!(len > 0, "AlignedBuf of zero length");
        let layout = Layout::from_size_align(len, align).expect("valid alignment");
        if len >= MAPPED_MIN && align <= PAGE {
            // SAFETY: an anonymous private mapping of a non-zero length at an
            // address the kernel picks; it aliases nothing. Its pages read as
            // zero until written, and it is page-aligned (so `align`-aligned).
            let raw = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    len,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                    -1,
                    0,
                )
            };
            if raw == libc::MAP_FAILED {
                std::alloc::handle_alloc_error(layout);
            }
            let ptr = NonNull::new(raw.cast()).unwrap_or_else(|| std::alloc::handle_alloc_error(layout));
            return AlignedBuf { ptr, layout, mapped: true };
        }
        // SAFETY: the layout has a non-zero size.
        let raw = unsafe { alloc_zeroed(layout) };
        let ptr = NonNull::new(raw).unwrap_or_else(|| std::alloc::handle_alloc_error(layout));
        AlignedBuf { ptr, layout, mapped: false }
    }

    /// Allocates `len` zeroed bytes, page-aligned, asking the kernel to back
    /// them with transparent huge pages where `len` allows (2 MiB-aligned,
    /// `madvise(MADV_HUGEPAGE)` before the first touch).
    ///
    /// For memory that the disk reads into through io_uring's registered
    /// buffers: a registered buffer of 4 KiB pages reaches the block layer
    /// as one segment per page, and a virtio disk then serves a 128 KiB
    /// read as 32 pieces; measured on this project's VM, 128 KiB sequential
    /// reads at QD16 into registered buffers ran at 600–800 MiB/s with 4
    /// KiB pages and 2.4–2.5 GB/s with huge pages (docs/perf-log/issue-20-looks.md, "Huge
    /// pages under the pool"). Where THP is off (`never`) this is
    /// [`AlignedBuf::new`] with a larger alignment.
    pub fn new_huge_backed(len: usize) -> Self {
        if len < HUGE_PAGE {
            // Not one huge page long: nothing to advise.
            return Self::new(len, 4096);
        }
        let layout = Layout::from_size_align(len, HUGE_PAGE).expect("valid alignment");
        // SAFETY: the layout has a non-zero size.
        let raw = unsafe { alloc(layout) };
        let ptr = NonNull::new(raw).unwrap_or_else(|| std::alloc::handle_alloc_error(layout));
        // SAFETY: the range is the allocation just made, page-aligned;
        // MADV_HUGEPAGE only changes how its pages are backed (an error,
        // e.g. a kernel without THP, leaves it as it was).
        unsafe { libc::madvise(raw.cast(), len, libc::MADV_HUGEPAGE) };
        // SAFETY: the allocation is `len` bytes long and not yet shared; the
        // first touch happens here, after the advice.
        unsafe { std::ptr::write_bytes(raw, 0, len) };
        AlignedBuf { ptr, layout, mapped: false }
    }

    /// Start of the buffer.
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// Start address as a fabric address.
    pub fn addr(&self) -> u64 {
        self.ptr.as_ptr() as u64
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.layout.size()
    }

    /// Always false: zero-length buffers are refused at construction.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// The bytes as a shared slice.
    ///
    /// # Safety
    /// No peer or kernel write into the buffer may be in flight while the
    /// slice lives.
    pub unsafe fn as_slice(&self) -> &[u8] {
        // SAFETY: the allocation is live and `len` bytes long; the caller rules
        // out concurrent writers.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len()) }
    }

    /// The bytes as a mutable slice.
    ///
    /// # Safety
    /// No peer or kernel access to the buffer may be in flight while the
    /// slice lives.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn as_mut_slice(&self) -> &mut [u8] {
        // SAFETY: the allocation is live and `len` bytes long; the caller rules
        // out concurrent access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len()) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        if self.mapped {
            // SAFETY: the mapping `new` made, of this length, unmapped once;
            // nothing refers to it any more (the owner, and any region
            // registered over it, are gone). An error would mean a bad
            // address, which it is not; there is nothing to do about one.
            unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.layout.size()) };
            return;
        }
        // SAFETY: allocated in `new` or `new_huge_backed` with this exact
        // layout, from the global allocator.
        unsafe { dealloc(self.ptr.as_ptr(), self.layout) }
    }
}

/// Gives the heap's free memory back to the kernel, in every thread's arena
/// (glibc's `malloc_trim(0)`: free pages inside the heaps are discarded, not
/// only a free top); true if any was. What smaller per-connection state
/// (the tcp provider's queues and staging, an NVMe/TCP queue's buffers)
/// freed stays in the allocator otherwise, and sessions that close in a
/// burst leave as much as they held. It takes each arena's lock in turn
/// and walks its free chunks: for a thread with nothing better to do, after
/// many connections ended, not per I/O. Elsewhere than glibc it does nothing.
pub fn release_free_heap() -> bool {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // SAFETY: malloc_trim only reorganizes the allocator's own free
        // memory, under its locks; it touches no allocation in use.
        unsafe { libc::malloc_trim(0) == 1 }
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    {
        false
    }
}

impl std::fmt::Debug for AlignedBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "AlignedBuf({:#x}, {} bytes)", self.addr(), self.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The `VmFlags` line of the mapping in /proc/self/smaps that holds `addr`.
    fn vm_flags_of(addr: u64) -> Option<String> {
        let smaps = std::fs::read_to_string("/proc/self/smaps").ok()?;
        let mut inside = false;
        for line in smaps.lines() {
            if let Some((range, _)) = line.split_once(' ') {
                if let Some((lo, hi)) = range.split_once('-') {
                    if let (Ok(lo), Ok(hi)) = (u64::from_str_radix(lo, 16), u64::from_str_radix(hi, 16)) {
                        inside = (lo..hi).contains(&addr);
                        continue;
                    }
                }
            }
            if inside {
                if let Some(flags) = line.strip_prefix("VmFlags:") {
                    return Some(flags.trim().to_string());
                }
            }
        }
        None
    }

    #[test]
    fn huge_backed_memory_is_zeroed_aligned_and_advised() {
        let len = 4 * HUGE_PAGE + 128 * 1024;
        let buf = AlignedBuf::new_huge_backed(len);
        assert_eq!(buf.len(), len);
        assert_eq!(buf.addr() % HUGE_PAGE as u64, 0, "2 MiB-aligned");
        // SAFETY: nothing else knows the buffer.
        assert!(unsafe { buf.as_slice() }.iter().all(|&b| b == 0), "zeroed");
        if std::path::Path::new("/sys/kernel/mm/transparent_hugepage/enabled").exists() {
            let flags = vm_flags_of(buf.addr()).expect("the buffer's mapping in smaps");
            assert!(flags.split(' ').any(|f| f == "hg"), "MADV_HUGEPAGE not applied: VmFlags {flags}");
        }
        // Small buffers keep page alignment and are zeroed too.
        let small = AlignedBuf::new_huge_backed(8192);
        assert_eq!(small.addr() % 4096, 0);
        // SAFETY: as above.
        assert!(unsafe { small.as_slice() }.iter().all(|&b| b == 0));
    }

    #[test]
    fn large_buffers_are_mappings_of_their_own_and_small_ones_heap() {
        for (len, align, mapped) in [
            (MAPPED_MIN, 64, true),
            (MAPPED_MIN + 100, 4096, true),
            (4 << 20, 4096, true),
            (MAPPED_MIN - 64, 64, false),
            (MAPPED_MIN, 8192, false),
        ] {
            let buf = AlignedBuf::new(len, align);
            assert_eq!((buf.len(), buf.mapped), (len, mapped), "{len} bytes aligned to {align}");
            assert_eq!(buf.addr() % align as u64, 0);
            // SAFETY: nothing else knows the buffer.
            let bytes = unsafe { buf.as_mut_slice() };
            assert!(bytes.iter().all(|&b| b == 0), "zeroed");
            bytes.fill(0xa5);
            assert_eq!(bytes[len - 1], 0xa5);
        }
        // A mapping reads as zero however it was reused before.
        for _ in 0..4 {
            let buf = AlignedBuf::new(MAPPED_MIN, 4096);
            // SAFETY: as above.
            let bytes = unsafe { buf.as_mut_slice() };
            assert!(bytes.iter().all(|&b| b == 0));
            bytes.fill(1);
        }
    }
}
