//! The per-group executor: one worker thread that runs queued (async) operations, and a ticket
//! order that blocking operations on the caller's thread join, so that every operation of a
//! group runs in issue order.
//!
//! The ticket doubles as the group's collective sequence number: every rank issues the group's
//! collectives in the same order, so ticket `n` names the same collective on every rank, which
//! is what progress reports compare.

use std::collections::VecDeque;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;

use dist_backend::Backend;

/// A queued operation: runs on the worker with the group's backend and its ticket.
pub(crate) type Job = Box<dyn FnOnce(&dyn Backend, u64) + Send>;

struct Queue {
    next_ticket: u64,
    now_serving: u64,
    jobs: VecDeque<(u64, Job)>,
    closed: bool,
}

/// A backend plus the order its operations run in.
pub(crate) struct Exec {
    backend: Box<dyn Backend>,
    q: Mutex<Queue>,
    cv: Condvar,
}

/// Advances the ticket order when an operation ends, even by a panic.
struct Advance<'a>(&'a Exec);

impl Drop for Advance<'_> {
    fn drop(&mut self) {
        let mut q = self.0.q.lock().unwrap_or_else(|e| e.into_inner());
        q.now_serving += 1;
        self.0.cv.notify_all();
    }
}

impl Exec {
    /// An executor over `backend` and its worker thread. Fails only when the thread cannot be
    /// started.
    pub(crate) fn start(
        backend: Box<dyn Backend>,
        name: String,
    ) -> std::io::Result<(Arc<Exec>, JoinHandle<()>)> {
        let exec = Arc::new(Exec {
            backend,
            q: Mutex::new(Queue {
                next_ticket: 0,
                now_serving: 0,
                jobs: VecDeque::new(),
                closed: false,
            }),
            cv: Condvar::new(),
        });
        let e = exec.clone();
        let handle = std::thread::Builder::new()
            .name(name)
            .spawn(move || e.work())?;
        Ok((exec, handle))
    }

    /// The backend (to close it once the worker has finished).
    pub(crate) fn backend(&self) -> &dyn Backend {
        &*self.backend
    }

    /// Runs `f` (given the backend and this operation's ticket) on this thread once every
    /// operation issued before it has finished; operations issued after it wait for it.
    /// `on_ticket` sees the ticket as soon as it is taken. `None` when the group is closed.
    pub(crate) fn run_inline<R>(
        &self,
        on_ticket: impl FnOnce(u64),
        f: impl FnOnce(&dyn Backend, u64) -> R,
    ) -> Option<R> {
        let mut q = self.q.lock().unwrap_or_else(|e| e.into_inner());
        if q.closed {
            return None;
        }
        let t = q.next_ticket;
        q.next_ticket += 1;
        on_ticket(t);
        // Bounded: every earlier operation is bounded by its own timeout.
        while q.now_serving != t {
            q = self.cv.wait(q).unwrap_or_else(|e| e.into_inner());
        }
        drop(q);
        let _advance = Advance(self);
        Some(f(&*self.backend, t))
    }

    /// Queues the job `make` builds for its ticket after every operation issued so far (`make`
    /// runs under the queue's lock, so the job is recorded before it can start). `None` if the
    /// group is closed.
    pub(crate) fn submit(&self, make: impl FnOnce(u64) -> Job) -> Option<u64> {
        let mut q = self.q.lock().unwrap_or_else(|e| e.into_inner());
        if q.closed {
            return None;
        }
        let t = q.next_ticket;
        q.next_ticket += 1;
        q.jobs.push_back((t, make(t)));
        self.cv.notify_all();
        Some(t)
    }

    /// Stops taking jobs; the worker finishes the queued ones and exits.
    pub(crate) fn close(&self) {
        let mut q = self.q.lock().unwrap_or_else(|e| e.into_inner());
        q.closed = true;
        self.cv.notify_all();
    }

    fn work(&self) {
        loop {
            let job = {
                let mut q = self.q.lock().unwrap_or_else(|e| e.into_inner());
                loop {
                    if q.jobs.front().is_some_and(|(t, _)| *t == q.now_serving) {
                        break q.jobs.pop_front();
                    }
                    if q.closed && q.jobs.is_empty() {
                        break None;
                    }
                    q = self.cv.wait(q).unwrap_or_else(|e| e.into_inner());
                }
            };
            let Some((ticket, job)) = job else { return };
            let _advance = Advance(self);
            // A panicking job drops its completer, which completes its Work with an error.
            if catch_unwind(AssertUnwindSafe(|| job(&*self.backend, ticket))).is_err() {
                tracing::error!(
                    rank = self.backend.rank(),
                    "a queued operation panicked; its Work reports the group as destroyed"
                );
            }
        }
    }
}
