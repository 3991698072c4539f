//! Fuzz harnesses for rdmablk, one module per cargo-fuzz target.
//!
//! Each module's `run(&[u8])` is the whole harness: it panics on any broken
//! invariant and returns otherwise. The libFuzzer binaries in
//! `fuzz_targets/` only call it, so the same code is compiled by the normal
//! workspace build and exercised by `tests/corpus.rs`, which replays the
//! committed corpus (`corpus/<target>/`) and every crash found so far
//! (`regressions/<target>/`). [`seeds`] generates the committed seed corpus.
//!
//! Run the fuzzers with `scripts/fuzz.sh [seconds-per-target] [target...]`.

pub mod capsule_decode;
pub mod config_parse;
pub mod nvme_commands;
pub mod nvme_tcp_pdus;
pub mod seeds;
pub mod tcp_frames;

/// The fuzz targets, as named in `Cargo.toml` and in `corpus/`.
pub const TARGETS: &[&str] = &["capsule_decode", "tcp_frames", "nvme_tcp_pdus", "nvme_commands", "config_parse"];

/// The harness of a target, by name.
pub fn harness(target: &str) -> Option<fn(&[u8])> {
    match target {
        "capsule_decode" => Some(capsule_decode::run),
        "tcp_frames" => Some(tcp_frames::run),
        "nvme_tcp_pdus" => Some(nvme_tcp_pdus::run),
        "nvme_commands" => Some(nvme_commands::run),
        "config_parse" => Some(config_parse::run),
        _ => None,
    }
}
