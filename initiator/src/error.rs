//! The one error type of the initiator: a small matchable [`ErrorKind`] plus
//! the context a message needs to name the problem.

use std::fmt;
use std::time::Duration;

use rdmablk_common::fabric::FabricError;
use rdmablk_common::protocol::{Opcode, Status, PROTOCOL_VERSION};

/// Result of initiator calls.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// What a request was doing, for error messages ("write of 4096 bytes ...").
pub fn op_name(op: Opcode) -> &'static str {
    match op {
        Opcode::Connect => "connect",
        Opcode::ListVolumes => "list-volumes",
        Opcode::OpenVolume => "open",
        Opcode::CloseVolume => "close",
        Opcode::KeepAlive => "keep-alive",
        Opcode::AuthNegotiate => "auth-negotiate",
        Opcode::AuthReply => "auth-reply",
        Opcode::Read => "read",
        Opcode::Write => "write",
        Opcode::Flush => "flush",
        Opcode::Discard => "discard",
        Opcode::WriteZeroes => "write-zeroes",
    }
}

/// Everything that can go wrong in the initiator.
///
/// Match on [`Error::kind`] for control flow; the variants carry the context
/// the `Display` message is built from.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The target answered a command with a failure status.
    #[error("{}", target_message(*.op, *.status, *.detail, .volume.as_deref(), *.offset, *.length))]
    Target {
        op: Opcode,
        status: Status,
        /// Status detail from the response (errno for `IoError`).
        detail: u32,
        volume: Option<String>,
        offset: Option<u64>,
        length: Option<u64>,
    },
    /// Offset or length is not a multiple of the block size. Checked before
    /// anything is sent.
    #[error("{} of {length} bytes at offset {offset} is not aligned to the volume's {block_size}-byte block size", op_name(*.op))]
    Misaligned { op: Opcode, offset: u64, length: u64, block_size: u32 },
    /// The byte range lies (partly) beyond the end of the device. Checked before
    /// anything is sent.
    #[error("{} of {length} bytes at offset {offset} is beyond the end of the {size}-byte volume", op_name(*.op))]
    OutOfRange { op: Opcode, offset: u64, length: u64, size: u64 },
    /// A write-type request to a device that is read-only.
    #[error("{} on read-only volume {volume:?} refused", op_name(*.op))]
    ReadOnly { op: Opcode, volume: String },
    /// No volume with that name exists on the target.
    #[error("the target has no volume named {name:?}")]
    UnknownVolume { name: String },
    /// A command got no response within its deadline. The connection was closed
    /// (the target may still have been working on the command, so its buffers
    /// could not be reused safely otherwise).
    #[error("{what} timed out after {}", fmt_duration(*.after))]
    Timeout { what: String, after: Duration },
    /// The connection is gone and will not come back: closed by this
    /// initiator ([`Session::close`](crate::Session::close)), or lost with
    /// reconnection disabled (`ctrl_loss_timeout` of zero).
    #[error("connection to the target is closed: {reason}")]
    Disconnected { reason: String },
    /// The connection was lost and could not be re-established within
    /// `ctrl_loss_timeout`. Final: every queued and future request of the
    /// session fails with this error.
    #[error("target lost: no connection for {} (ctrl_loss_timeout); last failure: {reason}", fmt_duration(*.after))]
    TargetLost { reason: String, after: Duration },
    /// After a reconnection the target no longer offers the volume as it
    /// was opened (block size or size changed). The volume's requests fail
    /// with this error; open it again.
    #[error("volume {name:?} changed on the target after reconnecting: {detail}")]
    VolumeChanged { name: String, detail: String },
    /// The target speaks a different protocol version.
    #[error("target speaks protocol v{target}, this initiator speaks v{ours}")]
    VersionMismatch { target: u32, ours: u16 },
    /// Host authentication failed: the target did not accept this host's
    /// proof, or the target could not prove that it holds the key. The two
    /// are deliberately the same error (a wrong key on either side, an
    /// unknown host id and a target impersonator look alike from here).
    #[error("authentication with the target failed: it does not accept host id {host_id:?} with this key, or it could not prove it holds the key")]
    Authentication { host_id: String },
    /// The target sent something this initiator cannot make sense of. The
    /// connection is closed.
    #[error("protocol error: {detail}")]
    Protocol { detail: String },
    /// The fabric layer failed (connect refused, unreachable, bad URL...).
    #[error("{}", fabric_message(.context, .source))]
    Fabric {
        context: String,
        #[source]
        source: FabricError,
    },
    /// The caller passed something invalid (buffer range, name too long...).
    #[error("{detail}")]
    InvalidArgument { detail: String },
    /// A local I/O call failed (file devices, CLI input and output).
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },
    /// A volume with several gateways: none of them could be connected to.
    /// Each gateway's URL with what went wrong there, in list order.
    #[error("none of the {} gateways could be used: {}", .failures.len(), gateway_failures(.failures))]
    NoGateway { failures: Vec<(String, Error)> },
}

/// The small, copyable classification of an [`Error`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ErrorKind {
    Target,
    Misaligned,
    OutOfRange,
    ReadOnly,
    UnknownVolume,
    Timeout,
    Disconnected,
    TargetLost,
    VolumeChanged,
    VersionMismatch,
    Authentication,
    Protocol,
    Fabric,
    InvalidArgument,
    Io,
    NoGateway,
}

impl Error {
    /// The kind, for matching.
    pub fn kind(&self) -> ErrorKind {
        match self {
            Error::Target { .. } => ErrorKind::Target,
            Error::Misaligned { .. } => ErrorKind::Misaligned,
            Error::OutOfRange { .. } => ErrorKind::OutOfRange,
            Error::ReadOnly { .. } => ErrorKind::ReadOnly,
            Error::UnknownVolume { .. } => ErrorKind::UnknownVolume,
            Error::Timeout { .. } => ErrorKind::Timeout,
            Error::Disconnected { .. } => ErrorKind::Disconnected,
            Error::TargetLost { .. } => ErrorKind::TargetLost,
            Error::VolumeChanged { .. } => ErrorKind::VolumeChanged,
            Error::VersionMismatch { .. } => ErrorKind::VersionMismatch,
            Error::Authentication { .. } => ErrorKind::Authentication,
            Error::Protocol { .. } => ErrorKind::Protocol,
            Error::Fabric { .. } => ErrorKind::Fabric,
            Error::InvalidArgument { .. } => ErrorKind::InvalidArgument,
            Error::Io { .. } => ErrorKind::Io,
            Error::NoGateway { .. } => ErrorKind::NoGateway,
        }
    }

    /// The protocol status of this error: for [`Error::Target`] the one the
    /// target sent; for problems the initiator detects before sending
    /// (misaligned, out of range, read-only, unknown volume, version
    /// mismatch) the status the target answers them with. `None` for
    /// everything else (connection, timeouts, local I/O...).
    pub fn status(&self) -> Option<Status> {
        match self {
            Error::Target { status, .. } => Some(*status),
            Error::Misaligned { .. } => Some(Status::Misaligned),
            Error::OutOfRange { .. } => Some(Status::OutOfRange),
            Error::ReadOnly { .. } => Some(Status::ReadOnly),
            Error::UnknownVolume { .. } => Some(Status::UnknownVolume),
            Error::VersionMismatch { .. } => Some(Status::VersionMismatch),
            Error::Authentication { .. } => Some(Status::AuthFailed),
            _ => None,
        }
    }

    /// The message and every source, joined on one line (`a: b: c`), without
    /// repeating a source that the message already contains.
    pub fn one_line(&self) -> String {
        let mut out = self.to_string();
        let mut source = std::error::Error::source(self);
        while let Some(s) = source {
            let text = s.to_string();
            if !out.contains(&text) {
                out.push_str(": ");
                out.push_str(&text);
            }
            source = s.source();
        }
        out.replace('\n', " ")
    }

    pub(crate) fn invalid(detail: impl Into<String>) -> Self {
        Error::InvalidArgument { detail: detail.into() }
    }

    pub(crate) fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        Error::Io { context: context.into(), source }
    }

    pub(crate) fn fabric(context: impl Into<String>, source: FabricError) -> Self {
        Error::Fabric { context: context.into(), source }
    }

    pub(crate) fn protocol(detail: impl Into<String>) -> Self {
        Error::Protocol { detail: detail.into() }
    }

    pub(crate) fn version_mismatch(target: u32) -> Self {
        Error::VersionMismatch { target, ours: PROTOCOL_VERSION }
    }

    /// What connecting to each of a volume's gateways ended with, in list
    /// order: the error itself when there was only one.
    pub(crate) fn no_gateway(mut failures: Vec<(String, Error)>) -> Self {
        if failures.len() == 1 {
            return failures.pop().expect("one failure").1;
        }
        Error::NoGateway { failures }
    }
}

/// `url: what happened; url: what happened`.
fn gateway_failures(failures: &[(String, Error)]) -> String {
    failures.iter().map(|(url, e)| format!("{url}: {}", e.one_line())).collect::<Vec<_>>().join("; ")
}

impl From<Error> for std::io::Error {
    /// For the `std::io` adapters: the kind that fits, the message kept.
    fn from(e: Error) -> std::io::Error {
        use std::io::ErrorKind as K;
        let kind = match e.kind() {
            ErrorKind::Misaligned | ErrorKind::OutOfRange | ErrorKind::InvalidArgument => K::InvalidInput,
            ErrorKind::ReadOnly | ErrorKind::Authentication => K::PermissionDenied,
            ErrorKind::UnknownVolume => K::NotFound,
            ErrorKind::Timeout => K::TimedOut,
            ErrorKind::Target if e.status() == Some(Status::OutOfBuffers) => K::ResourceBusy,
            ErrorKind::Disconnected | ErrorKind::TargetLost | ErrorKind::NoGateway => K::NotConnected,
            ErrorKind::Io => match &e {
                Error::Io { source, .. } => source.kind(),
                _ => K::Other,
            },
            _ => K::Other,
        };
        std::io::Error::new(kind, e)
    }
}

fn target_message(
    op: Opcode,
    status: Status,
    detail: u32,
    volume: Option<&str>,
    offset: Option<u64>,
    length: Option<u64>,
) -> String {
    let mut s = String::from(op_name(op));
    match (length, offset) {
        (Some(len), Some(off)) => s.push_str(&format!(" of {len} bytes at offset {off}")),
        (None, Some(off)) => s.push_str(&format!(" at offset {off}")),
        (Some(len), None) => s.push_str(&format!(" of {len} bytes")),
        (None, None) => {}
    }
    if let Some(v) = volume {
        s.push_str(&format!(" on volume {v:?}"));
    }
    s.push_str(&format!(" failed: target reported {} ({status:?})", status.describe()));
    match status {
        Status::IoError if detail != 0 => {
            s.push_str(&format!(", errno {detail} ({})", std::io::Error::from_raw_os_error(detail as i32)))
        }
        // The pool could not serve it: not retried here (the caller decides).
        Status::OutOfBuffers => s.push_str(&format!(
            ": waited {} for a pool chunk (the target's chunk_wait_timeout); its pool is held by other I/O",
            fmt_duration(Duration::from_millis(u64::from(detail)))
        )),
        Status::Success => {}
        _ if detail != 0 => s.push_str(&format!(", detail {detail}")),
        _ => {}
    }
    s
}

fn fabric_message(context: &str, source: &FabricError) -> String {
    if source.context.contains(context) {
        source.to_string()
    } else {
        format!("{context}: {source}")
    }
}

/// `30s`, `1.5s`, `250ms`.
pub(crate) fn fmt_duration(d: Duration) -> String {
    if d.subsec_nanos() == 0 {
        format!("{}s", d.as_secs())
    } else if d < Duration::from_secs(1) {
        format!("{}ms", d.as_millis())
    } else {
        format!("{:.3}s", d.as_secs_f64())
    }
}

impl fmt::Display for ErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self, f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rdmablk_common::fabric::FabricErrorKind;

    #[test]
    fn misaligned_message_names_everything() {
        let e = Error::Misaligned { op: Opcode::Write, offset: 12289, length: 1048576, block_size: 4096 };
        assert_eq!(
            e.to_string(),
            "write of 1048576 bytes at offset 12289 is not aligned to the volume's 4096-byte block size"
        );
        assert_eq!(e.kind(), ErrorKind::Misaligned);
        assert_eq!(e.status(), Some(Status::Misaligned));
        let e = Error::Disconnected { reason: "x".into() };
        assert_eq!(e.status(), None);
    }

    #[test]
    fn target_message_includes_status_and_errno() {
        let e = Error::Target {
            op: Opcode::Read,
            status: Status::IoError,
            detail: 5,
            volume: Some("vol0".into()),
            offset: Some(8192),
            length: Some(4096),
        };
        let m = e.to_string();
        assert!(
            m.starts_with("read of 4096 bytes at offset 8192 on volume \"vol0\" failed: target reported I/O error"),
            "{m}"
        );
        assert!(m.contains("errno 5"), "{m}");
        assert_eq!(e.status(), Some(Status::IoError));
    }

    #[test]
    fn out_of_buffers_says_how_long_the_command_waited() {
        let e = Error::Target {
            op: Opcode::ListVolumes,
            status: Status::OutOfBuffers,
            detail: 5003,
            volume: None,
            offset: None,
            length: None,
        };
        assert_eq!(
            e.to_string(),
            "list-volumes failed: target reported target out of buffers (OutOfBuffers): waited 5.003s for a pool chunk (the target's chunk_wait_timeout); its pool is held by other I/O"
        );
        assert_eq!(std::io::Error::from(e).kind(), std::io::ErrorKind::ResourceBusy);
    }

    #[test]
    fn version_mismatch_names_both_versions() {
        let e = Error::version_mismatch(7);
        assert_eq!(e.to_string(), "target speaks protocol v7, this initiator speaks v1");
    }

    #[test]
    fn one_line_joins_sources() {
        let io = std::io::Error::new(std::io::ErrorKind::ConnectionRefused, "refused");
        let f = FabricError { kind: FabricErrorKind::ConnectFailed, context: "tcp://x:1".into(), source: Some(io) };
        let e = Error::fabric("connecting to tcp://x:1", f);
        let line = e.one_line();
        assert!(line.contains("connecting to tcp://x:1"), "{line}");
        assert!(line.contains("connection failed"), "{line}");
        assert!(line.contains("refused"), "{line}");
        assert!(!line.contains('\n'));
    }

    #[test]
    fn target_lost_names_the_timeout_and_the_cause() {
        let e = Error::TargetLost { reason: "connection refused".into(), after: Duration::from_secs(30) };
        assert_eq!(
            e.to_string(),
            "target lost: no connection for 30s (ctrl_loss_timeout); last failure: connection refused"
        );
        assert_eq!(e.kind(), ErrorKind::TargetLost);
        let io: std::io::Error = e.into();
        assert_eq!(io.kind(), std::io::ErrorKind::NotConnected);
        let io: std::io::Error = Error::Misaligned { op: Opcode::Read, offset: 1, length: 2, block_size: 512 }.into();
        assert_eq!(io.kind(), std::io::ErrorKind::InvalidInput);
    }

    #[test]
    fn no_gateway_names_each_gateway_and_what_it_said() {
        let refused = || {
            let io = std::io::Error::new(std::io::ErrorKind::ConnectionRefused, "Connection refused (os error 111)");
            Error::fabric("connecting to tcp://a:1", FabricError::io("tcp://a:1", io))
        };
        let single = Error::no_gateway(vec![("tcp://a:1".into(), refused())]);
        assert_eq!(single.kind(), ErrorKind::Fabric, "one gateway: its own error, as before");
        let e = Error::no_gateway(vec![
            ("tcp://a:1".into(), refused()),
            ("tcp://b:2".into(), Error::Timeout { what: "connecting to tcp://b:2".into(), after: Duration::from_secs(1) }),
        ]);
        assert_eq!(e.kind(), ErrorKind::NoGateway);
        let m = e.to_string();
        assert!(m.starts_with("none of the 2 gateways could be used: tcp://a:1: connecting to tcp://a:1"), "{m}");
        assert!(m.contains("Connection refused") && m.contains("; tcp://b:2: connecting to tcp://b:2 timed out after 1s"), "{m}");
        assert_eq!(std::io::Error::from(e).kind(), std::io::ErrorKind::NotConnected);
    }

    #[test]
    fn durations_print_compactly() {
        assert_eq!(fmt_duration(Duration::from_secs(30)), "30s");
        assert_eq!(fmt_duration(Duration::from_millis(250)), "250ms");
        assert_eq!(fmt_duration(Duration::from_millis(1500)), "1.500s");
    }
}
