//! SIGINT and SIGTERM stop the server in order: a thread of
//! [`StopSignals::stop_on_signal`] receives them (through `signal-hook`,
//! which keeps the signal handler's unsafe code out of this crate) and asks
//! the server to stop.

use std::io;

use signal_hook::consts::{SIGINT, SIGTERM};
use signal_hook::iterator::Signals;

use super::server::Stopper;

/// SIGINT and SIGTERM, caught from the moment it is made: a signal that
/// arrives before [`StopSignals::stop_on_signal`] runs is kept for it
/// instead of ending the process.
pub struct StopSignals {
    signals: Signals,
}

impl StopSignals {
    /// Catches SIGINT and SIGTERM from now on. Call it before starting the
    /// session, so that no signal ends the process half way.
    pub fn catch() -> io::Result<StopSignals> {
        Ok(StopSignals { signals: Signals::new([SIGINT, SIGTERM])? })
    }

    /// Starts a thread that stops the server at the first SIGINT or
    /// SIGTERM (in order: the requests in flight are answered and the
    /// volume is flushed) and gives up waiting at the second
    /// ([`Stopper::give_up`]): a target that went away would otherwise
    /// hold the stop for up to `ctrl_loss_timeout`.
    pub fn stop_on_signal(mut self, stopper: Stopper) -> io::Result<()> {
        std::thread::Builder::new().name("nbd-signals".into()).spawn(move || {
            for sig in self.signals.forever() {
                let name = if sig == SIGINT { "SIGINT" } else { "SIGTERM" };
                if stopper.is_stopping() {
                    tracing::warn!("{name} while stopping: giving up the requests in flight and the final flush");
                    stopper.give_up();
                } else {
                    tracing::info!("{name}: stopping");
                    stopper.stop();
                    // At once: a lost target makes the stop wait, up to ctrl_loss_timeout.
                    stopper.log_the_wait("a second SIGINT or SIGTERM");
                }
            }
        })?;
        Ok(())
    }
}
