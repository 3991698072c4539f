//! The target's side of host authentication and per-volume access control.
//!
//! - [`AccessPolicy`]: the `[[host]]` keys (read from their key files when a
//!   configuration is applied) and every volume's grants, published with the
//!   volume set, so a reload's new grants reach the next OPEN on every reactor.
//! - [`AuthState`]: one queue pair's progress through AUTH_NEGOTIATE and
//!   AUTH_REPLY (see `docs/PROTOCOL.md`, "Authentication"), driven by
//!   [`negotiate`], [`reply`] and checked by [`check_connect`].
//!
//! Every authentication failure reaches the initiator as the same status,
//! `AuthFailed` with detail 0, whatever the reason (unknown host id, no key,
//! wrong MAC, a replayed exchange); only the target's log says which.

use std::collections::HashMap;
use std::fmt;
use std::io::Read;
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::sync::Arc;

use rdmablk_common::auth::{self as wire_auth, AuthKey, Direction, Transcript};
use rdmablk_common::nvme::auth::{DhGroup, HashId, Secret};
use rdmablk_common::protocol::{
    AuthChallenge, AuthResponse, AuthSuccess, SessionId, AUTH_ALGORITHM_HMAC_SHA256, AUTH_CHALLENGE_SIZE,
    AUTH_SUCCESS_SIZE,
};

use crate::config::{Config, VolumeAccess};
use crate::error::{Error, ErrorKind, Result};

/// What a host may do with a volume.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Grant {
    ReadWrite,
    /// Reads only: OPEN reports the volume read-only, writes fail `ReadOnly`.
    ReadOnly,
}

/// Who is asking: the host id a queue pair sent, and whether it proved it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Identity<'a> {
    pub host_id: &'a str,
    pub authenticated: bool,
}

impl fmt::Display for Identity<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.authenticated {
            write!(f, "{}", self.host_id)
        } else {
            write!(f, "{} (unauthenticated)", self.host_id)
        }
    }
}

/// One volume's grants, as the per-command checks see them.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct VolumeGrants {
    pub allow_any_host: bool,
    pub allowed_hosts: Vec<String>,
    pub read_only_hosts: Vec<String>,
}

impl VolumeGrants {
    /// What `who` may do with this volume. `hosts_configured`: the target
    /// has `[[host]]` entries (then an unauthenticated queue pair, one that
    /// connected before a reload added hosts, gets nothing).
    pub fn grant(&self, who: Identity<'_>, hosts_configured: bool) -> Option<Grant> {
        if !who.authenticated {
            return (!hosts_configured && self.allow_any_host).then_some(Grant::ReadWrite);
        }
        if self.read_only_hosts.iter().any(|h| h == who.host_id) {
            return Some(Grant::ReadOnly);
        }
        (self.allow_any_host || self.allowed_hosts.iter().any(|h| h == who.host_id)).then_some(Grant::ReadWrite)
    }

    /// Why `who` got no grant, for the log.
    pub fn refusal(&self, who: Identity<'_>, hosts_configured: bool) -> &'static str {
        match (who.authenticated, hosts_configured) {
            (false, true) => "the queue pair is not authenticated and the target has [[host]] entries",
            (false, false) => "allow_any_host is not set and unauthenticated hosts cannot be named in allowed_hosts",
            (true, _) => "the host is not in allowed_hosts or read_only_hosts and allow_any_host is not set",
        }
    }
}

impl From<&VolumeAccess> for VolumeGrants {
    fn from(a: &VolumeAccess) -> Self {
        VolumeGrants {
            allow_any_host: a.allow_any_host,
            allowed_hosts: a.allowed_hosts.clone(),
            read_only_hosts: a.read_only_hosts.clone(),
        }
    }
}

/// The hosts' keys and the volumes' grants of one configuration.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AccessPolicy {
    /// `[[host]]` entries, with a key file or not.
    hosts: usize,
    keys: HashMap<String, AuthKey>,
    volumes: HashMap<String, VolumeGrants>,
    /// NVMe host NQN to `[[host]]` id (`nqn =`).
    host_nqns: HashMap<String, String>,
    /// NVMe host NQN to its DH-HMAC-CHAP secrets (`dhchap_key_file`).
    nvme_keys: HashMap<String, Arc<NvmeAuthKeys>>,
}

/// An NVMe host's DH-HMAC-CHAP secrets and the target's choices for it
/// (`[[host]] dhchap_*`): the host must authenticate on every queue.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NvmeAuthKeys {
    pub host: Secret,
    /// The controller's secret: the target proves it holds it when the host asks.
    pub ctrl: Option<Secret>,
    pub hash: HashId,
    pub dh_group: DhGroup,
}

/// Reads a secret file that only its owner may access (as the rdmablk key
/// files and ssh's private keys), naming the file and its mode otherwise.
fn read_private(path: &Path) -> std::result::Result<String, String> {
    let file = std::fs::File::open(path).map_err(|e| format!("{}: cannot open: {e}", path.display()))?;
    let meta = file.metadata().map_err(|e| format!("{}: cannot stat: {e}", path.display()))?;
    if !meta.is_file() {
        return Err(format!("{}: is not a regular file", path.display()));
    }
    let mode = meta.mode() & 0o7777;
    if mode & 0o077 != 0 {
        return Err(format!(
            "{}: mode {mode:04o} lets group or others access it; a secret must be private to its owner (chmod 600 {})",
            path.display(),
            path.display()
        ));
    }
    let mut text = String::new();
    file.take(4096).read_to_string(&mut text).map_err(|e| format!("{}: cannot read: {e}", path.display()))?;
    Ok(text)
}

fn read_secret(path: &Path) -> std::result::Result<Secret, String> {
    let text = read_private(path)?;
    Secret::parse(&text).map_err(|e| format!("{}: {e}", path.display()))
}

impl AccessPolicy {
    /// Reads every `[[host]]` key file of `config`. A key file that group or
    /// others may access, or that does not hold a key, is a configuration
    /// error naming the key (`host[N].key_file`), the file and its mode.
    pub fn load(config: &Config) -> Result<AccessPolicy> {
        let mut keys = HashMap::with_capacity(config.hosts.len());
        for h in &config.hosts {
            let Some(path) = &h.key_file else { continue };
            let key = AuthKey::from_file(path)
                .map_err(|e| Error::config(format!("{}: host[{}].key_file: {e}", config.source, h.index)))?;
            keys.insert(h.id.clone(), key);
        }
        let volumes = config.access.iter().map(|a| (a.volume.clone(), VolumeGrants::from(a))).collect();
        let host_nqns = config.hosts.iter().filter_map(|h| Some((h.nqn.clone()?, h.id.clone()))).collect();
        let mut nvme_keys = HashMap::new();
        for h in &config.hosts {
            let (Some(d), Some(nqn)) = (&h.dhchap, &h.nqn) else { continue };
            let err = |k: &str, e: String| Error::config(format!("{}: host[{}].{k}: {e}", config.source, h.index));
            let host = read_secret(&d.key_file).map_err(|e| err("dhchap_key_file", e))?;
            let ctrl = match &d.ctrl_key_file {
                Some(p) => Some(read_secret(p).map_err(|e| err("dhchap_ctrl_key_file", e))?),
                None => None,
            };
            nvme_keys.insert(nqn.clone(), Arc::new(NvmeAuthKeys { host, ctrl, hash: d.hash, dh_group: d.dh_group }));
        }
        Ok(AccessPolicy { hosts: config.hosts.len(), keys, volumes, host_nqns, nvme_keys })
    }

    /// A policy from parts (tests, library use).
    pub fn new(keys: HashMap<String, AuthKey>, volumes: HashMap<String, VolumeGrants>) -> AccessPolicy {
        AccessPolicy { hosts: keys.len(), keys, volumes, host_nqns: HashMap::new(), nvme_keys: HashMap::new() }
    }

    /// The DH-HMAC-CHAP secrets of NVMe host `nqn`, if it must authenticate.
    pub fn nvme_auth(&self, nqn: &str) -> Option<&Arc<NvmeAuthKeys>> {
        self.nvme_keys.get(nqn)
    }

    /// The `[[host]]` id whose `nqn` is `nqn`.
    pub fn host_for_nqn(&self, nqn: &str) -> Option<&str> {
        self.host_nqns.get(nqn).map(String::as_str)
    }

    /// Every volume open to any host and no `[[host]]`: how a target without
    /// access keys behaved before access control.
    pub fn open_to_all<'a>(volume_names: impl IntoIterator<Item = &'a str>) -> AccessPolicy {
        let all = VolumeGrants { allow_any_host: true, ..VolumeGrants::default() };
        AccessPolicy {
            hosts: 0,
            keys: HashMap::new(),
            volumes: volume_names.into_iter().map(|n| (n.to_owned(), all.clone())).collect(),
            host_nqns: HashMap::new(),
            nvme_keys: HashMap::new(),
        }
    }

    /// Whether CONNECT requires authentication, and an NVMe Connect a
    /// known host NQN (there are `[[host]]` entries).
    pub fn hosts_configured(&self) -> bool {
        self.hosts > 0
    }

    /// Number of `[[host]]` entries.
    pub fn host_count(&self) -> usize {
        self.hosts
    }

    /// The grants of volume `name` (none for a volume the configuration
    /// does not define, e.g. one a reload could not remove because it is open).
    pub fn volume(&self, name: &str) -> VolumeGrants {
        self.volumes.get(name).cloned().unwrap_or_default()
    }

    /// Keeps `grants` for volume `name`, which this configuration does not
    /// define but which stays served (a reload could not remove it because
    /// it is open): it keeps the grants it had, like the rest of it.
    pub fn keep_volume(&mut self, name: &str, grants: VolumeGrants) {
        self.volumes.entry(name.to_owned()).or_insert(grants);
    }

    /// Names of volumes whose grants differ between `self` and `other`, and
    /// whether the hosts or their keys changed.
    pub fn changes(&self, other: &AccessPolicy) -> (Vec<String>, bool) {
        let mut names: Vec<String> = self
            .volumes
            .keys()
            .chain(other.volumes.keys())
            .filter(|n| self.volumes.get(*n) != other.volumes.get(*n))
            .cloned()
            .collect();
        names.sort();
        names.dedup();
        (names, self.keys != other.keys || self.nvme_keys != other.nvme_keys)
    }

    fn key(&self, host_id: &str) -> Option<&AuthKey> {
        self.keys.get(host_id)
    }
}

/// One queue pair's authentication progress.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum AuthState {
    /// Nothing yet (or the last attempt failed).
    #[default]
    Idle,
    /// AUTH_NEGOTIATE answered with `target_nonce`; AUTH_REPLY expected.
    Challenged { host_id: String, session_id: SessionId, target_nonce: [u8; 32] },
    /// The initiator proved the key of `host_id` for joining/creating `session_id`.
    Authenticated { host_id: String, session_id: SessionId },
}

impl AuthState {
    /// The host this queue pair authenticated as.
    pub fn authenticated_host(&self) -> Option<&str> {
        match self {
            AuthState::Authenticated { host_id, .. } => Some(host_id),
            _ => None,
        }
    }
}

/// AUTH_NEGOTIATE: remembers the claimed host id and session and answers a
/// fresh challenge. It answers the same way for a host id the target does
/// not know (the failure comes at AUTH_REPLY, looking like a wrong key), so
/// that the exchange does not tell which host ids exist.
pub fn negotiate(state: &mut AuthState, host_id: &str, session_id: SessionId, target_name: &str) -> Result<[u8; AUTH_CHALLENGE_SIZE]> {
    let target_nonce = wire_auth::random_nonce();
    let challenge = AuthChallenge { algorithm: AUTH_ALGORITHM_HMAC_SHA256, target_nonce, target_name: target_name.to_owned() };
    let bytes = challenge
        .to_bytes()
        .map_err(|e| Error::new(ErrorKind::Internal, format!("cannot encode the auth challenge: {e}")))?;
    *state = AuthState::Challenged { host_id: host_id.to_owned(), session_id, target_nonce };
    Ok(bytes)
}

/// AUTH_REPLY: checks the initiator's proof and answers the target's. Any
/// failure leaves the queue pair [`AuthState::Idle`] (a new attempt needs a
/// new AUTH_NEGOTIATE, hence a new target nonce) and is an `AuthFailed`
/// error whose context (for the log only) says why.
pub fn reply(state: &mut AuthState, policy: &AccessPolicy, response: &AuthResponse, target_name: &str) -> Result<[u8; AUTH_SUCCESS_SIZE]> {
    let fail = |why: String| Error::new(ErrorKind::AuthFailed, why);
    let (host_id, session_id, target_nonce) = match std::mem::take(state) {
        AuthState::Challenged { host_id, session_id, target_nonce } => (host_id, session_id, target_nonce),
        AuthState::Idle => return Err(fail("AUTH_REPLY without a pending AUTH_NEGOTIATE".into())),
        AuthState::Authenticated { host_id, .. } => {
            return Err(fail(format!("AUTH_REPLY after host {host_id:?} had authenticated; a new AUTH_NEGOTIATE is needed")))
        }
    };
    let transcript = Transcript {
        host_id: &host_id,
        target_name,
        session_id,
        initiator_nonce: &response.initiator_nonce,
        target_nonce: &target_nonce,
    };
    let Some(key) = policy.key(&host_id) else {
        return Err(fail(format!("host {host_id:?} has no [[host]] entry")));
    };
    if wire_auth::verify(key, Direction::Initiator, &transcript, &response.mac).is_err() {
        return Err(fail(format!(
            "host {host_id:?}: the initiator's MAC does not match (wrong key, or a replayed or altered exchange)"
        )));
    }
    let proof = AuthSuccess { mac: wire_auth::mac(key, Direction::Target, &transcript) };
    *state = AuthState::Authenticated { host_id, session_id };
    Ok(proof.to_bytes())
}

/// CONNECT: with `[[host]]` entries, the queue pair must have authenticated
/// as `host_id` for exactly this session (`join`, or 0 for a new session);
/// otherwise `AuthRequired`. Returns whether the queue pair is authenticated.
pub fn check_connect(state: &AuthState, policy: &AccessPolicy, host_id: &str, join: Option<SessionId>) -> Result<bool> {
    let session = join.unwrap_or(SessionId(0));
    match state {
        AuthState::Authenticated { host_id: h, session_id } if h == host_id && *session_id == session => Ok(true),
        AuthState::Authenticated { host_id: h, session_id } if policy.hosts_configured() => Err(Error::new(
            ErrorKind::AuthRequired,
            format!(
                "CONNECT as host {host_id:?} for session {:#x}, but the queue pair authenticated as {h:?} for session {:#x}",
                session.0, session_id.0
            ),
        )),
        _ if policy.hosts_configured() => Err(Error::new(
            ErrorKind::AuthRequired,
            format!("host {host_id:?} sent CONNECT without authenticating; this target has [[host]] entries"),
        )),
        _ => Ok(false),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(b: u8) -> AuthKey {
        AuthKey::new(&[b; 32]).unwrap()
    }

    fn policy() -> AccessPolicy {
        let keys = HashMap::from([("a".to_owned(), key(1)), ("b".to_owned(), key(2))]);
        let volumes = HashMap::from([
            ("shared".to_owned(), VolumeGrants { allow_any_host: true, read_only_hosts: vec!["b".into()], ..Default::default() }),
            ("a-only".to_owned(), VolumeGrants { allowed_hosts: vec!["a".into()], ..Default::default() }),
            ("nobody".to_owned(), VolumeGrants::default()),
        ]);
        AccessPolicy::new(keys, volumes)
    }

    fn who(host_id: &str, authenticated: bool) -> Identity<'_> {
        Identity { host_id, authenticated }
    }

    #[test]
    fn grants() {
        let p = policy();
        let g = |v: &str, w| p.volume(v).grant(w, p.hosts_configured());
        assert_eq!(g("shared", who("a", true)), Some(Grant::ReadWrite));
        assert_eq!(g("shared", who("b", true)), Some(Grant::ReadOnly), "read_only_hosts wins over allow_any_host");
        assert_eq!(g("shared", who("a", false)), None, "unauthenticated, with hosts configured");
        assert_eq!(g("a-only", who("a", true)), Some(Grant::ReadWrite));
        assert_eq!(g("a-only", who("b", true)), None);
        assert_eq!(g("nobody", who("a", true)), None);
        assert_eq!(g("undefined", who("a", true)), None);
        let mut kept = policy();
        kept.keep_volume("removed-but-open", VolumeGrants { allowed_hosts: vec!["b".into()], ..Default::default() });
        kept.keep_volume("a-only", VolumeGrants::default());
        assert_eq!(kept.volume("removed-but-open").grant(who("b", true), true), Some(Grant::ReadWrite));
        assert_eq!(kept.volume("a-only").grant(who("a", true), true), Some(Grant::ReadWrite), "configured grants win");
        let open = AccessPolicy::open_to_all(["v"]);
        assert_eq!(open.volume("v").grant(who("anyone", false), open.hosts_configured()), Some(Grant::ReadWrite));
        let closed = AccessPolicy::new(HashMap::new(), HashMap::from([("v".to_owned(), VolumeGrants::default())]));
        assert_eq!(closed.volume("v").grant(who("anyone", false), false), None, "default: nobody");
    }

    /// Runs the initiator's half by hand.
    fn exchange(p: &AccessPolicy, host: &str, initiator_key: &AuthKey, session: SessionId) -> (AuthState, Result<[u8; 32]>, [u8; 32], [u8; 32]) {
        let mut st = AuthState::Idle;
        let ch = AuthChallenge::decode(&negotiate(&mut st, host, session, "tgt").unwrap()).unwrap();
        let ni = wire_auth::random_nonce();
        let t = Transcript { host_id: host, target_name: "tgt", session_id: session, initiator_nonce: &ni, target_nonce: &ch.target_nonce };
        let mac = wire_auth::mac(initiator_key, Direction::Initiator, &t);
        let r = reply(&mut st, p, &AuthResponse { initiator_nonce: ni, mac }, "tgt");
        (st, r, ni, ch.target_nonce)
    }

    #[test]
    fn a_good_exchange_authenticates_both_ways() {
        let p = policy();
        let (st, r, ni, nt) = exchange(&p, "a", &key(1), SessionId(0));
        let proof = r.unwrap();
        let t = Transcript { host_id: "a", target_name: "tgt", session_id: SessionId(0), initiator_nonce: &ni, target_nonce: &nt };
        assert!(wire_auth::verify(&key(1), Direction::Target, &t, &proof).is_ok(), "the target proves the key too");
        assert_eq!(st.authenticated_host(), Some("a"));
        assert!(check_connect(&st, &p, "a", None).unwrap());
        assert_eq!(check_connect(&st, &p, "b", None).unwrap_err().kind(), ErrorKind::AuthRequired);
        assert_eq!(check_connect(&st, &p, "a", Some(SessionId(5))).unwrap_err().kind(), ErrorKind::AuthRequired);
    }

    #[test]
    fn every_failure_is_the_same_status() {
        let p = policy();
        let failures = [
            exchange(&p, "a", &key(9), SessionId(0)).1.unwrap_err(),
            exchange(&p, "unknown", &key(1), SessionId(0)).1.unwrap_err(),
            exchange(&AccessPolicy::open_to_all(["v"]), "a", &key(1), SessionId(0)).1.unwrap_err(),
            reply(&mut AuthState::Idle, &p, &AuthResponse { initiator_nonce: [1; 32], mac: [0; 32] }, "tgt").unwrap_err(),
        ];
        for e in &failures {
            assert_eq!(e.wire_status(), failures[0].wire_status(), "{e}");
            assert_eq!(e.kind(), ErrorKind::AuthFailed);
        }
        let (st, ..) = exchange(&p, "a", &key(9), SessionId(0));
        assert_eq!(st, AuthState::Idle, "a failure resets the queue pair");
        assert_eq!(check_connect(&st, &p, "a", None).unwrap_err().kind(), ErrorKind::AuthRequired);
    }

    #[test]
    fn a_replayed_reply_fails_against_a_new_nonce() {
        let p = policy();
        let mut first = AuthState::Idle;
        let ch = AuthChallenge::decode(&negotiate(&mut first, "a", SessionId(0), "tgt").unwrap()).unwrap();
        let ni = [7u8; 32];
        let t = Transcript { host_id: "a", target_name: "tgt", session_id: SessionId(0), initiator_nonce: &ni, target_nonce: &ch.target_nonce };
        let captured = AuthResponse { initiator_nonce: ni, mac: wire_auth::mac(&key(1), Direction::Initiator, &t) };
        assert!(reply(&mut first, &p, &captured, "tgt").is_ok());
        let mut second = AuthState::Idle;
        negotiate(&mut second, "a", SessionId(0), "tgt").unwrap();
        assert_eq!(reply(&mut second, &p, &captured, "tgt").unwrap_err().kind(), ErrorKind::AuthFailed);
        // And the same reply cannot be used twice on one queue pair either.
        assert_eq!(reply(&mut first, &p, &captured, "tgt").unwrap_err().kind(), ErrorKind::AuthFailed);
    }

    #[test]
    fn without_hosts_connect_needs_no_authentication() {
        let p = AccessPolicy::open_to_all(["v"]);
        assert!(!check_connect(&AuthState::Idle, &p, "x", None).unwrap());
        assert_eq!(check_connect(&AuthState::Idle, &policy(), "x", None).unwrap_err().kind(), ErrorKind::AuthRequired);
    }
}
