//! [`Work`]: the handle an asynchronous operation returns, and the slot its worker completes.

use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use crate::{Error, Result};

/// Where a worker puts an operation's outcome.
struct Slot<T> {
    value: Mutex<Option<Result<T>>>,
    cv: Condvar,
}

/// The worker's side of a [`Work`]: completing it wakes the waiter. Dropped without completing
/// (the group was destroyed first, or the job panicked), it completes the work with
/// [`Error::Destroyed`], so a waiter never hangs.
pub(crate) struct Completer<T> {
    slot: Option<Arc<Slot<T>>>,
    rank: usize,
    op: &'static str,
}

impl<T> Completer<T> {
    pub(crate) fn complete(mut self, r: Result<T>) {
        if let Some(slot) = self.slot.take() {
            fill(&slot, r);
        }
    }
}

fn fill<T>(slot: &Slot<T>, r: Result<T>) {
    let mut v = slot.value.lock().unwrap_or_else(|e| e.into_inner());
    *v = Some(r);
    slot.cv.notify_all();
}

impl<T> Drop for Completer<T> {
    fn drop(&mut self) {
        if let Some(slot) = self.slot.take() {
            fill(
                &slot,
                Err(Error::Destroyed {
                    rank: self.rank,
                    op: self.op,
                }),
            );
        }
    }
}

/// A handle on an operation issued with an `*_async` method (torch's `Work`).
///
/// The handle **owns** the operation's buffer while it runs: the `*_async` methods take a
/// `Vec<T>` and [`wait`](Work::wait) gives the result back (for most operations the same
/// vector, holding the result). No borrow of user memory outlives the call that issued the
/// operation, so the borrow checker rules out reading a buffer that is still on the wire.
///
/// Operations of one group run in issue order on the group's worker thread; several groups
/// progress concurrently.
///
/// **Dropping an unfinished handle** does not cancel the operation (peers are waiting for it,
/// and cancelling one rank's half of a collective would hang or corrupt the others): it still
/// runs to completion in the background, in its place in the order, and its buffer and result
/// are then dropped. Nothing leaks, and later operations see the group exactly as if the handle
/// had been waited on. An error from a dropped handle's operation is logged (and recorded in the
/// flight recorder), and, as after any failure, the group must then be re-created.
#[must_use = "an async operation's result (and its buffer) comes back through wait()"]
pub struct Work<T> {
    slot: Arc<Slot<T>>,
    rank: usize,
    op: &'static str,
    seq: u64,
}

impl<T> std::fmt::Debug for Work<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Work")
            .field("rank", &self.rank)
            .field("op", &self.op)
            .field("seq", &self.seq)
            .field("completed", &self.is_completed())
            .finish()
    }
}

impl<T> Work<T> {
    /// A handle and the completer its worker fills.
    pub(crate) fn pending(rank: usize, op: &'static str, seq: u64) -> (Self, Completer<T>) {
        let slot = Arc::new(Slot {
            value: Mutex::new(None),
            cv: Condvar::new(),
        });
        (
            Work {
                slot: slot.clone(),
                rank,
                op,
                seq,
            },
            Completer {
                slot: Some(slot),
                rank,
                op,
            },
        )
    }

    /// True once the operation has finished (successfully or not); does not wait.
    pub fn is_completed(&self) -> bool {
        self.slot
            .value
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_some()
    }

    /// Waits up to `timeout` for the operation to finish; true when it has. The handle stays
    /// usable either way.
    pub fn wait_for(&self, timeout: Duration) -> bool {
        let deadline = Instant::now().checked_add(timeout);
        let mut v = self.slot.value.lock().unwrap_or_else(|e| e.into_inner());
        while v.is_none() {
            let left = match deadline {
                Some(d) => d.saturating_duration_since(Instant::now()),
                None => Duration::from_secs(3600),
            };
            if left.is_zero() {
                return false;
            }
            v = self
                .slot
                .cv
                .wait_timeout(v, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        true
    }

    /// Waits for the operation and returns its result (the buffer, for most operations).
    ///
    /// This waits as long as the operation takes; the operation itself is bounded by the
    /// group's timeout, after which it fails with a backend `Timeout`.
    pub fn wait(self) -> Result<T> {
        let mut v = self.slot.value.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            if let Some(r) = v.take() {
                return r;
            }
            v = self.slot.cv.wait(v).unwrap_or_else(|e| e.into_inner());
        }
    }

    /// [`wait`](Work::wait), giving up after `timeout` with [`Error::WaitTimeout`]. On timeout the
    /// handle is dropped: the operation still completes in the background (see the type docs).
    /// Use [`wait_for`](Work::wait_for) to wait without giving the handle up.
    pub fn wait_timeout(self, timeout: Duration) -> Result<T> {
        if self.wait_for(timeout) {
            self.wait()
        } else {
            Err(Error::WaitTimeout {
                rank: self.rank,
                op: self.op,
                seq: self.seq,
                waited: timeout,
            })
        }
    }

    /// The operation's name (`"all_reduce"`, `"isend"`, ...).
    pub fn op(&self) -> &'static str {
        self.op
    }

    /// The operation's issue number in its group (as in the flight recorder).
    pub fn seq(&self) -> u64 {
        self.seq
    }
}
