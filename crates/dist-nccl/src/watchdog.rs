//! The watchdog: the state every operation of one communicator shares, and the thread that
//! polls it.
//!
//! Each enqueued operation is registered as [`Pending`] with its completion (a CUDA event) and
//! deadline. The watchdog thread (and any caller waiting for completion) polls them; the
//! first failure it finds (an op past its timeout, `ncclCommGetAsyncError` reporting an error,
//! an event query failing) becomes the sticky [`AbortCause`]: the communicator is aborted
//! (`ncclCommAbort`, which also ends kernels stuck waiting for a dead peer), every pending
//! operation fails with [`Error::CommAborted`] naming op, seq and the peer state known, and so
//! does every later one. The state machine is generic over [`CommProbe`] and [`Completion`], so
//! it is tested with fakes on machines without a GPU.

use std::collections::VecDeque;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::error::AbortCause;
use crate::{Error, Result};

/// The communicator, as the watchdog sees it.
pub(crate) trait CommProbe: Send + Sync + 'static {
    /// NCCL's asynchronous error, `None` while healthy (`ncclCommGetAsyncError`).
    fn async_error(&self) -> Option<String>;
    /// Aborts the communicator (idempotent, may be called from any thread).
    fn abort(&self);
}

/// Whether one operation has finished on the GPU.
pub(crate) trait Completion: Send + 'static {
    /// `Ok(true)` once done; `Err(code)` when the device reports a failure.
    fn poll(&self) -> std::result::Result<bool, String>;
}

/// What the flight recorder remembers of one operation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FlightRecord {
    /// Sequence number in the group.
    pub seq: u64,
    /// Operation name.
    pub op: &'static str,
    /// Bytes the operation moves on this rank (its input).
    pub bytes: usize,
    /// Where it stands.
    pub state: OpState,
    /// Time from enqueue to the state (for a completed op, to when completion was noticed).
    pub elapsed: Duration,
}

/// The state of one operation in the flight recorder.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum OpState {
    /// Enqueued; the GPU has not finished it.
    Pending,
    /// Finished on the GPU.
    Completed,
    /// Failed with the communicator's abort.
    Failed,
}

/// One enqueued operation.
pub(crate) struct Pending {
    pub(crate) seq: u64,
    pub(crate) op: &'static str,
    pub(crate) bytes: usize,
    pub(crate) started: Instant,
    pub(crate) timeout: Duration,
    pub(crate) done: Box<dyn Completion>,
}

struct State {
    pending: VecDeque<Pending>,
    failed: Option<AbortCause>,
    /// Highest seq seen complete.
    completed: Option<u64>,
    history: VecDeque<FlightRecord>,
    stopped: bool,
}

/// What one communicator's operations and its watchdog share.
pub(crate) struct Watch<C: CommProbe> {
    rank: usize,
    comm: Arc<C>,
    state: Mutex<State>,
    cond: Condvar,
    capacity: usize,
}

impl<C: CommProbe> Watch<C> {
    /// A watch over `comm`, remembering the last `capacity` operations.
    pub(crate) fn new(rank: usize, comm: Arc<C>, capacity: usize) -> Self {
        Watch {
            rank,
            comm,
            state: Mutex::new(State {
                pending: VecDeque::new(),
                failed: None,
                completed: None,
                history: VecDeque::new(),
                stopped: false,
            }),
            cond: Condvar::new(),
            capacity: capacity.max(1),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The communicator.
    pub(crate) fn comm(&self) -> &Arc<C> {
        &self.comm
    }

    /// Fails with the sticky abort if there was one (before enqueuing `op` `seq`).
    pub(crate) fn check(&self, op: &'static str, seq: u64) -> Result<()> {
        let st = self.lock();
        match &st.failed {
            Some(cause) => Err(self.aborted(&st, op, seq, cause.clone())),
            None => Ok(()),
        }
    }

    fn aborted(&self, st: &State, op: &'static str, seq: u64, cause: AbortCause) -> Error {
        let done = match st.completed {
            Some(s) => format!("this rank completed up to #{s}"),
            None => "this rank completed no operation".to_owned(),
        };
        let pending: Vec<String> = st
            .pending
            .iter()
            .map(|p| format!("{} #{}", p.op, p.seq))
            .collect();
        let peers = if pending.is_empty() {
            format!("{done}; NCCL does not say which peer failed (see the group's progress report)")
        } else {
            format!(
                "{done}, pending: {}; NCCL does not say which peer failed (see the group's progress report)",
                pending.join(", ")
            )
        };
        Error::CommAborted {
            rank: self.rank,
            op,
            seq,
            cause,
            peers,
        }
    }

    fn remember(&self, st: &mut State, r: FlightRecord) {
        if st.history.len() == self.capacity {
            st.history.pop_front();
        }
        st.history.push_back(r);
    }

    /// Registers an enqueued operation.
    pub(crate) fn push(&self, p: Pending) {
        let mut st = self.lock();
        st.pending.push_back(p);
    }

    /// Drops finished operations (in enqueue order: a stream finishes in order) and returns
    /// the first failure found, making it sticky and aborting the communicator.
    pub(crate) fn tick(&self, now: Instant) -> Option<AbortCause> {
        let mut st = self.lock();
        if st.failed.is_some() {
            return None;
        }
        let cause = self.find_failure(&mut st, now);
        if let Some(c) = &cause {
            self.fail(st, c.clone(), now);
        }
        cause
    }

    fn find_failure(&self, st: &mut State, now: Instant) -> Option<AbortCause> {
        let mut i = 0;
        while i < st.pending.len() {
            match st.pending[i].done.poll() {
                Ok(true) => {
                    let p = st.pending.remove(i)?;
                    st.completed = Some(st.completed.map_or(p.seq, |c| c.max(p.seq)));
                    let r = FlightRecord {
                        seq: p.seq,
                        op: p.op,
                        bytes: p.bytes,
                        state: OpState::Completed,
                        elapsed: now.saturating_duration_since(p.started),
                    };
                    self.remember(st, r);
                }
                Ok(false) => i += 1,
                Err(code) => {
                    let p = &st.pending[i];
                    return Some(AbortCause::AsyncError {
                        code,
                        op: p.op,
                        seq: p.seq,
                    });
                }
            }
        }
        if let Some(code) = self.comm.async_error() {
            let (op, seq) = st
                .pending
                .front()
                .map_or(("no operation", st.completed.unwrap_or(0)), |p| {
                    (p.op, p.seq)
                });
            return Some(AbortCause::AsyncError { code, op, seq });
        }
        st.pending
            .iter()
            .find(|p| now.saturating_duration_since(p.started) > p.timeout)
            .map(|p| AbortCause::Timeout {
                op: p.op,
                seq: p.seq,
                timeout: p.timeout,
            })
    }

    fn fail(&self, mut st: MutexGuard<'_, State>, cause: AbortCause, now: Instant) {
        st.failed = Some(cause.clone());
        let failed: Vec<FlightRecord> = st
            .pending
            .iter()
            .map(|p| FlightRecord {
                seq: p.seq,
                op: p.op,
                bytes: p.bytes,
                state: OpState::Failed,
                elapsed: now.saturating_duration_since(p.started),
            })
            .collect();
        for r in failed {
            self.remember(&mut st, r);
        }
        drop(st);
        tracing::error!(rank = self.rank, %cause, "dist-nccl: aborting the communicator");
        // Outside the lock: an abort may take a while, and waiters must see the failure now.
        self.cond.notify_all();
        self.comm.abort();
    }

    /// Fails every pending operation and later one with `cause` (close with work pending).
    pub(crate) fn abort_with(&self, cause: AbortCause) {
        let st = self.lock();
        if st.failed.is_some() {
            return;
        }
        self.fail(st, cause, Instant::now());
    }

    /// Waits until operation `seq` has finished on the GPU, polling its completion (every
    /// `poll`), or until the communicator fails.
    pub(crate) fn wait(&self, op: &'static str, seq: u64, poll: Duration) -> Result<()> {
        let mut st = self.lock();
        loop {
            if let Some(cause) = &st.failed {
                return Err(self.aborted(&st, op, seq, cause.clone()));
            }
            if !st.pending.iter().any(|p| p.seq == seq) {
                return Ok(());
            }
            let now = Instant::now();
            if let Some(cause) = self.find_failure(&mut st, now) {
                let e = self.aborted(&st, op, seq, cause.clone());
                self.fail(st, cause, now);
                return Err(e);
            }
            if !st.pending.iter().any(|p| p.seq == seq) {
                return Ok(());
            }
            st = self
                .cond
                .wait_timeout(st, poll)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    /// Whether any operation is still pending and may yet finish: not once the communicator
    /// failed. Its failed operations stay listed (errors name them) but never leave, and a
    /// close that drained until none was pending waited out its whole timeout after any
    /// failure (300 s by default; twice, through `close` and then `Drop`).
    pub(crate) fn has_pending(&self) -> bool {
        let st = self.lock();
        st.failed.is_none() && !st.pending.is_empty()
    }

    /// The flight recorder: the last operations, oldest first, then the pending ones.
    pub(crate) fn records(&self) -> Vec<FlightRecord> {
        let st = self.lock();
        let now = Instant::now();
        let mut out: Vec<FlightRecord> = st.history.iter().cloned().collect();
        if st.failed.is_none() {
            out.extend(st.pending.iter().map(|p| FlightRecord {
                seq: p.seq,
                op: p.op,
                bytes: p.bytes,
                state: OpState::Pending,
                elapsed: now.saturating_duration_since(p.started),
            }));
        }
        out
    }

    /// Stops the watchdog thread.
    pub(crate) fn stop(&self) {
        self.lock().stopped = true;
        self.cond.notify_all();
    }

    /// Runs the watchdog loop (on its own thread) until [`Watch::stop`].
    pub(crate) fn run(&self, interval: Duration) {
        loop {
            {
                let st = self.lock();
                if st.stopped {
                    return;
                }
                let st = self
                    .cond
                    .wait_timeout(st, interval)
                    .unwrap_or_else(|e| e.into_inner())
                    .0;
                if st.stopped {
                    return;
                }
            }
            self.tick(Instant::now());
        }
    }
}

/// Starts the watchdog thread of `watch` (the backend starts its own, binding the device first).
#[cfg(test)]
pub(crate) fn spawn<C: CommProbe>(
    watch: Arc<Watch<C>>,
    name: String,
    interval: Duration,
) -> std::io::Result<std::thread::JoinHandle<()>> {
    std::thread::Builder::new()
        .name(name)
        .spawn(move || watch.run(interval))
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

    use super::*;

    #[derive(Default)]
    struct FakeComm {
        error: Mutex<Option<String>>,
        aborts: AtomicUsize,
    }

    impl CommProbe for FakeComm {
        fn async_error(&self) -> Option<String> {
            self.error.lock().unwrap().clone()
        }
        fn abort(&self) {
            self.aborts.fetch_add(1, Ordering::SeqCst);
        }
    }

    struct Flag(Arc<AtomicBool>);

    impl Completion for Flag {
        fn poll(&self) -> std::result::Result<bool, String> {
            Ok(self.0.load(Ordering::SeqCst))
        }
    }

    fn op(
        seq: u64,
        name: &'static str,
        t0: Instant,
        timeout: Duration,
    ) -> (Pending, Arc<AtomicBool>) {
        let f = Arc::new(AtomicBool::new(false));
        (
            Pending {
                seq,
                op: name,
                bytes: 4,
                started: t0,
                timeout,
                done: Box::new(Flag(f.clone())),
            },
            f,
        )
    }

    #[test]
    fn completed_ops_leave_and_are_recorded() {
        let w = Watch::new(0, Arc::new(FakeComm::default()), 8);
        let t0 = Instant::now();
        let (p, f) = op(1, "all_reduce", t0, Duration::from_secs(10));
        w.push(p);
        assert!(w.tick(t0).is_none());
        assert!(w.has_pending());
        f.store(true, Ordering::SeqCst);
        assert!(w.tick(t0).is_none());
        assert!(!w.has_pending());
        assert_eq!(w.records()[0].state, OpState::Completed);
        w.wait("all_reduce", 1, Duration::from_millis(1)).unwrap();
        w.check("broadcast", 2).unwrap();
    }

    #[test]
    fn a_timeout_aborts_once_and_fails_pending_and_later_ops() {
        let comm = Arc::new(FakeComm::default());
        let w = Watch::new(3, comm.clone(), 8);
        let t0 = Instant::now();
        let (done, f) = op(6, "broadcast", t0, Duration::from_secs(1));
        f.store(true, Ordering::SeqCst);
        w.push(done);
        let (p, _) = op(7, "all_reduce", t0, Duration::from_secs(1));
        w.push(p);
        assert!(w.tick(t0 + Duration::from_millis(500)).is_none());
        let cause = w.tick(t0 + Duration::from_secs(2)).unwrap();
        assert_eq!(
            cause,
            AbortCause::Timeout {
                op: "all_reduce",
                seq: 7,
                timeout: Duration::from_secs(1)
            }
        );
        assert_eq!(comm.aborts.load(Ordering::SeqCst), 1);
        // Sticky: no second abort, and waiters and later ops fail with the first cause.
        assert!(w.tick(t0 + Duration::from_secs(3)).is_none());
        // Nothing is left to drain: a close stops waiting for the failed op.
        assert!(!w.has_pending());
        assert_eq!(comm.aborts.load(Ordering::SeqCst), 1);
        let e = w
            .wait("all_reduce", 7, Duration::from_millis(1))
            .unwrap_err();
        let msg = e.to_string();
        assert!(msg.contains("rank 3: all_reduce #7 failed"), "{msg}");
        assert!(msg.contains("did not complete within 1s"), "{msg}");
        assert!(msg.contains("completed up to #6"), "{msg}");
        let e = w.check("reduce", 8).unwrap_err();
        assert!(e.to_string().contains("reduce #8 failed"), "{e}");
        assert!(
            e.to_string().contains("all_reduce #7 did not complete"),
            "{e}"
        );
        let states: Vec<OpState> = w.records().iter().map(|r| r.state).collect();
        assert_eq!(states, [OpState::Completed, OpState::Failed]);
    }

    #[test]
    fn an_async_error_names_the_oldest_pending_op() {
        let comm = Arc::new(FakeComm::default());
        let w = Watch::new(1, comm.clone(), 8);
        let t0 = Instant::now();
        let (p, _) = op(4, "all_gather", t0, Duration::from_secs(100));
        w.push(p);
        *comm.error.lock().unwrap() = Some("ncclRemoteError".into());
        let cause = w.tick(t0).unwrap();
        assert_eq!(
            cause,
            AbortCause::AsyncError {
                code: "ncclRemoteError".into(),
                op: "all_gather",
                seq: 4
            }
        );
        assert_eq!(comm.aborts.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn a_waiter_is_woken_by_the_watchdog_thread() {
        let comm = Arc::new(FakeComm::default());
        let w = Arc::new(Watch::new(2, comm.clone(), 8));
        let (p, _) = op(
            1,
            "reduce_scatter",
            Instant::now(),
            Duration::from_secs(600),
        );
        w.push(p);
        let t = spawn(w.clone(), "wd".into(), Duration::from_millis(5)).unwrap();
        // The waiter polls rarely; the watchdog's abort must wake it.
        let waiter = {
            let w = w.clone();
            std::thread::spawn(move || w.wait("reduce_scatter", 1, Duration::from_secs(600)))
        };
        *comm.error.lock().unwrap() = Some("ncclSystemError".into());
        let e = waiter.join().unwrap().unwrap_err();
        assert!(
            e.to_string().contains("NCCL reported ncclSystemError"),
            "{e}"
        );
        w.stop();
        t.join().unwrap();
        assert_eq!(comm.aborts.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn a_device_failure_on_poll_aborts() {
        struct Broken;
        impl Completion for Broken {
            fn poll(&self) -> std::result::Result<bool, String> {
                Err("CUDA_ERROR_LAUNCH_FAILED".into())
            }
        }
        let comm = Arc::new(FakeComm::default());
        let w = Watch::new(0, comm.clone(), 2);
        w.push(Pending {
            seq: 9,
            op: "send",
            bytes: 0,
            started: Instant::now(),
            timeout: Duration::from_secs(60),
            done: Box::new(Broken),
        });
        let e = w.wait("send", 9, Duration::from_millis(1)).unwrap_err();
        assert!(e.to_string().contains("CUDA_ERROR_LAUNCH_FAILED"), "{e}");
        assert_eq!(comm.aborts.load(Ordering::SeqCst), 1);
        w.abort_with(AbortCause::Closed);
        assert_eq!(comm.aborts.load(Ordering::SeqCst), 1);
    }
}
