//! The rdmablk v1 front end: one [`V1`] transport per reactor holds the
//! v1 queue pairs placed there, decodes their capsules, plans them
//! ([`command`]) and answers; the reactor's executor carries out their
//! disk side, and the data moves by RDMA READ and WRITE between the
//! initiator's buffers and the executor's pool chunks.
//!
//! Files by concern:
//! - this file: the transport's state (queue pairs, commands), accepting
//!   a connection, deadlines, shutdown;
//! - [`capsule`]: a received capsule: its plan, CONNECT and the reconnect
//!   fence, authentication, OPEN, CLOSE, LIST, and I/O handed to the
//!   executor;
//! - [`answer`]: the executor's news turned into RDMA work, the response
//!   capsules (their slots and the send queue), the completions of what
//!   was posted, and the teardown of a queue pair;
//! - [`command`]: what a capsule asks for, as a pure function;
//! - [`session`]: the sessions shared by a host's queue pairs on every
//!   reactor.
//!
//! A command's index in this transport's slab is its tag with the
//! executor and is encoded, with the queue pair's slot and generation,
//! into the fabric `wr_id`, so every completion finds its command in O(1).

use std::any::Any;
use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rdmablk_common::fabric::{Access, Completion, ConnectRequest, QpCaps, QpNum, QueuePair, RecvWr, SendOp, Sge, WrId};
use rdmablk_common::protocol::{
    CommandId, ConnectReply, DataDescriptor, SessionId, CONNECT_INLINE_MAX, COMMAND_CAPSULE_SIZE, MAX_NAME_LEN, RESPONSE_SLOT_SIZE,
};

use crate::config::TargetConfig;
use crate::engine::exec::{CmdId, Event, CHUNK_WINDOW};
use crate::engine::pool::{ChunkId, SlotBuf};
use crate::error::ErrorKind;
use crate::reactor::fabric::completion_reason;
use crate::reactor::{Runtime, Transport, CQ_ENTRIES_PER_DEPTH};
use crate::registry::{Admission, ConnectionSlot, HandshakeSlot};
use session::{SharedSession, Sessions};

pub mod answer;
pub mod capsule;
pub mod command;
pub mod session;

use command::{Limits, SessionState};

/// How long a failed queue pair may take to flush its work requests
/// before it is destroyed regardless.
pub const FLUSH_TIMEOUT: Duration = Duration::from_secs(5);
const NONE16: u16 = u16::MAX;

// wr_id layout: kind:4 | queue pair generation:12 | queue pair slot:16 | a:16 | b:16
const K_RECV: u64 = 1; // a = receive slot
const K_SEND: u64 = 2; // a = response slot, b = command
const K_RDMA: u64 = 3; // a = command, b = chunk
const K_SEND_NOSLOT: u64 = 4; // inline QUEUE_FULL response without a slot

fn wr_id(kind: u64, gen: u16, sess: u16, a: u16, b: u16) -> WrId {
    WrId(kind << 60 | ((gen as u64) & 0xfff) << 48 | (sess as u64) << 32 | (a as u64) << 16 | b as u64)
}

fn split_wr_id(w: WrId) -> (u64, u16, u16, u16, u16) {
    let v = w.0;
    (v >> 60, ((v >> 48) & 0xfff) as u16, (v >> 32) as u16, (v >> 16) as u16, v as u16)
}

/// A connection request to accept, handed over by the control thread; it
/// holds one of the `max_handshakes` slots until its CONNECT succeeds.
pub struct Accept {
    pub req: ConnectRequest,
    /// The runtime's index of the fabric the request came in on.
    pub fabric: usize,
    pub admission: Admission,
}

/// A queue pair and its registered buffers. Field order is drop order: the
/// queue pair is destroyed before its buffers are deregistered.
struct QpRes {
    qp: QueuePair,
    recv: SlotBuf,
    resp: SlotBuf,
}

/// A queue pair (this transport's view of one connection of a session).
struct Session {
    res: Option<QpRes>,
    fabric: usize,
    /// Index of its completion queue in the fabric's.
    cq: usize,
    peer: String,
    qp_num: QpNum,
    state: SessionState,
    /// Set by CONNECT: the session this queue pair belongs to.
    shared: Option<Arc<SharedSession>>,
    queue_index: u16,
    free_resp: Vec<u16>,
    sq_used: u32,
    sq_cap: u32,
    max_inline: u32,
    recv_posted: u32,
    noslot_sends: u32,
    /// Receive slots (= configured queue depth).
    slots: u32,
    cq_reserved: u32,
    closing: Option<String>,
    close_deadline: Option<Instant>,
    /// Until CONNECT succeeds: the handshake slot and when it expires.
    handshake: Option<(HandshakeSlot, Instant)>,
    /// Counts against `max_connections_per_address` while it lives, and
    /// holds its source address's pool accounts (`host_pool_share`).
    connection: ConnectionSlot,
    /// Send work requests of this turn, posted together at its end (one
    /// `post_send`: one `sendmsg` on tcp, one doorbell on verbs).
    tx: Vec<QueuedWr>,
    /// A CONNECT waiting for the session it replaces to be retired.
    fence: Option<Fence>,
    /// Commands of this queue pair in the slab (answered ones included,
    /// until their send completion).
    live_cmds: u32,
    /// Answers waiting for a response slot or send-queue room, in order.
    resp_wait: VecDeque<WaitingResponse>,
    /// When its last command (a keep-alive included) arrived, or it was
    /// accepted: for `target.idle_timeout`.
    last_heard: Instant,
}

impl Session {
    fn host(&self) -> &str {
        self.state.host_id.as_deref().unwrap_or("-")
    }
}

struct SessionSlot {
    gen: u16,
    s: Option<Session>,
}

/// A chunk to send before an answer, in the same chain: a piece of the
/// command's data (or zeroes), at `off` of the initiator's buffer.
#[derive(Clone, Copy, Debug)]
struct Piece {
    chunk: ChunkId,
    off: u32,
    len: u32,
    zero: bool,
}

/// An answer that found every response slot busy.
struct WaitingResponse {
    ci: u16,
    data: Vec<u8>,
    chain: Option<Piece>,
}

/// A CONNECT that passed its checks and has not been answered yet.
struct PendingConnect {
    cid: CommandId,
    negotiated: command::Negotiated,
    host_id: String,
    /// The queue pair authenticated as `host_id`.
    authenticated: bool,
    join: Option<SessionId>,
    reply: ConnectReply,
}

/// A CONNECT held by the reconnect fence until `old` has ended.
struct Fence {
    old: Arc<SharedSession>,
    since: Instant,
    deadline: Instant,
    connect: PendingConnect,
}

/// A send-queue work request waiting for the end of the reactor turn. Its
/// memory (a response slot or a pool chunk) stays reserved until its
/// completion, as when posted at once.
#[derive(Clone, Copy)]
struct QueuedWr {
    wr_id: WrId,
    op: SendOp,
    sge: Sge,
    inline: bool,
}

/// Work requests per `post_send` when a turn's queue is flushed.
const TX_CHUNK: usize = 16;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum CmdKind {
    /// Answered right away (admin commands and validation failures).
    Immediate,
    List,
    Read,
    Write,
    WriteInline,
    Flush,
    /// DISCARD or WRITE_ZEROES.
    Range,
}

/// A command's wire side; its disk side is the executor's (`exec`).
struct Cmd {
    sess: u16,
    cid: CommandId,
    kind: CmdKind,
    /// Its executor command, until the executor's `Done`.
    exec: Option<CmdId>,
    remote: DataDescriptor,
    /// Receive slot still holding inline data.
    held_recv: Option<u16>,
    /// RDMA operations posted for it and not completed.
    fabric_ops: u32,
    error: Option<ErrorKind>,
    /// Part of it reached the disk (the executor said so).
    at_disk: bool,
    /// Answered (or given up with its queue pair): no longer counted
    /// against the queue depth.
    responded: bool,
    /// Its answer waits for a response slot (`Session::resp_wait`).
    answer_waits: bool,
    send_inflight: bool,
    result: u64,
    list_entries: u32,
}

/// The rdmablk v1 transport of one reactor.
pub struct V1 {
    /// Its index among the reactor's transports (its executor owner).
    index: usize,
    /// The sessions of every reactor.
    sessions_table: Arc<Sessions>,
    sessions: Vec<SessionSlot>,
    /// Sessions with work requests queued this turn.
    tx_pending: Vec<u16>,
    free_sessions: Vec<u16>,
    cmds: Vec<Option<Cmd>>,
    free_cmds: Vec<u16>,
    limits: Limits,
    queue_depth: u32,
    /// `target.handshake_timeout`: time from accept to a successful CONNECT.
    handshake_timeout: Duration,
    recv_slot_size: usize,
    /// `target.fence_timeout`.
    fence_timeout: Duration,
    /// `target.idle_timeout`.
    idle_timeout: Duration,
    /// The registry's fence generation this transport has acted on.
    fence_generation: u64,
    /// Queue pairs with a CONNECT held by the fence.
    fences_waiting: u32,
}

/// Receive slot size: a capsule plus the largest inline payload any command may carry.
pub fn recv_slot_size(inline_data_size: u32) -> usize {
    let inline = (inline_data_size as usize).max(CONNECT_INLINE_MAX).max(MAX_NAME_LEN);
    (COMMAND_CAPSULE_SIZE + inline).div_ceil(64) * 64
}

/// Response slots per queue pair: twice the queue depth. The initiator may
/// send its next command as soon as it holds an answer, which can be before
/// the answer's send completion reaches the target (Soft-RoCE on Linux 6.12
/// and busy NICs report it late), so up to `queue_depth` unanswered
/// commands meet answers still waiting for their completions. An answer
/// that finds no free slot waits for one (`Session::resp_wait`).
pub fn response_slots(queue_depth: u32) -> u32 {
    2 * queue_depth
}

/// Send queue depth requested per queue pair: responses, inline QUEUE_FULL
/// answers, and RDMA operations of every chunk that may be in flight.
pub fn send_queue_depth(queue_depth: u32, pool_chunks: u32) -> u32 {
    response_slots(queue_depth) + queue_depth + pool_chunks.min(queue_depth * CHUNK_WINDOW)
}

impl V1 {
    /// The transport for index `index` of a reactor, with `cfg`'s limits,
    /// its sessions in `sessions`.
    pub fn new(index: usize, cfg: &TargetConfig, sessions: Arc<Sessions>) -> V1 {
        V1 {
            index,
            sessions_table: sessions,
            sessions: Vec::new(),
            tx_pending: Vec::new(),
            free_sessions: Vec::new(),
            cmds: Vec::new(),
            free_cmds: Vec::new(),
            limits: Limits {
                target_name: cfg.name.clone(),
                queue_depth: cfg.queue_depth,
                max_io_size: cfg.max_io_size,
                inline_data_size: cfg.inline_data_size,
                chunk_size: cfg.chunk_size,
            },
            queue_depth: cfg.queue_depth,
            handshake_timeout: cfg.handshake_timeout,
            recv_slot_size: recv_slot_size(cfg.inline_data_size),
            fence_timeout: cfg.fence_timeout,
            idle_timeout: cfg.idle_timeout,
            fence_generation: 0,
            fences_waiting: 0,
        }
    }

    fn session(&mut self, si: u16) -> &mut Session {
        self.sessions[si as usize].s.as_mut().expect("live session")
    }

    fn cmd(&mut self, ci: u16) -> &mut Cmd {
        self.cmds[ci as usize].as_mut().expect("live command")
    }

    /// Whether `target.idle_timeout` applies to a queue pair: connected (a
    /// handshake has its own deadline), live, and nothing of it in flight
    /// (a command waiting for the disk or a chunk is not the peer's silence).
    fn may_idle_out(s: &Session) -> bool {
        s.closing.is_none() && s.handshake.is_none() && s.fence.is_none() && s.live_cmds == 0
    }

    /// Accepts a connection request: a queue pair on one of the reactor's
    /// completion queues of its fabric, with its receives posted.
    fn add_session(&mut self, rt: &mut Runtime, a: Accept) {
        let Accept { req, fabric: fi, admission } = a;
        let Admission { handshake, connection } = admission;
        let peer = req.peer();
        if rt.shutdown.is_some() {
            req.reject(b"target shutting down");
            return;
        }
        let qd = self.queue_depth;
        let chunks = rt.exec.engine().pool().capacity() as u32;
        let reserve = CQ_ENTRIES_PER_DEPTH * qd;
        // Admission by what the device's completion queue really holds, so
        // that it can never overrun.
        let ci = match rt.cq_with_room(fi, reserve) {
            Ok(ci) => ci,
            Err(e) => {
                tracing::warn!("reactor {}: refusing connection from {peer}: {e}", rt.id);
                req.reject(b"target busy: cannot create a completion queue");
                return;
            }
        };
        if self.free_sessions.is_empty() && self.sessions.len() >= u16::MAX as usize {
            req.reject(b"target busy");
            return;
        }
        let sq_cap = send_queue_depth(qd, chunks);
        let caps = QpCaps { max_send_wr: sq_cap, max_recv_wr: qd, max_send_sge: 1, max_recv_sge: 1, max_inline_data: 256 };
        let f = &rt.fabrics[fi];
        let qp = match req.into_queue_pair(&f.pd, &f.cqs[ci].cq, caps) {
            Ok(qp) => qp,
            Err(e) => {
                tracing::warn!("cannot create a queue pair for {peer}: {e}");
                return;
            }
        };
        let got = qp.caps();
        if got.max_send_wr < sq_cap || got.max_recv_wr < qd {
            tracing::warn!("queue pair for {peer} got {got:?}, need {caps:?}; dropping the connection");
            return;
        }
        let mut res = QpRes {
            qp,
            recv: SlotBuf::new(qd as usize, self.recv_slot_size),
            resp: SlotBuf::new(response_slots(qd) as usize, RESPONSE_SLOT_SIZE),
        };
        if let Err(e) = res.recv.register(&f.pd, Access::LOCAL_WRITE).and_then(|()| res.resp.register(&f.pd, Access::NONE)) {
            tracing::warn!("cannot register buffers for {peer}: {e}");
            return;
        }
        let si = match self.free_sessions.pop() {
            Some(si) => si,
            None => {
                self.sessions.push(SessionSlot { gen: 0, s: None });
                (self.sessions.len() - 1) as u16
            }
        };
        let gen = self.sessions[si as usize].gen;
        let slot_size = self.recv_slot_size as u32;
        let sges: Vec<Sge> = (0..qd as usize).map(|i| res.recv.lend(i, slot_size)).collect();
        let wrs: Vec<RecvWr<'_>> =
            sges.iter().enumerate().map(|(i, sge)| RecvWr { wr_id: wr_id(K_RECV, gen, si, i as u16, 0), sges: std::slice::from_ref(sge) }).collect();
        let posted = res.qp.post_recv(&wrs);
        drop(wrs);
        let discard = |this: &mut V1| {
            this.sessions[si as usize].gen = this.sessions[si as usize].gen.wrapping_add(1);
            this.free_sessions.push(si);
        };
        if let Err(e) = posted {
            tracing::warn!("cannot post receives for {peer}: {e}");
            discard(self);
            return;
        }
        if let Err(e) = res.qp.accept(&[]) {
            tracing::warn!("cannot accept connection from {peer}: {e}");
            discard(self);
            return;
        }
        rt.fabrics[fi].cqs[ci].reserved += reserve;
        let now = Instant::now();
        let session = Session {
            qp_num: res.qp.qp_num(),
            max_inline: got.max_inline_data,
            res: Some(res),
            fabric: fi,
            cq: ci,
            peer: peer.clone(),
            state: SessionState { shutting_down: rt.shutdown.is_some(), ..SessionState::new() },
            shared: None,
            queue_index: 0,
            free_resp: (0..response_slots(qd) as u16).rev().collect(),
            sq_used: 0,
            sq_cap,
            recv_posted: qd,
            noslot_sends: 0,
            slots: qd,
            cq_reserved: reserve,
            closing: None,
            close_deadline: None,
            handshake: Some((handshake, now + self.handshake_timeout)),
            connection,
            tx: Vec::new(),
            fence: None,
            live_cmds: 0,
            resp_wait: VecDeque::new(),
            last_heard: now,
        };
        self.sessions[si as usize].s = Some(session);
        rt.stats.queue_pairs.add(1);
        tracing::debug!("reactor {}: accepted connection from {peer}", rt.id);
    }
}

impl Transport for V1 {
    fn adopt(&mut self, rt: &mut Runtime, conn: Box<dyn Any + Send>) {
        match conn.downcast::<Accept>() {
            Ok(a) => self.add_session(rt, *a),
            Err(_) => tracing::error!("reactor {}: v1 was handed something that is not a connection request", rt.id),
        }
    }

    fn completion(&mut self, rt: &mut Runtime, _fi: usize, wc: Completion) {
        self.on_completion(rt, wc);
    }

    fn exec_event(&mut self, rt: &mut Runtime, tag: u32, id: CmdId, ev: Event) {
        self.on_exec(rt, tag as u16, id, ev);
    }

    fn turn(&mut self, rt: &mut Runtime) {
        self.check_fences(rt);
    }

    fn flush(&mut self, rt: &mut Runtime) {
        self.flush_sends(rt);
    }

    fn next_deadline(&self, rt: &Runtime) -> Option<Instant> {
        let mut d = None;
        let mut min = |t: Instant| d = Some(d.map_or(t, |x: Instant| x.min(t)));
        for s in self.sessions.iter().filter_map(|slot| slot.s.as_ref()) {
            if s.closing.is_none() {
                if let Some(sd) = rt.shutdown {
                    min(sd);
                }
                if let Some(f) = &s.fence {
                    min(f.deadline);
                } else if let Some((_, hd)) = &s.handshake {
                    min(*hd);
                } else if Self::may_idle_out(s) {
                    min(s.last_heard + self.idle_timeout);
                }
            } else if s.res.is_some() && (s.sq_used > 0 || s.recv_posted > 0) {
                if let Some(cd) = s.close_deadline {
                    min(cd);
                }
            }
        }
        d
    }

    fn check_deadlines(&mut self, rt: &mut Runtime, now: Instant) {
        if let Some(deadline) = rt.shutdown {
            let idle = self.sessions.iter().all(|s| s.s.as_ref().is_none_or(|s| s.live_cmds == 0));
            if idle || now >= deadline {
                if !idle {
                    tracing::warn!("shutdown timeout reached with commands in flight; disconnecting");
                }
                for si in 0..self.sessions.len() {
                    if self.sessions[si].s.as_ref().is_some_and(|s| s.closing.is_none()) {
                        self.fail_session(rt, si as u16, "target shutting down".into());
                    }
                }
            }
        }
        for si in 0..self.sessions.len() {
            let Some(s) = &self.sessions[si].s else { continue };
            // A CONNECT held by the fence has the fence's deadline instead.
            if s.closing.is_none() && s.fence.is_none() && s.handshake.as_ref().is_some_and(|(_, d)| now >= *d) {
                let why = format!("no successful CONNECT within {:?} (target.handshake_timeout)", self.handshake_timeout);
                // Counted before it is logged: whoever reads the log line finds it counted.
                rt.registry.counters.handshakes_timed_out.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                tracing::warn!("reactor {}: dropping connection from {}: {why}", rt.id, s.peer);
                self.fail_session(rt, si as u16, why);
                continue;
            }
            if Self::may_idle_out(s) && now.saturating_duration_since(s.last_heard) >= self.idle_timeout {
                let why = format!(
                    "idle: no command and no keep-alive for {:?} (target.idle_timeout)",
                    now.saturating_duration_since(s.last_heard)
                );
                rt.registry.counters.idle_timeouts.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                tracing::warn!("reactor {}: dropping connection from {} host={}: {why}", rt.id, s.peer, s.host());
                self.fail_session(rt, si as u16, why);
                continue;
            }
            if s.res.is_none() || s.close_deadline.is_none_or(|d| now < d) {
                continue;
            }
            if s.sq_used == 0 && s.recv_posted == 0 {
                continue;
            }
            tracing::warn!(
                "session {}: {} sends and {} receives not flushed {:?} after disconnect; destroying the queue pair",
                s.peer,
                s.sq_used,
                s.recv_posted,
                FLUSH_TIMEOUT
            );
            self.force_teardown(rt, si as u16);
        }
    }

    fn shutdown(&mut self, _rt: &mut Runtime) {
        for slot in &mut self.sessions {
            if let Some(s) = &mut slot.s {
                s.state.shutting_down = true;
            }
        }
    }

    fn live(&self) -> usize {
        self.sessions.iter().filter(|s| s.s.is_some()).count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_roundtrip() {
        let w = wr_id(K_RDMA, 0xabc, 0xfffe, 0x1234, 0xffff);
        assert_eq!(split_wr_id(w), (K_RDMA, 0xabc, 0xfffe, 0x1234, 0xffff));
        let w = wr_id(K_RECV, 0x1abc, 1, 2, 3);
        assert_eq!(split_wr_id(w), (K_RECV, 0xabc, 1, 2, 3), "generation keeps 12 bits");
    }

    #[test]
    fn sizes() {
        assert_eq!(recv_slot_size(4096), 64 + 4096);
        assert_eq!(recv_slot_size(0), 64 + 256, "room for a CONNECT host id");
        assert_eq!(send_queue_depth(128, 512), 3 * 128 + 512);
        assert_eq!(send_queue_depth(4, 512), 12 + 32);
    }
}
