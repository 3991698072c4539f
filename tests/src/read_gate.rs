//! Holding a daemon's disk reads: a fanotify permission watch on a volume
//! file, for tests of what a queue does while its commands wait for the
//! disk (a closed connection must sleep, not spin). Needs CAP_SYS_ADMIN
//! and a tmpfs that takes O_DIRECT; the callers skip without them.

use std::ffi::CString;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

/// CPU time (user + system) the process has used, in USER_HZ ticks (100 a
/// second on Linux), from /proc.
pub fn cpu_ticks(pid: u32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    // Fields after the command name (which may hold spaces) start after ')'.
    let rest = &stat[stat.rfind(')').unwrap() + 2..];
    let f: Vec<&str> = rest.split(' ').collect();
    // utime and stime are fields 14 and 15 (1-based), i.e. 11 and 12 here.
    f[11].parse::<u64>().unwrap() + f[12].parse::<u64>().unwrap()
}

/// Holds reads of one file at the disk: a fanotify permission watch whose
/// thread allows every read, except while `hold` is set, when it keeps
/// the reads' permission events unanswered until [`ReadGate::release`].
/// Dropping it releases them too (as the kernel does for a closed group).
pub struct ReadGate {
    shared: Arc<GateShared>,
    thread: Option<std::thread::JoinHandle<()>>,
}

struct GateShared {
    fd: OwnedFd,
    hold: AtomicBool,
    /// Event descriptors of reads held unanswered.
    held: Mutex<Vec<OwnedFd>>,
    /// Reads held so far.
    held_count: AtomicUsize,
    stop: AtomicBool,
}

impl GateShared {
    fn answer(&self, event_fd: &OwnedFd) {
        let r = libc::fanotify_response { fd: event_fd.as_raw_fd(), response: libc::FAN_ALLOW };
        // SAFETY: writes a plain struct of the fanotify ABI to our own descriptor.
        let n = unsafe {
            libc::write(self.fd.as_raw_fd(), &r as *const _ as *const libc::c_void, std::mem::size_of_val(&r))
        };
        assert_eq!(n, std::mem::size_of_val(&r) as isize, "fanotify response: {}", std::io::Error::last_os_error());
    }
}

impl ReadGate {
    /// Watches reads of `file`; None without the privilege (CAP_SYS_ADMIN)
    /// or kernel support. Must be set up before the daemon opens the file:
    /// the kernel decides at open whether a file's reads ask watchers.
    pub fn watch(file: &Path) -> Option<ReadGate> {
        // SAFETY: plain system calls on integers and a NUL-terminated path.
        let fd = unsafe { libc::fanotify_init(libc::FAN_CLASS_CONTENT | libc::FAN_CLOEXEC, libc::O_RDONLY as u32) };
        if fd < 0 {
            eprintln!("fanotify_init: {}", std::io::Error::last_os_error());
            return None;
        }
        // SAFETY: fanotify_init returned a descriptor that is ours alone.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        let path = CString::new(file.as_os_str().as_bytes()).unwrap();
        // SAFETY: as above.
        let rc = unsafe { libc::fanotify_mark(fd.as_raw_fd(), libc::FAN_MARK_ADD, libc::FAN_ACCESS_PERM, libc::AT_FDCWD, path.as_ptr()) };
        if rc < 0 {
            eprintln!("fanotify_mark: {}", std::io::Error::last_os_error());
            return None;
        }
        let shared = Arc::new(GateShared {
            fd,
            hold: AtomicBool::new(false),
            held: Mutex::new(Vec::new()),
            held_count: AtomicUsize::new(0),
            stop: AtomicBool::new(false),
        });
        let s = Arc::clone(&shared);
        let thread = std::thread::spawn(move || Self::serve(&s));
        Some(ReadGate { shared, thread: Some(thread) })
    }

    fn serve(s: &GateShared) {
        let mut buf = vec![0u8; 4096];
        while !s.stop.load(Ordering::Acquire) {
            let mut pfd = libc::pollfd { fd: s.fd.as_raw_fd(), events: libc::POLLIN, revents: 0 };
            // SAFETY: one pollfd on the stack.
            if unsafe { libc::poll(&mut pfd, 1, 50) } <= 0 {
                continue;
            }
            // SAFETY: reads into our own buffer.
            let n = unsafe { libc::read(s.fd.as_raw_fd(), buf.as_mut_ptr() as *mut libc::c_void, buf.len()) };
            if n <= 0 {
                continue;
            }
            let mut at = 0;
            while at + std::mem::size_of::<libc::fanotify_event_metadata>() <= n as usize {
                // SAFETY: the kernel wrote whole event records; read unaligned.
                let m: libc::fanotify_event_metadata = unsafe { std::ptr::read_unaligned(buf[at..].as_ptr() as *const _) };
                assert_eq!(m.vers, libc::FANOTIFY_METADATA_VERSION, "fanotify metadata version");
                at += m.event_len as usize;
                if m.fd < 0 {
                    continue;
                }
                // SAFETY: the event's descriptor is ours to close.
                let event_fd = unsafe { OwnedFd::from_raw_fd(m.fd) };
                if m.mask & libc::FAN_ACCESS_PERM == 0 {
                    continue;
                }
                // Under the lock `release` takes: no read is kept after it.
                let mut held = s.held.lock().unwrap();
                if s.hold.load(Ordering::Acquire) {
                    held.push(event_fd);
                    s.held_count.fetch_add(1, Ordering::AcqRel);
                } else {
                    drop(held);
                    s.answer(&event_fd);
                }
            }
        }
    }

    /// From now on reads are held.
    pub fn hold(&self) {
        self.shared.hold.store(true, Ordering::Release);
    }

    /// Reads held so far.
    pub fn held(&self) -> usize {
        self.shared.held_count.load(Ordering::Acquire)
    }

    /// Lets the held reads go on, and the next ones.
    pub fn release(&self) {
        let mut held = self.shared.held.lock().unwrap();
        self.shared.hold.store(false, Ordering::Release);
        for fd in held.drain(..) {
            self.shared.answer(&fd);
        }
    }
}

impl Drop for ReadGate {
    fn drop(&mut self) {
        self.release();
        self.shared.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// A directory on tmpfs whose files take O_DIRECT, if there is one.
pub fn tmpfs_dir() -> Option<tempfile::TempDir> {
    let dir = tempfile::tempdir_in("/dev/shm").ok()?;
    let probe = crate::sparse_file(dir.path(), "probe", 1 << 16);
    let direct = std::fs::OpenOptions::new().read(true).custom_flags(libc::O_DIRECT).open(&probe);
    if let Err(e) = direct {
        eprintln!("/dev/shm: O_DIRECT: {e}");
        return None;
    }
    Some(dir)
}
