//! `capsule_decode`: every decoder of `rdmablk_common::protocol` on the same
//! bytes, as the target and the initiator meet them on the wire.
//!
//! - the input as a whole SEND to the target: [`CommandCapsule::decode`],
//!   then the inline data (host id, volume name, [`AuthResponse`]) as the
//!   target reads it;
//! - the input as a whole SEND to the initiator: [`ResponseCapsule::decode`],
//!   then its reply data as [`ConnectReply`], [`VolumeInfo`],
//!   [`AuthChallenge`] and [`AuthSuccess`];
//! - the input alone as each of those reply structures and as an
//!   [`AuthResponse`], and cut into 96-byte [`VolumeInfo`] entries as LIST
//!   writes them.
//!
//! Whatever decodes must satisfy the structural rules its `validate()`
//! promises and must re-encode to exactly the bytes it came from (every
//! byte is either a field or a reserved byte decode checked to be zero), and
//! decoding that encoding must give the same value. A mismatch is a bug.

use rdmablk_common::protocol::{
    decode_inline_str, validate_name, AuthChallenge, AuthResponse, AuthSuccess, CommandCapsule, ConnectReply,
    DataDescriptor, Opcode, ResponseCapsule, SessionId, Status, VolumeInfo, AUTH_ALGORITHM_HMAC_SHA256,
    AUTH_NONCE_SIZE, AUTH_RESPONSE_SIZE, COMMAND_CAPSULE_SIZE, MAX_HOST_ID_LEN, MAX_NAME_LEN, MAX_RESPONSE_DATA,
    RESPONSE_CAPSULE_SIZE, VOLUME_FLAG_DISCARD, VOLUME_FLAG_READ_ONLY, VOLUME_FLAG_WRITE_ZEROES, VOLUME_INFO_SIZE,
};

/// The harness.
pub fn run(data: &[u8]) {
    command(data);
    response(data);
    reply_data(data);
    auth_response(data);
    for entry in data.chunks_exact(VOLUME_INFO_SIZE) {
        volume_info(entry);
    }
    wire_enums(data);
}

/// A SEND the target received: capsule plus inline data.
fn command(message: &[u8]) {
    let capsule = match CommandCapsule::decode(message) {
        Ok(c) => c,
        Err(e) => {
            let _ = e.to_string();
            return;
        }
    };
    assert_eq!(capsule.validate(), Ok(()), "decode returned a capsule that fails validate: {capsule:?}");

    let encoded = capsule.to_bytes();
    assert_eq!(encoded[..], message[..COMMAND_CAPSULE_SIZE], "encode(decode(m)) != m for {capsule:?}");
    let inline = &message[COMMAND_CAPSULE_SIZE..];
    let mut again = encoded.to_vec();
    again.extend_from_slice(inline);
    assert_eq!(CommandCapsule::decode(&again), Ok(capsule), "decode(encode(c)) != c");

    // The structural rules docs/PROTOCOL.md lists, which the target relies
    // on once decode succeeded.
    let op = capsule.opcode;
    assert_eq!(capsule.inline_len as usize, inline.len(), "inline length disagrees with the SEND length");
    assert!(inline.is_empty() || op.allows_inline(), "{op:?} carries inline data");
    assert!(!capsule.fua() || op == Opcode::Write, "FUA on {op:?}");
    assert!(!capsule.has_inline_data() || op == Opcode::Write, "INLINE_DATA on {op:?}");
    if op == Opcode::Write {
        assert_eq!(capsule.has_inline_data(), !inline.is_empty(), "WRITE: INLINE_DATA flag disagrees with the length");
    }
    if !op.uses_descriptor() || capsule.has_inline_data() {
        assert_eq!(capsule.descriptor, DataDescriptor::default(), "{op:?} carries a descriptor");
    }
    if op != Opcode::Connect {
        assert_eq!((capsule.version, capsule.queue_depth, capsule.max_io_size), (0, 0, 0), "CONNECT fields on {op:?}");
    }
    if !op.carries_session_id() {
        assert_eq!(capsule.session_id, SessionId(0), "session id on {op:?}");
    }
    if !op.is_io() || op == Opcode::Flush {
        assert_eq!((capsule.start_block.0, capsule.block_count.0), (0, 0), "block range on {op:?}");
    }
    if !op.is_io() && op != Opcode::CloseVolume {
        assert_eq!(capsule.volume_id.0, 0, "volume id on {op:?}");
    }

    // The inline strings, decoded as the target does.
    match op {
        Opcode::Connect => {
            assert!(inline.len() <= MAX_HOST_ID_LEN, "host id of {} bytes accepted", inline.len());
            if let Ok(host) = decode_inline_str(inline, MAX_HOST_ID_LEN, "host id") {
                assert!(!host.contains('\0'));
            }
        }
        Opcode::AuthNegotiate => {
            assert!((1..=MAX_HOST_ID_LEN).contains(&inline.len()), "host id of {} bytes accepted", inline.len());
            if let Ok(host) = decode_inline_str(inline, MAX_HOST_ID_LEN, "host id") {
                assert!(!host.contains('\0'));
            }
        }
        Opcode::AuthReply => {
            assert_eq!(inline.len(), AUTH_RESPONSE_SIZE, "AUTH_REPLY with {} bytes of inline data", inline.len());
            auth_response(inline);
        }
        Opcode::OpenVolume => {
            assert!((1..=MAX_NAME_LEN).contains(&inline.len()), "volume name of {} bytes accepted", inline.len());
            if let Ok(name) = decode_inline_str(inline, MAX_NAME_LEN, "volume name") {
                // What OPEN decodes must be a name the rest of the system accepts.
                assert_eq!(validate_name(name), Ok(()), "OPEN name {name:?} passes decode but not validate_name");
            }
        }
        _ => {}
    }
}

/// A SEND the initiator received: response capsule plus reply data.
fn response(message: &[u8]) {
    let response = match ResponseCapsule::decode(message) {
        Ok(r) => r,
        Err(e) => {
            let _ = e.to_string();
            return;
        }
    };
    assert_eq!(response.validate(), Ok(()), "decode returned a response that fails validate: {response:?}");
    let data = &message[RESPONSE_CAPSULE_SIZE..];
    assert_eq!(response.data_len as usize, data.len());
    assert!(data.len() <= MAX_RESPONSE_DATA, "{} bytes of reply data accepted", data.len());
    assert_eq!(Status::from_wire(response.status.to_wire()), Some(response.status));

    let encoded = response.to_bytes();
    assert_eq!(encoded[..], message[..RESPONSE_CAPSULE_SIZE], "encode(decode(m)) != m for {response:?}");
    let mut again = encoded.to_vec();
    again.extend_from_slice(data);
    assert_eq!(ResponseCapsule::decode(&again), Ok(response), "decode(encode(r)) != r");

    reply_data(data);
}

/// The reply structures that follow a CONNECT, OPEN, AUTH_NEGOTIATE or
/// AUTH_REPLY response.
fn reply_data(b: &[u8]) {
    connect_reply(b);
    volume_info(b);
    auth_challenge(b);
    auth_success(b);
}

fn connect_reply(b: &[u8]) {
    let reply = match ConnectReply::decode(b) {
        Ok(r) => r,
        Err(e) => {
            let _ = e.to_string();
            return;
        }
    };
    assert_eq!(reply.validate(), Ok(()), "decode returned a reply that fails validate: {reply:?}");
    assert!((1..=u16::MAX as u32).contains(&reply.queue_depth));
    assert_ne!(reply.max_io_size, 0);
    assert_ne!(reply.session_id, SessionId(0));
    assert!(reply.target_name.len() <= MAX_NAME_LEN && !reply.target_name.contains('\0'));

    let encoded = reply.to_bytes().expect("a decoded ConnectReply must encode");
    assert_eq!(encoded[..], b[..], "encode(decode(b)) != b for {reply:?}");
    assert_eq!(ConnectReply::decode(&encoded), Ok(reply.clone()), "decode(encode(r)) != r");
}

fn volume_info(b: &[u8]) {
    let info = match VolumeInfo::decode(b) {
        Ok(v) => v,
        Err(e) => {
            let _ = e.to_string();
            return;
        }
    };
    assert_eq!(info.validate(), Ok(()), "decode returned a VolumeInfo that fails validate: {info:?}");
    assert!(info.block_size >= 512 && info.block_size.is_power_of_two());
    assert_eq!(info.size_bytes % info.block_size as u64, 0);
    let known = VOLUME_FLAG_READ_ONLY | VOLUME_FLAG_DISCARD | VOLUME_FLAG_WRITE_ZEROES;
    assert_eq!(info.flags & !known, 0);
    assert_eq!(info.read_only(), info.flags & VOLUME_FLAG_READ_ONLY != 0);
    assert!(info.name.len() <= MAX_NAME_LEN && !info.name.contains('\0'));

    let encoded = info.to_bytes().expect("a decoded VolumeInfo must encode");
    assert_eq!(encoded[..], b[..], "encode(decode(b)) != b for {info:?}");
    assert_eq!(VolumeInfo::decode(&encoded), Ok(info.clone()), "decode(encode(v)) != v");
}

fn auth_challenge(b: &[u8]) {
    let challenge = match AuthChallenge::decode(b) {
        Ok(c) => c,
        Err(e) => {
            let _ = e.to_string();
            return;
        }
    };
    assert_eq!(challenge.validate(), Ok(()), "decode returned a challenge that fails validate: {challenge:?}");
    assert_eq!(challenge.algorithm, AUTH_ALGORITHM_HMAC_SHA256);
    assert_ne!(challenge.target_nonce, [0; AUTH_NONCE_SIZE], "all-zero target nonce accepted");
    assert!(challenge.target_name.len() <= MAX_NAME_LEN && !challenge.target_name.contains('\0'));

    let encoded = challenge.to_bytes().expect("a decoded AuthChallenge must encode");
    assert_eq!(encoded[..], b[..], "encode(decode(b)) != b for {challenge:?}");
    assert_eq!(AuthChallenge::decode(&encoded), Ok(challenge.clone()), "decode(encode(c)) != c");
}

fn auth_response(b: &[u8]) {
    let response = match AuthResponse::decode(b) {
        Ok(r) => r,
        Err(e) => {
            let _ = e.to_string();
            return;
        }
    };
    assert_eq!(response.validate(), Ok(()));
    assert_ne!(response.initiator_nonce, [0; AUTH_NONCE_SIZE], "all-zero initiator nonce accepted");
    let encoded = response.to_bytes();
    assert_eq!(encoded[..], b[..], "encode(decode(b)) != b for {response:?}");
    assert_eq!(AuthResponse::decode(&encoded), Ok(response.clone()), "decode(encode(r)) != r");
}

fn auth_success(b: &[u8]) {
    let success = match AuthSuccess::decode(b) {
        Ok(s) => s,
        Err(e) => {
            let _ = e.to_string();
            return;
        }
    };
    assert_eq!(success.validate(), Ok(()));
    let encoded = success.to_bytes();
    assert_eq!(encoded[..], b[..], "encode(decode(b)) != b");
    assert_eq!(AuthSuccess::decode(&encoded), Ok(success.clone()), "decode(encode(s)) != s");
}

/// `from_wire` and `to_wire` are inverse on every value they accept.
fn wire_enums(data: &[u8]) {
    for &b in data.iter().take(8) {
        if let Some(op) = Opcode::from_wire(b) {
            assert_eq!(op.to_wire(), b);
            assert!(Opcode::ALL.contains(&op));
        }
    }
    for pair in data.chunks_exact(2).take(4) {
        let v = u16::from_le_bytes([pair[0], pair[1]]);
        if let Some(s) = Status::from_wire(v) {
            assert_eq!(s.to_wire(), v);
            assert!(!s.describe().is_empty());
        }
    }
}
