//! A host whose NVMe/TCP sockets are reset (TCP RST) while it has commands
//! in flight, and that reconnects at once with the same host NQN, as the
//! Linux host does after a path failure: the real daemon, the harness's
//! own NVMe/TCP host (`rdmablk_system_tests::nvme_tcp`).
//!
//! Each round puts 32 commands in flight on the two I/O queues of one
//! association: reads, 4 KiB in-capsule writes, and writes by R2T of
//! 16-128 KiB, some of which get only half of their H2CData. Most write
//! data is sent in one burst right before every socket of the association
//! is reset (SO_LINGER {on, 0}, close), so the target's queue threads are
//! in the middle of it when the resets arrive. Then:
//!
//! - a new admin Connect with the same host NQN must be answered with
//!   success within 1 s (the target's fence waits for the old
//!   association's queues, but must not lock the host out: a Connect
//!   Controller Busy, or no answer, fails the round);
//! - the old association's writes either landed before that answer or
//!   never land: every range written in the round is read back through the
//!   new association right after the answer and again 300 ms later (no
//!   change allowed), and every 4 KiB block holds either its previous
//!   content or exactly this round's version of it (each block is stamped
//!   with the round, the command and its index); a write whose completion
//!   the host saw has landed, and one that got half of its data has not.
//!
//! The new association is the next round's. `RDMABLK_TEST_SEED` replays
//! the commands' layout; `RDMABLK_RESET_ROUNDS` changes the round count.

use std::net::{Ipv4Addr, SocketAddr};
use std::path::Path;
use std::time::{Duration, Instant};

use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use rdmablk_common::nvme::fabrics::ANY_CONTROLLER;
use rdmablk_common::nvme::sqe::{io_opcode, Sgl};
use rdmablk_common::nvme::status::Status;
use rdmablk_common::nvme::tcp::{Digests, Pdu};
use rdmablk_system_tests::nvme_tcp::{connect_data, connect_entry, rw_entry, ConnError, NvmeTcpConn, DEFAULT_TIMEOUT};
use rdmablk_system_tests::stamp::{describe, stamp};
use rdmablk_system_tests::{file_volume, listen_host, sparse_file, TargetProcess};

const MIB: u64 = 1 << 20;
const VOL_SIZE: u64 = 64 * MIB;
const BS: u32 = 4096;
const BSZ: usize = BS as usize;
const _: () = assert!(BSZ == rdmablk_system_tests::stamp::STAMP_BLOCK);
const NSID: u32 = 1;
const SUBNQN: &str = "nqn.2026-11.io.rdmablk.test:nvme-reset";
const HOSTNQN: &str = "nqn.2014-08.org.nvmexpress:uuid:5e7a11ed-0b5e-4c0e-9d1e-0123456789ab";
const NO_DIGESTS: Digests = Digests { header: false, data: false };
const KATO_MS: u32 = 5000;

const ROUNDS: u32 = 50;
const IO_QUEUES: usize = 2;
/// Commands in flight per round, over the I/O queues.
const COMMANDS: usize = 32;
/// Each command of a round has a slot of its own (no two overlap): the
/// region of the volume the test uses is `COMMANDS` slots of 128 KiB.
const SLOT_BLOCKS: u32 = 32;
const REGION_BLOCKS: usize = COMMANDS * SLOT_BLOCKS as usize;
/// How soon the new association's admin Connect must be answered.
const CONNECT_LIMIT: Duration = Duration::from_secs(1);
/// How long the test waits for that answer anyway, to report its status
/// (the target's default fence_timeout is 5 s).
const CONNECT_WAIT: Duration = Duration::from_secs(8);
/// Between the two read-backs: an old write landing late shows here.
const SETTLE: Duration = Duration::from_millis(300);

fn seed() -> u64 {
    std::env::var("RDMABLK_TEST_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or_else(rand::random)
}

fn rounds() -> u32 {
    std::env::var("RDMABLK_RESET_ROUNDS").ok().and_then(|s| s.parse().ok()).unwrap_or(ROUNDS)
}

fn start_target(dir: &Path) -> (TargetProcess, SocketAddr) {
    let img = sparse_file(dir, "vol.img", VOL_SIZE);
    let host = listen_host();
    let host = if host.contains(':') { format!("[{host}]") } else { host };
    let config = format!(
        "[target]\nlisten = [\"nvme+tcp://{host}:0\"]\nnqn = \"{SUBNQN}\"\n\n{}nsid = {NSID}\n",
        file_volume("vol", &img, VOL_SIZE, false)
    );
    let path = dir.join("target.toml");
    std::fs::write(&path, config).unwrap();
    let target = TargetProcess::start_with_path(&path);
    let addr = target.nvme_tcp_addr();
    (target, addr)
}

/// The local address round `round`'s association connects from: another
/// loopback address each round where the target listens on 127.0.0.1
/// (any 127/8 address reaches it), else the kernel's choice.
fn source(addr: SocketAddr, round: u32) -> Option<Ipv4Addr> {
    match addr {
        SocketAddr::V4(a) if a.ip().is_loopback() => Some(Ipv4Addr::new(127, 0, 0, 2 + (round % 200) as u8)),
        _ => None,
    }
}

fn tcp_conn(addr: SocketAddr, src: Option<Ipv4Addr>) -> NvmeTcpConn {
    match src {
        Some(s) => NvmeTcpConn::connect_from(addr, s, NO_DIGESTS),
        None => NvmeTcpConn::connect(addr, NO_DIGESTS),
    }
}

/// One association: the admin queue and the I/O queues.
struct Association {
    admin: NvmeTcpConn,
    io: Vec<NvmeTcpConn>,
}

/// Connects an association of `HOSTNQN` for round `round` (what the round
/// after a reset does first). Fails the test, naming the round, unless
/// the admin Connect succeeds within [`CONNECT_LIMIT`]; returns the
/// association and how long that Connect took.
fn associate(target: &TargetProcess, addr: SocketAddr, round: u32, after: &str) -> (Association, Duration) {
    let src = source(addr, round);
    let t0 = Instant::now();
    let mut admin = tcp_conn(addr, src);
    admin.timeout = CONNECT_WAIT;
    let data = connect_data(ANY_CONTROLLER, SUBNQN, HOSTNQN);
    let answer = admin.execute_raw(connect_entry(0, 31, KATO_MS), &data, &[], 0);
    let took = t0.elapsed();
    admin.timeout = DEFAULT_TIMEOUT;
    // The daemon's word on refused Connects, for the failure message.
    let fence_log = || {
        let lines: Vec<String> = target.log().into_iter().filter(|l| l.contains("nvme connect from")).collect();
        match lines.last() {
            Some(l) => format!("; the daemon logged {} refused Connect(s), the last: {l}", lines.len()),
            None => String::new(),
        }
    };
    let cntlid = match answer {
        Ok(c) if c.cqe.status.is_success() && took <= CONNECT_LIMIT => c.cqe.result as u16,
        Ok(c) => {
            let busy = if c.cqe.status == Status::CONNECT_CONTROLLER_BUSY { " (Connect Controller Busy)" } else { "" };
            panic!(
                "round {round}: the admin Connect of host {HOSTNQN} {after} was answered after {took:?} with status {}{busy} \
                 (required: success within {CONNECT_LIMIT:?}){}",
                c.cqe.status,
                fence_log()
            )
        }
        Err(ConnError::Timeout) => panic!(
            "round {round}: the admin Connect of host {HOSTNQN} {after} got no answer within {took:?} \
             (required: success within {CONNECT_LIMIT:?}){}",
            fence_log()
        ),
        Err(e) => panic!("round {round}: the admin Connect of host {HOSTNQN} {after} failed after {took:?}: {e}{}", fence_log()),
    };
    admin.enable();
    let want = (IO_QUEUES - 1) as u32;
    let granted = admin.set_features(0x07, want | want << 16).unwrap_or_else(|s| panic!("round {round}: Set Features number of queues: {s}"));
    assert!(
        (granted & 0xffff) as u32 >= want && (granted >> 16) as u32 >= want,
        "round {round}: the target granted fewer than {IO_QUEUES} I/O queues: {granted:#x}"
    );
    let io = (1..=IO_QUEUES as u16)
        .map(|qid| {
            let mut q = tcp_conn(addr, src);
            q.io_connect(cntlid, qid, SUBNQN, HOSTNQN).unwrap_or_else(|s| panic!("round {round}: I/O Connect of queue {qid}: {s}"));
            q
        })
        .collect();
    (Association { admin, io }, took)
}

// ---------------------------------------------------------------------------
// The versioned data

// ---------------------------------------------------------------------------
// A round's commands

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Read,
    /// 4 KiB of data in the capsule; `early`: sent with the reads (its
    /// completion may come before the reset), else in the last burst.
    InCapsule { early: bool },
    /// Data by R2T and H2CData; `half`: only the first half is sent.
    R2t { half: bool },
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
}

impl Planned {
    fn writes(&self) -> bool {
        self.kind != Kind::Read
    }
    fn len(&self) -> usize {
        self.blocks as usize * BSZ
    }
}

/// 16 commands per I/O queue: 4 reads of 4-64 KiB, 4 in-capsule writes
/// (2 early, 2 in the burst), 8 R2T writes of 16-128 KiB (a third of them
/// half-sent), each in a slot of its own at a random place within it.
fn plan_round(rng: &mut impl Rng, round: u32, region: u64) -> Vec<Planned> {
    let mut slots: Vec<u64> = (0..COMMANDS as u64).collect();
    slots.shuffle(rng);
    let per_queue = COMMANDS / IO_QUEUES;
    let mut out = Vec::with_capacity(COMMANDS);
    for (i, slot) in slots.into_iter().enumerate() {
        let (queue, j) = (i / per_queue, i % per_queue);
        let kind = match j {
            0..=3 => Kind::Read,
            4..=7 => Kind::InCapsule { early: j < 6 },
            _ => Kind::R2t { half: rng.gen_ratio(1, 3) },
        };
        let blocks = match kind {
            Kind::Read => rng.gen_range(1..=16),
            Kind::InCapsule { .. } => 1,
            Kind::R2t { .. } => rng.gen_range(4..=SLOT_BLOCKS),
        };
        let slba = region + slot * SLOT_BLOCKS as u64 + rng.gen_range(0..=(SLOT_BLOCKS - blocks)) as u64;
        let cmd = i as u32;
        let data = match kind {
            Kind::Read => Vec::new(),
            _ => (0..blocks).flat_map(|b| stamp(round, cmd, b, slba + b as u64)).collect(),
        };
        out.push(Planned { cmd, queue, kind, slba, blocks, data });
    }
    out
}

/// One item of a queue's last burst before the reset.
#[derive(Clone, Copy)]
enum Burst {
    /// A late in-capsule write's capsule (command `plan[i]`).
    Capsule(usize),
    /// The H2CData answering command `plan[i]`'s R2T.
    Data { i: usize, ttag: u16, off: u32, len: u32 },
}

/// What the host learned about a round's writes before the reset.
#[derive(Default)]
struct Seen {
    /// Commands (by number) whose successful completion the host read.
    acked: Vec<u32>,
}

/// Puts the round's commands in flight on `a` and resets every socket of
/// it, the last write data only just sent.
fn load_and_reset(mut a: Association, plan: &[Planned], round: u32) -> Seen {
    let mut seen = Seen::default();
    // Per queue: command id → command, and the R2Ts (ttag, offset, length).
    let mut cids: Vec<Vec<(u16, usize)>> = vec![Vec::new(); IO_QUEUES];
    let mut r2ts: Vec<Vec<(usize, u16, u32, u32)>> = vec![Vec::new(); IO_QUEUES];

    // 1. Reads, the early in-capsule writes and every R2T write's capsule.
    let send = |q: &mut NvmeTcpConn, p: &Planned| -> u16 {
        let opcode = if p.writes() { io_opcode::WRITE } else { io_opcode::READ };
        let mut e = rw_entry(opcode, NSID, p.slba, p.blocks, false);
        match p.kind {
            Kind::InCapsule { .. } => {
                e.set_sgl(Sgl::InCapsule { offset: 0, length: p.len() as u32 });
                q.send_command(e, &p.data)
            }
            _ => {
                e.set_sgl(Sgl::Transport { length: p.len() as u32 });
                q.send_command(e, &[])
            }
        }
    };
    for (i, p) in plan.iter().enumerate() {
        if p.kind != (Kind::InCapsule { early: false }) {
            let cid = send(&mut a.io[p.queue], p);
            cids[p.queue].push((cid, i));
        }
    }

    // 2. Every R2T write's R2T; completions that come meanwhile are noted.
    for qi in 0..IO_QUEUES {
        let want = plan.iter().filter(|p| p.queue == qi && matches!(p.kind, Kind::R2t { .. })).count();
        let deadline = Instant::now() + Duration::from_secs(10);
        while r2ts[qi].len() < want {
            assert!(Instant::now() < deadline, "round {round}: queue {}: only {} of {want} R2Ts in 10 s", qi + 1, r2ts[qi].len());
            let q = &mut a.io[qi];
            let pdu = q.recv_pdu().unwrap_or_else(|e| panic!("round {round}: queue {} before the reset: {e}", qi + 1));
            let of = |cid: u16| cids[qi].iter().find(|c| c.0 == cid).map(|c| c.1);
            match pdu {
                (Pdu::R2T(r), _) => {
                    let i = of(r.cccid).unwrap_or_else(|| panic!("round {round}: R2T for no command: {r:?}"));
                    let p = &plan[i];
                    assert!(matches!(p.kind, Kind::R2t { .. }), "round {round}: R2T for a command that sent its data: {r:?}");
                    assert!(r.offset as usize + r.length as usize <= p.len(), "round {round}: R2T beyond the data: {r:?}");
                    r2ts[qi].push((i, r.ttag, r.offset, r.length));
                }
                (Pdu::CapsuleResp(c), _) => {
                    let i = of(c.cid).unwrap_or_else(|| panic!("round {round}: completion of no command: {c:?}"));
                    assert!(c.status.is_success(), "round {round}: command {} ({:?}) failed: {}", plan[i].cmd, plan[i].kind, c.status);
                    if plan[i].writes() {
                        seen.acked.push(plan[i].cmd);
                    }
                }
                (Pdu::C2HData(_), _) => {}
                (other, _) => panic!("round {round}: queue {} before the reset: unexpected {other:?}", qi + 1),
            }
        }
    }

    // 3. The burst: the R2T writes' data (all of it, or the first half and
    // no LAST_PDU) and the late in-capsule writes, interleaved over the
    // queues, then every socket reset at once.
    let mut bursts: Vec<Vec<Burst>> = vec![Vec::new(); IO_QUEUES];
    for (qi, list) in r2ts.iter().enumerate() {
        bursts[qi].extend(list.iter().map(|&(i, ttag, off, len)| Burst::Data { i, ttag, off, len }));
    }
    for (i, p) in plan.iter().enumerate() {
        if p.kind == (Kind::InCapsule { early: false }) {
            bursts[p.queue].push(Burst::Capsule(i));
        }
    }
    let longest = bursts.iter().map(Vec::len).max().unwrap_or(0);
    for k in 0..longest {
        for (qi, burst) in bursts.iter().enumerate() {
            let q = &mut a.io[qi];
            match burst.get(k) {
                None => {}
                Some(&Burst::Capsule(i)) => {
                    send(q, &plan[i]);
                }
                Some(&Burst::Data { i, ttag, off, len }) => {
                    let (off, len) = (off as usize, len as usize);
                    let half = plan[i].kind == Kind::R2t { half: true };
                    let n = if half { len / 2 } else { len };
                    let cid = cids[qi].iter().find(|c| c.1 == i).expect("sent").0;
                    q.send_h2c(cid, ttag, off as u32, &plan[i].data[off..off + n], !half);
                }
            }
        }
    }
    let Association { admin, io } = a;
    if round % 2 == 0 {
        io.into_iter().for_each(NvmeTcpConn::reset);
        admin.reset();
    } else {
        admin.reset();
        io.into_iter().for_each(NvmeTcpConn::reset);
    }
    seen
}

/// Reads every range `plan` wrote through `q`: (command, bytes).
fn read_back(q: &mut NvmeTcpConn, plan: &[Planned], round: u32, when: &str) -> Vec<(usize, Vec<u8>)> {
    plan.iter()
        .enumerate()
        .filter(|(_, p)| p.writes())
        .map(|(i, p)| {
            let b = q.read(NSID, p.slba, p.blocks, BS).unwrap_or_else(|s| panic!("round {round}: read-back {when}: {s}"));
            (i, b)
        })
        .collect()
}

/// Checks the round's writes against the model of the region (every
/// block's content before the round), then moves the model on.
fn check_writes(
    model: &mut [u8],
    region: u64,
    plan: &[Planned],
    seen: &Seen,
    back: &[(usize, Vec<u8>)],
    round: u32,
) -> (usize, usize) {
    let (mut landed, mut not_landed) = (0, 0);
    let mut errors = Vec::new();
    for (i, got) in back {
        let p = &plan[*i];
        let acked = seen.acked.contains(&p.cmd);
        for b in 0..p.blocks as usize {
            let lba = p.slba + b as u64;
            let at = (lba - region) as usize * BSZ;
            let before = &model[at..at + BSZ];
            let new = &p.data[b * BSZ..(b + 1) * BSZ];
            let g = &got[b * BSZ..(b + 1) * BSZ];
            let what = format!("round {round}: command {} ({:?}, LBA {}+{}) block {b} at LBA {lba}", p.cmd, p.kind, p.slba, p.blocks);
            if g == new {
                landed += 1;
                if p.kind == (Kind::R2t { half: true }) {
                    errors.push(format!("{what}: a write that got only half of its data landed"));
                }
            } else if g == before {
                not_landed += 1;
                if acked {
                    errors.push(format!("{what}: its success was seen before the reset, but it holds the previous content ({})", describe(g)));
                }
            } else {
                errors.push(format!(
                    "{what}: neither the previous content ({}) nor this round's version; it holds {}",
                    describe(before),
                    describe(g)
                ));
            }
        }
        // What the round left is the next round's "before".
        let at = (p.slba - region) as usize * BSZ;
        model[at..at + got.len()].copy_from_slice(got);
    }
    assert!(errors.is_empty(), "{} block(s) wrong:\n{}", errors.len(), errors.join("\n"));
    (landed, not_landed)
}

#[test]
fn a_host_that_resets_its_sockets_mid_io_reconnects_at_once_and_no_old_write_lands_late() {
    let dir = tempfile::tempdir().unwrap();
    let (target, addr) = start_target(dir.path());
    let seed = seed();
    eprintln!("RDMABLK_TEST_SEED={seed}");
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let rounds = rounds();
    // The region the rounds write, somewhere in the volume.
    let region = rng.gen_range(0..(VOL_SIZE / BS as u64 - REGION_BLOCKS as u64)) & !(SLOT_BLOCKS as u64 - 1);
    let mut model = vec![0u8; REGION_BLOCKS * BSZ];

    let started = Instant::now();
    let (mut assoc, _) = associate(&target, addr, 0, "(the first association)");
    let mut times = Vec::with_capacity(rounds as usize);
    let (mut landed, mut not_landed) = (0, 0);
    for round in 1..=rounds {
        let plan = plan_round(&mut rng, round, region);
        let seen = load_and_reset(assoc, &plan, round);
        let (mut next, took) = associate(&target, addr, round, "right after its old association's sockets were reset mid-I/O");
        times.push(took);

        let first = read_back(&mut next.io[0], &plan, round, "right after the new Connect");
        let (l, n) = check_writes(&mut model, region, &plan, &seen, &first, round);
        landed += l;
        not_landed += n;
        std::thread::sleep(SETTLE);
        let second = read_back(&mut next.io[1], &plan, round, "after the settle time");
        for ((i, a), (_, b)) in first.iter().zip(&second) {
            if a != b {
                let p = &plan[*i];
                let block = a.chunks(BSZ).zip(b.chunks(BSZ)).position(|(x, y)| x != y).expect("a block differs");
                panic!(
                    "round {round}: command {} ({:?}) at LBA {}+{} changed {SETTLE:?} after the new Connect was answered: \
                     block {block} held {} and now holds {} (an old association's write landed late)",
                    p.cmd,
                    p.kind,
                    p.slba,
                    p.blocks,
                    describe(&a[block * BSZ..(block + 1) * BSZ]),
                    describe(&b[block * BSZ..(block + 1) * BSZ])
                );
            }
        }
        next.admin.keep_alive().unwrap_or_else(|s| panic!("round {round}: Keep Alive on the new admin queue: {s}"));
        assoc = next;
    }
    times.sort();
    eprintln!(
        "{rounds} rounds in {:?}; admin Connect after the reset: median {:?}, max {:?}; \
         blocks of the rounds' writes landed {landed}, not landed {not_landed}",
        started.elapsed(),
        times[times.len() / 2],
        times[times.len() - 1]
    );
    drop(assoc);
    target.assert_no_panic();
}
