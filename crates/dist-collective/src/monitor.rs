//! `monitored_barrier`: a barrier through the store that names the ranks that did not arrive.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use crate::debug::OpInfo;
use crate::group::ProcessGroup;
use crate::{Error, Result};

/// What a barrier allows past its timeout for rank 0's result to be published and read.
const RESULT_SLACK: Duration = Duration::from_secs(1);

impl ProcessGroup {
    /// A barrier that, instead of hanging, fails after `timeout` naming the ranks that did not
    /// arrive (torch's `monitored_barrier`): rank 0 collects every rank's arrival through the
    /// store and reports the result to the others. With `wait_all_ranks` the error names every
    /// missing rank; without it, the first. Every rank of the group gets the error.
    ///
    /// It runs in the group's issue order (after the group's earlier operations complete on
    /// this rank), and it uses the store, not the backend, so a failure leaves the group usable.
    pub fn monitored_barrier(&self, timeout: Duration, wait_all_ranks: bool) -> Result<()> {
        let info = OpInfo {
            op: "monitored_barrier",
            dtype: None,
            counts: vec![],
            peer: None,
        };
        self.ordered(info, || self.monitored_barrier_now(timeout, wait_all_ranks))
    }

    fn monitored_barrier_now(&self, timeout: Duration, wait_all_ranks: bool) -> Result<()> {
        let rank = self.rank();
        let seq = self.inner.monitored.fetch_add(1, Ordering::Relaxed);
        let store = self.store();
        let arrived = |r: usize| format!("monitored_barrier/{seq}/arrived/{r}");
        let result = format!("monitored_barrier/{seq}/result");
        let ctx = |what: &str| format!("monitored_barrier #{seq}: {what}");
        let start = Instant::now();
        // The barrier's own deadline: rank 0 stops collecting arrivals there.
        let deadline = dist_backend::deadline_after(start, timeout);
        // Rank 0's store calls may run a little past it (its last check round, then the
        // result), but not a store timeout per call.
        let calls_by = dist_backend::deadline_after(deadline, RESULT_SLACK);
        store
            .set_by(&arrived(rank), b"1", deadline)
            .map_err(|e| Error::store(rank, ctx("announcing arrival"), e))?;
        let missing = if rank == 0 {
            let mut missing: Vec<usize> = (1..self.world_size()).collect();
            loop {
                let mut still = Vec::new();
                for &r in &missing {
                    let here = store
                        .check_by(&[&arrived(r)], calls_by)
                        .map_err(|e| Error::store(rank, ctx("checking arrivals"), e))?;
                    if !here {
                        still.push(r);
                    }
                }
                missing = still;
                if missing.is_empty() || Instant::now() >= deadline {
                    break;
                }
                std::thread::sleep(Duration::from_millis(2));
            }
            if !wait_all_ranks {
                missing.truncate(1);
            }
            let text: Vec<String> = missing.iter().map(ToString::to_string).collect();
            store
                .set_by(&result, text.join(",").as_bytes(), calls_by)
                .map_err(|e| Error::store(rank, ctx("publishing the result"), e))?;
            missing
        } else {
            // Rank 0 answers within `timeout` of arriving; allow it that long after us, plus
            // the slack of a slow store. The first `timeout` of that is one wait of its own,
            // so that a store that does not answer at all (its host stopped) fails the
            // barrier after `timeout`, not after the whole allowance.
            let allowance =
                dist_backend::deadline_after(deadline, timeout.saturating_add(RESULT_SLACK));
            let first = store.wait_by(&[&result], deadline);
            let waited = match first {
                Err(e) if e.is_unreachable() => {
                    return Err(Error::store(rank, ctx("waiting for rank 0's result"), e));
                }
                Err(_) => store.wait_by(&[&result], allowance),
                Ok(()) => Ok(()),
            };
            match waited {
                Ok(()) => {
                    let v = store
                        .get_by(&result, allowance)
                        .map_err(|e| Error::store(rank, ctx("reading the result"), e))?;
                    String::from_utf8_lossy(&v)
                        .split(',')
                        .filter_map(|s| s.parse().ok())
                        .collect()
                }
                Err(e) if e.is_unreachable() => {
                    return Err(Error::store(rank, ctx("waiting for rank 0's result"), e));
                }
                // Rank 0 itself never arrived.
                Err(_) => vec![0],
            }
        };
        if missing.is_empty() {
            Ok(())
        } else {
            Err(Error::MonitoredBarrier {
                rank,
                seq,
                timeout,
                missing,
            })
        }
    }
}
