//! fio's options: one table shared by the command line and job files.
//!
//! # Command line
//! `rdmablk-bench [--opt=value | --opt value | --flag]... [JOBFILE]...`,
//! as with fio: options before the first `--name` are global; `--name=X`
//! starts a job, and the options after it belong to that job. Both
//! `--opt=value` and `--opt value` work; flags (`--time_based`) take no
//! value on the command line but accept one (`--time_based=0`). Dashes and
//! underscores in option names are the same (`--output-format`,
//! `--ramp_time`).
//!
//! # Job files
//! fio's INI syntax ([`crate::jobfile`]): `[global]` sections set defaults
//! for the jobs that follow them in the file, every other section is a job.
//! Global options given on the command line apply to every job of a job
//! file too, over what the file says.
//!
//! # Resolution order for one job
//! defaults, then job-file `[global]`, then the job's section (or, for
//! command-line jobs, nothing), then command-line globals, then (command-line
//! jobs only) the job's own options.

use std::path::PathBuf;
use std::time::Duration;

use crate::engine::EngineKind;
use crate::fio_log::LogOptions;
use crate::units::{parse_bool, parse_size, parse_time, parse_u64};

/// The longest `ctrl_loss_tmo` (10^9 s, as the `rdmablk` CLI's durations):
/// the bound only keeps deadlines computable.
pub const MAX_CTRL_LOSS_TMO: Duration = Duration::from_secs(1_000_000_000);

/// Parses `ctrl_loss_tmo`: seconds (`30`), or a fio time (`30s`, `500ms`,
/// `2m`); `0` turns reconnection off. nvme-cli's `-1` (reconnect forever)
/// is refused with a message saying so.
pub fn parse_ctrl_loss_tmo(input: &str) -> Result<Duration, String> {
    let s = input.trim();
    if s.starts_with('-') {
        return Err(format!(
            "{input:?} is negative: give the seconds to keep reconnecting to a lost target, or 0 to report the \
             loss (nvme-cli's -1, reconnect forever, is not supported)"
        ));
    }
    let d = parse_time(s)?;
    if d > MAX_CTRL_LOSS_TMO {
        return Err(format!("{input:?} is longer than {} seconds", MAX_CTRL_LOSS_TMO.as_secs()));
    }
    Ok(d)
}

/// fio's `rw=`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RwMode {
    Read,
    Write,
    RandRead,
    RandWrite,
    /// `rw` / `readwrite`: sequential mixed reads and writes.
    ReadWrite,
    RandRw,
}

impl RwMode {
    /// Parses fio's names (`read`, `write`, `randread`, `randwrite`, `rw`,
    /// `readwrite`, `randrw`).
    pub fn parse(s: &str) -> Result<RwMode, String> {
        Ok(match s.trim() {
            "read" => RwMode::Read,
            "write" => RwMode::Write,
            "randread" => RwMode::RandRead,
            "randwrite" => RwMode::RandWrite,
            "rw" | "readwrite" => RwMode::ReadWrite,
            "randrw" => RwMode::RandRw,
            "trim" | "randtrim" | "trimwrite" | "randtrimwrite" => {
                return Err(format!("rw={s} is not supported by rdmablk-bench (no trim workloads)"))
            }
            _ => return Err(format!("invalid rw {s:?}: use read, write, randread, randwrite, rw or randrw")),
        })
    }

    /// fio's name.
    pub fn name(self) -> &'static str {
        match self {
            RwMode::Read => "read",
            RwMode::Write => "write",
            RwMode::RandRead => "randread",
            RwMode::RandWrite => "randwrite",
            RwMode::ReadWrite => "rw",
            RwMode::RandRw => "randrw",
        }
    }

    pub fn is_random(self) -> bool {
        matches!(self, RwMode::RandRead | RwMode::RandWrite | RwMode::RandRw)
    }

    pub fn reads(self) -> bool {
        !matches!(self, RwMode::Write | RwMode::RandWrite)
    }

    pub fn writes(self) -> bool {
        !matches!(self, RwMode::Read | RwMode::RandRead)
    }

    /// Both directions.
    pub fn is_mixed(self) -> bool {
        matches!(self, RwMode::ReadWrite | RwMode::RandRw)
    }
}

/// `verify=`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum VerifyMode {
    None,
    Crc32c,
}

/// Volume backend of the embedded target (`--backend`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Backend {
    File,
    Null,
    Memory,
}

impl Backend {
    pub fn name(self) -> &'static str {
        match self {
            Backend::File => "file",
            Backend::Null => "null",
            Backend::Memory => "memory",
        }
    }
}

/// A size given in bytes or as a percentage of the volume (`size=50%`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum SizeSpec {
    Bytes(u64),
    Percent(f64),
}

impl SizeSpec {
    fn parse(s: &str) -> Result<SizeSpec, String> {
        let t = s.trim();
        if let Some(p) = t.strip_suffix('%') {
            let v: f64 = p.trim().parse().map_err(|_| format!("invalid percentage {s:?}"))?;
            if !(0.0..=100.0).contains(&v) {
                return Err(format!("invalid percentage {s:?}: must be within 0..=100"));
            }
            return Ok(SizeSpec::Percent(v));
        }
        parse_size(t).map(SizeSpec::Bytes)
    }

    /// Bytes of a volume of `volume_size` bytes.
    pub fn resolve(self, volume_size: u64) -> u64 {
        match self {
            SizeSpec::Bytes(b) => b,
            SizeSpec::Percent(p) => (volume_size as f64 * p / 100.0) as u64,
        }
    }
}

/// `--output-format`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OutputFormat {
    Normal,
    Json,
    /// fio's `json+`: JSON with the latency bins (`clat_ns.bins`).
    JsonPlus,
}

impl OutputFormat {
    pub fn is_json(self) -> bool {
        matches!(self, OutputFormat::Json | OutputFormat::JsonPlus)
    }
}

/// `--eta`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EtaMode {
    /// On a terminal with normal output.
    Auto,
    Always,
    Never,
}

/// fio's default `percentile_list`.
pub const DEFAULT_PERCENTILES: [f64; 17] =
    [1.0, 5.0, 10.0, 20.0, 30.0, 40.0, 50.0, 60.0, 70.0, 80.0, 90.0, 95.0, 99.0, 99.5, 99.9, 99.95, 99.99];

/// Everything one job is told.
#[derive(Clone, Debug)]
pub struct JobOptions {
    pub name: String,
    pub description: Option<String>,
    pub rw: RwMode,
    /// Percentage of reads in mixed workloads.
    pub rwmixread: u32,
    /// Block size of reads and of writes.
    pub bs: [u64; 2],
    pub iodepth: u32,
    /// Most I/Os handed to the engine in one submit call (0: as many as are ready).
    pub iodepth_batch_submit: u32,
    /// Fewest completions waited for in one reap call.
    pub iodepth_batch_complete_min: u32,
    /// fio's `iodepth_low`, when given: only its default (refill every free
    /// slot, `iodepth_low=iodepth`) is implemented; [`JobOptions::validate`] says so.
    pub iodepth_low: Option<u32>,
    /// Poll for completions instead of sleeping (fio's `hipri`).
    pub hipri: bool,
    /// Scope each command's data with a memory window (rdmablk's own).
    pub rkey_scoping: bool,
    pub numjobs: u32,
    pub size: Option<SizeSpec>,
    /// Bytes to transfer (default: `size`).
    pub io_size: Option<u64>,
    pub offset: SizeSpec,
    /// Added to `offset` for every clone of `numjobs` (`offset_increment`).
    pub offset_increment: u64,
    pub runtime: Option<Duration>,
    pub time_based: bool,
    pub ramp_time: Duration,
    pub group_reporting: bool,
    pub verify: VerifyMode,
    /// Read back and verify what a write workload wrote (default on).
    pub do_verify: bool,
    /// Do not write: only read and verify.
    pub verify_only: bool,
    /// Stop at the first verify failure.
    pub verify_fatal: bool,
    /// Random offsets without a map: blocks may repeat within a pass.
    pub norandommap: bool,
    pub randseed: u64,
    pub randrepeat: bool,
    pub stonewall: bool,
    pub new_group: bool,
    pub percentiles: Vec<f64>,
    /// Embedded target: the volume's backing file.
    pub filename: Option<String>,
    /// Embedded target: the volume's backend.
    pub backend: Option<Backend>,
    /// A running target's URL.
    pub target: Option<String>,
    /// The volume to open on `target`.
    pub volume: Option<String>,
    /// Host id sent to `target` (default: the machine's host name).
    pub host_id: Option<String>,
    /// Pre-shared key file of the host id: authenticate with `target`.
    pub key_file: Option<String>,
    /// `ioengine`: `rdmablk` (the submission API) or `rdmablk-sync`.
    pub ioengine: EngineKind,
    /// `ctrl_loss_tmo` (nvme-cli's name): how long the job's session keeps
    /// reconnecting to a lost target, its I/O waiting and re-issued after
    /// the reconnection. Zero (the default): the first loss ends the job
    /// with an error.
    pub ctrl_loss_tmo: Duration,
    /// fio's log files (`write_lat_log` and the rest).
    pub logs: LogOptions,
    /// Options as given (key, value), globals included.
    pub given: Vec<(String, String)>,
    /// The job's own options (its section or its command-line options,
    /// without the globals), for `"job options"` in the JSON, as fio.
    pub own: Vec<(String, String)>,
}

impl JobOptions {
    pub fn new(name: &str) -> JobOptions {
        JobOptions {
            name: name.to_owned(),
            description: None,
            rw: RwMode::Read,
            rwmixread: 50,
            bs: [4096, 4096],
            iodepth: 1,
            iodepth_batch_submit: 0,
            iodepth_batch_complete_min: 1,
            iodepth_low: None,
            hipri: false,
            rkey_scoping: true,
            numjobs: 1,
            size: None,
            io_size: None,
            offset: SizeSpec::Bytes(0),
            offset_increment: 0,
            runtime: None,
            time_based: false,
            ramp_time: Duration::ZERO,
            group_reporting: false,
            verify: VerifyMode::None,
            do_verify: true,
            verify_only: false,
            verify_fatal: false,
            norandommap: false,
            randseed: 0x5eed_f10b_ad5e_ed00,
            randrepeat: true,
            stonewall: false,
            new_group: false,
            percentiles: DEFAULT_PERCENTILES.to_vec(),
            filename: None,
            backend: None,
            target: None,
            volume: None,
            host_id: None,
            key_file: None,
            ioengine: EngineKind::Queue,
            ctrl_loss_tmo: Duration::ZERO,
            logs: LogOptions::default(),
            given: Vec::new(),
            own: Vec::new(),
        }
    }

    /// The largest block size of the job.
    pub fn max_bs(&self) -> u64 {
        self.bs[0].max(self.bs[1])
    }

    /// Checks values that only make sense together.
    pub fn validate(&self) -> Result<(), String> {
        let n = &self.name;
        for (dir, bs) in [("read", self.bs[0]), ("write", self.bs[1])] {
            if bs == 0 || bs % 512 != 0 {
                return Err(format!("job {n}: {dir} block size {bs} is not a non-zero multiple of 512"));
            }
            if bs > 1 << 30 {
                return Err(format!("job {n}: {dir} block size {bs} is larger than 1GiB"));
            }
        }
        if self.iodepth == 0 || self.iodepth > 65535 {
            return Err(format!("job {n}: iodepth {} is outside 1..=65535", self.iodepth));
        }
        if let Some(low) = self.iodepth_low.filter(|&l| l != 0 && l < self.iodepth) {
            return Err(format!(
                "job {n}: iodepth_low={low} is not implemented by rdmablk-bench: it refills every free slot at once \
                 (fio's default, iodepth_low=iodepth); leave iodepth_low out"
            ));
        }
        if self.logs.hist_coarseness > 6 {
            return Err(format!("job {n}: log_hist_coarseness {} is outside 0..=6", self.logs.hist_coarseness));
        }
        if self.numjobs == 0 {
            return Err(format!("job {n}: numjobs must be at least 1"));
        }
        if self.rwmixread > 100 {
            return Err(format!("job {n}: rwmixread {} is above 100", self.rwmixread));
        }
        if self.time_based && self.runtime.is_none_or(|r| r.is_zero()) {
            return Err(format!("job {n}: time_based needs a runtime"));
        }
        if self.verify != VerifyMode::None && self.bs[0] != self.bs[1] {
            return Err(format!("job {n}: verify needs the same block size for reads and writes"));
        }
        if self.verify != VerifyMode::None && self.bs[0] < crate::verify::HEADER_LEN as u64 {
            return Err(format!("job {n}: verify needs blocks of at least {} bytes", crate::verify::HEADER_LEN));
        }
        if self.verify_only && self.verify == VerifyMode::None {
            return Err(format!("job {n}: verify_only needs verify=crc32c"));
        }
        if self.target.is_some() && self.volume.is_none() {
            return Err(format!("job {n}: --target needs --volume NAME"));
        }
        if self.target.is_some() && (self.filename.is_some() || self.backend.is_some()) {
            return Err(format!(
                "job {n}: --filename and --backend configure the embedded target; with --target the volume is \
                 served elsewhere (use --volume)"
            ));
        }
        if self.target.is_none() && (self.host_id.is_some() || self.key_file.is_some()) {
            return Err(format!(
                "job {n}: --host-id and --key-file are for --target; the embedded target does not authenticate"
            ));
        }
        if self.backend == Some(Backend::File) && self.filename.is_none() && self.target.is_none() {
            return Err(format!("job {n}: --backend=file needs --filename=PATH"));
        }
        if self.filename.is_some() && matches!(self.backend, Some(Backend::Null | Backend::Memory)) {
            return Err(format!("job {n}: --filename is only for the file backend"));
        }
        Ok(())
    }

    /// The embedded backend this job uses (when there is no `--target`).
    pub fn embedded_backend(&self) -> Backend {
        match (self.backend, &self.filename) {
            (Some(b), _) => b,
            (None, Some(_)) => Backend::File,
            (None, None) => Backend::File,
        }
    }
}

/// Options of the whole run (command line only).
#[derive(Clone, Debug)]
pub struct RunOptions {
    pub output_format: OutputFormat,
    pub output: Option<PathBuf>,
    pub eta: EtaMode,
    /// Reactor threads of the embedded target (default: its own default).
    pub reactors: Option<usize>,
    /// PID of a separately started target, to report its CPU time.
    pub target_pid: Option<u32>,
    /// Print each job's resolved options and exit.
    pub parse_only: bool,
    /// `--plot=PREFIX`: write PREFIX_clat_read.svg / PREFIX_clat_write.svg
    /// (latency histograms) and PREFIX_iops.svg (IOPS over time).
    pub plot: Option<PathBuf>,
}

impl Default for RunOptions {
    fn default() -> Self {
        RunOptions {
            output_format: OutputFormat::Normal,
            output: None,
            eta: EtaMode::Auto,
            reactors: None,
            target_pid: None,
            parse_only: false,
            plot: None,
        }
    }
}

/// What the command line asks for.
#[derive(Debug)]
pub enum Command {
    Run(RunSpec),
    Help,
    Version,
}

/// Resolved jobs and run options.
#[derive(Debug)]
pub struct RunSpec {
    pub run: RunOptions,
    pub jobs: Vec<JobOptions>,
    /// The global options as given (command line before the first
    /// `--name`, then each job file's `[global]` sections), for `"global
    /// options"` in the JSON, as fio.
    pub globals: Vec<(String, String)>,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// Takes no value on the command line (`--time_based`), an optional one elsewhere.
    Flag,
    Value,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Scope {
    Job,
    /// Command line only.
    Run,
    /// fio options that change nothing here, for the values [`Def::check`]
    /// accepts; other values are refused as not implemented.
    Compat,
}

/// What a fio option without effect here accepts: `Ok` or why not.
type Check = fn(Option<&str>) -> Result<(), String>;

struct Def {
    name: &'static str,
    kind: Kind,
    scope: Scope,
    /// For `Compat`: why the option changes nothing (or for which values).
    help: &'static str,
    check: Option<Check>,
}

const fn job(name: &'static str, help: &'static str) -> Def {
    Def { name, kind: Kind::Value, scope: Scope::Job, help, check: None }
}
const fn job_flag(name: &'static str, help: &'static str) -> Def {
    Def { name, kind: Kind::Flag, scope: Scope::Job, help, check: None }
}
const fn run(name: &'static str, help: &'static str) -> Def {
    Def { name, kind: Kind::Value, scope: Scope::Run, help, check: None }
}
const fn run_flag(name: &'static str, help: &'static str) -> Def {
    Def { name, kind: Kind::Flag, scope: Scope::Run, help, check: None }
}
const fn compat(name: &'static str, help: &'static str, check: Check) -> Def {
    Def { name, kind: Kind::Value, scope: Scope::Compat, help, check: Some(check) }
}
const fn compat_flag(name: &'static str, help: &'static str, check: Check) -> Def {
    Def { name, kind: Kind::Flag, scope: Scope::Compat, help, check: Some(check) }
}

/// The refusal of a fio option (or of one of its values) rdmablk-bench does not implement.
fn not_implemented(name: &str, value: Option<&str>, why: &str) -> String {
    let opt = match value {
        Some(v) if !v.is_empty() => format!("{name}={v}"),
        _ => name.to_owned(),
    };
    format!("{opt}: rdmablk-bench does not implement this fio option{}{why}", if why.is_empty() { "" } else { ": " })
}

/// A boolean fio option of which only `want` is what rdmablk-bench does.
fn only_bool(name: &str, value: Option<&str>, want: bool, why: &str) -> Result<(), String> {
    let v = value.map_or(Ok(true), parse_bool).map_err(|e| format!("{name}: {e}"))?;
    if v == want {
        Ok(())
    } else {
        Err(not_implemented(name, value, why))
    }
}

fn any_value(_: Option<&str>) -> Result<(), String> {
    Ok(())
}

const DEFS: &[Def] = &[
    job("name", "start a new job with this name"),
    job("description", "text shown in the report"),
    job("rw", "read|write|randread|randwrite|rw|randrw (default read)"),
    job("readwrite", "same as rw"),
    job("rwmixread", "percentage of reads in rw/randrw (default 50)"),
    job("rwmixwrite", "percentage of writes in rw/randrw"),
    job("bs", "block size, or READ,WRITE (default 4k)"),
    job("blocksize", "same as bs"),
    job("iodepth", "I/Os in flight per job (default 1)"),
    job("iodepth_batch_submit", "most I/Os per submit call (default: all that are ready)"),
    job("iodepth_batch", "same as iodepth_batch_submit"),
    job("iodepth_batch_complete_min", "fewest completions per reap call (default 1)"),
    job("iodepth_batch_complete", "same as iodepth_batch_complete_min"),
    job_flag("hipri", "poll for completions (busy-poll the queue pair) instead of sleeping"),
    job("rkey_scoping", "1: the target reaches only the bytes of each command in flight (memory windows); 0: the whole buffer while registered (default 1)"),
    job("numjobs", "clones of this job, each a thread with its own queue pair (default 1)"),
    job("size", "bytes of the volume this job covers (or N%); embedded file volumes are created at this size"),
    job("io_size", "bytes to transfer (default: size)"),
    job("io_limit", "same as io_size"),
    job("offset", "where the job's region starts (bytes or N%)"),
    job("offset_increment", "added to offset for each numjobs clone"),
    job("runtime", "stop after this long (fio time units: us, ms, s, m, h; default s)"),
    job_flag("time_based", "run for the whole runtime, looping over the region"),
    job("ramp_time", "run this long before counting"),
    job_flag("group_reporting", "report the jobs of a group together"),
    job("verify", "crc32c: written blocks carry a header and a checksum; reads are verified"),
    job("do_verify", "after a write workload, read back and verify (default 1)"),
    job_flag("verify_only", "do not write: read what a write job would have written and verify it"),
    job("verify_fatal", "stop at the first verify failure (default 0)"),
    job_flag("norandommap", "random offsets may repeat within a pass"),
    job("randseed", "seed of the offset and mix generators"),
    job("randrepeat", "same random sequence every run (default 1)"),
    job_flag("stonewall", "wait for the jobs before this one; starts a new group"),
    job_flag("wait_for_previous", "same as stonewall"),
    job_flag("new_group", "start a new reporting group"),
    job("percentile_list", "clat percentiles, colon separated (default fio's 17 points)"),
    job("filename", "embedded target: serve this file (created at --size if missing; holes are written before jobs read it)"),
    job("backend", "embedded target: file|null|memory (default file; null and memory volumes default to 1G)"),
    job(
        "target",
        "URL of a running target (tcp://HOST:PORT), or the URLs of a volume's gateways, comma-separated \
         (tcp://A:4420,tcp://B:4420: tried in order; failing over needs ctrl_loss_tmo > 0); no embedded target",
    ),
    job("volume", "volume to open on --target"),
    job("host_id", "host id sent to --target (default: this machine's host name)"),
    job("key_file", "pre-shared key file of the host id (rdmablk keygen): authenticate with --target"),
    job("ioengine", "rdmablk (submission API, default) or rdmablk-sync (blocking calls); fio's engines mean rdmablk"),
    job("ctrl_loss_tmo", "seconds to keep reconnecting to a lost target, I/O waiting and re-issued after (nvme-cli's option; default 0: report the loss)"),
    run("output_format", "normal|json|json+ (default normal); json+ adds fio's latency bins (clat_ns.bins)"),
    run("output", "write the report to FILE"),
    run("plot", "write SVG pictures of the run: PREFIX_clat_read.svg, PREFIX_clat_write.svg (latency histograms) and PREFIX_iops.svg (IOPS over time)"),
    run("eta", "auto|always|never: the live status line (default auto: on a terminal, normal output)"),
    run("reactors", "embedded target: reactor threads (default: one per CPU)"),
    run("target_pid", "PID of the target process, to report its CPU time and IOPS per target CPU-second"),
    run_flag("parse_only", "print each job's resolved options and exit"),
    run_flag("help", "this help"),
    run_flag("version", "print the version"),
    job("write_lat_log", "write fio's latency logs PREFIX_lat.N.log, PREFIX_clat.N.log, PREFIX_slat.N.log (ns)"),
    job("write_bw_log", "write fio's bandwidth log PREFIX_bw.N.log (KiB/s)"),
    job("write_iops_log", "write fio's IOPS log PREFIX_iops.N.log"),
    job("write_hist_log", "write fio's completion latency histogram log PREFIX_clat_hist.N.log (needs log_hist_msec)"),
    job("log_avg_msec", "average the lat/bw/iops logs over this many ms (default 0: a line per I/O)"),
    job("log_hist_msec", "one histogram log line per this many ms (default 0: none)"),
    job("log_hist_coarseness", "0..6: add up 2^N neighbouring bins in the histogram log (default 0)"),
    job("log_max_value", "1: with log_avg_msec, log each window's largest value instead of its mean"),
    job("log_offset", "1: the logs have an offset column"),
    job("per_job_logs", "0: jobs share one log file per kind, without the .N (default 1)"),
    compat("direct", "1 only: the I/O always goes to the target's volume, no initiator-side cache", |v| {
        only_bool("direct", v, true, "its I/O always goes straight to the target's volume (direct=1)")
    }),
    compat("buffered", "0 only: no initiator-side cache", |v| {
        only_bool("buffered", v, false, "its I/O always goes straight to the target's volume (buffered=0)")
    }),
    compat_flag("thread", "jobs always are threads", any_value),
    compat("invalidate", "no initiator-side page cache to invalidate", any_value),
    compat("gtod_reduce", "0 only: every I/O is timed", |v| {
        only_bool("gtod_reduce", v, false, "it times every I/O (gtod_reduce=0)")
    }),
    compat("clat_percentiles", "1 only: always reported", |v| {
        only_bool("clat_percentiles", v, true, "completion latency percentiles are always reported")
    }),
    compat("lat_percentiles", "total latency percentiles are always reported", any_value),
    compat("slat_percentiles", "submission latency percentiles are always reported", any_value),
    compat("end_fsync", "0 only", |v| only_bool("end_fsync", v, false, "no fsync at the end of a job (end_fsync=0)")),
    compat("fsync_on_close", "0 only", |v| only_bool("fsync_on_close", v, false, "no fsync at the end of a job")),
    compat_flag("create_on_open", "the embedded target opens its files before the jobs start", any_value),
    compat("allow_mounted_write", "1 only: nothing checks whether a block device is mounted", |v| {
        only_bool("allow_mounted_write", v, true, "it does not check whether --filename is a mounted block device")
    }),
    compat("unlink", "0 only: files are kept", |v| only_bool("unlink", v, false, "its files are kept after the run (unlink=0)")),
    compat_flag("refill_buffers", "buffers hold random data; the target neither deduplicates nor compresses", any_value),
    compat("scramble_buffers", "buffers hold random data; the target neither deduplicates nor compresses", any_value),
    compat_flag("zero_buffers", "0 only: buffers hold random data", |v| {
        only_bool("zero_buffers", v, false, "write buffers hold random data")
    }),
    job("iodepth_low", "only iodepth_low=iodepth (the default): every free slot is refilled at once"),
    compat("unified_rw_reporting", "none/0 only: reads and writes are reported apart", |v| match v.map(str::trim) {
        Some("0" | "none") => Ok(()),
        _ => Err(not_implemented("unified_rw_reporting", v, "reads and writes are reported apart (unified_rw_reporting=none)")),
    }),
    compat("kb_base", "1024 only", |v| match v.map(str::trim) {
        Some("1024") => Ok(()),
        _ => Err(not_implemented("kb_base", v, "units are binary (kb_base=1024)")),
    }),
    compat("fadvise_hint", "no initiator-side page cache to advise", any_value),
    compat_flag("fixedbufs", "1 only: buffers are always registered", |v| {
        only_bool("fixedbufs", v, true, "its buffers are always registered (fixedbufs=1)")
    }),
    compat_flag("registerfiles", "no files are opened on the initiator side", any_value),
];

fn canonical(name: &str) -> String {
    name.trim().replace('-', "_")
}

fn lookup(name: &str) -> Option<&'static Def> {
    let c = canonical(name);
    DEFS.iter().find(|d| d.name == c)
}

/// Sets one job option. `value` is `None` for a bare flag.
pub fn set_job_option(o: &mut JobOptions, key: &str, value: Option<&str>) -> Result<(), String> {
    let def = lookup(key).ok_or_else(|| unknown(key))?;
    match def.scope {
        Scope::Run => return Err(format!("option {key:?} is a command-line option, not a job option")),
        Scope::Compat => {
            (def.check.expect("compat options have a check"))(value)?;
            o.given.push((def.name.to_owned(), value.unwrap_or("").to_owned()));
            return Ok(());
        }
        Scope::Job => {}
    }
    let bad = |e: String| format!("{}: {e}", def.name);
    let need = || value.ok_or_else(|| format!("option {:?} needs a value", def.name));
    let flag = || value.map_or(Ok(true), parse_bool).map_err(bad);
    match def.name {
        "name" => o.name = need()?.to_owned(),
        "description" => o.description = Some(need()?.to_owned()),
        "rw" | "readwrite" => {
            // fio allows a suffix (rw=randread:8); only the mode matters here.
            let v = need()?;
            o.rw = RwMode::parse(v.split(':').next().unwrap_or(v)).map_err(bad)?;
        }
        "rwmixread" => o.rwmixread = parse_u64(need()?).map_err(bad)?.min(101) as u32,
        "rwmixwrite" => o.rwmixread = 100u32.saturating_sub(parse_u64(need()?).map_err(bad)?.min(100) as u32),
        "bs" | "blocksize" => {
            let v = need()?;
            let mut parts = v.split(',');
            let r = parse_size(parts.next().unwrap_or("")).map_err(bad)?;
            let w = match parts.next() {
                Some(p) if !p.trim().is_empty() => parse_size(p).map_err(bad)?,
                _ => r,
            };
            o.bs = [r, w];
        }
        "iodepth" => o.iodepth = u32::try_from(parse_u64(need()?).map_err(bad)?).unwrap_or(u32::MAX),
        "iodepth_batch_submit" | "iodepth_batch" => {
            o.iodepth_batch_submit = u32::try_from(parse_u64(need()?).map_err(bad)?).unwrap_or(u32::MAX)
        }
        "iodepth_batch_complete_min" | "iodepth_batch_complete" => {
            o.iodepth_batch_complete_min = u32::try_from(parse_u64(need()?).map_err(bad)?).unwrap_or(u32::MAX).max(1)
        }
        "numjobs" => o.numjobs = u32::try_from(parse_u64(need()?).map_err(bad)?).unwrap_or(u32::MAX),
        "size" => o.size = Some(SizeSpec::parse(need()?).map_err(bad)?),
        "io_size" | "io_limit" => o.io_size = Some(parse_size(need()?).map_err(bad)?),
        "offset" => o.offset = SizeSpec::parse(need()?).map_err(bad)?,
        "offset_increment" => o.offset_increment = parse_size(need()?).map_err(bad)?,
        "runtime" => o.runtime = Some(parse_time(need()?).map_err(bad)?),
        "time_based" => o.time_based = flag()?,
        "hipri" => o.hipri = flag()?,
        "rkey_scoping" => o.rkey_scoping = flag()?,
        "ramp_time" => o.ramp_time = parse_time(need()?).map_err(bad)?,
        "group_reporting" => o.group_reporting = flag()?,
        "verify" => {
            o.verify = match need()?.trim() {
                "crc32c" | "crc32c-intel" => VerifyMode::Crc32c,
                "0" | "none" | "null" => VerifyMode::None,
                other => return Err(format!("verify: {other:?} is not supported (use crc32c)")),
            }
        }
        "do_verify" => o.do_verify = flag()?,
        "verify_only" => o.verify_only = flag()?,
        "verify_fatal" => o.verify_fatal = flag()?,
        "norandommap" => o.norandommap = flag()?,
        "randseed" => o.randseed = parse_u64(need()?).map_err(bad)?,
        "randrepeat" => o.randrepeat = flag()?,
        "stonewall" | "wait_for_previous" => o.stonewall = flag()?,
        "new_group" => o.new_group = flag()?,
        "percentile_list" => {
            let mut v = Vec::new();
            for p in need()?.split(':').filter(|p| !p.trim().is_empty()) {
                let x: f64 = p.trim().parse().map_err(|_| bad(format!("invalid percentile {p:?}")))?;
                if !(0.0..=100.0).contains(&x) {
                    return Err(bad(format!("percentile {x} is outside 0..=100")));
                }
                v.push(x);
            }
            if v.is_empty() {
                return Err(bad("needs at least one percentile".into()));
            }
            o.percentiles = v;
        }
        "filename" => o.filename = Some(need()?.to_owned()),
        "backend" => {
            o.backend = Some(match need()?.trim() {
                "file" => Backend::File,
                "null" => Backend::Null,
                "memory" | "mem" => Backend::Memory,
                other => return Err(format!("backend: {other:?} is not one of file, null, memory")),
            })
        }
        "target" => {
            // One URL, or a volume's gateways (tried in order, failed over): checked here, so that a bad list is named.
            let v = need()?;
            rdmablk_initiator::Targets::parse(v).map_err(|e| bad(e.one_line()))?;
            o.target = Some(v.to_owned());
        }
        "volume" => o.volume = Some(need()?.to_owned()),
        "host_id" => o.host_id = Some(need()?.to_owned()),
        "key_file" => o.key_file = Some(need()?.to_owned()),
        "ioengine" => o.ioengine = EngineKind::from_ioengine(Some(need()?.trim())),
        "ctrl_loss_tmo" => o.ctrl_loss_tmo = parse_ctrl_loss_tmo(need()?).map_err(bad)?,
        "iodepth_low" => o.iodepth_low = Some(u32::try_from(parse_u64(need()?).map_err(bad)?).unwrap_or(u32::MAX)),
        // fio: without a value, the prefix is the job's name.
        "write_lat_log" => o.logs.lat = Some(value.unwrap_or("").trim().to_owned()),
        "write_bw_log" => o.logs.bw = Some(value.unwrap_or("").trim().to_owned()),
        "write_iops_log" => o.logs.iops = Some(value.unwrap_or("").trim().to_owned()),
        "write_hist_log" => o.logs.hist = Some(value.unwrap_or("").trim().to_owned()),
        "log_avg_msec" => o.logs.avg_msec = parse_u64(need()?).map_err(bad)?,
        "log_hist_msec" => o.logs.hist_msec = parse_u64(need()?).map_err(bad)?,
        "log_hist_coarseness" => {
            o.logs.hist_coarseness = u32::try_from(parse_u64(need()?).map_err(bad)?).unwrap_or(u32::MAX)
        }
        "log_max_value" => o.logs.max_value = flag()?,
        "log_offset" => o.logs.offset = flag()?,
        "per_job_logs" => o.logs.per_job = flag()?,
        other => unreachable!("job option {other} without a setter"),
    }
    if def.name != "name" {
        o.given.push((def.name.to_owned(), value.unwrap_or("").to_owned()));
    }
    Ok(())
}

fn set_run_option(r: &mut RunOptions, name: &str, value: Option<&str>) -> Result<(), String> {
    let need = || value.ok_or_else(|| format!("option --{name} needs a value"));
    match name {
        "output_format" => {
            r.output_format = match need()?.trim() {
                "normal" => OutputFormat::Normal,
                "json" => OutputFormat::Json,
                "json+" => OutputFormat::JsonPlus,
                other => return Err(format!(
                    "--output-format: {other:?} is not implemented by rdmablk-bench: use normal, json or json+"
                )),
            }
        }
        "output" => r.output = Some(PathBuf::from(need()?)),
        "plot" => r.plot = Some(PathBuf::from(need()?)),
        "eta" => {
            r.eta = match need()?.trim() {
                "auto" => EtaMode::Auto,
                "always" => EtaMode::Always,
                "never" => EtaMode::Never,
                other => return Err(format!("--eta: {other:?} is not auto, always or never")),
            }
        }
        "reactors" => {
            let n = parse_u64(need()?)?;
            if n == 0 || n > 1024 {
                return Err(format!("--reactors: {n} is outside 1..=1024"));
            }
            r.reactors = Some(n as usize);
        }
        "target_pid" => {
            r.target_pid = Some(need()?.trim().parse().map_err(|_| format!("--target_pid: {:?} is not a PID", value))?)
        }
        "parse_only" => r.parse_only = value.map_or(Ok(true), parse_bool)?,
        _ => unreachable!("run option {name} without a setter"),
    }
    Ok(())
}

/// Parses the command line (without the program name) and reads the job files.
pub fn parse_args(args: &[String]) -> Result<Command, String> {
    let mut run = RunOptions::default();
    let mut globals: Vec<(String, Option<String>)> = Vec::new();
    let mut jobs: Vec<Vec<(String, Option<String>)>> = Vec::new();
    let mut files: Vec<PathBuf> = Vec::new();
    let mut i = 0;
    while i < args.len() {
        let arg = &args[i];
        i += 1;
        if arg == "-h" {
            return Ok(Command::Help);
        }
        let Some(body) = arg.strip_prefix("--") else {
            if arg.starts_with('-') && arg.len() > 1 {
                return Err(format!("unknown option {arg:?} (options are --name=value; see --help)"));
            }
            files.push(PathBuf::from(arg));
            continue;
        };
        let (key, inline) = match body.split_once('=') {
            Some((k, v)) => (k, Some(v.to_owned())),
            None => (body, None),
        };
        let def = lookup(key).ok_or_else(|| unknown(&format!("--{key}")))?;
        let value = match (def.kind, inline) {
            (_, Some(v)) => Some(v),
            (Kind::Flag, None) => None,
            (Kind::Value, None) => {
                let v = args.get(i).ok_or_else(|| format!("option --{key} needs a value"))?;
                i += 1;
                Some(v.clone())
            }
        };
        match (def.scope, def.name) {
            (Scope::Run, "help") => return Ok(Command::Help),
            (Scope::Run, "version") => return Ok(Command::Version),
            (Scope::Run, name) => set_run_option(&mut run, name, value.as_deref())?,
            (_, "name") => jobs.push(vec![("name".to_owned(), value)]),
            (_, name) => match jobs.last_mut() {
                Some(j) => j.push((name.to_owned(), value)),
                None => globals.push((name.to_owned(), value)),
            },
        }
    }

    let apply = |o: &mut JobOptions, list: &[(String, Option<String>)]| -> Result<(), String> {
        for (k, v) in list {
            set_job_option(o, k, v.as_deref())?;
        }
        Ok(())
    };

    let mut given_globals: Vec<(String, String)> = Vec::new();
    let mut add_globals = |list: &[(String, Option<String>)]| {
        for (k, v) in list {
            let key = lookup(k).map_or_else(|| canonical(k), |d| d.name.to_owned());
            given_globals.push((key, v.clone().unwrap_or_default()));
        }
    };
    add_globals(&globals);
    let mut out = Vec::new();
    for path in &files {
        let text = std::fs::read_to_string(path).map_err(|e| format!("{}: cannot read job file: {e}", path.display()))?;
        let sections = crate::jobfile::parse(&text).map_err(|e| format!("{}: {e}", path.display()))?;
        let mut file_global: Vec<(String, Option<String>)> = Vec::new();
        for s in sections {
            if s.name == "global" {
                let entries: Vec<_> = s.entries.iter().map(|e| (e.key.clone(), e.value.clone())).collect();
                add_globals(&entries);
                file_global.extend(entries);
                continue;
            }
            let mut o = JobOptions::new(&s.name);
            let ctx = |e: String| format!("{}: [{}]: {e}", path.display(), s.name);
            apply(&mut o, &file_global).map_err(ctx)?;
            let mark = o.given.len();
            for e in &s.entries {
                set_job_option(&mut o, &e.key, e.value.as_deref())
                    .map_err(|err| format!("{}: line {}: {err}", path.display(), e.line))?;
            }
            o.own = o.given[mark..].to_vec();
            o.name = s.name.clone();
            apply(&mut o, &globals).map_err(ctx)?;
            out.push(o);
        }
    }
    for list in &jobs {
        let mut o = JobOptions::new("job");
        apply(&mut o, &globals)?;
        let mark = o.given.len();
        apply(&mut o, list)?;
        o.own = o.given[mark..].to_vec();
        out.push(o);
    }
    if out.is_empty() {
        if files.is_empty() && globals.is_empty() {
            return Ok(Command::Help);
        }
        // fio wants --name; a lone set of options is one job.
        let mut o = JobOptions::new("job");
        apply(&mut o, &globals)?;
        out.push(o);
    }
    for o in &out {
        o.validate()?;
    }
    Ok(Command::Run(RunSpec { run, jobs: out, globals: given_globals }))
}

/// An option rdmablk-bench does not know: fio's or not, it is refused.
fn unknown(opt: &str) -> String {
    format!("unknown option {opt}: rdmablk-bench does not implement it (--help lists the fio options it takes)")
}

/// The `--help` text.
pub fn help() -> String {
    let mut s = String::from(
        "rdmablk-bench: a fio-style benchmark for rdmablk targets\n\n\
         usage: rdmablk-bench [--opt=value | --opt value]... [JOBFILE]...\n\n\
         Options before the first --name are global; --name starts a job. JOBFILE is a fio job file\n\
         ([global] plus one section per job). Without --target an embedded target is started on\n\
         loopback, serving --filename=PATH (created at --size) or --backend=null|memory.\n\n\
         job options:\n",
    );
    let section = |scope: Scope, s: &mut String| {
        for d in DEFS.iter().filter(|d| d.scope == scope) {
            let v = if d.kind == Kind::Value { "=VALUE" } else { "" };
            let left = format!("  --{}{v}", d.name);
            s.push_str(&format!("{left:<36} {}\n", d.help));
        }
    };
    section(Scope::Job, &mut s);
    s.push_str("\nrun options (command line only):\n");
    section(Scope::Run, &mut s);
    s.push_str("\nfio options that change nothing here (other values are refused):\n");
    for d in DEFS.iter().filter(|d| d.scope == Scope::Compat) {
        s.push_str(&format!("  {:<34} {}\n", d.name, d.help));
    }
    s.push_str(
        "\nAny other fio option is refused: rdmablk-bench does not implement it.\n\
         Log files are fio's (time in ms, value, ddir, bs[, offset], prio); N is the job's number from 1.",
    );
    s.push_str(
        "\n\nexample (the main job):\n  rdmablk-bench --name=main --filename=/var/tmp/rdmablk.img --size=1G --rw=randread \\\n    \
         --bs=4k --iodepth=32 --runtime=10s --time_based\n",
    );
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(s: &[&str]) -> Vec<String> {
        s.iter().map(|x| x.to_string()).collect()
    }

    fn jobs(s: &[&str]) -> Vec<JobOptions> {
        match parse_args(&args(s)).unwrap() {
            Command::Run(r) => r.jobs,
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn both_value_syntaxes_and_flags() {
        let j = jobs(&[
            "--name=a", "--rw", "randread", "--bs=4k", "--iodepth", "32", "--time_based", "--runtime", "5s",
            "--backend=null", "--size=1G",
        ]);
        assert_eq!(j.len(), 1);
        let a = &j[0];
        assert_eq!(a.name, "a");
        assert_eq!(a.rw, RwMode::RandRead);
        assert_eq!(a.bs, [4096, 4096]);
        assert_eq!(a.iodepth, 32);
        assert!(a.time_based);
        assert_eq!(a.runtime, Some(Duration::from_secs(5)));
        assert_eq!(a.size, Some(SizeSpec::Bytes(1 << 30)));
        assert!(!a.hipri && a.rkey_scoping, "defaults: sleep, scoped");
        let j = jobs(&["--name=a", "--hipri", "--rkey_scoping=0", "--backend=null", "--size=1M"]);
        assert!(j[0].hipri && !j[0].rkey_scoping);
    }

    #[test]
    fn globals_before_name_apply_to_every_job() {
        let j = jobs(&["--bs=8k", "--backend=null", "--size=1M", "--name=a", "--name=b", "--bs=16k", "--rw=write"]);
        assert_eq!(j.len(), 2);
        assert_eq!(j[0].bs[0], 8192);
        assert_eq!(j[1].bs[0], 16384);
        assert_eq!(j[1].rw, RwMode::Write);
    }

    #[test]
    fn run_options_and_dashes() {
        let Command::Run(r) =
            parse_args(&args(&["--output-format=json", "--output", "/x", "--name=a", "--ramp-time=1", "--backend=null", "--size=1M"]))
                .unwrap()
        else {
            panic!()
        };
        assert_eq!(r.run.output_format, OutputFormat::Json);
        assert_eq!(r.run.output, Some(PathBuf::from("/x")));
        assert_eq!(r.jobs[0].ramp_time, Duration::from_secs(1));
    }

    #[test]
    fn errors_name_the_option() {
        let e = parse_args(&args(&["--name=a", "--bogus=1"])).unwrap_err();
        assert!(e.contains("--bogus"), "{e}");
        let e = parse_args(&args(&["--name=a", "--rw=sideways"])).unwrap_err();
        assert!(e.contains("sideways"), "{e}");
        let e = parse_args(&args(&["--name=a", "--iodepth"])).unwrap_err();
        assert!(e.contains("needs a value"), "{e}");
        let e = parse_args(&args(&["--name=a", "--time_based", "--backend=null"])).unwrap_err();
        assert!(e.contains("runtime"), "{e}");
        let e = parse_args(&args(&["--name=a", "--verify=md5"])).unwrap_err();
        assert!(e.contains("md5"), "{e}");
    }

    #[test]
    fn target_takes_a_url_or_a_list_of_gateways() {
        let j = jobs(&["--name=a", "--target=tcp://h:1", "--volume=v"]);
        assert_eq!(j[0].target.as_deref(), Some("tcp://h:1"));
        let j = jobs(&["--name=a", "--target=tcp://h:1,tcp://g:2", "--volume=v"]);
        assert_eq!(j[0].target.as_deref(), Some("tcp://h:1,tcp://g:2"));
        let e = parse_args(&args(&["--name=a", "--target=tcp://h:1,,tcp://g:2", "--volume=v"])).unwrap_err();
        assert!(e.starts_with("target: ") && e.contains("gateway 2 of 3 is empty"), "{e}");
        let e = parse_args(&args(&["--name=a", "--target=tcp://h:1,junk", "--volume=v"])).unwrap_err();
        assert!(e.contains("gateway 2 of 2: \"junk\": expected scheme://host:port"), "{e}");
        assert!(help().contains("tcp://A:4420,tcp://B:4420"));
    }

    #[test]
    fn mixes_and_split_block_sizes() {
        let j = jobs(&["--name=a", "--rw=randrw", "--rwmixwrite=30", "--bs=4k,64k", "--backend=null", "--size=1M"]);
        assert_eq!(j[0].rwmixread, 70);
        assert_eq!(j[0].bs, [4096, 65536]);
        assert_eq!(j[0].max_bs(), 65536);
    }

    #[test]
    fn ctrl_loss_tmo_takes_seconds_or_a_time_and_defaults_to_zero() {
        let j = jobs(&["--name=a", "--backend=null", "--size=1M"]);
        assert_eq!(j[0].ctrl_loss_tmo, Duration::ZERO, "default: report the loss");
        let j = jobs(&["--ctrl_loss_tmo=30", "--name=a", "--backend=null", "--size=1M", "--name=b"]);
        assert_eq!(j[0].ctrl_loss_tmo, Duration::from_secs(30), "a global applies to every job");
        assert_eq!(j[1].ctrl_loss_tmo, Duration::from_secs(30));
        assert!(j[0].given.iter().any(|(k, v)| k == "ctrl_loss_tmo" && v == "30"), "{:?}", j[0].given);
        let j = jobs(&["--name=a", "--ctrl-loss-tmo", "500ms", "--backend=null", "--size=1M"]);
        assert_eq!(j[0].ctrl_loss_tmo, Duration::from_millis(500));
        let j = jobs(&["--name=a", "--ctrl_loss_tmo=2m", "--backend=null", "--size=1M", "--name=b", "--ctrl_loss_tmo=0"]);
        assert_eq!(j[0].ctrl_loss_tmo, Duration::from_secs(120));
        assert_eq!(j[1].ctrl_loss_tmo, Duration::ZERO);
    }

    #[test]
    fn bad_ctrl_loss_tmo_values_are_named() {
        let err = |v: &str| parse_args(&args(&["--name=a", "--backend=null", "--size=1M", v])).unwrap_err();
        let e = err("--ctrl_loss_tmo=-1");
        assert!(e.starts_with("ctrl_loss_tmo: ") && e.contains("\"-1\" is negative") && e.contains("forever"), "{e}");
        let e = parse_args(&args(&["--name=a", "--ctrl_loss_tmo", "-1"])).unwrap_err();
        assert!(e.contains("negative"), "the value after a space is the value, not an option: {e}");
        let e = err("--ctrl_loss_tmo=soon");
        assert!(e.starts_with("ctrl_loss_tmo: invalid time \"soon\""), "{e}");
        let e = err("--ctrl_loss_tmo=30parsecs");
        assert!(e.contains("unknown unit"), "{e}");
        let e = err("--ctrl_loss_tmo=1.5");
        assert!(e.starts_with("ctrl_loss_tmo: "), "{e}");
        let e = err("--ctrl_loss_tmo=99999999999");
        assert!(e.contains("longer than 1000000000 seconds"), "{e}");
        let e = err("--ctrl_loss_tmo=");
        assert!(e.starts_with("ctrl_loss_tmo: "), "{e}");
        let e = parse_args(&args(&["--name=a", "--ctrl_loss_tmo"])).unwrap_err();
        assert!(e.contains("needs a value"), "{e}");
        assert_eq!(parse_ctrl_loss_tmo("1000000000"), Ok(MAX_CTRL_LOSS_TMO));
    }

    #[test]
    fn ctrl_loss_tmo_in_a_job_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("jobs.fio");
        std::fs::write(
            &path,
            "[global]\nbackend=null\nsize=1M\nctrl_loss_tmo=45\n[a]\n[b]\nctrl_loss_tmo=0\n[c]\nctrl_loss_tmo=-1\n",
        )
        .unwrap();
        let file = path.to_str().unwrap();
        let e = parse_args(&args(&[file])).unwrap_err();
        assert!(e.contains("line 9") && e.contains("ctrl_loss_tmo") && e.contains("negative"), "{e}");
        let text = std::fs::read_to_string(&path).unwrap().replace("[c]\nctrl_loss_tmo=-1\n", "");
        std::fs::write(&path, text).unwrap();
        let j = jobs(&[file]);
        assert_eq!(j.len(), 2);
        assert_eq!(j[0].ctrl_loss_tmo, Duration::from_secs(45), "from [global]");
        assert_eq!(j[1].ctrl_loss_tmo, Duration::ZERO, "the job's section overrides [global]");
        // A command-line global applies over the file.
        let j = jobs(&["--ctrl_loss_tmo=7", file]);
        assert!(j.iter().all(|j| j.ctrl_loss_tmo == Duration::from_secs(7)), "{j:?}");
    }

    #[test]
    fn help_documents_ctrl_loss_tmo() {
        let h = help();
        let line = h.lines().find(|l| l.trim_start().starts_with("--ctrl_loss_tmo=VALUE")).expect("in --help");
        assert!(line.contains("default 0"), "{line}");
    }

    #[test]
    fn fio_options_without_effect_are_accepted() {
        let j = jobs(&["--name=a", "--ioengine=libaio", "--direct=1", "--thread", "--backend=null", "--size=1M"]);
        assert_eq!(j.len(), 1);
        assert!(j[0].given.iter().any(|(k, v)| k == "ioengine" && v == "libaio"));
    }

    #[test]
    fn fio_options_not_implemented_are_refused_by_name() {
        let err = |a: &[&str]| {
            let mut v = vec!["--name=a", "--backend=null", "--size=1M"];
            v.extend(a);
            parse_args(&args(&v)).unwrap_err()
        };
        for (opt, named) in [
            ("--direct=0", "direct=0"),
            ("--buffered=1", "buffered=1"),
            ("--gtod_reduce=1", "gtod_reduce=1"),
            ("--end_fsync=1", "end_fsync=1"),
            ("--unlink=1", "unlink=1"),
            ("--zero_buffers", "zero_buffers"),
            ("--kb_base=1000", "kb_base=1000"),
            ("--unified_rw_reporting=mixed", "unified_rw_reporting=mixed"),
            ("--clat_percentiles=0", "clat_percentiles=0"),
        ] {
            let e = err(&[opt]);
            assert!(e.starts_with(&format!("{named}: rdmablk-bench does not implement this fio option: ")), "{opt}: {e}");
        }
        for opt in ["--exitall", "--cpus_allowed=0-3", "--sqthread_poll=1", "--log_prio=1", "--rate=10m"] {
            let e = err(&[opt]);
            let name = opt.split('=').next().unwrap();
            assert!(e.starts_with(&format!("unknown option {name}: rdmablk-bench does not implement it")), "{opt}: {e}");
        }
        let e = err(&["--iodepth=8", "--iodepth_low=2"]);
        assert!(e.contains("iodepth_low=2 is not implemented by rdmablk-bench"), "{e}");
        let e = parse_args(&args(&["--name=a", "--backend=null", "--output-format=terse"])).unwrap_err();
        assert!(e.contains("\"terse\" is not implemented by rdmablk-bench"), "{e}");
        // The values that are what the bench does pass.
        let j = jobs(&["--name=a", "--backend=null", "--size=1M", "--buffered=0", "--gtod_reduce=0", "--kb_base=1024", "--iodepth=8", "--iodepth_low=8", "--fixedbufs", "--lat_percentiles=1"]);
        assert_eq!(j[0].iodepth_low, Some(8));
        // In a job file the line is named.
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("j.fio");
        std::fs::write(&path, "[a]\nbackend=null\nsize=1M\ndirect=0\n").unwrap();
        let e = parse_args(&args(&[path.to_str().unwrap()])).unwrap_err();
        assert!(e.contains("line 4: direct=0: rdmablk-bench does not implement this fio option"), "{e}");
        let h = help();
        assert!(h.contains("Any other fio option is refused"), "{h}");
    }

    #[test]
    fn log_options_and_json_plus() {
        let Command::Run(r) = parse_args(&args(&[
            "--output-format=json+", "--write_lat_log=x", "--name=a", "--backend=null", "--size=1M", "--log_avg_msec=250",
            "--write_hist_log=h", "--log_hist_msec=100", "--log_hist_coarseness=3", "--log_offset=1", "--log_max_value=1",
            "--per_job_logs=0", "--write_bw_log=b", "--write_iops_log=i",
        ]))
        .unwrap() else {
            panic!()
        };
        assert_eq!(r.run.output_format, OutputFormat::JsonPlus);
        let l = &r.jobs[0].logs;
        assert_eq!((l.lat.as_deref(), l.bw.as_deref(), l.iops.as_deref(), l.hist.as_deref()), (Some("x"), Some("b"), Some("i"), Some("h")));
        assert_eq!((l.avg_msec, l.hist_msec, l.hist_coarseness, l.offset, l.max_value, l.per_job), (250, 100, 3, true, true, false));
        // Globals and the job's own options apart, as fio's JSON has them.
        assert_eq!(r.globals, [("write_lat_log".to_owned(), "x".to_owned())]);
        assert!(r.jobs[0].own.iter().all(|(k, _)| k != "write_lat_log"), "{:?}", r.jobs[0].own);
        assert!(r.jobs[0].own.iter().any(|(k, v)| k == "log_avg_msec" && v == "250"));
        let e = parse_args(&args(&["--name=a", "--backend=null", "--log_hist_coarseness=7"])).unwrap_err();
        assert!(e.contains("log_hist_coarseness 7 is outside 0..=6"), "{e}");
        // A bare write_lat_log in a job file: the job's name is the prefix.
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("j.fio");
        std::fs::write(&path, "[global]\nbackend=null\nsize=1M\n[a]\nwrite_lat_log\n").unwrap();
        let Command::Run(r) = parse_args(&args(&[path.to_str().unwrap(), "--runtime=1"])).unwrap() else { panic!() };
        assert_eq!(r.jobs[0].logs.lat.as_deref(), Some(""));
        let g: Vec<&str> = r.globals.iter().map(|(k, _)| k.as_str()).collect();
        assert_eq!(g, ["runtime", "backend", "size"], "command-line globals first, as fio");
        assert_eq!(r.jobs[0].own, [("write_lat_log".to_owned(), String::new())]);
    }
}
