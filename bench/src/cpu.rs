//! CPU time: of a job's own thread (getrusage `RUSAGE_THREAD`, as fio
//! reports per job), of the embedded target's threads, and of a separate
//! target process (both from `/proc`).

use std::time::Duration;

/// CPU use over an interval.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CpuUsage {
    pub usr: Duration,
    pub sys: Duration,
    /// Voluntary plus involuntary context switches.
    pub ctx: u64,
    pub majf: u64,
    pub minf: u64,
}

impl CpuUsage {
    pub fn add(&mut self, o: &CpuUsage) {
        self.usr += o.usr;
        self.sys += o.sys;
        self.ctx += o.ctx;
        self.majf += o.majf;
        self.minf += o.minf;
    }

    /// `self - earlier`.
    pub fn since(&self, earlier: &CpuUsage) -> CpuUsage {
        CpuUsage {
            usr: self.usr.saturating_sub(earlier.usr),
            sys: self.sys.saturating_sub(earlier.sys),
            ctx: self.ctx.saturating_sub(earlier.ctx),
            majf: self.majf.saturating_sub(earlier.majf),
            minf: self.minf.saturating_sub(earlier.minf),
        }
    }

    pub fn total(&self) -> Duration {
        self.usr + self.sys
    }
}

fn tv(t: libc::timeval) -> Duration {
    Duration::from_secs(t.tv_sec.max(0) as u64) + Duration::from_micros(t.tv_usec.max(0) as u64)
}

/// The calling thread's CPU use since it started.
pub fn thread_usage() -> CpuUsage {
    let mut ru = std::mem::MaybeUninit::<libc::rusage>::zeroed();
    // SAFETY: getrusage writes one `struct rusage` through the pointer, which
    // points to a properly sized and aligned, writable MaybeUninit that lives
    // across the call. RUSAGE_THREAD is valid on Linux.
    let rc = unsafe { libc::getrusage(libc::RUSAGE_THREAD, ru.as_mut_ptr()) };
    if rc != 0 {
        return CpuUsage::default();
    }
    // SAFETY: the struct was zero-initialised (a valid rusage: all integer
    // fields) and getrusage succeeded, so it is fully written.
    let ru = unsafe { ru.assume_init() };
    CpuUsage {
        usr: tv(ru.ru_utime),
        sys: tv(ru.ru_stime),
        ctx: (ru.ru_nvcsw.max(0) + ru.ru_nivcsw.max(0)) as u64,
        majf: ru.ru_majflt.max(0) as u64,
        minf: ru.ru_minflt.max(0) as u64,
    }
}

/// Clock ticks per second of `/proc` times (`_SC_CLK_TCK`, 100 on Linux).
const CLK_TCK: u64 = 100;

/// utime and stime (fields 14 and 15) of a `/proc/.../stat` line.
fn parse_stat_times(stat: &str) -> Option<(Duration, Duration)> {
    // The command name (field 2) is in parentheses and may contain spaces.
    let after = &stat[stat.rfind(')')? + 1..];
    let fields: Vec<&str> = after.split_whitespace().collect();
    // `after` starts at field 3 (state): utime is field 14, index 11.
    let utime: u64 = fields.get(11)?.parse().ok()?;
    let stime: u64 = fields.get(12)?.parse().ok()?;
    let tick = |t: u64| Duration::from_nanos(t * (1_000_000_000 / CLK_TCK));
    Some((tick(utime), tick(stime)))
}

/// CPU time of a process (all its threads, living and exited) from
/// `/proc/PID/stat`.
pub fn process_usage(pid: u32) -> Option<CpuUsage> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let (usr, sys) = parse_stat_times(&stat)?;
    Some(CpuUsage { usr, sys, ..CpuUsage::default() })
}

/// CPU time of this process's threads whose name `select` picks.
pub fn threads_usage(select: impl Fn(&str) -> bool) -> CpuUsage {
    let mut total = CpuUsage::default();
    let Ok(dir) = std::fs::read_dir("/proc/self/task") else {
        return total;
    };
    for entry in dir.flatten() {
        let path = entry.path();
        let comm = std::fs::read_to_string(path.join("comm")).unwrap_or_default();
        if !select(comm.trim_end()) {
            continue;
        }
        if let Some((usr, sys)) = std::fs::read_to_string(path.join("stat")).ok().as_deref().and_then(parse_stat_times) {
            total.usr += usr;
            total.sys += sys;
        }
    }
    total
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_line_parses_with_spaces_in_the_name() {
        let line = "1234 (a (b) c) S 1 1234 1234 0 -1 4194304 100 0 0 0 250 130 0 0 20 0 1 0 5 0 0";
        let (u, s) = parse_stat_times(line).unwrap();
        assert_eq!(u, Duration::from_millis(2500));
        assert_eq!(s, Duration::from_millis(1300));
    }

    #[test]
    fn own_thread_and_process_usage() {
        let mut x = 0u64;
        for i in 0..2_000_000u64 {
            x = x.wrapping_mul(31).wrapping_add(i);
        }
        std::hint::black_box(x);
        let t = thread_usage();
        assert!(t.total() > Duration::ZERO || t.ctx > 0);
        assert!(process_usage(std::process::id()).is_some());
    }
}
