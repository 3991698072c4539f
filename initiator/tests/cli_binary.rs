//! The real `rdmablk` binary: exit codes, one-line errors, stdin and stdout.

mod support;

use std::io::Write;
use std::process::{Command, Output, Stdio};

use support::{pattern, FakeConfig, FakeTarget, FakeVolume};

fn rdmablk(args: &[&str], stdin: Option<&[u8]>) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_rdmablk"))
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .env_remove("RDMABLK_LOG")
        .env_remove("RUST_LOG")
        .spawn()
        .expect("spawn rdmablk");
    let mut input = child.stdin.take().unwrap();
    if let Some(data) = stdin {
        input.write_all(data).unwrap();
    }
    drop(input);
    child.wait_with_output().unwrap()
}

fn one_error_line(out: &Output) -> String {
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(err.lines().count(), 1, "expected one line on stderr, got {err:?}");
    assert!(err.starts_with("rdmablk: error: "), "{err:?}");
    err
}

#[test]
fn stdin_to_volume_to_stdout() {
    let target = FakeTarget::start(FakeConfig::default(), vec![FakeVolume::new("vol0", 4 << 20, 4096)]);
    let url = target.url.as_str();
    let data = pattern(3 << 20, 11);
    let out = rdmablk(&["--target", url, "write", "vol0", "--offset", "8k"], Some(&data));
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(out.stdout.is_empty() && out.stderr.is_empty());
    assert_eq!(target.volume_data(0)[8192..8192 + data.len()], data[..]);
    let out = rdmablk(&["--target", url, "read", "vol0", "--offset", "8192", "--length", "3MiB"], None);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(out.stdout == data);
    let out = rdmablk(&["--target", url, "flush", "vol0"], None);
    assert!(out.status.success());
}

#[test]
fn errors_are_one_line_and_exit_non_zero() {
    let target = FakeTarget::start(FakeConfig::default(), vec![FakeVolume::new("vol0", 1 << 20, 4096)]);
    let url = target.url.as_str();
    let before = target.volume_data(0);

    let out = rdmablk(&["--target", url, "write", "vol0", "--offset", "12289"], Some(&[7u8; 4096]));
    assert_eq!(out.status.code(), Some(1));
    let err = one_error_line(&out);
    assert!(err.contains("12289") && err.contains("4096-byte block size"), "{err}");
    assert_eq!(target.volume_data(0), before);

    let out = rdmablk(&["--target", url, "read", "nosuchvol", "--offset", "0", "--length", "4k"], None);
    assert_eq!(out.status.code(), Some(1));
    assert!(one_error_line(&out).contains("nosuchvol"));

    let out = rdmablk(&["--target", url, "read", "vol0", "--offset", "0", "--length", "2MiB"], None);
    assert_eq!(out.status.code(), Some(1));
    assert!(one_error_line(&out).contains("beyond the end"));

    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let dead = format!("tcp://127.0.0.1:{port}");
    let out = rdmablk(&["--target", &dead, "--timeout", "2s", "list"], None);
    assert_eq!(out.status.code(), Some(1));
    assert!(one_error_line(&out).contains(&dead));

    let out = rdmablk(&["--target", url, "read", "vol0", "--offset", "1q", "--length", "4k"], None);
    assert_eq!(out.status.code(), Some(2));
    assert!(one_error_line(&out).contains("1q"));

    let out = rdmablk(&["--help"], None);
    assert_eq!(out.status.code(), Some(0));
    assert!(String::from_utf8_lossy(&out.stdout).contains("Usage: rdmablk"));

    let out = rdmablk(&["list"], None);
    assert_eq!(out.status.code(), Some(1));
    assert!(one_error_line(&out).contains("--target"));
}

#[test]
fn large_transfers_keep_their_order_and_report_progress_when_asked() {
    let size = 24 << 20;
    let target = FakeTarget::start(
        FakeConfig { max_io: 256 << 10, ..FakeConfig::default() },
        vec![FakeVolume::new("vol0", size, 4096)],
    );
    let url = target.url.as_str();
    // Several 8 MiB chunks in flight at once; the last one short.
    let data = pattern((20 << 20) + 4096, 3);
    let out = rdmablk(&["--target", url, "--progress", "always", "write", "vol0", "--offset", "4k"], Some(&data));
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("20.0 MiB") && err.contains("/s"), "no progress line: {err:?}");
    assert!(target.volume_data(0)[4096..4096 + data.len()] == data[..]);
    let len = data.len().to_string();
    let out =
        rdmablk(&["--target", url, "--progress", "always", "read", "vol0", "--offset", "4096", "--length", &len], None);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(out.stdout == data, "read returned other bytes (or out of order)");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.lines().last().unwrap_or("").contains("(100%)"), "{err:?}");
    // Not a terminal and not asked: quiet.
    let out = rdmablk(&["--target", url, "read", "vol0", "--offset", "0", "--length", "16MiB"], None);
    assert!(out.status.success() && out.stderr.is_empty(), "{}", String::from_utf8_lossy(&out.stderr));
}

#[test]
fn discard_and_write_zeroes_commands() {
    let target = FakeTarget::start(FakeConfig::default(), vec![FakeVolume::new("vol0", 1 << 20, 4096)]);
    let url = target.url.as_str();
    let data = pattern(64 << 10, 9);
    assert!(rdmablk(&["--target", url, "write", "vol0", "--offset", "0"], Some(&data)).status.success());
    let out = rdmablk(&["--target", url, "write-zeroes", "vol0", "--offset", "4k", "--length", "8k"], None);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let now = target.volume_data(0);
    assert!(now[4096..12288].iter().all(|&b| b == 0));
    assert_eq!(now[..4096], data[..4096]);
    assert_eq!(now[12288..65536], data[12288..]);
    let out = rdmablk(&["--target", url, "discard", "vol0", "--offset", "32k", "--length", "16k"], None);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let cmds = target.commands();
    let zeroes =
        cmds.iter().find(|c| c.opcode == rdmablk_common::protocol::Opcode::WriteZeroes).expect("WRITE_ZEROES sent");
    assert_eq!((zeroes.start_block.0, zeroes.block_count.0), (1, 2));
    let discard = cmds.iter().find(|c| c.opcode == rdmablk_common::protocol::Opcode::Discard).expect("DISCARD sent");
    assert_eq!((discard.start_block.0, discard.block_count.0), (8, 4));

    let out = rdmablk(&["--target", url, "discard", "vol0", "--offset", "1", "--length", "4k"], None);
    assert_eq!(out.status.code(), Some(1));
    assert!(one_error_line(&out).contains("not aligned"));
    let out = rdmablk(&["--target", url, "write-zeroes", "vol0", "--offset", "1MiB", "--length", "4k"], None);
    assert_eq!(out.status.code(), Some(1));
    assert!(one_error_line(&out).contains("beyond the end"));
}

#[test]
fn several_gateways_on_the_command_line() {
    let a = FakeTarget::start(FakeConfig { name: "gw-a".into(), ..FakeConfig::default() }, vec![FakeVolume::new("vol0", 1 << 20, 4096)]);
    let b = FakeTarget::start_sharing(FakeConfig { name: "gw-b".into(), ..FakeConfig::default() }, a.volumes.clone());
    let list = format!("{},{}", a.url, b.url);
    let data = pattern(64 << 10, 5);
    let out = rdmablk(&["--target", &list, "write", "vol0", "--offset", "0"], Some(&data));
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let out = rdmablk(&["--target", &list, "info", "vol0", "-o", "json"], None);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let info: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!((info["gateway"].as_str(), info["target_name"].as_str()), (Some(a.url.as_str()), Some("gw-a")));

    // The first gateway is down: the second serves, and says so.
    a.set_down(true);
    let out = rdmablk(&["--target", &list, "--timeout", "2s", "read", "vol0", "--offset", "0", "--length", "64k"], None);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(out.stdout == data);
    let out = rdmablk(&["--target", &list, "info", "vol0"], None);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains(&format!("gateway: {}", b.url)) && text.contains("target_name: gw-b"), "{text}");
    // A single URL's info has no gateway line (as before).
    let out = rdmablk(&["--target", &b.url, "info", "vol0"], None);
    assert!(!String::from_utf8_lossy(&out.stdout).contains("gateway"));

    // Neither answers: one line naming both.
    b.set_down(true);
    let out = rdmablk(&["--target", &list, "--timeout", "2s", "list"], None);
    assert_eq!(out.status.code(), Some(1));
    let err = one_error_line(&out);
    assert!(err.contains("none of the 2 gateways could be used") && err.contains(&a.url) && err.contains(&b.url), "{err}");

    // A bad list: one line saying which entry.
    let bad = format!("{},,{}", a.url, b.url);
    let out = rdmablk(&["--target", &bad, "list"], None);
    assert_eq!(out.status.code(), Some(1));
    assert!(one_error_line(&out).contains("gateway 2 of 3 is empty"));
    let out = rdmablk(&["--target", &format!("{},nonsense", a.url), "list"], None);
    assert_eq!(out.status.code(), Some(1));
    assert!(one_error_line(&out).contains("gateway 2 of 2: \"nonsense\": expected scheme://host:port"));

    let out = rdmablk(&["--help"], None);
    assert!(String::from_utf8_lossy(&out.stdout).contains("tcp://A:4420,tcp://B:4420"));
}

#[test]
fn an_attach_file_lists_several_gateways() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("db.toml");
    std::fs::write(&path, "target = [\"tcp://10.0.0.1:7420\", \"tcp://10.0.0.2:7420\"]\nvolume = \"vol0\"\nhost_id = \"db1\"\n").unwrap();
    let out = rdmablk(&["attach", "--check", "--config", path.to_str().unwrap()], None);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("ok: volume vol0 on tcp://10.0.0.1:7420,tcp://10.0.0.2:7420 as host db1"), "{text}");
    std::fs::write(&path, "target = \"tcp://10.0.0.1:7420,,tcp://10.0.0.2:7420\"\nvolume = \"vol0\"\n").unwrap();
    let out = rdmablk(&["attach", "--check", "--config", path.to_str().unwrap()], None);
    assert_eq!(out.status.code(), Some(1));
    let err = one_error_line(&out);
    assert!(err.contains("db.toml: target: ") && err.contains("gateway 2 of 3 is empty"), "{err}");
}

#[test]
fn a_write_fails_over_when_its_gateway_answers_not_owner_and_says_so() {
    let a = FakeTarget::start(FakeConfig::default(), vec![FakeVolume::new("vol0", 16 << 20, 4096)]);
    let b = FakeTarget::start_sharing(FakeConfig::default(), a.volumes.clone());
    let list = format!("{},{}", a.url, b.url);
    let mut child = Command::new(env!("CARGO_BIN_EXE_rdmablk"))
        .args(["--target", &list, "write", "vol0", "--offset", "0"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .env_remove("RDMABLK_LOG")
        .env_remove("RUST_LOG")
        .spawn()
        .expect("spawn rdmablk");
    let mut input = child.stdin.take().unwrap();
    // The first 8 MiB chunk goes to the first gateway...
    let data = pattern(16 << 20, 4);
    input.write_all(&data[..8 << 20]).unwrap();
    let t0 = std::time::Instant::now();
    while !a.commands().iter().any(|c| c.opcode == rdmablk_common::protocol::Opcode::Write) {
        assert!(t0.elapsed() < std::time::Duration::from_secs(10), "the first chunk never reached the first gateway");
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    // ...which then loses the volume to the second: the rest goes there.
    a.set_not_owner(true);
    input.write_all(&data[8 << 20..]).unwrap();
    drop(input);
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    eprintln!("{err}");
    assert!(out.status.success(), "{err}");
    assert!(a.volume_data(0) == data, "the shared volume holds other bytes");
    let line = err.lines().find(|l| l.contains("failover")).unwrap_or_else(|| panic!("no failover line: {err}"));
    assert!(line.contains(&format!("from gateway {} to gateway {}", a.url, b.url)) && line.contains("(NotOwner)"), "{line}");
    assert_eq!(err.matches("failover").count(), 1, "one line per failover: {err}");
}
