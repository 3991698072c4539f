//! The report: fio's normal text output and fio's JSON, from the stats of
//! every job (merged per group with `group_reporting`).

use std::fmt::Write as _;
use std::time::{Duration, SystemTime};

use serde::ser::{Serialize, SerializeMap, SerializeSeq, Serializer};

use crate::cpu::CpuUsage;
use crate::options::JobOptions;
use crate::stats::{per_sec, sample_summary, DirStats, JobStats, Lat, BATCH_BUCKETS, DEPTH_BUCKETS};
use crate::units::{bw_both, bytes_binary, bytes_decimal, num_short};

/// The version string: `rdmablk-bench-X.Y.Z`.
pub fn version() -> String {
    format!("rdmablk-bench-{}", env!("CARGO_PKG_VERSION"))
}

/// The fio release whose JSON (keys, their order, json+ bins) and log
/// formats rdmablk-bench writes: checked against fio 3.33's own output.
pub const FIO_FORMAT: &str = "fio-3.33";

/// The JSON's `"fio version"`: `fio-3.33-rdmablk-bench-X.Y.Z`. It starts
/// with the fio release whose format the document has, so that parsers
/// that read `fio-MAJOR.MINOR` from it (a prefix match, a split on `-`, a
/// regular expression) take it as 3.33, as they take the versions of fio
/// built from git (`fio-3.33-54-gabcdef`); and it says which program wrote
/// it.
pub fn fio_version() -> String {
    format!("{FIO_FORMAT}-{}", version())
}

/// One entry of the report: a job, or the merged jobs of a group.
#[derive(Clone, Debug)]
pub struct Entry {
    pub stats: JobStats,
    /// The (first) job's options.
    pub opts: JobOptions,
    /// Where it ran: `tcp://...` and the volume.
    pub url: String,
    pub volume: String,
}

/// Per group: the aggregate the "Run status group" lines show, and the
/// target's CPU time while the group ran.
#[derive(Clone, Debug)]
pub struct Group {
    pub groupid: usize,
    /// Stats of every job in the group (not merged).
    pub jobs: Vec<JobStats>,
    /// CPU time of the target (embedded threads or `--target_pid`) while
    /// the group ran.
    pub target_cpu: Option<CpuUsage>,
    /// Wall time the group ran.
    pub wall: Duration,
}

impl Group {
    /// Total I/Os (both directions) of the group.
    pub fn total_ios(&self) -> u64 {
        self.jobs.iter().map(|j| j.dirs[0].total_ios + j.dirs[1].total_ios).sum()
    }

    /// IOPS of the group: sum of each job's IOPS per direction.
    pub fn iops(&self) -> f64 {
        self.jobs.iter().map(|j| j.dirs[0].iops() + j.dirs[1].iops()).sum()
    }

    /// I/Os per CPU-second of the target.
    pub fn iops_per_target_cpu_sec(&self) -> Option<f64> {
        let cpu = self.target_cpu?.total().as_secs_f64();
        (cpu > 0.0).then(|| self.total_ios() as f64 / cpu)
    }

    fn dir_totals(&self, d: usize) -> (u64, Duration, Vec<f64>) {
        let bytes = self.jobs.iter().map(|j| j.dirs[d].io_bytes).sum();
        let run = self.jobs.iter().map(|j| j.dirs[d].runtime).max().unwrap_or_default();
        let per_job: Vec<f64> = self.jobs.iter().filter(|j| j.dirs[d].total_ios > 0).map(|j| j.dirs[d].bw_bytes()).collect();
        (bytes, run, per_job)
    }
}

/// Everything the report shows.
#[derive(Clone, Debug)]
pub struct Report {
    pub entries: Vec<Entry>,
    pub groups: Vec<Group>,
    /// Lines describing the target (embedded volumes or the URL).
    pub target_lines: Vec<String>,
    pub started: SystemTime,
    /// The global options as given ([`crate::options::RunSpec::globals`]).
    pub globals: Vec<(String, String)>,
}

// ---------------------------------------------------------------------------
// Normal output.

/// fio's unit choice for a min/max/avg/stdev line, in nanoseconds.
fn lat_unit(min: u64, max: u64, dev: f64) -> (&'static str, f64) {
    if min > 2_000_000 && max > 99_999_999 && dev > 1_000_000.0 {
        ("msec", 1e6)
    } else if min > 2000 && max > 99_999 && dev > 1000.0 {
        ("usec", 1e3)
    } else {
        ("nsec", 1.0)
    }
}

fn lat_line(out: &mut String, label: &str, l: &Lat) {
    if l.count() == 0 {
        return;
    }
    let (unit, div) = lat_unit(l.min(), l.max(), l.stddev());
    let _ = writeln!(
        out,
        "    {label:>4} ({unit}): min={}, max={}, avg={:.2}, stdev={:.2}",
        (l.min() as f64 / div) as u64,
        (l.max() as f64 / div) as u64,
        l.mean() / div,
        l.stddev() / div
    );
}

fn percentile_lines(out: &mut String, label: &str, l: &Lat, points: &[f64]) {
    if l.count() == 0 || points.is_empty() {
        return;
    }
    let values: Vec<u64> = points.iter().map(|&p| l.percentile(p)).collect();
    let minv = values.iter().copied().min().unwrap_or(0);
    let maxv = values.iter().copied().max().unwrap_or(0);
    let (unit, div) = if minv > 2_000_000 && maxv > 99_999_999 {
        ("msec", 1_000_000)
    } else if minv > 2000 && maxv > 99_999 {
        ("usec", 1000)
    } else {
        ("nsec", 1)
    };
    let width = (maxv / div).to_string().len().max(5);
    let _ = writeln!(out, "    {label} percentiles ({unit}):");
    for (i, (p, v)) in points.iter().zip(&values).enumerate() {
        if i % 4 == 0 {
            out.push_str("     |");
        }
        let _ = write!(out, " {p:5.2}th=[{:>width$}]", v / div);
        let last = i == points.len() - 1;
        out.push_str(if last || i % 4 == 3 { if last { "\n" } else { ",\n" } } else { "," });
    }
}

fn dir_block(out: &mut String, name: &str, d: &DirStats, opts: &JobOptions, group_bw_kib: f64) {
    if d.total_ios == 0 {
        return;
    }
    let ms = d.runtime.as_millis().max(1);
    let _ = writeln!(
        out,
        "  {name}: IOPS={}, BW={}({}/{ms}msec)",
        num_short(d.iops()),
        bw_both(d.bw_bytes()),
        bytes_binary(d.io_bytes as f64),
    );
    lat_line(out, "slat", &d.slat);
    lat_line(out, "clat", &d.clat);
    lat_line(out, "lat", &d.lat);
    percentile_lines(out, "clat", &d.clat, &opts.percentiles);
    let (mn, mx, avg, dev) = sample_summary(&d.bw_samples);
    let per = if group_bw_kib > 0.0 { avg / group_bw_kib * 100.0 } else { 0.0 };
    let _ = writeln!(
        out,
        "   bw (  KiB/s): min={}, max={}, per={per:.2}%, avg={avg:.2}, stdev={dev:.2}, samples={}",
        mn as u64,
        mx as u64,
        d.bw_samples.len()
    );
    let (mn, mx, avg, dev) = sample_summary(&d.iops_samples);
    let _ = writeln!(
        out,
        "   iops        : min={}, max={}, avg={avg:.2}, stdev={dev:.2}, samples={}",
        mn as u64,
        mx as u64,
        d.iops_samples.len()
    );
}

/// fio's latency buckets, as (label, low ns, high ns).
fn lat_buckets() -> Vec<(&'static str, &'static str, u64, u64)> {
    let mut v = Vec::new();
    let edges: [(&str, u64); 10] = [
        ("2", 2),
        ("4", 4),
        ("10", 10),
        ("20", 20),
        ("50", 50),
        ("100", 100),
        ("250", 250),
        ("500", 500),
        ("750", 750),
        ("1000", 1000),
    ];
    for (unit, scale) in [("nsec", 1u64), ("usec", 1000)] {
        let mut low = if scale == 1 { 0 } else { 1000 };
        for (label, e) in edges {
            let high = e * scale + 1;
            v.push((unit, label, low, high));
            low = high;
        }
    }
    let ms: [(&str, u64); 11] = [
        ("2", 2),
        ("4", 4),
        ("10", 10),
        ("20", 20),
        ("50", 50),
        ("100", 100),
        ("250", 250),
        ("500", 500),
        ("750", 750),
        ("1000", 1000),
        ("2000", 2000),
    ];
    let mut low = 1_000_001;
    for (label, e) in ms {
        let high = e * 1_000_000 + 1;
        v.push(("msec", label, low, high));
        low = high;
    }
    v.push(("msec", ">=2000", low, u64::MAX));
    v
}

fn merged_lat(s: &JobStats) -> Lat {
    let mut l = s.dirs[0].lat.clone();
    l.merge(&s.dirs[1].lat);
    l
}

fn latency_distribution(out: &mut String, s: &JobStats) {
    let l = merged_lat(s);
    if l.count() == 0 {
        return;
    }
    for unit in ["nsec", "usec", "msec"] {
        let parts: Vec<String> = lat_buckets()
            .into_iter()
            .filter(|b| b.0 == unit)
            .map(|(_, label, lo, hi)| (label, l.fraction_between(lo, hi) * 100.0))
            .filter(|(_, pct)| *pct >= 0.01)
            .map(|(label, pct)| format!("{label}={pct:.2}%"))
            .collect();
        if !parts.is_empty() {
            let _ = writeln!(out, "  lat ({unit})   : {}", parts.join(", "));
        }
    }
}

fn pct_row(counts: &[u64; 7], labels: &[&str; 7]) -> String {
    let total: u64 = counts.iter().sum();
    labels
        .iter()
        .zip(counts)
        .map(|(l, &c)| format!("{l}={:.1}%", if total > 0 { c as f64 * 100.0 / total as f64 } else { 0.0 }))
        .collect::<Vec<_>>()
        .join(", ")
}

fn date(t: SystemTime) -> String {
    // RFC 3339 in UTC, without a time zone database.
    let secs = t.duration_since(SystemTime::UNIX_EPOCH).map_or(0, |d| d.as_secs());
    let days = secs / 86400;
    let rem = secs % 86400;
    let (y, m, d) = civil_from_days(days as i64);
    format!("{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z", rem / 3600, rem % 3600 / 60, rem % 60)
}

/// fio's `"time"`: C's `ctime` without the newline (`Wed Dec  2 19:51:54
/// 2026`), in UTC: the bench reads no time zone database (`timestamp` is
/// the same instant, unambiguous).
fn ctime(t: SystemTime) -> String {
    const DAYS: [&str; 7] = ["Sun", "Mon", "Tue", "Wed", "Thu", "Fri", "Sat"];
    const MONTHS: [&str; 12] = ["Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec"];
    let secs = t.duration_since(SystemTime::UNIX_EPOCH).map_or(0, |d| d.as_secs());
    let days = secs / 86400;
    let rem = secs % 86400;
    let (y, m, d) = civil_from_days(days as i64);
    // 1970-01-01 was a Thursday.
    let wday = DAYS[((days + 4) % 7) as usize];
    let month = MONTHS[(m - 1) as usize];
    format!("{wday} {month} {d:>2} {:02}:{:02}:{:02} {y}", rem / 3600, rem % 3600 / 60, rem % 60)
}

/// Days since 1970-01-01 to (year, month, day) (Howard Hinnant's algorithm).
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36524 - doe / 146_096) / 365;
    let y = yoe + era * 400;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (if m <= 2 { y + 1 } else { y }, m, d)
}

/// The lines fio prints before the jobs start.
pub fn header(plans: &[(JobOptions, usize)], target_lines: &[String], threads: usize) -> String {
    let mut out = String::new();
    let mut last: Option<&str> = None;
    for (o, g) in plans {
        if last == Some(o.name.as_str()) {
            continue;
        }
        last = Some(&o.name);
        let _ = writeln!(
            out,
            "{}: (g={g}): rw={}, bs=(R) {}B-{}B, (W) {}B-{}B, (T) 4096B-4096B, ioengine={}, iodepth={}",
            o.name,
            o.rw.name(),
            o.bs[0],
            o.bs[0],
            o.bs[1],
            o.bs[1],
            o.ioengine.name(),
            o.iodepth
        );
        if o.numjobs > 1 {
            out.push_str("...\n");
        }
    }
    let _ = writeln!(out, "{}", version());
    for l in target_lines {
        let _ = writeln!(out, "{l}");
    }
    let _ = writeln!(out, "Starting {threads} thread{}", if threads == 1 { "" } else { "s" });
    out
}

/// fio's normal report.
pub fn normal(r: &Report) -> String {
    let mut out = String::new();
    let pid = std::process::id();
    for e in &r.entries {
        let s = &e.stats;
        let group = r.groups.iter().find(|g| g.groupid == s.groupid);
        let group_bw = |d: usize| -> f64 {
            group.map_or(0.0, |g| {
                let (bytes, run, _) = g.dir_totals(d);
                per_sec(bytes as f64, run) / 1024.0
            })
        };
        let _ = writeln!(
            out,
            "{}: (groupid={}, jobs={}): err={:2}: pid={pid}: {}",
            s.name,
            s.groupid,
            s.jobs,
            s.error,
            date(r.started)
        );
        if let Some(d) = &e.opts.description {
            let _ = writeln!(out, "  Description  : [{d}]");
        }
        dir_block(&mut out, "read", &s.dirs[0], &e.opts, group_bw(0));
        dir_block(&mut out, "write", &s.dirs[1], &e.opts, group_bw(1));
        latency_distribution(&mut out, s);
        let run = s.runtime.as_secs_f64().max(1e-9) * f64::from(s.jobs.max(1));
        let _ = writeln!(
            out,
            "  cpu          : usr={:.2}%, sys={:.2}%, ctx={}, majf={}, minf={}",
            s.cpu.usr.as_secs_f64() / run * 100.0,
            s.cpu.sys.as_secs_f64() / run * 100.0,
            s.cpu.ctx,
            s.cpu.majf,
            s.cpu.minf
        );
        let _ = writeln!(out, "  IO depths    : {}", pct_row(&s.depth_levels, &DEPTH_BUCKETS));
        let _ = writeln!(out, "     submit    : {}", pct_row(&s.submit_batches, &BATCH_BUCKETS));
        let _ = writeln!(out, "     complete  : {}", pct_row(&s.complete_batches, &BATCH_BUCKETS));
        let _ = writeln!(
            out,
            "     issued rwts: total={},{},0,0 short=0,0,0,0 dropped=0,0,0,0",
            s.dirs[0].total_ios, s.dirs[1].total_ios
        );
        let _ = writeln!(out, "     latency   : target=0, window=0, percentile=100.00%, depth={}", e.opts.iodepth);
        let _ = writeln!(out, "     errors    : io={}, verify={}", s.io_errors, s.verify_errors);
        if s.reconnects > 0 {
            let _ = writeln!(out, "     reconnects: {} (the I/O in flight waited and was re-issued)", s.reconnects);
        }
        if let Some(m) = &s.error_msg {
            let _ = writeln!(out, "     first error: {m}");
        }
        out.push('\n');
    }
    for g in &r.groups {
        let _ = writeln!(out, "Run status group {} (all jobs):", g.groupid);
        for (d, name) in [(0, "READ"), (1, "WRITE")] {
            let (bytes, run, per_job) = g.dir_totals(d);
            if bytes == 0 {
                continue;
            }
            let mn = per_job.iter().copied().fold(f64::INFINITY, f64::min);
            let mx = per_job.iter().copied().fold(0.0, f64::max);
            let runs: Vec<u128> =
                g.jobs.iter().filter(|j| j.dirs[d].total_ios > 0).map(|j| j.dirs[d].runtime.as_millis()).collect();
            let _ = writeln!(
                out,
                "{name:>7}: bw={}, {}/s-{}/s ({}/s-{}/s), io={} ({}), run={}-{}msec",
                bw_both(per_sec(bytes as f64, run)),
                bytes_binary(mn),
                bytes_binary(mx),
                bytes_decimal(mn),
                bytes_decimal(mx),
                bytes_binary(bytes as f64),
                bytes_decimal(bytes as f64),
                runs.iter().min().copied().unwrap_or(0),
                runs.iter().max().copied().unwrap_or(0),
            );
        }
        if let Some(cpu) = g.target_cpu {
            let per = g.iops_per_target_cpu_sec().map_or("-".to_owned(), num_short);
            let _ = writeln!(
                out,
                " TARGET: cpu usr={:.2}s sys={:.2}s ({:.1}% of one CPU), IOPS per target CPU-second={per}",
                cpu.usr.as_secs_f64(),
                cpu.sys.as_secs_f64(),
                per_sec(cpu.total().as_secs_f64(), g.wall) * 100.0
            );
        }
        let reconnects: u64 = g.jobs.iter().map(|j| j.reconnects).sum();
        if reconnects > 0 {
            let _ = writeln!(out, " RECONNECTS: {reconnects} (sessions re-established after losing the target)");
        }
    }
    out
}

// ---------------------------------------------------------------------------
// JSON.

/// An ordered JSON value (fio's key order, without serde_json's
/// `preserve_order` feature).
#[derive(Clone, Debug)]
pub enum J {
    Null,
    Bool(bool),
    U(u64),
    I(i64),
    F(f64),
    S(String),
    A(Vec<J>),
    O(Vec<(String, J)>),
}

impl Serialize for J {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            J::Null => s.serialize_unit(),
            J::Bool(b) => s.serialize_bool(*b),
            J::U(v) => s.serialize_u64(*v),
            J::I(v) => s.serialize_i64(*v),
            J::F(v) if v.is_finite() => s.serialize_f64(*v),
            J::F(_) => s.serialize_f64(0.0),
            J::S(v) => s.serialize_str(v),
            J::A(v) => {
                let mut seq = s.serialize_seq(Some(v.len()))?;
                for x in v {
                    seq.serialize_element(x)?;
                }
                seq.end()
            }
            J::O(v) => {
                let mut map = s.serialize_map(Some(v.len()))?;
                for (k, x) in v {
                    map.serialize_entry(k, x)?;
                }
                map.end()
            }
        }
    }
}

fn obj(pairs: Vec<(&str, J)>) -> J {
    J::O(pairs.into_iter().map(|(k, v)| (k.to_owned(), v)).collect())
}

/// One latency object; json+ (`plus`) adds fio's `bins` where fio has
/// them, next to the percentiles: each non-empty bin's value in ns (a
/// string, as fio) and its count, ascending.
fn lat_json(l: &Lat, points: &[f64], plus: bool) -> J {
    let mut v = vec![
        ("min", J::U(l.min())),
        ("max", J::U(l.max())),
        ("mean", J::F(l.mean())),
        ("stddev", J::F(l.stddev())),
        ("N", J::U(l.count())),
    ];
    if l.count() > 0 {
        let pct = points.iter().map(|&p| (format!("{p:.6}"), J::U(l.percentile(p)))).collect();
        v.push(("percentile", J::O(pct)));
        if plus {
            v.push(("bins", J::O(l.fio_bins().into_iter().map(|(ns, n)| (ns.to_string(), J::U(n))).collect())));
        }
    }
    obj(v)
}

fn dir_json(d: &DirStats, points: &[f64], group_bw_kib: f64, plus: bool) -> J {
    let (bmin, bmax, bmean, bdev) = sample_summary(&d.bw_samples);
    let (imin, imax, imean, idev) = sample_summary(&d.iops_samples);
    let bw_bytes = d.bw_bytes();
    obj(vec![
        ("io_bytes", J::U(d.io_bytes)),
        ("io_kbytes", J::U(d.io_bytes / 1024)),
        ("bw_bytes", J::U(bw_bytes as u64)),
        ("bw", J::U((bw_bytes / 1024.0) as u64)),
        ("iops", J::F(d.iops())),
        ("runtime", J::U(d.runtime.as_millis() as u64)),
        ("total_ios", J::U(d.total_ios)),
        ("short_ios", J::U(0)),
        ("drop_ios", J::U(0)),
        ("slat_ns", lat_json(&d.slat, points, plus)),
        ("clat_ns", lat_json(&d.clat, points, plus)),
        ("lat_ns", lat_json(&d.lat, points, plus)),
        ("bw_min", J::U(bmin as u64)),
        ("bw_max", J::U(bmax as u64)),
        ("bw_agg", J::F(if group_bw_kib > 0.0 { bmean / group_bw_kib * 100.0 } else { 0.0 })),
        ("bw_mean", J::F(bmean)),
        ("bw_dev", J::F(bdev)),
        ("bw_samples", J::U(d.bw_samples.len() as u64)),
        ("iops_min", J::U(imin as u64)),
        ("iops_max", J::U(imax as u64)),
        ("iops_mean", J::F(imean)),
        ("iops_stddev", J::F(idev)),
        ("iops_samples", J::U(d.iops_samples.len() as u64)),
    ])
}

fn pct_obj(counts: &[u64; 7], labels: &[&str; 7]) -> J {
    let total: u64 = counts.iter().sum();
    J::O(
        labels
            .iter()
            .zip(counts)
            .map(|(l, &c)| ((*l).to_owned(), J::F(if total > 0 { c as f64 * 100.0 / total as f64 } else { 0.0 })))
            .collect(),
    )
}

fn latency_json(s: &JobStats, unit: &str) -> J {
    let l = merged_lat(s);
    J::O(
        lat_buckets()
            .into_iter()
            .filter(|b| b.0 == unit)
            .map(|(_, label, lo, hi)| (label.to_owned(), J::F(l.fraction_between(lo, hi) * 100.0)))
            .collect(),
    )
}

/// fio's JSON document (`--output-format=json`).
pub fn json(r: &Report) -> J {
    document(r, false)
}

/// fio's json+ document: the JSON with each latency's `bins`.
pub fn json_plus(r: &Report) -> J {
    document(r, true)
}

fn document(r: &Report, plus: bool) -> J {
    let started = r.started.duration_since(SystemTime::UNIX_EPOCH).unwrap_or_default();
    let zero_dir = dir_json(&DirStats::default(), &[], 0.0, false);
    let jobs: Vec<J> = r
        .entries
        .iter()
        .map(|e| {
            let s = &e.stats;
            let group = r.groups.iter().find(|g| g.groupid == s.groupid);
            let group_bw = |d: usize| -> f64 {
                group.map_or(0.0, |g| {
                    let (bytes, run, _) = g.dir_totals(d);
                    per_sec(bytes as f64, run) / 1024.0
                })
            };
            let run = s.runtime.as_secs_f64().max(1e-9) * f64::from(s.jobs.max(1));
            // The job's own options, each once with its last value; the
            // globals are in "global options", as fio has them.
            let mut options: Vec<(String, J)> = vec![("name".to_owned(), J::S(e.opts.name.clone()))];
            for (k, v) in &e.opts.own {
                match options.iter_mut().find(|(key, _)| key == k) {
                    Some(slot) => slot.1 = J::S(v.clone()),
                    None => options.push((k.clone(), J::S(v.clone()))),
                }
            }
            let options = J::O(options);
            obj(vec![
                ("jobname", J::S(s.name.clone())),
                ("groupid", J::U(s.groupid as u64)),
                ("error", J::I(i64::from(s.error))),
                ("eta", J::U(0)),
                ("elapsed", J::U(s.elapsed.as_secs().max(1))),
                ("job options", options),
                ("read", dir_json(&s.dirs[0], &e.opts.percentiles, group_bw(0), plus)),
                ("write", dir_json(&s.dirs[1], &e.opts.percentiles, group_bw(1), plus)),
                ("trim", zero_dir.clone()),
                (
                    "sync",
                    obj(vec![("total_ios", J::U(0)), ("lat_ns", lat_json(&Lat::default(), &[], false))]),
                ),
                ("job_runtime", J::U(s.runtime.as_millis() as u64)),
                ("usr_cpu", J::F(s.cpu.usr.as_secs_f64() / run * 100.0)),
                ("sys_cpu", J::F(s.cpu.sys.as_secs_f64() / run * 100.0)),
                ("ctx", J::U(s.cpu.ctx)),
                ("majf", J::U(s.cpu.majf)),
                ("minf", J::U(s.cpu.minf)),
                ("iodepth_level", pct_obj(&s.depth_levels, &DEPTH_BUCKETS)),
                ("iodepth_submit", pct_obj(&s.submit_batches, &BATCH_BUCKETS)),
                ("iodepth_complete", pct_obj(&s.complete_batches, &BATCH_BUCKETS)),
                ("latency_ns", latency_json(s, "nsec")),
                ("latency_us", latency_json(s, "usec")),
                ("latency_ms", latency_json(s, "msec")),
                ("latency_depth", J::U(u64::from(e.opts.iodepth))),
                ("latency_target", J::U(0)),
                ("latency_percentile", J::F(100.0)),
                ("latency_window", J::U(0)),
                (
                    "rdmablk",
                    obj(vec![
                        ("ioengine", J::S(e.opts.ioengine.name().to_owned())),
                        ("target", J::S(e.url.clone())),
                        ("volume", J::S(e.volume.clone())),
                        ("io_errors", J::U(s.io_errors)),
                        ("verify_errors", J::U(s.verify_errors)),
                        ("reconnects", J::U(s.reconnects)),
                        ("error_message", s.error_msg.clone().map_or(J::Null, J::S)),
                    ]),
                ),
            ])
        })
        .collect();
    let groups: Vec<J> = r
        .groups
        .iter()
        .map(|g| {
            let cpu = g.target_cpu.map_or(J::Null, |c| {
                obj(vec![("usr_sec", J::F(c.usr.as_secs_f64())), ("sys_sec", J::F(c.sys.as_secs_f64()))])
            });
            obj(vec![
                ("groupid", J::U(g.groupid as u64)),
                ("wall_ms", J::U(g.wall.as_millis() as u64)),
                ("total_ios", J::U(g.total_ios())),
                ("iops", J::F(g.iops())),
                ("target_cpu", cpu),
                ("iops_per_target_cpu_sec", g.iops_per_target_cpu_sec().map_or(J::Null, J::F)),
            ])
        })
        .collect();
    // fio's top-level keys in fio's order; "global options" only when
    // there are globals, as fio. The bench's own keys follow.
    let mut top = vec![
        ("fio version", J::S(fio_version())),
        ("timestamp", J::U(started.as_secs())),
        ("timestamp_ms", J::U(started.as_millis() as u64)),
        ("time", J::S(ctime(r.started))),
    ];
    if !r.globals.is_empty() {
        let mut globals: Vec<(String, J)> = Vec::new();
        for (k, v) in &r.globals {
            match globals.iter_mut().find(|(key, _)| key == k) {
                Some(slot) => slot.1 = J::S(v.clone()),
                None => globals.push((k.clone(), J::S(v.clone()))),
            }
        }
        top.push(("global options", J::O(globals)));
    }
    top.extend([
        ("jobs", J::A(jobs)),
        // No disk statistics: the disks are the target's.
        ("disk_util", J::A(Vec::new())),
        ("rdmablk-bench version", J::S(version())),
        (
            "rdmablk",
            obj(vec![
                ("target", J::A(r.target_lines.iter().cloned().map(J::S).collect())),
                ("groups", J::A(groups)),
                ("reconnects", J::U(r.entries.iter().map(|e| e.stats.reconnects).sum())),
            ]),
        ),
    ]);
    obj(top)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn time_is_ctimes_and_top_level_keys_are_fios() {
        assert_eq!(ctime(SystemTime::UNIX_EPOCH), "Thu Jan  1 00:00:00 1970");
        assert_eq!(ctime(SystemTime::UNIX_EPOCH + Duration::from_secs(1_796_241_510)), "Wed Dec  2 19:58:30 2026");
        assert_eq!(ctime(SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000)), "Tue Nov 14 22:13:20 2023");
        let mut lat = Lat::new();
        for v in [100u64, 129, 130, 30_000, 30_100, 5_000_000] {
            lat.record(v);
        }
        let mut stats = JobStats { name: "a".into(), jobs: 1, ..JobStats::default() };
        stats.dirs[0].clat = lat.clone();
        stats.dirs[0].total_ios = 6;
        let mut opts = JobOptions::new("a");
        opts.own = vec![("rw".into(), "read".into())];
        opts.given = vec![("size".into(), "4m".into()), ("rw".into(), "read".into())];
        let mut r = Report {
            entries: vec![Entry { stats, opts, url: "tcp://127.0.0.1:1".into(), volume: "v".into() }],
            groups: Vec::new(),
            target_lines: Vec::new(),
            started: SystemTime::UNIX_EPOCH + Duration::from_millis(1_796_241_510_815),
            globals: vec![("size".into(), "4m".into()), ("bs".into(), "4k".into()), ("size".into(), "8m".into())],
        };
        let text = serde_json::to_string(&json_plus(&r)).unwrap();
        let keys: Vec<&str> = ["fio version", "timestamp", "timestamp_ms", "time", "global options", "jobs", "disk_util"]
            .into_iter()
            .map(|k| text.find(&format!("\"{k}\":")).map(|_| k).unwrap_or("missing"))
            .collect();
        assert!(!keys.contains(&"missing"), "{text}");
        let at: Vec<usize> = keys.iter().map(|k| text.find(&format!("\"{k}\":")).unwrap()).collect();
        assert!(at.windows(2).all(|w| w[0] < w[1]), "fio's order: {text}");
        let v: serde_json::Value = serde_json::from_str(&text).unwrap();
        assert_eq!(v["fio version"], format!("fio-3.33-rdmablk-bench-{}", env!("CARGO_PKG_VERSION")));
        assert_eq!((v["timestamp"].as_u64(), v["timestamp_ms"].as_u64()), (Some(1_796_241_510), Some(1_796_241_510_815)));
        assert_eq!(v["time"], "Wed Dec  2 19:58:30 2026");
        assert_eq!(v["global options"], serde_json::json!({"size": "8m", "bs": "4k"}), "each once, the last value");
        assert_eq!(v["jobs"][0]["job options"], serde_json::json!({"name": "a", "rw": "read"}), "the job's own options");
        let bins = &v["jobs"][0]["read"]["clat_ns"]["bins"];
        // fio 3.33's bins of these values (128..=129 is one bin; 29952..=30207 another).
        assert_eq!(bins, &serde_json::json!({"100": 1, "129": 1, "131": 1, "30080": 2, "5013504": 1}), "{bins}");
        assert!(v["jobs"][0]["read"]["slat_ns"].get("bins").is_none(), "no bins without samples");
        // Plain JSON has no bins, and no "global options" without globals.
        r.globals.clear();
        let v = serde_json::to_value(json(&r)).unwrap();
        assert!(v["jobs"][0]["read"]["clat_ns"].get("bins").is_none());
        assert!(v.get("global options").is_none());
    }

    #[test]
    fn dates_are_utc() {
        assert_eq!(date(SystemTime::UNIX_EPOCH), "1970-01-01T00:00:00Z");
        let t = SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000);
        assert_eq!(date(t), "2023-11-14T22:13:20Z");
    }

    #[test]
    fn percentile_lines_look_like_fio() {
        let mut l = Lat::new();
        for v in 0..10_000u64 {
            l.record(30_000 + v * 50);
        }
        let mut s = String::new();
        percentile_lines(&mut s, "clat", &l, &crate::options::DEFAULT_PERCENTILES);
        let lines: Vec<&str> = s.lines().collect();
        assert_eq!(lines[0], "    clat percentiles (usec):");
        assert!(lines[1].starts_with("     |  1.00th=[   "), "{}", lines[1]);
        assert!(lines[1].ends_with(','), "{}", lines[1]);
        assert!(lines[5].contains("99.99th="), "{s}");
        assert_eq!(lines.len(), 6);
    }

    #[test]
    fn reconnects_are_counted_per_job_and_in_total_and_printed_when_non_zero() {
        let job = |name: &str, reconnects| JobStats { name: name.into(), jobs: 1, reconnects, ..JobStats::default() };
        let entry = |stats: JobStats| Entry {
            opts: JobOptions::new(&stats.name),
            stats,
            url: "tcp://127.0.0.1:1".into(),
            volume: "v".into(),
        };
        let report = |a: u64, b: u64| Report {
            entries: vec![entry(job("a", a)), entry(job("b", b))],
            groups: vec![Group {
                groupid: 0,
                jobs: vec![job("a", a), job("b", b)],
                target_cpu: None,
                wall: Duration::from_secs(1),
            }],
            target_lines: Vec::new(),
            started: SystemTime::UNIX_EPOCH,
            globals: Vec::new(),
        };
        let r = report(2, 1);
        let v = serde_json::to_value(json(&r)).unwrap();
        assert_eq!(v["jobs"][0]["rdmablk"]["reconnects"], 2);
        assert_eq!(v["jobs"][1]["rdmablk"]["reconnects"], 1);
        assert_eq!(v["rdmablk"]["reconnects"], 3, "the total over every job");
        let text = normal(&r);
        let b_at = text.find("b: (groupid=0").expect("job b's section");
        assert!(text[..b_at].contains("     reconnects: 2 "), "{text}");
        assert!(text[b_at..].contains("     reconnects: 1 "), "{text}");
        assert!(text.contains(" RECONNECTS: 3 "), "{text}");

        let r = report(0, 0);
        let v = serde_json::to_value(json(&r)).unwrap();
        assert_eq!(v["jobs"][0]["rdmablk"]["reconnects"], 0, "always in the JSON");
        assert_eq!(v["rdmablk"]["reconnects"], 0);
        let text = normal(&r);
        assert!(!text.to_lowercase().contains("reconnects"), "printed only when non-zero:\n{text}");

        // Group reporting adds them up.
        let mut merged = job("a", 2);
        merged.merge(&job("b", 1));
        assert_eq!(merged.reconnects, 3);
    }

    #[test]
    fn lat_units_follow_fio() {
        assert_eq!(lat_unit(30_000, 500_000, 11_000.0).0, "usec");
        assert_eq!(lat_unit(300, 5000, 100.0).0, "nsec");
        assert_eq!(lat_unit(3_000_000, 500_000_000, 2_000_000.0).0, "msec");
    }
}
