//! fio's per-job log files and its latency bins, in fio 3.33's formats, so
//! that fio's own tools (`fio2gnuplot`, `fio_generate_plots`,
//! `fiologparser_hist.py`, `fio_jsonplus_clat2csv`) and fio-plot read them.
//!
//! # Files
//! `write_lat_log=P` writes `P_lat.N.log`, `P_clat.N.log` and
//! `P_slat.N.log`; `write_bw_log=P` `P_bw.N.log`; `write_iops_log=P`
//! `P_iops.N.log`; `write_hist_log=P` `P_clat_hist.N.log`. `N` is the job's
//! number in the run, from 1, clones of `numjobs` counted (fio's thread
//! number); without a value `P` is the job's name. With `per_job_logs=0` the
//! `.N` is left out and the jobs append to one file, as fio does.
//!
//! # Lines
//! `time, value, ddir, bs, prio` (`time, value, ddir, bs, offset, prio` with
//! `log_offset=1`): milliseconds since the job started measuring (after
//! `ramp_time`), the value, 0 for reads and 1 for writes, the block size in
//! bytes, the offset in bytes, and the priority bit (always 0: rdmablk-bench
//! has no I/O priorities). Latencies are in nanoseconds; bandwidth in KiB/s;
//! IOPS in I/Os per second.
//!
//! - Without `log_avg_msec` every I/O has a line, stamped at its completion:
//!   its latency; its bandwidth (bytes * 10^6 / clat in ns, fio's per-I/O
//!   rate); 1 in the IOPS log.
//! - With `log_avg_msec=M` a latency log has, per direction, one line per
//!   window of at least M ms in which I/O completed: the mean rounded to
//!   the nearest integer, or with `log_max_value=1` the largest value. The
//!   window closes at the first completion M ms after it opened (the line
//!   has that completion's time), the next opens at the M-ms boundary
//!   before it, and the last, partial window is written at the end of the
//!   job. The bandwidth and IOPS logs have one line per M ms per direction
//!   with I/O, the rate over the time since the previous line (integer
//!   arithmetic as fio: bytes * 1000 / ms / 1024). Averaged lines have
//!   block size 0 and offset 0, as fio writes them.
//! - The histogram log (`log_hist_msec=M`, without which it stays empty, as
//!   in fio) has per direction one line per window of at least M ms:
//!   `time, ddir, bs, bin0, bin1, ...`: the completion latencies of the I/O
//!   of that window in fio's [`PLAT_NR`] bins, `log_hist_coarseness=C`
//!   adding up `2^C` neighbouring bins. `bs` is the block size of the I/O
//!   that closed the window.
//!
//! # Bins
//! fio's latency histogram ([`plat_val_to_idx`]): values below 128 ns have a
//! bin each; above, every power of two is split into 64 bins, so that a bin
//! is within 1/128 of its values; 29 groups, 1856 bins, the last one taking
//! everything from 2^34 ns up. A bin's value ([`plat_idx_to_val`]) is the
//! middle of its range, the key json+ writes in `clat_ns.bins`.

use std::fs::{File, OpenOptions};
use std::io::{BufWriter, Write};
use std::path::PathBuf;
use std::sync::Mutex;

/// fio's `FIO_IO_U_PLAT_BITS`: bits of a value kept below its most significant one.
pub const PLAT_BITS: u32 = 6;
/// Bins per group (`FIO_IO_U_PLAT_VAL`).
pub const PLAT_VAL: u64 = 1 << PLAT_BITS;
/// Groups (`FIO_IO_U_PLAT_GROUP_NR`).
pub const PLAT_GROUP_NR: usize = 29;
/// Bins (`FIO_IO_U_PLAT_NR`).
pub const PLAT_NR: usize = PLAT_GROUP_NR * PLAT_VAL as usize;

/// fio's bin of a latency in nanoseconds.
#[inline]
pub fn plat_val_to_idx(val: u64) -> usize {
    let msb = if val == 0 { 0 } else { 63 - val.leading_zeros() };
    // Up to 2^(PLAT_BITS+1) - 1 every value has its own bin.
    if msb <= PLAT_BITS {
        return val as usize;
    }
    let error_bits = msb - PLAT_BITS;
    let base = ((error_bits + 1) as usize) << PLAT_BITS;
    let offset = ((PLAT_VAL - 1) & (val >> error_bits)) as usize;
    (base + offset).min(PLAT_NR - 1)
}

/// The value fio gives bin `idx`: the middle of the bin's range.
pub fn plat_idx_to_val(idx: usize) -> u64 {
    assert!(idx < PLAT_NR, "bin {idx} is beyond fio's {PLAT_NR}");
    if idx < (PLAT_VAL as usize) << 1 {
        return idx as u64;
    }
    let error_bits = (idx >> PLAT_BITS) as u32 - 1;
    let base = 1u64 << (error_bits + PLAT_BITS);
    let k = idx as u64 % PLAT_VAL;
    // fio: base + (k + 0.5) * 2^error_bits, exact in integers as error_bits >= 1.
    base + (k << error_bits) + (1u64 << (error_bits - 1))
}

/// The log options of a job.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LogOptions {
    /// Prefixes (`write_lat_log` and so on); empty: the job's name.
    pub lat: Option<String>,
    pub bw: Option<String>,
    pub iops: Option<String>,
    pub hist: Option<String>,
    /// `log_avg_msec` (0: a line per I/O).
    pub avg_msec: u64,
    /// `log_hist_msec` (0: no histogram lines).
    pub hist_msec: u64,
    /// `log_hist_coarseness`, 0..=6.
    pub hist_coarseness: u32,
    /// `log_max_value`: the window's largest value instead of its mean.
    pub max_value: bool,
    /// `log_offset`: an offset column.
    pub offset: bool,
    /// `per_job_logs` (default 1): `.N` in the names.
    pub per_job: bool,
}

impl Default for LogOptions {
    fn default() -> Self {
        LogOptions {
            lat: None,
            bw: None,
            iops: None,
            hist: None,
            avg_msec: 0,
            hist_msec: 0,
            hist_coarseness: 0,
            max_value: false,
            offset: false,
            per_job: true,
        }
    }
}

impl LogOptions {
    pub fn any(&self) -> bool {
        self.lat.is_some() || self.bw.is_some() || self.iops.is_some() || self.hist.is_some()
    }
}

/// fio's file name of a log: `PREFIX_KIND.N.log` (`PREFIX_KIND.log` without per-job logs).
pub fn log_path(prefix: &str, job_name: &str, kind: &str, number: usize, per_job: bool) -> PathBuf {
    let prefix = if prefix.is_empty() { job_name } else { prefix };
    if per_job {
        PathBuf::from(format!("{prefix}_{kind}.{number}.log"))
    } else {
        PathBuf::from(format!("{prefix}_{kind}.log"))
    }
}

/// Shared logs (`per_job_logs=0`) are appended to one job at a time.
static SHARED_APPEND: Mutex<()> = Mutex::new(());

/// Where a log's lines go: straight to its file, or, for a file shared
/// with other jobs, to memory until the job ends (then appended whole, so
/// lines of two jobs never mix).
enum Out {
    File(BufWriter<File>),
    Shared(Vec<u8>),
}

struct Sink {
    path: PathBuf,
    option: &'static str,
    out: Out,
    /// The first write error; the log stops there.
    error: Option<String>,
}

impl Sink {
    fn open(path: PathBuf, option: &'static str, per_job: bool) -> Result<Sink, String> {
        let cannot = |e: std::io::Error| format!("{option}: cannot create {}: {e}", path.display());
        let out = if per_job {
            Out::File(BufWriter::with_capacity(1 << 20, File::create(&path).map_err(cannot)?))
        } else {
            // Created now so that a bad path fails before the job runs; fio
            // appends to what is there.
            OpenOptions::new().create(true).append(true).open(&path).map_err(cannot)?;
            Out::Shared(Vec::new())
        };
        Ok(Sink { path, option, out, error: None })
    }

    fn write(&mut self, line: std::fmt::Arguments<'_>) {
        if self.error.is_some() {
            return;
        }
        let r = match &mut self.out {
            Out::File(w) => w.write_fmt(line),
            Out::Shared(v) => v.write_fmt(line),
        };
        if let Err(e) = r {
            self.error = Some(format!("{}: writing {}: {e}", self.option, self.path.display()));
        }
    }

    fn finish(self) -> Result<(), String> {
        if let Some(e) = self.error {
            return Err(e);
        }
        let fail = |e: std::io::Error| format!("{}: writing {}: {e}", self.option, self.path.display());
        match self.out {
            Out::File(mut w) => w.flush().map_err(fail),
            Out::Shared(v) => {
                let _one_at_a_time = SHARED_APPEND.lock().unwrap_or_else(|p| p.into_inner());
                let mut f = OpenOptions::new().create(true).append(true).open(&self.path).map_err(fail)?;
                f.write_all(&v).map_err(fail)
            }
        }
    }
}

/// One direction's averaging window.
#[derive(Clone, Copy, Debug, Default)]
struct Window {
    n: u64,
    sum: u128,
    max: u64,
}

impl Window {
    fn add(&mut self, v: u64) {
        self.n += 1;
        self.sum += u128::from(v);
        self.max = self.max.max(v);
    }

    /// fio's value of the window: the mean rounded (mean + 0.5, truncated) or the maximum.
    fn value(&self, max_value: bool) -> u64 {
        if max_value {
            self.max
        } else {
            (self.sum as f64 / self.n as f64 + 0.5) as u64
        }
    }
}

/// A latency log (or the per-I/O bandwidth and IOPS logs).
struct ValueLog {
    sink: Sink,
    windows: [Window; 2],
    /// Where each direction's window opened (ms).
    opened: [u64; 2],
}

impl ValueLog {
    fn new(sink: Sink) -> ValueLog {
        ValueLog { sink, windows: [Window::default(); 2], opened: [0; 2] }
    }

    fn line(&mut self, ms: u64, value: u64, dir: usize, bs: u64, offset: Option<u64>) {
        match offset {
            Some(off) => self.sink.write(format_args!("{ms}, {value}, {dir}, {bs}, {off}, 0\n")),
            None => self.sink.write(format_args!("{ms}, {value}, {dir}, {bs}, 0\n")),
        }
    }

    /// One I/O's value: its own line, or into the window.
    fn sample(&mut self, cfg: &Cfg, ms: u64, value: u64, dir: usize, bs: u64, offset: u64) {
        if cfg.avg_msec == 0 {
            self.line(ms, value, dir, bs, cfg.offset.then_some(offset));
            return;
        }
        self.windows[dir].add(value);
        if ms < self.opened[dir] || ms - self.opened[dir] < cfg.avg_msec {
            return;
        }
        self.close(cfg, ms, dir);
        self.opened[dir] = ms - ms % cfg.avg_msec;
    }

    fn close(&mut self, cfg: &Cfg, ms: u64, dir: usize) {
        let w = std::mem::take(&mut self.windows[dir]);
        if w.n > 0 {
            self.line(ms, w.value(cfg.max_value), dir, 0, cfg.offset.then_some(0));
        }
    }
}

/// The histogram log.
struct HistLog {
    sink: Sink,
    bins: [Box<[u64]>; 2],
    /// Where each direction's window opened (ms; 0: not yet, as fio).
    last: [u64; 2],
}

/// The settings the hot path needs.
#[derive(Clone, Copy, Debug)]
struct Cfg {
    avg_msec: u64,
    hist_msec: u64,
    stride: usize,
    max_value: bool,
    offset: bool,
}

/// Rates of the averaged bandwidth and IOPS logs.
#[derive(Clone, Copy, Debug, Default)]
struct Rates {
    last_ns: u64,
    bytes: [u64; 2],
    ios: [u64; 2],
    base_bytes: [u64; 2],
    base_ios: [u64; 2],
}

/// The logs of one job.
pub struct JobLogs {
    cfg: Cfg,
    /// Job time (ns) at which the log's time 0 is: the end of the ramp.
    epoch_ns: u64,
    slat: Option<ValueLog>,
    clat: Option<ValueLog>,
    lat: Option<ValueLog>,
    bw: Option<ValueLog>,
    iops: Option<ValueLog>,
    hist: Option<HistLog>,
    rates: Rates,
}

impl JobLogs {
    /// Opens (creates) the logs `opts` asks for, of job `name`, number
    /// `number` in the run (from 1). `epoch_ns`: the job time of the logs'
    /// time 0.
    pub fn open(opts: &LogOptions, name: &str, number: usize, epoch_ns: u64) -> Result<JobLogs, String> {
        let per_job = opts.per_job;
        let sink = |prefix: &str, kind: &str, option: &'static str| {
            Sink::open(log_path(prefix, name, kind, number, per_job), option, per_job)
        };
        let (mut slat, mut clat, mut lat) = (None, None, None);
        if let Some(p) = &opts.lat {
            lat = Some(ValueLog::new(sink(p, "lat", "write_lat_log")?));
            slat = Some(ValueLog::new(sink(p, "slat", "write_lat_log")?));
            clat = Some(ValueLog::new(sink(p, "clat", "write_lat_log")?));
        }
        let bw = opts.bw.as_deref().map(|p| sink(p, "bw", "write_bw_log").map(ValueLog::new)).transpose()?;
        let iops = opts.iops.as_deref().map(|p| sink(p, "iops", "write_iops_log").map(ValueLog::new)).transpose()?;
        let hist = match &opts.hist {
            Some(p) => Some(HistLog {
                sink: sink(p, "clat_hist", "write_hist_log")?,
                bins: [vec![0; PLAT_NR].into_boxed_slice(), vec![0; PLAT_NR].into_boxed_slice()],
                last: [0; 2],
            }),
            None => None,
        };
        let cfg = Cfg {
            avg_msec: opts.avg_msec,
            hist_msec: opts.hist_msec,
            stride: 1 << opts.hist_coarseness.min(6),
            max_value: opts.max_value,
            offset: opts.offset,
        };
        let rates = Rates { last_ns: epoch_ns, ..Rates::default() };
        Ok(JobLogs { cfg, epoch_ns, slat, clat, lat, bw, iops, hist, rates })
    }

    /// Logs nothing (no log option given).
    pub fn none() -> JobLogs {
        JobLogs {
            cfg: Cfg { avg_msec: 0, hist_msec: 0, stride: 1, max_value: false, offset: false },
            epoch_ns: 0,
            slat: None,
            clat: None,
            lat: None,
            bw: None,
            iops: None,
            hist: None,
            rates: Rates::default(),
        }
    }

    /// Whether any log is open: the job loop skips the calls otherwise.
    #[inline]
    pub fn enabled(&self) -> bool {
        self.slat.is_some() || self.bw.is_some() || self.iops.is_some() || self.hist.is_some()
    }

    fn ms(&self, now_ns: u64) -> u64 {
        now_ns.saturating_sub(self.epoch_ns) / 1_000_000
    }

    /// One measured I/O, completed at job time `now_ns`: direction (0 read,
    /// 1 write), length, offset and its latencies in ns.
    #[allow(clippy::too_many_arguments)]
    pub fn io(&mut self, now_ns: u64, dir: usize, len: u64, offset: u64, slat: u64, clat: u64, lat: u64) {
        let ms = self.ms(now_ns);
        let cfg = self.cfg;
        for (log, v) in [(&mut self.slat, slat), (&mut self.clat, clat), (&mut self.lat, lat)] {
            if let Some(l) = log {
                l.sample(&cfg, ms, v, dir, len, offset);
            }
        }
        if cfg.avg_msec == 0 {
            // fio's per-I/O rate: bytes per millisecond of completion latency.
            let rate = (len * 1_000_000).checked_div(clat).unwrap_or(0);
            if let Some(l) = &mut self.bw {
                l.line(ms, rate, dir, len, cfg.offset.then_some(offset));
            }
            if let Some(l) = &mut self.iops {
                l.line(ms, 1, dir, len, cfg.offset.then_some(offset));
            }
        } else {
            self.rates.bytes[dir] += len;
            self.rates.ios[dir] += 1;
        }
        if let Some(h) = &mut self.hist {
            if cfg.hist_msec > 0 {
                h.bins[dir][plat_val_to_idx(clat)] += 1;
                if h.last[dir] == 0 {
                    h.last[dir] = ms;
                }
                let window = ms.saturating_sub(h.last[dir]);
                if window >= cfg.hist_msec {
                    let bins = &mut h.bins[dir];
                    h.sink.write(format_args!("{ms}, {dir}, {len}"));
                    for chunk in bins.chunks(cfg.stride) {
                        let n: u64 = chunk.iter().sum();
                        h.sink.write(format_args!(", {n}"));
                    }
                    h.sink.write(format_args!("\n"));
                    bins.fill(0);
                    h.last[dir] = ms - (window - cfg.hist_msec);
                }
            }
        }
    }

    /// After a batch of completions: the averaged bandwidth and IOPS lines
    /// whose time has come.
    pub fn tick(&mut self, now_ns: u64) {
        let avg = self.cfg.avg_msec;
        if avg == 0 || (self.bw.is_none() && self.iops.is_none()) {
            return;
        }
        let spent = now_ns.saturating_sub(self.rates.last_ns) / 1_000_000;
        // fio samples up to a millisecond early (LOG_MSEC_SLACK).
        if spent < avg && avg - spent > 1 {
            return;
        }
        let ms = self.ms(now_ns);
        let offset = self.cfg.offset.then_some(0);
        let r = &mut self.rates;
        for dir in 0..2 {
            let bytes = r.bytes[dir] - r.base_bytes[dir];
            let ios = r.ios[dir] - r.base_ios[dir];
            if bytes == 0 {
                continue;
            }
            let bw = (bytes * 1000).checked_div(spent).map_or(0, |b| b / 1024);
            let iops = (ios * 1000).checked_div(spent).unwrap_or(0);
            if let Some(l) = &mut self.bw {
                l.line(ms, bw, dir, 0, offset);
            }
            if let Some(l) = &mut self.iops {
                l.line(ms, iops, dir, 0, offset);
            }
            r.base_bytes[dir] = r.bytes[dir];
            r.base_ios[dir] = r.ios[dir];
        }
        r.last_ns = now_ns;
    }

    /// At the end of the job: the partial windows of the latency logs, and
    /// every log to its file. Returns the first error.
    pub fn finish(mut self, now_ns: u64) -> Result<(), String> {
        let ms = self.ms(now_ns);
        let cfg = self.cfg;
        let mut first: Option<String> = None;
        let mut done = |r: Result<(), String>| {
            if let Err(e) = r {
                first.get_or_insert(e);
            }
        };
        for mut l in [self.slat.take(), self.clat.take(), self.lat.take()].into_iter().flatten() {
            if cfg.avg_msec > 0 {
                for dir in 0..2 {
                    l.close(&cfg, ms, dir);
                }
            }
            done(l.sink.finish());
        }
        for l in [self.bw.take(), self.iops.take()].into_iter().flatten() {
            done(l.sink.finish());
        }
        if let Some(h) = self.hist.take() {
            done(h.sink.finish());
        }
        first.map_or(Ok(()), Err)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bins_are_fios() {
        // Every value up to 127 has its own bin.
        for v in 0..128u64 {
            assert_eq!(plat_val_to_idx(v), v as usize);
            assert_eq!(plat_idx_to_val(v as usize), v);
        }
        // Keys of a real fio 3.33 json+ run are bin values: they map to themselves.
        for key in [27776u64, 29824, 30336, 30592, 30848] {
            assert_eq!(plat_idx_to_val(plat_val_to_idx(key)), key);
        }
        // 128..=129 share a bin whose value is 129; 256..=259 one of value 258.
        assert_eq!((plat_val_to_idx(128), plat_val_to_idx(129), plat_val_to_idx(130)), (128, 128, 129));
        assert_eq!((plat_idx_to_val(129), plat_idx_to_val(plat_val_to_idx(5_000_000))), (131, 5_013_504));
        assert_eq!(plat_idx_to_val(128), 129);
        assert_eq!(plat_idx_to_val(plat_val_to_idx(257)), 258);
        // The last bin takes everything from 2^34 ns on.
        assert_eq!(plat_val_to_idx(1 << 34), PLAT_NR - 1);
        assert_eq!(plat_val_to_idx(u64::MAX), PLAT_NR - 1);
        assert_eq!(PLAT_NR, 1856);
        // Every value below 2^34 is within 1/128 of its bin's value, and bins grow with values.
        let mut last = 0;
        for v in (1..34u32).flat_map(|s| [(1u64 << s) - 1, 1 << s, (1 << s) + 1, (1 << s) + (1 << s) / 3]).collect::<std::collections::BTreeSet<_>>() {
            let idx = plat_val_to_idx(v);
            assert!(idx >= last, "{v}: bin {idx} after {last}");
            last = idx;
            let b = plat_idx_to_val(idx);
            assert!(b.abs_diff(v) as f64 <= v as f64 / 128.0 + 0.5, "{v} in bin {idx} of value {b}");
        }
    }

    #[test]
    fn names_follow_fio() {
        assert_eq!(log_path("pre", "job", "clat", 3, true), PathBuf::from("pre_clat.3.log"));
        assert_eq!(log_path("", "job", "bw", 1, true), PathBuf::from("job_bw.1.log"));
        assert_eq!(log_path("d/x", "job", "clat_hist", 1, false), PathBuf::from("d/x_clat_hist.log"));
    }

    fn read(p: &std::path::Path) -> Vec<Vec<u64>> {
        std::fs::read_to_string(p)
            .unwrap()
            .lines()
            .map(|l| l.split(", ").map(|f| f.parse().unwrap_or_else(|_| panic!("{l:?}"))).collect())
            .collect()
    }

    #[test]
    fn per_io_and_averaged_lines() {
        let dir = tempfile::tempdir().unwrap();
        let prefix = dir.path().join("p").display().to_string();
        let ms = 1_000_000u64;
        let opts = LogOptions { lat: Some(prefix.clone()), bw: Some(prefix.clone()), iops: Some(prefix.clone()), offset: true, ..LogOptions::default() };
        let mut l = JobLogs::open(&opts, "j", 2, 5 * ms).unwrap();
        l.io(7 * ms, 0, 4096, 8192, 1000, 1_000_000, 1_001_000);
        l.io(9 * ms + 1, 1, 8192, 0, 2000, 2_000_000, 2_002_000);
        l.finish(10 * ms).unwrap();
        assert_eq!(read(&dir.path().join("p_clat.2.log")), [vec![2, 1_000_000, 0, 4096, 8192, 0], vec![4, 2_000_000, 1, 8192, 0, 0]]);
        assert_eq!(read(&dir.path().join("p_slat.2.log"))[1], [4, 2000, 1, 8192, 0, 0]);
        assert_eq!(read(&dir.path().join("p_lat.2.log"))[0], [2, 1_001_000, 0, 4096, 8192, 0]);
        assert_eq!(read(&dir.path().join("p_bw.2.log"))[0], [2, 4096, 0, 4096, 8192, 0], "bytes per ms of clat");
        assert_eq!(read(&dir.path().join("p_iops.2.log"))[1], [4, 1, 1, 8192, 0, 0]);

        // Averaged over 100 ms: 10 reads per ms of 1..=10 us for 250 ms.
        let opts = LogOptions { lat: Some(prefix.clone()), bw: Some(prefix.clone()), avg_msec: 100, max_value: false, ..LogOptions::default() };
        let mut l = JobLogs::open(&opts, "j", 3, 0).unwrap();
        for t in 0..250u64 {
            for i in 1..=10u64 {
                l.io(t * ms + i, 0, 4096, 0, 100, i * 1000, i * 1000 + 100);
            }
            l.tick(t * ms + 11);
        }
        l.finish(250 * ms).unwrap();
        let clat = read(&dir.path().join("p_clat.3.log"));
        // A window closes with the first completion at or after its end (and
        // holds it): 1001 I/O of mean 5495.5 ns, 1000 of 5500, then the
        // partial window at the end, 499 of 5509.0; block size 0.
        assert_eq!(clat, [vec![100, 5496, 0, 0, 0], vec![200, 5500, 0, 0, 0], vec![250, 5509, 0, 0, 0]]);
        let bw = read(&dir.path().join("p_bw.3.log"));
        assert_eq!(bw.len(), 2, "{bw:?}");
        // 10 x 4 KiB per ms: 40 KiB per ms, 40000 KiB/s, give or take a millisecond of the window.
        for line in &bw {
            assert!((39_000..=41_000).contains(&line[1]) && line[2] == 0 && line[3] == 0, "{bw:?}");
        }
    }

    #[test]
    fn histogram_lines_hold_the_window() {
        let dir = tempfile::tempdir().unwrap();
        let prefix = dir.path().join("h").display().to_string();
        let ms = 1_000_000u64;
        for coarseness in [0u32, 2] {
            let opts = LogOptions { hist: Some(prefix.clone()), hist_msec: 50, hist_coarseness: coarseness, ..LogOptions::default() };
            let mut l = JobLogs::open(&opts, "j", 1, 0).unwrap();
            for t in 1..=200u64 {
                l.io(t * ms, 1, 4096, 0, 0, 10_000 + t, 0);
            }
            l.finish(201 * ms).unwrap();
            let lines = read(&dir.path().join("h_clat_hist.1.log"));
            // The first window opens at the first completion (1 ms) and holds it.
            assert_eq!(lines.iter().map(|l| l[0]).collect::<Vec<_>>(), [51, 101, 151]);
            for (line, ios) in lines.iter().zip([51, 50, 50]) {
                assert_eq!(line.len(), 3 + PLAT_NR / (1 << coarseness));
                assert_eq!((line[1], line[2]), (1, 4096));
                assert_eq!(line[3..].iter().sum::<u64>(), ios, "{}: the I/O of one window", line[0]);
            }
        }
    }
}
