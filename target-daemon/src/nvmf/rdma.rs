//! The NVMe/RDMA transport (NVMe over Fabrics RDMA Transport Specification
//! 1.0b): one [`NvmeRdma`] per reactor holds the queue pairs (one NVMe
//! queue each) placed there, on the reactor's protection domain and
//! completion queues for the listener's fabric; no thread of its own.
//!
//! Connecting: the host's rdma_cm request carries the queue id and its
//! queue sizes ([`CmRequest`]); the control thread checks them and refuses
//! a wrong field with the NVMe/RDMA reject status for it, before any queue
//! pair exists. The reactor then makes the queue pair, posts one receive
//! per entry and accepts, telling the host how many commands the queue
//! takes (CRQSIZE: the receives posted). Its send queue holds, per entry,
//! a completion's SEND with the RDMA WRITE chained before it and every
//! piece of a command's data that may be out at once (a read in pool
//! chunks smaller than the largest transfer leaves in pieces, each before
//! the last an RDMA WRITE of its own); a queue whose work requests the
//! reactor's completion queues have no room for is refused (NO_RESOURCES),
//! and a Connect for a larger queue than the request named fails it.
//!
//! Capsules: each command arrives in one SEND into a receive slot of 64
//! bytes plus the in-capsule data the queue accepts (IOCCSZ); it is
//! decoded, its in-capsule data copied to the command's staging buffer,
//! and the receive posted again at once. A completion leaves in one SEND
//! of 16 bytes from a registered response slot. Data under a keyed SGL
//! moves one-sided, straight between the host's memory and the reactor's
//! pool chunk the executor granted (the pool is registered with the
//! reactor's domain): a read's piece by an RDMA WRITE (the last posted in
//! one chain with its completion: reliable-connected ordering places the
//! data first), a write's piece by an RDMA READ before it goes to the
//! disk. Data in heap memory (admin pages, DSM ranges) goes through the
//! reactor's registered staging slots. When the host's SGL asked for it
//! (Keyed Data Block, subtype Invalidate), the completion is a SEND with
//! Invalidate of the host's key.
//!
//! Nothing is posted the moment an answer is carried out: a queue's flush
//! (at the end of the reactor's turn) queues the send work requests of its
//! answers, RDMA READs, RDMA WRITEs and completions, and posts them together
//! at its end, in order, up to 16 per `post_send`: one system call (a
//! `sendmsg` on the tcp provider, a doorbell on rxe) for a burst's answers
//! instead of one each.
//!
//! A failed work request (the host's key refused, the queue pair broken)
//! ends the connection: the queue pair is disconnected, its outstanding
//! work requests flush, and the queue leaves its controller as a closed
//! NVMe/TCP connection does. A torn-down controller's queues are closed by
//! their reactors at the next turn (the registry wakes every reactor).

use std::any::Any;
use std::collections::VecDeque;
use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::Arc;
use std::time::{Duration, Instant};

use arrayvec::ArrayVec;
use rdmablk_common::fabric::{
    Access, Completion, ConnectRequest, Fabric, FabricError, FabricErrorKind, FabricOptions, ListenOptions, Listener, Payload, QpCaps,
    QpNum, QueuePair, RecvWr, Rkey, SendOp, SendWr, Sge, WcStatus, WrId,
};
use rdmablk_common::nvme::cqe::{CompletionEntry, CQE_SIZE};
use rdmablk_common::nvme::fabrics::{fctype, Connect};
use rdmablk_common::nvme::rdma::{reject, CmAccept, CmReject, CmRequest, RECFMT_1_0};
use rdmablk_common::nvme::sqe::{admin_opcode, Sgl, SubmissionEntry, SQE_SIZE};

use super::queue::{Action, Buf, Due, Queue};
use super::{
    CloseKind, CloseReason, Incoming, Subsystem, ADMIN_IN_CAPSULE, HOST_CLOSED, IO_IN_CAPSULE, MAX_HEAP_DATA, MAX_IO_QUEUES,
};
use crate::config::{NvmeListen, NvmeTransport, TargetConfig};
use crate::engine::exec::{CmdId, Event, CHUNK_WINDOW};
use crate::engine::pool::{ChunkId, SlotBuf};
use crate::reactor::fabric::completion_reason;
use crate::reactor::Runtime;
use crate::registry::{Admission, ConnectionSlot, HandshakeSlot, Protocol, Seen};

/// How long a closing queue waits for its answers to go out, and then for
/// its flushed work requests.
const CLOSE_GRACE: Duration = Duration::from_secs(2);
/// Staging slots (of `MAX_HEAP_DATA`) per reactor and fabric for data in
/// heap memory: admin pages and Connect data, DSM ranges.
const STAGING_SLOTS: usize = 8;
/// Answers that may wait for a response or staging slot before the host is
/// taken for one that does not take its completions.
const MAX_WAITING: usize = 4 * crate::config::MAX_NVME_QUEUE_SIZE as usize;
/// Send work requests per `post_send` when a queue's flush posts what it
/// queued: both providers carry at most 16 in one system call (the tcp
/// provider's `sendmsg`, the verbs provider's `ibv_post_send`, a doorbell
/// on rxe), as rdmablk v1's `TX_CHUNK`.
const TX_CHUNK: usize = 16;

// wr_id layout: kind:8 | queue generation:16 | queue:16 | index:24.
const K_RECV: u64 = 1;
const K_SEND: u64 = 2;
const K_READ: u64 = 3;
/// An RDMA WRITE of a read's piece that is not its last (signaled: its
/// chunk goes back at its completion; index: [`piece_index`], the chunk and
/// whether it stood for zeroes).
const K_WRITE: u64 = 4;
/// The RDMA WRITE of a read's last piece, unsignaled in the chain of its
/// completion (whose SEND completion gives the chunk back): it completes
/// only in error.
const K_CHAIN: u64 = 5;

fn wr_id(kind: u64, gen: u16, queue: u16, index: u32) -> WrId {
    WrId(kind << 56 | (gen as u64) << 40 | (queue as u64) << 24 | (index as u64 & 0xff_ffff))
}

fn split_wr_id(w: WrId) -> (u64, u16, u16, u32) {
    let v = w.0;
    (v >> 56, (v >> 40) as u16, (v >> 24) as u16, (v & 0xff_ffff) as u32)
}

/// In the index of a [`K_WRITE`]: the piece stood for zeroes.
const ZERO_PIECE: u32 = 1 << 16;

/// The index of a [`K_WRITE`] of a piece out of `with`, which is all its
/// completion needs (as v1's RDMA work requests carry their chunk).
fn piece_index(with: SentWith) -> u32 {
    match with {
        SentWith::Chunk(c) => c.0 as u32,
        SentWith::Zero(c) => c.0 as u32 | ZERO_PIECE,
        SentWith::Nothing | SentWith::Staging(_) => unreachable!("a piece before a read's last is a pool chunk's"),
    }
}

/// What a [`K_WRITE`] with `index` went out of.
fn piece_of(index: u32) -> SentWith {
    let c = ChunkId(index as u16);
    if index & ZERO_PIECE != 0 {
        SentWith::Zero(c)
    } else {
        SentWith::Chunk(c)
    }
}

/// Pieces of one command's data that may be on the send queue at once as
/// work requests of their own: a write's RDMA READs (one at a time, as the
/// queue asks for them) or a read's RDMA WRITEs before its last, as many
/// as the pieces of the largest transfer (MDTS: `max_transfer`) in pool
/// chunks of `chunk_size`, and no more than the executor keeps in flight
/// per command.
fn pieces_per_command(max_transfer: u32, chunk_size: u32) -> u32 {
    max_transfer.div_ceil(chunk_size.max(1)).min(CHUNK_WINDOW)
}

/// The send queue of a queue of `entries` entries: per response slot (one
/// per entry) its completion's SEND and the unsignaled RDMA WRITE of a
/// read's last piece chained before it, and per command
/// [`pieces_per_command`] pieces, which all hold a pool chunk (or stand
/// for one: a null volume's zeroes) or a staging slot while they are out,
/// so no more of those than the reactor has (as rdmablk v1's
/// `send_queue_depth`).
fn send_queue_depth(entries: u32, max_transfer: u32, chunk_size: u32, pool_chunks: u32) -> u32 {
    2 * entries + (entries * pieces_per_command(max_transfer, chunk_size)).min(pool_chunks + STAGING_SLOTS as u32)
}

/// An `nvme+rdma://` listener: an rdma_cm listener on its own fabric.
pub struct RdmaListener {
    // Field order: the listener goes before its fabric.
    listener: Listener,
    fabric: Arc<Fabric>,
    addr: SocketAddr,
}

/// A connection request for a reactor: checked, admitted, not accepted yet.
pub struct Accept {
    req: ConnectRequest,
    cm: CmRequest,
    /// Which NVMe/RDMA listener's fabric (in listener order).
    rdma_index: usize,
    peer: SocketAddr,
    local: SocketAddr,
    port: u16,
    admission: Admission,
}

impl RdmaListener {
    pub fn bind(source: &str, l: &NvmeListen, cfg: &TargetConfig) -> crate::Result<RdmaListener> {
        let options = FabricOptions { transport_timeout: cfg.transport_timeout, frame_timeout: cfg.frame_timeout };
        let fabric = Fabric::open_with(&l.url, options).map_err(|e| crate::Error::fabric(format!("{l}: cannot open the fabric"), e))?;
        let listener = fabric
            .listen_with(ListenOptions { handshake_timeout: cfg.handshake_timeout })
            .map_err(|e| crate::target::listen_error(format!("{source}: target.listen: cannot listen on {l}"), e))?;
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

    /// The listener's fabric: every reactor has its resources on it.
    pub fn fabric(&self) -> Arc<Fabric> {
        Arc::clone(&self.fabric)
    }

    /// Takes every pending connection request: refuses the ones whose
    /// private data is wrong (with its reject status) or over the
    /// connection limits, and passes the others on for a reactor.
    pub fn accept(&self, sub: &Arc<Subsystem>, port: u16, rdma_index: usize, out: &mut Vec<Incoming>) {
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
            let cm = match CmRequest::parse(req.raw_private_data(), MAX_IO_QUEUES, sub.cfg.nvme_queue_size, sub.cfg.nvme_queue_size) {
                Ok(cm) => cm,
                Err(r) => {
                    refuse(req, r.status, &r.to_string());
                    continue;
                }
            };
            let admission = match sub.registry.begin_handshake(Protocol::Nvme, (!peer.ip().is_unspecified()).then(|| peer.ip())) {
                Ok(a) => a,
                Err(why) => {
                    refuse(req, reject::NO_RESOURCES, &sub.registry.refusal_reason(Protocol::Nvme, why));
                    continue;
                }
            };
            // The address this host reached: the discovery log names a
            // wildcard listener by it.
            let local = req.local_addr().unwrap_or(self.addr);
            out.push(Incoming::Rdma(Accept { req, cm, rdma_index, peer, local, port, admission }));
        }
    }
}

/// Where an RDMA READ of host data lands.
#[derive(Clone, Copy, Debug)]
enum ReadInto {
    /// The pool chunk of the write's piece, directly.
    Chunk(ChunkId),
    /// Staging slot `i`, copied to the command's heap buffer afterwards.
    Staging(usize),
}

/// What a signaled send-queue work request's completion gives back.
#[derive(Clone, Copy, Debug)]
enum SentWith {
    Nothing,
    /// The pool chunk a read's piece went out of.
    Chunk(ChunkId),
    /// A chunk that stood for zeroes (the data went out of the zero chunk;
    /// the chunk is lent to the fabric all the same while the piece is out,
    /// so that it is found there: [`NvmeRdma::take_back_lent`]).
    Zero(ChunkId),
    /// The staging slot heap data went out of.
    Staging(usize),
}

/// A send-queue work request as queued: its SGE is kept here, and the
/// `SendWr` that borrows it is built when it is posted.
#[derive(Clone, Copy)]
struct Wr {
    wr_id: WrId,
    op: SendOp,
    sge: Sge,
}

/// What a queue's flush posts at its end ([`NvmeRdma::post_queued`]), in
/// order. What it lends (a pool chunk, a staging slot, a response slot) is
/// taken when it is queued; what it counts (`sends_outstanding`, and
/// `reads` or `sent_with`) only once it is posted.
#[derive(Clone, Copy)]
enum Tx {
    /// A signaled RDMA READ of a write's piece into `into` (`len` bytes),
    /// for command slot `slot`.
    Read { wr: Wr, slot: u16, into: ReadInto, len: u32 },
    /// A signaled RDMA WRITE of a read's piece before its last, out of
    /// `with` (its chunk, or the zero chunk for it), which its `wr_id` names.
    Write { wr: Wr, with: SentWith },
    /// A completion's signaled SEND from response slot `slot`, after the
    /// unsignaled RDMA WRITE of the data's last piece (`chain`, out of
    /// `with`) when there is one: the two always go in one `post_send`.
    Respond { chain: Option<Wr>, send: Wr, slot: usize, with: SentWith },
}

impl Tx {
    /// Its work requests.
    fn wrs(&self) -> usize {
        1 + matches!(self, Tx::Respond { chain: Some(_), .. }) as usize
    }

    /// Appends its work requests to `out`.
    fn push_to<'a>(&'a self, out: &mut ArrayVec<SendWr<'a>, TX_CHUNK>) {
        let wr = |w: &'a Wr, signaled: bool| {
            SendWr { wr_id: w.wr_id, op: w.op, payload: Payload::Sges(std::slice::from_ref(&w.sge)), signaled }
        };
        match self {
            Tx::Read { wr: w, .. } | Tx::Write { wr: w, .. } => out.push(wr(w, true)),
            Tx::Respond { chain, send, .. } => {
                if let Some(w) = chain {
                    out.push(wr(w, false));
                }
                out.push(wr(send, true));
            }
        }
    }
}

/// The reactor's staging slots on one fabric.
struct Staging {
    slots: SlotBuf,
    free: Vec<usize>,
}

/// One NVMe/RDMA queue on this reactor.
struct RQueue {
    // Field order is drop order: the queue pair goes before the memory it
    // could still reach.
    /// `None` once destroyed: when work requests did not flush in time,
    /// before what they name is given back ([`NvmeRdma::take_back_lent`]).
    qp: Option<QueuePair>,
    recv: SlotBuf,
    resp: SlotBuf,
    qp_num: QpNum,
    /// The runtime's fabric, the NVMe/RDMA listener's index, its CQ and
    /// the entries it reserved there.
    fi: usize,
    rdma_index: usize,
    cq: usize,
    cq_reserved: u32,
    q: Queue,
    cm: CmRequest,
    recv_size: u32,
    free_resp: Vec<usize>,
    sent_with: Vec<SentWith>,
    /// Per command slot: where its RDMA READ lands, while one is in flight.
    reads: Vec<Option<(ReadInto, u32)>>,
    /// Answers waiting for a response or staging slot, in order.
    waiting: VecDeque<Action>,
    /// The send work requests of the flush under way, posted at its end
    /// (kept empty with its capacity in between).
    tx: Vec<Tx>,
    /// Receives posted, and signaled send-queue work requests outstanding.
    recvs_posted: u32,
    sends_outstanding: u32,
    closing: Option<CloseReason>,
    close_phase: ClosePhase,
    close_due: Option<Instant>,
    handshake: Option<HandshakeSlot>,
    _connection: ConnectionSlot,
    dirty: bool,
}

/// Where a closing queue is in its teardown.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum ClosePhase {
    /// Its answers may still go out (a host that ended the queue waits
    /// for them): nothing disconnected yet.
    Answering,
    /// Disconnected: its work requests flush.
    Flushing,
    /// Nothing of it on the fabric: its commands are dropped, the
    /// executor's last ones finish.
    Draining,
}

struct Slot {
    gen: u16,
    q: Option<RQueue>,
}

/// The NVMe/RDMA transport of one reactor.
pub struct NvmeRdma {
    index: usize,
    sub: Arc<Subsystem>,
    /// The runtime's fabric index of each NVMe/RDMA listener's fabric.
    fabrics: Vec<usize>,
    staging: Vec<Option<Staging>>,
    queues: Vec<Slot>,
    free: Vec<u16>,
    dirty: Vec<u16>,
    held: Vec<u16>,
    seen: Seen,
    /// The earliest deadline of any queue, when known (recomputed by a
    /// pass over them when `deadlines_stale`), as NVMe/TCP keeps it: what
    /// a queue's deadline hangs on moves rarely (its handshake, a Connect
    /// the fence holds, an admin queue's commands, its close, the fence's
    /// news), and each of those marks it stale.
    earliest: Option<Instant>,
    deadlines_stale: bool,
    live: usize,
}

impl NvmeRdma {
    /// The transport for index `index`, whose listeners' fabrics are the
    /// runtime's fabrics `fabrics` (in listener order).
    pub fn new(index: usize, sub: Arc<Subsystem>, fabrics: Vec<usize>) -> NvmeRdma {
        let staging = fabrics.iter().map(|_| None).collect();
        NvmeRdma {
            index,
            sub,
            fabrics,
            staging,
            queues: Vec::new(),
            free: Vec::new(),
            dirty: Vec::new(),
            held: Vec::new(),
            seen: Seen::default(),
            earliest: None,
            deadlines_stale: false,
            live: 0,
        }
    }

    fn queue(&mut self, qi: u16) -> &mut RQueue {
        self.queues[qi as usize].q.as_mut().expect("live queue")
    }

    fn mark_dirty(&mut self, qi: u16) {
        let r = self.queue(qi);
        if !r.dirty {
            r.dirty = true;
            self.dirty.push(qi);
        }
    }

    /// The staging slots on NVMe/RDMA fabric `ri`, registered at first use.
    fn staging(&mut self, rt: &Runtime, ri: usize) -> Option<&mut Staging> {
        if self.staging[ri].is_none() {
            let mut slots = SlotBuf::new(STAGING_SLOTS, MAX_HEAP_DATA as usize);
            match slots.register(&rt.fabrics[self.fabrics[ri]].pd, Access::LOCAL_WRITE) {
                Ok(()) => self.staging[ri] = Some(Staging { slots, free: (0..STAGING_SLOTS).rev().collect() }),
                Err(e) => {
                    tracing::error!("nvme+rdma: reactor {}: cannot register staging slots: {e}", rt.id);
                    return None;
                }
            }
        }
        self.staging[ri].as_mut()
    }

    fn adopt_queue(&mut self, rt: &mut Runtime, a: Accept) {
        let Accept { req, cm, rdma_index, peer, local, port, admission } = a;
        let name = req.peer();
        if rt.shutdown.is_some() {
            req.reject_raw(&CmReject { recfmt: RECFMT_1_0, status: reject::NO_RESOURCES }.encode());
            return;
        }
        let Some(&fi) = self.fabrics.get(rdma_index) else {
            tracing::error!("nvme+rdma {name}: reactor {} has no resources on that listener's fabric", rt.id);
            return;
        };
        let entries = cm.entries();
        let in_capsule = if cm.qid == 0 { ADMIN_IN_CAPSULE } else { IO_IN_CAPSULE };
        let recv_size = SQE_SIZE as u32 + in_capsule;
        let pool_chunks = rt.exec.engine().pool().capacity() as u32;
        let max_send_wr = send_queue_depth(entries, self.sub.max_transfer, rt.exec.engine().chunk_size() as u32, pool_chunks);
        // Its receives and everything it may have on the send queue (a
        // work request that flushes completes, signaled or not).
        let reserve = max_send_wr + entries;
        let ci = match rt.cq_with_room(fi, reserve) {
            // A completion queue made for it is sized for the fabric's
            // queue depth, which need not leave room for this much.
            Ok(ci) if rt.fabrics[fi].cqs[ci].reserved + reserve <= rt.fabrics[fi].cqs[ci].capacity.saturating_sub(pool_chunks) => ci,
            made => {
                let why = match made {
                    Ok(ci) => format!(
                        "a completion queue of {} entries has no room for its {reserve} beside {pool_chunks} pool chunks",
                        rt.fabrics[fi].cqs[ci].capacity
                    ),
                    Err(e) => e.to_string(),
                };
                tracing::warn!("nvme+rdma {name}: cannot accept the queue of {entries} entries: {why}");
                req.reject_raw(&CmReject { recfmt: RECFMT_1_0, status: reject::NO_RESOURCES }.encode());
                return;
            }
        };
        let qi = match self.free.pop() {
            Some(qi) => qi,
            None if self.queues.len() < u16::MAX as usize => {
                self.queues.push(Slot { gen: 0, q: None });
                (self.queues.len() - 1) as u16
            }
            None => {
                req.reject_raw(&CmReject { recfmt: RECFMT_1_0, status: reject::NO_RESOURCES }.encode());
                return;
            }
        };
        let gen = self.queues[qi as usize].gen;
        let f = &rt.fabrics[fi];
        let caps = QpCaps { max_send_wr, max_recv_wr: entries, max_send_sge: 1, max_recv_sge: 1, max_inline_data: 0 };
        let made = (|| -> Result<(QueuePair, SlotBuf, SlotBuf), String> {
            let qp = req.into_queue_pair(&f.pd, &f.cqs[ci].cq, caps).map_err(|e| format!("queue pair: {e}"))?;
            let got = qp.caps();
            if got.max_send_wr < max_send_wr || got.max_recv_wr < entries {
                return Err(format!("the device granted {got:?}, the queue needs {caps:?}"));
            }
            let mut recv = SlotBuf::new(entries as usize, recv_size as usize);
            let mut resp = SlotBuf::new(entries as usize, CQE_SIZE);
            recv.register(&f.pd, Access::LOCAL_WRITE).map_err(|e| format!("receive slots: {e}"))?;
            resp.register(&f.pd, Access::NONE).map_err(|e| format!("response slots: {e}"))?;
            Ok((qp, recv, resp))
        })();
        let (qp, recv, resp) = match made {
            Ok(m) => m,
            Err(why) => {
                tracing::warn!("nvme+rdma {name}: cannot accept the queue: {why}");
                self.free.push(qi);
                return;
            }
        };
        let mut q = Queue::new(Arc::clone(&self.sub), NvmeTransport::Rdma, port, local, peer);
        q.place(rt.id, self.index, qi, admission.connection.host_pool_account(rt.id).cloned());
        q.now = rt.turn_start;
        let mut r = RQueue {
            qp_num: qp.qp_num(),
            qp: Some(qp),
            recv,
            resp,
            fi,
            rdma_index,
            cq: ci,
            cq_reserved: reserve,
            q,
            cm,
            recv_size,
            free_resp: (0..entries as usize).rev().collect(),
            sent_with: vec![SentWith::Nothing; entries as usize],
            reads: Vec::new(),
            waiting: VecDeque::new(),
            tx: Vec::new(),
            recvs_posted: 0,
            sends_outstanding: 0,
            closing: None,
            close_phase: ClosePhase::Answering,
            close_due: None,
            handshake: Some(admission.handshake),
            _connection: admission.connection,
            dirty: false,
        };
        // Receives are posted from here on: completions of them may still
        // come if the queue is given up, and must not be taken for the next
        // queue in the slot (as v1's `discard`).
        let discard = |this: &mut NvmeRdma| {
            let slot = &mut this.queues[qi as usize];
            slot.gen = slot.gen.wrapping_add(1);
            this.free.push(qi);
        };
        for i in 0..entries as usize {
            if let Err(e) = r.post_recv(gen, qi, i) {
                tracing::warn!("nvme+rdma {name}: cannot accept the queue: posting receives: {e}");
                discard(self);
                return;
            }
        }
        let accept = CmAccept { recfmt: RECFMT_1_0, crqsize: entries as u16 };
        if let Err(e) = r.qp.as_ref().expect("just made").accept_raw(&accept.encode()) {
            tracing::warn!("nvme+rdma {name}: cannot accept the queue: {e}");
            discard(self);
            return;
        }
        rt.fabrics[fi].cqs[ci].reserved += reserve;
        tracing::debug!("nvme+rdma {name}: queue {} connected on reactor {} ({entries} entries)", cm.qid, rt.id);
        self.queues[qi as usize].q = Some(r);
        self.live += 1;
        // Its handshake's deadline.
        self.deadlines_stale = true;
        rt.stats.queue_pairs.add(1);
    }

    fn on_completion(&mut self, rt: &mut Runtime, wc: Completion) {
        let (kind, gen, qi, index) = split_wr_id(wc.wr_id);
        let live = self.queues.get(qi as usize).is_some_and(|s| s.gen == gen && s.q.as_ref().is_some_and(|r| r.qp_num == wc.qp_num));
        if !live {
            tracing::trace!("nvme+rdma: stale completion {wc:?}");
            return;
        }
        if self.queue(qi).close_phase == ClosePhase::Draining {
            // Everything it posted completed, or what had not when the
            // close's grace ended was taken back (`take_back_lent`, which
            // a failed post may count on): nothing is owed to a late flush.
            tracing::trace!("nvme+rdma: completion after the flush {wc:?}");
            return;
        }
        let ok = wc.status == WcStatus::Success;
        if !ok {
            // A flush before this side closed: the queue pair was
            // disconnected by the host (a failed work request of its own
            // comes first, with its status, and sets the reason).
            let why = if wc.status == WcStatus::WrFlushError {
                CloseReason::by_host(format!("{HOST_CLOSED} (the queue pair was disconnected)"))
            } else {
                let what = match kind {
                    K_RECV => "a receive",
                    K_SEND => "a completion's SEND",
                    K_READ => "an RDMA READ",
                    _ => "an RDMA WRITE",
                };
                CloseReason::fault(completion_reason(what, wc.status))
            };
            if wc.status != WcStatus::WrFlushError && self.queue(qi).closing.is_none() {
                tracing::warn!("nvme+rdma {}: {why}", self.queue(qi).q.peer);
            }
            self.close(qi, why);
        }
        let index = index as usize;
        match kind {
            K_RECV => {
                let r = self.queue(qi);
                r.recvs_posted -= 1;
                r.recv.reclaim(index);
                if ok && r.closing.is_none() {
                    r.q.now = rt.turn_start;
                    self.capsule(rt, qi, gen, index, wc.byte_len);
                }
            }
            K_SEND => {
                let r = self.queue(qi);
                r.sends_outstanding -= 1;
                r.resp.reclaim(index);
                let with = std::mem::replace(&mut r.sent_with[index], SentWith::Nothing);
                r.free_resp.push(index);
                self.give_back(rt, qi, with);
            }
            K_WRITE => {
                self.queue(qi).sends_outstanding -= 1;
                self.give_back(rt, qi, piece_of(index as u32));
            }
            K_READ => {
                let ri = self.queue(qi).rdma_index;
                let r = self.queue(qi);
                r.sends_outstanding -= 1;
                let Some((into, len)) = r.reads.get_mut(index).and_then(Option::take) else { return };
                let slot = index as u16;
                match into {
                    ReadInto::Chunk(c) => {
                        rt.exec.engine_mut().pool_mut().return_from_fabric(c);
                        if !ok || r.closing.is_some() {
                            r.q.fetch_failed(&mut rt.exec, slot);
                        } else if let Err(why) = r.q.data_placed(&mut rt.exec, slot, len, true) {
                            self.close(qi, why.into());
                        }
                    }
                    ReadInto::Staging(i) => {
                        let staging = self.staging[ri].as_mut().expect("staging slots in use");
                        staging.slots.reclaim(i);
                        let r = self.queues[qi as usize].q.as_mut().expect("live queue");
                        if ok && r.closing.is_none() {
                            let staged = &staging.slots.slot(i)[..len as usize];
                            r.q.data_mut(&mut rt.exec, slot, 0, len).copy_from_slice(staged);
                            if let Err(why) = r.q.data_placed(&mut rt.exec, slot, len, true) {
                                self.close(qi, why.into());
                            }
                        }
                        self.staging[ri].as_mut().expect("staging slots in use").free.push(i);
                    }
                }
            }
            _ => {}
        }
        self.mark_dirty(qi);
    }

    /// A command capsule arrived in receive slot `i` of queue `qi`.
    fn capsule(&mut self, rt: &mut Runtime, qi: u16, gen: u16, i: usize, len: u32) {
        let r = self.queue(qi);
        if (len as usize) < SQE_SIZE {
            // Linux nvmet treats this as a fatal controller error too.
            return self.close(qi, format!("a capsule of {len} bytes, shorter than a command").into());
        }
        let bytes = &r.recv.slot(i)[..len as usize];
        let sqe = SubmissionEntry::decode_unchecked(&bytes[..SQE_SIZE]).expect("64 bytes");
        if sqe.opcode == admin_opcode::FABRICS && sqe.fctype() == fctype::CONNECT {
            let c = Connect::from_entry(&sqe);
            if c.qid != r.cm.qid {
                // The queue was sized and accepted for the queue id the
                // connect request named.
                let why = format!("Connect for queue {} on the queue pair connected as queue {}", c.qid, r.cm.qid);
                return self.close(qi, why.into());
            }
            if c.queue_entries() > r.cm.entries() {
                // And for as many commands as it named: its send queue
                // has room for the data of no more.
                let why = format!("Connect for {} entries on the queue pair connected for {}", c.queue_entries(), r.cm.entries());
                return self.close(qi, why.into());
            }
        }
        let in_capsule = len - SQE_SIZE as u32;
        if let Some(slot) = r.q.command(&mut rt.exec, sqe, in_capsule) {
            let data = &r.recv.slot(i)[SQE_SIZE..len as usize];
            r.q.data_mut(&mut rt.exec, slot, 0, in_capsule).copy_from_slice(data);
            if let Err(why) = r.q.data_placed(&mut rt.exec, slot, in_capsule, true) {
                return self.close(qi, why.into());
            }
        }
        if let Err(e) = r.post_recv(gen, qi, i) {
            self.close(qi, format!("posting a receive: {e}").into());
        }
    }

    fn close(&mut self, qi: u16, why: CloseReason) {
        let r = self.queue(qi);
        if r.closing.is_none() {
            r.closing = Some(why);
            self.deadlines_stale = true;
        }
        self.mark_dirty(qi);
    }

    /// Frees what a send's data went out of, once the send is done with it
    /// (its completion came, or it was never posted).
    fn give_back(&mut self, rt: &mut Runtime, qi: u16, with: SentWith) {
        match with {
            SentWith::Nothing => {}
            SentWith::Chunk(c) | SentWith::Zero(c) => {
                rt.exec.engine_mut().pool_mut().return_from_fabric(c);
                rt.exec.sent(c);
            }
            SentWith::Staging(i) => {
                let ri = self.queue(qi).rdma_index;
                let s = self.staging[ri].as_mut().expect("staging slots in use");
                s.slots.reclaim(i);
                s.free.push(i);
            }
        }
    }

    /// Carries out the queue's answers, in order: those that find no
    /// response or staging slot wait for one.
    fn flush_queue(&mut self, rt: &mut Runtime, qi: u16) {
        let r = self.queue(qi);
        r.dirty = false;
        // An admin queue's keep-alive or idle deadline may have moved (a
        // command, its answer, the executor's news), and a closing queue's
        // moves with its close ([`NvmeRdma::maybe_end`], at the end).
        let mut stale = r.q.is_admin() || r.closing.is_some();
        if r.q.conn.is_some() && r.handshake.is_some() {
            // Past its handshake: the slot goes back for the next connection.
            r.handshake = None;
            stale = true;
        }
        if r.q.connect_deadline().is_some() && !self.held.contains(&qi) {
            self.held.push(qi);
            stale = true;
        }
        self.deadlines_stale |= stale;
        // The queue's own close (a Disconnect) comes before the answer made
        // with it, and that answer must still go out: it closes the queue
        // after the whole batch.
        let mut close = None;
        let mut batch = self.queue(qi).q.take_actions();
        for a in batch.drain(..) {
            if let Action::Close(why) = a {
                close.get_or_insert(why);
                continue;
            }
            self.queue(qi).waiting.push_back(a);
        }
        self.queue(qi).q.actions_done(batch);
        // Each waiting answer once, in place: one that still finds no slot
        // goes back in front, and those behind it wait too.
        let mut stuck = false;
        for _ in 0..self.queue(qi).waiting.len() {
            let a = self.queue(qi).waiting.pop_front().expect("counted");
            if stuck {
                self.queue(qi).waiting.push_back(a);
                continue;
            }
            if let Some(back) = self.act(rt, qi, a) {
                self.queue(qi).waiting.push_back(back);
                stuck = true;
            }
        }
        self.post_queued(rt, qi);
        if let Some(why) = close {
            self.close(qi, why);
        }
        let r = self.queue(qi);
        if r.waiting.len() > MAX_WAITING {
            let why = format!("the host takes no completions ({} answers waiting)", r.waiting.len());
            self.close(qi, why.into());
        }
        self.maybe_end(rt, qi);
    }

    /// Posts the send work requests the queue's flush queued, in order, up
    /// to [`TX_CHUNK`] per `post_send` (a read's last RDMA WRITE and its
    /// completion's SEND always in the same one), and counts each posted
    /// one as outstanding.
    ///
    /// A failed `post_send` fails the queue (it is disconnected, and what
    /// it posted flushes). The fabric API does not say which work requests
    /// of a failed call were posted; both providers post a call's list in
    /// order and stop at the first one they refuse (verbs: a request the
    /// arguments check or the shadow send queue refuses, or `ibv_post_send`'s
    /// `bad_wr`; tcp: the arguments check or a full send queue, a broken
    /// connection being no error there but flush completions): those before
    /// it were posted, it and those after it were not. What this relies on:
    /// the calls before the failed one posted everything; the calls after
    /// it were never made, so what their work requests lend comes back
    /// now; the failed call's last work request was not posted either (so a
    /// call of one posted nothing), and it comes back now if it stands
    /// alone (a READ, a WRITE, a SEND without data); the rest of the failed
    /// call may have been posted and is counted as posted: what it lends
    /// comes back with its flush completion or, for what was not posted
    /// and so never completes, when the close's grace ends
    /// ([`NvmeRdma::take_back_lent`]), not before, since the device may
    /// still read or write that memory until then (such a queue leaves
    /// after [`CLOSE_GRACE`], with the warning that says what did not flush).
    fn post_queued(&mut self, rt: &mut Runtime, qi: u16) {
        let r = self.queue(qi);
        if r.tx.is_empty() {
            return;
        }
        let mut tx = std::mem::take(&mut r.tx);
        let mut at = 0;
        let mut failed = None;
        // A queue whose queue pair is gone queues nothing (`act`): were
        // anything queued, it would come back unposted.
        while at < tx.len() && self.queue(qi).qp.is_some() {
            let r = self.queue(qi);
            let mut end = at;
            let mut wrs = ArrayVec::<SendWr, TX_CHUNK>::new();
            while end < tx.len() && wrs.len() + tx[end].wrs() <= TX_CHUNK {
                tx[end].push_to(&mut wrs);
                end += 1;
            }
            let (posted, n) = (r.qp.as_ref().expect("checked above").post_send(&wrs), wrs.len());
            drop(wrs);
            match posted {
                Ok(()) => tx[at..end].iter().for_each(|t| r.count_posted(t)),
                Err(e) => {
                    let alone = tx[end - 1].wrs() == 1;
                    let maybe = end - alone as usize;
                    tx[at..maybe].iter().for_each(|t| r.count_posted(t));
                    failed = Some((e, n));
                    at = maybe;
                    break;
                }
            }
            at = end;
        }
        for &t in &tx[at..] {
            self.unqueue(rt, qi, t);
        }
        tx.clear();
        self.queue(qi).tx = tx;
        if let Some((e, n)) = failed {
            self.close(qi, CloseReason::fault(format!("posting {n} send work requests: {e}")));
        }
    }

    /// Gives back what a queued work request that was not posted lends.
    fn unqueue(&mut self, rt: &mut Runtime, qi: u16, t: Tx) {
        match t {
            Tx::Read { slot, into: ReadInto::Chunk(c), .. } => {
                rt.exec.engine_mut().pool_mut().return_from_fabric(c);
                self.queue(qi).q.fetch_failed(&mut rt.exec, slot);
            }
            Tx::Read { into: ReadInto::Staging(i), .. } => self.give_back(rt, qi, SentWith::Staging(i)),
            Tx::Write { with, .. } => self.give_back(rt, qi, with),
            Tx::Respond { slot, with, .. } => {
                let r = self.queue(qi);
                r.resp.reclaim(slot);
                r.free_resp.push(slot);
                self.give_back(rt, qi, with);
            }
        }
    }

    /// Carries out one answer: queues its work requests for the end of the
    /// flush ([`NvmeRdma::post_queued`]); gives it back when it finds no slot.
    fn act(&mut self, rt: &mut Runtime, qi: u16, a: Action) -> Option<Action> {
        let gen = self.queues[qi as usize].gen;
        let ri = self.queue(qi).rdma_index;
        if self.queue(qi).closing.is_some() && self.queue(qi).close_phase != ClosePhase::Answering {
            // Nothing more goes on the wire: what a piece lends comes back.
            if let Action::SendData { buf: Buf::Chunk(c) | Buf::Zero(c), .. } = a {
                rt.exec.sent(c);
            }
            return None;
        }
        match a {
            Action::Respond(cqe, sgl) => {
                let r = self.queue(qi);
                let Some(slot) = r.free_resp.pop() else { return Some(Action::Respond(cqe, sgl)) };
                r.queue_response(gen, qi, slot, &cqe, sgl, None);
                None
            }
            Action::SendData { cid, buf, off, len, to, then } => {
                let Sgl::Keyed { addr, key, .. } = to else {
                    self.close(qi, format!("command {cid}: data to send without a keyed SGL ({to:?})").into());
                    if let Buf::Chunk(c) | Buf::Zero(c) = buf {
                        rt.exec.sent(c);
                    }
                    return None;
                };
                if then.is_some() && self.queue(qi).free_resp.is_empty() {
                    return Some(Action::SendData { cid, buf, off, len, to, then });
                }
                let fi = self.queue(qi).fi;
                let (sge, with) = match buf {
                    Buf::Chunk(c) => {
                        rt.exec.engine_mut().pool_mut().lend_to_fabric(c);
                        (rt.fabrics[fi].pool_mr.sge(c, 0, len), SentWith::Chunk(c))
                    }
                    Buf::Zero(c) => {
                        rt.exec.engine_mut().pool_mut().lend_to_fabric(c);
                        (rt.fabrics[fi].pool_mr.zero_sge(len), SentWith::Zero(c))
                    }
                    Buf::Heap(v) => {
                        let Some(staging) = self.staging(rt, ri) else {
                            self.close(qi, "no staging slots for admin data".into());
                            return None;
                        };
                        let Some(i) = staging.free.pop() else {
                            return Some(Action::SendData { cid, buf: Buf::Heap(v), off, len, to, then });
                        };
                        staging.slots.slot_mut(i)[..len as usize].copy_from_slice(&v[..len as usize]);
                        (staging.slots.lend(i, len), SentWith::Staging(i))
                    }
                };
                let remote_addr = addr.wrapping_add(off as u64);
                match then {
                    Some(cqe) => {
                        let write = Wr { wr_id: wr_id(K_CHAIN, gen, qi, 0), op: SendOp::RdmaWrite { remote_addr, rkey: Rkey(key) }, sge };
                        let r = self.queue(qi);
                        let slot = r.free_resp.pop().expect("checked above");
                        r.queue_response(gen, qi, slot, &cqe, Some(to), Some((write, with)));
                    }
                    None => {
                        // A piece before the last: its own signaled WRITE.
                        if !matches!(with, SentWith::Chunk(_) | SentWith::Zero(_)) {
                            self.give_back(rt, qi, with);
                            self.close(qi, "admin data in pieces".into());
                            return None;
                        }
                        let op = SendOp::RdmaWrite { remote_addr, rkey: Rkey(key) };
                        let wr = Wr { wr_id: wr_id(K_WRITE, gen, qi, piece_index(with)), op, sge };
                        self.queue(qi).tx.push(Tx::Write { wr, with });
                    }
                }
                None
            }
            Action::RequestData { cid, ttag: slot, off, len } => {
                let r = self.queue(qi);
                let Sgl::Keyed { addr, key, .. } = r.q.sgl(slot) else {
                    self.close(qi, format!("command {cid}: data to fetch without a keyed SGL").into());
                    return None;
                };
                let fi = r.fi;
                let (sge, into) = match r.q.fetch_target(slot) {
                    Some(c) => {
                        rt.exec.engine_mut().pool_mut().lend_to_fabric(c);
                        let at = r.q.fetch_offset(slot, off) as u32;
                        (rt.fabrics[fi].pool_mr.sge(c, at, len), ReadInto::Chunk(c))
                    }
                    None => {
                        let Some(staging) = self.staging(rt, ri) else {
                            self.close(qi, "no staging slots for admin data".into());
                            return None;
                        };
                        let Some(i) = staging.free.pop() else { return Some(Action::RequestData { cid, ttag: slot, off, len }) };
                        (staging.slots.lend(i, len), ReadInto::Staging(i))
                    }
                };
                let op = SendOp::RdmaRead { remote_addr: addr.wrapping_add(off as u64), rkey: Rkey(key) };
                let wr = Wr { wr_id: wr_id(K_READ, gen, qi, slot as u32), op, sge };
                self.queue(qi).tx.push(Tx::Read { wr, slot, into, len });
                None
            }
            Action::Close(why) => {
                self.close(qi, why);
                None
            }
        }
    }

    /// Moves a closing queue on (see [`ClosePhase`]): a host that ended
    /// the queue gets the answers already posted (the Disconnect's among
    /// them) before the queue pair goes; a queue that faulted, or whose
    /// answers did not go out in time, is disconnected at once. Either way
    /// every work request has flushed before the memory it names is
    /// reused, the commands go (what reached the disk finishes), and the
    /// queue leaves its controller only then.
    fn maybe_end(&mut self, rt: &mut Runtime, qi: u16) {
        let r = self.queue(qi);
        let Some(why) = r.closing.clone() else { return };
        let now = Instant::now();
        let due = *r.close_due.get_or_insert(now + CLOSE_GRACE);
        if r.close_phase == ClosePhase::Answering {
            let delivered = why.kind == CloseKind::ByHost && r.sends_outstanding == 0;
            if delivered {
                // Its answers are out: it leaves its controller before the
                // host sees the queue pair go, so the host finds the queue
                // id free if it connects it again at once.
                r.q.drop_commands(&mut rt.exec);
                if r.q.exec_live() > 0 {
                    return;
                }
                r.q.leave(&why);
            } else if why.kind == CloseKind::ByHost && now < due && r.q.conn.is_some() {
                return;
            }
            if let Some(qp) = &r.qp {
                qp.disconnect();
            }
            r.close_phase = ClosePhase::Flushing;
            r.close_due = Some(now + CLOSE_GRACE);
        }
        let r = self.queue(qi);
        if r.close_phase == ClosePhase::Flushing {
            if (r.recvs_posted > 0 || r.sends_outstanding > 0) && now < r.close_due.unwrap_or(now) {
                return;
            }
            if r.recvs_posted > 0 || r.sends_outstanding > 0 {
                tracing::warn!(
                    "nvme+rdma {}: {} receives and {} sends did not flush within {CLOSE_GRACE:?}",
                    r.q.peer,
                    r.recvs_posted,
                    r.sends_outstanding
                );
                self.take_back_lent(rt, qi);
            }
            self.queue(qi).close_phase = ClosePhase::Draining;
        }
        let r = self.queue(qi);
        r.q.drop_commands(&mut rt.exec);
        for a in std::mem::take(&mut r.waiting) {
            if let Action::SendData { buf: Buf::Chunk(c) | Buf::Zero(c), .. } = a {
                rt.exec.sent(c);
            }
        }
        let r = self.queue(qi);
        if r.q.exec_live() > 0 {
            return;
        }
        r.q.leave(&why);
        let (fi, cq, reserved) = (r.fi, r.cq, r.cq_reserved);
        rt.fabrics[fi].cqs[cq].reserved -= reserved;
        let slot = &mut self.queues[qi as usize];
        slot.q = None;
        slot.gen = slot.gen.wrapping_add(1);
        self.free.push(qi);
        self.held.retain(|&h| h != qi);
        self.live -= 1;
        self.deadlines_stale = true;
        rt.stats.queue_pairs.set(rt.stats.queue_pairs.get().saturating_sub(1));
    }

    /// Work requests did not flush in time (or a failed `post_send` left
    /// some counted that were never posted: [`NvmeRdma::post_queued`]): the
    /// queue pair is destroyed first, so that no device reaches the memory
    /// they name any more, and the chunks and staging slots come back
    /// regardless, as rdmablk v1's `force_teardown` does. Its completions
    /// still in the completion queue carry the slot's generation before
    /// this one: they are taken for stale.
    fn take_back_lent(&mut self, rt: &mut Runtime, qi: u16) {
        let slot = &mut self.queues[qi as usize];
        slot.gen = slot.gen.wrapping_add(1);
        let r = self.queue(qi);
        r.qp = None;
        let sent: Vec<SentWith> = r.sent_with.iter_mut().map(|w| std::mem::replace(w, SentWith::Nothing)).collect();
        let reads: Vec<(usize, (ReadInto, u32))> = r.reads.iter_mut().enumerate().filter_map(|(s, x)| x.take().map(|x| (s, x))).collect();
        r.sends_outstanding = 0;
        r.recvs_posted = 0;
        for w in sent {
            self.give_back(rt, qi, w);
        }
        for (slot, (into, _)) in reads {
            match into {
                ReadInto::Chunk(c) => {
                    rt.exec.engine_mut().pool_mut().return_from_fabric(c);
                    self.queue(qi).q.fetch_failed(&mut rt.exec, slot as u16);
                }
                ReadInto::Staging(i) => {
                    let ri = self.queue(qi).rdma_index;
                    let s = self.staging[ri].as_mut().expect("staging slots in use");
                    s.slots.reclaim(i);
                    s.free.push(i);
                }
            }
        }
        // What is still lent to the fabric for this queue's commands are
        // the pieces before a read's last whose WRITEs did not complete
        // (their `wr_id`s name them, and nothing else does): found in the
        // pool, as v1's `force_teardown` finds its queue pair's.
        for c in 0..rt.exec.engine().pool().capacity() {
            let chunk = ChunkId(c as u16);
            if !rt.exec.engine().pool().is_lent_to_fabric(chunk) {
                continue;
            }
            let Some((owner, _)) = rt.exec.chunk_owner(chunk) else { continue };
            if owner.transport as usize == self.index && Queue::key_of_tag(owner.tag) == qi {
                self.give_back(rt, qi, SentWith::Chunk(chunk));
            }
        }
    }

    /// The earliest deadline of any queue: a pass over them all (an admin
    /// queue of a controller without keep-alive takes its controller's
    /// lock for it).
    fn earliest_deadline(&self) -> Option<Instant> {
        let deadline = |r: &RQueue| if r.closing.is_some() { r.close_deadline() } else { r.q.deadline() };
        self.queues.iter().filter_map(|s| s.q.as_ref()).filter_map(deadline).min()
    }

    /// Closes every queue whose controller was torn down.
    fn close_torn_down(&mut self) {
        for qi in 0..self.queues.len() as u16 {
            let Some(r) = self.queues[qi as usize].q.as_ref() else { continue };
            if r.closing.is_none() && r.q.conn.as_ref().is_some_and(|k| k.ctrl.is_dead()) {
                self.close(qi, CloseReason::fault("the controller was torn down"));
            }
        }
    }
}

impl RQueue {
    /// When a closing queue is moved on without news ([`NvmeRdma::maybe_end`]):
    /// at the end of its grace while its answers may still go out, or its
    /// work requests flush. One that waits only for the executor (its
    /// answers out to a host that ended it, or nothing of it left on the
    /// fabric) has no deadline: the executor's `Done` moves it on, and
    /// a deadline past would wake its reactor at once on every turn until then.
    fn close_deadline(&self) -> Option<Instant> {
        let by_host = self.closing.as_ref().is_some_and(|w| w.kind == CloseKind::ByHost);
        match self.close_phase {
            ClosePhase::Answering if by_host && self.sends_outstanding == 0 => None,
            ClosePhase::Answering | ClosePhase::Flushing => self.close_due,
            ClosePhase::Draining => None,
        }
    }

    fn post_recv(&mut self, gen: u16, qi: u16, i: usize) -> rdmablk_common::fabric::Result<()> {
        let Some(qp) = &self.qp else {
            return Err(FabricError::new(FabricErrorKind::InvalidState, "the queue pair was destroyed"));
        };
        let sge = self.recv.lend(i, self.recv_size);
        match qp.post_recv(&[RecvWr { wr_id: wr_id(K_RECV, gen, qi, i as u32), sges: std::slice::from_ref(&sge) }]) {
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

    /// Queues completion `cqe` from response slot `slot` (taken), after
    /// `first` (the unsignaled RDMA WRITE of the command's data, out of
    /// what it names) when there is one; a SEND with Invalidate when the
    /// command's SGL asked for it.
    fn queue_response(&mut self, gen: u16, qi: u16, slot: usize, cqe: &CompletionEntry, sgl: Option<Sgl>, first: Option<(Wr, SentWith)>) {
        self.resp.slot_mut(slot).copy_from_slice(&cqe.to_bytes());
        let sge = self.resp.lend(slot, CQE_SIZE as u32);
        let op = match sgl {
            Some(Sgl::Keyed { key, invalidate: true, length, .. }) if length > 0 => SendOp::SendWithInvalidate { rkey: Rkey(key) },
            _ => SendOp::Send,
        };
        let send = Wr { wr_id: wr_id(K_SEND, gen, qi, slot as u32), op, sge };
        let (chain, with) = match first {
            Some((write, with)) => (Some(write), with),
            None => (None, SentWith::Nothing),
        };
        self.tx.push(Tx::Respond { chain, send, slot, with });
    }

    /// A queued work request was posted: it is counted as outstanding, and
    /// what it lends is found again at its completion.
    fn count_posted(&mut self, t: &Tx) {
        self.sends_outstanding += 1;
        match *t {
            Tx::Read { slot, into, len, .. } => {
                if self.reads.len() <= slot as usize {
                    self.reads.resize(slot as usize + 1, None);
                }
                self.reads[slot as usize] = Some((into, len));
            }
            // Its completion finds its chunk in its `wr_id`.
            Tx::Write { .. } => {}
            Tx::Respond { slot, with, .. } => self.sent_with[slot] = with,
        }
    }
}

impl crate::reactor::Transport for NvmeRdma {
    fn adopt(&mut self, rt: &mut Runtime, conn: Box<dyn Any + Send>) {
        match conn.downcast::<Accept>() {
            Ok(a) => self.adopt_queue(rt, *a),
            Err(_) => tracing::error!("reactor {}: nvme+rdma was handed something that is not a connection request", rt.id),
        }
    }

    fn completion(&mut self, rt: &mut Runtime, _fi: usize, wc: Completion) {
        self.on_completion(rt, wc);
    }

    fn exec_event(&mut self, rt: &mut Runtime, tag: u32, id: CmdId, ev: Event) {
        let qi = Queue::key_of_tag(tag);
        let Some(r) = self.queues.get_mut(qi as usize).and_then(|s| s.q.as_mut()) else {
            tracing::error!("reactor {}: executor news {ev:?} for no nvme+rdma queue", rt.id);
            return;
        };
        r.q.exec_event(&mut rt.exec, Queue::slot_of_tag(tag), id, ev);
        self.mark_dirty(qi);
    }

    fn turn(&mut self, rt: &mut Runtime) {
        let news = self.seen.news(&rt.registry);
        if news.fences {
            self.close_torn_down();
        }
        if news.volumes {
            for qi in 0..self.queues.len() as u16 {
                let Some(r) = self.queues[qi as usize].q.as_mut() else { continue };
                if r.closing.is_none() && r.q.volumes_changed(rt.turn_start) {
                    self.mark_dirty(qi);
                }
            }
        }
        for i in (0..self.held.len()).rev() {
            let qi = self.held[i];
            let Some(r) = self.queues.get_mut(qi as usize).and_then(|s| s.q.as_mut()) else {
                self.held.swap_remove(i);
                continue;
            };
            if !r.q.retry_connect(&mut rt.exec) {
                self.held.swap_remove(i);
                self.deadlines_stale = true;
            }
            self.mark_dirty(qi);
        }
    }

    fn flush(&mut self, rt: &mut Runtime) {
        while let Some(qi) = self.dirty.pop() {
            if self.queues[qi as usize].q.is_some() {
                self.flush_queue(rt, qi);
            }
        }
    }

    fn next_deadline(&self, _rt: &Runtime) -> Option<Instant> {
        if !self.deadlines_stale {
            return self.earliest;
        }
        self.earliest_deadline()
    }

    fn check_deadlines(&mut self, rt: &mut Runtime, now: Instant) {
        if !self.deadlines_stale && self.earliest.is_none_or(|e| now < e) && rt.shutdown.is_none() {
            return;
        }
        for qi in 0..self.queues.len() as u16 {
            let Some(r) = self.queues[qi as usize].q.as_mut() else { continue };
            if r.closing.is_some() {
                if r.close_deadline().is_some_and(|d| now >= d) {
                    self.mark_dirty(qi);
                }
                continue;
            }
            match r.q.check_deadlines(now, rt.shutdown.is_some()) {
                Due::Nothing => {}
                Due::Flush => self.mark_dirty(qi),
                Due::Close(why) => self.close(qi, why),
            }
        }
        self.earliest = self.earliest_deadline();
        self.deadlines_stale = false;
    }

    fn shutdown(&mut self, _rt: &mut Runtime) {
        // The control thread tore every controller down (their queues close
        // at the next turn); queues before Connect close at the next
        // deadline check.
        self.deadlines_stale = true;
    }

    fn live(&self) -> usize {
        self.live
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_send_queue_holds_every_piece_a_command_may_have_out() {
        const K128: u32 = 128 << 10;
        // Chunks of the largest transfer: one piece per command.
        assert_eq!(send_queue_depth(32, K128, 128 << 10, 512), 3 * 32);
        assert_eq!(send_queue_depth(128, K128, 1 << 20, 512), 3 * 128);
        // 16 KiB: eight pieces of 128 KiB, all of them out at once.
        assert_eq!(send_queue_depth(32, K128, 16 << 10, 4096), (2 + 8) * 32);
        // 4 KiB: 32 pieces, of which the executor keeps 8 out.
        assert_eq!(send_queue_depth(32, K128, 4 << 10, 16384), (2 + 8) * 32);
        // A small pool bounds the pieces of all commands together.
        assert_eq!(send_queue_depth(128, K128, 16 << 10, 64), 2 * 128 + 64 + STAGING_SLOTS as u32);
        // MDTS 4 MiB in chunks of 128 KiB: 32 pieces, the executor keeps 8
        // out; 1024 entries, bounded by the pool.
        assert_eq!(send_queue_depth(32, 4 << 20, 128 << 10, 4096), (2 + 8) * 32);
        assert_eq!(send_queue_depth(1024, 4 << 20, 128 << 10, 512), 2 * 1024 + 512 + STAGING_SLOTS as u32);
    }

    #[test]
    fn a_pieces_write_names_its_chunk() {
        let pieces = [SentWith::Chunk(ChunkId(0)), SentWith::Chunk(ChunkId(u16::MAX)), SentWith::Zero(ChunkId(7)), SentWith::Zero(ChunkId(u16::MAX))];
        for with in pieces {
            let (kind, gen, queue, index) = split_wr_id(wr_id(K_WRITE, 0xfffe, 0xffff, piece_index(with)));
            assert_eq!((kind, gen, queue), (K_WRITE, 0xfffe, 0xffff));
            assert_eq!(format!("{:?}", piece_of(index)), format!("{with:?}"));
        }
    }
}
