#![no_main]
//! libFuzzer entry point; the harness is `rdmablk_fuzz::config_parse::run`.

libfuzzer_sys::fuzz_target!(|data: &[u8]| rdmablk_fuzz::config_parse::run(data));
