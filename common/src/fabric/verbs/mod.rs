//! The `verbs` provider: real RDMA (InfiniBand, RoCE, iWARP) through
//! libibverbs and librdmacm, using sideway 0.4.3 for the verbs objects and
//! rdma-mummy-sys 0.2.6 for the calls sideway does not wrap.
//!
//! # Loading and errors
//!
//! rdma-mummy-sys loads libibverbs and librdmacm with `dlopen`, so a binary
//! built with this provider starts on a machine without rdma-core. Opening
//! an `rdma://` URL first checks that both libraries load and that the
//! kernel has an RDMA device, and fails with one
//! [`ProviderUnavailable`](crate::fabric::FabricErrorKind::ProviderUnavailable)
//! error naming what is missing.
//!
//! # Which device
//!
//! The URL names an address. `listen` uses the device that owns it
//! (`rdma_bind_addr`); the active side uses the device the route to it
//! leaves from (`rdma_resolve_addr`), as rdma_cm itself does. Protection
//! domains, completion queues and queue pairs belong to one device, so a
//! [`VerbsFabric`] settles on one at the first call that needs it: `listen`
//! takes the owning device, and `alloc_pd`, `create_cq` or `create_qp`
//! before any `listen` take the routed one. On a host with one RDMA device
//! per address both are the same; they differ only when the route to a
//! local address leaves through another device (the Soft-RoCE test VM's
//! routed link), where a passive user must call `listen` first.
//!
//! # Connections
//!
//! Both sides go through rdma_cm. Queue pairs are created by this provider
//! (rdma_cm does not own them) and moved through INIT, RTR and RTS with the
//! attributes `rdma_init_qp_attr` computes, then:
//! - RTS uses `timeout` 14 (67 ms), `retry_cnt` 6 (about half a second to
//!   declare a silent peer dead; 7 would retry forever on some devices) and
//!   `rnr_retry` 0: a SEND that finds no receive fails at once, as the
//!   protocol's credit rules and the tcp provider have it.
//! - Up to 16 RDMA READs may be in flight each way (capped by the device).
//! - Private data travels with a length byte in front (IB and RoCE pad it),
//!   so connect data is limited to 55 bytes, accept data to 195, reject
//!   data to 147. The raw calls (`connect_raw`, `accept_raw`,
//!   `reject_raw`, `raw_private_data`) leave the byte out, for stock peers
//!   (an NVMe/RDMA host) whose protocol has its own fields: up to 56, 196
//!   and 148 bytes go as given, and what arrives is handed over as the CM
//!   delivered it, padding included (a request's 56 bytes on IB and
//!   RoCE). A raw connect's error for a reject shows the reject's data as
//!   hex bytes.
//! - Once a connection is established (or a request is turned into a queue
//!   pair), its rdma_cm id moves to the event channel of the queue pair's
//!   completion queue, whose fd covers it. A DISCONNECTED there moves the
//!   queue pair to ERR (so its work requests flush into the CQ) and answers
//!   with `rdma_disconnect`; DEVICE_REMOVAL and ADDR_CHANGE do the same and
//!   are logged. Events of connections still on the listener's channel are
//!   routed the same way by `poll_request`.
//! - A thread per device logs its asynchronous events (port down, device
//!   fatal, queue pair errors).
//!
//! # Data path
//!
//! `post_send`/`post_recv` build `ibv_send_wr`/`ibv_recv_wr` chains on the
//! stack and call `ibv_post_send`/`ibv_post_recv`; `poll` calls
//! `ibv_poll_cq` on a classic CQ. Shadow queues per queue pair give every
//! completion its caller's `wr_id`, opcode and length (see the `qp` module);
//! nothing is allocated or registered per work request.
//!
//! # Differences from the tcp provider
//! - Arming a CQ does not fire for completions already queued
//!   (`ibv_req_notify_cq`): poll once more after arming.
//! - A CQ is limited to the device's `max_cqe` entries; a larger capacity
//!   is clamped, with a warning.
//! - `max_inline_data` may be granted smaller than asked when the device
//!   cannot inline that much; read it back from `caps()`.
//! - Devices disagree on a SEND longer than the receive: rxe reports
//!   `RemoteOperationError` at the sender and `LocalQpOperationError` at the
//!   receiver, mlx5 `RemoteInvalidRequest` and `LocalLengthError`. Statuses
//!   the facade has no name for map to `GeneralError`.

mod cm;
mod cq;
mod device;
mod listener;
mod mr;
mod mw;
mod qp;

use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

pub use cq::VerbsCq;
pub use listener::{VerbsConnectRequest, VerbsListener};
pub use mr::{VerbsMr, VerbsPd};
pub use qp::{VerbsQp, VerbsWindow};

use cm::{ev, CmChannel, CmId};
use device::{Device, RESOLVE_TIMEOUT};

use super::{FabricError, FabricErrorKind, FabricUrl, QpCaps, Result};
use crate::fabric::lock;

/// Local ACK timeout exponent: 4.096 µs × 2^14 = 67 ms.
pub(crate) const QP_TIMEOUT: u8 = 14;
/// Transport retries before RETRY_EXC_ERR (7 means "forever" on some devices).
pub(crate) const RETRY_CNT: u8 = 6;
/// Receiver-not-ready retries: none.
pub(crate) const RNR_RETRY: u8 = 0;
/// The RNR NAK timer this side advertises (0.01 ms); moot with no retries.
pub(crate) const MIN_RNR_TIMER: u8 = 1;
/// Largest message of one work request (as the tcp provider).
pub(crate) const MAX_MESSAGE: u64 = 1 << 30;

/// The verbs provider opened for one URL.
pub struct VerbsFabric {
    url: FabricUrl,
    addr: SocketAddr,
    /// The device that owns the address, if it is a local RDMA address.
    local: Option<Arc<Device>>,
    /// The device this fabric's objects live on, once settled.
    chosen: Mutex<Option<Arc<Device>>>,
}

impl VerbsFabric {
    pub fn open(url: &FabricUrl) -> Result<VerbsFabric> {
        device::check_available(url)?;
        let addr = url
            .host_port()
            .to_socket_addrs()
            .map_err(|e| FabricError::io(format!("{url}: resolving the host name"), e))?
            .next()
            .ok_or_else(|| FabricError::new(FabricErrorKind::InvalidUrl, format!("{url}: the host has no address")))?;
        if cm::is_wildcard(&addr.ip()) {
            return Err(FabricError::new(
                FabricErrorKind::InvalidArgument,
                format!("{url}: rdma:// needs the address of an RDMA device, not a wildcard"),
            ));
        }
        let local = Device::owning(url, &addr)?;
        let mut chosen = None;
        if local.is_none() {
            // Not a local RDMA address: usable only as a destination.
            match Device::routed(url, &addr) {
                Ok(d) => chosen = Some(d),
                Err(e) => {
                    return Err(FabricError::new(
                        FabricErrorKind::ProviderUnavailable,
                        format!("{url}: no RDMA device has address {}, and none routes to it ({})", addr.ip(), e.context),
                    ))
                }
            }
        }
        Ok(VerbsFabric { url: url.clone(), addr, local, chosen: Mutex::new(chosen) })
    }

    pub fn url(&self) -> &FabricUrl {
        &self.url
    }

    /// The device for PDs, CQs and active-side QPs.
    fn device(&self) -> Result<Arc<Device>> {
        let mut g = lock(&self.chosen);
        if let Some(d) = &*g {
            return Ok(d.clone());
        }
        let d = Device::routed(&self.url, &self.addr)?;
        *g = Some(d.clone());
        Ok(d)
    }

    pub fn alloc_pd(&self) -> Result<VerbsPd> {
        VerbsPd::new(self.device()?)
    }

    pub fn create_cq(&self, capacity: u32) -> Result<VerbsCq> {
        VerbsCq::new(self.device()?, capacity)
    }

    /// An active-side queue pair for this fabric's URL: resolves the address
    /// and route (rdma_cm), creates the QP and moves it to INIT.
    pub fn create_qp(&self, pd: &VerbsPd, cq: &VerbsCq, caps: QpCaps) -> Result<VerbsQp> {
        let dev = self.device()?;
        if !Arc::ptr_eq(&pd.dev, &dev) || !Arc::ptr_eq(&cq.sh.dev, &dev) {
            return Err(FabricError::new(
                FabricErrorKind::InvalidArgument,
                format!(
                    "{}: the fabric uses {}, the protection domain {} and the completion queue {}",
                    self.url, dev.name, pd.dev.name, cq.sh.dev.name
                ),
            ));
        }
        let url = &self.url;
        let io = |what: &str, e: std::io::Error| FabricError::io(format!("{url}: {what}"), e);
        let chan = CmChannel::new().map_err(|e| io("rdma_create_event_channel", e))?;
        let id = CmId::create(&chan, 0).map_err(|e| io("rdma_create_id", e))?;
        let ms = RESOLVE_TIMEOUT.as_millis() as i32;
        let resolve = |id: &CmId, start: &dyn Fn() -> std::io::Result<()>, ok: u32, what: &str| -> Result<()> {
            start().map_err(|e| {
                FabricError::new(FabricErrorKind::ConnectFailed, format!("{url}: {what}: {e}"))
            })?;
            let deadline = Instant::now() + RESOLVE_TIMEOUT + Duration::from_secs(1);
            match id.channel().wait_event(deadline) {
                Ok(Some(e)) if e.kind == ok => Ok(()),
                Ok(Some(e)) => Err(FabricError::new(
                    FabricErrorKind::ConnectFailed,
                    format!("{url}: {what}: {} ({})", e.name(), std::io::Error::from_raw_os_error(e.status.abs())),
                )),
                Ok(None) => Err(FabricError::new(FabricErrorKind::Timeout, format!("{url}: {what} timed out"))),
                Err(e) => Err(io("rdma_get_cm_event", e)),
            }
        };
        resolve(&id, &|| id.resolve_addr(&self.addr, ms), ev::ADDR_RESOLVED, "address resolution")?;
        if id.verbs() != dev.raw() {
            return Err(FabricError::new(
                FabricErrorKind::InvalidState,
                format!("{url}: the route now leaves from another RDMA device than {}", dev.name),
            ));
        }
        resolve(&id, &|| id.resolve_route(ms), ev::ROUTE_RESOLVED, "route resolution")?;
        let end = qp::Endpoint { id, url: Some(url.clone()), peer: self.addr.to_string(), passive_rd: None };
        VerbsQp::create(&dev, pd, cq, caps, end)
    }

    /// Listens on the URL's address, on the device that owns it.
    pub fn listen(&self) -> Result<VerbsListener> {
        let Some(local) = self.local.clone() else {
            return Err(FabricError::new(
                FabricErrorKind::ProviderUnavailable,
                format!("{}: no RDMA device has address {}", self.url, self.addr.ip()),
            ));
        };
        {
            let mut g = lock(&self.chosen);
            match &*g {
                Some(d) if !Arc::ptr_eq(d, &local) => {
                    return Err(FabricError::new(
                        FabricErrorKind::InvalidState,
                        format!(
                            "{}: this fabric already has objects on {} (the device the route to {} leaves from), \
                             but the address belongs to {}: call listen() before alloc_pd()/create_cq()",
                            self.url,
                            d.name,
                            self.addr.ip(),
                            local.name
                        ),
                    ))
                }
                Some(_) => {}
                None => *g = Some(local.clone()),
            }
        }
        VerbsListener::bind(&self.url, &self.addr, local)
    }
}
