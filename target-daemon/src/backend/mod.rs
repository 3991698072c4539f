//! Volumes and their backends.
//!
//! A [`Volume`] is what the protocol exports: a name, an id, a size in
//! blocks, a block size, flags. Its [`Backend`] is where the blocks live.
//! Only the `file` backend exists now (a regular file or a block device,
//! O_DIRECT through io_uring); `memory` and `null` backends can be added as
//! new variants without touching the protocol code, which asks the volume
//! what it supports.

pub mod file;

use std::os::fd::RawFd;

use rdmablk_common::protocol::{
    VolumeId, VolumeInfo, VOLUME_FLAG_DISCARD, VOLUME_FLAG_READ_ONLY, VOLUME_FLAG_WRITE_ZEROES,
};
use rdmablk_common::size::ByteSize;

use crate::config::{BackendKind, Config};
use crate::error::{Error, ErrorKind, Result};
pub use file::{FileBackend, FileKind};

/// Where a volume's blocks live.
#[derive(Debug)]
pub enum Backend {
    File(FileBackend),
}

/// An exported volume.
#[derive(Debug)]
pub struct Volume {
    /// Wire id: position in the configuration + 1 (0 means "no volume").
    pub id: VolumeId,
    /// Position in the configuration; also the io_uring fixed-file index.
    pub index: usize,
    pub name: String,
    pub read_only: bool,
    pub block_size: u32,
    /// Size in bytes (a multiple of `block_size`).
    pub size: u64,
    pub backend: Backend,
}

impl Volume {
    /// Size in blocks.
    pub fn blocks(&self) -> u64 {
        self.size / self.block_size as u64
    }

    /// Whether DISCARD can be served.
    pub fn supports_discard(&self) -> bool {
        match &self.backend {
            Backend::File(f) => f.kind() == FileKind::Regular,
        }
    }

    /// Whether WRITE_ZEROES can be served.
    pub fn supports_write_zeroes(&self) -> bool {
        match &self.backend {
            Backend::File(f) => f.kind() == FileKind::Regular,
        }
    }

    /// The descriptor to register with io_uring.
    pub fn uring_fd(&self) -> RawFd {
        match &self.backend {
            Backend::File(f) => f.fd(),
        }
    }

    /// What OPEN replies and LIST writes.
    pub fn info(&self) -> VolumeInfo {
        let mut flags = 0;
        if self.read_only {
            flags |= VOLUME_FLAG_READ_ONLY;
        } else {
            if self.supports_discard() {
                flags |= VOLUME_FLAG_DISCARD;
            }
            if self.supports_write_zeroes() {
                flags |= VOLUME_FLAG_WRITE_ZEROES;
            }
        }
        VolumeInfo { volume_id: self.id, block_size: self.block_size, size_bytes: self.size, flags, name: self.name.clone() }
    }

    /// Makes completed writes durable (fdatasync).
    pub fn sync(&self) -> std::io::Result<()> {
        match &self.backend {
            Backend::File(f) => f.sync(),
        }
    }

    /// One line for logs and `--check`.
    pub fn describe(&self) -> String {
        match &self.backend {
            Backend::File(f) => format!(
                "volume {}: backend=file path={} ({}) size={} block_size={} {}",
                self.name,
                f.path().display(),
                f.kind(),
                ByteSize(self.size),
                self.block_size,
                if self.read_only { "ro" } else { "rw" },
            ),
        }
    }
}

/// Opens every configured volume for serving (creating or growing regular
/// files where the configuration says so).
pub fn open_volumes(config: &Config) -> Result<Vec<Volume>> {
    let mut volumes: Vec<Volume> = Vec::with_capacity(config.volumes.len());
    for vc in &config.volumes {
        let (backend, size, block_size) = match vc.backend {
            BackendKind::File => {
                let f = FileBackend::open(&config.source, vc)?;
                let (size, bs) = (f.size(), f.block_size());
                (Backend::File(f), size, bs)
            }
        };
        for other in &volumes {
            let (Backend::File(a), Backend::File(b)) = (&other.backend, &backend);
            if a.identity() == b.identity() {
                return Err(Error::new(
                    ErrorKind::Config,
                    format!(
                        "{}: {}: {} is the same file as volume {:?}",
                        config.source,
                        vc.key("path"),
                        vc.path.display(),
                        other.name
                    ),
                ));
            }
        }
        let v = Volume {
            id: VolumeId(vc.index as u32 + 1),
            index: vc.index,
            name: vc.name.clone(),
            read_only: vc.read_only,
            block_size,
            size,
            backend,
        };
        let info = v.info();
        tracing::info!(
            "{}; discard={} write_zeroes={}",
            v.describe(),
            info.flags & VOLUME_FLAG_DISCARD != 0,
            info.flags & VOLUME_FLAG_WRITE_ZEROES != 0
        );
        volumes.push(v);
    }
    Ok(volumes)
}

/// Validates every volume without creating or changing anything; one line per volume.
pub fn check_volumes(config: &Config) -> Result<Vec<String>> {
    let mut lines = Vec::new();
    for vc in &config.volumes {
        match vc.backend {
            BackendKind::File => {
                let c = FileBackend::check(&config.source, vc)?;
                let mut line = format!(
                    "volume {}: backend=file path={} ({}) size={} block_size={} {}",
                    vc.name,
                    vc.path.display(),
                    c.kind,
                    ByteSize(c.size),
                    c.block_size,
                    if vc.read_only { "ro" } else { "rw" },
                );
                if let Some(action) = c.action {
                    line.push_str(&format!(" ({action})"));
                }
                lines.push(line);
            }
        }
    }
    Ok(lines)
}
