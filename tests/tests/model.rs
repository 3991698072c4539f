//! Model-based test of the whole stack: proptest generates sequences of
//! reads, writes (some FUA), flushes, discards and write-zeroes at random
//! block-aligned offsets and sizes, spread over the 1–4 queue pairs of one
//! multi-queue session. They run through the initiator library, the tcp
//! fabric and the real `rdmablk-target` binary onto a real sparse file, and
//! every read is checked against an in-memory model; at the end of each case
//! the whole volume (read back through the bounce path) and the backing file
//! are compared with the model too.
//!
//! The target runs with a 16 KiB chunk size and a 64 KiB max I/O size, so
//! the generated sizes (1 block, sizes across one or several chunks, sizes
//! around the max I/O size and beyond it, which the initiator splits) cover
//! the chunk pipeline, and with a small pool so commands wait for chunks.
//!
//! Ops flagged `&` run concurrently with the op before them (one thread per
//! queue pair with work) unless their ranges overlap with a write-type op of
//! the same batch; overlapping ops always run one after the other, so the
//! expected result is exact. Flushes overlap nothing. Most ops go through an
//! `IoQueue` with registered buffers; those marked "(sync call)" through the
//! `BlockDevice` calls (bounce buffers; one-block writes inline), made while
//! the thread's `IoQueue` requests are in flight. Each case also picks the
//! initiator's queue depth (128, 1, 2 or 4), so requests wait for command
//! slots. A batch that does not finish within io_timeout + 10 s fails the
//! case as "hung" (and shrinks) instead of hanging the test.
//!
//! The model follows docs/PROTOCOL.md: WRITE_ZEROES reads back as zeroes;
//! DISCARD leaves the range *unspecified*, so discarded blocks match anything
//! until they are written again (they must still read back as the bytes of
//! the backing file).
//!
//! Knobs: `PROPTEST_CASES` (default 256) sets the number of cases. Failures
//! shrink to a minimal sequence and are recorded in
//! `tests/proptest-regressions/model.txt` (replayed first on every run).
//! `RDMABLK_MODEL_INJECT_FAULT=1` corrupts the model on every write of two or
//! more blocks, to see the test fail and shrink; never set it in CI.

use std::fmt;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use proptest::prelude::*;
use proptest::test_runner::{Config, FileFailurePersistence, TestCaseError, TestError, TestRunner};
use rdmablk_initiator::{BlockDevice, ConnectOptions, IoBuffer, IoCompletion, IoQueue, IoRequest, Session, Volume};
use rdmablk_system_tests::{file_bytes, file_volume, sparse_file, target_section, TargetProcess};

const BS: u64 = 4096;
/// The target's chunk_size, in blocks (16 KiB).
const CHUNK_BLOCKS: u64 = 4;
/// The target's max_io_size, in blocks (64 KiB).
const MAX_IO_BLOCKS: u64 = 16;
/// Volume size in blocks (1 MiB): small, so that ops overlap often.
const VOLUME_BLOCKS: u64 = 256;
const VOLUME_BYTES: u64 = VOLUME_BLOCKS * BS;
const MAX_QUEUES: usize = 4;
const DEFAULT_CASES: u32 = 256;
const MAX_OPS: usize = 48;
const IO_TIMEOUT: Duration = Duration::from_secs(20);
/// Where failing cases are persisted (committed, replayed first).
const REGRESSIONS: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/proptest-regressions/model.txt");

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Read,
    Write { fua: bool },
    Flush,
    Discard,
    WriteZeroes,
}

/// One generated operation. `start` and `blocks` are in volume blocks.
#[derive(Clone, Copy, PartialEq, Eq)]
struct Op {
    kind: Kind,
    start: u64,
    blocks: u64,
    /// Queue index, taken modulo the session's queue count.
    queue: usize,
    /// Run concurrently with the previous op when nothing conflicts.
    with_previous: bool,
    /// Through the synchronous `BlockDevice` calls (bounce buffers, inline
    /// data for small writes) instead of an `IoQueue` with registered buffers.
    sync_call: bool,
}

impl fmt::Debug for Op {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let name = match self.kind {
            Kind::Read => "read",
            Kind::Write { fua: false } => "write",
            Kind::Write { fua: true } => "write_fua",
            Kind::Flush => "flush",
            Kind::Discard => "discard",
            Kind::WriteZeroes => "write_zeroes",
        };
        let join = if self.with_previous { "& " } else { "" };
        let how = if self.sync_call { " (sync call)" } else { "" };
        if self.kind == Kind::Flush {
            write!(f, "{join}{name} q{}{how}", self.queue)
        } else {
            write!(f, "{join}{name} blocks {}..{} q{}{how}", self.start, self.start + self.blocks, self.queue)
        }
    }
}

impl Op {
    fn bytes(&self) -> std::ops::Range<usize> {
        (self.start * BS) as usize..((self.start + self.blocks) * BS) as usize
    }

    fn writes(&self) -> bool {
        matches!(self.kind, Kind::Write { .. } | Kind::Discard | Kind::WriteZeroes)
    }

    /// Whether `self` and `other` must not run at the same time: they
    /// overlap and at least one of them changes the range.
    fn conflicts(&self, other: &Op) -> bool {
        if self.kind == Kind::Flush || other.kind == Kind::Flush || !(self.writes() || other.writes()) {
            return false;
        }
        self.start < other.start + other.blocks && other.start < self.start + self.blocks
    }
}

#[derive(Clone)]
struct Case {
    queues: usize,
    /// The initiator's queue depth per queue pair: small depths make
    /// requests wait inside the `IoQueue` for command slots.
    queue_depth: u32,
    ops: Vec<Op>,
}

impl fmt::Debug for Case {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "{} queue(s) of depth {}, {} op(s):", self.queues, self.queue_depth, self.ops.len())?;
        for (i, op) in self.ops.iter().enumerate() {
            writeln!(f, "  #{i} {op:?}")?;
        }
        Ok(())
    }
}

/// Sizes in blocks; the first alternative (one block) is where shrinking goes.
fn block_counts() -> impl Strategy<Value = u64> {
    prop_oneof![
        4 => Just(1u64),
        3 => 2..=CHUNK_BLOCKS + 1,
        2 => (1..=3u64, 0..=2u64).prop_map(|(chunks, delta)| chunks * CHUNK_BLOCKS + 1 - delta),
        2 => MAX_IO_BLOCKS - 1..=MAX_IO_BLOCKS + 1,
        1 => 1..=2 * MAX_IO_BLOCKS + 1,
    ]
}

fn kinds() -> impl Strategy<Value = Kind> {
    prop_oneof![
        4 => Just(Kind::Read),
        4 => any::<bool>().prop_map(|fua| Kind::Write { fua }),
        1 => Just(Kind::Flush),
        1 => Just(Kind::Discard),
        1 => Just(Kind::WriteZeroes),
    ]
}

fn ops() -> impl Strategy<Value = Op> {
    let flags = (proptest::bool::weighted(0.7), proptest::bool::weighted(0.25));
    (kinds(), block_counts(), 0..VOLUME_BLOCKS, 0..MAX_QUEUES, flags).prop_map(
        |(kind, blocks, start, queue, (with_previous, sync_call))| {
            let (start, blocks) = if kind == Kind::Flush { (0, 0) } else { (start.min(VOLUME_BLOCKS - blocks), blocks) };
            Op { kind, start, blocks, queue, with_previous, sync_call }
        },
    )
}

fn cases() -> impl Strategy<Value = Case> {
    let depths = prop_oneof![Just(128u32), Just(1), Just(2), Just(4)];
    (1..=MAX_QUEUES, depths, proptest::collection::vec(ops(), 1..=MAX_OPS))
        .prop_map(|(queues, queue_depth, ops)| Case { queues, queue_depth, ops })
}

fn splitmix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// What op `op_index` writes to volume block `block`: a header (block,
/// op index + 1) and bytes unique to both, so a misplaced or stale block
/// is recognized.
fn fill_block(out: &mut [u8], block: u64, op_index: usize) {
    for (k, word) in out.chunks_exact_mut(8).enumerate() {
        let v = match k {
            0 => block,
            1 => op_index as u64 + 1,
            _ => splitmix((block << 40) ^ ((op_index as u64) << 16) ^ k as u64),
        };
        word.copy_from_slice(&v.to_le_bytes());
    }
}

/// A short description of a block's bytes, for failure messages.
fn describe(block: &[u8]) -> String {
    if block.iter().all(|&b| b == 0) {
        return "zeroes".to_owned();
    }
    let word = |k: usize| u64::from_le_bytes(block[k * 8..k * 8 + 8].try_into().unwrap());
    format!("header says block {} written by op #{}", word(0), word(1) as i64 - 1)
}

/// The expected contents of the volume.
struct Model {
    data: Vec<u8>,
    /// Discarded and not written since: any contents are allowed.
    unspecified: Vec<bool>,
    /// Which op last set each block (None: the reset to zeroes).
    origin: Vec<Option<usize>>,
    inject_fault: bool,
}

impl Model {
    fn zeroed(inject_fault: bool) -> Model {
        Model {
            data: vec![0; VOLUME_BYTES as usize],
            unspecified: vec![false; VOLUME_BLOCKS as usize],
            origin: vec![None; VOLUME_BLOCKS as usize],
            inject_fault,
        }
    }

    fn apply(&mut self, index: usize, op: &Op) {
        let blocks = op.start as usize..(op.start + op.blocks) as usize;
        match op.kind {
            Kind::Read | Kind::Flush => return,
            Kind::Write { .. } => {
                for b in blocks.clone() {
                    fill_block(&mut self.data[b * BS as usize..(b + 1) * BS as usize], b as u64, index);
                }
                if self.inject_fault && op.blocks >= 2 {
                    self.data[op.bytes().start + BS as usize + 100] ^= 0x5a;
                }
            }
            Kind::WriteZeroes => self.data[op.bytes()].fill(0),
            Kind::Discard => {}
        }
        for b in blocks {
            self.unspecified[b] = op.kind == Kind::Discard;
            self.origin[b] = Some(index);
        }
    }

    fn expected(&self, b: usize) -> String {
        match self.origin[b] {
            None => "zeroes from the reset".to_owned(),
            Some(i) => format!("what op #{i} left"),
        }
    }

    /// Compares `got` (the bytes of blocks `start..`) with the model.
    fn check(&self, start: u64, got: &[u8], what: &str) -> Result<(), TestCaseError> {
        for (i, block) in got.chunks_exact(BS as usize).enumerate() {
            let b = start as usize + i;
            if self.unspecified[b] {
                continue;
            }
            let want = &self.data[b * BS as usize..(b + 1) * BS as usize];
            if block != want {
                let at = block.iter().zip(want).position(|(x, y)| x != y).unwrap();
                return Err(TestCaseError::fail(format!(
                    "{what}: block {b} differs from the model at byte {at} (expected {:#04x}, got {:#04x}): \
                     expected {} ({}), got {}",
                    want[at],
                    block[at],
                    self.expected(b),
                    describe(want),
                    describe(block)
                )));
            }
        }
        Ok(())
    }
}

/// The daemon, started once per test function and reused by every case.
struct Harness {
    target: TargetProcess,
    image: PathBuf,
    _dir: tempfile::TempDir,
    stats: Stats,
}

/// What the cases exercised, to show the generator reaches the paths it is for.
#[derive(Default)]
struct Stats {
    ops: AtomicU64,
    batches: AtomicU64,
    /// Batches in flight on two or more queue pairs at once.
    multi_queue_batches: AtomicU64,
    /// Ops larger than the target's chunk size (pipelined in chunks).
    chunked_ops: AtomicU64,
    /// Ops larger than the max I/O size (split by the initiator).
    split_ops: AtomicU64,
    /// Writes whose data travelled inside the command capsule.
    inline_writes: AtomicU64,
}

impl Stats {
    fn count(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Ordering::Relaxed);
    }

    fn get(counter: &AtomicU64) -> u64 {
        counter.load(Ordering::Relaxed)
    }
}

impl Harness {
    fn start() -> Harness {
        let dir = tempfile::tempdir().unwrap();
        let image = sparse_file(dir.path(), "model.img", VOLUME_BYTES);
        let config = format!(
            "{}reactors = 2\nchunk_size = \"16KiB\"\nmax_io_size = \"64KiB\"\nbuffer_pool = \"128KiB\"\n{}",
            target_section(),
            file_volume("model", &image, VOLUME_BYTES, false)
        );
        let target = TargetProcess::start(&config);
        Harness { target, image, _dir: dir, stats: Stats::default() }
    }
}

fn options(queues: usize, queue_depth: u32) -> ConnectOptions {
    ConnectOptions {
        host_id: "model-test".into(),
        queues,
        queue_depth,
        io_timeout: IO_TIMEOUT,
        // A target failure ends the case at once instead of being ridden out.
        ctrl_loss_timeout: Duration::ZERO,
        ..ConnectOptions::default()
    }
}

fn io_error(what: String) -> impl FnOnce(rdmablk_initiator::Error) -> TestCaseError {
    move |e| TestCaseError::fail(format!("{what}: {e}"))
}

/// How one op ended; reads carry the bytes they got.
struct Done {
    index: usize,
    result: rdmablk_initiator::Result<()>,
    data: Option<Vec<u8>>,
}

fn write_data(op: &Op, index: usize, out: &mut [u8]) {
    for (k, block) in out.chunks_exact_mut(BS as usize).enumerate() {
        fill_block(block, op.start + k as u64, index);
    }
}

/// Runs the ops of `batch` (indices into `ops`) that belong to this thread:
/// first submits the queued ones on `queue`, then, while they are in
/// flight, makes the synchronous calls; waits for everything.
fn run_on_queue(
    session: &Session,
    vol: &Volume,
    queue: &mut IoQueue,
    ops: &[Op],
    batch: &[usize],
) -> Result<Vec<Done>, TestCaseError> {
    for &i in batch.iter().filter(|&&i| !ops[i].sync_call) {
        let op = &ops[i];
        let offset = op.start * BS;
        let len = op.blocks * BS;
        let request = match op.kind {
            Kind::Read => {
                let buf = session.alloc_buffer(len as usize).map_err(io_error(format!("op #{i} buffer")))?;
                IoRequest::read(vol, offset, buf)
            }
            Kind::Write { fua } => {
                let mut buf: IoBuffer = session.alloc_buffer(len as usize).map_err(io_error(format!("op #{i} buffer")))?;
                write_data(op, i, buf.as_mut_slice());
                let request = IoRequest::write(vol, offset, buf);
                if fua {
                    request.with_fua()
                } else {
                    request
                }
            }
            Kind::Flush => IoRequest::flush(vol),
            Kind::Discard => IoRequest::discard(vol, offset, len),
            Kind::WriteZeroes => IoRequest::write_zeroes(vol, offset, len),
        };
        queue.submit(request, i as u64);
    }
    let mut done = Vec::with_capacity(batch.len());
    for &i in batch.iter().filter(|&&i| ops[i].sync_call) {
        let op = &ops[i];
        let (offset, len) = (op.start * BS, (op.blocks * BS) as usize);
        let mut data = None;
        let result = match op.kind {
            Kind::Read => {
                let mut buf = vec![0u8; len];
                let r = vol.read_at(&mut buf, offset);
                data = Some(buf);
                r
            }
            Kind::Write { fua } => {
                let mut buf = vec![0u8; len];
                write_data(op, i, &mut buf);
                if fua {
                    vol.write_at_fua(&buf, offset)
                } else {
                    vol.write_at(&buf, offset)
                }
            }
            Kind::Flush => vol.flush(),
            Kind::Discard => vol.discard(offset, len as u64),
            Kind::WriteZeroes => vol.write_zeroes(offset, len as u64),
        };
        done.push(Done { index: i, result, data });
    }
    let mut completions: Vec<IoCompletion> = Vec::with_capacity(batch.len());
    while queue.outstanding() > 0 {
        queue.wait(&mut completions, queue.outstanding(), Some(Duration::from_secs(1)));
    }
    for c in completions {
        let index = c.tag as usize;
        let data = (ops[index].kind == Kind::Read).then(|| c.buffer.expect("a read hands its buffer back").as_slice().to_vec());
        done.push(Done { index, result: c.result, data });
    }
    Ok(done)
}

/// Groups ops into batches: an op flagged `with_previous` joins the current
/// batch unless it conflicts with an op already in it.
fn batches(ops: &[Op]) -> Vec<Vec<usize>> {
    let mut out: Vec<Vec<usize>> = Vec::new();
    for (i, op) in ops.iter().enumerate() {
        match out.last_mut() {
            Some(batch) if op.with_previous && batch.iter().all(|&j| !op.conflicts(&ops[j])) => batch.push(i),
            _ => out.push(vec![i]),
        }
    }
    out
}

fn run_case(h: &Harness, case: &Case, inject_fault: bool) -> Result<(), TestCaseError> {
    let session = Session::connect(h.target.url.as_str(), options(case.queues, case.queue_depth)).map_err(io_error("connect".into()))?;
    let vol = Arc::new(session.open("model").map_err(io_error("open".into()))?);
    let ops = Arc::new(case.ops.clone());
    // Start from zeroes with plain writes (not the write-zeroes under test).
    vol.write_at(&vec![0u8; VOLUME_BYTES as usize], 0).map_err(io_error("reset".into()))?;
    let mut model = Model::zeroed(inject_fault);
    let queue_count = session.queue_count();
    let mut queues: Vec<Option<IoQueue>> = (0..queue_count).map(|_| Some(session.io_queue())).collect();

    for batch in batches(&case.ops) {
        let mut per_queue: Vec<Vec<usize>> = vec![Vec::new(); queue_count];
        for &i in &batch {
            per_queue[case.ops[i].queue % queue_count].push(i);
        }
        let stats = &h.stats;
        Stats::count(&stats.batches, 1);
        Stats::count(&stats.ops, batch.len() as u64);
        Stats::count(&stats.multi_queue_batches, u64::from(per_queue.iter().filter(|q| !q.is_empty()).count() > 1));
        Stats::count(&stats.chunked_ops, batch.iter().filter(|&&i| case.ops[i].blocks > CHUNK_BLOCKS).count() as u64);
        Stats::count(&stats.split_ops, batch.iter().filter(|&&i| case.ops[i].blocks > MAX_IO_BLOCKS).count() as u64);
        // One thread per queue with work: the batch is in flight on every
        // queue pair at once. The threads are not scoped, so that a hung
        // request fails the case (and shrinks) instead of hanging the test.
        let (tx, rx) = mpsc::channel();
        let mut running = 0;
        for (q, mine) in per_queue.into_iter().enumerate().filter(|(_, mine)| !mine.is_empty()) {
            let mut queue = queues[q].take().expect("the queue is back from the previous batch");
            let (session, vol, ops, tx) = (session.clone(), Arc::clone(&vol), Arc::clone(&ops), tx.clone());
            std::thread::spawn(move || {
                let result = run_on_queue(&session, &vol, &mut queue, &ops, &mine);
                let _ = tx.send((q, queue, result));
            });
            running += 1;
        }
        // Every request ends within io_timeout (the library's promise).
        let deadline = Instant::now() + IO_TIMEOUT + Duration::from_secs(10);
        let mut finished: Vec<Done> = Vec::new();
        for _ in 0..running {
            let wait = deadline.saturating_duration_since(Instant::now());
            let Ok((q, queue, result)) = rx.recv_timeout(wait) else {
                return Err(TestCaseError::fail(format!(
                    "hung: the batch {:?} did not finish within {:?}",
                    batch.iter().map(|&i| (i, ops[i])).collect::<Vec<_>>(),
                    IO_TIMEOUT + Duration::from_secs(10)
                )));
            };
            queues[q] = Some(queue);
            finished.extend(result?);
        }
        // Reads see the model as it was before the batch: nothing in the
        // batch overlaps them.
        finished.sort_by_key(|d| d.index);
        for d in finished {
            let i = d.index;
            let op = &case.ops[i];
            d.result.map_err(io_error(format!("op #{i} {op:?}")))?;
            if let Some(data) = d.data {
                model.check(op.start, &data, &format!("op #{i} {op:?}"))?;
            }
        }
        for &i in &batch {
            model.apply(i, &case.ops[i]);
        }
    }

    Stats::count(&h.stats.inline_writes, session.stats().inline_writes);
    // The whole volume through the synchronous (bounce) path, then the file.
    vol.flush().map_err(io_error("final flush".into()))?;
    let mut all = vec![0u8; VOLUME_BYTES as usize];
    vol.read_at(&mut all, 0).map_err(io_error("final read".into()))?;
    model.check(0, &all, "final read of the whole volume")?;
    let file = file_bytes(&h.image, 0, VOLUME_BYTES as usize);
    model.check(0, &file, "backing file")?;
    for (b, unspecified) in model.unspecified.iter().enumerate() {
        let range = b * BS as usize..(b + 1) * BS as usize;
        if *unspecified && all[range.clone()] != file[range] {
            return Err(TestCaseError::fail(format!("discarded block {b} reads back other bytes than the file holds")));
        }
    }
    Ok(())
}

#[test]
fn random_op_sequences_over_several_queues_match_the_model() {
    let h = Harness::start();
    let inject_fault = std::env::var_os("RDMABLK_MODEL_INJECT_FAULT").is_some_and(|v| v != "0");
    if inject_fault {
        eprintln!("RDMABLK_MODEL_INJECT_FAULT is set: the model is wrong on purpose, this test must fail");
    }
    let cases_wanted = std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(DEFAULT_CASES);
    let config = Config {
        cases: cases_wanted,
        failure_persistence: Some(Box::new(FileFailurePersistence::Direct(REGRESSIONS))),
        source_file: Some(file!()),
        // Each case talks to the daemon: bound the shrinking, not the test.
        max_shrink_time: 120_000,
        ..Config::default()
    };
    let mut runner = TestRunner::new(config);
    let t0 = std::time::Instant::now();
    let result = runner.run(&cases(), |case| run_case(&h, &case, inject_fault));
    let s = &h.stats;
    eprintln!(
        "{:?}: {} ops in {} batches ({} on several queue pairs at once), {} ops over the chunk size, {} over the max \
         I/O size, {} inline writes",
        t0.elapsed(),
        Stats::get(&s.ops),
        Stats::get(&s.batches),
        Stats::get(&s.multi_queue_batches),
        Stats::get(&s.chunked_ops),
        Stats::get(&s.split_ops),
        Stats::get(&s.inline_writes)
    );
    h.target.assert_no_panic();
    match result {
        Ok(()) => {}
        Err(TestError::Fail(reason, case)) => panic!("{reason}\nminimal failing case: {case:?}"),
        Err(e) => panic!("{e}"),
    }
    if cases_wanted >= 20 {
        // Generator sanity: the interesting paths were reached.
        assert!(
            Stats::get(&s.multi_queue_batches) > 0 && Stats::get(&s.split_ops) > 0 && Stats::get(&s.inline_writes) > 0,
            "the cases never ran concurrently, split or inline"
        );
    }
}

/// Regression (found by the model test against commit aa36038): on a queue
/// pair with one command slot for requests (a negotiated depth of 1, or 2
/// with the keep-alive slot), a thread with an `IoQueue` request on the wire
/// that made a synchronous call on the same queue pair waited forever: the
/// `IoQueue` held the only slot until it took its response, which this very
/// thread would only do after the call returned. Since d5f8509 an
/// `IoQueue`'s response is detached on arrival and its slot freed.
#[test]
fn a_sync_call_beside_an_outstanding_io_queue_request_at_queue_depth_2_completes() {
    let h = Harness::start();
    for depth in [1, 2] {
        let session = Session::connect(h.target.url.as_str(), options(1, depth)).expect("connect");
        let vol = session.open("model").expect("open");
        let (tx, rx) = mpsc::channel();
        // A thread of its own, so that a deadlock fails the test instead of hanging it.
        std::thread::spawn(move || {
            let mut queue = session.io_queue();
            let buf = session.alloc_buffer(BS as usize).expect("buffer");
            queue.submit(IoRequest::read(&vol, 0, buf), 0);
            let sync = vol.read_at(&mut [0u8; BS as usize], BS);
            let mut done = Vec::new();
            while queue.outstanding() > 0 {
                queue.wait(&mut done, 1, None);
            }
            let _ = tx.send((sync, done.into_iter().map(|c| c.result).collect::<Vec<_>>()));
        });
        let limit = IO_TIMEOUT + Duration::from_secs(10);
        let (sync, queued) = rx
            .recv_timeout(limit)
            .unwrap_or_else(|_| panic!("queue depth {depth}: the synchronous read did not return within {limit:?}"));
        sync.expect("the synchronous read");
        assert!(queued.iter().all(Result::is_ok), "{queued:?}");
    }
    h.target.assert_no_panic();
}
