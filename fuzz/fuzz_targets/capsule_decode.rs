#![no_main]
//! libFuzzer entry point; the harness is `rdmablk_fuzz::capsule_decode::run`.

libfuzzer_sys::fuzz_target!(|data: &[u8]| rdmablk_fuzz::capsule_decode::run(data));
