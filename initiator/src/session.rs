//! Sessions (one connection to a target) and the volumes opened through them.

use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use rdmablk_common::fabric::{Access, Fabric, FabricErrorKind, FabricUrl, ProtectionDomain, QpCaps};
use rdmablk_common::protocol::{
    validate_name, CommandCapsule, CommandId, ConnectReply, Opcode, ResponseCapsule, Status, VolumeId, VolumeInfo,
    COMMAND_CAPSULE_SIZE, MAX_HOST_ID_LEN, PROTOCOL_VERSION, RESPONSE_SLOT_SIZE, VOLUME_FLAG_DISCARD,
    VOLUME_FLAG_WRITE_ZEROES,
};

use crate::buffer::{IoBuffer, Region};
use crate::device::{check_request, BlockDevice, WriteFlags};
use crate::error::{Error, Result};
use crate::queue::{status_error, Conn, Data, Queue, SendSlots, Stats, VolCtx};

/// Receives posted beyond the requested queue depth.
const RECV_MARGIN: usize = 4;
/// Most inline write data this initiator puts in one command, whatever the
/// target offers (bounds the send slot memory: depth × slot).
const INLINE_CAP: usize = 8192;

/// How to connect. `Default` gives the documented defaults.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConnectOptions {
    /// Identifies this host to the target (access control, logs): UTF-8, at
    /// most 223 bytes, no NUL. Default: the machine's host name.
    pub host_id: String,
    /// Commands this initiator wants outstanding at once (1..=65535). The
    /// target may grant fewer. Default 128.
    pub queue_depth: u32,
    /// Largest data transfer of one command, in bytes. The target may grant
    /// less; larger requests are split. Default 1 MiB.
    pub max_io_size: u32,
    /// Deadline for establishing the connection and the CONNECT exchange.
    /// Default 10 s.
    pub connect_timeout: Duration,
    /// Deadline for the response of each command. A command that misses it
    /// closes the connection. Default 30 s.
    pub io_timeout: Duration,
    /// Bytes of registered memory used to stage I/O on plain slices (at
    /// least one max-I/O-size chunk, at most one per queue slot). Default 4 MiB.
    pub bounce_pool_size: usize,
}

impl Default for ConnectOptions {
    fn default() -> Self {
        ConnectOptions {
            host_id: default_host_id(),
            queue_depth: 128,
            max_io_size: 1 << 20,
            connect_timeout: Duration::from_secs(10),
            io_timeout: Duration::from_secs(30),
            bounce_pool_size: 4 << 20,
        }
    }
}

/// The machine's host name, or `rdmablk-initiator`.
pub fn default_host_id() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|s| s.trim().to_owned())
        .filter(|s| !s.is_empty() && s.len() <= MAX_HOST_ID_LEN && !s.contains('\0'))
        .unwrap_or_else(|| "rdmablk-initiator".to_owned())
}

impl ConnectOptions {
    fn validate(&self) -> Result<()> {
        if self.host_id.len() > MAX_HOST_ID_LEN || self.host_id.contains('\0') {
            return Err(Error::invalid(format!(
                "host id of {} bytes is invalid: at most {MAX_HOST_ID_LEN} bytes of UTF-8 without NUL",
                self.host_id.len()
            )));
        }
        if self.queue_depth == 0 || self.queue_depth > u32::from(u16::MAX) {
            return Err(Error::invalid(format!("queue depth {} is outside 1..=65535", self.queue_depth)));
        }
        if self.max_io_size < 512 {
            return Err(Error::invalid(format!("max I/O size {} is below 512 bytes", self.max_io_size)));
        }
        if self.connect_timeout.is_zero() || self.io_timeout.is_zero() {
            return Err(Error::invalid("timeouts must be longer than zero"));
        }
        Ok(())
    }
}

/// What CONNECT negotiated.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub struct NegotiatedLimits {
    /// Commands outstanding at once on the queue pair (the smaller of what
    /// was asked and what the target granted).
    pub queue_depth: u32,
    /// Largest data transfer of one command, in bytes.
    pub max_io_size: u32,
    /// Largest write payload the target accepts inline in a command.
    pub inline_data_size: u32,
}

/// Counters of a session, for tests and monitoring.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct SessionStats {
    /// Commands sent, of every kind.
    pub commands: u64,
    /// Pieces of I/O on plain slices staged through the bounce pool (one copy each).
    pub bounce_copies: u64,
    /// Bytes copied through the bounce pool.
    pub bounce_bytes: u64,
    /// Write pieces sent as inline data.
    pub inline_writes: u64,
    /// Bytes sent inline.
    pub inline_bytes: u64,
    /// Bytes moved directly to or from [`IoBuffer`]s.
    pub zero_copy_bytes: u64,
}

/// Protection domain and fabric of a session; buffers keep it alive.
pub(crate) struct Domain {
    // The PD goes before the fabric it was allocated from.
    pd: ProtectionDomain,
    _fabric: Fabric,
}

impl Domain {
    pub(crate) fn pd(&self) -> &ProtectionDomain {
        &self.pd
    }
}

/// Anything that names a target: `"tcp://host:port"` or a [`FabricUrl`].
pub trait IntoTargetUrl {
    /// Parses or clones the URL.
    fn into_target_url(self) -> Result<FabricUrl>;
}

impl IntoTargetUrl for &str {
    fn into_target_url(self) -> Result<FabricUrl> {
        FabricUrl::parse(self).map_err(|e| Error::fabric("parsing the target URL", e))
    }
}
impl IntoTargetUrl for String {
    fn into_target_url(self) -> Result<FabricUrl> {
        self.as_str().into_target_url()
    }
}
impl IntoTargetUrl for &String {
    fn into_target_url(self) -> Result<FabricUrl> {
        self.as_str().into_target_url()
    }
}
impl IntoTargetUrl for FabricUrl {
    fn into_target_url(self) -> Result<FabricUrl> {
        Ok(self)
    }
}
impl IntoTargetUrl for &FabricUrl {
    fn into_target_url(self) -> Result<FabricUrl> {
        Ok(self.clone())
    }
}

/// A connection to a target: one queue pair (today), the negotiated limits,
/// and the registered memory of its buffers.
///
/// Cheap to clone (a handle); the connection closes when the last handle,
/// [`Volume`] and [`IoBuffer`] user of it is gone, or at [`Session::close`].
///
/// # Concurrency
/// `Session` and [`Volume`] are `Send + Sync`. Requests from several threads
/// share the one queue pair and run one at a time; each request pipelines its
/// own pieces up to the queue depth.
///
/// # Failures
/// A command without a response within [`ConnectOptions::io_timeout`], a
/// fabric error, or a malformed response closes the connection: every later
/// call fails with [`Error::Disconnected`]. Connect again to recover.
#[derive(Clone)]
pub struct Session {
    inner: Arc<Inner>,
}

struct Inner {
    // Declared first so it drops first: the queue pair goes before the PD.
    queue: Mutex<Queue>,
    /// Open volumes of this session and how many handles use each. Held
    /// across OPEN and CLOSE so they cannot interleave for one volume.
    open: Mutex<HashMap<VolumeId, usize>>,
    domain: Arc<Domain>,
    url: FabricUrl,
    host_id: String,
    target_name: String,
    limits: NegotiatedLimits,
    stats: Arc<Stats>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while a request ran closed the connection (see Conn::pipeline),
    // so the state behind a poisoned lock is consistent.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Session {
    /// Connects to the target at `url` (`tcp://host:port`; `rdma://` once a
    /// verbs provider exists): opens the fabric, posts the response buffers,
    /// connects the queue pair and negotiates with CONNECT. The whole
    /// sequence must finish within `options.connect_timeout`.
    ///
    /// Fails with [`Error::VersionMismatch`] if the target speaks another
    /// protocol version, [`Error::Target`] if it refuses (e.g. access denied),
    /// [`Error::Fabric`] if the connection cannot be made and
    /// [`Error::Timeout`] if it takes too long.
    pub fn connect(url: impl IntoTargetUrl, options: ConnectOptions) -> Result<Session> {
        let url = url.into_target_url()?;
        options.validate()?;
        let started = Instant::now();
        let deadline = started + options.connect_timeout;
        let remaining = || deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1));
        let ctx = |what: &str| format!("{what} for {url}");

        let fabric = Fabric::open(&url).map_err(|e| Error::fabric(ctx("opening the fabric"), e))?;
        let pd = fabric.alloc_pd().map_err(|e| Error::fabric(ctx("allocating a protection domain"), e))?;
        let depth = options.queue_depth;
        let recv_count = depth as usize + RECV_MARGIN;
        let cq = fabric
            .create_cq(depth + recv_count as u32 + 16)
            .map_err(|e| Error::fabric(ctx("creating a completion queue"), e))?;
        let caps = QpCaps {
            max_send_wr: depth + 1,
            max_recv_wr: recv_count as u32,
            max_send_sge: 1,
            max_recv_sge: 1,
            ..QpCaps::default()
        };
        let qp = fabric.create_qp(&pd, &cq, caps).map_err(|e| Error::fabric(ctx("creating a queue pair"), e))?;
        let domain = Arc::new(Domain { pd, _fabric: fabric });
        let stats = Arc::new(Stats::default());

        let recv = Region::new(domain.pd(), recv_count * RESPONSE_SLOT_SIZE, Access::LOCAL_WRITE)
            .map_err(|e| Error::fabric(ctx("registering receive buffers"), e))?;
        let connect_slot = (COMMAND_CAPSULE_SIZE + MAX_HOST_ID_LEN).next_multiple_of(64);
        let send = Region::new(domain.pd(), connect_slot, Access::LOCAL_WRITE)
            .map_err(|e| Error::fabric(ctx("registering send buffers"), e))?;
        let send = SendSlots { region: send, count: 1, size: connect_slot };
        let mut conn = Conn::new(Arc::clone(&domain), qp, cq, recv, send, Arc::clone(&stats))?;

        conn.qp().connect(&[], remaining()).map_err(|e| {
            if e.kind == FabricErrorKind::Timeout {
                Error::Timeout { what: format!("connecting to {url}"), after: options.connect_timeout }
            } else {
                Error::fabric(format!("connecting to {url}"), e)
            }
        })?;

        let mut c = CommandCapsule::new(Opcode::Connect, CommandId(0));
        c.version = PROTOCOL_VERSION;
        c.queue_depth = depth;
        c.max_io_size = options.max_io_size;
        c.inline_len = options.host_id.len() as u32;
        let resp = conn.execute(&c, options.host_id.as_bytes(), remaining())?;
        match resp.capsule.status {
            Status::Success => {}
            Status::VersionMismatch => return Err(Error::version_mismatch(resp.capsule.detail)),
            _ => return Err(status_error(Opcode::Connect, &resp.capsule, None, None, None)),
        }
        let reply = ConnectReply::decode(resp.data())
            .map_err(|e| Error::protocol(format!("the target's CONNECT reply is invalid: {e}")))?;
        if reply.version != PROTOCOL_VERSION {
            return Err(Error::version_mismatch(u32::from(reply.version)));
        }
        if reply.queue_depth > depth {
            tracing::warn!(
                granted = reply.queue_depth,
                requested = depth,
                "target granted a deeper queue than requested"
            );
        }
        let limits = NegotiatedLimits {
            queue_depth: reply.queue_depth.min(depth),
            max_io_size: reply.max_io_size.min(options.max_io_size),
            inline_data_size: reply.inline_data_size,
        };
        tracing::debug!(?limits, target = %reply.target_name, "connected");

        let slots = limits.queue_depth as usize;
        let inline_use = (limits.inline_data_size as usize).min(INLINE_CAP);
        let slot_size = (COMMAND_CAPSULE_SIZE + inline_use.max(MAX_HOST_ID_LEN)).next_multiple_of(64);
        let send = Region::new(domain.pd(), slots * slot_size, Access::LOCAL_WRITE)
            .map_err(|e| Error::fabric(ctx("registering send buffers"), e))?;
        conn.replace_send_slots(SendSlots { region: send, count: slots, size: slot_size })?;

        let chunk = limits.max_io_size as usize;
        let chunks = (options.bounce_pool_size / chunk).clamp(1, slots);
        let all = Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ;
        let bounce = Region::new(domain.pd(), chunk * chunks, all)
            .map_err(|e| Error::fabric(ctx("registering the bounce pool"), e))?;
        let queue =
            Queue::new(conn, bounce, chunk, limits.max_io_size, inline_use, options.io_timeout, Arc::clone(&stats));

        Ok(Session {
            inner: Arc::new(Inner {
                queue: Mutex::new(queue),
                open: Mutex::new(HashMap::new()),
                domain,
                url,
                host_id: options.host_id,
                target_name: reply.target_name,
                limits,
                stats,
            }),
        })
    }

    /// The target's name from the CONNECT reply.
    pub fn target_name(&self) -> &str {
        &self.inner.target_name
    }

    /// The URL this session connected to.
    pub fn url(&self) -> &FabricUrl {
        &self.inner.url
    }

    /// The host id sent at CONNECT.
    pub fn host_id(&self) -> &str {
        &self.inner.host_id
    }

    /// What CONNECT negotiated.
    pub fn limits(&self) -> NegotiatedLimits {
        self.inner.limits
    }

    /// Negotiated queue depth (commands outstanding at once).
    pub fn queue_depth(&self) -> u32 {
        self.inner.limits.queue_depth
    }

    /// Negotiated max I/O size: the largest transfer of one command.
    pub fn max_io_size(&self) -> u32 {
        self.inner.limits.max_io_size
    }

    /// Negotiated inline data size: the largest write sent inside a command.
    pub fn inline_data_size(&self) -> u32 {
        self.inner.limits.inline_data_size
    }

    /// A snapshot of the counters.
    pub fn stats(&self) -> SessionStats {
        let s = &self.inner.stats;
        let get = |c: &std::sync::atomic::AtomicU64| c.load(Ordering::Relaxed);
        SessionStats {
            commands: get(&s.commands),
            bounce_copies: get(&s.bounce_copies),
            bounce_bytes: get(&s.bounce_bytes),
            inline_writes: get(&s.inline_writes),
            inline_bytes: get(&s.inline_bytes),
            zero_copy_bytes: get(&s.zero_copy_bytes),
        }
    }

    /// Whether the connection is still up (as far as this side knows).
    pub fn is_connected(&self) -> bool {
        !lock(&self.inner.queue).conn.is_broken()
    }

    /// Closes the connection now. Every later call on this session, its
    /// volumes and buffers fails with [`Error::Disconnected`].
    pub fn close(&self) {
        lock(&self.inner.queue).conn.fail("closed by this initiator");
    }

    /// Every volume the target exports to this host.
    pub fn list_volumes(&self) -> Result<Vec<VolumeInfo>> {
        lock(&self.inner.queue).list_volumes()
    }

    /// Proves the target is alive (KEEP_ALIVE).
    pub fn keep_alive(&self) -> Result<()> {
        let mut q = lock(&self.inner.queue);
        let resp = q.simple(&CommandCapsule::new(Opcode::KeepAlive, CommandId(0)), &[])?;
        match resp.capsule.status {
            Status::Success => Ok(()),
            _ => Err(status_error(Opcode::KeepAlive, &resp.capsule, None, None, None)),
        }
    }

    /// Opens the volume `name`. Fails with [`Error::UnknownVolume`] if the
    /// target has no such volume. Opening the same volume twice in one
    /// session gives two handles; the volume is closed when the last goes.
    pub fn open(&self, name: &str) -> Result<Volume> {
        validate_name(name).map_err(|_| {
            Error::invalid(format!("volume name {name:?} is invalid: 1 to 64 bytes of UTF-8 without NUL"))
        })?;
        let mut open = lock(&self.inner.open);
        let mut c = CommandCapsule::new(Opcode::OpenVolume, CommandId(0));
        c.inline_len = name.len() as u32;
        let resp = lock(&self.inner.queue).simple(&c, name.as_bytes())?;
        match resp.capsule.status {
            Status::Success => {}
            Status::UnknownVolume => return Err(Error::UnknownVolume { name: name.to_owned() }),
            _ => return Err(status_error(Opcode::OpenVolume, &resp.capsule, Some(name), None, None)),
        }
        let info = VolumeInfo::decode(resp.data())
            .map_err(|e| Error::protocol(format!("the target's OPEN reply for {name:?} is invalid: {e}")))?;
        *open.entry(info.volume_id).or_insert(0) += 1;
        Ok(Volume { session: self.clone(), info, closed: false })
    }

    /// Allocates a zero-filled buffer of `len` bytes, registered once for
    /// zero-copy I/O with this session's volumes.
    pub fn alloc_buffer(&self, len: usize) -> Result<IoBuffer> {
        if len == 0 {
            return Err(Error::invalid("cannot allocate a zero-length I/O buffer"));
        }
        IoBuffer::new(Arc::clone(&self.inner.domain), len)
            .map_err(|e| Error::fabric(format!("registering a {len}-byte I/O buffer"), e))
    }

    /// Sends a command exactly as given except for the command id (filled in
    /// with a free slot), waits for its response and returns it raw, whatever
    /// its status. For system tests that must send deliberately bad
    /// commands. `buffer` is only borrowed for the duration of the command,
    /// so a descriptor naming it (see [`IoBuffer::descriptor`]) stays valid.
    #[doc(hidden)]
    pub fn raw_command(
        &self,
        capsule: CommandCapsule,
        inline: &[u8],
        buffer: Option<&mut IoBuffer>,
    ) -> Result<(ResponseCapsule, Vec<u8>)> {
        self.raw_command_bytes(capsule.to_bytes(), inline, buffer)
    }

    /// [`raw_command`](Session::raw_command) for a capsule given as bytes
    /// (unknown opcodes, non-zero reserved bytes...). Bytes 2..4 are
    /// replaced by the command id.
    #[doc(hidden)]
    pub fn raw_command_bytes(
        &self,
        capsule: [u8; COMMAND_CAPSULE_SIZE],
        inline: &[u8],
        buffer: Option<&mut IoBuffer>,
    ) -> Result<(ResponseCapsule, Vec<u8>)> {
        let _borrowed_for_the_call = buffer;
        let mut q = lock(&self.inner.queue);
        let timeout = q.io_timeout();
        let op = Opcode::from_wire(capsule[0]).unwrap_or(Opcode::KeepAlive);
        let cid = q.conn.acquire()?;
        q.conn.submit_raw(cid, &capsule, inline, op, timeout)?;
        let resp = q.conn.wait_for(cid)?;
        Ok((resp.capsule, resp.data().to_vec()))
    }

    fn same_domain(&self, buf: &IoBuffer) -> Result<()> {
        if Arc::ptr_eq(buf.domain(), &self.inner.domain) {
            Ok(())
        } else {
            Err(Error::invalid("the I/O buffer was allocated by another session; its keys are not valid here"))
        }
    }
}

impl fmt::Debug for Session {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Session")
            .field("url", &self.inner.url.to_string())
            .field("target_name", &self.inner.target_name)
            .field("limits", &self.inner.limits)
            .finish()
    }
}

/// An opened remote volume. Implements [`BlockDevice`]; see there for the
/// alignment, ordering and durability rules.
///
/// Plain-slice I/O ([`BlockDevice::read_at`], [`BlockDevice::write_at`])
/// stages data through the session's registered bounce pool, or sends small
/// writes (up to the negotiated inline size) inline. [`Volume::read_into`]
/// and [`Volume::write_from`] move data straight between the target and an
/// [`IoBuffer`] without any copy. Requests larger than the negotiated max
/// I/O size are split and the pieces pipelined up to the queue depth.
///
/// Write-type requests on a read-only volume fail with [`Error::ReadOnly`]
/// without being sent. DISCARD on a volume that does not offer it does
/// nothing (allowed: contents after a discard are unspecified).
/// WRITE_ZEROES on a volume that does not offer it is carried out by writing
/// zeroes. Flush on a read-only volume does nothing.
pub struct Volume {
    session: Session,
    info: VolumeInfo,
    closed: bool,
}

impl Volume {
    /// What the target reported at OPEN.
    pub fn info(&self) -> &VolumeInfo {
        &self.info
    }

    /// The volume's name.
    pub fn name(&self) -> &str {
        &self.info.name
    }

    /// The session-local id the target assigned.
    pub fn id(&self) -> VolumeId {
        self.info.volume_id
    }

    /// Whether the target offers DISCARD on this volume.
    pub fn supports_discard(&self) -> bool {
        self.info.flags & VOLUME_FLAG_DISCARD != 0
    }

    /// Whether the target offers WRITE_ZEROES on this volume.
    pub fn supports_write_zeroes(&self) -> bool {
        self.info.flags & VOLUME_FLAG_WRITE_ZEROES != 0
    }

    /// The session this volume was opened through.
    pub fn session(&self) -> &Session {
        &self.session
    }

    fn ctx(&self) -> VolCtx<'_> {
        VolCtx {
            id: self.info.volume_id,
            name: &self.info.name,
            block_size: self.info.block_size,
            supports_write_zeroes: self.supports_write_zeroes(),
        }
    }

    fn check(&self, op: Opcode, offset: u64, len: u64) -> Result<()> {
        check_request(op, offset, len, self.info.block_size, self.info.size_bytes)?;
        if op != Opcode::Read && self.info.read_only() {
            return Err(Error::ReadOnly { op, volume: self.info.name.clone() });
        }
        Ok(())
    }

    fn check_buffer(&self, op: Opcode, buf: &IoBuffer, buf_offset: usize, len: usize) -> Result<()> {
        self.session.same_domain(buf)?;
        match buf_offset.checked_add(len) {
            Some(end) if end <= buf.len() => Ok(()),
            _ => Err(Error::invalid(format!(
                "{} of {len} bytes at buffer offset {buf_offset} overruns the {}-byte I/O buffer",
                crate::error::op_name(op),
                buf.len()
            ))),
        }
    }

    /// Reads `len` bytes at volume `offset` into `buf[buf_offset..][..len]`,
    /// zero-copy: the target writes the data straight into the buffer.
    pub fn read_into(&self, buf: &mut IoBuffer, buf_offset: usize, len: usize, offset: u64) -> Result<()> {
        self.check_buffer(Opcode::Read, buf, buf_offset, len)?;
        self.check(Opcode::Read, offset, len as u64)?;
        let data = Data::Registered { addr: buf.region().addr() + buf_offset as u64, rkey: buf.region().rkey() };
        let mut q = lock(&self.session.inner.queue);
        q.transfer(self.ctx(), Opcode::Read, data, len as u64, offset, WriteFlags::NONE)
    }

    /// Writes `buf[buf_offset..][..len]` at volume `offset`, zero-copy: the
    /// target reads the data straight from the buffer.
    pub fn write_from(&self, buf: &IoBuffer, buf_offset: usize, len: usize, offset: u64) -> Result<()> {
        self.write_from_with(buf, buf_offset, len, offset, WriteFlags::NONE)
    }

    /// [`write_from`](Volume::write_from) with flags (FUA).
    pub fn write_from_with(
        &self,
        buf: &IoBuffer,
        buf_offset: usize,
        len: usize,
        offset: u64,
        flags: WriteFlags,
    ) -> Result<()> {
        self.check_buffer(Opcode::Write, buf, buf_offset, len)?;
        self.check(Opcode::Write, offset, len as u64)?;
        let data = Data::Registered { addr: buf.region().addr() + buf_offset as u64, rkey: buf.region().rkey() };
        let mut q = lock(&self.session.inner.queue);
        q.transfer(self.ctx(), Opcode::Write, data, len as u64, offset, flags)
    }

    /// Closes the volume now (if this is its last handle in the session) and
    /// reports the target's answer.
    pub fn close(mut self) -> Result<()> {
        self.closed = true;
        self.release()
    }

    fn release(&self) -> Result<()> {
        let inner = &self.session.inner;
        let mut open = lock(&inner.open);
        let id = self.info.volume_id;
        match open.get_mut(&id) {
            Some(n) if *n > 1 => {
                *n -= 1;
                return Ok(());
            }
            _ => {
                open.remove(&id);
            }
        }
        let mut q = lock(&inner.queue);
        if q.conn.is_broken() {
            return Ok(()); // the target closed everything with the connection
        }
        let mut c = CommandCapsule::new(Opcode::CloseVolume, CommandId(0));
        c.volume_id = id;
        let resp = q.simple(&c, &[])?;
        match resp.capsule.status {
            Status::Success => Ok(()),
            _ => Err(status_error(Opcode::CloseVolume, &resp.capsule, Some(&self.info.name), None, None)),
        }
    }
}

impl Drop for Volume {
    fn drop(&mut self) {
        if !self.closed {
            if let Err(e) = self.release() {
                tracing::debug!(volume = %self.info.name, error = %e, "closing volume on drop failed");
            }
        }
    }
}

impl fmt::Debug for Volume {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Volume").field("info", &self.info).finish()
    }
}

impl BlockDevice for Volume {
    fn block_size(&self) -> u32 {
        self.info.block_size
    }

    fn size(&self) -> u64 {
        self.info.size_bytes
    }

    fn read_only(&self) -> bool {
        self.info.read_only()
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        let len = buf.len() as u64;
        self.check(Opcode::Read, offset, len)?;
        let mut q = lock(&self.session.inner.queue);
        q.transfer(self.ctx(), Opcode::Read, Data::ReadSlice(buf), len, offset, WriteFlags::NONE)
    }

    fn write_at_with(&self, buf: &[u8], offset: u64, flags: WriteFlags) -> Result<()> {
        let len = buf.len() as u64;
        self.check(Opcode::Write, offset, len)?;
        let mut q = lock(&self.session.inner.queue);
        q.transfer(self.ctx(), Opcode::Write, Data::WriteSlice(buf), len, offset, flags)
    }

    fn flush(&self) -> Result<()> {
        if self.info.read_only() {
            return Ok(());
        }
        let mut c = CommandCapsule::new(Opcode::Flush, CommandId(0));
        c.volume_id = self.info.volume_id;
        let resp = lock(&self.session.inner.queue).simple(&c, &[])?;
        match resp.capsule.status {
            Status::Success => Ok(()),
            _ => Err(status_error(Opcode::Flush, &resp.capsule, Some(&self.info.name), None, None)),
        }
    }

    fn discard(&self, offset: u64, len: u64) -> Result<()> {
        self.check(Opcode::Discard, offset, len)?;
        if !self.supports_discard() {
            return Ok(());
        }
        lock(&self.session.inner.queue).zeroes(self.ctx(), Opcode::Discard, offset, len)
    }

    fn write_zeroes(&self, offset: u64, len: u64) -> Result<()> {
        self.check(Opcode::WriteZeroes, offset, len)?;
        lock(&self.session.inner.queue).zeroes(self.ctx(), Opcode::WriteZeroes, offset, len)
    }
}

#[allow(dead_code)]
fn assert_send_sync() {
    fn is<T: Send + Sync>() {}
    is::<Session>();
    is::<Volume>();
    is::<IoBuffer>();
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
        assert!(!ok.host_id.is_empty());
        let bad = ConnectOptions { host_id: "x".repeat(224), ..ConnectOptions::default() };
        assert!(bad.validate().unwrap_err().to_string().contains("224 bytes"));
        let bad = ConnectOptions { queue_depth: 0, ..ConnectOptions::default() };
        assert!(bad.validate().is_err());
        let bad = ConnectOptions { queue_depth: 70000, ..ConnectOptions::default() };
        assert!(bad.validate().is_err());
        let bad = ConnectOptions { io_timeout: Duration::ZERO, ..ConnectOptions::default() };
        assert!(bad.validate().is_err());
    }

    #[test]
    fn url_conversion_reports_bad_urls() {
        let e = Session::connect("udp://x:1", ConnectOptions::default()).unwrap_err();
        assert_eq!(e.kind(), crate::ErrorKind::Fabric);
        assert!(e.to_string().contains("parsing the target URL"), "{e}");
        assert_eq!("tcp://127.0.0.1:7420".into_target_url().unwrap().port, 7420);
    }

    #[test]
    fn rdma_scheme_is_reported_unavailable() {
        let e = Session::connect("rdma://127.0.0.1:4420", ConnectOptions::default()).unwrap_err();
        assert_eq!(e.kind(), crate::ErrorKind::Fabric);
        assert!(e.one_line().contains("no verbs provider"), "{}", e.one_line());
    }
}
