//! Owned, aligned, zeroed memory for registration with the fabric and with
//! io_uring (O_DIRECT needs block-aligned buffers).

use std::alloc::{alloc, alloc_zeroed, dealloc, Layout};
use std::ptr::NonNull;

/// Size of a transparent huge page on x86-64 and aarch64 (4 KiB base pages).
const HUGE_PAGE: usize = 2 << 20;

/// A heap allocation with a chosen alignment. It hands out raw pointers only:
/// once registered, a peer or the kernel may write into it at any time, so
/// safe slices are offered through `unsafe` accessors whose callers promise
/// that no such write is in flight.
pub struct AlignedBuf {
    ptr: NonNull<u8>,
    layout: Layout,
}

// SAFETY: the buffer is plain memory owned by this value; moving it between
// threads moves ownership, and shared access only hands out raw pointers.
unsafe impl Send for AlignedBuf {}
// SAFETY: as above; `&AlignedBuf` exposes no safe way to read or write the bytes.
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    /// Allocates `len` zeroed bytes aligned to `align` (a power of two).
    /// Panics if `len` is zero or the layout is invalid; aborts on OOM.
    pub fn new(len: usize, align: usize) -> Self {
        assert!(len > 0, "AlignedBuf of zero length");
        let layout = Layout::from_size_align(len, align).expect("valid alignment");
        // SAFETY: the layout has a non-zero size.
        let raw = unsafe { alloc_zeroed(layout) };
        let ptr = NonNull::new(raw).unwrap_or_else(|| std::alloc::handle_alloc_error(layout));
        AlignedBuf { ptr, layout }
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
    /// KiB pages and 2.4–2.5 GB/s with huge pages (BENCHMARKS.md, "Huge
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
        AlignedBuf { ptr, layout }
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
        // SAFETY: allocated in `new` with this exact layout.
        unsafe { dealloc(self.ptr.as_ptr(), self.layout) }
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
}
