//! The `distrun`s of a multi-node job agreeing through the store on node 0.
//!
//! Keys (outside the ranks' `/worker/` namespace), per attempt `n`:
//! `distrun/attempt_<n>/joined` (counter) and `go` (every node is there: start);
//! `failed` (`<exit code>\t<what>`, first writer wins: every node stops its ranks);
//! `finished` (counter) and `all_finished` (every node's ranks have ended). `distrun/left`
//! counts the nodes that have read the outcome: node 0 keeps the store up until all have.
//!
//! Each operation (joining an attempt and waiting for `go`, reporting a failure, leaving)
//! takes one deadline when it starts and makes every store call through the `_by` forms with
//! it, so a stopped store host fails the operation by that deadline: with the store's own
//! timeout per call, a call made late in a wait would start a fresh timeout of its own. The
//! polls within them (has every node arrived, finished; has any failed) are looks of at most
//! [`LOOK`] each, never past that deadline: between looks the signals and this node's ranks
//! are looked at, and a look the store does not answer is no news until it has answered none
//! for the rendezvous timeout ([`Agents::look`]).

use std::time::{Duration, Instant};

use dist_backend::deadline_after;
use dist_backend::store::{Store, StoreError, TcpStore};

use crate::signals;

const POLL: Duration = Duration::from_millis(20);
/// The longest node 0 keeps the store up for the other nodes to leave (less when
/// `--rdzv-timeout` is shorter): they leave right after reading the outcome, so waiting longer
/// only delays node 0's exit when a node is gone.
const LEAVE: Duration = Duration::from_secs(30);

/// How long one attempt to reach node 0's store lasts before the signals are looked at.
const CONNECT_SLICE: Duration = Duration::from_millis(500);

/// How long one look at node 0's store (is there a failure, has every node arrived or
/// finished) waits for its answer. Between looks the signals, and during an attempt this
/// node's ranks, are looked at: a store that does not answer (node 0 stopped by SIGSTOP or a
/// debugger) must not keep them unseen for the whole rendezvous timeout.
const LOOK: Duration = Duration::from_secs(1);

/// The longest an interrupted node spends telling the others (less when `--rdzv-timeout` is
/// shorter): it is on its way out, and a store that does not answer must not hold it there.
const ABANDON: Duration = Duration::from_secs(5);

/// Since when node 0's store has not answered a look ([`Agents::look`]), and how the last
/// look failed: a wait that runs out of time while the store is silent says so.
#[derive(Debug, Default)]
pub(crate) struct Silence {
    since: Option<Instant>,
    last: Option<StoreError>,
}

/// Whether `e` says that the store did not answer in time (slow, or its host stopped), not
/// that it is gone (refused, reset: its process died).
fn unanswered(e: &StoreError) -> bool {
    match e {
        StoreError::Unresponsive { .. } | StoreError::Timeout { .. } => true,
        StoreError::Connect { source, .. } => source.kind() == std::io::ErrorKind::TimedOut,
        _ => false,
    }
}

/// One node's client of the coordination keys.
pub(crate) struct Agents {
    store: TcpStore,
    nnodes: u32,
    node_rank: u32,
    /// `--rdzv-timeout`: the store's timeout, and the bound of each operation but `finish`'s
    /// wait for the other nodes' ranks.
    timeout: Duration,
}

/// The key by which node `node` marks its arrival at attempt `attempt`'s rendezvous.
fn arrival_key(attempt: u32, node: u32) -> String {
    key(attempt, &format!("joined/{node}"))
}

fn key(attempt: u32, name: &str) -> String {
    format!("distrun/attempt_{attempt}/{name}")
}

impl Agents {
    /// Connects to the store on node 0, retrying until `timeout`, interruptibly: in short
    /// attempts with a look at the signals between them, so that Ctrl-C while node 0 is not
    /// up yet stops this node at once rather than after the whole rendezvous timeout (every
    /// later call passes its own deadline, so the store's own timeout is never used).
    pub(crate) fn connect(
        host: &str,
        port: u16,
        nnodes: u32,
        node_rank: u32,
        timeout: Duration,
    ) -> Result<Self, String> {
        let deadline = deadline_after(Instant::now(), timeout);
        let store = loop {
            let slice = deadline
                .saturating_duration_since(Instant::now())
                .min(CONNECT_SLICE);
            match TcpStore::connect(host, port, slice) {
                Ok(store) => break store,
                Err(e) if Instant::now() >= deadline => {
                    return Err(format!(
                        "could not reach the store of node 0 at {host}:{port}: {e}"
                    ));
                }
                Err(_) => {}
            }
            if let Some(sig) = signals::pending() {
                return Err(format!(
                    "interrupted by {} while reaching the store of node 0 at {host}:{port}",
                    signals::name(sig)
                ));
            }
        };
        Ok(Agents {
            store,
            nnodes,
            node_rank,
            timeout,
        })
    }

    fn err(&self, what: &str, e: impl std::fmt::Display) -> String {
        format!("node {}: {what}: {e}", self.node_rank)
    }

    /// Waits (interruptibly) until `key` exists, or fails at `deadline` (`None`: never).
    fn wait_key(&self, key: &str, deadline: Option<Instant>, what: &str) -> Result<(), String> {
        if self.poll_key(key, what, || Ok(deadline))? {
            return Ok(());
        }
        let why = format!(
            "not every node arrived within {:?} (--rdzv-timeout)",
            self.timeout
        );
        Err(self.err(what, why))
    }

    /// Polls (interruptibly) until `key` exists: `true`. Before each look, `bound` gives the
    /// deadline (`None`: none yet), so that a wait can become bounded while it runs; `false`
    /// once it has passed.
    fn poll_key(
        &self,
        key: &str,
        what: &str,
        mut bound: impl FnMut() -> Result<Option<Instant>, String>,
    ) -> Result<bool, String> {
        let mut silence = Silence::default();
        loop {
            let deadline = bound()?;
            // Checked before the store call: a call made with a deadline already past would
            // fail as a store error, not as the missing nodes it is, unless the store is
            // what has been silent.
            if deadline.is_some_and(|d| Instant::now() >= d) {
                return match silence.last {
                    Some(e) => Err(self.err(what, e)),
                    None => Ok(false),
                };
            }
            let there = self.look(what, deadline, &mut silence, |by| {
                self.store.check_by(&[key], by)
            })?;
            if there == Some(true) {
                return Ok(true);
            }
            if let Some(sig) = signals::pending() {
                return Err(self.err(what, format!("interrupted by {}", signals::name(sig))));
            }
            std::thread::sleep(POLL);
        }
    }

    /// One look at the store (`f`, given the look's deadline: [`LOOK`] from now, never past
    /// `deadline`). `Ok(None)` when the store did not answer in time but has answered a look
    /// within the rendezvous timeout (`silence` keeps since when it has not): a slow store is
    /// not yet a gone one. Silence past `deadline` or for the whole rendezvous timeout, and
    /// any other failure (node 0 is gone), are errors.
    fn look<T>(
        &self,
        what: &str,
        deadline: Option<Instant>,
        silence: &mut Silence,
        f: impl FnOnce(Instant) -> Result<T, StoreError>,
    ) -> Result<Option<T>, String> {
        let now = Instant::now();
        let by = deadline_after(now, LOOK);
        match f(deadline.map_or(by, |d| d.min(by))) {
            Ok(v) => {
                *silence = Silence::default();
                Ok(Some(v))
            }
            Err(e) if unanswered(&e) => {
                let since = *silence.since.get_or_insert(now);
                let out_of_time = deadline.is_some_and(|d| Instant::now() >= d)
                    || since.elapsed() >= self.timeout;
                if out_of_time {
                    Err(self.err(what, e))
                } else {
                    silence.last = Some(e);
                    Ok(None)
                }
            }
            Err(e) => Err(self.err(what, e)),
        }
    }

    /// Before attempt `attempt`: waits until every node has arrived, all within the
    /// rendezvous timeout from now. Each node marks its own arrival, so a node interrupted
    /// while it waited and started again arrives once, not twice: a count of arrivals would
    /// have reached the node count with one node still missing.
    pub(crate) fn join(&self, attempt: u32) -> Result<(), String> {
        let deadline = deadline_after(Instant::now(), self.timeout);
        let what = format!("joining attempt {attempt}");
        let arrived = |node: u32| arrival_key(attempt, node);
        self.store
            .set_by(&arrived(self.node_rank), b"", deadline)
            .map_err(|e| self.err(&what, e))?;
        for node in 0..self.nnodes {
            let waiting = format!("{what} (waiting for node {node})");
            self.wait_key(&arrived(node), Some(deadline), &waiting)?;
        }
        Ok(())
    }

    /// This node leaves the rendezvous of `attempt`, in which it was interrupted: its arrival
    /// mark is taken back, so that the others go on waiting for it, and the same node started
    /// again arrives once, as torchrun's rendezvous forgets a node that leaves before it
    /// closes. Nodes that saw every mark before this start the attempt without it, and fail
    /// it when its ranks do not come, as if it had died right after joining.
    pub(crate) fn withdraw(&self, attempt: u32) {
        let deadline = deadline_after(Instant::now(), self.timeout.min(ABANDON));
        let mine = arrival_key(attempt, self.node_rank);
        if let Err(e) = self.store.delete_key_by(&mine, deadline) {
            eprintln!("distrun: could not take back this node's arrival: {e}");
        }
    }

    /// Tells every node that a rank of this one failed (the first report wins).
    pub(crate) fn report_failure(&self, attempt: u32, code: i32, what: &str) {
        self.report_failure_by(
            attempt,
            code,
            what,
            deadline_after(Instant::now(), self.timeout),
        );
    }

    /// [`Agents::report_failure`] within one [`LOOK`]: `false` when the store did not answer
    /// in time, and the report is still to be made; `true` when it was made, or failed for
    /// good (said on stderr).
    pub(crate) fn report_failure_soon(&self, attempt: u32, code: i32, what: &str) -> bool {
        let deadline = deadline_after(Instant::now(), LOOK.min(self.timeout));
        match self.try_report_failure(attempt, code, what, deadline) {
            Err(e) if unanswered(&e) => false,
            Err(e) => {
                eprintln!("distrun: could not tell the other nodes of the failure: {e}");
                true
            }
            Ok(()) => true,
        }
    }

    fn report_failure_by(&self, attempt: u32, code: i32, what: &str, deadline: Instant) {
        if let Err(e) = self.try_report_failure(attempt, code, what, deadline) {
            eprintln!("distrun: could not tell the other nodes of the failure: {e}");
        }
    }

    fn try_report_failure(
        &self,
        attempt: u32,
        code: i32,
        what: &str,
        deadline: Instant,
    ) -> Result<(), StoreError> {
        let value = format!("{code}\t{what}");
        self.store
            .compare_set_by(&key(attempt, "failed"), b"", value.as_bytes(), deadline)?;
        Ok(())
    }

    /// The failure some node reported in `attempt`, if any: (exit code, description).
    fn failure(&self, attempt: u32) -> Result<Option<(i32, String)>, String> {
        let deadline = deadline_after(Instant::now(), self.timeout);
        self.failure_by(attempt, deadline)
            .map_err(|e| self.err("checking for failures", e))
    }

    /// [`Agents::failure`] as one look ([`Agents::look`]): `Ok(None)` also while node 0's
    /// store does not answer, until it has not for the rendezvous timeout. For a node whose
    /// ranks run, which looks often and must keep an eye on them and on the signals.
    pub(crate) fn look_for_failure(
        &self,
        attempt: u32,
        silence: &mut Silence,
    ) -> Result<Option<(i32, String)>, String> {
        let found = self.look("checking for failures", None, silence, |by| {
            self.failure_by(attempt, by)
        })?;
        Ok(found.flatten())
    }

    fn failure_by(
        &self,
        attempt: u32,
        deadline: Instant,
    ) -> Result<Option<(i32, String)>, StoreError> {
        let k = key(attempt, "failed");
        if !self.store.check_by(&[k.as_str()], deadline)? {
            return Ok(None);
        }
        let v = self.store.get_by(&k, deadline)?;
        let v = String::from_utf8_lossy(&v);
        let (code, what) = v.split_once('\t').unwrap_or(("1", &v));
        Ok(Some((code.parse().unwrap_or(1), what.to_owned())))
    }

    /// After this node's ranks of `attempt` ended: waits for every node's, then returns the
    /// attempt's failure, the same on every node. `grace` is `--grace-period`, which the
    /// other nodes may take to stop their ranks once one has failed.
    pub(crate) fn finish(
        &self,
        attempt: u32,
        grace: Duration,
    ) -> Result<Option<(i32, String)>, String> {
        let what = format!("finishing attempt {attempt}");
        self.count_finished(attempt, &what)?;
        // Ranks of other nodes may legitimately run for days: no deadline for the wait while
        // the attempt goes well. Once a node has reported a failure, every other node starts
        // stopping its ranks within a poll and is done within the grace period, so the rest
        // finish within the rendezvous timeout and that; a node that does not (its host died
        // with it) would otherwise keep this one waiting forever.
        // The failure is looked for on every poll, not only as the wait begins: it may come
        // from a node whose ranks ran on after this node's had ended well.
        let mut failed: Option<((i32, String), Instant)> = None;
        let mut silence = Silence::default();
        let all_ended = self.poll_key(&key(attempt, "all_finished"), &what, || {
            if failed.is_none() {
                failed = self.look_for_failure(attempt, &mut silence)?.map(|f| {
                    let bound = self.timeout.saturating_add(grace);
                    (f, deadline_after(Instant::now(), bound))
                });
            }
            Ok(failed.as_ref().map(|(_, by)| *by))
        })?;
        match failed {
            Some((failure, _)) => {
                if !all_ended {
                    eprintln!(
                        "distrun: node {}: not every node ended attempt {attempt} within {:?} \
                         (--rdzv-timeout) and {:?} (--grace-period) of its failure; ending \
                         without them",
                        self.node_rank, self.timeout, grace
                    );
                }
                Ok(Some(failure))
            }
            // A failure reported between the last look and the last node's count.
            None => self.failure(attempt),
        }
    }

    /// Counts this node as done with `attempt`; the last node to count says so.
    fn count_finished(&self, attempt: u32, what: &str) -> Result<(), String> {
        self.count_finished_by(attempt, what, deadline_after(Instant::now(), self.timeout))
    }

    fn count_finished_by(&self, attempt: u32, what: &str, deadline: Instant) -> Result<(), String> {
        let n = self
            .store
            .add_by(&key(attempt, "finished"), 1, deadline)
            .map_err(|e| self.err(what, e))?;
        if n == i64::from(self.nnodes) {
            self.store
                .set_by(&key(attempt, "all_finished"), b"", deadline)
                .map_err(|e| self.err(what, e))?;
        }
        Ok(())
    }

    /// This node stops in the middle of `attempt` (it was interrupted, `code` its exit code):
    /// it reports the failure and counts itself finished, without waiting for the others, so
    /// that they end the attempt instead of waiting for this node forever.
    /// It also counts as having left the job, so that node 0 does not keep its store up
    /// waiting for it.
    /// All of it ends by one deadline: the rendezvous timeout, at most [`ABANDON`].
    pub(crate) fn abandon(&self, attempt: u32, code: i32, what: &str) {
        self.abandon_by(attempt, code, what, true);
    }

    /// [`Agents::abandon`] for a node interrupted while it waited for the others to finish
    /// `attempt` ([`Agents::finish`]), which counted it finished already: counted twice, it
    /// would let the others' wait end with a node still running.
    pub(crate) fn abandon_finished(&self, attempt: u32, code: i32, what: &str) {
        self.abandon_by(attempt, code, what, false);
    }

    fn abandon_by(&self, attempt: u32, code: i32, what: &str, count: bool) {
        let deadline = deadline_after(Instant::now(), self.timeout.min(ABANDON));
        self.report_failure_by(attempt, code, what, deadline);
        let what = format!("abandoning attempt {attempt}");
        if count && let Err(e) = self.count_finished_by(attempt, &what, deadline) {
            eprintln!("distrun: could not tell the other nodes this one stopped: {e}");
            return;
        }
        if let Err(e) = self.store.add_by("distrun/left", 1, deadline) {
            eprintln!("distrun: leaving: {e}");
        }
    }

    /// The job is over for this node; node 0 keeps the store up until every node has left.
    /// Both end by one deadline from now: the rendezvous timeout, at most [`LEAVE`].
    pub(crate) fn leave(&self) {
        let deadline = deadline_after(Instant::now(), self.timeout.min(LEAVE));
        if let Err(e) = self.store.add_by("distrun/left", 1, deadline) {
            eprintln!("distrun: leaving: {e}");
            return;
        }
        if self.node_rank != 0 {
            return;
        }
        while Instant::now() < deadline {
            match self.store.add_by("distrun/left", 0, deadline) {
                Ok(n) if n >= i64::from(self.nnodes) => return,
                Ok(_) => std::thread::sleep(POLL),
                Err(_) => return,
            }
        }
    }
}
