//! The `file` backend: a regular file or a block device, opened with
//! O_DIRECT (O_RDONLY for read-only volumes) and served through io_uring.
//!
//! Sizing rules:
//! - regular file, missing: created sparse with `size` (required) when
//!   serving; `--check` reports "would create".
//! - regular file, existing: must agree with `size`; a smaller file is grown
//!   (logged; `--check` reports "would grow"), a larger one is an error.
//!   Without `size`, the file's length is the volume size.
//! - block device: size from BLKGETSIZE64, which `size` (if given) must equal;
//!   block size defaults to the logical block size (BLKSSZGET) and may not be
//!   smaller than it.
//! - block size defaults to 4096 for regular files; it may not be smaller
//!   than the file system's O_DIRECT offset alignment (statx STATX_DIOALIGN).
//!
//! DISCARD and WRITE_ZEROES are advertised only when they work, which is
//! found out when a writable volume is opened:
//! - regular file: fallocate(PUNCH_HOLE) and fallocate(ZERO_RANGE) are tried
//!   on an O_TMPFILE in the file's directory (or, failing that, past the end
//!   of the file, which changes no data). DISCARD punches a hole;
//!   WRITE_ZEROES uses ZERO_RANGE, or PUNCH_HOLE when the file system lacks
//!   it (a hole reads back as zeroes).
//! - block device: DISCARD is BLKDISCARD when the device discards
//!   (`queue/discard_max_bytes` > 0); WRITE_ZEROES is BLKZEROOUT, which the
//!   kernel serves with WRITE ZEROES or, failing that, by writing zeroes.

use std::fmt;
use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::fs::{FileTypeExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use rdmablk_common::size::ByteSize;

use crate::backend::RangeOp;
use crate::config::{VolumeConfig, DEFAULT_FILE_BLOCK_SIZE};
use crate::error::{Error, ErrorKind, Result};
use crate::sys;
use super::{PUNCH_HOLE, ZERO_RANGE};
use crate::config::PAGE;

/// What the path is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FileKind {
    Regular,
    BlockDevice,
}

impl fmt::Display for FileKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            FileKind::Regular => "regular file",
            FileKind::BlockDevice => "block device",
        })
    }
}

/// An opened file-backed volume.
#[derive(Debug)]
pub struct FileBackend {
    file: File,
    path: PathBuf,
    kind: FileKind,
    size: u64,
    block_size: u32,
    identity: (u64, u64),
    writable: bool,
    discard: Option<RangeOp>,
    write_zeroes: Option<RangeOp>,
    /// The block device that serves the I/O (the device itself, or the file system's).
    device: u64,
}

/// What `--check` found, without side effects.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FileCheck {
    pub kind: FileKind,
    pub size: u64,
    pub block_size: u32,
    /// What serving would change: "would create ...", "would grow ...".
    pub action: Option<String>,
}

struct Ctx<'a> {
    source: &'a str,
    vc: &'a VolumeConfig,
}

impl Ctx<'_> {
    fn err(&self, key: &str, reason: impl fmt::Display) -> Error {
        Error::new(
            ErrorKind::Volume,
            format!("{}: {}: {}: {reason}", self.source, self.vc.key(key), self.vc.path.display()),
        )
    }

    fn io_err(&self, what: &str, e: io::Error) -> Error {
        let writing = !self.vc.read_only || what != "open";
        let read_only = self.vc.key("read_only");
        let hint = match e.raw_os_error() {
            Some(libc::EINVAL) if what.starts_with("open") => " (does the file system support O_DIRECT?)".to_owned(),
            Some(libc::EBUSY) => " (the device is in use, e.g. mounted)".to_owned(),
            Some(libc::EACCES | libc::EPERM) if writing => format!(
                " (rdmablk-target opens it read-write: give its user write access, set {read_only} = true to serve it \
                 read-only, or, under systemd, list its directory in ReadWritePaths= of the unit)"
            ),
            Some(libc::EROFS) if writing => format!(
                " (the file system is read-only to rdmablk-target: under systemd, ProtectSystem=strict lets it write only \
                 to ReadWritePaths= (/var/lib/rdmablk in the shipped unit): add its directory there, or set {read_only} = true)"
            ),
            _ => String::new(),
        };
        self.err("path", format!("{what}: {e}{hint}"))
    }
}

enum Plan {
    Create { size: u64, block_size: u32 },
    Regular { len: u64, size: u64, block_size: u32 },
    Block,
}

fn open_options(read_only: bool, kind: FileKind) -> OpenOptions {
    let mut o = OpenOptions::new();
    o.read(true).write(!read_only);
    let mut flags = libc::O_DIRECT | libc::O_CLOEXEC;
    if kind == FileKind::BlockDevice && !read_only {
        // Exclusive open: refuse a device that is mounted or used by another exporter.
        flags |= libc::O_EXCL;
    }
    o.custom_flags(flags);
    o
}

impl FileBackend {
    /// Opens for serving: creates or grows regular files per the rules above.
    pub fn open(source: &str, vc: &VolumeConfig) -> Result<FileBackend> {
        let cx = Ctx { source, vc };
        let (plan, kind) = plan(&cx)?;
        let (file, size, block_size) = match plan {
            Plan::Create { size, block_size } => {
                let file = open_options(false, FileKind::Regular)
                    .create_new(true)
                    .mode(0o600)
                    .open(&vc.path)
                    .map_err(|e| cx.io_err("create", e))?;
                file.set_len(size).map_err(|e| cx.io_err("set size of new file", e))?;
                tracing::info!("volume {}: created sparse file {} of {}", vc.name, vc.path.display(), ByteSize(size));
                (file, size, block_size)
            }
            Plan::Regular { len, size, block_size } => {
                let file = open_options(vc.read_only, kind).open(&vc.path).map_err(|e| cx.io_err("open", e))?;
                if len < size {
                    file.set_len(size).map_err(|e| cx.io_err("grow file", e))?;
                    tracing::info!(
                        "volume {}: grew {} from {} to {}",
                        vc.name,
                        vc.path.display(),
                        ByteSize(len),
                        ByteSize(size)
                    );
                }
                (file, size, block_size)
            }
            Plan::Block => {
                let file = open_options(vc.read_only, kind).open(&vc.path).map_err(|e| cx.io_err("open", e))?;
                let (size, block_size) = block_geometry(&cx, &file)?;
                (file, size, block_size)
            }
        };
        check_dio(&cx, &file, kind, block_size)?;
        let meta = file.metadata().map_err(|e| cx.io_err("stat", e))?;
        let identity = if kind == FileKind::BlockDevice { (u64::MAX, meta.rdev()) } else { (meta.dev(), meta.ino()) };
        let device = if kind == FileKind::BlockDevice { meta.rdev() } else { meta.dev() };
        let writable = !vc.read_only;
        let (discard, write_zeroes) = if !writable {
            (None, None)
        } else {
            match kind {
                FileKind::Regular => {
                    let (punch, zero) = probe_fallocate(&vc.path, &file, size);
                    let discard = punch.then_some(RangeOp::Fallocate(PUNCH_HOLE));
                    let zeroes = if zero {
                        Some(RangeOp::Fallocate(ZERO_RANGE))
                    } else {
                        punch.then_some(RangeOp::Fallocate(PUNCH_HOLE))
                    };
                    (discard, zeroes)
                }
                FileKind::BlockDevice => {
                    let max = sys::block_queue_attr(device, "discard_max_bytes").and_then(|v| v.parse::<u64>().ok());
                    (max.is_some_and(|m| m > 0).then_some(RangeOp::BlkDiscard), Some(RangeOp::BlkZeroout))
                }
            }
        };
        Ok(FileBackend { file, path: vc.path.clone(), kind, size, block_size, identity, writable, discard, write_zeroes, device })
    }

    /// Whether it was opened read-write.
    pub fn writable(&self) -> bool {
        self.writable
    }

    /// How DISCARD is done, if it works here.
    pub fn discard(&self) -> Option<RangeOp> {
        self.discard
    }

    /// How WRITE_ZEROES is done, if it works here.
    pub fn write_zeroes(&self) -> Option<RangeOp> {
        self.write_zeroes
    }

    /// Whether the I/O lands on a block device with poll queues (iopoll).
    pub fn pollable(&self) -> bool {
        sys::block_queue_attr(self.device, "io_poll").as_deref() == Some("1")
    }

    /// Validates without creating or changing anything (opens existing
    /// files to prove access and O_DIRECT support).
    pub fn check(source: &str, vc: &VolumeConfig) -> Result<FileCheck> {
        let cx = Ctx { source, vc };
        let (plan, kind) = plan(&cx)?;
        match plan {
            Plan::Create { size, block_size } => {
                if let Some(dir) = vc.path.parent().filter(|p| !p.as_os_str().is_empty()) {
                    if !dir.is_dir() {
                        return Err(cx.err("path", format!("directory {} does not exist", dir.display())));
                    }
                }
                Ok(FileCheck { kind, size, block_size, action: Some(format!("would create sparse file of {}", ByteSize(size))) })
            }
            Plan::Regular { len, size, block_size } => {
                let file = open_options(vc.read_only, kind).open(&vc.path).map_err(|e| cx.io_err("open", e))?;
                check_dio(&cx, &file, kind, block_size)?;
                let action = (len < size).then(|| format!("would grow from {} to {}", ByteSize(len), ByteSize(size)));
                Ok(FileCheck { kind, size, block_size, action })
            }
            Plan::Block => {
                let file = open_options(vc.read_only, kind).open(&vc.path).map_err(|e| cx.io_err("open", e))?;
                let (size, block_size) = block_geometry(&cx, &file)?;
                Ok(FileCheck { kind, size, block_size, action: None })
            }
        }
    }

    /// The descriptor (O_DIRECT).
    pub fn fd(&self) -> RawFd {
        self.file.as_raw_fd()
    }

    /// Regular file or block device.
    pub fn kind(&self) -> FileKind {
        self.kind
    }

    /// Volume size in bytes.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// Volume block size.
    pub fn block_size(&self) -> u32 {
        self.block_size
    }

    /// The configured path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// (device, inode) or the device number: two volumes must not share it.
    pub fn identity(&self) -> (u64, u64) {
        self.identity
    }

    /// fdatasync.
    pub fn sync(&self) -> io::Result<()> {
        self.file.sync_data()
    }
}

fn plan(cx: &Ctx<'_>) -> Result<(Plan, FileKind)> {
    let vc = cx.vc;
    match std::fs::metadata(&vc.path) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            let Some(size) = vc.size else {
                return Err(cx.err("size", "the file does not exist and no size is given to create it"));
            };
            if vc.read_only {
                return Err(cx.err("path", "does not exist (a read-only volume is never created)"));
            }
            let block_size = vc.block_size.unwrap_or(DEFAULT_FILE_BLOCK_SIZE);
            if size % block_size as u64 != 0 {
                return Err(cx.err("size", format!("{size} is not a multiple of the block size {block_size}")));
            }
            Ok((Plan::Create { size, block_size }, FileKind::Regular))
        }
        Err(e) => Err(cx.io_err("stat", e)),
        Ok(meta) if meta.is_file() => {
            let len = meta.len();
            let block_size = vc.block_size.unwrap_or(DEFAULT_FILE_BLOCK_SIZE);
            let size = match vc.size {
                Some(s) if s == len => s,
                Some(s) if len < s => {
                    if vc.read_only {
                        return Err(cx.err(
                            "size",
                            format!("the file is {len} bytes, smaller than size {s}, and a read-only volume is not grown"),
                        ));
                    }
                    s
                }
                Some(s) => {
                    return Err(cx.err(
                        "size",
                        format!("the file is {len} bytes ({}), larger than size {s} ({}); refusing to truncate", ByteSize(len), ByteSize(s)),
                    ))
                }
                None => {
                    if len == 0 {
                        return Err(cx.err("size", "the file is empty; give a size to grow it"));
                    }
                    len
                }
            };
            if size % block_size as u64 != 0 {
                return Err(cx.err("size", format!("{size} is not a multiple of the block size {block_size}")));
            }
            Ok((Plan::Regular { len, size, block_size }, FileKind::Regular))
        }
        Ok(meta) if meta.file_type().is_block_device() => Ok((Plan::Block, FileKind::BlockDevice)),
        Ok(_) => Err(cx.err("path", "is neither a regular file nor a block device")),
    }
}

/// Whether fallocate(PUNCH_HOLE) and fallocate(ZERO_RANGE) work for this
/// file, tried where no data can change: on an O_TMPFILE in the same
/// directory (same file system), or else past the end of the file.
fn probe_fallocate(path: &Path, file: &File, size: u64) -> (bool, bool) {
    let try_on = |fd: RawFd, off: u64| {
        let punch = sys::fallocate(fd, PUNCH_HOLE, off, 4096).is_ok();
        let zero = sys::fallocate(fd, ZERO_RANGE, off, 4096).is_ok();
        (punch, zero)
    };
    let dir = path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    let tmp = OpenOptions::new().read(true).write(true).mode(0o600).custom_flags(libc::O_TMPFILE | libc::O_CLOEXEC).open(dir);
    if let Ok(t) = tmp {
        if t.set_len(65536).is_ok() {
            return try_on(t.as_raw_fd(), 8192);
        }
    }
    // Past the end with KEEP_SIZE: a hole where nothing was, and zeroed
    // blocks beyond EOF that no read can reach; punched again afterwards.
    let r = try_on(file.as_raw_fd(), size);
    if r.1 && r.0 {
        let _ = sys::fallocate(file.as_raw_fd(), PUNCH_HOLE, size, 4096);
    }
    r
}

fn block_geometry(cx: &Ctx<'_>, file: &File) -> Result<(u64, u32)> {
    let vc = cx.vc;
    let fd = file.as_raw_fd();
    let dev_size = sys::block_device_size(fd).map_err(|e| cx.io_err("ioctl BLKGETSIZE64", e))?;
    let lbs = sys::block_device_logical_block_size(fd).map_err(|e| cx.io_err("ioctl BLKSSZGET", e))?;
    let block_size = vc.block_size.unwrap_or(lbs);
    if block_size < lbs {
        return Err(cx.err("block_size", format!("{block_size} is smaller than the device's logical block size {lbs}")));
    }
    if let Some(s) = vc.size {
        if s != dev_size {
            return Err(cx.err("size", format!("{s} disagrees with the device size {dev_size} ({})", ByteSize(dev_size))));
        }
    }
    if dev_size == 0 {
        return Err(cx.err("path", "the device is empty"));
    }
    if dev_size % block_size as u64 != 0 {
        return Err(cx.err("block_size", format!("the device size {dev_size} is not a multiple of {block_size}")));
    }
    Ok((dev_size, block_size))
}

fn check_dio(cx: &Ctx<'_>, file: &File, kind: FileKind, block_size: u32) -> Result<()> {
    match sys::dio_alignment(file.as_raw_fd()) {
        Some((mem, off)) => {
            if off > block_size {
                return Err(cx.err(
                    "block_size",
                    format!("{block_size} is smaller than the O_DIRECT offset alignment {off} this {kind} requires"),
                ));
            }
            if mem > PAGE {
                return Err(cx.err("path", format!("O_DIRECT needs {mem}-byte aligned memory; buffers are {PAGE}-aligned")));
            }
            tracing::debug!("volume {}: O_DIRECT alignment: memory {mem}, offset {off}", cx.vc.name);
        }
        None => tracing::debug!("volume {}: O_DIRECT alignment not reported; assuming {block_size}", cx.vc.name),
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::BackendKind;

    fn vc(path: &Path, size: Option<u64>, block_size: Option<u32>, read_only: bool) -> VolumeConfig {
        VolumeConfig {
            index: 3,
            name: "v".into(),
            backend: BackendKind::File,
            path: path.to_owned(),
            size,
            block_size,
            read_only,
            nsid: None,
            rbd: None,
        }
    }

    fn dir() -> tempfile::TempDir {
        tempfile::tempdir_in("/tmp").unwrap()
    }

    #[test]
    fn creates_missing_file_sparse() {
        let d = dir();
        let p = d.path().join("new.img");
        let c = FileBackend::check("c.toml", &vc(&p, Some(1 << 30), None, false)).unwrap();
        assert_eq!(c.action.as_deref(), Some("would create sparse file of 1GiB"));
        assert!(!p.exists(), "--check must not create");
        let f = FileBackend::open("c.toml", &vc(&p, Some(1 << 30), None, false)).unwrap();
        assert_eq!(f.size(), 1 << 30);
        assert_eq!(f.block_size(), 4096);
        assert_eq!(f.kind(), FileKind::Regular);
        let m = std::fs::metadata(&p).unwrap();
        assert_eq!(m.len(), 1 << 30);
        assert!(m.blocks() < 64, "sparse: {} blocks", m.blocks());
    }

    #[test]
    fn missing_file_needs_size_and_write_access() {
        let d = dir();
        let p = d.path().join("none.img");
        let e = FileBackend::open("c.toml", &vc(&p, None, None, false)).unwrap_err().to_string();
        assert!(e.starts_with("c.toml: volume[3].size: "), "{e}");
        assert!(e.contains("does not exist"), "{e}");
        let e = FileBackend::open("c.toml", &vc(&p, Some(4096), None, true)).unwrap_err().to_string();
        assert!(e.contains("volume[3].path") && e.contains("read-only"), "{e}");
        let e = FileBackend::check("c.toml", &vc(&d.path().join("nodir/x.img"), Some(4096), None, false))
            .unwrap_err()
            .to_string();
        assert!(e.contains("does not exist"), "{e}");
    }

    #[test]
    fn existing_file_sizing() {
        let d = dir();
        let p = d.path().join("f.img");
        std::fs::File::create(&p).unwrap().set_len(1 << 20).unwrap();
        // Agrees.
        assert_eq!(FileBackend::open("c", &vc(&p, Some(1 << 20), None, false)).unwrap().size(), 1 << 20);
        // No size: taken from the file.
        assert_eq!(FileBackend::open("c", &vc(&p, None, Some(512), false)).unwrap().size(), 1 << 20);
        // Larger file than size: error.
        let e = FileBackend::open("c", &vc(&p, Some(1 << 19), None, false)).unwrap_err().to_string();
        assert!(e.contains("volume[3].size") && e.contains("larger"), "{e}");
        // Smaller: check reports, open grows.
        let c = FileBackend::check("c", &vc(&p, Some(2 << 20), None, false)).unwrap();
        assert_eq!(c.action.as_deref(), Some("would grow from 1MiB to 2MiB"));
        assert_eq!(std::fs::metadata(&p).unwrap().len(), 1 << 20);
        let f = FileBackend::open("c", &vc(&p, Some(2 << 20), None, false)).unwrap();
        assert_eq!(f.size(), 2 << 20);
        assert_eq!(std::fs::metadata(&p).unwrap().len(), 2 << 20);
        // Smaller but read-only: error.
        let e = FileBackend::open("c", &vc(&p, Some(4 << 20), None, true)).unwrap_err().to_string();
        assert!(e.contains("read-only"), "{e}");
        // Read-only open of an agreeing file works.
        assert!(FileBackend::open("c", &vc(&p, None, None, true)).is_ok());
        // Not a multiple of the block size.
        let q = d.path().join("odd.img");
        std::fs::File::create(&q).unwrap().set_len(4096 + 512).unwrap();
        let e = FileBackend::open("c", &vc(&q, None, None, false)).unwrap_err().to_string();
        assert!(e.contains("not a multiple of the block size 4096"), "{e}");
        assert!(FileBackend::open("c", &vc(&q, None, Some(512), false)).is_ok());
        // Empty file without size.
        let z = d.path().join("empty.img");
        std::fs::File::create(&z).unwrap();
        let e = FileBackend::open("c", &vc(&z, None, None, false)).unwrap_err().to_string();
        assert!(e.contains("empty"), "{e}");
    }

    #[test]
    fn regular_files_advertise_what_fallocate_does() {
        let d = dir();
        let p = d.path().join("f.img");
        let f = FileBackend::open("c", &vc(&p, Some(1 << 20), None, false)).unwrap();
        // ext4, xfs and btrfs punch holes and zero ranges; tmpfs only punches.
        assert_eq!(f.discard(), Some(RangeOp::Fallocate(PUNCH_HOLE)));
        assert!(matches!(f.write_zeroes(), Some(RangeOp::Fallocate(_))));
        assert_eq!(std::fs::metadata(&p).unwrap().len(), 1 << 20, "probing changed the file");
        let names: Vec<_> = std::fs::read_dir(d.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(names.len(), 1, "probing left files behind: {names:?}");
        let ro = FileBackend::open("c", &vc(&p, None, None, true)).unwrap();
        assert!(!ro.writable() && ro.discard().is_none() && ro.write_zeroes().is_none());
    }

    #[test]
    fn rejects_directories() {
        let d = dir();
        let e = FileBackend::open("c", &vc(d.path(), None, None, false)).unwrap_err().to_string();
        assert!(e.contains("neither a regular file nor a block device"), "{e}");
    }

    #[test]
    fn block_device_geometry_via_loop() {
        // Uses a loop device when losetup is available and we are root; skipped otherwise.
        let d = dir();
        let img = d.path().join("loop.img");
        std::fs::File::create(&img).unwrap().set_len(8 << 20).unwrap();
        let out = std::process::Command::new("losetup").args(["--find", "--show"]).arg(&img).output();
        let Ok(out) = out else { return };
        if !out.status.success() {
            eprintln!("skipping: losetup failed: {}", String::from_utf8_lossy(&out.stderr));
            return;
        }
        let dev = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim().to_owned());
        struct Detach(PathBuf);
        impl Drop for Detach {
            fn drop(&mut self) {
                let _ = std::process::Command::new("losetup").arg("-d").arg(&self.0).status();
            }
        }
        let _guard = Detach(dev.clone());
        let f = FileBackend::open("c", &vc(&dev, None, None, false)).unwrap();
        assert_eq!(f.kind(), FileKind::BlockDevice);
        assert_eq!(f.size(), 8 << 20);
        assert!(f.block_size() >= 512);
        // Loop devices on ext4 discard; BLKZEROOUT always works.
        assert_eq!(f.discard(), Some(RangeOp::BlkDiscard));
        assert_eq!(f.write_zeroes(), Some(RangeOp::BlkZeroout));
        assert!(!f.pollable(), "loop devices have no poll queues");
        drop(f);
        let e = FileBackend::open("c", &vc(&dev, Some(4 << 20), None, false)).unwrap_err().to_string();
        assert!(e.contains("volume[3].size") && e.contains("disagrees"), "{e}");
        let c = FileBackend::check("c", &vc(&dev, Some(8 << 20), Some(4096), true)).unwrap();
        assert_eq!((c.kind, c.size, c.block_size, c.action), (FileKind::BlockDevice, 8 << 20, 4096, None));
    }
}
