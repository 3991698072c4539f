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

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use rdmablk_common::logging::{LogFormat, Logging};
use rdmablk_target::Config;

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
    /// Log format on stderr [default: $RDMABLK_LOG_FORMAT or text]. The filter comes from RUST_LOG (or
    /// RDMABLK_LOG; default: info); under systemd lines carry journald priorities.
    #[arg(long, value_enum, value_name = "FORMAT")]
    log_format: Option<LogFormat>,
}

fn main() -> ExitCode {
    let args = Args::parse();
    Logging::new("rdmablk-target", "info").format(args.log_format).init();

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
