//! A minimal fake target written against the fabric API, for testing the
//! initiator without the real daemon. It speaks protocol v1 with direct data
//! placement (RDMA WRITE for reads, RDMA READ for writes), keeps volumes in
//! memory, records every command it sees, and can be told to misbehave
//! (stall a command, drop the connection, fail a block, refuse the version).
//!
//! To observe pipelining it answers in batches: it collects commands until
//! none arrived for a couple of milliseconds, then answers them all, so
//! `max_outstanding` is the number of commands the initiator had in flight.

#![allow(dead_code)]

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use rdmablk_common::fabric::{
    Access, AlignedBuf, Completion, CompletionQueue, Fabric, FabricUrl, MemoryRegion, ProtectionDomain, QpCaps,
    QueuePair, RecvWr, Rkey, SendOp, SendWr, WcOpcode, WcStatus, WrId,
};
use rdmablk_common::protocol::{
    CommandCapsule, ConnectReply, DecodeError, Opcode, ResponseCapsule, Status, VolumeId, VolumeInfo,
    COMMAND_CAPSULE_SIZE, MAX_HOST_ID_LEN, PROTOCOL_VERSION, RESPONSE_SLOT_SIZE, VOLUME_FLAG_DISCARD,
    VOLUME_FLAG_READ_ONLY, VOLUME_FLAG_WRITE_ZEROES, VOLUME_INFO_SIZE,
};

/// One in-memory volume.
#[derive(Clone, Debug)]
pub struct FakeVolume {
    pub name: String,
    pub block_size: u32,
    pub data: Vec<u8>,
    pub flags: u32,
    /// Reads covering this block fail with IoError (errno 5).
    pub bad_block: Option<u64>,
}

impl FakeVolume {
    pub fn new(name: &str, size: usize, block_size: u32) -> FakeVolume {
        FakeVolume {
            name: name.into(),
            block_size,
            data: vec![0; size],
            flags: VOLUME_FLAG_DISCARD | VOLUME_FLAG_WRITE_ZEROES,
            bad_block: None,
        }
    }
    pub fn read_only(mut self) -> Self {
        self.flags |= VOLUME_FLAG_READ_ONLY;
        self
    }
    pub fn flags(mut self, flags: u32) -> Self {
        self.flags = flags;
        self
    }
    fn info(&self, id: usize) -> VolumeInfo {
        VolumeInfo {
            volume_id: VolumeId(id as u32 + 1),
            block_size: self.block_size,
            size_bytes: self.data.len() as u64,
            flags: self.flags,
            name: self.name.clone(),
        }
    }
}

/// How the fake behaves.
#[derive(Clone, Debug)]
pub struct FakeConfig {
    pub queue_depth: u32,
    pub max_io: u32,
    pub inline: u32,
    pub name: String,
    /// Answer CONNECT with VersionMismatch naming this version.
    pub version_mismatch: Option<u16>,
    /// Never answer commands with this opcode.
    pub stall: Option<Opcode>,
    /// Disconnect when a command with this opcode arrives.
    pub drop_on: Option<Opcode>,
    /// Answer DISCARD/WRITE_ZEROES bigger than max_io with TooLarge.
    pub zeroes_limited: bool,
    /// How long the fake waits for more commands before answering a batch.
    pub batch_quiet: Duration,
}

impl Default for FakeConfig {
    fn default() -> Self {
        FakeConfig {
            queue_depth: 32,
            max_io: 1 << 20,
            inline: 4096,
            name: "fake-target".into(),
            version_mismatch: None,
            stall: None,
            drop_on: None,
            zeroes_limited: false,
            batch_quiet: Duration::from_millis(2),
        }
    }
}

/// What the fake saw.
#[derive(Default, Debug)]
pub struct Observed {
    pub commands: Vec<CommandCapsule>,
    pub max_outstanding: usize,
    pub connections: usize,
    pub host_ids: Vec<String>,
}

pub struct FakeTarget {
    pub url: String,
    pub volumes: Arc<Mutex<Vec<FakeVolume>>>,
    pub observed: Arc<Mutex<Observed>>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl FakeTarget {
    pub fn start(config: FakeConfig, volumes: Vec<FakeVolume>) -> FakeTarget {
        let fabric = Fabric::open(&FabricUrl::parse("tcp://127.0.0.1:0").unwrap()).expect("open fabric");
        let listener = fabric.listen().expect("listen");
        let url = listener.local_url().to_string();
        let volumes = Arc::new(Mutex::new(volumes));
        let observed = Arc::new(Mutex::new(Observed::default()));
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let (volumes, observed, stop) = (volumes.clone(), observed.clone(), stop.clone());
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    match listener.poll_request() {
                        Ok(Some(req)) => {
                            observed.lock().unwrap().connections += 1;
                            let pd = fabric.alloc_pd().expect("pd");
                            let mut conn = FakeConn::new(&fabric, &pd, req, &config, &volumes, &observed, &stop);
                            if let Some(c) = conn.as_mut() {
                                c.run();
                            }
                        }
                        Ok(None) => std::thread::sleep(Duration::from_millis(1)),
                        Err(e) => panic!("listener: {e}"),
                    }
                }
            })
        };
        FakeTarget { url, volumes, observed, stop, thread: Some(thread) }
    }

    pub fn commands(&self) -> Vec<CommandCapsule> {
        self.observed.lock().unwrap().commands.clone()
    }

    pub fn command_count(&self) -> usize {
        self.observed.lock().unwrap().commands.len()
    }

    pub fn max_outstanding(&self) -> usize {
        self.observed.lock().unwrap().max_outstanding
    }

    pub fn reset_max_outstanding(&self) {
        self.observed.lock().unwrap().max_outstanding = 0;
    }

    pub fn volume_data(&self, index: usize) -> Vec<u8> {
        self.volumes.lock().unwrap()[index].data.clone()
    }
}

impl Drop for FakeTarget {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Registered memory of the fake.
struct Mem {
    mr: MemoryRegion,
    buf: AlignedBuf,
}

impl Mem {
    fn new(pd: &ProtectionDomain, len: usize, access: Access) -> Mem {
        let buf = AlignedBuf::new(len, 4096);
        // SAFETY: `buf` lives as long as `mr` (same struct; `mr` is declared
        // first and so deregistered before `buf` is freed).
        let mr = unsafe { pd.register(buf.as_ptr(), buf.len(), access) }.expect("register");
        Mem { mr, buf }
    }
    fn addr(&self, off: usize) -> u64 {
        self.buf.addr() + off as u64
    }
    fn read(&self, off: usize, len: usize) -> Vec<u8> {
        // SAFETY: the fake reads only ranges whose receive or RDMA READ has
        // completed and that no posted work request targets.
        unsafe { self.buf.as_slice()[off..off + len].to_vec() }
    }
    fn write(&self, off: usize, data: &[u8]) {
        // SAFETY: the fake writes only ranges that no posted work request
        // references (a response or staging slot of a command it is handling).
        unsafe { self.buf.as_mut_slice()[off..off + data.len()].copy_from_slice(data) }
    }
}

struct FakeConn<'a> {
    qp: QueuePair,
    cq: CompletionQueue,
    recv: Mem,
    send: Mem,
    stage: Mem,
    slots: usize,
    recv_size: usize,
    stage_size: usize,
    pending: VecDeque<(usize, usize)>,
    read_done: Vec<u64>,
    max_io: u32,
    config: &'a FakeConfig,
    volumes: &'a Mutex<Vec<FakeVolume>>,
    observed: &'a Mutex<Observed>,
    stop: &'a AtomicBool,
}

const RDMA_READ_TAG: u64 = 1 << 40;

impl<'a> FakeConn<'a> {
    fn new(
        fabric: &Fabric,
        pd: &ProtectionDomain,
        req: rdmablk_common::fabric::ConnectRequest,
        config: &'a FakeConfig,
        volumes: &'a Mutex<Vec<FakeVolume>>,
        observed: &'a Mutex<Observed>,
        stop: &'a AtomicBool,
    ) -> Option<FakeConn<'a>> {
        let slots = config.queue_depth as usize;
        let cq = fabric.create_cq(4 * slots as u32 + 16).expect("cq");
        let caps = QpCaps {
            max_send_wr: 4 * slots as u32,
            max_recv_wr: slots as u32,
            max_send_sge: 1,
            max_recv_sge: 1,
            ..QpCaps::default()
        };
        let qp = req.into_queue_pair(pd, &cq, caps).expect("qp");
        let recv_size = COMMAND_CAPSULE_SIZE + (config.inline as usize).max(MAX_HOST_ID_LEN);
        let stage_size = (config.max_io as usize).max(64 << 10);
        let recv = Mem::new(pd, slots * recv_size, Access::LOCAL_WRITE);
        let send = Mem::new(pd, slots * RESPONSE_SLOT_SIZE, Access::LOCAL_WRITE);
        let stage = Mem::new(pd, slots * stage_size, Access::LOCAL_WRITE);
        let conn = FakeConn {
            qp,
            cq,
            recv,
            send,
            stage,
            slots,
            recv_size,
            stage_size,
            pending: VecDeque::new(),
            read_done: Vec::new(),
            max_io: config.max_io,
            config,
            volumes,
            observed,
            stop,
        };
        for i in 0..slots {
            conn.post_recv(i);
        }
        conn.qp.accept(&[]).ok()?;
        Some(conn)
    }

    fn post_recv(&self, i: usize) {
        let sge = [rdmablk_common::fabric::Sge {
            addr: self.recv.addr(i * self.recv_size),
            length: self.recv_size as u32,
            lkey: self.recv.mr.lkey(),
        }];
        let _ = self.qp.post_recv(&[RecvWr { wr_id: WrId(i as u64), sges: &sge }]);
    }

    /// Polls once; false when the connection is over.
    fn poll(&mut self) -> bool {
        let mut wcs = [Completion::EMPTY; 32];
        let n = match self.cq.poll(&mut wcs) {
            Ok(n) => n,
            Err(_) => return false,
        };
        for wc in &wcs[..n] {
            if wc.status != WcStatus::Success {
                return false;
            }
            match wc.opcode {
                WcOpcode::Recv => {
                    self.pending.push_back((wc.wr_id.0 as usize, wc.byte_len as usize));
                    let mut o = self.observed.lock().unwrap();
                    o.max_outstanding = o.max_outstanding.max(self.pending.len());
                }
                WcOpcode::RdmaRead => self.read_done.push(wc.wr_id.0),
                _ => {}
            }
        }
        true
    }

    fn run(&mut self) {
        let mut last_arrival = Instant::now();
        while !self.stop.load(Ordering::Relaxed) {
            let before = self.pending.len();
            if !self.poll() {
                return;
            }
            if self.pending.len() > before {
                last_arrival = Instant::now();
                continue;
            }
            if !self.pending.is_empty() && last_arrival.elapsed() >= self.config.batch_quiet {
                let batch: Vec<_> = self.pending.drain(..).collect();
                for (i, len) in batch {
                    if !self.handle(i, len) {
                        return;
                    }
                }
                continue;
            }
            let _ = self.cq.wait(Some(Duration::from_millis(1)));
        }
    }

    /// Answers one command; false when the connection is over.
    fn handle(&mut self, i: usize, len: usize) -> bool {
        let msg = self.recv.read(i * self.recv_size, len);
        let c = match CommandCapsule::decode(&msg) {
            Ok(c) => c,
            Err(e) => {
                let cid = u16::from_le_bytes([msg[2], msg[3]]);
                let status = if matches!(e, DecodeError::UnknownOpcode(_)) {
                    Status::InvalidOpcode
                } else {
                    Status::InvalidField
                };
                self.post_recv(i);
                return self.respond(
                    i,
                    ResponseCapsule::failure(rdmablk_common::protocol::CommandId(cid), status, 0),
                    &[],
                    None,
                );
            }
        };
        self.observed.lock().unwrap().commands.push(c);
        if self.config.drop_on == Some(c.opcode) {
            self.qp.disconnect();
            return false;
        }
        if self.config.stall == Some(c.opcode) {
            self.post_recv(i);
            return true;
        }
        let inline = msg[COMMAND_CAPSULE_SIZE..].to_vec();
        // Repost before answering, so a new command can never find no receive.
        self.post_recv(i);
        let ok = |result: u64| ResponseCapsule { result, ..ResponseCapsule::success(c.command_id) };
        let fail = |s: Status, detail: u32| ResponseCapsule::failure(c.command_id, s, detail);
        match c.opcode {
            Opcode::Connect => {
                if let Some(v) = self.config.version_mismatch {
                    return self.respond(i, fail(Status::VersionMismatch, v.into()), &[], None);
                }
                assert_eq!(c.version, PROTOCOL_VERSION);
                self.observed.lock().unwrap().host_ids.push(String::from_utf8(inline).unwrap());
                let reply = ConnectReply {
                    version: PROTOCOL_VERSION,
                    queue_depth: c.queue_depth.min(self.config.queue_depth),
                    max_io_size: c.max_io_size.min(self.config.max_io),
                    inline_data_size: self.config.inline,
                    target_name: self.config.name.clone(),
                    session_id: rdmablk_common::protocol::SessionId(0x5e55),
                    queue_index: 0,
                };
                self.max_io = reply.max_io_size;
                let bytes = reply.to_bytes().unwrap();
                let mut r = ok(0);
                r.data_len = bytes.len() as u32;
                self.respond(i, r, &bytes, None)
            }
            Opcode::ListVolumes => {
                let vols = self.volumes.lock().unwrap().clone();
                let fit = (c.descriptor.length as usize / VOLUME_INFO_SIZE).min(vols.len());
                let mut bytes = Vec::new();
                for (id, v) in vols.iter().enumerate().take(fit) {
                    bytes.extend_from_slice(&v.info(id).to_bytes().unwrap());
                }
                assert!(bytes.len() <= self.stage_size);
                self.stage.write(i * self.stage_size, &bytes);
                let write = (!bytes.is_empty()).then_some((
                    i * self.stage_size,
                    bytes.len(),
                    c.descriptor.remote_addr,
                    c.descriptor.rkey,
                ));
                self.respond(i, ok(vols.len() as u64), &[], write)
            }
            Opcode::OpenVolume => {
                let name = String::from_utf8(inline).unwrap();
                let vols = self.volumes.lock().unwrap();
                match vols.iter().position(|v| v.name == name) {
                    Some(id) => {
                        let bytes = vols[id].info(id).to_bytes().unwrap();
                        drop(vols);
                        let mut r = ok(0);
                        r.data_len = bytes.len() as u32;
                        self.respond(i, r, &bytes, None)
                    }
                    None => {
                        drop(vols);
                        self.respond(i, fail(Status::UnknownVolume, 0), &[], None)
                    }
                }
            }
            Opcode::CloseVolume | Opcode::KeepAlive => self.respond(i, ok(0), &[], None),
            Opcode::Read | Opcode::Write | Opcode::Flush | Opcode::Discard | Opcode::WriteZeroes => {
                self.io(i, c, &inline)
            }
        }
    }

    fn io(&mut self, i: usize, c: CommandCapsule, inline: &[u8]) -> bool {
        let fail = |s: Status, detail: u32| ResponseCapsule::failure(c.command_id, s, detail);
        let id = c.volume_id.0 as usize;
        let (bs, size, ro, bad) = {
            let vols = self.volumes.lock().unwrap();
            match id.checked_sub(1).and_then(|i| vols.get(i)) {
                Some(v) => {
                    (v.block_size as u64, v.data.len() as u64, v.flags & VOLUME_FLAG_READ_ONLY != 0, v.bad_block)
                }
                None => return self.respond(i, fail(Status::UnknownVolume, 0), &[], None),
            }
        };
        let vi = id - 1;
        if c.opcode == Opcode::Flush {
            return self.respond(i, ResponseCapsule::success(c.command_id), &[], None);
        }
        let start = c.start_block.0 * bs;
        let len = u64::from(c.block_count.0) * bs;
        if start.checked_add(len).is_none_or(|e| e > size) {
            return self.respond(i, fail(Status::OutOfRange, 0), &[], None);
        }
        if c.opcode != Opcode::Read && ro {
            return self.respond(i, fail(Status::ReadOnly, 0), &[], None);
        }
        let (s, l) = (start as usize, len as usize);
        match c.opcode {
            Opcode::Discard | Opcode::WriteZeroes => {
                if self.config.zeroes_limited && len > u64::from(self.max_io) {
                    return self.respond(i, fail(Status::TooLarge, 0), &[], None);
                }
                self.volumes.lock().unwrap()[vi].data[s..s + l].fill(0);
                self.respond(i, ResponseCapsule::success(c.command_id), &[], None)
            }
            Opcode::Read => {
                if c.descriptor.length as u64 != len {
                    return self.respond(i, fail(Status::LengthMismatch, 0), &[], None);
                }
                if len > u64::from(self.max_io) {
                    return self.respond(i, fail(Status::TooLarge, 0), &[], None);
                }
                if bad.is_some_and(|b| b >= c.start_block.0 && b < c.start_block.0 + u64::from(c.block_count.0)) {
                    return self.respond(i, fail(Status::IoError, 5), &[], None);
                }
                let data = self.volumes.lock().unwrap()[vi].data[s..s + l].to_vec();
                self.stage.write(i * self.stage_size, &data);
                self.respond(
                    i,
                    ResponseCapsule::success(c.command_id),
                    &[],
                    Some((i * self.stage_size, l, c.descriptor.remote_addr, c.descriptor.rkey)),
                )
            }
            Opcode::Write => {
                let data = if c.has_inline_data() {
                    if inline.len() as u64 != len {
                        return self.respond(i, fail(Status::LengthMismatch, 0), &[], None);
                    }
                    inline.to_vec()
                } else {
                    if c.descriptor.length as u64 != len {
                        return self.respond(i, fail(Status::LengthMismatch, 0), &[], None);
                    }
                    if len > u64::from(self.max_io) {
                        return self.respond(i, fail(Status::TooLarge, 0), &[], None);
                    }
                    match self.rdma_read(i, l, c.descriptor.remote_addr, c.descriptor.rkey) {
                        Some(d) => d,
                        None => return false,
                    }
                };
                self.volumes.lock().unwrap()[vi].data[s..s + l].copy_from_slice(&data);
                self.respond(i, ResponseCapsule::success(c.command_id), &[], None)
            }
            _ => unreachable!(),
        }
    }

    /// RDMA READs `len` bytes into staging slot `i` and waits for it.
    fn rdma_read(&mut self, i: usize, len: usize, remote_addr: u64, rkey: u32) -> Option<Vec<u8>> {
        let sge = [rdmablk_common::fabric::Sge {
            addr: self.stage.addr(i * self.stage_size),
            length: len as u32,
            lkey: self.stage.mr.lkey(),
        }];
        let tag = RDMA_READ_TAG | i as u64;
        let wr = SendWr {
            wr_id: WrId(tag),
            op: SendOp::RdmaRead { remote_addr, rkey: Rkey(rkey) },
            sges: &sge,
            signaled: true,
            inline: false,
        };
        self.qp.post_send(&[wr]).ok()?;
        let deadline = Instant::now() + Duration::from_secs(10);
        while !self.read_done.contains(&tag) {
            if Instant::now() > deadline || !self.poll() {
                return None;
            }
            let _ = self.cq.wait(Some(Duration::from_millis(1)));
        }
        self.read_done.retain(|&t| t != tag);
        Some(self.stage.read(i * self.stage_size, len))
    }

    /// Sends a response from slot `i`, after an optional RDMA WRITE
    /// `(stage offset, len, remote addr, rkey)` in the same chain.
    fn respond(&mut self, i: usize, r: ResponseCapsule, data: &[u8], write: Option<(usize, usize, u64, u32)>) -> bool {
        let mut msg = r.to_bytes().to_vec();
        msg.extend_from_slice(data);
        self.send.write(i * RESPONSE_SLOT_SIZE, &msg);
        let send_sge = [rdmablk_common::fabric::Sge {
            addr: self.send.addr(i * RESPONSE_SLOT_SIZE),
            length: msg.len() as u32,
            lkey: self.send.mr.lkey(),
        }];
        let send = SendWr { wr_id: WrId(i as u64), op: SendOp::Send, sges: &send_sge, signaled: true, inline: false };
        let result = match write {
            Some((off, len, remote_addr, rkey)) => {
                let sge = [rdmablk_common::fabric::Sge {
                    addr: self.stage.addr(off),
                    length: len as u32,
                    lkey: self.stage.mr.lkey(),
                }];
                let w = SendWr {
                    wr_id: WrId(i as u64),
                    op: SendOp::RdmaWrite { remote_addr, rkey: Rkey(rkey) },
                    sges: &sge,
                    signaled: false,
                    inline: false,
                };
                self.qp.post_send(&[w, send])
            }
            None => self.qp.post_send(&[send]),
        };
        result.is_ok()
    }
}

/// A deterministic pattern.
pub fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed).wrapping_add((i >> 8) as u8)).collect()
}
