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

use std::process::ExitCode;

use clap::Parser;
use rdmablk_common::logging::Logging;
// The options live in the library: the man page and completions are generated from them (docgen/).
use rdmablk_target::cli::Args;
use rdmablk_target::Config;

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
