//! Asymmetric Namespace Access as this target reports it: several targets
//! ("gateways") export one volume under one subsystem NQN, each a
//! controller of that subsystem to the host, and each reports the state in
//! which the volume is reachable through it.
//!
//! - One ANA group per namespace, its id the NSID, as SPDK's target does
//!   by default: a namespace is in one ANA group of the subsystem, the same
//!   on every gateway (the NSID must be the same on every gateway anyway
//!   for a host to see one namespace), and each gateway reports that
//!   group's state as seen through it. A group per gateway could not
//!   express a gateway that owns one shared volume and stands by for
//!   another.
//! - The state follows the volume's [`Access`] on this gateway: owner →
//!   optimized, standby → non-optimized (served: the backend takes the
//!   volume over at the first command), fenced → inaccessible (I/O answered
//!   the path-related status ANA Inaccessible, and the host retries on
//!   another path). A volume only this target serves is always optimized.
//! - A controller's admin queue compares what it last reported ([`Watch`])
//!   with the volumes' access and its generation, on its timer: every
//!   [`POLL`] while the controller has a shared namespace (whose access can
//!   move), and at every change of the volume set. A change moves the log's
//!   change count and, for a namespace the host already saw, raises an ANA
//!   change notice (if the host enabled it, Asynchronous Event
//!   Configuration bit 11), masked until the host reads the log.

use std::time::Duration;

use rdmablk_common::nvme::ana::{AnaGroup, AnaLog, AnaState};

use super::Namespace;
use crate::backend::Access;

/// How often an admin queue looks at the access of its shared namespaces
/// (only while it has some): the delay of an ANA change notice.
pub const POLL: Duration = Duration::from_millis(500);
/// ANATT, seconds: the most a group stays in the change state. This target
/// never reports that state (a takeover happens inside a command, which the
/// host waits for), so the value only bounds a host's patience.
pub const TRANSITION_TIME_SECS: u8 = 10;

/// The ANA state of a volume of access `access` on this target.
pub fn state(access: Access) -> AnaState {
    match access {
        Access::Owner => AnaState::Optimized,
        Access::Standby => AnaState::NonOptimized,
        Access::Fenced => AnaState::Inaccessible,
    }
}

/// The ANA group of a namespace: its NSID.
pub fn group(ns: &Namespace) -> u32 {
    ns.nsid
}

/// Whether the namespace's volume is one several gateways share (its
/// access may move).
pub fn shared(ns: &Namespace) -> bool {
    ns.volume.backend.ownership().is_some()
}

/// What a controller reports of one namespace.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct View {
    pub nsid: u32,
    pub group: u32,
    pub state: AnaState,
    /// The volume's access generation (it moves at every change, even one
    /// that came back to the same state between two looks).
    pub generation: u64,
}

impl View {
    pub fn of(ns: &Namespace) -> View {
        View { nsid: ns.nsid, group: group(ns), state: state(ns.volume.access()), generation: ns.volume.access_generation() }
    }
}

/// The views of `nss` (ascending NSIDs, as the namespace lists are).
pub fn views(nss: &[Namespace]) -> Vec<View> {
    nss.iter().map(View::of).collect()
}

/// What a controller last reported, its log's change count and its notice.
#[derive(Debug, Default)]
pub struct Watch {
    /// Each namespace as last seen, with the change count at which it last
    /// changed (its group's change count). `None` until the first look.
    known: Option<Vec<(View, u64)>>,
    /// The log's change count: moves at every change of the log.
    change_count: u64,
    /// A namespace's state changed since the host was told or read the log.
    pending: bool,
    /// An ANA change notice was sent: the next waits for the log to be read
    /// (without Retain Asynchronous Event).
    masked: bool,
}

impl Watch {
    /// Takes the namespaces' views now; true when a namespace the host
    /// already saw changed (its state or its generation): an ANA change
    /// notice is due. A namespace that appears or leaves changes the log
    /// (and its change count) only: the host hears of it by the namespace
    /// notice, and reads its state when it adds the namespace.
    pub fn update(&mut self, now: Vec<View>) -> bool {
        let Some(known) = &self.known else {
            self.known = Some(now.into_iter().map(|v| (v, 0)).collect());
            return false;
        };
        if known.len() == now.len() && known.iter().zip(&now).all(|((k, _), v)| k == v) {
            return false;
        }
        self.change_count += 1;
        let mut notice = false;
        let next = now
            .into_iter()
            .map(|v| match known.iter().find(|(k, _)| k.nsid == v.nsid) {
                Some(&(k, at)) if k == v => (v, at),
                Some(_) => {
                    notice = true;
                    (v, self.change_count)
                }
                None => (v, self.change_count),
            })
            .collect();
        self.known = Some(next);
        self.pending |= notice;
        notice
    }

    /// The log page as last updated: one descriptor per group, ascending
    /// group ids, each with its namespaces (ascending).
    pub fn log(&self) -> AnaLog {
        let mut all: Vec<(View, u64)> = self.known.clone().unwrap_or_default();
        all.sort_by_key(|(v, _)| (v.group, v.nsid));
        let mut groups: Vec<AnaGroup> = Vec::new();
        for (v, at) in all {
            match groups.last_mut() {
                Some(g) if g.group == v.group => {
                    debug_assert_eq!(g.state, v.state, "one group, one state");
                    g.change_count = g.change_count.max(at);
                    g.nsids.push(v.nsid);
                }
                _ => groups.push(AnaGroup { group: v.group, change_count: at, state: v.state, nsids: vec![v.nsid] }),
            }
        }
        AnaLog { change_count: self.change_count, groups }
    }

    /// The host read the log: what changed is told; without Retain
    /// Asynchronous Event (`retain`), the next notice may be sent.
    pub fn read(&mut self, retain: bool) {
        self.pending = false;
        if !retain {
            self.masked = false;
        }
    }

    /// Whether a notice waits to be sent (enabled or not: the caller asks).
    pub fn notice_due(&self) -> bool {
        self.pending && !self.masked
    }

    /// A notice went out: masked until the log is read.
    pub fn notice_sent(&mut self) {
        self.pending = false;
        self.masked = true;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v(nsid: u32, state: AnaState, generation: u64) -> View {
        View { nsid, group: nsid, state, generation }
    }

    #[test]
    fn access_maps_to_the_ana_state() {
        assert_eq!(state(Access::Owner), AnaState::Optimized);
        assert_eq!(state(Access::Standby), AnaState::NonOptimized);
        assert_eq!(state(Access::Fenced), AnaState::Inaccessible);
    }

    #[test]
    fn the_first_look_is_no_change_and_the_log_has_a_group_per_namespace() {
        let mut w = Watch::default();
        assert!(!w.update(vec![v(1, AnaState::Optimized, 0), v(4, AnaState::NonOptimized, 2)]));
        assert!(!w.notice_due());
        let log = w.log();
        assert_eq!(log.change_count, 0);
        assert_eq!(log.groups.len(), 2);
        assert_eq!((log.groups[0].group, log.groups[0].state, &log.groups[0].nsids[..]), (1, AnaState::Optimized, &[1][..]));
        assert_eq!((log.groups[1].group, log.groups[1].state, &log.groups[1].nsids[..]), (4, AnaState::NonOptimized, &[4][..]));
        // The same again: nothing moves.
        assert!(!w.update(vec![v(1, AnaState::Optimized, 0), v(4, AnaState::NonOptimized, 2)]));
        assert_eq!(w.log().change_count, 0);
    }

    #[test]
    fn a_state_change_moves_the_counts_and_raises_one_notice_until_the_log_is_read() {
        let mut w = Watch::default();
        w.update(vec![v(1, AnaState::Optimized, 0), v(2, AnaState::Optimized, 0)]);
        // Volume 2 is fenced: a notice, the change count and group 2's move.
        assert!(w.update(vec![v(1, AnaState::Optimized, 0), v(2, AnaState::Inaccessible, 1)]));
        assert!(w.notice_due());
        let log = w.log();
        assert_eq!(log.change_count, 1);
        assert_eq!((log.groups[0].change_count, log.groups[1].change_count), (0, 1));
        assert_eq!(log.groups[1].state, AnaState::Inaccessible);
        w.notice_sent();
        assert!(!w.notice_due());
        // Another change while the notice is unread: masked.
        assert!(w.update(vec![v(1, AnaState::Optimized, 0), v(2, AnaState::NonOptimized, 2)]));
        assert!(!w.notice_due(), "masked until the log is read");
        // Read with Retain Asynchronous Event: still masked; the change is told.
        w.read(true);
        assert!(!w.notice_due());
        assert!(w.update(vec![v(1, AnaState::Optimized, 0), v(2, AnaState::Optimized, 3)]));
        assert!(!w.notice_due(), "still masked: the event was retained");
        w.read(false);
        assert!(!w.notice_due(), "the read told the host what changed");
        assert!(w.update(vec![v(1, AnaState::Inaccessible, 1), v(2, AnaState::Optimized, 3)]));
        assert!(w.notice_due(), "unmasked by the read without RAE");
        assert_eq!(w.log().change_count, 4);
    }

    #[test]
    fn a_generation_that_moves_back_to_the_same_state_is_still_a_change() {
        let mut w = Watch::default();
        w.update(vec![v(1, AnaState::Optimized, 0)]);
        // Owner → standby → owner between two looks.
        assert!(w.update(vec![v(1, AnaState::Optimized, 2)]));
        assert_eq!(w.log().groups[0].change_count, 1);
    }

    #[test]
    fn namespaces_that_come_and_go_change_the_log_but_raise_no_ana_notice() {
        let mut w = Watch::default();
        w.update(vec![v(1, AnaState::Optimized, 0)]);
        assert!(!w.update(vec![v(1, AnaState::Optimized, 0), v(3, AnaState::NonOptimized, 0)]));
        assert!(!w.notice_due());
        let log = w.log();
        assert_eq!((log.change_count, log.groups.len(), log.groups[1].change_count), (1, 2, 1));
        assert!(!w.update(vec![v(3, AnaState::NonOptimized, 0)]));
        assert_eq!(w.log().change_count, 2);
        assert_eq!(w.log().groups.iter().map(|g| g.group).collect::<Vec<_>>(), [3]);
    }

    #[test]
    fn namespaces_of_one_group_share_its_descriptor() {
        // Not what this target reports (a group per namespace), but the
        // log is built by group, not by namespace.
        let mut w = Watch::default();
        let g = |nsid, group| View { nsid, group, state: AnaState::Optimized, generation: 0 };
        w.update(vec![g(1, 7), g(2, 3), g(3, 7)]);
        let log = w.log();
        assert_eq!(log.groups.iter().map(|g| (g.group, g.nsids.clone())).collect::<Vec<_>>(), [(3, vec![2]), (7, vec![1, 3])]);
    }
}
