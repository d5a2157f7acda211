//! [`ProcessGroup`]: a set of ranks with its own connections, worker thread and flight recorder,
//! and the typed collectives over it.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::Sender;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use dist_backend::store::PrefixStore;
use dist_backend::{Backend, BufMut, BufRef, OpOptions, Store};
use dist_wire::{Element, ReduceOp};

use crate::backend_spec::{BackendSpec, Engine};
use crate::debug::{DebugLevel, FailureDump, FlightEntry, FlightRecorder, OpInfo, dump_json};
use crate::dispatch::Dispatch;
use crate::exec::Exec;
use crate::p2p::{self, Dir, P2pJob};
use crate::progress::{self, Progress};
use crate::work::{Completer, Work};
use crate::{Error, Result};

/// The backends this build can create (`"nccl"` with the `nccl` feature). A backend string
/// may combine them per device type, as torch's does: `"cpu:gloo,cuda:nccl"`.
pub const AVAILABLE_BACKENDS: &[&str] = &[
    #[cfg(feature = "gloo")]
    "gloo",
    #[cfg(feature = "nccl")]
    "nccl",
];

/// What every group of one job shares: backend name, timeout, the job's store.
#[derive(Clone)]
pub(crate) struct GroupConfig {
    pub(crate) backend: String,
    pub(crate) timeout: Duration,
    pub(crate) root_store: Arc<dyn Store>,
    pub(crate) debug: DebugLevel,
    /// Where a group's first failure dumps its flight recorder (`None`: a `warn` event).
    pub(crate) flight_dir: Option<PathBuf>,
}

/// What an operation needs from its group while it runs (on the caller's thread or a worker).
pub(crate) struct OpCtx {
    pub(crate) rank: usize,
    pub(crate) world_size: usize,
    pub(crate) name: String,
    pub(crate) timeout: Duration,
    pub(crate) debug: DebugLevel,
    pub(crate) recorder: FlightRecorder,
    pub(crate) progress: Arc<Progress>,
    pub(crate) dump: FailureDump,
}

pub(crate) struct GroupInner {
    pub(crate) ctx: Arc<OpCtx>,
    pub(crate) cfg: GroupConfig,
    /// Store prefix of this group (its namespace in the job's store).
    pub(crate) prefix: String,
    /// This group's namespace.
    pub(crate) store: Arc<dyn Store>,
    /// Global rank of each group rank.
    pub(crate) global_ranks: Vec<usize>,
    /// Sub-groups created from this one so far (every rank counts the same).
    pub(crate) created: AtomicU64,
    /// Monitored barriers run so far.
    pub(crate) monitored: AtomicU64,
    exec: Arc<Exec>,
    p2p: Mutex<Option<Sender<P2pJob>>>,
    watchdog: Mutex<Option<Sender<()>>>,
    threads: Mutex<Vec<JoinHandle<()>>>,
    /// Made by `init_process_group`/`new_process_group` (not a sub-group): leaving it is
    /// recorded in the job's store, whose host waits for every rank.
    world: bool,
    torn_down: AtomicBool,
}

impl GroupInner {
    /// Destroys the group (once; later calls return at once): waits for its queued operations
    /// (each bounded by the timeout), stops its threads, says goodbye to the peers on both
    /// backends and, for a world group, leaves it in the store (see [`crate::teardown`]).
    /// Operations issued afterwards fail with [`Error::Destroyed`].
    pub(crate) fn teardown(&self) {
        if self.torn_down.swap(true, Ordering::AcqRel) {
            return;
        }
        self.exec.close();
        self.p2p.lock().unwrap_or_else(|e| e.into_inner()).take();
        self.watchdog
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        let threads = std::mem::take(&mut *self.threads.lock().unwrap_or_else(|e| e.into_inner()));
        let me = std::thread::current().id();
        for t in threads {
            // A group dropped on one of its own threads cannot wait for that thread.
            if t.thread().id() != me {
                // Queued operations finish first (each bounded by its timeout).
                let _ = t.join();
            }
        }
        self.exec.backend().close();
        if self.world {
            crate::teardown::leave(self);
        }
        if self.ctx.debug >= DebugLevel::Info {
            tracing::info!(rank = self.ctx.rank, group = %self.ctx.name, "process group destroyed");
        }
    }
}

impl Drop for GroupInner {
    fn drop(&mut self) {
        self.teardown();
    }
}

/// A group of ranks that run collectives together (torch's `ProcessGroup`).
///
/// Cheap to clone (an `Arc`), `Send + Sync`: clones share one set of connections, one worker
/// thread and one issue order. The group is destroyed when the last clone is dropped (or by
/// [`ProcessGroup::destroy`]): queued operations finish first, then the connections close.
///
/// Ranks in arguments (`root`, `dst`, `src`) are ranks **in this group**; convert with
/// [`get_group_rank`](ProcessGroup::get_group_rank) and
/// [`get_global_rank`](ProcessGroup::get_global_rank).
///
/// Every collective must be called by every rank of the group in the same order. Blocking forms
/// borrow their buffers and run on the caller's thread once the group's earlier operations are
/// done; `*_async` forms take ownership of their buffers and run on the group's worker thread
/// (see [`Work`]). Point-to-point operations run on a separate engine with its own connections
/// and do not wait for collectives.
#[derive(Clone)]
pub struct ProcessGroup {
    pub(crate) inner: Arc<GroupInner>,
}

impl std::fmt::Debug for ProcessGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProcessGroup")
            .field("name", &self.inner.ctx.name)
            .field("rank", &self.rank())
            .field("world_size", &self.world_size())
            .field("backend", &self.backend())
            .finish()
    }
}

fn connect_backend(
    cfg: &GroupConfig,
    prefix: &str,
    rank: usize,
    world_size: usize,
) -> Result<Box<dyn Backend>> {
    let spec = BackendSpec::parse(&cfg.backend)?;
    spec.check_available(&cfg.backend, AVAILABLE_BACKENDS)?;
    let host = match spec.host {
        // Host backends keep the group's own prefix (their store keys predate dispatch).
        Some(e) => Some(connect_engine(e, cfg, prefix, rank, world_size)?),
        None => None,
    };
    let device = match spec.device {
        Some(e) => Some(connect_device(
            e,
            cfg,
            &format!("{prefix}/cuda"),
            rank,
            world_size,
        )?),
        None => None,
    };
    match (host, device) {
        (Some(host), Some(device)) => Ok(Box::new(Dispatch { host, device })),
        (Some(one), None) | (None, Some(one)) => Ok(one),
        (None, None) => Err(Error::InvalidBackend {
            spec: cfg.backend.clone(),
            reason: "it names no backend".into(),
        }),
    }
}

/// The backend serving device buffers: NCCL, or a host backend behind host staging.
fn connect_device(
    engine: Engine,
    cfg: &GroupConfig,
    prefix: &str,
    rank: usize,
    world_size: usize,
) -> Result<Box<dyn Backend>> {
    let b = connect_engine(engine, cfg, prefix, rank, world_size)?;
    if engine == Engine::Nccl {
        return Ok(b);
    }
    #[cfg(feature = "nccl")]
    {
        let staged = dist_nccl::HostStaging::new(b).map_err(|e| e.into_backend(rank))?;
        Ok(Box::new(staged))
    }
    #[cfg(not(feature = "nccl"))]
    {
        // check_available refused this spec already; kept for the compiler.
        drop(b);
        Err(Error::UnknownBackend {
            name: format!("{} (needs nccl)", cfg.backend),
            available: AVAILABLE_BACKENDS,
        })
    }
}

fn connect_engine(
    engine: Engine,
    cfg: &GroupConfig,
    prefix: &str,
    rank: usize,
    world_size: usize,
) -> Result<Box<dyn Backend>> {
    let _ = (prefix, rank, world_size);
    match engine {
        #[cfg(feature = "gloo")]
        Engine::Gloo => {
            let mut o = dist_gloo::GlooOptions::from_env();
            o.mesh.timeout = cfg.timeout;
            Ok(Box::new(dist_gloo::GlooBackend::connect(
                &*cfg.root_store,
                prefix,
                rank,
                world_size,
                &o,
            )?))
        }
        #[cfg(feature = "nccl")]
        Engine::Nccl => {
            let mut o = dist_nccl::NcclOptions::from_env();
            o.timeout = cfg.timeout;
            let b =
                dist_nccl::NcclBackend::new(cfg.root_store.clone(), prefix, rank, world_size, o)
                    .map_err(|e| e.into_backend(rank))?;
            Ok(Box::new(b))
        }
        #[allow(
            unreachable_patterns,
            reason = "reached only in builds without a backend"
        )]
        other => Err(Error::UnknownBackend {
            name: format!("{other:?}").to_lowercase(),
            available: AVAILABLE_BACKENDS,
        }),
    }
}

/// Ends the creation of a group with an agreement that every rank has finished it: no rank
/// returns (and so may leave, or exit) while another is still connecting, so none of them
/// meets a half-built mesh or a store whose host has gone.
fn agree_connected(
    store: &dyn Store,
    rank: usize,
    world_size: usize,
    timeout: Duration,
) -> Result<()> {
    let key = |r: usize| format!("connected/{r}");
    let store_err = |e| {
        Error::store(
            rank,
            "creating the group: agreeing that every rank finished",
            e,
        )
    };
    store.set(&key(rank), b"1").map_err(store_err)?;
    let keys: Vec<String> = (0..world_size).map(key).collect();
    let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
    store.wait(&keys, timeout).map_err(store_err)
}

/// A fingerprint of one collective, compared across ranks at `DIST_DEBUG=DETAIL`.
pub(crate) type Fingerprint = [u64; 4];

pub(crate) fn fingerprint(
    op: &'static str,
    dtype: Option<dist_wire::DType>,
    count: usize,
    root: Option<usize>,
) -> Fingerprint {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in op.bytes() {
        h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
    }
    [
        h,
        dtype.map_or(u64::MAX, |d| u64::from(d.code())),
        count as u64,
        root.map_or(u64::MAX, |r| r as u64),
    ]
}

fn check_fingerprint(
    ctx: &OpCtx,
    b: &dyn Backend,
    op: &'static str,
    fp: Fingerprint,
) -> Result<()> {
    let mut all = vec![0u64; 4 * ctx.world_size];
    let counts = vec![4; ctx.world_size];
    b.all_gather(
        BufRef::Host(bytemuck::cast_slice(&fp)),
        BufMut::Host(bytemuck::cast_slice_mut(&mut all)),
        dist_wire::DType::U64,
        &counts,
        &OpOptions::with_timeout(ctx.timeout),
    )?;
    for (r, theirs) in all.chunks_exact(4).enumerate() {
        if theirs != fp {
            return Err(Error::invalid(
                ctx.rank,
                op,
                format!(
                    "DIST_DEBUG=DETAIL fingerprint check: this rank called {op} (dtype code {}, count {}, root {}) but rank {r} called an operation with fingerprint (op hash {:#x}, dtype code {}, count {}, root {})",
                    fp[1] as i64,
                    fp[2],
                    fp[3] as i64,
                    theirs[0],
                    theirs[1] as i64,
                    theirs[2],
                    theirs[3] as i64
                ),
            ));
        }
    }
    Ok(())
}

/// Runs one operation on `b` as the group's collective `seq` (flight recorder entry `id`),
/// keeping the flight recorder, the progress others read on a timeout, and the logs.
#[allow(
    clippy::too_many_arguments,
    reason = "one internal helper that every collective calls; a struct would only rename them"
)]
fn run_op<R>(
    ctx: &OpCtx,
    id: u64,
    seq: u64,
    op: &'static str,
    fp: Option<Fingerprint>,
    b: &dyn Backend,
    f: impl FnOnce(&dyn Backend, &OpOptions) -> Result<R>,
) -> Result<R> {
    ctx.recorder.started(id);
    ctx.progress.started(seq, op);
    let t0 = Instant::now();
    if ctx.debug >= DebugLevel::Detail {
        tracing::info!(rank = ctx.rank, group = %ctx.name, op, seq, "operation started");
    }
    let mut opts = OpOptions::with_timeout(ctx.timeout);
    opts.seq = Some(seq);
    let r = match fp {
        Some(fp) if ctx.debug >= DebugLevel::Detail => {
            check_fingerprint(ctx, b, op, fp).and_then(|()| f(b, &opts))
        }
        _ => f(b, &opts),
    };
    let r = r.map_err(|e| with_progress(ctx, op, seq, e));
    match &r {
        Ok(_) => ctx.progress.finished(seq, op),
        Err(_) => ctx.progress.failed(seq, op),
    }
    finish(ctx, id, Some(seq), op, t0, r.as_ref().err());
    r
}

/// The longest a timed-out collective spends gathering its progress report, so that the error
/// comes within a second of the timeout even when the store does not answer.
const PROGRESS_REPORT_BUDGET: Duration = Duration::from_millis(600);

/// Turns a backend timeout into [`Error::CollectiveTimeout`], which says where every rank of
/// the group is; other errors pass through.
fn with_progress(ctx: &OpCtx, op: &'static str, cseq: u64, e: Error) -> Error {
    match e {
        Error::Backend(source @ dist_backend::Error::Timeout { .. }) => Error::CollectiveTimeout {
            rank: ctx.rank,
            group: ctx.name.clone(),
            op,
            seq: cseq,
            progress: ctx.progress.report_within(op, cseq, PROGRESS_REPORT_BUDGET),
            source,
        },
        other => other,
    }
}

fn finish(
    ctx: &OpCtx,
    id: u64,
    seq: Option<u64>,
    op: &'static str,
    t0: Instant,
    err: Option<&Error>,
) {
    ctx.recorder.finished(id, err.map(ToString::to_string));
    match err {
        Some(e) => {
            // A monitored barrier fails through the store and leaves the group usable.
            let aborts = !matches!(e, Error::MonitoredBarrier { .. });
            let dumped = ctx.dump.on_failure(&ctx.name, ctx.rank, aborts, || {
                let error = e.to_string();
                dump_json(
                    &ctx.name,
                    ctx.rank,
                    ctx.world_size,
                    &ctx.recorder.entries(),
                    Some(&error),
                )
            });
            tracing::warn!(rank = ctx.rank, group = %ctx.name, op, ?seq, error = %e, first_failure = dumped, "operation failed");
        }
        None if ctx.debug >= DebugLevel::Detail => {
            tracing::info!(rank = ctx.rank, group = %ctx.name, op, ?seq, elapsed = ?t0.elapsed(), "operation completed");
        }
        None if ctx.debug >= DebugLevel::Info => {
            tracing::debug!(rank = ctx.rank, group = %ctx.name, op, ?seq, elapsed = ?t0.elapsed(), "operation completed");
        }
        None => {}
    }
}

fn bytes<T: Element>(s: &[T]) -> BufRef<'_> {
    BufRef::Host(bytemuck::cast_slice(s))
}

fn bytes_mut<T: Element>(s: &mut [T]) -> BufMut<'_> {
    BufMut::Host(bytemuck::cast_slice_mut(s))
}

fn info<T: Element>(op: &'static str, counts: Vec<usize>, peer: Option<usize>) -> OpInfo {
    OpInfo {
        op,
        dtype: Some(T::DTYPE.to_string()),
        counts,
        peer,
    }
}

/// One operation of [`ProcessGroup::batch_isend_irecv`].
#[derive(Debug)]
#[non_exhaustive]
pub enum P2pOp<T> {
    /// Send `buf` to group rank `peer` with `tag`.
    Send {
        /// The data.
        buf: Vec<T>,
        /// Destination (group rank).
        peer: usize,
        /// Matching tag.
        tag: u32,
    },
    /// Receive into `buf` (its length is the message length) from group rank `peer` with `tag`.
    Recv {
        /// Where the data goes.
        buf: Vec<T>,
        /// Source (group rank).
        peer: usize,
        /// Matching tag.
        tag: u32,
    },
}

impl<T> P2pOp<T> {
    /// A send of `buf` to `peer`.
    pub fn isend(buf: Vec<T>, peer: usize, tag: u32) -> Self {
        P2pOp::Send { buf, peer, tag }
    }

    /// A receive into `buf` from `peer`.
    pub fn irecv(buf: Vec<T>, peer: usize, tag: u32) -> Self {
        P2pOp::Recv { buf, peer, tag }
    }
}

impl ProcessGroup {
    /// Connects a new group: `rank` of `world_size`, under `prefix` in the job's store.
    pub(crate) fn connect(
        cfg: GroupConfig,
        prefix: String,
        rank: usize,
        global_ranks: Vec<usize>,
        world: bool,
    ) -> Result<ProcessGroup> {
        let world_size = global_ranks.len();
        let coll = connect_backend(&cfg, &format!("{prefix}/coll"), rank, world_size)?;
        let p2p_backend = connect_backend(&cfg, &format!("{prefix}/p2p"), rank, world_size)?;
        let store: Arc<dyn Store> =
            Arc::new(PrefixStore::new(prefix.clone(), cfg.root_store.clone()));
        agree_connected(&*store, rank, world_size, cfg.timeout)?;
        let short = prefix.rsplit('/').next().unwrap_or("g").to_owned();
        let no_thread = |what: &str| {
            let context = format!("process group {prefix}: starting its {what} thread");
            move |source| {
                Error::Backend(dist_backend::Error::Io {
                    rank,
                    context,
                    source,
                })
            }
        };
        let (exec, worker) =
            Exec::start(coll, format!("dist-{short}-r{rank}")).map_err(no_thread("worker"))?;
        // From here on, a failure stops the threads already started.
        let started = p2p::start(
            p2p_backend,
            store.clone(),
            format!("dist-{short}-p2p-r{rank}"),
        )
        .map_err(no_thread("point-to-point"));
        let (tx, p2p_thread) = match started {
            Ok(t) => t,
            Err(e) => {
                exec.close();
                let _ = worker.join();
                return Err(e);
            }
        };
        let progress = Arc::new(Progress::new(rank, world_size, store.clone(), cfg.timeout));
        let started =
            progress::start_watchdog(progress.clone(), format!("dist-{short}-wd-r{rank}"))
                .map_err(no_thread("watchdog"));
        let (stop_watchdog, watchdog) = match started {
            Ok(t) => t,
            Err(e) => {
                exec.close();
                drop(tx);
                let _ = worker.join();
                let _ = p2p_thread.join();
                return Err(e);
            }
        };
        if cfg.debug >= DebugLevel::Info {
            tracing::info!(rank, world_size, group = %prefix, backend = %cfg.backend, "process group created");
        }
        let inner = Arc::new(GroupInner {
            ctx: Arc::new(OpCtx {
                rank,
                world_size,
                name: prefix.clone(),
                timeout: cfg.timeout,
                debug: cfg.debug,
                recorder: FlightRecorder::from_env(),
                progress,
                dump: FailureDump::new(cfg.flight_dir.clone()),
            }),
            cfg,
            prefix,
            store,
            global_ranks,
            created: AtomicU64::new(0),
            monitored: AtomicU64::new(0),
            exec,
            p2p: Mutex::new(Some(tx)),
            watchdog: Mutex::new(Some(stop_watchdog)),
            threads: Mutex::new(vec![worker, p2p_thread, watchdog]),
            world,
            torn_down: AtomicBool::new(false),
        });
        crate::teardown::register(&inner);
        Ok(ProcessGroup { inner })
    }

    /// This process's rank in the group.
    pub fn rank(&self) -> usize {
        self.inner.ctx.rank
    }

    /// Number of ranks in the group.
    pub fn world_size(&self) -> usize {
        self.inner.ctx.world_size
    }

    /// Same as [`world_size`](ProcessGroup::world_size) (torch's `group.size()`).
    pub fn size(&self) -> usize {
        self.world_size()
    }

    /// The backend's name (`"gloo"`).
    pub fn backend(&self) -> &str {
        &self.inner.cfg.backend
    }

    /// The group's name: its namespace in the job's store (`"default"`, `"default/g0"`, ...).
    pub fn name(&self) -> &str {
        &self.inner.ctx.name
    }

    /// The per-operation timeout.
    pub fn timeout(&self) -> Duration {
        self.inner.ctx.timeout
    }

    /// Global rank of each group rank, in group-rank order.
    pub fn global_ranks(&self) -> &[usize] {
        &self.inner.global_ranks
    }

    /// The group rank of global rank `global`, or `None` if it is not a member.
    pub fn get_group_rank(&self, global: usize) -> Option<usize> {
        self.inner.global_ranks.iter().position(|&g| g == global)
    }

    /// The global rank of group rank `group_rank`, or `None` if there is no such rank.
    pub fn get_global_rank(&self, group_rank: usize) -> Option<usize> {
        self.inner.global_ranks.get(group_rank).copied()
    }

    /// The last operations of this group (oldest first; `DIST_FLIGHT_RECORDER_SIZE` of them,
    /// 64 by default).
    pub fn flight_recorder(&self) -> Vec<FlightEntry> {
        self.inner.ctx.recorder.entries()
    }

    /// The flight recorder as JSON: `{"group", "rank", "world_size", "entries": [...]}`. A
    /// group's first failed operation dumps the same object, with an `"error"` field, to
    /// `<dir>/<group>.rank<rank>.json` (`/` in the group name becomes `.`) when
    /// [`InitOptions::flight_recorder_dir`](crate::InitOptions::flight_recorder_dir) or
    /// `DIST_FLIGHT_RECORDER_DIR` names a directory, and into a `warn` event otherwise.
    pub fn dump_flight_recorder(&self) -> String {
        dump_json(
            self.name(),
            self.rank(),
            self.world_size(),
            &self.flight_recorder(),
            None,
        )
        .to_string()
    }

    /// Destroys this handle; when it is the last one, waits for the group's queued operations
    /// (each bounded by the timeout), closes its connections and joins its threads. Other
    /// clones keep the group alive.
    pub fn destroy(self) {
        drop(self);
    }

    pub(crate) fn store(&self) -> &Arc<dyn Store> {
        &self.inner.store
    }

    pub(crate) fn invalid(&self, op: &'static str, reason: impl Into<String>) -> Error {
        Error::invalid(self.rank(), op, reason)
    }

    fn check_len(
        &self,
        op: &'static str,
        what: &'static str,
        expected: usize,
        actual: usize,
    ) -> Result<()> {
        if expected != actual {
            return Err(Error::size(self.rank(), op, what, expected, actual));
        }
        Ok(())
    }

    pub(crate) fn check_root(&self, op: &'static str, root: usize) -> Result<()> {
        if root >= self.world_size() {
            return Err(self.invalid(
                op,
                format!(
                    "root {root} is not a rank of this group of {}",
                    self.world_size()
                ),
            ));
        }
        Ok(())
    }

    /// Checks a buffer only the root passes (`given` is its length when passed): present with
    /// `expected` elements on the root, absent elsewhere.
    fn check_root_buffer(
        &self,
        op: &'static str,
        what: &'static str,
        root: usize,
        given: Option<usize>,
        expected: usize,
    ) -> Result<()> {
        match (given, self.rank() == root) {
            (Some(len), true) => self.check_len(op, what, expected, len),
            (None, true) => Err(self.invalid(op, format!("the root must pass an {what} buffer"))),
            (Some(_), false) => Err(self.invalid(
                op,
                format!("only the root (rank {root}) passes an {what} buffer"),
            )),
            (None, false) => Ok(()),
        }
    }

    fn check_peer(&self, op: &'static str, peer: usize) -> Result<()> {
        if peer >= self.world_size() {
            return Err(self.invalid(
                op,
                format!(
                    "peer {peer} is not a rank of this group of {}",
                    self.world_size()
                ),
            ));
        }
        if peer == self.rank() {
            return Err(self.invalid(op, format!("rank {peer} cannot {op} itself")));
        }
        Ok(())
    }

    fn check_reduce<T: Element>(&self, op: &'static str, rop: ReduceOp) -> Result<()> {
        rop.check(T::DTYPE)
            .map_err(|source| self.invalid(op, format!("reduce op: {source}")))
    }

    fn check_counts(&self, op: &'static str, what: &'static str, counts: &[usize]) -> Result<()> {
        self.check_len(op, what, self.world_size(), counts.len())
    }

    /// Runs a collective on this thread in its place in the group's order.
    pub(crate) fn coll<R>(
        &self,
        info: OpInfo,
        fp: Option<Fingerprint>,
        f: impl FnOnce(&dyn Backend, &OpOptions) -> Result<R>,
    ) -> Result<R> {
        let op = info.op;
        let ctx = &self.inner.ctx;
        let id = std::cell::Cell::new(0);
        self.inner
            .exec
            .run_inline(
                |seq| id.set(ctx.recorder.issue(info, Some(seq))),
                |b, seq| run_op(ctx, id.get(), seq, op, fp, b, f),
            )
            .unwrap_or_else(|| Err(self.destroyed(op)))
    }

    /// Runs a group-level step (no backend operation) on this thread in its place in the
    /// group's order, recorded in the flight recorder.
    pub(crate) fn ordered<R>(&self, info: OpInfo, f: impl FnOnce() -> Result<R>) -> Result<R> {
        self.coll(info, None, |_, _| f())
    }

    /// Queues a collective on the group's worker.
    pub(crate) fn coll_async<R: Send + 'static>(
        &self,
        info: OpInfo,
        fp: Option<Fingerprint>,
        f: impl FnOnce(&dyn Backend, &OpOptions) -> Result<R> + Send + 'static,
    ) -> Result<Work<R>> {
        let op = info.op;
        let ctx = self.inner.ctx.clone();
        let mut work = None;
        self.inner
            .exec
            .submit(|seq| {
                let id = ctx.recorder.issue(info, Some(seq));
                let (w, done): (Work<R>, Completer<R>) = Work::pending(ctx.rank, op, seq);
                work = Some(w);
                Box::new(move |b: &dyn Backend, seq| {
                    done.complete(run_op(&ctx, id, seq, op, fp, b, f));
                })
            })
            .ok_or_else(|| self.destroyed(op))?;
        work.ok_or_else(|| self.destroyed(op))
    }

    fn destroyed(&self, op: &'static str) -> Error {
        Error::Destroyed {
            rank: self.rank(),
            op,
        }
    }

    /// Queues a send or receive on the point-to-point engine.
    fn p2p<T: Element>(
        &self,
        dir: Dir,
        buf: Vec<T>,
        peer: usize,
        tag: u32,
    ) -> Result<Work<Vec<T>>> {
        let op = match dir {
            Dir::Send => "send",
            Dir::Recv => "recv",
        };
        self.check_peer(op, peer)?;
        let ctx = self.inner.ctx.clone();
        let seq = ctx
            .recorder
            .issue(info::<T>(op, vec![buf.len()], Some(peer)), None);
        let (work, done) = Work::pending(ctx.rank, op, seq);
        let started = Instant::now();
        let deadline = dist_backend::deadline_after(started, ctx.timeout);
        let mut buf = buf;
        let run = Box::new(move |b: std::result::Result<&dyn Backend, Error>| {
            let t0 = Instant::now();
            let r = match b {
                Ok(b) => {
                    ctx.recorder.started(seq);
                    let mut opts = OpOptions::with_timeout(deadline.saturating_duration_since(t0));
                    opts.tag = tag;
                    match dir {
                        Dir::Send => b.send(bytes(&buf), T::DTYPE, peer, &opts),
                        Dir::Recv => b.recv(bytes_mut(&mut buf), T::DTYPE, peer, &opts),
                    }
                    .map_err(Error::from)
                }
                Err(e) => Err(e),
            };
            finish(&ctx, seq, None, op, t0, r.as_ref().err());
            done.complete(r.map(|()| buf));
        });
        let job = P2pJob {
            dir,
            peer,
            tag,
            seq,
            deadline,
            started,
            run,
        };
        let tx = self.inner.p2p.lock().unwrap_or_else(|e| e.into_inner());
        match tx.as_ref().map(|tx| tx.send(job)) {
            Some(Ok(())) => Ok(work),
            _ => Err(Error::Destroyed {
                rank: self.rank(),
                op,
            }),
        }
    }

    // ---- all_reduce, broadcast, reduce -------------------------------------------------------

    /// Reduces `buf` across the group in place; every rank ends with the same values.
    pub fn all_reduce<T: Element>(&self, buf: &mut [T], op: ReduceOp) -> Result<()> {
        self.check_reduce::<T>("all_reduce", op)?;
        let fp = fingerprint("all_reduce", Some(T::DTYPE), buf.len(), None);
        self.coll(
            info::<T>("all_reduce", vec![buf.len()], None),
            Some(fp),
            |b, o| Ok(b.all_reduce(bytes_mut(buf), T::DTYPE, op, o)?),
        )
    }

    /// [`all_reduce`](ProcessGroup::all_reduce) on the worker; `wait` gives back the reduced
    /// buffer.
    pub fn all_reduce_async<T: Element>(
        &self,
        mut buf: Vec<T>,
        op: ReduceOp,
    ) -> Result<Work<Vec<T>>> {
        self.check_reduce::<T>("all_reduce", op)?;
        let fp = fingerprint("all_reduce", Some(T::DTYPE), buf.len(), None);
        self.coll_async(
            info::<T>("all_reduce", vec![buf.len()], None),
            Some(fp),
            move |b, o| {
                b.all_reduce(bytes_mut(&mut buf), T::DTYPE, op, o)?;
                Ok(buf)
            },
        )
    }

    /// Copies `root`'s `buf` into every other rank's `buf` (same length on every rank).
    pub fn broadcast<T: Element>(&self, buf: &mut [T], root: usize) -> Result<()> {
        self.check_root("broadcast", root)?;
        let fp = fingerprint("broadcast", Some(T::DTYPE), buf.len(), Some(root));
        self.coll(
            info::<T>("broadcast", vec![buf.len()], Some(root)),
            Some(fp),
            |b, o| Ok(b.broadcast(bytes_mut(buf), T::DTYPE, root, o)?),
        )
    }

    /// [`broadcast`](ProcessGroup::broadcast) on the worker; `wait` gives back the buffer.
    pub fn broadcast_async<T: Element>(
        &self,
        mut buf: Vec<T>,
        root: usize,
    ) -> Result<Work<Vec<T>>> {
        self.check_root("broadcast", root)?;
        let fp = fingerprint("broadcast", Some(T::DTYPE), buf.len(), Some(root));
        self.coll_async(
            info::<T>("broadcast", vec![buf.len()], Some(root)),
            Some(fp),
            move |b, o| {
                b.broadcast(bytes_mut(&mut buf), T::DTYPE, root, o)?;
                Ok(buf)
            },
        )
    }

    /// Reduces `buf` across the group into `root`'s `buf`; other ranks' buffers are left in an
    /// unspecified state (as in torch).
    pub fn reduce<T: Element>(&self, buf: &mut [T], op: ReduceOp, root: usize) -> Result<()> {
        self.check_root("reduce", root)?;
        self.check_reduce::<T>("reduce", op)?;
        let fp = fingerprint("reduce", Some(T::DTYPE), buf.len(), Some(root));
        self.coll(
            info::<T>("reduce", vec![buf.len()], Some(root)),
            Some(fp),
            |b, o| Ok(b.reduce(bytes_mut(buf), T::DTYPE, op, root, o)?),
        )
    }

    /// [`reduce`](ProcessGroup::reduce) on the worker; `wait` gives back the buffer.
    pub fn reduce_async<T: Element>(
        &self,
        mut buf: Vec<T>,
        op: ReduceOp,
        root: usize,
    ) -> Result<Work<Vec<T>>> {
        self.check_root("reduce", root)?;
        self.check_reduce::<T>("reduce", op)?;
        let fp = fingerprint("reduce", Some(T::DTYPE), buf.len(), Some(root));
        self.coll_async(
            info::<T>("reduce", vec![buf.len()], Some(root)),
            Some(fp),
            move |b, o| {
                b.reduce(bytes_mut(&mut buf), T::DTYPE, op, root, o)?;
                Ok(buf)
            },
        )
    }

    // ---- all_gather ---------------------------------------------------------------------------

    /// Gathers every rank's `input` (equal lengths) into `output`, rank by rank (torch's
    /// `all_gather_into_tensor`). `output.len()` must be `input.len() * world_size`.
    pub fn all_gather_into<T: Element>(&self, input: &[T], output: &mut [T]) -> Result<()> {
        let w = self.world_size();
        self.check_len("all_gather", "output", input.len() * w, output.len())?;
        let counts = vec![input.len(); w];
        let fp = fingerprint("all_gather", Some(T::DTYPE), output.len(), None);
        self.coll(
            info::<T>("all_gather", counts.clone(), None),
            Some(fp),
            |b, o| Ok(b.all_gather(bytes(input), bytes_mut(output), T::DTYPE, &counts, o)?),
        )
    }

    /// Gathers every rank's `input` (equal lengths) into one vector per rank (torch's
    /// `all_gather` list form).
    pub fn all_gather<T: Element>(&self, input: &[T]) -> Result<Vec<Vec<T>>> {
        let mut out = vec![T::zeroed(); input.len() * self.world_size()];
        self.all_gather_into(input, &mut out)?;
        Ok(split_by(&out, &vec![input.len(); self.world_size()]))
    }

    /// [`all_gather_into`](ProcessGroup::all_gather_into) on the worker; `wait` gives the
    /// gathered vector (`input.len() * world_size` elements, rank by rank).
    pub fn all_gather_async<T: Element>(&self, input: Vec<T>) -> Result<Work<Vec<T>>> {
        let w = self.world_size();
        let counts = vec![input.len(); w];
        let fp = fingerprint("all_gather", Some(T::DTYPE), input.len() * w, None);
        self.coll_async(
            info::<T>("all_gather", counts.clone(), None),
            Some(fp),
            move |b, o| {
                let mut out = vec![T::zeroed(); input.len() * counts.len()];
                b.all_gather(bytes(&input), bytes_mut(&mut out), T::DTYPE, &counts, o)?;
                Ok(out)
            },
        )
    }

    /// Uneven all-gather: rank r contributes `counts[r]` elements; `input.len()` must be
    /// `counts[rank]` and `output.len()` their sum. Every rank passes the same `counts`.
    pub fn all_gather_into_uneven<T: Element>(
        &self,
        input: &[T],
        output: &mut [T],
        counts: &[usize],
    ) -> Result<()> {
        self.check_counts("all_gather", "counts", counts)?;
        self.check_len("all_gather", "input", counts[self.rank()], input.len())?;
        self.check_len("all_gather", "output", counts.iter().sum(), output.len())?;
        let fp = fingerprint("all_gather", Some(T::DTYPE), output.len(), None);
        self.coll(
            info::<T>("all_gather", counts.to_vec(), None),
            Some(fp),
            |b, o| Ok(b.all_gather(bytes(input), bytes_mut(output), T::DTYPE, counts, o)?),
        )
    }

    /// Uneven all-gather without known counts: exchanges the lengths first, then the data; one
    /// vector per rank.
    pub fn all_gather_uneven<T: Element>(&self, input: &[T]) -> Result<Vec<Vec<T>>> {
        let lens = self.all_gather(&[input.len() as u64])?;
        let counts: Vec<usize> = lens.iter().map(|l| l[0] as usize).collect();
        let mut out = vec![T::zeroed(); counts.iter().sum()];
        self.all_gather_into_uneven(input, &mut out, &counts)?;
        Ok(split_by(&out, &counts))
    }

    // ---- reduce_scatter -----------------------------------------------------------------------

    /// Reduces `input` (`output.len() * world_size` elements: rank r's share is the r-th
    /// block) across the group and leaves this rank's reduced share in `output` (torch's
    /// `reduce_scatter_tensor`).
    pub fn reduce_scatter_into<T: Element>(
        &self,
        input: &[T],
        output: &mut [T],
        op: ReduceOp,
    ) -> Result<()> {
        let w = self.world_size();
        self.check_len("reduce_scatter", "input", output.len() * w, input.len())?;
        let counts = vec![output.len(); w];
        self.reduce_scatter_into_uneven(input, output, &counts, op)
    }

    /// Uneven reduce-scatter: rank r's share is `counts[r]` elements; `input.len()` must be
    /// their sum and `output.len()` `counts[rank]`.
    pub fn reduce_scatter_into_uneven<T: Element>(
        &self,
        input: &[T],
        output: &mut [T],
        counts: &[usize],
        op: ReduceOp,
    ) -> Result<()> {
        self.check_counts("reduce_scatter", "counts", counts)?;
        self.check_len("reduce_scatter", "input", counts.iter().sum(), input.len())?;
        self.check_len(
            "reduce_scatter",
            "output",
            counts[self.rank()],
            output.len(),
        )?;
        self.check_reduce::<T>("reduce_scatter", op)?;
        let fp = fingerprint("reduce_scatter", Some(T::DTYPE), input.len(), None);
        self.coll(
            info::<T>("reduce_scatter", counts.to_vec(), None),
            Some(fp),
            |b, o| {
                Ok(b.reduce_scatter(bytes(input), bytes_mut(output), T::DTYPE, op, counts, o)?)
            },
        )
    }

    /// [`reduce_scatter_into`](ProcessGroup::reduce_scatter_into) on the worker: `input` must
    /// hold a multiple of `world_size` elements; `wait` gives this rank's reduced share.
    pub fn reduce_scatter_async<T: Element>(
        &self,
        input: Vec<T>,
        op: ReduceOp,
    ) -> Result<Work<Vec<T>>> {
        let w = self.world_size();
        if !input.len().is_multiple_of(w) {
            return Err(self.invalid(
                "reduce_scatter",
                format!(
                    "input has {} elements, not a multiple of the world size {w}",
                    input.len()
                ),
            ));
        }
        self.check_reduce::<T>("reduce_scatter", op)?;
        let counts = vec![input.len() / w; w];
        let fp = fingerprint("reduce_scatter", Some(T::DTYPE), input.len(), None);
        self.coll_async(
            info::<T>("reduce_scatter", counts.clone(), None),
            Some(fp),
            move |b, o| {
                let mut out = vec![T::zeroed(); counts[0]];
                b.reduce_scatter(bytes(&input), bytes_mut(&mut out), T::DTYPE, op, &counts, o)?;
                Ok(out)
            },
        )
    }

    // ---- all_to_all ---------------------------------------------------------------------------

    /// Sends block r of `input` to rank r and receives rank r's block for this rank into block r
    /// of `output` (torch's `all_to_all_single`). Without split sizes, both buffers are cut into
    /// `world_size` equal blocks; with them, `output_split_sizes[r]`/`input_split_sizes[r]` give
    /// block r's length, and each must sum to its buffer's length.
    pub fn all_to_all_single<T: Element>(
        &self,
        output: &mut [T],
        input: &[T],
        output_split_sizes: Option<&[usize]>,
        input_split_sizes: Option<&[usize]>,
    ) -> Result<()> {
        let op = "all_to_all";
        let w = self.world_size();
        let even = |len: usize, what: &'static str| -> Result<Vec<usize>> {
            if !len.is_multiple_of(w) {
                return Err(self.invalid(
                    op,
                    format!("{what} has {len} elements, not a multiple of the world size {w}"),
                ));
            }
            Ok(vec![len / w; w])
        };
        let recv = match output_split_sizes {
            Some(s) => {
                self.check_counts(op, "output_split_sizes", s)?;
                self.check_len(op, "output", s.iter().sum(), output.len())?;
                s.to_vec()
            }
            None => even(output.len(), "output")?,
        };
        let send = match input_split_sizes {
            Some(s) => {
                self.check_counts(op, "input_split_sizes", s)?;
                self.check_len(op, "input", s.iter().sum(), input.len())?;
                s.to_vec()
            }
            None => even(input.len(), "input")?,
        };
        let r = self.rank();
        if send[r] != recv[r] {
            return Err(Error::size(
                r,
                op,
                "output block from this rank itself",
                send[r],
                recv[r],
            ));
        }
        self.coll(info::<T>(op, send.clone(), None), None, |b, o| {
            Ok(b.all_to_all(bytes(input), bytes_mut(output), T::DTYPE, &send, &recv, o)?)
        })
    }

    /// List form of all-to-all: `inputs[r]` goes to rank r; returns what each rank sent here.
    /// Lengths may differ; they are exchanged first.
    pub fn all_to_all<T: Element>(&self, inputs: &[Vec<T>]) -> Result<Vec<Vec<T>>> {
        self.check_counts("all_to_all", "inputs", &vec![0; inputs.len()])?;
        let send: Vec<usize> = inputs.iter().map(Vec::len).collect();
        let send64: Vec<u64> = send.iter().map(|&n| n as u64).collect();
        let mut recv64 = vec![0u64; self.world_size()];
        self.all_to_all_single(&mut recv64, &send64, None, None)?;
        let recv: Vec<usize> = recv64.iter().map(|&n| n as usize).collect();
        let flat: Vec<T> = inputs.concat();
        let mut out = vec![T::zeroed(); recv.iter().sum()];
        self.all_to_all_single(&mut out, &flat, Some(&recv), Some(&send))?;
        Ok(split_by(&out, &recv))
    }

    // ---- gather, scatter, barrier ------------------------------------------------------------

    /// Gathers every rank's `input` (equal lengths) into `root`'s `output` (`input.len() *
    /// world_size` elements, rank by rank). `output` is `Some` on the root and `None` elsewhere.
    pub fn gather<T: Element>(
        &self,
        input: &[T],
        output: Option<&mut [T]>,
        root: usize,
    ) -> Result<()> {
        let op = "gather";
        self.check_root(op, root)?;
        self.check_root_buffer(
            op,
            "output",
            root,
            output.as_ref().map(|o| o.len()),
            input.len() * self.world_size(),
        )?;
        let fp = fingerprint(op, Some(T::DTYPE), input.len(), Some(root));
        self.coll(
            info::<T>(op, vec![input.len()], Some(root)),
            Some(fp),
            |b, o| Ok(b.gather(bytes(input), output.map(bytes_mut), T::DTYPE, root, o)?),
        )
    }

    /// Scatters `root`'s `input` (`output.len() * world_size` elements, rank r's share is block
    /// r) into every rank's `output`. `input` is `Some` on the root and `None` elsewhere.
    pub fn scatter<T: Element>(
        &self,
        input: Option<&[T]>,
        output: &mut [T],
        root: usize,
    ) -> Result<()> {
        let op = "scatter";
        self.check_root(op, root)?;
        self.check_root_buffer(
            op,
            "input",
            root,
            input.map(<[T]>::len),
            output.len() * self.world_size(),
        )?;
        let fp = fingerprint(op, Some(T::DTYPE), output.len(), Some(root));
        self.coll(
            info::<T>(op, vec![output.len()], Some(root)),
            Some(fp),
            |b, o| Ok(b.scatter(input.map(bytes), bytes_mut(output), T::DTYPE, root, o)?),
        )
    }

    /// Returns once every rank of the group has entered the barrier.
    pub fn barrier(&self) -> Result<()> {
        let fp = fingerprint("barrier", None, 0, None);
        self.coll(
            OpInfo {
                op: "barrier",
                dtype: None,
                counts: vec![],
                peer: None,
            },
            Some(fp),
            |b, o| Ok(b.barrier(o)?),
        )
    }

    /// [`barrier`](ProcessGroup::barrier) on the worker.
    pub fn barrier_async(&self) -> Result<Work<()>> {
        let fp = fingerprint("barrier", None, 0, None);
        self.coll_async(
            OpInfo {
                op: "barrier",
                dtype: None,
                counts: vec![],
                peer: None,
            },
            Some(fp),
            |b, o| Ok(b.barrier(o)?),
        )
    }

    // ---- point to point -----------------------------------------------------------------------

    /// Sends `buf` to group rank `dst`, matched by `tag` with a [`recv`](ProcessGroup::recv) of
    /// the same length. Returns when the message has been handed to the connection.
    pub fn send<T: Element>(&self, buf: &[T], dst: usize, tag: u32) -> Result<()> {
        self.isend(buf.to_vec(), dst, tag)?.wait().map(drop)
    }

    /// Receives into `buf` from group rank `src`, matched by `tag`; the message must have
    /// `buf.len()` elements.
    pub fn recv<T: Element>(&self, buf: &mut [T], src: usize, tag: u32) -> Result<()> {
        let got = self.irecv(vec![T::zeroed(); buf.len()], src, tag)?.wait()?;
        buf.copy_from_slice(&got);
        Ok(())
    }

    /// Sends `buf` to `dst` in the background; `wait` gives the buffer back. Sends to one peer
    /// with one tag arrive in issue order.
    pub fn isend<T: Element>(&self, buf: Vec<T>, dst: usize, tag: u32) -> Result<Work<Vec<T>>> {
        self.p2p(Dir::Send, buf, dst, tag)
    }

    /// Receives `buf.len()` elements from `src` in the background; `wait` gives the filled
    /// buffer. Posting receives before the matching sends (on both sides) does not deadlock.
    pub fn irecv<T: Element>(&self, buf: Vec<T>, src: usize, tag: u32) -> Result<Work<Vec<T>>> {
        self.p2p(Dir::Recv, buf, src, tag)
    }

    /// Issues every send and receive of `ops` at once (torch's `batch_isend_irecv`); one
    /// [`Work`] per op, in order. Every op is validated before any is issued.
    pub fn batch_isend_irecv<T: Element>(&self, ops: Vec<P2pOp<T>>) -> Result<Vec<Work<Vec<T>>>> {
        for o in &ops {
            match o {
                P2pOp::Send { peer, .. } => self.check_peer("send", *peer)?,
                P2pOp::Recv { peer, .. } => self.check_peer("recv", *peer)?,
            }
        }
        ops.into_iter()
            .map(|o| match o {
                P2pOp::Send { buf, peer, tag } => self.isend(buf, peer, tag),
                P2pOp::Recv { buf, peer, tag } => self.irecv(buf, peer, tag),
            })
            .collect()
    }
}

/// Cuts `flat` into consecutive vectors of `counts[i]` elements.
pub(crate) fn split_by<T: Clone>(flat: &[T], counts: &[usize]) -> Vec<Vec<T>> {
    let mut at = 0;
    counts
        .iter()
        .map(|&n| {
            let v = flat[at..at + n].to_vec();
            at += n;
            v
        })
        .collect()
}
