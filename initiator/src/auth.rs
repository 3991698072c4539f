//! The initiator's side of host authentication (see `docs/PROTOCOL.md`,
//! "Authentication"): on a fresh queue pair, before CONNECT,
//!
//! 1. AUTH_NEGOTIATE with the host id and the session to create (0) or join;
//!    the target answers a challenge: its nonce and its name;
//! 2. AUTH_REPLY with this side's nonce and its proof, HMAC-SHA256 over the
//!    transcript (`rdmablk_common::auth`); the target answers its own proof,
//!    which is checked here in constant time.
//!
//! The session is established only when both proofs match, so an initiator
//! with a key never talks to a target that does not hold the same key.
//! Every failure, whichever side's proof was wrong, is the same
//! [`Error::Authentication`].

use std::time::Duration;

use rdmablk_common::auth::{self, AuthKey, Direction, Transcript};
use rdmablk_common::protocol::{
    AuthChallenge, AuthResponse, AuthSuccess, CommandCapsule, CommandId, Opcode, SessionId, Status,
};

use crate::error::{Error, Result};
use crate::conn::{status_error, Conn};

/// Authenticates a fresh connection as `host_id` with `key`, for creating
/// (`SessionId(0)`) or joining `session_id`. Returns the target name the
/// target authenticated under; CONNECT's reply must carry the same.
pub(crate) fn authenticate(
    conn: &mut Conn,
    key: &AuthKey,
    host_id: &str,
    session_id: SessionId,
    timeout: impl Fn() -> Duration,
) -> Result<String> {
    let failed = || Error::Authentication { host_id: host_id.to_owned() };

    let mut c = CommandCapsule::new(Opcode::AuthNegotiate, CommandId(0));
    c.session_id = session_id;
    c.inline_len = host_id.len() as u32;
    let resp = conn.execute(&c, host_id.as_bytes(), timeout())?;
    match resp.capsule.status {
        Status::Success => {}
        Status::AuthFailed => return Err(failed()),
        _ => return Err(status_error(Opcode::AuthNegotiate, &resp.capsule, None, None, None)),
    }
    let challenge = AuthChallenge::decode(resp.data())
        .map_err(|e| Error::protocol(format!("the target's authentication challenge is invalid: {e}")))?;

    let initiator_nonce = auth::random_nonce();
    let transcript = Transcript {
        host_id,
        target_name: &challenge.target_name,
        session_id,
        initiator_nonce: &initiator_nonce,
        target_nonce: &challenge.target_nonce,
    };
    let response = AuthResponse { initiator_nonce, mac: auth::mac(key, Direction::Initiator, &transcript) };
    let mut c = CommandCapsule::new(Opcode::AuthReply, CommandId(0));
    c.inline_len = response.to_bytes().len() as u32;
    let resp = conn.execute(&c, &response.to_bytes(), timeout())?;
    match resp.capsule.status {
        Status::Success => {}
        Status::AuthFailed => return Err(failed()),
        _ => return Err(status_error(Opcode::AuthReply, &resp.capsule, None, None, None)),
    }
    let Ok(proof) = AuthSuccess::decode(resp.data()) else {
        tracing::warn!(host = host_id, "the target's authentication answer has {} bytes, not a MAC", resp.data().len());
        return Err(failed());
    };
    if auth::verify(key, Direction::Target, &transcript, &proof.mac).is_err() {
        tracing::warn!(host = host_id, target = %challenge.target_name, "the target could not prove it holds the key");
        return Err(failed());
    }
    Ok(challenge.target_name)
}
