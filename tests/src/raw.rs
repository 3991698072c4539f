//! A raw protocol client: speaks capsules over the fabric API directly, so
//! tests can send what the initiator library would never send (bad versions,
//! unknown volume ids, misaligned descriptors, out-of-range blocks).

use std::time::{Duration, Instant};

use rdmablk_common::fabric::{
    Access, AlignedBuf, Completion, CompletionQueue, Fabric, FabricUrl, MemoryRegion, ProtectionDomain, QpCaps,
    QueuePair, RecvWr, SendOp, SendWr, WcOpcode, WcStatus, WrId,
};
use rdmablk_common::protocol::{
    CommandCapsule, CommandId, ConnectReply, DataDescriptor, Opcode, ResponseCapsule, Status, VolumeInfo,
    PROTOCOL_VERSION, RESPONSE_SLOT_SIZE,
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
        let url = FabricUrl::parse(url).expect("url");
        let fabric = Fabric::open(&url).expect("open fabric");
        let pd = fabric.alloc_pd().expect("pd");
        let cq = fabric.create_cq(256).expect("cq");
        let caps = QpCaps { max_send_wr: 64, max_recv_wr: RECV_SLOTS as u32, max_send_sge: 1, max_recv_sge: 1, max_inline_data: 0 };
        let qp = fabric.create_qp(&pd, &cq, caps).expect("qp");
        let recv_buf = AlignedBuf::new(RECV_SLOTS * RESPONSE_SLOT_SIZE, 4096);
        let send_buf = AlignedBuf::new(SEND_SLOT, 4096);
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
        let q = RawQueue { qp, cq, recv_mr, send_mr, data_mr, _pd: pd, _fabric: fabric, recv_buf, send_buf, data_buf, next_id: 1 };
        for slot in 0..RECV_SLOTS {
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
    pub fn command(&mut self, mut capsule: CommandCapsule, inline: &[u8]) -> Result<RawResponse, RawError> {
        if capsule.command_id.0 == 0 {
            capsule.command_id = CommandId(self.next_id);
            self.next_id = self.next_id.wrapping_add(1).max(1);
        }
        let mut msg = capsule.to_bytes().to_vec();
        msg.extend_from_slice(inline);
        self.send_bytes(&msg);
        self.wait_response(capsule.command_id, Duration::from_secs(20))
    }

    /// Posts raw bytes as one SEND.
    pub fn send_bytes(&mut self, bytes: &[u8]) {
        assert!(bytes.len() <= SEND_SLOT);
        // SAFETY: no transfer reads the send buffer now: the previous SEND completed
        // before its response could arrive.
        unsafe { self.send_buf.as_mut_slice()[..bytes.len()].copy_from_slice(bytes) };
        let sge = self.send_mr.sge(0, bytes.len() as u32);
        let wr = SendWr { wr_id: WrId(1 << 32), op: SendOp::Send, sges: &[sge], signaled: true, inline: false };
        self.qp.post_send(&[wr]).expect("post_send");
    }

    /// Waits for the response to `id`.
    pub fn wait_response(&mut self, id: CommandId, timeout: Duration) -> Result<RawResponse, RawError> {
        let deadline = Instant::now() + timeout;
        let mut wcs = [Completion::EMPTY; 16];
        loop {
            let n = self.cq.poll(&mut wcs).map_err(|e| RawError(e.to_string()))?;
            for wc in &wcs[..n] {
                if wc.status != WcStatus::Success {
                    return Err(RawError(format!("{:?} completion {:?}", wc.opcode, wc.status)));
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
                if capsule.command_id == id {
                    return Ok(RawResponse { capsule, data });
                }
            }
            if n == 0 {
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return Err(RawError(format!("no response to command {} within {timeout:?}", id.0)));
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
