//! Test-only fault injection: disk writes of a chosen session held "at the
//! disk" until released.
//!
//! The reconnect fence (ARCHITECTURE.md, "The reconnect fence") exists for a
//! window that a real run hits rarely: a write of an old session still in
//! flight at the disk when the reconnected session's newer writes to the
//! same blocks arrive. A system test needs that window wide and on demand,
//! with the real daemon binary, so the daemon honours one environment
//! variable:
//!
//! `RDMABLK_FAULT_HOLD_WRITES=PATH`: while the file at `PATH` names a
//! session id (its text, `0x` hex, as the log prints it), every disk write
//! of that session is held, as a slow disk would hold it: the command
//! counts as in flight at the disk, and the write is carried out (it lands)
//! once the file is removed or names another session, whatever became of
//! the session meanwhile. The wait runs on the reactor's blocking worker,
//! so the reactor stays responsive.
//!
//! Without the variable nothing here runs beyond one branch on a cached
//! flag per disk write. Never set it in production: held writes stall
//! their sessions for as long as the file says so.

use std::path::PathBuf;
use std::sync::OnceLock;
use std::time::Duration;

use rdmablk_common::protocol::SessionId;

/// The environment variable that names the gate file.
pub const HOLD_WRITES_ENV: &str = "RDMABLK_FAULT_HOLD_WRITES";

/// How often a held write looks at the gate file again.
const POLL: Duration = Duration::from_millis(5);

fn gate() -> Option<&'static PathBuf> {
    static GATE: OnceLock<Option<PathBuf>> = OnceLock::new();
    GATE.get_or_init(|| {
        let path = std::env::var_os(HOLD_WRITES_ENV).map(PathBuf::from)?;
        tracing::warn!("fault injection on: disk writes of the session named in {} are held ({HOLD_WRITES_ENV})", path.display());
        Some(path)
    })
    .as_ref()
}

/// Whether fault injection is configured at all (cheap after the first call).
#[inline]
pub fn enabled() -> bool {
    gate().is_some()
}

/// Whether writes of `session` are to be held now.
pub fn holds(session: SessionId) -> bool {
    let Some(path) = gate() else { return false };
    let Ok(text) = std::fs::read_to_string(path) else { return false };
    let text = text.trim();
    let digits = text.strip_prefix("0x").unwrap_or(text);
    u64::from_str_radix(digits, 16).is_ok_and(|id| id == session.0)
}

/// Blocks until writes of `session` are no longer held (the blocking worker).
pub fn wait_released(session: SessionId) {
    while holds(session) {
        std::thread::sleep(POLL);
    }
}

/// `RDMABLK_FAULT_RBD_NO_BLOCKLIST=1`: an `rbd` gateway that takes an image
/// over breaks the old owner's lock without having Ceph blocklist it
/// (`rbd_blocklist_on_break_lock = false`), as a gateway without fencing
/// would. Only for the failover test's proof that it can see a stale write
/// land (`tests/tests/rbd_failover.rs`); never in production.
pub const RBD_NO_BLOCKLIST_ENV: &str = "RDMABLK_FAULT_RBD_NO_BLOCKLIST";

/// Whether takeovers skip the blocklist ([`RBD_NO_BLOCKLIST_ENV`]).
pub fn rbd_no_blocklist() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| {
        let on = std::env::var_os(RBD_NO_BLOCKLIST_ENV).is_some_and(|v| v == "1");
        if on {
            tracing::warn!("fault injection on: rbd takeovers do not blocklist the previous owner ({RBD_NO_BLOCKLIST_ENV}); its held writes can land");
        }
        on
    })
}
