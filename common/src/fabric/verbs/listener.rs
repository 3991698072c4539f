//! The passive side: an rdma_cm id listening on the URL's address, and the
//! connection requests it yields.

use std::net::SocketAddr;
use std::os::fd::RawFd;
use std::sync::Arc;

use super::cm::{self, ev, CmChannel, CmId};
use super::cq::VerbsCq;
use super::device::Device;
use super::mr::VerbsPd;
use super::qp::{self, Endpoint, VerbsQp};
use crate::fabric::{FabricError, FabricErrorKind, FabricUrl, ProviderKind, QpCaps, Result};

/// rdma_listen backlog.
const BACKLOG: i32 = 1024;

/// A listener of the verbs provider. Its fd is the rdma_cm event channel.
pub struct VerbsListener {
    url: FabricUrl,
    dev: Arc<Device>,
    id: CmId,
    chan: Arc<CmChannel>,
}

impl VerbsListener {
    pub(crate) fn bind(url: &FabricUrl, addr: &SocketAddr, dev: Arc<Device>) -> Result<VerbsListener> {
        let chan = CmChannel::new().map_err(|e| FabricError::io(format!("{url}: rdma_create_event_channel"), e))?;
        let id = CmId::create(&chan, 0).map_err(|e| FabricError::io(format!("{url}: rdma_create_id"), e))?;
        id.bind(addr).map_err(|e| FabricError::io(format!("listening on {url}: rdma_bind_addr"), e))?;
        if id.verbs() != dev.raw() {
            return Err(FabricError::new(
                FabricErrorKind::InvalidState,
                format!("listening on {url}: the address moved to another RDMA device than {}", dev.name),
            ));
        }
        id.listen(BACKLOG).map_err(|e| FabricError::io(format!("listening on {url}: rdma_listen"), e))?;
        let port = id.local_addr().map(|a| a.port()).unwrap_or(addr.port());
        let url = FabricUrl { provider: ProviderKind::Rdma, host: addr.ip().to_string(), port };
        tracing::debug!(%url, device = %dev.name, "rdma_cm listener bound");
        Ok(VerbsListener { url, dev, id, chan })
    }

    pub fn fd(&self) -> RawFd {
        self.chan.fd()
    }

    pub fn local_url(&self) -> FabricUrl {
        self.url.clone()
    }

    /// Returns the next connection request, if any, without blocking. Other
    /// events on the channel are handled on the way.
    pub fn poll_request(&self) -> Result<Option<VerbsConnectRequest>> {
        loop {
            let e = match self.chan.get_event() {
                Ok(Some(e)) => e,
                Ok(None) => return Ok(None),
                Err(e) => return Err(FabricError::io(format!("rdma_get_cm_event on {}", self.url), e)),
            };
            if e.kind == ev::CONNECT_REQUEST {
                // SAFETY: the new id of a CONNECT_REQUEST read from this channel.
                let Some(id) = (unsafe { CmId::from_request(e.id, &self.chan) }) else { continue };
                let peer = id.peer_addr().map(|a| a.to_string()).unwrap_or_else(|| "unknown peer".to_owned());
                let local = id.local_addr();
                if id.verbs() != self.dev.raw() {
                    tracing::warn!(%peer, "connect request on another RDMA device than {}; rejecting", self.dev.name);
                    let _ = id.reject(&cm::frame_private(b"wrong RDMA device"));
                    continue;
                }
                // Our side's RDMA READ depths: as many READs as the device
                // serves for the peer (at least what it asks for, if the
                // device allows), and no more of ours than it serves.
                let responder_resources = self.dev.rd_atomic;
                let initiator_depth = self.dev.rd_atomic.min(e.responder_resources.max(1));
                return Ok(Some(VerbsConnectRequest {
                    id: Some(id),
                    dev: self.dev.clone(),
                    peer,
                    local,
                    private_data: e.private,
                    raw_private_data: e.raw,
                    responder_resources,
                    initiator_depth,
                }));
            }
            if e.id == self.id.raw() {
                match e.kind {
                    ev::DEVICE_REMOVAL => tracing::error!(
                        url = %self.url,
                        device = %self.dev.name,
                        "RDMA device removed (RDMA_CM_EVENT_DEVICE_REMOVAL): the listener no longer works"
                    ),
                    ev::ADDR_CHANGE => tracing::warn!(url = %self.url, "the listener's address changed"),
                    _ => tracing::debug!(url = %self.url, event = %e.name(), "listener event"),
                }
                continue;
            }
            // A connection whose id has not moved to its CQ's channel yet.
            qp::dispatch(&e, "listener");
        }
    }
}

/// A connection request, not yet accepted or rejected. Dropping it rejects it.
pub struct VerbsConnectRequest {
    id: Option<CmId>,
    dev: Arc<Device>,
    peer: String,
    /// The address the request arrived on (the listener's may be a wildcard).
    local: Option<SocketAddr>,
    private_data: Vec<u8>,
    raw_private_data: Vec<u8>,
    responder_resources: u8,
    initiator_depth: u8,
}

impl VerbsConnectRequest {
    pub fn private_data(&self) -> &[u8] {
        &self.private_data
    }

    pub fn raw_private_data(&self) -> &[u8] {
        &self.raw_private_data
    }

    pub fn peer(&self) -> String {
        self.peer.clone()
    }

    pub fn local_addr(&self) -> Option<SocketAddr> {
        self.local
    }

    pub fn into_queue_pair(mut self, pd: &VerbsPd, cq: &VerbsCq, caps: QpCaps) -> Result<VerbsQp> {
        let id = self.id.take().expect("a request's id is taken once");
        let dev = self.dev.clone();
        if !Arc::ptr_eq(&pd.dev, &dev) || !Arc::ptr_eq(&cq.sh.dev, &dev) {
            let _ = id.reject(&cm::frame_private(b"internal error"));
            return Err(FabricError::new(
                FabricErrorKind::InvalidArgument,
                format!(
                    "the request arrived on {}, the protection domain is on {} and the completion queue on {}",
                    dev.name, pd.dev.name, cq.sh.dev.name
                ),
            ));
        }
        // On failure the queue pair's drop rejects the request (or, before
        // it exists, destroying the id does).
        let rd = (self.responder_resources, self.initiator_depth);
        VerbsQp::create(&dev, pd, cq, caps, Endpoint { id, url: None, peer: self.peer.clone(), passive_rd: Some(rd) })
    }

    pub fn reject(self, private_data: &[u8]) {
        let data = &private_data[..private_data.len().min(cm::MAX_REJECT_PRIVATE)];
        self.reject_raw(&cm::frame_private(data));
    }

    pub fn reject_raw(mut self, private_data: &[u8]) {
        if let Some(id) = self.id.take() {
            let data = &private_data[..private_data.len().min(cm::MAX_REJECT_PRIVATE + cm::PRIVATE_HEADER)];
            if let Err(e) = id.reject(data) {
                tracing::debug!(peer = %self.peer, "rdma_reject: {e}");
            }
        }
    }
}

impl Drop for VerbsConnectRequest {
    fn drop(&mut self) {
        if let Some(id) = self.id.take() {
            let _ = id.reject(&cm::frame_private(b""));
        }
    }
}
