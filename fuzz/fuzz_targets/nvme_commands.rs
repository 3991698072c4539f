#![no_main]
//! libFuzzer entry point; the harness is `rdmablk_fuzz::nvme_commands::run`.

libfuzzer_sys::fuzz_target!(|data: &[u8]| rdmablk_fuzz::nvme_commands::run(data));
