//! Registered memory: the crate-internal [`Region`] and the public
//! [`IoBuffer`]. Every `unsafe` block of the initiator lives in this file.
//!
//! # The invariant that makes the safe accessors sound
//! A peer (the target) or the local provider writes into registered memory
//! only through work requests or descriptors this library posted or sent.
//! The library
//! - posts a receive into a range of a [`Region`] and never reads that range
//!   until the receive completed, and does not repost it while a slice lives;
//! - names a range in a command (descriptor or send SGE) only while the
//!   caller holds the borrow that covers it (`&mut IoBuffer` for reads,
//!   `&IoBuffer` for writes, `&mut` access to an internal region), and
//!   returns from that call only after the command's response arrived or
//!   after the queue pair was moved to the error state, after which the
//!   provider touches none of its memory again.
//!
//! Under that invariant, a slice handed out here never overlaps memory that
//! the provider or peer is writing. It assumes a target that keeps the
//! protocol: a target that RDMA-WRITEs with an rkey after the command's
//! response can change memory under a live slice, as with any RDMA
//! initiator whose keys stay registered.

use std::fmt;
use std::ops::Range;
use std::sync::Arc;

use rdmablk_common::fabric::{Access, AlignedBuf, FabricError, Lkey, MemoryRegion, ProtectionDomain, Rkey, Sge};
use rdmablk_common::protocol::DataDescriptor;

use crate::domain::Domain;

/// Alignment of registered buffers: a page, which also suits O_DIRECT.
pub(crate) const BUFFER_ALIGN: usize = 4096;

/// Registered memory owned by the library.
pub(crate) struct Region {
    // Field order matters: the registration is dropped (and the provider
    // stops touching the memory) before the memory is freed.
    mr: MemoryRegion,
    buf: AlignedBuf,
}

impl Region {
    /// Allocates `len` zeroed bytes and registers them with `access`.
    pub(crate) fn new(pd: &ProtectionDomain, len: usize, access: Access) -> Result<Region, FabricError> {
        let buf = AlignedBuf::new(len, BUFFER_ALIGN);
        // SAFETY: `buf` is a live allocation of `buf.len()` bytes, valid for
        // reads and writes. It is stored next to the region in `Region`, whose
        // field order drops (deregisters) `mr` before `buf` is freed, and an
        // `AlignedBuf` moving does not move its heap memory. The library only
        // creates Rust references into it under the module invariant.
        let mr = unsafe { pd.register(buf.as_ptr(), buf.len(), access)? };
        Ok(Region { mr, buf })
    }

    pub(crate) fn len(&self) -> usize {
        self.buf.len()
    }

    pub(crate) fn addr(&self) -> u64 {
        self.buf.addr()
    }

    pub(crate) fn lkey(&self) -> Lkey {
        self.mr.lkey()
    }

    pub(crate) fn rkey(&self) -> Rkey {
        self.mr.rkey()
    }

    /// An SGE for `[offset, offset + len)`.
    pub(crate) fn sge(&self, offset: usize, len: usize) -> Sge {
        debug_assert!(offset + len <= self.len());
        Sge { addr: self.addr() + offset as u64, length: len as u32, lkey: self.lkey() }
    }

    /// Shared view of `range`. Crate rule (module invariant): no receive is
    /// posted into `range` and no outstanding command lets the peer write it.
    pub(crate) fn bytes(&self, range: Range<usize>) -> &[u8] {
        assert!(range.start <= range.end && range.end <= self.len(), "range outside region");
        // SAFETY: in bounds of the live allocation (checked above); nothing
        // writes the range while the slice lives (module invariant, upheld by
        // the callers in this crate).
        unsafe { std::slice::from_raw_parts(self.buf.as_ptr().add(range.start), range.len()) }
    }

    /// Exclusive view of `range`. Crate rule (module invariant): no work
    /// request or outstanding command references `range`.
    pub(crate) fn bytes_mut(&mut self, range: Range<usize>) -> &mut [u8] {
        assert!(range.start <= range.end && range.end <= self.len(), "range outside region");
        // SAFETY: in bounds of the live allocation (checked above); `&mut self`
        // rules out other slices from this crate, and no provider or peer
        // access to the range is in flight (module invariant).
        unsafe { std::slice::from_raw_parts_mut(self.buf.as_ptr().add(range.start), range.len()) }
    }
}

/// A buffer registered once with the session for zero-copy I/O
/// ([`Volume::read_into`](crate::Volume::read_into),
/// [`Volume::write_from`](crate::Volume::write_from)): the target places read
/// data straight into it and fetches write data straight from it.
///
/// Allocate with [`Session::alloc_buffer`](crate::Session::alloc_buffer). It
/// is page aligned, zero-filled at allocation, and usable only with volumes
/// of the session that allocated it (its keys mean nothing elsewhere).
///
/// The accessors are safe: the target touches the buffer only while a call
/// that borrows it (mutably for reads) is running, and every such call
/// returns only after the target is done with it or the connection is closed.
pub struct IoBuffer {
    // Field order matters: the region (and its memory) goes before the
    // protection domain it was registered with.
    region: Region,
    domain: Arc<Domain>,
}

impl IoBuffer {
    pub(crate) fn new(domain: Arc<Domain>, len: usize) -> Result<IoBuffer, FabricError> {
        let access = domain.access_for(Access::REMOTE_WRITE | Access::REMOTE_READ);
        let region = Region::new(domain.pd(), len, access)?;
        Ok(IoBuffer { region, domain })
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.region.len()
    }

    /// Always false: zero-length buffers cannot be allocated.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// The contents.
    pub fn as_slice(&self) -> &[u8] {
        self.region.bytes(0..self.region.len())
    }

    /// The contents, for filling before a write or after a read.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        let len = self.region.len();
        self.region.bytes_mut(0..len)
    }

    /// The descriptor that names `[offset, offset + length)` of this buffer
    /// in a command. Not bounds checked, so system tests can name ranges
    /// the target must refuse.
    #[doc(hidden)]
    pub fn descriptor(&self, offset: usize, length: u32) -> DataDescriptor {
        DataDescriptor { remote_addr: self.region.addr() + offset as u64, length, rkey: self.region.rkey().0 }
    }

    pub(crate) fn region(&self) -> &Region {
        &self.region
    }

    pub(crate) fn domain(&self) -> &Arc<Domain> {
        &self.domain
    }
}

impl AsRef<[u8]> for IoBuffer {
    fn as_ref(&self) -> &[u8] {
        self.as_slice()
    }
}

impl AsMut<[u8]> for IoBuffer {
    fn as_mut(&mut self) -> &mut [u8] {
        self.as_mut_slice()
    }
}

impl fmt::Debug for IoBuffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "IoBuffer({:#x}, {} bytes)", self.region.addr(), self.region.len())
    }
}
