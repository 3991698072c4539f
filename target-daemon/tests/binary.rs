//! The real binary: `--check`, exit codes, the "listening on" log line and
//! a clean exit on SIGTERM.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_rdmablk-target");

fn write_config(dir: &std::path::Path, extra: &str) -> std::path::PathBuf {
    let p = dir.join("t.toml");
    std::fs::write(
        &p,
        format!(
            "[target]\nlisten = [\"tcp://127.0.0.1:0\"]\nreactors = 1\nbuffer_pool = \"1MiB\"\n{extra}\n[[volume]]\nname = \"v\"\nbackend = \"file\"\npath = \"{}/v.img\"\nsize = \"8MiB\"\nallow_any_host = true\n",
            dir.display()
        ),
    )
    .unwrap();
    p
}

#[test]
fn check_prints_volumes_and_urls_without_creating() {
    let dir = tempfile::tempdir_in("/tmp").unwrap();
    let cfg = write_config(dir.path(), "");
    let out = Command::new(BIN).arg("--config").arg(&cfg).arg("--check").output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let stdout = String::from_utf8(out.stdout).unwrap();
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(lines.len(), 2, "{stdout}");
    assert!(lines[0].starts_with("volume v: backend=file path="), "{stdout}");
    assert!(lines[0].contains("size=8MiB block_size=4096 rw (would create sparse file of 8MiB)"), "{stdout}");
    assert_eq!(lines[1], "listen tcp://127.0.0.1:0");
    assert!(!dir.path().join("v.img").exists());
}

#[test]
fn check_lists_the_nvme_of_listeners_too() {
    let dir = tempfile::tempdir_in("/tmp").unwrap();
    let cfg = dir.path().join("t.toml");
    std::fs::write(
        &cfg,
        "[target]\nlisten = [\"tcp://127.0.0.1:0\", \"nvme+tcp://127.0.0.1:0\"]\n[[volume]]\nname = \"v\"\nbackend = \"null\"\nsize = 4096\nallow_any_host = true\n",
    )
    .unwrap();
    let out = Command::new(BIN).arg("--config").arg(&cfg).arg("--check").output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let stdout = String::from_utf8(out.stdout).unwrap();
    let listens: Vec<&str> = stdout.lines().filter(|l| l.starts_with("listen ")).collect();
    assert_eq!(listens, ["listen tcp://127.0.0.1:0", "listen nvme+tcp://127.0.0.1:0"], "{stdout}");
}

#[test]
fn config_errors_exit_2_with_one_line() {
    let dir = tempfile::tempdir_in("/tmp").unwrap();
    let cfg = write_config(dir.path(), "queue_depth = 0");
    let out = Command::new(BIN).arg("--config").arg(&cfg).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8(out.stderr).unwrap();
    assert!(stderr.contains("t.toml: target.queue_depth: must be in 1..=4096"), "{stderr}");
    assert_eq!(stderr.lines().filter(|l| l.starts_with("rdmablk-target:")).count(), 1, "{stderr}");
    let out = Command::new(BIN).arg("--config").arg(dir.path().join("missing.toml")).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    let out = Command::new(BIN).output().unwrap();
    assert_eq!(out.status.code(), Some(2), "clap usage error");
}

#[test]
fn serves_until_sigterm() {
    let dir = tempfile::tempdir_in("/tmp").unwrap();
    let cfg = write_config(dir.path(), "");
    let mut child = Command::new(BIN)
        .arg("--config")
        .arg(&cfg)
        .arg("--log-format")
        .arg("json")
        .env("RUST_LOG", "info")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let stderr = child.stderr.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines() {
            let Ok(line) = line else { break };
            let _ = tx.send(line);
        }
    });
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut url = None;
    let mut log = Vec::new();
    while url.is_none() {
        let line = rx.recv_timeout(deadline.saturating_duration_since(Instant::now())).expect("no 'listening on' line");
        let v: serde_json::Value = serde_json::from_str(&line).unwrap_or_else(|e| panic!("not JSON ({e}): {line}"));
        // The message and every field are top-level keys (rdmablk_common::logging).
        let msg = v["message"].as_str().unwrap_or("").to_owned();
        if let Some(u) = msg.strip_prefix("listening on ") {
            url = Some(u.to_owned());
        }
        log.push(line);
    }
    let url = url.unwrap();
    assert!(url.starts_with("tcp://127.0.0.1:") && !url.ends_with(":0"), "{url}");
    assert!(dir.path().join("v.img").exists());
    let st = Command::new("kill").arg("-TERM").arg(child.id().to_string()).status().unwrap();
    assert!(st.success());
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        assert!(Instant::now() < deadline, "did not exit after SIGTERM");
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(status.code(), Some(0));
    let rest: Vec<String> = rx.try_iter().collect();
    assert!(rest.iter().any(|l| l.contains("received SIGTERM")), "{rest:?}");
    assert!(rest.iter().any(|l| l.contains("shutdown complete")), "{rest:?}");
    let mut stdout = String::new();
    std::io::Read::read_to_string(&mut child.stdout.take().unwrap(), &mut stdout).unwrap();
    assert!(stdout.is_empty(), "the binary prints nothing but logs: {stdout}");
}
