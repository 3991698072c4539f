//! The NVMe over Fabrics front end: the target as a stock Linux host sees
//! it (`nvme discover`, `nvme connect -t tcp`).
//!
//! One NVM subsystem (`[target] nqn`) holds one namespace per volume the
//! connecting host may use (its grants, as for rdmablk v1 sessions; the host
//! is named by its host NQN, mapped onto a `[[host]]` id by `nqn =`). The
//! well-known discovery subsystem answers on the same listeners. Controllers
//! follow the dynamic model: every admin Connect creates one.
//!
//! Files by concern, in the manner of Linux nvmet, so that any command's
//! handler is one step away:
//! - [`tcp`]: the NVMe/TCP transport: PDU framing, digests, R2T and the data
//!   PDUs, termination; its connections run on the reactors.
//! - [`rdma`]: the NVMe/RDMA transport: rdma_cm private data, capsules in
//!   SEND/RECV, data by RDMA READ and WRITE under the host's keys; its
//!   queue pairs run on the reactors, on their protection domains and
//!   completion queues.
//! - [`queue`]: a queue's commands: the slab, the data each one carries,
//!   the executor's work, the answers.
//! - [`fabrics_cmd`]: Connect, Property Get/Set, Disconnect.
//! - [`auth_cmd`]: Authentication Send/Receive: in-band authentication
//!   (DH-HMAC-CHAP) of the hosts that have a `dhchap_key_file`.
//! - [`admin_cmd`]: Identify, Get Log Page, features, AER, Keep Alive.
//! - [`io_cmd`]: Read, Write, Flush, Write Zeroes, Dataset Management.
//! - [`discovery`]: the discovery log page.
//! - [`identify`]: the Identify data structures.
//! - [`ana`]: Asymmetric Namespace Access: the state of each namespace
//!   through this target (one of several gateways of a shared volume), the
//!   ANA log and its change notices.
//!
//! Disk I/O goes through the reactor's executor ([`crate::engine::exec`]),
//! shared with every other queue of every protocol on that reactor.

pub mod admin_cmd;
pub mod ana;
pub mod auth_cmd;
pub mod discovery;
pub mod fabrics_cmd;
pub mod identify;
pub mod io_cmd;
pub mod queue;
pub mod rdma;
pub mod tcp;

use std::collections::HashMap;
use std::net::{SocketAddr, TcpListener};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use sha2::{Digest, Sha256};

pub use crate::metrics::NvmeStats;

use crate::auth::{Grant, Identity};
use crate::backend::{Volume, VolumeSet};
use crate::config::{NvmeListen, NvmeTransport, TargetConfig};
use crate::registry::Registry;
use crate::engine::pool::PoolAccount;

/// The queue size the reactors' NVMe/RDMA completion queues are sized for
/// (`QPS_PER_CQ` queue pairs of it per CQ): the 128 entries a Linux host
/// asks for unless `nvme connect -Q` says otherwise. Not a limit: a queue of
/// up to `target.nvme_queue_size` entries reserves what it needs in a CQ
/// with room, or in a new one (`NvmeRdma::adopt_queue`), so deep queues cost
/// completion-queue memory only when hosts ask for them (sized for 1024, a
/// reactor's first CQ would ask for 262656 entries, 16 MiB, on every fabric).
pub const MAX_QUEUE_ENTRIES: u32 = 128;
/// The largest data transfer of one command whatever `target.max_io_size`
/// says (MDTS 11 with 4 KiB pages): NVMe/RDMA's keyed SGL descriptor
/// carries its length in 24 bits (16 MiB - 1), and MDTS is a power of two.
/// NVMe/TCP has the same limit, so that a host sees one MDTS on either.
pub const MAX_TRANSFER: u32 = 8 << 20;
/// Data a command moves through heap memory rather than pool chunks (admin
/// pages, authentication messages, DSM ranges, in-capsule writes): at most
/// this. I/O data moves in pool chunks and may be as large as MDTS.
pub const MAX_HEAP_DATA: u32 = 128 << 10;
/// The page size MDTS counts in (CAP.MPSMIN: 4 KiB).
const MDTS_PAGE: u32 = 4096;

/// The largest data transfer of one command on this target: `max_io_size`
/// (target-wide, so one value for every controller and namespace) rounded
/// down to a power of two times 4 KiB (MDTS is a power of two), at most
/// [`MAX_TRANSFER`]. The pool chunk size does not bound it: a command moves
/// in chunks, at most `CHUNK_WINDOW` of them at once (as v1's).
pub fn max_transfer(cfg: &TargetConfig) -> u32 {
    let pages = (cfg.max_io_size.min(MAX_TRANSFER) / MDTS_PAGE).max(1);
    MDTS_PAGE << pages.ilog2()
}

/// MDTS for a largest transfer of `max_transfer` bytes (a power of two
/// times 4 KiB): its log2 in 4 KiB pages.
pub fn mdts(max_transfer: u32) -> u8 {
    (max_transfer / MDTS_PAGE).ilog2() as u8
}
/// In-capsule data an I/O queue accepts (IOCCSZ = (64 + this) / 16).
pub const IO_IN_CAPSULE: u32 = 16 << 10;
/// In-capsule data the admin queue accepts (the Linux host sends at most 8 KiB).
pub const ADMIN_IN_CAPSULE: u32 = 8 << 10;
/// Most I/O queues per controller (Number of Queues grants at most this).
pub const MAX_IO_QUEUES: u16 = 64;
/// Outstanding Asynchronous Event Requests a controller holds (AERL + 1).
pub const MAX_AERS: usize = 4;

/// What a front end needs from the running target.
pub struct Subsystem {
    pub nqn: String,
    /// Serial number (20 ASCII characters) and model, for Identify.
    pub serial: String,
    pub registry: Arc<Registry>,
    pub cfg: TargetConfig,
    /// The largest data transfer of one command ([`max_transfer`]; MDTS).
    pub max_transfer: u32,
    /// The NVMe listeners' transports and bound addresses, for the discovery log.
    pub listeners: Mutex<Vec<(NvmeTransport, SocketAddr)>>,
    controllers: Mutex<Controllers>,
    /// Set once the target is stopping: queues finish and close.
    pub stopping: AtomicBool,
    pub stats: NvmeStats,
}

#[derive(Default)]
struct Controllers {
    by_id: HashMap<u16, Arc<Controller>>,
    next: u16,
}

/// The controller state the admin queue owns and the I/O queues look up.
pub struct Controller {
    pub id: u16,
    pub host_nqn: String,
    pub host_id: [u8; 16],
    pub discovery: bool,
    /// Its host must authenticate (DH-HMAC-CHAP): never torn down to make
    /// room for another controller.
    pub protected: bool,
    /// Set when the association ends (keep-alive expiry, the admin queue
    /// closing, shutdown): every queue closes its connection.
    pub dead: AtomicBool,
    /// Queues (admin included) that have not left yet, with their disk
    /// operations: the fence a reconnecting host waits for.
    pub live_queues: AtomicU32,
    /// Connected queue ids (0, the admin queue, included).
    queues: Mutex<QueueTable>,
    /// Connected I/O queues, and when one last left (nanoseconds after
    /// `created`, plus 1; 0: none ever did): its admin queue reads them
    /// without a lock for `target.idle_timeout` of a controller without
    /// keep-alive, which is idle from its last I/O queue's leaving at the
    /// earliest (the admin queue may have been silent all along while the
    /// I/O queues worked).
    io_queues: AtomicU32,
    last_io_left: AtomicU64,
    created: Instant,
    pub state: Mutex<ControllerState>,
    /// Pool chunks its queues hold, one account per reactor, for
    /// `target.session_pool_share` (a controller is an NVMe host's session).
    pool_accounts: Box<[Arc<PoolAccount>]>,
}

/// A controller's connected queue ids.
#[derive(Default)]
struct QueueTable {
    ids: Vec<u16>,
}

/// Registers and features the host sets.
#[derive(Clone, Debug, Default)]
pub struct ControllerState {
    pub cc: u32,
    pub csts: u32,
    pub kato_ms: u32,
    /// Set Features Number of Queues, granted (0-based, as on the wire).
    pub queues_granted: Option<u16>,
    /// Set Features Asynchronous Event Configuration.
    pub aen_config: u32,
}

/// What a queue says when its host closed the connection (a TCP FIN, an
/// rdma_cm disconnect).
pub const HOST_CLOSED: &str = "the host closed the connection";

/// Why a queue's connection or a whole association ended: the kind says
/// how to log it, the text what happened. Made where the end is detected
/// (the transport's thread, the keep-alive check, a Disconnect command)
/// and passed up unchanged in kind, so nothing above reads the text.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CloseReason {
    pub kind: CloseKind,
    pub why: String,
}

/// Whose doing an end was.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CloseKind {
    /// The host ended it (a TCP FIN, an rdma_cm disconnect, a Disconnect
    /// command): how a host disconnects, logged at INFO.
    ByHost,
    /// The host sends commands and does not read the answers: the target
    /// closes, logged at WARN although no PDU was malformed.
    HostStalled,
    /// Anything else: a protocol error, a timeout, a local failure, the
    /// target stopping. Logged at WARN.
    Fault,
}

impl CloseReason {
    /// The host closed the connection ([`HOST_CLOSED`]).
    pub fn host_closed() -> CloseReason {
        CloseReason::by_host(HOST_CLOSED)
    }

    pub fn by_host(why: impl Into<String>) -> CloseReason {
        CloseReason { kind: CloseKind::ByHost, why: why.into() }
    }

    pub fn host_stalled(why: impl Into<String>) -> CloseReason {
        CloseReason { kind: CloseKind::HostStalled, why: why.into() }
    }

    pub fn fault(why: impl Into<String>) -> CloseReason {
        CloseReason { kind: CloseKind::Fault, why: why.into() }
    }

    /// The same kind, the text rewritten (a prefix or a note added).
    pub fn map(&self, f: impl FnOnce(&str) -> String) -> CloseReason {
        CloseReason { kind: self.kind, why: f(&self.why) }
    }
}

/// A failure described in words is a fault.
impl From<String> for CloseReason {
    fn from(why: String) -> CloseReason {
        CloseReason::fault(why)
    }
}

impl From<&str> for CloseReason {
    fn from(why: &str) -> CloseReason {
        CloseReason::fault(why)
    }
}

impl std::fmt::Display for CloseReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.why)
    }
}

impl Controller {
    /// Ends the association: marks it dead and wakes every reactor, whose
    /// NVMe transports close the controller's queues at their next turn
    /// (they drop what is queued and let what reached the disk finish).
    pub fn tear_down(&self, sub: &Subsystem, reason: &CloseReason) {
        if self.dead.swap(true, Ordering::AcqRel) {
            return;
        }
        match reason.kind {
            CloseKind::ByHost => {
                tracing::info!(host = %self.host_nqn, controller = self.id, "nvme controller {} of host {}: ended: {reason}", self.id, self.host_nqn)
            }
            CloseKind::HostStalled | CloseKind::Fault => {
                tracing::warn!(host = %self.host_nqn, controller = self.id, "nvme controller {} of host {}: torn down: {reason}", self.id, self.host_nqn)
            }
        }
        sub.registry.fence_moved();
    }

    pub fn is_dead(&self) -> bool {
        self.dead.load(Ordering::Acquire)
    }

    fn queue_table(&self) -> MutexGuard<'_, QueueTable> {
        self.queues.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Takes queue id `qid` (0: the admin queue); false if it is taken already.
    pub fn add_queue(&self, qid: u16) -> bool {
        let mut t = self.queue_table();
        if t.ids.contains(&qid) {
            return false;
        }
        t.ids.push(qid);
        if qid != 0 {
            self.io_queues.fetch_add(1, Ordering::AcqRel);
        }
        true
    }

    /// Forgets a closed queue: its id may be connected again.
    pub fn remove_queue(&self, qid: u16) {
        let mut t = self.queue_table();
        let Some(i) = t.ids.iter().position(|&q| q == qid) else { return };
        t.ids.swap_remove(i);
        if qid != 0 {
            // When it left, before it stops counting: whoever sees no I/O
            // queue sees when the last one left.
            let at = self.created.elapsed().as_nanos().min(u64::MAX as u128 - 1) as u64 + 1;
            self.last_io_left.store(at, Ordering::Release);
            self.io_queues.fetch_sub(1, Ordering::AcqRel);
        }
    }

    /// Connected I/O queues (one load).
    pub fn io_queues(&self) -> u32 {
        self.io_queues.load(Ordering::Acquire)
    }

    /// When an I/O queue last left, if one ever did (one load).
    pub fn last_io_left(&self) -> Option<Instant> {
        match self.last_io_left.load(Ordering::Acquire) {
            0 => None,
            at => Some(self.created + Duration::from_nanos(at - 1)),
        }
    }

    /// The controller's pool account on `reactor`.
    pub fn pool_account(&self, reactor: usize) -> Option<&Arc<PoolAccount>> {
        self.pool_accounts.get(reactor)
    }
}

/// One namespace as a host sees it.
#[derive(Clone, Debug)]
pub struct Namespace {
    pub nsid: u32,
    pub volume: Arc<Volume>,
    pub read_only: bool,
    /// Where its volume is in the volume set of `generation`: an executor
    /// whose snapshot is that set finds the volume's slot by it
    /// (`Executor::slot_of_index`).
    pub index: usize,
    pub generation: u64,
}

impl Namespace {
    pub fn lba_shift(&self) -> u32 {
        self.volume.block_size.trailing_zeros()
    }
}

/// The host of a controller: its NQN, and the `[[host]]` id it maps to.
#[derive(Clone, Debug)]
pub struct HostView {
    pub nqn: String,
    pub id: Option<String>,
}

impl HostView {
    /// What this host may do with `vol` under the set's grants.
    pub fn grant(&self, set: &VolumeSet, vol: &Volume) -> Option<Grant> {
        let hosts = set.access.hosts_configured();
        let who = match &self.id {
            Some(id) => Identity { host_id: id, authenticated: true },
            None => Identity { host_id: &self.nqn, authenticated: false },
        };
        set.access.volume(&vol.name).grant(who, hosts)
    }
}

/// The namespace id of a volume: `nsid =`, or its first volume id (never
/// reused; see [`Volume::nsid`]).
pub fn nsid_of(vol: &Volume) -> u32 {
    vol.nsid
}

/// The namespaces `host` sees in `set`, by ascending nsid. A volume whose
/// nsid another volume already has is left out (and logged).
pub fn namespaces(set: &VolumeSet, host: &HostView) -> Vec<Namespace> {
    let mut out: Vec<Namespace> = Vec::new();
    for (index, v) in set.volumes.iter().enumerate() {
        let Some(grant) = host.grant(set, v) else { continue };
        let nsid = nsid_of(v);
        if nsid == 0 || nsid > crate::config::MAX_NSID {
            continue;
        }
        if let Some(o) = out.iter().find(|n| n.nsid == nsid) {
            tracing::warn!("volume {:?}: nsid {nsid} is also volume {:?}'s; not served over NVMe-oF", v.name, o.volume.name);
            continue;
        }
        let read_only = v.read_only || grant == Grant::ReadOnly;
        out.push(Namespace { nsid, volume: Arc::clone(v), read_only, index, generation: set.generation });
    }
    out.sort_by_key(|n| n.nsid);
    out
}

/// The NGUID (16 bytes) and UUID of a namespace: stable for a target
/// name and volume name, distinct between volumes.
pub fn namespace_ids(target_nqn: &str, volume: &str) -> ([u8; 16], [u8; 16]) {
    let hash = |what: &str| -> [u8; 16] {
        let mut h = Sha256::new();
        h.update(what.as_bytes());
        h.update([0]);
        h.update(target_nqn.as_bytes());
        h.update([0]);
        h.update(volume.as_bytes());
        h.finalize()[..16].try_into().expect("16 bytes")
    };
    let nguid = hash("rdmablk nguid");
    let mut uuid = hash("rdmablk uuid");
    // RFC 4122: version 5 (name based), variant 10.
    uuid[6] = (uuid[6] & 0x0f) | 0x50;
    uuid[8] = (uuid[8] & 0x3f) | 0x80;
    (nguid, uuid)
}

impl Subsystem {
    pub fn new(cfg: &TargetConfig, registry: Arc<Registry>) -> Subsystem {
        let digest = Sha256::digest(format!("rdmablk serial\0{}", cfg.nqn).as_bytes());
        let serial: String = digest.iter().take(10).map(|b| format!("{b:02x}")).collect();
        Subsystem {
            nqn: cfg.nqn.clone(),
            serial,
            registry,
            cfg: cfg.clone(),
            max_transfer: max_transfer(cfg),
            listeners: Mutex::new(Vec::new()),
            controllers: Mutex::new(Controllers { by_id: HashMap::new(), next: cfg.nvme_cntlid_min }),
            stopping: AtomicBool::new(false),
            stats: NvmeStats::default(),
        }
    }

    fn controllers(&self) -> MutexGuard<'_, Controllers> {
        self.controllers.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The `[[host]]` id that `nqn` maps to, if any.
    pub fn host_view(&self, set: &VolumeSet, nqn: &str) -> HostView {
        HostView { nqn: nqn.to_owned(), id: set.access.host_for_nqn(nqn).map(str::to_owned) }
    }

    /// Creates a controller for an admin Connect, unless
    /// `target.max_controllers` live controllers exist, or
    /// `max_controllers_per_host` of the same host NQN (discovery
    /// controllers count too: each is a host's connection for as long as
    /// it lasts). A host that must prove who it is (`protected`: its
    /// `[[host]]` has a `dhchap_key_file`, and its queues authenticate
    /// before anything else) is not refused for anonymous controllers:
    /// one of them is torn down for it, the oldest without an I/O queue
    /// first, else the oldest. Anonymous controllers are refused beyond
    /// `max_anonymous_controllers`.
    pub fn create_controller(
        &self,
        host_nqn: &str,
        host_id: [u8; 16],
        discovery: bool,
        protected: bool,
        kato_ms: u32,
    ) -> std::result::Result<Arc<Controller>, String> {
        let mut c = self.controllers();
        let total = c.by_id.values().filter(|x| !x.is_dead()).count();
        if total >= self.cfg.max_controllers as usize {
            let anonymous = c.by_id.values().filter(|x| !x.is_dead() && !x.protected);
            let idle = anonymous.clone().filter(|x| x.io_queues.load(Ordering::Acquire) == 0).min_by_key(|x| x.created);
            match idle.or_else(|| anonymous.min_by_key(|x| x.created)).filter(|_| protected) {
                Some(victim) => {
                    NvmeStats::add(&self.stats.controllers_evicted, 1);
                    let why = format!(
                        "evicted: {total} controllers exist (target.max_controllers = {}) and host {host_nqn:?}, which authenticates, needs a place; this one is anonymous{}",
                        self.cfg.max_controllers,
                        if victim.io_queues.load(Ordering::Acquire) == 0 { " and has no I/O queue" } else { " and the oldest" }
                    );
                    victim.tear_down(self, &CloseReason::host_stalled(why));
                }
                None => {
                    NvmeStats::add(&self.stats.controllers_refused, 1);
                    return Err(format!(
                        "{total} controllers exist (target.max_controllers = {}){}",
                        self.cfg.max_controllers,
                        if protected { ", none of them anonymous" } else { "" }
                    ));
                }
            }
        }
        if !protected {
            let anonymous = c.by_id.values().filter(|x| !x.is_dead() && !x.protected).count();
            if anonymous >= self.cfg.max_anonymous_controllers as usize {
                NvmeStats::add(&self.stats.controllers_refused, 1);
                return Err(format!(
                    "{anonymous} controllers of hosts that do not authenticate exist (target.max_anonymous_controllers = {})",
                    self.cfg.max_anonymous_controllers
                ));
            }
        }
        let of_host = c.by_id.values().filter(|x| x.host_nqn == host_nqn && !x.is_dead()).count();
        if of_host >= self.cfg.max_controllers_per_host as usize {
            NvmeStats::add(&self.stats.controllers_refused, 1);
            return Err(format!(
                "the host has {of_host} controllers (target.max_controllers_per_host = {})",
                self.cfg.max_controllers_per_host
            ));
        }
        // Controller ids in `nvme_cntlid_min..=nvme_cntlid_max` (at most
        // 1..=0xffef; 0xfff0.. are reserved), the next free one in turn: the
        // gateways of one subsystem hand out disjoint ranges, so that a host
        // with a controller on each never sees one id twice there.
        let (lo, hi) = (self.cfg.nvme_cntlid_min, self.cfg.nvme_cntlid_max);
        let after = |id: u16| if id >= hi { lo } else { id + 1 };
        let mut id = c.next.clamp(lo, hi);
        for _ in lo..=hi {
            if !c.by_id.contains_key(&id) {
                break;
            }
            id = after(id);
        }
        if c.by_id.contains_key(&id) {
            return Err(format!("every controller id of target.nvme_cntlid_min..=nvme_cntlid_max ({lo}..={hi}) is taken"));
        }
        c.next = after(id);
        let name = format!("host={host_nqn} controller={id}");
        let ctrl = Arc::new(Controller {
            id,
            host_nqn: host_nqn.to_owned(),
            host_id,
            discovery,
            protected,
            dead: AtomicBool::new(false),
            live_queues: AtomicU32::new(1),
            queues: Mutex::new(QueueTable::default()),
            io_queues: AtomicU32::new(0),
            last_io_left: AtomicU64::new(0),
            created: Instant::now(),
            state: Mutex::new(ControllerState { kato_ms, ..ControllerState::default() }),
            pool_accounts: (0..self.registry.reactors()).map(|_| Arc::new(PoolAccount::named(name.clone()))).collect(),
        });
        c.by_id.insert(id, Arc::clone(&ctrl));
        Ok(ctrl)
    }

    pub fn controller(&self, id: u16) -> Option<Arc<Controller>> {
        self.controllers().by_id.get(&id).cloned()
    }

    /// Forgets a controller whose queues have all left, and lets a fence
    /// that waits for it go on.
    pub fn remove_controller(&self, id: u16) {
        self.controllers().by_id.remove(&id);
        self.registry.fence_moved();
    }

    /// The controllers of `host_nqn`: how many are live (not torn down),
    /// and whether a torn-down one still has queues (with their disk
    /// operations) left.
    pub fn controllers_of(&self, host_nqn: &str) -> (usize, bool) {
        let c = self.controllers();
        let mine = c.by_id.values().filter(|c| c.host_nqn == host_nqn && !c.discovery);
        let (mut live, mut busy) = (0, false);
        for ctrl in mine {
            if ctrl.is_dead() {
                busy |= ctrl.live_queues.load(Ordering::Acquire) > 0;
            } else {
                live += 1;
            }
        }
        (live, busy)
    }

    /// Tears down every controller (shutdown).
    pub fn tear_down_all(&self, reason: &CloseReason) {
        let all: Vec<Arc<Controller>> = self.controllers().by_id.values().cloned().collect();
        for c in all {
            c.tear_down(self, reason);
        }
    }

    pub fn live_controllers(&self) -> usize {
        self.controllers().by_id.values().filter(|c| !c.is_dead()).count()
    }
}

/// A bound NVMe-oF listener.
pub enum NvmeListener {
    Tcp(TcpListener),
    Rdma(Box<rdma::RdmaListener>),
}

impl NvmeListener {
    /// Readable when a connection (request) is waiting.
    pub fn fd(&self) -> std::os::fd::RawFd {
        match self {
            NvmeListener::Tcp(l) => std::os::fd::AsRawFd::as_raw_fd(l),
            NvmeListener::Rdma(l) => l.fd(),
        }
    }
}

/// A new NVMe-oF connection for a reactor's transport.
pub enum Incoming {
    Tcp(tcp::Accept),
    Rdma(rdma::Accept),
}

/// The NVMe listeners (their connections go to the reactors).
pub struct NvmeFrontEnd {
    pub subsystem: Arc<Subsystem>,
    pub listeners: Vec<(NvmeListen, NvmeListener)>,
}

impl NvmeFrontEnd {
    /// Binds every NVMe-oF listener (port 0 picks a free one).
    /// `source`: the configuration file, for errors.
    pub fn bind(source: &str, cfg: &TargetConfig, registry: Arc<Registry>) -> crate::Result<NvmeFrontEnd> {
        let subsystem = Arc::new(Subsystem::new(cfg, registry));
        let mut listeners = Vec::new();
        for l in &cfg.nvme_listen {
            let (listener, addr) = match l.transport {
                NvmeTransport::Tcp => {
                    let sock = TcpListener::bind(l.url.host_port()).map_err(|e| {
                        crate::Error::listen(crate::ErrorKind::Os, format!("{source}: target.listen: cannot listen on {l}"), e)
                    })?;
                    sock.set_nonblocking(true).map_err(|e| crate::Error::os(format!("{l}: cannot listen"), e))?;
                    crate::sys::deepen_listen_backlog(std::os::fd::AsRawFd::as_raw_fd(&sock))
                        .map_err(|e| crate::Error::os(format!("{l}: cannot listen"), e))?;
                    let addr = sock.local_addr().map_err(|e| crate::Error::os(format!("{l}: cannot listen"), e))?;
                    (NvmeListener::Tcp(sock), addr)
                }
                NvmeTransport::Rdma => {
                    let r = rdma::RdmaListener::bind(source, l, cfg)?;
                    let addr = r.local_addr();
                    (NvmeListener::Rdma(Box::new(r)), addr)
                }
            };
            let mut bound = l.clone();
            bound.url.port = addr.port();
            subsystem.listeners.lock().unwrap_or_else(|e| e.into_inner()).push((l.transport, addr));
            listeners.push((bound, listener));
        }
        Ok(NvmeFrontEnd { subsystem, listeners })
    }

    /// The fabrics of the NVMe/RDMA listeners, in listener order: each
    /// reactor has a protection domain, pool region and completion queues
    /// on each.
    pub fn rdma_fabrics(&self) -> Vec<Arc<rdmablk_common::fabric::Fabric>> {
        self.listeners
            .iter()
            .filter_map(|(_, l)| match l {
                NvmeListener::Rdma(r) => Some(r.fabric()),
                NvmeListener::Tcp(_) => None,
            })
            .collect()
    }

    /// Takes every pending connection of listener `i` past admission (the
    /// connection limits, and for NVMe/RDMA the rdma_cm private data) into
    /// `out`, for the reactors.
    pub fn accept(&mut self, i: usize, out: &mut Vec<Incoming>) {
        let port = i as u16 + 1;
        if self.subsystem.stopping.load(Ordering::Acquire) {
            return;
        }
        // The index of this listener's fabric among the NVMe/RDMA ones.
        let rdma_index = self.listeners[..i].iter().filter(|(_, l)| matches!(l, NvmeListener::Rdma(_))).count();
        match &self.listeners[i].1 {
            NvmeListener::Rdma(l) => l.accept(&self.subsystem, port, rdma_index, out),
            NvmeListener::Tcp(listener) => tcp::accept(listener, &self.subsystem, port, out),
        }
    }

    /// Stops accepting and tears every controller down; the reactors close
    /// the queues (finishing their disk operations) as they stop.
    pub fn shutdown(&mut self) {
        self.subsystem.stopping.store(true, Ordering::Release);
        self.listeners.clear();
        self.subsystem.tear_down_all(&CloseReason::fault("the target is stopping"));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;

    fn cfg(extra: &str) -> TargetConfig {
        let volume = "[[volume]]\nname = \"a\"\nbackend = \"memory\"\nsize = \"1MiB\"\nallow_any_host = true\n";
        Config::parse(&format!("[target]\nlisten = [\"nvme+tcp://127.0.0.1:0\"]\n{extra}\n{volume}"), "t").unwrap().target
    }

    #[test]
    fn mdts_follows_max_io_size_rounded_down_to_a_power_of_two() {
        assert_eq!((max_transfer(&cfg("")), mdts(max_transfer(&cfg("")))), (1 << 20, 8), "the default 1 MiB");
        assert_eq!(max_transfer(&cfg("max_io_size = \"4MiB\"")), 4 << 20);
        assert_eq!(mdts(4 << 20), 10);
        // 3 MiB is no power of two: 2 MiB.
        assert_eq!(max_transfer(&cfg("max_io_size = \"3MiB\"")), 2 << 20);
        assert_eq!(max_transfer(&cfg("max_io_size = \"128KiB\"")), 128 << 10);
        assert_eq!(mdts(128 << 10), 5);
        // Keyed SGL lengths are 24 bits: 8 MiB at most.
        assert_eq!(max_transfer(&cfg("max_io_size = \"64MiB\"")), MAX_TRANSFER);
        assert_eq!(mdts(MAX_TRANSFER), 11);
    }
}
