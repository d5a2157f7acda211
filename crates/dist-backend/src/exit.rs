//! What a process does when it leaves: the teardown hooks that run at exit.
//!
//! A rank that returns from `main` (or calls `std::process::exit`) while it still holds a
//! process group must not make any other rank fail. The kernel would close its sockets with no
//! goodbye, and a peer reading them could not tell a clean exit from a crash. So the crates
//! that own connections register hooks here, and one C `atexit` handler runs them, in two
//! stages:
//!
//! 1. [`ExitStage::Groups`]: process groups say goodbye to their peers, and the rank that
//!    hosts the rendezvous store keeps serving it until every rank has left (`dist-collective`).
//! 2. [`ExitStage::Connections`]: connections that were closed wait, up to their timeout,
//!    until each peer has closed its end too, so no byte either side sent is lost to a reset
//!    (`dist-gloo`).
//!
//! The hooks run when `main` returns, on `std::process::exit` and after a panic unwinds out of
//! `main`; not on `abort` or a fatal signal (a peer then sees a crash, which is what it is).
//! On targets without `atexit` (non-Unix) registration is a no-op and the hooks run only when
//! called through [`run_stage`].

use std::sync::{Mutex, Once};

/// When a hook runs relative to the others.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
#[non_exhaustive]
pub enum ExitStage {
    /// Tear down process groups (goodbyes, the store host's wait for every rank to leave).
    Groups,
    /// Finish closing connections (wait for each peer's end of the close).
    Connections,
}

/// A registered hook and its stage.
type Hook = (ExitStage, fn());

static HOOKS: Mutex<Vec<Hook>> = Mutex::new(Vec::new());
static INSTALL: Once = Once::new();

/// Registers `hook` to run at process exit in `stage` (once, however often it is registered).
/// Hooks of one stage run in registration order; every `Groups` hook runs before any
/// `Connections` hook.
pub fn at_exit(stage: ExitStage, hook: fn()) {
    {
        let mut hooks = HOOKS.lock().unwrap_or_else(|e| e.into_inner());
        if hooks
            .iter()
            .any(|&(s, h)| s == stage && std::ptr::fn_addr_eq(h, hook))
        {
            return;
        }
        hooks.push((stage, hook));
    }
    INSTALL.call_once(install);
}

/// Runs the hooks of `stage` now (they stay registered and run again at exit; each hook is
/// written to be cheap when it has nothing left to do).
pub fn run_stage(stage: ExitStage) {
    let hooks: Vec<fn()> = HOOKS
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .iter()
        .filter(|(s, _)| *s == stage)
        .map(|&(_, h)| h)
        .collect();
    for h in hooks {
        // A failing hook must not keep the others from running, nor unwind into libc.
        if std::panic::catch_unwind(h).is_err() {
            tracing::error!(?stage, "an exit hook panicked");
        }
    }
}

extern "C" fn run_all() {
    run_stage(ExitStage::Groups);
    run_stage(ExitStage::Connections);
}

#[cfg(unix)]
#[allow(
    unsafe_code,
    reason = "registering with atexit has no safe std equivalent"
)]
fn install() {
    // SAFETY: `atexit` only stores the function pointer. `run_all` is an `extern "C" fn()`
    // with no arguments, as atexit requires; it never unwinds (every hook runs under
    // `catch_unwind`) and touches only this module's statics and what the hooks own, all of
    // which live for the whole process (statics are never destroyed in Rust).
    let rc = unsafe { libc::atexit(run_all) };
    if rc != 0 {
        tracing::warn!(
            "atexit refused the teardown hook: peers may see this process's exit as a crash"
        );
    }
}

#[cfg(not(unix))]
fn install() {}
