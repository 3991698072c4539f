//! The fabric layer: the verbs model behind one API.
//!
//! The objects and calls map one-to-one onto libibverbs/librdmacm:
//!
//! | here | verbs |
//! |---|---|
//! | [`Fabric::open`] | `rdma_create_id` + `rdma_resolve_addr`/`rdma_bind_addr` → `ibv_context` |
//! | [`Fabric::alloc_pd`] | `ibv_alloc_pd` |
//! | [`ProtectionDomain::register`] | `ibv_reg_mr` |
//! | [`Fabric::create_cq`] | `ibv_create_comp_channel` + `ibv_create_cq` |
//! | [`CompletionQueue::poll`] / [`CompletionQueue::arm`] / [`CompletionQueue::fd`] | `ibv_poll_cq` / `ibv_req_notify_cq` / channel fd |
//! | [`Fabric::create_qp`] + [`QueuePair::connect`] | `rdma_resolve_addr`/`_route` + `ibv_create_qp` (INIT) + `rdma_connect`, RTR/RTS, `rdma_establish` (active side) |
//! | [`Fabric::listen`] / [`Listener::poll_request`] | `rdma_listen` / `RDMA_CM_EVENT_CONNECT_REQUEST` |
//! | [`ConnectRequest::into_queue_pair`] + [`QueuePair::accept`] | `ibv_create_qp` (INIT) + RTR/RTS, `rdma_accept` (passive side) |
//! | [`ConnectRequest::private_data`] / [`ConnectRequest::reject`] | the request's private data / `rdma_reject`, behind a length byte |
//! | [`QueuePair::connect_raw`] / [`QueuePair::accept_raw`] / [`ConnectRequest::raw_private_data`] / [`ConnectRequest::reject_raw`] | the same, the private data as the peer's protocol has it (no length byte; what arrives, padding included) |
//! | [`QueuePair::post_send`] / [`QueuePair::post_recv`] | `ibv_post_send` / `ibv_post_recv` |
//! | [`SendOp::SendWithInvalidate`] / [`Completion::invalidated_rkey`] | `IBV_WR_SEND_WITH_INV` / `IBV_WC_WITH_INV` with `wc.invalidated_rkey` |
//! | [`QueuePair::window_invalidated_by_peer`] | nothing: the window is taken back (no `IBV_WR_LOCAL_INV`) |
//! | [`QueuePair::disconnect`] | `rdma_disconnect` + `ibv_modify_qp(ERR)` |
//! | [`QueuePair::state`] | `ibv_query_qp` |
//!
//! Providers: `tcp://` ([`tcp`]) carries the same semantics over a TCP
//! stream; `rdma://` ([`verbs`], the default-on cargo feature `verbs`) drives
//! a real RDMA NIC through libibverbs and librdmacm. Callers never name a
//! provider: the URL scheme picks it. Objects of different providers do not
//! mix: such a call fails with [`FabricErrorKind::InvalidArgument`].
//!
//! Threads: [`Fabric`], [`ProtectionDomain`] and [`MemoryRegion`] are `Send +
//! Sync`; [`CompletionQueue`], [`QueuePair`], [`Listener`] and
//! [`ConnectRequest`] are `Send`.
//!
//! # Semantics every provider keeps
//! - Reliable connected: work requests on one queue pair execute in order;
//!   an RDMA WRITE posted before a SEND is visible in the peer's memory
//!   before the peer sees the SEND's receive completion.
//! - A signaled send-queue work request completes when the peer has
//!   acknowledged it; the local buffers may be reused after that.
//! - A work request reaches only the local memory it names: inline bytes
//!   ([`Payload::Inline`], copied at post time) or SGEs of registered
//!   memory whose lkey, bounds and rights are checked ([`Payload::Sges`]).
//!   The safe [`QueuePair::post_send`] cannot make a provider read
//!   anything else.
//! - One-sided operations (RDMA WRITE, RDMA READ) are served by the peer's
//!   provider without involving the peer application's code.
//! - Any protection violation (unknown rkey, out of bounds, missing access
//!   right, no posted receive) moves the requester's queue pair to
//!   [`QpState::Error`]: the faulting work request completes with its error
//!   status and every other outstanding work request completes with
//!   [`WcStatus::WrFlushError`], signaled or not. Work requests posted to a
//!   queue pair in error are flushed the same way.
//! - The responder's queue pair fails too when the peer's request broke a
//!   rule it checks (rkey, range, rights, a SEND longer than the receive).
//!   It stays [`QpState::Ready`] when the requester failed on its own (a
//!   bad local SGE) and when a SEND found no receive (receiver not ready:
//!   the responder only answers with a NAK), as RC hardware does. Either
//!   side learns that its peer is gone when the peer disconnects or drops
//!   its queue pair, or when the peer stops responding.
//! - A SEND with Invalidate ends the receiver's memory window with that
//!   key (bound on the receiving queue pair) before the receiver's receive
//!   completes, which reports the key. A key that is no such window is the
//!   receiver's fault alone (IBTA's class J): its receive completes with
//!   [`WcStatus::RemoteInvalidRequest`] and its queue pair fails, while
//!   the SEND is acknowledged and completes with success.
//! - A peer that stops responding fails the requester's queue pair as
//!   RC's retry limit does (`IBV_WC_RETRY_EXC_ERR`): the send-queue work
//!   request it left unacknowledged (or, for a READ, unanswered) completes
//!   with [`WcStatus::TransportError`], every other outstanding one is
//!   flushed, and the peer's side of the connection breaks too. verbs: the
//!   NIC's `timeout` × `retry_cnt` (about half a second). tcp: no progress
//!   for [`FabricOptions::transport_timeout`] (4 s), and a peer stopped in
//!   the middle of a frame for [`FabricOptions::frame_timeout`] is a lost
//!   connection. The tcp provider acknowledges from its owner's polls
//!   (manual progress, see [`CompletionQueue::poll`]), so an owner must
//!   poll each CQ well within its peers' transport timeout while they may
//!   have work outstanding on its queue pairs, or they give up on it.

pub mod memory;
pub mod tcp;
mod url;
#[cfg(feature = "verbs")]
pub mod verbs;

use std::fmt;
use std::os::fd::RawFd;
use std::time::Duration;

pub use memory::{release_free_heap, AlignedBuf};
pub use url::{FabricUrl, ProviderKind};

/// Access rights of a memory region (`IBV_ACCESS_*`).
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Access(u32);

impl Access {
    /// No rights beyond local read (always granted).
    pub const NONE: Access = Access(0);
    /// The local provider may write into the region (receives, RDMA READ targets).
    pub const LOCAL_WRITE: Access = Access(1);
    /// A peer may RDMA WRITE into the region. Requires `LOCAL_WRITE`, as in verbs.
    pub const REMOTE_WRITE: Access = Access(2);
    /// A peer may RDMA READ from the region.
    pub const REMOTE_READ: Access = Access(4);
    /// Memory windows may be bound over the region (`IBV_ACCESS_MW_BIND`);
    /// a region registered with it and without remote rights is reachable
    /// by peers only through the windows bound over it.
    pub const MW_BIND: Access = Access(8);

    /// Whether every right in `other` is granted.
    pub fn contains(self, other: Access) -> bool {
        self.0 & other.0 == other.0
    }
    /// The raw bits.
    pub fn bits(self) -> u32 {
        self.0
    }
}

impl std::ops::BitOr for Access {
    type Output = Access;
    fn bitor(self, rhs: Access) -> Access {
        Access(self.0 | rhs.0)
    }
}

impl fmt::Debug for Access {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut names = Vec::new();
        if self.contains(Access::LOCAL_WRITE) {
            names.push("LOCAL_WRITE");
        }
        if self.contains(Access::REMOTE_WRITE) {
            names.push("REMOTE_WRITE");
        }
        if self.contains(Access::REMOTE_READ) {
            names.push("REMOTE_READ");
        }
        if self.contains(Access::MW_BIND) {
            names.push("MW_BIND");
        }
        write!(f, "Access({})", if names.is_empty() { "NONE".to_owned() } else { names.join("|") })
    }
}

/// Local key of a memory region: names it in local scatter-gather entries.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Lkey(pub u32);

/// Remote key of a memory region: a peer names it in RDMA READ/WRITE.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Rkey(pub u32);

/// The caller's identifier for a work request, returned in its completion.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct WrId(pub u64);

/// Identifies a queue pair in completions (`ibv_wc.qp_num`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct QpNum(pub u32);

/// A scatter-gather entry: a range of registered local memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Sge {
    pub addr: u64,
    pub length: u32,
    pub lkey: Lkey,
}

/// What a send-queue work request does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SendOp {
    /// Two-sided: consumes one receive posted by the peer.
    Send,
    /// A SEND that also invalidates `rkey` at the peer (`IBV_WR_SEND_WITH_INV`):
    /// a memory window bound on the peer's queue pair (or, on a NIC, a
    /// fast-registered region) stops granting access before the peer sees
    /// the receive, which reports the key ([`Completion::invalidated_rkey`]).
    /// NVMe/RDMA targets answer with it when the host asks. Completes as
    /// [`WcOpcode::Send`].
    ///
    /// A key the peer cannot invalidate (no window of the receiving queue
    /// pair: a region registered the ordinary way, another queue pair's
    /// window, no key at all) is IBTA's class J error, the receiver's
    /// alone, as on RC hardware (rxe's responder, checked): the SEND is
    /// acknowledged and completes with success, the peer's receive
    /// completes with [`WcStatus::RemoteInvalidRequest`] and its queue pair
    /// fails without a word to this side, which learns of it as of any peer
    /// that stopped answering. The tcp provider does the same.
    SendWithInvalidate { rkey: Rkey },
    /// One-sided: places the local SGEs at `remote_addr` in the peer's region `rkey`.
    RdmaWrite { remote_addr: u64, rkey: Rkey },
    /// One-sided: fetches from the peer's `remote_addr` into the local SGEs.
    RdmaRead { remote_addr: u64, rkey: Rkey },
}

/// The local memory of a send-queue work request: where a SEND's or an
/// RDMA WRITE's bytes come from, where an RDMA READ's land.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Payload<'a> {
    /// Registered memory. Every SGE is checked against its region (lkey,
    /// bounds, `LOCAL_WRITE` for a READ's destination); a violation fails
    /// the work request with [`WcStatus::LocalProtectionError`]. The memory
    /// must be left alone until the work request completes.
    Sges(&'a [Sge]),
    /// Bytes copied at post time (`IBV_SEND_INLINE`), at most the queue
    /// pair's `max_inline_data`: any memory, registered or not, reusable as
    /// soon as `post_send` returns. SEND and RDMA WRITE only.
    Inline(&'a [u8]),
}

impl Payload<'_> {
    /// Total length in bytes.
    pub(crate) fn byte_len(&self) -> u64 {
        match self {
            Payload::Sges(sges) => sges.iter().map(|s| s.length as u64).sum(),
            Payload::Inline(bytes) => bytes.len() as u64,
        }
    }
}

/// A send-queue work request (`ibv_send_wr`). A provider reads (or, for a
/// READ, writes) only the memory its payload names: the inline bytes, or
/// registered memory that passes the checks of [`Payload::Sges`].
#[derive(Clone, Copy, Debug)]
pub struct SendWr<'a> {
    pub wr_id: WrId,
    pub op: SendOp,
    pub payload: Payload<'a>,
    /// Generate a completion on success. Errors always complete.
    pub signaled: bool,
}

/// A receive work request (`ibv_recv_wr`).
#[derive(Clone, Copy, Debug)]
pub struct RecvWr<'a> {
    pub wr_id: WrId,
    pub sges: &'a [Sge],
}

/// Which kind of work request a completion belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WcOpcode {
    Send,
    RdmaWrite,
    RdmaRead,
    Recv,
    /// A memory window's bind (verbs binds with a work request; it
    /// completes only in error, since binds are never signaled).
    BindWindow,
    /// A memory window's invalidation ([`QueuePair::invalidate_window`]).
    LocalInvalidate,
}

/// Completion status (`ibv_wc_status`, the subset a storage protocol meets).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WcStatus {
    Success,
    /// An incoming message was longer than the posted receive, or an RDMA
    /// READ response longer than its local SGEs (`IBV_WC_LOC_LEN_ERR`).
    LocalLengthError,
    /// A local SGE named an unknown lkey, lay outside its region or lacked
    /// `LOCAL_WRITE` where the provider writes (`IBV_WC_LOC_PROT_ERR`).
    LocalProtectionError,
    /// Flushed because the queue pair is in the error state (`IBV_WC_WR_FLUSH_ERR`).
    WrFlushError,
    /// The peer refused the rkey, range or access right (`IBV_WC_REM_ACCESS_ERR`).
    RemoteAccessError,
    /// The peer found the request malformed (`IBV_WC_REM_INV_REQ_ERR`).
    RemoteInvalidRequest,
    /// The peer had no receive posted (`IBV_WC_RNR_RETRY_EXC_ERR`).
    RnrRetryExceeded,
    /// The connection to the peer was lost (`IBV_WC_RETRY_EXC_ERR`).
    TransportError,
    /// The responder failed the request for a reason of its own, such as a
    /// SEND longer than its receive on some devices (`IBV_WC_REM_OP_ERR`).
    RemoteOperationError,
    /// The local queue pair could not execute the request, such as a receive
    /// too short for the incoming SEND on some devices (`IBV_WC_LOC_QP_OP_ERR`).
    LocalQpOperationError,
    /// Anything else (`IBV_WC_GENERAL_ERR`).
    GeneralError,
}

/// A work completion (`ibv_wc`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Completion {
    pub wr_id: WrId,
    pub qp_num: QpNum,
    pub opcode: WcOpcode,
    pub status: WcStatus,
    /// Bytes received, for `Recv` and `RdmaRead`; otherwise unspecified.
    pub byte_len: u32,
    /// A successful `Recv` of the peer's [`SendOp::SendWithInvalidate`]: the
    /// key it invalidated on this side, dead by now (`IBV_WC_WITH_INV`,
    /// `wc.invalidated_rkey`). The window's owner hands it back with
    /// [`QueuePair::window_invalidated_by_peer`] (or drops it: either way
    /// nothing more is posted). `None` for every other completion.
    pub invalidated_rkey: Option<Rkey>,
}

impl Completion {
    /// An empty completion, for initialising arrays handed to [`CompletionQueue::poll`].
    pub const EMPTY: Completion = Completion {
        wr_id: WrId(0),
        qp_num: QpNum(0),
        opcode: WcOpcode::Send,
        status: WcStatus::Success,
        byte_len: 0,
        invalidated_rkey: None,
    };
}

/// Queue pair sizing (`ibv_qp_cap`). The provider may round up; read back
/// the granted values with [`QueuePair::caps`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QpCaps {
    pub max_send_wr: u32,
    pub max_recv_wr: u32,
    pub max_send_sge: u32,
    pub max_recv_sge: u32,
    pub max_inline_data: u32,
}

impl Default for QpCaps {
    fn default() -> Self {
        QpCaps { max_send_wr: 64, max_recv_wr: 64, max_send_sge: 4, max_recv_sge: 4, max_inline_data: 256 }
    }
}

/// Queue pair state, reduced to what users act on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QpState {
    /// Created, not yet connected (RESET/INIT/RTR).
    Init,
    /// Connected; work requests execute (RTS).
    Ready,
    /// Failed or disconnected; work requests are flushed (ERR).
    Error,
}

/// The one error type of the fabric layer: a small matchable kind plus context.
#[derive(Debug, thiserror::Error)]
#[error("{kind}: {context}")]
pub struct FabricError {
    pub kind: FabricErrorKind,
    pub context: String,
    #[source]
    pub source: Option<std::io::Error>,
}

/// What went wrong, for callers that branch on it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FabricErrorKind {
    /// The URL is not `tcp://host:port` or `rdma://host:port`.
    InvalidUrl,
    /// The provider for this URL is not available on this machine.
    ProviderUnavailable,
    /// An argument breaks the verbs rules (too many SGEs, inline too large...).
    InvalidArgument,
    /// The send or receive queue is full.
    QueueFull,
    /// Connecting failed: refused, unreachable or rejected by the peer.
    ConnectFailed,
    /// An operation did not finish in time.
    Timeout,
    /// The operation needs a queue pair in a different state.
    InvalidState,
    /// An operating-system call failed.
    Io,
    /// The provider or device does not offer this feature.
    Unsupported,
}

impl fmt::Display for FabricErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            FabricErrorKind::InvalidUrl => "invalid fabric URL",
            FabricErrorKind::ProviderUnavailable => "fabric provider unavailable",
            FabricErrorKind::InvalidArgument => "invalid argument",
            FabricErrorKind::QueueFull => "work queue full",
            FabricErrorKind::ConnectFailed => "connection failed",
            FabricErrorKind::Timeout => "timed out",
            FabricErrorKind::InvalidState => "invalid queue pair state",
            FabricErrorKind::Io => "I/O error",
            FabricErrorKind::Unsupported => "not supported",
        })
    }
}

impl FabricError {
    /// An error without an OS source.
    pub fn new(kind: FabricErrorKind, context: impl Into<String>) -> Self {
        FabricError { kind, context: context.into(), source: None }
    }
    /// An error caused by an OS call.
    pub fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        let kind = if source.kind() == std::io::ErrorKind::TimedOut {
            FabricErrorKind::Timeout
        } else {
            FabricErrorKind::Io
        };
        FabricError { kind, context: context.into(), source: Some(source) }
    }
}

/// Result of fabric calls.
pub type Result<T> = std::result::Result<T, FabricError>;

/// An opened provider and device for one URL (an `ibv_context` plus the
/// address it was resolved from).
pub struct Fabric {
    inner: FabricImpl,
}

enum FabricImpl {
    Tcp(tcp::TcpFabric),
    #[cfg(feature = "verbs")]
    Verbs(verbs::VerbsFabric),
}

/// A protection domain: memory regions and queue pairs of one domain can
/// only reach each other.
pub struct ProtectionDomain {
    inner: PdImpl,
}

enum PdImpl {
    Tcp(tcp::TcpPd),
    #[cfg(feature = "verbs")]
    Verbs(verbs::VerbsPd),
}

/// A registered memory region. Dropping it deregisters: its keys become
/// invalid and the provider never touches its memory again.
pub struct MemoryRegion {
    inner: MrImpl,
}

enum MrImpl {
    Tcp(tcp::TcpMr),
    #[cfg(feature = "verbs")]
    Verbs(verbs::VerbsMr),
}

/// A memory window: remote rights over part of a region, under its own
/// rkey, for as long as it lives. Dropping it invalidates the rkey: a
/// peer's access with it afterwards fails (REMOTE_ACCESS), as after
/// `IBV_WR_LOCAL_INV` of a type-2 window; unless the peer invalidated it
/// already ([`SendOp::SendWithInvalidate`], reported by a polled receive
/// completion), when nothing more is done.
pub struct MemoryWindow {
    inner: MwImpl,
}

enum MwImpl {
    Tcp(tcp::TcpWindow),
    #[cfg(feature = "verbs")]
    Verbs(verbs::VerbsWindow),
}

impl MemoryWindow {
    /// The key a peer names in RDMA READ/WRITE through this window.
    pub fn rkey(&self) -> Rkey {
        match &self.inner {
            MwImpl::Tcp(w) => w.rkey(),
            #[cfg(feature = "verbs")]
            MwImpl::Verbs(w) => w.rkey(),
        }
    }
}

/// When a window's invalidation takes effect ([`QueuePair::invalidate_window`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[must_use]
pub enum Invalidation {
    /// Already: no access with the rkey succeeds from now on (tcp).
    Done,
    /// When the `LocalInvalidate` completion with the caller's `wr_id`
    /// arrives (verbs: `IBV_WR_LOCAL_INV` executes in send-queue order).
    Pending,
}

/// The argument rules every provider applies to a window bind.
pub(crate) fn check_window_access(access: Access, len: u64) -> Result<()> {
    let invalid = |why: String| Err(FabricError::new(FabricErrorKind::InvalidArgument, format!("bind_window: {why}")));
    if access.bits() & !(Access::REMOTE_READ | Access::REMOTE_WRITE).bits() != 0 || access == Access::NONE {
        return invalid(format!("a window grants REMOTE_READ and/or REMOTE_WRITE, not {access:?}"));
    }
    if len == 0 {
        return invalid("zero length".to_owned());
    }
    Ok(())
}

/// A completion queue with a completion channel.
pub struct CompletionQueue {
    inner: CqImpl,
}

enum CqImpl {
    Tcp(tcp::TcpCq),
    #[cfg(feature = "verbs")]
    Verbs(verbs::VerbsCq),
}

/// A reliable-connected queue pair.
pub struct QueuePair {
    inner: QpImpl,
}

enum QpImpl {
    Tcp(tcp::TcpQp),
    #[cfg(feature = "verbs")]
    Verbs(verbs::VerbsQp),
}

/// Default [`FabricOptions::transport_timeout`]: 4 s.
///
/// An RC NIC gives up on a silent peer after its local ACK timeout times
/// its retries: the verbs provider sets `timeout` 14 (67 ms) and
/// `retry_cnt` 6, about half a second, for a peer whose NIC acknowledges
/// in hardware within microseconds. A tcp peer acknowledges from its
/// owner's thread (manual progress), so its acknowledgement waits for
/// that thread to be scheduled and to poll, and for TCP's own
/// retransmissions when a segment is lost (200 ms, 400 ms, 800 ms...: three
/// of them take 1.4 s). The longest a healthy peer normally leaves it is
/// the initiator library's monitor visiting an idle queue, at most once a
/// second, and the target's ACK hold (20 ms, many disk reads; a frame
/// is acknowledged when it is received, never after the disk). Eight times
/// verbs' bound, four times the monitor's period and above three TCP
/// retransmissions: a peer that stops acknowledging is found within
/// seconds, and a slow one that still reads is never mistaken for it.
pub const DEFAULT_TRANSPORT_TIMEOUT: Duration = Duration::from_secs(4);

/// Default [`FabricOptions::frame_timeout`]: 10 s, as long as a tcp
/// listener gives a new connection for its whole hello (the default
/// `ListenOptions::handshake_timeout`); a frame's payload gets one more
/// second per MiB on top.
pub const DEFAULT_FRAME_TIMEOUT: Duration = Duration::from_secs(10);

/// Options of an opened fabric, for every queue pair made from it
/// ([`Fabric::open_with`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FabricOptions {
    /// tcp: how long a send-queue work request may go without progress
    /// from the peer (an acknowledgement, READ response bytes, or, while
    /// bytes are still queued to the peer, its TCP taking more of them)
    /// before the queue pair gives up on the peer, as an RC NIC does after
    /// its retries: the oldest outstanding work request completes with
    /// [`WcStatus::TransportError`], the queue pair moves to
    /// [`QpState::Error`], everything else is flushed and the connection is
    /// reset so the peer sees it too. A peer that stopped is found one
    /// timeout after its last progress, or two when bytes were still queued
    /// to it (the second shows whether it still reads). `Duration::MAX`:
    /// never. verbs: ignored (the NIC's `timeout` × `retry_cnt` applies).
    pub transport_timeout: Duration,
    /// tcp: how long a frame may take from its first byte to its last,
    /// plus one second per MiB of its payload; a peer that stops in the
    /// middle of a frame fails the queue pair as a lost connection does
    /// (the frame is never delivered, the first outstanding send-queue
    /// work request completes with [`WcStatus::TransportError`], the rest
    /// flush) and the connection is reset. `Duration::MAX`: never. verbs:
    /// ignored (a partial message never arrives on RC).
    pub frame_timeout: Duration,
}

impl Default for FabricOptions {
    fn default() -> Self {
        FabricOptions { transport_timeout: DEFAULT_TRANSPORT_TIMEOUT, frame_timeout: DEFAULT_FRAME_TIMEOUT }
    }
}

impl FabricOptions {
    fn check(&self) -> Result<()> {
        for (name, d) in [("transport_timeout", self.transport_timeout), ("frame_timeout", self.frame_timeout)] {
            if d.is_zero() {
                return Err(FabricError::new(FabricErrorKind::InvalidArgument, format!("{name} must be positive")));
            }
        }
        Ok(())
    }
}

/// How a listener treats peers that are still connecting.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ListenOptions {
    /// A peer that has not completed its connection request within this time
    /// is dropped (tcp: the HELLO; rdma_cm applies its own timeouts).
    pub handshake_timeout: Duration,
}

impl Default for ListenOptions {
    fn default() -> Self {
        ListenOptions { handshake_timeout: Duration::from_secs(10) }
    }
}

/// A passive endpoint that yields connection requests.
pub struct Listener {
    inner: ListenerImpl,
}

enum ListenerImpl {
    Tcp(tcp::TcpListener),
    #[cfg(feature = "verbs")]
    Verbs(verbs::VerbsListener),
}

/// A peer's request to connect, not yet accepted.
pub struct ConnectRequest {
    inner: ConnectRequestImpl,
}

enum ConnectRequestImpl {
    Tcp(tcp::TcpConnectRequest),
    #[cfg(feature = "verbs")]
    Verbs(verbs::VerbsConnectRequest),
}

/// The error for a call that mixes objects of different providers.
#[allow(dead_code)]
/// Locks a provider mutex, using a poisoned one as it is: one panicking
/// caller must not take every other queue pair of the process down with it.
fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// What a connect's error says about the peer's reject: its private data
/// as text (this layer's peers send a reason), or as hex bytes for a stock
/// peer's binary reject (`connect_raw`).
pub(crate) fn rejected_by_peer(private: &[u8], raw: bool) -> String {
    if raw {
        let hex: Vec<String> = private.iter().map(|b| format!("{b:02x}")).collect();
        format!("rejected by peer: [{}]", hex.join(" "))
    } else {
        format!("rejected by peer: {}", String::from_utf8_lossy(private))
    }
}

fn mixed(what: &str) -> FabricError {
    FabricError::new(FabricErrorKind::InvalidArgument, format!("{what}: objects of different fabric providers"))
}

/// Dispatches a `&self` method with the same name and arguments to the provider.
macro_rules! dispatch {
    ($impl:ident, $inner:expr, $v:ident => $e:expr) => {
        match $inner {
            $impl::Tcp($v) => $e,
            #[cfg(feature = "verbs")]
            $impl::Verbs($v) => $e,
        }
    };
}

impl Fabric {
    /// Opens the provider named by the URL's scheme, for that address,
    /// with the default [`FabricOptions`].
    pub fn open(url: &FabricUrl) -> Result<Fabric> {
        Fabric::open_with(url, FabricOptions::default())
    }

    /// Opens the provider named by the URL's scheme, for that address;
    /// the queue pairs made from it (and from its listeners' requests)
    /// follow `options`.
    pub fn open_with(url: &FabricUrl, options: FabricOptions) -> Result<Fabric> {
        options.check()?;
        match url.provider {
            ProviderKind::Tcp => Ok(Fabric { inner: FabricImpl::Tcp(tcp::TcpFabric::open_with(url, options)?) }),
            #[cfg(feature = "verbs")]
            ProviderKind::Rdma => Ok(Fabric { inner: FabricImpl::Verbs(verbs::VerbsFabric::open(url)?) }),
            #[cfg(not(feature = "verbs"))]
            ProviderKind::Rdma => Err(FabricError::new(
                FabricErrorKind::ProviderUnavailable,
                format!("{url}: this build has no verbs provider (rdmablk-common was built without its `verbs` feature); use tcp://"),
            )),
        }
    }

    /// The URL this fabric was opened for.
    pub fn url(&self) -> &FabricUrl {
        dispatch!(FabricImpl, &self.inner, f => f.url())
    }

    /// Allocates a protection domain.
    pub fn alloc_pd(&self) -> Result<ProtectionDomain> {
        match &self.inner {
            FabricImpl::Tcp(f) => Ok(ProtectionDomain { inner: PdImpl::Tcp(f.alloc_pd()?) }),
            #[cfg(feature = "verbs")]
            FabricImpl::Verbs(f) => Ok(ProtectionDomain { inner: PdImpl::Verbs(f.alloc_pd()?) }),
        }
    }

    /// Creates a completion queue able to hold `capacity` completions.
    pub fn create_cq(&self, capacity: u32) -> Result<CompletionQueue> {
        match &self.inner {
            FabricImpl::Tcp(f) => Ok(CompletionQueue { inner: CqImpl::Tcp(f.create_cq(capacity)?) }),
            #[cfg(feature = "verbs")]
            FabricImpl::Verbs(f) => Ok(CompletionQueue { inner: CqImpl::Verbs(f.create_cq(capacity)?) }),
        }
    }

    /// Creates an active-side queue pair for this fabric's URL. Post receives,
    /// then call [`QueuePair::connect`].
    pub fn create_qp(&self, pd: &ProtectionDomain, cq: &CompletionQueue, caps: QpCaps) -> Result<QueuePair> {
        #[allow(unreachable_patterns)]
        match (&self.inner, &pd.inner, &cq.inner) {
            (FabricImpl::Tcp(f), PdImpl::Tcp(pd), CqImpl::Tcp(cq)) => {
                Ok(QueuePair { inner: QpImpl::Tcp(f.create_qp(pd, cq, caps)?) })
            }
            #[cfg(feature = "verbs")]
            (FabricImpl::Verbs(f), PdImpl::Verbs(pd), CqImpl::Verbs(cq)) => {
                Ok(QueuePair { inner: QpImpl::Verbs(f.create_qp(pd, cq, caps)?) })
            }
            _ => Err(mixed("create_qp")),
        }
    }

    /// Listens on this fabric's URL with the default [`ListenOptions`].
    pub fn listen(&self) -> Result<Listener> {
        self.listen_with(ListenOptions::default())
    }

    /// Listens on this fabric's URL.
    pub fn listen_with(&self, options: ListenOptions) -> Result<Listener> {
        match &self.inner {
            FabricImpl::Tcp(f) => Ok(Listener { inner: ListenerImpl::Tcp(f.listen_with(options.handshake_timeout)?) }),
            // rdma_cm bounds its own connection establishment.
            #[cfg(feature = "verbs")]
            FabricImpl::Verbs(f) => Ok(Listener { inner: ListenerImpl::Verbs(f.listen()?) }),
        }
    }
}

/// The verbs rules for `ibv_reg_mr` arguments that every provider enforces
/// the same way: known access bits, REMOTE_WRITE only with LOCAL_WRITE, and a
/// non-null, non-empty range that does not wrap.
pub(crate) fn check_registration(addr: *mut u8, len: usize, access: Access) -> Result<()> {
    let invalid = |why: &str| FabricError::new(FabricErrorKind::InvalidArgument, format!("register: {why}"));
    if access.contains(Access::REMOTE_WRITE) && !access.contains(Access::LOCAL_WRITE) {
        return Err(invalid("REMOTE_WRITE requires LOCAL_WRITE"));
    }
    let known = Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ | Access::MW_BIND;
    if access.bits() & !known.bits() != 0 {
        return Err(invalid("unknown access bits"));
    }
    if addr.is_null() {
        return Err(invalid("null address"));
    }
    if len == 0 {
        return Err(invalid("zero length"));
    }
    if (addr as usize as u64).checked_add(len as u64).is_none() {
        return Err(invalid("region wraps the address space"));
    }
    Ok(())
}

impl ProtectionDomain {
    /// Whether [`QueuePair::bind_window`] works on this domain's queue pairs.
    /// tcp: always. verbs: where the device has type-2B memory windows
    /// (`IBV_DEVICE_MEM_WINDOW_TYPE_2B`); elsewhere a region is reachable by
    /// peers for as long as it is registered with remote rights.
    pub fn supports_windows(&self) -> bool {
        match &self.inner {
            PdImpl::Tcp(_) => true,
            #[cfg(feature = "verbs")]
            PdImpl::Verbs(pd) => pd.dev.windows,
        }
    }

    /// Registers caller-owned memory.
    ///
    /// # Safety
    /// `[addr, addr + len)` must be valid for reads and writes and stay
    /// allocated until the returned region is dropped. Peers may write into
    /// it at any time the access rights allow, so the caller must not hold
    /// Rust references into it across such windows; treat it as device memory.
    pub unsafe fn register(&self, addr: *mut u8, len: usize, access: Access) -> Result<MemoryRegion> {
        match &self.inner {
            // SAFETY: the caller's contract is forwarded unchanged.
            PdImpl::Tcp(pd) => Ok(MemoryRegion { inner: MrImpl::Tcp(unsafe { pd.register(addr, len, access)? }) }),
            #[cfg(feature = "verbs")]
            // SAFETY: the caller's contract is forwarded unchanged.
            PdImpl::Verbs(pd) => Ok(MemoryRegion { inner: MrImpl::Verbs(unsafe { pd.register(addr, len, access)? }) }),
        }
    }
}

impl MemoryRegion {
    /// Key for local scatter-gather entries.
    pub fn lkey(&self) -> Lkey {
        dispatch!(MrImpl, &self.inner, mr => mr.lkey())
    }
    /// Key a peer uses to reach this region.
    pub fn rkey(&self) -> Rkey {
        dispatch!(MrImpl, &self.inner, mr => mr.rkey())
    }
    /// Start address of the region.
    pub fn addr(&self) -> u64 {
        dispatch!(MrImpl, &self.inner, mr => mr.addr())
    }
    /// Length of the region in bytes.
    pub fn len(&self) -> usize {
        dispatch!(MrImpl, &self.inner, mr => mr.len())
    }
    /// Whether the region is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Rights granted at registration.
    pub fn access(&self) -> Access {
        dispatch!(MrImpl, &self.inner, mr => mr.access())
    }
    /// An SGE covering `[offset, offset + length)` of this region.
    pub fn sge(&self, offset: usize, length: u32) -> Sge {
        Sge { addr: self.addr() + offset as u64, length, lkey: self.lkey() }
    }
}

impl CompletionQueue {
    /// Polls up to `out.len()` completions; returns how many were written.
    /// For providers without their own progress engine (tcp) this call also
    /// drives the queue pairs attached to this CQ: it receives, places and
    /// acknowledges what their peers sent, and checks their transport and
    /// frame timeouts. Peers wait for that: see the transport timeout in
    /// the module documentation.
    pub fn poll(&self, out: &mut [Completion]) -> Result<usize> {
        dispatch!(CqImpl, &self.inner, cq => cq.poll(out))
    }
    /// A file descriptor that becomes readable when the CQ, after [`arm`],
    /// may have new completions. Put it in the caller's epoll set. tcp: it
    /// is also readable while a socket has input to process and when a
    /// queue pair's timeout is due, so an owner asleep on it wakes for
    /// both; an idle CQ is not readable.
    ///
    /// [`arm`]: CompletionQueue::arm
    pub fn fd(&self) -> RawFd {
        dispatch!(CqImpl, &self.inner, cq => cq.fd())
    }
    /// Requests a notification on the fd for the next completion. Poll once
    /// more after arming to close the race, as with `ibv_req_notify_cq`,
    /// where [`CompletionQueue::needs_poll_after_arm`] says so.
    pub fn arm(&self) -> Result<()> {
        dispatch!(CqImpl, &self.inner, cq => cq.arm())
    }
    /// Whether the owner must poll once more after [`arm`] before it
    /// sleeps on the fd (verbs, as with `ibv_req_notify_cq`: a completion
    /// that arrived between its last poll and the arm fires nothing).
    /// tcp: no. Its fd is level-triggered on socket input and on its
    /// timers, and `arm` fires it at once when completions are already
    /// queued, so nothing can slip in between: a sleep right after `arm`
    /// returns at once if there is work, and the owner saves the poll's
    /// `epoll_wait` on every sleep that finds none.
    ///
    /// [`arm`]: CompletionQueue::arm
    pub fn needs_poll_after_arm(&self) -> bool {
        match &self.inner {
            CqImpl::Tcp(_) => false,
            #[cfg(feature = "verbs")]
            CqImpl::Verbs(_) => true,
        }
    }
    /// Completions the queue holds before it overruns: the capacity asked
    /// for, or less where the device allows less (verbs: `max_cqe`; the tcp
    /// provider never overruns and reports the capacity asked for).
    pub fn capacity(&self) -> u32 {
        dispatch!(CqImpl, &self.inner, cq => cq.capacity())
    }
    /// Lets a software provider hold back the acknowledgements of received
    /// frames for up to `hold`, so that the application's next frame on
    /// that queue pair (its answer) carries them instead of a frame of
    /// their own. Only for an owner that keeps polling while it has work and
    /// arms the CQ before it sleeps on its fd (a reactor), or whose idle
    /// queues someone polls well within the peer's transport timeout (the
    /// initiator's monitor): a held-back ACK leaves at the first `poll`
    /// after `hold`, unless a frame carried it first; an armed CQ's fd
    /// becomes readable when the oldest hold ends, so a sleeping owner
    /// polls then. The peer's sends complete that much later, so `hold`
    /// should be about the time the owner takes to answer. `None` (the default) sends
    /// each ACK when its frame is processed. A NIC acknowledges in hardware;
    /// verbs ignores this.
    pub fn set_ack_coalescing(&self, hold: Option<Duration>) {
        match &self.inner {
            CqImpl::Tcp(cq) => cq.set_ack_coalescing(hold),
            #[cfg(feature = "verbs")]
            CqImpl::Verbs(_) => {}
        }
    }
    /// Consumes the notification after the fd was readable. The owner
    /// must arm again (and poll once more) before it next sleeps; the tcp
    /// provider disarms here, so that completions the owner is about to
    /// poll anyway do not fire the channel again.
    pub fn ack_event(&self) -> Result<()> {
        dispatch!(CqImpl, &self.inner, cq => cq.ack_event())
    }
    /// Takes back an `arm` whose owner stayed awake after all (its poll
    /// after arming found completions), so that completions it polls anyway
    /// do not fire the channel: on tcp that saves a write to the channel
    /// and the read that drains it. A verbs CQ cannot be disarmed: its
    /// event, if one comes, is consumed by the next wait.
    pub fn disarm(&self) {
        match &self.inner {
            CqImpl::Tcp(cq) => cq.disarm(),
            #[cfg(feature = "verbs")]
            CqImpl::Verbs(_) => {}
        }
    }
    /// Blocks until the CQ may have completions or `timeout` passes.
    /// Returns `false` on timeout. Arms, waits on the fd and acknowledges.
    pub fn wait(&self, timeout: Option<Duration>) -> Result<bool> {
        self.arm()?;
        let mut pfd = libc::pollfd { fd: self.fd(), events: libc::POLLIN, revents: 0 };
        let ms = timeout.map(|t| t.as_millis().min(i32::MAX as u128) as i32).unwrap_or(-1);
        // SAFETY: `pfd` is a valid pollfd for the duration of the call.
        let rc = unsafe { libc::poll(&mut pfd, 1, ms) };
        if rc < 0 {
            let err = std::io::Error::last_os_error();
            if err.kind() == std::io::ErrorKind::Interrupted {
                return Ok(false);
            }
            return Err(FabricError::io("poll on completion channel", err));
        }
        if rc == 0 {
            return Ok(false);
        }
        self.ack_event()?;
        Ok(true)
    }
    /// As [`wait`](CompletionQueue::wait), for an owner that is the only
    /// thread using this CQ and its queue pairs. tcp, with one queue pair
    /// attached: sleeps in a receive on its socket and processes what
    /// arrives in the same call, one system call where `wait` and the
    /// `poll` after it take two, and the next `poll` takes the completions
    /// without one. Nothing another thread does to the CQ or the queue
    /// pair wakes that sleep (a post or disconnect from one waits for it),
    /// hence the rule. Otherwise, and on verbs, it is `wait`.
    pub fn wait_alone(&self, timeout: Option<Duration>) -> Result<bool> {
        if let CqImpl::Tcp(cq) = &self.inner {
            if let Some(woken) = cq.wait_receiving(timeout) {
                return Ok(woken);
            }
        }
        self.wait(timeout)
    }
    /// As [`wait`](CompletionQueue::wait), but also returns when `other`
    /// is readable: an eventfd that another thread writes to wake the owner
    /// (the owner reads it). Returns whether `other` was readable; the CQ's
    /// notification, if it came, is acknowledged as by `wait`.
    pub fn wait_or(&self, timeout: Option<Duration>, other: std::os::fd::BorrowedFd<'_>) -> Result<bool> {
        use std::os::fd::AsRawFd;
        self.arm()?;
        let mut pfds = [
            libc::pollfd { fd: self.fd(), events: libc::POLLIN, revents: 0 },
            libc::pollfd { fd: other.as_raw_fd(), events: libc::POLLIN, revents: 0 },
        ];
        let ms = timeout.map(|t| t.as_millis().min(i32::MAX as u128) as i32).unwrap_or(-1);
        // SAFETY: `pfds` is a valid array of two pollfds for the duration of
        // the call, and its length is passed with it.
        let rc = unsafe { libc::poll(pfds.as_mut_ptr(), pfds.len() as libc::nfds_t, ms) };
        if rc < 0 {
            let err = std::io::Error::last_os_error();
            if err.kind() == std::io::ErrorKind::Interrupted {
                return Ok(false);
            }
            return Err(FabricError::io("poll on completion channel", err));
        }
        if pfds[0].revents != 0 {
            self.ack_event()?;
        }
        Ok(pfds[1].revents != 0)
    }
}

impl QueuePair {
    /// The number completions of this queue pair carry.
    pub fn qp_num(&self) -> QpNum {
        dispatch!(QpImpl, &self.inner, qp => qp.qp_num())
    }
    /// Current state.
    pub fn state(&self) -> QpState {
        dispatch!(QpImpl, &self.inner, qp => qp.state())
    }
    /// Sizes granted at creation.
    pub fn caps(&self) -> QpCaps {
        dispatch!(QpImpl, &self.inner, qp => qp.caps())
    }
    /// The peer's address, for logs.
    pub fn peer(&self) -> String {
        dispatch!(QpImpl, &self.inner, qp => qp.peer())
    }
    /// Active side: connects to the fabric's URL, sending `private_data`;
    /// returns the peer's reply private data. Receives must be posted first.
    /// Private data is limited to 256 bytes (tcp) or 55 bytes (rdma_cm).
    pub fn connect(&self, private_data: &[u8], timeout: Duration) -> Result<Vec<u8>> {
        dispatch!(QpImpl, &self.inner, qp => qp.connect(private_data, timeout))
    }
    /// Passive side: completes a connection made by
    /// [`ConnectRequest::into_queue_pair`]. Receives must be posted first.
    pub fn accept(&self, private_data: &[u8]) -> Result<()> {
        dispatch!(QpImpl, &self.inner, qp => qp.accept(private_data))
    }
    /// As [`connect`](QueuePair::connect), with private data as a stock
    /// peer (an NVMe/RDMA host) sends it: no length prefix on rdma_cm, and
    /// the reply as received (the CM may pad it). A reject's private data
    /// is in the error's context as hex bytes (`rejected by peer: [00 00 02 00]`),
    /// as received. rdma_cm: at most 56 bytes, and the reply comes padded
    /// to the REP's 196 bytes on IB and RoCE (a reject's to 148). tcp: at
    /// most 256 bytes; the hello carries a length, so the bytes are the
    /// framed call's and the reply is exactly what the peer sent.
    pub fn connect_raw(&self, private_data: &[u8], timeout: Duration) -> Result<Vec<u8>> {
        dispatch!(QpImpl, &self.inner, qp => qp.connect_raw(private_data, timeout))
    }
    /// As [`accept`](QueuePair::accept), with private data as a stock peer
    /// expects it (no length prefix on rdma_cm): at most 196 bytes there
    /// (the IB CM REP), 256 on tcp (the same bytes as `accept`).
    pub fn accept_raw(&self, private_data: &[u8]) -> Result<()> {
        dispatch!(QpImpl, &self.inner, qp => qp.accept_raw(private_data))
    }
    /// Binds a memory window over `[addr, addr + len)` of the region whose
    /// rkey is `parent` (registered with [`Access::MW_BIND`] in this queue
    /// pair's domain), granting `access` — `REMOTE_READ` and/or
    /// `REMOTE_WRITE` (which needs the region's `LOCAL_WRITE`) — to this
    /// queue pair's peer only, under a fresh rkey: a type-2B window. The
    /// queue pair must be connected.
    ///
    /// tcp: the bind takes effect at once and the rkey has 31 random bits.
    /// verbs: the bind is an `IBV_WR_BIND_MW` work request that takes one
    /// send-queue slot until a later signaled completion; it takes effect
    /// in order with the other send work requests, so a SEND posted after
    /// it reaches the peer only once the window is valid. Only the rkey's
    /// low 8 bits are the binder's (see the verbs `mw` module).
    ///
    /// Dropping the window invalidates it: at once (tcp), or by an
    /// unsignaled `IBV_WR_LOCAL_INV` that takes one more slot (verbs). To
    /// know when a peer can no longer use it, use [`Self::invalidate_window`].
    /// The peer may invalidate it itself with a
    /// [`SendOp::SendWithInvalidate`]; the drop then posts nothing, once
    /// the receive that reports it was polled. Do not drop or invalidate a
    /// window the peer may still be invalidating (its SEND not received
    /// yet): rxe panics on the second invalidation, whichever comes first.
    pub fn bind_window(&self, parent: Rkey, addr: u64, len: u64, access: Access) -> Result<MemoryWindow> {
        let inner = match &self.inner {
            QpImpl::Tcp(qp) => MwImpl::Tcp(qp.bind_window(parent, addr, len, access)?),
            #[cfg(feature = "verbs")]
            QpImpl::Verbs(qp) => MwImpl::Verbs(qp.bind_window(parent, addr, len, access)?),
        };
        Ok(MemoryWindow { inner })
    }
    /// Invalidates `window`, which was bound on this queue pair, and says
    /// when the invalidation takes effect: [`Invalidation::Done`] at once,
    /// or [`Invalidation::Pending`] until a completion with `wr_id` and
    /// opcode [`WcOpcode::LocalInvalidate`] (posting it takes a send-queue
    /// slot). A caller that must not give the memory back while a peer can
    /// still write it waits for that completion, as NVMe-oF hosts do.
    /// `Done` too for a window the peer's SEND with Invalidate ended (a
    /// receive completion this queue pair's CQ polled reported its key):
    /// nothing is posted for it (see
    /// [`window_invalidated_by_peer`](Self::window_invalidated_by_peer)).
    pub fn invalidate_window(&self, window: MemoryWindow, wr_id: WrId) -> Result<Invalidation> {
        match (&self.inner, window.inner) {
            (QpImpl::Tcp(_), MwImpl::Tcp(w)) => {
                let _ = wr_id;
                drop(w);
                Ok(Invalidation::Done)
            }
            #[cfg(feature = "verbs")]
            (QpImpl::Verbs(qp), MwImpl::Verbs(w)) => qp.invalidate_window(w, wr_id),
            #[cfg(feature = "verbs")]
            _ => Err(mixed("invalidate_window")),
        }
    }
    /// Forgets `window`, which the peer invalidated: a receive completion
    /// on this queue pair reported its rkey ([`Completion::invalidated_rkey`],
    /// from the peer's [`SendOp::SendWithInvalidate`]). Nothing is posted:
    /// invalidating it again is at best wasted, and rxe on Linux 6.12
    /// panics on it. Dropping the window, or [`Self::invalidate_window`]
    /// (which then says [`Invalidation::Done`]), does the same for a window
    /// the provider saw invalidated: the completion queue notes each such
    /// key as it polls the receive; this call says so in the caller's code,
    /// and checks it. A window no receive reported is invalidated as by a
    /// drop, and the call fails with [`FabricErrorKind::InvalidArgument`].
    pub fn window_invalidated_by_peer(&self, window: MemoryWindow) -> Result<()> {
        match (&self.inner, window.inner) {
            (QpImpl::Tcp(_), MwImpl::Tcp(w)) => {
                let rkey = w.rkey();
                if w.is_bound() {
                    drop(w);
                    return Err(FabricError::new(
                        FabricErrorKind::InvalidArgument,
                        format!(
                            "window_invalidated_by_peer: the peer did not invalidate rkey {:#x}; it was invalidated locally",
                            rkey.0
                        ),
                    ));
                }
                Ok(())
            }
            #[cfg(feature = "verbs")]
            (QpImpl::Verbs(qp), MwImpl::Verbs(w)) => qp.window_invalidated_by_peer(w),
            #[cfg(feature = "verbs")]
            _ => Err(mixed("window_invalidated_by_peer")),
        }
    }
    /// Posts a chain of send-queue work requests, executed in order.
    pub fn post_send(&self, wrs: &[SendWr<'_>]) -> Result<()> {
        dispatch!(QpImpl, &self.inner, qp => qp.post_send(wrs))
    }
    /// Posts receives.
    pub fn post_recv(&self, wrs: &[RecvWr<'_>]) -> Result<()> {
        dispatch!(QpImpl, &self.inner, qp => qp.post_recv(wrs))
    }
    /// Moves the queue pair to the error state and tells the peer. Every
    /// outstanding work request completes with [`WcStatus::WrFlushError`].
    pub fn disconnect(&self) {
        dispatch!(QpImpl, &self.inner, qp => qp.disconnect())
    }
}

impl Listener {
    /// Readable when [`poll_request`](Listener::poll_request) may make progress.
    pub fn fd(&self) -> RawFd {
        dispatch!(ListenerImpl, &self.inner, l => l.fd())
    }
    /// The address actually bound (port 0 resolved), as a URL.
    pub fn local_url(&self) -> FabricUrl {
        dispatch!(ListenerImpl, &self.inner, l => l.local_url())
    }
    /// Returns the next complete connection request, if any, without blocking.
    pub fn poll_request(&self) -> Result<Option<ConnectRequest>> {
        match &self.inner {
            ListenerImpl::Tcp(l) => Ok(l.poll_request()?.map(|r| ConnectRequest { inner: ConnectRequestImpl::Tcp(r) })),
            #[cfg(feature = "verbs")]
            ListenerImpl::Verbs(l) => {
                Ok(l.poll_request()?.map(|r| ConnectRequest { inner: ConnectRequestImpl::Verbs(r) }))
            }
        }
    }
}

impl ConnectRequest {
    /// The private data the peer sent with its request.
    pub fn private_data(&self) -> &[u8] {
        dispatch!(ConnectRequestImpl, &self.inner, r => r.private_data())
    }
    /// The private data as it arrived, for stock peers that send it
    /// without this layer's length prefix (an NVMe/RDMA host): on rdma_cm
    /// padded to the CM message's size (56 bytes on IB and RoCE), so the
    /// peer's protocol says how much of it counts; on tcp what the peer
    /// sent (the same bytes as [`private_data`](Self::private_data)).
    pub fn raw_private_data(&self) -> &[u8] {
        dispatch!(ConnectRequestImpl, &self.inner, r => r.raw_private_data())
    }
    /// The peer's address, for logs.
    pub fn peer(&self) -> String {
        dispatch!(ConnectRequestImpl, &self.inner, r => r.peer())
    }
    /// The local address the request arrived on: on a listener bound to
    /// every address, the one the peer connected to. `None` if the
    /// provider cannot tell.
    pub fn local_addr(&self) -> Option<std::net::SocketAddr> {
        dispatch!(ConnectRequestImpl, &self.inner, r => r.local_addr())
    }
    /// Creates the passive-side queue pair. Post receives, then call
    /// [`QueuePair::accept`].
    pub fn into_queue_pair(self, pd: &ProtectionDomain, cq: &CompletionQueue, caps: QpCaps) -> Result<QueuePair> {
        #[allow(unreachable_patterns)]
        match (self.inner, &pd.inner, &cq.inner) {
            (ConnectRequestImpl::Tcp(r), PdImpl::Tcp(pd), CqImpl::Tcp(cq)) => {
                Ok(QueuePair { inner: QpImpl::Tcp(r.into_queue_pair(pd, cq, caps)?) })
            }
            #[cfg(feature = "verbs")]
            (ConnectRequestImpl::Verbs(r), PdImpl::Verbs(pd), CqImpl::Verbs(cq)) => {
                Ok(QueuePair { inner: QpImpl::Verbs(r.into_queue_pair(pd, cq, caps)?) })
            }
            (inner, _, _) => {
                // Refuse the peer too: its request cannot be served.
                ConnectRequest { inner }.reject(b"internal error");
                Err(mixed("into_queue_pair"))
            }
        }
    }
    /// Refuses the request, sending `private_data` as the reason (as much
    /// of it as the provider carries: 256 bytes on tcp, 147 on rdma_cm).
    pub fn reject(self, private_data: &[u8]) {
        dispatch!(ConnectRequestImpl, self.inner, r => r.reject(private_data))
    }
    /// As [`reject`](ConnectRequest::reject), with private data as a stock
    /// peer expects it (no length prefix on rdma_cm): as much of it as the
    /// provider carries, 148 bytes on rdma_cm (the IB CM REJ), 256 on tcp.
    pub fn reject_raw(self, private_data: &[u8]) {
        dispatch!(ConnectRequestImpl, self.inner, r => r.reject_raw(private_data))
    }
}

// The threading contract of the facade.
const _: () = {
    const fn send_sync<T: Send + Sync>() {}
    const fn send<T: Send>() {}
    send_sync::<Fabric>();
    send_sync::<ProtectionDomain>();
    send_sync::<MemoryRegion>();
    send::<CompletionQueue>();
    send::<QueuePair>();
    send::<Listener>();
    send::<ConnectRequest>();
};
