//! Host authentication: pre-shared keys, key files and the HMAC-SHA256
//! challenge-response transcript that both ends compute.
//!
//! The exchange (documented in `docs/PROTOCOL.md`, "Authentication") follows
//! the idea of NVMe in-band authentication (DH-HMAC-CHAP, without the DH
//! part): each side sends a fresh random nonce, and each side proves it holds
//! the key with an HMAC over a transcript that binds both nonces, both
//! identities (host id, target name), the session the queue pair creates or
//! joins, and a direction label, so that one side's proof can never be played
//! back as the other's, and nothing that crosses the wire can be replayed on
//! another queue pair (the other side's nonce will differ). The key itself
//! never crosses the wire.
//!
//! This module has no state machine: the target (`rdmablk-target`'s `auth`
//! module) and the initiator (`rdmablk-initiator`'s `auth` module) drive
//! the exchange and call [`mac`] / [`verify`] here, so both compute exactly
//! the same bytes.

use std::fmt;
use std::io::{Read, Write};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use hmac::{Hmac, Mac};
use rand::RngCore;
use sha2::Sha256;

use crate::protocol::{SessionId, PROTOCOL_VERSION};

/// Bytes of each side's nonce.
pub const NONCE_LEN: usize = 32;
/// Bytes of an HMAC-SHA256 tag.
pub const MAC_LEN: usize = 32;
/// Shortest key accepted (256 bits).
pub const MIN_KEY_LEN: usize = 32;
/// Longest key accepted.
pub const MAX_KEY_LEN: usize = 64;
/// Bytes of a key written by [`generate_key_file`].
pub const GENERATED_KEY_LEN: usize = 32;
/// Length of the direction label field at the start of the MAC input.
pub const LABEL_LEN: usize = 32;
/// Label of the initiator's proof (NUL padded to [`LABEL_LEN`]).
pub const INITIATOR_LABEL: &str = "rdmablk-v1 auth initiator proof";
/// Label of the target's proof (NUL padded to [`LABEL_LEN`]).
pub const TARGET_LABEL: &str = "rdmablk-v1 auth target proof";

const _: () = assert!(INITIATOR_LABEL.len() <= LABEL_LEN && TARGET_LABEL.len() <= LABEL_LEN);

/// A nonce: 32 bytes from the operating system's CSPRNG, one per side and
/// per exchange.
pub type Nonce = [u8; NONCE_LEN];
/// An HMAC-SHA256 tag.
pub type MacTag = [u8; MAC_LEN];

/// Who proves: the label that keeps one side's MAC from being accepted as
/// the other side's.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Direction {
    /// The initiator proves it holds the key (sent in AUTH_REPLY).
    Initiator,
    /// The target proves it holds the key (the reply to AUTH_REPLY).
    Target,
}

impl Direction {
    fn label(self) -> &'static str {
        match self {
            Direction::Initiator => INITIATOR_LABEL,
            Direction::Target => TARGET_LABEL,
        }
    }
}

/// Everything both MACs cover besides the direction.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Transcript<'a> {
    /// The host id the initiator claims (AUTH_NEGOTIATE's inline data).
    pub host_id: &'a str,
    /// The target's name (in the AUTH challenge).
    pub target_name: &'a str,
    /// The session the queue pair's CONNECT will create (0) or join.
    pub session_id: SessionId,
    /// The initiator's nonce (AUTH_REPLY).
    pub initiator_nonce: &'a Nonce,
    /// The target's nonce (the AUTH challenge).
    pub target_nonce: &'a Nonce,
}

impl Transcript<'_> {
    /// The exact bytes the MAC of `direction` covers:
    ///
    /// | bytes | field |
    /// |---|---|
    /// | 32 | direction label, ASCII, NUL padded |
    /// | 2 | protocol version, u16 LE |
    /// | 2 + n | host id length (u16 LE) and UTF-8 bytes |
    /// | 2 + m | target name length (u16 LE) and UTF-8 bytes |
    /// | 8 | session id, u64 LE |
    /// | 32 | initiator nonce |
    /// | 32 | target nonce |
    pub fn message(&self, direction: Direction) -> Vec<u8> {
        let mut m = Vec::with_capacity(LABEL_LEN + 2 + 2 + self.host_id.len() + 2 + self.target_name.len() + 8 + 64);
        let mut label = [0u8; LABEL_LEN];
        label[..direction.label().len()].copy_from_slice(direction.label().as_bytes());
        m.extend_from_slice(&label);
        m.extend_from_slice(&PROTOCOL_VERSION.to_le_bytes());
        for field in [self.host_id, self.target_name] {
            // Both are at most a few hundred bytes (checked by the protocol).
            let len = u16::try_from(field.len()).unwrap_or(u16::MAX);
            m.extend_from_slice(&len.to_le_bytes());
            m.extend_from_slice(&field.as_bytes()[..len as usize]);
        }
        m.extend_from_slice(&self.session_id.0.to_le_bytes());
        m.extend_from_slice(self.initiator_nonce);
        m.extend_from_slice(self.target_nonce);
        m
    }
}

/// A pre-shared host key: 32 to 64 secret bytes. `Debug` does not show it.
#[derive(Clone, PartialEq, Eq)]
pub struct AuthKey {
    bytes: Vec<u8>,
}

impl fmt::Debug for AuthKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "AuthKey(<{} secret bytes>)", self.bytes.len())
    }
}

/// Why a key or a key file was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KeyError {
    /// The key has the wrong length.
    #[error("a key has {MIN_KEY_LEN} to {MAX_KEY_LEN} bytes, this one has {0}")]
    Length(usize),
    /// A key file problem: names the file.
    #[error("key file {}: {reason}", path.display())]
    File { path: PathBuf, reason: String },
}

impl AuthKey {
    /// A key from its bytes (32 to 64).
    pub fn new(bytes: &[u8]) -> Result<AuthKey, KeyError> {
        if !(MIN_KEY_LEN..=MAX_KEY_LEN).contains(&bytes.len()) {
            return Err(KeyError::Length(bytes.len()));
        }
        Ok(AuthKey { bytes: bytes.to_vec() })
    }

    /// Reads a key file (see [`parse_key_file`] for the format). Refuses a
    /// file that group or others may read or write, naming the file and its
    /// mode, like ssh does for private keys.
    pub fn from_file(path: &Path) -> Result<AuthKey, KeyError> {
        let err = |reason: String| KeyError::File { path: path.to_owned(), reason };
        let file = std::fs::File::open(path).map_err(|e| err(format!("cannot open: {e}")))?;
        // The permissions of the file actually opened (no window between check and read).
        let meta = file.metadata().map_err(|e| err(format!("cannot stat: {e}")))?;
        if !meta.is_file() {
            return Err(err("is not a regular file".into()));
        }
        let mode = meta.mode() & 0o7777;
        if mode & 0o077 != 0 {
            return Err(err(format!(
                "mode {mode:04o} lets group or others access it; a key file must be private to its owner \
                 (chmod 600 {})",
                path.display()
            )));
        }
        let mut text = String::new();
        file.take(4096).read_to_string(&mut text).map_err(|e| err(format!("cannot read: {e}")))?;
        parse_key_file(&text).map_err(err)
    }

    /// The secret bytes.
    pub fn bytes(&self) -> &[u8] {
        &self.bytes
    }

    fn hmac(&self) -> Hmac<Sha256> {
        // HMAC takes keys of any length: this cannot fail.
        <Hmac<Sha256> as Mac>::new_from_slice(&self.bytes).expect("HMAC accepts any key length")
    }
}

/// Parses the text of a key file: one line of hexadecimal digits (upper or
/// lower case) encoding 32 to 64 bytes, optionally followed by one newline.
/// Nothing else is allowed (no spaces, no comments), so that a truncated or
/// edited key is refused rather than silently shortened.
pub fn parse_key_file(text: &str) -> Result<AuthKey, String> {
    let line = text.strip_suffix('\n').unwrap_or(text);
    let line = line.strip_suffix('\r').unwrap_or(line);
    if line.is_empty() {
        return Err("is empty; expected one line of 64 to 128 hexadecimal digits".into());
    }
    if line.contains('\n') {
        return Err("has more than one line; expected one line of 64 to 128 hexadecimal digits".into());
    }
    if let Some(c) = line.chars().find(|c| !c.is_ascii_hexdigit()) {
        return Err(format!("contains {c:?}; expected only hexadecimal digits (64 to 128 of them)"));
    }
    if line.len() % 2 != 0 {
        return Err(format!("has {} hexadecimal digits, an odd number", line.len()));
    }
    let bytes: Vec<u8> = (0..line.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&line[i..i + 2], 16).expect("checked hex digits"))
        .collect();
    AuthKey::new(&bytes).map_err(|_| {
        format!(
            "holds {} bytes; a key has {MIN_KEY_LEN} to {MAX_KEY_LEN} bytes ({} to {} hexadecimal digits)",
            bytes.len(),
            2 * MIN_KEY_LEN,
            2 * MAX_KEY_LEN
        )
    })
}

/// Writes a new key file at `path`: 32 random bytes as 64 lowercase
/// hexadecimal digits and a newline, created with mode 0600. Refuses to
/// overwrite an existing file. Returns the key.
pub fn generate_key_file(path: &Path) -> Result<AuthKey, KeyError> {
    let err = |reason: String| KeyError::File { path: path.to_owned(), reason };
    let mut bytes = [0u8; GENERATED_KEY_LEN];
    rand::rngs::OsRng.fill_bytes(&mut bytes);
    let mut text: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
    text.push('\n');
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
        .map_err(|e| err(format!("cannot create: {e}")))?;
    // A umask only removes bits: the file is 0600 or stricter.
    file.write_all(text.as_bytes()).and_then(|()| file.sync_all()).map_err(|e| err(format!("cannot write: {e}")))?;
    AuthKey::new(&bytes).map_err(|e| err(e.to_string()))
}

/// A fresh nonce from the operating system's CSPRNG.
pub fn random_nonce() -> Nonce {
    let mut n = [0u8; NONCE_LEN];
    rand::rngs::OsRng.fill_bytes(&mut n);
    n
}

/// The MAC `direction`'s side sends: HMAC-SHA256(key, transcript message).
pub fn mac(key: &AuthKey, direction: Direction, transcript: &Transcript<'_>) -> MacTag {
    let mut h = key.hmac();
    h.update(&transcript.message(direction));
    h.finalize().into_bytes().into()
}

/// The MAC did not match: the peer does not hold the key, or the transcript
/// differs (a replayed or altered exchange).
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("authentication failed")]
pub struct MacMismatch;

/// Checks a received MAC in constant time ([`Mac::verify_slice`]).
pub fn verify(key: &AuthKey, direction: Direction, transcript: &Transcript<'_>, received: &[u8]) -> Result<(), MacMismatch> {
    let mut h = key.hmac();
    h.update(&transcript.message(direction));
    h.verify_slice(received).map_err(|_| MacMismatch)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key() -> AuthKey {
        AuthKey::new(&(0u8..32).collect::<Vec<_>>()).unwrap()
    }

    const NI: Nonce = [0xa5; 32];
    const NT: Nonce = [0x5a; 32];

    fn transcript() -> Transcript<'static> {
        Transcript {
            host_id: "host-a",
            target_name: "rdmablk",
            session_id: SessionId(0x1122_3344_5566_7788),
            initiator_nonce: &NI,
            target_nonce: &NT,
        }
    }

    fn hex(b: &[u8]) -> String {
        b.iter().map(|b| format!("{b:02x}")).collect()
    }

    /// Known answers computed independently with Python's hmac module:
    ///
    /// ```python
    /// import hmac, hashlib, struct
    /// key = bytes(range(32))
    /// def msg(label):
    ///     return (label.ljust(32, b"\0") + struct.pack("<H", 1)
    ///             + struct.pack("<H", 6) + b"host-a" + struct.pack("<H", 7) + b"rdmablk"
    ///             + struct.pack("<Q", 0x1122334455667788) + b"\xa5" * 32 + b"\x5a" * 32)
    /// for label in (b"rdmablk-v1 auth initiator proof", b"rdmablk-v1 auth target proof"):
    ///     print(hmac.new(key, msg(label), hashlib.sha256).hexdigest())
    /// ```
    const KAT_INITIATOR: &str = "e16e1ec4ca60db72f62ab6a91ced0815fe11fdc848c3de4b368075cec16559be";
    const KAT_TARGET: &str = "c747ccefbb3e1435117ba20ebbacba3fc3296fa3974864096e389a4f47c2f15c";

    #[test]
    fn known_answers() {
        assert_eq!(hex(&mac(&key(), Direction::Initiator, &transcript())), KAT_INITIATOR);
        assert_eq!(hex(&mac(&key(), Direction::Target, &transcript())), KAT_TARGET);
    }

    #[test]
    fn message_layout() {
        let m = transcript().message(Direction::Initiator);
        assert_eq!(m.len(), 32 + 2 + 2 + 6 + 2 + 7 + 8 + 32 + 32);
        assert_eq!(&m[..INITIATOR_LABEL.len()], INITIATOR_LABEL.as_bytes());
        assert!(m[INITIATOR_LABEL.len()..32].iter().all(|&b| b == 0));
        assert_eq!(&m[32..34], &PROTOCOL_VERSION.to_le_bytes());
    }

    #[test]
    fn the_right_mac_verifies_and_directions_differ() {
        let t = transcript();
        let mi = mac(&key(), Direction::Initiator, &t);
        let mt = mac(&key(), Direction::Target, &t);
        assert_ne!(mi, mt, "one side's proof is never the other's");
        assert_eq!(verify(&key(), Direction::Initiator, &t, &mi), Ok(()));
        assert_eq!(verify(&key(), Direction::Target, &t, &mt), Ok(()));
        assert_eq!(verify(&key(), Direction::Target, &t, &mi), Err(MacMismatch), "reflection");
        assert_eq!(verify(&key(), Direction::Initiator, &t, &mi[..31]), Err(MacMismatch), "truncated");
    }

    #[test]
    fn tampering_with_any_field_fails() {
        let t = transcript();
        let good = mac(&key(), Direction::Initiator, &t);
        let other_nonce: Nonce = [0x5b; 32];
        let mut flipped_ni = NI;
        flipped_ni[31] ^= 1;
        let cases: Vec<(&str, Transcript<'_>)> = vec![
            ("host id", Transcript { host_id: "host-b", ..t }),
            ("host id prefix", Transcript { host_id: "host-", ..t }),
            ("target name", Transcript { target_name: "rdmablk2", ..t }),
            ("session id", Transcript { session_id: SessionId(0x1122_3344_5566_7789), ..t }),
            ("new session", Transcript { session_id: SessionId(0), ..t }),
            ("initiator nonce", Transcript { initiator_nonce: &flipped_ni, ..t }),
            ("target nonce", Transcript { target_nonce: &other_nonce, ..t }),
            ("nonces swapped", Transcript { initiator_nonce: &NT, target_nonce: &NI, ..t }),
            // Moving bytes between the two names must change the message.
            ("boundary", Transcript { host_id: "host-ar", target_name: "dmablk", ..t }),
        ];
        for (what, tampered) in cases {
            assert_eq!(verify(&key(), Direction::Initiator, &tampered, &good), Err(MacMismatch), "{what}");
        }
        let other_key = AuthKey::new(&[7u8; 32]).unwrap();
        assert_eq!(verify(&other_key, Direction::Initiator, &t, &good), Err(MacMismatch), "key");
        for bit in 0..MAC_LEN * 8 {
            let mut bad = good;
            bad[bit / 8] ^= 1 << (bit % 8);
            assert_eq!(verify(&key(), Direction::Initiator, &t, &bad), Err(MacMismatch), "mac bit {bit}");
        }
    }

    #[test]
    fn key_file_format() {
        let hex64 = "00112233445566778899aabbccddeeff00112233445566778899AABBCCDDEEFF";
        assert_eq!(parse_key_file(hex64).unwrap().bytes().len(), 32);
        assert_eq!(parse_key_file(&format!("{hex64}\n")).unwrap().bytes()[31], 0xff);
        assert_eq!(parse_key_file(&format!("{hex64}{hex64}\n")).unwrap().bytes().len(), 64);
        assert!(parse_key_file("").unwrap_err().contains("empty"));
        assert!(parse_key_file(&hex64[..62]).unwrap_err().contains("31 bytes"));
        assert!(parse_key_file(&hex64[..63]).unwrap_err().contains("odd"));
        assert!(parse_key_file(&format!("{hex64}{hex64}00")).unwrap_err().contains("65 bytes"));
        assert!(parse_key_file(&format!(" {hex64}")).unwrap_err().contains("' '"));
        assert!(parse_key_file(&format!("{hex64}\n{hex64}\n")).unwrap_err().contains("more than one line"));
        assert!(AuthKey::new(&[1; 31]).is_err() && AuthKey::new(&[1; 65]).is_err());
        assert!(!format!("{:?}", key()).contains("01"), "Debug hides the key");
    }

    #[test]
    fn generated_key_files_are_private_and_readable() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile_dir();
        let path = dir.join("host.key");
        let k = generate_key_file(&path).unwrap();
        assert_eq!(std::fs::metadata(&path).unwrap().permissions().mode() & 0o777, 0o600);
        assert_eq!(AuthKey::from_file(&path).unwrap(), k);
        let text = std::fs::read_to_string(&path).unwrap();
        assert_eq!(text.len(), 65);
        assert!(generate_key_file(&path).is_err(), "never overwrites");
        let other = generate_key_file(&dir.join("other.key")).unwrap();
        assert_ne!(other, k, "random");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        let e = AuthKey::from_file(&path).unwrap_err().to_string();
        assert!(e.contains(&path.display().to_string()) && e.contains("0644"), "{e}");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o620)).unwrap();
        assert!(AuthKey::from_file(&path).unwrap_err().to_string().contains("0620"));
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o400)).unwrap();
        assert_eq!(AuthKey::from_file(&path).unwrap(), k);
        let e = AuthKey::from_file(&dir).unwrap_err().to_string();
        assert!(e.contains("regular file") || e.contains("mode"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    fn tempfile_dir() -> PathBuf {
        let dir = std::env::temp_dir().join(format!("rdmablk-auth-{}-{:x}", std::process::id(), rand::random::<u64>()));
        std::fs::create_dir(&dir).unwrap();
        dir
    }

    #[test]
    fn nonces_are_random() {
        assert_ne!(random_nonce(), random_nonce());
        assert_ne!(random_nonce(), [0u8; NONCE_LEN]);
    }
}
