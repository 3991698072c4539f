//! On a machine without RDMA (no rdma-core, or no RDMA device, as on the
//! build hosts), `rdma://` fails with one clear message naming what is
//! missing, and `tcp://` keeps working. Skipped where an RDMA device exists
//! (the Soft-RoCE VM stage tests rdma:// for real there).

use std::io::Read;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use rdmablk_system_tests::{bin, file_volume, rdmablk, sparse_file};

fn rdma_device_present() -> bool {
    std::fs::read_dir("/sys/class/infiniband").map(|mut d| d.next().is_some()).unwrap_or(false)
}

/// What the message must name: the missing library or the missing device.
fn names_what_is_missing(msg: &str) -> bool {
    msg.contains("not found (install rdma-core") || msg.contains("cannot be loaded") || msg.contains("no RDMA device")
}

#[test]
fn cli_refuses_rdma_with_one_line_naming_what_is_missing() {
    if rdma_device_present() {
        eprintln!("skipped: this machine has an RDMA device");
        return;
    }
    let out = rdmablk(&["--target", "rdma://127.0.0.1:4420", "list"], None);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "rdmablk list over rdma:// succeeded: {err}");
    assert!(out.stdout.is_empty(), "{}", String::from_utf8_lossy(&out.stdout));
    assert_eq!(err.lines().count(), 1, "expected one line: {err}");
    assert!(err.contains("rdma://127.0.0.1:4420"), "the message does not name the URL: {err}");
    assert!(names_what_is_missing(&err), "the message does not name what is missing: {err}");
}

#[test]
fn daemon_with_an_rdma_listener_does_not_start_and_says_why() {
    if rdma_device_present() {
        eprintln!("skipped: this machine has an RDMA device");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let img = sparse_file(dir.path(), "vol0.img", 8 << 20);
    let config = dir.path().join("target.toml");
    // tcp:// alone works (every other system test); with an rdma:// listener
    // that cannot be served the daemon refuses to start.
    std::fs::write(
        &config,
        format!(
            "[target]\nlisten = [\"tcp://127.0.0.1:0\", \"rdma://127.0.0.1:0\"]\n\n{}",
            file_volume("vol0", &img, 8 << 20, false)
        ),
    )
    .unwrap();
    let mut child = Command::new(bin("rdmablk-target"))
        .arg("--config")
        .arg(&config)
        .env_remove("NOTIFY_SOCKET")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn rdmablk-target");
    let deadline = Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("rdmablk-target kept running with an rdma:// listener it cannot serve");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let mut err = String::new();
    child.stderr.take().unwrap().read_to_string(&mut err).unwrap();
    assert!(!status.success(), "rdmablk-target exited successfully: {err}");
    let line = err.lines().find(|l| l.contains("rdma://127.0.0.1:0")).unwrap_or_else(|| panic!("no line names the URL: {err}"));
    assert!(names_what_is_missing(line), "the message does not name what is missing: {line}");
    assert!(!err.contains("panicked"), "{err}");
}
