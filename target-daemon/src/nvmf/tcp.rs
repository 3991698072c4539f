//! The NVMe/TCP transport (NVMe/TCP Transport Specification 1.0): one
//! thread per connection, which is one NVMe queue.
//!
//! Receiving: PDUs are read into a 16 KiB buffer, so that one `recv`
//! carries many command capsules. An I/O queue whose ring can receive
//! (`Uring::arm_recv`) arms that receive before it sleeps, so a command's
//! bytes arrive with the wake-up itself and no `recv` call is made; the
//! ring's buffer is copied into this one (capsules: small). Every header is checked
//! ([`CommonHeader::layout`], [`Pdu::decode`]: lengths, offsets, flags,
//! header digest) before a byte of its data is placed. Data goes to the
//! command's buffer, a pool chunk for reads and writes: what came in with
//! the header is copied (small: at most the buffer), the rest of a large
//! H2CData is received straight into the chunk. A data digest is checked
//! over the placed bytes; a wrong one fails that command (Data Transfer
//! Error), as Linux nvmet does. Anything that breaks the framing gets a
//! C2HTermReq carrying the offending header and the connection closes;
//! other connections are untouched.
//!
//! Sending: completions, C2HData and R2T PDUs queue up and leave with one
//! `writev` per turn; a read's data goes from its pool chunk to the socket
//! without a copy, and the chunk returns to the pool when it has left.

use std::collections::{HashSet, VecDeque};
use std::io::{IoSlice, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rdmablk_common::nvme::tcp::{
    digest, fes, CommonHeader, DataPdu, Digests, IcResp, Pdu, PduType, R2t, TermReq, CAPSULE_CMD_HLEN, CH_SIZE,
    DIGEST_SIZE, IC_SIZE, MAX_HEADER, MAX_TERM_PLEN, SHORT_HLEN,
};
use rdmablk_common::nvme::WireError;

use super::queue::{Action, Buf, H2cRefusal, Queue, WakeSource};
use super::{CloseReason, QueueCloser, Subsystem, MAX_TRANSFER};
use crate::config::NvmeTransport;
use crate::engine::pool::ChunkId;
use crate::session::{Admission, ConnectionSlot, HandshakeSlot};
use crate::sys::{Epoll, READABLE, WRITABLE};

/// Bytes one receive call may bring in before a header is parsed.
const RX_BUFFER: usize = 16 << 10;
/// MAXH2CDATA offered in ICResp: one R2T covers a whole command.
pub const MAXH2CDATA: u32 = MAX_TRANSFER;
/// How long a closing connection may take to send its last PDUs.
const CLOSE_GRACE: Duration = Duration::from_secs(2);
/// Answers (PDUs) a connection may have waiting to be sent, beyond what the
/// socket buffers hold. A host keeps at most its queue size in flight (a
/// few PDUs each); one that sends commands and reads no answers would make
/// this grow without end, so past it the connection is closed.
const MAX_UNSENT: usize = 4096;

const TOKEN_SOCKET: u64 = 0;
const TOKEN_WAKE: u64 = 1;
const TOKEN_ENGINE: u64 = 2;

/// A broken connection: the termination request to send, if any, and why.
struct Fatal {
    fes: Option<(u16, u32)>,
    header: Vec<u8>,
    why: CloseReason,
}

impl Fatal {
    /// The connection closes without a termination request.
    fn closed(why: impl Into<CloseReason>) -> Fatal {
        Fatal { fes: None, header: Vec::new(), why: why.into() }
    }
}

/// Where the data of the PDU being received goes.
#[derive(Clone, Copy, Debug)]
enum Dest {
    /// Command `slot`'s buffer from `offset`; `h2c_last`: an H2CData PDU
    /// (Some(LAST_PDU)) or in-capsule data (None).
    Command { slot: u16, offset: u32, h2c_last: Option<bool> },
    Discard,
}

#[derive(Clone, Copy, Debug)]
enum Rx {
    Header,
    Data { dest: Dest, pad: usize, len: u32, placed: u32, digest: bool },
}

enum TxBody {
    None,
    Chunk(ChunkId, usize),
    Heap(Vec<u8>),
}

struct TxItem {
    head: [u8; MAX_HEADER],
    head_len: usize,
    body: TxBody,
    trailer: Option<[u8; DIGEST_SIZE]>,
}

impl TxItem {
    fn len(&self) -> usize {
        self.head_len
            + match &self.body {
                TxBody::None => 0,
                TxBody::Chunk(_, n) => *n,
                TxBody::Heap(v) => v.len(),
            }
            + self.trailer.map_or(0, |t| t.len())
    }
}

struct Connection {
    stream: TcpStream,
    q: Queue,
    /// Negotiated by ICReq/ICResp (None before).
    digests: Option<Digests>,
    /// Where C2HData's data starts: the host's HPDA, rounded.
    data_align: usize,
    rx: Vec<u8>,
    rx_start: usize,
    rx_end: usize,
    state: Rx,
    /// The header of the PDU whose data is being received (for a termination).
    last_header: Vec<u8>,
    tx: VecDeque<TxItem>,
    /// Bytes of the first queued item already sent.
    tx_sent: usize,
    epoll: Epoll,
    watching_write: bool,
    watched: HashSet<i32>,
    closing: Option<CloseReason>,
    /// Bytes the ring's socket receive was asked for (it is armed).
    ring_asked: usize,
    /// Counts against the handshake limits until Connect succeeds.
    handshake: Option<HandshakeSlot>,
    /// Counts against `max_connections_per_address` while the connection lives.
    _connection: ConnectionSlot,
}

/// Serves one NVMe/TCP connection until it closes.
pub fn serve(stream: TcpStream, peer: SocketAddr, port: u16, sub: Arc<Subsystem>, admission: Admission) {
    let local = stream.local_addr().unwrap_or(peer);
    let setup = || -> std::io::Result<Epoll> {
        stream.set_nodelay(true)?;
        stream.set_nonblocking(true)?;
        let epoll = Epoll::new()?;
        epoll.add(std::os::fd::AsRawFd::as_raw_fd(&stream), TOKEN_SOCKET)?;
        Ok(epoll)
    };
    let epoll = match setup() {
        Ok(e) => e,
        Err(e) => {
            tracing::warn!("nvme+tcp {peer}: cannot set up the connection: {e}");
            return;
        }
    };
    let mut q = Queue::new(Arc::clone(&sub), NvmeTransport::Tcp, port, local, peer);
    q.closer = stream.try_clone().ok().map(QueueCloser::Tcp);
    q.wake_fd = Some(epoll.fd());
    q.socket_fd = Some((std::os::fd::AsRawFd::as_raw_fd(&stream), RX_BUFFER));
    let mut c = Connection {
        stream,
        q,
        digests: None,
        data_align: 0,
        rx: vec![0; RX_BUFFER + MAX_HEADER],
        rx_start: 0,
        rx_end: 0,
        state: Rx::Header,
        last_header: Vec::new(),
        tx: VecDeque::new(),
        tx_sent: 0,
        epoll,
        watching_write: false,
        watched: HashSet::new(),
        closing: None,
        ring_asked: 0,
        handshake: Some(admission.handshake),
        _connection: admission.connection,
    };
    let why = c.run();
    c.finish(&why);
}

impl Connection {
    fn run(&mut self) -> CloseReason {
        let handshake_due = Instant::now() + self.q.sub.cfg.handshake_timeout;
        let mut close_due: Option<Instant> = None;
        let mut tokens = Vec::new();
        loop {
            self.drain_actions();
            if let Err(f) = self.flush_tx() {
                return f.why;
            }
            if let Some(why) = &self.closing {
                if self.tx.is_empty() {
                    return why.clone();
                }
                let due = *close_due.get_or_insert_with(|| Instant::now() + CLOSE_GRACE);
                if Instant::now() >= due {
                    return why.map(|w| format!("{w} (the host did not take the last PDUs)"));
                }
            }
            // A ring the thread sleeps in submits as it sleeps.
            if let Some(e) = self.q.engine.as_mut().filter(|e| !e.sleeps_in_ring()) {
                if let Err(e) = e.submit() {
                    return format!("io_uring: {e}").into();
                }
            }
            self.watch_new_fds();
            if self.q.conn.is_some() {
                self.handshake = None;
            }
            let mut timeout = match self.q.sleep_limit(handshake_due) {
                Ok(t) => t,
                Err(why) => return why.into(),
            };
            if self.closing.is_some() {
                timeout = Some(Duration::from_millis(20));
            }
            match self.q.engine.as_mut().filter(|e| e.sleeps_in_ring()) {
                // An I/O queue sleeps in its ring: a disk completion wakes
                // it without an eventfd, and epoll is asked which
                // descriptor fired only when the wake poll did.
                Some(_) => {
                    self.arm_ring_recv();
                    let engine = self.q.engine.as_mut().expect("matched above");
                    if let Err(e) = engine.sleep(timeout) {
                        return format!("io_uring: {e}").into();
                    }
                    self.q.reap();
                    let received = match self.take_ring_bytes() {
                        Ok(r) => r,
                        Err(f) => {
                            self.fail(f);
                            false
                        }
                    };
                    let direct = self.takes_data_directly();
                    let engine = self.q.engine.as_mut().expect("matched above");
                    let woken = engine.take_wake();
                    tokens.clear();
                    if woken && engine.wait_fds().next().is_none() {
                        // The socket is all the epoll set holds until a
                        // blocking worker starts: no need to ask which
                        // descriptor fired (a system call per I/O at QD1).
                        // If the ring's receive took the bytes that made it
                        // readable, there is nothing left to read.
                        if !received || direct {
                            tokens.push(TOKEN_SOCKET);
                        }
                    } else if woken {
                        if let Err(e) = self.epoll.wait(&mut tokens, Some(Duration::ZERO)) {
                            return format!("epoll: {e}").into();
                        }
                    }
                }
                None => {
                    if let Err(e) = self.epoll.wait(&mut tokens, timeout) {
                        return format!("epoll: {e}").into();
                    }
                }
            }
            for &t in &tokens {
                match t {
                    TOKEN_SOCKET if self.closing.is_none() => {
                        if let Err(f) = self.receive() {
                            self.fail(f);
                        }
                    }
                    TOKEN_WAKE => self.q.woken_by(WakeSource::Controller),
                    TOKEN_ENGINE => self.q.woken_by(WakeSource::Engine),
                    _ => {}
                }
            }
            self.q.reap();
            if self.q.is_admin() {
                self.q.tick(Instant::now());
            }
        }
    }

    /// Registers the engine's and the controller's descriptors once they exist.
    fn watch_new_fds(&mut self) {
        for (fd, source) in self.q.wake_sources() {
            let token = match source {
                WakeSource::Engine => TOKEN_ENGINE,
                WakeSource::Controller => TOKEN_WAKE,
            };
            if self.watched.insert(fd) {
                if let Err(e) = self.epoll.add(fd, token) {
                    tracing::error!("nvme+tcp {}: epoll: {e}", self.q.peer);
                }
            }
        }
    }

    /// Queues a termination request (when there is one) and closes after it.
    fn fail(&mut self, f: Fatal) {
        if let Some((fes, fei)) = f.fes {
            let mut header = f.header;
            header.truncate(MAX_TERM_PLEN as usize - SHORT_HLEN);
            tracing::warn!("nvme+tcp {}: {} (termination request, FES {fes:#x})", self.q.peer, f.why);
            super::NvmeStats::add(&self.q.sub.stats.terminations, 1);
            self.queue_pdu(&Pdu::C2HTermReq(TermReq { fes, fei }), TxBody::Heap(header));
        } else if f.why.kind == super::CloseKind::HostStalled {
            tracing::warn!("nvme+tcp {}: {}; closing", self.q.peer, f.why);
        } else {
            tracing::debug!("nvme+tcp {}: {}", self.q.peer, f.why);
        }
        self.closing.get_or_insert(f.why);
    }

    /// Leaves the controller before the socket closes: a host that sees
    /// the close may at once connect the same queue id again, and must
    /// find it free (and the old queue's disk writes done).
    fn finish(&mut self, why: &CloseReason) {
        self.q.close(why);
        let _ = self.stream.shutdown(std::net::Shutdown::Both);
    }

    /// Whether the data being received goes straight from the socket into
    /// a command's buffer (the ring's receive is not used then).
    fn takes_data_directly(&self) -> bool {
        matches!(self.state, Rx::Data { dest: Dest::Command { .. }, .. })
    }

    /// Before an I/O queue sleeps: lets its ring receive the next bytes, if
    /// it can and nothing else reads the socket.
    fn arm_ring_recv(&mut self) {
        if self.closing.is_some() || self.takes_data_directly() {
            return;
        }
        let Some(engine) = self.q.engine.as_mut() else { return };
        if !engine.receives() || engine.recv_armed() {
            return;
        }
        if self.rx_start > 0 {
            self.rx.copy_within(self.rx_start..self.rx_end, 0);
            self.rx_end -= self.rx_start;
            self.rx_start = 0;
        }
        let room = (self.rx.len() - self.rx_end).min(RX_BUFFER);
        if room > 0 {
            self.ring_asked = room;
            engine.arm_recv(room);
        }
    }

    /// Takes what the ring's receive brought (after a reap) into the
    /// receive buffer and handles it as [`Connection::receive`] would.
    /// Returns whether there was any.
    fn take_ring_bytes(&mut self) -> Result<bool, Fatal> {
        let Some(engine) = self.q.engine.as_mut() else { return Ok(false) };
        let n = match engine.take_received() {
            None => return Ok(false),
            Some(Ok([])) => return Err(Fatal::closed(CloseReason::host_closed())),
            Some(Ok(bytes)) => {
                // `arm_ring_recv` asked for no more than the room left here.
                self.rx[self.rx_end..self.rx_end + bytes.len()].copy_from_slice(bytes);
                bytes.len()
            }
            Some(Err(errno)) => return Err(Fatal::closed(format!("receive: {}", std::io::Error::from_raw_os_error(errno)))),
        };
        self.rx_end += n;
        self.receive_from(n < self.ring_asked)?;
        Ok(true)
    }

    /// Reads what the socket has and handles every complete part.
    fn receive(&mut self) -> Result<(), Fatal> {
        if self.q.engine.as_ref().is_some_and(|e| e.recv_armed()) {
            // The ring reads the socket: its bytes come with the reap.
            return Ok(());
        }
        self.receive_from(false)
    }

    /// [`Connection::receive`], with `drained` when the socket is known to
    /// have been emptied by the last read.
    fn receive_from(&mut self, mut drained: bool) -> Result<(), Fatal> {
        // A read that returned less than it asked for emptied the socket:
        // the next read would only say EAGAIN, so wait for epoll (level
        // triggered: it reports at once what arrived since).
        loop {
            if self.closing.is_some() {
                return Ok(());
            }
            if self.q.actions.len() + self.tx.len() > MAX_UNSENT {
                return Err(Fatal::closed(CloseReason::host_stalled(format!(
                    "the host sends commands and does not read their answers ({MAX_UNSENT} PDUs unsent)"
                ))));
            }
            if self.parse()? {
                continue;
            }
            if drained {
                return Ok(());
            }
            // Data of a command with nothing buffered: straight into its buffer.
            if let Rx::Data { dest: Dest::Command { slot, offset, .. }, pad: 0, len, placed, .. } = self.state {
                if self.rx_start == self.rx_end && placed < len {
                    let buf = self.q.data_mut(slot, offset + placed, len - placed);
                    let asked = buf.len();
                    match (&self.stream).read(buf) {
                        Ok(0) => return Err(Fatal::closed(CloseReason::host_closed())),
                        Ok(n) => {
                            drained = n < asked;
                            if let Rx::Data { placed, .. } = &mut self.state {
                                *placed += n as u32;
                            }
                            continue;
                        }
                        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return Ok(()),
                        Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                        Err(e) => return Err(Fatal::closed(format!("receive: {e}"))),
                    }
                }
            }
            if self.rx_start > 0 {
                self.rx.copy_within(self.rx_start..self.rx_end, 0);
                self.rx_end -= self.rx_start;
                self.rx_start = 0;
            }
            let asked = self.rx.len() - self.rx_end;
            match (&self.stream).read(&mut self.rx[self.rx_end..]) {
                Ok(0) => return Err(Fatal::closed(CloseReason::host_closed())),
                Ok(n) => {
                    drained = n < asked;
                    self.rx_end += n;
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return Ok(()),
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(Fatal::closed(format!("receive: {e}"))),
            }
        }
    }

    fn max_plen(&self, t: PduType) -> u32 {
        let digests = 2 * DIGEST_SIZE as u32;
        match t {
            PduType::IcReq => IC_SIZE as u32,
            PduType::CapsuleCmd => CAPSULE_CMD_HLEN as u32 + digests + self.q.in_capsule_limit(),
            PduType::H2CData => SHORT_HLEN as u32 + digests + MAXH2CDATA,
            PduType::H2CTermReq => MAX_TERM_PLEN,
            _ => MAX_HEADER as u32,
        }
    }

    /// Handles buffered bytes; false when more must be read first.
    fn parse(&mut self) -> Result<bool, Fatal> {
        let avail = self.rx_end - self.rx_start;
        match self.state {
            Rx::Header => {
                if avail < CH_SIZE {
                    return Ok(false);
                }
                let b = &self.rx[self.rx_start..self.rx_end];
                let header_bytes = || b[..avail.min(MAX_HEADER)].to_vec();
                let ch = CommonHeader::decode(b).map_err(|e| invalid(&e, header_bytes()))?;
                let layout = ch.layout(self.digests, self.max_plen(ch.pdu_type)).map_err(|e| invalid(&e, header_bytes()))?;
                if avail < layout.header_with_digest {
                    return Ok(false);
                }
                // Copied, as `on_header` changes the connection; on the
                // stack, as every command's PDU comes here. No type's
                // header with its digest is longer than MAX_HEADER (the
                // ICReq's, which has none).
                let n = layout.header_with_digest;
                let mut copy = [0u8; MAX_HEADER];
                copy[..n].copy_from_slice(&b[..n]);
                let header = &copy[..n];
                let pdu = Pdu::decode(&ch, &layout, b).map_err(|e| invalid(&e, header.to_vec()))?;
                self.rx_start += layout.header_with_digest;
                let dest = self.on_header(pdu, layout.data_len as u32, header)?;
                if layout.data_len > 0 {
                    // Into the kept buffer, which keeps its capacity.
                    self.last_header.clear();
                    self.last_header.extend_from_slice(header);
                    self.state = Rx::Data {
                        dest,
                        pad: layout.data_offset - layout.header_with_digest,
                        len: layout.data_len as u32,
                        placed: 0,
                        digest: layout.data_digest,
                    };
                }
                Ok(true)
            }
            Rx::Data { dest, pad, len, placed, digest: has_digest } => {
                if pad > 0 {
                    let n = pad.min(avail);
                    if n == 0 {
                        return Ok(false);
                    }
                    self.rx_start += n;
                    self.state = Rx::Data { dest, pad: pad - n, len, placed, digest: has_digest };
                    return Ok(true);
                }
                if placed < len {
                    let n = ((len - placed) as usize).min(avail);
                    if n == 0 {
                        return Ok(false);
                    }
                    if let Dest::Command { slot, offset, .. } = dest {
                        let src = self.rx_start;
                        let target = self.q.data_mut(slot, offset + placed, n as u32);
                        target.copy_from_slice(&self.rx[src..src + n]);
                    }
                    self.rx_start += n;
                    self.state = Rx::Data { dest, pad, len, placed: placed + n as u32, digest: has_digest };
                    return Ok(true);
                }
                let mut good = true;
                if has_digest {
                    if avail < DIGEST_SIZE {
                        return Ok(false);
                    }
                    let got = u32::from_le_bytes(self.rx[self.rx_start..self.rx_start + DIGEST_SIZE].try_into().expect("4 bytes"));
                    self.rx_start += DIGEST_SIZE;
                    if let Dest::Command { slot, offset, .. } = dest {
                        good = digest(self.q.data_mut(slot, offset, len)) == got;
                    }
                }
                self.state = Rx::Header;
                if let Dest::Command { slot, h2c_last, .. } = dest {
                    if !good {
                        tracing::warn!("nvme+tcp {}: data digest error; the command fails", self.q.peer);
                        self.q.data_corrupt(slot);
                        return Ok(true);
                    }
                    let last = h2c_last.unwrap_or(true);
                    if let Err(why) = self.q.data_placed(slot, len, last) {
                        return Err(Fatal {
                            fes: Some((fes::PDU_SEQUENCE_ERROR, 0)),
                            header: std::mem::take(&mut self.last_header),
                            why: why.into(),
                        });
                    }
                }
                Ok(true)
            }
        }
    }

    /// A complete, checked header: where its data goes, or what it does.
    fn on_header(&mut self, pdu: Pdu, data_len: u32, header: &[u8]) -> Result<Dest, Fatal> {
        let sequence = |why: &str| Fatal { fes: Some((fes::PDU_SEQUENCE_ERROR, 0)), header: header.to_vec(), why: why.into() };
        if self.digests.is_none() && !matches!(pdu, Pdu::IcReq(_)) {
            return Err(sequence("a PDU before ICReq"));
        }
        match pdu {
            Pdu::IcReq(r) => {
                if self.digests.is_some() {
                    return Err(sequence("a second ICReq"));
                }
                let digests = r.digests;
                self.digests = Some(digests);
                // HPDA: the host wants data at multiples of (HPDA + 1) dwords.
                let align = (r.hpda as usize + 1) * 4;
                let header_with_digest = SHORT_HLEN + if digests.header { DIGEST_SIZE } else { 0 };
                self.data_align = header_with_digest.next_multiple_of(align);
                let resp = Pdu::IcResp(IcResp { pfv: 0, cpda: 0, digests, maxh2cdata: MAXH2CDATA });
                self.queue_pdu(&resp, TxBody::None);
                Ok(Dest::Discard)
            }
            Pdu::CapsuleCmd(sqe) => match self.q.command(sqe, data_len) {
                Some(slot) => Ok(Dest::Command { slot, offset: 0, h2c_last: None }),
                None => Ok(Dest::Discard),
            },
            Pdu::H2CData(d) => match self.q.check_h2c(d.ttag, d.cccid, d.offset, d.length) {
                Ok(slot) => Ok(Dest::Command { slot, offset: d.offset, h2c_last: Some(d.last) }),
                Err(why) => {
                    // FEI: the field at fault (CCCID at 8, TTAG at 10, DATAO at 12).
                    let (fes, fei) = match why {
                        H2cRefusal::OutOfRange => (fes::DATA_OUT_OF_RANGE, 12),
                        H2cRefusal::WrongCommand => (fes::INVALID_HEADER_FIELD, 8),
                        H2cRefusal::UnknownTag | H2cRefusal::NotRequested => (fes::INVALID_HEADER_FIELD, 10),
                    };
                    Err(Fatal { fes: Some((fes, fei)), header: header.to_vec(), why: format!("H2CData: {why}").into() })
                }
            },
            Pdu::H2CTermReq(t) => {
                Err(Fatal::closed(format!("the host terminated the connection (FES {:#x}, FEI {:#x})", t.fes, t.fei)))
            }
            _ => Err(Fatal {
                fes: Some((fes::INVALID_HEADER_FIELD, 0)),
                header: header.to_vec(),
                why: format!("a {:?} PDU from a host", pdu.pdu_type()).into(),
            }),
        }
    }

    fn queue_pdu(&mut self, pdu: &Pdu, body: TxBody) {
        let digests = self.digests.unwrap_or_default();
        let data_len = match &body {
            TxBody::None => 0,
            TxBody::Chunk(_, n) => *n,
            TxBody::Heap(v) => v.len(),
        };
        let mut head = [0u8; MAX_HEADER];
        let (at, _) = pdu.encode(digests, data_len as u32, self.data_align, &mut head);
        let trailer = (digests.data && data_len > 0 && pdu.pdu_type().digested()).then(|| {
            let bytes = match &body {
                TxBody::None => &[][..],
                TxBody::Chunk(c, n) => &self.q.engine.as_ref().expect("engine").bytes(*c)[..*n],
                TxBody::Heap(v) => &v[..],
            };
            digest(bytes).to_le_bytes()
        });
        self.tx.push_back(TxItem { head, head_len: at, body, trailer });
    }

    /// Turns the queue's actions into PDUs.
    fn drain_actions(&mut self) {
        let mut batch = self.q.take_actions();
        for a in batch.drain(..) {
            match a {
                Action::Respond(cqe, _) => self.queue_pdu(&Pdu::CapsuleResp(cqe), TxBody::None),
                Action::SendData { cid, buf, len, then, .. } => {
                    let body = match buf {
                        Buf::Chunk(c) => TxBody::Chunk(c, len as usize),
                        Buf::Heap(mut v) => {
                            v.truncate(len as usize);
                            TxBody::Heap(v)
                        }
                        Buf::None => TxBody::None,
                    };
                    let d = DataPdu { cccid: cid, ttag: 0, offset: 0, length: len, last: true, success: false };
                    self.queue_pdu(&Pdu::C2HData(d), body);
                    self.queue_pdu(&Pdu::CapsuleResp(then), TxBody::None);
                }
                Action::RequestData { cid, ttag, len } => {
                    self.queue_pdu(&Pdu::R2T(R2t { cccid: cid, ttag, offset: 0, length: len }), TxBody::None);
                }
                Action::Close(why) => {
                    self.closing.get_or_insert(why);
                }
            }
        }
        self.q.actions_done(batch);
    }

    /// Sends what is queued, as far as the socket takes it.
    fn flush_tx(&mut self) -> Result<(), Fatal> {
        while !self.tx.is_empty() {
            let written = {
                // The three parts of each of the first ITEMS items, on the stack.
                const ITEMS: usize = 16;
                let mut slices = [IoSlice::new(&[]); ITEMS * 3];
                let mut count = 0;
                let mut skip = self.tx_sent;
                for item in self.tx.iter().take(ITEMS) {
                    let body: &[u8] = match &item.body {
                        TxBody::None => &[],
                        TxBody::Chunk(c, n) => &self.q.engine.as_ref().expect("engine").bytes(*c)[..*n],
                        TxBody::Heap(v) => v,
                    };
                    let trailer: &[u8] = item.trailer.as_ref().map_or(&[], |t| &t[..]);
                    for part in [&item.head[..item.head_len], body, trailer] {
                        if skip >= part.len() {
                            skip -= part.len();
                            continue;
                        }
                        slices[count] = IoSlice::new(&part[skip..]);
                        count += 1;
                        skip = 0;
                    }
                }
                match (&self.stream).write_vectored(&slices[..count]) {
                    Ok(0) => return Err(Fatal::closed("send: the connection is closed")),
                    Ok(n) => n,
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                        self.watch_write(true);
                        return Ok(());
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => 0,
                    Err(e) => return Err(Fatal::closed(format!("send: {e}"))),
                }
            };
            self.tx_sent += written;
            while let Some(front) = self.tx.front() {
                let len = front.len();
                if self.tx_sent < len {
                    break;
                }
                self.tx_sent -= len;
                let item = self.tx.pop_front().expect("front exists");
                if let TxBody::Chunk(c, _) = item.body {
                    self.q.sent(c);
                }
            }
        }
        self.watch_write(false);
        Ok(())
    }

    fn watch_write(&mut self, on: bool) {
        if self.watching_write == on {
            return;
        }
        self.watching_write = on;
        let events = READABLE | if on { WRITABLE } else { 0 };
        let fd = std::os::fd::AsRawFd::as_raw_fd(&self.stream);
        if let Err(e) = self.epoll.modify(fd, TOKEN_SOCKET, events) {
            tracing::error!("nvme+tcp {}: epoll: {e}", self.q.peer);
        }
    }
}

/// A header that does not hold together: the termination names the field.
fn invalid(e: &WireError, header: Vec<u8>) -> Fatal {
    let (fes, fei) = match e {
        WireError::HeaderDigest { .. } => (fes::HEADER_DIGEST_ERROR, 0),
        WireError::InvalidField { field, .. } => (fes::INVALID_HEADER_FIELD, field_offset(field)),
        WireError::UnknownPduType(_) => (fes::INVALID_HEADER_FIELD, 0),
        WireError::ReservedNotZero { offset, .. } => (fes::INVALID_HEADER_FIELD, *offset as u32),
        _ => (fes::INVALID_HEADER_FIELD, 0),
    };
    Fatal { fes: Some((fes, fei)), header, why: e.to_string().into() }
}

/// Byte offset of a common-header or PDU field, for FEI.
fn field_offset(field: &str) -> u32 {
    match field {
        "FLAGS" => 1,
        "HLEN" => 2,
        "PDO" => 3,
        "PLEN" => 4,
        "PFV" => 8,
        "HPDA" => 10,
        "DGST" => 11,
        "DATAL" => 16,
        _ => 0,
    }
}
