//! `RpcFuture`: the handle of a call in flight, and the slot its reply lands in.

use std::marker::PhantomData;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use crate::agent::{Agent, Outcome};
use crate::{Error, Result};

/// Where a call's outcome is put by whichever thread learns it first (the connection's reader,
/// a peer's death, shutdown) and taken by the waiter.
pub(crate) struct Slot {
    outcome: Mutex<Option<Outcome>>,
    done: Condvar,
}

impl Slot {
    pub(crate) fn new() -> Self {
        Slot {
            outcome: Mutex::new(None),
            done: Condvar::new(),
        }
    }

    /// Stores the outcome (the first one wins) and wakes the waiter.
    pub(crate) fn complete(&self, o: Outcome) {
        let mut g = self.outcome.lock().unwrap_or_else(|e| e.into_inner());
        if g.is_none() {
            *g = Some(o);
        }
        self.done.notify_all();
    }

    /// Waits for the outcome until `deadline`; `None` when it passed first.
    pub(crate) fn wait(&self, deadline: Instant) -> Option<Outcome> {
        let mut g = self.outcome.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            if let Some(o) = g.take() {
                return Some(o);
            }
            let now = Instant::now();
            if now >= deadline {
                return None;
            }
            g = self
                .done
                .wait_timeout(g, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    /// Whether an outcome is there.
    pub(crate) fn is_done(&self) -> bool {
        self.outcome
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_some()
    }
}

/// A call in flight (torch's `Future` from `rpc_async`). [`wait`](Self::wait) returns its
/// result, or fails once its timeout (set when the call was made) has passed. Dropping it
/// without waiting is allowed: the reply is then discarded when it arrives.
pub struct RpcFuture<R> {
    pub(crate) agent: Arc<Agent>,
    pub(crate) slot: Arc<Slot>,
    pub(crate) call_id: u64,
    pub(crate) peer: usize,
    pub(crate) func: String,
    pub(crate) deadline: Instant,
    pub(crate) timeout: Duration,
    pub(crate) decode: fn(&Arc<Agent>, usize, &str, Outcome) -> Result<R>,
    pub(crate) _r: PhantomData<fn() -> R>,
}

impl<R> std::fmt::Debug for RpcFuture<R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RpcFuture")
            .field("call_id", &self.call_id)
            .field("peer", &self.peer)
            .field("func", &self.func)
            .field("done", &self.slot.is_done())
            .finish()
    }
}

impl<R> Drop for RpcFuture<R> {
    /// A call no one waits for any more leaves the table at once (its reply, if it comes, is
    /// discarded), so it cannot keep this worker busy until shutdown's timeout. The callee
    /// still finishes it, and shutdown still waits for that.
    fn drop(&mut self) {
        if !self.slot.is_done() {
            self.agent.forget_call(self.call_id);
        }
    }
}

impl<R> RpcFuture<R> {
    /// Whether the outcome has arrived (`wait` would not block).
    pub fn is_completed(&self) -> bool {
        self.slot.is_done()
    }

    /// The call's id on this worker (it appears in errors and logs).
    pub fn call_id(&self) -> u64 {
        self.call_id
    }

    /// Waits for the result: the callee's value, its error ([`Error::Remote`]), or
    /// [`Error::Timeout`] / [`Error::PeerLost`] / [`Error::PeerShutDown`].
    pub fn wait(self) -> Result<R> {
        self.wait_ref()
    }

    fn wait_ref(&self) -> Result<R> {
        match self.slot.wait(self.deadline) {
            Some(o) => (self.decode)(&self.agent, self.peer, &self.func, o),
            None => {
                // The reply may land between the timeout and this removal: it then wins.
                if !self.agent.forget_call(self.call_id)
                    && let Some(o) = self.slot.wait(Instant::now())
                {
                    return (self.decode)(&self.agent, self.peer, &self.func, o);
                }
                Err(Error::Timeout {
                    worker: self.agent.label().to_owned(),
                    peer: self.agent.worker(self.peer).to_string(),
                    func: self.func.clone(),
                    call_id: self.call_id,
                    timeout: self.timeout,
                })
            }
        }
    }
}
