//! Seeing that a rank exited without reaping it.
//!
//! Each rank leads its own process group, whose id is the rank's pid, and the launcher
//! signals that group when it stops the job, also for ranks that already exited (what they
//! started dies with them). Once a rank is reaped its pid is free: a process started since
//! could have it, lead a group of the same id, and receive the launcher's SIGKILL. So ranks
//! are watched with `waitid(WNOWAIT)`, which reads the exit but leaves the zombie holding
//! the pid, and reaped only after the last signal to their group ([`reap`]).

use std::io;
use std::os::unix::process::ExitStatusExt;
use std::process::{Child, ExitStatus};

/// The child's exit status if it has exited, leaving it unreaped; `None` while it runs.
pub(crate) fn exited(child: &Child) -> io::Result<Option<ExitStatus>> {
    let pid = libc::id_t::from(child.id());
    // SAFETY: `siginfo_t` is a plain C struct for which all-zero bytes are valid (and
    // `si_pid` 0 is how `WNOHANG` says nothing exited); `waitid` writes only into `info`,
    // a valid, writable value that lives through the call.
    let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
    // SAFETY: as above; `P_PID` with our own child's pid touches no other process, and
    // `WNOWAIT` leaves the child waitable, so `Child::wait` still reaps it later.
    let rc = unsafe {
        libc::waitid(
            libc::P_PID,
            pid,
            &mut info,
            libc::WEXITED | libc::WNOHANG | libc::WNOWAIT,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: after a successful `waitid` the kernel filled the SIGCHLD fields of `info`
    // (or left them zero), which is what `si_pid` and `si_status` read.
    let (who, status) = unsafe { (info.si_pid(), info.si_status()) };
    if who == 0 {
        return Ok(None);
    }
    Ok(Some(decode(info.si_code, status)))
}

/// The wait status `waitpid` would have given for `waitid`'s `si_code` and `si_status`.
fn decode(code: libc::c_int, status: libc::c_int) -> ExitStatus {
    let raw = match code {
        libc::CLD_EXITED => (status & 0xff) << 8,
        libc::CLD_DUMPED => (status & 0x7f) | 0x80,
        // CLD_KILLED; the stop and continue codes need WSTOPPED / WCONTINUED, not asked for.
        _ => status & 0x7f,
    };
    ExitStatus::from_raw(raw)
}

/// Reaps every child in `children` (waits for it): call once the last signal to their groups
/// went. A child that still runs is waited for; the caller killed the ones it would not wait for.
pub(crate) fn reap<'a>(children: impl IntoIterator<Item = &'a mut Child>) {
    for child in children {
        let _ = child.wait();
    }
}

#[cfg(test)]
mod tests {
    use super::exited;
    use std::os::unix::process::ExitStatusExt;
    use std::process::{Child, Command};
    use std::time::{Duration, Instant};

    fn sh(script: &str) -> Child {
        Command::new("sh").arg("-c").arg(script).spawn().unwrap()
    }

    /// Polls [`exited`] until it reports; a child of `sh -c` ends within seconds.
    fn poll(child: &Child) -> std::process::ExitStatus {
        let give_up = Instant::now() + Duration::from_secs(60);
        loop {
            if let Some(st) = exited(child).unwrap() {
                return st;
            }
            assert!(
                Instant::now() < give_up,
                "child {} never exited",
                child.id()
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    fn zombie(pid: u32) -> bool {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
        // The state follows the command's closing parenthesis.
        let after = &stat[stat.rfind(')').unwrap() + 1..];
        after.trim_start().starts_with('Z')
    }

    #[test]
    fn exits_read_without_reaping_match_what_wait_then_reaps() {
        for script in [
            "exit 0",
            "exit 3",
            "exit 255",
            "kill -9 $$",
            "kill -TERM $$",
        ] {
            let mut child = sh(script);
            let seen = poll(&child);
            // Still unreaped: the pid (and so the process group id) stays the child's.
            assert!(zombie(child.id()), "{script}: reaped by the look");
            assert_eq!(
                exited(&child).unwrap(),
                Some(seen),
                "{script}: a second look"
            );
            let reaped = child.wait().unwrap();
            assert_eq!(seen, reaped, "{script}");
            assert_eq!(
                (seen.code(), seen.signal()),
                (reaped.code(), reaped.signal())
            );
        }
    }

    #[test]
    fn a_running_child_is_not_exited() {
        let mut child = sh("exec sleep 600");
        assert_eq!(exited(&child).unwrap(), None);
        child.kill().unwrap();
        assert_eq!(poll(&child).signal(), Some(9));
        assert!(zombie(child.id()));
        super::reap([&mut child]);
        // Reaped: std's cached status, the one the look saw.
        assert_eq!(child.try_wait().unwrap().and_then(|s| s.signal()), Some(9));
    }
}
