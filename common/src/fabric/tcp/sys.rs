//! Thin wrappers over the Linux calls the tcp provider needs beyond `std`:
//! epoll, eventfd, timerfd and vectored socket I/O. Every wrapper retries
//! `EINTR` where that is the right answer and reports errors as `io::Error`.

use std::io;
use std::os::fd::{FromRawFd, OwnedFd, RawFd};
use std::time::Duration;

fn cvt(rc: libc::c_int) -> io::Result<libc::c_int> {
    if rc < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(rc)
    }
}

/// Takes ownership of a descriptor the kernel just returned.
fn owned(fd: libc::c_int) -> OwnedFd {
    // SAFETY: `fd` is a fresh descriptor returned by a successful syscall;
    // nothing else owns it.
    unsafe { OwnedFd::from_raw_fd(fd) }
}

/// A new epoll instance (close-on-exec).
pub(crate) fn epoll_create() -> io::Result<OwnedFd> {
    // SAFETY: no pointers are involved.
    let fd = cvt(unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) })?;
    Ok(owned(fd))
}

/// `epoll_ctl` with the event's user data set to `token`.
pub(crate) fn epoll_ctl(epfd: RawFd, op: libc::c_int, fd: RawFd, events: u32, token: u64) -> io::Result<()> {
    let mut ev = libc::epoll_event { events, u64: token };
    // SAFETY: `ev` is a valid epoll_event for the duration of the call (the
    // kernel ignores it for EPOLL_CTL_DEL).
    cvt(unsafe { libc::epoll_ctl(epfd, op, fd, &mut ev) })?;
    Ok(())
}

/// Adds `fd` to `epfd` for readability.
pub(crate) fn epoll_add_in(epfd: RawFd, fd: RawFd, token: u64) -> io::Result<()> {
    epoll_ctl(epfd, libc::EPOLL_CTL_ADD, fd, libc::EPOLLIN as u32, token)
}

/// Removes `fd` from `epfd`, ignoring errors (the fd may already be gone).
pub(crate) fn epoll_del(epfd: RawFd, fd: RawFd) {
    let _ = epoll_ctl(epfd, libc::EPOLL_CTL_DEL, fd, 0, 0);
}

/// An empty event, for initialising arrays handed to [`epoll_wait`].
pub(crate) const EMPTY_EVENT: libc::epoll_event = libc::epoll_event { events: 0, u64: 0 };

/// `epoll_wait`; an interrupted wait reports zero events.
pub(crate) fn epoll_wait(epfd: RawFd, events: &mut [libc::epoll_event], timeout_ms: i32) -> io::Result<usize> {
    let max = events.len().min(i32::MAX as usize) as libc::c_int;
    // SAFETY: the buffer is valid for writes of `max` events.
    let rc = unsafe { libc::epoll_wait(epfd, events.as_mut_ptr(), max, timeout_ms) };
    if rc < 0 {
        let err = io::Error::last_os_error();
        if err.kind() == io::ErrorKind::Interrupted {
            return Ok(0);
        }
        return Err(err);
    }
    Ok(rc as usize)
}

/// A nonblocking, close-on-exec eventfd.
pub(crate) fn eventfd() -> io::Result<OwnedFd> {
    // SAFETY: no pointers are involved.
    let fd = cvt(unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) })?;
    Ok(owned(fd))
}

/// Makes an eventfd readable. A full counter (impossible in practice) is
/// already readable, so `EAGAIN` is ignored.
pub(crate) fn eventfd_signal(fd: RawFd) {
    let one: u64 = 1;
    loop {
        // SAFETY: writes 8 bytes from a live u64.
        let rc = unsafe { libc::write(fd, (&one as *const u64).cast(), 8) };
        if rc >= 0 || io::Error::last_os_error().kind() != io::ErrorKind::Interrupted {
            return;
        }
    }
}

/// Resets an eventfd (or timerfd) to not readable. Both are 8-byte counters.
pub(crate) fn counter_drain(fd: RawFd) {
    let mut v: u64 = 0;
    loop {
        // SAFETY: reads at most 8 bytes into a live u64.
        let rc = unsafe { libc::read(fd, (&mut v as *mut u64).cast(), 8) };
        if rc >= 0 || io::Error::last_os_error().kind() != io::ErrorKind::Interrupted {
            return;
        }
    }
}

/// A nonblocking, close-on-exec CLOCK_MONOTONIC timerfd.
pub(crate) fn timerfd() -> io::Result<OwnedFd> {
    // SAFETY: no pointers are involved.
    let fd = cvt(unsafe { libc::timerfd_create(libc::CLOCK_MONOTONIC, libc::TFD_NONBLOCK | libc::TFD_CLOEXEC) })?;
    Ok(owned(fd))
}

/// Arms a timerfd to fire once after `after`, or disarms it with `None`.
pub(crate) fn timerfd_set(fd: RawFd, after: Option<Duration>) -> io::Result<()> {
    let value = match after {
        // A zero it_value would disarm: fire after one nanosecond instead.
        Some(d) => {
            let d = d.max(Duration::from_nanos(1));
            libc::timespec {
                tv_sec: d.as_secs().min(i64::MAX as u64) as libc::time_t,
                tv_nsec: d.subsec_nanos() as libc::c_long,
            }
        }
        None => libc::timespec { tv_sec: 0, tv_nsec: 0 },
    };
    let spec = libc::itimerspec { it_interval: libc::timespec { tv_sec: 0, tv_nsec: 0 }, it_value: value };
    // SAFETY: `spec` is valid for reads; the old-value pointer may be null.
    cvt(unsafe { libc::timerfd_settime(fd, 0, &spec, std::ptr::null_mut()) })?;
    Ok(())
}

/// Listens on bound socket `fd` again with a deep backlog (std listens
/// with 128; a second `listen` only changes the backlog, which
/// `net.core.somaxconn` caps): a flood of connections must not fill it, as
/// a SYN the kernel drops is retried only after a second.
pub(crate) fn deepen_listen_backlog(fd: RawFd) -> io::Result<()> {
    // SAFETY: plain syscall on a descriptor the caller owns.
    cvt(unsafe { libc::listen(fd, 4096) })?;
    Ok(())
}

/// `SO_LINGER` with a zero timeout: closing the socket then resets the
/// connection (RST) and drops whatever is still queued for the peer.
pub(crate) fn set_linger_zero(fd: RawFd) -> io::Result<()> {
    set_socket_option(fd, libc::SO_LINGER, &libc::linger { l_onoff: 1, l_linger: 0 })
}

/// `setsockopt(fd, SOL_SOCKET, name, value)`; `T` is the C type the option
/// takes (`linger`, `timeval`).
fn set_socket_option<T>(fd: RawFd, name: libc::c_int, value: &T) -> io::Result<()> {
    // SAFETY: `value` is valid for reads of its size during the call.
    cvt(unsafe {
        libc::setsockopt(
            fd,
            libc::SOL_SOCKET,
            name,
            (value as *const T).cast(),
            std::mem::size_of::<T>() as libc::socklen_t,
        )
    })?;
    Ok(())
}

/// How many bytes of the stream the peer's TCP has acknowledged so far
/// (`tcpi_bytes_acked`, Linux 4.2 and later; `None` where it is missing).
/// It grows as the peer takes bytes off its socket once its receive
/// buffer is full, so it tells a peer that reads slowly from one that
/// does not read.
pub(crate) fn tcp_bytes_acked(fd: RawFd) -> Option<u64> {
    // SAFETY: tcp_info is a plain C struct; all-zero is a valid value.
    let mut info: libc::tcp_info = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::tcp_info>() as libc::socklen_t;
    // SAFETY: `info` is valid for writes of `len` bytes, and `len` for a
    // read and a write, during the call.
    let rc = unsafe {
        libc::getsockopt(fd, libc::IPPROTO_TCP, libc::TCP_INFO, (&mut info as *mut libc::tcp_info).cast(), &mut len)
    };
    let end = std::mem::offset_of!(libc::tcp_info, tcpi_bytes_acked) + std::mem::size_of::<u64>();
    (rc == 0 && len as usize >= end).then_some(info.tcpi_bytes_acked)
}

/// Bytes of the stream the peer's TCP has not acknowledged yet, sent or
/// not (`SIOCOUTQ`).
pub(crate) fn unacked_bytes(fd: RawFd) -> Option<usize> {
    let mut n: libc::c_int = 0;
    // SAFETY: TIOCOUTQ (SIOCOUTQ) writes one int through the pointer.
    let rc = unsafe { libc::ioctl(fd, libc::TIOCOUTQ, &mut n as *mut libc::c_int) };
    (rc == 0).then_some(n.max(0) as usize)
}

/// A receive that never blocks (`MSG_DONTWAIT`, whether or not the
/// socket is `O_NONBLOCK`), retrying `EINTR`.
pub(crate) fn read(fd: RawFd, buf: &mut [u8]) -> io::Result<usize> {
    loop {
        // SAFETY: `buf` is valid for writes of `buf.len()` bytes.
        let rc = unsafe { libc::recv(fd, buf.as_mut_ptr().cast(), buf.len(), libc::MSG_DONTWAIT) };
        if rc >= 0 {
            return Ok(rc as usize);
        }
        let err = io::Error::last_os_error();
        if err.kind() != io::ErrorKind::Interrupted {
            return Err(err);
        }
    }
}

/// A receive that sleeps until bytes arrive, the stream ends or the
/// socket's `SO_RCVTIMEO` passes (then `WouldBlock`), on a socket without
/// `O_NONBLOCK`. A signal ends it too (`Interrupted`, not retried: the
/// caller's wait ends early, as a `poll` would).
pub(crate) fn recv_blocking(fd: RawFd, buf: &mut [u8]) -> io::Result<usize> {
    // SAFETY: `buf` is valid for writes of `buf.len()` bytes.
    let rc = unsafe { libc::recv(fd, buf.as_mut_ptr().cast(), buf.len(), 0) };
    if rc >= 0 {
        return Ok(rc as usize);
    }
    Err(io::Error::last_os_error())
}

/// `SO_RCVTIMEO`: how long [`recv_blocking`] sleeps at most. The kernel
/// rounds it up to its tick.
pub(crate) fn set_recv_timeout(fd: RawFd, timeout: Duration) -> io::Result<()> {
    let tv = libc::timeval {
        tv_sec: timeout.as_secs().min(i32::MAX as u64) as libc::time_t,
        tv_usec: timeout.subsec_micros() as libc::suseconds_t,
    };
    set_socket_option(fd, libc::SO_RCVTIMEO, &tv)
}

/// A vectored receive that never blocks (`MSG_DONTWAIT`), retrying `EINTR`.
///
/// # Safety
/// Every iovec must describe memory valid for writes for the duration of the
/// call, and nothing may hold a Rust reference to that memory meanwhile.
pub(crate) unsafe fn readv(fd: RawFd, iov: &[libc::iovec]) -> io::Result<usize> {
    // SAFETY: msghdr is a plain C struct; all-zero is a valid value (no
    // address, no control data).
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = iov.as_ptr() as *mut libc::iovec;
    msg.msg_iovlen = iov.len() as _;
    loop {
        // SAFETY: the caller guarantees the iovecs describe writable memory;
        // `msg` and the iovec array are valid for the duration of the call.
        let rc = unsafe { libc::recvmsg(fd, &mut msg, libc::MSG_DONTWAIT) };
        if rc >= 0 {
            return Ok(rc as usize);
        }
        let err = io::Error::last_os_error();
        if err.kind() != io::ErrorKind::Interrupted {
            return Err(err);
        }
    }
}

/// Nonblocking vectored send without SIGPIPE, retrying `EINTR`.
///
/// # Safety
/// Every iovec must describe memory valid for reads for the duration of the call.
pub(crate) unsafe fn sendv(fd: RawFd, iov: &[libc::iovec]) -> io::Result<usize> {
    // SAFETY: msghdr is a plain C struct; all-zero is a valid value (no
    // address, no control data).
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = iov.as_ptr() as *mut libc::iovec;
    msg.msg_iovlen = iov.len() as _;
    loop {
        // SAFETY: `msg` points at the caller's iovecs, which describe readable
        // memory; the kernel does not write through msg_iov on send.
        let rc = unsafe { libc::sendmsg(fd, &msg, libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT) };
        if rc >= 0 {
            return Ok(rc as usize);
        }
        let err = io::Error::last_os_error();
        if err.kind() != io::ErrorKind::Interrupted {
            return Err(err);
        }
    }
}

/// An iovec over raw memory.
pub(crate) fn iov(addr: u64, len: usize) -> libc::iovec {
    libc::iovec { iov_base: addr as usize as *mut libc::c_void, iov_len: len }
}

/// The empty iovec, for initialising arrays.
pub(crate) const EMPTY_IOV: libc::iovec = libc::iovec { iov_base: std::ptr::null_mut(), iov_len: 0 };
