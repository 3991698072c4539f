//! A verifying random read/write load on one volume, shared by the
//! initiator's tests (fake target) and the system tests (real target, via
//! `#[path]`): several threads, each with its own `IoQueue` keeping `depth`
//! requests in flight on its own slice of the volume, plus occasional
//! synchronous plain-slice requests. Every completed write goes into an
//! in-memory model (`MemDevice`); every read is compared with it. No two
//! requests in flight overlap, so the expected contents are exact even when
//! the session reconnects and re-issues requests.

#![allow(dead_code)]

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rand::{Rng, RngCore, SeedableRng};
use rdmablk_initiator::{BlockDevice, IoBuffer, IoCompletion, IoRequest, MemDevice, Volume};

/// What to run.
#[derive(Clone, Debug)]
pub struct LoadConfig {
    pub threads: usize,
    /// Requests each thread keeps in flight.
    pub depth: usize,
    /// Stop submitting after this long (or when `stop` is set, whichever
    /// comes first, but never before `min_ops` requests per thread).
    pub duration: Duration,
    pub min_ops: u64,
    /// Largest request, in blocks.
    pub max_blocks: u64,
    /// Every this many requests a thread makes a synchronous one (0: never).
    pub sync_every: u64,
    pub seed: u64,
}

/// What happened.
#[derive(Debug, Default, Clone)]
pub struct LoadReport {
    pub reads: u64,
    pub writes: u64,
    pub sync_ops: u64,
    pub bytes: u64,
    /// Every failed request and every verification mismatch.
    pub errors: Vec<String>,
}

impl LoadReport {
    fn merge(&mut self, o: LoadReport) {
        self.reads += o.reads;
        self.writes += o.writes;
        self.sync_ops += o.sync_ops;
        self.bytes += o.bytes;
        self.errors.extend(o.errors);
    }
}

/// Runs the load on `volume`, checking against (and updating) `model`,
/// which must start with the volume's contents. Thread `t` works on the
/// `t`-th of `threads` equal slices of the volume.
pub fn run(volume: &Arc<Volume>, model: &Arc<MemDevice>, config: &LoadConfig, stop: &Arc<AtomicBool>) -> LoadReport {
    let report = Arc::new(Mutex::new(LoadReport::default()));
    std::thread::scope(|scope| {
        for t in 0..config.threads {
            let (volume, model, report, stop) = (volume.clone(), model.clone(), report.clone(), stop.clone());
            let config = config.clone();
            scope.spawn(move || {
                let r = thread_load(&volume, &model, &config, t, &stop);
                report.lock().unwrap().merge(r);
            });
        }
    });
    let r = report.lock().unwrap().clone();
    r
}

struct Op {
    write: bool,
    offset: u64,
    len: u64,
}

fn thread_load(volume: &Volume, model: &MemDevice, config: &LoadConfig, t: usize, stop: &AtomicBool) -> LoadReport {
    let mut report = LoadReport::default();
    let mut rng = rand::rngs::StdRng::seed_from_u64(config.seed.wrapping_add(t as u64 * 0x9e37_79b9));
    let session = volume.session().clone();
    let bs = u64::from(volume.block_size());
    let slice = volume.size() / config.threads as u64 / bs * bs;
    let base = t as u64 * slice;
    let max_len = (config.max_blocks * bs).min(slice);
    let mut queue = session.io_queue();
    let mut free: Vec<IoBuffer> =
        (0..config.depth).map(|_| session.alloc_buffer(max_len as usize).expect("alloc_buffer")).collect();
    let mut ops: Vec<Option<Op>> = (0..config.depth).map(|_| None).collect();
    let mut busy: Vec<(u64, u64)> = Vec::new();
    let mut done: Vec<IoCompletion> = Vec::new();
    let started = Instant::now();
    let mut submitted = 0u64;
    let overlaps = |busy: &[(u64, u64)], off: u64, len: u64| busy.iter().any(|&(o, l)| off < o + l && o < off + len);
    loop {
        let time_up =
            (started.elapsed() >= config.duration || stop.load(Ordering::Relaxed)) && submitted >= config.min_ops;
        // Fill the queue.
        while !time_up && !free.is_empty() {
            let blocks = if rng.gen_ratio(1, 8) {
                rng.gen_range(1..=config.max_blocks)
            } else {
                rng.gen_range(1..=8.min(config.max_blocks))
            };
            let len = (blocks * bs).min(max_len);
            let Some(offset) =
                (0..8).map(|_| base + rng.gen_range(0..=(slice - len) / bs) * bs).find(|&o| !overlaps(&busy, o, len))
            else {
                break;
            };
            submitted += 1;
            if config.sync_every > 0 && submitted % config.sync_every == 0 {
                // A synchronous plain-slice request on a free range.
                report.sync_ops += 1;
                if rng.gen_bool(0.5) {
                    let mut data = vec![0u8; len as usize];
                    rng.fill_bytes(&mut data);
                    match volume.write_at(&data, offset) {
                        Ok(()) => model.write_at(&data, offset).unwrap(),
                        Err(e) => report.errors.push(format!("sync write at {offset}+{len}: {}", e.one_line())),
                    }
                } else {
                    let mut back = vec![0u8; len as usize];
                    match volume.read_at(&mut back, offset) {
                        Ok(()) => {
                            let mut want = vec![0u8; len as usize];
                            model.read_at(&mut want, offset).unwrap();
                            if back != want {
                                report.errors.push(format!("sync read at {offset}+{len} returned other bytes"));
                            }
                        }
                        Err(e) => report.errors.push(format!("sync read at {offset}+{len}: {}", e.one_line())),
                    }
                }
                continue;
            }
            let slot = ops.iter().position(Option::is_none).expect("a free op slot per free buffer");
            let mut buf = free.pop().expect("checked non-empty");
            let write = rng.gen_bool(0.5);
            let request = if write {
                rng.fill_bytes(&mut buf.as_mut_slice()[..len as usize]);
                IoRequest::write(volume, offset, buf).with_range(0, len as usize)
            } else {
                buf.as_mut_slice()[..len as usize].fill(0xee);
                IoRequest::read(volume, offset, buf).with_range(0, len as usize)
            };
            let request = if write && rng.gen_ratio(1, 16) { request.with_fua() } else { request };
            busy.push((offset, len));
            ops[slot] = Some(Op { write, offset, len });
            queue.submit(request, slot as u64);
        }
        if queue.outstanding() == 0 {
            if time_up {
                break;
            }
            continue;
        }
        queue.wait(&mut done, 1, Some(Duration::from_secs(120)));
        if done.is_empty() {
            report.errors.push(format!("no completion within 120 s ({} outstanding)", queue.outstanding()));
            break;
        }
        for c in done.drain(..) {
            let op = ops[c.tag as usize].take().expect("an op per tag");
            busy.retain(|&(o, l)| (o, l) != (op.offset, op.len));
            let buf = c.buffer.expect("read and write requests hand their buffer back");
            report.bytes += op.len;
            let what = if op.write { "write" } else { "read" };
            if let Err(e) = c.result {
                report.errors.push(format!("{what} at {}+{}: {}", op.offset, op.len, e.one_line()));
            } else if op.write {
                report.writes += 1;
                model.write_at(&buf.as_slice()[..op.len as usize], op.offset).unwrap();
            } else {
                report.reads += 1;
                let mut want = vec![0u8; op.len as usize];
                model.read_at(&mut want, op.offset).unwrap();
                if buf.as_slice()[..op.len as usize] != want[..] {
                    let first = buf.as_slice().iter().zip(&want).position(|(a, b)| a != b).unwrap_or(0);
                    report.errors.push(format!(
                        "read at {}+{} returned other bytes (first difference at byte {first})",
                        op.offset, op.len
                    ));
                }
            }
            free.push(buf);
        }
    }
    report
}

/// Reads the whole volume through the library and compares it with the model.
pub fn verify_all(volume: &Volume, model: &MemDevice) -> Result<(), String> {
    let chunk = 4 << 20;
    let size = volume.size();
    let mut off = 0;
    let mut back = vec![0u8; chunk];
    let mut want = vec![0u8; chunk];
    while off < size {
        let n = (size - off).min(chunk as u64) as usize;
        volume.read_at(&mut back[..n], off).map_err(|e| format!("verify read at {off}: {}", e.one_line()))?;
        model.read_at(&mut want[..n], off).unwrap();
        if back[..n] != want[..n] {
            let first = back[..n].iter().zip(&want[..n]).position(|(a, b)| a != b).unwrap_or(0);
            return Err(format!("volume differs from the model at byte {}", off + first as u64));
        }
        off += n as u64;
    }
    Ok(())
}

/// The test duration from `var` (seconds), or `default`.
pub fn duration_from_env(var: &str, default: Duration) -> Duration {
    std::env::var(var).ok().and_then(|s| s.parse::<f64>().ok()).map_or(default, Duration::from_secs_f64)
}

/// A seed from `RDMABLK_TEST_SEED`, or a random one; printed for replay.
pub fn seed() -> u64 {
    let seed = std::env::var("RDMABLK_TEST_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or_else(rand::random);
    eprintln!("seed {seed} (set RDMABLK_TEST_SEED to replay)");
    seed
}
