//! The man pages and shell completions of the Debian package, generated
//! from the command-line definitions the binaries parse with, so that they
//! cannot drift from `--help`:
//!
//! - `rdmablk` (section 1, a page per subcommand too) and `rdmablk-target`
//!   (section 8, a daemon's): clap's own definitions
//!   ([`rdmablk_initiator::cli::Cli`], [`rdmablk_target::cli::Args`]) through
//!   clap_mangen and clap_complete;
//! - `rdmablk-bench` (section 1) parses fio's options itself: its page and
//!   completions are built from its `--help` text
//!   ([`rdmablk_bench::options::help`]), which lists every option the parser
//!   accepts, one line each.
//!
//! [`generate`] writes them in the layout the package installs (see
//! target-daemon/Cargo.toml's `[package.metadata.deb]`): `man1/`, `man8/`,
//! `bash/` (a file named as the command, for bash-completion's lazy
//! loading), `zsh/` (`_COMMAND`), `fish/` (`COMMAND.fish`). cargo-deb
//! compresses the man pages.

use std::fs;
use std::io;
use std::path::{Path, PathBuf};

use clap::{Arg, ArgAction, Command, CommandFactory, ValueHint};
use clap_complete::Shell;
use roff::{bold, italic, roman, Roff};

/// The configuration and state paths the package creates, for the pages'
/// FILES sections (as the systemd units use them).
const TARGET_CONFIG: &str = "/etc/rdmablk/target.toml";
const ATTACH_DIR: &str = "/etc/rdmablk/attach";
const STATE_DIR: &str = "/var/lib/rdmablk";

/// The `rdmablk` command as clap sees it.
pub fn rdmablk_command() -> Command {
    rdmablk_initiator::cli::Cli::command()
}

/// The `rdmablk-target` command as clap sees it.
pub fn target_command() -> Command {
    rdmablk_target::cli::Args::command()
}

/// An option of `rdmablk-bench`, from a `  --name=VALUE   what it does` line.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BenchOption {
    pub name: String,
    pub takes_value: bool,
    pub help: String,
}

/// A paragraph of `rdmablk-bench --help` (paragraphs are separated by blank lines).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Block {
    /// Running text, its lines joined.
    Text(String),
    /// `heading:` over `  term   text` lines: options when the terms are `--name[=VALUE]`.
    List { heading: String, entries: Vec<(String, String)> },
    /// `heading:` over indented lines kept as written (an example).
    Verbatim { heading: String, lines: Vec<String> },
}

/// `rdmablk-bench --help`, cut into its parts.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct BenchHelp {
    /// The first line's text after `rdmablk-bench: `.
    pub summary: String,
    /// After `usage: `.
    pub usage: String,
    pub blocks: Vec<Block>,
}

impl BenchHelp {
    /// Every `--name` entry of every list, in order.
    pub fn options(&self) -> Vec<BenchOption> {
        let entries = self.blocks.iter().flat_map(|b| match b {
            Block::List { entries, .. } => entries.as_slice(),
            _ => &[],
        });
        entries
            .filter_map(|(term, help)| {
                let opt = term.strip_prefix("--")?;
                let (name, takes_value) = opt.strip_suffix("=VALUE").map_or((opt, false), |n| (n, true));
                Some(BenchOption { name: name.to_owned(), takes_value, help: help.clone() })
            })
            .collect()
    }
}

/// Cuts the bench's help text into [`Block`]s. A paragraph under a
/// `heading:` line is a list when each of its lines is two spaces, a term
/// and its text, and some term is followed by a column of spaces (the
/// help's layout); other indented lines are kept as written.
pub fn parse_bench_help(text: &str) -> BenchHelp {
    let mut help = BenchHelp::default();
    let paragraphs = text.split("\n\n").map(|p| p.trim_matches('\n').trim_end()).filter(|p| !p.trim().is_empty());
    for (i, para) in paragraphs.enumerate() {
        let lines: Vec<&str> = para.lines().collect();
        if i == 0 {
            help.summary = lines[0].split_once(": ").map_or(lines[0], |(_, s)| s).to_owned();
            if lines.len() > 1 {
                help.blocks.push(Block::Text(lines[1..].join(" ")));
            }
            continue;
        }
        if let Some(usage) = para.strip_prefix("usage: ") {
            help.usage = usage.to_owned();
            continue;
        }
        let block = match lines.split_first() {
            Some((head, body)) if head.ends_with(':') && !body.is_empty() && body.iter().all(|l| l.starts_with("  ")) => {
                let heading = head.trim_end_matches(':').to_owned();
                let entry = |l: &&str| {
                    let l = l.strip_prefix("  ").filter(|l| !l.starts_with(' '))?;
                    let (term, text) = l.split_once(' ')?;
                    Some((term.to_owned(), text.to_owned()))
                };
                match body.iter().map(entry).collect::<Option<Vec<(String, String)>>>() {
                    Some(entries) if entries.iter().any(|(_, text)| text.starts_with(' ')) => Block::List {
                        heading,
                        entries: entries.into_iter().map(|(term, text)| (term, text.trim().to_owned())).collect(),
                    },
                    _ => Block::Verbatim { heading, lines: body.iter().map(|l| l.to_string()).collect() },
                }
            }
            _ => Block::Text(lines.iter().map(|l| l.trim()).collect::<Vec<_>>().join(" ")),
        };
        help.blocks.push(block);
    }
    help
}

/// A clap command with the bench's options, for the completion generators
/// only (the bench does not parse with it): `--opt value` and `--opt=value`
/// both complete, and JOBFILE arguments as files.
pub fn bench_command(help: &BenchHelp) -> Command {
    let mut cmd = Command::new("rdmablk-bench")
        .about(help.summary.clone())
        .disable_help_flag(true)
        .disable_version_flag(true)
        .arg(Arg::new("JOBFILE").num_args(0..).value_hint(ValueHint::FilePath));
    for o in help.options() {
        // clap takes owned names only with its `string` feature, which would change clap for the
        // whole workspace build; the generator runs once and exits.
        let name: &'static str = Box::leak(o.name.into_boxed_str());
        let arg = Arg::new(name).long(name).help(o.help);
        let arg = if o.takes_value {
            let hint = match name {
                "filename" | "output" | "key_file" => ValueHint::FilePath,
                _ => ValueHint::Other,
            };
            arg.num_args(1).action(ArgAction::Append).value_hint(hint)
        } else {
            arg.action(ArgAction::Count)
        };
        cmd = cmd.arg(arg);
    }
    cmd
}

/// The bench's man page, in roff: NAME and SYNOPSIS from the help's first
/// lines, DESCRIPTION from the text before the first list, a section per
/// list or example, the text after a list in its section.
pub fn bench_man_page(help: &BenchHelp, version: &str) -> String {
    let mut r = Roff::new();
    r.control("TH", ["RDMABLK-BENCH", "1", "", &format!("rdmablk-bench {version}")]);
    r.control("SH", ["NAME"]).text([roman(format!("rdmablk-bench - {}", help.summary))]);
    r.control("SH", ["SYNOPSIS"]).text([bold("rdmablk-bench"), roman(" "), roman(help.usage.trim_start_matches("rdmablk-bench "))]);
    r.control("SH", ["DESCRIPTION"]);
    // Text right under DESCRIPTION starts its paragraph; any other (after a
    // paragraph, a list's last entry or an example) needs .PP.
    let mut after_heading = true;
    for block in &help.blocks {
        match block {
            Block::Text(text) => {
                if !after_heading {
                    r.control("PP", []);
                }
                r.text([roman(text.clone())]);
            }
            Block::List { heading, entries } => {
                r.control("SH", [heading.to_uppercase().as_str()]);
                for (term, text) in entries {
                    r.control("TP", []);
                    match term.strip_prefix("--").map(|t| t.split_once('=').unwrap_or((t, ""))) {
                        Some((name, "")) => r.text([bold(format!("--{name}"))]),
                        Some((name, value)) => r.text([bold(format!("--{name}")), roman("="), italic(value)]),
                        None => r.text([bold(term.clone())]),
                    };
                    r.text([roman(text.clone())]);
                }
            }
            Block::Verbatim { heading, lines } => {
                r.control("SH", [heading.to_uppercase().as_str()]).control("nf", []).control("RS", ["4"]);
                // Relative to the first line's indent.
                let indent = lines.first().map_or(0, |l| l.len() - l.trim_start().len());
                for l in lines {
                    r.text([roman(l.get(indent..).unwrap_or(l.trim_start()).to_owned())]);
                }
                r.control("RE", []).control("fi", []);
            }
        }
        after_heading = false;
    }
    see_also(&mut r, &[("rdmablk", "1"), ("rdmablk-target", "8"), ("fio", "1")]);
    r.render()
}

fn see_also(r: &mut Roff, pages: &[(&str, &str)]) {
    r.control("SH", ["SEE ALSO"]);
    let mut line = Vec::new();
    for (i, (name, section)) in pages.iter().enumerate() {
        if i > 0 {
            line.push(roman(", "));
        }
        line.extend([bold(*name), roman(format!("({section})"))]);
    }
    r.text(line);
}

fn files(r: &mut Roff, entries: &[(&str, &str)]) {
    r.control("SH", ["FILES"]);
    for (path, what) in entries {
        r.control("TP", []).text([italic(*path)]).text([roman(*what)]);
    }
}

/// clap_mangen's page of `cmd` in `section`, with roff appended (FILES,
/// SEE ALSO).
fn clap_page(cmd: Command, section: &str, extra: &Roff) -> io::Result<String> {
    let mut out = Vec::new();
    clap_mangen::Man::new(cmd).section(section).render(&mut out)?;
    let mut page = String::from_utf8(out).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
    page.push_str(&extra.to_roff());
    Ok(page)
}

/// Writes every page and completion file under `out`; returns their paths.
pub fn generate(out: &Path) -> io::Result<Vec<PathBuf>> {
    let mut written = Vec::new();
    let mut write = |rel: String, text: &[u8]| -> io::Result<()> {
        let path = out.join(rel);
        fs::create_dir_all(path.parent().expect("a directory"))?;
        fs::write(&path, text)?;
        written.push(path);
        Ok(())
    };

    // rdmablk: the command and each subcommand (`man rdmablk-attach`).
    let mut rdmablk = rdmablk_command().disable_help_subcommand(true);
    rdmablk.build();
    let mut extra = Roff::new();
    files(&mut extra, &[(ATTACH_DIR, "One file per volume for the rdmablk-attach@ systemd units: rdmablk attach --config FILE.")]);
    see_also(&mut extra, &[("rdmablk-target", "8"), ("rdmablk-bench", "1")]);
    write("man1/rdmablk.1".into(), clap_page(rdmablk.clone(), "1", &extra)?.as_bytes())?;
    for sub in rdmablk.get_subcommands().filter(|s| !s.is_hide_set()) {
        let name = sub.get_display_name().unwrap_or(sub.get_name()).to_owned();
        let mut extra = Roff::new();
        see_also(&mut extra, &[("rdmablk", "1")]);
        write(format!("man1/{name}.1"), clap_page(sub.clone(), "1", &extra)?.as_bytes())?;
    }

    // rdmablk-target: a daemon, section 8.
    let mut extra = Roff::new();
    files(
        &mut extra,
        &[
            (TARGET_CONFIG, "The configuration the rdmablk-target systemd unit runs with (SIGHUP reloads it)."),
            (STATE_DIR, "Where the unit lets the target write (ReadWritePaths): file volumes."),
        ],
    );
    see_also(&mut extra, &[("rdmablk", "1"), ("rdmablk-bench", "1")]);
    write("man8/rdmablk-target.8".into(), clap_page(target_command(), "8", &extra)?.as_bytes())?;

    // rdmablk-bench, from its help text.
    let bench = parse_bench_help(&rdmablk_bench::options::help());
    write("man1/rdmablk-bench.1".into(), bench_man_page(&bench, env!("CARGO_PKG_VERSION")).as_bytes())?;

    for (name, mut cmd) in [("rdmablk", rdmablk), ("rdmablk-target", target_command()), ("rdmablk-bench", bench_command(&bench))] {
        for (shell, rel) in [(Shell::Bash, format!("bash/{name}")), (Shell::Zsh, format!("zsh/_{name}")), (Shell::Fish, format!("fish/{name}.fish"))] {
            let mut text = Vec::new();
            clap_complete::generate(shell, &mut cmd, name, &mut text);
            write(rel, &text)?;
        }
    }
    Ok(written)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_bench_help_is_cut_into_its_option_lists() {
        let text = rdmablk_bench::options::help();
        let help = parse_bench_help(&text);
        assert!(help.summary.contains("benchmark"), "{help:?}");
        assert!(help.usage.starts_with("rdmablk-bench "), "{help:?}");
        assert!(matches!(help.blocks[0], Block::Text(_)), "a description first: {help:?}");
        // Every `  --name` line of the help is an option.
        let listed: Vec<&str> = text.lines().filter_map(|l| l.strip_prefix("  --")).collect();
        let options = help.options();
        assert_eq!(listed.len(), options.len(), "{:#?}", help.blocks);
        assert!(listed.len() > 40, "{listed:?}");
        let rw = options.iter().find(|o| o.name == "rw").expect("--rw");
        assert!(rw.takes_value && rw.help.contains("randread"), "{rw:?}");
        let hipri = options.iter().find(|o| o.name == "hipri").expect("--hipri");
        assert!(!hipri.takes_value, "{hipri:?}");
        // The example keeps its lines.
        let example = help.blocks.iter().find_map(|b| match b {
            Block::Verbatim { heading, lines } if heading.starts_with("example") => Some(lines),
            _ => None,
        });
        let example = example.unwrap_or_else(|| panic!("no example: {:#?}", help.blocks));
        assert!(example[0].trim_start().starts_with("rdmablk-bench --name=main") && example.len() >= 2, "{example:?}");
    }

    #[test]
    fn a_made_up_help_parses_as_written() {
        let help = parse_bench_help(
            "tool: does things\n\nusage: tool [--x=value]\n\nFirst paragraph\nwraps.\n\nlist one:\n  --a=VALUE   takes one\n  --b         a flag\n\n\
             no effect:\n  p     1 only\n  q     ignored\n\nMore text.\n\n\nexample:\n  tool --a=1 \\\n    --b\n",
        );
        assert_eq!(help.summary, "does things");
        assert_eq!(help.usage, "tool [--x=value]");
        let pairs = |v: &[(&str, &str)]| v.iter().map(|(a, b)| (a.to_string(), b.to_string())).collect::<Vec<_>>();
        assert_eq!(
            help.blocks,
            [
                Block::Text("First paragraph wraps.".into()),
                Block::List { heading: "list one".into(), entries: pairs(&[("--a=VALUE", "takes one"), ("--b", "a flag")]) },
                Block::List { heading: "no effect".into(), entries: pairs(&[("p", "1 only"), ("q", "ignored")]) },
                Block::Text("More text.".into()),
                Block::Verbatim { heading: "example".into(), lines: vec!["  tool --a=1 \\".into(), "    --b".into()] },
            ]
        );
        assert_eq!(
            help.options(),
            [
                BenchOption { name: "a".into(), takes_value: true, help: "takes one".into() },
                BenchOption { name: "b".into(), takes_value: false, help: "a flag".into() }
            ]
        );
        let page = bench_man_page(&help, "9.9");
        assert!(page.contains(".SH \"LIST ONE\"\n.TP\n\\fB\\-\\-a\\fR=\\fIVALUE\\fR\ntakes one\n"), "{page}");
        assert!(page.contains("ignored\n.PP\nMore text.\n"), "{page}");
        assert!(page.contains(".nf\n.RS 4\ntool \\-\\-a=1 \\\\\n  \\-\\-b\n.RE\n.fi\n"), "{page}");
        assert!(page.contains(".SH NAME\nrdmablk\\-bench \\- does things\n"), "{page}");
    }

    #[test]
    fn every_page_and_completion_is_written_from_the_definitions() {
        let dir = tempfile::tempdir().unwrap();
        let written = generate(dir.path()).unwrap();
        let read = |rel: &str| fs::read_to_string(dir.path().join(rel)).unwrap_or_else(|e| panic!("{rel}: {e}"));
        // A page per visible subcommand of rdmablk.
        for sub in rdmablk_command().get_subcommands().filter(|s| !s.is_hide_set()) {
            let page = read(&format!("man1/rdmablk-{}.1", sub.get_name()));
            assert!(page.starts_with(".ie") || page.contains(".TH"), "{page}");
        }
        let rdmablk = read("man1/rdmablk.1");
        assert!(rdmablk.contains(".TH rdmablk 1"), "{rdmablk}");
        for word in ["attach", "list", "ctrl\\-loss\\-timeout", "/etc/rdmablk/attach", "rdmablk\\-target"] {
            assert!(rdmablk.contains(word), "{word} not in rdmablk.1:\n{rdmablk}");
        }
        let target = read("man8/rdmablk-target.8");
        assert!(target.contains(".TH rdmablk\\-target 8") || target.contains(".TH rdmablk-target 8"), "{target}");
        for word in ["config", "check", "log\\-format", "/etc/rdmablk/target.toml", "/var/lib/rdmablk"] {
            assert!(target.contains(word), "{word} not in rdmablk-target.8:\n{target}");
        }
        let bench = read("man1/rdmablk-bench.1");
        for o in ["iodepth", "rkey_scoping", "output_format", "target_pid"] {
            assert!(bench.contains(&format!("\\-\\-{o}")) || bench.contains(&format!("--{o}")), "--{o} not in rdmablk-bench.1:\n{bench}");
        }
        // Completions: each shell, each command.
        for name in ["rdmablk", "rdmablk-target", "rdmablk-bench"] {
            for rel in [format!("bash/{name}"), format!("zsh/_{name}"), format!("fish/{name}.fish")] {
                assert!(read(&rel).contains(name), "{rel}");
            }
        }
        assert!(read("bash/rdmablk").contains("attach"));
        assert!(read("bash/rdmablk-bench").contains("--iodepth"));
        assert!(read("fish/rdmablk-target.fish").contains("log-format"));
        assert_eq!(written.len(), 3 + 9 + rdmablk_command().get_subcommands().filter(|s| !s.is_hide_set()).count(), "{written:?}");
    }
}
