//! Pictures of benchmark results: self-contained SVG, written by hand.
//!
//! Three charts, each a pure function from plain data to an SVG string (no
//! I/O, no plotting crate; SVG is text):
//! - [`latency_histogram_svg`]: fio's json+ latency bins on a log-scale
//!   latency axis, share of I/Os on y, p50/p99/p99.9 marked;
//! - [`time_series_svg`]: IOPS (or bandwidth, or latency) over time, one line
//!   per series;
//! - [`comparison_chart_svg`]: grouped bars, one group per case and one bar
//!   per system, each bar's ratio to its group's reference written above it.
//!
//! And the readers of what they plot, also pure: fio's json+ bins
//! ([`json_plus_bins`]), fio's `_iops`/`_bw`/`_lat` log files
//! ([`parse_fio_log`], [`log_series`]) and the results table that
//! `bench/compare.sh` writes ([`parse_compare_tsv`], [`compare_panels`]).
//! [`main_with_args`] is `rdmablk-plot`, which reads the files and writes
//! the SVG.
//!
//! Empty or malformed input is an error that says what is missing and how to
//! get it, never a blank or broken picture.

use std::collections::BTreeMap;
use std::fmt::Write as _;

/// Width and height of the histogram and time-series charts (the comparison
/// chart is as tall as its panels need). Every chart has a `viewBox`, so it
/// scales to any size.
pub const WIDTH: f64 = 800.0;
pub const HEIGHT: f64 = 450.0;

/// Tableau 10: distinct on screen and in print, and mostly apart for the
/// colour-blind. Bar and line colours cycle through it.
const PALETTE: [&str; 10] =
    ["#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1", "#ff9da7", "#9c755f", "#bab0ac"];

/// Histogram bars per decade of latency: fio's bins are finer (64 per power
/// of two above 64 ns); 20 per decade keeps bars wide enough to see.
const HIST_BARS_PER_DECADE: f64 = 20.0;

/// The percentiles marked on the histogram.
pub const MARKED_PERCENTILES: [f64; 3] = [50.0, 99.0, 99.9];

// --- SVG text ---------------------------------------------------------------------

/// Escapes text for an XML text node or a double-quoted attribute.
fn esc(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&apos;"),
            // Control characters other than tab and newline are not allowed in XML 1.0.
            c if (c as u32) < 0x20 && c != '\t' && c != '\n' => out.push(' '),
            c => out.push(c),
        }
    }
    out
}

/// An SVG document under construction.
struct Svg {
    body: String,
    width: f64,
    height: f64,
}

impl Svg {
    fn new(width: f64, height: f64) -> Svg {
        let mut s = Svg { body: String::new(), width, height };
        s.raw(&format!(r#"<rect x="0" y="0" width="{width:.0}" height="{height:.0}" fill="white"/>"#));
        s
    }

    fn raw(&mut self, element: &str) {
        self.body.push_str(element);
        self.body.push('\n');
    }

    /// Text at (x, y); `anchor` is start, middle or end; `extra` more attributes.
    fn text(&mut self, x: f64, y: f64, anchor: &str, size: f64, extra: &str, s: &str) {
        let _ = writeln!(
            self.body,
            r#"<text x="{x:.1}" y="{y:.1}" text-anchor="{anchor}" font-size="{size}"{extra}>{}</text>"#,
            esc(s)
        );
    }

    fn line(&mut self, x1: f64, y1: f64, x2: f64, y2: f64, style: &str) {
        let _ = writeln!(self.body, r#"<line x1="{x1:.1}" y1="{y1:.1}" x2="{x2:.1}" y2="{y2:.1}" {style}/>"#);
    }

    /// A rectangle with a tooltip (`<title>`), which browsers show on hover.
    fn rect(&mut self, class: &str, (x, y, w, h): (f64, f64, f64, f64), fill: &str, tooltip: &str) {
        let _ = writeln!(
            self.body,
            r#"<rect class="{class}" x="{x:.1}" y="{y:.1}" width="{w:.1}" height="{h:.1}" fill="{fill}"><title>{}</title></rect>"#,
            esc(tooltip)
        );
    }

    fn finish(self) -> String {
        format!(
            "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w:.0}\" height=\"{h:.0}\" \
             viewBox=\"0 0 {w:.0} {h:.0}\" font-family=\"DejaVu Sans, Helvetica, Arial, sans-serif\" font-size=\"12\">\n{}</svg>\n",
            self.body,
            w = self.width,
            h = self.height
        )
    }
}

// --- numbers ----------------------------------------------------------------------

/// `x` with three significant digits, trailing zeros dropped: 62.2, 0.71, 354.
fn sig3(x: f64) -> String {
    if x == 0.0 || !x.is_finite() {
        return "0".to_owned();
    }
    let decimals = (2 - x.abs().log10().floor() as i32).clamp(0, 6) as usize;
    let s = format!("{x:.decimals$}");
    if s.contains('.') {
        s.trim_end_matches('0').trim_end_matches('.').to_owned()
    } else {
        s
    }
}

/// A count or rate the way fio prints one: 2213, 16.2k, 551k, 1.2M.
pub fn compact(v: f64) -> String {
    let a = v.abs();
    if a >= 1e9 {
        format!("{}G", sig3(v / 1e9))
    } else if a >= 1e6 {
        format!("{}M", sig3(v / 1e6))
    } else if a >= 1e4 {
        format!("{}k", sig3(v / 1e3))
    } else if a >= 100.0 {
        format!("{v:.0}")
    } else {
        sig3(v)
    }
}

/// A latency in nanoseconds with its unit: 850 ns, 62.2 µs, 1.81 ms, 2 s.
pub fn latency_text(ns: f64) -> String {
    if ns < 1e3 {
        format!("{} ns", sig3(ns))
    } else if ns < 1e6 {
        format!("{} µs", sig3(ns / 1e3))
    } else if ns < 1e9 {
        format!("{} ms", sig3(ns / 1e6))
    } else {
        format!("{} s", sig3(ns / 1e9))
    }
}

/// A tick step of 1, 2 or 5 times a power of ten that cuts `range` into
/// about `target` pieces.
fn nice_step(range: f64, target: f64) -> f64 {
    let raw = (range / target).max(f64::MIN_POSITIVE);
    let magnitude = 10f64.powf(raw.log10().floor());
    let m = match raw / magnitude {
        n if n <= 1.0 => 1.0,
        n if n <= 2.0 => 2.0,
        n if n <= 5.0 => 5.0,
        _ => 10.0,
    };
    m * magnitude
}

/// A linear axis from 0: its top (a whole number of steps at or above `max`)
/// and its ticks.
fn linear_axis(max: f64) -> (f64, Vec<f64>) {
    let max = if max > 0.0 && max.is_finite() { max } else { 1.0 };
    let step = nice_step(max, 5.0);
    let top = (max / step - 1e-9).ceil().max(1.0) * step;
    let n = (top / step).round() as usize;
    (top, (0..=n).map(|i| i as f64 * step).collect())
}

/// Where the plot area sits inside the chart.
#[derive(Clone, Copy)]
struct Area {
    left: f64,
    top: f64,
    width: f64,
    height: f64,
}

impl Area {
    fn right(&self) -> f64 {
        self.left + self.width
    }
    fn bottom(&self) -> f64 {
        self.top + self.height
    }
}

/// The y axis of `area`: grid lines, tick labels and the rotated axis title.
fn y_axis(svg: &mut Svg, area: Area, top: f64, ticks: &[f64], title: &str, label: impl Fn(f64) -> String) {
    for &t in ticks {
        let y = area.bottom() - t / top * area.height;
        svg.line(area.left, y, area.right(), y, r##"stroke="#e0e0e0""##);
        svg.line(area.left - 4.0, y, area.left, y, r#"stroke="black""#);
        svg.text(area.left - 7.0, y + 4.0, "end", 11.0, "", &label(t));
    }
    svg.line(area.left, area.top, area.left, area.bottom(), r#"stroke="black""#);
    let (x, y) = (area.left - 52.0, area.top + area.height / 2.0);
    svg.text(x, y, "middle", 12.0, &format!(r#" transform="rotate(-90 {x:.1} {y:.1})""#), title);
}

/// A legend box of coloured swatches, its top right corner at (right, top).
fn legend(svg: &mut Svg, right: f64, top: f64, entries: &[(String, &str)]) {
    let width = entries.iter().map(|(l, _)| l.chars().count()).max().unwrap_or(0) as f64 * 6.6 + 34.0;
    let left = right - width;
    let _ = writeln!(
        svg.body,
        r##"<rect class="legend" x="{left:.1}" y="{top:.1}" width="{width:.1}" height="{:.1}" fill="white" stroke="#999"/>"##,
        entries.len() as f64 * 17.0 + 8.0
    );
    for (i, (label, colour)) in entries.iter().enumerate() {
        let y = top + 6.0 + i as f64 * 17.0;
        let _ = writeln!(svg.body, r#"<rect x="{:.1}" y="{y:.1}" width="14" height="11" fill="{colour}"/>"#, left + 8.0);
        svg.text(left + 28.0, y + 10.0, "start", 11.0, r#" class="legend-label""#, label);
    }
}

// --- latency histogram ------------------------------------------------------------

/// The latency (ns) at each of `percents`, from fio's bins (value, count),
/// computed as fio computes its own percentiles from the same bins: the
/// first bin, in latency order, at which the running count reaches
/// `percent / 100` of all I/Os. So on fio's json+ these equal the
/// `percentile` entries fio prints beside the bins.
pub fn bin_percentiles(bins: &[(u64, u64)], percents: &[f64]) -> Result<Vec<u64>, String> {
    let mut sorted: Vec<(u64, u64)> = bins.iter().copied().filter(|&(_, n)| n > 0).collect();
    sorted.sort_unstable();
    let total: u64 = sorted.iter().map(|&(_, n)| n).sum();
    if total == 0 {
        return Err("no I/O in the latency bins: every count is 0 (did the run do any I/O?)".to_owned());
    }
    percents
        .iter()
        .map(|&p| {
            if !(0.0..=100.0).contains(&p) {
                return Err(format!("percentile {p} is outside 0..100"));
            }
            let want = p / 100.0 * total as f64;
            let mut running = 0u64;
            for &(ns, n) in &sorted {
                running += n;
                if running as f64 >= want {
                    return Ok(ns);
                }
            }
            Ok(sorted.last().map_or(0, |&(ns, _)| ns))
        })
        .collect()
}

/// A latency histogram of one run: fio's json+ bins (`clat_ns.bins`: the
/// latency in ns that fio gives each bin, and how many I/Os fell in it) on a
/// log-scale latency axis, in bars of 1/20 decade, with the share of all
/// I/Os on y and p50, p99 and p99.9 marked.
pub fn latency_histogram_svg(title: &str, bins: &[(u64, u64)]) -> Result<String, String> {
    let total: u64 = bins.iter().map(|&(_, n)| n).sum();
    if total == 0 {
        return Err(if bins.is_empty() {
            "no latency bins to plot: run fio (or rdmablk-bench) with --output-format=json+, whose clat_ns has bins".to_owned()
        } else {
            "no I/O in the latency bins: every count is 0 (did the run do any I/O?)".to_owned()
        });
    }
    // Bars of 1/20 decade; fio's first bins can be 0 ns, drawn at 1 ns.
    let bar_of = |ns: u64| (((ns.max(1)) as f64).log10() * HIST_BARS_PER_DECADE).floor() as i64;
    let mut bars: BTreeMap<i64, u64> = BTreeMap::new();
    for &(ns, n) in bins.iter().filter(|&&(_, n)| n > 0) {
        *bars.entry(bar_of(ns)).or_default() += n;
    }
    let (first, last) = (*bars.keys().next().expect("non-empty"), *bars.keys().next_back().expect("non-empty"));
    // The x axis: whole bars, at least half a decade either side, so a
    // narrow distribution still shows where it sits.
    let lo = (first as f64 / HIST_BARS_PER_DECADE).min((first + last) as f64 / 2.0 / HIST_BARS_PER_DECADE - 0.5);
    let hi = ((last + 1) as f64 / HIST_BARS_PER_DECADE).max((first + last) as f64 / 2.0 / HIST_BARS_PER_DECADE + 0.5);

    let mut svg = Svg::new(WIDTH, HEIGHT);
    let area = Area { left: 78.0, top: 88.0, width: WIDTH - 78.0 - 24.0, height: HEIGHT - 88.0 - 58.0 };
    let x_of = |log10: f64| area.left + (log10 - lo) / (hi - lo) * area.width;
    svg.text(WIDTH / 2.0, 24.0, "middle", 15.0, r#" font-weight="bold""#, title);
    svg.text(WIDTH / 2.0, 42.0, "middle", 11.0, r##" fill="#555""##, &format!("{total} I/Os"));

    let max_share = bars.values().copied().max().unwrap_or(1) as f64 / total as f64 * 100.0;
    let (top, ticks) = linear_axis(max_share);
    y_axis(&mut svg, area, top, &ticks, "% of I/Os", |v| format!("{}%", sig3(v)));

    // Latency ticks at 1, 2 and 5 of each decade (every digit when the axis
    // spans less than a decade).
    let (d0, d1) = (lo.floor() as i32, hi.ceil() as i32);
    let mantissas: &[f64] = if hi - lo < 1.2 { &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0] } else { &[1.0, 2.0, 5.0] };
    for d in d0..=d1 {
        for &m in mantissas {
            let ns = m * 10f64.powi(d);
            let l = ns.log10();
            if l < lo - 1e-9 || l > hi + 1e-9 {
                continue;
            }
            let x = x_of(l);
            svg.line(x, area.bottom(), x, area.bottom() + 4.0, r#"stroke="black""#);
            svg.text(x, area.bottom() + 17.0, "middle", 11.0, r#" class="x-tick""#, &latency_text(ns));
        }
    }
    svg.line(area.left, area.bottom(), area.right(), area.bottom(), r#"stroke="black""#);
    svg.text(area.left + area.width / 2.0, HEIGHT - 14.0, "middle", 12.0, "", "latency (log scale)");

    for (&bar, &n) in &bars {
        let (x0, x1) = (x_of(bar as f64 / HIST_BARS_PER_DECADE), x_of((bar + 1) as f64 / HIST_BARS_PER_DECADE));
        let share = n as f64 / total as f64 * 100.0;
        let h = share / top * area.height;
        let (from, to) = (10f64.powf(bar as f64 / HIST_BARS_PER_DECADE), 10f64.powf((bar + 1) as f64 / HIST_BARS_PER_DECADE));
        let tip = format!("{} to {}: {n} I/Os ({}%)", latency_text(from), latency_text(to), sig3(share));
        svg.rect("bar", (x0 + 0.5, area.bottom() - h, (x1 - x0 - 1.0).max(0.5), h), PALETTE[0], &tip);
    }

    let marks = bin_percentiles(bins, &MARKED_PERCENTILES)?;
    for (i, (p, ns)) in MARKED_PERCENTILES.iter().zip(&marks).enumerate() {
        let x = x_of(((*ns).max(1) as f64).log10().clamp(lo, hi));
        let colour = ["#e15759", "#b07aa1", "#000000"][i % 3];
        svg.line(x, area.top - 4.0, x, area.bottom(), &format!(r#"stroke="{colour}" stroke-width="1.5" stroke-dasharray="5,3""#));
        // Labels on three rows, so that close percentiles do not overprint.
        let y = area.top - 36.0 + i as f64 * 13.0;
        let anchor = if x > area.left + area.width * 0.85 { "end" } else { "start" };
        let dx = if anchor == "end" { -3.0 } else { 3.0 };
        svg.text(
            x + dx,
            y,
            anchor,
            11.0,
            &format!(r#" class="percentile" fill="{colour}""#),
            &format!("p{} {}", sig3(*p), latency_text(*ns as f64)),
        );
    }
    Ok(svg.finish())
}

// --- time series ------------------------------------------------------------------

/// One line of a time-series chart: points (seconds, value).
#[derive(Debug, Clone, PartialEq)]
pub struct Series {
    pub label: String,
    pub points: Vec<(f64, f64)>,
}

/// Values over time (IOPS, bandwidth, latency), one line per series, a
/// legend naming them.
pub fn time_series_svg(title: &str, y_label: &str, series: &[Series]) -> Result<String, String> {
    if series.is_empty() || series.iter().all(|s| s.points.is_empty()) {
        return Err("no samples to plot: the logs are empty (fio writes them with --write_iops_log=NAME or \
                    --write_bw_log=NAME; --log_avg_msec=N averages them over N ms)"
            .to_owned());
    }
    let mut points = series.iter().flat_map(|s| s.points.iter().map(move |p| (s, p)));
    if let Some((s, (t, v))) = points.find(|(_, (t, v))| !t.is_finite() || !v.is_finite()) {
        return Err(format!("series {:?}: the point ({t}, {v}) is not a finite number", s.label));
    }
    let t_max = series.iter().flat_map(|s| &s.points).map(|p| p.0).fold(0.0, f64::max);
    let v_max = series.iter().flat_map(|s| &s.points).map(|p| p.1).fold(0.0, f64::max);
    let (x_top, x_ticks) = linear_axis(t_max);
    let (y_top, y_ticks) = linear_axis(v_max);

    let mut svg = Svg::new(WIDTH, HEIGHT);
    let area = Area { left: 78.0, top: 50.0, width: WIDTH - 78.0 - 24.0, height: HEIGHT - 50.0 - 58.0 };
    svg.text(WIDTH / 2.0, 26.0, "middle", 15.0, r#" font-weight="bold""#, title);
    y_axis(&mut svg, area, y_top, &y_ticks, y_label, compact);
    for &t in &x_ticks {
        let x = area.left + t / x_top * area.width;
        svg.line(x, area.bottom(), x, area.bottom() + 4.0, r#"stroke="black""#);
        svg.text(x, area.bottom() + 17.0, "middle", 11.0, r#" class="x-tick""#, &sig3(t));
    }
    svg.line(area.left, area.bottom(), area.right(), area.bottom(), r#"stroke="black""#);
    svg.text(area.left + area.width / 2.0, HEIGHT - 14.0, "middle", 12.0, "", "time (s)");

    let mut entries = Vec::new();
    for (i, s) in series.iter().enumerate() {
        let colour = PALETTE[i % PALETTE.len()];
        let xy = |&(t, v): &(f64, f64)| (area.left + t / x_top * area.width, area.bottom() - v / y_top * area.height);
        if s.points.len() == 1 {
            let (x, y) = xy(&s.points[0]);
            let _ = writeln!(svg.body, r#"<circle class="series" cx="{x:.1}" cy="{y:.1}" r="3" fill="{colour}"/>"#);
        } else {
            let pts: Vec<String> = s.points.iter().map(xy).map(|(x, y)| format!("{x:.1},{y:.1}")).collect();
            let _ = writeln!(
                svg.body,
                r#"<polyline class="series" fill="none" stroke="{colour}" stroke-width="1.5" points="{}"><title>{}</title></polyline>"#,
                pts.join(" "),
                esc(&s.label)
            );
        }
        entries.push((s.label.clone(), colour));
    }
    legend(&mut svg, area.right() - 6.0, area.top + 6.0, &entries);
    Ok(svg.finish())
}

// --- comparison chart -------------------------------------------------------------

/// One bar: a system's value in a case, and its ratio to the group's
/// reference (which the bar's height shows; the reference itself is 1).
#[derive(Debug, Clone, PartialEq)]
pub struct Bar {
    pub system: String,
    pub value: f64,
    pub ratio: f64,
}

/// One case: its label, a note under it (what 1.0 is), its bars.
#[derive(Debug, Clone, PartialEq)]
pub struct BarGroup {
    pub label: String,
    pub note: String,
    pub bars: Vec<Bar>,
}

/// A row of groups sharing a y axis (ratio to each group's reference).
#[derive(Debug, Clone, PartialEq)]
pub struct Panel {
    pub title: String,
    pub groups: Vec<BarGroup>,
}

const COMPARE_WIDTH: f64 = 1000.0;
const PANEL_HEIGHT: f64 = 300.0;

/// Grouped bars: one panel per kind of comparison (its own y scale, since a
/// null backend's ratios dwarf a disk's), in each one group per case and one
/// bar per system, coloured by system (the same colour in every panel),
/// its ratio written above it and its value inside it; a dashed line marks
/// 1.0, the reference; one legend names the systems.
pub fn comparison_chart_svg(title: &str, subtitle: &str, panels: &[Panel]) -> Result<String, String> {
    if panels.iter().all(|p| p.groups.iter().all(|g| g.bars.is_empty())) {
        return Err("no results to plot: the table has no rows with a value".to_owned());
    }
    if let Some(b) = panels.iter().flat_map(|p| &p.groups).flat_map(|g| &g.bars).find(|b| !(b.ratio.is_finite() && b.ratio >= 0.0)) {
        return Err(format!("bar {:?}: its ratio {} is not a finite number >= 0", b.system, b.ratio));
    }
    // Colours by system, in order of first appearance; "file" and "null"
    // variants of one stack share one colour.
    let mut systems: Vec<String> = Vec::new();
    for b in panels.iter().flat_map(|p| &p.groups).flat_map(|g| &g.bars) {
        let key = system_key(&b.system);
        if !systems.contains(&key) {
            systems.push(key);
        }
    }
    let colour_of = |system: &str| {
        let key = system_key(system);
        PALETTE[systems.iter().position(|s| *s == key).unwrap_or(0) % PALETTE.len()]
    };
    let panels: Vec<&Panel> = panels.iter().filter(|p| p.groups.iter().any(|g| !g.bars.is_empty())).collect();
    let legend_rows = systems.len().div_ceil(2);
    let legend_top = 58.0 + panels.len() as f64 * PANEL_HEIGHT + 8.0;
    let height = legend_top + legend_rows as f64 * 17.0 + 16.0;

    let mut svg = Svg::new(COMPARE_WIDTH, height);
    svg.text(COMPARE_WIDTH / 2.0, 24.0, "middle", 15.0, r#" font-weight="bold""#, title);
    svg.text(COMPARE_WIDTH / 2.0, 42.0, "middle", 11.0, r##" fill="#555""##, subtitle);
    for (pi, panel) in panels.iter().enumerate() {
        let top = 58.0 + pi as f64 * PANEL_HEIGHT + 34.0;
        let area = Area { left: 70.0, top, width: COMPARE_WIDTH - 70.0 - 16.0, height: PANEL_HEIGHT - 34.0 - 62.0 };
        svg.text(area.left, area.top - 14.0, "start", 13.0, r#" font-weight="bold" class="panel-title""#, &panel.title);
        let max_ratio = panel.groups.iter().flat_map(|g| &g.bars).map(|b| b.ratio).fold(1.0, f64::max);
        // Headroom for the ratio written above the tallest bar.
        let (top, ticks) = linear_axis(max_ratio * 1.1);
        y_axis(&mut svg, area, top, &ticks, "ratio to the reference", |v| format!("{}×", sig3(v)));
        svg.line(area.left, area.bottom(), area.right(), area.bottom(), r#"stroke="black""#);
        let y_one = area.bottom() - 1.0 / top * area.height;
        svg.line(area.left, y_one, area.right(), y_one, r##"stroke="#333" stroke-dasharray="6,4""##);

        let slots = panel.groups.iter().map(|g| g.bars.len()).max().unwrap_or(1).max(1) as f64;
        let group_width = area.width / panel.groups.len().max(1) as f64;
        let bar_width = (group_width * 0.9 / slots).min(60.0);
        for (gi, g) in panel.groups.iter().enumerate() {
            let centre = area.left + (gi as f64 + 0.5) * group_width;
            let start = centre - bar_width * g.bars.len() as f64 / 2.0;
            for (bi, b) in g.bars.iter().enumerate() {
                let x = start + bi as f64 * bar_width;
                let h = b.ratio / top * area.height;
                let y = area.bottom() - h;
                let tip = format!("{} — {}: {} ({}× the reference)", g.label, b.system, compact(b.value), sig3(b.ratio));
                svg.rect("bar", (x + 1.0, y, bar_width - 2.0, h), colour_of(&b.system), &tip);
                // Without its ×, which the axis carries: neighbours' ratios stay apart.
                svg.text(x + bar_width / 2.0, y - 3.0, "middle", 10.0, r#" class="ratio""#, &ratio_text(b.ratio));
                // The value inside the bar, upright along it, where it fits.
                let value = compact(b.value);
                if h > value.len() as f64 * 6.5 + 6.0 && bar_width >= 12.0 {
                    let (tx, ty) = (x + bar_width / 2.0 + 3.5, area.bottom() - 4.0);
                    let attributes = format!(r#" class="value" fill="white" transform="rotate(-90 {tx:.1} {ty:.1})""#);
                    svg.text(tx, ty, "start", 10.0, &attributes, &value);
                }
            }
            svg.text(centre, area.bottom() + 16.0, "middle", 12.0, r#" class="group-label""#, &g.label);
            svg.text(centre, area.bottom() + 31.0, "middle", 10.5, r##" fill="#555""##, &g.note);
        }
    }
    // The legend: two columns under the panels.
    for (i, s) in systems.iter().enumerate() {
        let (col, row) = (i % 2, i / 2);
        let x = 70.0 + col as f64 * (COMPARE_WIDTH - 70.0) / 2.0;
        let y = legend_top + row as f64 * 17.0;
        let _ = writeln!(svg.body, r#"<rect x="{x:.1}" y="{y:.1}" width="14" height="11" fill="{}"/>"#, PALETTE[i % PALETTE.len()]);
        svg.text(x + 20.0, y + 10.0, "start", 11.0, r#" class="legend-label""#, s);
    }
    Ok(svg.finish())
}

/// A ratio with two decimals (as compare.sh prints them), three significant
/// digits from 10 up.
fn ratio_text(r: f64) -> String {
    if r < 10.0 {
        format!("{r:.2}")
    } else {
        sig3(r)
    }
}

/// A system without its backend: `rdmablk-bench -> rdmablk-target, file`
/// and `..., null` are one stack, one colour.
fn system_key(system: &str) -> String {
    let s = system.trim();
    for suffix in [", file", ", null", " file", " null"] {
        if let Some(stem) = s.strip_suffix(suffix) {
            return stem.to_owned();
        }
    }
    s.to_owned()
}

// --- fio's json+ ------------------------------------------------------------------

/// Latency bins of one data direction of one job of a fio json+ report.
#[derive(Debug, Clone, PartialEq)]
pub struct JobBins {
    pub job: String,
    /// `read`, `write` or `trim`.
    pub ddir: String,
    /// `clat_ns` or `lat_ns`: which latency the bins count.
    pub latency: String,
    pub total_ios: u64,
    pub bins: Vec<(u64, u64)>,
}

/// The latency bins of every job and data direction of a fio json+ report
/// (from fio, or from rdmablk-bench): `jobs[].{read,write,trim}.clat_ns.bins`,
/// or `lat_ns.bins` where fio gave no clat bins. fio may print notes before
/// the JSON document; they are skipped. Directions without I/O are left out.
pub fn json_plus_bins(text: &str) -> Result<Vec<JobBins>, String> {
    let start = text.find('{').ok_or("not a fio JSON report: no '{' in it (run fio with --output-format=json+)")?;
    let doc: serde_json::Value = serde_json::from_str(&text[start..]).map_err(|e| {
        let skipped = text[..start].matches('\n').count();
        format!("line {}: not JSON: {e} (run fio with --output-format=json+)", e.line() + skipped)
    })?;
    let jobs = doc.get("jobs").and_then(|j| j.as_array()).ok_or("not a fio JSON report: it has no \"jobs\" array")?;
    let mut out = Vec::new();
    let mut without_bins = Vec::new();
    for (i, job) in jobs.iter().enumerate() {
        let name = job.get("jobname").and_then(|n| n.as_str()).map_or_else(|| format!("job {i}"), str::to_owned);
        for ddir in ["read", "write", "trim"] {
            let Some(d) = job.get(ddir) else { continue };
            let total_ios = d.get("total_ios").and_then(|n| n.as_u64()).unwrap_or(0);
            let found = ["clat_ns", "lat_ns"].into_iter().find_map(|lat| d.get(lat).and_then(|l| l.get("bins")).map(|b| (lat, b)));
            let Some((latency, bins)) = found else {
                if total_ios > 0 {
                    without_bins.push(format!("jobs[{i}].{ddir}"));
                }
                continue;
            };
            let obj = bins.as_object().ok_or_else(|| format!("jobs[{i}].{ddir}.{latency}.bins is not an object of latency: count"))?;
            let mut pairs = Vec::with_capacity(obj.len());
            for (k, v) in obj {
                let ns: u64 =
                    k.parse().map_err(|_| format!("jobs[{i}].{ddir}.{latency}.bins: key {k:?} is not a latency in ns"))?;
                let n = v.as_u64().ok_or_else(|| format!("jobs[{i}].{ddir}.{latency}.bins[{k:?}]: {v} is not a count"))?;
                pairs.push((ns, n));
            }
            pairs.sort_unstable();
            if pairs.iter().any(|&(_, n)| n > 0) {
                out.push(JobBins { job: name.clone(), ddir: ddir.to_owned(), latency: latency.to_owned(), total_ios, bins: pairs });
            }
        }
    }
    if out.is_empty() {
        return Err(if without_bins.is_empty() {
            "no latency bins: no job did any I/O".to_owned()
        } else {
            format!(
                "no latency bins ({} have I/O but no clat_ns.bins): this is plain JSON; \
                 run fio or rdmablk-bench with --output-format=json+",
                without_bins.join(", ")
            )
        });
    }
    Ok(out)
}

/// The bins of every job in one direction, added up (fio's bins have the same
/// edges in every job, so adding them is exact).
pub fn merge_bins(all: &[JobBins], ddir: &str) -> Vec<(u64, u64)> {
    let mut merged: BTreeMap<u64, u64> = BTreeMap::new();
    for j in all.iter().filter(|j| j.ddir == ddir) {
        for &(ns, n) in &j.bins {
            *merged.entry(ns).or_default() += n;
        }
    }
    merged.into_iter().collect()
}

// --- fio's log files --------------------------------------------------------------

/// One line of a fio log: `time_ms, value, ddir, bs[, offset[, priority]]`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LogSample {
    pub time_ms: u64,
    pub value: u64,
    /// 0 read, 1 write, 2 trim.
    pub ddir: u8,
    /// The I/O's size in a per-I/O log; 0 in a log averaged over
    /// `log_avg_msec`.
    pub bs: u64,
}

/// What a fio log holds, from its name (`NAME_iops.1.log`, `NAME_bw.1.log`,
/// `NAME_lat.1.log`, `_clat`, `_slat`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogKind {
    Iops,
    Bandwidth,
    Latency,
}

impl LogKind {
    /// The kind of log a file name says it is, if it does.
    pub fn from_file_name(name: &str) -> Option<LogKind> {
        let base = name.rsplit('/').next().unwrap_or(name);
        if base.contains("_iops.") {
            Some(LogKind::Iops)
        } else if base.contains("_bw.") {
            Some(LogKind::Bandwidth)
        } else if base.contains("_lat.") || base.contains("_clat.") || base.contains("_slat.") {
            Some(LogKind::Latency)
        } else {
            None
        }
    }

    /// The y axis title of a chart of such logs.
    pub fn y_label(self) -> &'static str {
        match self {
            LogKind::Iops => "IOPS",
            LogKind::Bandwidth => "bandwidth (KiB/s)",
            LogKind::Latency => "latency (µs)",
        }
    }
}

/// Parses a fio log file's text. Errors name the line (1-based) and say
/// what a line should look like.
pub fn parse_fio_log(text: &str) -> Result<Vec<LogSample>, String> {
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() {
            continue;
        }
        let fields: Vec<&str> = line.split(',').map(str::trim).collect();
        let bad = |what: &str| {
            format!(
                "line {}: {what} in {line:?}: a fio log line is `time_ms, value, ddir, bs[, offset[, priority]]` \
                 (text logs only: not log_compression's binary)",
                i + 1
            )
        };
        if !(4..=6).contains(&fields.len()) {
            return Err(bad(&format!("{} fields", fields.len())));
        }
        let num = |idx: usize, what: &str| {
            fields[idx].parse::<u64>().map_err(|_| bad(&format!("{what} {:?} is not a whole number", fields[idx])))
        };
        let ddir = num(2, "ddir")?;
        if ddir > 2 {
            return Err(bad(&format!("ddir {ddir} is not 0 (read), 1 (write) or 2 (trim)")));
        }
        out.push(LogSample { time_ms: num(0, "time")?, value: num(1, "value")?, ddir: ddir as u8, bs: num(3, "bs")? });
    }
    Ok(out)
}

/// The name of a data direction in fio's logs.
pub fn ddir_name(ddir: u8) -> &'static str {
    match ddir {
        0 => "read",
        1 => "write",
        _ => "trim",
    }
}

/// The points of one data direction of a log, in seconds and the chart's
/// unit. An averaged log (`log_avg_msec`; fio writes bs 0) is drawn as it
/// is. A per-I/O log (a line per I/O, with its bs) is added up into windows
/// of at least 100 ms, about 200 of them: IOPS as I/Os per second, bandwidth
/// as KiB per second, latency as the windows' mean. Latency is in µs.
pub fn log_series(samples: &[LogSample], ddir: u8, kind: LogKind) -> Vec<(f64, f64)> {
    let picked: Vec<&LogSample> = samples.iter().filter(|s| s.ddir == ddir).collect();
    let scale = if kind == LogKind::Latency { 1e-3 } else { 1.0 };
    if picked.iter().all(|s| s.bs == 0) {
        return picked.iter().map(|s| (s.time_ms as f64 / 1e3, s.value as f64 * scale)).collect();
    }
    let span = picked.iter().map(|s| s.time_ms).max().unwrap_or(0);
    let window_ms = (span / 200).max(100);
    // Window -> (I/Os, bytes, sum of values).
    let mut windows: BTreeMap<u64, (u64, u64, u64)> = BTreeMap::new();
    for s in &picked {
        let w = windows.entry(s.time_ms / window_ms).or_default();
        w.0 += 1;
        w.1 += s.bs;
        w.2 += s.value;
    }
    // The last window ends at the last sample: a rate over it counts the
    // time it covers, and one that covers less than half a window (a few
    // I/Os at the end of the run, too few to say a rate) is left out.
    let last = windows.keys().next_back().copied().unwrap_or(0);
    let covered_ms = span - last * window_ms + 1;
    if last > 0 && covered_ms < window_ms / 2 {
        windows.remove(&last);
    }
    windows
        .into_iter()
        .map(|(w, (ios, bytes, sum))| {
            let width_ms = if w == last { covered_ms.min(window_ms) } else { window_ms };
            let secs = width_ms as f64 / 1e3;
            let t = (w * window_ms) as f64 / 1e3 + secs / 2.0;
            let v = match kind {
                LogKind::Iops => ios as f64 / secs,
                LogKind::Bandwidth => bytes as f64 / 1024.0 / secs,
                LogKind::Latency => sum as f64 / ios as f64 * scale,
            };
            (t, v)
        })
        .collect()
}

// --- compare.sh's results table ---------------------------------------------------

/// The columns of the results table compare.sh writes, tab-separated, after
/// `#` comment lines (the first says which run it is). `ratio_metric` is
/// `iops` or `bw_mib`: what the row's ratios compare. A missing value is `-`.
pub const COMPARE_COLUMNS: [&str; 9] = ["case", "system", "ratio_metric", "iops", "bw_mib", "p50_us", "p99_us", "vs_ceiling", "vs_peer"];

/// One row of compare.sh's table: a system in a case.
#[derive(Debug, Clone, PartialEq)]
pub struct CompareRow {
    pub case: String,
    pub system: String,
    /// `iops` or `bw_mib`.
    pub ratio_metric: String,
    pub iops: Option<f64>,
    pub bw_mib: Option<f64>,
    pub p50_us: Option<f64>,
    pub p99_us: Option<f64>,
    pub vs_ceiling: Option<f64>,
    pub vs_peer: Option<f64>,
}

impl CompareRow {
    /// The value its ratios compare.
    pub fn metric_value(&self) -> Option<f64> {
        if self.ratio_metric == "bw_mib" {
            self.bw_mib
        } else {
            self.iops
        }
    }
}

/// The table's comment lines (without `#`) and rows. Errors name the line.
pub fn parse_compare_tsv(text: &str) -> Result<(Vec<String>, Vec<CompareRow>), String> {
    let mut comments = Vec::new();
    let mut rows = Vec::new();
    let mut header_seen = false;
    for (i, line) in text.lines().enumerate() {
        let n = i + 1;
        if let Some(c) = line.strip_prefix('#') {
            comments.push(c.trim().to_owned());
            continue;
        }
        if line.trim().is_empty() {
            continue;
        }
        let fields: Vec<&str> = line.split('\t').map(str::trim).collect();
        if !header_seen {
            if fields != COMPARE_COLUMNS {
                return Err(format!(
                    "line {n}: expected the header `{}` (tab-separated), found {line:?}: is this compare.sh's results table?",
                    COMPARE_COLUMNS.join("\\t")
                ));
            }
            header_seen = true;
            continue;
        }
        if fields.len() != COMPARE_COLUMNS.len() {
            return Err(format!("line {n}: {} tab-separated fields, expected {}", fields.len(), COMPARE_COLUMNS.len()));
        }
        let num = |idx: usize| -> Result<Option<f64>, String> {
            match fields[idx] {
                "-" | "" => Ok(None),
                s => s
                    .parse::<f64>()
                    .ok()
                    .filter(|v| v.is_finite())
                    .map(Some)
                    .ok_or_else(|| format!("line {n}: {} {s:?} is not a number (write - when there is none)", COMPARE_COLUMNS[idx])),
            }
        };
        let ratio_metric = fields[2].to_owned();
        if ratio_metric != "iops" && ratio_metric != "bw_mib" {
            return Err(format!("line {n}: ratio_metric {ratio_metric:?} is neither iops nor bw_mib"));
        }
        rows.push(CompareRow {
            case: fields[0].to_owned(),
            system: fields[1].to_owned(),
            ratio_metric,
            iops: num(3)?,
            bw_mib: num(4)?,
            p50_us: num(5)?,
            p99_us: num(6)?,
            vs_ceiling: num(7)?,
            vs_peer: num(8)?,
        });
    }
    if !header_seen {
        return Err(format!("no header line `{}`: the table is empty", COMPARE_COLUMNS.join("\\t")));
    }
    if rows.is_empty() {
        return Err("the table has a header but no rows: did the run measure anything?".to_owned());
    }
    Ok((comments, rows))
}

/// The panels of compare.sh's chart: the file rows (each case's bars over
/// local fio, the disk's ceiling, or over nbdkit file where there is no
/// local row, as with `--only nbd`) and the null rows (over nbdkit null).
/// A case's reference is its row whose system ends in `(ceiling)`, else the
/// first nbdkit row, else its first row. Rows without a value (a failed
/// run) get no bar.
pub fn compare_panels(rows: &[CompareRow]) -> Result<Vec<Panel>, String> {
    let mut panels = Vec::new();
    for (kind, is_null) in [("file", false), ("null", true)] {
        let mut cases: Vec<&str> = Vec::new();
        for r in rows.iter().filter(|r| r.system.contains("null") == is_null) {
            if !cases.contains(&r.case.as_str()) {
                cases.push(&r.case);
            }
        }
        let mut groups = Vec::new();
        let mut references: Vec<String> = Vec::new();
        for case in cases {
            let in_case: Vec<&CompareRow> =
                rows.iter().filter(|r| r.case == case && r.system.contains("null") == is_null && r.metric_value().is_some()).collect();
            let reference = in_case
                .iter()
                .find(|r| r.system.ends_with("(ceiling)"))
                .or_else(|| in_case.iter().find(|r| r.system.contains("nbdkit")))
                .or_else(|| in_case.first());
            let Some(reference) = reference else { continue };
            let base = reference.metric_value().unwrap_or(0.0);
            if base <= 0.0 {
                return Err(format!("{case}: the reference row {:?} has value 0, so no ratio can be taken to it", reference.system));
            }
            let unit = if reference.ratio_metric == "bw_mib" { "MiB/s" } else { "IOPS" };
            references.push(reference.system.clone());
            groups.push(BarGroup {
                label: case.to_owned(),
                note: format!("1.00× = {} {unit}", compact(base)),
                bars: in_case
                    .iter()
                    .map(|r| {
                        let value = r.metric_value().unwrap_or(0.0);
                        Bar { system: r.system.clone(), value, ratio: value / base }
                    })
                    .collect(),
            });
        }
        if groups.is_empty() {
            continue;
        }
        references.dedup();
        let over = if references.len() == 1 { references[0].clone() } else { "each case's reference".to_owned() };
        panels.push(Panel { title: format!("{kind} rows: each bar over {over} (1.00×)"), groups });
    }
    if panels.is_empty() {
        return Err("no row of the table has a value: every run failed".to_owned());
    }
    Ok(panels)
}

// --- rdmablk-plot -----------------------------------------------------------------

/// `rdmablk-plot --help`.
pub fn usage() -> &'static str {
    "usage: rdmablk-plot hist RESULT.json [--ddir read|write|trim] [--title T] [-o OUT.svg]
       rdmablk-plot iops LOG... [--title T] [-o OUT.svg]
       rdmablk-plot compare TABLE [--title T] [-o OUT.svg]

  hist     latency histogram of a fio json+ report (fio or rdmablk-bench with
           --output-format=json+): clat_ns.bins of every job added up, in the
           direction with the most I/Os unless --ddir says; p50/p99/p99.9 marked
  iops     values over time from fio logs (--write_iops_log=NAME gives
           NAME_iops.N.log; also _bw and _lat/_clat/_slat logs, one kind per
           chart): one line per file and direction; per-I/O logs are added up
           into windows, logs averaged with --log_avg_msec are drawn as they are
  compare  the chart of bench/compare.sh's results table (its --results file):
           one group of bars per case, one bar per system, each bar's ratio to
           the case's reference (local fio; nbdkit null on null rows)

  -o OUT.svg   where to write the SVG (default: standard output)
  --title T    the chart's title
"
}

/// Runs `rdmablk-plot` (arguments without the program name); returns the
/// exit code: 0 written, 1 bad input, 2 bad arguments.
pub fn main_with_args(args: &[String]) -> i32 {
    match cli(args) {
        Ok(()) => 0,
        Err(CliError::Usage(e)) => {
            eprintln!("rdmablk-plot: {e}\n{}", usage());
            2
        }
        Err(CliError::Input(e)) => {
            eprintln!("rdmablk-plot: {e}");
            1
        }
    }
}

enum CliError {
    Usage(String),
    Input(String),
}

fn cli(args: &[String]) -> Result<(), CliError> {
    let usage_err = |s: String| CliError::Usage(s);
    let Some(command) = args.first() else { return Err(usage_err("no command: say hist, iops or compare".into())) };
    if command == "-h" || command == "--help" {
        print!("{}", usage());
        return Ok(());
    }
    let mut files = Vec::new();
    let (mut out, mut title, mut ddir) = (None, None, None);
    let mut it = args[1..].iter();
    while let Some(a) = it.next() {
        let mut value = |name: &str| it.next().cloned().ok_or_else(|| usage_err(format!("{name} needs a value")));
        match a.as_str() {
            "-o" | "--output" => out = Some(value(a)?),
            "--title" => title = Some(value(a)?),
            "--ddir" => ddir = Some(value(a)?),
            "-h" | "--help" => {
                print!("{}", usage());
                return Ok(());
            }
            s if s.starts_with('-') && s != "-" => return Err(usage_err(format!("unknown option {s}"))),
            _ => files.push(a.clone()),
        }
    }
    let read = |path: &str| std::fs::read_to_string(path).map_err(|e| CliError::Input(format!("{path}: {e}")));
    let svg = match command.as_str() {
        "hist" => {
            let [file] = files.as_slice() else { return Err(usage_err("hist takes one fio json+ file".into())) };
            let all = json_plus_bins(&read(file)?).map_err(|e| CliError::Input(format!("{file}: {e}")))?;
            let ddir = match ddir {
                Some(d) if ["read", "write", "trim"].contains(&d.as_str()) => d,
                Some(d) => return Err(usage_err(format!("--ddir {d:?}: use read, write or trim"))),
                None => {
                    let ios = |d: &str| all.iter().filter(|j| j.ddir == d).map(|j| j.total_ios).sum::<u64>();
                    ["read", "write", "trim"].into_iter().max_by_key(|d| ios(d)).unwrap_or("read").to_owned()
                }
            };
            let bins = merge_bins(&all, &ddir);
            if bins.is_empty() {
                let have: Vec<String> = all.iter().map(|j| j.ddir.clone()).collect();
                return Err(CliError::Input(format!("{file}: no {ddir} latency bins (it has {}): pick one with --ddir", have.join(", "))));
            }
            let mut jobs: Vec<&str> = all.iter().filter(|j| j.ddir == ddir).map(|j| j.job.as_str()).collect();
            jobs.dedup();
            let latency = all.iter().find(|j| j.ddir == ddir).map_or("clat_ns", |j| j.latency.as_str());
            let what = if latency == "lat_ns" { "total latency" } else { "completion latency" };
            let title = title.unwrap_or_else(|| format!("{} {ddir}: {what}", jobs.join(", ")));
            latency_histogram_svg(&title, &bins).map_err(|e| CliError::Input(format!("{file}: {e}")))?
        }
        "iops" => {
            if files.is_empty() {
                return Err(usage_err("iops takes one or more fio log files (NAME_iops.N.log)".into()));
            }
            let mut kind = None;
            let mut series = Vec::new();
            for file in &files {
                let k = LogKind::from_file_name(file).unwrap_or(LogKind::Iops);
                match kind {
                    None => kind = Some(k),
                    Some(prev) if prev != k => {
                        return Err(CliError::Input(format!(
                            "{file}: a {} log among {} logs: plot each kind in its own chart",
                            k.y_label(),
                            prev.y_label()
                        )))
                    }
                    Some(_) => {}
                }
                let samples = parse_fio_log(&read(file)?).map_err(|e| CliError::Input(format!("{file}: {e}")))?;
                if samples.is_empty() {
                    return Err(CliError::Input(format!("{file}: no samples: the log is empty (did the job run?)")));
                }
                let mut ddirs: Vec<u8> = samples.iter().map(|s| s.ddir).collect();
                ddirs.sort_unstable();
                ddirs.dedup();
                let base = file.rsplit('/').next().unwrap_or(file);
                for d in ddirs {
                    series.push(Series { label: format!("{base} {}", ddir_name(d)), points: log_series(&samples, d, k) });
                }
            }
            let kind = kind.unwrap_or(LogKind::Iops);
            let title = title.unwrap_or_else(|| format!("{} over time", kind.y_label()));
            time_series_svg(&title, kind.y_label(), &series).map_err(CliError::Input)?
        }
        "compare" => {
            let [file] = files.as_slice() else { return Err(usage_err("compare takes one results table".into())) };
            let (comments, rows) = parse_compare_tsv(&read(file)?).map_err(|e| CliError::Input(format!("{file}: {e}")))?;
            let panels = compare_panels(&rows).map_err(|e| CliError::Input(format!("{file}: {e}")))?;
            let title = title.unwrap_or_else(|| "rdmablk against the local disk and NBD (bench/compare.sh)".to_owned());
            let subtitle = comments.first().cloned().unwrap_or_default();
            comparison_chart_svg(&title, &subtitle, &panels).map_err(|e| CliError::Input(format!("{file}: {e}")))?
        }
        other => return Err(usage_err(format!("unknown command {other:?}: say hist, iops or compare"))),
    };
    match out.as_deref() {
        None | Some("-") => {
            print!("{svg}");
            Ok(())
        }
        Some(path) => std::fs::write(path, svg).map_err(|e| CliError::Input(format!("{path}: {e}"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_read_like_fio() {
        assert_eq!(compact(16198.0), "16.2k");
        assert_eq!(compact(550986.0), "551k");
        assert_eq!(compact(2213.4), "2213");
        assert_eq!(compact(1.5e6), "1.5M");
        assert_eq!(compact(0.71), "0.71");
        assert_eq!(latency_text(62208.0), "62.2 µs");
        assert_eq!(latency_text(1810432.0), "1.81 ms");
        assert_eq!(latency_text(850.0), "850 ns");
        assert_eq!(latency_text(2e9), "2 s");
    }

    #[test]
    fn axes_end_on_a_whole_step_at_or_above_the_maximum() {
        let (top, ticks) = linear_axis(5.73);
        assert!((5.73..=8.0).contains(&top), "top {top}");
        assert_eq!(ticks.first(), Some(&0.0));
        assert_eq!(ticks.last(), Some(&top));
        let (top, _) = linear_axis(0.0);
        assert_eq!(top, 1.0);
    }

    #[test]
    fn text_is_escaped() {
        assert_eq!(esc(r#"a<b & "c" > 'd'"#), "a&lt;b &amp; &quot;c&quot; &gt; &apos;d&apos;");
    }

    #[test]
    fn percentiles_follow_fios_rule() {
        // 100 I/Os: 50 at 10 us, 49 at 20 us, 1 at 1 ms.
        let bins = [(1_000_000, 1), (10_000, 50), (20_000, 49)];
        assert_eq!(bin_percentiles(&bins, &[50.0, 99.0, 99.9, 100.0]).unwrap(), vec![10_000, 20_000, 1_000_000, 1_000_000]);
        assert!(bin_percentiles(&[(5, 0)], &[50.0]).unwrap_err().contains("every count is 0"));
    }

    #[test]
    fn system_variants_share_a_colour_key() {
        assert_eq!(system_key("rdmablk-bench -> rdmablk-target, file"), "rdmablk-bench -> rdmablk-target");
        assert_eq!(system_key("rdmablk-bench -> rdmablk-target, null"), "rdmablk-bench -> rdmablk-target");
        assert_eq!(system_key("fio nbd -> nbdkit null"), "fio nbd -> nbdkit");
        assert_eq!(system_key("fio io_uring, local file (ceiling)"), "fio io_uring, local file (ceiling)");
    }
}
