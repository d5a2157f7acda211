//! The agent: one per `init_rpc`. It owns the connections to every peer (one TCP connection
//! per pair, with a reader thread each), the handler pool, the control thread, the table of
//! calls in flight and the owner's table of RRef values.
//!
//! Threads and what they may do:
//! * a **reader** per peer reads frames and does only non-blocking work: completing calls,
//!   queueing jobs, and the RRef bookkeeping (so that the owner sees one peer's RRef messages
//!   in the order that peer sent them). It never writes to a socket (but for the 32-byte
//!   answer to a peer's goodbye, which that peer reads until it sees our end close), so two
//!   readers can never wait on each other's full socket buffers.
//! * the **pool** (`num_worker_threads`, fixed) runs handlers and writes their replies.
//! * the **control** thread writes what no caller thread should wait for: fork deletions
//!   (sent when an `RRef` is dropped) and replies to fetches that waited for a value.
//!
//! Where each part lives: this file holds the agent's state and `init`; `mesh.rs` the
//! connections' set-up, `send.rs` one frame out to a peer, `calls.rs` the calls in flight and
//! their futures, `forks.rs` the RRef forks, `receive.rs` the reader threads, `pool.rs` the
//! handler pool and the control thread, `shutdown.rs` leaving the job.

use std::collections::{HashMap, VecDeque};
use std::io::{BufReader, Read, Write};
use std::net::{IpAddr, Shutdown, SocketAddr, TcpListener, TcpStream};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use dist_backend::exit::{ExitStage, at_exit};
use dist_backend::store::PrefixStore;
use dist_backend::{Store, StoreError, deadline_after};
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::frame::{
    CallMeta, FailKind, FailMeta, ForkToken, FrameError, GlobalId, HEADER_LEN, Header, HelloMeta,
    Kind, Limits, RRefMeta, ReplyMeta, decode_meta, encode_meta,
};
use crate::future::{RpcFuture, Slot};
use crate::handler::{ErasedValue, Failure, Handlers, Input, Output};
use crate::rref::{
    CellState, Deleted, ForkShared, Owners, RRef, ValueCell, decoding, encoding, fail_kind_what,
};
use crate::{Error, Result, Rpc, RpcOptions, RpcStats, WorkerInfo};

mod calls;
mod forks;
mod mesh;
mod pool;
mod receive;
mod send;
mod shutdown;

use mesh::connect_mesh;

/// How a call ended, as the waiter learns it.
pub(crate) enum Outcome {
    /// The reply: JSON body, raw blob, and the RRef forks that came with it (adopted).
    Reply {
        body: Vec<u8>,
        blob: Vec<u8>,
        forks: Vec<Arc<ForkShared>>,
    },
    /// The callee answered with a failure.
    Fail(FailKind, String),
    /// The peer's connection broke.
    Lost(String),
    /// The peer said goodbye.
    PeerShutDown,
    /// This agent closed.
    ShutDown,
}

/// A call waiting for its reply.
struct Pending {
    peer: usize,
    slot: Arc<Slot>,
}

/// A peer's connection state.
#[derive(Clone, Debug, PartialEq, Eq)]
enum PeerState {
    Up,
    ShutDown,
    Lost(String),
}

/// The write side of a connection (the reader thread holds a clone of the socket for reading).
struct Writer {
    stream: TcpStream,
    closed: bool,
}

struct Peer {
    writer: Mutex<Writer>,
    state: Mutex<PeerState>,
}

/// Work for the pool.
enum Job {
    Call {
        peer: usize,
        call_id: u64,
        meta: CallMeta,
        input: Input,
        forks: Vec<Arc<ForkShared>>,
    },
    Create {
        meta: CallMeta,
        input: Input,
        forks: Vec<Arc<ForkShared>>,
        cell: Arc<ValueCell>,
    },
}

#[derive(Default)]
struct PoolQueue {
    jobs: VecDeque<Job>,
    stop: bool,
}

/// Work for the control thread.
enum Control {
    Delete(ForkToken),
    FetchReply {
        peer: usize,
        call_id: u64,
        value: std::result::Result<Arc<dyn ErasedValue>, (FailKind, String)>,
    },
    Stop,
}

/// The agent's life.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Life {
    Running,
    ShuttingDown,
    Closed,
}

/// Every agent of this process, for the exit hook.
static LIVE: Mutex<Vec<Weak<Agent>>> = Mutex::new(Vec::new());

/// At process exit, agents never shut down say goodbye (a local shutdown), so their peers see
/// an exit, not a crash: calls to this worker then fail at once with `PeerShutDown`.
fn shutdown_all_at_exit() {
    let live = std::mem::take(&mut *lock(&LIVE));
    for a in live.iter().filter_map(Weak::upgrade) {
        if *lock(&a.life) == Life::Running {
            let _ = a.shutdown(false);
        }
    }
}

/// How long the worker serving the store waits for the others to leave once a peer is lost.
const LOST_LEAVE_WAIT: Duration = Duration::from_secs(10);

/// What store calls made past the shutdown's deadline may take together: naming the workers
/// that did not publish, or reading keys a wait found just in time.
const DIAGNOSIS_GRACE: Duration = Duration::from_millis(500);

thread_local! {
    /// Set on pool threads: a handler must not shut down the agent that runs it.
    static IN_POOL: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

pub(crate) struct Agent {
    me: usize,
    label: String,
    workers: Vec<WorkerInfo>,
    peers: Vec<Option<Peer>>,
    handlers: Handlers,
    opts: RpcOptions,
    limits: Limits,
    store: Arc<dyn Store>,
    life: Mutex<Life>,
    next_call: AtomicU64,
    next_id: AtomicU64,
    pending: Mutex<HashMap<u64, Pending>>,
    /// Work this worker still has to do or wait for: calls in flight, queued or running jobs,
    /// queued control messages. Shutdown waits for zero.
    busy: Mutex<usize>,
    idle: Condvar,
    /// Requests sent / requests fully processed, for shutdown's termination detection.
    sent: AtomicU64,
    processed: AtomicU64,
    pool: Mutex<PoolQueue>,
    pool_cv: Condvar,
    running: AtomicUsize,
    peak_running: AtomicUsize,
    peak_queued: AtomicUsize,
    served: AtomicU64,
    control: Mutex<Option<mpsc::Sender<Control>>>,
    owners: Owners,
    /// This worker's live forks (user references), so shutdown can release them.
    live_forks: Mutex<HashMap<GlobalId, Weak<ForkShared>>>,
    threads: Mutex<Vec<JoinHandle<()>>>,
    readers: Mutex<Vec<JoinHandle<()>>>,
    readers_left: Mutex<usize>,
    readers_cv: Condvar,
    /// Pool and control threads not yet returned.
    threads_alive: Mutex<usize>,
    threads_cv: Condvar,
    lost_any: AtomicBool,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// What each worker publishes in the store.
#[derive(serde::Serialize, serde::Deserialize)]
struct Published {
    name: String,
    host: String,
    port: u16,
}

impl Agent {
    // ---- init ----------------------------------------------------------------------------

    pub(crate) fn init(
        name: &str,
        rank: usize,
        world_size: usize,
        store: Arc<dyn Store>,
        opts: RpcOptions,
        deadline: Instant,
    ) -> Result<Arc<Agent>> {
        let label = format!("{name} (rank {rank})");
        let invalid = |what: String| Error::InvalidArgument {
            worker: label.clone(),
            op: "init_rpc",
            what,
        };
        if name.is_empty() {
            return Err(invalid("a worker name must not be empty".into()));
        }
        if opts.num_worker_threads == 0 {
            return Err(invalid("num_worker_threads must be at least 1".into()));
        }
        let store_err = |op: &'static str| {
            let label = label.clone();
            move |source: StoreError| Error::Store {
                worker: label,
                op,
                source,
            }
        };
        // The n-th init of each rank meets the n-th init of every other under `rpc/<n>/`, so
        // a job that shuts RPC down and starts it again never reads the keys of the last one.
        // Every store call of the init ends by the init's deadline (taken by `init_rpc` before
        // it made the store), not a store timeout each.
        let generation = store
            .add_by(&format!("rpc/inits/{rank}"), 1, deadline)
            .map_err(store_err("counting this rank's inits"))?;
        let store: Arc<dyn Store> = Arc::new(PrefixStore::new(format!("rpc/{generation}"), store));
        // The same interface as the rank's Gloo mesh (DIST_SOCKET_IFNAME, else the route to
        // MASTER_ADDR).
        let ip = match opts.listen_ip {
            Some(ip) => ip,
            None => dist_backend::net::local_ip(rank).map_err(|source| Error::Init {
                worker: label.clone(),
                source,
            })?,
        };
        // Bound to port 0 and published: the port is ours from bind until we drop it.
        let listener = TcpListener::bind((ip, 0)).map_err(|source| Error::Io {
            worker: label.clone(),
            peer: "listener".into(),
            op: "binding the listener",
            source,
        })?;
        let port = listener
            .local_addr()
            .map(|a| a.port())
            .map_err(|source| Error::Io {
                worker: label.clone(),
                peer: "listener".into(),
                op: "reading the listener's port",
                source,
            })?;
        let candidate = format!("{}-{}-{:?}", std::process::id(), rank, Instant::now());
        let job = store
            .compare_set_by("job", b"", candidate.as_bytes(), deadline)
            .map_err(store_err("agreeing on the job id"))?;
        let job = String::from_utf8_lossy(&job).into_owned();
        let me = Published {
            name: name.to_owned(),
            host: ip.to_string(),
            port,
        };
        store
            .set_by(
                &format!("addr/{rank}"),
                &serde_json::to_vec(&me).unwrap_or_default(),
                deadline,
            )
            .map_err(store_err("publishing this worker's address"))?;
        let keys: Vec<String> = (0..world_size).map(|r| format!("addr/{r}")).collect();
        let key_refs: Vec<&str> = keys.iter().map(String::as_str).collect();
        store
            .wait_by(&key_refs, deadline)
            .map_err(store_err("waiting for every worker's address"))?;
        let values = store
            .multi_get_by(&key_refs, deadline)
            .map_err(store_err("reading every worker's address"))?;
        let mut published = Vec::with_capacity(world_size);
        for (r, v) in values.iter().enumerate() {
            let p: Published = serde_json::from_slice(v)
                .map_err(|e| invalid(format!("rank {r} published an unreadable address ({e})")))?;
            published.push(p);
        }
        for (r, p) in published.iter().enumerate() {
            if let Some(other) = published[..r].iter().position(|q| q.name == p.name) {
                return Err(invalid(format!(
                    "ranks {other} and {r} are both named {:?}: worker names must be unique",
                    p.name
                )));
            }
        }
        let workers: Vec<WorkerInfo> = published
            .iter()
            .enumerate()
            .map(|(id, p)| WorkerInfo {
                name: p.name.clone(),
                id,
            })
            .collect();
        let streams = connect_mesh(&label, rank, &published, &listener, &job, name, deadline)?;
        drop(listener);
        let mut peers = Vec::with_capacity(world_size);
        let mut read_halves = Vec::new();
        for (r, s) in streams.into_iter().enumerate() {
            match s {
                None => peers.push(None),
                Some(stream) => {
                    // A peer that stops reading (stopped, swapped out) cannot hold a writer,
                    // and the callers queued behind it, forever: a write that cannot finish
                    // within the call timeout breaks the connection.
                    let write_timeout = (opts.rpc_timeout < Duration::from_secs(86_400 * 365))
                        .then(|| opts.rpc_timeout.max(Duration::from_millis(1)));
                    stream
                        .set_write_timeout(write_timeout)
                        .map_err(|source| Error::Io {
                            worker: label.clone(),
                            peer: workers[r].to_string(),
                            op: "setting the write timeout",
                            source,
                        })?;
                    let read = stream.try_clone().map_err(|source| Error::Io {
                        worker: label.clone(),
                        peer: workers[r].to_string(),
                        op: "cloning the socket for its reader",
                        source,
                    })?;
                    read_halves.push((r, read));
                    peers.push(Some(Peer {
                        writer: Mutex::new(Writer {
                            stream,
                            closed: false,
                        }),
                        state: Mutex::new(PeerState::Up),
                    }));
                }
            }
        }
        let (ctl_tx, ctl_rx) = mpsc::channel();
        let agent = Arc::new(Agent {
            me: rank,
            label: label.clone(),
            workers,
            peers,
            handlers: opts.handlers.clone(),
            limits: Limits::default(),
            opts,
            store,
            life: Mutex::new(Life::Running),
            next_call: AtomicU64::new(1),
            next_id: AtomicU64::new(1),
            pending: Mutex::new(HashMap::new()),
            busy: Mutex::new(0),
            idle: Condvar::new(),
            sent: AtomicU64::new(0),
            processed: AtomicU64::new(0),
            pool: Mutex::new(PoolQueue::default()),
            pool_cv: Condvar::new(),
            running: AtomicUsize::new(0),
            peak_running: AtomicUsize::new(0),
            peak_queued: AtomicUsize::new(0),
            served: AtomicU64::new(0),
            control: Mutex::new(Some(ctl_tx)),
            owners: Owners::default(),
            live_forks: Mutex::new(HashMap::new()),
            threads: Mutex::new(Vec::new()),
            readers: Mutex::new(Vec::new()),
            readers_left: Mutex::new(read_halves.len()),
            readers_cv: Condvar::new(),
            threads_alive: Mutex::new(0),
            threads_cv: Condvar::new(),
            lost_any: AtomicBool::new(false),
        });
        let spawn_err = |what: &'static str| {
            let label = label.clone();
            move |source| Error::Io {
                worker: label,
                peer: "self".into(),
                op: what,
                source,
            }
        };
        let mut threads = Vec::new();
        for i in 0..agent.opts.num_worker_threads {
            let a = agent.clone();
            *lock(&agent.threads_alive) += 1;
            let spawned = std::thread::Builder::new()
                .name(format!("rpc-pool-{i}"))
                .spawn(move || {
                    a.clone().pool_loop();
                    a.thread_exited();
                });
            match spawned {
                Ok(h) => threads.push(h),
                Err(e) => {
                    agent.thread_exited();
                    *lock(&agent.threads) = threads;
                    agent.close();
                    return Err(spawn_err("starting a pool thread")(e));
                }
            }
        }
        let a = agent.clone();
        *lock(&agent.threads_alive) += 1;
        match std::thread::Builder::new()
            .name("rpc-control".into())
            .spawn(move || {
                a.clone().control_loop(ctl_rx);
                a.thread_exited();
            }) {
            Ok(h) => threads.push(h),
            Err(e) => {
                agent.thread_exited();
                *lock(&agent.threads) = threads;
                agent.close();
                return Err(spawn_err("starting the control thread")(e));
            }
        }
        *lock(&agent.threads) = threads;
        let mut readers = Vec::new();
        for (r, read) in read_halves {
            let a = agent.clone();
            match std::thread::Builder::new()
                .name(format!("rpc-reader-{r}"))
                .spawn(move || a.reader_loop(r, read))
            {
                Ok(h) => readers.push(h),
                Err(e) => {
                    *lock(&agent.readers) = readers;
                    agent.close();
                    return Err(spawn_err("starting a reader thread")(e));
                }
            }
        }
        *lock(&agent.readers) = readers;
        {
            let mut live = lock(&LIVE);
            live.retain(|w| w.strong_count() > 0);
            live.push(Arc::downgrade(&agent));
        }
        at_exit(ExitStage::Groups, shutdown_all_at_exit);
        tracing::debug!(worker = %label, world_size, "rpc agent up");
        Ok(agent)
    }

    // ---- small accessors -----------------------------------------------------------------

    pub(crate) fn rank(&self) -> usize {
        self.me
    }

    pub(crate) fn label(&self) -> &str {
        &self.label
    }

    pub(crate) fn workers(&self) -> &[WorkerInfo] {
        &self.workers
    }

    pub(crate) fn worker(&self, rank: usize) -> WorkerInfo {
        self.workers.get(rank).cloned().unwrap_or(WorkerInfo {
            name: format!("rank{rank}"),
            id: rank,
        })
    }

    pub(crate) fn default_timeout(&self) -> Duration {
        self.opts.rpc_timeout
    }

    pub(crate) fn handlers(&self) -> &Handlers {
        &self.handlers
    }

    pub(crate) fn stats(&self) -> RpcStats {
        RpcStats {
            pool_threads: self.opts.num_worker_threads,
            peak_running: self.peak_running.load(Ordering::Relaxed),
            peak_queued: self.peak_queued.load(Ordering::Relaxed),
            calls_served: self.served.load(Ordering::Relaxed),
            owned_rrefs: self.owners.len(),
            rrefs_deleted: self.owners.deleted(),
        }
    }

    fn thread_exited(&self) {
        let mut n = lock(&self.threads_alive);
        *n = n.saturating_sub(1);
        self.threads_cv.notify_all();
    }

    fn new_id(&self) -> GlobalId {
        GlobalId {
            worker: self.me,
            local: self.next_id.fetch_add(1, Ordering::Relaxed),
        }
    }

    fn busy_add(&self, n: usize) {
        *lock(&self.busy) += n;
    }

    fn busy_done(&self) {
        let mut b = lock(&self.busy);
        *b = b.saturating_sub(1);
        if *b == 0 {
            self.idle.notify_all();
        }
    }

    pub(crate) fn rref_error(&self, t: ForkToken, what: impl Into<String>) -> Error {
        Error::RRef {
            worker: self.label.clone(),
            rref: t.rref.to_string(),
            owner: self.worker(t.owner).to_string(),
            what: what.into(),
        }
    }

    fn closed_err(&self, op: &str) -> Error {
        Error::ShutDown {
            worker: self.label.clone(),
            op: op.to_owned(),
        }
    }
}
