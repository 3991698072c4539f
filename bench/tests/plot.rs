//! bench::plot and rdmablk-plot: every chart parses as XML (roxmltree) with
//! the bars, lines and labels its data asks for; empty input is an error;
//! the readers are proven on what real fio writes (json+ bins, iops and bw
//! logs, averaged and per I/O) and on compare.sh's results table as
//! recorded in docs/img/compare.tsv.

mod support;
use support::{dir, text};

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use rdmablk_bench::plot::{
    bin_percentiles, compare_panels, comparison_chart_svg, json_plus_bins, latency_histogram_svg, log_series, merge_bins,
    parse_compare_tsv, parse_fio_log, time_series_svg, Bar, BarGroup, LogKind, Panel, Series, MARKED_PERCENTILES,
};
use serde_json::Value;

/// Parses the SVG, checks its root, and hands it to `check`.
fn with_svg(svg: &str, check: impl FnOnce(&roxmltree::Document)) {
    let doc = roxmltree::Document::parse(svg).unwrap_or_else(|e| panic!("not well-formed XML: {e}\n{svg}"));
    let root = doc.root_element();
    assert_eq!(root.tag_name().name(), "svg");
    assert_eq!(root.tag_name().namespace(), Some("http://www.w3.org/2000/svg"));
    assert!(root.attribute("viewBox").is_some(), "no viewBox: the chart would not scale");
    check(&doc);
}

fn with_class<'a>(doc: &'a roxmltree::Document, class: &str) -> Vec<roxmltree::Node<'a, 'a>> {
    doc.descendants().filter(|n| n.attribute("class") == Some(class)).collect()
}

/// Every text node's content, in document order.
fn texts(doc: &roxmltree::Document) -> Vec<String> {
    doc.descendants().filter(|n| n.has_tag_name("text")).map(|n| n.text().unwrap_or("").to_owned()).collect()
}

fn texts_of(doc: &roxmltree::Document, class: &str) -> Vec<String> {
    with_class(doc, class).iter().map(|n| n.text().unwrap_or("").to_owned()).collect()
}

fn plot(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_rdmablk-plot")).args(args).output().expect("running rdmablk-plot")
}

fn stderr(o: &Output) -> String {
    text(&o.stderr)
}

// --- the charts, on data made up here -------------------------------------------------

#[test]
fn histogram_has_a_bar_per_twentieth_decade_and_the_percentiles_marked() {
    // 10000 I/Os: 9000 around 50 us (two fio bins in one 1/20 decade), 905
    // at 200 us, 90 at 1 ms, 5 at 5 ms (no percentile on a bin's edge).
    let bins = [(50_176, 5000), (50_688, 4000), (200_704, 905), (1_003_520, 90), (5_013_504, 5)];
    let svg = latency_histogram_svg("4k randread <QD1> & more", &bins).expect("a histogram");
    with_svg(&svg, |doc| {
        assert_eq!(with_class(doc, "bar").len(), 4, "50.2 and 50.7 us share a bar; the others have one each");
        let all = texts(doc);
        assert!(all.contains(&"4k randread <QD1> & more".to_owned()), "the title, unescaped by the parser: {all:?}");
        assert!(all.contains(&"10000 I/Os".to_owned()));
        assert_eq!(texts_of(doc, "percentile"), ["p50 50.2 µs", "p99 201 µs", "p99.9 1 ms"]);
        let ticks = texts_of(doc, "x-tick");
        assert!(ticks.iter().any(|t| t.ends_with(" µs")) && ticks.iter().any(|t| t.ends_with(" ms")), "{ticks:?}");
        // The tallest bar holds 90 % of the I/Os.
        let tooltip = |b: &roxmltree::Node| b.children().find(|c| c.has_tag_name("title")).unwrap().text().unwrap().to_owned();
        let tips: Vec<String> = with_class(doc, "bar").iter().map(tooltip).collect();
        assert!(tips.iter().any(|t| t.ends_with("9000 I/Os (90%)")), "{tips:?}");
    });
}

#[test]
fn histogram_of_nothing_is_an_error_that_says_how_to_get_bins() {
    let e = latency_histogram_svg("t", &[]).unwrap_err();
    assert!(e.contains("--output-format=json+"), "{e}");
    let e = latency_histogram_svg("t", &[(1000, 0), (2000, 0)]).unwrap_err();
    assert!(e.contains("every count is 0"), "{e}");
}

#[test]
fn time_series_draws_one_line_per_series_through_every_point() {
    let series = vec![
        Series { label: "read".into(), points: (0..10).map(|i| (i as f64 * 0.1, 1000.0 + i as f64)).collect() },
        Series { label: "write".into(), points: (0..7).map(|i| (i as f64 * 0.1, 500.0)).collect() },
        Series { label: "one sample".into(), points: vec![(0.5, 200.0)] },
    ];
    let svg = time_series_svg("IOPS over time", "IOPS", &series).expect("a chart");
    with_svg(&svg, |doc| {
        let lines = with_class(doc, "series");
        assert_eq!(lines.len(), 3);
        let counts: Vec<usize> =
            lines.iter().map(|l| l.attribute("points").map_or(1, |p| p.split_whitespace().count())).collect();
        assert_eq!(counts, [10, 7, 1]);
        assert_eq!(texts_of(doc, "legend-label"), ["read", "write", "one sample"]);
        assert!(texts(doc).contains(&"time (s)".to_owned()));
    });
}

#[test]
fn time_series_refuses_empty_and_non_finite_input() {
    let e = time_series_svg("t", "IOPS", &[]).unwrap_err();
    assert!(e.contains("--write_iops_log"), "{e}");
    let e = time_series_svg("t", "IOPS", &[Series { label: "x".into(), points: vec![] }]).unwrap_err();
    assert!(e.contains("no samples"), "{e}");
    let e = time_series_svg("t", "IOPS", &[Series { label: "x".into(), points: vec![(0.0, f64::NAN)] }]).unwrap_err();
    assert!(e.contains("\"x\"") && e.contains("not a finite number"), "{e}");
}

#[test]
fn comparison_chart_has_a_bar_per_system_with_its_ratio_and_one_legend() {
    let bar = |system: &str, value: f64, ratio: f64| Bar { system: system.into(), value, ratio };
    let panels = vec![
        Panel {
            title: "file".into(),
            groups: vec![
                BarGroup {
                    label: "qd1".into(),
                    note: "1.00× = 22.8k IOPS".into(),
                    bars: vec![bar("local, file", 22816.0, 1.0), bar("rdmablk, file", 16198.0, 0.71), bar("nbdkit file", 12171.0, 0.533)],
                },
                BarGroup { label: "qd32".into(), note: String::new(), bars: vec![bar("local, file", 88996.0, 1.0)] },
            ],
        },
        Panel {
            title: "null".into(),
            groups: vec![BarGroup {
                label: "qd32".into(),
                note: String::new(),
                bars: vec![bar("rdmablk, null", 550986.0, 5.59), bar("nbdkit null", 98514.0, 1.0)],
            }],
        },
    ];
    let svg = comparison_chart_svg("compare", "run X", &panels).expect("a chart");
    with_svg(&svg, |doc| {
        assert_eq!(with_class(doc, "bar").len(), 6);
        assert_eq!(texts_of(doc, "ratio"), ["1.00", "0.71", "0.53", "1.00", "5.59", "1.00"]);
        assert_eq!(texts_of(doc, "group-label"), ["qd1", "qd32", "qd32"]);
        assert_eq!(texts_of(doc, "panel-title"), ["file", "null"]);
        // One colour per stack: "rdmablk, file" and "rdmablk, null" are one entry.
        assert_eq!(texts_of(doc, "legend-label"), ["local", "rdmablk", "nbdkit"]);
        let fill = |i: usize| with_class(doc, "bar")[i].attribute("fill").unwrap().to_owned();
        assert_eq!(fill(1), fill(4), "rdmablk's file and null bars share a colour");
        assert_ne!(fill(0), fill(1));
        assert!(texts(doc).contains(&"run X".to_owned()));
    });
}

#[test]
fn comparison_chart_of_nothing_is_an_error() {
    let e = comparison_chart_svg("t", "", &[]).unwrap_err();
    assert!(e.contains("no rows with a value"), "{e}");
    let empty = Panel { title: "file".into(), groups: vec![BarGroup { label: "qd1".into(), note: String::new(), bars: vec![] }] };
    assert!(comparison_chart_svg("t", "", &[empty]).is_err());
    let bad = Panel {
        title: "file".into(),
        groups: vec![BarGroup {
            label: "qd1".into(),
            note: String::new(),
            bars: vec![Bar { system: "x".into(), value: 1.0, ratio: f64::INFINITY }],
        }],
    };
    assert!(comparison_chart_svg("t", "", &[bad]).unwrap_err().contains("not a finite number"));
}

// --- compare.sh's results table -------------------------------------------------------

fn repo_file(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join(rel)
}

/// The chart's ratios, taken from the values, are the ratios compare.sh
/// printed in its table: vs ceiling on file rows (over local fio), vs peer
/// on the rdmablk null rows (over nbdkit null).
#[test]
fn compare_panels_of_run_t_give_compare_shs_own_ratios() {
    let text = std::fs::read_to_string(repo_file("docs/img/compare.tsv")).expect("docs/img/compare.tsv");
    let (comments, rows) = parse_compare_tsv(&text).expect("the recorded table parses");
    assert!(comments[0].starts_with("run T"), "the first comment names the run: {comments:?}");
    let panels = compare_panels(&rows).expect("panels");
    assert_eq!(panels.len(), 2, "file and null");
    let bars = panels.iter().map(|p| p.groups.iter().map(|g| g.bars.len()).sum::<usize>()).sum::<usize>();
    assert_eq!(bars, rows.len(), "a bar for every row with a value");
    let mut checked = 0;
    for p in &panels {
        for g in &p.groups {
            for b in &g.bars {
                let row = rows.iter().find(|r| r.case == g.label && r.system == b.system).expect("the bar's row");
                let printed = if b.system.contains("null") {
                    if b.system.starts_with("rdmablk-bench") {
                        row.vs_peer
                    } else {
                        None
                    }
                } else {
                    row.vs_ceiling
                };
                if let Some(printed) = printed {
                    // compare.sh printed two decimals.
                    assert!((b.ratio - printed).abs() <= 0.006, "{} / {}: {} against the table's {printed}", g.label, b.system, b.ratio);
                    checked += 1;
                }
            }
        }
    }
    assert!(checked >= 20, "only {checked} ratios checked");
    assert!(panels[0].title.contains("fio io_uring, local file (ceiling)"), "{}", panels[0].title);
    assert!(panels[1].title.contains("fio nbd -> nbdkit null"), "{}", panels[1].title);
}

#[test]
fn compare_table_errors_name_the_line() {
    let header = "case\tsystem\tratio_metric\tiops\tbw_mib\tp50_us\tp99_us\tvs_ceiling\tvs_peer";
    let e = parse_compare_tsv("| case | system |\n").unwrap_err();
    assert!(e.starts_with("line 1:") && e.contains("compare.sh's results table"), "{e}");
    let e = parse_compare_tsv(&format!("# run\n{header}\nqd1\tx\tiops\t12,000\t-\t-\t-\t-\t-\n")).unwrap_err();
    assert!(e.starts_with("line 3:") && e.contains("iops \"12,000\""), "{e}");
    let e = parse_compare_tsv(&format!("{header}\nqd1\tx\tiops\n")).unwrap_err();
    assert!(e.starts_with("line 2:") && e.contains("3 tab-separated fields"), "{e}");
    let e = parse_compare_tsv(&format!("{header}\nqd1\tx\tlatency\t1\t-\t-\t-\t-\t-\n")).unwrap_err();
    assert!(e.contains("ratio_metric \"latency\""), "{e}");
    assert!(parse_compare_tsv(&format!("{header}\n")).unwrap_err().contains("no rows"));
    // A failed run (a row of dashes) gets no bar; a table of only those is an error.
    let (_, rows) = parse_compare_tsv(&format!("{header}\nqd1\tx\tiops\t-\t-\t-\t-\t-\t-\n")).unwrap();
    assert!(compare_panels(&rows).unwrap_err().contains("every run failed"));
}

#[test]
fn rdmablk_plot_compare_writes_the_chart_of_a_table() {
    let d = dir();
    let out = d.path().join("c.svg");
    let table = repo_file("docs/img/compare.tsv");
    let o = plot(&["compare", table.to_str().unwrap(), "-o", out.to_str().unwrap()]);
    assert!(o.status.success(), "{}", stderr(&o));
    let svg = std::fs::read_to_string(&out).unwrap();
    with_svg(&svg, |doc| {
        assert_eq!(with_class(doc, "bar").len(), 34, "run T's 34 rows");
        assert!(texts(doc).iter().any(|t| t.starts_with("run T")));
    });
    // A markdown table instead: the error names the file and the line.
    let md = d.path().join("table.md");
    std::fs::write(&md, "| case | system | IOPS |\n").unwrap();
    let o = plot(&["compare", md.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains(&format!("{}: line 1:", md.display())), "{}", stderr(&o));
}

// --- real fio -------------------------------------------------------------------------

fn have_fio() -> bool {
    let ok = Command::new("fio").arg("--version").output().is_ok_and(|o| o.status.success());
    if !ok {
        eprintln!("SKIPPED: fio is not installed (apt-get install fio); the readers are not checked against real fio output");
    }
    ok
}

/// Runs fio for 1 s on a file in `dir` with `extra` options and returns its
/// json+ text.
fn fio(dir: &Path, rw: &str, extra: &[&str]) -> String {
    let name = dir.join("job");
    let mut args = vec![
        "--name=job".to_owned(),
        format!("--filename={}", dir.join("data").display()),
        "--size=8M".into(),
        format!("--rw={rw}"),
        "--bs=4k".into(),
        "--ioengine=psync".into(),
        "--runtime=1".into(),
        "--time_based".into(),
        "--output-format=json+".into(),
    ];
    args.extend(extra.iter().map(|e| e.replace("NAME", name.to_str().unwrap())));
    let o = Command::new("fio").args(&args).current_dir(dir).output().expect("running fio");
    assert!(o.status.success(), "fio {args:?}: {}", stderr(&o));
    String::from_utf8(o.stdout).unwrap()
}

fn fio_json(text: &str) -> Value {
    serde_json::from_str(&text[text.find('{').unwrap()..]).unwrap()
}

#[test]
fn json_plus_bins_of_real_fio_give_fios_own_percentiles() {
    if !have_fio() {
        return;
    }
    let d = dir();
    let text = fio(d.path(), "randrw", &[]);
    let doc = fio_json(&text);
    let all = json_plus_bins(&text).expect("fio's json+ has bins");
    for ddir in ["read", "write"] {
        let lat = &doc["jobs"][0][ddir]["clat_ns"];
        let bins = merge_bins(&all, ddir);
        let n: u64 = bins.iter().map(|b| b.1).sum();
        assert_eq!(n, lat["N"].as_u64().unwrap(), "{ddir}: the bins count every I/O");
        let ours = bin_percentiles(&bins, &MARKED_PERCENTILES).unwrap();
        for (p, v) in MARKED_PERCENTILES.iter().zip(ours) {
            let fios = lat["percentile"][format!("{p:.6}")].as_u64().unwrap();
            assert_eq!(v, fios, "{ddir} p{p}: ours {v} ns, fio's {fios} ns");
        }
    }
    with_svg(&latency_histogram_svg("real fio", &merge_bins(&all, "read")).unwrap(), |doc| {
        assert!(!with_class(doc, "bar").is_empty());
        assert_eq!(with_class(doc, "percentile").len(), 3);
    });

    // The binary on the same file: the direction with more I/Os, or --ddir.
    let json = d.path().join("r.json");
    std::fs::write(&json, &text).unwrap();
    let out = d.path().join("h.svg");
    let o = plot(&["hist", json.to_str().unwrap(), "--ddir", "write", "-o", out.to_str().unwrap()]);
    assert!(o.status.success(), "{}", stderr(&o));
    with_svg(&std::fs::read_to_string(&out).unwrap(), |doc| {
        assert!(texts(doc).iter().any(|t| t == "job write: completion latency"), "{:?}", texts(doc));
    });
}

#[test]
fn plain_json_is_refused_with_the_option_that_gives_bins() {
    if !have_fio() {
        return;
    }
    let d = dir();
    let text = fio(d.path(), "randread", &["--output-format=json"]);
    let e = json_plus_bins(&text).unwrap_err();
    assert!(e.contains("jobs[0].read") && e.contains("--output-format=json+"), "{e}");
    let json = d.path().join("plain.json");
    std::fs::write(&json, &text).unwrap();
    let o = plot(&["hist", json.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains(&format!("{}: no latency bins", json.display())), "{}", stderr(&o));
}

#[test]
fn fio_logs_averaged_and_per_io_become_iops_over_time() {
    if !have_fio() {
        return;
    }
    let d = dir();
    // Averaged over 100 ms: a line per 100 ms, drawn as it is.
    fio(d.path(), "randread", &["--write_iops_log=NAME-avg", "--write_bw_log=NAME-avg", "--log_avg_msec=100"]);
    let iops_log = d.path().join("job-avg_iops.1.log");
    let samples = parse_fio_log(&std::fs::read_to_string(&iops_log).unwrap()).expect("fio's iops log parses");
    assert!(samples.len() >= 5, "{} samples in 1 s at 100 ms", samples.len());
    assert!(samples.iter().all(|s| s.bs == 0 && s.ddir == 0), "averaged: bs 0, reads");
    let points = log_series(&samples, 0, LogKind::Iops);
    assert_eq!(points.len(), samples.len());
    assert!(points.iter().all(|p| p.1 > 0.0));

    // Per I/O: a line per I/O (value 1, the I/O's bs), added up into windows;
    // the windows hold every I/O of the run but those of a last, short one.
    let text = fio(d.path(), "randrw", &["--write_iops_log=NAME-io"]);
    let doc = fio_json(&text);
    let log = d.path().join("job-io_iops.1.log");
    let samples = parse_fio_log(&std::fs::read_to_string(&log).unwrap()).unwrap();
    let total = doc["jobs"][0]["read"]["total_ios"].as_u64().unwrap() + doc["jobs"][0]["write"]["total_ios"].as_u64().unwrap();
    assert_eq!(samples.len() as u64, total, "a log line per I/O");
    assert!(samples.iter().all(|s| s.value == 1 && s.bs == 4096));
    let reads = samples.iter().filter(|s| s.ddir == 0).count() as f64;
    let points = log_series(&samples, 0, LogKind::Iops);
    assert!(points.len() >= 5, "{points:?}");
    // Rate x window (100 ms here: the run is under 20 s) gives the I/Os back.
    let counted: f64 = points[..points.len() - 1].iter().map(|p| p.1 * 0.1).sum();
    assert!(counted <= reads + 0.5 && counted >= reads * 0.8, "{counted} of {reads} reads in the windows");

    // The binary: both logs (read and write of the per-I/O one), one chart.
    let out = d.path().join("iops.svg");
    let avg = iops_log.to_str().unwrap();
    let o = plot(&["iops", avg, log.to_str().unwrap(), "--title", "two runs", "-o", out.to_str().unwrap()]);
    assert!(o.status.success(), "{}", stderr(&o));
    with_svg(&std::fs::read_to_string(&out).unwrap(), |doc| {
        assert_eq!(
            texts_of(doc, "legend-label"),
            ["job-avg_iops.1.log read", "job-io_iops.1.log read", "job-io_iops.1.log write"]
        );
        assert!(texts(doc).contains(&"IOPS".to_owned()));
    });
    // Bandwidth among IOPS: refused, naming the file.
    let bw = d.path().join("job-avg_bw.1.log");
    let o = plot(&["iops", avg, bw.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("job-avg_bw.1.log: a bandwidth (KiB/s) log among IOPS logs"), "{}", stderr(&o));
}

#[test]
fn a_bad_log_line_is_named_by_file_and_line() {
    let d = dir();
    let log = d.path().join("x_iops.1.log");
    std::fs::write(&log, "100, 2000, 0, 0, 0\n200, many, 0, 0, 0\n").unwrap();
    let o = plot(&["iops", log.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(1));
    let e = stderr(&o);
    assert!(e.contains(&format!("{}: line 2: value \"many\" is not a whole number", log.display())), "{e}");
    assert!(e.contains("time_ms, value, ddir, bs"), "says what a line looks like: {e}");
    std::fs::write(&log, "").unwrap();
    let o = plot(&["iops", log.to_str().unwrap()]);
    assert!(stderr(&o).contains("no samples"), "{}", stderr(&o));
    // Unknown commands and options are usage errors (exit 2).
    assert_eq!(plot(&["pie", "x"]).status.code(), Some(2));
    assert_eq!(plot(&["hist", "x", "--colour", "red"]).status.code(), Some(2));
    assert!(plot(&["--help"]).status.success());
}

/// rdmablk-bench's own json+ and iops log (its null backend on the embedded
/// target) plot like fio's: the bins count every I/O, the percentiles taken
/// from them are within one fio bin (64 per power of two: under 2 %) of the
/// ones it printed from its HDR histogram, and the log is fio's format.
#[test]
fn rdmablk_benchs_json_plus_and_iops_log_plot_like_fios() {
    let d = dir();
    let o = Command::new(env!("CARGO_BIN_EXE_rdmablk-bench"))
        .args(["--name=n", "--backend=null", "--rw=randread", "--bs=4k", "--iodepth=4", "--runtime=1", "--time_based"])
        .args(["--output-format=json+", "--write_iops_log=rb", "--log_avg_msec=100"])
        .current_dir(d.path())
        .output()
        .expect("running rdmablk-bench");
    assert!(o.status.success(), "rdmablk-bench: {}", stderr(&o));
    let text = String::from_utf8(o.stdout).unwrap();
    let doc = fio_json(&text);
    let lat = &doc["jobs"][0]["read"]["clat_ns"];
    let bins = merge_bins(&json_plus_bins(&text).expect("rdmablk-bench's json+ has bins"), "read");
    assert_eq!(bins.iter().map(|b| b.1).sum::<u64>(), lat["N"].as_u64().unwrap());
    let ours = bin_percentiles(&bins, &MARKED_PERCENTILES).unwrap();
    for (p, v) in MARKED_PERCENTILES.iter().zip(ours) {
        let printed = lat["percentile"][format!("{p:.6}")].as_u64().unwrap() as f64;
        assert!((v as f64 - printed).abs() <= printed * 0.02, "p{p}: {v} ns from the bins, {printed} ns printed");
    }
    let json = d.path().join("rb.json");
    std::fs::write(&json, &text).unwrap();
    let log = d.path().join("rb_iops.1.log");
    for (args, what) in [(["hist", json.to_str().unwrap()], "percentile"), (["iops", log.to_str().unwrap()], "series")] {
        let o = plot(&args);
        assert!(o.status.success(), "rdmablk-plot {args:?}: {}", stderr(&o));
        with_svg(&String::from_utf8(o.stdout).unwrap(), |doc| assert!(!with_class(doc, what).is_empty(), "no {what} in {args:?}"));
    }
}

/// `rdmablk-bench --plot=PREFIX` draws the run itself: a histogram per
/// direction that did I/O, with the run's own percentiles marked, and one
/// IOPS line per direction over the run's time, with nothing drawn for a
/// direction without I/O.
#[test]
fn rdmablk_bench_plot_draws_the_runs_histograms_and_iops_over_time() {
    let d = dir();
    let prefix = d.path().join("run");
    let o = Command::new(env!("CARGO_BIN_EXE_rdmablk-bench"))
        .args(["--name=m", "--backend=null", "--rw=randrw", "--rwmixread=70", "--bs=4k", "--iodepth=4"])
        .args(["--runtime=2", "--time_based", "--output-format=json"])
        .arg(format!("--plot={}", prefix.display()))
        .output()
        .expect("running rdmablk-bench");
    assert!(o.status.success(), "rdmablk-bench: {}", stderr(&o));
    let err = stderr(&o);
    for name in ["run_clat_read.svg", "run_clat_write.svg", "run_iops.svg"] {
        assert!(err.contains(&d.path().join(name).display().to_string()), "no 'wrote {name}' in: {err}");
        let svg = std::fs::read_to_string(d.path().join(name)).unwrap_or_else(|e| panic!("{name}: {e}"));
        with_svg(&svg, |doc| {
            if name.contains("clat") {
                assert!(!with_class(doc, "bar").is_empty(), "{name}: no bars");
                assert_eq!(with_class(doc, "percentile").len(), MARKED_PERCENTILES.len(), "{name}: percentiles");
            } else {
                let lines = with_class(doc, "series");
                assert_eq!(lines.len(), 2, "one line per direction");
                // About 2 s at one point per 100 ms, every point's time within the run.
                for l in lines {
                    let pts: Vec<(f64, f64)> = l
                        .attribute("points")
                        .unwrap()
                        .split(' ')
                        .map(|p| p.split_once(',').map(|(x, y)| (x.parse().unwrap(), y.parse().unwrap())).unwrap())
                        .collect();
                    assert!((15..=40).contains(&pts.len()), "{} points", pts.len());
                }
                let t = texts(doc).join("|");
                assert!(t.contains("read") && t.contains("write"), "legend: {t}");
            }
        });
    }

    // A read-only run has no write histogram and one IOPS line.
    let prefix = d.path().join("ro");
    let o = Command::new(env!("CARGO_BIN_EXE_rdmablk-bench"))
        .args(["--name=r", "--backend=null", "--rw=randread", "--bs=4k", "--runtime=1", "--time_based", "--output-format=json"])
        .arg(format!("--plot={}", prefix.display()))
        .output()
        .expect("running rdmablk-bench");
    assert!(o.status.success(), "rdmablk-bench: {}", stderr(&o));
    assert!(d.path().join("ro_clat_read.svg").exists());
    assert!(!d.path().join("ro_clat_write.svg").exists(), "a write histogram of no writes");
    with_svg(&std::fs::read_to_string(d.path().join("ro_iops.svg")).unwrap(), |doc| {
        assert_eq!(with_class(doc, "series").len(), 1)
    });
}
