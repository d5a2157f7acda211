//! Shutdown: the graceful rounds in which every worker drains its calls, then leaves
//! through the store; and closing the connections and threads.

use super::*;

/// The longest pause between two rounds of [`Agent::quiesce`] that were not quiet.
const QUIESCE_PAUSE_MAX: Duration = Duration::from_millis(50);

impl Agent {
    pub(crate) fn shutdown(self: &Arc<Self>, graceful: bool) -> Result<()> {
        if IN_POOL.with(std::cell::Cell::get) {
            return Err(Error::InvalidArgument {
                worker: self.label.clone(),
                op: "shutdown",
                what: "called from inside an RPC handler".into(),
            });
        }
        {
            let mut life = lock(&self.life);
            match *life {
                Life::Closed => return Ok(()),
                Life::ShuttingDown => {
                    return Err(Error::InvalidArgument {
                        worker: self.label.clone(),
                        op: "shutdown",
                        what: "already shutting down on another thread".into(),
                    });
                }
                Life::Running => *life = Life::ShuttingDown,
            }
        }
        let deadline = deadline_after(Instant::now(), self.opts.shutdown_timeout);
        let res = if graceful {
            // First every worker finishes its work (handlers may still hold and pass on
            // RRefs they received); only then are the RRefs user code still holds released,
            // and their deletions in turn waited for.
            let mut round = 0;
            self.quiesce(deadline, &mut round).and_then(|()| {
                self.release_all_forks();
                self.quiesce(deadline, &mut round)
            })
        } else {
            Ok(())
        };
        // The same deadline: quiet rounds that used it up leave close nothing to wait with,
        // rather than a fresh `shutdown_timeout` on top.
        self.close_by(deadline);
        let left = self.leave_store(deadline);
        res.and(left)
    }

    /// Releases every RRef this worker's user code still holds (torch deletes all user RRefs
    /// at shutdown; later drops are no-ops).
    fn release_all_forks(&self) {
        let live: Vec<Arc<ForkShared>> = lock(&self.live_forks)
            .values()
            .filter_map(Weak::upgrade)
            .collect();
        for f in live {
            self.release_fork(f.token, &f.released);
        }
    }

    /// Waits, with every worker, until no worker has work left and every request sent has
    /// been processed. Each round, every worker waits until it is idle, then publishes its
    /// (sent, processed) totals; the job is quiet when the sums are equal and unchanged from
    /// the round before (counters only grow, so unchanged sums mean no worker did anything
    /// between its two snapshots: Mattern's four-counter termination detection).
    fn quiesce(self: &Arc<Self>, deadline: Instant, next_round: &mut u64) -> Result<()> {
        let mut prev: Option<(u64, u64)> = None;
        // Between rounds that were not quiet, a pause growing from 1 ms to 50 ms: rounds whose
        // sums never settle (a message that will never be processed) ran back to back until
        // the deadline, 14 million of them in 300 s, each a pair of store keys.
        let mut pause = Duration::from_millis(1);
        loop {
            let round = *next_round;
            *next_round += 1;
            self.wait_idle(deadline)?;
            let mine = format!(
                "{},{}",
                self.sent.load(Ordering::SeqCst),
                self.processed.load(Ordering::SeqCst)
            );
            self.store
                .set_by(
                    &format!("shutdown/{round}/{}", self.me),
                    mine.as_bytes(),
                    deadline,
                )
                .map_err(|source| Error::Store {
                    worker: self.label.clone(),
                    op: "publishing shutdown progress",
                    source,
                })?;
            let keys: Vec<String> = (0..self.workers.len())
                .map(|r| format!("shutdown/{round}/{r}"))
                .collect();
            let values =
                self.store_wait_all(&keys, deadline, "every worker's shutdown progress")?;
            let (mut s, mut p) = (0u64, 0u64);
            for v in values {
                let text = String::from_utf8_lossy(&v).into_owned();
                let mut it = text.split(',').map(|x| x.parse::<u64>().unwrap_or(0));
                s += it.next().unwrap_or(0);
                p += it.next().unwrap_or(0);
            }
            if s == p && prev == Some((s, p)) {
                tracing::debug!(worker = %self.label, rounds = round + 1, "every worker is done");
                return Ok(());
            }
            if prev.is_some() {
                std::thread::sleep(pause.min(deadline.saturating_duration_since(Instant::now())));
                pause = (pause * 2).min(QUIESCE_PAUSE_MAX);
            }
            prev = Some((s, p));
        }
    }

    /// Waits until this worker has nothing in flight.
    fn wait_idle(&self, deadline: Instant) -> Result<()> {
        let mut b = lock(&self.busy);
        while *b > 0 {
            let now = Instant::now();
            if now >= deadline {
                return Err(Error::ShutdownTimeout {
                    worker: self.label.clone(),
                    waiting_for: format!("{} call(s), job(s) or message(s) of this worker", *b),
                    timeout: self.opts.shutdown_timeout,
                });
            }
            b = self
                .idle
                .wait_timeout(b, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        Ok(())
    }

    /// Waits for store keys in slices, failing early when a peer is lost (a crashed worker
    /// never publishes).
    fn store_wait_all(
        &self,
        keys: &[String],
        deadline: Instant,
        what: &str,
    ) -> Result<Vec<Vec<u8>>> {
        let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
        loop {
            let now = Instant::now();
            let slice = deadline
                .saturating_duration_since(now)
                .clamp(Duration::from_millis(1), Duration::from_millis(200));
            match self.store.wait_by(&refs, deadline_after(now, slice)) {
                Ok(()) => break,
                Err(StoreError::Timeout { .. }) => {}
                Err(source) => {
                    return Err(Error::Store {
                        worker: self.label.clone(),
                        op: "waiting during shutdown",
                        source,
                    });
                }
            }
            if let Some((r, reason)) = self.first_lost() {
                return Err(Error::PeerLost {
                    worker: self.label.clone(),
                    peer: self.worker(r).to_string(),
                    func: "shutdown".into(),
                    reason,
                });
            }
            // A peer that said goodbye without publishing this round left without a graceful
            // shutdown (`shutdown_now`, or exit): it will never publish.
            for (r, key) in refs.iter().enumerate() {
                if self.peer_state(r) == Some(PeerState::ShutDown)
                    && !self.store.check_by(&[key], deadline).unwrap_or(true)
                {
                    return Err(Error::PeerShutDown {
                        worker: self.label.clone(),
                        peer: self.worker(r).to_string(),
                        func: "shutdown".into(),
                    });
                }
            }
            if Instant::now() >= deadline {
                // Past the deadline: the diagnosis gets one short grace for all its checks.
                let grace = deadline_after(Instant::now(), DIAGNOSIS_GRACE);
                let missing: Vec<&str> = refs
                    .iter()
                    .copied()
                    .filter(|k| !self.store.check_by(&[k], grace).unwrap_or(false))
                    .collect();
                return Err(Error::ShutdownTimeout {
                    worker: self.label.clone(),
                    waiting_for: format!("{what} (missing {missing:?})"),
                    timeout: self.opts.shutdown_timeout,
                });
            }
        }
        // The keys exist (the wait said so): reading them may take a short grace past the
        // deadline, which the wait may have used up.
        let read_by = deadline.max(deadline_after(Instant::now(), DIAGNOSIS_GRACE));
        self.store
            .multi_get_by(&refs, read_by)
            .map_err(|source| Error::Store {
                worker: self.label.clone(),
                op: "reading during shutdown",
                source,
            })
    }

    fn peer_state(&self, r: usize) -> Option<PeerState> {
        let p = self.peers.get(r)?.as_ref()?;
        Some(lock(&p.state).clone())
    }

    fn first_lost(&self) -> Option<(usize, String)> {
        if !self.lost_any.load(Ordering::SeqCst) {
            return None;
        }
        self.peers.iter().enumerate().find_map(|(r, p)| match p {
            Some(p) => match &*lock(&p.state) {
                PeerState::Lost(reason) => Some((r, reason.clone())),
                _ => None,
            },
            None => None,
        })
    }

    /// [`close_by`](Self::close_by) a `shutdown_timeout` from now (a failed init).
    pub(super) fn close(&self) {
        self.close_by(deadline_after(Instant::now(), self.opts.shutdown_timeout));
    }

    /// Says goodbye to every peer, stops every thread and closes every socket, waiting for
    /// readers and threads to end until `deadline` at most (the shutdown's).
    pub(super) fn close_by(&self, deadline: Instant) {
        *lock(&self.life) = Life::Closed;
        let goodbye = Header {
            kind: Kind::Goodbye,
            call_id: 0,
            meta_len: 0,
            body_len: 0,
            blob_len: 0,
        }
        .encode();
        for p in self.peers.iter().flatten() {
            let mut w = lock(&p.writer);
            if !w.closed {
                let _ = w.stream.write_all(&goodbye);
                w.closed = true;
                let _ = w.stream.shutdown(Shutdown::Write);
            }
        }
        self.fail_pending_to(None, || Outcome::ShutDown);
        // Each reader ends when its peer closes its half (at once for a peer that is gone);
        // a peer that does neither is cut off after a bounded wait.
        let readers_by = deadline.min(deadline_after(
            Instant::now(),
            self.opts.rpc_timeout.min(Duration::from_secs(30)),
        ));
        {
            let mut left = lock(&self.readers_left);
            while *left > 0 {
                let now = Instant::now();
                if now >= readers_by {
                    for p in self.peers.iter().flatten() {
                        let _ = lock(&p.writer).stream.shutdown(Shutdown::Both);
                    }
                    break;
                }
                left = self
                    .readers_cv
                    .wait_timeout(left, readers_by - now)
                    .unwrap_or_else(|e| e.into_inner())
                    .0;
            }
        }
        let me = std::thread::current().id();
        for h in std::mem::take(&mut *lock(&self.readers)) {
            if h.thread().id() != me {
                let _ = h.join();
            }
        }
        {
            let mut q = lock(&self.pool);
            q.stop = true;
            let dropped = q.jobs.len();
            q.jobs.clear();
            drop(q);
            for _ in 0..dropped {
                self.busy_done();
            }
        }
        self.pool_cv.notify_all();
        if let Some(tx) = lock(&self.control).take() {
            self.busy_add(1);
            if tx.send(Control::Stop).is_err() {
                self.busy_done();
            }
        }
        // A handler that never returns must not hold shutdown forever: past the deadline its
        // thread is detached (and logged) instead of joined.
        let still_running = {
            let mut n = lock(&self.threads_alive);
            while *n > 0 && Instant::now() < deadline {
                n = self
                    .threads_cv
                    .wait_timeout(n, deadline.saturating_duration_since(Instant::now()))
                    .unwrap_or_else(|e| e.into_inner())
                    .0;
            }
            *n
        };
        let handles = std::mem::take(&mut *lock(&self.threads));
        if still_running == 0 {
            for h in handles {
                if h.thread().id() != me {
                    let _ = h.join();
                }
            }
        } else {
            // Idle ones among them were told to stop and end on their own; a busy one ends
            // when its handler returns.
            tracing::warn!(worker = %self.label, still_running, "pool or control threads had not returned by the shutdown's deadline; left running");
        }
        // Drop the sockets now rather than with the last `Arc` (an RRef may keep it).
        for p in self.peers.iter().flatten() {
            let _ = lock(&p.writer).stream.shutdown(Shutdown::Both);
        }
        lock(&self.live_forks).clear();
        tracing::debug!(worker = %self.label, "rpc agent closed");
    }

    /// Records leaving in the store; the worker that serves the store keeps it up until every
    /// worker has left.
    fn leave_store(&self, deadline: Instant) -> Result<()> {
        self.store
            .set_by(&format!("left/{}", self.me), b"1", deadline)
            .map_err(|source| Error::Store {
                worker: self.label.clone(),
                op: "recording leaving",
                source,
            })?;
        if !self.store.serves_others() {
            return Ok(());
        }
        let keys: Vec<String> = (0..self.workers.len())
            .map(|r| format!("left/{r}"))
            .collect();
        // A crashed worker never leaves: wait for it only briefly.
        let deadline = if self.lost_any.load(Ordering::SeqCst) {
            deadline.min(deadline_after(Instant::now(), LOST_LEAVE_WAIT))
        } else {
            deadline
        };
        let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
        self.store
            .wait_by(&refs, deadline)
            .map_err(|source| Error::Store {
                worker: self.label.clone(),
                op: "waiting for every worker to leave",
                source,
            })
    }
}
