//! rdmablk-bench: a fio-style benchmark for rdmablk targets. See the
//! library ([`rdmablk_bench`]) and `rdmablk-bench --help`.

use rdmablk_common::logging::Logging;

fn main() {
    // The embedded target and the initiator log through tracing: warnings
    // and errors only, unless RUST_LOG (or RDMABLK_LOG) says otherwise. The
    // options are fio's, so the format comes from RDMABLK_LOG_FORMAT only.
    Logging::new("rdmablk-bench", "warn").init();
    let args: Vec<String> = std::env::args().skip(1).collect();
    std::process::exit(rdmablk_bench::main_with_args(&args));
}
