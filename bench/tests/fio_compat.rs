//! rdmablk-bench against fio's formats, end to end on the real binary and
//! its embedded target: files that jobs read are laid out first, fio's log
//! files and json+ bins are written as fio writes them (and fio's own
//! tools read them, where they are installed), the JSON has fio's
//! top-level keys, and fio options that are not implemented are refused.
//! No timing assertions.

mod support;
use support::{bench, dir, json, ok, text};

use std::collections::BTreeMap;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::process::Command;

use rdmablk_bench::fio_log::{plat_idx_to_val, plat_val_to_idx, PLAT_NR};
use serde_json::Value;

fn s(p: &Path) -> String {
    p.to_str().expect("UTF-8 path").to_owned()
}

/// The ranges of `path` in `0..len` that hold no data.
fn holes(path: &Path, len: u64) -> Vec<(u64, u64)> {
    rdmablk_bench::file_layout::holes(&std::fs::File::open(path).unwrap(), len).unwrap()
}

fn u(v: &Value, what: &str) -> u64 {
    v.as_u64().unwrap_or_else(|| panic!("{what} is not an unsigned integer: {v}"))
}

#[test]
fn a_sparse_file_is_laid_out_before_it_is_read_and_keeps_its_data() {
    let d = dir();
    let file = d.path().join("sparse.img");
    let f = std::fs::File::create(&file).unwrap();
    f.set_len(16 << 20).unwrap();
    let mark = vec![0xa5u8; 64 << 10];
    f.write_all_at(&mark, 1 << 20).unwrap();
    f.sync_all().unwrap();
    drop(f);
    assert!(std::fs::metadata(&file).unwrap().blocks() * 512 < 1 << 20, "the file starts sparse");

    let path = s(&file);
    let args = ["--name=reader", "--filename", &path, "--size=16M", "--rw=read", "--bs=64k", "--iodepth=4", "--output-format=json"];
    let out = ok(&args);
    let err = text(&out.stderr);
    assert!(err.contains("reader: Laying out IO file (1 file / 16MiB)\n"), "no layout line on stderr:\n{err}");
    let m = std::fs::metadata(&file).unwrap();
    assert_eq!(m.len(), 16 << 20);
    assert!(m.blocks() * 512 >= 16 << 20, "only {} bytes allocated after the layout", m.blocks() * 512);
    assert!(holes(&file, 16 << 20).is_empty(), "holes left: {:?}", holes(&file, 16 << 20));
    let mut back = vec![0u8; mark.len()];
    std::fs::File::open(&file).unwrap().read_exact_at(&mut back, 1 << 20).unwrap();
    assert!(back == mark, "the layout wrote over data that was in the file");
    // The read job then ran over the whole file.
    let v = json(&out);
    assert_eq!(u(&v["jobs"][0]["read"]["io_bytes"], "io_bytes"), 16 << 20);
    assert_eq!(v["jobs"][0]["error"], 0);

    // Laid out once: the next run reads it as it is.
    let out = ok(&args);
    assert!(!text(&out.stderr).contains("Laying out"), "{}", text(&out.stderr));

    // A missing file that a mixed job reads is created and laid out too.
    let new = s(&d.path().join("new.img"));
    let out = ok(&["--name=mixed", "--filename", &new, "--size=4M", "--rw=randrw", "--bs=4k", "--io_size=1M"]);
    assert!(text(&out.stderr).contains("mixed: Laying out IO file (1 file / 4MiB)"), "{}", text(&out.stderr));
    assert!(holes(Path::new(&new), 4 << 20).is_empty());

    // A write-only job needs no layout (as in fio): its writes allocate.
    let fresh = d.path().join("write-only.img");
    let out = ok(&["--name=writer", "--filename", &s(&fresh), "--size=8M", "--rw=write", "--bs=1M", "--io_size=1M"]);
    assert!(!text(&out.stderr).contains("Laying out"), "{}", text(&out.stderr));
    assert!(!holes(&fresh, 8 << 20).is_empty(), "the written file is not laid out beyond what was written");
}

/// Parses a log: lines of integers separated by ", ".
fn log(path: &Path) -> Vec<Vec<u64>> {
    let t = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    t.lines()
        .map(|l| l.split(", ").map(|f| f.parse().unwrap_or_else(|_| panic!("{}: bad line {l:?}", path.display()))).collect())
        .collect()
}

#[test]
fn fio_log_files_per_io_match_the_json_and_the_job() {
    let d = dir();
    let prefix = s(&d.path().join("run"));
    let out = ok(&[
        "--backend=null", "--size=64M", "--name=mix", "--rw=randrw", "--bs=4k", "--iodepth=8", "--numjobs=2", "--runtime=1",
        "--time_based", "--output-format=json+", &format!("--write_lat_log={prefix}"), &format!("--write_bw_log={prefix}"),
        &format!("--write_iops_log={prefix}"), &format!("--write_hist_log={prefix}"), "--log_hist_msec=100", "--log_offset=1",
    ]);
    let v = json(&out);
    for n in 1..=2usize {
        let job = &v["jobs"][n - 1];
        let total = [u(&job["read"]["total_ios"], "read"), u(&job["write"]["total_ios"], "write")];
        assert!(total[0] > 100 && total[1] > 100, "{total:?}");
        let runtime_ms = u(&job["job_runtime"], "job_runtime");
        let logs: BTreeMap<&str, Vec<Vec<u64>>> = ["lat", "clat", "slat", "bw", "iops"]
            .into_iter()
            .map(|k| (k, log(&PathBuf::from(format!("{prefix}_{k}.{n}.log")))))
            .collect();
        for (kind, lines) in &logs {
            // time, value, ddir, bs, offset, prio: one line per I/O.
            let mut per_dir = [0u64; 2];
            for l in lines {
                assert_eq!(l.len(), 6, "{kind}.{n}: {l:?}");
                assert!(l[0] <= runtime_ms + 100, "{kind}.{n}: time {} ms after a {runtime_ms} ms run", l[0]);
                assert!(l[2] <= 1 && l[3] == 4096 && l[4] % 4096 == 0 && l[4] < 64 << 20 && l[5] == 0, "{kind}.{n}: {l:?}");
                per_dir[l[2] as usize] += 1;
            }
            assert_eq!(per_dir, total, "{kind}.{n}: a line per I/O, as the JSON counts them");
            let times: Vec<u64> = lines.iter().map(|l| l[0]).collect();
            assert!(times.windows(2).all(|w| w[0] <= w[1]), "{kind}.{n}: times go backwards");
        }
        let (clat, lat, slat) = (&logs["clat"], &logs["lat"], &logs["slat"]);
        for i in 0..clat.len() {
            assert_eq!(clat[i][4], lat[i][4], "line {i}: the same I/O in both logs");
            assert_eq!(clat[i][1] + slat[i][1], lat[i][1], "line {i}: clat + slat = lat");
            // fio's per-I/O bandwidth: bytes per millisecond of clat (about KiB/s).
            assert_eq!(logs["bw"][i][1], (4096 * 1_000_000u64).checked_div(clat[i][1]).unwrap_or(0), "line {i}");
            assert_eq!(logs["iops"][i][1], 1);
        }
        // The clat log and json+ bins describe the same I/O.
        for (d, name) in [(0usize, "read"), (1, "write")] {
            let mut from_log: BTreeMap<u64, u64> = BTreeMap::new();
            for l in clat.iter().filter(|l| l[2] == d as u64) {
                *from_log.entry(plat_idx_to_val(plat_val_to_idx(l[1]))).or_default() += 1;
            }
            let bins: BTreeMap<u64, u64> = job[name]["clat_ns"]["bins"]
                .as_object()
                .unwrap_or_else(|| panic!("{name}.clat_ns.bins missing: {}", job[name]["clat_ns"]))
                .iter()
                .map(|(k, c)| (k.parse().unwrap(), u(c, k)))
                .collect();
            assert_eq!(bins.values().sum::<u64>(), total[d], "{name}: bins add up to total_ios");
            assert_eq!(bins, from_log, "{name}: json+ bins are the clat log's I/O in fio's bins");
        }
        // Histogram lines: time, ddir, bs, 1856 bins of the window's I/O.
        let hist = log(&PathBuf::from(format!("{prefix}_clat_hist.{n}.log")));
        assert!(hist.len() >= 10, "{} lines for 1 s at 100 ms per direction", hist.len());
        let mut in_hist = [0u64; 2];
        for l in &hist {
            assert_eq!(l.len(), 3 + PLAT_NR);
            assert!(l[1] <= 1 && l[2] == 4096, "{:?}", &l[..3]);
            in_hist[l[1] as usize] += l[3..].iter().sum::<u64>();
        }
        for d in 0..2 {
            // The last, partial window is not written (as in fio).
            assert!(in_hist[d] <= total[d] && in_hist[d] * 10 >= total[d] * 5, "{in_hist:?} of {total:?}");
        }
    }
}

#[test]
fn averaged_logs_have_a_line_per_window() {
    let d = dir();
    let prefix = s(&d.path().join("avg"));
    let out = ok(&[
        "--backend=null", "--size=64M", "--name=rr", "--rw=randread", "--bs=4k", "--iodepth=4", "--runtime=1200ms",
        "--time_based", "--output-format=json", "--log_avg_msec=200", &format!("--write_lat_log={prefix}"),
        &format!("--write_bw_log={prefix}"), &format!("--write_iops_log={prefix}"),
    ]);
    let v = json(&out);
    let job = &v["jobs"][0];
    let clat = log(&PathBuf::from(format!("{prefix}_clat.1.log")));
    let (min, max) = (u(&job["read"]["clat_ns"]["min"], "min"), u(&job["read"]["clat_ns"]["max"], "max"));
    assert!((5..=8).contains(&clat.len()), "{} lines for 1.2 s at 200 ms: {clat:?}", clat.len());
    for l in &clat {
        // time, value, ddir, bs 0, prio: the window's mean.
        assert_eq!(l.len(), 5, "{l:?}");
        assert!(l[1] >= min && l[1] <= max && l[2] == 0 && l[3] == 0 && l[4] == 0, "{l:?} (clat {min}..{max})");
    }
    let iops = log(&PathBuf::from(format!("{prefix}_iops.1.log")));
    let bw = log(&PathBuf::from(format!("{prefix}_bw.1.log")));
    assert!((4..=7).contains(&iops.len()) && iops.len() == bw.len(), "{iops:?}\n{bw:?}");
    let mean_iops = job["read"]["iops"].as_f64().unwrap();
    for (i, b) in iops.iter().zip(&bw) {
        assert_eq!((i[0], i[2], i[3]), (b[0], 0, 0));
        // bw in KiB/s of 4 KiB I/O: IOPS * 4, within rounding.
        assert!(b[1].abs_diff(i[1] * 4) <= 4, "bw {} vs iops {}", b[1], i[1]);
        assert!(i[1] as f64 > mean_iops / 4.0 && (i[1] as f64) < mean_iops * 4.0, "{} vs a mean of {mean_iops}", i[1]);
    }
}

#[test]
fn jobs_share_a_log_without_per_job_logs() {
    let d = dir();
    let prefix = s(&d.path().join("shared"));
    let out = ok(&[
        "--backend=null", "--size=64M", "--name=w", "--rw=randwrite", "--bs=8k", "--numjobs=3", "--io_size=2M",
        "--output-format=json", "--per_job_logs=0", &format!("--write_iops_log={prefix}"),
    ]);
    let v = json(&out);
    let total: u64 = (0..3).map(|j| u(&v["jobs"][j]["write"]["total_ios"], "total_ios")).sum();
    assert_eq!(total, 3 * 256);
    assert!(!Path::new(&format!("{prefix}_iops.1.log")).exists(), "no .N without per_job_logs");
    let lines = log(Path::new(&format!("{prefix}_iops.log")));
    assert_eq!(lines.len() as u64, total, "every job's lines, whole");
    assert!(lines.iter().all(|l| l.len() == 5 && l[1] == 1 && l[2] == 1 && l[3] == 8192), "{lines:?}");
}

#[test]
fn json_has_fios_top_level_keys_in_fios_order() {
    let out = ok(&["--backend=null", "--size=16M", "--bs=4k", "--name=a", "--rw=randread", "--io_size=4M", "--output-format=json"]);
    let t = text(&out.stdout);
    let keys = ["\"fio version\"", "\"timestamp\"", "\"timestamp_ms\"", "\"time\"", "\"global options\"", "\"jobs\"", "\"disk_util\""];
    let at: Vec<usize> = keys.iter().map(|k| t.find(k).unwrap_or_else(|| panic!("{k} missing:\n{t}"))).collect();
    assert!(at.windows(2).all(|w| w[0] < w[1]), "not fio's order: {keys:?} at {at:?}");
    let v = json(&out);
    let version = v["fio version"].as_str().unwrap();
    assert!(version.starts_with("fio-3.33-rdmablk-bench-"), "{version}");
    let ts = u(&v["timestamp"], "timestamp");
    assert_eq!(u(&v["timestamp_ms"], "timestamp_ms") / 1000, ts);
    // ctime: "Wed Dec  2 19:51:54 2026".
    let time = v["time"].as_str().unwrap();
    let f: Vec<&str> = time.split_whitespace().collect();
    assert!(f.len() == 5 && f[0].len() == 3 && f[1].len() == 3 && f[3].len() == 8 && f[4].parse::<u32>().is_ok(), "{time}");
    assert_eq!(v["global options"], serde_json::json!({"backend": "null", "size": "16M", "bs": "4k"}));
    assert_eq!(v["jobs"][0]["job options"], serde_json::json!({"name": "a", "rw": "randread", "io_size": "4M"}));
    assert!(v["disk_util"].is_array());
}

#[test]
fn fio_options_that_are_not_implemented_are_refused_by_name() {
    for (opt, want) in [
        ("--direct=0", "rdmablk-bench: direct=0: rdmablk-bench does not implement this fio option"),
        ("--gtod_reduce=1", "rdmablk-bench: gtod_reduce=1: rdmablk-bench does not implement this fio option"),
        ("--exitall", "rdmablk-bench: unknown option --exitall: rdmablk-bench does not implement it"),
        ("--rate_iops=1000", "rdmablk-bench: unknown option --rate_iops: rdmablk-bench does not implement it"),
        ("--output-format=terse", "rdmablk-bench: --output-format: \"terse\" is not implemented by rdmablk-bench"),
    ] {
        let out = bench(&["--backend=null", "--size=1M", "--name=x", opt]);
        assert_eq!(out.status.code(), Some(1), "{opt} accepted");
        let err = text(&out.stderr);
        assert!(err.starts_with(want), "{opt}: {err}");
        assert!(out.stdout.is_empty(), "{opt}: nothing runs");
    }
    // A log file that cannot be created fails the job, saying which and why.
    let out = bench(&["--backend=null", "--size=1M", "--name=x", "--write_bw_log=/nonexistent-dir-x/p", "--output-format=json"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(text(&out.stderr).contains("write_bw_log: cannot create /nonexistent-dir-x/p_bw.1.log"), "{}", text(&out.stderr));
}

/// A fio tool, if it is installed.
fn tool(name: &str) -> Option<PathBuf> {
    std::env::var_os("PATH")?.to_str()?.split(':').map(|d| Path::new(d).join(name)).find(|p| p.is_file())
}

#[test]
fn fios_own_tools_read_the_output() {
    let Some(clat2csv) = tool("fio_jsonplus_clat2csv") else {
        eprintln!("fio_jsonplus_clat2csv is not installed (Debian: apt-get install fio): not checked");
        return;
    };
    let d = dir();
    let json_path = d.path().join("out.json");
    let prefix = s(&d.path().join("run"));
    ok(&[
        "--backend=null", "--size=64M", "--name=mix", "--rw=randrw", "--bs=4k", "--iodepth=8", "--runtime=1", "--time_based",
        "--output-format=json+", "--output", &s(&json_path), &format!("--write_bw_log={prefix}"),
        &format!("--write_iops_log={prefix}"),
    ]);
    // fio's json+ converter reads the bins, then checks its CSV against them.
    let stub = s(&d.path().join("clat.csv"));
    for (args, said) in [(vec![s(&json_path), stub.clone()], "clat_job0.csv generated"), (vec!["--validate".into(), s(&json_path), stub.clone()], "clat_job0.csv validated")] {
        let out = Command::new(&clat2csv).args(&args).output().unwrap();
        assert!(out.status.success(), "{args:?}: {}\n{}", text(&out.stdout), text(&out.stderr));
        assert!(text(&out.stdout).contains(said), "{args:?}: {}", text(&out.stdout));
    }
    let csv = std::fs::read_to_string(d.path().join("clat_job0.csv")).unwrap();
    let last = csv.lines().last().unwrap();
    assert!(last.contains(", 1.0,"), "the cumulative percentile reaches 1.0: {last}");

    // fio2gnuplot plots the bandwidth log (with gnuplot installed).
    if let (Some(f2g), Some(_)) = (tool("fio2gnuplot"), tool("gnuplot")) {
        let out = Command::new(f2g).args(["-b", "-g"]).current_dir(d.path()).output().unwrap();
        assert!(out.status.success(), "{}\n{}", text(&out.stdout), text(&out.stderr));
        assert!(d.path().join("run_bw.1-2Draw.png").is_file(), "{}", text(&out.stdout));
    } else {
        eprintln!("fio2gnuplot or gnuplot is not installed: the bandwidth plot is not checked");
    }
}
