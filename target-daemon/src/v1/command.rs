//! What a received command asks for, decided without side effects.
//!
//! [`plan`] takes the received message (capsule plus inline data), the
//! exported volumes, the target's limits, the queue pair's state and the
//! session's opened set, and returns either a [`Plan`] for the reactor to
//! carry out or the [`Error`] whose kind becomes the response status.
//! Nothing here touches a disk, the fabric or shared state, so every status
//! can be tested directly. (Joining a session needs the session registry:
//! the plan names the session and the reactor looks it up.)

use rdmablk_common::protocol::{
    decode_inline_str, AuthResponse, BlockCount, CommandCapsule, CommandId, ConnectReply, DataDescriptor, Lba, Opcode,
    SessionId, VolumeId, COMMAND_CAPSULE_SIZE, MAX_HOST_ID_LEN, MAX_NAME_LEN, PROTOCOL_VERSION,
    VOLUME_INFO_SIZE,
};

use crate::auth::{AuthState, Grant, Identity};
pub use crate::backend::table::{VolumeMeta, VolumeTable};
use crate::error::{Error, ErrorKind, Result};
use super::session::OpenSet;

/// Granularity of the negotiated max I/O size.
pub const IO_SIZE_UNIT: u32 = 4096;


/// The target's limits, from the configuration.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Limits {
    pub target_name: String,
    /// Maximum queue depth per queue pair.
    pub queue_depth: u32,
    /// Maximum I/O size (a multiple of 4096).
    pub max_io_size: u32,
    /// Maximum inline write payload.
    pub inline_data_size: u32,
    /// Pool chunk size: bounds what LIST_VOLUMES writes.
    pub chunk_size: u32,
}

/// What CONNECT settled.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Negotiated {
    pub queue_depth: u32,
    pub max_io_size: u32,
}

/// A queue pair's state as far as validation is concerned. (What its
/// session has opened is shared by all its queue pairs: an [`OpenSet`].)
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SessionState {
    /// Set by a successful CONNECT.
    pub connected: Option<Negotiated>,
    /// Host id from CONNECT.
    pub host_id: Option<String>,
    /// Authentication progress (AUTH_NEGOTIATE, AUTH_REPLY) and, once
    /// connected, whether the queue pair proved its host id.
    pub auth: AuthState,
    /// Commands of this queue pair received and not yet answered (not counting this one).
    pub outstanding: u32,
    /// The target is shutting down.
    pub shutting_down: bool,
}

impl SessionState {
    /// A fresh, unconnected queue pair.
    pub fn new() -> Self {
        SessionState::default()
    }

    /// Who this queue pair is, for access decisions: its CONNECT host id and
    /// whether it authenticated as that host.
    pub fn identity(&self) -> Identity<'_> {
        let host_id = self.host_id.as_deref().unwrap_or("");
        Identity { host_id, authenticated: self.auth.authenticated_host() == Some(host_id) && self.host_id.is_some() }
    }
}

/// Where a WRITE's data comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WriteSource {
    /// RDMA READ from the initiator's buffer.
    Descriptor(DataDescriptor),
    /// Inline after the capsule in the receive buffer.
    Inline,
}

/// A validated block command.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IoPlan {
    /// Read `len` bytes at byte `offset` of volume `volume` into the descriptor.
    Read { volume: usize, offset: u64, len: u32, dest: DataDescriptor },
    /// Write `len` bytes at byte `offset`.
    Write { volume: usize, offset: u64, len: u32, source: WriteSource, fua: bool },
    /// fdatasync.
    Flush { volume: usize },
    /// Punch a hole over `[offset, offset + len)`.
    Discard { volume: usize, offset: u64, len: u64 },
    /// Zero `[offset, offset + len)`.
    WriteZeroes { volume: usize, offset: u64, len: u64 },
}

/// What a command asks the reactor to do.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Plan {
    /// Create a session (`join` is `None`) or join one, mark the queue pair
    /// connected and send the reply; the reactor fills in the reply's
    /// session id and queue index.
    /// `replaces`: the earlier session of this host that a new session
    /// replaces (the reconnect fence); only without `join`.
    Connect { negotiated: Negotiated, host_id: String, join: Option<SessionId>, replaces: Option<SessionId>, reply: ConnectReply },
    /// Start authentication: answer an [`AuthChallenge`](rdmablk_common::protocol::AuthChallenge).
    AuthNegotiate { host_id: String, session_id: SessionId },
    /// Check the initiator's proof; answer the target's.
    AuthReply { response: AuthResponse },
    /// Write the first `entries` `VolumeInfo`s of the volumes the queue
    /// pair may see ([`VolumeTable::visible_to`]) into `dest`; result = `total`.
    ListVolumes { dest: DataDescriptor, entries: u32, total: u32 },
    /// Mark volume index `volume` open with `grant`; reply its info (read-only
    /// for a read-only grant); result = its id.
    Open { volume: usize, grant: Grant },
    /// Mark volume index `volume` closed.
    Close { volume: usize },
    /// Answer success.
    KeepAlive,
    /// A block command.
    Io(IoPlan),
}

/// The command id of a message, even one that does not decode.
pub fn command_id_of(msg: &[u8]) -> CommandId {
    if msg.len() >= 4 {
        CommandId(u16::from_le_bytes([msg[2], msg[3]]))
    } else {
        CommandId(0)
    }
}

/// Opcode and volume id of an I/O command that decodes, for counting
/// refused commands against their volume.
pub fn io_target(msg: &[u8]) -> Option<(Opcode, VolumeId)> {
    let cap = CommandCapsule::decode(msg).ok()?;
    cap.opcode.is_io().then_some((cap.opcode, cap.volume_id))
}

fn volume_by_id(volumes: &VolumeTable, id: VolumeId) -> Result<usize> {
    volumes.index_of(id).ok_or_else(|| Error::new(ErrorKind::UnknownVolume, format!("no volume with id {id}")))
}

/// Negotiated max I/O size: the smaller of both, whole 4 KiB units, at least one unit.
pub fn negotiate_max_io(requested: u32, limit: u32) -> u32 {
    (requested.min(limit) / IO_SIZE_UNIT * IO_SIZE_UNIT).max(IO_SIZE_UNIT)
}

/// Decides what `msg` (capsule plus inline data) asks for; `open` is what
/// the queue pair's session has opened.
pub fn plan(
    msg: &[u8],
    volumes: &VolumeTable,
    limits: &Limits,
    state: &SessionState,
    open: &OpenSet,
) -> (CommandId, Result<Plan>) {
    let cid = command_id_of(msg);
    (cid, plan_inner(msg, volumes, limits, state, open))
}

fn plan_inner(msg: &[u8], volumes: &VolumeTable, limits: &Limits, state: &SessionState, open: &OpenSet) -> Result<Plan> {
    let cap = CommandCapsule::decode(msg)?;
    let inline = &msg[COMMAND_CAPSULE_SIZE..];
    if state.shutting_down {
        return Err(Error::new(ErrorKind::ShuttingDown, "target is shutting down"));
    }
    let Some(neg) = state.connected else {
        match cap.opcode {
            Opcode::Connect => return connect(&cap, inline, limits),
            Opcode::AuthNegotiate => {
                let host_id = decode_inline_str(inline, MAX_HOST_ID_LEN, "host id")?;
                return Ok(Plan::AuthNegotiate { host_id: host_id.to_owned(), session_id: cap.session_id });
            }
            Opcode::AuthReply => return Ok(Plan::AuthReply { response: AuthResponse::decode(inline)? }),
            _ => {}
        }
        return Err(Error::new(ErrorKind::NotConnected, format!("{:?} before CONNECT", cap.opcode)));
    };
    if state.outstanding >= neg.queue_depth {
        return Err(Error::new(
            ErrorKind::QueueFull,
            format!("{} commands outstanding, negotiated queue depth {}", state.outstanding + 1, neg.queue_depth),
        ));
    }
    match cap.opcode {
        Opcode::Connect => Err(Error::new(ErrorKind::AlreadyConnected, "second CONNECT on a connected queue pair")),
        Opcode::AuthNegotiate | Opcode::AuthReply => {
            Err(Error::new(ErrorKind::AlreadyConnected, format!("{:?} on a connected queue pair", cap.opcode)))
        }
        Opcode::ListVolumes => {
            let total = volumes.visible_to(state.identity()).count() as u32;
            let fit = (cap.descriptor.length as usize / VOLUME_INFO_SIZE).min(limits.chunk_size as usize / VOLUME_INFO_SIZE);
            Ok(Plan::ListVolumes { dest: cap.descriptor, entries: (fit as u32).min(total), total })
        }
        Opcode::OpenVolume => {
            let name = decode_inline_str(inline, MAX_NAME_LEN, "volume name")?;
            let Some(i) = volumes.metas().iter().position(|v| v.name == name) else {
                return Err(Error::new(ErrorKind::UnknownVolume, format!("no volume named {name:?}")));
            };
            let who = state.identity();
            match volumes.get(i).grant(who, volumes.hosts_configured()) {
                Some(grant) => Ok(Plan::Open { volume: i, grant }),
                None => Err(Error::new(
                    ErrorKind::AccessDenied,
                    format!(
                        "host {who} may not open volume {name:?}: {}",
                        volumes.get(i).grants.refusal(who, volumes.hosts_configured())
                    ),
                )),
            }
        }
        Opcode::CloseVolume => {
            let i = volume_by_id(volumes, cap.volume_id)?;
            if !open.contains(cap.volume_id) {
                return Err(Error::new(ErrorKind::VolumeNotOpen, format!("volume {} is not open", cap.volume_id)));
            }
            Ok(Plan::Close { volume: i })
        }
        Opcode::KeepAlive => Ok(Plan::KeepAlive),
        Opcode::Read | Opcode::Write | Opcode::Flush | Opcode::Discard | Opcode::WriteZeroes => {
            io(&cap, inline, volumes, limits, open, neg).map(Plan::Io)
        }
    }
}

fn connect(cap: &CommandCapsule, inline: &[u8], limits: &Limits) -> Result<Plan> {
    let host_id = decode_inline_str(inline, MAX_HOST_ID_LEN, "host id")?;
    if cap.version != PROTOCOL_VERSION {
        return Err(Error::new(
            ErrorKind::VersionMismatch,
            format!(
                "host {host_id:?} speaks protocol version {}, this target speaks version {PROTOCOL_VERSION}",
                cap.version
            ),
        ));
    }
    let join = (cap.session_id != SessionId(0)).then_some(cap.session_id);
    let replaces = (cap.replaces != SessionId(0)).then_some(cap.replaces);
    let negotiated = Negotiated {
        queue_depth: cap.queue_depth.min(limits.queue_depth).max(1),
        max_io_size: negotiate_max_io(cap.max_io_size, limits.max_io_size),
    };
    let reply = ConnectReply {
        version: PROTOCOL_VERSION,
        queue_depth: negotiated.queue_depth,
        max_io_size: negotiated.max_io_size,
        inline_data_size: limits.inline_data_size,
        target_name: limits.target_name.clone(),
        // Filled in by the reactor once the registry created or joined the session.
        session_id: SessionId(0),
        queue_index: 0,
    };
    Ok(Plan::Connect { negotiated, host_id: host_id.to_owned(), join, replaces, reply })
}

fn io(
    cap: &CommandCapsule,
    inline: &[u8],
    volumes: &VolumeTable,
    limits: &Limits,
    open: &OpenSet,
    neg: Negotiated,
) -> Result<IoPlan> {
    let op = cap.opcode;
    let volume = volume_by_id(volumes, cap.volume_id)?;
    let v = volumes.get(volume);
    if !open.contains(cap.volume_id) {
        return Err(Error::new(ErrorKind::VolumeNotOpen, format!("volume {} ({}) is not open", v.id, v.name)));
    }
    let writes = matches!(op, Opcode::Write | Opcode::Discard | Opcode::WriteZeroes);
    if writes && v.read_only {
        return Err(Error::new(ErrorKind::ReadOnly, format!("{op:?} to read-only volume {}", v.name)));
    }
    if writes && open.is_read_only(cap.volume_id) {
        return Err(Error::new(
            ErrorKind::ReadOnly,
            format!("{op:?} to volume {}, which this session opened with a read-only grant (read_only_hosts)", v.name),
        ));
    }
    if (op == Opcode::Discard && !v.discard) || (op == Opcode::WriteZeroes && !v.write_zeroes) {
        return Err(Error::new(ErrorKind::NotSupported, format!("{op:?} is not supported by volume {}", v.name)));
    }
    if op == Opcode::Flush {
        return Ok(IoPlan::Flush { volume });
    }
    let BlockCount(count) = cap.block_count;
    if count == 0 {
        return Err(Error::new(ErrorKind::ZeroLength, format!("{op:?} of zero blocks")));
    }
    let bs = v.block_size as u64;
    let bytes = count as u64 * bs;
    if matches!(op, Opcode::Read | Opcode::Write) {
        let (len, max, what) = if cap.has_inline_data() {
            (inline.len() as u64, limits.inline_data_size as u64, "inline data")
        } else {
            (cap.descriptor.length as u64, neg.max_io_size as u64, "descriptor length")
        };
        if len % bs != 0 {
            return Err(Error::new(ErrorKind::Misaligned, format!("{what} {len} is not a multiple of block size {bs}")));
        }
        if len != bytes {
            return Err(Error::new(
                ErrorKind::LengthMismatch,
                format!("{what} {len} but {count} blocks of {bs} bytes is {bytes}"),
            ));
        }
        if len > max {
            return Err(Error::new(ErrorKind::TooLarge, format!("{what} {len} exceeds the maximum {max}")));
        }
    }
    let Lba(start) = cap.start_block;
    let end = start.checked_add(count as u64);
    let blocks = v.size / bs;
    if end.is_none_or(|e| e > blocks) {
        return Err(Error::new(
            ErrorKind::OutOfRange,
            format!("blocks {start} + {count} outside volume {} of {blocks} blocks", v.name),
        ));
    }
    // start < blocks here, so this cannot overflow: blocks * bs == size.
    let offset = start * bs;
    Ok(match op {
        Opcode::Read => IoPlan::Read { volume, offset, len: bytes as u32, dest: cap.descriptor },
        Opcode::Write => {
            let source = if cap.has_inline_data() { WriteSource::Inline } else { WriteSource::Descriptor(cap.descriptor) };
            IoPlan::Write { volume, offset, len: bytes as u32, source, fua: cap.fua() }
        }
        Opcode::Discard => IoPlan::Discard { volume, offset, len: bytes },
        Opcode::WriteZeroes => IoPlan::WriteZeroes { volume, offset, len: bytes },
        _ => unreachable!("checked above"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::auth::{AccessPolicy, VolumeGrants};
    use rdmablk_common::protocol::{Status, VolumeInfo, FLAG_FUA, FLAG_INLINE_DATA, VOLUME_FLAG_READ_ONLY};

    fn meta(id: u32, name: &str, bs: u32, size: u64, ro: bool, discard: bool) -> VolumeMeta {
        VolumeMeta {
            id: VolumeId(id),
            name: name.into(),
            block_size: bs,
            size,
            read_only: ro,
            discard,
            write_zeroes: discard,
            info: VolumeInfo {
                volume_id: VolumeId(id),
                block_size: bs,
                size_bytes: size,
                flags: if ro { VOLUME_FLAG_READ_ONLY } else { 0 },
                name: name.into(),
            },
            grants: VolumeGrants { allow_any_host: true, ..VolumeGrants::default() },
        }
    }

    fn vols() -> VolumeTable {
        VolumeTable::new(vec![
            meta(1, "rw", 4096, 1 << 20, false, true),
            meta(2, "ro", 512, 1 << 20, true, true),
            meta(3, "blk", 4096, 1 << 20, false, false),
        ])
    }

    fn all_open() -> OpenSet {
        OpenSet::default().with(VolumeId(1)).with(VolumeId(2)).with(VolumeId(3))
    }

    fn limits() -> Limits {
        Limits { target_name: "t".into(), queue_depth: 32, max_io_size: 65536, inline_data_size: 8192, chunk_size: 65536 }
    }

    fn connected() -> SessionState {
        SessionState {
            connected: Some(Negotiated { queue_depth: 8, max_io_size: 65536 }),
            host_id: Some("h".into()),
            auth: AuthState::Idle,
            outstanding: 0,
            shutting_down: false,
        }
    }

    fn msg(c: &CommandCapsule, inline: &[u8]) -> Vec<u8> {
        let mut m = c.to_bytes().to_vec();
        m.extend_from_slice(inline);
        m
    }

    fn status_with(m: &[u8], st: &SessionState, open: &OpenSet) -> Status {
        match plan(m, &vols(), &limits(), st, open).1 {
            Ok(p) => panic!("expected an error, got {p:?}"),
            Err(e) => e.wire_status().0,
        }
    }

    fn status(m: &[u8], st: &SessionState) -> Status {
        status_with(m, st, &all_open())
    }

    fn ok(m: &[u8], st: &SessionState) -> Plan {
        plan(m, &vols(), &limits(), st, &all_open()).1.unwrap()
    }

    fn io_cmd(op: Opcode, vol: u32, start: u64, count: u32, len: u32) -> CommandCapsule {
        let mut c = CommandCapsule::new(op, CommandId(7));
        c.volume_id = VolumeId(vol);
        c.start_block = Lba(start);
        c.block_count = BlockCount(count);
        if op.uses_descriptor() {
            c.descriptor = DataDescriptor { remote_addr: 0x1000, length: len, rkey: 5 };
        }
        c
    }

    fn connect_cmd(version: u16, qd: u32, max_io: u32) -> CommandCapsule {
        let mut c = CommandCapsule::new(Opcode::Connect, CommandId(1));
        c.version = version;
        c.queue_depth = qd;
        c.max_io_size = max_io;
        c.inline_len = 4;
        c
    }

    #[test]
    fn connect_negotiates() {
        let st = SessionState::new();
        let (cid, p) = plan(&msg(&connect_cmd(PROTOCOL_VERSION, 1000, 1 << 20), b"host"), &vols(), &limits(), &st, &OpenSet::default());
        assert_eq!(cid, CommandId(1));
        let Plan::Connect { negotiated, host_id, join, replaces, reply } = p.unwrap() else { panic!() };
        assert_eq!(replaces, None);
        assert_eq!(negotiated, Negotiated { queue_depth: 32, max_io_size: 65536 });
        assert_eq!(host_id, "host");
        assert_eq!(join, None, "session id 0 creates a session");
        assert_eq!(reply.inline_data_size, 8192);
        assert_eq!(reply.target_name, "t");
        let Plan::Connect { negotiated, .. } = ok(&msg(&connect_cmd(PROTOCOL_VERSION, 0, 5000), b"host"), &st) else {
            panic!()
        };
        assert_eq!(negotiated, Negotiated { queue_depth: 1, max_io_size: 4096 });
        let Plan::Connect { negotiated, .. } = ok(&msg(&connect_cmd(PROTOCOL_VERSION, 4, 12288 + 100), b"host"), &st) else {
            panic!()
        };
        assert_eq!(negotiated, Negotiated { queue_depth: 4, max_io_size: 12288 });
    }

    #[test]
    fn connect_with_a_session_id_asks_to_join() {
        let mut c = connect_cmd(PROTOCOL_VERSION, 4, 4096);
        c.session_id = SessionId(0x1234);
        let Plan::Connect { join, .. } = ok(&msg(&c, b"host"), &SessionState::new()) else { panic!() };
        assert_eq!(join, Some(SessionId(0x1234)));
    }

    #[test]
    fn a_new_session_may_name_the_session_it_replaces() {
        let mut c = connect_cmd(PROTOCOL_VERSION, 4, 4096);
        c.replaces = SessionId(0x77);
        let Plan::Connect { join, replaces, .. } = ok(&msg(&c, b"host"), &SessionState::new()) else { panic!() };
        assert_eq!((join, replaces), (None, Some(SessionId(0x77))));
        // A join replaces nothing.
        c.session_id = SessionId(0x1234);
        assert_eq!(status(&msg(&c, b"host"), &SessionState::new()), Status::InvalidField);
    }

    #[test]
    fn volume_table_by_id() {
        let t = VolumeTable::new(vec![meta(7, "a", 512, 4096, false, false), meta(2, "b", 512, 4096, false, false)]);
        assert_eq!(t.index_of(VolumeId(7)), Some(0));
        assert_eq!(t.index_of(VolumeId(2)), Some(1));
        assert_eq!(t.index_of(VolumeId(1)), None);
        assert_eq!(t.index_of(VolumeId(0)), None);
        assert_eq!(t.index_of(VolumeId(1000)), None);
        // Ids need not be positions: a reload removes and adds volumes.
        let mut c = CommandCapsule::new(Opcode::OpenVolume, CommandId(3));
        c.inline_len = 1;
        let p = plan(&msg(&c, b"b"), &t, &limits(), &connected(), &OpenSet::default()).1.unwrap();
        assert_eq!(p, Plan::Open { volume: 1, grant: Grant::ReadWrite });
        let m = msg(&io_cmd(Opcode::Read, 7, 0, 8, 4096), b"");
        let p = plan(&m, &t, &limits(), &connected(), &OpenSet::default().with(VolumeId(7))).1.unwrap();
        assert!(matches!(p, Plan::Io(IoPlan::Read { volume: 0, .. })));
        assert_eq!(io_target(&m), Some((Opcode::Read, VolumeId(7))));
    }

    #[test]
    fn status_version_mismatch() {
        let m = msg(&connect_cmd(PROTOCOL_VERSION + 1, 4, 4096), b"host");
        let e = plan(&m, &vols(), &limits(), &SessionState::new(), &OpenSet::default()).1.unwrap_err();
        assert_eq!(e.wire_status(), (Status::VersionMismatch, PROTOCOL_VERSION as u32));
        assert!(e.to_string().contains("host"), "{e}");
    }

    #[test]
    fn status_not_connected() {
        let m = msg(&CommandCapsule::new(Opcode::KeepAlive, CommandId(2)), b"");
        assert_eq!(status(&m, &SessionState::new()), Status::NotConnected);
        let m = msg(&io_cmd(Opcode::Read, 1, 0, 1, 4096), b"");
        assert_eq!(status(&m, &SessionState::new()), Status::NotConnected);
    }

    #[test]
    fn status_already_connected() {
        let m = msg(&connect_cmd(PROTOCOL_VERSION, 4, 4096), b"host");
        assert_eq!(status(&m, &connected()), Status::AlreadyConnected);
    }

    #[test]
    fn status_invalid_opcode_and_field() {
        let mut m = msg(&CommandCapsule::new(Opcode::KeepAlive, CommandId(9)), b"");
        m[0] = 0x7e;
        let (cid, r) = plan(&m, &vols(), &limits(), &connected(), &all_open());
        assert_eq!(cid, CommandId(9));
        assert_eq!(r.unwrap_err().wire_status().0, Status::InvalidOpcode);
        let mut m = msg(&CommandCapsule::new(Opcode::KeepAlive, CommandId(9)), b"");
        m[60] = 1;
        assert_eq!(status(&m, &connected()), Status::InvalidField);
        // Truncated.
        assert_eq!(status(&m[..10], &connected()), Status::InvalidField);
        // Host id not UTF-8.
        let m = msg(&connect_cmd(PROTOCOL_VERSION, 4, 4096), &[0xff, 0xfe, 0, 1]);
        assert_eq!(status(&m, &SessionState::new()), Status::InvalidField);
    }

    #[test]
    fn status_unknown_volume() {
        let mut c = CommandCapsule::new(Opcode::OpenVolume, CommandId(3));
        c.inline_len = 4;
        assert_eq!(status(&msg(&c, b"nope"), &connected()), Status::UnknownVolume);
        assert_eq!(status(&msg(&io_cmd(Opcode::Read, 9, 0, 1, 4096), b""), &connected()), Status::UnknownVolume);
        assert_eq!(status(&msg(&io_cmd(Opcode::Read, 0, 0, 1, 4096), b""), &connected()), Status::UnknownVolume);
        let mut c = CommandCapsule::new(Opcode::CloseVolume, CommandId(3));
        c.volume_id = VolumeId(4);
        assert_eq!(status(&msg(&c, b""), &connected()), Status::UnknownVolume);
    }

    #[test]
    fn open_close_list_keepalive() {
        let mut c = CommandCapsule::new(Opcode::OpenVolume, CommandId(3));
        c.inline_len = 2;
        assert_eq!(ok(&msg(&c, b"ro"), &connected()), Plan::Open { volume: 1, grant: Grant::ReadWrite });
        let mut c = CommandCapsule::new(Opcode::CloseVolume, CommandId(3));
        c.volume_id = VolumeId(3);
        assert_eq!(ok(&msg(&c, b""), &connected()), Plan::Close { volume: 2 });
        let open = all_open().without(VolumeId(3));
        assert_eq!(status_with(&msg(&c, b""), &connected(), &open), Status::VolumeNotOpen);
        let mut c = CommandCapsule::new(Opcode::ListVolumes, CommandId(3));
        c.descriptor = DataDescriptor { remote_addr: 1, length: 2 * 96 + 50, rkey: 1 };
        let Plan::ListVolumes { entries, total, .. } = ok(&msg(&c, b""), &connected()) else { panic!() };
        assert_eq!((entries, total), (2, 3));
        c.descriptor = DataDescriptor::default();
        let Plan::ListVolumes { entries, total, .. } = ok(&msg(&c, b""), &connected()) else { panic!() };
        assert_eq!((entries, total), (0, 3));
        assert_eq!(ok(&msg(&CommandCapsule::new(Opcode::KeepAlive, CommandId(1)), b""), &connected()), Plan::KeepAlive);
    }

    #[test]
    fn status_volume_not_open() {
        let open = all_open().without(VolumeId(1));
        assert_eq!(status_with(&msg(&io_cmd(Opcode::Read, 1, 0, 1, 4096), b""), &connected(), &open), Status::VolumeNotOpen);
        assert_eq!(status_with(&msg(&io_cmd(Opcode::Flush, 1, 0, 0, 0), b""), &connected(), &open), Status::VolumeNotOpen);
    }

    #[test]
    fn status_read_only() {
        for op in [Opcode::Write, Opcode::Discard, Opcode::WriteZeroes] {
            let len = if op == Opcode::Write { 512 } else { 0 };
            assert_eq!(status(&msg(&io_cmd(op, 2, 0, 1, len), b""), &connected()), Status::ReadOnly, "{op:?}");
        }
        // Reads and flushes of a read-only volume are fine.
        assert!(matches!(ok(&msg(&io_cmd(Opcode::Read, 2, 0, 1, 512), b""), &connected()), Plan::Io(IoPlan::Read { .. })));
        assert_eq!(ok(&msg(&io_cmd(Opcode::Flush, 2, 0, 0, 0), b""), &connected()), Plan::Io(IoPlan::Flush { volume: 1 }));
    }

    #[test]
    fn status_not_supported() {
        assert_eq!(status(&msg(&io_cmd(Opcode::Discard, 3, 0, 1, 0), b""), &connected()), Status::NotSupported);
        assert_eq!(status(&msg(&io_cmd(Opcode::WriteZeroes, 3, 0, 1, 0), b""), &connected()), Status::NotSupported);
    }

    #[test]
    fn status_zero_length() {
        for op in [Opcode::Read, Opcode::Write, Opcode::Discard, Opcode::WriteZeroes] {
            assert_eq!(status(&msg(&io_cmd(op, 1, 0, 0, 0), b""), &connected()), Status::ZeroLength, "{op:?}");
        }
    }

    #[test]
    fn status_misaligned() {
        assert_eq!(status(&msg(&io_cmd(Opcode::Read, 1, 0, 1, 4000), b""), &connected()), Status::Misaligned);
        let mut c = io_cmd(Opcode::Write, 1, 0, 1, 0);
        c.descriptor = DataDescriptor::default();
        c.flags = FLAG_INLINE_DATA;
        c.inline_len = 100;
        assert_eq!(status(&msg(&c, &[0; 100]), &connected()), Status::Misaligned);
    }

    #[test]
    fn status_length_mismatch() {
        assert_eq!(status(&msg(&io_cmd(Opcode::Read, 1, 0, 2, 4096), b""), &connected()), Status::LengthMismatch);
        assert_eq!(status(&msg(&io_cmd(Opcode::Write, 1, 0, 1, 8192), b""), &connected()), Status::LengthMismatch);
        // WRITE with neither descriptor nor inline data.
        let mut c = io_cmd(Opcode::Write, 1, 0, 1, 0);
        c.descriptor = DataDescriptor::default();
        assert_eq!(status(&msg(&c, b""), &connected()), Status::LengthMismatch);
    }

    #[test]
    fn status_too_large() {
        // Negotiated 64 KiB.
        assert_eq!(status(&msg(&io_cmd(Opcode::Read, 1, 0, 32, 131072), b""), &connected()), Status::TooLarge);
        assert!(plan(&msg(&io_cmd(Opcode::Read, 1, 0, 16, 65536), b""), &vols(), &limits(), &connected(), &all_open()).1.is_ok());
        // Inline beyond inline_data_size (8 KiB).
        let mut c = io_cmd(Opcode::Write, 1, 0, 3, 0);
        c.descriptor = DataDescriptor::default();
        c.flags = FLAG_INLINE_DATA;
        c.inline_len = 12288;
        assert_eq!(status(&msg(&c, &[0; 12288]), &connected()), Status::TooLarge);
    }

    #[test]
    fn status_out_of_range() {
        // 1 MiB / 4096 = 256 blocks.
        assert_eq!(status(&msg(&io_cmd(Opcode::Read, 1, 256, 1, 4096), b""), &connected()), Status::OutOfRange);
        assert_eq!(status(&msg(&io_cmd(Opcode::Read, 1, 255, 2, 8192), b""), &connected()), Status::OutOfRange);
        assert_eq!(status(&msg(&io_cmd(Opcode::Read, 1, u64::MAX, 1, 4096), b""), &connected()), Status::OutOfRange);
        assert_eq!(status(&msg(&io_cmd(Opcode::Discard, 1, u64::MAX - 1, 4, 0), b""), &connected()), Status::OutOfRange);
        assert_eq!(
            ok(&msg(&io_cmd(Opcode::Read, 1, 255, 1, 4096), b""), &connected()),
            Plan::Io(IoPlan::Read { volume: 0, offset: 255 * 4096, len: 4096, dest: DataDescriptor { remote_addr: 0x1000, length: 4096, rkey: 5 } })
        );
    }

    #[test]
    fn status_queue_full_and_shutting_down() {
        let mut st = connected();
        st.outstanding = 8;
        assert_eq!(status(&msg(&CommandCapsule::new(Opcode::KeepAlive, CommandId(1)), b""), &st), Status::QueueFull);
        let mut st = connected();
        st.shutting_down = true;
        assert_eq!(status(&msg(&CommandCapsule::new(Opcode::KeepAlive, CommandId(1)), b""), &st), Status::ShuttingDown);
    }

    /// Hosts "a" (read-write on rw, read-only on ro2) and "b" (nothing).
    fn guarded() -> VolumeTable {
        use std::collections::HashMap;
        let key = rdmablk_common::auth::AuthKey::new(&[1; 32]).unwrap();
        let keys = HashMap::from([("a".to_owned(), key.clone()), ("b".to_owned(), key)]);
        let grants = HashMap::from([
            ("rw".to_owned(), VolumeGrants { allowed_hosts: vec!["a".into()], ..VolumeGrants::default() }),
            ("ro2".to_owned(), VolumeGrants { read_only_hosts: vec!["a".into()], ..VolumeGrants::default() }),
            ("blk".to_owned(), VolumeGrants::default()),
        ]);
        let mut metas = vec![meta(1, "rw", 4096, 1 << 20, false, true), meta(2, "ro2", 4096, 1 << 20, false, true), meta(3, "blk", 4096, 1 << 20, false, false)];
        for m in &mut metas {
            m.grants = VolumeGrants::default();
        }
        VolumeTable::new(metas).with_access(&AccessPolicy::new(keys, grants))
    }

    fn as_host(host: &str, authenticated: bool) -> SessionState {
        let mut st = connected();
        st.host_id = Some(host.into());
        if authenticated {
            st.auth = AuthState::Authenticated { host_id: host.into(), session_id: SessionId(0) };
        }
        st
    }

    #[test]
    fn open_and_list_follow_the_grants() {
        let t = guarded();
        let open = |name: &str, st: &SessionState| {
            let mut c = CommandCapsule::new(Opcode::OpenVolume, CommandId(3));
            c.inline_len = name.len() as u32;
            plan(&msg(&c, name.as_bytes()), &t, &limits(), st, &OpenSet::default()).1
        };
        let a = as_host("a", true);
        assert_eq!(open("rw", &a).unwrap(), Plan::Open { volume: 0, grant: Grant::ReadWrite });
        assert_eq!(open("ro2", &a).unwrap(), Plan::Open { volume: 1, grant: Grant::ReadOnly });
        let e = open("blk", &a).unwrap_err();
        assert_eq!(e.wire_status().0, Status::AccessDenied);
        assert!(e.to_string().contains("\"a\"") || e.to_string().contains("host a"), "{e}");
        assert_eq!(open("rw", &as_host("b", true)).unwrap_err().wire_status().0, Status::AccessDenied);
        // Claiming host a without having proved it gets nothing.
        let e = open("rw", &as_host("a", false)).unwrap_err();
        assert_eq!(e.wire_status().0, Status::AccessDenied);
        assert!(e.to_string().contains("unauthenticated"), "{e}");
        assert_eq!(open("nope", &a).unwrap_err().wire_status().0, Status::UnknownVolume);

        let list = |st: &SessionState| {
            let mut c = CommandCapsule::new(Opcode::ListVolumes, CommandId(3));
            c.descriptor = DataDescriptor { remote_addr: 1, length: 10 * 96, rkey: 1 };
            let Plan::ListVolumes { entries, total, .. } = plan(&msg(&c, b""), &t, &limits(), st, &OpenSet::default()).1.unwrap() else {
                panic!()
            };
            (entries, total)
        };
        assert_eq!(list(&a), (2, 2));
        assert_eq!(list(&as_host("b", true)), (0, 0), "b sees nothing");
        assert_eq!(list(&as_host("a", false)), (0, 0));
        let seen: Vec<_> = t.visible_to(a.identity()).map(|(m, g)| (m.name.as_str(), g, m.info_for(g).read_only())).collect();
        assert_eq!(seen, vec![("rw", Grant::ReadWrite, false), ("ro2", Grant::ReadOnly, true)]);
    }

    #[test]
    fn a_read_only_grant_refuses_writes() {
        let t = guarded();
        let open = OpenSet::default().with_grant(VolumeId(2), true).with_grant(VolumeId(1), false);
        let st = as_host("a", true);
        for op in [Opcode::Write, Opcode::Discard, Opcode::WriteZeroes] {
            let len = if op == Opcode::Write { 4096 } else { 0 };
            let e = plan(&msg(&io_cmd(op, 2, 0, 1, len), b""), &t, &limits(), &st, &open).1.unwrap_err();
            assert_eq!(e.wire_status().0, Status::ReadOnly, "{op:?}");
            assert!(e.to_string().contains("read-only grant"), "{e}");
            assert!(plan(&msg(&io_cmd(op, 1, 0, 1, len), b""), &t, &limits(), &st, &open).1.is_ok(), "{op:?} on rw");
        }
        assert!(plan(&msg(&io_cmd(Opcode::Read, 2, 0, 1, 4096), b""), &t, &limits(), &st, &open).1.is_ok());
    }

    #[test]
    fn auth_commands_before_connect_only() {
        let mut c = CommandCapsule::new(Opcode::AuthNegotiate, CommandId(4));
        c.inline_len = 1;
        c.session_id = SessionId(77);
        let p = plan(&msg(&c, b"a"), &vols(), &limits(), &SessionState::new(), &OpenSet::default()).1.unwrap();
        assert_eq!(p, Plan::AuthNegotiate { host_id: "a".into(), session_id: SessionId(77) });
        assert_eq!(status(&msg(&c, b"a"), &connected()), Status::AlreadyConnected);
        let mut r = CommandCapsule::new(Opcode::AuthReply, CommandId(5));
        r.inline_len = 64;
        let p = plan(&msg(&r, &[3; 64]), &vols(), &limits(), &SessionState::new(), &OpenSet::default()).1.unwrap();
        assert_eq!(p, Plan::AuthReply { response: AuthResponse { initiator_nonce: [3; 32], mac: [3; 32] } });
        assert_eq!(status(&msg(&r, &[3; 64]), &connected()), Status::AlreadyConnected);
        assert_eq!(status(&msg(&r, &[0; 64]), &SessionState::new()), Status::InvalidField, "all-zero nonce");
    }

    #[test]
    fn write_plans() {
        let mut c = io_cmd(Opcode::Write, 1, 2, 2, 8192);
        c.flags = FLAG_FUA;
        let Plan::Io(IoPlan::Write { volume, offset, len, source, fua }) = ok(&msg(&c, b""), &connected()) else { panic!() };
        assert_eq!((volume, offset, len, fua), (0, 8192, 8192, true));
        assert!(matches!(source, WriteSource::Descriptor(_)));
        let mut c = io_cmd(Opcode::Write, 2, 0, 1, 0);
        c.descriptor = DataDescriptor::default();
        c.flags = FLAG_INLINE_DATA;
        c.inline_len = 512;
        let mut st = connected();
        assert_eq!(status(&msg(&c, &[1; 512]), &st), Status::ReadOnly);
        c.volume_id = VolumeId(1);
        c.inline_len = 4096;
        st.outstanding = 7;
        let Plan::Io(IoPlan::Write { source, len, .. }) = ok(&msg(&c, &[1; 4096]), &st) else { panic!() };
        assert_eq!((source, len), (WriteSource::Inline, 4096));
        let p = ok(&msg(&io_cmd(Opcode::WriteZeroes, 1, 10, 6, 0), b""), &connected());
        assert_eq!(p, Plan::Io(IoPlan::WriteZeroes { volume: 0, offset: 40960, len: 24576 }));
    }
}
