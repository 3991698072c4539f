//! Durations for people: the parsers the command line and the attach files
//! share ([`parse_duration`], [`parse_duration_or_zero`],
//! [`parse_ctrl_loss_timeout`]; the CLI re-exports them), and how log lines
//! and messages write one ([`spaced_duration`]).

use std::time::Duration;

/// Parses `30`, `30s`, `500ms`, `2m`, `1.5s`.
pub fn parse_duration(s: &str) -> std::result::Result<Duration, String> {
    let t = s.trim();
    let split = t.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let value: f64 = num.parse().map_err(|_| format!("invalid duration {s:?}: expected a number"))?;
    let secs = match unit.trim() {
        "" | "s" => value,
        "ms" => value / 1000.0,
        "m" | "min" => value * 60.0,
        "h" => value * 3600.0,
        _ => return Err(format!("invalid duration {s:?}: unknown unit (use ms, s, m or h)")),
    };
    if !secs.is_finite() || secs > 1e9 {
        return Err(format!("invalid duration {s:?}: longer than 1000000000 seconds"));
    }
    if secs <= 0.0 {
        return Err(format!("invalid duration {s:?}: must be positive"));
    }
    Ok(Duration::from_secs_f64(secs))
}

/// [`parse_duration`], and `0` for "none".
pub fn parse_duration_or_zero(s: &str) -> std::result::Result<Duration, String> {
    if s.trim().trim_end_matches(|c: char| c.is_ascii_alphabetic()).parse::<f64>() == Ok(0.0) {
        return Ok(Duration::ZERO);
    }
    parse_duration(s)
}

/// `--ctrl-loss-timeout` / `--ctrl_loss_tmo`: [`parse_duration_or_zero`],
/// so plain seconds as with nvme-cli's `--ctrl-loss-tmo`; nvme-cli's `-1`
/// (reconnect forever) is refused with a message saying so.
pub fn parse_ctrl_loss_timeout(s: &str) -> std::result::Result<Duration, String> {
    if s.trim().strip_prefix('-').is_some_and(|rest| parse_duration_or_zero(rest).is_ok()) {
        return Err(format!(
            "invalid duration {s:?}: negative; give how long to keep reconnecting (30, 30s, 2m) or 0 not to \
             reconnect (nvme-cli's -1, reconnect forever, is not supported)"
        ));
    }
    parse_duration_or_zero(s)
}

/// `60 s`, `1.5 s`, `250 ms`: a duration for a person.
pub(crate) fn spaced_duration(d: Duration) -> String {
    if d < Duration::from_secs(1) {
        format!("{} ms", d.as_millis())
    } else if d.subsec_millis() == 0 || d >= Duration::from_secs(10) {
        format!("{} s", d.as_secs_f64().round() as u64)
    } else {
        format!("{:.1} s", d.as_secs_f64())
    }
}
