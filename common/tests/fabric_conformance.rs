//! Provider conformance suite for the fabric layer.
//!
//! Uses only the public facade (`rdmablk_common::fabric`), so the same file
//! runs against any provider. The URL comes from `RDMABLK_FABRIC_URL`
//! (default `tcp://127.0.0.1:0`): the passive side listens on it, the
//! active side connects to the listener's `local_url()`. It runs against
//! tcp on the host and against the verbs provider (rdma://) on Soft-RoCE in
//! the test VM (tests/rdma-vm), where the passive side sits on rxe0 and the
//! active side reaches it through rxe1.
//!
//! The assertions are what reliable-connected hardware guarantees (checked
//! on rxe). Where hardware itself varies, the accepted statuses are listed
//! and explained at the assertion. The passive side calls `listen()` before
//! allocating its protection domain: with rdma:// that picks the device that
//! owns the address (see the verbs provider's docs).
//!
//! Progress may be manual (the tcp provider), so every wait polls both
//! sides' completion queues until a predicate holds, under a deadline: a
//! broken provider fails a test instead of hanging it.

use std::os::fd::RawFd;
use std::thread;
use std::time::{Duration, Instant};

use rdmablk_common::fabric::{
    Access, AlignedBuf, Completion, CompletionQueue, ConnectRequest, Fabric, FabricErrorKind, FabricUrl, Listener,
    MemoryRegion, Payload, ProtectionDomain, ProviderKind, QpCaps, QpState, QueuePair, RecvWr, Rkey, SendOp, SendWr, Sge,
    WcOpcode, WcStatus, WrId,
};

const PAGE: usize = 4096;
const DEADLINE: Duration = Duration::from_secs(30);
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

fn all_rights() -> Access {
    Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ
}

fn fabric_url() -> FabricUrl {
    let s = std::env::var("RDMABLK_FABRIC_URL").unwrap_or_else(|_| "tcp://127.0.0.1:0".to_owned());
    FabricUrl::parse(&s).expect("RDMABLK_FABRIC_URL")
}

fn is_tcp() -> bool {
    fabric_url().provider == ProviderKind::Tcp
}

/// Whether `fd` becomes readable within `ms` milliseconds.
fn readable(fd: RawFd, ms: i32) -> bool {
    let mut pfd = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
    // SAFETY: `pfd` is a valid pollfd for the duration of the call.
    let rc = unsafe { libc::poll(&mut pfd, 1, ms) };
    assert!(rc >= 0, "poll: {}", std::io::Error::last_os_error());
    rc > 0
}

fn pattern(seed: u64, len: usize) -> Vec<u8> {
    // xorshift: no period that a misplaced chunk could match.
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

/// A registered buffer. The region is declared first so it drops (and
/// deregisters) before the memory is freed.
struct Mem {
    mr: MemoryRegion,
    buf: AlignedBuf,
}

impl Mem {
    fn new(pd: &ProtectionDomain, len: usize, access: Access) -> Mem {
        let buf = AlignedBuf::new(len, PAGE);
        // SAFETY: `buf` lives as long as the region (field order), and the
        // tests only touch its bytes while no operation is in flight.
        let mr = unsafe { pd.register(buf.as_ptr(), buf.len(), access) }.expect("register");
        Mem { mr, buf }
    }
    fn fill(&self, byte: u8) {
        // SAFETY: no operation on this buffer is in flight.
        unsafe { self.buf.as_mut_slice() }.fill(byte);
    }
    fn put(&self, off: usize, data: &[u8]) {
        // SAFETY: as above.
        let slice = unsafe { self.buf.as_mut_slice() };
        slice[off..off + data.len()].copy_from_slice(data);
    }
    fn bytes(&self) -> Vec<u8> {
        // SAFETY: as above.
        unsafe { self.buf.as_slice() }.to_vec()
    }
    fn sge(&self, off: usize, len: usize) -> Sge {
        self.mr.sge(off, len as u32)
    }
    fn addr(&self, off: usize) -> u64 {
        self.mr.addr() + off as u64
    }
}

/// One host: fabric, protection domain, completion queue and the
/// completions polled so far.
struct Node {
    fabric: Fabric,
    pd: ProtectionDomain,
    cq: CompletionQueue,
    comps: Vec<Completion>,
}

impl Node {
    fn new(url: &FabricUrl) -> Node {
        let fabric = Fabric::open(url).expect("open fabric");
        let pd = fabric.alloc_pd().expect("alloc_pd");
        let cq = fabric.create_cq(1024).expect("create_cq");
        assert!(cq.capacity() >= 1024, "CQ of {} entries for 1024 asked", cq.capacity());
        Node { fabric, pd, cq, comps: Vec::new() }
    }
    /// The passive side: listens first, then allocates.
    fn listening(url: &FabricUrl) -> (Node, Listener) {
        let fabric = Fabric::open(url).expect("open fabric");
        let listener = fabric.listen().expect("listen");
        let pd = fabric.alloc_pd().expect("alloc_pd");
        let cq = fabric.create_cq(1024).expect("create_cq");
        (Node { fabric, pd, cq, comps: Vec::new() }, listener)
    }
    fn poll(&mut self) -> usize {
        let mut out = [Completion::EMPTY; 32];
        let n = self.cq.poll(&mut out).expect("poll");
        self.comps.extend_from_slice(&out[..n]);
        n
    }
    fn get(&self, wr: u64) -> Option<Completion> {
        self.comps.iter().copied().find(|c| c.wr_id == WrId(wr))
    }
    fn has(&self, wr: u64) -> bool {
        self.get(wr).is_some()
    }
    fn count(&self, wr: u64) -> usize {
        self.comps.iter().filter(|c| c.wr_id == WrId(wr)).count()
    }
}

/// A server (passive) and a client (active) node, connected by `connect`.
struct Env {
    server: Node,
    client: Node,
    listener: Listener,
}

impl Env {
    fn new() -> Env {
        let (server, listener) = Node::listening(&fabric_url());
        let client = Node::new(&listener.local_url());
        Env { server, client, listener }
    }

    fn next_request(&self) -> ConnectRequest {
        let deadline = Instant::now() + DEADLINE;
        loop {
            if let Some(r) = self.listener.poll_request().expect("poll_request") {
                return r;
            }
            assert!(Instant::now() < deadline, "no connect request within {DEADLINE:?}");
            readable(self.listener.fd(), 10);
        }
    }

    /// Connects a client QP to a server QP; each side's receives are posted
    /// before the connection is established. Returns (client, server).
    fn connect_with(
        &mut self,
        client_caps: QpCaps,
        server_caps: QpCaps,
        client_recvs: &[RecvWr<'_>],
        server_recvs: &[RecvWr<'_>],
    ) -> (QueuePair, QueuePair) {
        let cqp = self.client.fabric.create_qp(&self.client.pd, &self.client.cq, client_caps).expect("create_qp");
        assert_eq!(cqp.state(), QpState::Init);
        cqp.post_recv(client_recvs).expect("client post_recv");
        let connecting = thread::spawn(move || {
            let r = cqp.connect(b"hello from the client", CONNECT_TIMEOUT);
            (cqp, r)
        });
        let req = self.next_request();
        assert_eq!(req.private_data(), b"hello from the client");
        let sqp = req.into_queue_pair(&self.server.pd, &self.server.cq, server_caps).expect("into_queue_pair");
        assert_eq!(sqp.state(), QpState::Init);
        sqp.post_recv(server_recvs).expect("server post_recv");
        sqp.accept(b"welcome").expect("accept");
        let (cqp, r) = connecting.join().expect("connect thread");
        assert_eq!(r.expect("connect"), b"welcome");
        assert_eq!(cqp.state(), QpState::Ready);
        assert_eq!(sqp.state(), QpState::Ready);
        (cqp, sqp)
    }

    fn connect(&mut self, client_recvs: &[RecvWr<'_>], server_recvs: &[RecvWr<'_>]) -> (QueuePair, QueuePair) {
        self.connect_with(QpCaps::default(), QpCaps::default(), client_recvs, server_recvs)
    }

    fn poll_both(&mut self) -> usize {
        self.server.poll() + self.client.poll()
    }

    /// Polls both CQs until `pred` holds; panics after the deadline.
    fn pump_until(&mut self, what: &str, mut pred: impl FnMut(&Env) -> bool) {
        let deadline = Instant::now() + DEADLINE;
        loop {
            let n = self.poll_both();
            if pred(self) {
                return;
            }
            if Instant::now() > deadline {
                panic!(
                    "timed out waiting for {what}\nclient completions: {:#?}\nserver completions: {:#?}",
                    self.client.comps, self.server.comps
                );
            }
            if n == 0 {
                thread::yield_now();
            }
        }
    }

    /// Polls both CQs for `d` (to let a provider do whatever it would).
    fn pump_for(&mut self, d: Duration) {
        let end = Instant::now() + d;
        while Instant::now() < end {
            if self.poll_both() == 0 {
                thread::sleep(Duration::from_millis(1));
            }
        }
    }

    fn client_comp(&mut self, wr: u64) -> Completion {
        self.pump_until(&format!("client completion {wr}"), |e| e.client.has(wr));
        self.client.get(wr).unwrap()
    }

    fn server_comp(&mut self, wr: u64) -> Completion {
        self.pump_until(&format!("server completion {wr}"), |e| e.server.has(wr));
        self.server.get(wr).unwrap()
    }
}

fn send_wr<'a>(wr: u64, op: SendOp, sges: &'a [Sge]) -> SendWr<'a> {
    SendWr { wr_id: WrId(wr), op, payload: Payload::Sges(sges), signaled: true }
}

fn write_op(mem: &Mem, off: usize) -> SendOp {
    SendOp::RdmaWrite { remote_addr: mem.addr(off), rkey: mem.mr.rkey() }
}

fn read_op(mem: &Mem, off: usize) -> SendOp {
    SendOp::RdmaRead { remote_addr: mem.addr(off), rkey: mem.mr.rkey() }
}

fn assert_success(c: Completion, opcode: WcOpcode) {
    assert_eq!(c.status, WcStatus::Success, "{c:?}");
    assert_eq!(c.opcode, opcode, "{c:?}");
}

// ------------------------------------------------------------ data path --

#[test]
fn send_recv() {
    let mut env = Env::new();
    let rx = Mem::new(&env.server.pd, PAGE, Access::LOCAL_WRITE);
    let tx = Mem::new(&env.client.pd, PAGE, Access::LOCAL_WRITE);
    let rsges: Vec<[Sge; 1]> = (0..8).map(|i| [rx.sge(i * 512, 512)]).collect();
    let recvs: Vec<RecvWr> = rsges.iter().enumerate().map(|(i, s)| RecvWr { wr_id: WrId(100 + i as u64), sges: s }).collect();
    let (cqp, sqp) = env.connect(&[], &recvs);

    // One message from registered memory.
    tx.put(0, b"hello fabric");
    cqp.post_send(&[send_wr(1, SendOp::Send, &[tx.sge(0, 12)])]).unwrap();
    let c = env.server_comp(100);
    assert_success(c, WcOpcode::Recv);
    assert_eq!(c.byte_len, 12);
    assert_eq!(c.qp_num, sqp.qp_num());
    assert_eq!(&rx.bytes()[..12], b"hello fabric");
    let c = env.client_comp(1);
    assert_success(c, WcOpcode::Send);
    assert_eq!(c.qp_num, cqp.qp_num());

    // Inline from an unregistered buffer; the buffer is reusable at once.
    let mut stack = *b"inline payload";
    cqp.post_send(&[SendWr { wr_id: WrId(2), op: SendOp::Send, payload: Payload::Inline(&stack), signaled: true }]).unwrap();
    stack.fill(0);
    let c = env.server_comp(101);
    assert_success(c, WcOpcode::Recv);
    assert_eq!(&rx.bytes()[512..512 + 14], b"inline payload");
    assert_success(env.client_comp(2), WcOpcode::Send);

    // Several messages land in posting order, each in the next receive;
    // a zero-length SEND completes a receive with byte_len 0.
    for i in 0..5u64 {
        let msg = pattern(i, 100 + i as usize);
        tx.put(i as usize * 200, &msg);
    }
    let sges: Vec<[Sge; 1]> = (0..5).map(|i| [tx.sge(i * 200, 100 + i)]).collect();
    let mut wrs: Vec<SendWr> = sges.iter().enumerate().map(|(i, s)| send_wr(10 + i as u64, SendOp::Send, s)).collect();
    wrs.push(send_wr(15, SendOp::Send, &[]));
    cqp.post_send(&wrs).unwrap();
    env.pump_until("six receives", |e| (102..108).all(|w| e.server.has(w)) && (10..16).all(|w| e.client.has(w)));
    let data = rx.bytes();
    for i in 0..5u64 {
        let c = env.server.get(102 + i).unwrap();
        assert_success(c, WcOpcode::Recv);
        assert_eq!(c.byte_len as u64, 100 + i);
        let off = (2 + i as usize) * 512;
        assert_eq!(&data[off..off + 100 + i as usize], &pattern(i, 100 + i as usize)[..]);
    }
    assert_eq!(env.server.get(107).unwrap().byte_len, 0);
    // Send completions arrive in posting order.
    let order: Vec<u64> = env.client.comps.iter().map(|c| c.wr_id.0).filter(|w| (10..16).contains(w)).collect();
    assert_eq!(order, (10..16).collect::<Vec<_>>());
    assert_eq!(cqp.state(), QpState::Ready);
    assert_eq!(sqp.state(), QpState::Ready);
}

const SIZES: [usize; 5] = [1, 7, 4096, 64 * 1024 + 1, 1 << 20];
const GUARD: usize = 64;

#[test]
fn send_recv_sizes() {
    let mut env = Env::new();
    let rx = Mem::new(&env.server.pd, (1 << 20) + 2 * GUARD, Access::LOCAL_WRITE);
    let tx = Mem::new(&env.client.pd, 1 << 20, Access::LOCAL_WRITE);
    let (cqp, sqp) = env.connect(&[], &[]);
    for (i, &size) in SIZES.iter().enumerate() {
        rx.fill(0xEE);
        let data = pattern(size as u64 + 7, size);
        tx.put(0, &data);
        let recv = 100 + i as u64;
        // The receive is larger than the message: byte_len tells the size.
        sqp.post_recv(&[RecvWr { wr_id: WrId(recv), sges: &[rx.sge(GUARD, (1 << 20) + GUARD)] }]).unwrap();
        let wr = i as u64 + 1;
        cqp.post_send(&[send_wr(wr, SendOp::Send, &[tx.sge(0, size)])]).unwrap();
        let c = env.server_comp(recv);
        assert_success(c, WcOpcode::Recv);
        assert_eq!(c.byte_len as usize, size);
        assert_success(env.client_comp(wr), WcOpcode::Send);
        let got = rx.bytes();
        assert!(got[..GUARD].iter().all(|&b| b == 0xEE), "bytes before the receive buffer changed ({size})");
        assert!(got[GUARD..GUARD + size] == data[..], "message of {size} bytes differs");
        assert!(got[GUARD + size..].iter().all(|&b| b == 0xEE), "bytes past the message changed ({size})");
    }
    assert_eq!(cqp.state(), QpState::Ready);
    assert_eq!(sqp.state(), QpState::Ready);
}

#[test]
fn rdma_write_sizes() {
    let mut env = Env::new();
    let remote = Mem::new(&env.server.pd, (1 << 20) + 2 * GUARD, all_rights());
    let local = Mem::new(&env.client.pd, 1 << 20, Access::LOCAL_WRITE);
    let (cqp, sqp) = env.connect(&[], &[]);
    for (i, &size) in SIZES.iter().enumerate() {
        remote.fill(0xEE);
        let data = pattern(size as u64, size);
        local.put(0, &data);
        let wr = i as u64 + 1;
        cqp.post_send(&[send_wr(wr, write_op(&remote, GUARD), &[local.sge(0, size)])]).unwrap();
        assert_success(env.client_comp(wr), WcOpcode::RdmaWrite);
        let got = remote.bytes();
        assert!(got[..GUARD].iter().all(|&b| b == 0xEE), "bytes before the target changed ({size})");
        assert!(got[GUARD..GUARD + size] == data[..], "payload of {size} bytes differs");
        assert!(got[GUARD + size..].iter().all(|&b| b == 0xEE), "bytes after the target changed ({size})");
    }
    // One-sided: nothing shows up on the server's CQ.
    env.pump_for(Duration::from_millis(50));
    assert!(env.server.comps.is_empty(), "{:?}", env.server.comps);
    assert_eq!(sqp.state(), QpState::Ready);
}

#[test]
fn rdma_read_sizes() {
    let mut env = Env::new();
    let remote = Mem::new(&env.server.pd, 1 << 20, Access::LOCAL_WRITE | Access::REMOTE_READ);
    let local = Mem::new(&env.client.pd, (1 << 20) + 2 * GUARD, Access::LOCAL_WRITE);
    let (cqp, sqp) = env.connect(&[], &[]);
    for (i, &size) in SIZES.iter().enumerate() {
        let data = pattern(size as u64 + 99, size);
        remote.put(0, &data);
        local.fill(0xEE);
        let wr = i as u64 + 1;
        cqp.post_send(&[send_wr(wr, read_op(&remote, 0), &[local.sge(GUARD, size)])]).unwrap();
        let c = env.client_comp(wr);
        assert_success(c, WcOpcode::RdmaRead);
        assert_eq!(c.byte_len as usize, size);
        let got = local.bytes();
        assert!(got[..GUARD].iter().all(|&b| b == 0xEE), "bytes before the destination changed ({size})");
        assert!(got[GUARD..GUARD + size] == data[..], "payload of {size} bytes differs");
        assert!(got[GUARD + size..].iter().all(|&b| b == 0xEE), "bytes after the destination changed ({size})");
    }
    env.pump_for(Duration::from_millis(50));
    assert!(env.server.comps.is_empty(), "{:?}", env.server.comps);
    assert_eq!(sqp.state(), QpState::Ready);
}

#[test]
fn scatter_gather() {
    let mut env = Env::new();
    let caps = QpCaps { max_send_sge: 4, max_recv_sge: 4, ..QpCaps::default() };
    let rx = Mem::new(&env.server.pd, 4 * PAGE, Access::LOCAL_WRITE);
    let remote = Mem::new(&env.server.pd, 4 * PAGE, all_rights());
    let a = Mem::new(&env.client.pd, 3 * PAGE, Access::LOCAL_WRITE);
    let b = Mem::new(&env.client.pd, 2 * PAGE, Access::LOCAL_WRITE);
    rx.fill(0);
    remote.fill(0);
    let rsges = [rx.sge(0, 3000), rx.sge(3000 + 100, 7), rx.sge(8192, 3000)];
    let (cqp, _sqp) = env.connect_with(caps, caps, &[], &[RecvWr { wr_id: WrId(100), sges: &rsges }]);

    // SEND gathered from three SGEs in two regions, scattered over three.
    let p1 = pattern(1, 100);
    let p2 = pattern(2, 1);
    let p3 = pattern(3, 5000);
    a.put(10, &p1);
    b.put(0, &p2);
    a.put(PAGE, &p3);
    let ssges = [a.sge(10, 100), b.sge(0, 1), a.sge(PAGE, 5000)];
    cqp.post_send(&[send_wr(1, SendOp::Send, &ssges)]).unwrap();
    let c = env.server_comp(100);
    assert_success(c, WcOpcode::Recv);
    assert_eq!(c.byte_len, 5101);
    let msg: Vec<u8> = [&p1[..], &p2[..], &p3[..]].concat();
    let got = rx.bytes();
    assert_eq!(&got[..3000], &msg[..3000]);
    assert!(got[3000..3100].iter().all(|&x| x == 0), "gap between receive SGEs written");
    assert_eq!(&got[3100..3107], &msg[3000..3007]);
    assert!(got[3107..8192].iter().all(|&x| x == 0), "gap between receive SGEs written");
    assert_eq!(&got[8192..8192 + 2094], &msg[3007..]);
    assert!(got[8192 + 2094..].iter().all(|&x| x == 0), "bytes past the message written");
    assert_success(env.client_comp(1), WcOpcode::Send);

    // WRITE gathered from three SGEs into one remote range.
    cqp.post_send(&[send_wr(2, write_op(&remote, 50), &ssges)]).unwrap();
    assert_success(env.client_comp(2), WcOpcode::RdmaWrite);
    let got = remote.bytes();
    assert!(got[..50].iter().all(|&x| x == 0));
    assert_eq!(&got[50..50 + 5101], &msg[..]);
    assert!(got[50 + 5101..].iter().all(|&x| x == 0));

    // READ of one remote range scattered over three local SGEs.
    a.fill(0xAA);
    b.fill(0xBB);
    let dsges = [b.sge(PAGE, 1000), a.sge(0, 1), a.sge(PAGE + 7, 4100)];
    cqp.post_send(&[send_wr(3, read_op(&remote, 50), &dsges)]).unwrap();
    let c = env.client_comp(3);
    assert_success(c, WcOpcode::RdmaRead);
    assert_eq!(c.byte_len, 5101);
    let (ga, gb) = (a.bytes(), b.bytes());
    assert_eq!(&gb[PAGE..PAGE + 1000], &msg[..1000]);
    assert_eq!(ga[0], msg[1000]);
    assert_eq!(&ga[PAGE + 7..PAGE + 7 + 4100], &msg[1001..]);
    assert!(gb[..PAGE].iter().all(|&x| x == 0xBB) && gb[PAGE + 1000..].iter().all(|&x| x == 0xBB));
    assert!(ga[1..PAGE + 7].iter().all(|&x| x == 0xAA) && ga[PAGE + 7 + 4100..].iter().all(|&x| x == 0xAA));
}

#[test]
fn write_then_send_is_ordered() {
    let mut env = Env::new();
    const LEN: usize = 256 * 1024;
    let remote = Mem::new(&env.server.pd, LEN, all_rights());
    let rx = Mem::new(&env.server.pd, PAGE, Access::LOCAL_WRITE);
    let local = Mem::new(&env.client.pd, LEN + 64, Access::LOCAL_WRITE);
    let rsge = [rx.sge(0, 64)];
    let (cqp, sqp) = env.connect(&[], &[RecvWr { wr_id: WrId(1000), sges: &rsge }]);
    for round in 0..20u64 {
        let data = pattern(round, LEN);
        local.put(0, &data);
        local.put(LEN, &round.to_le_bytes());
        // The WRITE is unsignaled: only the ordering guarantees its data.
        let wsge = [local.sge(0, LEN)];
        let ssge = [local.sge(LEN, 8)];
        let write = SendWr { signaled: false, ..send_wr(1, write_op(&remote, 0), &wsge) };
        cqp.post_send(&[write, send_wr(2000 + round, SendOp::Send, &ssge)]).unwrap();
        let recv = 1000 + round;
        // Check the data the moment the receive completion is seen.
        let deadline = Instant::now() + DEADLINE;
        loop {
            env.server.poll();
            if let Some(c) = env.server.get(recv) {
                assert_success(c, WcOpcode::Recv);
                assert!(remote.bytes() == data, "round {round}: WRITE data not visible at the SEND's receive");
                assert_eq!(&rx.bytes()[..8], &round.to_le_bytes());
                break;
            }
            env.client.poll();
            assert!(Instant::now() < deadline, "round {round}: no receive completion");
        }
        sqp.post_recv(&[RecvWr { wr_id: WrId(recv + 1), sges: &rsge }]).unwrap();
        assert_success(env.client_comp(2000 + round), WcOpcode::Send);
    }
    // Only the signaled SENDs completed, in posting order.
    let ids: Vec<u64> = env.client.comps.iter().map(|c| c.wr_id.0).collect();
    assert_eq!(ids, (2000..2020).collect::<Vec<_>>());
}

#[test]
fn several_queue_pairs_share_a_cq() {
    let mut env = Env::new();
    let rx = Mem::new(&env.server.pd, PAGE, Access::LOCAL_WRITE);
    let tx = Mem::new(&env.client.pd, PAGE, Access::LOCAL_WRITE);
    let s1 = [rx.sge(0, 64)];
    let s2 = [rx.sge(64, 64)];
    let (c1, q1) = env.connect(&[], &[RecvWr { wr_id: WrId(101), sges: &s1 }]);
    let (c2, q2) = env.connect(&[], &[RecvWr { wr_id: WrId(102), sges: &s2 }]);
    assert_ne!(q1.qp_num(), q2.qp_num());
    tx.put(0, b"two");
    tx.put(8, b"one");
    c2.post_send(&[send_wr(2, SendOp::Send, &[tx.sge(0, 3)])]).unwrap();
    c1.post_send(&[send_wr(1, SendOp::Send, &[tx.sge(8, 3)])]).unwrap();
    let r1 = env.server_comp(101);
    let r2 = env.server_comp(102);
    assert_eq!(r1.qp_num, q1.qp_num());
    assert_eq!(r2.qp_num, q2.qp_num());
    assert_eq!(&rx.bytes()[..3], b"one");
    assert_eq!(&rx.bytes()[64..67], b"two");
    assert_eq!(env.client_comp(1).qp_num, c1.qp_num());
    assert_eq!(env.client_comp(2).qp_num, c2.qp_num());
}

// --------------------------------------------------------------- errors --

#[derive(Clone, Copy, Debug)]
enum Bad {
    WrongRkey,
    ForeignPdRkey,
    PastEnd,
    BeforeStart,
    Overflow,
    MissingRight,
    Deregistered,
}

/// An RDMA WRITE or READ that breaks one rule. The server's memory is three
/// pages of which only the middle one is registered; everything must stay
/// untouched, the faulting WR must complete with RemoteAccessError, both QPs
/// must end in Error and every other outstanding WR must flush.
fn remote_fault(write: bool, bad: Bad) {
    let mut env = Env::new();
    let server_mem = AlignedBuf::new(3 * PAGE, PAGE);
    // SAFETY: no operation is in flight.
    unsafe { server_mem.as_mut_slice() }.fill(0x5A);
    let access = match (bad, write) {
        (Bad::MissingRight, true) => Access::LOCAL_WRITE | Access::REMOTE_READ,
        (Bad::MissingRight, false) => Access::LOCAL_WRITE | Access::REMOTE_WRITE,
        _ => all_rights(),
    };
    // SAFETY: `server_mem` outlives the region (dropped explicitly or at the
    // end of this function, before `server_mem`).
    let mr = unsafe { env.server.pd.register(server_mem.as_ptr().add(PAGE), PAGE, access) }.unwrap();
    // A region of another protection domain on the responder's own fabric
    // (and device): its rkey is valid there, but not for this queue pair.
    let other_pd = env.server.fabric.alloc_pd().expect("second protection domain");
    let foreign = Mem::new(&other_pd, PAGE, all_rights());
    let local = Mem::new(&env.client.pd, PAGE, Access::LOCAL_WRITE);
    local.fill(0xC3);
    let srx = Mem::new(&env.server.pd, PAGE, Access::LOCAL_WRITE);
    let crx = Mem::new(&env.client.pd, PAGE, Access::LOCAL_WRITE);
    let good = Mem::new(&env.server.pd, PAGE, all_rights());
    let (rkey, addr, len) = match bad {
        Bad::WrongRkey => (Rkey(mr.rkey().0 ^ 0x8001_0001), mr.addr(), 64),
        Bad::ForeignPdRkey => (foreign.mr.rkey(), foreign.mr.addr(), 64),
        Bad::PastEnd => (mr.rkey(), mr.addr() + PAGE as u64 - 10, 100),
        Bad::BeforeStart => (mr.rkey(), mr.addr() - 10, 100),
        Bad::Overflow => (mr.rkey(), u64::MAX - 10, 100),
        Bad::MissingRight | Bad::Deregistered => (mr.rkey(), mr.addr(), 64),
    };
    let mut mr = Some(mr);
    if let Bad::Deregistered = bad {
        drop(mr.take());
    }
    let s0 = [srx.sge(0, 64)];
    let s1 = [srx.sge(64, 64)];
    let c0 = [crx.sge(0, 64)];
    let (cqp, sqp) = env.connect(
        &[RecvWr { wr_id: WrId(200), sges: &c0 }],
        &[RecvWr { wr_id: WrId(100), sges: &s0 }, RecvWr { wr_id: WrId(101), sges: &s1 }],
    );
    let op = if write {
        SendOp::RdmaWrite { remote_addr: addr, rkey }
    } else {
        SendOp::RdmaRead { remote_addr: addr, rkey }
    };
    let lsge = [local.sge(0, len)];
    let msg = [local.sge(0, 8)];
    // A valid WRITE, the faulting WR, then an unsignaled and a signaled
    // SEND behind it.
    local.put(PAGE - 8, b"in order");
    let good_sge = [local.sge(PAGE - 8, 8)];
    cqp.post_send(&[
        send_wr(0, write_op(&good, 0), &good_sge),
        send_wr(1, op, &lsge),
        SendWr { signaled: false, ..send_wr(2, SendOp::Send, &msg) },
        send_wr(3, SendOp::Send, &msg),
    ])
    .unwrap();
    let what = format!("{bad:?} {}", if write { "WRITE" } else { "READ" });
    env.pump_until(&what, |e| {
        [0, 1, 2, 3, 200].iter().all(|&w| e.client.has(w))
            && [100, 101].iter().all(|&w| e.server.has(w))
            && cqp.state() == QpState::Error
            && sqp.state() == QpState::Error
    });
    // The WR before the fault was executed by the peer: it succeeds.
    let c = env.client.get(0).unwrap();
    assert_eq!(c.status, WcStatus::Success, "{what}: {c:?}");
    assert_eq!(&good.bytes()[..8], b"in order", "{what}");
    let c = env.client.get(1).unwrap();
    assert_eq!(c.status, WcStatus::RemoteAccessError, "{what}: {c:?}");
    for w in [2, 3, 200] {
        assert_eq!(env.client.get(w).unwrap().status, WcStatus::WrFlushError, "{what}: client WR {w}");
    }
    for w in [100, 101] {
        assert_eq!(env.server.get(w).unwrap().status, WcStatus::WrFlushError, "{what}: server WR {w}");
    }
    // Each WR completed exactly once.
    for w in [0, 1, 2, 3, 200] {
        assert_eq!(env.client.count(w), 1, "{what}: client WR {w}");
    }
    // Send-queue completions in posting order.
    let order: Vec<u64> = env.client.comps.iter().map(|c| c.wr_id.0).filter(|&w| w < 100).collect();
    assert_eq!(order, [0, 1, 2, 3], "{what}");
    // SAFETY: both QPs are in error; nothing is in flight.
    assert!(unsafe { server_mem.as_slice() }.iter().all(|&b| b == 0x5A), "{what}: server memory changed");
    assert!(local.bytes()[..PAGE - 8].iter().all(|&b| b == 0xC3), "{what}: local memory changed");
    assert!(srx.bytes().iter().all(|&b| b == 0), "{what}: a flushed receive was written");
    drop(mr);
}

#[test]
fn write_with_wrong_rkey() {
    remote_fault(true, Bad::WrongRkey);
}
#[test]
fn write_with_rkey_of_another_pd() {
    remote_fault(true, Bad::ForeignPdRkey);
}
#[test]
fn write_past_region_end() {
    remote_fault(true, Bad::PastEnd);
}
#[test]
fn write_before_region_start() {
    remote_fault(true, Bad::BeforeStart);
}
#[test]
fn write_with_address_overflow() {
    remote_fault(true, Bad::Overflow);
}
#[test]
fn write_without_remote_write() {
    remote_fault(true, Bad::MissingRight);
}
#[test]
fn write_to_deregistered_region() {
    remote_fault(true, Bad::Deregistered);
}
#[test]
fn read_with_wrong_rkey() {
    remote_fault(false, Bad::WrongRkey);
}
#[test]
fn read_with_rkey_of_another_pd() {
    remote_fault(false, Bad::ForeignPdRkey);
}
#[test]
fn read_past_region_end() {
    remote_fault(false, Bad::PastEnd);
}
#[test]
fn read_before_region_start() {
    remote_fault(false, Bad::BeforeStart);
}
#[test]
fn read_with_address_overflow() {
    remote_fault(false, Bad::Overflow);
}
#[test]
fn read_without_remote_read() {
    remote_fault(false, Bad::MissingRight);
}
#[test]
fn read_from_deregistered_region() {
    remote_fault(false, Bad::Deregistered);
}

#[test]
fn send_without_posted_receive_is_rnr() {
    let mut env = Env::new();
    let tx = Mem::new(&env.client.pd, PAGE, Access::LOCAL_WRITE);
    let crx = Mem::new(&env.client.pd, PAGE, Access::LOCAL_WRITE);
    let c0 = [crx.sge(0, 64)];
    let (cqp, sqp) = env.connect(&[RecvWr { wr_id: WrId(200), sges: &c0 }], &[]);
    cqp.post_send(&[send_wr(1, SendOp::Send, &[tx.sge(0, 16)]), send_wr(2, SendOp::Send, &[tx.sge(0, 16)])]).unwrap();
    env.pump_until("RNR", |e| [1, 2, 200].iter().all(|&w| e.client.has(w)) && cqp.state() == QpState::Error);
    assert_eq!(env.client.get(1).unwrap().status, WcStatus::RnrRetryExceeded);
    assert_eq!(env.client.get(2).unwrap().status, WcStatus::WrFlushError);
    assert_eq!(env.client.get(200).unwrap().status, WcStatus::WrFlushError);
    // The responder only sent a NAK: it stays Ready and sees nothing.
    env.pump_for(Duration::from_millis(100));
    assert_eq!(sqp.state(), QpState::Ready);
    assert!(env.server.comps.is_empty(), "{:?}", env.server.comps);
    // Once the failed side goes away, the responder learns it.
    drop(cqp);
    env.pump_until("the responder sees the peer leave", |_| sqp.state() == QpState::Error);
}

#[test]
fn send_longer_than_receive() {
    let mut env = Env::new();
    let tx = Mem::new(&env.client.pd, PAGE, Access::LOCAL_WRITE);
    let rx = Mem::new(&env.server.pd, PAGE, Access::LOCAL_WRITE);
    rx.fill(0x77);
    let r0 = [rx.sge(0, 16)];
    let r1 = [rx.sge(1024, 512)];
    let (cqp, sqp) = env.connect(&[], &[RecvWr { wr_id: WrId(100), sges: &r0 }, RecvWr { wr_id: WrId(101), sges: &r1 }]);
    tx.fill(0x11);
    cqp.post_send(&[send_wr(1, SendOp::Send, &[tx.sge(0, 100)]), send_wr(2, SendOp::Send, &[tx.sge(0, 8)])]).unwrap();
    env.pump_until("length error", |e| {
        [1, 2].iter().all(|&w| e.client.has(w))
            && [100, 101].iter().all(|&w| e.server.has(w))
            && cqp.state() == QpState::Error
            && sqp.state() == QpState::Error
    });
    // Hardware varies here: the IB spec and mlx5 report LOC_LEN_ERR at the
    // receiver and REM_INV_REQ_ERR at the sender; rxe reports LOC_QP_OP_ERR
    // and REM_OP_ERR.
    let r = env.server.get(100).unwrap().status;
    assert!(matches!(r, WcStatus::LocalLengthError | WcStatus::LocalQpOperationError), "receive: {r:?}");
    assert_eq!(env.server.get(101).unwrap().status, WcStatus::WrFlushError);
    let s = env.client.get(1).unwrap().status;
    assert!(matches!(s, WcStatus::RemoteInvalidRequest | WcStatus::RemoteOperationError), "send: {s:?}");
    assert_eq!(env.client.get(2).unwrap().status, WcStatus::WrFlushError);
    let got = rx.bytes();
    assert!(got[16..].iter().all(|&b| b == 0x77), "bytes past the receive buffer written");
}

#[test]
fn invalid_local_lkey_in_send() {
    let mut env = Env::new();
    let tx = Mem::new(&env.client.pd, PAGE, Access::LOCAL_WRITE);
    let crx = Mem::new(&env.client.pd, PAGE, Access::LOCAL_WRITE);
    let c0 = [crx.sge(0, 64)];
    let (cqp, sqp) = env.connect(&[RecvWr { wr_id: WrId(200), sges: &c0 }], &[]);
    let bogus = [Sge { addr: tx.addr(0), length: 16, lkey: rdmablk_common::fabric::Lkey(tx.mr.lkey().0 ^ 0x4000_0100) }];
    let next = [tx.sge(0, 8)];
    cqp.post_send(&[send_wr(1, SendOp::Send, &bogus), send_wr(2, SendOp::Send, &next)]).unwrap();
    env.pump_until("local protection error", |e| {
        [1, 2, 200].iter().all(|&w| e.client.has(w)) && cqp.state() == QpState::Error
    });
    // mlx5 and the tcp provider: LOC_PROT_ERR; rxe: LOC_QP_OP_ERR.
    let s = env.client.get(1).unwrap().status;
    assert!(matches!(s, WcStatus::LocalProtectionError | WcStatus::LocalQpOperationError), "send: {s:?}");
    assert_eq!(env.client.get(2).unwrap().status, WcStatus::WrFlushError);
    assert_eq!(env.client.get(200).unwrap().status, WcStatus::WrFlushError);
    // A local fault is not the peer's business.
    env.pump_for(Duration::from_millis(50));
    assert_eq!(sqp.state(), QpState::Ready);
}

#[test]
fn local_sge_outside_its_region() {
    let mut env = Env::new();
    let tx = Mem::new(&env.client.pd, PAGE, Access::LOCAL_WRITE);
    let (cqp, _sqp) = env.connect(&[], &[]);
    let past = [tx.sge(PAGE - 8, 16)];
    cqp.post_send(&[send_wr(1, SendOp::Send, &past)]).unwrap();
    assert_eq!(env.client_comp(1).status, WcStatus::LocalProtectionError);
    assert_eq!(cqp.state(), QpState::Error);
}

#[test]
fn read_into_region_without_local_write() {
    let mut env = Env::new();
    let remote = Mem::new(&env.server.pd, PAGE, all_rights());
    let ro = Mem::new(&env.client.pd, PAGE, Access::NONE);
    ro.fill(0x42);
    let (cqp, sqp) = env.connect(&[], &[]);
    cqp.post_send(&[send_wr(1, read_op(&remote, 0), &[ro.sge(0, 64)])]).unwrap();
    assert_eq!(env.client_comp(1).status, WcStatus::LocalProtectionError);
    assert_eq!(cqp.state(), QpState::Error);
    assert!(ro.bytes().iter().all(|&b| b == 0x42));
    env.pump_for(Duration::from_millis(50));
    assert_eq!(sqp.state(), QpState::Ready, "the responder is not affected by the requester's local fault");
}

#[test]
fn receive_with_invalid_lkey() {
    let mut env = Env::new();
    let tx = Mem::new(&env.client.pd, PAGE, Access::LOCAL_WRITE);
    let rx = Mem::new(&env.server.pd, PAGE, Access::LOCAL_WRITE);
    rx.fill(0x33);
    let bogus =
        [Sge { addr: rx.addr(0), length: 64, lkey: rdmablk_common::fabric::Lkey(rx.mr.lkey().0 ^ 0x0100_0010) }];
    let (cqp, sqp) = env.connect(&[], &[RecvWr { wr_id: WrId(100), sges: &bogus }]);
    cqp.post_send(&[send_wr(1, SendOp::Send, &[tx.sge(0, 16)])]).unwrap();
    env.pump_until("receive protection error", |e| {
        e.server.has(100) && e.client.has(1) && sqp.state() == QpState::Error && cqp.state() == QpState::Error
    });
    // mlx5 and the tcp provider: LOC_PROT_ERR; rxe: LOC_QP_OP_ERR.
    let r = env.server.get(100).unwrap().status;
    assert!(matches!(r, WcStatus::LocalProtectionError | WcStatus::LocalQpOperationError), "receive: {r:?}");
    assert_ne!(env.client.get(1).unwrap().status, WcStatus::Success);
    assert!(rx.bytes().iter().all(|&b| b == 0x33));
}

#[test]
fn peer_disconnect_flushes_receives() {
    let mut env = Env::new();
    let rx = Mem::new(&env.server.pd, PAGE, Access::LOCAL_WRITE);
    let crx = Mem::new(&env.client.pd, PAGE, Access::LOCAL_WRITE);
    let s = [rx.sge(0, 64)];
    let c = [crx.sge(0, 64)];
    let (cqp, sqp) = env.connect(
        &[RecvWr { wr_id: WrId(200), sges: &c }, RecvWr { wr_id: WrId(201), sges: &c }],
        &[RecvWr { wr_id: WrId(100), sges: &s }, RecvWr { wr_id: WrId(101), sges: &s }],
    );
    cqp.disconnect();
    assert_eq!(cqp.state(), QpState::Error);
    env.pump_until("flushes after disconnect", |e| {
        [200, 201].iter().all(|&w| e.client.has(w))
            && [100, 101].iter().all(|&w| e.server.has(w))
            && sqp.state() == QpState::Error
    });
    for w in [200, 201] {
        assert_eq!(env.client.get(w).unwrap().status, WcStatus::WrFlushError);
    }
    for w in [100, 101] {
        assert_eq!(env.server.get(w).unwrap().status, WcStatus::WrFlushError);
    }
    // A second disconnect is harmless.
    cqp.disconnect();
    sqp.disconnect();
    env.pump_for(Duration::from_millis(20));
    assert_eq!(env.client.comps.len() + env.server.comps.len(), 4);
}

#[test]
fn dropped_peer_flushes_receives() {
    // What a crashed peer looks like: the queue pair goes without disconnect.
    for client_goes in [true, false] {
        let mut env = Env::new();
        let rx = Mem::new(&env.server.pd, PAGE, Access::LOCAL_WRITE);
        let crx = Mem::new(&env.client.pd, PAGE, Access::LOCAL_WRITE);
        let s = [rx.sge(0, 64)];
        let c = [crx.sge(0, 64)];
        let (cqp, sqp) =
            env.connect(&[RecvWr { wr_id: WrId(200), sges: &c }], &[RecvWr { wr_id: WrId(100), sges: &s }]);
        let (survivor, wr) = if client_goes {
            drop(cqp);
            (sqp, 100)
        } else {
            drop(sqp);
            (cqp, 200)
        };
        env.pump_until("the survivor's receive flushes", |e| {
            e.client.has(wr) || e.server.has(wr)
        });
        let c = env.client.get(wr).or(env.server.get(wr)).unwrap();
        assert_eq!(c.status, WcStatus::WrFlushError, "{c:?}");
        env.pump_until("the survivor in error", |_| survivor.state() == QpState::Error);
    }
}

#[test]
fn posting_to_an_errored_qp_flushes() {
    let mut env = Env::new();
    let tx = Mem::new(&env.client.pd, PAGE, Access::LOCAL_WRITE);
    let remote = Mem::new(&env.server.pd, PAGE, all_rights());
    let (cqp, _sqp) = env.connect(&[], &[]);
    cqp.disconnect();
    let sge = [tx.sge(0, 8)];
    cqp.post_send(&[
        SendWr { signaled: false, ..send_wr(1, SendOp::Send, &sge) },
        send_wr(2, write_op(&remote, 0), &sge),
        send_wr(3, read_op(&remote, 0), &sge),
    ])
    .expect("posting to an errored QP is not refused");
    cqp.post_recv(&[RecvWr { wr_id: WrId(4), sges: &sge }]).expect("post_recv to an errored QP");
    env.pump_until("flush completions", |e| (1..=4).all(|w| e.client.has(w)));
    let expect = [(1, WcOpcode::Send), (2, WcOpcode::RdmaWrite), (3, WcOpcode::RdmaRead), (4, WcOpcode::Recv)];
    for (w, op) in expect {
        let c = env.client.get(w).unwrap();
        assert_eq!(c.status, WcStatus::WrFlushError, "{c:?}");
        assert_eq!(c.opcode, op, "{c:?}");
    }
}

#[test]
fn send_queue_overflow() {
    let mut env = Env::new();
    let caps = QpCaps { max_send_wr: 4, max_recv_wr: 4, ..QpCaps::default() };
    let remote = Mem::new(&env.server.pd, PAGE, all_rights());
    let tx = Mem::new(&env.client.pd, PAGE, Access::LOCAL_WRITE);
    let (cqp, _sqp) = env.connect_with(caps, QpCaps::default(), &[], &[]);
    let n = cqp.caps().max_send_wr as u64;
    assert!(n >= 4);
    let sge = [tx.sge(0, 64)];
    let unsignaled = |w: u64| SendWr { signaled: false, ..send_wr(w, write_op(&remote, 0), &sge) };

    // n-1 unsignaled WRITEs keep their slots however long we wait...
    for w in 1..n {
        cqp.post_send(&[unsignaled(w)]).unwrap();
    }
    env.pump_for(Duration::from_millis(100));
    assert!(env.client.comps.is_empty(), "{:?}", env.client.comps);
    // ...one more slot is left...
    cqp.post_send(&[send_wr(n, write_op(&remote, 0), &sge)]).unwrap();
    // ...and then the queue is full.
    let e = cqp.post_send(&[unsignaled(n + 1)]).unwrap_err();
    assert_eq!(e.kind, rdmablk_common::fabric::FabricErrorKind::QueueFull, "{e}");
    // The signaled WRITE's completion frees all n slots.
    assert_success(env.client_comp(n), WcOpcode::RdmaWrite);
    assert_eq!(env.client.comps.len(), 1, "unsignaled WRs completed: {:?}", env.client.comps);
    // A chain longer than the queue posts what fits and reports QueueFull.
    let chain: Vec<SendWr> = (0..=n).map(|i| send_wr(100 + i, write_op(&remote, 0), &sge)).collect();
    let e = cqp.post_send(&chain).unwrap_err();
    assert_eq!(e.kind, rdmablk_common::fabric::FabricErrorKind::QueueFull, "{e}");
    env.pump_until("the posted part of the chain", |e| (100..100 + n).all(|w| e.client.has(w)));
    env.pump_for(Duration::from_millis(20));
    assert!(!env.client.has(100 + n), "the refused WR completed");
    assert_eq!(cqp.state(), QpState::Ready);

    // Receive queue: max_recv_wr receives, then QueueFull.
    let rq = cqp.caps().max_recv_wr as u64;
    for w in 0..rq {
        cqp.post_recv(&[RecvWr { wr_id: WrId(500 + w), sges: &sge }]).unwrap();
    }
    let e = cqp.post_recv(&[RecvWr { wr_id: WrId(999), sges: &sge }]).unwrap_err();
    assert_eq!(e.kind, rdmablk_common::fabric::FabricErrorKind::QueueFull, "{e}");
}

#[test]
fn argument_rules() {
    let mut env = Env::new();
    let caps = QpCaps { max_send_sge: 2, max_recv_sge: 2, max_inline_data: 64, ..QpCaps::default() };
    let tx = Mem::new(&env.client.pd, PAGE, Access::LOCAL_WRITE);
    let (cqp, _sqp) = env.connect_with(caps, QpCaps::default(), &[], &[]);
    let granted = cqp.caps();
    let too_many: Vec<Sge> = (0..=granted.max_send_sge as usize).map(|i| tx.sge(i, 1)).collect();
    let e = cqp.post_send(&[send_wr(1, SendOp::Send, &too_many)]).unwrap_err();
    assert_eq!(e.kind, FabricErrorKind::InvalidArgument, "{e}");
    let too_many: Vec<Sge> = (0..=granted.max_recv_sge as usize).map(|i| tx.sge(i, 1)).collect();
    let e = cqp.post_recv(&[RecvWr { wr_id: WrId(2), sges: &too_many }]).unwrap_err();
    assert_eq!(e.kind, FabricErrorKind::InvalidArgument, "{e}");
    let big = vec![0u8; granted.max_inline_data as usize + 1];
    let e = cqp.post_send(&[SendWr { payload: Payload::Inline(&big), ..send_wr(3, SendOp::Send, &[]) }]).unwrap_err();
    assert_eq!(e.kind, FabricErrorKind::InvalidArgument, "{e}");
    let read = read_op(&tx, 0);
    let e = cqp.post_send(&[SendWr { payload: Payload::Inline(&big[..1]), ..send_wr(4, read, &[]) }]).unwrap_err();
    assert_eq!(e.kind, FabricErrorKind::InvalidArgument, "inline RDMA READ: {e}");
    // REMOTE_WRITE without LOCAL_WRITE is refused at registration.
    let buf = AlignedBuf::new(PAGE, PAGE);
    // SAFETY: `buf` outlives any region (none is created).
    let e = unsafe { env.client.pd.register(buf.as_ptr(), PAGE, Access::REMOTE_WRITE) }.err().unwrap();
    assert_eq!(e.kind, FabricErrorKind::InvalidArgument, "{e}");
    env.pump_for(Duration::from_millis(20));
    assert!(env.client.comps.is_empty());
    assert_eq!(cqp.state(), QpState::Ready);
}

#[test]
fn objects_of_different_providers_do_not_mix() {
    if is_tcp() {
        return; // needs a second provider
    }
    let (node, listener) = Node::listening(&fabric_url());
    let tcp = Node::new(&FabricUrl::parse("tcp://127.0.0.1:9").unwrap());
    let e = node.fabric.create_qp(&tcp.pd, &node.cq, QpCaps::default()).err().expect("mixed create_qp");
    assert_eq!(e.kind, FabricErrorKind::InvalidArgument, "{e}");
    let e = tcp.fabric.create_qp(&tcp.pd, &node.cq, QpCaps::default()).err().expect("mixed create_qp");
    assert_eq!(e.kind, FabricErrorKind::InvalidArgument, "{e}");
    // A connect request turned into a queue pair with another provider's
    // objects is refused, and the peer is rejected.
    let client = Node::new(&listener.local_url());
    let cqp = client.fabric.create_qp(&client.pd, &client.cq, QpCaps::default()).unwrap();
    let connecting = thread::spawn(move || cqp.connect(b"", CONNECT_TIMEOUT).map(|_| ()));
    let deadline = Instant::now() + DEADLINE;
    let req = loop {
        if let Some(r) = listener.poll_request().unwrap() {
            break r;
        }
        assert!(Instant::now() < deadline, "no connect request");
        readable(listener.fd(), 10);
    };
    let e = req.into_queue_pair(&tcp.pd, &tcp.cq, QpCaps::default()).err().expect("mixed into_queue_pair");
    assert_eq!(e.kind, FabricErrorKind::InvalidArgument, "{e}");
    assert_eq!(connecting.join().unwrap().unwrap_err().kind, FabricErrorKind::ConnectFailed);
}

// ------------------------------------------------------- registration --

#[test]
fn keys_are_unique_and_not_sequential() {
    let fabric = Fabric::open(&fabric_url()).unwrap();
    let pds = [fabric.alloc_pd().unwrap(), fabric.alloc_pd().unwrap()];
    let buf = AlignedBuf::new(256 * 64, PAGE);
    let mut regions: Vec<MemoryRegion> = Vec::new();
    for i in 0..256 {
        let pd = &pds[i % 2];
        // SAFETY: `buf` outlives the regions (dropped at the end, before it).
        regions.push(unsafe { pd.register(buf.as_ptr().add(i * 64), 64, all_rights()) }.unwrap());
    }
    let rkeys: Vec<u32> = regions.iter().map(|r| r.rkey().0).collect();
    let lkeys: Vec<u32> = regions.iter().map(|r| r.lkey().0).collect();
    let mut sorted = rkeys.clone();
    sorted.sort_unstable();
    sorted.dedup();
    assert_eq!(sorted.len(), rkeys.len(), "duplicate rkeys");
    let mut sorted = lkeys.clone();
    sorted.sort_unstable();
    sorted.dedup();
    assert_eq!(sorted.len(), lkeys.len(), "duplicate lkeys");
    if is_tcp() {
        // Unpredictability is a property of this provider; real NICs derive
        // keys from a table index and may hand out neighbouring values.
        assert!(rkeys.iter().chain(&lkeys).all(|&k| k != 0));
        let close = rkeys.windows(2).filter(|w| w[0].abs_diff(w[1]) < 1 << 16).count();
        assert!(close <= 3, "{close} consecutive rkeys are within 65536 of each other: {rkeys:x?}");
        let all: std::collections::HashSet<u32> = rkeys.iter().chain(&lkeys).copied().collect();
        assert_eq!(all.len(), 512, "an lkey equals an rkey");
        // Keys of dropped regions are not handed out again right away.
        drop(regions);
        let again: Vec<MemoryRegion> = (0..64)
            // SAFETY: as above.
            .map(|i| unsafe { pds[0].register(buf.as_ptr().add(i * 64), 64, all_rights()) }.unwrap())
            .collect();
        let reused = again.iter().filter(|r| rkeys.contains(&r.rkey().0)).count();
        assert_eq!(reused, 0, "new registrations reuse old rkeys");
    }
}

#[test]
fn deregistration_during_placement() {
    let mut env = Env::new();
    const LEN: usize = 1 << 20;
    let target = AlignedBuf::new(LEN, PAGE);
    // SAFETY: `target` outlives the region, which is dropped below.
    let mr = unsafe { env.server.pd.register(target.as_ptr(), LEN, all_rights()) }.unwrap();
    let local = Mem::new(&env.client.pd, LEN, Access::LOCAL_WRITE);
    local.fill(0xAB);
    let (cqp, sqp) = env.connect(&[], &[]);
    let (rkey, raddr) = (mr.rkey(), mr.addr());

    // The server's CQ is polled by its own thread, as a target reactor would.
    let Env { server, mut client, listener } = env;
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let stop2 = stop.clone();
    let server_thread = thread::spawn(move || {
        let mut server = server;
        while !stop2.load(std::sync::atomic::Ordering::Relaxed) {
            if server.poll() == 0 {
                thread::yield_now();
            }
        }
        server
    });
    let sge = [local.sge(0, LEN)];
    let mut posted = 0u64;
    let mut deregistered = None;
    let deadline = Instant::now() + DEADLINE;
    loop {
        client.poll();
        let done = client.comps.len() as u64;
        if client.comps.iter().any(|c| c.status != WcStatus::Success) {
            break;
        }
        // Keep up to four 1 MiB WRITEs in flight.
        if cqp.state() == QpState::Ready && posted - done < 4 {
            posted += 1;
            cqp.post_send(&[send_wr(posted, SendOp::RdmaWrite { remote_addr: raddr, rkey }, &sge)]).unwrap();
        }
        if done >= 8 && deregistered.is_none() {
            // Writes are streaming in: deregister under the server's feet.
            deregistered = Some(done);
            drop(mr);
            // From here on the memory is ours again.
            // SAFETY: the region is gone; the provider must not touch it.
            unsafe { target.as_mut_slice() }.fill(0x11);
            break;
        }
        assert!(Instant::now() < deadline, "writes did not complete");
    }
    // Keep everything running for a while: the server keeps polling.
    let end = Instant::now() + Duration::from_millis(300);
    while Instant::now() < end {
        client.poll();
        if cqp.state() == QpState::Ready && posted - (client.comps.len() as u64) < 4 {
            posted += 1;
            let _ = cqp.post_send(&[send_wr(posted, SendOp::RdmaWrite { remote_addr: raddr, rkey }, &sge)]);
        }
        thread::yield_now();
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let server = server_thread.join().unwrap();
    // SAFETY: the region is gone; nothing may write here.
    assert!(unsafe { target.as_slice() }.iter().all(|&b| b == 0x11), "memory written after deregistration");
    let mut env = Env { server, client, listener };
    env.pump_until("the WRITE to the deregistered region fails", |e| {
        e.client.comps.iter().any(|c| c.status == WcStatus::RemoteAccessError) && cqp.state() == QpState::Error
    });
    env.pump_until("server error", |_| sqp.state() == QpState::Error);
    assert!(deregistered.is_some());
}

// ---------------------------------------------------------- connection --

#[test]
fn reject_carries_private_data() {
    let env = Env::new();
    let cqp = env.client.fabric.create_qp(&env.client.pd, &env.client.cq, QpCaps::default()).unwrap();
    let connecting = thread::spawn(move || cqp.connect(b"please", CONNECT_TIMEOUT).map(|_| ()));
    let req = env.next_request();
    assert_eq!(req.private_data(), b"please");
    assert!(!req.peer().is_empty());
    req.reject(b"no such volume: vol7");
    let e = connecting.join().unwrap().unwrap_err();
    assert_eq!(e.kind, FabricErrorKind::ConnectFailed, "{e}");
    assert!(e.to_string().contains("no such volume: vol7"), "{e}");
}

#[test]
fn connect_to_closed_port_fails() {
    let base = fabric_url();
    let probe = std::net::TcpListener::bind((base.host.as_str(), 0)).unwrap();
    let port = probe.local_addr().unwrap().port();
    drop(probe);
    let url = FabricUrl { port, ..base };
    let node = Node::new(&url);
    let qp = node.fabric.create_qp(&node.pd, &node.cq, QpCaps::default()).unwrap();
    let e = qp.connect(b"", Duration::from_secs(5)).unwrap_err();
    assert_eq!(e.kind, FabricErrorKind::ConnectFailed, "{e}");
    assert_ne!(qp.state(), QpState::Ready);
}

#[test]
fn private_data_limits() {
    let node = Node::new(&fabric_url());
    let qp = node.fabric.create_qp(&node.pd, &node.cq, QpCaps::default()).unwrap();
    let e = qp.connect(&[0u8; 257], CONNECT_TIMEOUT).unwrap_err();
    assert_eq!(e.kind, FabricErrorKind::InvalidArgument, "{e}");
    // Raw: the CM's REQ carries 56 bytes (rdma_cm); the tcp hello 256.
    let over = if is_tcp() { 257 } else { 57 };
    let e = qp.connect_raw(&vec![0u8; over], CONNECT_TIMEOUT).unwrap_err();
    assert_eq!(e.kind, FabricErrorKind::InvalidArgument, "{e}");
    assert_eq!(qp.state(), QpState::Init, "a refused argument leaves the queue pair unused");
}

#[test]
fn post_send_before_connect_is_refused() {
    let node = Node::new(&fabric_url());
    let qp = node.fabric.create_qp(&node.pd, &node.cq, QpCaps::default()).unwrap();
    let e = qp.post_send(&[send_wr(1, SendOp::Send, &[])]).unwrap_err();
    assert_eq!(e.kind, FabricErrorKind::InvalidState, "{e}");
}

// ---------------------------------------------------- completion channel --

#[test]
fn cq_fd_signals_completions() {
    let mut env = Env::new();
    let rx = Mem::new(&env.server.pd, PAGE, Access::LOCAL_WRITE);
    let tx = Mem::new(&env.client.pd, PAGE, Access::LOCAL_WRITE);
    let s = [rx.sge(0, 64)];
    let (cqp, _sqp) =
        env.connect(&[], &[RecvWr { wr_id: WrId(100), sges: &s }, RecvWr { wr_id: WrId(101), sges: &s }]);
    env.pump_for(Duration::from_millis(20));

    // Idle and armed: not readable (a reactor blocking on it does not spin).
    env.server.cq.arm().unwrap();
    assert_eq!(env.server.poll(), 0);
    assert!(!readable(env.server.cq.fd(), 100), "idle CQ fd is readable");

    // A SEND from the peer makes it readable; only the client is polled.
    cqp.post_send(&[send_wr(1, SendOp::Send, &[tx.sge(0, 8)])]).unwrap();
    let deadline = Instant::now() + DEADLINE;
    while !readable(env.server.cq.fd(), 5) {
        env.client.poll();
        assert!(Instant::now() < deadline, "CQ fd never became readable");
    }
    env.server.cq.ack_event().unwrap();
    env.pump_until("the receive", |e| e.server.has(100) && e.client.has(1));
    env.pump_for(Duration::from_millis(20));

    // Completions generated without socket activity (flushes on an errored
    // QP) fire the channel too.
    cqp.disconnect();
    env.pump_until("disconnect flushes", |e| e.server.has(101));
    env.pump_for(Duration::from_millis(50));
    env.client.cq.ack_event().unwrap();
    env.client.cq.arm().unwrap();
    assert_eq!(env.client.poll(), 0);
    assert!(!readable(env.client.cq.fd(), 50), "idle CQ of an errored QP is readable");
    cqp.post_send(&[send_wr(2, SendOp::Send, &[tx.sge(0, 8)])]).unwrap();
    assert!(readable(env.client.cq.fd(), 2000), "flush completion did not fire the channel");
    env.client.cq.ack_event().unwrap();
    assert_eq!(env.client_comp(2).status, WcStatus::WrFlushError);

    if is_tcp() {
        // tcp: arming with a completion already queued fires at once.
        cqp.post_send(&[send_wr(3, SendOp::Send, &[tx.sge(0, 8)])]).unwrap();
        env.client.cq.ack_event().unwrap();
        let mut none: [Completion; 0] = [];
        assert_eq!(env.client.cq.poll(&mut none).unwrap(), 0);
        env.client.cq.arm().unwrap();
        assert!(readable(env.client.cq.fd(), 1000), "armed CQ with a pending completion is not readable");
        env.client.cq.ack_event().unwrap();
        assert_eq!(env.client_comp(3).status, WcStatus::WrFlushError);
        // The facade's wait() sees it as well.
        cqp.post_send(&[send_wr(4, SendOp::Send, &[tx.sge(0, 8)])]).unwrap();
        assert!(env.client.cq.wait(Some(Duration::from_secs(1))).unwrap());
        assert_eq!(env.client_comp(4).status, WcStatus::WrFlushError);
        // tcp: acknowledging a wake-up disarms. The owner is awake and polls
        // before it sleeps again, after arming, so a completion queued in
        // between does not write the channel (for the owner to read back).
        env.client.cq.arm().unwrap();
        env.client.cq.ack_event().unwrap();
        cqp.post_send(&[send_wr(5, SendOp::Send, &[tx.sge(0, 8)])]).unwrap();
        assert!(!readable(env.client.cq.fd(), 50), "a CQ fired after its wake-up was acknowledged");
        env.client.cq.arm().unwrap();
        assert!(readable(env.client.cq.fd(), 1000), "arming after the acknowledgement did not fire");
        env.client.cq.ack_event().unwrap();
        assert_eq!(env.client_comp(5).status, WcStatus::WrFlushError);
    }
}

#[test]
fn listener_fd_signals_requests() {
    let env = Env::new();
    assert!(!readable(env.listener.fd(), 50), "idle listener fd is readable");
    let cqp = env.client.fabric.create_qp(&env.client.pd, &env.client.cq, QpCaps::default()).unwrap();
    let connecting = thread::spawn(move || {
        let r = cqp.connect(b"x", CONNECT_TIMEOUT);
        (cqp, r)
    });
    assert!(readable(env.listener.fd(), 10_000), "listener fd never became readable");
    let req = env.next_request();
    req.reject(b"not today");
    let (_cqp, r) = connecting.join().unwrap();
    assert_eq!(r.unwrap_err().kind, FabricErrorKind::ConnectFailed);
    assert!(env.listener.poll_request().unwrap().is_none());
}

// ----------------------------------------------------- memory windows --

/// How the peer uses a window that grants REMOTE_WRITE over 512 bytes at
/// offset 1024 of a region that itself grants no remote right.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum WindowUse {
    /// Exactly the window's bytes: placed.
    Inside,
    /// One byte before the window.
    Before,
    /// One byte past its end.
    Past,
    /// An RDMA READ through a write-only window.
    WrongRight,
    /// The region's own rkey instead of the window's.
    ParentRkey,
    /// After `invalidate_window` has taken effect.
    AfterInvalidate,
    /// After the window was dropped (and a later signaled SEND of the
    /// binder completed, so the drop's invalidation has executed).
    AfterDrop,
    /// On another queue pair between the same nodes (type 2B: the window
    /// belongs to the queue pair it was bound on).
    OtherQueuePair,
    /// After the peer's SEND with Invalidate of its rkey was received
    /// (which reports the key).
    AfterPeerInvalidate,
}

const WIN_OFF: usize = 1024;
const WIN_LEN: usize = 512;

fn window_use(how: WindowUse) {
    let mut env = Env::new();
    assert!(env.server.pd.supports_windows(), "the provider binds no memory windows");
    let target = Mem::new(&env.server.pd, 2 * PAGE, Access::LOCAL_WRITE | Access::MW_BIND);
    target.fill(0x5A);
    let data = pattern(7, WIN_LEN);
    let local = Mem::new(&env.client.pd, PAGE, Access::LOCAL_WRITE);
    local.put(0, &data);
    let srx = Mem::new(&env.server.pd, PAGE, Access::LOCAL_WRITE);
    let crx = Mem::new(&env.client.pd, PAGE, Access::LOCAL_WRITE);
    let (c0, c1) = ([crx.sge(0, 64)], [crx.sge(64, 64)]);
    let s0 = [srx.sge(0, 64)];
    let (cqp, sqp) =
        env.connect(&[RecvWr { wr_id: WrId(200), sges: &c0 }, RecvWr { wr_id: WrId(201), sges: &c1 }], &[
            RecvWr { wr_id: WrId(100), sges: &s0 },
        ]);
    let other = (how == WindowUse::OtherQueuePair).then(|| env.connect(&[], &[]));
    let window = sqp
        .bind_window(target.mr.rkey(), target.addr(WIN_OFF), WIN_LEN as u64, Access::REMOTE_WRITE)
        .expect("bind_window");
    assert_ne!(window.rkey(), target.mr.rkey());
    let rkey = window.rkey();
    // The binder tells the peer after the bind, as a command would: the
    // SEND executes after the bind on the same send queue.
    let note = [srx.sge(128, 8)];
    sqp.post_send(&[send_wr(50, SendOp::Send, &note)]).unwrap();
    assert_success(env.client_comp(200), WcOpcode::Recv);
    let mut window = Some(window);
    match how {
        WindowUse::AfterInvalidate
            if sqp.invalidate_window(window.take().unwrap(), WrId(60)).expect("invalidate_window")
                == rdmablk_common::fabric::Invalidation::Pending =>
        {
            assert_success(env.server_comp(60), WcOpcode::LocalInvalidate);
        }
        WindowUse::AfterPeerInvalidate => {
            // The window leaves the test's hands before any assertion: one
            // the peer invalidated must not be invalidated again (rxe on
            // Linux 6.12 panics), even by the unwinding of a failed check.
            // If the receive does not say so, the device may have ended it
            // all the same: it is leaked, never invalidated.
            let w = window.take().unwrap();
            let sge = [local.sge(0, 8)];
            cqp.post_send(&[send_wr(52, SendOp::SendWithInvalidate { rkey }, &sge)]).unwrap();
            let s = env.client_comp(52);
            let c = env.server_comp(100);
            if c.invalidated_rkey == Some(rkey) {
                sqp.window_invalidated_by_peer(w).expect("window_invalidated_by_peer");
            } else {
                std::mem::forget(w);
            }
            assert_success(s, WcOpcode::Send);
            assert_success(c, WcOpcode::Recv);
            assert_eq!((c.byte_len, c.invalidated_rkey), (8, Some(rkey)), "the receive reports the key it invalidated");
        }
        WindowUse::AfterDrop => {
            drop(window.take());
            sqp.post_send(&[send_wr(51, SendOp::Send, &note)]).unwrap();
            assert_success(env.server_comp(51), WcOpcode::Send);
            assert_success(env.client_comp(201), WcOpcode::Recv);
        }
        _ => {}
    }
    let at = |off: usize| target.addr(off);
    let (addr, key, write) = match how {
        WindowUse::Before => (at(WIN_OFF - 1), rkey, true),
        WindowUse::Past => (at(WIN_OFF + 1), rkey, true),
        WindowUse::WrongRight => (at(WIN_OFF), rkey, false),
        WindowUse::ParentRkey => (at(WIN_OFF), target.mr.rkey(), true),
        _ => (at(WIN_OFF), rkey, true),
    };
    let op = if write {
        SendOp::RdmaWrite { remote_addr: addr, rkey: key }
    } else {
        SendOp::RdmaRead { remote_addr: addr, rkey: key }
    };
    let sge = [local.sge(0, WIN_LEN)];
    let qp = other.as_ref().map_or(&cqp, |(c, _)| c);
    qp.post_send(&[send_wr(1, op, &sge)]).unwrap();
    let c = env.client_comp(1);
    let what = format!("{how:?}");
    let mut expect = vec![0x5Au8; 2 * PAGE];
    if how == WindowUse::Inside {
        assert_success(c, WcOpcode::RdmaWrite);
        expect[WIN_OFF..WIN_OFF + WIN_LEN].copy_from_slice(&data);
    } else {
        assert_eq!(c.status, WcStatus::RemoteAccessError, "{what}: {c:?}");
        env.pump_until(&format!("{what}: the faulting queue pair fails"), |_| qp.state() == QpState::Error);
    }
    drop(window);
    assert!(target.bytes() == expect, "{what}: the window's region does not hold what the rights allow");
    drop((cqp, sqp, other));
}

#[test]
fn window_places_exactly_its_bytes() {
    window_use(WindowUse::Inside);
}
#[test]
fn window_refuses_a_byte_before() {
    window_use(WindowUse::Before);
}
#[test]
fn window_refuses_a_byte_past() {
    window_use(WindowUse::Past);
}
#[test]
fn window_refuses_the_right_it_lacks() {
    window_use(WindowUse::WrongRight);
}
#[test]
fn window_region_rkey_grants_nothing() {
    window_use(WindowUse::ParentRkey);
}
#[test]
fn window_refused_after_invalidation() {
    window_use(WindowUse::AfterInvalidate);
}
#[test]
fn window_refused_after_drop() {
    window_use(WindowUse::AfterDrop);
}
#[test]
fn window_refused_on_another_queue_pair() {
    window_use(WindowUse::OtherQueuePair);
}
#[test]
fn window_refused_after_the_peers_send_with_invalidate() {
    window_use(WindowUse::AfterPeerInvalidate);
}

/// A plain SEND reports no invalidation. A SEND with Invalidate of a key
/// that is no window of the receiving queue pair (here a region's, which
/// an ordinary registration cannot give up) is IBTA's class J error: as
/// rxe's responder does, the SEND is acknowledged and succeeds, the
/// receive completes with `RemoteInvalidRequest` and the receiving queue
/// pair fails on its own, without a word to the sender.
#[test]
fn send_with_invalidate_of_an_unknown_key_fails_the_receive() {
    let mut env = Env::new();
    let target = Mem::new(&env.server.pd, PAGE, all_rights());
    target.fill(0x5A);
    let local = Mem::new(&env.client.pd, PAGE, Access::LOCAL_WRITE);
    local.put(0, &[0xEE; 64]);
    let srx = Mem::new(&env.server.pd, PAGE, Access::LOCAL_WRITE);
    let (s0, s1, s2) = ([srx.sge(0, 64)], [srx.sge(64, 64)], [srx.sge(128, 64)]);
    let (cqp, sqp) = env.connect(&[], &[
        RecvWr { wr_id: WrId(100), sges: &s0 },
        RecvWr { wr_id: WrId(101), sges: &s1 },
        RecvWr { wr_id: WrId(102), sges: &s2 },
    ]);
    let sge = [local.sge(0, 8)];
    cqp.post_send(&[send_wr(1, SendOp::Send, &sge)]).unwrap();
    let c = env.server_comp(100);
    assert_success(c, WcOpcode::Recv);
    assert_eq!(c.invalidated_rkey, None, "a plain SEND invalidates nothing");
    cqp.post_send(&[send_wr(2, SendOp::SendWithInvalidate { rkey: target.mr.rkey() }, &sge)]).unwrap();
    let r = env.server_comp(101);
    assert_eq!((r.status, r.invalidated_rkey), (WcStatus::RemoteInvalidRequest, None), "{r:?}");
    assert_success(env.client_comp(2), WcOpcode::Send);
    env.pump_until("the receiving queue pair fails", |_| sqp.state() == QpState::Error);
    let flushed = env.server_comp(102);
    assert_eq!(flushed.status, WcStatus::WrFlushError, "{flushed:?}");
    assert_eq!(cqp.state(), QpState::Ready, "the sender is not told");
    drop((cqp, sqp));
    // Nothing was invalidated: the region's key serves a new connection.
    let (cqp, _sqp) = env.connect(&[], &[]);
    let data = [local.sge(0, 64)];
    cqp.post_send(&[send_wr(3, write_op(&target, 0), &data)]).unwrap();
    assert_success(env.client_comp(3), WcOpcode::RdmaWrite);
    assert_eq!(target.bytes()[..64], [0xEE; 64]);
}

/// A window the peer invalidated needs nothing more from its owner:
/// invalidating it says `Done` at once and posts nothing (rxe on Linux
/// 6.12 panics on a second invalidation), and the next bind, which may
/// reuse the device's window, works under a fresh key while the old one
/// stays dead.
#[test]
fn a_window_the_peer_invalidated_is_given_back_and_bound_again() {
    let mut env = Env::new();
    let target = Mem::new(&env.server.pd, 2 * PAGE, Access::LOCAL_WRITE | Access::MW_BIND);
    target.fill(0x5A);
    let local = Mem::new(&env.client.pd, PAGE, Access::LOCAL_WRITE);
    local.put(0, &pattern(11, WIN_LEN));
    let srx = Mem::new(&env.server.pd, PAGE, Access::LOCAL_WRITE);
    let crx = Mem::new(&env.client.pd, PAGE, Access::LOCAL_WRITE);
    let (c0, c1) = ([crx.sge(0, 64)], [crx.sge(64, 64)]);
    let s0 = [srx.sge(0, 64)];
    let (cqp, sqp) = env.connect(
        &[RecvWr { wr_id: WrId(200), sges: &c0 }, RecvWr { wr_id: WrId(201), sges: &c1 }],
        &[RecvWr { wr_id: WrId(100), sges: &s0 }],
    );
    let bind = || sqp.bind_window(target.mr.rkey(), target.addr(WIN_OFF), WIN_LEN as u64, Access::REMOTE_WRITE).unwrap();
    let note = [srx.sge(128, 8)];
    let first = bind();
    let old = first.rkey();
    sqp.post_send(&[send_wr(50, SendOp::Send, &note)]).unwrap();
    assert_success(env.client_comp(200), WcOpcode::Recv);
    let sge = [local.sge(0, 8)];
    cqp.post_send(&[send_wr(1, SendOp::SendWithInvalidate { rkey: old }, &sge)]).unwrap();
    let c = env.server_comp(100);
    if c.invalidated_rkey != Some(old) {
        // The device may have ended the window all the same: leaked, never
        // invalidated a second time (rxe panics).
        std::mem::forget(first);
        panic!("the receive does not report the key it invalidated: {c:?}");
    }
    let given_back = sqp.invalidate_window(first, WrId(60)).expect("invalidate_window");
    assert_eq!(given_back, rdmablk_common::fabric::Invalidation::Done);
    assert_success(env.client_comp(1), WcOpcode::Send);

    let second = bind();
    assert_ne!(second.rkey(), old);
    sqp.post_send(&[send_wr(51, SendOp::Send, &note)]).unwrap();
    assert_success(env.client_comp(201), WcOpcode::Recv);
    let data = [local.sge(0, WIN_LEN)];
    let write = |rkey| SendOp::RdmaWrite { remote_addr: target.addr(WIN_OFF), rkey };
    cqp.post_send(&[send_wr(2, write(second.rkey()), &data)]).unwrap();
    assert_success(env.client_comp(2), WcOpcode::RdmaWrite);
    assert_eq!(target.bytes()[WIN_OFF..WIN_OFF + WIN_LEN], pattern(11, WIN_LEN)[..]);
    cqp.post_send(&[send_wr(3, write(old), &data)]).unwrap();
    assert_eq!(env.client_comp(3).status, WcStatus::RemoteAccessError, "the invalidated key came back");
    env.pump_until("the faulting queue pair fails", |_| cqp.state() == QpState::Error);
    assert!(env.server.get(60).is_none(), "a completion for an invalidation that was never posted");
    drop(second);
}

/// `window_invalidated_by_peer` checks its claim: for a window the peer did
/// not invalidate it fails, and the window is invalidated all the same.
#[test]
fn window_invalidated_by_peer_refuses_a_window_the_peer_did_not_invalidate() {
    let mut env = Env::new();
    let target = Mem::new(&env.server.pd, 2 * PAGE, Access::LOCAL_WRITE | Access::MW_BIND);
    target.fill(0x5A);
    let local = Mem::new(&env.client.pd, PAGE, Access::LOCAL_WRITE);
    let crx = Mem::new(&env.client.pd, PAGE, Access::LOCAL_WRITE);
    let srx = Mem::new(&env.server.pd, PAGE, Access::LOCAL_WRITE);
    let (c0, c1) = ([crx.sge(0, 64)], [crx.sge(64, 64)]);
    let (cqp, sqp) = env.connect(&[RecvWr { wr_id: WrId(200), sges: &c0 }, RecvWr { wr_id: WrId(201), sges: &c1 }], &[]);
    let window = sqp.bind_window(target.mr.rkey(), target.addr(WIN_OFF), WIN_LEN as u64, Access::REMOTE_WRITE).unwrap();
    let rkey = window.rkey();
    let e = sqp.window_invalidated_by_peer(window).expect_err("the peer invalidated nothing");
    assert_eq!(e.kind, FabricErrorKind::InvalidArgument, "{e}");
    // The local invalidation (posted in send-queue order) executed before
    // a later SEND's completion.
    let note = [srx.sge(0, 8)];
    sqp.post_send(&[send_wr(50, SendOp::Send, &note)]).unwrap();
    assert_success(env.server_comp(50), WcOpcode::Send);
    assert_success(env.client_comp(200), WcOpcode::Recv);
    let data = [local.sge(0, 64)];
    cqp.post_send(&[send_wr(1, SendOp::RdmaWrite { remote_addr: target.addr(WIN_OFF), rkey }, &data)]).unwrap();
    assert_eq!(env.client_comp(1).status, WcStatus::RemoteAccessError);
    assert!(target.bytes().iter().all(|&b| b == 0x5A));
}

/// Private data as stock peers (an NVMe/RDMA host) send it: no length
/// prefix; the receiver sees the bytes as sent (rdma_cm pads them), and a
/// binary reject reaches the connecting side as hex.
#[test]
fn raw_private_data_travels_as_sent() {
    let env = Env::new();
    let request: Vec<u8> = (1..=32).collect();
    let cqp = env.client.fabric.create_qp(&env.client.pd, &env.client.cq, QpCaps::default()).expect("create_qp");
    let sent = request.clone();
    let connecting = thread::spawn(move || {
        let r = cqp.connect_raw(&sent, CONNECT_TIMEOUT);
        (cqp, r)
    });
    let req = env.next_request();
    // tcp: exactly what was sent; rdma_cm: padded to the REQ's 56 bytes
    // (IB and RoCE), never cut.
    let raw = req.raw_private_data();
    assert!(raw.starts_with(&request), "{raw:?}");
    assert!(if is_tcp() { raw.len() == request.len() } else { raw[request.len()..].iter().all(|&b| b == 0) }, "{raw:?}");
    let sqp = req.into_queue_pair(&env.server.pd, &env.server.cq, QpCaps::default()).expect("into_queue_pair");
    let reply = [0u8, 0, 0x20, 0];
    sqp.accept_raw(&reply).expect("accept_raw");
    let (cqp, r) = connecting.join().expect("connect thread");
    let got = r.expect("connect_raw");
    assert!(got.starts_with(&reply), "{got:?}");
    assert!(if is_tcp() { got.len() == reply.len() } else { got[reply.len()..].iter().all(|&b| b == 0) }, "{got:?}");
    assert_eq!(cqp.state(), QpState::Ready);

    let cqp2 = env.client.fabric.create_qp(&env.client.pd, &env.client.cq, QpCaps::default()).expect("create_qp");
    let connecting = thread::spawn(move || cqp2.connect_raw(&[9; 32], CONNECT_TIMEOUT).map(drop));
    env.next_request().reject_raw(&[0, 0, 3, 0]);
    let e = connecting.join().expect("connect thread").expect_err("rejected");
    assert_eq!(e.kind, FabricErrorKind::ConnectFailed);
    assert!(e.to_string().contains("rejected by peer: [00 00 03 00"), "{e}");
    drop((cqp, sqp));
}

/// Rebinding gives a fresh rkey each time, and an old one does not come
/// back within 255 binds (the verbs device's 8-bit key).
#[test]
fn window_rkeys_are_fresh_on_rebind() {
    let mut env = Env::new();
    let target = Mem::new(&env.server.pd, PAGE, Access::LOCAL_WRITE | Access::MW_BIND);
    let (_cqp, sqp) = env.connect(&[], &[]);
    let mut keys = Vec::new();
    for i in 0..300u64 {
        let w = sqp.bind_window(target.mr.rkey(), target.addr(0), 64, Access::REMOTE_READ).expect("bind_window");
        keys.push(w.rkey().0);
        if sqp.invalidate_window(w, WrId(1000 + i)).expect("invalidate") == rdmablk_common::fabric::Invalidation::Pending
        {
            assert_success(env.server_comp(1000 + i), WcOpcode::LocalInvalidate);
        }
    }
    for (i, k) in keys.iter().enumerate() {
        let recent = &keys[i.saturating_sub(255)..i];
        assert!(!recent.contains(k), "rkey {k:#x} of bind {i} came back within 255 binds");
    }
}

#[test]
fn window_argument_rules() {
    let mut env = Env::new();
    let bindable = Mem::new(&env.server.pd, PAGE, Access::LOCAL_WRITE | Access::MW_BIND);
    let read_only = Mem::new(&env.server.pd, PAGE, Access::MW_BIND);
    let plain = Mem::new(&env.server.pd, PAGE, Access::LOCAL_WRITE | Access::REMOTE_WRITE);
    let (_cqp, sqp) = env.connect(&[], &[]);
    let bind = |mem: &Mem, off: u64, len: u64, access: Access| {
        sqp.bind_window(mem.mr.rkey(), mem.mr.addr() + off, len, access).err().map(|e| e.kind)
    };
    let invalid = Some(FabricErrorKind::InvalidArgument);
    assert_eq!(bind(&bindable, 0, 0, Access::REMOTE_READ), invalid, "zero length");
    assert_eq!(bind(&bindable, 0, 64, Access::NONE), invalid, "no right");
    assert_eq!(bind(&bindable, 0, 64, Access::LOCAL_WRITE), invalid, "a local right");
    assert_eq!(bind(&bindable, PAGE as u64 - 8, 16, Access::REMOTE_READ), invalid, "past the region");
    assert_eq!(bind(&read_only, 0, 64, Access::REMOTE_WRITE), invalid, "REMOTE_WRITE without LOCAL_WRITE");
    assert_eq!(bind(&plain, 0, 64, Access::REMOTE_READ), invalid, "a region without MW_BIND");
    let e = sqp.bind_window(Rkey(0xdead_beef), bindable.mr.addr(), 64, Access::REMOTE_READ).err().map(|e| e.kind);
    assert_eq!(e, invalid, "an unknown rkey");
    assert_eq!(bind(&read_only, 0, 64, Access::REMOTE_READ), None, "a read window over a read-only region");
    env.pump_for(Duration::from_millis(20));
    assert!(env.server.comps.is_empty(), "{:?}", env.server.comps);
    assert_eq!(sqp.state(), QpState::Ready);
}
