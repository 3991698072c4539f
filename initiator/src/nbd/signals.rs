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
    /// SIGTERM; a later one is logged (the stop is already under way).
    pub fn stop_on_signal(mut self, stopper: Stopper) -> io::Result<()> {
        std::thread::Builder::new().name("nbd-signals".into()).spawn(move || {
            for sig in self.signals.forever() {
                let name = if sig == SIGINT { "SIGINT" } else { "SIGTERM" };
                if stopper.is_stopping() {
                    tracing::info!("{name}: already stopping, waiting for the requests in flight");
                } else {
                    tracing::info!("{name}: stopping");
                    stopper.stop();
                }
            }
        })?;
        Ok(())
    }
}
