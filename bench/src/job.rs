//! One job: its offsets, its read/write mix, its phases (ramp, measured
//! run, verify) and the submit/reap loop.
//!
//! # The hot path
//! Per I/O: one clock read after its submission (the one before it is
//! shared with the previous I/O of the batch), a share of one clock read per
//! reap batch, three histogram records, and no allocation, lock or syscall of
//! its own. Progress counters are published with relaxed stores once per
//! reap batch.
//!
//! # Verify
//! With `verify=crc32c`, every write stamps its block ([`crate::verify`]),
//! and the job remembers how many times it wrote each block (its
//! generation). No two I/Os of a job touch the same block at once then, so
//! a read knows exactly which generation it must see.
//! - Write workloads (`write`, `randwrite`) read back every block they wrote
//!   after the measured run and check its generation (fio's `do_verify`).
//! - Mixed workloads check reads of blocks written earlier in the run.
//! - Read workloads check every block they read on its own (magic, length,
//!   offset, CRC), as does `verify_only`, which replaces the workload with
//!   one sequential pass of reads over the job's region.
//!
//! A checked read's buffer is marked before it is submitted
//! ([`verify::poison`]), so a read that completes without placing data
//! fails instead of passing on what the slot held before.
//!
//! ## Across a reconnection (`ctrl_loss_tmo`)
//! The I/Os in flight when the session loses the target wait, and the
//! library re-issues those that had not completed once it has reconnected.
//! A re-issued write sends the same buffer, stamped once at submission with
//! the block's new generation, so it writes exactly what the bench last
//! wrote to the block, however often it is executed (the dead target may
//! have executed it before it died). The generation map only moves at
//! submission, and no other I/O of the job touches the block until the
//! write completes, so the check needs no exception for re-issues and
//! makes none: a block that afterwards holds an older generation (a write
//! the target acknowledged and then lost, or an old execution landing late)
//! is a verify failure, as it is without a reconnection. An I/O that fails
//! (reconnection off or given up) stops the job before anything reads the
//! block it may or may not have written.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::time::{Duration, Instant};

use crate::cpu;
use crate::engine::{Dir, Engine, IoDone, IoReq};
use crate::fio_log::JobLogs;
use crate::options::{JobOptions, RwMode, VerifyMode};
use crate::stats::{batch_bucket, depth_bucket, JobStats, SAMPLE_PERIOD};
use crate::verify;

/// fio's error numbers.
pub const EIO: i32 = 5;
pub const EINVAL: i32 = 22;
pub const EILSEQ: i32 = 84;
pub const ECONNREFUSED: i32 = 111;

/// Verify failures printed per job (all are counted).
const MAX_VERIFY_MESSAGES: u64 = 10;

/// What a job is doing, for the status line.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Phase {
    Setup = 0,
    Ramp = 1,
    Running = 2,
    Verifying = 3,
    Done = 4,
}

/// Counters a job publishes while it runs (read by the status line).
#[derive(Debug, Default)]
pub struct JobProgress {
    phase: AtomicU8,
    pub ios: [AtomicU64; 2],
    pub bytes: [AtomicU64; 2],
    /// Bytes the job will move in total (0: time based).
    pub planned_bytes: AtomicU64,
    /// Nanoseconds the job will run, ramp included (0: size based).
    pub planned_ns: AtomicU64,
}

impl JobProgress {
    pub fn phase(&self) -> Phase {
        match self.phase.load(Ordering::Relaxed) {
            0 => Phase::Setup,
            1 => Phase::Ramp,
            2 => Phase::Running,
            3 => Phase::Verifying,
            _ => Phase::Done,
        }
    }

    fn set_phase(&self, p: Phase) {
        self.phase.store(p as u8, Ordering::Relaxed);
    }
}

/// A job as it will run: its options and where its volume is.
#[derive(Clone, Debug)]
pub struct JobPlan {
    pub opts: JobOptions,
    /// Position among all jobs of the run (clones included).
    pub index: usize,
    /// Which clone of `numjobs` this is.
    pub clone: u32,
    pub groupid: usize,
    pub url: String,
    pub volume: String,
}

/// A small, fast generator (xorshift64*).
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(splitmix(seed) | 1)
    }

    #[inline]
    pub fn next_u64(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    /// Uniform in `0..n` (n > 0), by multiply-shift.
    #[inline]
    pub fn below(&mut self, n: u64) -> u64 {
        ((u128::from(self.next_u64()) * u128::from(n)) >> 64) as u64
    }

    pub fn fill(&mut self, buf: &mut [u8]) {
        for chunk in buf.chunks_mut(8) {
            let v = self.next_u64().to_le_bytes();
            chunk.copy_from_slice(&v[..chunk.len()]);
        }
    }
}

fn splitmix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// A random permutation of `0..n` without a map: a bijection on
/// `0..2^bits` (xor with a key, multiply by an odd constant, xorshift, all
/// modulo 2^bits) walked by a counter, skipping values `>= n`. Every block
/// comes once per pass, as with fio's random map.
#[derive(Clone, Debug)]
pub struct Permutation {
    n: u64,
    bits: u32,
    mask: u64,
    key: u64,
    counter: u64,
}

impl Permutation {
    pub fn new(n: u64, seed: u64) -> Permutation {
        assert!(n > 0);
        let bits = (64 - (n - 1).leading_zeros()).max(1);
        let mask = if bits >= 64 { u64::MAX } else { (1u64 << bits) - 1 };
        Permutation { n, bits, mask, key: splitmix(seed), counter: 0 }
    }

    #[inline]
    fn mix(&self, i: u64) -> u64 {
        let m = self.mask;
        let half = self.bits.div_ceil(2);
        let mut x = (i ^ self.key) & m;
        x = x.wrapping_mul(0x9e37_79b9_7f4a_7c15) & m;
        x ^= x >> half;
        x = x.wrapping_add(self.key >> 7) & m;
        x = x.wrapping_mul(0xbf58_476d_1ce4_e5b9) & m;
        x ^= x >> half;
        x = x.wrapping_mul(0x94d0_49bb_1331_11eb) & m;
        x ^ (x >> half)
    }

    /// The next block; a new pass (with a new order) starts after `n`.
    #[inline]
    pub fn next_block(&mut self) -> u64 {
        loop {
            if self.counter > self.mask {
                self.counter = 0;
                self.key = splitmix(self.key);
            }
            let x = self.mix(self.counter);
            self.counter += 1;
            if x < self.n {
                return x;
            }
        }
    }
}

enum Order {
    Seq { next: u64, n: u64 },
    Perm(Permutation),
    Uniform { n: u64 },
}

impl Order {
    #[inline]
    fn next(&mut self, rng: &mut Rng) -> u64 {
        match self {
            Order::Seq { next, n } => {
                let b = *next;
                *next = if b + 1 >= *n { 0 } else { b + 1 };
                b
            }
            Order::Perm(p) => p.next_block(),
            Order::Uniform { n } => rng.below(*n),
        }
    }
}

/// How a read is checked.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Check {
    None,
    /// On its own: magic, length, offset, CRC.
    Alone,
    /// And that it is this job's write number `gen`.
    Exact(u32),
}

#[derive(Clone, Copy, Debug)]
struct Slot {
    dir: Dir,
    block: u64,
    offset: u64,
    len: u32,
    issued: u64,
    slat: u64,
    check: Check,
}

/// Marks a block with an I/O in flight in the generation map.
const IN_FLIGHT: u32 = 1 << 31;

/// Where the job works and how much it moves.
struct Region {
    start: u64,
    /// Offset granularity (the largest block size).
    unit: u64,
    blocks: u64,
}

/// What a phase issues.
enum Source {
    /// The workload.
    Workload { order: Order, bytes_left: u64, mixed: bool },
    /// Every block in `list` (ascending), read and checked.
    ReadBack { next: usize, list: Vec<u64>, exact: bool },
}

/// Runs a job on `engine`: waits on `start` (all jobs of the group begin
/// together), then runs its phases. Never panics on I/O errors: they end
/// up in the returned stats.
pub fn run(plan: &JobPlan, engine: &mut dyn Engine, progress: &JobProgress, stop: &AtomicBool) -> JobStats {
    let o = &plan.opts;
    let mut st = JobStats { name: o.name.clone(), groupid: plan.groupid, jobs: 1, ..JobStats::default() };
    let region = match region(plan, engine) {
        Ok(r) => r,
        Err(e) => {
            st.error = EINVAL;
            st.error_msg = Some(e);
            progress.set_phase(Phase::Done);
            return st;
        }
    };
    // fio's log files: time 0 is where measuring starts (after the ramp).
    let log_epoch = if o.verify_only { 0 } else { o.ramp_time.as_nanos() as u64 };
    let mut logs = if o.logs.any() {
        match JobLogs::open(&o.logs, &o.name, plan.index + 1, log_epoch) {
            Ok(l) => l,
            Err(e) => {
                eprintln!("{}: {e}", o.name);
                st.error = EINVAL;
                st.error_msg = Some(e);
                progress.set_phase(Phase::Done);
                return st;
            }
        }
    } else {
        JobLogs::none()
    };
    if o.logs.hist.is_some() && o.logs.hist_msec == 0 {
        eprintln!("{}: write_hist_log without log_hist_msec: the histogram log stays empty, as in fio", o.name);
    }
    let seed = if o.randrepeat {
        o.randseed ^ (plan.index as u64).wrapping_mul(0x9e37_79b9)
    } else {
        o.randseed ^ (std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64))
    };
    // Identifies this job's writes in block headers.
    let clock = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64);
    let write_seed = splitmix(seed ^ clock ^ u64::from(std::process::id()).rotate_left(32)) | 1;
    let mut rng = Rng::new(seed);
    for tag in 0..engine.depth() as u32 {
        rng.fill(engine.buf_mut(tag));
    }
    let verify = o.verify != VerifyMode::None;
    let mut gens: Vec<u32> = if verify && o.rw.writes() && !o.verify_only { vec![0; region.blocks as usize] } else { Vec::new() };

    let io_size = o.io_size.unwrap_or(region.blocks * region.unit);
    let mut cx = Ctx {
        engine,
        progress,
        stop,
        st: &mut st,
        rng,
        region,
        opts: o,
        write_seed,
        verify,
        base: Instant::now(),
        prog_ios: [0; 2],
        prog_bytes: [0; 2],
        fatal: false,
        logs: &mut logs,
    };

    let cpu0 = cpu::thread_usage();
    cx.base = Instant::now();
    if o.verify_only {
        let list: Vec<u64> = (0..cx.region.blocks).collect();
        progress.planned_bytes.store(cx.region.blocks * cx.region.unit, Ordering::Relaxed);
        progress.set_phase(Phase::Verifying);
        cx.phase(Source::ReadBack { next: 0, list, exact: false }, &mut gens, 0, None, [true, false]);
    } else {
        let order = if !o.rw.is_random() {
            Order::Seq { next: 0, n: cx.region.blocks }
        } else if o.norandommap {
            Order::Uniform { n: cx.region.blocks }
        } else {
            Order::Perm(Permutation::new(cx.region.blocks, seed ^ 0x000f_f5e7))
        };
        let ramp = o.ramp_time.as_nanos() as u64;
        let end = o.runtime.map(|r| ramp + r.as_nanos() as u64);
        let bytes_left = if o.time_based { u64::MAX } else { io_size };
        if o.time_based {
            progress.planned_ns.store(end.unwrap_or(0), Ordering::Relaxed);
        } else {
            progress.planned_bytes.store(io_size, Ordering::Relaxed);
            if let Some(e) = end {
                progress.planned_ns.store(e, Ordering::Relaxed);
            }
        }
        progress.set_phase(if ramp > 0 { Phase::Ramp } else { Phase::Running });
        let active = [o.rw.reads(), o.rw.writes()];
        cx.phase(Source::Workload { order, bytes_left, mixed: o.rw.is_mixed() }, &mut gens, ramp, end, active);

        let readback = verify && o.do_verify && matches!(o.rw, RwMode::Write | RwMode::RandWrite);
        if readback && !cx.fatal && cx.st.io_errors == 0 && !stop.load(Ordering::Relaxed) {
            let list: Vec<u64> = (0..cx.region.blocks).filter(|&b| gens[b as usize] != 0).collect();
            let moved: u64 = cx.prog_bytes.iter().sum();
            progress.planned_bytes.store(moved + list.len() as u64 * cx.region.unit, Ordering::Relaxed);
            progress.set_phase(Phase::Verifying);
            let start = cx.now();
            cx.phase(Source::ReadBack { next: 0, list, exact: true }, &mut gens, start, None, [true, false]);
        }
    }
    let (reconnects, lost) = (cx.engine.reconnects(), cx.engine.is_lost());
    let end_ns = cx.now();
    if let Err(e) = logs.finish(end_ns) {
        eprintln!("{}: {e}", o.name);
        if st.error == 0 {
            st.error = EIO;
        }
        st.error_msg.get_or_insert(e);
    }
    st.cpu = cpu::thread_usage().since(&cpu0);
    st.reconnects = reconnects;
    if lost && st.io_errors > 0 {
        let summary = loss_summary(plan, o.ctrl_loss_tmo);
        eprintln!("{}: {summary}", o.name);
        st.error_msg = Some(match st.error_msg.take() {
            Some(first) => format!("{summary}; first failed I/O: {first}"),
            None => summary,
        });
    }
    if st.verify_errors > 0 && st.error == 0 {
        st.error = EILSEQ;
    }
    if st.verify_errors > MAX_VERIFY_MESSAGES {
        eprintln!(
            "{}: {} more verify failures not shown ({} in all)",
            o.name,
            st.verify_errors - MAX_VERIFY_MESSAGES,
            st.verify_errors
        );
    }
    progress.set_phase(Phase::Done);
    st
}

/// What a job that lost its target says, with what to do about it.
fn loss_summary(plan: &JobPlan, ctrl_loss_tmo: Duration) -> String {
    let url = &plan.url;
    if ctrl_loss_tmo.is_zero() {
        format!(
            "lost the connection to the target {url}; not reconnecting (ctrl_loss_tmo=0): \
             --ctrl_loss_tmo=SECONDS waits that long for the target to come back"
        )
    } else {
        let tmo = crate::units::duration_short(ctrl_loss_tmo);
        format!("lost the target {url}: no connection within ctrl_loss_tmo={tmo}")
    }
}

fn region(plan: &JobPlan, engine: &dyn Engine) -> Result<Region, String> {
    let o = &plan.opts;
    let vol = engine.volume_size();
    let vbs = u64::from(engine.block_size());
    let unit = o.max_bs();
    for bs in o.bs {
        if bs % vbs != 0 {
            return Err(format!(
                "job {}: block size {bs} is not a multiple of the volume's block size {vbs}",
                o.name
            ));
        }
    }
    let start = o.offset.resolve(vol) + u64::from(plan.clone) * o.offset_increment;
    let start = start.next_multiple_of(unit);
    if start >= vol {
        return Err(format!("job {}: offset {start} is beyond the end of the {vol}-byte volume", o.name));
    }
    let size = o.size.map_or(vol - start, |s| s.resolve(vol)).min(vol - start);
    let blocks = size / unit;
    if blocks == 0 {
        return Err(format!(
            "job {}: the region at offset {start} of {size} bytes holds no {unit}-byte block",
            o.name
        ));
    }
    Ok(Region { start, unit, blocks })
}

struct Ctx<'a> {
    engine: &'a mut dyn Engine,
    progress: &'a JobProgress,
    stop: &'a AtomicBool,
    st: &'a mut JobStats,
    rng: Rng,
    region: Region,
    opts: &'a JobOptions,
    write_seed: u64,
    verify: bool,
    base: Instant,
    prog_ios: [u64; 2],
    prog_bytes: [u64; 2],
    /// The engine failed: nothing more can be done.
    fatal: bool,
    /// fio's log files (mostly none).
    logs: &'a mut JobLogs,
}

impl Ctx<'_> {
    #[inline]
    fn now(&self) -> u64 {
        self.base.elapsed().as_nanos() as u64
    }

    /// The next I/O of `src`, or `None` when it has nothing more.
    fn next_io(&mut self, src: &mut Source, gens: &mut [u32]) -> Option<(Dir, u64, Check)> {
        match src {
            Source::Workload { order, bytes_left, mixed } => {
                let o = self.opts;
                let dir = if *mixed {
                    if self.rng.below(100) < u64::from(o.rwmixread) {
                        Dir::Read
                    } else {
                        Dir::Write
                    }
                } else if o.rw.writes() {
                    Dir::Write
                } else {
                    Dir::Read
                };
                let len = o.bs[dir as usize];
                if *bytes_left < len {
                    return None;
                }
                let mut block = order.next(&mut self.rng);
                if self.verify && !gens.is_empty() {
                    // Skip blocks with an I/O in flight (a bounded number of tries).
                    let mut tries = 0;
                    while gens[block as usize] & IN_FLIGHT != 0 {
                        tries += 1;
                        if tries > 64 {
                            return None;
                        }
                        block = order.next(&mut self.rng);
                    }
                }
                *bytes_left -= len;
                let check = match (self.verify, dir) {
                    (false, _) | (true, Dir::Write) => Check::None,
                    (true, Dir::Read) if gens.is_empty() => Check::Alone,
                    (true, Dir::Read) => match gens[block as usize] {
                        0 => Check::None,
                        g => Check::Exact(g),
                    },
                };
                Some((dir, block, check))
            }
            Source::ReadBack { next, list, exact } => {
                let block = *list.get(*next)?;
                *next += 1;
                let check = if *exact { Check::Exact(gens[block as usize] & !IN_FLIGHT) } else { Check::Alone };
                Some((Dir::Read, block, check))
            }
        }
    }

    /// One phase: issues what `src` gives until it runs dry, `end` (ns since
    /// the job's start) passes, or an error stops the job. Completions
    /// before `measure_from` are not counted.
    fn phase(&mut self, mut src: Source, gens: &mut [u32], measure_from: u64, end: Option<u64>, active: [bool; 2]) {
        let depth = self.engine.depth();
        let batch_max = match self.opts.iodepth_batch_submit {
            0 => depth,
            n => (n as usize).min(depth),
        };
        let reap_min = (self.opts.iodepth_batch_complete_min as usize).clamp(1, depth);
        let mut free: Vec<u32> = (0..depth as u32).rev().collect();
        let mut slots = vec![
            Slot { dir: Dir::Read, block: 0, offset: 0, len: 0, issued: 0, slat: 0, check: Check::None };
            depth
        ];
        let mut reqs: Vec<IoReq> = Vec::with_capacity(depth);
        let mut done: Vec<IoDone> = Vec::with_capacity(depth);
        let mut inflight = 0usize;
        let mut draining = false;
        let mut measuring = self.now() >= measure_from;
        let mut measure_start = measure_from;
        let mut last_completion = measure_from;
        let mut next_sample = measure_from + SAMPLE_PERIOD.as_nanos() as u64;
        let mut sample_at = measure_from;
        let mut sample_base = [(0u64, 0u64); 2];
        let verify_stamp = self.verify;
        let unit = self.region.unit;
        let start = self.region.start;

        loop {
            // Fill the free slots, in submit calls of at most batch_max, as
            // fio keeps iodepth in flight whatever iodepth_batch_submit is.
            while !draining && !free.is_empty() {
                reqs.clear();
                while reqs.len() < batch_max {
                    let Some(&tag) = free.last() else { break };
                    let Some((dir, block, check)) = self.next_io(&mut src, gens) else {
                        // Nothing now. A workload that cannot find a free
                        // block tries again after completions.
                        if inflight == 0 || !matches!(src, Source::Workload { bytes_left, .. } if bytes_left > 0) {
                            draining = true;
                        }
                        break;
                    };
                    free.pop();
                    let len = match dir {
                        Dir::Read => self.opts.bs[0],
                        Dir::Write => self.opts.bs[1],
                    } as u32;
                    let offset = start + block * unit;
                    if verify_stamp && !gens.is_empty() {
                        let g = &mut gens[block as usize];
                        if dir == Dir::Write {
                            *g = (*g + 1) & !IN_FLIGHT;
                            let generation = *g;
                            verify::stamp(&mut self.engine.buf_mut(tag)[..len as usize], offset, self.write_seed, generation);
                        }
                        *g |= IN_FLIGHT;
                    }
                    if check != Check::None {
                        // What the check sees must come from this read (or
                        // its re-issue after a reconnection), not from what
                        // the slot held before.
                        verify::poison(&mut self.engine.buf_mut(tag)[..len as usize]);
                    }
                    slots[tag as usize] = Slot { dir, block, offset, len, issued: 0, slat: 0, check };
                    reqs.push(IoReq { tag, dir, offset, len });
                }
                if !reqs.is_empty() {
                    // One submit call per batch (at most iodepth_batch_submit),
                    // so the batch can leave in one message; each I/O's slat
                    // is that call's duration.
                    let t = self.now();
                    if let Err(e) = self.engine.submit(&reqs) {
                        self.fail_fatal(e);
                        return;
                    }
                    let t2 = self.now();
                    for r in &reqs {
                        let s = &mut slots[r.tag as usize];
                        s.issued = t;
                        s.slat = t2 - t;
                    }
                    inflight += reqs.len();
                    self.st.depth_levels[depth_bucket(inflight)] += reqs.len() as u64;
                    self.st.submit_batches[batch_bucket(reqs.len())] += 1;
                } else {
                    break; // nothing to issue now
                }
            }
            if inflight == 0 {
                break;
            }

            done.clear();
            if let Err(e) = self.engine.reap(reap_min.min(inflight), &mut done) {
                self.fail_fatal(e);
                return;
            }
            let now = self.now();
            if !measuring && now >= measure_from {
                measuring = true;
                measure_start = now;
                last_completion = now;
                sample_at = now;
                next_sample = now + SAMPLE_PERIOD.as_nanos() as u64;
                self.progress.set_phase(if matches!(src, Source::ReadBack { .. }) {
                    Phase::Verifying
                } else {
                    Phase::Running
                });
            }
            self.st.complete_batches[batch_bucket(done.len())] += 1;
            for d in &done {
                let s = slots[d.tag as usize];
                inflight -= 1;
                free.push(d.tag);
                if !gens.is_empty() {
                    gens[s.block as usize] &= !IN_FLIGHT;
                }
                let di = s.dir as usize;
                self.prog_ios[di] += 1;
                self.prog_bytes[di] += u64::from(s.len);
                if let Some(err) = &d.error {
                    self.st.io_errors += 1;
                    if self.st.error == 0 {
                        self.st.error = EIO;
                        let what = if s.dir == Dir::Read { "read" } else { "write" };
                        self.st.error_msg = Some(format!("{what} of {} bytes at offset {}: {err}", s.len, s.offset));
                        eprintln!("{}: {}", self.opts.name, self.st.error_msg.as_deref().unwrap_or(""));
                    }
                    draining = true;
                    continue;
                }
                if s.check != Check::None {
                    let data = &self.engine.buf(d.tag)[..s.len as usize];
                    let r = match s.check {
                        Check::Exact(g) => verify::check_exact(data, s.offset, self.write_seed, g).map(|_| ()),
                        _ => verify::check(data, s.offset).map(|_| ()),
                    };
                    if let Err(e) = r {
                        self.st.verify_errors += 1;
                        if self.st.verify_errors <= MAX_VERIFY_MESSAGES {
                            eprintln!("{}: {e}", self.opts.name);
                        }
                        if self.st.error_msg.is_none() {
                            self.st.error_msg = Some(e.to_string());
                        }
                        if self.opts.verify_fatal {
                            draining = true;
                        }
                    }
                }
                if measuring {
                    let ds = &mut self.st.dirs[di];
                    ds.total_ios += 1;
                    ds.io_bytes += u64::from(s.len);
                    let lat = now.saturating_sub(s.issued);
                    let clat = lat.saturating_sub(s.slat);
                    ds.slat.record(s.slat);
                    ds.clat.record(clat);
                    ds.lat.record(lat);
                    if self.logs.enabled() {
                        self.logs.io(now, di, u64::from(s.len), s.offset, s.slat, clat, lat);
                    }
                }
            }
            if measuring {
                if self.logs.enabled() {
                    self.logs.tick(now);
                }
                last_completion = now;
                if now >= next_sample {
                    let period = Duration::from_nanos(now - sample_at);
                    for (d, ds) in self.st.dirs.iter_mut().enumerate() {
                        if !active[d] {
                            continue;
                        }
                        let (b0, i0) = sample_base[d];
                        let secs = period.as_secs_f64().max(1e-9);
                        ds.bw_samples.push((ds.io_bytes - b0) as f64 / 1024.0 / secs);
                        ds.iops_samples.push((ds.total_ios - i0) as f64 / secs);
                        sample_base[d] = (ds.io_bytes, ds.total_ios);
                    }
                    sample_at = now;
                    next_sample = now + SAMPLE_PERIOD.as_nanos() as u64;
                }
            }
            for d in 0..2 {
                self.progress.ios[d].store(self.prog_ios[d], Ordering::Relaxed);
                self.progress.bytes[d].store(self.prog_bytes[d], Ordering::Relaxed);
            }
            if end.is_some_and(|e| now >= e) || self.stop.load(Ordering::Relaxed) {
                draining = true;
            }
        }
        let measured = Duration::from_nanos(last_completion.saturating_sub(measure_start));
        for (ds, _) in self.st.dirs.iter_mut().zip(active).filter(|(_, a)| *a) {
            ds.runtime += measured;
        }
        self.st.runtime += measured;
        self.st.elapsed = Duration::from_nanos(self.now());
    }

    fn fail_fatal(&mut self, e: String) {
        self.fatal = true;
        self.st.io_errors += 1;
        if self.st.error == 0 {
            self.st.error = EIO;
            self.st.error_msg = Some(e.clone());
        }
        eprintln!("{}: {e}", self.opts.name);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::options::SizeSpec;

    const BS: usize = 4096;

    /// A volume in memory behind the engine interface, with the failures a
    /// reconnection brings scripted in.
    struct MemEngine {
        vol: Vec<u8>,
        bufs: Vec<Vec<u8>>,
        inflight: Vec<IoReq>,
        reaps: u64,
        /// Every this many reaps the session "reconnects": the I/Os in
        /// flight were executed by the target that died (at submission),
        /// their read buffers got part of a transfer that never finished,
        /// and they are executed again, re-issued to the new target.
        reconnect_every: Option<u64>,
        reconnects: u64,
        /// Writes to this block after its first are acknowledged and
        /// dropped (a target that lost acknowledged writes).
        drop_writes_to: Option<u64>,
        writes_to: Vec<u64>,
        /// Reads complete without placing any data.
        reads_place_nothing: bool,
        /// At this reap the session is lost: what is in flight fails.
        lose_at_reap: Option<u64>,
        /// ... but only the I/Os fail; the session says it is not lost.
        errors_only: bool,
        lost: bool,
    }

    impl MemEngine {
        fn new(blocks: usize, depth: usize) -> MemEngine {
            MemEngine {
                vol: vec![0; blocks * BS],
                bufs: vec![vec![0; BS]; depth],
                inflight: Vec::new(),
                reaps: 0,
                reconnect_every: None,
                reconnects: 0,
                drop_writes_to: None,
                writes_to: vec![0; blocks],
                reads_place_nothing: false,
                lose_at_reap: None,
                errors_only: false,
                lost: false,
            }
        }

        fn execute(&mut self, r: IoReq) {
            let at = r.offset as usize;
            let len = r.len as usize;
            match r.dir {
                Dir::Write => {
                    let block = r.offset / BS as u64;
                    if self.drop_writes_to == Some(block) && self.writes_to[block as usize] > 0 {
                        return;
                    }
                    self.vol[at..at + len].copy_from_slice(&self.bufs[r.tag as usize][..len]);
                }
                Dir::Read if self.reads_place_nothing => {}
                Dir::Read => self.bufs[r.tag as usize][..len].copy_from_slice(&self.vol[at..at + len]),
            }
        }
    }

    impl Engine for MemEngine {
        fn name(&self) -> &'static str {
            "mem"
        }
        fn depth(&self) -> usize {
            self.bufs.len()
        }
        fn volume_size(&self) -> u64 {
            self.vol.len() as u64
        }
        fn block_size(&self) -> u32 {
            512
        }
        fn buf(&self, tag: u32) -> &[u8] {
            &self.bufs[tag as usize]
        }
        fn buf_mut(&mut self, tag: u32) -> &mut [u8] {
            &mut self.bufs[tag as usize]
        }
        fn submit(&mut self, reqs: &[IoReq]) -> Result<(), String> {
            for &r in reqs {
                self.execute(r);
            }
            self.inflight.extend_from_slice(reqs);
            Ok(())
        }
        fn reap(&mut self, _min: usize, out: &mut Vec<IoDone>) -> Result<(), String> {
            self.reaps += 1;
            let reqs = std::mem::take(&mut self.inflight);
            if self.lose_at_reap == Some(self.reaps) {
                self.lost = true;
            }
            if self.lost {
                let error = Some("connection to the target is closed: the connection was closed by the target or lost");
                out.extend(reqs.iter().map(|r| IoDone { tag: r.tag, error: error.map(str::to_owned) }));
                return Ok(());
            }
            if self.reconnect_every.is_some_and(|n| self.reaps % n == 0) && !reqs.is_empty() {
                self.reconnects += 1;
                for &r in &reqs {
                    if r.dir == Dir::Read {
                        // Half of a transfer on the dead connection.
                        self.bufs[r.tag as usize][..r.len as usize / 2].fill(0xee);
                    }
                }
                for &r in &reqs {
                    self.execute(r);
                }
            }
            for r in &reqs {
                if r.dir == Dir::Write {
                    self.writes_to[(r.offset / BS as u64) as usize] += 1;
                }
                out.push(IoDone { tag: r.tag, error: None });
            }
            Ok(())
        }
        fn reconnects(&self) -> u64 {
            self.reconnects
        }
        fn is_lost(&self) -> bool {
            self.lost && !self.errors_only
        }
    }

    fn plan(rw: RwMode, blocks: usize, ios: usize, depth: u32) -> JobPlan {
        let mut o = JobOptions::new("mem");
        o.rw = rw;
        o.iodepth = depth;
        o.size = Some(SizeSpec::Bytes((blocks * BS) as u64));
        o.io_size = Some((ios * BS) as u64);
        o.verify = VerifyMode::Crc32c;
        JobPlan { opts: o, index: 0, clone: 0, groupid: 0, url: "tcp://127.0.0.1:1".into(), volume: "v".into() }
    }

    fn run_on(plan: &JobPlan, e: &mut MemEngine) -> JobStats {
        run(plan, e, &JobProgress::default(), &AtomicBool::new(false))
    }

    #[test]
    fn reissued_writes_and_reads_verify_clean_and_reconnects_are_counted() {
        for rw in [RwMode::RandRw, RwMode::RandWrite] {
            let p = plan(rw, 256, 4096, 16);
            let mut e = MemEngine::new(256, 16);
            e.reconnect_every = Some(5);
            let st = run_on(&p, &mut e);
            assert_eq!((st.io_errors, st.verify_errors, st.error), (0, 0, 0), "{rw:?}: {:?}", st.error_msg);
            assert!(e.reconnects > 50, "{rw:?}: only {} reconnects", e.reconnects);
            assert_eq!(st.reconnects, e.reconnects, "{rw:?}");
            assert_eq!(st.dirs[1].total_ios + st.dirs[0].total_ios, if rw == RwMode::RandWrite { 4096 + 256 } else { 4096 });
            // The checks ran: the same run with reads that place nothing fails.
            let mut e = MemEngine::new(256, 16);
            e.reconnect_every = Some(5);
            e.reads_place_nothing = true;
            let st = run_on(&p, &mut e);
            assert!(st.verify_errors > 100, "{rw:?}: {} verify errors", st.verify_errors);
        }
    }

    #[test]
    fn a_write_the_target_lost_is_reported_across_reconnects() {
        // randwrite over 64 blocks, each written about 4 times, then read
        // back; block 5 keeps its first write.
        let p = plan(RwMode::RandWrite, 64, 256, 4);
        let mut e = MemEngine::new(64, 4);
        e.reconnect_every = Some(3);
        e.drop_writes_to = Some(5);
        let st = run_on(&p, &mut e);
        assert!(e.writes_to[5] >= 2, "block 5 was written {} times", e.writes_to[5]);
        assert_eq!(st.verify_errors, 1, "{:?}", st.error_msg);
        assert_eq!(st.error, EILSEQ);
        let msg = st.error_msg.unwrap();
        assert!(msg.starts_with(&format!("verify: stale block at offset {}", 5 * BS)), "{msg}");
        assert!(msg.contains("generation 1, expected"), "{msg}");
    }

    #[test]
    fn a_read_that_places_no_data_fails_even_when_its_slot_held_the_block() {
        // One block, one slot: every read follows I/O of the same block
        // from the same buffer, so without the marker the stale buffer
        // would verify.
        let p = plan(RwMode::RandRw, 1, 64, 1);
        let mut e = MemEngine::new(1, 1);
        let st = run_on(&p, &mut e);
        assert_eq!((st.verify_errors, st.io_errors), (0, 0), "{:?}", st.error_msg);
        assert!(st.dirs[0].total_ios > 10 && st.dirs[1].total_ios > 10, "{:?}", st.dirs);
        let mut e = MemEngine::new(1, 1);
        e.reads_place_nothing = true;
        let st = run_on(&p, &mut e);
        assert!(st.verify_errors > 0);
        let msg = st.error_msg.unwrap();
        assert!(msg.starts_with("verify: no data at offset 0"), "{msg}");
    }

    #[test]
    fn a_lost_session_says_what_ctrl_loss_tmo_would_do() {
        let mut p = plan(RwMode::RandRw, 64, 4096, 8);
        let mut e = MemEngine::new(64, 8);
        e.lose_at_reap = Some(10);
        let st = run_on(&p, &mut e);
        assert_eq!(st.error, EIO);
        assert_eq!(st.io_errors, 8, "every I/O in flight failed");
        assert_eq!(st.verify_errors, 0);
        let msg = st.error_msg.unwrap();
        assert!(
            msg.starts_with("lost the connection to the target tcp://127.0.0.1:1; not reconnecting (ctrl_loss_tmo=0)"),
            "{msg}"
        );
        assert!(msg.contains("--ctrl_loss_tmo=SECONDS"), "{msg}");
        assert!(msg.contains("; first failed I/O: ") && msg.contains("connection to the target is closed"), "{msg}");

        p.opts.ctrl_loss_tmo = Duration::from_secs(30);
        let mut e = MemEngine::new(64, 8);
        e.lose_at_reap = Some(10);
        let msg = run_on(&p, &mut e).error_msg.unwrap();
        assert!(msg.starts_with("lost the target tcp://127.0.0.1:1: no connection within ctrl_loss_tmo=30s"), "{msg}");

        // I/O errors of a session that is not lost keep their own message.
        let mut e = MemEngine::new(64, 8);
        e.lose_at_reap = Some(10);
        e.errors_only = true;
        let st = run_on(&p, &mut e);
        assert_eq!((st.error, st.io_errors), (EIO, 8));
        let msg = st.error_msg.unwrap();
        assert!(msg.starts_with("read of 4096 bytes at offset ") || msg.starts_with("write of 4096 bytes at offset "), "{msg}");
        assert!(!msg.contains("ctrl_loss_tmo"), "{msg}");
    }

    #[test]
    fn permutation_visits_every_block_once_per_pass() {
        for n in [1u64, 2, 3, 7, 64, 1000, 4097] {
            let mut p = Permutation::new(n, 42);
            let mut seen = vec![0u32; n as usize];
            for _ in 0..n {
                seen[p.next_block() as usize] += 1;
            }
            assert!(seen.iter().all(|&c| c == 1), "n={n}");
            let mut seen2 = vec![0u32; n as usize];
            for _ in 0..n {
                seen2[p.next_block() as usize] += 1;
            }
            assert!(seen2.iter().all(|&c| c == 1), "second pass n={n}");
        }
    }

    #[test]
    fn permutation_is_not_sequential() {
        let mut p = Permutation::new(1 << 16, 7);
        let v: Vec<u64> = (0..100).map(|_| p.next_block()).collect();
        let ascending = v.windows(2).filter(|w| w[1] == w[0] + 1).count();
        assert!(ascending < 5, "{v:?}");
    }

    #[test]
    fn rng_below_is_in_range_and_spread() {
        let mut r = Rng::new(1);
        let mut hist = [0u32; 10];
        for _ in 0..10_000 {
            let x = r.below(10);
            hist[x as usize] += 1;
        }
        assert!(hist.iter().all(|&c| (800..1200).contains(&c)), "{hist:?}");
    }
}
