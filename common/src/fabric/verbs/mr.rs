//! Protection domains and memory regions: `ibv_alloc_pd` and `ibv_reg_mr`
//! through sideway. Dropping a region deregisters it; `ibv_dereg_mr`
//! returns only once the device no longer touches the memory.

use std::sync::{Arc, Mutex};

use sideway::ibverbs::memory_region::{MemoryRegion, RegisterMemoryRegionErrorKind};
use sideway::ibverbs::protection_domain::ProtectionDomain;
use sideway::ibverbs::AccessFlags;

use super::device::Device;
use super::mw::{BindableRegion, BindableRegions};
use crate::fabric::{lock, Access, FabricError, FabricErrorKind, Lkey, Result, Rkey};

/// A protection domain on one device.
pub struct VerbsPd {
    pub(crate) dev: Arc<Device>,
    pub(crate) pd: Arc<ProtectionDomain>,
    /// Regions registered with `MW_BIND`, which queue pairs bind windows over.
    pub(crate) bindable: BindableRegions,
}

impl VerbsPd {
    pub(crate) fn new(dev: Arc<Device>) -> Result<VerbsPd> {
        let pd = dev
            .ctx
            .alloc_pd()
            .map_err(|e| FabricError::new(FabricErrorKind::Io, format!("ibv_alloc_pd on {}: {e:?}", dev.name)))?;
        Ok(VerbsPd { dev, pd, bindable: Arc::new(Mutex::new(Default::default())) })
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
            if !self.dev.windows {
                // Refuse rather than register a region no peer could reach.
                return Err(FabricError::new(
                    FabricErrorKind::Unsupported,
                    format!("register: {} has no type-2B memory windows (MW_BIND)", self.dev.name),
                ));
            }
            flags |= AccessFlags::MemoryWindowBind;
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
        let bindable = access.contains(Access::MW_BIND).then(|| {
            let entry = BindableRegion {
                mr: Arc::downgrade(&mr),
                rkey: mr.rkey(),
                addr: addr as usize as u64,
                len: len as u64,
                access,
            };
            lock(&self.bindable).insert(mr.lkey(), entry);
            self.bindable.clone()
        });
        Ok(VerbsMr { mr, addr: addr as usize as u64, len, access, bindable })
    }
}

/// A registered region.
pub struct VerbsMr {
    mr: Arc<MemoryRegion>,
    addr: u64,
    len: usize,
    access: Access,
    /// Where the region is listed for window binds (registered with MW_BIND).
    bindable: Option<BindableRegions>,
}

impl Drop for VerbsMr {
    fn drop(&mut self) {
        // No new window over it; bound ones keep the region registered
        // until their invalidation has executed (see the `mw` module).
        if let Some(b) = &self.bindable {
            lock(b).remove(&self.mr.lkey());
        }
    }
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
