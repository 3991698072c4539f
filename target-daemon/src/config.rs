//! The TOML configuration: parsing, defaults and validation.
//!
//! Every error names the file, the key (`target.max_io_size`,
//! `volume[1].size`) and the reason. Unknown keys are refused
//! (`deny_unknown_fields`); toml's own message for them already names the key
//! and shows the line, and is kept as it is.

use std::collections::HashSet;
use std::fmt;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use rdmablk_common::fabric::{FabricUrl, ProviderKind};
use rdmablk_common::protocol::{MAX_HOST_ID_LEN, MAX_NAME_LEN};
use rdmablk_common::size::ByteSize;
use serde::de::{self, Deserializer, Visitor};
use serde::Deserialize;

use crate::error::{Error, Result};

/// Default target name sent in the CONNECT reply.
pub const DEFAULT_TARGET_NAME: &str = "rdmablk";
/// `[target] nqn` by default: this prefix and the target's name.
pub const DEFAULT_NQN_PREFIX: &str = "nqn.2014-08.io.rdmablk:";
/// The largest namespace id (`[[volume]] nsid`, and the default, the volume
/// id); Identify Controller reports it as NN.
pub const MAX_NSID: u32 = 65535;
/// Default maximum queue depth per queue pair.
pub const DEFAULT_QUEUE_DEPTH: u32 = 128;
/// Largest queue depth the configuration may set.
pub const MAX_QUEUE_DEPTH: u32 = 4096;
/// Default maximum I/O size.
pub const DEFAULT_MAX_IO_SIZE: u32 = 1 << 20;
/// Default `target.nvme_queue_size`: the entries an NVMe-oF queue may have
/// (CAP.MQES + 1). What Linux nvmet offers and the most a Linux host asks
/// for (`nvme connect -Q`, NVMF_MAX_QUEUE_SIZE): the host takes the smaller
/// of its own size (128 unless -Q says otherwise) and this, so a larger
/// offer costs nothing to a host that asks for less.
pub const DEFAULT_NVME_QUEUE_SIZE: u32 = 1024;
/// Bounds of `target.nvme_queue_size`: a Linux host refuses a controller
/// smaller than NVMF_MIN_QUEUE_SIZE (16); NVMF_MAX_QUEUE_SIZE (1024) is
/// the most it asks for.
pub const MIN_NVME_QUEUE_SIZE: u32 = 16;
pub const MAX_NVME_QUEUE_SIZE: u32 = 1024;
/// The NVMe controller ids a target may hand out (`target.nvme_cntlid_min`
/// and `nvme_cntlid_max`, by default all of them): 0xfff0 and above are
/// reserved (0xffff is the dynamic controller of a Connect), 0 is not used.
pub const MIN_CNTLID: u16 = 1;
pub const MAX_CNTLID: u16 = 0xffef;
/// Default maximum inline write payload.
pub const DEFAULT_INLINE_DATA_SIZE: u32 = 4096;
/// Default buffer pool per reactor.
pub const DEFAULT_BUFFER_POOL: u64 = 64 << 20;
/// Default pool chunk size.
pub const DEFAULT_CHUNK_SIZE: u32 = 128 << 10;
/// Largest chunk size.
pub const MAX_CHUNK_SIZE: u32 = 16 << 20;
/// io_uring accepts at most this many fixed buffers, so a pool has at most this many chunks.
pub const MAX_POOL_CHUNKS: u64 = 16384;
/// Largest maximum I/O size.
pub const MAX_MAX_IO_SIZE: u32 = 1 << 30;
/// Default shutdown timeout.
pub const DEFAULT_SHUTDOWN_TIMEOUT: Duration = Duration::from_secs(10);
/// Default block size of regular-file volumes.
pub const DEFAULT_FILE_BLOCK_SIZE: u32 = 4096;
/// Alignment of every pool buffer and the unit of max_io_size and chunk_size.
pub const PAGE: u32 = 4096;
/// Longest `busy_poll`: beyond it, polling only burns the CPU.
pub const MAX_BUSY_POLL: Duration = Duration::from_millis(10);
/// Most volumes a target serves at once (the configuration and every reload).
pub const MAX_VOLUMES: usize = 256;
/// Default most sessions at once.
pub const DEFAULT_MAX_SESSIONS: u32 = 256;
/// Default most live queue pairs per session.
pub const DEFAULT_MAX_QUEUES_PER_SESSION: u32 = 16;
/// Default most connections of one protocol (rdmablk v1, NVMe-oF: each has
/// its own budget) accepted but not yet past CONNECT. A connection in its
/// handshake costs a socket and a few KiB, no thread and no registered
/// memory, so thousands can wait without starving anyone.
pub const DEFAULT_MAX_HANDSHAKES: u32 = 4096;
/// Default `target.max_handshakes_per_address` (never above
/// `max_handshakes`): a quarter of the default `max_handshakes`, so that
/// one peer leaves most of the slots to everyone else.
pub const DEFAULT_MAX_HANDSHAKES_PER_ADDRESS: u32 = 1024;
/// Default `target.max_connections_per_address`, handshaking or connected,
/// every protocol: as many as a quarter of the handshake slots. A large
/// NVMe-oF host opens a queue per CPU and per path (a 128-CPU host on two
/// paths: 258 connections from one address).
pub const DEFAULT_MAX_CONNECTIONS_PER_ADDRESS: u32 = 1024;
/// Default `target.max_controllers`: NVMe-oF controllers at once (admin
/// queues past Connect, discovery ones included).
pub const DEFAULT_MAX_CONTROLLERS: u32 = 1024;
/// Default `target.max_controllers_per_host`: live controllers of one host
/// NQN (a host keeps one per path, and a new one while an old one ends).
pub const DEFAULT_MAX_CONTROLLERS_PER_HOST: u32 = 16;
/// Default time a connection has to complete CONNECT.
pub const DEFAULT_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Default `target.fence_timeout`: below the initiator's default connect
/// timeout (10 s), so that a CONNECT kept waiting is answered in time.
pub const DEFAULT_FENCE_TIMEOUT: Duration = Duration::from_secs(5);
/// Default `target.idle_timeout`: far above the keep-alive interval of the
/// initiator library (a quarter of its 5 s `keepalive_timeout`).
pub const DEFAULT_IDLE_TIMEOUT: Duration = Duration::from_secs(30);
/// Default `target.transport_timeout`: the fabric's (4 s, see
/// [`rdmablk_common::fabric::DEFAULT_TRANSPORT_TIMEOUT`] for why).
pub const DEFAULT_TRANSPORT_TIMEOUT: Duration = rdmablk_common::fabric::DEFAULT_TRANSPORT_TIMEOUT;
/// Default `target.frame_timeout`: the fabric's (10 s, as the handshake).
pub const DEFAULT_FRAME_TIMEOUT: Duration = rdmablk_common::fabric::DEFAULT_FRAME_TIMEOUT;
/// Default share of a reactor's pool one session may hold: 25 %.
pub const DEFAULT_SESSION_POOL_SHARE: PoolShare = PoolShare::Percent(25);
/// Default share of a reactor's pool one host (source address) may hold,
/// all its sessions together: half, so that one peer, however many
/// sessions it opens, leaves the other half to everyone else (as
/// `max_handshakes_per_address` leaves half the handshake slots).
pub const DEFAULT_HOST_POOL_SHARE: PoolShare = PoolShare::Percent(50);
/// Default `target.chunk_wait_timeout`: below the initiator's default I/O
/// timeout (30 s) and connect timeout (10 s, which a LIST at connect
/// counts against), so that a command the pool cannot serve is answered
/// `OutOfBuffers` before the initiator gives up on the connection; far
/// above what a turning pool makes a command wait (milliseconds).
pub const DEFAULT_CHUNK_WAIT_TIMEOUT: Duration = Duration::from_secs(5);
/// Default `target.readahead`: the most bytes read ahead of a sequential
/// stream. Four MiB at 128 KiB chunks keeps 32 reads in flight ahead of a
/// reader, enough to reach a fast disk's sequential bandwidth.
pub const DEFAULT_READAHEAD: u64 = 4 << 20;
/// Largest `target.readahead` (a reactor's readahead holds at most a
/// quarter of its pool anyway).
pub const MAX_READAHEAD: u64 = 256 << 20;
/// Upper bound of the count limits (sessions, queues, handshakes).
pub const MAX_COUNT_LIMIT: u32 = 1 << 20;

/// The validated configuration.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Config {
    /// Where it came from (a file path), for messages.
    pub source: String,
    pub target: TargetConfig,
    pub volumes: Vec<VolumeConfig>,
    /// `[[host]]`: the hosts that may authenticate, with their key files.
    /// None: sessions are not authenticated.
    pub hosts: Vec<HostConfig>,
    /// Who may use each volume: one entry per volume, in the order of `volumes`.
    pub access: Vec<VolumeAccess>,
}

/// `[[host]]`: a host that authenticates with a pre-shared key.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HostConfig {
    /// Position in the file, for messages (`host[N]`).
    pub index: usize,
    /// The host id the initiator sends (AUTH_NEGOTIATE, CONNECT).
    pub id: String,
    /// The key file (one line of hex; see `rdmablk keygen`). Read when the
    /// configuration is applied, refused if group or others may read it.
    /// `None`: a host known only by its NQN, which cannot authenticate on
    /// rdmablk listeners.
    pub key_file: Option<PathBuf>,
    /// The NVMe host NQN that stands for this host on NVMe-oF listeners
    /// (`nqn =`): its grants are this host's.
    pub nqn: Option<String>,
    /// NVMe in-band authentication (DH-HMAC-CHAP) of the host named `nqn`.
    pub dhchap: Option<DhchapConfig>,
}

/// `[[host]] dhchap_*`: the host must prove it holds the secret (and, with
/// a controller key, the target proves it holds that one) before any
/// command beyond Connect, Property Get/Set and the authentication itself.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DhchapConfig {
    /// `dhchap_key_file`: one `DHHC-1:..` secret (`nvme gen-dhchap-key`),
    /// read when the configuration is applied, refused if group or others
    /// may read it.
    pub key_file: PathBuf,
    /// `dhchap_ctrl_key_file`: the controller's secret, for bidirectional
    /// authentication (the host's `--dhchap-ctrl-secret`).
    pub ctrl_key_file: Option<PathBuf>,
    /// `dhchap_hash` (`sha256`, default; `sha384`, `sha512`): the hash the
    /// target chooses; the host must offer it.
    pub hash: rdmablk_common::nvme::auth::HashId,
    /// `dhchap_dhgroup` (`null`, `ffdhe2048` (default) ... `ffdhe8192`): the
    /// Diffie-Hellman group the target chooses; the host must offer it.
    pub dh_group: rdmablk_common::nvme::auth::DhGroup,
}

/// The access keys of one `[[volume]]`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct VolumeAccess {
    /// The volume's name.
    pub volume: String,
    /// Any host may use the volume: any authenticated host when `[[host]]`
    /// entries exist, any session at all when there are none.
    pub allow_any_host: bool,
    /// `[[host]]` ids that may use the volume.
    pub allowed_hosts: Vec<String>,
    /// `[[host]]` ids that get the volume read-only (whatever else grants them).
    pub read_only_hosts: Vec<String>,
}

/// `[target]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TargetConfig {
    /// Target name sent in the CONNECT reply.
    pub name: String,
    /// Fabric URLs to listen on (port 0 picks a free port).
    pub listen: Vec<FabricUrl>,
    /// `nvme+tcp://` entries of `listen`: NVMe-oF listeners (see `nvmf`).
    pub nvme_listen: Vec<NvmeListen>,
    /// The NVMe subsystem NQN this target serves its namespaces under.
    pub nqn: String,
    /// Number of reactor threads.
    pub reactors: usize,
    /// Maximum queue depth negotiated per queue pair.
    pub queue_depth: u32,
    /// Maximum I/O size negotiated per queue pair (multiple of 4096); for
    /// NVMe-oF, MDTS (rounded down to a power of two times 4 KiB).
    pub max_io_size: u32,
    /// Entries an NVMe-oF queue may have (CAP.MQES + 1).
    pub nvme_queue_size: u32,
    /// Maximum inline write payload.
    pub inline_data_size: u32,
    /// Buffer pool size per reactor (a multiple of `chunk_size`).
    pub buffer_pool: u64,
    /// Pool buffer size.
    pub chunk_size: u32,
    /// How long in-flight commands may take to finish at shutdown.
    pub shutdown_timeout: Duration,
    /// Use an io_uring submission-queue polling thread per reactor.
    pub sqpoll: bool,
    /// Busy-poll completions (IORING_SETUP_IOPOLL): NVMe with poll queues only.
    pub iopoll: bool,
    /// Pin reactor `i` to allowed CPU `i mod n`. Default: on when the
    /// reactors poll (`busy_poll` > 0 or `iopoll`), off when they sleep.
    /// A polling reactor owns its CPU, and two pollers must never share
    /// one. A sleeping reactor is woken by the disk's interrupt and by its
    /// peers' packets: unpinned, the scheduler runs it where the waker ran
    /// (wake-affine), instead of paying a cross-CPU wake-up for each. On the
    /// benchmark machine that was 82–94 µs against 103–115 µs p50 at QD1 on
    /// a file, and no row was slower (docs/perf-log/issue-20-looks.md, "Sleeping reactors
    /// unpinned").
    pub pin_reactors: bool,
    /// How long an idle reactor keeps polling before it sleeps (0: sleeps
    /// at once).
    pub busy_poll: Duration,
    /// Where to serve Prometheus metrics over HTTP (`None`: no endpoint).
    pub metrics: Option<SocketAddr>,
    /// Most sessions at once; CONNECT creating one more is refused
    /// (`LimitReached`), unless it authenticated: then an anonymous session
    /// is evicted for it.
    pub max_sessions: u32,
    /// Of those, most that did not authenticate (default: `max_sessions`).
    pub max_anonymous_sessions: u32,
    /// Most live queue pairs per session; a join beyond is refused (`LimitReached`).
    pub max_queues_per_session: u32,
    /// Most connections accepted but not yet past CONNECT; more are rejected
    /// at the fabric level.
    pub max_handshakes: u32,
    /// Of those, most from one source address (default 32, or
    /// `max_handshakes` if that is smaller).
    pub max_handshakes_per_address: u32,
    /// Most connections (queue pairs, in their handshake or connected) from
    /// one source address at once.
    pub max_connections_per_address: u32,
    /// NVMe-oF controllers at once (`target.max_controllers`).
    pub max_controllers: u32,
    /// Of those, most of hosts that do not authenticate (no
    /// `dhchap_key_file`; default: `max_controllers`).
    pub max_anonymous_controllers: u32,
    /// Live NVMe-oF controllers of one host NQN (`target.max_controllers_per_host`).
    pub max_controllers_per_host: u32,
    /// The NVMe controller ids this target hands out, `min..=max`: the
    /// gateways of one subsystem each take their own range, since a host
    /// refuses a second controller with an id it already has there.
    pub nvme_cntlid_min: u16,
    pub nvme_cntlid_max: u16,
    /// Time a connection has from arriving until its CONNECT succeeds
    /// (applied to the fabric hello and again to CONNECT).
    pub handshake_timeout: Duration,
    /// How long a CONNECT that replaces an earlier session (the reconnect
    /// fence) may wait for that session's disk I/O to finish before it is
    /// answered `FenceTimeout` (the initiator then retries).
    pub fence_timeout: Duration,
    /// A connected queue pair with nothing outstanding that has received no
    /// command (a keep-alive included) for this long is torn down.
    pub idle_timeout: Duration,
    /// tcp:// listeners: a queue pair whose initiator makes no progress on
    /// an outstanding transfer or response for this long fails with a
    /// transport error and is torn down (`FabricOptions::transport_timeout`).
    pub transport_timeout: Duration,
    /// tcp:// listeners: an initiator that stops in the middle of a frame
    /// for this long (plus one second per MiB of its payload) loses the
    /// connection (`FabricOptions::frame_timeout`).
    pub frame_timeout: Duration,
    /// Most pool buffers one session may hold at once on one reactor;
    /// commands beyond it wait for the session's own buffers to return.
    pub session_pool_share: PoolShare,
    /// Most pool buffers the connections of one source address (all its
    /// sessions together) may hold at once on one reactor; never below
    /// `session_pool_share` (the default follows it when that is larger,
    /// a smaller setting is refused).
    pub host_pool_share: PoolShare,
    /// A command that has waited this long for a pool chunk (since it
    /// queued, or since its last chunk) is answered `OutOfBuffers`.
    pub chunk_wait_timeout: Duration,
    /// Most bytes read ahead of a sequential stream of READs on a file
    /// volume (0: no readahead).
    pub readahead: u64,
}

/// `target.session_pool_share`: a fraction of each reactor's pool, or bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PoolShare {
    /// 1..=100 percent of the reactor's pool.
    Percent(u8),
    /// At most this many bytes (rounded down to whole chunks, at least one).
    Bytes(u64),
}

impl PoolShare {
    /// The share in chunks of a pool of `pool_chunks` chunks of `chunk_size` bytes (at least 1).
    pub fn chunks(self, pool_chunks: u32, chunk_size: u32) -> u32 {
        let n = match self {
            PoolShare::Percent(p) => (pool_chunks as u64 * p as u64 / 100) as u32,
            PoolShare::Bytes(b) => (b / chunk_size as u64).min(pool_chunks as u64) as u32,
        };
        n.clamp(1, pool_chunks.max(1))
    }
}

impl fmt::Display for PoolShare {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PoolShare::Percent(p) => write!(f, "{p}%"),
            PoolShare::Bytes(b) => write!(f, "{}", ByteSize(*b)),
        }
    }
}

/// The kind of a volume's backend.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum BackendKind {
    /// A regular file or a block device, accessed with O_DIRECT through io_uring.
    File,
    /// RAM (a memfd), data kept while the target runs; lost when it stops.
    Memory,
    /// Reads return zeroes, writes are dropped: measures the fabric alone.
    Null,
    /// A Ceph RBD image, through librbd; several gateways may serve it, one
    /// at a time (the image's exclusive lock, fenced by Ceph's blocklist).
    Rbd,
}

impl fmt::Display for BackendKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            BackendKind::File => "file",
            BackendKind::Memory => "memory",
            BackendKind::Null => "null",
            BackendKind::Rbd => "rbd",
        })
    }
}

/// NVMe-oF transports a `listen` entry can name.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum NvmeTransport {
    /// `nvme+tcp://`: NVMe/TCP (TCP Transport Specification 1.0).
    Tcp,
    /// `nvme+rdma://`: NVMe/RDMA (RDMA Transport Specification 1.0b),
    /// through rdma_cm on the verbs provider.
    Rdma,
}

impl NvmeTransport {
    /// The scheme of its `listen` entries.
    pub fn scheme(self) -> &'static str {
        match self {
            NvmeTransport::Tcp => "nvme+tcp",
            NvmeTransport::Rdma => "nvme+rdma",
        }
    }
}

/// An `nvme+tcp://host:port` or `nvme+rdma://host:port` entry of `listen`
/// (4420 by convention).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct NvmeListen {
    pub transport: NvmeTransport,
    /// The address, as the fabric URL of its provider: `tcp://` for
    /// NVMe/TCP (a plain TCP listener), `rdma://` for NVMe/RDMA.
    pub url: FabricUrl,
}

impl NvmeListen {
    /// Parses `nvme+tcp://host:port` or `nvme+rdma://host:port`; the error says why not.
    pub fn parse(s: &str) -> std::result::Result<NvmeListen, String> {
        let (transport, fabric) = if let Some(rest) = s.strip_prefix("nvme+tcp://") {
            (NvmeTransport::Tcp, format!("tcp://{rest}"))
        } else if let Some(rest) = s.strip_prefix("nvme+rdma://") {
            (NvmeTransport::Rdma, format!("rdma://{rest}"))
        } else {
            return Err(format!("{s:?}: unknown NVMe-oF transport (use nvme+tcp:// or nvme+rdma://)"));
        };
        let url = FabricUrl::parse(&fabric).map_err(|e| format!("{s:?}: {}", e.context))?;
        Ok(NvmeListen { transport, url })
    }
}

impl std::fmt::Display for NvmeListen {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}://{}", self.transport.scheme(), self.url.host_port())
    }
}

/// `[[volume]]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VolumeConfig {
    /// Position in the file, for messages (`volume[N]`).
    pub index: usize,
    pub name: String,
    pub backend: BackendKind,
    /// The file or device (`file` backend); empty for `memory` and `null`.
    pub path: PathBuf,
    /// Size in bytes, if given (required for `memory` and `null`).
    pub size: Option<u64>,
    /// Block size, if given.
    pub block_size: Option<u32>,
    pub read_only: bool,
    /// NVMe namespace id, if given (default: the volume id, which is never
    /// reused while the target runs).
    pub nsid: Option<u32>,
    /// Where the image is (`rbd` backend only).
    pub rbd: Option<RbdConfig>,
}

/// An `rbd` volume's image and the Ceph identity the target uses for it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RbdConfig {
    pub pool: String,
    /// RADOS namespace inside the pool ("" = the default namespace).
    pub namespace: String,
    pub image: String,
    /// ceph.conf to read (`None`: librados' own search: $CEPH_CONF, /etc/ceph/ceph.conf, ...).
    pub ceph_conf: Option<PathBuf>,
    /// The cephx user without "client." (default "admin"). A gateway's user
    /// needs `mon 'profile rbd' osd 'profile rbd'`: breaking a lock blocklists its owner.
    pub client: String,
    /// Keyring of that user (`None`: what ceph.conf says).
    pub keyring: Option<PathBuf>,
    /// Take the image's exclusive lock at start (the image's preferred
    /// gateway), fencing whichever gateway held it; without, this gateway
    /// is a standby that takes the image over at the first command a host
    /// sends it.
    pub lock_at_start: bool,
}

impl RbdConfig {
    /// `pool/image` or `pool/namespace/image`, as the `rbd` tool writes it.
    pub fn spec(&self) -> String {
        if self.namespace.is_empty() {
            format!("{}/{}", self.pool, self.image)
        } else {
            format!("{}/{}/{}", self.pool, self.namespace, self.image)
        }
    }
}

impl VolumeConfig {
    /// `volume[N].key`, for messages.
    pub fn key(&self, key: &str) -> String {
        format!("volume[{}].{key}", self.index)
    }

    /// Whether `other` describes the same volume, ignoring its position in
    /// the file and the read-only flag (what a reload may change in place).
    pub fn same_except_read_only(&self, other: &VolumeConfig) -> bool {
        self.name == other.name
            && self.backend == other.backend
            && self.path == other.path
            && self.size == other.size
            && self.block_size == other.block_size
            && self.nsid == other.nsid
            && self.rbd == other.rbd
    }
}

impl TargetConfig {
    /// The `[target]` keys whose values differ from `other` (a reload cannot
    /// apply them; they take effect at the next start).
    pub fn changed_keys(&self, other: &TargetConfig) -> Vec<&'static str> {
        let mut v = Vec::new();
        let mut check = |changed: bool, key: &'static str| {
            if changed {
                v.push(key);
            }
        };
        check(self.name != other.name, "target.name");
        check(self.listen != other.listen || self.nvme_listen != other.nvme_listen, "target.listen");
        check(self.nqn != other.nqn, "target.nqn");
        check(self.reactors != other.reactors, "target.reactors");
        check(self.queue_depth != other.queue_depth, "target.queue_depth");
        check(self.max_io_size != other.max_io_size, "target.max_io_size");
        check(self.nvme_queue_size != other.nvme_queue_size, "target.nvme_queue_size");
        check(self.inline_data_size != other.inline_data_size, "target.inline_data_size");
        check(self.buffer_pool != other.buffer_pool, "target.buffer_pool");
        check(self.chunk_size != other.chunk_size, "target.chunk_size");
        check(self.shutdown_timeout != other.shutdown_timeout, "target.shutdown_timeout");
        check(self.sqpoll != other.sqpoll, "target.sqpoll");
        check(self.iopoll != other.iopoll, "target.iopoll");
        check(self.pin_reactors != other.pin_reactors, "target.pin_reactors");
        check(self.busy_poll != other.busy_poll, "target.busy_poll");
        check(self.metrics != other.metrics, "target.metrics");
        check(self.max_sessions != other.max_sessions, "target.max_sessions");
        check(self.max_anonymous_sessions != other.max_anonymous_sessions, "target.max_anonymous_sessions");
        check(self.max_queues_per_session != other.max_queues_per_session, "target.max_queues_per_session");
        check(self.max_handshakes != other.max_handshakes, "target.max_handshakes");
        check(self.max_handshakes_per_address != other.max_handshakes_per_address, "target.max_handshakes_per_address");
        check(self.max_connections_per_address != other.max_connections_per_address, "target.max_connections_per_address");
        check(self.max_controllers != other.max_controllers, "target.max_controllers");
        check(self.max_anonymous_controllers != other.max_anonymous_controllers, "target.max_anonymous_controllers");
        check(self.max_controllers_per_host != other.max_controllers_per_host, "target.max_controllers_per_host");
        check(self.nvme_cntlid_min != other.nvme_cntlid_min, "target.nvme_cntlid_min");
        check(self.nvme_cntlid_max != other.nvme_cntlid_max, "target.nvme_cntlid_max");
        check(self.handshake_timeout != other.handshake_timeout, "target.handshake_timeout");
        check(self.fence_timeout != other.fence_timeout, "target.fence_timeout");
        check(self.idle_timeout != other.idle_timeout, "target.idle_timeout");
        check(self.transport_timeout != other.transport_timeout, "target.transport_timeout");
        check(self.frame_timeout != other.frame_timeout, "target.frame_timeout");
        check(self.session_pool_share != other.session_pool_share, "target.session_pool_share");
        check(self.host_pool_share != other.host_pool_share, "target.host_pool_share");
        check(self.chunk_wait_timeout != other.chunk_wait_timeout, "target.chunk_wait_timeout");
        check(self.readahead != other.readahead, "target.readahead");
        v
    }
}

impl Config {
    /// Reads and validates a configuration file.
    pub fn load(path: &Path) -> Result<Config> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| Error::config(format!("{}: cannot read configuration: {e}", path.display())))?;
        Config::parse(&text, &path.display().to_string())
    }

    /// Parses and validates configuration text; `source` names it in messages.
    pub fn parse(text: &str, source: &str) -> Result<Config> {
        let raw: RawConfig = toml::from_str(text).map_err(|e| Error::config(toml_error(source, text, &e)))?;
        raw.validate(source)
    }
}

/// toml's message on one line, with the position: `file: line L, column C: message`.
fn toml_error(source: &str, text: &str, e: &toml::de::Error) -> String {
    let msg = e.message().trim_end().replace('\n', " ");
    match e.span() {
        Some(span) => {
            let before = &text[..span.start.min(text.len())];
            let line = before.matches('\n').count() + 1;
            let line_start = before.rfind('\n').map_or(0, |p| p + 1);
            let col = before.len() - line_start + 1;
            let text_line = text[line_start..].lines().next().unwrap_or("").trim();
            format!("{source}: line {line}, column {col} (`{text_line}`): {msg}")
        }
        None => format!("{source}: {msg}"),
    }
}

// ---------------------------------------------------------------------------
// Raw (as written) structures.

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawConfig {
    target: RawTarget,
    #[serde(default)]
    volume: Vec<RawVolume>,
    #[serde(default)]
    host: Vec<RawHost>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawHost {
    id: String,
    key_file: Option<PathBuf>,
    nqn: Option<String>,
    dhchap_key_file: Option<PathBuf>,
    dhchap_ctrl_key_file: Option<PathBuf>,
    dhchap_hash: Option<String>,
    dhchap_dhgroup: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawTarget {
    name: Option<String>,
    listen: Vec<String>,
    nqn: Option<String>,
    reactors: Option<i64>,
    queue_depth: Option<i64>,
    max_io_size: Option<RawSize>,
    nvme_queue_size: Option<i64>,
    inline_data_size: Option<RawSize>,
    buffer_pool: Option<RawSize>,
    chunk_size: Option<RawSize>,
    shutdown_timeout: Option<RawDuration>,
    #[serde(default)]
    sqpoll: bool,
    #[serde(default)]
    iopoll: bool,
    pin_reactors: Option<bool>,
    busy_poll: Option<RawDuration>,
    metrics: Option<String>,
    max_sessions: Option<i64>,
    max_anonymous_sessions: Option<i64>,
    max_queues_per_session: Option<i64>,
    max_handshakes: Option<i64>,
    max_handshakes_per_address: Option<i64>,
    max_connections_per_address: Option<i64>,
    max_controllers: Option<i64>,
    max_anonymous_controllers: Option<i64>,
    max_controllers_per_host: Option<i64>,
    nvme_cntlid_min: Option<i64>,
    nvme_cntlid_max: Option<i64>,
    handshake_timeout: Option<RawDuration>,
    fence_timeout: Option<RawDuration>,
    idle_timeout: Option<RawDuration>,
    transport_timeout: Option<RawDuration>,
    frame_timeout: Option<RawDuration>,
    session_pool_share: Option<RawSize>,
    host_pool_share: Option<RawSize>,
    chunk_wait_timeout: Option<RawDuration>,
    readahead: Option<RawSize>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawVolume {
    name: String,
    backend: BackendKind,
    path: Option<PathBuf>,
    size: Option<RawSize>,
    block_size: Option<RawSize>,
    #[serde(default)]
    read_only: bool,
    nsid: Option<i64>,
    #[serde(default)]
    allow_any_host: bool,
    #[serde(default)]
    allowed_hosts: Vec<String>,
    #[serde(default)]
    read_only_hosts: Vec<String>,
    pool: Option<String>,
    namespace: Option<String>,
    image: Option<String>,
    ceph_conf: Option<PathBuf>,
    client: Option<String>,
    keyring: Option<PathBuf>,
    lock_at_start: Option<bool>,
}

/// A size as written: an integer or a string with a suffix. Parsed during
/// validation so that errors can name the key.
enum RawSize {
    Int(i64),
    Str(String),
}

impl<'de> Deserialize<'de> for RawSize {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = RawSize;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a size: an integer number of bytes or a string such as \"4KiB\"")
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> std::result::Result<RawSize, E> {
                Ok(RawSize::Int(v))
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> std::result::Result<RawSize, E> {
                Ok(RawSize::Int(i64::try_from(v).unwrap_or(i64::MAX)))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> std::result::Result<RawSize, E> {
                Ok(RawSize::Str(v.to_owned()))
            }
        }
        d.deserialize_any(V)
    }
}

/// A duration as written: an integer number of seconds or a string such as "10s".
enum RawDuration {
    Int(i64),
    Str(String),
}

impl<'de> Deserialize<'de> for RawDuration {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = RawDuration;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a duration: an integer number of seconds or a string such as \"10s\" or \"500ms\"")
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> std::result::Result<RawDuration, E> {
                Ok(RawDuration::Int(v))
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> std::result::Result<RawDuration, E> {
                Ok(RawDuration::Int(i64::try_from(v).unwrap_or(i64::MAX)))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> std::result::Result<RawDuration, E> {
                Ok(RawDuration::Str(v.to_owned()))
            }
        }
        d.deserialize_any(V)
    }
}

/// Parses `N`, `Nus`, `Nms`, `Ns`, `Nm`, `Nh`.
pub fn parse_duration(s: &str) -> std::result::Result<Duration, String> {
    let t = s.trim();
    let end = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    if end == 0 {
        return Err(format!("invalid duration {s:?}: expected a number"));
    }
    let n: u64 = t[..end].parse().map_err(|_| format!("invalid duration {s:?}: number too large"))?;
    let d = match t[end..].trim() {
        "" | "s" => Duration::from_secs(n),
        "us" | "µs" => Duration::from_micros(n),
        "ms" => Duration::from_millis(n),
        "m" | "min" => Duration::from_secs(n.saturating_mul(60)),
        "h" => Duration::from_secs(n.saturating_mul(3600)),
        _ => return Err(format!("invalid duration {s:?}: unknown unit (use us, ms, s, m or h)")),
    };
    Ok(d)
}

/// Whether two TCP listen addresses would bind the same port: the same
/// non-zero port (0 picks a free one each time) on the same address, or on
/// any address where either is a wildcard (`0.0.0.0`, or `::`, which also
/// takes IPv4 unless the host set `bindv6only`).
fn same_port(a: &FabricUrl, b: &FabricUrl) -> bool {
    let wildcard = |h: &str| h.parse::<std::net::IpAddr>().is_ok_and(|ip| ip.is_unspecified());
    a.provider == b.provider && a.port != 0 && a.port == b.port && (a.host == b.host || wildcard(&a.host) || wildcard(&b.host))
}

struct Ctx<'a> {
    source: &'a str,
}

impl Ctx<'_> {
    fn err(&self, key: &str, reason: impl fmt::Display) -> Error {
        Error::config(format!("{}: {key}: {reason}", self.source))
    }

    fn size(&self, key: &str, raw: Option<RawSize>, default: u64) -> Result<u64> {
        match raw {
            None => Ok(default),
            Some(RawSize::Int(v)) if v < 0 => Err(self.err(key, format!("must not be negative (got {v})"))),
            Some(RawSize::Int(v)) => Ok(v as u64),
            Some(RawSize::Str(s)) => ByteSize::parse(&s).map(|b| b.0).map_err(|e| self.err(key, e)),
        }
    }

    fn size_u32(&self, key: &str, raw: Option<RawSize>, default: u32) -> Result<u32> {
        let v = self.size(key, raw, default as u64)?;
        u32::try_from(v).map_err(|_| self.err(key, format!("{} is too large (at most 4GiB - 1)", ByteSize(v))))
    }

    fn count(&self, key: &str, raw: Option<i64>, default: u32) -> Result<u32> {
        match raw {
            None => Ok(default),
            Some(n) if (1..=MAX_COUNT_LIMIT as i64).contains(&n) => Ok(n as u32),
            Some(n) => Err(self.err(key, format!("must be in 1..={MAX_COUNT_LIMIT} (got {n})"))),
        }
    }

    fn duration(&self, key: &str, raw: Option<RawDuration>, default: Duration) -> Result<Duration> {
        match raw {
            None => Ok(default),
            Some(RawDuration::Int(n)) if n >= 0 => Ok(Duration::from_secs(n as u64)),
            Some(RawDuration::Int(n)) => Err(self.err(key, format!("must not be negative (got {n})"))),
            Some(RawDuration::Str(s)) => parse_duration(&s).map_err(|e| self.err(key, e)),
        }
    }

    /// A pool share (`session_pool_share`, `host_pool_share`): a percentage
    /// in 1%..=100%, or a size between one chunk and the whole pool.
    fn pool_share(&self, key: &str, raw: Option<RawSize>, chunk_size: u32, buffer_pool: u64) -> Result<Option<PoolShare>> {
        let share = match raw {
            None => return Ok(None),
            Some(RawSize::Str(s)) if s.trim().ends_with('%') => {
                let digits = s.trim().trim_end_matches('%').trim();
                match digits.parse::<u8>() {
                    Ok(p) if (1..=100).contains(&p) => PoolShare::Percent(p),
                    _ => return Err(self.err(key, format!("{s:?} is not a percentage in 1%..=100%"))),
                }
            }
            Some(raw) => {
                let b = self.size(key, Some(raw), 0)?;
                if b < chunk_size as u64 || b > buffer_pool {
                    return Err(self.err(
                        key,
                        format!(
                            "{} must lie between target.chunk_size {} and target.buffer_pool {} (or be a percentage such as \"25%\")",
                            ByteSize(b),
                            ByteSize(chunk_size as u64),
                            ByteSize(buffer_pool)
                        ),
                    ));
                }
                PoolShare::Bytes(b)
            }
        };
        Ok(Some(share))
    }

    fn name(&self, key: &str, name: &str) -> Result<()> {
        if name.is_empty() {
            return Err(self.err(key, "must not be empty"));
        }
        if name.len() > MAX_NAME_LEN {
            return Err(self.err(key, format!("{name:?} is {} bytes long, at most {MAX_NAME_LEN} allowed", name.len())));
        }
        if name.contains('\0') {
            return Err(self.err(key, "must not contain NUL"));
        }
        Ok(())
    }
}

impl RawConfig {
    fn validate(self, source: &str) -> Result<Config> {
        let cx = Ctx { source };
        let t = self.target;

        let name = t.name.unwrap_or_else(|| DEFAULT_TARGET_NAME.to_owned());
        cx.name("target.name", &name)?;

        if t.listen.is_empty() {
            return Err(cx.err("target.listen", "at least one URL is required, e.g. \"tcp://127.0.0.1:7420\""));
        }
        let mut listen = Vec::with_capacity(t.listen.len());
        let mut nvme_listen: Vec<NvmeListen> = Vec::new();
        // tcp:// and nvme+tcp:// listeners both bind TCP ports, rdma:// and
        // nvme+rdma:// both rdma_cm ports (its TCP port space, separate
        // from the kernel's on RoCE and InfiniBand): two on one port would
        // fail when the target starts, so this says which. (The address,
        // whose provider tells the port space, and the entry's index.)
        let mut binds: Vec<(FabricUrl, usize)> = Vec::new();
        for (i, s) in t.listen.iter().enumerate() {
            let key = format!("target.listen[{i}]");
            let url = if s.starts_with("nvme+") {
                let l = NvmeListen::parse(s).map_err(|why| cx.err(&key, why))?;
                if nvme_listen.contains(&l) {
                    return Err(cx.err(&key, format!("{l} is listed twice")));
                }
                let url = l.url.clone();
                nvme_listen.push(l);
                url
            } else {
                let url = FabricUrl::parse(s).map_err(|e| cx.err(&key, e.context))?;
                if listen.contains(&url) {
                    return Err(cx.err(&key, format!("{url} is listed twice")));
                }
                listen.push(url.clone());
                url
            };
            if let Some(&(_, j)) = binds.iter().find(|(u, _)| same_port(u, &url)) {
                let space = if url.provider == ProviderKind::Tcp { "TCP" } else { "rdma_cm" };
                return Err(cx.err(
                    &key,
                    format!("{s:?} and target.listen[{j}] ({:?}) would share one {space} port; give each its own", t.listen[j]),
                ));
            }
            binds.push((url, i));
        }

        let reactors = match t.reactors {
            None => std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1),
            Some(n) if (1..=1024).contains(&n) => n as usize,
            Some(n) => return Err(cx.err("target.reactors", format!("must be in 1..=1024 (got {n})"))),
        };

        let queue_depth = match t.queue_depth {
            None => DEFAULT_QUEUE_DEPTH,
            Some(n) if (1..=MAX_QUEUE_DEPTH as i64).contains(&n) => n as u32,
            Some(n) => return Err(cx.err("target.queue_depth", format!("must be in 1..={MAX_QUEUE_DEPTH} (got {n})"))),
        };

        let chunk_size = cx.size_u32("target.chunk_size", t.chunk_size, DEFAULT_CHUNK_SIZE)?;
        if chunk_size == 0 || chunk_size % PAGE != 0 || chunk_size > MAX_CHUNK_SIZE {
            return Err(cx.err(
                "target.chunk_size",
                format!("must be a non-zero multiple of 4096 of at most {} (got {chunk_size})", ByteSize(MAX_CHUNK_SIZE as u64)),
            ));
        }

        let max_io_size = cx.size_u32("target.max_io_size", t.max_io_size, DEFAULT_MAX_IO_SIZE)?;
        if max_io_size == 0 || max_io_size % PAGE != 0 {
            return Err(cx.err("target.max_io_size", format!("must be a non-zero multiple of 4096 (got {max_io_size})")));
        }
        if max_io_size < chunk_size {
            return Err(cx.err(
                "target.max_io_size",
                format!("{} is smaller than target.chunk_size {}", ByteSize(max_io_size as u64), ByteSize(chunk_size as u64)),
            ));
        }
        if max_io_size > MAX_MAX_IO_SIZE {
            return Err(cx.err("target.max_io_size", format!("must be at most {}", ByteSize(MAX_MAX_IO_SIZE as u64))));
        }

        let nvme_queue_size = match t.nvme_queue_size {
            None => DEFAULT_NVME_QUEUE_SIZE,
            Some(n) if (MIN_NVME_QUEUE_SIZE as i64..=MAX_NVME_QUEUE_SIZE as i64).contains(&n) => n as u32,
            Some(n) => {
                return Err(cx.err(
                    "target.nvme_queue_size",
                    format!("must be in {MIN_NVME_QUEUE_SIZE}..={MAX_NVME_QUEUE_SIZE} (got {n})"),
                ))
            }
        };

        let inline_data_size = cx.size_u32("target.inline_data_size", t.inline_data_size, DEFAULT_INLINE_DATA_SIZE)?;
        if inline_data_size > chunk_size {
            return Err(cx.err(
                "target.inline_data_size",
                format!("{} is larger than target.chunk_size {}", ByteSize(inline_data_size as u64), ByteSize(chunk_size as u64)),
            ));
        }
        if inline_data_size > 64 << 10 {
            return Err(cx.err("target.inline_data_size", format!("must be at most 64KiB (got {})", ByteSize(inline_data_size as u64))));
        }

        let buffer_pool = cx.size("target.buffer_pool", t.buffer_pool, DEFAULT_BUFFER_POOL)?;
        if buffer_pool == 0 || buffer_pool % chunk_size as u64 != 0 {
            return Err(cx.err(
                "target.buffer_pool",
                format!("must be a non-zero multiple of target.chunk_size {} (got {})", ByteSize(chunk_size as u64), ByteSize(buffer_pool)),
            ));
        }
        let chunks = buffer_pool / chunk_size as u64;
        if chunks > MAX_POOL_CHUNKS {
            return Err(cx.err(
                "target.buffer_pool",
                format!("{} makes {chunks} chunks of {}; io_uring allows at most {MAX_POOL_CHUNKS}", ByteSize(buffer_pool), ByteSize(chunk_size as u64)),
            ));
        }

        let shutdown_timeout = cx.duration("target.shutdown_timeout", t.shutdown_timeout, DEFAULT_SHUTDOWN_TIMEOUT)?;

        let max_sessions = cx.count("target.max_sessions", t.max_sessions, DEFAULT_MAX_SESSIONS)?;
        let max_anonymous_sessions = cx.count("target.max_anonymous_sessions", t.max_anonymous_sessions, max_sessions)?;
        if max_anonymous_sessions > max_sessions {
            return Err(cx.err(
                "target.max_anonymous_sessions",
                format!("{max_anonymous_sessions} is more than target.max_sessions {max_sessions}"),
            ));
        }
        let max_queues_per_session =
            cx.count("target.max_queues_per_session", t.max_queues_per_session, DEFAULT_MAX_QUEUES_PER_SESSION)?;
        let max_handshakes = cx.count("target.max_handshakes", t.max_handshakes, DEFAULT_MAX_HANDSHAKES)?;
        let default_per_address = DEFAULT_MAX_HANDSHAKES_PER_ADDRESS.min(max_handshakes);
        let max_handshakes_per_address =
            cx.count("target.max_handshakes_per_address", t.max_handshakes_per_address, default_per_address)?;
        if max_handshakes_per_address > max_handshakes {
            return Err(cx.err(
                "target.max_handshakes_per_address",
                format!("{max_handshakes_per_address} is above target.max_handshakes ({max_handshakes})"),
            ));
        }
        let handshake_timeout = cx.duration("target.handshake_timeout", t.handshake_timeout, DEFAULT_HANDSHAKE_TIMEOUT)?;
        if handshake_timeout < Duration::from_millis(100) || handshake_timeout > Duration::from_secs(3600) {
            return Err(cx.err(
                "target.handshake_timeout",
                format!("must be between 100ms and 1h (got {handshake_timeout:?})"),
            ));
        }
        let fence_timeout = cx.duration("target.fence_timeout", t.fence_timeout, DEFAULT_FENCE_TIMEOUT)?;
        if fence_timeout < Duration::from_millis(100) || fence_timeout > Duration::from_secs(3600) {
            return Err(cx.err("target.fence_timeout", format!("must be between 100ms and 1h (got {fence_timeout:?})")));
        }
        let idle_timeout = cx.duration("target.idle_timeout", t.idle_timeout, DEFAULT_IDLE_TIMEOUT)?;
        if idle_timeout < Duration::from_secs(1) || idle_timeout > Duration::from_secs(86400) {
            return Err(cx.err("target.idle_timeout", format!("must be between 1s and 24h (got {idle_timeout:?})")));
        }
        // Below a second, an initiator's idle queue, polled by its monitor
        // at least twice a second, would be cut off (see the fabric's default).
        let transport_timeout =
            cx.duration("target.transport_timeout", t.transport_timeout, DEFAULT_TRANSPORT_TIMEOUT)?;
        if transport_timeout < Duration::from_secs(1) || transport_timeout > Duration::from_secs(3600) {
            return Err(cx.err(
                "target.transport_timeout",
                format!("must be between 1s and 1h (got {transport_timeout:?})"),
            ));
        }
        let frame_timeout = cx.duration("target.frame_timeout", t.frame_timeout, DEFAULT_FRAME_TIMEOUT)?;
        if frame_timeout < Duration::from_secs(1) || frame_timeout > Duration::from_secs(3600) {
            return Err(cx.err("target.frame_timeout", format!("must be between 1s and 1h (got {frame_timeout:?})")));
        }
        let max_connections_per_address = cx.count(
            "target.max_connections_per_address",
            t.max_connections_per_address,
            DEFAULT_MAX_CONNECTIONS_PER_ADDRESS,
        )?;
        let max_controllers = cx.count("target.max_controllers", t.max_controllers, DEFAULT_MAX_CONTROLLERS)?;
        let max_anonymous_controllers = cx.count("target.max_anonymous_controllers", t.max_anonymous_controllers, max_controllers)?;
        if max_anonymous_controllers > max_controllers {
            return Err(cx.err(
                "target.max_anonymous_controllers",
                format!("{max_anonymous_controllers} is more than target.max_controllers {max_controllers}"),
            ));
        }
        let max_controllers_per_host =
            cx.count("target.max_controllers_per_host", t.max_controllers_per_host, DEFAULT_MAX_CONTROLLERS_PER_HOST)?;
        let cntlid = |key: &str, raw: Option<i64>, default: u16| -> Result<u16> {
            match raw {
                None => Ok(default),
                Some(n) if (MIN_CNTLID as i64..=MAX_CNTLID as i64).contains(&n) => Ok(n as u16),
                Some(n) => Err(cx.err(key, format!("must be in {MIN_CNTLID}..={MAX_CNTLID} (0x{MAX_CNTLID:x}; got {n})"))),
            }
        };
        let nvme_cntlid_min = cntlid("target.nvme_cntlid_min", t.nvme_cntlid_min, MIN_CNTLID)?;
        let nvme_cntlid_max = cntlid("target.nvme_cntlid_max", t.nvme_cntlid_max, MAX_CNTLID)?;
        if nvme_cntlid_max < nvme_cntlid_min {
            return Err(cx.err("target.nvme_cntlid_max", format!("{nvme_cntlid_max} is below target.nvme_cntlid_min {nvme_cntlid_min}")));
        }
        let pool_chunks = chunks as u32;
        let session_pool_share =
            cx.pool_share("target.session_pool_share", t.session_pool_share, chunk_size, buffer_pool)?.unwrap_or(DEFAULT_SESSION_POOL_SHARE);
        let session_chunks = session_pool_share.chunks(pool_chunks, chunk_size);
        let host_pool_share = match cx.pool_share("target.host_pool_share", t.host_pool_share, chunk_size, buffer_pool)? {
            Some(h) if h.chunks(pool_chunks, chunk_size) < session_chunks => {
                return Err(cx.err(
                    "target.host_pool_share",
                    format!(
                        "{h} ({} chunks of each reactor's {pool_chunks}) is below target.session_pool_share {session_pool_share} ({session_chunks} chunks): one session of a host would be held to the host's share",
                        h.chunks(pool_chunks, chunk_size)
                    ),
                ))
            }
            Some(h) => h,
            // The default never falls below the session share.
            None if DEFAULT_HOST_POOL_SHARE.chunks(pool_chunks, chunk_size) < session_chunks => session_pool_share,
            None => DEFAULT_HOST_POOL_SHARE,
        };

        let chunk_wait_timeout = cx.duration("target.chunk_wait_timeout", t.chunk_wait_timeout, DEFAULT_CHUNK_WAIT_TIMEOUT)?;
        if chunk_wait_timeout < Duration::from_millis(100) || chunk_wait_timeout > Duration::from_secs(3600) {
            return Err(cx.err("target.chunk_wait_timeout", format!("must be between 100ms and 1h (got {chunk_wait_timeout:?})")));
        }

        let readahead = cx.size("target.readahead", t.readahead, DEFAULT_READAHEAD)?;
        if readahead != 0 && (readahead < chunk_size as u64 || readahead > MAX_READAHEAD) {
            return Err(cx.err(
                "target.readahead",
                format!(
                    "must be 0 (off) or between target.chunk_size {} and {} (got {})",
                    ByteSize(chunk_size as u64),
                    ByteSize(MAX_READAHEAD),
                    ByteSize(readahead)
                ),
            ));
        }

        let busy_poll = match t.busy_poll {
            None => Duration::ZERO,
            Some(RawDuration::Int(n)) if n >= 0 => Duration::from_secs(n as u64),
            Some(RawDuration::Int(n)) => return Err(cx.err("target.busy_poll", format!("must not be negative (got {n})"))),
            Some(RawDuration::Str(s)) => parse_duration(&s).map_err(|e| cx.err("target.busy_poll", e))?,
        };
        if busy_poll > MAX_BUSY_POLL {
            return Err(cx.err("target.busy_poll", format!("{busy_poll:?} is more than the maximum, {MAX_BUSY_POLL:?}")));
        }

        let metrics = match t.metrics {
            None => None,
            Some(s) if s.is_empty() => None,
            Some(s) => Some(s.parse::<SocketAddr>().map_err(|_| {
                cx.err("target.metrics", format!("{s:?} is not an address:port such as \"127.0.0.1:9420\""))
            })?),
        };

        let nqn = match t.nqn {
            None => format!("{DEFAULT_NQN_PREFIX}{name}"),
            Some(n) => {
                if n.len() > rdmablk_common::nvme::fabrics::NQN_MAX || !n.starts_with("nqn.") || n.contains('\0') {
                    return Err(cx.err(
                        "target.nqn",
                        format!("{n:?} is not an NQN: \"nqn.\" followed by a reverse domain, at most {} bytes", rdmablk_common::nvme::fabrics::NQN_MAX),
                    ));
                }
                if n == rdmablk_common::nvme::fabrics::DISCOVERY_NQN {
                    return Err(cx.err("target.nqn", "is the well-known discovery NQN, which a subsystem cannot use"));
                }
                n
            }
        };
        let target = TargetConfig {
            name,
            listen,
            nvme_listen,
            nqn,
            reactors,
            queue_depth,
            max_io_size,
            nvme_queue_size,
            inline_data_size,
            buffer_pool,
            chunk_size,
            shutdown_timeout,
            sqpoll: t.sqpoll,
            iopoll: t.iopoll,
            pin_reactors: t.pin_reactors.unwrap_or(!busy_poll.is_zero() || t.iopoll),
            busy_poll,
            metrics,
            max_sessions,
            max_anonymous_sessions,
            max_queues_per_session,
            max_handshakes,
            max_handshakes_per_address,
            max_connections_per_address,
            max_controllers,
            max_anonymous_controllers,
            max_controllers_per_host,
            nvme_cntlid_min,
            nvme_cntlid_max,
            handshake_timeout,
            fence_timeout,
            idle_timeout,
            transport_timeout,
            frame_timeout,
            session_pool_share,
            host_pool_share,
            chunk_wait_timeout,
            readahead,
        };

        if self.volume.is_empty() {
            return Err(cx.err("volume", "no [[volume]] is defined"));
        }
        if self.volume.len() > MAX_VOLUMES {
            return Err(cx.err("volume", format!("{} volumes; at most {MAX_VOLUMES} are served", self.volume.len())));
        }
        let hosts = validate_hosts(&cx, self.host)?;
        let mut names = HashSet::new();
        let mut paths = HashSet::new();
        let mut volumes = Vec::with_capacity(self.volume.len());
        let mut access = Vec::with_capacity(self.volume.len());
        for (index, mut v) in self.volume.into_iter().enumerate() {
            let key = |k: &str| format!("volume[{index}].{k}");
            let mut rbd_keys = v_rbd_keys(&mut v);
            cx.name(&key("name"), &v.name)?;
            for (list, ids) in [("allowed_hosts", &v.allowed_hosts), ("read_only_hosts", &v.read_only_hosts)] {
                for (i, id) in ids.iter().enumerate() {
                    if !hosts.iter().any(|h| &h.id == id) {
                        return Err(cx.err(
                            &key(&format!("{list}[{i}]")),
                            format!("{id:?} is not the id of any [[host]]; define it with id and key_file"),
                        ));
                    }
                    if ids[..i].contains(id) {
                        return Err(cx.err(&key(&format!("{list}[{i}]")), format!("{id:?} is listed twice")));
                    }
                }
            }
            access.push(VolumeAccess {
                volume: v.name.clone(),
                allow_any_host: v.allow_any_host,
                allowed_hosts: v.allowed_hosts,
                read_only_hosts: v.read_only_hosts,
            });
            if !names.insert(v.name.clone()) {
                return Err(cx.err(&key("name"), format!("{:?} is used by an earlier volume", v.name)));
            }
            let path = match (v.backend, v.path) {
                (BackendKind::File, None) => return Err(cx.err(&key("path"), "is required for backend \"file\"")),
                (BackendKind::File, Some(p)) => {
                    if p.as_os_str().is_empty() {
                        return Err(cx.err(&key("path"), "must not be empty"));
                    }
                    if !paths.insert(p.clone()) {
                        return Err(cx.err(&key("path"), format!("{} is used by an earlier volume", p.display())));
                    }
                    p
                }
                (b, Some(_)) => return Err(cx.err(&key("path"), format!("is not used by backend \"{b}\"; remove it"))),
                (_, None) => PathBuf::new(),
            };
            if target.iopoll && v.backend == BackendKind::Memory {
                return Err(cx.err(
                    &key("backend"),
                    "\"memory\" cannot be served on a polled ring (target.iopoll = true needs NVMe poll queues)",
                ));
            }
            let block_size = match v.block_size {
                None => None,
                Some(raw) => {
                    let bs = cx.size(&key("block_size"), Some(raw), 0)?;
                    if !(512..=65536).contains(&bs) || !bs.is_power_of_two() {
                        return Err(cx.err(&key("block_size"), format!("must be a power of two in 512..=65536 (got {bs})")));
                    }
                    Some(bs as u32)
                }
            };
            let size = match v.size {
                None => None,
                Some(raw) => {
                    let s = cx.size(&key("size"), Some(raw), 0)?;
                    if s == 0 {
                        return Err(cx.err(&key("size"), "must not be zero"));
                    }
                    if let Some(bs) = block_size {
                        if s % bs as u64 != 0 {
                            return Err(cx.err(&key("size"), format!("{s} is not a multiple of block_size {bs}")));
                        }
                    }
                    Some(s)
                }
            };
            let rbd = validate_rbd(&cx, index, &mut rbd_keys)?;
            if v.backend == BackendKind::Rbd && rbd.is_none() {
                return Err(cx.err(&key("image"), "is required for backend \"rbd\" (with pool)"));
            }
            if size.is_none() && !matches!(v.backend, BackendKind::File | BackendKind::Rbd) {
                return Err(cx.err(&key("size"), format!("is required for backend \"{}\"", v.backend)));
            }
            let nsid = match v.nsid {
                None => None,
                Some(n) if (1..=MAX_NSID as i64).contains(&n) => {
                    if let Some(o) = volumes.iter().find(|o: &&VolumeConfig| o.nsid == Some(n as u32)) {
                        return Err(cx.err(&key("nsid"), format!("{n} is used by volume {:?}", o.name)));
                    }
                    Some(n as u32)
                }
                Some(n) => return Err(cx.err(&key("nsid"), format!("must be in 1..={MAX_NSID} (got {n})"))),
            };
            volumes.push(VolumeConfig {
                index,
                name: v.name,
                backend: v.backend,
                path,
                size,
                block_size,
                read_only: v.read_only,
                nsid,
                rbd: if v.backend == BackendKind::Rbd { rbd } else { None },
            });
        }

        Ok(Config { source: source.to_owned(), target, volumes, hosts, access })
    }
}

/// A `[[volume]]`'s rbd keys, taken out of it.
struct RbdKeys {
    backend: BackendKind,
    pool: Option<String>,
    namespace: Option<String>,
    image: Option<String>,
    ceph_conf: Option<PathBuf>,
    client: Option<String>,
    keyring: Option<PathBuf>,
    lock_at_start: Option<bool>,
}

fn v_rbd_keys(v: &mut RawVolume) -> RbdKeys {
    RbdKeys {
        backend: v.backend,
        pool: v.pool.take(),
        namespace: v.namespace.take(),
        image: v.image.take(),
        ceph_conf: v.ceph_conf.take(),
        client: v.client.take(),
        keyring: v.keyring.take(),
        lock_at_start: v.lock_at_start.take(),
    }
}

/// The rbd keys of volume `index`: required for backend "rbd", refused for the others.
fn validate_rbd(cx: &Ctx<'_>, index: usize, k: &mut RbdKeys) -> Result<Option<RbdConfig>> {
    let key = |k: &str| format!("volume[{index}].{k}");
    if k.backend != BackendKind::Rbd {
        let given = [
            ("pool", k.pool.is_some()),
            ("namespace", k.namespace.is_some()),
            ("image", k.image.is_some()),
            ("ceph_conf", k.ceph_conf.is_some()),
            ("client", k.client.is_some()),
            ("keyring", k.keyring.is_some()),
            ("lock_at_start", k.lock_at_start.is_some()),
        ];
        if let Some((name, _)) = given.iter().find(|(_, g)| *g) {
            return Err(cx.err(&key(name), format!("is used by backend \"rbd\" only, not \"{}\"; remove it", k.backend)));
        }
        return Ok(None);
    }
    // Ceph's own rules for pool and image names: no '/' or '@' (they
    // separate pool, namespace, image and snapshot in a spec), not empty.
    let name = |what: &str, v: Option<String>, required: bool| -> Result<Option<String>> {
        match v {
            None if required => Err(cx.err(&key(what), "is required for backend \"rbd\"")),
            None => Ok(None),
            Some(s) if s.is_empty() || s.contains(['/', '@', '\0']) => {
                Err(cx.err(&key(what), format!("{s:?} is not a valid name (not empty, no '/', '@' or NUL)")))
            }
            Some(s) => Ok(Some(s)),
        }
    };
    let pool = name("pool", k.pool.take(), true)?.expect("required");
    let image = name("image", k.image.take(), true)?.expect("required");
    let namespace = name("namespace", k.namespace.take(), false)?.unwrap_or_default();
    let client = match k.client.take() {
        None => "admin".to_owned(),
        Some(c) if c.starts_with("client.") => {
            return Err(cx.err(&key("client"), format!("{c:?}: give the user without \"client.\" (as `rbd --id` takes it)")))
        }
        Some(c) => name("client", Some(c), true)?.expect("given"),
    };
    for (what, p) in [("ceph_conf", &k.ceph_conf), ("keyring", &k.keyring)] {
        if let Some(p) = p {
            if p.as_os_str().is_empty() {
                return Err(cx.err(&key(what), "must not be empty"));
            }
        }
    }
    Ok(Some(RbdConfig {
        pool,
        namespace,
        image,
        ceph_conf: k.ceph_conf.take(),
        client,
        keyring: k.keyring.take(),
        lock_at_start: k.lock_at_start.unwrap_or(false),
    }))
}

/// `[[host]] dhchap_*`: a key file needs the host's `nqn`; a controller
/// key, hash or group needs a key file.
fn validate_dhchap(cx: &Ctx<'_>, index: usize, h: &RawHost) -> Result<Option<DhchapConfig>> {
    use rdmablk_common::nvme::auth::{DhGroup, HashId};
    let key = |k: &str| format!("host[{index}].{k}");
    let Some(key_file) = &h.dhchap_key_file else {
        for (k, set) in [
            ("dhchap_ctrl_key_file", h.dhchap_ctrl_key_file.is_some()),
            ("dhchap_hash", h.dhchap_hash.is_some()),
            ("dhchap_dhgroup", h.dhchap_dhgroup.is_some()),
        ] {
            if set {
                return Err(cx.err(&key(k), "needs dhchap_key_file (the host's DH-HMAC-CHAP secret)"));
            }
        }
        return Ok(None);
    };
    if h.nqn.is_none() {
        return Err(cx.err(&key("dhchap_key_file"), "needs nqn (the NVMe host NQN that authenticates with it)"));
    }
    for (k, p) in [("dhchap_key_file", Some(key_file)), ("dhchap_ctrl_key_file", h.dhchap_ctrl_key_file.as_ref())] {
        if p.is_some_and(|p| p.as_os_str().is_empty()) {
            return Err(cx.err(&key(k), "must not be empty"));
        }
    }
    let hash = match h.dhchap_hash.as_deref() {
        None => HashId::Sha256,
        Some(n) => HashId::from_name(n)
            .ok_or_else(|| cx.err(&key("dhchap_hash"), format!("{n:?} is not one of \"sha256\", \"sha384\", \"sha512\"")))?,
    };
    let dh_group = match h.dhchap_dhgroup.as_deref() {
        None => DhGroup::Ffdhe2048,
        Some(n) => DhGroup::from_name(n).ok_or_else(|| {
            cx.err(&key("dhchap_dhgroup"), format!("{n:?} is not one of \"null\", \"ffdhe2048\" ... \"ffdhe8192\""))
        })?,
    };
    Ok(Some(DhchapConfig { key_file: key_file.clone(), ctrl_key_file: h.dhchap_ctrl_key_file.clone(), hash, dh_group }))
}

fn validate_hosts(cx: &Ctx<'_>, raw: Vec<RawHost>) -> Result<Vec<HostConfig>> {
    let mut hosts: Vec<HostConfig> = Vec::with_capacity(raw.len());
    for (index, h) in raw.into_iter().enumerate() {
        let key = |k: &str| format!("host[{index}].{k}");
        let dhchap = validate_dhchap(cx, index, &h)?;
        if h.id.is_empty() {
            return Err(cx.err(&key("id"), "must not be empty"));
        }
        if h.id.len() > MAX_HOST_ID_LEN || h.id.contains('\0') {
            return Err(cx.err(&key("id"), format!("must be at most {MAX_HOST_ID_LEN} bytes of UTF-8 without NUL")));
        }
        if hosts.iter().any(|o| o.id == h.id) {
            return Err(cx.err(&key("id"), format!("{:?} is used by an earlier [[host]]", h.id)));
        }
        let key_file = match h.key_file {
            Some(p) if p.as_os_str().is_empty() => return Err(cx.err(&key("key_file"), "must not be empty")),
            Some(p) => Some(p),
            // An NVMe-oF host authenticates with nothing this target checks
            // (see SECURITY.md): its NQN alone names it.
            None if h.nqn.is_some() => None,
            None => {
                return Err(cx.err(
                    &key("key_file"),
                    "is required unless the host has an nqn (create one with `rdmablk keygen PATH`)",
                ))
            }
        };
        if let Some(n) = &h.nqn {
            if n.len() > rdmablk_common::nvme::fabrics::NQN_MAX || !n.starts_with("nqn.") || n.contains('\0') {
                return Err(cx.err(&key("nqn"), format!("{n:?} is not an NQN (\"nqn.\" ..., at most {} bytes)", rdmablk_common::nvme::fabrics::NQN_MAX)));
            }
            if hosts.iter().any(|o| o.nqn.as_ref() == Some(n)) {
                return Err(cx.err(&key("nqn"), format!("{n:?} is used by an earlier [[host]]")));
            }
        }
        hosts.push(HostConfig { index, id: h.id, key_file, nqn: h.nqn, dhchap });
    }
    Ok(hosts)
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = r#"
[target]
name = "t1"
listen = ["tcp://127.0.0.1:7420", "tcp://[::1]:0"]
reactors = 2
queue_depth = 64
max_io_size = "1MiB"
inline_data_size = "4KiB"
buffer_pool = "8MiB"
chunk_size = "128KiB"
shutdown_timeout = "2s"

[[volume]]
name = "vol0"
backend = "file"
path = "/tmp/vol0.img"
size = "1GiB"
block_size = 4096

[[volume]]
name = "vol1"
backend = "file"
path = "/dev/loop0"
read_only = true
"#;

    fn err(text: &str) -> String {
        Config::parse(text, "test.toml").unwrap_err().to_string()
    }

    fn with_target(extra: &str) -> String {
        format!(
            "[target]\nlisten = [\"tcp://127.0.0.1:0\"]\n{extra}\n[[volume]]\nname = \"v\"\nbackend = \"file\"\npath = \"/tmp/x\"\nsize = 4096\n"
        )
    }

    #[test]
    fn an_rbd_volume_takes_its_image_and_ceph_identity_and_the_other_backends_refuse_those_keys() {
        let vol = |body: &str| format!("[target]\nlisten=[\"tcp://h:1\"]\n[[volume]]\nname=\"r\"\n{body}\n");
        let c = Config::parse(
            &vol("backend=\"rbd\"\npool=\"rbd\"\nnamespace=\"ns1\"\nimage=\"img\"\nceph_conf=\"/etc/ceph/c.conf\"\nclient=\"gw\"\nkeyring=\"/k\"\nlock_at_start=true\nsize=\"1GiB\""),
            "t",
        )
        .unwrap();
        let r = c.volumes[0].rbd.as_ref().unwrap();
        assert_eq!((r.spec().as_str(), r.client.as_str(), r.lock_at_start), ("rbd/ns1/img", "gw", true));
        assert_eq!((r.ceph_conf.as_deref(), r.keyring.as_deref()), (Some(Path::new("/etc/ceph/c.conf")), Some(Path::new("/k"))));
        assert_eq!(c.volumes[0].size, Some(1 << 30));
        // Defaults: client.admin, the default namespace, standby, the image's own size.
        let c = Config::parse(&vol("backend=\"rbd\"\npool=\"p\"\nimage=\"i\""), "t").unwrap();
        let r = c.volumes[0].rbd.as_ref().unwrap();
        assert_eq!((r.spec().as_str(), r.client.as_str(), r.lock_at_start, r.ceph_conf.is_none()), ("p/i", "admin", false, true));
        assert_eq!(c.volumes[0].size, None);

        let e = err(&vol("backend=\"rbd\"\npool=\"p\""));
        assert!(e.contains("volume[0].image: is required for backend \"rbd\""), "{e}");
        let e = err(&vol("backend=\"rbd\"\nimage=\"i\""));
        assert!(e.contains("volume[0].pool: is required for backend \"rbd\""), "{e}");
        let e = err(&vol("backend=\"rbd\"\npool=\"p\"\nimage=\"a/b\""));
        assert!(e.contains("volume[0].image: \"a/b\" is not a valid name"), "{e}");
        let e = err(&vol("backend=\"rbd\"\npool=\"p\"\nimage=\"i\"\nclient=\"client.gw\""));
        assert!(e.contains("volume[0].client") && e.contains("without \"client.\""), "{e}");
        let e = err(&vol("backend=\"file\"\npath=\"/x\"\nimage=\"i\""));
        assert!(e.contains("volume[0].image: is used by backend \"rbd\" only, not \"file\"; remove it"), "{e}");
        let e = err(&vol("backend=\"memory\"\nsize=4096\nlock_at_start=true"));
        assert!(e.contains("volume[0].lock_at_start: is used by backend \"rbd\" only"), "{e}");
    }

    #[test]
    fn parses_everything() {
        let c = Config::parse(GOOD, "test.toml").unwrap();
        assert_eq!(c.target.name, "t1");
        assert_eq!(c.target.listen.len(), 2);
        assert_eq!(c.target.listen[1].host, "::1");
        assert_eq!(c.target.reactors, 2);
        assert_eq!(c.target.queue_depth, 64);
        assert_eq!(c.target.max_io_size, 1 << 20);
        assert_eq!(c.target.inline_data_size, 4096);
        assert_eq!(c.target.buffer_pool, 8 << 20);
        assert_eq!(c.target.chunk_size, 128 << 10);
        assert_eq!(c.target.shutdown_timeout, Duration::from_secs(2));
        assert_eq!(c.volumes.len(), 2);
        assert_eq!(c.volumes[0].size, Some(1 << 30));
        assert_eq!(c.volumes[0].block_size, Some(4096));
        assert!(!c.volumes[0].read_only);
        assert_eq!(c.volumes[1].size, None);
        assert!(c.volumes[1].read_only);
        assert_eq!(c.volumes[1].key("size"), "volume[1].size");
    }

    #[test]
    fn defaults() {
        let c = Config::parse(&with_target(""), "d.toml").unwrap();
        assert_eq!(c.target.name, DEFAULT_TARGET_NAME);
        assert_eq!(c.target.queue_depth, DEFAULT_QUEUE_DEPTH);
        assert_eq!(c.target.max_io_size, DEFAULT_MAX_IO_SIZE);
        assert_eq!(c.target.inline_data_size, DEFAULT_INLINE_DATA_SIZE);
        assert_eq!(c.target.buffer_pool, DEFAULT_BUFFER_POOL);
        assert_eq!(c.target.chunk_size, DEFAULT_CHUNK_SIZE);
        assert_eq!(c.target.shutdown_timeout, DEFAULT_SHUTDOWN_TIMEOUT);
        assert!(c.target.reactors >= 1);
        assert!(!c.target.sqpoll);
        assert!(!c.target.iopoll);
        assert!(!c.target.pin_reactors, "sleeping reactors are not pinned unless told to be");
        assert_eq!(c.target.metrics, None);
        assert_eq!(c.volumes[0].size, Some(4096));
    }

    #[test]
    fn polling_reactors_are_pinned_by_default_and_the_setting_wins() {
        let pinned = |extra: &str| Config::parse(&with_target(extra), "p").unwrap().target.pin_reactors;
        assert!(!pinned(""));
        assert!(!pinned("busy_poll = \"0us\""));
        assert!(pinned("busy_poll = \"1ms\""));
        assert!(pinned("iopoll = true"));
        assert!(!pinned("busy_poll = \"1ms\"\npin_reactors = false"));
        assert!(pinned("pin_reactors = true"));
    }

    #[test]
    fn memory_and_null_backends() {
        let text = "[target]\nlisten=[\"tcp://h:1\"]\nmetrics = \"127.0.0.1:9420\"\npin_reactors = false\n\
                    [[volume]]\nname=\"m\"\nbackend=\"memory\"\nsize=\"64MiB\"\n\
                    [[volume]]\nname=\"n\"\nbackend=\"null\"\nsize=\"1GiB\"\nblock_size=512\n";
        let c = Config::parse(text, "m.toml").unwrap();
        assert_eq!(c.target.metrics, Some("127.0.0.1:9420".parse().unwrap()));
        assert!(!c.target.pin_reactors);
        assert_eq!((c.volumes[0].backend, c.volumes[0].size), (BackendKind::Memory, Some(64 << 20)));
        assert_eq!((c.volumes[1].backend, c.volumes[1].block_size), (BackendKind::Null, Some(512)));
        assert!(c.volumes[0].path.as_os_str().is_empty());

        let vol = |body: &str| format!("[target]\nlisten=[\"tcp://h:1\"]\n[[volume]]\n{body}\n");
        let e = err(&vol("name=\"m\"\nbackend=\"memory\""));
        assert!(e.contains("volume[0].size: is required for backend \"memory\""), "{e}");
        let e = err(&vol("name=\"m\"\nbackend=\"null\"\nsize=4096\npath=\"/x\""));
        assert!(e.contains("volume[0].path: is not used by backend \"null\""), "{e}");
        let e = err(&vol("name=\"f\"\nbackend=\"file\"\nsize=4096"));
        assert!(e.contains("volume[0].path: is required for backend \"file\""), "{e}");
        let e = err(&vol("name=\"m\"\nbackend=\"memory\"\nsize=4096\nblock_size=8192"));
        assert!(e.contains("volume[0].size: 4096 is not a multiple of block_size 8192"), "{e}");
        let e = err(&format!("{}iopoll = true\n[[volume]]\nname=\"m\"\nbackend=\"memory\"\nsize=4096\n", "[target]\nlisten=[\"tcp://h:1\"]\n"));
        assert!(e.contains("volume[0].backend") && e.contains("iopoll"), "{e}");
    }

    #[test]
    fn busy_poll_takes_micro_seconds_and_is_bounded() {
        assert_eq!(Config::parse(&with_target(""), "d").unwrap().target.busy_poll, Duration::ZERO);
        let c = Config::parse(&with_target("busy_poll = \"250us\""), "d").unwrap();
        assert_eq!(c.target.busy_poll, Duration::from_micros(250));
        let e = err(&with_target("busy_poll = \"20ms\""));
        assert!(e.starts_with("test.toml: target.busy_poll: 20ms is more than the maximum, 10ms"), "{e}");
        let e = err(&with_target("busy_poll = -1"));
        assert!(e.starts_with("test.toml: target.busy_poll: must not be negative"), "{e}");
        let e = err(&with_target("busy_poll = \"5 fortnights\""));
        assert!(e.contains("target.busy_poll") && e.contains("unknown unit"), "{e}");
    }

    #[test]
    fn metrics_address_errors_are_named() {
        let e = err(&with_target("metrics = \"localhost\""));
        assert!(e.starts_with("test.toml: target.metrics: \"localhost\" is not an address:port"), "{e}");
        let e = err(&with_target("metrics = 9420"));
        assert!(e.contains("test.toml") && e.contains("metrics"), "{e}");
        let c = Config::parse(&with_target("metrics = \"[::1]:0\""), "x").unwrap();
        assert_eq!(c.target.metrics.unwrap().port(), 0);
    }

    #[test]
    fn a_bad_key_anywhere_is_named_with_file_and_line() {
        let e = err(&format!("{}metric = \"127.0.0.1:1\"\n", "[target]\nlisten=[\"tcp://h:1\"]\n"));
        assert!(e.starts_with("test.toml: line 3, column 1 (`metric = \"127.0.0.1:1\"`): unknown field `metric`"), "{e}");
        let e = err(&format!("{}readonly = true\n", with_target("")));
        assert!(e.contains("test.toml: line") && e.contains("unknown field `readonly`"), "{e}");
    }

    #[test]
    fn reload_diffs() {
        let a = Config::parse(&with_target(""), "a").unwrap();
        let b = Config::parse(&with_target("queue_depth = 7\nmetrics = \"127.0.0.1:1\""), "b").unwrap();
        assert_eq!(a.target.changed_keys(&b.target), vec!["target.queue_depth", "target.metrics"]);
        assert!(a.target.changed_keys(&a.target).is_empty());
        let mut v = a.volumes[0].clone();
        v.read_only = true;
        v.index = 5;
        assert!(a.volumes[0].same_except_read_only(&v));
        v.size = Some(8192);
        assert!(!a.volumes[0].same_except_read_only(&v));
    }

    #[test]
    fn unknown_keys_are_named() {
        let e = err(&with_target("queue_dept = 4"));
        assert!(e.starts_with("test.toml: line 3, column 1 (`queue_dept = 4`): unknown field `queue_dept`"), "{e}");
        assert!(!e.contains('\n'), "one line: {e}");
        let e = err(&format!("{}mystery = 1\n", with_target("")));
        assert!(e.contains("mystery"), "{e}");
        let e = err("[target]\nlisten=[\"tcp://h:1\"]\n[extra]\n");
        assert!(e.contains("extra"), "{e}");
    }

    #[test]
    fn nvme_queue_size_has_its_default_and_bounds() {
        let c = Config::parse(&with_target(""), "t").unwrap();
        assert_eq!(c.target.nvme_queue_size, DEFAULT_NVME_QUEUE_SIZE);
        let c = Config::parse(&with_target("nvme_queue_size = 128"), "t").unwrap();
        assert_eq!(c.target.nvme_queue_size, 128);
        for bad in [0, 15, 1025] {
            let e = err(&with_target(&format!("nvme_queue_size = {bad}")));
            assert!(e.contains(&format!("target.nvme_queue_size: must be in 16..=1024 (got {bad})")), "{e}");
        }
    }

    #[test]
    fn nvme_cntlid_ranges_are_checked() {
        let c = Config::parse(&with_target(""), "t").unwrap();
        assert_eq!((c.target.nvme_cntlid_min, c.target.nvme_cntlid_max), (1, 0xffef));
        let c = Config::parse(&with_target("nvme_cntlid_min = 1000\nnvme_cntlid_max = 1999"), "t").unwrap();
        assert_eq!((c.target.nvme_cntlid_min, c.target.nvme_cntlid_max), (1000, 1999));
        let c = Config::parse(&with_target("nvme_cntlid_min = 7\nnvme_cntlid_max = 7"), "t").unwrap();
        assert_eq!((c.target.nvme_cntlid_min, c.target.nvme_cntlid_max), (7, 7), "a range of one id");
        for (key, bad) in [("nvme_cntlid_min", 0), ("nvme_cntlid_max", 0xfff0), ("nvme_cntlid_min", 65535), ("nvme_cntlid_max", -1)] {
            let e = err(&with_target(&format!("{key} = {bad}")));
            assert!(e.contains(&format!("target.{key}: must be in 1..=65519 (0xffef; got {bad})")), "{e}");
        }
        let e = err(&with_target("nvme_cntlid_min = 2000\nnvme_cntlid_max = 1999"));
        assert!(e.contains("target.nvme_cntlid_max: 1999 is below target.nvme_cntlid_min 2000"), "{e}");
        // Either bound alone: the other keeps its default.
        let c = Config::parse(&with_target("nvme_cntlid_max = 10"), "t").unwrap();
        assert_eq!((c.target.nvme_cntlid_min, c.target.nvme_cntlid_max), (1, 10));
    }

    #[test]
    fn bad_sizes_are_named() {
        let e = err(&with_target("max_io_size = \"12q\""));
        assert!(e.contains("test.toml: target.max_io_size: invalid size \"12q\""), "{e}");
        let e = err(&with_target("max_io_size = 5000"));
        assert!(e.contains("target.max_io_size: must be a non-zero multiple of 4096"), "{e}");
        let e = err(&with_target("max_io_size = \"64KiB\""));
        assert!(e.contains("target.max_io_size") && e.contains("smaller than target.chunk_size"), "{e}");
        let e = err(&with_target("chunk_size = 1000"));
        assert!(e.contains("target.chunk_size"), "{e}");
        let e = err(&with_target("buffer_pool = \"100KiB\""));
        assert!(e.contains("target.buffer_pool"), "{e}");
        let e = err(&with_target("buffer_pool = \"4GiB\"\nchunk_size = \"4KiB\"\nmax_io_size = \"4KiB\""));
        assert!(e.contains("target.buffer_pool") && e.contains("16384"), "{e}");
        let e = err(&with_target("inline_data_size = \"256KiB\""));
        assert!(e.contains("target.inline_data_size"), "{e}");
        let e = err(&with_target("queue_depth = 0"));
        assert!(e.contains("target.queue_depth: must be in 1..=4096"), "{e}");
        let e = err(&with_target("reactors = 0"));
        assert!(e.contains("target.reactors"), "{e}");
        let e = err(&with_target("shutdown_timeout = \"10 parsecs\""));
        assert!(e.contains("target.shutdown_timeout"), "{e}");
        let e = err(&with_target("max_io_size = -4096"));
        assert!(e.contains("target.max_io_size: must not be negative"), "{e}");
        let e = err(&with_target("max_io_size = true"));
        assert!(e.contains("test.toml") && e.contains("max_io_size"), "{e}");
    }

    #[test]
    fn volume_errors_are_named() {
        let vol = |body: &str| format!("[target]\nlisten=[\"tcp://h:1\"]\n[[volume]]\nname=\"a\"\nbackend=\"file\"\npath=\"/a\"\n[[volume]]\n{body}\n");
        let e = err(&vol("name=\"b\"\nbackend=\"file\"\npath=\"/b\"\nsize=\"1000\"\nblock_size=512"));
        assert!(e.contains("volume[1].size: 1000 is not a multiple of block_size 512"), "{e}");
        let e = err(&vol("name=\"b\"\nbackend=\"file\"\npath=\"/b\"\nblock_size=1000"));
        assert!(e.contains("volume[1].block_size: must be a power of two in 512..=65536"), "{e}");
        let e = err(&vol("name=\"b\"\nbackend=\"file\"\npath=\"/b\"\nblock_size=\"128KiB\""));
        assert!(e.contains("volume[1].block_size"), "{e}");
        let e = err(&vol("name=\"a\"\nbackend=\"file\"\npath=\"/b\""));
        assert!(e.contains("volume[1].name: \"a\" is used by an earlier volume"), "{e}");
        let many: String = (0..=MAX_VOLUMES).map(|i| format!("[[volume]]\nname=\"n{i}\"\nbackend=\"null\"\nsize=4096\n")).collect();
        let e = err(&format!("[target]\nlisten=[\"tcp://h:1\"]\n{many}"));
        assert!(e.contains("volume: 257 volumes; at most 256"), "{e}");
        let e = err(&vol("name=\"b\"\nbackend=\"file\"\npath=\"/a\""));
        assert!(e.contains("volume[1].path"), "{e}");
        let e = err(&vol("name=\"\"\nbackend=\"file\"\npath=\"/b\""));
        assert!(e.contains("volume[1].name: must not be empty"), "{e}");
        let long = "x".repeat(65);
        let e = err(&vol(&format!("name=\"{long}\"\nbackend=\"file\"\npath=\"/b\"")));
        assert!(e.contains("volume[1].name") && e.contains("at most 64"), "{e}");
        let e = err(&vol("name=\"b\"\nbackend=\"tape\"\npath=\"/b\""));
        assert!(e.contains("tape") && e.contains("file") && e.contains("memory") && e.contains("null"), "{e}");
        let e = err(&vol("name=\"b\"\nbackend=\"file\"\npath=\"/b\"\nsize=0"));
        assert!(e.contains("volume[1].size: must not be zero"), "{e}");
        let e = err(&vol("name=\"b\"\nbackend=\"file\"\npath=\"/b\"\nsize=\"1x\""));
        assert!(e.contains("volume[1].size: invalid size"), "{e}");
    }

    #[test]
    fn listen_errors() {
        let e = err("[target]\nlisten=[]\n[[volume]]\nname=\"a\"\nbackend=\"file\"\npath=\"/a\"\n");
        assert!(e.contains("target.listen: at least one URL"), "{e}");
        let e = err("[target]\nlisten=[\"tcp://h:1\", \"udp://h:1\"]\n[[volume]]\nname=\"a\"\nbackend=\"file\"\npath=\"/a\"\n");
        assert!(e.contains("target.listen[1]") && e.contains("unknown scheme"), "{e}");
        let e = err("[target]\nlisten=[\"tcp://h:1\", \"tcp://h:1\"]\n[[volume]]\nname=\"a\"\nbackend=\"file\"\npath=\"/a\"\n");
        assert!(e.contains("target.listen[1]") && e.contains("twice"), "{e}");
        let e = err("[target]\nlisten=[\"tcp://h:1\"]\n");
        assert!(e.contains("volume: no [[volume]]"), "{e}");
        let e = err("[target]\nname=\"\"\nlisten=[\"tcp://h:1\"]\n");
        assert!(e.contains("target.name"), "{e}");
    }

    #[test]
    fn a_tcp_port_serves_one_protocol() {
        let listen = |urls: &str| format!("[target]\nlisten=[{urls}]\n[[volume]]\nname=\"a\"\nbackend=\"null\"\nsize=4096\n");
        // tcp:// and nvme+tcp:// are both TCP: the second bind would fail
        // when the target starts; the configuration says so first.
        let e = err(&listen("\"tcp://127.0.0.1:7420\", \"nvme+tcp://127.0.0.1:7420\""));
        assert!(e.contains("target.listen[1]") && e.contains("tcp://127.0.0.1:7420") && e.contains("TCP port"), "{e}");
        let e = err(&listen("\"nvme+tcp://0.0.0.0:4420\", \"tcp://10.0.0.1:4420\""));
        assert!(e.contains("target.listen[1]") && e.contains("nvme+tcp://0.0.0.0:4420"), "{e}");
        let e = err(&listen("\"nvme+tcp://[::]:4420\", \"tcp://10.0.0.1:4420\""));
        assert!(e.contains("target.listen[1]"), "{e}");
        // rdma:// and nvme+rdma:// share rdma_cm's port space the same way.
        let e = err(&listen("\"rdma://10.0.0.1:4420\", \"nvme+rdma://0.0.0.0:4420\""));
        assert!(e.contains("target.listen[1]") && e.contains("rdma_cm port"), "{e}");
        // Port 0 picks a free port for each; other addresses and the other
        // port space do not collide.
        for ok in [
            "\"tcp://127.0.0.1:0\", \"nvme+tcp://127.0.0.1:0\"",
            "\"tcp://127.0.0.1:7420\", \"nvme+tcp://127.0.0.2:7420\"",
            "\"rdma://10.0.0.1:4420\", \"nvme+tcp://10.0.0.1:4420\"",
            "\"nvme+rdma://10.0.0.1:4420\", \"nvme+tcp://10.0.0.1:4420\"",
        ] {
            let c = Config::parse(&listen(ok), "t.toml").unwrap_or_else(|e| panic!("{ok}: {e}"));
            assert_eq!(c.target.listen.len() + c.target.nvme_listen.len(), 2);
        }
    }

    #[test]
    fn limits_have_safe_defaults() {
        let c = Config::parse(&with_target(""), "d.toml").unwrap();
        assert_eq!(c.target.max_sessions, DEFAULT_MAX_SESSIONS);
        assert_eq!(c.target.max_queues_per_session, DEFAULT_MAX_QUEUES_PER_SESSION);
        assert_eq!(c.target.max_handshakes, DEFAULT_MAX_HANDSHAKES);
        assert_eq!(c.target.max_handshakes_per_address, DEFAULT_MAX_HANDSHAKES_PER_ADDRESS);
        assert_eq!(c.target.max_connections_per_address, DEFAULT_MAX_CONNECTIONS_PER_ADDRESS);
        assert_eq!(c.target.handshake_timeout, DEFAULT_HANDSHAKE_TIMEOUT);
        assert_eq!(c.target.transport_timeout, Duration::from_secs(4));
        assert_eq!(c.target.frame_timeout, Duration::from_secs(10));
        assert_eq!(c.target.session_pool_share, PoolShare::Percent(25));
        // 64 MiB of 128 KiB chunks: 512 chunks, a quarter each.
        assert_eq!(c.target.session_pool_share.chunks(512, 128 << 10), 128);
        assert_eq!(c.target.host_pool_share, PoolShare::Percent(50));
        assert_eq!(c.target.chunk_wait_timeout, Duration::from_secs(5));
    }

    #[test]
    fn chunk_wait_timeout_parses_within_bounds() {
        let c = Config::parse(&with_target("chunk_wait_timeout = \"750ms\""), "w.toml").unwrap();
        assert_eq!(c.target.chunk_wait_timeout, Duration::from_millis(750));
        let c = Config::parse(&with_target("chunk_wait_timeout = 20"), "w.toml").unwrap();
        assert_eq!(c.target.chunk_wait_timeout, Duration::from_secs(20));
        for bad in ["\"50ms\"", "\"2h\"", "0", "-1", "\"soon\""] {
            let e = err(&with_target(&format!("chunk_wait_timeout = {bad}")));
            assert!(e.contains("target.chunk_wait_timeout"), "{bad}: {e}");
        }
        let a = Config::parse(&with_target(""), "a").unwrap();
        assert_eq!(a.target.changed_keys(&c.target), vec!["target.chunk_wait_timeout"]);
    }

    #[test]
    fn readahead_is_on_by_default_off_with_zero_and_bounded() {
        assert_eq!(Config::parse(&with_target(""), "r").unwrap().target.readahead, DEFAULT_READAHEAD);
        assert_eq!(Config::parse(&with_target("readahead = \"0\""), "r").unwrap().target.readahead, 0);
        assert_eq!(Config::parse(&with_target("readahead = 0"), "r").unwrap().target.readahead, 0);
        let c = Config::parse(&with_target("readahead = \"16MiB\""), "r").unwrap();
        assert_eq!(c.target.readahead, 16 << 20);
        // Below one chunk (128 KiB by default), above the maximum, negative, garbage.
        for bad in ["\"64KiB\"", "\"1GiB\"", "-1", "\"lots\""] {
            let e = err(&with_target(&format!("readahead = {bad}")));
            assert!(e.contains("target.readahead"), "{bad}: {e}");
        }
        let a = Config::parse(&with_target(""), "a").unwrap();
        assert_eq!(a.target.changed_keys(&c.target), vec!["target.readahead"]);
    }

    #[test]
    fn host_pool_share_is_never_below_the_session_share() {
        let c = Config::parse(&with_target("host_pool_share = \"40MiB\""), "h.toml").unwrap();
        assert_eq!(c.target.host_pool_share, PoolShare::Bytes(40 << 20));
        assert_eq!(c.target.host_pool_share.chunks(512, 128 << 10), 320);
        // Below the default session share (25 %) without setting it lower.
        let e = err(&with_target("host_pool_share = \"8MiB\""));
        assert!(e.contains("target.host_pool_share: 8MiB (64 chunks of each reactor's 512) is below target.session_pool_share 25% (128 chunks)"), "{e}");
        let c = Config::parse(&with_target("session_pool_share = \"10%\"\nhost_pool_share = \"10%\""), "h.toml").unwrap();
        assert_eq!(c.target.host_pool_share, PoolShare::Percent(10));
        // Compared in chunks, whatever the units.
        let c = Config::parse(&with_target("session_pool_share = \"16MiB\"\nhost_pool_share = \"25%\""), "h.toml").unwrap();
        assert_eq!(c.target.host_pool_share, PoolShare::Percent(25));
        let e = err(&with_target("session_pool_share = \"16MiB\"\nhost_pool_share = \"24%\""));
        assert!(
            e.contains("target.host_pool_share: 24% (122 chunks of each reactor's 512) is below target.session_pool_share 16MiB (128 chunks)"),
            "{e}"
        );
        // Unset, it follows a session share above its default.
        let c = Config::parse(&with_target("session_pool_share = \"75%\""), "h.toml").unwrap();
        assert_eq!(c.target.host_pool_share, PoolShare::Percent(75));
        for (bad, why) in [("0%", "is not a percentage"), ("101%", "is not a percentage"), ("4KiB", "must lie between"), ("soon", "invalid size")] {
            let e = err(&with_target(&format!("host_pool_share = \"{bad}\"")));
            assert!(e.contains("target.host_pool_share") && e.contains(why), "{bad}: {e}");
        }
        let a = Config::parse(&with_target(""), "a").unwrap();
        let b = Config::parse(&with_target("host_pool_share = \"100%\""), "b").unwrap();
        assert_eq!(a.target.changed_keys(&b.target), vec!["target.host_pool_share"]);
    }

    #[test]
    fn limits_parse() {
        let c = Config::parse(
            &with_target(
                "max_sessions = 3\nmax_queues_per_session = 2\nmax_handshakes = 5\nhandshake_timeout = \"1500ms\"\nsession_pool_share = \"1MiB\"",
            ),
            "l.toml",
        )
        .unwrap();
        assert_eq!(
            (c.target.max_sessions, c.target.max_queues_per_session, c.target.max_handshakes),
            (3, 2, 5)
        );
        assert_eq!(c.target.max_handshakes_per_address, 5, "never above max_handshakes by default");
        let per = Config::parse(&with_target("max_handshakes_per_address = 4"), "l.toml").unwrap();
        assert_eq!(per.target.max_handshakes_per_address, 4);
        let e = err(&with_target("max_handshakes = 8\nmax_handshakes_per_address = 9"));
        assert!(e.contains("target.max_handshakes_per_address: 9 is above target.max_handshakes (8)"), "{e}");
        assert_eq!(c.target.handshake_timeout, Duration::from_millis(1500));
        assert_eq!(c.target.fence_timeout, DEFAULT_FENCE_TIMEOUT);
        assert_eq!(c.target.idle_timeout, DEFAULT_IDLE_TIMEOUT);
        let idle = Config::parse(&with_target("idle_timeout = \"90s\""), "l.toml").unwrap();
        assert_eq!(idle.target.idle_timeout, Duration::from_secs(90));
        let e = err(&with_target("idle_timeout = \"500ms\""));
        assert!(e.contains("target.idle_timeout: must be between 1s and 24h"), "{e}");
        let fabric = Config::parse(&with_target("transport_timeout = \"1500ms\"\nframe_timeout = 3"), "l.toml").unwrap();
        assert_eq!(fabric.target.transport_timeout, Duration::from_millis(1500));
        assert_eq!(fabric.target.frame_timeout, Duration::from_secs(3));
        for key in ["transport_timeout", "frame_timeout"] {
            for bad in ["\"500ms\"", "0", "\"2h\""] {
                let e = err(&with_target(&format!("{key} = {bad}")));
                assert!(e.contains(&format!("target.{key}: must be between 1s and 1h")), "{e}");
            }
            let e = err(&with_target(&format!("{key} = -4")));
            assert!(e.contains(&format!("target.{key}: must not be negative")), "{e}");
            let e = err(&with_target(&format!("{key} = \"soon\"")));
            assert!(e.contains(&format!("target.{key}: invalid duration")), "{e}");
        }
        assert_eq!(c.target.session_pool_share, PoolShare::Bytes(1 << 20));
        assert_eq!(c.target.session_pool_share.chunks(512, 128 << 10), 8);
        let c = Config::parse(&with_target("session_pool_share = \"100%\"\nhandshake_timeout = 2"), "l.toml").unwrap();
        assert_eq!(c.target.session_pool_share, PoolShare::Percent(100));
        assert_eq!(c.target.session_pool_share.chunks(512, 128 << 10), 512);
        assert_eq!(c.target.handshake_timeout, Duration::from_secs(2));
        // A tiny share still lets one chunk through, so every session progresses.
        assert_eq!(PoolShare::Percent(1).chunks(8, 4096), 1);
    }

    #[test]
    fn bad_limits_are_named() {
        for key in [
            "max_sessions",
            "max_queues_per_session",
            "max_handshakes",
            "max_handshakes_per_address",
            "max_connections_per_address",
            "max_controllers",
            "max_controllers_per_host",
        ] {
            let e = err(&with_target(&format!("{key} = 0")));
            assert!(e.contains(&format!("test.toml: target.{key}: must be in 1..=")), "{e}");
            let e = err(&with_target(&format!("{key} = -3")));
            assert!(e.contains(&format!("target.{key}")), "{e}");
            let e = err(&with_target(&format!("{key} = 99999999")));
            assert!(e.contains(&format!("target.{key}")), "{e}");
            let e = err(&with_target(&format!("{key} = \"ten\"")));
            assert!(e.contains("test.toml") && e.contains(key), "{e}");
        }
        let e = err(&with_target("handshake_timeout = \"10 fortnights\""));
        assert!(e.contains("target.handshake_timeout: invalid duration"), "{e}");
        let e = err(&with_target("handshake_timeout = 0"));
        assert!(e.contains("target.handshake_timeout: must be between 100ms and 1h"), "{e}");
        let e = err(&with_target("fence_timeout = \"50ms\""));
        assert!(e.contains("target.fence_timeout: must be between 100ms and 1h"), "{e}");
        let c = Config::parse(&with_target("fence_timeout = \"2s\""), "l.toml").unwrap();
        assert_eq!(c.target.fence_timeout, Duration::from_secs(2));
        let e = err(&with_target("handshake_timeout = -1"));
        assert!(e.contains("target.handshake_timeout: must not be negative"), "{e}");
        let e = err(&with_target("session_pool_share = \"0%\""));
        assert!(e.contains("target.session_pool_share: \"0%\" is not a percentage"), "{e}");
        let e = err(&with_target("session_pool_share = \"150%\""));
        assert!(e.contains("target.session_pool_share"), "{e}");
        let e = err(&with_target("session_pool_share = \"4KiB\""));
        assert!(e.contains("target.session_pool_share: 4KiB must lie between target.chunk_size"), "{e}");
        let e = err(&with_target("session_pool_share = \"1GiB\""));
        assert!(e.contains("target.session_pool_share") && e.contains("target.buffer_pool"), "{e}");
        let e = err(&with_target("session_pool_share = \"lots\""));
        assert!(e.contains("target.session_pool_share: invalid size"), "{e}");
    }

    #[test]
    fn anonymous_caps_lie_within_their_tables() {
        let c = Config::parse(&with_target("max_sessions = 10\nmax_anonymous_sessions = 4"), "t").unwrap();
        assert_eq!((c.target.max_sessions, c.target.max_anonymous_sessions), (10, 4));
        assert_eq!(Config::parse(&with_target("max_sessions = 10"), "t").unwrap().target.max_anonymous_sessions, 10);
        let e = Config::parse(&with_target("max_sessions = 10\nmax_anonymous_sessions = 11"), "t").unwrap_err().to_string();
        assert!(e.contains("target.max_anonymous_sessions: 11 is more than target.max_sessions 10"), "{e}");
        let c = Config::parse(&with_target("max_controllers = 10\nmax_anonymous_controllers = 4"), "t").unwrap();
        assert_eq!((c.target.max_controllers, c.target.max_anonymous_controllers), (10, 4));
        let e = Config::parse(&with_target("max_controllers = 3\nmax_anonymous_controllers = 4"), "t").unwrap_err().to_string();
        assert!(e.contains("target.max_anonymous_controllers: 4 is more than target.max_controllers 3"), "{e}");
    }

    #[test]
    fn limits_need_a_restart() {
        let a = Config::parse(&with_target(""), "a").unwrap();
        let b = Config::parse(
            &with_target("max_sessions = 2\nmax_queues_per_session = 2\nmax_handshakes = 2\nhandshake_timeout = 2\ntransport_timeout = 8\nframe_timeout = \"20s\"\nsession_pool_share = \"50%\""),
            "b",
        )
        .unwrap();
        assert_eq!(
            a.target.changed_keys(&b.target),
            vec![
                "target.max_sessions",
                // Its default follows max_sessions.
                "target.max_anonymous_sessions",
                "target.max_queues_per_session",
                "target.max_handshakes",
                // Its default follows max_handshakes when that is smaller.
                "target.max_handshakes_per_address",
                "target.handshake_timeout",
                "target.transport_timeout",
                "target.frame_timeout",
                "target.session_pool_share"
            ]
        );
    }

    #[test]
    fn durations() {
        assert_eq!(parse_duration("10s").unwrap(), Duration::from_secs(10));
        assert_eq!(parse_duration("250ms").unwrap(), Duration::from_millis(250));
        assert_eq!(parse_duration("2m").unwrap(), Duration::from_secs(120));
        assert_eq!(parse_duration("7").unwrap(), Duration::from_secs(7));
        assert!(parse_duration("s").is_err());
        assert!(parse_duration("5 fortnights").is_err());
        let c = Config::parse(&with_target("shutdown_timeout = 3"), "x").unwrap();
        assert_eq!(c.target.shutdown_timeout, Duration::from_secs(3));
    }
}

#[cfg(test)]
mod example_tests {
    #[test]
    fn the_example_config_is_valid() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/rdmablk-target.example.toml");
        let c = super::Config::load(std::path::Path::new(path)).unwrap();
        assert_eq!(c.volumes[0].size, Some(1 << 30));
        assert_eq!(c.target.chunk_size, 128 << 10);
    }

    #[test]
    fn the_shipped_config_is_valid() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../configs/target.toml");
        let c = super::Config::load(std::path::Path::new(path)).unwrap();
        assert_eq!(c.target.metrics, Some("127.0.0.1:9420".parse().unwrap()));
        assert_eq!(c.volumes[0].path, std::path::Path::new("/var/lib/rdmablk/vol0.img"));
        assert!(!c.target.pin_reactors && !c.target.iopoll && !c.target.sqpoll);
    }
}

#[cfg(test)]
mod access_tests {
    use super::*;

    fn parse(extra_volume: &str, hosts: &str) -> Result<Config> {
        Config::parse(
            &format!(
                "[target]\nlisten = [\"tcp://127.0.0.1:0\"]\n[[volume]]\nname = \"v\"\nbackend = \"null\"\nsize = 4096\n{extra_volume}\n{hosts}"
            ),
            "a.toml",
        )
    }

    const HOSTS: &str = "[[host]]\nid = \"alpha\"\nkey_file = \"/etc/rdmablk/alpha.key\"\n[[host]]\nid = \"beta\"\nkey_file = \"/etc/rdmablk/beta.key\"\n";

    #[test]
    fn hosts_and_grants_parse() {
        let c = parse("allowed_hosts = [\"alpha\"]\nread_only_hosts = [\"beta\"]", HOSTS).unwrap();
        assert_eq!(c.hosts.len(), 2);
        assert_eq!((c.hosts[1].index, c.hosts[1].id.as_str()), (1, "beta"));
        assert_eq!(c.hosts[0].key_file.as_deref(), Some(Path::new("/etc/rdmablk/alpha.key")));
        assert_eq!(c.access.len(), 1);
        assert_eq!(c.access[0].volume, "v");
        assert_eq!(c.access[0].allowed_hosts, vec!["alpha"]);
        assert_eq!(c.access[0].read_only_hosts, vec!["beta"]);
        assert!(!c.access[0].allow_any_host);
        let c = parse("allow_any_host = true", "").unwrap();
        assert!(c.hosts.is_empty() && c.access[0].allow_any_host);
        let c = parse("", "").unwrap();
        assert_eq!(c.access[0], VolumeAccess { volume: "v".into(), ..VolumeAccess::default() }, "default: nobody");
    }

    #[test]
    fn grant_and_host_errors_name_the_key() {
        let e = parse("allowed_hosts = [\"gamma\"]", HOSTS).unwrap_err().to_string();
        assert!(e.contains("a.toml: volume[0].allowed_hosts[0]: \"gamma\" is not the id of any [[host]]"), "{e}");
        let e = parse("read_only_hosts = [\"alpha\", \"delta\"]", HOSTS).unwrap_err().to_string();
        assert!(e.contains("volume[0].read_only_hosts[1]: \"delta\""), "{e}");
        let e = parse("allowed_hosts = [\"alpha\"]", "").unwrap_err().to_string();
        assert!(e.contains("volume[0].allowed_hosts[0]"), "no hosts at all: {e}");
        let e = parse("allowed_hosts = [\"alpha\", \"alpha\"]", HOSTS).unwrap_err().to_string();
        assert!(e.contains("volume[0].allowed_hosts[1]") && e.contains("twice"), "{e}");
        let e = parse("", "[[host]]\nid = \"a\"\n").unwrap_err().to_string();
        assert!(e.contains("host[0].key_file: is required unless the host has an nqn"), "{e}");
        let e = parse("", "[[host]]\nid = \"a\"\nkey_file = \"\"\nnqn = \"nqn.2014-08.org.example:a\"\n").unwrap_err().to_string();
        assert!(e.contains("host[0].key_file: must not be empty"), "{e}");
        let c = parse("", "[[host]]\nid = \"a\"\nnqn = \"nqn.2014-08.org.example:a\"\n").unwrap();
        assert_eq!((c.hosts[0].key_file.as_deref(), c.hosts[0].nqn.as_deref()), (None, Some("nqn.2014-08.org.example:a")));
        let e = parse("", "[[host]]\nid = \"\"\nkey_file = \"/k\"\n").unwrap_err().to_string();
        assert!(e.contains("host[0].id: must not be empty"), "{e}");
        let e = parse("", &format!("{HOSTS}[[host]]\nid = \"alpha\"\nkey_file = \"/k\"\n")).unwrap_err().to_string();
        assert!(e.contains("host[2].id: \"alpha\" is used by an earlier [[host]]"), "{e}");
        let e = parse("", &format!("[[host]]\nid = \"{}\"\nkey_file = \"/k\"\n", "h".repeat(224))).unwrap_err().to_string();
        assert!(e.contains("host[0].id: must be at most 223 bytes"), "{e}");
        let e = parse("", "[[host]]\nid = \"a\"\nkey_file = \"/k\"\nkey = \"00\"\n").unwrap_err().to_string();
        assert!(e.contains("unknown field `key`"), "{e}");
    }
}
