//! `verify=crc32c`: every written block carries a header that identifies it
//! and a CRC32C over the whole block; reads check both.
//!
//! Header (little endian, the first [`HEADER_LEN`] bytes of each block):
//!
//! | bytes | field |
//! |---|---|
//! | 0..4 | magic `RBV1` |
//! | 4..8 | block length in bytes |
//! | 8..16 | byte offset of the block on the volume |
//! | 16..24 | seed of the writing job (run seed and job number) |
//! | 24..28 | write generation: how many times this job wrote the block |
//! | 28..32 | CRC32C over bytes 0..28 and 32..len |
//!
//! The rest of the block is payload (random bytes). A read is checked on its
//! own (magic, length, offset, CRC), which is what a later `verify_only` run
//! can do; within the run that wrote the block, the seed and generation are
//! checked as well, so a stale block with a valid checksum is caught too.

use std::fmt;

/// Bytes of the header.
pub const HEADER_LEN: usize = 32;
/// `RBV1`.
pub const MAGIC: u32 = u32::from_le_bytes(*b"RBV1");
/// `RBV?`: what a buffer holds before a checked read fills it ([`poison`]).
pub const UNREAD: u32 = u32::from_le_bytes(*b"RBV?");

/// A decoded header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Header {
    pub len: u32,
    pub offset: u64,
    pub seed: u64,
    pub generation: u32,
    pub crc: u32,
}

/// What a verify failure found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Failure {
    BadMagic { found: u32 },
    /// The read completed but the buffer still holds [`UNREAD`]: no data
    /// was placed in it.
    Unread,
    BadLength { found: u32 },
    BadOffset { found: u64 },
    BadCrc { stored: u32, computed: u32 },
    /// The block is intact but was not written by this job's last write to it.
    Stale { seed: u64, generation: u32, expected_seed: u64, expected_generation: u32 },
}

/// A verify failure of the block at `offset`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct VerifyError {
    pub offset: u64,
    pub len: u32,
    pub failure: Failure,
}

impl fmt::Display for VerifyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let off = self.offset;
        match self.failure {
            Failure::BadMagic { found } => {
                write!(f, "verify: bad magic header at offset {off} (found {found:#010x}, expected {MAGIC:#010x})")
            }
            Failure::Unread => {
                write!(f, "verify: no data at offset {off}: the read completed without placing the block in the buffer")
            }
            Failure::BadLength { found } => {
                write!(f, "verify: bad length at offset {off} (header says {found}, block is {})", self.len)
            }
            Failure::BadOffset { found } => {
                write!(f, "verify: bad offset at offset {off} (header names offset {found})")
            }
            Failure::BadCrc { stored, computed } => {
                write!(f, "verify: bad crc at offset {off} (stored {stored:#010x}, computed {computed:#010x})")
            }
            Failure::Stale { seed, generation, expected_seed, expected_generation } => write!(
                f,
                "verify: stale block at offset {off} (seed {seed:#x} generation {generation}, expected seed \
                 {expected_seed:#x} generation {expected_generation})"
            ),
        }
    }
}

impl std::error::Error for VerifyError {}

fn crc_of(block: &[u8]) -> u32 {
    let c = crc32c::crc32c(&block[..28]);
    crc32c::crc32c_append(c, &block[HEADER_LEN..])
}

/// Writes the header of a block about to be written at `offset` and its
/// CRC over the whole block (the payload is left as it is).
pub fn stamp(block: &mut [u8], offset: u64, seed: u64, generation: u32) {
    assert!(block.len() >= HEADER_LEN, "a verified block is at least {HEADER_LEN} bytes");
    block[0..4].copy_from_slice(&MAGIC.to_le_bytes());
    let len = block.len() as u32;
    block[4..8].copy_from_slice(&len.to_le_bytes());
    block[8..16].copy_from_slice(&offset.to_le_bytes());
    block[16..24].copy_from_slice(&seed.to_le_bytes());
    block[24..28].copy_from_slice(&generation.to_le_bytes());
    let crc = crc_of(block);
    block[28..32].copy_from_slice(&crc.to_le_bytes());
}

/// Marks a buffer about to receive a checked read: its header becomes
/// [`UNREAD`], so that the check cannot pass on what the buffer held
/// before (an earlier write or read of the same block from this buffer)
/// if the read completed without placing data.
pub fn poison(block: &mut [u8]) {
    let n = block.len().min(HEADER_LEN);
    block[..n].fill(0);
    if n >= 4 {
        block[0..4].copy_from_slice(&UNREAD.to_le_bytes());
    }
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

/// Checks a block read at `offset` on its own: magic, length, offset, CRC.
pub fn check(block: &[u8], offset: u64) -> Result<Header, VerifyError> {
    let len = block.len() as u32;
    let err = |failure| VerifyError { offset, len, failure };
    if block.len() < HEADER_LEN {
        return Err(err(Failure::BadLength { found: 0 }));
    }
    let magic = u32_at(block, 0);
    if magic == UNREAD {
        return Err(err(Failure::Unread));
    }
    if magic != MAGIC {
        return Err(err(Failure::BadMagic { found: magic }));
    }
    let h = Header {
        len: u32_at(block, 4),
        offset: u64_at(block, 8),
        seed: u64_at(block, 16),
        generation: u32_at(block, 24),
        crc: u32_at(block, 28),
    };
    if h.len != len {
        return Err(err(Failure::BadLength { found: h.len }));
    }
    let computed = crc_of(block);
    if computed != h.crc {
        return Err(err(Failure::BadCrc { stored: h.crc, computed }));
    }
    if h.offset != offset {
        return Err(err(Failure::BadOffset { found: h.offset }));
    }
    Ok(h)
}

/// [`check`], then that the block is this job's write number `generation`.
pub fn check_exact(block: &[u8], offset: u64, seed: u64, generation: u32) -> Result<Header, VerifyError> {
    let h = check(block, offset)?;
    if h.seed != seed || h.generation != generation {
        return Err(VerifyError {
            offset,
            len: block.len() as u32,
            failure: Failure::Stale {
                seed: h.seed,
                generation: h.generation,
                expected_seed: seed,
                expected_generation: generation,
            },
        });
    }
    Ok(h)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn block(len: usize) -> Vec<u8> {
        (0..len).map(|i| (i * 31 + 7) as u8).collect()
    }

    #[test]
    fn stamped_blocks_verify() {
        let mut b = block(4096);
        stamp(&mut b, 8192, 42, 3);
        let h = check(&b, 8192).unwrap();
        assert_eq!(h, Header { len: 4096, offset: 8192, seed: 42, generation: 3, crc: h.crc });
        check_exact(&b, 8192, 42, 3).unwrap();
    }

    #[test]
    fn corruption_is_reported_with_the_offset() {
        let mut b = block(4096);
        stamp(&mut b, 8192, 42, 3);
        b[1000] ^= 0x40;
        let e = check(&b, 8192).unwrap_err();
        assert!(matches!(e.failure, Failure::BadCrc { .. }));
        assert!(e.to_string().starts_with("verify: bad crc at offset 8192"), "{e}");
    }

    #[test]
    fn a_poisoned_buffer_never_verifies() {
        let mut b = block(4096);
        stamp(&mut b, 8192, 42, 3);
        poison(&mut b);
        let e = check(&b, 8192).unwrap_err();
        assert_eq!(e.failure, Failure::Unread);
        assert!(e.to_string().starts_with("verify: no data at offset 8192"), "{e}");
        assert!(check_exact(&b, 8192, 42, 3).is_err());
        // A read that places the block overwrites the marker.
        stamp(&mut b, 8192, 42, 3);
        check_exact(&b, 8192, 42, 3).unwrap();
    }

    #[test]
    fn misplaced_zeroed_and_stale_blocks_fail() {
        let mut b = block(4096);
        stamp(&mut b, 8192, 42, 3);
        assert!(matches!(check(&b, 4096).unwrap_err().failure, Failure::BadOffset { found: 8192 }));
        assert!(matches!(check(&[0u8; 4096], 0).unwrap_err().failure, Failure::BadMagic { found: 0 }));
        assert!(matches!(check_exact(&b, 8192, 42, 4).unwrap_err().failure, Failure::Stale { .. }));
        assert!(matches!(check_exact(&b, 8192, 43, 3).unwrap_err().failure, Failure::Stale { .. }));
        let mut short = b.clone();
        short.truncate(2048);
        assert!(matches!(check(&short, 8192).unwrap_err().failure, Failure::BadLength { found: 4096 }));
    }
}
