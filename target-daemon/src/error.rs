//! The one error type of the target: a small matchable [`ErrorKind`] plus
//! context, and the one function per wire that turns it into a status:
//! [`Error::wire_status`] for rdmablk v1, [`Error::nvme_status`] for NVMe-oF.

use std::borrow::Cow;
use std::fmt;

use rdmablk_common::fabric::FabricError;
use rdmablk_common::nvme::status::Status as NvmeStatus;
use rdmablk_common::protocol::{DecodeError, Status, PROTOCOL_VERSION};

/// What went wrong. Daemon-level kinds come first; the rest are the reasons
/// a command is refused or fails, one per wire status.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ErrorKind {
    /// The configuration file is unreadable or invalid.
    Config,
    /// A backing file or device cannot be opened or disagrees with the configuration.
    Volume,
    /// io_uring could not be set up (missing opcodes, registration refused...).
    Uring,
    /// A fabric call failed.
    Fabric,
    /// Another operating-system call failed (threads, epoll, eventfd, signals).
    Os,
    /// Unknown opcode in a command capsule.
    InvalidOpcode,
    /// A command field has a value the protocol does not allow.
    InvalidField,
    /// CONNECT asked for a protocol version this target does not speak.
    VersionMismatch,
    /// A command other than CONNECT before CONNECT.
    NotConnected,
    /// A second CONNECT on a connected queue pair.
    AlreadyConnected,
    /// No volume with that name or id.
    UnknownVolume,
    /// The volume exists but this session has not opened it.
    VolumeNotOpen,
    /// The block range lies (partly) outside the volume or overflows.
    OutOfRange,
    /// A data length is not a multiple of the block size.
    Misaligned,
    /// The transfer exceeds the negotiated maximum (or the inline maximum).
    TooLarge,
    /// The volume is read-only.
    ReadOnly,
    /// The backing device failed with this errno.
    DeviceIo(i32),
    /// An RDMA READ or WRITE to or from the initiator's buffer failed.
    Transfer,
    /// The volume's backend cannot perform this command.
    NotSupported,
    /// A zero block count where data is required.
    ZeroLength,
    /// The data length disagrees with block_count × block_size.
    LengthMismatch,
    /// More commands outstanding than the negotiated queue depth.
    QueueFull,
    /// The target is shutting down.
    ShuttingDown,
    /// CONNECT names a session that does not exist or is another host's.
    UnknownSession,
    /// CONNECT would exceed `target.max_sessions` or `target.max_queues_per_session`.
    LimitReached,
    /// CONNECT replaces a session that could not be retired within
    /// `target.fence_timeout` (a disk I/O of it is still in flight).
    FenceTimeout,
    /// The host may not use this volume (not granted by allowed_hosts,
    /// read_only_hosts or allow_any_host).
    AccessDenied,
    /// CONNECT without the authentication the target requires.
    AuthRequired,
    /// Host authentication failed. The context (log only) says why; the
    /// wire status is the same whatever the reason.
    AuthFailed,
    /// The command waited longer than `target.chunk_wait_timeout` for a
    /// buffer-pool chunk: this many milliseconds.
    OutOfBuffers(u32),
    /// This gateway was fenced off from a volume several gateways share
    /// (another one took it over): nothing of it is served here.
    NotOwner,
    /// A bug or broken invariant in the target.
    Internal,
}

/// The error type of this crate.
#[derive(Debug)]
pub struct Error {
    kind: ErrorKind,
    context: Cow<'static, str>,
    source: Option<Box<dyn std::error::Error + Send + Sync + 'static>>,
}

/// Result type of this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// An error of `kind` with a human-readable context.
    pub fn new(kind: ErrorKind, context: impl Into<Cow<'static, str>>) -> Self {
        Error { kind, context: context.into(), source: None }
    }

    /// An error caused by another error.
    pub fn with_source(
        kind: ErrorKind,
        context: impl Into<Cow<'static, str>>,
        source: impl std::error::Error + Send + Sync + 'static,
    ) -> Self {
        Error { kind, context: context.into(), source: Some(Box::new(source)) }
    }

    /// An error caused by an OS call.
    pub fn os(context: impl Into<Cow<'static, str>>, source: std::io::Error) -> Self {
        Self::with_source(ErrorKind::Os, context, source)
    }

    /// A configuration error; `context` names the file, the key and the reason.
    pub fn config(context: impl Into<Cow<'static, str>>) -> Self {
        Self::new(ErrorKind::Config, context)
    }

    /// A failed fabric call.
    pub fn fabric(context: impl Into<Cow<'static, str>>, source: FabricError) -> Self {
        Self::with_source(ErrorKind::Fabric, context, source)
    }

    /// A listening socket that could not be bound. `context` names the file,
    /// the key and the address (`cfg.toml: target.listen: cannot listen on
    /// tcp://0.0.0.0:7420`); the address being in use, not on this host or
    /// below 1024 is said in words with its fix, anything else as the OS says it.
    pub fn listen(kind: ErrorKind, context: String, e: std::io::Error) -> Self {
        let reason = match e.raw_os_error() {
            Some(libc::EADDRINUSE) => {
                "address already in use (EADDRINUSE): another process, or another rdmablk-target, listens on this port; \
                 stop it or choose another port"
            }
            Some(libc::EADDRNOTAVAIL) => {
                "address not available on this host (EADDRNOTAVAIL): no network interface has this IP address; \
                 use an address of this host (ip -br addr) or 0.0.0.0"
            }
            Some(libc::EACCES) => "permission denied (EACCES): ports below 1024 need CAP_NET_BIND_SERVICE; choose another port",
            _ => return Self::with_source(kind, context, e),
        };
        Self::new(kind, format!("{context}: {reason}"))
    }

    /// What went wrong.
    pub fn kind(&self) -> ErrorKind {
        self.kind
    }

    /// The context message, without the source.
    pub fn context(&self) -> &str {
        &self.context
    }

    /// The status and detail a response carries for this error. This is the
    /// only place where target errors become wire statuses.
    pub fn wire_status(&self) -> (Status, u32) {
        match self.kind {
            ErrorKind::InvalidOpcode => (Status::InvalidOpcode, 0),
            ErrorKind::InvalidField => (Status::InvalidField, 0),
            ErrorKind::VersionMismatch => (Status::VersionMismatch, PROTOCOL_VERSION as u32),
            ErrorKind::NotConnected => (Status::NotConnected, 0),
            ErrorKind::AlreadyConnected => (Status::AlreadyConnected, 0),
            ErrorKind::UnknownVolume => (Status::UnknownVolume, 0),
            ErrorKind::VolumeNotOpen => (Status::VolumeNotOpen, 0),
            ErrorKind::OutOfRange => (Status::OutOfRange, 0),
            ErrorKind::Misaligned => (Status::Misaligned, 0),
            ErrorKind::TooLarge => (Status::TooLarge, 0),
            ErrorKind::ReadOnly => (Status::ReadOnly, 0),
            ErrorKind::DeviceIo(errno) => (Status::IoError, errno.max(0) as u32),
            ErrorKind::Transfer => (Status::TransferError, 0),
            ErrorKind::NotSupported => (Status::NotSupported, 0),
            ErrorKind::ZeroLength => (Status::ZeroLength, 0),
            ErrorKind::LengthMismatch => (Status::LengthMismatch, 0),
            ErrorKind::QueueFull => (Status::QueueFull, 0),
            ErrorKind::ShuttingDown => (Status::ShuttingDown, 0),
            ErrorKind::UnknownSession => (Status::UnknownSession, 0),
            ErrorKind::AccessDenied => (Status::AccessDenied, 0),
            ErrorKind::AuthRequired => (Status::AuthRequired, 0),
            ErrorKind::AuthFailed => (Status::AuthFailed, 0),
            ErrorKind::LimitReached => (Status::LimitReached, 0),
            ErrorKind::FenceTimeout => (Status::FenceTimeout, 0),
            ErrorKind::OutOfBuffers(waited_ms) => (Status::OutOfBuffers, waited_ms),
            ErrorKind::NotOwner => (Status::NotOwner, 0),
            ErrorKind::Config
            | ErrorKind::Volume
            | ErrorKind::Uring
            | ErrorKind::Fabric
            | ErrorKind::Os
            | ErrorKind::Internal => (Status::InternalError, 0),
        }
    }

    /// Process exit code for the binary: 2 for configuration problems
    /// (including volumes that disagree with it), 1 for everything else.
    /// The NVMe status this error is answered with on an NVMe-oF queue
    /// (`reading`: a device error of a read is an unrecovered read error,
    /// of anything else a write fault).
    pub fn nvme_status(&self, reading: bool) -> NvmeStatus {
        match self.kind {
            ErrorKind::InvalidOpcode => NvmeStatus::INVALID_OPCODE,
            ErrorKind::InvalidField
            | ErrorKind::TooLarge
            | ErrorKind::Misaligned
            | ErrorKind::ZeroLength
            | ErrorKind::NotSupported => NvmeStatus::INVALID_FIELD,
            ErrorKind::UnknownVolume | ErrorKind::VolumeNotOpen => NvmeStatus::INVALID_NAMESPACE,
            ErrorKind::OutOfRange => NvmeStatus::LBA_OUT_OF_RANGE,
            ErrorKind::ReadOnly => NvmeStatus::NAMESPACE_WRITE_PROTECTED,
            ErrorKind::AccessDenied | ErrorKind::AuthRequired | ErrorKind::AuthFailed => NvmeStatus::ACCESS_DENIED,
            ErrorKind::LengthMismatch => NvmeStatus::SGL_DATA_LENGTH_INVALID,
            ErrorKind::DeviceIo(e) if e == libc::ENOSPC => NvmeStatus::CAPACITY_EXCEEDED,
            ErrorKind::DeviceIo(_) if reading => NvmeStatus::UNRECOVERED_READ_ERROR,
            ErrorKind::DeviceIo(_) => NvmeStatus::WRITE_FAULT,
            ErrorKind::Transfer => NvmeStatus::DATA_TRANSFER_ERROR,
            ErrorKind::NotConnected | ErrorKind::AlreadyConnected => NvmeStatus::COMMAND_SEQUENCE_ERROR,
            ErrorKind::ShuttingDown => NvmeStatus::NAMESPACE_NOT_READY,
            ErrorKind::NotOwner => NvmeStatus::ANA_INACCESSIBLE,
            ErrorKind::VersionMismatch
            | ErrorKind::QueueFull
            | ErrorKind::UnknownSession
            | ErrorKind::LimitReached
            | ErrorKind::FenceTimeout
            | ErrorKind::OutOfBuffers(_)
            | ErrorKind::Config
            | ErrorKind::Volume
            | ErrorKind::Uring
            | ErrorKind::Fabric
            | ErrorKind::Os
            | ErrorKind::Internal => NvmeStatus::INTERNAL_ERROR,
        }
    }

    pub fn exit_code(&self) -> i32 {
        match self.kind {
            ErrorKind::Config | ErrorKind::Volume => 2,
            _ => 1,
        }
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.context)?;
        if let Some(source) = &self.source {
            write!(f, ": {source}")?;
        }
        Ok(())
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.source.as_deref().map(|e| e as &(dyn std::error::Error + 'static))
    }
}

impl From<DecodeError> for Error {
    fn from(e: DecodeError) -> Self {
        let kind = match e {
            DecodeError::UnknownOpcode(_) => ErrorKind::InvalidOpcode,
            _ => ErrorKind::InvalidField,
        };
        Error::new(kind, e.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_command_kind_has_its_own_status() {
        let kinds = [
            ErrorKind::InvalidOpcode,
            ErrorKind::InvalidField,
            ErrorKind::VersionMismatch,
            ErrorKind::NotConnected,
            ErrorKind::AlreadyConnected,
            ErrorKind::UnknownVolume,
            ErrorKind::VolumeNotOpen,
            ErrorKind::OutOfRange,
            ErrorKind::Misaligned,
            ErrorKind::TooLarge,
            ErrorKind::ReadOnly,
            ErrorKind::DeviceIo(5),
            ErrorKind::Transfer,
            ErrorKind::NotSupported,
            ErrorKind::ZeroLength,
            ErrorKind::LengthMismatch,
            ErrorKind::QueueFull,
            ErrorKind::ShuttingDown,
            ErrorKind::UnknownSession,
            ErrorKind::AccessDenied,
            ErrorKind::AuthRequired,
            ErrorKind::AuthFailed,
            ErrorKind::LimitReached,
            ErrorKind::FenceTimeout,
            ErrorKind::OutOfBuffers(5000),
            ErrorKind::NotOwner,
            ErrorKind::Internal,
        ];
        let mut seen = std::collections::HashSet::new();
        for k in kinds {
            let (status, _) = Error::new(k, "x").wire_status();
            assert!(seen.insert(status), "{k:?} shares {status:?}");
            assert_ne!(status, Status::Success);
        }
    }

    #[test]
    fn listen_errors_say_why_in_words() {
        let e = |errno| {
            let context = "t.toml: target.listen: cannot listen on tcp://x:1".to_owned();
            Error::listen(ErrorKind::Os, context, std::io::Error::from_raw_os_error(errno))
        };
        let in_use = e(libc::EADDRINUSE).to_string();
        assert!(in_use.starts_with("t.toml: target.listen: cannot listen on tcp://x:1: address already in use (EADDRINUSE)"), "{in_use}");
        assert!(in_use.ends_with("stop it or choose another port"), "{in_use}");
        let absent = e(libc::EADDRNOTAVAIL).to_string();
        assert!(absent.contains(": address not available on this host (EADDRNOTAVAIL)") && absent.contains("0.0.0.0"), "{absent}");
        assert!(e(libc::EACCES).to_string().contains("CAP_NET_BIND_SERVICE"));
        // Anything else as the OS says it.
        assert!(e(libc::ENOBUFS).to_string().starts_with("t.toml: target.listen: cannot listen on tcp://x:1: No buffer space"));
    }

    #[test]
    fn details() {
        assert_eq!(Error::new(ErrorKind::DeviceIo(libc::EIO), "").wire_status(), (Status::IoError, libc::EIO as u32));
        assert_eq!(
            Error::new(ErrorKind::VersionMismatch, "").wire_status(),
            (Status::VersionMismatch, PROTOCOL_VERSION as u32)
        );
        assert_eq!(Error::new(ErrorKind::OutOfBuffers(5003), "").wire_status(), (Status::OutOfBuffers, 5003));
        let e: Error = DecodeError::UnknownOpcode(0x7f).into();
        assert_eq!(e.wire_status().0, Status::InvalidOpcode);
        let e: Error = DecodeError::ReservedNotZero { offset: 42 }.into();
        assert_eq!(e.wire_status().0, Status::InvalidField);
    }
}
