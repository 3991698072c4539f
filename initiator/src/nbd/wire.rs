//! The NBD wire format, fixed newstyle negotiation and simple replies, as
//! the NBD protocol document (`doc/proto.md` of the NetworkBlockDevice/nbd
//! project) defines them. Every field is big-endian. Each message has a
//! fixed-size part with its size as a constant (checked at compile time
//! against its fields) and `encode`/`decode` functions; decoders check
//! magics and lengths and say what is wrong. Nothing here does I/O.

use std::fmt;

/// `NBDMAGIC`: the first 8 bytes the server sends.
pub const NBDMAGIC: u64 = 0x4e42_444d_4147_4943;
/// `IHAVEOPT`: newstyle negotiation, and the magic of every option request.
pub const IHAVEOPT: u64 = 0x4948_4156_454f_5054;
/// Magic of every option reply.
pub const OPTION_REPLY_MAGIC: u64 = 0x0003_e889_0455_65a9;
/// Magic of every transmission request.
pub const REQUEST_MAGIC: u32 = 0x2560_9513;
/// Magic of a simple reply.
pub const SIMPLE_REPLY_MAGIC: u32 = 0x6744_6698;

/// Handshake flags (server, 16 bits).
pub const FLAG_FIXED_NEWSTYLE: u16 = 1 << 0;
/// The server may omit the 124 zero bytes after `NBD_OPT_EXPORT_NAME`.
pub const FLAG_NO_ZEROES: u16 = 1 << 1;
/// Client flags (32 bits).
pub const FLAG_C_FIXED_NEWSTYLE: u32 = 1 << 0;
/// The client asks for no zero padding after `NBD_OPT_EXPORT_NAME`.
pub const FLAG_C_NO_ZEROES: u32 = 1 << 1;

/// Transmission flags (16 bits).
pub const TFLAG_HAS_FLAGS: u16 = 1 << 0;
pub const TFLAG_READ_ONLY: u16 = 1 << 1;
pub const TFLAG_SEND_FLUSH: u16 = 1 << 2;
pub const TFLAG_SEND_FUA: u16 = 1 << 3;
pub const TFLAG_ROTATIONAL: u16 = 1 << 4;
pub const TFLAG_SEND_TRIM: u16 = 1 << 5;
pub const TFLAG_SEND_WRITE_ZEROES: u16 = 1 << 6;
pub const TFLAG_SEND_DF: u16 = 1 << 7;
pub const TFLAG_CAN_MULTI_CONN: u16 = 1 << 8;

/// Option types.
pub const OPT_EXPORT_NAME: u32 = 1;
pub const OPT_ABORT: u32 = 2;
pub const OPT_LIST: u32 = 3;
pub const OPT_STARTTLS: u32 = 5;
pub const OPT_INFO: u32 = 6;
pub const OPT_GO: u32 = 7;
pub const OPT_STRUCTURED_REPLY: u32 = 8;
pub const OPT_LIST_META_CONTEXT: u32 = 9;
pub const OPT_SET_META_CONTEXT: u32 = 10;
pub const OPT_EXTENDED_HEADERS: u32 = 11;

/// Option reply types.
pub const REP_ACK: u32 = 1;
pub const REP_SERVER: u32 = 2;
pub const REP_INFO: u32 = 3;
const REP_ERR: u32 = 1 << 31;
pub const REP_ERR_UNSUP: u32 = REP_ERR | 1;
pub const REP_ERR_POLICY: u32 = REP_ERR | 2;
pub const REP_ERR_INVALID: u32 = REP_ERR | 3;
pub const REP_ERR_PLATFORM: u32 = REP_ERR | 4;
pub const REP_ERR_TLS_REQD: u32 = REP_ERR | 5;
pub const REP_ERR_UNKNOWN: u32 = REP_ERR | 6;
pub const REP_ERR_SHUTDOWN: u32 = REP_ERR | 7;
pub const REP_ERR_BLOCK_SIZE_REQD: u32 = REP_ERR | 8;
pub const REP_ERR_TOO_BIG: u32 = REP_ERR | 9;

/// Information types of `NBD_REP_INFO`.
pub const INFO_EXPORT: u16 = 0;
pub const INFO_NAME: u16 = 1;
pub const INFO_DESCRIPTION: u16 = 2;
pub const INFO_BLOCK_SIZE: u16 = 3;

/// Command flags (16 bits).
pub const CMD_FLAG_FUA: u16 = 1 << 0;
pub const CMD_FLAG_NO_HOLE: u16 = 1 << 1;
pub const CMD_FLAG_DF: u16 = 1 << 2;
pub const CMD_FLAG_REQ_ONE: u16 = 1 << 3;
pub const CMD_FLAG_FAST_ZERO: u16 = 1 << 4;

/// Error values of a reply (the NBD protocol's own list).
pub const NBD_EPERM: u32 = 1;
pub const NBD_EIO: u32 = 5;
pub const NBD_ENOMEM: u32 = 12;
pub const NBD_EINVAL: u32 = 22;
pub const NBD_ENOSPC: u32 = 28;
pub const NBD_EOVERFLOW: u32 = 75;
pub const NBD_ENOTSUP: u32 = 95;
pub const NBD_ESHUTDOWN: u32 = 108;

/// The longest option data the server reads. `NBD_OPT_GO` carries a name
/// (a string of at most 4096 bytes) and a few information requests;
/// anything longer is a client to disconnect.
pub const MAX_OPTION_DATA: u32 = 8192;

/// The longest READ or WRITE this server serves: the spec's default
/// maximum payload (2^25 bytes), which clients that do not ask for block
/// sizes may use (the kernel's `nbd-client` sends writes above the
/// advertised maximum); the I/O path splits them at the session's max I/O
/// size. A longer READ is refused; a longer WRITE ends the connection,
/// since its payload is too long to read and throw away.
pub const MAX_PAYLOAD: u32 = 1 << 25;

/// What is wrong with bytes received from a client. Each message names the
/// field and the value.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    #[error("bad {what} magic {got:#x} (expected {want:#x})")]
    BadMagic { what: &'static str, got: u64, want: u64 },
    #[error("unknown client flags {0:#x} (known: FIXED_NEWSTYLE, NO_ZEROES)")]
    UnknownClientFlags(u32),
    #[error("option {option} carries {length} bytes of data, more than the {max} this server reads")]
    OptionTooLong { option: u32, length: u32, max: u32 },
    #[error("{option} data of {length} bytes is malformed: {detail}")]
    BadOptionData { option: &'static str, length: usize, detail: String },
    #[error("block sizes {0} are not valid: {1}")]
    BadBlockSizes(BlockSizes, &'static str),
}

/// Why a request is refused before it reaches the volume. Every variant
/// but [`RequestError::PayloadTooLong`] is answered with an error reply
/// (see `errno` in the server); that one ends the connection, since the
/// payload that follows is too long to read and throw away.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RequestError {
    #[error("unknown or unsupported command {0}")]
    UnknownCommand(u16),
    #[error("command flags {flags:#x} are not valid for {command}")]
    BadFlags { command: Command, flags: u16 },
    #[error("{command} of {length} bytes is longer than the {max} bytes this server serves")]
    TooLong { command: Command, length: u32, max: u32 },
    #[error("write of {length} bytes is longer than the {max} bytes this server serves or reads and discards")]
    PayloadTooLong { length: u32, max: u32 },
}

impl RequestError {
    /// Whether the connection must end (the stream cannot be resynchronised).
    pub fn is_fatal(&self) -> bool {
        matches!(self, RequestError::PayloadTooLong { .. })
    }
}

/// The server's first message: `NBDMAGIC`, `IHAVEOPT`, handshake flags.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Greeting {
    pub flags: u16,
}

impl Greeting {
    pub const SIZE: usize = 8 + 8 + 2;

    pub fn encode(&self) -> [u8; Self::SIZE] {
        let mut b = [0u8; Self::SIZE];
        b[0..8].copy_from_slice(&NBDMAGIC.to_be_bytes());
        b[8..16].copy_from_slice(&IHAVEOPT.to_be_bytes());
        b[16..18].copy_from_slice(&self.flags.to_be_bytes());
        b
    }

    pub fn decode(b: &[u8; Self::SIZE]) -> Result<Greeting, WireError> {
        check_magic("server", u64::from_be_bytes(b[0..8].try_into().expect("8 bytes")), NBDMAGIC)?;
        check_magic("newstyle", u64::from_be_bytes(b[8..16].try_into().expect("8 bytes")), IHAVEOPT)?;
        Ok(Greeting { flags: u16::from_be_bytes([b[16], b[17]]) })
    }
}

/// The client's flags, in answer to the greeting.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClientFlags(pub u32);

impl ClientFlags {
    pub const SIZE: usize = 4;

    pub fn decode(b: &[u8; Self::SIZE]) -> ClientFlags {
        ClientFlags(u32::from_be_bytes(*b))
    }

    /// A client may set only flags the server advertised.
    pub fn validate(&self, server: u16) -> Result<(), WireError> {
        let mut allowed = 0;
        if server & FLAG_FIXED_NEWSTYLE != 0 {
            allowed |= FLAG_C_FIXED_NEWSTYLE;
        }
        if server & FLAG_NO_ZEROES != 0 {
            allowed |= FLAG_C_NO_ZEROES;
        }
        if self.0 & !allowed != 0 {
            return Err(WireError::UnknownClientFlags(self.0));
        }
        Ok(())
    }

    pub fn no_zeroes(&self) -> bool {
        self.0 & FLAG_C_NO_ZEROES != 0
    }
}

/// The header of an option request: `IHAVEOPT`, option, data length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OptionHeader {
    pub option: u32,
    pub length: u32,
}

impl OptionHeader {
    pub const SIZE: usize = 8 + 4 + 4;

    pub fn encode(&self) -> [u8; Self::SIZE] {
        let mut b = [0u8; Self::SIZE];
        b[0..8].copy_from_slice(&IHAVEOPT.to_be_bytes());
        b[8..12].copy_from_slice(&self.option.to_be_bytes());
        b[12..16].copy_from_slice(&self.length.to_be_bytes());
        b
    }

    /// Checks the magic; [`validate`](OptionHeader::validate) checks the length.
    pub fn decode(b: &[u8; Self::SIZE]) -> Result<OptionHeader, WireError> {
        check_magic("option", u64::from_be_bytes(b[0..8].try_into().expect("8 bytes")), IHAVEOPT)?;
        Ok(OptionHeader {
            option: u32::from_be_bytes(b[8..12].try_into().expect("4 bytes")),
            length: u32::from_be_bytes(b[12..16].try_into().expect("4 bytes")),
        })
    }

    /// The data must be short enough to read ([`MAX_OPTION_DATA`]).
    pub fn validate(&self) -> Result<(), WireError> {
        if self.length > MAX_OPTION_DATA {
            return Err(WireError::OptionTooLong { option: self.option, length: self.length, max: MAX_OPTION_DATA });
        }
        Ok(())
    }
}

/// The header of an option reply; `length` bytes of data follow.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OptionReply {
    pub option: u32,
    pub reply: u32,
    pub length: u32,
}

impl OptionReply {
    pub const SIZE: usize = 8 + 4 + 4 + 4;

    pub fn encode(&self) -> [u8; Self::SIZE] {
        let mut b = [0u8; Self::SIZE];
        b[0..8].copy_from_slice(&OPTION_REPLY_MAGIC.to_be_bytes());
        b[8..12].copy_from_slice(&self.option.to_be_bytes());
        b[12..16].copy_from_slice(&self.reply.to_be_bytes());
        b[16..20].copy_from_slice(&self.length.to_be_bytes());
        b
    }

    pub fn decode(b: &[u8; Self::SIZE]) -> Result<OptionReply, WireError> {
        check_magic("option reply", u64::from_be_bytes(b[0..8].try_into().expect("8 bytes")), OPTION_REPLY_MAGIC)?;
        Ok(OptionReply {
            option: u32::from_be_bytes(b[8..12].try_into().expect("4 bytes")),
            reply: u32::from_be_bytes(b[12..16].try_into().expect("4 bytes")),
            length: u32::from_be_bytes(b[16..20].try_into().expect("4 bytes")),
        })
    }

    pub fn is_error(&self) -> bool {
        self.reply & REP_ERR != 0
    }
}

/// The data of `NBD_OPT_INFO` and `NBD_OPT_GO`: an export name and the
/// information types asked for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InfoRequest {
    pub name: Vec<u8>,
    pub requests: Vec<u16>,
}

impl InfoRequest {
    pub fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(4 + self.name.len() + 2 + 2 * self.requests.len());
        b.extend_from_slice(&(self.name.len() as u32).to_be_bytes());
        b.extend_from_slice(&self.name);
        b.extend_from_slice(&(self.requests.len() as u16).to_be_bytes());
        for r in &self.requests {
            b.extend_from_slice(&r.to_be_bytes());
        }
        b
    }

    /// Parses the option data; every length must agree with the total.
    pub fn decode(option: &'static str, data: &[u8]) -> Result<InfoRequest, WireError> {
        let bad = |detail: String| WireError::BadOptionData { option, length: data.len(), detail };
        if data.len() < 6 {
            return Err(bad("shorter than the 6 bytes of an empty request".into()));
        }
        let name_len = u32::from_be_bytes(data[0..4].try_into().expect("4 bytes")) as usize;
        if name_len > data.len() - 6 {
            return Err(bad(format!("the name length {name_len} leaves no room for the information requests")));
        }
        let name = data[4..4 + name_len].to_vec();
        let rest = &data[4 + name_len..];
        let count = u16::from_be_bytes([rest[0], rest[1]]) as usize;
        if rest.len() != 2 + 2 * count {
            return Err(bad(format!(
                "{count} information requests need {} bytes, {} follow",
                2 * count,
                rest.len() - 2
            )));
        }
        let requests = rest[2..].chunks_exact(2).map(|c| u16::from_be_bytes([c[0], c[1]])).collect();
        Ok(InfoRequest { name, requests })
    }
}

/// What `NBD_OPT_EXPORT_NAME` answers and `NBD_INFO_EXPORT` carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExportInfo {
    pub size: u64,
    pub flags: u16,
}

impl ExportInfo {
    /// The payload of `NBD_REP_INFO` / `NBD_INFO_EXPORT` (its *length* is 12).
    pub const INFO_SIZE: usize = 2 + 8 + 2;
    /// The answer to `NBD_OPT_EXPORT_NAME` without its zero padding.
    pub const EXPORT_NAME_SIZE: usize = 8 + 2;
    /// The zero padding after it, unless the client asked for none.
    pub const PADDING: usize = 124;

    pub fn encode_info(&self) -> [u8; Self::INFO_SIZE] {
        let mut b = [0u8; Self::INFO_SIZE];
        b[0..2].copy_from_slice(&INFO_EXPORT.to_be_bytes());
        b[2..10].copy_from_slice(&self.size.to_be_bytes());
        b[10..12].copy_from_slice(&self.flags.to_be_bytes());
        b
    }

    /// Size, flags and, unless `no_zeroes`, 124 zero bytes.
    pub fn encode_export_name(&self, no_zeroes: bool) -> Vec<u8> {
        let mut b = Vec::with_capacity(Self::EXPORT_NAME_SIZE + Self::PADDING);
        b.extend_from_slice(&self.size.to_be_bytes());
        b.extend_from_slice(&self.flags.to_be_bytes());
        if !no_zeroes {
            b.resize(Self::EXPORT_NAME_SIZE + Self::PADDING, 0);
        }
        b
    }

    pub fn decode_info(b: &[u8]) -> Option<ExportInfo> {
        if b.len() != Self::INFO_SIZE || u16::from_be_bytes([b[0], b[1]]) != INFO_EXPORT {
            return None;
        }
        Some(ExportInfo {
            size: u64::from_be_bytes(b[2..10].try_into().expect("8 bytes")),
            flags: u16::from_be_bytes([b[10], b[11]]),
        })
    }
}

/// `NBD_INFO_BLOCK_SIZE`: the size constraints of the export.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockSizes {
    pub minimum: u32,
    pub preferred: u32,
    pub maximum: u32,
}

impl fmt::Display for BlockSizes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "minimum {}, preferred {}, maximum {}", self.minimum, self.preferred, self.maximum)
    }
}

impl BlockSizes {
    /// The payload of `NBD_REP_INFO` / `NBD_INFO_BLOCK_SIZE` (its *length* is 14).
    pub const INFO_SIZE: usize = 2 + 4 + 4 + 4;

    /// The spec's rules: the minimum a power of two of at most 64 KiB, the
    /// preferred a power of two of at least the minimum and 512, the
    /// maximum at least the preferred.
    pub fn validate(&self) -> Result<(), WireError> {
        let bad = |why| Err(WireError::BadBlockSizes(*self, why));
        if !self.minimum.is_power_of_two() || self.minimum > 65536 {
            return bad("the minimum must be a power of two of at most 65536");
        }
        if !self.preferred.is_power_of_two() || self.preferred < self.minimum.max(512) {
            return bad("the preferred size must be a power of two of at least the minimum and 512");
        }
        if self.maximum < self.preferred {
            return bad("the maximum payload must be at least the preferred size");
        }
        Ok(())
    }

    pub fn encode_info(&self) -> [u8; Self::INFO_SIZE] {
        let mut b = [0u8; Self::INFO_SIZE];
        b[0..2].copy_from_slice(&INFO_BLOCK_SIZE.to_be_bytes());
        b[2..6].copy_from_slice(&self.minimum.to_be_bytes());
        b[6..10].copy_from_slice(&self.preferred.to_be_bytes());
        b[10..14].copy_from_slice(&self.maximum.to_be_bytes());
        b
    }

    pub fn decode_info(b: &[u8]) -> Option<BlockSizes> {
        if b.len() != Self::INFO_SIZE || u16::from_be_bytes([b[0], b[1]]) != INFO_BLOCK_SIZE {
            return None;
        }
        let word = |i: usize| u32::from_be_bytes(b[i..i + 4].try_into().expect("4 bytes"));
        Some(BlockSizes { minimum: word(2), preferred: word(6), maximum: word(10) })
    }
}

/// A transmission command.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Command {
    Read,
    Write,
    Disc,
    Flush,
    Trim,
    WriteZeroes,
    /// Anything else (`NBD_CMD_CACHE`, `NBD_CMD_BLOCK_STATUS`, unknown):
    /// this server refuses it.
    Other(u16),
}

impl Command {
    pub fn from_wire(t: u16) -> Command {
        match t {
            0 => Command::Read,
            1 => Command::Write,
            2 => Command::Disc,
            3 => Command::Flush,
            4 => Command::Trim,
            6 => Command::WriteZeroes,
            other => Command::Other(other),
        }
    }

    pub fn to_wire(self) -> u16 {
        match self {
            Command::Read => 0,
            Command::Write => 1,
            Command::Disc => 2,
            Command::Flush => 3,
            Command::Trim => 4,
            Command::WriteZeroes => 6,
            Command::Other(t) => t,
        }
    }

    /// The command flags this server accepts on the command. FUA is valid
    /// on every command (clients are known to set it on reads); NO_HOLE
    /// only on WRITE_ZEROES. DF, REQ_ONE and FAST_ZERO belong to features
    /// this server does not advertise.
    pub fn allowed_flags(self) -> u16 {
        match self {
            Command::WriteZeroes => CMD_FLAG_FUA | CMD_FLAG_NO_HOLE,
            _ => CMD_FLAG_FUA,
        }
    }
}

impl fmt::Display for Command {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Command::Read => f.write_str("NBD_CMD_READ"),
            Command::Write => f.write_str("NBD_CMD_WRITE"),
            Command::Disc => f.write_str("NBD_CMD_DISC"),
            Command::Flush => f.write_str("NBD_CMD_FLUSH"),
            Command::Trim => f.write_str("NBD_CMD_TRIM"),
            Command::WriteZeroes => f.write_str("NBD_CMD_WRITE_ZEROES"),
            Command::Other(t) => write!(f, "command {t}"),
        }
    }
}

/// A transmission request header; a WRITE's `length` bytes follow it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Request {
    pub flags: u16,
    pub command: Command,
    pub cookie: u64,
    pub offset: u64,
    pub length: u32,
}

impl Request {
    pub const SIZE: usize = 4 + 2 + 2 + 8 + 8 + 4;

    pub fn encode(&self) -> [u8; Self::SIZE] {
        let mut b = [0u8; Self::SIZE];
        b[0..4].copy_from_slice(&REQUEST_MAGIC.to_be_bytes());
        b[4..6].copy_from_slice(&self.flags.to_be_bytes());
        b[6..8].copy_from_slice(&self.command.to_wire().to_be_bytes());
        b[8..16].copy_from_slice(&self.cookie.to_be_bytes());
        b[16..24].copy_from_slice(&self.offset.to_be_bytes());
        b[24..28].copy_from_slice(&self.length.to_be_bytes());
        b
    }

    /// Checks the magic: a wrong one means the stream is out of step, and
    /// the connection must end. [`validate`](Request::validate) checks the rest.
    pub fn decode(b: &[u8; Self::SIZE]) -> Result<Request, WireError> {
        let magic = u32::from_be_bytes(b[0..4].try_into().expect("4 bytes"));
        check_magic("request", u64::from(magic), u64::from(REQUEST_MAGIC))?;
        Ok(Request {
            flags: u16::from_be_bytes([b[4], b[5]]),
            command: Command::from_wire(u16::from_be_bytes([b[6], b[7]])),
            cookie: u64::from_be_bytes(b[8..16].try_into().expect("8 bytes")),
            offset: u64::from_be_bytes(b[16..24].try_into().expect("8 bytes")),
            length: u32::from_be_bytes(b[24..28].try_into().expect("4 bytes")),
        })
    }

    /// Bytes of payload that follow this header on the wire.
    pub fn payload_len(&self) -> u32 {
        if self.command == Command::Write {
            self.length
        } else {
            0
        }
    }

    /// The command and its flags must be ones this server serves, and a
    /// READ or WRITE at most `max_payload` bytes long (a longer WRITE is
    /// fatal: its payload cannot be skipped). Alignment and the range are
    /// the volume's checks (the I/O path makes them).
    pub fn validate(&self, max_payload: u32) -> Result<(), RequestError> {
        let command = self.command;
        if let Command::Other(t) = command {
            return Err(RequestError::UnknownCommand(t));
        }
        if matches!(command, Command::Read | Command::Write) && self.length > max_payload {
            if command == Command::Write {
                return Err(RequestError::PayloadTooLong { length: self.length, max: max_payload });
            }
            return Err(RequestError::TooLong { command, length: self.length, max: max_payload });
        }
        if self.flags & !command.allowed_flags() != 0 {
            return Err(RequestError::BadFlags { command, flags: self.flags });
        }
        Ok(())
    }
}

/// A simple reply header; a successful READ's data follows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SimpleReply {
    pub error: u32,
    pub cookie: u64,
}

impl SimpleReply {
    pub const SIZE: usize = 4 + 4 + 8;

    pub fn encode(&self) -> [u8; Self::SIZE] {
        let mut b = [0u8; Self::SIZE];
        b[0..4].copy_from_slice(&SIMPLE_REPLY_MAGIC.to_be_bytes());
        b[4..8].copy_from_slice(&self.error.to_be_bytes());
        b[8..16].copy_from_slice(&self.cookie.to_be_bytes());
        b
    }

    pub fn decode(b: &[u8; Self::SIZE]) -> Result<SimpleReply, WireError> {
        let magic = u32::from_be_bytes(b[0..4].try_into().expect("4 bytes"));
        check_magic("simple reply", u64::from(magic), u64::from(SIMPLE_REPLY_MAGIC))?;
        Ok(SimpleReply {
            error: u32::from_be_bytes(b[4..8].try_into().expect("4 bytes")),
            cookie: u64::from_be_bytes(b[8..16].try_into().expect("8 bytes")),
        })
    }
}

// The fixed sizes the protocol document gives.
const _: () = assert!(Greeting::SIZE == 18);
const _: () = assert!(OptionHeader::SIZE == 16);
const _: () = assert!(OptionReply::SIZE == 20);
const _: () = assert!(ExportInfo::INFO_SIZE == 12 && ExportInfo::EXPORT_NAME_SIZE + ExportInfo::PADDING == 134);
const _: () = assert!(BlockSizes::INFO_SIZE == 14);
const _: () = assert!(Request::SIZE == 28);
const _: () = assert!(SimpleReply::SIZE == 16);

fn check_magic(what: &'static str, got: u64, want: u64) -> Result<(), WireError> {
    if got != want {
        return Err(WireError::BadMagic { what, got, want });
    }
    Ok(())
}

/// A readable name of an option type, for logs and error messages.
pub fn option_name(option: u32) -> String {
    let name = match option {
        OPT_EXPORT_NAME => "NBD_OPT_EXPORT_NAME",
        OPT_ABORT => "NBD_OPT_ABORT",
        OPT_LIST => "NBD_OPT_LIST",
        4 => "NBD_OPT_PEEK_EXPORT",
        OPT_STARTTLS => "NBD_OPT_STARTTLS",
        OPT_INFO => "NBD_OPT_INFO",
        OPT_GO => "NBD_OPT_GO",
        OPT_STRUCTURED_REPLY => "NBD_OPT_STRUCTURED_REPLY",
        OPT_LIST_META_CONTEXT => "NBD_OPT_LIST_META_CONTEXT",
        OPT_SET_META_CONTEXT => "NBD_OPT_SET_META_CONTEXT",
        OPT_EXTENDED_HEADERS => "NBD_OPT_EXTENDED_HEADERS",
        other => return format!("option {other}"),
    };
    name.to_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greeting_and_client_flags() {
        let g = Greeting { flags: FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES };
        let b = g.encode();
        assert_eq!(&b[..8], b"NBDMAGIC");
        assert_eq!(&b[8..16], b"IHAVEOPT");
        assert_eq!(&b[16..], &[0, 3]);
        assert_eq!(Greeting::decode(&b).unwrap(), g);
        let mut bad = b;
        bad[0] = b'X';
        assert!(matches!(Greeting::decode(&bad), Err(WireError::BadMagic { what: "server", .. })));

        let server = FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES;
        let c = ClientFlags::decode(&[0, 0, 0, 3]);
        c.validate(server).unwrap();
        assert!(c.no_zeroes());
        assert!(!ClientFlags(1).no_zeroes());
        let e = ClientFlags(4).validate(server).unwrap_err();
        assert_eq!(e.to_string(), "unknown client flags 0x4 (known: FIXED_NEWSTYLE, NO_ZEROES)");
        // A flag the server did not advertise is as bad as an unknown one.
        assert!(ClientFlags(FLAG_C_NO_ZEROES).validate(FLAG_FIXED_NEWSTYLE).is_err());
    }

    #[test]
    fn option_header_round_trip_and_checks() {
        let h = OptionHeader { option: OPT_GO, length: 12 };
        let b = h.encode();
        assert_eq!(&b[..8], b"IHAVEOPT");
        assert_eq!(OptionHeader::decode(&b).unwrap(), h);
        h.validate().unwrap();
        let mut bad = b;
        bad[7] ^= 1;
        let e = OptionHeader::decode(&bad).unwrap_err();
        assert!(e.to_string().starts_with("bad option magic 0x49484156454f5055"), "{e}");
        let long = OptionHeader { option: 99, length: MAX_OPTION_DATA + 1 };
        assert_eq!(
            long.validate().unwrap_err(),
            WireError::OptionTooLong { option: 99, length: MAX_OPTION_DATA + 1, max: MAX_OPTION_DATA }
        );
        OptionHeader { option: 99, length: MAX_OPTION_DATA }.validate().unwrap();
    }

    #[test]
    fn option_reply_layout() {
        let r = OptionReply { option: OPT_LIST, reply: REP_ERR_UNSUP, length: 5 };
        let b = r.encode();
        assert_eq!(b[..8], 0x3e889045565a9u64.to_be_bytes());
        assert_eq!(b[8..12], [0, 0, 0, 3]);
        assert_eq!(b[12..16], [0x80, 0, 0, 1]);
        assert_eq!(b[16..20], [0, 0, 0, 5]);
        let back = OptionReply::decode(&b).unwrap();
        assert_eq!(back, r);
        assert!(back.is_error());
        assert!(!OptionReply { option: 1, reply: REP_ACK, length: 0 }.is_error());
    }

    #[test]
    fn info_request_decodes_and_refuses_bad_lengths() {
        let r = InfoRequest { name: b"vol0".to_vec(), requests: vec![INFO_BLOCK_SIZE, INFO_NAME] };
        let data = r.encode();
        assert_eq!(data.len(), 4 + 4 + 2 + 4);
        assert_eq!(InfoRequest::decode("NBD_OPT_GO", &data).unwrap(), r);
        let empty = InfoRequest { name: vec![], requests: vec![] };
        assert_eq!(InfoRequest::decode("NBD_OPT_GO", &empty.encode()).unwrap(), empty);
        // Too short, a name running past the end, a count that disagrees.
        for (data, want) in [
            (vec![0u8; 5], "shorter than the 6 bytes"),
            ([&[0, 0, 0, 9][..], b"vol0", &[0, 0]].concat(), "name length 9"),
            ([&[0, 0, 0, 4][..], b"vol0", &[0, 2, 0, 3]].concat(), "2 information requests need 4 bytes, 2 follow"),
            ([&[0, 0, 0, 4][..], b"vol0", &[0, 0, 0]].concat(), "0 information requests need 0 bytes, 1 follow"),
            ([&[0xff, 0xff, 0xff, 0xff][..], &[0, 0]].concat(), "name length 4294967295"),
        ] {
            let e = InfoRequest::decode("NBD_OPT_INFO", &data).unwrap_err().to_string();
            assert!(e.starts_with("NBD_OPT_INFO data of") && e.contains(want), "{e}");
        }
    }

    #[test]
    fn export_info_and_block_sizes() {
        let info = ExportInfo { size: 1 << 30, flags: TFLAG_HAS_FLAGS | TFLAG_SEND_FLUSH };
        let b = info.encode_info();
        assert_eq!(b[..2], [0, 0]);
        assert_eq!(ExportInfo::decode_info(&b), Some(info));
        assert_eq!(ExportInfo::decode_info(&b[..11]), None);
        let padded = info.encode_export_name(false);
        assert_eq!(padded.len(), 134);
        assert!(padded[10..].iter().all(|&x| x == 0));
        assert_eq!(info.encode_export_name(true), b[2..].to_vec());

        let sizes = BlockSizes { minimum: 4096, preferred: 4096, maximum: 1 << 20 };
        sizes.validate().unwrap();
        let b = sizes.encode_info();
        assert_eq!(b[..2], [0, 3]);
        assert_eq!(BlockSizes::decode_info(&b), Some(sizes));
        BlockSizes { minimum: 512, preferred: 4096, maximum: 4096 }.validate().unwrap();
        BlockSizes { minimum: 1, preferred: 512, maximum: 0xffff_ffff }.validate().unwrap();
        for bad in [
            BlockSizes { minimum: 3000, preferred: 4096, maximum: 1 << 20 },
            BlockSizes { minimum: 1 << 17, preferred: 1 << 17, maximum: 1 << 20 },
            BlockSizes { minimum: 4096, preferred: 2048, maximum: 1 << 20 },
            BlockSizes { minimum: 1, preferred: 256, maximum: 1 << 20 },
            BlockSizes { minimum: 512, preferred: 4096, maximum: 2048 },
        ] {
            let e = bad.validate().unwrap_err();
            assert!(e.to_string().starts_with("block sizes minimum"), "{e}");
        }
    }

    #[test]
    fn request_round_trip_and_layout() {
        let r = Request {
            flags: CMD_FLAG_FUA,
            command: Command::Write,
            cookie: 0x0102030405060708,
            offset: 4096,
            length: 512,
        };
        let b = r.encode();
        assert_eq!(b[..4], [0x25, 0x60, 0x95, 0x13]);
        assert_eq!(b[4..8], [0, 1, 0, 1]);
        assert_eq!(b[8..16], [1, 2, 3, 4, 5, 6, 7, 8]);
        assert_eq!(b[16..24], 4096u64.to_be_bytes());
        assert_eq!(b[24..28], 512u32.to_be_bytes());
        assert_eq!(Request::decode(&b).unwrap(), r);
        assert_eq!(r.payload_len(), 512);
        assert_eq!(Request { command: Command::Read, ..r }.payload_len(), 0);
        for t in 0..10u16 {
            assert_eq!(Command::from_wire(t).to_wire(), t);
        }
        assert_eq!(Command::from_wire(5), Command::Other(5));
        let mut bad = b;
        bad[0] = 0x67; // a reply's magic is no request
        let e = Request::decode(&bad).unwrap_err();
        assert_eq!(e.to_string(), "bad request magic 0x67609513 (expected 0x25609513)");
    }

    #[test]
    fn request_validation() {
        let max = 1 << 20;
        let req = |command, flags, length| Request { flags, command, cookie: 1, offset: 0, length };
        for ok in [
            req(Command::Read, 0, max),
            req(Command::Read, CMD_FLAG_FUA, 4096),
            req(Command::Write, CMD_FLAG_FUA, max),
            req(Command::Flush, 0, 0),
            req(Command::Trim, CMD_FLAG_FUA, u32::MAX),
            req(Command::WriteZeroes, CMD_FLAG_NO_HOLE | CMD_FLAG_FUA, u32::MAX),
            req(Command::Disc, 0, 0),
        ] {
            ok.validate(max).unwrap_or_else(|e| panic!("{ok:?}: {e}"));
        }
        assert_eq!(req(Command::Other(7), 0, 0).validate(max), Err(RequestError::UnknownCommand(7)));
        assert_eq!(
            req(Command::Write, CMD_FLAG_NO_HOLE, 4096).validate(max),
            Err(RequestError::BadFlags { command: Command::Write, flags: CMD_FLAG_NO_HOLE })
        );
        assert!(req(Command::Read, CMD_FLAG_DF, 4096).validate(max).is_err());
        assert!(req(Command::WriteZeroes, CMD_FLAG_FAST_ZERO, 4096).validate(max).is_err());
        assert!(req(Command::Read, 1 << 15, 4096).validate(max).is_err());
        let e = req(Command::Read, 0, max + 1).validate(max).unwrap_err();
        assert!(!e.is_fatal());
        assert_eq!(e.to_string(), "NBD_CMD_READ of 1048577 bytes is longer than the 1048576 bytes this server serves");
        let e = req(Command::Write, 0, max + 1).validate(max).unwrap_err();
        assert!(e.is_fatal(), "a write's payload that is not served cannot be skipped: {e}");
        assert!(req(Command::Write, 0, u32::MAX).validate(MAX_PAYLOAD).unwrap_err().is_fatal());
        req(Command::Write, 0, MAX_PAYLOAD).validate(MAX_PAYLOAD).unwrap();
        // Refused for its flags, a write stays in step: its payload is read and dropped.
        assert!(!req(Command::Write, CMD_FLAG_NO_HOLE, MAX_PAYLOAD).validate(MAX_PAYLOAD).unwrap_err().is_fatal());
    }

    #[test]
    fn simple_reply_layout() {
        let r = SimpleReply { error: NBD_EPERM, cookie: 42 };
        let b = r.encode();
        assert_eq!(b[..4], [0x67, 0x44, 0x66, 0x98]);
        assert_eq!(b[4..8], [0, 0, 0, 1]);
        assert_eq!(SimpleReply::decode(&b).unwrap(), r);
        assert!(SimpleReply::decode(&[0u8; 16]).is_err());
    }

    #[test]
    fn names() {
        assert_eq!(option_name(OPT_GO), "NBD_OPT_GO");
        assert_eq!(option_name(4000), "option 4000");
        assert_eq!(Command::Other(9).to_string(), "command 9");
        assert_eq!(Command::WriteZeroes.to_string(), "NBD_CMD_WRITE_ZEROES");
    }
}
