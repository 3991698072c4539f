#![doc = include_str!("../README.md")]

pub mod attach_file;
mod auth;
mod buffer;
pub mod cli;
mod conn;
mod device;
mod domain;
mod error;
pub mod nbd;
mod options;
mod probe;
mod queue;
mod session;
mod shared;
mod stream;
mod submit;
pub mod ublk;

pub use buffer::IoBuffer;
pub use device::{check_request, BlockDevice, FileDevice, MemDevice, WriteFlags};
pub use error::{op_name, Error, ErrorKind, Result};
pub use options::{default_host_id, ConnectOptions, NegotiatedLimits};
pub use session::{IntoTargetUrl, Session, SessionStats, Volume};
pub use stream::BlockStream;
pub use submit::{IoCompletion, IoQueue, IoRequest, IoWaker};

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
