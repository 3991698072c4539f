//! [`BlockStream`]: `std::io::{Read, Write, Seek}` over any [`BlockDevice`],
//! at byte granularity, for convenience tools.

use std::io::{self, Read, Seek, SeekFrom, Write};

use crate::device::BlockDevice;

/// Largest transfer one `read`/`write` call makes on the device.
const MAX_STEP: usize = 8 << 20;

/// A byte stream over a [`BlockDevice`]: reads, writes and seeks at any
/// byte offset and length, for tools that think in bytes.
///
/// Unaligned parts are handled by reading the blocks they touch
/// (read-modify-write for writes): a write that covers a block only partly
/// reads that block first and writes it back whole. That is not atomic with
/// respect to other writers of the same block: do not write the same block
/// through two streams (or a stream and anything else) at once. Aligned
/// middles go to the device directly.
///
/// Reads stop at the end of the device (`Ok(0)`); writes past it fail with
/// [`io::ErrorKind::WriteZero`]. [`Write::flush`] calls
/// [`BlockDevice::flush`]: written data is durable when it returns. Errors
/// of the device keep their message; their kind is mapped (see
/// `impl From<Error> for io::Error`).
///
/// Works on a [`Volume`](crate::Volume) by reference, by `Arc` or by value,
/// and equally on a [`MemDevice`](crate::MemDevice) or
/// [`FileDevice`](crate::FileDevice):
///
/// ```
/// use std::io::{Read, Seek, SeekFrom, Write};
/// use rdmablk_initiator::{BlockStream, MemDevice};
///
/// let dev = MemDevice::new(64 * 1024, 4096)?;
/// let mut s = BlockStream::new(&dev);
/// s.seek(SeekFrom::Start(4000))?;
/// s.write_all(b"hello, unaligned world")?; // straddles two blocks
/// s.seek(SeekFrom::Start(4007))?;
/// let mut word = [0u8; 9];
/// s.read_exact(&mut word)?;
/// assert_eq!(&word, b"unaligned");
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug)]
pub struct BlockStream<D: BlockDevice> {
    dev: D,
    pos: u64,
    block: Vec<u8>,
}

impl<D: BlockDevice> BlockStream<D> {
    /// A stream at position 0.
    pub fn new(dev: D) -> Self {
        let bs = dev.block_size() as usize;
        BlockStream { dev, pos: 0, block: vec![0; bs] }
    }

    /// The device.
    pub fn get_ref(&self) -> &D {
        &self.dev
    }

    /// The device, giving up the stream.
    pub fn into_inner(self) -> D {
        self.dev
    }

    /// The current byte position.
    pub fn position(&self) -> u64 {
        self.pos
    }

    fn bs(&self) -> u64 {
        u64::from(self.dev.block_size())
    }
}

impl<D: BlockDevice> Read for BlockStream<D> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let size = self.dev.size();
        if self.pos >= size || buf.is_empty() {
            return Ok(0);
        }
        let bs = self.bs();
        let want = (buf.len() as u64).min(size - self.pos).min(MAX_STEP as u64) as usize;
        let head = self.pos % bs;
        if head == 0 && want as u64 >= bs {
            // Aligned: whole blocks straight into the caller's buffer.
            let n = (want as u64 / bs * bs) as usize;
            self.dev.read_at(&mut buf[..n], self.pos)?;
            self.pos += n as u64;
            return Ok(n);
        }
        // Partial block: through the block buffer.
        let start = self.pos - head;
        self.dev.read_at(&mut self.block, start)?;
        let n = want.min((bs - head) as usize);
        buf[..n].copy_from_slice(&self.block[head as usize..head as usize + n]);
        self.pos += n as u64;
        Ok(n)
    }
}

impl<D: BlockDevice> Write for BlockStream<D> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        if buf.is_empty() {
            return Ok(0);
        }
        let size = self.dev.size();
        if self.pos >= size {
            return Err(io::Error::new(
                io::ErrorKind::WriteZero,
                format!("write at byte {} is beyond the end of the {size}-byte device", self.pos),
            ));
        }
        let bs = self.bs();
        let want = (buf.len() as u64).min(size - self.pos).min(MAX_STEP as u64) as usize;
        let head = self.pos % bs;
        if head == 0 && want as u64 >= bs {
            let n = (want as u64 / bs * bs) as usize;
            self.dev.write_at(&buf[..n], self.pos)?;
            self.pos += n as u64;
            return Ok(n);
        }
        // Read-modify-write of one block.
        let start = self.pos - head;
        let n = want.min((bs - head) as usize);
        self.dev.read_at(&mut self.block, start)?;
        self.block[head as usize..head as usize + n].copy_from_slice(&buf[..n]);
        self.dev.write_at(&self.block, start)?;
        self.pos += n as u64;
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(self.dev.flush()?)
    }
}

impl<D: BlockDevice> Seek for BlockStream<D> {
    fn seek(&mut self, to: SeekFrom) -> io::Result<u64> {
        let (base, delta) = match to {
            SeekFrom::Start(p) => {
                self.pos = p;
                return Ok(p);
            }
            SeekFrom::End(d) => (self.dev.size(), d),
            SeekFrom::Current(d) => (self.pos, d),
        };
        match base.checked_add_signed(delta) {
            Some(p) => {
                self.pos = p;
                Ok(p)
            }
            None => Err(io::Error::new(io::ErrorKind::InvalidInput, "seek to a negative or overflowing position")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::MemDevice;

    fn pattern(len: usize, seed: u8) -> Vec<u8> {
        (0..len).map(|i| (i as u8).wrapping_mul(13).wrapping_add(seed)).collect()
    }

    #[test]
    fn unaligned_writes_and_reads_match_a_byte_model() {
        let dev = MemDevice::new(64 * 512, 512).unwrap();
        let mut model = vec![0u8; 64 * 512];
        let mut s = BlockStream::new(&dev);
        let mut x = 12345u64;
        let mut rnd = |n: u64| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x % n
        };
        for round in 0..300 {
            let off = rnd(model.len() as u64);
            let len = 1 + rnd(3000).min(model.len() as u64 - off - 1) as usize;
            if round % 2 == 0 {
                let data = pattern(len, round as u8);
                s.seek(SeekFrom::Start(off)).unwrap();
                s.write_all(&data).unwrap();
                model[off as usize..off as usize + len].copy_from_slice(&data);
                assert_eq!(s.position(), off + len as u64);
            } else {
                let mut back = vec![0u8; len];
                s.seek(SeekFrom::Start(off)).unwrap();
                s.read_exact(&mut back).unwrap();
                assert_eq!(back, model[off as usize..off as usize + len], "round {round} at {off}+{len}");
            }
        }
        assert_eq!(dev.contents(), model);
    }

    #[test]
    fn end_of_device_and_seeking() {
        let dev = MemDevice::new(4096, 512).unwrap();
        let mut s = BlockStream::new(&dev);
        assert_eq!(s.seek(SeekFrom::End(-10)).unwrap(), 4086);
        s.write_all(&[7u8; 10]).unwrap();
        let e = s.write_all(&[1]).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::WriteZero);
        assert!(e.to_string().contains("beyond the end"), "{e}");
        let mut rest = Vec::new();
        s.seek(SeekFrom::Current(-4)).unwrap();
        s.read_to_end(&mut rest).unwrap();
        assert_eq!(rest, [7u8; 4]);
        assert!(s.seek(SeekFrom::Current(-5000)).is_err());
        s.seek(SeekFrom::Start(0)).unwrap();
        let mut all = Vec::new();
        assert_eq!(s.read_to_end(&mut all).unwrap(), 4096);
        s.flush().unwrap();
    }

    #[test]
    fn device_errors_keep_their_message() {
        let dev = MemDevice::new(4096, 512).unwrap().with_read_only(true).with_name("ro");
        let mut s = BlockStream::new(dev);
        let e = s.write_all(b"x").unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::PermissionDenied);
        assert!(e.to_string().contains("read-only"), "{e}");
    }
}
