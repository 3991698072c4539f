//! What answered on a port whose handshake failed: a tcp:// target that
//! replies with something other than an rdmablk hello is asked once more,
//! with an NVMe/TCP ICReq, and the first bytes of its answer say what it
//! speaks (an NVMe-oF port, a web server, something else), so the error
//! names the mistake instead of a frame decode error.

use std::io::{Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use rdmablk_common::fabric::{FabricUrl, ProviderKind};

use crate::error::{Error, ErrorKind};

/// The port rdmablk targets listen on by convention (NVMe-oF's is 4420).
pub const DEFAULT_PORT: u16 = 7420;

/// How long the probe waits for the connection and the answer.
const PROBE_TIMEOUT: Duration = Duration::from_secs(2);

/// What a port that is not an rdmablk target speaks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Speaker {
    /// An NVMe/TCP controller: an ICResp (PDU type 0x01, header length
    /// 128) or a C2HTermReq (0x03, header length 24).
    NvmeTcp,
    /// A web server: `HTTP/`.
    Http,
    /// Something else that answered.
    Other,
}

/// Classifies the first bytes a port answered an ICReq with; `None` when
/// nothing came or they look like an rdmablk frame (an rdmablk target that
/// refused the ICReq: the first failure was something else).
pub fn classify(first: &[u8]) -> Option<Speaker> {
    if first.is_empty() {
        return None;
    }
    if first.starts_with(b"HTTP/") {
        return Some(Speaker::Http);
    }
    if first.len() >= 8 {
        let plen = u32::from_le_bytes([first[4], first[5], first[6], first[7]]);
        // ICResp: type 0x01, hlen 128, pdo 0, plen 128.
        if first[0] == 0x01 && first[2] == 0x80 && first[3] == 0 && plen == 128 {
            return Some(Speaker::NvmeTcp);
        }
        // C2HTermReq: type 0x03, hlen 24, plen >= 24.
        if first[0] == 0x03 && first[2] == 0x18 && plen >= 24 {
            return Some(Speaker::NvmeTcp);
        }
    }
    // An rdmablk header: a type of 1..=9 and a zero reserved field.
    if first.len() >= 4 && (1..=9).contains(&first[0]) && first[2] == 0 && first[3] == 0 {
        return None;
    }
    Some(Speaker::Other)
}

/// An NVMe/TCP ICReq: PDU type 0x00, header length 128, PFV 0, no digests.
fn icreq() -> [u8; 128] {
    let mut b = [0u8; 128];
    b[2] = 128;
    b[4..8].copy_from_slice(&128u32.to_le_bytes());
    b
}

/// Connects to `url` once more, sends an ICReq and classifies the answer.
pub fn probe(url: &FabricUrl) -> Option<Speaker> {
    let deadline = Instant::now() + PROBE_TIMEOUT;
    let addr = url.host_port().to_socket_addrs().ok()?.next()?;
    let mut s = TcpStream::connect_timeout(&addr, PROBE_TIMEOUT).ok()?;
    s.set_write_timeout(Some(PROBE_TIMEOUT)).ok()?;
    // A server that speaks first (SSH, SMTP) may close before it reads.
    let _ = s.write_all(&icreq());
    let mut first = [0u8; 8];
    let mut got = 0;
    while got < first.len() {
        let left = deadline.checked_duration_since(Instant::now()).filter(|d| !d.is_zero())?;
        s.set_read_timeout(Some(left)).ok()?;
        match s.read(&mut first[got..]) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(_) if got > 0 => break,
            Err(_) => return None,
        }
    }
    classify(&first[..got])
}

/// Whether a connect error says the port answered, but not as an rdmablk
/// target does.
fn not_a_hello(e: &Error) -> bool {
    let text = e.one_line();
    e.kind() == ErrorKind::Fabric
        && ["malformed reply", "expected a hello reply", "peer closed during the handshake"].iter().any(|t| text.contains(t))
}

/// `e`, a failed connect to `url`, or the error naming what answered there
/// instead of an rdmablk target.
pub fn explain_connect_error(url: &FabricUrl, e: Error) -> Error {
    if url.provider != ProviderKind::Tcp || !not_a_hello(&e) {
        return e;
    }
    let Some(speaker) = probe(url) else { return e };
    Error::invalid(not_rdmablk_message(url, speaker, &e.one_line()))
}

/// The message for a port that speaks `speaker`; `detail` is the connect error.
pub fn not_rdmablk_message(url: &FabricUrl, speaker: Speaker, detail: &str) -> String {
    let default = format!("rdmablk listens on {DEFAULT_PORT} by default");
    match speaker {
        Speaker::NvmeTcp => format!(
            "tcp://{} is not an rdmablk target: this port speaks NVMe/TCP (an ICResp); {default} \
             (give its rdmablk port in the target URL, or use nvme-cli for this one: nvme connect -t tcp -a {} -s {})",
            url.host_port(),
            url.host,
            url.port
        ),
        Speaker::Http => format!(
            "tcp://{} is not an rdmablk target: this port speaks HTTP; {default} (check the port in the target URL)",
            url.host_port()
        ),
        Speaker::Other => format!(
            "tcp://{} is not an rdmablk target (the handshake failed: {detail}); {default} (check the port in the target URL)",
            url.host_port()
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_bytes_say_who_answered() {
        let mut icresp = [0u8; 8];
        icresp[0] = 0x01;
        icresp[2] = 0x80;
        icresp[4] = 0x80;
        assert_eq!(classify(&icresp), Some(Speaker::NvmeTcp));
        assert_eq!(classify(&[0x03, 0, 0x18, 0, 0x18, 0, 0, 0]), Some(Speaker::NvmeTcp), "C2HTermReq");
        assert_eq!(classify(b"HTTP/1.1 400 Bad Request"), Some(Speaker::Http));
        assert_eq!(classify(b"SSH-2.0-OpenSSH"), Some(Speaker::Other));
        assert_eq!(classify(&[8, 0, 0, 0, 0, 0, 0, 0]), None, "an rdmablk TERMINATE");
        assert_eq!(classify(&[]), None);
        assert_eq!(icreq()[..8], [0, 0, 128, 0, 128, 0, 0, 0]);
    }
}
