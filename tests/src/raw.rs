//! A raw protocol client: speaks capsules over the fabric API directly, so
//! tests can send what the initiator library would never send (bad versions,
//! unknown volume ids, misaligned descriptors, out-of-range blocks).

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use rdmablk_common::fabric::{
    Access, AlignedBuf, Completion, CompletionQueue, Fabric, FabricUrl, MemoryRegion, Payload, ProtectionDomain,
    QpCaps, QueuePair, RecvWr, Rkey, SendOp, SendWr, WcOpcode, WcStatus, WrId,
};
use rdmablk_common::protocol::{
    BlockCount, CommandCapsule, CommandId, ConnectReply, DataDescriptor, Lba, Opcode, ResponseCapsule, SessionId,
    Status, VolumeId, VolumeInfo, PROTOCOL_VERSION, RESPONSE_SLOT_SIZE,
};

const RECV_SLOTS: usize = 16;
const SEND_SLOT: usize = 64 + 8192;

/// One queue pair to a target, driven by hand.
pub struct RawQueue {
    // Field order is drop order: the QP goes before the regions it uses.
    qp: QueuePair,
    cq: CompletionQueue,
    recv_mr: MemoryRegion,
    send_mr: MemoryRegion,
    data_mr: MemoryRegion,
    _pd: ProtectionDomain,
    _fabric: Fabric,
    recv_buf: AlignedBuf,
    send_buf: AlignedBuf,
    data_buf: AlignedBuf,
    next_id: u16,
    recv_slots: usize,
    /// Send slots whose SEND has not completed yet.
    send_busy: Vec<bool>,
    next_send: usize,
    /// Responses that arrived while waiting for another one.
    pending: VecDeque<RawResponse>,
}

/// What came back for a command.
#[derive(Debug)]
pub struct RawResponse {
    pub capsule: ResponseCapsule,
    pub data: Vec<u8>,
}

/// A fabric-level failure seen while waiting (the target dropped the QP, say).
#[derive(Debug)]
pub struct RawError(pub String);

impl RawQueue {
    /// Connects at the fabric level only (no CONNECT capsule yet). The data
    /// buffer of `data_len` bytes is registered with remote read and write.
    pub fn open(url: &str, data_len: usize) -> RawQueue {
        Self::open_with_depth(url, data_len, RECV_SLOTS)
    }

    /// Like [`open`](RawQueue::open), with room for `depth` commands in
    /// flight at once (receives posted and send slots).
    pub fn open_with_depth(url: &str, data_len: usize, depth: usize) -> RawQueue {
        let url = FabricUrl::parse(url).expect("url");
        let fabric = Fabric::open(&url).expect("open fabric");
        let pd = fabric.alloc_pd().expect("pd");
        let cq = fabric.create_cq((4 * depth as u32).max(256)).expect("cq");
        let slots = depth.max(1);
        let caps = QpCaps {
            max_send_wr: (2 * slots as u32).max(64),
            max_recv_wr: slots as u32,
            max_send_sge: 1,
            max_recv_sge: 1,
            max_inline_data: 0,
        };
        let qp = fabric.create_qp(&pd, &cq, caps).expect("qp");
        let recv_buf = AlignedBuf::new(slots * RESPONSE_SLOT_SIZE, 4096);
        let send_buf = AlignedBuf::new(slots * SEND_SLOT, 4096);
        let data_buf = AlignedBuf::new(data_len.max(4096), 4096);
        // SAFETY: each buffer outlives its region: the struct drops regions first.
        let (recv_mr, send_mr, data_mr) = unsafe {
            (
                pd.register(recv_buf.as_ptr(), recv_buf.len(), Access::LOCAL_WRITE).expect("reg recv"),
                pd.register(send_buf.as_ptr(), send_buf.len(), Access::NONE).expect("reg send"),
                pd.register(
                    data_buf.as_ptr(),
                    data_buf.len(),
                    Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ,
                )
                .expect("reg data"),
            )
        };
        let q = RawQueue {
            qp,
            cq,
            recv_mr,
            send_mr,
            data_mr,
            _pd: pd,
            _fabric: fabric,
            recv_buf,
            send_buf,
            data_buf,
            next_id: 1,
            recv_slots: slots,
            send_busy: vec![false; slots],
            next_send: 0,
            pending: VecDeque::new(),
        };
        for slot in 0..q.recv_slots {
            q.post_recv_slot(slot);
        }
        q.qp.connect(&[], Duration::from_secs(10)).expect("fabric connect");
        q
    }

    /// Opens and sends a valid CONNECT; panics unless it succeeds.
    pub fn connected(url: &str, data_len: usize) -> (RawQueue, ConnectReply) {
        let mut q = RawQueue::open(url, data_len);
        let r = q.connect_command(PROTOCOL_VERSION, 32, 1 << 20, "raw-test-host").expect("CONNECT");
        assert_eq!(r.capsule.status, Status::Success, "CONNECT failed: {:?}", r.capsule);
        let reply = ConnectReply::decode(&r.data).expect("connect reply");
        (q, reply)
    }

    fn post_recv_slot(&self, slot: usize) {
        let sge = self.recv_mr.sge(slot * RESPONSE_SLOT_SIZE, RESPONSE_SLOT_SIZE as u32);
        self.qp.post_recv(&[RecvWr { wr_id: WrId(slot as u64), sges: &[sge] }]).expect("post_recv");
    }

    /// Opens a queue pair for `depth` commands and sends CONNECT as `host`,
    /// joining `session` (0 creates one); panics unless it succeeds.
    pub fn connected_as(url: &str, data_len: usize, depth: usize, host: &str, session: SessionId) -> (RawQueue, ConnectReply) {
        let mut q = RawQueue::open_with_depth(url, data_len, depth);
        let r = q.connect_to_session(depth as u32, 1 << 20, host, session).expect("CONNECT");
        assert_eq!(r.capsule.status, Status::Success, "CONNECT failed: {:?}", r.capsule);
        let reply = ConnectReply::decode(&r.data).expect("connect reply");
        (q, reply)
    }

    /// Sends CONNECT joining `session` (0: create a session).
    pub fn connect_to_session(&mut self, queue_depth: u32, max_io: u32, host: &str, session: SessionId) -> Result<RawResponse, RawError> {
        let mut c = CommandCapsule::new(Opcode::Connect, CommandId(0));
        c.version = PROTOCOL_VERSION;
        c.queue_depth = queue_depth;
        c.max_io_size = max_io;
        c.session_id = session;
        c.inline_len = host.len() as u32;
        self.command(c, host.as_bytes())
    }

    /// Sends CONNECT with the given fields.
    pub fn connect_command(&mut self, version: u16, queue_depth: u32, max_io: u32, host: &str) -> Result<RawResponse, RawError> {
        let mut c = CommandCapsule::new(Opcode::Connect, CommandId(0));
        c.version = version;
        c.queue_depth = queue_depth;
        c.max_io_size = max_io;
        c.inline_len = host.len() as u32;
        self.command(c, host.as_bytes())
    }

    /// Opens a volume by name; returns its info on success.
    pub fn open_volume(&mut self, name: &str) -> Result<VolumeInfo, Status> {
        let mut c = CommandCapsule::new(Opcode::OpenVolume, CommandId(0));
        c.inline_len = name.len() as u32;
        let r = self.command(c, name.as_bytes()).expect("OPEN");
        if r.capsule.status != Status::Success {
            return Err(r.capsule.status);
        }
        Ok(VolumeInfo::decode(&r.data).expect("volume info"))
    }

    /// A descriptor for `[offset, offset + len)` of the data buffer.
    pub fn descriptor(&self, offset: usize, len: u32) -> DataDescriptor {
        DataDescriptor { remote_addr: self.data_mr.addr() + offset as u64, length: len, rkey: self.data_mr.rkey().0 }
    }

    /// The data buffer's bytes.
    pub fn data(&self) -> &[u8] {
        // SAFETY: only called between commands, when no transfer targets the buffer.
        unsafe { self.data_buf.as_slice() }
    }

    /// The data buffer's bytes, mutable.
    pub fn data_mut(&mut self) -> &mut [u8] {
        // SAFETY: as for `data`; `&mut self` rules out other borrows.
        unsafe { self.data_buf.as_mut_slice() }
    }

    /// Sends a capsule exactly as given (the command id is assigned here
    /// unless the caller set a non-zero one) and waits for its response.
    pub fn command(&mut self, capsule: CommandCapsule, inline: &[u8]) -> Result<RawResponse, RawError> {
        let id = self.post(capsule, inline);
        self.wait_response(id, Duration::from_secs(20))
    }

    /// Sends a capsule without waiting (ids as for [`command`](RawQueue::command));
    /// returns its command id. Collect responses with
    /// [`next_response`](RawQueue::next_response) or [`wait_response`](RawQueue::wait_response).
    pub fn post(&mut self, mut capsule: CommandCapsule, inline: &[u8]) -> CommandId {
        if capsule.command_id.0 == 0 {
            capsule.command_id = CommandId(self.next_id);
            self.next_id = self.next_id.wrapping_add(1).max(1);
        }
        let mut msg = capsule.to_bytes().to_vec();
        msg.extend_from_slice(inline);
        self.send_bytes(&msg);
        capsule.command_id
    }

    /// Posts raw bytes as one SEND (from a send slot whose last SEND completed).
    pub fn send_bytes(&mut self, bytes: &[u8]) {
        assert!(bytes.len() <= SEND_SLOT);
        let slot = self.next_send;
        let deadline = Instant::now() + Duration::from_secs(20);
        while self.send_busy[slot] {
            assert!(Instant::now() < deadline, "send slot {slot} never completed");
            if self.poll_once().expect("completion while waiting for a send slot") == 0 {
                let _ = self.cq.wait(Some(Duration::from_millis(10)));
            }
        }
        self.next_send = (slot + 1) % self.send_busy.len();
        // SAFETY: no transfer reads this send slot now: its previous SEND completed.
        unsafe { self.send_buf.as_mut_slice()[slot * SEND_SLOT..slot * SEND_SLOT + bytes.len()].copy_from_slice(bytes) };
        let sge = self.send_mr.sge(slot * SEND_SLOT, bytes.len() as u32);
        let wr = SendWr { wr_id: WrId(1 << 32 | slot as u64), op: SendOp::Send, payload: Payload::Sges(&[sge]), signaled: true };
        self.send_busy[slot] = true;
        self.qp.post_send(&[wr]).expect("post_send");
    }

    /// Polls the completion queue once: responses go to the pending queue,
    /// completed SENDs free their slot. Returns how many completions it saw.
    fn poll_once(&mut self) -> Result<usize, RawError> {
        let mut wcs = [Completion::EMPTY; 16];
        let n = self.cq.poll(&mut wcs).map_err(|e| RawError(e.to_string()))?;
        for wc in &wcs[..n] {
            if wc.status != WcStatus::Success {
                return Err(RawError(format!("{:?} completion {:?}", wc.opcode, wc.status)));
            }
            if wc.opcode == WcOpcode::Send {
                if let Some(b) = self.send_busy.get_mut((wc.wr_id.0 & 0xffff_ffff) as usize) {
                    *b = false;
                }
                continue;
            }
            if wc.opcode != WcOpcode::Recv {
                continue;
            }
            let slot = wc.wr_id.0 as usize;
            let start = slot * RESPONSE_SLOT_SIZE;
            // SAFETY: the receive completed; nothing writes this slot until it is reposted below.
            let msg = unsafe { self.recv_buf.as_slice()[start..start + wc.byte_len as usize].to_vec() };
            self.post_recv_slot(slot);
            let capsule = ResponseCapsule::decode(&msg).map_err(|e| RawError(format!("bad response: {e}")))?;
            let data = msg[32..].to_vec();
            self.pending.push_back(RawResponse { capsule, data });
        }
        Ok(n)
    }

    /// Waits for the response to `id` (responses to other commands are kept
    /// for later calls).
    pub fn wait_response(&mut self, id: CommandId, timeout: Duration) -> Result<RawResponse, RawError> {
        self.wait_for(Some(id), timeout)
    }

    /// Waits for the next response, whichever command it answers.
    pub fn next_response(&mut self, timeout: Duration) -> Result<RawResponse, RawError> {
        self.wait_for(None, timeout)
    }

    fn wait_for(&mut self, id: Option<CommandId>, timeout: Duration) -> Result<RawResponse, RawError> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(pos) = self.pending.iter().position(|r| id.is_none_or(|id| r.capsule.command_id == id)) {
                return Ok(self.pending.remove(pos).expect("present"));
            }
            if self.poll_once()? == 0 {
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    let what = id.map_or("any command".to_owned(), |id| format!("command {}", id.0));
                    return Err(RawError(format!("no response to {what} within {timeout:?}")));
                }
                self.cq.wait(Some(left.min(Duration::from_millis(100)))).map_err(|e| RawError(e.to_string()))?;
            }
        }
    }

    /// Whether the queue pair is still usable.
    pub fn is_alive(&self) -> bool {
        self.qp.state() == rdmablk_common::fabric::QpState::Ready
    }
}

// --- authentication (security tests) ---

impl RawQueue {
    /// The exact bytes of a command SEND: the capsule, then `inline`.
    pub fn message(capsule: &CommandCapsule, inline: &[u8]) -> Vec<u8> {
        let mut msg = capsule.to_bytes().to_vec();
        msg.extend_from_slice(inline);
        msg
    }

    /// Sends `msg` (a whole command SEND, as [`RawQueue::message`] builds it)
    /// byte for byte and waits for the response to the command id it carries.
    pub fn send_message(&mut self, msg: &[u8]) -> Result<RawResponse, RawError> {
        let id = rdmablk_common::protocol::CommandId(u16::from_le_bytes([msg[2], msg[3]]));
        self.send_bytes(msg);
        self.wait_response(id, Duration::from_secs(20))
    }

    /// The AUTH_NEGOTIATE message for `host` creating (0) or joining `session`.
    pub fn auth_negotiate_message(id: u16, host: &str, session: SessionId) -> Vec<u8> {
        let mut c = CommandCapsule::new(Opcode::AuthNegotiate, CommandId(id));
        c.session_id = session;
        c.inline_len = host.len() as u32;
        Self::message(&c, host.as_bytes())
    }

    /// The AUTH_REPLY message carrying `response`.
    pub fn auth_reply_message(id: u16, response: &rdmablk_common::protocol::AuthResponse) -> Vec<u8> {
        let mut c = CommandCapsule::new(Opcode::AuthReply, CommandId(id));
        let bytes = response.to_bytes();
        c.inline_len = bytes.len() as u32;
        Self::message(&c, &bytes)
    }

    /// The CONNECT message for `host` creating (0) or joining `session`.
    pub fn connect_message(id: u16, host: &str, session: SessionId) -> Vec<u8> {
        let mut c = CommandCapsule::new(Opcode::Connect, CommandId(id));
        c.version = PROTOCOL_VERSION;
        c.queue_depth = 8;
        c.max_io_size = 1 << 20;
        c.session_id = session;
        c.inline_len = host.len() as u32;
        Self::message(&c, host.as_bytes())
    }

    /// Runs a whole authentication as `host` with `key` (AUTH_NEGOTIATE,
    /// AUTH_REPLY, checking the target's proof) and then CONNECT. Returns
    /// every message sent, in order (to replay them), and the last response.
    pub fn authenticate_and_connect(
        &mut self,
        host: &str,
        key: &rdmablk_common::auth::AuthKey,
        session: SessionId,
    ) -> (Vec<Vec<u8>>, RawResponse) {
        use rdmablk_common::auth::{mac, random_nonce, verify, Direction, Transcript};
        use rdmablk_common::protocol::{AuthChallenge, AuthResponse, AuthSuccess};
        let mut sent = Vec::new();
        let negotiate = Self::auth_negotiate_message(100, host, session);
        let r = self.send_message(&negotiate).expect("AUTH_NEGOTIATE");
        sent.push(negotiate);
        assert_eq!(r.capsule.status, Status::Success, "AUTH_NEGOTIATE: {:?}", r.capsule);
        let challenge = AuthChallenge::decode(&r.data).expect("challenge");
        let nonce = random_nonce();
        let t = Transcript {
            host_id: host,
            target_name: &challenge.target_name,
            session_id: session,
            initiator_nonce: &nonce,
            target_nonce: &challenge.target_nonce,
        };
        let reply = Self::auth_reply_message(101, &AuthResponse { initiator_nonce: nonce, mac: mac(key, Direction::Initiator, &t) });
        let r = self.send_message(&reply).expect("AUTH_REPLY");
        sent.push(reply);
        if r.capsule.status != Status::Success {
            return (sent, r);
        }
        let proof = AuthSuccess::decode(&r.data).expect("proof");
        assert!(verify(key, Direction::Target, &t, &proof.mac).is_ok(), "the target's proof must verify");
        let connect = Self::connect_message(102, host, session);
        let r = self.send_message(&connect).expect("CONNECT");
        sent.push(connect);
        (sent, r)
    }
}

/// An I/O command capsule: `op` on `blocks` blocks of volume `vol` from
/// block `lba`, with data descriptor `desc` (command id 0: the queue sets it).
pub fn io_command(op: Opcode, vol: VolumeId, lba: u64, blocks: u32, desc: DataDescriptor) -> CommandCapsule {
    let mut c = CommandCapsule::new(op, CommandId(0));
    c.volume_id = vol;
    c.start_block = Lba(lba);
    c.block_count = BlockCount(blocks);
    c.descriptor = desc;
    c
}

/// The passive side of one queue pair, driven by hand: for tests that need
/// a target that misbehaves (an impersonator without the key, say).
pub struct RawTarget {
    // Field order is drop order: the QP goes before the regions it uses.
    qp: QueuePair,
    cq: CompletionQueue,
    recv_mr: MemoryRegion,
    send_mr: MemoryRegion,
    _pd: ProtectionDomain,
    recv_buf: AlignedBuf,
    send_buf: AlignedBuf,
    send_busy: Vec<bool>,
    next_send: usize,
    pending: VecDeque<(CommandCapsule, Vec<u8>)>,
    /// Source of [`RawTarget::rdma_write`], and how the last one ended.
    data_mr: MemoryRegion,
    data_buf: AlignedBuf,
    write_status: Option<WcStatus>,
}

const TARGET_RECV_SLOT: usize = 64 + 4096;
/// Largest [`RawTarget::rdma_write`].
pub const RAW_TARGET_WRITE_MAX: usize = 64 << 10;
const WRITE_WR_ID: u64 = 1 << 40;

impl RawTarget {
    /// Listens on port 0 of the system tests' scheme and host (`tcp://127.0.0.1`
    /// unless the VM stage says otherwise), sends the URL through `url_tx`,
    /// and accepts one connection (waiting at most `timeout`). Call it on
    /// the thread that will drive the queue pair.
    pub fn accept_one(url_tx: std::sync::mpsc::Sender<String>, timeout: Duration) -> Option<RawTarget> {
        let url = FabricUrl::parse(&format!("{}://{}:0", crate::scheme(), crate::listen_host())).expect("url");
        let fabric = Fabric::open(&url).expect("open fabric");
        let listener = fabric.listen().expect("listen");
        url_tx.send(listener.local_url().to_string()).expect("send url");
        let deadline = Instant::now() + timeout;
        let req = loop {
            if let Some(req) = listener.poll_request().expect("poll_request") {
                break req;
            }
            if Instant::now() >= deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(5));
        };
        let pd = fabric.alloc_pd().expect("pd");
        let cq = fabric.create_cq(256).expect("cq");
        let caps = QpCaps { max_send_wr: 64, max_recv_wr: RECV_SLOTS as u32, max_send_sge: 1, max_recv_sge: 1, max_inline_data: 0 };
        let qp = req.into_queue_pair(&pd, &cq, caps).expect("qp");
        let recv_buf = AlignedBuf::new(RECV_SLOTS * TARGET_RECV_SLOT, 4096);
        let send_buf = AlignedBuf::new(RECV_SLOTS * RESPONSE_SLOT_SIZE, 4096);
        // SAFETY: each buffer outlives its region: the struct drops regions first.
        let (recv_mr, send_mr) = unsafe {
            (
                pd.register(recv_buf.as_ptr(), recv_buf.len(), Access::LOCAL_WRITE).expect("reg recv"),
                pd.register(send_buf.as_ptr(), send_buf.len(), Access::NONE).expect("reg send"),
            )
        };
        let data_buf = AlignedBuf::new(RAW_TARGET_WRITE_MAX, 4096);
        // SAFETY: the buffer outlives the region (the struct drops regions first).
        let data_mr = unsafe { pd.register(data_buf.as_ptr(), data_buf.len(), Access::NONE) }.expect("reg data");
        let t = RawTarget {
            qp,
            cq,
            recv_mr,
            send_mr,
            _pd: pd,
            recv_buf,
            send_buf,
            send_busy: vec![false; RECV_SLOTS],
            next_send: 0,
            pending: VecDeque::new(),
            data_mr,
            data_buf,
            write_status: None,
        };
        for slot in 0..RECV_SLOTS {
            t.post_recv_slot(slot);
        }
        t.qp.accept(&[]).ok()?;
        Some(t)
    }

    fn post_recv_slot(&self, slot: usize) {
        let sge = self.recv_mr.sge(slot * TARGET_RECV_SLOT, TARGET_RECV_SLOT as u32);
        self.qp.post_recv(&[RecvWr { wr_id: WrId(slot as u64), sges: &[sge] }]).expect("post_recv");
    }

    /// Polls once: commands go to the pending queue, completed SENDs free
    /// their slot. `None` when the connection is gone.
    fn poll_once(&mut self) -> Option<usize> {
        let mut wcs = [Completion::EMPTY; 16];
        let n = self.cq.poll(&mut wcs).ok()?;
        for wc in &wcs[..n] {
            if wc.wr_id.0 == WRITE_WR_ID {
                self.write_status = Some(wc.status);
                continue;
            }
            if wc.status != WcStatus::Success {
                return None;
            }
            match wc.opcode {
                WcOpcode::Send => {
                    if let Some(b) = self.send_busy.get_mut(wc.wr_id.0 as usize) {
                        *b = false;
                    }
                }
                WcOpcode::Recv => {
                    let slot = wc.wr_id.0 as usize;
                    let start = slot * TARGET_RECV_SLOT;
                    // SAFETY: the receive completed; nothing writes this slot until it is reposted below.
                    let msg = unsafe { self.recv_buf.as_slice()[start..start + wc.byte_len as usize].to_vec() };
                    self.post_recv_slot(slot);
                    let cap = CommandCapsule::decode(&msg).ok()?;
                    self.pending.push_back((cap, msg[64..].to_vec()));
                }
                _ => {}
            }
        }
        Some(n)
    }

    /// The next command and its inline data; `None` when the connection is
    /// gone or nothing came within `timeout`.
    pub fn next_command(&mut self, timeout: Duration) -> Option<(CommandCapsule, Vec<u8>)> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(c) = self.pending.pop_front() {
                return Some(c);
            }
            if self.poll_once()? == 0 {
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return None;
                }
                let _ = self.cq.wait(Some(left.min(Duration::from_millis(50))));
            }
        }
    }

    /// RDMA-WRITEs `bytes` to `remote_addr` under `rkey`, as a target
    /// answering a READ does (or as a malicious one tries to), and returns
    /// how the work request completed.
    pub fn rdma_write(&mut self, remote_addr: u64, rkey: u32, bytes: &[u8]) -> WcStatus {
        assert!(bytes.len() <= RAW_TARGET_WRITE_MAX);
        // SAFETY: no transfer reads the data buffer now: the previous WRITE completed.
        unsafe { self.data_buf.as_mut_slice()[..bytes.len()].copy_from_slice(bytes) };
        let sge = self.data_mr.sge(0, bytes.len() as u32);
        let wr = SendWr {
            wr_id: WrId(WRITE_WR_ID),
            op: SendOp::RdmaWrite { remote_addr, rkey: Rkey(rkey) },
            payload: Payload::Sges(&[sge]),
            signaled: true,
        };
        self.write_status = None;
        self.qp.post_send(&[wr]).expect("post_send");
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let alive = self.poll_once();
            if let Some(status) = self.write_status {
                return status;
            }
            assert!(alive.is_some(), "connection lost before the WRITE completed");
            assert!(Instant::now() < deadline, "the RDMA WRITE never completed");
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// Sends a response to command `id` with `status` and reply `data`.
    pub fn respond(&mut self, id: CommandId, status: Status, data: &[u8]) {
        let slot = self.next_send;
        let deadline = Instant::now() + Duration::from_secs(10);
        while self.send_busy[slot] {
            assert!(Instant::now() < deadline, "send slot never completed");
            if self.poll_once().expect("connection lost while sending") == 0 {
                std::thread::sleep(Duration::from_millis(1));
            }
        }
        self.next_send = (slot + 1) % self.send_busy.len();
        let mut r = ResponseCapsule::failure(id, status, 0);
        r.data_len = data.len() as u32;
        let mut msg = r.to_bytes().to_vec();
        msg.extend_from_slice(data);
        let at = slot * RESPONSE_SLOT_SIZE;
        // SAFETY: no transfer reads this send slot now: its previous SEND completed.
        unsafe { self.send_buf.as_mut_slice()[at..at + msg.len()].copy_from_slice(&msg) };
        let sge = self.send_mr.sge(at, msg.len() as u32);
        let wr = SendWr { wr_id: WrId(slot as u64), op: SendOp::Send, payload: Payload::Sges(&[sge]), signaled: true };
        self.send_busy[slot] = true;
        self.qp.post_send(&[wr]).expect("post_send");
    }
}
