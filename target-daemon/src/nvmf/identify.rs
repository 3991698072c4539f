//! The Identify data structures (NVMe Base 2.0, 5.17.2; NVMe over Fabrics
//! 1.1 for the fabrics fields), 4,096 bytes each, little endian.

use rdmablk_common::nvme::ana::AnaState;

use super::{ana, namespace_ids, Namespace, Subsystem, ADMIN_IN_CAPSULE, IO_IN_CAPSULE, MAX_AERS};
use crate::config::{NvmeTransport, MAX_NSID, MAX_VOLUMES};

pub const IDENTIFY_SIZE: usize = 4096;

/// CNS values this target answers.
pub mod cns {
    pub const NAMESPACE: u8 = 0x00;
    pub const CONTROLLER: u8 = 0x01;
    pub const ACTIVE_NAMESPACES: u8 = 0x02;
    pub const NAMESPACE_DESCRIPTORS: u8 = 0x03;
}

/// The version this controller implements (VS and Identify VER): 1.3.0.
/// At 1.3 the Linux host identifies namespaces with CNS 0 and 3 and asks
/// for nothing that needs the 2.0 command-set-specific structures.
pub const VERSION: u32 = 0x0001_0300;

/// OAES and AEN configuration bit: namespace attribute notices.
pub const AEN_NS_ATTR: u32 = 1 << 8;
/// OAES and AEN configuration bit: ANA change notices.
pub const AEN_ANA_CHANGE: u32 = 1 << 11;
/// The notices this controller sends (OAES), all a host may enable.
pub const AEN_SUPPORTED: u32 = AEN_NS_ATTR | AEN_ANA_CHANGE;
/// CMIC: the subsystem may have more than one port (bit 0) and more than
/// one controller (bit 1: several gateways, several paths of a host), and
/// reports ANA (bit 3). Without bit 1 a Linux host refuses a second
/// controller of the subsystem, and builds no multipath device.
pub const CMIC: u8 = 1 << 0 | 1 << 1 | 1 << 3;
/// ANACAP: the states reported (optimized, non-optimized, inaccessible)
/// and an ANA group id that does not change while the namespace is
/// attached (bit 6).
pub const ANACAP: u8 = 1 << 0 | 1 << 1 | 1 << 2 | 1 << 6;
/// ANAGRPMAX: group ids are NSIDs ([`ana::group`]).
pub const ANAGRPMAX: u32 = MAX_NSID;
/// NANAGRPID and MNAN: one group per namespace, and at most as many
/// namespaces as volumes served. A Linux host sizes its ANA log buffer as
/// 16 + 32 × NANAGRPID + 4 × MNAN bytes (9,232 here), which must fit MDTS,
/// and refuses a controller that reports ANA with MNAN 0 or above NN.
pub const NANAGRPID: u32 = MAX_VOLUMES as u32;
pub const MNAN: u32 = MAX_VOLUMES as u32;
/// The ANA log page's size as hosts compute it from those (header,
/// NANAGRPID descriptors, MNAN NSIDs): the page is zero-padded to it, so
/// that a host reading it in pieces (libnvme: 4 KiB at a time, LPO
/// 0, 4096, 8192) finds every offset below it valid.
pub const ANA_LOG_SIZE: usize = 16 + 32 * NANAGRPID as usize + 4 * MNAN as usize;
/// ONCS bits.
const ONCS_DSM: u16 = 1 << 2;
const ONCS_WRITE_ZEROES: u16 = 1 << 3;
/// LPA: commands supported and effects log, extended data (NUMDU, LPO).
const LPA_EFFECTS: u8 = 1 << 1;
const LPA_EXTENDED: u8 = 1 << 2;
/// Error log entries (ELPE, 0-based).
pub const ERROR_LOG_ENTRIES: usize = 1;

fn put_str(out: &mut [u8], s: &str) {
    // ASCII, space padded (Identify strings are not NUL terminated).
    out.fill(b' ');
    let n = s.len().min(out.len());
    out[..n].copy_from_slice(&s.as_bytes()[..n]);
}

fn put_u16(out: &mut [u8], at: usize, v: u16) {
    out[at..at + 2].copy_from_slice(&v.to_le_bytes());
}

fn put_u32(out: &mut [u8], at: usize, v: u32) {
    out[at..at + 4].copy_from_slice(&v.to_le_bytes());
}

fn put_u64(out: &mut [u8], at: usize, v: u64) {
    out[at..at + 8].copy_from_slice(&v.to_le_bytes());
}

/// Identify Controller for controller `cntlid` (`discovery`: the
/// discovery controller, which has no I/O queues or namespaces).
pub fn controller(sub: &Subsystem, transport: NvmeTransport, cntlid: u16, discovery: bool) -> Vec<u8> {
    let mut d = vec![0u8; IDENTIFY_SIZE];
    put_str(&mut d[4..24], &sub.serial);
    put_str(&mut d[24..64], "rdmablk-target");
    put_str(&mut d[64..72], env!("CARGO_PKG_VERSION"));
    d[76] = if discovery { 0 } else { CMIC };
    // MDTS: `max_io_size`, the same on every transport (`max_transfer`).
    d[77] = super::mdts(sub.max_transfer);
    put_u16(&mut d, 78, cntlid);
    put_u32(&mut d, 80, VERSION);
    put_u32(&mut d, 92, if discovery { 0 } else { AEN_SUPPORTED });
    // CNTRLTYPE: 1 I/O controller, 2 discovery controller.
    d[111] = if discovery { 2 } else { 1 };
    // ACL and AERL are 0-based.
    d[258] = 3;
    d[259] = MAX_AERS as u8 - 1;
    d[261] = LPA_EXTENDED | if discovery { 0 } else { LPA_EFFECTS };
    d[262] = ERROR_LOG_ENTRIES as u8 - 1;
    // KAS: keep-alive granularity, 100 ms.
    put_u16(&mut d, 320, 1);
    if !discovery {
        d[342] = ana::TRANSITION_TIME_SECS;
        d[343] = ANACAP;
        put_u32(&mut d, 344, ANAGRPMAX);
        put_u32(&mut d, 348, NANAGRPID);
    }
    // MAXCMD: a fabrics host refuses a controller (the discovery one too)
    // that reports 0.
    put_u16(&mut d, 514, sub.cfg.nvme_queue_size as u16);
    if !discovery {
        // SQES and CQES: required and maximum entry sizes, log2.
        d[512] = 0x66;
        d[513] = 0x44;
        put_u32(&mut d, 516, MAX_NSID);
        put_u32(&mut d, 540, MNAN);
        put_u16(&mut d, 520, ONCS_DSM | ONCS_WRITE_ZEROES);
        // VWC: a volatile write cache (Flush does fdatasync); bits 2:1 = 10,
        // Flush with the broadcast nsid is not supported.
        d[525] = 0b101;
    }
    // SGLS: SGLs supported (no alignment requirement), offsets in in-capsule
    // data descriptors (bit 20); on NVMe/RDMA keyed data blocks (bit 2),
    // without which the Linux host refuses the controller.
    let keyed = if transport == NvmeTransport::Rdma { 1 << 2 } else { 0 };
    put_u32(&mut d, 536, 1 | keyed | 1 << 20);
    let nqn = sub_nqn(sub, discovery);
    d[768..768 + nqn.len()].copy_from_slice(nqn.as_bytes());
    // Fabrics: IOCCSZ and IORCSZ in 16-byte units, ICDOFF 0, FCATT 0
    // (dynamic controller model), MSDBD 1.
    let in_capsule = if discovery { ADMIN_IN_CAPSULE } else { IO_IN_CAPSULE };
    put_u32(&mut d, 1792, (64 + in_capsule) / 16);
    put_u32(&mut d, 1796, 1);
    d[1803] = 1;
    // OFCS bit 0: a Disconnect deletes the I/O queue it is sent on (a
    // discovery controller has none).
    if !discovery {
        put_u16(&mut d, 1804, 1);
    }
    // Power state 0: 25 W maximum, as a placeholder the host only displays.
    put_u16(&mut d, 2048, 2500);
    d
}

fn sub_nqn(sub: &Subsystem, discovery: bool) -> &str {
    if discovery {
        rdmablk_common::nvme::fabrics::DISCOVERY_NQN
    } else {
        &sub.nqn
    }
}

/// Identify Namespace; all zeroes for an inactive namespace id.
pub fn namespace(target_nqn: &str, ns: Option<&Namespace>) -> Vec<u8> {
    let mut d = vec![0u8; IDENTIFY_SIZE];
    let Some(ns) = ns else { return d };
    let blocks = ns.volume.blocks();
    let ana = ana::View::of(ns);
    put_u64(&mut d, 0, blocks);
    put_u64(&mut d, 8, blocks);
    // NUSE: 0 while the namespace is inaccessible through this controller
    // (as nvmet); its size stays, the same on every path.
    put_u64(&mut d, 16, if ana.state == AnaState::Inaccessible { 0 } else { blocks });
    // NSFEAT bit 0: thin provisioning (a deallocated block takes no space
    // in a sparse file).
    d[24] = ns.volume.supports_discard() as u8;
    // NLBAF 0 (one format), FLBAS 0.
    // NMIC: shared, may be attached to more than one controller (all of a
    // host's paths); a Linux host puts only shared namespaces of several
    // controllers under one multipath device.
    d[30] = 1;
    // DLFEAT: deallocated blocks read as zeroes (a punched hole does).
    d[33] = if ns.volume.supports_discard() { 0b001 } else { 0 };
    put_u32(&mut d, 92, ana.group);
    // NSATTR: write protected.
    d[99] = ns.read_only as u8;
    let (nguid, _) = namespace_ids(target_nqn, &ns.volume.name);
    d[104..120].copy_from_slice(&nguid);
    // LBA format 0: no metadata, LBADS = log2(block size), best performance.
    d[130] = ns.lba_shift() as u8;
    d
}

/// The active namespace list: ids greater than `after`, ascending.
pub fn active_namespaces(nss: &[Namespace], after: u32) -> Vec<u8> {
    let mut d = vec![0u8; IDENTIFY_SIZE];
    for (i, ns) in nss.iter().filter(|n| n.nsid > after).take(IDENTIFY_SIZE / 4).enumerate() {
        put_u32(&mut d, 4 * i, ns.nsid);
    }
    d
}

/// Namespace identification descriptors: NGUID, UUID, command set (NVM).
pub fn namespace_descriptors(target_nqn: &str, ns: &Namespace) -> Vec<u8> {
    let mut d = vec![0u8; IDENTIFY_SIZE];
    let (nguid, uuid) = namespace_ids(target_nqn, &ns.volume.name);
    let mut at = 0;
    for (nidt, id) in [(2u8, &nguid[..]), (3u8, &uuid[..]), (4u8, &[0u8][..])] {
        d[at] = nidt;
        d[at + 1] = id.len() as u8;
        d[at + 4..at + 4 + id.len()].copy_from_slice(id);
        at += 4 + id.len();
    }
    d
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn namespace_ids_are_stable_and_distinct() {
        let (g1, u1) = namespace_ids("nqn.2014-08.io.rdmablk:t", "a");
        assert_eq!((g1, u1), namespace_ids("nqn.2014-08.io.rdmablk:t", "a"));
        let (g2, u2) = namespace_ids("nqn.2014-08.io.rdmablk:t", "b");
        let (g3, _) = namespace_ids("nqn.2014-08.io.rdmablk:u", "a");
        assert!(g1 != g2 && g1 != g3 && u1 != u2 && g1 != u1);
        // An RFC 4122 name-based UUID: version 5, variant 10.
        assert_eq!(u1[6] >> 4, 5);
        assert_eq!(u1[8] >> 6, 0b10);
    }

    #[test]
    fn the_active_list_starts_after_the_given_id() {
        let d = active_namespaces(&[], 0);
        assert!(d.iter().all(|&b| b == 0));
        assert_eq!(d.len(), IDENTIFY_SIZE);
    }
}
