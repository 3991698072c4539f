//! A reactor's resources on each fabric its transports use: one
//! protection domain, the reactor's pool registered with it (so a keyed
//! transfer moves straight between a peer's memory and a pool chunk), and
//! completion queues shared by every queue pair of that fabric on this
//! reactor, created as queue pairs arrive.

use std::sync::Arc;
use std::time::Duration;

use rdmablk_common::fabric::{CompletionQueue, Fabric, ProtectionDomain, WcStatus};

use crate::engine::pool::PoolRegion;
use crate::error::{Error, ErrorKind, Result};
use crate::sys::Epoll;

/// Queue pairs one completion queue is sized for. A reactor creates
/// another completion queue when its queues are full, so this bounds the
/// size of each (and a device's `max_cqe`), not how many queue pairs a
/// reactor serves: that is up to the transports' limits.
pub const QPS_PER_CQ: u32 = 64;
/// Completion-queue entries one queue pair may have outstanding, per unit
/// of queue depth: its receives, its responses and what else it sends
/// (RDMA operations are bounded by the pool, counted once per CQ).
pub const CQ_ENTRIES_PER_DEPTH: u32 = 4;
/// How long the tcp provider may hold a command's acknowledgement back for
/// the response to carry it: far longer than a disk read usually takes, so
/// that the reactor does not send an ACK frame of its own for every command
/// that waits for the disk (and the initiator is not woken for it). A
/// reactor asleep meanwhile is woken by the CQ's timer when the hold ends.
/// The initiator needs the acknowledgement only to reuse the command's
/// slot, which waits for the response anyway, and to know the target is
/// alive, which its transport timeout (4 s by default) asks 200 times later.
/// The timer is set when the reactor sleeps with an ACK held and nothing
/// armed, and fires once per hold while commands keep coming (one carried
/// since only costs that wake-up): with a 1 ms hold that was a
/// `timerfd_settime` of about 10 µs (a VM exit to reprogram the timer) ahead
/// of the disk read on one in eight I/Os at file QD1, and a wake-up per
/// millisecond (docs/perf-log/issue-20-looks.md, "Issue 20, tenth look").
pub const ACK_HOLD: Duration = Duration::from_millis(20);

/// The epoll token of completion queue `ci` of fabric `fi` (below
/// `TOKEN_RUNTIME`).
pub(super) fn cq_token(fi: usize, ci: usize) -> u64 {
    (fi as u64) << 20 | ci as u64
}

pub(super) fn split_cq_token(t: u64) -> (usize, usize) {
    ((t >> 20) as usize, (t & 0xf_ffff) as usize)
}

/// Per-fabric resources of a reactor. Field order is drop order: the pool
/// region before the protection domain.
pub struct FabricCtx {
    pub pool_mr: PoolRegion,
    /// Created as queue pairs arrive ([`super::Runtime::cq_with_room`]);
    /// never fewer than one.
    pub cqs: Vec<CqCtx>,
    pub pd: ProtectionDomain,
    pub fabric: Arc<Fabric>,
    /// The transport whose queue pairs live on this fabric: its
    /// completions go there.
    pub owner: usize,
    /// The queue depth its completion queues are sized for.
    pub(super) queue_depth: u32,
}

/// One completion queue of a fabric and the entries its queue pairs may
/// fill. Every completion queue also keeps room for an RDMA operation of
/// every pool chunk, since any one queue pair may have all of them.
pub struct CqCtx {
    pub cq: CompletionQueue,
    /// Entries reserved by live queue pairs.
    pub reserved: u32,
    /// Entries it really holds (a device may allow fewer than asked for:
    /// rxe's `max_cqe` is 32767).
    pub capacity: u32,
}

/// Creates completion queue `ci` of fabric `fi`, sized for `QPS_PER_CQ`
/// queue pairs of queue depth `queue_depth` beside `chunks` pool chunks,
/// and adds it to the reactor's epoll set. Fails if the device's largest
/// completion queue has no room for even one queue pair.
pub(super) fn new_cq(f: &Fabric, epoll: &Epoll, fi: usize, ci: usize, chunks: u32, queue_depth: u32) -> Result<CqCtx> {
    let url = f.url();
    let want = (chunks + CQ_ENTRIES_PER_DEPTH * queue_depth * QPS_PER_CQ).min(1 << 20);
    let cq = f.create_cq(want).map_err(|e| Error::fabric(format!("{url}: cannot create a completion queue"), e))?;
    // The reactor keeps polling while it has work and arms before it
    // sleeps, so acknowledgements can ride on its responses.
    cq.set_ack_coalescing(Some(ACK_HOLD));
    let capacity = cq.capacity().min(want);
    if capacity < chunks + CQ_ENTRIES_PER_DEPTH * queue_depth {
        return Err(Error::new(
            ErrorKind::Fabric,
            format!(
                "{url}: a completion queue of {capacity} entries has no room for one queue pair beside {chunks} pool chunks; lower target.queue_depth or target.buffer_pool"
            ),
        ));
    }
    epoll.add(cq.fd(), cq_token(fi, ci)).map_err(|e| Error::os("epoll_ctl", e))?;
    Ok(CqCtx { cq, reserved: 0, capacity })
}

/// Why a work completion failed, in words, for a log line or a queue's
/// close reason: `what` ("RDMA READ") and its status.
pub fn completion_reason(what: &str, status: WcStatus) -> String {
    let why = match status {
        WcStatus::Success => "success",
        WcStatus::LocalLengthError => "local length error (message larger than the receive buffer?)",
        WcStatus::LocalProtectionError => "local protection error",
        WcStatus::WrFlushError => "flushed",
        WcStatus::RemoteAccessError => "remote access error (bad rkey, range or rights)",
        WcStatus::RemoteInvalidRequest => "remote invalid request",
        WcStatus::RnrRetryExceeded => "receiver not ready (initiator posted no receive)",
        WcStatus::TransportError => "transport error (connection lost)",
        WcStatus::RemoteOperationError => "remote operation error (the initiator failed the request)",
        WcStatus::LocalQpOperationError => "local queue pair operation error",
        WcStatus::GeneralError => "general error",
    };
    format!("{what} failed: {why}")
}
