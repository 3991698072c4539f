//! The daemon's own process figures, as the Prometheus client libraries
//! export them (`process_*`, the names dashboards and alerts already use):
//! read from /proc/self on each scrape, no system call of our own.
//!
//! - `/proc/self/stat`: CPU time, start time (clock ticks after boot),
//!   virtual size, resident pages;
//! - `/proc/stat`: the boot time, to make the start time a Unix time;
//! - `/proc/self/fd`: the open descriptors (the one this listing uses
//!   counts too, as in the Go and Python clients);
//! - `/proc/self/limits`: RLIMIT_NOFILE's soft limit.

use std::io;

/// One reading of the process figures.
#[derive(Clone, Debug, PartialEq)]
pub struct ProcessStats {
    /// Unix time the process started, in seconds.
    pub start_time_seconds: f64,
    /// User and system CPU time of every thread, living and ended.
    pub cpu_seconds: f64,
    pub resident_bytes: u64,
    pub virtual_bytes: u64,
    pub open_fds: u64,
    /// The soft limit of open descriptors; `None`: unlimited.
    pub max_fds: Option<u64>,
}

/// The fields of `/proc/self/stat` that [`ProcessStats`] needs, in their
/// kernel units.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct StatFields {
    utime_ticks: u64,
    stime_ticks: u64,
    start_ticks: u64,
    vsize_bytes: u64,
    rss_pages: u64,
}

impl ProcessStats {
    /// Reads them now; an error when /proc is not mounted or not Linux's.
    pub fn read() -> io::Result<ProcessStats> {
        let stat = parse_stat(&std::fs::read_to_string("/proc/self/stat")?)?;
        let boot_time = parse_boot_time(&std::fs::read_to_string("/proc/stat")?)?;
        let open_fds = std::fs::read_dir("/proc/self/fd")?.count() as u64;
        let max_fds = parse_max_open_files(&std::fs::read_to_string("/proc/self/limits")?)?;
        // The kernel's USER_HZ, from the auxiliary vector (no system call).
        let ticks = rustix::param::clock_ticks_per_second().max(1) as f64;
        Ok(ProcessStats {
            start_time_seconds: boot_time as f64 + stat.start_ticks as f64 / ticks,
            cpu_seconds: (stat.utime_ticks + stat.stime_ticks) as f64 / ticks,
            resident_bytes: stat.rss_pages * rustix::param::page_size() as u64,
            virtual_bytes: stat.vsize_bytes,
            open_fds,
            max_fds,
        })
    }
}

fn malformed(what: &str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, format!("unexpected {what}"))
}

/// Parses `/proc/<pid>/stat`. The command name (field 2) is in
/// parentheses and may hold spaces and parentheses itself, so the fields
/// are counted from the last `)`.
fn parse_stat(text: &str) -> io::Result<StatFields> {
    let rest = text.rsplit_once(')').ok_or_else(|| malformed("/proc/self/stat: no command name"))?.1;
    // Field 3 (state) is the first after the name; proc(5) numbers from 1.
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let field = |n: usize| -> io::Result<u64> {
        fields.get(n - 3).and_then(|f| f.parse().ok()).ok_or_else(|| malformed(&format!("/proc/self/stat field {n}")))
    };
    Ok(StatFields {
        utime_ticks: field(14)?,
        stime_ticks: field(15)?,
        start_ticks: field(22)?,
        vsize_bytes: field(23)?,
        rss_pages: field(24)?,
    })
}

/// The `btime` line of `/proc/stat`: boot time, Unix seconds.
fn parse_boot_time(text: &str) -> io::Result<u64> {
    text.lines()
        .find_map(|l| l.strip_prefix("btime "))
        .and_then(|v| v.trim().parse().ok())
        .ok_or_else(|| malformed("/proc/stat: no btime line"))
}

/// The soft limit on the `Max open files` line of `/proc/<pid>/limits`.
fn parse_max_open_files(text: &str) -> io::Result<Option<u64>> {
    let soft = text
        .lines()
        .find_map(|l| l.strip_prefix("Max open files"))
        .and_then(|rest| rest.split_whitespace().next())
        .ok_or_else(|| malformed("/proc/self/limits: no 'Max open files' line"))?;
    match soft {
        "unlimited" => Ok(None),
        n => n.parse().map(Some).map_err(|_| malformed("/proc/self/limits: Max open files")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_fields_are_counted_after_the_last_parenthesis() {
        // A command name with a space and a ')' of its own, from a real
        // /proc/<pid>/stat with the name changed.
        let line = "4242 (rdma tgt) x) S 1 4242 4242 0 -1 4194560 1200 0 0 0 \
                    317 42 0 0 20 0 9 0 123456 987654321 2048 18446744073709551615 1 1 0 0 0 0 0 4096 0 0 0 0 17 1 0 0 0 0 0";
        let s = parse_stat(line).unwrap();
        assert_eq!(
            s,
            StatFields { utime_ticks: 317, stime_ticks: 42, start_ticks: 123456, vsize_bytes: 987654321, rss_pages: 2048 }
        );
        assert!(parse_stat("4242 (truncated) S 1 2").is_err());
        assert!(parse_stat("no name").is_err());
    }

    #[test]
    fn boot_time_and_fd_limit_are_found_by_their_lines() {
        assert_eq!(parse_boot_time("cpu  1 2 3\nintr 5\nbtime 1700000000\nprocesses 9\n").unwrap(), 1_700_000_000);
        assert!(parse_boot_time("cpu  1 2 3\n").is_err());
        let limits = "Limit                     Soft Limit           Hard Limit           Units     \n\
                      Max processes             96362                96362                processes \n\
                      Max open files            20000                1048576              files     \n";
        assert_eq!(parse_max_open_files(limits).unwrap(), Some(20000));
        assert_eq!(parse_max_open_files("Max open files            unlimited            unlimited            files\n").unwrap(), None);
        assert!(parse_max_open_files("Max processes 5 5 processes\n").is_err());
    }

    #[test]
    fn this_process_reads_as_itself() {
        let before = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs_f64();
        // Some CPU time to see.
        let mut x = 0u64;
        for i in 0..20_000_000u64 {
            x = x.wrapping_mul(31).wrapping_add(i);
        }
        std::hint::black_box(x);
        let kept = std::fs::File::open("/proc/self/stat").unwrap();
        let p = ProcessStats::read().unwrap();
        // Started before now, and not before this machine booted.
        assert!(p.start_time_seconds <= before + 1.0 && p.start_time_seconds > 1e9, "{p:?}");
        assert!(p.cpu_seconds > 0.0, "{p:?}");
        assert!(p.resident_bytes >= 1 << 20 && p.virtual_bytes >= p.resident_bytes, "{p:?}");
        assert!(p.open_fds >= 4, "stdin, stdout, stderr and {kept:?}: {p:?}");
        assert!(p.max_fds.is_none_or(|m| m >= p.open_fds), "{p:?}");
    }
}
