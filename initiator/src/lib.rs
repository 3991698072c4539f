#![doc = include_str!("../README.md")]

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
pub mod ublk;

pub use buffer::IoBuffer;
pub use device::{check_request, BlockDevice, FileDevice, MemDevice, WriteFlags};
pub use error::{op_name, Error, ErrorKind, Result};
pub use io_queue::{IoCompletion, IoQueue, IoRequest, IoWaker};
pub use options::{default_host_id, ConnectOptions, NegotiatedLimits};
pub use session::{IntoTargetUrl, Session, SessionStats, Volume};
pub use stream::BlockStream;

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
