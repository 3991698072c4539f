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
use rdmablk_system_tests::BusyCpus;
use rdmablk_target::{Config, RunningTarget, Target};

const HOST_NQN: &str = "nqn.2014-08.org.example:rdma-host";
const RECVS: usize = 32;
const SEND_SLOTS: usize = 8;
const SEND_SLOT: usize = SQE_SIZE + 16384;
const DATA: usize = 1 << 20;
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
    let verbs_host = std::env::var("RDMABLK_NVME_RDMA_HOST").ok();
    let text = format!(
        "[target]\nname = \"rdma\"\nlisten = [\"nvme+rdma://{host}:0\"]\nshutdown_timeout = \"5s\"\n\
         [[volume]]\nname = \"v\"\nbackend = \"memory\"\nsize = \"4MiB\"\nblock_size = 512\nallow_any_host = true\n"
    );
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
    done: VecDeque<(CompletionEntry, Option<Rkey>)>,
}

impl Host {
    /// Connects a queue with `request` as the rdma_cm private data; the
    /// accept's private data, or the error.
    fn connect_raw(url: &FabricUrl, request: &[u8]) -> Result<(Host, Vec<u8>), String> {
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
            done: VecDeque::new(),
        };
        for i in 0..RECVS {
            h.post_recv(i);
        }
        let reply = h.qp.connect_raw(request, Duration::from_secs(5)).map_err(|e| e.to_string())?;
        Ok((h, reply))
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

    /// Sends raw capsule bytes.
    fn send_bytes(&mut self, bytes: &[u8]) {
        assert!(bytes.len() <= SEND_SLOT);
        let slot = self.next_slot;
        self.next_slot = (slot + 1) % SEND_SLOTS;
        // SAFETY: the slot's previous SEND was copied at post time by the
        // tcp provider; the slot is not in use.
        let buf = unsafe { &mut self.send_buf.as_mut_slice()[slot * SEND_SLOT..slot * SEND_SLOT + bytes.len()] };
        buf.copy_from_slice(bytes);
        let sge = self.send_mr.sge(slot * SEND_SLOT, bytes.len() as u32);
        let wr = SendWr { wr_id: WrId(1000 + slot as u64), op: SendOp::Send, payload: Payload::Sges(&[sge]), signaled: true };
        self.qp.post_send(&[wr]).unwrap();
    }

    /// Sends a command with its in-capsule data.
    fn send(&mut self, sqe: &SubmissionEntry, in_capsule: &[u8]) {
        let mut bytes = sqe.to_bytes().to_vec();
        bytes.extend_from_slice(in_capsule);
        self.send_bytes(&bytes);
    }

    /// The next completion and the key its SEND invalidated, or the status
    /// of the failure that ended the queue pair instead.
    fn completion(&mut self) -> Result<(CompletionEntry, Option<Rkey>), WcStatus> {
        let deadline = Instant::now() + Duration::from_secs(20);
        let mut wcs = [Completion::EMPTY; 16];
        loop {
            if let Some(c) = self.done.pop_front() {
                return Ok(c);
            }
            let n = self.cq.poll(&mut wcs).unwrap();
            let mut failed = None;
            for wc in &wcs[..n] {
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
            if let Some(status) = failed {
                return self.done.pop_front().ok_or(status);
            }
            if n > 0 {
                continue;
            }
            assert!(Instant::now() < deadline, "no completion within 20 s");
            self.cq.wait(Some(Duration::from_millis(50))).unwrap();
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
    /// Installs the capture as the process's subscriber (at INFO).
    fn install() -> LogCapture {
        let capture = LogCapture::default();
        let writer = capture.clone();
        tracing_subscriber::fmt()
            .with_ansi(false)
            .with_max_level(tracing::Level::INFO)
            .with_writer(move || writer.clone())
            .try_init()
            .expect("no other subscriber in this test");
        capture
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
