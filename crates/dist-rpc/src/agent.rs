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

    // ---- sending -------------------------------------------------------------------------

    /// Why a frame could not be sent.
    fn peer_down(&self, to: usize, func: &str) -> Option<Error> {
        let peer = self.peers.get(to)?.as_ref()?;
        let st = lock(&peer.state).clone();
        match st {
            PeerState::Up => None,
            PeerState::ShutDown => Some(Error::PeerShutDown {
                worker: self.label.clone(),
                peer: self.worker(to).to_string(),
                func: func.to_owned(),
            }),
            PeerState::Lost(reason) => Some(Error::PeerLost {
                worker: self.label.clone(),
                peer: self.worker(to).to_string(),
                func: func.to_owned(),
                reason,
            }),
        }
    }

    /// Writes one frame to `to` (to this worker itself: handles it in place). The blob is
    /// written straight from the caller's slice, after the header, with no copy.
    #[allow(
        clippy::too_many_arguments,
        reason = "the frame's fields, passed by reference so the blob is never copied"
    )]
    fn send(
        self: &Arc<Self>,
        to: usize,
        kind: Kind,
        call_id: u64,
        meta: &[u8],
        body: &[u8],
        blob: &[u8],
        func: &str,
    ) -> Result<()> {
        let too_big = |section, len: usize| Error::InvalidArgument {
            worker: self.label.clone(),
            op: "send",
            what: format!("{func}: {section} of {len} bytes is too large for one frame"),
        };
        let h = Header {
            kind,
            call_id,
            meta_len: u32::try_from(meta.len()).map_err(|_| too_big("meta", meta.len()))?,
            body_len: u32::try_from(body.len()).map_err(|_| too_big("body", body.len()))?,
            blob_len: blob.len() as u64,
        };
        if to == self.me {
            // Calls to oneself take the same path as a peer's, minus the socket.
            self.on_frame(to, h, meta.to_vec(), body.to_vec(), blob.to_vec());
            return Ok(());
        }
        let Some(Some(peer)) = self.peers.get(to) else {
            return Err(Error::UnknownWorker {
                worker: self.label.clone(),
                name: format!("rank {to}"),
                known: self.known(),
            });
        };
        if let Some(e) = self.peer_down(to, func) {
            return Err(e);
        }
        let mut w = lock(&peer.writer);
        if w.closed {
            drop(w);
            return Err(self
                .peer_down(to, func)
                .unwrap_or_else(|| self.closed_err(func)));
        }
        let mut head = Vec::with_capacity(HEADER_LEN + meta.len() + body.len());
        head.extend_from_slice(&h.encode());
        head.extend_from_slice(meta);
        head.extend_from_slice(body);
        let res = w.stream.write_all(&head).and_then(|()| {
            if blob.is_empty() {
                Ok(())
            } else {
                w.stream.write_all(blob)
            }
        });
        if let Err(source) = res {
            // The reader will see the broken connection too; closing both halves makes sure it
            // does at once, so every call waiting on this peer fails now.
            w.closed = true;
            let _ = w.stream.shutdown(Shutdown::Both);
            drop(w);
            if let Some(e) = self.peer_down(to, func) {
                return Err(e);
            }
            return Err(Error::Io {
                worker: self.label.clone(),
                peer: self.worker(to).to_string(),
                op: "sending a frame",
                source,
            });
        }
        Ok(())
    }

    fn known(&self) -> String {
        self.workers
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join(", ")
    }

    pub(crate) fn resolve_name(&self, name: &str) -> Result<usize> {
        self.workers
            .iter()
            .position(|w| w.name == name)
            .ok_or_else(|| Error::UnknownWorker {
                worker: self.label.clone(),
                name: format!("{name:?}"),
                known: self.known(),
            })
    }

    pub(crate) fn resolve_rank(&self, rank: usize) -> Result<usize> {
        if rank < self.workers.len() {
            Ok(rank)
        } else {
            Err(Error::UnknownWorker {
                worker: self.label.clone(),
                name: format!("rank {rank}"),
                known: self.known(),
            })
        }
    }

    // ---- calls ---------------------------------------------------------------------------

    /// Sends a request that expects a reply and returns its slot.
    #[allow(
        clippy::too_many_arguments,
        reason = "one internal entry point for every request kind"
    )]
    fn request(
        self: &Arc<Self>,
        to: usize,
        kind: Kind,
        func: &str,
        meta: &[u8],
        body: &[u8],
        blob: &[u8],
        forks: &[ForkToken],
    ) -> Result<(u64, Arc<Slot>)> {
        if *lock(&self.life) == Life::Closed {
            self.release_tokens(forks);
            return Err(self.closed_err(func));
        }
        if let Some(e) = self.peer_down(to, func) {
            self.release_tokens(forks);
            return Err(e);
        }
        let call_id = self.next_call.fetch_add(1, Ordering::Relaxed);
        let slot = Arc::new(Slot::new());
        // Registered before the write, so a fast reply finds it.
        lock(&self.pending).insert(
            call_id,
            Pending {
                peer: to,
                slot: slot.clone(),
            },
        );
        self.busy_add(1);
        self.sent.fetch_add(1, Ordering::Relaxed);
        if let Err(e) = self.send(to, kind, call_id, meta, body, blob, func) {
            // Never delivered: it must not count as sent, or shutdown would wait for it.
            self.sent.fetch_sub(1, Ordering::Relaxed);
            self.forget_call(call_id);
            self.release_tokens(forks);
            return Err(e);
        }
        Ok((call_id, slot))
    }

    /// Removes a call from the table (timeout); false when its outcome already arrived.
    pub(crate) fn forget_call(&self, call_id: u64) -> bool {
        let removed = lock(&self.pending).remove(&call_id).is_some();
        if removed {
            self.busy_done();
        }
        removed
    }

    /// Encodes `args` for `to`, collecting the RRef forks inside.
    fn encode_args<A: Serialize>(
        self: &Arc<Self>,
        to: usize,
        func: &str,
        args: &A,
    ) -> Result<(Vec<u8>, Vec<ForkToken>)> {
        let (body, forks) = encoding(self, to, || serde_json::to_vec(args));
        match body {
            Ok(b) => Ok((b, forks)),
            Err(source) => {
                self.release_tokens(&forks);
                Err(Error::Codec {
                    worker: self.label.clone(),
                    peer: self.worker(to).to_string(),
                    func: func.to_owned(),
                    what: "encoding the arguments",
                    source,
                })
            }
        }
    }

    pub(crate) fn call_async<A: Serialize, R: DeserializeOwned>(
        self: &Arc<Self>,
        to: usize,
        func: &str,
        args: &A,
        timeout: Duration,
    ) -> Result<RpcFuture<R>> {
        let (body, forks) = self.encode_args(to, func, args)?;
        let meta = encode_meta(&CallMeta {
            func: func.to_owned(),
            forks: forks.clone(),
            create: None,
            raw: false,
        });
        let start = Instant::now();
        let (call_id, slot) = self.request(to, Kind::Call, func, &meta, &body, &[], &forks)?;
        Ok(self.future(to, func, call_id, slot, start, timeout, decode_typed::<R>))
    }

    pub(crate) fn call_bytes_async(
        self: &Arc<Self>,
        to: usize,
        func: &str,
        bytes: &[u8],
        timeout: Duration,
    ) -> Result<RpcFuture<Vec<u8>>> {
        let meta = encode_meta(&CallMeta {
            func: func.to_owned(),
            forks: Vec::new(),
            create: None,
            raw: true,
        });
        let start = Instant::now();
        let (call_id, slot) = self.request(to, Kind::Call, func, &meta, &[], bytes, &[])?;
        Ok(self.future(to, func, call_id, slot, start, timeout, decode_bytes))
    }

    #[allow(clippy::too_many_arguments, reason = "plain constructor")]
    fn future<R>(
        self: &Arc<Self>,
        to: usize,
        func: &str,
        call_id: u64,
        slot: Arc<Slot>,
        start: Instant,
        timeout: Duration,
        decode: fn(&Arc<Agent>, usize, &str, Outcome) -> Result<R>,
    ) -> RpcFuture<R> {
        RpcFuture {
            agent: self.clone(),
            slot,
            call_id,
            peer: to,
            func: func.to_owned(),
            deadline: deadline_after(start, timeout),
            timeout,
            decode,
            _r: std::marker::PhantomData,
        }
    }

    pub(crate) fn remote<A: Serialize, T>(
        self: &Arc<Self>,
        to: usize,
        func: &str,
        args: &A,
    ) -> Result<RRef<T>> {
        if *lock(&self.life) == Life::Closed {
            return Err(self.closed_err(func));
        }
        if let Some(e) = self.peer_down(to, func) {
            return Err(e);
        }
        let (body, forks) = self.encode_args(to, func, args)?;
        let token = ForkToken {
            owner: to,
            rref: self.new_id(),
            fork: self.new_id(),
        };
        let meta = encode_meta(&CallMeta {
            func: func.to_owned(),
            forks: forks.clone(),
            create: Some(token),
            raw: false,
        });
        // Our fork exists from here: the owner learns of it with the creation itself.
        let mine = self.adopt(token);
        self.sent.fetch_add(1, Ordering::Relaxed);
        if let Err(e) = self.send(to, Kind::Remote, 0, &meta, &body, &[], func) {
            self.sent.fetch_sub(1, Ordering::Relaxed);
            // The owner never heard of it: nothing to release there.
            mine.released.store(true, Ordering::SeqCst);
            self.release_tokens(&forks);
            return Err(e);
        }
        Ok(RRef::from_fork(mine))
    }

    /// `to_here`: the value of the RRef `t`, from its owner.
    pub(crate) fn fetch<T: DeserializeOwned>(
        self: &Arc<Self>,
        t: ForkToken,
        timeout: Duration,
    ) -> Result<T> {
        let func = format!("to_here(RRef {})", t.rref);
        let start = Instant::now();
        if t.owner == self.me {
            let v = self.local_value(t, timeout)?;
            let bytes = v.encode().map_err(|source| Error::Codec {
                worker: self.label.clone(),
                peer: self.label.clone(),
                func: func.clone(),
                what: "encoding the value",
                source,
            })?;
            return serde_json::from_slice(&bytes).map_err(|source| Error::Codec {
                worker: self.label.clone(),
                peer: self.label.clone(),
                func,
                what: "decoding the value",
                source,
            });
        }
        let meta = encode_meta(&RRefMeta { token: t });
        let (call_id, slot) = self.request(t.owner, Kind::Fetch, &func, &meta, &[], &[], &[])?;
        let fut = self.future(
            t.owner,
            &func,
            call_id,
            slot,
            start,
            timeout,
            decode_typed::<T>,
        );
        fut.wait().map_err(|e| match e {
            Error::Remote { message, .. } => self.rref_error(t, message),
            other => other,
        })
    }

    /// The owner's value of `t`, waiting until it is made.
    pub(crate) fn local_value(
        &self,
        t: ForkToken,
        timeout: Duration,
    ) -> Result<Arc<dyn ErasedValue>> {
        if t.owner != self.me {
            return Err(self.rref_error(t, "local_value called on a worker that is not the owner"));
        }
        let cell = self
            .owners
            .existing(t.rref)
            .ok_or_else(|| self.rref_error(t, "the owner has deleted it"))?;
        match cell.wait(deadline_after(Instant::now(), timeout)) {
            Some(Ok(v)) => Ok(v),
            Some(Err((kind, msg))) => {
                Err(self.rref_error(t, format!("{}: {msg}", fail_kind_what(kind))))
            }
            None => Err(self.rref_error(
                t,
                format!("the function making the value did not finish within {timeout:?}"),
            )),
        }
    }

    // ---- RRef forks ----------------------------------------------------------------------

    /// Makes a counted fork for a token that arrived (or that this worker created).
    fn adopt(self: &Arc<Self>, token: ForkToken) -> Arc<ForkShared> {
        let f = Arc::new(ForkShared {
            agent: self.clone(),
            token,
            released: AtomicBool::new(false),
        });
        lock(&self.live_forks).insert(token.fork, Arc::downgrade(&f));
        f
    }

    /// A new fork of `t` that will travel to `dest`: registered with the owner before it
    /// leaves (directly when this worker is the owner, else by a notice on the connection to
    /// the owner, ahead of anything this worker sends the owner later, in particular ahead of
    /// the deletion of `t` itself).
    pub(crate) fn fork_for(self: &Arc<Self>, t: ForkToken, _dest: usize) -> Result<ForkToken> {
        let child = ForkToken {
            fork: self.new_id(),
            ..t
        };
        if t.owner == self.me {
            if let Some(d) = self.owners.add_fork(child) {
                self.after_delete(t.rref, d);
            }
        } else {
            let meta = encode_meta(&RRefMeta { token: child });
            self.sent.fetch_add(1, Ordering::Relaxed);
            if let Err(e) = self.send(
                t.owner,
                Kind::ForkNotify,
                0,
                &meta,
                &[],
                &[],
                "RRef fork notice",
            ) {
                self.sent.fetch_sub(1, Ordering::Relaxed);
                return Err(e);
            }
        }
        Ok(child)
    }

    /// Releases forks that were made for a frame that was never sent.
    fn release_tokens(self: &Arc<Self>, forks: &[ForkToken]) {
        for &t in forks {
            drop(self.adopt(t));
        }
    }

    /// A fork is dropped (or released at shutdown): tell the owner, once.
    pub(crate) fn release_fork(&self, t: ForkToken, released: &AtomicBool) {
        if released.swap(true, Ordering::SeqCst) {
            return;
        }
        lock(&self.live_forks).remove(&t.fork);
        if t.owner == self.me {
            if let Some(d) = self.owners.del_fork(t) {
                self.after_delete(t.rref, d);
            }
            return;
        }
        if *lock(&self.life) == Life::Closed {
            return;
        }
        self.enqueue_control(Control::Delete(t));
    }

    /// Fails the fetches that waited for a value its users released before it was made.
    fn after_delete(&self, rref: GlobalId, d: Deleted) {
        for (peer, call_id) in d.waiters {
            self.enqueue_control(Control::FetchReply {
                peer,
                call_id,
                value: Err((FailKind::RRefGone, format!("RRef {rref} was deleted"))),
            });
        }
    }

    fn enqueue_control(&self, c: Control) {
        let tx = lock(&self.control).clone();
        if let Some(tx) = tx {
            self.busy_add(1);
            if tx.send(c).is_err() {
                self.busy_done();
            }
        }
    }

    // ---- receiving -----------------------------------------------------------------------

    fn reader_loop(self: Arc<Self>, peer: usize, stream: TcpStream) {
        let mut r = BufReader::with_capacity(64 << 10, stream);
        let mut said_goodbye = false;
        let reason = loop {
            let mut hb = [0u8; HEADER_LEN];
            if let Err(e) = r.read_exact(&mut hb) {
                break if e.kind() == std::io::ErrorKind::UnexpectedEof {
                    "connection closed without a goodbye".to_owned()
                } else {
                    e.to_string()
                };
            }
            let h = match Header::decode(&hb, &self.limits) {
                Ok(h) => h,
                Err(e) => break self.protocol_error(peer, e),
            };
            // Into reserved capacity through `take`: the kernel fills the buffer directly,
            // with no zeroing pass first (what a 1 MiB argument would otherwise pay).
            let read = |r: &mut BufReader<TcpStream>, n: u64| -> std::io::Result<Vec<u8>> {
                // Capacity up front only up to 64 MiB: a header may lie about its length, and
                // bytes that really arrive grow the buffer as they come.
                let mut v = Vec::with_capacity(n.min(64 << 20) as usize);
                r.by_ref().take(n).read_to_end(&mut v)?;
                if v.len() as u64 != n {
                    return Err(std::io::ErrorKind::UnexpectedEof.into());
                }
                Ok(v)
            };
            let frame = read(&mut r, h.meta_len.into()).and_then(|m| {
                let b = read(&mut r, h.body_len.into())?;
                let x = read(&mut r, h.blob_len)?;
                Ok((m, b, x))
            });
            let (meta, body, blob) = match frame {
                Ok(f) => f,
                Err(e) => break format!("connection broke inside a frame: {e}"),
            };
            if h.kind == Kind::Goodbye {
                said_goodbye = true;
                self.peer_said_goodbye(peer);
                continue;
            }
            if said_goodbye {
                continue;
            }
            if let Err(e) = self.on_frame_checked(peer, h, meta, body, blob) {
                break self.protocol_error(peer, e);
            }
        };
        if !said_goodbye {
            self.peer_lost(peer, reason);
        }
        let mut left = lock(&self.readers_left);
        *left = left.saturating_sub(1);
        self.readers_cv.notify_all();
    }

    fn protocol_error(&self, peer: usize, e: FrameError) -> String {
        let err = Error::Protocol {
            worker: self.label.clone(),
            peer: self.worker(peer).to_string(),
            source: e,
        };
        tracing::error!(error = %err, "closing the connection");
        err.to_string()
    }

    /// A frame from a peer (or from this worker to itself); never blocks.
    fn on_frame(
        self: &Arc<Self>,
        peer: usize,
        h: Header,
        meta: Vec<u8>,
        body: Vec<u8>,
        blob: Vec<u8>,
    ) {
        if let Err(e) = self.on_frame_checked(peer, h, meta, body, blob) {
            let _ = self.protocol_error(peer, e);
        }
    }

    fn on_frame_checked(
        self: &Arc<Self>,
        peer: usize,
        h: Header,
        meta: Vec<u8>,
        body: Vec<u8>,
        blob: Vec<u8>,
    ) -> std::result::Result<(), FrameError> {
        match h.kind {
            Kind::Call => {
                let m: CallMeta = decode_meta(h.kind, &meta)?;
                let forks = m.forks.iter().map(|&t| self.adopt(t)).collect();
                let raw = m.raw;
                self.enqueue_job(Job::Call {
                    peer,
                    call_id: h.call_id,
                    meta: m,
                    input: Input { body, blob, raw },
                    forks,
                });
            }
            Kind::Remote => {
                let m: CallMeta = decode_meta(h.kind, &meta)?;
                let Some(t) = m.create else {
                    return Err(FrameError::Unexpected {
                        kind: "Remote".into(),
                        why: "no RRef to create".into(),
                    });
                };
                if t.owner != self.me {
                    return Err(FrameError::Unexpected {
                        kind: "Remote".into(),
                        why: format!(
                            "RRef {} is owned by rank {}, not this worker",
                            t.rref, t.owner
                        ),
                    });
                }
                // The creator's fork is registered here, in arrival order, before anything
                // the creator sends later on this connection (its deletion, say) is read.
                let (cell, deleted) = self.owners.create(t);
                if let Some(d) = deleted {
                    self.after_delete(t.rref, d);
                }
                let forks = m.forks.iter().map(|&t| self.adopt(t)).collect();
                let raw = m.raw;
                self.enqueue_job(Job::Create {
                    meta: m,
                    input: Input { body, blob, raw },
                    forks,
                    cell,
                });
            }
            Kind::Reply => {
                let m: ReplyMeta = decode_meta(h.kind, &meta)?;
                let forks = m.forks.iter().map(|&t| self.adopt(t)).collect();
                self.complete(h.call_id, Outcome::Reply { body, blob, forks });
            }
            Kind::Fail => {
                let m: FailMeta = decode_meta(h.kind, &meta)?;
                self.complete(h.call_id, Outcome::Fail(m.kind, m.message));
            }
            Kind::Fetch => {
                let m: RRefMeta = decode_meta(h.kind, &meta)?;
                let cell = self.owners.cell(m.token.rref);
                let mut st = lock(&cell.state);
                match &mut *st {
                    CellState::Pending(waiters) => waiters.push((peer, h.call_id)),
                    CellState::Ready(v) => {
                        let value = v.clone();
                        drop(st);
                        self.enqueue_control(Control::FetchReply {
                            peer,
                            call_id: h.call_id,
                            value,
                        });
                    }
                    CellState::Gone => {
                        drop(st);
                        self.enqueue_control(Control::FetchReply {
                            peer,
                            call_id: h.call_id,
                            value: Err((
                                FailKind::RRefGone,
                                format!("RRef {} was deleted", m.token.rref),
                            )),
                        });
                    }
                }
            }
            Kind::ForkNotify => {
                let m: RRefMeta = decode_meta(h.kind, &meta)?;
                if let Some(d) = self.owners.add_fork(m.token) {
                    self.after_delete(m.token.rref, d);
                }
                self.processed.fetch_add(1, Ordering::Relaxed);
            }
            Kind::ForkDelete => {
                let m: RRefMeta = decode_meta(h.kind, &meta)?;
                if let Some(d) = self.owners.del_fork(m.token) {
                    self.after_delete(m.token.rref, d);
                }
                self.processed.fetch_add(1, Ordering::Relaxed);
            }
            Kind::Hello | Kind::Goodbye => {
                return Err(FrameError::Unexpected {
                    kind: format!("{:?}", h.kind),
                    why: "only the first frame of a connection may be a Hello".into(),
                });
            }
        }
        Ok(())
    }

    fn complete(&self, call_id: u64, o: Outcome) {
        let p = lock(&self.pending).remove(&call_id);
        match p {
            Some(p) => {
                p.slot.complete(o);
                self.busy_done();
            }
            // A call that timed out: its reply (and any forks in it, dropped here) is late.
            None => {
                tracing::debug!(worker = %self.label, call_id, "reply to a call no one waits for")
            }
        }
    }

    fn fail_pending_to(&self, peer: Option<usize>, o: impl Fn() -> Outcome) {
        let failed: Vec<Pending> = {
            let mut p = lock(&self.pending);
            let ids: Vec<u64> = p
                .iter()
                .filter(|(_, c)| peer.is_none_or(|x| c.peer == x))
                .map(|(&id, _)| id)
                .collect();
            ids.into_iter().filter_map(|id| p.remove(&id)).collect()
        };
        for c in failed {
            c.slot.complete(o());
            self.busy_done();
        }
    }

    fn peer_said_goodbye(&self, peer: usize) {
        let Some(Some(p)) = self.peers.get(peer) else {
            return;
        };
        {
            let mut st = lock(&p.state);
            if *st == PeerState::Up {
                *st = PeerState::ShutDown;
            }
        }
        tracing::debug!(worker = %self.label, peer = %self.worker(peer), "peer said goodbye");
        self.fail_pending_to(Some(peer), || Outcome::PeerShutDown);
        // Our half of the close: the peer's reader then sees our end and finishes.
        let mut w = lock(&p.writer);
        if !w.closed {
            let _ = w.stream.write_all(
                &Header {
                    kind: Kind::Goodbye,
                    call_id: 0,
                    meta_len: 0,
                    body_len: 0,
                    blob_len: 0,
                }
                .encode(),
            );
            w.closed = true;
            let _ = w.stream.shutdown(Shutdown::Write);
        }
    }

    fn peer_lost(&self, peer: usize, reason: String) {
        let Some(Some(p)) = self.peers.get(peer) else {
            return;
        };
        {
            let mut st = lock(&p.state);
            if *st != PeerState::Up {
                return;
            }
            *st = PeerState::Lost(reason.clone());
        }
        self.lost_any.store(true, Ordering::SeqCst);
        {
            let mut w = lock(&p.writer);
            w.closed = true;
            let _ = w.stream.shutdown(Shutdown::Both);
        }
        tracing::warn!(worker = %self.label, peer = %self.worker(peer), %reason, "peer lost");
        self.fail_pending_to(Some(peer), || Outcome::Lost(reason.clone()));
    }

    // ---- the pool ------------------------------------------------------------------------

    fn enqueue_job(&self, job: Job) {
        self.busy_add(1);
        let mut q = lock(&self.pool);
        q.jobs.push_back(job);
        self.peak_queued.fetch_max(q.jobs.len(), Ordering::Relaxed);
        drop(q);
        self.pool_cv.notify_one();
    }

    fn pool_loop(self: Arc<Self>) {
        IN_POOL.with(|p| p.set(true));
        loop {
            let job = {
                let mut q = lock(&self.pool);
                loop {
                    if q.stop {
                        return;
                    }
                    if let Some(j) = q.jobs.pop_front() {
                        break j;
                    }
                    q = self.pool_cv.wait(q).unwrap_or_else(|e| e.into_inner());
                }
            };
            let now = self.running.fetch_add(1, Ordering::SeqCst) + 1;
            self.peak_running.fetch_max(now, Ordering::Relaxed);
            self.run_job(job);
            self.running.fetch_sub(1, Ordering::SeqCst);
            self.served.fetch_add(1, Ordering::Relaxed);
            self.processed.fetch_add(1, Ordering::Relaxed);
            self.busy_done();
        }
    }

    /// Runs a handler, catching its panic.
    fn invoke(
        self: &Arc<Self>,
        func: &str,
        input: Input,
        forks: Vec<Arc<ForkShared>>,
    ) -> std::result::Result<Output, (FailKind, String)> {
        let Some(h) = self.handlers.get(func) else {
            return Err((
                FailKind::UnknownFunction,
                format!("{} has no function named {func:?}", self.label),
            ));
        };
        let rpc = Rpc {
            agent: self.clone(),
        };
        let res = decoding(forks, || catch_unwind(AssertUnwindSafe(|| h(&rpc, input))));
        match res {
            Ok(Ok(out)) => Ok(out),
            Ok(Err(Failure::User(m))) => Err((FailKind::Handler, m)),
            Ok(Err(Failure::BadArguments(m))) => Err((FailKind::BadArguments, m)),
            Err(payload) => {
                let msg = payload
                    .downcast_ref::<&str>()
                    .map(|s| (*s).to_owned())
                    .or_else(|| payload.downcast_ref::<String>().cloned())
                    .unwrap_or_else(|| "a non-string panic payload".to_owned());
                Err((FailKind::Panic, msg))
            }
        }
    }

    fn run_job(self: &Arc<Self>, job: Job) {
        match job {
            Job::Call {
                peer,
                call_id,
                meta,
                input,
                forks,
            } => {
                let func = meta.func;
                let out = self.invoke(&func, input, forks);
                self.reply(peer, call_id, &func, out);
            }
            Job::Create {
                meta,
                input,
                forks,
                cell,
            } => {
                let out = self.invoke(&meta.func, input, forks).map(|o| match o {
                    Output::Value(v) => v,
                    Output::Bytes(b) => Arc::new(b) as Arc<dyn ErasedValue>,
                });
                let waiters = {
                    let mut st = lock(&cell.state);
                    match std::mem::replace(&mut *st, CellState::Gone) {
                        CellState::Pending(w) => {
                            *st = CellState::Ready(out.clone());
                            w
                        }
                        // Every user released it while it was being made: drop the value.
                        _ => Vec::new(),
                    }
                };
                cell.ready.notify_all();
                for (peer, call_id) in waiters {
                    self.enqueue_control(Control::FetchReply {
                        peer,
                        call_id,
                        value: out.clone(),
                    });
                }
            }
        }
    }

    /// Encodes and sends a handler's outcome to the caller.
    fn reply(
        self: &Arc<Self>,
        peer: usize,
        call_id: u64,
        func: &str,
        out: std::result::Result<Output, (FailKind, String)>,
    ) {
        let sent = match out {
            Ok(Output::Bytes(b)) => {
                let meta = encode_meta(&ReplyMeta::default());
                self.send(peer, Kind::Reply, call_id, &meta, &[], &b, func)
            }
            Ok(Output::Value(v)) => {
                let (body, forks) = encoding(self, peer, || v.encode());
                match body {
                    Ok(body) => {
                        let meta = encode_meta(&ReplyMeta {
                            forks: forks.clone(),
                        });
                        let r = self.send(peer, Kind::Reply, call_id, &meta, &body, &[], func);
                        if r.is_err() {
                            self.release_tokens(&forks);
                        }
                        r
                    }
                    Err(e) => {
                        self.release_tokens(&forks);
                        self.send_fail(peer, call_id, func, FailKind::BadResult, e.to_string())
                    }
                }
            }
            Err((kind, msg)) => self.send_fail(peer, call_id, func, kind, msg),
        };
        if let Err(e) = sent {
            tracing::debug!(worker = %self.label, error = %e, "could not send a reply");
        }
    }

    fn send_fail(
        self: &Arc<Self>,
        peer: usize,
        call_id: u64,
        func: &str,
        kind: FailKind,
        message: String,
    ) -> Result<()> {
        let meta = encode_meta(&FailMeta { kind, message });
        self.send(peer, Kind::Fail, call_id, &meta, &[], &[], func)
    }

    fn control_loop(self: Arc<Self>, rx: mpsc::Receiver<Control>) {
        while let Ok(c) = rx.recv() {
            match c {
                Control::Stop => {
                    self.busy_done();
                    return;
                }
                Control::Delete(t) => {
                    let meta = encode_meta(&RRefMeta { token: t });
                    self.sent.fetch_add(1, Ordering::Relaxed);
                    if let Err(e) = self.send(
                        t.owner,
                        Kind::ForkDelete,
                        0,
                        &meta,
                        &[],
                        &[],
                        "RRef deletion",
                    ) {
                        self.sent.fetch_sub(1, Ordering::Relaxed);
                        tracing::debug!(worker = %self.label, error = %e, "could not tell the owner of a released RRef");
                    }
                }
                Control::FetchReply {
                    peer,
                    call_id,
                    value,
                } => {
                    let out = value.map(Output::Value);
                    self.reply(peer, call_id, "to_here", out);
                    self.processed.fetch_add(1, Ordering::Relaxed);
                }
            }
            self.busy_done();
        }
    }

    // ---- shutdown ------------------------------------------------------------------------

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
        self.close();
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

    /// Says goodbye to every peer, stops every thread and closes every socket.
    fn close(&self) {
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
        let deadline = deadline_after(
            Instant::now(),
            self.opts.rpc_timeout.min(Duration::from_secs(30)),
        );
        {
            let mut left = lock(&self.readers_left);
            while *left > 0 {
                let now = Instant::now();
                if now >= deadline {
                    for p in self.peers.iter().flatten() {
                        let _ = lock(&p.writer).stream.shutdown(Shutdown::Both);
                    }
                    break;
                }
                left = self
                    .readers_cv
                    .wait_timeout(left, deadline - now)
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
        let deadline = deadline_after(Instant::now(), self.opts.shutdown_timeout);
        let all_exited = {
            let mut n = lock(&self.threads_alive);
            while *n > 0 && Instant::now() < deadline {
                n = self
                    .threads_cv
                    .wait_timeout(n, deadline.saturating_duration_since(Instant::now()))
                    .unwrap_or_else(|e| e.into_inner())
                    .0;
            }
            *n == 0
        };
        let handles = std::mem::take(&mut *lock(&self.threads));
        if all_exited {
            for h in handles {
                if h.thread().id() != me {
                    let _ = h.join();
                }
            }
        } else {
            tracing::warn!(worker = %self.label, "a handler did not return before the shutdown timeout; its thread is left running");
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

fn decode_typed<R: DeserializeOwned>(
    agent: &Arc<Agent>,
    peer: usize,
    func: &str,
    o: Outcome,
) -> Result<R> {
    match o {
        Outcome::Reply { body, forks, .. } => decoding(forks, || serde_json::from_slice(&body))
            .map_err(|source| Error::Codec {
                worker: agent.label().to_owned(),
                peer: agent.worker(peer).to_string(),
                func: func.to_owned(),
                what: "decoding the result",
                source,
            }),
        other => Err(outcome_error(agent, peer, func, other)),
    }
}

fn decode_bytes(agent: &Arc<Agent>, peer: usize, func: &str, o: Outcome) -> Result<Vec<u8>> {
    match o {
        Outcome::Reply { blob, .. } => Ok(blob),
        other => Err(outcome_error(agent, peer, func, other)),
    }
}

fn outcome_error(agent: &Agent, peer: usize, func: &str, o: Outcome) -> Error {
    let worker = agent.label().to_owned();
    let peer_name = agent.worker(peer).to_string();
    let func = func.to_owned();
    match o {
        Outcome::Reply { .. } => Error::InvalidArgument {
            worker,
            op: "decode",
            what: "a reply is not an error".into(),
        },
        Outcome::Fail(kind, message) => match kind {
            FailKind::Handler | FailKind::Panic | FailKind::RRefGone | FailKind::ShuttingDown => {
                Error::Remote {
                    worker,
                    peer: peer_name,
                    func,
                    message,
                    panicked: kind == FailKind::Panic,
                }
            }
            FailKind::UnknownFunction => Error::UnknownFunction {
                worker,
                peer: peer_name,
                func,
            },
            FailKind::BadArguments => Error::BadArguments {
                worker,
                peer: peer_name,
                func,
                reason: message,
            },
            FailKind::BadResult => Error::BadResult {
                worker,
                peer: peer_name,
                func,
                reason: message,
            },
        },
        Outcome::Lost(reason) => Error::PeerLost {
            worker,
            peer: peer_name,
            func,
            reason,
        },
        Outcome::PeerShutDown => Error::PeerShutDown {
            worker,
            peer: peer_name,
            func,
        },
        Outcome::ShutDown => Error::ShutDown { worker, op: func },
    }
}

/// Builds the full mesh: this worker dials every lower rank and accepts every higher one,
/// each connection opened by a `Hello` naming the dialer and the job.
fn connect_mesh(
    label: &str,
    rank: usize,
    published: &[Published],
    listener: &TcpListener,
    job: &str,
    name: &str,
    deadline: Instant,
) -> Result<Vec<Option<TcpStream>>> {
    let world = published.len();
    let mut streams: Vec<Option<TcpStream>> = (0..world).map(|_| None).collect();
    let io = |peer: String, op: &'static str| {
        let label = label.to_owned();
        move |source| Error::Io {
            worker: label,
            peer,
            op,
            source,
        }
    };
    for (r, p) in published.iter().enumerate().take(rank) {
        let who = format!("{} (rank {r})", p.name);
        let ip: IpAddr = p.host.parse().map_err(|_| Error::InvalidArgument {
            worker: label.to_owned(),
            op: "init_rpc",
            what: format!("{who} published the address {:?}, not an IP", p.host),
        })?;
        let addr = SocketAddr::new(ip, p.port);
        let stream = loop {
            let left = deadline
                .saturating_duration_since(Instant::now())
                .max(Duration::from_millis(1));
            match TcpStream::connect_timeout(&addr, left) {
                Ok(s) => break s,
                Err(e) if Instant::now() >= deadline => return Err(io(who, "connecting")(e)),
                // A listener's backlog may be full for a moment while a big job starts.
                Err(_) => std::thread::sleep(Duration::from_millis(10)),
            }
        };
        stream
            .set_nodelay(true)
            .map_err(io(who.clone(), "setting TCP_NODELAY"))?;
        let meta = encode_meta(&HelloMeta {
            rank,
            name: name.to_owned(),
            job: job.to_owned(),
        });
        let h = Header {
            kind: Kind::Hello,
            call_id: 0,
            meta_len: meta.len() as u32,
            body_len: 0,
            blob_len: 0,
        };
        let mut frame = h.encode().to_vec();
        frame.extend_from_slice(&meta);
        (&stream)
            .write_all(&frame)
            .map_err(io(who, "sending hello"))?;
        streams[r] = Some(stream);
    }
    let mut missing = world - rank - 1;
    listener
        .set_nonblocking(true)
        .map_err(io("listener".into(), "setting non-blocking"))?;
    while missing > 0 {
        let (stream, from) = match listener.accept() {
            Ok(x) => x,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if Instant::now() >= deadline {
                    let waiting: Vec<usize> = (rank + 1..world)
                        .filter(|&r| streams[r].is_none())
                        .collect();
                    return Err(Error::InvalidArgument {
                        worker: label.to_owned(),
                        op: "init_rpc",
                        what: format!("ranks {waiting:?} did not connect before the init timeout"),
                    });
                }
                // Init only: a short poll keeps the listener owned by this thread alone.
                std::thread::sleep(Duration::from_millis(2));
                continue;
            }
            Err(e) => return Err(io("listener".into(), "accepting")(e)),
        };
        let peer = from.to_string();
        stream
            .set_nonblocking(false)
            .map_err(io(peer.clone(), "setting blocking"))?;
        stream
            .set_nodelay(true)
            .map_err(io(peer.clone(), "setting TCP_NODELAY"))?;
        // A stranger that connects and says nothing holds init up for a bounded time only.
        let left = deadline
            .saturating_duration_since(Instant::now())
            .clamp(Duration::from_millis(1), Duration::from_secs(30));
        stream
            .set_read_timeout(Some(left))
            .map_err(io(peer.clone(), "setting a read timeout"))?;
        let hello = read_hello(&stream, &Limits::default());
        let stranger = |why: String| {
            tracing::warn!(worker = label, %peer, %why, "refusing a connection");
        };
        match hello {
            Ok(h) if h.job != job => stranger(format!("it belongs to another job ({})", h.job)),
            Ok(h) if h.rank <= rank || h.rank >= world => {
                stranger(format!("rank {} does not dial this worker", h.rank))
            }
            Ok(h) if streams[h.rank].is_some() => {
                stranger(format!("rank {} is already connected", h.rank))
            }
            Ok(h) => {
                stream
                    .set_read_timeout(None)
                    .map_err(io(peer.clone(), "clearing the read timeout"))?;
                streams[h.rank] = Some(stream);
                missing -= 1;
            }
            Err(e) => stranger(e),
        }
    }
    Ok(streams)
}

fn read_hello(mut s: &TcpStream, limits: &Limits) -> std::result::Result<HelloMeta, String> {
    let mut hb = [0u8; HEADER_LEN];
    s.read_exact(&mut hb).map_err(|e| e.to_string())?;
    let h = Header::decode(&hb, limits).map_err(|e| e.to_string())?;
    if h.kind != Kind::Hello || h.body_len != 0 || h.blob_len != 0 || h.meta_len > 4096 {
        return Err(format!("expected a Hello frame, got {:?}", h.kind));
    }
    let mut meta = vec![0u8; h.meta_len as usize];
    s.read_exact(&mut meta).map_err(|e| e.to_string())?;
    decode_meta(Kind::Hello, &meta).map_err(|e| e.to_string())
}
