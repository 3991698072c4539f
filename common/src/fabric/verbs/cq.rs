//! Completion queues: a classic CQ (`ibv_create_cq`) with a completion
//! channel, polled with `ibv_poll_cq` (full `ibv_wc`, `qp_num` included),
//! plus the rdma_cm event channel that the connections of its queue pairs
//! report to once established.
//!
//! The fd the caller waits on is an epoll set of the two channels. Arming
//! is `ibv_req_notify_cq`; acknowledging drains the completion channel and
//! acknowledges the events at once (`ibv_destroy_cq` waits for that).
//! rdma_cm events (DISCONNECTED, DEVICE_REMOVAL, ADDR_CHANGE) are handled in
//! `arm`, in `ack_event`, and in `poll` when the CQ is empty (at most once
//! per millisecond): a DISCONNECTED moves the queue pair to ERR, so its
//! outstanding work requests flush into this CQ.

use std::collections::HashMap;
use std::mem::MaybeUninit;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, LazyLock, Mutex};
use std::time::Instant;

use rdma_mummy_sys as sys;
use sideway::ibverbs::completion::{BasicCompletionQueue, CompletionChannel, CompletionQueue as _};

use super::cm::CmChannel;
use super::device::Device;
use super::qp::{self, QpCore};
use crate::fabric::{lock, Completion, FabricError, FabricErrorKind, Result, WcStatus};

/// Device completions read per `ibv_poll_cq` call.
const POLL_BATCH: usize = 32;
/// An empty poll looks at the rdma_cm channel at most this often.
const CM_CHECK_NANOS: u64 = 1_000_000;

const TOKEN_COMP: u64 = 1;
const TOKEN_CM: u64 = 2;

static EPOCH: LazyLock<Instant> = LazyLock::new(Instant::now);

fn now_nanos() -> u64 {
    EPOCH.elapsed().as_nanos() as u64
}

/// State shared by a CQ handle and its queue pairs.
pub(crate) struct CqShared {
    pub(crate) dev: Arc<Device>,
    raw_cq: NonNull<sys::ibv_cq>,
    raw_chan: NonNull<sys::ibv_comp_channel>,
    /// rdma_cm channel of the established connections of this CQ's QPs.
    pub(crate) cm: Arc<CmChannel>,
    epfd: OwnedFd,
    /// The queue pairs whose completions arrive here, by qp_num.
    qps: Mutex<HashMap<u32, Arc<QpCore>>>,
    last_cm_check: AtomicU64,
    /// Entries the device granted.
    capacity: u32,
    // Drop order: the CQ before its completion channel.
    pub(crate) cq: Arc<BasicCompletionQueue>,
    _chan: Arc<CompletionChannel>,
}

// SAFETY: the raw pointers belong to `cq` and `_chan` (sideway marks both
// Send + Sync); libibverbs' poll, notify and channel calls are thread-safe,
// and the rest is behind mutexes or atomics.
unsafe impl Send for CqShared {}
// SAFETY: as above.
unsafe impl Sync for CqShared {}

impl CqShared {
    pub(crate) fn attach(&self, core: &Arc<QpCore>) {
        lock(&self.qps).insert(core.qp_num, core.clone());
    }

    pub(crate) fn detach(&self, qp_num: u32) {
        lock(&self.qps).remove(&qp_num);
    }

    /// Handles every queued rdma_cm event.
    fn service_cm(&self) {
        self.last_cm_check.store(now_nanos(), Ordering::Relaxed);
        loop {
            match self.cm.get_event() {
                Ok(Some(e)) => qp::dispatch(&e, "completion queue"),
                Ok(None) => return,
                Err(e) => {
                    tracing::warn!(device = %self.dev.name, "rdma_get_cm_event on a completion queue's channel: {e}");
                    return;
                }
            }
        }
    }
}

/// A completion queue of the verbs provider.
pub struct VerbsCq {
    pub(crate) sh: Arc<CqShared>,
}

fn epoll_add(epfd: RawFd, fd: RawFd, token: u64) -> std::io::Result<()> {
    let mut ev = libc::epoll_event { events: libc::EPOLLIN as u32, u64: token };
    // SAFETY: valid descriptors and a valid event struct.
    if unsafe { libc::epoll_ctl(epfd, libc::EPOLL_CTL_ADD, fd, &mut ev) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

impl VerbsCq {
    pub(crate) fn new(dev: Arc<Device>, capacity: u32) -> Result<VerbsCq> {
        let cqe = capacity.clamp(1, dev.max_cqe);
        if cqe < capacity {
            tracing::warn!(
                device = %dev.name,
                "completion queue of {capacity} entries asked for; the device allows {cqe}"
            );
        }
        let io = |what: &str, e: std::io::Error| FabricError::io(format!("{what} on {}", dev.name), e);
        let chan = dev
            .ctx
            .create_comp_channel()
            .map_err(|e| FabricError::new(FabricErrorKind::Io, format!("ibv_create_comp_channel on {}: {e:?}", dev.name)))?;
        chan.set_nonblocking(true).map_err(|e| io("O_NONBLOCK on the completion channel", e))?;
        let mut b = dev.ctx.create_cq_builder();
        b.setup_cqe(cqe).setup_comp_channel(&chan, 0);
        // The classic CQ: the extended one (ibv_create_cq_ex) misreports
        // completions on rxe after the first batch.
        let cq = b
            .build()
            .map_err(|e| FabricError::new(FabricErrorKind::Io, format!("ibv_create_cq({cqe}) on {}: {e:?}", dev.name)))?;
        let cm = CmChannel::new().map_err(|e| io("rdma_create_event_channel", e))?;
        // SAFETY: epoll_create1 has no memory arguments.
        let ep = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
        if ep < 0 {
            return Err(io("epoll_create1", std::io::Error::last_os_error()));
        }
        // SAFETY: a descriptor we just created and own.
        let epfd = unsafe { OwnedFd::from_raw_fd(ep) };
        epoll_add(epfd.as_raw_fd(), chan.as_raw_fd(), TOKEN_COMP).map_err(|e| io("epoll_ctl", e))?;
        epoll_add(epfd.as_raw_fd(), cm.fd(), TOKEN_CM).map_err(|e| io("epoll_ctl", e))?;
        // SAFETY: the pointers are owned by `cq` and `chan`, kept in the struct.
        let (raw_cq, raw_chan) = unsafe { (cq.cq(), chan.comp_channel()) };
        // SAFETY: `cqe` is a plain field of the live CQ (possibly rounded up).
        let capacity = (unsafe { raw_cq.as_ref().cqe }.max(0) as u32).max(cqe);
        Ok(VerbsCq {
            sh: Arc::new(CqShared {
                dev,
                raw_cq,
                raw_chan,
                cm,
                epfd,
                qps: Mutex::new(HashMap::new()),
                last_cm_check: AtomicU64::new(0),
                capacity,
                cq,
                _chan: chan,
            }),
        })
    }

    pub fn poll(&self, out: &mut [Completion]) -> Result<usize> {
        let sh = &*self.sh;
        let mut k = 0;
        while k < out.len() {
            let want = (out.len() - k).min(POLL_BATCH);
            let mut wcs = [MaybeUninit::<sys::ibv_wc>::uninit(); POLL_BATCH];
            // SAFETY: a live CQ and room for `want` completions.
            let n = unsafe { sys::ibv_poll_cq(sh.raw_cq.as_ptr(), want as i32, wcs.as_mut_ptr() as *mut sys::ibv_wc) };
            if n < 0 {
                return Err(FabricError::io("ibv_poll_cq", std::io::Error::from_raw_os_error(-n)));
            }
            if n == 0 {
                break;
            }
            let mut kick: Vec<Arc<QpCore>> = Vec::new();
            {
                let qps = lock(&sh.qps);
                for w in &wcs[..n as usize] {
                    // SAFETY: ibv_poll_cq initialised the first `n` entries.
                    let wc = unsafe { w.assume_init_ref() };
                    let status = qp::map_status(wc.status);
                    let Some(core) = qps.get(&wc.qp_num) else {
                        tracing::debug!(qp = wc.qp_num, "completion of a destroyed queue pair dropped");
                        continue;
                    };
                    if status != WcStatus::Success && status != WcStatus::WrFlushError {
                        tracing::debug!(
                            qp = wc.qp_num,
                            status = %qp::status_name(wc.status),
                            vendor_err = wc.vendor_err,
                            "error completion"
                        );
                    }
                    let mut shadow = lock(&core.shadow);
                    if status != WcStatus::Success && !shadow.errored {
                        shadow.errored = true;
                        kick.push(core.clone());
                    }
                    let c = shadow.translate(wc.qp_num, wc, status, core.dev.wc_with_inv);
                    drop(shadow);
                    if let Some(c) = c {
                        if let Some(rkey) = c.invalidated_rkey {
                            // Before the owner can drop that window: the
                            // device ended it, and must not see it again.
                            core.invalidated_by_peer(rkey.0);
                        }
                        out[k] = c;
                        k += 1;
                    }
                }
            }
            // The device put the QP in ERR; make it flush receives posted
            // before we knew (see the qp module).
            for core in kick {
                core.to_error();
            }
            if (n as usize) < want {
                break;
            }
        }
        if k == 0 && now_nanos().saturating_sub(sh.last_cm_check.load(Ordering::Relaxed)) >= CM_CHECK_NANOS {
            sh.service_cm();
        }
        Ok(k)
    }

    pub fn fd(&self) -> RawFd {
        self.sh.epfd.as_raw_fd()
    }

    pub fn capacity(&self) -> u32 {
        self.sh.capacity
    }

    pub fn arm(&self) -> Result<()> {
        // SAFETY: a live CQ.
        let rc = unsafe { sys::ibv_req_notify_cq(self.sh.raw_cq.as_ptr(), 0) };
        if rc != 0 {
            return Err(FabricError::io("ibv_req_notify_cq", std::io::Error::from_raw_os_error(rc)));
        }
        self.sh.service_cm();
        Ok(())
    }

    pub fn ack_event(&self) -> Result<()> {
        let sh = &*self.sh;
        let mut n = 0u32;
        loop {
            let mut cq: *mut sys::ibv_cq = std::ptr::null_mut();
            let mut ctx: *mut libc::c_void = std::ptr::null_mut();
            // SAFETY: a live, nonblocking channel and valid out-pointers.
            if unsafe { sys::ibv_get_cq_event(sh.raw_chan.as_ptr(), &mut cq, &mut ctx) } != 0 {
                break;
            }
            n += 1;
        }
        if n > 0 {
            // SAFETY: acknowledges the events just read for this CQ (the
            // channel serves only this CQ).
            unsafe { sys::ibv_ack_cq_events(sh.raw_cq.as_ptr(), n) };
        }
        sh.service_cm();
        Ok(())
    }
}
