//! The storage engine of one reactor, which every protocol front end's
//! commands run on. Bottom to top:
//! - [`pool`]: the registered buffer pool (chunks, their owners and
//!   accounts) and registered slot buffers;
//! - [`uring`]: the io_uring ring (fixed files, fixed buffers,
//!   restrictions, the sleep in the ring, socket receives);
//! - [`blocking`]: the worker thread for the few calls io_uring cannot carry;
//! - [`readahead`]: sequential streams and the chunks read ahead of them;
//! - this file: [`BlockEngine`], the ring, the pool, the volumes' fixed-file
//!   slots and the blocking worker behind one API of disk operations on
//!   pool chunks, tagged by the caller;
//! - [`exec`]: the [`exec::Executor`], which owns the commands on the
//!   engine: chunk waits and shares, pipelining, readahead, write epochs,
//!   the volume snapshot and counters; a front end hands it a request and
//!   hears back what must cross its wire.
//!
//! The engine knows nothing of any wire.
//!
//! Ordering: operations are independent. A write is complete (and, with
//! `fua`, durable) when its completion is reaped; a flush covers the writes
//! completed before it was submitted. Nothing else is promised, as a disk
//! promises nothing else.
//!
//! Fixed files: a volume gets a slot at its first operation (or at
//! [`BlockEngine::attach`]) and a reloaded volume its new descriptor in the
//! same slot; [`BlockEngine::detach`] gives the slot back after the
//! volume's last operation. Operations in flight keep the file they were
//! submitted with whatever happens to the slot afterwards.

use std::collections::HashMap;
use std::os::fd::RawFd;
use std::sync::Arc;

use rdmablk_common::keymap::KeyHashing;
use rdmablk_common::protocol::{SessionId, VolumeId};

pub mod blocking;
pub mod exec;
pub mod pool;
pub mod readahead;
pub mod uring;

use crate::backend::rbd::{RbdCompletions, RbdOp, EBLOCKLISTED};
use crate::backend::{Access, Backend, RangeOp, Volume};
use crate::engine::blocking::{BlockingWorker, Job, JobKind};
use crate::error::Result;
use crate::engine::pool::{ChunkId, Pool};
use crate::engine::uring::{RecvId, RecvInto, Uring, UringFeatures, UringOptions};

/// What a finished operation reports: its tag and bytes moved or `-errno`.
pub type Completion = (u64, i32);

/// One thread's ring, pool, fixed files and blocking worker.
pub struct BlockEngine {
    // Field order: the ring closes (after waiting for in-flight operations)
    // before the pool's memory is freed.
    uring: Uring,
    pool: Pool,
    blocking: Option<BlockingWorker>,
    /// librbd's completions for this engine's `rbd` volumes, from the first.
    rbd: Option<RbdCompletions>,
    /// Descriptors of wake-up sources started since the caller last asked
    /// ([`BlockEngine::started_worker_fd`]): the blocking worker's, librbd's.
    new_wait_fds: Vec<RawFd>,
    /// Volume id to fixed-file slot, with the backend it was registered
    /// for (a reload may publish a new backend with another descriptor).
    /// Looked up by every disk operation; the target numbers its volumes,
    /// so the ids need no keyed hash (std's SipHash was 114 instructions
    /// and 12 code lines per file read).
    files: HashMap<VolumeId, (u32, Arc<Backend>), KeyHashing>,
    free_files: Vec<u32>,
    /// Operations that need no disk (the `null` backend, no-op ranges):
    /// reported at the next reap, as if the disk had answered.
    immediate: Vec<Completion>,
    worker_id: usize,
}

impl BlockEngine {
    /// An engine over `pool`, with a ring set up by `opts` (its fixed
    /// buffers are the pool's chunks). `worker_id` names the blocking
    /// worker's thread. With `opts.wake_fd` (the caller's epoll
    /// descriptor), the caller sleeps in the ring where the kernel allows
    /// it ([`BlockEngine::sleep`]).
    pub fn new(pool: Pool, opts: UringOptions, worker_id: usize) -> Result<BlockEngine> {
        let uring = Uring::new(&[], &pool, opts)?;
        Ok(BlockEngine {
            uring,
            pool,
            blocking: None,
            rbd: None,
            new_wait_fds: Vec::new(),
            files: HashMap::default(),
            free_files: (0..opts.file_slots).rev().collect(),
            immediate: Vec::new(),
            worker_id,
        })
    }

    pub fn features(&self) -> UringFeatures {
        self.uring.features()
    }

    /// Whether completions are found only by polling (an iopoll ring).
    pub fn needs_polling(&self) -> bool {
        self.uring.needs_polling()
    }

    pub fn pool(&self) -> &Pool {
        &self.pool
    }

    pub fn pool_mut(&mut self) -> &mut Pool {
        &mut self.pool
    }

    /// The descriptors to wait on: the ring's eventfd, and the blocking
    /// worker's once it exists.
    pub fn wait_fds(&self) -> impl Iterator<Item = RawFd> + '_ {
        self.uring.eventfd().into_iter().chain(self.blocking.as_ref().map(|b| b.fd())).chain(self.rbd.as_ref().map(RbdCompletions::fd))
    }

    /// Operations not yet reported.
    pub fn inflight(&self) -> usize {
        self.uring.inflight()
            + self.blocking.as_ref().map_or(0, |b| b.inflight())
            + self.rbd.as_ref().map_or(0, RbdCompletions::inflight)
            + self.immediate.len()
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

    /// Gives `vol` its fixed-file slot now (or its new descriptor after a
    /// reload), so that a failure shows before its first command.
    pub fn attach(&mut self, vol: &Volume) -> Result<()> {
        self.slot(vol).map(drop)
    }

    /// Gives back the slot of a volume that is no longer served, after its
    /// last operation: the engine stops holding its file open.
    pub fn detach(&mut self, id: VolumeId) -> Result<()> {
        if let Some((slot, _)) = self.files.remove(&id) {
            self.free_files.push(slot);
            self.uring.set_file(slot, None)?;
        }
        Ok(())
    }

    /// The fixed-file slot of `vol`, registering it (or its new descriptor
    /// after a reload) on first use. `None`: no disk behind it.
    fn slot(&mut self, vol: &Volume) -> Result<Option<u32>> {
        let Some(fd) = vol.backend.uring_fd() else { return Ok(None) };
        if let Some((slot, known)) = self.files.get(&vol.id) {
            if Arc::ptr_eq(known, &vol.backend) {
                return Ok(Some(*slot));
            }
        }
        let slot = match self.files.remove(&vol.id) {
            Some((slot, _)) => slot,
            None => match self.free_files.pop() {
                Some(s) => s,
                None => {
                    // Every slot is taken (a front end that never detaches
                    // touched that many volumes): take one over. What was
                    // queued for it is submitted first, so that it still
                    // reaches the file it was meant for.
                    self.uring.submit()?;
                    let (&old, _) = self.files.iter().next().expect("a full table has entries");
                    self.files.remove(&old).expect("present").0
                }
            },
        };
        if let Err(e) = self.uring.set_file(slot, Some(fd)) {
            // The volume holds no slot now: the slot is free for the next.
            self.free_files.push(slot);
            return Err(e);
        }
        self.files.insert(vol.id, (slot, Arc::clone(&vol.backend)));
        Ok(Some(slot))
    }

    /// Reads `len` bytes at `offset` of `vol` into chunk `c`.
    pub fn read(&mut self, vol: &Volume, c: ChunkId, len: u32, offset: u64, tag: u64) -> Result<()> {
        if matches!(*vol.backend, Backend::Rbd(_)) {
            let buf = self.pool.bytes_mut(c)[..len as usize].as_mut_ptr();
            return self.rbd_op(vol, RbdOp::Read { buf, len: len as usize, offset }, tag);
        }
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
    pub fn write(&mut self, vol: &Volume, c: ChunkId, len: u32, offset: u64, fua: bool, tag: u64) -> Result<()> {
        if matches!(*vol.backend, Backend::Rbd(_)) {
            // FUA needs nothing more: with librbd's cache off, a write is
            // complete when the OSDs have committed it.
            let buf = self.pool.bytes(c)[..len as usize].as_ptr();
            return self.rbd_op(vol, RbdOp::Write { buf, len: len as usize, offset }, tag);
        }
        match self.slot(vol)? {
            Some(file) => self.uring.write_fixed(&mut self.pool, file, c, 0, len, offset, fua && vol.backend.needs_flush(), tag),
            None => self.immediate.push((tag, len as i32)),
        }
        Ok(())
    }

    /// Makes the completed writes of `vol` durable.
    pub fn flush(&mut self, vol: &Volume, tag: u64) -> Result<()> {
        if !vol.backend.needs_flush() {
            self.immediate.push((tag, 0));
            return Ok(());
        }
        if matches!(*vol.backend, Backend::Rbd(_)) {
            return self.rbd_op(vol, RbdOp::Flush, tag);
        }
        match self.slot(vol)? {
            Some(file) if self.uring.features().fsync => self.uring.fsync(file, tag),
            // An iopoll ring (or a kernel without the opcode): the worker does it.
            _ => self.submit_job(vol, JobKind::Fdatasync, 0, 0, tag)?,
        }
        Ok(())
    }

    /// Deallocates or zeroes `len` bytes at `offset` of `vol` the way its
    /// backend does it (`op`, from `Backend::discard` or `write_zeroes`).
    pub fn range(&mut self, vol: &Volume, op: RangeOp, offset: u64, len: u64, tag: u64) -> Result<()> {
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
            RangeOp::RbdDiscard => return self.rbd_op(vol, RbdOp::Discard { offset, len }, tag),
            RangeOp::RbdWriteZeroes => return self.rbd_op(vol, RbdOp::WriteZeroes { offset, len }, tag),
            RangeOp::Fallocate(mode) => JobKind::Fallocate(mode),
            RangeOp::BlkDiscard => JobKind::Discard,
            RangeOp::BlkZeroout => JobKind::ZeroOut,
        };
        self.submit_job(vol, kind, offset, len, tag)
    }

    /// Holds a write of `session` on the blocking worker until fault
    /// injection releases it (`crate::fault`, test builds of the system
    /// tests); its completion then says the caller may write.
    pub fn hold_write(&mut self, vol: &Volume, session: SessionId, tag: u64) -> Result<()> {
        self.submit_job(vol, JobKind::HoldWrite(session), 0, 0, tag)
    }

    /// An operation on an `rbd` volume, by this gateway's access to it:
    /// as owner, librbd aio (completed through [`RbdCompletions`]); as
    /// standby, on the blocking worker after the takeover; fenced, failed
    /// at once with `EBLOCKLISTED`, which the executor answers as NotOwner.
    fn rbd_op(&mut self, vol: &Volume, op: RbdOp, tag: u64) -> Result<()> {
        let Backend::Rbd(image) = &*vol.backend else { unreachable!("callers check the backend") };
        match image.ownership().access() {
            Access::Fenced => self.immediate.push((tag, -EBLOCKLISTED)),
            Access::Standby => self.submit_job(vol, JobKind::RbdTakeOverThen(op), 0, 0, tag)?,
            Access::Owner => {
                if self.rbd.is_none() {
                    let done = RbdCompletions::new()?;
                    self.new_wait_fds.push(done.fd());
                    self.rbd = Some(done);
                }
                let done = self.rbd.as_mut().expect("created above");
                // SAFETY: a Read or Write names the command's pool chunk,
                // which the executor holds until this tag is reaped, as for
                // the ring's fixed-buffer operations.
                if let Err(e) = unsafe { image.submit(op, done, tag) } {
                    self.immediate.push((tag, e));
                }
            }
        }
        Ok(())
    }

    fn submit_job(&mut self, vol: &Volume, kind: JobKind, offset: u64, len: u64, tag: u64) -> Result<()> {
        if self.blocking.is_none() {
            let worker = BlockingWorker::start(self.worker_id)?;
            self.new_wait_fds.push(worker.fd());
            self.blocking = Some(worker);
        }
        let job = Job { user_data: tag, kind, backend: Arc::clone(&vol.backend), offset, len };
        self.blocking.as_mut().expect("started above").submit(job);
        Ok(())
    }

    /// A wake-up descriptor started since the last call (the blocking
    /// worker's, librbd's completions'), each once: for a caller that
    /// watches [`BlockEngine::wait_fds`] in its own epoll set. Call until `None`.
    pub fn started_worker_fd(&mut self) -> Option<RawFd> {
        self.new_wait_fds.pop()
    }

    /// Hands everything queued to the kernel.
    pub fn submit(&mut self) -> Result<()> {
        self.uring.submit().map(drop)
    }

    /// Whether the caller sleeps in the ring ([`BlockEngine::sleep`])
    /// rather than on [`BlockEngine::wait_fds`].
    pub fn sleeps_in_ring(&self) -> bool {
        self.uring.features().ring_sleep
    }

    /// Submits what is queued and sleeps in one `io_uring_enter` until a
    /// disk operation completes, the caller's epoll descriptor becomes
    /// readable ([`BlockEngine::take_wake`] says so after the reap) or
    /// `timeout` passes. Only when [`BlockEngine::sleeps_in_ring`].
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

    /// Withdraws the wake poll an earlier [`BlockEngine::sleep`] left
    /// armed, for a caller about to sleep on its epoll descriptor itself:
    /// one `io_uring_enter`, which also reaps the poll's end (the kernel
    /// completes a cancelled poll before the call returns; if it has not,
    /// [`BlockEngine::wake_poll_armed`] stays true until a later reap).
    /// [`BlockEngine::take_wake`] then says whether the descriptor was
    /// readable before the withdrawal caught the poll.
    ///
    /// A poll that already fired needs no withdrawal, and its completion
    /// may be in the completion queue already: the caller was preempted
    /// by the peer its answer woke (client and reactor on one CPU), the
    /// peer's next command fired the poll meanwhile, and its task work ran
    /// on the caller's way back to user space. So the queue is reaped
    /// first (no system call) and the cancellation is entered only for a
    /// poll still armed. Returns whether it entered the kernel.
    pub fn withdraw_wake_poll(&mut self) -> Result<bool> {
        self.reap_ring_for_later();
        if !self.uring.wake_poll_armed() {
            return Ok(false);
        }
        self.uring.withdraw_wake_poll();
        let entered = self.uring.submit()? > 0;
        self.reap_ring_for_later();
        Ok(entered)
    }

    /// Reaps the ring (which is how the wake poll's end is seen) and keeps
    /// the operations' completions for the caller's next [`BlockEngine::reap`].
    fn reap_ring_for_later(&mut self) {
        let immediate = &mut self.immediate;
        self.uring.reap(&mut self.pool, |tag, res| immediate.push((tag, res)));
    }

    /// Whether the ring can receive from sockets (`UringOptions::socket_slots`;
    /// see [`Uring::arm_recv`]).
    pub fn receives(&self) -> bool {
        self.uring.receives()
    }

    /// A fixed-file slot for receives from socket `fd`, if one is free.
    pub fn register_socket(&mut self, fd: RawFd) -> Option<u32> {
        self.uring.register_socket(fd)
    }

    /// Gives a socket's slot back.
    pub fn unregister_socket(&mut self, slot: u32) {
        self.uring.unregister_socket(slot)
    }

    /// Socket receives queued or in flight: each ends a sleep in the ring.
    pub fn recvs_armed(&self) -> usize {
        self.uring.recvs_armed()
    }

    /// Queues a receive of at most `len` bytes from the socket in `slot`
    /// into `into` at `off` (a chunk is lent to the kernel meanwhile); its
    /// completion is reported by [`BlockEngine::reap`] with `tag` and ends a
    /// [`BlockEngine::sleep`]. Take the memory back with
    /// [`BlockEngine::take_recv`] once it was reported.
    pub fn arm_recv(&mut self, slot: u32, into: RecvInto, off: usize, len: usize, tag: u64) -> RecvId {
        self.uring.arm_recv(&mut self.pool, slot, into, off, len, tag)
    }

    /// Cancels a receive still in flight (its completion is reported as any).
    pub fn cancel_recv(&mut self, id: RecvId) {
        self.uring.cancel_recv(id)
    }

    /// The memory of a receive whose completion was reported.
    pub fn take_recv(&mut self, id: RecvId) -> RecvInto {
        self.uring.take_recv(id)
    }

    /// Whether the wake poll of [`BlockEngine::sleep`] is queued or
    /// waiting for its descriptor (its completion not reaped yet).
    pub fn wake_poll_armed(&self) -> bool {
        self.uring.wake_poll_armed()
    }

    /// Whether the epoll descriptor woke the last sleep (reap first).
    pub fn take_wake(&mut self) -> bool {
        self.uring.take_wake_poll_fired()
    }

    /// Clears the wake-up descriptors ([`BlockEngine::wait_fds`]) after
    /// one fired; reap afterwards, so that nothing that completed in
    /// between is missed.
    pub fn clear_wake(&mut self) {
        self.uring.clear_eventfd();
        if let Some(b) = self.blocking.as_ref() {
            b.clear_wake();
        }
        if let Some(r) = self.rbd.as_ref() {
            r.clear_wake();
        }
    }

    /// Reports every finished operation to `f` once: its tag and bytes
    /// moved, or `-errno`. No system call: cheap to call every turn.
    pub fn reap(&mut self, mut f: impl FnMut(u64, i32)) -> usize {
        let mut n = 0;
        // Drained in place: the list keeps its capacity, so that a null
        // volume's read (completed here on every command) allocates nothing.
        for (tag, res) in self.immediate.drain(..) {
            f(tag, res);
            n += 1;
        }
        n += self.uring.reap(&mut self.pool, &mut f);
        if let Some(b) = self.blocking.as_mut() {
            n += b.reap(&mut f);
        }
        if let Some(r) = self.rbd.as_mut() {
            n += r.reap(&mut f);
        }
        n
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sys::{Epoll, EventFd};
    use std::time::{Duration, Instant};

    /// An engine that sleeps in its ring, woken by an epoll set that
    /// holds one eventfd.
    fn sleeping_engine() -> (BlockEngine, Epoll, EventFd) {
        let epoll = Epoll::new().unwrap();
        let efd = EventFd::new().unwrap();
        epoll.add(efd.fd(), 7).unwrap();
        let opts = UringOptions { entries: 16, wake_fd: Some(epoll.fd()), ..Default::default() };
        let engine = BlockEngine::new(Pool::new(4096, 4096), opts, 0).unwrap();
        assert!(engine.sleeps_in_ring(), "this kernel has PollAdd and EXT_ARG");
        (engine, epoll, efd)
    }

    #[test]
    fn completions_done_without_the_kernel_are_reported_once_and_their_list_keeps_its_capacity() {
        let (mut engine, _epoll, _efd) = sleeping_engine();
        for round in 0..3u64 {
            // As a null volume's reads and a memory volume's flushes complete.
            engine.immediate.push((round, 4096));
            engine.immediate.push((round + 100, 0));
            let mut seen = Vec::new();
            assert_eq!(engine.reap(|tag, res| seen.push((tag, res))), 2);
            assert_eq!(seen, [(round, 4096), (round + 100, 0)]);
            assert_eq!(engine.reap(|tag, res| panic!("reported twice: ({tag}, {res})")), 0);
            assert!(engine.immediate.capacity() >= 2, "round {round}: the list was given away, the next push allocates");
        }
    }

    #[test]
    fn a_wake_poll_that_already_fired_is_taken_without_entering_a_cancellation() {
        let (mut engine, _epoll, efd) = sleeping_engine();
        let no_op = |tag: u64, res: i32| panic!("unexpected completion ({tag}, {res})");

        // A sleep arms the poll; nothing readable, so it is still armed
        // after the timeout, and withdrawing it takes a cancellation.
        engine.sleep(Some(Duration::from_millis(1))).unwrap();
        assert!(engine.wake_poll_armed());
        assert!(engine.withdraw_wake_poll().unwrap(), "an armed, quiet poll is cancelled");
        let start = Instant::now();
        while engine.wake_poll_armed() {
            assert_eq!(engine.reap(no_op), 0);
            assert!(start.elapsed() < Duration::from_secs(5), "the cancelled poll never ended");
        }
        assert!(!engine.take_wake(), "a cancelled poll is not a wake-up");

        // Armed again, then its descriptor becomes readable. The poll's
        // task work runs on this thread's way back from a system call (the
        // eventfd write, at the latest the sleep after it), so its
        // completion waits in the queue: the withdrawal takes it and
        // enters nothing.
        engine.sleep(Some(Duration::from_millis(1))).unwrap();
        assert!(engine.wake_poll_armed());
        efd.notify();
        std::thread::sleep(Duration::from_millis(10));
        assert!(!engine.withdraw_wake_poll().unwrap(), "a fired poll needs no cancellation");
        assert!(!engine.wake_poll_armed());
        assert!(engine.take_wake(), "the poll fired: a wake-up");
        assert_eq!(engine.reap(no_op), 0);
    }
}
