//! The 16-byte completion queue entry.
//!
//! | bytes | field |
//! |---|---|
//! | 0..8 | dwords 0 and 1: command-specific result |
//! | 8..10 | SQ head pointer |
//! | 10..12 | SQ identifier |
//! | 12..14 | command identifier |
//! | 14..16 | status (phase tag in bit 0, reserved on fabrics) |

use super::status::Status;
use super::{get_u16, get_u64, need, put_u16, put_u64, WireError};

/// Size of a completion queue entry.
pub const CQE_SIZE: usize = 16;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CompletionEntry {
    /// Dwords 0 and 1: e.g. Connect's controller id, Property Get's value,
    /// Set Features' granted queue counts.
    pub result: u64,
    pub sq_head: u16,
    pub sq_id: u16,
    pub cid: u16,
    pub status: Status,
}

impl CompletionEntry {
    pub fn new(cid: u16, status: Status) -> CompletionEntry {
        CompletionEntry { result: 0, sq_head: 0, sq_id: 0, cid, status }
    }

    pub fn encode(&self, out: &mut [u8; CQE_SIZE]) {
        put_u64(out, 0, self.result);
        put_u16(out, 8, self.sq_head);
        put_u16(out, 10, self.sq_id);
        put_u16(out, 12, self.cid);
        put_u16(out, 14, self.status.to_field());
    }

    pub fn to_bytes(&self) -> [u8; CQE_SIZE] {
        let mut out = [0; CQE_SIZE];
        self.encode(&mut out);
        out
    }

    pub fn decode(b: &[u8]) -> Result<CompletionEntry, WireError> {
        need("completion entry", b, CQE_SIZE)?;
        Ok(CompletionEntry {
            result: get_u64(b, 0),
            sq_head: get_u16(b, 8),
            sq_id: get_u16(b, 10),
            cid: get_u16(b, 12),
            status: Status::from_field(get_u16(b, 14)),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_completion_round_trips_at_its_spec_offsets() {
        let c = CompletionEntry { result: 0x0102_0304_0506_0708, sq_head: 5, sq_id: 1, cid: 0xabcd, status: Status::LBA_OUT_OF_RANGE };
        let b = c.to_bytes();
        assert_eq!(&b[0..4], &[8, 7, 6, 5]);
        assert_eq!(&b[8..14], &[5, 0, 1, 0, 0xcd, 0xab]);
        assert_eq!(u16::from_le_bytes([b[14], b[15]]), 0x4080 << 1);
        assert_eq!(CompletionEntry::decode(&b).unwrap(), c);
        assert!(matches!(CompletionEntry::decode(&b[..15]), Err(WireError::Truncated { need: 16, .. })));
    }
}
