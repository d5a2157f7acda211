//! The `distrun`s of a multi-node job agreeing through the store on node 0.
//!
//! Keys (outside the ranks' `/worker/` namespace), per attempt `n`:
//! `distrun/attempt_<n>/joined` (counter) and `go` (every node is there: start);
//! `failed` (`<exit code>\t<what>`, first writer wins: every node stops its ranks);
//! `finished` (counter) and `all_finished` (every node's ranks have ended). `distrun/left`
//! counts the nodes that have read the outcome: node 0 keeps the store up until all have.

use std::time::{Duration, Instant};

use dist_backend::store::{Store, TcpStore};

use crate::signals;

const POLL: Duration = Duration::from_millis(20);

/// One node's client of the coordination keys.
pub(crate) struct Agents {
    store: TcpStore,
    nnodes: u32,
    node_rank: u32,
}

fn key(attempt: u32, name: &str) -> String {
    format!("distrun/attempt_{attempt}/{name}")
}

impl Agents {
    /// Connects to the store on node 0, retrying until `timeout`.
    pub(crate) fn connect(
        host: &str,
        port: u16,
        nnodes: u32,
        node_rank: u32,
        timeout: Duration,
    ) -> Result<Self, String> {
        let store = TcpStore::connect(host, port, timeout)
            .map_err(|e| format!("could not reach the store of node 0 at {host}:{port}: {e}"))?;
        Ok(Agents {
            store,
            nnodes,
            node_rank,
        })
    }

    fn err(&self, what: &str, e: impl std::fmt::Display) -> String {
        format!("node {}: {what}: {e}", self.node_rank)
    }

    /// Waits (interruptibly) until `key` exists.
    fn wait_key(&self, key: &str, timeout: Duration, what: &str) -> Result<(), String> {
        let start = Instant::now();
        loop {
            if self.store.check(&[key]).map_err(|e| self.err(what, e))? {
                return Ok(());
            }
            if let Some(sig) = signals::pending() {
                return Err(format!("{what}: interrupted by {}", signals::name(sig)));
            }
            if start.elapsed() >= timeout {
                return Err(format!(
                    "{what}: not every node arrived within {timeout:?} (--rdzv-timeout)"
                ));
            }
            std::thread::sleep(POLL);
        }
    }

    /// Before attempt `attempt`: waits until every node has arrived.
    pub(crate) fn join(&self, attempt: u32, timeout: Duration) -> Result<(), String> {
        let what = format!("joining attempt {attempt}");
        let n = self
            .store
            .add(&key(attempt, "joined"), 1)
            .map_err(|e| self.err(&what, e))?;
        if n == i64::from(self.nnodes) {
            self.store
                .set(&key(attempt, "go"), b"")
                .map_err(|e| self.err(&what, e))?;
        }
        self.wait_key(&key(attempt, "go"), timeout, &what)
    }

    /// Tells every node that a rank of this one failed (the first report wins).
    pub(crate) fn report_failure(&self, attempt: u32, code: i32, what: &str) {
        let value = format!("{code}\t{what}");
        if let Err(e) = self
            .store
            .compare_set(&key(attempt, "failed"), b"", value.as_bytes())
        {
            eprintln!("distrun: could not tell the other nodes of the failure: {e}");
        }
    }

    /// The failure some node reported in `attempt`, if any: (exit code, description).
    pub(crate) fn failure(&self, attempt: u32) -> Result<Option<(i32, String)>, String> {
        let k = key(attempt, "failed");
        if !self
            .store
            .check(&[k.as_str()])
            .map_err(|e| self.err("checking for failures", e))?
        {
            return Ok(None);
        }
        let v = self
            .store
            .get(&k)
            .map_err(|e| self.err("reading a failure", e))?;
        let v = String::from_utf8_lossy(&v);
        let (code, what) = v.split_once('\t').unwrap_or(("1", &v));
        Ok(Some((code.parse().unwrap_or(1), what.to_owned())))
    }

    /// After this node's ranks of `attempt` ended: waits for every node's, then returns the
    /// attempt's failure, the same on every node.
    pub(crate) fn finish(&self, attempt: u32) -> Result<Option<(i32, String)>, String> {
        let what = format!("finishing attempt {attempt}");
        let n = self
            .store
            .add(&key(attempt, "finished"), 1)
            .map_err(|e| self.err(&what, e))?;
        if n == i64::from(self.nnodes) {
            self.store
                .set(&key(attempt, "all_finished"), b"")
                .map_err(|e| self.err(&what, e))?;
        }
        // Ranks of other nodes may legitimately run for days.
        self.wait_key(
            &key(attempt, "all_finished"),
            Duration::from_secs(u64::MAX / 4),
            &what,
        )?;
        self.failure(attempt)
    }

    /// The job is over for this node; node 0 keeps the store up until every node has left.
    pub(crate) fn leave(&self) {
        if let Err(e) = self.store.add("distrun/left", 1) {
            eprintln!("distrun: leaving: {e}");
            return;
        }
        if self.node_rank != 0 {
            return;
        }
        let start = Instant::now();
        while start.elapsed() < Duration::from_secs(30) {
            match self.store.add("distrun/left", 0) {
                Ok(n) if n >= i64::from(self.nnodes) => return,
                Ok(_) => std::thread::sleep(POLL),
                Err(_) => return,
            }
        }
    }
}
