//! How a session connects and rides out failures ([`ConnectOptions`]), and
//! what CONNECT negotiated ([`NegotiatedLimits`]): plain values every
//! layer reads, from the connection up.

use std::time::Duration;

use rdmablk_common::auth::AuthKey;
use rdmablk_common::protocol::MAX_HOST_ID_LEN;

use crate::error::{Error, Result};

/// How to connect, and how to ride out failures. `Default` gives the
/// documented defaults.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConnectOptions {
    /// Identifies this host to the target (access control, logs): UTF-8, at
    /// most 223 bytes, no NUL. Default: the machine's host name.
    pub host_id: String,
    /// Pre-shared key of `host_id` (the target's `[[host]]` entry holds
    /// the same one). With a key, every queue pair, reconnections included,
    /// authenticates both ways before CONNECT, and the connection fails with
    /// [`Error::Authentication`] unless the target proves it holds the key.
    /// Without, CONNECT is sent unauthenticated, which only a target without
    /// `[[host]]` entries accepts. Load one with [`AuthKey::from_file`] (or
    /// [`ConnectOptions::with_key_file`]) or [`AuthKey::new`]. Default: none.
    pub key: Option<AuthKey>,
    /// Queue pairs (I/O queues) of the session. Each thread that uses the
    /// session gets one, round-robin, in the order threads first use it.
    /// A target that refuses to join more than one queue pair to a session
    /// (`UnknownSession`) leaves the session with fewer; see
    /// [`Session::queue_count`](crate::Session::queue_count). Default: the number of CPUs.
    pub queues: usize,
    /// Commands this initiator wants outstanding at once on each queue pair
    /// (1..=65535). The target may grant fewer. One slot of each queue pair
    /// is reserved for keep-alives when the depth is at least 2. Default 128.
    pub queue_depth: u32,
    /// Largest data transfer of one command, in bytes. The target may grant
    /// less; larger requests are split. Default 1 MiB.
    pub max_io_size: u32,
    /// Deadline for establishing the connections and the CONNECT exchange,
    /// at connect and at each reconnection attempt. Default 10 s.
    pub connect_timeout: Duration,
    /// Deadline for the response of each command. A command that misses it
    /// fails with [`Error::Timeout`]; its queue pair is closed (the target
    /// may still be working on the buffer) and the session reconnects, so
    /// other requests carry on. Default 30 s.
    pub io_timeout: Duration,
    /// A target that does not answer for this long is declared dead, even
    /// when no I/O is in flight: a queue pair that received nothing for a
    /// quarter of it sends a KEEP_ALIVE, which must be answered within half
    /// of it. Zero disables keep-alives. Default 5 s.
    pub keepalive_timeout: Duration,
    /// Pause before the second reconnection attempt (the first is
    /// immediate); it doubles after each failed attempt, up to 5 s (or this
    /// value, if larger). Default 1 s.
    pub reconnect_delay: Duration,
    /// How long the session keeps trying to reconnect after a failure before
    /// it gives up and fails queued and future requests with
    /// [`Error::TargetLost`]. Requests wait (at most this long) while it
    /// reconnects. Zero disables reconnection: the first failure closes the
    /// session ([`Error::Disconnected`]). Default 60 s.
    pub ctrl_loss_timeout: Duration,
    /// Bytes of registered memory, shared out among the queues, used to
    /// stage I/O on plain slices (at least one max-I/O-size chunk per queue,
    /// at most one per queue slot). Default 8 MiB.
    pub bounce_pool_size: usize,
    /// Expose to the target only the bytes of each command in flight: each
    /// READ or WRITE gets a memory window over its buffer, with the one
    /// right it needs (remote write for a READ, remote read for a WRITE),
    /// invalidated when its response arrives; registered buffers grant the
    /// target nothing by themselves. Where the device has no type-2B
    /// memory windows the session logs a warning and falls back to buffers
    /// the target may access while they are registered. Default on.
    pub rkey_scoping: bool,
    /// While commands are outstanding, keep polling the queue pair for this
    /// long before sleeping on its completion channel: lower latency at low
    /// queue depth for a CPU kept busy (fio's `hipri`). Default 0 (sleep at
    /// once); at most 10 ms.
    ///
    /// A polling queue also holds back the acknowledgement of a response
    /// (on providers that acknowledge in software: tcp) until its next
    /// command carries it or its next poll or sleep sends it, instead of
    /// sending it before the response is delivered. Until then the target
    /// keeps that command's buffer, so a polling application that stops
    /// calling the library holds the target's resources for its last
    /// responses until its next call.
    pub busy_poll: Duration,
}

/// Longest timeout or delay [`ConnectOptions`] takes (about 31 years).
pub const MAX_TIMEOUT: Duration = Duration::from_secs(1_000_000_000);

impl Default for ConnectOptions {
    fn default() -> Self {
        ConnectOptions {
            host_id: default_host_id(),
            key: None,
            queues: std::thread::available_parallelism().map_or(1, |n| n.get()),
            queue_depth: 128,
            max_io_size: 1 << 20,
            connect_timeout: Duration::from_secs(10),
            io_timeout: Duration::from_secs(30),
            keepalive_timeout: Duration::from_secs(5),
            reconnect_delay: Duration::from_secs(1),
            ctrl_loss_timeout: Duration::from_secs(60),
            bounce_pool_size: 8 << 20,
            rkey_scoping: true,
            busy_poll: Duration::ZERO,
        }
    }
}

/// Longest [`ConnectOptions::busy_poll`].
pub const MAX_BUSY_POLL: Duration = Duration::from_millis(10);

/// The machine's host name, or `rdmablk-initiator`.
pub fn default_host_id() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|s| s.trim().to_owned())
        .filter(|s| !s.is_empty() && s.len() <= MAX_HOST_ID_LEN && !s.contains('\0'))
        .unwrap_or_else(|| "rdmablk-initiator".to_owned())
}

impl ConnectOptions {
    /// These options with the key read from `path` (one line of 64 to 128
    /// hex digits, private to its owner: see `rdmablk keygen`).
    pub fn with_key_file(self, path: impl AsRef<std::path::Path>) -> Result<Self> {
        let key = AuthKey::from_file(path.as_ref()).map_err(|e| Error::invalid(e.to_string()))?;
        Ok(ConnectOptions { key: Some(key), ..self })
    }

    pub(crate) fn validate(&self) -> Result<()> {
        if self.host_id.len() > MAX_HOST_ID_LEN || self.host_id.contains('\0') {
            return Err(Error::invalid(format!(
                "host id of {} bytes is invalid: at most {MAX_HOST_ID_LEN} bytes of UTF-8 without NUL",
                self.host_id.len()
            )));
        }
        if self.queues == 0 || self.queues > 1024 {
            return Err(Error::invalid(format!("{} queues is outside 1..=1024", self.queues)));
        }
        if self.queue_depth == 0 || self.queue_depth > u32::from(u16::MAX) {
            return Err(Error::invalid(format!("queue depth {} is outside 1..=65535", self.queue_depth)));
        }
        if self.max_io_size < 512 {
            return Err(Error::invalid(format!("max I/O size {} is below 512 bytes", self.max_io_size)));
        }
        if self.connect_timeout.is_zero() || self.io_timeout.is_zero() {
            return Err(Error::invalid("connect and I/O timeouts must be longer than zero"));
        }
        if self.busy_poll > MAX_BUSY_POLL {
            return Err(Error::invalid(format!("busy_poll of {:?} is above the maximum, {MAX_BUSY_POLL:?}", self.busy_poll)));
        }
        // Deadlines are `Instant + timeout`: keep them far from overflowing.
        let longest = [
            ("connect_timeout", self.connect_timeout),
            ("io_timeout", self.io_timeout),
            ("keepalive_timeout", self.keepalive_timeout),
            ("reconnect_delay", self.reconnect_delay),
            ("ctrl_loss_timeout", self.ctrl_loss_timeout),
        ];
        if let Some((name, d)) = longest.iter().find(|(_, d)| *d > MAX_TIMEOUT) {
            return Err(Error::invalid(format!("{name} of {d:?} is above the maximum, {MAX_TIMEOUT:?}")));
        }
        Ok(())
    }
}

/// What CONNECT negotiated (on the first queue pair of the current
/// connection).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub struct NegotiatedLimits {
    /// Commands outstanding at once on a queue pair (the smaller of what
    /// was asked and what the target granted).
    pub queue_depth: u32,
    /// Largest data transfer of one command, in bytes.
    pub max_io_size: u32,
    /// Largest write payload the target accepts inline in a command.
    pub inline_data_size: u32,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn options_validation() {
        let ok = ConnectOptions::default();
        ok.validate().unwrap();
        assert_eq!(ok.queue_depth, 128);
        assert_eq!(ok.max_io_size, 1 << 20);
        assert_eq!(ok.io_timeout, Duration::from_secs(30));
        assert_eq!(ok.keepalive_timeout, Duration::from_secs(5));
        assert!(ok.queues >= 1);
        assert!(!ok.host_id.is_empty());
        let bad = ConnectOptions { host_id: "x".repeat(224), ..ConnectOptions::default() };
        assert!(bad.validate().unwrap_err().to_string().contains("224 bytes"));
        let bad = ConnectOptions { queue_depth: 0, ..ConnectOptions::default() };
        assert!(bad.validate().is_err());
        let bad = ConnectOptions { queue_depth: 70000, ..ConnectOptions::default() };
        assert!(bad.validate().is_err());
        let bad = ConnectOptions { io_timeout: Duration::ZERO, ..ConnectOptions::default() };
        assert!(bad.validate().is_err());
        let bad = ConnectOptions { queues: 0, ..ConnectOptions::default() };
        assert!(bad.validate().unwrap_err().to_string().contains("queues"));
        assert!(ok.rkey_scoping && ok.busy_poll.is_zero());
        let bad = ConnectOptions { busy_poll: MAX_BUSY_POLL + Duration::from_micros(1), ..ConnectOptions::default() };
        assert!(bad.validate().unwrap_err().to_string().contains("busy_poll"));
        ConnectOptions { busy_poll: MAX_BUSY_POLL, ..ConnectOptions::default() }.validate().unwrap();
        let bad = ConnectOptions { ctrl_loss_timeout: Duration::MAX, ..ConnectOptions::default() };
        assert!(bad.validate().unwrap_err().to_string().contains("ctrl_loss_timeout"), "a deadline past Instant's range would panic");
        ConnectOptions { ctrl_loss_timeout: MAX_TIMEOUT, ..ConnectOptions::default() }.validate().unwrap();
    }
}
