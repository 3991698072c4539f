//! Finding the libraries and the RDMA device, and watching the device's
//! asynchronous events.

use std::collections::HashMap;
use std::ffi::{CStr, CString};
use std::net::SocketAddr;
use std::ptr::NonNull;
use std::sync::{Arc, LazyLock, Mutex, OnceLock};
use std::time::{Duration, Instant};

use rdma_mummy_sys as sys;
use sideway::ibverbs::device::DeviceInfo;
use sideway::ibverbs::device_context::{DeviceCapabilityFlags, DeviceContext};
use sideway::rdmacm::communication_manager::{BindAddressErrorKind, EventChannel, EventType, PortSpace};

use crate::fabric::{lock, FabricError, FabricErrorKind, FabricUrl, Result};

/// Address and route resolution time limit.
pub(crate) const RESOLVE_TIMEOUT: Duration = Duration::from_secs(2);

fn unavailable(url: &FabricUrl, why: impl std::fmt::Display) -> FabricError {
    FabricError::new(FabricErrorKind::ProviderUnavailable, format!("{url}: {why}"))
}

/// dlopen()s `name` and keeps it loaded; the error text on failure.
fn load(name: &str) -> std::result::Result<(), String> {
    let c = CString::new(name).expect("no NUL in a library name");
    // SAFETY: dlopen with a valid C string; the handle is intentionally
    // leaked (the library stays loaded for the process, as rdma-mummy-sys's
    // own dlopen keeps it).
    let h = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
    if !h.is_null() {
        return Ok(());
    }
    // SAFETY: dlerror returns NULL or a NUL-terminated thread-local string.
    let e = unsafe { libc::dlerror() };
    let detail = if e.is_null() {
        "not found".to_owned()
    } else {
        // SAFETY: non-NULL, NUL-terminated.
        unsafe { CStr::from_ptr(e) }.to_string_lossy().into_owned()
    };
    Err(detail)
}

/// Checks that libibverbs and librdmacm can be loaded (rdma-mummy-sys
/// resolves their symbols at start-up and, when they are missing, leaves
/// every call failing with EOPNOTSUPP: so look first, and say what is missing).
fn libraries() -> std::result::Result<(), String> {
    static LIBS: OnceLock<std::result::Result<(), String>> = OnceLock::new();
    LIBS.get_or_init(|| {
        for lib in ["libibverbs.so.1", "librdmacm.so.1"] {
            if let Err(detail) = load(lib) {
                const INSTALL: &str = "install rdma-core: apt-get install rdma-core ibverbs-providers";
                return Err(if detail.contains("No such file") {
                    format!("{lib} not found ({INSTALL})")
                } else {
                    format!("{lib} cannot be loaded: {detail} ({INSTALL})")
                });
            }
        }
        Ok(())
    })
    .clone()
}

/// Checks that the libraries load and at least one RDMA device exists.
pub(crate) fn check_available(url: &FabricUrl) -> Result<()> {
    libraries().map_err(|why| unavailable(url, why))?;
    let mut n: libc::c_int = 0;
    // SAFETY: a valid out-pointer; the list is freed below.
    let list = unsafe { sys::ibv_get_device_list(&mut n) };
    if list.is_null() {
        let e = std::io::Error::last_os_error();
        return Err(if e.raw_os_error() == Some(libc::ENOSYS) {
            unavailable(url, "no RDMA device: this kernel has no RDMA support loaded (no /sys/class/infiniband)")
        } else {
            unavailable(url, format!("no RDMA device: ibv_get_device_list failed: {e}"))
        });
    }
    // SAFETY: a list returned by ibv_get_device_list.
    unsafe { sys::ibv_free_device_list(list) };
    if n <= 0 {
        return Err(unavailable(
            url,
            "no RDMA device found (no RDMA driver is bound to a NIC; for Soft-RoCE: rdma link add rxe0 type rxe netdev IFACE)",
        ));
    }
    Ok(())
}

/// One RDMA device (librdmacm's context for it, shared process-wide) and
/// the limits this provider checks against.
pub(crate) struct Device {
    pub(crate) ctx: Arc<DeviceContext>,
    raw: NonNull<sys::ibv_context>,
    pub(crate) name: String,
    pub(crate) max_cqe: u32,
    pub(crate) max_qp_wr: u32,
    pub(crate) max_sge: u32,
    pub(crate) max_sge_rd: u32,
    /// Type-2B memory windows are available (`IBV_DEVICE_MEM_WINDOW_TYPE_2B`).
    pub(crate) windows: bool,
    /// RDMA READs in flight per queue pair, each way (responder resources
    /// and initiator depth), capped at [`MAX_RD_ATOMIC`].
    pub(crate) rd_atomic: u8,
    /// The `wc_flags` bit that marks the receive of a SEND with Invalidate
    /// (whose `invalidated_rkey` is then valid): `IBV_WC_WITH_INV` (8),
    /// except on rxe. Its user-space provider hands over the completions
    /// the kernel wrote (a plain copy of `ib_uverbs_wc`), whose flags are
    /// the kernel's `ib_wc_flags`: there the bit is `IB_WC_WITH_INVALIDATE`
    /// (4, which libibverbs calls `IBV_WC_IP_CSUM_OK`), and bit 8 is never
    /// set. Reading it the libibverbs way on rxe would miss every remote
    /// invalidation, and the window's owner would invalidate it a second
    /// time, which panics rxe (see the `mw` module).
    pub(crate) wc_with_inv: u32,
}

/// `ibv_device_attr.vendor_id` of rxe (Soft-RoCE), `RXE_VENDOR_ID`.
const RXE_VENDOR_ID: u32 = 0xFF_FFFF;
/// `IB_WC_WITH_INVALIDATE` in the kernel's `enum ib_wc_flags`.
const KERNEL_WC_WITH_INVALIDATE: u32 = 1 << 2;

// SAFETY: `raw` is librdmacm's ibv_context, which lives for the whole
// process and whose calls are thread-safe; the rest is plain data.
unsafe impl Send for Device {}
// SAFETY: as above.
unsafe impl Sync for Device {}

/// Most RDMA READs in flight per queue pair we ask for.
const MAX_RD_ATOMIC: i32 = 16;

static DEVICES: LazyLock<Mutex<HashMap<usize, Arc<Device>>>> = LazyLock::new(|| Mutex::new(HashMap::new()));

impl Device {
    pub(crate) fn raw(&self) -> *mut sys::ibv_context {
        self.raw.as_ptr()
    }

    /// The process-wide Device for a context librdmacm opened.
    fn get(ctx: Arc<DeviceContext>) -> std::result::Result<Arc<Device>, String> {
        // SAFETY: the pointer is only used as a key and for calls while the
        // context lives (librdmacm keeps its contexts open).
        let raw = unsafe { ctx.context() };
        let mut devs = lock(&DEVICES);
        if let Some(d) = devs.get(&(raw.as_ptr() as usize)) {
            return Ok(d.clone());
        }
        let name = ctx.name();
        let attr = ctx.query_device().map_err(|e| format!("ibv_query_device on {name}: {e}"))?;
        let dev = Arc::new(Device {
            ctx: ctx.clone(),
            raw,
            max_cqe: attr.max_cqe().max(1) as u32,
            max_qp_wr: attr.max_qp_wr().max(1) as u32,
            max_sge: attr.max_sge().max(1) as u32,
            max_sge_rd: attr.max_sge_rd().max(1) as u32,
            windows: attr.max_mw() > 0 && attr.device_cap_flags().contains(DeviceCapabilityFlags::MemoryWindowType2B),
            rd_atomic: attr.max_qp_rd_atom().min(attr.max_qp_init_rd_atom()).clamp(1, MAX_RD_ATOMIC) as u8,
            wc_with_inv: if attr.vendor_id() == RXE_VENDOR_ID {
                KERNEL_WC_WITH_INVALIDATE
            } else {
                sys::ibv_wc_flags::IBV_WC_WITH_INV.0
            },
            name,
        });
        devs.insert(raw.as_ptr() as usize, dev.clone());
        spawn_async_watcher(&dev);
        tracing::debug!(
            device = %dev.name,
            max_cqe = dev.max_cqe,
            max_qp_wr = dev.max_qp_wr,
            max_sge = dev.max_sge,
            max_sge_rd = dev.max_sge_rd,
            windows = dev.windows,
            rd_atomic = dev.rd_atomic,
            wc_with_inv = dev.wc_with_inv,
            "RDMA device opened"
        );
        Ok(dev)
    }

    /// The device that owns `addr` (rdma_bind_addr), or None if no RDMA
    /// device has that address.
    pub(crate) fn owning(url: &FabricUrl, addr: &SocketAddr) -> Result<Option<Arc<Device>>> {
        let chan = EventChannel::new().map_err(|e| unavailable(url, format!("cannot open rdma_cm: {e:?}")))?;
        let id = chan.create_id(PortSpace::Tcp).map_err(|e| unavailable(url, format!("rdma_create_id: {e:?}")))?;
        let probe = SocketAddr::new(addr.ip(), 0);
        if let Err(e) = id.bind_addr(probe) {
            let errno = match &e.source {
                BindAddressErrorKind::Rdmacm(io) => io.raw_os_error(),
                _ => None,
            };
            return match errno {
                Some(libc::ENODEV) | Some(libc::EADDRNOTAVAIL) | Some(libc::ENOENT) => Ok(None),
                _ => Err(unavailable(url, format!("rdma_bind_addr({}): {e:?}", addr.ip()))),
            };
        }
        let Some(ctx) = id.get_device_context() else { return Ok(None) };
        Device::get(ctx).map(Some).map_err(|why| unavailable(url, why))
    }

    /// The device the route to `addr` leaves from (rdma_resolve_addr).
    pub(crate) fn routed(url: &FabricUrl, addr: &SocketAddr) -> Result<Arc<Device>> {
        let chan = EventChannel::new().map_err(|e| unavailable(url, format!("cannot open rdma_cm: {e:?}")))?;
        chan.set_nonblocking(true).map_err(|e| FabricError::io("O_NONBLOCK on an rdma_cm channel", e))?;
        let id = chan.create_id(PortSpace::Tcp).map_err(|e| unavailable(url, format!("rdma_create_id: {e:?}")))?;
        id.resolve_addr(None, *addr, RESOLVE_TIMEOUT).map_err(|e| {
            FabricError::new(FabricErrorKind::ConnectFailed, format!("{url}: cannot resolve {}: {e:?}", addr.ip()))
        })?;
        let deadline = Instant::now() + RESOLVE_TIMEOUT * 2;
        use std::os::fd::AsRawFd;
        let fd = chan.as_raw_fd();
        let ev = loop {
            match chan.get_cm_event() {
                Ok(ev) => break ev,
                Err(_) if Instant::now() < deadline => {
                    let mut pfd = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
                    // SAFETY: a valid pollfd for the call.
                    unsafe { libc::poll(&mut pfd, 1, 50) };
                }
                Err(e) => {
                    return Err(FabricError::new(
                        FabricErrorKind::Timeout,
                        format!("{url}: resolving {} to an RDMA device timed out: {e:?}", addr.ip()),
                    ))
                }
            }
        };
        let (kind, status) = (ev.event_type(), ev.status());
        let _ = ev.ack();
        if kind != EventType::AddressResolved {
            return Err(FabricError::new(
                FabricErrorKind::ConnectFailed,
                format!(
                    "{url}: no route to {} over an RDMA device ({kind:?}: {})",
                    addr.ip(),
                    std::io::Error::from_raw_os_error(status.abs())
                ),
            ));
        }
        let ctx = id
            .get_device_context()
            .ok_or_else(|| unavailable(url, format!("{} resolved to no RDMA device", addr.ip())))?;
        Device::get(ctx).map_err(|why| unavailable(url, why))
    }
}

// ------------------------------------------------------- async events --

/// The layout of `struct ibv_async_event` with the event type as a plain
/// integer: rdma-mummy-sys declares it as a Rust enum, which a value from a
/// newer kernel would make undefined behaviour.
#[repr(C)]
struct RawAsyncEvent {
    element: *mut libc::c_void,
    event_type: u32,
}

const _: () = assert!(std::mem::size_of::<RawAsyncEvent>() == std::mem::size_of::<sys::ibv_async_event>());

/// One thread per device reads its asynchronous events (port up/down,
/// device fatal, queue pair errors) and logs them. Queue pair errors also
/// show up as error completions, which the data path acts on; this thread
/// only makes the cause visible.
fn spawn_async_watcher(dev: &Arc<Device>) {
    struct Ctx(NonNull<sys::ibv_context>);
    // SAFETY: librdmacm's context lives for the process; ibv_get_async_event
    // is meant to be called from a dedicated thread.
    unsafe impl Send for Ctx {}
    let ctx = Ctx(dev.raw);
    let name = dev.name.clone();
    let spawned = std::thread::Builder::new().name(format!("rdma-async-{name}")).spawn(move || {
        let ctx = ctx;
        let raw = ctx.0.as_ptr();
        // SAFETY: a live context; async_fd is a plain field.
        let fd = unsafe { (*raw).async_fd };
        loop {
            let mut pfd = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
            // SAFETY: a valid pollfd for the call.
            let rc = unsafe { libc::poll(&mut pfd, 1, -1) };
            if rc < 0 {
                if std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted {
                    continue;
                }
                tracing::warn!(device = %name, "poll on the async event fd failed; no longer watching it");
                return;
            }
            let mut ev = RawAsyncEvent { element: std::ptr::null_mut(), event_type: 0 };
            // SAFETY: `ev` has the layout of ibv_async_event (checked above).
            let rc = unsafe { sys::ibv_get_async_event(raw, &mut ev as *mut RawAsyncEvent as *mut sys::ibv_async_event) };
            if rc != 0 {
                continue;
            }
            log_async(&name, &ev);
            // SAFETY: an event returned by ibv_get_async_event, acknowledged once.
            unsafe { sys::ibv_ack_async_event(&mut ev as *mut RawAsyncEvent as *mut sys::ibv_async_event) };
        }
    });
    if let Err(e) = spawned {
        tracing::warn!(device = %dev.name, "cannot start the async event thread: {e}");
    }
}

fn log_async(dev: &str, ev: &RawAsyncEvent) {
    // The element is a QP, CQ, SRQ or WQ pointer, or the port number.
    let port = ev.element as usize as u32;
    let qp_num = || {
        if ev.element.is_null() {
            0
        } else {
            // SAFETY: for QP events the element is the ibv_qp, valid until
            // the event is acknowledged.
            unsafe { (*(ev.element as *mut sys::ibv_qp)).qp_num }
        }
    };
    match ev.event_type {
        10 => tracing::error!(device = dev, port, "RDMA port down (IBV_EVENT_PORT_ERR): connections over it fail"),
        9 => tracing::info!(device = dev, port, "RDMA port active (IBV_EVENT_PORT_ACTIVE)"),
        8 => tracing::error!(device = dev, "RDMA device failed (IBV_EVENT_DEVICE_FATAL): every connection over it is lost"),
        0 => tracing::error!(device = dev, "completion queue error (IBV_EVENT_CQ_ERR: overrun?)"),
        1 => tracing::warn!(device = dev, qp = qp_num(), "queue pair fatal error (IBV_EVENT_QP_FATAL)"),
        2 => tracing::warn!(device = dev, qp = qp_num(), "invalid request on queue pair (IBV_EVENT_QP_REQ_ERR)"),
        3 => tracing::warn!(device = dev, qp = qp_num(), "access violation on queue pair (IBV_EVENT_QP_ACCESS_ERR)"),
        4 | 16 => tracing::debug!(device = dev, qp = qp_num(), event = ev.event_type, "queue pair event"),
        18 => tracing::info!(device = dev, port, "GID table changed (IBV_EVENT_GID_CHANGE)"),
        t => tracing::info!(device = dev, event = t, "RDMA async event"),
    }
}
