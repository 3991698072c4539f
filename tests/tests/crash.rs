//! Crash durability against the real daemon on a real store. Each test runs
//! twice: on a file volume (the test's own name) and on an RBD image of the
//! dev Ceph cluster (its `_on_rbd` twin, issue 54).
//!
//! 1. `sigkill_during_fua_and_flushed_writes_keeps_every_acknowledged_write`:
//!    two queue pairs write (half FUA, half plain, with a FLUSH now and then;
//!    QD 8 each through `IoQueue`, plus a thread of inline one-block writes)
//!    while the daemon is SIGKILLed at a random moment, over and over
//!    (`RDMABLK_CRASH_ITERATIONS`, default 24, on either store: a round on
//!    rbd takes about 1 s, twice a file's). Every block written carries a
//!    header (magic, block number, write sequence number, checksum) and bytes
//!    derived from them, so a read tells exactly which write it came from.
//!    The initiator side tracks, per block, every write issued and whether it
//!    was acknowledged and whether it is durable (FUA acknowledged, or
//!    acknowledged before a FLUSH that was acknowledged). After each kill the
//!    daemon is restarted on the same store and every block is read back
//!    (on rbd the restarted daemon's `lock_at_start` breaks the exclusive
//!    lock the killed one left, blocklisting its client: the test checks it
//!    did), and what the restarted daemon reads is what the store holds
//!    ([`Backing::contents`]: the file, or the image by `rbd export`):
//!    - it holds the last durable write or a later issued one, never older
//!      (docs/PROTOCOL.md: FUA, FLUSH);
//!    - it holds the last acknowledged write or a later issued one: only the
//!      process died, not the machine, and "an acknowledged write is in the
//!      file" (ARCHITECTURE.md, "Volumes and backends") — this is what a
//!      target acknowledging before its O_DIRECT write (or its librbd write,
//!      cache off: on the OSDs) completed would break;
//!    - it is either zeroes (never written) or exactly one complete issued
//!      write of this block: no foreign, stale-garbage or torn block.
//!
//!    Writes to a block never overlap in time, so the writes of one block are
//!    totally ordered and "older" is well defined.
//! 2. `sigkill_of_an_initiator_mid_load_frees_its_session`: the benchmark (QD 32
//!    × 2 queue pairs of 256 KiB writes) and the CLI (`rdmablk write` from a
//!    pipe) as child processes under a write load, SIGKILLed; the daemon
//!    must drop the session, its queue pairs and every pool chunk (metrics),
//!    keep its fd count and RSS bounded, and serve a new session correctly.
//!
//! Seeds: `RDMABLK_TEST_SEED` replays a run (the seed is printed).

use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::{Rng, RngCore, SeedableRng};
use rdmablk_initiator::{BlockDevice, ConnectOptions, IoBuffer, IoCompletion, IoRequest, Session, Volume};
use rdmablk_system_tests::backing::{Backing, BackingKind};
use rdmablk_system_tests::{
    bin, free_port, open_fds, rss_bytes, sample, sample_sum, scrape, target_section, target_section_at, wait_until, TargetProcess,
};

const BS: usize = 4096;
const MIB: u64 = 1 << 20;

fn seed() -> u64 {
    let s = std::env::var("RDMABLK_TEST_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or_else(rand::random);
    eprintln!("seed {s} (set RDMABLK_TEST_SEED to replay)");
    s
}

fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

/// Stops the target with SIGTERM and expects a clean exit, so that an rbd
/// image is closed (its watch gone) when its `Backing` removes it.
fn stop(mut target: TargetProcess) {
    target.signal(libc::SIGTERM);
    assert_eq!(target.wait_exit(Duration::from_secs(20)), Some(0), "the target's exit on SIGTERM; log:\n{}", target.log().join("\n"));
}

// ---------------------------------------------------------------------------
// Self-describing blocks.

const MAGIC: u64 = u64::from_le_bytes(*b"RDBCRASH");
const CHECKSUM_AT: usize = 24;

fn splitmix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// FNV-1a of the block without its checksum field.
fn checksum(block: &[u8]) -> u64 {
    block[..CHECKSUM_AT]
        .iter()
        .chain(&block[CHECKSUM_AT + 8..])
        .fold(0xcbf2_9ce4_8422_2325u64, |h, &b| (h ^ b as u64).wrapping_mul(0x0100_0000_01b3))
}

/// The contents write `seq` gives volume block `block`: magic, block, seq,
/// checksum, then bytes derived from (block, seq).
fn fill_block(out: &mut [u8], block: u64, seq: u64) {
    for (k, word) in out.chunks_exact_mut(8).enumerate() {
        let v = match k {
            0 => MAGIC,
            1 => block,
            2 => seq,
            3 => 0,
            _ => splitmix((seq << 24) ^ (block << 9) ^ k as u64),
        };
        word.copy_from_slice(&v.to_le_bytes());
    }
    let sum = checksum(out);
    out[CHECKSUM_AT..CHECKSUM_AT + 8].copy_from_slice(&sum.to_le_bytes());
}

/// What a block read back holds.
#[derive(Debug, PartialEq, Eq)]
enum Found {
    Zeroes,
    /// Exactly the bytes of write `seq` of this block.
    Write(u64),
    /// Anything else, described.
    Garbage(String),
}

fn word(block: &[u8], k: usize) -> u64 {
    u64::from_le_bytes(block[k * 8..k * 8 + 8].try_into().unwrap())
}

fn decode(block_no: u64, bytes: &[u8], candidates: &[u64]) -> Found {
    if bytes.iter().all(|&b| b == 0) {
        return Found::Zeroes;
    }
    let (magic, block, seq, sum) = (word(bytes, 0), word(bytes, 1), word(bytes, 2), word(bytes, 3));
    let mut expected = vec![0u8; BS];
    if magic == MAGIC && block == block_no {
        fill_block(&mut expected, block_no, seq);
        if expected == bytes {
            return Found::Write(seq);
        }
    }
    Found::Garbage(format!(
        "magic {}, header block {block}, seq {seq}, checksum {}; by 512-byte sector: {}",
        if magic == MAGIC { "ok" } else { "wrong" },
        if sum == checksum(bytes) { "valid" } else { "invalid" },
        sector_map(block_no, bytes, candidates)
    ))
}

/// Which write (or zeroes) each 512-byte sector of `bytes` matches, to tell
/// a torn block from garbage.
fn sector_map(block_no: u64, bytes: &[u8], candidates: &[u64]) -> String {
    let images: Vec<(String, Vec<u8>)> = candidates
        .iter()
        .map(|&seq| {
            let mut b = vec![0u8; BS];
            if seq != 0 {
                fill_block(&mut b, block_no, seq);
            }
            (if seq == 0 { "zeroes".to_owned() } else { format!("seq {seq}") }, b)
        })
        .collect();
    (0..BS / 512)
        .map(|s| {
            let r = s * 512..(s + 1) * 512;
            images.iter().find(|(_, img)| img[r.clone()] == bytes[r.clone()]).map_or("?", |(n, _)| n.as_str()).to_owned()
        })
        .collect::<Vec<_>>()
        .join(" | ")
}

// ---------------------------------------------------------------------------
// What the initiator knows about each block.

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    /// Sent; no success seen (in flight when the target died, or failed).
    Issued,
    /// Acknowledged, not yet covered by a FLUSH.
    Acked,
    /// FUA acknowledged, or acknowledged before an acknowledged FLUSH.
    Durable,
}

#[derive(Clone, Copy, Debug)]
struct Rec {
    /// 0: zeroes (the file's initial contents).
    seq: u64,
    state: State,
}

#[derive(Default)]
struct History {
    /// In issue order; [0] is what the block held when the iteration started.
    writes: Vec<Rec>,
    /// A write to it is outstanding: no second one is issued meanwhile.
    busy: bool,
}

struct Tracker {
    blocks: Vec<History>,
    next_seq: u64,
    /// Acknowledged plain writes not yet covered by a flush:
    /// (acknowledgement number, block, index in its history).
    unflushed: Vec<(u64, usize, usize)>,
    acks: u64,
    counts: Counts,
}

#[derive(Clone, Copy, Debug, Default)]
struct Counts {
    writes_issued: u64,
    fua_acked: u64,
    plain_acked: u64,
    flushes_acked: u64,
    made_durable_by_flush: u64,
    writes_failed: u64,
}

impl Tracker {
    fn new(blocks: usize) -> Tracker {
        Tracker {
            blocks: (0..blocks).map(|_| History { writes: vec![Rec { seq: 0, state: State::Durable }], busy: false }).collect(),
            next_seq: 1,
            unflushed: Vec::new(),
            acks: 0,
            counts: Counts::default(),
        }
    }

    /// Claims `start..start + n` for a new write; None when a block is busy.
    fn issue(&mut self, start: usize, n: usize) -> Option<u64> {
        if self.blocks[start..start + n].iter().any(|h| h.busy) {
            return None;
        }
        let seq = self.next_seq;
        self.next_seq += 1;
        for h in &mut self.blocks[start..start + n] {
            h.busy = true;
            h.writes.push(Rec { seq, state: State::Issued });
        }
        self.counts.writes_issued += 1;
        Some(seq)
    }

    fn completed(&mut self, start: usize, n: usize, seq: u64, fua: bool, ok: bool) {
        for b in start..start + n {
            let h = &mut self.blocks[b];
            h.busy = false;
            let idx = h.writes.iter().rposition(|r| r.seq == seq).expect("issued");
            if ok {
                h.writes[idx].state = if fua { State::Durable } else { State::Acked };
                if !fua {
                    self.acks += 1;
                    self.unflushed.push((self.acks, b, idx));
                }
            }
        }
        match (ok, fua) {
            (false, _) => self.counts.writes_failed += 1,
            (true, true) => self.counts.fua_acked += 1,
            (true, false) => self.counts.plain_acked += 1,
        }
    }

    /// A FLUSH is about to be sent: it covers every acknowledgement so far.
    fn flush_watermark(&self) -> u64 {
        self.acks
    }

    fn flushed(&mut self, watermark: u64) {
        self.counts.flushes_acked += 1;
        let (covered, rest): (Vec<_>, Vec<_>) = self.unflushed.drain(..).partition(|&(ack, _, _)| ack <= watermark);
        self.unflushed = rest;
        for (_, b, idx) in covered {
            if self.blocks[b].writes[idx].state == State::Acked {
                self.blocks[b].writes[idx].state = State::Durable;
                self.counts.made_durable_by_flush += 1;
            }
        }
    }

    /// Checks block `b` against its history; Err describes the violation.
    /// Ok(true): it holds a write issued after its last acknowledged one
    /// (one the kill caught in flight, which made it to the file).
    fn check(&self, b: usize, bytes: &[u8]) -> Result<bool, String> {
        let h = &self.blocks[b];
        let candidates: Vec<u64> = h.writes.iter().map(|r| r.seq).collect();
        let seq = match decode(b as u64, bytes, &candidates) {
            Found::Zeroes => 0,
            Found::Write(seq) => seq,
            Found::Garbage(what) => {
                return Err(format!("block {b} holds bytes no single write put there ({what}); history {:?}", h.writes))
            }
        };
        let Some(idx) = h.writes.iter().position(|r| r.seq == seq) else {
            return Err(format!("block {b} holds write seq {seq}, never issued to it; history {:?}", h.writes));
        };
        let last = |pred: fn(State) -> bool| h.writes.iter().rposition(|r| pred(r.state)).unwrap_or(0);
        let last_durable = last(|s| s == State::Durable);
        let last_acked = last(|s| s != State::Issued);
        if idx < last_durable {
            return Err(format!(
                "block {b} holds write seq {seq}, older than the durable write seq {}: durability lost; history {:?}",
                h.writes[last_durable].seq, h.writes
            ));
        }
        if idx < last_acked {
            return Err(format!(
                "block {b} holds write seq {seq}, older than the acknowledged write seq {}: an acknowledged write \
                 is not in the store after a process crash; history {:?}",
                h.writes[last_acked].seq, h.writes
            ));
        }
        Ok(idx > last_acked)
    }

    /// After a verified restart: what each block holds is its new baseline.
    fn rebase(&mut self, found: &[u64]) {
        for (h, &seq) in self.blocks.iter_mut().zip(found) {
            *h = History { writes: vec![Rec { seq, state: State::Durable }], busy: false };
        }
        self.unflushed.clear();
    }
}

// ---------------------------------------------------------------------------
// The write load.

const QUEUE_DEPTH: usize = 8;
const MAX_WRITE_BLOCKS: usize = 8;

enum Pending {
    Write { start: usize, n: usize, seq: u64, fua: bool },
    Flush { watermark: u64 },
}

/// One thread's load on its own queue pair: writes of 1..=8 blocks (half
/// FUA), a FLUSH every so often, until `stop` or the first failure.
fn write_load(session: &Session, vol: &Volume, tracker: &Mutex<Tracker>, stop: &AtomicBool, seed: u64) {
    let mut rng = StdRng::seed_from_u64(seed);
    let volume_blocks = tracker.lock().unwrap().blocks.len();
    let mut queue = session.io_queue();
    let mut buffers: Vec<IoBuffer> =
        (0..QUEUE_DEPTH).map(|_| session.alloc_buffer(MAX_WRITE_BLOCKS * BS).expect("buffer")).collect();
    let mut slots: Vec<Option<Pending>> = (0..QUEUE_DEPTH).map(|_| None).collect();
    let mut free: Vec<usize> = (0..QUEUE_DEPTH).collect();
    let mut failed = false;
    let mut done: Vec<IoCompletion> = Vec::new();
    loop {
        while !failed && !stop.load(Ordering::Relaxed) && !free.is_empty() {
            let slot = *free.last().unwrap();
            if rng.gen_ratio(1, 10) {
                let watermark = tracker.lock().unwrap().flush_watermark();
                slots[slot] = Some(Pending::Flush { watermark });
                queue.submit(IoRequest::flush(vol), slot as u64);
            } else {
                let n = rng.gen_range(1..=MAX_WRITE_BLOCKS);
                let start = rng.gen_range(0..=volume_blocks - n);
                let fua = rng.gen_bool(0.5);
                let Some(seq) = tracker.lock().unwrap().issue(start, n) else { continue };
                let mut buf = buffers.pop().expect("a buffer per free slot");
                for (k, block) in buf.as_mut_slice()[..n * BS].chunks_exact_mut(BS).enumerate() {
                    fill_block(block, (start + k) as u64, seq);
                }
                let request = IoRequest::write(vol, (start * BS) as u64, buf).with_range(0, n * BS);
                slots[slot] = Some(Pending::Write { start, n, seq, fua });
                queue.submit(if fua { request.with_fua() } else { request }, slot as u64);
            }
            free.pop();
        }
        if queue.outstanding() == 0 {
            return;
        }
        queue.wait(&mut done, 1, Some(Duration::from_millis(100)));
        for c in done.drain(..) {
            let slot = c.tag as usize;
            let ok = c.result.is_ok();
            failed |= !ok;
            match slots[slot].take().expect("pending") {
                Pending::Write { start, n, seq, fua } => {
                    tracker.lock().unwrap().completed(start, n, seq, fua, ok);
                    buffers.push(c.buffer.expect("writes hand their buffer back"));
                }
                Pending::Flush { watermark } if ok => tracker.lock().unwrap().flushed(watermark),
                Pending::Flush { .. } => {}
            }
            free.push(slot);
        }
    }
}

/// Sets the flag when dropped.
struct StopOnDrop<'a>(&'a AtomicBool);

impl Drop for StopOnDrop<'_> {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

/// A third writer with the synchronous calls: one-block writes, which the
/// library sends inline in the command capsule (the target writes them from
/// the received capsule, not from an RDMA READ), and FLUSHes.
fn inline_write_load(vol: &Volume, tracker: &Mutex<Tracker>, stop: &AtomicBool, seed: u64) {
    let mut rng = StdRng::seed_from_u64(seed);
    let volume_blocks = tracker.lock().unwrap().blocks.len();
    let mut block = vec![0u8; BS];
    while !stop.load(Ordering::Relaxed) {
        if rng.gen_ratio(1, 10) {
            let watermark = tracker.lock().unwrap().flush_watermark();
            match vol.flush() {
                Ok(()) => tracker.lock().unwrap().flushed(watermark),
                Err(_) => return,
            }
            continue;
        }
        let b = rng.gen_range(0..volume_blocks);
        let fua = rng.gen_bool(0.5);
        let Some(seq) = tracker.lock().unwrap().issue(b, 1) else { continue };
        fill_block(&mut block, b as u64, seq);
        let result = if fua { vol.write_at_fua(&block, (b * BS) as u64) } else { vol.write_at(&block, (b * BS) as u64) };
        tracker.lock().unwrap().completed(b, 1, seq, fua, result.is_ok());
        if result.is_err() {
            return;
        }
    }
}

fn crash_options() -> ConnectOptions {
    ConnectOptions {
        host_id: "crash-test".into(),
        queues: 2,
        connect_timeout: Duration::from_secs(10),
        io_timeout: Duration::from_secs(20),
        // The kill must fail what is in flight, not be ridden out: what was
        // in flight stays "issued" and nothing is re-sent to the new daemon.
        ctrl_loss_timeout: Duration::ZERO,
        ..ConnectOptions::default()
    }
}

#[test]
fn sigkill_during_fua_and_flushed_writes_keeps_every_acknowledged_write() {
    sigkill_during_writes_keeps_every_acknowledged_write(BackingKind::File, env_or("RDMABLK_CRASH_ITERATIONS", 24));
}

#[test]
fn sigkill_during_fua_and_flushed_writes_keeps_every_acknowledged_write_on_rbd() {
    sigkill_during_writes_keeps_every_acknowledged_write(BackingKind::Rbd, env_or("RDMABLK_CRASH_ITERATIONS", 24));
}

fn sigkill_during_writes_keeps_every_acknowledged_write(kind: BackingKind, iterations: usize) {
    let mut rng = StdRng::seed_from_u64(seed());
    let volume_blocks = 512usize; // 2 MiB: writes often hit blocks written before
    let size = (volume_blocks * BS) as u64;
    let dir = tempfile::tempdir().unwrap();
    let store = Backing::new(kind, dir.path(), "crash.img", size);
    let config = dir.path().join("target.toml");
    std::fs::write(
        &config,
        format!(
            "{}reactors = 2\nchunk_size = \"16KiB\"\nmax_io_size = \"64KiB\"\n{}",
            target_section_at(free_port()),
            store.volume("crash", size, false)
        ),
    )
    .unwrap();
    let mut target = TargetProcess::start_with_path(&config);
    let tracker = Mutex::new(Tracker::new(volume_blocks));
    let mut totals = Counts::default();
    let mut inline_writes = 0;
    let t0 = Instant::now();
    for iteration in 0..iterations {
        let session = Session::connect(target.url.as_str(), crash_options()).expect("connect");
        let vol = session.open("crash").expect("open");
        let stop = AtomicBool::new(false);
        let load_for = Duration::from_millis(rng.gen_range(100..=500));
        let seeds = [rng.next_u64(), rng.next_u64(), rng.next_u64()];
        std::thread::scope(|scope| {
            // Ends the load threads even when this thread panics, or the
            // scope would wait for them forever.
            let _stop = StopOnDrop(&stop);
            let mut loads: Vec<_> = seeds[..2]
                .iter()
                .map(|&s| {
                    let (session, vol, tracker, stop) = (&session, &vol, &tracker, &stop);
                    scope.spawn(move || write_load(session, vol, tracker, stop, s))
                })
                .collect();
            let (vol, tracker, stop, s) = (&vol, &tracker, &stop, seeds[2]);
            loads.push(scope.spawn(move || inline_write_load(vol, tracker, stop, s)));
            // The load is running (something was acknowledged), then a random moment.
            wait_until("the first acknowledgements", Duration::from_secs(20), || {
                let c = tracker.lock().unwrap().counts;
                c.fua_acked + c.plain_acked >= 2
            });
            std::thread::sleep(load_for);
            target.kill_and_wait();
            stop.store(true, Ordering::Relaxed);
            for l in loads {
                l.join().expect("load thread");
            }
        });
        target.assert_no_panic();
        inline_writes += session.stats().inline_writes;
        drop(vol);
        drop(session);

        target = TargetProcess::start_with_path(&config);
        if kind == BackingKind::Rbd {
            // The killed daemon's lock was left behind; the new one broke it.
            target.wait_for_log("took the exclusive lock from", Duration::from_secs(10));
        }
        let session = Session::connect(target.url.as_str(), crash_options()).expect("reconnect after the restart");
        let vol = session.open("crash").expect("open after the restart");
        let mut all = vec![0u8; size as usize];
        vol.read_at(&mut all, 0).expect("read the volume back");
        let held = store.contents();
        assert!(held.len() == all.len(), "iteration {iteration}: the {kind:?} store holds {} bytes, not {size}", held.len());
        if let Some(b) = (0..volume_blocks).find(|&b| held[b * BS..(b + 1) * BS] != all[b * BS..(b + 1) * BS]) {
            panic!("iteration {iteration}: block {b}: the restarted daemon read other bytes than the {kind:?} store holds");
        }
        let mut t = tracker.lock().unwrap();
        let mut violations: Vec<String> = Vec::new();
        let mut landed_unacknowledged = 0;
        for (b, bytes) in all.chunks_exact(BS).enumerate() {
            match t.check(b, bytes) {
                Ok(newer) => landed_unacknowledged += usize::from(newer),
                Err(v) => violations.push(v),
            }
        }
        assert!(
            violations.is_empty(),
            "iteration {iteration}: {} block(s) wrong after SIGKILL and restart; first ones:\n{}",
            violations.len(),
            violations.iter().take(5).cloned().collect::<Vec<_>>().join("\n")
        );
        let c = t.counts;
        eprintln!(
            "iteration {iteration}: load {load_for:?}: {} writes issued, {} FUA + {} plain acknowledged, {} flushes \
             acknowledged ({} block writes made durable), {} failed by the kill; {landed_unacknowledged} blocks hold \
             an unacknowledged write",
            c.writes_issued, c.fua_acked, c.plain_acked, c.flushes_acked, c.made_durable_by_flush, c.writes_failed
        );
        totals.writes_issued += c.writes_issued;
        totals.fua_acked += c.fua_acked;
        totals.plain_acked += c.plain_acked;
        totals.flushes_acked += c.flushes_acked;
        totals.made_durable_by_flush += c.made_durable_by_flush;
        totals.writes_failed += c.writes_failed;
        // The verified contents are durable from here on; they are the baseline.
        vol.flush().expect("flush the verified contents");
        let found: Vec<u64> =
            all.chunks_exact(BS).map(|bytes| if bytes.iter().all(|&x| x == 0) { 0 } else { word(bytes, 2) }).collect();
        t.rebase(&found);
        t.counts = Counts::default();
    }
    eprintln!("{iterations} SIGKILLs in {:?}; totals {totals:?}, {inline_writes} inline writes", t0.elapsed());
    assert!(totals.fua_acked > 0 && totals.flushes_acked > 0 && totals.made_durable_by_flush > 0, "{totals:?}");
    assert!(inline_writes > 0, "no write went inline");
    target.assert_no_panic();
    stop(target);
}

// ---------------------------------------------------------------------------
// An initiator killed mid-load.

/// The daemon's view of sessions and pool use, from the metrics endpoint.
#[derive(Debug, PartialEq)]
struct Load {
    sessions: f64,
    queue_pairs: f64,
    chunks_in_use: f64,
    waiting_commands: f64,
    writes: f64,
}

fn load_of(addr: &str) -> Load {
    let m = scrape(addr);
    Load {
        sessions: sample(&m, "rdmablk_sessions_connected", &[]).expect("sessions gauge"),
        queue_pairs: sample(&m, "rdmablk_queue_pairs_connected", &[]).expect("queue pairs gauge"),
        chunks_in_use: sample_sum(&m, "rdmablk_buffer_pool_chunks_in_use"),
        waiting_commands: sample_sum(&m, "rdmablk_buffer_pool_waiting_commands"),
        writes: sample(&m, "rdmablk_volume_ops_total", &[("volume", "v"), ("op", "write")]).unwrap_or(0.0),
    }
}

fn idle(l: &Load) -> bool {
    l.sessions == 0.0 && l.queue_pairs == 0.0 && l.chunks_in_use == 0.0 && l.waiting_commands == 0.0
}

/// A child process that is SIGKILLed and reaped when dropped, so that a
/// failing test leaves no initiator behind.
struct Initiator(Child);

impl Drop for Initiator {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The benchmark as a separate process: QD 32 on each of 2 queue pairs,
/// writes of 256 KiB (two pool chunks each), for longer than it will live.
fn spawn_bench(url: &str) -> Child {
    Command::new(bin("rdmablk-bench"))
        .args([
            &format!("--target={url}"),
            "--volume=v",
            "--name=killed",
            "--rw=randwrite",
            "--bs=256k",
            "--iodepth=32",
            "--numjobs=2",
            "--time_based",
            "--runtime=30s",
            "--eta=never",
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn rdmablk-bench")
}

/// The CLI writing standard input to the volume (pipelined 8 MiB chunks):
/// a thread feeds it 56 MiB as fast as it takes them and then holds the pipe
/// open, so the CLI is still connected, writing or waiting for more input,
/// whenever it is killed. Dropping the returned sender lets the feeder go.
fn spawn_cli_write(url: &str, seed: u64) -> (Child, std::sync::mpsc::Sender<()>, std::thread::JoinHandle<()>) {
    let mut child = Command::new(bin("rdmablk"))
        .args(["--target", url, "write", "v", "--offset", "0", "--progress", "never"])
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn rdmablk");
    let mut pipe = child.stdin.take().expect("stdin piped");
    let (release, held) = std::sync::mpsc::channel::<()>();
    let feeder = std::thread::spawn(move || {
        use std::io::Write;
        let mut rng = StdRng::seed_from_u64(seed);
        let mut piece = vec![0u8; MIB as usize];
        for _ in 0..56 {
            rng.fill_bytes(&mut piece);
            if pipe.write_all(&piece).is_err() {
                return; // the CLI is gone
            }
        }
        let _ = held.recv();
    });
    (child, release, feeder)
}

/// A new session writes, flushes and reads back random data.
fn check_fresh_session(url: &str, rng: &mut StdRng, size: u64) {
    let session = Session::connect(url, ConnectOptions { host_id: "after-kill".into(), queues: 2, ..ConnectOptions::default() })
        .expect("a new session after the kill");
    let vol = session.open("v").expect("open");
    let len = MIB as usize;
    let offset = rng.gen_range(0..(size - MIB) / BS as u64) * BS as u64;
    let mut data = vec![0u8; len];
    rng.fill_bytes(&mut data);
    vol.write_at(&data, offset).expect("write");
    vol.flush().expect("flush");
    let mut back = vec![0u8; len];
    vol.read_at(&mut back, offset).expect("read");
    assert!(back == data, "a new session read back other bytes than it wrote at {offset}");
}

/// The daemon's steady descriptor count: the fewest open over 500 ms.
/// Descriptors opened lazily stay open, so they are counted; ones being
/// closed are not.
fn settled_fds(pid: u32) -> usize {
    (0..25)
        .map(|_| {
            std::thread::sleep(Duration::from_millis(20));
            open_fds(pid)
        })
        .min()
        .expect("25 samples")
}

#[test]
fn sigkill_of_an_initiator_mid_load_frees_its_session() {
    sigkill_of_an_initiator_mid_load_frees_its_session_on(BackingKind::File);
}

#[test]
fn sigkill_of_an_initiator_mid_load_frees_its_session_on_rbd() {
    sigkill_of_an_initiator_mid_load_frees_its_session_on(BackingKind::Rbd);
}

fn sigkill_of_an_initiator_mid_load_frees_its_session_on(kind: BackingKind) {
    let mut rng = StdRng::seed_from_u64(seed());
    let size = 64 * MIB;
    let dir = tempfile::tempdir().unwrap();
    let store = Backing::new(kind, dir.path(), "v.img", size);
    // 4 MiB of pool per reactor: 64 writes of 256 KiB in flight exhaust it,
    // so commands also wait for chunks when the initiator dies.
    let config = format!(
        "{}reactors = 2\nbuffer_pool = \"4MiB\"\nmetrics = \"127.0.0.1:0\"\n{}",
        target_section(),
        store.volume("v", size, false)
    );
    let target = TargetProcess::start(&config);
    let addr = target.metrics_addr();
    let pid = target.pid();
    let baseline = load_of(&addr);
    assert!(idle(&baseline), "not idle before any initiator: {baseline:?}");
    let mut reference_fds: Option<usize> = None;
    let mut rss = Vec::new();
    let rounds: usize = env_or("RDMABLK_KILL_ROUNDS", 6);
    for round in 0..rounds {
        let before = load_of(&addr).writes;
        let (what, mut child, feeder) = if round % 3 == 2 {
            let (child, release, feeder) = spawn_cli_write(&target.url, rng.next_u64());
            ("rdmablk write", Initiator(child), Some((release, feeder)))
        } else {
            ("rdmablk-bench", Initiator(spawn_bench(&target.url)), None)
        };
        // Killed mid-load: connected, and writes are being served.
        let mut peak = 0.0f64;
        wait_until(&format!("{what} connected and writing"), Duration::from_secs(20), || {
            let l = load_of(&addr);
            peak = peak.max(l.chunks_in_use);
            l.sessions >= 1.0 && l.writes >= before + 8.0
        });
        std::thread::sleep(Duration::from_millis(rng.gen_range(0..200)));
        let during = load_of(&addr);
        child.0.kill().expect("SIGKILL the initiator");
        let status = child.0.wait().expect("reap the initiator");
        assert!(status.code().is_none(), "{what} ended before it was killed: {status}");
        if let Some((release, feeder)) = feeder {
            drop(release);
            feeder.join().expect("feeder thread");
        }

        let took = wait_until("the session, its queue pairs and its pool chunks freed", Duration::from_secs(15), || {
            idle(&load_of(&addr))
        });
        check_fresh_session(&target.url, &mut rng, size);
        wait_until("the new session gone", Duration::from_secs(15), || idle(&load_of(&addr)));
        // Descriptors return to what they were after the first round (the
        // first round may open lazily created ones, e.g. a blocking worker).
        // The reference is the fewest seen over 500 ms: a single sample can
        // catch a descriptor on its way out (a metrics scrape's connection, a
        // closed session's socket) and then no later round would match it.
        let fds = open_fds(pid);
        let reference = *reference_fds.get_or_insert_with(|| settled_fds(pid));
        wait_until(&format!("the daemon's fds back to {reference} (now {fds})"), Duration::from_secs(10), || {
            open_fds(pid) == reference
        });
        rss.push(rss_bytes(pid));
        eprintln!(
            "round {round}: {what} killed with {} queue pairs, {} chunks in use (peak seen {peak}), {} waiting; \
             freed in {took:?}; fds {reference}; rss {} KiB",
            during.queue_pairs,
            during.chunks_in_use,
            during.waiting_commands,
            rss.last().unwrap() / 1024
        );
        target.assert_no_panic();
    }
    // No memory growth round after round: a leak of what a session holds
    // (64 × 256 KiB of requests, its queue pairs) would add up over 6 rounds.
    let (first, last) = (rss[0], *rss.last().unwrap());
    assert!(last <= first + 16 * MIB, "RSS grew from {} KiB to {} KiB over {rounds} rounds", first / 1024, last / 1024);
    let log = target.log();
    let disconnects = log.iter().filter(|l| l.contains("session disconnected")).count();
    assert!(disconnects >= rounds, "{disconnects} disconnect lines for {rounds} killed initiators");
    stop(target);
}
