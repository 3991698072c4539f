//! Runs the fuzz harnesses without libFuzzer: every committed seed and every
//! crash input kept in `regressions/` is replayed, so a fixed crash stays
//! fixed in the normal test run. Also keeps `corpus/` in step with the
//! seed generator.

use std::path::{Path, PathBuf};

use rdmablk_fuzz::{harness, seeds, TARGETS};

fn fuzz_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The files of `dir`, sorted; none if it does not exist.
fn inputs(dir: &Path) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(dir) else { return Vec::new() };
    let mut files: Vec<PathBuf> =
        entries.map(|e| e.expect("directory entry").path()).filter(|p| p.is_file()).collect();
    files.sort();
    files
}

/// Replays every input of `target`; returns how many ran.
fn replay(target: &str) -> usize {
    let run = harness(target).expect("known target");
    let mut count = 0;
    let mut dirs = vec![fuzz_dir().join("corpus").join(target), fuzz_dir().join("regressions").join(target)];
    dirs.extend(seeds::extra_seed_dirs(target).iter().map(|d| fuzz_dir().join("..").join(d)));
    for dir in dirs {
        for path in inputs(&dir) {
            if path.file_name().is_some_and(|n| n.to_string_lossy().starts_with('.')) {
                continue;
            }
            let bytes = std::fs::read(&path).expect("read input");
            let outcome = std::panic::catch_unwind(|| run(&bytes));
            if let Err(panic) = outcome {
                eprintln!("{target}: {} fails", path.display());
                std::panic::resume_unwind(panic);
            }
            count += 1;
        }
    }
    count
}

#[test]
fn capsule_decode_inputs_replay_cleanly() {
    assert!(replay("capsule_decode") > 0, "no capsule_decode inputs found");
}

#[test]
fn tcp_frames_inputs_replay_cleanly() {
    assert!(replay("tcp_frames") > 0, "no tcp_frames inputs found");
}

#[test]
fn nvme_tcp_pdus_inputs_replay_cleanly() {
    assert!(replay("nvme_tcp_pdus") > 0, "no nvme_tcp_pdus inputs found");
}

#[test]
fn nvme_commands_inputs_replay_cleanly() {
    assert!(replay("nvme_commands") > 0, "no nvme_commands inputs found");
}

#[test]
fn config_parse_inputs_replay_cleanly() {
    assert!(replay("config_parse") > 0, "no config_parse inputs found");
}

/// `corpus/` holds exactly what `seeds::all()` generates (libFuzzer runs use
/// a scratch copy, so nothing else lands there). With
/// `RDMABLK_WRITE_SEEDS=1` the files are (re)written instead.
#[test]
fn committed_seeds_match_the_generator() {
    let write = std::env::var_os("RDMABLK_WRITE_SEEDS").is_some_and(|v| v == "1");
    let all = seeds::all();
    for target in TARGETS {
        let dir = fuzz_dir().join("corpus").join(target);
        let expected: Vec<_> = all.iter().filter(|s| s.target == *target).collect();
        assert!(!expected.is_empty(), "no seeds for {target}");
        if write {
            std::fs::create_dir_all(&dir).expect("create corpus dir");
            for old in inputs(&dir) {
                std::fs::remove_file(old).expect("remove old seed");
            }
            for s in &expected {
                std::fs::write(dir.join(&s.name), &s.bytes).expect("write seed");
            }
            continue;
        }
        let hint = "regenerate with `RDMABLK_WRITE_SEEDS=1 cargo test -p rdmablk-fuzz --test corpus committed_seeds`";
        let mut names: Vec<String> = inputs(&dir).iter().map(|p| p.file_name().unwrap().to_string_lossy().into_owned()).collect();
        let mut want: Vec<String> = expected.iter().map(|s| s.name.clone()).collect();
        names.sort();
        want.sort();
        assert_eq!(names, want, "corpus/{target} differs from the generator; {hint}");
        for s in expected {
            let on_disk = std::fs::read(dir.join(&s.name)).expect("read seed");
            assert!(on_disk == s.bytes, "corpus/{target}/{} differs from the generator; {hint}", s.name);
        }
    }
}

/// Seeds must be distinct, or libFuzzer merges them away.
#[test]
fn seeds_are_distinct() {
    let all = seeds::all();
    for (i, a) in all.iter().enumerate() {
        for b in &all[i + 1..] {
            if a.target == b.target {
                assert_ne!(a.name, b.name, "two seeds named {}", a.name);
                assert!(a.bytes != b.bytes, "{}/{} and {} are the same bytes", a.target, a.name, b.name);
            }
        }
    }
}
