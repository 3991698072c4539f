//! Owned, aligned, zeroed memory for registration with the fabric and with
//! io_uring (O_DIRECT needs block-aligned buffers).

use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::ptr::NonNull;

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
