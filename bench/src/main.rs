//! rdmablk-bench: a fio-style benchmark for rdmablk targets. See the
//! library ([`rdmablk_bench`]) and `rdmablk-bench --help`.

use tracing_subscriber::EnvFilter;

fn main() {
    // The embedded target and the initiator log through tracing: warnings
    // and errors only, unless RUST_LOG says otherwise.
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("warn"));
    tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).init();
    let args: Vec<String> = std::env::args().skip(1).collect();
    std::process::exit(rdmablk_bench::main_with_args(&args));
}
