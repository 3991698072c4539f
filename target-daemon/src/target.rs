//! Starting, running and stopping a target: the control thread.
//!
//! One control thread does everything that is not I/O, in one epoll loop:
//! it owns the listeners and hands each connection request to the least
//! loaded reactor (ties taking turns; through a channel and an eventfd); it serves the metrics
//! endpoint; it talks to systemd (READY, STATUS, WATCHDOG); on SIGHUP (or
//! [`RunningTarget::reload`]) it applies a new configuration's volumes; on
//! SIGINT/SIGTERM (binary) or [`RunningTarget::shutdown`] (library) it stops
//! accepting, lets in-flight commands finish (bounded by
//! `shutdown_timeout`), fdatasyncs every writable volume and returns.
//!
//! A reload adds new volumes, changes read-only flags, removes volumes no
//! session has open, and refuses (logging why) to remove or change a volume
//! that is open. Sessions on unchanged volumes are untouched. Volume ids
//! stay the same across reloads and are never reused for another volume.
//! `[target]` keys take effect at the next start (a reload says which changed).

use std::net::SocketAddr;
use std::path::Path;
use std::sync::{mpsc, Arc};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use rdmablk_common::fabric::{Fabric, FabricOptions, FabricUrl, ListenOptions, Listener};
use rdmablk_common::protocol::VolumeId;
use rdmablk_common::size::ByteSize;

use crate::auth::AccessPolicy;
use crate::backend::{self, Volume, VolumeSet};
use crate::config::{Config, NvmeListen, TargetConfig, MAX_VOLUMES};
use crate::error::{Error, ErrorKind, Result};
use crate::metrics::{self, HttpServer, ReactorStats};
use crate::notify::{self, Notifier};
use crate::nvmf::NvmeFrontEnd;
use crate::reactor::{self, Control, ReactorHandle, ReactorSpec, Transport};
use crate::registry::{AdmissionLimits, HandshakeRefusal, Protocol, Registry};
use crate::v1::session::{SessionLimits, SessionSummary, Sessions};
use crate::sys::{self, Epoll, EventFd, SignalFd};

/// Entry point for starting targets.
pub struct Target;

impl Target {
    /// Opens the volumes, listens on every configured URL (port 0 picks a
    /// free port; see [`RunningTarget::urls`]), starts the reactors and the
    /// control thread, and returns once the target accepts connections.
    /// Signals are left alone: stop it with [`RunningTarget::shutdown`].
    pub fn start(config: Config) -> Result<RunningTarget> {
        start(config, None, Notifier::none())
    }
}

/// Runs a target until SIGINT or SIGTERM, then shuts it down cleanly;
/// SIGHUP reloads the configuration file. Talks to systemd when
/// `NOTIFY_SOCKET` is set. Blocks the three signals in the calling thread
/// first (threads started afterwards inherit the mask), so call it before
/// starting other threads.
pub fn run(config: Config) -> Result<()> {
    let signals = SignalFd::block_daemon_signals().map_err(|e| Error::os("cannot set up signal handling", e))?;
    start(config, Some(signals), Notifier::from_env())?.wait()
}

/// Validates the configuration and every volume without creating or
/// changing anything. Returns one line per volume, one per host, then one
/// per listen URL (rdmablk's, then NVMe-oF's).
pub fn check(config: &Config) -> Result<Vec<String>> {
    let access = AccessPolicy::load(config)?;
    let mut lines = backend::check_volumes(config)?;
    for h in &config.hosts {
        match (&h.key_file, &h.nqn) {
            (Some(k), _) => lines.push(format!("host {:?}: key file {} (readable, mode private)", h.id, k.display())),
            (None, Some(nqn)) => lines.push(format!("host {:?}: NVMe-oF only, as {nqn} (no key file: cannot use rdmablk listeners)", h.id)),
            (None, None) => unreachable!("validation requires a key file or an nqn"),
        }
    }
    if access.hosts_configured() {
        lines.push(format!("authentication required: {} host(s)", access.host_count()));
    }
    for w in unauthenticated_warnings(
        config,
        &config.target.listen.iter().map(|u| (u.to_string(), u.host.as_str())).collect::<Vec<_>>(),
        &config.target.nvme_listen.iter().map(|l| (l.to_string(), l.url.host.as_str())).collect::<Vec<_>>(),
    ) {
        tracing::warn!("{w}");
    }
    lines.extend(config.target.listen.iter().map(|u| format!("listen {u}")));
    lines.extend(config.target.nvme_listen.iter().map(|l| format!("listen {l}")));
    if let Some(m) = config.target.metrics {
        lines.push(format!("metrics http://{m}/metrics"));
    }
    Ok(lines)
}

/// What a reload did, volume by volume (names).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ReloadSummary {
    pub added: Vec<String>,
    pub removed: Vec<String>,
    /// The read-only flag changed.
    pub read_only_changed: Vec<String>,
    /// Changed otherwise (path, size, backend, block size) while unused: reopened with a new id.
    pub replaced: Vec<String>,
    /// Left as they were, with the reason (in use).
    pub refused: Vec<(String, String)>,
    /// `[target]` keys that changed and need a restart.
    pub restart_needed: Vec<&'static str>,
}

struct ReloadRequest {
    config: Option<Config>,
    reply: Option<mpsc::Sender<Result<ReloadSummary>>>,
}

/// A started target.
pub struct RunningTarget {
    urls: Vec<FabricUrl>,
    nvme_listeners: Vec<NvmeListen>,
    metrics: Option<SocketAddr>,
    stop: Arc<EventFd>,
    reload_tx: mpsc::Sender<ReloadRequest>,
    reload_wake: Arc<EventFd>,
    registry: Arc<Registry>,
    sessions: Arc<Sessions>,
    control: Option<JoinHandle<Result<()>>>,
}

/// Asks a running target to shut down; cheap to clone, usable from any thread.
#[derive(Clone)]
pub struct StopHandle(Arc<EventFd>);

impl StopHandle {
    /// Starts the shutdown; returns at once.
    pub fn stop(&self) {
        self.0.notify();
    }
}

impl RunningTarget {
    /// The bound listen URLs (port 0 resolved), in configuration order.
    pub fn urls(&self) -> &[FabricUrl] {
        &self.urls
    }

    /// The bound NVMe-oF listeners (port 0 resolved), in configuration order.
    pub fn nvme_listeners(&self) -> &[NvmeListen] {
        &self.nvme_listeners
    }

    /// The first bound listen URL.
    pub fn url(&self) -> &FabricUrl {
        &self.urls[0]
    }

    /// The metrics endpoint's bound address, if one is configured.
    pub fn metrics_addr(&self) -> Option<SocketAddr> {
        self.metrics
    }

    /// A handle that starts the shutdown from elsewhere.
    pub fn stop_handle(&self) -> StopHandle {
        StopHandle(Arc::clone(&self.stop))
    }

    /// Applies `config`'s volumes as SIGHUP applies the configuration file,
    /// and waits for the result.
    pub fn reload(&self, config: Config) -> Result<ReloadSummary> {
        let (tx, rx) = mpsc::channel();
        self.reload_tx
            .send(ReloadRequest { config: Some(config), reply: Some(tx) })
            .map_err(|_| Error::new(ErrorKind::ShuttingDown, "the target is stopping"))?;
        self.reload_wake.notify();
        rx.recv().unwrap_or_else(|_| Err(Error::new(ErrorKind::ShuttingDown, "the target is stopping")))
    }

    /// The served volumes: name, id, read-only.
    pub fn volumes(&self) -> Vec<(String, VolumeId, bool)> {
        self.registry.volumes().volumes.iter().map(|v| (v.name.clone(), v.id, v.read_only)).collect()
    }

    /// The sessions connected now.
    pub fn sessions(&self) -> Vec<SessionSummary> {
        self.sessions.admin().sessions()
    }

    /// Shuts down (see the module docs) and waits until done.
    pub fn shutdown(mut self) -> Result<()> {
        self.stop.notify();
        self.join()
    }

    /// Waits until the target stops (after a signal, a [`StopHandle`] or a fatal error).
    pub fn wait(mut self) -> Result<()> {
        self.join()
    }

    fn join(&mut self) -> Result<()> {
        match self.control.take() {
            None => Ok(()),
            Some(t) => t.join().unwrap_or_else(|_| Err(Error::new(ErrorKind::Internal, "control thread panicked"))),
        }
    }
}

impl Drop for RunningTarget {
    fn drop(&mut self) {
        if self.control.is_some() {
            self.stop.notify();
            if let Err(e) = self.join() {
                tracing::error!("target stopped with an error: {e}");
            }
        }
    }
}

/// Every reactor registers its buffer pool with io_uring, which pins it
/// against RLIMIT_MEMLOCK (`limit`, `None` when unlimited) unless the
/// process has CAP_IPC_LOCK (`exempt`). Refuses to start when the pools
/// cannot fit, naming the bytes needed and the fix; the limit is shared
/// with the user's other processes, so passing is no promise.
fn check_memlock(config: &Config, limit: Option<u64>, exempt: bool) -> Result<()> {
    let cfg = &config.target;
    let needed = cfg.buffer_pool.saturating_mul(cfg.reactors as u64);
    let Some(limit) = limit.filter(|&l| l < needed && !exempt) else { return Ok(()) };
    Err(Error::new(
        ErrorKind::Os,
        format!(
            "{}: target.buffer_pool: the buffer pools need {needed} bytes ({}) locked in memory (target.reactors {} \
             × target.buffer_pool {} bytes, registered with io_uring) but RLIMIT_MEMLOCK is {limit} bytes ({}); raise it: \
             `ulimit -l {}` (KiB) in the shell that starts rdmablk-target, or LimitMEMLOCK=infinity in its systemd unit \
             (the shipped unit has it); or lower target.buffer_pool or target.reactors",
            config.source,
            ByteSize(needed),
            cfg.reactors,
            cfg.buffer_pool,
            ByteSize(limit),
            needed.div_ceil(1024),
        ),
    ))
}

/// A fabric listener that could not be bound: the OS's reason in words
/// when there is one (see [`Error::listen`]).
pub(crate) fn listen_error(context: String, e: rdmablk_common::fabric::FabricError) -> Error {
    match e.source {
        Some(io) => Error::listen(ErrorKind::Fabric, context, io),
        None => Error::fabric(context, e),
    }
}

const TOKEN_STOP: u64 = 1 << 40;
const TOKEN_SIGNAL: u64 = (1 << 40) + 1;
const TOKEN_EXITED: u64 = (1 << 40) + 2;
const TOKEN_RELOAD: u64 = (1 << 40) + 3;
const TOKEN_METRICS: u64 = (1 << 40) + 4;
const TOKEN_HTTP: u64 = 1 << 41;
/// NVMe listener `i` is `TOKEN_NVME + i`.
const TOKEN_NVME: u64 = 1 << 42;
/// How often STATUS= is refreshed (when it changed).
const STATUS_EVERY: Duration = Duration::from_secs(5);
/// The reactors' transports, by index (what their fabrics, epoll tokens
/// and executor commands name).
const TRANSPORT_V1: usize = 0;
const TRANSPORT_NVME_TCP: usize = 1;
const TRANSPORT_NVME_RDMA: usize = 2;
/// How often removed volumes are checked for release.
const RETIRED_EVERY: Duration = Duration::from_millis(200);

fn start(config: Config, signals: Option<SignalFd>, notifier: Notifier) -> Result<RunningTarget> {
    let cfg = config.target.clone();
    match sys::raise_nofile_limit(65536) {
        Ok(n) if n < 4096 => tracing::warn!("RLIMIT_NOFILE is {n}; every queue pair uses a descriptor (raise LimitNOFILE)"),
        Ok(_) => {}
        Err(e) => tracing::warn!("cannot raise RLIMIT_NOFILE: {e}"),
    }
    let volumes = backend::open_volumes(&config)?;
    check_memlock(&config, sys::memlock_limit().ok().flatten(), sys::has_cap_ipc_lock())?;
    let next_volume_id = volumes.iter().map(|v| v.id.0).max().unwrap_or(0) + 1;
    let limits = AdmissionLimits {
        max_handshakes: cfg.max_handshakes,
        max_handshakes_per_address: cfg.max_handshakes_per_address,
        max_connections_per_address: cfg.max_connections_per_address,
    };
    let access = Arc::new(AccessPolicy::load(&config)?);
    log_access(&config);
    let registry = Arc::new(Registry::new(VolumeSet::new(1, volumes).with_access(access), cfg.reactors).with_limits(limits));
    let session_limits = SessionLimits {
        max_sessions: cfg.max_sessions,
        max_anonymous_sessions: cfg.max_anonymous_sessions,
        max_queues_per_session: cfg.max_queues_per_session,
    };
    let sessions = Arc::new(Sessions::new(Arc::clone(&registry), session_limits));

    let mut fabrics = Vec::with_capacity(cfg.listen.len());
    let mut listeners = Vec::with_capacity(cfg.listen.len());
    let mut urls = Vec::with_capacity(cfg.listen.len());
    for url in &cfg.listen {
        let options = FabricOptions { transport_timeout: cfg.transport_timeout, frame_timeout: cfg.frame_timeout };
        let f = Fabric::open_with(url, options).map_err(|e| Error::fabric(format!("{url}: cannot open the fabric"), e))?;
        let l = f
            .listen_with(ListenOptions { handshake_timeout: cfg.handshake_timeout })
            .map_err(|e| listen_error(format!("{}: target.listen: cannot listen on {url}", config.source), e))?;
        urls.push(l.local_url());
        fabrics.push(Arc::new(f));
        listeners.push(l);
    }
    let nvme = NvmeFrontEnd::bind(&config.source, &cfg, Arc::clone(&registry))?;
    let nvme_rdma_fabrics = nvme.rdma_fabrics();
    let metrics = match cfg.metrics {
        None => None,
        Some(addr) => Some(HttpServer::bind(addr, TOKEN_HTTP).map_err(|e| {
            Error::listen(ErrorKind::Os, format!("{}: target.metrics: cannot listen on {addr}", config.source), e)
        })?),
    };

    let exited = Arc::new(EventFd::new().map_err(|e| Error::os("eventfd", e))?);
    let cpus = sys::allowed_cpus();
    let mut reactors: Vec<ReactorHandle> = Vec::with_capacity(cfg.reactors);
    let mut reactor_stats = Vec::with_capacity(cfg.reactors);
    for id in 0..cfg.reactors {
        let stats = Arc::new(ReactorStats::default());
        // The reactor's fabrics: the v1 listeners', then the NVMe/RDMA
        // listeners', each owned by its transport.
        let mut reactor_fabrics: Vec<(Arc<Fabric>, usize, u32)> =
            fabrics.iter().map(|f| (Arc::clone(f), TRANSPORT_V1, cfg.queue_depth)).collect();
        let rdma_fabrics: Vec<usize> = (fabrics.len()..fabrics.len() + nvme_rdma_fabrics.len()).collect();
        reactor_fabrics.extend(nvme_rdma_fabrics.iter().map(|f| (Arc::clone(f), TRANSPORT_NVME_RDMA, crate::nvmf::MAX_QUEUE_ENTRIES)));
        let (v1_cfg, v1_sessions, sub) = (cfg.clone(), Arc::clone(&sessions), Arc::clone(&nvme.subsystem));
        let transports: reactor::TransportFactory = Box::new(move |_rt| {
            let v1: Box<dyn Transport> = Box::new(crate::v1::V1::new(TRANSPORT_V1, &v1_cfg, v1_sessions));
            let tcp: Box<dyn Transport> = Box::new(crate::nvmf::tcp::NvmeTcp::new(TRANSPORT_NVME_TCP, Arc::clone(&sub)));
            let rdma: Box<dyn Transport> = Box::new(crate::nvmf::rdma::NvmeRdma::new(TRANSPORT_NVME_RDMA, sub, rdma_fabrics));
            Ok(vec![v1, tcp, rdma])
        });
        let spec = ReactorSpec {
            id,
            cfg: cfg.clone(),
            registry: Arc::clone(&registry),
            fabrics: reactor_fabrics,
            transports,
            cpu: cfg.pin_reactors.then(|| cpus[id % cpus.len()]),
            exited: Arc::clone(&exited),
            stats: Arc::clone(&stats),
        };
        match reactor::spawn(spec) {
            Ok(h) => {
                reactors.push(h);
                reactor_stats.push(stats);
            }
            Err(e) => {
                stop_reactors(&mut reactors, Instant::now());
                return Err(e);
            }
        }
    }
    let nvol = registry.volumes().volumes.len();
    tracing::info!(
        "target {:?}: {} reactor(s){}, {nvol} volume(s), queue depth {}, max I/O {} bytes, pool {} bytes per reactor in chunks of {}",
        cfg.name,
        cfg.reactors,
        if cfg.pin_reactors { format!(" pinned to CPUs {:?}", (0..cfg.reactors).map(|i| cpus[i % cpus.len()]).collect::<Vec<_>>()) } else { String::new() },
        cfg.queue_depth,
        cfg.max_io_size,
        cfg.buffer_pool,
        cfg.chunk_size
    );
    for u in &urls {
        tracing::info!("listening on {u}");
    }
    for (l, _) in &nvme.listeners {
        tracing::info!("listening on {l} (NVMe-oF subsystem {})", cfg.nqn);
    }
    for w in unauthenticated_warnings(
        &config,
        &urls.iter().map(|u| (u.to_string(), u.host.as_str())).collect::<Vec<_>>(),
        &nvme.listeners.iter().map(|(l, _)| (l.to_string(), l.url.host.as_str())).collect::<Vec<_>>(),
    ) {
        tracing::warn!("{w}");
    }
    let metrics_addr = metrics.as_ref().map(|m| m.local_addr());
    let nvme_listeners: Vec<NvmeListen> = nvme.listeners.iter().map(|(l, _)| l.clone()).collect();
    if let Some(a) = metrics_addr {
        tracing::info!("metrics endpoint: http://{a}/metrics");
    }

    let stop = Arc::new(EventFd::new().map_err(|e| Error::os("eventfd", e))?);
    let reload_wake = Arc::new(EventFd::new().map_err(|e| Error::os("eventfd", e))?);
    let (reload_tx, reload_rx) = mpsc::channel();
    let mut ctl = ControlThread {
        listeners,
        nvme,
        reactors,
        reactor_stats,
        registry: Arc::clone(&registry),
        sessions: Arc::clone(&sessions),
        stop: Arc::clone(&stop),
        signals,
        exited,
        reload_rx,
        reload_wake: Arc::clone(&reload_wake),
        running: cfg.clone(),
        source: config.source.clone(),
        next_volume_id,
        retired: Vec::new(),
        notifier,
        metrics,
        urls: urls.clone(),
        started: Instant::now(),
        reloads_ok: 0,
        reloads_failed: 0,
        heartbeats: Vec::new(),
        last_status: String::new(),
    };
    let status = ctl.status_text();
    ctl.notifier.notify(&format!("READY=1\n{}", notify::status(&status)));
    ctl.last_status = status;
    if let Some(every) = ctl.notifier.watchdog_interval() {
        tracing::info!("systemd watchdog: pinging every {every:?} while every reactor responds");
    }
    let control = std::thread::Builder::new()
        .name("rdmablk-ctl".into())
        .spawn(move || ctl.run())
        .map_err(|e| Error::os("cannot spawn the control thread", e))?;
    Ok(RunningTarget { urls, nvme_listeners, metrics: metrics_addr, stop, reload_tx, reload_wake, registry, sessions, control: Some(control) })
}

fn stop_reactors(reactors: &mut [ReactorHandle], deadline: Instant) -> Option<Error> {
    for r in reactors.iter() {
        let _ = r.send(Control::Shutdown { deadline });
    }
    let mut first = None;
    for r in reactors.iter_mut() {
        if let Err(e) = r.join() {
            tracing::error!("reactor {}: {e}", r.id);
            first.get_or_insert(e);
        }
    }
    first
}

struct ControlThread {
    listeners: Vec<Listener>,
    /// The NVMe-oF listeners; their queues run on threads of their own.
    nvme: NvmeFrontEnd,
    reactors: Vec<ReactorHandle>,
    reactor_stats: Vec<Arc<ReactorStats>>,
    registry: Arc<Registry>,
    /// rdmablk v1's sessions (for scrapes, and reloads' "is it open?").
    sessions: Arc<Sessions>,
    stop: Arc<EventFd>,
    signals: Option<SignalFd>,
    exited: Arc<EventFd>,
    reload_rx: mpsc::Receiver<ReloadRequest>,
    reload_wake: Arc<EventFd>,
    /// The `[target]` section in force (a reload does not change it).
    running: TargetConfig,
    /// The configuration file SIGHUP re-reads.
    source: String,
    next_volume_id: u32,
    /// Removed volumes, closed (after fdatasync) once no reactor uses them.
    retired: Vec<Arc<Volume>>,
    notifier: Notifier,
    metrics: Option<HttpServer>,
    urls: Vec<FabricUrl>,
    started: Instant,
    reloads_ok: u64,
    reloads_failed: u64,
    heartbeats: Vec<u64>,
    last_status: String,
}

impl ControlThread {
    fn run(mut self) -> Result<()> {
        let mut failure = self.serve().err();
        self.notifier.notify(&format!("STOPPING=1\n{}", notify::status("stopping: finishing in-flight commands")));
        drop(std::mem::take(&mut self.listeners));
        let timeout = self.running.shutdown_timeout;
        tracing::info!("shutting down: no new connections; waiting up to {timeout:?} for in-flight commands");
        let deadline = Instant::now() + timeout;
        self.nvme.shutdown();
        if let Some(e) = stop_reactors(&mut self.reactors, deadline) {
            failure.get_or_insert(e);
        }
        let set = self.registry.volumes();
        let retired = std::mem::take(&mut self.retired);
        for v in set.volumes.iter().chain(retired.iter()).filter(|v| !v.read_only || v.backend.writable()) {
            if let Err(e) = v.sync() {
                tracing::error!("volume {}: fdatasync failed: {e}", v.name);
                failure.get_or_insert(Error::with_source(ErrorKind::Volume, format!("volume {}: fdatasync failed", v.name), e));
            }
        }
        match failure {
            None => {
                tracing::info!("shutdown complete: every writable volume flushed");
                Ok(())
            }
            Some(e) => Err(e),
        }
    }

    /// Serves until asked to stop; an error means a reactor died.
    fn serve(&mut self) -> Result<()> {
        let epoll = Epoll::new().map_err(|e| Error::os("epoll_create", e))?;
        for (i, l) in self.listeners.iter().enumerate() {
            epoll.add(l.fd(), i as u64).map_err(|e| Error::os("epoll_ctl", e))?;
        }
        for (i, (_, l)) in self.nvme.listeners.iter().enumerate() {
            epoll.add(l.fd(), TOKEN_NVME + i as u64).map_err(|e| Error::os("epoll_ctl", e))?;
        }
        epoll.add(self.stop.fd(), TOKEN_STOP).map_err(|e| Error::os("epoll_ctl", e))?;
        epoll.add(self.exited.fd(), TOKEN_EXITED).map_err(|e| Error::os("epoll_ctl", e))?;
        epoll.add(self.reload_wake.fd(), TOKEN_RELOAD).map_err(|e| Error::os("epoll_ctl", e))?;
        if let Some(s) = &self.signals {
            epoll.add(s.fd(), TOKEN_SIGNAL).map_err(|e| Error::os("epoll_ctl", e))?;
        }
        if let Some(m) = &self.metrics {
            epoll.add(m.fd(), TOKEN_METRICS).map_err(|e| Error::os("epoll_ctl", e))?;
        }
        let watchdog = self.notifier.watchdog_interval();
        let mut next_watchdog = watchdog.map(|w| Instant::now() + w);
        if watchdog.is_some() {
            // The first ping goes out at once; reactors are woken so that each
            // has turned by the next tick.
            self.watchdog_tick();
        }
        let mut next_status = Instant::now() + STATUS_EVERY;
        let mut next_retired = Instant::now() + RETIRED_EVERY;
        let mut next = 0usize;
        let mut tokens = Vec::new();
        loop {
            let now = Instant::now();
            let mut deadline = next_status;
            if let Some(w) = next_watchdog {
                deadline = deadline.min(w);
            }
            if !self.retired.is_empty() {
                deadline = deadline.min(next_retired);
            }
            if let Some(d) = self.metrics.as_ref().and_then(|m| m.next_deadline()) {
                deadline = deadline.min(d);
            }
            epoll.wait(&mut tokens, Some(deadline.saturating_duration_since(now))).map_err(|e| Error::os("epoll_wait", e))?;
            for &t in &tokens {
                match t {
                    TOKEN_STOP if self.stop.drain() => {
                        tracing::info!("shutdown requested");
                        return Ok(());
                    }
                    TOKEN_SIGNAL => {
                        while let Some(sig) = self.signals.as_ref().and_then(|s| s.read()) {
                            match sig {
                                libc::SIGHUP => {
                                    tracing::info!("received SIGHUP: reloading {}", self.source);
                                    let _ = self.reload(None);
                                }
                                _ => {
                                    let name = if sig == libc::SIGINT { "SIGINT" } else { "SIGTERM" };
                                    tracing::info!("received {name}");
                                    return Ok(());
                                }
                            }
                        }
                    }
                    TOKEN_RELOAD => {
                        self.reload_wake.drain();
                        while let Ok(req) = self.reload_rx.try_recv() {
                            let r = self.reload(req.config);
                            if let Some(reply) = req.reply {
                                let _ = reply.send(r);
                            }
                        }
                    }
                    TOKEN_EXITED => self.reactor_exited()?,
                    TOKEN_METRICS => {
                        if let Some(m) = self.metrics.as_mut() {
                            m.accept(&epoll);
                        }
                    }
                    t if self.metrics.as_ref().is_some_and(|m| m.owns(t)) => {
                        let mut m = self.metrics.take().expect("metrics server");
                        m.ready(t, &epoll, &mut |path| match path {
                            "/metrics" => Some(self.render_metrics()),
                            "/" => Some("rdmablk-target: metrics at /metrics\n".to_owned()),
                            _ => None,
                        });
                        self.metrics = Some(m);
                    }
                    i if (i as usize) < self.listeners.len() => self.accept(i as usize, &mut next),
                    i if i >= TOKEN_NVME && ((i - TOKEN_NVME) as usize) < self.nvme.listeners.len() => {
                        self.accept_nvme((i - TOKEN_NVME) as usize, &mut next)
                    }
                    _ => {}
                }
            }
            let now = Instant::now();
            if let Some(m) = self.metrics.as_mut() {
                m.expire(now, &epoll);
            }
            if let (Some(w), Some(every)) = (next_watchdog, watchdog) {
                if now >= w {
                    self.watchdog_tick();
                    next_watchdog = Some(now + every);
                }
            }
            if now >= next_status {
                self.refresh_status();
                next_status = now + STATUS_EVERY;
            }
            if !self.retired.is_empty() && now >= next_retired {
                self.release_retired();
                next_retired = now + RETIRED_EVERY;
            }
        }
    }

    fn reactor_exited(&mut self) -> Result<()> {
        self.exited.drain();
        // The notification comes from the exiting thread itself, a moment
        // before it counts as finished.
        let t0 = Instant::now();
        while !self.reactors.iter().any(|r| r.thread.as_ref().is_some_and(|t| t.is_finished()))
            && t0.elapsed() < Duration::from_secs(2)
        {
            std::thread::sleep(Duration::from_millis(5));
        }
        for r in &mut self.reactors {
            if r.thread.as_ref().is_some_and(|t| t.is_finished()) {
                let err = r
                    .join()
                    .err()
                    .unwrap_or_else(|| Error::new(ErrorKind::Internal, format!("reactor {} exited unexpectedly", r.id)));
                tracing::error!("reactor {} stopped: {err}", r.id);
                return Err(err);
            }
        }
        Ok(())
    }

    fn accept(&mut self, li: usize, next: &mut usize) {
        loop {
            match self.listeners[li].poll_request() {
                Ok(Some(req)) => {
                    let peer = req.peer();
                    let from = peer.parse::<std::net::SocketAddr>().ok().map(|a| a.ip());
                    let admission = match self.registry.begin_handshake(Protocol::V1, from) {
                        Ok(h) => h,
                        Err(why) => {
                            let reject: &[u8] = match why {
                                HandshakeRefusal::Total => b"target busy: too many connections in their handshake",
                                HandshakeRefusal::PerAddress => b"target busy: too many connections from this address in their handshake",
                                HandshakeRefusal::ConnectionsPerAddress => b"target busy: too many connections from this address",
                            };
                            tracing::warn!("refusing connection from {peer}: {}", self.registry.refusal_reason(Protocol::V1, why));
                            req.reject(reject);
                            continue;
                        }
                    };
                    let r = &self.reactors[reactor::least_loaded(&self.reactors, next)];
                    tracing::debug!("connection request from {} → reactor {}", req.peer(), r.id);
                    let accept = crate::v1::Accept { req, fabric: li, admission };
                    if let Err(back) = r.hand_off(TRANSPORT_V1, Box::new(accept)) {
                        if let Ok(a) = back.downcast::<crate::v1::Accept>() {
                            a.req.reject(b"target is shutting down");
                        }
                    }
                }
                Ok(None) => return,
                Err(e) => {
                    tracing::warn!("{}: connection request failed: {e}", self.listeners[li].local_url());
                    // Keep a persistently failing listener from spinning the loop.
                    std::thread::sleep(Duration::from_millis(10));
                    return;
                }
            }
        }
    }

    /// Hands every connection NVMe-oF listener `li` admitted to the least
    /// loaded reactor.
    fn accept_nvme(&mut self, li: usize, next: &mut usize) {
        let mut incoming = Vec::new();
        self.nvme.accept(li, &mut incoming);
        for conn in incoming {
            let r = &self.reactors[reactor::least_loaded(&self.reactors, next)];
            let sent = match conn {
                crate::nvmf::Incoming::Tcp(a) => r.hand_off(TRANSPORT_NVME_TCP, Box::new(a)),
                crate::nvmf::Incoming::Rdma(a) => r.hand_off(TRANSPORT_NVME_RDMA, Box::new(a)),
            };
            if sent.is_err() {
                tracing::warn!("an NVMe-oF connection found reactor {} gone; dropped", r.id);
            }
        }
    }

    /// Pings systemd when every reactor turned since the last tick, then
    /// wakes them all so that a healthy one has turned by the next.
    fn watchdog_tick(&mut self) {
        let now: Vec<u64> = self.reactor_stats.iter().map(|s| s.heartbeat.get()).collect();
        let stuck: Vec<usize> = if self.heartbeats.len() == now.len() {
            (0..now.len()).filter(|&i| now[i] == self.heartbeats[i]).collect()
        } else {
            Vec::new()
        };
        if stuck.is_empty() {
            self.notifier.notify("WATCHDOG=1");
        } else {
            tracing::warn!("reactor(s) {stuck:?} did not turn since the last watchdog tick; not pinging systemd");
        }
        self.heartbeats = now;
        for r in &self.reactors {
            r.wake();
        }
    }

    fn status_text(&self) -> String {
        let set = self.registry.volumes();
        let sessions = self.sessions.admin().sessions();
        let qps: u64 = self.reactor_stats.iter().map(|r| r.queue_pairs.get()).sum();
        let urls: Vec<String> = self.urls.iter().map(|u| u.to_string()).collect();
        format!(
            "serving {} volume(s) on {} with {} reactor(s); {} session(s), {qps} queue pair(s); {} NVMe controller(s)",
            set.volumes.len(),
            urls.iter().cloned().chain(self.nvme.listeners.iter().map(|(l, _)| l.to_string())).collect::<Vec<_>>().join(" "),
            self.reactors.len(),
            sessions.len(),
            self.nvme.subsystem.live_controllers()
        )
    }

    fn refresh_status(&mut self) {
        if !self.notifier.enabled() {
            return;
        }
        let s = self.status_text();
        if s != self.last_status {
            self.notifier.notify(&notify::status(&s));
            self.last_status = s;
        }
    }

    fn render_metrics(&self) -> String {
        let set = self.registry.volumes();
        let sessions = self.sessions.admin().sessions();
        metrics::render(&metrics::Scrape {
            target: &self.running.name,
            uptime: self.started.elapsed(),
            volumes: set
                .volumes
                .iter()
                .map(|v| metrics::VolumeView {
                    name: &v.name,
                    backend: v.backend.kind_name(),
                    read_only: v.read_only,
                    size: v.size,
                    stats: &v.stats,
                })
                .collect(),
            reactors: &self.reactor_stats,
            chunk_size: self.running.chunk_size as u64,
            sessions: sessions
                .into_iter()
                .map(|s| metrics::SessionView { host: s.host_id, queue_pairs: s.queue_pairs })
                .collect(),
            reloads_ok: self.reloads_ok,
            reloads_failed: self.reloads_failed,
            limits: Some(&self.registry.counters),
            nvme: (!self.nvme.listeners.is_empty())
                .then(|| (&self.nvme.subsystem.stats, self.nvme.subsystem.live_controllers())),
        })
    }

    /// Closes removed volumes nothing uses any more, after an fdatasync.
    fn release_retired(&mut self) {
        let mut keep = Vec::new();
        for v in std::mem::take(&mut self.retired) {
            if Arc::strong_count(&v) > 1 {
                keep.push(v);
                continue;
            }
            if v.backend.writable() {
                if let Err(e) = v.sync() {
                    tracing::error!("removed volume {}: fdatasync failed: {e}", v.name);
                }
            }
            tracing::info!("removed volume {} (id {}) closed", v.name, v.id);
        }
        self.retired = keep;
    }

    fn reload(&mut self, config: Option<Config>) -> Result<ReloadSummary> {
        self.notifier.notify("RELOADING=1");
        let r = match config {
            Some(c) => self.apply(c),
            None => Config::load(Path::new(&self.source)).and_then(|c| self.apply(c)),
        };
        match &r {
            Ok(_) => self.reloads_ok += 1,
            Err(e) => {
                self.reloads_failed += 1;
                tracing::error!("reload failed, the running configuration stays: {e}");
            }
        }
        let status = self.status_text();
        let line = match &r {
            Ok(_) => notify::status(&status),
            Err(e) => notify::status(&format!("{status}; last reload failed: {e}")),
        };
        self.notifier.notify(&format!("READY=1\n{line}"));
        self.last_status = status;
        for h in &self.reactors {
            h.wake();
        }
        r
    }

    fn apply(&mut self, config: Config) -> Result<ReloadSummary> {
        enum Action {
            Keep(Arc<Volume>),
            ReadOnly(Arc<Volume>, Volume),
            Replace(Arc<Volume>, Volume, String),
            Add(Volume),
        }
        // Key files first: a bad one fails the reload before anything changes.
        let mut access = AccessPolicy::load(&config)?;
        log_access(&config);
        let mut summary = ReloadSummary { restart_needed: self.running.changed_keys(&config.target), ..Default::default() };
        if !summary.restart_needed.is_empty() {
            tracing::warn!(
                "reload: {} changed; these take effect at the next start",
                summary.restart_needed.join(", ")
            );
        }
        let (reactors, iopoll) = (self.running.reactors, self.running.iopoll);
        if iopoll {
            if let Some(vc) = config.volumes.iter().find(|v| v.backend == crate::config::BackendKind::Memory) {
                return Err(Error::config(format!(
                    "{}: {}: \"memory\" cannot be served on the running iopoll rings",
                    config.source,
                    vc.key("backend")
                )));
            }
        }
        let current = self.registry.volumes();
        // An rbd owner another gateway took over while it held nothing has
        // not been told: ask Ceph, so that it is reopened as a standby below.
        for v in &current.volumes {
            v.confirm_access();
        }
        // Open what is new first, without the admin lock: this may touch disks.
        let mut actions = Vec::with_capacity(config.volumes.len());
        let mut next_id = self.next_volume_id;
        for vc in &config.volumes {
            let action = match current.by_name(&vc.name) {
                // A gateway another one fenced off from an rbd image comes
                // back under a new client (the old one is blocklisted), as a
                // standby even with lock_at_start: taking the image back is
                // for a host that comes to this gateway, not for a reload.
                Some(old) if old.access() == crate::backend::Access::Fenced && old.config.same_except_read_only(vc) => {
                    let mut standby = vc.clone();
                    if let Some(r) = standby.rbd.as_mut() {
                        r.lock_at_start = false;
                    }
                    let mut v = Volume::open(&config.source, &standby, VolumeId(next_id), reactors, iopoll)?;
                    v.config = vc.clone();
                    // The same namespace to NVMe hosts: a path of theirs, not a new disk.
                    v.nsid = old.nsid;
                    next_id += 1;
                    Action::Replace(Arc::clone(old), v, "fenced off by another gateway: reopened as a standby; access".into())
                }
                Some(old) if old.config.same_except_read_only(vc) && old.read_only == vc.read_only => Action::Keep(Arc::clone(old)),
                Some(old) if old.config.same_except_read_only(vc) => {
                    Action::ReadOnly(Arc::clone(old), old.with_read_only(&config.source, vc, iopoll)?)
                }
                Some(old) => {
                    let what = changed_fields(&old.config, vc);
                    let v = Volume::open(&config.source, vc, VolumeId(next_id), reactors, iopoll)?;
                    next_id += 1;
                    Action::Replace(Arc::clone(old), v, what)
                }
                None => {
                    let v = Volume::open(&config.source, vc, VolumeId(next_id), reactors, iopoll)?;
                    next_id += 1;
                    Action::Add(v)
                }
            };
            actions.push(action);
        }
        // Ids handed out are never handed out again, even if this reload fails.
        self.next_volume_id = next_id;
        let removed: Vec<Arc<Volume>> =
            current.volumes.iter().filter(|v| !config.volumes.iter().any(|vc| vc.name == v.name)).cloned().collect();

        // Decide and publish under the session table's lock: no OPEN can
        // slip between "nobody has it open" and the publication.
        let (registry, sessions) = (Arc::clone(&self.registry), Arc::clone(&self.sessions));
        let admin = sessions.admin();
        let mut served: Vec<Arc<Volume>> = Vec::with_capacity(actions.len() + removed.len());
        let mut retire = Vec::new();
        let mut lines = Vec::new();
        for action in actions {
            match action {
                Action::Keep(v) => served.push(v),
                Action::ReadOnly(old, new) => {
                    lines.push(format!(
                        "volume {} (id {}) is now {}",
                        new.name,
                        new.id,
                        if new.read_only { "read-only" } else { "read-write" }
                    ));
                    summary.read_only_changed.push(new.name.clone());
                    drop(old);
                    served.push(Arc::new(new));
                }
                Action::Replace(old, new, what) => {
                    let users = admin.users_of(old.id);
                    if users.is_empty() {
                        lines.push(format!("volume {} changed ({what}): reopened as id {} (was id {})", new.name, new.id, old.id));
                        summary.replaced.push(new.name.clone());
                        served.push(Arc::new(new));
                        retire.push(old);
                    } else {
                        let why = format!("{what} changed but it is open by {}; keeping the running volume", users.join(", "));
                        tracing::warn!("reload: refusing to change volume {}: {why}", old.name);
                        summary.refused.push((old.name.clone(), why));
                        served.push(old);
                    }
                }
                Action::Add(v) => {
                    lines.push(format!("volume {} added (id {})", v.name, v.id));
                    summary.added.push(v.name.clone());
                    served.push(Arc::new(v));
                }
            }
        }
        for old in removed {
            let users = admin.users_of(old.id);
            if users.is_empty() {
                lines.push(format!("volume {} (id {}) removed", old.name, old.id));
                summary.removed.push(old.name.clone());
                retire.push(old);
            } else {
                let why = format!("it is open by {}; it stays until no session has it open", users.join(", "));
                tracing::warn!("reload: refusing to remove volume {}: {why}", old.name);
                summary.refused.push((old.name.clone(), why));
                served.push(old);
            }
        }
        if served.len() > MAX_VOLUMES {
            return Err(Error::config(format!("{}: volume: {} volumes; at most {MAX_VOLUMES} are served", config.source, served.len())));
        }
        for (i, v) in served.iter().enumerate() {
            v.check_distinct(&config.source, &served[..i])?;
        }
        for v in &served {
            if !config.access.iter().any(|a| a.volume == v.name) {
                access.keep_volume(&v.name, current.access.volume(&v.name));
            }
        }
        let access = Arc::new(access);
        let (grants_changed, hosts_changed) = current.access.changes(&access);
        for name in &grants_changed {
            if let Some(v) = served.iter().find(|v| &v.name == name) {
                let users = admin.users_of(v.id);
                if !users.is_empty() {
                    lines.push(format!(
                        "volume {name}: grants changed; they apply to the next OPEN; sessions that have it open keep \
                         the access they opened it with until they close it or disconnect: {}",
                        users.join(", ")
                    ));
                }
            }
        }
        if hosts_changed {
            lines.push(format!(
                "[[host]] entries or keys changed ({} host(s)); connected queue pairs stay connected, new ones authenticate with the new keys",
                access.host_count()
            ));
        }
        registry.publish(VolumeSet::new(current.generation + 1, served).with_access(access));
        drop(admin);
        for l in &lines {
            tracing::info!("reload: {l}");
        }
        self.retired.extend(retire);
        tracing::info!(
            "reload complete: {} added, {} removed, {} read-only flag(s) changed, {} replaced, {} refused",
            summary.added.len(),
            summary.removed.len(),
            summary.read_only_changed.len(),
            summary.replaced.len(),
            summary.refused.len()
        );
        Ok(summary)
    }
}

fn changed_fields(a: &crate::config::VolumeConfig, b: &crate::config::VolumeConfig) -> String {
    let mut v = Vec::new();
    if a.backend != b.backend {
        v.push("backend");
    }
    if a.path != b.path {
        v.push("path");
    }
    if a.size != b.size {
        v.push("size");
    }
    if a.block_size != b.block_size {
        v.push("block_size");
    }
    if a.read_only != b.read_only {
        v.push("read_only");
    }
    v.join(", ")
}

/// One log line per volume saying who may use it, and whether CONNECT needs
/// authentication.
/// Whether a listener's host is a loopback address (or `localhost`): only
/// this machine reaches it.
fn is_loopback(host: &str) -> bool {
    host.eq_ignore_ascii_case("localhost")
        || host.trim_start_matches('[').trim_end_matches(']').parse::<std::net::IpAddr>().is_ok_and(|ip| ip.is_loopback())
}

/// One warning per listener not on a loopback address that serves volumes
/// to hosts that do not authenticate, naming the listener, the volumes and
/// the fix (logged at WARN by the callers). `v1` and `nvme`: the listeners
/// as the log names them (bound ports at startup, configured ones for
/// `--check`) with their hosts.
fn unauthenticated_warnings(config: &Config, v1: &[(String, &str)], nvme: &[(String, &str)]) -> Vec<String> {
    let names = |f: &dyn Fn(&crate::config::VolumeAccess) -> bool| -> Vec<&str> {
        config.access.iter().filter(|a| f(a)).map(|a| a.volume.as_str()).collect()
    };
    // rdmablk v1: with [[host]] entries every queue pair authenticates with its key.
    let v1_open = if config.hosts.is_empty() { names(&|a| a.allow_any_host) } else { Vec::new() };
    // NVMe-oF: a host without a dhchap_key_file is only the NQN it claims.
    let claimed: Vec<&str> = config.hosts.iter().filter(|h| h.nqn.is_some() && h.dhchap.is_none()).map(|h| h.id.as_str()).collect();
    let nvme_open = if config.hosts.is_empty() {
        v1_open.clone()
    } else {
        names(&|a| {
            (a.allow_any_host && !claimed.is_empty())
                || a.allowed_hosts.iter().chain(&a.read_only_hosts).any(|h| claimed.contains(&h.as_str()))
        })
    };
    let no_hosts = "no [[host]] entries and allow_any_host = true";
    let v1_why = (no_hosts.to_owned(), "add [[host]] entries with a key_file (rdmablk keygen) and grant them the volumes");
    let nvme_why = if config.hosts.is_empty() {
        (no_hosts.to_owned(), "add [[host]] entries with a dhchap_key_file and grant them the volumes")
    } else {
        let who = claimed.join(", ");
        let why = format!("[[host]] {who} without dhchap_key_file, granted by allow_any_host, allowed_hosts or read_only_hosts");
        (why, "give those [[host]] entries a dhchap_key_file")
    };
    let mut out = Vec::new();
    for (listeners, open, (why, fix)) in [(v1, &v1_open, v1_why), (nvme, &nvme_open, nvme_why)] {
        if open.is_empty() {
            continue;
        }
        for (url, _) in listeners.iter().filter(|(_, host)| !is_loopback(host)) {
            out.push(format!(
                "{url} is not a loopback address and serves volume(s) {} to unauthenticated hosts ({why}): anyone who reaches it \
                 can use them; {fix}, or listen on a loopback address",
                open.join(", ")
            ));
        }
    }
    out
}

fn log_access(config: &Config) {
    if config.hosts.is_empty() {
        tracing::info!("no [[host]] entries: queue pairs are not authenticated; only volumes with allow_any_host = true can be opened");
    } else {
        let ids: Vec<&str> = config.hosts.iter().map(|h| h.id.as_str()).collect();
        tracing::info!("authentication required for every queue pair: {} host(s): {}", ids.len(), ids.join(", "));
    }
    for a in &config.access {
        let mut who = Vec::new();
        if a.allow_any_host {
            who.push(if config.hosts.is_empty() { "any host".to_owned() } else { "any authenticated host".to_owned() });
        }
        if !a.allowed_hosts.is_empty() {
            who.push(format!("read-write: {}", a.allowed_hosts.join(", ")));
        }
        if !a.read_only_hosts.is_empty() {
            who.push(format!("read-only: {}", a.read_only_hosts.join(", ")));
        }
        if who.is_empty() {
            tracing::warn!("volume {}: no host may open it (set allowed_hosts, read_only_hosts or allow_any_host)", a.volume);
        } else {
            tracing::info!("volume {} access: {}", a.volume, who.join("; "));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn warnings(text: &str) -> Vec<String> {
        let c = Config::parse(text, "t.toml").unwrap();
        let v1: Vec<(String, &str)> = c.target.listen.iter().map(|u| (u.to_string(), u.host.as_str())).collect();
        let nvme: Vec<(String, &str)> = c.target.nvme_listen.iter().map(|l| (l.to_string(), l.url.host.as_str())).collect();
        unauthenticated_warnings(&c, &v1, &nvme)
    }

    const VOLUMES: &str = "[[volume]]\nname = \"a\"\nbackend = \"null\"\nsize = \"1MiB\"\nallow_any_host = true\n\
                           [[volume]]\nname = \"b\"\nbackend = \"null\"\nsize = \"1MiB\"\n";

    #[test]
    fn volumes_open_to_any_host_on_a_wildcard_listener_are_named() {
        let w = warnings(&format!("[target]\nlisten = [\"tcp://0.0.0.0:7420\", \"nvme+tcp://10.0.0.1:4420\"]\n{VOLUMES}"));
        assert_eq!(w.len(), 2, "{w:?}");
        assert!(w[0].starts_with("tcp://0.0.0.0:7420 is not a loopback address and serves volume(s) a to unauthenticated hosts"), "{w:?}");
        assert!(w[0].contains("no [[host]] entries and allow_any_host = true") && w[0].contains("key_file (rdmablk keygen)"), "{w:?}");
        assert!(w[1].starts_with("nvme+tcp://10.0.0.1:4420 ") && w[1].contains("volume(s) a "), "{w:?}");
        assert!(w[1].contains("add [[host]] entries with a dhchap_key_file"), "{w:?}");
        // Loopback listeners, or no volume open to anyone: nothing to say.
        assert!(warnings(&format!("[target]\nlisten = [\"tcp://127.0.0.1:7420\", \"nvme+tcp://[::1]:4420\"]\n{VOLUMES}")).is_empty());
        assert!(warnings(&format!("[target]\nlisten = [\"tcp://localhost:7420\"]\n{VOLUMES}")).is_empty());
        let closed = "[[volume]]\nname = \"b\"\nbackend = \"null\"\nsize = \"1MiB\"\n";
        assert!(warnings(&format!("[target]\nlisten = [\"tcp://0.0.0.0:7420\"]\n{closed}")).is_empty());
    }

    #[test]
    fn hosts_known_only_by_their_nqn_leave_nvme_listeners_unauthenticated() {
        let hosts = "[[host]]\nid = \"db2\"\nnqn = \"nqn.2014-08.org.example:db2\"\n";
        let w = warnings(&format!("[target]\nlisten = [\"tcp://0.0.0.0:7420\", \"nvme+tcp://0.0.0.0:4420\"]\n{VOLUMES}{hosts}"));
        // rdmablk v1 authenticates every queue pair once there are [[host]] entries.
        assert_eq!(w.len(), 1, "{w:?}");
        assert!(w[0].starts_with("nvme+tcp://0.0.0.0:4420 ") && w[0].contains("volume(s) a "), "{w:?}");
        assert!(w[0].contains("[[host]] db2 without dhchap_key_file"), "{w:?}");
    }

    #[test]
    fn too_little_memlock_names_the_bytes_and_the_fix() {
        let text = format!("[target]\nlisten = [\"tcp://127.0.0.1:0\"]\nreactors = 4\nbuffer_pool = \"16MiB\"\n{VOLUMES}");
        let c = Config::parse(&text, "t.toml").unwrap();
        let e = check_memlock(&c, Some(8 << 20), false).unwrap_err().to_string();
        assert_eq!(
            e,
            "t.toml: target.buffer_pool: the buffer pools need 67108864 bytes (64MiB) locked in memory (target.reactors 4 × \
             target.buffer_pool 16777216 bytes, registered with io_uring) but RLIMIT_MEMLOCK is 8388608 bytes (8MiB); raise it: \
             `ulimit -l 65536` (KiB) in the shell that starts rdmablk-target, or LimitMEMLOCK=infinity in its systemd unit (the \
             shipped unit has it); or lower target.buffer_pool or target.reactors"
        );
        assert!(check_memlock(&c, Some(64 << 20), false).is_ok());
        assert!(check_memlock(&c, None, false).is_ok(), "unlimited");
        assert!(check_memlock(&c, Some(8 << 20), true).is_ok(), "CAP_IPC_LOCK lifts the limit");
    }
}
