//! A minimal fake target written against the fabric API, for testing the
//! initiator without the real daemon. It speaks protocol v1 with direct data
//! placement (RDMA WRITE for reads, RDMA READ for writes), keeps volumes in
//! memory, records every command it sees, and can be told to misbehave
//! (stall a command, drop the connection, fail a block, refuse the version).
//!
//! It serves several connections at once (a thread each) and multi-queue
//! sessions: CONNECT with session id 0 creates a session, CONNECT with an
//! existing id and the same host id joins it, and volumes opened on one
//! queue pair are open on all of the session's queue pairs; I/O to a volume
//! the session has not opened is answered `VolumeNotOpen`. A session ends
//! with its last connection. Failure injection: [`FakeTarget::restart`]
//! (every connection dies, sessions are forgotten and volume ids change),
//! [`FakeTarget::set_down`] (refuse new connections),
//! [`FakeTarget::set_hang`] (stop processing anything, like SIGSTOP),
//! [`FakeTarget::set_not_owner`] (a gateway fenced off from a shared
//! volume: every volume command is answered `NotOwner`). Several fakes made
//! with [`FakeTarget::start_sharing`] serve the same volumes, as gateways of
//! shared storage do.
//!
//! To observe pipelining it answers in batches: it collects commands until
//! none arrived for a couple of milliseconds, then answers them all, so
//! `max_outstanding` is the number of commands the initiator had in flight
//! on one queue pair. Keep-alives are counted, not recorded with the commands.

#![allow(dead_code)]

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use rdmablk_common::fabric::{
    Access, AlignedBuf, Completion, CompletionQueue, Fabric, FabricUrl, MemoryRegion, Payload, ProtectionDomain,
    QpCaps, QueuePair, RecvWr, Rkey, SendOp, SendWr, WcOpcode, WcStatus, WrId,
};
use rdmablk_common::protocol::{
    CommandCapsule, ConnectReply, DecodeError, Opcode, ResponseCapsule, SessionId, Status, VolumeId, VolumeInfo,
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
    fn info(&self, id: usize, base: u32) -> VolumeInfo {
        VolumeInfo {
            volume_id: VolumeId(id as u32 + 1 + base),
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
    /// Let further queue pairs join a session (false: refuse with
    /// UnknownSession, like a target without multi-queue sessions).
    pub joins: bool,
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
            joins: true,
        }
    }
}

/// What the fake saw.
#[derive(Default, Debug)]
pub struct Observed {
    /// Every decodable command except KEEP_ALIVE, in arrival order.
    pub commands: Vec<CommandCapsule>,
    /// For each entry of `commands`, the number of the connection it came on.
    pub command_conns: Vec<usize>,
    /// KEEP_ALIVE commands received.
    pub keep_alives: usize,
    /// Most commands outstanding at once on one connection.
    pub max_outstanding: usize,
    pub connections: usize,
    pub host_ids: Vec<String>,
    /// Each CONNECT: (session id asked for, session id granted or None if refused, queue index).
    pub connects: Vec<(SessionId, Option<SessionId>, u16)>,
}

struct FakeSession {
    host: String,
    queues: u16,
    live: usize,
    open: HashSet<usize>,
}

/// State shared by the listener and connection threads.
pub struct FakeShared {
    config: FakeConfig,
    volumes: Arc<Mutex<Vec<FakeVolume>>>,
    observed: Arc<Mutex<Observed>>,
    sessions: Mutex<HashMap<u64, FakeSession>>,
    stop: AtomicBool,
    /// Connections of an older epoch end (restart).
    epoch: AtomicU64,
    /// Refuse new connections.
    down: AtomicBool,
    /// Process nothing at all.
    hang: AtomicBool,
    /// Answer every volume command NotOwner.
    not_owner: AtomicBool,
    /// Added to every volume id (changes at restart).
    id_base: AtomicU32,
    next_conn: AtomicUsize,
    live_conns: AtomicUsize,
    /// Commands are handled under the read side; restart takes the write
    /// side, so no connection of the old epoch answers after a restart.
    world: std::sync::RwLock<()>,
}

pub struct FakeTarget {
    pub url: String,
    pub volumes: Arc<Mutex<Vec<FakeVolume>>>,
    pub observed: Arc<Mutex<Observed>>,
    shared: Arc<FakeShared>,
    thread: Option<JoinHandle<()>>,
}

impl FakeTarget {
    pub fn start(config: FakeConfig, volumes: Vec<FakeVolume>) -> FakeTarget {
        FakeTarget::start_sharing(config, Arc::new(Mutex::new(volumes)))
    }

    /// A fake serving `volumes`, which other fakes may serve too (pass
    /// another fake's [`FakeTarget::volumes`]): gateways of shared storage.
    pub fn start_sharing(config: FakeConfig, volumes: Arc<Mutex<Vec<FakeVolume>>>) -> FakeTarget {
        let fabric = Arc::new(Fabric::open(&FabricUrl::parse("tcp://127.0.0.1:0").unwrap()).expect("open fabric"));
        let listener = fabric.listen().expect("listen");
        let url = listener.local_url().to_string();
        let observed = Arc::new(Mutex::new(Observed::default()));
        let shared = Arc::new(FakeShared {
            config,
            volumes: volumes.clone(),
            observed: observed.clone(),
            sessions: Mutex::new(HashMap::new()),
            stop: AtomicBool::new(false),
            epoch: AtomicU64::new(0),
            down: AtomicBool::new(false),
            hang: AtomicBool::new(false),
            not_owner: AtomicBool::new(false),
            id_base: AtomicU32::new(0),
            next_conn: AtomicUsize::new(0),
            live_conns: AtomicUsize::new(0),
            world: std::sync::RwLock::new(()),
        });
        let thread = {
            let shared = shared.clone();
            std::thread::spawn(move || {
                let mut conns = Vec::new();
                while !shared.stop.load(Ordering::Relaxed) {
                    match listener.poll_request() {
                        Ok(Some(req)) => {
                            if shared.down.load(Ordering::Relaxed) {
                                req.reject(b"down");
                                continue;
                            }
                            let number = shared.next_conn.fetch_add(1, Ordering::Relaxed);
                            shared.observed.lock().unwrap().connections += 1;
                            let (fabric, shared) = (fabric.clone(), shared.clone());
                            shared.live_conns.fetch_add(1, Ordering::Relaxed);
                            conns.push(std::thread::spawn(move || {
                                let pd = fabric.alloc_pd().expect("pd");
                                if let Some(mut c) = FakeConn::new(&fabric, &pd, req, &shared, number) {
                                    c.run();
                                    c.leave_session();
                                }
                                shared.live_conns.fetch_sub(1, Ordering::Relaxed);
                            }));
                        }
                        Ok(None) => std::thread::sleep(Duration::from_millis(1)),
                        Err(e) => panic!("listener: {e}"),
                    }
                }
                for c in conns {
                    let _ = c.join();
                }
            })
        };
        FakeTarget { url, volumes, observed, shared, thread: Some(thread) }
    }

    /// Like a target restart: every connection dies at once, every session
    /// is forgotten, and volume ids change (by +100). Volume data stays.
    pub fn restart(&self) {
        let _world = self.shared.world.write().unwrap();
        self.shared.id_base.fetch_add(100, Ordering::SeqCst);
        self.shared.sessions.lock().unwrap().clear();
        self.shared.epoch.fetch_add(1, Ordering::SeqCst);
    }

    /// Breaks every connection (sessions end with them); ids stay.
    pub fn drop_connections(&self) {
        let _world = self.shared.world.write().unwrap();
        self.shared.epoch.fetch_add(1, Ordering::SeqCst);
    }

    /// While down, new connections are rejected.
    pub fn set_down(&self, down: bool) {
        self.shared.down.store(down, Ordering::SeqCst);
    }

    /// While hung, no connection processes anything (no answers, no acks).
    pub fn set_hang(&self, hang: bool) {
        self.shared.hang.store(hang, Ordering::SeqCst);
    }

    /// While set, every volume command (OPEN, CLOSE, I/O) is answered
    /// `NotOwner` and does nothing: another gateway took the volume over.
    pub fn set_not_owner(&self, not_owner: bool) {
        self.shared.not_owner.store(not_owner, Ordering::SeqCst);
    }

    /// The `replaces` field of each CONNECT that created a session (session
    /// id 0), in order: the reconnect fence's.
    pub fn replaced_sessions(&self) -> Vec<SessionId> {
        self.commands().iter().filter(|c| c.opcode == Opcode::Connect && c.session_id == SessionId(0)).map(|c| c.replaces).collect()
    }

    /// The sessions this fake created, in order (granted ids of new-session CONNECTs).
    pub fn created_sessions(&self) -> Vec<SessionId> {
        let o = self.observed.lock().unwrap();
        o.connects.iter().filter(|(asked, _, _)| *asked == SessionId(0)).filter_map(|(_, granted, _)| *granted).collect()
    }

    /// Connections being served now.
    pub fn live_connections(&self) -> usize {
        self.shared.live_conns.load(Ordering::SeqCst)
    }

    /// Sessions that exist now.
    pub fn session_count(&self) -> usize {
        self.shared.sessions.lock().unwrap().len()
    }

    /// The id a volume has now.
    pub fn volume_id(&self, index: usize) -> VolumeId {
        VolumeId(index as u32 + 1 + self.shared.id_base.load(Ordering::SeqCst))
    }

    pub fn keep_alives(&self) -> usize {
        self.observed.lock().unwrap().keep_alives
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
        self.shared.stop.store(true, Ordering::Relaxed);
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
    number: usize,
    epoch: u64,
    session: Option<u64>,
    shared: &'a FakeShared,
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
        shared: &'a FakeShared,
        number: usize,
    ) -> Option<FakeConn<'a>> {
        let (config, volumes, observed, stop) = (&shared.config, &*shared.volumes, &*shared.observed, &shared.stop);
        let epoch = shared.epoch.load(Ordering::SeqCst);
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
            number,
            epoch,
            session: None,
            shared,
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

    /// Drops this connection from its session; the session ends with its last.
    fn leave_session(&mut self) {
        if let Some(id) = self.session.take() {
            let mut sessions = self.shared.sessions.lock().unwrap();
            if let Some(s) = sessions.get_mut(&id) {
                s.live -= 1;
                if s.live == 0 {
                    sessions.remove(&id);
                }
            }
        }
    }

    fn run(&mut self) {
        let mut last_arrival = Instant::now();
        while !self.stop.load(Ordering::Relaxed) {
            if self.shared.epoch.load(Ordering::SeqCst) != self.epoch {
                self.qp.disconnect();
                return;
            }
            if self.shared.hang.load(Ordering::SeqCst) {
                std::thread::sleep(Duration::from_millis(1));
                continue;
            }
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
        let shared = self.shared;
        let _world = shared.world.read().unwrap();
        if shared.epoch.load(Ordering::SeqCst) != self.epoch {
            self.qp.disconnect();
            return false;
        }
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
        {
            let mut o = self.observed.lock().unwrap();
            if c.opcode == Opcode::KeepAlive {
                o.keep_alives += 1;
            } else {
                o.commands.push(c);
                o.command_conns.push(self.number);
            }
        }
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
        let volume_command = !matches!(
            c.opcode,
            Opcode::Connect | Opcode::ListVolumes | Opcode::KeepAlive | Opcode::AuthNegotiate | Opcode::AuthReply
        );
        if volume_command && shared.not_owner.load(Ordering::SeqCst) {
            return self.respond(i, fail(Status::NotOwner, 0), &[], None);
        }
        match c.opcode {
            Opcode::Connect => {
                if let Some(v) = self.config.version_mismatch {
                    return self.respond(i, fail(Status::VersionMismatch, v.into()), &[], None);
                }
                assert_eq!(c.version, PROTOCOL_VERSION);
                let host = String::from_utf8(inline).unwrap();
                self.observed.lock().unwrap().host_ids.push(host.clone());
                let joined = {
                    let mut sessions = self.shared.sessions.lock().unwrap();
                    if c.session_id == SessionId(0) {
                        let mut id = rand::random::<u64>();
                        while id == 0 || sessions.contains_key(&id) {
                            id = rand::random::<u64>();
                        }
                        sessions.insert(id, FakeSession { host, queues: 1, live: 1, open: HashSet::new() });
                        Some((id, 0u16))
                    } else {
                        match sessions.get_mut(&c.session_id.0) {
                            Some(s) if self.config.joins && s.host == host => {
                                s.queues += 1;
                                s.live += 1;
                                Some((c.session_id.0, s.queues - 1))
                            }
                            _ => None,
                        }
                    }
                };
                self.observed.lock().unwrap().connects.push((
                    c.session_id,
                    joined.map(|(id, _)| SessionId(id)),
                    joined.map_or(0, |(_, q)| q),
                ));
                let Some((session_id, queue_index)) = joined else {
                    return self.respond(i, fail(Status::UnknownSession, 0), &[], None);
                };
                self.session = Some(session_id);
                let reply = ConnectReply {
                    version: PROTOCOL_VERSION,
                    queue_depth: c.queue_depth.min(self.config.queue_depth),
                    max_io_size: c.max_io_size.min(self.config.max_io),
                    inline_data_size: self.config.inline,
                    target_name: self.config.name.clone(),
                    session_id: SessionId(session_id),
                    queue_index,
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
                let base = self.shared.id_base.load(Ordering::SeqCst);
                for (id, v) in vols.iter().enumerate().take(fit) {
                    bytes.extend_from_slice(&v.info(id, base).to_bytes().unwrap());
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
                        let bytes = vols[id].info(id, self.shared.id_base.load(Ordering::SeqCst)).to_bytes().unwrap();
                        drop(vols);
                        if let Some(sid) = self.session {
                            if let Some(s) = self.shared.sessions.lock().unwrap().get_mut(&sid) {
                                s.open.insert(id);
                            }
                        }
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
            Opcode::CloseVolume => {
                let index =
                    (c.volume_id.0 as usize).wrapping_sub(1 + self.shared.id_base.load(Ordering::SeqCst) as usize);
                if let Some(sid) = self.session {
                    if let Some(s) = self.shared.sessions.lock().unwrap().get_mut(&sid) {
                        s.open.remove(&index);
                    }
                }
                self.respond(i, ok(0), &[], None)
            }
            Opcode::KeepAlive => self.respond(i, ok(0), &[], None),
            // This fake target has no [[host]] entries: it authenticates nobody.
            Opcode::AuthNegotiate | Opcode::AuthReply => self.respond(i, fail(Status::AuthFailed, 0), &[], None),
            Opcode::Read | Opcode::Write | Opcode::Flush | Opcode::Discard | Opcode::WriteZeroes => {
                self.io(i, c, &inline)
            }
        }
    }

    fn io(&mut self, i: usize, c: CommandCapsule, inline: &[u8]) -> bool {
        let fail = |s: Status, detail: u32| ResponseCapsule::failure(c.command_id, s, detail);
        let id = c.volume_id.0 as usize;
        let base = self.shared.id_base.load(Ordering::SeqCst) as usize;
        let index = id.checked_sub(1 + base);
        let (bs, size, ro, bad) = {
            let vols = self.volumes.lock().unwrap();
            match index.and_then(|i| vols.get(i)) {
                Some(v) => {
                    (v.block_size as u64, v.data.len() as u64, v.flags & VOLUME_FLAG_READ_ONLY != 0, v.bad_block)
                }
                None => return self.respond(i, fail(Status::UnknownVolume, 0), &[], None),
            }
        };
        let vi = index.expect("checked above");
        let open = self
            .session
            .and_then(|sid| self.shared.sessions.lock().unwrap().get(&sid).map(|s| s.open.contains(&vi)))
            .unwrap_or(false);
        if !open {
            return self.respond(i, fail(Status::VolumeNotOpen, 0), &[], None);
        }
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
            payload: Payload::Sges(&sge),
            signaled: true,
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
        let send = SendWr { wr_id: WrId(i as u64), op: SendOp::Send, payload: Payload::Sges(&send_sge), signaled: true };
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
                    payload: Payload::Sges(&sge),
                    signaled: false,
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

pub mod workload;
