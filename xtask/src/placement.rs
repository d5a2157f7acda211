//! Where the host has put this VM's first two vCPUs right now: the round trip of one cache line
//! between two threads pinned to CPU 0 and CPU 1.
//!
//! On the 2-core development VM it reads 50-74 ns, and 300 ns and more while the host has put
//! the two vCPUs far apart (another core complex or socket), for seconds to minutes; our
//! shared-memory collectives whose bytes pass from core to core through the cache (the rings,
//! the group area) then run 3-16x slower for the whole run (docs/BENCHMARKS.md, "The vCPUs far
//! apart" and "A placement probe before every cell"). `cargo xtask bench` probes before
//! each cell so that a table says which cells met that placement. The threads must be pinned:
//! unpinned, the scheduler may put both on one CPU and the reading says nothing (385-1072 ns
//! where the pinned probe read 54). The calling thread is never pinned, so the processes a
//! benchmark starts afterwards inherit its affinity unchanged. Work running on CPU 0 or 1
//! while it probes lengthens the reading too, and reads as far: probe a quiet machine. Linux
//! only (`sched_setaffinity`); elsewhere there is no reading.

use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Instant;

/// Round trips timed per probe (about 12 ms near, 70 ms far), after as many again to warm up.
const TRIPS: u32 = 200_000;

/// A reading more than this many times the near placement's counts as far.
pub(crate) const FAR_FACTOR: f64 = 2.0;

/// The near placement's reading where an invocation's lowest is higher: a round trip between
/// cores that share a cache takes less on current x86 parts (50-74 ns here). Without it an
/// invocation met far apart throughout (327-382 ns in every cell of one, 2026-11-29) would
/// count its far readings as near.
pub(crate) const NEAR_NS: f64 = 100.0;

/// One cache line, alone in it: a neighbour sharing the line would add its own traffic.
#[repr(align(64))]
struct Line(AtomicU32);

/// The mean round trip in nanoseconds of a cache line between CPU 0 and CPU 1, or `None` where
/// either CPU cannot be pinned (one CPU, an affinity mask that excludes them, not Linux) or a
/// thread cannot be started.
pub(crate) fn round_trip_ns() -> Option<f64> {
    let line = Line(AtomicU32::new(0));
    // Each thread reports whether it pinned itself (PINNED or UNPINNED), then waits for the
    // calling thread's word: GO once both pinned, else STOP, also where the second thread
    // could not be started, so that no thread waits for a partner that never comes.
    let reports = [AtomicU32::new(WAITING), AtomicU32::new(WAITING)];
    let go = AtomicU32::new(WAITING);
    let ready = |me: usize| {
        let pinned = pin(me);
        reports[me].store(if pinned { PINNED } else { UNPINNED }, Ordering::SeqCst);
        set_word(&go) == GO
    };
    std::thread::scope(|s| {
        let answerer = std::thread::Builder::new().spawn_scoped(s, || {
            if ready(1) {
                for _ in 0..2 * TRIPS {
                    while line.0.load(Ordering::Acquire) != 1 {
                        std::hint::spin_loop();
                    }
                    line.0.store(0, Ordering::Release);
                }
            }
        });
        let asker = std::thread::Builder::new().spawn_scoped(s, || {
            if !ready(0) {
                return None;
            }
            let bounce = |trips: u32| {
                for _ in 0..trips {
                    line.0.store(1, Ordering::Release);
                    while line.0.load(Ordering::Acquire) != 0 {
                        std::hint::spin_loop();
                    }
                }
            };
            bounce(TRIPS);
            let start = Instant::now();
            bounce(TRIPS);
            Some(start.elapsed().as_secs_f64() * 1e9 / f64::from(TRIPS))
        });
        let word = if answerer.is_ok() && asker.is_ok() {
            let both = reports.iter().all(|r| set_word(r) == PINNED);
            if both { GO } else { STOP }
        } else {
            STOP
        };
        go.store(word, Ordering::SeqCst);
        let ns = asker.ok().and_then(|t| t.join().ok().flatten());
        if let Ok(t) = answerer {
            let _ = t.join();
        }
        ns
    })
}

/// Waits for `word` to leave [`WAITING`] and returns what it was set to.
fn set_word(word: &AtomicU32) -> u32 {
    loop {
        match word.load(Ordering::SeqCst) {
            WAITING => std::thread::yield_now(),
            set => return set,
        }
    }
}

/// The words of [`round_trip_ns`]'s handshake.
const WAITING: u32 = 0;
const PINNED: u32 = 1;
const UNPINNED: u32 = 2;
const GO: u32 = 1;
const STOP: u32 = 2;

/// Pins the calling thread to `cpu`; false where the kernel refuses.
#[cfg(target_os = "linux")]
fn pin(cpu: usize) -> bool {
    use nix::sched::{CpuSet, sched_setaffinity};
    let mut set = CpuSet::new();
    set.set(cpu).is_ok() && sched_setaffinity(nix::unistd::Pid::from_raw(0), &set).is_ok()
}

/// Nowhere to pin outside Linux: no reading.
#[cfg(not(target_os = "linux"))]
fn pin(_cpu: usize) -> bool {
    false
}

/// Whether `reading` counts as far placement in an invocation whose lowest reading is `lowest`:
/// over [`FAR_FACTOR`] times the lower of `lowest` and [`NEAR_NS`].
pub(crate) fn is_far(reading: f64, lowest: f64) -> bool {
    reading > FAR_FACTOR * lowest.min(NEAR_NS)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[cfg(target_os = "linux")]
    #[test]
    fn the_probe_reads_a_positive_time_or_none_and_leaves_this_thread_unpinned() {
        use nix::unistd::Pid;
        let before = nix::sched::sched_getaffinity(Pid::from_raw(0)).unwrap();
        let both = before.is_set(0).unwrap_or(false) && before.is_set(1).unwrap_or(false);
        match round_trip_ns() {
            // A round trip takes tens of nanoseconds at least and, on any machine this runs
            // on, well under a millisecond.
            Some(ns) => assert!(ns > 1.0 && ns < 1e6, "{ns} ns"),
            None => assert!(
                !both,
                "CPU 0 and 1 are ours, yet the probe could not pin them"
            ),
        }
        let after = nix::sched::sched_getaffinity(Pid::from_raw(0)).unwrap();
        assert_eq!(before, after);
    }

    #[test]
    fn far_is_more_than_twice_the_lowest_reading_or_the_near_bound() {
        assert!(!is_far(74.0, 50.0));
        assert!(!is_far(100.0, 50.0));
        assert!(is_far(331.0, 50.0));
        // An invocation far apart throughout has no near reading of its own.
        assert!(is_far(382.0, 327.0));
        assert!(!is_far(150.0, 140.0));
    }
}
