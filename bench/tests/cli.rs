//! rdmablk-bench end to end, on its embedded target: the JSON keeps fio's
//! keys, job files run, and verify catches a corrupted block. No timing
//! assertions: only that the tool runs and reports.

mod support;
use support::{bench, dir, json, ok, text};

use std::path::Path;

use serde_json::Value;

fn path_str(p: &Path) -> String {
    p.to_str().expect("UTF-8 path").to_owned()
}

fn num(v: &Value, what: &str) -> f64 {
    v.as_f64().unwrap_or_else(|| panic!("{what} is not a number: {v}"))
}

fn check_lat(l: &Value, what: &str) {
    for key in ["min", "max", "mean", "stddev"] {
        num(&l[key], &format!("{what}.{key}"));
    }
    let p = &l["percentile"];
    assert!(p.is_object(), "{what}.percentile missing: {l}");
    for key in ["1.000000", "50.000000", "99.000000", "99.990000"] {
        num(&p[key], &format!("{what}.percentile[{key}]"));
    }
    assert!(num(&l["min"], what) <= num(&l["max"], what), "{what}: min > max");
}

fn check_dir(d: &Value, what: &str) {
    for key in ["io_bytes", "bw", "bw_bytes", "iops", "runtime", "total_ios"] {
        num(&d[key], &format!("{what}.{key}"));
    }
    assert!(num(&d["total_ios"], what) > 0.0, "{what}: no I/O: {d}");
    assert!(num(&d["io_bytes"], what) > 0.0, "{what}: no bytes");
    let bw = num(&d["bw"], what);
    let bw_bytes = num(&d["bw_bytes"], what);
    assert!((bw - (bw_bytes / 1024.0).floor()).abs() <= 1.0, "{what}: bw {bw} is not bw_bytes/1024 ({bw_bytes})");
    let runtime = num(&d["runtime"], what);
    let iops = num(&d["iops"], what);
    let total = num(&d["total_ios"], what);
    assert!((iops - total / (runtime / 1000.0)).abs() / iops < 0.05, "{what}: iops {iops} vs {total} in {runtime} ms");
    for key in ["slat_ns", "clat_ns", "lat_ns"] {
        check_lat(&d[key], &format!("{what}.{key}"));
    }
}

#[test]
fn json_of_an_embedded_run_has_fios_keys() {
    let d = dir();
    let file = path_str(&d.path().join("vol.img"));
    let out = ok(&[
        "--name=mixed",
        &format!("--filename={file}"),
        "--size=16M",
        "--rw=randrw",
        "--bs",
        "4k",
        "--iodepth=8",
        "--runtime=1500ms",
        "--time_based",
        "--output-format=json",
    ]);
    let v = json(&out);
    assert!(v["rdmablk-bench version"].as_str().is_some_and(|s| s.starts_with("rdmablk-bench-")), "{v}");
    let jobs = v["jobs"].as_array().expect("jobs[]");
    assert_eq!(jobs.len(), 1);
    let j = &jobs[0];
    assert_eq!(j["jobname"], "mixed");
    assert_eq!(j["error"], 0);
    check_dir(&j["read"], "read");
    check_dir(&j["write"], "write");
    let runtime = num(&j["read"]["runtime"], "runtime");
    assert!((1000.0..5000.0).contains(&runtime), "runtime {runtime} ms for a 1.5 s run");
    for key in ["usr_cpu", "sys_cpu"] {
        num(&j[key], key);
    }
    assert!(num(&j["usr_cpu"], "usr_cpu") + num(&j["sys_cpu"], "sys_cpu") > 0.0);
    // No reconnection, counted all the same, per job and in total.
    assert_eq!(j["rdmablk"]["reconnects"], 0, "{}", j["rdmablk"]);
    assert_eq!(v["rdmablk"]["reconnects"], 0, "{}", v["rdmablk"]);
    // The embedded target's CPU time is reported per group.
    let g = &v["rdmablk"]["groups"][0];
    assert!(num(&g["iops_per_target_cpu_sec"], "iops_per_target_cpu_sec") > 0.0, "{g}");
    // No status line in JSON output: stdout is exactly the document.
    assert!(text(&out.stdout).trim_start().starts_with('{'));
}

#[test]
fn a_job_file_with_two_jobs_runs_both() {
    let d = dir();
    let jobfile = d.path().join("two.fio");
    std::fs::write(
        &jobfile,
        "; two jobs on the embedded null volume\n\
         [global]\n\
         backend=null\n\
         size=64m\n\
         bs=4k\n\
         runtime=1\n\
         time_based\n\
         \n\
         [reader]\n\
         rw=randread\n\
         iodepth=4\n\
         \n\
         [writer]\n\
         rw=write\n\
         bs=64k\n",
    )
    .unwrap();
    let jf = path_str(&jobfile);
    let v = json(&ok(&[&jf, "--output-format=json"]));
    let jobs = v["jobs"].as_array().expect("jobs[]");
    let names: Vec<&str> = jobs.iter().map(|j| j["jobname"].as_str().unwrap()).collect();
    assert_eq!(names, ["reader", "writer"]);
    check_dir(&jobs[0]["read"], "reader.read");
    check_dir(&jobs[1]["write"], "writer.write");
    assert_eq!(jobs[0]["write"]["total_ios"], 0);
    assert_eq!(jobs[1]["job options"]["bs"], "64k");

    // The same file in normal output, reported as one group.
    let out = ok(&[&jf, "--group_reporting", "--runtime=500ms"]);
    let s = text(&out.stdout);
    for want in ["reader: (g=0): rw=randread", "writer: (g=0): rw=write", "(groupid=0, jobs=2)", "clat percentiles", "Run status group 0", "READ: bw=", "WRITE: bw="] {
        assert!(s.contains(want), "missing {want:?} in:\n{s}");
    }
}

#[test]
fn verify_catches_a_corrupted_block() {
    let d = dir();
    let file = d.path().join("verify.img");
    let f = path_str(&file);
    let common = [format!("--filename={f}"), "--size=4M".into(), "--bs=4k".into(), "--verify=crc32c".into(), "--iodepth=8".into()];
    let args = |extra: &[&str]| -> Vec<String> {
        let mut v: Vec<String> = vec!["--name=verify".into()];
        v.extend(common.iter().cloned());
        v.extend(extra.iter().map(|s| s.to_string()));
        v
    };
    let run = |extra: &[&str]| bench(&args(extra).iter().map(String::as_str).collect::<Vec<_>>());

    // Write phase, read back and verified in the same run.
    let out = run(&["--rw=randwrite", "--output-format=json"]);
    assert!(out.status.success(), "write phase failed:\n{}", text(&out.stderr));
    let v = json(&out);
    assert_eq!(num(&v["jobs"][0]["write"]["io_bytes"], "write io_bytes"), 4.0 * 1048576.0);
    assert_eq!(num(&v["jobs"][0]["read"]["io_bytes"], "verify io_bytes"), 4.0 * 1048576.0);

    // A clean verify-only pass succeeds.
    let out = run(&["--rw=randwrite", "--verify_only"]);
    assert!(out.status.success(), "clean verify failed:\n{}\n{}", text(&out.stdout), text(&out.stderr));

    // Flip a payload byte of block 100 behind the target's back.
    let block = 100u64;
    let at = block * 4096 + 2000;
    let mut data = std::fs::read(&file).unwrap();
    data[at as usize] ^= 0x5a;
    std::fs::write(&file, &data).unwrap();

    let out = run(&["--rw=randwrite", "--verify_only", "--output-format=json"]);
    assert!(!out.status.success(), "verify_only passed over a corrupted block");
    let err = text(&out.stderr);
    let want = format!("verify: bad crc at offset {}", block * 4096);
    assert!(err.contains(&want), "stderr lacks {want:?}:\n{err}");
    let v = json(&out);
    let j = &v["jobs"][0];
    assert_eq!(j["error"], 84, "fio's EILSEQ for a verify failure");
    assert_eq!(j["rdmablk"]["verify_errors"], 1);
    assert!(j["rdmablk"]["error_message"].as_str().unwrap().contains(&want));
}

#[test]
fn help_version_and_bad_options() {
    let out = ok(&["--help"]);
    assert!(text(&out.stdout).contains("--iodepth"));
    assert!(text(&out.stdout).contains("--ctrl_loss_tmo=VALUE"));
    let out = ok(&["--version"]);
    assert!(text(&out.stdout).starts_with("rdmablk-bench-"));
    let out = bench(&["--name=x", "--rw=sideways", "--backend=null", "--size=1M"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(text(&out.stderr).contains("sideways"));
    let out = bench(&["--name=x", "--backend=null", "--size=1M", "--ctrl_loss_tmo=-1"]);
    assert_eq!(out.status.code(), Some(1));
    let err = text(&out.stderr);
    assert!(err.starts_with("rdmablk-bench: ctrl_loss_tmo: \"-1\" is negative"), "{err}");
    let out = bench(&["--name=x", "--target=tcp://127.0.0.1:1", "--volume=v", "--runtime=1"]);
    assert_eq!(out.status.code(), Some(1), "an unreachable target is an error");
}
