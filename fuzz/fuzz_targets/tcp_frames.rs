#![no_main]
//! libFuzzer entry point; the harness is `rdmablk_fuzz::tcp_frames::run`.

libfuzzer_sys::fuzz_target!(|data: &[u8]| rdmablk_fuzz::tcp_frames::run(data));
