//! rdmablk initiator: remote volumes of an rdmablk target as block devices,
//! and the `rdmablk` command-line tool ([`cli`]).
//!
//! ```no_run
//! use rdmablk_initiator::{BlockDevice, ConnectOptions, Session};
//!
//! # fn main() -> rdmablk_initiator::Result<()> {
//! let session = Session::connect("tcp://127.0.0.1:7420", ConnectOptions::default())?;
//! for v in session.list_volumes()? {
//!     println!("{} {} bytes", v.name, v.size_bytes);
//! }
//! let vol = session.open("vol0")?;
//!
//! // Plain slices: staged through a registered bounce pool.
//! let mut block = vec![0u8; vol.block_size() as usize];
//! vol.read_at(&mut block, 0)?;
//!
//! // Registered buffers: the target places data straight into them.
//! let mut buf = session.alloc_buffer(1 << 20)?;
//! vol.read_into(&mut buf, 0, 1 << 20, 0)?;
//! buf.as_mut_slice()[0] ^= 1;
//! vol.write_from(&buf, 0, 4096, 0)?;
//! vol.flush()?;
//! # Ok(())
//! # }
//! ```
//!
//! The pieces:
//! - [`Session`]: one connection (queue pair) to a target: CONNECT
//!   negotiation, volume listing and opening, registered [`IoBuffer`]s.
//! - [`Volume`]: an opened remote volume, a [`BlockDevice`].
//! - [`BlockDevice`]: the contract (alignment, ordering, durability) shared
//!   with the local [`FileDevice`] and [`MemDevice`].
//! - [`Error`] with [`ErrorKind`]: what went wrong, with messages that name it.

mod buffer;
pub mod cli;
mod device;
mod error;
mod queue;
mod session;

pub use buffer::IoBuffer;
pub use device::{check_request, BlockDevice, FileDevice, MemDevice, WriteFlags};
pub use error::{op_name, Error, ErrorKind, Result};
pub use session::{default_host_id, ConnectOptions, IntoTargetUrl, NegotiatedLimits, Session, SessionStats, Volume};

/// The wire types a caller meets in this API (volume info, statuses, ids).
pub use rdmablk_common::protocol::{Status, VolumeId, VolumeInfo};
