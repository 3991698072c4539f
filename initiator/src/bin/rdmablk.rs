//! `rdmablk`: command-line access to volumes of an rdmablk target.
//! Everything but logging setup lives in `rdmablk_initiator::cli`.

fn main() {
    // Logs only when asked for: a failing command prints exactly one line.
    if let Ok(filter) = std::env::var("RDMABLK_LOG") {
        tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::new(filter))
            .with_writer(std::io::stderr)
            .init();
    }
    std::process::exit(rdmablk_initiator::cli::main(std::env::args_os()));
}
