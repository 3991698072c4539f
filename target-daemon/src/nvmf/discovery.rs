//! The discovery log page (NVMe over Fabrics 1.1, 5.3): one entry per
//! NVMe listener for this target's subsystem.

use std::net::SocketAddr;

use super::Subsystem;
use crate::config::NvmeTransport;

const HEADER: usize = 1024;
const ENTRY: usize = 1024;

/// TRTYPE: RDMA, TCP. ADRFAM: IPv4, IPv6. SUBTYPE: an NVM subsystem.
const TRTYPE_RDMA: u8 = 1;
const TRTYPE_TCP: u8 = 3;
const ADRFAM_IPV4: u8 = 1;
const ADRFAM_IPV6: u8 = 2;
const SUBTYPE_NVM: u8 = 2;
/// TREQ: a secure channel is not required.
const TREQ_NOT_REQUIRED: u8 = 0b10;
/// TSAS for RDMA: reliable connected queue pairs, no particular RDMA
/// provider type, connections through rdma_cm (as Linux nvmet reports).
const RDMA_QPTYPE_CONNECTED: u8 = 1;
const RDMA_PRTYPE_NOT_SPECIFIED: u8 = 1;
const RDMA_CMS_RDMA_CM: u8 = 1;

fn put_str(out: &mut [u8], s: &str) {
    out.fill(0);
    let n = s.len().min(out.len());
    out[..n].copy_from_slice(&s.as_bytes()[..n]);
}

/// The log page as seen through a connection whose local address is
/// `local`: a listener on a wildcard address is reported with the
/// address the host reached it on.
pub fn log_page(sub: &Subsystem, local: SocketAddr) -> Vec<u8> {
    let listeners = sub.listeners.lock().unwrap_or_else(|e| e.into_inner()).clone();
    let mut d = vec![0u8; HEADER + ENTRY * listeners.len()];
    // GENCTR: listeners and the subsystem do not change while the target runs.
    d[0..8].copy_from_slice(&1u64.to_le_bytes());
    d[8..16].copy_from_slice(&(listeners.len() as u64).to_le_bytes());
    for (i, (transport, addr)) in listeners.iter().enumerate() {
        let e = &mut d[HEADER + ENTRY * i..HEADER + ENTRY * (i + 1)];
        let ip = if addr.ip().is_unspecified() { local.ip() } else { addr.ip() };
        e[0] = match transport {
            NvmeTransport::Tcp => TRTYPE_TCP,
            NvmeTransport::Rdma => TRTYPE_RDMA,
        };
        e[1] = if ip.is_ipv4() { ADRFAM_IPV4 } else { ADRFAM_IPV6 };
        e[2] = SUBTYPE_NVM;
        e[3] = TREQ_NOT_REQUIRED;
        e[4..6].copy_from_slice(&(i as u16 + 1).to_le_bytes());
        e[6..8].copy_from_slice(&0xffffu16.to_le_bytes());
        e[8..10].copy_from_slice(&(sub.cfg.nvme_queue_size as u16).to_le_bytes());
        put_str(&mut e[32..64], &addr.port().to_string());
        put_str(&mut e[256..512], &sub.nqn);
        put_str(&mut e[512..768], &ip.to_string());
        // TSAS. TCP: SECTYPE 0, no security.
        if *transport == NvmeTransport::Rdma {
            e[768] = RDMA_QPTYPE_CONNECTED;
            e[769] = RDMA_PRTYPE_NOT_SPECIFIED;
            e[770] = RDMA_CMS_RDMA_CM;
        }
    }
    d
}
