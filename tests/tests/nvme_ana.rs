//! Several gateways of one volume (issue 54): two real `rdmablk-target`
//! processes export the same backing file under the same subsystem NQN,
//! with disjoint controller id ranges, and the test harness's NVMe/TCP host
//! connects to both, as a Linux host with native multipath does (`nvme
//! connect` to each, one subsystem, one namespace, two paths).
//!
//! - Identify Controller on each: the same subsystem NQN and serial,
//!   several controllers and ANA reporting in CMIC, ANACAP, ANATT, the
//!   ANA change notice in OAES, MNAN within NN (a Linux host refuses ANA
//!   with MNAN 0), and controller ids in each gateway's range, distinct;
//! - Identify Namespace and the namespace identification descriptors on
//!   each: the same NGUID, UUID (and EUI-64, not reported) and size, NMIC
//!   shared, the same ANA group (the NSID) on both;
//! - the ANA log page on each: the namespace's group, optimized (a file
//!   volume has one server, its owner), with its NSID, and without it with
//!   Return Groups Only; the ANA change notice can be enabled;
//! - data written through one path reads back through the other.
//!
//!
//! And with a volume whose access moves, an RBD image of the development
//! Ceph cluster (`rdmablk_system_tests::ceph`), exported by a gateway that
//! takes its lock at start and a standby:
//!
//! - the owner reports the namespace optimized, the standby non-optimized;
//! - a write through the standby is served (it takes the image over): the
//!   standby raises an ANA change notice (notice, ANA change, log 0Ch) and
//!   its log says optimized;
//! - the old owner, fenced by Ceph, answers its next I/O ANA Inaccessible
//!   (path related, no DNR: a host retries on the other path), raises the
//!   notice, and its log says inaccessible (Identify Namespace's NUSE 0);
//!   every I/O after that is answered the same at once;
//! - what the standby wrote reads back through it.

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use rand::SeedableRng;
use rdmablk_common::nvme::ana::{AnaLog, AnaState, LSP_RGO};
use rdmablk_common::nvme::status::{sct, Status};
use rdmablk_common::nvme::tcp::Digests;
use rdmablk_system_tests::nvme_tcp::{parse_ns_descriptors, parse_ns_list, IdCtrl, IdNs, NvmeTcpConn};
use rdmablk_system_tests::ceph::cluster;
use rdmablk_system_tests::{file_bytes, file_volume, listen_host, random_bytes, sparse_file, TargetProcess};

const MIB: u64 = 1 << 20;
const VOL_SIZE: u64 = 16 * MIB;
const BS: u32 = 4096;
const SUBNQN: &str = "nqn.2026-12.io.rdmablk.test:nvme-ana";
const HOSTNQN: &str = "nqn.2014-08.org.nvmexpress:uuid:a4a4a4a4-4f89-11d3-9a0c-0305e82c3301";
const NO_DIGESTS: Digests = Digests { header: false, data: false };
const NSID: u32 = 7;
/// LID of the Asymmetric Namespace Access log.
const ANA_LOG: u8 = 0x0c;
/// Feature: Asynchronous Event Configuration.
const AEC: u8 = 0x0b;

fn seed() -> u64 {
    std::env::var("RDMABLK_TEST_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or_else(rand::random)
}

/// A gateway: a daemon named `name` with an NVMe/TCP listener, the shared
/// subsystem NQN, controller ids `cntlids`, exporting `file` as volume
/// "shared" (NSID 7 on every gateway). Without readahead: a target's
/// chunks read ahead do not see another target's writes to the file.
fn gateway(dir: &Path, name: &str, cntlids: (u16, u16), file: &Path) -> (TargetProcess, SocketAddr) {
    let host = listen_host();
    let host = if host.contains(':') { format!("[{host}]") } else { host };
    let config = format!(
        "[target]\nname = \"{name}\"\nlisten = [\"nvme+tcp://{host}:0\"]\nnqn = \"{SUBNQN}\"\nnvme_cntlid_min = {}\nnvme_cntlid_max = {}\nreadahead = 0\n{}nsid = {NSID}\n",
        cntlids.0,
        cntlids.1,
        file_volume("shared", file, VOL_SIZE, false)
    );
    let path = dir.join(format!("{name}.toml"));
    std::fs::write(&path, config).unwrap();
    let target = TargetProcess::start_with_path(&path);
    let addr = target.nvme_tcp_addr();
    (target, addr)
}

/// Two gateways of one backing file, and the host's admin queue on each
/// (with its controller id).
struct TwoGateways {
    _dir: tempfile::TempDir,
    file: std::path::PathBuf,
    _a: TargetProcess,
    _b: TargetProcess,
    addrs: [SocketAddr; 2],
    admins: [(NvmeTcpConn, u16); 2],
}

fn two_gateways() -> TwoGateways {
    let dir = tempfile::tempdir().unwrap();
    let file = sparse_file(dir.path(), "shared.img", VOL_SIZE);
    let (a, addr_a) = gateway(dir.path(), "gw-a", (1, 99), &file);
    let (b, addr_b) = gateway(dir.path(), "gw-b", (100, 199), &file);
    let admins = [addr_a, addr_b].map(|addr| {
        let (mut admin, cntlid) = NvmeTcpConn::admin(addr, NO_DIGESTS, SUBNQN, HOSTNQN, 0);
        admin.set_features(0x07, 0).expect("Set Features number of queues");
        (admin, cntlid)
    });
    TwoGateways { _dir: dir, file, _a: a, _b: b, addrs: [addr_a, addr_b], admins }
}

#[test]
fn two_gateways_are_two_controllers_of_one_subsystem_with_one_shared_namespace() {
    let mut g = two_gateways();
    let ctrls: Vec<IdCtrl> = g.admins.iter_mut().map(|(a, _)| IdCtrl::parse(&a.identify(1, 0).expect("Identify Controller"))).collect();
    for (i, (c, (_, cntlid))) in ctrls.iter().zip(&g.admins).enumerate() {
        let gw = ["gw-a", "gw-b"][i];
        assert_eq!(c.subnqn, SUBNQN, "{gw}: SUBNQN");
        assert_eq!(c.cntlid, *cntlid, "{gw}: Identify's CNTLID is the Connect's");
        assert_eq!(c.cmic & 0b1010, 0b1010, "{gw}: CMIC {:#x}: several controllers (bit 1) and ANA reporting (bit 3)", c.cmic);
        assert_eq!(c.anacap & 0b111, 0b111, "{gw}: ANACAP {:#x}: optimized, non-optimized, inaccessible", c.anacap);
        assert!(c.anatt > 0, "{gw}: ANATT");
        assert_ne!(c.oaes & 1 << 11, 0, "{gw}: OAES {:#x}: ANA change notices", c.oaes);
        assert!(c.mnan > 0 && c.mnan <= c.nn, "{gw}: MNAN {} in 1..=NN {}", c.mnan, c.nn);
        assert!(c.nanagrpid > 0 && c.nanagrpid <= c.anagrpmax, "{gw}: NANAGRPID {} ANAGRPMAX {}", c.nanagrpid, c.anagrpmax);
        // A Linux host's ANA log buffer must fit MDTS.
        let ana_log = 16 + 32 * c.nanagrpid as u64 + 4 * c.mnan as u64;
        assert!(ana_log <= 4096 << c.mdts, "{gw}: ANA log of {ana_log} bytes above MDTS {}", c.mdts);
    }
    assert!((1..=99).contains(&ctrls[0].cntlid), "gw-a's controller id {} in its range", ctrls[0].cntlid);
    assert!((100..=199).contains(&ctrls[1].cntlid), "gw-b's controller id {} in its range", ctrls[1].cntlid);
    assert_eq!(ctrls[0].serial, ctrls[1].serial, "one subsystem, one serial number");

    // One namespace: the same ids, size and ANA group through both.
    let mut nss = Vec::new();
    let mut descs = Vec::new();
    for (admin, _) in &mut g.admins {
        assert_eq!(parse_ns_list(&admin.identify(2, 0).expect("active namespaces")), [NSID]);
        nss.push(IdNs::parse(&admin.identify(0, NSID).expect("Identify Namespace")));
        descs.push(parse_ns_descriptors(&admin.identify(3, NSID).expect("namespace identification descriptors")));
    }
    assert_eq!(nss[0], nss[1], "Identify Namespace differs between the gateways");
    assert_eq!(descs[0], descs[1], "the namespace identification descriptors differ between the gateways");
    let ns = &nss[0];
    assert_eq!(ns.nsze, VOL_SIZE / BS as u64);
    assert_eq!(ns.nuse, ns.nsze, "NUSE while optimized");
    assert_eq!(ns.nmic & 1, 1, "NMIC: shared");
    assert_eq!(ns.anagrpid, NSID, "ANAGRPID: the NSID, on every gateway");
    assert_ne!(ns.nguid, [0; 16], "an NGUID");
    assert_eq!(ns.eui64, [0; 8], "no EUI-64 (no IEEE OUI to make one of)");
    let kinds: Vec<(u8, usize)> = descs[0].iter().map(|(t, id)| (*t, id.len())).collect();
    assert_eq!(&kinds[..2], &[(2, 16), (3, 16)], "NGUID and UUID descriptors");
    assert_eq!(descs[0][0].1, ns.nguid, "the NGUID descriptor is Identify Namespace's");
}

#[test]
fn each_gateway_reports_the_namespace_optimized_in_its_ana_log_and_data_crosses_between_paths() {
    let mut g = two_gateways();
    for (i, (admin, _)) in g.admins.iter_mut().enumerate() {
        let gw = ["gw-a", "gw-b"][i];
        let c = IdCtrl::parse(&admin.identify(1, 0).unwrap());
        // The length a Linux host reads: header, NANAGRPID descriptors, MNAN NSIDs.
        let len = 16 + 32 * c.nanagrpid as usize + 4 * c.mnan as usize;
        let page = admin.get_log_page(ANA_LOG, u32::MAX, len).unwrap_or_else(|s| panic!("{gw}: ANA log: {s}"));
        assert_eq!(page.len(), len);
        let log = AnaLog::decode(&page).unwrap_or_else(|e| panic!("{gw}: ANA log: {e}"));
        assert_eq!(log.groups.len(), 1, "{gw}: {log:?}");
        let group = &log.groups[0];
        assert_eq!((group.group, group.state, &group.nsids[..]), (NSID, AnaState::Optimized, &[NSID][..]), "{gw}: {log:?}");
        assert_eq!(log.group_of(NSID).map(|g| g.group), Some(IdNs::parse(&admin.identify(0, NSID).unwrap()).anagrpid));
        // Return Groups Only: the descriptor, no NSIDs; RAE and NSID 0 are accepted too.
        let rgo = AnaLog::decode(&admin.get_log_page_with(ANA_LOG, 0, 4096, LSP_RGO, true).unwrap()).unwrap();
        assert_eq!(rgo.groups.iter().map(|g| (g.group, g.state, g.nsids.len())).collect::<Vec<_>>(), [(NSID, AnaState::Optimized, 0)]);
        assert_eq!(rgo.change_count, log.change_count, "{gw}: nothing changed between the two reads");
        // The host enables namespace attribute and ANA change notices (as
        // Linux does, with what OAES offers) and posts a request.
        admin.set_features(AEC, c.oaes).unwrap_or_else(|s| panic!("{gw}: Set Features AEC: {s}"));
        assert_eq!(admin.get_features(AEC).unwrap() as u32 & (1 << 8 | 1 << 11), 1 << 8 | 1 << 11, "{gw}: AEC");
        let aer = admin.submit_aer();
        // Nothing changes: no notice, and the admin queue goes on answering.
        for _ in 0..2 {
            admin.keep_alive().unwrap_or_else(|s| panic!("{gw}: Keep Alive with an AER outstanding: {s}"));
        }
        assert!(admin.stray.iter().all(|c| c.cid != aer), "{gw}: the AER completed without a change: {:?}", admin.stray);
    }
    // One I/O queue on each path; a write through one reads back through the other.
    let mut qs: Vec<NvmeTcpConn> =
        g.admins.iter().zip(g.addrs).map(|((_, cntlid), addr)| NvmeTcpConn::io(addr, NO_DIGESTS, *cntlid, 1, SUBNQN, HOSTNQN)).collect();
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed());
    // A sequential stream through gateway A first, as a file system's reads
    // are: with readahead on, A would hold chunks beyond it that B's write
    // below does not invalidate (the gateways run without it).
    for slba in (0..1024u64).step_by(32) {
        qs[0].read(NSID, slba, 32, BS).unwrap_or_else(|s| panic!("sequential read at {slba} through gateway 0: {s}"));
    }
    for (from, to, slba) in [(0, 1, 16u64), (1, 0, 1536)] {
        let data = random_bytes(&mut rng, 256 << 10);
        qs[from].write(NSID, slba, &data, true).unwrap_or_else(|s| panic!("write through gateway {from}: {s}"));
        let back = qs[to].read(NSID, slba, (data.len() / BS as usize) as u32, BS).unwrap_or_else(|s| panic!("read through gateway {to}: {s}"));
        assert!(back == data, "what gateway {from} wrote does not read back through gateway {to}");
        assert!(file_bytes(&g.file, slba * BS as u64, data.len()) == data, "the backing file");
    }
    // An NSID the gateways do not export is no namespace of theirs.
    assert_eq!(qs[0].read(NSID + 1, 0, 1, BS).unwrap_err(), Status::INVALID_NAMESPACE);
}

/// An RBD gateway: `name`, controller ids `cntlids`, image `image` of the
/// development cluster as volume "shared" (NSID 7), its lock taken at start
/// or not (a standby).
fn rbd_gateway(dir: &Path, name: &str, cntlids: (u16, u16), image: &str, lock_at_start: bool) -> (TargetProcess, SocketAddr) {
    rbd_gateway_nsid(dir, name, cntlids, image, lock_at_start, Some(NSID))
}

/// [`rbd_gateway`] with `nsid = ` set or left to its default (the volume id).
fn rbd_gateway_nsid(
    dir: &Path,
    name: &str,
    cntlids: (u16, u16),
    image: &str,
    lock_at_start: bool,
    nsid: Option<u32>,
) -> (TargetProcess, SocketAddr) {
    let c = cluster();
    let host = listen_host();
    let host = if host.contains(':') { format!("[{host}]") } else { host };
    let config = format!(
        "[target]\nname = \"{name}\"\nlisten = [\"nvme+tcp://{host}:0\"]\nnqn = \"{SUBNQN}\"\nnvme_cntlid_min = {}\nnvme_cntlid_max = {}\n\
         {}{}allow_any_host = true\n",
        cntlids.0,
        cntlids.1,
        c.volume_block("shared", image, lock_at_start),
        nsid.map(|n| format!("nsid = {n}\n")).unwrap_or_default()
    );
    let path = dir.join(format!("{name}.toml"));
    std::fs::write(&path, config).unwrap();
    let target = TargetProcess::start_with_path(&path);
    let addr = target.nvme_tcp_addr();
    (target, addr)
}

/// The state of the namespace in `admin`'s ANA log, and the log's change count.
fn ana_state(admin: &mut NvmeTcpConn, gw: &str) -> (AnaState, u64) {
    let page = admin.get_log_page(ANA_LOG, u32::MAX, 4096).unwrap_or_else(|s| panic!("{gw}: ANA log: {s}"));
    let log = AnaLog::decode(&page).unwrap_or_else(|e| panic!("{gw}: ANA log: {e}"));
    let g = log.group_of(NSID).unwrap_or_else(|| panic!("{gw}: no group lists namespace {NSID}: {log:?}"));
    assert_eq!(g.group, NSID, "{gw}: {log:?}");
    (g.state, log.change_count)
}

/// Waits for the ANA change notice on `aer` (an AER of `admin`).
fn ana_notice(admin: &mut NvmeTcpConn, aer: u16, gw: &str) {
    let c = admin.wait_completion(aer, Duration::from_secs(10)).unwrap_or_else(|e| panic!("{gw}: no ANA change notice in 10 s: {e}"));
    assert_eq!(c.status, Status::SUCCESS, "{gw}: the AER");
    assert_eq!(c.result, 0x000c_0302, "{gw}: AER result {:#x}: notice (2), ANA change (03h), log page 0Ch", c.result);
}

#[test]
fn an_rbd_volume_taken_over_by_the_standby_is_optimized_there_and_inaccessible_on_the_fenced_owner() {
    let c = cluster();
    let image = c.unique_name("nvme-ana");
    c.create_image(&image, VOL_SIZE);
    let dir = tempfile::tempdir().unwrap();
    let (mut a, addr_a) = rbd_gateway(dir.path(), "gw-a", (1, 99), &image, true);
    let (mut b, addr_b) = rbd_gateway(dir.path(), "gw-b", (100, 199), &image, false);
    let mut gws: Vec<(NvmeTcpConn, u16)> = [addr_a, addr_b].map(|addr| NvmeTcpConn::admin(addr, NO_DIGESTS, SUBNQN, HOSTNQN, 0)).into();
    let mut aers = Vec::new();
    for (i, (admin, _)) in gws.iter_mut().enumerate() {
        let gw = ["gw-a", "gw-b"][i];
        admin.set_features(0x07, 0).unwrap_or_else(|s| panic!("{gw}: Set Features number of queues: {s}"));
        admin.set_features(AEC, 1 << 8 | 1 << 11).unwrap_or_else(|s| panic!("{gw}: Set Features AEC: {s}"));
        aers.push(admin.submit_aer());
    }
    let (state_a, _) = ana_state(&mut gws[0].0, "gw-a");
    let (state_b, count_b) = ana_state(&mut gws[1].0, "gw-b");
    assert_eq!((state_a, state_b), (AnaState::Optimized, AnaState::NonOptimized), "the owner and the standby");
    let ids: Vec<IdNs> = gws.iter_mut().map(|(a, _)| IdNs::parse(&a.identify(0, NSID).unwrap())).collect();
    assert_eq!(ids[0], ids[1], "one namespace through both gateways");

    // A write through the standby: served, and the standby is the owner.
    let mut q_a = NvmeTcpConn::io(addr_a, NO_DIGESTS, gws[0].1, 1, SUBNQN, HOSTNQN);
    let mut q_b = NvmeTcpConn::io(addr_b, NO_DIGESTS, gws[1].1, 1, SUBNQN, HOSTNQN);
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed());
    let data = random_bytes(&mut rng, 64 << 10);
    q_b.write(NSID, 32, &data, true).unwrap_or_else(|s| panic!("a write through the standby: {s}"));
    ana_notice(&mut gws[1].0, aers[1], "gw-b");
    let (state_b, after_b) = ana_state(&mut gws[1].0, "gw-b");
    assert_eq!(state_b, AnaState::Optimized, "gw-b after taking the image over");
    assert!(after_b > count_b, "gw-b's ANA log change count moved ({count_b} to {after_b})");

    // The old owner was fenced by Ceph: its next I/O tells it, and it answers
    // ANA Inaccessible, which a multipath host retries on the other path.
    let st = q_a.read(NSID, 32, 16, BS).expect_err("a read through the fenced gateway");
    assert_eq!(st, Status::ANA_INACCESSIBLE, "gw-a's read after the takeover");
    assert_eq!((st.sct, st.sc, st.dnr), (sct::PATH, 0x02, false));
    ana_notice(&mut gws[0].0, aers[0], "gw-a");
    assert_eq!(ana_state(&mut gws[0].0, "gw-a").0, AnaState::Inaccessible, "gw-a fenced");
    let ns_a = IdNs::parse(&gws[0].0.identify(0, NSID).unwrap());
    assert_eq!((ns_a.nsze, ns_a.nuse), (ids[0].nsze, 0), "gw-a: NSZE stays, NUSE 0 while inaccessible");
    for (what, st) in [
        ("write", q_a.write(NSID, 0, &data[..4096], false).unwrap_err()),
        ("flush", q_a.flush(NSID).unwrap_err()),
        ("read", q_a.read(NSID, 0, 1, BS).unwrap_err()),
    ] {
        assert_eq!(st, Status::ANA_INACCESSIBLE, "gw-a's {what} once fenced");
    }
    // The standby (now owner) serves what it wrote.
    let back = q_b.read(NSID, 32, (data.len() / BS as usize) as u32, BS).unwrap_or_else(|s| panic!("a read through gw-b: {s}"));
    assert!(back == data, "what gw-b wrote does not read back through it");
    // No further notice on gw-b: the host read its log.
    let aer = gws[1].0.submit_aer();
    gws[1].0.keep_alive().unwrap();
    std::thread::sleep(Duration::from_millis(1200));
    gws[1].0.keep_alive().unwrap();
    assert!(gws[1].0.stray.iter().all(|c| c.cid != aer), "gw-b sent another notice without a change: {:?}", gws[1].0.stray);
    drop((q_a, q_b, gws));
    // The gateways close the image; a fenced one's watch may outlive it for
    // a while (Ceph's watch timeout): then the image stays, a few KiB of the
    // development cluster's memory.
    for t in [&mut a, &mut b] {
        t.signal(libc::SIGTERM);
        t.wait_exit(Duration::from_secs(30));
    }
    let rm = c.rbd(&["rm", "--no-progress", &c.spec(&image)]);
    if !rm.status.success() {
        eprintln!("{image} left in the development cluster: {}", String::from_utf8_lossy(&rm.stderr).trim());
    }
}

/// A fenced gateway reopened by a reload keeps the namespace's id when the
/// config leaves `nsid` to its default (the volume id, which the reopened
/// volume does not keep): a host's path must not see its namespace vanish
/// and another appear.
#[test]
fn a_fenced_rbd_gateway_reopened_by_a_reload_keeps_its_default_namespace_id() {
    let c = cluster();
    let image = c.unique_name("nvme-nsid");
    c.create_image(&image, VOL_SIZE);
    let dir = tempfile::tempdir().unwrap();
    let (mut a, addr_a) = rbd_gateway_nsid(dir.path(), "gw-a", (1, 99), &image, true, None);
    let (mut b, addr_b) = rbd_gateway_nsid(dir.path(), "gw-b", (100, 199), &image, false, None);
    let active = |addr: SocketAddr, gw: &str| {
        let (mut admin, _) = NvmeTcpConn::admin(addr, NO_DIGESTS, SUBNQN, HOSTNQN, 0);
        parse_ns_list(&admin.identify(2, 0).unwrap_or_else(|s| panic!("{gw}: active namespace list: {s}")))
    };
    let before = active(addr_a, "gw-a");
    assert_eq!(before, active(addr_b, "gw-b"), "the gateways' namespace ids");
    // b takes the image over; a, idle, learns it at its reload.
    let (admin_b, cntlid_b) = NvmeTcpConn::admin(addr_b, NO_DIGESTS, SUBNQN, HOSTNQN, 0);
    let mut q_b = NvmeTcpConn::io(addr_b, NO_DIGESTS, cntlid_b, 1, SUBNQN, HOSTNQN);
    q_b.write(before[0], 0, &[7u8; 4096], true).unwrap_or_else(|s| panic!("a write through gw-b: {s}"));
    a.signal(libc::SIGHUP);
    a.wait_for_log("reopened as a standby", Duration::from_secs(20));
    assert_eq!(active(addr_a, "gw-a after its reload"), before, "the reopened gateway's namespace ids");
    drop((q_b, admin_b));
    for t in [&mut a, &mut b] {
        t.signal(libc::SIGTERM);
        assert_eq!(t.wait_exit(Duration::from_secs(30)), Some(0), "a gateway's exit");
    }
    c.remove_image(&image);
}
