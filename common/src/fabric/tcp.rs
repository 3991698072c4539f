//! The `tcp` provider: verbs semantics over a TCP stream. (Skeleton: being implemented.)

use std::os::fd::RawFd;
use std::time::Duration;

use super::{Access, Completion, FabricUrl, Lkey, QpCaps, QpNum, QpState, RecvWr, Result, Rkey, SendWr};

pub struct TcpFabric;
pub struct TcpPd;
pub struct TcpMr;
pub struct TcpCq;
pub struct TcpQp;
pub struct TcpListener;
pub struct TcpConnectRequest;

impl TcpFabric {
    pub fn open(_url: &FabricUrl) -> Result<Self> { todo!() }
    pub fn url(&self) -> &FabricUrl { todo!() }
    pub fn alloc_pd(&self) -> Result<TcpPd> { todo!() }
    pub fn create_cq(&self, _capacity: u32) -> Result<TcpCq> { todo!() }
    pub fn create_qp(&self, _pd: &TcpPd, _cq: &TcpCq, _caps: QpCaps) -> Result<TcpQp> { todo!() }
    pub fn listen(&self) -> Result<TcpListener> { todo!() }
}
impl TcpPd {
    /// # Safety
    /// See [`super::ProtectionDomain::register`].
    pub unsafe fn register(&self, _addr: *mut u8, _len: usize, _access: Access) -> Result<TcpMr> { todo!() }
}
impl TcpMr {
    pub fn lkey(&self) -> Lkey { todo!() }
    pub fn rkey(&self) -> Rkey { todo!() }
    pub fn addr(&self) -> u64 { todo!() }
    pub fn len(&self) -> usize { todo!() }
    pub fn access(&self) -> Access { todo!() }
}
impl TcpCq {
    pub fn poll(&self, _out: &mut [Completion]) -> Result<usize> { todo!() }
    pub fn fd(&self) -> RawFd { todo!() }
    pub fn arm(&self) -> Result<()> { todo!() }
    pub fn ack_event(&self) -> Result<()> { todo!() }
}
impl TcpQp {
    pub fn qp_num(&self) -> QpNum { todo!() }
    pub fn state(&self) -> QpState { todo!() }
    pub fn caps(&self) -> QpCaps { todo!() }
    pub fn peer(&self) -> String { todo!() }
    pub fn connect(&self, _private_data: &[u8], _timeout: Duration) -> Result<Vec<u8>> { todo!() }
    pub fn accept(&self, _private_data: &[u8]) -> Result<()> { todo!() }
    pub fn post_send(&self, _wrs: &[SendWr<'_>]) -> Result<()> { todo!() }
    pub fn post_recv(&self, _wrs: &[RecvWr<'_>]) -> Result<()> { todo!() }
    pub fn disconnect(&self) { todo!() }
}
impl TcpListener {
    pub fn fd(&self) -> RawFd { todo!() }
    pub fn local_url(&self) -> FabricUrl { todo!() }
    pub fn poll_request(&self) -> Result<Option<TcpConnectRequest>> { todo!() }
}
impl TcpConnectRequest {
    pub fn private_data(&self) -> &[u8] { todo!() }
    pub fn peer(&self) -> String { todo!() }
    pub fn into_queue_pair(self, _pd: &TcpPd, _cq: &TcpCq, _caps: QpCaps) -> Result<TcpQp> { todo!() }
    pub fn reject(self, _private_data: &[u8]) { todo!() }
}
