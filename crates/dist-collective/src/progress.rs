//! Progress reports: where each rank of a group is in the group's collectives, published lazily
//! through the group's store, so that a rank whose collective times out can say who finished
//! what (`rank 1 finished all_reduce #4 but did not join #5`).
//!
//! The hot path only stores two atomics per collective. A watchdog thread per group publishes a
//! rank's state to `progress/<rank>` once that state has stayed unchanged for an eighth of the
//! timeout (at most 2 s): a rank issuing collectives back to back publishes nothing, and a rank
//! that is stuck (in a collective, or outside one while its peers wait) has published
//! where it is long before any peer's timeout expires.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{RecvTimeoutError, Sender, channel};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use dist_backend::Store;
use serde::{Deserialize, Serialize};

/// Operation names a packed progress word can carry; index 0 stands for any other.
const OPS: [&str; 11] = [
    "collective",
    "all_reduce",
    "broadcast",
    "reduce",
    "all_gather",
    "reduce_scatter",
    "all_to_all",
    "gather",
    "scatter",
    "barrier",
    "monitored_barrier",
];

/// `(seq + 1) << 8 | op index`, so that 0 means "none" and a word fits one atomic.
fn pack(seq: u64, op: &str) -> u64 {
    let idx = OPS.iter().position(|&o| o == op).unwrap_or(0) as u64;
    ((seq + 1) << 8) | idx
}

fn unpack(word: u64) -> Option<CollectiveRef> {
    (word != 0).then(|| CollectiveRef {
        op: OPS[(word & 0xff) as usize % OPS.len()].to_owned(),
        seq: (word >> 8) - 1,
    })
}

/// One collective of a group: its name and its sequence number (the order in which every rank
/// issued it, counted from 0 per group).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CollectiveRef {
    /// The operation (`"all_reduce"`, ...).
    pub op: String,
    /// Its sequence number in the group.
    pub seq: u64,
}

impl fmt::Display for CollectiveRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} #{}", self.op, self.seq)
    }
}

/// Where one rank was in its group's collectives.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct RankState {
    /// The last collective it completed successfully.
    pub finished: Option<CollectiveRef>,
    /// The collective it was running (started, not finished).
    pub running: Option<CollectiveRef>,
    /// The last collective that failed on it.
    pub failed: Option<CollectiveRef>,
}

impl RankState {
    /// Whether this rank had reached collective `seq` (joined it, or got past it).
    pub fn joined(&self, seq: u64) -> bool {
        [&self.finished, &self.running, &self.failed]
            .into_iter()
            .flatten()
            .any(|c| c.seq >= seq)
    }
}

/// One rank's entry in a [`ProgressReport`].
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct RankProgress {
    /// The rank (in the group).
    pub rank: usize,
    /// What it last published; `None` when nothing could be read (the rank is gone, never
    /// created the group, or cannot reach the store).
    pub state: Option<RankState>,
}

/// Every rank's progress through a group's collectives, as seen by a rank whose collective
/// timed out. Its `Display` has one line per state the other ranks are in, e.g. `rank 1
/// finished all_reduce #4 but did not join #5` or `ranks 0, 2-7 are in all_reduce #5 too`.
///
/// Other ranks' states are what they last published, which is at most a fraction of the
/// timeout old for a rank that is stuck.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct ProgressReport {
    /// The rank that wrote the report (in the group).
    pub rank: usize,
    /// The collective that timed out.
    pub op: &'static str,
    /// Its sequence number in the group.
    pub seq: u64,
    /// Every rank of the group, in rank order (this rank included).
    pub ranks: Vec<RankProgress>,
}

impl ProgressReport {
    /// Ranks not known to have reached the timed-out collective: the likely culprits.
    pub fn lagging(&self) -> Vec<usize> {
        self.ranks
            .iter()
            .filter(|p| !p.state.as_ref().is_some_and(|s| s.joined(self.seq)))
            .map(|p| p.rank)
            .collect()
    }

    /// What a rank in `state` is doing relative to the timed-out collective, after its name;
    /// `be` is "is" or "are", so ranks in the same state share one line.
    fn tail(&self, state: Option<&RankState>, be: &str) -> String {
        let (s, op) = (self.seq, self.op);
        let Some(st) = state else {
            return "published no progress (gone, never created this group, or cannot reach the store)"
                .to_owned();
        };
        let here = [&st.running, &st.failed]
            .into_iter()
            .flatten()
            .find(|c| c.seq == s);
        if let Some(c) = here {
            let failed = if st.failed.as_ref() == Some(c) {
                " (and failed there)"
            } else {
                ""
            };
            return if c.op == op {
                format!("{be} in {op} #{s} too{failed}")
            } else {
                format!("{be} in {c}, not {op}: the ranks issued different collectives{failed}")
            };
        }
        if let Some(c) = &st.running {
            return if c.seq < s {
                format!("{be} still in {c} and did not join #{s}")
            } else {
                format!("{be} past #{s}, in {c}")
            };
        }
        if let Some(c) = &st.failed {
            return if c.seq < s {
                format!("failed in {c} and did not join #{s}")
            } else {
                // Its finished collective may be older than #s: "finished ... but did not
                // join" would contradict it having gone past.
                format!("{be} past #{s}, and failed in {c}")
            };
        }
        match &st.finished {
            Some(c) if c.seq < s => format!("finished {c} but did not join #{s}"),
            Some(c) => format!("already finished #{s} (last finished: {c})"),
            None => format!("finished no collective of this group and did not join #{s}"),
        }
    }
}

/// `1`, `2-5`, `1, 3-4, 9`: ranks in increasing order, runs collapsed.
fn rank_list(ranks: &[usize]) -> String {
    let mut out: Vec<String> = Vec::new();
    let mut i = 0;
    while i < ranks.len() {
        let mut j = i;
        while j + 1 < ranks.len() && ranks[j + 1] == ranks[j] + 1 {
            j += 1;
        }
        out.push(if j > i {
            format!("{}-{}", ranks[i], ranks[j])
        } else {
            ranks[i].to_string()
        });
        i = j + 1;
    }
    out.join(", ")
}

impl fmt::Display for ProgressReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // One line per distinct state, so a thousand ranks waiting in the same collective are
        // one line and the few that lag stand out.
        let mut lines: Vec<(String, Vec<usize>)> = Vec::new();
        for p in self.ranks.iter().filter(|p| p.rank != self.rank) {
            let key = self.tail(p.state.as_ref(), "is");
            match lines.iter_mut().find(|(k, _)| *k == key) {
                Some((_, ranks)) => ranks.push(p.rank),
                None => lines.push((key, vec![p.rank])),
            }
        }
        write!(f, "progress of the other ranks (as last published):")?;
        for (key, ranks) in &lines {
            if let [r] = ranks[..] {
                write!(f, "\n  rank {r} {key}")?;
            } else {
                let state = self.ranks.iter().find(|p| p.rank == ranks[0]);
                let tail = self.tail(state.and_then(|p| p.state.as_ref()), "are");
                write!(f, "\n  ranks {} {tail}", rank_list(ranks))?;
            }
        }
        Ok(())
    }
}

/// The longest a timed-out collective waits for ranks that have not published their progress.
const REPORT_WAIT_MAX: Duration = Duration::from_millis(250);

/// One rank's progress in one group: written on the hot path, published by the watchdog.
pub(crate) struct Progress {
    rank: usize,
    world_size: usize,
    store: Arc<dyn Store>,
    publish_after: Duration,
    /// The group's timeout: what the watchdog's publishing may take, as life-cycle work.
    timeout: Duration,
    started: AtomicU64,
    finished: AtomicU64,
    failed: AtomicU64,
}

fn key(rank: usize) -> String {
    format!("progress/{rank}")
}

impl Progress {
    /// Progress of `rank` in a group whose namespace is `store` and whose operations time out
    /// after `timeout`.
    pub(crate) fn new(
        rank: usize,
        world_size: usize,
        store: Arc<dyn Store>,
        timeout: Duration,
    ) -> Self {
        // A stuck rank publishes within publish_after (plus a tick); an eighth of the timeout
        // leaves the report fresh when a peer's timeout expires, and the cap bounds how stale a
        // report can be under the five-minute default.
        let publish_after = (timeout / 8).clamp(Duration::from_millis(10), Duration::from_secs(2));
        Progress {
            rank,
            world_size,
            store,
            publish_after,
            timeout,
            started: AtomicU64::new(0),
            finished: AtomicU64::new(0),
            failed: AtomicU64::new(0),
        }
    }

    /// Collective `seq` started on this rank.
    pub(crate) fn started(&self, seq: u64, op: &str) {
        self.started.store(pack(seq, op), Ordering::Relaxed);
    }

    /// Collective `seq` completed successfully on this rank.
    pub(crate) fn finished(&self, seq: u64, op: &str) {
        self.finished.store(pack(seq, op), Ordering::Relaxed);
    }

    /// Collective `seq` failed on this rank.
    pub(crate) fn failed(&self, seq: u64, op: &str) {
        self.failed.store(pack(seq, op), Ordering::Relaxed);
    }

    fn words(&self) -> [u64; 3] {
        [
            self.started.load(Ordering::Relaxed),
            self.finished.load(Ordering::Relaxed),
            self.failed.load(Ordering::Relaxed),
        ]
    }

    fn state_of([started, finished, failed]: [u64; 3]) -> RankState {
        // Words carry seq + 1 above the op byte, so comparing them compares sequence numbers.
        let running = started > finished.max(failed);
        RankState {
            finished: unpack(finished),
            running: if running { unpack(started) } else { None },
            failed: unpack(failed),
        }
    }

    /// Publishes `state`, ending by `deadline`.
    fn publish(&self, state: &RankState, deadline: Instant) {
        let Ok(v) = serde_json::to_vec(state) else {
            return;
        };
        if let Err(e) = self.store.set_by(&key(self.rank), &v, deadline) {
            tracing::debug!(rank = self.rank, error = %e, "cannot publish progress");
        }
    }

    /// Publishes this rank's state now and reads every other rank's: the failure path of a
    /// collective `op` #`seq` that timed out here.
    /// [`Progress::report`], given at most `budget`: the store may be unreachable (its host
    /// stopped or gone), and an error must not wait on it for the store's own timeout. Past
    /// the budget the report holds only this rank's state; the store calls, each ending by
    /// the budget too, give up on their thread in the background.
    pub(crate) fn report_within(
        self: &Arc<Self>,
        op: &'static str,
        seq: u64,
        budget: Duration,
    ) -> ProgressReport {
        let deadline = dist_backend::deadline_after(Instant::now(), budget);
        let (tx, rx) = channel();
        let me = self.clone();
        let spawned = std::thread::Builder::new()
            .name("dist-progress-report".into())
            .spawn(move || {
                let _ = tx.send(me.report(op, seq, deadline));
            });
        if spawned.is_err() {
            return self.report(op, seq, deadline);
        }
        rx.recv_timeout(budget).unwrap_or_else(|_| {
            let own = Self::state_of(self.words());
            ProgressReport {
                rank: self.rank,
                op,
                seq,
                ranks: (0..self.world_size)
                    .map(|r| RankProgress {
                        rank: r,
                        state: (r == self.rank).then(|| own.clone()),
                    })
                    .collect(),
            }
        })
    }

    /// [`Progress::report_within`]'s work, every store call ending by `deadline`.
    fn report(&self, op: &'static str, seq: u64, deadline: Instant) -> ProgressReport {
        let own = Self::state_of(self.words());
        self.publish(&own, deadline);
        let keys: Vec<String> = (0..self.world_size).map(key).collect();
        let others: Vec<&str> = keys
            .iter()
            .enumerate()
            .filter(|&(r, _)| r != self.rank)
            .map(|(_, k)| k.as_str())
            .collect();
        // A live rank publishes once its state has been unchanged for publish_after, and a rank
        // that makes a peer time out has been unchanged for far longer (the whole timeout), so
        // it has published already. The ones that have not are gone, stopped or frozen: a short
        // wait covers a publish in flight without delaying the error past timeout + 1 s.
        let wait = (self.publish_after * 2).min(REPORT_WAIT_MAX);
        let wait_by = dist_backend::deadline_after(Instant::now(), wait).min(deadline);
        let waited = self.store.wait_by(&others, wait_by);
        if waited.as_ref().is_err_and(|e| e.is_unreachable()) {
            // A silent store would make each per-rank read below wait again.
            return ProgressReport {
                rank: self.rank,
                op,
                seq,
                ranks: (0..self.world_size)
                    .map(|r| RankProgress {
                        rank: r,
                        state: (r == self.rank).then(|| own.clone()),
                    })
                    .collect(),
            };
        }
        let everyone = waited.is_ok();
        // One round trip in the usual case; one per rank when some never published.
        let fetched: Vec<Option<RankState>> = match everyone
            .then(|| self.store.multi_get_by(&others, deadline).ok())
            .flatten()
        {
            Some(values) => values
                .iter()
                .map(|v| serde_json::from_slice(v).ok())
                .collect(),
            None => others.iter().map(|k| self.read(k, deadline)).collect(),
        };
        let mut fetched = fetched.into_iter();
        let ranks = (0..self.world_size)
            .map(|r| RankProgress {
                rank: r,
                state: if r == self.rank {
                    Some(own.clone())
                } else {
                    fetched.next().flatten()
                },
            })
            .collect();
        ProgressReport {
            rank: self.rank,
            op,
            seq,
            ranks,
        }
    }

    fn read(&self, key: &str, deadline: Instant) -> Option<RankState> {
        if !self.store.check_by(&[key], deadline).ok()? {
            return None;
        }
        let v = self.store.get_by(key, deadline).ok()?;
        serde_json::from_slice(&v).ok()
    }
}

/// Decides when the watchdog publishes: once a value has been seen unchanged for `after`, and
/// only if it differs from the last one published.
pub(crate) struct Pacer<T> {
    after: Duration,
    seen: Option<(T, Instant)>,
    published: Option<T>,
}

impl<T: PartialEq + Clone> Pacer<T> {
    pub(crate) fn new(after: Duration) -> Self {
        Pacer {
            after,
            seen: None,
            published: None,
        }
    }

    /// Observes `value` at `now`; returns it when it is due for publishing.
    pub(crate) fn observe(&mut self, now: Instant, value: T) -> Option<T> {
        match &self.seen {
            Some((v, since)) if *v == value => {
                let settled = now.saturating_duration_since(*since) >= self.after;
                if settled && self.published.as_ref() != Some(&value) {
                    self.published = Some(value.clone());
                    return Some(value);
                }
                None
            }
            _ => {
                self.seen = Some((value, now));
                None
            }
        }
    }
}

/// The longest the watchdog waits for the store to take one publication. Why not the group's
/// timeout: teardown joins the watchdog before it leaves the group through the store, so a
/// publication stuck on a store whose host stopped held teardown for up to a whole timeout
/// before the leave's own (3 s timeout: 5.5 s, where teardown promises the timeout + 1 s). A
/// publication that gives up leaves the last one standing; the next state change publishes
/// again.
const WATCHDOG_PUBLISH_WAIT: Duration = Duration::from_millis(500);

/// Starts the group's watchdog thread; dropping the returned sender stops it. Fails only when
/// the thread cannot be started.
pub(crate) fn start_watchdog(
    p: Arc<Progress>,
    name: String,
) -> std::io::Result<(Sender<()>, JoinHandle<()>)> {
    let (tx, rx) = channel::<()>();
    let tick = (p.publish_after / 2).max(Duration::from_millis(5));
    let handle = std::thread::Builder::new().name(name).spawn(move || {
        let mut pacer = Pacer::new(p.publish_after);
        loop {
            match rx.recv_timeout(tick) {
                Err(RecvTimeoutError::Timeout) => {}
                Ok(()) | Err(RecvTimeoutError::Disconnected) => return,
            }
            if let Some(words) = pacer.observe(Instant::now(), p.words()) {
                let wait = p.timeout.min(WATCHDOG_PUBLISH_WAIT);
                let deadline = dist_backend::deadline_after(Instant::now(), wait);
                p.publish(&Progress::state_of(words), deadline);
            }
        }
    })?;
    Ok((tx, handle))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn words_round_trip_and_order_by_seq() {
        let w = pack(41, "reduce_scatter");
        assert_eq!(
            unpack(w),
            Some(CollectiveRef {
                op: "reduce_scatter".into(),
                seq: 41
            })
        );
        assert_eq!(unpack(pack(0, "no_such_op")).unwrap().op, "collective");
        assert!(pack(5, "all_reduce") > pack(4, "monitored_barrier"));
        assert_eq!(unpack(0), None);
    }

    #[test]
    fn state_says_running_only_between_start_and_end() {
        let s = Progress::state_of([pack(5, "barrier"), pack(4, "all_reduce"), 0]);
        assert_eq!(s.running.unwrap().seq, 5);
        assert_eq!(s.finished.unwrap().seq, 4);
        let s = Progress::state_of([pack(5, "barrier"), pack(5, "barrier"), 0]);
        assert_eq!(s.running, None);
        let s = Progress::state_of([
            pack(5, "barrier"),
            pack(4, "all_reduce"),
            pack(5, "barrier"),
        ]);
        assert_eq!(s.running, None);
        assert_eq!(s.failed.unwrap().seq, 5);
    }

    #[test]
    fn pacer_publishes_nothing_while_values_keep_changing() {
        let t0 = Instant::now();
        let ms = |n: u64| t0 + Duration::from_millis(n);
        let mut p = Pacer::new(Duration::from_millis(100));
        // A thousand changes, one every millisecond: a busy rank.
        let busy: Vec<u64> = (0..1000).filter_map(|i| p.observe(ms(i), i)).collect();
        assert!(busy.is_empty(), "{busy:?}");
        // Then it settles: published once, after `after`, and not again.
        assert_eq!(p.observe(ms(1050), 999), None);
        assert_eq!(p.observe(ms(1099), 999), Some(999));
        assert_eq!(p.observe(ms(5000), 999), None);
        // A new value settles and is published; returning to the published one is not news.
        assert_eq!(p.observe(ms(5001), 7), None);
        assert_eq!(p.observe(ms(5101), 7), Some(7));
    }

    fn report(states: Vec<Option<RankState>>, seq: u64) -> ProgressReport {
        ProgressReport {
            rank: 0,
            op: "all_reduce",
            seq,
            ranks: states
                .into_iter()
                .enumerate()
                .map(|(rank, state)| RankProgress { rank, state })
                .collect(),
        }
    }

    fn c(op: &str, seq: u64) -> Option<CollectiveRef> {
        Some(CollectiveRef { op: op.into(), seq })
    }

    #[test]
    fn report_lines_name_who_finished_what() {
        let st = |finished, running, failed| {
            Some(RankState {
                finished,
                running,
                failed,
            })
        };
        let r = report(
            vec![
                st(c("all_reduce", 4), c("all_reduce", 5), None),
                st(c("all_reduce", 4), None, None),
                st(c("all_reduce", 4), None, c("all_reduce", 5)),
                st(c("all_reduce", 3), c("all_reduce", 4), None),
                None,
                st(c("all_reduce", 4), c("broadcast", 5), None),
                st(None, None, None),
                st(c("all_reduce", 4), None, None),
                st(c("all_reduce", 3), c("all_reduce", 4), None),
                st(c("all_reduce", 3), c("all_reduce", 4), None),
                st(c("all_reduce", 3), c("all_reduce", 4), None),
                st(c("all_reduce", 4), None, c("all_reduce", 7)),
            ],
            5,
        );
        let text = r.to_string();
        let lines: Vec<&str> = text.lines().skip(1).map(str::trim).collect();
        assert_eq!(
            lines,
            [
                "ranks 1, 7 finished all_reduce #4 but did not join #5",
                "rank 2 is in all_reduce #5 too (and failed there)",
                "ranks 3, 8-10 are still in all_reduce #4 and did not join #5",
                "rank 4 published no progress (gone, never created this group, or cannot reach the store)",
                "rank 5 is in broadcast #5, not all_reduce: the ranks issued different collectives",
                "rank 6 finished no collective of this group and did not join #5",
                "rank 11 is past #5, and failed in all_reduce #7",
            ]
        );
        assert_eq!(r.lagging(), [1, 3, 4, 6, 7, 8, 9, 10]);
    }
}
