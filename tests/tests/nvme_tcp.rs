//! The NVMe-oF front end over NVMe/TCP, end to end: the real daemon with an
//! `nvme+tcp://` listener and file volumes on real sparse files, driven by
//! the test harness's own NVMe/TCP host (`rdmablk_system_tests::nvme_tcp`),
//! which builds every PDU with the project's codec.
//!
//! - the admin queue: Connect, properties, enable, Identify (controller,
//!   namespace, active list, descriptors stable over a restart), features,
//!   log page, keep alive, an outstanding AER;
//! - the data path on two I/O queues (and one with both digests): in-capsule
//!   writes, R2T/H2CData writes, reads, checked against the backing file;
//! - Write Zeroes, Dataset Management (deallocate), Flush;
//! - command errors with their specific statuses, on a connection that
//!   keeps working;
//! - hostile PDUs, each on its own connection while a healthy controller
//!   keeps doing verified I/O: a C2HTermReq with the specific FES and a
//!   close, nothing written, no panic;
//! - keep-alive: a silent controller is torn down after KATO;
//! - the controller's life: Disconnect, shutdown, loss of the admin queue;
//! - discovery, per-host namespaces (`[[host]] nqn`), both front ends on
//!   one volume, and many controllers and queues in parallel.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rand::{Rng, SeedableRng};
use rdmablk_common::nvme::fabrics::{connect_data_offset, invalid_connect_parameter, property, Property, ANY_CONTROLLER};
use rdmablk_common::nvme::sqe::{admin_opcode, io_opcode, Sgl, SubmissionEntry};
use rdmablk_common::nvme::status::Status;
use rdmablk_common::nvme::tcp::{fes, DataPdu, Digests, Pdu, R2t, TermReq};
use rdmablk_system_tests::nvme_tcp::{
    connect_data, connect_entry, parse_ns_descriptors, parse_ns_list, rw_entry, Cmd, IdCtrl, IdNs, NvmeTcpConn, CC_ENABLE,
    Termination,
};
use rdmablk_system_tests::{
    file_bytes, file_volume, listen_host, null_volume, random_bytes, sample, scrape, sparse_file, wait_until, BusyCpus, TargetProcess,
};

const KIB: usize = 1024;
const MIB: u64 = 1 << 20;
const VOL_SIZE: u64 = 64 * MIB;
const BS: u32 = 4096;
const SUBNQN: &str = "nqn.2026-11.io.rdmablk.test:nvme-tcp-subsystem";
const HOSTNQN: &str = "nqn.2014-08.org.nvmexpress:uuid:3f2504e0-4f89-11d3-9a0c-0305e82c3301";
const NO_DIGESTS: Digests = Digests { header: false, data: false };
const BOTH_DIGESTS: Digests = Digests { header: true, data: true };
/// NVMe-oF Transient Transport Error (generic 0x22), a data digest error's status.
const TRANSIENT_TRANSPORT_ERROR: Status = Status::generic(0x22);

fn seed() -> u64 {
    std::env::var("RDMABLK_TEST_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or_else(rand::random)
}

/// A `[target]` section with only an NVMe/TCP listener on port 0 and the
/// suite's subsystem NQN; `extra` lines go into it.
fn nvme_section(extra: &str) -> String {
    let host = listen_host();
    let host = if host.contains(':') { format!("[{host}]") } else { host };
    format!("[target]\nlisten = [\"nvme+tcp://{host}:0\"]\nnqn = \"{SUBNQN}\"\n{extra}")
}

/// A file volume block with an explicit namespace id and extra lines.
fn nvme_volume(name: &str, path: &Path, size: u64, read_only: bool, nsid: Option<u32>, extra: &str) -> String {
    let mut v = file_volume(name, path, size, read_only);
    if let Some(n) = nsid {
        v.push_str(&format!("nsid = {n}\n"));
    }
    v.push_str(extra);
    v
}

/// A daemon on a config file in `dir` (kept, for restarts).
fn start_on(dir: &Path, config: &str) -> (TargetProcess, SocketAddr, PathBuf) {
    let path = dir.join("target.toml");
    std::fs::write(&path, config).unwrap();
    let target = TargetProcess::start_with_path(&path);
    let addr = target.nvme_tcp_addr();
    (target, addr, path)
}

/// An enabled admin queue of host `HOSTNQN` asking for 4 I/O queues.
fn controller(addr: SocketAddr) -> (NvmeTcpConn, u16) {
    controller_of(addr, HOSTNQN)
}

/// An enabled admin queue of `hostnqn` asking for 4 I/O queues.
fn controller_of(addr: SocketAddr, hostnqn: &str) -> (NvmeTcpConn, u16) {
    let (mut admin, cntlid) = NvmeTcpConn::admin(addr, NO_DIGESTS, SUBNQN, hostnqn, 0);
    let granted = admin.set_features(0x07, 3 | 3 << 16).unwrap_or_else(|s| panic!("Set Features number of queues: {s}"));
    assert!(granted as u16 >= 1 && (granted >> 16) as u16 >= 1, "the target granted fewer than 2 I/O queue pairs: {granted:#x}");
    (admin, cntlid)
}

fn assert_status<T: std::fmt::Debug>(what: &str, got: Result<T, Status>, want: Status) {
    match got {
        Err(s) => assert_eq!(s, want, "{what}: expected {want}, got {s}"),
        Ok(v) => panic!("{what}: expected {want}, the command succeeded ({v:?})"),
    }
}

// ---------------------------------------------------------------------------
// 1. The admin queue

#[test]
fn admin_queue_connects_enables_and_identifies_controller_and_namespaces() {
    let dir = tempfile::tempdir().unwrap();
    let a = sparse_file(dir.path(), "a.img", VOL_SIZE);
    let b = sparse_file(dir.path(), "b.img", 16 * MIB);
    let config = format!(
        "{}\n{}\n{}",
        nvme_section(""),
        nvme_volume("a", &a, VOL_SIZE, false, None, ""),
        nvme_volume("b", &b, 16 * MIB, false, Some(7), "block_size = 512\n"),
    );
    let (mut target, addr, config_path) = start_on(dir.path(), &config);

    let mut admin = NvmeTcpConn::connect(addr, NO_DIGESTS);
    let cntlid = admin.admin_connect(SUBNQN, HOSTNQN, 0).expect("admin Connect");
    assert_ne!(cntlid, ANY_CONTROLLER, "Connect DW0 is the controller id, never 0xFFFF");

    // Properties before enabling.
    let cap = admin.property_get(property::CAP, true).expect("Property Get CAP");
    assert_eq!(cap & 0xffff, 1023, "CAP.MQES (0-based): the default nvme_queue_size: {cap:#x}");
    assert_eq!((cap >> 48) & 0xf, 0, "CAP.MPSMIN is 4 KiB: {cap:#x}");
    assert_ne!((cap >> 37) & 1, 0, "CAP.CSS bit 0 (NVM command set): {cap:#x}");
    let vs = admin.property_get(property::VS, false).expect("Property Get VS");
    assert_eq!(vs, 0x0001_0300, "VS");
    let csts = admin.property_get(property::CSTS, false).expect("Property Get CSTS");
    assert_eq!(csts & 1, 0, "CSTS.RDY before CC.EN: {csts:#x}");
    admin.enable();
    let cc = admin.property_get(property::CC, false).expect("Property Get CC");
    assert_eq!(cc & 0x00ff_0001, 0x0046_0001, "CC reads back as set: {cc:#x}");

    // Identify Controller.
    let ctrl = IdCtrl::parse(&admin.identify(1, 0).expect("Identify Controller"));
    eprintln!("identify controller: {ctrl:?}");
    assert_eq!(ctrl.cntlid, cntlid, "CNTLID in Identify Controller vs Connect DW0");
    assert_eq!(ctrl.subnqn, SUBNQN, "SUBNQN");
    assert_eq!(ctrl.mdts, 8, "MDTS (the default max_io_size, 1 MiB with 4 KiB pages)");
    assert!(ctrl.nn >= 7, "NN ({}) must cover the largest namespace id (7)", ctrl.nn);
    assert_eq!(ctrl.ioccsz, 1028, "IOCCSZ: 64-byte SQE + 16 KiB in-capsule data, in 16-byte units");
    assert_eq!(ctrl.iorcsz, 1, "IORCSZ: a 16-byte CQE");
    assert_eq!(ctrl.ofcs, 1, "OFCS: Disconnect of an I/O queue is supported (and tested below)");
    assert_ne!(ctrl.sgls & 0b11, 0, "SGLS: SGLs are mandatory on fabrics ({:#x})", ctrl.sgls);
    assert_ne!(ctrl.kas, 0, "KAS: keep alive is mandatory on fabrics");

    // Identify Namespace: sizes and LBA formats as configured.
    let ns1 = IdNs::parse(&admin.identify(0, 1).expect("Identify Namespace 1"));
    assert_eq!(ns1.nsze, VOL_SIZE / 4096, "NSZE of namespace 1 (volume a, the default nsid 1)");
    assert_eq!(ns1.block_size(), 4096, "LBA format of namespace 1: {ns1:?}");
    assert!(ns1.ncap <= ns1.nsze && ns1.ncap > 0, "NCAP {ns1:?}");
    let ns7 = IdNs::parse(&admin.identify(0, 7).expect("Identify Namespace 7"));
    assert_eq!(ns7.nsze, 16 * MIB / 512, "NSZE of namespace 7 (volume b, 512-byte blocks)");
    assert_eq!(ns7.block_size(), 512, "LBA format of namespace 7: {ns7:?}");
    // An inactive namespace id within NN: a zero-filled structure (NVMe
    // Base 2.0, Identify CNS 00h).
    match admin.identify(0, 5) {
        Ok(data) => assert!(data.iter().all(|&b| b == 0), "Identify Namespace of inactive nsid 5 is not zero-filled"),
        Err(s) => panic!("Identify Namespace of inactive nsid 5 (≤ NN): expected a zero-filled structure, got {s}"),
    }

    // Active namespace lists.
    assert_eq!(parse_ns_list(&admin.identify(2, 0).expect("active ns list")), vec![1, 7]);
    assert_eq!(parse_ns_list(&admin.identify(2, 1).expect("active ns list above 1")), vec![7]);
    assert_eq!(parse_ns_list(&admin.identify(2, 7).expect("active ns list above 7")), Vec::<u32>::new());

    // Namespace identification descriptors: an NGUID and a UUID each, distinct.
    let descriptors = |admin: &mut NvmeTcpConn, nsid: u32| {
        let d = parse_ns_descriptors(&admin.identify(3, nsid).unwrap_or_else(|s| panic!("ns descriptors of {nsid}: {s}")));
        let nguid = d.iter().find(|(t, _)| *t == 2).map(|(_, v)| v.clone()).unwrap_or_else(|| panic!("no NGUID descriptor for nsid {nsid}: {d:?}"));
        let uuid = d.iter().find(|(t, _)| *t == 3).map(|(_, v)| v.clone()).unwrap_or_else(|| panic!("no UUID descriptor for nsid {nsid}: {d:?}"));
        assert_eq!((nguid.len(), uuid.len()), (16, 16), "NIDL of NGUID and UUID");
        assert!(nguid.iter().any(|&b| b != 0) && uuid.iter().any(|&b| b != 0), "zero NGUID/UUID for nsid {nsid}");
        (nguid, uuid)
    };
    let (nguid1, uuid1) = descriptors(&mut admin, 1);
    let (nguid7, uuid7) = descriptors(&mut admin, 7);
    assert_ne!(nguid1, nguid7, "namespaces share an NGUID");
    assert_ne!(uuid1, uuid7, "namespaces share a UUID");
    assert_eq!(ns1.nguid.to_vec(), nguid1, "Identify Namespace NGUID vs its descriptor");
    assert_eq!(ns7.nguid.to_vec(), nguid7, "Identify Namespace NGUID vs its descriptor");

    // Features, a log page, keep alive, and an AER that stays outstanding.
    let granted = admin.set_features(0x07, 1 | 1 << 16).expect("Set Features number of queues");
    assert!(granted as u16 >= 1 && (granted >> 16) as u16 >= 1, "granted {granted:#x}");
    let current = admin.get_features(0x07).expect("Get Features number of queues");
    assert_eq!(current, granted, "Get Features returns what Set Features granted");
    let smart = admin.get_log_page(0x02, 0xffff_ffff, 512).expect("Get Log Page SMART / health");
    assert_eq!(smart.len(), 512);
    admin.get_log_page(0x01, 0, 64).expect("Get Log Page Error Information");
    let effects = admin.get_log_page(0x05, 0, 4096).expect("Get Log Page Commands Supported and Effects");
    let csupp = |at: usize| u32::from_le_bytes(effects[at..at + 4].try_into().unwrap()) & 1 == 1;
    for op in [admin_opcode::IDENTIFY, admin_opcode::GET_LOG_PAGE, admin_opcode::KEEP_ALIVE] {
        assert!(csupp(4 * op as usize), "effects log: admin opcode {op:#04x} not marked supported");
    }
    for op in [io_opcode::FLUSH, io_opcode::WRITE, io_opcode::READ, io_opcode::WRITE_ZEROES, io_opcode::DATASET_MANAGEMENT] {
        assert!(csupp(1024 + 4 * op as usize), "effects log: I/O opcode {op:#04x} not marked supported");
    }
    assert!(!csupp(1024 + 4 * 0x55), "effects log: unknown I/O opcode 0x55 marked supported");
    let aer = admin.submit_aer();
    admin.keep_alive().expect("Keep Alive");
    admin.keep_alive().expect("Keep Alive");
    assert!(admin.stray.iter().all(|c| c.cid != aer), "the AER completed without an event: {:?}", admin.stray);
    // An unknown admin opcode.
    let c = admin.exec(SubmissionEntry::new(0x55, 0), &[], &[], 0);
    assert_eq!(c.cqe.status, Status::INVALID_OPCODE, "unknown admin opcode 0x55");
    target.assert_no_panic();

    // The same namespaces keep their NGUID and UUID over a restart.
    drop(admin);
    target.kill_and_wait();
    let target = TargetProcess::start_with_path(&config_path);
    let addr = target.nvme_tcp_addr();
    let (mut admin, _) = NvmeTcpConn::admin(addr, NO_DIGESTS, SUBNQN, HOSTNQN, 0);
    assert_eq!(descriptors(&mut admin, 1), (nguid1, uuid1), "namespace 1's NGUID/UUID changed over a restart");
    assert_eq!(descriptors(&mut admin, 7), (nguid7, uuid7), "namespace 7's NGUID/UUID changed over a restart");
    target.assert_no_panic();
}

#[test]
fn connect_refuses_the_wrong_subsystem_and_a_second_connect() {
    let dir = tempfile::tempdir().unwrap();
    let a = sparse_file(dir.path(), "a.img", VOL_SIZE);
    let (target, addr, _) = start_on(dir.path(), &format!("{}\n{}", nvme_section(""), nvme_volume("a", &a, VOL_SIZE, false, None, "")));

    // A subsystem NQN the target does not serve.
    let mut c = NvmeTcpConn::connect(addr, NO_DIGESTS);
    let data = connect_data(ANY_CONTROLLER, "nqn.2026-11.io.example:nobody", HOSTNQN);
    let r = c.exec(connect_entry(0, 31, 0), &data, &[], 0);
    assert_eq!(r.cqe.status, Status::CONNECT_INVALID_PARAMETERS, "Connect to an unknown subsystem NQN");
    assert_eq!(r.cqe.result, invalid_connect_parameter(true, connect_data_offset::SUBSYSTEM_NQN), "IATTR/IPO name SUBNQN");
    drop(c);

    // The default NQN is not served when one is configured.
    let mut c = NvmeTcpConn::connect(addr, NO_DIGESTS);
    assert!(c.admin_connect("nqn.2014-08.io.rdmablk:rdmablk", HOSTNQN, 0).is_err(), "the default NQN is not this subsystem's");
    drop(c);

    // SQSIZE beyond CAP.MQES (1023).
    let mut c = NvmeTcpConn::connect(addr, NO_DIGESTS);
    let r = c.exec(connect_entry(0, 1024, 0), &connect_data(ANY_CONTROLLER, SUBNQN, HOSTNQN), &[], 0);
    assert!(!r.cqe.status.is_success(), "Connect with SQSIZE 1024 > MQES 1023 succeeded");
    drop(c);

    // A good Connect, then a second one on the same queue.
    let mut c = NvmeTcpConn::connect(addr, NO_DIGESTS);
    c.admin_connect(SUBNQN, HOSTNQN, 0).expect("admin Connect");
    let r = c.exec(connect_entry(0, 31, 0), &connect_data(ANY_CONTROLLER, SUBNQN, HOSTNQN), &[], 0);
    assert!(!r.cqe.status.is_success(), "a second Connect on a connected queue succeeded");

    // Connect data whose host NQN is not NUL-terminated, and Connect data
    // shorter than 1,024 bytes.
    let mut c = NvmeTcpConn::connect(addr, NO_DIGESTS);
    let r = c.exec(connect_entry(0, 31, 0), &connect_data(ANY_CONTROLLER, SUBNQN, HOSTNQN)[..512], &[], 0);
    assert!(!r.cqe.status.is_success(), "Connect with 512 bytes of Connect data succeeded");
    drop(c);
    let mut c = NvmeTcpConn::connect(addr, NO_DIGESTS);
    let mut data = connect_data(ANY_CONTROLLER, SUBNQN, HOSTNQN);
    data[512..768].fill(b'a');
    let r = c.exec(connect_entry(0, 31, 0), &data, &[], 0);
    assert_eq!(r.cqe.status, Status::CONNECT_INVALID_PARAMETERS, "Connect with an unterminated host NQN");
    assert_eq!(r.cqe.result, invalid_connect_parameter(true, connect_data_offset::HOST_NQN), "IATTR/IPO name HOSTNQN");
    drop(c);
    target.assert_no_panic();
}

// ---------------------------------------------------------------------------
// 2. The data path

#[test]
fn two_io_queues_write_and_read_back_in_capsule_and_by_r2t() {
    let dir = tempfile::tempdir().unwrap();
    let img = sparse_file(dir.path(), "vol.img", VOL_SIZE);
    let (target, addr, _) =
        start_on(dir.path(), &format!("{}\n{}", nvme_section(""), nvme_volume("vol", &img, VOL_SIZE, false, Some(1), "")));
    let seed = seed();
    eprintln!("seed {seed} (set RDMABLK_TEST_SEED to replay)");
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);

    let (mut admin, cntlid) = controller(addr);
    let mdts = 4096usize << IdCtrl::parse(&admin.identify(1, 0).unwrap()).mdts;
    assert_eq!(mdts, 1024 * KIB);
    let mut q1 = NvmeTcpConn::io(addr, NO_DIGESTS, cntlid, 1, SUBNQN, HOSTNQN);
    let mut q2 = NvmeTcpConn::io(addr, NO_DIGESTS, cntlid, 2, SUBNQN, HOSTNQN);
    let mut model = vec![0u8; VOL_SIZE as usize];

    let check = |q: &mut NvmeTcpConn, what: &str, lba: u64, data: &[u8], model: &mut Vec<u8>| {
        let off = lba as usize * BS as usize;
        model[off..off + data.len()].copy_from_slice(data);
        let blocks = (data.len() / BS as usize) as u32;
        let back = q.read(1, lba, blocks, BS).unwrap_or_else(|s| panic!("{what}: read back: {s}"));
        assert!(back == data, "{what}: read back other bytes at LBA {lba}");
        assert!(file_bytes(&img, off as u64, data.len()) == data, "{what}: the backing file differs at LBA {lba}");
    };

    // 4 KiB in the capsule.
    let d = random_bytes(&mut rng, 4 * KIB);
    q1.write(1, 10, &d, false).expect("4 KiB in-capsule write");
    check(&mut q2, "4 KiB in-capsule", 10, &d, &mut model);
    // Exactly 16 KiB in the capsule (the largest IOCCSZ allows), with FUA.
    let d = random_bytes(&mut rng, 16 * KIB);
    q2.write(1, 20, &d, true).expect("16 KiB in-capsule write");
    check(&mut q1, "16 KiB in-capsule", 20, &d, &mut model);
    // 20 KiB and 64 KiB by R2T/H2CData.
    let d = random_bytes(&mut rng, 20 * KIB);
    q1.write(1, 40, &d, false).expect("20 KiB write by R2T");
    check(&mut q1, "20 KiB by R2T", 40, &d, &mut model);
    let d = random_bytes(&mut rng, 64 * KIB);
    q2.write(1, 100, &d, false).expect("64 KiB write by R2T");
    check(&mut q1, "64 KiB by R2T", 100, &d, &mut model);
    // 2 MiB, split by the host into commands of MDTS.
    let d = random_bytes(&mut rng, 2 * mdts);
    for (i, part) in d.chunks(mdts).enumerate() {
        q1.write(1, 1000 + (i * mdts / BS as usize) as u64, part, false).expect("MDTS-sized write by R2T");
    }
    check(&mut q2, "2 MiB in MDTS pieces (first half)", 1000, &d[..mdts], &mut model);
    check(&mut q2, "2 MiB in MDTS pieces (second half)", 1000 + (mdts / BS as usize) as u64, &d[mdts..], &mut model);
    // The host splits an R2T's data over several H2CData PDUs.
    q2.h2c_chunk = 16 * KIB as u32;
    let d = random_bytes(&mut rng, 128 * KIB);
    q2.write(1, 2000, &d, false).expect("128 KiB write in 16 KiB H2CData PDUs");
    check(&mut q1, "128 KiB in 16 KiB H2CData PDUs", 2000, &d, &mut model);
    q2.h2c_chunk = q2.maxh2cdata;

    // A third queue with header and data digests.
    let mut q3 = NvmeTcpConn::io(addr, BOTH_DIGESTS, cntlid, 3, SUBNQN, HOSTNQN);
    for (lba, len) in [(3000u64, 4 * KIB), (3100, 16 * KIB), (3200, 64 * KIB), (3300, 128 * KIB)] {
        let d = random_bytes(&mut rng, len);
        q3.write(1, lba, &d, false).unwrap_or_else(|s| panic!("{len}-byte write with digests: {s}"));
        check(&mut q3, "with digests", lba, &d, &mut model);
    }

    // Random I/O over the three queues against the model.
    let nsze = VOL_SIZE / BS as u64;
    for i in 0..60 {
        let blocks = rng.gen_range(1..=(mdts / BS as usize) as u64);
        let lba = rng.gen_range(0..=nsze - blocks);
        let d = random_bytes(&mut rng, (blocks * BS as u64) as usize);
        let (w, r): (&mut NvmeTcpConn, &mut NvmeTcpConn) = match i % 3 {
            0 => (&mut q1, &mut q2),
            1 => (&mut q2, &mut q3),
            _ => (&mut q3, &mut q1),
        };
        w.write(1, lba, &d, false).unwrap_or_else(|s| panic!("random write {i} at {lba}+{blocks}: {s}"));
        check(r, &format!("random {i}"), lba, &d, &mut model);
    }
    q1.flush(1).expect("flush");
    assert!(std::fs::read(&img).unwrap() == model, "the backing file differs from the model");
    admin.keep_alive().expect("the admin queue still answers");
    target.assert_no_panic();
}

#[test]
fn pipelined_commands_on_one_queue_all_complete_and_land() {
    let dir = tempfile::tempdir().unwrap();
    let img = sparse_file(dir.path(), "vol.img", VOL_SIZE);
    let (target, addr, _) =
        start_on(dir.path(), &format!("{}\n{}", nvme_section(""), nvme_volume("vol", &img, VOL_SIZE, false, Some(1), "")));
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed());
    let (mut admin, cntlid) = controller(addr);
    for (qid, digests) in [(1u16, NO_DIGESTS), (2, BOTH_DIGESTS)] {
        let mut q = NvmeTcpConn::io(addr, digests, cntlid, qid, SUBNQN, HOSTNQN);
        let base = if digests == NO_DIGESTS { 0u64 } else { 4096 };
        // 24 in-capsule writes of 4 KiB and 8 of 64 KiB by R2T, all outstanding at once.
        let small: Vec<Vec<u8>> = (0..24).map(|_| random_bytes(&mut rng, 4 * KIB)).collect();
        let large: Vec<Vec<u8>> = (0..8).map(|_| random_bytes(&mut rng, 64 * KIB)).collect();
        let mut cmds: Vec<Cmd<'_>> = Vec::new();
        for (i, d) in small.iter().enumerate() {
            cmds.push(Cmd::new(rw_entry(io_opcode::WRITE, 1, base + i as u64, 1, false), d, &[], 0));
        }
        let done = q.execute_many(&cmds).unwrap_or_else(|e| panic!("{digests:?}: 24 pipelined in-capsule writes: {e}"));
        assert!(done.iter().all(|c| c.cqe.status.is_success()), "{digests:?}: {:?}", done.iter().map(|c| c.cqe.status).collect::<Vec<_>>());
        let cmds: Vec<Cmd<'_>> = large
            .iter()
            .enumerate()
            .map(|(i, d)| Cmd::new(rw_entry(io_opcode::WRITE, 1, base + 100 + 16 * i as u64, 16, false), &[], d, 0))
            .collect();
        let done = q.execute_many(&cmds).unwrap_or_else(|e| panic!("{digests:?}: 8 pipelined R2T writes: {e}"));
        assert!(done.iter().all(|c| c.cqe.status.is_success()), "{digests:?}: {:?}", done.iter().map(|c| c.cqe.status).collect::<Vec<_>>());
        // Reads of all of it, 32 at once, mixed sizes.
        let mut cmds: Vec<Cmd<'_>> = (0..24).map(|i| Cmd::new(rw_entry(io_opcode::READ, 1, base + i, 1, false), &[], &[], 4096)).collect();
        cmds.extend((0..8).map(|i| Cmd::new(rw_entry(io_opcode::READ, 1, base + 100 + 16 * i, 16, false), &[], &[], 64 * KIB)));
        let done = q.execute_many(&cmds[..24]).unwrap_or_else(|e| panic!("{digests:?}: 24 pipelined reads: {e}"));
        for (i, c) in done.iter().enumerate() {
            assert!(c.cqe.status.is_success() && c.data == small[i], "{digests:?}: pipelined read {i}: {}", c.cqe.status);
        }
        let done = q.execute_many(&cmds[24..]).unwrap_or_else(|e| panic!("{digests:?}: 8 pipelined 64 KiB reads: {e}"));
        for (i, c) in done.iter().enumerate() {
            assert!(c.cqe.status.is_success() && c.data == large[i], "{digests:?}: pipelined 64 KiB read {i}: {}", c.cqe.status);
            assert!(file_bytes(&img, (base + 100 + 16 * i as u64) * 4096, 64 * KIB) == large[i], "{digests:?}: file at write {i}");
        }
        // Writes and reads of other LBAs, interleaved.
        let mixed: Vec<Vec<u8>> = (0..8).map(|_| random_bytes(&mut rng, 32 * KIB)).collect();
        let mut cmds = Vec::new();
        for (i, d) in mixed.iter().enumerate() {
            cmds.push(Cmd::new(rw_entry(io_opcode::WRITE, 1, base + 1000 + 8 * i as u64, 8, false), &[], d, 0));
            cmds.push(Cmd::new(rw_entry(io_opcode::READ, 1, base + i as u64, 1, false), &[], &[], 4096));
        }
        let done = q.execute_many(&cmds).unwrap_or_else(|e| panic!("{digests:?}: mixed pipelined commands: {e}"));
        for (i, c) in done.iter().enumerate() {
            assert!(c.cqe.status.is_success(), "{digests:?}: mixed command {i}: {}", c.cqe.status);
            if i % 2 == 1 {
                assert!(c.data == small[i / 2], "{digests:?}: mixed read {i}");
            }
        }
        for (i, d) in mixed.iter().enumerate() {
            assert!(file_bytes(&img, (base + 1000 + 8 * i as u64) * 4096, d.len()) == *d, "{digests:?}: mixed write {i}");
        }
    }
    // Both connections are gone: their queue ids are free again.
    wait_until_reconnects(addr, cntlid, NO_DIGESTS);
    admin.keep_alive().unwrap();
    target.assert_no_panic();
}

#[test]
fn a_queue_deeper_than_its_chunks_gets_every_write_by_r2t_and_reads_it_back() {
    // A queue has 32 chunks and Linux keeps up to 128 commands in flight:
    // the writes beyond the 32nd get their R2T when a chunk frees.
    const DEPTH: u64 = 96;
    const BLOCKS: u32 = 32; // 128 KiB, a pool chunk
    let (_dir, target, addr, img) = one_volume_target();
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed());
    let (mut admin, cntlid) = controller(addr);
    for (qid, digests) in [(1u16, NO_DIGESTS), (2, BOTH_DIGESTS)] {
        let mut q = NvmeTcpConn::connect(addr, digests);
        q.io_connect_sized(cntlid, qid, 127, SUBNQN, HOSTNQN).unwrap_or_else(|s| panic!("I/O Connect with 128 entries: {s}"));
        let datas: Vec<Vec<u8>> = (0..DEPTH).map(|_| random_bytes(&mut rng, BLOCKS as usize * BS as usize)).collect();
        let cmds: Vec<Cmd<'_>> =
            datas.iter().enumerate().map(|(i, d)| Cmd::new(rw_entry(io_opcode::WRITE, 1, i as u64 * BLOCKS as u64, BLOCKS, false), &[], d, 0)).collect();
        let done = q.execute_many(&cmds).unwrap_or_else(|e| panic!("{digests:?}: {DEPTH} writes by R2T in flight: {e}"));
        assert!(done.iter().all(|c| c.cqe.status.is_success()), "{digests:?}: {:?}", done.iter().map(|c| c.cqe.status).collect::<Vec<_>>());
        let cmds: Vec<Cmd<'_>> = (0..DEPTH)
            .map(|i| Cmd::new(rw_entry(io_opcode::READ, 1, i * BLOCKS as u64, BLOCKS, false), &[], &[], BLOCKS as usize * BS as usize))
            .collect();
        let done = q.execute_many(&cmds).unwrap_or_else(|e| panic!("{digests:?}: {DEPTH} reads in flight: {e}"));
        for (i, c) in done.iter().enumerate() {
            assert!(c.cqe.status.is_success() && c.data == datas[i], "{digests:?}: read {i}: {}", c.cqe.status);
            assert!(file_bytes(&img, i as u64 * BLOCKS as u64 * BS as u64, datas[i].len()) == datas[i], "{digests:?}: file at write {i}");
        }
    }
    admin.keep_alive().unwrap();
    target.assert_no_panic();
}

/// Reconnects I/O queue 1 of `cntlid` once its old connection is cleaned up.
fn wait_until_reconnects(addr: SocketAddr, cntlid: u16, digests: Digests) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let mut q = NvmeTcpConn::connect(addr, digests);
        match q.io_connect(cntlid, 1, SUBNQN, HOSTNQN) {
            Ok(_) => return,
            Err(s) => assert!(Instant::now() < deadline, "I/O queue 1 still taken 10 s after its connection closed: {s}"),
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

// ---------------------------------------------------------------------------
// 3. Write Zeroes, deallocate, flush

#[test]
fn write_zeroes_and_deallocate_read_back_zeros_and_flush_succeeds() {
    let dir = tempfile::tempdir().unwrap();
    let img = sparse_file(dir.path(), "vol.img", VOL_SIZE);
    let (target, addr, _) =
        start_on(dir.path(), &format!("{}\n{}", nvme_section(""), nvme_volume("vol", &img, VOL_SIZE, false, Some(1), "")));
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed());
    let (mut admin, cntlid) = controller(addr);
    let ns = IdNs::parse(&admin.identify(0, 1).unwrap());
    eprintln!("namespace 1: {ns:?}");
    let mut q = NvmeTcpConn::io(addr, NO_DIGESTS, cntlid, 1, SUBNQN, HOSTNQN);

    let d = random_bytes(&mut rng, 128 * KIB); // LBAs 0..32
    q.write(1, 0, &d, false).expect("write");
    let mut model = d.clone();

    q.write_zeroes(1, 2, 4).expect("Write Zeroes of LBAs 2..6");
    model[2 * 4096..6 * 4096].fill(0);
    q.deallocate(1, &[(10, 3), (20, 4)]).expect("Dataset Management deallocate of 10..13 and 20..24");
    model[10 * 4096..13 * 4096].fill(0);
    model[20 * 4096..24 * 4096].fill(0);
    q.flush(1).expect("Flush");

    let back = q.read(1, 0, 32, BS).expect("read");
    for lba in 0..32 {
        let r = lba * 4096..(lba + 1) * 4096;
        assert!(back[r.clone()] == model[r.clone()], "LBA {lba} after Write Zeroes/deallocate: read back other bytes");
        assert!(file_bytes(&img, r.start as u64, 4096) == model[r], "LBA {lba}: the backing file differs");
    }
    // A single block, and a large Write Zeroes that no data transfer limits.
    q.write_zeroes(1, 31, 1).expect("Write Zeroes of one block");
    q.write(1, 4096, &random_bytes(&mut rng, 64 * KIB), false).expect("write");
    q.write_zeroes(1, 0, 8192).expect("Write Zeroes of 32 MiB (8192 blocks, beyond MDTS)");
    assert!(q.read(1, 4096, 16, BS).unwrap().iter().all(|&b| b == 0), "Write Zeroes beyond MDTS left data");
    assert!(file_bytes(&img, 0, 32 * MIB as usize).iter().all(|&b| b == 0), "the backing file holds data after Write Zeroes");
    // As the Linux host deallocates: one range, and a whole page of range
    // data (zeroes past NR), which only NR's ranges count in.
    q.write(1, 9000, &[0x44; 8192], false).unwrap();
    q.deallocate_padded(1, &[(9000, 1)], 4096).expect("DSM with 4 KiB of range data and NR = 0");
    assert_eq!(q.read(1, 9000, 2, BS).unwrap()[..4096], [0u8; 4096], "the range was deallocated");
    assert_eq!(q.read(1, 9001, 1, BS).unwrap(), vec![0x44; 4096], "and nothing past it");
    q.flush(1).expect("Flush");
    admin.keep_alive().unwrap();
    target.assert_no_panic();
}

// ---------------------------------------------------------------------------
// 4. Command errors

#[test]
fn command_errors_get_their_statuses_and_the_connection_keeps_working() {
    let dir = tempfile::tempdir().unwrap();
    let img = sparse_file(dir.path(), "vol.img", VOL_SIZE);
    let ro = sparse_file(dir.path(), "ro.img", 16 * MIB);
    std::fs::write(&ro, vec![0x5au8; 16 * MIB as usize]).unwrap();
    let config = format!(
        "{}\n{}\n{}",
        nvme_section(""),
        nvme_volume("vol", &img, VOL_SIZE, false, Some(1), ""),
        nvme_volume("ro", &ro, 16 * MIB, true, Some(2), ""),
    );
    let (target, addr, _) = start_on(dir.path(), &config);
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed());
    let (mut admin, cntlid) = controller(addr);
    let mut q = NvmeTcpConn::io(addr, NO_DIGESTS, cntlid, 1, SUBNQN, HOSTNQN);
    let nsze = VOL_SIZE / BS as u64;
    let good = random_bytes(&mut rng, 8 * KIB);
    q.write(1, 7, &good, false).unwrap();
    let still_works = |q: &mut NvmeTcpConn, after: &str| {
        let back = q.read(1, 7, 2, BS).unwrap_or_else(|s| panic!("after {after}: a good read fails: {s}"));
        assert!(back == good, "after {after}: a good read returned other bytes");
    };

    // LBA out of range: starting past the end, and running past it.
    assert_status("read at NSZE", q.read(1, nsze, 1, BS), Status::LBA_OUT_OF_RANGE);
    still_works(&mut q, "read at NSZE");
    assert_status("read of 2 blocks at NSZE-1", q.read(1, nsze - 1, 2, BS), Status::LBA_OUT_OF_RANGE);
    still_works(&mut q, "read past NSZE");
    assert_status("read at LBA 2^63", q.read(1, 1 << 63, 1, BS), Status::LBA_OUT_OF_RANGE);
    assert_status("4 KiB write at NSZE", q.write(1, nsze, &[1u8; 4096], false), Status::LBA_OUT_OF_RANGE);
    still_works(&mut q, "write at NSZE");
    assert_status("64 KiB write by R2T at NSZE-1", q.write(1, nsze - 1, &vec![1u8; 64 * KIB], false), Status::LBA_OUT_OF_RANGE);
    still_works(&mut q, "R2T write past NSZE");
    assert_status("Write Zeroes at NSZE-1 of 2", q.write_zeroes(1, nsze - 1, 2), Status::LBA_OUT_OF_RANGE);
    assert_status("deallocate past NSZE", q.deallocate(1, &[(nsze - 1, 2)]), Status::LBA_OUT_OF_RANGE);
    still_works(&mut q, "Write Zeroes / deallocate past NSZE");
    assert!(file_bytes(&img, (nsze - 1) * BS as u64, BS as usize).iter().all(|&b| b == 0), "an out-of-range write landed in the last block");

    // Unknown namespace ids.
    assert_status("read of nsid 99", q.read(99, 0, 1, BS), Status::INVALID_NAMESPACE);
    assert_status("write to nsid 99", q.write(99, 0, &[1u8; 4096], false), Status::INVALID_NAMESPACE);
    assert_status("flush of nsid 99", q.flush(99), Status::INVALID_NAMESPACE);
    still_works(&mut q, "bad nsid");

    // The read-only namespace reads but refuses writes of every kind.
    let back = q.read(2, 0, 4, BS).expect("read of the read-only namespace");
    assert!(back.iter().all(|&b| b == 0x5a), "read-only namespace data");
    assert_status("write to read-only", q.write(2, 0, &[1u8; 4096], false), Status::NAMESPACE_WRITE_PROTECTED);
    assert_status("R2T write to read-only", q.write(2, 0, &vec![1u8; 64 * KIB], false), Status::NAMESPACE_WRITE_PROTECTED);
    assert_status("Write Zeroes to read-only", q.write_zeroes(2, 0, 1), Status::NAMESPACE_WRITE_PROTECTED);
    assert_status("deallocate on read-only", q.deallocate(2, &[(0, 1)]), Status::NAMESPACE_WRITE_PROTECTED);
    assert!(file_bytes(&ro, 0, 64 * KIB).iter().all(|&b| b == 0x5a), "a write landed on the read-only volume");
    still_works(&mut q, "writes to read-only");

    // Unknown I/O opcode.
    let mut e = SubmissionEntry::new(0x55, 0);
    e.nsid = 1;
    assert_eq!(q.exec(e, &[], &[], 0).cqe.status, Status::INVALID_OPCODE, "unknown I/O opcode 0x55");
    still_works(&mut q, "unknown opcode");

    // In-capsule data shorter than the blocks the command names.
    let e = rw_entry(io_opcode::WRITE, 1, 30, 2, false);
    let r = q.exec(e, &[9u8; 4096], &[], 0);
    assert_eq!(r.cqe.status, Status::SGL_DATA_LENGTH_INVALID, "2-block write with 4 KiB of in-capsule data");
    assert!(file_bytes(&img, 30 * BS as u64, 8192).iter().all(|&b| b == 0), "a short in-capsule write landed");
    still_works(&mut q, "short in-capsule write");

    // A read whose transport SGL is shorter than its blocks.
    let mut e = rw_entry(io_opcode::READ, 1, 7, 2, false);
    e.set_sgl(Sgl::Transport { length: 4096 });
    let r = q.execute_raw(e, &[], &[], 4096).expect("a read with a short SGL gets a completion");
    assert_eq!(r.cqe.status, Status::SGL_DATA_LENGTH_INVALID, "2-block read with a 4 KiB SGL");
    still_works(&mut q, "short read SGL");

    // More than MDTS (1 MiB) in one command: Invalid Field in Command
    // (NVMe Base 2.0, Identify Controller MDTS), and no R2T for the write.
    assert_status("2 MiB read (> MDTS)", q.read(1, 0, 512, BS), Status::INVALID_FIELD);
    assert_status("2 MiB write by R2T (> MDTS)", q.write(1, 4000, &vec![0xabu8; 2048 * KIB], false), Status::INVALID_FIELD);
    assert!(file_bytes(&img, 4000 * BS as u64, 2048 * KIB).iter().all(|&b| b == 0), "a write beyond MDTS landed");
    still_works(&mut q, "commands beyond MDTS");

    admin.keep_alive().expect("the admin queue still answers");
    target.assert_no_panic();
}

/// Commands that move no data define SQE bytes 24-39 (the SGL) as
/// reserved (Property Get and Set: NVMe over Fabrics 1.1, Figures 41 and
/// 43), and hosts leave them zero there; Linux nvmet-tcp accepts any
/// zero-length SGL on a command that moves no data. So an all-zero SGL on
/// Property Get, Property Set, Keep Alive and Flush must not be "SGL
/// Descriptor Type Invalid": each succeeds. A command that does move data
/// with such an SGL is still refused (an SGL error), and moves nothing.
#[test]
fn commands_that_move_no_data_succeed_with_an_all_zero_sgl() {
    let (_dir, target, addr, img) = one_volume_target();
    let zero_sgl = |mut e: SubmissionEntry| {
        e.dptr = [0; 16];
        e
    };
    let mut failures = Vec::new();
    let mut check = |what: &str, c: &mut NvmeTcpConn, e: SubmissionEntry| -> Option<u64> {
        let r = c.execute_raw(e, &[], &[], 0).unwrap_or_else(|err| panic!("{what} with an all-zero SGL: {err}"));
        if r.cqe.status.is_success() {
            Some(r.cqe.result)
        } else {
            failures.push(format!("{what} with an all-zero SGL: {} (expected success)", r.cqe.status));
            None
        }
    };

    let mut admin = NvmeTcpConn::connect(addr, NO_DIGESTS);
    let cntlid = admin.admin_connect(SUBNQN, HOSTNQN, 0).expect("admin Connect");
    let get_csts = zero_sgl(Property { offset: property::CSTS, wide: false, value: 0 }.to_entry(0, false));
    if let Some(csts) = check("Property Get CSTS", &mut admin, get_csts) {
        assert_eq!(csts & 1, 0, "CSTS.RDY before CC.EN: {csts:#x}");
    }
    let set_cc = zero_sgl(Property { offset: property::CC, wide: false, value: CC_ENABLE }.to_entry(0, true));
    if check("Property Set CC (EN)", &mut admin, set_cc).is_some() {
        let deadline = Instant::now() + Duration::from_secs(5);
        while admin.property_get(property::CSTS, false).expect("Property Get CSTS") & 1 == 0 {
            assert!(Instant::now() < deadline, "CSTS.RDY not set within 5 s of a Property Set of CC.EN with an all-zero SGL");
            std::thread::sleep(Duration::from_millis(10));
        }
    } else {
        // Enabled the usual way, so that the rest is still checked.
        admin.enable();
    }
    check("Keep Alive", &mut admin, zero_sgl(SubmissionEntry::new(admin_opcode::KEEP_ALIVE, 0)));

    let mut q = NvmeTcpConn::io(addr, NO_DIGESTS, cntlid, 1, SUBNQN, HOSTNQN);
    let mut flush = SubmissionEntry::new(io_opcode::FLUSH, 0);
    flush.nsid = 1;
    check("Flush", &mut q, zero_sgl(flush));

    // Commands that move data still need an SGL that covers it.
    let sgl_error = [Status::SGL_TYPE_INVALID, Status::SGL_DATA_LENGTH_INVALID];
    let read = zero_sgl(rw_entry(io_opcode::READ, 1, 5, 1, false));
    let r = q.execute_raw(read, &[], &[], 0).expect("a read with an all-zero SGL gets a completion");
    assert!(sgl_error.contains(&r.cqe.status), "a 1-block Read with an all-zero SGL: {} (expected an SGL error)", r.cqe.status);
    let write = zero_sgl(rw_entry(io_opcode::WRITE, 1, 5, 1, false));
    let r = q.execute_raw(write, &[], &[], 0).expect("a write with an all-zero SGL gets a completion");
    assert!(sgl_error.contains(&r.cqe.status), "a 1-block Write with an all-zero SGL: {} (expected an SGL error)", r.cqe.status);
    let data = [0x3cu8; 4096];
    q.write(1, 6, &data, false).expect("a good write after them");
    assert!(q.read(1, 5, 2, BS).expect("a good read after them") == [vec![0u8; 4096], data.to_vec()].concat(), "LBAs 5-6");
    assert!(file_bytes(&img, 5 * BS as u64, 4096).iter().all(|&b| b == 0), "the Write with an all-zero SGL wrote something");

    assert!(failures.is_empty(), "{} command(s) that move no data refused:\n{}", failures.len(), failures.join("\n"));
    admin.keep_alive().expect("the admin queue still answers");
    target.assert_no_panic();
}

// ---------------------------------------------------------------------------
// 5. Hostile PDUs

/// What a hostile case must make the target do.
#[derive(Clone, Copy, Debug)]
enum Expect {
    /// A C2HTermReq with one of these (FES, Some(FEI) or any FEI), then a close.
    Term(&'static [(u16, Option<u32>)]),
    /// A close; a C2HTermReq before it with one of these FES is fine.
    Closed(&'static [u16]),
    /// Either a C2HTermReq (any FES) and a close, or an error completion
    /// with this status on a connection that stays up.
    TermOrStatus(Status),
    /// Like `TermOrStatus`, or a plain close: anything but running it.
    Refused(Status),
    /// Checked by the attack itself.
    Checked,
}

struct HostileEnv {
    addr: SocketAddr,
    /// The healthy controller's id.
    cntlid: u16,
    img: PathBuf,
    /// The attackers' admin queues, kept open until their case ends.
    keep: std::cell::RefCell<Vec<NvmeTcpConn>>,
}

/// The attacking host: its own controllers, never the healthy one's.
const ATTACKER_HOSTNQN: &str = "nqn.2014-08.org.nvmexpress:uuid:badbadba-dbad-4bad-8bad-badbadbadbad";

type Attack = fn(&HostileEnv) -> NvmeTcpConn;

struct Case {
    name: &'static str,
    attack: Attack,
    expect: Expect,
    /// LBAs of namespace 1 the attack tried to write: they must stay zero.
    sentinel: Option<(u64, u32)>,
}

/// LBAs the attacks write to (never written by anyone else).
const SENTINEL: u64 = 8192;

/// I/O queue 1 of a fresh controller of the attacking host (its admin
/// queue stays open in `env.keep` until the case ends).
fn io_conn(env: &HostileEnv, digests: Digests) -> NvmeTcpConn {
    let (admin, cntlid) = controller_of(env.addr, ATTACKER_HOSTNQN);
    env.keep.borrow_mut().push(admin);
    NvmeTcpConn::io(env.addr, digests, cntlid, 1, SUBNQN, ATTACKER_HOSTNQN)
}

/// A Write capsule's bytes with `data` in the capsule.
fn in_capsule_write(c: &mut NvmeTcpConn, lba: u64, data: &[u8]) -> Vec<u8> {
    let mut e = rw_entry(io_opcode::WRITE, 1, lba, (data.len() / BS as usize) as u32, false);
    e.cid = c.take_cid();
    e.set_sgl(Sgl::InCapsule { offset: 0, length: data.len() as u32 });
    c.pdu_bytes(&Pdu::CapsuleCmd(e), data)
}

/// An I/O queue (with `digests`) that sent a 4 KiB in-capsule Write at the
/// sentinel whose bytes `corrupt` changed first.
fn corrupted_write(env: &HostileEnv, digests: Digests, corrupt: fn(&mut Vec<u8>)) -> NvmeTcpConn {
    let mut c = io_conn(env, digests);
    let mut b = in_capsule_write(&mut c, SENTINEL, &[0xee; 4096]);
    corrupt(&mut b);
    c.raw_send(&b);
    c
}

/// Sends a 64 KiB Write by R2T at the sentinel and waits for the first R2T.
fn write_until_r2t(c: &mut NvmeTcpConn) -> R2t {
    let mut e = rw_entry(io_opcode::WRITE, 1, SENTINEL, 16, false);
    e.cid = c.take_cid();
    e.set_sgl(Sgl::Transport { length: 64 * KIB as u32 });
    c.send_pdu(&Pdu::CapsuleCmd(e), &[]);
    match c.recv_pdu() {
        Ok((Pdu::R2T(r), _)) => {
            assert_eq!(r.cccid, e.cid, "R2T for the write");
            assert!(r.offset as usize + r.length as usize <= 64 * KIB, "R2T beyond the command's data: {r:?}");
            r
        }
        other => panic!("expected an R2T for a 64 KiB write, got {other:?}"),
    }
}

fn hostile_cases() -> Vec<Case> {
    use fes::*;
    vec![
        Case {
            name: "garbage bytes instead of an ICReq",
            attack: |env| {
                let mut c = NvmeTcpConn::tcp(env.addr);
                c.raw_send(&[0xa5; 128]);
                c
            },
            expect: Expect::Closed(&[INVALID_HEADER_FIELD]),
            sentinel: None,
        },
        Case {
            name: "garbage bytes after ICResp",
            attack: |env| {
                let mut c = NvmeTcpConn::connect(env.addr, NO_DIGESTS);
                c.raw_send(&[0xa5; 128]);
                c
            },
            expect: Expect::Term(&[(INVALID_HEADER_FIELD, Some(0))]),
            sentinel: None,
        },
        Case {
            name: "a CapsuleCmd before ICReq",
            attack: |env| {
                let mut c = NvmeTcpConn::tcp(env.addr);
                let data = connect_data(ANY_CONTROLLER, SUBNQN, HOSTNQN);
                c.send_pdu(&Pdu::CapsuleCmd(connect_entry(0, 31, 0)), &data);
                c
            },
            expect: Expect::Closed(&[INVALID_HEADER_FIELD, PDU_SEQUENCE_ERROR]),
            sentinel: None,
        },
        Case {
            name: "a second ICReq",
            attack: |env| {
                let mut c = NvmeTcpConn::connect(env.addr, NO_DIGESTS);
                c.send_pdu(&Pdu::IcReq(rdmablk_common::nvme::tcp::IcReq { pfv: 0, hpda: 0, digests: NO_DIGESTS, maxr2t: 0 }), &[]);
                c
            },
            expect: Expect::Term(&[(PDU_SEQUENCE_ERROR, None), (INVALID_HEADER_FIELD, Some(0))]),
            sentinel: None,
        },
        Case {
            name: "a controller-to-host PDU type (R2T) from the host",
            attack: |env| {
                let mut c = io_conn(env, NO_DIGESTS);
                c.send_pdu(&Pdu::R2T(R2t { cccid: 1, ttag: 1, offset: 0, length: 4096 }), &[]);
                c
            },
            expect: Expect::Term(&[(PDU_SEQUENCE_ERROR, None), (INVALID_HEADER_FIELD, Some(0))]),
            sentinel: None,
        },
        Case {
            name: "CapsuleCmd with a wrong HLEN",
            attack: |env| corrupted_write(env, NO_DIGESTS, |b| b[2] = 24),
            expect: Expect::Term(&[(INVALID_HEADER_FIELD, Some(2))]),
            sentinel: Some((SENTINEL, 1)),
        },
        Case {
            name: "CapsuleCmd with PDO beyond PLEN",
            attack: |env| {
                let mut c = io_conn(env, NO_DIGESTS);
                // 72-byte header and 16 bytes of data: PLEN 88, PDO 200.
                let mut e = rw_entry(io_opcode::WRITE, 1, SENTINEL, 1, false);
                e.set_sgl(Sgl::InCapsule { offset: 0, length: 16 });
                let mut b = c.pdu_bytes(&Pdu::CapsuleCmd(e), &[0xee; 16]);
                assert_eq!((b[3], b.len()), (72, 88));
                b[3] = 200;
                c.raw_send(&b);
                c
            },
            expect: Expect::Term(&[(INVALID_HEADER_FIELD, Some(3))]),
            sentinel: Some((SENTINEL, 1)),
        },
        Case {
            name: "CapsuleCmd with PDO inside the header",
            attack: |env| corrupted_write(env, NO_DIGESTS, |b| b[3] = 8),
            expect: Expect::Term(&[(INVALID_HEADER_FIELD, Some(3))]),
            sentinel: Some((SENTINEL, 1)),
        },
        Case {
            name: "CapsuleCmd with a huge PLEN",
            // The header and a little data; the target must not wait for 2 GiB.
            attack: |env| corrupted_write(env, NO_DIGESTS, |b| b[4..8].copy_from_slice(&0x7fff_fff0u32.to_le_bytes())),
            expect: Expect::Term(&[(INVALID_HEADER_FIELD, Some(4)), (LIMIT_EXCEEDED, None)]),
            sentinel: Some((SENTINEL, 1)),
        },
        Case {
            name: "CapsuleCmd with more in-capsule data than IOCCSZ allows",
            attack: |env| {
                let mut c = io_conn(env, NO_DIGESTS);
                let b = in_capsule_write(&mut c, SENTINEL, &[0xee; 32 * 1024]);
                let _ = c.try_raw_send(&b);
                c
            },
            expect: Expect::Checked,
            sentinel: Some((SENTINEL, 8)),
        },
        Case {
            name: "wrong header digest",
            // The digest right after the 72-byte header.
            attack: |env| corrupted_write(env, Digests { header: true, data: false }, |b| b[72] ^= 0xff),
            expect: Expect::Term(&[(HEADER_DIGEST_ERROR, None)]),
            sentinel: Some((SENTINEL, 1)),
        },
        Case {
            name: "wrong data digest on an in-capsule write",
            attack: |env| corrupted_write(env, BOTH_DIGESTS, |b| *b.last_mut().unwrap() ^= 0xff),
            expect: Expect::TermOrStatus(TRANSIENT_TRANSPORT_ERROR),
            sentinel: Some((SENTINEL, 1)),
        },
        Case {
            name: "wrong data digest on H2CData",
            attack: |env| {
                let mut c = io_conn(env, BOTH_DIGESTS);
                let r = write_until_r2t(&mut c);
                let d = DataPdu { cccid: r.cccid, ttag: r.ttag, offset: r.offset, length: r.length, last: true, success: false };
                let mut b = c.pdu_bytes(&Pdu::H2CData(d), &vec![0xee; r.length as usize]);
                let n = b.len();
                b[n - 1] ^= 0xff;
                c.raw_send(&b);
                c
            },
            expect: Expect::TermOrStatus(TRANSIENT_TRANSPORT_ERROR),
            sentinel: Some((SENTINEL, 16)),
        },
        Case {
            name: "H2CData with a ttag never issued",
            attack: |env| {
                let mut c = io_conn(env, NO_DIGESTS);
                let r = write_until_r2t(&mut c);
                let d = DataPdu { cccid: r.cccid, ttag: r.ttag ^ 0x5a5a, offset: r.offset, length: r.length, last: true, success: false };
                c.send_pdu(&Pdu::H2CData(d), &vec![0xee; r.length as usize]);
                c
            },
            expect: Expect::Term(&[(INVALID_HEADER_FIELD, Some(10)), (PDU_SEQUENCE_ERROR, None)]),
            sentinel: Some((SENTINEL, 16)),
        },
        Case {
            name: "H2CData for a command that does not exist",
            attack: |env| {
                let mut c = io_conn(env, NO_DIGESTS);
                let d = DataPdu { cccid: 0x4242, ttag: 1, offset: 0, length: 4096, last: true, success: false };
                c.send_pdu(&Pdu::H2CData(d), &[0xee; 4096]);
                c
            },
            expect: Expect::Term(&[(INVALID_HEADER_FIELD, Some(8)), (INVALID_HEADER_FIELD, Some(10)), (PDU_SEQUENCE_ERROR, None)]),
            sentinel: None,
        },
        Case {
            name: "H2CData at an offset beyond the R2T",
            attack: |env| {
                let mut c = io_conn(env, NO_DIGESTS);
                let r = write_until_r2t(&mut c);
                let end = r.offset + r.length;
                let d = DataPdu { cccid: r.cccid, ttag: r.ttag, offset: end, length: 4096, last: true, success: false };
                c.send_pdu(&Pdu::H2CData(d), &[0xee; 4096]);
                c
            },
            expect: Expect::Term(&[(DATA_OUT_OF_RANGE, None)]),
            sentinel: Some((SENTINEL, 17)),
        },
        Case {
            name: "H2CData running past the end of the R2T",
            attack: |env| {
                let mut c = io_conn(env, NO_DIGESTS);
                let r = write_until_r2t(&mut c);
                let end = r.offset + r.length;
                let d = DataPdu { cccid: r.cccid, ttag: r.ttag, offset: end - 4096, length: 8192, last: true, success: false };
                c.send_pdu(&Pdu::H2CData(d), &[0xee; 8192]);
                c
            },
            expect: Expect::Term(&[(DATA_OUT_OF_RANGE, None)]),
            sentinel: Some((SENTINEL, 17)),
        },
        Case {
            name: "H2CData larger than MAXH2CDATA",
            attack: |env| {
                let mut c = io_conn(env, NO_DIGESTS);
                // A 128 KiB write: R2T for up to 128 KiB; send it in one PDU
                // of 128 KiB + 4 KiB (beyond MAXH2CDATA and the R2T).
                let mut e = rw_entry(io_opcode::WRITE, 1, SENTINEL, 32, false);
                e.cid = c.take_cid();
                e.set_sgl(Sgl::Transport { length: 128 * KIB as u32 });
                c.send_pdu(&Pdu::CapsuleCmd(e), &[]);
                let r = match c.recv_pdu() {
                    Ok((Pdu::R2T(r), _)) => r,
                    other => panic!("expected an R2T, got {other:?}"),
                };
                let len = c.maxh2cdata + 4096;
                let d = DataPdu { cccid: r.cccid, ttag: r.ttag, offset: r.offset, length: len, last: true, success: false };
                let _ = c.try_raw_send(&c.pdu_bytes(&Pdu::H2CData(d), &vec![0xee; len as usize]));
                c
            },
            expect: Expect::Term(&[(DATA_OUT_OF_RANGE, None), (LIMIT_EXCEEDED, None), (INVALID_HEADER_FIELD, Some(4))]),
            sentinel: Some((SENTINEL, 33)),
        },
        Case {
            name: "an I/O capsule before Connect",
            attack: |env| {
                let mut c = NvmeTcpConn::connect(env.addr, NO_DIGESTS);
                let b = in_capsule_write(&mut c, SENTINEL, &[0xee; 4096]);
                c.raw_send(&b);
                c
            },
            expect: Expect::TermOrStatus(Status::COMMAND_SEQUENCE_ERROR),
            sentinel: Some((SENTINEL, 1)),
        },
        Case {
            name: "an I/O Connect with a wrong controller id, then I/O",
            attack: |env| {
                let mut c = NvmeTcpConn::connect(env.addr, NO_DIGESTS);
                let wrong = if env.cntlid == 0x1234 { 0x4321 } else { 0x1234 };
                let r = c.exec(connect_entry(4, 31, 0), &connect_data(wrong, SUBNQN, HOSTNQN), &[], 0);
                assert_eq!(r.cqe.status, Status::CONNECT_INVALID_PARAMETERS, "I/O Connect with controller id {wrong:#x}");
                assert_eq!(r.cqe.result, invalid_connect_parameter(true, connect_data_offset::CONTROLLER_ID), "IATTR/IPO name CNTLID");
                // The queue is not connected: I/O on it must not run.
                let b = in_capsule_write(&mut c, SENTINEL, &[0xee; 4096]);
                let _ = c.try_raw_send(&b);
                c
            },
            expect: Expect::Refused(Status::COMMAND_SEQUENCE_ERROR),
            sentinel: Some((SENTINEL, 1)),
        },
        Case {
            name: "an I/O Connect with controller id 0xFFFF",
            attack: |env| {
                let mut c = NvmeTcpConn::connect(env.addr, NO_DIGESTS);
                let r = c.exec(connect_entry(4, 31, 0), &connect_data(ANY_CONTROLLER, SUBNQN, HOSTNQN), &[], 0);
                assert_eq!(r.cqe.status, Status::CONNECT_INVALID_PARAMETERS, "I/O Connect with controller id 0xFFFF");
                c
            },
            expect: Expect::Checked,
            sentinel: None,
        },
        Case {
            name: "an I/O Connect from another host NQN",
            attack: |env| {
                let mut c = NvmeTcpConn::connect(env.addr, NO_DIGESTS);
                let other = "nqn.2014-08.org.nvmexpress:uuid:00000000-0000-0000-0000-0000000000ff";
                let r = c.exec(connect_entry(4, 31, 0), &connect_data(env.cntlid, SUBNQN, other), &[], 0);
                // The pair (controller id, host NQN) names no controller:
                // either field may be the one reported.
                let ipo = [connect_data_offset::HOST_NQN, connect_data_offset::CONTROLLER_ID].map(|o| invalid_connect_parameter(true, o));
                assert!(
                    r.cqe.status == Status::CONNECT_INVALID_HOST
                        || (r.cqe.status == Status::CONNECT_INVALID_PARAMETERS && ipo.contains(&r.cqe.result)),
                    "I/O Connect to controller {} from another host NQN: {} DW0 {:#x}",
                    env.cntlid,
                    r.cqe.status,
                    r.cqe.result
                );
                c
            },
            expect: Expect::Checked,
            sentinel: None,
        },
        Case {
            name: "an I/O Connect for a queue id already connected",
            attack: |env| {
                let mut c = NvmeTcpConn::connect(env.addr, NO_DIGESTS);
                // Queue 1 is the healthy controller's.
                let r = c.exec(connect_entry(1, 31, 0), &connect_data(env.cntlid, SUBNQN, HOSTNQN), &[], 0);
                assert!(!r.cqe.status.is_success(), "a second Connect of I/O queue 1 succeeded");
                c
            },
            expect: Expect::Checked,
            sentinel: None,
        },
        Case {
            name: "the attacker hangs up in the middle of an R2T write",
            attack: |env| {
                let mut c = io_conn(env, NO_DIGESTS);
                let r = write_until_r2t(&mut c);
                let d = DataPdu { cccid: r.cccid, ttag: r.ttag, offset: r.offset, length: 4096, last: false, success: false };
                c.send_pdu(&Pdu::H2CData(d), &[0xee; 4096]);
                c.stream.shutdown(std::net::Shutdown::Both).unwrap();
                c
            },
            expect: Expect::Checked,
            sentinel: Some((SENTINEL, 16)),
        },
    ]
}

/// A healthy controller (admin queue, I/O queue 1) doing verified write
/// and read rounds in LBAs 0..1024 on a thread until told to stop.
struct Healthy {
    stop: Arc<AtomicBool>,
    rounds: Arc<AtomicU64>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Healthy {
    fn start(mut q: NvmeTcpConn, img: PathBuf, seed: u64) -> Healthy {
        let stop = Arc::new(AtomicBool::new(false));
        let rounds = Arc::new(AtomicU64::new(0));
        let (s, r) = (stop.clone(), rounds.clone());
        let thread = std::thread::spawn(move || {
            let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
            while !s.load(Ordering::Relaxed) {
                let blocks = rng.gen_range(1..=32u32);
                let lba = rng.gen_range(0..1024 - blocks as u64);
                let d = random_bytes(&mut rng, blocks as usize * BS as usize);
                q.write(1, lba, &d, false).unwrap_or_else(|st| panic!("healthy write: {st}"));
                let back = q.read(1, lba, blocks, BS).unwrap_or_else(|st| panic!("healthy read: {st}"));
                assert!(back == d, "healthy queue read back other bytes at LBA {lba}");
                assert!(file_bytes(&img, lba * BS as u64, d.len()) == d, "healthy write not in the file at LBA {lba}");
                r.fetch_add(1, Ordering::Relaxed);
            }
        });
        Healthy { stop, rounds, thread: Some(thread) }
    }

    /// Waits for `n` more rounds (the healthy queue makes progress now).
    fn progress(&self, n: u64, when: &str) {
        let from = self.rounds.load(Ordering::Relaxed);
        let deadline = Instant::now() + Duration::from_secs(10);
        while self.rounds.load(Ordering::Relaxed) < from + n {
            assert!(!self.thread.as_ref().unwrap().is_finished(), "the healthy controller's thread died ({when})");
            assert!(Instant::now() < deadline, "the healthy controller made no progress ({when})");
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    fn finish(mut self) -> u64 {
        self.stop.store(true, Ordering::Relaxed);
        if let Err(e) = self.thread.take().unwrap().join() {
            std::panic::resume_unwind(e);
        }
        self.rounds.load(Ordering::Relaxed)
    }
}

/// What a connection saw, in one line.
fn summary(t: &Termination) -> String {
    let term = match &t.term {
        Some((term, _)) => format!("C2HTermReq FES {:#x} FEI {:#x}", term.fes, term.fei),
        None => "no C2HTermReq".into(),
    };
    let other: Vec<String> = t
        .other
        .iter()
        .map(|p| match p {
            Pdu::CapsuleResp(r) => format!("CapsuleResp cid {} {}", r.cid, r.status),
            p => format!("{p:?}"),
        })
        .collect();
    format!("{term}; other {other:?}; {}", if t.closed { "closed" } else { "still open" })
}

fn check_termination(name: &str, t: &Termination, allowed: &[(u16, Option<u32>)]) {
    let Some((term, _)) = &t.term else {
        panic!("{name}: expected a C2HTermReq with one of (FES, FEI) {allowed:x?}, got none: {t:?}");
    };
    assert!(
        allowed.iter().any(|&(f, i)| term.fes == f && i.is_none_or(|i| term.fei == i)),
        "{name}: C2HTermReq FES {:#x} FEI {:#x}, expected one of (FES, FEI) {allowed:x?}",
        term.fes,
        term.fei
    );
    assert!(t.closed, "{name}: the target kept the connection after its C2HTermReq ({t:?})");
}

#[test]
fn hostile_pdus_are_terminated_specifically_and_hurt_no_other_connection() {
    let dir = tempfile::tempdir().unwrap();
    let img = sparse_file(dir.path(), "vol.img", VOL_SIZE);
    let (target, addr, _) =
        start_on(dir.path(), &format!("{}\n{}", nvme_section(""), nvme_volume("vol", &img, VOL_SIZE, false, Some(1), "")));
    let (mut admin, cntlid) = controller(addr);
    let healthy = Healthy::start(NvmeTcpConn::io(addr, NO_DIGESTS, cntlid, 1, SUBNQN, HOSTNQN), img.clone(), seed());
    healthy.progress(5, "before the attacks");
    let env = HostileEnv { addr, cntlid, img: img.clone(), keep: Default::default() };

    let cases = hostile_cases();
    let mut names: Vec<&str> = cases.iter().map(|c| c.name).collect();
    names.sort();
    names.dedup();
    assert_eq!(names.len(), cases.len(), "case names are distinct");
    let mut failures = Vec::new();
    for case in &cases {
        let name = case.name;
        // Every case runs; failures are collected so one report shows all.
        let outcome_of = std::cell::RefCell::new(String::from("-"));
        let watch = |c: &mut NvmeTcpConn, within: Duration| {
            let t = c.wait_for_termination(within);
            *outcome_of.borrow_mut() = summary(&t);
            t
        };
        let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let mut c = (case.attack)(&env);
            healthy.progress(2, name);
            match case.expect {
                Expect::Term(allowed) => {
                    let t = watch(&mut c, Duration::from_secs(10));
                    check_termination(name, &t, allowed);
                }
                Expect::Closed(allowed) => {
                    let t = watch(&mut c, Duration::from_secs(10));
                    assert!(t.closed, "{name}: the target did not close the connection: {t:?}");
                    if let Some((term, _)) = &t.term {
                        assert!(allowed.contains(&term.fes), "{name}: C2HTermReq {term:?}, expected FES in {allowed:x?}");
                    }
                    assert!(t.other.is_empty(), "{name}: the target answered with {:?}", t.other);
                }
                Expect::TermOrStatus(want) => {
                    let t = watch(&mut c, Duration::from_secs(5));
                    let resp = t.other.iter().find_map(|p| match p {
                        Pdu::CapsuleResp(r) => Some(*r),
                        _ => None,
                    });
                    match (&t.term, resp) {
                        (Some(_), None) => assert!(t.closed, "{name}: the target kept the connection after its C2HTermReq"),
                        (None, Some(r)) => assert_eq!(r.status, want, "{name}: completion status"),
                        _ => panic!("{name}: expected a C2HTermReq or a {want} completion, got {t:?}"),
                    }
                }
                Expect::Refused(want) => {
                    let t = watch(&mut c, Duration::from_secs(5));
                    for p in &t.other {
                        if let Pdu::CapsuleResp(r) = p {
                            assert_eq!(r.status, want, "{name}: completion status");
                        }
                    }
                    if t.term.is_some() {
                        assert!(t.closed, "{name}: the target kept the connection after its C2HTermReq");
                    }
                }
                Expect::Checked => {
                    // The attack asserted what it needed; the connection may
                    // stay or go, but nothing it sent may run.
                    let _ = watch(&mut c, Duration::from_secs(2));
                }
            }
            drop(c);
            env.keep.borrow_mut().clear();
            if let Some((lba, blocks)) = case.sentinel {
                let on_file = file_bytes(&env.img, lba * BS as u64, blocks as usize * BS as usize);
                assert!(on_file.iter().all(|&b| b == 0), "{name}: the attacker's data landed in the backing file");
            }
            healthy.progress(2, name);
            admin.keep_alive().unwrap_or_else(|s| panic!("{name}: the healthy admin queue: {s}"));
            target.assert_no_panic();
        }));
        match outcome {
            Ok(()) => eprintln!("ok: {name}: {}", outcome_of.borrow()),
            Err(e) => {
                let msg = e.downcast_ref::<String>().cloned().or_else(|| e.downcast_ref::<&str>().map(|s| s.to_string()));
                eprintln!("FAILED: {name}: {}", msg.as_deref().unwrap_or("?"));
                failures.push(format!("{name}: {}", msg.unwrap_or_default()));
            }
        }
    }
    // Nothing any case sent reached the sentinel area through a healthy
    // connection either.
    let mut q = NvmeTcpConn::io(addr, NO_DIGESTS, cntlid, 2, SUBNQN, HOSTNQN);
    for half in [0, 32] {
        let back = q.read(1, SENTINEL + half, 32, BS).unwrap_or_else(|s| panic!("read of the sentinel LBAs: {s}"));
        assert!(back.iter().all(|&b| b == 0), "attack data readable at the sentinel LBAs");
    }
    let rounds = healthy.finish();
    eprintln!("hostile: {} cases, healthy queue {rounds} verified rounds", cases.len());
    target.assert_no_panic();
    assert!(failures.is_empty(), "{} of {} hostile cases failed:\n{}", failures.len(), cases.len(), failures.join("\n"));
}

// ---------------------------------------------------------------------------
// 6. Keep alive

#[test]
fn a_silent_controller_is_torn_down_after_its_keep_alive_timeout() {
    const KATO_MS: u64 = 1000;
    let dir = tempfile::tempdir().unwrap();
    let img = sparse_file(dir.path(), "vol.img", VOL_SIZE);
    let (target, addr, _) =
        start_on(dir.path(), &format!("{}\n{}", nvme_section(""), nvme_volume("vol", &img, VOL_SIZE, false, Some(1), "")));

    // A controller that sends Keep Alive every 300 ms stays up.
    let (mut kept, kept_id) = NvmeTcpConn::admin(addr, NO_DIGESTS, SUBNQN, HOSTNQN, KATO_MS as u32);
    assert_eq!(kept.get_features(0x0f).expect("Get Features Keep Alive Timer"), KATO_MS, "the KATO of the Connect");
    let t0 = Instant::now();
    // A silent one, with an I/O queue.
    let (mut silent, silent_id) = NvmeTcpConn::admin(addr, NO_DIGESTS, SUBNQN, HOSTNQN, KATO_MS as u32);
    assert_ne!(kept_id, silent_id, "two admin Connects got the same controller id");
    let mut io = NvmeTcpConn::io(addr, NO_DIGESTS, silent_id, 1, SUBNQN, HOSTNQN);
    let waiter = std::thread::spawn(move || {
        let t = silent.wait_for_termination(Duration::from_millis(2 * KATO_MS + 5000));
        (t, t0.elapsed())
    });
    while t0.elapsed() < Duration::from_millis(3 * KATO_MS) {
        kept.keep_alive().unwrap_or_else(|s| panic!("Keep Alive at {:?}: {s}", t0.elapsed()));
        std::thread::sleep(Duration::from_millis(300));
    }
    let (t, closed_after) = waiter.join().unwrap();
    eprintln!("silent controller: {t:?} after {closed_after:?}");
    assert!(t.closed, "the target kept a controller with KATO {KATO_MS} ms that sent nothing: {t:?}");
    assert!(
        closed_after >= Duration::from_millis(KATO_MS - 100),
        "the target closed the admin queue after {closed_after:?}, before KATO ({KATO_MS} ms)"
    );
    assert!(closed_after <= Duration::from_millis(2 * KATO_MS + 3000), "closed only after {closed_after:?}");
    // Its I/O queue goes with it (the association ends).
    let t = io.wait_for_termination(Duration::from_secs(5));
    assert!(t.closed, "the I/O queue of the timed-out controller is still open: {t:?}");
    // The kept controller is fine, and a new one can connect.
    kept.keep_alive().expect("the controller that kept alive still answers");
    let (mut again, _) = NvmeTcpConn::admin(addr, NO_DIGESTS, SUBNQN, HOSTNQN, KATO_MS as u32);
    again.keep_alive().unwrap();
    target.assert_no_panic();
}

/// A daemon with one 64 MiB file volume as namespace 1.
fn one_volume_target() -> (tempfile::TempDir, TargetProcess, SocketAddr, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let img = sparse_file(dir.path(), "vol.img", VOL_SIZE);
    let (target, addr, _) =
        start_on(dir.path(), &format!("{}\n{}", nvme_section(""), nvme_volume("vol", &img, VOL_SIZE, false, Some(1), "")));
    (dir, target, addr, img)
}

#[test]
fn disconnect_of_an_io_queue_closes_it_and_frees_its_queue_id() {
    let (_dir, target, addr, _) = one_volume_target();
    let (mut admin, cntlid) = controller(addr);
    let mut q = NvmeTcpConn::io(addr, NO_DIGESTS, cntlid, 1, SUBNQN, HOSTNQN);
    // Once the host sees the connection closed, the queue id is free: a
    // Connect sent right then must not find it still taken. The window
    // is short (the target's thread must lose its CPU inside it), so it
    // is crossed many times with every CPU kept busy.
    let busy = BusyCpus::start();
    for round in 0..=255u8 {
        q.write(1, 0, &[round; 4096], false).unwrap();
        q.disconnect().unwrap_or_else(|s| panic!("round {round}: Fabrics Disconnect of I/O queue 1: {s}"));
        let t = q.wait_for_termination(Duration::from_secs(5));
        assert!(t.closed && t.term.is_none() && t.other.is_empty(), "round {round}: after Disconnect: {}", summary(&t));
        q = NvmeTcpConn::connect(addr, NO_DIGESTS);
        q.io_connect(cntlid, 1, SUBNQN, HOSTNQN)
            .unwrap_or_else(|s| panic!("round {round}: I/O queue 1 again right after its Disconnect: {s}"));
        assert!(q.read(1, 0, 1, BS).unwrap() == [round; 4096], "round {round}: the write before the Disconnect is lost");
    }
    drop(busy);
    admin.keep_alive().unwrap();
    target.assert_no_panic();
}

/// The Fabrics commands sent where they do not belong (NVMe Base 2.x,
/// Figures 574 and 105, section 6.4): a Disconnect on the admin queue
/// fails with Invalid Queue Type and ends nothing; a Disconnect of another
/// record format fails with Incompatible Format and keeps the I/O queue; a
/// Property Get or Set on an I/O queue fails with Invalid Field.
#[test]
fn fabrics_commands_on_the_wrong_queue_or_format_are_refused_and_end_nothing() {
    let (_dir, target, addr, _) = one_volume_target();
    let (mut admin, cntlid) = controller(addr);
    let disconnect = |recfmt: u32| {
        let mut e = SubmissionEntry::new(admin_opcode::FABRICS, 0);
        e.nsid = rdmablk_common::nvme::fabrics::fctype::DISCONNECT as u32;
        e.cdw[0] = recfmt;
        e
    };
    let c = admin.exec(disconnect(0), &[], &[], 0);
    assert_eq!(c.cqe.status, Status::INVALID_QUEUE_TYPE, "Disconnect on the admin queue");
    admin.keep_alive().expect("the admin queue after a refused Disconnect");
    let mut q = NvmeTcpConn::io(addr, NO_DIGESTS, cntlid, 1, SUBNQN, HOSTNQN);
    q.write(1, 0, &[0x44; 4096], false).unwrap();
    let c = q.exec(disconnect(1), &[], &[], 0);
    assert_eq!(c.cqe.status, Status::CONNECT_INCOMPATIBLE_FORMAT, "Disconnect with record format 1");
    for (what, set) in [("Property Get", false), ("Property Set", true)] {
        let e = Property { offset: property::CC, wide: false, value: 0 }.to_entry(0, set);
        assert_eq!(q.exec(e, &[], &[], 0).cqe.status, Status::INVALID_FIELD, "{what} on an I/O queue");
    }
    assert!(q.read(1, 0, 1, BS).unwrap() == [0x44; 4096], "the I/O queue after the refused commands");
    q.disconnect().expect("a proper Disconnect of the I/O queue");
    admin.keep_alive().unwrap();
    target.assert_no_panic();
}

#[test]
fn shutdown_and_disable_follow_cc() {
    let (_dir, target, addr, _) = one_volume_target();
    let (mut admin, _) = controller(addr);
    // Shutdown (CC.SHN normal): CSTS.SHST reaches "complete"; then CC.EN = 0 clears RDY.
    admin.property_set(property::CC, (CC_ENABLE | 1 << 14) as u32).expect("Property Set CC.SHN");
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let csts = admin.property_get(property::CSTS, false).expect("Property Get CSTS");
        if (csts >> 2) & 3 == 2 {
            break;
        }
        assert!(Instant::now() < deadline, "CSTS.SHST not 'complete' 5 s after CC.SHN: {csts:#x}");
        std::thread::sleep(Duration::from_millis(10));
    }
    admin.property_set(property::CC, 0).expect("Property Set CC.EN = 0");
    let deadline = Instant::now() + Duration::from_secs(5);
    while admin.property_get(property::CSTS, false).unwrap() & 1 != 0 {
        assert!(Instant::now() < deadline, "CSTS.RDY still set 5 s after CC.EN = 0");
        std::thread::sleep(Duration::from_millis(10));
    }
    target.assert_no_panic();
}

#[test]
fn losing_the_admin_queue_ends_the_controller_and_its_io_queues() {
    let (_dir, target, addr, _) = one_volume_target();
    let (admin, cntlid) = controller(addr);
    let mut q = NvmeTcpConn::io(addr, NO_DIGESTS, cntlid, 1, SUBNQN, HOSTNQN);
    q.read(1, 0, 1, BS).unwrap();
    drop(admin);
    let t = q.wait_for_termination(Duration::from_secs(10));
    assert!(t.closed, "an I/O queue outlived its controller's admin queue: {}", summary(&t));
    // And its controller id no longer takes I/O queues.
    let mut c = NvmeTcpConn::connect(addr, NO_DIGESTS);
    assert!(c.io_connect(cntlid, 2, SUBNQN, HOSTNQN).is_err(), "an I/O queue joined a controller whose admin queue is gone");
    target.assert_no_panic();
}

/// A host that ends its association by closing the admin queue's socket
/// is doing what hosts do: the log says the controller ended, at INFO,
/// and never that it was torn down (the kind of the close travels with
/// it from the queue thread to the controller; nothing matches its text).
#[test]
fn a_host_closing_its_admin_queue_is_logged_as_an_end_not_as_a_fault() {
    let (_dir, target, addr, _) = one_volume_target();
    let (admin, cntlid) = controller(addr);
    drop(admin);
    let line = target.wait_for_log_all(
        &[&format!("nvme controller {cntlid} "), "ended: admin queue closed: the host closed the connection"],
        Duration::from_secs(10),
    );
    assert!(line.contains(" INFO "), "a host closing its admin queue is logged as: {line}");
    let faults: Vec<String> = target.log().into_iter().filter(|l| l.contains("torn down")).collect();
    assert!(faults.is_empty(), "an association the host ended was logged as torn down: {faults:?}");
    target.assert_no_panic();
}

#[test]
fn digests_are_granted_as_asked_and_checked_on_the_admin_queue() {
    let dir = tempfile::tempdir().unwrap();
    let img = sparse_file(dir.path(), "vol.img", VOL_SIZE);
    let (target, addr, _) =
        start_on(dir.path(), &format!("{}\n{}", nvme_section(""), nvme_volume("vol", &img, VOL_SIZE, false, Some(1), "")));
    for digests in [NO_DIGESTS, Digests { header: true, data: false }, Digests { header: false, data: true }, BOTH_DIGESTS] {
        // NvmeTcpConn::connect asserts the ICResp grants exactly what was asked.
        let (mut admin, cntlid) = NvmeTcpConn::admin(addr, digests, SUBNQN, HOSTNQN, 0);
        let ctrl = IdCtrl::parse(&admin.identify(1, 0).unwrap_or_else(|s| panic!("{digests:?}: Identify: {s}")));
        assert_eq!(ctrl.subnqn, SUBNQN);
        let mut q = NvmeTcpConn::io(addr, digests, cntlid, 1, SUBNQN, HOSTNQN);
        let d: Vec<u8> = (0..64 * KIB).map(|i| (i * 7 + cntlid as usize) as u8).collect();
        q.write(1, 0, &d, false).unwrap_or_else(|s| panic!("{digests:?}: write: {s}"));
        assert!(q.read(1, 0, 16, BS).unwrap() == d, "{digests:?}: read back");
        q.write(1, 16, &d[..4096], false).unwrap();
        assert!(q.read(1, 16, 1, BS).unwrap() == d[..4096], "{digests:?}: read back in-capsule write");
    }
    // A Termination of a TermReq carries the header it echoes: the target
    // echoes the offending header (up to the PDU's header length).
    let mut c = NvmeTcpConn::connect(addr, Digests { header: true, data: false });
    let mut b = c.pdu_bytes(&Pdu::CapsuleCmd(connect_entry(0, 31, 0)), &connect_data(ANY_CONTROLLER, SUBNQN, HOSTNQN));
    b[72] ^= 1;
    c.raw_send(&b);
    let t = c.wait_for_termination(Duration::from_secs(10));
    let Some((TermReq { fes: f, .. }, echoed)) = &t.term else { panic!("no C2HTermReq for a bad header digest: {t:?}") };
    assert_eq!(*f, fes::HEADER_DIGEST_ERROR, "FES for a bad header digest on the admin Connect");
    assert!(!echoed.is_empty() && echoed[..] == b[..echoed.len()], "the C2HTermReq echoes the offending header: {echoed:02x?}");
    assert!(t.closed, "closed after the C2HTermReq");
    target.assert_no_panic();
}

// ---------------------------------------------------------------------------
// Discovery and per-host namespaces

/// An NQN or address field of a discovery log entry, without padding.
fn log_str(b: &[u8]) -> String {
    String::from_utf8_lossy(b).trim_end_matches(['\0', ' ']).to_owned()
}

#[test]
fn the_discovery_controller_lists_the_subsystem_on_its_listener() {
    use rdmablk_common::nvme::fabrics::DISCOVERY_NQN;
    let dir = tempfile::tempdir().unwrap();
    let img = sparse_file(dir.path(), "vol.img", VOL_SIZE);
    let (target, addr, _) =
        start_on(dir.path(), &format!("{}\n{}", nvme_section(""), nvme_volume("vol", &img, VOL_SIZE, false, Some(1), "")));
    let (mut disc, _) = NvmeTcpConn::admin(addr, NO_DIGESTS, DISCOVERY_NQN, HOSTNQN, 0);
    let id = IdCtrl::parse(&disc.identify(1, 0).expect("Identify Controller of the discovery controller"));
    assert_eq!(id.subnqn, DISCOVERY_NQN, "the discovery controller's SUBNQN");
    let header = disc.get_log_page(0x70, 0, 1024).expect("discovery log page header");
    let numrec = u64::from_le_bytes(header[8..16].try_into().unwrap());
    assert!(numrec >= 1, "the discovery log has no entries");
    let page = disc.get_log_page(0x70, 0, 1024 * (1 + numrec as usize)).expect("discovery log page");
    assert_eq!(page[..16], header[..16], "GENCTR and NUMREC changed between two reads");
    let entries: Vec<&[u8]> = page[1024..].chunks(1024).collect();
    let ours: Vec<&&[u8]> = entries.iter().filter(|e| log_str(&e[256..512]) == SUBNQN).collect();
    assert_eq!(ours.len(), 1, "one entry for the subsystem on one listener: {:?}", entries.iter().map(|e| log_str(&e[256..512])).collect::<Vec<_>>());
    let e = ours[0];
    assert_eq!((e[0], e[1], e[2]), (3, 1, 2), "TRTYPE TCP, ADRFAM IPv4, SUBTYPE NVM subsystem");
    assert_eq!(log_str(&e[32..64]), addr.port().to_string(), "TRSVCID");
    assert_eq!(log_str(&e[512..768]), addr.ip().to_string(), "TRADDR");
    // The discovery controller serves no I/O queues.
    let mut c = NvmeTcpConn::connect(addr, NO_DIGESTS);
    let r = c.exec(connect_entry(1, 31, 0), &connect_data(disc_cntlid_of(&mut disc), DISCOVERY_NQN, HOSTNQN), &[], 0);
    assert!(!r.cqe.status.is_success(), "an I/O queue Connect to the discovery controller succeeded");
    target.assert_no_panic();
}

/// The controller id of a connected admin queue (Identify Controller).
fn disc_cntlid_of(admin: &mut NvmeTcpConn) -> u16 {
    IdCtrl::parse(&admin.identify(1, 0).unwrap()).cntlid
}

/// A file volume block with the given access lines (no allow_any_host).
fn granted_volume(name: &str, path: &Path, nsid: u32, access: &str) -> String {
    format!(
        "[[volume]]\nname = \"{name}\"\nbackend = \"file\"\npath = \"{}\"\nsize = {VOL_SIZE}\nnsid = {nsid}\n{access}\n",
        path.display()
    )
}

#[test]
fn a_host_nqn_sees_only_the_namespaces_its_host_id_is_granted() {
    const H1: &str = "nqn.2014-08.org.nvmexpress:uuid:11111111-1111-4111-8111-111111111111";
    const H2: &str = "nqn.2014-08.org.nvmexpress:uuid:22222222-2222-4222-8222-222222222222";
    const STRANGER: &str = "nqn.2014-08.org.nvmexpress:uuid:33333333-3333-4333-8333-333333333333";
    let dir = tempfile::tempdir().unwrap();
    let mine = sparse_file(dir.path(), "mine.img", VOL_SIZE);
    let ro = sparse_file(dir.path(), "ro.img", VOL_SIZE);
    let other = sparse_file(dir.path(), "other.img", VOL_SIZE);
    // Key files for the rdmablk v1 side of the same hosts.
    let (k1, k2) = (dir.path().join("h1.key"), dir.path().join("h2.key"));
    rdmablk_common::auth::generate_key_file(&k1).unwrap();
    rdmablk_common::auth::generate_key_file(&k2).unwrap();
    let config = format!(
        "{}\n[[host]]\nid = \"h1\"\nnqn = \"{H1}\"\nkey_file = \"{}\"\n\n[[host]]\nid = \"h2\"\nnqn = \"{H2}\"\nkey_file = \"{}\"\n\n{}\n{}\n{}",
        nvme_section(""),
        k1.display(),
        k2.display(),
        granted_volume("mine", &mine, 1, "allowed_hosts = [\"h1\"]"),
        granted_volume("ro", &ro, 2, "read_only_hosts = [\"h1\"]"),
        granted_volume("other", &other, 3, "allowed_hosts = [\"h2\"]"),
    );
    let (target, addr, _) = start_on(dir.path(), &config);

    let (mut admin, cntlid) = controller_of(addr, H1);
    assert_eq!(parse_ns_list(&admin.identify(2, 0).unwrap()), vec![1, 2], "h1's active namespaces");
    let mut q = NvmeTcpConn::io(addr, NO_DIGESTS, cntlid, 1, SUBNQN, H1);
    q.write(1, 0, &[0x11; 8192], false).expect("h1 writes its volume");
    assert!(file_bytes(&mine, 0, 8192).iter().all(|&b| b == 0x11));
    q.read(2, 0, 1, BS).expect("h1 reads its read-only volume");
    assert_status("h1 writes its read-only volume", q.write(2, 0, &[0x11; 4096], false), Status::NAMESPACE_WRITE_PROTECTED);
    assert_status("h1 reads h2's volume", q.read(3, 0, 1, BS), Status::INVALID_NAMESPACE);
    assert_status("h1 writes h2's volume", q.write(3, 0, &[0x11; 4096], false), Status::INVALID_NAMESPACE);
    assert!(file_bytes(&ro, 0, 4096).iter().all(|&b| b == 0) && file_bytes(&other, 0, 4096).iter().all(|&b| b == 0));

    let (mut admin2, cntlid2) = controller_of(addr, H2);
    assert_eq!(parse_ns_list(&admin2.identify(2, 0).unwrap()), vec![3], "h2's active namespaces");
    let mut q2 = NvmeTcpConn::io(addr, NO_DIGESTS, cntlid2, 1, SUBNQN, H2);
    assert_status("h2 reads h1's volume", q2.read(1, 0, 1, BS), Status::INVALID_NAMESPACE);
    // h2 cannot attach an I/O queue to h1's controller.
    let mut c = NvmeTcpConn::connect(addr, NO_DIGESTS);
    let r = c.exec(connect_entry(2, 31, 0), &connect_data(cntlid, SUBNQN, H2), &[], 0);
    assert!(!r.cqe.status.is_success(), "h2 connected an I/O queue to h1's controller");

    // A host NQN no [[host]] names: refused, or a controller with nothing in it.
    let mut s = NvmeTcpConn::connect(addr, NO_DIGESTS);
    match s.admin_connect(SUBNQN, STRANGER, 0) {
        Err(st) => assert_eq!(st, Status::CONNECT_INVALID_HOST, "Connect from an unknown host NQN"),
        Ok(id) => {
            s.enable();
            assert_eq!(parse_ns_list(&s.identify(2, 0).unwrap()), Vec::<u32>::new(), "a stranger's active namespaces");
            let mut sq = NvmeTcpConn::io(addr, NO_DIGESTS, id, 1, SUBNQN, STRANGER);
            assert_status("a stranger reads h1's volume", sq.read(1, 0, 1, BS), Status::INVALID_NAMESPACE);
        }
    }
    admin.keep_alive().unwrap();
    admin2.keep_alive().unwrap();
    target.assert_no_panic();
}

#[test]
fn a_host_known_only_by_its_nqn_needs_no_key_file() {
    const H1: &str = "nqn.2014-08.org.nvmexpress:uuid:11111111-1111-4111-8111-111111111111";
    let dir = tempfile::tempdir().unwrap();
    let mine = sparse_file(dir.path(), "mine.img", VOL_SIZE);
    let other = sparse_file(dir.path(), "other.img", VOL_SIZE);
    // h2 is an rdmablk v1 host with a key; h1 is an NVMe-oF host with none.
    let k2 = dir.path().join("h2.key");
    rdmablk_common::auth::generate_key_file(&k2).unwrap();
    let config = format!(
        "{}\n[[host]]\nid = \"h1\"\nnqn = \"{H1}\"\n\n[[host]]\nid = \"h2\"\nkey_file = \"{}\"\n\n{}\n{}",
        nvme_section(""),
        k2.display(),
        granted_volume("mine", &mine, 1, "allowed_hosts = [\"h1\"]"),
        granted_volume("other", &other, 2, "allowed_hosts = [\"h2\"]"),
    );
    let (target, addr, path) = start_on(dir.path(), &config);
    let check = std::process::Command::new(rdmablk_system_tests::bin("rdmablk-target")).arg("--check").arg("--config").arg(&path).output().unwrap();
    let out = String::from_utf8_lossy(&check.stdout);
    assert!(check.status.success() && out.contains(&format!("host \"h1\": NVMe-oF only, as {H1}")), "--check: {out}");
    let (mut admin, cntlid) = controller_of(addr, H1);
    assert_eq!(parse_ns_list(&admin.identify(2, 0).unwrap()), vec![1], "h1's active namespaces");
    let mut q = NvmeTcpConn::io(addr, NO_DIGESTS, cntlid, 1, SUBNQN, H1);
    q.write(1, 0, &[0x11; 4096], false).expect("h1 writes its volume");
    assert!(file_bytes(&mine, 0, 4096).iter().all(|&b| b == 0x11));
    assert_status("h1 reads h2's volume", q.read(2, 0, 1, BS), Status::INVALID_NAMESPACE);
    admin.keep_alive().unwrap();
    target.assert_no_panic();
}

// ---------------------------------------------------------------------------
// Both front ends on one daemon

/// A target serving volume "vol" (namespace 1) on an rdmablk listener and
/// an nvme+tcp one, with `extra` lines in `[target]`: the process, the
/// NVMe address and the rdmablk URL.
fn start_both_front_ends(dir: &Path, extra: &str) -> (TargetProcess, SocketAddr, String) {
    let img = sparse_file(dir, "vol.img", VOL_SIZE);
    let host = listen_host();
    let host = if host.contains(':') { format!("[{host}]") } else { host };
    let config = format!(
        "[target]\nlisten = [\"{}://{host}:0\", \"nvme+tcp://{host}:0\"]\nnqn = \"{SUBNQN}\"\n{extra}\n{}",
        rdmablk_system_tests::scheme(),
        nvme_volume("vol", &img, VOL_SIZE, false, Some(1), "")
    );
    let (target, addr, _) = start_on(dir, &config);
    let line = target.wait_for_log(&format!("listening on {}://", rdmablk_system_tests::scheme()), Duration::from_secs(10));
    let at = line.find("listening on ").unwrap() + "listening on ".len();
    let url: String = line[at..].chars().take_while(|c| !c.is_whitespace() && *c != '"' && *c != ',').collect();
    (target, addr, url)
}

#[test]
fn nvme_tcp_and_the_rdmablk_protocol_serve_the_same_volume() {
    use rdmablk_initiator::{BlockDevice, ConnectOptions, Session};
    let dir = tempfile::tempdir().unwrap();
    let (target, addr, url) = start_both_front_ends(dir.path(), "");
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed());

    let (mut admin, cntlid) = controller(addr);
    let mut q = NvmeTcpConn::io(addr, NO_DIGESTS, cntlid, 1, SUBNQN, HOSTNQN);
    let session = Session::connect(&url, ConnectOptions::default()).expect("rdmablk session");
    let vol = session.open("vol").expect("open");

    // NVMe writes, the rdmablk protocol reads; and the other way round.
    let a = random_bytes(&mut rng, 64 * KIB);
    q.write(1, 256, &a, false).unwrap();
    let mut back = vec![0u8; a.len()];
    vol.read_at(&mut back, 256 * 4096).unwrap();
    assert!(back == a, "the rdmablk session reads other bytes than NVMe wrote");
    let b = random_bytes(&mut rng, 128 * KIB);
    vol.write_at(&b, 1024 * 4096).unwrap();
    assert!(q.read(1, 1024, 32, BS).unwrap() == b, "NVMe reads other bytes than the rdmablk session wrote");
    session.close();
    admin.keep_alive().unwrap();
    target.assert_no_panic();
}

// ---------------------------------------------------------------------------
// Concurrency

#[test]
fn many_controllers_and_queues_in_parallel_keep_every_byte() {
    const THREADS: u64 = 4;
    const REGION: u64 = 2048; // blocks per queue: 8 queues fill the 64 MiB volume
    let dir = tempfile::tempdir().unwrap();
    let img = sparse_file(dir.path(), "vol.img", VOL_SIZE);
    let (target, addr, _) =
        start_on(dir.path(), &format!("{}\n{}", nvme_section(""), nvme_volume("vol", &img, VOL_SIZE, false, Some(1), "")));
    let seed = seed();
    eprintln!("seed {seed} (set RDMABLK_TEST_SEED to replay)");
    let workers: Vec<_> = (0..THREADS)
        .map(|t| {
            std::thread::spawn(move || {
                let host = format!("nqn.2014-08.org.nvmexpress:uuid:00000000-0000-4000-8000-00000000000{t}");
                let (mut admin, cntlid) = controller_of(addr, &host);
                let digests = if t % 2 == 0 { NO_DIGESTS } else { BOTH_DIGESTS };
                let mut rng = rand::rngs::StdRng::seed_from_u64(seed ^ t);
                let mut models = Vec::new();
                let queues: Vec<NvmeTcpConn> = (1..=2).map(|qid| NvmeTcpConn::io(addr, digests, cntlid, qid, SUBNQN, &host)).collect();
                let handles: Vec<_> = queues
                    .into_iter()
                    .enumerate()
                    .map(|(i, mut q)| {
                        let base = (t * 2 + i as u64) * REGION;
                        let mut rng = rand::rngs::StdRng::seed_from_u64(rng.gen());
                        std::thread::spawn(move || {
                            let mut model = vec![0u8; (REGION * BS as u64) as usize];
                            for round in 0..25 {
                                // 8 writes in flight, then 8 reads of the same ranges.
                                let mut ranges = Vec::new();
                                let mut datas = Vec::new();
                                for _ in 0..8 {
                                    let blocks = rng.gen_range(1..=32u32);
                                    let lba = rng.gen_range(0..=REGION - blocks as u64);
                                    ranges.push((lba, blocks));
                                    datas.push(random_bytes(&mut rng, blocks as usize * BS as usize));
                                }
                                let cmds: Vec<Cmd<'_>> = ranges
                                    .iter()
                                    .zip(&datas)
                                    .map(|(&(lba, blocks), d)| {
                                        let e = rw_entry(io_opcode::WRITE, 1, base + lba, blocks, false);
                                        if d.len() <= 16 * KIB { Cmd::new(e, d, &[], 0) } else { Cmd::new(e, &[], d, 0) }
                                    })
                                    .collect();
                                let done = q.execute_many(&cmds).unwrap_or_else(|e| panic!("queue at {base}, round {round}: writes: {e}"));
                                assert!(
                                    done.iter().all(|c| c.cqe.status.is_success()),
                                    "queue at {base}, round {round}: write statuses {:?} for {:?}",
                                    done.iter().map(|c| c.cqe.status.to_string()).collect::<Vec<_>>(),
                                    ranges
                                );
                                // Overlapping writes in one batch land in some order:
                                // apply them to the model in submission order and
                                // check only ranges no later write of the batch touched.
                                for (&(lba, _), d) in ranges.iter().zip(&datas) {
                                    let off = (lba * BS as u64) as usize;
                                    model[off..off + d.len()].copy_from_slice(d);
                                }
                                let cmds: Vec<Cmd<'_>> = ranges
                                    .iter()
                                    .map(|&(lba, blocks)| {
                                        Cmd::new(rw_entry(io_opcode::READ, 1, base + lba, blocks, false), &[], &[], blocks as usize * BS as usize)
                                    })
                                    .collect();
                                let done = q.execute_many(&cmds).unwrap_or_else(|e| panic!("queue at {base}, round {round}: reads: {e}"));
                                for (j, (c, &(lba, blocks))) in done.iter().zip(&ranges).enumerate() {
                                    assert!(c.cqe.status.is_success(), "round {round}: read {j}: {}", c.cqe.status);
                                    let overlapped = ranges[j + 1..].iter().any(|&(l, b)| l < lba + blocks as u64 && lba < l + b as u64)
                                        || ranges[..j].iter().any(|&(l, b)| l < lba + blocks as u64 && lba < l + b as u64);
                                    if !overlapped {
                                        let off = (lba * BS as u64) as usize;
                                        assert!(c.data == model[off..off + c.data.len()], "queue at {base}, round {round}: read {j} at {lba}+{blocks}");
                                    }
                                }
                                // Settle the model with what the target holds for overlapped ranges.
                                for (c, &(lba, _)) in done.iter().zip(&ranges) {
                                    let off = (lba * BS as u64) as usize;
                                    model[off..off + c.data.len()].copy_from_slice(&c.data);
                                }
                            }
                            (base, model)
                        })
                    })
                    .collect();
                for h in handles {
                    models.push(h.join().unwrap_or_else(|e| std::panic::resume_unwind(e)));
                }
                admin.keep_alive().expect("keep alive after the parallel I/O");
                models
            })
        })
        .collect();
    let mut models = Vec::new();
    for w in workers {
        models.extend(w.join().unwrap_or_else(|e| std::panic::resume_unwind(e)));
    }
    for (base, model) in models {
        assert!(file_bytes(&img, base * BS as u64, model.len()) == model, "the backing file differs in the region at LBA {base}");
    }
    target.assert_no_panic();
}

// ---------------------------------------------------------------------------
// Reload: namespaces come and go with an asynchronous event

/// Waits for the completion of the outstanding AER `cid` (or finds it among
/// the stray completions); returns its DW0.
fn await_aer(admin: &mut NvmeTcpConn, cid: u16, within: Duration) -> u32 {
    if let Some(i) = admin.stray.iter().position(|c| c.cid == cid) {
        let c = admin.stray.remove(i).unwrap();
        assert!(c.status.is_success(), "AER completed with {}", c.status);
        return c.result as u32;
    }
    match admin.recv_pdu_within(within) {
        Ok((Pdu::CapsuleResp(c), _)) if c.cid == cid => {
            assert!(c.status.is_success(), "AER completed with {}", c.status);
            c.result as u32
        }
        other => panic!("expected the completion of AER {cid}, got {other:?}"),
    }
}

#[test]
fn a_reload_that_adds_or_removes_a_volume_raises_a_namespace_event() {
    let dir = tempfile::tempdir().unwrap();
    let a = sparse_file(dir.path(), "a.img", VOL_SIZE);
    let b = sparse_file(dir.path(), "b.img", 16 * MIB);
    let one = format!("{}\n{}", nvme_section(""), nvme_volume("a", &a, VOL_SIZE, false, None, ""));
    let two = format!("{one}\n{}", nvme_volume("b", &b, 16 * MIB, false, None, ""));
    let (target, addr, _) = start_on(dir.path(), &one);
    let (mut admin, _) = controller(addr);
    // Namespace attribute notices on (Asynchronous Event Configuration, bit 8).
    admin.set_features(0x0b, 1 << 8).expect("Set Features Asynchronous Event Configuration");
    assert_eq!(parse_ns_list(&admin.identify(2, 0).unwrap()), vec![1]);

    let aer = admin.submit_aer();
    admin.keep_alive().unwrap();
    assert!(admin.stray.is_empty(), "the AER completed before any event: {:?}", admin.stray);
    let summary = target.reload(&two);
    assert!(summary.contains("reload complete"), "{summary}");
    let dw0 = await_aer(&mut admin, aer, Duration::from_secs(10));
    assert_eq!(dw0 & 0x7, 2, "AER type: Notice ({dw0:#x})");
    assert_eq!((dw0 >> 8) & 0xff, 0, "AER info: Namespace Attribute Changed ({dw0:#x})");
    assert_eq!((dw0 >> 16) & 0xff, 0x04, "AER log page: Changed Namespace List ({dw0:#x})");
    let changed = parse_ns_list(&admin.get_log_page(0x04, 0xffff_ffff, 4096).expect("Changed Namespace List"));
    assert_eq!(changed, vec![2], "the changed namespace list names the new namespace");
    assert_eq!(parse_ns_list(&admin.identify(2, 0).unwrap()), vec![1, 2], "active namespaces after adding b");
    let ns2 = IdNs::parse(&admin.identify(0, 2).unwrap());
    assert_eq!(ns2.nsze * ns2.block_size() as u64, 16 * MIB, "size of the new namespace: {ns2:?}");

    // Removing it: another event, and the namespace is gone.
    let aer = admin.submit_aer();
    let summary = target.reload(&one);
    assert!(summary.contains("reload complete"), "{summary}");
    let dw0 = await_aer(&mut admin, aer, Duration::from_secs(10));
    assert_eq!((dw0 & 0x7, (dw0 >> 8) & 0xff, (dw0 >> 16) & 0xff), (2, 0, 0x04), "AER for the removal ({dw0:#x})");
    let changed = parse_ns_list(&admin.get_log_page(0x04, 0xffff_ffff, 4096).expect("Changed Namespace List"));
    assert_eq!(changed, vec![2], "the changed namespace list names the removed namespace");
    assert_eq!(parse_ns_list(&admin.identify(2, 0).unwrap()), vec![1], "active namespaces after removing b");
    target.assert_no_panic();
}

#[test]
fn io_on_a_512_byte_block_namespace() {
    let dir = tempfile::tempdir().unwrap();
    let img = sparse_file(dir.path(), "v512.img", 16 * MIB);
    let (target, addr, _) = start_on(
        dir.path(),
        &format!("{}\n{}", nvme_section(""), nvme_volume("v512", &img, 16 * MIB, false, Some(3), "block_size = 512\n")),
    );
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed());
    let (mut admin, cntlid) = controller(addr);
    let ns = IdNs::parse(&admin.identify(0, 3).unwrap());
    assert_eq!((ns.block_size(), ns.nsze), (512, 16 * MIB / 512), "{ns:?}");
    let mut q = NvmeTcpConn::io(addr, NO_DIGESTS, cntlid, 1, SUBNQN, HOSTNQN);
    for (lba, blocks) in [(5u64, 3usize), (1, 1), (1000, 32), (4001, 100), (20_000, 256)] {
        let d = random_bytes(&mut rng, blocks * 512);
        q.write_bs(3, lba, &d, 512, false).unwrap_or_else(|s| panic!("write of {blocks} blocks at {lba}: {s}"));
        let back = q.read(3, lba, blocks as u32, 512).unwrap_or_else(|s| panic!("read of {blocks} blocks at {lba}: {s}"));
        assert!(back == d, "512-byte namespace: read back other bytes at {lba}+{blocks}");
        assert!(file_bytes(&img, lba * 512, d.len()) == d, "512-byte namespace: the file differs at {lba}+{blocks}");
    }
    q.write_zeroes(3, 6, 1).unwrap();
    assert!(file_bytes(&img, 6 * 512, 512).iter().all(|&b| b == 0), "Write Zeroes of one 512-byte block");
    assert_status("read at NSZE", q.read(3, ns.nsze, 1, 512), Status::LBA_OUT_OF_RANGE);
    admin.keep_alive().unwrap();
    target.assert_no_panic();
}

#[test]
fn connections_that_never_connect_are_dropped_after_the_handshake_timeout() {
    let dir = tempfile::tempdir().unwrap();
    let img = sparse_file(dir.path(), "vol.img", VOL_SIZE);
    let (target, addr, _) = start_on(
        dir.path(),
        &format!("{}\n{}", nvme_section("handshake_timeout = \"1s\"\n"), nvme_volume("vol", &img, VOL_SIZE, false, Some(1), "")),
    );
    let t0 = Instant::now();
    // Silent from the first byte; ICReq and then silence; half an ICReq.
    let mut silent = NvmeTcpConn::tcp(addr);
    let mut no_connect = NvmeTcpConn::connect(addr, NO_DIGESTS);
    let mut half = NvmeTcpConn::tcp(addr);
    let icreq = half.pdu_bytes(&Pdu::IcReq(rdmablk_common::nvme::tcp::IcReq { pfv: 0, hpda: 0, digests: NO_DIGESTS, maxr2t: 0 }), &[]);
    half.raw_send(&icreq[..60]);
    // A connected admin queue with KATO 0 is not affected.
    let (mut good, _) = NvmeTcpConn::admin(addr, NO_DIGESTS, SUBNQN, HOSTNQN, 0);
    for (name, c) in [("silent", &mut silent), ("ICReq only", &mut no_connect), ("half an ICReq", &mut half)] {
        let t = c.wait_for_termination(Duration::from_secs(8).saturating_sub(t0.elapsed()));
        assert!(t.closed, "{name}: still open {:?} after a 1 s handshake_timeout: {}", t0.elapsed(), summary(&t));
    }
    std::thread::sleep(Duration::from_millis(1500));
    good.keep_alive().expect("a connected admin queue outlives handshake_timeout");
    target.assert_no_panic();
}

#[test]
fn per_volume_metrics_count_nvme_io_by_opcode_beside_v1() {
    use rdmablk_initiator::{BlockDevice, ConnectOptions, Session};
    let dir = tempfile::tempdir().unwrap();
    let (target, addr, url) = start_both_front_ends(dir.path(), "metrics = \"127.0.0.1:0\"\n");
    let metrics = target.metrics_addr();
    let (_admin, cntlid) = controller(addr);
    let mut q = NvmeTcpConn::io(addr, NO_DIGESTS, cntlid, 1, SUBNQN, HOSTNQN);
    q.write(1, 0, &[0x5a; 8192], true).unwrap();
    q.write(1, 2, &[0x5b; 4096], false).unwrap();
    assert_eq!(q.read(1, 0, 2, BS).unwrap(), vec![0x5a; 8192]);
    q.flush(1).unwrap();
    q.write_zeroes(1, 8, 4).unwrap();
    q.deallocate(1, &[(16, 2), (32, 1)]).unwrap();
    // Refused before any disk work (past the end): not an I/O of the volume.
    assert_status("read past the end", q.read(1, VOL_SIZE / BS as u64, 1, BS), Status::LBA_OUT_OF_RANGE);
    // A v1 READ of the same volume adds to the same series.
    let session = Session::connect(&url, ConnectOptions::default()).expect("rdmablk session");
    let vol = session.open("vol").expect("open");
    let mut buf = vec![0u8; 4096];
    vol.read_at(&mut buf, 0).unwrap();
    assert_eq!(buf, vec![0x5a; 4096]);
    session.close();
    let s = scrape(&metrics);
    let v = |name: &str, op: &str| sample(&s, name, &[("volume", "vol"), ("op", op)]).unwrap_or_else(|| panic!("{name} {op} missing"));
    assert_eq!(v("rdmablk_volume_ops_total", "write"), 2.0);
    assert_eq!(v("rdmablk_volume_bytes_total", "write"), 12288.0);
    assert_eq!(v("rdmablk_volume_ops_total", "read"), 2.0, "one NVMe read and one v1 read");
    assert_eq!(v("rdmablk_volume_bytes_total", "read"), 12288.0);
    assert_eq!(v("rdmablk_volume_ops_total", "flush"), 1.0);
    assert_eq!(v("rdmablk_volume_ops_total", "write_zeroes"), 1.0);
    assert_eq!(v("rdmablk_volume_bytes_total", "write_zeroes"), 4.0 * BS as f64);
    assert_eq!(v("rdmablk_volume_ops_total", "discard"), 1.0);
    assert_eq!(v("rdmablk_volume_bytes_total", "discard"), 3.0 * BS as f64);
    assert_eq!(v("rdmablk_volume_errors_total", "read"), 0.0);
    // NVMe commands are timed where the clock costs no system call.
    let clock = std::fs::read_to_string("/sys/devices/system/clocksource/clocksource0/current_clocksource").unwrap_or_default();
    let timed = matches!(clock.trim(), "tsc" | "kvm-clock" | "arch_sys_counter" | "hyperv_clocksource_tsc_page" | "riscv_clocksource");
    let nvme_reads_timed = if timed { 1.0 } else { 0.0 };
    assert_eq!(v("rdmablk_volume_latency_seconds_count", "read"), 1.0 + nvme_reads_timed, "clocksource {clock:?}");
    target.assert_no_panic();
}

#[test]
fn the_metrics_endpoint_counts_nvme_queues_commands_bytes_and_terminations() {
    let dir = tempfile::tempdir().unwrap();
    let img = sparse_file(dir.path(), "vol.img", VOL_SIZE);
    let config = format!("{}\n{}", nvme_section("metrics = \"127.0.0.1:0\"\n"), nvme_volume("vol", &img, VOL_SIZE, false, Some(1), ""));
    let (target, addr, _) = start_on(dir.path(), &config);
    let metrics = target.metrics_addr();
    let (mut admin, cntlid) = controller(addr);
    let mut q = NvmeTcpConn::io(addr, NO_DIGESTS, cntlid, 1, SUBNQN, HOSTNQN);
    q.write(1, 0, &[0x5a; 8192], false).unwrap();
    assert_eq!(q.read(1, 0, 2, BS).unwrap(), vec![0x5a; 8192]);
    assert_status("read past the end", q.read(1, VOL_SIZE / BS as u64, 1, BS), Status::LBA_OUT_OF_RANGE);
    let s = scrape(&metrics);
    let v = |name: &str, labels: &[(&str, &str)]| sample(&s, name, labels).unwrap_or_else(|| panic!("{name} {labels:?} missing"));
    assert_eq!(v("rdmablk_nvme_controllers", &[]), 1.0);
    assert_eq!(v("rdmablk_nvme_queues", &[]), 2.0);
    assert_eq!(v("rdmablk_nvme_commands_total", &[("class", "write")]), 1.0);
    assert_eq!(v("rdmablk_nvme_commands_total", &[("class", "read")]), 2.0);
    assert_eq!(v("rdmablk_nvme_written_bytes_total", &[]), 8192.0);
    assert_eq!(v("rdmablk_nvme_read_bytes_total", &[]), 8192.0);
    assert!(v("rdmablk_nvme_errors_total", &[]) >= 1.0);
    // A garbage PDU on a third connection is terminated and counted.
    let mut bad = NvmeTcpConn::connect(addr, NO_DIGESTS);
    bad.raw_send(&[0xff; 72]);
    let t = bad.wait_for_termination(Duration::from_secs(5));
    assert!(t.closed, "{}", summary(&t));
    wait_until("the termination is counted", Duration::from_secs(5), || {
        sample(&scrape(&metrics), "rdmablk_nvme_terminations_total", &[]) == Some(1.0)
    });
    drop(q);
    admin.keep_alive().unwrap();
    drop(admin);
    wait_until("the queues are gone", Duration::from_secs(5), || {
        let s = scrape(&metrics);
        sample(&s, "rdmablk_nvme_queues", &[]) == Some(0.0) && sample(&s, "rdmablk_nvme_controllers", &[]) == Some(0.0)
    });
    target.assert_no_panic();
}

#[test]
fn nvme_connections_count_against_the_connection_limits() {
    use std::io::Read;
    let dir = tempfile::tempdir().unwrap();
    let img = sparse_file(dir.path(), "vol.img", VOL_SIZE);
    let config = format!(
        "{}\n{}",
        nvme_section("max_connections_per_address = 3\nmax_handshakes_per_address = 3\n"),
        nvme_volume("vol", &img, VOL_SIZE, false, Some(1), "")
    );
    let (target, addr, _) = start_on(dir.path(), &config);
    let (mut admin, cntlid) = controller(addr);
    let mut q1 = NvmeTcpConn::io(addr, NO_DIGESTS, cntlid, 1, SUBNQN, HOSTNQN);
    let idle = NvmeTcpConn::connect(addr, NO_DIGESTS);
    // A fourth connection from this address is closed at once, unanswered.
    let mut extra = std::net::TcpStream::connect(addr).unwrap();
    extra.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut buf = [0u8; 8];
    match extra.read(&mut buf) {
        Ok(0) => {}
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => {}
        other => panic!("the fourth connection got {other:?} instead of being closed"),
    }
    target.wait_for_log("target.max_connections_per_address = 3", Duration::from_secs(5));
    // The three that were admitted keep working; one closing makes room.
    q1.write(1, 0, &[0x11; 4096], false).unwrap();
    drop(idle);
    // Admitted means answered: an ICReq gets its 128-byte ICResp.
    let answered = || {
        use std::io::Write;
        let mut s = std::net::TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
        let icreq = Pdu::IcReq(rdmablk_common::nvme::tcp::IcReq { pfv: 0, hpda: 0, digests: NO_DIGESTS, maxr2t: 0 });
        s.write_all(&icreq.to_wire(NO_DIGESTS, &[], 0)).is_ok() && {
            let mut resp = [0u8; 128];
            s.read_exact(&mut resp).is_ok() && resp[0] == 0x01
        }
    };
    wait_until("a connection slot is free again", Duration::from_secs(5), answered);
    admin.keep_alive().unwrap();
    target.assert_no_panic();
}

#[test]
fn sigterm_with_nvme_hosts_connected_ends_their_controllers_and_exits_cleanly() {
    let (_dir, mut target, addr, img) = one_volume_target();
    let (_admin, cntlid) = controller(addr);
    let mut q = NvmeTcpConn::io(addr, NO_DIGESTS, cntlid, 1, SUBNQN, HOSTNQN);
    let data = vec![0x77u8; 65536];
    q.write(1, 16, &data, true).unwrap();
    target.signal(libc::SIGTERM);
    assert_eq!(target.wait_exit(Duration::from_secs(10)), Some(0), "exit status after SIGTERM");
    let t = q.wait_for_termination(Duration::from_secs(5));
    assert!(t.closed, "the I/O queue is closed: {}", summary(&t));
    assert_eq!(file_bytes(&img, 16 * BS as u64, data.len()), data, "the FUA write is on disk");
    assert!(target.log().iter().any(|l| l.contains("torn down: the target is stopping")));
}

/// A loop device over a sparse file, detached on drop.
struct LoopDevice(String);

impl LoopDevice {
    fn over(file: &Path) -> Option<LoopDevice> {
        let out = std::process::Command::new("losetup").args(["-f", "--show"]).arg(file).output().ok()?;
        out.status.success().then(|| LoopDevice(String::from_utf8_lossy(&out.stdout).trim().to_owned()))
    }
}

impl Drop for LoopDevice {
    fn drop(&mut self) {
        let _ = std::process::Command::new("losetup").args(["-d", &self.0]).status();
    }
}

#[test]
fn a_block_device_namespace_deallocates_and_zeroes_through_the_blocking_worker() {
    let dir = tempfile::tempdir().unwrap();
    let img = sparse_file(dir.path(), "dev.img", VOL_SIZE);
    let Some(dev) = LoopDevice::over(&img) else {
        eprintln!("skipping: no loop device (needs root and losetup)");
        return;
    };
    let vol = format!("[[volume]]\nname = \"dev\"\nbackend = \"file\"\npath = \"{}\"\nallow_any_host = true\nnsid = 1\n", dev.0);
    let (target, addr, _) = start_on(dir.path(), &format!("{}\n{vol}", nvme_section("")));
    let (mut admin, cntlid) = controller(addr);
    let ns = admin.identify(0, 1).unwrap();
    let bs = 1u32 << ns[130];
    let mut q = NvmeTcpConn::io(addr, NO_DIGESTS, cntlid, 1, SUBNQN, HOSTNQN);
    let blocks = 65536 / bs;
    let data = vec![0xc3u8; 65536];
    q.write_bs(1, 0, &data, bs, false).unwrap();
    q.write_bs(1, blocks as u64, &data, bs, false).unwrap();
    assert_eq!(q.read(1, 0, 2 * blocks, bs).unwrap(), [&data[..], &data[..]].concat());
    // Block devices deallocate with BLKDISCARD and zero with BLKZEROOUT,
    // which run on the queue's blocking worker.
    q.deallocate(1, &[(0, blocks)]).unwrap();
    q.write_zeroes(1, blocks as u64, blocks).unwrap();
    q.flush(1).unwrap();
    assert_eq!(q.read(1, 0, 2 * blocks, bs).unwrap(), vec![0u8; 131072]);
    let described = target.log().into_iter().find(|l| l.contains(&dev.0)).expect("the volume is the loop device");
    assert!(described.contains("discard=BLKDISCARD") && described.contains("write_zeroes=BLKZEROOUT"), "{described}");
    admin.keep_alive().unwrap();
    target.assert_no_panic();
}

#[test]
fn a_host_that_sends_commands_and_reads_no_answers_is_closed_not_buffered_without_end() {
    let (_dir, target, addr, _) = one_volume_target();
    let (mut admin, cntlid) = controller(addr);
    let mut good = NvmeTcpConn::io(addr, NO_DIGESTS, cntlid, 2, SUBNQN, HOSTNQN);
    let mut flood = NvmeTcpConn::io(addr, NO_DIGESTS, cntlid, 1, SUBNQN, HOSTNQN);
    // Flushes, never reading an answer: far more than the socket buffers and
    // the target's limit of unsent answers hold.
    let rss_before = rdmablk_system_tests::rss_bytes(target.pid());
    let mut sent = 0u32;
    let mut closed = false;
    for i in 0..400_000u32 {
        let mut e = SubmissionEntry::new(io_opcode::FLUSH, (i % 60000) as u16 + 1);
        e.nsid = 1;
        if flood.try_raw_send(&flood.pdu_bytes(&Pdu::CapsuleCmd(e), &[])).is_err() {
            closed = true;
            break;
        }
        sent += 1;
    }
    assert!(closed, "the target took {sent} commands without an answer read and kept the connection");
    target.wait_for_log("does not read their answers", Duration::from_secs(10));
    let rss_after = rdmablk_system_tests::rss_bytes(target.pid());
    assert!(rss_after < rss_before + (64 << 20), "RSS grew from {rss_before} to {rss_after} bytes");
    // Others are unaffected.
    good.write(1, 0, &[0x42; 4096], false).unwrap();
    assert_eq!(good.read(1, 0, 1, BS).unwrap(), vec![0x42; 4096]);
    admin.keep_alive().unwrap();
    target.assert_no_panic();
}

/// `max_controllers` and `max_controllers_per_host` bound the controllers
/// (each refused Connect is Connect Controller Busy, logged with the key),
/// and a controller with KATO 0 (no keep-alive to expire) still ends by
/// `idle_timeout` once it has no I/O queue, nothing in flight and has sent
/// nothing for that long; one with an I/O queue stays.
#[test]
fn controllers_are_bounded_and_a_kato_zero_one_without_io_queues_ends_when_idle() {
    let dir = tempfile::tempdir().unwrap();
    let img = sparse_file(dir.path(), "vol.img", VOL_SIZE);
    let config = format!(
        "{}\n{}",
        nvme_section("max_controllers = 4\nmax_controllers_per_host = 2\nidle_timeout = \"2s\"\nmetrics = \"127.0.0.1:0\"\n"),
        nvme_volume("vol", &img, VOL_SIZE, false, Some(1), "")
    );
    let (target, addr, _) = start_on(dir.path(), &config);
    let host = |i: usize| format!("nqn.2014-08.org.example:bounded-{i}");
    let admin_of = |hostnqn: &str| {
        let mut c = NvmeTcpConn::connect(addr, NO_DIGESTS);
        let r = c.admin_connect(SUBNQN, hostnqn, 0);
        (c, r)
    };
    // Two controllers of one host; its third is refused.
    let (mut a1, r) = admin_of(&host(0));
    let a1_id = r.expect("first controller of host 0");
    a1.enable();
    let (_a2, r) = admin_of(&host(0));
    r.expect("second controller of host 0");
    let (_a3, r) = admin_of(&host(0));
    assert_status("a third controller of one host", r, Status::CONNECT_CONTROLLER_BUSY);
    target.wait_for_log("target.max_controllers_per_host = 2", Duration::from_secs(5));
    // Two more hosts fill max_controllers; a fifth controller is refused.
    let (_b, r) = admin_of(&host(1));
    r.expect("host 1");
    let (_c, r) = admin_of(&host(2));
    r.expect("host 2");
    let (_d, r) = admin_of(&host(3));
    assert_status("a fifth controller", r, Status::CONNECT_CONTROLLER_BUSY);
    target.wait_for_log("target.max_controllers = 4", Duration::from_secs(5));
    // Controller a1 gets an I/O queue; the other three have none and send
    // nothing: after idle_timeout (2 s) they end, a1 stays.
    let mut io = NvmeTcpConn::io(addr, NO_DIGESTS, a1_id, 1, SUBNQN, &host(0));
    let t0 = Instant::now();
    let idle = [_a2, _b, _c];
    for mut c in idle {
        let t = c.wait_for_termination(Duration::from_secs(10));
        assert!(t.closed, "a KATO 0 controller without I/O queues stayed past idle_timeout: {t:?}");
    }
    let took = t0.elapsed();
    assert!(took >= Duration::from_millis(1500), "idle controllers ended after {took:?}, before idle_timeout");
    target.wait_for_log("(target.idle_timeout)", Duration::from_secs(5));
    assert_eq!(sample(&scrape(&target.metrics_addr()), "rdmablk_nvme_controllers_idle_timed_out_total", &[]), Some(3.0));
    // The one with an I/O queue is alive, and new controllers fit again.
    io.write(1, 0, &[0x42; 4096], false).unwrap();
    a1.keep_alive().unwrap();
    let (_e, r) = admin_of(&host(3));
    r.expect("room for a controller again");
    target.assert_no_panic();
}

/// `idle_timeout` of a KATO-0 controller counts from its last command on
/// any queue, or from its last I/O queue's leaving, not only from its admin
/// queue's last command: a host that set up its admin queue, then did I/O
/// for longer than idle_timeout, may close and reopen an I/O queue (a
/// reconnect, a resize) without its controller being torn down under it.
#[test]
fn a_kato_zero_controller_busy_on_its_io_queues_is_not_idle_when_one_reconnects() {
    let dir = tempfile::tempdir().unwrap();
    let img = sparse_file(dir.path(), "vol.img", VOL_SIZE);
    let config = format!(
        "{}\n{}",
        nvme_section("idle_timeout = \"2s\"\n"),
        nvme_volume("vol", &img, VOL_SIZE, false, Some(1), "")
    );
    let (target, addr, _) = start_on(dir.path(), &config);
    let hostnqn = "nqn.2014-08.org.example:busy-io";
    let (mut admin, cntlid) = NvmeTcpConn::admin(addr, NO_DIGESTS, SUBNQN, hostnqn, 0);
    admin.enable();
    // I/O for longer than idle_timeout; the admin queue stays silent.
    let mut io = NvmeTcpConn::io(addr, NO_DIGESTS, cntlid, 1, SUBNQN, hostnqn);
    let t0 = Instant::now();
    let mut block = 0u64;
    while t0.elapsed() < Duration::from_secs(3) {
        io.write(1, block % 64, &[block as u8; 4096], false).expect("I/O while the admin queue is silent");
        block += 1;
        std::thread::sleep(Duration::from_millis(50));
    }
    // The I/O queue leaves (Disconnect) and comes back at once.
    io.disconnect().expect("Disconnect of the I/O queue");
    drop(io);
    let mut again = NvmeTcpConn::connect(addr, NO_DIGESTS);
    again
        .io_connect(cntlid, 1, SUBNQN, hostnqn)
        .expect("an I/O queue reconnected at once: its controller was busy a moment ago, not idle");
    again.write(1, 0, &[0x5a; 4096], false).expect("I/O on the new queue");
    assert_eq!(again.read(1, 0, 1, 4096).unwrap(), vec![0x5a; 4096]);
    // Without its I/O queue, the controller then ends idle_timeout after
    // its last command, not sooner.
    drop(again);
    let gone = Instant::now();
    let t = admin.wait_for_termination(Duration::from_secs(10));
    assert!(t.closed, "the controller outlived idle_timeout without I/O queues: {t:?}\n{}", target.log().join("\n"));
    let after = gone.elapsed();
    assert!(
        after >= Duration::from_millis(1500),
        "the controller ended {after:?} after its last I/O queue left, before idle_timeout: {t:?}\n{}",
        target.log().join("\n")
    );
    target.assert_no_panic();
}

/// With pool chunks smaller than the largest transfer, a read's data and
/// a write's R2Ts come in pieces: 128 KiB in 32 KiB chunks, written and
/// read back, and read from a null volume, many times.
#[test]
fn transfers_larger_than_a_pool_chunk_move_in_pieces() {
    let dir = tempfile::tempdir().unwrap();
    let img = sparse_file(dir.path(), "vol.img", VOL_SIZE);
    let config = format!(
        "{}\n{}{}nsid = 2\n",
        nvme_section("chunk_size = \"32KiB\"\n"),
        nvme_volume("vol", &img, VOL_SIZE, false, Some(1), ""),
        null_volume("z", VOL_SIZE)
    );
    let (target, addr, _) = start_on(dir.path(), &config);
    let hostnqn = "nqn.2014-08.org.example:pieces";
    let (mut admin, cntlid) = NvmeTcpConn::admin(addr, NO_DIGESTS, SUBNQN, hostnqn, 0);
    admin.enable();
    let mut io = NvmeTcpConn::io(addr, NO_DIGESTS, cntlid, 1, SUBNQN, hostnqn);
    let len = 128 << 10;
    for round in 0..64u8 {
        let data: Vec<u8> = (0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(round)).collect();
        let slba = (round as u64 % 16) * 32;
        io.write(1, slba, &data, false).unwrap_or_else(|s| panic!("round {round}: write: {s}"));
        let back = io.read(1, slba, 32, 4096).unwrap_or_else(|s| panic!("round {round}: read: {s}"));
        assert!(back == data, "round {round}: the pieces read back are what was written");
        let zeroes = io.read(2, slba, 32, 4096).unwrap_or_else(|s| panic!("round {round}: null read: {s}"));
        assert!(zeroes.len() == len && zeroes.iter().all(|&b| b == 0), "round {round}: the null volume reads zeroes");
    }
    target.assert_no_panic();
}

/// A wrong data digest on a write whose data comes in several pieces
/// (pool chunks of 64 KiB, a 128 KiB write: two pieces handed out at
/// once, one asked for by R2T, the other waiting its turn) fails that
/// command with Transient Transport Error and gives every piece's chunk
/// back: when the host then deletes the queue (Disconnect), the queue
/// leaves its controller and closes, and its queue id connects again at
/// once.
#[test]
fn a_data_digest_error_on_a_write_in_pieces_lets_its_queue_close_and_its_id_connect_again() {
    let dir = tempfile::tempdir().unwrap();
    let img = sparse_file(dir.path(), "vol.img", VOL_SIZE);
    let config = format!("{}\n{}", nvme_section("chunk_size = \"64KiB\"\n"), nvme_volume("vol", &img, VOL_SIZE, false, Some(1), ""));
    let (target, addr, _) = start_on(dir.path(), &config);
    let hostnqn = "nqn.2014-08.org.example:digest-pieces";
    let (mut admin, cntlid) = NvmeTcpConn::admin(addr, NO_DIGESTS, SUBNQN, hostnqn, 0);
    admin.enable();
    let mut io = NvmeTcpConn::io(addr, BOTH_DIGESTS, cntlid, 1, SUBNQN, hostnqn);
    let len = 128 * KIB;
    let mut e = rw_entry(io_opcode::WRITE, 1, 0, (len / BS as usize) as u32, false);
    e.set_sgl(Sgl::Transport { length: len as u32 });
    let cid = io.send_command(e, &[]);
    let r = match io.recv_pdu() {
        Ok((Pdu::R2T(r), _)) => r,
        other => panic!("expected an R2T for the 128 KiB write, got {other:?}"),
    };
    assert_eq!((r.cccid, r.offset, r.length as usize), (cid, 0, 64 * KIB), "the first 64 KiB piece asked for alone");
    let d = DataPdu { cccid: cid, ttag: r.ttag, offset: 0, length: r.length, last: true, success: false };
    let mut b = io.pdu_bytes(&Pdu::H2CData(d), &vec![0xee; r.length as usize]);
    let n = b.len();
    b[n - 1] ^= 0xff;
    io.raw_send(&b);
    match io.recv_pdu() {
        Ok((Pdu::CapsuleResp(c), _)) => {
            assert_eq!((c.cid, c.status), (cid, TRANSIENT_TRANSPORT_ERROR), "the write fails, to be retried")
        }
        other => panic!("expected the write's completion, got {other:?}"),
    }
    io.disconnect().expect("Disconnect of I/O queue 1 after the digest error");
    let t = io.wait_for_termination(Duration::from_secs(5));
    assert!(t.closed, "the queue never closed after its Disconnect (its write's executor command never ended?): {}", summary(&t));
    let mut again = NvmeTcpConn::connect(addr, BOTH_DIGESTS);
    again.io_connect(cntlid, 1, SUBNQN, hostnqn).expect("I/O queue 1 again right after its queue closed");
    let data: Vec<u8> = (0..len).map(|i| (i as u8).wrapping_mul(7)).collect();
    again.write(1, 0, &data, false).expect("the 128 KiB write retried on the new queue");
    assert!(again.read(1, 0, (len / BS as usize) as u32, BS).unwrap() == data, "the retried write reads back");
    admin.keep_alive().unwrap();
    target.assert_no_panic();
}
