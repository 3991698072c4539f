//! The attach record, `/run/rdmablk/ublk/ublkbN.toml`: what a restarted
//! `rdmablk attach` needs to take back a device whose `rdmablk attach`
//! died (ublk user recovery): the target, the volume, and the session the
//! dead process had, which the new session names so that the target
//! fences it (no write of the dead process lands after the new one's).
//!
//! `rdmablk attach` writes it when the device exists and rewrites it,
//! before anything is re-issued, whenever a reconnection creates a new
//! session; it removes it when it ends normally. A record left behind
//! therefore means that the process died. /run is cleared at boot, with
//! the devices.

use std::path::{Path, PathBuf};

use rdmablk_common::protocol::SessionId;
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// Where the records live.
pub const RECORD_DIR: &str = "/run/rdmablk/ublk";

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AttachRecord {
    /// N in /dev/ublkbN.
    pub dev_id: u32,
    /// The target URL, as the session printed it (`rdma://10.0.0.1:7420`),
    /// or the list of the volume's gateways (`tcp://a:7420,tcp://b:7420`).
    pub target: String,
    pub volume: String,
    pub host_id: String,
    /// The session id, in hex (TOML integers are signed 64-bit).
    pub session: String,
    /// With several gateways, the one `session` is at (a session id means
    /// something only to its gateway); absent with one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gateway: Option<String>,
    /// The `rdmablk attach` that serves the device.
    pub pid: u32,
}

impl AttachRecord {
    pub fn path_in(dir: &Path, dev_id: u32) -> PathBuf {
        dir.join(format!("ublkb{dev_id}.toml"))
    }

    pub fn session_id(&self) -> Result<SessionId> {
        u64::from_str_radix(self.session.trim_start_matches("0x"), 16)
            .map(SessionId)
            .map_err(|_| Error::invalid(format!("the attach record of /dev/ublkb{} has a bad session id {:?}", self.dev_id, self.session)))
    }

    pub fn with_session(&self, id: SessionId) -> AttachRecord {
        AttachRecord { session: format!("{:#x}", id.0), ..self.clone() }
    }

    /// This record with session `id` at `gateway` (kept only when the
    /// record lists several gateways).
    pub fn with_session_at(&self, id: SessionId, gateway: &str) -> AttachRecord {
        let several = self.target.contains(',');
        AttachRecord { gateway: several.then(|| gateway.to_owned()), ..self.with_session(id) }
    }

    pub fn to_toml(&self) -> String {
        let body = toml::to_string(self).expect("a record serializes");
        format!("# rdmablk attach's record of /dev/ublkb{}: read by a restarted rdmablk attach\n{body}", self.dev_id)
    }

    pub fn parse(text: &str, path: &Path) -> Result<AttachRecord> {
        toml::from_str(text).map_err(|e| Error::invalid(format!("{}: {}", path.display(), e.message())))
    }

    /// Writes the record in `dir` (created if missing) by renaming a
    /// complete temporary file over it: a reader never sees half of one.
    pub fn save_in(&self, dir: &Path) -> Result<()> {
        std::fs::create_dir_all(dir).map_err(|e| Error::io(format!("creating {}", dir.display()), e))?;
        let path = Self::path_in(dir, self.dev_id);
        let tmp = path.with_extension("toml.tmp");
        std::fs::write(&tmp, self.to_toml()).map_err(|e| Error::io(format!("writing {}", tmp.display()), e))?;
        std::fs::rename(&tmp, &path).map_err(|e| Error::io(format!("renaming {} to {}", tmp.display(), path.display()), e))
    }

    pub fn remove_in(dir: &Path, dev_id: u32) {
        let _ = std::fs::remove_file(Self::path_in(dir, dev_id));
    }

    /// The records in `dir` for `target` and `volume` whose process is
    /// gone (`alive` says whether a pid still runs), lowest device first.
    /// Unreadable records are skipped with a warning.
    pub fn orphans_in(dir: &Path, target: &str, volume: &str, alive: impl Fn(u32) -> bool) -> Vec<AttachRecord> {
        let Ok(entries) = std::fs::read_dir(dir) else { return Vec::new() };
        let mut found: Vec<AttachRecord> = entries
            .flatten()
            .map(|e| e.path())
            .filter(|p| p.extension().is_some_and(|x| x == "toml"))
            .filter_map(|p| {
                let text = std::fs::read_to_string(&p).ok()?;
                match AttachRecord::parse(&text, &p) {
                    Ok(r) => Some(r),
                    Err(e) => {
                        tracing::warn!("ignoring an attach record: {}", e.one_line());
                        None
                    }
                }
            })
            .filter(|r| r.target == target && r.volume == volume && !alive(r.pid))
            .collect();
        found.sort_by_key(|r| r.dev_id);
        found
    }
}

/// Whether process `pid` exists.
pub fn pid_alive(pid: u32) -> bool {
    let Some(p) = rustix::process::Pid::from_raw(pid as i32) else { return false };
    !matches!(rustix::process::test_kill_process(p), Err(rustix::io::Errno::SRCH))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(dev_id: u32, volume: &str, pid: u32) -> AttachRecord {
        AttachRecord {
            dev_id,
            target: "rdma://10.0.0.1:7420".into(),
            volume: volume.into(),
            host_id: "db1".into(),
            session: "0x0".into(),
            pid,
            gateway: None,
        }
        .with_session(SessionId(0xfedc_ba98_7654_3210))
    }

    #[test]
    fn a_record_round_trips_and_keeps_a_full_64_bit_session_id() {
        let r = rec(3, "vol0", 42);
        let text = r.to_toml();
        assert!(text.starts_with("# rdmablk attach's record of /dev/ublkb3"), "{text}");
        assert!(text.contains("session = \"0xfedcba9876543210\""), "{text}");
        let back = AttachRecord::parse(&text, Path::new("x.toml")).unwrap();
        assert_eq!(back, r);
        assert_eq!(back.session_id().unwrap(), SessionId(0xfedc_ba98_7654_3210));
        let e = AttachRecord::parse("dev_id = 1\n", Path::new("/run/x.toml")).unwrap_err().one_line();
        assert!(e.contains("/run/x.toml") && e.contains("missing field"), "{e}");
        let bad = AttachRecord { session: "zz".into(), ..r };
        assert!(bad.session_id().unwrap_err().one_line().contains("bad session id"));
    }

    #[test]
    fn a_record_of_several_gateways_names_the_sessions_gateway() {
        let one = rec(3, "vol0", 42).with_session_at(SessionId(7), "rdma://10.0.0.1:7420");
        assert_eq!(one.gateway, None, "one gateway: the record is as before");
        assert!(!one.to_toml().contains("gateway"), "{}", one.to_toml());
        let several = AttachRecord { target: "tcp://a:1,tcp://b:2".into(), ..rec(3, "vol0", 42) };
        let r = several.with_session_at(SessionId(0x2a), "tcp://b:2");
        assert_eq!((r.session.as_str(), r.gateway.as_deref()), ("0x2a", Some("tcp://b:2")));
        let back = AttachRecord::parse(&r.to_toml(), Path::new("x.toml")).unwrap();
        assert_eq!(back, r);
        let old = "dev_id = 1\ntarget = \"tcp://a:1\"\nvolume = \"v\"\nhost_id = \"h\"\nsession = \"0x1\"\npid = 5\n";
        assert_eq!(AttachRecord::parse(old, Path::new("x.toml")).unwrap().gateway, None, "a record without the key");
    }

    #[test]
    fn orphans_are_the_matching_records_of_dead_processes() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path().join("ublk");
        rec(2, "vol0", 100).save_in(&d).unwrap(); // dead: an orphan
        rec(0, "vol0", 101).save_in(&d).unwrap(); // dead: an orphan
        rec(1, "vol0", 200).save_in(&d).unwrap(); // alive: served
        rec(4, "vol1", 100).save_in(&d).unwrap(); // another volume
        AttachRecord { target: "tcp://10.0.0.1:7420".into(), ..rec(5, "vol0", 100) }.save_in(&d).unwrap();
        std::fs::write(d.join("ublkb9.toml"), "garbage").unwrap();
        assert!(!d.join("ublkb2.toml.tmp").exists());
        let alive = |pid: u32| pid == 200;
        let ids: Vec<u32> =
            AttachRecord::orphans_in(&d, "rdma://10.0.0.1:7420", "vol0", alive).iter().map(|r| r.dev_id).collect();
        assert_eq!(ids, vec![0, 2]);
        AttachRecord::remove_in(&d, 0);
        let ids: Vec<u32> =
            AttachRecord::orphans_in(&d, "rdma://10.0.0.1:7420", "vol0", alive).iter().map(|r| r.dev_id).collect();
        assert_eq!(ids, vec![2]);
        assert!(AttachRecord::orphans_in(&dir.path().join("none"), "x", "y", alive).is_empty());
    }

    #[test]
    fn this_process_is_alive_and_a_reaped_child_is_not() {
        assert!(pid_alive(std::process::id()));
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id();
        child.wait().unwrap();
        assert!(!pid_alive(pid));
    }
}
