//! The `rdmablk` command-line tool. The binary only calls [`main`]; parsing
//! and every command live here so they can be tested.
//!
//! ```text
//! rdmablk --target URL list
//! rdmablk --target URL info VOL [--json]
//! rdmablk --target URL read VOL --offset N --length N [--output FILE]
//! rdmablk --target URL write VOL --offset N [--input FILE] [--fua]
//! rdmablk --target URL flush VOL
//! ```
//!
//! Sizes take suffixes (`4k`, `1MiB`, binary multiples). Errors print one
//! line, `rdmablk: error: ...`, and exit with 1 (2 for usage errors).

use std::ffi::OsString;
use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::AsFd;
use std::path::PathBuf;
use std::time::Duration;

use clap::{ColorChoice, Parser, Subcommand};
use rdmablk_common::protocol::Opcode;
use rdmablk_common::size::ByteSize;

use crate::device::{check_request, BlockDevice, WriteFlags};
use crate::error::{Error, Result};
use crate::session::{ConnectOptions, Session};

/// Largest transfer one CLI step moves through its registered buffer.
const CLI_CHUNK: u64 = 8 << 20;

/// Command line of `rdmablk`.
#[derive(Parser, Debug, Clone, PartialEq, Eq)]
#[command(
    name = "rdmablk",
    version,
    about = "Access volumes of an rdmablk target",
    color = ColorChoice::Never,
    propagate_version = true
)]
pub struct Cli {
    /// Target address, e.g. tcp://192.0.2.1:7420
    #[arg(long, short = 't', value_name = "URL", global = true)]
    pub target: Option<String>,
    /// Host identifier sent to the target (default: this machine's host name)
    #[arg(long, value_name = "ID", global = true)]
    pub host_id: Option<String>,
    /// Connect and per-command timeout: 30, 30s, 500ms, 2m
    #[arg(long, value_name = "DURATION", value_parser = parse_duration, global = true)]
    pub timeout: Option<Duration>,
    #[command(subcommand)]
    pub command: Command,
}

/// The subcommands.
#[derive(Subcommand, Debug, Clone, PartialEq, Eq)]
pub enum Command {
    /// One line per volume: name, size in bytes, block size, ro|rw
    List,
    /// Details of one volume and of the connection
    Info {
        /// Volume name
        volume: String,
        /// Print JSON instead of key: value lines
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
}

/// Parses a size with an optional suffix (`4k`, `1MiB`).
pub fn parse_size(s: &str) -> std::result::Result<u64, String> {
    ByteSize::parse(s).map(|b| b.0).map_err(|e| e.to_string())
}

/// Parses `30`, `30s`, `500ms`, `2m`, `1.5s`.
pub fn parse_duration(s: &str) -> std::result::Result<Duration, String> {
    let t = s.trim();
    let split = t.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let value: f64 = num.parse().map_err(|_| format!("invalid duration {s:?}: expected a number"))?;
    let secs = match unit.trim() {
        "" | "s" => value,
        "ms" => value / 1000.0,
        "m" | "min" => value * 60.0,
        "h" => value * 3600.0,
        _ => return Err(format!("invalid duration {s:?}: unknown unit (use ms, s, m or h)")),
    };
    if !secs.is_finite() || secs <= 0.0 || secs > 1e9 {
        return Err(format!("invalid duration {s:?}: must be positive"));
    }
    Ok(Duration::from_secs_f64(secs))
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
    let target =
        cli.target.as_deref().ok_or_else(|| Error::invalid("no target given: use --target tcp://HOST:PORT"))?;
    let mut options = ConnectOptions::default();
    if let Some(id) = &cli.host_id {
        options.host_id = id.clone();
    }
    if let Some(t) = cli.timeout {
        options.connect_timeout = t;
        options.io_timeout = t;
    }
    Session::connect(target, options)
}

/// Runs a parsed command; normal output goes to `out`.
pub fn run(cli: &Cli, out: &mut dyn Write) -> Result<()> {
    let session = connect(cli)?;
    let write_err = |e| Error::io("writing the output", e);
    match &cli.command {
        Command::List => {
            for v in session.list_volumes()? {
                writeln!(
                    out,
                    "{}\t{}\t{}\t{}",
                    v.name,
                    v.size_bytes,
                    v.block_size,
                    if v.read_only() { "ro" } else { "rw" }
                )
                .map_err(write_err)?;
            }
        }
        Command::Info { volume, json } => {
            let vol = session.open(volume)?;
            let limits = session.limits();
            let info = serde_json::json!({
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
            if *json {
                writeln!(out, "{info}").map_err(write_err)?;
            } else {
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
                ] {
                    let v = &map[key];
                    let text = v.as_str().map(str::to_owned).unwrap_or_else(|| v.to_string());
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
            let chunk = chunk_size(*length, vol.block_size());
            let mut buf = session.alloc_buffer(chunk.max(1) as usize)?;
            let mut done = 0u64;
            while done < *length {
                let n = chunk.min(*length - done);
                vol.read_into(&mut buf, 0, n as usize, offset + done)?;
                out.write_all(&buf.as_slice()[..n as usize]).map_err(write_err)?;
                done += n;
            }
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
            let flags = if *fua { WriteFlags::FUA } else { WriteFlags::NONE };
            let chunk = chunk_size(known_len.unwrap_or(CLI_CHUNK), vol.block_size()).max(u64::from(vol.block_size()));
            let mut buf = session.alloc_buffer(chunk as usize)?;
            let mut pos = *offset;
            loop {
                // The data goes from the input straight into registered memory.
                let n = fill(&mut file, buf.as_mut_slice()).map_err(|e| Error::io(format!("reading {name}"), e))?;
                if n == 0 {
                    break;
                }
                vol.write_from_with(&buf, 0, n, pos, flags)?;
                pos += n as u64;
                if n < buf.len() {
                    break;
                }
            }
            if pos == *offset {
                check_request(Opcode::Write, *offset, 0, vol.block_size(), vol.size())?;
            }
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
        assert_eq!(c.command, Command::List);

        let c = parse(&["--target", "tcp://h:1", "info", "vol0", "--json"]).unwrap();
        assert_eq!(c.command, Command::Info { volume: "vol0".into(), json: true });

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
