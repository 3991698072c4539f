//! What the bench's end-to-end tests share: running the real binary and
//! reading what it printed.
#![allow(dead_code)] // each test file uses its own part

use std::process::{Command, Output};

use serde_json::Value;

pub fn bench(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_rdmablk-bench")).args(args).output().expect("running rdmablk-bench")
}

pub fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// Runs the bench and fails the test, with both outputs, unless it succeeded.
pub fn ok(args: &[&str]) -> Output {
    let out = bench(args);
    assert!(
        out.status.success(),
        "rdmablk-bench {args:?} failed ({})\nstdout:\n{}\nstderr:\n{}",
        out.status,
        text(&out.stdout),
        text(&out.stderr)
    );
    out
}

pub fn json(out: &Output) -> Value {
    serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("output is not JSON: {e}\n{}\nstderr:\n{}", text(&out.stdout), text(&out.stderr)))
}

/// A temporary directory under the target directory: a real file system,
/// where O_DIRECT works and sparse files are sparse (unlike a tmpfs /tmp).
pub fn dir() -> tempfile::TempDir {
    tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).expect("temporary directory")
}
