//! The [`BlockDevice`] abstraction and two local implementations:
//! [`FileDevice`] (a file or block device node) and [`MemDevice`] (an
//! in-memory model). A remote [`Volume`](crate::Volume) implements the same
//! trait, so code written against it runs unchanged on any of the three.

use std::fs::{File, OpenOptions};
use std::io::{Seek, SeekFrom};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::RwLock;

use rdmablk_common::protocol::Opcode;

use crate::error::{Error, Result};

/// Flags of a write request.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct WriteFlags {
    /// Force Unit Access: the data of this write is durable (survives a power
    /// loss of the device) before the call returns. Says nothing about other
    /// writes; use [`BlockDevice::flush`] for those.
    pub fua: bool,
}

impl WriteFlags {
    /// A plain write.
    pub const NONE: WriteFlags = WriteFlags { fua: false };
    /// A write with Force Unit Access.
    pub const FUA: WriteFlags = WriteFlags { fua: true };
}

/// A device addressed in bytes, transferring whole blocks.
///
/// # Alignment and range
/// Every `offset` and every length (`buf.len()`, `len`) must be a multiple of
/// [`block_size`](BlockDevice::block_size), and `offset + length` must not
/// exceed [`size`](BlockDevice::size). Violations fail with
/// [`Error::Misaligned`] or [`Error::OutOfRange`] before anything is sent or
/// touched. A zero-length request at a valid offset succeeds and does
/// nothing.
///
/// # Visibility and ordering
/// A write (or discard, or write-zeroes) that has returned `Ok` is visible to
/// every read issued after it returned, from any thread. Requests that run
/// concurrently (issued from different threads, neither returned before the
/// other started) are not ordered: a read overlapping a concurrent write may
/// see old data, new data, or a mix of the two at block granularity, and two
/// concurrent overlapping writes may leave either one's blocks. A request that
/// fails may have been carried out partly (for example some of the pieces of a
/// large write).
///
/// # Durability
/// A returned write is visible but not necessarily durable: it may sit in a
/// volatile cache of the device. It becomes durable when
/// - it was written with [`WriteFlags::FUA`] (durable before the call returns), or
/// - a [`flush`](BlockDevice::flush) issued after it returned has returned.
///
/// The same holds for discard and write-zeroes.
///
/// # Discard and write-zeroes
/// After [`discard`](BlockDevice::discard) the contents of the range are
/// unspecified (old data, zeroes, anything) until written again; devices
/// that cannot deallocate may do nothing. After
/// [`write_zeroes`](BlockDevice::write_zeroes) the range reads back as zeroes.
pub trait BlockDevice: Send + Sync {
    /// Logical block size in bytes: a power of two, at least 512 for remote
    /// volumes.
    fn block_size(&self) -> u32;

    /// Size in bytes, a multiple of the block size.
    fn size(&self) -> u64;

    /// Whether write-type requests are refused with [`Error::ReadOnly`].
    fn read_only(&self) -> bool {
        false
    }

    /// Reads `buf.len()` bytes at `offset` into `buf`.
    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()>;

    /// Writes `buf` at `offset` with the given flags.
    fn write_at_with(&self, buf: &[u8], offset: u64, flags: WriteFlags) -> Result<()>;

    /// Writes `buf` at `offset`; visible when it returns, durable after a
    /// later flush.
    fn write_at(&self, buf: &[u8], offset: u64) -> Result<()> {
        self.write_at_with(buf, offset, WriteFlags::NONE)
    }

    /// Writes `buf` at `offset` and makes it durable before returning.
    fn write_at_fua(&self, buf: &[u8], offset: u64) -> Result<()> {
        self.write_at_with(buf, offset, WriteFlags::FUA)
    }

    /// Makes every write that returned before this call durable.
    fn flush(&self) -> Result<()>;

    /// Deallocates `[offset, offset + len)`; its contents become unspecified.
    fn discard(&self, offset: u64, len: u64) -> Result<()>;

    /// Sets `[offset, offset + len)` to zeroes.
    fn write_zeroes(&self, offset: u64, len: u64) -> Result<()>;
}

macro_rules! forward_block_device {
    ($($ty:ty),*) => {$(
        impl<T: BlockDevice + ?Sized> BlockDevice for $ty {
            fn block_size(&self) -> u32 {
                (**self).block_size()
            }
            fn size(&self) -> u64 {
                (**self).size()
            }
            fn read_only(&self) -> bool {
                (**self).read_only()
            }
            fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
                (**self).read_at(buf, offset)
            }
            fn write_at_with(&self, buf: &[u8], offset: u64, flags: WriteFlags) -> Result<()> {
                (**self).write_at_with(buf, offset, flags)
            }
            fn flush(&self) -> Result<()> {
                (**self).flush()
            }
            fn discard(&self, offset: u64, len: u64) -> Result<()> {
                (**self).discard(offset, len)
            }
            fn write_zeroes(&self, offset: u64, len: u64) -> Result<()> {
                (**self).write_zeroes(offset, len)
            }
        }
    )*};
}

// References and smart pointers to devices are devices, so a `&Volume` or
// an `Arc<Volume>` can go wherever a `BlockDevice` is expected.
forward_block_device!(&T, Box<T>, std::sync::Arc<T>);

/// Checks that `[offset, offset + length)` is block aligned and inside a
/// device of `size` bytes. The check every [`BlockDevice`] makes first.
pub fn check_request(op: Opcode, offset: u64, length: u64, block_size: u32, size: u64) -> Result<()> {
    let bs = u64::from(block_size.max(1));
    if offset % bs != 0 || length % bs != 0 {
        return Err(Error::Misaligned { op, offset, length, block_size });
    }
    match offset.checked_add(length) {
        Some(end) if end <= size => Ok(()),
        _ => Err(Error::OutOfRange { op, offset, length, size }),
    }
}

/// The largest piece a request may be split into: the biggest multiple of the
/// block size that is at most `max_io` bytes and at most `u32::MAX` blocks.
pub(crate) fn max_piece(max_io: u64, block_size: u32) -> Result<u64> {
    let bs = u64::from(block_size);
    let blocks = (max_io / bs).min(u64::from(u32::MAX));
    if blocks == 0 {
        return Err(Error::invalid(format!(
            "the negotiated max I/O size of {max_io} bytes is smaller than the {block_size}-byte block size"
        )));
    }
    Ok(blocks * bs)
}

/// Splits `[offset, offset + len)` into consecutive pieces of at most `piece`
/// bytes; yields `(offset, length)`. An empty range yields nothing.
pub(crate) fn split(offset: u64, len: u64, piece: u64) -> impl Iterator<Item = (u64, u64)> + Clone {
    assert!(piece > 0, "piece size must be positive");
    let count = len.div_ceil(piece);
    (0..count).map(move |i| {
        let start = i * piece;
        (offset + start, piece.min(len - start))
    })
}

/// Number of pieces [`split`] yields.
#[cfg(test)]
pub(crate) fn piece_count(len: u64, piece: u64) -> u64 {
    len.div_ceil(piece)
}

fn check_block_size(block_size: u32) -> Result<()> {
    if block_size == 0 || !block_size.is_power_of_two() {
        return Err(Error::invalid(format!("block size {block_size} is not a power of two")));
    }
    Ok(())
}

/// An in-memory block device: the reference model for tests.
///
/// Every write is immediately durable (there is no cache to lose), discard
/// zeroes the range, and requests are atomic with respect to each other (one
/// lock), which is stronger than the [`BlockDevice`] contract requires.
#[derive(Debug)]
pub struct MemDevice {
    data: RwLock<Vec<u8>>,
    block_size: u32,
    read_only: bool,
    name: String,
}

impl MemDevice {
    /// A zero-filled device of `size` bytes (a multiple of `block_size`, a power of two).
    pub fn new(size: u64, block_size: u32) -> Result<Self> {
        check_block_size(block_size)?;
        if size % u64::from(block_size) != 0 {
            return Err(Error::invalid(format!("size {size} is not a multiple of the {block_size}-byte block size")));
        }
        let len = usize::try_from(size).map_err(|_| Error::invalid(format!("size {size} does not fit in memory")))?;
        Ok(MemDevice { data: RwLock::new(vec![0; len]), block_size, read_only: false, name: "memory".into() })
    }

    /// A device holding `data` (its length must be a multiple of `block_size`).
    pub fn from_vec(data: Vec<u8>, block_size: u32) -> Result<Self> {
        let dev = MemDevice::new(0, block_size)?;
        if data.len() as u64 % u64::from(block_size) != 0 {
            return Err(Error::invalid(format!(
                "size {} is not a multiple of the {block_size}-byte block size",
                data.len()
            )));
        }
        *dev.data.write().unwrap_or_else(|e| e.into_inner()) = data;
        Ok(dev)
    }

    /// Makes the device refuse writes.
    pub fn with_read_only(mut self, read_only: bool) -> Self {
        self.read_only = read_only;
        self
    }

    /// Names the device in error messages.
    pub fn with_name(mut self, name: impl Into<String>) -> Self {
        self.name = name.into();
        self
    }

    /// A copy of the whole contents.
    pub fn contents(&self) -> Vec<u8> {
        self.data.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    fn check(&self, op: Opcode, offset: u64, len: u64) -> Result<()> {
        check_request(op, offset, len, self.block_size, self.size())?;
        if self.read_only && op != Opcode::Read {
            return Err(Error::ReadOnly { op, volume: self.name.clone() });
        }
        Ok(())
    }

    fn fill(&self, op: Opcode, offset: u64, len: u64) -> Result<()> {
        self.check(op, offset, len)?;
        let mut data = self.data.write().unwrap_or_else(|e| e.into_inner());
        data[offset as usize..(offset + len) as usize].fill(0);
        Ok(())
    }
}

impl BlockDevice for MemDevice {
    fn block_size(&self) -> u32 {
        self.block_size
    }

    fn size(&self) -> u64 {
        self.data.read().unwrap_or_else(|e| e.into_inner()).len() as u64
    }

    fn read_only(&self) -> bool {
        self.read_only
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        self.check(Opcode::Read, offset, buf.len() as u64)?;
        let data = self.data.read().unwrap_or_else(|e| e.into_inner());
        let start = offset as usize;
        buf.copy_from_slice(&data[start..start + buf.len()]);
        Ok(())
    }

    fn write_at_with(&self, buf: &[u8], offset: u64, _flags: WriteFlags) -> Result<()> {
        self.check(Opcode::Write, offset, buf.len() as u64)?;
        let mut data = self.data.write().unwrap_or_else(|e| e.into_inner());
        let start = offset as usize;
        data[start..start + buf.len()].copy_from_slice(buf);
        Ok(())
    }

    fn flush(&self) -> Result<()> {
        Ok(())
    }

    fn discard(&self, offset: u64, len: u64) -> Result<()> {
        self.fill(Opcode::Discard, offset, len)
    }

    fn write_zeroes(&self, offset: u64, len: u64) -> Result<()> {
        self.fill(Opcode::WriteZeroes, offset, len)
    }
}

/// A regular file or a block device node used as a [`BlockDevice`], with
/// `pread`/`pwrite`, `fdatasync` for flush and FUA, and `fallocate` for
/// discard (punch hole) and write-zeroes (zero range).
///
/// The file's size is fixed when it is opened and must be a multiple of the
/// block size. Goes through the page cache (no `O_DIRECT`), so buffers need
/// no alignment.
#[derive(Debug)]
pub struct FileDevice {
    file: File,
    path: PathBuf,
    block_size: u32,
    size: u64,
    read_only: bool,
}

impl FileDevice {
    /// Opens an existing file or block device for reading and writing.
    pub fn open(path: impl AsRef<Path>, block_size: u32) -> Result<Self> {
        Self::open_with(path.as_ref(), block_size, false)
    }

    /// Opens an existing file or block device read-only.
    pub fn open_read_only(path: impl AsRef<Path>, block_size: u32) -> Result<Self> {
        Self::open_with(path.as_ref(), block_size, true)
    }

    /// Creates (or truncates) a regular file of `size` bytes, all zeroes.
    pub fn create(path: impl AsRef<Path>, size: u64, block_size: u32) -> Result<Self> {
        let path = path.as_ref();
        check_block_size(block_size)?;
        if size % u64::from(block_size) != 0 {
            return Err(Error::invalid(format!("size {size} is not a multiple of the {block_size}-byte block size")));
        }
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(path)
            .map_err(|e| Error::io(format!("creating {}", path.display()), e))?;
        file.set_len(size).map_err(|e| Error::io(format!("sizing {} to {size} bytes", path.display()), e))?;
        Ok(FileDevice { file, path: path.to_owned(), block_size, size, read_only: false })
    }

    fn open_with(path: &Path, block_size: u32, read_only: bool) -> Result<Self> {
        check_block_size(block_size)?;
        let mut file = OpenOptions::new()
            .read(true)
            .write(!read_only)
            .open(path)
            .map_err(|e| Error::io(format!("opening {}", path.display()), e))?;
        // Seeking to the end works for block devices too, where metadata says 0.
        let size =
            file.seek(SeekFrom::End(0)).map_err(|e| Error::io(format!("finding the size of {}", path.display()), e))?;
        if size % u64::from(block_size) != 0 {
            return Err(Error::invalid(format!(
                "{} is {size} bytes, not a multiple of the {block_size}-byte block size",
                path.display()
            )));
        }
        Ok(FileDevice { file, path: path.to_owned(), block_size, size, read_only })
    }

    /// The path the device was opened from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    fn check(&self, op: Opcode, offset: u64, len: u64) -> Result<()> {
        check_request(op, offset, len, self.block_size, self.size)?;
        if self.read_only && op != Opcode::Read {
            return Err(Error::ReadOnly { op, volume: self.path.display().to_string() });
        }
        Ok(())
    }

    fn io_err(&self, what: &str, offset: u64, len: u64, e: std::io::Error) -> Error {
        Error::io(format!("{what} of {len} bytes at offset {offset} on {}", self.path.display()), e)
    }

    fn fallocate(&self, flags: rustix::fs::FallocateFlags, offset: u64, len: u64) -> std::io::Result<()> {
        rustix::fs::fallocate(&self.file, flags, offset, len).map_err(std::io::Error::from)
    }

    fn write_zero_blocks(&self, offset: u64, len: u64) -> std::io::Result<()> {
        const CHUNK: u64 = 1 << 20;
        let zeroes = vec![0u8; CHUNK.min(len) as usize];
        for (off, l) in split(offset, len, CHUNK) {
            self.file.write_all_at(&zeroes[..l as usize], off)?;
        }
        Ok(())
    }
}

fn unsupported(e: &std::io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::EOPNOTSUPP) | Some(libc::ENOSYS) | Some(libc::EINVAL) | Some(libc::ENODEV))
}

impl BlockDevice for FileDevice {
    fn block_size(&self) -> u32 {
        self.block_size
    }

    fn size(&self) -> u64 {
        self.size
    }

    fn read_only(&self) -> bool {
        self.read_only
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        self.check(Opcode::Read, offset, buf.len() as u64)?;
        self.file.read_exact_at(buf, offset).map_err(|e| self.io_err("read", offset, buf.len() as u64, e))
    }

    fn write_at_with(&self, buf: &[u8], offset: u64, flags: WriteFlags) -> Result<()> {
        let len = buf.len() as u64;
        self.check(Opcode::Write, offset, len)?;
        if buf.is_empty() {
            return Ok(());
        }
        self.file.write_all_at(buf, offset).map_err(|e| self.io_err("write", offset, len, e))?;
        if flags.fua {
            self.file.sync_data().map_err(|e| self.io_err("FUA sync after write", offset, len, e))?;
        }
        Ok(())
    }

    fn flush(&self) -> Result<()> {
        if self.read_only {
            return Ok(());
        }
        self.file.sync_data().map_err(|e| Error::io(format!("flush (fdatasync) of {}", self.path.display()), e))
    }

    fn discard(&self, offset: u64, len: u64) -> Result<()> {
        use rustix::fs::FallocateFlags as F;
        self.check(Opcode::Discard, offset, len)?;
        if len == 0 {
            return Ok(());
        }
        match self.fallocate(F::PUNCH_HOLE | F::KEEP_SIZE, offset, len) {
            Ok(()) => Ok(()),
            // Discard is advisory: leaving the data in place is a valid outcome.
            Err(e) if unsupported(&e) => Ok(()),
            Err(e) => Err(self.io_err("discard", offset, len, e)),
        }
    }

    fn write_zeroes(&self, offset: u64, len: u64) -> Result<()> {
        use rustix::fs::FallocateFlags as F;
        self.check(Opcode::WriteZeroes, offset, len)?;
        if len == 0 {
            return Ok(());
        }
        let err = |e| self.io_err("write-zeroes", offset, len, e);
        match self.fallocate(F::ZERO_RANGE | F::KEEP_SIZE, offset, len) {
            Ok(()) => return Ok(()),
            Err(e) if !unsupported(&e) => return Err(err(e)),
            Err(_) => {}
        }
        // A punched hole reads back as zeroes, on files and block devices alike.
        match self.fallocate(F::PUNCH_HOLE | F::KEEP_SIZE, offset, len) {
            Ok(()) => return Ok(()),
            Err(e) if !unsupported(&e) => return Err(err(e)),
            Err(_) => {}
        }
        self.write_zero_blocks(offset, len).map_err(err)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::ErrorKind;

    fn pattern(len: usize, seed: u8) -> Vec<u8> {
        (0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect()
    }

    /// The behaviour every BlockDevice must show; run on each implementation.
    fn exercise(dev: &dyn BlockDevice) {
        let bs = dev.block_size() as usize;
        assert_eq!(dev.size() % bs as u64, 0);
        let data = pattern(3 * bs, 7);
        dev.write_at(&data, bs as u64).unwrap();
        let mut back = vec![0u8; 3 * bs];
        dev.read_at(&mut back, bs as u64).unwrap();
        assert_eq!(back, data);

        dev.write_at_fua(&data[..bs], 0).unwrap();
        dev.flush().unwrap();
        let mut first = vec![0u8; bs];
        dev.read_at(&mut first, 0).unwrap();
        assert_eq!(first, data[..bs]);

        dev.write_zeroes(bs as u64, 2 * bs as u64).unwrap();
        dev.read_at(&mut back, bs as u64).unwrap();
        assert!(back[..2 * bs].iter().all(|&b| b == 0));
        assert_eq!(back[2 * bs..], data[2 * bs..]);

        dev.discard(0, bs as u64).unwrap();
        // Contents unspecified, but the call succeeded and the range is still readable.
        dev.read_at(&mut first, 0).unwrap();

        // Zero-length requests at valid offsets are no-ops.
        dev.read_at(&mut [], 0).unwrap();
        dev.write_at(&[], dev.size()).unwrap();

        // Misalignment is refused before touching anything.
        let e = dev.write_at(&data[..bs], 1).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Misaligned);
        let e = dev.read_at(&mut back[..bs - 1], 0).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Misaligned);
        let e = dev.discard(0, 3).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Misaligned);
        // Range.
        let e = dev.read_at(&mut back[..bs], dev.size()).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::OutOfRange);
        let e = dev.write_zeroes(dev.size() - bs as u64, 2 * bs as u64).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::OutOfRange);
        let e = dev.write_zeroes(u64::MAX - (bs as u64 - 1), bs as u64).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::OutOfRange);
    }

    #[test]
    fn mem_device_behaves() {
        let dev = MemDevice::new(64 * 1024, 4096).unwrap();
        exercise(&dev);
        assert!(MemDevice::new(1000, 512).is_err());
        assert!(MemDevice::new(4096, 1000).is_err());
    }

    #[test]
    fn mem_device_read_only_refuses_writes() {
        let dev = MemDevice::new(8192, 512).unwrap().with_read_only(true).with_name("ro");
        let e = dev.write_at(&[0u8; 512], 0).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::ReadOnly);
        assert_eq!(e.to_string(), "write on read-only volume \"ro\" refused");
        assert_eq!(dev.discard(0, 512).unwrap_err().kind(), ErrorKind::ReadOnly);
        assert_eq!(dev.write_zeroes(0, 512).unwrap_err().kind(), ErrorKind::ReadOnly);
        dev.read_at(&mut [0u8; 512], 0).unwrap();
        dev.flush().unwrap();
    }

    #[test]
    fn file_device_behaves() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("disk.img");
        let dev = FileDevice::create(&path, 256 * 1024, 4096).unwrap();
        exercise(&dev);
        drop(dev);
        // Reopening sees the size and the data.
        let dev = FileDevice::open(&path, 4096).unwrap();
        assert_eq!(dev.size(), 256 * 1024);
        let mut b = vec![0u8; 4096];
        dev.read_at(&mut b, 3 * 4096).unwrap();
        assert_eq!(b, pattern(3 * 4096, 7)[2 * 4096..]);
        // Write-zeroes over a big range reads back zeroes.
        dev.write_at(&pattern(8192, 1), 65536).unwrap();
        dev.write_zeroes(0, 256 * 1024).unwrap();
        let mut all = vec![1u8; 256 * 1024];
        dev.read_at(&mut all, 0).unwrap();
        assert!(all.iter().all(|&x| x == 0));
    }

    #[test]
    fn file_device_checks_size_and_read_only() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("odd.img");
        std::fs::write(&path, vec![0u8; 5000]).unwrap();
        let e = FileDevice::open(&path, 4096).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidArgument);
        assert!(e.to_string().contains("5000 bytes"), "{e}");
        std::fs::write(&path, vec![0u8; 8192]).unwrap();
        let dev = FileDevice::open_read_only(&path, 4096).unwrap();
        assert!(dev.read_only());
        assert_eq!(dev.write_at(&[0u8; 4096], 0).unwrap_err().kind(), ErrorKind::ReadOnly);
        let e = FileDevice::open(dir.path().join("missing"), 4096).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Io);
        assert!(e.to_string().contains("missing"), "{e}");
    }

    #[test]
    fn devices_are_interchangeable_trait_objects() {
        let dir = tempfile::tempdir().unwrap();
        let devs: Vec<Box<dyn BlockDevice>> = vec![
            Box::new(MemDevice::new(16384, 512).unwrap()),
            Box::new(FileDevice::create(dir.path().join("a"), 16384, 512).unwrap()),
        ];
        for d in &devs {
            d.write_at(&[9u8; 1024], 512).unwrap();
            let mut b = [0u8; 1024];
            d.read_at(&mut b, 512).unwrap();
            assert_eq!(b, [9u8; 1024]);
        }
    }

    #[test]
    fn alignment_and_range_checks() {
        check_request(Opcode::Read, 0, 0, 4096, 0).unwrap();
        check_request(Opcode::Read, 4096, 4096, 4096, 8192).unwrap();
        let e = check_request(Opcode::Write, 12289, 1 << 20, 4096, 1 << 30).unwrap_err();
        assert_eq!(
            e.to_string(),
            "write of 1048576 bytes at offset 12289 is not aligned to the volume's 4096-byte block size"
        );
        let e = check_request(Opcode::Read, 0, 4095, 4096, 1 << 30).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Misaligned);
        let e = check_request(Opcode::Read, 8192, 4096, 4096, 8192).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::OutOfRange);
        assert_eq!(e.to_string(), "read of 4096 bytes at offset 8192 is beyond the end of the 8192-byte volume");
        let e = check_request(Opcode::Read, u64::MAX - 4095, 4096 * 2, 4096, u64::MAX).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::OutOfRange);
    }

    #[test]
    fn splitting_arithmetic() {
        assert_eq!(max_piece(1 << 20, 4096).unwrap(), 1 << 20);
        assert_eq!(max_piece((1 << 20) + 100, 4096).unwrap(), 1 << 20);
        assert_eq!(max_piece(6000, 4096).unwrap(), 4096);
        assert!(max_piece(2048, 4096).is_err());
        assert_eq!(max_piece(u64::MAX, 512).unwrap(), u64::from(u32::MAX) * 512);

        let v: Vec<_> = split(4096, 10 * 4096, 4 * 4096).collect();
        assert_eq!(v, vec![(4096, 16384), (20480, 16384), (36864, 8192)]);
        assert_eq!(piece_count(10 * 4096, 4 * 4096), 3);
        assert_eq!(split(0, 0, 4096).count(), 0);
        assert_eq!(piece_count(0, 4096), 0);
        let v: Vec<_> = split(0, 8192, 8192).collect();
        assert_eq!(v, vec![(0, 8192)]);
        // Pieces are contiguous and cover the range exactly.
        for (len, piece) in [(1u64 << 30, 1u64 << 20), (12345 * 512, 7 * 512), (512, 512)] {
            let mut next = 1 << 40;
            let mut total = 0;
            for (o, l) in split(1 << 40, len, piece) {
                assert_eq!(o, next);
                assert!(l > 0 && l <= piece);
                next += l;
                total += l;
            }
            assert_eq!(total, len);
        }
    }
}
