//! What the server, the handshake and the connections share: the export
//! they serve ([`Export`]) and a connection's socket ([`Stream`]).

use std::io::{self, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::os::unix::net::UnixStream;
use std::time::Duration;

use super::wire::{
    BlockSizes, TFLAG_CAN_MULTI_CONN, TFLAG_HAS_FLAGS, TFLAG_READ_ONLY, TFLAG_SEND_FLUSH, TFLAG_SEND_FUA,
    TFLAG_SEND_TRIM, TFLAG_SEND_WRITE_ZEROES,
};
use crate::device::{max_piece, BlockDevice};
use crate::error::{Error, Result};
use crate::session::{Session, Volume};

/// What the connections serve: the export's description.
#[derive(Debug)]
pub(crate) struct Export {
    pub name: String,
    pub size: u64,
    pub flags: u16,
    pub sizes: BlockSizes,
    pub block_size: u32,
}

impl Export {
    pub(super) fn of(session: &Session, volume: &Volume) -> Result<Export> {
        let bs = volume.block_size();
        let read_only = volume.read_only();
        let mut flags = TFLAG_HAS_FLAGS | TFLAG_SEND_FLUSH | TFLAG_CAN_MULTI_CONN;
        if read_only {
            flags |= TFLAG_READ_ONLY;
        } else {
            flags |= TFLAG_SEND_FUA;
            if volume.supports_discard() {
                flags |= TFLAG_SEND_TRIM;
            }
            if volume.supports_write_zeroes() {
                flags |= TFLAG_SEND_WRITE_ZEROES;
            }
        }
        let maximum = max_piece(u64::from(session.max_io_size()), bs)? as u32;
        let sizes = BlockSizes { minimum: bs, preferred: bs.max(4096), maximum: maximum.max(bs.max(4096)) };
        sizes
            .validate()
            .map_err(|e| Error::invalid(format!("volume {:?} cannot be served over NBD: {e}", volume.name())))?;
        Ok(Export { name: volume.name().to_owned(), size: volume.size(), flags, sizes, block_size: bs })
    }

    /// Whether a client's export name selects this export: its name, or
    /// the empty default name.
    pub fn matches(&self, name: &[u8]) -> bool {
        name.is_empty() || name == self.name.as_bytes()
    }
}

/// A connection's socket.
#[derive(Debug)]
pub(crate) enum Stream {
    Unix(UnixStream),
    Tcp(TcpStream),
}

impl Stream {
    pub fn try_clone(&self) -> io::Result<Stream> {
        Ok(match self {
            Stream::Unix(s) => Stream::Unix(s.try_clone()?),
            Stream::Tcp(s) => Stream::Tcp(s.try_clone()?),
        })
    }

    pub fn as_fd(&self) -> std::os::fd::BorrowedFd<'_> {
        use std::os::fd::AsFd;
        match self {
            Stream::Unix(s) => s.as_fd(),
            Stream::Tcp(s) => s.as_fd(),
        }
    }

    pub fn shutdown(&self, how: Shutdown) {
        let _ = match self {
            Stream::Unix(s) => s.shutdown(how),
            Stream::Tcp(s) => s.shutdown(how),
        };
    }

    pub fn set_read_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        match self {
            Stream::Unix(s) => s.set_read_timeout(t),
            Stream::Tcp(s) => s.set_read_timeout(t),
        }
    }

    pub fn set_write_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        match self {
            Stream::Unix(s) => s.set_write_timeout(t),
            Stream::Tcp(s) => s.set_write_timeout(t),
        }
    }
}

impl Read for &Stream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Stream::Unix(s) => (&*s).read(buf),
            Stream::Tcp(s) => (&*s).read(buf),
        }
    }
}

impl Write for &Stream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Stream::Unix(s) => (&*s).write(buf),
            Stream::Tcp(s) => (&*s).write(buf),
        }
    }
    fn write_vectored(&mut self, bufs: &[io::IoSlice<'_>]) -> io::Result<usize> {
        match self {
            Stream::Unix(s) => (&*s).write_vectored(bufs),
            Stream::Tcp(s) => (&*s).write_vectored(bufs),
        }
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}
