#![no_main]
//! libFuzzer entry point; the harness is `rdmablk_fuzz::nvme_tcp_pdus::run`.

libfuzzer_sys::fuzz_target!(|data: &[u8]| rdmablk_fuzz::nvme_tcp_pdus::run(data));
