//! The io_uring engine: completion based, no futures (in the style of
//! cloud-hypervisor's and Firecracker's async I/O).
//!
//! One ring per reactor. The volume descriptors are registered as fixed
//! files in a sparse table (a reload adds and removes volumes with
//! `IORING_REGISTER_FILES_UPDATE`, the only register operation the ring
//! allows once enabled) and the whole buffer pool as fixed buffers (one
//! iovec per chunk, `buf_index` = chunk index). The ring is created disabled,
//! probed (ReadFixed, WriteFixed and Fsync are required; Fallocate is
//! optional), restricted to exactly the opcodes it uses with fixed files
//! only, and then enabled.
//!
//! Where the caller sleeps. If the caller names a descriptor to watch
//! ([`UringOptions::wake_fd`], the reactor's epoll fd) and the kernel can
//! (PollAdd in the probe, `IORING_FEAT_EXT_ARG` for a timed wait, and not
//! iopoll, whose rings cannot carry polls), the caller sleeps in the ring
//! itself: the watched descriptor takes one more fixed-file slot past the
//! volume slots, the caller arms a one-shot PollAdd on it (the *wake
//! poll*, `user_data` `WAKE_POLL`, which no operation's slab index can
//! equal) before it sleeps, and [`Uring::sleep`] submits and waits in one
//! `io_uring_enter` for a completion, with a timeout. A disk completion
//! ends the sleep, and so does the wake poll's completion when the watched
//! descriptor becomes readable. [`Uring::reap`] consumes the wake poll's
//! completion itself (callers never see it; [`Uring::take_wake_poll_fired`]
//! says it came) and re-arming is the caller's choice. A caller about to
//! sleep elsewhere may withdraw an armed wake poll
//! ([`Uring::withdraw_wake_poll`], an AsyncCancel); a withdrawn poll that
//! the cancellation caught does not count as fired. Otherwise
//! ("eventfd mode") an eventfd is registered so that the caller can block
//! on it in epoll. `UringFeatures::ring_sleep` says which mode a ring is
//! in, and its Display (logged by the daemon) names where the caller sleeps.
//!
//! A caller that serves stream sockets (NVMe/TCP queues) may also have
//! the ring receive from them ([`UringOptions::socket_slots`]): a socket
//! takes one of those fixed-file slots past the watched descriptor's
//! ([`Uring::register_socket`]), [`Uring::arm_recv`] queues one Recv into
//! memory the caller hands over for as long as the kernel may write it (a
//! buffer it owns, or a pool chunk lent to the kernel), and its
//! completion ends a sleep with the bytes in hand; [`Uring::take_recv`]
//! gives the memory back. A receive the caller no longer wants is
//! cancelled ([`Uring::cancel_recv`]) and its memory comes back with its
//! completion; at teardown every receive still waiting is cancelled and
//! waited for before its memory is freed.
//!
//! With `iopoll` (IORING_SETUP_IOPOLL, for NVMe namespaces with poll queues)
//! the ring carries only ReadFixed and WriteFixed: the kernel refuses other
//! operations on a polled ring, so the reactor runs fdatasync and fallocate
//! on its blocking worker instead, and polls the ring while reads and writes
//! are in flight.
//!
//! Callers push operations tagged with a `u64`, call [`Uring::submit`] once
//! per loop turn and [`Uring::reap`] completions. The engine keeps its own
//! table of in-flight operations: it owns the chunk while the kernel uses it,
//! resubmits the remainder of short transfers, and reports each operation
//! exactly once.

use std::collections::VecDeque;
use std::io;
use std::os::fd::RawFd;
use std::sync::Arc;
use std::time::Duration;

use io_uring::{opcode, register::Restriction, squeue, types, IoUring, Probe};

use crate::error::{Error, ErrorKind, Result};
use crate::engine::pool::{ChunkId, Pool, PoolMemory};
use crate::sys::EventFd;


/// `IORING_REGISTER_FILES_UPDATE`: the register opcode the restricted ring allows.
const REGISTER_FILES_UPDATE: u8 = 6;

/// `user_data` of the wake poll. Operations carry their slab index, a
/// `u32`, so this value is never an operation's.
const WAKE_POLL: u64 = u64::MAX;
/// `user_data` of the withdrawal of the wake poll ([`Uring::withdraw_wake_poll`]).
const WAKE_CANCEL: u64 = u64::MAX - 3;
/// `user_data` of socket receive `i` ([`Uring::arm_recv`]) is `RECV | i`,
/// of its cancellation `RECV_CANCEL | i`: above every operation's.
const RECV: u64 = 1 << 40;
const RECV_CANCEL: u64 = 2 << 40;
const RECV_INDEX: u64 = (1 << 32) - 1;

/// Whether a completion is one of the ring's own (the wake poll, socket
/// receives and cancellations) rather than an operation's, whose
/// `user_data` is a `u32` slab index.
fn is_internal(user_data: u64) -> bool {
    user_data > u64::from(u32::MAX)
}

/// An AsyncCancel of the request tagged `target`, itself tagged `tag`.
/// FIXED_FILE: the restrictions require the flag on every entry (a
/// cancellation by `user_data` takes no file and ignores it).
fn cancel_entry(target: u64, tag: u64) -> squeue::Entry {
    opcode::AsyncCancel::new(target).build().flags(squeue::Flags::FIXED_FILE).user_data(tag)
}

/// Ring options.
#[derive(Clone, Copy, Debug)]
pub struct UringOptions {
    /// Submission queue entries (rounded up to a power of two by the kernel).
    pub entries: u32,
    /// Use a kernel submission polling thread with this idle time in ms.
    pub sqpoll_idle_ms: Option<u32>,
    /// Busy-poll for completions (IORING_SETUP_IOPOLL); reads and writes only.
    pub iopoll: bool,
    /// Size of the fixed-file table (at least the number of initial files);
    /// slots beyond the initial files start empty.
    pub file_slots: u32,
    /// A descriptor (the reactor's epoll fd) whose readability should end a
    /// [`Uring::sleep`]: with it, and if the kernel supports it, the caller
    /// sleeps in the ring (`UringFeatures::ring_sleep`). The ring keeps its
    /// own reference to the file from `Uring::new` on.
    pub wake_fd: Option<RawFd>,
    /// Fixed-file slots for connected stream sockets the caller receives
    /// from through the ring ([`Uring::register_socket`],
    /// [`Uring::arm_recv`]), so that a sleep ends with the bytes already
    /// received. Only in ring-sleep mode; the ring keeps its own reference
    /// to each registered file.
    pub socket_slots: u32,
}

impl Default for UringOptions {
    fn default() -> Self {
        UringOptions { entries: 64, sqpoll_idle_ms: None, iopoll: false, file_slots: 0, wake_fd: None, socket_slots: 0 }
    }
}

/// The memory a socket receive writes into: a buffer the caller hands the
/// ring for as long as the kernel may write it, or a pool chunk (lent to
/// the kernel meanwhile). [`Uring::take_recv`] gives it back.
#[derive(Debug)]
pub enum RecvInto {
    Buf(Box<[u8]>),
    Chunk(ChunkId),
}

/// A socket receive, from [`Uring::arm_recv`] until [`Uring::take_recv`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RecvId(u32);

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum OpKind {
    Read,
    Write { dsync: bool },
    Fsync,
    Fallocate { mode: i32 },
}

#[derive(Clone, Copy, Debug)]
struct Op {
    user_data: u64,
    kind: OpKind,
    file: u32,
    chunk: Option<ChunkId>,
    buf_off: u32,
    len: u64,
    offset: u64,
    done: u64,
}

/// What the kernel supports, from the probe, and how the ring was set up.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct UringFeatures {
    /// IORING_OP_FALLOCATE exists (and the ring carries it: not with iopoll).
    pub fallocate: bool,
    /// Fsync rides on the ring (not with iopoll).
    pub fsync: bool,
    /// The ring was set up with a submission polling thread.
    pub sqpoll: bool,
    /// The ring was set up with IORING_SETUP_IOPOLL.
    pub iopoll: bool,
    /// The caller sleeps in the ring ([`Uring::sleep`], woken by the wake
    /// poll on `UringOptions::wake_fd`), and the ring carries PollAdd; else
    /// it blocks in epoll on the ring's eventfd ([`Uring::eventfd`]).
    pub ring_sleep: bool,
}

impl std::fmt::Display for UringFeatures {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "read_fixed write_fixed{}{}{}{}{}; {}",
            if self.fsync { " fsync" } else { "" },
            if self.fallocate { " fallocate" } else { "" },
            if self.ring_sleep { " poll_add" } else { "" },
            if self.sqpoll { " sqpoll" } else { "" },
            if self.iopoll { " iopoll" } else { "" },
            if self.ring_sleep { "sleeps in io_uring_enter" } else { "sleeps in epoll_wait (ring eventfd)" }
        )
    }
}

/// One io_uring instance with fixed files and fixed buffers.
pub struct Uring {
    // Field order matters: the ring is closed (after `Drop` waited for every
    // in-flight op) before the pool memory can be freed.
    ring: IoUring,
    /// Registered in eventfd mode only (not `features.ring_sleep`).
    eventfd: Option<EventFd>,
    ops: Vec<Option<Op>>,
    free_ops: Vec<u32>,
    inflight: usize,
    backlog: VecDeque<squeue::Entry>,
    cqes: Vec<(u64, i32)>,
    pending_fail: Vec<(u32, i32)>,
    nfiles: u32,
    features: UringFeatures,
    /// The wake poll's SQE was queued and its completion not reaped yet.
    wake_poll_armed: bool,
    /// The wake poll's completion was reaped and not yet taken by
    /// [`Uring::take_wake_poll_fired`].
    wake_poll_fired: bool,
    /// A failed wake poll was logged (once: the caller may re-arm it on
    /// every turn).
    wake_poll_failure_logged: bool,
    /// The wake poll's withdrawal was queued and the poll's completion not
    /// reaped yet.
    wake_poll_withdrawn: bool,
    /// Socket receives, by index (`RecvId`), until taken back.
    recvs: Vec<Option<SocketRecv>>,
    /// The caller's tag of each receive, by index.
    recv_tags: Vec<u64>,
    free_recvs: Vec<u32>,
    /// Receives queued or in flight.
    recvs_inflight: usize,
    /// The first fixed-file slot for sockets, and the free ones.
    socket_base: u32,
    socket_slots: u32,
    free_sockets: Vec<u32>,
    mem: Arc<PoolMemory>,
}

/// A receive from a registered socket into memory the ring holds until the
/// kernel is done with it.
struct SocketRecv {
    /// Written by the kernel while `inflight`; never moved or freed before
    /// the receive completed (`wait_idle` cancels it and waits).
    into: RecvInto,
    inflight: bool,
}

fn uring_err(what: &str, e: io::Error) -> Error {
    let hint = match e.raw_os_error() {
        Some(libc::ENOMEM) => {
            " (registered buffers count against RLIMIT_MEMLOCK, shared by every process of this user: raise it with \
             `ulimit -l unlimited` in the shell that starts rdmablk-target, or LimitMEMLOCK=infinity in its systemd unit)"
        }
        Some(libc::EPERM) => " (io_uring may be disabled: check kernel.io_uring_disabled)",
        Some(libc::ENOSYS) => " (this kernel has no io_uring)",
        _ => "",
    };
    Error::with_source(ErrorKind::Uring, format!("io_uring: {what}{hint}"), e)
}

impl Uring {
    /// Creates, probes, registers, restricts and enables a ring.
    pub fn new(files: &[RawFd], pool: &Pool, opts: UringOptions) -> Result<Uring> {
        let mut builder = IoUring::builder();
        builder.setup_r_disabled();
        builder.setup_cqsize(opts.entries.saturating_mul(4).max(64));
        if let Some(idle) = opts.sqpoll_idle_ms {
            builder.setup_sqpoll(idle);
        }
        if opts.iopoll {
            builder.setup_iopoll();
        }
        let ring = builder.build(opts.entries).map_err(|e| uring_err("cannot create ring", e))?;
        let submitter = ring.submitter();

        let mut probe = Probe::new();
        submitter.register_probe(&mut probe).map_err(|e| uring_err("probe failed", e))?;
        let required = [
            (opcode::ReadFixed::CODE, "READ_FIXED"),
            (opcode::WriteFixed::CODE, "WRITE_FIXED"),
            (opcode::Fsync::CODE, "FSYNC"),
        ];
        let missing: Vec<&str> = required.iter().filter(|(c, _)| !probe.is_supported(*c)).map(|(_, n)| *n).collect();
        if !missing.is_empty() {
            return Err(Error::new(
                ErrorKind::Uring,
                format!("io_uring: this kernel lacks required opcodes {}; a kernel >= 5.6 is needed", missing.join(", ")),
            ));
        }
        // Polls cannot ride on an IOPOLL ring, and a sleep with a timeout
        // needs IORING_ENTER_EXT_ARG (5.11).
        let ring_sleep = opts.wake_fd.is_some()
            && !opts.iopoll
            && probe.is_supported(opcode::PollAdd::CODE)
            && ring.params().is_feature_ext_arg();
        let features = UringFeatures {
            fallocate: probe.is_supported(opcode::Fallocate::CODE) && !opts.iopoll,
            fsync: !opts.iopoll,
            sqpoll: opts.sqpoll_idle_ms.is_some(),
            iopoll: opts.iopoll,
            ring_sleep,
        };

        // A sparse table: empty slots are -1, filled in later by `set_file`.
        // In ring-sleep mode one more slot, `nfiles`, holds the watched
        // descriptor; `set_file` cannot reach it.
        let nfiles = opts.file_slots.max(files.len() as u32);
        let wake_fd = opts.wake_fd.filter(|_| ring_sleep);
        // Sockets take the slots after the watched descriptor's.
        let socket_slots = if ring_sleep && probe.is_supported(opcode::Recv::CODE) { opts.socket_slots } else { 0 };
        let socket_base = nfiles + wake_fd.is_some() as u32;
        let table_len = socket_base + socket_slots;
        if table_len > 0 {
            let mut table = vec![-1; table_len as usize];
            table[..files.len()].copy_from_slice(files);
            if let Some(fd) = wake_fd {
                table[nfiles as usize] = fd;
            }
            submitter.register_files(&table).map_err(|e| uring_err("cannot register files", e))?;
        }
        let mem = Arc::clone(pool.memory());
        let iovecs = mem.iovecs();
        // SAFETY: every iovec lies within the pool memory, which this `Uring`
        // keeps alive through `mem` until the ring is closed after all ops
        // completed (see `Drop`).
        unsafe { submitter.register_buffers(&iovecs) }.map_err(|e| {
            let bytes: usize = iovecs.iter().map(|v| v.iov_len).sum();
            uring_err(&format!("cannot register the buffer pool ({bytes} bytes)"), e)
        })?;
        let eventfd = if ring_sleep {
            None
        } else {
            let eventfd = EventFd::new().map_err(|e| uring_err("cannot create eventfd", e))?;
            submitter.register_eventfd(eventfd.fd()).map_err(|e| uring_err("cannot register eventfd", e))?;
            Some(eventfd)
        };

        let mut restrictions = vec![
            Restriction::sqe_op(opcode::ReadFixed::CODE),
            Restriction::sqe_op(opcode::WriteFixed::CODE),
            Restriction::sqe_flags_required(squeue::Flags::FIXED_FILE.bits()),
            Restriction::register_op(REGISTER_FILES_UPDATE),
        ];
        if features.fsync {
            restrictions.push(Restriction::sqe_op(opcode::Fsync::CODE));
        }
        if features.fallocate {
            restrictions.push(Restriction::sqe_op(opcode::Fallocate::CODE));
        }
        if features.ring_sleep {
            // AsyncCancel withdraws the wake poll, and cancels the socket
            // receive at teardown.
            restrictions.push(Restriction::sqe_op(opcode::PollAdd::CODE));
            restrictions.push(Restriction::sqe_op(opcode::AsyncCancel::CODE));
        }
        if socket_slots > 0 {
            restrictions.push(Restriction::sqe_op(opcode::Recv::CODE));
        }
        submitter.register_restrictions(&mut restrictions).map_err(|e| uring_err("cannot register restrictions", e))?;
        submitter.register_enable_rings().map_err(|e| uring_err("cannot enable ring", e))?;

        Ok(Uring {
            ring,
            eventfd,
            ops: Vec::new(),
            free_ops: Vec::new(),
            inflight: 0,
            backlog: VecDeque::new(),
            cqes: Vec::with_capacity(64),
            pending_fail: Vec::new(),
            nfiles,
            features,
            wake_poll_armed: false,
            wake_poll_fired: false,
            wake_poll_failure_logged: false,
            wake_poll_withdrawn: false,
            recvs: Vec::new(),
            recv_tags: Vec::new(),
            free_recvs: Vec::new(),
            recvs_inflight: 0,
            socket_base,
            socket_slots,
            free_sockets: (socket_base..socket_base + socket_slots).rev().collect(),
            mem,
        })
    }

    /// What the kernel supports.
    pub fn features(&self) -> UringFeatures {
        self.features
    }

    /// Size of the fixed-file table.
    pub fn file_slots(&self) -> u32 {
        self.nfiles
    }

    /// Points fixed-file slot `slot` at `fd`, or empties it (`None`).
    /// Operations already submitted keep the file they started with.
    pub fn set_file(&mut self, slot: u32, fd: Option<RawFd>) -> Result<()> {
        assert!(slot < self.nfiles, "fixed file slot {slot} outside the table of {}", self.nfiles);
        let fds = [fd.unwrap_or(-1)];
        self.ring
            .submitter()
            .register_files_update(slot, &fds)
            .map_err(|e| uring_err(&format!("cannot update fixed file slot {slot}"), e))?;
        Ok(())
    }

    /// Whether the ring must be polled for completions (iopoll) rather than
    /// waited on (through its eventfd or in [`Uring::sleep`]).
    pub fn needs_polling(&self) -> bool {
        self.features.iopoll && self.inflight > 0
    }

    /// The registered eventfd, readable when completions were posted; only
    /// in eventfd mode (`None` when the caller sleeps in the ring).
    pub fn eventfd(&self) -> Option<RawFd> {
        self.eventfd.as_ref().map(EventFd::fd)
    }

    /// Clears the eventfd. Call before reaping so no wake-up is lost.
    pub fn clear_eventfd(&self) {
        if let Some(e) = &self.eventfd {
            e.drain();
        }
    }

    /// Whether the wake poll is queued or waiting for its descriptor, its
    /// completion not reaped yet.
    pub fn wake_poll_armed(&self) -> bool {
        self.wake_poll_armed
    }

    /// Queues the wake poll: a one-shot POLLIN on the watched descriptor,
    /// whose completion ends a [`Uring::sleep`] once the descriptor is
    /// readable (at once if it already is). It is submitted with the next
    /// `submit` or `sleep`. Only in ring-sleep mode and when not armed.
    pub fn arm_wake_poll(&mut self) {
        assert!(self.features.ring_sleep, "wake poll on a ring without ring sleep");
        assert!(!self.wake_poll_armed, "wake poll armed twice");
        // The slot past the volume slots, filled in `new`.
        let entry = opcode::PollAdd::new(types::Fixed(self.nfiles), libc::POLLIN as u32).build().user_data(WAKE_POLL);
        self.wake_poll_armed = true;
        self.push(entry);
    }

    /// Withdraws the armed wake poll: queues its cancellation, submitted
    /// with the next `submit` or `sleep`. The poll's completion is reaped
    /// as usual (until then [`Uring::wake_poll_armed`] stays true); if the
    /// cancellation caught it, it does not count as fired, and if the
    /// watched descriptor became readable first, it does. For a caller
    /// that is about to sleep on the watched descriptor itself: a poll
    /// left armed there would fire at its next readiness anyway, through
    /// a poll wake-up and task work that the waker pays for. Nothing to do
    /// when the wake poll is not armed or already withdrawn.
    pub fn withdraw_wake_poll(&mut self) {
        if !self.wake_poll_armed || self.wake_poll_withdrawn {
            return;
        }
        self.wake_poll_withdrawn = true;
        self.push(cancel_entry(WAKE_POLL, WAKE_CANCEL));
    }

    /// Whether the wake poll's completion was reaped since the last call:
    /// the watched descriptor became readable (or the poll failed, which
    /// the caller cannot tell from a spurious wake-up either). Clears it.
    pub fn take_wake_poll_fired(&mut self) -> bool {
        std::mem::take(&mut self.wake_poll_fired)
    }

    /// Whether the ring can receive from sockets (`socket_slots`, and a
    /// kernel with ring sleep and the Recv opcode).
    pub fn receives(&self) -> bool {
        self.socket_slots > 0
    }

    /// Gives socket `fd` a fixed-file slot for receives; `None` when every
    /// slot is taken (or the ring does not receive): the caller reads the
    /// socket itself. The ring keeps its own reference to the file until
    /// [`Uring::unregister_socket`] and the last receive on it completed.
    pub fn register_socket(&mut self, fd: RawFd) -> Option<u32> {
        let slot = self.free_sockets.pop()?;
        match self.ring.submitter().register_files_update(slot, &[fd]) {
            Ok(_) => Some(slot),
            Err(e) => {
                tracing::warn!("io_uring: cannot register a socket in fixed file slot {slot}: {e}");
                self.free_sockets.push(slot);
                None
            }
        }
    }

    /// Gives a socket's slot back (a receive still in flight keeps the
    /// file it started with).
    pub fn unregister_socket(&mut self, slot: u32) {
        if let Err(e) = self.ring.submitter().register_files_update(slot, &[-1]) {
            tracing::warn!("io_uring: cannot empty fixed file slot {slot}: {e}");
        }
        self.free_sockets.push(slot);
    }

    /// Socket receives queued or in flight.
    pub fn recvs_armed(&self) -> usize {
        self.recvs_inflight
    }

    /// Queues a receive of at most `len` bytes from the socket in fixed
    /// slot `slot` into `into` at `off`; its completion is reported by
    /// [`Uring::reap`] with `user_data` (which must not be a `u32`
    /// operation index: the caller's own tag space) and ends a
    /// [`Uring::sleep`]. The memory is the ring's until
    /// [`Uring::take_recv`]. Submitted with the next `submit` or `sleep`.
    pub fn arm_recv(&mut self, pool: &mut Pool, slot: u32, into: RecvInto, off: usize, len: usize, user_data: u64) -> RecvId {
        assert!(slot >= self.socket_base, "slot {slot} is not a socket's");
        assert!(is_internal(user_data) && user_data & RECV_INDEX != user_data, "a receive's tag must not look like an operation's");
        match &into {
            RecvInto::Buf(b) => assert!(len > 0 && off + len <= b.len(), "receive outside its buffer"),
            RecvInto::Chunk(c) => {
                assert!(Arc::ptr_eq(pool.memory(), &self.mem), "pool not registered with this ring");
                assert!(len > 0 && off + len <= self.mem.chunk_size(), "receive outside its chunk");
                pool.lend_to_kernel(*c);
            }
        }
        let idx = match self.free_recvs.pop() {
            Some(i) => i,
            None => {
                self.recvs.push(None);
                (self.recvs.len() - 1) as u32
            }
        };
        // Stored first, the pointer taken where the memory stays until the
        // receive completed.
        let r = self.recvs[idx as usize].insert(SocketRecv { into, inflight: true });
        let ptr = match &mut r.into {
            // SAFETY: off + len lies within the buffer (checked above).
            RecvInto::Buf(b) => unsafe { b.as_mut_ptr().add(off) },
            // SAFETY: off + len lies within the chunk (checked above), which
            // is lent to the kernel until the receive completed.
            RecvInto::Chunk(c) => unsafe { self.mem.chunk_ptr(*c).add(off) },
        };
        self.recvs_inflight += 1;
        // The caller's tag is kept beside the entry: the CQE carries RECV | idx.
        self.recv_tags_set(idx, user_data);
        let entry = opcode::Recv::new(types::Fixed(slot), ptr, len as u32).build().user_data(RECV | idx as u64);
        self.push(entry);
        RecvId(idx)
    }

    /// Cancels receive `id` if it is still in flight: its completion (with
    /// `-ECANCELED`, or the bytes if they came first) is reported as any.
    pub fn cancel_recv(&mut self, id: RecvId) {
        if self.recvs.get(id.0 as usize).and_then(|r| r.as_ref()).is_some_and(|r| r.inflight) {
            self.push(cancel_entry(RECV | id.0 as u64, RECV_CANCEL | id.0 as u64));
        }
    }

    /// The memory of receive `id` back, once its completion was reported
    /// (a chunk is the CPU's again). Panics while it is in flight.
    pub fn take_recv(&mut self, id: RecvId) -> RecvInto {
        let r = self.recvs[id.0 as usize].take().expect("a live receive");
        assert!(!r.inflight, "receive taken while in flight");
        self.free_recvs.push(id.0);
        r.into
    }

    /// Operations pushed and not yet reaped.
    pub fn inflight(&self) -> usize {
        self.inflight
    }

    /// Reads `len` bytes at `offset` of fixed file `file` into chunk `chunk`
    /// at `buf_off`. The chunk is lent to the kernel until the completion is reaped.
    #[allow(clippy::too_many_arguments)]
    pub fn read_fixed(&mut self, pool: &mut Pool, file: u32, chunk: ChunkId, buf_off: u32, len: u32, offset: u64, user_data: u64) {
        self.rw(pool, OpKind::Read, file, chunk, buf_off, len, offset, user_data)
    }

    /// Writes `len` bytes from chunk `chunk` at `buf_off` to `offset` of fixed
    /// file `file`, with RWF_DSYNC if `dsync`.
    #[allow(clippy::too_many_arguments)]
    pub fn write_fixed(
        &mut self,
        pool: &mut Pool,
        file: u32,
        chunk: ChunkId,
        buf_off: u32,
        len: u32,
        offset: u64,
        dsync: bool,
        user_data: u64,
    ) {
        self.rw(pool, OpKind::Write { dsync }, file, chunk, buf_off, len, offset, user_data)
    }

    /// fdatasync of fixed file `file`. Not on an iopoll ring.
    pub fn fsync(&mut self, file: u32, user_data: u64) {
        assert!(file < self.nfiles, "fixed file {file} not registered");
        assert!(self.features.fsync, "fsync on a ring that does not carry it");
        let op = Op { user_data, kind: OpKind::Fsync, file, chunk: None, buf_off: 0, len: 0, offset: 0, done: 0 };
        self.start(op);
    }

    /// fallocate of fixed file `file` with `mode` (`backend::PUNCH_HOLE`, `backend::ZERO_RANGE`).
    /// Completes with `-EOPNOTSUPP` if the kernel has no Fallocate opcode.
    pub fn fallocate(&mut self, file: u32, mode: i32, offset: u64, len: u64, user_data: u64) {
        assert!(file < self.nfiles, "fixed file {file} not registered");
        let op = Op { user_data, kind: OpKind::Fallocate { mode }, file, chunk: None, buf_off: 0, len, offset, done: 0 };
        self.start(op);
    }

    #[allow(clippy::too_many_arguments)]
    fn rw(&mut self, pool: &mut Pool, kind: OpKind, file: u32, chunk: ChunkId, buf_off: u32, len: u32, offset: u64, user_data: u64) {
        assert!(Arc::ptr_eq(pool.memory(), &self.mem), "pool not registered with this ring");
        assert!(file < self.nfiles, "fixed file {file} not registered");
        assert!(len > 0 && buf_off as usize + len as usize <= self.mem.chunk_size(), "transfer outside the chunk");
        pool.lend_to_kernel(chunk);
        let op = Op { user_data, kind, file, chunk: Some(chunk), buf_off, len: len as u64, offset, done: 0 };
        self.start(op);
    }

    fn start(&mut self, op: Op) {
        if matches!(op.kind, OpKind::Fallocate { .. }) && !self.features.fallocate {
            // Callers use the blocking worker on iopoll rings; this is for
            // kernels without the opcode.
            // Report through the completion path like any other failure.
            let idx = self.insert(op);
            self.inflight += 1;
            self.pending_fail.push((idx, -libc::EOPNOTSUPP));
            return;
        }
        let idx = self.insert(op);
        self.inflight += 1;
        self.push_entry(idx);
    }

    fn insert(&mut self, op: Op) -> u32 {
        match self.free_ops.pop() {
            Some(i) => {
                self.ops[i as usize] = Some(op);
                i
            }
            None => {
                self.ops.push(Some(op));
                (self.ops.len() - 1) as u32
            }
        }
    }

    fn entry(&self, idx: u32) -> squeue::Entry {
        let op = self.ops[idx as usize].expect("live op");
        let fd = types::Fixed(op.file);
        let rest = op.len - op.done;
        let entry = match op.kind {
            OpKind::Read | OpKind::Write { .. } => {
                let chunk = op.chunk.expect("rw op has a chunk");
                // SAFETY: buf_off + len lies within the chunk (checked in `rw`),
                // and `done < len`, so the pointer stays inside the chunk.
                let ptr = unsafe { self.mem.chunk_ptr(chunk).add(op.buf_off as usize + op.done as usize) };
                if op.kind == OpKind::Read {
                    opcode::ReadFixed::new(fd, ptr, rest as u32, chunk.0).offset(op.offset + op.done).build()
                } else {
                    let flags = if op.kind == (OpKind::Write { dsync: true }) { libc::RWF_DSYNC } else { 0 };
                    opcode::WriteFixed::new(fd, ptr, rest as u32, chunk.0).offset(op.offset + op.done).rw_flags(flags).build()
                }
            }
            OpKind::Fsync => opcode::Fsync::new(fd).flags(types::FsyncFlags::DATASYNC).build(),
            OpKind::Fallocate { mode } => opcode::Fallocate::new(fd, op.len).offset(op.offset).mode(mode).build(),
        };
        entry.user_data(idx as u64)
    }

    fn push_entry(&mut self, idx: u32) {
        let entry = self.entry(idx);
        self.push(entry);
    }

    /// Queues an entry built by `entry` or `arm_wake_poll`, behind the backlog.
    fn push(&mut self, entry: squeue::Entry) {
        if !self.backlog.is_empty() {
            self.backlog.push_back(entry);
            return;
        }
        // SAFETY: the buffer the entry points to (if any) is a chunk of the
        // registered pool memory kept alive by `self.mem`, lent to the kernel
        // until the op's final completion is reaped, or a socket receive's
        // buffer or chunk, which `self` holds (`recvs`) until the receive
        // completed (`take_recv` refuses earlier, `wait_idle` waits); the
        // wake poll points to no memory; fixed files stay registered for
        // the ring's lifetime, and an op keeps the file it started with.
        if unsafe { self.ring.submission().push(&entry) }.is_err() {
            let _ = self.ring.submit();
            // SAFETY: as above.
            if unsafe { self.ring.submission().push(&entry) }.is_err() {
                self.backlog.push_back(entry);
            }
        }
    }

    /// Moves backlog entries into the submission queue while it has room.
    fn fill_from_backlog(&mut self) {
        while let Some(entry) = self.backlog.front() {
            // SAFETY: see `push`; backlog entries were built the same way.
            if unsafe { self.ring.submission().push(entry) }.is_err() {
                break;
            }
            self.backlog.pop_front();
        }
    }

    /// Submits everything pushed since the last call. Returns how many
    /// entries the kernel consumed.
    pub fn submit(&mut self) -> Result<usize> {
        self.fill_from_backlog();
        // Nothing queued: no io_uring_enter (an iopoll ring still needs one
        // to find its completions).
        if self.ring.submission().is_empty() && !self.needs_polling() {
            return Ok(0);
        }
        match self.ring.submit() {
            Ok(n) => Ok(n),
            Err(e) if matches!(e.raw_os_error(), Some(libc::EBUSY | libc::EAGAIN | libc::EINTR)) => Ok(0),
            Err(e) => Err(uring_err("submit failed", e)),
        }
    }

    /// Submits everything queued and sleeps until a completion is in the
    /// completion queue (one posted before the call counts: the kernel
    /// checks before it sleeps) or `timeout` passed (`None`: no limit), in
    /// one `io_uring_enter`. A signal or a full completion queue also ends
    /// it early; the caller reaps either way. Only in ring-sleep mode; arm
    /// the wake poll first if the watched descriptor should end the sleep.
    pub fn sleep(&mut self, timeout: Option<Duration>) -> Result<()> {
        assert!(self.features.ring_sleep, "sleep on a ring without ring sleep");
        self.fill_from_backlog();
        if !self.backlog.is_empty() {
            // The submission queue is full, and the wake poll may still be
            // in the backlog: submit without sleeping, the caller comes back.
            return self.submit().map(drop);
        }
        let submitter = self.ring.submitter();
        let ts = timeout.map(types::Timespec::from);
        let r = match &ts {
            Some(ts) => submitter.submit_with_args(1, &types::SubmitArgs::new().timespec(ts)),
            None => submitter.submit_with_args(1, &types::SubmitArgs::new()),
        };
        match r {
            Ok(_) => Ok(()),
            // ETIME: the timeout passed; EINTR: a signal; EBUSY/EAGAIN: the
            // completion queue is full (or the kernel is short of memory),
            // which reaping resolves.
            Err(e) if matches!(e.raw_os_error(), Some(libc::ETIME | libc::EINTR | libc::EBUSY | libc::EAGAIN)) => Ok(()),
            Err(e) => Err(uring_err("sleep failed", e)),
        }
    }

    /// Reaps completions: calls `f(user_data, result)` once per finished
    /// operation, where `result` is the total bytes transferred (reads and
    /// writes) or 0, or a negative errno. Short transfers are resubmitted and
    /// not reported; a read that hits end of file reports `-EIO`.
    /// Returns how many operations were reported.
    pub fn reap(&mut self, pool: &mut Pool, mut f: impl FnMut(u64, i32)) -> usize {
        let mut reported = 0;
        for (idx, res) in std::mem::take(&mut self.pending_fail) {
            reported += 1;
            let op = self.finish(idx, pool);
            f(op.user_data, res);
        }
        loop {
            self.cqes.clear();
            self.cqes.extend(self.ring.completion().map(|c| (c.user_data(), c.result())));
            if self.cqes.is_empty() {
                break;
            }
            for i in 0..self.cqes.len() {
                let (user_data, res) = self.cqes[i];
                if user_data == WAKE_POLL {
                    self.wake_poll_reaped(res);
                    continue;
                }
                if user_data & !RECV_INDEX == RECV {
                    let idx = (user_data & RECV_INDEX) as u32;
                    let tag = self.recv_finished(idx, pool);
                    reported += 1;
                    f(tag, res);
                    continue;
                }
                if is_internal(user_data) {
                    // RECV_CANCEL, WAKE_CANCEL: their target's completion says it all.
                    continue;
                }
                let idx = user_data as u32;
                let op = self.ops[idx as usize].as_mut().expect("completion for a live op");
                let is_rw = matches!(op.kind, OpKind::Read | OpKind::Write { .. });
                let result = if res < 0 {
                    res
                } else if is_rw {
                    op.done += res as u64;
                    if op.done < op.len {
                        if res == 0 {
                            -libc::EIO
                        } else {
                            self.push_entry(idx);
                            continue;
                        }
                    } else {
                        op.done as i32
                    }
                } else {
                    res
                };
                let op = self.finish(idx, pool);
                reported += 1;
                f(op.user_data, result);
            }
        }
        reported
    }

    /// The wake poll's completion: a mask of ready events, or an error
    /// (-ECANCELED when withdrawn or when the ring is torn down).
    fn wake_poll_reaped(&mut self, res: i32) {
        self.wake_poll_armed = false;
        let withdrawn = std::mem::take(&mut self.wake_poll_withdrawn);
        if withdrawn && res == -libc::ECANCELED {
            return;
        }
        self.wake_poll_fired = true;
        if res < 0 && res != -libc::ECANCELED && !self.wake_poll_failure_logged {
            self.wake_poll_failure_logged = true;
            tracing::warn!(
                "io_uring: wake poll failed ({}); while it fails, a sleep ends at once when the poll is re-armed",
                io::Error::from_raw_os_error(-res)
            );
        }
    }

    /// Receive `idx` completed: its memory is the caller's to take back
    /// (a chunk the CPU's again). Returns the caller's tag.
    fn recv_finished(&mut self, idx: u32, pool: &mut Pool) -> u64 {
        let r = self.recvs[idx as usize].as_mut().expect("a live receive");
        r.inflight = false;
        self.recvs_inflight -= 1;
        if let RecvInto::Chunk(c) = r.into {
            pool.return_from_kernel(c);
        }
        self.recv_tags[idx as usize]
    }

    fn recv_tags_set(&mut self, idx: u32, tag: u64) {
        if self.recv_tags.len() <= idx as usize {
            self.recv_tags.resize(idx as usize + 1, 0);
        }
        self.recv_tags[idx as usize] = tag;
    }

    fn finish(&mut self, idx: u32, pool: &mut Pool) -> Op {
        let op = self.ops[idx as usize].take().expect("live op");
        self.free_ops.push(idx);
        self.inflight -= 1;
        if let Some(c) = op.chunk {
            pool.return_from_kernel(c);
        }
        op
    }

    /// Blocks until every in-flight operation completed, discarding results
    /// (chunks stay marked as lent: only for teardown). The wake poll is not
    /// an operation: it is not waited for (it may never fire; closing the
    /// ring cancels it), and its completion, if it comes, is skipped.
    fn wait_idle(&mut self) {
        let mut stuck_rounds = 0;
        // A receive may wait for its peer forever: cancel each, and wait
        // below until the kernel is done with its memory.
        for idx in 0..self.recvs.len() {
            if self.recvs[idx].as_ref().is_some_and(|r| r.inflight) {
                self.push(cancel_entry(RECV | idx as u64, RECV_CANCEL | idx as u64));
            }
        }
        while self.inflight > 0 || self.recvs_inflight > 0 {
            while let Some(entry) = self.backlog.pop_front() {
                // SAFETY: see `push`.
                if unsafe { self.ring.submission().push(&entry) }.is_err() {
                    self.backlog.push_front(entry);
                    break;
                }
            }
            let pending: Vec<_> = std::mem::take(&mut self.pending_fail);
            for (idx, _) in pending {
                self.ops[idx as usize] = None;
                self.inflight -= 1;
            }
            if self.inflight == 0 && self.recvs_inflight == 0 {
                break;
            }
            if let Err(e) = self.ring.submit_and_wait(1) {
                if e.raw_os_error() != Some(libc::EINTR) {
                    stuck_rounds += 1;
                    if stuck_rounds > 1000 {
                        // Leaking is the only safe option left: the kernel may still
                        // write into the pool or a receive buffer, so the memory
                        // must never be freed.
                        tracing::error!("io_uring teardown failed ({e}); leaking the ring and its buffers");
                        std::mem::forget(Arc::clone(&self.mem));
                        std::mem::forget(std::mem::take(&mut self.recvs));
                        return;
                    }
                }
            }
            let cqes: Vec<(u64, i32)> = self.ring.completion().map(|c| (c.user_data(), c.result())).collect();
            for (idx, res) in cqes {
                if idx == WAKE_POLL {
                    self.wake_poll_armed = false;
                    self.wake_poll_withdrawn = false;
                    continue;
                }
                if idx & !RECV_INDEX == RECV {
                    if let Some(r) = self.recvs.get_mut((idx & RECV_INDEX) as usize).and_then(|r| r.as_mut()) {
                        r.inflight = false;
                        self.recvs_inflight -= 1;
                    }
                    continue;
                }
                if is_internal(idx) {
                    continue;
                }
                let Some(op) = self.ops[idx as usize].as_mut() else { continue };
                let is_rw = matches!(op.kind, OpKind::Read | OpKind::Write { .. });
                if res > 0 && is_rw && op.done + (res as u64) < op.len {
                    op.done += res as u64;
                    let idx = idx as u32;
                    self.push_entry(idx);
                    continue;
                }
                self.ops[idx as usize] = None;
                self.inflight -= 1;
            }
        }
    }
}

impl Drop for Uring {
    fn drop(&mut self) {
        self.wait_idle();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::{PUNCH_HOLE, ZERO_RANGE};
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::{FileExt, MetadataExt, OpenOptionsExt};

    fn odirect_file(len: u64) -> (tempfile::TempPath, std::fs::File) {
        let tmp = tempfile::NamedTempFile::new_in("/tmp").unwrap();
        let path = tmp.into_temp_path();
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_DIRECT)
            .open(&path)
            .unwrap();
        f.set_len(len).unwrap();
        (path, f)
    }

    fn opts() -> UringOptions {
        UringOptions { entries: 16, ..Default::default() }
    }

    fn wait_all(ring: &mut Uring, pool: &mut Pool, want: usize) -> Vec<(u64, i32)> {
        let mut got = Vec::new();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while got.len() < want {
            ring.submit().unwrap();
            ring.reap(pool, |u, r| got.push((u, r)));
            assert!(std::time::Instant::now() < deadline, "timed out waiting for completions");
            std::thread::yield_now();
        }
        got.sort();
        got
    }

    #[test]
    fn fixed_read_write_roundtrip_odirect() {
        let (path, file) = odirect_file(1 << 20);
        let mut pool = Pool::new(4 * 65536, 65536);
        let mut ring = Uring::new(&[file.as_raw_fd()], &pool, opts()).unwrap();

        let a = pool.alloc().unwrap();
        let b = pool.alloc().unwrap();
        for (i, x) in pool.bytes_mut(a).iter_mut().enumerate() {
            *x = (i % 251) as u8;
        }
        ring.write_fixed(&mut pool, 0, a, 0, 65536, 8192, false, 1);
        assert!(!pool.is_held(a), "lent to the kernel while in flight");
        let got = wait_all(&mut ring, &mut pool, 1);
        assert_eq!(got, vec![(1, 65536)]);
        assert!(pool.is_held(a));
        ring.write_fixed(&mut pool, 0, a, 4096, 4096, 262144, true, 2);
        assert_eq!(wait_all(&mut ring, &mut pool, 1), vec![(2, 4096)]);

        ring.read_fixed(&mut pool, 0, b, 0, 65536, 8192, 3);
        let got = wait_all(&mut ring, &mut pool, 1);
        assert_eq!(got, vec![(3, 65536)]);
        assert_eq!(pool.bytes(a), pool.bytes(b));

        // What the file holds, read without O_DIRECT.
        let plain = std::fs::File::open(&path).unwrap();
        let mut buf = vec![0u8; 4096];
        plain.read_exact_at(&mut buf, 262144).unwrap();
        assert_eq!(&buf[..], &pool.bytes(a)[4096..8192]);

        // Reading past the end of the file reports EIO (short read with no progress).
        ring.read_fixed(&mut pool, 0, b, 0, 4096, 1 << 20, 4);
        let got = wait_all(&mut ring, &mut pool, 1);
        assert_eq!(got, vec![(4, -libc::EIO)]);

        assert_eq!(ring.inflight(), 0);
        pool.release(a);
        pool.release(b);
    }

    #[test]
    fn fsync_and_punch_hole() {
        let (path, file) = odirect_file(1 << 20);
        let mut pool = Pool::new(65536, 65536);
        let mut ring = Uring::new(&[file.as_raw_fd()], &pool, opts()).unwrap();
        let c = pool.alloc().unwrap();
        pool.bytes_mut(c).fill(0x5a);
        ring.write_fixed(&mut pool, 0, c, 0, 65536, 0, false, 1);
        wait_all(&mut ring, &mut pool, 1);
        ring.write_fixed(&mut pool, 0, c, 0, 65536, 65536, false, 2);
        wait_all(&mut ring, &mut pool, 1);
        ring.fsync(0, 3);
        assert_eq!(wait_all(&mut ring, &mut pool, 1), vec![(3, 0)]);
        let blocks_before = std::fs::metadata(&path).unwrap().blocks();
        assert!(blocks_before >= 256, "{blocks_before}");

        assert!(ring.features().fallocate);
        ring.fallocate(0, PUNCH_HOLE, 0, 65536, 4);
        ring.fallocate(0, ZERO_RANGE, 65536, 4096, 5);
        assert_eq!(wait_all(&mut ring, &mut pool, 2), vec![(4, 0), (5, 0)]);
        let meta = std::fs::metadata(&path).unwrap();
        assert_eq!(meta.len(), 1 << 20, "KEEP_SIZE");
        assert!(meta.blocks() < blocks_before, "{} !< {blocks_before}", meta.blocks());
        let plain = std::fs::File::open(&path).unwrap();
        let mut buf = vec![0xffu8; 65536 + 8192];
        plain.read_exact_at(&mut buf, 0).unwrap();
        assert!(buf[..65536 + 4096].iter().all(|&b| b == 0));
        assert!(buf[65536 + 4096..].iter().all(|&b| b == 0x5a));
        pool.release(c);
    }

    #[test]
    fn many_ops_beyond_sq_size() {
        let (_path, file) = odirect_file(4 << 20);
        let mut pool = Pool::new(64 * 4096, 4096);
        let mut ring = Uring::new(&[file.as_raw_fd()], &pool, UringOptions { entries: 4, ..Default::default() }).unwrap();
        let chunks: Vec<_> = std::iter::from_fn(|| pool.alloc()).collect();
        for (i, &c) in chunks.iter().enumerate() {
            pool.bytes_mut(c).fill(i as u8);
            ring.write_fixed(&mut pool, 0, c, 0, 4096, i as u64 * 4096, false, i as u64);
        }
        let got = wait_all(&mut ring, &mut pool, chunks.len());
        assert!(got.iter().all(|&(_, r)| r == 4096));
        for (i, &c) in chunks.iter().enumerate() {
            ring.read_fixed(&mut pool, 0, c, 0, 4096, (63 - i) as u64 * 4096, i as u64);
        }
        wait_all(&mut ring, &mut pool, chunks.len());
        for (i, &c) in chunks.iter().enumerate() {
            assert!(pool.bytes(c).iter().all(|&b| b == (63 - i) as u8));
        }
    }

    #[test]
    fn file_slots_are_updated_at_runtime_under_restrictions() {
        let (_pa, a) = odirect_file(1 << 20);
        let (pb, b) = odirect_file(1 << 20);
        let mut pool = Pool::new(2 * 4096, 4096);
        let mut ring = Uring::new(&[a.as_raw_fd()], &pool, UringOptions { file_slots: 4, ..opts() }).unwrap();
        assert_eq!(ring.file_slots(), 4);
        // Slot 2 is empty: an op on it fails with EBADF.
        let c = pool.alloc().unwrap();
        ring.read_fixed(&mut pool, 2, c, 0, 4096, 0, 1);
        assert_eq!(wait_all(&mut ring, &mut pool, 1), vec![(1, -libc::EBADF)]);
        // Fill it with file b and write through it.
        ring.set_file(2, Some(b.as_raw_fd())).unwrap();
        pool.bytes_mut(c).fill(0x3c);
        ring.write_fixed(&mut pool, 2, c, 0, 4096, 8192, false, 2);
        assert_eq!(wait_all(&mut ring, &mut pool, 1), vec![(2, 4096)]);
        let plain = std::fs::File::open(&pb).unwrap();
        let mut buf = vec![0u8; 4096];
        plain.read_exact_at(&mut buf, 8192).unwrap();
        assert!(buf.iter().all(|&x| x == 0x3c));
        // Empty it again.
        ring.set_file(2, None).unwrap();
        ring.read_fixed(&mut pool, 2, c, 0, 4096, 0, 3);
        assert_eq!(wait_all(&mut ring, &mut pool, 1), vec![(3, -libc::EBADF)]);
        pool.release(c);
    }

    #[test]
    fn an_iopoll_ring_carries_reads_and_writes_only() {
        let (_path, file) = odirect_file(1 << 20);
        let mut pool = Pool::new(2 * 4096, 4096);
        let mut ring = Uring::new(&[file.as_raw_fd()], &pool, UringOptions { iopoll: true, ..opts() }).unwrap();
        let f = ring.features();
        assert!(f.iopoll && !f.fsync && !f.fallocate, "{f}");
        assert_eq!(f.to_string(), "read_fixed write_fixed iopoll; sleeps in epoll_wait (ring eventfd)");
        // This disk has no poll queues: the kernel refuses polled I/O on it
        // (EOPNOTSUPP), or completes it if it can. Either way the completion
        // is found by polling, which `needs_polling` asks for.
        let c = pool.alloc().unwrap();
        ring.read_fixed(&mut pool, 0, c, 0, 4096, 0, 1);
        assert!(ring.needs_polling());
        let got = wait_all(&mut ring, &mut pool, 1);
        assert!(got == vec![(1, 4096)] || got == vec![(1, -libc::EOPNOTSUPP)], "{got:?}");
        assert!(!ring.needs_polling());
        pool.release(c);
    }

    #[test]
    fn restricted_to_fixed_files() {
        // The ring refuses an op on a non-fixed descriptor: restrictions are in force.
        let (_path, file) = odirect_file(1 << 20);
        let pool = Pool::new(4096, 4096);
        let mut ring = Uring::new(&[file.as_raw_fd()], &pool, opts()).unwrap();
        let entry = opcode::Fsync::new(types::Fd(file.as_raw_fd())).build().user_data(99);
        // SAFETY: Fsync references no memory.
        unsafe { ring.ring.submission().push(&entry) }.unwrap();
        let _ = ring.ring.submit_and_wait(1);
        let res: Vec<_> = ring.ring.completion().map(|c| (c.user_data(), c.result())).collect();
        assert_eq!(res, vec![(99, -libc::EACCES)]);
    }

    /// An epoll set watching one eventfd, like the reactor's; the ring
    /// watches the set.
    fn watched_epoll() -> (crate::sys::Epoll, EventFd) {
        let epoll = crate::sys::Epoll::new().unwrap();
        let efd = EventFd::new().unwrap();
        epoll.add(efd.fd(), 7).unwrap();
        (epoll, efd)
    }

    fn sleeping_opts(epoll: &crate::sys::Epoll) -> UringOptions {
        UringOptions { wake_fd: Some(epoll.fd()), ..opts() }
    }

    #[test]
    fn ring_sleep_needs_a_wake_fd_and_no_iopoll() {
        let (_path, file) = odirect_file(1 << 20);
        let pool = Pool::new(4096, 4096);
        let (epoll, _efd) = watched_epoll();
        let ring = Uring::new(&[file.as_raw_fd()], &pool, sleeping_opts(&epoll)).unwrap();
        let f = ring.features();
        assert!(f.ring_sleep, "this kernel has PollAdd and EXT_ARG: {f}");
        assert!(f.to_string().ends_with(" poll_add; sleeps in io_uring_enter"), "{f}");
        assert_eq!(ring.eventfd(), None, "no eventfd in ring-sleep mode");
        assert_eq!(ring.file_slots(), 1, "the watched fd's slot is not the caller's");
        drop(ring);

        let ring = Uring::new(&[file.as_raw_fd()], &pool, opts()).unwrap();
        assert!(!ring.features().ring_sleep);
        assert!(ring.eventfd().is_some());
        drop(ring);

        let ring = Uring::new(&[file.as_raw_fd()], &pool, UringOptions { iopoll: true, ..sleeping_opts(&epoll) }).unwrap();
        assert!(!ring.features().ring_sleep, "an iopoll ring cannot carry the wake poll");
        assert!(ring.eventfd().is_some());
    }

    #[test]
    fn wake_poll_fires_when_the_watched_fd_is_readable_and_never_reaches_the_callback() {
        let (_path, file) = odirect_file(1 << 20);
        let mut pool = Pool::new(2 * 4096, 4096);
        let (epoll, efd) = watched_epoll();
        let mut ring = Uring::new(&[file.as_raw_fd()], &pool, sleeping_opts(&epoll)).unwrap();

        // Nothing readable: the poll stays armed across a sleep.
        ring.arm_wake_poll();
        assert!(ring.wake_poll_armed());
        ring.sleep(Some(Duration::from_millis(20))).unwrap();
        assert_eq!(ring.reap(&mut pool, |u, r| panic!("unexpected completion ({u}, {r})")), 0);
        assert!(!ring.take_wake_poll_fired());
        assert!(ring.wake_poll_armed());

        // A write to the watched eventfd makes the epoll set readable: the
        // poll fires, ends the sleep, and `reap` keeps it to itself while
        // reporting an operation completed alongside.
        let c = pool.alloc().unwrap();
        ring.read_fixed(&mut pool, 0, c, 0, 4096, 0, 1);
        let efd = Arc::new(efd);
        let notifier = {
            let efd = Arc::clone(&efd);
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(50));
                efd.notify();
            })
        };
        let mut got = Vec::new();
        let start = std::time::Instant::now();
        while !ring.take_wake_poll_fired() {
            ring.sleep(Some(Duration::from_secs(10))).unwrap();
            ring.reap(&mut pool, |u, r| got.push((u, r)));
            assert!(start.elapsed() < Duration::from_secs(5), "the wake poll did not end the sleep");
        }
        notifier.join().unwrap();
        assert!(!ring.wake_poll_armed(), "one-shot: re-arming is the caller's choice");
        assert!(!ring.take_wake_poll_fired(), "taken once");
        // The read may still be in flight (the poll can fire first).
        got.extend(wait_all(&mut ring, &mut pool, 1 - got.len()));
        assert_eq!(got, vec![(1, 4096)], "only the read reaches the callback");
        assert_eq!(ring.inflight(), 0);

        // Still readable (level-triggered): a new poll fires at once.
        ring.arm_wake_poll();
        ring.sleep(Some(Duration::from_secs(10))).unwrap();
        assert_eq!(ring.reap(&mut pool, |u, r| panic!("unexpected completion ({u}, {r})")), 0);
        assert!(ring.take_wake_poll_fired());
        assert!(start.elapsed() < Duration::from_secs(5));
        pool.release(c);
    }

    #[test]
    fn a_withdrawn_wake_poll_ends_without_firing_unless_its_fd_was_readable_first() {
        let (_path, file) = odirect_file(1 << 20);
        let mut pool = Pool::new(4096, 4096);
        let (epoll, efd) = watched_epoll();
        let mut ring = Uring::new(&[file.as_raw_fd()], &pool, sleeping_opts(&epoll)).unwrap();
        let reap_all = |ring: &mut Uring, pool: &mut Pool| {
            let start = std::time::Instant::now();
            while ring.wake_poll_armed() {
                ring.submit().unwrap();
                assert_eq!(ring.reap(pool, |u, r| panic!("unexpected completion ({u}, {r})")), 0);
                assert!(start.elapsed() < Duration::from_secs(5), "the withdrawn poll never completed");
            }
        };

        // Armed and waiting (nothing readable): the withdrawal catches it.
        ring.arm_wake_poll();
        ring.submit().unwrap();
        ring.withdraw_wake_poll();
        ring.withdraw_wake_poll(); // once is enough; a second is a no-op
        assert!(ring.wake_poll_armed(), "armed until its completion is reaped");
        reap_all(&mut ring, &mut pool);
        assert!(!ring.take_wake_poll_fired(), "a withdrawn poll is not a wake-up");

        // Not armed: nothing to withdraw, nothing queued.
        ring.withdraw_wake_poll();
        ring.submit().unwrap();
        assert_eq!(ring.reap(&mut pool, |u, r| panic!("unexpected completion ({u}, {r})")), 0);

        // Readable before the withdrawal: the poll fired, and says so.
        efd.notify();
        ring.arm_wake_poll();
        ring.submit().unwrap();
        ring.withdraw_wake_poll();
        reap_all(&mut ring, &mut pool);
        assert!(ring.take_wake_poll_fired(), "a poll that fired before its withdrawal is a wake-up");

        // And the ring sleeps on as before: a new poll fires at once.
        ring.arm_wake_poll();
        ring.sleep(Some(Duration::from_secs(10))).unwrap();
        ring.reap(&mut pool, |u, r| panic!("unexpected completion ({u}, {r})"));
        assert!(ring.take_wake_poll_fired());
    }

    #[test]
    fn a_sleep_with_nothing_pending_returns_after_its_timeout() {
        let (_path, file) = odirect_file(1 << 20);
        let mut pool = Pool::new(4096, 4096);
        let (epoll, _efd) = watched_epoll();
        let mut ring = Uring::new(&[file.as_raw_fd()], &pool, sleeping_opts(&epoll)).unwrap();
        for arm in [false, true] {
            if arm {
                ring.arm_wake_poll();
            }
            let start = std::time::Instant::now();
            ring.sleep(Some(Duration::from_millis(30))).unwrap();
            let took = start.elapsed();
            assert!(took >= Duration::from_millis(30), "woke after {took:?} (wake poll armed: {arm})");
            assert!(took < Duration::from_secs(5), "slept {took:?} (wake poll armed: {arm})");
            assert_eq!(ring.reap(&mut pool, |u, r| panic!("unexpected completion ({u}, {r})")), 0);
            assert!(!ring.take_wake_poll_fired());
        }
        // A zero timeout (a deadline already past) does not sleep.
        let start = std::time::Instant::now();
        ring.sleep(Some(Duration::ZERO)).unwrap();
        assert!(start.elapsed() < Duration::from_secs(1));
    }

    #[test]
    fn a_read_completion_wakes_a_sleep() {
        let (_path, file) = odirect_file(1 << 20);
        let mut pool = Pool::new(4096, 4096);
        let (epoll, _efd) = watched_epoll();
        let mut ring = Uring::new(&[file.as_raw_fd()], &pool, sleeping_opts(&epoll)).unwrap();
        ring.arm_wake_poll();
        let c = pool.alloc().unwrap();
        // Not submitted before: the sleep's io_uring_enter submits it.
        ring.read_fixed(&mut pool, 0, c, 0, 4096, 4096, 1);
        let start = std::time::Instant::now();
        ring.sleep(Some(Duration::from_secs(10))).unwrap();
        assert!(start.elapsed() < Duration::from_secs(5), "slept {:?}", start.elapsed());
        let mut got = Vec::new();
        assert_eq!(ring.reap(&mut pool, |u, r| got.push((u, r))), 1, "the sleep ended with the read's completion");
        assert_eq!(got, vec![(1, 4096)]);
        assert!(ring.wake_poll_armed() && !ring.take_wake_poll_fired());
        pool.release(c);
    }

    /// Drops `ring` on another thread; fails if that does not return.
    fn drop_within(ring: Uring, limit: Duration) {
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            drop(ring);
            tx.send(()).unwrap();
        });
        rx.recv_timeout(limit).expect("dropping the ring did not return");
    }

    #[test]
    fn drop_with_the_wake_poll_armed_returns() {
        let (_path, file) = odirect_file(1 << 20);
        let mut pool = Pool::new(4096, 4096);
        let (epoll, efd) = watched_epoll();

        // Armed and submitted, never fired.
        let mut ring = Uring::new(&[file.as_raw_fd()], &pool, sleeping_opts(&epoll)).unwrap();
        ring.arm_wake_poll();
        ring.sleep(Some(Duration::from_millis(1))).unwrap();
        assert!(ring.wake_poll_armed());
        drop_within(ring, Duration::from_secs(10));

        // Armed, queued but not submitted.
        let mut ring = Uring::new(&[file.as_raw_fd()], &pool, sleeping_opts(&epoll)).unwrap();
        ring.arm_wake_poll();
        drop_within(ring, Duration::from_secs(10));

        // Armed with a read in flight, and the poll fired: its completion
        // is not reaped before the drop, so `Drop`'s wait for the read
        // finds it and skips it.
        let mut ring = Uring::new(&[file.as_raw_fd()], &pool, sleeping_opts(&epoll)).unwrap();
        ring.arm_wake_poll();
        ring.sleep(Some(Duration::from_millis(1))).unwrap();
        efd.notify();
        let c = pool.alloc().unwrap();
        ring.read_fixed(&mut pool, 0, c, 0, 4096, 0, 1);
        drop_within(ring, Duration::from_secs(10));
    }

    fn receiving_opts(epoll: &crate::sys::Epoll) -> UringOptions {
        UringOptions { socket_slots: 4, ..sleeping_opts(epoll) }
    }

    /// Sleeps until one receive completes; returns its tag and result.
    fn next_recv(ring: &mut Uring, pool: &mut Pool) -> (u64, i32) {
        let started = std::time::Instant::now();
        loop {
            ring.sleep(Some(Duration::from_secs(10))).unwrap();
            let mut got = None;
            ring.reap(pool, |t, r| got = Some((t, r)));
            if let Some(g) = got {
                return g;
            }
            assert!(started.elapsed() < Duration::from_secs(10), "no receive completed");
        }
    }

    #[test]
    fn socket_receives_end_the_sleep_with_the_bytes_into_a_buffer_or_a_chunk_and_report_the_close() {
        use std::io::Write;
        let pool = Pool::new(8192, 4096);
        let (epoll, _efd) = watched_epoll();
        let (a, mut peer_a) = std::os::unix::net::UnixStream::pair().unwrap();
        let (b, mut peer_b) = std::os::unix::net::UnixStream::pair().unwrap();
        let mut ring = Uring::new(&[], &pool, receiving_opts(&epoll)).unwrap();
        assert!(ring.receives(), "this kernel has Recv and ring sleep: {}", ring.features());
        let mut pool = pool;
        let (sa, sb) = (ring.register_socket(a.as_raw_fd()).unwrap(), ring.register_socket(b.as_raw_fd()).unwrap());
        const TAG_A: u64 = 8 << 60 | 1;
        const TAG_B: u64 = 8 << 60 | 2;
        let ra = ring.arm_recv(&mut pool, sa, RecvInto::Buf(vec![0; 64].into_boxed_slice()), 0, 64, TAG_A);
        let chunk = pool.alloc().unwrap();
        let rb = ring.arm_recv(&mut pool, sb, RecvInto::Chunk(chunk), 100, 1000, TAG_B);
        assert_eq!(ring.recvs_armed(), 2);
        // Nothing to receive: the sleep times out.
        ring.sleep(Some(Duration::from_millis(20))).unwrap();
        assert_eq!(ring.reap(&mut pool, |t, r| panic!("nothing came: ({t:#x}, {r})")), 0);
        // Bytes on b end the sleep, into the chunk at its offset.
        peer_b.write_all(&[9u8; 10]).unwrap();
        assert_eq!(next_recv(&mut ring, &mut pool), (TAG_B, 10));
        match ring.take_recv(rb) {
            RecvInto::Chunk(c) => assert_eq!((c, &pool.bytes(c)[100..110]), (chunk, &[9u8; 10][..])),
            other => panic!("{other:?}"),
        }
        // On a: at most the 64 bytes asked for are taken.
        peer_a.write_all(&[7u8; 100]).unwrap();
        assert_eq!(next_recv(&mut ring, &mut pool), (TAG_A, 64));
        let RecvInto::Buf(buf) = ring.take_recv(ra) else { panic!("a buffer") };
        assert_eq!(&buf[..], &[7u8; 64][..]);
        let ra = ring.arm_recv(&mut pool, sa, RecvInto::Buf(buf), 10, 54, TAG_A);
        assert_eq!(next_recv(&mut ring, &mut pool), (TAG_A, 36));
        let RecvInto::Buf(buf) = ring.take_recv(ra) else { panic!("a buffer") };
        assert_eq!(&buf[10..46], &[7u8; 36][..]);
        // The peer closes: an empty receive.
        drop(peer_a);
        let ra = ring.arm_recv(&mut pool, sa, RecvInto::Buf(buf), 0, 64, TAG_A);
        assert_eq!(next_recv(&mut ring, &mut pool), (TAG_A, 0));
        ring.take_recv(ra);
        // A receive cancelled comes back with its memory.
        let rb = ring.arm_recv(&mut pool, sb, RecvInto::Chunk(chunk), 0, 64, TAG_B);
        ring.cancel_recv(rb);
        assert_eq!(next_recv(&mut ring, &mut pool), (TAG_B, -libc::ECANCELED));
        assert!(matches!(ring.take_recv(rb), RecvInto::Chunk(c) if c == chunk));
        assert!(pool.is_held(chunk), "the chunk is the CPU's again");
        assert_eq!(ring.recvs_armed(), 0);
        ring.unregister_socket(sa);
        ring.unregister_socket(sb);
    }

    #[test]
    fn drop_with_a_socket_receive_waiting_cancels_it_and_returns() {
        let pool = Pool::new(4096, 4096);
        let (epoll, _efd) = watched_epoll();
        let (ours, _peer) = std::os::unix::net::UnixStream::pair().unwrap();
        let mut pool2 = Pool::new(4096, 4096);
        // Submitted and waiting for bytes that never come.
        let mut ring = Uring::new(&[], &pool, receiving_opts(&epoll)).unwrap();
        let slot = ring.register_socket(ours.as_raw_fd()).unwrap();
        let mut pool = pool;
        ring.arm_recv(&mut pool, slot, RecvInto::Buf(vec![0; 64].into_boxed_slice()), 0, 64, 8 << 60);
        ring.sleep(Some(Duration::from_millis(1))).unwrap();
        drop_within(ring, Duration::from_secs(10));
        // Queued, not submitted.
        let mut ring = Uring::new(&[], &pool2, receiving_opts(&epoll)).unwrap();
        let slot = ring.register_socket(ours.as_raw_fd()).unwrap();
        ring.arm_recv(&mut pool2, slot, RecvInto::Buf(vec![0; 64].into_boxed_slice()), 0, 64, 8 << 60);
        drop_within(ring, Duration::from_secs(10));
    }

    #[test]
    fn no_socket_receive_without_ring_sleep() {
        let pool = Pool::new(4096, 4096);
        let ring = Uring::new(&[], &pool, UringOptions { socket_slots: 4, ..opts() }).unwrap();
        assert!(!ring.receives(), "no wake fd, no ring sleep: the caller reads its sockets itself");
    }
}
