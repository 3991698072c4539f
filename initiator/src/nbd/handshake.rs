//! Fixed newstyle negotiation: the greeting, the client's flags and the
//! options, until the client enters transmission, aborts, or breaks a rule.
//!
//! The handshake timeout bounds the whole negotiation, not each step: a
//! client that sends one option now and then, each in time, would otherwise
//! hold a connection (one of [`MAX_CONNECTIONS`](super::server::MAX_CONNECTIONS))
//! and its thread for [`MAX_OPTIONS`] times the timeout.

use std::io::{self, Read, Write};
use std::time::{Duration, Instant};

use super::export::{Export, Stream};
use super::wire::{
    option_name, ClientFlags, ExportInfo, Greeting, InfoRequest, OptionHeader, OptionReply, FLAG_FIXED_NEWSTYLE,
    FLAG_NO_ZEROES, INFO_BLOCK_SIZE, INFO_NAME, OPT_ABORT, OPT_EXPORT_NAME, OPT_EXTENDED_HEADERS, OPT_GO, OPT_INFO,
    OPT_LIST, OPT_LIST_META_CONTEXT, OPT_SET_META_CONTEXT, OPT_STARTTLS, OPT_STRUCTURED_REPLY, REP_ACK,
    REP_ERR_INVALID, REP_ERR_UNKNOWN, REP_ERR_UNSUP, REP_INFO, REP_SERVER,
};

/// The handshake flags this server sends.
pub(crate) const SERVER_FLAGS: u16 = FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES;
/// Options one connection may send before it must choose an export.
pub(crate) const MAX_OPTIONS: usize = 64;

/// Runs the negotiation on `stream`, all of it within `timeout`.
/// `Ok(true)`: the client chose the export, go on with transmission;
/// `Ok(false)`: it aborted or closed (logged here); `Err`: the reason to
/// close the connection, for the log. Leaves the stream's timeouts set.
pub(crate) fn negotiate(stream: &Stream, export: &Export, peer: &str, timeout: Duration) -> Result<bool, String> {
    let timed = Timed { stream, deadline: Instant::now() + timeout, timeout };
    let stream = &timed;
    let mut s = stream;
    let io_err = |what: &str, e: io::Error| format!("{what}: {e}");
    s.write_all(&Greeting { flags: SERVER_FLAGS }.encode()).map_err(|e| io_err("sending the greeting", e))?;
    let mut b = [0u8; ClientFlags::SIZE];
    if !read_or_eof(s, &mut b).map_err(|e| io_err("reading the client flags", e))? {
        tracing::info!("{peer}: closed before negotiating");
        return Ok(false);
    }
    let client = ClientFlags::decode(&b);
    client.validate(SERVER_FLAGS).map_err(|e| e.to_string())?;
    for _ in 0..MAX_OPTIONS {
        let mut h = [0u8; OptionHeader::SIZE];
        if !read_or_eof(s, &mut h).map_err(|e| io_err("reading an option", e))? {
            tracing::info!("{peer}: closed during negotiation");
            return Ok(false);
        }
        let header = OptionHeader::decode(&h).map_err(|e| e.to_string())?;
        header.validate().map_err(|e| e.to_string())?;
        let mut data = vec![0u8; header.length as usize];
        s.read_exact(&mut data)
            .map_err(|e| io_err(&format!("reading the data of {}", option_name(header.option)), e))?;
        let option = header.option;
        let reply = |reply: u32, payload: &[u8]| -> Result<(), String> {
            let mut s = stream;
            let h = OptionReply { option, reply, length: payload.len() as u32 };
            s.write_all(&[&h.encode()[..], payload].concat())
                .map_err(|e| format!("sending the reply to {}: {e}", option_name(option)))
        };
        match option {
            OPT_EXPORT_NAME => {
                if !export.matches(&data) {
                    // This option cannot be answered with an error.
                    return Err(format!(
                        "NBD_OPT_EXPORT_NAME asks for export {:?}, which is not served (only {:?} and the default \"\")",
                        String::from_utf8_lossy(&data),
                        export.name
                    ));
                }
                let info = ExportInfo { size: export.size, flags: export.flags };
                s.write_all(&info.encode_export_name(client.no_zeroes()))
                    .map_err(|e| io_err("answering NBD_OPT_EXPORT_NAME", e))?;
                tracing::info!("{peer}: NBD_OPT_EXPORT_NAME: serving {:?} (flags {:#x})", export.name, export.flags);
                return Ok(true);
            }
            OPT_ABORT => {
                // The client may already be gone: a failed reply is fine.
                let _ = reply(REP_ACK, &[]);
                tracing::info!("{peer}: aborted the negotiation");
                return Ok(false);
            }
            OPT_LIST => {
                if !data.is_empty() {
                    tracing::warn!("{peer}: NBD_OPT_LIST with {} bytes of data: refused", data.len());
                    reply(REP_ERR_INVALID, b"NBD_OPT_LIST takes no data")?;
                    continue;
                }
                let mut server = (export.name.len() as u32).to_be_bytes().to_vec();
                server.extend_from_slice(export.name.as_bytes());
                reply(REP_SERVER, &server)?;
                reply(REP_ACK, &[])?;
            }
            OPT_INFO | OPT_GO => {
                let what = if option == OPT_GO { "NBD_OPT_GO" } else { "NBD_OPT_INFO" };
                let request = match InfoRequest::decode(what, &data) {
                    Ok(r) => r,
                    Err(e) => {
                        tracing::warn!("{peer}: {e}");
                        reply(REP_ERR_INVALID, e.to_string().as_bytes())?;
                        continue;
                    }
                };
                if !export.matches(&request.name) {
                    let name = String::from_utf8_lossy(&request.name);
                    tracing::warn!("{peer}: {what} asks for export {name:?}, which is not served");
                    let msg = format!("no export {name:?}: this server serves {:?} (also as \"\")", export.name);
                    reply(REP_ERR_UNKNOWN, msg.as_bytes())?;
                    continue;
                }
                let info = ExportInfo { size: export.size, flags: export.flags };
                reply(REP_INFO, &info.encode_info())?;
                if request.requests.contains(&INFO_NAME) {
                    let mut name = INFO_NAME.to_be_bytes().to_vec();
                    name.extend_from_slice(export.name.as_bytes());
                    reply(REP_INFO, &name)?;
                }
                // Sent whether asked for or not: the constraints hold for
                // every client (unaligned requests are refused).
                reply(REP_INFO, &export.sizes.encode_info())?;
                reply(REP_ACK, &[])?;
                if option == OPT_GO {
                    let asked = request.requests.contains(&INFO_BLOCK_SIZE);
                    tracing::info!(
                        "{peer}: NBD_OPT_GO: serving {:?} (flags {:#x}, block sizes {}{})",
                        export.name,
                        export.flags,
                        export.sizes,
                        if asked { "" } else { ", not asked for" }
                    );
                    return Ok(true);
                }
            }
            OPT_STRUCTURED_REPLY
            | OPT_STARTTLS
            | OPT_LIST_META_CONTEXT
            | OPT_SET_META_CONTEXT
            | OPT_EXTENDED_HEADERS => {
                tracing::debug!("{peer}: {} not supported", option_name(option));
                let msg = format!("{} is not supported by this server (simple replies, no TLS)", option_name(option));
                reply(REP_ERR_UNSUP, msg.as_bytes())?;
            }
            _ => {
                tracing::warn!(
                    "{peer}: unknown {} ({} bytes of data): NBD_REP_ERR_UNSUP",
                    option_name(option),
                    data.len()
                );
                reply(REP_ERR_UNSUP, format!("unknown {}", option_name(option)).as_bytes())?;
            }
        }
    }
    Err(format!("{MAX_OPTIONS} options without choosing an export"))
}

/// The negotiation's side of the socket: each read or write may wait only
/// for what is left of the handshake timeout.
struct Timed<'a> {
    stream: &'a Stream,
    deadline: Instant,
    timeout: Duration,
}

impl Timed<'_> {
    /// What is left of the timeout, or the error that it is over.
    fn left(&self) -> io::Result<Duration> {
        match self.deadline.checked_duration_since(Instant::now()) {
            Some(left) if !left.is_zero() => Ok(left),
            _ => Err(self.expired()),
        }
    }

    fn expired(&self) -> io::Error {
        let t = crate::duration::spaced_duration(self.timeout);
        io::Error::new(io::ErrorKind::TimedOut, format!("the negotiation did not finish within {t} (the handshake timeout)"))
    }

    /// A socket timeout's error (`EAGAIN`) says which timeout it was.
    fn timed_out(&self, e: io::Error) -> io::Error {
        if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut) {
            self.expired()
        } else {
            e
        }
    }
}

impl Read for &Timed<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.stream.set_read_timeout(Some(self.left()?))?;
        let mut s = self.stream;
        s.read(buf).map_err(|e| self.timed_out(e))
    }
}

impl Write for &Timed<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.stream.set_write_timeout(Some(self.left()?))?;
        let mut s = self.stream;
        s.write(buf).map_err(|e| self.timed_out(e))
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// Reads exactly `buf.len()` bytes; false if the stream ended before the
/// first byte (a clean close between messages).
fn read_or_eof(mut s: impl Read, buf: &mut [u8]) -> io::Result<bool> {
    let mut got = 0;
    while got < buf.len() {
        match s.read(&mut buf[got..]) {
            Ok(0) if got == 0 => return Ok(false),
            Ok(0) => {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    format!("closed after {got} of {} bytes", buf.len()),
                ))
            }
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(true)
}
