//! The `rdmablk-target` command line, in the library so that the package's
//! man page and shell completions are generated from it (`docgen/`), not
//! written again by hand.

use std::path::PathBuf;

use clap::Parser;
use rdmablk_common::logging::LogFormat;

/// Remote block storage target (NVMe-oF/RDMA style, direct data placement).
/// SIGHUP reloads the configuration; SIGTERM stops cleanly.
#[derive(Parser, Debug)]
#[command(name = "rdmablk-target", version, about)]
pub struct Args {
    /// Configuration file (TOML).
    #[arg(long, short = 'c', value_name = "FILE")]
    pub config: PathBuf,
    /// Validate the configuration and the volumes, print what would be served, and exit.
    #[arg(long)]
    pub check: bool,
    /// Log format on stderr [default: $RDMABLK_LOG_FORMAT or text]. The filter comes from RUST_LOG (or
    /// RDMABLK_LOG; default: info); under systemd lines carry journald priorities.
    #[arg(long, value_enum, value_name = "FORMAT")]
    pub log_format: Option<LogFormat>,
}
