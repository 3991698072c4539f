//! Shared pieces of rdmablk: the wire protocol (v1), the NVMe and NVMe/TCP
//! codec (`nvme`), units and identifiers, and the fabric layer that
//! carries capsules and one-sided RDMA operations.
//!
//! Everything the target and the initiator exchange is defined here, so the
//! two ends cannot drift apart.

pub mod auth;
pub mod fabric;
pub mod keymap;
#[cfg(feature = "logging")]
pub mod logging;
pub mod notify;
pub mod nvme;
pub mod protocol;
pub mod size;
