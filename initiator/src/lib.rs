#![doc = include_str!("../README.md")]
//!
//! ## Inside: the layers
//!
//! The modules read bottom to top, each importing only those below it:
//!
//! 1. Plain values and resources: `options.rs` ([`ConnectOptions`],
//!    [`NegotiatedLimits`]), `targets.rs` ([`Targets`], a volume's
//!    gateways), `domain.rs` (the session's protection domain
//!    and fabric), `buffer.rs` ([`IoBuffer`]), `duration.rs`, `error.rs`,
//!    `device.rs` ([`BlockDevice`]).
//! 2. The connection, one queue pair: `conn.rs` (capsules, command slots,
//!    progress, waiting, keep-alive), `auth.rs` (authentication on it) and
//!    `queue.rs` (a queue's bounce pool and request splitting on top of it).
//! 3. The connection set: `connection_set.rs` (connecting, reconnection,
//!    the reconnect fence, the monitor thread that sends keep-alives).
//! 4. The session, the public handle: `session.rs` ([`Session`],
//!    [`Volume`]).
//! 5. The I/O queue: `io_queue.rs` ([`IoQueue`], asynchronous submission
//!    on one of the session's queue pairs).
//! 6. The users: [`nbd`], [`ublk`], [`cli`] with [`attach_file`], and
//!    [`BlockStream`].

pub mod attach_file;
mod auth;
mod buffer;
pub mod cli;
mod conn;
mod connection_set;
mod device;
mod domain;
mod duration;
mod error;
mod io_queue;
pub mod nbd;
mod options;
mod probe;
mod queue;
mod session;
mod stream;
mod targets;
pub mod ublk;

pub use buffer::IoBuffer;
pub use device::{check_request, BlockDevice, FileDevice, MemDevice, WriteFlags};
pub use error::{op_name, Error, ErrorKind, Result};
pub use io_queue::{IoCompletion, IoQueue, IoRequest, IoWaker};
pub use options::{default_host_id, ConnectOptions, NegotiatedLimits};
pub use session::{IntoTargetUrl, Session, SessionStats, Volume};
pub use stream::BlockStream;
pub use targets::{IntoTargets, Targets, MAX_GATEWAYS};

/// The wire types a caller meets in this API (volume info, statuses, ids).
pub use rdmablk_common::auth::{generate_key_file, AuthKey, KeyError};
pub use rdmablk_common::protocol::{SessionId, Status, VolumeId, VolumeInfo};

#[allow(dead_code)]
fn assert_send_sync() {
    fn is<T: Send + Sync>() {}
    fn is_send<T: Send>() {}
    is::<Session>();
    is::<Volume>();
    is::<IoBuffer>();
    is_send::<IoQueue>();
}
