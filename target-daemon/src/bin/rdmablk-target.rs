//! rdmablk-target: exports volumes over the fabric.
//!
//! Signals: SIGHUP reloads the configuration file (volumes only); SIGTERM
//! and SIGINT stop cleanly (in-flight commands finish, writable volumes are
//! flushed, exit 0). Under systemd (`Type=notify`) it reports READY, STATUS
//! and WATCHDOG through `NOTIFY_SOCKET`.
//!
//! Exit codes: 0 on a clean shutdown (or a passing `--check`), 2 for an
//! invalid configuration or a volume that disagrees with it (clap's usage
//! errors are 2 as well), 1 for anything else.

use std::io::IsTerminal;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, ValueEnum};
use rdmablk_target::Config;
use tracing_subscriber::EnvFilter;

#[derive(Clone, Copy, Debug, ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

/// Remote block storage target (NVMe-oF/RDMA style, direct data placement).
/// SIGHUP reloads the configuration; SIGTERM stops cleanly.
#[derive(Parser, Debug)]
#[command(name = "rdmablk-target", version, about)]
struct Args {
    /// Configuration file (TOML).
    #[arg(long, short = 'c', value_name = "FILE")]
    config: PathBuf,
    /// Validate the configuration and the volumes, print what would be served, and exit.
    #[arg(long)]
    check: bool,
    /// Log format on stderr; the level comes from RUST_LOG (default: info).
    #[arg(long, value_enum, default_value_t = LogFormat::Text)]
    log_format: LogFormat,
}

fn main() -> ExitCode {
    let args = Args::parse();
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal());
    match args.log_format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().init(),
    }

    let result = Config::load(&args.config).and_then(|config| {
        if args.check {
            for line in rdmablk_target::check(&config)? {
                println!("{line}");
            }
            Ok(())
        } else {
            rdmablk_target::run(config)
        }
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("rdmablk-target: {e}");
            ExitCode::from(e.exit_code() as u8)
        }
    }
}
