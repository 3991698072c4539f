//! Thin safe wrappers over the Linux calls the daemon needs and std does not
//! offer: eventfd, epoll, signalfd, CPU affinity, block-device ioctls and
//! statx. Together with `uring.rs` and `pool.rs` this is the only place with
//! `unsafe`.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::time::Duration;

fn cvt(rc: libc::c_int) -> io::Result<libc::c_int> {
    if rc < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(rc)
    }
}

/// A non-blocking eventfd used as a wake-up counter.
#[derive(Debug)]
pub struct EventFd(OwnedFd);

impl EventFd {
    /// Creates a non-blocking, close-on-exec eventfd.
    pub fn new() -> io::Result<Self> {
        // SAFETY: eventfd has no pointer arguments; the result is checked.
        let fd = cvt(unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) })?;
        // SAFETY: `fd` is a fresh descriptor that nothing else owns.
        Ok(EventFd(unsafe { OwnedFd::from_raw_fd(fd) }))
    }

    /// Adds one to the counter, waking any waiter.
    pub fn notify(&self) {
        let one: u64 = 1;
        // SAFETY: writes 8 bytes from a live u64 to our own descriptor.
        let _ = unsafe { libc::write(self.0.as_raw_fd(), (&one as *const u64).cast(), 8) };
    }

    /// Resets the counter; returns whether it was non-zero.
    pub fn drain(&self) -> bool {
        let mut v: u64 = 0;
        // SAFETY: reads 8 bytes into a live u64 from our own non-blocking descriptor.
        let n = unsafe { libc::read(self.0.as_raw_fd(), (&mut v as *mut u64).cast(), 8) };
        n == 8 && v != 0
    }

    /// The descriptor, for epoll and io_uring.
    pub fn fd(&self) -> RawFd {
        self.0.as_raw_fd()
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

    /// Watches `fd` for readability; `token` comes back from [`wait`](Epoll::wait).
    pub fn add(&self, fd: RawFd, token: u64) -> io::Result<()> {
        let mut ev = libc::epoll_event { events: libc::EPOLLIN as u32, u64: token };
        // SAFETY: `ev` is a valid epoll_event for the duration of the call.
        cvt(unsafe { libc::epoll_ctl(self.0.as_raw_fd(), libc::EPOLL_CTL_ADD, fd, &mut ev) })?;
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

/// SIGINT and SIGTERM delivered through a descriptor instead of handlers.
#[derive(Debug)]
pub struct SignalFd(OwnedFd);

fn term_sigset() -> libc::sigset_t {
    // SAFETY: sigset_t is plain data; sigemptyset initialises it fully.
    let mut set: libc::sigset_t = unsafe { std::mem::zeroed() };
    // SAFETY: `set` is a valid sigset_t.
    unsafe {
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGINT);
        libc::sigaddset(&mut set, libc::SIGTERM);
    }
    set
}

impl SignalFd {
    /// Blocks SIGINT and SIGTERM in the calling thread (threads spawned
    /// afterwards inherit the mask) and returns a descriptor that becomes
    /// readable when one is pending.
    pub fn block_term_signals() -> io::Result<Self> {
        let set = term_sigset();
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
    fn dio_alignment_on_tmp() {
        let f = tempfile::tempfile_in("/tmp").unwrap();
        // Reported on ext4/xfs with a recent kernel; just make sure the call is sane.
        if let Some((mem, off)) = dio_alignment(f.as_raw_fd()) {
            assert!(mem.is_power_of_two() && off.is_power_of_two(), "{mem} {off}");
        }
    }
}
