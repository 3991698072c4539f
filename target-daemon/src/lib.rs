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
//! - [`config`]: the TOML configuration and its validation.
//! - [`backend`]: volumes and their backends (`file`, `memory`, `null`).
//! - [`command`]: what a received command asks for, as a pure function.
//! - [`error`]: the crate's error type and its mapping to wire statuses.
//! - [`pool`]: registered memory (the chunk pool, receive/response slots).
//! - [`uring`]: the io_uring engine (fixed files, fixed buffers, restrictions).
//! - [`blocking`]: a reactor's helper thread for the few blocking calls.
//! - [`fault`]: test-only fault injection (disk writes held on demand).
//! - [`session`]: state shared by reactors (volume set, sessions).
//! - [`engine`]: the block engine (ring, pool, fixed files, blocking worker)
//!   that every front end's thread owns one of.
//! - [`reactor`]: reactor threads (fabric CQs + queue pairs + an engine):
//!   the rdmablk v1 front end.
//! - [`nvmf`]: the NVMe over Fabrics front end and its NVMe/TCP transport.
//! - [`readahead`]: sequential readahead bookkeeping (streams, cached chunks).
//! - [`metrics`]: lock-free counters, Prometheus text, the HTTP responder.
//! - [`notify`]: systemd notifications (READY, STATUS, WATCHDOG).
//! - [`target`]: start/stop, the control thread, signals, reload.
//! - [`sys`]: thin wrappers over Linux calls std lacks.
//!
//! `unsafe` lives only in `pool`, `uring` and `sys`; every block carries a
//! `// SAFETY:` comment.

pub mod auth;
pub mod backend;
pub mod fault;
pub mod config;
pub mod error;
pub mod engine;
pub mod metrics;
pub mod nvmf;
/// systemd notifications live in `rdmablk-common`, shared with the `rdmablk` CLI.
pub use rdmablk_common::notify;
pub mod reactor;
pub mod registry;
pub mod sys;
pub mod target;
pub mod v1;

pub use config::Config;
pub use error::{Error, ErrorKind, Result};
pub use target::{check, run, ReloadSummary, RunningTarget, StopHandle, Target};
