//! Ctrl-C (SIGINT) during `sparda generate`, `perplexity` and `bench`.
//!
//! [`install`] sets a SIGINT handler. The first Ctrl-C only sets a flag
//! ([`requested`]); the long loops check it between units of work — the
//! generation loop before each decode step, the CPU and GPU prefill between
//! chunks, perplexity before each chunk and scored position, the benchmark
//! between cells — and stop there: the run then finishes its trace
//! (`--trace`), removes its temporary files, writes no result file
//! (`--json`, `--save-logits`: an interrupted run's figures are not the
//! run's), prints what it completed on stderr and exits with
//! [`EXIT_CODE`] (130, as shells report a process ended by SIGINT). A
//! second Ctrl-C exits at once with the same code (nothing is flushed).
//!
//! The handler only stores to atomics and calls `_exit`, both
//! async-signal-safe. Nothing sets the flag but the handler, so library
//! users that never call [`install`] never see it.

use crate::{Error, Result};
use std::sync::atomic::{AtomicBool, Ordering};

/// Exit code of a run stopped by Ctrl-C: 128 + SIGINT (2), what a shell
/// reports for a process a SIGINT ended.
pub const EXIT_CODE: i32 = 130;

/// Set by the first Ctrl-C.
static REQUESTED: AtomicBool = AtomicBool::new(false);

/// Whether Ctrl-C was pressed since [`install`].
pub fn requested() -> bool {
    REQUESTED.load(Ordering::Relaxed)
}

/// `Err(Error::Interrupted(at))` once Ctrl-C was pressed, else `Ok(())`:
/// what loops call between units of work (`at` names the point, e.g.
/// "prefill chunk 3 of 8").
///
/// Errors: [`Error::Interrupted`] naming `at()`.
pub fn check(at: impl FnOnce() -> String) -> Result<()> {
    if requested() {
        Err(Error::Interrupted(at()))
    } else {
        Ok(())
    }
}

#[cfg(unix)]
extern "C" fn on_sigint(_sig: libc::c_int) {
    // A second Ctrl-C: leave at once (async-signal-safe).
    if REQUESTED.swap(true, Ordering::SeqCst) {
        // SAFETY: _exit is async-signal-safe and never returns.
        unsafe { libc::_exit(EXIT_CODE) };
    }
}

/// Installs the SIGINT handler described in the module doc (once per
/// process; later calls reinstall the same handler). On platforms without
/// POSIX signals it does nothing and Ctrl-C keeps its default effect.
///
/// Errors: [`Error::Input`] when `sigaction` fails, with the OS error.
pub fn install() -> Result<()> {
    #[cfg(unix)]
    {
        // SAFETY: a zeroed sigaction is a valid "no flags, empty mask" value;
        // the handler is an `extern "C" fn(c_int)` that only touches atomics
        // and _exit. SA_RESTART keeps blocking reads and writes going.
        let r = unsafe {
            let mut sa: libc::sigaction = std::mem::zeroed();
            sa.sa_sigaction = on_sigint as extern "C" fn(libc::c_int) as libc::sighandler_t;
            sa.sa_flags = libc::SA_RESTART;
            libc::sigemptyset(&mut sa.sa_mask);
            libc::sigaction(libc::SIGINT, &sa, std::ptr::null_mut())
        };
        if r != 0 {
            return Err(Error::Input(format!(
                "installing the Ctrl-C (SIGINT) handler: sigaction: {}",
                std::io::Error::last_os_error()
            )));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn check_names_the_point_only_once_requested() {
        // Nothing in this process sets the flag but a SIGINT.
        assert!(!requested());
        assert!(check(|| unreachable!("not requested")).is_ok());
        let e = Error::Interrupted("decode step 3".into());
        assert_eq!(e.to_string(), "interrupted (Ctrl-C) at decode step 3");
        assert_eq!(EXIT_CODE, 128 + 2);
    }
}
