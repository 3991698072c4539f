//! `--plot=PREFIX`: pictures of this run, drawn by [`crate::plot`] from what
//! the run measured, with no log file in between.
//!
//! - `PREFIX_clat_read.svg`, `PREFIX_clat_write.svg`: completion latency
//!   histograms of every I/O of the direction, from the same bins as json+'s
//!   `clat_ns.bins` (so the picture and the JSON never disagree);
//! - `PREFIX_iops.svg`: IOPS over time of all jobs together, per direction,
//!   from the jobs' progress counters read every [`PERIOD`] (ramp included:
//!   it shows what the run did, not only what it counted).

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::job::JobProgress;
use crate::plot;

/// How often the counters are read. Fine enough to show a stall of a few
/// hundred ms; [`MAX_POINTS`] keeps long runs' pictures small.
const PERIOD: Duration = Duration::from_millis(100);

/// Points per line at most; longer runs add neighbouring windows up.
const MAX_POINTS: usize = 600;

/// One reading: time since the sampler started, completed I/Os (read, write) so far.
pub type IopsSample = (Duration, [u64; 2]);

/// Completed I/Os of all jobs per direction, read every [`PERIOD`] on a
/// thread of its own (the jobs never wait for it).
pub struct IopsSampler {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<Vec<IopsSample>>>,
}

impl IopsSampler {
    pub fn start(jobs: Vec<Arc<JobProgress>>) -> IopsSampler {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&stop);
        let thread = std::thread::Builder::new()
            .name("bench-plot".into())
            .spawn(move || {
                let start = Instant::now();
                let count = || -> [u64; 2] {
                    let sum = |d: usize| jobs.iter().map(|p| p.ios[d].load(Ordering::Relaxed)).sum();
                    [sum(0), sum(1)]
                };
                let mut samples = vec![(Duration::ZERO, count())];
                let mut next = start + PERIOD;
                while !flag.load(Ordering::Relaxed) {
                    let now = Instant::now();
                    if now < next {
                        std::thread::sleep((next - now).min(Duration::from_millis(20)));
                        continue;
                    }
                    samples.push((now.duration_since(start), count()));
                    next += PERIOD;
                }
                // The jobs have ended: a last window much shorter than the
                // others would draw the few I/Os in it as a fall to zero.
                let end = start.elapsed();
                if samples.last().is_none_or(|l| end - l.0 >= PERIOD / 2) {
                    samples.push((end, count()));
                }
                samples
            })
            .ok();
        IopsSampler { stop, thread }
    }

    /// Stops the sampler; returns (seconds since it started, cumulative I/Os per direction).
    pub fn finish(mut self) -> Vec<IopsSample> {
        self.stop.store(true, Ordering::Relaxed);
        self.thread.take().and_then(|t| t.join().ok()).unwrap_or_default()
    }
}

/// IOPS per window of cumulative samples: one point per window, at its end.
/// Windows are merged so that at most [`MAX_POINTS`] remain.
pub fn iops_points(samples: &[(f64, [u64; 2])], ddir: usize) -> Vec<(f64, f64)> {
    let step = samples.len().saturating_sub(1).div_ceil(MAX_POINTS).max(1);
    let kept: Vec<&(f64, [u64; 2])> =
        samples.iter().step_by(step).chain(samples.last().filter(|_| (samples.len() - 1) % step != 0)).collect();
    kept.windows(2)
        .filter(|w| w[1].0 > w[0].0)
        .map(|w| (w[1].0, w[1].1[ddir].saturating_sub(w[0].1[ddir]) as f64 / (w[1].0 - w[0].0)))
        .collect()
}

/// Writes the pictures; returns the files written. `json_plus` is the run's
/// json+ report (its `clat_ns.bins`), `samples` the sampler's readings of
/// every batch, on one clock.
pub fn write(prefix: &Path, json_plus: &str, samples: &[(f64, [u64; 2])]) -> Result<Vec<PathBuf>, String> {
    let mut written = Vec::new();
    let mut save = |suffix: &str, svg: String| -> Result<(), String> {
        let mut name = prefix.as_os_str().to_owned();
        name.push(suffix);
        let path = PathBuf::from(name);
        std::fs::write(&path, svg).map_err(|e| format!("--plot: writing {}: {e}", path.display()))?;
        written.push(path);
        Ok(())
    };
    // A run without I/O has no bins: that is not an error of --plot, the
    // report already says so; it only draws no histogram.
    let bins = plot::json_plus_bins(json_plus).unwrap_or_default();
    for ddir in ["read", "write"] {
        let merged = plot::merge_bins(&bins, ddir);
        if merged.iter().any(|&(_, n)| n > 0) {
            let svg = plot::latency_histogram_svg(&format!("completion latency, {ddir}s"), &merged)?;
            save(&format!("_clat_{ddir}.svg"), svg)?;
        }
    }
    let series: Vec<plot::Series> = [(0, "read"), (1, "write")]
        .into_iter()
        .filter(|&(d, _)| samples.last().is_some_and(|s| s.1[d] > 0))
        .map(|(d, label)| plot::Series { label: label.to_owned(), points: iops_points(samples, d) })
        .collect();
    if series.iter().any(|s| !s.points.is_empty()) {
        save("_iops.svg", plot::time_series_svg("IOPS over time (all jobs)", "IOPS", &series)?)?;
    }
    Ok(written)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn iops_per_window_from_cumulative_counts() {
        let s = [(0.0, [0, 0]), (0.5, [500, 0]), (1.0, [1500, 10])];
        assert_eq!(iops_points(&s, 0), vec![(0.5, 1000.0), (1.0, 2000.0)]);
        assert_eq!(iops_points(&s, 1), vec![(0.5, 0.0), (1.0, 20.0)]);
    }

    #[test]
    fn long_runs_are_merged_to_at_most_max_points_and_keep_the_total() {
        let s: Vec<(f64, [u64; 2])> = (0..=3001u64).map(|i| (i as f64 * 0.1, [i * 7, 0])).collect();
        let p = iops_points(&s, 0);
        assert!(p.len() <= MAX_POINTS, "{} points", p.len());
        assert_eq!(p.last().unwrap().0, 300.1, "the last sample is kept");
        // Every window is 70 IOPS, merged or not.
        assert!(p.iter().all(|&(_, v)| (v - 70.0).abs() < 1e-6), "{p:?}");
    }
}
