//! The pool of connections a [`TcpStore`] lends its calls: open on demand, one place always
//! left to calls that do not block, a failed connection closed rather than lent again.

use super::*;

#[derive(Debug)]
pub(super) struct Conn {
    pub(super) stream: TcpStream,
    pub(super) buf: Vec<u8>,
}

/// The connections of a [`TcpStore`].
#[derive(Debug, Default)]
pub(super) struct Pool {
    /// Connections in step with the server, waiting for a call.
    pub(super) idle: Vec<Conn>,
    /// Connections that exist or are being opened: idle, lent out, or connecting.
    pub(super) open: usize,
    /// Of those, the ones lent to calls that may block.
    pub(super) blocking: usize,
    /// The most `open` has been, for tests.
    pub(super) peak: usize,
}

/// What a call wants a connection for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Use {
    /// One request and its reply, answered at once by the server.
    Quick,
    /// A `WAIT`, which may hold the connection until its timeout.
    Blocking,
}

/// A connection's place in the pool while a call holds it. Dropping the slot without
/// [`give_back`](Slot::give_back) (an error, a panic) frees the place, and the connection, which
/// may be out of step with the server, is closed with it.
pub(super) struct Slot<'a> {
    pub(super) store: &'a TcpStore,
    pub(super) use_: Use,
    pub(super) returned: bool,
}

impl Slot<'_> {
    /// Returns a connection that is in step with the server to the idle ones.
    pub(super) fn give_back(mut self, conn: Conn) {
        self.returned = true;
        self.store.release(Some(conn), self.use_);
    }
}

impl Drop for Slot<'_> {
    fn drop(&mut self) {
        if !self.returned {
            self.store.release(None, self.use_);
        }
    }
}

impl TcpStore {
    pub(super) fn lock(&self) -> MutexGuard<'_, Pool> {
        // The pool's counts are updated in single statements: a panic elsewhere cannot leave
        // them half-changed, so a poisoned lock is still good.
        self.pool.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Lends a connection for `use_`: an idle one, else a new one while the pool has room, else
    /// the first one given back, waiting until the call's deadline.
    pub(super) fn checkout(
        &self,
        use_: Use,
        call: &Call<'_>,
    ) -> Result<(Slot<'_>, Conn), StoreError> {
        self.try_checkout(use_, call.deadline, call)?
            .ok_or_else(|| self.timed_out(call))
    }

    /// A connection for a call that may block, or `None` when its keys (`raw`) appeared while
    /// it queued for one. Every place blocking calls may take can be held by waits on keys that
    /// appear only once this call returns (thread 1 waits for `b`, which thread 2 sets after
    /// its own wait for `a`), so a queued call looks again, with backoff, whether its keys
    /// exist.
    pub(super) fn checkout_blocking(
        &self,
        call: &Call<'_>,
        raw: &[Vec<u8>],
    ) -> Result<Option<(Slot<'_>, Conn)>, StoreError> {
        let mut pause = Duration::from_millis(5);
        loop {
            let until = earlier(call.deadline, optional_deadline(pause));
            if let Some(lent) = self.try_checkout(Use::Blocking, until, call)? {
                return Ok(Some(lent));
            }
            if call.deadline.is_some_and(|d| Instant::now() >= d) {
                return Err(self.timed_out(call));
            }
            if self.present(call, raw)? {
                return Ok(None);
            }
            pause = (pause * 2).min(Duration::from_millis(200));
        }
    }

    /// [`checkout`](Self::checkout) until `until` (`None`: for ever); `Ok(None)` when it passed
    /// with no place free. A new connection is opened within the call's own deadline.
    fn try_checkout(
        &self,
        use_: Use,
        until: Option<Instant>,
        call: &Call<'_>,
    ) -> Result<Option<(Slot<'_>, Conn)>, StoreError> {
        let mut pool = self.lock();
        loop {
            // Blocking calls leave the last place to quick ones, so that a `set` never waits
            // for a key some other thread waits for.
            let allowed = use_ == Use::Quick || pool.blocking + 1 < Self::MAX_CONNECTIONS;
            if allowed && (!pool.idle.is_empty() || pool.open < Self::MAX_CONNECTIONS) {
                if use_ == Use::Blocking {
                    pool.blocking += 1;
                }
                let slot = Slot {
                    store: self,
                    use_,
                    returned: false,
                };
                if let Some(conn) = pool.idle.pop() {
                    return Ok(Some((slot, conn)));
                }
                pool.open += 1;
                pool.peak = pool.peak.max(pool.open);
                drop(pool);
                // Connect without the lock, so that other calls go on meanwhile. On failure
                // the slot's drop gives the place back.
                let conn = connect_with_retry(&self.host, self.port, &self.addr, call.deadline)?;
                return Ok(Some((slot, conn)));
            }
            pool = match until {
                None => self.freed.wait(pool).unwrap_or_else(|e| e.into_inner()),
                Some(until) => {
                    let left = until.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        return Ok(None);
                    }
                    self.freed
                        .wait_timeout(pool, left)
                        .unwrap_or_else(|e| e.into_inner())
                        .0
                }
            };
        }
    }

    /// Takes back a lent connection: `Some` to lend again, `None` when it was closed. Past
    /// [`MAX_IDLE`](Self::MAX_IDLE) idle ones it is closed too: a burst of concurrent waits
    /// would otherwise leave every rank holding the most connections for the rest of the job,
    /// and the server (one process for the whole job) their file descriptors.
    fn release(&self, conn: Option<Conn>, use_: Use) {
        let mut pool = self.lock();
        if use_ == Use::Blocking {
            pool.blocking -= 1;
        }
        let surplus = match conn {
            Some(c) if pool.idle.len() < Self::MAX_IDLE => {
                pool.idle.push(c);
                None
            }
            closing => {
                pool.open -= 1;
                closing
            }
        };
        drop(pool);
        // Closed outside the lock (the server sees an end of stream, as from a finished rank).
        drop(surplus);
        // Every waiter re-checks: a quick call may take a place a blocking one may not.
        self.freed.notify_all();
    }
}

/// The earlier of two deadlines, `None` being none.
fn earlier(a: Option<Instant>, b: Option<Instant>) -> Option<Instant> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, None) => a,
        (None, b) => b,
    }
}
