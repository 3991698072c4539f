//! I/O commands: Read, Write (with FUA), Flush, Write Zeroes and Dataset
//! Management (deallocate), checked and turned into engine work with the
//! same bounds and read-only rules as rdmablk v1's commands.

use rdmablk_common::nvme::sqe::{io_opcode, DsmRange, SubmissionEntry, DSM_RANGE_SIZE};

use super::{Namespace, MAX_TRANSFER};
pub use crate::backend::ByteRanges;
use crate::backend::{Access, RangeOp};
use crate::error::{Error, ErrorKind, Result};

/// What an I/O command does, once checked.
#[derive(Clone, Debug)]
pub enum IoPlan {
    Read { ns: Namespace, offset: u64, len: u32 },
    Write { ns: Namespace, offset: u64, len: u32, fua: bool },
    Flush { ns: Namespace },
    /// Write Zeroes: byte ranges, done the backend's way.
    Range { ns: Namespace, op: RangeOp, ranges: ByteRanges },
    /// Dataset Management with Deallocate: its `ranges` ranges arrive as
    /// data (possibly followed by more bytes; see [`plan`]).
    Deallocate { ns: Namespace, op: RangeOp, ranges: u32 },
}

impl IoPlan {
    pub fn namespace(&self) -> &Namespace {
        match self {
            IoPlan::Read { ns, .. }
            | IoPlan::Write { ns, .. }
            | IoPlan::Flush { ns }
            | IoPlan::Range { ns, .. }
            | IoPlan::Deallocate { ns, .. } => ns,
        }
    }

    pub fn nsid(&self) -> u32 {
        self.namespace().nsid
    }

    pub fn name(&self) -> &'static str {
        match self {
            IoPlan::Read { .. } => "read",
            IoPlan::Write { .. } => "write",
            IoPlan::Flush { .. } => "flush",
            IoPlan::Range { .. } => "write zeroes",
            IoPlan::Deallocate { .. } => "deallocate",
        }
    }
}

fn find(nss: &[Namespace], nsid: u32) -> Result<&Namespace> {
    nss.iter()
        .find(|n| n.nsid == nsid)
        .ok_or_else(|| Error::new(ErrorKind::UnknownVolume, format!("namespace {nsid} is not attached to this host")))
}

/// The byte range of `blocks` blocks at `slba`, if it lies in `ns`.
fn byte_range(ns: &Namespace, slba: u64, blocks: u64) -> Result<(u64, u64)> {
    let end = slba.checked_add(blocks);
    if end.is_none_or(|e| e > ns.volume.blocks()) {
        return Err(Error::new(
            ErrorKind::OutOfRange,
            format!("blocks {slba}+{blocks} run past namespace {} ({} blocks)", ns.nsid, ns.volume.blocks()),
        ));
    }
    let shift = ns.lba_shift();
    Ok((slba << shift, blocks << shift))
}

/// Whether this gateway serves the namespace's volume now: not once it
/// was fenced off (another gateway took it over), whatever the command
/// (ANA Inaccessible: the host retries on another path). A standby serves:
/// its backend takes the volume over at the command.
fn reachable(ns: &Namespace) -> Result<()> {
    check_access(ns.nsid, ns.volume.access())
}

fn check_access(nsid: u32, access: Access) -> Result<()> {
    match access {
        Access::Owner | Access::Standby => Ok(()),
        Access::Fenced => Err(Error::new(
            ErrorKind::NotOwner,
            format!("namespace {nsid}: another gateway took its volume over and fenced this one off"),
        )),
    }
}

fn writable(ns: &Namespace) -> Result<()> {
    if ns.read_only {
        return Err(Error::new(ErrorKind::ReadOnly, format!("namespace {} is read-only for this host", ns.nsid)));
    }
    Ok(())
}

/// Checks an I/O command against the host's namespaces; `sgl_len` is the
/// data length its descriptor names. A Read or Write may move up to
/// [`MAX_TRANSFER`]; a queue checks against its target's MDTS with
/// [`plan_within`].
pub fn plan(sqe: &SubmissionEntry, nss: &[Namespace], sgl_len: u32) -> Result<IoPlan> {
    plan_within(sqe, nss, sgl_len, MAX_TRANSFER)
}

/// [`plan`] with a Read or Write moving at most `max_transfer` bytes (MDTS).
pub fn plan_within(sqe: &SubmissionEntry, nss: &[Namespace], sgl_len: u32, max_transfer: u32) -> Result<IoPlan> {
    let op = sqe.opcode;
    if !matches!(op, io_opcode::READ | io_opcode::WRITE | io_opcode::FLUSH | io_opcode::WRITE_ZEROES | io_opcode::DATASET_MANAGEMENT) {
        return Err(Error::new(ErrorKind::InvalidOpcode, format!("I/O opcode {op:#04x}")));
    }
    let ns = find(nss, sqe.nsid)?.clone();
    reachable(&ns)?;
    let no_data = |what: &str| -> Result<()> {
        if sgl_len != 0 {
            return Err(Error::new(ErrorKind::LengthMismatch, format!("{what} carries no data; the SGL names {sgl_len} bytes")));
        }
        Ok(())
    };
    match op {
        io_opcode::READ | io_opcode::WRITE => {
            let (offset, len) = byte_range(&ns, sqe.slba(), sqe.block_count() as u64)?;
            if len > max_transfer as u64 {
                return Err(Error::new(ErrorKind::TooLarge, format!("{len} bytes exceed MDTS ({max_transfer})")));
            }
            if sgl_len as u64 != len {
                return Err(Error::new(ErrorKind::LengthMismatch, format!("the SGL names {sgl_len} bytes for {len}")));
            }
            let len = len as u32;
            if op == io_opcode::READ {
                Ok(IoPlan::Read { ns, offset, len })
            } else {
                writable(&ns)?;
                Ok(IoPlan::Write { ns, offset, len, fua: sqe.fua() })
            }
        }
        io_opcode::FLUSH => {
            no_data("Flush")?;
            Ok(IoPlan::Flush { ns })
        }
        io_opcode::WRITE_ZEROES => {
            no_data("Write Zeroes")?;
            writable(&ns)?;
            let range = byte_range(&ns, sqe.slba(), sqe.block_count() as u64)?;
            let op = ns
                .volume
                .backend
                .write_zeroes()
                .ok_or_else(|| Error::new(ErrorKind::NotSupported, format!("namespace {} cannot write zeroes", ns.nsid)))?;
            Ok(IoPlan::Range { ns, op, ranges: ByteRanges::One(range) })
        }
        _ => {
            let (nr, deallocate) = sqe.dsm_ranges();
            // At least NR ranges' worth and at most 256: the Linux host
            // always sends a whole 4 KiB page of ranges (zeroes past NR),
            // and Linux nvmet accepts any length from NR ranges up.
            let least = nr * DSM_RANGE_SIZE as u32;
            if sgl_len < least || sgl_len > MAX_DSM_BYTES {
                return Err(Error::new(
                    ErrorKind::LengthMismatch,
                    format!("{nr} DSM ranges need {least}..={MAX_DSM_BYTES} bytes; the SGL names {sgl_len}"),
                ));
            }
            if !deallocate {
                // Only hints (access frequency, latency): nothing to do, but
                // the ranges still come and are read, as plans need.
                return Ok(IoPlan::Deallocate { ns, op: RangeOp::Nothing, ranges: nr });
            }
            writable(&ns)?;
            let op = ns
                .volume
                .backend
                .discard()
                .ok_or_else(|| Error::new(ErrorKind::NotSupported, format!("namespace {} cannot deallocate", ns.nsid)))?;
            Ok(IoPlan::Deallocate { ns, op, ranges: nr })
        }
    }
}

/// The most DSM data a command may carry: 256 ranges.
pub const MAX_DSM_BYTES: u32 = 256 * DSM_RANGE_SIZE as u32;

/// The byte ranges of the first `count` ranges of a DSM command's data,
/// each checked against the namespace; empty ranges are skipped.
pub fn dsm_ranges(data: &[u8], count: u32, ns: &Namespace) -> Result<Vec<(u64, u64)>> {
    let mut out = Vec::new();
    for chunk in data.chunks_exact(DSM_RANGE_SIZE).take(count as usize) {
        let r = DsmRange::decode(chunk).map_err(|e| Error::new(ErrorKind::InvalidField, e.to_string()))?;
        if r.blocks == 0 {
            continue;
        }
        out.push(byte_range(ns, r.slba, r.blocks as u64)?);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use rdmablk_common::nvme::sqe::Sgl;
    use rdmablk_common::protocol::VolumeId;

    use super::*;
    use crate::backend::Volume;
    use crate::config::{BackendKind, VolumeConfig};

    fn ns(read_only: bool) -> Namespace {
        let vc = VolumeConfig {
            index: 0,
            name: "m".into(),
            backend: BackendKind::Memory,
            path: Default::default(),
            size: Some(1 << 20),
            block_size: Some(512),
            read_only: false,
            nsid: None,
            rbd: None,
        };
        let volume = Arc::new(Volume::open("test", &vc, VolumeId(1), 1, false).unwrap());
        Namespace { nsid: 1, volume, read_only, index: 0, generation: 1 }
    }

    fn rw(op: u8, slba: u64, blocks: u32) -> SubmissionEntry {
        let mut e = SubmissionEntry::new(op, 7);
        e.nsid = 1;
        e.set_rw(slba, blocks, false);
        e.set_sgl(Sgl::Transport { length: blocks * 512 });
        e
    }

    fn kind(r: Result<IoPlan>) -> ErrorKind {
        r.unwrap_err().kind()
    }

    #[test]
    fn reads_and_writes_inside_the_namespace_are_planned_with_byte_offsets() {
        let nss = [ns(false)];
        let p = plan(&rw(io_opcode::READ, 2, 8), &nss, 4096).unwrap();
        assert!(matches!(p, IoPlan::Read { offset: 1024, len: 4096, .. }), "{p:?}");
        // The last block of the namespace (2048 blocks of 512 bytes).
        let p = plan(&rw(io_opcode::WRITE, 2047, 1), &nss, 512).unwrap();
        assert!(matches!(p, IoPlan::Write { offset, len: 512, fua: false, .. } if offset == (1 << 20) - 512), "{p:?}");
    }

    #[test]
    fn write_zeroes_holds_its_one_range_inline() {
        let nss = [ns(false)];
        let mut wz = rw(io_opcode::WRITE_ZEROES, 2, 8);
        wz.set_sgl(Sgl::NONE);
        let p = plan(&wz, &nss, 0).unwrap();
        assert!(matches!(&p, IoPlan::Range { ranges: ByteRanges::One((1024, 4096)), .. }), "{p:?}");
        let IoPlan::Range { ranges, .. } = p else { unreachable!() };
        assert_eq!(&ranges[..], &[(1024, 4096)]);
        assert!(ByteRanges::None.is_empty());
    }

    #[test]
    fn every_refusal_has_its_own_reason() {
        let nss = [ns(false)];
        assert_eq!(kind(plan(&rw(io_opcode::READ, 2047, 2), &nss, 1024)), ErrorKind::OutOfRange);
        assert_eq!(kind(plan(&rw(io_opcode::READ, u64::MAX, 1), &nss, 512)), ErrorKind::OutOfRange);
        assert_eq!(kind(plan(&rw(io_opcode::READ, 0, 8), &nss, 512)), ErrorKind::LengthMismatch);
        assert_eq!(kind(plan_within(&rw(io_opcode::READ, 0, 257), &nss, 257 * 512, 128 << 10)), ErrorKind::TooLarge);
        assert!(plan_within(&rw(io_opcode::READ, 0, 256), &nss, 256 * 512, 128 << 10).is_ok(), "a Read of exactly MDTS");
        let mut other = rw(io_opcode::READ, 0, 1);
        other.nsid = 2;
        assert_eq!(kind(plan(&other, &nss, 512)), ErrorKind::UnknownVolume);
        assert_eq!(kind(plan(&rw(0x7e, 0, 1), &nss, 512)), ErrorKind::InvalidOpcode);
        let mut flush = SubmissionEntry::new(io_opcode::FLUSH, 1);
        flush.nsid = 1;
        assert!(plan(&flush, &nss, 0).is_ok());
        assert_eq!(kind(plan(&flush, &nss, 512)), ErrorKind::LengthMismatch);
    }

    #[test]
    fn a_fenced_volume_answers_ana_inaccessible_and_a_standby_serves() {
        use rdmablk_common::nvme::status::{sct, Status};
        assert!(check_access(1, Access::Owner).is_ok());
        assert!(check_access(1, Access::Standby).is_ok(), "the backend takes the volume over at the command");
        let e = check_access(3, Access::Fenced).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::NotOwner);
        assert!(e.context().contains("namespace 3"), "{e}");
        let st = e.nvme_status(true);
        assert_eq!(st, Status::ANA_INACCESSIBLE);
        assert_eq!((st.sct, st.sc, st.dnr), (sct::PATH, 0x02, false), "path related, retried on another path");
        // A volume only this target serves is its owner: every command is planned.
        let nss = [ns(false)];
        assert_eq!(nss[0].volume.access(), Access::Owner);
        assert!(plan(&rw(io_opcode::WRITE, 0, 1), &nss, 512).is_ok());
    }

    #[test]
    fn a_read_only_namespace_refuses_every_command_that_writes() {
        let nss = [ns(true)];
        assert!(plan(&rw(io_opcode::READ, 0, 1), &nss, 512).is_ok());
        assert_eq!(kind(plan(&rw(io_opcode::WRITE, 0, 1), &nss, 512)), ErrorKind::ReadOnly);
        let mut wz = rw(io_opcode::WRITE_ZEROES, 0, 1);
        wz.set_sgl(Sgl::NONE);
        assert_eq!(kind(plan(&wz, &nss, 0)), ErrorKind::ReadOnly);
        let mut dsm = SubmissionEntry::new(io_opcode::DATASET_MANAGEMENT, 3);
        dsm.nsid = 1;
        dsm.cdw[1] = 1 << 2;
        assert_eq!(kind(plan(&dsm, &nss, 16)), ErrorKind::ReadOnly);
        // Hints only (no deallocate): nothing is written.
        dsm.cdw[1] = 0;
        assert!(matches!(plan(&dsm, &nss, 16), Ok(IoPlan::Deallocate { op: RangeOp::Nothing, .. })));
    }

    #[test]
    fn dsm_ranges_are_checked_one_by_one_and_empty_ones_skipped() {
        let n = ns(false);
        let mut data = Vec::new();
        for (slba, blocks) in [(0u64, 8u32), (100, 0), (2040, 8)] {
            let mut r = [0u8; DSM_RANGE_SIZE];
            DsmRange { attributes: 0, blocks, slba }.encode(&mut r);
            data.extend_from_slice(&r);
        }
        assert_eq!(dsm_ranges(&data, 3, &n).unwrap(), vec![(0, 4096), (2040 * 512, 4096)]);
        let mut r = [0u8; DSM_RANGE_SIZE];
        DsmRange { attributes: 0, blocks: 9, slba: 2040 }.encode(&mut r);
        assert_eq!(dsm_ranges(&r, 1, &n).unwrap_err().kind(), ErrorKind::OutOfRange);
        let mut dsm = SubmissionEntry::new(io_opcode::DATASET_MANAGEMENT, 3);
        dsm.nsid = 1;
        dsm.cdw[0] = 1;
        dsm.cdw[1] = 1 << 2;
        assert_eq!(kind(plan(&dsm, std::slice::from_ref(&n), 16)), ErrorKind::LengthMismatch, "two ranges are 32 bytes");
        assert_eq!(kind(plan(&dsm, std::slice::from_ref(&n), 4112)), ErrorKind::LengthMismatch, "at most 256 ranges' worth");
    }

    #[test]
    fn the_linux_host_sends_a_whole_page_of_ranges_and_only_nr_count() {
        // Linux sends 256 ranges' worth (4 KiB) whatever NR says, so that a
        // device reading past NR finds zeroes; only NR ranges are ranges.
        let n = ns(false);
        let mut dsm = SubmissionEntry::new(io_opcode::DATASET_MANAGEMENT, 3);
        dsm.nsid = 1;
        dsm.cdw[1] = 1 << 2;
        let p = plan(&dsm, std::slice::from_ref(&n), 4096).unwrap();
        assert!(matches!(p, IoPlan::Deallocate { ranges: 1, .. }), "{p:?}");
        let mut page = vec![0u8; 4096];
        DsmRange { attributes: 0, blocks: 8, slba: 16 }.encode((&mut page[..16]).try_into().unwrap());
        // Beyond NR: a range past the end, which must not be looked at.
        DsmRange { attributes: 0, blocks: 8, slba: u64::MAX - 4 }.encode((&mut page[16..32]).try_into().unwrap());
        assert_eq!(dsm_ranges(&page, 1, &n).unwrap(), vec![(16 * 512, 4096)]);
    }
}
