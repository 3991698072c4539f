//! NVMe and NVMe over Fabrics on the wire: the submission and completion
//! queue entries, status codes, the Fabrics commands (Connect, Property
//! Get/Set), and the NVMe/TCP PDUs.
//!
//! This is the codec only, shared by the target's NVMe-oF front end and by
//! the test harness's NVMe/TCP client. Every type is a fixed-size
//! little-endian layout with a size constant, `decode` (which validates)
//! and `encode`; what needs target state (a namespace's size, a queue's
//! depth) is checked by the front end, not here. The layouts follow the
//! NVMe Base Specification 2.0 and the NVMe over Fabrics and NVMe/TCP
//! Transport Specifications 1.0.
//!
//! - [`sqe`]: the 64-byte submission queue entry and its SGL descriptor;
//! - [`cqe`]: the 16-byte completion queue entry;
//! - [`status`]: status codes (type and code), the one place a front end
//!   maps an error to a wire status;
//! - [`fabrics`]: Connect (command and its 1,024-byte data), Property
//!   Get/Set, Disconnect;
//! - [`auth`]: in-band authentication (DH-HMAC-CHAP): secrets, responses,
//!   FFDHE, the Authentication Send/Receive messages;
//! - [`tcp`]: the NVMe/TCP PDUs (ICReq/ICResp, CapsuleCmd/CapsuleResp,
//!   H2CData, C2HData, R2T, the termination requests) and their digests;
//! - [`rdma`]: the NVMe/RDMA connect request, accept and reject (rdma_cm
//!   private data);
//! - [`ana`]: Asymmetric Namespace Access: the ANA states and the ANA log
//!   page.

pub mod ana;
pub mod auth;
pub mod cqe;
pub mod fabrics;
pub mod rdma;
pub mod sqe;
pub mod status;
pub mod tcp;

/// Why bytes from the network are not a valid NVMe structure.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    #[error("{what} truncated: {got} bytes, need {need}")]
    Truncated { what: &'static str, got: usize, need: usize },
    #[error("{what}: reserved byte {offset} is not zero")]
    ReservedNotZero { what: &'static str, offset: usize },
    #[error("{what}: field {field} has an invalid value ({value:#x})")]
    InvalidField { what: &'static str, field: &'static str, value: u64 },
    #[error("unknown NVMe/TCP PDU type {0:#04x}")]
    UnknownPduType(u8),
    #[error("{what}: header digest {got:#010x}, computed {want:#010x}")]
    HeaderDigest { what: &'static str, got: u32, want: u32 },
    #[error("data digest {got:#010x}, computed {want:#010x}")]
    DataDigest { got: u32, want: u32 },
    #[error("{what}: {field} is not a valid NQN (NUL-terminated UTF-8, at most 223 bytes)")]
    BadNqn { what: &'static str, field: &'static str },
}

pub(crate) fn need(what: &'static str, b: &[u8], len: usize) -> Result<(), WireError> {
    if b.len() < len {
        return Err(WireError::Truncated { what, got: b.len(), need: len });
    }
    Ok(())
}

/// The first non-zero byte of `b[range]`, as an error naming its offset.
pub(crate) fn reserved_zero(what: &'static str, b: &[u8], range: std::ops::Range<usize>) -> Result<(), WireError> {
    let start = range.start;
    match b[range].iter().position(|&x| x != 0) {
        Some(i) => Err(WireError::ReservedNotZero { what, offset: start + i }),
        None => Ok(()),
    }
}

pub(crate) fn get_u16(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}
pub(crate) fn get_u32(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}
pub(crate) fn get_u64(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}
pub(crate) fn put_u16(b: &mut [u8], at: usize, v: u16) {
    b[at..at + 2].copy_from_slice(&v.to_le_bytes());
}
pub(crate) fn put_u32(b: &mut [u8], at: usize, v: u32) {
    b[at..at + 4].copy_from_slice(&v.to_le_bytes());
}
pub(crate) fn put_u64(b: &mut [u8], at: usize, v: u64) {
    b[at..at + 8].copy_from_slice(&v.to_le_bytes());
}
