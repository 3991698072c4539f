//! A reactor's blocking worker: one helper thread, started on first use,
//! for the few operations io_uring cannot carry. A reactor never blocks.
//!
//! - BLKDISCARD and BLKZEROOUT on block devices (ioctls, synchronous);
//! - fdatasync and fallocate of volumes on an iopoll ring (the kernel
//!   refuses them on a polled ring).
//!
//! Jobs go through a bounded channel (preallocated; no allocation per job),
//! results come back through another and an eventfd in the reactor's epoll
//! set, as `(user_data, result)` pairs shaped like io_uring completions.

use std::collections::VecDeque;
use std::sync::mpsc::{self, Receiver, SyncSender, TrySendError};
use std::sync::Arc;
use std::thread::JoinHandle;

use crate::backend::Backend;
use crate::error::{Error, Result};
use crate::sys::{self, EventFd};

/// What a job does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum JobKind {
    /// ioctl BLKDISCARD.
    Discard,
    /// ioctl BLKZEROOUT.
    ZeroOut,
    /// fdatasync.
    Fdatasync,
    /// fallocate with this mode.
    Fallocate(i32),
    /// Test-only fault injection: wait until writes of this session are
    /// released (`crate::fault`); the write itself then goes to the ring.
    HoldWrite(rdmablk_common::protocol::SessionId),
    /// A standby `rbd` gateway's operation: take the image over (fencing
    /// its previous owner), then carry the operation out synchronously.
    RbdTakeOverThen(crate::backend::rbd::RbdOp),
}

/// One blocking operation on a volume's backend.
pub struct Job {
    pub user_data: u64,
    pub kind: JobKind,
    pub backend: Arc<Backend>,
    pub offset: u64,
    pub len: u64,
}

/// Queue capacity of the channels; more jobs wait in the reactor's backlog.
const CAPACITY: usize = 256;

/// The reactor's side of its worker.
pub struct BlockingWorker {
    jobs: Option<SyncSender<Job>>,
    done: Receiver<(u64, i32)>,
    wake: Arc<EventFd>,
    backlog: VecDeque<Job>,
    inflight: usize,
    thread: Option<JoinHandle<()>>,
}

fn run(job: &Job) -> i32 {
    if let JobKind::HoldWrite(session) = job.kind {
        crate::fault::wait_released(session);
        return 0;
    }
    if let (JobKind::RbdTakeOverThen(op), Backend::Rbd(r)) = (job.kind, &*job.backend) {
        // SAFETY: the engine submitted `op` on a pool chunk the command
        // owns until this job's result is reaped.
        return unsafe { crate::backend::rbd::take_over_then(r, op) };
    }
    let Some(fd) = job.backend.uring_fd() else {
        // Fdatasync of a volume without a descriptor (rbd): its own flush.
        return match (job.kind, job.backend.sync()) {
            (JobKind::Fdatasync, Err(e)) => -sys::errno_of(&e),
            _ => 0,
        };
    };
    let r = match job.kind {
        JobKind::HoldWrite(_) | JobKind::RbdTakeOverThen(_) => unreachable!("handled above"),
        JobKind::Discard => sys::blk_discard(fd, job.offset, job.len),
        JobKind::ZeroOut => sys::blk_zeroout(fd, job.offset, job.len),
        JobKind::Fdatasync => job.backend.sync(),
        JobKind::Fallocate(mode) => sys::fallocate(fd, mode, job.offset, job.len),
    };
    match r {
        Ok(()) => 0,
        Err(e) => -sys::errno_of(&e),
    }
}

impl BlockingWorker {
    /// Starts the worker thread for reactor `reactor`.
    pub fn start(reactor: usize) -> Result<BlockingWorker> {
        let (jobs_tx, jobs_rx) = mpsc::sync_channel::<Job>(CAPACITY);
        let (done_tx, done_rx) = mpsc::sync_channel::<(u64, i32)>(CAPACITY);
        let wake = Arc::new(EventFd::new().map_err(|e| Error::os("eventfd", e))?);
        let wake2 = Arc::clone(&wake);
        let thread = std::thread::Builder::new()
            .name(format!("rdmablk-r{reactor}-blk"))
            .spawn(move || {
                while let Ok(job) = jobs_rx.recv() {
                    let ud = job.user_data;
                    let res = run(&job);
                    // Release the backend before reporting, so that a removed
                    // volume's file closes once its last job is reaped.
                    drop(job);
                    // The reactor has at most CAPACITY jobs in flight, so the
                    // result channel never fills.
                    if done_tx.send((ud, res)).is_err() {
                        return;
                    }
                    wake2.notify();
                }
            })
            .map_err(|e| Error::os("cannot spawn the blocking worker", e))?;
        Ok(BlockingWorker { jobs: Some(jobs_tx), done: done_rx, wake, backlog: VecDeque::new(), inflight: 0, thread: Some(thread) })
    }

    /// The eventfd that becomes readable when results are ready.
    pub fn fd(&self) -> std::os::fd::RawFd {
        self.wake.fd()
    }

    /// Reads the eventfd if it was notified since the last reap. The
    /// worker notifies after it sends a result, so a reap can take the
    /// last result before its notification lands: with nothing left in
    /// flight nobody reaps again, and the eventfd would stay readable and
    /// end every sleep of the reactor at once.
    pub fn clear_wake(&self) {
        self.wake.drain_if_notified();
    }

    /// Jobs submitted and not yet reaped.
    pub fn inflight(&self) -> usize {
        self.inflight + self.backlog.len()
    }

    /// Queues a job.
    pub fn submit(&mut self, job: Job) {
        self.backlog.push_back(job);
        self.flush();
    }

    fn flush(&mut self) {
        let Some(tx) = &self.jobs else { return };
        while self.inflight < CAPACITY {
            let Some(job) = self.backlog.pop_front() else { return };
            match tx.try_send(job) {
                Ok(()) => self.inflight += 1,
                Err(TrySendError::Full(job)) | Err(TrySendError::Disconnected(job)) => {
                    self.backlog.push_front(job);
                    return;
                }
            }
        }
    }

    /// Reports finished jobs as `f(user_data, result)`; returns how many.
    pub fn reap(&mut self, mut f: impl FnMut(u64, i32)) -> usize {
        self.wake.drain();
        let mut n = 0;
        while let Ok((ud, res)) = self.done.try_recv() {
            self.inflight -= 1;
            n += 1;
            f(ud, res);
        }
        self.flush();
        n
    }
}

impl Drop for BlockingWorker {
    fn drop(&mut self) {
        self.jobs = None;
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::MemoryBackend;
    use crate::config::{BackendKind, VolumeConfig};
    use std::time::{Duration, Instant};

    #[test]
    fn jobs_complete_through_the_eventfd() {
        let vc = VolumeConfig {
            index: 0,
            name: "m".into(),
            backend: BackendKind::Memory,
            path: Default::default(),
            size: Some(1 << 20),
            block_size: None,
            read_only: false,
            nsid: None,
            rbd: None,
        };
        let backend = Arc::new(Backend::Memory(MemoryBackend::open("t", &vc, 1 << 20).unwrap()));
        let mut w = BlockingWorker::start(0).unwrap();
        let ep = sys::Epoll::new().unwrap();
        ep.add(w.fd(), 9).unwrap();
        for i in 0..600u64 {
            let kind = if i % 2 == 0 { JobKind::Fdatasync } else { JobKind::Fallocate(crate::backend::PUNCH_HOLE) };
            w.submit(Job { user_data: i, kind, backend: Arc::clone(&backend), offset: 0, len: 4096 });
        }
        // BLKDISCARD on a memfd is not a block device: ENOTTY, reported as a result.
        w.submit(Job { user_data: 1000, kind: JobKind::Discard, backend: Arc::clone(&backend), offset: 0, len: 4096 });
        let mut got = Vec::new();
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut tokens = Vec::new();
        while got.len() < 601 {
            assert!(Instant::now() < deadline, "only {} results", got.len());
            ep.wait(&mut tokens, Some(Duration::from_millis(100))).unwrap();
            w.reap(|u, r| got.push((u, r)));
        }
        assert_eq!(w.inflight(), 0);
        got.sort();
        assert!(got[..600].iter().enumerate().all(|(i, &(u, r))| u == i as u64 && r == 0), "{:?}", &got[..4]);
        assert_eq!(got[600], (1000, -libc::ENOTTY));
    }
}

