//! NVMe/TCP connections that close while the disk still holds one of
//! their commands: the real daemon with an `nvme+tcp://` listener and a
//! file volume, driven by the test harness's own NVMe/TCP host
//! (`rdmablk_system_tests::nvme_tcp`).
//!
//! A disk read is held "at the disk" by a fanotify permission watch on the
//! volume's file (`FAN_ACCESS_PERM`: the kernel asks the watcher before a
//! read of it goes on, and the test answers only when it wants the read to
//! end). That needs CAP_SYS_ADMIN. The file is on tmpfs (`/dev/shm`): a
//! tmpfs read cannot be tried without waiting, so io_uring hands it to its
//! worker thread, which waits for the answer; a file system whose reads
//! io_uring tries at once (ext4) would have the reactor's own thread wait
//! in `io_uring_enter`, and nothing would be left to measure. Without the
//! privilege, a tmpfs taking O_DIRECT (Linux 6.6) or a reactor that stays
//! free while the read is held, the test says so and passes.

use std::ffi::CString;
use std::net::{SocketAddr, ToSocketAddrs};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rdmablk_common::nvme::sqe::{admin_opcode, io_opcode, Sgl, SubmissionEntry};
use rdmablk_common::nvme::tcp::{Digests, Pdu};
use rdmablk_system_tests::nvme_tcp::{rw_entry, NvmeTcpConn};
use rdmablk_system_tests::{file_volume, listen_host, sparse_file, TargetProcess};

const MIB: u64 = 1 << 20;
const VOL_SIZE: u64 = 16 * MIB;
const BS: u32 = 4096;
const SUBNQN: &str = "nqn.2026-11.io.rdmablk.test:nvme-tcp-close";
const HOSTNQN: &str = "nqn.2014-08.org.nvmexpress:uuid:3f2504e0-4f89-11d3-9a0c-0305e82c3302";
const NO_DIGESTS: Digests = Digests { header: false, data: false };
/// The target's grace for a closing connection's last PDUs (`CLOSE_GRACE`
/// in `target-daemon/src/nvmf/tcp.rs`).
const CLOSE_GRACE: Duration = Duration::from_secs(2);

/// A `[target]` section with only an NVMe/TCP listener on port 0 and the
/// suite's subsystem NQN; `extra` lines go into it.
fn nvme_section(extra: &str) -> String {
    let host = listen_host();
    let host = if host.contains(':') { format!("[{host}]") } else { host };
    format!("[target]\nlisten = [\"nvme+tcp://{host}:0\"]\nnqn = \"{SUBNQN}\"\n{extra}")
}

/// The NVMe/TCP listener's address, from the daemon's "listening on
/// nvme+tcp://IP:PORT" line.
fn nvme_addr(target: &TargetProcess) -> SocketAddr {
    let line = target.wait_for_log("listening on nvme+tcp://", Duration::from_secs(10));
    let at = line.find("nvme+tcp://").unwrap() + "nvme+tcp://".len();
    let hp: String = line[at..].chars().take_while(|c| !c.is_whitespace() && *c != '"' && *c != ',').collect();
    hp.to_socket_addrs().unwrap_or_else(|e| panic!("{hp:?} from {line:?}: {e}")).next().expect("an address")
}

/// A daemon on a config file in `dir`.
fn start_on(dir: &Path, config: &str) -> (TargetProcess, SocketAddr, PathBuf) {
    let path = dir.join("target.toml");
    std::fs::write(&path, config).unwrap();
    let target = TargetProcess::start_with_path(&path);
    let addr = nvme_addr(&target);
    (target, addr, path)
}

/// CPU time (user + system) the process has used, in USER_HZ ticks (100 a
/// second on Linux), from /proc.
fn cpu_ticks(pid: u32) -> u64 {
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
struct ReadGate {
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
    fn watch(file: &Path) -> Option<ReadGate> {
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
    fn hold(&self) {
        self.shared.hold.store(true, Ordering::Release);
    }

    /// Reads held so far.
    fn held(&self) -> usize {
        self.shared.held_count.load(Ordering::Acquire)
    }

    /// Lets the held reads go on, and the next ones.
    fn release(&self) {
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
fn tmpfs_dir() -> Option<tempfile::TempDir> {
    let dir = tempfile::tempdir_in("/dev/shm").ok()?;
    let probe = sparse_file(dir.path(), "probe", 1 << 16);
    let direct = std::fs::OpenOptions::new().read(true).custom_flags(libc::O_DIRECT).open(&probe);
    if let Err(e) = direct {
        eprintln!("/dev/shm: O_DIRECT: {e}");
        return None;
    }
    Some(dir)
}

/// A connection the host closed while a read of it is held at the disk
/// waits only for that read once its grace is over: it sleeps until the
/// read ends (no deadline of its own; the executor's news wakes it), it
/// does not spin its reactor. Then it ends, and its queue id is free.
#[test]
fn a_closed_connection_waiting_for_a_disk_read_does_not_spin_its_reactor() {
    let Some(dir) = tmpfs_dir() else {
        eprintln!("skipping: no tmpfs at /dev/shm that takes O_DIRECT");
        return;
    };
    let img = sparse_file(dir.path(), "vol.img", VOL_SIZE);
    let file = std::fs::OpenOptions::new().write(true).open(&img).unwrap();
    file.write_all_at(&[0x5a; BS as usize], 0).unwrap();
    let Some(gate) = ReadGate::watch(&img) else {
        eprintln!("skipping: no fanotify permission watch (needs CAP_SYS_ADMIN)");
        return;
    };
    // One reactor: the admin queue shows whether the I/O queue's reactor is free.
    let config = format!("{}\n{}nsid = 1\n", nvme_section("reactors = 1\n"), file_volume("vol", &img, VOL_SIZE, false));
    let (target, addr, _) = start_on(dir.path(), &config);
    let (mut admin, cntlid) = NvmeTcpConn::admin(addr, NO_DIGESTS, SUBNQN, HOSTNQN, 0);
    admin.set_features(0x07, 1 | 1 << 16).unwrap();
    let mut q = NvmeTcpConn::io(addr, NO_DIGESTS, cntlid, 1, SUBNQN, HOSTNQN);
    assert_eq!(q.read(1, 0, 1, BS).unwrap(), vec![0x5au8; BS as usize], "a read before the hold");

    gate.hold();
    let mut e = rw_entry(io_opcode::READ, 1, 0, 1, false);
    e.set_sgl(Sgl::Transport { length: BS });
    q.send_command(e, &[]);
    let until = Instant::now() + Duration::from_secs(10);
    while gate.held() == 0 {
        assert!(Instant::now() < until, "the read never reached the disk");
        std::thread::sleep(Duration::from_millis(10));
    }
    // The read waits in io_uring's worker, not in the reactor's thread.
    admin.send_command(SubmissionEntry::new(admin_opcode::KEEP_ALIVE, 0), &[]);
    match admin.recv_pdu_within(Duration::from_secs(3)) {
        Ok((Pdu::CapsuleResp(c), _)) => assert!(c.status.is_success(), "Keep Alive while the read is held: {}", c.status),
        other => {
            gate.release();
            eprintln!("skipping: the held read holds the reactor's own thread (Keep Alive: {other:?})");
            return;
        }
    }
    // The host goes away; the read stays at the disk past the close's grace.
    drop(q);
    std::thread::sleep(CLOSE_GRACE + Duration::from_millis(500));
    let before = cpu_ticks(target.pid());
    std::thread::sleep(Duration::from_secs(3));
    let spent = cpu_ticks(target.pid()) - before;
    gate.release();
    assert!(spent < 30, "the daemon used {spent} ticks of CPU in 3 s with a closed connection waiting for a disk read");

    // The read ends, then the connection: queue 1 can be connected again.
    let until = Instant::now() + Duration::from_secs(10);
    let mut q = loop {
        let mut q = NvmeTcpConn::connect(addr, NO_DIGESTS);
        match q.io_connect(cntlid, 1, SUBNQN, HOSTNQN) {
            Ok(_) => break q,
            Err(s) => assert!(Instant::now() < until, "I/O queue 1 is still taken after the read ended: {s}"),
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    assert_eq!(q.read(1, 0, 1, BS).unwrap(), vec![0x5au8; BS as usize], "a read after the release");
    admin.keep_alive().unwrap();
    target.assert_no_panic();
}
