//! NVMe/TCP PDUs (NVMe/TCP Transport Specification 1.0).
//!
//! Every PDU starts with an 8-byte common header:
//!
//! | bytes | field |
//! |---|---|
//! | 0 | PDU type |
//! | 1 | flags: HDGSTF 0x01, DDGSTF 0x02, LAST_PDU 0x04, SUCCESS 0x08 |
//! | 2 | HLEN: header length, fixed per type |
//! | 3 | PDO: offset of the data from the PDU's start (0: no data) |
//! | 4..8 | PLEN: the whole PDU's length |
//!
//! followed by the rest of the type's header, a CRC32C header digest if
//! one was negotiated (not on ICReq/ICResp), padding up to PDO, the data,
//! and a CRC32C data digest if one was negotiated and there is data.
//! [`CommonHeader::layout`] checks that HLEN, PDO and PLEN agree with each
//! other, with the type and with the digests before a byte of data is
//! placed; [`Pdu::decode`] reads the header.

use super::cqe::{CompletionEntry, CQE_SIZE};
use super::sqe::{SubmissionEntry, SQE_SIZE};
use super::{get_u16, get_u32, need, put_u16, put_u32, reserved_zero, WireError};

/// Size of the common header.
pub const CH_SIZE: usize = 8;
/// Size of ICReq and ICResp (header only, no data).
pub const IC_SIZE: usize = 128;
/// Header length of CapsuleCmd: the common header and a submission entry.
pub const CAPSULE_CMD_HLEN: usize = CH_SIZE + SQE_SIZE;
/// Header length of CapsuleResp: the common header and a completion entry.
pub const CAPSULE_RESP_HLEN: usize = CH_SIZE + CQE_SIZE;
/// Header length of H2CData, C2HData, R2T and the termination requests.
pub const SHORT_HLEN: usize = 24;
/// Length of a digest.
pub const DIGEST_SIZE: usize = 4;
/// The longest header with its digest: what a receiver reads before it
/// knows where the data goes.
pub const MAX_HEADER: usize = IC_SIZE;
/// Smallest MAXH2CDATA a controller may offer.
pub const MIN_MAXH2CDATA: u32 = 4096;
/// Most bytes of a termination request (header and the offending header).
pub const MAX_TERM_PLEN: u32 = 152;
const _: () = assert!(CAPSULE_CMD_HLEN == 72 && CAPSULE_RESP_HLEN == 24 && MAX_HEADER >= CAPSULE_CMD_HLEN + DIGEST_SIZE);

/// Common header flags.
pub mod flags {
    pub const HDGSTF: u8 = 0x01;
    pub const DDGSTF: u8 = 0x02;
    /// H2CData, C2HData: the last data PDU of the command.
    pub const LAST_PDU: u8 = 0x04;
    /// C2HData: the command succeeded and no CapsuleResp follows.
    pub const SUCCESS: u8 = 0x08;
}

/// Fatal error status of a termination request.
pub mod fes {
    pub const INVALID_HEADER_FIELD: u16 = 0x01;
    pub const PDU_SEQUENCE_ERROR: u16 = 0x02;
    pub const HEADER_DIGEST_ERROR: u16 = 0x03;
    pub const DATA_OUT_OF_RANGE: u16 = 0x04;
    /// R2T limit exceeded (on H2C), data limit exceeded (on C2H).
    pub const LIMIT_EXCEEDED: u16 = 0x05;
    pub const UNSUPPORTED_PARAMETER: u16 = 0x06;
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum PduType {
    IcReq = 0x00,
    IcResp = 0x01,
    H2CTermReq = 0x02,
    C2HTermReq = 0x03,
    CapsuleCmd = 0x04,
    CapsuleResp = 0x05,
    H2CData = 0x06,
    C2HData = 0x07,
    R2T = 0x09,
}

impl PduType {
    pub fn from_wire(v: u8) -> Result<PduType, WireError> {
        Ok(match v {
            0x00 => PduType::IcReq,
            0x01 => PduType::IcResp,
            0x02 => PduType::H2CTermReq,
            0x03 => PduType::C2HTermReq,
            0x04 => PduType::CapsuleCmd,
            0x05 => PduType::CapsuleResp,
            0x06 => PduType::H2CData,
            0x07 => PduType::C2HData,
            0x09 => PduType::R2T,
            v => return Err(WireError::UnknownPduType(v)),
        })
    }

    /// The one header length the type has.
    pub fn hlen(self) -> usize {
        match self {
            PduType::IcReq | PduType::IcResp => IC_SIZE,
            PduType::CapsuleCmd => CAPSULE_CMD_HLEN,
            PduType::CapsuleResp => CAPSULE_RESP_HLEN,
            _ => SHORT_HLEN,
        }
    }

    /// Whether the type carries data after its header.
    pub fn has_data(self) -> bool {
        matches!(self, PduType::CapsuleCmd | PduType::H2CData | PduType::C2HData | PduType::H2CTermReq | PduType::C2HTermReq)
    }

    /// Whether header and data digests apply (every type but the
    /// connection's initialization and its termination).
    pub fn digested(self) -> bool {
        !matches!(self, PduType::IcReq | PduType::IcResp | PduType::H2CTermReq | PduType::C2HTermReq)
    }

    /// The flags other than the digest flags that the type may carry.
    fn other_flags(self) -> u8 {
        match self {
            PduType::H2CData => flags::LAST_PDU,
            PduType::C2HData => flags::LAST_PDU | flags::SUCCESS,
            _ => 0,
        }
    }
}

/// Which digests the connection negotiated (ICReq asks, ICResp grants).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Digests {
    pub header: bool,
    pub data: bool,
}

impl Digests {
    fn from_wire(v: u8) -> Digests {
        Digests { header: v & 0x01 != 0, data: v & 0x02 != 0 }
    }
    fn to_wire(self) -> u8 {
        self.header as u8 | (self.data as u8) << 1
    }
}

/// CRC32C of a header (or of data), as NVMe/TCP digests are computed.
pub fn digest(bytes: &[u8]) -> u32 {
    crc32c::crc32c(bytes)
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CommonHeader {
    pub pdu_type: PduType,
    pub flags: u8,
    pub hlen: u8,
    pub pdo: u8,
    pub plen: u32,
}

/// Where the parts of one PDU are, from its common header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Layout {
    /// Header length, and with its digest.
    pub hlen: usize,
    pub header_with_digest: usize,
    /// Offset and length of the data (0 and 0 when there is none).
    pub data_offset: usize,
    pub data_len: usize,
    /// Whether a data digest follows the data.
    pub data_digest: bool,
    /// The whole PDU.
    pub plen: usize,
}

impl CommonHeader {
    pub fn decode(b: &[u8]) -> Result<CommonHeader, WireError> {
        need("PDU common header", b, CH_SIZE)?;
        Ok(CommonHeader { pdu_type: PduType::from_wire(b[0])?, flags: b[1], hlen: b[2], pdo: b[3], plen: get_u32(b, 4) })
    }

    pub fn encode(&self, out: &mut [u8]) {
        out[0] = self.pdu_type as u8;
        out[1] = self.flags;
        out[2] = self.hlen;
        out[3] = self.pdo;
        put_u32(out, 4, self.plen);
    }

    /// Checks the header's fields against each other, the type and the
    /// negotiated digests (`None` before ICReq/ICResp completed: only an
    /// ICReq or ICResp is valid then), and `max_plen`, the most a PDU
    /// may be on this connection; returns where the parts are.
    pub fn layout(&self, digests: Option<Digests>, max_plen: u32) -> Result<Layout, WireError> {
        const WHAT: &str = "PDU common header";
        let bad = |field: &'static str, value: u64| WireError::InvalidField { what: WHAT, field, value };
        // A PDU that may carry no data here has PDO 0 and ends after its header.
        let bad_pdo_or_plen = || if self.pdo != 0 { bad("PDO", self.pdo as u64) } else { bad("PLEN", self.plen as u64) };
        let t = self.pdu_type;
        let initializing = matches!(t, PduType::IcReq | PduType::IcResp);
        let Some(digests) = (if initializing { Some(Digests::default()) } else { digests }) else {
            return Err(bad("PDU type before initialization", t as u64));
        };
        if self.hlen as usize != t.hlen() {
            return Err(bad("HLEN", self.hlen as u64));
        }
        let hlen = t.hlen();
        let (hd, dd) = if t.digested() { (digests.header, digests.data) } else { (false, false) };
        let allowed = t.other_flags() | if hd { flags::HDGSTF } else { 0 } | if dd { flags::DDGSTF } else { 0 };
        if self.flags & !allowed != 0 || hd != (self.flags & flags::HDGSTF != 0) {
            return Err(bad("FLAGS", self.flags as u64));
        }
        if self.plen > max_plen {
            return Err(bad("PLEN", self.plen as u64));
        }
        let plen = self.plen as usize;
        let header_with_digest = hlen + if hd { DIGEST_SIZE } else { 0 };
        if initializing {
            if self.pdo != 0 || plen != IC_SIZE {
                return Err(bad_pdo_or_plen());
            }
            return Ok(Layout { hlen, header_with_digest, data_offset: 0, data_len: 0, data_digest: false, plen });
        }
        if plen < header_with_digest {
            return Err(bad("PLEN", plen as u64));
        }
        let has_data = plen > header_with_digest;
        if !has_data || !t.has_data() {
            if has_data || self.pdo != 0 || self.flags & flags::DDGSTF != 0 {
                return Err(bad_pdo_or_plen());
            }
            return Ok(Layout { hlen, header_with_digest, data_offset: 0, data_len: 0, data_digest: false, plen });
        }
        // Termination requests carry their data right after the header,
        // with PDO 0; data PDUs and capsules say where it starts.
        let data_offset = if matches!(t, PduType::H2CTermReq | PduType::C2HTermReq) {
            if self.pdo != 0 {
                return Err(bad("PDO", self.pdo as u64));
            }
            hlen
        } else {
            self.pdo as usize
        };
        if data_offset < header_with_digest || data_offset >= plen {
            return Err(bad("PDO", self.pdo as u64));
        }
        if dd != (self.flags & flags::DDGSTF != 0) {
            return Err(bad("FLAGS", self.flags as u64));
        }
        let trailer = if dd { DIGEST_SIZE } else { 0 };
        let data_len = plen.checked_sub(data_offset + trailer).filter(|&n| n > 0).ok_or(bad("PLEN", plen as u64))?;
        Ok(Layout { hlen, header_with_digest, data_offset, data_len, data_digest: dd, plen })
    }
}

/// ICReq: the host opens the connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IcReq {
    /// PDU format version, 0.
    pub pfv: u16,
    /// Host PDU data alignment, 0-based in dwords (0 to 31).
    pub hpda: u8,
    pub digests: Digests,
    /// Most outstanding R2Ts per command, 0-based.
    pub maxr2t: u32,
}

/// ICResp: the controller answers it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IcResp {
    pub pfv: u16,
    /// Controller PDU data alignment, 0-based in dwords (0 to 31).
    pub cpda: u8,
    pub digests: Digests,
    /// Most data in one H2CData PDU, at least 4,096.
    pub maxh2cdata: u32,
}

/// H2CData or C2HData: data of command `cccid` at `offset` into its
/// transfer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DataPdu {
    pub cccid: u16,
    /// H2CData: the transfer tag of the R2T it answers; C2HData: 0.
    pub ttag: u16,
    pub offset: u32,
    pub length: u32,
    pub last: bool,
    /// C2HData: the command succeeded, no CapsuleResp follows.
    pub success: bool,
}

/// R2T: the controller asks for `length` bytes at `offset` of command
/// `cccid`'s data.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct R2t {
    pub cccid: u16,
    pub ttag: u16,
    pub offset: u32,
    pub length: u32,
}

/// H2CTermReq or C2HTermReq: a fatal error closes the connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TermReq {
    pub fes: u16,
    /// Fatal error information: the offset of the bad field for
    /// INVALID_HEADER_FIELD, else 0.
    pub fei: u32,
}

/// A decoded PDU header.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Pdu {
    IcReq(IcReq),
    IcResp(IcResp),
    H2CTermReq(TermReq),
    C2HTermReq(TermReq),
    /// The entry is read with [`SubmissionEntry::decode_unchecked`]: an
    /// invalid command gets an error completion, not a termination.
    CapsuleCmd(SubmissionEntry),
    CapsuleResp(CompletionEntry),
    H2CData(DataPdu),
    C2HData(DataPdu),
    R2T(R2t),
}

impl Pdu {
    pub fn pdu_type(&self) -> PduType {
        match self {
            Pdu::IcReq(_) => PduType::IcReq,
            Pdu::IcResp(_) => PduType::IcResp,
            Pdu::H2CTermReq(_) => PduType::H2CTermReq,
            Pdu::C2HTermReq(_) => PduType::C2HTermReq,
            Pdu::CapsuleCmd(_) => PduType::CapsuleCmd,
            Pdu::CapsuleResp(_) => PduType::CapsuleResp,
            Pdu::H2CData(_) => PduType::H2CData,
            Pdu::C2HData(_) => PduType::C2HData,
            Pdu::R2T(_) => PduType::R2T,
        }
    }

    /// Decodes the header of a PDU whose common header `ch` was checked
    /// by [`CommonHeader::layout`] into `layout`; `b` holds at least the
    /// header and its digest. A wrong header digest is an error.
    pub fn decode(ch: &CommonHeader, layout: &Layout, b: &[u8]) -> Result<Pdu, WireError> {
        let t = ch.pdu_type;
        need("PDU header", b, layout.header_with_digest)?;
        let h = &b[..layout.hlen];
        if layout.header_with_digest > layout.hlen {
            let got = get_u32(b, layout.hlen);
            let want = digest(h);
            if got != want {
                return Err(WireError::HeaderDigest { what: "PDU header", got, want });
            }
        }
        let what = "PDU header";
        Ok(match t {
            PduType::IcReq | PduType::IcResp => {
                reserved_zero(what, h, 16..IC_SIZE)?;
                let (pfv, align, dgst, last) = (get_u16(h, 8), h[10], h[11], get_u32(h, 12));
                if pfv != 0 {
                    return Err(WireError::InvalidField { what, field: "PFV", value: pfv as u64 });
                }
                if align > 31 {
                    return Err(WireError::InvalidField { what, field: if t == PduType::IcReq { "HPDA" } else { "CPDA" }, value: align as u64 });
                }
                if dgst & !0x03 != 0 {
                    return Err(WireError::InvalidField { what, field: "DGST", value: dgst as u64 });
                }
                let digests = Digests::from_wire(dgst);
                if t == PduType::IcReq {
                    Pdu::IcReq(IcReq { pfv, hpda: align, digests, maxr2t: last })
                } else {
                    if last < MIN_MAXH2CDATA || last % 4 != 0 {
                        return Err(WireError::InvalidField { what, field: "MAXH2CDATA", value: last as u64 });
                    }
                    Pdu::IcResp(IcResp { pfv, cpda: align, digests, maxh2cdata: last })
                }
            }
            PduType::H2CTermReq | PduType::C2HTermReq => {
                reserved_zero(what, h, 14..SHORT_HLEN)?;
                let term = TermReq { fes: get_u16(h, 8), fei: get_u32(h, 10) };
                if t == PduType::H2CTermReq {
                    Pdu::H2CTermReq(term)
                } else {
                    Pdu::C2HTermReq(term)
                }
            }
            PduType::CapsuleCmd => Pdu::CapsuleCmd(SubmissionEntry::decode_unchecked(&h[CH_SIZE..])?),
            PduType::CapsuleResp => Pdu::CapsuleResp(CompletionEntry::decode(&h[CH_SIZE..])?),
            PduType::H2CData | PduType::C2HData => {
                if t == PduType::C2HData {
                    reserved_zero(what, h, 10..12)?;
                }
                reserved_zero(what, h, 20..SHORT_HLEN)?;
                let d = DataPdu {
                    cccid: get_u16(h, 8),
                    ttag: get_u16(h, 10),
                    offset: get_u32(h, 12),
                    length: get_u32(h, 16),
                    last: ch.flags & flags::LAST_PDU != 0,
                    success: ch.flags & flags::SUCCESS != 0,
                };
                if d.length == 0 || d.length as usize != layout.data_len {
                    return Err(WireError::InvalidField { what, field: "DATAL", value: d.length as u64 });
                }
                if d.success && !d.last {
                    return Err(WireError::InvalidField { what, field: "FLAGS", value: ch.flags as u64 });
                }
                if t == PduType::H2CData {
                    Pdu::H2CData(d)
                } else {
                    Pdu::C2HData(d)
                }
            }
            PduType::R2T => {
                reserved_zero(what, h, 20..SHORT_HLEN)?;
                let r = R2t { cccid: get_u16(h, 8), ttag: get_u16(h, 10), offset: get_u32(h, 12), length: get_u32(h, 16) };
                if r.length == 0 {
                    return Err(WireError::InvalidField { what, field: "R2TL", value: 0 });
                }
                Pdu::R2T(r)
            }
        })
    }

    /// Writes the header (common header, type fields, header digest if
    /// `digests.header` and the type is digested) for a PDU carrying
    /// `data_len` bytes of data whose first byte lies `data_align` bytes
    /// from the PDU's start at the earliest (the peer's PDA; 0: right
    /// after the header). Returns the header's length with digest and
    /// padding (where the data goes), and the PDU's total length. The
    /// caller sends the data and, if `digests.data` and there is data, its
    /// digest ([`digest`]).
    pub fn encode(&self, digests: Digests, data_len: u32, data_align: usize, out: &mut [u8; MAX_HEADER]) -> (usize, u32) {
        out.fill(0);
        let t = self.pdu_type();
        let hlen = t.hlen();
        let (hd, dd) = if t.digested() { (digests.header, digests.data && data_len > 0) } else { (false, false) };
        let mut fl = if hd { flags::HDGSTF } else { 0 } | if dd { flags::DDGSTF } else { 0 };
        let h = &mut out[..];
        match self {
            Pdu::IcReq(r) => {
                put_u16(h, 8, r.pfv);
                h[10] = r.hpda;
                h[11] = r.digests.to_wire();
                put_u32(h, 12, r.maxr2t);
            }
            Pdu::IcResp(r) => {
                put_u16(h, 8, r.pfv);
                h[10] = r.cpda;
                h[11] = r.digests.to_wire();
                put_u32(h, 12, r.maxh2cdata);
            }
            Pdu::H2CTermReq(r) | Pdu::C2HTermReq(r) => {
                put_u16(h, 8, r.fes);
                put_u32(h, 10, r.fei);
            }
            Pdu::CapsuleCmd(e) => {
                let sqe: &mut [u8; SQE_SIZE] = (&mut h[CH_SIZE..CAPSULE_CMD_HLEN]).try_into().expect("64 bytes");
                e.encode(sqe);
            }
            Pdu::CapsuleResp(c) => {
                let cqe: &mut [u8; CQE_SIZE] = (&mut h[CH_SIZE..CAPSULE_RESP_HLEN]).try_into().expect("16 bytes");
                c.encode(cqe);
            }
            Pdu::H2CData(d) | Pdu::C2HData(d) => {
                put_u16(h, 8, d.cccid);
                put_u16(h, 10, d.ttag);
                put_u32(h, 12, d.offset);
                put_u32(h, 16, d.length);
                fl |= if d.last { flags::LAST_PDU } else { 0 } | if d.success { flags::SUCCESS } else { 0 };
            }
            Pdu::R2T(r) => {
                put_u16(h, 8, r.cccid);
                put_u16(h, 10, r.ttag);
                put_u32(h, 12, r.offset);
                put_u32(h, 16, r.length);
            }
        }
        let header_with_digest = hlen + if hd { DIGEST_SIZE } else { 0 };
        let is_term = matches!(t, PduType::H2CTermReq | PduType::C2HTermReq);
        let data_offset = if data_len == 0 || is_term { header_with_digest } else { header_with_digest.max(data_align) };
        let pdo = if data_len == 0 || is_term { 0 } else { data_offset as u8 };
        let plen = (data_offset + data_len as usize + if dd { DIGEST_SIZE } else { 0 }) as u32;
        CommonHeader { pdu_type: t, flags: fl, hlen: hlen as u8, pdo, plen }.encode(h);
        if hd {
            let d = digest(&out[..hlen]);
            put_u32(out, hlen, d);
        }
        (data_offset, plen)
    }
}

impl Pdu {
    /// The whole PDU as it goes on the wire: header (with its digest and
    /// padding, see [`Pdu::encode`]), `data`, and the data digest where
    /// `digests.data` and the type call for one. For test clients and
    /// seeds; a transport sends the parts without joining them.
    pub fn to_wire(&self, digests: Digests, data: &[u8], data_align: usize) -> Vec<u8> {
        let mut header = [0u8; MAX_HEADER];
        let (at, plen) = self.encode(digests, data.len() as u32, data_align, &mut header);
        let mut out = Vec::with_capacity(plen as usize);
        out.extend_from_slice(&header[..at]);
        out.extend_from_slice(data);
        if digests.data && !data.is_empty() && self.pdu_type().digested() {
            out.extend_from_slice(&digest(data).to_le_bytes());
        }
        debug_assert_eq!(out.len(), plen as usize);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::super::sqe::{io_opcode, Sgl};
    use super::super::status::Status;
    use super::*;

    const MAX: u32 = 1 << 20;

    /// Encodes `pdu` with `data`, then decodes the bytes as a receiver
    /// would: common header, layout, header; returns the PDU and its data.
    fn round_trip(pdu: &Pdu, digests: Digests, data: &[u8], align: usize) -> (Vec<u8>, Pdu, Layout) {
        let wire = pdu.to_wire(digests, data, align);
        let ch = CommonHeader::decode(&wire).unwrap();
        let l = ch.layout(Some(digests), MAX).unwrap();
        assert_eq!(wire.len(), l.plen);
        let back = Pdu::decode(&ch, &l, &wire).unwrap();
        assert_eq!(&wire[l.data_offset..l.data_offset + l.data_len], data);
        (wire, back, l)
    }

    #[test]
    fn every_pdu_round_trips_with_and_without_digests() {
        let mut cmd = SubmissionEntry::new(io_opcode::WRITE, 5);
        cmd.set_sgl(Sgl::InCapsule { offset: 0, length: 512 });
        let data = [0xa5u8; 512];
        let pdus: Vec<(Pdu, &[u8])> = vec![
            (Pdu::IcReq(IcReq { pfv: 0, hpda: 0, digests: Digests { header: true, data: true }, maxr2t: 0 }), &[][..]),
            (Pdu::IcResp(IcResp { pfv: 0, cpda: 0, digests: Digests { header: true, data: false }, maxh2cdata: 131072 }), &[][..]),
            (Pdu::CapsuleCmd(cmd), &data[..]),
            (Pdu::CapsuleCmd(SubmissionEntry::new(io_opcode::READ, 6)), &[][..]),
            (Pdu::CapsuleResp(CompletionEntry::new(5, Status::SUCCESS)), &[][..]),
            (Pdu::H2CData(DataPdu { cccid: 5, ttag: 2, offset: 4096, length: 512, last: true, success: false }), &data[..]),
            (Pdu::C2HData(DataPdu { cccid: 6, ttag: 0, offset: 0, length: 512, last: true, success: true }), &data[..]),
            (Pdu::R2T(R2t { cccid: 5, ttag: 2, offset: 0, length: 8192 }), &[][..]),
            (Pdu::C2HTermReq(TermReq { fes: fes::HEADER_DIGEST_ERROR, fei: 0 }), &[1u8, 2, 3, 4, 5, 6, 7, 8][..]),
        ];
        for digests in [Digests::default(), Digests { header: true, data: true }] {
            for (pdu, data) in &pdus {
                let (wire, back, l) = round_trip(pdu, digests, data, 0);
                assert_eq!(&back, pdu, "{digests:?}");
                let digested = pdu.pdu_type().digested();
                assert_eq!(l.header_with_digest - l.hlen, if digests.header && digested { 4 } else { 0 });
                assert_eq!(wire[1] & flags::HDGSTF != 0, digests.header && digested);
            }
        }
    }

    #[test]
    fn the_fixed_layouts_match_the_specification() {
        let mut h = [0; MAX_HEADER];
        let (_, plen) = Pdu::IcReq(IcReq { pfv: 0, hpda: 3, digests: Digests { header: false, data: true }, maxr2t: 7 }).encode(Digests::default(), 0, 0, &mut h);
        assert_eq!(&h[..8], &[0x00, 0, 128, 0, 128, 0, 0, 0]);
        assert_eq!((h[10], h[11], plen), (3, 0x02, 128));
        assert_eq!(&h[12..16], &[7, 0, 0, 0]);
        let (_, plen) = Pdu::R2T(R2t { cccid: 0x102, ttag: 0x304, offset: 8, length: 16 }).encode(Digests::default(), 0, 0, &mut h);
        assert_eq!(&h[..24], &[0x09, 0, 24, 0, 24, 0, 0, 0, 2, 1, 4, 3, 8, 0, 0, 0, 16, 0, 0, 0, 0, 0, 0, 0]);
        assert_eq!(plen, 24);
        // A capsule with data aligned by the peer's PDA: data at 128.
        let (at, plen) = Pdu::CapsuleCmd(SubmissionEntry::new(io_opcode::WRITE, 1)).encode(Digests::default(), 4096, 128, &mut h);
        assert_eq!((h[0], h[2], h[3], at, plen), (0x04, 72, 128, 128, 128 + 4096));
    }

    fn header(t: PduType, fl: u8, hlen: u8, pdo: u8, plen: u32) -> CommonHeader {
        CommonHeader { pdu_type: t, flags: fl, hlen, pdo, plen }
    }

    #[test]
    fn inconsistent_common_headers_are_refused_before_any_data_is_placed() {
        let none = Some(Digests::default());
        let both = Some(Digests { header: true, data: true });
        let field = |r: Result<Layout, WireError>| match r {
            Err(WireError::InvalidField { field, .. }) => field,
            other => panic!("{other:?}"),
        };
        // Wrong HLEN for the type.
        assert_eq!(field(header(PduType::CapsuleCmd, 0, 24, 0, 72).layout(none, MAX)), "HLEN");
        // Data PDUs: data offset inside the header, past the end, or no data at all.
        assert_eq!(field(header(PduType::H2CData, 0, 24, 8, 100).layout(none, MAX)), "PDO");
        assert_eq!(field(header(PduType::H2CData, 0, 24, 200, 100).layout(none, MAX)), "PDO");
        assert_eq!(field(header(PduType::CapsuleResp, 0, 24, 0, 30).layout(none, MAX)), "PLEN");
        assert_eq!(field(header(PduType::R2T, 0, 24, 24, 24).layout(none, MAX)), "PDO");
        assert_eq!(field(header(PduType::CapsuleCmd, 0, 72, 0, 60).layout(none, MAX)), "PLEN");
        // Longer than the connection allows.
        assert_eq!(field(header(PduType::H2CData, 0, 24, 24, MAX + 1).layout(none, MAX)), "PLEN");
        // Digest flags that disagree with what was negotiated, and flags the type does not have.
        assert_eq!(field(header(PduType::CapsuleResp, flags::HDGSTF, 24, 0, 28).layout(none, MAX)), "FLAGS");
        assert_eq!(field(header(PduType::CapsuleResp, 0, 24, 0, 24).layout(both, MAX)), "FLAGS");
        assert_eq!(field(header(PduType::H2CData, flags::HDGSTF | flags::SUCCESS, 24, 28, 100).layout(both, MAX)), "FLAGS");
        assert_eq!(field(header(PduType::H2CData, flags::HDGSTF, 24, 28, 100).layout(both, MAX)), "FLAGS", "data without its digest flag");
        // Before initialization only ICReq/ICResp.
        assert_eq!(field(header(PduType::CapsuleCmd, 0, 72, 0, 72).layout(None, MAX)), "PDU type before initialization");
        assert_eq!(field(header(PduType::IcReq, 0, 128, 0, 129).layout(None, MAX)), "PLEN");
        // A data digest takes the last 4 bytes.
        let l = header(PduType::H2CData, flags::HDGSTF | flags::DDGSTF, 24, 28, 28 + 512 + 4).layout(both, MAX).unwrap();
        assert_eq!((l.data_offset, l.data_len, l.data_digest), (28, 512, true));
        assert!(matches!(CommonHeader::decode(&[0x08, 0, 24, 0, 24, 0, 0, 0]), Err(WireError::UnknownPduType(8))));
    }

    #[test]
    fn bad_headers_digests_and_fields_are_refused() {
        let d = Digests { header: true, data: true };
        let (mut wire, _, _) = round_trip(&Pdu::R2T(R2t { cccid: 1, ttag: 1, offset: 0, length: 4096 }), d, &[], 0);
        wire[12] ^= 1;
        let ch = CommonHeader::decode(&wire).unwrap();
        let l = ch.layout(Some(d), MAX).unwrap();
        assert!(matches!(Pdu::decode(&ch, &l, &wire), Err(WireError::HeaderDigest { .. })));

        // DATAL must be the data the PDU carries.
        let data = [0u8; 64];
        let (mut wire, _, _) = round_trip(&Pdu::H2CData(DataPdu { cccid: 1, ttag: 1, offset: 0, length: 64, last: true, success: false }), Digests::default(), &data, 0);
        wire[16] = 65;
        let ch = CommonHeader::decode(&wire).unwrap();
        let l = ch.layout(Some(Digests::default()), MAX).unwrap();
        assert!(matches!(Pdu::decode(&ch, &l, &wire), Err(WireError::InvalidField { field: "DATAL", .. })));

        // ICReq with a PDU format version, an alignment or digest bits that do not exist.
        for (at, v, f) in [(8, 1, "PFV"), (10, 32, "HPDA"), (11, 4, "DGST")] {
            let (mut wire, _, _) = round_trip(&Pdu::IcReq(IcReq { pfv: 0, hpda: 0, digests: Digests::default(), maxr2t: 0 }), Digests::default(), &[], 0);
            wire[at] = v;
            let ch = CommonHeader::decode(&wire).unwrap();
            let l = ch.layout(None, MAX).unwrap();
            assert!(matches!(Pdu::decode(&ch, &l, &wire), Err(WireError::InvalidField { field, .. }) if field == f), "{f}");
        }
        // ICResp offering less than 4 KiB per H2CData.
        let (mut wire, _, _) = round_trip(&Pdu::IcResp(IcResp { pfv: 0, cpda: 0, digests: Digests::default(), maxh2cdata: 8192 }), Digests::default(), &[], 0);
        wire[12..16].copy_from_slice(&1024u32.to_le_bytes());
        let ch = CommonHeader::decode(&wire).unwrap();
        assert!(matches!(Pdu::decode(&ch, &ch.layout(None, MAX).unwrap(), &wire), Err(WireError::InvalidField { field: "MAXH2CDATA", .. })));
        // Reserved bytes of an ICReq.
        let (mut wire, _, _) = round_trip(&Pdu::IcReq(IcReq { pfv: 0, hpda: 0, digests: Digests::default(), maxr2t: 0 }), Digests::default(), &[], 0);
        wire[100] = 1;
        let ch = CommonHeader::decode(&wire).unwrap();
        assert_eq!(Pdu::decode(&ch, &ch.layout(None, MAX).unwrap(), &wire), Err(WireError::ReservedNotZero { what: "PDU header", offset: 100 }));
    }
}
