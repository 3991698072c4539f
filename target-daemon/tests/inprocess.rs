//! In-process tests: a target started with `Target::start` on port 0 and a
//! minimal initiator written directly against the fabric API.

use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use rdmablk_common::fabric::{
    Access, AlignedBuf, Completion, CompletionQueue, Fabric, FabricUrl, MemoryRegion, Payload, ProtectionDomain,
    QpCaps, QpState, QueuePair, RecvWr, SendOp, SendWr, WcOpcode, WcStatus, WrId,
};
use rdmablk_common::protocol::{
    BlockCount, CommandCapsule, CommandId, ConnectReply, DataDescriptor, Lba, Opcode, ResponseCapsule, Status,
    VolumeId, VolumeInfo, COMMAND_CAPSULE_SIZE, FLAG_FUA, FLAG_INLINE_DATA, PROTOCOL_VERSION, RESPONSE_SLOT_SIZE,
    VOLUME_FLAG_DISCARD, VOLUME_FLAG_READ_ONLY, VOLUME_FLAG_WRITE_ZEROES, VOLUME_INFO_SIZE,
};
use rdmablk_target::{Config, RunningTarget, Target};

const RECVS: usize = 16;
const SEND_SLOT: usize = 8192;
const DATA: usize = 4 << 20;

/// A minimal initiator: one queue pair, a registered receive area, a
/// registered send area, and a registered data area the target may read
/// and write.
struct Client {
    // Field order is drop order: queue pair, regions, buffers, CQ, PD.
    qp: QueuePair,
    recv_mr: MemoryRegion,
    send_mr: MemoryRegion,
    data_mr: MemoryRegion,
    recv_buf: AlignedBuf,
    send_buf: AlignedBuf,
    data: AlignedBuf,
    cq: CompletionQueue,
    _pd: ProtectionDomain,
    _fabric: Fabric,
    next_cid: u16,
    sends_outstanding: usize,
    responses: std::collections::VecDeque<(ResponseCapsule, Vec<u8>)>,
}

impl Client {
    fn connect(url: &FabricUrl) -> Client {
        let fabric = Fabric::open(url).unwrap();
        let pd = fabric.alloc_pd().unwrap();
        let cq = fabric.create_cq(256).unwrap();
        let caps = QpCaps { max_send_wr: 64, max_recv_wr: RECVS as u32, max_send_sge: 2, max_recv_sge: 1, max_inline_data: 256 };
        let qp = fabric.create_qp(&pd, &cq, caps).unwrap();
        let recv_buf = AlignedBuf::new(RECVS * RESPONSE_SLOT_SIZE, 4096);
        let send_buf = AlignedBuf::new(8 * SEND_SLOT, 4096);
        let data = AlignedBuf::new(DATA, 4096);
        // SAFETY: the buffers outlive their regions (field order) and are only
        // touched by the test while no work request uses them.
        let (recv_mr, send_mr, data_mr) = unsafe {
            (
                pd.register(recv_buf.as_ptr(), recv_buf.len(), Access::LOCAL_WRITE).unwrap(),
                pd.register(send_buf.as_ptr(), send_buf.len(), Access::NONE).unwrap(),
                pd.register(data.as_ptr(), data.len(), Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ)
                    .unwrap(),
            )
        };
        let c = Client {
            qp,
            recv_mr,
            send_mr,
            data_mr,
            recv_buf,
            send_buf,
            data,
            cq,
            _pd: pd,
            _fabric: fabric,
            next_cid: 1,
            sends_outstanding: 0,
            responses: Default::default(),
        };
        for i in 0..RECVS {
            c.post_recv(i);
        }
        c.qp.connect(&[], Duration::from_secs(5)).unwrap();
        c
    }

    fn post_recv(&self, i: usize) {
        let sge = self.recv_mr.sge(i * RESPONSE_SLOT_SIZE, RESPONSE_SLOT_SIZE as u32);
        self.qp.post_recv(&[RecvWr { wr_id: WrId(i as u64), sges: &[sge] }]).unwrap();
    }

    #[allow(clippy::mut_from_ref)]
    fn data(&self) -> &mut [u8] {
        // SAFETY: only called while no command using the data area is in flight.
        unsafe { self.data.as_mut_slice() }
    }

    fn desc(&self, off: usize, len: usize) -> DataDescriptor {
        DataDescriptor { remote_addr: self.data_mr.addr() + off as u64, length: len as u32, rkey: self.data_mr.rkey().0 }
    }

    fn cid(&mut self) -> CommandId {
        self.next_cid = self.next_cid.wrapping_add(1);
        CommandId(self.next_cid)
    }

    /// Posts a command from send slot `slot` without waiting.
    fn post(&mut self, slot: usize, cap: &CommandCapsule, inline: &[u8]) {
        let mut cap = *cap;
        cap.inline_len = inline.len() as u32;
        let len = COMMAND_CAPSULE_SIZE + inline.len();
        assert!(len <= SEND_SLOT);
        // SAFETY: the send slot is not in use by a posted work request (the
        // provider copies SEND payloads at post time).
        let buf = unsafe { &mut self.send_buf.as_mut_slice()[slot * SEND_SLOT..slot * SEND_SLOT + len] };
        buf[..COMMAND_CAPSULE_SIZE].copy_from_slice(&cap.to_bytes());
        buf[COMMAND_CAPSULE_SIZE..].copy_from_slice(inline);
        let sge = self.send_mr.sge(slot * SEND_SLOT, len as u32);
        self.qp
            .post_send(&[SendWr { wr_id: WrId(1000 + slot as u64), op: SendOp::Send, payload: Payload::Sges(&[sge]), signaled: true }])
            .unwrap();
        self.sends_outstanding += 1;
    }

    /// Waits for the next response, polling the CQ (which also drives the
    /// target's RDMA into our memory).
    fn response(&mut self) -> (ResponseCapsule, Vec<u8>) {
        let deadline = Instant::now() + Duration::from_secs(20);
        let mut wcs = [Completion::EMPTY; 16];
        loop {
            if let Some(g) = self.responses.pop_front() {
                return g;
            }
            let n = self.cq.poll(&mut wcs).unwrap();
            let mut failed = None;
            for wc in &wcs[..n] {
                match wc.opcode {
                    // Responses that arrived before the failure still count.
                    _ if wc.status != WcStatus::Success => failed = failed.or(Some(*wc)),
                    WcOpcode::Recv => {
                        let i = wc.wr_id.0 as usize;
                        // SAFETY: the receive completed; the slot is ours until re-posted.
                        let slot = unsafe { &self.recv_buf.as_slice()[i * RESPONSE_SLOT_SIZE..(i + 1) * RESPONSE_SLOT_SIZE] };
                        let msg = &slot[..wc.byte_len as usize];
                        let r = ResponseCapsule::decode(msg).unwrap();
                        self.responses.push_back((r, msg[32..].to_vec()));
                        self.post_recv(i);
                    }
                    WcOpcode::Send => self.sends_outstanding -= 1,
                    _ => panic!("unexpected completion {wc:?}"),
                }
            }
            if let Some(wc) = failed {
                if let Some(g) = self.responses.pop_front() {
                    return g;
                }
                panic!("initiator completion failed: {wc:?}");
            }
            if n > 0 {
                continue;
            }
            assert!(Instant::now() < deadline, "no response within 20s");
            if n == 0 {
                self.cq.wait(Some(Duration::from_millis(100))).unwrap();
            }
        }
    }

    fn call(&mut self, cap: CommandCapsule, inline: &[u8]) -> (ResponseCapsule, Vec<u8>) {
        self.post(0, &cap, inline);
        let (r, d) = self.response();
        assert_eq!(r.command_id, cap.command_id);
        (r, d)
    }

    fn connect_cmd(&mut self, qd: u32, max_io: u32) -> (ResponseCapsule, Vec<u8>) {
        let mut c = CommandCapsule::new(Opcode::Connect, self.cid());
        c.version = PROTOCOL_VERSION;
        c.queue_depth = qd;
        c.max_io_size = max_io;
        self.call(c, b"test-host")
    }

    fn open(&mut self, name: &str) -> (ResponseCapsule, Vec<u8>) {
        let c = CommandCapsule::new(Opcode::OpenVolume, self.cid());
        self.call(c, name.as_bytes())
    }

    fn io(&mut self, op: Opcode, vol: u32, lba: u64, blocks: u32, desc: DataDescriptor) -> CommandCapsule {
        let mut c = CommandCapsule::new(op, self.cid());
        c.volume_id = VolumeId(vol);
        c.start_block = Lba(lba);
        c.block_count = BlockCount(blocks);
        c.descriptor = desc;
        c
    }
}

fn config(dir: &Path, extra_target: &str, volumes: &str) -> Config {
    let text = format!(
        "[target]\nname = \"itest\"\nlisten = [\"tcp://127.0.0.1:0\"]\nreactors = 2\nqueue_depth = 8\nmax_io_size = \"1MiB\"\ninline_data_size = \"4KiB\"\nbuffer_pool = \"512KiB\"\nchunk_size = \"64KiB\"\nshutdown_timeout = \"5s\"\n{extra_target}\n{volumes}"
    );
    let text = text.replace("@DIR@", dir.to_str().unwrap());
    Config::parse(&text, "itest.toml").unwrap()
}

const VOLUMES: &str = r#"
[[volume]]
name = "vol0"
backend = "file"
allow_any_host = true
path = "@DIR@/vol0.img"
size = "16MiB"

[[volume]]
name = "ro"
backend = "file"
allow_any_host = true
path = "@DIR@/ro.img"
read_only = true
"#;

fn init_logs() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()))
        .with_test_writer()
        .try_init();
}

fn setup() -> (tempfile::TempDir, RunningTarget) {
    init_logs();
    let dir = tempfile::tempdir_in("/tmp").unwrap();
    let ro = dir.path().join("ro.img");
    std::fs::write(&ro, vec![0x77u8; 1 << 20]).unwrap();
    let t = Target::start(config(dir.path(), "", VOLUMES)).unwrap();
    (dir, t)
}

fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

fn file_bytes(path: &PathBuf, off: u64, len: usize) -> Vec<u8> {
    let f = std::fs::File::open(path).unwrap();
    let mut v = vec![0u8; len];
    f.read_exact_at(&mut v, off).unwrap();
    v
}

#[test]
fn connect_open_write_read_roundtrip() {
    let (dir, target) = setup();
    assert_eq!(target.urls().len(), 1);
    assert_ne!(target.url().port, 0);
    let mut c = Client::connect(target.url());

    // Before CONNECT.
    let k = CommandCapsule::new(Opcode::KeepAlive, c.cid());
    assert_eq!(c.call(k, b"").0.status, Status::NotConnected);

    // CONNECT negotiates down to the target's limits.
    let (r, d) = c.connect_cmd(1000, 8 << 20);
    assert_eq!(r.status, Status::Success, "{r:?}");
    let reply = ConnectReply::decode(&d).unwrap();
    assert_eq!(reply.version, PROTOCOL_VERSION);
    assert_eq!(reply.queue_depth, 8);
    assert_eq!(reply.max_io_size, 1 << 20);
    assert_eq!(reply.inline_data_size, 4096);
    assert_eq!(reply.target_name, "itest");
    assert_eq!(c.connect_cmd(8, 4096).0.status, Status::AlreadyConnected);

    // LIST_VOLUMES into our memory.
    let desc = c.desc(0, 4 * VOLUME_INFO_SIZE);
    let mut l = CommandCapsule::new(Opcode::ListVolumes, c.cid());
    l.descriptor = desc;
    let (r, _) = c.call(l, b"");
    assert_eq!((r.status, r.result), (Status::Success, 2));
    let v0 = VolumeInfo::decode(&c.data()[..VOLUME_INFO_SIZE]).unwrap();
    let v1 = VolumeInfo::decode(&c.data()[VOLUME_INFO_SIZE..2 * VOLUME_INFO_SIZE]).unwrap();
    assert_eq!((v0.name.as_str(), v0.size_bytes, v0.block_size), ("vol0", 16 << 20, 4096));
    assert!(v0.flags & VOLUME_FLAG_DISCARD != 0);
    assert_eq!((v1.name.as_str(), v1.flags & VOLUME_FLAG_READ_ONLY), ("ro", VOLUME_FLAG_READ_ONLY));
    // Descriptor with room for one entry only.
    let mut l = CommandCapsule::new(Opcode::ListVolumes, c.cid());
    l.descriptor = c.desc(8192, VOLUME_INFO_SIZE + 10);
    c.data()[8192 + VOLUME_INFO_SIZE..8192 + 2 * VOLUME_INFO_SIZE].fill(0xee);
    let (r, _) = c.call(l, b"");
    assert_eq!((r.status, r.result), (Status::Success, 2));
    assert!(c.data()[8192 + VOLUME_INFO_SIZE..8192 + 2 * VOLUME_INFO_SIZE].iter().all(|&b| b == 0xee));

    // OPEN.
    assert_eq!(c.open("nope").0.status, Status::UnknownVolume);
    let (r, d) = c.open("vol0");
    assert_eq!(r.status, Status::Success);
    let info = VolumeInfo::decode(&d).unwrap();
    assert_eq!(r.result, info.volume_id.0 as u64);
    let vol = info.volume_id.0;

    // WRITE 1 MiB through the descriptor (16 chunks of 64 KiB; the pool has 8).
    let data = pattern(1, 1 << 20);
    c.data()[..1 << 20].copy_from_slice(&data);
    let w = c.io(Opcode::Write, vol, 16, 256, c.desc(0, 1 << 20));
    let (r, _) = c.call(w, b"");
    assert_eq!(r.status, Status::Success, "{r:?}");
    assert_eq!(file_bytes(&dir.path().join("vol0.img"), 16 * 4096, 1 << 20), data);

    // READ it back into another part of our memory.
    c.data()[2 << 20..3 << 20].fill(0);
    let rd = c.io(Opcode::Read, vol, 16, 256, c.desc(2 << 20, 1 << 20));
    let (r, _) = c.call(rd, b"");
    assert_eq!(r.status, Status::Success, "{r:?}");
    assert!(c.data()[2 << 20..3 << 20] == data[..], "read data differs");

    // Odd sizes: 3 blocks at the very end of the volume.
    let tail = pattern(2, 3 * 4096);
    c.data()[..tail.len()].copy_from_slice(&tail);
    let mut w = c.io(Opcode::Write, vol, 4096 - 3, 3, c.desc(0, tail.len()));
    w.flags = FLAG_FUA;
    assert_eq!(c.call(w, b"").0.status, Status::Success);
    let rd = c.io(Opcode::Read, vol, 4096 - 3, 3, c.desc(1 << 20, tail.len()));
    assert_eq!(c.call(rd, b"").0.status, Status::Success);
    assert!(c.data()[1 << 20..(1 << 20) + tail.len()] == tail[..]);

    // Inline WRITE.
    let small = pattern(3, 4096);
    let mut w = c.io(Opcode::Write, vol, 1, 1, DataDescriptor::default());
    w.flags = FLAG_INLINE_DATA;
    assert_eq!(c.call(w, &small).0.status, Status::Success);
    assert_eq!(file_bytes(&dir.path().join("vol0.img"), 4096, 4096), small);

    // FLUSH, DISCARD, WRITE_ZEROES.
    let f = c.io(Opcode::Flush, vol, 0, 0, DataDescriptor::default());
    assert_eq!(c.call(f, b"").0.status, Status::Success);
    let z = c.io(Opcode::WriteZeroes, vol, 16, 2, DataDescriptor::default());
    assert_eq!(c.call(z, b"").0.status, Status::Success);
    let d = c.io(Opcode::Discard, vol, 18, 2, DataDescriptor::default());
    assert_eq!(c.call(d, b"").0.status, Status::Success);
    assert!(file_bytes(&dir.path().join("vol0.img"), 16 * 4096, 4 * 4096).iter().all(|&b| b == 0));
    assert_eq!(file_bytes(&dir.path().join("vol0.img"), 20 * 4096, 4096), data[4 * 4096..5 * 4096]);

    // Errors, each with its own status, none touching the disk.
    let cases = [
        (c.io(Opcode::Read, vol, 4096, 1, c.desc(0, 4096)), Status::OutOfRange),
        (c.io(Opcode::Read, vol, 0, 1, c.desc(0, 1000)), Status::Misaligned),
        (c.io(Opcode::Read, vol, 0, 2, c.desc(0, 4096)), Status::LengthMismatch),
        (c.io(Opcode::Read, vol, 0, 512, c.desc(0, 2 << 20)), Status::TooLarge),
        (c.io(Opcode::Read, vol, 0, 0, c.desc(0, 0)), Status::ZeroLength),
        (c.io(Opcode::Read, 99, 0, 1, c.desc(0, 4096)), Status::UnknownVolume),
        (c.io(Opcode::Read, 2, 0, 1, c.desc(0, 4096)), Status::VolumeNotOpen),
    ];
    for (cap, want) in cases {
        let (r, _) = c.call(cap, b"");
        assert_eq!(r.status, want, "{cap:?}");
    }
    let mut bad = CommandCapsule::new(Opcode::KeepAlive, c.cid()).to_bytes();
    bad[0] = 0x7f;
    c.post(0, &CommandCapsule::new(Opcode::KeepAlive, CommandId(0)), b"");
    let _ = c.response();
    // Raw invalid opcode.
    {
        // SAFETY: slot 1 is not in use.
        let buf = unsafe { &mut c.send_buf.as_mut_slice()[SEND_SLOT..SEND_SLOT + 64] };
        buf.copy_from_slice(&bad);
        let sge = c.send_mr.sge(SEND_SLOT, 64);
        c.qp.post_send(&[SendWr { wr_id: WrId(77), op: SendOp::Send, payload: Payload::Sges(&[sge]), signaled: true }]).unwrap();
        c.sends_outstanding += 1;
        let (r, _) = c.response();
        assert_eq!(r.status, Status::InvalidOpcode);
    }

    // Read-only volume.
    let (r, d) = c.open("ro");
    assert_eq!(r.status, Status::Success);
    let ro = VolumeInfo::decode(&d).unwrap();
    let w = c.io(Opcode::Write, ro.volume_id.0, 0, 1, c.desc(0, 4096));
    assert_eq!(c.call(w, b"").0.status, Status::ReadOnly);
    let rd = c.io(Opcode::Read, ro.volume_id.0, 0, 1, c.desc(0, 4096));
    assert_eq!(c.call(rd, b"").0.status, Status::Success);
    assert!(c.data()[..4096].iter().all(|&b| b == 0x77));

    // CLOSE, then I/O is refused.
    let mut cl = CommandCapsule::new(Opcode::CloseVolume, c.cid());
    cl.volume_id = VolumeId(vol);
    assert_eq!(c.call(cl, b"").0.status, Status::Success);
    let rd = c.io(Opcode::Read, vol, 0, 1, c.desc(0, 4096));
    assert_eq!(c.call(rd, b"").0.status, Status::VolumeNotOpen);

    drop(c);
    target.shutdown().unwrap();
}

#[test]
fn pipelined_commands_share_a_small_pool() {
    let (dir, target) = setup();
    let mut c = Client::connect(target.url());
    assert_eq!(c.connect_cmd(8, 1 << 20).0.status, Status::Success);
    let vol = VolumeInfo::decode(&c.open("vol0").1).unwrap().volume_id.0;
    // Four 1 MiB writes in flight at once need 64 chunks; the pool has 8.
    let data = pattern(9, 4 << 20);
    c.data().copy_from_slice(&data);
    let mut ids = Vec::new();
    for i in 0..4usize {
        let w = c.io(Opcode::Write, vol, (i * 256) as u64, 256, c.desc(i << 20, 1 << 20));
        ids.push(w.command_id);
        c.post(i, &w, b"");
    }
    let mut seen = Vec::new();
    for _ in 0..4 {
        let (r, _) = c.response();
        assert_eq!(r.status, Status::Success, "{r:?}");
        seen.push(r.command_id);
    }
    seen.sort();
    ids.sort();
    assert_eq!(seen, ids);
    assert_eq!(file_bytes(&dir.path().join("vol0.img"), 0, 4 << 20), data);
    // And four reads in flight.
    c.data().fill(0);
    for i in 0..4usize {
        let rd = c.io(Opcode::Read, vol, (i * 256) as u64, 256, c.desc(i << 20, 1 << 20));
        c.post(i, &rd, b"");
    }
    for _ in 0..4 {
        assert_eq!(c.response().0.status, Status::Success);
    }
    assert!(c.data()[..] == data[..]);
    drop(c);
    target.shutdown().unwrap();
}

#[test]
fn bad_rkey_tears_down_only_that_session() {
    let (_dir, target) = setup();
    let mut a = Client::connect(target.url());
    let mut b = Client::connect(target.url());
    for c in [&mut a, &mut b] {
        assert_eq!(c.connect_cmd(8, 1 << 20).0.status, Status::Success);
        assert_eq!(c.open("vol0").0.status, Status::Success);
    }
    // A WRITE whose descriptor names a bad rkey: the target's RDMA READ fails.
    let mut desc = a.desc(0, 4096);
    desc.rkey ^= 0xdead;
    let w = a.io(Opcode::Write, 1, 0, 1, desc);
    a.post(0, &w, b"");
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut wcs = [Completion::EMPTY; 16];
    while a.qp.state() != QpState::Error {
        let _ = a.cq.poll(&mut wcs).unwrap();
        assert!(Instant::now() < deadline, "queue pair of the faulty session never failed");
        std::thread::sleep(Duration::from_millis(1));
    }
    // The other session still works.
    b.data()[..4096].fill(0x42);
    let w = b.io(Opcode::Write, 1, 3, 1, b.desc(0, 4096));
    assert_eq!(b.call(w, b"").0.status, Status::Success);
    let rd = b.io(Opcode::Read, 1, 3, 1, b.desc(8192, 4096));
    assert_eq!(b.call(rd, b"").0.status, Status::Success);
    assert!(b.data()[8192..12288].iter().all(|&x| x == 0x42));
    // And new sessions are accepted.
    let mut c = Client::connect(target.url());
    assert_eq!(c.connect_cmd(8, 1 << 20).0.status, Status::Success);
    drop((a, b, c));
    target.shutdown().unwrap();
}

#[test]
fn version_mismatch_and_queue_full() {
    let (_dir, target) = setup();
    let mut c = Client::connect(target.url());
    let mut k = CommandCapsule::new(Opcode::Connect, c.cid());
    k.version = PROTOCOL_VERSION + 1;
    k.queue_depth = 2;
    k.max_io_size = 4096;
    let (r, _) = c.call(k, b"old-host");
    assert_eq!((r.status, r.detail), (Status::VersionMismatch, PROTOCOL_VERSION as u32));
    // Negotiate a queue depth of 2, then send 4 writes at once. The first two
    // cannot finish before we poll (their RDMA READs need our progress), so
    // the last two find the queue full.
    assert_eq!(c.connect_cmd(2, 4096).0.status, Status::Success);
    let vol = VolumeInfo::decode(&c.open("vol0").1).unwrap().volume_id.0;
    let mut ids = Vec::new();
    for i in 0..4usize {
        let w = c.io(Opcode::Write, vol, i as u64, 1, c.desc(i * 4096, 4096));
        ids.push(w.command_id);
        c.post(i, &w, b"");
    }
    std::thread::sleep(Duration::from_millis(50));
    let mut got: Vec<(CommandId, Status)> = (0..4).map(|_| c.response().0).map(|r| (r.command_id, r.status)).collect();
    got.sort_by_key(|g| g.0);
    let want: Vec<(CommandId, Status)> =
        ids.iter().zip([Status::Success, Status::Success, Status::QueueFull, Status::QueueFull]).map(|(&i, s)| (i, s)).collect();
    assert_eq!(got, want);
    drop(c);
    target.shutdown().unwrap();
}

#[test]
fn shutdown_with_idle_sessions_and_restart_on_same_files() {
    let (dir, target) = setup();
    let mut c = Client::connect(target.url());
    assert_eq!(c.connect_cmd(8, 1 << 20).0.status, Status::Success);
    let vol = VolumeInfo::decode(&c.open("vol0").1).unwrap().volume_id.0;
    let data = pattern(5, 65536);
    c.data()[..65536].copy_from_slice(&data);
    let w = c.io(Opcode::Write, vol, 100, 16, c.desc(0, 65536));
    assert_eq!(c.call(w, b"").0.status, Status::Success);
    // Shut down while the session is still connected.
    let t0 = Instant::now();
    target.shutdown().unwrap();
    assert!(t0.elapsed() < Duration::from_secs(5), "shutdown took {:?}", t0.elapsed());
    drop(c);
    // The same files serve again with the data in place.
    let t = Target::start(config(dir.path(), "", VOLUMES)).unwrap();
    let mut c = Client::connect(t.url());
    assert_eq!(c.connect_cmd(8, 1 << 20).0.status, Status::Success);
    let vol = VolumeInfo::decode(&c.open("vol0").1).unwrap().volume_id.0;
    let rd = c.io(Opcode::Read, vol, 100, 16, c.desc(65536, 65536));
    assert_eq!(c.call(rd, b"").0.status, Status::Success);
    assert!(c.data()[65536..131072] == data[..]);
    drop(c);
    t.shutdown().unwrap();
}

#[test]
fn sqpoll_and_pinned_reactors() {
    init_logs();
    let dir = tempfile::tempdir_in("/tmp").unwrap();
    std::fs::write(dir.path().join("ro.img"), vec![0u8; 1 << 20]).unwrap();
    let t = Target::start(config(dir.path(), "sqpoll = true\npin_reactors = true", VOLUMES)).unwrap();
    let mut c = Client::connect(t.url());
    assert_eq!(c.connect_cmd(8, 1 << 20).0.status, Status::Success);
    let vol = VolumeInfo::decode(&c.open("vol0").1).unwrap().volume_id.0;
    let data = pattern(11, 256 << 10);
    c.data()[..data.len()].copy_from_slice(&data);
    let w = c.io(Opcode::Write, vol, 7, 64, c.desc(0, data.len()));
    assert_eq!(c.call(w, b"").0.status, Status::Success);
    let rd = c.io(Opcode::Read, vol, 7, 64, c.desc(1 << 20, data.len()));
    assert_eq!(c.call(rd, b"").0.status, Status::Success);
    assert!(c.data()[1 << 20..(1 << 20) + data.len()] == data[..]);
    drop(c);
    t.shutdown().unwrap();
}

#[test]
fn shutdown_lets_in_flight_commands_finish() {
    let (dir, target) = setup();
    let mut c = Client::connect(target.url());
    assert_eq!(c.connect_cmd(8, 1 << 20).0.status, Status::Success);
    let vol = VolumeInfo::decode(&c.open("vol0").1).unwrap().volume_id.0;
    let data = pattern(21, 4 << 20);
    c.data().copy_from_slice(&data);
    for i in 0..4usize {
        let w = c.io(Opcode::Write, vol, (i * 256) as u64, 256, c.desc(i << 20, 1 << 20));
        c.post(i, &w, b"");
    }
    // The target has the capsules and waits for its RDMA READs, which need
    // our polling to be served: the writes are in flight while we sleep.
    std::thread::sleep(Duration::from_millis(50));
    let stop = target.stop_handle();
    stop.stop();
    let waiter = std::thread::spawn(move || target.shutdown());
    for _ in 0..4 {
        let (r, _) = c.response();
        assert!(r.status == Status::Success, "{r:?}");
    }
    // Then the target disconnects us and finishes.
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut wcs = [Completion::EMPTY; 16];
    while c.qp.state() != QpState::Error {
        let _ = c.cq.poll(&mut wcs);
        assert!(Instant::now() < deadline, "not disconnected after shutdown");
        std::thread::sleep(Duration::from_millis(1));
    }
    waiter.join().unwrap().unwrap();
    assert_eq!(file_bytes(&dir.path().join("vol0.img"), 0, 4 << 20), data);
}

#[test]
fn initiator_vanishing_mid_io_leaves_nothing_behind() {
    let (_dir, target) = setup();
    for op in [Opcode::Write, Opcode::Read] {
        let mut c = Client::connect(target.url());
        assert_eq!(c.connect_cmd(8, 1 << 20).0.status, Status::Success);
        let vol = VolumeInfo::decode(&c.open("vol0").1).unwrap().volume_id.0;
        for i in 0..4usize {
            let cap = c.io(op, vol, (i * 256) as u64, 256, c.desc(i << 20, 1 << 20));
            c.post(i, &cap, b"");
        }
        // Let the target start (its RDMA needs our polling, which we never do).
        std::thread::sleep(Duration::from_millis(50));
        drop(c);
    }
    // The target still serves new sessions with the whole pool.
    let mut c = Client::connect(target.url());
    assert_eq!(c.connect_cmd(8, 1 << 20).0.status, Status::Success);
    let vol = VolumeInfo::decode(&c.open("vol0").1).unwrap().volume_id.0;
    let data = pattern(31, 1 << 20);
    c.data()[..1 << 20].copy_from_slice(&data);
    let w = c.io(Opcode::Write, vol, 0, 256, c.desc(0, 1 << 20));
    assert_eq!(c.call(w, b"").0.status, Status::Success);
    drop(c);
    // Every queue pair flushed and every chunk came back: shutdown does not
    // wait for the forced-teardown timeout.
    let t0 = Instant::now();
    target.shutdown().unwrap();
    assert!(t0.elapsed() < Duration::from_secs(3), "shutdown took {:?}", t0.elapsed());
}

#[test]
fn block_device_volume_via_loop() {
    // Needs root and losetup; skipped otherwise.
    init_logs();
    let dir = tempfile::tempdir_in("/tmp").unwrap();
    let img = dir.path().join("loop.img");
    std::fs::File::create(&img).unwrap().set_len(8 << 20).unwrap();
    let Ok(out) = std::process::Command::new("losetup").args(["--find", "--show"]).arg(&img).output() else { return };
    if !out.status.success() {
        eprintln!("skipping: losetup failed: {}", String::from_utf8_lossy(&out.stderr));
        return;
    }
    let dev = String::from_utf8_lossy(&out.stdout).trim().to_owned();
    struct Detach(String);
    impl Drop for Detach {
        fn drop(&mut self) {
            let _ = std::process::Command::new("losetup").arg("-d").arg(&self.0).status();
        }
    }
    let _guard = Detach(dev.clone());
    let vols = format!("[[volume]]\nname = \"blk\"\nbackend = \"file\"\nallow_any_host = true\npath = \"{dev}\"\n");
    let t = Target::start(config(dir.path(), "", &vols)).unwrap();
    let mut c = Client::connect(t.url());
    assert_eq!(c.connect_cmd(8, 1 << 20).0.status, Status::Success);
    let (r, d) = c.open("blk");
    assert_eq!(r.status, Status::Success);
    let info = VolumeInfo::decode(&d).unwrap();
    assert_eq!(info.size_bytes, 8 << 20);
    // A loop device on ext4 discards (BLKDISCARD); BLKZEROOUT always works.
    assert_eq!(info.flags, VOLUME_FLAG_DISCARD | VOLUME_FLAG_WRITE_ZEROES);
    let bs = info.block_size as usize;
    let vol = info.volume_id.0;
    let data = pattern(41, 64 * bs);
    c.data()[..data.len()].copy_from_slice(&data);
    let w = c.io(Opcode::Write, vol, 5, 64, c.desc(0, data.len()));
    assert_eq!(c.call(w, b"").0.status, Status::Success);
    let rd = c.io(Opcode::Read, vol, 5, 64, c.desc(1 << 20, data.len()));
    assert_eq!(c.call(rd, b"").0.status, Status::Success);
    assert!(c.data()[1 << 20..(1 << 20) + data.len()] == data[..]);
    // WRITE_ZEROES (BLKZEROOUT on the blocking worker) over blocks 5..9,
    // DISCARD (BLKDISCARD) over blocks 60..62: both succeed, and the zeroed
    // blocks read back as zeroes while the others keep their data.
    let z = c.io(Opcode::WriteZeroes, vol, 5, 4, DataDescriptor::default());
    assert_eq!(c.call(z, b"").0.status, Status::Success);
    let d = c.io(Opcode::Discard, vol, 60, 2, DataDescriptor::default());
    assert_eq!(c.call(d, b"").0.status, Status::Success);
    let rd = c.io(Opcode::Read, vol, 5, 8, c.desc(2 << 20, 8 * bs));
    assert_eq!(c.call(rd, b"").0.status, Status::Success);
    assert!(c.data()[2 << 20..(2 << 20) + 4 * bs].iter().all(|&b| b == 0), "WRITE_ZEROES left data");
    assert!(c.data()[(2 << 20) + 4 * bs..(2 << 20) + 8 * bs] == data[4 * bs..8 * bs]);
    let f = c.io(Opcode::Flush, vol, 0, 0, DataDescriptor::default());
    assert_eq!(c.call(f, b"").0.status, Status::Success);
    drop(c);
    t.shutdown().unwrap();
    let mut want = data.clone();
    want[..4 * bs].fill(0);
    assert_eq!(file_bytes(&img, 5 * bs as u64, 55 * bs), want[..55 * bs]);
}

#[test]
fn reload_through_the_library_replaces_unused_volumes_and_refuses_used_ones() {
    init_logs();
    let dir = tempfile::tempdir_in("/tmp").unwrap();
    let text = |vols: &str| {
        format!("[target]\nlisten = [\"tcp://127.0.0.1:0\"]\nreactors = 2\nbuffer_pool = \"1MiB\"\n{vols}")
            .replace("@DIR@", dir.path().to_str().unwrap())
    };
    let vol = |name: &str, file: &str, size: &str| {
        format!("[[volume]]\nname = \"{name}\"\nbackend = \"file\"\nallow_any_host = true\npath = \"@DIR@/{file}\"\nsize = \"{size}\"\n")
    };
    let t = Target::start(Config::parse(&text(&format!("{}{}", vol("a", "a.img", "1MiB"), vol("b", "b.img", "1MiB"))), "r.toml").unwrap()).unwrap();
    let before = t.volumes();
    let mut c = Client::connect(t.url());
    assert_eq!(c.connect_cmd(8, 1 << 20).0.status, Status::Success);
    assert_eq!(c.open("a").0.status, Status::Success);
    let sessions = t.sessions();
    assert_eq!(sessions.len(), 1);
    assert_eq!(sessions[0].host_id, "test-host");
    assert_eq!(sessions[0].open, vec![before[0].1]);

    // Both change size: "b" is unused and is reopened with a new id; "a" is open and stays.
    let cfg = Config::parse(&text(&format!("{}{}", vol("a", "a.img", "2MiB"), vol("b", "b.img", "2MiB"))), "r.toml").unwrap();
    let s = t.reload(cfg).unwrap();
    assert_eq!(s.replaced, vec!["b".to_owned()]);
    assert_eq!(s.refused.len(), 1);
    assert_eq!(s.refused[0].0, "a");
    assert!(s.refused[0].1.contains("size changed but it is open by test-host"), "{:?}", s.refused);
    let after = t.volumes();
    assert_eq!(after[0], before[0], "a untouched");
    assert_eq!(after[1].0, "b");
    assert!(after[1].1 .0 > before[1].1 .0, "a replaced volume gets a new id");
    // The reopened "b" is 2 MiB: block 300 is in range now.
    assert_eq!(c.open("b").0.status, Status::Success);
    let w = c.io(Opcode::Write, after[1].1 .0, 300, 1, c.desc(0, 4096));
    assert_eq!(c.call(w, b"").0.status, Status::Success);
    // A target key change is reported, not applied.
    let cfg = Config::parse(&text(&vol("b", "b.img", "2MiB")).replace("reactors = 2", "reactors = 3"), "r.toml").unwrap();
    let s = t.reload(cfg).unwrap();
    assert_eq!(s.restart_needed, vec!["target.reactors"]);
    assert_eq!(s.refused.len(), 1, "a is still open: {s:?}");
    drop(c);
    t.shutdown().unwrap();
}
