//! The `rbd` backend: a volume is a Ceph RBD image, reached through librbd.
//! This file is the librbd glue: every call into librados and librbd, and
//! so every `unsafe` of the backend, is here.
//!
//! Data path: reads, writes, flushes, discards and write-zeroes are librbd
//! aio straight from and into the pool chunk of the command (librbd copies
//! what it sends into its own messages, as it must; nothing else copies).
//! librbd calls back on its own threads; the callback puts `(tag, result)`
//! on the reactor's [`RbdCompletions`] list and notifies its eventfd, which
//! is in the reactor's epoll set like the blocking worker's: no thread per
//! I/O, and the reactor reaps the list as it reaps its ring.
//!
//! Ownership: several gateways may export one image; only the owner of
//! the image's exclusive lock writes it. The lock is taken explicitly
//! (`rbd_lock_acquire`), which turns off librbd's cooperative hand-over: a
//! peer's request for the lock is refused, never granted behind our back.
//! A gateway takes the image over by breaking the current owner's lock
//! (`rbd_lock_break`), which first blocklists the owner's RADOS client in
//! the OSD map (`rbd_blocklist_on_break_lock`, on by default) and waits
//! for that map, then acquiring the lock. From then on the OSDs refuse
//! every operation of the old owner, including writes it still held when
//! it was frozen or cut off. The old owner learns it when its next
//! operation fails with `EBLOCKLISTED` (= `ESHUTDOWN`): it marks the image
//! fenced and serves nothing of it until it is reopened (a reload), under
//! a new client instance that is not blocklisted.

use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::path::Path;
use std::sync::{Arc, Mutex};

use rdmablk_rbd_sys as sys;

use crate::backend::ownership::{Access, Ownership};
use crate::config::{RbdConfig, VolumeConfig};
use crate::error::{Error, ErrorKind, Result};
use crate::sys::EventFd;

/// What librbd reports for an operation of a blocklisted client
/// (Ceph's EBLOCKLISTED is ESHUTDOWN on Linux).
pub const EBLOCKLISTED: i32 = libc::ESHUTDOWN;

/// How long connecting to the monitors and a monitor command (the
/// blocklist of a lock break) may take before the open or the takeover
/// fails, instead of librados' default of five minutes.
const MON_TIMEOUT_SECS: &str = "15";

/// A RADOS cluster connection, an I/O context on the pool (and namespace)
/// and the open image, closed in reverse order.
struct Handles {
    cluster: sys::rados_t,
    ioctx: sys::rados_ioctx_t,
    image: sys::rbd_image_t,
}

// SAFETY: librados and librbd handles are used from several threads by
// design (librbd's own threads call back; its API is thread-safe per image
// for I/O and for the lock calls, which serialise on the image's locks).
unsafe impl Send for Handles {}
// SAFETY: as above; the handles are never mutated on the Rust side after open.
unsafe impl Sync for Handles {}

impl Drop for Handles {
    fn drop(&mut self) {
        // SAFETY: each handle was opened by `RbdBackend::open` and is
        // closed exactly once, image first. rbd_close waits for the
        // image's in-flight aio; the engine keeps the volume (and so this
        // backend) alive until every operation it submitted was reaped, so
        // none is left by then.
        unsafe {
            if !self.image.is_null() {
                sys::rbd_close(self.image);
            }
            if !self.ioctx.is_null() {
                sys::rados_ioctx_destroy(self.ioctx);
            }
            if !self.cluster.is_null() {
                sys::rados_shutdown(self.cluster);
            }
        }
    }
}

/// What librbd's callbacks need of the image: its access and name.
struct Shared {
    ownership: Ownership,
    spec: String,
}

/// An open RBD image.
pub struct RbdBackend {
    handles: Handles,
    config: RbdConfig,
    writable: bool,
    shared: Arc<Shared>,
    /// One takeover at a time (each reactor's blocking worker may try).
    takeover: Mutex<()>,
    /// This client's address as the OSD map blocklists it (`ip:port/nonce`), for logs.
    client_addr: String,
}

impl std::fmt::Debug for RbdBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RbdBackend").field("image", &self.shared.spec).field("access", &self.shared.ownership.access()).finish()
    }
}

fn rbd_err(what: String, ret: i32) -> Error {
    Error::with_source(ErrorKind::Volume, what, std::io::Error::from_raw_os_error(-ret))
}

fn cstring(what: &str, s: &str) -> Result<CString> {
    CString::new(s).map_err(|_| Error::new(ErrorKind::Config, format!("{what}: {s:?} contains NUL")))
}

fn path_cstring(what: &str, p: &Path) -> Result<CString> {
    cstring(what, p.to_str().ok_or_else(|| Error::new(ErrorKind::Config, format!("{what}: {} is not UTF-8", p.display())))?)
}

impl RbdBackend {
    /// Connects to the cluster as `rbd.client` and opens the image; takes
    /// its lock when `rbd.lock_at_start` (and it is opened for writing).
    /// Blocks: the target opens volumes at start and on reload, never on a
    /// reactor. Returns the backend and the image's size.
    pub fn open(source: &str, vc: &VolumeConfig, rbd: &RbdConfig, read_only: bool) -> Result<(RbdBackend, u64)> {
        let spec = rbd.spec();
        let cx = |what: &str| format!("{source}: {}: rbd image {spec} as client.{}: {what}", vc.key("image"), rbd.client);
        let mut h = Handles { cluster: std::ptr::null_mut(), ioctx: std::ptr::null_mut(), image: std::ptr::null_mut() };
        let cluster_name = cstring("cluster", "ceph")?;
        let user = cstring(&vc.key("client"), &format!("client.{}", rbd.client))?;
        // SAFETY: `h.cluster` is a valid out-pointer; the strings live across the call.
        let r = unsafe { sys::rados_create2(&mut h.cluster, cluster_name.as_ptr(), user.as_ptr(), 0) };
        if r < 0 {
            return Err(rbd_err(cx("cannot create a RADOS client"), r));
        }
        let conf = rbd.ceph_conf.as_deref().map(|p| path_cstring(&vc.key("ceph_conf"), p)).transpose()?;
        // SAFETY: a NULL path makes librados search its default places.
        let r = unsafe { sys::rados_conf_read_file(h.cluster, conf.as_ref().map_or(std::ptr::null(), |c| c.as_ptr())) };
        if r < 0 {
            let which = rbd.ceph_conf.as_ref().map_or("the default ceph.conf ($CEPH_CONF, /etc/ceph/ceph.conf)".to_owned(), |p| p.display().to_string());
            return Err(rbd_err(cx(&format!("cannot read {which}")), r));
        }
        let mut settings: Vec<(&str, String)> = vec![
            // A gateway must never answer a read from a cache another
            // gateway's writes bypassed, nor hold acknowledged writes in one.
            ("rbd_cache", "false".into()),
            ("rbd_blocklist_on_break_lock", if crate::fault::rbd_no_blocklist() { "false" } else { "true" }.into()),
            ("client_mount_timeout", MON_TIMEOUT_SECS.into()),
            ("rados_mon_op_timeout", MON_TIMEOUT_SECS.into()),
        ];
        if let Some(k) = &rbd.keyring {
            settings.push(("keyring", k.to_str().ok_or_else(|| Error::new(ErrorKind::Config, cx("keyring path is not UTF-8")))?.to_owned()));
        }
        for (k, v) in &settings {
            let (kc, vcs) = (cstring("option", k)?, cstring(k, v)?);
            // SAFETY: valid cluster handle, NUL-terminated strings that outlive the call.
            let r = unsafe { sys::rados_conf_set(h.cluster, kc.as_ptr(), vcs.as_ptr()) };
            if r < 0 {
                return Err(rbd_err(cx(&format!("cannot set {k} = {v}")), r));
            }
        }
        // SAFETY: configured cluster handle; blocks at most client_mount_timeout.
        let r = unsafe { sys::rados_connect(h.cluster) };
        if r < 0 {
            let hint = match -r {
                libc::ETIMEDOUT => " (no monitor answered: is the cluster up, and does ceph.conf name its mon_host?)",
                libc::EACCES | libc::EPERM => " (the key was refused: check the keyring and the user's caps)",
                libc::ENOENT => " (no keyring for this user: give keyring = PATH)",
                _ => "",
            };
            return Err(rbd_err(cx(&format!("cannot connect to the cluster{hint}")), r));
        }
        let pool = cstring(&vc.key("pool"), &rbd.pool)?;
        // SAFETY: connected cluster handle, valid out-pointer.
        let r = unsafe { sys::rados_ioctx_create(h.cluster, pool.as_ptr(), &mut h.ioctx) };
        if r < 0 {
            return Err(rbd_err(cx(&format!("cannot open pool {:?}", rbd.pool)), r));
        }
        let ns = cstring(&vc.key("namespace"), &rbd.namespace)?;
        // SAFETY: valid ioctx; an empty namespace is the default one.
        unsafe { sys::rados_ioctx_set_namespace(h.ioctx, ns.as_ptr()) };
        let image = cstring(&vc.key("image"), &rbd.image)?;
        // SAFETY: valid ioctx, out-pointer and strings; no snapshot (NULL).
        let r = unsafe {
            if read_only {
                sys::rbd_open_read_only(h.ioctx, image.as_ptr(), &mut h.image, std::ptr::null())
            } else {
                sys::rbd_open(h.ioctx, image.as_ptr(), &mut h.image, std::ptr::null())
            }
        };
        if r < 0 {
            let hint = if -r == libc::ENOENT { format!(" (create it: rbd create --size SIZE {spec})") } else { String::new() };
            return Err(rbd_err(cx(&format!("cannot open the image{hint}")), r));
        }
        let mut features = 0u64;
        // SAFETY: open image, valid out-pointer.
        let r = unsafe { sys::rbd_get_features(h.image, &mut features) };
        if r < 0 {
            return Err(rbd_err(cx("cannot read the image's features"), r));
        }
        if !read_only && features & u64::from(sys::RBD_FEATURE_EXCLUSIVE_LOCK) == 0 {
            return Err(Error::new(
                ErrorKind::Volume,
                cx(&format!(
                    "the image has no exclusive-lock feature, without which gateways cannot be fenced off each other: \
                     rbd feature enable {spec} exclusive-lock"
                )),
            ));
        }
        // SAFETY: connected cluster handle.
        let client_addr = format!("client.{} instance {}", rbd.client, unsafe { sys::rados_get_instance_id(h.cluster) });
        let backend = RbdBackend {
            handles: h,
            config: rbd.clone(),
            writable: !read_only,
            shared: Arc::new(Shared { ownership: Ownership::new(Access::Standby), spec: spec.clone() }),
            takeover: Mutex::new(()),
            client_addr,
        };
        let size = backend.size().map_err(|e| Error::new(ErrorKind::Volume, cx(&e.to_string())))?;
        if read_only {
            // A read-only export writes nothing and needs no lock; it may
            // read data an owner is changing, as any reader of a shared disk.
            backend.shared.ownership.set(Access::Owner);
        } else if rbd.lock_at_start {
            backend.take_over().map_err(|e| Error::new(ErrorKind::Volume, cx(&format!("lock_at_start: {e}"))))?;
        }
        Ok((backend, size))
    }

    /// The image's size now.
    pub fn size(&self) -> Result<u64> {
        let mut size = 0u64;
        // SAFETY: open image, valid out-pointer.
        let r = unsafe { sys::rbd_get_size(self.handles.image, &mut size) };
        if r < 0 {
            return Err(rbd_err("cannot read the image size".into(), r));
        }
        Ok(size)
    }

    /// Grows the image to `size` bytes (a reload or a start with a larger `size`).
    pub fn grow(&self, size: u64) -> Result<()> {
        // SAFETY: open image.
        let r = unsafe { sys::rbd_resize(self.handles.image, size) };
        if r < 0 {
            return Err(rbd_err(format!("cannot resize the image to {size} bytes"), r));
        }
        Ok(())
    }

    pub fn config(&self) -> &RbdConfig {
        &self.config
    }

    pub fn writable(&self) -> bool {
        self.writable
    }

    pub fn ownership(&self) -> &Ownership {
        &self.shared.ownership
    }

    /// Makes this gateway the image's owner, fencing the previous owner.
    /// Blocks (monitor commands, OSD map waits): only on a blocking
    /// worker or at open. A fenced gateway does not take the image back:
    /// its client is blocklisted, and a host's stale commands could still
    /// be waiting in its sockets; it is reopened by a reload instead.
    pub fn take_over(&self) -> Result<()> {
        let _one = self.takeover.lock().unwrap_or_else(|e| e.into_inner());
        match self.shared.ownership.access() {
            Access::Owner => return Ok(()),
            Access::Fenced => return Err(Error::new(ErrorKind::NotOwner, format!("rbd image {}: fenced", self.config.spec()))),
            Access::Standby => {}
        }
        let spec = self.config.spec();
        let start = std::time::Instant::now();
        for _attempt in 0..5 {
            let owners = self.lock_owners()?;
            for owner in &owners {
                let o = cstring("lock owner", owner)?;
                // SAFETY: open image, NUL-terminated owner string from rbd_lock_get_owners.
                let r = unsafe { sys::rbd_lock_break(self.handles.image, sys::rbd_lock_mode_t_RBD_LOCK_MODE_EXCLUSIVE, o.as_ptr()) };
                // ENOENT: released meanwhile; EBUSY: the owner changed meanwhile (try again).
                if r < 0 && -r != libc::ENOENT && -r != libc::EBUSY {
                    return Err(rbd_err(format!("rbd image {spec}: cannot break the lock of {owner}"), r));
                }
                if r == 0 {
                    tracing::warn!(image = %spec, owner = %owner, "rbd image {spec}: took the exclusive lock from {owner}; Ceph blocklisted that client, its writes are refused from now on");
                }
            }
            // SAFETY: open image.
            let r = unsafe { sys::rbd_lock_acquire(self.handles.image, sys::rbd_lock_mode_t_RBD_LOCK_MODE_EXCLUSIVE) };
            match -r {
                0 => {
                    self.shared.ownership.set(Access::Owner);
                    let took = start.elapsed();
                    tracing::info!(image = %spec, "rbd image {spec}: this gateway ({}) owns it now (lock taken in {took:?})", self.client_addr);
                    return Ok(());
                }
                // Another gateway took it between the break and the acquire.
                libc::EROFS | libc::EBUSY | libc::EAGAIN => continue,
                e if e == EBLOCKLISTED => {
                    self.fence();
                    return Err(Error::new(ErrorKind::NotOwner, format!("rbd image {spec}: this gateway was blocklisted")));
                }
                _ => return Err(rbd_err(format!("rbd image {spec}: cannot acquire the exclusive lock"), r)),
            }
        }
        Err(Error::new(ErrorKind::Volume, format!("rbd image {spec}: the exclusive lock changed hands five times while taking it over")))
    }

    /// The clients that hold the image's lock.
    fn lock_owners(&self) -> Result<Vec<String>> {
        let mut mode: sys::rbd_lock_mode_t = sys::rbd_lock_mode_t_RBD_LOCK_MODE_EXCLUSIVE;
        let mut owners: [*mut c_char; 8] = [std::ptr::null_mut(); 8];
        let mut n: usize = owners.len();
        // SAFETY: open image; `owners` has room for `n` pointers, which
        // librbd fills and rbd_lock_get_owners_cleanup frees.
        let r = unsafe { sys::rbd_lock_get_owners(self.handles.image, &mut mode, owners.as_mut_ptr(), &mut n) };
        if -r == libc::ENOENT {
            return Ok(Vec::new());
        }
        if r < 0 {
            return Err(rbd_err(format!("rbd image {}: cannot read the lock's owners", self.config.spec()), r));
        }
        let list = owners[..n]
            .iter()
            // SAFETY: librbd returned `n` NUL-terminated strings.
            .map(|&p| unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
            .collect();
        // SAFETY: frees exactly what rbd_lock_get_owners allocated.
        unsafe { sys::rbd_lock_get_owners_cleanup(owners.as_mut_ptr(), n) };
        Ok(list)
    }

    /// Waits until the image's completed writes are durable (with the cache
    /// off, a completed write already is; this also waits for writes in flight).
    pub fn flush(&self) -> std::io::Result<()> {
        // SAFETY: open image.
        let r = unsafe { sys::rbd_flush(self.handles.image) };
        if r == -EBLOCKLISTED {
            // Another gateway took the image over: nothing of this one's may
            // land any more, so there is nothing left to make durable.
            self.fence();
            return Ok(());
        }
        if r < 0 {
            return Err(std::io::Error::from_raw_os_error(-r));
        }
        Ok(())
    }

    /// Asks Ceph whether this gateway, believing itself the owner, still
    /// holds the image's lock, and marks the image fenced when it does not.
    /// An owner taken over while it held no operation (a frozen gateway
    /// resumed with nothing in flight) learns it no other way before its
    /// next command. One round trip to Ceph: on a reload, never a reactor.
    pub fn confirm_ownership(&self) {
        if self.shared.ownership.access() != Access::Owner {
            return;
        }
        let mut is_owner: c_int = 0;
        // SAFETY: open image; `is_owner` is an int that librbd writes.
        let r = unsafe { sys::rbd_is_exclusive_lock_owner(self.handles.image, &mut is_owner) };
        if r == -EBLOCKLISTED || (r == 0 && is_owner == 0) {
            // Blocklisted, or the lock released behind its back (EROFS on
            // the next write): either way not the owner any more.
            self.fence();
        } else if r < 0 {
            tracing::warn!(image = %self.config.spec(), "rbd image {}: cannot tell whether this gateway still owns it: {}", self.config.spec(), std::io::Error::from_raw_os_error(-r));
        }
    }

    /// Marks the image fenced (an operation came back `EBLOCKLISTED`).
    fn fence(&self) {
        self.shared.fence();
    }

    /// Starts an aio operation; its result reaches `done` with `tag`.
    ///
    /// # Safety
    /// For `Read` and `Write`, `buf` must point to `len` bytes that stay
    /// valid (and, for a read, are not otherwise accessed) until the
    /// operation's completion was reaped from `done`.
    pub unsafe fn submit(&self, op: RbdOp, done: &mut RbdCompletions, tag: u64) -> std::result::Result<(), i32> {
        let ctx = Box::new(AioCtx { sink: Arc::clone(&done.sink), image: Arc::clone(&self.shared), tag });
        let arg = Box::into_raw(ctx);
        let mut c: sys::rbd_completion_t = std::ptr::null_mut();
        // SAFETY: `arg` is a leaked box that the callback takes back exactly once.
        let r = unsafe { sys::rbd_aio_create_completion(arg.cast(), Some(aio_done), &mut c) };
        if r < 0 {
            // SAFETY: the completion was not created: the box is ours again.
            drop(unsafe { Box::from_raw(arg) });
            return Err(r);
        }
        let img = self.handles.image;
        // SAFETY: open image and completion; the caller keeps `buf` valid until the completion is reaped.
        let r = unsafe {
            match op {
                RbdOp::Read { buf, len, offset } => sys::rbd_aio_read(img, offset, len, buf.cast(), c) as c_int,
                RbdOp::Write { buf, len, offset } => sys::rbd_aio_write(img, offset, len, buf.cast(), c) as c_int,
                RbdOp::Flush => sys::rbd_aio_flush(img, c),
                RbdOp::Discard { offset, len } => sys::rbd_aio_discard(img, offset, len, c),
                RbdOp::WriteZeroes { offset, len } => sys::rbd_aio_write_zeroes(img, offset, len as usize, c, 0, 0),
            }
        };
        if r < 0 {
            // SAFETY: librbd refused the operation, so the callback will not run: take the box back and free the completion.
            unsafe {
                drop(Box::from_raw(arg));
                sys::rbd_aio_release(c);
            }
            return Err(r);
        }
        done.inflight += 1;
        Ok(())
    }
}

impl Shared {
    fn fence(&self) {
        if self.ownership.set(Access::Fenced) {
            let spec = &self.spec;
            tracing::error!(image = %spec, "rbd image {spec}: another gateway took it over and Ceph blocklisted this one: serving nothing of it (reads answer NotOwner / ANA inaccessible) until a reload reopens it");
        }
    }
}

/// One operation of the data path.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RbdOp {
    Read { buf: *mut u8, len: usize, offset: u64 },
    Write { buf: *const u8, len: usize, offset: u64 },
    Flush,
    Discard { offset: u64, len: u64 },
    WriteZeroes { offset: u64, len: u64 },
}

/// One operation in librbd's hands; boxed per operation (librbd's own
/// per-operation allocations dwarf it).
// SAFETY: the buffer pointers are the engine's pool chunks, owned by the
// command until the operation's completion is reaped (the contract of
// `RbdBackend::submit` and `take_over_then`); the blocking worker that
// carries a standby's first operations touches them only within it.
unsafe impl Send for RbdOp {}

struct AioCtx {
    sink: Arc<Sink>,
    image: Arc<Shared>,
    tag: u64,
}

/// Completed operations waiting for the reactor.
struct Sink {
    done: Mutex<Vec<(u64, i32)>>,
    wake: EventFd,
}

extern "C" fn aio_done(c: sys::rbd_completion_t, arg: *mut c_void) {
    // SAFETY: `arg` is the box leaked by `submit` for this completion; librbd calls back once.
    let ctx = unsafe { Box::from_raw(arg.cast::<AioCtx>()) };
    // SAFETY: the completion is valid until released here, once.
    let ret = unsafe {
        let r = sys::rbd_aio_get_return_value(c);
        sys::rbd_aio_release(c);
        r
    };
    let mut res = ret.clamp(i32::MIN as isize, i32::MAX as isize) as i32;
    if res == -EBLOCKLISTED || (res == -libc::EROFS && ctx.image.ownership.access() == Access::Owner) {
        // Blocklisted: another gateway broke our lock. EROFS on an owner:
        // the lock is gone without a blocklist (released by an operator);
        // either way this gateway must stop serving.
        ctx.image.fence();
        res = -EBLOCKLISTED;
    }
    ctx.sink.done.lock().unwrap_or_else(|e| e.into_inner()).push((ctx.tag, res));
    ctx.sink.wake.notify();
}

/// A reactor's side of librbd's completions: a list the callbacks fill and
/// an eventfd they notify.
pub struct RbdCompletions {
    sink: Arc<Sink>,
    inflight: usize,
    /// Swapped with the shared list at each reap, so that neither side allocates once warm.
    spare: Vec<(u64, i32)>,
}

impl RbdCompletions {
    pub fn new() -> Result<RbdCompletions> {
        let wake = EventFd::new().map_err(|e| Error::os("eventfd", e))?;
        Ok(RbdCompletions { sink: Arc::new(Sink { done: Mutex::new(Vec::with_capacity(256)), wake }), inflight: 0, spare: Vec::with_capacity(256) })
    }

    /// The eventfd that becomes readable when completions wait.
    pub fn fd(&self) -> std::os::fd::RawFd {
        self.sink.wake.fd()
    }

    pub fn inflight(&self) -> usize {
        self.inflight
    }

    /// Reads the eventfd if it was notified (see `BlockingWorker::clear_wake`).
    pub fn clear_wake(&self) {
        self.sink.wake.drain_if_notified();
    }

    /// Reports finished operations as `f(tag, result)`; returns how many.
    pub fn reap(&mut self, mut f: impl FnMut(u64, i32)) -> usize {
        if self.inflight == 0 {
            return 0;
        }
        self.sink.wake.drain();
        {
            let mut shared = self.sink.done.lock().unwrap_or_else(|e| e.into_inner());
            std::mem::swap(&mut *shared, &mut self.spare);
        }
        let n = self.spare.len();
        self.inflight -= n;
        for (tag, res) in self.spare.drain(..) {
            f(tag, res);
        }
        n
    }
}

/// A blocking operation of a standby gateway's first commands: the
/// takeover, then the operation itself (synchronously, on the blocking
/// worker). Returns bytes moved or `-errno`.
///
/// # Safety
/// As [`RbdBackend::submit`]: `buf` valid for `len` bytes until the job's result is reaped.
pub unsafe fn take_over_then(backend: &RbdBackend, op: RbdOp) -> i32 {
    if let Err(e) = backend.take_over() {
        tracing::warn!("{e}");
        return if e.kind() == ErrorKind::NotOwner { -EBLOCKLISTED } else { -libc::EIO };
    }
    let img = backend.handles.image;
    // SAFETY: open image; the caller keeps `buf` valid.
    let r: isize = unsafe {
        match op {
            RbdOp::Read { buf, len, offset } => sys::rbd_read2(img, offset, len, buf.cast(), 0),
            RbdOp::Write { buf, len, offset } => sys::rbd_write2(img, offset, len, buf.cast(), 0),
            RbdOp::Flush => sys::rbd_flush(img) as isize,
            RbdOp::Discard { offset, len } => sys::rbd_discard(img, offset, len) as isize,
            RbdOp::WriteZeroes { offset, len } => sys::rbd_write_zeroes(img, offset, len as usize, 0, 0),
        }
    };
    let mut res = r.clamp(i32::MIN as isize, i32::MAX as isize) as i32;
    if res == -EBLOCKLISTED {
        backend.fence();
    } else if res > 0 && matches!(op, RbdOp::Discard { .. } | RbdOp::WriteZeroes { .. }) {
        res = 0;
    }
    res
}
