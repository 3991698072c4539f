//! The `tcp` provider: verbs semantics over a TCP stream, as a software
//! RDMA NIC.
//!
//! # Progress model: manual
//!
//! There is no provider thread. As with libfabric's `FI_PROGRESS_MANUAL`,
//! the thread that calls [`TcpCq::poll`] drives every queue pair attached to
//! that completion queue: it reads incoming frames, places RDMA WRITE
//! payloads into registered memory, serves RDMA READ requests from
//! registered memory, consumes SENDs into posted receives, processes
//! acknowledgements, sends standalone ACKs and flushes send backlogs. The
//! remote application's code is never involved in a one-sided operation
//! beyond calling `poll` on its CQ, which it does anyway to see its own
//! completions.
//!
//! `post_send` writes its frame to the nonblocking socket at once; whatever
//! the socket does not take is copied into a per-QP backlog and sent by later
//! polls (the socket is then in the CQ's epoll set for `EPOLLOUT`). The
//! caller's buffers are therefore free once `post_send` returns, which is
//! stricter than verbs requires.
//!
//! # Completion channel
//!
//! [`TcpCq::fd`] is an epoll fd covering the sockets of all attached queue
//! pairs (readable input; `EPOLLOUT` only while a backlog exists) plus an
//! eventfd. Socket readiness makes it readable whether or not the CQ is
//! armed: the data must be processed by a `poll` anyway, and that poll
//! consumes it, so an idle CQ is not readable and a reactor blocking on it
//! never spins. The eventfd covers completions generated without socket
//! activity (flushes inside `post_send`/`post_recv` on an errored queue
//! pair, `disconnect`): after [`TcpCq::arm`] the next completion pushed to
//! the CQ signals it, and `arm` signals it at once if completions are already
//! queued. [`TcpCq::ack_event`] drains it. A timerfd armed for the earliest
//! deadline check of the attached queue pairs (see Timeouts) is in the set
//! too, so that a sleeping owner wakes for it.
//!
//! # Reliability and acknowledgements
//!
//! Every WR-bearing frame (SEND, WRITE, READ_REQ) carries a sequence number;
//! every frame carries the cumulative ack, the highest peer sequence number
//! fully processed (WRITE placed, SEND placed into a receive, READ_REQ
//! answered). Frames of signaled work requests set `ACK_REQUESTED`; a
//! progress round that processed such a frame ends with a standalone ACK
//! unless an outgoing frame already carried the current ack. A SEND or RDMA
//! WRITE completes when acknowledged; an RDMA READ when its READ_RESP has
//! been placed. Completions of one send queue are generated in posting order.
//! Slot accounting follows verbs: an unsignaled work request keeps its slot
//! until a later signaled one completes; a receive frees its slot when it
//! completes. Slots are released when the completion is queued on the CQ.
//!
//! # Timeouts
//!
//! As an RC NIC gives up on a peer after `timeout` × `retry_cnt`, a queue
//! pair gives up on a peer that makes no progress on what it owes: while a
//! SEND or RDMA WRITE is unacknowledged or an RDMA READ unanswered, each
//! acknowledgement that moves and each READ_RESP byte restarts
//! [`FabricOptions::transport_timeout`] (4 s by default; the reasoning is
//! at [`crate::fabric::DEFAULT_TRANSPORT_TIMEOUT`]). At the deadline the
//! socket is served first, so an owner that did not poll for a while does
//! not blame the peer for what is waiting in it. If bytes are still queued
//! to the peer (in the backlog, or unacknowledged by its TCP: `SIOCOUTQ`),
//! the peer may be reading slowly a payload it acknowledges only whole: its
//! TCP acknowledging more of the stream since the last deadline
//! (`tcpi_bytes_acked`) counts as progress, and without a mark from a last
//! deadline it gets one more timeout to show it. So a peer that stopped
//! is found within one timeout when everything reached its socket, two
//! when bytes were still queued. The queue pair then fails as on
//! RETRY_EXC_ERR: the oldest outstanding work request completes with
//! `TransportError`, the rest flush, and the connection is reset (RST,
//! `SO_LINGER` 0: what is still queued would arrive after the failure, and
//! the peer sees the end whether or not it reads).
//!
//! A progress round that ends in the middle of a frame (part of a header
//! staged, or a payload pending) notes when that frame's first byte came.
//! A frame still partial [`FabricOptions::frame_timeout`] later (10 s by
//! default), plus a second per MiB of its payload, is a lost connection (on
//! RC a partial message never arrives): the queue pair fails as above.
//!
//! Deadlines cost nothing per operation beyond a clock read when a wait
//! starts or progresses, or a frame spans progress rounds: each queue pair keeps one entry in its CQ's check
//! queue, no later than its earliest deadline, and a check that finds a
//! deadline moved queues the next. The CQ's timerfd is armed for the
//! earliest entry; a queue pair that owes and is owed nothing queues no
//! more, so an idle CQ is woken at most once, by the last stale check.
//! Manual progress means the peer's acknowledgements come from its owner's
//! polls: an owner must poll well within its peers' transport timeout
//! while they may have work outstanding on its queue pairs.
//!
//! # Protection
//!
//! Incoming WRITE and READ_REQ frames are checked against the queue pair's
//! own protection domain (rkey known, access right granted, range covered,
//! overflow-safe) before a byte is placed; payloads are received with `readv`
//! straight into the registered memory together with the next header, and
//! READ responses are sent with `sendmsg` straight from it. Local SGEs are
//! checked (lkey, bounds, `LOCAL_WRITE` where written) at post time and again
//! at placement; an inline payload is a slice the caller lends for the
//! `post_send` call, so no SGE escapes the checks. Every region is pinned around each syscall that touches it,
//! so deregistration waits for a placement in progress and the provider never
//! touches a region after its [`TcpMr`] is dropped (see the `mr` module).
//!
//! A violation by the peer's request moves the queue pair to the error
//! state: the faulting work request completes with its specific status,
//! every other outstanding one (signaled or not, both queues) is flushed,
//! and the peer is told with a TERMINATE frame naming the error and the
//! offending sequence number, so its faulting work request completes with
//! the matching remote status (REMOTE_ACCESS, REMOTE_INVALID_REQUEST; a bad
//! lkey in the responder's receive gives the sender `RemoteOperationError`,
//! verbs' `REM_OP_ERR`). Malformed frames are answered the same
//! way; the decoder never panics and nothing is ever allocated at a size the
//! peer chose. EOF or a reset moves the queue pair to error with
//! `TransportError` for the first outstanding send and flushes the rest. In
//! the error state the socket is drained to EOF and then leaves the epoll set.
//!
//! What RC hardware does not report to the peer is not reported here either
//! (checked against rxe; see the conformance suite):
//! - A local fault (a bad lkey or range in a local SGE, a READ into a region
//!   without `LOCAL_WRITE`) fails only this queue pair.
//! - A SEND that finds no receive fails the sender's work request with
//!   `RnrRetryExceeded` (hardware with `rnr_retry` 0); the receiver only
//!   answers with the NAK (a TERMINATE naming the SEND), stays Ready, and
//!   drops the sender's later requests unexecuted.
//! - A SEND with Invalidate (a SEND frame with the `INVALIDATE` flag and
//!   the key in its rkey field) of a key that is no memory window bound on
//!   the receiving queue pair (IBTA's class J): the receiver acknowledges
//!   the SEND, completes the receive with `RemoteInvalidRequest` and fails
//!   on its own, as rxe's responder does; the sender's work request
//!   succeeds. A window the peer did invalidate is removed from the
//!   domain before the receive completes; its `TcpWindow` stays with its
//!   owner, whose drop then leaves alone any later window that drew the
//!   same random key.
//! - A queue pair that failed that way, or was told by a TERMINATE, keeps the
//!   stream open ("lingers") until the application disconnects or drops it;
//!   only then does the peer see DISCONNECT or EOF. A peer that stays Ready
//!   and sends to it gets no acknowledgement, and fails that work request
//!   with `TransportError` after its transport timeout, as a NIC does with
//!   RETRY_EXC_ERR after its retries.
//!
//! # Late send completions (test-only)
//!
//! With `RDMABLK_TCP_LATE_SEND_COMPLETIONS=N` in the environment (read once
//! per process) or [`TcpCq::set_late_send_completions`], the completion of
//! an acknowledged signaled SEND is held back until the peer's next SEND
//! (with N ≥ 2, its N-th) on that queue pair has been delivered, so those
//! receive completions come first; or until the queue pair fails (the SEND is then flushed with the
//! rest); or until 50 ms pass without one (a timerfd in the CQ's epoll set
//! wakes a sleeping owner then). Soft-RoCE on Linux 6.12 often reports
//! completions in that order, and loaded NICs can: it lets tests show code
//! that wrongly expects its answer's send completion before the peer's next
//! request. Completions behind a held SEND on the same send queue wait with
//! it (posting order is kept); RDMA WRITE and READ are never held on their
//! own. With the mode off nothing changes: one branch per signaled SEND
//! completion and one per `poll`.
//!
//! # Locking
//!
//! A queue pair's state is behind one mutex shared by the [`TcpQp`] handle
//! and the CQ's progress routine (as mlx5's per-QP lock); used from one
//! thread it is never contended. Region lookups on the data path take no
//! lock (an `ArcSwap` snapshot). The CQ's completion ring and its table of
//! attached queue pairs have their own short mutexes; the lock order is
//! queue pair → completion ring.
//!
//! # Deviations from verbs worth knowing
//! - The CQ never overflows: `capacity` is a preallocation hint.
//! - A failed `connect` leaves the queue pair in the error state with its
//!   receives flushed.
//!
//! The wire format is documented in the `wire` module.

mod cq;
mod listener;
mod mr;
mod qp;
mod sys;
mod wire;

#[cfg(test)]
mod tests;

pub use cq::{TcpCq, LATE_SEND_COMPLETIONS_ENV};
pub use listener::{TcpConnectRequest, TcpListener};
pub use mr::{TcpMr, TcpPd, TcpWindow};
pub use qp::TcpQp;

use super::{FabricError, FabricErrorKind, FabricOptions, FabricUrl, QpCaps, Result};

/// Most work requests per queue.
pub(crate) const MAX_WR: u32 = 16 * 1024;
/// Most SGEs per work request.
pub(crate) const MAX_SGE: usize = 32;
/// Largest inline payload.
pub(crate) const MAX_INLINE: u32 = 4096;

/// Checks requested queue sizes against the provider's limits and rounds
/// zeros up to one.
pub(crate) fn grant_caps(c: QpCaps) -> Result<QpCaps> {
    let too_big = |what: &str, v: u32, max: u32| {
        Err(FabricError::new(FabricErrorKind::InvalidArgument, format!("{what} = {v} exceeds the tcp provider's {max}")))
    };
    if c.max_send_wr > MAX_WR {
        return too_big("max_send_wr", c.max_send_wr, MAX_WR);
    }
    if c.max_recv_wr > MAX_WR {
        return too_big("max_recv_wr", c.max_recv_wr, MAX_WR);
    }
    if c.max_send_sge as usize > MAX_SGE {
        return too_big("max_send_sge", c.max_send_sge, MAX_SGE as u32);
    }
    if c.max_recv_sge as usize > MAX_SGE {
        return too_big("max_recv_sge", c.max_recv_sge, MAX_SGE as u32);
    }
    if c.max_inline_data > MAX_INLINE {
        return too_big("max_inline_data", c.max_inline_data, MAX_INLINE);
    }
    Ok(QpCaps {
        max_send_wr: c.max_send_wr.max(1),
        max_recv_wr: c.max_recv_wr.max(1),
        max_send_sge: c.max_send_sge.max(1),
        max_recv_sge: c.max_recv_sge.max(1),
        max_inline_data: c.max_inline_data,
    })
}

/// The tcp provider opened for one URL.
pub struct TcpFabric {
    url: FabricUrl,
    options: FabricOptions,
}

impl TcpFabric {
    pub fn open(url: &FabricUrl) -> Result<Self> {
        TcpFabric::open_with(url, FabricOptions::default())
    }

    /// Opens the provider; its queue pairs follow `options` (checked by
    /// the caller, [`crate::fabric::Fabric::open_with`]).
    pub fn open_with(url: &FabricUrl, options: FabricOptions) -> Result<Self> {
        Ok(TcpFabric { url: url.clone(), options })
    }

    pub fn url(&self) -> &FabricUrl {
        &self.url
    }

    pub fn alloc_pd(&self) -> Result<TcpPd> {
        Ok(TcpPd::new())
    }

    pub fn create_cq(&self, capacity: u32) -> Result<TcpCq> {
        TcpCq::new(capacity)
    }

    /// An active-side queue pair that will connect to this fabric's URL.
    pub fn create_qp(&self, pd: &TcpPd, cq: &TcpCq, caps: QpCaps) -> Result<TcpQp> {
        TcpQp::new(pd, cq, caps, Some(self.url.clone()), None, self.options)
    }

    pub fn listen(&self) -> Result<TcpListener> {
        TcpListener::bind(&self.url, listener::HANDSHAKE_TIMEOUT, self.options)
    }

    /// Listens, dropping peers whose HELLO is not complete within `handshake_timeout`.
    pub fn listen_with(&self, handshake_timeout: std::time::Duration) -> Result<TcpListener> {
        TcpListener::bind(&self.url, handshake_timeout, self.options)
    }
}
