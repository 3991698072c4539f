//! Logging conventions of the real binaries (issue 51, item 12;
//! rdmablk_common::logging): `RUST_LOG` with `RDMABLK_LOG` as its alias for
//! `rdmablk-target` and `rdmablk`, no ANSI escapes unless standard error is
//! a terminal, `--log-format json` with host, session, peer and queue as
//! top-level keys, and journald priority prefixes only when `JOURNAL_STREAM`
//! names standard error.
//!
//! Each daemon writes its standard error to a file of its own, so that a
//! test can name that file's device and inode in `JOURNAL_STREAM`. Whether
//! journald itself files the lines by priority is not run here (no systemd
//! as PID 1 in CI); the prefix is what sd-daemon(3) documents it parses.

use std::fs::File;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::Duration;

use rdmablk_system_tests::{bin, memory_volume, target_section, wait_until};

const ESC: u8 = 0x1b;

/// A target with one volume any host may open and one no host may (its
/// startup warning is the WARN line the journald tests look for).
fn config(dir: &Path) -> PathBuf {
    let path = dir.join("target.toml");
    let text = format!(
        "{}{}[[volume]]\nname = \"closed\"\nbackend = \"memory\"\nsize = 1048576\n",
        target_section(),
        memory_volume("vol0", 1 << 20, false)
    );
    std::fs::write(&path, text).unwrap();
    path
}

/// The real daemon, its standard error in `dir/NAME.log`, killed on drop.
struct Daemon {
    child: Child,
    log: PathBuf,
    url: String,
}

impl Daemon {
    /// Starts rdmablk-target with none of the log variables of the test's
    /// own environment, then `env`, `args`, and standard error on `log`
    /// (created first when `JOURNAL_STREAM` must name it). Waits for its
    /// listen line.
    fn start(dir: &Path, name: &str, env: &[(&str, String)], args: &[&str]) -> Daemon {
        let log = dir.join(format!("{name}.log"));
        let stderr = File::options().create(true).append(true).open(&log).unwrap();
        let mut cmd = Command::new(bin("rdmablk-target"));
        cmd.arg("--config").arg(config(dir)).args(args);
        clean_env(&mut cmd);
        for (k, v) in env {
            cmd.env(k, v);
        }
        let child = cmd.stdin(Stdio::null()).stdout(Stdio::null()).stderr(stderr).spawn().unwrap();
        let mut d = Daemon { child, log, url: String::new() };
        wait_until("the target's listen line", Duration::from_secs(20), || d.text().contains("listening on"));
        let text = d.text();
        let at = text.find("listening on ").unwrap() + "listening on ".len();
        d.url = text[at..].chars().take_while(|c| !c.is_whitespace() && *c != '"').collect();
        d
    }

    fn text(&self) -> String {
        String::from_utf8_lossy(&self.bytes()).into_owned()
    }

    fn bytes(&self) -> Vec<u8> {
        std::fs::read(&self.log).unwrap()
    }

    /// SIGTERM, waits for the exit (0), returns the whole log.
    fn stop(mut self) -> String {
        let st = Command::new("kill").arg("-TERM").arg(self.child.id().to_string()).status().unwrap();
        assert!(st.success());
        let status = self.child.wait().unwrap();
        assert_eq!(status.code(), Some(0), "{}", self.text());
        self.text()
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The log variables of whoever runs the tests do not leak in.
fn clean_env(cmd: &mut Command) {
    for var in ["RUST_LOG", "RDMABLK_LOG", "RDMABLK_LOG_FORMAT", "JOURNAL_STREAM", "NO_COLOR", "NOTIFY_SOCKET", "WATCHDOG_USEC"] {
        cmd.env_remove(var);
    }
}

/// `rdmablk` with `args`, a clean environment plus `env`, its standard
/// error piped.
fn cli(env: &[(&str, String)], args: &[&str]) -> Output {
    let mut cmd = Command::new(bin("rdmablk"));
    clean_env(&mut cmd);
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.args(args).stdin(Stdio::null()).output().unwrap();
    assert!(out.status.success(), "rdmablk {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    out
}

fn env(pairs: &[(&'static str, &str)]) -> Vec<(&'static str, String)> {
    pairs.iter().map(|(k, v)| (*k, v.to_string())).collect()
}

fn debug_lines(text: &str) -> usize {
    text.lines().filter(|l| l.contains(" DEBUG ")).count()
}

#[test]
fn rdmablk_log_is_the_filter_when_rust_log_is_unset_and_rust_log_wins_when_both_are_set() {
    let dir = tempfile::tempdir().unwrap();
    // The daemon: the alias alone turns debug on; the default is info.
    let alias = Daemon::start(dir.path(), "alias", &env(&[("RDMABLK_LOG", "debug")]), &[]);
    let plain = Daemon::start(dir.path(), "plain", &[], &[]);
    // rdmablk_target::target=info: its listen line says it is up.
    let quiet = "warn,rdmablk_target::target=info";
    let both = Daemon::start(dir.path(), "both", &env(&[("RUST_LOG", quiet), ("RDMABLK_LOG", "debug")]), &[]);
    let said = Daemon::start(dir.path(), "said", &env(&[("RUST_LOG", "debug"), ("RDMABLK_LOG", "warn")]), &[]);
    let (alias, plain, both, said) = (alias.stop(), plain.stop(), both.stop(), said.stop());
    assert!(debug_lines(&alias) > 0, "RDMABLK_LOG=debug logged no debug line:\n{alias}");
    assert_eq!(debug_lines(&plain), 0, "{plain}");
    assert!(plain.contains(" INFO "), "{plain}");
    let rest_info = both.lines().filter(|l| l.contains(" INFO ") && !l.contains(" rdmablk_target::target: ")).count();
    assert!(debug_lines(&both) == 0 && rest_info == 0 && both.contains(" WARN "), "RUST_LOG={quiet} did not win:\n{both}");
    let note = said.lines().find(|l| l.contains("rdmablk::logging")).unwrap_or_else(|| panic!("no note on both variables:\n{said}"));
    assert!(note.contains(" DEBUG ") && note.contains("RUST_LOG") && note.contains("RDMABLK_LOG") && note.contains("RUST_LOG is used"), "{note}");

    // The CLI: silent by default, debug with the alias or with RUST_LOG.
    let t = Daemon::start(dir.path(), "cli", &[], &[]);
    let list = ["--target", t.url.as_str(), "list"];
    let quiet = cli(&[], &list);
    assert!(quiet.stderr.is_empty(), "{}", String::from_utf8_lossy(&quiet.stderr));
    for var in ["RDMABLK_LOG", "RUST_LOG"] {
        let out = cli(&env(&[(var, "debug")]), &list);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(debug_lines(&err) > 0, "{var}=debug: {err}");
    }
    let out = cli(&env(&[("RUST_LOG", "error"), ("RDMABLK_LOG", "debug")]), &list);
    assert!(out.stderr.is_empty(), "RUST_LOG=error did not win: {}", String::from_utf8_lossy(&out.stderr));
}

#[test]
fn a_bad_filter_is_named_in_a_warning_and_the_default_applies() {
    let dir = tempfile::tempdir().unwrap();
    let d = Daemon::start(dir.path(), "bad", &env(&[("RDMABLK_LOG", "info,rdmablk_target=loud")]), &[]);
    let log = d.stop();
    let w = log.lines().find(|l| l.contains("not a valid log filter")).unwrap_or_else(|| panic!("no warning:\n{log}"));
    assert!(w.contains(" WARN ") && w.contains("RDMABLK_LOG=\"info,rdmablk_target=loud\""), "{w}");
    assert!(log.contains(" INFO ") && debug_lines(&log) == 0, "the default (info) did not apply:\n{log}");
    // The CLI says it too, on its one-line form, with RUST_LOG named.
    let t = Daemon::start(dir.path(), "t", &[], &[]);
    let out = cli(&env(&[("RUST_LOG", "=nonsense=")]), &["--target", t.url.as_str(), "list"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.starts_with("rdmablk: RUST_LOG=\"=nonsense=\" is not a valid log filter"), "{err}");
    assert_eq!(err.lines().count(), 1, "{err}");
}

#[test]
fn no_escape_codes_unless_standard_error_is_a_terminal() {
    let dir = tempfile::tempdir().unwrap();
    let d = Daemon::start(dir.path(), "piped", &env(&[("RUST_LOG", "debug")]), &[]);
    let out = cli(&env(&[("RUST_LOG", "debug")]), &["--target", d.url.as_str(), "list"]);
    let log = d.stop();
    assert!(debug_lines(&log) > 0);
    assert!(!log.as_bytes().contains(&ESC), "ESC in the daemon's log written to a file:\n{log:?}");
    assert!(!out.stderr.is_empty() && !out.stderr.contains(&ESC), "ESC in the CLI's piped stderr: {:?}", String::from_utf8_lossy(&out.stderr));

    // On a terminal (script(1) gives the CLI one) the colours are there,
    // unless NO_COLOR says otherwise: the check above can fail.
    if Command::new("script").arg("--version").output().is_err() {
        eprintln!("script(1) not installed: the terminal half is skipped");
        return;
    }
    let t = Daemon::start(dir.path(), "tty", &[], &[]);
    let on_tty = |no_color: bool| {
        let line = format!("{} --target {} list", bin("rdmablk").display(), t.url);
        let mut cmd = Command::new("script");
        clean_env(&mut cmd);
        cmd.env("RUST_LOG", "debug").env("TERM", "xterm");
        if no_color {
            cmd.env("NO_COLOR", "1");
        }
        let out = cmd.args(["-qec", &line, "/dev/null"]).stdin(Stdio::null()).output().unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stdout));
        out.stdout
    };
    let coloured = on_tty(false);
    assert!(coloured.contains(&ESC), "no colour on a terminal: {:?}", String::from_utf8_lossy(&coloured));
    let plain = on_tty(true);
    assert!(plain.windows(5).any(|w| w == b"DEBUG") && !plain.contains(&ESC), "NO_COLOR: {:?}", String::from_utf8_lossy(&plain));
}

fn json_lines(text: &str) -> Vec<serde_json::Value> {
    text.lines().map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}"))).collect()
}

#[test]
fn json_lines_carry_host_session_peer_and_queue_as_keys() {
    let dir = tempfile::tempdir().unwrap();
    let d = Daemon::start(dir.path(), "json", &env(&[("RUST_LOG", "info")]), &["--log-format", "json"]);
    let out = cli(&env(&[("RUST_LOG", "debug")]), &["--target", d.url.as_str(), "--host-id", "json-host", "--log-format", "json", "list"]);
    wait_until("the disconnect line", Duration::from_secs(10), || d.text().contains("session disconnected"));
    let log = d.stop();
    let lines = json_lines(&log);
    for l in &lines {
        for key in ["timestamp", "level", "target", "message"] {
            assert!(l.get(key).is_some(), "no {key}: {l}");
        }
        assert!(l.get("fields").is_none(), "fields nested, not top-level: {l}");
    }
    let connect = lines.iter().find(|l| l["message"].as_str().is_some_and(|m| m.starts_with("session connected"))).expect("a connect line");
    assert_eq!(connect["host"], "json-host", "{connect}");
    assert!(connect["session"].as_str().is_some_and(|s| s.starts_with("0x")), "{connect}");
    assert!(connect["peer"].as_str().is_some_and(|p| p.starts_with("127.0.0.1:")), "{connect}");
    assert_eq!(connect["queue"], 0, "{connect}");
    assert!(!connect["message"].as_str().unwrap().contains("host="), "fields repeated in the message: {connect}");
    let gone = lines.iter().find(|l| l["message"] == "session disconnected").expect("a disconnect line");
    assert_eq!((&gone["host"], &gone["session"], &gone["peer"]), (&connect["host"], &connect["session"], &connect["peer"]), "{gone}");
    assert!(gone["reason"].is_string(), "{gone}");

    // The CLI's lines are JSON too, its session and queue keys of their own.
    let cli_lines = json_lines(&String::from_utf8_lossy(&out.stderr));
    let connected = cli_lines.iter().find(|l| l["message"] == "connected").expect("the CLI's connect line");
    assert_eq!(connected["queue"], 0, "{connected}");
    assert!(connected["session"].is_u64(), "{connected}");

    // RDMABLK_LOG_FORMAT=json without --log-format: JSON as well.
    let d = Daemon::start(dir.path(), "json-env", &env(&[("RDMABLK_LOG_FORMAT", "json")]), &[]);
    assert!(!json_lines(&d.stop()).is_empty());
}

/// `DEV:INODE` of `path`, as systemd writes JOURNAL_STREAM.
fn dev_ino(path: &Path) -> (u64, u64) {
    let m = std::fs::metadata(path).unwrap();
    (m.dev(), m.ino())
}

#[test]
fn with_journal_stream_naming_stderr_lines_carry_sd_daemon_priorities() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("journal.log");
    File::create(&log).unwrap();
    let (dev, ino) = dev_ino(&log);
    let d = Daemon::start(dir.path(), "journal", &env(&[("RUST_LOG", "debug"), ("JOURNAL_STREAM", &format!("{dev}:{ino}"))]), &[]);
    let text = d.stop();
    let lines: Vec<&str> = text.lines().collect();
    let warn = lines.iter().find(|l| l.contains("no host may open it")).unwrap_or_else(|| panic!("no warning:\n{text}"));
    assert!(warn.starts_with("<4>"), "{warn}");
    let info = lines.iter().find(|l| l.contains("listening on")).unwrap();
    assert!(info.starts_with("<6>"), "{info}");
    assert!(lines.iter().any(|l| l.starts_with("<7>") && l.contains("DEBUG")), "{text}");
    for l in &lines {
        let p = l.get(..3).unwrap_or("");
        assert!(["<3>", "<4>", "<6>", "<7>"].contains(&p), "a line without a priority: {l}");
        // No time stamp: the journal adds its own.
        assert!(!l[3..].trim_start().starts_with("20"), "{l}");
        assert!(!l.as_bytes().contains(&ESC), "{l:?}");
    }

    // JSON lines get the prefix too (journald strips it).
    let log = dir.path().join("journal-json.log");
    File::create(&log).unwrap();
    let (dev, ino) = dev_ino(&log);
    let d = Daemon::start(dir.path(), "journal-json", &env(&[("JOURNAL_STREAM", &format!("{dev}:{ino}"))]), &["--log-format", "json"]);
    let t = d.stop();
    let warn = t.lines().find(|l| l.contains("no host may open it")).unwrap();
    let v: serde_json::Value = serde_json::from_str(warn.strip_prefix("<4>").unwrap_or_else(|| panic!("{warn}"))).unwrap();
    assert_eq!(v["level"], "WARN");

    // The CLI as a service (rdmablk-attach@): its terse lines are prefixed.
    let t = Daemon::start(dir.path(), "for-cli", &[], &[]);
    let cli_log = dir.path().join("cli.log");
    let f = File::create(&cli_log).unwrap();
    let (dev, ino) = dev_ino(&cli_log);
    let mut cmd = Command::new(bin("rdmablk"));
    clean_env(&mut cmd);
    let st = cmd
        .env("RDMABLK_LOG", "debug")
        .env("JOURNAL_STREAM", format!("{dev}:{ino}"))
        .args(["--target", t.url.as_str(), "list"])
        .stdout(Stdio::null())
        .stderr(f)
        .status()
        .unwrap();
    assert!(st.success());
    let c = std::fs::read_to_string(&cli_log).unwrap();
    assert!(!c.is_empty() && c.lines().all(|l| l.starts_with("<7>") || l.starts_with("<6>")), "{c}");
}

#[test]
fn a_journal_stream_that_is_not_stderr_changes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    // Another file's device and inode (a child of a service whose stderr went elsewhere).
    let other = dir.path().join("other");
    File::create(&other).unwrap();
    let (dev, ino) = dev_ino(&other);
    let d = Daemon::start(dir.path(), "not-journal", &env(&[("JOURNAL_STREAM", &format!("{dev}:{ino}"))]), &[]);
    let text = d.stop();
    for l in text.lines() {
        assert!(!l.starts_with('<'), "a priority prefix though JOURNAL_STREAM names another file: {l}");
        assert!(l.starts_with("20"), "no time stamp: {l}");
    }
    let warn = text.lines().find(|l| l.contains("no host may open it")).unwrap();
    assert!(warn.contains(" WARN "), "{warn}");
}

#[test]
fn the_bench_and_tcp_ceiling_take_the_same_variables() {
    let dir = tempfile::tempdir().unwrap();
    for binary in ["rdmablk-bench", "tcp-ceiling"] {
        // Their options are fio-style: no --log-format; RDMABLK_LOG_FORMAT,
        // the alias and JOURNAL_STREAM work as for the others.
        let log = dir.path().join(format!("{binary}.log"));
        let f = File::create(&log).unwrap();
        let (dev, ino) = dev_ino(&log);
        let mut cmd = Command::new(bin(binary));
        clean_env(&mut cmd);
        let st = cmd
            .env("RDMABLK_LOG", "nonsense=x=y")
            .env("RDMABLK_LOG_FORMAT", "json")
            .env("JOURNAL_STREAM", format!("{dev}:{ino}"))
            .arg("--help")
            .stdout(Stdio::null())
            .stderr(f)
            .status()
            .unwrap();
        let text = std::fs::read_to_string(&log).unwrap();
        assert!(st.success(), "{binary}: {text}");
        let warn = text.lines().find(|l| l.contains("not a valid log filter")).unwrap_or_else(|| panic!("{binary}: {text}"));
        let v: serde_json::Value = serde_json::from_str(warn.strip_prefix("<4>").unwrap_or_else(|| panic!("{warn}"))).unwrap();
        assert!(v["message"].as_str().unwrap().starts_with("RDMABLK_LOG=\"nonsense=x=y\""), "{v}");
        assert_eq!(v["level"], "WARN");
    }
}
