//! SIGINT and SIGTERM stop the server in order: a thread waits for them
//! with `sigwait` while every other thread has them blocked.

use std::io;

use super::server::Stopper;

/// SIGINT and SIGTERM, blocked in the calling thread and in every thread
/// it starts afterwards (signal masks are inherited), so that only the
/// thread of [`StopSignals::stop_on_signal`] receives them.
pub struct StopSignals {
    set: libc::sigset_t,
}

impl StopSignals {
    /// Blocks SIGINT and SIGTERM in this thread. Call it before any thread
    /// is started (the session's monitor thread, the server's threads):
    /// one that was started before keeps them unblocked, and a signal
    /// delivered to it would end the process.
    pub fn block() -> io::Result<StopSignals> {
        // SAFETY: an all-zero sigset_t is a valid value to hand to
        // sigemptyset, which initialises it.
        let mut set: libc::sigset_t = unsafe { std::mem::zeroed() };
        // SAFETY: `set` is a valid, exclusively borrowed sigset_t; the
        // signal numbers are valid.
        let rc = unsafe {
            libc::sigemptyset(&mut set);
            libc::sigaddset(&mut set, libc::SIGINT);
            libc::sigaddset(&mut set, libc::SIGTERM);
            libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut())
        };
        if rc != 0 {
            return Err(io::Error::from_raw_os_error(rc));
        }
        Ok(StopSignals { set })
    }

    /// Starts a thread that stops the server at the first SIGINT or
    /// SIGTERM; a later one is logged (the stop is already under way).
    pub fn stop_on_signal(self, stopper: Stopper) -> io::Result<()> {
        std::thread::Builder::new().name("nbd-signals".into()).spawn(move || loop {
            let mut sig: libc::c_int = 0;
            // SAFETY: `self.set` was initialised in `block`; `sig` is a
            // valid out-pointer.
            let rc = unsafe { libc::sigwait(&self.set, &mut sig) };
            if rc != 0 {
                tracing::error!("sigwait failed: {}", io::Error::from_raw_os_error(rc));
                return;
            }
            let name = if sig == libc::SIGINT { "SIGINT" } else { "SIGTERM" };
            if stopper.is_stopping() {
                tracing::info!("{name}: already stopping, waiting for the requests in flight");
            } else {
                tracing::info!("{name}: stopping");
                stopper.stop();
            }
        })?;
        Ok(())
    }
}
