//! The passive side: a nonblocking listening socket, and connection
//! requests driven through the hello without ever blocking.

use std::collections::{HashMap, VecDeque};
use std::io::{self, Write};
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::sync::{Mutex};
use std::time::{Duration, Instant};

use super::cq::TcpCq;
use super::mr::TcpPd;
use super::qp::TcpQp;
use super::sys;
use super::wire::{self, FrameType, Header, HDR_LEN, HELLO_MAX};
use crate::fabric::{lock, FabricError, FabricOptions, FabricUrl, ProviderKind, QpCaps, Result};

/// A client must complete its hello within this time.
pub(crate) const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Connections still in their hello beyond this number are refused.
const MAX_PENDING: usize = 1024;

const TOKEN_LISTEN: u64 = 0;
const TOKEN_TIMER: u64 = 1;
const TOKEN_READY: u64 = 2;
const FIRST_PENDING_TOKEN: u64 = 3;

/// A connection whose hello is still arriving.
struct Pending {
    stream: TcpStream,
    peer: SocketAddr,
    buf: [u8; HDR_LEN + HELLO_MAX],
    got: usize,
    /// Header plus body, known once the header is in.
    need: usize,
    deadline: Instant,
}

struct Inner {
    sock: std::net::TcpListener,
    pending: HashMap<u64, Pending>,
    next_token: u64,
    ready: VecDeque<TcpConnectRequest>,
}

/// A listener of the tcp provider.
///
/// Its fd is an epoll set over the listening socket, the sockets still in
/// their hello, a timerfd armed for the earliest handshake deadline, and an
/// eventfd that stays readable while complete requests wait to be returned.
pub struct TcpListener {
    url: FabricUrl,
    epfd: OwnedFd,
    timerfd: OwnedFd,
    readyfd: OwnedFd,
    handshake_timeout: Duration,
    /// For the queue pairs made from its requests.
    options: FabricOptions,
    inner: Mutex<Inner>,
}

impl TcpListener {
    pub(crate) fn bind(url: &FabricUrl, handshake_timeout: Duration, options: FabricOptions) -> Result<TcpListener> {
        let sock = std::net::TcpListener::bind(url.host_port())
            .map_err(|e| FabricError::io(format!("listening on {url}"), e))?;
        sock.set_nonblocking(true).map_err(|e| FabricError::io("O_NONBLOCK on the listener", e))?;
        sys::deepen_listen_backlog(sock.as_raw_fd()).map_err(|e| FabricError::io(format!("listening on {url}"), e))?;
        let local = sock.local_addr().map_err(|e| FabricError::io("getsockname on the listener", e))?;
        let epfd = sys::epoll_create().map_err(|e| FabricError::io("epoll_create1 for a listener", e))?;
        let timerfd = sys::timerfd().map_err(|e| FabricError::io("timerfd for a listener", e))?;
        let readyfd = sys::eventfd().map_err(|e| FabricError::io("eventfd for a listener", e))?;
        for (fd, token) in
            [(sock.as_raw_fd(), TOKEN_LISTEN), (timerfd.as_raw_fd(), TOKEN_TIMER), (readyfd.as_raw_fd(), TOKEN_READY)]
        {
            sys::epoll_add_in(epfd.as_raw_fd(), fd, token).map_err(|e| FabricError::io("epoll_ctl for a listener", e))?;
        }
        Ok(TcpListener {
            url: FabricUrl { provider: ProviderKind::Tcp, host: local.ip().to_string(), port: local.port() },
            epfd,
            timerfd,
            readyfd,
            handshake_timeout,
            options,
            inner: Mutex::new(Inner { sock, pending: HashMap::new(), next_token: FIRST_PENDING_TOKEN, ready: VecDeque::new() }),
        })
    }

    pub fn fd(&self) -> RawFd {
        self.epfd.as_raw_fd()
    }

    pub fn local_url(&self) -> FabricUrl {
        self.url.clone()
    }

    /// Accepts new sockets, advances the hellos that have input, expires
    /// late ones and returns one complete request. Never blocks.
    pub fn poll_request(&self) -> Result<Option<TcpConnectRequest>> {
        let mut g = lock(&self.inner);
        let inner = &mut *g;
        let epfd = self.epfd.as_raw_fd();
        sys::counter_drain(self.timerfd.as_raw_fd());
        sys::counter_drain(self.readyfd.as_raw_fd());

        let mut accept_err = None;
        loop {
            match inner.sock.accept() {
                Ok((stream, peer)) => {
                    if inner.pending.len() >= MAX_PENDING {
                        tracing::warn!(%peer, "too many connections in their handshake; refusing");
                        continue;
                    }
                    let setup = stream.set_nonblocking(true).and_then(|()| stream.set_nodelay(true));
                    if let Err(e) = setup {
                        tracing::warn!(%peer, error = %e, "configuring an accepted socket failed");
                        continue;
                    }
                    let token = inner.next_token;
                    inner.next_token += 1;
                    if let Err(e) = sys::epoll_add_in(epfd, stream.as_raw_fd(), token) {
                        tracing::warn!(%peer, error = %e, "epoll_ctl for an accepted socket failed");
                        continue;
                    }
                    let deadline = Instant::now() + self.handshake_timeout;
                    inner.pending.insert(
                        token,
                        Pending { stream, peer, buf: [0; HDR_LEN + HELLO_MAX], got: 0, need: HDR_LEN, deadline },
                    );
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::Interrupted | io::ErrorKind::ConnectionAborted | io::ErrorKind::ConnectionReset
                    ) => {}
                Err(e) => {
                    // EMFILE and friends: report, after serving what we can.
                    accept_err = Some(e);
                    break;
                }
            }
        }

        let mut events = [sys::EMPTY_EVENT; 64];
        let n = sys::epoll_wait(epfd, &mut events, 0).map_err(|e| FabricError::io("epoll_wait on a listener", e))?;
        for ev in &events[..n] {
            let token = ev.u64;
            if token < FIRST_PENDING_TOKEN {
                continue;
            }
            let Some(p) = inner.pending.get_mut(&token) else { continue };
            match advance(p) {
                Ok(false) => {}
                Ok(true) => {
                    let p = inner.pending.remove(&token).expect("present");
                    sys::epoll_del(epfd, p.stream.as_raw_fd());
                    let peer = p.peer;
                    match finish(p, self.options) {
                        Ok(req) => inner.ready.push_back(req),
                        Err(why) => tracing::warn!(%peer, "refusing a connection: {why}"),
                    }
                }
                Err(why) => {
                    let p = inner.pending.remove(&token).expect("present");
                    tracing::warn!(peer = %p.peer, "dropping a connection in its handshake: {why}");
                    sys::epoll_del(epfd, p.stream.as_raw_fd());
                }
            }
        }

        let now = Instant::now();
        inner.pending.retain(|_, p| {
            let alive = p.deadline > now;
            if !alive {
                tracing::warn!(peer = %p.peer, "connection did not complete its hello in time");
                sys::epoll_del(epfd, p.stream.as_raw_fd());
            }
            alive
        });
        let next = inner.pending.values().map(|p| p.deadline).min();
        sys::timerfd_set(self.timerfd.as_raw_fd(), next.map(|d| d.saturating_duration_since(now)))
            .map_err(|e| FabricError::io("timerfd_settime on a listener", e))?;

        let req = inner.ready.pop_front();
        if !inner.ready.is_empty() {
            sys::eventfd_signal(self.readyfd.as_raw_fd());
        }
        if req.is_none() {
            if let Some(e) = accept_err {
                return Err(FabricError::io(format!("accept on {}", self.url), e));
            }
        }
        Ok(req)
    }
}

/// Reads what is available of a hello. Ok(true) once complete.
fn advance(p: &mut Pending) -> std::result::Result<bool, String> {
    loop {
        match sys::read(p.stream.as_raw_fd(), &mut p.buf[p.got..p.need]) {
            Ok(0) => return Err("peer closed".to_owned()),
            Ok(k) => p.got += k,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(false),
            Err(e) => return Err(e.to_string()),
        }
        if p.got == HDR_LEN && p.need == HDR_LEN {
            let mut raw = [0u8; HDR_LEN];
            raw.copy_from_slice(&p.buf[..HDR_LEN]);
            let h = Header::decode(&raw).map_err(|e| format!("malformed hello header: {e}"))?;
            if h.ty != FrameType::Hello {
                return Err(format!("expected HELLO, got {:?}", h.ty));
            }
            // decode bounds a hello body at HELLO_MAX.
            p.need = HDR_LEN + h.length as usize;
        }
        if p.got == p.need && p.need > HDR_LEN {
            return Ok(true);
        }
    }
}

fn finish(p: Pending, options: FabricOptions) -> std::result::Result<TcpConnectRequest, String> {
    let body = wire::decode_hello_body(&p.buf[HDR_LEN..p.need])?;
    Ok(TcpConnectRequest {
        private_data: body.private.to_vec(),
        peer_caps: body.caps,
        peer: p.peer.to_string(),
        stream: p.stream,
        options,
    })
}

/// A complete hello, not yet accepted or rejected.
pub struct TcpConnectRequest {
    stream: TcpStream,
    peer: String,
    private_data: Vec<u8>,
    #[allow(dead_code)]
    peer_caps: QpCaps,
    options: FabricOptions,
}

impl TcpConnectRequest {
    pub fn private_data(&self) -> &[u8] {
        &self.private_data
    }

    /// The hello carries its own length: the same bytes.
    pub fn raw_private_data(&self) -> &[u8] {
        &self.private_data
    }

    pub fn reject_raw(self, private_data: &[u8]) {
        self.reject(private_data)
    }

    pub fn peer(&self) -> String {
        self.peer.clone()
    }

    pub fn local_addr(&self) -> Option<std::net::SocketAddr> {
        self.stream.local_addr().ok()
    }

    pub fn into_queue_pair(self, pd: &TcpPd, cq: &TcpCq, caps: QpCaps) -> Result<TcpQp> {
        TcpQp::new(pd, cq, caps, None, Some((self.stream, self.peer)), self.options)
    }

    /// Sends HELLO_REPLY(reject) and closes. Best effort: the socket is
    /// nonblocking and the reply small enough for an empty send buffer.
    pub fn reject(self, private_data: &[u8]) {
        let reply = wire::encode_hello(FrameType::HelloReply, wire::STATUS_REJECT, &QpCaps::default(), private_data);
        if let Err(e) = (&self.stream).write_all(reply.as_bytes()) {
            tracing::debug!(peer = %self.peer, error = %e, "sending a reject failed");
        }
        let _ = self.stream.shutdown(Shutdown::Write);
    }
}
