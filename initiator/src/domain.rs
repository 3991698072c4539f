//! The protection domain and fabric a session's buffers and connections
//! share ([`Domain`]).

use rdmablk_common::fabric::{Access, Fabric, ProtectionDomain};

/// Protection domain and fabric of a session; buffers keep it alive, and
/// every connection of the session, reconnections included, uses it, so
/// registered buffers stay valid across reconnections.
pub(crate) struct Domain {
    // The PD goes before the fabric it was allocated from.
    pd: ProtectionDomain,
    fabric: Fabric,
    /// Every command exposes only its own bytes, through a memory window
    /// bound for it (see [`ConnectOptions::rkey_scoping`](crate::ConnectOptions::rkey_scoping)).
    scoped: bool,
}

impl Domain {
    pub(crate) fn new(pd: ProtectionDomain, fabric: Fabric, rkey_scoping: bool) -> Domain {
        let scoped = rkey_scoping && pd.supports_windows();
        if rkey_scoping && !scoped {
            tracing::warn!(
                "the RDMA device for {} has no type-2B memory windows: the target may access every registered buffer of this \
                 session while it is registered (rkey scoping is per pool)",
                fabric.url()
            );
        }
        Domain { pd, fabric, scoped }
    }

    /// Whether commands are scoped with memory windows.
    pub(crate) fn scoped(&self) -> bool {
        self.scoped
    }

    /// Access rights for a region the target reaches with `remote` rights:
    /// with scoping, the region itself grants none (only windows bound over
    /// it do); without, it grants them for as long as it is registered.
    pub(crate) fn access_for(&self, remote: Access) -> Access {
        let local = if remote.contains(Access::REMOTE_WRITE) { Access::LOCAL_WRITE } else { Access::NONE };
        if self.scoped {
            local | Access::MW_BIND
        } else {
            local | remote
        }
    }

    pub(crate) fn pd(&self) -> &ProtectionDomain {
        &self.pd
    }

    pub(crate) fn fabric(&self) -> &Fabric {
        &self.fabric
    }
}
