//! Who may serve a volume that several gateways export (an RBD image).
//!
//! A volume on this machine's disks has one server, this target, and is
//! always [`Access::Owner`]. A shared volume is served by several targets
//! ("gateways"), and only one of them may write it at a time: the one that
//! holds the image's exclusive lock. Each gateway keeps its own view here;
//! the backend moves it (`Standby` → `Owner` when it takes the lock over,
//! `Owner` → `Fenced` when Ceph refuses its I/O because another gateway
//! broke its lock and blocklisted it, `Fenced` → `Standby` once it is
//! connected again under a new client identity).
//!
//! Front ends read it: NVMe-oF reports it as the namespace's ANA state
//! (optimized, non-optimized, inaccessible) and sends an ANA change AEN
//! when [`Ownership::generation`] moves; rdmablk v1 answers `NotOwner`
//! while fenced.

use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};

/// What this gateway may do with a volume.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Access {
    /// It serves the volume (holds the lock, or the volume is not shared).
    Owner,
    /// Another gateway may own it; this one takes it over at the first
    /// command it gets (fencing the previous owner first).
    Standby,
    /// Another gateway took it over and fenced this one: nothing is served
    /// (reads could be stale, writes are refused by the cluster).
    Fenced,
}

impl Access {
    fn to_u8(self) -> u8 {
        match self {
            Access::Owner => 0,
            Access::Standby => 1,
            Access::Fenced => 2,
        }
    }

    fn from_u8(v: u8) -> Access {
        match v {
            0 => Access::Owner,
            1 => Access::Standby,
            _ => Access::Fenced,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Access::Owner => "owner",
            Access::Standby => "standby",
            Access::Fenced => "fenced",
        }
    }
}

/// A shared volume's access, readable from every reactor without a lock.
#[derive(Debug)]
pub struct Ownership {
    access: AtomicU8,
    /// Bumped at every change of `access`.
    generation: AtomicU64,
}

impl Ownership {
    pub fn new(initial: Access) -> Ownership {
        Ownership { access: AtomicU8::new(initial.to_u8()), generation: AtomicU64::new(0) }
    }

    pub fn access(&self) -> Access {
        Access::from_u8(self.access.load(Ordering::Acquire))
    }

    /// Moves to `to`; returns whether it changed (and the generation moved).
    pub fn set(&self, to: Access) -> bool {
        let old = self.access.swap(to.to_u8(), Ordering::AcqRel);
        if old == to.to_u8() {
            return false;
        }
        self.generation.fetch_add(1, Ordering::AcqRel);
        true
    }

    /// Changes since the volume was opened: a front end that saw another
    /// value tells its hosts (an ANA change AEN).
    pub fn generation(&self) -> u64 {
        self.generation.load(Ordering::Acquire)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_change_moves_the_generation_and_the_same_state_does_not() {
        let o = Ownership::new(Access::Standby);
        assert_eq!((o.access(), o.generation()), (Access::Standby, 0));
        assert!(!o.set(Access::Standby));
        assert_eq!(o.generation(), 0);
        assert!(o.set(Access::Owner));
        assert!(o.set(Access::Fenced));
        assert_eq!((o.access(), o.generation()), (Access::Fenced, 2));
    }
}
