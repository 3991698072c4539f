//! A small blocking NVMe/TCP host (initiator) for system tests.
//!
//! One [`NvmeTcpConn`] is one NVMe/TCP connection, i.e. one queue (the admin
//! queue or one I/O queue), over a plain `TcpStream`. Everything on the wire
//! is built and parsed with the project's codec (`rdmablk_common::nvme`);
//! this file only sequences it: ICReq/ICResp, capsules, C2HData, R2T and
//! H2CData. Commands run one at a time (command ids increment), which is
//! all the tests need, and every read has a deadline so that a hung target
//! fails a test instead of hanging it.
//!
//! Hostile tests use the low-level half: [`NvmeTcpConn::send_pdu`],
//! [`NvmeTcpConn::recv_pdu`], [`NvmeTcpConn::raw_send`] and
//! [`NvmeTcpConn::wait_for_termination`].

use std::collections::VecDeque;
use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use rdmablk_common::nvme::auth::{
    self, explanation, DhGroup, DhKey, HashId, Message, Negotiate, Reply, Secret, SECP_DHCHAP, SPSP,
};
use rdmablk_common::nvme::cqe::CompletionEntry;
use rdmablk_common::nvme::fabrics::{property, Connect, ConnectData, Property, ANY_CONTROLLER, CONNECT_DATA_SIZE};
use rdmablk_common::nvme::sqe::{admin_opcode, io_opcode, DsmRange, Sgl, SubmissionEntry, DSM_RANGE_SIZE};
use rdmablk_common::nvme::status::Status;
use rdmablk_common::nvme::tcp::{
    digest, CommonHeader, DataPdu, Digests, IcReq, Pdu, TermReq, CH_SIZE, DIGEST_SIZE,
};

/// How long a reply may take before the test fails.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(10);
/// In-capsule data the target offers on I/O queues (IOCCSZ 1028: 16 KiB).
pub const IN_CAPSULE_MAX: usize = 16 * 1024;
/// The largest PDU this client accepts from the target.
const MAX_RX_PLEN: u32 = 8 << 20;

/// CC.EN = 1, IOSQES = 6 (64 bytes), IOCQES = 4 (16 bytes).
pub const CC_ENABLE: u64 = 0x0046_0001;

/// Why a command or a read did not complete normally.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ConnError {
    /// The target closed (EOF) or reset the connection.
    Closed(String),
    /// Nothing arrived before the deadline.
    Timeout,
    /// The target sent a C2HTermReq (with the offending header it echoed).
    Terminated { term: TermReq, data: Vec<u8> },
    /// The target sent something this host cannot accept.
    Protocol(String),
}

impl std::fmt::Display for ConnError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ConnError::Closed(why) => write!(f, "connection closed by the target ({why})"),
            ConnError::Timeout => write!(f, "no reply from the target in time"),
            ConnError::Terminated { term, .. } => {
                write!(f, "C2HTermReq from the target: FES {:#x}, FEI {:#x}", term.fes, term.fei)
            }
            ConnError::Protocol(why) => write!(f, "protocol violation by the target: {why}"),
        }
    }
}

/// One command for [`NvmeTcpConn::execute_many`]: the entry (its SGL set
/// by the caller), in-capsule data, data to send on R2Ts, and the bytes of
/// C2HData expected.
#[derive(Clone, Copy, Debug)]
pub struct Cmd<'a> {
    pub sqe: SubmissionEntry,
    pub in_capsule: &'a [u8],
    pub h2c: &'a [u8],
    pub c2h_len: usize,
}

impl<'a> Cmd<'a> {
    /// A command with the usual SGL: in-capsule data if any, else a
    /// transport SGL covering `h2c` or `c2h_len`, else none.
    pub fn new(mut sqe: SubmissionEntry, in_capsule: &'a [u8], h2c: &'a [u8], c2h_len: usize) -> Cmd<'a> {
        if !in_capsule.is_empty() {
            sqe.set_sgl(Sgl::InCapsule { offset: 0, length: in_capsule.len() as u32 });
        } else if !h2c.is_empty() {
            sqe.set_sgl(Sgl::Transport { length: h2c.len() as u32 });
        } else if c2h_len > 0 {
            sqe.set_sgl(Sgl::Transport { length: c2h_len as u32 });
        }
        Cmd { sqe, in_capsule, h2c, c2h_len }
    }
}

/// A completed command: its completion entry and the C2H data it returned.
#[derive(Debug, Clone)]
pub struct Completion {
    pub cqe: CompletionEntry,
    pub data: Vec<u8>,
}

/// What the target did on a connection after something was sent to it.
#[derive(Debug, Default)]
pub struct Termination {
    /// The C2HTermReq, if one came (and the bytes of the header it echoed).
    pub term: Option<(TermReq, Vec<u8>)>,
    /// Other PDUs that came before the end.
    pub other: Vec<Pdu>,
    /// The connection ended (EOF or reset) within the timeout.
    pub closed: bool,
    /// Why the stream ended, or what could not be parsed.
    pub end: String,
}

/// One NVMe/TCP connection (one queue) to a target.
pub struct NvmeTcpConn {
    pub stream: TcpStream,
    /// The digests the ICResp granted.
    pub digests: Digests,
    /// The target's MAXH2CDATA.
    pub maxh2cdata: u32,
    /// The target's CPDA (0-based dwords; 0: no alignment asked).
    pub cpda: u8,
    /// Most bytes this host puts in one H2CData PDU (MAXH2CDATA by default;
    /// tests lower it to split an R2T's data over several PDUs).
    pub h2c_chunk: u32,
    /// Most bytes of write data sent in the capsule (else R2T/H2CData).
    pub in_capsule_max: usize,
    /// Read deadline for every reply.
    pub timeout: Duration,
    /// The queue id this connection was connected as (after a Connect).
    pub qid: u16,
    /// Completions that came for other commands (an AER, say).
    pub stray: VecDeque<CompletionEntry>,
    next_cid: u16,
    /// ICResp received: from then on every PDU type may come.
    initialized: bool,
}

/// A host identifier derived from the host NQN, the same on every queue.
pub fn host_id_of(hostnqn: &str) -> [u8; 16] {
    let mut h = 0xcbf29ce484222325u64;
    let mut out = [0u8; 16];
    for (i, b) in hostnqn.bytes().chain(*b"rdmablk-tests").enumerate() {
        h = (h ^ b as u64).wrapping_mul(0x100000001b3);
        out[i % 16] ^= (h >> 24) as u8;
    }
    out
}

/// The 1,024 bytes of Connect data.
pub fn connect_data(cntlid: u16, subnqn: &str, hostnqn: &str) -> Vec<u8> {
    let d = ConnectData {
        host_id: host_id_of(hostnqn),
        controller_id: cntlid,
        subsystem_nqn: subnqn.to_owned(),
        host_nqn: hostnqn.to_owned(),
    };
    let mut out = [0u8; CONNECT_DATA_SIZE];
    d.encode(&mut out).expect("valid NQNs");
    out.to_vec()
}

/// A Connect entry for queue `qid` with a 0-based `sqsize` and `kato_ms`.
pub fn connect_entry(qid: u16, sqsize: u16, kato_ms: u32) -> SubmissionEntry {
    let mut e = Connect { recfmt: 0, qid, sqsize, cattr: 0, kato_ms }.to_entry(0);
    e.set_sgl(Sgl::InCapsule { offset: 0, length: CONNECT_DATA_SIZE as u32 });
    e
}

/// An I/O entry (Read, Write, Write Zeroes) of `blocks` blocks at `slba`.
pub fn rw_entry(opcode: u8, nsid: u32, slba: u64, blocks: u32, fua: bool) -> SubmissionEntry {
    let mut e = SubmissionEntry::new(opcode, 0);
    e.nsid = nsid;
    e.set_rw(slba, blocks, fua);
    e
}

impl NvmeTcpConn {
    /// Opens a TCP connection to `addr` and does ICReq/ICResp asking for
    /// `digests`. Panics if the target does not answer with a valid ICResp
    /// granting them.
    pub fn connect(addr: SocketAddr, digests: Digests) -> NvmeTcpConn {
        Self::tcp(addr).initialize(digests)
    }

    /// [`connect`](Self::connect) from the local address `source` (bound
    /// before the TCP connect, see [`crate::tcp_from`]).
    pub fn connect_from(addr: SocketAddr, source: Ipv4Addr, digests: Digests) -> NvmeTcpConn {
        Self::tcp_from(addr, source).initialize(digests)
    }

    /// ICReq asking for `digests`, and the ICResp.
    fn initialize(mut self, digests: Digests) -> NvmeTcpConn {
        self.send_pdu(&Pdu::IcReq(IcReq { pfv: 0, hpda: 0, digests, maxr2t: 0 }), &[]);
        match self.recv_pdu() {
            Ok((Pdu::IcResp(r), _)) => {
                assert_eq!(r.pfv, 0, "ICResp PFV");
                assert_eq!(r.digests, digests, "ICResp: the target did not grant the digests asked for");
                assert!(r.maxh2cdata >= 4096, "ICResp MAXH2CDATA {}", r.maxh2cdata);
                self.digests = r.digests;
                self.maxh2cdata = r.maxh2cdata;
                self.h2c_chunk = r.maxh2cdata;
                self.cpda = r.cpda;
            }
            other => panic!("expected an ICResp to the ICReq, got {other:?}"),
        }
        self
    }

    /// A TCP connection with nothing sent (for attacks before the ICReq).
    pub fn tcp(addr: SocketAddr) -> NvmeTcpConn {
        let stream = TcpStream::connect(addr).unwrap_or_else(|e| panic!("TCP connect to {addr}: {e}"));
        stream.set_nodelay(true).unwrap();
        Self::from_stream(stream)
    }

    /// [`tcp`](Self::tcp) from the local address `source`.
    pub fn tcp_from(addr: SocketAddr, source: Ipv4Addr) -> NvmeTcpConn {
        Self::from_stream(crate::tcp_from(&format!("nvme+tcp://{addr}"), source))
    }

    /// [`tcp_from`](Self::tcp_from) without panicking, giving up when the connection is
    /// not established within `timeout`.
    pub fn tcp_from_within(addr: SocketAddr, source: std::net::Ipv4Addr, timeout: Duration) -> std::io::Result<NvmeTcpConn> {
        crate::try_tcp_from_within(addr, source, Some(timeout)).map(Self::from_stream)
    }

    /// ICReq (asking for `digests`) and the ICResp, without panicking: a
    /// target that closes, stays silent or answers something else is an Err.
    pub fn try_initialize(&mut self, digests: Digests) -> Result<(), ConnError> {
        self.try_send_pdu(&Pdu::IcReq(IcReq { pfv: 0, hpda: 0, digests, maxr2t: 0 }), &[])?;
        match self.recv_pdu()? {
            (Pdu::IcResp(r), _) if r.pfv == 0 && r.digests == digests && r.maxh2cdata >= 4096 => {
                self.digests = r.digests;
                self.maxh2cdata = r.maxh2cdata;
                self.h2c_chunk = r.maxh2cdata;
                self.cpda = r.cpda;
                Ok(())
            }
            (other, _) => Err(ConnError::Protocol(format!("expected a valid ICResp to the ICReq, got {other:?}"))),
        }
    }

    /// Like [`exec_ok`](Self::exec_ok) without panicking: a transport
    /// failure or a status other than success is an Err saying which.
    pub fn try_exec(&mut self, sqe: SubmissionEntry, in_capsule: &[u8], h2c: &[u8], c2h_len: usize) -> Result<Completion, String> {
        let c = Cmd::new(sqe, in_capsule, h2c, c2h_len);
        match self.execute_raw(c.sqe, in_capsule, h2c, c2h_len) {
            Ok(done) if done.cqe.status.is_success() => Ok(done),
            Ok(done) => Err(format!("status {}", done.cqe.status)),
            Err(e) => Err(e.to_string()),
        }
    }

    /// A connection over `stream`, nothing sent or received on it yet.
    pub fn from_stream(stream: TcpStream) -> NvmeTcpConn {
        NvmeTcpConn {
            stream,
            digests: Digests::default(),
            maxh2cdata: 0,
            cpda: 0,
            h2c_chunk: 0,
            in_capsule_max: IN_CAPSULE_MAX,
            timeout: DEFAULT_TIMEOUT,
            qid: 0,
            stray: VecDeque::new(),
            next_cid: 1,
            initialized: false,
        }
    }

    /// A connected admin queue: ICReq, Connect (KATO `kato_ms`), CC.EN and
    /// CSTS.RDY. Returns the connection and the controller id.
    pub fn admin(addr: SocketAddr, digests: Digests, subnqn: &str, hostnqn: &str, kato_ms: u32) -> (NvmeTcpConn, u16) {
        let mut c = Self::connect(addr, digests);
        let cntlid = c.admin_connect(subnqn, hostnqn, kato_ms).unwrap_or_else(|s| panic!("admin Connect: {s}"));
        c.enable();
        (c, cntlid)
    }

    /// A connected I/O queue `qid` of controller `cntlid`.
    pub fn io(addr: SocketAddr, digests: Digests, cntlid: u16, qid: u16, subnqn: &str, hostnqn: &str) -> NvmeTcpConn {
        let mut c = Self::connect(addr, digests);
        c.io_connect(cntlid, qid, subnqn, hostnqn).unwrap_or_else(|s| panic!("I/O Connect of queue {qid}: {s}"));
        c
    }

    // ---- the wire

    /// Writes bytes as they are.
    pub fn raw_send(&mut self, bytes: &[u8]) {
        self.stream.write_all(bytes).expect("write to the target");
    }

    /// Like [`raw_send`](Self::raw_send), but tolerates a target that has
    /// already closed the connection (hostile tests).
    pub fn try_raw_send(&mut self, bytes: &[u8]) -> std::io::Result<()> {
        self.stream.write_all(bytes)
    }

    /// The bytes of `pdu` with `data`, with this connection's digests and
    /// the target's data alignment.
    pub fn pdu_bytes(&self, pdu: &Pdu, data: &[u8]) -> Vec<u8> {
        let align = if self.cpda == 0 { 0 } else { (self.cpda as usize + 1) * 4 };
        pdu.to_wire(self.digests, data, align)
    }

    /// Sends one PDU with its data.
    pub fn send_pdu(&mut self, pdu: &Pdu, data: &[u8]) {
        let bytes = self.pdu_bytes(pdu, data);
        self.raw_send(&bytes);
    }

    /// Like [`send_pdu`](Self::send_pdu); a target that closed or reset the
    /// connection is an Err instead of a panic.
    pub fn try_send_pdu(&mut self, pdu: &Pdu, data: &[u8]) -> Result<(), ConnError> {
        let bytes = self.pdu_bytes(pdu, data);
        self.try_raw_send(&bytes).map_err(|e| ConnError::Closed(format!("write: {e}")))
    }

    /// Reads one PDU: checks its common header, header digest and data
    /// digest; returns it and its data.
    pub fn recv_pdu(&mut self) -> Result<(Pdu, Vec<u8>), ConnError> {
        self.recv_pdu_within(self.timeout)
    }

    /// [`recv_pdu`](Self::recv_pdu) with its own deadline for the first byte.
    pub fn recv_pdu_within(&mut self, timeout: Duration) -> Result<(Pdu, Vec<u8>), ConnError> {
        let mut buf = vec![0u8; CH_SIZE];
        self.read_exact_within(&mut buf, timeout)?;
        let ch = CommonHeader::decode(&buf).map_err(|e| ConnError::Protocol(format!("{e} (header {buf:02x?})")))?;
        // A termination may come before ICResp; its layout uses no digests.
        let known = self.initialized || ch.pdu_type == rdmablk_common::nvme::tcp::PduType::C2HTermReq;
        let layout = ch
            .layout(if known { Some(self.digests) } else { None }, MAX_RX_PLEN)
            .map_err(|e| ConnError::Protocol(format!("{e} in {ch:?}")))?;
        buf.resize(layout.plen, 0);
        self.read_exact_within(&mut buf[CH_SIZE..], self.timeout)?;
        let pdu = Pdu::decode(&ch, &layout, &buf).map_err(|e| ConnError::Protocol(format!("{e} in {ch:?}")))?;
        let data = buf[layout.data_offset..layout.data_offset + layout.data_len].to_vec();
        if layout.data_digest {
            let at = layout.data_offset + layout.data_len;
            let got = u32::from_le_bytes(buf[at..at + DIGEST_SIZE].try_into().unwrap());
            let want = digest(&data);
            if got != want {
                return Err(ConnError::Protocol(format!("data digest {got:#010x}, computed {want:#010x} in {pdu:?}")));
            }
        }
        if matches!(pdu, Pdu::IcResp(_)) {
            self.initialized = true;
        }
        Ok((pdu, data))
    }

    fn read_exact_within(&mut self, buf: &mut [u8], timeout: Duration) -> Result<(), ConnError> {
        let deadline = Instant::now() + timeout;
        let mut got = 0;
        while got < buf.len() {
            let left = deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1));
            self.stream.set_read_timeout(Some(left)).unwrap();
            match self.stream.read(&mut buf[got..]) {
                Ok(0) => return Err(ConnError::Closed(format!("EOF after {got} of {} bytes", buf.len()))),
                Ok(n) => got += n,
                Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {
                    if Instant::now() >= deadline {
                        return if got == 0 {
                            Err(ConnError::Timeout)
                        } else {
                            Err(ConnError::Protocol(format!("stalled after {got} of {} bytes", buf.len())))
                        };
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(ConnError::Closed(e.to_string())),
            }
        }
        Ok(())
    }

    /// Reads until the target ends the connection or `timeout` passes,
    /// noting a C2HTermReq and whatever else came.
    pub fn wait_for_termination(&mut self, timeout: Duration) -> Termination {
        let deadline = Instant::now() + timeout;
        let mut t = Termination::default();
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                t.end = "timeout".into();
                return t;
            }
            match self.recv_pdu_within(left) {
                Ok((Pdu::C2HTermReq(term), data)) => t.term = Some((term, data)),
                Ok((pdu, _)) => t.other.push(pdu),
                Err(ConnError::Closed(why)) => {
                    t.closed = true;
                    t.end = why;
                    return t;
                }
                Err(ConnError::Timeout) => {
                    t.end = "timeout".into();
                    return t;
                }
                Err(e) => {
                    // Unparseable bytes: note them and keep reading to the end.
                    t.end = e.to_string();
                    let mut sink = [0u8; 4096];
                    let left = deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1));
                    self.stream.set_read_timeout(Some(left)).unwrap();
                    match self.stream.read(&mut sink) {
                        Ok(0) | Err(_) => {
                            t.closed = true;
                            return t;
                        }
                        Ok(_) => {}
                    }
                }
            }
        }
    }

    /// Ends the connection with a TCP reset: SO_LINGER {on, 0 s}, then
    /// close, so the kernel sends an RST instead of a FIN and drops what
    /// was not sent yet; whatever the target has in flight stays so.
    pub fn reset(self) {
        let linger = libc::linger { l_onoff: 1, l_linger: 0 };
        let fd = std::os::fd::AsRawFd::as_raw_fd(&self.stream);
        // SAFETY: `fd` is the stream's open socket and `linger` a live
        // value of the size passed.
        let r = unsafe {
            libc::setsockopt(
                fd,
                libc::SOL_SOCKET,
                libc::SO_LINGER,
                (&linger as *const libc::linger).cast(),
                std::mem::size_of::<libc::linger>() as libc::socklen_t,
            )
        };
        assert_eq!(r, 0, "SO_LINGER: {}", std::io::Error::last_os_error());
        drop(self.stream);
    }

    // ---- commands

    /// Sends `sqe` with a fresh command id and `in_capsule` data, its SGL
    /// as the caller set it, and waits for nothing. Returns the command id.
    pub fn send_command(&mut self, mut sqe: SubmissionEntry, in_capsule: &[u8]) -> u16 {
        sqe.cid = self.take_cid();
        self.send_pdu(&Pdu::CapsuleCmd(sqe), in_capsule);
        sqe.cid
    }

    /// Sends `data` as one H2CData PDU at `offset` of command `cccid`'s
    /// transfer `ttag` (from its R2T); `last` sets LAST_PDU.
    pub fn send_h2c(&mut self, cccid: u16, ttag: u16, offset: u32, data: &[u8], last: bool) {
        let d = DataPdu { cccid, ttag, offset, length: data.len() as u32, last, success: false };
        self.send_pdu(&Pdu::H2CData(d), data);
    }

    /// A fresh command id.
    pub fn take_cid(&mut self) -> u16 {
        let cid = self.next_cid;
        self.next_cid = self.next_cid.wrapping_add(1);
        cid
    }

    /// Runs one command: sends `sqe` (a fresh command id) with
    /// `in_capsule` data, answers R2Ts from `h2c`, collects up to `c2h_len`
    /// bytes of C2HData, and returns the completion. The caller sets the
    /// SGL; see [`exec`](Self::exec) for the usual choice.
    pub fn execute_raw(
        &mut self,
        sqe: SubmissionEntry,
        in_capsule: &[u8],
        h2c: &[u8],
        c2h_len: usize,
    ) -> Result<Completion, ConnError> {
        let mut done = self.execute_many(&[Cmd { sqe, in_capsule, h2c, c2h_len }])?;
        Ok(done.remove(0))
    }

    /// Submits every command at once (fresh command ids, in order), then
    /// serves the target's R2Ts and collects C2HData and completions in
    /// whatever order they come. Returns the completions in command order.
    pub fn execute_many(&mut self, cmds: &[Cmd<'_>]) -> Result<Vec<Completion>, ConnError> {
        struct State {
            cid: u16,
            opcode: u8,
            data: Vec<u8>,
            received: usize,
            done: Option<CompletionEntry>,
        }
        let mut states = Vec::with_capacity(cmds.len());
        for c in cmds {
            let mut sqe = c.sqe;
            sqe.cid = self.take_cid();
            self.try_send_pdu(&Pdu::CapsuleCmd(sqe), c.in_capsule)?;
            states.push(State { cid: sqe.cid, opcode: sqe.opcode, data: vec![0u8; c.c2h_len], received: 0, done: None });
        }
        let find = |states: &[State], cid: u16| states.iter().position(|s| s.cid == cid && s.done.is_none());
        while states.iter().any(|s| s.done.is_none()) {
            match self.recv_pdu()? {
                (Pdu::CapsuleResp(cqe), _) => match find(&states, cqe.cid) {
                    Some(i) => {
                        let st = &mut states[i];
                        if cqe.status.is_success() && st.received != st.data.len() {
                            return Err(ConnError::Protocol(format!(
                                "command {} (opcode {:#04x}) succeeded after {} of {} bytes of C2HData",
                                st.cid,
                                st.opcode,
                                st.received,
                                st.data.len()
                            )));
                        }
                        st.done = Some(cqe);
                    }
                    None => self.stray.push_back(cqe),
                },
                (Pdu::C2HData(d), bytes) => {
                    let Some(i) = find(&states, d.cccid) else {
                        return Err(ConnError::Protocol(format!("C2HData for no outstanding command: {d:?}")));
                    };
                    let st = &mut states[i];
                    // Linux's host (drivers/nvme/host/tcp.c) copies C2HData
                    // into the request in arrival order and never reads
                    // DATAO: data sent out of order lands at the wrong place
                    // there, so this host refuses it.
                    if d.offset as usize != st.received {
                        return Err(ConnError::Protocol(format!(
                            "C2HData at {}+{} for command {} after {} bytes of its data: not in order",
                            d.offset,
                            bytes.len(),
                            st.cid,
                            st.received
                        )));
                    }
                    let end = d.offset as usize + bytes.len();
                    if end > st.data.len() {
                        return Err(ConnError::Protocol(format!(
                            "C2HData at {}+{} beyond the {} bytes command {} asked for",
                            d.offset,
                            bytes.len(),
                            st.data.len(),
                            st.cid
                        )));
                    }
                    st.data[d.offset as usize..end].copy_from_slice(&bytes);
                    st.received += bytes.len();
                    if d.success {
                        // SQ flow control is on (CATTR 0): the CapsuleResp
                        // carries SQHD, so SUCCESS must not be used.
                        return Err(ConnError::Protocol(format!(
                            "C2HData with the SUCCESS flag on a queue with SQ flow control: {d:?}"
                        )));
                    }
                }
                (Pdu::R2T(r), _) => {
                    let Some(i) = find(&states, r.cccid) else {
                        return Err(ConnError::Protocol(format!("R2T for no outstanding command: {r:?}")));
                    };
                    let h2c = cmds[i].h2c;
                    let end = r.offset as u64 + r.length as u64;
                    if end > h2c.len() as u64 {
                        return Err(ConnError::Protocol(format!(
                            "R2T {r:?} beyond the {} bytes command {} has to send",
                            h2c.len(),
                            r.cccid
                        )));
                    }
                    let mut off = r.offset as usize;
                    let end = end as usize;
                    let chunk = self.h2c_chunk.max(1) as usize;
                    while off < end {
                        let n = chunk.min(end - off);
                        let d = DataPdu {
                            cccid: r.cccid,
                            ttag: r.ttag,
                            offset: off as u32,
                            length: n as u32,
                            last: off + n == end,
                            success: false,
                        };
                        self.try_send_pdu(&Pdu::H2CData(d), &h2c[off..off + n])?;
                        off += n;
                    }
                }
                (Pdu::C2HTermReq(term), data) => return Err(ConnError::Terminated { term, data }),
                (other, _) => return Err(ConnError::Protocol(format!("unexpected {other:?} from the target"))),
            }
        }
        Ok(states.into_iter().map(|s| Completion { cqe: s.done.expect("done"), data: s.data }).collect())
    }

    /// Runs one command with the usual SGL: in-capsule data if any, else a
    /// transport SGL covering `h2c` or `c2h_len`, else none. Panics on a
    /// transport failure (the tests that expect one use `execute_raw`).
    pub fn exec(&mut self, sqe: SubmissionEntry, in_capsule: &[u8], h2c: &[u8], c2h_len: usize) -> Completion {
        let c = Cmd::new(sqe, in_capsule, h2c, c2h_len);
        self.execute_raw(c.sqe, in_capsule, h2c, c2h_len)
            .unwrap_or_else(|e| panic!("command opcode {:#04x} on queue {}: {e}", sqe.opcode, self.qid))
    }

    /// Like [`exec`](Self::exec); Err with the status unless it succeeded.
    pub fn exec_ok(&mut self, sqe: SubmissionEntry, in_capsule: &[u8], h2c: &[u8], c2h_len: usize) -> Result<Completion, Status> {
        let c = self.exec(sqe, in_capsule, h2c, c2h_len);
        if c.cqe.status.is_success() {
            Ok(c)
        } else {
            Err(c.cqe.status)
        }
    }

    // ---- Fabrics

    /// Connect on the admin queue (controller id 0xFFFF); returns the
    /// controller id from DW0.
    pub fn admin_connect(&mut self, subnqn: &str, hostnqn: &str, kato_ms: u32) -> Result<u16, Status> {
        let data = connect_data(ANY_CONTROLLER, subnqn, hostnqn);
        let c = self.exec_ok(connect_entry(0, 31, kato_ms), &data, &[], 0)?;
        self.qid = 0;
        Ok(c.cqe.result as u16)
    }

    /// Connect of I/O queue `qid` to controller `cntlid`.
    pub fn io_connect(&mut self, cntlid: u16, qid: u16, subnqn: &str, hostnqn: &str) -> Result<CompletionEntry, Status> {
        self.io_connect_sized(cntlid, qid, 31, subnqn, hostnqn)
    }

    /// [`io_connect`](Self::io_connect) with a 0-based `sqsize` (Linux
    /// asks for 127).
    pub fn io_connect_sized(&mut self, cntlid: u16, qid: u16, sqsize: u16, subnqn: &str, hostnqn: &str) -> Result<CompletionEntry, Status> {
        let data = connect_data(cntlid, subnqn, hostnqn);
        let c = self.exec_ok(connect_entry(qid, sqsize, 0), &data, &[], 0)?;
        self.qid = qid;
        Ok(c.cqe)
    }

    /// Fabrics Disconnect of this queue.
    pub fn disconnect(&mut self) -> Result<(), Status> {
        let mut e = SubmissionEntry::new(admin_opcode::FABRICS, 0);
        e.nsid = rdmablk_common::nvme::fabrics::fctype::DISCONNECT as u32;
        self.exec_ok(e, &[], &[], 0).map(|_| ())
    }

    pub fn property_get(&mut self, offset: u32, wide: bool) -> Result<u64, Status> {
        let e = Property { offset, wide, value: 0 }.to_entry(0, false);
        Ok(self.exec_ok(e, &[], &[], 0)?.cqe.result)
    }

    pub fn property_set(&mut self, offset: u32, value: u32) -> Result<(), Status> {
        let e = Property { offset, wide: false, value: value as u64 }.to_entry(0, true);
        self.exec_ok(e, &[], &[], 0).map(|_| ())
    }

    /// Sets CC (EN, IOSQES, IOCQES) and polls CSTS until RDY (5 s at most).
    pub fn enable(&mut self) {
        self.property_set(property::CC, CC_ENABLE as u32).unwrap_or_else(|s| panic!("Property Set CC: {s}"));
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let csts = self.property_get(property::CSTS, false).unwrap_or_else(|s| panic!("Property Get CSTS: {s}"));
            assert_eq!(csts & 0x2, 0, "CSTS.CFS is set ({csts:#x})");
            if csts & 1 == 1 {
                return;
            }
            assert!(Instant::now() < deadline, "CSTS.RDY not set within 5 s of CC.EN ({csts:#x})");
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    // ---- admin commands

    /// Identify with `cns` for `nsid`: the 4,096 bytes.
    pub fn identify(&mut self, cns: u8, nsid: u32) -> Result<Vec<u8>, Status> {
        let mut e = SubmissionEntry::new(admin_opcode::IDENTIFY, 0);
        e.nsid = nsid;
        e.cdw[0] = cns as u32;
        Ok(self.exec_ok(e, &[], &[], 4096)?.data)
    }

    /// Get Log Page `lid`, `len` bytes (a multiple of 4).
    pub fn get_log_page(&mut self, lid: u8, nsid: u32, len: usize) -> Result<Vec<u8>, Status> {
        self.get_log_page_with(lid, nsid, len, 0, false)
    }

    /// Get Log Page with a log specific field `lsp` (CDW10 bits 14:8) and
    /// Retain Asynchronous Event (`rae`, bit 15).
    pub fn get_log_page_with(&mut self, lid: u8, nsid: u32, len: usize, lsp: u8, rae: bool) -> Result<Vec<u8>, Status> {
        let mut e = SubmissionEntry::new(admin_opcode::GET_LOG_PAGE, 0);
        e.nsid = nsid;
        let numd = (len / 4 - 1) as u32;
        e.cdw[0] = lid as u32 | ((lsp & 0x7f) as u32) << 8 | (rae as u32) << 15 | (numd & 0xffff) << 16;
        e.cdw[1] = numd >> 16;
        Ok(self.exec_ok(e, &[], &[], len)?.data)
    }

    /// Set Features `fid` with dword 11 `value`; returns DW0.
    pub fn set_features(&mut self, fid: u8, value: u32) -> Result<u64, Status> {
        let mut e = SubmissionEntry::new(admin_opcode::SET_FEATURES, 0);
        e.cdw[0] = fid as u32;
        e.cdw[1] = value;
        Ok(self.exec_ok(e, &[], &[], 0)?.cqe.result)
    }

    /// Get Features `fid` (current value); returns DW0.
    pub fn get_features(&mut self, fid: u8) -> Result<u64, Status> {
        let mut e = SubmissionEntry::new(admin_opcode::GET_FEATURES, 0);
        e.cdw[0] = fid as u32;
        Ok(self.exec_ok(e, &[], &[], 0)?.cqe.result)
    }

    pub fn keep_alive(&mut self) -> Result<(), Status> {
        self.exec_ok(SubmissionEntry::new(admin_opcode::KEEP_ALIVE, 0), &[], &[], 0).map(|_| ())
    }

    /// Waits up to `within` for the completion of command `cid` sent
    /// earlier (an AER): from the strays, else from the connection (other
    /// completions that come meanwhile go to the strays).
    pub fn wait_completion(&mut self, cid: u16, within: Duration) -> Result<CompletionEntry, ConnError> {
        if let Some(i) = self.stray.iter().position(|c| c.cid == cid) {
            return Ok(self.stray.remove(i).expect("found"));
        }
        let deadline = Instant::now() + within;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(ConnError::Timeout);
            }
            match self.recv_pdu_within(left)? {
                (Pdu::CapsuleResp(c), _) if c.cid == cid => return Ok(c),
                (Pdu::CapsuleResp(c), _) => self.stray.push_back(c),
                (Pdu::C2HTermReq(term), data) => return Err(ConnError::Terminated { term, data }),
                (other, _) => return Err(ConnError::Protocol(format!("{other:?} while waiting for the completion of command {cid}"))),
            }
        }
    }

    /// Sends an Asynchronous Event Request (it stays outstanding); returns its id.
    pub fn submit_aer(&mut self) -> u16 {
        let mut e = SubmissionEntry::new(admin_opcode::ASYNC_EVENT_REQUEST, 0);
        let cid = self.take_cid();
        e.cid = cid;
        self.send_pdu(&Pdu::CapsuleCmd(e), &[]);
        cid
    }

    // ---- I/O commands

    /// Read of `blocks` blocks of `block_size` bytes at `slba`.
    pub fn read(&mut self, nsid: u32, slba: u64, blocks: u32, block_size: u32) -> Result<Vec<u8>, Status> {
        let len = blocks as usize * block_size as usize;
        Ok(self.exec_ok(rw_entry(io_opcode::READ, nsid, slba, blocks, false), &[], &[], len)?.data)
    }

    /// Write of `data` (whole blocks of `block_size`) at `slba`: in the
    /// capsule up to `in_capsule_max`, else by R2T and H2CData.
    pub fn write_bs(&mut self, nsid: u32, slba: u64, data: &[u8], block_size: u32, fua: bool) -> Result<(), Status> {
        assert!(!data.is_empty() && data.len() % block_size as usize == 0, "whole blocks");
        let blocks = (data.len() / block_size as usize) as u32;
        let e = rw_entry(io_opcode::WRITE, nsid, slba, blocks, fua);
        if data.len() <= self.in_capsule_max {
            self.exec_ok(e, data, &[], 0).map(|_| ())
        } else {
            self.exec_ok(e, &[], data, 0).map(|_| ())
        }
    }

    /// [`write_bs`](Self::write_bs) with 4 KiB blocks.
    pub fn write(&mut self, nsid: u32, slba: u64, data: &[u8], fua: bool) -> Result<(), Status> {
        self.write_bs(nsid, slba, data, 4096, fua)
    }

    pub fn flush(&mut self, nsid: u32) -> Result<(), Status> {
        let mut e = SubmissionEntry::new(io_opcode::FLUSH, 0);
        e.nsid = nsid;
        self.exec_ok(e, &[], &[], 0).map(|_| ())
    }

    pub fn write_zeroes(&mut self, nsid: u32, slba: u64, blocks: u32) -> Result<(), Status> {
        self.exec_ok(rw_entry(io_opcode::WRITE_ZEROES, nsid, slba, blocks, false), &[], &[], 0).map(|_| ())
    }

    /// Dataset Management with the Deallocate attribute for `(slba, blocks)` ranges.
    pub fn deallocate(&mut self, nsid: u32, ranges: &[(u64, u32)]) -> Result<(), Status> {
        self.deallocate_padded(nsid, ranges, ranges.len() * DSM_RANGE_SIZE)
    }

    /// The same with the data padded with zeroes to `len` bytes, as the
    /// Linux host sends it (always 4 KiB: 256 ranges' worth).
    pub fn deallocate_padded(&mut self, nsid: u32, ranges: &[(u64, u32)], len: usize) -> Result<(), Status> {
        assert!((1..=256).contains(&ranges.len()) && len >= ranges.len() * DSM_RANGE_SIZE);
        let mut data = vec![0u8; len];
        for (i, &(slba, blocks)) in ranges.iter().enumerate() {
            let out: &mut [u8; DSM_RANGE_SIZE] = (&mut data[i * DSM_RANGE_SIZE..(i + 1) * DSM_RANGE_SIZE]).try_into().unwrap();
            DsmRange { attributes: 0, blocks, slba }.encode(out);
        }
        let mut e = SubmissionEntry::new(io_opcode::DATASET_MANAGEMENT, 0);
        e.nsid = nsid;
        e.cdw[0] = ranges.len() as u32 - 1;
        e.cdw[1] = 1 << 2;
        self.exec_ok(e, &data, &[], 0).map(|_| ())
    }
}

// ---- in-band authentication (DH-HMAC-CHAP), the host's side

/// Writes `secret` as `nvme gen-dhchap-key` prints it to `dir/name`, mode
/// 0600 (the target refuses a key file others may read): the path for a
/// `[[host]] dhchap_key_file` or `dhchap_ctrl_key_file`.
pub fn write_dhchap_secret(dir: &std::path::Path, name: &str, secret: &Secret) -> std::path::PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let p = dir.join(name);
    std::fs::write(&p, format!("{}\n", secret.encode())).unwrap();
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600)).unwrap();
    p
}

/// A host's DH-HMAC-CHAP secrets and offer, as Linux's host makes it.
#[derive(Clone, Debug)]
pub struct HostAuth {
    pub secret: Secret,
    /// `--dhchap-ctrl-secret`: the controller must prove it holds this one.
    pub ctrl_secret: Option<Secret>,
    pub hostnqn: String,
    pub subnqn: String,
    /// Hash and DH group ids offered (Linux: all three hashes, all six groups).
    pub hashes: Vec<u8>,
    pub dh_groups: Vec<u8>,
}

impl HostAuth {
    pub fn new(secret: Secret, ctrl_secret: Option<Secret>, hostnqn: &str, subnqn: &str) -> HostAuth {
        HostAuth {
            secret,
            ctrl_secret,
            hostnqn: hostnqn.to_owned(),
            subnqn: subnqn.to_owned(),
            hashes: HashId::ALL.iter().map(|h| *h as u8).collect(),
            dh_groups: DhGroup::ALL.iter().map(|g| *g as u8).collect(),
        }
    }

    pub fn negotiate(&self, tid: u16) -> Vec<u8> {
        Message::Negotiate(Negotiate { tid, sc_c: 0, hashes: self.hashes.clone(), dh_groups: self.dh_groups.clone() }).encode()
    }
}

/// How far an authentication got: the messages the host sent (to replay
/// them), and the failure, if any.
#[derive(Debug, Default)]
pub struct AuthRun {
    pub sent: Vec<Vec<u8>>,
    pub failure: Option<String>,
}

/// An Authentication Send (`send`) or Receive entry for `len` bytes.
pub fn auth_entry(send: bool, len: u32) -> SubmissionEntry {
    use rdmablk_common::nvme::fabrics::fctype;
    let mut e = SubmissionEntry::new(admin_opcode::FABRICS, 0);
    e.nsid = if send { fctype::AUTHENTICATION_SEND } else { fctype::AUTHENTICATION_RECEIVE } as u32;
    e.cdw[0] = (SECP_DHCHAP as u32) << 24 | (SPSP as u32) << 16 | (SPSP as u32) << 8;
    e.cdw[1] = len;
    e
}

impl NvmeTcpConn {
    /// Authentication Send of one message.
    pub fn auth_send(&mut self, msg: &[u8]) -> Result<(), Status> {
        self.exec_ok(auth_entry(true, msg.len() as u32), msg, &[], 0).map(|_| ())
    }

    /// Authentication Receive into a buffer of `al` bytes (Linux: 4 KiB).
    pub fn auth_receive(&mut self, al: u32) -> Result<Message, String> {
        let c = self.exec_ok(auth_entry(false, al), &[], &[], al as usize).map_err(|s| format!("Authentication Receive: {s}"))?;
        Message::decode(&c.data).map_err(|e| format!("Authentication Receive: {e}"))
    }

    /// The whole exchange as Linux's host runs it (Negotiate, Challenge,
    /// Reply, Success1, and Success2 or Failure2 when the controller must
    /// prove its secret too) with transaction id `tid`.
    pub fn authenticate(&mut self, a: &HostAuth, tid: u16) -> AuthRun {
        let mut run = AuthRun::default();
        if let Err(e) = self.try_authenticate(a, tid, &mut run) {
            run.failure = Some(e);
        }
        run
    }

    fn try_authenticate(&mut self, a: &HostAuth, tid: u16, run: &mut AuthRun) -> Result<(), String> {
        let send = |c: &mut NvmeTcpConn, run: &mut AuthRun, m: Vec<u8>| {
            run.sent.push(m.clone());
            c.auth_send(&m).map_err(|s| format!("Authentication Send: {s}"))
        };
        send(self, run, a.negotiate(tid))?;
        let ch = match self.auth_receive(4096)? {
            Message::Challenge(ch) => ch,
            Message::Failure { explanation: e, .. } => return Err(format!("AUTH_Failure1 after Negotiate: {}", explanation::name(e))),
            m => return Err(format!("expected a Challenge, got {m:?}")),
        };
        let (key, session_key) = if ch.dh_group == DhGroup::Null {
            (None, None)
        } else {
            let k = DhKey::generate(ch.dh_group).map_err(|e| e.to_string())?;
            let sk = k.shared(&ch.dh_value).map_err(|e| format!("the controller's DH value: {e}"))?;
            (Some(k), Some(sk))
        };
        let kh = a.secret.transformed(&a.hostnqn);
        let ca = auth::augmented_challenge(ch.hash, session_key.as_deref(), &ch.c1);
        let response = auth::host_response(ch.hash, &kh, &ca, ch.seqnum, tid, &a.hostnqn, &a.subnqn);
        let (c2, s2) = match a.ctrl_secret {
            Some(_) => (Some(auth::random_bytes(ch.hash.digest_len())), auth::random_seqnum()),
            None => (None, 0),
        };
        let dh_value = key.as_ref().map_or_else(Vec::new, |k| k.public().to_vec());
        send(self, run, Message::Reply(Reply { tid, response, c2: c2.clone(), seqnum: s2, dh_value }).encode())?;
        let s1 = match self.auth_receive(4096)? {
            Message::Success1(s) => s,
            Message::Failure { explanation: e, .. } => return Err(format!("AUTH_Failure1 after Reply: {}", explanation::name(e))),
            m => return Err(format!("expected Success1, got {m:?}")),
        };
        let (Some(ctrl), Some(c2)) = (&a.ctrl_secret, c2) else { return Ok(()) };
        let kc = ctrl.transformed(&a.subnqn);
        let ca2 = auth::augmented_challenge(ch.hash, session_key.as_deref(), &c2);
        let want = auth::controller_response(ch.hash, &kc, &ca2, s2, tid, &a.hostnqn, &a.subnqn);
        if s1.response.as_deref() != Some(&want[..]) {
            let f = Message::Failure { first: false, tid, reason: auth::REASON_FAILED, explanation: explanation::FAILED };
            send(self, run, f.encode())?;
            return Err("the controller's response is wrong (AUTH_Failure2 sent)".into());
        }
        send(self, run, Message::Success2 { tid }.encode())
    }
}

// ---- Identify data

/// Fields of Identify Controller (CNS 1) the tests look at.
#[derive(Debug, Clone)]
pub struct IdCtrl {
    pub cntlid: u16,
    pub serial: String,
    /// Multi-path I/O and namespace sharing (bit 1: several controllers,
    /// bit 3: ANA reporting).
    pub cmic: u8,
    /// Asynchronous events supported (bit 8: namespace attribute, bit 11: ANA change).
    pub oaes: u32,
    pub anatt: u8,
    pub anacap: u8,
    pub anagrpmax: u32,
    pub nanagrpid: u32,
    pub mnan: u32,
    pub mdts: u8,
    pub nn: u32,
    pub sgls: u32,
    pub subnqn: String,
    /// I/O queue command capsule size, in 16-byte units.
    pub ioccsz: u32,
    /// I/O queue response capsule size, in 16-byte units.
    pub iorcsz: u32,
    /// Optional fabrics commands supported (bit 0: Disconnect).
    pub ofcs: u16,
    pub kas: u16,
}

impl IdCtrl {
    pub fn parse(b: &[u8]) -> IdCtrl {
        assert_eq!(b.len(), 4096, "Identify Controller data");
        let u16_at = |o: usize| u16::from_le_bytes([b[o], b[o + 1]]);
        let u32_at = |o: usize| u32::from_le_bytes(b[o..o + 4].try_into().unwrap());
        let nqn = &b[768..1024];
        let end = nqn.iter().position(|&c| c == 0).unwrap_or(nqn.len());
        IdCtrl {
            cntlid: u16_at(78),
            serial: String::from_utf8_lossy(&b[4..24]).trim_end().to_owned(),
            cmic: b[76],
            oaes: u32_at(92),
            anatt: b[342],
            anacap: b[343],
            anagrpmax: u32_at(344),
            nanagrpid: u32_at(348),
            mnan: u32_at(540),
            mdts: b[77],
            nn: u32_at(516),
            sgls: u32_at(536),
            subnqn: String::from_utf8_lossy(&nqn[..end]).into_owned(),
            ioccsz: u32_at(1792),
            iorcsz: u32_at(1796),
            ofcs: u16_at(1804),
            kas: u16_at(320),
        }
    }
}

/// Fields of Identify Namespace (CNS 0) the tests look at.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IdNs {
    pub nsze: u64,
    pub ncap: u64,
    pub nuse: u64,
    /// Bit 0: shared, may be attached to several controllers.
    pub nmic: u8,
    pub anagrpid: u32,
    pub eui64: [u8; 8],
    pub nlbaf: u8,
    pub flbas: u8,
    pub nguid: [u8; 16],
    /// LBADS of the format FLBAS selects: log2 of the block size.
    pub lbads: u8,
}

impl IdNs {
    pub fn parse(b: &[u8]) -> IdNs {
        assert_eq!(b.len(), 4096, "Identify Namespace data");
        let u64_at = |o: usize| u64::from_le_bytes(b[o..o + 8].try_into().unwrap());
        let flbas = b[26];
        let fmt = (flbas & 0x0f) as usize;
        IdNs {
            nsze: u64_at(0),
            ncap: u64_at(8),
            nuse: u64_at(16),
            nmic: b[30],
            anagrpid: u32::from_le_bytes(b[92..96].try_into().unwrap()),
            eui64: b[120..128].try_into().unwrap(),
            nlbaf: b[25],
            flbas,
            nguid: b[104..120].try_into().unwrap(),
            lbads: b[128 + 4 * fmt + 2],
        }
    }

    pub fn block_size(&self) -> u32 {
        1 << self.lbads
    }
}

/// The active namespace list (CNS 2): the ids up to the first 0.
pub fn parse_ns_list(b: &[u8]) -> Vec<u32> {
    b.chunks(4).map(|c| u32::from_le_bytes(c.try_into().unwrap())).take_while(|&n| n != 0).collect()
}

/// The namespace identification descriptors (CNS 3): (NIDT, NID).
pub fn parse_ns_descriptors(b: &[u8]) -> Vec<(u8, Vec<u8>)> {
    let mut out = Vec::new();
    let mut at = 0;
    while at + 4 <= b.len() && b[at] != 0 {
        let (nidt, nidl) = (b[at], b[at + 1] as usize);
        assert!(at + 4 + nidl <= b.len(), "descriptor at {at} (NIDT {nidt}, NIDL {nidl}) runs past the data");
        out.push((nidt, b[at + 4..at + 4 + nidl].to_vec()));
        at += 4 + nidl;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use rdmablk_common::nvme::tcp::R2t;
    use std::net::TcpListener;

    /// A scripted controller on a loopback socket: it reads PDUs with the
    /// same framing code and answers as `script` says.
    fn with_peer(digests: Digests, script: impl FnOnce(&mut NvmeTcpConn) + Send + 'static) -> NvmeTcpConn {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let t = std::thread::spawn(move || {
            let (s, _) = listener.accept().unwrap();
            let mut peer = NvmeTcpConn::from_stream(s);
            // The "controller" receives the ICReq (host-side framing
            // accepts any PDU type once initialized).
            let mut ch = [0u8; 128];
            peer.stream.read_exact(&mut ch).unwrap();
            assert_eq!(ch[0], 0x00, "ICReq");
            assert_eq!(ch[11], (digests.header as u8) | (digests.data as u8) << 1);
            let resp = Pdu::IcResp(rdmablk_common::nvme::tcp::IcResp { pfv: 0, cpda: 0, digests, maxh2cdata: 8192 });
            peer.raw_send(&resp.to_wire(Digests::default(), &[], 0));
            peer.digests = digests;
            peer.initialized = true;
            script(&mut peer);
        });
        let c = NvmeTcpConn::connect(addr, digests);
        std::mem::forget(t);
        c
    }

    #[test]
    fn a_read_collects_c2h_data_in_pieces_with_digests() {
        let both = Digests { header: true, data: true };
        let mut c = with_peer(both, |peer| {
            let (pdu, data) = peer.recv_pdu().unwrap();
            let Pdu::CapsuleCmd(e) = pdu else { panic!("{pdu:?}") };
            assert!(data.is_empty());
            assert_eq!((e.opcode, e.nsid, e.slba(), e.block_count()), (io_opcode::READ, 3, 10, 2));
            assert_eq!(e.sgl().unwrap(), Sgl::Transport { length: 8192 });
            let payload: Vec<u8> = (0..8192u32).map(|i| i as u8).collect();
            for (off, last) in [(0usize, false), (4096, true)] {
                let d = DataPdu { cccid: e.cid, ttag: 0, offset: off as u32, length: 4096, last, success: false };
                peer.send_pdu(&Pdu::C2HData(d), &payload[off..off + 4096]);
            }
            peer.send_pdu(&Pdu::CapsuleResp(CompletionEntry::new(e.cid, Status::SUCCESS)), &[]);
        });
        let back = c.read(3, 10, 2, 4096).unwrap();
        assert!(back.iter().enumerate().all(|(i, &b)| b == i as u8));
    }

    #[test]
    fn c2h_data_out_of_order_is_a_protocol_violation() {
        let mut c = with_peer(Digests { header: false, data: false }, |peer| {
            let (pdu, _) = peer.recv_pdu().unwrap();
            let Pdu::CapsuleCmd(e) = pdu else { panic!("{pdu:?}") };
            // The second half first: Linux's host would copy it to the start.
            let d = DataPdu { cccid: e.cid, ttag: 0, offset: 4096, length: 4096, last: false, success: false };
            peer.send_pdu(&Pdu::C2HData(d), &[1u8; 4096]);
        });
        let e = rw_entry(io_opcode::READ, 1, 0, 2, false);
        match c.execute_raw(Cmd::new(e, &[], &[], 8192).sqe, &[], &[], 8192) {
            Err(ConnError::Protocol(m)) => assert!(m.contains("at 4096+4096") && m.contains("after 0 bytes") && m.contains("not in order"), "{m}"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_large_write_answers_r2ts_with_h2c_data_and_a_small_one_goes_in_the_capsule() {
        let mut c = with_peer(Digests { header: true, data: false }, |peer| {
            let (pdu, data) = peer.recv_pdu().unwrap();
            let Pdu::CapsuleCmd(e) = pdu else { panic!("{pdu:?}") };
            assert_eq!(e.sgl().unwrap(), Sgl::InCapsule { offset: 0, length: 4096 });
            assert_eq!(data, vec![7u8; 4096]);
            peer.send_pdu(&Pdu::CapsuleResp(CompletionEntry::new(e.cid, Status::SUCCESS)), &[]);

            let (pdu, data) = peer.recv_pdu().unwrap();
            let Pdu::CapsuleCmd(e) = pdu else { panic!("{pdu:?}") };
            assert!(data.is_empty());
            assert_eq!(e.sgl().unwrap(), Sgl::Transport { length: 65536 });
            let mut got = vec![0u8; 65536];
            // Two R2Ts of 32 KiB; MAXH2CDATA is 8 KiB, so four PDUs each.
            for (ttag, off) in [(1u16, 0u32), (2, 32768)] {
                peer.send_pdu(&Pdu::R2T(R2t { cccid: e.cid, ttag, offset: off, length: 32768 }), &[]);
                for i in 0..4 {
                    let (pdu, data) = peer.recv_pdu().unwrap();
                    let Pdu::H2CData(d) = pdu else { panic!("{pdu:?}") };
                    assert_eq!((d.cccid, d.ttag, d.offset, d.length, d.last), (e.cid, ttag, off + i * 8192, 8192, i == 3));
                    got[d.offset as usize..d.offset as usize + 8192].copy_from_slice(&data);
                }
            }
            assert!(got.iter().enumerate().all(|(i, &b)| b == (i / 4096) as u8));
            peer.send_pdu(&Pdu::CapsuleResp(CompletionEntry::new(e.cid, Status::LBA_OUT_OF_RANGE)), &[]);
        });
        assert_eq!(c.write(1, 0, &[7u8; 4096], false), Ok(()));
        let data: Vec<u8> = (0..65536usize).map(|i| (i / 4096) as u8).collect();
        assert_eq!(c.write(1, 0, &data, true), Err(Status::LBA_OUT_OF_RANGE));
    }

    #[test]
    fn termination_and_bad_digests_are_reported() {
        let mut c = with_peer(Digests { header: false, data: true }, |peer| {
            let (pdu, _) = peer.recv_pdu().unwrap();
            let Pdu::CapsuleCmd(e) = pdu else { panic!("{pdu:?}") };
            // C2HData whose data digest is wrong.
            let d = DataPdu { cccid: e.cid, ttag: 0, offset: 0, length: 512, last: true, success: false };
            let mut bytes = peer.pdu_bytes(&Pdu::C2HData(d), &[1u8; 512]);
            let n = bytes.len();
            bytes[n - 1] ^= 0xff;
            peer.raw_send(&bytes);
            let (pdu, _) = peer.recv_pdu().unwrap();
            assert!(matches!(pdu, Pdu::CapsuleCmd(_)));
            let term = Pdu::C2HTermReq(TermReq { fes: 0x01, fei: 2 });
            peer.send_pdu(&term, &[0x04, 0, 24, 0, 72, 0, 0, 0]);
        });
        let e = rw_entry(io_opcode::READ, 1, 0, 1, false);
        let r = c.execute_raw(e, &[], &[], 512);
        assert!(matches!(&r, Err(ConnError::Protocol(m)) if m.contains("data digest")), "{r:?}");
        let r = c.execute_raw(SubmissionEntry::new(io_opcode::FLUSH, 0), &[], &[], 0);
        match r {
            Err(ConnError::Terminated { term, data }) => {
                assert_eq!((term.fes, term.fei), (0x01, 2));
                assert_eq!(data, vec![0x04, 0, 24, 0, 72, 0, 0, 0]);
            }
            other => panic!("{other:?}"),
        }
        let t = c.wait_for_termination(Duration::from_secs(5));
        assert!(t.closed, "{t:?}");
    }

    #[test]
    fn pipelined_commands_complete_in_any_order() {
        let mut c = with_peer(Digests::default(), |peer| {
            let mut cmds = Vec::new();
            for _ in 0..3 {
                let (pdu, _) = peer.recv_pdu().unwrap();
                let Pdu::CapsuleCmd(e) = pdu else { panic!("{pdu:?}") };
                cmds.push(e);
            }
            let (r1, r2, w) = (cmds[0], cmds[1], cmds[2]);
            assert_eq!((r1.opcode, r2.opcode, w.opcode), (io_opcode::READ, io_opcode::READ, io_opcode::WRITE));
            peer.send_pdu(&Pdu::R2T(R2t { cccid: w.cid, ttag: 9, offset: 0, length: 8192 }), &[]);
            let d = DataPdu { cccid: r2.cid, ttag: 0, offset: 0, length: 4096, last: true, success: false };
            peer.send_pdu(&Pdu::C2HData(d), &[2u8; 4096]);
            peer.send_pdu(&Pdu::CapsuleResp(CompletionEntry::new(r2.cid, Status::SUCCESS)), &[]);
            let (pdu, data) = peer.recv_pdu().unwrap();
            assert!(matches!(pdu, Pdu::H2CData(d) if d.cccid == w.cid && d.ttag == 9 && d.last && d.length == 8192), "{pdu:?}");
            assert_eq!(data, vec![3u8; 8192]);
            peer.send_pdu(&Pdu::CapsuleResp(CompletionEntry::new(w.cid, Status::SUCCESS)), &[]);
            let d = DataPdu { cccid: r1.cid, ttag: 0, offset: 0, length: 4096, last: true, success: false };
            peer.send_pdu(&Pdu::C2HData(d), &[1u8; 4096]);
            peer.send_pdu(&Pdu::CapsuleResp(CompletionEntry::new(r1.cid, Status::SUCCESS)), &[]);
        });
        let w = [3u8; 8192];
        let cmds = [
            Cmd::new(rw_entry(io_opcode::READ, 1, 0, 1, false), &[], &[], 4096),
            Cmd::new(rw_entry(io_opcode::READ, 1, 1, 1, false), &[], &[], 4096),
            Cmd::new(rw_entry(io_opcode::WRITE, 1, 2, 2, false), &[], &w, 0),
        ];
        let done = c.execute_many(&cmds).unwrap();
        assert_eq!(done[0].data, vec![1u8; 4096]);
        assert_eq!(done[1].data, vec![2u8; 4096]);
        assert!(done.iter().all(|d| d.cqe.status.is_success()));
    }

    #[test]
    fn identify_parsers() {
        let mut b = vec![0u8; 4096];
        b[0..8].copy_from_slice(&1024u64.to_le_bytes());
        b[26] = 1;
        b[128 + 4 + 2] = 9;
        let ns = IdNs::parse(&b);
        assert_eq!((ns.nsze, ns.block_size()), (1024, 512));
        let mut l = vec![0u8; 4096];
        l[0] = 1;
        l[4] = 7;
        assert_eq!(parse_ns_list(&l), vec![1, 7]);
        let mut d = vec![0u8; 4096];
        d[0..4].copy_from_slice(&[2, 16, 0, 0]);
        d[4..20].fill(0xaa);
        d[20..24].copy_from_slice(&[3, 16, 0, 0]);
        d[24..40].fill(0xbb);
        assert_eq!(parse_ns_descriptors(&d), vec![(2, vec![0xaa; 16]), (3, vec![0xbb; 16])]);
        assert_ne!(host_id_of("a"), host_id_of("b"));
        assert_eq!(connect_data(5, "nqn.a", "nqn.b")[16..18], [5, 0]);
    }
}
