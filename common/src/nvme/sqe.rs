//! The 64-byte submission queue entry (NVMe Base 2.0, "Common Command
//! Format") and the SGL descriptor in its data pointer.
//!
//! | bytes | field |
//! |---|---|
//! | 0 | opcode |
//! | 1 | FUSE (bits 1:0), PSDT (bits 7:6) |
//! | 2..4 | command identifier |
//! | 4..8 | namespace id (Fabrics commands: byte 4 is FCTYPE) |
//! | 8..16 | command dwords 2 and 3 |
//! | 16..24 | metadata pointer |
//! | 24..40 | data pointer: SGL descriptor 1 |
//! | 40..64 | command dwords 10 to 15 |

use super::{get_u16, get_u32, get_u64, need, put_u16, put_u32, put_u64, reserved_zero, WireError};

/// Size of a submission queue entry.
pub const SQE_SIZE: usize = 64;
/// Size of an SGL descriptor.
pub const SGL_DESCRIPTOR_SIZE: usize = 16;
const _: () = assert!(SQE_SIZE == 40 + 6 * 4 && SGL_DESCRIPTOR_SIZE == 16);

/// PSDT value: the data pointer is an SGL and the metadata pointer an
/// address. Fabrics hosts always use it; PRPs exist only on PCIe.
pub const PSDT_SGL: u8 = 0b01;

/// Admin command opcodes a target serves (Fabrics commands share 0x7f).
pub mod admin_opcode {
    pub const DELETE_IO_SQ: u8 = 0x00;
    pub const CREATE_IO_SQ: u8 = 0x01;
    pub const GET_LOG_PAGE: u8 = 0x02;
    pub const IDENTIFY: u8 = 0x06;
    pub const ABORT: u8 = 0x08;
    pub const SET_FEATURES: u8 = 0x09;
    pub const GET_FEATURES: u8 = 0x0a;
    pub const ASYNC_EVENT_REQUEST: u8 = 0x0c;
    pub const KEEP_ALIVE: u8 = 0x18;
    /// Fabrics commands (Connect, Property Get/Set, Disconnect); FCTYPE
    /// says which. Valid on admin and I/O queues alike.
    pub const FABRICS: u8 = 0x7f;
}

/// NVM command set I/O opcodes.
pub mod io_opcode {
    pub const FLUSH: u8 = 0x00;
    pub const WRITE: u8 = 0x01;
    pub const READ: u8 = 0x02;
    pub const WRITE_ZEROES: u8 = 0x08;
    pub const DATASET_MANAGEMENT: u8 = 0x09;
}

/// SGL descriptor identifiers (type in bits 7:4, subtype in 3:0) that
/// NVMe-oF hosts send.
pub mod sgl_id {
    /// Data Block, subtype Offset: in-capsule data at an offset into the
    /// capsule's data (NVMe/TCP and NVMe/RDMA).
    pub const DATA_BLOCK_OFFSET: u8 = 0x01;
    /// Keyed Data Block, subtype Address: host memory under an RDMA key.
    pub const KEYED_ADDRESS: u8 = 0x40;
    /// Keyed Data Block, subtype Invalidate Key: as above, and the target
    /// invalidates the key with its response (SEND with Invalidate).
    pub const KEYED_INVALIDATE: u8 = 0x4f;
    /// Transport SGL Data Block, transport-specific subtype: NVMe/TCP data
    /// moved by H2CData/R2T or C2HData PDUs.
    pub const TRANSPORT_DATA_BLOCK: u8 = 0x5a;
}

/// Where a command's data is, as its SGL descriptor 1 says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Sgl {
    /// In-capsule data: `length` bytes at `offset` into the capsule's data.
    InCapsule { offset: u64, length: u32 },
    /// NVMe/RDMA: `length` bytes (at most 2^24 - 1) of host memory at
    /// `addr` under `key`; `invalidate` asks the target to invalidate the
    /// key with its response.
    Keyed { addr: u64, length: u32, key: u32, invalidate: bool },
    /// NVMe/TCP: `length` bytes moved by data PDUs.
    Transport { length: u32 },
}

impl Sgl {
    /// No data: a zero-length transport descriptor, as hosts send on
    /// commands that move none.
    pub const NONE: Sgl = Sgl::Transport { length: 0 };

    /// Bytes of data the descriptor covers.
    pub fn length(&self) -> u32 {
        match *self {
            Sgl::InCapsule { length, .. } | Sgl::Keyed { length, .. } | Sgl::Transport { length } => length,
        }
    }

    pub fn encode(&self, out: &mut [u8; SGL_DESCRIPTOR_SIZE]) {
        out.fill(0);
        match *self {
            Sgl::InCapsule { offset, length } => {
                put_u64(out, 0, offset);
                put_u32(out, 8, length);
                out[15] = sgl_id::DATA_BLOCK_OFFSET;
            }
            Sgl::Keyed { addr, length, key, invalidate } => {
                put_u64(out, 0, addr);
                out[8..11].copy_from_slice(&length.to_le_bytes()[..3]);
                put_u32(out, 11, key);
                out[15] = if invalidate { sgl_id::KEYED_INVALIDATE } else { sgl_id::KEYED_ADDRESS };
            }
            Sgl::Transport { length } => {
                put_u32(out, 8, length);
                out[15] = sgl_id::TRANSPORT_DATA_BLOCK;
            }
        }
    }

    /// Decodes a descriptor; any other type, or reserved bytes of a
    /// transport descriptor set, is an error (the front end answers it with
    /// "SGL descriptor type invalid").
    pub fn decode(b: &[u8]) -> Result<Sgl, WireError> {
        const WHAT: &str = "SGL descriptor";
        need(WHAT, b, SGL_DESCRIPTOR_SIZE)?;
        let b = &b[..SGL_DESCRIPTOR_SIZE];
        match b[15] {
            // Bytes 12..15 are not checked: the Linux NVMe/RDMA host leaves
            // a previous keyed SGL's key there when it reuses a request for
            // in-capsule data, and Linux nvmet ignores them.
            sgl_id::DATA_BLOCK_OFFSET => Ok(Sgl::InCapsule { offset: get_u64(b, 0), length: get_u32(b, 8) }),
            id @ (sgl_id::KEYED_ADDRESS | sgl_id::KEYED_INVALIDATE) => Ok(Sgl::Keyed {
                addr: get_u64(b, 0),
                length: u32::from_le_bytes([b[8], b[9], b[10], 0]),
                key: get_u32(b, 11),
                invalidate: id == sgl_id::KEYED_INVALIDATE,
            }),
            sgl_id::TRANSPORT_DATA_BLOCK => {
                // The address is reserved for this type: data moves by PDU.
                reserved_zero(WHAT, b, 0..8)?;
                reserved_zero(WHAT, b, 12..15)?;
                Ok(Sgl::Transport { length: get_u32(b, 8) })
            }
            id => Err(WireError::InvalidField { what: WHAT, field: "SGL identifier", value: id as u64 }),
        }
    }
}

/// A submission queue entry. The opcode's meaning depends on the queue
/// (admin or I/O), so it stays a byte here; the accessors below read the
/// command-specific dwords for the commands this target serves.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SubmissionEntry {
    pub opcode: u8,
    /// Byte 1: FUSE (bits 1:0) and PSDT (bits 7:6).
    pub flags: u8,
    pub cid: u16,
    /// Namespace id; on a Fabrics command (opcode 0x7f) byte 0 of it is
    /// FCTYPE, see [`SubmissionEntry::fctype`].
    pub nsid: u32,
    pub cdw2: u32,
    pub cdw3: u32,
    pub mptr: u64,
    /// SGL descriptor 1, as sent (decode with [`Sgl::decode`]; a bad
    /// descriptor is a command error, not a broken PDU).
    pub dptr: [u8; SGL_DESCRIPTOR_SIZE],
    /// Command dwords 10 to 15.
    pub cdw: [u32; 6],
}

impl SubmissionEntry {
    /// An entry with the given opcode and command id, an SGL data pointer
    /// covering no data, and everything else zero.
    pub fn new(opcode: u8, cid: u16) -> SubmissionEntry {
        let mut e = SubmissionEntry { opcode, flags: PSDT_SGL << 6, cid, nsid: 0, cdw2: 0, cdw3: 0, mptr: 0, dptr: [0; 16], cdw: [0; 6] };
        e.set_sgl(Sgl::NONE);
        e
    }

    pub fn encode(&self, out: &mut [u8; SQE_SIZE]) {
        out[0] = self.opcode;
        out[1] = self.flags;
        put_u16(out, 2, self.cid);
        put_u32(out, 4, self.nsid);
        put_u32(out, 8, self.cdw2);
        put_u32(out, 12, self.cdw3);
        put_u64(out, 16, self.mptr);
        out[24..40].copy_from_slice(&self.dptr);
        for (i, d) in self.cdw.iter().enumerate() {
            put_u32(out, 40 + 4 * i, *d);
        }
    }

    pub fn to_bytes(&self) -> [u8; SQE_SIZE] {
        let mut out = [0; SQE_SIZE];
        self.encode(&mut out);
        out
    }

    /// Reads an entry and checks what holds for every command: no fused
    /// operations, an SGL data pointer (PSDT 01), reserved bits clear.
    pub fn decode(b: &[u8]) -> Result<SubmissionEntry, WireError> {
        let e = Self::decode_unchecked(b)?;
        e.validate()?;
        Ok(e)
    }

    /// Reads an entry without [`SubmissionEntry::validate`]: for a front
    /// end that answers a malformed command with an error completion (it
    /// needs the command id for that) instead of dropping the connection.
    pub fn decode_unchecked(b: &[u8]) -> Result<SubmissionEntry, WireError> {
        need("submission entry", b, SQE_SIZE)?;
        let mut dptr = [0; SGL_DESCRIPTOR_SIZE];
        dptr.copy_from_slice(&b[24..40]);
        let mut cdw = [0; 6];
        for (i, d) in cdw.iter_mut().enumerate() {
            *d = get_u32(b, 40 + 4 * i);
        }
        Ok(SubmissionEntry {
            opcode: b[0],
            flags: b[1],
            cid: get_u16(b, 2),
            nsid: get_u32(b, 4),
            cdw2: get_u32(b, 8),
            cdw3: get_u32(b, 12),
            mptr: get_u64(b, 16),
            dptr,
            cdw,
        })
    }

    /// Checks that need no queue or namespace state.
    pub fn validate(&self) -> Result<(), WireError> {
        const WHAT: &str = "submission entry";
        if self.fuse() != 0 {
            return Err(WireError::InvalidField { what: WHAT, field: "FUSE", value: self.fuse() as u64 });
        }
        if self.psdt() != PSDT_SGL {
            return Err(WireError::InvalidField { what: WHAT, field: "PSDT", value: self.psdt() as u64 });
        }
        if self.flags & 0b0011_1100 != 0 {
            return Err(WireError::ReservedNotZero { what: WHAT, offset: 1 });
        }
        Ok(())
    }

    pub fn fuse(&self) -> u8 {
        self.flags & 0b11
    }
    pub fn psdt(&self) -> u8 {
        self.flags >> 6
    }

    /// The data pointer.
    pub fn sgl(&self) -> Result<Sgl, WireError> {
        Sgl::decode(&self.dptr)
    }
    pub fn set_sgl(&mut self, sgl: Sgl) {
        sgl.encode(&mut self.dptr);
    }

    /// Fabrics commands (opcode 0x7f): the command type, byte 4.
    pub fn fctype(&self) -> u8 {
        self.nsid as u8
    }

    /// Read, Write, Write Zeroes: the starting LBA (dwords 10 and 11).
    pub fn slba(&self) -> u64 {
        self.cdw[0] as u64 | (self.cdw[1] as u64) << 32
    }
    /// Read, Write, Write Zeroes: the number of blocks (dword 12 bits
    /// 15:0 hold it 0-based, so this is 1 to 65,536).
    pub fn block_count(&self) -> u32 {
        (self.cdw[2] & 0xffff) + 1
    }
    /// Read, Write, Write Zeroes: Force Unit Access (dword 12 bit 30).
    pub fn fua(&self) -> bool {
        self.cdw[2] & (1 << 30) != 0
    }
    /// Write Zeroes: Deallocate (dword 12 bit 25).
    pub fn deallocate(&self) -> bool {
        self.cdw[2] & (1 << 25) != 0
    }
    /// Sets the starting LBA, the block count (1 to 65,536) and FUA.
    pub fn set_rw(&mut self, slba: u64, blocks: u32, fua: bool) {
        debug_assert!((1..=65536).contains(&blocks));
        self.cdw[0] = slba as u32;
        self.cdw[1] = (slba >> 32) as u32;
        self.cdw[2] = (blocks - 1) | if fua { 1 << 30 } else { 0 };
    }
    /// Dataset Management: number of ranges (dword 10 bits 7:0 hold it
    /// 0-based, so 1 to 256) and the Attribute Deallocate bit (dword 11
    /// bit 2).
    pub fn dsm_ranges(&self) -> (u32, bool) {
        ((self.cdw[0] & 0xff) + 1, self.cdw[1] & (1 << 2) != 0)
    }
}

/// Size of one Dataset Management range.
pub const DSM_RANGE_SIZE: usize = 16;

/// One Dataset Management range: context attributes, length in blocks,
/// starting LBA.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DsmRange {
    pub attributes: u32,
    pub blocks: u32,
    pub slba: u64,
}

impl DsmRange {
    pub fn decode(b: &[u8]) -> Result<DsmRange, WireError> {
        need("dataset management range", b, DSM_RANGE_SIZE)?;
        Ok(DsmRange { attributes: get_u32(b, 0), blocks: get_u32(b, 4), slba: get_u64(b, 8) })
    }
    pub fn encode(&self, out: &mut [u8; DSM_RANGE_SIZE]) {
        put_u32(out, 0, self.attributes);
        put_u32(out, 4, self.blocks);
        put_u64(out, 8, self.slba);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_read_round_trips_at_its_spec_offsets() {
        let mut e = SubmissionEntry::new(io_opcode::READ, 0x1234);
        e.nsid = 7;
        e.set_rw(0x1_0000_0002, 8, true);
        e.set_sgl(Sgl::Transport { length: 4096 });
        let b = e.to_bytes();
        assert_eq!(b[0], 0x02);
        assert_eq!(b[1], 0x40, "PSDT 01, no fuse");
        assert_eq!(&b[2..4], &[0x34, 0x12]);
        assert_eq!(&b[4..8], &[7, 0, 0, 0]);
        assert_eq!(&b[40..48], &[2, 0, 0, 0, 1, 0, 0, 0], "SLBA in dwords 10-11");
        assert_eq!(&b[48..52], &[7, 0, 0, 0x40], "NLB 0-based, FUA bit 30");
        assert_eq!(b[39], 0x5a, "transport SGL data block");
        assert_eq!(&b[32..36], &4096u32.to_le_bytes());
        let d = SubmissionEntry::decode(&b).unwrap();
        assert_eq!(d, e);
        assert_eq!((d.slba(), d.block_count(), d.fua()), (0x1_0000_0002, 8, true));
        assert_eq!(d.sgl().unwrap(), Sgl::Transport { length: 4096 });
    }

    #[test]
    fn every_sgl_kind_round_trips_and_others_are_refused() {
        for sgl in [
            Sgl::InCapsule { offset: 0, length: 8192 },
            Sgl::Keyed { addr: 0xdead_beef_0000, length: 0xff_ffff, key: 0x1234_5678, invalidate: false },
            Sgl::Keyed { addr: 1, length: 512, key: 9, invalidate: true },
            Sgl::Transport { length: 1 << 20 },
        ] {
            let mut b = [0; 16];
            sgl.encode(&mut b);
            assert_eq!(Sgl::decode(&b).unwrap(), sgl);
        }
        let mut b = [0; 16];
        b[15] = 0x30; // last segment: not sent by fabrics hosts for SGL 1
        assert!(matches!(Sgl::decode(&b), Err(WireError::InvalidField { field: "SGL identifier", .. })));
        Sgl::Transport { length: 4 }.encode(&mut b);
        b[3] = 1;
        assert_eq!(Sgl::decode(&b), Err(WireError::ReservedNotZero { what: "SGL descriptor", offset: 3 }));
        assert!(matches!(Sgl::decode(&b[..15]), Err(WireError::Truncated { .. })));
    }

    #[test]
    fn an_in_capsule_descriptor_ignores_what_its_reserved_bytes_hold() {
        // The Linux NVMe/RDMA host fills in only the address, length and
        // type of an in-capsule descriptor, and reuses a request's command:
        // bytes 12..15 still hold the key of the keyed SGL the request
        // carried before (seen on 6.12 over rxe). Linux nvmet ignores them.
        let mut b = [0; 16];
        Sgl::Keyed { addr: 0x1000, length: 0x2_0000, key: 0xa1b2_c3d4, invalidate: true }.encode(&mut b);
        let stale = b;
        Sgl::InCapsule { offset: 0, length: 4096 }.encode(&mut b);
        b[12..15].copy_from_slice(&stale[12..15]);
        assert_eq!(Sgl::decode(&b).unwrap(), Sgl::InCapsule { offset: 0, length: 4096 });
    }

    #[test]
    fn fused_prp_and_reserved_flags_are_refused() {
        let e = SubmissionEntry::new(io_opcode::WRITE, 1);
        for (flags, field) in [(0x41, "FUSE"), (0x00, "PSDT"), (0x80, "PSDT")] {
            let mut b = e.to_bytes();
            b[1] = flags;
            assert!(matches!(SubmissionEntry::decode(&b), Err(WireError::InvalidField { field: f, .. }) if f == field), "{flags:#x}");
            // The command id stays readable, to answer with an error.
            assert_eq!(SubmissionEntry::decode_unchecked(&b).unwrap().cid, 1);
        }
        let mut b = e.to_bytes();
        b[1] = 0x44;
        assert_eq!(SubmissionEntry::decode(&b), Err(WireError::ReservedNotZero { what: "submission entry", offset: 1 }));
        assert!(matches!(SubmissionEntry::decode(&b[..63]), Err(WireError::Truncated { need: 64, .. })));
    }

    #[test]
    fn write_zeroes_and_dataset_management_fields() {
        let mut e = SubmissionEntry::new(io_opcode::WRITE_ZEROES, 3);
        e.cdw[2] = 0xffff | 1 << 25;
        assert_eq!((e.block_count(), e.deallocate(), e.fua()), (65536, true, false));
        let mut d = SubmissionEntry::new(io_opcode::DATASET_MANAGEMENT, 4);
        d.cdw[0] = 255;
        d.cdw[1] = 1 << 2;
        assert_eq!(d.dsm_ranges(), (256, true));
        let r = DsmRange { attributes: 0, blocks: 16, slba: 1 << 40 };
        let mut b = [0; 16];
        r.encode(&mut b);
        assert_eq!(DsmRange::decode(&b).unwrap(), r);
    }
}
