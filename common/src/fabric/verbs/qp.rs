//! Queue pairs: creation through sideway, state changes from rdma_cm's
//! attributes, the data path on `ibv_post_send`/`ibv_post_recv`, and the
//! shadow work queues that give completions their caller's `wr_id`, opcode
//! and length.
//!
//! # Shadow queues and `wr_id`
//!
//! A completion in error carries no valid opcode, so each queue pair keeps
//! a shadow of its send queue (caller's `wr_id`, opcode, length per slot)
//! and of its receive queue (caller's `wr_id`). The `wr_id` given to the
//! device is the slot's absolute index, with bit 63 set for receives. A send
//! completion retires every slot up to its own, as verbs does: an unsignaled
//! work request keeps its slot until a later completion. The shadow queues
//! have exactly the granted capacities and slots are freed when completions
//! are polled, never earlier, so the device's queues cannot overflow and
//! `QueueFull` is reported exactly as the tcp provider does.
//!
//! # Error state
//!
//! Any error completion means the queue pair is in the error state. The
//! first one (or a disconnect) moves it to ERR once more by hand: some
//! devices (rxe) never flush a receive posted after the queue pair failed,
//! since posting a receive is a pure user-space operation there; a second
//! transition to ERR flushes it. Receives posted after that point are
//! followed by the same transition.

use std::collections::HashMap;
use std::mem::{size_of, MaybeUninit};
use std::ptr::{self, NonNull};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, LazyLock, Mutex, Weak};
use std::time::{Duration, Instant};

use rdma_mummy_sys as sys;
use sideway::ibverbs::queue_pair::{BasicQueuePair, QueuePair as _, QueuePairAttributeMask};

use super::cm::{self, ev, CmEvent, CmId};
use super::cq::{CqShared, VerbsCq};
use super::device::Device;
use super::mr::VerbsPd;
use super::mw::WindowPool;
use super::{MAX_MESSAGE, MIN_RNR_TIMER, QP_TIMEOUT, RETRY_CNT, RNR_RETRY};
use crate::fabric::{
    lock, Access, Completion, FabricError, FabricErrorKind, FabricUrl, Invalidation, Payload, QpCaps, QpNum, QpState, RecvWr,
    Result, Rkey, SendOp, SendWr, WcOpcode, WcStatus, WrId,
};

fn err(kind: FabricErrorKind, context: impl Into<String>) -> FabricError {
    FabricError::new(kind, context)
}

/// Bit 63 of a device `wr_id` marks a receive.
pub(crate) const RECV_BIT: u64 = 1 << 63;
/// Work requests per `ibv_post_send`/`ibv_post_recv` call; longer chains are
/// posted in order, batch by batch.
const BATCH: usize = 16;
/// SGEs per batch.
const BATCH_SGES: usize = 128;

// ------------------------------------------------------------ registry --

static NEXT_TOKEN: AtomicU64 = AtomicU64::new(1);

/// Every live queue pair by the token its rdma_cm id carries, so an event
/// read from any channel reaches its queue pair.
static BY_TOKEN: LazyLock<Mutex<HashMap<u64, Weak<QpCore>>>> = LazyLock::new(|| Mutex::new(HashMap::new()));

/// Hands an rdma_cm event that arrived after connection setup to its queue pair.
pub(crate) fn dispatch(e: &CmEvent, channel: &str) {
    let core = if e.token == 0 { None } else { lock(&BY_TOKEN).get(&e.token).and_then(Weak::upgrade) };
    match core {
        Some(core) => core.on_cm_event(e),
        None => tracing::debug!(event = %e.name(), status = e.status, channel, "rdma_cm event for no live queue pair"),
    }
}

// -------------------------------------------------------------- shadow --

#[derive(Clone, Copy)]
struct SqSlot {
    wr_id: WrId,
    opcode: WcOpcode,
    len: u32,
}

pub(crate) struct Shadow {
    sq: Vec<SqSlot>,
    sq_head: u64,
    sq_tail: u64,
    rq: Vec<WrId>,
    rq_head: u64,
    rq_tail: u64,
    /// The queue pair is known to be in the error state.
    pub(crate) errored: bool,
}

impl Shadow {
    fn new(caps: &QpCaps) -> Shadow {
        Shadow {
            sq: vec![SqSlot { wr_id: WrId(0), opcode: WcOpcode::Send, len: 0 }; caps.max_send_wr as usize],
            sq_head: 0,
            sq_tail: 0,
            rq: vec![WrId(0); caps.max_recv_wr as usize],
            rq_head: 0,
            rq_tail: 0,
            errored: false,
        }
    }
    fn sq_full(&self) -> bool {
        self.sq_tail - self.sq_head >= self.sq.len() as u64
    }
    fn rq_full(&self) -> bool {
        self.rq_tail - self.rq_head >= self.rq.len() as u64
    }

    /// The caller's view of a device completion; None for a stale one.
    /// `with_inv`: the device's `wc_flags` bit for a SEND with Invalidate
    /// ([`Device::wc_with_inv`]).
    pub(crate) fn translate(&mut self, qp_num: u32, wc: &sys::ibv_wc, status: WcStatus, with_inv: u32) -> Option<Completion> {
        let ok = status == WcStatus::Success;
        if wc.wr_id & RECV_BIT != 0 {
            let abs = wc.wr_id & !RECV_BIT;
            if abs < self.rq_head || abs >= self.rq_tail {
                return None;
            }
            let wr_id = self.rq[(abs % self.rq.len() as u64) as usize];
            self.rq_head = abs + 1;
            let byte_len = if ok { wc.byte_len } else { 0 };
            // SAFETY: both members of the union are four plain bytes, so
            // reading either is defined; with the WITH_INV flag this one holds
            // the invalidated rkey (otherwise it is not used).
            let union_rkey = unsafe { wc.imm_data_invalidated_rkey_union.invalidated_rkey };
            let invalidated_rkey = (ok && wc.wc_flags & with_inv != 0).then_some(Rkey(union_rkey));
            Some(Completion { wr_id, qp_num: QpNum(qp_num), opcode: WcOpcode::Recv, status, byte_len, invalidated_rkey })
        } else {
            let abs = wc.wr_id;
            if abs < self.sq_head || abs >= self.sq_tail {
                return None;
            }
            let slot = self.sq[(abs % self.sq.len() as u64) as usize];
            // Retires the unsignaled work requests before it too.
            self.sq_head = abs + 1;
            let byte_len = if ok && slot.opcode == WcOpcode::RdmaRead { slot.len } else { 0 };
            Some(Completion {
                wr_id: slot.wr_id,
                qp_num: QpNum(qp_num),
                opcode: slot.opcode,
                status,
                byte_len,
                invalidated_rkey: None,
            })
        }
    }
}

// ---------------------------------------------------------------- core --

/// A queue pair's state shared by its handle, its CQ (which translates its
/// completions) and the rdma_cm event dispatch.
pub(crate) struct QpCore {
    pub(crate) qp_num: u32,
    raw_qp: NonNull<sys::ibv_qp>,
    pub(crate) caps: QpCaps,
    max_read_sge: u32,
    passive: bool,
    token: u64,
    pub(crate) dev: Arc<Device>,
    peer: Mutex<String>,
    pub(crate) shadow: Mutex<Shadow>,
    /// connect() or accept() succeeded.
    connected: AtomicBool,
    /// connect() or accept() was called (each may run once).
    started: AtomicBool,
    /// rdma_disconnect (or rdma_reject, for an unanswered request) was called.
    cm_done: AtomicBool,
    /// Memory windows bound on this queue pair. Lock order: `windows`
    /// before `shadow`.
    windows: Mutex<WindowPool>,
    // Drop order: the queue pair before the id, as rdma_destroy_ep does.
    _qp: BasicQueuePair,
    id: CmId,
}

// SAFETY: `raw_qp` is the QP owned by `_qp` (sideway marks it Send + Sync);
// libibverbs' post, poll and modify calls are thread-safe, and all Rust-side
// mutable state is behind mutexes or atomics.
unsafe impl Send for QpCore {}
// SAFETY: as above.
unsafe impl Sync for QpCore {}

fn ibv_err(what: &str, rc: libc::c_int) -> std::io::Error {
    let e = std::io::Error::from_raw_os_error(rc);
    std::io::Error::new(e.kind(), format!("{what}: {e}"))
}

impl QpCore {
    fn modify(&self, attr: &mut sys::ibv_qp_attr, mask: libc::c_int, what: &str) -> std::io::Result<()> {
        // SAFETY: a live QP and a valid attribute struct.
        let rc = unsafe { sys::ibv_modify_qp(self.raw_qp.as_ptr(), attr, mask) };
        if rc == 0 {
            Ok(())
        } else {
            Err(ibv_err(what, rc))
        }
    }

    /// Moves the queue pair to ERR: outstanding work requests flush.
    pub(crate) fn to_error(&self) {
        // SAFETY: ibv_qp_attr is plain old data.
        let mut attr: sys::ibv_qp_attr = unsafe { MaybeUninit::zeroed().assume_init() };
        attr.qp_state = sys::ibv_qp_state::IBV_QPS_ERR;
        let mask = sys::ibv_qp_attr_mask::IBV_QP_STATE.0 as libc::c_int;
        if let Err(e) = self.modify(&mut attr, mask, "ibv_modify_qp(ERR)") {
            tracing::warn!(qp = self.qp_num, "{e}");
        }
    }

    /// Marks the error state and moves the queue pair to ERR (again).
    pub(crate) fn fail(&self) {
        lock(&self.shadow).errored = true;
        self.to_error();
    }

    /// Fails the queue pair and tells the peer (rdma_disconnect), once.
    fn fail_and_disconnect(&self) {
        self.fail();
        if self.connected.load(Ordering::Acquire) && !self.cm_done.swap(true, Ordering::AcqRel) {
            if let Err(e) = self.id.disconnect() {
                tracing::debug!(qp = self.qp_num, "rdma_disconnect: {e}");
            }
        }
    }

    fn peer(&self) -> String {
        lock(&self.peer).clone()
    }

    /// An rdma_cm event after (or during) connection setup.
    fn on_cm_event(&self, e: &CmEvent) {
        match e.kind {
            ev::DISCONNECTED => {
                tracing::debug!(qp = self.qp_num, peer = %self.peer(), "peer disconnected");
                // rdma_cm does not own this QP: it stays RTS until moved.
                // Flush it, and answer the DREQ with our own DREP.
                self.fail_and_disconnect();
            }
            ev::DEVICE_REMOVAL => {
                tracing::error!(
                    device = %self.dev.name,
                    qp = self.qp_num,
                    peer = %self.peer(),
                    "RDMA device removed (RDMA_CM_EVENT_DEVICE_REMOVAL): the connection is lost"
                );
                self.fail_and_disconnect();
            }
            ev::ADDR_CHANGE => {
                tracing::warn!(
                    device = %self.dev.name,
                    qp = self.qp_num,
                    peer = %self.peer(),
                    "local address changed (RDMA_CM_EVENT_ADDR_CHANGE): dropping the connection"
                );
                self.fail_and_disconnect();
            }
            ev::CONNECT_ERROR | ev::UNREACHABLE | ev::REJECTED => {
                tracing::debug!(qp = self.qp_num, event = %e.name(), status = e.status, "connection setup failed");
                self.fail();
            }
            _ => tracing::debug!(qp = self.qp_num, event = %e.name(), status = e.status, "rdma_cm event"),
        }
    }

    fn query_state(&self) -> u32 {
        // SAFETY: plain old data.
        let mut attr: sys::ibv_qp_attr = unsafe { MaybeUninit::zeroed().assume_init() };
        // SAFETY: plain old data.
        let mut init: sys::ibv_qp_init_attr = unsafe { MaybeUninit::zeroed().assume_init() };
        let mask = sys::ibv_qp_attr_mask::IBV_QP_STATE.0 as libc::c_int;
        // SAFETY: a live QP; valid out-structs.
        let rc = unsafe { sys::ibv_query_qp(self.raw_qp.as_ptr(), &mut attr, mask, &mut init) };
        if rc != 0 {
            return sys::ibv_qp_state::IBV_QPS_ERR;
        }
        attr.qp_state
    }

    /// INIT with the rights peers need for RDMA READ and WRITE (access
    /// flags on a QP only enable the operations; each region's own rights
    /// are checked separately).
    fn to_init(&self) -> std::io::Result<()> {
        let (mut attr, mut mask) = self.id.qp_attr(sys::ibv_qp_state::IBV_QPS_INIT)?;
        attr.qp_access_flags = (sys::ibv_access_flags::IBV_ACCESS_LOCAL_WRITE.0
            | sys::ibv_access_flags::IBV_ACCESS_REMOTE_WRITE.0
            | sys::ibv_access_flags::IBV_ACCESS_REMOTE_READ.0) as libc::c_uint;
        mask |= sys::ibv_qp_attr_mask::IBV_QP_ACCESS_FLAGS.0 as libc::c_int;
        self.modify(&mut attr, mask, "ibv_modify_qp(INIT)")
    }

    fn to_rtr(&self, responder_resources: Option<u8>) -> std::io::Result<()> {
        let (mut attr, mut mask) = self.id.qp_attr(sys::ibv_qp_state::IBV_QPS_RTR)?;
        attr.min_rnr_timer = MIN_RNR_TIMER;
        mask |= sys::ibv_qp_attr_mask::IBV_QP_MIN_RNR_TIMER.0 as libc::c_int;
        if let Some(r) = responder_resources {
            attr.max_dest_rd_atomic = r;
            mask |= sys::ibv_qp_attr_mask::IBV_QP_MAX_DEST_RD_ATOMIC.0 as libc::c_int;
        }
        self.modify(&mut attr, mask, "ibv_modify_qp(RTR)")
    }

    fn to_rts(&self, initiator_depth: Option<u8>) -> std::io::Result<()> {
        let (mut attr, mut mask) = self.id.qp_attr(sys::ibv_qp_state::IBV_QPS_RTS)?;
        attr.timeout = QP_TIMEOUT;
        attr.retry_cnt = RETRY_CNT;
        attr.rnr_retry = RNR_RETRY;
        mask |= (sys::ibv_qp_attr_mask::IBV_QP_TIMEOUT.0
            | sys::ibv_qp_attr_mask::IBV_QP_RETRY_CNT.0
            | sys::ibv_qp_attr_mask::IBV_QP_RNR_RETRY.0) as libc::c_int;
        if let Some(d) = initiator_depth {
            attr.max_rd_atomic = d;
            mask |= sys::ibv_qp_attr_mask::IBV_QP_MAX_QP_RD_ATOMIC.0 as libc::c_int;
        }
        self.modify(&mut attr, mask, "ibv_modify_qp(RTS)")
    }
}

impl QpCore {
    /// Posts one work request that moves no data (a window bind or
    /// invalidation) through the shadow send queue; returns its index.
    fn post_control(&self, mut w: sys::ibv_send_wr, slot: SqSlot, what: &str) -> Result<u64> {
        let mut sh = lock(&self.shadow);
        if sh.sq_full() {
            return Err(err(
                FabricErrorKind::QueueFull,
                format!("{what}: send queue full ({} work requests outstanding)", self.caps.max_send_wr),
            ));
        }
        let abs = sh.sq_tail;
        let cap = sh.sq.len() as u64;
        sh.sq[(abs % cap) as usize] = slot;
        sh.sq_tail += 1;
        w.wr_id = abs;
        w.next = ptr::null_mut();
        w.sg_list = ptr::null_mut();
        w.num_sge = 0;
        let mut bad: *mut sys::ibv_send_wr = ptr::null_mut();
        // SAFETY: a live QP and a single work request with no SGEs; the
        // window and region it names are live (the caller holds them).
        let rc = unsafe { sys::ibv_post_send(self.raw_qp.as_ptr(), &mut w, &mut bad) };
        if rc != 0 {
            sh.sq_tail = abs;
            return Err(post_error(what, rc));
        }
        Ok(abs)
    }

    /// Posts the invalidation of a bound window (signaled with `wr_id` if
    /// given) and hands the window back to the pool: `Pending` until that
    /// completes. A window the peer's SEND with Invalidate already ended
    /// (a polled receive completion reported it) is only handed back:
    /// `Done`, and nothing is posted, since rxe panics on a second
    /// invalidation (see the `mw` module).
    fn invalidate(&self, window: &mut VerbsWindow, wr_id: Option<WrId>) -> Result<Invalidation> {
        let Some(mr) = window.mr.take() else {
            return Ok(Invalidation::Done);
        };
        let mut pool = lock(&self.windows);
        if pool.take_peer_invalidated(window.rkey) {
            pool.invalidated_remotely(window.mw);
            // The device holds the region no more: it may go.
            drop(mr);
            return Ok(Invalidation::Done);
        }
        // SAFETY: ibv_send_wr is plain old data; all-zero is valid.
        let mut w: sys::ibv_send_wr = unsafe { MaybeUninit::zeroed().assume_init() };
        w.opcode = sys::ibv_wr_opcode::IBV_WR_LOCAL_INV;
        w.imm_data_invalidated_rkey_union.invalidated_rkey = window.rkey;
        w.send_flags = if wr_id.is_some() { sys::ibv_send_flags::IBV_SEND_SIGNALED.0 } else { 0 };
        let slot = SqSlot { wr_id: wr_id.unwrap_or(WrId(0)), opcode: WcOpcode::LocalInvalidate, len: 0 };
        let posted = self.post_control(w, slot, "ibv_post_send(LOCAL_INV)");
        let sq_head = lock(&self.shadow).sq_head;
        pool.give_back(window.mw, mr, posted.as_ref().ok().copied());
        pool.release_retired(sq_head);
        posted.map(|_| Invalidation::Pending)
    }

    /// A receive completion of this queue pair reported that the peer's
    /// SEND with Invalidate ended `rkey` (see the `mw` module). Called as
    /// the completion is translated, before the application sees it.
    pub(crate) fn invalidated_by_peer(&self, rkey: u32) {
        lock(&self.windows).invalidated_by_peer(rkey);
    }
}

impl Drop for QpCore {
    fn drop(&mut self) {
        lock(&BY_TOKEN).remove(&self.token);
    }
}

// ------------------------------------------------------------- batches --

/// A chain of send work requests built on the stack and posted with one call.
struct SendBatch {
    wrs: [MaybeUninit<sys::ibv_send_wr>; BATCH],
    sges: [sys::ibv_sge; BATCH_SGES],
    sge_at: [(usize, usize); BATCH],
    n: usize,
    nsge: usize,
    first_abs: u64,
}

impl SendBatch {
    fn new() -> SendBatch {
        SendBatch {
            wrs: [const { MaybeUninit::uninit() }; BATCH],
            sges: [sys::ibv_sge { addr: 0, length: 0, lkey: 0 }; BATCH_SGES],
            sge_at: [(0, 0); BATCH],
            n: 0,
            nsge: 0,
            first_abs: 0,
        }
    }

    fn fits(&self, nsge: usize) -> bool {
        self.n < BATCH && self.nsge + nsge <= BATCH_SGES
    }

    fn add(&mut self, abs: u64, wr: &SendWr<'_>) {
        if self.n == 0 {
            self.first_abs = abs;
        }
        let start = self.nsge;
        let mut flags = 0u32;
        match wr.payload {
            Payload::Sges(sges) => {
                for s in sges.iter().filter(|s| s.length > 0) {
                    self.sges[self.nsge] = sys::ibv_sge { addr: s.addr, length: s.length, lkey: s.lkey.0 };
                    self.nsge += 1;
                }
            }
            Payload::Inline(bytes) => {
                // The device copies the bytes during ibv_post_send (lkey
                // unused); the slice is borrowed for the whole call.
                flags |= sys::ibv_send_flags::IBV_SEND_INLINE.0;
                if !bytes.is_empty() {
                    let (addr, length) = (bytes.as_ptr() as usize as u64, bytes.len() as u32);
                    self.sges[self.nsge] = sys::ibv_sge { addr, length, lkey: 0 };
                    self.nsge += 1;
                }
            }
        }
        self.sge_at[self.n] = (start, self.nsge - start);
        // SAFETY: ibv_send_wr is plain old data (integers, raw pointers and
        // unions of them); all-zero is valid.
        let mut w: sys::ibv_send_wr = unsafe { MaybeUninit::zeroed().assume_init() };
        w.wr_id = abs;
        if wr.signaled {
            flags |= sys::ibv_send_flags::IBV_SEND_SIGNALED.0;
        }
        w.send_flags = flags;
        match wr.op {
            SendOp::Send => w.opcode = sys::ibv_wr_opcode::IBV_WR_SEND,
            SendOp::SendWithInvalidate { rkey } => {
                w.opcode = sys::ibv_wr_opcode::IBV_WR_SEND_WITH_INV;
                w.imm_data_invalidated_rkey_union = sys::imm_data_invalidated_rkey_union_t { invalidated_rkey: rkey.0 };
            }
            SendOp::RdmaWrite { remote_addr, rkey } => {
                w.opcode = sys::ibv_wr_opcode::IBV_WR_RDMA_WRITE;
                w.wr.rdma = sys::rdma_t { remote_addr, rkey: rkey.0 };
            }
            SendOp::RdmaRead { remote_addr, rkey } => {
                w.opcode = sys::ibv_wr_opcode::IBV_WR_RDMA_READ;
                w.wr.rdma = sys::rdma_t { remote_addr, rkey: rkey.0 };
            }
        }
        self.wrs[self.n].write(w);
        self.n += 1;
    }

    /// Links and posts the batch. On failure returns the absolute index of
    /// the first work request that was not posted.
    fn post(&mut self, qp: *mut sys::ibv_qp) -> std::result::Result<(), (u64, libc::c_int)> {
        if self.n == 0 {
            return Ok(());
        }
        let base = self.wrs.as_mut_ptr() as *mut sys::ibv_send_wr;
        for i in 0..self.n {
            let (start, count) = self.sge_at[i];
            // SAFETY: wrs[..n] were initialised by `add`; the links point into
            // this batch's own arrays, which do not move until the call returns.
            unsafe {
                let w = &mut *base.add(i);
                w.next = if i + 1 < self.n { base.add(i + 1) } else { ptr::null_mut() };
                w.sg_list = if count == 0 { ptr::null_mut() } else { self.sges.as_mut_ptr().add(start) };
                w.num_sge = count as libc::c_int;
            }
        }
        let mut bad: *mut sys::ibv_send_wr = ptr::null_mut();
        // SAFETY: a live QP and a well-formed, null-terminated chain whose SGEs
        // name registered memory, which the device checks against the lkey,
        // or inline bytes: a slice the caller's `post_send` call borrows,
        // copied by the device within this call.
        let rc = unsafe { sys::ibv_post_send(qp, base, &mut bad) };
        let (n, first) = (self.n, self.first_abs);
        self.n = 0;
        self.nsge = 0;
        if rc == 0 {
            return Ok(());
        }
        let idx = if bad.is_null() { 0 } else { (bad as usize - base as usize) / size_of::<sys::ibv_send_wr>() };
        Err((first + idx.min(n) as u64, rc))
    }
}

/// A chain of receive work requests.
struct RecvBatch {
    wrs: [sys::ibv_recv_wr; BATCH],
    sges: [sys::ibv_sge; BATCH_SGES],
    sge_at: [(usize, usize); BATCH],
    n: usize,
    nsge: usize,
    first_abs: u64,
}

impl RecvBatch {
    fn new() -> RecvBatch {
        RecvBatch {
            wrs: [sys::ibv_recv_wr { wr_id: 0, next: ptr::null_mut(), sg_list: ptr::null_mut(), num_sge: 0 }; BATCH],
            sges: [sys::ibv_sge { addr: 0, length: 0, lkey: 0 }; BATCH_SGES],
            sge_at: [(0, 0); BATCH],
            n: 0,
            nsge: 0,
            first_abs: 0,
        }
    }

    fn fits(&self, nsge: usize) -> bool {
        self.n < BATCH && self.nsge + nsge <= BATCH_SGES
    }

    fn add(&mut self, abs: u64, wr: &RecvWr<'_>) {
        if self.n == 0 {
            self.first_abs = abs;
        }
        let start = self.nsge;
        for s in wr.sges.iter().filter(|s| s.length > 0) {
            self.sges[self.nsge] = sys::ibv_sge { addr: s.addr, length: s.length, lkey: s.lkey.0 };
            self.nsge += 1;
        }
        self.sge_at[self.n] = (start, self.nsge - start);
        self.wrs[self.n].wr_id = RECV_BIT | abs;
        self.n += 1;
    }

    fn post(&mut self, qp: *mut sys::ibv_qp) -> std::result::Result<(), (u64, libc::c_int)> {
        if self.n == 0 {
            return Ok(());
        }
        let base = self.wrs.as_mut_ptr();
        for i in 0..self.n {
            let (start, count) = self.sge_at[i];
            // SAFETY: indices are within the arrays; the links point into this
            // batch, which does not move until the call returns.
            unsafe {
                let w = &mut *base.add(i);
                w.next = if i + 1 < self.n { base.add(i + 1) } else { ptr::null_mut() };
                w.sg_list = if count == 0 { ptr::null_mut() } else { self.sges.as_mut_ptr().add(start) };
                w.num_sge = count as libc::c_int;
            }
        }
        let mut bad: *mut sys::ibv_recv_wr = ptr::null_mut();
        // SAFETY: a live QP and a well-formed, null-terminated chain.
        let rc = unsafe { sys::ibv_post_recv(qp, base, &mut bad) };
        let (n, first) = (self.n, self.first_abs);
        self.n = 0;
        self.nsge = 0;
        if rc == 0 {
            return Ok(());
        }
        let idx = if bad.is_null() { 0 } else { (bad as usize - base as usize) / size_of::<sys::ibv_recv_wr>() };
        Err((first + idx.min(n) as u64, rc))
    }
}

fn post_error(what: &str, rc: libc::c_int) -> FabricError {
    match rc {
        libc::ENOMEM => err(FabricErrorKind::QueueFull, format!("{what}: the device's queue is full")),
        libc::EINVAL => err(FabricErrorKind::InvalidArgument, format!("{what}: the device refused a work request (EINVAL)")),
        _ => FabricError::io(what.to_owned(), std::io::Error::from_raw_os_error(rc)),
    }
}

fn opcode_of(op: &SendOp) -> WcOpcode {
    match op {
        SendOp::Send | SendOp::SendWithInvalidate { .. } => WcOpcode::Send,
        SendOp::RdmaWrite { .. } => WcOpcode::RdmaWrite,
        SendOp::RdmaRead { .. } => WcOpcode::RdmaRead,
    }
}

// ------------------------------------------------------------------ QP --

/// The connection a new queue pair belongs to.
pub(crate) struct Endpoint {
    /// Resolved (active side) or a connect request's id (passive side).
    pub(crate) id: CmId,
    /// Active side: where `connect` goes.
    pub(crate) url: Option<FabricUrl>,
    pub(crate) peer: String,
    /// Passive side: (responder resources, initiator depth) for accept.
    pub(crate) passive_rd: Option<(u8, u8)>,
}

/// A reliable-connected queue pair of the verbs provider.
pub struct VerbsQp {
    core: Arc<QpCore>,
    cq: Arc<CqShared>,
    /// Active side: the URL `connect` goes to.
    url: Option<FabricUrl>,
    /// Passive side: the RDMA READ depths for accept (responder resources,
    /// initiator depth), negotiated with the request.
    passive_rd: Option<(u8, u8)>,
}

impl VerbsQp {
    /// Creates the QP for `id` (resolved, or a connect request's) and moves
    /// it to INIT, so receives can be posted.
    pub(crate) fn create(dev: &Arc<Device>, pd: &VerbsPd, cq: &VerbsCq, caps: QpCaps, end: Endpoint) -> Result<VerbsQp> {
        let Endpoint { id, url, peer, passive_rd } = end;
        let invalid = |why: String| Err(err(FabricErrorKind::InvalidArgument, why));
        let max_wr = dev.max_qp_wr;
        if caps.max_send_wr > max_wr || caps.max_recv_wr > max_wr {
            return invalid(format!("{caps:?} exceeds {}'s {max_wr} work requests per queue", dev.name));
        }
        if caps.max_send_sge > dev.max_sge || caps.max_recv_sge > dev.max_sge {
            return invalid(format!("{caps:?} exceeds {}'s {} SGEs per work request", dev.name, dev.max_sge));
        }
        let want = QpCaps {
            max_send_wr: caps.max_send_wr.max(1),
            max_recv_wr: caps.max_recv_wr.max(1),
            max_send_sge: caps.max_send_sge.max(1),
            max_recv_sge: caps.max_recv_sge.max(1),
            max_inline_data: caps.max_inline_data,
        };
        // Inline data where the device allows: try the size asked for, then
        // smaller ones. The granted size is in caps(); callers check it.
        let mut inline = want.max_inline_data;
        let qp = loop {
            let mut b = pd.pd.create_qp_builder();
            b.setup_max_send_wr(want.max_send_wr)
                .setup_max_recv_wr(want.max_recv_wr)
                .setup_max_send_sge(want.max_send_sge)
                .setup_max_recv_sge(want.max_recv_sge)
                .setup_max_inline_data(inline)
                .setup_send_cq(cq.sh.cq.clone())
                .setup_recv_cq(cq.sh.cq.clone());
            match b.build() {
                Ok(qp) => break qp,
                Err(e) if inline > 0 => {
                    tracing::debug!(device = %dev.name, inline, "ibv_create_qp refused: {e:?}; asking for less inline data");
                    inline = if inline > 64 { inline / 2 } else { 0 };
                }
                Err(e) => {
                    return Err(err(
                        FabricErrorKind::InvalidArgument,
                        format!("ibv_create_qp with {want:?} on {} failed: {e:?}", dev.name),
                    ))
                }
            }
        };
        let granted = match qp.query(QueuePairAttributeMask::Capabilities) {
            Ok((_, init)) => QpCaps {
                max_send_wr: init.max_send_wr().max(want.max_send_wr),
                max_recv_wr: init.max_recv_wr().max(want.max_recv_wr),
                max_send_sge: init.max_send_sge().max(want.max_send_sge),
                max_recv_sge: init.max_recv_sge().max(want.max_recv_sge),
                max_inline_data: init.max_inline_data().max(inline),
            },
            Err(_) => QpCaps { max_inline_data: inline, ..want },
        };
        // SAFETY: the pointer is owned by `qp`, which the core keeps.
        let raw_qp = unsafe { qp.qp() };
        let qp_num = qp.qp_number();
        let token = NEXT_TOKEN.fetch_add(1, Ordering::Relaxed);
        let passive = passive_rd.is_some();
        let core = Arc::new(QpCore {
            qp_num,
            raw_qp,
            caps: granted,
            max_read_sge: granted.max_send_sge.min(dev.max_sge_rd),
            passive,
            token,
            dev: dev.clone(),
            peer: Mutex::new(peer),
            shadow: Mutex::new(Shadow::new(&granted)),
            connected: AtomicBool::new(false),
            started: AtomicBool::new(false),
            cm_done: AtomicBool::new(false),
            windows: Mutex::new(WindowPool::new(pd.pd.clone(), pd.bindable.clone())),
            _qp: qp,
            id,
        });
        core.id.set_token(token);
        lock(&BY_TOKEN).insert(token, Arc::downgrade(&core));
        cq.sh.attach(&core);
        let this = VerbsQp { core, cq: cq.sh.clone(), url, passive_rd };
        if let Err(e) = this.core.to_init() {
            return Err(FabricError::io(format!("queue pair {qp_num} on {}", dev.name), e));
        }
        if passive {
            // From here on, this connection's rdma_cm events arrive on the
            // CQ's event channel, which the CQ's fd covers.
            this.core
                .id
                .migrate(&cq.sh.cm)
                .map_err(|e| FabricError::io("rdma_migrate_id to the completion queue's channel", e))?;
        }
        Ok(this)
    }

    pub fn qp_num(&self) -> QpNum {
        QpNum(self.core.qp_num)
    }

    pub fn state(&self) -> QpState {
        use sys::ibv_qp_state::*;
        match self.core.query_state() {
            IBV_QPS_RESET | IBV_QPS_INIT | IBV_QPS_RTR => QpState::Init,
            IBV_QPS_RTS | IBV_QPS_SQD => QpState::Ready,
            _ => QpState::Error,
        }
    }

    pub fn caps(&self) -> QpCaps {
        self.core.caps
    }

    pub fn peer(&self) -> String {
        self.core.peer()
    }

    /// Active side: rdma_connect, then INIT (again, with the connection's
    /// attributes), RTR and RTS on CONNECT_RESPONSE, and rdma_establish.
    pub fn connect(&self, private_data: &[u8], timeout: Duration) -> Result<Vec<u8>> {
        if private_data.len() > cm::MAX_CONNECT_PRIVATE {
            return Err(err(
                FabricErrorKind::InvalidArgument,
                format!("private data over {} bytes (the rdma_cm connect limit)", cm::MAX_CONNECT_PRIVATE),
            ));
        }
        self.connect_with(&cm::frame_private(private_data), timeout, false)
    }

    /// As `connect`, without the length byte: a stock peer's private data,
    /// and its reply as it arrived (padded by the CM).
    pub fn connect_raw(&self, private_data: &[u8], timeout: Duration) -> Result<Vec<u8>> {
        if private_data.len() > cm::MAX_CONNECT_PRIVATE + cm::PRIVATE_HEADER {
            return Err(err(
                FabricErrorKind::InvalidArgument,
                format!("private data over {} bytes (the rdma_cm connect limit)", cm::MAX_CONNECT_PRIVATE + cm::PRIVATE_HEADER),
            ));
        }
        self.connect_with(private_data, timeout, true)
    }

    fn connect_with(&self, wire: &[u8], timeout: Duration, raw: bool) -> Result<Vec<u8>> {
        let core = &*self.core;
        let Some(url) = &self.url else {
            return Err(err(FabricErrorKind::InvalidState, "connect needs an active-side queue pair"));
        };
        if core.started.swap(true, Ordering::AcqRel) {
            return Err(err(FabricErrorKind::InvalidState, "connect needs an unconnected active-side queue pair"));
        }
        let deadline = Instant::now() + timeout;
        let mut param = cm::conn_param(wire, core.dev.rd_atomic, core.dev.rd_atomic, core.qp_num);
        let failed = |kind: FabricErrorKind, why: String| {
            // Like the tcp provider: a failed connect leaves the QP in the
            // error state with its receives flushed.
            core.fail();
            err(kind, format!("{url}: {why}"))
        };
        if let Err(e) = core.id.connect(&mut param) {
            return Err(failed(FabricErrorKind::ConnectFailed, format!("rdma_connect: {e}")));
        }
        let chan = core.id.channel();
        loop {
            let e = match chan.wait_event(deadline) {
                Ok(Some(e)) => e,
                Ok(None) => return Err(failed(FabricErrorKind::Timeout, format!("no answer within {timeout:?}"))),
                Err(e) => return Err(failed(FabricErrorKind::Io, format!("rdma_get_cm_event: {e}"))),
            };
            match e.kind {
                ev::CONNECT_RESPONSE => {
                    let setup = core
                        .to_init()
                        .and_then(|()| core.to_rtr(None))
                        .and_then(|()| core.to_rts(None))
                        .and_then(|()| core.id.establish());
                    if let Err(x) = setup {
                        return Err(failed(FabricErrorKind::ConnectFailed, format!("completing the connection: {x}")));
                    }
                    core.connected.store(true, Ordering::Release);
                    if let Some(p) = core.id.peer_addr() {
                        *lock(&core.peer) = p.to_string();
                    }
                    if let Err(x) = core.id.migrate(&self.cq.cm) {
                        tracing::warn!(qp = core.qp_num, "rdma_migrate_id: {x}; disconnects will only be seen by the data path");
                    }
                    return Ok(if raw { e.raw } else { e.private });
                }
                ev::REJECTED => {
                    let why = if raw && !e.raw.is_empty() {
                        crate::fabric::rejected_by_peer(&e.raw, true)
                    } else if !e.private.is_empty() {
                        crate::fabric::rejected_by_peer(&e.private, false)
                    } else if e.status == 8 || e.status == -libc::ECONNREFUSED {
                        "connection refused (nothing listens there)".to_owned()
                    } else {
                        format!("rejected (reason {})", e.status)
                    };
                    return Err(failed(FabricErrorKind::ConnectFailed, why));
                }
                ev::UNREACHABLE | ev::CONNECT_ERROR => {
                    let kind = if e.status == -libc::ETIMEDOUT {
                        FabricErrorKind::Timeout
                    } else {
                        FabricErrorKind::ConnectFailed
                    };
                    let io = std::io::Error::from_raw_os_error(e.status.abs());
                    return Err(failed(kind, format!("{}: {io}", e.name())));
                }
                ev::DISCONNECTED | ev::DEVICE_REMOVAL => {
                    return Err(failed(FabricErrorKind::ConnectFailed, format!("{} during connect", e.name())));
                }
                _ => tracing::debug!(qp = core.qp_num, event = %e.name(), "rdma_cm event during connect"),
            }
        }
    }

    /// Passive side: RTR and RTS with the negotiated RDMA READ depths, then
    /// rdma_accept.
    pub fn accept(&self, private_data: &[u8]) -> Result<()> {
        if private_data.len() > cm::MAX_ACCEPT_PRIVATE {
            return Err(err(
                FabricErrorKind::InvalidArgument,
                format!("private data over {} bytes (the rdma_cm accept limit)", cm::MAX_ACCEPT_PRIVATE),
            ));
        }
        self.accept_with(&cm::frame_private(private_data))
    }

    /// As `accept`, without the length byte (a stock peer's private data).
    pub fn accept_raw(&self, private_data: &[u8]) -> Result<()> {
        if private_data.len() > cm::MAX_ACCEPT_PRIVATE + cm::PRIVATE_HEADER {
            return Err(err(
                FabricErrorKind::InvalidArgument,
                format!("private data over {} bytes (the rdma_cm accept limit)", cm::MAX_ACCEPT_PRIVATE + cm::PRIVATE_HEADER),
            ));
        }
        self.accept_with(private_data)
    }

    fn accept_with(&self, wire: &[u8]) -> Result<()> {
        let core = &*self.core;
        let Some((responder_resources, initiator_depth)) = self.passive_rd else {
            return Err(err(FabricErrorKind::InvalidState, "accept needs a queue pair made from a connect request"));
        };
        if core.started.swap(true, Ordering::AcqRel) {
            return Err(err(FabricErrorKind::InvalidState, "accept was already called"));
        }
        let peer = core.peer();
        let failed = |why: String| {
            core.fail();
            err(FabricErrorKind::ConnectFailed, format!("{peer}: {why}"))
        };
        if lock(&core.shadow).errored {
            return Err(failed("the peer gave up before the accept".to_owned()));
        }
        let mut param = cm::conn_param(wire, responder_resources, initiator_depth, core.qp_num);
        let setup = core.to_rtr(Some(responder_resources)).and_then(|()| core.to_rts(Some(initiator_depth)));
        if let Err(x) = setup {
            return Err(failed(format!("preparing the queue pair: {x}")));
        }
        if let Err(x) = core.id.accept(&mut param) {
            return Err(failed(format!("rdma_accept: {x}")));
        }
        core.connected.store(true, Ordering::Release);
        Ok(())
    }

    /// Binds a type-2B window (see the `mw` module); the bind executes in
    /// order with this queue pair's other send work requests.
    pub fn bind_window(&self, parent: Rkey, addr: u64, len: u64, access: Access) -> Result<VerbsWindow> {
        let core = &self.core;
        if !core.connected.load(Ordering::Acquire) {
            return Err(err(FabricErrorKind::InvalidState, "bind_window on a queue pair that is not connected"));
        }
        let mut pool = lock(&core.windows);
        let (mr, flags) = pool.parent(parent, addr, len, access)?;
        let lease = pool.lease()?;
        // SAFETY: ibv_send_wr is plain old data; all-zero is valid.
        let mut w: sys::ibv_send_wr = unsafe { MaybeUninit::zeroed().assume_init() };
        w.opcode = sys::ibv_wr_opcode::IBV_WR_BIND_MW;
        w.bind_mw_tso_union.bind_mw = sys::bind_mw_t {
            mw: lease.mw.as_ptr(),
            rkey: lease.rkey,
            bind_info: sys::ibv_mw_bind_info {
                // SAFETY: the region is live: `mr` is held by the window
                // from here until its invalidation has executed.
                mr: unsafe { mr.mr() }.as_ptr(),
                addr,
                length: len,
                mw_access_flags: flags,
            },
        };
        let slot = SqSlot { wr_id: WrId(0), opcode: WcOpcode::BindWindow, len: 0 };
        match core.post_control(w, slot, "ibv_post_send(BIND_MW)") {
            Ok(_) => {
                pool.bound(&lease);
                Ok(VerbsWindow { core: core.clone(), mw: lease.mw, rkey: lease.rkey, mr: Some(mr) })
            }
            Err(e) => {
                pool.abandon(lease);
                Err(e)
            }
        }
    }

    /// The peer's SEND with Invalidate ended `window`: no LOCAL_INV is
    /// posted for it (rxe on Linux 6.12 dereferences a NULL region when a
    /// window it already invalidated is invalidated again, and panics). A
    /// window no receive of this queue pair reported is invalidated here
    /// instead, and the call fails: the caller's bookkeeping is wrong.
    pub fn window_invalidated_by_peer(&self, mut window: VerbsWindow) -> Result<()> {
        if !Arc::ptr_eq(&window.core, &self.core) {
            return Err(err(FabricErrorKind::InvalidArgument, "window_invalidated_by_peer: the window belongs to another queue pair"));
        }
        let rkey = window.rkey;
        match self.core.invalidate(&mut window, None)? {
            Invalidation::Done => Ok(()),
            Invalidation::Pending => Err(err(
                FabricErrorKind::InvalidArgument,
                format!(
                    "window_invalidated_by_peer: no receive of this queue pair reported rkey {rkey:#x} invalidated; \
                     the window was invalidated locally"
                ),
            )),
        }
    }

    /// Posts the invalidation of `window`, bound on this queue pair,
    /// signaled: a `LocalInvalidate` completion with `wr_id` follows once
    /// its rkey is dead (`Pending`). `Done` if the peer's SEND with
    /// Invalidate ended it already: nothing is posted, no completion comes.
    pub fn invalidate_window(&self, mut window: VerbsWindow, wr_id: WrId) -> Result<Invalidation> {
        if !Arc::ptr_eq(&window.core, &self.core) {
            return Err(err(FabricErrorKind::InvalidArgument, "invalidate_window: the window belongs to another queue pair"));
        }
        self.core.invalidate(&mut window, Some(wr_id))
    }

    pub fn post_send(&self, wrs: &[SendWr<'_>]) -> Result<()> {
        let core = &*self.core;
        if !core.connected.load(Ordering::Acquire) && !lock(&core.shadow).errored {
            return Err(err(FabricErrorKind::InvalidState, "post_send on a queue pair that is not connected"));
        }
        let mut sh = lock(&core.shadow);
        let mut batch = SendBatch::new();
        let mut res = Ok(());
        for wr in wrs {
            let nsge = match self.validate_send(wr) {
                Ok(n) => n,
                Err(e) => {
                    res = Err(e);
                    break;
                }
            };
            if sh.sq_full() {
                res = Err(err(
                    FabricErrorKind::QueueFull,
                    format!("send queue full ({} work requests outstanding)", core.caps.max_send_wr),
                ));
                break;
            }
            if !batch.fits(nsge) {
                if let Err((abs, rc)) = batch.post(core.raw_qp.as_ptr()) {
                    sh.sq_tail = abs;
                    return Err(post_error("ibv_post_send", rc));
                }
            }
            let abs = sh.sq_tail;
            let cap = sh.sq.len() as u64;
            let total = wr.payload.byte_len();
            sh.sq[(abs % cap) as usize] = SqSlot { wr_id: wr.wr_id, opcode: opcode_of(&wr.op), len: total as u32 };
            sh.sq_tail += 1;
            batch.add(abs, wr);
        }
        if let Err((abs, rc)) = batch.post(core.raw_qp.as_ptr()) {
            sh.sq_tail = abs;
            return Err(post_error("ibv_post_send", rc));
        }
        res
    }

    /// The verbs argument rules; returns the number of non-empty SGEs.
    fn validate_send(&self, wr: &SendWr<'_>) -> Result<usize> {
        let caps = &self.core.caps;
        let invalid = |why: String| Err(err(FabricErrorKind::InvalidArgument, why));
        let read = matches!(wr.op, SendOp::RdmaRead { .. });
        if let Payload::Sges(sges) = wr.payload {
            let max_sge = if read { self.core.max_read_sge } else { caps.max_send_sge };
            if sges.len() > max_sge as usize {
                let what = if read { "an RDMA READ" } else { "a send" };
                return invalid(format!("{} SGEs in {what}, the limit is {max_sge}", sges.len()));
            }
        }
        let total = wr.payload.byte_len();
        if total > MAX_MESSAGE {
            return invalid(format!("work request of {total} bytes exceeds {MAX_MESSAGE}"));
        }
        match wr.payload {
            Payload::Sges(sges) => Ok(sges.iter().filter(|s| s.length > 0).count()),
            Payload::Inline(_) if read => invalid("inline RDMA READ".to_owned()),
            Payload::Inline(_) if total > caps.max_inline_data as u64 => {
                invalid(format!("{total} inline bytes, max_inline_data is {}", caps.max_inline_data))
            }
            Payload::Inline(bytes) => Ok(usize::from(!bytes.is_empty())),
        }
    }

    pub fn post_recv(&self, wrs: &[RecvWr<'_>]) -> Result<()> {
        let core = &*self.core;
        let mut sh = lock(&core.shadow);
        let mut batch = RecvBatch::new();
        let mut res = Ok(());
        for wr in wrs {
            if wr.sges.len() > core.caps.max_recv_sge as usize {
                res = Err(err(
                    FabricErrorKind::InvalidArgument,
                    format!("{} SGEs in a receive, max_recv_sge is {}", wr.sges.len(), core.caps.max_recv_sge),
                ));
                break;
            }
            if sh.rq_full() {
                res = Err(err(
                    FabricErrorKind::QueueFull,
                    format!("receive queue full ({} receives posted)", core.caps.max_recv_wr),
                ));
                break;
            }
            let nsge = wr.sges.iter().filter(|s| s.length > 0).count();
            if !batch.fits(nsge) {
                if let Err((abs, rc)) = batch.post(core.raw_qp.as_ptr()) {
                    sh.rq_tail = abs;
                    return Err(post_error("ibv_post_recv", rc));
                }
            }
            let abs = sh.rq_tail;
            let cap = sh.rq.len() as u64;
            sh.rq[(abs % cap) as usize] = wr.wr_id;
            sh.rq_tail += 1;
            batch.add(abs, wr);
        }
        if let Err((abs, rc)) = batch.post(core.raw_qp.as_ptr()) {
            sh.rq_tail = abs;
            return Err(post_error("ibv_post_recv", rc));
        }
        let kick = sh.errored;
        drop(sh);
        if kick {
            // See the module docs: make the device flush what was just posted.
            core.to_error();
        }
        res
    }

    /// Moves the queue pair to ERR (every outstanding work request flushes)
    /// and tells the peer with rdma_disconnect.
    pub fn disconnect(&self) {
        self.core.fail_and_disconnect();
    }
}

/// A bound type-2B memory window; dropping it posts its invalidation.
pub struct VerbsWindow {
    core: Arc<QpCore>,
    mw: NonNull<sys::ibv_mw>,
    rkey: u32,
    /// The parent region while the window is bound.
    mr: Option<Arc<sideway::ibverbs::memory_region::MemoryRegion>>,
}

// SAFETY: the window pointer is only passed to libibverbs (thread-safe)
// under the queue pair's window lock; the rest is Send + Sync.
unsafe impl Send for VerbsWindow {}
// SAFETY: as above; `&VerbsWindow` only reads the rkey.
unsafe impl Sync for VerbsWindow {}

impl VerbsWindow {
    pub fn rkey(&self) -> Rkey {
        Rkey(self.rkey)
    }
}

impl Drop for VerbsWindow {
    fn drop(&mut self) {
        let core = self.core.clone();
        if let Err(e) = core.invalidate(self, None) {
            // The queue pair has failed: no peer can use the window any more.
            tracing::debug!(qp = core.qp_num, "invalidating a memory window: {e}");
        }
    }
}

impl Drop for VerbsQp {
    fn drop(&mut self) {
        let core = &self.core;
        self.cq.detach(core.qp_num);
        if !core.cm_done.swap(true, Ordering::AcqRel) {
            if core.connected.load(Ordering::Acquire) {
                // rdma_destroy_id would send the DREQ as well; be explicit.
                let _ = core.id.disconnect();
            } else if core.passive {
                // A connect request that was never answered.
                let _ = core.id.reject(&cm::frame_private(b""));
            }
        }
        // The core (QP, then id) goes when the last reference does; the CQ
        // may hold one for a moment while translating a completion.
    }
}

/// Status of a device completion.
pub(crate) fn map_status(s: u32) -> WcStatus {
    use sys::ibv_wc_status::*;
    match s {
        IBV_WC_SUCCESS => WcStatus::Success,
        IBV_WC_LOC_LEN_ERR => WcStatus::LocalLengthError,
        IBV_WC_LOC_PROT_ERR | IBV_WC_LOC_ACCESS_ERR => WcStatus::LocalProtectionError,
        IBV_WC_WR_FLUSH_ERR => WcStatus::WrFlushError,
        IBV_WC_REM_ACCESS_ERR => WcStatus::RemoteAccessError,
        IBV_WC_REM_INV_REQ_ERR | IBV_WC_REM_INV_RD_REQ_ERR => WcStatus::RemoteInvalidRequest,
        IBV_WC_RNR_RETRY_EXC_ERR => WcStatus::RnrRetryExceeded,
        IBV_WC_RETRY_EXC_ERR | IBV_WC_RESP_TIMEOUT_ERR => WcStatus::TransportError,
        // rxe's answers to a SEND longer than the receive, at the sender and
        // at the receiver (mlx5 reports REM_INV_REQ_ERR and LOC_LEN_ERR).
        IBV_WC_REM_OP_ERR => WcStatus::RemoteOperationError,
        IBV_WC_LOC_QP_OP_ERR => WcStatus::LocalQpOperationError,
        // FATAL, GENERAL and the rest.
        _ => WcStatus::GeneralError,
    }
}

/// A printable name for a raw status.
pub(crate) fn status_name(s: u32) -> String {
    // SAFETY: returns a pointer to a static string, or NULL if libibverbs is
    // not loaded (handled).
    let p = unsafe { sys::ibv_wc_status_str(s) };
    if p.is_null() {
        return format!("status {s}");
    }
    // SAFETY: NUL-terminated static string.
    unsafe { std::ffi::CStr::from_ptr(p) }.to_string_lossy().into_owned()
}
