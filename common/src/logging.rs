//! The logging setup every rdmablk binary shares (`rdmablk-target`,
//! `rdmablk`, `rdmablk-bench`, `tcp-ceiling`): one filter variable, colour
//! only on a terminal, text or JSON lines, and journald priorities under
//! systemd.
//!
//! - **Filter:** `RUST_LOG` (an `EnvFilter`: `debug`,
//!   `info,rdmablk_target::v1=debug`); `RDMABLK_LOG` is read when `RUST_LOG`
//!   is unset or empty. When both are set, `RUST_LOG` wins and a debug line
//!   of target `rdmablk::logging` says so. A filter that does not parse is
//!   reported as a warning naming the variable, and the binary's default is
//!   used instead.
//! - **Colour:** only when standard error is a terminal, `NO_COLOR` is unset
//!   or empty (<https://no-color.org>) and the output is not the journal.
//! - **Format:** `text` (time, level, target, `message: key=value ...`) or
//!   `json` (one object per line; every field of the event and of the spans
//!   it is in is a top-level key, so `host`, `session`, `peer`, `volume` and
//!   `queue` are fields of their own). The binaries take `--log-format`;
//!   without it `RDMABLK_LOG_FORMAT` (`text` or `json`) decides.
//! - **journald:** when `JOURNAL_STREAM` names standard error (its
//!   `device:inode`, as systemd sets it for a service whose output goes to
//!   the journal), each line starts with the sd-daemon priority prefix
//!   (`<3>` error, `<4>` warning, `<6>` info, `<7>` debug and trace), which
//!   journald turns into the entry's priority (`journalctl -p warning`), and
//!   text lines carry no time (the journal has it).
//!
//! Compiled with the `logging` feature, so the fuzzers and the library's
//! other users do not build tracing-subscriber, its regex filter and its
//! JSON support.

use std::fmt;
use std::io::IsTerminal;
use std::os::fd::AsFd;
use std::os::unix::fs::MetadataExt;

use tracing::field::{Field, Visit};
use tracing::{Event, Level, Subscriber};
use tracing_subscriber::field::RecordFields;
use tracing_subscriber::fmt::format::{Format, Full, JsonFields, Writer};
use tracing_subscriber::fmt::time::{FormatTime, SystemTime};
use tracing_subscriber::fmt::{FmtContext, FormatEvent, FormatFields, FormattedFields};
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::EnvFilter;

/// The filter variable.
pub const FILTER_VAR: &str = "RUST_LOG";
/// Read when [`FILTER_VAR`] is unset or empty.
pub const FILTER_ALIAS_VAR: &str = "RDMABLK_LOG";
/// The format when the command line gives none: `text` or `json`.
pub const FORMAT_VAR: &str = "RDMABLK_LOG_FORMAT";
/// The target of the setup's own lines (a bad filter, both variables set).
pub const LOG_TARGET: &str = "rdmablk::logging";

/// How log lines look.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum LogFormat {
    /// One readable line per event
    #[default]
    Text,
    /// One JSON object per line, every field a top-level key
    Json,
}

impl std::str::FromStr for LogFormat {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim().to_ascii_lowercase().as_str() {
            "text" => Ok(LogFormat::Text),
            "json" => Ok(LogFormat::Json),
            _ => Err(format!("unknown log format {s:?} (text or json)")),
        }
    }
}

/// Where the filter came from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FilterSource {
    /// The variable named.
    Env(&'static str),
    /// The binary's default.
    Default,
}

/// The filter [`resolve_filter`] chose, and what the setup logs about it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ResolvedFilter {
    /// The directives to use.
    pub directives: String,
    pub source: FilterSource,
    /// A warning to log (a filter that did not parse).
    pub warning: Option<String>,
    /// A debug line to log (both variables set).
    pub note: Option<String>,
}

/// Chooses the filter from the values of `RUST_LOG` and `RDMABLK_LOG`
/// (`None` when unset; empty counts as unset) and the binary's default.
pub fn resolve_filter(rust_log: Option<&str>, alias: Option<&str>, default: &str) -> ResolvedFilter {
    let rust_log = rust_log.filter(|v| !v.trim().is_empty());
    let alias = alias.filter(|v| !v.trim().is_empty());
    let (var, value) = match (rust_log, alias) {
        (Some(v), _) => (FILTER_VAR, v),
        (None, Some(v)) => (FILTER_ALIAS_VAR, v),
        (None, None) => {
            return ResolvedFilter { directives: default.to_owned(), source: FilterSource::Default, warning: None, note: None }
        }
    };
    let note = match (rust_log, alias) {
        (Some(r), Some(a)) => Some(format!("{FILTER_VAR}={r:?} and {FILTER_ALIAS_VAR}={a:?} are both set; {FILTER_VAR} is used")),
        _ => None,
    };
    match EnvFilter::builder().parse(value) {
        Ok(_) => ResolvedFilter { directives: value.to_owned(), source: FilterSource::Env(var), warning: None, note },
        Err(e) => ResolvedFilter {
            directives: default.to_owned(),
            source: FilterSource::Default,
            warning: Some(format!("{var}={value:?} is not a valid log filter ({e}); logging with the default, {default:?}")),
            note,
        },
    }
}

/// Whether `journal_stream`, the value of `JOURNAL_STREAM` (`DEV:INODE`, in
/// decimal), names the file whose device and inode are `dev` and `ino`.
pub fn journal_stream_names(journal_stream: &str, dev: u64, ino: u64) -> bool {
    let Some((d, i)) = journal_stream.trim().split_once(':') else { return false };
    d.parse::<u64>() == Ok(dev) && i.parse::<u64>() == Ok(ino)
}

/// Whether standard error is the journal's stream: systemd sets
/// `JOURNAL_STREAM` for a service's output, and it is inherited by children
/// whose standard error may be elsewhere, so the device and inode must match
/// standard error's (sd_journal_stream_fd(3), systemd.exec(5)).
pub fn stderr_is_journal() -> bool {
    let Ok(value) = std::env::var("JOURNAL_STREAM") else { return false };
    // A duplicate of fd 2, only to fstat it.
    let Ok(fd) = std::io::stderr().as_fd().try_clone_to_owned() else { return false };
    match std::fs::File::from(fd).metadata() {
        Ok(m) => journal_stream_names(&value, m.dev(), m.ino()),
        Err(_) => false,
    }
}

/// The sd-daemon priority prefix of `level` (sd-daemon(3)).
pub fn journal_prefix(level: &Level) -> &'static str {
    match *level {
        Level::ERROR => "<3>",
        Level::WARN => "<4>",
        Level::INFO => "<6>",
        _ => "<7>",
    }
}

/// How one binary logs; [`Logging::init`] installs it.
#[derive(Clone, Debug)]
pub struct Logging<'a> {
    program: &'a str,
    default_filter: &'a str,
    format: Option<LogFormat>,
    terse_default: bool,
}

/// What [`Logging::init`] set up.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Installed {
    pub filter: ResolvedFilter,
    pub format: LogFormat,
    pub journal: bool,
    pub ansi: bool,
}

impl<'a> Logging<'a> {
    /// `program` names the binary (in the terse lines); `default_filter`
    /// applies when neither `RUST_LOG` nor `RDMABLK_LOG` is set.
    pub fn new(program: &'a str, default_filter: &'a str) -> Self {
        Logging { program, default_filter, format: None, terse_default: false }
    }

    /// The format the command line asked for; `None` leaves it to
    /// `RDMABLK_LOG_FORMAT` (default text).
    pub fn format(mut self, format: Option<LogFormat>) -> Self {
        self.format = format;
        self
    }

    /// With the default filter, text lines are only `PROGRAM: message` (a
    /// command-line tool that prints a few lines of its own, like its error
    /// line); a filter from the environment gets the full lines.
    pub fn terse_default(mut self, terse: bool) -> Self {
        self.terse_default = terse;
        self
    }

    /// Installs the global subscriber (once per process; later calls
    /// change nothing) and logs what the environment got wrong.
    pub fn init(self) -> Installed {
        let filter = resolve_filter(
            std::env::var(FILTER_VAR).ok().as_deref(),
            std::env::var(FILTER_ALIAS_VAR).ok().as_deref(),
            self.default_filter,
        );
        let mut format_warning = None;
        let format = self.format.unwrap_or_else(|| match std::env::var(FORMAT_VAR) {
            Ok(v) if !v.trim().is_empty() => v.parse().unwrap_or_else(|e| {
                format_warning = Some(format!("{FORMAT_VAR}: {e}; logging text"));
                LogFormat::Text
            }),
            _ => LogFormat::Text,
        });
        let journal = stderr_is_journal();
        let no_color = std::env::var_os("NO_COLOR").is_some_and(|v| !v.is_empty());
        let ansi = !journal && !no_color && format == LogFormat::Text && std::io::stderr().is_terminal();
        let mut env_filter = EnvFilter::builder().parse_lossy(&filter.directives);
        if filter.warning.is_some() || format_warning.is_some() {
            // The warning about the environment shows whatever the default filter is.
            env_filter = env_filter.add_directive(format!("{LOG_TARGET}=warn").parse().expect("a valid directive"));
        }
        let terse = self.terse_default && filter.source == FilterSource::Default;
        let program = self.program.to_owned();
        let builder = tracing_subscriber::fmt().with_env_filter(env_filter).with_writer(std::io::stderr).with_ansi(ansi);
        let _ = match format {
            LogFormat::Text => {
                let line = if terse {
                    TextLine::Terse(program)
                } else if journal {
                    TextLine::Untimed(Format::default().without_time())
                } else {
                    TextLine::Timed(Format::default())
                };
                builder.fmt_fields(TextFields).event_format(EventFormat { line, journal }).try_init()
            }
            LogFormat::Json => builder.fmt_fields(JsonFields::new()).event_format(JsonLine { journal }).try_init(),
        };
        for warning in filter.warning.iter().chain(&format_warning) {
            tracing::warn!(target: LOG_TARGET, "{warning}");
        }
        if let Some(note) = &filter.note {
            tracing::debug!(target: LOG_TARGET, "{note}");
        }
        Installed { filter, format, journal, ansi }
    }
}

/// The text line's layout.
enum TextLine {
    Timed(Format<Full, SystemTime>),
    Untimed(Format<Full, ()>),
    Terse(String),
}

/// A text line, with the journal's priority prefix when it goes there.
struct EventFormat {
    line: TextLine,
    journal: bool,
}

impl<S, N> FormatEvent<S, N> for EventFormat
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
{
    fn format_event(&self, ctx: &FmtContext<'_, S, N>, mut writer: Writer<'_>, event: &Event<'_>) -> fmt::Result {
        if self.journal {
            writer.write_str(journal_prefix(event.metadata().level()))?;
        }
        match &self.line {
            TextLine::Timed(f) => f.format_event(ctx, writer, event),
            TextLine::Untimed(f) => f.format_event(ctx, writer, event),
            TextLine::Terse(program) => {
                write!(writer, "{program}: ")?;
                ctx.field_format().format_fields(writer.by_ref(), event)?;
                writeln!(writer)
            }
        }
    }
}

/// Text fields: `message: key=value key=value`, so that a line reads as a
/// sentence followed by its particulars. Control characters in the values
/// (a peer's host name may carry any) are escaped, so a log line cannot
/// drive a terminal or split itself in the journal.
struct TextFields;

impl<'w> FormatFields<'w> for TextFields {
    fn format_fields<R: RecordFields>(&self, mut writer: Writer<'w>, fields: R) -> fmt::Result {
        let mut v = TextVisitor::default();
        fields.record(&mut v);
        let mut sep = "";
        if let Some(m) = &v.message {
            write_escaped(&mut writer, m)?;
            sep = ": ";
        }
        for (name, value) in &v.fields {
            write!(writer, "{sep}{name}=")?;
            write_escaped(&mut writer, value)?;
            sep = " ";
        }
        Ok(())
    }
}

fn write_escaped(w: &mut Writer<'_>, s: &str) -> fmt::Result {
    if !s.chars().any(|c| c.is_control()) {
        return w.write_str(s);
    }
    for c in s.chars() {
        if c.is_control() {
            write!(w, "{}", c.escape_default())?;
        } else {
            w.write_char(c)?;
        }
    }
    Ok(())
}

#[derive(Default)]
struct TextVisitor {
    message: Option<String>,
    fields: Vec<(&'static str, String)>,
}

impl Visit for TextVisitor {
    fn record_str(&mut self, field: &Field, value: &str) {
        if field.name() == "message" {
            self.message = Some(value.to_owned());
        } else {
            self.record_debug(field, &value);
        }
    }

    fn record_error(&mut self, field: &Field, value: &(dyn std::error::Error + 'static)) {
        self.record_debug(field, &format_args!("{value}"));
    }

    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        let name = field.name();
        if name == "message" {
            self.message = Some(format!("{value:?}"));
        } else if !name.starts_with("log.") {
            self.fields.push((name.strip_prefix("r#").unwrap_or(name), format!("{value:?}")));
        }
    }
}

/// A JSON line: `timestamp`, `level`, `target`, `message`, then every field
/// of the event and of its spans (innermost first; the event's own win) as
/// top-level keys, and `spans`, the span names from the root.
struct JsonLine {
    journal: bool,
}

impl<S> FormatEvent<S, JsonFields> for JsonLine
where
    S: Subscriber + for<'a> LookupSpan<'a>,
{
    fn format_event(&self, ctx: &FmtContext<'_, S, JsonFields>, mut writer: Writer<'_>, event: &Event<'_>) -> fmt::Result {
        let meta = event.metadata();
        let mut time = String::new();
        SystemTime.format_time(&mut Writer::new(&mut time))?;
        let mut line = JsonObject::default();
        line.put("timestamp", time.into());
        line.put("level", meta.level().as_str().into());
        line.put("target", meta.target().into());
        let mut v = JsonVisitor(serde_json::Map::new());
        event.record(&mut v);
        if let Some(m) = v.0.remove("message") {
            line.put("message", m);
        }
        for (k, value) in v.0 {
            line.put(&k, value);
        }
        let mut names = Vec::new();
        if let Some(scope) = ctx.event_scope() {
            for span in scope {
                names.push(serde_json::Value::from(span.name()));
                let ext = span.extensions();
                let Some(fields) = ext.get::<FormattedFields<JsonFields>>() else { continue };
                if let Ok(serde_json::Value::Object(map)) = serde_json::from_str::<serde_json::Value>(fields) {
                    for (k, value) in map {
                        line.put(&k, value);
                    }
                }
            }
        }
        if !names.is_empty() {
            names.reverse();
            line.put("spans", serde_json::Value::Array(names));
        }
        if self.journal {
            writer.write_str(journal_prefix(meta.level()))?;
        }
        writeln!(writer, "{}", line.finish())
    }
}

/// A JSON object written in insertion order (time, level, target and message
/// first, for people reading it), the first value of a key kept.
#[derive(Default)]
struct JsonObject {
    text: String,
    keys: Vec<String>,
}

impl JsonObject {
    fn put(&mut self, key: &str, value: serde_json::Value) {
        if self.keys.iter().any(|k| k == key) {
            return;
        }
        self.text.push(if self.keys.is_empty() { '{' } else { ',' });
        self.text.push_str(&serde_json::Value::from(key).to_string());
        self.text.push(':');
        self.text.push_str(&value.to_string());
        self.keys.push(key.to_owned());
    }

    fn finish(mut self) -> String {
        if self.keys.is_empty() {
            self.text.push('{');
        }
        self.text.push('}');
        self.text
    }
}

struct JsonVisitor(serde_json::Map<String, serde_json::Value>);

impl JsonVisitor {
    fn put(&mut self, field: &Field, value: serde_json::Value) {
        let name = field.name();
        if !name.starts_with("log.") {
            self.0.insert(name.strip_prefix("r#").unwrap_or(name).to_owned(), value);
        }
    }
}

impl Visit for JsonVisitor {
    fn record_i64(&mut self, field: &Field, value: i64) {
        self.put(field, value.into());
    }
    fn record_u64(&mut self, field: &Field, value: u64) {
        self.put(field, value.into());
    }
    fn record_bool(&mut self, field: &Field, value: bool) {
        self.put(field, value.into());
    }
    fn record_f64(&mut self, field: &Field, value: f64) {
        self.put(field, value.into());
    }
    fn record_str(&mut self, field: &Field, value: &str) {
        self.put(field, value.into());
    }
    fn record_error(&mut self, field: &Field, value: &(dyn std::error::Error + 'static)) {
        self.put(field, value.to_string().into());
    }
    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        self.put(field, format!("{value:?}").into());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rust_log_wins_over_the_alias_and_says_so() {
        let r = resolve_filter(Some("debug"), Some("warn"), "info");
        assert_eq!(r.directives, "debug");
        assert_eq!(r.source, FilterSource::Env(FILTER_VAR));
        assert!(r.note.as_deref().is_some_and(|n| n.contains("RUST_LOG") && n.contains("RDMABLK_LOG")), "{r:?}");
        assert_eq!(r.warning, None);
    }

    #[test]
    fn the_alias_applies_when_rust_log_is_unset_or_empty() {
        for rust_log in [None, Some(""), Some("  ")] {
            let r = resolve_filter(rust_log, Some("rdmablk_target=debug"), "info");
            assert_eq!(r.directives, "rdmablk_target=debug");
            assert_eq!(r.source, FilterSource::Env(FILTER_ALIAS_VAR));
            assert_eq!(r.note, None);
        }
        let r = resolve_filter(None, None, "warn");
        assert_eq!((r.directives.as_str(), r.source), ("warn", FilterSource::Default));
    }

    #[test]
    fn a_bad_filter_falls_back_to_the_default_with_a_warning_naming_the_variable() {
        let r = resolve_filter(None, Some("info,x=nonsense=1"), "warn");
        assert_eq!((r.directives.as_str(), r.source.clone()), ("warn", FilterSource::Default));
        let w = r.warning.expect("a warning");
        assert!(w.starts_with("RDMABLK_LOG=\"info,x=nonsense=1\" is not a valid log filter"), "{w}");
        let r = resolve_filter(Some("=["), None, "info");
        assert!(r.warning.is_some_and(|w| w.starts_with("RUST_LOG=")));
    }

    #[test]
    fn journal_stream_must_name_the_device_and_inode() {
        assert!(journal_stream_names("8:1234", 8, 1234));
        assert!(journal_stream_names("8:1234\n", 8, 1234));
        assert!(!journal_stream_names("8:1235", 8, 1234));
        assert!(!journal_stream_names("9:1234", 8, 1234));
        assert!(!journal_stream_names("8", 8, 1234));
        assert!(!journal_stream_names("", 8, 1234));
        assert!(!journal_stream_names("x:y", 8, 1234));
    }

    #[test]
    fn priorities_follow_sd_daemon() {
        let p: Vec<_> = [Level::ERROR, Level::WARN, Level::INFO, Level::DEBUG, Level::TRACE].iter().map(journal_prefix).collect();
        assert_eq!(p, ["<3>", "<4>", "<6>", "<7>", "<7>"]);
    }

    #[test]
    fn log_formats_parse() {
        assert_eq!("json".parse::<LogFormat>(), Ok(LogFormat::Json));
        assert_eq!(" Text ".parse::<LogFormat>(), Ok(LogFormat::Text));
        assert!("xml".parse::<LogFormat>().is_err());
    }
}
