//! Protection domains and memory regions: `ibv_alloc_pd` and `ibv_reg_mr`
//! through sideway. Dropping a region deregisters it; `ibv_dereg_mr`
//! returns only once the device no longer touches the memory.

use std::sync::Arc;

use sideway::ibverbs::memory_region::{MemoryRegion, RegisterMemoryRegionErrorKind};
use sideway::ibverbs::protection_domain::ProtectionDomain;
use sideway::ibverbs::AccessFlags;

use super::device::Device;
use crate::fabric::{Access, FabricError, FabricErrorKind, Lkey, Result, Rkey};

/// A protection domain on one device.
pub struct VerbsPd {
    pub(crate) dev: Arc<Device>,
    pub(crate) pd: Arc<ProtectionDomain>,
}

impl VerbsPd {
    pub(crate) fn new(dev: Arc<Device>) -> Result<VerbsPd> {
        let pd = dev
            .ctx
            .alloc_pd()
            .map_err(|e| FabricError::new(FabricErrorKind::Io, format!("ibv_alloc_pd on {}: {e:?}", dev.name)))?;
        Ok(VerbsPd { dev, pd })
    }

    /// Registers `[addr, addr + len)`.
    ///
    /// # Safety
    /// See [`crate::fabric::ProtectionDomain::register`].
    pub unsafe fn register(&self, addr: *mut u8, len: usize, access: Access) -> Result<VerbsMr> {
        crate::fabric::check_registration(addr, len, access)?;
        let mut flags = AccessFlags::none();
        if access.contains(Access::LOCAL_WRITE) {
            flags |= AccessFlags::LocalWrite;
        }
        if access.contains(Access::REMOTE_WRITE) {
            flags |= AccessFlags::RemoteWrite;
        }
        if access.contains(Access::REMOTE_READ) {
            flags |= AccessFlags::RemoteRead;
        }
        if access.contains(Access::MW_BIND) {
            // The verbs provider binds no windows yet (see
            // `ProtectionDomain::supports_windows`): refuse rather than
            // register a region no peer could ever reach.
            return Err(crate::fabric::FabricError::new(
                crate::fabric::FabricErrorKind::Unsupported,
                "register: MW_BIND (memory windows) is not supported by the verbs provider",
            ));
        }
        // SAFETY: the caller guarantees the range is valid and outlives the
        // region (forwarded contract of ProtectionDomain::register).
        let mr = unsafe { self.pd.reg_mr(addr as usize, len, flags) }.map_err(|e| {
            let errno = match &e.0 {
                RegisterMemoryRegionErrorKind::Ibverbs(io) => io.raw_os_error(),
                _ => None,
            };
            let hint = if errno == Some(libc::ENOMEM) {
                " (locked-memory limit too low? see ulimit -l / LimitMEMLOCK)"
            } else {
                ""
            };
            FabricError::new(
                FabricErrorKind::Io,
                format!("ibv_reg_mr of {len} bytes on {} failed{hint}: {e:?}", self.dev.name),
            )
        })?;
        Ok(VerbsMr { mr, addr: addr as usize as u64, len, access })
    }
}

/// A registered region.
pub struct VerbsMr {
    mr: Arc<MemoryRegion>,
    addr: u64,
    len: usize,
    access: Access,
}

impl VerbsMr {
    pub fn lkey(&self) -> Lkey {
        Lkey(self.mr.lkey())
    }
    pub fn rkey(&self) -> Rkey {
        Rkey(self.mr.rkey())
    }
    pub fn addr(&self) -> u64 {
        self.addr
    }
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    pub fn access(&self) -> Access {
        self.access
    }
}
