//! `rdmablk attach`: a volume as a kernel block device through ublk
//! (`/dev/ublkbN`), and `rdmablk detach`.
//!
//! One ublk queue per session queue pair, each served by its own thread
//! that owns the queue's io_uring and an [`IoQueue`](crate::IoQueue) (see
//! `serve.rs`). This file holds what runs without a kernel: how a ublk
//! request becomes a volume request (`translate`) and the device
//! parameters the volume gives ([`DeviceParams`]); both are unit-tested on
//! a host without ublk.

mod record;
mod serve;

pub use record::{pid_alive, AttachRecord, RECORD_DIR};
pub use serve::{attach, detach, AttachOptions};
pub(crate) use serve::check_machine;

use crate::error::{Error, Result};

// ublk's operation codes and flags (include/uapi/linux/ublk_cmd.h).
pub(crate) const OP_READ: u32 = 0;
pub(crate) const OP_WRITE: u32 = 1;
pub(crate) const OP_FLUSH: u32 = 2;
pub(crate) const OP_DISCARD: u32 = 3;
pub(crate) const OP_WRITE_ZEROES: u32 = 5;
pub(crate) const IO_F_FUA: u32 = 1 << 13;

/// A ublk request as the volume's command.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum VolumeOp {
    Read { offset: u64, len: u64 },
    Write { offset: u64, len: u64, fua: bool },
    Flush,
    Discard { offset: u64, len: u64 },
    WriteZeroes { offset: u64, len: u64 },
    /// Anything else (zoned operations, WRITE_SAME): answered EOPNOTSUPP.
    Unsupported(u32),
}

impl VolumeOp {
    /// Bytes the request moves through the tag's buffer (its result on success).
    pub(crate) fn data_len(self) -> u64 {
        match self {
            VolumeOp::Read { len, .. } | VolumeOp::Write { len, .. } => len,
            _ => 0,
        }
    }
}

/// Translates a ublk I/O descriptor (`op_flags`, `start_sector`,
/// `nr_sectors`, in 512-byte sectors as ublk always counts) into the
/// volume request. Alignment and range are checked by the `IoQueue`, which
/// fails a bad request with its error (EIO to the kernel); the block layer
/// never sends one, since the logical block size is the volume's.
pub(crate) fn translate(op_flags: u32, start_sector: u64, nr_sectors: u32) -> VolumeOp {
    let offset = start_sector << 9;
    let len = u64::from(nr_sectors) << 9;
    match op_flags & 0xff {
        OP_READ => VolumeOp::Read { offset, len },
        OP_WRITE => VolumeOp::Write { offset, len, fua: op_flags & IO_F_FUA != 0 },
        OP_FLUSH => VolumeOp::Flush,
        OP_DISCARD => VolumeOp::Discard { offset, len },
        OP_WRITE_ZEROES => VolumeOp::WriteZeroes { offset, len },
        other => VolumeOp::Unsupported(other),
    }
}

/// What the ublk device is told about the volume (UBLK_CMD_SET_PARAMS).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceParams {
    /// log2 of the volume's block size: the logical and physical block size.
    pub block_shift: u8,
    /// Capacity in 512-byte sectors.
    pub dev_sectors: u64,
    /// Largest request, in 512-byte sectors: the session's max I/O size,
    /// rounded down to the block size.
    pub max_sectors: u32,
    /// The max I/O size in bytes: each tag's registered buffer.
    pub io_buf_bytes: u32,
    pub read_only: bool,
    /// 0 when the volume has no DISCARD.
    pub max_discard_sectors: u32,
    /// 0 when the volume has no WRITE_ZEROES.
    pub max_write_zeroes_sectors: u32,
}

/// Largest discard or write-zeroes the device takes at once (the IoQueue
/// splits it into the target's pieces).
const MAX_ZEROES_SECTORS: u32 = (1 << 30) >> 9;

impl DeviceParams {
    /// The parameters of a volume of `size` bytes in blocks of
    /// `block_size`, over a session whose max I/O size is `max_io`.
    pub fn compute(
        block_size: u32,
        size: u64,
        max_io: u32,
        read_only: bool,
        discard: bool,
        write_zeroes: bool,
    ) -> Result<DeviceParams> {
        if !block_size.is_power_of_two() || !(512..=4096).contains(&block_size) {
            return Err(Error::invalid(format!(
                "the volume's block size is {block_size} bytes; ublk takes a power of two from 512 to 4096"
            )));
        }
        if size % u64::from(block_size) != 0 || size == 0 {
            return Err(Error::invalid(format!(
                "the volume's size, {size} bytes, is not a positive multiple of its block size {block_size}"
            )));
        }
        let io = max_io - max_io % block_size;
        if io == 0 {
            return Err(Error::invalid(format!(
                "the session's max I/O size, {max_io} bytes, is below the volume's block size {block_size}"
            )));
        }
        let zeroes = |on: bool| if on && !read_only { MAX_ZEROES_SECTORS } else { 0 };
        Ok(DeviceParams {
            block_shift: block_size.trailing_zeros() as u8,
            dev_sectors: size >> 9,
            max_sectors: io >> 9,
            io_buf_bytes: io,
            read_only,
            max_discard_sectors: zeroes(discard),
            max_write_zeroes_sectors: zeroes(write_zeroes),
        })
    }

    /// As libublk's `ublk_params`.
    pub(crate) fn to_sys(self) -> libublk::sys::ublk_params {
        use libublk::sys;
        let mut attrs = sys::UBLK_ATTR_VOLATILE_CACHE | sys::UBLK_ATTR_FUA;
        if self.read_only {
            attrs |= sys::UBLK_ATTR_READ_ONLY;
        }
        let mut p = sys::ublk_params {
            types: sys::UBLK_PARAM_TYPE_BASIC,
            basic: sys::ublk_param_basic {
                attrs,
                logical_bs_shift: self.block_shift,
                physical_bs_shift: self.block_shift,
                io_opt_shift: self.block_shift,
                io_min_shift: self.block_shift,
                max_sectors: self.max_sectors,
                dev_sectors: self.dev_sectors,
                ..Default::default()
            },
            ..Default::default()
        };
        if self.max_discard_sectors != 0 || self.max_write_zeroes_sectors != 0 {
            p.types |= sys::UBLK_PARAM_TYPE_DISCARD;
            p.discard = sys::ublk_param_discard {
                discard_granularity: 1 << self.block_shift,
                max_discard_sectors: self.max_discard_sectors,
                max_write_zeroes_sectors: self.max_write_zeroes_sectors,
                max_discard_segments: 1,
                ..Default::default()
            };
        }
        p
    }
}

/// The device number in a ublk block device path (`/dev/ublkb3` → 3).
pub(crate) fn parse_dev_path(path: &str) -> Result<u32> {
    let name = path.rsplit('/').next().unwrap_or(path);
    name.strip_prefix("ublkb").and_then(|n| n.parse().ok()).ok_or_else(|| {
        Error::invalid(format!("{path:?} is not a ublk block device: give its path, e.g. /dev/ublkb0"))
    })
}

/// The mount points in `mountinfo` (the format of /proc/self/mountinfo)
/// of the device `major:minor`.
pub(crate) fn mount_points(mountinfo: &str, major: u32, minor: u32) -> Vec<String> {
    let dev = format!("{major}:{minor}");
    mountinfo
        .lines()
        .filter_map(|l| {
            let mut f = l.split(' ');
            let (_, _, d, _, mp) = (f.next()?, f.next()?, f.next()?, f.next()?, f.next()?);
            (d == dev).then(|| mp.to_string())
        })
        .collect()
}

/// A request's result for the kernel: bytes done, or a negative errno.
pub(crate) fn result_code(op: VolumeOp, result: &Result<()>) -> i32 {
    match (op, result) {
        (VolumeOp::Unsupported(_), _) => -libc::EOPNOTSUPP,
        (op, Ok(())) => op.data_len() as i32,
        (_, Err(_)) => -libc::EIO,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ops_translate_to_volume_requests() {
        assert_eq!(translate(OP_READ, 8, 16), VolumeOp::Read { offset: 4096, len: 8192 });
        assert_eq!(translate(OP_WRITE, 0, 8), VolumeOp::Write { offset: 0, len: 4096, fua: false });
        assert_eq!(translate(OP_WRITE | IO_F_FUA, 24, 8), VolumeOp::Write { offset: 12288, len: 4096, fua: true });
        assert_eq!(translate(OP_FLUSH, 0, 0), VolumeOp::Flush);
        assert_eq!(translate(OP_DISCARD, 2048, 2048), VolumeOp::Discard { offset: 1 << 20, len: 1 << 20 });
        assert_eq!(translate(OP_WRITE_ZEROES, 1, 1), VolumeOp::WriteZeroes { offset: 512, len: 512 });
        assert_eq!(translate(4, 0, 8), VolumeOp::Unsupported(4));
        assert_eq!(translate(13, 0, 8), VolumeOp::Unsupported(13));
        // Flags above the op byte other than FUA do not change the op.
        assert_eq!(translate(OP_READ | (1 << 10), 0, 1), VolumeOp::Read { offset: 0, len: 512 });
    }

    #[test]
    fn results_are_bytes_or_errno() {
        let w = VolumeOp::Write { offset: 0, len: 8192, fua: false };
        assert_eq!(result_code(w, &Ok(())), 8192);
        assert_eq!(result_code(VolumeOp::Flush, &Ok(())), 0);
        assert_eq!(result_code(VolumeOp::Discard { offset: 0, len: 4096 }, &Ok(())), 0);
        assert_eq!(result_code(w, &Err(Error::invalid("x"))), -libc::EIO);
        assert_eq!(result_code(VolumeOp::Unsupported(4), &Ok(())), -libc::EOPNOTSUPP);
    }

    #[test]
    fn params_come_from_the_volume_and_session() {
        let p = DeviceParams::compute(4096, 1 << 30, 1 << 20, false, true, true).unwrap();
        assert_eq!(p.block_shift, 12);
        assert_eq!(p.dev_sectors, 2 << 20);
        assert_eq!(p.max_sectors, 2048);
        assert_eq!(p.io_buf_bytes, 1 << 20);
        assert!(p.max_discard_sectors > 0 && p.max_write_zeroes_sectors > 0);
        let s = p.to_sys();
        assert_eq!(s.types, libublk::sys::UBLK_PARAM_TYPE_BASIC | libublk::sys::UBLK_PARAM_TYPE_DISCARD);
        assert_eq!(s.basic.logical_bs_shift, 12);
        assert_eq!(s.basic.attrs & libublk::sys::UBLK_ATTR_FUA, libublk::sys::UBLK_ATTR_FUA);
        assert_eq!(s.basic.attrs & libublk::sys::UBLK_ATTR_READ_ONLY, 0);
        assert_eq!(s.discard.discard_granularity, 4096);

        // No DISCARD/WRITE_ZEROES: no discard parameters; read-only says so.
        let p = DeviceParams::compute(512, 1 << 20, 1_000_000, true, true, true).unwrap();
        assert_eq!((p.block_shift, p.max_discard_sectors, p.max_write_zeroes_sectors), (9, 0, 0));
        assert_eq!(p.io_buf_bytes, 1_000_000 - 1_000_000 % 512);
        let s = p.to_sys();
        assert_eq!(s.types, libublk::sys::UBLK_PARAM_TYPE_BASIC);
        assert_ne!(s.basic.attrs & libublk::sys::UBLK_ATTR_READ_ONLY, 0);
        let p = DeviceParams::compute(4096, 1 << 20, 1 << 20, false, false, true).unwrap();
        assert_eq!((p.max_discard_sectors, p.max_write_zeroes_sectors), (0, MAX_ZEROES_SECTORS));

        for (bs, size, io) in [(8192, 1 << 20, 1 << 20), (1000, 1 << 20, 1 << 20), (4096, 4095, 1 << 20), (4096, 1 << 20, 2048)] {
            assert!(DeviceParams::compute(bs, size, io, false, false, false).is_err(), "{bs} {size} {io}");
        }
    }

    #[test]
    fn attach_and_detach_parse() {
        use crate::cli::{Cli, Command};
        use clap::Parser;
        let cli = Cli::try_parse_from(["rdmablk", "--target", "rdma://h:1", "attach", "vol0", "--queues", "2", "--depth", "32"])
            .unwrap();
        assert_eq!(cli.command, Command::Attach { volume: Some("vol0".into()), queues: 2, depth: 32, config: None, check: false });
        let cli = Cli::try_parse_from(["rdmablk", "--target", "tcp://h:1", "attach", "vol0"]).unwrap();
        assert_eq!(cli.command, Command::Attach { volume: Some("vol0".into()), queues: 1, depth: 64, config: None, check: false });
        assert!(Cli::try_parse_from(["rdmablk", "attach", "vol0", "--queues", "0"]).is_err());
        assert!(Cli::try_parse_from(["rdmablk", "attach", "vol0", "--depth", "0"]).is_err());
        let cli = Cli::try_parse_from(["rdmablk", "detach", "/dev/ublkb0"]).unwrap();
        assert_eq!(cli.command, Command::Detach { device: "/dev/ublkb0".into() });
    }

    #[test]
    fn without_the_ublk_driver_attach_and_detach_say_so() {
        if std::path::Path::new("/dev/ublk-control").exists() {
            return; // a kernel with ublk: the VM step covers it
        }
        let e = check_machine().unwrap_err().one_line();
        assert!(e.contains("the kernel has no ublk driver (modprobe ublk_drv)"), "{e}");
        let e = detach("/dev/ublkb0", &mut Vec::new()).unwrap_err().one_line();
        assert!(e.contains("modprobe ublk_drv"), "{e}");
        let e = detach("/dev/sda", &mut Vec::new()).unwrap_err().one_line();
        assert!(e.contains("not a ublk block device"), "{e}");
    }

    #[test]
    fn device_paths_and_mounts() {
        assert_eq!(parse_dev_path("/dev/ublkb0").unwrap(), 0);
        assert_eq!(parse_dev_path("ublkb12").unwrap(), 12);
        assert!(parse_dev_path("/dev/ublkc0").is_err());
        assert!(parse_dev_path("/dev/sda").is_err());
        let mi = "22 1 259:0 / / rw,relatime shared:1 - ext4 /dev/vda rw\n\
                  40 22 259:1 / /mnt/a rw - ext4 /dev/ublkb0 rw\n\
                  41 22 259:1 / /mnt/b rw - ext4 /dev/ublkb0 rw\n";
        assert_eq!(mount_points(mi, 259, 1), vec!["/mnt/a".to_string(), "/mnt/b".to_string()]);
        assert!(mount_points(mi, 259, 2).is_empty());
    }
}
