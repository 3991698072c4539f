//! Wire format of the tcp provider.
//!
//! Every frame is a fixed 32-byte little-endian header followed by `length`
//! payload bytes:
//!
//! ```text
//! offset size field
//!      0    1 type         HELLO, HELLO_REPLY, SEND, WRITE, READ_REQ, READ_RESP,
//!                          ACK, TERMINATE, DISCONNECT
//!      1    1 flags        bit 0: ACK_REQUESTED; bit 1: INVALIDATE (SEND only:
//!                          a SEND with Invalidate of `rkey`); others zero
//!      2    2 reserved     must be zero
//!      4    4 seq          sequence number of a WR-bearing frame (SEND, WRITE,
//!                          READ_REQ); TERMINATE: the offending peer seq (0: none)
//!      8    4 ack          cumulative: highest peer seq fully processed
//!     12    4 length       payload bytes that follow the header
//!     16    8 remote_addr  WRITE, READ_REQ: target address in the peer's region
//!     24    4 rkey         WRITE, READ_REQ: the peer region's rkey; SEND with
//!                          INVALIDATE: the key to invalidate
//!     28    4 aux          READ_REQ: bytes requested; READ_RESP: the request's
//!                          seq; TERMINATE: error code
//! ```
//!
//! Sequence numbers start at 1, increase by one per WR-bearing frame, wrap
//! and skip 0 (0 means "none"); they compare with serial-number arithmetic.
//!
//! The connection starts with HELLO (active → passive) and HELLO_REPLY
//! (passive → active), whose payload is a 32-byte body plus private data:
//!
//! ```text
//! offset size field
//!      0    4 magic        "RDBK"
//!      4    2 version      1
//!      6    2 private_len  <= 256
//!      8    4 status       HELLO: 0; HELLO_REPLY: 0 accept, 1 reject
//!     12   20 caps         max_send_wr, max_recv_wr, max_send_sge,
//!                          max_recv_sge, max_inline_data (u32 each)
//!     32    n private data
//! ```
//!
//! The `INVALIDATE` flag (SEND with Invalidate) left the version at 1: a
//! queue pair that never sends one talks to a peer from before the flag as
//! it always did, and such a peer refuses a flagged SEND as malformed
//! (unknown flags: TERMINATE, the SEND fails with `RemoteInvalidRequest`)
//! rather than taking it for a plain SEND, so nothing is silently left
//! valid. Raw private data (`connect_raw` and friends) needs nothing on
//! the wire: the hello carries the private data's length either way.

use std::fmt;

use crate::fabric::{QpCaps, WcStatus};

/// Size of every frame header.
pub(crate) const HDR_LEN: usize = 32;

/// Largest payload of one frame and so of one work request (1 GiB).
pub(crate) const MAX_PAYLOAD: u32 = 1 << 30;

/// The header as a C struct: documents the layout and lets the compiler
/// check the offsets the encoder uses.
#[repr(C)]
#[allow(dead_code)]
struct HeaderLayout {
    ty: u8,
    flags: u8,
    reserved: u16,
    seq: u32,
    ack: u32,
    length: u32,
    remote_addr: u64,
    rkey: u32,
    aux: u32,
}

const OFF_SEQ: usize = 4;
const OFF_ACK: usize = 8;
const OFF_LENGTH: usize = 12;
const OFF_ADDR: usize = 16;
const OFF_RKEY: usize = 24;
const OFF_AUX: usize = 28;

const _: () = {
    assert!(std::mem::size_of::<HeaderLayout>() == HDR_LEN);
    assert!(std::mem::offset_of!(HeaderLayout, reserved) == 2);
    assert!(std::mem::offset_of!(HeaderLayout, seq) == OFF_SEQ);
    assert!(std::mem::offset_of!(HeaderLayout, ack) == OFF_ACK);
    assert!(std::mem::offset_of!(HeaderLayout, length) == OFF_LENGTH);
    assert!(std::mem::offset_of!(HeaderLayout, remote_addr) == OFF_ADDR);
    assert!(std::mem::offset_of!(HeaderLayout, rkey) == OFF_RKEY);
    assert!(std::mem::offset_of!(HeaderLayout, aux) == OFF_AUX);
};

/// Frame types.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub(crate) enum FrameType {
    Hello = 1,
    HelloReply = 2,
    Send = 3,
    Write = 4,
    ReadReq = 5,
    ReadResp = 6,
    Ack = 7,
    Terminate = 8,
    Disconnect = 9,
}

impl FrameType {
    fn from_u8(v: u8) -> Option<FrameType> {
        Some(match v {
            1 => FrameType::Hello,
            2 => FrameType::HelloReply,
            3 => FrameType::Send,
            4 => FrameType::Write,
            5 => FrameType::ReadReq,
            6 => FrameType::ReadResp,
            7 => FrameType::Ack,
            8 => FrameType::Terminate,
            9 => FrameType::Disconnect,
            _ => return None,
        })
    }

    /// Whether frames of this type carry a work request and a sequence number.
    pub(crate) fn carries_wr(self) -> bool {
        matches!(self, FrameType::Send | FrameType::Write | FrameType::ReadReq)
    }
}

/// The sender wants an acknowledgement soon (a signaled work request).
pub(crate) const FLAG_ACK_REQUESTED: u8 = 1;
/// A SEND with Invalidate: the receiver invalidates the window `rkey` names.
pub(crate) const FLAG_INVALIDATE: u8 = 2;
const KNOWN_FLAGS: u8 = FLAG_ACK_REQUESTED | FLAG_INVALIDATE;

/// A decoded frame header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Header {
    pub(crate) ty: FrameType,
    pub(crate) flags: u8,
    pub(crate) seq: u32,
    pub(crate) ack: u32,
    pub(crate) length: u32,
    pub(crate) remote_addr: u64,
    pub(crate) rkey: u32,
    pub(crate) aux: u32,
}

/// Why a header was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum DecodeError {
    UnknownType(u8),
    UnknownFlags(u8),
    ReservedNotZero(u16),
    TooLong(u32),
    UnexpectedPayload(FrameType, u32),
    BadReadLength(u32),
    BadHelloLength(u32),
}

impl fmt::Display for DecodeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DecodeError::UnknownType(t) => write!(f, "unknown frame type {t}"),
            DecodeError::UnknownFlags(x) => write!(f, "unknown flags {x:#04x}"),
            DecodeError::ReservedNotZero(r) => write!(f, "reserved field is {r:#06x}, not zero"),
            DecodeError::TooLong(l) => write!(f, "payload length {l} exceeds {MAX_PAYLOAD}"),
            DecodeError::UnexpectedPayload(t, l) => write!(f, "{t:?} frame with a {l}-byte payload"),
            DecodeError::BadReadLength(l) => write!(f, "RDMA READ of {l} bytes exceeds {MAX_PAYLOAD}"),
            DecodeError::BadHelloLength(l) => write!(f, "hello body of {l} bytes"),
        }
    }
}

impl Header {
    /// A header of type `ty` with every other field zero.
    pub(crate) fn new(ty: FrameType) -> Header {
        Header { ty, flags: 0, seq: 0, ack: 0, length: 0, remote_addr: 0, rkey: 0, aux: 0 }
    }

    /// The wire bytes.
    pub(crate) fn encode(&self) -> [u8; HDR_LEN] {
        let mut b = [0u8; HDR_LEN];
        b[0] = self.ty as u8;
        b[1] = self.flags;
        // b[2..4]: reserved, zero.
        b[OFF_SEQ..OFF_SEQ + 4].copy_from_slice(&self.seq.to_le_bytes());
        b[OFF_ACK..OFF_ACK + 4].copy_from_slice(&self.ack.to_le_bytes());
        b[OFF_LENGTH..OFF_LENGTH + 4].copy_from_slice(&self.length.to_le_bytes());
        b[OFF_ADDR..OFF_ADDR + 8].copy_from_slice(&self.remote_addr.to_le_bytes());
        b[OFF_RKEY..OFF_RKEY + 4].copy_from_slice(&self.rkey.to_le_bytes());
        b[OFF_AUX..OFF_AUX + 4].copy_from_slice(&self.aux.to_le_bytes());
        b
    }

    /// Parses and validates a header. Never panics; every field a peer
    /// controls is range-checked here or by the frame's handler.
    pub(crate) fn decode(b: &[u8; HDR_LEN]) -> Result<Header, DecodeError> {
        let u32_at = |o: usize| u32::from_le_bytes([b[o], b[o + 1], b[o + 2], b[o + 3]]);
        let ty = FrameType::from_u8(b[0]).ok_or(DecodeError::UnknownType(b[0]))?;
        let flags = b[1];
        if flags & !KNOWN_FLAGS != 0 || (flags & FLAG_INVALIDATE != 0 && ty != FrameType::Send) {
            return Err(DecodeError::UnknownFlags(flags));
        }
        let reserved = u16::from_le_bytes([b[2], b[3]]);
        if reserved != 0 {
            return Err(DecodeError::ReservedNotZero(reserved));
        }
        let mut addr = [0u8; 8];
        addr.copy_from_slice(&b[OFF_ADDR..OFF_ADDR + 8]);
        let h = Header {
            ty,
            flags,
            seq: u32_at(OFF_SEQ),
            ack: u32_at(OFF_ACK),
            length: u32_at(OFF_LENGTH),
            remote_addr: u64::from_le_bytes(addr),
            rkey: u32_at(OFF_RKEY),
            aux: u32_at(OFF_AUX),
        };
        if h.length > MAX_PAYLOAD {
            return Err(DecodeError::TooLong(h.length));
        }
        match ty {
            FrameType::Hello | FrameType::HelloReply => {
                if !(HELLO_FIXED..=HELLO_MAX).contains(&(h.length as usize)) {
                    return Err(DecodeError::BadHelloLength(h.length));
                }
            }
            FrameType::Ack | FrameType::Terminate | FrameType::Disconnect | FrameType::ReadReq => {
                if h.length != 0 {
                    return Err(DecodeError::UnexpectedPayload(ty, h.length));
                }
                if ty == FrameType::ReadReq && h.aux > MAX_PAYLOAD {
                    return Err(DecodeError::BadReadLength(h.aux));
                }
            }
            FrameType::Send | FrameType::Write | FrameType::ReadResp => {}
        }
        Ok(h)
    }
}

/// `a <= b` in serial-number arithmetic.
pub(crate) fn seq_le(a: u32, b: u32) -> bool {
    (b.wrapping_sub(a) as i32) >= 0
}

/// The sequence number after `s` (0 is skipped: it means "none").
pub(crate) fn seq_next(s: u32) -> u32 {
    match s.wrapping_add(1) {
        0 => 1,
        n => n,
    }
}

// ---- connection hello ----

/// "RDBK", little-endian.
pub(crate) const MAGIC: u32 = u32::from_le_bytes(*b"RDBK");
/// Provider wire version.
pub(crate) const VERSION: u16 = 1;
/// Largest private data of a hello or reply (as rdma_cm's connect data).
pub(crate) const MAX_PRIVATE_DATA: usize = 256;
/// Fixed part of a hello body.
pub(crate) const HELLO_FIXED: usize = 32;
/// Largest hello body.
pub(crate) const HELLO_MAX: usize = HELLO_FIXED + MAX_PRIVATE_DATA;
/// HELLO_REPLY status: accepted.
pub(crate) const STATUS_ACCEPT: u32 = 0;
/// HELLO_REPLY status: rejected (the private data says why).
pub(crate) const STATUS_REJECT: u32 = 1;

/// An encoded HELLO or HELLO_REPLY frame, header included.
pub(crate) struct HelloFrame {
    buf: [u8; HDR_LEN + HELLO_MAX],
    len: usize,
}

impl HelloFrame {
    pub(crate) fn as_bytes(&self) -> &[u8] {
        &self.buf[..self.len]
    }
}

/// Encodes a hello or reply. `private` longer than [`MAX_PRIVATE_DATA`] is
/// truncated (callers refuse it first).
pub(crate) fn encode_hello(ty: FrameType, status: u32, caps: &QpCaps, private: &[u8]) -> HelloFrame {
    let private = &private[..private.len().min(MAX_PRIVATE_DATA)];
    let body_len = HELLO_FIXED + private.len();
    let mut h = Header::new(ty);
    h.length = body_len as u32;
    let mut buf = [0u8; HDR_LEN + HELLO_MAX];
    buf[..HDR_LEN].copy_from_slice(&h.encode());
    let body = &mut buf[HDR_LEN..HDR_LEN + body_len];
    body[0..4].copy_from_slice(&MAGIC.to_le_bytes());
    body[4..6].copy_from_slice(&VERSION.to_le_bytes());
    body[6..8].copy_from_slice(&(private.len() as u16).to_le_bytes());
    body[8..12].copy_from_slice(&status.to_le_bytes());
    let caps = [caps.max_send_wr, caps.max_recv_wr, caps.max_send_sge, caps.max_recv_sge, caps.max_inline_data];
    for (i, c) in caps.iter().enumerate() {
        body[12 + 4 * i..16 + 4 * i].copy_from_slice(&c.to_le_bytes());
    }
    body[HELLO_FIXED..].copy_from_slice(private);
    HelloFrame { buf, len: HDR_LEN + body_len }
}

/// A decoded hello body.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct HelloBody<'a> {
    pub(crate) status: u32,
    pub(crate) caps: QpCaps,
    pub(crate) private: &'a [u8],
}

/// Parses a hello body (the header's `length` bytes).
pub(crate) fn decode_hello_body(b: &[u8]) -> Result<HelloBody<'_>, String> {
    if b.len() < HELLO_FIXED || b.len() > HELLO_MAX {
        return Err(format!("hello body of {} bytes", b.len()));
    }
    let u32_at = |o: usize| u32::from_le_bytes([b[o], b[o + 1], b[o + 2], b[o + 3]]);
    let magic = u32_at(0);
    if magic != MAGIC {
        return Err(format!("bad magic {magic:#010x}"));
    }
    let version = u16::from_le_bytes([b[4], b[5]]);
    if version != VERSION {
        return Err(format!("provider version {version}, expected {VERSION}"));
    }
    let private_len = u16::from_le_bytes([b[6], b[7]]) as usize;
    if private_len > MAX_PRIVATE_DATA || HELLO_FIXED + private_len != b.len() {
        return Err(format!("private data length {private_len} does not match a {}-byte body", b.len()));
    }
    let status = u32_at(8);
    if status != STATUS_ACCEPT && status != STATUS_REJECT {
        return Err(format!("unknown hello status {status}"));
    }
    let caps = QpCaps {
        max_send_wr: u32_at(12),
        max_recv_wr: u32_at(16),
        max_send_sge: u32_at(20),
        max_recv_sge: u32_at(24),
        max_inline_data: u32_at(28),
    };
    Ok(HelloBody { status, caps, private: &b[HELLO_FIXED..] })
}

// ---- TERMINATE error codes ----

/// The peer's request named an unknown rkey, lay out of bounds or lacked the
/// access right (or the region was deregistered during placement).
pub(crate) const TERM_REMOTE_ACCESS: u32 = 1;
/// The peer's request was malformed, or its SEND was longer than the receive.
pub(crate) const TERM_INVALID_REQUEST: u32 = 2;
/// The peer's SEND found no posted receive.
pub(crate) const TERM_RNR: u32 = 3;
/// The peer's SEND hit a local error on this side (bad receive lkey).
pub(crate) const TERM_REMOTE_OPERATION: u32 = 4;
/// This side failed on its own; no request of the peer is at fault. No
/// longer sent (a local fault fails only the local queue pair, as on RC
/// hardware); still understood.
pub(crate) const TERM_PEER_ERROR: u32 = 5;

/// The completion status of the work request a TERMINATE names.
/// A TERMINATE code for log lines.
pub(crate) fn term_name(code: u32) -> &'static str {
    match code {
        TERM_REMOTE_ACCESS => "remote access error: unknown rkey, missing right or out of bounds",
        TERM_INVALID_REQUEST => "invalid request",
        TERM_RNR => "receiver not ready",
        TERM_REMOTE_OPERATION => "remote operation error",
        TERM_PEER_ERROR => "peer error",
        _ => "unknown code",
    }
}

pub(crate) fn remote_status(code: u32) -> WcStatus {
    match code {
        TERM_REMOTE_ACCESS => WcStatus::RemoteAccessError,
        TERM_INVALID_REQUEST => WcStatus::RemoteInvalidRequest,
        TERM_RNR => WcStatus::RnrRetryExceeded,
        TERM_REMOTE_OPERATION => WcStatus::RemoteOperationError,
        TERM_PEER_ERROR => WcStatus::WrFlushError,
        _ => WcStatus::GeneralError,
    }
}
