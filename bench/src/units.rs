//! fio's value syntax (sizes, times, booleans) and fio's way of printing
//! numbers (`18.4k`, `71.9MiB/s (75.4MB/s)`).

use std::time::Duration;

/// Parses a size the way fio does with its default `kb_base=1024`: a number
/// with an optional suffix `k`, `m`, `g`, `t`, `p` (any case, optionally
/// followed by `i`, `b` or `ib`), all binary multiples. `4k` = `4KiB` =
/// `4KB` = 4096.
pub fn parse_size(input: &str) -> Result<u64, String> {
    let s = input.trim();
    let end = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    if end == 0 {
        return Err(format!("invalid size {input:?}: expected a number such as 4k or 1G"));
    }
    let n: u64 = s[..end].parse().map_err(|_| format!("invalid size {input:?}: number too large"))?;
    let shift = match s[end..].trim().to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "ki" | "kb" | "kib" => 10,
        "m" | "mi" | "mb" | "mib" => 20,
        "g" | "gi" | "gb" | "gib" => 30,
        "t" | "ti" | "tb" | "tib" => 40,
        "p" | "pi" | "pb" | "pib" => 50,
        other => return Err(format!("invalid size {input:?}: unknown suffix {other:?} (use k, m, g, t or p)")),
    };
    n.checked_mul(1u64 << shift).ok_or_else(|| format!("invalid size {input:?}: overflows 64 bits"))
}

/// Parses a time the way fio does: a number with an optional unit (`us`,
/// `ms`, `s`, `m`, `h`, `d`); without a unit it is in seconds.
pub fn parse_time(input: &str) -> Result<Duration, String> {
    let s = input.trim();
    let end = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    if end == 0 {
        return Err(format!("invalid time {input:?}: expected a number such as 10, 10s or 500ms"));
    }
    let n: u64 = s[..end].parse().map_err(|_| format!("invalid time {input:?}: number too large"))?;
    let d = match s[end..].trim().to_ascii_lowercase().as_str() {
        "" | "s" | "sec" | "secs" => Duration::from_secs(n),
        "us" | "usec" | "usecs" => Duration::from_micros(n),
        "ms" | "msec" | "msecs" => Duration::from_millis(n),
        "m" | "min" | "mins" => Duration::from_secs(n.saturating_mul(60)),
        "h" | "hour" | "hours" => Duration::from_secs(n.saturating_mul(3600)),
        "d" | "day" | "days" => Duration::from_secs(n.saturating_mul(86400)),
        other => return Err(format!("invalid time {input:?}: unknown unit {other:?} (use us, ms, s, m, h or d)")),
    };
    Ok(d)
}

/// Parses fio's booleans: `1`/`0`, `true`/`false`, `yes`/`no`, `on`/`off`.
pub fn parse_bool(input: &str) -> Result<bool, String> {
    match input.trim().to_ascii_lowercase().as_str() {
        "1" | "true" | "yes" | "on" => Ok(true),
        "0" | "false" | "no" | "off" => Ok(false),
        _ => Err(format!("invalid boolean {input:?}: use 1 or 0")),
    }
}

/// Parses an unsigned integer, with fio's size suffixes allowed (`iodepth=32`).
pub fn parse_u64(input: &str) -> Result<u64, String> {
    let s = input.trim();
    if let Ok(v) = s.parse::<u64>() {
        return Ok(v);
    }
    parse_size(s).map_err(|_| format!("invalid number {input:?}"))
}

/// A value scaled to at most 4 characters of digits the way fio's
/// `num2str` does: `925`, `9250`, `18.4k`, `123k`, `1.23M`.
pub fn num_short(v: f64) -> String {
    if v < 10_000.0 {
        return format!("{}", v.round() as u64);
    }
    scaled(v, 1000.0, &["", "k", "M", "G", "T", "P"])
}

fn scaled(v: f64, base: f64, units: &[&str]) -> String {
    let mut x = v;
    let mut u = 0;
    while x >= base && u + 1 < units.len() {
        x /= base;
        u += 1;
    }
    let digits = if x >= 99.95 {
        0
    } else if x >= 9.995 {
        1
    } else {
        2
    };
    // Rounding can carry into the next unit (999.96 -> "1000").
    if digits == 0 && x.round() >= base && u + 1 < units.len() {
        return format!("{:.2}{}", x / base, units[u + 1]);
    }
    format!("{x:.digits$}{}", units[u])
}

/// Bytes in binary units as fio prints them: `72.0MiB`, `512B`.
pub fn bytes_binary(v: f64) -> String {
    if v < 1024.0 {
        return format!("{}B", v.round() as u64);
    }
    scaled(v, 1024.0, &["B", "KiB", "MiB", "GiB", "TiB", "PiB"])
}

/// Bytes in decimal units as fio prints them: `75.5MB`, `512B`.
pub fn bytes_decimal(v: f64) -> String {
    if v < 1000.0 {
        return format!("{}B", v.round() as u64);
    }
    scaled(v, 1000.0, &["B", "kB", "MB", "GB", "TB", "PB"])
}

/// A bandwidth in bytes per second as fio prints it: `71.9MiB/s (75.4MB/s)`.
pub fn bw_both(bytes_per_sec: f64) -> String {
    format!("{}/s ({}/s)", bytes_binary(bytes_per_sec), bytes_decimal(bytes_per_sec))
}

/// `4096B` style, as in fio's job header line.
pub fn bytes_plain(v: u64) -> String {
    format!("{v}B")
}

/// A duration in the units [`parse_time`] reads back: `30s`, `1500ms`,
/// `250us` (the largest that is exact).
pub fn duration_short(d: Duration) -> String {
    if d.subsec_nanos() == 0 {
        format!("{}s", d.as_secs())
    } else if d.subsec_nanos() % 1_000_000 == 0 {
        format!("{}ms", d.as_millis())
    } else {
        format!("{}us", d.as_micros())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_follow_fio() {
        assert_eq!(parse_size("4k").unwrap(), 4096);
        assert_eq!(parse_size("4K").unwrap(), 4096);
        assert_eq!(parse_size("4KiB").unwrap(), 4096);
        assert_eq!(parse_size("4kb").unwrap(), 4096);
        assert_eq!(parse_size("128k").unwrap(), 128 << 10);
        assert_eq!(parse_size("1G").unwrap(), 1 << 30);
        assert_eq!(parse_size("512").unwrap(), 512);
        assert!(parse_size("x").is_err());
        assert!(parse_size("4q").is_err());
    }

    #[test]
    fn times_default_to_seconds() {
        assert_eq!(parse_time("10").unwrap(), Duration::from_secs(10));
        assert_eq!(parse_time("10s").unwrap(), Duration::from_secs(10));
        assert_eq!(parse_time("500ms").unwrap(), Duration::from_millis(500));
        assert_eq!(parse_time("2m").unwrap(), Duration::from_secs(120));
        assert_eq!(parse_time("1h").unwrap(), Duration::from_secs(3600));
        assert_eq!(parse_time("100us").unwrap(), Duration::from_micros(100));
        assert!(parse_time("5y").is_err());
        for t in ["30s", "0s", "1500ms", "250us"] {
            assert_eq!(duration_short(parse_time(t).unwrap()), t);
        }
    }

    #[test]
    fn numbers_print_like_fio() {
        assert_eq!(num_short(925.0), "925");
        assert_eq!(num_short(9250.0), "9250");
        assert_eq!(num_short(18423.0), "18.4k");
        assert_eq!(num_short(123_456.0), "123k");
        assert_eq!(num_short(1_234_567.0), "1.23M");
        assert_eq!(bytes_binary(75_497_472.0), "72.0MiB");
        assert_eq!(bytes_decimal(75_497_472.0), "75.5MB");
        assert_eq!(bw_both(75_366_400.0), "71.9MiB/s (75.4MB/s)");
        assert_eq!(bytes_binary(100.0), "100B");
    }
}
