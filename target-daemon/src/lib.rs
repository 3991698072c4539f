//! rdmablk target: exports volumes (regular files or block devices) over
//! the fabric with direct data placement, in the style of NVMe-oF/RDMA.
//!
//! # Starting a target from a test
//!
//! ```no_run
//! use rdmablk_target::{Config, Target};
//!
//! let config = Config::parse(
//!     r#"
//!     [target]
//!     listen = ["tcp://127.0.0.1:0"]   # port 0: pick a free port
//!     reactors = 1
//!     buffer_pool = "4MiB"
//!
//!     [[volume]]
//!     name = "vol0"
//!     backend = "file"
//!     path = "/tmp/vol0.img"
//!     size = "64MiB"
//!     allow_any_host = true            # no [[host]] entries: any initiator
//!     "#,
//!     "inline config",
//! )?;
//! let target = Target::start(config)?;      // returns once it accepts connections
//! let url = target.url().clone();           // e.g. tcp://127.0.0.1:41234
//! // ... connect an initiator to `url` ...
//! target.shutdown()?;                        // finish in-flight commands, fdatasync, stop
//! # Ok::<(), rdmablk_target::Error>(())
//! ```
//!
//! The binary (`rdmablk-target --config FILE [--check] [--log-format text|json]`)
//! calls [`run`] (or [`check`]) and logs `listening on tcp://HOST:PORT` at
//! info level for every bound URL (and `metrics endpoint: http://ADDR/metrics`
//! when `[target] metrics` is set). SIGHUP reloads the configuration file,
//! SIGTERM/SIGINT stop cleanly; under systemd (`NOTIFY_SOCKET`) it sends
//! READY, STATUS and WATCHDOG notifications. A library user reloads with
//! [`RunningTarget::reload`].
//!
//! # Layout
//!
//! Bottom to top (each module uses only those above it in this list):
//! - [`error`], [`sys`], [`config`], [`fault`]: the crate's error type, thin
//!   wrappers over Linux calls, the TOML configuration, test-only fault
//!   injection.
//! - [`auth`]: rdmablk v1 authentication and every front end's grants.
//! - [`metrics`]: lock-free counters, Prometheus text, the HTTP responder.
//! - [`backend`]: volumes and their backends (`file`, `memory`, `null`),
//!   the published volume set.
//! - [`engine`]: the storage engine of one reactor: the io_uring ring,
//!   the registered buffer pool, the blocking worker, readahead, and the
//!   executor that carries out every front end's disk commands on them.
//! - [`registry`]: what every front end shares across reactors: the
//!   volume set, connection admission, wake-ups and the fence generation.
//! - [`reactor`]: the runtime: a thread per core that runs the executor
//!   and every transport's queues, its sleep and wake-ups, and the
//!   [`reactor::Transport`] trait a protocol front end implements.
//! - The protocol front ends, which decode their wire and plan, each a
//!   set of transports on the runtime: [`v1`] (rdmablk v1 over `tcp://`
//!   and `rdma://`) and [`nvmf`] (NVMe over Fabrics: NVMe/TCP and
//!   NVMe/RDMA).
//! - [`target`]: start/stop, the control thread (listeners, signals,
//!   reload, metrics, systemd), which hands each new connection to a
//!   reactor's transport.
//!
//! `unsafe` lives only in `engine` (the pool, the ring) and `sys`; every
//! block carries a `// SAFETY:` comment.

pub mod error;
pub mod sys;
pub mod config;
pub mod fault;
pub mod auth;
pub mod metrics;
pub mod backend;
pub mod engine;
pub mod registry;
pub mod reactor;
pub mod v1;
pub mod nvmf;
pub mod target;
pub mod cli;
/// systemd notifications live in `rdmablk-common`, shared with the `rdmablk` CLI.
pub use rdmablk_common::notify;

pub use config::Config;
pub use error::{Error, ErrorKind, Result};
pub use target::{check, run, ReloadSummary, RunningTarget, StopHandle, Target};
