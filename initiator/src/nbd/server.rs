//! The listener, the accept loop, the connections' registry and the
//! orderly stop.

use std::collections::HashMap;
use std::io;
use std::net::{Shutdown, SocketAddr, TcpListener};
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::fs::FileTypeExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::thread::JoinHandle;
use std::time::Duration;

use super::export::{Export, Stream};
use super::wire::TFLAG_READ_ONLY;
use super::{conn, handshake};
use crate::device::BlockDevice;
use crate::error::{Error, Result};
use crate::session::{Session, Volume};

/// Connections served at once; one more is closed at once, logged.
pub const MAX_CONNECTIONS: usize = 64;
/// How long a client may take to negotiate, from its connection to its
/// choice of the export, unless [`Server::with_handshake_timeout`] says
/// otherwise.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a reply may wait for a client that reads nothing: then the
/// connection ends (so that a stuck client cannot hold a stopping server).
pub const SEND_TIMEOUT: Duration = Duration::from_secs(120);
/// Registered memory each connection may hold for requests in flight (a
/// READ's or WRITE's buffer lives from its request to its reply).
pub const CONNECTION_BUFFER_BUDGET: usize = 32 << 20;

/// Where to listen.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Listen {
    /// A unix socket at this path (created; a stale socket is replaced, any
    /// other file is refused).
    Unix(PathBuf),
    /// A TCP address (port 0: any free port; see [`Server::uri`]).
    Tcp(SocketAddr),
}

enum Listener {
    Unix(UnixListener),
    Tcp(TcpListener),
}

impl Listener {
    fn accept(&self) -> io::Result<(Stream, String)> {
        match self {
            Listener::Unix(l) => {
                let (s, _) = l.accept()?;
                s.set_nonblocking(false)?;
                Ok((Stream::Unix(s), "unix socket client".to_owned()))
            }
            Listener::Tcp(l) => {
                let (s, peer) = l.accept()?;
                s.set_nonblocking(false)?;
                s.set_nodelay(true)?;
                Ok((Stream::Tcp(s), peer.to_string()))
            }
        }
    }

    fn fd(&self) -> std::os::fd::BorrowedFd<'_> {
        match self {
            Listener::Unix(l) => l.as_fd(),
            Listener::Tcp(l) => l.as_fd(),
        }
    }
}

/// The stop signal shared by the server, its connections and [`Stopper`]s.
struct Stop {
    stopping: AtomicBool,
    /// [`Stopper::give_up`] was called: the session is closed, so the
    /// requests in flight and the final flush fail instead of waiting.
    given_up: AtomicBool,
    /// The server's session, closed by [`Stopper::give_up`] (weak: a
    /// `Stopper` the signal thread keeps does not keep it open).
    session: Weak<crate::connection_set::Shared>,
    /// How long the session waits for a lost target: what the stop may wait.
    ctrl_loss_timeout: Duration,
    /// The volume served, for the log.
    volume: String,
    /// Readable once stopping: wakes the accept loop.
    fd: OwnedFd,
    /// The sockets of connections still negotiating, to end their reading.
    conns: Mutex<HashMap<u64, Stream>>,
}

impl Stop {
    /// Registers a connection's socket; false (and the socket's reading is
    /// ended) if the server is already stopping.
    fn register(&self, id: u64, stream: Stream) -> bool {
        let mut conns = self.conns.lock().unwrap_or_else(|e| e.into_inner());
        if self.stopping.load(Ordering::Acquire) {
            stream.shutdown(Shutdown::Read);
            return false;
        }
        conns.insert(id, stream);
        true
    }

    fn unregister(&self, id: u64) {
        self.conns.lock().unwrap_or_else(|e| e.into_inner()).remove(&id);
    }
}

// By hand: the session's `Shared` has no `Debug`.
impl std::fmt::Debug for Stop {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Stop")
            .field("stopping", &self.stopping)
            .field("given_up", &self.given_up)
            .finish_non_exhaustive()
    }
}

/// Stops a running [`Server`] from any thread: it stops accepting, the
/// connections still negotiating are closed, the requests in flight finish
/// and are answered, the requests that come after the stop are answered
/// `NBD_ESHUTDOWN` until each client closes or goes quiet (see `conn.rs`),
/// the volume is flushed, and [`Server::run`] returns.
#[derive(Clone, Debug)]
pub struct Stopper {
    stop: Arc<Stop>,
}

impl Stopper {
    pub fn stop(&self) {
        let conns = self.stop.conns.lock().unwrap_or_else(|e| e.into_inner());
        if self.stop.stopping.swap(true, Ordering::AcqRel) {
            return;
        }
        let _ = rustix::io::write(&self.stop.fd, &1u64.to_ne_bytes());
        for s in conns.values() {
            s.shutdown(Shutdown::Read);
        }
    }

    /// Logs what the stop may wait for, at once: with the target
    /// unreachable, the requests in flight and the final flush wait for it
    /// to come back, up to `ctrl_loss_timeout` (60 s by default) after the
    /// connection was lost, and only [`give_up`](Stopper::give_up) (a
    /// second signal) ends that sooner. A warning if the session is not
    /// connected now; otherwise a note, since the target may go while the
    /// stop waits. Nothing when the session does not reconnect.
    pub fn log_the_wait(&self, give_up: &str) {
        let stop = &self.stop;
        if stop.ctrl_loss_timeout.is_zero() {
            return;
        }
        let wait = crate::duration::spaced_duration(stop.ctrl_loss_timeout);
        let then = format!(
            "up to {wait} (ctrl_loss_timeout); {give_up} ends the wait at once, without the final flush of volume {:?}: writes since its last flush may be lost",
            stop.volume
        );
        let unreachable = stop.session.upgrade().is_some_and(|s| s.phase() != crate::connection_set::Phase::Connected);
        if unreachable {
            tracing::warn!("the target is unreachable: the requests in flight and the final flush wait for it to come back, {then}");
        } else {
            tracing::info!("should the target become unreachable, the requests in flight and the final flush wait for it, {then}");
        }
    }

    /// Whether [`stop`](Stopper::stop) was called.
    pub fn is_stopping(&self) -> bool {
        self.stop.stopping.load(Ordering::Acquire)
    }

    /// Stops without waiting: closes the session, so that requests still
    /// in flight and the final flush fail at once (their clients get
    /// errors) instead of waiting, up to `ctrl_loss_timeout`, for a target
    /// that went away. [`Server::run`] then returns the flush's error:
    /// writes answered since the volume's last flush may not be durable.
    pub fn give_up(&self) {
        self.stop();
        if !self.stop.given_up.swap(true, Ordering::AcqRel) {
            if let Some(session) = self.stop.session.upgrade() {
                session.close("the NBD server gave up waiting for the target");
            }
        }
    }
}

/// An NBD server for one volume; see the [module docs](super).
pub struct Server {
    listener: Listener,
    shared: Arc<conn::Shared>,
    stop: Arc<Stop>,
    uri: String,
    socket_path: Option<PathBuf>,
    handshake_timeout: Duration,
}

impl Server {
    /// Listens on `listen` to serve `volume` (opened through `session`).
    /// Nothing is served before [`run`](Server::run).
    pub fn bind(session: &Session, volume: Volume, listen: &Listen) -> Result<Server> {
        let export = Export::of(session, &volume)?;
        let (listener, uri, socket_path) = match listen {
            Listen::Unix(path) => {
                let l = bind_unix(path)?;
                let shown = std::path::absolute(path).unwrap_or_else(|_| path.clone());
                let uri = format!("nbd+unix:///{}?socket={}", uri_escape(&export.name), shown.display());
                (Listener::Unix(l), uri, Some(path.clone()))
            }
            Listen::Tcp(addr) => {
                let l = TcpListener::bind(addr).map_err(|e| Error::io(format!("listening on {addr}"), e))?;
                let local = l.local_addr().map_err(|e| Error::io("reading the listening address", e))?;
                if !local.ip().is_loopback() {
                    tracing::warn!(
                        "NBD has no authentication: anyone who reaches {local} can read and write volume {:?}",
                        export.name
                    );
                }
                let uri = format!("nbd://{local}/{}", uri_escape(&export.name));
                (Listener::Tcp(l), uri, None)
            }
        };
        match &listener {
            Listener::Unix(l) => l.set_nonblocking(true),
            Listener::Tcp(l) => l.set_nonblocking(true),
        }
        .map_err(|e| Error::io("making the listener nonblocking", e))?;
        use rustix::event::{eventfd, EventfdFlags};
        let fd = eventfd(0, EventfdFlags::CLOEXEC | EventfdFlags::NONBLOCK)
            .map_err(|e| Error::io("creating the stop eventfd", e.into()))?;
        let stop = Arc::new(Stop {
            stopping: AtomicBool::new(false),
            given_up: AtomicBool::new(false),
            session: Arc::downgrade(&session.shared),
            ctrl_loss_timeout: session.options().ctrl_loss_timeout,
            volume: export.name.clone(),
            fd,
            conns: Mutex::new(HashMap::new()),
        });
        let depth = session.queue_depth().max(1) as usize;
        let shared = Arc::new(conn::Shared {
            session: session.clone(),
            volume: Arc::new(volume),
            export,
            depth,
            buffer_budget: CONNECTION_BUFFER_BUDGET,
        });
        Ok(Server { listener, shared, stop, uri, socket_path, handshake_timeout: HANDSHAKE_TIMEOUT })
    }

    /// How long a client may take to negotiate, all of it (default 30 s).
    pub fn with_handshake_timeout(mut self, timeout: Duration) -> Server {
        self.handshake_timeout = timeout;
        self
    }

    /// The NBD URI of the export: `nbd+unix:///VOL?socket=PATH` or
    /// `nbd://HOST:PORT/VOL`.
    pub fn uri(&self) -> &str {
        &self.uri
    }

    /// A handle that stops the server from another thread.
    pub fn stopper(&self) -> Stopper {
        Stopper { stop: Arc::clone(&self.stop) }
    }

    /// Serves until a [`Stopper`] stops it; then waits for the connections
    /// to answer their requests in flight, flushes the volume and removes
    /// the unix socket. Errors: the listener failed, or the final flush did.
    pub fn run(self) -> Result<()> {
        let counter = AtomicU64::new(0);
        let live = Arc::new(AtomicUsize::new(0));
        let mut threads: Vec<JoinHandle<()>> = Vec::new();
        tracing::info!(
            "serving volume {:?} ({} bytes, {}-byte blocks{}) at {}",
            self.shared.export.name,
            self.shared.export.size,
            self.shared.export.block_size,
            if self.shared.export.flags & TFLAG_READ_ONLY != 0 { ", read-only" } else { "" },
            self.uri
        );
        let result = loop {
            if self.stop.stopping.load(Ordering::Acquire) {
                break Ok(());
            }
            let listener_fd = self.listener.fd();
            let mut fds = [
                rustix::event::PollFd::new(&listener_fd, rustix::event::PollFlags::IN),
                rustix::event::PollFd::new(&self.stop.fd, rustix::event::PollFlags::IN),
            ];
            match rustix::event::poll(&mut fds, None) {
                Ok(_) | Err(rustix::io::Errno::INTR) => {}
                Err(e) => break Err(Error::io("waiting for connections", e.into())),
            }
            let (stream, peer) = match self.listener.accept() {
                Ok(c) => c,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock || e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) if matches!(e.raw_os_error(), Some(libc::EMFILE | libc::ENFILE | libc::ECONNABORTED)) => {
                    tracing::warn!("accepting a connection failed: {e}");
                    std::thread::sleep(Duration::from_millis(50));
                    continue;
                }
                Err(e) => break Err(Error::io("accepting a connection", e)),
            };
            threads.retain(|t| !t.is_finished());
            let id = counter.fetch_add(1, Ordering::Relaxed);
            let peer = format!("{peer} (connection {id})");
            if live.load(Ordering::Acquire) >= MAX_CONNECTIONS {
                tracing::warn!("{peer}: refused, {MAX_CONNECTIONS} connections are served already");
                continue;
            }
            let registered = match stream.try_clone() {
                Ok(clone) => self.stop.register(id, clone),
                Err(e) => {
                    tracing::warn!("{peer}: closing, cannot duplicate its socket: {e}");
                    continue;
                }
            };
            if !registered {
                continue;
            }
            live.fetch_add(1, Ordering::AcqRel);
            let (shared, stop, still) = (Arc::clone(&self.shared), Arc::clone(&self.stop), Arc::clone(&live));
            let handshake_timeout = self.handshake_timeout;
            let spawned = std::thread::Builder::new().name(format!("nbd-conn-{id}")).spawn(move || {
                serve_connection(&shared, stream, &peer, handshake_timeout, &stop, id);
                stop.unregister(id);
                still.fetch_sub(1, Ordering::AcqRel);
            });
            match spawned {
                Ok(t) => threads.push(t),
                Err(e) => {
                    tracing::warn!("connection {id}: no thread for it: {e}");
                    self.stop.unregister(id);
                    live.fetch_sub(1, Ordering::AcqRel);
                }
            }
        };
        // Stop (also after a listener failure): no new connections, and
        // each live one stops reading and finishes what it has.
        self.stopper().stop();
        drop(self.listener);
        let finishing = threads.iter().filter(|t| !t.is_finished()).count();
        tracing::info!("stopping: {finishing} connection(s) finishing their requests in flight");
        for t in threads {
            let _ = t.join();
        }
        if let Some(path) = &self.socket_path {
            let _ = std::fs::remove_file(path);
        }
        let flushed = if self.shared.volume.read_only() { Ok(()) } else { self.shared.volume.flush() };
        match (&result, &flushed) {
            (_, Err(_)) if self.stop.given_up.load(Ordering::Acquire) => tracing::error!(
                "gave up waiting: volume {:?} not flushed (writes answered since its last flush may not be durable on the target)",
                self.shared.export.name
            ),
            (_, Err(e)) => tracing::error!("the final flush of volume {:?} failed: {e}", self.shared.export.name),
            (Ok(()), Ok(())) => tracing::info!("stopped; volume {:?} flushed", self.shared.export.name),
            (Err(_), Ok(())) => {}
        }
        result.and(flushed)
    }
}

/// Negotiates with one client and serves it until it disconnects or the
/// server stops. Every way it ends is logged.
fn serve_connection(shared: &conn::Shared, stream: Stream, peer: &str, handshake_timeout: Duration, stop: &Stop, id: u64) {
    tracing::info!("{peer}: connected");
    match handshake::negotiate(&stream, &shared.export, peer, handshake_timeout) {
        Ok(true) => {}
        Ok(false) => return,
        Err(reason) => {
            tracing::warn!("{peer}: closing during negotiation: {reason}");
            return;
        }
    }
    // The negotiation's timeouts give way to transmission's.
    if let Err(e) = stream.set_read_timeout(None).and(stream.set_write_timeout(Some(SEND_TIMEOUT))) {
        tracing::warn!("{peer}: closing, cannot set the socket's timeouts: {e}");
        return;
    }
    // From here the stop no longer ends the socket's reading: the
    // connection watches the stop itself and answers what comes after it
    // NBD_ESHUTDOWN (see `conn`). (Stopped before this: its reading is
    // ended; what was sent before is answered all the same.)
    stop.unregister(id);
    conn::serve(shared, stream, peer, conn::StopSignal { flag: &stop.stopping, fd: stop.fd.as_fd() });
}

/// Binds a unix socket at `path`. An existing socket nobody listens on
/// (left by a server that died) is replaced; a live one, or any other kind
/// of file, is refused.
fn bind_unix(path: &Path) -> Result<UnixListener> {
    match std::fs::symlink_metadata(path) {
        Ok(meta) if meta.file_type().is_socket() => {
            if UnixStream::connect(path).is_ok() {
                return Err(Error::invalid(format!("{} is a socket another server listens on", path.display())));
            }
            std::fs::remove_file(path)
                .map_err(|e| Error::io(format!("removing the stale socket {}", path.display()), e))?;
        }
        Ok(_) => {
            return Err(Error::invalid(format!(
                "{} exists and is not a socket: refusing to replace it",
                path.display()
            )))
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(Error::io(format!("inspecting {}", path.display()), e)),
    }
    UnixListener::bind(path).map_err(|e| Error::io(format!("listening on {}", path.display()), e))
}

/// Percent-encodes what is not an unreserved URI character.
fn uri_escape(s: &str) -> String {
    let mut out = String::new();
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uris_escape_what_they_must() {
        assert_eq!(uri_escape("vol0"), "vol0");
        assert_eq!(uri_escape("a b/c?"), "a%20b%2Fc%3F");
    }

    #[test]
    fn a_unix_socket_never_replaces_another_file() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("plain");
        std::fs::write(&file, b"keep me").unwrap();
        let e = bind_unix(&file).expect_err("a plain file is refused").to_string();
        assert!(e.contains("is not a socket"), "{e}");
        assert_eq!(std::fs::read(&file).unwrap(), b"keep me");
        let sock = dir.path().join("s");
        let live = bind_unix(&sock).unwrap();
        let e = bind_unix(&sock).expect_err("a live socket is refused").to_string();
        assert!(e.contains("another server listens"), "{e}");
        drop(live);
        // Left behind by a server that is gone: replaced.
        bind_unix(&sock).unwrap();
    }
}
