//! rdmablk-bench: a fio-style benchmark for rdmablk targets.
//!
//! It takes fio's options and job files, runs each job as a thread with its
//! own queue pair on the initiator's completion-based submission API with
//! registered buffers (zero copy), and reports the way fio does, in text or
//! in fio's JSON. Without `--target` it starts an embedded target on
//! loopback.
//!
//! The binary is a thin wrapper over [`main_with_args`].
//!
//! # A lost target
//! Each job has its own session. `ctrl_loss_tmo` (nvme-cli's name, default
//! 0) is how long it keeps reconnecting to a lost target: meanwhile its I/O
//! waits, and the library re-issues what had not completed once it has
//! reconnected (see [`job`] for what verify checks then). With 0, or once
//! the time is up, the I/O in flight fails and the job stops with an error
//! that says the target was lost. The JSON counts the reconnections,
//! `"reconnects"`, in each job's `rdmablk` object and in total in the
//! top-level `rdmablk` object; the text report prints them when non-zero.
//!
//! Modules:
//! - [`options`]: the option table, the command line; [`jobfile`]: fio's INI job files.
//! - [`engine`]: the slot-based engine trait and its two engines (submission API, blocking calls).
//! - [`job`]: a job's phases and its submit/reap loop.
//! - [`verify`]: block headers and CRC32C.
//! - [`stats`]: HDR histograms and exact moments, merged for group reporting.
//! - [`report`]: fio's text report and JSON (json+ with fio's latency bins).
//! - [`fio_log`]: fio's log files (`write_lat_log` and the rest) and latency bins.
//! - [`file_layout`]: files that jobs read are laid out first (no holes).
//! - [`progress`]: the live status line.
//! - [`embedded`]: the in-process target.
//! - [`cpu`]: CPU time of jobs and of the target.
//! - [`units`]: fio's number syntax and formatting.

pub mod cpu;
pub mod embedded;
pub mod engine;
pub mod file_layout;
pub mod fio_log;
pub mod job;
pub mod jobfile;
pub mod options;
pub mod plot;
pub mod progress;
pub mod report;
pub mod run_plot;
pub mod stats;
pub mod units;
pub mod verify;

use std::io::{IsTerminal, Write};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Barrier};
use std::time::{Instant, SystemTime};

use crate::cpu::CpuUsage;
use crate::job::{JobPlan, JobProgress, ECONNREFUSED};
use crate::options::{Command, EtaMode, OutputFormat, RunSpec};
use crate::report::{Entry, Group, Report};
use crate::stats::JobStats;

/// Set by SIGINT: jobs stop issuing, finish what is in flight, and the
/// report is printed.
static STOP: AtomicBool = AtomicBool::new(false);

extern "C" fn on_sigint(_: libc::c_int) {
    STOP.store(true, Ordering::Relaxed);
}

fn catch_sigint() {
    // SAFETY: the handler only stores to an atomic, which is
    // async-signal-safe; `signal` itself has no memory-safety preconditions.
    // SA_RESETHAND semantics are not needed: a second SIGINT just sets the
    // flag again, and the jobs stop within one I/O anyway.
    unsafe {
        libc::signal(libc::SIGINT, on_sigint as *const () as libc::sighandler_t);
    }
}

/// Runs the command line (without the program name); returns the exit code:
/// 0 when every job ran without error, 1 otherwise (bad options, I/O or
/// verify errors).
pub fn main_with_args(args: &[String]) -> i32 {
    match options::parse_args(args) {
        Err(e) => {
            eprintln!("rdmablk-bench: {e}");
            1
        }
        Ok(Command::Help) => {
            print!("{}", options::help());
            0
        }
        Ok(Command::Version) => {
            println!("{}", report::version());
            0
        }
        Ok(Command::Run(spec)) => match run(spec) {
            Ok(code) => code,
            Err(e) => {
                eprintln!("rdmablk-bench: {e}");
                1
            }
        },
    }
}

/// Runs the jobs and writes the report; returns the exit code.
pub fn run(spec: RunSpec) -> Result<i32, String> {
    let RunSpec { run: ropts, jobs, globals } = spec;

    // Where each job runs.
    let layout = embedded::layout(&jobs)?;
    let shape = embedded::TargetShape {
        reactors: ropts.reactors,
        max_iodepth: jobs.iter().map(|j| j.iodepth).max().unwrap_or(1),
        max_bs: jobs.iter().map(|j| j.max_bs()).max().unwrap_or(4096),
    };
    if ropts.parse_only {
        for (i, j) in jobs.iter().enumerate() {
            println!("{j:#?}");
            if let Some(Some(v)) = layout.job_volume.get(i) {
                println!("embedded volume: {}", embedded::describe(&layout.volumes[*v]));
            }
        }
        if !layout.volumes.is_empty() {
            print!("{}", embedded::config_text(&layout.volumes, shape));
        }
        return Ok(0);
    }

    let mut out: Box<dyn Write> = match &ropts.output {
        Some(p) => Box::new(std::fs::File::create(p).map_err(|e| format!("{}: {e}", p.display()))?),
        None => Box::new(std::io::stdout()),
    };

    // Files that jobs read get no holes: reads of holes would measure memory.
    file_layout::prepare(&layout, &jobs)?;
    let target = if layout.volumes.is_empty() { None } else { Some(embedded::start(&layout.volumes, shape)?) };
    let mut target_lines = Vec::new();
    if let Some(t) = &target {
        target_lines.push(format!("embedded target: {}", t.url()));
        target_lines.extend(layout.volumes.iter().map(|v| format!("  {}", embedded::describe(v))));
    }

    // Expand numjobs into plans, with reporting groups and run batches
    // (stonewall starts a batch that waits for the jobs before it).
    let mut plans: Vec<(JobPlan, usize)> = Vec::new();
    let mut groupid = 0usize;
    let mut batch = 0usize;
    for (i, o) in jobs.iter().enumerate() {
        if i > 0 && (o.stonewall || o.new_group) {
            groupid += 1;
        }
        if i > 0 && o.stonewall {
            batch += 1;
        }
        let (url, volume) = match (&o.target, layout.job_volume[i]) {
            (Some(url), _) => (url.clone(), o.volume.clone().unwrap_or_default()),
            (None, Some(v)) => (
                target.as_ref().map(|t| t.url().to_string()).unwrap_or_default(),
                layout.volumes[v].name.clone(),
            ),
            (None, None) => return Err(format!("job {}: no target", o.name)),
        };
        if o.target.is_some() && !target_lines.iter().any(|l| l.contains(url.as_str())) {
            target_lines.push(format!("target: {url}"));
        }
        for clone in 0..o.numjobs {
            let index = plans.len();
            plans.push((
                JobPlan { opts: o.clone(), index, clone, groupid, url: url.clone(), volume: volume.clone() },
                batch,
            ));
        }
    }

    let json = ropts.output_format.is_json();
    if !json {
        let hdr: Vec<_> = plans.iter().map(|(p, _)| (p.opts.clone(), p.groupid)).collect();
        out.write_all(report::header(&hdr, &target_lines, plans.len()).as_bytes()).map_err(|e| e.to_string())?;
        out.flush().map_err(|e| e.to_string())?;
    }
    let show_eta = match ropts.eta {
        EtaMode::Always => true,
        EtaMode::Never => false,
        EtaMode::Auto => !json && std::io::stdout().is_terminal(),
    };

    catch_sigint();
    let started = SystemTime::now();
    let mut all: Vec<JobStats> = Vec::with_capacity(plans.len());
    let mut groups: Vec<Group> = Vec::new();
    let batches = plans.iter().map(|(_, b)| *b).max().map_or(0, |b| b + 1);
    // --plot's IOPS samples of every batch on one clock: (s since the first batch, cumulative I/Os).
    let mut iops_samples: Vec<(f64, [u64; 2])> = Vec::new();
    let run_clock = Instant::now();
    for b in 0..batches {
        let batch_plans: Vec<JobPlan> = plans.iter().filter(|(_, pb)| *pb == b).map(|(p, _)| p.clone()).collect();
        let batch_start = run_clock.elapsed().as_secs_f64();
        let before = iops_samples.last().map_or([0, 0], |s| s.1);
        let (stats, target_cpu, wall, samples) =
            run_batch(&batch_plans, ropts.target_pid, target.is_some(), show_eta, ropts.plot.is_some());
        iops_samples.extend(
            samples.iter().map(|(t, n)| (batch_start + t.as_secs_f64(), [before[0] + n[0], before[1] + n[1]])),
        );
        for s in &stats {
            match groups.iter_mut().find(|g| g.groupid == s.groupid) {
                Some(g) => g.jobs.push(s.clone()),
                None => groups.push(Group { groupid: s.groupid, jobs: vec![s.clone()], target_cpu, wall }),
            }
        }
        all.extend(stats);
        if STOP.load(Ordering::Relaxed) {
            break;
        }
    }

    if let Some(t) = target {
        if let Err(e) = t.shutdown() {
            eprintln!("rdmablk-bench: embedded target: {e}");
        }
    }

    // Entries: one per job, or one per group where a job asks for group reporting.
    let mut entries: Vec<Entry> = Vec::new();
    for ((plan, _), s) in plans.iter().zip(&all) {
        let merge = plan.opts.group_reporting || plans.iter().any(|(p, _)| p.groupid == plan.groupid && p.opts.group_reporting);
        if merge {
            if let Some(e) = entries.iter_mut().find(|e| e.stats.groupid == plan.groupid) {
                e.stats.merge(s);
                continue;
            }
        }
        entries.push(Entry { stats: s.clone(), opts: plan.opts.clone(), url: plan.url.clone(), volume: plan.volume.clone() });
    }
    let rep = Report { entries, groups, target_lines, started, globals };
    let text = if json {
        let doc = if ropts.output_format == OutputFormat::JsonPlus { report::json_plus(&rep) } else { report::json(&rep) };
        let mut s = serde_json::to_string_pretty(&doc).map_err(|e| e.to_string())?;
        s.push('\n');
        s
    } else {
        report::normal(&rep)
    };
    out.write_all(text.as_bytes()).map_err(|e| e.to_string())?;
    out.flush().map_err(|e| e.to_string())?;
    if let Some(prefix) = &ropts.plot {
        let json_plus = serde_json::to_string(&report::json_plus(&rep)).map_err(|e| e.to_string())?;
        for path in run_plot::write(prefix, &json_plus, &iops_samples)? {
            eprintln!("rdmablk-bench: wrote {}", path.display());
        }
    }

    let failed = all.iter().any(|s| s.error != 0 || s.total_errors() > 0);
    Ok(i32::from(failed))
}

/// Runs the jobs of one batch at once; returns their stats (in plan order),
/// the target's CPU time while they ran, and the wall time.
fn run_batch(
    plans: &[JobPlan],
    target_pid: Option<u32>,
    embedded: bool,
    show_eta: bool,
    plot: bool,
) -> (Vec<JobStats>, Option<CpuUsage>, std::time::Duration, Vec<run_plot::IopsSample>) {
    let target_cpu = || -> Option<CpuUsage> {
        match target_pid {
            Some(pid) => cpu::process_usage(pid),
            None if embedded => Some(cpu::threads_usage(embedded::is_target_thread)),
            None => None,
        }
    };
    let barrier = Arc::new(Barrier::new(plans.len() + 1));
    let progress: Vec<Arc<JobProgress>> = plans.iter().map(|_| Arc::new(JobProgress::default())).collect();
    let mut handles = Vec::with_capacity(plans.len());
    for (plan, prog) in plans.iter().zip(&progress) {
        let plan = plan.clone();
        let prog = Arc::clone(prog);
        let barrier = Arc::clone(&barrier);
        let h = std::thread::Builder::new().name(format!("job{}", plan.index)).spawn(move || -> JobStats {
            let o = &plan.opts;
            let slot = o.max_bs() as usize;
            let who = engine::Identity { host_id: o.host_id.as_deref(), key_file: o.key_file.as_deref() };
            let tuning = engine::Tuning { hipri: o.hipri, rkey_scoping: o.rkey_scoping, ctrl_loss_timeout: o.ctrl_loss_tmo };
            let engine = engine::open(o.ioengine, &plan.url, &plan.volume, o.iodepth, slot, who, tuning);
            barrier.wait();
            match engine {
                Ok(mut e) => job::run(&plan, e.as_mut(), &prog, &STOP),
                Err(msg) => {
                    eprintln!("{}: {msg}", o.name);
                    JobStats {
                        name: o.name.clone(),
                        groupid: plan.groupid,
                        jobs: 1,
                        error: ECONNREFUSED,
                        error_msg: Some(msg),
                        io_errors: 1,
                        ..JobStats::default()
                    }
                }
            }
        });
        handles.push(h.expect("spawning a job thread"));
    }
    // Every job has connected (or failed to): start the clock together.
    barrier.wait();
    let cpu0 = target_cpu();
    let t0 = Instant::now();
    let sampler = plot.then(|| run_plot::IopsSampler::start(progress.clone()));
    let eta = show_eta.then(|| {
        progress::StatusLine::start(progress.iter().cloned().zip(plans.iter().map(|p| p.opts.rw)).collect())
    });
    let stats: Vec<JobStats> = handles
        .into_iter()
        .zip(plans)
        .map(|(h, plan)| match h.join() {
            Ok(s) => s,
            Err(_) => JobStats {
                name: plan.opts.name.clone(),
                groupid: plan.groupid,
                jobs: 1,
                error: job::EIO,
                error_msg: Some("the job thread panicked".to_owned()),
                io_errors: 1,
                ..JobStats::default()
            },
        })
        .collect();
    let wall = t0.elapsed();
    if let Some(e) = eta {
        e.finish();
    }
    let samples = sampler.map(run_plot::IopsSampler::finish).unwrap_or_default();
    let cpu = match (cpu0, target_cpu()) {
        (Some(a), Some(b)) => Some(b.since(&a)),
        _ => None,
    };
    (stats, cpu, wall, samples)
}
