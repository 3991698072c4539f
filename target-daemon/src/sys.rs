//! Thin safe wrappers over the Linux calls the daemon needs and std does not
//! offer: eventfd, epoll, signalfd, CPU affinity, block-device ioctls
//! (BLKGETSIZE64, BLKSSZGET, BLKDISCARD, BLKZEROOUT), fallocate, memfd,
//! statx, rlimits and thread ids. Together with `uring.rs` and `pool.rs` this
//! is the only place with `unsafe`.

use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

fn cvt(rc: libc::c_int) -> io::Result<libc::c_int> {
    if rc < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(rc)
    }
}

/// A non-blocking eventfd used as a wake-up counter, with a flag that says
/// whether it may be readable, so that a reactor woken by something else
/// need not read it (a system call) to find out.
#[derive(Debug)]
pub struct EventFd {
    fd: OwnedFd,
    notified: AtomicBool,
}

impl EventFd {
    /// Creates a non-blocking, close-on-exec eventfd.
    pub fn new() -> io::Result<Self> {
        // SAFETY: eventfd has no pointer arguments; the result is checked.
        let fd = cvt(unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) })?;
        // SAFETY: `fd` is a fresh descriptor that nothing else owns.
        Ok(EventFd { fd: unsafe { OwnedFd::from_raw_fd(fd) }, notified: AtomicBool::new(false) })
    }

    /// Adds one to the counter, waking any waiter. The flag is set after
    /// the write: whoever sees it set finds the counter non-zero (or
    /// drained by an earlier read), and a counter written but not yet
    /// flagged keeps the descriptor readable until the flag follows.
    pub fn notify(&self) {
        let one: u64 = 1;
        // SAFETY: writes 8 bytes from a live u64 to our own descriptor.
        let _ = unsafe { libc::write(self.fd.as_raw_fd(), (&one as *const u64).cast(), 8) };
        self.notified.store(true, Ordering::Release);
    }

    /// Resets the counter; returns whether it was non-zero.
    pub fn drain(&self) -> bool {
        self.notified.store(false, Ordering::Release);
        let mut v: u64 = 0;
        // SAFETY: reads 8 bytes into a live u64 from our own non-blocking descriptor.
        let n = unsafe { libc::read(self.fd.as_raw_fd(), (&mut v as *mut u64).cast(), 8) };
        n == 8 && v != 0
    }

    /// Resets the counter if it was notified since the last drain; no
    /// system call otherwise.
    pub fn drain_if_notified(&self) {
        if self.notified.swap(false, Ordering::AcqRel) {
            self.drain();
        }
    }

    /// The descriptor, for epoll and io_uring.
    pub fn fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }
}

/// A level-triggered epoll set.
#[derive(Debug)]
pub struct Epoll(OwnedFd);

impl Epoll {
    /// Creates an epoll instance.
    pub fn new() -> io::Result<Self> {
        // SAFETY: no pointer arguments; the result is checked.
        let fd = cvt(unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) })?;
        // SAFETY: `fd` is a fresh descriptor that nothing else owns.
        Ok(Epoll(unsafe { OwnedFd::from_raw_fd(fd) }))
    }

    /// The epoll descriptor itself (readable when a watched descriptor is
    /// ready; the io_uring's wake poll watches it).
    pub fn fd(&self) -> RawFd {
        self.0.as_raw_fd()
    }

    /// Watches `fd` for readability; `token` comes back from [`wait`](Epoll::wait).
    pub fn add(&self, fd: RawFd, token: u64) -> io::Result<()> {
        self.ctl(libc::EPOLL_CTL_ADD, fd, token, READABLE)
    }

    /// Watches `fd` for `events` ([`READABLE`], [`WRITABLE`] or both).
    pub fn add_events(&self, fd: RawFd, token: u64, events: u32) -> io::Result<()> {
        self.ctl(libc::EPOLL_CTL_ADD, fd, token, events)
    }

    /// Changes what `fd` is watched for.
    pub fn modify(&self, fd: RawFd, token: u64, events: u32) -> io::Result<()> {
        self.ctl(libc::EPOLL_CTL_MOD, fd, token, events)
    }

    fn ctl(&self, op: libc::c_int, fd: RawFd, token: u64, events: u32) -> io::Result<()> {
        let mut ev = libc::epoll_event { events, u64: token };
        // SAFETY: `ev` is a valid epoll_event for the duration of the call.
        cvt(unsafe { libc::epoll_ctl(self.0.as_raw_fd(), op, fd, &mut ev) })?;
        Ok(())
    }

    /// Stops watching `fd`.
    pub fn remove(&self, fd: RawFd) -> io::Result<()> {
        let mut ev = libc::epoll_event { events: 0, u64: 0 };
        // SAFETY: `ev` is valid (ignored by the kernel for DEL, required non-null by old ones).
        cvt(unsafe { libc::epoll_ctl(self.0.as_raw_fd(), libc::EPOLL_CTL_DEL, fd, &mut ev) })?;
        Ok(())
    }

    /// Waits for readiness; pushes the tokens of ready descriptors into `out`
    /// (cleared first). `None` waits forever. EINTR returns with no tokens.
    pub fn wait(&self, out: &mut Vec<u64>, timeout: Option<Duration>) -> io::Result<()> {
        out.clear();
        let mut events = [libc::epoll_event { events: 0, u64: 0 }; 32];
        let ms = match timeout {
            None => -1,
            // Round up so that a deadline is not missed by a sub-millisecond remainder.
            Some(t) => t.as_micros().div_ceil(1000).min(i32::MAX as u128) as i32,
        };
        // SAFETY: `events` is a writable array of the length passed.
        let n = unsafe { libc::epoll_wait(self.0.as_raw_fd(), events.as_mut_ptr(), events.len() as i32, ms) };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                return Ok(());
            }
            return Err(e);
        }
        for ev in &events[..n as usize] {
            let token = ev.u64;
            out.push(token);
        }
        Ok(())
    }
}

/// Epoll interest: readable.
pub const READABLE: u32 = libc::EPOLLIN as u32;
/// Epoll interest: writable.
pub const WRITABLE: u32 = libc::EPOLLOUT as u32;

/// SIGINT, SIGTERM and SIGHUP delivered through a descriptor instead of handlers.
#[derive(Debug)]
pub struct SignalFd(OwnedFd);

fn daemon_sigset() -> libc::sigset_t {
    // SAFETY: sigset_t is plain data; sigemptyset initialises it fully.
    let mut set: libc::sigset_t = unsafe { std::mem::zeroed() };
    // SAFETY: `set` is a valid sigset_t.
    unsafe {
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGINT);
        libc::sigaddset(&mut set, libc::SIGTERM);
        libc::sigaddset(&mut set, libc::SIGHUP);
    }
    set
}

impl SignalFd {
    /// Blocks SIGINT, SIGTERM and SIGHUP in the calling thread (threads
    /// spawned afterwards inherit the mask) and returns a descriptor that
    /// becomes readable when one is pending.
    pub fn block_daemon_signals() -> io::Result<Self> {
        let set = daemon_sigset();
        // SAFETY: `set` is initialised; the old mask is not requested.
        let rc = unsafe { libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut()) };
        if rc != 0 {
            return Err(io::Error::from_raw_os_error(rc));
        }
        // SAFETY: `set` is initialised; -1 asks for a new descriptor.
        let fd = cvt(unsafe { libc::signalfd(-1, &set, libc::SFD_NONBLOCK | libc::SFD_CLOEXEC) })?;
        // SAFETY: `fd` is a fresh descriptor that nothing else owns.
        Ok(SignalFd(unsafe { OwnedFd::from_raw_fd(fd) }))
    }

    /// Reads one pending signal, if any.
    pub fn read(&self) -> Option<i32> {
        // SAFETY: signalfd_siginfo is plain data.
        let mut info: libc::signalfd_siginfo = unsafe { std::mem::zeroed() };
        let len = std::mem::size_of::<libc::signalfd_siginfo>();
        // SAFETY: reads at most `len` bytes into `info`, which is `len` bytes long.
        let n = unsafe { libc::read(self.0.as_raw_fd(), (&mut info as *mut libc::signalfd_siginfo).cast(), len) };
        (n as usize == len).then_some(info.ssi_signo as i32)
    }

    /// The descriptor, for epoll.
    pub fn fd(&self) -> RawFd {
        self.0.as_raw_fd()
    }
}

/// Pins the calling thread to one CPU.
pub fn pin_current_thread(cpu: usize) -> io::Result<()> {
    // SAFETY: cpu_set_t is plain data; CPU_ZERO/CPU_SET initialise it.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: `set` is a valid cpu_set_t and the index is reduced modulo its bit count.
    unsafe {
        libc::CPU_ZERO(&mut set);
        libc::CPU_SET(cpu % (8 * std::mem::size_of::<libc::cpu_set_t>()), &mut set);
    }
    // SAFETY: `set` is valid for the length passed; 0 means the calling thread.
    cvt(unsafe { libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) })?;
    Ok(())
}

/// The CPUs the process may run on, in order.
pub fn allowed_cpus() -> Vec<usize> {
    // SAFETY: cpu_set_t is plain data.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: `set` is writable and of the length passed.
    let rc = unsafe { libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) };
    if rc != 0 {
        return vec![0];
    }
    let max = 8 * std::mem::size_of::<libc::cpu_set_t>();
    // SAFETY: `set` was filled in by the kernel; CPU_ISSET only reads it.
    (0..max).filter(|&c| unsafe { libc::CPU_ISSET(c, &set) }).collect()
}

/// `_IOR(0x12, 114, size_t)`: size of a block device in bytes.
const BLKGETSIZE64: libc::c_ulong = 0x8008_1272;

/// Size in bytes of the block device open on `fd` (ioctl BLKGETSIZE64).
pub fn block_device_size(fd: RawFd) -> io::Result<u64> {
    let mut size: u64 = 0;
    // SAFETY: BLKGETSIZE64 writes one u64 through the pointer, which is live.
    cvt(unsafe { libc::ioctl(fd, BLKGETSIZE64 as _, &mut size as *mut u64) })?;
    Ok(size)
}

/// Logical block size of the block device open on `fd` (ioctl BLKSSZGET).
pub fn block_device_logical_block_size(fd: RawFd) -> io::Result<u32> {
    let mut size: libc::c_int = 0;
    // SAFETY: BLKSSZGET writes one int through the pointer, which is live.
    cvt(unsafe { libc::ioctl(fd, libc::BLKSSZGET as _, &mut size as *mut libc::c_int) })?;
    Ok(size as u32)
}

/// O_DIRECT alignment requirements reported by statx (STATX_DIOALIGN):
/// `(memory alignment, file offset alignment)`, or `None` if the kernel or
/// file system does not report them.
pub fn dio_alignment(fd: RawFd) -> Option<(u32, u32)> {
    // SAFETY: statx is plain data.
    let mut stx: libc::statx = unsafe { std::mem::zeroed() };
    // SAFETY: the empty path with AT_EMPTY_PATH names `fd`; `stx` is writable.
    let rc = unsafe { libc::statx(fd, c"".as_ptr(), libc::AT_EMPTY_PATH, libc::STATX_DIOALIGN, &mut stx) };
    if rc != 0 || stx.stx_mask & libc::STATX_DIOALIGN == 0 || stx.stx_dio_offset_align == 0 {
        return None;
    }
    Some((stx.stx_dio_mem_align, stx.stx_dio_offset_align))
}

/// The errno of an I/O error, or EIO.
pub fn errno_of(e: &io::Error) -> i32 {
    e.raw_os_error().unwrap_or(libc::EIO)
}

/// `_IO(0x12, 119)`: discard a byte range of a block device.
const BLKDISCARD: libc::c_ulong = 0x1277;
/// `_IO(0x12, 127)`: zero a byte range of a block device.
const BLKZEROOUT: libc::c_ulong = 0x127f;

fn blk_range_ioctl(fd: RawFd, req: libc::c_ulong, offset: u64, len: u64) -> io::Result<()> {
    let range: [u64; 2] = [offset, len];
    // SAFETY: both ioctls read two u64 (start, length) through the pointer, which is live.
    cvt(unsafe { libc::ioctl(fd, req as _, range.as_ptr()) })?;
    Ok(())
}

/// ioctl BLKDISCARD: the device may deallocate `[offset, offset + len)`.
pub fn blk_discard(fd: RawFd, offset: u64, len: u64) -> io::Result<()> {
    blk_range_ioctl(fd, BLKDISCARD, offset, len)
}

/// ioctl BLKZEROOUT: `[offset, offset + len)` reads back as zeroes (the
/// kernel uses WRITE ZEROES when the device has it and writes zeroes otherwise).
pub fn blk_zeroout(fd: RawFd, offset: u64, len: u64) -> io::Result<()> {
    blk_range_ioctl(fd, BLKZEROOUT, offset, len)
}

/// fallocate(2).
pub fn fallocate(fd: RawFd, mode: i32, offset: u64, len: u64) -> io::Result<()> {
    // SAFETY: fallocate takes plain integers.
    cvt(unsafe { libc::fallocate(fd, mode, offset as libc::off_t, len as libc::off_t) })?;
    Ok(())
}

/// An anonymous RAM-backed file (memfd), close-on-exec.
pub fn memfd_create(name: &std::ffi::CStr) -> io::Result<File> {
    // SAFETY: `name` is a valid NUL-terminated string for the duration of the call.
    let fd = cvt(unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) })?;
    // SAFETY: `fd` is a fresh descriptor that nothing else owns.
    Ok(File::from(unsafe { OwnedFd::from_raw_fd(fd) }))
}

/// The calling thread's kernel id.
pub fn gettid() -> i32 {
    // SAFETY: gettid has no arguments and cannot fail.
    unsafe { libc::gettid() }
}

/// Backlog of the listening sockets: connections the kernel completes
/// before the control thread accepts them. A flood of connections must
/// not fill it (a SYN the kernel drops is retried only after a second), so
/// it is as deep as the kernel allows (`net.core.somaxconn` caps it).
pub const LISTEN_BACKLOG: i32 = 4096;

/// Listens on bound socket `fd` again with a backlog of [`LISTEN_BACKLOG`]
/// (std listens with 128; a second `listen` only changes the backlog).
pub fn deepen_listen_backlog(fd: RawFd) -> io::Result<()> {
    // SAFETY: plain syscall on a descriptor the caller owns.
    cvt(unsafe { libc::listen(fd, LISTEN_BACKLOG) })?;
    Ok(())
}

/// Raises the soft RLIMIT_NOFILE to at least `want` (up to the hard limit).
/// Returns the soft limit in force afterwards.
pub fn raise_nofile_limit(want: u64) -> io::Result<u64> {
    let mut rl = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: `rl` is a writable rlimit.
    cvt(unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut rl) })?;
    if rl.rlim_cur >= want || rl.rlim_cur == rl.rlim_max {
        return Ok(rl.rlim_cur);
    }
    let new = libc::rlimit { rlim_cur: want.min(rl.rlim_max), rlim_max: rl.rlim_max };
    // SAFETY: `new` is a valid rlimit.
    cvt(unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &new) })?;
    Ok(new.rlim_cur)
}

/// The soft RLIMIT_MEMLOCK in bytes; `None` when unlimited.
pub fn memlock_limit() -> io::Result<Option<u64>> {
    let mut rl = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: `rl` is a writable rlimit.
    cvt(unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut rl) })?;
    Ok((rl.rlim_cur != libc::RLIM_INFINITY).then_some(rl.rlim_cur))
}

/// Whether this process has CAP_IPC_LOCK in its effective set (then
/// RLIMIT_MEMLOCK does not bound what io_uring pins), from /proc/self/status.
pub fn has_cap_ipc_lock() -> bool {
    const CAP_IPC_LOCK: u32 = 14;
    let Ok(status) = std::fs::read_to_string("/proc/self/status") else { return false };
    status
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .and_then(|hex| u64::from_str_radix(hex.trim(), 16).ok())
        .is_some_and(|caps| caps & (1 << CAP_IPC_LOCK) != 0)
}

/// CPU time (user + system) a thread of this process has used, from
/// `/proc/self/task/TID/stat`.
pub fn thread_cpu_time(tid: i32) -> Option<Duration> {
    let stat = std::fs::read_to_string(format!("/proc/self/task/{tid}/stat")).ok()?;
    // Fields after the command name, which is in parentheses and may contain spaces.
    let rest = &stat[stat.rfind(')')? + 2..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // utime and stime are fields 14 and 15 of the whole line: 11 and 12 after the name.
    let ticks: u64 = fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?;
    // SAFETY: sysconf takes a plain integer.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    let hz = if hz > 0 { hz as u64 } else { 100 };
    Some(Duration::from_nanos(ticks.saturating_mul(1_000_000_000 / hz)))
}

/// Major and minor number of a `dev_t`.
pub fn dev_major_minor(dev: u64) -> (u64, u64) {
    let major = ((dev >> 8) & 0xfff) | ((dev >> 32) & !0xfff);
    let minor = (dev & 0xff) | ((dev >> 12) & !0xff);
    (major, minor)
}

/// A block queue attribute (`queue/discard_max_bytes`, `queue/io_poll`...)
/// of the disk that holds device `dev` (a partition's attributes live on its disk).
pub fn block_queue_attr(dev: u64, attr: &str) -> Option<String> {
    let (major, minor) = dev_major_minor(dev);
    let base = PathBuf::from(format!("/sys/dev/block/{major}:{minor}"));
    for dir in [base.join("queue"), base.join("../queue")] {
        if let Ok(v) = std::fs::read_to_string(dir.join(attr)) {
            return Some(v.trim().to_owned());
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn eventfd_wakes_epoll() {
        let efd = EventFd::new().unwrap();
        let ep = Epoll::new().unwrap();
        ep.add(efd.fd(), 7).unwrap();
        let mut out = Vec::new();
        ep.wait(&mut out, Some(Duration::from_millis(1))).unwrap();
        assert!(out.is_empty());
        efd.notify();
        ep.wait(&mut out, Some(Duration::from_secs(1))).unwrap();
        assert_eq!(out, vec![7]);
        assert!(efd.drain());
        assert!(!efd.drain());
    }

    #[test]
    fn memfd_is_a_sized_ram_file() {
        use std::os::unix::fs::FileExt;
        let f = memfd_create(c"t").unwrap();
        f.set_len(1 << 20).unwrap();
        f.write_all_at(b"abc", 4096).unwrap();
        let mut b = [0u8; 3];
        f.read_exact_at(&mut b, 4096).unwrap();
        assert_eq!(&b, b"abc");
        // shmem punches holes (and they read back as zeroes).
        fallocate(f.as_raw_fd(), libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE, 0, 8192).unwrap();
        f.read_exact_at(&mut b, 4096).unwrap();
        assert_eq!(b, [0; 3]);
    }

    #[test]
    fn thread_cpu_time_of_this_thread() {
        // Burn CPU until the thread's CPU time moves (a clock tick, usually
        // 10 ms of CPU); bounded generously so that a loaded machine only
        // makes it slower, not flaky.
        let tid = gettid();
        let t0 = thread_cpu_time(tid).expect("readable");
        let start = std::time::Instant::now();
        let mut x = 0u64;
        let mut t1 = t0;
        while t1 <= t0 && start.elapsed() < Duration::from_secs(60) {
            for _ in 0..100_000 {
                x = x.wrapping_add(std::hint::black_box(1));
            }
            t1 = thread_cpu_time(tid).unwrap();
        }
        std::hint::black_box(x);
        assert!(t1 > t0, "{t0:?} -> {t1:?}");
        assert!(thread_cpu_time(i32::MAX).is_none(), "no such thread");
    }

    #[test]
    fn dev_numbers() {
        assert_eq!(dev_major_minor(0x0803), (8, 3));
        assert_eq!(dev_major_minor((259 << 8) | 1), (259, 1));
    }

    #[test]
    fn dio_alignment_on_tmp() {
        let f = tempfile::tempfile_in("/tmp").unwrap();
        // Reported on ext4/xfs with a recent kernel; just make sure the call is sane.
        if let Some((mem, off)) = dio_alignment(f.as_raw_fd()) {
            assert!(mem.is_power_of_two() && off.is_power_of_two(), "{mem} {off}");
        }
    }
}
