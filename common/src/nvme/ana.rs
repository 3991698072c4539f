//! Asymmetric Namespace Access (NVMe Base 2.0, 8.1.3): the ANA states and
//! the Asymmetric Namespace Access log page (Get Log Page, LID 0Ch,
//! 5.16.1.13).
//!
//! A namespace belongs to one ANA group in the NVM subsystem; each
//! controller reports the state of every group as seen through it, so two
//! controllers (two gateways) may report one group in different states.
//! The page is a header and one descriptor per group:
//!
//! | bytes | header field |
//! |---|---|
//! | 0..8 | change count |
//! | 8..10 | number of ANA group descriptors |
//! | 10..16 | reserved |
//!
//! | bytes | descriptor field |
//! |---|---|
//! | 0..4 | ANA group id (never 0) |
//! | 4..8 | number of NSID values that follow (0 with RGO) |
//! | 8..16 | change count of the group |
//! | 16 | ANA state, bits 3:0 (7:4 reserved) |
//! | 17..32 | reserved |
//! | 32.. | the NSIDs, 4 bytes each, ascending |

use super::{get_u16, get_u32, get_u64, need, put_u16, put_u32, put_u64, reserved_zero, WireError};

/// Get Log Page LSP bit of the ANA log: Return Groups Only (no NSIDs).
pub const LSP_RGO: u8 = 1;
pub const LOG_HEADER_SIZE: usize = 16;
pub const GROUP_DESCRIPTOR_SIZE: usize = 32;
const _: () = assert!(LOG_HEADER_SIZE == 8 + 2 + 6 && GROUP_DESCRIPTOR_SIZE == 4 + 4 + 8 + 1 + 15);

/// An ANA group's state as seen through one controller.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum AnaState {
    /// Served, the best path.
    Optimized = 0x01,
    /// Served, a worse path than an optimized one.
    NonOptimized = 0x02,
    /// Not served through this controller now: commands get the
    /// path-related status ANA Inaccessible.
    Inaccessible = 0x03,
    /// Never served through this controller again.
    PersistentLoss = 0x04,
    /// Moving between states (for at most ANATT seconds).
    Change = 0x0f,
}

impl AnaState {
    pub fn from_u8(v: u8) -> Option<AnaState> {
        Some(match v {
            0x01 => AnaState::Optimized,
            0x02 => AnaState::NonOptimized,
            0x03 => AnaState::Inaccessible,
            0x04 => AnaState::PersistentLoss,
            0x0f => AnaState::Change,
            _ => return None,
        })
    }

    /// As the Linux host names it (sysfs `ana_state`).
    pub fn name(self) -> &'static str {
        match self {
            AnaState::Optimized => "optimized",
            AnaState::NonOptimized => "non-optimized",
            AnaState::Inaccessible => "inaccessible",
            AnaState::PersistentLoss => "persistent-loss",
            AnaState::Change => "change",
        }
    }
}

/// The page's header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AnaLogHeader {
    pub change_count: u64,
    pub groups: u16,
}

impl AnaLogHeader {
    pub fn decode(b: &[u8]) -> Result<AnaLogHeader, WireError> {
        const WHAT: &str = "ANA log header";
        need(WHAT, b, LOG_HEADER_SIZE)?;
        reserved_zero(WHAT, b, 10..16)?;
        Ok(AnaLogHeader { change_count: get_u64(b, 0), groups: get_u16(b, 8) })
    }

    pub fn encode(&self, out: &mut [u8; LOG_HEADER_SIZE]) {
        out.fill(0);
        put_u64(out, 0, self.change_count);
        put_u16(out, 8, self.groups);
    }
}

/// One group's descriptor, without its NSID list.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AnaGroupDescriptor {
    pub group: u32,
    /// NSIDs that follow the descriptor.
    pub nsids: u32,
    pub change_count: u64,
    pub state: AnaState,
}

impl AnaGroupDescriptor {
    pub fn decode(b: &[u8]) -> Result<AnaGroupDescriptor, WireError> {
        const WHAT: &str = "ANA group descriptor";
        need(WHAT, b, GROUP_DESCRIPTOR_SIZE)?;
        reserved_zero(WHAT, b, 17..32)?;
        if b[16] & 0xf0 != 0 {
            return Err(WireError::ReservedNotZero { what: WHAT, offset: 16 });
        }
        let state = AnaState::from_u8(b[16])
            .ok_or(WireError::InvalidField { what: WHAT, field: "ANA state", value: b[16] as u64 })?;
        let d = AnaGroupDescriptor { group: get_u32(b, 0), nsids: get_u32(b, 4), change_count: get_u64(b, 8), state };
        d.validate()?;
        Ok(d)
    }

    /// Checks that need no other state: a group id is never 0.
    pub fn validate(&self) -> Result<(), WireError> {
        if self.group == 0 {
            return Err(WireError::InvalidField { what: "ANA group descriptor", field: "ANAGRPID", value: 0 });
        }
        Ok(())
    }

    pub fn encode(&self, out: &mut [u8; GROUP_DESCRIPTOR_SIZE]) {
        out.fill(0);
        put_u32(out, 0, self.group);
        put_u32(out, 4, self.nsids);
        put_u64(out, 8, self.change_count);
        out[16] = self.state as u8;
    }
}

/// One group of the page with its namespaces.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AnaGroup {
    pub group: u32,
    pub change_count: u64,
    pub state: AnaState,
    /// Ascending.
    pub nsids: Vec<u32>,
}

/// The whole page.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AnaLog {
    pub change_count: u64,
    pub groups: Vec<AnaGroup>,
}

impl AnaLog {
    /// Its bytes: the header, then each group's descriptor followed by its
    /// NSIDs, or by none with Return Groups Only (`rgo`).
    pub fn encode(&self, rgo: bool) -> Vec<u8> {
        let nsids: usize = if rgo { 0 } else { self.groups.iter().map(|g| g.nsids.len()).sum() };
        let mut out = Vec::with_capacity(LOG_HEADER_SIZE + self.groups.len() * GROUP_DESCRIPTOR_SIZE + 4 * nsids);
        let mut h = [0u8; LOG_HEADER_SIZE];
        AnaLogHeader { change_count: self.change_count, groups: self.groups.len() as u16 }.encode(&mut h);
        out.extend_from_slice(&h);
        for g in &self.groups {
            let listed: &[u32] = if rgo { &[] } else { &g.nsids };
            let mut d = [0u8; GROUP_DESCRIPTOR_SIZE];
            AnaGroupDescriptor { group: g.group, nsids: listed.len() as u32, change_count: g.change_count, state: g.state }.encode(&mut d);
            out.extend_from_slice(&d);
            for n in listed {
                out.extend_from_slice(&n.to_le_bytes());
            }
        }
        out
    }

    /// Reads a page (whatever follows its last group is ignored: a host
    /// reads a buffer sized for the most groups and namespaces).
    pub fn decode(b: &[u8]) -> Result<AnaLog, WireError> {
        let h = AnaLogHeader::decode(b)?;
        let mut at = LOG_HEADER_SIZE;
        let mut groups = Vec::with_capacity(h.groups as usize);
        for _ in 0..h.groups {
            let d = AnaGroupDescriptor::decode(b.get(at..).unwrap_or(&[]))?;
            at += GROUP_DESCRIPTOR_SIZE;
            let len = d.nsids as usize * 4;
            need("ANA group NSIDs", b.get(at..).unwrap_or(&[]), len)?;
            let nsids = b[at..at + len].chunks_exact(4).map(|c| get_u32(c, 0)).collect();
            at += len;
            groups.push(AnaGroup { group: d.group, change_count: d.change_count, state: d.state, nsids });
        }
        Ok(AnaLog { change_count: h.change_count, groups })
    }

    /// The group that lists `nsid`, if any.
    pub fn group_of(&self, nsid: u32) -> Option<&AnaGroup> {
        self.groups.iter().find(|g| g.nsids.contains(&nsid))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn log() -> AnaLog {
        AnaLog {
            change_count: 7,
            groups: vec![
                AnaGroup { group: 1, change_count: 0, state: AnaState::Optimized, nsids: vec![1] },
                AnaGroup { group: 5, change_count: 3, state: AnaState::Inaccessible, nsids: vec![5, 9] },
            ],
        }
    }

    #[test]
    fn the_page_lays_out_at_its_spec_offsets() {
        let b = log().encode(false);
        assert_eq!(b.len(), 16 + 32 + 4 + 32 + 8);
        assert_eq!(&b[0..8], &7u64.to_le_bytes(), "change count");
        assert_eq!(&b[8..10], &[2, 0], "two descriptors");
        assert!(b[10..16].iter().all(|&x| x == 0));
        // Group 1: id, one NSID, change count 0, optimized, then NSID 1.
        assert_eq!(&b[16..20], &1u32.to_le_bytes());
        assert_eq!(&b[20..24], &1u32.to_le_bytes());
        assert_eq!(b[32], 0x01);
        assert_eq!(&b[48..52], &1u32.to_le_bytes());
        // Group 5 right after: two NSIDs, change count 3, inaccessible.
        assert_eq!(&b[52..56], &5u32.to_le_bytes());
        assert_eq!(&b[56..60], &2u32.to_le_bytes());
        assert_eq!(&b[60..68], &3u64.to_le_bytes());
        assert_eq!(b[68], 0x03);
        assert_eq!(&b[84..92], &[5, 0, 0, 0, 9, 0, 0, 0]);
        assert_eq!(AnaLog::decode(&b).unwrap(), log());
        assert_eq!(log().group_of(9).map(|g| g.group), Some(5));
    }

    #[test]
    fn return_groups_only_leaves_the_nsids_out() {
        let b = log().encode(true);
        assert_eq!(b.len(), 16 + 2 * 32);
        assert_eq!(&b[20..24], &[0, 0, 0, 0], "NNSIDs 0");
        assert_eq!(&b[48..52], &5u32.to_le_bytes(), "the next descriptor follows at once");
        let d = AnaLog::decode(&b).unwrap();
        assert_eq!(d.groups.iter().map(|g| (g.group, g.state, g.nsids.len())).collect::<Vec<_>>(), [
            (1, AnaState::Optimized, 0),
            (5, AnaState::Inaccessible, 0)
        ]);
    }

    #[test]
    fn bad_pages_are_refused_and_trailing_bytes_ignored() {
        let mut b = log().encode(false);
        b.extend_from_slice(&[0xff; 64]);
        assert_eq!(AnaLog::decode(&b).unwrap(), log(), "a host's buffer is larger than the page");
        let good = log().encode(false);
        assert!(matches!(AnaLog::decode(&good[..good.len() - 1]), Err(WireError::Truncated { .. })));
        let mut zero_group = good.clone();
        zero_group[16..20].fill(0);
        assert!(matches!(AnaLog::decode(&zero_group), Err(WireError::InvalidField { field: "ANAGRPID", .. })));
        let mut bad_state = good.clone();
        bad_state[32] = 0x05;
        assert!(matches!(AnaLog::decode(&bad_state), Err(WireError::InvalidField { field: "ANA state", .. })));
        let mut reserved = good.clone();
        reserved[12] = 1;
        assert_eq!(AnaLog::decode(&reserved), Err(WireError::ReservedNotZero { what: "ANA log header", offset: 12 }));
        let mut high_bits = good;
        high_bits[32] |= 0x10;
        assert!(matches!(AnaLog::decode(&high_bits), Err(WireError::ReservedNotZero { offset: 16, .. })));
        for s in [AnaState::Optimized, AnaState::NonOptimized, AnaState::Inaccessible, AnaState::PersistentLoss, AnaState::Change] {
            assert_eq!(AnaState::from_u8(s as u8), Some(s));
        }
        assert_eq!(AnaState::from_u8(0), None);
    }
}
