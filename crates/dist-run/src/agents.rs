//! The `distrun`s of a multi-node job agreeing through the store on node 0.
//!
//! Keys (outside the ranks' `/worker/` namespace), per attempt `n`:
//! `distrun/attempt_<n>/joined` (counter) and `go` (every node is there: start);
//! `failed` (`<exit code>\t<what>`, first writer wins: every node stops its ranks);
//! `finished` (counter) and `all_finished` (every node's ranks have ended). `distrun/left`
//! counts the nodes that have read the outcome: node 0 keeps the store up until all have.
//!
//! Each operation (joining an attempt and waiting for `go`, reading a failure, leaving) takes
//! one deadline when it starts and makes every store call through the `_by` forms with it, so
//! a stopped store host fails the operation by that deadline: with the store's own timeout per
//! call, a call made late in a wait would start a fresh timeout of its own.

use std::time::{Duration, Instant};

use dist_backend::deadline_after;
use dist_backend::store::{Store, TcpStore};

use crate::signals;

const POLL: Duration = Duration::from_millis(20);
/// The longest node 0 keeps the store up for the other nodes to leave (less when
/// `--rdzv-timeout` is shorter): they leave right after reading the outcome, so waiting longer
/// only delays node 0's exit when a node is gone.
const LEAVE: Duration = Duration::from_secs(30);

/// How long one attempt to reach node 0's store lasts before the signals are looked at.
const CONNECT_SLICE: Duration = Duration::from_millis(500);

/// One node's client of the coordination keys.
pub(crate) struct Agents {
    store: TcpStore,
    nnodes: u32,
    node_rank: u32,
    /// `--rdzv-timeout`: the store's timeout, and the bound of each operation but `finish`'s
    /// wait for the other nodes' ranks.
    timeout: Duration,
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
        loop {
            let deadline = bound()?;
            // Checked before the store call: a call made with a deadline already past would
            // fail as a store error, not as the missing nodes it is.
            if deadline.is_some_and(|d| Instant::now() >= d) {
                return Ok(false);
            }
            // Each check ends by the operation's deadline; with none, by a store timeout of
            // its own, which bounds only that check.
            let by = deadline.unwrap_or_else(|| deadline_after(Instant::now(), self.timeout));
            if self
                .store
                .check_by(&[key], by)
                .map_err(|e| self.err(what, e))?
            {
                return Ok(true);
            }
            if let Some(sig) = signals::pending() {
                return Err(self.err(what, format!("interrupted by {}", signals::name(sig))));
            }
            std::thread::sleep(POLL);
        }
    }

    /// Before attempt `attempt`: waits until every node has arrived, all within the
    /// rendezvous timeout from now.
    pub(crate) fn join(&self, attempt: u32) -> Result<(), String> {
        let deadline = deadline_after(Instant::now(), self.timeout);
        let what = format!("joining attempt {attempt}");
        let n = self
            .store
            .add_by(&key(attempt, "joined"), 1, deadline)
            .map_err(|e| self.err(&what, e))?;
        if n == i64::from(self.nnodes) {
            self.store
                .set_by(&key(attempt, "go"), b"", deadline)
                .map_err(|e| self.err(&what, e))?;
        }
        self.wait_key(&key(attempt, "go"), Some(deadline), &what)
    }

    /// Tells every node that a rank of this one failed (the first report wins).
    pub(crate) fn report_failure(&self, attempt: u32, code: i32, what: &str) {
        let value = format!("{code}\t{what}");
        let deadline = deadline_after(Instant::now(), self.timeout);
        if let Err(e) =
            self.store
                .compare_set_by(&key(attempt, "failed"), b"", value.as_bytes(), deadline)
        {
            eprintln!("distrun: could not tell the other nodes of the failure: {e}");
        }
    }

    /// The failure some node reported in `attempt`, if any: (exit code, description).
    pub(crate) fn failure(&self, attempt: u32) -> Result<Option<(i32, String)>, String> {
        let deadline = deadline_after(Instant::now(), self.timeout);
        let k = key(attempt, "failed");
        if !self
            .store
            .check_by(&[k.as_str()], deadline)
            .map_err(|e| self.err("checking for failures", e))?
        {
            return Ok(None);
        }
        let v = self
            .store
            .get_by(&k, deadline)
            .map_err(|e| self.err("reading a failure", e))?;
        let v = String::from_utf8_lossy(&v);
        let (code, what) = v.split_once('\t').unwrap_or(("1", &v));
        Ok(Some((code.parse().unwrap_or(1), what.to_owned())))
    }

    /// After this node's ranks of `attempt` ended: waits for every node's, then returns the
    /// attempt's failure, the same on every node.
    pub(crate) fn finish(&self, attempt: u32) -> Result<Option<(i32, String)>, String> {
        let what = format!("finishing attempt {attempt}");
        self.count_finished(attempt, &what)?;
        // Ranks of other nodes may legitimately run for days: no deadline for the wait while
        // the attempt goes well. Once a node has reported a failure, every other node stops
        // its ranks within a poll, so the rest finish within the rendezvous timeout; a node
        // that does not (its host died with it) would otherwise keep this one waiting forever.
        // The failure is looked for on every poll, not only as the wait begins: it may come
        // from a node whose ranks ran on after this node's had ended well.
        let mut failed: Option<((i32, String), Instant)> = None;
        let all_ended = self.poll_key(&key(attempt, "all_finished"), &what, || {
            if failed.is_none() {
                failed = self
                    .failure(attempt)?
                    .map(|f| (f, deadline_after(Instant::now(), self.timeout)));
            }
            Ok(failed.as_ref().map(|(_, by)| *by))
        })?;
        match failed {
            Some((failure, _)) => {
                if !all_ended {
                    eprintln!(
                        "distrun: node {}: not every node ended attempt {attempt} within {:?} \
                         (--rdzv-timeout) of its failure; ending without them",
                        self.node_rank, self.timeout
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
        let deadline = deadline_after(Instant::now(), self.timeout);
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
    pub(crate) fn abandon(&self, attempt: u32, code: i32, what: &str) {
        self.report_failure(attempt, code, what);
        if let Err(e) = self.count_finished(attempt, &format!("abandoning attempt {attempt}")) {
            eprintln!("distrun: could not tell the other nodes this one stopped: {e}");
            return;
        }
        let deadline = deadline_after(Instant::now(), self.timeout.min(LEAVE));
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
