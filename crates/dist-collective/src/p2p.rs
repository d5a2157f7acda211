//! The point-to-point engine of a group: its own backend (its own connections), off the
//! collective queue, with a doorbell so that a receive never blocks a send.
//!
//! A backend runs one operation at a time, and a blocking `recv` holds it until the message
//! arrives, so a naive design deadlocks on the most common pattern (both ranks `irecv`, then
//! `send`). Here a receive is only handed to the backend once its message has begun to arrive;
//! until then, sends queued after it go ahead. A backend that can tell
//! ([`Backend::probe`], e.g. gloo) is asked directly, which costs a non-blocking read of the
//! peer's connection; for any other backend every send first rings the receiver's doorbell (a
//! queue in the group's store naming the sender and tag). Messages with the same source and
//! tag are received in the order they were sent; a large send completes once the receiver has
//! posted the matching receive, or while the receiver's engine is busy with other messages (it
//! reads ahead whatever arrives).
//!
//! Once a receive has waited longer than a short spin, a backend that can
//! ([`Backend::wait_for_arrival`], e.g. gloo) puts the engine to sleep in its poller, so the
//! message wakes it the moment it lands; a new job handed to the engine meanwhile wakes it
//! through the backend's arrival waker ([`P2pQueue`]). Other backends are polled with a
//! growing backoff.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering, fence};
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender, TryRecvError, channel};
use std::task::Waker;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use dist_backend::{Backend, Store};
use dist_wire::CollectiveOp;

use crate::Error;

/// Send or receive.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Dir {
    Send,
    Recv,
}

/// What the job's closure gets: the backend, or why it will not run.
pub(crate) type P2pRun = Box<dyn FnOnce(Result<&dyn Backend, Error>) + Send>;

/// One queued send or receive.
pub(crate) struct P2pJob {
    pub(crate) dir: Dir,
    pub(crate) peer: usize,
    pub(crate) tag: u32,
    /// Issue number in the group's flight recorder, named by a timeout.
    pub(crate) seq: u64,
    pub(crate) deadline: Instant,
    pub(crate) started: Instant,
    pub(crate) run: P2pRun,
}

/// How long the engine keeps polling without sleeping once nothing can progress (probing
/// backends only): the same budget the gloo transport spins before sleeping.
const SPIN: Duration = Duration::from_micros(100);

fn inbox(rank: usize) -> String {
    format!("p2p/inbox/{rank}")
}

/// Where the group's threads hand the engine its jobs. Dropping it stops the engine (pending
/// receives fail with [`Error::Destroyed`]).
pub(crate) struct P2pQueue {
    /// `None` only while dropping.
    tx: Option<Sender<P2pJob>>,
    /// What ends the engine's sleep in the backend's poller, where it sleeps there.
    wake: Option<SleepWake>,
}

/// The engine's side of the hand-over: it raises `sleeping` before it sleeps in the backend's
/// poller, so that a job sent meanwhile wakes it and other jobs cost no system call.
struct SleepWake {
    sleeping: Arc<AtomicBool>,
    waker: Waker,
}

impl SleepWake {
    fn wake_if_sleeping(&self) {
        // Pairs with the engine's fence between raising the flag and its last look at the
        // channel: either it sees the job, or this sees the flag.
        fence(Ordering::SeqCst);
        if self.sleeping.load(Ordering::Relaxed) {
            self.waker.wake_by_ref();
        }
    }
}

impl P2pQueue {
    /// Hands `job` to the engine; gives it back when the engine has stopped.
    pub(crate) fn submit(&self, job: P2pJob) -> Result<(), P2pJob> {
        let Some(tx) = &self.tx else {
            return Err(job);
        };
        tx.send(job).map_err(|e| e.0)?;
        if let Some(w) = &self.wake {
            w.wake_if_sleeping();
        }
        Ok(())
    }
}

impl Drop for P2pQueue {
    fn drop(&mut self) {
        // The channel closes first, so the engine, once woken, finds it closed.
        drop(self.tx.take());
        if let Some(w) = &self.wake {
            w.waker.wake_by_ref();
        }
    }
}

/// Starts the engine's thread. Fails only when the thread cannot be started.
pub(crate) fn start(
    backend: Box<dyn Backend>,
    store: Arc<dyn Store>,
    name: String,
) -> std::io::Result<(P2pQueue, JoinHandle<()>)> {
    let (tx, rx) = channel();
    let sleeping = Arc::new(AtomicBool::new(false));
    let wake = probes(&*backend)
        .then(|| backend.arrival_waker())
        .flatten()
        .map(|waker| SleepWake {
            sleeping: Arc::clone(&sleeping),
            waker,
        });
    let sleeps = wake.is_some().then_some(sleeping);
    let handle = std::thread::Builder::new()
        .name(name)
        .spawn(move || Engine::new(backend, store, rx, sleeps).run())?;
    Ok((P2pQueue { tx: Some(tx), wake }, handle))
}

/// Whether the engine asks `backend` if a message has arrived rather than ringing doorbells.
/// `DIST_P2P_DOORBELL=1` forces the store doorbells (to rule the probe out when debugging, and
/// so tests cover the path backends without a probe take).
fn probes(backend: &dyn Backend) -> bool {
    backend.capabilities().probe && std::env::var("DIST_P2P_DOORBELL").map_or(true, |v| v != "1")
}

struct Engine {
    backend: Box<dyn Backend>,
    store: Arc<dyn Store>,
    rx: Receiver<P2pJob>,
    rank: usize,
    pending: VecDeque<P2pJob>,
    /// Announced but not yet received messages, by (source, tag) (doorbell mode).
    announced: HashMap<(usize, u32), u64>,
    /// Ask the backend whether a message has arrived instead of ringing doorbells.
    probing: bool,
    /// Raised while the engine sleeps in the backend's poller ([`Backend::wait_for_arrival`]);
    /// `None` where it does not sleep there (no probe, or no arrival waker).
    sleeping: Option<Arc<AtomicBool>>,
    closed: bool,
}

impl Engine {
    fn new(
        backend: Box<dyn Backend>,
        store: Arc<dyn Store>,
        rx: Receiver<P2pJob>,
        sleeping: Option<Arc<AtomicBool>>,
    ) -> Self {
        let rank = backend.rank();
        let probing = probes(&*backend);
        Engine {
            backend,
            store,
            rx,
            rank,
            pending: VecDeque::new(),
            announced: HashMap::new(),
            probing,
            sleeping,
            closed: false,
        }
    }

    /// Sleeps in the backend's poller until a message may have arrived, a job is handed over
    /// (its [`P2pQueue::submit`] wakes the poller) or the nearest receive's deadline passes.
    /// Returns false, without sleeping, where the engine does not sleep there.
    fn sleep_for_arrival(&mut self) -> bool {
        let Some(sleeping) = self.sleeping.clone() else {
            return false;
        };
        let now = Instant::now();
        let Some(deadline) = self.pending.iter().map(|j| j.deadline).min() else {
            return true;
        };
        sleeping.store(true, Ordering::Relaxed);
        // Pairs with the submitter's fence (`SleepWake::wake_if_sleeping`).
        fence(Ordering::SeqCst);
        match self.rx.try_recv() {
            Ok(j) => self.pending.push_back(j),
            Err(TryRecvError::Disconnected) => self.closed = true,
            Err(TryRecvError::Empty) => {
                // An error here is the backend's own (its poller failed): the receives
                // probe again and meet it, or their deadline.
                let _ = self
                    .backend
                    .wait_for_arrival(deadline.saturating_duration_since(now));
            }
        }
        sleeping.store(false, Ordering::Relaxed);
        true
    }

    fn run(mut self) {
        // Between polls for a message that has not arrived. A probe is a non-blocking read, a
        // doorbell poll a store round trip: the first can afford to look far more often.
        let (first, most) = if self.probing {
            (Duration::from_micros(2), Duration::from_millis(1))
        } else {
            (Duration::from_micros(20), Duration::from_millis(2))
        };
        let mut backoff = first;
        let mut idle_since: Option<Instant> = None;
        loop {
            if self.pending.is_empty() {
                if self.closed {
                    return;
                }
                // Idle: nothing is in flight, so waiting for work has no deadline to keep.
                match self.rx.recv() {
                    Ok(j) => self.pending.push_back(j),
                    Err(_) => return,
                }
            }
            loop {
                match self.rx.try_recv() {
                    Ok(j) => self.pending.push_back(j),
                    Err(TryRecvError::Empty) => break,
                    Err(TryRecvError::Disconnected) => {
                        self.closed = true;
                        break;
                    }
                }
            }
            let progressed = self.step();
            if self.closed {
                self.fail_receives();
                continue;
            }
            if progressed {
                backoff = first;
                idle_since = None;
            } else if self.probing
                && !self.pending.is_empty()
                && idle_since.get_or_insert_with(Instant::now).elapsed() < SPIN
            {
                // A message usually lands within a round trip: sleeping through it would
                // cost more than looking again.
                std::thread::yield_now();
                match self.rx.try_recv() {
                    Ok(j) => self.pending.push_back(j),
                    Err(TryRecvError::Empty) => {}
                    Err(TryRecvError::Disconnected) => self.closed = true,
                }
            } else if !self.pending.is_empty() && !self.sleep_for_arrival() {
                match self.rx.recv_timeout(backoff) {
                    Ok(j) => self.pending.push_back(j),
                    Err(RecvTimeoutError::Timeout) => {}
                    Err(RecvTimeoutError::Disconnected) => self.closed = true,
                }
                backoff = (backoff * 2).min(most);
            }
        }
    }

    /// Reads the doorbell queue; returns false (after failing the receives) on a store error.
    /// The reads end by the nearest deadline of the receives waiting for them: the engine's
    /// one thread serves them all, so a silent store must not hold it past any of them.
    /// Receives already past theirs are left to time out in [`Engine::step`].
    fn poll_inbox(&mut self) -> bool {
        let now = Instant::now();
        let Some(by) = self
            .pending
            .iter()
            .filter(|j| j.dir == Dir::Recv && j.deadline > now)
            .map(|j| j.deadline)
            .min()
        else {
            return true;
        };
        loop {
            match self.store.queue_pop_by(&inbox(self.rank), false, by) {
                Ok(Some(v)) => {
                    let s = String::from_utf8_lossy(&v);
                    if let Some((src, tag)) = s.split_once(':')
                        && let (Ok(src), Ok(tag)) = (src.parse(), tag.parse())
                    {
                        *self.announced.entry((src, tag)).or_insert(0) += 1;
                    }
                }
                Ok(None) => return true,
                Err(e) => {
                    // The first waiting receive gets the error; the others retry next round
                    // (and meet their own error if the store is gone).
                    if let Some(i) = self.pending.iter().position(|j| j.dir == Dir::Recv)
                        && let Some(j) = self.pending.remove(i)
                    {
                        (j.run)(Err(Error::store(
                            self.rank,
                            format!("recv from rank {}: reading the doorbell", j.peer),
                            e,
                        )));
                    }
                    return false;
                }
            }
        }
    }

    fn take_receives(&mut self) -> Vec<P2pJob> {
        let (recvs, rest): (Vec<_>, Vec<_>) =
            self.pending.drain(..).partition(|j| j.dir == Dir::Recv);
        self.pending = rest.into();
        recvs
    }

    fn fail_receives(&mut self) {
        for j in self.take_receives() {
            (j.run)(Err(Error::Destroyed {
                rank: self.rank,
                op: "recv",
            }));
        }
    }

    /// Runs every job that can run now, in order; returns whether any ran.
    fn step(&mut self) -> bool {
        if !self.probing && self.pending.iter().any(|j| j.dir == Dir::Recv) {
            self.poll_inbox();
        }
        let mut progressed = false;
        let mut blocked: Vec<(usize, u32)> = Vec::new();
        let mut i = 0;
        while i < self.pending.len() {
            let j = &self.pending[i];
            let key = (j.peer, j.tag);
            match j.dir {
                Dir::Send => {
                    let Some(j) = self.pending.remove(i) else {
                        break;
                    };
                    progressed = true;
                    if self.probing {
                        (j.run)(Ok(&*self.backend));
                        continue;
                    }
                    let bell = format!("{}:{}", self.rank, j.tag);
                    // Ringing is part of the send: it ends by the send's deadline.
                    match self
                        .store
                        .queue_push_by(&inbox(j.peer), bell.as_bytes(), j.deadline)
                    {
                        Ok(()) => (j.run)(Ok(&*self.backend)),
                        Err(e) => (j.run)(Err(Error::store(
                            self.rank,
                            format!("send to rank {}: ringing its doorbell", j.peer),
                            e,
                        ))),
                    }
                }
                Dir::Recv => {
                    let ready = !blocked.contains(&key)
                        && if self.probing {
                            // An error (a bad peer, say) is the receive's to report.
                            self.backend.probe(key.0, key.1).unwrap_or(true)
                        } else {
                            self.announced.get(&key).copied().unwrap_or(0) > 0
                        };
                    if ready {
                        if let Some(n) = self.announced.get_mut(&key) {
                            *n -= 1;
                        }
                        let Some(j) = self.pending.remove(i) else {
                            break;
                        };
                        progressed = true;
                        (j.run)(Ok(&*self.backend));
                    } else if Instant::now() >= j.deadline {
                        let Some(j) = self.pending.remove(i) else {
                            break;
                        };
                        progressed = true;
                        (j.run)(Err(Error::Backend(dist_backend::Error::Timeout {
                            rank: self.rank,
                            op: CollectiveOp::SendRecv,
                            seq: j.seq,
                            waited: j.started.elapsed(),
                            missing_peers: vec![j.peer],
                        })));
                    } else {
                        blocked.push(key);
                        i += 1;
                    }
                }
            }
        }
        progressed
    }
}
