//! `dist-rpc`: remote procedure calls and remote references between the processes of a job,
//! after `torch.distributed.rpc`.
//!
//! Every process calls [`init_rpc`] with a unique name; from then on any worker can call a
//! function registered by name on any other, synchronously ([`Rpc::rpc_sync`]), asynchronously
//! ([`Rpc::rpc_async`], an [`RpcFuture`]) or keeping the result where it was made
//! ([`Rpc::remote`], an [`RRef`]). [`Rpc::shutdown`] waits until every worker is done.
//!
//! ```no_run
//! use dist_rpc::{Handlers, RpcOptions, init_rpc};
//!
//! let handlers = Handlers::new();
//! handlers.register("add", |(a, b): (i64, i64)| Ok(a + b));
//! // Under `distrun --nproc-per-node 2`: rank and world size come from the environment.
//! let rank: usize = std::env::var("RANK")?.parse()?;
//! let rpc = init_rpc(&format!("worker{rank}"), None, None, RpcOptions::new().handlers(handlers))?;
//! if rank == 0 {
//!     let sum: i64 = rpc.rpc_sync("worker1", "add", &(2, 3))?;
//!     assert_eq!(sum, 5);
//! }
//! rpc.shutdown()?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! # Functions by name
//!
//! Rust cannot ship closures, so each worker registers its handlers under names
//! ([`Handlers::register`]: `Fn(A) -> Result<R, String>` with `A`, `R` serde types). A call
//! carries the name and the arguments encoded as JSON; the result comes back the same way. A
//! raw-bytes path ([`Handlers::register_bytes`], [`Rpc::rpc_sync_bytes`]) carries large
//! tensors without a serde pass: the caller's slice is written to the socket as is after a
//! 32-byte header, and read on the callee into one `Vec<u8>` handed to the handler.
//!
//! # Transport
//!
//! Each worker binds a listener on port 0 and publishes the bound address in the job's store
//! (the same `env://` store as process groups, under the prefix `rpc/<n>/` for the n-th init);
//! then every worker
//! dials each lower rank, so every pair shares one TCP connection, used in both directions. On
//! it travel frames of the protocol in `frame.rs`: a fixed header (magic, version, kind, call
//! id, three section lengths) and the sections (JSON meta, JSON body, raw blob). Decoding
//! checks every length before allocating and never panics. Each connection has one reader
//! thread, which never writes; a fixed pool of `num_worker_threads` threads (16 by default,
//! as in torch) runs the handlers, so a burst of calls queues instead of spawning threads.
//!
//! A job that also makes a process group under plain `env://` (rank 0 serving the store)
//! must share one store between the two: make it with `dist_backend::init::init_from_url`
//! and pass it to both (`InitOptions::store`, [`RpcOptions::store`]). Under `distrun` or
//! torchrun the launcher serves the store and each init may connect on its own.
//!
//! Handlers run on the fixed pool. A handler that makes a blocking call of its own holds its
//! pool thread meanwhile, so a cycle of such calls larger than the pools can wait until the
//! calls time out (as in torch); prefer `rpc_async` chains for deep call graphs.
//!
//! # Failures
//!
//! An error returned by a remote handler, or a panic inside it, comes back as
//! [`Error::Remote`] with the message and the worker's name. A call whose reply does not come
//! within its timeout (60 s by default, as in torch) fails with [`Error::Timeout`]. When a
//! connection breaks without a goodbye (the peer crashed or was killed), every call pending on
//! it fails at once with [`Error::PeerLost`]; a peer that shut down says goodbye first, and
//! calls to it then fail at once with [`Error::PeerShutDown`].
//!
//! # RRef protocol
//!
//! An [`RRef`] is a reference to a value kept by its **owner**, the worker that ran the
//! `remote` call. Every reference held anywhere is a **fork**, with an id unique in the job
//! (the id of the worker that made it and a counter); the owner keeps the set of forks it
//! knows to be alive, and deletes the value exactly once, when the `remote` call that makes it
//! has arrived and that set is empty. The protocol rests on one property of the transport:
//! **messages from one worker to another are handled in the order they were sent**, because
//! each pair shares one connection and the reader thread does the RRef bookkeeping itself, in
//! arrival order (torch cannot assume this, which is why it needs fork requests and child
//! confirmations).
//!
//! 1. **Create.** `remote` makes the RRef id and the caller's fork id and sends both with the
//!    call; the owner registers the fork when the frame is read, before the handler runs.
//! 2. **Fork.** When a holder `U` serialises an RRef into a call or reply for `V`, it makes a
//!    new fork id and registers it with the owner *before* the message leaves: directly when
//!    `U` is the owner, else with a `ForkNotify` frame on `U`'s connection to the owner. The
//!    fork ids travel in the frame's meta too, so the receiver adopts every fork even when its
//!    handler never decodes the argument (an unknown function, say) and releases the ones no
//!    `RRef` claimed.
//! 3. **Delete.** Dropping the last clone of an `RRef` sends `ForkDelete` to the owner (through
//!    the control thread, so `Drop` never waits on a socket); on the owner it only edits the
//!    set.
//! 4. **Races.** `V`'s deletion of its fork travels on `V`'s connection and may overtake `U`'s
//!    notice of it: the owner then keeps a tombstone, and the notice cancels it. The owner
//!    never sees an empty set while some fork is alive: an alive fork that the owner does not
//!    know yet was announced by a parent fork, whose own deletion comes after that notice on
//!    the same connection, and so on up to the creator's fork, registered by the creation
//!    itself. A fetch or notice that overtakes the creation makes a placeholder entry, which
//!    is not deleted before the creation arrives.
//! 5. **Shutdown** waits until every worker is quiet (below), then releases every fork this
//!    worker's user code still holds (as torch deletes all user RRefs), then waits for quiet
//!    again, so those deletions are processed before the connections close. Releasing only
//!    once no handler runs matters: a handler may be passing on the RRef it received. Forks held by a worker that crashed are never
//!    released (torch leaves crashes out of scope too).
//!
//! `to_here` sends a `Fetch` to the owner, answered once the value exists (the owner parks
//! fetches that arrive before the value is made). A fetch of an id the owner's table lacks
//! from the RRef's creator (whose `remote` went first on that connection), or of a value the
//! owner made for itself, finds it deleted and fails at once; from any other worker it may
//! have overtaken the creation, and parks on a placeholder. `local_value` on the owner returns the
//! value itself (`Arc<T>`).
//!
//! # Shutdown
//!
//! [`Rpc::shutdown`] is torch's graceful shutdown. Quiet is detected through the store: every
//! worker repeats a round: wait until it has nothing in flight (calls awaiting replies, queued or running
//! handlers, queued RRef messages), then publish how many requests it has sent and processed.
//! When the sums over all workers are equal and unchanged since the previous round, no
//! worker has work left and none is on the way. After the second quiet (the RRef release
//! above between the two), each worker says goodbye on every connection,
//! stops its threads, and records leaving in the store (the worker that serves the store
//! waits until all have left). A peer lost meanwhile fails the shutdown at once.
//! [`Rpc::shutdown_now`] does only the local part (torch's `graceful=False`).

#![forbid(unsafe_code)]

mod agent;
mod error;
mod frame;
mod future;
mod handler;
mod rref;

use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use serde::Serialize;
use serde::de::DeserializeOwned;

pub use error::{Error, Result};
pub use frame::{FrameError, GlobalId};
pub use future::RpcFuture;
pub use handler::Handlers;
pub use rref::RRef;

use agent::Agent;

/// torch's default RPC timeout (`kDefaultRpcTimeoutSeconds`).
pub const DEFAULT_RPC_TIMEOUT: Duration = Duration::from_secs(60);
/// torch's default handler pool size (`kDefaultNumWorkerThreads`).
pub const DEFAULT_NUM_WORKER_THREADS: usize = 16;

/// A worker: its unique name and its rank (`id`, as torch's `WorkerInfo` calls it).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct WorkerInfo {
    /// The name given to `init_rpc`.
    pub name: String,
    /// The rank.
    pub id: usize,
}

impl std::fmt::Display for WorkerInfo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} (rank {})", self.name, self.id)
    }
}

/// Options of [`init_rpc`] (torch's `TensorPipeRpcBackendOptions`), built with chained setters.
#[derive(Clone)]
pub struct RpcOptions {
    pub(crate) num_worker_threads: usize,
    pub(crate) rpc_timeout: Duration,
    pub(crate) init_method: String,
    pub(crate) store: Option<Arc<dyn dist_backend::Store>>,
    pub(crate) listen_ip: Option<IpAddr>,
    pub(crate) init_timeout: Duration,
    pub(crate) shutdown_timeout: Duration,
    pub(crate) handlers: Handlers,
}

impl std::fmt::Debug for RpcOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RpcOptions")
            .field("num_worker_threads", &self.num_worker_threads)
            .field("rpc_timeout", &self.rpc_timeout)
            .field("init_method", &self.init_method)
            .field("store", &self.store.is_some())
            .field("listen_ip", &self.listen_ip)
            .field("init_timeout", &self.init_timeout)
            .field("shutdown_timeout", &self.shutdown_timeout)
            .field("handlers", &self.handlers)
            .finish()
    }
}

impl Default for RpcOptions {
    fn default() -> Self {
        Self::new()
    }
}

impl RpcOptions {
    /// 16 handler threads, a 60 s call timeout, `env://`, five minutes for init and for
    /// shutdown, no handlers.
    pub fn new() -> Self {
        RpcOptions {
            num_worker_threads: DEFAULT_NUM_WORKER_THREADS,
            rpc_timeout: DEFAULT_RPC_TIMEOUT,
            init_method: "env://".to_owned(),
            store: None,
            listen_ip: None,
            init_timeout: Duration::from_secs(300),
            shutdown_timeout: Duration::from_secs(300),
            handlers: Handlers::new(),
        }
    }

    /// Size of the fixed pool that runs handlers.
    pub fn num_worker_threads(mut self, n: usize) -> Self {
        self.num_worker_threads = n;
        self
    }

    /// Default timeout of calls and `to_here` (`Duration::MAX`: none).
    pub fn rpc_timeout(mut self, t: Duration) -> Self {
        self.rpc_timeout = t;
        self
    }

    /// Where rank, world size and the store come from: `env://` (default),
    /// `tcp://host:port` or `file:///path`, as for process groups.
    pub fn init_method(mut self, url: impl Into<String>) -> Self {
        self.init_method = url.into();
        self
    }

    /// A store every worker already shares (e.g. a process group's), instead of
    /// `init_method`; rank and world size must then be given to `init_rpc`.
    pub fn store(mut self, store: Arc<dyn dist_backend::Store>) -> Self {
        self.store = Some(store);
        self
    }

    /// The address to listen on (default: the local address of the route to `MASTER_ADDR`,
    /// else loopback).
    pub fn listen_ip(mut self, ip: IpAddr) -> Self {
        self.listen_ip = Some(ip);
        self
    }

    /// How long init waits for the store and the other workers.
    pub fn init_timeout(mut self, t: Duration) -> Self {
        self.init_timeout = t;
        self
    }

    /// How long a graceful shutdown waits for the other workers.
    pub fn shutdown_timeout(mut self, t: Duration) -> Self {
        self.shutdown_timeout = t;
        self
    }

    /// The functions this worker serves (register them before init: peers may call at once).
    pub fn handlers(mut self, h: Handlers) -> Self {
        self.handlers = h;
        self
    }
}

/// Counters of one worker, for tests and monitoring.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct RpcStats {
    /// Size of the handler pool (fixed).
    pub pool_threads: usize,
    /// Most handlers that ever ran at once (never above `pool_threads`).
    pub peak_running: usize,
    /// Most calls that ever waited in the queue.
    pub peak_queued: usize,
    /// Calls and `remote`s served.
    pub calls_served: u64,
    /// RRef values this worker owns now.
    pub owned_rrefs: usize,
    /// RRef values this worker has deleted because no user held them any more.
    pub rrefs_deleted: u64,
}

/// Who to call: a worker's name, its rank, or its [`WorkerInfo`].
pub trait ToWorker {
    /// The rank of the worker meant.
    fn to_rank(&self, rpc: &Rpc) -> Result<usize>;
}

impl ToWorker for &str {
    fn to_rank(&self, rpc: &Rpc) -> Result<usize> {
        rpc.agent.resolve_name(self)
    }
}

impl ToWorker for String {
    fn to_rank(&self, rpc: &Rpc) -> Result<usize> {
        rpc.agent.resolve_name(self)
    }
}

impl ToWorker for usize {
    fn to_rank(&self, rpc: &Rpc) -> Result<usize> {
        rpc.agent.resolve_rank(*self)
    }
}

impl ToWorker for &WorkerInfo {
    fn to_rank(&self, rpc: &Rpc) -> Result<usize> {
        rpc.agent.resolve_rank(self.id)
    }
}

/// This process's RPC agent (what torch keeps as a module global). Cloning shares it.
///
/// It owns the connections and threads; [`shutdown`](Self::shutdown) (or
/// [`shutdown_now`](Self::shutdown_now)) closes them, and must be called before the process
/// exits: peers see a worker that exits without it as a crash.
#[derive(Clone)]
pub struct Rpc {
    pub(crate) agent: Arc<Agent>,
}

impl std::fmt::Debug for Rpc {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Rpc")
            .field("worker", &self.agent.label())
            .finish()
    }
}

/// Starts RPC on this process as worker `name`: reads rank and world size from the launcher's
/// environment (or takes them from `rank`/`world_size`), rendezvouses through the store,
/// connects to every other worker and starts serving `options`' handlers. Every worker of the
/// job must call it.
///
/// Under a launcher that names an error file (`TORCHELASTIC_ERROR_FILE`), a panic is then
/// recorded there as the worker's root cause, as process groups do
/// ([`dist_backend::error_file::record_panics`]).
pub fn init_rpc(
    name: &str,
    rank: Option<usize>,
    world_size: Option<usize>,
    options: RpcOptions,
) -> Result<Rpc> {
    dist_backend::error_file::record_panics();
    let label = |r: Option<usize>| match r {
        Some(r) => format!("{name} (rank {r})"),
        None => name.to_owned(),
    };
    // One deadline for the whole init: making the store (its host may answer late) comes out
    // of the same budget as the agents' rendezvous, rather than before a fresh one.
    let deadline = dist_backend::deadline_after(std::time::Instant::now(), options.init_timeout);
    let (rank, world_size, store) = match &options.store {
        Some(store) => match (rank, world_size) {
            (Some(r), Some(w)) if r < w => (r, w, store.clone()),
            _ => {
                return Err(Error::InvalidArgument {
                    worker: label(rank),
                    op: "init_rpc",
                    what: format!(
                        "with an explicit store, rank and world size are required and rank < \
                         world size (got {rank:?}, {world_size:?})"
                    ),
                });
            }
        },
        None => {
            let info = dist_backend::init::init_from_url_by(
                &options.init_method,
                rank,
                world_size,
                options.init_timeout,
                deadline,
            )
            .map_err(|source| Error::Init {
                worker: label(rank),
                source,
            })?;
            (info.rank, info.world_size, info.store)
        }
    };
    let agent = Agent::init(name, rank, world_size, store, options, deadline)?;
    Ok(Rpc { agent })
}

impl Rpc {
    /// This worker.
    pub fn worker_info(&self) -> WorkerInfo {
        self.agent.worker(self.agent.rank())
    }

    /// A worker by name (`get_worker_info(name)`).
    pub fn get_worker_info(&self, name: &str) -> Result<WorkerInfo> {
        let r = self.agent.resolve_name(name)?;
        Ok(self.agent.worker(r))
    }

    /// Every worker, in rank order.
    pub fn workers(&self) -> Vec<WorkerInfo> {
        self.agent.workers().to_vec()
    }

    /// Registers a handler after init (see [`Handlers::register`]).
    pub fn register<A, R, F>(&self, name: &str, f: F)
    where
        A: DeserializeOwned + 'static,
        R: Serialize + Send + Sync + 'static,
        F: Fn(A) -> std::result::Result<R, String> + Send + Sync + 'static,
    {
        self.agent.handlers().register(name, f);
    }

    /// The handler table this worker serves (shared: a handler added here is seen by calls
    /// that arrive later).
    pub fn handlers(&self) -> &Handlers {
        self.agent.handlers()
    }

    /// Calls `func` on `to` and waits for its result, within the default timeout.
    pub fn rpc_sync<A: Serialize, R: DeserializeOwned>(
        &self,
        to: impl ToWorker,
        func: &str,
        args: &A,
    ) -> Result<R> {
        self.rpc_async(to, func, args)?.wait()
    }

    /// Calls `func` on `to`; the future's [`wait`](RpcFuture::wait) returns the result.
    pub fn rpc_async<A: Serialize, R: DeserializeOwned>(
        &self,
        to: impl ToWorker,
        func: &str,
        args: &A,
    ) -> Result<RpcFuture<R>> {
        self.rpc_async_timeout(to, func, args, self.agent.default_timeout())
    }

    /// [`rpc_async`](Self::rpc_async) with this call's own timeout (`Duration::MAX`: none).
    pub fn rpc_async_timeout<A: Serialize, R: DeserializeOwned>(
        &self,
        to: impl ToWorker,
        func: &str,
        args: &A,
        timeout: Duration,
    ) -> Result<RpcFuture<R>> {
        let to = to.to_rank(self)?;
        self.agent.call_async(to, func, args, timeout)
    }

    /// Calls a raw-bytes handler ([`Handlers::register_bytes`]) with `bytes`, written to the
    /// socket straight from this slice, and waits for the bytes it returns.
    pub fn rpc_sync_bytes(&self, to: impl ToWorker, func: &str, bytes: &[u8]) -> Result<Vec<u8>> {
        self.rpc_async_bytes(to, func, bytes, self.agent.default_timeout())?
            .wait()
    }

    /// The asynchronous [`rpc_sync_bytes`](Self::rpc_sync_bytes); `bytes` is sent before this
    /// returns, so it need not outlive the call.
    pub fn rpc_async_bytes(
        &self,
        to: impl ToWorker,
        func: &str,
        bytes: &[u8],
        timeout: Duration,
    ) -> Result<RpcFuture<Vec<u8>>> {
        let to = to.to_rank(self)?;
        self.agent.call_bytes_async(to, func, bytes, timeout)
    }

    /// Runs `func` on `to` and keeps its result there: the returned [`RRef`] refers to it.
    /// Returns as soon as the call is sent; a failure of the function shows in
    /// [`RRef::to_here`].
    pub fn remote<A: Serialize, T>(
        &self,
        to: impl ToWorker,
        func: &str,
        args: &A,
    ) -> Result<RRef<T>> {
        let to = to.to_rank(self)?;
        self.agent.remote(to, func, args)
    }

    /// Graceful shutdown (torch's default): releases this worker's RRefs, waits until every
    /// worker has finished the calls it received and released its references, then closes
    /// the connections and stops the threads. Every worker must call it. Calls made after it
    /// fail with [`Error::ShutDown`].
    pub fn shutdown(&self) -> Result<()> {
        self.agent.shutdown(true)
    }

    /// Local shutdown (torch's `graceful=False`): says goodbye to every peer and stops at
    /// once; calls still in flight fail, and peers' calls to this worker fail at once with
    /// [`Error::PeerShutDown`].
    pub fn shutdown_now(&self) -> Result<()> {
        self.agent.shutdown(false)
    }

    /// This worker's counters.
    pub fn stats(&self) -> RpcStats {
        self.agent.stats()
    }
}
