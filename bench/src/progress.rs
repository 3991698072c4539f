//! The live status line, like fio's eta line:
//! `Jobs: 2 (f=2): [r(2)][45.0%][r=123MiB/s][r=31.5k IOPS][eta 00m:06s]`.
//!
//! A thread of its own reads the jobs' relaxed counters once a second; the
//! jobs never wait for it.

use std::io::Write;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::job::{JobProgress, Phase};
use crate::options::RwMode;
use crate::units::{bytes_binary, num_short};

/// Refresh period of the line.
const PERIOD: Duration = Duration::from_secs(1);

/// A running status line; [`StatusLine::finish`] stops and erases it.
pub struct StatusLine {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl StatusLine {
    /// Starts the line for `jobs` (progress and workload of each).
    pub fn start(jobs: Vec<(Arc<JobProgress>, RwMode)>) -> StatusLine {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&stop);
        let thread = std::thread::Builder::new()
            .name("bench-eta".into())
            .spawn(move || run(&jobs, &flag))
            .ok();
        StatusLine { stop, thread }
    }

    pub fn finish(mut self) {
        self.stop_now();
    }

    fn stop_now(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for StatusLine {
    fn drop(&mut self) {
        self.stop_now();
    }
}

fn state_char(p: Phase, rw: RwMode) -> char {
    match p {
        Phase::Setup => 'P',
        Phase::Ramp => '/',
        Phase::Verifying => 'V',
        Phase::Done => '_',
        Phase::Running => match rw {
            RwMode::Read => 'R',
            RwMode::RandRead => 'r',
            RwMode::Write => 'W',
            RwMode::RandWrite => 'w',
            RwMode::ReadWrite => 'M',
            RwMode::RandRw => 'm',
        },
    }
}

fn mmss(d: Duration) -> String {
    // Rounded up, as a countdown reads.
    let s = d.as_secs() + u64::from(d.subsec_nanos() > 0);
    if s >= 3600 {
        format!("{:02}h:{:02}m:{:02}s", s / 3600, s % 3600 / 60, s % 60)
    } else {
        format!("{:02}m:{:02}s", s / 60, s % 60)
    }
}

/// The line for the current counters; `rate` is (bytes/s, IOPS) per direction.
fn line(jobs: &[(Arc<JobProgress>, RwMode)], elapsed: Duration, rate: [(f64, f64); 2]) -> String {
    let running = jobs.iter().filter(|(p, _)| p.phase() != Phase::Done).count();
    let mut states = String::new();
    let mut last: Option<(char, usize)> = None;
    for (p, rw) in jobs {
        let c = state_char(p.phase(), *rw);
        match &mut last {
            Some((lc, n)) if *lc == c => *n += 1,
            _ => {
                if let Some((lc, n)) = last {
                    states.push_str(&format!("{lc}({n}),"));
                }
                last = Some((c, 1));
            }
        }
    }
    if let Some((lc, n)) = last {
        states.push_str(&format!("{lc}({n})"));
    }
    // Done fraction and time left: by time for time-based jobs, by bytes otherwise.
    let mut frac: f64 = 0.0;
    let mut left = Duration::ZERO;
    let total_rate = rate[0].0 + rate[1].0;
    for (p, _) in jobs {
        let ns = p.planned_ns.load(Ordering::Relaxed);
        let bytes = p.planned_bytes.load(Ordering::Relaxed);
        let done: u64 = p.bytes.iter().map(|b| b.load(Ordering::Relaxed)).sum();
        let (f, l) = if p.phase() == Phase::Done {
            (1.0, Duration::ZERO)
        } else if bytes > 0 && (p.phase() == Phase::Verifying || ns == 0) {
            let f = (done as f64 / bytes as f64).min(1.0);
            let per_job = total_rate / jobs.len().max(1) as f64;
            let l = if per_job > 0.0 { Duration::from_secs_f64(bytes.saturating_sub(done) as f64 / per_job) } else { Duration::ZERO };
            (f, l)
        } else if ns > 0 {
            let f = (elapsed.as_nanos() as f64 / ns as f64).min(1.0);
            (f, Duration::from_nanos(ns).saturating_sub(elapsed))
        } else {
            (0.0, Duration::ZERO)
        };
        frac += f / jobs.len().max(1) as f64;
        left = left.max(l);
    }
    let mut bw = Vec::new();
    let mut iops = Vec::new();
    for (d, name) in [(0, "r"), (1, "w")] {
        if rate[d].1 > 0.0 {
            bw.push(format!("{name}={}/s", bytes_binary(rate[d].0)));
            iops.push(format!("{name}={}", num_short(rate[d].1)));
        }
    }
    let bw = if bw.is_empty() { "r=0KiB/s".to_owned() } else { bw.join(",") };
    let iops = if iops.is_empty() { "r=0".to_owned() } else { iops.join(",") };
    format!(
        "Jobs: {running} (f={running}): [{states}][{:.1}%][{bw}][{iops} IOPS][eta {}]",
        frac * 100.0,
        mmss(left)
    )
}

fn run(jobs: &[(Arc<JobProgress>, RwMode)], stop: &AtomicBool) {
    let start = Instant::now();
    let mut last_t = start;
    let mut last = [(0u64, 0u64); 2];
    let mut width = 0usize;
    let mut out = std::io::stdout();
    loop {
        let next = last_t + PERIOD;
        while Instant::now() < next {
            if stop.load(Ordering::Relaxed) {
                let _ = write!(out, "\r{:width$}\r", "");
                let _ = out.flush();
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let now = Instant::now();
        let dt = now.duration_since(last_t).as_secs_f64().max(1e-6);
        let mut rate = [(0.0, 0.0); 2];
        for d in 0..2 {
            let bytes: u64 = jobs.iter().map(|(p, _)| p.bytes[d].load(Ordering::Relaxed)).sum();
            let ios: u64 = jobs.iter().map(|(p, _)| p.ios[d].load(Ordering::Relaxed)).sum();
            rate[d] = (bytes.saturating_sub(last[d].0) as f64 / dt, ios.saturating_sub(last[d].1) as f64 / dt);
            last[d] = (bytes, ios);
        }
        last_t = now;
        let l = line(jobs, now.duration_since(start), rate);
        let pad = width.saturating_sub(l.len());
        width = l.len();
        let _ = write!(out, "\r{l}{:pad$}", "");
        let _ = out.flush();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn line_looks_like_fios() {
        let p = Arc::new(JobProgress::default());
        p.planned_ns.store(10_000_000_000, Ordering::Relaxed);
        let jobs = vec![(Arc::clone(&p), RwMode::RandRead), (p, RwMode::RandRead)];
        let l = line(&jobs, Duration::from_secs(4), [(128.0 * 1048576.0, 32_768.0), (0.0, 0.0)]);
        assert_eq!(l, "Jobs: 2 (f=2): [P(2)][40.0%][r=128MiB/s][r=32.8k IOPS][eta 00m:06s]");
    }
}
