//! The NVMe/RDMA transport (NVMe over Fabrics RDMA Transport Specification
//! 1.0b): one thread per queue pair, which is one NVMe queue.
//!
//! Connecting: the host's rdma_cm request carries the queue id and its
//! queue sizes ([`CmRequest`]); a wrong field is refused with the NVMe/RDMA
//! reject status for it, before any queue pair exists. The accept tells the
//! host how many commands the queue takes (CRQSIZE: the receives posted).
//!
//! Capsules: each command arrives in one SEND into a receive slot of 64
//! bytes plus the in-capsule data the queue accepts (IOCCSZ); it is
//! decoded, its in-capsule data copied to the command's buffer, and the
//! receive posted again at once. A completion leaves in one SEND of 16
//! bytes from a registered response slot. Data under a keyed SGL moves
//! one-sided, straight between the host's memory and the command's pool
//! chunk: a read's data by an RDMA WRITE posted in one chain with its
//! completion (reliable-connected ordering places the data first), a
//! write's by an RDMA READ before the command runs. Data in heap memory
//! (admin pages, Connect data, DSM ranges) goes through a few registered
//! staging slots. When the host's SGL asked for it (Keyed Data Block,
//! subtype Invalidate), the completion is a SEND with Invalidate of the
//! host's key.
//!
//! A failed work request (the host's key refused, the queue pair broken)
//! ends the connection: the queue pair is disconnected, its outstanding
//! work requests flush, and the queue leaves its controller as a closed
//! NVMe/TCP connection does. The controller's teardown wakes the thread
//! through an eventfd ([`QueueCloser::Wake`]).

use std::collections::VecDeque;
use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use rdmablk_common::fabric::{
    Access, Completion, CompletionQueue, ConnectRequest, Fabric, FabricOptions, ListenOptions, Listener, Payload,
    ProtectionDomain, QpCaps, QueuePair, RecvWr, Rkey, SendOp, SendWr, WcStatus, WrId,
};
use rdmablk_common::nvme::cqe::{CompletionEntry, CQE_SIZE};
use rdmablk_common::nvme::fabrics::{fctype, Connect};
use rdmablk_common::nvme::rdma::{reject, CmAccept, CmReject, CmRequest, RECFMT_1_0};
use rdmablk_common::nvme::sqe::{admin_opcode, Sgl, SubmissionEntry, SQE_SIZE};

use super::queue::{Action, Buf, Queue, WakeSource};
use super::{CloseKind, CloseReason, QueueCloser, Subsystem, ADMIN_IN_CAPSULE, HOST_CLOSED, IO_IN_CAPSULE, MAX_IO_QUEUES, MAX_QUEUE_ENTRIES, MAX_TRANSFER};
use crate::config::{NvmeListen, NvmeTransport, TargetConfig};
use crate::engine::pool::{PoolRegion, SlotBuf};
use crate::session::{Admission, ConnectionSlot, HandshakeSlot};
use crate::sys::{Epoll, EventFd};

/// How long a closing queue waits for its flushed work requests.
const CLOSE_GRACE: Duration = Duration::from_secs(2);
/// Staging slots (of `MAX_TRANSFER`) for data in heap memory: the admin
/// queue's pages and Connect data, an I/O queue's DSM ranges.
const ADMIN_STAGING: usize = 4;
const IO_STAGING: usize = 2;
/// Answers that may wait for a response or staging slot before the host is
/// taken for one that does not take its completions.
const MAX_WAITING: usize = 4 * MAX_QUEUE_ENTRIES as usize;

const TOKEN_CQ: u64 = 0;
const TOKEN_KICK: u64 = 1;
const TOKEN_WAKE: u64 = 2;
const TOKEN_ENGINE: u64 = 3;

/// Work request ids: the kind in the top byte, an index below.
const K_RECV: u64 = 1 << 56;
const K_SEND: u64 = 2 << 56;
const K_READ: u64 = 3 << 56;
const K_WRITE: u64 = 4 << 56;
const KIND_MASK: u64 = 0xff << 56;

/// An `nvme+rdma://` listener: an rdma_cm listener on its own fabric.
pub struct RdmaListener {
    // Field order: the listener goes before its fabric.
    listener: Listener,
    fabric: Arc<Fabric>,
    addr: SocketAddr,
}

impl RdmaListener {
    pub fn bind(l: &NvmeListen, cfg: &TargetConfig) -> crate::Result<RdmaListener> {
        let options = FabricOptions { transport_timeout: cfg.transport_timeout, frame_timeout: cfg.frame_timeout };
        let fabric = Fabric::open_with(&l.url, options).map_err(|e| crate::Error::fabric(format!("{l}: cannot open the fabric"), e))?;
        let listener = fabric
            .listen_with(ListenOptions { handshake_timeout: cfg.handshake_timeout })
            .map_err(|e| crate::Error::fabric(format!("{l}: cannot listen"), e))?;
        let url = listener.local_url();
        let addr = url
            .host_port()
            .to_socket_addrs()
            .ok()
            .and_then(|mut a| a.next())
            .ok_or_else(|| crate::Error::config(format!("{l}: {url} is not an IP address and port")))?;
        Ok(RdmaListener { listener, fabric: Arc::new(fabric), addr })
    }

    pub fn fd(&self) -> std::os::fd::RawFd {
        self.listener.fd()
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Takes every pending connection request: refuses the ones whose
    /// private data is wrong (with its reject status) or over the
    /// connection limits, and starts a queue thread for each other one.
    pub fn accept(&self, sub: &Arc<Subsystem>, port: u16) -> Vec<JoinHandle<()>> {
        let mut started = Vec::new();
        loop {
            let req = match self.listener.poll_request() {
                Ok(Some(r)) => r,
                Ok(None) => break,
                Err(e) => {
                    tracing::warn!("nvme+rdma: {e}");
                    break;
                }
            };
            let peer_name = req.peer();
            let peer: SocketAddr = peer_name.parse().unwrap_or_else(|_| SocketAddr::from(([0, 0, 0, 0], 0)));
            let refuse = |req: ConnectRequest, status: u16, why: &str| {
                tracing::warn!("nvme+rdma: refused a connection from {peer_name}: {why}");
                req.reject_raw(&CmReject { recfmt: RECFMT_1_0, status }.encode());
            };
            if sub.stopping.load(std::sync::atomic::Ordering::Acquire) {
                refuse(req, reject::NO_RESOURCES, "the target is stopping");
                continue;
            }
            let cm = match CmRequest::parse(req.raw_private_data(), MAX_IO_QUEUES, MAX_QUEUE_ENTRIES, MAX_QUEUE_ENTRIES) {
                Ok(cm) => cm,
                Err(r) => {
                    refuse(req, r.status, &r.to_string());
                    continue;
                }
            };
            let admission = match sub.registry.begin_handshake((!peer.ip().is_unspecified()).then(|| peer.ip())) {
                Ok(a) => a,
                Err(why) => {
                    refuse(req, reject::NO_RESOURCES, &format!("{why:?} limit reached"));
                    continue;
                }
            };
            // The address this host reached: the discovery log names a
            // wildcard listener by it.
            let local = req.local_addr().unwrap_or(self.addr);
            let (fabric, sub) = (Arc::clone(&self.fabric), Arc::clone(sub));
            let serve = move || serve(req, cm, &fabric, Peer { addr: peer, local, port }, sub, admission);
            match std::thread::Builder::new().name("rdmablk-nvmeq".into()).spawn(serve) {
                Ok(t) => started.push(t),
                Err(e) => tracing::error!("nvme+rdma: cannot start a queue thread for {peer_name}: {e}"),
            }
        }
        started
    }
}

struct Peer {
    addr: SocketAddr,
    local: SocketAddr,
    port: u16,
}

/// Where an RDMA READ of host data lands.
#[derive(Clone, Copy, Debug)]
enum ReadInto {
    /// The command's pool chunk, directly.
    Chunk,
    /// Staging slot `i`, copied to the command's heap buffer afterwards.
    Staging(usize),
}

/// What a response SEND's completion gives back besides its slot.
#[derive(Clone, Copy, Debug)]
enum SentWith {
    Nothing,
    /// The pool chunk a read's data went out of.
    Chunk(crate::engine::pool::ChunkId),
    /// The staging slot heap data went out of.
    Staging(usize),
}

struct Connection {
    // Field order is drop order: the queue pair goes before the memory it
    // could still reach, and before its completion queue and domain.
    qp: QueuePair,
    pool_mr: Option<PoolRegion>,
    recv: SlotBuf,
    resp: SlotBuf,
    staging: SlotBuf,
    cq: CompletionQueue,
    pd: ProtectionDomain,
    q: Queue,
    cm: CmRequest,
    recv_size: u32,
    free_resp: Vec<usize>,
    sent_with: Vec<SentWith>,
    free_staging: Vec<usize>,
    /// Per command slot: where its RDMA READ lands, while one is in flight.
    reads: Vec<Option<(ReadInto, u32)>>,
    /// Answers waiting for a response or staging slot, in order.
    waiting: VecDeque<Action>,
    /// Receives posted, and signaled send-queue work requests outstanding.
    recvs_posted: u32,
    sends_outstanding: u32,
    epoll: Epoll,
    kick: Arc<EventFd>,
    watched: Vec<i32>,
    closing: Option<CloseReason>,
    handshake: Option<HandshakeSlot>,
    _connection: ConnectionSlot,
}

/// Serves one NVMe/RDMA queue until it closes.
fn serve(req: ConnectRequest, cm: CmRequest, fabric: &Fabric, peer: Peer, sub: Arc<Subsystem>, admission: Admission) {
    let name = req.peer();
    let mut c = match Connection::accept(req, cm, fabric, &peer, sub, admission) {
        Ok(c) => c,
        Err(why) => {
            tracing::warn!("nvme+rdma {name}: cannot accept the queue: {why}");
            return;
        }
    };
    tracing::debug!("nvme+rdma {name}: queue {} connected ({} entries)", cm.qid, cm.entries());
    let why = c.run();
    c.finish(&why);
}

impl Connection {
    fn accept(req: ConnectRequest, cm: CmRequest, fabric: &Fabric, peer: &Peer, sub: Arc<Subsystem>, admission: Admission) -> Result<Connection, String> {
        let entries = cm.entries();
        let in_capsule = if cm.qid == 0 { ADMIN_IN_CAPSULE } else { IO_IN_CAPSULE };
        let recv_size = SQE_SIZE as u32 + in_capsule;
        // Per command at most an RDMA READ, an RDMA WRITE and its completion.
        let max_send_wr = 3 * entries + 4;
        let pd = fabric.alloc_pd().map_err(|e| format!("protection domain: {e}"))?;
        let cq = fabric.create_cq(max_send_wr + entries + 8).map_err(|e| format!("completion queue: {e}"))?;
        let caps = QpCaps { max_send_wr, max_recv_wr: entries, max_send_sge: 1, max_recv_sge: 1, max_inline_data: 0 };
        let qp = req.into_queue_pair(&pd, &cq, caps).map_err(|e| format!("queue pair: {e}"))?;
        let got = qp.caps();
        if got.max_send_wr < max_send_wr || got.max_recv_wr < entries {
            return Err(format!("the device granted {got:?}, the queue needs {caps:?}"));
        }
        let staging_slots = if cm.qid == 0 { ADMIN_STAGING } else { IO_STAGING };
        let mut recv = SlotBuf::new(entries as usize, recv_size as usize);
        let mut resp = SlotBuf::new(entries as usize, CQE_SIZE);
        let mut staging = SlotBuf::new(staging_slots, MAX_TRANSFER as usize);
        recv.register(&pd, Access::LOCAL_WRITE).map_err(|e| format!("receive slots: {e}"))?;
        resp.register(&pd, Access::NONE).map_err(|e| format!("response slots: {e}"))?;
        staging.register(&pd, Access::LOCAL_WRITE).map_err(|e| format!("staging slots: {e}"))?;
        let epoll = Epoll::new().map_err(|e| format!("epoll: {e}"))?;
        let kick = Arc::new(EventFd::new().map_err(|e| format!("eventfd: {e}"))?);
        epoll.add(cq.fd(), TOKEN_CQ).map_err(|e| format!("epoll: {e}"))?;
        epoll.add(kick.fd(), TOKEN_KICK).map_err(|e| format!("epoll: {e}"))?;
        let mut q = Queue::new(sub, NvmeTransport::Rdma, peer.port, peer.local, peer.addr);
        q.closer = Some(QueueCloser::Wake(Arc::clone(&kick)));
        q.wake_fd = Some(epoll.fd());
        let mut c = Connection {
            qp,
            pool_mr: None,
            recv,
            resp,
            staging,
            cq,
            pd,
            q,
            cm,
            recv_size,
            free_resp: (0..entries as usize).rev().collect(),
            sent_with: vec![SentWith::Nothing; entries as usize],
            free_staging: (0..staging_slots).rev().collect(),
            reads: Vec::new(),
            waiting: VecDeque::new(),
            recvs_posted: 0,
            sends_outstanding: 0,
            epoll,
            kick,
            watched: Vec::new(),
            closing: None,
            handshake: Some(admission.handshake),
            _connection: admission.connection,
        };
        for i in 0..entries as usize {
            c.post_recv(i).map_err(|e| format!("posting receives: {e}"))?;
        }
        let accept = CmAccept { recfmt: RECFMT_1_0, crqsize: entries as u16 };
        c.qp.accept_raw(&accept.encode()).map_err(|e| format!("accept: {e}"))?;
        Ok(c)
    }

    fn post_recv(&mut self, i: usize) -> rdmablk_common::fabric::Result<()> {
        let sge = self.recv.lend(i, self.recv_size);
        match self.qp.post_recv(&[RecvWr { wr_id: WrId(K_RECV | i as u64), sges: std::slice::from_ref(&sge) }]) {
            Ok(()) => {
                self.recvs_posted += 1;
                Ok(())
            }
            Err(e) => {
                self.recv.reclaim(i);
                Err(e)
            }
        }
    }

    fn run(&mut self) -> CloseReason {
        let handshake_due = Instant::now() + self.q.sub.cfg.handshake_timeout;
        let mut wcs = [Completion::EMPTY; 32];
        let mut tokens = Vec::new();
        loop {
            self.drain_actions();
            if let Some(why) = &self.closing {
                return why.clone();
            }
            if let Err(e) = self.register_pool() {
                return e.into();
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
            let timeout = match self.q.sleep_limit(handshake_due) {
                Ok(t) => t,
                Err(why) => return why.into(),
            };
            if self.q.is_admin() {
                self.q.tick(Instant::now());
            }
            let polled = match self.poll(&mut wcs) {
                Ok(n) => n,
                Err(why) => return why.into(),
            };
            let reaped = self.q.reap();
            if polled > 0 || reaped > 0 || !self.q.actions.is_empty() {
                continue;
            }
            if let Err(e) = self.cq.arm() {
                return format!("arming the completion queue: {e}").into();
            }
            if self.cq.needs_poll_after_arm() {
                match self.poll(&mut wcs) {
                    Ok(0) => {}
                    Ok(_) => continue,
                    Err(why) => return why.into(),
                }
            }
            tokens.clear();
            match self.q.engine.as_mut().filter(|e| e.sleeps_in_ring()) {
                // An I/O queue sleeps in its ring: a disk completion ends
                // the sleep by itself, a completion queue event or a wake-up
                // through the epoll descriptor's poll.
                Some(engine) => {
                    if let Err(e) = engine.sleep(timeout) {
                        return format!("io_uring: {e}").into();
                    }
                    self.q.reap();
                    let engine = self.q.engine.as_mut().expect("matched above");
                    if engine.take_wake() {
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
                    TOKEN_CQ => {
                        if let Err(e) = self.cq.ack_event() {
                            return format!("completion channel: {e}").into();
                        }
                    }
                    TOKEN_KICK => {
                        self.kick.drain();
                    }
                    TOKEN_WAKE => self.q.woken_by(WakeSource::Controller),
                    TOKEN_ENGINE => self.q.woken_by(WakeSource::Engine),
                    _ => {}
                }
            }
        }
    }

    /// Registers the engine's pool with the queue pair's domain once the
    /// queue has one (at its Connect).
    fn register_pool(&mut self) -> Result<(), String> {
        if self.pool_mr.is_some() {
            return Ok(());
        }
        let Some(engine) = self.q.engine.as_ref() else { return Ok(()) };
        let mr = engine.pool().register(&self.pd).map_err(|e| format!("registering the buffer pool: {e}"))?;
        self.pool_mr = Some(mr);
        Ok(())
    }

    /// Registers the engine's and the controller's descriptors once they exist.
    fn watch_new_fds(&mut self) {
        for (fd, source) in self.q.wake_sources() {
            let token = match source {
                WakeSource::Engine => TOKEN_ENGINE,
                WakeSource::Controller => TOKEN_WAKE,
            };
            if !self.watched.contains(&fd) {
                self.watched.push(fd);
                if let Err(e) = self.epoll.add(fd, token) {
                    tracing::error!("nvme+rdma {}: epoll: {e}", self.q.peer);
                }
            }
        }
    }

    /// Polls the completion queue once and handles what it held.
    fn poll(&mut self, wcs: &mut [Completion]) -> Result<usize, String> {
        let n = self.cq.poll(wcs).map_err(|e| format!("polling the completion queue: {e}"))?;
        for wc in &wcs[..n] {
            self.completion(*wc);
        }
        Ok(n)
    }

    fn completion(&mut self, wc: Completion) {
        let index = (wc.wr_id.0 & !KIND_MASK) as usize;
        let ok = wc.status == WcStatus::Success;
        if !ok {
            // A flush before this side closed: the queue pair was
            // disconnected by the host (a failed work request of its own
            // comes first, with its status, and sets the reason).
            let why = if wc.status == WcStatus::WrFlushError {
                CloseReason::by_host(format!("{HOST_CLOSED} (the queue pair was disconnected)"))
            } else {
                CloseReason::fault(format!("a {:?} work request failed: {:?}", wc.opcode, wc.status))
            };
            if wc.status != WcStatus::WrFlushError {
                tracing::warn!("nvme+rdma {}: {why}", self.q.peer);
            }
            self.close(why);
        }
        match wc.wr_id.0 & KIND_MASK {
            K_RECV => {
                self.recvs_posted -= 1;
                self.recv.reclaim(index);
                if ok && self.closing.is_none() {
                    self.capsule(index, wc.byte_len);
                }
            }
            K_SEND => {
                self.sends_outstanding -= 1;
                self.resp.reclaim(index);
                let with = std::mem::replace(&mut self.sent_with[index], SentWith::Nothing);
                self.give_back(with);
                self.free_resp.push(index);
            }
            K_READ => {
                self.sends_outstanding -= 1;
                let Some((into, len)) = self.reads.get_mut(index).and_then(Option::take) else { return };
                if let ReadInto::Staging(i) = into {
                    self.staging.reclaim(i);
                    if ok {
                        let slot = index as u16;
                        let n = len as usize;
                        let staged = &self.staging.slot(i)[..n];
                        self.q.data_mut(slot, 0, len).copy_from_slice(staged);
                    }
                    self.free_staging.push(i);
                }
                if ok && self.closing.is_none() {
                    if let Err(why) = self.q.data_placed(index as u16, len, true) {
                        self.close(why.to_owned());
                    }
                }
            }
            // An RDMA WRITE is unsignaled: it completes only in error.
            _ => {}
        }
        if !self.waiting.is_empty() && self.closing.is_none() {
            // Each waiting answer once, in place (the deque keeps its
            // capacity): one that still finds no slot goes to the back,
            // behind the others that wait, in the order they were made.
            for _ in 0..self.waiting.len() {
                let a = self.waiting.pop_front().expect("counted");
                self.act(a);
            }
        }
    }

    /// A command capsule arrived in receive slot `i`.
    fn capsule(&mut self, i: usize, len: u32) {
        if (len as usize) < SQE_SIZE {
            // Linux nvmet treats this as a fatal controller error too.
            self.close(format!("a capsule of {len} bytes, shorter than a command"));
            return;
        }
        let bytes = &self.recv.slot(i)[..len as usize];
        let sqe = SubmissionEntry::decode_unchecked(&bytes[..SQE_SIZE]).expect("64 bytes");
        if sqe.opcode == admin_opcode::FABRICS && sqe.fctype() == fctype::CONNECT {
            let qid = Connect::from_entry(&sqe).qid;
            if qid != self.cm.qid {
                // The queue was sized and accepted for the queue id the
                // connect request named.
                self.close(format!("Connect for queue {qid} on the queue pair connected as queue {}", self.cm.qid));
                return;
            }
        }
        let in_capsule = len - SQE_SIZE as u32;
        if let Some(slot) = self.q.command(sqe, in_capsule) {
            let data = &self.recv.slot(i)[SQE_SIZE..len as usize];
            self.q.data_mut(slot, 0, in_capsule).copy_from_slice(data);
            if let Err(why) = self.q.data_placed(slot, in_capsule, true) {
                self.close(why.to_owned());
                return;
            }
        }
        if let Err(e) = self.post_recv(i) {
            self.close(format!("posting a receive: {e}"));
        }
    }

    fn close(&mut self, why: impl Into<CloseReason>) {
        self.closing.get_or_insert_with(|| why.into());
    }

    /// Turns the queue's actions into work requests.
    fn drain_actions(&mut self) {
        // The queue's own close (a Disconnect) comes before the answer made
        // with it, and that answer must still go out: it closes the queue
        // after the whole batch.
        let mut close = None;
        let mut batch = self.q.take_actions();
        for a in batch.drain(..) {
            if self.closing.is_some() {
                break;
            }
            if let Action::Close(why) = a {
                close.get_or_insert(why);
                continue;
            }
            if !self.waiting.is_empty() {
                // Answers leave in the order they were made.
                self.waiting.push_back(a);
                continue;
            }
            self.act(a);
        }
        self.q.actions_done(batch);
        if let Some(why) = close {
            self.close(why);
        }
        if self.waiting.len() > MAX_WAITING {
            self.close(format!("the host takes no completions ({} answers waiting)", self.waiting.len()));
        }
    }

    fn act(&mut self, a: Action) {
        if self.closing.is_some() {
            return;
        }
        match a {
            Action::Respond(cqe, sgl) => {
                let Some(r) = self.free_resp.pop() else {
                    self.waiting.push_back(Action::Respond(cqe, sgl));
                    return;
                };
                self.post_response(r, &cqe, sgl, None);
            }
            Action::SendData { cid, buf, len, to, then } => {
                let Some(r) = self.free_resp.last().copied() else {
                    self.waiting.push_back(Action::SendData { cid, buf, len, to, then });
                    return;
                };
                let Sgl::Keyed { addr, key, .. } = to else {
                    self.close(format!("command {cid}: data to send without a keyed SGL ({to:?})"));
                    return;
                };
                let (sge, with) = match buf {
                    Buf::Chunk(c) => {
                        let mr = self.pool_mr.as_ref().expect("a queue with chunks has its pool registered");
                        (mr.sge(c, 0, len), SentWith::Chunk(c))
                    }
                    Buf::Heap(v) => {
                        let Some(i) = self.free_staging.pop() else {
                            self.waiting.push_back(Action::SendData { cid, buf: Buf::Heap(v), len, to, then });
                            return;
                        };
                        self.staging.slot_mut(i)[..len as usize].copy_from_slice(&v[..len as usize]);
                        (self.staging.lend(i, len), SentWith::Staging(i))
                    }
                    Buf::None => {
                        self.close(format!("command {cid}: data to send without a buffer"));
                        return;
                    }
                };
                self.free_resp.pop();
                let write = SendWr {
                    wr_id: WrId(K_WRITE | r as u64),
                    op: SendOp::RdmaWrite { remote_addr: addr, rkey: Rkey(key) },
                    payload: Payload::Sges(std::slice::from_ref(&sge)),
                    signaled: false,
                };
                self.post_response(r, &then, Some(to), Some((write, with)));
            }
            Action::RequestData { cid, ttag: slot, len } => {
                let Sgl::Keyed { addr, key, .. } = self.q.sgl(slot) else {
                    self.close(format!("command {cid}: data to fetch without a keyed SGL"));
                    return;
                };
                let (sge, into) = match self.q.data_chunk(slot) {
                    Some(c) => (self.pool_mr.as_ref().expect("a queue with chunks has its pool registered").sge(c, 0, len), ReadInto::Chunk),
                    None => {
                        let Some(i) = self.free_staging.pop() else {
                            self.waiting.push_back(Action::RequestData { cid, ttag: slot, len });
                            return;
                        };
                        (self.staging.lend(i, len), ReadInto::Staging(i))
                    }
                };
                let read = SendWr {
                    wr_id: WrId(K_READ | slot as u64),
                    op: SendOp::RdmaRead { remote_addr: addr, rkey: Rkey(key) },
                    payload: Payload::Sges(std::slice::from_ref(&sge)),
                    signaled: true,
                };
                if self.reads.len() <= slot as usize {
                    self.reads.resize(slot as usize + 1, None);
                }
                match self.qp.post_send(&[read]) {
                    Ok(()) => {
                        self.sends_outstanding += 1;
                        self.reads[slot as usize] = Some((into, len));
                    }
                    Err(e) => {
                        if let ReadInto::Staging(i) = into {
                            self.staging.reclaim(i);
                            self.free_staging.push(i);
                        }
                        self.close(format!("posting an RDMA READ: {e}"));
                    }
                }
            }
            Action::Close(why) => self.close(why),
        }
    }

    /// Posts completion `cqe` from response slot `r` (taken), after
    /// `first` (an RDMA WRITE of the command's data) when there is one; a
    /// SEND with Invalidate when the command's SGL asked for it.
    fn post_response(&mut self, r: usize, cqe: &CompletionEntry, sgl: Option<Sgl>, first: Option<(SendWr<'_>, SentWith)>) {
        self.resp.slot_mut(r).copy_from_slice(&cqe.to_bytes());
        let sge = self.resp.lend(r, CQE_SIZE as u32);
        let op = match sgl {
            Some(Sgl::Keyed { key, invalidate: true, length, .. }) if length > 0 => SendOp::SendWithInvalidate { rkey: Rkey(key) },
            _ => SendOp::Send,
        };
        let send = SendWr { wr_id: WrId(K_SEND | r as u64), op, payload: Payload::Sges(std::slice::from_ref(&sge)), signaled: true };
        let (posted, with) = match first {
            Some((write, with)) => (self.qp.post_send(&[write, send]), with),
            None => (self.qp.post_send(&[send]), SentWith::Nothing),
        };
        match posted {
            Ok(()) => {
                self.sends_outstanding += 1;
                self.sent_with[r] = with;
            }
            Err(e) => {
                self.resp.reclaim(r);
                self.free_resp.push(r);
                self.give_back(with);
                self.close(format!("posting a completion: {e}"));
            }
        }
    }

    /// Frees what a response's data went out of, once the send is done
    /// with it (its completion came, or it was never posted).
    fn give_back(&mut self, with: SentWith) {
        match with {
            SentWith::Nothing => {}
            SentWith::Chunk(c) => self.q.sent(c),
            SentWith::Staging(i) => {
                self.staging.reclaim(i);
                self.free_staging.push(i);
            }
        }
    }

    /// When the host ended the queue (a Disconnect), lets the answers
    /// already posted (the Disconnect's among them) reach it and, when
    /// they did, leaves the controller: a host that sees the queue pair go
    /// may at once connect the same queue id again, and must find it free
    /// (and the old queue's disk writes done). Then disconnects and lets
    /// every outstanding work request flush: the memory they name must not
    /// be reused before, so a queue whose answers did not go out (or that
    /// ends on a fault, with a host that may take none) leaves the
    /// controller only then.
    fn finish(&mut self, why: &CloseReason) {
        let delivered = why.kind == CloseKind::ByHost && self.settle(|c| c.sends_outstanding == 0);
        if delivered {
            self.q.close(why);
        }
        self.qp.disconnect();
        if !self.settle(|c| c.recvs_posted == 0 && c.sends_outstanding == 0) {
            tracing::warn!(
                "nvme+rdma {}: {} receives and {} sends did not flush within {CLOSE_GRACE:?}",
                self.q.peer,
                self.recvs_posted,
                self.sends_outstanding
            );
        }
        if !delivered {
            self.q.close(why);
        }
    }

    /// Handles completions until `done` holds (true) or `CLOSE_GRACE` has
    /// passed (false). A closing queue starts nothing new from them.
    fn settle(&mut self, done: impl Fn(&Self) -> bool) -> bool {
        let deadline = Instant::now() + CLOSE_GRACE;
        let mut wcs = [Completion::EMPTY; 32];
        while !done(self) && Instant::now() < deadline {
            match self.cq.poll(&mut wcs) {
                Ok(0) => std::thread::sleep(Duration::from_millis(1)),
                Ok(n) => {
                    for wc in &wcs[..n] {
                        self.completion(*wc);
                    }
                }
                Err(_) => break,
            }
        }
        done(self)
    }
}
