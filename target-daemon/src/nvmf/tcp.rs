//! The NVMe/TCP transport (NVMe/TCP Transport Specification 1.0): one
//! [`NvmeTcp`] per reactor holds the connections (one NVMe queue each)
//! placed there; no thread of its own.
//!
//! Receiving: where the reactor's ring can receive (`Uring::arm_recv`),
//! each connection keeps one receive armed in the ring, so a command's
//! bytes arrive with the reactor's wake-up and no `recv` call is made;
//! otherwise the socket sits in the reactor's epoll set and is read when
//! ready. PDUs are read into the connection's receive buffer, so that one
//! receive carries many command capsules; the buffer grows with the
//! connection (a few hundred bytes before ICReq, 4 KiB until an I/O
//! queue's Connect, then 16 KiB), so a connection in its handshake costs
//! little. Every header is checked ([`CommonHeader::layout`],
//! [`Pdu::decode`]: lengths, offsets, flags, header digest) before a byte
//! of its data is placed. Data goes to the command: in-capsule data to its
//! staging buffer, H2CData to the pool chunk the executor granted for the
//! piece asked for (what came in with the header is copied, the rest of a
//! large H2CData is received straight into the chunk). A data digest is
//! checked over the placed bytes; a wrong one fails that command (Data
//! Transfer Error), as Linux nvmet does. Anything that breaks the framing
//! gets a C2HTermReq carrying the offending header and the connection
//! closes; other connections are untouched.
//!
//! Sending: completions, C2HData and R2T PDUs queue up and leave with one
//! `writev` per connection and turn; a read's data goes from its pool
//! chunk to the socket without a copy, and the chunk returns to the
//! executor when it has left. A connection whose socket takes no more
//! waits in the epoll set for room.
//!
//! Closing: the connection stops reading, sends what it answered (within
//! a grace period), drops its other commands (what reached the disk runs
//! to its end), leaves its controller once the executor has nothing of it
//! left, and only then shuts its socket: a host that sees the close may at
//! once connect the same queue id again, and finds it free.

use std::any::Any;
use std::collections::VecDeque;
use std::io::{IoSlice, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rdmablk_common::nvme::tcp::{
    digest, fes, CommonHeader, DataPdu, Digests, IcResp, Pdu, PduType, R2t, TermReq, CAPSULE_CMD_HLEN, CH_SIZE,
    DIGEST_SIZE, IC_SIZE, MAX_HEADER, MAX_TERM_PLEN, SHORT_HLEN,
};
use rdmablk_common::nvme::WireError;

use super::queue::{Action, Buf, Due, H2cRefusal, Queue};
use super::{CloseKind, CloseReason, Incoming, Subsystem, MAX_HEAP_DATA};
use crate::config::NvmeTransport;
use crate::engine::exec::{CmdId, Event, Executor};
use crate::engine::pool::ChunkId;
use crate::engine::uring::{RecvId, RecvInto};
use crate::reactor::{Runtime, Transport};
use crate::registry::{Admission, ConnectionSlot, HandshakeSlot, Protocol, Seen};
use crate::sys::{READABLE, WRITABLE};

/// Receive buffer of an I/O queue: one receive call may bring in this much
/// (plus a header) before it is parsed.
const RX_BUFFER: usize = 16 << 10;
/// Receive buffer of a connection before ICReq: the ICReq.
const RX_HANDSHAKE: usize = 2 * MAX_HEADER;
/// Receive buffer of an admin queue (and of a queue before its Connect).
const RX_ADMIN: usize = 4 << 10;
/// MAXH2CDATA offered in ICResp: the largest H2CData PDU. An R2T asks for
/// one piece of a write (a pool chunk's worth at most), which the host
/// splits into PDUs of at most this; their data goes straight into the
/// chunk, so this bounds neither MDTS nor memory (128 KiB: the default
/// chunk, one PDU per R2T).
pub const MAXH2CDATA: u32 = MAX_HEAP_DATA;
/// How long a closing connection may take to send its last PDUs.
const CLOSE_GRACE: Duration = Duration::from_secs(2);
/// Answers (PDUs) a connection may have waiting to be sent, beyond what the
/// socket buffers hold. A host keeps at most its queue size in flight (a
/// few PDUs each); one that sends commands and reads no answers would make
/// this grow without end, so past it the connection is closed.
const MAX_UNSENT: usize = 4096;

/// A new NVMe/TCP connection for a reactor; it holds a handshake slot
/// until its Connect succeeds.
pub struct Accept {
    stream: TcpStream,
    peer: SocketAddr,
    port: u16,
    admission: Admission,
}

/// Accepts every pending connection of `listener` that the connection
/// limits admit.
pub fn accept(listener: &TcpListener, sub: &Arc<Subsystem>, port: u16, out: &mut Vec<Incoming>) {
    loop {
        match listener.accept() {
            Ok((stream, peer)) => {
                // The same connection limits as rdmablk v1's: handshakes
                // in progress (total and per address) and connections
                // per address.
                let admission = match sub.registry.begin_handshake(Protocol::Nvme, Some(peer.ip())) {
                    Ok(a) => a,
                    Err(why) => {
                        tracing::warn!("nvme+tcp: refused a connection from {peer}: {}", sub.registry.refusal_reason(Protocol::Nvme, why));
                        continue;
                    }
                };
                out.push(Incoming::Tcp(Accept { stream, peer, port, admission }));
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => {
                tracing::warn!("nvme+tcp: accept failed: {e}");
                break;
            }
        }
    }
}

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
    /// Command `slot`'s data from `offset`; `h2c_last`: an H2CData PDU
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
    Zero(ChunkId, usize),
    Heap(Vec<u8>),
}

struct TxItem {
    head: [u8; MAX_HEADER],
    head_len: usize,
    body: TxBody,
    trailer: Option<[u8; DIGEST_SIZE]>,
}

impl TxItem {
    fn body_len(&self) -> usize {
        match &self.body {
            TxBody::None => 0,
            TxBody::Chunk(_, n) | TxBody::Zero(_, n) => *n,
            TxBody::Heap(v) => v.len(),
        }
    }

    fn len(&self) -> usize {
        self.head_len + self.body_len() + self.trailer.map_or(0, |t| t.len())
    }
}

/// How the socket's bytes reach the connection.
enum Input {
    /// The socket is in the reactor's epoll set; read when ready.
    Epoll,
    /// The ring receives from it (fixed-file `slot`), one receive at a
    /// time, into the receive buffer or a command's chunk.
    Ring { slot: u32, armed: Option<(RecvId, RecvDest)> },
}

/// Where an armed ring receive puts its bytes.
#[derive(Clone, Copy, Debug)]
enum RecvDest {
    /// The receive buffer, at `rx_end`.
    Buffer,
    /// The data of the PDU being received, straight into its chunk.
    Chunk,
}

struct Conn {
    stream: TcpStream,
    q: Queue,
    /// Negotiated by ICReq/ICResp (None before).
    digests: Option<Digests>,
    /// Where C2HData's data starts: the host's HPDA, rounded.
    data_align: usize,
    /// The receive buffer; `None` while the ring holds it.
    rx: Option<Box<[u8]>>,
    rx_start: usize,
    rx_end: usize,
    state: Rx,
    /// The header of the PDU whose data is being received (for a termination).
    last_header: Vec<u8>,
    tx: VecDeque<TxItem>,
    /// Bytes of the first queued item already sent.
    tx_sent: usize,
    /// Since when what is queued has not moved (the socket took nothing):
    /// a host that reads nothing it is sent loses the connection, and the
    /// chunks queued to it, at `target.transport_timeout`.
    tx_stalled_since: Option<Instant>,
    input: Input,
    /// The socket is in the epoll set for room to send.
    watching_write: bool,
    /// Reading stopped: sending what is queued, then ending.
    closing: Option<CloseReason>,
    close_due: Option<Instant>,
    /// Nothing more is sent: waiting for the executor's last commands of
    /// the queue before it leaves its controller.
    draining: bool,
    /// Sending failed (the connection is gone): what is queued never leaves.
    send_failed: bool,
    /// Counts against the handshake limits until Connect succeeds.
    handshake: Option<HandshakeSlot>,
    /// Counts against `max_connections_per_address` while the connection lives.
    _connection: ConnectionSlot,
    /// In the transport's list of connections to flush this turn.
    dirty: bool,
}

struct Slot {
    gen: u16,
    c: Option<Conn>,
}

/// The NVMe/TCP transport of one reactor.
pub struct NvmeTcp {
    index: usize,
    sub: Arc<Subsystem>,
    conns: Vec<Slot>,
    free: Vec<u16>,
    /// Connections with something to send or to do this turn.
    dirty: Vec<u16>,
    /// The registry's generations this transport acted on: the fence's
    /// (controllers torn down) and the volume set's (namespace notices).
    seen: Seen,
    /// Connections with a Connect the fence holds.
    held: Vec<u16>,
    /// The earliest deadline of any connection, when known (recomputed
    /// by a pass over them when `deadlines_stale`).
    earliest: Option<Instant>,
    deadlines_stale: bool,
    /// Live connections (open or closing).
    live: usize,
}

impl NvmeTcp {
    pub fn new(index: usize, sub: Arc<Subsystem>) -> NvmeTcp {
        NvmeTcp {
            index,
            sub,
            conns: Vec::new(),
            free: Vec::new(),
            dirty: Vec::new(),
            seen: Seen::default(),
            held: Vec::new(),
            earliest: None,
            deadlines_stale: false,
            live: 0,
        }
    }

    fn key(&self, ci: u16) -> u64 {
        (self.conns[ci as usize].gen as u64) << 16 | ci as u64
    }

    /// The connection a key names, if it is still the one it named.
    fn conn_of_key(&self, key: u64) -> Option<u16> {
        let ci = key as u16;
        let slot = self.conns.get(ci as usize)?;
        (slot.gen == (key >> 16) as u16 && slot.c.is_some()).then_some(ci)
    }

    fn conn(&mut self, ci: u16) -> &mut Conn {
        self.conns[ci as usize].c.as_mut().expect("live connection")
    }

    fn mark_dirty(&mut self, ci: u16) {
        let c = self.conn(ci);
        if !c.dirty {
            c.dirty = true;
            self.dirty.push(ci);
        }
    }

    fn adopt_conn(&mut self, rt: &mut Runtime, a: Accept) {
        let Accept { stream, peer, port, admission } = a;
        let setup = stream.set_nodelay(true).and_then(|()| stream.set_nonblocking(true));
        if let Err(e) = setup {
            tracing::warn!("nvme+tcp {peer}: cannot set up the connection: {e}");
            return;
        }
        if rt.shutdown.is_some() {
            return;
        }
        let local = stream.local_addr().unwrap_or(peer);
        let ci = match self.free.pop() {
            Some(ci) => ci,
            None if self.conns.len() < u16::MAX as usize => {
                self.conns.push(Slot { gen: 0, c: None });
                (self.conns.len() - 1) as u16
            }
            None => {
                tracing::warn!("nvme+tcp {peer}: reactor {} holds as many connections as it can", rt.id);
                return;
            }
        };
        let key = self.key(ci);
        let fd = stream.as_raw_fd();
        // The ring receives where it can; otherwise epoll says when to read.
        let input = match rt.exec.engine_mut().register_socket(fd) {
            Some(slot) => Input::Ring { slot, armed: None },
            None => {
                if let Err(e) = rt.watch(self.index, fd, key, READABLE) {
                    tracing::warn!("nvme+tcp {peer}: epoll: {e}");
                    self.free.push(ci);
                    return;
                }
                Input::Epoll
            }
        };
        let mut q = Queue::new(Arc::clone(&self.sub), NvmeTransport::Tcp, port, local, peer);
        q.place(rt.id, self.index, ci, admission.connection.host_pool_account(rt.id).cloned());
        q.now = rt.turn_start;
        let handshake_due = q.handshake_due;
        self.conns[ci as usize].c = Some(Conn {
            stream,
            q,
            digests: None,
            data_align: 0,
            rx: Some(vec![0; RX_HANDSHAKE].into_boxed_slice()),
            rx_start: 0,
            rx_end: 0,
            state: Rx::Header,
            last_header: Vec::new(),
            tx: VecDeque::new(),
            tx_stalled_since: None,
            tx_sent: 0,
            input,
            watching_write: false,
            closing: None,
            close_due: None,
            draining: false,
            send_failed: false,
            handshake: Some(admission.handshake),
            _connection: admission.connection,
            dirty: false,
        });
        self.live += 1;
        self.earliest = Some(self.earliest.map_or(handshake_due, |e| e.min(handshake_due)));
        rt.stats.queue_pairs.add(1);
        // A ring receive is armed at the end of the turn.
        self.mark_dirty(ci);
    }

    // ---------------------------------------------------------------- receiving

    /// The socket is readable (epoll input) or writable.
    fn on_ready(&mut self, rt: &mut Runtime, ci: u16) {
        let c = self.conn(ci);
        if c.watching_write {
            self.mark_dirty(ci);
        }
        let c = self.conn(ci);
        if matches!(c.input, Input::Epoll) && c.closing.is_none() {
            if let Err(f) = self.receive_from(rt, ci, false) {
                self.fail(ci, f);
            }
            self.after_input(rt, ci);
        }
    }

    /// A ring receive of connection `ci` completed with `res`.
    fn on_received(&mut self, rt: &mut Runtime, ci: u16, res: i32) {
        let c = self.conn(ci);
        let Input::Ring { armed, .. } = &mut c.input else { return };
        let Some((id, dest)) = armed.take() else { return };
        let into = rt.exec.engine_mut().take_recv(id);
        match into {
            RecvInto::Buf(b) => c.rx = Some(b),
            // The chunk is the CPU's again; it stays the command's.
            RecvInto::Chunk(_) => {}
        }
        if c.closing.is_some() {
            // A receive cancelled (or not) as the connection closes: its
            // bytes are not looked at, and the close goes on.
            self.mark_dirty(ci);
            return;
        }
        let result = match res {
            0 => Err(Fatal::closed(CloseReason::host_closed())),
            n if n < 0 => Err(Fatal::closed(format!("receive: {}", std::io::Error::from_raw_os_error(-n)))),
            n => {
                let n = n as usize;
                match dest {
                    RecvDest::Buffer => c.rx_end += n,
                    RecvDest::Chunk => {
                        if let Rx::Data { placed, .. } = &mut c.state {
                            *placed += n as u32;
                        }
                    }
                }
                self.receive_from(rt, ci, true)
            }
        };
        if let Err(f) = result {
            self.fail(ci, f);
        }
        self.after_input(rt, ci);
    }

    /// After input: the queue's answers become PDUs, and the connection
    /// is flushed at the end of the turn.
    fn after_input(&mut self, _rt: &mut Runtime, ci: u16) {
        let c = self.conns[ci as usize].c.as_mut().expect("live connection");
        let mut stale = false;
        if c.q.conn.is_some() && c.handshake.is_some() {
            // Past its handshake: the slot goes back for the next connection.
            c.handshake = None;
            stale = true;
        }
        // An admin queue's keep-alive deadline may have moved.
        stale |= c.q.is_admin();
        let held = c.q.connect_deadline().is_some();
        if held && !self.held.contains(&ci) {
            self.held.push(ci);
            stale = true;
        }
        self.deadlines_stale |= stale;
        self.mark_dirty(ci);
    }

    /// Reads what the socket (epoll input) or the last ring receive has and
    /// handles every complete part. `drained`: the bytes already in hand
    /// are all there is for now (a ring receive's), so no read is tried.
    fn receive_from(&mut self, rt: &mut Runtime, ci: u16, mut drained: bool) -> Result<(), Fatal> {
        loop {
            let c = self.conns[ci as usize].c.as_mut().expect("live connection");
            if c.closing.is_some() {
                return Ok(());
            }
            if c.q.actions.len() + c.tx.len() > MAX_UNSENT {
                return Err(Fatal::closed(CloseReason::host_stalled(format!(
                    "the host sends commands and does not read their answers ({MAX_UNSENT} PDUs unsent)"
                ))));
            }
            c.q.now = rt.turn_start;
            if c.parse(&mut rt.exec)? {
                continue;
            }
            if drained || !matches!(c.input, Input::Epoll) {
                return Ok(());
            }
            // Data of a command with nothing buffered: straight into its buffer.
            if let Some((slot, at, left)) = c.direct_data() {
                let buf = c.q.data_mut(&mut rt.exec, slot, at, left);
                let asked = buf.len();
                match (&c.stream).read(buf) {
                    Ok(0) => return Err(Fatal::closed(CloseReason::host_closed())),
                    Ok(n) => {
                        drained = n < asked;
                        if let Rx::Data { placed, .. } = &mut c.state {
                            *placed += n as u32;
                        }
                        continue;
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return Ok(()),
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                    Err(e) => return Err(Fatal::closed(format!("receive: {e}"))),
                }
            }
            c.compact_rx();
            let rx = c.rx.as_mut().expect("the receive buffer is ours in epoll input");
            let asked = rx.len() - c.rx_end;
            match (&c.stream).read(&mut rx[c.rx_end..]) {
                Ok(0) => return Err(Fatal::closed(CloseReason::host_closed())),
                Ok(n) => {
                    // A read that returned less than it asked for emptied the
                    // socket: the next would only say EAGAIN (epoll is
                    // level-triggered and reports what arrives since).
                    drained = n < asked;
                    c.rx_end += n;
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return Ok(()),
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(Fatal::closed(format!("receive: {e}"))),
            }
        }
    }

    /// Arms the ring receive of a connection that has none: straight into
    /// a command's chunk when the data being received has nothing
    /// buffered, else into the receive buffer.
    fn arm_receive(&mut self, rt: &mut Runtime, ci: u16) {
        let key = self.key(ci);
        let c = self.conns[ci as usize].c.as_mut().expect("live connection");
        let Input::Ring { slot, armed: None } = c.input else { return };
        if c.closing.is_some() {
            return;
        }
        let tag = Runtime::engine_tag(self.index, key);
        if let Some((cmd, at, left)) = c.direct_data() {
            if let Some(chunk) = c.q.fetch_target(cmd) {
                let at = c.q.fetch_offset(cmd, at);
                let id = rt.exec.engine_mut().arm_recv(slot, RecvInto::Chunk(chunk), at, left as usize, tag);
                c.input = Input::Ring { slot, armed: Some((id, RecvDest::Chunk)) };
                return;
            }
        }
        c.compact_rx();
        let rx = c.rx.take().expect("the receive buffer is ours between receives");
        let room = rx.len() - c.rx_end;
        if room == 0 {
            // A full buffer is parsed before more is read (never: the
            // parser takes every complete header, and a header fits).
            c.rx = Some(rx);
            return;
        }
        let id = rt.exec.engine_mut().arm_recv(slot, RecvInto::Buf(rx), c.rx_end, room, tag);
        c.input = Input::Ring { slot, armed: Some((id, RecvDest::Buffer)) };
    }

    // ---------------------------------------------------------------- sending

    /// Turns the queue's answers into PDUs and sends what the socket takes.
    fn flush_conn(&mut self, rt: &mut Runtime, ci: u16) {
        let index = self.index;
        let key = self.key(ci);
        let c = self.conns[ci as usize].c.as_mut().expect("live connection");
        c.dirty = false;
        c.drain_actions(&mut rt.exec);
        if !c.draining && !c.send_failed {
            let before = (c.tx.len(), c.tx_sent);
            if let Err(f) = c.flush_tx(&mut rt.exec) {
                c.send_failed = true;
                c.fail(f);
            }
            let stalled = if c.tx.is_empty() {
                None
            } else if (c.tx.len(), c.tx_sent) != before {
                Some(rt.turn_start)
            } else {
                c.tx_stalled_since.or(Some(rt.turn_start))
            };
            if stalled != c.tx_stalled_since {
                c.tx_stalled_since = stalled;
                self.deadlines_stale = true;
            }
            let want_write = !c.tx.is_empty();
            if want_write != c.watching_write {
                c.watching_write = want_write;
                let fd = c.stream.as_raw_fd();
                let r = match (&c.input, want_write) {
                    (Input::Epoll, w) => rt.rewatch(index, fd, key, READABLE | if w { WRITABLE } else { 0 }),
                    (Input::Ring { .. }, true) => rt.watch(index, fd, key, WRITABLE),
                    (Input::Ring { .. }, false) => {
                        rt.unwatch(fd);
                        Ok(())
                    }
                };
                if let Err(e) = r {
                    tracing::error!("nvme+tcp {}: epoll: {e}", c.q.peer);
                }
            }
        }
        self.maybe_end(rt, ci);
        if let Some(c) = self.conns[ci as usize].c.as_ref() {
            if c.closing.is_none() {
                self.arm_receive(rt, ci);
            }
        }
    }

    // ---------------------------------------------------------------- closing

    fn fail(&mut self, ci: u16, f: Fatal) {
        self.conn(ci).fail(f);
        self.deadlines_stale = true;
        self.mark_dirty(ci);
    }

    /// Moves a closing connection on: once its last PDUs went out (or the
    /// grace passed), it stops sending and gives up its commands; once the
    /// executor has nothing of it left, it leaves its controller and ends.
    fn maybe_end(&mut self, rt: &mut Runtime, ci: u16) {
        let c = self.conns[ci as usize].c.as_mut().expect("live connection");
        let Some(why) = c.closing.clone() else { return };
        let now = Instant::now();
        let due = *c.close_due.get_or_insert(now + CLOSE_GRACE);
        if !c.draining {
            if !c.tx.is_empty() && !c.send_failed && now < due {
                return;
            }
            c.draining = true;
            // Its grace deadline is gone.
            self.deadlines_stale = true;
            if !c.tx.is_empty() {
                tracing::debug!("nvme+tcp {}: {why} (the host did not take the last PDUs)", c.q.peer);
            }
            // What was not sent goes back unsent.
            for item in c.tx.drain(..) {
                if let TxBody::Chunk(ch, _) | TxBody::Zero(ch, _) = item.body {
                    rt.exec.sent(ch);
                }
            }
            if c.watching_write {
                c.watching_write = false;
                if matches!(c.input, Input::Ring { .. }) {
                    rt.unwatch(c.stream.as_raw_fd());
                }
            }
            // A receive still in the ring comes back first (it may hold a
            // command's chunk).
            if let Input::Ring { armed: Some((id, _)), .. } = c.input {
                rt.exec.engine_mut().cancel_recv(id);
            }
        }
        if matches!(c.input, Input::Ring { armed: Some(_), .. }) {
            return;
        }
        if c.q.conn.is_some() || c.q.exec_live() > 0 || c.q.busy_commands() > 0 {
            c.q.drop_commands(&mut rt.exec);
        }
        // Chunks of pieces the drop gave back may come back as executor
        // news of other commands first; the queue waits for its own.
        if c.q.exec_live() > 0 {
            return;
        }
        c.q.leave(&why);
        match why.kind {
            CloseKind::ByHost => tracing::debug!("nvme+tcp {}: {why}", c.q.peer),
            _ => tracing::debug!("nvme+tcp {}: closed: {why}", c.q.peer),
        }
        let _ = c.stream.shutdown(std::net::Shutdown::Both);
        match c.input {
            Input::Ring { slot, .. } => rt.exec.engine_mut().unregister_socket(slot),
            Input::Epoll => rt.unwatch(c.stream.as_raw_fd()),
        }
        let slot = &mut self.conns[ci as usize];
        slot.c = None;
        slot.gen = slot.gen.wrapping_add(1);
        self.free.push(ci);
        self.held.retain(|&h| h != ci);
        self.live -= 1;
        self.deadlines_stale = true;
        rt.stats.queue_pairs.set(rt.stats.queue_pairs.get().saturating_sub(1));
    }

    /// Closes every connection whose controller was torn down.
    fn close_torn_down(&mut self) {
        for ci in 0..self.conns.len() as u16 {
            let Some(c) = self.conns[ci as usize].c.as_ref() else { continue };
            if c.closing.is_none() && c.q.conn.as_ref().is_some_and(|k| k.ctrl.is_dead()) {
                self.fail(ci, Fatal::closed("the controller was torn down"));
            }
        }
    }

    /// The earliest deadline of connection `c`, if it has one. A closing
    /// connection has one while it may still send (the end of its grace);
    /// once it stopped (`draining`) it waits only for its ring receive to
    /// come back and for the executor's last commands of its queue, whose
    /// news marks it dirty (`on_received`, `exec_event`): no deadline, or
    /// one past would wake its reactor at once, again and again, for as
    /// long as a disk operation takes.
    fn deadline_of(c: &Conn) -> Option<Instant> {
        if c.closing.is_some() {
            if c.draining {
                return None;
            }
            return c.close_due.or(Some(Instant::now()));
        }
        let stalled = c.tx_stalled_since.map(|since| since + c.q.sub.cfg.transport_timeout);
        [c.q.deadline(), stalled].into_iter().flatten().min()
    }
}

impl Conn {
    fn fail(&mut self, f: Fatal) {
        if self.closing.is_some() {
            return;
        }
        if let Some((fes, fei)) = f.fes {
            let mut header = f.header;
            header.truncate(MAX_TERM_PLEN as usize - SHORT_HLEN);
            tracing::warn!("nvme+tcp {}: {} (termination request, FES {fes:#x})", self.q.peer, f.why);
            super::NvmeStats::add(&self.q.sub.stats.terminations, 1);
            self.queue_pdu_body(&Pdu::C2HTermReq(TermReq { fes, fei }), TxBody::Heap(header), None);
        } else if f.why.kind == CloseKind::HostStalled {
            tracing::warn!("nvme+tcp {}: {}; closing", self.q.peer, f.why);
        } else {
            tracing::debug!("nvme+tcp {}: {}", self.q.peer, f.why);
        }
        self.closing = Some(f.why);
    }

    /// The data of the PDU being received, when it may be received
    /// straight into its command's buffer (a command's, no padding before
    /// it, nothing of it buffered, some of it still to come): the
    /// command's slot, the offset in its data where the rest goes, and
    /// how many bytes the rest is.
    fn direct_data(&self) -> Option<(u16, u32, u32)> {
        match self.state {
            Rx::Data { dest: Dest::Command { slot, offset, .. }, pad: 0, len, placed, .. }
                if self.rx_start == self.rx_end && placed < len =>
            {
                Some((slot, offset + placed, len - placed))
            }
            _ => None,
        }
    }

    /// Moves what is left in the receive buffer to its start.
    fn compact_rx(&mut self) {
        if self.rx_start > 0 {
            if let Some(rx) = self.rx.as_mut() {
                rx.copy_within(self.rx_start..self.rx_end, 0);
            }
            self.rx_end -= self.rx_start;
            self.rx_start = 0;
        }
    }

    /// Grows the receive buffer to `size` (between receives).
    fn grow_rx(&mut self, size: usize) {
        let Some(rx) = self.rx.as_mut() else { return };
        if rx.len() >= size {
            return;
        }
        let mut bigger = vec![0; size].into_boxed_slice();
        bigger[..self.rx_end - self.rx_start].copy_from_slice(&rx[self.rx_start..self.rx_end]);
        self.rx_end -= self.rx_start;
        self.rx_start = 0;
        *rx = bigger;
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
    fn parse(&mut self, exec: &mut Executor) -> Result<bool, Fatal> {
        let avail = self.rx_end - self.rx_start;
        match self.state {
            Rx::Header => {
                if avail < CH_SIZE {
                    return Ok(false);
                }
                let rx = self.rx.as_ref().expect("the receive buffer is ours while parsing");
                let b = &rx[self.rx_start..self.rx_end];
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
                let dest = self.on_header(exec, pdu, layout.data_len as u32, header)?;
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
                        let rx = self.rx.as_ref().expect("the receive buffer is ours while parsing");
                        let target = self.q.data_mut(exec, slot, offset + placed, n as u32);
                        target.copy_from_slice(&rx[src..src + n]);
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
                    let rx = self.rx.as_ref().expect("the receive buffer is ours while parsing");
                    let got = u32::from_le_bytes(rx[self.rx_start..self.rx_start + DIGEST_SIZE].try_into().expect("4 bytes"));
                    self.rx_start += DIGEST_SIZE;
                    if let Dest::Command { slot, offset, .. } = dest {
                        good = digest(self.q.data_mut(exec, slot, offset, len)) == got;
                    }
                }
                self.state = Rx::Header;
                if let Dest::Command { slot, h2c_last, .. } = dest {
                    if !good {
                        tracing::warn!("nvme+tcp {}: data digest error; the command fails", self.q.peer);
                        self.q.data_corrupt(exec, slot);
                        return Ok(true);
                    }
                    let last = h2c_last.unwrap_or(true);
                    if let Err(why) = self.q.data_placed(exec, slot, len, last) {
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
    fn on_header(&mut self, exec: &mut Executor, pdu: Pdu, data_len: u32, header: &[u8]) -> Result<Dest, Fatal> {
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
                self.queue_pdu_body(&resp, TxBody::None, None);
                self.grow_rx(RX_ADMIN + MAX_HEADER);
                Ok(Dest::Discard)
            }
            Pdu::CapsuleCmd(sqe) => {
                let was_connected = self.q.conn.is_some();
                let dest = match self.q.command(exec, sqe, data_len) {
                    Some(slot) => Dest::Command { slot, offset: 0, h2c_last: None },
                    None => Dest::Discard,
                };
                if !was_connected && self.q.qid().is_some_and(|q| q > 0) {
                    self.grow_rx(RX_BUFFER + MAX_HEADER);
                }
                Ok(dest)
            }
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

    /// Queues a PDU with its data (a chunk's bytes are digested from the
    /// executor's pool).
    fn queue_pdu_body(&mut self, pdu: &Pdu, body: TxBody, exec: Option<&Executor>) {
        let digests = self.digests.unwrap_or_default();
        let mut item = TxItem { head: [0u8; MAX_HEADER], head_len: 0, body, trailer: None };
        let data_len = item.body_len();
        let (at, _) = pdu.encode(digests, data_len as u32, self.data_align, &mut item.head);
        item.head_len = at;
        if digests.data && data_len > 0 && pdu.pdu_type().digested() {
            let bytes = match (&item.body, exec) {
                (TxBody::Chunk(c, n), Some(e)) => &e.bytes(*c)[..*n],
                (TxBody::Zero(_, n), Some(e)) => &e.engine().pool().zero_bytes()[..*n],
                (TxBody::Heap(v), _) => &v[..],
                _ => &[][..],
            };
            item.trailer = Some(digest(bytes).to_le_bytes());
        }
        self.tx.push_back(item);
    }

    /// Turns the queue's actions into PDUs.
    fn drain_actions(&mut self, exec: &mut Executor) {
        let mut batch = self.q.take_actions();
        for a in batch.drain(..) {
            match a {
                Action::Respond(cqe, _) => self.queue_pdu_body(&Pdu::CapsuleResp(cqe), TxBody::None, None),
                Action::SendData { cid, buf, off, len, then, .. } => {
                    let body = match buf {
                        Buf::Chunk(c) => TxBody::Chunk(c, len as usize),
                        Buf::Zero(c) => TxBody::Zero(c, len as usize),
                        Buf::Heap(mut v) => {
                            v.truncate(len as usize);
                            TxBody::Heap(v)
                        }
                    };
                    if self.draining {
                        if let TxBody::Chunk(c, _) | TxBody::Zero(c, _) = body {
                            exec.sent(c);
                        }
                        continue;
                    }
                    let d = DataPdu { cccid: cid, ttag: 0, offset: off, length: len, last: then.is_some(), success: false };
                    self.queue_pdu_body(&Pdu::C2HData(d), body, Some(exec));
                    if let Some(cqe) = then {
                        self.queue_pdu_body(&Pdu::CapsuleResp(cqe), TxBody::None, None);
                    }
                }
                Action::RequestData { cid, ttag, off, len } => {
                    self.queue_pdu_body(&Pdu::R2T(R2t { cccid: cid, ttag, offset: off, length: len }), TxBody::None, None);
                }
                Action::Close(why) => {
                    self.closing.get_or_insert(why);
                }
            }
        }
        self.q.actions_done(batch);
    }

    /// Sends what is queued, as far as the socket takes it.
    fn flush_tx(&mut self, exec: &mut Executor) -> Result<(), Fatal> {
        while !self.tx.is_empty() {
            let written = {
                // The three parts of each of the first ITEMS items, on the stack.
                const ITEMS: usize = 16;
                let mut slices = [IoSlice::new(&[]); ITEMS * 3];
                let mut count = 0;
                let mut skip = self.tx_sent;
                let zero = exec.engine().pool().zero_bytes();
                for item in self.tx.iter().take(ITEMS) {
                    let body: &[u8] = match &item.body {
                        TxBody::None => &[],
                        TxBody::Chunk(c, n) => &exec.bytes(*c)[..*n],
                        TxBody::Zero(_, n) => &zero[..*n],
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
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return Ok(()),
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
                if let TxBody::Chunk(c, _) | TxBody::Zero(c, _) = item.body {
                    exec.sent(c);
                }
            }
        }
        Ok(())
    }
}

impl Transport for NvmeTcp {
    fn adopt(&mut self, rt: &mut Runtime, conn: Box<dyn Any + Send>) {
        match conn.downcast::<Accept>() {
            Ok(a) => self.adopt_conn(rt, *a),
            Err(_) => tracing::error!("reactor {}: nvme+tcp was handed something that is not a connection", rt.id),
        }
    }

    fn ready(&mut self, rt: &mut Runtime, key: u64) {
        if let Some(ci) = self.conn_of_key(key) {
            self.on_ready(rt, ci);
        }
    }

    fn engine_completion(&mut self, rt: &mut Runtime, key: u64, res: i32) {
        match self.conn_of_key(key) {
            Some(ci) => self.on_received(rt, ci, res),
            None => tracing::error!("reactor {}: nvme+tcp: a receive completed for a connection that is gone", rt.id),
        }
    }

    fn exec_event(&mut self, rt: &mut Runtime, tag: u32, id: CmdId, ev: Event) {
        let ci = Queue::key_of_tag(tag);
        let Some(c) = self.conns.get_mut(ci as usize).and_then(|s| s.c.as_mut()) else {
            tracing::error!("reactor {}: executor news {ev:?} for no nvme+tcp connection", rt.id);
            return;
        };
        c.q.exec_event(&mut rt.exec, Queue::slot_of_tag(tag), id, ev);
        self.mark_dirty(ci);
    }

    fn turn(&mut self, rt: &mut Runtime) {
        let news = self.seen.news(&rt.registry);
        if news.fences {
            self.close_torn_down();
        }
        if news.volumes {
            for ci in 0..self.conns.len() as u16 {
                let Some(c) = self.conns[ci as usize].c.as_mut() else { continue };
                if c.closing.is_none() && c.q.volumes_changed(rt.turn_start) {
                    self.mark_dirty(ci);
                }
            }
        }
        for i in (0..self.held.len()).rev() {
            let ci = self.held[i];
            let Some(c) = self.conns.get_mut(ci as usize).and_then(|s| s.c.as_mut()) else {
                self.held.swap_remove(i);
                continue;
            };
            if !c.q.retry_connect(&mut rt.exec) {
                self.held.swap_remove(i);
            }
            self.after_input(rt, ci);
        }
    }

    fn flush(&mut self, rt: &mut Runtime) {
        while let Some(ci) = self.dirty.pop() {
            if self.conns[ci as usize].c.is_some() {
                self.flush_conn(rt, ci);
            }
        }
    }

    fn next_deadline(&self, _rt: &Runtime) -> Option<Instant> {
        if !self.deadlines_stale {
            return self.earliest;
        }
        self.conns.iter().filter_map(|s| s.c.as_ref()).filter_map(Self::deadline_of).min()
    }

    fn check_deadlines(&mut self, rt: &mut Runtime, now: Instant) {
        if !self.deadlines_stale && self.earliest.is_none_or(|e| now < e) && rt.shutdown.is_none() {
            return;
        }
        for ci in 0..self.conns.len() as u16 {
            let Some(c) = self.conns[ci as usize].c.as_mut() else { continue };
            if c.closing.is_some() {
                if !c.draining && c.close_due.is_some_and(|d| now >= d) {
                    self.mark_dirty(ci);
                }
                continue;
            }
            if let Some(since) = c.tx_stalled_since.filter(|&since| now >= since + c.q.sub.cfg.transport_timeout) {
                let why = format!(
                    "the host {} read nothing it was sent for {:?} (target.transport_timeout; {} PDUs waiting)",
                    c.q.peer,
                    now.saturating_duration_since(since),
                    c.tx.len()
                );
                self.fail(ci, Fatal::closed(CloseReason::host_stalled(why)));
                continue;
            }
            match c.q.check_deadlines(now, rt.shutdown.is_some()) {
                Due::Nothing => {}
                Due::Flush => self.mark_dirty(ci),
                Due::Close(why) => self.fail(ci, Fatal::closed(why)),
            }
        }
        self.earliest = self.conns.iter().filter_map(|s| s.c.as_ref()).filter_map(Self::deadline_of).min();
        self.deadlines_stale = false;
    }

    fn shutdown(&mut self, _rt: &mut Runtime) {
        // The control thread tore every controller down (their queues close
        // at the next turn); connections before Connect close at the next
        // deadline check.
        self.deadlines_stale = true;
    }

    fn live(&self) -> usize {
        self.live
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
