//! `/etc/rdmablk/attach/NAME.toml`: what `rdmablk-attach@NAME.service`
//! attaches at boot (`rdmablk attach --config FILE`).
//!
//! ```toml
//! target = "rdma://10.0.0.1:7420"   # required
//! volume = "vol0"                   # required
//! host_id = "db1"                   # default: the machine's host name
//! key_file = "/etc/rdmablk/db1.key" # with [[host]] on the target
//! queues = 2                        # default: 1
//! depth = 64                        # default: 64
//! ctrl_loss_timeout = "60s"         # "0": do not reconnect
//! connect_retry = "5s"              # until the target first answers
//! ```
//!
//! A volume served by several gateways lists them all, in the order they
//! are tried, as an array or in one comma-separated string:
//!
//! ```toml
//! target = ["rdma://10.0.0.1:7420", "rdma://10.0.0.2:7420"]
//! ```
//!
//! Unknown keys are errors, and every error names the file and the key, as
//! with the target's configuration.

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;

use crate::duration::{parse_ctrl_loss_timeout, parse_duration};
use crate::error::{Error, Result};
use crate::targets::Targets;

/// Default wait between two attempts to reach the target at boot.
pub const DEFAULT_CONNECT_RETRY: Duration = Duration::from_secs(5);

/// One attach file, checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AttachFile {
    /// The target URL, or the gateways' URLs comma-separated (an array in
    /// the file becomes that list).
    pub target: String,
    pub volume: String,
    pub host_id: Option<String>,
    pub key_file: Option<PathBuf>,
    pub queues: Option<usize>,
    pub depth: Option<u32>,
    pub ctrl_loss_timeout: Option<Duration>,
    /// How long to wait before trying again while the target does not
    /// answer at all (the network or the target is not up yet).
    pub connect_retry: Duration,
}

/// `target`: one string (a URL or a comma-separated list) or an array.
#[derive(Deserialize)]
#[serde(untagged)]
enum RawTarget {
    One(String),
    List(Vec<String>),
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Raw {
    target: Option<RawTarget>,
    volume: Option<String>,
    host_id: Option<String>,
    key_file: Option<PathBuf>,
    queues: Option<i64>,
    depth: Option<i64>,
    ctrl_loss_timeout: Option<String>,
    connect_retry: Option<String>,
}

impl AttachFile {
    /// Reads and checks `path`.
    pub fn load(path: &Path) -> Result<AttachFile> {
        let text = std::fs::read_to_string(path).map_err(|e| Error::io(format!("reading {}", path.display()), e))?;
        AttachFile::parse(&text, &path.display().to_string())
    }

    /// Checks the text of an attach file named `name` (for messages).
    pub fn parse(text: &str, name: &str) -> Result<AttachFile> {
        let bad = |key: &str, why: String| Error::invalid(format!("{name}: {key}: {why}"));
        let raw: Raw = toml::from_str(text).map_err(|e| Error::invalid(format!("{name}: {}", e.to_string().trim_end())))?;
        let target = match raw.target {
            None => return Err(bad("target", "missing (the target's URL, such as rdma://10.0.0.1:7420)".into())),
            Some(RawTarget::One(t)) => t,
            Some(RawTarget::List(list)) => Targets::from_list(&list).map_err(|e| bad("target", e.to_string()))?.to_string(),
        };
        let volume = raw.volume.filter(|v| !v.is_empty()).ok_or_else(|| bad("volume", "missing (the volume's name)".into()))?;
        if let Some(h) = &raw.host_id {
            if h.is_empty() {
                return Err(bad("host_id", "empty".into()));
            }
        }
        let queues = match raw.queues {
            None => None,
            Some(n) if (1..=32).contains(&n) => Some(n as usize),
            Some(n) => return Err(bad("queues", format!("must be in 1..=32 (got {n})"))),
        };
        let depth = match raw.depth {
            None => None,
            Some(n) if (1..=4096).contains(&n) => Some(n as u32),
            Some(n) => return Err(bad("depth", format!("must be in 1..=4096 (got {n})"))),
        };
        let ctrl_loss_timeout =
            raw.ctrl_loss_timeout.as_deref().map(parse_ctrl_loss_timeout).transpose().map_err(|e| bad("ctrl_loss_timeout", e))?;
        let connect_retry = match raw.connect_retry.as_deref() {
            None => DEFAULT_CONNECT_RETRY,
            Some(s) => parse_duration(s).map_err(|e| bad("connect_retry", e))?,
        };
        Ok(AttachFile { target, volume, host_id: raw.host_id, key_file: raw.key_file, queues, depth, ctrl_loss_timeout, connect_retry })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_full_file_and_a_minimal_one() {
        let f = AttachFile::parse(
            "target = \"rdma://10.0.0.1:7420\"\nvolume = \"vol0\"\nhost_id = \"db1\"\nkey_file = \"/etc/rdmablk/db1.key\"\n\
             queues = 2\ndepth = 64\nctrl_loss_timeout = \"0\"\nconnect_retry = \"2s\"\n",
            "db.toml",
        )
        .unwrap();
        assert_eq!(f.target, "rdma://10.0.0.1:7420");
        assert_eq!(f.volume, "vol0");
        assert_eq!(f.host_id.as_deref(), Some("db1"));
        assert_eq!(f.key_file.as_deref(), Some(Path::new("/etc/rdmablk/db1.key")));
        assert_eq!((f.queues, f.depth), (Some(2), Some(64)));
        assert_eq!(f.ctrl_loss_timeout, Some(Duration::ZERO));
        assert_eq!(f.connect_retry, Duration::from_secs(2));
        let m = AttachFile::parse("target = \"tcp://h:1\"\nvolume = \"v\"\n", "m.toml").unwrap();
        assert_eq!((m.queues, m.depth, m.ctrl_loss_timeout, m.connect_retry), (None, None, None, DEFAULT_CONNECT_RETRY));
    }

    #[test]
    fn the_documented_example_parses() {
        let f = AttachFile::parse(include_str!("../../configs/attach.toml"), "configs/attach.toml").unwrap();
        assert_eq!((f.target.as_str(), f.volume.as_str()), ("rdma://192.0.2.10:7420", "vol0"));
    }

    #[test]
    fn several_gateways_as_an_array_or_a_list() {
        let a = AttachFile::parse("target = [\"tcp://a:1\", \"tcp://b:2\"]\nvolume = \"v\"\n", "a.toml").unwrap();
        assert_eq!(a.target, "tcp://a:1,tcp://b:2");
        assert_eq!(Targets::parse(&a.target).unwrap().len(), 2);
        let l = AttachFile::parse("target = \"tcp://a:1,tcp://b:2\"\nvolume = \"v\"\n", "l.toml").unwrap();
        assert_eq!(l.target, a.target);
        for (text, want) in [
            ("target = []\nvolume = \"v\"\n", "the list is empty"),
            ("target = [\"tcp://a:1\", \"\"]\nvolume = \"v\"\n", "gateway 2 of 2 is empty"),
            ("target = [\"tcp://a:1\", \"ftp://b:2\"]\nvolume = \"v\"\n", "gateway 2 of 2: \"ftp://b:2\": unknown scheme"),
        ] {
            let e = AttachFile::parse(text, "/etc/rdmablk/attach/x.toml").unwrap_err().to_string();
            assert!(e.starts_with("/etc/rdmablk/attach/x.toml: target: ") && e.contains(want), "{text:?}: {e}");
        }
        let e = AttachFile::parse("target = 5\nvolume = \"v\"\n", "x.toml").unwrap_err().to_string();
        assert!(e.contains("x.toml") && e.contains("target"), "{e}");
    }

    #[test]
    fn every_error_names_the_file_and_the_key() {
        let cases = [
            ("volume = \"v\"\n", "target: missing"),
            ("target = \"tcp://h:1\"\n", "volume: missing"),
            ("target = \"tcp://h:1\"\nvolume = \"v\"\nqueues = 0\n", "queues: must be in 1..=32 (got 0)"),
            ("target = \"tcp://h:1\"\nvolume = \"v\"\ndepth = 5000\n", "depth: must be in 1..=4096 (got 5000)"),
            ("target = \"tcp://h:1\"\nvolume = \"v\"\nctrl_loss_timeout = \"-1\"\n", "ctrl_loss_timeout: invalid duration"),
            ("target = \"tcp://h:1\"\nvolume = \"v\"\nconnect_retry = \"soon\"\n", "connect_retry: invalid duration"),
            ("target = \"tcp://h:1\"\nvolume = \"v\"\nhost_id = \"\"\n", "host_id: empty"),
            ("target = \"tcp://h:1\"\nvolume = \"v\"\nqueue = 2\n", "unknown field `queue`"),
        ];
        for (text, want) in cases {
            let e = AttachFile::parse(text, "/etc/rdmablk/attach/x.toml").unwrap_err().to_string();
            assert!(e.contains("/etc/rdmablk/attach/x.toml") && e.contains(want), "{text:?}: {e}");
        }
    }
}
