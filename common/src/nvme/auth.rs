//! NVMe in-band authentication, DH-HMAC-CHAP (NVMe Base Specification 2.0,
//! section 8.13): the secrets (`DHHC-1:` as nvme-cli's `gen-dhchap-key`
//! writes them), the key transformation, the responses, the finite-field
//! Diffie-Hellman groups of RFC 7919, and the messages the Authentication
//! Send and Receive commands (Fabrics types 0x05 and 0x06) carry.
//!
//! Pure code: no I/O, no state. The target's per-queue state machine is
//! `target-daemon/src/nvmf/auth_cmd.rs`; the system tests' host
//! (`tests/src/nvme_tcp.rs`) drives the host side with the same functions.
//!
//! The formulas, as the specification gives them and Linux
//! (`drivers/nvme/common/auth.c`, `drivers/nvme/target/auth.c`) computes them:
//!
//! - secret: `DHHC-1:<hh>:<base64(key || crc32(key) little-endian)>:`, `hh`
//!   the hash the key is transformed with (00: none, 01: SHA-256, 02:
//!   SHA-384, 03: SHA-512), the key 32, 48 or 64 bytes;
//! - transformed key: `Kh' = HMAC(hh, key, NQN || "NVMe-over-Fabrics")`
//!   (the host's NQN for the host key, the subsystem's for the controller
//!   key), or the key itself when `hh` is 00;
//! - with a DH group, the challenge is augmented: `Ca = HMAC(H, H(g^xy mod p), C)`;
//! - host response `R1 = HMAC(H, Kh', C1 || S1 (LE32) || T_ID (LE16) || SC_C (0) ||
//!   "HostHost" || NQNh || 0x00 || NQNc)`;
//! - controller response `R2 = HMAC(H, Kc', C2 || S2 || T_ID || SC_C ||
//!   "Controller" || NQNc || 0x00 || NQNh)`,
//!
//! `H` being the hash the controller chose from the host's list.
//!
//! Messages (all little-endian; byte 0 AUTH-Type, 1 AUTH-Id, 4..6 T_ID):
//!
//! | message | bytes |
//! |---|---|
//! | AUTH_Negotiate (type 0, id 0x00) | 6 SC_C, 7 NAPD, then NAPD descriptors of 64 bytes: 0 AUTHID (1), 2 HALEN, 3 DHLEN, 4.. hash ids, 34.. DH group ids |
//! | DH-HMAC-CHAP_Challenge (1, 0x01) | 6 HL, 8 HASHID, 9 DHGID, 10..12 DHVLEN, 12..16 SEQNUM, 16.. C1 (HL), DH value (DHVLEN) |
//! | DH-HMAC-CHAP_Reply (1, 0x02) | 6 HL, 8 CVALID, 10..12 DHVLEN, 12..16 SEQNUM (S2), 16.. R1 (HL), C2 (HL), DH value |
//! | DH-HMAC-CHAP_Success1 (1, 0x03) | 6 HL, 8 RVALID, 16.. R2 (HL, if RVALID) |
//! | DH-HMAC-CHAP_Success2 (1, 0x04) | 16 bytes, T_ID only |
//! | AUTH_Failure2 / AUTH_Failure1 (0, 0xf0 / 0xf1) | 6 reason code (1), 7 explanation |

use std::fmt;
use std::sync::OnceLock;

use base64::engine::general_purpose::STANDARD as BASE64;
use base64::Engine as _;
use hmac::{Hmac, Mac};
use num_bigint::BigUint;
use rand::RngCore;
use sha2::{Digest, Sha256, Sha384, Sha512};

use super::{get_u16, get_u32, need, put_u16, put_u32, WireError};

/// SECP of Authentication Send/Receive: the DH-HMAC-CHAP protocol.
pub const SECP_DHCHAP: u8 = 0xe9;
/// SPSP0 and SPSP1 of Authentication Send/Receive.
pub const SPSP: u8 = 0x01;
/// Connect response dword 0, AUTHREQ.ATR: the host must authenticate
/// (bit 17, as Linux nvmet sets it and its host tests it).
pub const CONNECT_AUTHREQ_ATR: u64 = 1 << 17;
/// AUTHREQ.ASCR: secure channel concatenation required (never set here).
pub const CONNECT_AUTHREQ_ASCR: u64 = 1 << 18;

/// AUTH-Type.
pub mod auth_type {
    pub const COMMON: u8 = 0x00;
    pub const DHCHAP: u8 = 0x01;
}

/// AUTH-Id.
pub mod message {
    pub const NEGOTIATE: u8 = 0x00;
    pub const CHALLENGE: u8 = 0x01;
    pub const REPLY: u8 = 0x02;
    pub const SUCCESS1: u8 = 0x03;
    pub const SUCCESS2: u8 = 0x04;
    pub const FAILURE2: u8 = 0xf0;
    pub const FAILURE1: u8 = 0xf1;
}

/// AUTH_Failure reason code (byte 6): the only one defined.
pub const REASON_FAILED: u8 = 0x01;

/// AUTH_Failure reason code explanation (byte 7).
pub mod explanation {
    pub const FAILED: u8 = 0x01;
    pub const NOT_USABLE: u8 = 0x02;
    pub const CONCAT_MISMATCH: u8 = 0x03;
    pub const HASH_UNUSABLE: u8 = 0x04;
    pub const DHGROUP_UNUSABLE: u8 = 0x05;
    pub const INCORRECT_PAYLOAD: u8 = 0x06;
    pub const INCORRECT_MESSAGE: u8 = 0x07;

    /// The explanation in words, for logs.
    pub fn name(e: u8) -> &'static str {
        match e {
            FAILED => "authentication failed",
            NOT_USABLE => "authentication protocol not usable",
            CONCAT_MISMATCH => "secure channel concatenation mismatch",
            HASH_UNUSABLE => "hash function not usable",
            DHGROUP_UNUSABLE => "DH group not usable",
            INCORRECT_PAYLOAD => "incorrect payload",
            INCORRECT_MESSAGE => "incorrect protocol message",
            _ => "unknown explanation",
        }
    }
}

/// The AUTHID of a DH-HMAC-CHAP protocol descriptor.
pub const AUTHID_DHCHAP: u8 = 0x01;
/// Bytes of AUTH_Negotiate before its descriptors, and of one descriptor.
pub const NEGOTIATE_HEADER_SIZE: usize = 8;
pub const DESCRIPTOR_SIZE: usize = 64;
/// Hash and DH group ids a descriptor holds at most (HALEN, DHLEN).
pub const MAX_IDS: usize = 30;
/// Bytes of the Challenge, Reply, Success1 and Success2 headers.
pub const HEADER_SIZE: usize = 16;
/// Bytes of AUTH_Failure1/2.
pub const FAILURE_SIZE: usize = 8;
const _: () = assert!(NEGOTIATE_HEADER_SIZE + DESCRIPTOR_SIZE == 72 && 4 + 2 * MAX_IDS == DESCRIPTOR_SIZE);

/// The hash functions (HashID).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum HashId {
    Sha256 = 1,
    Sha384 = 2,
    Sha512 = 3,
}

impl HashId {
    pub const ALL: [HashId; 3] = [HashId::Sha256, HashId::Sha384, HashId::Sha512];

    pub fn from_id(id: u8) -> Option<HashId> {
        HashId::ALL.into_iter().find(|h| *h as u8 == id)
    }

    /// Its name in configuration files and logs: `sha256`, `sha384`, `sha512`.
    pub fn from_name(name: &str) -> Option<HashId> {
        HashId::ALL.into_iter().find(|h| h.name() == name)
    }

    pub fn name(self) -> &'static str {
        match self {
            HashId::Sha256 => "sha256",
            HashId::Sha384 => "sha384",
            HashId::Sha512 => "sha512",
        }
    }

    /// Digest length in bytes (HL).
    pub fn digest_len(self) -> usize {
        match self {
            HashId::Sha256 => 32,
            HashId::Sha384 => 48,
            HashId::Sha512 => 64,
        }
    }

    pub fn digest(self, data: &[u8]) -> Vec<u8> {
        match self {
            HashId::Sha256 => Sha256::digest(data).to_vec(),
            HashId::Sha384 => Sha384::digest(data).to_vec(),
            HashId::Sha512 => Sha512::digest(data).to_vec(),
        }
    }

    /// HMAC over the concatenation of `parts`.
    pub fn hmac(self, key: &[u8], parts: &[&[u8]]) -> Vec<u8> {
        macro_rules! run {
            ($h:ty) => {{
                // HMAC takes keys of any length: this cannot fail.
                let mut m = <Hmac<$h> as Mac>::new_from_slice(key).expect("HMAC accepts any key length");
                for p in parts {
                    m.update(p);
                }
                m.finalize().into_bytes().to_vec()
            }};
        }
        match self {
            HashId::Sha256 => run!(Sha256),
            HashId::Sha384 => run!(Sha384),
            HashId::Sha512 => run!(Sha512),
        }
    }
}

impl fmt::Display for HashId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The Diffie-Hellman groups (DHGID): none, or RFC 7919's FFDHE groups
/// (generator 2).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DhGroup {
    Null = 0,
    Ffdhe2048 = 1,
    Ffdhe3072 = 2,
    Ffdhe4096 = 3,
    Ffdhe6144 = 4,
    Ffdhe8192 = 5,
}

impl DhGroup {
    pub const ALL: [DhGroup; 6] =
        [DhGroup::Null, DhGroup::Ffdhe2048, DhGroup::Ffdhe3072, DhGroup::Ffdhe4096, DhGroup::Ffdhe6144, DhGroup::Ffdhe8192];

    pub fn from_id(id: u8) -> Option<DhGroup> {
        DhGroup::ALL.into_iter().find(|g| *g as u8 == id)
    }

    /// Its name in configuration files and logs: `null`, `ffdhe2048` ... `ffdhe8192`.
    pub fn from_name(name: &str) -> Option<DhGroup> {
        DhGroup::ALL.into_iter().find(|g| g.name() == name)
    }

    pub fn name(self) -> &'static str {
        match self {
            DhGroup::Null => "null",
            DhGroup::Ffdhe2048 => "ffdhe2048",
            DhGroup::Ffdhe3072 => "ffdhe3072",
            DhGroup::Ffdhe4096 => "ffdhe4096",
            DhGroup::Ffdhe6144 => "ffdhe6144",
            DhGroup::Ffdhe8192 => "ffdhe8192",
        }
    }

    /// Bytes of a DH value (DHVLEN): the prime's size; 0 for the NULL group.
    pub fn value_len(self) -> usize {
        match self {
            DhGroup::Null => 0,
            DhGroup::Ffdhe2048 => 256,
            DhGroup::Ffdhe3072 => 384,
            DhGroup::Ffdhe4096 => 512,
            DhGroup::Ffdhe6144 => 768,
            DhGroup::Ffdhe8192 => 1024,
        }
    }

    /// Bits of a private exponent: at least twice the group's security
    /// strength (RFC 7919, section 5.2), rounded up.
    fn exponent_bits(self) -> u64 {
        match self {
            DhGroup::Null => 0,
            DhGroup::Ffdhe2048 => 256,
            DhGroup::Ffdhe3072 => 320,
            DhGroup::Ffdhe4096 => 384,
            DhGroup::Ffdhe6144 => 448,
            DhGroup::Ffdhe8192 => 512,
        }
    }

    /// The group's prime; `None` for the NULL group.
    pub fn prime(self) -> Option<&'static BigUint> {
        static PRIMES: [OnceLock<BigUint>; 5] = [const { OnceLock::new() }; 5];
        let (i, hex) = match self {
            DhGroup::Null => return None,
            DhGroup::Ffdhe2048 => (0, FFDHE2048),
            DhGroup::Ffdhe3072 => (1, FFDHE3072),
            DhGroup::Ffdhe4096 => (2, FFDHE4096),
            DhGroup::Ffdhe6144 => (3, FFDHE6144),
            DhGroup::Ffdhe8192 => (4, FFDHE8192),
        };
        Some(PRIMES[i].get_or_init(|| BigUint::parse_bytes(hex.as_bytes(), 16).expect("RFC 7919 prime in hex")))
    }
}

impl fmt::Display for DhGroup {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

// ------------------------------------------------------------------ secrets

/// Why a `DHHC-1` secret was refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SecretError {
    #[error("is not a DH-HMAC-CHAP secret: expected DHHC-1:<00..03>:<base64>: (as `nvme gen-dhchap-key` writes)")]
    Format,
    #[error("names key transformation {0:?}; only 00 (none), 01 (SHA-256), 02 (SHA-384) and 03 (SHA-512) exist")]
    Transform(String),
    #[error("the base64 part does not decode: {0}")]
    Base64(String),
    #[error("holds {0} bytes; a secret is 32, 48 or 64 bytes plus a 4-byte CRC")]
    Length(usize),
    #[error("CRC-32 of the key is {computed:#010x}, the secret says {stored:#010x} (a mistyped or truncated secret)")]
    Crc { stored: u32, computed: u32 },
    #[error("is transformed with {hash} but holds a {len}-byte key; a {hash} key is {want} bytes")]
    KeyForHash { hash: HashId, len: usize, want: usize },
}

/// A DH-HMAC-CHAP secret: the key and the hash it is transformed with
/// (`None`: used as it is). Its `Debug` shows no key byte.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret {
    transform: Option<HashId>,
    key: Vec<u8>,
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Secret({} bytes, transform {:?})", self.key.len(), self.transform.map(HashId::name))
    }
}

impl Secret {
    /// A secret of `key` (32, 48 or 64 bytes), transformed with `transform`.
    pub fn new(transform: Option<HashId>, key: Vec<u8>) -> Result<Secret, SecretError> {
        if ![32, 48, 64].contains(&key.len()) {
            return Err(SecretError::Length(key.len()));
        }
        if let Some(h) = transform {
            // Linux keys its HMAC with as many bytes of the transformed key
            // as the key has: only a key of the hash's length means the same
            // on both sides (nvme-cli's gen-dhchap-key makes no other).
            if key.len() != h.digest_len() {
                return Err(SecretError::KeyForHash { hash: h, len: key.len(), want: h.digest_len() });
            }
        }
        Ok(Secret { transform, key })
    }

    /// A fresh random secret (OS entropy), as `nvme gen-dhchap-key` makes.
    pub fn generate(transform: Option<HashId>) -> Secret {
        let mut key = vec![0u8; transform.map_or(32, HashId::digest_len)];
        rand::rngs::OsRng.fill_bytes(&mut key);
        Secret { transform, key }
    }

    /// Parses `DHHC-1:hh:<base64>:` (surrounding whitespace ignored, the
    /// final colon optional as Linux takes it).
    pub fn parse(text: &str) -> Result<Secret, SecretError> {
        let text = text.trim();
        let rest = text.strip_prefix("DHHC-1:").ok_or(SecretError::Format)?;
        let (hh, rest) = rest.split_once(':').ok_or(SecretError::Format)?;
        let b64 = rest.strip_suffix(':').unwrap_or(rest);
        if b64.contains(':') || b64.is_empty() {
            return Err(SecretError::Format);
        }
        let transform = match hh {
            "00" => None,
            "01" => Some(HashId::Sha256),
            "02" => Some(HashId::Sha384),
            "03" => Some(HashId::Sha512),
            other => return Err(SecretError::Transform(other.to_owned())),
        };
        let raw = BASE64.decode(b64).map_err(|e| SecretError::Base64(e.to_string()))?;
        if ![36, 52, 68].contains(&raw.len()) {
            return Err(SecretError::Length(raw.len()));
        }
        let (key, crc) = raw.split_at(raw.len() - 4);
        let stored = u32::from_le_bytes(crc.try_into().expect("4 bytes"));
        let computed = crc32fast::hash(key);
        if stored != computed {
            return Err(SecretError::Crc { stored, computed });
        }
        Secret::new(transform, key.to_vec())
    }

    /// The text form, `DHHC-1:hh:<base64>:`.
    pub fn encode(&self) -> String {
        let mut raw = self.key.clone();
        raw.extend_from_slice(&crc32fast::hash(&self.key).to_le_bytes());
        format!("DHHC-1:{:02x}:{}:", self.transform.map_or(0, |h| h as u8), BASE64.encode(raw))
    }

    pub fn transform(&self) -> Option<HashId> {
        self.transform
    }

    /// The transformed key for `nqn` (the host's NQN for a host secret,
    /// the subsystem's for a controller secret).
    pub fn transformed(&self, nqn: &str) -> Vec<u8> {
        match self.transform {
            None => self.key.clone(),
            Some(h) => h.hmac(&self.key, &[nqn.as_bytes(), b"NVMe-over-Fabrics"]),
        }
    }
}

// ------------------------------------------------------------------ responses

/// The challenge a response is computed over: `c` itself, or, with a DH
/// group, `HMAC(H, H(session_key), c)`.
pub fn augmented_challenge(hash: HashId, session_key: Option<&[u8]>, c: &[u8]) -> Vec<u8> {
    match session_key {
        None => c.to_vec(),
        Some(k) => hash.hmac(&hash.digest(k), &[c]),
    }
}

/// The host's response R1 over challenge `c1` (augmented already, if a DH
/// group is used).
pub fn host_response(hash: HashId, key: &[u8], c1: &[u8], s1: u32, tid: u16, host_nqn: &str, subsys_nqn: &str) -> Vec<u8> {
    hash.hmac(
        key,
        &[c1, &s1.to_le_bytes(), &tid.to_le_bytes(), &[0], b"HostHost", host_nqn.as_bytes(), &[0], subsys_nqn.as_bytes()],
    )
}

/// The controller's response R2 over challenge `c2` (augmented already).
pub fn controller_response(hash: HashId, key: &[u8], c2: &[u8], s2: u32, tid: u16, host_nqn: &str, subsys_nqn: &str) -> Vec<u8> {
    hash.hmac(
        key,
        &[c2, &s2.to_le_bytes(), &tid.to_le_bytes(), &[0], b"Controller", subsys_nqn.as_bytes(), &[0], host_nqn.as_bytes()],
    )
}

/// Compares two responses in time independent of where they differ.
pub fn same_response(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Fresh random bytes (OS entropy): a challenge.
pub fn random_bytes(len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    rand::rngs::OsRng.fill_bytes(&mut v);
    v
}

/// A fresh nonzero sequence number.
pub fn random_seqnum() -> u32 {
    loop {
        let s = rand::rngs::OsRng.next_u32();
        if s != 0 {
            return s;
        }
    }
}

// ------------------------------------------------------------------ Diffie-Hellman

/// Why a peer's DH value was refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum DhError {
    #[error("the DH value is {got} bytes; {group} values are {want}")]
    Length { group: DhGroup, got: usize, want: usize },
    #[error("the DH value is not in 2..p-2 of {0}")]
    OutOfRange(DhGroup),
    #[error("the NULL DH group has no values")]
    NullGroup,
}

/// One side's ephemeral DH key: the private exponent (its `Debug` shows
/// none of it) and the public value `g^x mod p`, big-endian, as long as the prime.
pub struct DhKey {
    group: DhGroup,
    x: BigUint,
    public: Vec<u8>,
}

impl fmt::Debug for DhKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "DhKey({})", self.group)
    }
}

fn padded(v: &BigUint, len: usize) -> Vec<u8> {
    let b = v.to_bytes_be();
    let mut out = vec![0u8; len.saturating_sub(b.len())];
    out.extend_from_slice(&b);
    out
}

impl DhKey {
    /// A fresh key in `group` (not the NULL group). Costs one modular
    /// exponentiation: milliseconds for the large groups, so a reactor
    /// hands it to a worker.
    pub fn generate(group: DhGroup) -> Result<DhKey, DhError> {
        let p = group.prime().ok_or(DhError::NullGroup)?;
        let bits = group.exponent_bits();
        let mut bytes = vec![0u8; (bits / 8) as usize];
        rand::rngs::OsRng.fill_bytes(&mut bytes);
        bytes[0] |= 0x80;
        let x = BigUint::from_bytes_be(&bytes);
        Ok(DhKey::from_exponent(group, p, x))
    }

    fn from_exponent(group: DhGroup, p: &BigUint, x: BigUint) -> DhKey {
        let public = padded(&BigUint::from(2u32).modpow(&x, p), group.value_len());
        DhKey { group, x, public }
    }

    /// A key of a given exponent (test vectors).
    pub fn with_exponent(group: DhGroup, x: &[u8]) -> Result<DhKey, DhError> {
        let p = group.prime().ok_or(DhError::NullGroup)?;
        Ok(DhKey::from_exponent(group, p, BigUint::from_bytes_be(x)))
    }

    pub fn group(&self) -> DhGroup {
        self.group
    }

    /// `g^x mod p`, big-endian, as long as the prime.
    pub fn public(&self) -> &[u8] {
        &self.public
    }

    /// The shared secret `peer^x mod p`, big-endian, as long as the prime
    /// (as Linux's kpp writes it): the session key the challenges are
    /// augmented with. The peer's value must be as long as the prime and
    /// within 2..p-2.
    pub fn shared(&self, peer: &[u8]) -> Result<Vec<u8>, DhError> {
        let p = self.group.prime().ok_or(DhError::NullGroup)?;
        let want = self.group.value_len();
        if peer.len() != want {
            return Err(DhError::Length { group: self.group, got: peer.len(), want });
        }
        let y = BigUint::from_bytes_be(peer);
        let two = BigUint::from(2u32);
        if y < two || y > p - &two {
            return Err(DhError::OutOfRange(self.group));
        }
        Ok(padded(&y.modpow(&self.x, p), want))
    }
}

// ------------------------------------------------------------------ messages

const WHAT: &str = "authentication message";

/// AUTH_Negotiate with one DH-HMAC-CHAP protocol descriptor (NAPD 1, as
/// Linux sends and nvmet requires).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Negotiate {
    pub tid: u16,
    /// SC_C: secure channel concatenation asked for (0: none).
    pub sc_c: u8,
    /// Hash and DH group ids offered, in the host's order (unknown ids kept).
    pub hashes: Vec<u8>,
    pub dh_groups: Vec<u8>,
}

/// DH-HMAC-CHAP_Challenge.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Challenge {
    pub tid: u16,
    pub hash: HashId,
    pub dh_group: DhGroup,
    pub seqnum: u32,
    pub c1: Vec<u8>,
    pub dh_value: Vec<u8>,
}

/// DH-HMAC-CHAP_Reply.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Reply {
    pub tid: u16,
    pub response: Vec<u8>,
    /// C2 when the host asks the controller to authenticate too (CVALID).
    pub c2: Option<Vec<u8>>,
    /// S2 (0 when there is no C2).
    pub seqnum: u32,
    pub dh_value: Vec<u8>,
}

/// DH-HMAC-CHAP_Success1: HL, and R2 when the host sent a C2.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Success1 {
    pub tid: u16,
    pub hl: u8,
    pub response: Option<Vec<u8>>,
}

/// One authentication message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Message {
    Negotiate(Negotiate),
    Challenge(Challenge),
    Reply(Reply),
    Success1(Success1),
    Success2 { tid: u16 },
    /// AUTH_Failure1 (controller to host) or AUTH_Failure2 (host to
    /// controller): `first` tells which; reason code and explanation.
    Failure { first: bool, tid: u16, reason: u8, explanation: u8 },
}

fn bad(field: &'static str, value: u64) -> WireError {
    WireError::InvalidField { what: WHAT, field, value }
}

impl Message {
    /// The message's T_ID.
    pub fn tid(&self) -> u16 {
        match self {
            Message::Negotiate(m) => m.tid,
            Message::Challenge(m) => m.tid,
            Message::Reply(m) => m.tid,
            Message::Success1(m) => m.tid,
            Message::Success2 { tid } | Message::Failure { tid, .. } => *tid,
        }
    }

    /// Its AUTH-Id (byte 1).
    pub fn id(&self) -> u8 {
        match self {
            Message::Negotiate(_) => message::NEGOTIATE,
            Message::Challenge(_) => message::CHALLENGE,
            Message::Reply(_) => message::REPLY,
            Message::Success1(_) => message::SUCCESS1,
            Message::Success2 { .. } => message::SUCCESS2,
            Message::Failure { first: true, .. } => message::FAILURE1,
            Message::Failure { first: false, .. } => message::FAILURE2,
        }
    }

    /// Decodes and validates one message: its length against what its
    /// header announces, the hash and group ids, HL against the hash.
    /// Bytes past the message (a longer transfer) are ignored.
    pub fn decode(b: &[u8]) -> Result<Message, WireError> {
        need(WHAT, b, FAILURE_SIZE)?;
        let tid = get_u16(b, 4);
        match (b[0], b[1]) {
            (auth_type::COMMON, message::NEGOTIATE) => {
                need(WHAT, b, NEGOTIATE_HEADER_SIZE + DESCRIPTOR_SIZE)?;
                if b[7] != 1 {
                    return Err(bad("NAPD", b[7] as u64));
                }
                let d = &b[NEGOTIATE_HEADER_SIZE..NEGOTIATE_HEADER_SIZE + DESCRIPTOR_SIZE];
                if d[0] != AUTHID_DHCHAP {
                    return Err(bad("AUTHID", d[0] as u64));
                }
                let (halen, dhlen) = (d[2] as usize, d[3] as usize);
                if halen > MAX_IDS {
                    return Err(bad("HALEN", halen as u64));
                }
                if dhlen > MAX_IDS {
                    return Err(bad("DHLEN", dhlen as u64));
                }
                Ok(Message::Negotiate(Negotiate {
                    tid,
                    sc_c: b[6],
                    hashes: d[4..4 + halen].to_vec(),
                    dh_groups: d[4 + MAX_IDS..4 + MAX_IDS + dhlen].to_vec(),
                }))
            }
            (auth_type::COMMON, id @ (message::FAILURE1 | message::FAILURE2)) => {
                Ok(Message::Failure { first: id == message::FAILURE1, tid, reason: b[6], explanation: b[7] })
            }
            (auth_type::DHCHAP, id @ (message::CHALLENGE | message::REPLY | message::SUCCESS1 | message::SUCCESS2)) => {
                need(WHAT, b, HEADER_SIZE)?;
                let hl = b[6] as usize;
                let dhvlen = get_u16(b, 10) as usize;
                match id {
                    message::CHALLENGE => {
                        let hash = HashId::from_id(b[8]).ok_or(bad("HASHID", b[8] as u64))?;
                        let dh_group = DhGroup::from_id(b[9]).ok_or(bad("DHGID", b[9] as u64))?;
                        if hl != hash.digest_len() {
                            return Err(bad("HL", hl as u64));
                        }
                        if dhvlen != dh_group.value_len() {
                            return Err(bad("DHVLEN", dhvlen as u64));
                        }
                        need(WHAT, b, HEADER_SIZE + hl + dhvlen)?;
                        let at = HEADER_SIZE;
                        Ok(Message::Challenge(Challenge {
                            tid,
                            hash,
                            dh_group,
                            seqnum: get_u32(b, 12),
                            c1: b[at..at + hl].to_vec(),
                            dh_value: b[at + hl..at + hl + dhvlen].to_vec(),
                        }))
                    }
                    message::REPLY => {
                        if ![32, 48, 64].contains(&hl) {
                            return Err(bad("HL", hl as u64));
                        }
                        need(WHAT, b, HEADER_SIZE + 2 * hl + dhvlen)?;
                        let at = HEADER_SIZE;
                        let cvalid = b[8] & 1 != 0;
                        Ok(Message::Reply(Reply {
                            tid,
                            response: b[at..at + hl].to_vec(),
                            c2: cvalid.then(|| b[at + hl..at + 2 * hl].to_vec()),
                            seqnum: get_u32(b, 12),
                            dh_value: b[at + 2 * hl..at + 2 * hl + dhvlen].to_vec(),
                        }))
                    }
                    message::SUCCESS1 => {
                        if ![32, 48, 64].contains(&hl) {
                            return Err(bad("HL", hl as u64));
                        }
                        let rvalid = b[8] & 1 != 0;
                        if rvalid {
                            need(WHAT, b, HEADER_SIZE + hl)?;
                        }
                        let response = rvalid.then(|| b[HEADER_SIZE..HEADER_SIZE + hl].to_vec());
                        Ok(Message::Success1(Success1 { tid, hl: hl as u8, response }))
                    }
                    _ => Ok(Message::Success2 { tid }),
                }
            }
            (t, id) => Err(bad("AUTH-Type/AUTH-Id", (t as u64) << 8 | id as u64)),
        }
    }

    /// The message's bytes.
    pub fn encode(&self) -> Vec<u8> {
        let (t, size) = match self {
            Message::Negotiate(_) => (auth_type::COMMON, NEGOTIATE_HEADER_SIZE + DESCRIPTOR_SIZE),
            Message::Failure { .. } => (auth_type::COMMON, FAILURE_SIZE),
            Message::Challenge(m) => (auth_type::DHCHAP, HEADER_SIZE + m.c1.len() + m.dh_value.len()),
            Message::Reply(m) => (auth_type::DHCHAP, HEADER_SIZE + 2 * m.response.len() + m.dh_value.len()),
            Message::Success1(m) => (auth_type::DHCHAP, HEADER_SIZE + m.response.as_ref().map_or(0, Vec::len)),
            Message::Success2 { .. } => (auth_type::DHCHAP, HEADER_SIZE),
        };
        let mut b = vec![0u8; size];
        b[0] = t;
        b[1] = self.id();
        put_u16(&mut b, 4, self.tid());
        match self {
            Message::Negotiate(m) => {
                b[6] = m.sc_c;
                b[7] = 1;
                let d = &mut b[NEGOTIATE_HEADER_SIZE..];
                d[0] = AUTHID_DHCHAP;
                let (h, g) = (m.hashes.len().min(MAX_IDS), m.dh_groups.len().min(MAX_IDS));
                d[2] = h as u8;
                d[3] = g as u8;
                d[4..4 + h].copy_from_slice(&m.hashes[..h]);
                d[4 + MAX_IDS..4 + MAX_IDS + g].copy_from_slice(&m.dh_groups[..g]);
            }
            Message::Failure { reason, explanation, .. } => {
                b[6] = *reason;
                b[7] = *explanation;
            }
            Message::Challenge(m) => {
                b[6] = m.c1.len() as u8;
                b[8] = m.hash as u8;
                b[9] = m.dh_group as u8;
                put_u16(&mut b, 10, m.dh_value.len() as u16);
                put_u32(&mut b, 12, m.seqnum);
                let hl = m.c1.len();
                b[HEADER_SIZE..HEADER_SIZE + hl].copy_from_slice(&m.c1);
                b[HEADER_SIZE + hl..].copy_from_slice(&m.dh_value);
            }
            Message::Reply(m) => {
                let hl = m.response.len();
                b[6] = hl as u8;
                b[8] = m.c2.is_some() as u8;
                put_u16(&mut b, 10, m.dh_value.len() as u16);
                put_u32(&mut b, 12, m.seqnum);
                b[HEADER_SIZE..HEADER_SIZE + hl].copy_from_slice(&m.response);
                if let Some(c2) = &m.c2 {
                    b[HEADER_SIZE + hl..HEADER_SIZE + hl + c2.len().min(hl)].copy_from_slice(&c2[..c2.len().min(hl)]);
                }
                b[HEADER_SIZE + 2 * hl..].copy_from_slice(&m.dh_value);
            }
            Message::Success1(m) => {
                b[6] = m.hl;
                if let Some(r) = &m.response {
                    b[8] = 1;
                    b[HEADER_SIZE..].copy_from_slice(r);
                }
            }
            Message::Success2 { .. } => {}
        }
        b
    }
}

const FFDHE2048: &str = concat!(
    "FFFFFFFFFFFFFFFFADF85458A2BB4A9AAFDC5620273D3CF1D8B9C583CE2D3695A9E13641146433FBCC939DCE249B3EF97D2FE363630C75D8F681B202AEC4617A",
    "D3DF1ED5D5FD65612433F51F5F066ED0856365553DED1AF3B557135E7F57C935984F0C70E0E68B77E2A689DAF3EFE8721DF158A136ADE73530ACCA4F483A797A",
    "BC0AB182B324FB61D108A94BB2C8E3FBB96ADAB760D7F4681D4F42A3DE394DF4AE56EDE76372BB190B07A7C8EE0A6D709E02FCE1CDF7E2ECC03404CD28342F61",
    "9172FE9CE98583FF8E4F1232EEF28183C3FE3B1B4C6FAD733BB5FCBC2EC22005C58EF1837D1683B2C6F34A26C1B2EFFA886B423861285C97FFFFFFFFFFFFFFFF",
);

const FFDHE3072: &str = concat!(
    "FFFFFFFFFFFFFFFFADF85458A2BB4A9AAFDC5620273D3CF1D8B9C583CE2D3695A9E13641146433FBCC939DCE249B3EF97D2FE363630C75D8F681B202AEC4617A",
    "D3DF1ED5D5FD65612433F51F5F066ED0856365553DED1AF3B557135E7F57C935984F0C70E0E68B77E2A689DAF3EFE8721DF158A136ADE73530ACCA4F483A797A",
    "BC0AB182B324FB61D108A94BB2C8E3FBB96ADAB760D7F4681D4F42A3DE394DF4AE56EDE76372BB190B07A7C8EE0A6D709E02FCE1CDF7E2ECC03404CD28342F61",
    "9172FE9CE98583FF8E4F1232EEF28183C3FE3B1B4C6FAD733BB5FCBC2EC22005C58EF1837D1683B2C6F34A26C1B2EFFA886B4238611FCFDCDE355B3B6519035B",
    "BC34F4DEF99C023861B46FC9D6E6C9077AD91D2691F7F7EE598CB0FAC186D91CAEFE130985139270B4130C93BC437944F4FD4452E2D74DD364F2E21E71F54BFF",
    "5CAE82AB9C9DF69EE86D2BC522363A0DABC521979B0DEADA1DBF9A42D5C4484E0ABCD06BFA53DDEF3C1B20EE3FD59D7C25E41D2B66C62E37FFFFFFFFFFFFFFFF",
);

const FFDHE4096: &str = concat!(
    "FFFFFFFFFFFFFFFFADF85458A2BB4A9AAFDC5620273D3CF1D8B9C583CE2D3695A9E13641146433FBCC939DCE249B3EF97D2FE363630C75D8F681B202AEC4617A",
    "D3DF1ED5D5FD65612433F51F5F066ED0856365553DED1AF3B557135E7F57C935984F0C70E0E68B77E2A689DAF3EFE8721DF158A136ADE73530ACCA4F483A797A",
    "BC0AB182B324FB61D108A94BB2C8E3FBB96ADAB760D7F4681D4F42A3DE394DF4AE56EDE76372BB190B07A7C8EE0A6D709E02FCE1CDF7E2ECC03404CD28342F61",
    "9172FE9CE98583FF8E4F1232EEF28183C3FE3B1B4C6FAD733BB5FCBC2EC22005C58EF1837D1683B2C6F34A26C1B2EFFA886B4238611FCFDCDE355B3B6519035B",
    "BC34F4DEF99C023861B46FC9D6E6C9077AD91D2691F7F7EE598CB0FAC186D91CAEFE130985139270B4130C93BC437944F4FD4452E2D74DD364F2E21E71F54BFF",
    "5CAE82AB9C9DF69EE86D2BC522363A0DABC521979B0DEADA1DBF9A42D5C4484E0ABCD06BFA53DDEF3C1B20EE3FD59D7C25E41D2B669E1EF16E6F52C3164DF4FB",
    "7930E9E4E58857B6AC7D5F42D69F6D187763CF1D5503400487F55BA57E31CC7A7135C886EFB4318AED6A1E012D9E6832A907600A918130C46DC778F971AD0038",
    "092999A333CB8B7A1A1DB93D7140003C2A4ECEA9F98D0ACC0A8291CDCEC97DCF8EC9B55A7F88A46B4DB5A851F44182E1C68A007E5E655F6AFFFFFFFFFFFFFFFF",
);

const FFDHE6144: &str = concat!(
    "FFFFFFFFFFFFFFFFADF85458A2BB4A9AAFDC5620273D3CF1D8B9C583CE2D3695A9E13641146433FBCC939DCE249B3EF97D2FE363630C75D8F681B202AEC4617A",
    "D3DF1ED5D5FD65612433F51F5F066ED0856365553DED1AF3B557135E7F57C935984F0C70E0E68B77E2A689DAF3EFE8721DF158A136ADE73530ACCA4F483A797A",
    "BC0AB182B324FB61D108A94BB2C8E3FBB96ADAB760D7F4681D4F42A3DE394DF4AE56EDE76372BB190B07A7C8EE0A6D709E02FCE1CDF7E2ECC03404CD28342F61",
    "9172FE9CE98583FF8E4F1232EEF28183C3FE3B1B4C6FAD733BB5FCBC2EC22005C58EF1837D1683B2C6F34A26C1B2EFFA886B4238611FCFDCDE355B3B6519035B",
    "BC34F4DEF99C023861B46FC9D6E6C9077AD91D2691F7F7EE598CB0FAC186D91CAEFE130985139270B4130C93BC437944F4FD4452E2D74DD364F2E21E71F54BFF",
    "5CAE82AB9C9DF69EE86D2BC522363A0DABC521979B0DEADA1DBF9A42D5C4484E0ABCD06BFA53DDEF3C1B20EE3FD59D7C25E41D2B669E1EF16E6F52C3164DF4FB",
    "7930E9E4E58857B6AC7D5F42D69F6D187763CF1D5503400487F55BA57E31CC7A7135C886EFB4318AED6A1E012D9E6832A907600A918130C46DC778F971AD0038",
    "092999A333CB8B7A1A1DB93D7140003C2A4ECEA9F98D0ACC0A8291CDCEC97DCF8EC9B55A7F88A46B4DB5A851F44182E1C68A007E5E0DD9020BFD64B645036C7A",
    "4E677D2C38532A3A23BA4442CAF53EA63BB454329B7624C8917BDD64B1C0FD4CB38E8C334C701C3ACDAD0657FCCFEC719B1F5C3E4E46041F388147FB4CFDB477",
    "A52471F7A9A96910B855322EDB6340D8A00EF092350511E30ABEC1FFF9E3A26E7FB29F8C183023C3587E38DA0077D9B4763E4E4B94B2BBC194C6651E77CAF992",
    "EEAAC0232A281BF6B3A739C1226116820AE8DB5847A67CBEF9C9091B462D538CD72B03746AE77F5E62292C311562A846505DC82DB854338AE49F5235C95B9117",
    "8CCF2DD5CACEF403EC9D1810C6272B045B3B71F9DC6B80D63FDD4A8E9ADB1E6962A69526D43161C1A41D570D7938DAD4A40E329CD0E40E65FFFFFFFFFFFFFFFF",
);

const FFDHE8192: &str = concat!(
    "FFFFFFFFFFFFFFFFADF85458A2BB4A9AAFDC5620273D3CF1D8B9C583CE2D3695A9E13641146433FBCC939DCE249B3EF97D2FE363630C75D8F681B202AEC4617A",
    "D3DF1ED5D5FD65612433F51F5F066ED0856365553DED1AF3B557135E7F57C935984F0C70E0E68B77E2A689DAF3EFE8721DF158A136ADE73530ACCA4F483A797A",
    "BC0AB182B324FB61D108A94BB2C8E3FBB96ADAB760D7F4681D4F42A3DE394DF4AE56EDE76372BB190B07A7C8EE0A6D709E02FCE1CDF7E2ECC03404CD28342F61",
    "9172FE9CE98583FF8E4F1232EEF28183C3FE3B1B4C6FAD733BB5FCBC2EC22005C58EF1837D1683B2C6F34A26C1B2EFFA886B4238611FCFDCDE355B3B6519035B",
    "BC34F4DEF99C023861B46FC9D6E6C9077AD91D2691F7F7EE598CB0FAC186D91CAEFE130985139270B4130C93BC437944F4FD4452E2D74DD364F2E21E71F54BFF",
    "5CAE82AB9C9DF69EE86D2BC522363A0DABC521979B0DEADA1DBF9A42D5C4484E0ABCD06BFA53DDEF3C1B20EE3FD59D7C25E41D2B669E1EF16E6F52C3164DF4FB",
    "7930E9E4E58857B6AC7D5F42D69F6D187763CF1D5503400487F55BA57E31CC7A7135C886EFB4318AED6A1E012D9E6832A907600A918130C46DC778F971AD0038",
    "092999A333CB8B7A1A1DB93D7140003C2A4ECEA9F98D0ACC0A8291CDCEC97DCF8EC9B55A7F88A46B4DB5A851F44182E1C68A007E5E0DD9020BFD64B645036C7A",
    "4E677D2C38532A3A23BA4442CAF53EA63BB454329B7624C8917BDD64B1C0FD4CB38E8C334C701C3ACDAD0657FCCFEC719B1F5C3E4E46041F388147FB4CFDB477",
    "A52471F7A9A96910B855322EDB6340D8A00EF092350511E30ABEC1FFF9E3A26E7FB29F8C183023C3587E38DA0077D9B4763E4E4B94B2BBC194C6651E77CAF992",
    "EEAAC0232A281BF6B3A739C1226116820AE8DB5847A67CBEF9C9091B462D538CD72B03746AE77F5E62292C311562A846505DC82DB854338AE49F5235C95B9117",
    "8CCF2DD5CACEF403EC9D1810C6272B045B3B71F9DC6B80D63FDD4A8E9ADB1E6962A69526D43161C1A41D570D7938DAD4A40E329CCFF46AAA36AD004CF600C838",
    "1E425A31D951AE64FDB23FCEC9509D43687FEB69EDD1CC5E0B8CC3BDF64B10EF86B63142A3AB8829555B2F747C932665CB2C0F1CC01BD70229388839D2AF05E4",
    "54504AC78B7582822846C0BA35C35F5C59160CC046FD8251541FC68C9C86B022BB7099876A460E7451A8A93109703FEE1C217E6C3826E52C51AA691E0E423CFC",
    "99E9E31650C1217B624816CDAD9A95F9D5B8019488D9C0A0A1FE3075A577E23183F81D4A3F2FA4571EFC8CE0BA8A4FE8B6855DFE72B0A66EDED2FBABFBE58A30",
    "FAFABE1C5D71A87E2F741EF8C1FE86FEA6BBFDE530677F0D97D11D49F7A8443D0822E506A9F4614E011E2A94838FF88CD68C8BB7C5C6424CFFFFFFFFFFFFFFFF",
);

#[cfg(test)]
mod tests {
    use super::*;

    // The vectors were computed with an independent implementation of the
    // formulas above (Python's hmac, hashlib, zlib.crc32, base64 and pow,
    // following NVMe Base 2.0 section 8.13.5 and Linux's
    // nvme_auth_transform_key / nvmet_auth_host_hash / nvmet_auth_ctrl_hash),
    // over the inputs below; the primes are OpenSSL 3.0's ffdhe groups.
    const HOST: &str = "nqn.2014-08.org.nvmexpress:uuid:00000000-0000-0000-0000-000000000001";
    const SUB: &str = "nqn.2024-01.io.rdmablk:target";
    const S1: u32 = 0x1234_5678;
    const S2: u32 = 0x9abc_def0;
    const TID: u16 = 0x0102;

    fn hex(b: &[u8]) -> String {
        b.iter().map(|x| format!("{x:02x}")).collect()
    }

    fn seq(start: u8, len: usize) -> Vec<u8> {
        (0..len).map(|i| start.wrapping_add(i as u8)).collect()
    }

    struct Vector {
        transform: Option<HashId>,
        secret: &'static str,
        kh: &'static str,
        r1: &'static str,
        r2: &'static str,
    }

    const VECTORS: [Vector; 4] = [
        Vector {
            transform: Some(HashId::Sha256),
            secret: "DHHC-1:01:AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh+KfiaR:",
            kh: "6c7b81cb2a746f74454b1d7140f3153b51ca99459fcef7a86a17f27695b87cd8",
            r1: "0e2c6e3ab45d421733427dc210625fc77fc179f3465d7fb3ed61c3149b93756a",
            r2: "9584e5307ee49224643ad2c7e92112d63091b2e1c000a30296bbe7de70cd11e0",
        },
        Vector {
            transform: Some(HashId::Sha384),
            secret: "DHHC-1:02:AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8gISIjJCUmJygpKissLS4vcSEgBQ==:",
            kh: "c916f39d7bd438ac94ce98f12f22202c6bc43b1b1bf7f081a36fd76d11b4b1730726ff75f32576b5749cfa06d1a7b4f5",
            r1: "e5857c5399f048ad0132a652b7f5a74f3d6049e95abf13402506a08f6c49e131b3794e2f1a7578d9dcc9b636c1c95f0e",
            r2: "90e6661e51f8c14bdbd58dfbcf8808a2d122a11af3d33f97914c93a8e2ddfed8a5c2a610e5e20afb4b75b579ec4108c8",
        },
        Vector {
            transform: Some(HashId::Sha512),
            secret: "DHHC-1:03:AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8gISIjJCUmJygpKissLS4vMDEyMzQ1Njc4OTo7PD0+P4zODhA=:",
            kh: "5da79d3888c5ddac507b097840c4c8af8c7099e3f32fbf216209d24103f54bcf22284e7034bb579a8997475f50aec0bff3ccad184563779e81f48c405071b970",
            r1: "596d363b859446a43322359ec12b1708e15e12aca804f5f0377376fae363235c7708a912e35d8020847a80abe95b91db3f7cb4fc502720ee5d28fbf3fad19e28",
            r2: "df8029771a84fde098eb9941cec49c4a5c1c13cb4305ef7a94fdc98ffc88e8cd307fd1f356d0590f536cd1efd747605a1a9d90c0253a2d17805960c95207d8eb",
        },
        // No transformation: the key itself keys the HMAC (SHA-256 chosen).
        Vector {
            transform: None,
            secret: "DHHC-1:00:AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh+KfiaR:",
            kh: "000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f",
            r1: "4bd25810697743a0d3cfb8850f60f5684bdb28893226a303acc9d9134a1cb2a8",
            r2: "4f0a860c563af5d2fa430b72e74337444f0d5fa580060fb60f082567f0141e9b",
        },
    ];

    #[test]
    fn secrets_transformed_keys_and_responses_match_the_vectors() {
        for v in &VECTORS {
            let hash = v.transform.unwrap_or(HashId::Sha256);
            let s = Secret::parse(v.secret).expect(v.secret);
            assert_eq!(s.transform(), v.transform);
            assert_eq!(s.encode(), v.secret, "encode is parse's inverse");
            let kh = s.transformed(HOST);
            assert_eq!(hex(&kh), v.kh, "{}", v.secret);
            let r1 = host_response(hash, &kh, &seq(0xa0, hash.digest_len()), S1, TID, HOST, SUB);
            assert_eq!(hex(&r1), v.r1, "{}", v.secret);
            // The controller key is transformed with the subsystem's NQN.
            let kc = s.transformed(SUB);
            let r2 = controller_response(hash, &kc, &seq(0x50, hash.digest_len()), S2, TID, HOST, SUB);
            assert_eq!(hex(&r2), v.r2, "{}", v.secret);
        }
    }

    #[test]
    fn a_response_changes_with_every_input() {
        let kh = Secret::parse(VECTORS[0].secret).unwrap().transformed(HOST);
        let c = seq(0xa0, 32);
        let r = host_response(HashId::Sha256, &kh, &c, S1, TID, HOST, SUB);
        assert_ne!(r, host_response(HashId::Sha256, &kh, &seq(0xa1, 32), S1, TID, HOST, SUB));
        assert_ne!(r, host_response(HashId::Sha256, &kh, &c, S1 + 1, TID, HOST, SUB));
        assert_ne!(r, host_response(HashId::Sha256, &kh, &c, S1, TID + 1, HOST, SUB));
        assert_ne!(r, host_response(HashId::Sha256, &kh, &c, S1, TID, SUB, HOST));
        assert_ne!(r, controller_response(HashId::Sha256, &kh, &c, S1, TID, HOST, SUB), "roles differ");
        assert!(same_response(&r, &r.clone()) && !same_response(&r, &r[..31]));
    }

    #[test]
    fn bad_secrets_are_refused_with_the_reason() {
        let good = VECTORS[0].secret;
        assert_eq!(Secret::parse("DHHC-2:01:AAAA:"), Err(SecretError::Format));
        assert_eq!(Secret::parse("00:AAAA:"), Err(SecretError::Format));
        assert!(matches!(Secret::parse(&good.replace(":01:", ":04:")), Err(SecretError::Transform(t)) if t == "04"));
        assert!(matches!(Secret::parse(&good.replace("AAEC", "AA!C")), Err(SecretError::Base64(_))));
        // One character changed: the CRC catches it.
        assert!(matches!(Secret::parse(&good.replace("AAEC", "AAED")), Err(SecretError::Crc { .. })));
        // A 48-byte key announced as SHA-256.
        assert!(matches!(Secret::parse(&VECTORS[1].secret.replace(":02:", ":01:")), Err(SecretError::KeyForHash { .. })));
        // Whitespace around it and a missing final colon are accepted, as Linux does.
        assert!(Secret::parse(&format!("  {}\n", good.trim_end_matches(':'))).is_ok());
        let g = Secret::generate(Some(HashId::Sha384));
        assert_eq!(Secret::parse(&g.encode()), Ok(g.clone()));
        assert!(!format!("{g:?}").contains(&hex(&g.key)[..8]), "Debug shows no key byte");
    }

    #[test]
    fn ffdhe2048_values_and_the_augmented_challenge_match_the_vectors() {
        let a = DhKey::with_exponent(DhGroup::Ffdhe2048, &seq(1, 32)).unwrap();
        let b = DhKey::with_exponent(DhGroup::Ffdhe2048, &seq(101, 32)).unwrap();
        assert_eq!(a.public().len(), 256);
        assert_eq!(hex(&HashId::Sha256.digest(a.public())), "53b37a098c5882b9f56495d787706d354ac8ebc273e680a7047c70228ce24ad3");
        let sk = a.shared(b.public()).unwrap();
        assert_eq!(sk, b.shared(a.public()).unwrap(), "both sides agree");
        assert_eq!(hex(&HashId::Sha256.digest(&sk)), "a85e4e22b45f65ac6f13b6023d09a5013f8fcd0d68682577dffa25e6be8e82eb");
        let aug = augmented_challenge(HashId::Sha256, Some(&sk), &seq(0xa0, 32));
        assert_eq!(hex(&aug), "0e894006e02e18b6a855ec6df34f3381527fa8af26634a3abc3af3fb833b4877");
        assert_eq!(augmented_challenge(HashId::Sha256, None, &seq(0xa0, 32)), seq(0xa0, 32));
    }

    #[test]
    fn peer_dh_values_outside_the_group_are_refused() {
        let a = DhKey::generate(DhGroup::Ffdhe2048).unwrap();
        let p = DhGroup::Ffdhe2048.prime().unwrap();
        let mut one = vec![0u8; 256];
        one[255] = 1;
        assert_eq!(a.shared(&one), Err(DhError::OutOfRange(DhGroup::Ffdhe2048)));
        let p_minus_1 = padded(&(p - 1u32), 256);
        assert_eq!(a.shared(&p_minus_1), Err(DhError::OutOfRange(DhGroup::Ffdhe2048)));
        assert!(matches!(a.shared(&[2u8; 255]), Err(DhError::Length { .. })));
        assert_eq!(DhKey::generate(DhGroup::Null).err(), Some(DhError::NullGroup));
    }

    #[test]
    fn the_primes_are_rfc_7919s() {
        // Every FFDHE prime starts with 64 one bits and the same digits of
        // e, ends with 64 one bits, and has the group's size.
        for g in DhGroup::ALL.into_iter().skip(1) {
            let p = g.prime().unwrap();
            assert_eq!(p.bits() as usize, g.value_len() * 8, "{g}");
            let b = p.to_bytes_be();
            assert_eq!(hex(&b[..16]), "ffffffffffffffffadf85458a2bb4a9a", "{g}");
            assert_eq!(b[b.len() - 8..], [0xff; 8], "{g}");
        }
        // ffdhe2048 is a safe prime with 2 generating the subgroup of order q:
        // 2^q = 1 mod p for q = (p - 1) / 2.
        let p = DhGroup::Ffdhe2048.prime().unwrap();
        let q: BigUint = (p - 1u32) >> 1;
        assert_eq!(BigUint::from(2u32).modpow(&q, p), BigUint::from(1u32));
    }

    #[test]
    fn messages_round_trip_and_linux_layouts_hold() {
        let neg = Message::Negotiate(Negotiate { tid: 7, sc_c: 0, hashes: vec![1, 2, 3], dh_groups: vec![0, 1, 2, 3, 4, 5] });
        let b = neg.encode();
        assert_eq!(b.len(), 72);
        assert_eq!((b[0], b[1], b[4], b[7], b[8], b[10], b[11]), (0, 0, 7, 1, 1, 3, 6));
        assert_eq!((&b[12..15], &b[42..48]), (&[1u8, 2, 3][..], &[0u8, 1, 2, 3, 4, 5][..]), "idlist[0..] and idlist[30..]");
        assert_eq!(Message::decode(&b), Ok(neg));
        let ch = Message::Challenge(Challenge {
            tid: 7,
            hash: HashId::Sha384,
            dh_group: DhGroup::Ffdhe2048,
            seqnum: S1,
            c1: seq(0, 48),
            dh_value: seq(9, 256),
        });
        let b = ch.encode();
        assert_eq!((b.len(), b[6], b[8], b[9], get_u16(&b, 10), get_u32(&b, 12)), (16 + 48 + 256, 48, 2, 1, 256, S1));
        // A longer transfer (the host's buffer) decodes the same.
        let mut longer = b.clone();
        longer.resize(4096, 0);
        assert_eq!(Message::decode(&longer), Ok(ch));
        let rep = Message::Reply(Reply { tid: 7, response: seq(1, 32), c2: Some(seq(2, 32)), seqnum: S2, dh_value: vec![] });
        let b = rep.encode();
        assert_eq!((b.len(), b[8], get_u32(&b, 12)), (80, 1, S2));
        assert_eq!(Message::decode(&b), Ok(rep));
        let one_way = Message::Reply(Reply { tid: 7, response: seq(1, 32), c2: None, seqnum: 0, dh_value: vec![] });
        assert_eq!(Message::decode(&one_way.encode()), Ok(one_way));
        for m in [
            Message::Success1(Success1 { tid: 7, hl: 32, response: Some(seq(3, 32)) }),
            Message::Success1(Success1 { tid: 7, hl: 32, response: None }),
            Message::Success2 { tid: 7 },
            Message::Failure { first: true, tid: 7, reason: REASON_FAILED, explanation: explanation::FAILED },
            Message::Failure { first: false, tid: 7, reason: REASON_FAILED, explanation: explanation::FAILED },
        ] {
            assert_eq!(Message::decode(&m.encode()), Ok(m));
        }
        let f = Message::Failure { first: true, tid: 7, reason: REASON_FAILED, explanation: 6 }.encode();
        assert_eq!(f, [0, 0xf1, 0, 0, 7, 0, 1, 6]);
    }

    #[test]
    fn malformed_messages_are_refused() {
        let neg = Message::Negotiate(Negotiate { tid: 7, sc_c: 0, hashes: vec![1], dh_groups: vec![0] }).encode();
        assert!(matches!(Message::decode(&neg[..71]), Err(WireError::Truncated { .. })));
        let mut b = neg.clone();
        b[7] = 2;
        assert!(matches!(Message::decode(&b), Err(WireError::InvalidField { field: "NAPD", .. })));
        let mut b = neg.clone();
        b[10] = 31;
        assert!(matches!(Message::decode(&b), Err(WireError::InvalidField { field: "HALEN", .. })));
        let rep = Message::Reply(Reply { tid: 7, response: seq(1, 32), c2: None, seqnum: 0, dh_value: seq(0, 256) }).encode();
        assert!(matches!(Message::decode(&rep[..rep.len() - 1]), Err(WireError::Truncated { .. })));
        let mut b = rep.clone();
        b[6] = 33;
        assert!(matches!(Message::decode(&b), Err(WireError::InvalidField { field: "HL", .. })));
        assert!(matches!(Message::decode(&[1, 9, 0, 0, 0, 0, 0, 0]), Err(WireError::InvalidField { .. })));
    }
}
