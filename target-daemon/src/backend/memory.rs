//! The `memory` backend: a memfd (anonymous shmem file) of the volume's size.
//!
//! The data is kept in RAM while the target runs and lost when it stops.
//! Pages are allocated when first written, so a large volume costs only
//! what is used. It is served through io_uring exactly like a file (ReadFixed
//! / WriteFixed on the memfd as a fixed file), which keeps one data path for
//! both. FLUSH and FUA have nothing to make durable and succeed at once;
//! DISCARD and WRITE_ZEROES punch holes, which read back as zeroes.

use std::ffi::CString;
use std::fs::File;
use std::os::fd::{AsRawFd, RawFd};

use crate::config::VolumeConfig;
use crate::error::{Error, ErrorKind, Result};
use crate::sys;

/// A RAM-backed volume.
#[derive(Debug)]
pub struct MemoryBackend {
    file: File,
    size: u64,
}

impl MemoryBackend {
    /// Creates a zeroed memfd of `size` bytes.
    pub fn open(source: &str, vc: &VolumeConfig, size: u64) -> Result<MemoryBackend> {
        let name = CString::new(format!("rdmablk:{}", vc.name))
            .map_err(|_| Error::new(ErrorKind::Config, format!("{source}: {}: contains NUL", vc.key("name"))))?;
        let err = |what: &str, e: std::io::Error| {
            Error::with_source(ErrorKind::Volume, format!("{source}: {}: cannot {what} the RAM file", vc.key("backend")), e)
        };
        let file = sys::memfd_create(&name).map_err(|e| err("create", e))?;
        file.set_len(size).map_err(|e| err("size", e))?;
        Ok(MemoryBackend { file, size })
    }

    /// The memfd.
    pub fn fd(&self) -> RawFd {
        self.file.as_raw_fd()
    }

    /// Size in bytes.
    pub fn size(&self) -> u64 {
        self.size
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::BackendKind;
    use std::os::unix::fs::FileExt;

    #[test]
    fn a_sparse_zeroed_ram_file() {
        let vc = VolumeConfig {
            index: 0,
            name: "m".into(),
            backend: BackendKind::Memory,
            path: Default::default(),
            size: Some(1 << 30),
            block_size: None,
            read_only: false,
            nsid: None,
            rbd: None,
        };
        let m = MemoryBackend::open("t.toml", &vc, 1 << 30).unwrap();
        assert_eq!(m.size(), 1 << 30);
        assert_eq!(m.file.metadata().unwrap().len(), 1 << 30);
        let mut b = [1u8; 16];
        m.file.read_exact_at(&mut b, (1 << 30) - 16).unwrap();
        assert_eq!(b, [0; 16]);
    }
}
