//! Sessions (a set of queue pairs to one target) and the volumes opened
//! through them.

use std::collections::hash_map::Entry;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use rdmablk_common::fabric::FabricUrl;
use rdmablk_common::protocol::{
    validate_name, CommandCapsule, CommandId, Opcode, ResponseCapsule, SessionId, Status, VolumeId, VolumeInfo,
    COMMAND_CAPSULE_SIZE, VOLUME_FLAG_DISCARD, VOLUME_FLAG_WRITE_ZEROES,
};

use crate::buffer::IoBuffer;
use crate::conn::{piece_status, status_error, Outcome, PieceError};
use crate::connection_set::{lock, Phase, Shared, VolumeEntry, VolumeSlot};
use crate::device::{check_request, BlockDevice, WriteFlags};
use crate::error::{Error, Result};
use crate::options::{ConnectOptions, NegotiatedLimits};
use crate::queue::{Data, Queue, VolCtx};
use crate::targets::{IntoTargets, Targets};

/// Counters of a session, for tests and monitoring.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct SessionStats {
    /// Commands sent, of every kind (keep-alives included).
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
    /// KEEP_ALIVE commands sent.
    pub keep_alives: u64,
    /// Successful reconnections.
    pub reconnects: u64,
    /// Request attempts re-issued after a broken connection.
    pub retries: u64,
    /// Commands that missed their deadline.
    pub timeouts: u64,
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

/// A session with a target: several queue pairs (I/O queues) sharing the
/// volumes opened through them, the negotiated limits, and the registered
/// memory of its buffers.
///
/// Cheap to clone (a handle); the connections close when the last handle,
/// [`Volume`] and [`IoQueue`](crate::IoQueue) of it is gone, or at [`Session::close`].
///
/// # Concurrency
/// `Session`, [`Volume`] and [`IoBuffer`] are `Send + Sync`. Each thread
/// that uses the session is given one of its queue pairs, round-robin, and
/// keeps it; each queue pair has its own lock, so threads on different
/// queue pairs share no lock on the I/O path. Threads beyond the number of
/// queues share queues (a request holds its queue's lock while it runs).
/// Each request pipelines its own pieces up to the queue depth.
///
/// # Failures
/// Like an NVMe-oF host: a keep-alive finds a dead or hung target within
/// [`ConnectOptions::keepalive_timeout`]. When a connection breaks (or a
/// command misses [`ConnectOptions::io_timeout`], which fails that command
/// with [`Error::Timeout`]), the session reconnects in the background,
/// re-opens its volumes by name and re-issues the pieces of reads and
/// writes that had not completed (they are idempotent at block level).
/// Requests wait meanwhile. Only when [`ConnectOptions::ctrl_loss_timeout`]
/// has passed without a connection do queued and future requests fail, with
/// [`Error::TargetLost`]. No call waits forever.
///
/// # Several gateways
/// A volume exported by several gateways (rdmablk-target processes sharing
/// one RBD image, one of which owns it at a time) is reached through the
/// list of their URLs, `"tcp://10.0.0.1:7420,tcp://10.0.0.2:7420"` (see
/// [`Targets`]). The session connects to the first gateway that answers,
/// in list order. When it loses its gateway (the connection breaks, a
/// keep-alive or [`ConnectOptions::io_timeout`] is missed, or a command is
/// answered `NotOwner`: that gateway lost the volume to another) it
/// reconnects to the next gateway in the list, then the ones after it, and
/// the lost one last, each round within `connect_timeout` per gateway and
/// the backoff between rounds, until `ctrl_loss_timeout`, as above. A
/// command answered `NotOwner` does not fail: it is re-issued on the new
/// gateway like the rest. The new gateway gets a fresh session (the fence
/// below names only a session this initiator had at that same gateway), and
/// the volumes are re-opened there by name; one it serves with another size
/// or block size ends the session with [`Error::VolumeChanged`]. When
/// `ctrl_loss_timeout` passes, [`Error::TargetLost`] names each gateway
/// and its last failure. Each failover logs one warning naming both
/// gateways and the cause. With a single URL `NotOwner` fails the command,
/// as any other status.
///
/// # Ordering across reconnections
/// - An acknowledged write is never overwritten by an older one: the new
///   session names the one it replaces, and the target answers its CONNECT
///   only after it retired that session (stopped its queue pairs, dropped
///   what had not reached the disk, waited for every disk I/O it had
///   submitted). Nothing is re-issued before that answer.
/// - A write that failed with [`Error::TargetLost`] (or `Disconnected`, or
///   `Timeout`) may or may not have landed, wholly or in part.
/// - Overlapping requests in flight at the same time are not ordered.
#[derive(Clone)]
pub struct Session {
    pub(crate) shared: Arc<Shared>,
}

impl Session {
    /// Connects to the target at `url` (`tcp://host:port`; `rdma://` once a
    /// verbs provider exists): opens the fabric, connects the first queue
    /// pair (a new session) and joins the other queue pairs to it. The whole
    /// sequence must finish within `options.connect_timeout`. The first
    /// connection is not retried: its failure is returned.
    ///
    /// Fails with [`Error::VersionMismatch`] if the target speaks another
    /// protocol version, [`Error::Target`] if it refuses (e.g. access denied),
    /// [`Error::Fabric`] if the connection cannot be made and
    /// [`Error::Timeout`] if it takes too long.
    ///
    /// `url` may list several gateways of the same volumes
    /// (`"tcp://a:7420,tcp://b:7420"`, see [`Targets`]): the session
    /// connects to the first that answers, each within `connect_timeout`,
    /// and fails with [`Error::NoGateway`], naming each and its error, if
    /// none does.
    pub fn connect(url: impl IntoTargets, options: ConnectOptions) -> Result<Session> {
        let targets = url.into_targets()?;
        options.validate()?;
        Ok(Session { shared: Shared::connect(targets, options, SessionId(0), 0)? })
    }

    /// Like [`Session::connect`], for a process that takes over the work of
    /// an earlier one (a restarted `rdmablk attach`): the new session names
    /// `replaced`, a session of the same host id, and the target retires it
    /// (drops what had not reached the disk, waits for what had) before it
    /// answers, as at a reconnection (docs/PROTOCOL.md, "The reconnect
    /// fence"). An id the target no longer knows is nothing to wait for.
    ///
    /// With several gateways `replaced` is taken for a session at the first
    /// one (a session id means something only to its gateway); see
    /// [`Session::connect_replacing_at`].
    pub fn connect_replacing(url: impl IntoTargets, options: ConnectOptions, replaced: SessionId) -> Result<Session> {
        let targets = url.into_targets()?;
        options.validate()?;
        Ok(Session { shared: Shared::connect(targets, options, replaced, 0)? })
    }

    /// [`Session::connect_replacing`] where `replaced` is a session at
    /// `gateway`, one of `url`'s gateways (as [`Session::watch_session`]
    /// reported it): it is named only if the session connects there, as
    /// another gateway knows nothing of it.
    pub fn connect_replacing_at(
        url: impl IntoTargets,
        options: ConnectOptions,
        replaced: SessionId,
        gateway: &FabricUrl,
    ) -> Result<Session> {
        let targets = url.into_targets()?;
        options.validate()?;
        let at = targets.position(gateway).ok_or_else(|| {
            Error::invalid(format!("the replaced session's gateway {gateway} is not one of the gateways {targets}"))
        })?;
        Ok(Session { shared: Shared::connect(targets, options, replaced, at)? })
    }

    /// Calls `watch` with the id of every session a reconnection creates,
    /// before anything is re-issued on it: a process that records its
    /// session id (for a successor's [`Session::connect_replacing`]) keeps
    /// the record current with it. Replaces an earlier watch.
    pub fn watch_session_id(&self, watch: impl Fn(SessionId) + Send + 'static) {
        self.watch_session(move |id, _| watch(id));
    }

    /// [`Session::watch_session_id`] with the gateway of each new session
    /// (for [`Session::connect_replacing_at`]).
    pub fn watch_session(&self, watch: impl Fn(SessionId, &FabricUrl) + Send + 'static) {
        *crate::connection_set::lock(&self.shared.session_watch) = Some(Box::new(watch));
    }

    /// The target's name from the CONNECT reply (of the current gateway's
    /// first).
    pub fn target_name(&self) -> &str {
        self.shared.target_name()
    }

    /// The URL of the gateway serving the session now: the one it connected
    /// to, or failed over to (with a single URL, that URL).
    pub fn url(&self) -> &FabricUrl {
        self.shared.current_url()
    }

    /// Every gateway the session may use, as given.
    pub fn targets(&self) -> &Targets {
        &self.shared.targets
    }

    /// The host id sent at CONNECT.
    pub fn host_id(&self) -> &str {
        &self.shared.options.host_id
    }

    /// The options the session was opened with.
    pub fn options(&self) -> &ConnectOptions {
        &self.shared.options
    }

    /// What CONNECT negotiated (on the current connection).
    pub fn limits(&self) -> NegotiatedLimits {
        self.shared.limits()
    }

    /// Negotiated queue depth (commands outstanding at once per queue pair).
    pub fn queue_depth(&self) -> u32 {
        self.limits().queue_depth
    }

    /// Negotiated max I/O size: the largest transfer of one command.
    pub fn max_io_size(&self) -> u32 {
        self.limits().max_io_size
    }

    /// Negotiated inline data size: the largest write sent inside a command.
    pub fn inline_data_size(&self) -> u32 {
        self.limits().inline_data_size
    }

    /// Queue pairs connected now: [`ConnectOptions::queues`], or fewer if
    /// the target refused to join more to the session.
    pub fn queue_count(&self) -> usize {
        self.shared.active_queues()
    }

    /// The target's id of the current session (it changes when the session
    /// reconnects).
    pub fn session_id(&self) -> SessionId {
        self.shared.session_id()
    }

    /// A snapshot of the counters.
    pub fn stats(&self) -> SessionStats {
        let mut sum = [0u64; 10];
        self.shared.stats.sum_into(&mut sum);
        for q in self.shared.queues.iter() {
            q.stats.sum_into(&mut sum);
        }
        let [commands, bounce_copies, bounce_bytes, inline_writes, inline_bytes, zero_copy_bytes, keep_alives, reconnects, retries, timeouts] =
            sum;
        SessionStats {
            commands,
            bounce_copies,
            bounce_bytes,
            inline_writes,
            inline_bytes,
            zero_copy_bytes,
            keep_alives,
            reconnects,
            retries,
            timeouts,
        }
    }

    /// Whether the session is connected now (not reconnecting, lost or closed).
    pub fn is_connected(&self) -> bool {
        self.shared.phase() == Phase::Connected
    }

    /// Whether the session has given up ([`Error::TargetLost`]) or was
    /// closed: every request fails from now on.
    pub fn is_lost(&self) -> bool {
        matches!(self.shared.phase(), Phase::Lost | Phase::Closed)
    }

    /// Waits until the session is connected (`Ok(true)`), `timeout` passes
    /// (`Ok(false)`), or it is lost or closed (the error requests get).
    pub fn wait_connected(&self, timeout: Duration) -> Result<bool> {
        self.shared.wait_ready(Some(std::time::Instant::now() + timeout))
    }

    /// Closes the connections now. Every later call on this session, its
    /// volumes and queues fails with [`Error::Disconnected`].
    pub fn close(&self) {
        self.shared.close("closed by this initiator");
    }

    /// Every volume the target exports to this host.
    pub fn list_volumes(&self) -> Result<Vec<VolumeInfo>> {
        self.shared.run(Queue::list_volumes)
    }

    /// Proves the target is alive (one KEEP_ALIVE on this thread's queue;
    /// the session also sends them by itself).
    pub fn keep_alive(&self) -> Result<()> {
        let resp = self.shared.run(|q| q.simple(&CommandCapsule::new(Opcode::KeepAlive, CommandId(0)), &[]))?;
        match resp.capsule.status {
            Status::Success => Ok(()),
            _ => Err(status_error(Opcode::KeepAlive, &resp.capsule, None, None, None)),
        }
    }

    /// Opens the volume `name`. Fails with [`Error::UnknownVolume`] if the
    /// target has no such volume. Opening the same volume twice in one
    /// session gives two handles; the volume is closed when the last goes.
    /// The volume stays open across reconnections (re-opened by name).
    pub fn open(&self, name: &str) -> Result<Volume> {
        validate_name(name).map_err(|_| {
            Error::invalid(format!("volume name {name:?} is invalid: 1 to 64 bytes of UTF-8 without NUL"))
        })?;
        loop {
            let (info, gen) = self.shared.run(|q| {
                let gen = q.conn.as_ref().map_or(0, |c| c.gen);
                q.open_volume(name).map(|info| (info, gen))
            })?;
            let mut vols = lock(&self.shared.volumes);
            // A reconnection after the OPEN re-opened only the volumes it
            // knew of: open again in the new connection set.
            if self.shared.generation() != gen {
                continue;
            }
            let entry = match vols.entry(name.to_owned()) {
                Entry::Occupied(mut o) => {
                    let slot = o.get_mut();
                    slot.handles += 1;
                    Arc::clone(&slot.entry)
                }
                Entry::Vacant(v) => {
                    let entry = Arc::new(VolumeEntry::new(info, gen));
                    v.insert(VolumeSlot { entry: Arc::clone(&entry), handles: 1 });
                    entry
                }
            };
            return Ok(Volume { session: self.clone(), entry, closed: false });
        }
    }

    /// Allocates a zero-filled buffer of `len` bytes, registered once for
    /// zero-copy I/O with this session's volumes. It stays valid across
    /// reconnections.
    pub fn alloc_buffer(&self, len: usize) -> Result<IoBuffer> {
        if len == 0 {
            return Err(Error::invalid("cannot allocate a zero-length I/O buffer"));
        }
        IoBuffer::new(Arc::clone(&self.shared.domain), len)
            .map_err(|e| Error::fabric(format!("registering a {len}-byte I/O buffer"), e))
    }

    /// Sends a command exactly as given except for the command id (filled in
    /// with a free slot), waits for its response and returns it raw, whatever
    /// its status. For system tests that must send deliberately bad
    /// commands. `buffer` is only borrowed for the duration of the command,
    /// so a descriptor naming it (see [`IoBuffer::descriptor`]) stays valid.
    /// Not retried after a connection failure.
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
        if let Some(e) = self.shared.final_error() {
            return Err(e);
        }
        let slot = &self.shared.queues[self.shared.home_queue()];
        let mut q = lock(&slot.q);
        let Some(conn) = q.conn.as_mut() else {
            return Err(Error::Disconnected { reason: "the session is reconnecting".into() });
        };
        let gen = conn.gen;
        let op = Opcode::from_wire(capsule[0]).unwrap_or(Opcode::KeepAlive);
        let result = (|| {
            conn.check_usable()?;
            let cid = conn.acquire()?;
            conn.submit_raw(cid, &capsule, inline, op, conn.params.io_timeout, std::time::Instant::now())?;
            conn.wait_for(cid)
        })();
        let broken = conn.broken_reason().map(str::to_owned);
        drop(q);
        if let Some(reason) = broken {
            self.shared.report_failure(gen, &reason);
        }
        let resp = result?;
        Ok((resp.capsule, resp.data().to_vec()))
    }

    pub(crate) fn same_domain(&self, buf: &IoBuffer) -> Result<()> {
        if Arc::ptr_eq(buf.domain(), &self.shared.domain) {
            Ok(())
        } else {
            Err(Error::invalid("the I/O buffer was allocated by another session; its keys are not valid here"))
        }
    }
}

impl fmt::Debug for Session {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Session")
            .field("url", &self.url().to_string())
            .field("target_name", &self.target_name())
            .field("limits", &self.limits())
            .field("queues", &self.queue_count())
            .finish()
    }
}

/// An opened remote volume. Implements [`BlockDevice`]; see there for the
/// alignment, ordering and durability rules.
///
/// Plain-slice I/O ([`BlockDevice::read_at`], [`BlockDevice::write_at`])
/// stages data through the calling queue's registered bounce pool, or sends
/// small writes (up to the negotiated inline size) inline.
/// [`Volume::read_into`] and [`Volume::write_from`] move data straight
/// between the target and an [`IoBuffer`] without any copy. Requests larger
/// than the negotiated max I/O size are split and the pieces pipelined up
/// to the queue depth; after a reconnection only the pieces that had not
/// completed are re-issued.
///
/// Write-type requests on a read-only volume fail with [`Error::ReadOnly`]
/// without being sent. DISCARD on a volume that does not offer it does
/// nothing (allowed: contents after a discard are unspecified).
/// WRITE_ZEROES on a volume that does not offer it is carried out by writing
/// zeroes. Flush on a read-only volume does nothing.
///
/// A `Volume` is `Send + Sync`: share it between threads with `Arc` or
/// scoped threads; each thread's requests go through its own queue.
pub struct Volume {
    session: Session,
    pub(crate) entry: Arc<VolumeEntry>,
    closed: bool,
}

impl Volume {
    /// What the target reported at OPEN (the first time; after a
    /// reconnection [`Volume::id`] may differ from `info().volume_id`).
    pub fn info(&self) -> &VolumeInfo {
        &self.entry.info
    }

    /// The volume's name.
    pub fn name(&self) -> &str {
        &self.entry.name
    }

    /// The id the target assigned in the current session.
    pub fn id(&self) -> VolumeId {
        self.entry.current_id()
    }

    /// Whether the target offers DISCARD on this volume.
    pub fn supports_discard(&self) -> bool {
        self.entry.info.flags & VOLUME_FLAG_DISCARD != 0
    }

    /// Whether the target offers WRITE_ZEROES on this volume.
    pub fn supports_write_zeroes(&self) -> bool {
        self.entry.info.flags & VOLUME_FLAG_WRITE_ZEROES != 0
    }

    /// The session this volume was opened through.
    pub fn session(&self) -> &Session {
        &self.session
    }

    /// Runs `f` with the volume's context for the queue's connection.
    fn attempt<T>(&self, q: &mut Queue, f: impl FnOnce(&mut Queue, VolCtx<'_>) -> Outcome<T>) -> Outcome<T> {
        let conn = q.conn.as_mut().expect("an attempt runs on a queue with a connection");
        let id = match self.entry.remote_id(conn.gen) {
            Ok(id) => id,
            Err(Some(e)) => return Outcome::Failed(e),
            Err(None) => {
                // Opened in another connection set than this one: replace it.
                conn.fail(format!("volume {:?} is not open on this connection", self.entry.name));
                return Outcome::Broken;
            }
        };
        let ctx = VolCtx {
            id,
            name: &self.entry.name,
            block_size: self.entry.info.block_size,
            supports_write_zeroes: self.supports_write_zeroes(),
        };
        f(q, ctx)
    }

    pub(crate) fn check(&self, op: Opcode, offset: u64, len: u64) -> Result<()> {
        let info = &self.entry.info;
        check_request(op, offset, len, info.block_size, info.size_bytes)?;
        if op != Opcode::Read && info.read_only() {
            return Err(Error::ReadOnly { op, volume: info.name.clone() });
        }
        Ok(())
    }

    pub(crate) fn check_buffer(&self, op: Opcode, buf: &IoBuffer, buf_offset: usize, len: usize) -> Result<()> {
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

    fn transfer(&self, op: Opcode, mut data: Data<'_>, len: u64, offset: u64, flags: WriteFlags) -> Result<()> {
        if len == 0 {
            return Ok(());
        }
        let mut ranges = vec![(0, len)];
        self.session
            .shared
            .run(|q| self.attempt(q, |q, vol| q.transfer(vol, op, &mut data, &mut ranges, offset, flags)))
    }

    /// Reads `len` bytes at volume `offset` into `buf[buf_offset..][..len]`,
    /// zero-copy: the target writes the data straight into the buffer.
    /// `offset` and `len` must be multiples of the block size; `buf_offset`
    /// may be anything.
    pub fn read_into(&self, buf: &mut IoBuffer, buf_offset: usize, len: usize, offset: u64) -> Result<()> {
        self.check_buffer(Opcode::Read, buf, buf_offset, len)?;
        self.check(Opcode::Read, offset, len as u64)?;
        let data = Data::Registered { addr: buf.region().addr() + buf_offset as u64, rkey: buf.region().rkey() };
        self.transfer(Opcode::Read, data, len as u64, offset, WriteFlags::NONE)
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
        self.transfer(Opcode::Write, data, len as u64, offset, flags)
    }

    /// Closes the volume now (if this is its last handle in the session) and
    /// reports the target's answer.
    pub fn close(mut self) -> Result<()> {
        self.closed = true;
        self.release()
    }

    fn release(&self) -> Result<()> {
        let shared = &self.session.shared;
        let mut vols = lock(&shared.volumes);
        match vols.get_mut(&self.entry.name) {
            Some(slot) if Arc::ptr_eq(&slot.entry, &self.entry) && slot.handles > 1 => {
                slot.handles -= 1;
                return Ok(());
            }
            Some(slot) if Arc::ptr_eq(&slot.entry, &self.entry) => {
                vols.remove(&self.entry.name);
            }
            _ => return Ok(()),
        }
        // Not retried: a new connection set does not have it open anyway.
        let resp = shared.run_once(|q| {
            self.attempt(q, |q, vol| {
                let mut c = CommandCapsule::new(Opcode::CloseVolume, CommandId(0));
                c.volume_id = vol.id;
                q.simple(&c, &[])
            })
        });
        drop(vols);
        match resp {
            Ok(Some(r)) if r.capsule.status == Status::Success => Ok(()),
            Ok(Some(r)) => Err(status_error(Opcode::CloseVolume, &r.capsule, Some(&self.entry.name), None, None)),
            Ok(None) => Ok(()),
            Err(e) => Err(e),
        }
    }
}

impl Drop for Volume {
    fn drop(&mut self) {
        if !self.closed {
            if let Err(e) = self.release() {
                tracing::debug!(volume = %self.entry.name, error = %e, "closing volume on drop failed");
            }
        }
    }
}

impl fmt::Debug for Volume {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Volume").field("info", &self.entry.info).field("id", &self.id()).finish()
    }
}

impl BlockDevice for Volume {
    fn block_size(&self) -> u32 {
        self.entry.info.block_size
    }

    fn size(&self) -> u64 {
        self.entry.info.size_bytes
    }

    fn read_only(&self) -> bool {
        self.entry.info.read_only()
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        let len = buf.len() as u64;
        self.check(Opcode::Read, offset, len)?;
        self.transfer(Opcode::Read, Data::ReadSlice(buf), len, offset, WriteFlags::NONE)
    }

    fn write_at_with(&self, buf: &[u8], offset: u64, flags: WriteFlags) -> Result<()> {
        let len = buf.len() as u64;
        self.check(Opcode::Write, offset, len)?;
        self.transfer(Opcode::Write, Data::WriteSlice(buf), len, offset, flags)
    }

    fn flush(&self) -> Result<()> {
        if self.read_only() {
            return Ok(());
        }
        self.session.shared.run(|q| {
            self.attempt(q, |q, vol| {
                let mut c = CommandCapsule::new(Opcode::Flush, CommandId(0));
                c.volume_id = vol.id;
                match q.simple(&c, &[]) {
                    Outcome::Done(r) => match piece_status(Opcode::Flush, &r.capsule, vol.name, None, None, false) {
                        Ok(()) => Outcome::Done(()),
                        Err(PieceError::Fatal(e)) => Outcome::Failed(e),
                        Err(PieceError::Retry(_)) => unreachable!("simple() retries ShuttingDown (and NotOwner with other gateways)"),
                    },
                    other => other.map(|_| ()),
                }
            })
        })
    }

    fn discard(&self, offset: u64, len: u64) -> Result<()> {
        self.check(Opcode::Discard, offset, len)?;
        if !self.supports_discard() || len == 0 {
            return Ok(());
        }
        self.zeroes(Opcode::Discard, offset, len)
    }

    fn write_zeroes(&self, offset: u64, len: u64) -> Result<()> {
        self.check(Opcode::WriteZeroes, offset, len)?;
        if len == 0 {
            return Ok(());
        }
        self.zeroes(Opcode::WriteZeroes, offset, len)
    }
}

impl Volume {
    fn zeroes(&self, op: Opcode, offset: u64, len: u64) -> Result<()> {
        let shared = &self.session.shared;
        let mut ranges = vec![(0, len)];
        shared.run(|q| {
            self.attempt(q, |q, vol| q.zeroes(vol, op, &mut ranges, offset, &shared.zero, &shared.small_zeroes))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn url_conversion_reports_bad_urls() {
        let e = Session::connect("udp://x:1", ConnectOptions::default()).unwrap_err();
        assert_eq!(e.kind(), crate::ErrorKind::Fabric);
        assert!(e.to_string().contains("parsing the target URL"), "{e}");
        assert_eq!("tcp://127.0.0.1:7420".into_target_url().unwrap().port, 7420);
    }

    #[test]
    fn rdma_scheme_without_a_device_is_reported_unavailable() {
        // Without the verbs provider, or without an RDMA device (as on this
        // test machine), rdma:// fails at once and says why.
        if std::path::Path::new("/sys/class/infiniband").exists() {
            return; // a machine with RDMA devices: nothing to check here
        }
        let e = Session::connect("rdma://127.0.0.1:4420", ConnectOptions::default()).unwrap_err();
        assert_eq!(e.kind(), crate::ErrorKind::Fabric);
        match &e {
            crate::Error::Fabric { source, .. } => {
                assert_eq!(source.kind, rdmablk_common::fabric::FabricErrorKind::ProviderUnavailable)
            }
            other => panic!("{other:?}"),
        }
        assert!(e.one_line().contains("rdma://127.0.0.1:4420"), "{}", e.one_line());
    }
}
