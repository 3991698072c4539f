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

use std::net::SocketAddr;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use rdmablk_common::nvme::sqe::{admin_opcode, io_opcode, Sgl, SubmissionEntry};
use rdmablk_common::nvme::tcp::{Digests, Pdu};
use rdmablk_system_tests::nvme_tcp::{rw_entry, NvmeTcpConn};
use rdmablk_system_tests::read_gate::{cpu_ticks, tmpfs_dir, ReadGate};
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

/// A daemon on a config file in `dir`.
fn start_on(dir: &Path, config: &str) -> (TargetProcess, SocketAddr, PathBuf) {
    let path = dir.join("target.toml");
    std::fs::write(&path, config).unwrap();
    let target = TargetProcess::start_with_path(&path);
    let addr = target.nvme_tcp_addr();
    (target, addr, path)
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
