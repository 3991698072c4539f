//! The `rdmablk` command-line tool. The binary only calls [`main`]; parsing
//! and every command live here so they can be tested.
//!
//! ```text
//! rdmablk --target URL list [-o json]
//! rdmablk --target URL info VOL [-o json]
//! rdmablk --target URL read VOL --offset N --length N [--output FILE]
//! rdmablk --target URL write VOL --offset N [--input FILE] [--fua]
//! rdmablk --target URL flush VOL
//! rdmablk --target URL discard VOL --offset N --length N
//! rdmablk --target URL write-zeroes VOL --offset N --length N
//! rdmablk --target URL nbd VOL (--socket PATH | --listen 127.0.0.1:PORT) [--queues N] [--handshake-timeout 30s]
//! ```
//!
//! Sizes take suffixes (`4k`, `1MiB`, binary multiples). Errors print one
//! line, `rdmablk: error: ...`, and exit with 1 (2 for usage errors; `--help`
//! says so). `list` and `info` print a header and human sizes, or JSON with
//! nvme-cli's `-o json` / `--output-format json`.
//!
//! `read` and `write` move the data through registered buffers with the
//! library's submission queue, several chunks in flight at once (zero copy
//! between the wire and the buffers). On a terminal, transfers of 64 MiB or
//! more show their progress (bytes and rate) on standard error;
//! `--progress always|never` overrides that.
//!
//! A connection that breaks during a command is re-established (the
//! library's reconnection); `--ctrl-loss-timeout` (or nvme-cli's spelling,
//! `--ctrl_loss_tmo`) bounds how long the tool keeps trying (0 disables
//! reconnection; without either, the library's default, 60 s).
//!
//! A volume that several gateways serve (one at a time) is given as the
//! list of their URLs, `--target tcp://A:7420,tcp://B:7420`: the tool
//! connects to the first that answers and fails over to the others, in
//! list order, when its gateway is lost or answers `NotOwner`.

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::fs::File;
use std::io::{IsTerminal, Read, Write};
use std::os::fd::AsFd;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use clap::{ColorChoice, Parser, Subcommand, ValueEnum};
use rdmablk_common::protocol::{Opcode, SessionId};
use rdmablk_common::size::ByteSize;

use crate::buffer::IoBuffer;
use crate::device::{check_request, BlockDevice};
use crate::error::{Error, Result};
use crate::io_queue::{IoCompletion, IoRequest};
use crate::options::ConnectOptions;
use crate::session::{IntoTargetUrl, Session, Volume};
use crate::targets::Targets;

pub use crate::duration::{parse_ctrl_loss_timeout, parse_duration, parse_duration_or_zero};

/// Largest transfer one CLI step moves through its registered buffer.
const CLI_CHUNK: u64 = 8 << 20;
/// Chunks in flight at once.
const CLI_DEPTH: usize = 4;
/// Transfers at least this large show progress on a terminal.
const LARGE_TRANSFER: u64 = 64 << 20;

/// When to show progress.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Default)]
pub enum ProgressMode {
    /// On a terminal, for transfers of 64 MiB or more.
    #[default]
    Auto,
    /// Always (a line per second when standard error is not a terminal).
    Always,
    /// Never.
    Never,
}

/// How `list` and `info` print (nvme-cli's `-o` / `--output-format`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Default)]
pub enum OutputFormat {
    /// A header and human sizes (with the exact bytes)
    #[default]
    Normal,
    /// One JSON object, sizes in bytes
    Json,
}

/// The exit codes, in `--help` and the README.
const EXIT_CODES: &str = "Exit status:\n  0  success\n  1  the command failed: one line on standard error, \
                          `rdmablk: error: ...`, naming the problem\n  2  usage error (a bad option or value)";

/// Command line of `rdmablk`.
#[derive(Parser, Debug, Clone, PartialEq, Eq)]
#[command(
    name = "rdmablk",
    version,
    about = "Access volumes of an rdmablk target",
    after_help = EXIT_CODES,
    color = ColorChoice::Never,
    propagate_version = true
)]
pub struct Cli {
    /// Target address, e.g. tcp://192.0.2.1:7420; a volume served by several gateways: all their
    /// URLs, comma-separated (tcp://A:4420,tcp://B:4420), tried in that order and failed over
    #[arg(long, short = 't', value_name = "URL[,URL...]", global = true)]
    pub target: Option<String>,
    /// Host identifier sent to the target (default: this machine's host name)
    #[arg(long, value_name = "ID", global = true)]
    pub host_id: Option<String>,
    /// Pre-shared key file of the host id (see `keygen`): authenticate both ways before connecting
    #[arg(long, value_name = "PATH", global = true)]
    pub key_file: Option<PathBuf>,
    /// Connect and per-command timeout: 30, 30s, 500ms, 2m
    #[arg(long, value_name = "DURATION", value_parser = parse_duration, global = true)]
    pub timeout: Option<Duration>,
    /// How long to keep reconnecting after the connection breaks: 30, 30s, 2m (0: do not reconnect;
    /// default 60s). --ctrl_loss_tmo is nvme-cli's spelling
    #[arg(
        long,
        visible_alias = "ctrl_loss_tmo",
        value_name = "DURATION",
        value_parser = parse_ctrl_loss_timeout,
        allow_hyphen_values = true,
        global = true
    )]
    pub ctrl_loss_timeout: Option<Duration>,
    /// Progress on standard error for read and write
    #[arg(long, value_enum, value_name = "WHEN", default_value_t, global = true)]
    pub progress: ProgressMode,
    /// Log lines on standard error: text or json [default: $RDMABLK_LOG_FORMAT or text]; the filter is
    /// RUST_LOG (or RDMABLK_LOG)
    #[arg(long, value_enum, value_name = "FORMAT", global = true)]
    pub log_format: Option<rdmablk_common::logging::LogFormat>,
    #[command(subcommand)]
    pub command: Command,
}

/// The subcommands.
#[derive(Subcommand, Debug, Clone, PartialEq, Eq)]
pub enum Command {
    /// The volumes this host may open: name, size, bytes, block size, ro|rw
    List {
        /// normal (a header, human sizes) or json
        #[arg(long, short = 'o', value_enum, value_name = "FORMAT", default_value_t)]
        output_format: OutputFormat,
    },
    /// Write a new random key file (mode 0600) for a host id: give the same
    /// file to the target's `[[host]]` entry and to --key-file
    Keygen {
        /// The file to create (never overwritten)
        path: PathBuf,
    },
    /// Details of one volume and of the connection
    Info {
        /// Volume name
        volume: String,
        /// normal (a header, key: value lines, human sizes) or json
        #[arg(long, short = 'o', value_enum, value_name = "FORMAT", default_value_t)]
        output_format: OutputFormat,
        /// Same as -o json
        #[arg(long)]
        json: bool,
    },
    /// Read a byte range of a volume to a file or standard output
    Read {
        /// Volume name
        volume: String,
        /// Byte offset (a multiple of the block size)
        #[arg(long, value_parser = parse_size)]
        offset: u64,
        /// Bytes to read (a multiple of the block size)
        #[arg(long, value_parser = parse_size)]
        length: u64,
        /// Output file (default: standard output)
        #[arg(long, short = 'o')]
        output: Option<PathBuf>,
    },
    /// Write a file or standard input to a volume; the length is the input's
    Write {
        /// Volume name
        volume: String,
        /// Byte offset (a multiple of the block size)
        #[arg(long, value_parser = parse_size)]
        offset: u64,
        /// Input file (default: standard input)
        #[arg(long, short = 'i')]
        input: Option<PathBuf>,
        /// Make the data durable before each write returns (Force Unit Access)
        #[arg(long)]
        fua: bool,
    },
    /// Make every completed write to the volume durable
    Flush {
        /// Volume name
        volume: String,
    },
    /// Deallocate a byte range; its contents become unspecified
    Discard {
        /// Volume name
        volume: String,
        /// Byte offset (a multiple of the block size)
        #[arg(long, value_parser = parse_size)]
        offset: u64,
        /// Bytes (a multiple of the block size)
        #[arg(long, value_parser = parse_size)]
        length: u64,
    },
    /// Set a byte range to zeroes
    WriteZeroes {
        /// Volume name
        volume: String,
        /// Byte offset (a multiple of the block size)
        #[arg(long, value_parser = parse_size)]
        offset: u64,
        /// Bytes (a multiple of the block size)
        #[arg(long, value_parser = parse_size)]
        length: u64,
    },
    /// Serve a volume as an NBD export (fixed newstyle) until SIGINT or SIGTERM (a second one
    /// gives up waiting for requests in flight and the final flush); prints its URI on standard
    /// output when ready
    // One of --socket and --listen: a group, so that the error without either names both.
    #[command(group = clap::ArgGroup::new("address").required(true).args(["socket", "listen"]))]
    Nbd {
        /// Volume name (also the export name; the empty default name selects it too)
        volume: String,
        /// Listen on a unix socket at PATH (a stale socket is replaced, any other file refused)
        #[arg(long, value_name = "PATH")]
        socket: Option<PathBuf>,
        /// Listen on a TCP address, e.g. 127.0.0.1:10809 (NBD has no authentication)
        #[arg(long, value_name = "ADDR:PORT")]
        listen: Option<std::net::SocketAddr>,
        /// Queue pairs of the session, shared round-robin by the NBD connections (default: one per CPU)
        #[arg(long, value_name = "N")]
        queues: Option<usize>,
        /// How long a client may take to negotiate, from connecting to choosing the export
        #[arg(long, value_name = "DURATION", value_parser = parse_duration, default_value = "30s")]
        handshake_timeout: Duration,
    },
    // ublk: rdmablk attach / detach (initiator/src/ublk/).
    /// Serve a volume as a kernel block device, /dev/ublkbN (ublk; root, modprobe ublk_drv),
    /// until SIGINT, SIGTERM or `rdmablk detach`; prints the device path when ready
    Attach {
        /// Volume name (or `volume` in --config)
        #[arg(required_unless_present = "config")]
        volume: Option<String>,
        /// ublk queues, one session queue pair and one thread each
        #[arg(long, value_name = "N", default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=32))]
        queues: u16,
        /// Requests in flight per queue (each holds a registered buffer of the max I/O size)
        #[arg(long, value_name = "D", default_value_t = 64, value_parser = clap::value_parser!(u16).range(1..=4096))]
        depth: u16,
        /// An attach file (/etc/rdmablk/attach/NAME.toml, see rdmablk-attach@.service): target,
        /// volume and options from it; waits for the target to answer instead of failing, and tells
        /// systemd READY=1 once the device exists
        #[arg(long, value_name = "FILE", conflicts_with_all = ["volume", "queues", "depth", "target", "host_id", "key_file", "ctrl_loss_timeout"])]
        config: Option<PathBuf>,
        /// Check the --config file (its keys, the target URL, the key file) and exit: 0 when it is
        /// usable; neither the target nor ublk is touched
        #[arg(long, requires = "config", conflicts_with = "volume")]
        check: bool,
    },
    /// Stop and remove a device made by `rdmablk attach` (refused while a file system on it is mounted)
    Detach {
        /// The device, e.g. /dev/ublkb0
        device: String,
    },
}

/// Parses a size with an optional suffix (`4k`, `1MiB`).
pub fn parse_size(s: &str) -> std::result::Result<u64, String> {
    ByteSize::parse(s).map(|b| b.0).map_err(|e| e.to_string())
}

/// Runs the tool on `args` (including the program name), printing to the
/// real standard output and error; returns the exit code.
pub fn main<I, T>(args: I) -> i32
where
    I: IntoIterator<Item = T>,
    T: Into<OsString> + Clone,
{
    let cli = match Cli::try_parse_from(args) {
        Ok(cli) => cli,
        Err(e) => {
            use clap::error::ErrorKind as K;
            if matches!(e.kind(), K::DisplayHelp | K::DisplayVersion | K::DisplayHelpOnMissingArgumentOrSubcommand) {
                let _ = e.print();
                return if e.kind() == K::DisplayHelpOnMissingArgumentOrSubcommand { 2 } else { 0 };
            }
            eprintln!("rdmablk: error: {}", clap_one_line(&e));
            return 2;
        }
    };
    init_logging(&cli);
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    match run(&cli, &mut out) {
        Ok(()) => 0,
        Err(e) => {
            let _ = out.flush();
            eprintln!("rdmablk: error: {}", e.one_line());
            1
        }
    }
}

/// Logging on standard error (rdmablk_common::logging). `RUST_LOG` (or
/// `RDMABLK_LOG`; a filter: `debug`, `rdmablk_initiator=trace`) logs what it
/// names; without either `nbd`, a server, logs at info level, and the other
/// commands print only the reconnection's progress (`rdmablk: tcp://H:P:
/// connection lost, reconnecting (up to 60 s): ...`, each attempt, the
/// outcome), as the kernel's NVMe host does, so a failing command otherwise
/// prints one line.
fn init_logging(cli: &Cli) {
    let reconnect_only = format!("off,{}=info", crate::connection_set::RECONNECT_LOG);
    let nbd = matches!(cli.command, Command::Nbd { .. });
    let default = if nbd { "info" } else { reconnect_only.as_str() };
    rdmablk_common::logging::Logging::new("rdmablk", default).format(cli.log_format).terse_default(!nbd).init();
}

/// Condenses a clap error to one line, without the usage and tips.
pub fn clap_one_line(e: &clap::Error) -> String {
    let text = e.render().to_string();
    let mut parts = Vec::new();
    for line in text.lines() {
        let line = line.trim();
        if line.starts_with("Usage:") {
            break;
        }
        if line.is_empty() || line.starts_with("tip:") || line.starts_with("For more information") {
            continue;
        }
        parts.push(line.strip_prefix("error: ").unwrap_or(line).to_owned());
    }
    if parts.is_empty() {
        "invalid command line".to_owned()
    } else {
        parts.join(" ")
    }
}

fn connect(cli: &Cli) -> Result<Session> {
    // One thread: one queue pair.
    connect_with(cli, ConnectOptions { queues: 1, ..ConnectOptions::default() })
}

fn connect_with(cli: &Cli, options: ConnectOptions) -> Result<Session> {
    let (target, options) = connect_options(cli, options)?;
    Session::connect(target.as_str(), options).map_err(|e| explain(&target, e))
}

/// `e`, a failed connect to `target`, or the error naming what answered
/// there when that is not an rdmablk target (an NVMe/TCP port, a web server);
/// with several gateways, for each of them.
fn explain(target: &str, e: Error) -> Error {
    match e {
        Error::NoGateway { failures } => {
            let failures = failures
                .into_iter()
                .map(|(url, e)| {
                    let e = explain(&url, e);
                    (url, e)
                })
                .collect();
            Error::NoGateway { failures }
        }
        e => match target.into_target_url() {
            Ok(url) => crate::probe::explain_connect_error(&url, e),
            Err(_) => e,
        },
    }
}

/// The target and the connect options the command line gives.
fn connect_options(cli: &Cli, mut options: ConnectOptions) -> Result<(String, ConnectOptions)> {
    let target =
        cli.target.clone().ok_or_else(|| Error::invalid("no target given: use --target tcp://HOST:PORT"))?;
    options = with_identity(options, cli.host_id.as_deref(), cli.key_file.as_deref(), cli.ctrl_loss_timeout)?;
    if let Some(t) = cli.timeout {
        options.connect_timeout = t;
        options.io_timeout = t;
    }
    Ok((target, options))
}

/// `options` with what the command line or an attach file gives: host id,
/// key file and ctrl_loss_timeout, each where given.
fn with_identity(
    mut options: ConnectOptions,
    host_id: Option<&str>,
    key_file: Option<&std::path::Path>,
    ctrl_loss_timeout: Option<Duration>,
) -> Result<ConnectOptions> {
    if let Some(id) = host_id {
        options.host_id = id.to_owned();
    }
    if let Some(path) = key_file {
        options = options.with_key_file(path)?;
    }
    if let Some(t) = ctrl_loss_timeout {
        options.ctrl_loss_timeout = t;
    }
    Ok(options)
}

/// `rdmablk attach`: from the command line, or from an attach file
/// (`--config`, the boot unit's way), which also waits for the target.
/// A device of the same target and volume whose `rdmablk attach` died is
/// taken back (ublk user recovery) instead of a new one being made.
fn run_attach(cli: &Cli, volume: Option<&str>, queues: u16, depth: u16, config: Option<&std::path::Path>) -> Result<()> {
    use crate::ublk::{AttachRecord, RECORD_DIR};
    let notifier = rdmablk_common::notify::Notifier::from_env();
    let (target, volume, opts, options, retry) = match config {
        None => {
            let (target, options) =
                connect_options(cli, ConnectOptions { queues: usize::from(queues), ..ConnectOptions::default() })?;
            let volume = volume.expect("clap: a volume unless --config").to_owned();
            (target, volume, crate::ublk::AttachOptions { queues, depth }, options, None)
        }
        Some(path) => {
            let (file, opts, options) = load_attach_file(path, queues, depth)?;
            (file.target, file.volume, opts, options, Some(file.connect_retry))
        }
    };
    // One URL, or the gateways' list: what the records name.
    let url = Targets::parse(&target)?.to_string();
    // After the file's checks: a host without ublk still hears what is wrong with it.
    crate::ublk::check_machine()?;
    let orphan =
        AttachRecord::orphans_in(std::path::Path::new(RECORD_DIR), &url, &volume, crate::ublk::pid_alive).into_iter().next();
    // The gateway the dead process's session was at (a record of several gateways says).
    let replaced_at = match orphan.as_ref().and_then(|r| r.gateway.as_deref()) {
        Some(g) => Some(g.parse::<rdmablk_common::fabric::FabricUrl>().map_err(|e| {
            Error::invalid(format!("the attach record of /dev/ublkb{}: gateway: {e}", orphan.as_ref().map_or(0, |r| r.dev_id)))
        })?),
        None => None,
    };
    let replaced = match &orphan {
        None => SessionId(0),
        Some(r) => {
            eprintln!(
                "rdmablk: taking back /dev/ublkb{} ({} on {}): its rdmablk attach (pid {}) has ended",
                r.dev_id, r.volume, r.target, r.pid
            );
            if r.host_id == options.host_id {
                r.session_id()?
            } else {
                eprintln!(
                    "rdmablk: its session was host {:?}'s, not {:?}'s: the target cannot retire it for this one",
                    r.host_id, options.host_id
                );
                SessionId(0)
            }
        }
    };
    let session = match retry {
        None => connect_replacing(&target, options, replaced, replaced_at.as_ref()).map_err(|e| explain(&target, e))?,
        Some(retry) => connect_until_answered(&target, &options, replaced, replaced_at.as_ref(), retry, &notifier)?,
    };
    let vol = session.open(&volume)?;
    // The path goes to standard output from the thread that starts the device.
    crate::ublk::attach(session, vol, &opts, orphan, move |path| {
        let mut stdout = std::io::stdout();
        let _ = writeln!(stdout, "{path}");
        let _ = stdout.flush();
        notifier.notify(&format!("READY=1\nSTATUS=volume {volume} as {path}"));
    })
}

/// Reads and checks an attach file: its keys, its target URL and its key
/// file; returns it with the device and connect options it gives.
fn load_attach_file(
    path: &std::path::Path,
    queues: u16,
    depth: u16,
) -> Result<(crate::attach_file::AttachFile, crate::ublk::AttachOptions, ConnectOptions)> {
    let file = crate::attach_file::AttachFile::load(path)?;
    Targets::parse(&file.target).map_err(|e| Error::invalid(format!("{}: target: {}", path.display(), e.one_line())))?;
    let opts = crate::ublk::AttachOptions {
        queues: file.queues.map_or(queues, |q| q as u16),
        depth: file.depth.map_or(depth, |d| d as u16),
    };
    let options = with_identity(
        ConnectOptions { queues: usize::from(opts.queues), ..ConnectOptions::default() },
        file.host_id.as_deref(),
        file.key_file.as_deref(),
        file.ctrl_loss_timeout,
    )
    .map_err(|e| Error::invalid(format!("{}: {}", path.display(), e.one_line())))?;
    Ok((file, opts, options))
}

/// `rdmablk attach --check --config FILE`: checks the file as `attach`
/// does, says what it would attach, and touches neither the target nor ublk.
fn check_attach_file(path: &std::path::Path, queues: u16, depth: u16, out: &mut dyn Write) -> Result<()> {
    let (file, opts, options) = load_attach_file(path, queues, depth)?;
    let auth = match &file.key_file {
        Some(k) => format!(", authenticated with {}", k.display()),
        None => String::new(),
    };
    writeln!(
        out,
        "{}: ok: volume {} on {} as host {}{auth}; {} queues of depth {}, ctrl_loss_timeout {}, connect_retry {}",
        path.display(),
        file.volume,
        file.target,
        options.host_id,
        opts.queues,
        opts.depth,
        crate::error::fmt_duration(options.ctrl_loss_timeout),
        crate::error::fmt_duration(file.connect_retry)
    )
    .map_err(|e| Error::io("writing the output", e))
}

/// [`Session::connect_replacing`], or with the replaced session's gateway
/// when a record of several gateways names it.
fn connect_replacing(
    target: &str,
    options: ConnectOptions,
    replaced: SessionId,
    replaced_at: Option<&rdmablk_common::fabric::FabricUrl>,
) -> Result<Session> {
    match replaced_at {
        Some(gateway) => Session::connect_replacing_at(target, options, replaced, gateway),
        None => Session::connect_replacing(target, options, replaced),
    }
}

/// Whether a failed connect is worth trying again: nothing answered (with
/// several gateways, at none of them).
fn unanswered(e: &Error) -> bool {
    use crate::ErrorKind as K;
    match e {
        Error::NoGateway { failures } => failures.iter().all(|(_, e)| unanswered(e)),
        _ => matches!(e.kind(), K::Fabric | K::Timeout | K::Disconnected | K::TargetLost),
    }
}

/// Connects, trying again every `retry` while the target cannot be reached
/// at all (at boot the network or the target may not be up yet); any other
/// failure (authentication, a refused CONNECT, a bad key file) is final.
/// `replaced_at`: the gateway of `replaced`, when `target` lists several.
pub fn connect_until_answered(
    target: &str,
    options: &ConnectOptions,
    replaced: SessionId,
    replaced_at: Option<&rdmablk_common::fabric::FabricUrl>,
    retry: Duration,
    notifier: &rdmablk_common::notify::Notifier,
) -> Result<Session> {
    let mut attempts = 0u64;
    loop {
        // A port that answers as something else (NVMe/TCP, HTTP) is final.
        match connect_replacing(target, options.clone(), replaced, replaced_at).map_err(|e| explain(target, e)) {
            Ok(s) => {
                if attempts > 0 {
                    eprintln!("rdmablk: connected to {target} after {} failed attempts", attempts);
                }
                return Ok(s);
            }
            Err(e) if unanswered(&e) => {
                attempts += 1;
                let line = format!("waiting for the target {target}: {} (attempt {attempts}, next in {retry:?})", e.one_line());
                eprintln!("rdmablk: {line}");
                notifier.notify(&format!("STATUS={line}"));
                std::thread::sleep(retry);
            }
            Err(e) => return Err(e),
        }
    }
}

/// Runs a parsed command; normal output goes to `out`.
pub fn run(cli: &Cli, out: &mut dyn Write) -> Result<()> {
    let write_err = |e| Error::io("writing the output", e);
    if let Command::Keygen { path } = &cli.command {
        rdmablk_common::auth::generate_key_file(path).map_err(|e| Error::invalid(e.to_string()))?;
        return writeln!(out, "wrote a new key to {} (mode 0600)", path.display()).map_err(write_err);
    }
    if let Command::Nbd { volume, socket, listen, queues, handshake_timeout } = &cli.command {
        return serve_nbd(cli, volume, socket.as_deref(), *listen, *queues, *handshake_timeout, out);
    }
    // ublk: rdmablk attach / detach.
    if let Command::Attach { volume, queues, depth, config, check } = &cli.command {
        if *check {
            return check_attach_file(config.as_deref().expect("clap: --check requires --config"), *queues, *depth, out);
        }
        return run_attach(cli, volume.as_deref(), *queues, *depth, config.as_deref());
    }
    if let Command::Detach { device } = &cli.command {
        return crate::ublk::detach(device, out);
    }
    let session = connect(cli)?;
    match &cli.command {
        Command::Keygen { .. } | Command::Nbd { .. } => unreachable!("handled above"),
        Command::Attach { .. } | Command::Detach { .. } => unreachable!("handled above"),
        Command::List { output_format } => {
            let volumes = session.list_volumes()?;
            if *output_format == OutputFormat::Json {
                let list: Vec<_> = volumes
                    .iter()
                    .map(|v| {
                        serde_json::json!({
                            "name": v.name,
                            "id": v.volume_id.0,
                            "size": v.size_bytes,
                            "block_size": v.block_size,
                            "read_only": v.read_only(),
                        })
                    })
                    .collect();
                let doc = serde_json::json!({ "target_name": session.target_name(), "volumes": list });
                writeln!(out, "{doc}").map_err(write_err)?;
            } else {
                out.write_all(format_list(&volumes).as_bytes()).map_err(write_err)?;
            }
        }
        Command::Info { volume, output_format, json } => {
            let vol = session.open(volume)?;
            let limits = session.limits();
            let mut info = serde_json::json!({
                "name": vol.name(),
                "id": vol.id().0,
                "size": vol.size(),
                "block_size": vol.block_size(),
                "read_only": vol.read_only(),
                "discard": vol.supports_discard(),
                "write_zeroes": vol.supports_write_zeroes(),
                "target_name": session.target_name(),
                "queue_depth": limits.queue_depth,
                "max_io_size": limits.max_io_size,
                "inline_data_size": limits.inline_data_size,
            });
            if session.targets().len() > 1 {
                // Which of the volume's gateways serves it now.
                info["gateway"] = serde_json::json!(session.url().to_string());
            }
            if *json || *output_format == OutputFormat::Json {
                writeln!(out, "{info}").map_err(write_err)?;
            } else {
                let url = cli.target.as_deref().unwrap_or_default();
                writeln!(out, "volume {} on {url} (target {:?})", vol.name(), session.target_name()).map_err(write_err)?;
                let map = info.as_object().expect("object");
                for key in [
                    "name",
                    "id",
                    "size",
                    "block_size",
                    "read_only",
                    "discard",
                    "write_zeroes",
                    "target_name",
                    "queue_depth",
                    "max_io_size",
                    "inline_data_size",
                    "gateway",
                ] {
                    let Some(v) = map.get(key) else { continue };
                    let text = match (key, v.as_u64()) {
                        ("size" | "max_io_size" | "inline_data_size", Some(n)) if n >= 1024 => {
                            format!("{} ({n} bytes)", human_bytes(n))
                        }
                        _ => v.as_str().map(str::to_owned).unwrap_or_else(|| v.to_string()),
                    };
                    writeln!(out, "{key}: {text}").map_err(write_err)?;
                }
            }
            vol.close()?;
        }
        Command::Read { volume, offset, length, output } => {
            let vol = session.open(volume)?;
            check_request(Opcode::Read, *offset, *length, vol.block_size(), vol.size())?;
            let mut file;
            let out: &mut dyn Write = match output {
                Some(path) => {
                    file = File::create(path).map_err(|e| Error::io(format!("creating {}", path.display()), e))?;
                    &mut file
                }
                None => out,
            };
            let mut progress = Progress::new(cli.progress, Some(*length));
            read_range(&session, &vol, *offset, *length, out, &mut progress)?;
            progress.finish();
            out.flush().map_err(write_err)?;
            vol.close()?;
        }
        Command::Write { volume, offset, input, fua } => {
            let vol = session.open(volume)?;
            let (mut file, name) = match input {
                Some(path) => (
                    File::open(path).map_err(|e| Error::io(format!("opening {}", path.display()), e))?,
                    path.display().to_string(),
                ),
                None => {
                    let fd = std::io::stdin()
                        .as_fd()
                        .try_clone_to_owned()
                        .map_err(|e| Error::io("duplicating standard input", e))?;
                    (File::from(fd), "standard input".to_owned())
                }
            };
            let meta = file.metadata().map_err(|e| Error::io(format!("inspecting {name}"), e))?;
            // A regular file's length is known: check the whole request
            // before writing anything. From a pipe each chunk is checked
            // before it is sent, so a misaligned tail fails after the
            // aligned chunks before it were written.
            let known_len = meta.is_file().then_some(meta.len());
            if let Some(len) = known_len {
                check_request(Opcode::Write, *offset, len, vol.block_size(), vol.size())?;
            }
            let mut progress = Progress::new(cli.progress, known_len);
            let written = write_stream(&session, &vol, *offset, &mut file, &name, known_len, *fua, &mut progress)?;
            progress.finish();
            if written == 0 {
                check_request(Opcode::Write, *offset, 0, vol.block_size(), vol.size())?;
            }
            vol.close()?;
        }
        Command::Discard { volume, offset, length } => {
            let vol = session.open(volume)?;
            vol.discard(*offset, *length)?;
            vol.close()?;
        }
        Command::WriteZeroes { volume, offset, length } => {
            let vol = session.open(volume)?;
            vol.write_zeroes(*offset, *length)?;
            vol.close()?;
        }
        Command::Flush { volume } => {
            let vol = session.open(volume)?;
            vol.flush()?;
            vol.close()?;
        }
    }
    Ok(())
}

/// `rdmablk nbd`: serves `volume` until SIGINT or SIGTERM (see [`crate::nbd`]).
fn serve_nbd(
    cli: &Cli,
    volume: &str,
    socket: Option<&std::path::Path>,
    listen: Option<std::net::SocketAddr>,
    queues: Option<usize>,
    handshake_timeout: Duration,
    out: &mut dyn Write,
) -> Result<()> {
    use crate::nbd::{Listen, Server, StopSignals};
    // Before the session starts its threads, so that they inherit the mask.
    let signals = StopSignals::catch().map_err(|e| Error::io("catching SIGINT and SIGTERM", e))?;
    let mut options = ConnectOptions::default();
    if let Some(q) = queues {
        options.queues = q;
    }
    let session = connect_with(cli, options)?;
    let vol = session.open(volume)?;
    let listen = match (socket, listen) {
        (Some(path), _) => Listen::Unix(path.to_owned()),
        (None, Some(addr)) => Listen::Tcp(addr),
        (None, None) => return Err(Error::invalid("give --socket PATH or --listen ADDR:PORT")),
    };
    let server = Server::bind(&session, vol, &listen)?.with_handshake_timeout(handshake_timeout);
    signals.stop_on_signal(server.stopper()).map_err(|e| Error::io("starting the signal thread", e))?;
    writeln!(out, "{}", server.uri()).and_then(|()| out.flush()).map_err(|e| Error::io("writing the output", e))?;
    server.run()
}

/// Reads `[offset, offset + length)` (checked) into `out`, in order, with
/// up to [`CLI_DEPTH`] chunks in flight in registered buffers.
fn read_range(
    session: &Session,
    vol: &Volume,
    offset: u64,
    length: u64,
    out: &mut dyn Write,
    progress: &mut Progress,
) -> Result<()> {
    let chunk = chunk_size(length, vol.block_size());
    if length == 0 {
        return Ok(());
    }
    let chunks = length.div_ceil(chunk);
    let mut queue = session.io_queue();
    let mut free: Vec<IoBuffer> =
        (0..CLI_DEPTH.min(chunks as usize)).map(|_| session.alloc_buffer(chunk as usize)).collect::<Result<_>>()?;
    let mut ready: BTreeMap<u64, IoBuffer> = BTreeMap::new();
    let mut done: Vec<IoCompletion> = Vec::new();
    let (mut next_submit, mut next_out) = (0u64, 0u64);
    let len_of = |i: u64| chunk.min(length - i * chunk) as usize;
    while next_out < chunks {
        while next_submit < chunks {
            let Some(buf) = free.pop() else { break };
            let request = IoRequest::read(vol, offset + next_submit * chunk, buf).with_range(0, len_of(next_submit));
            queue.submit(request, next_submit);
            next_submit += 1;
        }
        queue.wait(&mut done, 1, None);
        for c in done.drain(..) {
            c.result?;
            ready.insert(c.tag, c.buffer.expect("reads hand their buffer back"));
        }
        // Out in order, as chunks become ready.
        while let Some(buf) = ready.remove(&next_out) {
            let n = len_of(next_out);
            out.write_all(&buf.as_slice()[..n]).map_err(|e| Error::io("writing the output", e))?;
            progress.add(n as u64);
            free.push(buf);
            next_out += 1;
        }
    }
    Ok(())
}

/// Writes `input` at `offset` until it ends, with up to [`CLI_DEPTH`]
/// chunks in flight; the data goes from the input straight into registered
/// memory. Returns the bytes written.
#[allow(clippy::too_many_arguments)]
fn write_stream(
    session: &Session,
    vol: &Volume,
    offset: u64,
    input: &mut dyn Read,
    name: &str,
    known_len: Option<u64>,
    fua: bool,
    progress: &mut Progress,
) -> Result<u64> {
    let bs = vol.block_size();
    let chunk = chunk_size(known_len.unwrap_or(CLI_CHUNK), bs).max(u64::from(bs));
    let mut queue = session.io_queue();
    let mut free: Vec<IoBuffer> = Vec::new();
    let mut allocated = 0;
    let mut done: Vec<IoCompletion> = Vec::new();
    let mut pos = offset;
    let mut finished = false;
    loop {
        // Reap what is done; wait only when no buffer is free.
        let must_wait = free.is_empty() && allocated == CLI_DEPTH;
        if queue.outstanding() > 0 {
            if must_wait || finished {
                queue.wait(&mut done, 1, None);
            } else {
                queue.poll(&mut done);
            }
        }
        for c in done.drain(..) {
            c.result?;
            progress.add(c.tag);
            free.push(c.buffer.expect("writes hand their buffer back"));
        }
        if finished {
            if queue.outstanding() == 0 {
                return Ok(pos - offset);
            }
            continue;
        }
        let mut buf = match free.pop() {
            Some(b) => b,
            None if allocated < CLI_DEPTH => {
                allocated += 1;
                session.alloc_buffer(chunk as usize)?
            }
            None => continue,
        };
        let n = fill(input, buf.as_mut_slice()).map_err(|e| Error::io(format!("reading {name}"), e))?;
        if n == 0 {
            finished = true;
            continue;
        }
        // Checked before it is sent (a pipe's length is not known ahead).
        if let Err(e) = check_request(Opcode::Write, pos, n as u64, bs, vol.size()) {
            drop(queue); // waits for the chunks in flight
            return Err(e);
        }
        let mut request = IoRequest::write(vol, pos, buf).with_range(0, n);
        if fua {
            request = request.with_fua();
        }
        queue.submit(request, n as u64);
        pos += n as u64;
        if n < chunk as usize {
            finished = true;
        }
    }
}

/// Progress of a transfer on standard error.
struct Progress {
    total: Option<u64>,
    done: u64,
    start: Instant,
    last: Option<Instant>,
    mode: ProgressMode,
    tty: bool,
    /// A terminal line is open (needs a newline before anything else).
    open_line: bool,
    /// `done` when the last line was printed.
    printed: Option<u64>,
}

impl Progress {
    fn new(mode: ProgressMode, total: Option<u64>) -> Progress {
        Progress {
            total,
            done: 0,
            start: Instant::now(),
            last: None,
            mode,
            tty: std::io::stderr().is_terminal(),
            open_line: false,
            printed: None,
        }
    }

    fn enabled(&self) -> bool {
        match self.mode {
            ProgressMode::Never => false,
            ProgressMode::Always => true,
            ProgressMode::Auto => self.tty && self.total.unwrap_or(self.done) >= LARGE_TRANSFER,
        }
    }

    fn add(&mut self, n: u64) {
        self.done += n;
        if !self.enabled() {
            return;
        }
        let every = if self.tty { Duration::from_millis(200) } else { Duration::from_secs(1) };
        if self.last.is_some_and(|l| l.elapsed() < every) {
            return;
        }
        self.last = Some(Instant::now());
        self.print();
    }

    fn print(&mut self) {
        self.printed = Some(self.done);
        let line = format_progress(self.done, self.total, self.start.elapsed());
        let mut err = std::io::stderr().lock();
        if self.tty {
            let _ = write!(err, "\r{line}\x1b[K");
            self.open_line = true;
        } else {
            let _ = writeln!(err, "{line}");
        }
        let _ = err.flush();
    }

    fn finish(&mut self) {
        let shown = self.last.is_some() || self.mode == ProgressMode::Always;
        if self.enabled() && shown && self.printed != Some(self.done) {
            self.print();
        }
        self.close_line();
    }

    fn close_line(&mut self) {
        if self.open_line {
            eprintln!();
            self.open_line = false;
        }
    }
}

impl Drop for Progress {
    fn drop(&mut self) {
        // An error message must start on a line of its own.
        self.close_line();
    }
}

/// `12.0 MiB / 64.0 MiB (18%), 85.3 MiB/s`.
fn format_progress(done: u64, total: Option<u64>, elapsed: Duration) -> String {
    let secs = elapsed.as_secs_f64().max(1e-3);
    let rate = format!("{}/s", human_bytes((done as f64 / secs) as u64));
    match total {
        Some(t) if t > 0 => {
            format!("{} / {} ({}%), {rate}", human_bytes(done), human_bytes(t), done * 100 / t)
        }
        _ => format!("{}, {rate}", human_bytes(done)),
    }
}

/// `list`'s table: a header, then a row per volume, the columns aligned.
fn format_list(volumes: &[rdmablk_common::protocol::VolumeInfo]) -> String {
    let mut rows = vec![["NAME".to_owned(), "SIZE".to_owned(), "BYTES".to_owned(), "BLOCK".to_owned(), "ACCESS".to_owned()]];
    for v in volumes {
        rows.push([
            v.name.clone(),
            human_bytes(v.size_bytes),
            v.size_bytes.to_string(),
            v.block_size.to_string(),
            if v.read_only() { "ro" } else { "rw" }.to_owned(),
        ]);
    }
    let mut widths = [0usize; 5];
    for row in &rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let mut text = String::new();
    for row in &rows {
        let mut line = String::new();
        for (i, cell) in row.iter().enumerate() {
            if i + 1 == row.len() {
                line.push_str(cell);
            } else {
                line.push_str(&format!("{cell:<width$}  ", width = widths[i]));
            }
        }
        text.push_str(line.trim_end());
        text.push('\n');
    }
    text
}

/// `512 B`, `4.0 KiB`, `1.5 GiB`.
fn human_bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["KiB", "MiB", "GiB", "TiB", "PiB"];
    if n < 1024 {
        return format!("{n} B");
    }
    let mut v = n as f64 / 1024.0;
    let mut unit = 0;
    while v >= 1024.0 && unit < UNITS.len() - 1 {
        v /= 1024.0;
        unit += 1;
    }
    format!("{v:.1} {}", UNITS[unit])
}

/// The CLI's transfer unit for `total` bytes: at most [`CLI_CHUNK`], a
/// multiple of the block size when `total` is at least one block.
fn chunk_size(total: u64, block_size: u32) -> u64 {
    let bs = u64::from(block_size);
    let c = total.min(CLI_CHUNK);
    if c >= bs {
        c / bs * bs
    } else {
        c
    }
}

/// Reads until `buf` is full or the input ends; returns the bytes read.
fn fill(r: &mut dyn Read, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match r.read(&mut buf[n..]) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> std::result::Result<Cli, clap::Error> {
        Cli::try_parse_from(std::iter::once("rdmablk").chain(args.iter().copied()))
    }

    #[test]
    fn parses_every_command() {
        let c = parse(&["--target", "tcp://h:1", "list"]).unwrap();
        assert_eq!(c.target.as_deref(), Some("tcp://h:1"));
        assert_eq!(c.command, Command::List { output_format: OutputFormat::Normal });

        let c = parse(&["--target", "tcp://h:1", "info", "vol0", "--json"]).unwrap();
        assert_eq!(c.command, Command::Info { volume: "vol0".into(), output_format: OutputFormat::Normal, json: true });
        let c = parse(&["--target", "tcp://h:1", "info", "vol0", "-o", "json"]).unwrap();
        assert_eq!(c.command, Command::Info { volume: "vol0".into(), output_format: OutputFormat::Json, json: false });
        let c = parse(&["--target", "tcp://h:1", "list", "--output-format", "json"]).unwrap();
        assert_eq!(c.command, Command::List { output_format: OutputFormat::Json });

        let c = parse(&["-t", "tcp://h:1", "read", "v", "--offset", "4k", "--length", "1MiB", "-o", "/tmp/x"]).unwrap();
        assert_eq!(
            c.command,
            Command::Read { volume: "v".into(), offset: 4096, length: 1 << 20, output: Some("/tmp/x".into()) }
        );

        let c =
            parse(&["write", "v", "--offset", "0", "--fua", "--target", "tcp://h:1", "--timeout", "500ms"]).unwrap();
        assert_eq!(c.command, Command::Write { volume: "v".into(), offset: 0, input: None, fua: true });
        assert_eq!(c.timeout, Some(Duration::from_millis(500)));
        assert_eq!(c.target.as_deref(), Some("tcp://h:1"));

        let c = parse(&["--host-id", "me", "--target", "tcp://h:1", "flush", "v"]).unwrap();
        assert_eq!(c.command, Command::Flush { volume: "v".into() });
        assert_eq!(c.host_id.as_deref(), Some("me"));
        assert_eq!(c.progress, ProgressMode::Auto);

        let c = parse(&["-t", "tcp://h:1", "discard", "v", "--offset", "1MiB", "--length", "64k"]).unwrap();
        assert_eq!(c.command, Command::Discard { volume: "v".into(), offset: 1 << 20, length: 65536 });
        let c =
            parse(&["-t", "tcp://h:1", "write-zeroes", "v", "--offset", "0", "--length", "4k", "--progress", "never"])
                .unwrap();
        assert_eq!(c.command, Command::WriteZeroes { volume: "v".into(), offset: 0, length: 4096 });
        assert_eq!(c.progress, ProgressMode::Never);
        let c = parse(&["-t", "tcp://h:1", "--ctrl-loss-timeout", "0", "list"]).unwrap();
        assert_eq!(c.ctrl_loss_timeout, Some(Duration::ZERO));
        let c = parse(&["-t", "tcp://h:1", "--host-id", "h1", "--key-file", "/k", "list"]).unwrap();
        assert_eq!(c.key_file.as_deref(), Some(std::path::Path::new("/k")));
        let c = parse(&["-t", "tcp://h:1", "nbd", "v", "--socket", "/run/v.sock"]).unwrap();
        assert_eq!(
            c.command,
            Command::Nbd {
                volume: "v".into(),
                socket: Some("/run/v.sock".into()),
                listen: None,
                queues: None,
                handshake_timeout: Duration::from_secs(30)
            }
        );
        let c = parse(&["-t", "tcp://h:1", "nbd", "v", "--listen", "127.0.0.1:10809", "--queues", "4", "--handshake-timeout", "5s"])
            .unwrap();
        assert_eq!(
            c.command,
            Command::Nbd {
                volume: "v".into(),
                socket: None,
                listen: Some("127.0.0.1:10809".parse().unwrap()),
                queues: Some(4),
                handshake_timeout: Duration::from_secs(5)
            }
        );
        let e = parse(&["-t", "tcp://h:1", "nbd", "v"]).expect_err("a socket or an address is required");
        let e = clap_one_line(&e);
        assert!(e.contains("--socket") && e.contains("--listen"), "{e}");
        assert!(parse(&["-t", "tcp://h:1", "nbd", "v", "--socket", "/s", "--listen", "127.0.0.1:1"]).is_err());
        let c = parse(&["keygen", "/tmp/h.key"]).unwrap();
        assert_eq!(c.command, Command::Keygen { path: "/tmp/h.key".into() });
    }

    #[test]
    fn ctrl_loss_timeout_has_nvme_clis_spelling_too() {
        let tmo = |args: &[&str]| parse(args).map(|c| c.ctrl_loss_timeout);
        assert_eq!(tmo(&["-t", "tcp://h:1", "list"]).unwrap(), None, "absent: the library's default");
        for (args, want) in [
            (&["--ctrl_loss_tmo=30", "-t", "tcp://h:1", "list"][..], Duration::from_secs(30)),
            (&["--ctrl_loss_tmo", "30", "-t", "tcp://h:1", "list"], Duration::from_secs(30)),
            (&["-t", "tcp://h:1", "list", "--ctrl_loss_tmo=0"], Duration::ZERO),
            (&["-t", "tcp://h:1", "info", "v", "--ctrl_loss_tmo", "2m"], Duration::from_secs(120)),
            (&["-t", "tcp://h:1", "--ctrl_loss_tmo=1.5s", "list"], Duration::from_millis(1500)),
            (&["--ctrl-loss-timeout=45", "-t", "tcp://h:1", "list"], Duration::from_secs(45)),
            (&["--ctrl-loss-timeout", "500ms", "-t", "tcp://h:1", "list"], Duration::from_millis(500)),
        ] {
            assert_eq!(tmo(args).unwrap(), Some(want), "{args:?}");
        }
        // Bad values: one line naming the option and the value.
        for (value, want) in [
            ("-1", "negative"),
            ("-5s", "negative"),
            ("soon", "expected a number"),
            ("30parsecs", "unknown unit"),
            ("", "expected a number"),
            ("1e12", "unknown unit"),
            ("9999999999", "longer than 1000000000 seconds"),
            ("--help", "expected a number"),
        ] {
            for spelling in ["--ctrl_loss_tmo", "--ctrl-loss-timeout"] {
                for args in [vec![format!("{spelling}={value}")], vec![spelling.to_owned(), value.to_owned()]] {
                    let mut all = vec!["-t".to_owned(), "tcp://h:1".to_owned(), "list".to_owned()];
                    all.extend(args);
                    let e = Cli::try_parse_from(std::iter::once("rdmablk".to_owned()).chain(all.clone())).unwrap_err();
                    let line = clap_one_line(&e);
                    assert!(line.contains(want) && line.contains("--ctrl-loss-timeout"), "{all:?}: {line}");
                    assert!(line.contains(&format!("{value:?}")), "{all:?}: {line}");
                }
            }
        }
        // Both spellings at once are one option given twice.
        assert!(parse(&["--ctrl_loss_tmo=1", "--ctrl-loss-timeout=2", "-t", "tcp://h:1", "list"]).is_err());
        // --help shows both.
        let help = <Cli as clap::CommandFactory>::command().render_long_help().to_string();
        assert!(help.contains("--ctrl-loss-timeout <DURATION>") && help.contains("--ctrl_loss_tmo"), "{help}");
    }

    #[test]
    fn keygen_writes_a_private_key_and_refuses_to_overwrite() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("h.key");
        let cli = parse(&["keygen", path.to_str().unwrap()]).unwrap();
        let mut out = Vec::new();
        run(&cli, &mut out).unwrap();
        assert!(String::from_utf8(out).unwrap().contains("mode 0600"));
        assert_eq!(std::fs::metadata(&path).unwrap().permissions().mode() & 0o777, 0o600);
        assert!(crate::AuthKey::from_file(&path).is_ok());
        let e = run(&cli, &mut Vec::new()).unwrap_err().to_string();
        assert!(e.contains("cannot create") && e.contains("h.key"), "{e}");
        // A key file others may read is refused before anything is sent.
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        let cli = parse(&["-t", "tcp://127.0.0.1:1", "--key-file", path.to_str().unwrap(), "list"]).unwrap();
        let e = run(&cli, &mut Vec::new()).unwrap_err().to_string();
        assert!(e.contains("h.key") && e.contains("0644"), "{e}");
    }

    #[test]
    fn usage_errors_are_one_line() {
        let e = parse(&["--target", "tcp://h:1", "read", "v", "--offset", "4q", "--length", "1"]).unwrap_err();
        let line = clap_one_line(&e);
        assert!(!line.contains('\n'));
        assert!(line.contains("4q"), "{line}");
        let e = parse(&["--target", "tcp://h:1", "read", "v", "--offset", "0"]).unwrap_err();
        let line = clap_one_line(&e);
        assert!(line.contains("--length"), "{line}");
        assert!(!line.contains("Usage"), "{line}");
        let e = parse(&["frobnicate"]).unwrap_err();
        assert!(clap_one_line(&e).contains("frobnicate"));
    }

    #[test]
    fn durations_and_sizes() {
        assert_eq!(parse_duration("30").unwrap(), Duration::from_secs(30));
        assert_eq!(parse_duration("30s").unwrap(), Duration::from_secs(30));
        assert_eq!(parse_duration("250ms").unwrap(), Duration::from_millis(250));
        assert_eq!(parse_duration("2m").unwrap(), Duration::from_secs(120));
        assert_eq!(parse_duration("1.5s").unwrap(), Duration::from_millis(1500));
        assert!(parse_duration("0").is_err());
        assert!(parse_duration("x").is_err());
        assert!(parse_duration("5 parsecs").is_err());
        assert_eq!(parse_size("1MiB").unwrap(), 1 << 20);
        assert!(parse_size("-4").is_err());
    }

    #[test]
    fn missing_target_is_named() {
        let c = parse(&["list"]).unwrap();
        let e = run(&c, &mut Vec::new()).unwrap_err();
        assert_eq!(e.to_string(), "no target given: use --target tcp://HOST:PORT");
        assert_eq!(main(["rdmablk", "list"]), 1);
        assert_eq!(main(["rdmablk", "bogus"]), 2);
    }

    #[test]
    fn progress_lines() {
        assert_eq!(human_bytes(512), "512 B");
        assert_eq!(human_bytes(1536), "1.5 KiB");
        assert_eq!(human_bytes(3 << 30), "3.0 GiB");
        assert_eq!(
            format_progress(16 << 20, Some(64 << 20), Duration::from_secs(2)),
            "16.0 MiB / 64.0 MiB (25%), 8.0 MiB/s"
        );
        assert_eq!(format_progress(1 << 20, None, Duration::from_secs(1)), "1.0 MiB, 1.0 MiB/s");
        let p = Progress { tty: false, ..Progress::new(ProgressMode::Auto, Some(1 << 40)) };
        assert!(!p.enabled(), "auto: only on a terminal");
        let p = Progress { tty: true, ..Progress::new(ProgressMode::Auto, Some(1 << 20)) };
        assert!(!p.enabled(), "auto: only large transfers");
        let p = Progress { tty: true, ..Progress::new(ProgressMode::Auto, Some(LARGE_TRANSFER)) };
        assert!(p.enabled());
        assert!(Progress::new(ProgressMode::Always, Some(1)).enabled());
        assert_eq!(parse_duration_or_zero("0").unwrap(), Duration::ZERO);
        assert_eq!(parse_duration_or_zero("0s").unwrap(), Duration::ZERO);
        assert_eq!(parse_duration_or_zero("2s").unwrap(), Duration::from_secs(2));
    }

    #[test]
    fn chunking() {
        assert_eq!(chunk_size(100 << 20, 4096), CLI_CHUNK);
        assert_eq!(chunk_size(12288, 4096), 12288);
        assert_eq!(chunk_size(5000, 4096), 4096);
        assert_eq!(chunk_size(100, 4096), 100);
        let mut r: &[u8] = &[1, 2, 3];
        let mut b = [0u8; 8];
        assert_eq!(fill(&mut r, &mut b).unwrap(), 3);
    }
}
