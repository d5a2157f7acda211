//! Which rank's failure caused the others'.
//!
//! The first rank seen to exit is often not the one that failed first. A rank that panics
//! tears its groups down on the way out, which tells every peer at once; they fail, exit, and
//! may all be seen in the same poll as the rank that caused it, or before it (its teardown
//! waits for their ends of the connections). Polling order would then name whichever rank
//! comes first locally: 10 runs of 4 ranks, rank 2 panicking mid all_reduce, named rank 0 or
//! rank 1 every time.
//!
//! The error files say when each error happened: a rank writes its file at the moment of the
//! error (`record_panics` does it in the panic hook, before anything is torn down), with the
//! time in nanoseconds, so the earliest file is the root cause, as torch's launcher takes it
//! (torch's own files, dated in whole seconds, by their modification time). A rank killed by a signal
//! (a crash, the OOM killer) writes nothing, and its peers' files follow its death within
//! milliseconds; so a file counts as earlier than a crash only where it was written before the
//! last poll that found every rank running. Such a rank may even be seen to end after its
//! peers, so distrun waits a little for the ranks still running before it names one
//! (`group::settle`).

use std::time::SystemTime;

/// What is known of one rank when a failure is first seen.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Candidate {
    /// When its error file was written, if it wrote one (it may still be running).
    pub(crate) written: Option<SystemTime>,
    /// Whether it was seen to have failed in this poll.
    pub(crate) failed_now: bool,
    /// Whether, failing now, it was killed by a signal (nobody had been signalled yet).
    pub(crate) crashed: bool,
}

/// The index of the rank whose failure came first. `quiet` is when the last poll that found
/// every rank running started; at least one candidate has `failed_now`.
pub(crate) fn root_cause(ranks: &[Candidate], quiet: Option<SystemTime>) -> usize {
    let earliest_file = |before: Option<SystemTime>| {
        ranks
            .iter()
            .enumerate()
            .filter_map(|(i, c)| Some((c.written?, i)))
            .filter(|&(t, _)| before.is_none_or(|b| t <= b))
            .min()
            .map(|(_, i)| i)
    };
    // An error written while every rank still ran came before any failure seen now.
    if let Some(q) = quiet
        && let Some(i) = earliest_file(Some(q))
    {
        return i;
    }
    // A crash that wrote nothing (SIGKILL, the OOM killer); one that wrote a file (a panic
    // hook's, then an abort) is dated by it like any other.
    if let Some(i) = ranks
        .iter()
        .position(|c| c.failed_now && c.crashed && c.written.is_none())
    {
        return i;
    }
    earliest_file(None)
        .or_else(|| ranks.iter().position(|c| c.failed_now))
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn at(ms: u64) -> Option<SystemTime> {
        Some(SystemTime::UNIX_EPOCH + Duration::from_millis(ms))
    }

    fn exited(written: Option<SystemTime>) -> Candidate {
        Candidate {
            written,
            failed_now: true,
            crashed: false,
        }
    }

    const RUNNING: Candidate = Candidate {
        written: None,
        failed_now: false,
        crashed: false,
    };

    #[test]
    fn the_earliest_error_wins_over_the_ranks_seen_first() {
        // Ranks 0, 1 and 3 exited on hearing of rank 2's panic; rank 2 still tears down.
        let ranks = [
            exited(at(1003)),
            exited(at(1002)),
            Candidate {
                written: at(1000),
                ..RUNNING
            },
            exited(at(1004)),
        ];
        assert_eq!(root_cause(&ranks, at(995)), 2);
        assert_eq!(root_cause(&ranks, None), 2);
    }

    #[test]
    fn a_crash_wins_over_errors_written_after_the_last_quiet_poll() {
        let killed = Candidate {
            written: None,
            failed_now: true,
            crashed: true,
        };
        let ranks = [exited(at(1001)), RUNNING, killed, exited(at(1002))];
        assert_eq!(root_cause(&ranks, at(1000)), 2);
        // But not over an error written while every rank still ran.
        let ranks = [exited(at(990)), RUNNING, killed, exited(at(1002))];
        assert_eq!(root_cause(&ranks, at(1000)), 0);
    }

    #[test]
    fn a_crash_that_wrote_its_error_is_dated_by_it() {
        // panic = "abort": every rank's panic hook writes its file, then each aborts.
        let aborted = |t| Candidate {
            written: at(t),
            failed_now: true,
            crashed: true,
        };
        let ranks = [aborted(1003), aborted(1001), aborted(1002)];
        assert_eq!(root_cause(&ranks, at(1000)), 1);
    }

    #[test]
    fn without_files_or_crashes_the_first_rank_seen() {
        let ranks = [RUNNING, exited(None), exited(None)];
        assert_eq!(root_cause(&ranks, at(1000)), 1);
        assert_eq!(root_cause(&ranks, None), 1);
    }
}
