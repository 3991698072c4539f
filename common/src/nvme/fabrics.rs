//! Fabrics commands (opcode 0x7f, NVMe over Fabrics 1.1, section 3.3):
//! Connect and its data, Property Get and Set, Disconnect.
//!
//! Connect, in the submission entry (the rest is the common format):
//!
//! | bytes | field |
//! |---|---|
//! | 4 | FCTYPE = 0x01 |
//! | 40..42 | RECFMT (record format, 0) |
//! | 42..44 | QID: 0 for the admin queue |
//! | 44..46 | SQSIZE, 0-based |
//! | 46 | CATTR |
//! | 48..52 | KATO in milliseconds (admin queue) |
//!
//! and its 1,024 bytes of data (in the capsule on NVMe/TCP):
//!
//! | bytes | field |
//! |---|---|
//! | 0..16 | host identifier |
//! | 16..18 | controller id (0xffff: any, dynamic model) |
//! | 256..512 | subsystem NQN |
//! | 512..768 | host NQN |

use super::sqe::{admin_opcode, SubmissionEntry};
use super::{get_u16, need, put_u16, reserved_zero, WireError};

/// Fabrics command types (byte 4 of the entry).
pub mod fctype {
    pub const PROPERTY_SET: u8 = 0x00;
    pub const CONNECT: u8 = 0x01;
    pub const PROPERTY_GET: u8 = 0x04;
    pub const AUTHENTICATION_SEND: u8 = 0x05;
    pub const AUTHENTICATION_RECEIVE: u8 = 0x06;
    pub const DISCONNECT: u8 = 0x08;
}

/// Controller properties a fabrics host reads and writes (offsets).
pub mod property {
    /// Controller Capabilities, 8 bytes.
    pub const CAP: u32 = 0x00;
    /// Version, 4 bytes.
    pub const VS: u32 = 0x08;
    /// Controller Configuration, 4 bytes.
    pub const CC: u32 = 0x14;
    /// Controller Status, 4 bytes.
    pub const CSTS: u32 = 0x1c;
    /// NVM Subsystem Reset, 4 bytes.
    pub const NSSR: u32 = 0x20;
}

/// Size of the Connect command's data.
pub const CONNECT_DATA_SIZE: usize = 1024;
/// Size of an NQN field; the NQN itself is at most [`NQN_MAX`] bytes and
/// NUL-terminated.
pub const NQN_FIELD_SIZE: usize = 256;
pub const NQN_MAX: usize = 223;
/// The well-known NQN of a discovery controller.
pub const DISCOVERY_NQN: &str = "nqn.2014-08.org.nvmexpress.discovery";
/// Controller id a host sends to be given any controller (dynamic model).
pub const ANY_CONTROLLER: u16 = 0xffff;

/// A Connect command's fields.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Connect {
    pub recfmt: u16,
    pub qid: u16,
    /// Submission queue size, 0-based as on the wire.
    pub sqsize: u16,
    pub cattr: u8,
    /// Keep-alive timeout in milliseconds (admin queue; 0: none).
    pub kato_ms: u32,
}

impl Connect {
    /// Reads the Connect fields of a Fabrics entry with FCTYPE Connect.
    pub fn from_entry(e: &SubmissionEntry) -> Connect {
        Connect {
            recfmt: e.cdw[0] as u16,
            qid: (e.cdw[0] >> 16) as u16,
            sqsize: e.cdw[1] as u16,
            cattr: (e.cdw[1] >> 16) as u8,
            kato_ms: e.cdw[2],
        }
    }

    /// A Fabrics entry carrying this Connect (its data, 1,024 bytes, is
    /// described by the caller's SGL).
    pub fn to_entry(&self, cid: u16) -> SubmissionEntry {
        let mut e = SubmissionEntry::new(admin_opcode::FABRICS, cid);
        e.nsid = fctype::CONNECT as u32;
        e.cdw[0] = self.recfmt as u32 | (self.qid as u32) << 16;
        e.cdw[1] = self.sqsize as u32 | (self.cattr as u32) << 16;
        e.cdw[2] = self.kato_ms;
        e
    }

    /// Number of entries of the queue, from the 0-based SQSIZE.
    pub fn queue_entries(&self) -> u32 {
        self.sqsize as u32 + 1
    }
}

/// Where an invalid Connect parameter is, for the completion's dword 0
/// (IATTR in bits 23:16, IPO in 15:0).
pub fn invalid_connect_parameter(in_data: bool, offset: u16) -> u64 {
    ((in_data as u64) << 16) | offset as u64
}

/// Byte offsets in [`ConnectData`], for [`invalid_connect_parameter`].
pub mod connect_data_offset {
    pub const HOST_ID: u16 = 0;
    pub const CONTROLLER_ID: u16 = 16;
    pub const SUBSYSTEM_NQN: u16 = 256;
    pub const HOST_NQN: u16 = 512;
}

/// The data of a Connect command.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConnectData {
    pub host_id: [u8; 16],
    pub controller_id: u16,
    pub subsystem_nqn: String,
    pub host_nqn: String,
}

impl ConnectData {
    pub fn decode(b: &[u8]) -> Result<ConnectData, WireError> {
        const WHAT: &str = "connect data";
        need(WHAT, b, CONNECT_DATA_SIZE)?;
        reserved_zero(WHAT, b, 18..256)?;
        reserved_zero(WHAT, b, 768..1024)?;
        let mut host_id = [0; 16];
        host_id.copy_from_slice(&b[0..16]);
        Ok(ConnectData {
            host_id,
            controller_id: get_u16(b, 16),
            subsystem_nqn: decode_nqn(WHAT, "subsystem NQN", &b[256..512])?,
            host_nqn: decode_nqn(WHAT, "host NQN", &b[512..768])?,
        })
    }

    pub fn encode(&self, out: &mut [u8; CONNECT_DATA_SIZE]) -> Result<(), WireError> {
        out.fill(0);
        out[0..16].copy_from_slice(&self.host_id);
        put_u16(out, 16, self.controller_id);
        encode_nqn("connect data", "subsystem NQN", &self.subsystem_nqn, &mut out[256..512])?;
        encode_nqn("connect data", "host NQN", &self.host_nqn, &mut out[512..768])
    }
}

/// An NQN field: UTF-8 up to the first NUL, at most [`NQN_MAX`] bytes,
/// nothing but NULs after it.
pub fn decode_nqn(what: &'static str, field: &'static str, b: &[u8]) -> Result<String, WireError> {
    let bad = || WireError::BadNqn { what, field };
    let len = b.iter().position(|&c| c == 0).ok_or_else(bad)?;
    if len == 0 || len > NQN_MAX || b[len..].iter().any(|&c| c != 0) {
        return Err(bad());
    }
    let s = std::str::from_utf8(&b[..len]).map_err(|_| bad())?;
    if s.chars().any(char::is_control) {
        return Err(bad());
    }
    Ok(s.to_string())
}

pub fn encode_nqn(what: &'static str, field: &'static str, nqn: &str, out: &mut [u8]) -> Result<(), WireError> {
    if nqn.is_empty() || nqn.len() > NQN_MAX || nqn.contains('\0') {
        return Err(WireError::BadNqn { what, field });
    }
    out.fill(0);
    out[..nqn.len()].copy_from_slice(nqn.as_bytes());
    Ok(())
}

/// Property Get or Set: which property, how wide, and (Set) the value.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Property {
    pub offset: u32,
    /// 8 bytes wide (ATTRIB bits 2:0 = 1), else 4.
    pub wide: bool,
    /// Property Set only.
    pub value: u64,
}

impl Property {
    /// Reads a Property Get or Set entry (byte 40 ATTRIB, 44..48 OFST,
    /// 48..56 VALUE).
    pub fn from_entry(e: &SubmissionEntry) -> Result<Property, WireError> {
        let attrib = e.cdw[0] & 0xff;
        if attrib > 1 {
            return Err(WireError::InvalidField { what: "property command", field: "ATTRIB", value: attrib as u64 });
        }
        Ok(Property { offset: e.cdw[1], wide: attrib == 1, value: e.cdw[2] as u64 | (e.cdw[3] as u64) << 32 })
    }

    pub fn to_entry(&self, cid: u16, set: bool) -> SubmissionEntry {
        let mut e = SubmissionEntry::new(admin_opcode::FABRICS, cid);
        e.nsid = (if set { fctype::PROPERTY_SET } else { fctype::PROPERTY_GET }) as u32;
        e.cdw[0] = self.wide as u32;
        e.cdw[1] = self.offset;
        if set {
            e.cdw[2] = self.value as u32;
            e.cdw[3] = (self.value >> 32) as u32;
        }
        e
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn connect_round_trips_at_its_spec_offsets() {
        let c = Connect { recfmt: 0, qid: 3, sqsize: 127, cattr: 0, kato_ms: 5000 };
        let e = c.to_entry(9);
        let b = e.to_bytes();
        assert_eq!((b[0], b[4]), (0x7f, 0x01));
        assert_eq!(&b[42..44], &[3, 0], "QID");
        assert_eq!(&b[44..46], &[127, 0], "SQSIZE");
        assert_eq!(&b[48..52], &5000u32.to_le_bytes(), "KATO");
        let d = SubmissionEntry::decode(&b).unwrap();
        assert_eq!(d.fctype(), fctype::CONNECT);
        assert_eq!(Connect::from_entry(&d), c);
        assert_eq!(c.queue_entries(), 128);
    }

    #[test]
    fn connect_data_round_trips_and_bad_nqns_are_refused() {
        let data = ConnectData {
            host_id: [7; 16],
            controller_id: ANY_CONTROLLER,
            subsystem_nqn: "nqn.2026-11.io.rdmablk:target".into(),
            host_nqn: "nqn.2014-08.org.nvmexpress:uuid:0000".into(),
        };
        let mut b = [0; CONNECT_DATA_SIZE];
        data.encode(&mut b).unwrap();
        assert_eq!(&b[16..18], &[0xff, 0xff]);
        assert_eq!(&b[256..260], b"nqn.");
        assert_eq!(ConnectData::decode(&b).unwrap(), data);

        let mut unterminated = b;
        unterminated[512..768].fill(b'a');
        assert_eq!(ConnectData::decode(&unterminated), Err(WireError::BadNqn { what: "connect data", field: "host NQN" }));
        let mut trailing = b;
        trailing[700] = b'x';
        assert!(matches!(ConnectData::decode(&trailing), Err(WireError::BadNqn { field: "host NQN", .. })));
        let mut long = [0u8; CONNECT_DATA_SIZE];
        long[256..256 + 224].fill(b'n');
        assert!(matches!(ConnectData::decode(&long), Err(WireError::BadNqn { field: "subsystem NQN", .. })));
        let mut reserved = b;
        reserved[100] = 1;
        assert_eq!(ConnectData::decode(&reserved), Err(WireError::ReservedNotZero { what: "connect data", offset: 100 }));
        assert!(matches!(ConnectData::decode(&b[..1023]), Err(WireError::Truncated { .. })));
        assert!(ConnectData { host_nqn: "x".repeat(224), ..data.clone() }.encode(&mut b).is_err());
        assert_eq!(invalid_connect_parameter(true, connect_data_offset::HOST_NQN), 0x1_0200);
    }

    #[test]
    fn property_get_and_set() {
        let set = Property { offset: property::CC, wide: false, value: 0x46_0001 };
        let e = set.to_entry(1, true);
        let b = e.to_bytes();
        assert_eq!((b[4], b[40]), (fctype::PROPERTY_SET, 0));
        assert_eq!(&b[44..48], &0x14u32.to_le_bytes());
        assert_eq!(&b[48..52], &0x46_0001u32.to_le_bytes());
        assert_eq!(Property::from_entry(&SubmissionEntry::decode(&b).unwrap()).unwrap(), set);
        let get = Property { offset: property::CAP, wide: true, value: 0 };
        assert_eq!(Property::from_entry(&get.to_entry(2, false)).unwrap(), get);
        let mut bad = get.to_entry(3, false);
        bad.cdw[0] = 2;
        assert!(matches!(Property::from_entry(&bad), Err(WireError::InvalidField { field: "ATTRIB", .. })));
    }
}
