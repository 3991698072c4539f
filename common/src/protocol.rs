//! Wire protocol v1: fixed-size little-endian capsules.
//!
//! Every message is a SEND carrying either a 64-byte [`CommandCapsule`]
//! (initiator → target), optionally followed by inline data, or a 32-byte
//! [`ResponseCapsule`] (target → initiator), optionally followed by a small
//! fixed reply structure ([`ConnectReply`], [`VolumeInfo`]). Bulk data never
//! rides in a SEND except for small inline writes: the command names the
//! initiator's buffer with a [`DataDescriptor`] and the target moves the data
//! with RDMA WRITE (for READ) or RDMA READ (for WRITE).
//!
//! Decoding is two steps: `decode` checks the length and reads the fields,
//! `validate` checks the structural rules that need no target state (known
//! opcode, reserved bytes zero, flags legal for the opcode). Semantic checks
//! that need the volume (range, alignment, read-only) belong to the target.
//!
//! The layout is documented byte by byte in `docs/PROTOCOL.md`.

use std::fmt;

/// The protocol version this build speaks. Checked at CONNECT.
pub const PROTOCOL_VERSION: u16 = 1;

/// Size of a command capsule on the wire, without inline data.
pub const COMMAND_CAPSULE_SIZE: usize = 64;
/// Size of a response capsule on the wire, without reply data.
pub const RESPONSE_CAPSULE_SIZE: usize = 32;
/// Largest reply structure that may follow a response capsule.
pub const MAX_RESPONSE_DATA: usize = 224;
/// A receive buffer on the initiator must hold this many bytes.
pub const RESPONSE_SLOT_SIZE: usize = RESPONSE_CAPSULE_SIZE + MAX_RESPONSE_DATA;
/// Longest host identifier carried by CONNECT (inline, UTF-8).
pub const MAX_HOST_ID_LEN: usize = 223;
/// Longest volume or target name (UTF-8, NUL padded on the wire).
pub const MAX_NAME_LEN: usize = 64;
/// Inline data a CONNECT may carry before negotiation (the host id).
pub const CONNECT_INLINE_MAX: usize = MAX_HOST_ID_LEN;

const _: () = assert!(RESPONSE_SLOT_SIZE == 256);

/// Identifies a command within a queue pair; echoed in its response.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct CommandId(pub u16);

/// Identifies an opened volume within a session (returned by OPEN).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct VolumeId(pub u32);

/// A logical block address, in units of the volume's block size.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct Lba(pub u64);

/// Identifies a session (a host's set of queue pairs sharing opened
/// volumes). Chosen by the target at random, so it cannot be guessed; 0
/// means "none".
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct SessionId(pub u64);

/// `0x` and the id in hex, as the logs show it.
impl std::fmt::Display for SessionId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:#x}", self.0)
    }
}

/// A number of logical blocks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct BlockCount(pub u32);

impl fmt::Display for VolumeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// Why a capsule could not be decoded or failed structural validation.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    #[error("capsule truncated: {got} bytes, need {need}")]
    Truncated { got: usize, need: usize },
    #[error("unknown opcode {0:#04x}")]
    UnknownOpcode(u8),
    #[error("flags {flags:#04x} not valid for {opcode:?}")]
    BadFlags { opcode: Opcode, flags: u8 },
    #[error("reserved field at byte {offset} is not zero")]
    ReservedNotZero { offset: usize },
    #[error("inline length {inline_len} disagrees with {actual} bytes received")]
    InlineLength { inline_len: u32, actual: usize },
    #[error("{field} is not valid UTF-8 or too long")]
    BadString { field: &'static str },
    #[error("unknown status code {0}")]
    UnknownStatus(u16),
    #[error("field {field} has an invalid value")]
    InvalidField { field: &'static str },
}

macro_rules! wire_enum {
    ($(#[$m:meta])* $name:ident : $repr:ty { $($(#[$vm:meta])* $variant:ident = $value:expr),+ $(,)? }) => {
        $(#[$m])*
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        #[repr($repr)]
        pub enum $name { $($(#[$vm])* $variant = $value),+ }
        impl $name {
            /// Every value of this enum, in wire order.
            pub const ALL: &'static [$name] = &[$($name::$variant),+];
            /// The enum value for a wire value, if it is one.
            pub fn from_wire(v: $repr) -> Option<Self> {
                match v { $($value => Some($name::$variant),)+ _ => None }
            }
            /// The wire value.
            pub fn to_wire(self) -> $repr { self as $repr }
        }
    };
}

wire_enum! {
    /// Command opcodes. Admin commands are below 0x10, I/O commands from 0x10.
    Opcode: u8 {
        /// First command on a queue pair: version and limits negotiation.
        Connect = 0x01,
        /// Writes a [`VolumeInfo`] array into the descriptor; result = total count.
        ListVolumes = 0x02,
        /// Opens the volume named in the inline data; reply data = [`VolumeInfo`].
        OpenVolume = 0x03,
        /// Closes an opened volume.
        CloseVolume = 0x04,
        /// No-op that proves the target is alive.
        KeepAlive = 0x05,
        /// Starts host authentication before CONNECT: host id inline, the
        /// session id to create (0) or join; reply data = [`AuthChallenge`].
        AuthNegotiate = 0x06,
        /// Finishes host authentication: [`AuthResponse`] inline (the
        /// initiator's nonce and proof); reply data = [`AuthSuccess`].
        AuthReply = 0x07,
        /// Target reads the disk and RDMA-WRITEs into the descriptor.
        Read = 0x10,
        /// Target RDMA-READs the descriptor (or takes inline data) and writes the disk.
        Write = 0x11,
        /// Makes every completed write durable.
        Flush = 0x12,
        /// Deallocates a block range; its contents become unspecified.
        Discard = 0x13,
        /// Sets a block range to zeroes.
        WriteZeroes = 0x14,
    }
}

impl Opcode {
    /// Whether this opcode addresses a volume's blocks.
    pub fn is_io(self) -> bool {
        (self as u8) >= 0x10
    }
    /// Whether this command may carry a data descriptor.
    pub fn uses_descriptor(self) -> bool {
        matches!(self, Opcode::ListVolumes | Opcode::Read | Opcode::Write)
    }
    /// Whether this command may carry inline data after the capsule.
    pub fn allows_inline(self) -> bool {
        matches!(self, Opcode::Connect | Opcode::OpenVolume | Opcode::Write | Opcode::AuthNegotiate | Opcode::AuthReply)
    }
    /// Whether this command may carry a session id (CONNECT and AUTH_NEGOTIATE).
    pub fn carries_session_id(self) -> bool {
        matches!(self, Opcode::Connect | Opcode::AuthNegotiate)
    }
}

wire_enum! {
    /// Response status. Every failure has its own code so that a caller can
    /// tell exactly what was wrong. `detail` in the response adds context
    /// (an errno for `IoError`, the supported version for `VersionMismatch`).
    Status: u16 {
        Success = 0,
        /// The opcode is not known to this target.
        InvalidOpcode = 1,
        /// A field has a value the protocol does not allow (reserved bits, flags).
        InvalidField = 2,
        /// CONNECT asked for a protocol version the target does not speak.
        VersionMismatch = 3,
        /// A command other than CONNECT arrived before CONNECT.
        NotConnected = 4,
        /// CONNECT arrived on a queue pair that is already connected.
        AlreadyConnected = 5,
        /// No volume with that name (OPEN) or id (other commands) exists.
        UnknownVolume = 6,
        /// The volume id is valid but this session has not opened it.
        VolumeNotOpen = 7,
        /// The block range lies (partly) outside the volume, or overflows.
        OutOfRange = 8,
        /// A data length is not a multiple of the volume's block size.
        Misaligned = 9,
        /// The transfer exceeds the negotiated max I/O size or inline size.
        TooLarge = 10,
        /// The volume (or this session's grant) is read-only.
        ReadOnly = 11,
        /// The backing device failed; detail carries the errno.
        IoError = 12,
        /// The RDMA READ or WRITE to the initiator's buffer failed.
        TransferError = 13,
        /// The backend cannot perform this command.
        NotSupported = 14,
        /// A zero-length transfer where data is required.
        ZeroLength = 15,
        /// The descriptor length disagrees with block_count × block_size.
        LengthMismatch = 16,
        /// More commands outstanding than the negotiated queue depth.
        QueueFull = 17,
        /// The target is shutting down and takes no new commands.
        ShuttingDown = 18,
        /// The host is not allowed to do this.
        AccessDenied = 19,
        /// An internal error in the target; see its log.
        InternalError = 20,
        /// The volume is open and cannot be removed or reopened this way.
        Busy = 21,
        /// CONNECT names a session that does not exist or belongs to another host.
        UnknownSession = 22,
        /// CONNECT would exceed a configured limit of the target (its most
        /// sessions, or the most queue pairs of one session).
        LimitReached = 23,
        /// The target requires host authentication (AUTH_NEGOTIATE and
        /// AUTH_REPLY for this host id and session) before CONNECT.
        AuthRequired = 24,
        /// Host authentication failed. Deliberately says nothing more: not
        /// which MAC, not whether the host id is known.
        AuthFailed = 25,
        /// CONNECT asked to replace a session (the reconnect fence) and the
        /// target could not retire it in time: a disk I/O of that session
        /// has not completed. Nothing was created; retry the CONNECT.
        FenceTimeout = 26,
        /// The target is out of buffers: the command waited longer than the
        /// target's `chunk_wait_timeout` for a buffer-pool chunk and was
        /// given up; detail = the milliseconds it waited. A READ or LIST
        /// answered so delivered no data; a WRITE may have written part of
        /// its range, as any failed write.
        OutOfBuffers = 27,
        /// This gateway does not own the volume: it is shared (an RBD image
        /// served by several gateways) and another gateway took it over, so
        /// this one was fenced off and serves nothing of it, not even reads
        /// (they could be stale). Nothing was done; send the command to
        /// another of the volume's gateways.
        NotOwner = 28,
    }
}

impl Status {
    /// A short human-readable description, used in error messages.
    pub fn describe(self) -> &'static str {
        match self {
            Status::Success => "success",
            Status::InvalidOpcode => "invalid opcode",
            Status::InvalidField => "invalid field in command",
            Status::VersionMismatch => "protocol version mismatch",
            Status::NotConnected => "queue pair is not connected (CONNECT first)",
            Status::AlreadyConnected => "queue pair is already connected",
            Status::UnknownVolume => "unknown volume",
            Status::VolumeNotOpen => "volume is not open in this session",
            Status::OutOfRange => "block range is outside the volume",
            Status::Misaligned => "length is not a multiple of the block size",
            Status::TooLarge => "transfer is larger than the negotiated maximum",
            Status::ReadOnly => "volume is read-only",
            Status::IoError => "I/O error on the backing device",
            Status::TransferError => "RDMA transfer to or from the initiator buffer failed",
            Status::NotSupported => "command not supported by this volume's backend",
            Status::ZeroLength => "zero-length transfer",
            Status::LengthMismatch => "data length does not match the block count",
            Status::QueueFull => "queue depth exceeded",
            Status::ShuttingDown => "target is shutting down",
            Status::AccessDenied => "access denied",
            Status::InternalError => "internal target error",
            Status::Busy => "volume is busy",
            Status::UnknownSession => "unknown session (or it belongs to another host)",
            Status::LimitReached => "the target's limit of sessions or queue pairs per session is reached",
            Status::AuthRequired => "the target requires host authentication (a host id and its key) before CONNECT",
            Status::AuthFailed => "authentication failed",
            Status::FenceTimeout => {
                "the target could not yet retire the session this one replaces (a disk I/O of it is still in flight); retry"
            }
            Status::OutOfBuffers => "target out of buffers",
            Status::NotOwner => "this gateway lost the volume to another gateway (fenced); use another of its gateways",
        }
    }
}

impl fmt::Display for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.describe())
    }
}

/// Command flag: the write must be durable before the response (Force Unit Access).
pub const FLAG_FUA: u8 = 0x01;
/// Command flag: the write's data follows the capsule inline (no descriptor).
pub const FLAG_INLINE_DATA: u8 = 0x02;
const KNOWN_FLAGS: u8 = FLAG_FUA | FLAG_INLINE_DATA;

/// Names a buffer in the initiator's registered memory (a keyed SGL).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct DataDescriptor {
    /// Address of the buffer in the initiator's address space.
    pub remote_addr: u64,
    /// Length of the buffer in bytes.
    pub length: u32,
    /// Remote key of the memory region that holds the buffer.
    pub rkey: u32,
}

/// The 64-byte command capsule.
///
/// | bytes | field |
/// |---|---|
/// | 0 | opcode |
/// | 1 | flags |
/// | 2..4 | command id |
/// | 4..8 | volume id |
/// | 8..16 | starting block |
/// | 16..20 | block count |
/// | 20..24 | inline data length |
/// | 24..40 | data descriptor {addr u64, length u32, rkey u32} |
/// | 40..42 | CONNECT: protocol version |
/// | 42..44 | reserved |
/// | 44..48 | CONNECT: requested queue depth |
/// | 48..52 | CONNECT: requested max I/O size |
/// | 52..60 | CONNECT: session id to join (0 = create a new session) |
/// | 60..64 | reserved |
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CommandCapsule {
    pub opcode: Opcode,
    pub flags: u8,
    pub command_id: CommandId,
    pub volume_id: VolumeId,
    pub start_block: Lba,
    pub block_count: BlockCount,
    pub inline_len: u32,
    pub descriptor: DataDescriptor,
    /// CONNECT only: the protocol version the initiator speaks.
    pub version: u16,
    /// CONNECT only: requested queue depth.
    pub queue_depth: u32,
    /// CONNECT only: requested max I/O size in bytes.
    pub max_io_size: u32,
    /// CONNECT only: the session an additional queue pair joins; 0 creates
    /// a new session. The value comes from an earlier [`ConnectReply`].
    pub session_id: SessionId,
    /// CONNECT that creates a session (session id 0) only: the earlier
    /// session of the same host that the new one replaces (0: none). The
    /// target retires it before it answers: the reconnect fence. On the
    /// wire it takes bytes 8..16, the starting block of I/O commands.
    pub replaces: SessionId,
}

impl CommandCapsule {
    /// A capsule with every field zero except the opcode and command id.
    pub fn new(opcode: Opcode, command_id: CommandId) -> Self {
        CommandCapsule {
            opcode,
            flags: 0,
            command_id,
            volume_id: VolumeId(0),
            start_block: Lba(0),
            block_count: BlockCount(0),
            inline_len: 0,
            descriptor: DataDescriptor::default(),
            version: 0,
            queue_depth: 0,
            max_io_size: 0,
            session_id: SessionId(0),
            replaces: SessionId(0),
        }
    }

    /// Whether the FUA flag is set.
    pub fn fua(&self) -> bool {
        self.flags & FLAG_FUA != 0
    }

    /// Whether the data is inline.
    pub fn has_inline_data(&self) -> bool {
        self.flags & FLAG_INLINE_DATA != 0
    }

    /// Writes the capsule into the first 64 bytes of `out`.
    pub fn encode(&self, out: &mut [u8; COMMAND_CAPSULE_SIZE]) {
        out.fill(0);
        out[0] = self.opcode.to_wire();
        out[1] = self.flags;
        put_u16(out, 2, self.command_id.0);
        put_u32(out, 4, self.volume_id.0);
        // Bytes 8..16: the starting block, or on CONNECT the replaced
        // session (validate() keeps the other one zero).
        put_u64(out, 8, if self.opcode == Opcode::Connect { self.replaces.0 } else { self.start_block.0 });
        put_u32(out, 16, self.block_count.0);
        put_u32(out, 20, self.inline_len);
        put_u64(out, 24, self.descriptor.remote_addr);
        put_u32(out, 32, self.descriptor.length);
        put_u32(out, 36, self.descriptor.rkey);
        put_u16(out, 40, self.version);
        put_u32(out, 44, self.queue_depth);
        put_u32(out, 48, self.max_io_size);
        put_u64(out, 52, self.session_id.0);
    }

    /// Encodes into a fresh array.
    pub fn to_bytes(&self) -> [u8; COMMAND_CAPSULE_SIZE] {
        let mut out = [0u8; COMMAND_CAPSULE_SIZE];
        self.encode(&mut out);
        out
    }

    /// Reads a capsule from the start of a received message and validates it.
    /// `message` is the whole SEND payload: capsule plus inline data.
    pub fn decode(message: &[u8]) -> Result<Self, DecodeError> {
        if message.len() < COMMAND_CAPSULE_SIZE {
            return Err(DecodeError::Truncated { got: message.len(), need: COMMAND_CAPSULE_SIZE });
        }
        let b = &message[..COMMAND_CAPSULE_SIZE];
        let opcode = Opcode::from_wire(b[0]).ok_or(DecodeError::UnknownOpcode(b[0]))?;
        let bytes_8 = get_u64(b, 8);
        let connect = opcode == Opcode::Connect;
        let capsule = CommandCapsule {
            opcode,
            flags: b[1],
            command_id: CommandId(get_u16(b, 2)),
            volume_id: VolumeId(get_u32(b, 4)),
            start_block: Lba(if connect { 0 } else { bytes_8 }),
            block_count: BlockCount(get_u32(b, 16)),
            inline_len: get_u32(b, 20),
            descriptor: DataDescriptor {
                remote_addr: get_u64(b, 24),
                length: get_u32(b, 32),
                rkey: get_u32(b, 36),
            },
            version: get_u16(b, 40),
            queue_depth: get_u32(b, 44),
            max_io_size: get_u32(b, 48),
            session_id: SessionId(get_u64(b, 52)),
            replaces: SessionId(if connect { bytes_8 } else { 0 }),
        };
        if let Some(offset) = b[42..44].iter().chain(&b[60..64]).position(|&x| x != 0) {
            let offset = if offset < 2 { 42 + offset } else { 60 + offset - 2 };
            return Err(DecodeError::ReservedNotZero { offset });
        }
        let actual = message.len() - COMMAND_CAPSULE_SIZE;
        if capsule.inline_len as usize != actual {
            return Err(DecodeError::InlineLength { inline_len: capsule.inline_len, actual });
        }
        capsule.validate()?;
        Ok(capsule)
    }

    /// Structural checks that need no target state.
    pub fn validate(&self) -> Result<(), DecodeError> {
        let op = self.opcode;
        let bad_flags = DecodeError::BadFlags { opcode: op, flags: self.flags };
        if self.flags & !KNOWN_FLAGS != 0 {
            return Err(bad_flags);
        }
        if self.fua() && op != Opcode::Write {
            return Err(bad_flags);
        }
        if self.has_inline_data() && op != Opcode::Write {
            return Err(bad_flags);
        }
        if self.inline_len != 0 && !op.allows_inline() {
            return Err(DecodeError::InvalidField { field: "inline_len" });
        }
        if op == Opcode::Write && self.has_inline_data() != (self.inline_len != 0) {
            return Err(DecodeError::InvalidField { field: "inline_len" });
        }
        if !op.uses_descriptor() || self.has_inline_data() {
            let d = self.descriptor;
            if d != DataDescriptor::default() {
                return Err(DecodeError::InvalidField { field: "descriptor" });
            }
        }
        if op != Opcode::Connect && (self.version != 0 || self.queue_depth != 0 || self.max_io_size != 0) {
            return Err(DecodeError::InvalidField { field: "connect fields" });
        }
        if !op.carries_session_id() && self.session_id != SessionId(0) {
            return Err(DecodeError::InvalidField { field: "connect fields" });
        }
        // Only a CONNECT that creates a session replaces one; a join names
        // the session it joins instead.
        if self.replaces != SessionId(0) && (op != Opcode::Connect || self.session_id != SessionId(0)) {
            return Err(DecodeError::InvalidField { field: "replaced session" });
        }
        if !op.is_io() && op != Opcode::CloseVolume && self.volume_id != VolumeId(0) {
            return Err(DecodeError::InvalidField { field: "volume_id" });
        }
        if !op.is_io() && (self.start_block != Lba(0) || self.block_count != BlockCount(0)) {
            return Err(DecodeError::InvalidField { field: "block range" });
        }
        if op == Opcode::Flush && (self.start_block != Lba(0) || self.block_count != BlockCount(0)) {
            return Err(DecodeError::InvalidField { field: "block range" });
        }
        if op == Opcode::Connect && self.inline_len as usize > MAX_HOST_ID_LEN {
            return Err(DecodeError::BadString { field: "host id" });
        }
        if op == Opcode::AuthNegotiate && (self.inline_len == 0 || self.inline_len as usize > MAX_HOST_ID_LEN) {
            return Err(DecodeError::BadString { field: "host id" });
        }
        if op == Opcode::AuthReply && self.inline_len as usize != AUTH_RESPONSE_SIZE {
            return Err(DecodeError::InvalidField { field: "inline_len" });
        }
        if op == Opcode::OpenVolume && (self.inline_len == 0 || self.inline_len as usize > MAX_NAME_LEN) {
            return Err(DecodeError::BadString { field: "volume name" });
        }
        Ok(())
    }
}

/// The 32-byte response capsule.
///
/// | bytes | field |
/// |---|---|
/// | 0..2 | command id |
/// | 2..4 | status |
/// | 4..8 | status detail (errno for IoError, version for VersionMismatch) |
/// | 8..16 | result (command specific) |
/// | 16..20 | reply data length that follows the capsule |
/// | 20..32 | reserved |
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ResponseCapsule {
    pub command_id: CommandId,
    pub status: Status,
    pub detail: u32,
    pub result: u64,
    pub data_len: u32,
}

impl ResponseCapsule {
    /// A success response with no result.
    pub fn success(command_id: CommandId) -> Self {
        ResponseCapsule { command_id, status: Status::Success, detail: 0, result: 0, data_len: 0 }
    }

    /// A failure response.
    pub fn failure(command_id: CommandId, status: Status, detail: u32) -> Self {
        ResponseCapsule { command_id, status, detail, result: 0, data_len: 0 }
    }

    /// Writes the capsule into `out`.
    pub fn encode(&self, out: &mut [u8; RESPONSE_CAPSULE_SIZE]) {
        out.fill(0);
        put_u16(out, 0, self.command_id.0);
        put_u16(out, 2, self.status.to_wire());
        put_u32(out, 4, self.detail);
        put_u64(out, 8, self.result);
        put_u32(out, 16, self.data_len);
    }

    /// Encodes into a fresh array.
    pub fn to_bytes(&self) -> [u8; RESPONSE_CAPSULE_SIZE] {
        let mut out = [0u8; RESPONSE_CAPSULE_SIZE];
        self.encode(&mut out);
        out
    }

    /// Reads a response from a received message (capsule plus reply data).
    pub fn decode(message: &[u8]) -> Result<Self, DecodeError> {
        if message.len() < RESPONSE_CAPSULE_SIZE {
            return Err(DecodeError::Truncated { got: message.len(), need: RESPONSE_CAPSULE_SIZE });
        }
        let b = &message[..RESPONSE_CAPSULE_SIZE];
        let raw_status = get_u16(b, 2);
        let r = ResponseCapsule {
            command_id: CommandId(get_u16(b, 0)),
            status: Status::from_wire(raw_status).ok_or(DecodeError::UnknownStatus(raw_status))?,
            detail: get_u32(b, 4),
            result: get_u64(b, 8),
            data_len: get_u32(b, 16),
        };
        if let Some(p) = b[20..32].iter().position(|&x| x != 0) {
            return Err(DecodeError::ReservedNotZero { offset: 20 + p });
        }
        let actual = message.len() - RESPONSE_CAPSULE_SIZE;
        if r.data_len as usize != actual {
            return Err(DecodeError::InlineLength { inline_len: r.data_len, actual });
        }
        r.validate()?;
        Ok(r)
    }

    /// Structural checks.
    pub fn validate(&self) -> Result<(), DecodeError> {
        if self.data_len as usize > MAX_RESPONSE_DATA {
            return Err(DecodeError::InvalidField { field: "data_len" });
        }
        Ok(())
    }
}

/// Reply data of a successful CONNECT (96 bytes).
///
/// | bytes | field |
/// |---|---|
/// | 0..2 | protocol version |
/// | 2..4 | reserved |
/// | 4..8 | negotiated queue depth |
/// | 8..12 | negotiated max I/O size |
/// | 12..16 | inline data size (max inline write payload) |
/// | 16..80 | target name, UTF-8, NUL padded |
/// | 80..88 | session id (new, or the one joined) |
/// | 88..90 | queue index of this queue pair within the session (0 = first) |
/// | 90..96 | reserved |
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConnectReply {
    pub version: u16,
    pub queue_depth: u32,
    pub max_io_size: u32,
    pub inline_data_size: u32,
    pub target_name: String,
    pub session_id: SessionId,
    pub queue_index: u16,
}

/// Size of [`ConnectReply`] on the wire.
pub const CONNECT_REPLY_SIZE: usize = 96;

impl ConnectReply {
    /// Encodes; fails if the name is longer than [`MAX_NAME_LEN`].
    pub fn to_bytes(&self) -> Result<[u8; CONNECT_REPLY_SIZE], DecodeError> {
        let mut out = [0u8; CONNECT_REPLY_SIZE];
        put_u16(&mut out, 0, self.version);
        put_u32(&mut out, 4, self.queue_depth);
        put_u32(&mut out, 8, self.max_io_size);
        put_u32(&mut out, 12, self.inline_data_size);
        put_name(&mut out[16..80], &self.target_name, "target name")?;
        put_u64(&mut out, 80, self.session_id.0);
        put_u16(&mut out, 88, self.queue_index);
        Ok(out)
    }

    /// Decodes and validates.
    pub fn decode(b: &[u8]) -> Result<Self, DecodeError> {
        if b.len() != CONNECT_REPLY_SIZE {
            return Err(DecodeError::Truncated { got: b.len(), need: CONNECT_REPLY_SIZE });
        }
        if b[2..4] != [0, 0] {
            return Err(DecodeError::ReservedNotZero { offset: 2 });
        }
        if let Some(p) = b[90..96].iter().position(|&x| x != 0) {
            return Err(DecodeError::ReservedNotZero { offset: 90 + p });
        }
        let r = ConnectReply {
            version: get_u16(b, 0),
            queue_depth: get_u32(b, 4),
            max_io_size: get_u32(b, 8),
            inline_data_size: get_u32(b, 12),
            target_name: get_name(&b[16..80], "target name")?,
            session_id: SessionId(get_u64(b, 80)),
            queue_index: get_u16(b, 88),
        };
        r.validate()?;
        Ok(r)
    }

    /// A reply must grant at least one command slot and a non-zero I/O size.
    pub fn validate(&self) -> Result<(), DecodeError> {
        if self.queue_depth == 0 || self.queue_depth > u16::MAX as u32 {
            return Err(DecodeError::InvalidField { field: "queue_depth" });
        }
        if self.max_io_size == 0 {
            return Err(DecodeError::InvalidField { field: "max_io_size" });
        }
        if self.session_id == SessionId(0) {
            return Err(DecodeError::InvalidField { field: "session_id" });
        }
        Ok(())
    }
}

/// [`AuthChallenge::algorithm`]: HMAC-SHA256 over the transcript of
/// `common::auth` (the only one defined).
pub const AUTH_ALGORITHM_HMAC_SHA256: u16 = 1;
/// Bytes of a nonce in the authentication exchange.
pub const AUTH_NONCE_SIZE: usize = 32;
/// Bytes of a MAC in the authentication exchange.
pub const AUTH_MAC_SIZE: usize = 32;

/// Reply data of a successful AUTH_NEGOTIATE (104 bytes): the target's
/// fresh nonce and the name the target puts in the transcript.
///
/// | bytes | field |
/// |---|---|
/// | 0..2 | MAC algorithm: 1 = HMAC-SHA256 |
/// | 2..8 | reserved |
/// | 8..40 | target nonce |
/// | 40..104 | target name, UTF-8, NUL padded |
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AuthChallenge {
    pub algorithm: u16,
    pub target_nonce: [u8; AUTH_NONCE_SIZE],
    pub target_name: String,
}

/// Size of [`AuthChallenge`] on the wire.
pub const AUTH_CHALLENGE_SIZE: usize = 104;

impl AuthChallenge {
    /// Encodes; fails if the name is too long.
    pub fn to_bytes(&self) -> Result<[u8; AUTH_CHALLENGE_SIZE], DecodeError> {
        let mut out = [0u8; AUTH_CHALLENGE_SIZE];
        put_u16(&mut out, 0, self.algorithm);
        out[8..40].copy_from_slice(&self.target_nonce);
        put_name(&mut out[40..104], &self.target_name, "target name")?;
        Ok(out)
    }

    /// Decodes and validates.
    pub fn decode(b: &[u8]) -> Result<Self, DecodeError> {
        if b.len() != AUTH_CHALLENGE_SIZE {
            return Err(DecodeError::Truncated { got: b.len(), need: AUTH_CHALLENGE_SIZE });
        }
        if let Some(p) = b[2..8].iter().position(|&x| x != 0) {
            return Err(DecodeError::ReservedNotZero { offset: 2 + p });
        }
        let c = AuthChallenge {
            algorithm: get_u16(b, 0),
            target_nonce: b[8..40].try_into().expect("32 bytes"),
            target_name: get_name(&b[40..104], "target name")?,
        };
        c.validate()?;
        Ok(c)
    }

    /// A known algorithm and a nonce that is not all zeroes (a peer that
    /// forgot to fill it in).
    pub fn validate(&self) -> Result<(), DecodeError> {
        if self.algorithm != AUTH_ALGORITHM_HMAC_SHA256 {
            return Err(DecodeError::InvalidField { field: "algorithm" });
        }
        if self.target_nonce == [0; AUTH_NONCE_SIZE] {
            return Err(DecodeError::InvalidField { field: "target nonce" });
        }
        Ok(())
    }
}

/// Inline data of AUTH_REPLY (64 bytes): the initiator's fresh nonce and
/// its proof, HMAC-SHA256 over the transcript with the initiator's label.
///
/// | bytes | field |
/// |---|---|
/// | 0..32 | initiator nonce |
/// | 32..64 | initiator MAC |
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AuthResponse {
    pub initiator_nonce: [u8; AUTH_NONCE_SIZE],
    pub mac: [u8; AUTH_MAC_SIZE],
}

/// Size of [`AuthResponse`] on the wire.
pub const AUTH_RESPONSE_SIZE: usize = 64;

impl AuthResponse {
    /// Encodes.
    pub fn to_bytes(&self) -> [u8; AUTH_RESPONSE_SIZE] {
        let mut out = [0u8; AUTH_RESPONSE_SIZE];
        out[..32].copy_from_slice(&self.initiator_nonce);
        out[32..].copy_from_slice(&self.mac);
        out
    }

    /// Decodes and validates.
    pub fn decode(b: &[u8]) -> Result<Self, DecodeError> {
        if b.len() != AUTH_RESPONSE_SIZE {
            return Err(DecodeError::Truncated { got: b.len(), need: AUTH_RESPONSE_SIZE });
        }
        let r = AuthResponse { initiator_nonce: b[..32].try_into().expect("32 bytes"), mac: b[32..].try_into().expect("32 bytes") };
        r.validate()?;
        Ok(r)
    }

    /// The nonce is not all zeroes.
    pub fn validate(&self) -> Result<(), DecodeError> {
        if self.initiator_nonce == [0; AUTH_NONCE_SIZE] {
            return Err(DecodeError::InvalidField { field: "initiator nonce" });
        }
        Ok(())
    }
}

/// Reply data of a successful AUTH_REPLY (32 bytes): the target's proof,
/// HMAC-SHA256 over the same transcript with the target's label.
///
/// | bytes | field |
/// |---|---|
/// | 0..32 | target MAC |
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AuthSuccess {
    pub mac: [u8; AUTH_MAC_SIZE],
}

/// Size of [`AuthSuccess`] on the wire.
pub const AUTH_SUCCESS_SIZE: usize = 32;

impl AuthSuccess {
    /// Encodes.
    pub fn to_bytes(&self) -> [u8; AUTH_SUCCESS_SIZE] {
        self.mac
    }

    /// Decodes (any 32 bytes are a MAC; checking it is the caller's job).
    pub fn decode(b: &[u8]) -> Result<Self, DecodeError> {
        let mac = b.try_into().map_err(|_| DecodeError::Truncated { got: b.len(), need: AUTH_SUCCESS_SIZE })?;
        let s = AuthSuccess { mac };
        s.validate()?;
        Ok(s)
    }

    /// Nothing to check beyond the size.
    pub fn validate(&self) -> Result<(), DecodeError> {
        Ok(())
    }
}

/// Flag in [`VolumeInfo::flags`]: the volume rejects writes.
pub const VOLUME_FLAG_READ_ONLY: u32 = 0x1;
/// Flag in [`VolumeInfo::flags`]: DISCARD is supported.
pub const VOLUME_FLAG_DISCARD: u32 = 0x2;
/// Flag in [`VolumeInfo::flags`]: WRITE_ZEROES is supported.
pub const VOLUME_FLAG_WRITE_ZEROES: u32 = 0x4;
const KNOWN_VOLUME_FLAGS: u32 = VOLUME_FLAG_READ_ONLY | VOLUME_FLAG_DISCARD | VOLUME_FLAG_WRITE_ZEROES;

/// Describes a volume: reply data of OPEN, and the entries LIST writes (96 bytes).
///
/// | bytes | field |
/// |---|---|
/// | 0..4 | volume id |
/// | 4..8 | logical block size in bytes |
/// | 8..16 | size in bytes |
/// | 16..20 | flags (bit 0 read-only, bit 1 discard, bit 2 write-zeroes) |
/// | 20..32 | reserved |
/// | 32..96 | name, UTF-8, NUL padded |
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VolumeInfo {
    pub volume_id: VolumeId,
    pub block_size: u32,
    pub size_bytes: u64,
    pub flags: u32,
    pub name: String,
}

/// Size of [`VolumeInfo`] on the wire.
pub const VOLUME_INFO_SIZE: usize = 96;

impl VolumeInfo {
    /// Whether the volume is read-only.
    pub fn read_only(&self) -> bool {
        self.flags & VOLUME_FLAG_READ_ONLY != 0
    }

    /// Encodes; fails if the name is too long.
    pub fn to_bytes(&self) -> Result<[u8; VOLUME_INFO_SIZE], DecodeError> {
        let mut out = [0u8; VOLUME_INFO_SIZE];
        put_u32(&mut out, 0, self.volume_id.0);
        put_u32(&mut out, 4, self.block_size);
        put_u64(&mut out, 8, self.size_bytes);
        put_u32(&mut out, 16, self.flags);
        put_name(&mut out[32..96], &self.name, "volume name")?;
        Ok(out)
    }

    /// Decodes and validates.
    pub fn decode(b: &[u8]) -> Result<Self, DecodeError> {
        if b.len() != VOLUME_INFO_SIZE {
            return Err(DecodeError::Truncated { got: b.len(), need: VOLUME_INFO_SIZE });
        }
        if let Some(p) = b[20..32].iter().position(|&x| x != 0) {
            return Err(DecodeError::ReservedNotZero { offset: 20 + p });
        }
        let v = VolumeInfo {
            volume_id: VolumeId(get_u32(b, 0)),
            block_size: get_u32(b, 4),
            size_bytes: get_u64(b, 8),
            flags: get_u32(b, 16),
            name: get_name(&b[32..96], "volume name")?,
        };
        v.validate()?;
        Ok(v)
    }

    /// Block size is a power of two of at least 512; size is whole blocks.
    pub fn validate(&self) -> Result<(), DecodeError> {
        if self.block_size < 512 || !self.block_size.is_power_of_two() {
            return Err(DecodeError::InvalidField { field: "block_size" });
        }
        if self.size_bytes % self.block_size as u64 != 0 {
            return Err(DecodeError::InvalidField { field: "size_bytes" });
        }
        if self.flags & !KNOWN_VOLUME_FLAGS != 0 {
            return Err(DecodeError::InvalidField { field: "flags" });
        }
        Ok(())
    }
}

/// Checks a name for the wire: non-empty, at most [`MAX_NAME_LEN`] bytes, no NUL.
pub fn validate_name(name: &str) -> Result<(), DecodeError> {
    if name.is_empty() || name.len() > MAX_NAME_LEN || name.contains('\0') {
        return Err(DecodeError::BadString { field: "name" });
    }
    Ok(())
}

fn put_name(out: &mut [u8], name: &str, field: &'static str) -> Result<(), DecodeError> {
    if name.len() > out.len() || name.contains('\0') {
        return Err(DecodeError::BadString { field });
    }
    out[..name.len()].copy_from_slice(name.as_bytes());
    Ok(())
}

fn get_name(b: &[u8], field: &'static str) -> Result<String, DecodeError> {
    let end = b.iter().position(|&x| x == 0).unwrap_or(b.len());
    if b[end..].iter().any(|&x| x != 0) {
        return Err(DecodeError::BadString { field });
    }
    std::str::from_utf8(&b[..end]).map(str::to_owned).map_err(|_| DecodeError::BadString { field })
}

/// Decodes a UTF-8 string carried as inline data (host id, volume name).
pub fn decode_inline_str<'a>(b: &'a [u8], max: usize, field: &'static str) -> Result<&'a str, DecodeError> {
    if b.len() > max || b.contains(&0) {
        return Err(DecodeError::BadString { field });
    }
    std::str::from_utf8(b).map_err(|_| DecodeError::BadString { field })
}

fn put_u16(b: &mut [u8], at: usize, v: u16) {
    b[at..at + 2].copy_from_slice(&v.to_le_bytes());
}
fn put_u32(b: &mut [u8], at: usize, v: u32) {
    b[at..at + 4].copy_from_slice(&v.to_le_bytes());
}
fn put_u64(b: &mut [u8], at: usize, v: u64) {
    b[at..at + 8].copy_from_slice(&v.to_le_bytes());
}
fn get_u16(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}
fn get_u32(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}
fn get_u64(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

// Compile-time layout checks: the last field of each structure ends exactly
// at its fixed size, so a layout edit that forgets the size fails to build.
const _: () = assert!(60 + 4 == COMMAND_CAPSULE_SIZE, "command capsule: 60 bytes of fields + 4 reserved");
const _: () = assert!(20 + 12 == RESPONSE_CAPSULE_SIZE, "response capsule: 20 bytes of fields + 12 reserved");
const _: () = assert!(16 + MAX_NAME_LEN + 10 + 6 == CONNECT_REPLY_SIZE, "connect reply: 16 bytes + name + 10 + 6 reserved");
const _: () = assert!(32 + MAX_NAME_LEN == VOLUME_INFO_SIZE, "volume info: 32 bytes + name");
const _: () = assert!(CONNECT_REPLY_SIZE <= MAX_RESPONSE_DATA && VOLUME_INFO_SIZE <= MAX_RESPONSE_DATA);
const _: () = assert!(8 + AUTH_NONCE_SIZE + MAX_NAME_LEN == AUTH_CHALLENGE_SIZE, "auth challenge: 8 + nonce + name");
const _: () = assert!(AUTH_NONCE_SIZE + AUTH_MAC_SIZE == AUTH_RESPONSE_SIZE, "auth response: nonce + mac");
const _: () = assert!(AUTH_MAC_SIZE == AUTH_SUCCESS_SIZE, "auth success: mac");
const _: () = assert!(AUTH_CHALLENGE_SIZE <= MAX_RESPONSE_DATA && AUTH_SUCCESS_SIZE <= MAX_RESPONSE_DATA);
const _: () = assert!(AUTH_RESPONSE_SIZE <= MAX_HOST_ID_LEN, "AUTH_REPLY fits a CONNECT-sized send slot");
const _: () = assert!(AUTH_NONCE_SIZE == crate::auth::NONCE_LEN && AUTH_MAC_SIZE == crate::auth::MAC_LEN);
const _: () = assert!(COMMAND_CAPSULE_SIZE + CONNECT_INLINE_MAX <= 64 + 4096);

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn opcode() -> impl Strategy<Value = Opcode> {
        proptest::sample::select(Opcode::ALL)
    }

    fn status() -> impl Strategy<Value = Status> {
        proptest::sample::select(Status::ALL)
    }

    /// Capsules that obey the structural rules for their opcode.
    fn valid_capsule() -> impl Strategy<Value = (CommandCapsule, Vec<u8>)> {
        (opcode(), any::<u16>(), any::<u32>(), any::<u64>(), any::<u32>(), any::<(u64, u32, u32)>(), any::<bool>(), any::<bool>(), 1usize..64)
            .prop_map(|(op, cid, vol, lba, count, (addr, len, rkey), fua, inline, ilen)| {
                let mut c = CommandCapsule::new(op, CommandId(cid));
                let mut data = Vec::new();
                if op.is_io() || op == Opcode::CloseVolume {
                    c.volume_id = VolumeId(vol);
                }
                if op.is_io() && op != Opcode::Flush {
                    c.start_block = Lba(lba);
                    c.block_count = BlockCount(count);
                }
                match op {
                    Opcode::Connect => {
                        c.version = PROTOCOL_VERSION;
                        c.queue_depth = count;
                        c.max_io_size = len;
                        // A join names its session; a new session may
                        // name the one it replaces.
                        if fua {
                            c.session_id = SessionId(lba);
                        } else {
                            c.replaces = SessionId(lba);
                        }
                        data = b"host-a".to_vec();
                    }
                    Opcode::OpenVolume => data = vec![b'v'; ilen],
                    Opcode::AuthNegotiate => {
                        c.session_id = SessionId(lba);
                        data = b"host-a".to_vec();
                    }
                    Opcode::AuthReply => data = vec![0x42; AUTH_RESPONSE_SIZE],
                    Opcode::Write if inline => {
                        c.flags |= FLAG_INLINE_DATA;
                        data = vec![7u8; ilen];
                    }
                    _ => {}
                }
                if op == Opcode::Write && fua {
                    c.flags |= FLAG_FUA;
                }
                if op.uses_descriptor() && !c.has_inline_data() {
                    c.descriptor = DataDescriptor { remote_addr: addr, length: len, rkey };
                }
                c.inline_len = data.len() as u32;
                (c, data)
            })
    }

    proptest! {
        #[test]
        fn command_round_trips((capsule, inline) in valid_capsule()) {
            let mut msg = capsule.to_bytes().to_vec();
            msg.extend_from_slice(&inline);
            let decoded = CommandCapsule::decode(&msg).unwrap();
            prop_assert_eq!(decoded, capsule);
        }

        #[test]
        fn command_decode_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..200)) {
            let _ = CommandCapsule::decode(&bytes);
        }

        #[test]
        fn response_round_trips(cid in any::<u16>(), st in status(), detail in any::<u32>(), result in any::<u64>(), data_len in 0usize..=MAX_RESPONSE_DATA) {
            let r = ResponseCapsule { command_id: CommandId(cid), status: st, detail, result, data_len: data_len as u32 };
            let mut msg = r.to_bytes().to_vec();
            msg.resize(RESPONSE_CAPSULE_SIZE + data_len, 0xaa);
            prop_assert_eq!(ResponseCapsule::decode(&msg).unwrap(), r);
        }

        #[test]
        fn response_decode_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..300)) {
            let _ = ResponseCapsule::decode(&bytes);
        }

        #[test]
        fn volume_info_round_trips(id in any::<u32>(), shift in 9u32..=16, blocks in 0u64..(1 << 40), ro in any::<bool>(), name in "[a-z0-9_-]{1,64}") {
            let v = VolumeInfo { volume_id: VolumeId(id), block_size: 1 << shift, size_bytes: blocks << shift, flags: if ro { VOLUME_FLAG_READ_ONLY } else { 0 }, name };
            let bytes = v.to_bytes().unwrap();
            prop_assert_eq!(VolumeInfo::decode(&bytes).unwrap(), v);
        }

        #[test]
        fn connect_reply_round_trips(qd in 1u32..=65535, max_io in 1u32.., inline in any::<u32>(), name in "[a-zA-Z0-9.:-]{0,64}", sid in 1u64.., qi in any::<u16>()) {
            let r = ConnectReply { version: PROTOCOL_VERSION, queue_depth: qd, max_io_size: max_io, inline_data_size: inline, target_name: name, session_id: SessionId(sid), queue_index: qi };
            prop_assert_eq!(ConnectReply::decode(&r.to_bytes().unwrap()).unwrap(), r);
        }

        #[test]
        fn auth_structures_round_trip(nonce in any::<[u8; 32]>(), mac in any::<[u8; 32]>(), name in "[a-zA-Z0-9.:-]{0,64}") {
            prop_assume!(nonce != [0; 32]);
            let c = AuthChallenge { algorithm: AUTH_ALGORITHM_HMAC_SHA256, target_nonce: nonce, target_name: name };
            prop_assert_eq!(AuthChallenge::decode(&c.to_bytes().unwrap()).unwrap(), c);
            let r = AuthResponse { initiator_nonce: nonce, mac };
            prop_assert_eq!(AuthResponse::decode(&r.to_bytes()).unwrap(), r);
            let s = AuthSuccess { mac };
            prop_assert_eq!(AuthSuccess::decode(&s.to_bytes()).unwrap(), s);
        }

        #[test]
        fn auth_decoders_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..200)) {
            let _ = AuthChallenge::decode(&bytes);
            let _ = AuthResponse::decode(&bytes);
            let _ = AuthSuccess::decode(&bytes);
        }

        #[test]
        fn flipping_a_reserved_byte_is_rejected((capsule, inline) in valid_capsule(), pos in prop_oneof![42usize..44, 60usize..64], v in 1u8..) {
            let mut msg = capsule.to_bytes().to_vec();
            msg.extend_from_slice(&inline);
            msg[pos] = v;
            prop_assert_eq!(CommandCapsule::decode(&msg), Err(DecodeError::ReservedNotZero { offset: pos }));
        }
    }

    #[test]
    fn opcode_and_status_values_are_distinct_and_stable() {
        let mut seen = std::collections::HashSet::new();
        for s in Status::ALL {
            assert!(seen.insert(s.to_wire()), "duplicate status {s:?}");
            assert_eq!(Status::from_wire(s.to_wire()), Some(*s));
        }
        assert_eq!(Status::Success.to_wire(), 0);
        assert_eq!(Status::OutOfRange.to_wire(), 8);
        assert_eq!(Opcode::Read.to_wire(), 0x10);
        assert_eq!(Opcode::from_wire(0x7f), None);
    }

    #[test]
    fn auth_structural_rules() {
        let mut c = CommandCapsule::new(Opcode::AuthNegotiate, CommandId(1));
        let msg = |c: &CommandCapsule, inline: &[u8]| {
            let mut m = c.to_bytes().to_vec();
            m.extend_from_slice(inline);
            m
        };
        assert_eq!(CommandCapsule::decode(&msg(&c, b"")), Err(DecodeError::BadString { field: "host id" }));
        c.inline_len = 1;
        c.session_id = SessionId(9);
        assert!(CommandCapsule::decode(&msg(&c, b"h")).is_ok(), "AUTH_NEGOTIATE names the session");
        c.version = 1;
        assert_eq!(CommandCapsule::decode(&msg(&c, b"h")), Err(DecodeError::InvalidField { field: "connect fields" }));
        let mut r = CommandCapsule::new(Opcode::AuthReply, CommandId(1));
        r.inline_len = 63;
        assert_eq!(CommandCapsule::decode(&msg(&r, &[1; 63])), Err(DecodeError::InvalidField { field: "inline_len" }));
        r.inline_len = 64;
        assert!(CommandCapsule::decode(&msg(&r, &[1; 64])).is_ok());
        r.session_id = SessionId(1);
        assert_eq!(CommandCapsule::decode(&msg(&r, &[1; 64])), Err(DecodeError::InvalidField { field: "connect fields" }));
        let zero_nonce = AuthChallenge { algorithm: 1, target_nonce: [0; 32], target_name: "t".into() };
        assert_eq!(AuthChallenge::decode(&zero_nonce.to_bytes().unwrap()), Err(DecodeError::InvalidField { field: "target nonce" }));
        let bad_alg = AuthChallenge { algorithm: 2, target_nonce: [1; 32], target_name: "t".into() };
        assert_eq!(AuthChallenge::decode(&bad_alg.to_bytes().unwrap()), Err(DecodeError::InvalidField { field: "algorithm" }));
        let mut b = AuthChallenge { algorithm: 1, target_nonce: [1; 32], target_name: "t".into() }.to_bytes().unwrap();
        b[5] = 1;
        assert_eq!(AuthChallenge::decode(&b), Err(DecodeError::ReservedNotZero { offset: 5 }));
        assert!(AuthResponse::decode(&[0; 64]).is_err());
        assert!(AuthSuccess::decode(&[0; 31]).is_err());
    }

    #[test]
    fn structural_violations_are_named() {
        let mut c = CommandCapsule::new(Opcode::Read, CommandId(1));
        c.flags = FLAG_FUA;
        assert!(matches!(c.validate(), Err(DecodeError::BadFlags { .. })));
        let mut c = CommandCapsule::new(Opcode::Flush, CommandId(1));
        c.descriptor.length = 4096;
        assert_eq!(c.validate(), Err(DecodeError::InvalidField { field: "descriptor" }));
        let mut msg = CommandCapsule::new(Opcode::KeepAlive, CommandId(1)).to_bytes().to_vec();
        msg[0] = 0x99;
        assert_eq!(CommandCapsule::decode(&msg), Err(DecodeError::UnknownOpcode(0x99)));
        assert!(matches!(CommandCapsule::decode(&msg[..10]), Err(DecodeError::Truncated { .. })));
        let mut w = CommandCapsule::new(Opcode::Write, CommandId(2));
        w.flags = FLAG_INLINE_DATA;
        w.inline_len = 8;
        let mut msg = w.to_bytes().to_vec();
        msg.extend_from_slice(&[1, 2, 3]);
        assert_eq!(CommandCapsule::decode(&msg), Err(DecodeError::InlineLength { inline_len: 8, actual: 3 }));
    }

    #[test]
    fn the_replaced_session_rides_in_bytes_8_to_16_of_a_creating_connect_only() {
        let mut c = CommandCapsule::new(Opcode::Connect, CommandId(0));
        c.version = PROTOCOL_VERSION;
        c.queue_depth = 32;
        c.max_io_size = 1 << 20;
        c.replaces = SessionId(0x1122_3344_5566_7788);
        let bytes = c.to_bytes();
        assert_eq!(&bytes[8..16], &0x1122_3344_5566_7788u64.to_le_bytes());
        let back = CommandCapsule::decode(&bytes).unwrap();
        assert_eq!(back.replaces, c.replaces);
        assert_eq!(back.start_block, Lba(0), "bytes 8..16 are the replaced session on CONNECT, not a block");
        // A join names the session it joins; it replaces nothing.
        c.session_id = SessionId(9);
        assert_eq!(c.validate(), Err(DecodeError::InvalidField { field: "replaced session" }));
        assert!(CommandCapsule::decode(&c.to_bytes()).is_err());
        // Only CONNECT carries it.
        let mut k = CommandCapsule::new(Opcode::KeepAlive, CommandId(1));
        k.replaces = SessionId(5);
        assert_eq!(k.validate(), Err(DecodeError::InvalidField { field: "replaced session" }));
        // Bytes 8..16 of another admin command are still a (forbidden) block range.
        let mut raw = CommandCapsule::new(Opcode::KeepAlive, CommandId(1)).to_bytes();
        raw[8] = 1;
        assert_eq!(CommandCapsule::decode(&raw), Err(DecodeError::InvalidField { field: "block range" }));
        assert_eq!(Status::from_wire(26), Some(Status::FenceTimeout));
        assert_eq!(Status::from_wire(27), Some(Status::OutOfBuffers));
        assert_eq!(Status::from_wire(28), Some(Status::NotOwner));
        assert_eq!(Status::from_wire(29), None);
    }
}
