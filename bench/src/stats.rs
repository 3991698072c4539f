//! Latency and throughput statistics: HDR histograms for percentiles, exact
//! min/max/mean/stddev next to them, bandwidth samples, and merging for
//! group reporting.

use std::time::Duration;

use hdrhistogram::Histogram;

use crate::cpu::CpuUsage;

/// Highest latency a histogram tracks (larger values saturate): one hour.
const MAX_TRACKABLE_NS: u64 = 3_600_000_000_000;
/// Significant decimal digits of the histograms (0.1 % resolution).
const SIGFIG: u8 = 3;
/// fio's bandwidth sampling period (`bw_avg_time`, 500 ms).
pub const SAMPLE_PERIOD: Duration = Duration::from_millis(500);

/// One latency kind (slat, clat or lat) of one direction.
#[derive(Clone, Debug)]
pub struct Lat {
    hist: Histogram<u64>,
    n: u64,
    min: u64,
    max: u64,
    mean: f64,
    /// Sum of squared differences from the mean (Welford).
    m2: f64,
}

impl Default for Lat {
    fn default() -> Self {
        Lat::new()
    }
}

impl Lat {
    pub fn new() -> Lat {
        Lat {
            hist: Histogram::new_with_bounds(1, MAX_TRACKABLE_NS, SIGFIG).expect("valid histogram bounds"),
            n: 0,
            min: u64::MAX,
            max: 0,
            mean: 0.0,
            m2: 0.0,
        }
    }

    /// Records one value in nanoseconds.
    #[inline]
    pub fn record(&mut self, ns: u64) {
        self.hist.saturating_record(ns.max(1));
        self.n += 1;
        self.min = self.min.min(ns);
        self.max = self.max.max(ns);
        let x = ns as f64;
        let delta = x - self.mean;
        self.mean += delta / self.n as f64;
        self.m2 += delta * (x - self.mean);
    }

    /// Adds `other` (parallel variance formula).
    pub fn merge(&mut self, other: &Lat) {
        if other.n == 0 {
            return;
        }
        if self.n == 0 {
            *self = other.clone();
            return;
        }
        self.hist.add(&other.hist).expect("histograms with equal bounds add");
        let (na, nb) = (self.n as f64, other.n as f64);
        let n = na + nb;
        let delta = other.mean - self.mean;
        self.mean += delta * nb / n;
        self.m2 += other.m2 + delta * delta * na * nb / n;
        self.n += other.n;
        self.min = self.min.min(other.min);
        self.max = self.max.max(other.max);
    }

    pub fn reset(&mut self) {
        self.hist.reset();
        self.n = 0;
        self.min = u64::MAX;
        self.max = 0;
        self.mean = 0.0;
        self.m2 = 0.0;
    }

    pub fn count(&self) -> u64 {
        self.n
    }

    pub fn min(&self) -> u64 {
        if self.n == 0 {
            0
        } else {
            self.min
        }
    }

    pub fn max(&self) -> u64 {
        self.max
    }

    pub fn mean(&self) -> f64 {
        self.mean
    }

    /// Sample standard deviation, as fio computes it.
    pub fn stddev(&self) -> f64 {
        if self.n < 2 {
            0.0
        } else {
            (self.m2 / (self.n - 1) as f64).sqrt()
        }
    }

    /// The value at percentile `p` (0..=100); 0 without samples.
    pub fn percentile(&self, p: f64) -> u64 {
        if self.n == 0 {
            0
        } else {
            self.hist.value_at_percentile(p).min(self.max)
        }
    }

    /// fio's latency bins with their counts ([`crate::fio_log`]), the
    /// non-empty ones, ascending: json+ `bins`. Exact, not an estimate: a
    /// bucket of the HDR histogram (1/2048 of a power of two wide, aligned)
    /// lies within one of fio's bins (1/64 of a power of two, aligned).
    pub fn fio_bins(&self) -> Vec<(u64, u64)> {
        let mut out: Vec<(usize, u64)> = Vec::new();
        for v in self.hist.iter_recorded() {
            let idx = crate::fio_log::plat_val_to_idx(v.value_iterated_to());
            match out.last_mut() {
                Some((last, n)) if *last == idx => *n += v.count_at_value(),
                _ => out.push((idx, v.count_at_value())),
            }
        }
        out.into_iter().map(|(idx, n)| (crate::fio_log::plat_idx_to_val(idx), n)).collect()
    }

    /// Share (0..=1) of the values in `[low, high)`.
    pub fn fraction_between(&self, low: u64, high: u64) -> f64 {
        if self.n == 0 || high <= low {
            return 0.0;
        }
        // count_between is inclusive; values are integers.
        let c = self.hist.count_between(low.max(1), high - 1);
        c as f64 / self.n as f64
    }
}

/// Reads or writes of one job.
#[derive(Clone, Debug, Default)]
pub struct DirStats {
    pub io_bytes: u64,
    pub total_ios: u64,
    pub slat: Lat,
    pub clat: Lat,
    pub lat: Lat,
    /// Bandwidth samples in KiB/s, one per [`SAMPLE_PERIOD`].
    pub bw_samples: Vec<f64>,
    /// IOPS samples, one per [`SAMPLE_PERIOD`].
    pub iops_samples: Vec<f64>,
    /// Time over which this direction was measured.
    pub runtime: Duration,
}

impl DirStats {
    pub fn reset(&mut self) {
        self.io_bytes = 0;
        self.total_ios = 0;
        self.slat.reset();
        self.clat.reset();
        self.lat.reset();
        self.bw_samples.clear();
        self.iops_samples.clear();
    }

    pub fn merge(&mut self, o: &DirStats) {
        self.io_bytes += o.io_bytes;
        self.total_ios += o.total_ios;
        self.slat.merge(&o.slat);
        self.clat.merge(&o.clat);
        self.lat.merge(&o.lat);
        // All jobs of a run sample on the same grid: add sample by sample.
        add_samples(&mut self.bw_samples, &o.bw_samples);
        add_samples(&mut self.iops_samples, &o.iops_samples);
        self.runtime = self.runtime.max(o.runtime);
    }

    pub fn iops(&self) -> f64 {
        per_sec(self.total_ios as f64, self.runtime)
    }

    pub fn bw_bytes(&self) -> f64 {
        per_sec(self.io_bytes as f64, self.runtime)
    }
}

fn add_samples(into: &mut Vec<f64>, from: &[f64]) {
    if into.len() < from.len() {
        into.resize(from.len(), 0.0);
    }
    for (a, b) in into.iter_mut().zip(from) {
        *a += b;
    }
}

/// `x` per second of `d` (0 for a zero duration).
pub fn per_sec(x: f64, d: Duration) -> f64 {
    let s = d.as_secs_f64();
    if s > 0.0 {
        x / s
    } else {
        0.0
    }
}

/// min, max, mean, sample stddev of samples.
pub fn sample_summary(v: &[f64]) -> (f64, f64, f64, f64) {
    if v.is_empty() {
        return (0.0, 0.0, 0.0, 0.0);
    }
    let min = v.iter().copied().fold(f64::INFINITY, f64::min);
    let max = v.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let mean = v.iter().sum::<f64>() / v.len() as f64;
    let dev = if v.len() > 1 {
        (v.iter().map(|x| (x - mean) * (x - mean)).sum::<f64>() / (v.len() - 1) as f64).sqrt()
    } else {
        0.0
    };
    (min, max, mean, dev)
}

/// fio's I/O depth buckets: 1, 2, 4, 8, 16, 32, >=64.
pub const DEPTH_BUCKETS: [&str; 7] = ["1", "2", "4", "8", "16", "32", ">=64"];

/// Bucket of an I/O depth in [`DEPTH_BUCKETS`].
#[inline]
pub fn depth_bucket(depth: usize) -> usize {
    match depth {
        0..=1 => 0,
        2..=3 => 1,
        4..=7 => 2,
        8..=15 => 3,
        16..=31 => 4,
        32..=63 => 5,
        _ => 6,
    }
}

/// fio's submit/complete batch buckets: 0, 4, 8, 16, 32, 64, >=64 (a bucket
/// holds batches up to its label).
pub const BATCH_BUCKETS: [&str; 7] = ["0", "4", "8", "16", "32", "64", ">=64"];

#[inline]
pub fn batch_bucket(n: usize) -> usize {
    match n {
        0 => 0,
        1..=4 => 1,
        5..=8 => 2,
        9..=16 => 3,
        17..=32 => 4,
        33..=64 => 5,
        _ => 6,
    }
}

/// Everything measured for one job (or one group of merged jobs).
#[derive(Clone, Debug, Default)]
pub struct JobStats {
    pub name: String,
    pub groupid: usize,
    /// Jobs merged into this one.
    pub jobs: u32,
    /// fio's error code of the first error (0: none).
    pub error: i32,
    /// The first error's message.
    pub error_msg: Option<String>,
    /// I/Os that failed.
    pub io_errors: u64,
    /// Blocks that failed verification.
    pub verify_errors: u64,
    /// Times the job's session reconnected to the target (the library's
    /// `SessionStats::reconnects`; see `ctrl_loss_tmo`).
    pub reconnects: u64,
    /// Reads (0) and writes (1).
    pub dirs: [DirStats; 2],
    /// Time the job ran (after ramp).
    pub runtime: Duration,
    pub cpu: CpuUsage,
    /// I/Os submitted per depth bucket ([`DEPTH_BUCKETS`]).
    pub depth_levels: [u64; 7],
    /// Submit calls per batch-size bucket ([`BATCH_BUCKETS`]).
    pub submit_batches: [u64; 7],
    /// Reap calls per batch-size bucket.
    pub complete_batches: [u64; 7],
    /// Seconds the job ran including ramp and verify (for fio's "elapsed").
    pub elapsed: Duration,
}

impl JobStats {
    pub fn merge(&mut self, o: &JobStats) {
        self.jobs += o.jobs;
        if self.error == 0 && o.error != 0 {
            self.error = o.error;
            self.error_msg.clone_from(&o.error_msg);
        }
        self.io_errors += o.io_errors;
        self.verify_errors += o.verify_errors;
        self.reconnects += o.reconnects;
        for d in 0..2 {
            self.dirs[d].merge(&o.dirs[d]);
        }
        self.runtime = self.runtime.max(o.runtime);
        self.elapsed = self.elapsed.max(o.elapsed);
        self.cpu.add(&o.cpu);
        for i in 0..7 {
            self.depth_levels[i] += o.depth_levels[i];
            self.submit_batches[i] += o.submit_batches[i];
            self.complete_batches[i] += o.complete_batches[i];
        }
    }

    pub fn total_errors(&self) -> u64 {
        self.io_errors + self.verify_errors
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exact_moments_and_percentiles() {
        let mut l = Lat::new();
        for v in 1..=1000u64 {
            l.record(v * 1000);
        }
        assert_eq!(l.count(), 1000);
        assert_eq!(l.min(), 1000);
        assert_eq!(l.max(), 1_000_000);
        assert!((l.mean() - 500_500.0).abs() < 1e-6);
        let sd = l.stddev();
        assert!((sd - 288_819.0).abs() < 1.0, "{sd}");
        let p50 = l.percentile(50.0);
        assert!((499_000..=501_000).contains(&p50), "{p50}");
        let p99 = l.percentile(99.0);
        assert!((989_000..=991_000).contains(&p99), "{p99}");
        assert!((l.fraction_between(0, 100_001) - 0.1).abs() < 0.002);
    }

    #[test]
    fn merge_matches_recording_everything_in_one() {
        let mut a = Lat::new();
        let mut b = Lat::new();
        let mut all = Lat::new();
        for v in 0..500u64 {
            let x = 1000 + v * 37 % 911;
            a.record(x);
            all.record(x);
            let y = 5000 + v * 13 % 97;
            b.record(y);
            all.record(y);
        }
        a.merge(&b);
        assert_eq!(a.count(), all.count());
        assert_eq!(a.min(), all.min());
        assert_eq!(a.max(), all.max());
        assert!((a.mean() - all.mean()).abs() < 1e-6);
        assert!((a.stddev() - all.stddev()).abs() < 1e-6);
        assert_eq!(a.percentile(90.0), all.percentile(90.0));
    }

    #[test]
    fn fio_bins_match_counting_in_fios_bins() {
        use crate::fio_log::{plat_idx_to_val, plat_val_to_idx, PLAT_NR};
        let mut l = Lat::new();
        let mut direct = vec![0u64; PLAT_NR];
        let mut x = 0x1234_5678_9abc_def1u64;
        for i in 0..200_000u64 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            // Spread over 1 ns .. about 70 s, and every value below 3000.
            let v = if i < 3000 { i + 1 } else { 1 + (x >> (x % 28 + 28)) };
            l.record(v);
            direct[plat_val_to_idx(v)] += 1;
        }
        let want: Vec<(u64, u64)> =
            direct.iter().enumerate().filter(|(_, &n)| n > 0).map(|(i, &n)| (plat_idx_to_val(i), n)).collect();
        assert_eq!(l.fio_bins(), want);
        assert_eq!(l.fio_bins().iter().map(|b| b.1).sum::<u64>(), l.count());
    }

    #[test]
    fn buckets() {
        assert_eq!(depth_bucket(1), 0);
        assert_eq!(depth_bucket(32), 5);
        assert_eq!(depth_bucket(100), 6);
        assert_eq!(batch_bucket(1), 1);
        assert_eq!(batch_bucket(32), 4);
    }
}
