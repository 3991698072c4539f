//! The systemd notification protocol (sd_notify), without libsystemd: one
//! datagram per message to the `AF_UNIX` socket named by `NOTIFY_SOCKET`
//! (a path, or an abstract name written with a leading `@`).
//!
//! Shared by the target and the `rdmablk` CLI (`rdmablk attach` under
//! `rdmablk-attach@.service`).
//!
//! The target sends `READY=1` once every listener is up, `STATUS=` lines,
//! `RELOADING=1` ... `READY=1` around a reload, `STOPPING=1` at shutdown, and
//! `WATCHDOG=1` every half `WATCHDOG_USEC` while every reactor keeps turning
//! (when `WATCHDOG_PID` is set it must be this process).

use std::os::unix::net::{SocketAddr, UnixDatagram};
use std::time::Duration;

/// Where notifications go, if anywhere.
pub struct Notifier {
    target: Option<(UnixDatagram, SocketAddr, String)>,
    watchdog: Option<Duration>,
}

impl Notifier {
    /// From `NOTIFY_SOCKET`, `WATCHDOG_USEC` and `WATCHDOG_PID`.
    pub fn from_env() -> Notifier {
        let target = std::env::var("NOTIFY_SOCKET").ok().filter(|s| !s.is_empty()).and_then(|s| {
            let addr = match parse_addr(&s) {
                Ok(a) => a,
                Err(e) => {
                    tracing::warn!("NOTIFY_SOCKET={s:?} is unusable: {e}");
                    return None;
                }
            };
            match UnixDatagram::unbound() {
                Ok(sock) => Some((sock, addr, s)),
                Err(e) => {
                    tracing::warn!("cannot create a socket for systemd notifications: {e}");
                    None
                }
            }
        });
        let pid_ok = std::env::var("WATCHDOG_PID").ok().is_none_or(|p| p.trim() == std::process::id().to_string());
        let watchdog = std::env::var("WATCHDOG_USEC")
            .ok()
            .and_then(|v| v.trim().parse::<u64>().ok())
            .filter(|&us| us > 0 && pid_ok)
            .map(Duration::from_micros);
        Notifier { target, watchdog }
    }

    /// A notifier that sends nothing.
    pub fn none() -> Notifier {
        Notifier { target: None, watchdog: None }
    }

    /// Whether a notification socket is set.
    pub fn enabled(&self) -> bool {
        self.target.is_some()
    }

    /// How often to send `WATCHDOG=1` (half the watchdog timeout), if at all.
    pub fn watchdog_interval(&self) -> Option<Duration> {
        self.target.as_ref()?;
        self.watchdog.map(|t| (t / 2).max(Duration::from_millis(1)))
    }

    /// Sends `state` (newline-separated `KEY=VALUE` lines).
    pub fn notify(&self, state: &str) {
        let Some((sock, addr, name)) = &self.target else { return };
        if let Err(e) = sock.send_to_addr(state.as_bytes(), addr) {
            tracing::debug!("systemd notification to {name} failed: {e}");
        }
    }
}

fn parse_addr(s: &str) -> std::io::Result<SocketAddr> {
    if let Some(name) = s.strip_prefix('@') {
        use std::os::linux::net::SocketAddrExt;
        SocketAddr::from_abstract_name(name.as_bytes())
    } else if s.starts_with('/') {
        SocketAddr::from_pathname(s)
    } else {
        Err(std::io::Error::new(std::io::ErrorKind::InvalidInput, "expected an absolute path or @abstract-name"))
    }
}

/// One `STATUS=` line (newlines would end the field).
pub fn status(text: &str) -> String {
    format!("STATUS={}", text.replace('\n', " "))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sends_to_a_path_and_an_abstract_socket() {
        let dir = tempfile::tempdir_in("/tmp").unwrap();
        let path = dir.path().join("notify.sock");
        let rx = UnixDatagram::bind(&path).unwrap();
        let n = Notifier { target: Some((UnixDatagram::unbound().unwrap(), parse_addr(path.to_str().unwrap()).unwrap(), "p".into())), watchdog: Some(Duration::from_secs(2)) };
        n.notify("READY=1\nSTATUS=up");
        let mut buf = [0u8; 64];
        let len = rx.recv(&mut buf).unwrap();
        assert_eq!(&buf[..len], b"READY=1\nSTATUS=up");
        assert_eq!(n.watchdog_interval(), Some(Duration::from_secs(1)));

        use std::os::linux::net::SocketAddrExt;
        let name = format!("rdmablk-test-{}", std::process::id());
        let rx = UnixDatagram::bind_addr(&SocketAddr::from_abstract_name(name.as_bytes()).unwrap()).unwrap();
        let n = Notifier { target: Some((UnixDatagram::unbound().unwrap(), parse_addr(&format!("@{name}")).unwrap(), name)), watchdog: None };
        n.notify("WATCHDOG=1");
        let len = rx.recv(&mut buf).unwrap();
        assert_eq!(&buf[..len], b"WATCHDOG=1");
        assert_eq!(n.watchdog_interval(), None);
        assert!(parse_addr("relative").is_err());
        assert_eq!(status("a\nb"), "STATUS=a b");
    }
}
