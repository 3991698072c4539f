//! A queue's block engine: one io_uring ring, one registered buffer pool,
//! the volumes' fixed-file slots and a blocking worker, for a protocol
//! front end that runs one thread per queue (the NVMe-oF queues; see
//! `nvmf`). The front end decodes its wire and plans; it asks the engine for
//! disk operations on pool chunks, tagged with its own slab index, and reaps
//! their completions. The engine knows nothing of the wire.
//!
//! Ordering: operations are independent. A write is complete (and, with
//! `fua`, durable) when its completion is reaped; a flush covers the writes
//! completed before it was submitted. Nothing else is promised, as a disk
//! promises nothing else.
//!
//! The rdmablk v1 reactor (`reactor`) still drives its own ring and pool;
//! moving it onto this engine is the rest of the split that `ARCHITECTURE.md`
//! describes.

use std::collections::HashMap;
use std::os::fd::RawFd;
use std::sync::Arc;

use rdmablk_common::protocol::VolumeId;

use crate::backend::{RangeOp, Volume};
use crate::blocking::{BlockingWorker, Job, JobKind};
use crate::error::Result;
use crate::pool::{ChunkId, Pool};
use crate::uring::{Uring, UringOptions};

/// Fixed-file slots per queue: the volumes one queue may touch at once.
const FILE_SLOTS: u32 = 64;

/// What a finished operation reports: its tag and bytes moved or `-errno`.
pub type Completion = (u64, i32);

/// One queue's ring, pool and worker.
pub struct QueueEngine {
    // Field order: the ring closes (after waiting for in-flight operations)
    // before the pool's memory is freed.
    uring: Uring,
    pool: Pool,
    blocking: Option<BlockingWorker>,
    /// Volume id to fixed-file slot, with the volume it was registered for
    /// (a reload may publish a new `Volume` with another descriptor).
    slots: HashMap<VolumeId, (u32, Arc<Volume>)>,
    free_slots: Vec<u32>,
    /// Operations that need no disk (the `null` backend, no-op ranges):
    /// reported at the next reap, as if the disk had answered.
    immediate: Vec<Completion>,
    worker_id: usize,
}

impl QueueEngine {
    /// A ring of `entries` and a pool of `chunks` chunks of `chunk_size`
    /// bytes. `worker_id` names the blocking worker's thread. With
    /// `wake_fd` (the caller's epoll descriptor), the caller sleeps in the
    /// ring where the kernel allows it ([`QueueEngine::sleep`]).
    pub fn new(chunks: u32, chunk_size: u32, entries: u32, worker_id: usize, wake_fd: Option<RawFd>) -> Result<QueueEngine> {
        let pool = Pool::new(chunks as usize * chunk_size as usize, chunk_size as usize);
        let opts = UringOptions { entries, file_slots: FILE_SLOTS, wake_fd, ..UringOptions::default() };
        let uring = Uring::new(&[], &pool, opts)?;
        Ok(QueueEngine {
            uring,
            pool,
            blocking: None,
            slots: HashMap::new(),
            free_slots: (0..FILE_SLOTS).rev().collect(),
            immediate: Vec::new(),
            worker_id,
        })
    }

    /// The descriptors to wait on: the ring's eventfd, and the blocking
    /// worker's once it exists.
    pub fn wait_fds(&self) -> impl Iterator<Item = RawFd> + '_ {
        self.uring.eventfd().into_iter().chain(self.blocking.as_ref().map(|b| b.fd()))
    }

    /// Operations not yet reported.
    pub fn inflight(&self) -> usize {
        self.uring.inflight() + self.blocking.as_ref().map_or(0, |b| b.inflight()) + self.immediate.len()
    }

    pub fn chunk_size(&self) -> usize {
        self.pool.chunk_size()
    }

    /// A free chunk, if any.
    pub fn alloc(&mut self) -> Option<ChunkId> {
        self.pool.alloc()
    }

    pub fn release(&mut self, c: ChunkId) {
        self.pool.release(c);
    }

    pub fn bytes(&self, c: ChunkId) -> &[u8] {
        self.pool.bytes(c)
    }

    pub fn bytes_mut(&mut self, c: ChunkId) -> &mut [u8] {
        self.pool.bytes_mut(c)
    }

    /// The fixed-file slot of `vol`, registering it (or its new descriptor
    /// after a reload) on first use. `None`: no disk behind it.
    fn slot(&mut self, vol: &Arc<Volume>) -> Result<Option<u32>> {
        let Some(fd) = vol.backend.uring_fd() else { return Ok(None) };
        if let Some((slot, known)) = self.slots.get(&vol.id) {
            if Arc::ptr_eq(&known.backend, &vol.backend) {
                return Ok(Some(*slot));
            }
        }
        let slot = match self.slots.remove(&vol.id) {
            Some((slot, _)) => slot,
            None => match self.free_slots.pop() {
                Some(s) => s,
                None => {
                    // Every slot is taken: forget the volumes that are no
                    // longer served here (operations in flight keep their file).
                    let (&old, _) = self.slots.iter().next().expect("a full table has entries");
                    self.slots.remove(&old).expect("present").0
                }
            },
        };
        self.uring.set_file(slot, Some(fd))?;
        self.slots.insert(vol.id, (slot, Arc::clone(vol)));
        Ok(Some(slot))
    }

    /// Reads `len` bytes at `offset` of `vol` into chunk `c`.
    pub fn read(&mut self, vol: &Arc<Volume>, c: ChunkId, len: u32, offset: u64, tag: u64) -> Result<()> {
        match self.slot(vol)? {
            Some(file) => self.uring.read_fixed(&mut self.pool, file, c, 0, len, offset, tag),
            None => {
                self.pool.bytes_mut(c)[..len as usize].fill(0);
                self.immediate.push((tag, len as i32));
            }
        }
        Ok(())
    }

    /// Writes `len` bytes of chunk `c` at `offset` of `vol` (durably with `fua`).
    pub fn write(&mut self, vol: &Arc<Volume>, c: ChunkId, len: u32, offset: u64, fua: bool, tag: u64) -> Result<()> {
        match self.slot(vol)? {
            Some(file) => self.uring.write_fixed(&mut self.pool, file, c, 0, len, offset, fua && vol.backend.needs_flush(), tag),
            None => self.immediate.push((tag, len as i32)),
        }
        Ok(())
    }

    /// Makes the completed writes of `vol` durable.
    pub fn flush(&mut self, vol: &Arc<Volume>, tag: u64) -> Result<()> {
        match self.slot(vol)? {
            Some(file) if vol.backend.needs_flush() => self.uring.fsync(file, tag),
            _ => self.immediate.push((tag, 0)),
        }
        Ok(())
    }

    /// Deallocates or zeroes `len` bytes at `offset` of `vol` the way its
    /// backend does it (`op`, from `Backend::discard` or `write_zeroes`).
    pub fn range(&mut self, vol: &Arc<Volume>, op: RangeOp, offset: u64, len: u64, tag: u64) -> Result<()> {
        let kind = match op {
            RangeOp::Nothing => {
                self.immediate.push((tag, 0));
                return Ok(());
            }
            RangeOp::Fallocate(mode) if self.uring.features().fallocate => {
                match self.slot(vol)? {
                    Some(file) => self.uring.fallocate(file, mode, offset, len, tag),
                    None => self.immediate.push((tag, 0)),
                }
                return Ok(());
            }
            RangeOp::Fallocate(mode) => JobKind::Fallocate(mode),
            RangeOp::BlkDiscard => JobKind::Discard,
            RangeOp::BlkZeroout => JobKind::ZeroOut,
        };
        if self.blocking.is_none() {
            self.blocking = Some(BlockingWorker::start(self.worker_id)?);
        }
        let job = Job { user_data: tag, kind, backend: Arc::clone(&vol.backend), offset, len };
        self.blocking.as_mut().expect("started above").submit(job);
        Ok(())
    }

    /// Hands everything queued to the kernel.
    pub fn submit(&mut self) -> Result<()> {
        self.uring.submit().map(drop)
    }

    /// Whether the caller sleeps in the ring ([`QueueEngine::sleep`])
    /// rather than on [`QueueEngine::wait_fds`].
    pub fn sleeps_in_ring(&self) -> bool {
        self.uring.features().ring_sleep
    }

    /// Submits what is queued and sleeps in one `io_uring_enter` until a
    /// disk operation completes, the caller's epoll descriptor becomes
    /// readable ([`QueueEngine::take_wake`] says so after the reap) or
    /// `timeout` passes. Only when [`QueueEngine::sleeps_in_ring`].
    pub fn sleep(&mut self, timeout: Option<std::time::Duration>) -> Result<()> {
        if !self.uring.wake_poll_armed() {
            self.uring.arm_wake_poll();
        }
        if !self.immediate.is_empty() {
            // Completions are waiting to be reported: do not block.
            return self.uring.submit().map(drop);
        }
        self.uring.sleep(timeout)
    }

    /// Whether the epoll descriptor woke the last sleep (reap first).
    pub fn take_wake(&mut self) -> bool {
        self.uring.take_wake_poll_fired()
    }

    /// Clears the wake-up descriptors ([`QueueEngine::wait_fds`]) after
    /// one fired; reap afterwards, so that nothing that completed in
    /// between is missed.
    pub fn clear_wake(&mut self) {
        self.uring.clear_eventfd();
        if let Some(b) = self.blocking.as_ref() {
            b.clear_wake();
        }
    }

    /// Reports every finished operation to `f` once: its tag and bytes
    /// moved, or `-errno`. No system call: cheap to call every turn.
    pub fn reap(&mut self, mut f: impl FnMut(u64, i32)) -> usize {
        let mut n = 0;
        for (tag, res) in std::mem::take(&mut self.immediate) {
            f(tag, res);
            n += 1;
        }
        n += self.uring.reap(&mut self.pool, &mut f);
        if let Some(b) = self.blocking.as_mut() {
            n += b.reap(&mut f);
        }
        n
    }
}
