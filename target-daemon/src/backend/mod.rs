//! Volumes and their backends.
//!
//! A [`Volume`] is what the protocol exports: a name, an id, a size, a block
//! size, flags. Its [`Backend`] is where the blocks live:
//!
//! | backend | READ / WRITE | FLUSH | FUA | DISCARD | WRITE_ZEROES | durability |
//! |---|---|---|---|---|---|---|
//! | `file`, regular file | io_uring ReadFixed/WriteFixed, O_DIRECT | fdatasync | RWF_DSYNC | fallocate(PUNCH_HOLE) | fallocate(ZERO_RANGE), else PUNCH_HOLE | survives power loss after FLUSH or FUA |
//! | `file`, block device | the same, on the device | fdatasync (cache flush) | RWF_DSYNC (FUA) | BLKDISCARD, when the device discards | BLKZEROOUT | survives power loss after FLUSH or FUA |
//! | `memory` | io_uring on a memfd (RAM) | no-op | no-op | fallocate(PUNCH_HOLE) | fallocate(PUNCH_HOLE) (reads back zeroes) | none: kept while the target runs, lost when it stops |
//! | `null` | reads return zeroes, writes are dropped (their data still crosses the fabric) | no-op | no-op | no-op | no-op | none: nothing is stored |
//! | `rbd` | librbd aio on the pool chunk ([`rbd`]) | rbd flush | no-op (librbd's cache is off) | rbd discard | rbd write-zeroes | the Ceph cluster's; one owner among several gateways ([`ownership`]) |
//!
//! Only what really works is advertised (VolumeInfo flags): the file backend
//! probes fallocate on a temporary file in the volume's directory, and a
//! block device's `queue/discard_max_bytes`, when it opens the volume.
//! Blocking ioctls (BLKDISCARD, BLKZEROOUT) run on the reactor's blocking
//! worker, never on the reactor itself.

pub mod file;
pub mod memory;
pub mod ownership;
pub mod rbd;

use std::fmt;
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use rdmablk_common::protocol::{
    VolumeId, VolumeInfo, VOLUME_FLAG_DISCARD, VOLUME_FLAG_READ_ONLY, VOLUME_FLAG_WRITE_ZEROES,
};
use rdmablk_common::size::ByteSize;

pub mod table;

use table::{VolumeMeta, VolumeTable};
use crate::config::{BackendKind, Config, VolumeConfig, DEFAULT_FILE_BLOCK_SIZE};
use crate::error::{Error, ErrorKind, Result};
use crate::metrics::VolumeStats;
pub use file::{FileBackend, FileKind};
pub use memory::MemoryBackend;
pub use ownership::{Access, Ownership};
pub use rbd::RbdBackend;

/// `fallocate` mode for DISCARD.
pub const PUNCH_HOLE: i32 = libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE;
/// `fallocate` mode for WRITE_ZEROES.
pub const ZERO_RANGE: i32 = libc::FALLOC_FL_ZERO_RANGE | libc::FALLOC_FL_KEEP_SIZE;

/// How a volume carries out DISCARD or WRITE_ZEROES.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RangeOp {
    /// fallocate with this mode: through io_uring, or the blocking worker on an iopoll ring.
    Fallocate(i32),
    /// ioctl BLKDISCARD, on the blocking worker.
    BlkDiscard,
    /// ioctl BLKZEROOUT, on the blocking worker.
    BlkZeroout,
    /// Nothing to do (the `null` backend).
    Nothing,
    /// librbd discard (the image's objects are trimmed or deleted).
    RbdDiscard,
    /// librbd write-zeroes.
    RbdWriteZeroes,
}

/// A command's byte ranges `(offset, len)`. One range, which every Write
/// and Write Zeroes has, is held inline: the per-I/O path allocates
/// nothing. Only a Dataset Management command's ranges (up to 256, read
/// from its data) go to the heap.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ByteRanges {
    None,
    One((u64, u64)),
    Many(Vec<(u64, u64)>),
}

impl std::ops::Deref for ByteRanges {
    type Target = [(u64, u64)];

    fn deref(&self) -> &[(u64, u64)] {
        match self {
            ByteRanges::None => &[],
            ByteRanges::One(r) => std::slice::from_ref(r),
            ByteRanges::Many(v) => v,
        }
    }
}

impl fmt::Display for RangeOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            RangeOp::Fallocate(m) if m == PUNCH_HOLE => f.write_str("fallocate(PUNCH_HOLE)"),
            RangeOp::Fallocate(m) if m == ZERO_RANGE => f.write_str("fallocate(ZERO_RANGE)"),
            RangeOp::Fallocate(m) => write!(f, "fallocate({m:#x})"),
            RangeOp::BlkDiscard => f.write_str("BLKDISCARD"),
            RangeOp::BlkZeroout => f.write_str("BLKZEROOUT"),
            RangeOp::Nothing => f.write_str("no-op"),
            RangeOp::RbdDiscard => f.write_str("rbd discard"),
            RangeOp::RbdWriteZeroes => f.write_str("rbd write-zeroes"),
        }
    }
}

fn show(op: Option<RangeOp>) -> String {
    op.map_or_else(|| "unsupported".to_owned(), |o| o.to_string())
}

/// Where a volume's blocks live.
#[derive(Debug)]
pub enum Backend {
    File(FileBackend),
    Memory(MemoryBackend),
    Null,
    Rbd(RbdBackend),
}

impl Backend {
    /// The descriptor io_uring registers as a fixed file (`None`: no disk I/O).
    pub fn uring_fd(&self) -> Option<RawFd> {
        match self {
            Backend::File(f) => Some(f.fd()),
            Backend::Memory(m) => Some(m.fd()),
            Backend::Null | Backend::Rbd(_) => None,
        }
    }

    /// Whether the backend was opened for writing.
    pub fn writable(&self) -> bool {
        match self {
            Backend::File(f) => f.writable(),
            Backend::Rbd(r) => r.writable(),
            Backend::Memory(_) | Backend::Null => true,
        }
    }

    /// How DISCARD is done, if at all.
    pub fn discard(&self) -> Option<RangeOp> {
        match self {
            Backend::File(f) => f.discard(),
            Backend::Memory(_) => Some(RangeOp::Fallocate(PUNCH_HOLE)),
            Backend::Null => Some(RangeOp::Nothing),
            Backend::Rbd(_) => Some(RangeOp::RbdDiscard),
        }
    }

    /// How WRITE_ZEROES is done, if at all.
    pub fn write_zeroes(&self) -> Option<RangeOp> {
        match self {
            Backend::File(f) => f.write_zeroes(),
            // shmem has no ZERO_RANGE; a punched hole reads back as zeroes.
            Backend::Memory(_) => Some(RangeOp::Fallocate(PUNCH_HOLE)),
            Backend::Null => Some(RangeOp::Nothing),
            Backend::Rbd(_) => Some(RangeOp::RbdWriteZeroes),
        }
    }

    /// Whether FLUSH has anything to do (`file` and `rbd`).
    pub fn needs_flush(&self) -> bool {
        matches!(self, Backend::File(_) | Backend::Rbd(_))
    }

    /// Makes completed writes durable (fdatasync); a no-op for RAM and null.
    pub fn sync(&self) -> std::io::Result<()> {
        match self {
            Backend::File(f) => f.sync(),
            // Only an owner has writes of its own to flush: a standby wrote
            // nothing, and a fenced gateway's client is refused by the OSDs
            // (its held writes must never land).
            Backend::Rbd(r) if r.ownership().access() == Access::Owner => r.flush(),
            Backend::Rbd(_) | Backend::Memory(_) | Backend::Null => Ok(()),
        }
    }

    /// Who may serve the volume, for a volume several gateways share
    /// (`None`: only this target serves it, always as its owner).
    pub fn ownership(&self) -> Option<&Ownership> {
        match self {
            Backend::Rbd(r) => Some(r.ownership()),
            Backend::File(_) | Backend::Memory(_) | Backend::Null => None,
        }
    }

    /// The backend kind.
    pub fn kind(&self) -> BackendKind {
        match self {
            Backend::File(_) => BackendKind::File,
            Backend::Memory(_) => BackendKind::Memory,
            Backend::Null => BackendKind::Null,
            Backend::Rbd(_) => BackendKind::Rbd,
        }
    }

    /// The backend name as configured.
    pub fn kind_name(&self) -> &'static str {
        match self {
            Backend::File(_) => "file",
            Backend::Memory(_) => "memory",
            Backend::Null => "null",
            Backend::Rbd(_) => "rbd",
        }
    }
}

/// Stripes of a volume's write epochs (see [`WriteEpochs`]).
const EPOCH_STRIPES: usize = 256;
/// Bytes of a volume each stripe stands for: a default pool chunk, so that
/// a write leaves the chunks read ahead beside it usable. Volume offsets
/// wrap around the stripes every `EPOCH_STRIPES * EPOCH_STRIPE` (32 MiB).
const EPOCH_STRIPE: u64 = 128 << 10;

/// Counts the writes to a volume by region, for readahead: a chunk read
/// ahead serves a READ only if the epoch of its range has not moved since
/// its read was submitted. Every WRITE, WRITE_ZEROES and DISCARD bumps the
/// epoch of its range when it starts (before its disk I/O is submitted)
/// and again when its disk I/O is done (before it is answered), on
/// whichever reactor serves it, so a chunk read before or during a write
/// is never served after it. Regions are stripes, so that a write elsewhere
/// in the volume leaves a sequential reader's readahead usable.
#[derive(Debug)]
pub struct WriteEpochs {
    stripes: [AtomicU64; EPOCH_STRIPES],
}

impl Default for WriteEpochs {
    fn default() -> Self {
        WriteEpochs { stripes: std::array::from_fn(|_| AtomicU64::new(0)) }
    }
}

impl WriteEpochs {
    /// The stripes `len` bytes at `offset` touch (all of them for a long range).
    fn stripes(offset: u64, len: u64) -> impl Iterator<Item = usize> {
        let first = offset / EPOCH_STRIPE;
        let last = offset.saturating_add(len.max(1) - 1) / EPOCH_STRIPE;
        let n = (last - first + 1).min(EPOCH_STRIPES as u64);
        (0..n).map(move |k| ((first + k) % EPOCH_STRIPES as u64) as usize)
    }

    /// A write of `len` bytes at `offset` starts or ends.
    pub fn bump(&self, offset: u64, len: u64) {
        for i in Self::stripes(offset, len) {
            self.stripes[i].fetch_add(1, Ordering::SeqCst);
        }
    }

    /// The epoch of `len` bytes at `offset`: it changes with every bump of
    /// an overlapping range.
    pub fn of(&self, offset: u64, len: u32) -> u64 {
        Self::stripes(offset, len as u64).fold(0u64, |sum, i| sum.wrapping_add(self.stripes[i].load(Ordering::SeqCst)))
    }
}

/// An exported volume. Immutable: a reload that changes the read-only flag
/// publishes a new `Volume` with the same id, stats and (when possible) backend.
#[derive(Debug)]
pub struct Volume {
    /// Wire id, stable while the target runs and never reused for another volume.
    pub id: VolumeId,
    /// NVMe namespace id: `nsid =`, or the id it was first opened with (a
    /// gateway's image reopened after a fence keeps it, under a new id).
    pub nsid: u32,
    pub name: String,
    /// The configuration it was opened from (compared on reload).
    pub config: VolumeConfig,
    pub read_only: bool,
    pub block_size: u32,
    /// Size in bytes (a multiple of `block_size`).
    pub size: u64,
    pub backend: Arc<Backend>,
    pub stats: Arc<VolumeStats>,
    /// Shared with the same volume after a reload, as its stats.
    pub writes: Arc<WriteEpochs>,
}

impl Volume {
    /// Opens the backend of `vc` for serving, as volume `id`.
    /// `reactors` sizes its counters; `iopoll` demands a pollable device.
    pub fn open(source: &str, vc: &VolumeConfig, id: VolumeId, reactors: usize, iopoll: bool) -> Result<Volume> {
        let (backend, size, block_size) = open_backend(source, vc, vc.read_only, iopoll)?;
        let v = Volume {
            id,
            nsid: vc.nsid.unwrap_or(id.0),
            name: vc.name.clone(),
            config: vc.clone(),
            read_only: vc.read_only,
            block_size,
            size,
            backend: Arc::new(backend),
            stats: Arc::new(VolumeStats::new(reactors)),
            writes: Arc::default(),
        };
        tracing::info!("{}", v.describe());
        Ok(v)
    }

    /// The same volume with another read-only flag (and configuration
    /// position). A read-only backend is reopened for writing.
    pub fn with_read_only(&self, source: &str, vc: &VolumeConfig, iopoll: bool) -> Result<Volume> {
        let backend = if !vc.read_only && !self.backend.writable() {
            let (b, size, bs) = open_backend(source, vc, false, iopoll)?;
            if size != self.size || bs != self.block_size {
                return Err(Error::new(
                    ErrorKind::Volume,
                    format!("{source}: {}: reopened read-write, the size or block size changed", vc.key("read_only")),
                ));
            }
            Arc::new(b)
        } else {
            Arc::clone(&self.backend)
        };
        Ok(Volume {
            id: self.id,
            nsid: self.nsid,
            name: self.name.clone(),
            config: vc.clone(),
            read_only: vc.read_only,
            block_size: self.block_size,
            size: self.size,
            backend,
            stats: Arc::clone(&self.stats),
            writes: Arc::clone(&self.writes),
        })
    }

    /// What this target may do with the volume now ([`Access::Owner`]
    /// unless several gateways share it).
    pub fn access(&self) -> Access {
        self.backend.ownership().map_or(Access::Owner, Ownership::access)
    }

    /// Checks with the store that [`Volume::access`] still holds (an rbd
    /// owner may have been taken over unawares; see
    /// [`rbd::RbdBackend::confirm_ownership`]). Blocks: reload only.
    pub fn confirm_access(&self) {
        if let Backend::Rbd(r) = &*self.backend {
            r.confirm_ownership();
        }
    }

    /// Changes of [`Volume::access`] so far (0 for a volume not shared).
    pub fn access_generation(&self) -> u64 {
        self.backend.ownership().map_or(0, Ownership::generation)
    }

    /// Size in blocks.
    pub fn blocks(&self) -> u64 {
        self.size / self.block_size as u64
    }

    /// Whether DISCARD can be served.
    pub fn supports_discard(&self) -> bool {
        self.backend.discard().is_some()
    }

    /// Whether WRITE_ZEROES can be served.
    pub fn supports_write_zeroes(&self) -> bool {
        self.backend.write_zeroes().is_some()
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
        self.backend.sync()
    }

    /// One line for logs: what it is and what it supports.
    pub fn describe(&self) -> String {
        let what = match &*self.backend {
            Backend::File(f) => format!("backend=file path={} ({})", f.path().display(), f.kind()),
            Backend::Memory(_) => "backend=memory (RAM, lost when the target stops)".to_owned(),
            Backend::Null => "backend=null (reads return zeroes, writes are dropped)".to_owned(),
            Backend::Rbd(r) => format!(
                "backend=rbd image={} client.{} {}",
                r.config().spec(),
                r.config().client,
                if r.config().lock_at_start { "(lock_at_start: owner)" } else { "(standby: takes the image over at the first command)" }
            ),
        };
        let (discard, zeroes) = if self.read_only {
            ("read-only".to_owned(), "read-only".to_owned())
        } else {
            (show(self.backend.discard()), show(self.backend.write_zeroes()))
        };
        format!(
            "volume {} (id {}): {what} size={} block_size={} {}; discard={discard} write_zeroes={zeroes}",
            self.name,
            self.id,
            ByteSize(self.size),
            self.block_size,
            if self.read_only { "ro" } else { "rw" },
        )
    }

    /// Refuses a volume whose file or device another served volume already uses.
    pub fn check_distinct(&self, source: &str, others: &[Arc<Volume>]) -> Result<()> {
        let Backend::File(a) = &*self.backend else { return Ok(()) };
        for other in others.iter().filter(|o| o.id != self.id) {
            if let Backend::File(b) = &*other.backend {
                if a.identity() == b.identity() {
                    return Err(Error::new(
                        ErrorKind::Config,
                        format!(
                            "{source}: {}: {} is the same file as volume {:?}",
                            self.config.key("path"),
                            self.config.path.display(),
                            other.name
                        ),
                    ));
                }
            }
        }
        Ok(())
    }
}

fn open_backend(source: &str, vc: &VolumeConfig, read_only: bool, iopoll: bool) -> Result<(Backend, u64, u32)> {
    let err = |key: &str, why: String| Error::new(ErrorKind::Volume, format!("{source}: {}: {why}", vc.key(key)));
    match vc.backend {
        BackendKind::File => {
            let mut vc = vc.clone();
            vc.read_only = read_only;
            let f = FileBackend::open(source, &vc)?;
            if iopoll && !f.pollable() {
                return Err(err(
                    "path",
                    format!(
                        "{}: target.iopoll is set but this {} is not on a block device with poll queues \
                         (queue/io_poll is not 1; load nvme with poll_queues=N)",
                        vc.path.display(),
                        f.kind()
                    ),
                ));
            }
            let (size, bs) = (f.size(), f.block_size());
            Ok((Backend::File(f), size, bs))
        }
        BackendKind::Memory => {
            let (size, bs) = sized(vc)?;
            Ok((Backend::Memory(MemoryBackend::open(source, vc, size)?), size, bs))
        }
        BackendKind::Null => {
            let (size, bs) = sized(vc)?;
            Ok((Backend::Null, size, bs))
        }
        BackendKind::Rbd => {
            let rc = vc.rbd.as_ref().ok_or_else(|| err("image", "is required for backend \"rbd\"".into()))?;
            if iopoll {
                return Err(err("backend", "\"rbd\" cannot be served on a polled ring (target.iopoll = true)".into()));
            }
            let (r, mut size) = RbdBackend::open(source, vc, rc, read_only)?;
            let bs = vc.block_size.unwrap_or(DEFAULT_FILE_BLOCK_SIZE);
            match vc.size {
                Some(want) if want > size && read_only => {
                    return Err(err("size", format!("the image is {}, smaller than size {}, and a read-only volume is not grown", ByteSize(size), ByteSize(want))))
                }
                Some(want) if want > size => {
                    tracing::info!("{source}: {}: growing rbd image {} from {} to {}", vc.key("size"), rc.spec(), ByteSize(size), ByteSize(want));
                    r.grow(want)?;
                    size = want;
                }
                Some(want) if want < size => {
                    return Err(err("size", format!("the image is {}, larger than size {} (images are not shrunk; remove size or raise it)", ByteSize(size), ByteSize(want))))
                }
                _ => {}
            }
            if size == 0 || size % bs as u64 != 0 {
                return Err(err("image", format!("rbd image {} is {size} bytes, not a non-zero multiple of the block size {bs}", rc.spec())));
            }
            Ok((Backend::Rbd(r), size, bs))
        }
    }
}

/// Size and block size of a `memory` or `null` volume (the config requires a size).
fn sized(vc: &VolumeConfig) -> Result<(u64, u32)> {
    let size = vc.size.ok_or_else(|| Error::new(ErrorKind::Config, format!("{}: required", vc.key("size"))))?;
    let bs = vc.block_size.unwrap_or(DEFAULT_FILE_BLOCK_SIZE);
    if size % bs as u64 != 0 {
        return Err(Error::new(ErrorKind::Config, format!("{}: {size} is not a multiple of the block size {bs}", vc.key("size"))));
    }
    Ok((size, bs))
}

/// Opens every configured volume for serving (creating or growing regular
/// files where the configuration says so); ids are 1, 2, ... in order.
pub fn open_volumes(config: &Config) -> Result<Vec<Arc<Volume>>> {
    let mut volumes: Vec<Arc<Volume>> = Vec::with_capacity(config.volumes.len());
    for vc in &config.volumes {
        let v = Volume::open(&config.source, vc, VolumeId(vc.index as u32 + 1), config.target.reactors, config.target.iopoll)?;
        v.check_distinct(&config.source, &volumes)?;
        volumes.push(Arc::new(v));
    }
    Ok(volumes)
}

/// Validates every volume without creating or changing anything; one line per volume.
pub fn check_volumes(config: &Config) -> Result<Vec<String>> {
    let mut lines = Vec::new();
    for vc in &config.volumes {
        let access = if vc.read_only { "ro" } else { "rw" };
        match vc.backend {
            BackendKind::File => {
                let c = FileBackend::check(&config.source, vc)?;
                let mut line = format!(
                    "volume {}: backend=file path={} ({}) size={} block_size={} {access}",
                    vc.name,
                    vc.path.display(),
                    c.kind,
                    ByteSize(c.size),
                    c.block_size,
                );
                if let Some(action) = c.action {
                    line.push_str(&format!(" ({action})"));
                }
                lines.push(line);
            }
            BackendKind::Rbd => {
                // Opened read-only: no lock is taken, nothing is grown.
                let rc = vc.rbd.as_ref().ok_or_else(|| Error::new(ErrorKind::Config, format!("{}: required", vc.key("image"))))?;
                let (_, size) = RbdBackend::open(&config.source, vc, rc, true)?;
                let grow = match vc.size {
                    Some(want) if want > size => format!(" (would grow to {})", ByteSize(want)),
                    _ => String::new(),
                };
                lines.push(format!(
                    "volume {}: backend=rbd image={} client.{} size={}{grow} {access}",
                    vc.name,
                    rc.spec(),
                    rc.client,
                    ByteSize(size)
                ));
            }
            BackendKind::Memory | BackendKind::Null => {
                let (size, bs) = sized(vc)?;
                lines.push(format!("volume {}: backend={} size={} block_size={bs} {access}", vc.name, vc.backend, ByteSize(size)));
            }
        }
    }
    Ok(lines)
}

/// The published volume set: the control thread publishes a new one at
/// start and at each reload; every reactor follows it (one atomic load of
/// the generation per turn tells whether it moved).
#[derive(Debug)]
pub struct Publication {
    set: arc_swap::ArcSwap<VolumeSet>,
    generation: AtomicU64,
}

impl Publication {
    pub fn new(set: VolumeSet) -> Publication {
        let generation = AtomicU64::new(set.generation);
        Publication { set: arc_swap::ArcSwap::from_pointee(set), generation }
    }

    /// The generation of the published set: one load.
    #[inline]
    pub fn generation(&self) -> u64 {
        self.generation.load(Ordering::Acquire)
    }

    /// The published set.
    pub fn volumes(&self) -> Arc<VolumeSet> {
        self.set.load_full()
    }

    /// Publishes `set` (its generation must be above the last).
    pub fn publish(&self, set: VolumeSet) {
        let generation = set.generation;
        self.set.store(Arc::new(set));
        self.generation.store(generation, Ordering::Release);
    }
}

/// The volumes served at one moment, as published to the reactors.
#[derive(Debug)]
pub struct VolumeSet {
    /// Increases with every publication.
    pub generation: u64,
    /// In configuration order.
    pub volumes: Vec<Arc<Volume>>,
    /// What command validation needs, in the same order.
    pub table: VolumeTable,
    /// Host keys and volume grants, published with the volumes so that a
    /// reload's grants reach every reactor with its volume snapshot.
    pub access: Arc<crate::auth::AccessPolicy>,
}

impl VolumeSet {
    /// A set of `volumes` at `generation`, with no `[[host]]` and no grants
    /// (nobody may open anything): give it a policy with [`VolumeSet::with_access`].
    pub fn new(generation: u64, volumes: Vec<Arc<Volume>>) -> VolumeSet {
        let table = VolumeTable::new(volumes.iter().map(|v| VolumeMeta::of(v)).collect());
        VolumeSet { generation, volumes, table, access: Arc::default() }
    }

    /// The same set under `access` (grants of volumes it does not name: none).
    pub fn with_access(mut self, access: Arc<crate::auth::AccessPolicy>) -> VolumeSet {
        self.table = self.table.with_access(&access);
        self.access = access;
        self
    }

    /// The volume named `name`.
    pub fn by_name(&self, name: &str) -> Option<&Arc<Volume>> {
        self.volumes.iter().find(|v| v.name == name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_write_moves_the_epoch_of_every_range_it_overlaps_and_only_those() {
        let w = WriteEpochs::default();
        let stripe = EPOCH_STRIPE;
        let chunk = stripe as u32;
        let (before, at, after, far) = (w.of(0, chunk), w.of(stripe, chunk), w.of(2 * stripe, chunk), w.of(8 * stripe, chunk));
        // The last block of stripe 0 and the first of stripe 1.
        w.bump(stripe - 4096, 8192);
        assert_ne!(w.of(0, chunk), before, "overlaps the first stripe");
        assert_ne!(w.of(stripe, chunk), at, "and the second");
        assert_eq!(w.of(2 * stripe, chunk), after, "not the next one");
        assert_eq!(w.of(8 * stripe, chunk), far, "nor one further away");
        // A range across two stripes moves with either.
        let across = w.of(4 * stripe - 4096, 8192);
        w.bump(4 * stripe + 12288, 4096);
        assert_ne!(w.of(4 * stripe - 4096, 8192), across);
        // A range as long as the volume moves everything.
        let (x, y) = (w.of(0, chunk), w.of(1000 * stripe, chunk));
        w.bump(0, 1 << 40);
        assert_ne!(w.of(0, chunk), x);
        assert_ne!(w.of(1000 * stripe, chunk), y);
    }
}
