//! Signals: the ones `distrun` receives (to forward), and sending them to process groups.

use std::sync::atomic::{AtomicI32, Ordering};

/// The last signal received among SIGINT, SIGTERM, SIGHUP; 0 for none.
static PENDING: AtomicI32 = AtomicI32::new(0);

extern "C" fn on_signal(sig: libc::c_int) {
    // Async-signal-safe: a single atomic store.
    PENDING.store(sig, Ordering::SeqCst);
}

/// Catches SIGINT, SIGTERM and SIGHUP, so that they stop the ranks instead of orphaning them.
/// A signal that `distrun` was started ignoring stays ignored, for the ranks too (they
/// inherit the disposition through `exec`): `nohup distrun ... &` must outlive the shell's
/// SIGHUP at logout, and a background job its terminal's SIGINT.
pub(crate) fn install() {
    for sig in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP] {
        if ignored(sig) {
            continue;
        }
        let handler = on_signal as extern "C" fn(libc::c_int);
        // SAFETY: `on_signal` is async-signal-safe (one atomic store) and lives for the whole
        // program; `signal` has no other precondition.
        unsafe {
            libc::signal(sig, handler as libc::sighandler_t);
        }
    }
}

/// Whether `sig`'s disposition is "ignore" (as `nohup` leaves SIGHUP).
fn ignored(sig: libc::c_int) -> bool {
    // SAFETY: `sigaction` with a null new action only reads the current one into `old`, a
    // valid, writable `sigaction` (all-zero bytes are a valid value of that plain C struct).
    unsafe {
        let mut old: libc::sigaction = std::mem::zeroed();
        libc::sigaction(sig, std::ptr::null(), &mut old) == 0 && old.sa_sigaction == libc::SIG_IGN
    }
}

/// The signal received since [`install`], if any.
pub(crate) fn pending() -> Option<i32> {
    match PENDING.load(Ordering::SeqCst) {
        0 => None,
        s => Some(s),
    }
}

/// Sends `sig` to the process group `pgid` (each rank leads its own group, so this reaches
/// whatever the rank started too). Errors (the group is gone) are ignored.
pub(crate) fn kill_group(pgid: u32, sig: i32) {
    let Ok(pgid) = libc::pid_t::try_from(pgid) else {
        return;
    };
    if pgid <= 1 {
        return;
    }
    // SAFETY: `kill` has no memory-safety preconditions; a negative pid names a process group,
    // and `pgid > 1` rules out "every process" (-1) and our own group (0).
    unsafe {
        libc::kill(-pgid, sig);
    }
}

/// `SIGTERM`, `SIGKILL`, ... or `signal 42`.
pub(crate) fn name(sig: i32) -> String {
    let n = match sig {
        libc::SIGHUP => "SIGHUP",
        libc::SIGINT => "SIGINT",
        libc::SIGQUIT => "SIGQUIT",
        libc::SIGILL => "SIGILL",
        libc::SIGTRAP => "SIGTRAP",
        libc::SIGABRT => "SIGABRT",
        libc::SIGBUS => "SIGBUS",
        libc::SIGFPE => "SIGFPE",
        libc::SIGKILL => "SIGKILL",
        libc::SIGUSR1 => "SIGUSR1",
        libc::SIGSEGV => "SIGSEGV",
        libc::SIGUSR2 => "SIGUSR2",
        libc::SIGPIPE => "SIGPIPE",
        libc::SIGALRM => "SIGALRM",
        libc::SIGTERM => "SIGTERM",
        _ => return format!("signal {sig}"),
    };
    n.to_owned()
}
