//! Starting, running and stopping a target: the control thread.
//!
//! The control thread owns the listeners, hands each connection request to
//! a reactor (round-robin, through a channel and an eventfd), and on
//! SIGINT/SIGTERM (binary) or [`RunningTarget::shutdown`] (library) stops
//! accepting, lets in-flight commands finish (bounded by
//! `shutdown_timeout`), fdatasyncs every writable volume and returns.

use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use rdmablk_common::fabric::{Fabric, FabricUrl, Listener};

use crate::backend::{self, Volume};
use crate::config::Config;
use crate::error::{Error, ErrorKind, Result};
use crate::reactor::{self, Control, ReactorHandle, ReactorSpec};
use crate::sys::{self, Epoll, EventFd, SignalFd};

/// Entry point for starting targets.
pub struct Target;

impl Target {
    /// Opens the volumes, listens on every configured URL (port 0 picks a
    /// free port; see [`RunningTarget::urls`]), starts the reactors and the
    /// control thread, and returns once the target accepts connections.
    /// Signals are left alone: stop it with [`RunningTarget::shutdown`].
    pub fn start(config: Config) -> Result<RunningTarget> {
        start(config, None)
    }
}

/// Runs a target until SIGINT or SIGTERM, then shuts it down cleanly.
/// Blocks the two signals in the calling thread first (threads started
/// afterwards inherit the mask), so call it before starting other threads.
pub fn run(config: Config) -> Result<()> {
    let signals = SignalFd::block_term_signals().map_err(|e| Error::os("cannot set up signal handling", e))?;
    start(config, Some(signals))?.wait()
}

/// Validates the configuration and every volume without creating or
/// changing anything. Returns one line per volume, then one per listen URL.
pub fn check(config: &Config) -> Result<Vec<String>> {
    let mut lines = backend::check_volumes(config)?;
    lines.extend(config.target.listen.iter().map(|u| format!("listen {u}")));
    Ok(lines)
}

/// A started target.
pub struct RunningTarget {
    urls: Vec<FabricUrl>,
    stop: Arc<EventFd>,
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

    /// The first bound listen URL.
    pub fn url(&self) -> &FabricUrl {
        &self.urls[0]
    }

    /// A handle that starts the shutdown from elsewhere.
    pub fn stop_handle(&self) -> StopHandle {
        StopHandle(Arc::clone(&self.stop))
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

const TOKEN_STOP: u64 = 1 << 40;
const TOKEN_SIGNAL: u64 = (1 << 40) + 1;
const TOKEN_EXITED: u64 = (1 << 40) + 2;

fn start(config: Config, signals: Option<SignalFd>) -> Result<RunningTarget> {
    let cfg = config.target.clone();
    let volumes = Arc::new(backend::open_volumes(&config)?);

    let mut fabrics = Vec::with_capacity(cfg.listen.len());
    let mut listeners = Vec::with_capacity(cfg.listen.len());
    let mut urls = Vec::with_capacity(cfg.listen.len());
    for url in &cfg.listen {
        let f = Fabric::open(url).map_err(|e| Error::fabric(format!("{url}: cannot open the fabric"), e))?;
        let l = f.listen().map_err(|e| Error::fabric(format!("{url}: cannot listen"), e))?;
        urls.push(l.local_url());
        fabrics.push(Arc::new(f));
        listeners.push(l);
    }

    let exited = Arc::new(EventFd::new().map_err(|e| Error::os("eventfd", e))?);
    let cpus = sys::allowed_cpus();
    let mut reactors: Vec<ReactorHandle> = Vec::with_capacity(cfg.reactors);
    for id in 0..cfg.reactors {
        let spec = ReactorSpec {
            id,
            cfg: cfg.clone(),
            volumes: Arc::clone(&volumes),
            fabrics: fabrics.clone(),
            cpu: cfg.pin_reactors.then(|| cpus[id % cpus.len()]),
            exited: Arc::clone(&exited),
        };
        match reactor::spawn(spec) {
            Ok(h) => reactors.push(h),
            Err(e) => {
                stop_reactors(&mut reactors, Instant::now());
                return Err(e);
            }
        }
    }
    tracing::info!(
        "target {:?}: {} reactor(s), {} volume(s), queue depth {}, max I/O {} bytes",
        cfg.name,
        cfg.reactors,
        volumes.len(),
        cfg.queue_depth,
        cfg.max_io_size
    );
    for u in &urls {
        tracing::info!("listening on {u}");
    }

    let stop = Arc::new(EventFd::new().map_err(|e| Error::os("eventfd", e))?);
    let ctl = ControlThread {
        listeners,
        reactors,
        volumes,
        stop: Arc::clone(&stop),
        signals,
        exited,
        shutdown_timeout: cfg.shutdown_timeout,
    };
    let control = std::thread::Builder::new()
        .name("rdmablk-ctl".into())
        .spawn(move || ctl.run())
        .map_err(|e| Error::os("cannot spawn the control thread", e))?;
    Ok(RunningTarget { urls, stop, control: Some(control) })
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
    reactors: Vec<ReactorHandle>,
    volumes: Arc<Vec<Volume>>,
    stop: Arc<EventFd>,
    signals: Option<SignalFd>,
    exited: Arc<EventFd>,
    shutdown_timeout: Duration,
}

impl ControlThread {
    fn run(mut self) -> Result<()> {
        let mut failure = self.serve().err();
        drop(std::mem::take(&mut self.listeners));
        tracing::info!("shutting down: no new connections; waiting up to {:?} for in-flight commands", self.shutdown_timeout);
        let deadline = Instant::now() + self.shutdown_timeout;
        if let Some(e) = stop_reactors(&mut self.reactors, deadline) {
            failure.get_or_insert(e);
        }
        for v in self.volumes.iter().filter(|v| !v.read_only) {
            if let Err(e) = v.sync() {
                tracing::error!("volume {}: fdatasync failed: {e}", v.name);
                failure.get_or_insert(Error::with_source(ErrorKind::Volume, format!("volume {}: fdatasync failed", v.name), e));
            }
        }
        match failure {
            None => {
                tracing::info!("shutdown complete");
                Ok(())
            }
            Some(e) => Err(e),
        }
    }

    /// Accepts connections until asked to stop; an error means a reactor died.
    fn serve(&mut self) -> Result<()> {
        let epoll = Epoll::new().map_err(|e| Error::os("epoll_create", e))?;
        for (i, l) in self.listeners.iter().enumerate() {
            epoll.add(l.fd(), i as u64).map_err(|e| Error::os("epoll_ctl", e))?;
        }
        epoll.add(self.stop.fd(), TOKEN_STOP).map_err(|e| Error::os("epoll_ctl", e))?;
        epoll.add(self.exited.fd(), TOKEN_EXITED).map_err(|e| Error::os("epoll_ctl", e))?;
        if let Some(s) = &self.signals {
            epoll.add(s.fd(), TOKEN_SIGNAL).map_err(|e| Error::os("epoll_ctl", e))?;
        }
        let mut next = 0usize;
        let mut tokens = Vec::new();
        loop {
            epoll.wait(&mut tokens, None).map_err(|e| Error::os("epoll_wait", e))?;
            for &t in &tokens {
                match t {
                    TOKEN_STOP => {
                        if self.stop.drain() {
                            tracing::info!("shutdown requested");
                            return Ok(());
                        }
                    }
                    TOKEN_SIGNAL => {
                        if let Some(sig) = self.signals.as_ref().and_then(|s| s.read()) {
                            let name = if sig == libc::SIGINT { "SIGINT" } else { "SIGTERM" };
                            tracing::info!("received {name}");
                            return Ok(());
                        }
                    }
                    TOKEN_EXITED => {
                        self.exited.drain();
                        // The notification comes from the exiting thread itself,
                        // a moment before it counts as finished.
                        let t0 = Instant::now();
                        while !self.reactors.iter().any(|r| r.thread.as_ref().is_some_and(|t| t.is_finished()))
                            && t0.elapsed() < Duration::from_secs(2)
                        {
                            std::thread::sleep(Duration::from_millis(5));
                        }
                        for r in &mut self.reactors {
                            if r.thread.as_ref().is_some_and(|t| t.is_finished()) {
                                let err = r.join().err().unwrap_or_else(|| {
                                    Error::new(ErrorKind::Internal, format!("reactor {} exited unexpectedly", r.id))
                                });
                                tracing::error!("reactor {} stopped: {err}", r.id);
                                return Err(err);
                            }
                        }
                    }
                    i => self.accept(i as usize, &mut next),
                }
            }
        }
    }

    fn accept(&mut self, li: usize, next: &mut usize) {
        loop {
            match self.listeners[li].poll_request() {
                Ok(Some(req)) => {
                    let r = &self.reactors[*next % self.reactors.len()];
                    *next += 1;
                    tracing::debug!("connection request from {} → reactor {}", req.peer(), r.id);
                    if let Err(Control::Connect { req, .. }) = r.send(Control::Connect { req, fabric: li }) {
                        req.reject(b"target is shutting down");
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
}
