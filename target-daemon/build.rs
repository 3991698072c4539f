//! Fixes what `rdmablk_build_info` reports (src/metrics.rs) at build time:
//! the commit and the compiler, so the daemon needs neither git nor rustc
//! where it runs.
//!
//! - `RDMABLK_GIT_COMMIT`: the variable of that name when it is set (a
//!   build from a source tarball, a packager that knows better), else
//!   `git rev-parse HEAD` of the tree being built, else `unknown` (no git,
//!   no .git);
//! - `RDMABLK_RUSTC_VERSION`: the version `rustc --version` prints.
//!
//! The script runs again when HEAD or the branch it names moves, so a
//! build after a commit reports that commit.

use std::path::{Path, PathBuf};
use std::process::Command;

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-env-changed=RDMABLK_GIT_COMMIT");
    let commit = match std::env::var("RDMABLK_GIT_COMMIT") {
        Ok(c) if !c.trim().is_empty() => c.trim().to_owned(),
        _ => git_commit().unwrap_or_else(|| "unknown".to_owned()),
    };
    println!("cargo:rustc-env=RDMABLK_GIT_COMMIT={commit}");
    let rustc = std::env::var("RUSTC").unwrap_or_else(|_| "rustc".to_owned());
    let version = output(Command::new(rustc).arg("--version"))
        .and_then(|v| v.split_whitespace().nth(1).map(str::to_owned))
        .unwrap_or_else(|| "unknown".to_owned());
    println!("cargo:rustc-env=RDMABLK_RUSTC_VERSION={version}");
}

/// HEAD's commit, and the files that change when it moves (watched).
fn git_commit() -> Option<String> {
    let dir = PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR")?);
    let git = |args: &[&str]| output(Command::new("git").arg("-C").arg(&dir).args(args));
    let git_dir = PathBuf::from(git(&["rev-parse", "--absolute-git-dir"])?);
    watch(&git_dir.join("HEAD"));
    if let Some(branch) = git(&["symbolic-ref", "-q", "HEAD"]) {
        // A loose ref, or one packed into packed-refs (`git gc`, `git pack-refs`); in a
        // worktree both are in the main repository's git directory.
        let refs = git(&["rev-parse", "--path-format=absolute", "--git-common-dir"]).map_or(git_dir, PathBuf::from);
        watch(&refs.join(branch));
        watch(&refs.join("packed-refs"));
    }
    git(&["rev-parse", "HEAD"]).filter(|c| c.len() == 40 && c.bytes().all(|b| b.is_ascii_hexdigit()))
}

fn watch(path: &Path) {
    if path.exists() {
        println!("cargo:rerun-if-changed={}", path.display());
    }
}

/// Standard output of a command that succeeded, trimmed.
fn output(cmd: &mut Command) -> Option<String> {
    let out = cmd.output().ok().filter(|o| o.status.success())?;
    String::from_utf8(out.stdout).ok().map(|s| s.trim().to_owned())
}
