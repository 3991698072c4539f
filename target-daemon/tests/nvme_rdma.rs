//! NVMe/RDMA in process: a target whose `nvme+rdma://` listener runs on the
//! tcp fabric provider (the same verbs semantics: keys, bounds, one-sided
//! RDMA READ and WRITE, SEND with Invalidate), and a host written directly
//! against the fabric API as the Linux host drives a queue: the rdma_cm
//! private data, 64-byte command capsules in SENDs, keyed SGLs into its
//! registered memory, 16-byte completions. With `RDMABLK_NVME_RDMA_HOST=IP`
//! the listener is real verbs on that address instead (the VM stage runs
//! this file so on Soft-RoCE: `nvme-rdma-hostile`); the kernel host over
//! verbs is the VM stage's other NVMe/RDMA steps.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use rdmablk_common::fabric::{
    Access, AlignedBuf, Completion, CompletionQueue, Fabric, FabricUrl, MemoryRegion, Payload, ProtectionDomain,
    ProviderKind, QpCaps, QueuePair, RecvWr, Rkey, SendOp, SendWr, WcOpcode, WcStatus, WrId,
};
use rdmablk_common::nvme::cqe::{CompletionEntry, CQE_SIZE};
use rdmablk_common::nvme::fabrics::{Connect, ConnectData, Property, CONNECT_DATA_SIZE, DISCOVERY_NQN};
use rdmablk_common::nvme::rdma::{reject, CmAccept, CmRequest, RECFMT_1_0};
use rdmablk_common::nvme::sqe::{admin_opcode, io_opcode, Sgl, SubmissionEntry, SQE_SIZE};
use rdmablk_common::nvme::status::Status;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use rdmablk_system_tests::{file_volume, sparse_file, BusyCpus};
use rdmablk_system_tests::read_gate::{tmpfs_dir, ReadGate};
use rdmablk_system_tests::stamp::{describe, stamp};
use rdmablk_target::{Config, RunningTarget, Target};

const HOST_NQN: &str = "nqn.2014-08.org.example:rdma-host";
const RECVS: usize = 32;
/// Capsule slots: a slot is taken again only once its SEND completed (a
/// NIC reads the bytes when it transmits them, not when the SEND is posted).
const SEND_SLOTS: usize = 32;
const SEND_SLOT: usize = SQE_SIZE + 16384;
/// The `wr_id` of the SEND from capsule slot `i` is `SEND_WR + i`.
const SEND_WR: u64 = 1000;
const DATA: usize = 2 << 20;
const NULL_SGL: Sgl = Sgl::Keyed { addr: 0, length: 0, key: 0, invalidate: false };

/// The address the host connects to: `RDMABLK_NVME_RDMA_HOST` (verbs) or
/// 127.0.0.1 (the tcp provider).
fn host_address() -> String {
    std::env::var("RDMABLK_NVME_RDMA_HOST").unwrap_or_else(|_| "127.0.0.1".to_owned())
}

/// A target with a 4 MiB memory volume and an NVMe/RDMA listener on the
/// tcp provider (port 0), and that listener's URL.
fn target() -> (RunningTarget, FabricUrl, String) {
    target_listening_on(&host_address())
}

/// [`target`], its listener bound to `host` (`0.0.0.0`: every address).
fn target_listening_on(host: &str) -> (RunningTarget, FabricUrl, String) {
    let config = config_listening_on(host);
    let nqn = config.target.nqn.clone();
    let t = Target::start(config).unwrap();
    let url = t.nvme_listeners()[0].url.clone();
    (t, url, nqn)
}

/// The configuration of [`target_listening_on`].
fn config_listening_on(host: &str) -> Config {
    let volume = "[[volume]]\nname = \"v\"\nbackend = \"memory\"\nsize = \"4MiB\"\nblock_size = 512\nallow_any_host = true\n";
    config_with_volume(host, volume)
}

/// A target configuration with an NVMe/RDMA listener on `host` (port 0;
/// the tcp provider unless `RDMABLK_NVME_RDMA_HOST` is set) and `volume`
/// (a `[[volume]]` table) as namespace 1.
fn config_with_volume(host: &str, volume: &str) -> Config {
    let verbs_host = std::env::var("RDMABLK_NVME_RDMA_HOST").ok();
    let text = format!("[target]\nname = \"rdma\"\nlisten = [\"nvme+rdma://{host}:0\"]\nshutdown_timeout = \"5s\"\n{volume}");
    let mut config = Config::parse(&text, "rdma.toml").unwrap();
    if verbs_host.is_none() {
        // The same transport on the software provider: what runs here is
        // what runs on a NIC, minus the NIC.
        config.target.nvme_listen[0].url.provider = ProviderKind::Tcp;
    }
    config
}

/// A host queue: one queue pair with registered receive, send and data areas.
struct Host {
    // Field order is drop order: queue pair, regions, buffers, CQ, PD.
    qp: QueuePair,
    recv_mr: MemoryRegion,
    send_mr: MemoryRegion,
    data_mr: MemoryRegion,
    recv_buf: AlignedBuf,
    send_buf: AlignedBuf,
    data: AlignedBuf,
    cq: CompletionQueue,
    pd: ProtectionDomain,
    _fabric: Fabric,
    next_cid: u16,
    next_slot: usize,
    /// Capsule slots whose SEND has not completed yet.
    sending: [bool; SEND_SLOTS],
    done: VecDeque<(CompletionEntry, Option<Rkey>)>,
}

impl Host {
    /// Connects a queue with `request` as the rdma_cm private data; the
    /// accept's private data, or the error.
    fn connect_raw(url: &FabricUrl, request: &[u8]) -> Result<(Host, Vec<u8>), String> {
        let h = Host::prepare(url);
        let reply = h.cm_connect(request)?;
        Ok((h, reply))
    }

    /// A queue pair with its memory registered and its receives posted,
    /// not connected yet.
    fn prepare(url: &FabricUrl) -> Host {
        let fabric = Fabric::open(url).unwrap();
        let pd = fabric.alloc_pd().unwrap();
        let cq = fabric.create_cq(256).unwrap();
        let caps = QpCaps { max_send_wr: 64, max_recv_wr: RECVS as u32, max_send_sge: 1, max_recv_sge: 1, max_inline_data: 0 };
        let qp = fabric.create_qp(&pd, &cq, caps).unwrap();
        let recv_buf = AlignedBuf::new(RECVS * CQE_SIZE, 4096);
        let send_buf = AlignedBuf::new(SEND_SLOTS * SEND_SLOT, 4096);
        let data = AlignedBuf::new(DATA, 4096);
        // SAFETY: the buffers outlive their regions (field order) and the
        // test touches them only while no work request uses them.
        let (recv_mr, send_mr, data_mr) = unsafe {
            (
                pd.register(recv_buf.as_ptr(), recv_buf.len(), Access::LOCAL_WRITE).unwrap(),
                pd.register(send_buf.as_ptr(), send_buf.len(), Access::NONE).unwrap(),
                pd.register(
                    data.as_ptr(),
                    data.len(),
                    Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ | Access::MW_BIND,
                )
                .unwrap(),
            )
        };
        let h = Host {
            qp,
            recv_mr,
            send_mr,
            data_mr,
            recv_buf,
            send_buf,
            data,
            cq,
            pd,
            _fabric: fabric,
            next_cid: 0,
            next_slot: 0,
            sending: [false; SEND_SLOTS],
            done: VecDeque::new(),
        };
        for i in 0..RECVS {
            h.post_recv(i);
        }
        h
    }

    /// Connects a [`Host::prepare`]d queue pair with `request` as the
    /// rdma_cm private data: the accept's private data, or the error.
    fn cm_connect(&self, request: &[u8]) -> Result<Vec<u8>, String> {
        self.qp.connect_raw(request, Duration::from_secs(5)).map_err(|e| e.to_string())
    }

    /// Connects queue `qid` with `entries` entries, checks the accept.
    fn connect(url: &FabricUrl, qid: u16, entries: u16) -> Host {
        let req = CmRequest { recfmt: RECFMT_1_0, qid, hrqsize: entries, hsqsize: entries - 1, cntlid: 0xffff };
        let (h, reply) = Host::connect_raw(url, &req.encode()).unwrap();
        let accept = CmAccept::decode(&reply).unwrap();
        assert_eq!(accept, CmAccept { recfmt: RECFMT_1_0, crqsize: entries }, "the accept's private data");
        h
    }

    fn post_recv(&self, i: usize) {
        let sge = self.recv_mr.sge(i * CQE_SIZE, CQE_SIZE as u32);
        self.qp.post_recv(&[RecvWr { wr_id: WrId(i as u64), sges: &[sge] }]).unwrap();
    }

    #[allow(clippy::mut_from_ref)]
    fn data(&self) -> &mut [u8] {
        // SAFETY: only called while no command using the data area is in flight.
        unsafe { self.data.as_mut_slice() }
    }

    /// A keyed SGL for `len` bytes of the data area at `off`.
    fn keyed(&self, off: usize, len: usize) -> Sgl {
        Sgl::Keyed { addr: self.data_mr.addr() + off as u64, length: len as u32, key: self.data_mr.rkey().0, invalidate: false }
    }

    fn cid(&mut self) -> u16 {
        self.next_cid = self.next_cid.wrapping_add(1);
        self.next_cid
    }

    /// Sends raw capsule bytes (from the next capsule slot whose SEND
    /// completed, waiting for one if need be).
    fn send_bytes(&mut self, bytes: &[u8]) {
        assert!(bytes.len() <= SEND_SLOT);
        let deadline = Instant::now() + Duration::from_secs(20);
        let slot = loop {
            if let Some(s) = (0..SEND_SLOTS).map(|k| (self.next_slot + k) % SEND_SLOTS).find(|&s| !self.sending[s]) {
                break s;
            }
            let (n, failed) = self.progress();
            assert!(failed.is_none(), "the queue pair failed ({failed:?}) while every capsule slot was in use");
            if n == 0 {
                assert!(Instant::now() < deadline, "no capsule slot came free within 20 s");
                self.cq.wait(Some(Duration::from_millis(50))).unwrap();
            }
        };
        self.next_slot = (slot + 1) % SEND_SLOTS;
        // SAFETY: the slot's previous SEND completed; the slot is not in use.
        let buf = unsafe { &mut self.send_buf.as_mut_slice()[slot * SEND_SLOT..slot * SEND_SLOT + bytes.len()] };
        buf.copy_from_slice(bytes);
        let sge = self.send_mr.sge(slot * SEND_SLOT, bytes.len() as u32);
        let wr = SendWr { wr_id: WrId(SEND_WR + slot as u64), op: SendOp::Send, payload: Payload::Sges(&[sge]), signaled: true };
        self.qp.post_send(&[wr]).unwrap();
        self.sending[slot] = true;
    }

    /// Sends a command with its in-capsule data.
    fn send(&mut self, sqe: &SubmissionEntry, in_capsule: &[u8]) {
        let mut bytes = sqe.to_bytes().to_vec();
        bytes.extend_from_slice(in_capsule);
        self.send_bytes(&bytes);
    }

    /// Takes what the completion queue holds (one poll): NVMe completions
    /// go to `done`, capsule slots whose SEND completed come free. Returns
    /// how many work completions there were, and the status of the first
    /// that failed (the queue pair is then in error).
    fn progress(&mut self) -> (usize, Option<WcStatus>) {
        let mut wcs = [Completion::EMPTY; 16];
        let n = self.cq.poll(&mut wcs).unwrap();
        let mut failed = None;
        for wc in &wcs[..n] {
            if let Some(s) = wc.wr_id.0.checked_sub(SEND_WR).filter(|&s| s < SEND_SLOTS as u64) {
                self.sending[s as usize] = false;
            }
            match wc.opcode {
                _ if wc.status != WcStatus::Success => failed = failed.or(Some(wc.status)),
                WcOpcode::Recv => {
                    let i = wc.wr_id.0 as usize;
                    assert_eq!(wc.byte_len as usize, CQE_SIZE, "a completion capsule is 16 bytes");
                    // SAFETY: the receive completed; the slot is ours until re-posted.
                    let slot = unsafe { &self.recv_buf.as_slice()[i * CQE_SIZE..(i + 1) * CQE_SIZE] };
                    self.done.push_back((CompletionEntry::decode(slot).unwrap(), wc.invalidated_rkey));
                    self.post_recv(i);
                }
                _ => {}
            }
        }
        (n, failed)
    }

    /// The next completion and the key its SEND invalidated, or the status
    /// of the failure that ended the queue pair instead.
    fn completion(&mut self) -> Result<(CompletionEntry, Option<Rkey>), WcStatus> {
        let c = self.completion_within(Duration::from_secs(20))?;
        Ok(c.expect("no completion within 20 s"))
    }

    /// As [`Host::completion`], `None` when none came within `limit`.
    fn completion_within(&mut self, limit: Duration) -> Result<Option<(CompletionEntry, Option<Rkey>)>, WcStatus> {
        let deadline = Instant::now() + limit;
        loop {
            if let Some(c) = self.done.pop_front() {
                return Ok(Some(c));
            }
            let (n, failed) = self.progress();
            if let Some(status) = failed {
                return self.done.pop_front().map(Some).ok_or(status);
            }
            if n > 0 {
                continue;
            }
            let now = Instant::now();
            if now >= deadline {
                return Ok(None);
            }
            self.cq.wait(Some((deadline - now).min(Duration::from_millis(50)))).unwrap();
        }
    }

    fn exec(&mut self, mut sqe: SubmissionEntry, in_capsule: &[u8]) -> CompletionEntry {
        // A command without data carries a null keyed SGL, as the Linux
        // host sends it (NVMe/TCP's transport SGL is refused on RDMA).
        if sqe.sgl() == Ok(Sgl::NONE) {
            sqe.set_sgl(NULL_SGL);
        }
        self.send(&sqe, in_capsule);
        let (c, _) = self.completion().expect("a completion");
        assert_eq!(c.cid, sqe.cid);
        c
    }

    /// Connect (admin: controller 0xffff, data under a keyed SGL as the
    /// Linux host sends it; I/O: in-capsule). Returns the controller id.
    fn nvme_connect(&mut self, subnqn: &str, qid: u16, cntlid: u16) -> Result<u16, Status> {
        self.nvme_connect_as(HOST_NQN, subnqn, qid, cntlid)
    }

    fn nvme_connect_as(&mut self, hostnqn: &str, subnqn: &str, qid: u16, cntlid: u16) -> Result<u16, Status> {
        let mut d = [0u8; CONNECT_DATA_SIZE];
        let host_id = [0x5a; 16];
        ConnectData { host_id, controller_id: cntlid, subsystem_nqn: subnqn.into(), host_nqn: hostnqn.into() }.encode(&mut d).unwrap();
        let cid = self.cid();
        let mut e = Connect { recfmt: 0, qid, sqsize: 31, cattr: 0, kato_ms: 0 }.to_entry(cid);
        let c = if qid == 0 {
            self.data()[..CONNECT_DATA_SIZE].copy_from_slice(&d);
            e.set_sgl(self.keyed(0, CONNECT_DATA_SIZE));
            self.exec(e, &[])
        } else {
            e.set_sgl(Sgl::InCapsule { offset: 0, length: CONNECT_DATA_SIZE as u32 });
            self.exec(e, &d)
        };
        if c.status.is_success() {
            Ok(c.result as u16)
        } else {
            Err(c.status)
        }
    }

    fn enable(&mut self) {
        let cid = self.cid();
        let cc = Property { offset: 0x14, wide: false, value: 0x0046_0001 };
        assert_eq!(self.exec(cc.to_entry(cid, true), &[]).status, Status::SUCCESS);
    }

    /// An admin command whose data (`len` bytes) comes back through the data area.
    fn admin_data(&mut self, mut sqe: SubmissionEntry, len: usize) -> Vec<u8> {
        self.data()[..len].fill(0xee);
        sqe.set_sgl(self.keyed(0, len));
        let c = self.exec(sqe, &[]);
        assert_eq!(c.status, Status::SUCCESS, "{sqe:?}");
        self.data()[..len].to_vec()
    }

    fn rw(&mut self, opcode: u8, slba: u64, blocks: u32, sgl: Sgl, in_capsule: &[u8]) -> CompletionEntry {
        let cid = self.cid();
        let mut e = SubmissionEntry::new(opcode, cid);
        e.nsid = 1;
        e.set_rw(slba, blocks, false);
        e.set_sgl(sgl);
        self.exec(e, in_capsule)
    }
}

/// An admin queue of an enabled controller and I/O queue 1 of it.
fn admin_and_io(url: &FabricUrl, nqn: &str) -> (Host, Host) {
    let mut admin = Host::connect(url, 0, 32);
    let cntlid = admin.nvme_connect(nqn, 0, 0xffff).unwrap();
    admin.enable();
    let mut io = Host::connect(url, 1, 32);
    assert_eq!(io.nvme_connect(nqn, 1, cntlid), Ok(cntlid));
    (admin, io)
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect()
}

#[test]
fn connect_requests_with_bad_private_data_are_rejected_with_their_status() {
    let (t, url, _) = target();
    let good = CmRequest { recfmt: RECFMT_1_0, qid: 1, hrqsize: 32, hsqsize: 31, cntlid: 0xffff };
    for (what, req, status) in [
        ("record format", CmRequest { recfmt: 1, ..good }.encode().to_vec(), reject::INVALID_RECFMT),
        ("queue id", CmRequest { qid: 1000, ..good }.encode().to_vec(), reject::INVALID_QID),
        ("submission queue size", CmRequest { hsqsize: 4000, hrqsize: 4001, ..good }.encode().to_vec(), reject::INVALID_HSQSIZE),
        ("receive queue size", CmRequest { hrqsize: 8, ..good }.encode().to_vec(), reject::INVALID_HRQSIZE),
        ("length", good.encode()[..20].to_vec(), reject::INVALID_LENGTH),
    ] {
        if what == "length" && std::env::var_os("RDMABLK_NVME_RDMA_HOST").is_some() {
            // rdma_cm pads a request's private data to the CM message's
            // size with zeroes: on verbs a short request arrives as a whole
            // one (zero fields past the end), which is valid.
            continue;
        }
        let err = Host::connect_raw(&url, &req).err().unwrap_or_else(|| panic!("{what}: accepted"));
        let want = format!("{:02x} {:02x} {:02x} {:02x}", RECFMT_1_0 as u8, 0, status as u8, 0);
        assert!(err.contains(&want), "{what}: the reject carries status {status} ({want}): {err}");
    }
    // The target still takes good requests.
    let _ = Host::connect(&url, 1, 32);
    t.shutdown().unwrap();
}

#[test]
fn a_host_writes_and_reads_through_keyed_sgls_and_in_capsule_data() {
    let (t, url, nqn) = target();
    let (mut admin, mut io) = admin_and_io(&url, &nqn);
    let mut id = SubmissionEntry::new(admin_opcode::IDENTIFY, admin.cid());
    id.cdw[0] = 1;
    let ctrl = admin.admin_data(id, 4096);
    let sgls = u32::from_le_bytes(ctrl[536..540].try_into().unwrap());
    assert_ne!(sgls & 1 << 2, 0, "keyed SGL data blocks are advertised (the Linux host requires them)");
    let ioccsz = u32::from_le_bytes(ctrl[1792..1796].try_into().unwrap());
    assert!(ioccsz * 16 >= 64 + 4096, "IOCCSZ {ioccsz}");

    // 128 KiB written by RDMA READ from the host, read back by RDMA WRITE.
    let big = pattern(128 << 10, 3);
    io.data()[..big.len()].copy_from_slice(&big);
    let sgl = io.keyed(0, big.len());
    assert_eq!(io.rw(io_opcode::WRITE, 8, 256, sgl, &[]).status, Status::SUCCESS);
    io.data()[..big.len()].fill(0);
    let sgl = io.keyed(0, big.len());
    assert_eq!(io.rw(io_opcode::READ, 8, 256, sgl, &[]).status, Status::SUCCESS);
    assert!(io.data()[..big.len()] == big[..], "the data read back is what was written");

    // 4 KiB in the capsule, read back at an offset of the host's buffer.
    let small = pattern(4096, 77);
    let sgl = Sgl::InCapsule { offset: 0, length: 4096 };
    assert_eq!(io.rw(io_opcode::WRITE, 1000, 8, sgl, &small).status, Status::SUCCESS);
    let sgl = io.keyed(8192, 4096);
    assert_eq!(io.rw(io_opcode::READ, 1000, 8, sgl, &[]).status, Status::SUCCESS);
    assert!(io.data()[8192..8192 + 4096] == small[..]);

    // As the Linux host sends it after a keyed command on the same request:
    // the descriptor's reserved bytes still hold the old key.
    let again = pattern(4096, 78);
    let cid = io.cid();
    let mut w = SubmissionEntry::new(io_opcode::WRITE, cid);
    w.nsid = 1;
    w.set_rw(1008, 8, false);
    w.set_sgl(Sgl::InCapsule { offset: 0, length: 4096 });
    w.dptr[12..15].copy_from_slice(&[0xd4, 0xc3, 0xb2]);
    assert_eq!(io.exec(w, &again).status, Status::SUCCESS, "stale reserved bytes in an in-capsule descriptor");
    let sgl = io.keyed(0, 4096);
    assert_eq!(io.rw(io_opcode::READ, 1008, 8, sgl, &[]).status, Status::SUCCESS);
    assert!(io.data()[..4096] == again[..]);

    let cid = io.cid();
    let mut flush = SubmissionEntry::new(io_opcode::FLUSH, cid);
    flush.nsid = 1;
    assert_eq!(io.exec(flush, &[]).status, Status::SUCCESS);
    drop((admin, io));
    t.shutdown().unwrap();
}

/// The discovery log page (header and one entry) as a host reads it
/// through the discovery controller at `url`.
fn discovery_log(url: &FabricUrl) -> Vec<u8> {
    let mut d = Host::connect(url, 0, 32);
    d.nvme_connect(DISCOVERY_NQN, 0, 0xffff).unwrap();
    d.enable();
    let mut log = SubmissionEntry::new(admin_opcode::GET_LOG_PAGE, d.cid());
    log.cdw[0] = 0x70 | ((2048 / 4 - 1) << 16);
    d.admin_data(log, 2048)
}

#[test]
fn the_discovery_log_lists_the_rdma_listener_as_rdma() {
    let (t, url, nqn) = target();
    let page = discovery_log(&url);
    assert_eq!(u64::from_le_bytes(page[8..16].try_into().unwrap()), 1, "one record");
    let e = &page[1024..2048];
    assert_eq!(e[0], 1, "TRTYPE: RDMA");
    assert_eq!((e[768], e[769], e[770]), (1, 1, 1), "TSAS: connected QPs, any provider, rdma_cm");
    assert_eq!(&e[32..32 + url.port.to_string().len()], url.port.to_string().as_bytes());
    assert_eq!(&e[256..256 + nqn.len()], nqn.as_bytes());
    t.shutdown().unwrap();
}

/// A listener on every address is listed with the address the host
/// reached it on (as nvmet-rdma and the NVMe/TCP listener do): a host that
/// connects by the entry must get somewhere, and 0.0.0.0 is nowhere. On
/// verbs a wildcard is refused at start instead (rdma_cm binds a listener
/// to one device's address), with a reason that says so.
#[test]
fn a_wildcard_listener_is_listed_with_the_address_the_host_connected_to() {
    if std::env::var_os("RDMABLK_NVME_RDMA_HOST").is_some() {
        let e = Target::start(config_listening_on("0.0.0.0")).err().expect("verbs refuses a wildcard listener");
        assert!(format!("{e:?}").contains("not a wildcard"), "{e:?}");
        return;
    }
    let (t, mut url, _) = target_listening_on("0.0.0.0");
    url.host = host_address();
    let page = discovery_log(&url);
    let traddr = &page[1024 + 512..1024 + 768];
    let end = traddr.iter().position(|&b| b == 0 || b == b' ').unwrap_or(traddr.len());
    assert_eq!(std::str::from_utf8(&traddr[..end]).unwrap(), url.host, "TRADDR");
    t.shutdown().unwrap();
}

/// The target's log, captured in memory (this test binary's subscriber).
#[derive(Clone, Default)]
struct LogCapture(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);

impl std::io::Write for LogCapture {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl LogCapture {
    /// The process's subscriber (at INFO), installed by the first test
    /// that asks. One for all: the VM runs this binary's tests in one
    /// process, where a second global subscriber cannot be set. Each test
    /// looks only for lines that name what it did.
    fn install() -> LogCapture {
        static CAPTURE: std::sync::OnceLock<LogCapture> = std::sync::OnceLock::new();
        CAPTURE
            .get_or_init(|| {
                let capture = LogCapture::default();
                let writer = capture.clone();
                tracing_subscriber::fmt()
                    .with_ansi(false)
                    .with_max_level(tracing::Level::INFO)
                    .with_writer(move || writer.clone())
                    .try_init()
                    .expect("no other subscriber in this test binary");
                capture
            })
            .clone()
    }

    /// The captured lines that contain `needle`, waiting up to `within`
    /// for at least one.
    fn lines_with(&self, needle: &str, within: Duration) -> Vec<String> {
        let until = Instant::now() + within;
        loop {
            let text = String::from_utf8_lossy(&self.0.lock().unwrap()).into_owned();
            let lines: Vec<String> = text.lines().filter(|l| l.contains(needle)).map(str::to_owned).collect();
            if !lines.is_empty() || Instant::now() >= until {
                return lines;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// A host that disconnects its admin queue ends the association: that is
/// how an NVMe/RDMA host disconnects, not a fault, and the log must not
/// warn about it (a WARN per `nvme disconnect` hides the real ones).
#[test]
fn a_host_that_disconnects_ends_its_controller_without_a_warning() {
    let log = LogCapture::install();
    let host_nqn = "nqn.2014-08.org.example:rdma-disconnecting-host";
    let (t, url, nqn) = target();
    let mut admin = Host::connect(&url, 0, 32);
    admin.nvme_connect_as(host_nqn, &nqn, 0, 0xffff).unwrap();
    admin.enable();
    admin.qp.disconnect();
    drop(admin);
    let lines = log.lines_with(&format!("of host {host_nqn}: "), Duration::from_secs(10));
    assert!(!lines.is_empty(), "the controller's end was not logged");
    for l in &lines {
        assert!(l.contains(" INFO ") && !l.contains("torn down"), "a clean disconnect logged: {l}");
    }
    t.shutdown().unwrap();
}

#[test]
fn a_completion_invalidates_the_hosts_key_when_the_sgl_asks() {
    let (t, url, nqn) = target();
    let (_admin, mut io) = admin_and_io(&url, &nqn);
    let window = io.qp.bind_window(io.data_mr.rkey(), io.data_mr.addr(), 4096, Access::REMOTE_WRITE).unwrap();
    let key = window.rkey();
    let cid = io.cid();
    let mut read = SubmissionEntry::new(io_opcode::READ, cid);
    read.nsid = 1;
    read.set_rw(0, 8, false);
    read.set_sgl(Sgl::Keyed { addr: io.data_mr.addr(), length: 4096, key: key.0, invalidate: true });
    io.send(&read, &[]);
    let (c, invalidated) = io.completion().unwrap();
    // As the Linux host does: a key the target invalidated is not
    // invalidated again (before any assertion: rxe on Linux 6.12 panics on
    // a second invalidation, which a failed check's unwinding would post).
    if invalidated == Some(key) {
        io.qp.window_invalidated_by_peer(window).unwrap();
    } else {
        drop(window);
    }
    assert_eq!((c.cid, c.status), (cid, Status::SUCCESS));
    assert_eq!(invalidated, Some(key), "the completion came as a SEND with Invalidate of the command's key");
    // Without the request, a plain SEND.
    let sgl = io.keyed(0, 4096);
    let mut plain = SubmissionEntry::new(io_opcode::READ, io.cid());
    plain.nsid = 1;
    plain.set_rw(0, 8, false);
    plain.set_sgl(sgl);
    io.send(&plain, &[]);
    let (c, invalidated) = io.completion().unwrap();
    assert_eq!((c.status, invalidated), (Status::SUCCESS, None), "a plain SEND when the SGL did not ask");
    let _ = &io.pd;
    t.shutdown().unwrap();
}

#[test]
fn a_key_outside_what_the_host_registered_fails_that_connection_only() {
    let (t, url, nqn) = target();
    let (_admin, mut io) = admin_and_io(&url, &nqn);
    let good = pattern(4096, 9);
    io.data()[..4096].copy_from_slice(&good);
    let sgl = io.keyed(0, 4096);
    assert_eq!(io.rw(io_opcode::WRITE, 0, 8, sgl, &[]).status, Status::SUCCESS);
    // A READ whose data would land past the end of the host's region: the
    // target's RDMA WRITE is refused, the connection fails, and the host
    // never sees a completion for it (nor corrupted memory).
    let outside = Sgl::Keyed { addr: io.data_mr.addr() + DATA as u64 - 512, length: 4096, key: io.data_mr.rkey().0, invalidate: false };
    let cid = io.cid();
    let mut read = SubmissionEntry::new(io_opcode::READ, cid);
    read.nsid = 1;
    read.set_rw(0, 8, false);
    read.set_sgl(outside);
    io.send(&read, &[]);
    assert!(io.completion().is_err(), "the host sees a transport error, not a completion");
    // A WRITE pulling from outside: the same, and the volume is untouched.
    let (_admin2, mut io2) = admin_and_io(&url, &nqn);
    let sgl = Sgl::Keyed { addr: io2.data_mr.addr() + DATA as u64, length: 4096, key: io2.data_mr.rkey().0, invalidate: false };
    let cid = io2.cid();
    let mut write = SubmissionEntry::new(io_opcode::WRITE, cid);
    write.nsid = 1;
    write.set_rw(0, 8, false);
    write.set_sgl(sgl);
    io2.send(&write, &[]);
    assert!(io2.completion().is_err(), "the host sees a transport error, not a completion");
    // Another host's queue still works, and reads what was written first.
    let (_admin3, mut io3) = admin_and_io(&url, &nqn);
    let sgl = io3.keyed(0, 4096);
    assert_eq!(io3.rw(io_opcode::READ, 0, 8, sgl, &[]).status, Status::SUCCESS);
    assert!(io3.data()[..4096] == good[..]);
    t.shutdown().unwrap();
}

#[test]
fn bad_sgls_and_capsules_get_errors() {
    let (t, url, nqn) = target();
    let (_admin, mut io) = admin_and_io(&url, &nqn);
    // NVMe/TCP's transport data block means nothing on RDMA.
    let c = io.rw(io_opcode::READ, 0, 8, Sgl::Transport { length: 4096 }, &[]);
    assert_eq!(c.status, Status::SGL_TYPE_INVALID);
    // In-capsule data whose length differs from what arrived.
    let c = io.rw(io_opcode::WRITE, 0, 8, Sgl::InCapsule { offset: 0, length: 4096 }, &[0; 512]);
    assert_eq!(c.status, Status::SGL_DATA_LENGTH_INVALID);
    // The queue still works.
    let sgl = io.keyed(0, 4096);
    assert_eq!(io.rw(io_opcode::READ, 0, 8, sgl, &[]).status, Status::SUCCESS);
    // A capsule shorter than a command ends the connection.
    io.send_bytes(&[0u8; 40]);
    assert!(io.completion().is_err(), "a short capsule fails the queue");
    t.shutdown().unwrap();
}

#[test]
fn a_connect_for_another_queue_than_the_cm_request_named_fails_the_queue() {
    let (t, url, nqn) = target();
    let mut admin = Host::connect(&url, 0, 32);
    let cntlid = admin.nvme_connect(&nqn, 0, 0xffff).unwrap();
    admin.enable();
    // Sized and accepted as queue 1, then a Connect for queue 2.
    let mut io = Host::connect(&url, 1, 32);
    let mut d = [0u8; CONNECT_DATA_SIZE];
    ConnectData { host_id: [0x5a; 16], controller_id: cntlid, subsystem_nqn: nqn.clone(), host_nqn: HOST_NQN.into() }.encode(&mut d).unwrap();
    let mut e = Connect { recfmt: 0, qid: 2, sqsize: 31, cattr: 0, kato_ms: 0 }.to_entry(7);
    e.set_sgl(Sgl::InCapsule { offset: 0, length: CONNECT_DATA_SIZE as u32 });
    io.send(&e, &d);
    assert!(io.completion().is_err(), "the queue pair is disconnected");
    // Queue 1 can still be connected properly.
    let mut io = Host::connect(&url, 1, 32);
    assert_eq!(io.nvme_connect(&nqn, 1, cntlid), Ok(cntlid));
    t.shutdown().unwrap();
}

/// A Fabrics Disconnect of an I/O queue: the queue pair goes, and once the
/// host sees it gone the queue id is free again with the queue's writes
/// done. The window between the two is short (the target's thread must
/// lose its CPU inside it), so it is crossed many times with every CPU
/// kept busy.
#[test]
fn after_an_io_queues_disconnect_its_queue_id_is_free_at_once() {
    let (t, url, nqn) = target();
    let mut admin = Host::connect(&url, 0, 32);
    let cntlid = admin.nvme_connect(&nqn, 0, 0xffff).unwrap();
    admin.enable();
    let mut io = Host::connect(&url, 1, 32);
    assert_eq!(io.nvme_connect(&nqn, 1, cntlid), Ok(cntlid));
    let busy = BusyCpus::start();
    for round in 0..=255u8 {
        let data = pattern(4096, round);
        let c = io.rw(io_opcode::WRITE, 0, 8, Sgl::InCapsule { offset: 0, length: 4096 }, &data);
        assert_eq!(c.status, Status::SUCCESS, "round {round}: write");
        let mut e = SubmissionEntry::new(admin_opcode::FABRICS, io.cid());
        e.nsid = rdmablk_common::nvme::fabrics::fctype::DISCONNECT as u32;
        assert_eq!(io.exec(e, &[]).status, Status::SUCCESS, "round {round}: Disconnect");
        assert!(io.completion().is_err(), "round {round}: the queue pair outlived its Disconnect");
        io = Host::connect(&url, 1, 32);
        let again = io.nvme_connect(&nqn, 1, cntlid);
        assert_eq!(again, Ok(cntlid), "round {round}: I/O queue 1 again right after its Disconnect");
        let c = io.rw(io_opcode::READ, 0, 8, io.keyed(0, 4096), &[]);
        assert_eq!(c.status, Status::SUCCESS, "round {round}: read");
        assert!(io.data()[..4096] == data[..], "round {round}: the write before the Disconnect is lost");
    }
    drop((busy, admin));
    t.shutdown().unwrap();
}

/// With pool chunks smaller than the largest transfer, a read leaves in
/// pieces, each an RDMA WRITE of its own before the last (which rides with
/// the completion): every piece's chunk comes back with its own WRITE's
/// completion, in order, and a null volume's pieces of zeroes (sent from
/// the pool's zero buffer, never lent) come back without being taken from
/// the fabric. Reads and writes of 128 KiB in 32 KiB chunks, many times.
#[test]
fn transfers_larger_than_a_pool_chunk_move_in_pieces() {
    let volumes = "chunk_size = \"32KiB\"\n\
        [[volume]]\nname = \"v\"\nbackend = \"memory\"\nsize = \"4MiB\"\nblock_size = 512\nallow_any_host = true\nnsid = 1\n\
        [[volume]]\nname = \"z\"\nbackend = \"null\"\nsize = \"4MiB\"\nblock_size = 512\nallow_any_host = true\nnsid = 2\n";
    let config = config_with_volume(&host_address(), volumes);
    assert_eq!(config.target.chunk_size, 32 << 10);
    let nqn = config.target.nqn.clone();
    let t = Target::start(config).unwrap();
    let url = t.nvme_listeners()[0].url.clone();
    let (_admin, mut io) = admin_and_io(&url, &nqn);
    let len = 128 << 10;
    for round in 0..64u8 {
        let data = pattern(len, round);
        io.data()[..len].copy_from_slice(&data);
        let slba = (round as u64 % 16) * 256;
        assert_eq!(io.rw(io_opcode::WRITE, slba, 256, io.keyed(0, len), &[]).status, Status::SUCCESS, "round {round}: write");
        io.data()[..len].fill(0xee);
        assert_eq!(io.rw(io_opcode::READ, slba, 256, io.keyed(0, len), &[]).status, Status::SUCCESS, "round {round}: read");
        assert!(io.data()[..len] == data[..], "round {round}: the pieces read back are what was written");
        let mut zeroes = SubmissionEntry::new(io_opcode::READ, io.cid());
        zeroes.nsid = 2;
        zeroes.set_rw(slba, 256, false);
        zeroes.set_sgl(io.keyed(0, len));
        assert_eq!(io.exec(zeroes, &[]).status, Status::SUCCESS, "round {round}: a read of the null volume");
        assert!(io.data()[..len].iter().all(|&b| b == 0), "round {round}: the null volume reads zeroes");
    }
    t.shutdown().unwrap();
}

/// `idle_timeout` of a KATO-0 controller counts from its last command on
/// any queue or its last I/O queue's leaving: a host whose admin queue is
/// silent while its I/O queue works longer than idle_timeout may delete
/// and reconnect that I/O queue without losing the controller; once it has
/// no I/O queue, the controller ends idle_timeout later, and no reactor
/// spins meanwhile.
#[test]
fn a_kato_zero_controller_busy_on_its_io_queues_is_not_idle_when_one_reconnects() {
    let mut config = config_listening_on(&host_address());
    config.target.idle_timeout = Duration::from_secs(2);
    let nqn = config.target.nqn.clone();
    let t = Target::start(config).unwrap();
    let url = t.nvme_listeners()[0].url.clone();
    let mut admin = Host::connect(&url, 0, 32);
    let cntlid = admin.nvme_connect(&nqn, 0, 0xffff).unwrap();
    admin.enable();
    let mut io = Host::connect(&url, 1, 32);
    assert_eq!(io.nvme_connect(&nqn, 1, cntlid), Ok(cntlid));
    let t0 = Instant::now();
    let mut round = 0u8;
    while t0.elapsed() < Duration::from_secs(3) {
        let c = io.rw(io_opcode::WRITE, 0, 8, Sgl::InCapsule { offset: 0, length: 4096 }, &pattern(4096, round));
        assert_eq!(c.status, Status::SUCCESS, "write {round} while the admin queue is silent");
        round = round.wrapping_add(1);
        std::thread::sleep(Duration::from_millis(50));
    }
    let mut e = SubmissionEntry::new(admin_opcode::FABRICS, io.cid());
    e.nsid = rdmablk_common::nvme::fabrics::fctype::DISCONNECT as u32;
    assert_eq!(io.exec(e, &[]).status, Status::SUCCESS, "Disconnect");
    drop(io);
    let mut io = Host::connect(&url, 1, 32);
    assert_eq!(
        io.nvme_connect(&nqn, 1, cntlid),
        Ok(cntlid),
        "I/O queue 1 again right after its Disconnect: its controller was busy a moment ago, not idle"
    );
    let c = io.rw(io_opcode::READ, 0, 8, io.keyed(0, 4096), &[]);
    assert_eq!(c.status, Status::SUCCESS, "read on the new I/O queue");
    // Without I/O queues, the controller ends idle_timeout later, not sooner.
    let ticks = process_cpu_ticks;
    drop(io);
    let (gone, cpu0) = (Instant::now(), ticks());
    let end = admin.completion_within(Duration::from_secs(10));
    let (after, cpu) = (gone.elapsed(), ticks() - cpu0);
    assert!(end.is_err(), "the controller outlived idle_timeout without I/O queues: {end:?}");
    assert!(after >= Duration::from_millis(1500), "the controller ended {after:?} after its last I/O queue left, before idle_timeout");
    // A second of waiting on a sleeping target costs a few ticks (1/100 s):
    // a reactor woken by a deadline already passed would burn ~100 a second.
    assert!(cpu < 50 * (after.as_secs() + 1), "the target used {cpu} CPU ticks in {after:?} waiting for an idle deadline");
    t.shutdown().unwrap();
}

/// This process's CPU time so far (the in-process target's and the test
/// host's), in clock ticks: utime + stime of /proc/self/stat.
fn process_cpu_ticks() -> u64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap();
    let fields: Vec<&str> = stat[stat.rfind(')').unwrap() + 2..].split(' ').collect();
    fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap()
}

// ---------------------------------------------------------------------------
// A host that tears its queue pairs down mid-I/O and reconnects at once
//
// The NVMe/RDMA counterpart of `tests/tests/nvme_reset.rs` (NVMe/TCP
// sockets reset mid-I/O). RDMA has no reset of a connection as such: the
// closest a host comes to it is its queue pairs going away, disconnected
// or simply destroyed, with commands in flight and no NVMe Disconnect, as
// when the Linux host's path fails and it reconnects. Each round puts 32
// commands in flight on the two I/O queues of one association (reads by
// the target's RDMA WRITE, 4-16 KiB in-capsule writes, and 16-128 KiB
// writes whose data the target fetches by RDMA READ from the host's
// memory under a keyed SGL), takes a random number of their completions
// (none to most of them), and then tears every queue pair of the
// association down at once. Then:
//
// - a new admin Connect with the same host NQN must be answered with
//   success within 1 s of the host's rdma_cm connect (the fence waits for
//   the old association's queues, but must not lock the host out);
// - the old association's writes either landed before that answer or
//   never land: every range written in the round is read back by another
//   host (an association connected throughout) the moment that answer
//   comes, then through the new association once its I/O queues are
//   connected, and again 300 ms later (no change allowed); every 4 KiB
//   block holds either its previous content or exactly this round's
//   version of it; a write whose completion the host saw has landed, and
//   a read whose completion it saw brought the content the model says.
//
// The new admin queue pair is made (not connected) before the teardown,
// so the reconnect follows it at once: on the tcp provider (the Connect is
// answered about 1 ms after the teardown), a fence disabled in
// `Queue::fence` shows within a few rounds as old writes that the first
// read-back misses and the later ones find. On Soft-RoCE under TCG the
// rdma_cm connect alone takes about 10 ms, and a disabled fence went
// unnoticed in 50 rounds there. The new association is the next round's.
// The volume is a file, so that writes take the disk's time.
// `RDMABLK_TEST_SEED` replays the commands' layout; `RDMABLK_RESET_ROUNDS`
// changes the round count (50: about 17 s on the tcp provider, 42 s in
// the VM).

const RESET_HOST_NQN: &str = "nqn.2014-08.org.example:rdma-resetting-host";
/// Another host, connected throughout: it reads the rounds' ranges the
/// moment the resetting host's new admin Connect is answered.
const OBSERVER_NQN: &str = "nqn.2014-08.org.example:rdma-observer";
/// The volume's block size; the stamped unit of the versioned data.
const RBS: usize = 4096;
const _: () = assert!(RBS == rdmablk_system_tests::stamp::STAMP_BLOCK);
const RESET_VOLUME: u64 = 16 << 20;
const RESET_IO_QUEUES: usize = 2;
/// Commands in flight per round, over the I/O queues.
const RESET_COMMANDS: usize = 32;
/// Each command of a round has a slot of its own in the volume (no two
/// overlap): the region the rounds use is `RESET_COMMANDS` slots of 128 KiB.
const RESET_SLOT_BLOCKS: u32 = 32;
const RESET_REGION_BLOCKS: usize = RESET_COMMANDS * RESET_SLOT_BLOCKS as usize;
/// Entries of every queue (the host's and the target's side).
const RESET_ENTRIES: u16 = 32;
/// The admin Connect's keep-alive timeout (a Keep Alive ends every round).
const RESET_KATO_MS: u32 = 30_000;
/// How soon the new association's admin Connect must be answered.
const CONNECT_LIMIT: Duration = Duration::from_secs(1);
/// How long the test waits for that answer anyway, to report its status
/// (the target's default fence_timeout is 5 s).
const CONNECT_WAIT: Duration = Duration::from_secs(8);
/// Between the two read-backs: an old write landing late shows here.
const SETTLE: Duration = Duration::from_millis(300);
/// How long a round waits for the completions it takes before the teardown.
const LOAD_WAIT: Duration = Duration::from_secs(5);
/// A command's part of its queue's data area: the largest command.
const AREA: usize = RESET_SLOT_BLOCKS as usize * RBS;
const _: () = assert!(RESET_COMMANDS / RESET_IO_QUEUES * AREA <= DATA);

fn reset_seed() -> u64 {
    std::env::var("RDMABLK_TEST_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or_else(rand::random)
}

fn reset_rounds() -> u32 {
    std::env::var("RDMABLK_RESET_ROUNDS").ok().and_then(|s| s.parse().ok()).unwrap_or(50)
}

impl Host {
    /// A copy of `len` bytes of the data area at `off`, whose command has
    /// completed (other parts of the area may still be in use).
    fn data_copy(&self, off: usize, len: usize) -> Vec<u8> {
        assert!(off + len <= DATA);
        // SAFETY: in bounds; nothing writes this part of the area now.
        unsafe { std::slice::from_raw_parts(self.data.as_ptr().add(off), len).to_vec() }
    }

    /// Takes the completions the queue has (one poll) without waiting;
    /// panics if the queue pair failed.
    fn take_completions(&mut self, what: &str) -> Vec<CompletionEntry> {
        let (_, failed) = self.progress();
        assert!(failed.is_none(), "{what}: the queue pair failed ({failed:?}) before the host tore it down");
        self.done.drain(..).map(|(c, _)| c).collect()
    }
}

/// One association: the admin queue and the I/O queues.
struct Association {
    admin: Host,
    io: Vec<Host>,
}

/// Connects an association of `host_nqn` for round `round` (what a round
/// does first after its teardown) with `admin` (a [`Host::prepare`]d queue
/// pair) as its admin queue, and runs `right_after` as soon as its admin
/// Connect is answered. Fails the test, naming the round, unless that
/// Connect succeeds within [`CONNECT_LIMIT`] of the rdma_cm connect;
/// returns the association, how long that took and what `right_after` gave.
fn associate<T>(
    mut admin: Host,
    url: &FabricUrl,
    nqn: &str,
    host_nqn: &str,
    round: u32,
    after: &str,
    right_after: impl FnOnce() -> T,
) -> (Association, Duration, T) {
    let mut d = [0u8; CONNECT_DATA_SIZE];
    let data = ConnectData { host_id: [0x5a; 16], controller_id: 0xffff, subsystem_nqn: nqn.into(), host_nqn: host_nqn.into() };
    data.encode(&mut d).unwrap();
    admin.data()[..CONNECT_DATA_SIZE].copy_from_slice(&d);
    let cid = admin.cid();
    let mut connect = Connect { recfmt: 0, qid: 0, sqsize: RESET_ENTRIES - 1, cattr: 0, kato_ms: RESET_KATO_MS }.to_entry(cid);
    connect.set_sgl(admin.keyed(0, CONNECT_DATA_SIZE));
    let req = CmRequest { recfmt: RECFMT_1_0, qid: 0, hrqsize: RESET_ENTRIES, hsqsize: RESET_ENTRIES - 1, cntlid: 0xffff };

    let t0 = Instant::now();
    let reply = admin
        .cm_connect(&req.encode())
        .unwrap_or_else(|e| panic!("round {round}: the admin queue's rdma_cm connect {after} failed after {:?}: {e}", t0.elapsed()));
    assert_eq!(CmAccept::decode(&reply).ok(), Some(CmAccept { recfmt: RECFMT_1_0, crqsize: RESET_ENTRIES }), "round {round}: the accept");
    admin.send(&connect, &[]);
    let answer = admin.completion_within(CONNECT_WAIT);
    let took = t0.elapsed();
    let cntlid = match answer {
        Ok(Some((c, _))) if c.status.is_success() && took <= CONNECT_LIMIT => c.result as u16,
        Ok(Some((c, _))) => {
            let busy = if c.status == Status::CONNECT_CONTROLLER_BUSY { " (Connect Controller Busy)" } else { "" };
            panic!(
                "round {round}: the admin Connect of host {host_nqn} {after} was answered after {took:?} with status {}{busy} \
                 (required: success within {CONNECT_LIMIT:?})",
                c.status
            )
        }
        Ok(None) => panic!(
            "round {round}: the admin Connect of host {host_nqn} {after} got no answer within {took:?} \
             (required: success within {CONNECT_LIMIT:?})"
        ),
        Err(status) => panic!("round {round}: the admin queue {after} failed after {took:?} ({status:?}) instead of answering its Connect"),
    };
    let early = right_after();
    admin.enable();
    // Number of Queues, as the Linux host asks for them.
    let want = (RESET_IO_QUEUES - 1) as u32;
    let mut features = SubmissionEntry::new(admin_opcode::SET_FEATURES, admin.cid());
    features.cdw[0] = 0x07;
    features.cdw[1] = want | want << 16;
    let c = admin.exec(features, &[]);
    assert_eq!(c.status, Status::SUCCESS, "round {round}: Set Features, Number of Queues");
    let granted = c.result as u32;
    assert!(
        granted & 0xffff >= want && granted >> 16 >= want,
        "round {round}: the target granted fewer than {RESET_IO_QUEUES} I/O queues: {granted:#x}"
    );
    let io = (1..=RESET_IO_QUEUES as u16)
        .map(|qid| {
            let mut q = Host::connect(url, qid, RESET_ENTRIES);
            let joined = q.nvme_connect_as(host_nqn, nqn, qid, cntlid);
            assert_eq!(joined, Ok(cntlid), "round {round}: the Connect of I/O queue {qid}");
            q
        })
        .collect();
    (Association { admin, io }, took, early)
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    /// Its data comes by the target's RDMA WRITE into the host's memory.
    Read,
    /// 4-16 KiB of data in the capsule.
    InCapsule,
    /// 16-128 KiB the target fetches by RDMA READ (keyed SGL).
    Keyed,
}

#[derive(Clone, Debug)]
struct Planned {
    /// Its number in the round (stamped into its data).
    cmd: u32,
    queue: usize,
    kind: Kind,
    slba: u64,
    blocks: u32,
    data: Vec<u8>,
    /// Where its data lies in its queue's data area.
    at: usize,
}

impl Planned {
    fn writes(&self) -> bool {
        self.kind != Kind::Read
    }
    fn len(&self) -> usize {
        self.blocks as usize * RBS
    }
}

/// 16 commands per I/O queue: 4 reads of 4-64 KiB, 4 in-capsule writes of
/// 4-16 KiB, 8 keyed writes of 16-128 KiB, each in a slot of its own at a
/// random place within it, and in an area of its own of the host's memory;
/// in the order they are sent in.
fn plan_round(rng: &mut impl Rng, round: u32, region: u64) -> Vec<Planned> {
    let mut slots: Vec<u64> = (0..RESET_COMMANDS as u64).collect();
    slots.shuffle(rng);
    let per_queue = RESET_COMMANDS / RESET_IO_QUEUES;
    let mut out = Vec::with_capacity(RESET_COMMANDS);
    for (i, slot) in slots.into_iter().enumerate() {
        let (queue, j) = (i / per_queue, i % per_queue);
        let kind = match j {
            0..=3 => Kind::Read,
            4..=7 => Kind::InCapsule,
            _ => Kind::Keyed,
        };
        let blocks = match kind {
            Kind::Read => rng.gen_range(1..=16),
            Kind::InCapsule => rng.gen_range(1..=4),
            Kind::Keyed => rng.gen_range(4..=RESET_SLOT_BLOCKS),
        };
        let slba = region + slot * RESET_SLOT_BLOCKS as u64 + rng.gen_range(0..=(RESET_SLOT_BLOCKS - blocks)) as u64;
        let cmd = i as u32;
        let data = match kind {
            Kind::Read => Vec::new(),
            _ => (0..blocks).flat_map(|b| stamp(round, cmd, b, slba + b as u64)).collect(),
        };
        out.push(Planned { cmd, queue, kind, slba, blocks, data, at: j * AREA });
    }
    // The order they are sent in.
    out.shuffle(rng);
    out
}

/// How a round ends its association.
#[derive(Clone, Copy, Debug)]
enum Teardown {
    /// Every queue pair disconnected, the I/O queues' first, then dropped.
    DisconnectIoFirst,
    /// Every queue pair disconnected, the admin queue's first, then dropped.
    DisconnectAdminFirst,
    /// Every queue pair dropped (destroyed) without a disconnect of its own,
    /// the I/O queues' first.
    Drop,
}

/// What the host learned of a round's commands before the teardown.
#[derive(Default)]
struct Seen {
    /// Writes (by number) whose successful completion the host took.
    acked: Vec<u32>,
    /// Completions taken.
    completed: usize,
}

/// Puts the round's commands in flight on `a`, takes `take` of their
/// completions (or what comes within [`LOAD_WAIT`]), and tears every
/// queue pair of `a` down at once. Reads that completed are checked
/// against `model` (their slots are not written this round).
fn load_and_tear_down(a: Association, plan: &[Planned], model: &[u8], region: u64, round: u32, take: usize, how: Teardown) -> Seen {
    let Association { mut admin, mut io } = a;
    for p in plan {
        let area = &mut io[p.queue].data()[p.at..p.at + p.len()];
        match p.kind {
            Kind::Keyed => area.copy_from_slice(&p.data),
            Kind::Read => area.fill(0xee),
            Kind::InCapsule => {}
        }
    }
    // Every command in flight, the queues' in turn, each queue's in the
    // plan's (random) order.
    let mut order: Vec<Vec<usize>> = vec![Vec::new(); RESET_IO_QUEUES];
    for (i, p) in plan.iter().enumerate() {
        order[p.queue].push(i);
    }
    let per_queue = RESET_COMMANDS / RESET_IO_QUEUES;
    let sends: Vec<usize> = (0..per_queue).flat_map(|k| order.iter().map(move |o| o[k])).collect();
    let mut cids: Vec<Vec<(u16, usize)>> = vec![Vec::new(); RESET_IO_QUEUES];
    for i in sends {
        let p = &plan[i];
        let h = &mut io[p.queue];
        let cid = h.cid();
        let opcode = if p.writes() { io_opcode::WRITE } else { io_opcode::READ };
        let mut e = SubmissionEntry::new(opcode, cid);
        e.nsid = 1;
        e.set_rw(p.slba, p.blocks, false);
        if p.kind == Kind::InCapsule {
            e.set_sgl(Sgl::InCapsule { offset: 0, length: p.len() as u32 });
            h.send(&e, &p.data);
        } else {
            e.set_sgl(h.keyed(p.at, p.len()));
            h.send(&e, &[]);
        }
        cids[p.queue].push((cid, i));
    }

    // Some of their completions (on the tcp provider, polling is also what
    // serves the target's RDMA READs and places its RDMA WRITEs).
    let mut seen = Seen::default();
    let deadline = Instant::now() + LOAD_WAIT;
    while seen.completed < take && Instant::now() < deadline {
        let mut got = 0;
        for (qi, h) in io.iter_mut().enumerate() {
            for c in h.take_completions(&format!("round {round}: I/O queue {}", qi + 1)) {
                got += 1;
                let i = cids[qi].iter().find(|x| x.0 == c.cid).map(|x| x.1);
                let i = i.unwrap_or_else(|| panic!("round {round}: I/O queue {}: a completion of no command: {c:?}", qi + 1));
                let p = &plan[i];
                let what = format!("round {round}: command {} ({:?}, LBA {}+{})", p.cmd, p.kind, p.slba, p.blocks);
                assert!(c.status.is_success(), "{what} failed: {}", c.status);
                seen.completed += 1;
                if p.writes() {
                    seen.acked.push(p.cmd);
                    continue;
                }
                let at = (p.slba - region) as usize * RBS;
                let got = h.data_copy(p.at, p.len());
                if got != model[at..at + p.len()] {
                    let block = got.chunks(RBS).zip(model[at..].chunks(RBS)).position(|(x, y)| x != y).expect("a block differs");
                    panic!(
                        "round {round}: read {} at LBA {}+{} brought {} in block {block}, where the volume holds {}",
                        p.cmd,
                        p.slba,
                        p.blocks,
                        describe(&got[block * RBS..(block + 1) * RBS]),
                        describe(&model[at + block * RBS..at + (block + 1) * RBS])
                    );
                }
            }
        }
        let admin_news = admin.take_completions(&format!("round {round}: the admin queue"));
        assert!(admin_news.is_empty(), "round {round}: the admin queue answered nothing it was asked: {admin_news:?}");
        if got == 0 {
            std::thread::sleep(Duration::from_micros(200));
        }
    }

    // The teardown: every queue pair at once, no NVMe Disconnect.
    match how {
        Teardown::DisconnectIoFirst => {
            io.iter().for_each(|h| h.qp.disconnect());
            admin.qp.disconnect();
        }
        Teardown::DisconnectAdminFirst => {
            admin.qp.disconnect();
            io.iter().for_each(|h| h.qp.disconnect());
        }
        Teardown::Drop => {}
    }
    drop(io);
    drop(admin);
    seen
}

/// Reads every range `plan` wrote through `h` (as many reads in flight at
/// once as the data area holds): (command, bytes).
fn read_back(h: &mut Host, plan: &[Planned], round: u32, when: &str) -> Vec<(usize, Vec<u8>)> {
    let writes: Vec<usize> = plan.iter().enumerate().filter(|(_, p)| p.writes()).map(|(i, _)| i).collect();
    let mut out = Vec::with_capacity(writes.len());
    for batch in writes.chunks(DATA / AREA) {
        let mut cids = Vec::with_capacity(batch.len());
        for (k, &i) in batch.iter().enumerate() {
            let p = &plan[i];
            let cid = h.cid();
            let mut e = SubmissionEntry::new(io_opcode::READ, cid);
            e.nsid = 1;
            e.set_rw(p.slba, p.blocks, false);
            e.set_sgl(h.keyed(k * AREA, p.len()));
            h.send(&e, &[]);
            cids.push(cid);
        }
        for _ in batch {
            let (c, _) = h.completion().unwrap_or_else(|s| panic!("round {round}: read-back {when}: the queue pair failed: {s:?}"));
            assert!(cids.contains(&c.cid), "round {round}: read-back {when}: a completion of no read: {c:?}");
            assert_eq!(c.status, Status::SUCCESS, "round {round}: read-back {when}");
        }
        for (k, &i) in batch.iter().enumerate() {
            out.push((i, h.data_copy(k * AREA, plan[i].len())));
        }
    }
    out
}

/// Fails the test where a later read-back (`b`, at least `after` after
/// the first) differs from the first (`a`): an old write landed late.
fn unchanged(plan: &[Planned], a: &[(usize, Vec<u8>)], b: &[(usize, Vec<u8>)], round: u32, after: Duration) {
    for ((i, a), (_, b)) in a.iter().zip(b) {
        if a != b {
            let p = &plan[*i];
            let block = a.chunks(RBS).zip(b.chunks(RBS)).position(|(x, y)| x != y).expect("a block differs");
            panic!(
                "round {round}: command {} ({:?}) at LBA {}+{} changed after the new admin Connect was answered (read again \
                 {after:?} after the first read-back): block {block} held {} and now holds {} (an old association's write landed late)",
                p.cmd,
                p.kind,
                p.slba,
                p.blocks,
                describe(&a[block * RBS..(block + 1) * RBS]),
                describe(&b[block * RBS..(block + 1) * RBS])
            );
        }
    }
}

/// How the writes of a round ended up, in blocks and commands.
#[derive(Default)]
struct Landed {
    blocks: usize,
    blocks_not: usize,
    /// Commands with some blocks landed and some not.
    partly: usize,
}

/// Checks the round's writes against the model of the region (every
/// block's content before the round), then moves the model on.
fn check_writes(model: &mut [u8], region: u64, plan: &[Planned], seen: &Seen, back: &[(usize, Vec<u8>)], round: u32) -> Landed {
    let mut landed = Landed::default();
    let mut errors = Vec::new();
    for (i, got) in back {
        let p = &plan[*i];
        let acked = seen.acked.contains(&p.cmd);
        let mut new_blocks = 0;
        for b in 0..p.blocks as usize {
            let lba = p.slba + b as u64;
            let at = (lba - region) as usize * RBS;
            let before = &model[at..at + RBS];
            let new = &p.data[b * RBS..(b + 1) * RBS];
            let g = &got[b * RBS..(b + 1) * RBS];
            let what = format!("round {round}: command {} ({:?}, LBA {}+{}) block {b} at LBA {lba}", p.cmd, p.kind, p.slba, p.blocks);
            if g == new {
                new_blocks += 1;
            } else if g == before {
                if acked {
                    let held = describe(g);
                    errors.push(format!("{what}: its success was seen before the teardown, but it holds the previous content ({held})"));
                }
            } else {
                let (was, held) = (describe(before), describe(g));
                errors.push(format!("{what}: neither the previous content ({was}) nor this round's version; it holds {held}"));
            }
        }
        landed.blocks += new_blocks;
        landed.blocks_not += p.blocks as usize - new_blocks;
        landed.partly += usize::from(new_blocks > 0 && new_blocks < p.blocks as usize);
        // What the round left is the next round's "before".
        let at = (p.slba - region) as usize * RBS;
        model[at..at + got.len()].copy_from_slice(got);
    }
    assert!(errors.is_empty(), "{} block(s) wrong:\n{}", errors.len(), errors.join("\n"));
    landed
}

/// A host whose queue pairs all go at once, with commands in flight and no
/// NVMe Disconnect, reconnects with the same host NQN at once: its admin
/// Connect succeeds within 1 s, and every write of the old association
/// landed before that answer or never lands.
#[test]
fn a_host_that_drops_its_queue_pairs_mid_io_reconnects_at_once_and_no_old_write_lands_late() {
    let dir = tempfile::tempdir().unwrap();
    let img = sparse_file(dir.path(), "vol.img", RESET_VOLUME);
    let volume = format!("{}block_size = {RBS}\n", file_volume("v", &img, RESET_VOLUME, false));
    let config = config_with_volume(&host_address(), &volume);
    let nqn = config.target.nqn.clone();
    let t = Target::start(config).unwrap();
    let url = t.nvme_listeners()[0].url.clone();

    let seed = reset_seed();
    eprintln!("RDMABLK_TEST_SEED={seed}");
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let rounds = reset_rounds().max(1);
    // The region the rounds write, somewhere in the volume.
    let blocks = RESET_VOLUME / RBS as u64;
    let region = rng.gen_range(0..(blocks - RESET_REGION_BLOCKS as u64)) & !(RESET_SLOT_BLOCKS as u64 - 1);
    let mut model = vec![0u8; RESET_REGION_BLOCKS * RBS];

    let started = Instant::now();
    let (mut observer, _, ()) = associate(Host::prepare(&url), &url, &nqn, OBSERVER_NQN, 0, "(the observer)", || ());
    let (mut assoc, _, ()) = associate(Host::prepare(&url), &url, &nqn, RESET_HOST_NQN, 0, "(the first association)", || ());
    let mut times = Vec::with_capacity(rounds as usize);
    let (mut landed, mut acked, mut completed) = (Landed::default(), 0, 0);
    for round in 1..=rounds {
        let plan = plan_round(&mut rng, round, region);
        // None of the completions, some, or most (reads and writes alike).
        let take = rng.gen_range(0..=RESET_COMMANDS * 3 / 4);
        let how = [Teardown::DisconnectIoFirst, Teardown::DisconnectAdminFirst, Teardown::Drop][round as usize % 3];
        // The next admin queue pair is ready before the teardown: the host
        // connects it the moment the old association is gone.
        let admin = Host::prepare(&url);
        let seen = load_and_tear_down(assoc, &plan, &model, region, round, take, how);
        let n = seen.completed;
        let after = format!("right after its old association's queue pairs were torn down mid-I/O ({how:?}, {n} completions taken)");
        let right_after = "by another host right after the new admin Connect was answered";
        let (mut next, took, first) =
            associate(admin, &url, &nqn, RESET_HOST_NQN, round, &after, || read_back(&mut observer.io[0], &plan, round, right_after));
        times.push(took);
        let l = check_writes(&mut model, region, &plan, &seen, &first, round);
        landed.blocks += l.blocks;
        landed.blocks_not += l.blocks_not;
        landed.partly += l.partly;
        acked += seen.acked.len();
        completed += seen.completed;

        let connected = Instant::now();
        let second = read_back(&mut next.io[0], &plan, round, "through the new association");
        unchanged(&plan, &first, &second, round, connected.elapsed());
        std::thread::sleep(SETTLE);
        let third = read_back(&mut next.io[1], &plan, round, "through the new association after the settle time");
        unchanged(&plan, &first, &third, round, connected.elapsed());
        for a in [&mut observer.admin, &mut next.admin] {
            let mut keep_alive = SubmissionEntry::new(admin_opcode::KEEP_ALIVE, a.cid());
            keep_alive.set_sgl(NULL_SGL);
            assert_eq!(a.exec(keep_alive, &[]).status, Status::SUCCESS, "round {round}: Keep Alive");
        }
        assoc = next;
    }
    times.sort();
    eprintln!(
        "{rounds} rounds in {:?}; admin Connect after the teardown (rdma_cm connect to its answer): median {:?}, max {:?}; \
         completions taken before the teardown {completed} ({acked} of writes); blocks of the rounds' writes landed {}, \
         not landed {}; writes that landed in part {}",
        started.elapsed(),
        times[times.len() / 2],
        times[times.len() - 1],
        landed.blocks,
        landed.blocks_not,
        landed.partly
    );
    drop((assoc, observer));
    t.shutdown().unwrap();
}

// ---------------------------------------------------------------------------
// System calls per I/O at depth 16 (a measurement, not a check)

/// Batches of 16 commands, each batch's completions taken before the next.
fn qd16_batches() -> usize {
    std::env::var("RDMABLK_QD16_BATCHES").ok().and_then(|s| s.parse().ok()).unwrap_or(2000)
}

/// Runs [`qd16_batches`] batches of 16 4 KiB commands on one I/O queue:
/// writes whose data the target fetches by RDMA READ under a keyed SGL,
/// then reads it sends by RDMA WRITE (`RDMABLK_QD16=write` or `read`: only
/// those), and prints how many of each and how long they took. What it is
/// for is counting the target's system calls per I/O from outside, by
/// thread name (the reactors are `rdmablk-r<N>`, the test host is not):
///
/// ```text
/// perf record -q -c 1 -e syscalls:sys_enter_sendmsg,raw_syscalls:sys_enter -o /tmp/qd16.data -- \
///     env RDMABLK_QD16=write target/debug/deps/nvme_rdma-<hash> --ignored --exact qd16_4k_io_for_counting_system_calls
/// perf script -i /tmp/qd16.data -F comm,event | sort | uniq -c
/// ```
///
/// (the connect, Identify and teardown add a few dozen calls in all).
#[test]
#[ignore = "a measurement: run under perf (see its doc comment)"]
fn qd16_4k_io_for_counting_system_calls() {
    const DEPTH: usize = 16;
    const LEN: usize = 4096;
    let (t, url, nqn) = target();
    let (admin, mut io) = admin_and_io(&url, &nqn);
    let which = std::env::var("RDMABLK_QD16").unwrap_or_default();
    let batches = qd16_batches();
    for (name, opcode) in [("write", io_opcode::WRITE), ("read", io_opcode::READ)] {
        if !which.is_empty() && which != name {
            continue;
        }
        let started = Instant::now();
        for _ in 0..batches {
            let mut cids = [0u16; DEPTH];
            for (i, cid) in cids.iter_mut().enumerate() {
                *cid = io.cid();
                let mut e = SubmissionEntry::new(opcode, *cid);
                e.nsid = 1;
                e.set_rw((i * LEN / 512) as u64, (LEN / 512) as u32, false);
                e.set_sgl(io.keyed(i * LEN, LEN));
                io.send(&e, &[]);
            }
            for _ in 0..DEPTH {
                let (c, _) = io.completion().expect("a completion");
                assert!(cids.contains(&c.cid), "completion of command {}, not of this batch", c.cid);
                assert_eq!(c.status, Status::SUCCESS, "{name} {}", c.cid);
            }
        }
        let ios = batches * DEPTH;
        let took = started.elapsed();
        eprintln!("{ios} {name}s of {LEN} bytes at QD{DEPTH} in {took:?} ({:?} per I/O)", took / ios as u32);
    }
    drop((admin, io));
    t.shutdown().unwrap();
}

// ---------------------------------------------------------------------------
// The send queue's size with reads in pieces

/// With pool chunks of 16 KiB, every piece of a 128 KiB read before its
/// last is a signaled RDMA WRITE of its own (up to the executor's window
/// of pieces per command in flight at once): a queue's send queue must
/// hold those of every command besides each completion's SEND and its
/// chained last WRITE. 31 such reads at once on a 32-entry queue all come
/// back, with their data (the queue pair overflowed its send queue and
/// failed after 12 of them when it was sized for one WRITE per command).
#[test]
fn a_full_queue_of_reads_in_many_pieces_fits_the_send_queue() {
    const READS: usize = 31;
    const LEN: usize = 128 << 10;
    const AREAS: usize = DATA / LEN;
    let volumes = "chunk_size = \"16KiB\"\n\
        [[volume]]\nname = \"v\"\nbackend = \"memory\"\nsize = \"4MiB\"\nblock_size = 512\nallow_any_host = true\n";
    let config = config_with_volume(&host_address(), volumes);
    assert_eq!(config.target.chunk_size, 16 << 10);
    let nqn = config.target.nqn.clone();
    let t = Target::start(config).unwrap();
    let url = t.nvme_listeners()[0].url.clone();
    let (_admin, mut io) = admin_and_io(&url, &nqn);
    let data = pattern(LEN, 7);
    io.data()[..LEN].copy_from_slice(&data);
    assert_eq!(io.rw(io_opcode::WRITE, 0, (LEN / 512) as u32, io.keyed(0, LEN), &[]).status, Status::SUCCESS, "the write");
    for round in 0..8 {
        io.data().fill(0xee);
        let mut cids = Vec::new();
        for i in 0..READS {
            let cid = io.cid();
            let mut e = SubmissionEntry::new(io_opcode::READ, cid);
            e.nsid = 1;
            e.set_rw(0, (LEN / 512) as u32, false);
            e.set_sgl(io.keyed(i % AREAS * LEN, LEN));
            io.send(&e, &[]);
            cids.push(cid);
        }
        for n in 0..READS {
            let c = io.completion().unwrap_or_else(|s| panic!("round {round}: the queue pair failed ({s:?}) after {n} of {READS} reads"));
            assert!(cids.contains(&c.0.cid), "round {round}: completion of command {}, not of this round", c.0.cid);
            assert_eq!(c.0.status, Status::SUCCESS, "round {round}: read {}", c.0.cid);
        }
        for a in 0..AREAS {
            assert!(io.data_copy(a * LEN, LEN) == data, "round {round}: the data read into area {a}");
        }
    }
    t.shutdown().unwrap();
}

/// The queue's send queue is sized for the entries its rdma_cm request
/// named (HSQSIZE): a Connect for a larger queue (SQSIZE), whose commands
/// would overflow it, fails the queue as a Connect for another queue id
/// does. One for the same size, or a smaller one, is fine.
#[test]
fn a_connect_for_a_larger_queue_than_the_cm_request_named_fails_the_queue() {
    let (t, url, nqn) = target();
    let mut admin = Host::connect(&url, 0, 32);
    let cntlid = admin.nvme_connect(&nqn, 0, 0xffff).unwrap();
    admin.enable();
    let connect = |io: &mut Host, sqsize: u16| {
        let mut d = [0u8; CONNECT_DATA_SIZE];
        ConnectData { host_id: [0x5a; 16], controller_id: cntlid, subsystem_nqn: nqn.clone(), host_nqn: HOST_NQN.into() }
            .encode(&mut d)
            .unwrap();
        let mut e = Connect { recfmt: 0, qid: 1, sqsize, cattr: 0, kato_ms: 0 }.to_entry(io.cid());
        e.set_sgl(Sgl::InCapsule { offset: 0, length: CONNECT_DATA_SIZE as u32 });
        io.send(&e, &d);
        io.completion()
    };
    // Sized and accepted for 16 entries, then a Connect for 32.
    let mut io = Host::connect(&url, 1, 16);
    assert!(connect(&mut io, 31).is_err(), "the queue pair is disconnected");
    let mut io = Host::connect(&url, 1, 32);
    let (c, _) = connect(&mut io, 15).expect("a Connect for fewer entries than the queue pair holds");
    assert_eq!(c.status, Status::SUCCESS);
    t.shutdown().unwrap();
}

// ---------------------------------------------------------------------------
// Closed queues waiting for the disk

/// The target's grace for a closing queue (`CLOSE_GRACE` in
/// `target-daemon/src/nvmf/rdma.rs`).
const TARGET_CLOSE_GRACE: Duration = Duration::from_secs(2);

/// Queues that closed while a read of theirs is held at the disk wait only
/// for the executor once their grace is over, and sleep until the read
/// ends (no deadline of their own: the executor's news wakes them), not
/// spinning their reactor: one the host took down (its answers out, it
/// waits to leave its controller), one that failed (disconnected, its
/// work requests flushed). Then they end, and their queue ids are free.
/// Skipped without CAP_SYS_ADMIN (the fanotify watch) or a tmpfs taking
/// O_DIRECT, or if the held read holds the reactor's own thread.
#[test]
fn closed_queues_waiting_for_a_disk_read_do_not_spin_their_reactor() {
    use std::os::unix::fs::FileExt;
    const BS: usize = 4096;
    const VOL: u64 = 16 << 20;
    let Some(dir) = tmpfs_dir() else {
        eprintln!("skipping: no tmpfs at /dev/shm that takes O_DIRECT");
        return;
    };
    let img = sparse_file(dir.path(), "vol.img", VOL);
    std::fs::OpenOptions::new().write(true).open(&img).unwrap().write_all_at(&[0x5a; BS], 0).unwrap();
    let Some(gate) = ReadGate::watch(&img) else {
        eprintln!("skipping: no fanotify permission watch (needs CAP_SYS_ADMIN)");
        return;
    };
    // One reactor: the admin queue shows whether the I/O queues' reactor is free.
    let volume = format!("reactors = 1\n{}block_size = {BS}\n", file_volume("v", &img, VOL, false));
    let config = config_with_volume(&host_address(), &volume);
    let nqn = config.target.nqn.clone();
    let t = Target::start(config).unwrap();
    let url = t.nvme_listeners()[0].url.clone();
    let (mut admin, cntlid) = {
        let mut admin = Host::connect(&url, 0, 32);
        let cntlid = admin.nvme_connect(&nqn, 0, 0xffff).unwrap();
        admin.enable();
        (admin, cntlid)
    };
    let mut queues = Vec::new();
    for qid in [1, 2] {
        let mut io = Host::connect(&url, qid, 32);
        assert_eq!(io.nvme_connect(&nqn, qid, cntlid), Ok(cntlid));
        assert_eq!(io.rw(io_opcode::READ, 0, 1, io.keyed(0, BS), &[]).status, Status::SUCCESS, "queue {qid}: a read before the hold");
        assert!(io.data()[..BS].iter().all(|&b| b == 0x5a), "queue {qid}: the read before the hold");
        queues.push(io);
    }

    gate.hold();
    for (n, io) in queues.iter_mut().enumerate() {
        let mut e = SubmissionEntry::new(io_opcode::READ, io.cid());
        e.nsid = 1;
        e.set_rw(0, 1, false);
        e.set_sgl(io.keyed(0, BS));
        io.send(&e, &[]);
        let until = Instant::now() + Duration::from_secs(10);
        while gate.held() <= n {
            assert!(Instant::now() < until, "read {n} never reached the disk");
            std::thread::sleep(Duration::from_millis(10));
        }
    }
    // The reads wait in io_uring's worker, not in the reactor's thread.
    let mut e = SubmissionEntry::new(admin_opcode::KEEP_ALIVE, admin.cid());
    e.set_sgl(NULL_SGL);
    admin.send(&e, &[]);
    match admin.completion_within(Duration::from_secs(3)) {
        Ok(Some((c, _))) => assert_eq!(c.status, Status::SUCCESS, "Keep Alive while the reads are held"),
        other => {
            gate.release();
            eprintln!("skipping: the held reads hold the reactor's own thread (Keep Alive: {other:?})");
            return;
        }
    }
    // Queue 1's host goes away; queue 2 fails (a capsule shorter than a
    // command). Both reads stay at the disk past the close's grace.
    let mut failing = queues.pop().unwrap();
    drop(queues);
    failing.send_bytes(&[0; 16]);
    assert!(failing.completion().is_err(), "queue 2 outlived a capsule of 16 bytes");
    std::thread::sleep(TARGET_CLOSE_GRACE + Duration::from_millis(500));
    let before = process_cpu_ticks();
    std::thread::sleep(Duration::from_secs(3));
    let spent = process_cpu_ticks() - before;
    gate.release();
    assert!(spent < 30, "the target used {spent} ticks of CPU in 3 s with closed queues waiting for disk reads");

    // The reads end, then the queues: both queue ids can be connected again.
    for qid in [1, 2] {
        let until = Instant::now() + Duration::from_secs(10);
        let mut io = loop {
            let mut io = Host::connect(&url, qid, 32);
            match io.nvme_connect(&nqn, qid, cntlid) {
                Ok(_) => break io,
                Err(s) => assert!(Instant::now() < until, "I/O queue {qid} is still taken after the reads ended: {s:?}"),
            }
            std::thread::sleep(Duration::from_millis(50));
        };
        assert_eq!(io.rw(io_opcode::READ, 0, 1, io.keyed(0, BS), &[]).status, Status::SUCCESS, "queue {qid}: a read after the release");
        assert!(io.data()[..BS].iter().all(|&b| b == 0x5a), "queue {qid}: the read after the release");
    }
    drop(admin);
    t.shutdown().unwrap();
}

/// The deadlines of open queues (the transport keeps the earliest of them
/// and recomputes it only when one may have moved): a queue pair that
/// sends no Connect ends at `handshake_timeout`; an admin queue with a
/// keep-alive timeout lives on while Keep Alives come, each moving its
/// deadline, and ends that long after the last. Neither comes early or
/// late, and the target sleeps while it waits for them.
#[test]
fn handshake_and_keep_alive_deadlines_end_silent_queues_on_time() {
    let mut config = config_listening_on(&host_address());
    config.target.handshake_timeout = Duration::from_secs(1);
    let nqn = config.target.nqn.clone();
    let t = Target::start(config).unwrap();
    let url = t.nvme_listeners()[0].url.clone();
    let on_time = |what: &str, h: &mut Host, limit: Duration| {
        let (start, cpu0) = (Instant::now(), process_cpu_ticks());
        let end = h.completion_within(limit + Duration::from_secs(3));
        let (after, cpu) = (start.elapsed(), process_cpu_ticks() - cpu0);
        assert!(end.is_err(), "{what}: the queue pair outlived its deadline: {end:?}");
        assert!(after >= limit - Duration::from_millis(100), "{what}: the queue pair ended after {after:?}, before {limit:?}");
        assert!(after < limit + Duration::from_secs(2), "{what}: the queue pair ended after {after:?}, long after {limit:?}");
        assert!(cpu < 50 * (after.as_secs() + 1), "{what}: the target used {cpu} CPU ticks in {after:?} waiting for a deadline");
    };
    let mut silent = Host::connect(&url, 0, 32);
    on_time("no Connect", &mut silent, Duration::from_secs(1));

    let mut admin = Host::connect(&url, 0, 32);
    let mut d = [0u8; CONNECT_DATA_SIZE];
    ConnectData { host_id: [0x5a; 16], controller_id: 0xffff, subsystem_nqn: nqn.clone(), host_nqn: HOST_NQN.into() }.encode(&mut d).unwrap();
    admin.data()[..CONNECT_DATA_SIZE].copy_from_slice(&d);
    let mut e = Connect { recfmt: 0, qid: 0, sqsize: 31, cattr: 0, kato_ms: 1000 }.to_entry(admin.cid());
    e.set_sgl(admin.keyed(0, CONNECT_DATA_SIZE));
    assert_eq!(admin.exec(e, &[]).status, Status::SUCCESS, "Connect with KATO 1 s");
    admin.enable();
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_millis(2500) {
        std::thread::sleep(Duration::from_millis(300));
        let mut keep_alive = SubmissionEntry::new(admin_opcode::KEEP_ALIVE, admin.cid());
        keep_alive.set_sgl(NULL_SGL);
        assert_eq!(admin.exec(keep_alive, &[]).status, Status::SUCCESS, "Keep Alive {:?} after the Connect", t0.elapsed());
    }
    on_time("no Keep Alive", &mut admin, Duration::from_secs(1));
    t.shutdown().unwrap();
}

/// A work request that fails ends its queue with a warning that says, in
/// words, which work request and why (as rdmablk v1's do): a READ whose
/// data the host's key does not cover fails the target's RDMA WRITE.
#[test]
fn a_failed_work_request_is_logged_in_words() {
    let log = LogCapture::install();
    let (t, url, nqn) = target();
    let (_admin, mut io) = admin_and_io(&url, &nqn);
    let outside = Sgl::Keyed { addr: io.data_mr.addr() + DATA as u64 - 512, length: 4096, key: io.data_mr.rkey().0, invalidate: false };
    let mut read = SubmissionEntry::new(io_opcode::READ, io.cid());
    read.nsid = 1;
    read.set_rw(0, 8, false);
    read.set_sgl(outside);
    io.send(&read, &[]);
    assert!(io.completion().is_err(), "the host sees a transport error, not a completion");
    let lines = log.lines_with(" failed", Duration::from_secs(10));
    assert!(
        lines.iter().any(|l| l.contains(" WARN ") && l.contains("an RDMA WRITE failed: remote access error (bad rkey, range or rights)")),
        "no warning of the failed RDMA WRITE in words: {lines:#?}"
    );
    t.shutdown().unwrap();
}
