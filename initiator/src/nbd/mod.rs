//! An NBD server for one remote volume: `rdmablk nbd` serves it to the
//! kernel's `nbd-client`, qemu, libnbd's tools (`nbdcopy`, `nbdinfo`,
//! `nbdsh`, `nbdfuse`) and anything else that speaks the NBD protocol
//! (fixed newstyle negotiation, simple replies).
//!
//! # What is served
//! One export: the volume, under its own name and under the empty default
//! name. Options `NBD_OPT_GO`, `NBD_OPT_INFO`, `NBD_OPT_LIST`,
//! `NBD_OPT_ABORT` and `NBD_OPT_EXPORT_NAME` (for old clients); the rest
//! (structured replies, TLS, metadata contexts, extended headers) are
//! answered `NBD_REP_ERR_UNSUP`, and clients go on with simple replies.
//! Transmission flags: `HAS_FLAGS`, `SEND_FLUSH`, `SEND_FUA`, `SEND_TRIM`
//! and `SEND_WRITE_ZEROES` when the volume supports DISCARD and
//! WRITE_ZEROES, `READ_ONLY` for a read-only volume, and `CAN_MULTI_CONN`:
//! neither this server nor the target caches data (the target writes with
//! `O_DIRECT` and answers a write once it is in the file or device, and
//! FLUSH is an `fdatasync` of the whole volume), so a FLUSH or FUA on one
//! connection covers every write any connection had been answered for.
//! `NBD_INFO_BLOCK_SIZE` is sent to every `NBD_OPT_INFO`/`NBD_OPT_GO`:
//! minimum the volume's block size, preferred the larger of that and
//! 4 KiB, maximum the session's max I/O size. READs and WRITEs up to 32 MiB
//! (the spec's default maximum, which clients that do not ask for block
//! sizes use: the kernel's `nbd-client` sends 1.25 MiB writes) are served
//! all the same, split by the I/O path.
//!
//! # Unaligned requests are refused
//! A request whose offset or length is not a multiple of the volume's block
//! size is answered `NBD_EINVAL`, as the spec allows once block sizes were
//! advertised; nothing is read or written. (Read-modify-write would have to
//! serialise overlapping requests from every connection; clients that
//! honour `NBD_INFO_BLOCK_SIZE` never need it. The kernel's `nbd-client`
//! does not ask for block sizes: give it `-b` with the volume's block size.)
//!
//! # Threads and data copies
//! Each connection has one thread. It decodes requests, reads a WRITE's
//! payload straight from the socket into a registered
//! [`IoBuffer`](crate::IoBuffer), keeps the requests in flight together on
//! the connection's own [`IoQueue`](crate::IoQueue) (bounded by the
//! session's queue depth and a per-connection buffer budget), and sends
//! the replies, a READ's data straight from the registered buffer the
//! target placed it in, in whatever order they complete (replies carry the
//! client's cookie). With requests in flight it sleeps in
//! [`IoQueue::wait_or_readable`](crate::IoQueue::wait_or_readable), so the
//! next request and the answers wake the same thread. So the
//! only copies are the kernel's socket copies: socket → registered buffer
//! for writes, registered buffer → socket for reads; the fabric moves the
//! data between that buffer and the target without a copy (RDMA READ and
//! WRITE on `rdma://`).
//!
//! # Errors
//! Every failed request gets one NBD errno, chosen in one place
//! (`errno`), and a log line naming the client, the command, the range
//! and the reason. A request that cannot be parsed (bad magic), a WRITE
//! longer than 32 MiB (its payload is too long to read and discard), or a
//! protocol violation during
//! negotiation ends that connection, logged; other connections go on.
//!
//! # Stopping
//! At SIGINT or SIGTERM the requests already started on the volume are
//! completed and answered; those the client had sent but the server had not
//! started get `NBD_ESHUTDOWN` (`conn.rs` says why); then the volume is
//! flushed. The log says at once how long a lost target can make that wait
//! (`ctrl_loss_timeout`); a second signal gives up ([`StopSignals`]).
//! A client has the handshake timeout for its whole negotiation.

mod conn;
mod export;
mod handshake;
mod server;
mod signals;
pub mod wire;

use rdmablk_common::protocol::Status;

use crate::error::{Error, ErrorKind};

pub use server::{Listen, Server, Stopper};
pub use signals::StopSignals;
use wire::{Command, RequestError, NBD_EINVAL, NBD_EIO, NBD_ENOSPC, NBD_EPERM, NBD_ESHUTDOWN};

/// Why a request failed.
#[derive(Debug)]
pub(crate) enum Failure {
    /// The server refused it before it reached the volume.
    Request(RequestError),
    /// The volume (the I/O path's checks, or the target) failed it.
    Io(Error),
}

/// The NBD error value of a failed request: the one place where failures
/// become NBD errno values. Following the spec: a write beyond the end is
/// `ENOSPC` (WRITE, WRITE_ZEROES), a read or trim beyond it `EINVAL`, a
/// misaligned or malformed request `EINVAL`, a write to a read-only volume
/// `EPERM`; an errno the target's disk reported stays `ENOSPC` when it is
/// one of ENOSPC, EDQUOT and EFBIG; a target that is shutting down is
/// `ESHUTDOWN`; anything else (I/O errors, timeouts, a lost target) is `EIO`.
pub(crate) fn errno(command: Command, failure: &Failure) -> u32 {
    let beyond_end = if matches!(command, Command::Write | Command::WriteZeroes) { NBD_ENOSPC } else { NBD_EINVAL };
    let e = match failure {
        Failure::Request(_) => return NBD_EINVAL,
        Failure::Io(e) => e,
    };
    match e.kind() {
        ErrorKind::ReadOnly => NBD_EPERM,
        ErrorKind::OutOfRange => beyond_end,
        ErrorKind::Misaligned | ErrorKind::InvalidArgument => NBD_EINVAL,
        ErrorKind::Target => match e {
            Error::Target { status: Status::ReadOnly | Status::AccessDenied, .. } => NBD_EPERM,
            Error::Target { status: Status::OutOfRange, .. } => beyond_end,
            Error::Target { status: Status::Misaligned | Status::TooLarge | Status::ZeroLength, .. } => NBD_EINVAL,
            Error::Target { status: Status::ShuttingDown, .. } => NBD_ESHUTDOWN,
            Error::Target { status: Status::IoError, detail, .. }
                if [libc::ENOSPC, libc::EDQUOT, libc::EFBIG].contains(&(*detail as i32)) =>
            {
                NBD_ENOSPC
            }
            _ => NBD_EIO,
        },
        _ => NBD_EIO,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rdmablk_common::protocol::Opcode;
    use std::time::Duration;

    fn target(status: Status, detail: u32) -> Failure {
        Failure::Io(Error::Target { op: Opcode::Write, status, detail, volume: None, offset: None, length: None })
    }

    #[test]
    fn errno_follows_the_spec() {
        let out = |op| Failure::Io(Error::OutOfRange { op, offset: 1 << 30, length: 4096, size: 1 << 30 });
        assert_eq!(errno(Command::Write, &out(Opcode::Write)), NBD_ENOSPC);
        assert_eq!(errno(Command::WriteZeroes, &out(Opcode::WriteZeroes)), NBD_ENOSPC);
        assert_eq!(errno(Command::Read, &out(Opcode::Read)), NBD_EINVAL);
        assert_eq!(errno(Command::Trim, &out(Opcode::Discard)), NBD_EINVAL);
        let mis = Failure::Io(Error::Misaligned { op: Opcode::Read, offset: 1, length: 4096, block_size: 4096 });
        assert_eq!(errno(Command::Read, &mis), NBD_EINVAL);
        let ro = Failure::Io(Error::ReadOnly { op: Opcode::Write, volume: "v".into() });
        assert_eq!(errno(Command::Write, &ro), NBD_EPERM);
        assert_eq!(errno(Command::Trim, &ro), NBD_EPERM);
        assert_eq!(errno(Command::Write, &target(Status::ReadOnly, 0)), NBD_EPERM);
        assert_eq!(errno(Command::Write, &target(Status::OutOfRange, 0)), NBD_ENOSPC);
        assert_eq!(errno(Command::Read, &target(Status::OutOfRange, 0)), NBD_EINVAL);
        assert_eq!(errno(Command::Write, &target(Status::IoError, libc::ENOSPC as u32)), NBD_ENOSPC);
        assert_eq!(errno(Command::Write, &target(Status::IoError, libc::EDQUOT as u32)), NBD_ENOSPC);
        assert_eq!(errno(Command::Write, &target(Status::IoError, libc::EIO as u32)), NBD_EIO);
        assert_eq!(errno(Command::Flush, &target(Status::ShuttingDown, 0)), NBD_ESHUTDOWN);
        assert_eq!(errno(Command::Read, &target(Status::InternalError, 0)), NBD_EIO);
        let lost = Failure::Io(Error::TargetLost { reason: "gone".into(), after: Duration::from_secs(60) });
        assert_eq!(errno(Command::Read, &lost), NBD_EIO);
        let timeout = Failure::Io(Error::Timeout { what: "read".into(), after: Duration::from_secs(30) });
        assert_eq!(errno(Command::Read, &timeout), NBD_EIO);
        for r in [
            RequestError::UnknownCommand(5),
            RequestError::BadFlags { command: Command::Read, flags: 4 },
            RequestError::TooLong { command: Command::Read, length: 1 << 21, max: 1 << 20 },
        ] {
            assert_eq!(errno(Command::Read, &Failure::Request(r)), NBD_EINVAL);
        }
    }
}
