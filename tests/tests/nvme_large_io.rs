//! NVMe-oF commands as large as the configuration allows (issue 53), over
//! NVMe/TCP with the test harness's own host: the real daemon, file
//! volumes on sparse files.
//!
//! - Identify Controller's MDTS follows `target.max_io_size` (1 MiB by
//!   default: MDTS 8; 4 MiB: MDTS 10), and CAP.MQES `target.nvme_queue_size`;
//! - single Read and Write commands of 1 MiB and 4 MiB, each one command on
//!   the wire, served in pool chunks inside the target, read back identical
//!   and checked against the backing file;
//! - a command one block above MDTS is refused with Invalid Field, and the
//!   queue goes on;
//! - a deep queue: 512 outstanding commands on an I/O queue of 1024
//!   entries, all completing with the right data;
//! - a 4 MiB command through a session pool share of 2 chunks: it moves
//!   chunk by chunk and never waits for all its chunks at once.

use std::net::SocketAddr;
use std::path::Path;

use rand::SeedableRng;
use rdmablk_common::nvme::fabrics::property;
use rdmablk_common::nvme::sqe::io_opcode;
use rdmablk_common::nvme::status::Status;
use rdmablk_common::nvme::tcp::Digests;
use rdmablk_system_tests::nvme_tcp::{rw_entry, Cmd, IdCtrl, NvmeTcpConn};
use rdmablk_system_tests::{file_bytes, file_volume, listen_host, random_bytes, sparse_file, TargetProcess};

const MIB: u64 = 1 << 20;
const VOL_SIZE: u64 = 64 * MIB;
const BS: u32 = 4096;
const SUBNQN: &str = "nqn.2026-12.io.rdmablk.test:nvme-large-io";
const HOSTNQN: &str = "nqn.2014-08.org.nvmexpress:uuid:53535353-4f89-11d3-9a0c-0305e82c3301";
const NO_DIGESTS: Digests = Digests { header: false, data: false };

fn seed() -> u64 {
    std::env::var("RDMABLK_TEST_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or_else(rand::random)
}

/// A daemon with an NVMe/TCP listener, `extra` lines in `[target]` and one
/// file volume "a" of `VOL_SIZE` in `dir`.
fn start(dir: &Path, extra: &str) -> (TargetProcess, SocketAddr, std::path::PathBuf) {
    let host = listen_host();
    let host = if host.contains(':') { format!("[{host}]") } else { host };
    let file = sparse_file(dir, "a.img", VOL_SIZE);
    let config = format!(
        "[target]\nlisten = [\"nvme+tcp://{host}:0\"]\nnqn = \"{SUBNQN}\"\n{extra}\n{}",
        file_volume("a", &file, VOL_SIZE, false)
    );
    let path = dir.join("target.toml");
    std::fs::write(&path, config).unwrap();
    let target = TargetProcess::start_with_path(&path);
    let addr = target.nvme_tcp_addr();
    (target, addr, file)
}

/// An enabled admin queue asking for 2 I/O queues, and its MDTS and CAP.
fn controller(addr: SocketAddr) -> (NvmeTcpConn, u16, u8, u64) {
    let (mut admin, cntlid) = NvmeTcpConn::admin(addr, NO_DIGESTS, SUBNQN, HOSTNQN, 0);
    admin.set_features(0x07, 1 | 1 << 16).expect("Set Features number of queues");
    let cap = admin.property_get(property::CAP, true).expect("Property Get CAP");
    let ctrl = IdCtrl::parse(&admin.identify(1, 0).expect("Identify Controller"));
    (admin, cntlid, ctrl.mdts, cap)
}

/// Writes `data` at `slba` in one command, reads it back in one command and
/// checks both the answer and the backing file.
fn round_trip(q: &mut NvmeTcpConn, file: &Path, slba: u64, data: &[u8], what: &str) {
    q.write(1, slba, data, false).unwrap_or_else(|s| panic!("{what}: one Write of {} bytes: {s}", data.len()));
    let blocks = (data.len() / BS as usize) as u32;
    let back = q.read(1, slba, blocks, BS).unwrap_or_else(|s| panic!("{what}: one Read of {} bytes: {s}", data.len()));
    assert!(back == data, "{what}: the Read did not return what the Write wrote");
    assert!(file_bytes(file, slba * BS as u64, data.len()) == data, "{what}: the backing file differs");
}

#[test]
fn default_max_io_size_gives_mdts_of_1_mib_and_a_1_mib_command_is_one_command() {
    let dir = tempfile::tempdir().unwrap();
    let (_target, addr, file) = start(dir.path(), "");
    let (_admin, cntlid, mdts, cap) = controller(addr);
    let mut q = NvmeTcpConn::io(addr, NO_DIGESTS, cntlid, 1, SUBNQN, HOSTNQN);
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed());
    let data = random_bytes(&mut rng, MIB as usize);
    round_trip(&mut q, &file, 256, &data, "1 MiB");
    assert_eq!(mdts, 8, "MDTS with the default max_io_size (1 MiB in 4 KiB pages)");
    assert_eq!(cap & 0xffff, 1023, "CAP.MQES (0-based) with the default nvme_queue_size: {cap:#x}");
    // One block more than MDTS: Invalid Field, and the queue goes on.
    let over = (MIB / BS as u64) as u32 + 1;
    let c = q.exec(rw_entry(io_opcode::READ, 1, 0, over, false), &[], &[], over as usize * BS as usize);
    assert_eq!(c.cqe.status, Status::INVALID_FIELD, "a Read above MDTS");
    round_trip(&mut q, &file, 1024, &data[..64 << 10], "64 KiB after the refusal");
}

#[test]
fn max_io_size_of_4_mib_gives_mdts_10_and_single_4_mib_commands() {
    let dir = tempfile::tempdir().unwrap();
    let (_target, addr, file) = start(dir.path(), "max_io_size = \"4MiB\"\nnvme_queue_size = 256\n");
    let (_admin, cntlid, mdts, cap) = controller(addr);
    assert_eq!(mdts, 10, "MDTS with max_io_size 4 MiB");
    assert_eq!(cap & 0xffff, 255, "CAP.MQES (0-based) with nvme_queue_size 256: {cap:#x}");
    let mut q = NvmeTcpConn::io(addr, NO_DIGESTS, cntlid, 1, SUBNQN, HOSTNQN);
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed());
    let data = random_bytes(&mut rng, 4 * MIB as usize);
    round_trip(&mut q, &file, 0, &data, "4 MiB");
    round_trip(&mut q, &file, 4096, &data[..MIB as usize], "1 MiB");
    // Two 4 MiB commands at once, a write and a read of other blocks.
    let other = random_bytes(&mut rng, 4 * MIB as usize);
    let blocks = (4 * MIB / BS as u64) as u32;
    let cmds = [
        Cmd::new(rw_entry(io_opcode::WRITE, 1, 2048, blocks, false), &[], &other, 0),
        Cmd::new(rw_entry(io_opcode::READ, 1, 0, blocks, false), &[], &[], 4 * MIB as usize),
    ];
    let done = q.execute_many(&cmds).expect("a 4 MiB write and read at once");
    assert!(done.iter().all(|c| c.cqe.status.is_success()), "{:?}", done.iter().map(|c| c.cqe.status).collect::<Vec<_>>());
    assert!(done[1].data == data, "the concurrent 4 MiB read");
    assert!(file_bytes(&file, 2048 * BS as u64, other.len()) == other, "the concurrent 4 MiB write");
    let over = blocks + 1;
    let c = q.exec(rw_entry(io_opcode::WRITE, 1, 0, over, false), &[], &vec![0; over as usize * BS as usize], 0);
    assert_eq!(c.cqe.status, Status::INVALID_FIELD, "a Write above MDTS");
    // A queue larger than nvme_queue_size is refused at Connect.
    let mut big = NvmeTcpConn::connect(addr, NO_DIGESTS);
    assert!(big.io_connect_sized(cntlid, 2, 256, SUBNQN, HOSTNQN).is_err(), "Connect with SQSIZE 256 (257 entries) above MQES 255");
}

#[test]
fn a_deep_queue_of_1024_entries_holds_512_outstanding_commands() {
    let dir = tempfile::tempdir().unwrap();
    let (_target, addr, file) = start(dir.path(), "");
    let (_admin, cntlid, _, _) = controller(addr);
    let mut q = NvmeTcpConn::connect(addr, NO_DIGESTS);
    q.io_connect_sized(cntlid, 1, 1023, SUBNQN, HOSTNQN).expect("an I/O queue of 1024 entries");
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed());
    // 512 writes of 32 KiB (by R2T) at once, then 512 reads of them at once.
    const N: usize = 512;
    const LEN: usize = 32 << 10;
    let data = random_bytes(&mut rng, N * LEN);
    let blocks = (LEN / BS as usize) as u32;
    let lba = |i: usize| (i * LEN / BS as usize) as u64;
    let writes: Vec<Cmd<'_>> =
        (0..N).map(|i| Cmd::new(rw_entry(io_opcode::WRITE, 1, lba(i), blocks, false), &[], &data[i * LEN..(i + 1) * LEN], 0)).collect();
    let done = q.execute_many(&writes).expect("512 outstanding writes");
    assert!(done.iter().all(|c| c.cqe.status.is_success()), "every write succeeds");
    let reads: Vec<Cmd<'_>> =
        (0..N).map(|i| Cmd::new(rw_entry(io_opcode::READ, 1, lba(i), blocks, false), &[], &[], LEN)).collect();
    let done = q.execute_many(&reads).expect("512 outstanding reads");
    for (i, c) in done.iter().enumerate() {
        assert!(c.cqe.status.is_success(), "read {i}: {}", c.cqe.status);
        assert!(c.data == data[i * LEN..(i + 1) * LEN], "read {i} returned other data");
    }
    assert!(file_bytes(&file, 0, data.len()) == data, "the backing file");
}

#[test]
fn a_command_larger_than_its_session_pool_share_moves_chunk_by_chunk() {
    // 16 chunks of 128 KiB per reactor, 2 of them per controller: a 4 MiB
    // command needs 32 pieces and never waits for all of them at once.
    let dir = tempfile::tempdir().unwrap();
    let extra = "max_io_size = \"4MiB\"\nbuffer_pool = \"2MiB\"\nchunk_size = \"128KiB\"\nsession_pool_share = \"256KiB\"\n";
    let (_target, addr, file) = start(dir.path(), extra);
    let (_admin, cntlid, mdts, _) = controller(addr);
    assert_eq!(mdts, 10, "MDTS with max_io_size 4 MiB, whatever the pool");
    let mut q = NvmeTcpConn::io(addr, NO_DIGESTS, cntlid, 1, SUBNQN, HOSTNQN);
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed());
    let data = random_bytes(&mut rng, 4 * MIB as usize);
    round_trip(&mut q, &file, 1024, &data, "4 MiB through a share of 2 chunks");
    // Two at once, a write and a read, still within the share.
    let blocks = (4 * MIB / BS as u64) as u32;
    let cmds = [
        Cmd::new(rw_entry(io_opcode::WRITE, 1, 8192, blocks, false), &[], &data, 0),
        Cmd::new(rw_entry(io_opcode::READ, 1, 1024, blocks, false), &[], &[], 4 * MIB as usize),
    ];
    let done = q.execute_many(&cmds).expect("a 4 MiB write and read at once through a share of 2 chunks");
    assert!(done.iter().all(|c| c.cqe.status.is_success()), "{:?}", done.iter().map(|c| c.cqe.status).collect::<Vec<_>>());
    assert!(done[1].data == data && file_bytes(&file, 8192 * BS as u64, data.len()) == data, "the data of the concurrent commands");
}
