//! What the `rdmablk` CLI says when it meets something other than what it
//! expects (issue 51, "What a storage engineer meets first"): the real
//! binaries, the messages on standard error and the exit codes.

use std::io::{Read, Write};
use std::net::TcpListener;
use std::path::Path;

use rdmablk_system_tests::{file_volume, listen_host, rdmablk, sparse_file, TargetProcess};

fn stderr_of(out: &std::process::Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// A TCP server on the test host that answers every connection with
/// `banner` (after reading what the client sends first, up to 1 s), then
/// closes it. Returns its port.
fn fake_server(banner: &'static [u8]) -> u16 {
    let listener = TcpListener::bind((listen_host().as_str(), 0)).expect("bind");
    let port = listener.local_addr().unwrap().port();
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(mut conn) = conn else { continue };
            let _ = conn.set_read_timeout(Some(std::time::Duration::from_secs(1)));
            let mut buf = [0u8; 512];
            let _ = conn.read(&mut buf);
            let _ = conn.write_all(banner);
        }
    });
    port
}

fn nvme_only_target(dir: &Path) -> TargetProcess {
    let host = listen_host();
    let file = sparse_file(dir, "vol0.img", 1 << 20);
    let config = format!(
        "[target]\nlisten = [\"nvme+tcp://{host}:0\"]\nnqn = \"nqn.2026-12.io.rdmablk.test:cli\"\n{}",
        file_volume("vol0", &file, 1 << 20, false)
    );
    TargetProcess::start(&config)
}

/// Item 7: an NVMe/TCP port is named as one, with rdmablk's own port.
#[test]
fn an_nvme_tcp_port_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let target = nvme_only_target(dir.path());
    let addr = target.nvme_tcp_addr();
    let url = format!("tcp://{addr}");
    let out = rdmablk(&["--target", &url, "--ctrl-loss-timeout", "0", "list"], None);
    let err = stderr_of(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("this port speaks NVMe/TCP (an ICResp)"), "{err}");
    assert!(err.contains("rdmablk listens on 7420 by default"), "{err}");
    assert!(!err.contains("reserved field"), "the raw decode error is not the message: {err}");
    assert_eq!(err.lines().count(), 1, "{err}");
}

/// Item 7: an HTTP server is named as one.
#[test]
fn an_http_port_is_named() {
    let port = fake_server(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\nConnection: close\r\n\r\n");
    let url = format!("tcp://{}:{port}", listen_host());
    let out = rdmablk(&["--target", &url, "list"], None);
    let err = stderr_of(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("this port speaks HTTP"), "{err}");
    assert!(err.contains("rdmablk listens on 7420 by default"), "{err}");
    assert!(!err.contains("unknown frame type"), "{err}");
}

/// Item 7: anything else is "not an rdmablk target".
#[test]
fn another_server_is_not_an_rdmablk_target() {
    let port = fake_server(b"SSH-2.0-OpenSSH_9.6\r\n");
    let url = format!("tcp://{}:{port}", listen_host());
    let out = rdmablk(&["--target", &url, "info", "vol0"], None);
    let err = stderr_of(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("not an rdmablk target"), "{err}");
    assert!(err.contains("rdmablk listens on 7420 by default"), "{err}");
}

/// Item 8: a reconnection is not silent: the loss, each failed attempt and
/// the reconnection each print a line, as the kernel's NVMe host logs them.
#[test]
fn a_reconnection_prints_the_loss_and_each_attempt() {
    use std::io::BufRead;
    use std::process::{Command, Stdio};
    use std::sync::{Arc, Mutex};
    use std::time::Duration;
    use rdmablk_system_tests::{bin, free_port, target_section_at, wait_until};

    let dir = tempfile::tempdir().unwrap();
    let file = sparse_file(dir.path(), "vol0.img", 1 << 20);
    let port = free_port();
    let config = dir.path().join("target.toml");
    std::fs::write(&config, format!("{}{}", target_section_at(port), file_volume("vol0", &file, 1 << 20, false))).unwrap();
    let mut target = TargetProcess::start_with_path(&config);
    let url = target.url.clone();
    // A write that waits for its input: connected, idle, while the target goes away.
    let mut cli = Command::new(bin("rdmablk"))
        .args(["--target", &url, "--ctrl-loss-timeout", "30", "write", "vol0", "--offset", "0"])
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn rdmablk");
    let lines = Arc::new(Mutex::new(Vec::<String>::new()));
    let sink = lines.clone();
    let stderr = cli.stderr.take().unwrap();
    let reader = std::thread::spawn(move || {
        for line in std::io::BufReader::new(stderr).lines().map_while(Result::ok) {
            sink.lock().unwrap().push(line);
        }
    });
    let has = |needle: &str| lines.lock().unwrap().iter().any(|l| l.contains(needle));
    target.wait_for_log("session connected", Duration::from_secs(10));
    std::thread::sleep(Duration::from_millis(500));
    target.signal(libc::SIGKILL);
    target.wait_exit(Duration::from_secs(10));
    wait_until("the loss and two failed attempts on standard error", Duration::from_secs(20), || {
        has("connection lost, reconnecting (up to 30 s)") && has("reconnection attempt 2 failed")
    });
    let _target = TargetProcess::start_with_path(&config);
    wait_until("the reconnection on standard error", Duration::from_secs(30), || has("reconnected"));
    let mut stdin = cli.stdin.take().unwrap();
    stdin.write_all(&[0x5a; 4096]).unwrap();
    drop(stdin);
    let status = cli.wait().unwrap();
    reader.join().unwrap();
    let text = lines.lock().unwrap().join("\n");
    assert!(status.success(), "{text}");
    assert!(text.contains("reconnection attempt 1 failed"), "{text}");
    assert!(text.lines().all(|l| l.starts_with("rdmablk: ")), "{text}");
    eprintln!("rdmablk's standard error:\n{text}");
}

/// Item 11: `attach --config` reads and checks its file before it looks for
/// ublk, and `--check` validates it and exits without touching ublk.
#[test]
fn attach_config_is_checked_before_ublk() {
    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("bad.toml");
    std::fs::write(&bad, "target = \"tcp://127.0.0.1:7420\"\nvolume = \"vol0\"\nqueues = 0\n").unwrap();
    for args in [&["attach", "--config"][..], &["attach", "--check", "--config"]] {
        let mut all = args.to_vec();
        all.push(bad.to_str().unwrap());
        let out = rdmablk(&all, None);
        let err = stderr_of(&out);
        assert_eq!(out.status.code(), Some(1), "{all:?}: {err}");
        assert!(err.contains("bad.toml: queues: must be in 1..=32 (got 0)"), "{all:?}: {err}");
        assert!(!err.contains("ublk"), "the file's error, not the machine's: {err}");
    }
    let url = dir.path().join("url.toml");
    std::fs::write(&url, "target = \"tcp://127.0.0.1\"\nvolume = \"vol0\"\n").unwrap();
    let out = rdmablk(&["attach", "--check", "--config", url.to_str().unwrap()], None);
    let err = stderr_of(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("url.toml") && err.contains("missing :port"), "{err}");
    let key = dir.path().join("nokey.toml");
    std::fs::write(&key, "target = \"tcp://127.0.0.1:7420\"\nvolume = \"vol0\"\nhost_id = \"db1\"\nkey_file = \"/nonexistent/db1.key\"\n").unwrap();
    let out = rdmablk(&["attach", "--check", "--config", key.to_str().unwrap()], None);
    let err = stderr_of(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("/nonexistent/db1.key"), "{err}");

    let good = dir.path().join("good.toml");
    std::fs::write(&good, "target = \"tcp://127.0.0.1:7420\"\nvolume = \"vol0\"\nqueues = 2\n").unwrap();
    let out = rdmablk(&["attach", "--check", "--config", good.to_str().unwrap()], None);
    let (text, err) = (String::from_utf8_lossy(&out.stdout), stderr_of(&out));
    assert_eq!(out.status.code(), Some(0), "{err}");
    assert!(text.contains("good.toml: ok") && text.contains("vol0") && text.contains("tcp://127.0.0.1:7420"), "{text}");
    // --check is for a file.
    let out = rdmablk(&["-t", "tcp://127.0.0.1:7420", "attach", "vol0", "--check"], None);
    assert_eq!(out.status.code(), Some(2), "{}", stderr_of(&out));
}

/// Item 13: `list` and `info` print a header and human sizes by default and
/// JSON with nvme-cli's `-o json` / `--output-format json`; `--help` gives
/// the exit codes.
#[test]
fn list_and_info_have_a_header_human_sizes_and_json() {
    let dir = tempfile::tempdir().unwrap();
    let file = sparse_file(dir.path(), "vol0.img", 64 << 20);
    let ro = sparse_file(dir.path(), "ro.img", 3 << 30);
    let target = TargetProcess::start(&format!(
        "{}{}{}",
        rdmablk_system_tests::target_section(),
        file_volume("vol0", &file, 64 << 20, false),
        file_volume("archive", &ro, 3 << 30, true)
    ));
    let url = target.url.as_str();
    let run = |args: &[&str]| {
        let mut all = vec!["--target", url];
        all.extend_from_slice(args);
        let out = rdmablk(&all, None);
        assert!(out.status.success(), "{args:?}: {}", stderr_of(&out));
        String::from_utf8(out.stdout).unwrap()
    };
    let text = run(&["list"]);
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 3, "{text}");
    let header: Vec<&str> = lines[0].split_whitespace().collect();
    assert_eq!(header, ["NAME", "SIZE", "BYTES", "BLOCK", "ACCESS"], "{text}");
    let vol0 = lines.iter().find(|l| l.starts_with("vol0 ")).expect("vol0's row");
    assert_eq!(vol0.split_whitespace().collect::<Vec<_>>(), ["vol0", "64.0", "MiB", "67108864", "4096", "rw"], "{text}");
    let archive = lines.iter().find(|l| l.starts_with("archive ")).expect("archive's row");
    assert_eq!(archive.split_whitespace().collect::<Vec<_>>(), ["archive", "3.0", "GiB", "3221225472", "4096", "ro"], "{text}");
    // The columns line up.
    assert_eq!(lines[0].find("BYTES"), vol0.find("67108864"), "{text}");

    for spelling in [&["list", "-o", "json"][..], &["list", "--output-format", "json"], &["list", "--output-format=json"]] {
        let json: serde_json::Value = serde_json::from_str(&run(spelling)).unwrap();
        let vols = json["volumes"].as_array().unwrap_or_else(|| panic!("{spelling:?}: {json}"));
        let v = vols.iter().find(|v| v["name"] == "vol0").expect("vol0");
        assert_eq!((v["size"].as_u64(), v["block_size"].as_u64(), v["read_only"].as_bool()), (Some(64 << 20), Some(4096), Some(false)));
    }

    let text = run(&["info", "vol0"]);
    assert!(text.lines().next().unwrap().contains("vol0") && text.lines().next().unwrap().contains(url), "a header: {text}");
    assert!(text.contains("size: 64.0 MiB (67108864 bytes)"), "{text}");
    assert!(text.contains("block_size: 4096"), "{text}");
    for spelling in [&["info", "vol0", "-o", "json"][..], &["info", "vol0", "--output-format", "json"], &["info", "vol0", "--json"]] {
        let json: serde_json::Value = serde_json::from_str(&run(spelling)).unwrap();
        assert_eq!(json["size"].as_u64(), Some(64 << 20), "{spelling:?}: {json}");
    }
    let out = rdmablk(&["--target", url, "list", "-o", "yaml"], None);
    assert_eq!(out.status.code(), Some(2), "{}", stderr_of(&out));
    assert!(stderr_of(&out).contains("json"), "the values are named: {}", stderr_of(&out));

    let help = String::from_utf8(rdmablk(&["--help"], None).stdout).unwrap();
    assert!(help.contains("Exit status:") && help.contains("0 ") && help.contains("1 ") && help.contains("2 "), "{help}");
}
