//! `init_process_group`, the default group, and the torch-style free functions over it.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use dist_backend::{DEFAULT_TIMEOUT, Store};
use dist_wire::{Element, ReduceOp};

use crate::debug::DebugLevel;
use crate::group::{GroupConfig, ProcessGroup};
use crate::{Error, Result};

/// Where rank, world size and the rendezvous store come from.
#[derive(Clone)]
#[non_exhaustive]
pub enum InitMethod {
    /// `env://`: the launcher's variables (torchrun, Slurm, Open MPI, PMI); rank 0 serves the
    /// TCP store at `MASTER_ADDR:MASTER_PORT`.
    Env,
    /// A URL: `env://`, `tcp://host:port[?rank=..&world_size=..]` or `file:///path`.
    Url(String),
    /// A store every rank already shares (rank and world size must be given).
    Store(Arc<dyn Store>),
}

impl std::fmt::Debug for InitMethod {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            InitMethod::Env => f.write_str("Env"),
            InitMethod::Url(u) => f.debug_tuple("Url").field(u).finish(),
            InitMethod::Store(_) => f.write_str("Store(..)"),
        }
    }
}

/// Options of [`init_process_group`] (torch's keyword arguments), built with chained setters.
///
/// ```
/// use std::time::Duration;
/// use dist_collective::InitOptions;
/// let opts = InitOptions::new()
///     .backend("gloo")
///     .init_method("tcp://127.0.0.1:29500")
///     .rank(0)
///     .world_size(1)
///     .timeout(Duration::from_secs(60));
/// assert_eq!(opts.get_backend(), "gloo");
/// ```
#[derive(Clone, Debug)]
pub struct InitOptions {
    backend: String,
    method: InitMethod,
    rank: Option<usize>,
    world_size: Option<usize>,
    timeout: Duration,
    debug: Option<DebugLevel>,
    flight_dir: Option<PathBuf>,
}

impl Default for InitOptions {
    fn default() -> Self {
        Self::new()
    }
}

impl InitOptions {
    /// Backend `"gloo"`, `env://`, rank and world size from the environment, the default
    /// timeout ([`DEFAULT_TIMEOUT`], five minutes).
    pub fn new() -> Self {
        InitOptions {
            backend: "gloo".to_owned(),
            method: InitMethod::Env,
            rank: None,
            world_size: None,
            timeout: DEFAULT_TIMEOUT,
            debug: None,
            flight_dir: None,
        }
    }

    /// The debug level of the groups this creates (and their sub-groups), instead of
    /// `DIST_DEBUG`'s.
    pub fn debug_level(mut self, level: DebugLevel) -> Self {
        self.debug = Some(level);
        self
    }

    /// The directory a group's first failure dumps its flight recorder into (one JSON file
    /// per group and rank, see [`ProcessGroup::dump_flight_recorder`]), instead of
    /// `DIST_FLIGHT_RECORDER_DIR`'s. Without either, the dump goes into a `warn` event.
    pub fn flight_recorder_dir(mut self, dir: impl Into<PathBuf>) -> Self {
        self.flight_dir = Some(dir.into());
        self
    }

    /// The backend: `"gloo"` (host buffers), `"nccl"` (device buffers, feature `nccl`), or
    /// torch's per-device form `"cpu:gloo,cuda:nccl"`, which serves each call by where its
    /// buffers live. `"cuda:gloo"` serves device buffers with Gloo through host staging
    /// (copies through pinned memory; opt-in because it is slow).
    pub fn backend(mut self, name: impl Into<String>) -> Self {
        self.backend = name.into();
        self
    }

    /// An init URL: `env://`, `tcp://host:port`, `file:///path`.
    pub fn init_method(mut self, url: impl Into<String>) -> Self {
        self.method = InitMethod::Url(url.into());
        self
    }

    /// A store every rank shares, instead of an init URL.
    pub fn store(mut self, store: Arc<dyn Store>) -> Self {
        self.method = InitMethod::Store(store);
        self
    }

    /// This process's rank (overrides the environment).
    pub fn rank(mut self, rank: usize) -> Self {
        self.rank = Some(rank);
        self
    }

    /// Number of ranks (overrides the environment).
    pub fn world_size(mut self, world_size: usize) -> Self {
        self.world_size = Some(world_size);
        self
    }

    /// How long an operation (and connection set-up) waits for peers.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// The backend name set.
    pub fn get_backend(&self) -> &str {
        &self.backend
    }

    /// The timeout set.
    pub fn get_timeout(&self) -> Duration {
        self.timeout
    }
}

/// Creates a process group over all ranks of the job **without** making it the default one
/// (what [`crate::testing::run_world`] uses; most programs call [`init_process_group`]).
pub fn new_process_group(opts: InitOptions) -> Result<ProcessGroup> {
    // A bad or uncompiled backend fails here, before any rendezvous.
    crate::backend_spec::BackendSpec::parse(&opts.backend)?
        .check_available(&opts.backend, crate::group::AVAILABLE_BACKENDS)?;
    let (rank, world_size, store) = match &opts.method {
        InitMethod::Env => {
            let i = dist_backend::init::init_from_url(
                "env://",
                opts.rank,
                opts.world_size,
                opts.timeout,
            )?;
            (i.rank, i.world_size, i.store)
        }
        InitMethod::Url(u) => {
            let i = dist_backend::init::init_from_url(u, opts.rank, opts.world_size, opts.timeout)?;
            (i.rank, i.world_size, i.store)
        }
        InitMethod::Store(s) => {
            let (Some(r), Some(w)) = (opts.rank, opts.world_size) else {
                return Err(Error::Backend(dist_backend::Error::Init {
                    what: "init with an explicit store needs rank and world_size".into(),
                }));
            };
            if w == 0 || r >= w {
                return Err(Error::Backend(dist_backend::Error::Init {
                    what: format!("rank {r} is not below world_size {w}"),
                }));
            }
            (r, w, s.clone())
        }
    };
    // Each init over one store gets its own namespace, so a job may destroy and re-create its
    // world: every rank of one generation increments the counter before any rank can start
    // the next (the mesh of the first needs them all).
    let n = store
        .add("dist/world_inits", 1)
        .map_err(|e| Error::store(rank, "init_process_group: counting inits", e))?;
    let generation = (n.max(1) as u64 - 1) / world_size as u64;
    let prefix = if generation == 0 {
        "world".to_owned()
    } else {
        format!("world.{generation}")
    };
    let cfg = GroupConfig {
        backend: opts.backend,
        timeout: opts.timeout,
        root_store: store,
        debug: opts.debug.unwrap_or_else(DebugLevel::from_env),
        flight_dir: opts.flight_dir.or_else(|| {
            std::env::var_os("DIST_FLIGHT_RECORDER_DIR")
                .filter(|d| !d.is_empty())
                .map(PathBuf::from)
        }),
    };
    ProcessGroup::connect(cfg, prefix, rank, (0..world_size).collect(), true)
}

static DEFAULT: Mutex<Option<ProcessGroup>> = Mutex::new(None);

fn default_slot() -> std::sync::MutexGuard<'static, Option<ProcessGroup>> {
    DEFAULT.lock().unwrap_or_else(|e| e.into_inner())
}

/// Initialises the default process group (torch's `init_process_group`) and returns a handle
/// on it. Every rank of the job calls it.
///
/// Fails with [`Error::AlreadyInitialized`] if a default group exists (destroy it first).
pub fn init_process_group(opts: InitOptions) -> Result<ProcessGroup> {
    if let Some(pg) = default_slot().as_ref() {
        return Err(Error::AlreadyInitialized {
            rank: pg.rank(),
            world_size: pg.world_size(),
        });
    }
    let pg = new_process_group(opts)?;
    let mut slot = default_slot();
    if let Some(existing) = slot.as_ref() {
        return Err(Error::AlreadyInitialized {
            rank: existing.rank(),
            world_size: existing.world_size(),
        });
    }
    *slot = Some(pg.clone());
    Ok(pg)
}

/// True once [`init_process_group`] has run (and [`destroy_process_group`] has not).
pub fn is_initialized() -> bool {
    default_slot().is_some()
}

/// The default group (torch's `group.WORLD`).
pub fn default_group() -> Result<ProcessGroup> {
    default_slot().clone().ok_or(Error::NotInitialized {
        op: "default_group",
    })
}

/// Destroys the default group (torch's `destroy_process_group()`): waits for its queued
/// operations, says goodbye to every peer, and returns once each peer has closed its end of
/// the connections (or the group's timeout has passed); on the rank that hosts the store, once
/// every rank has left. Handles still held on it (from [`init_process_group`] or
/// [`default_group`]) then fail with [`Error::Destroyed`]. No-op if there is none.
///
/// Calling it is optional: a process that returns from `main` (or calls
/// `std::process::exit`) tears down every group it still has in an exit hook, which is the
/// same goodbye, so no other rank sees it as a crash.
pub fn destroy_process_group() {
    let pg = default_slot().take();
    if let Some(pg) = pg {
        pg.inner.teardown();
        drop(pg);
        dist_backend::exit::run_stage(dist_backend::exit::ExitStage::Connections);
    }
}

/// Empties the default slot (at exit; the group itself is torn down by the caller).
pub(crate) fn forget_default() {
    let pg = default_slot().take();
    drop(pg);
}

fn with_default<R>(op: &'static str, f: impl FnOnce(&ProcessGroup) -> Result<R>) -> Result<R> {
    let pg = default_slot().clone().ok_or(Error::NotInitialized { op })?;
    f(&pg)
}

/// Rank of this process in the default group (torch's `get_rank`).
pub fn get_rank() -> Result<usize> {
    with_default("get_rank", |pg| Ok(pg.rank()))
}

/// Size of the default group (torch's `get_world_size`).
pub fn get_world_size() -> Result<usize> {
    with_default("get_world_size", |pg| Ok(pg.world_size()))
}

/// Backend name of the default group (torch's `get_backend`).
pub fn get_backend() -> Result<String> {
    with_default("get_backend", |pg| Ok(pg.backend().to_owned()))
}

/// [`ProcessGroup::all_reduce`] on the default group.
pub fn all_reduce<T: Element>(buf: &mut [T], op: ReduceOp) -> Result<()> {
    with_default("all_reduce", |pg| pg.all_reduce(buf, op))
}

/// [`ProcessGroup::broadcast`] on the default group.
pub fn broadcast<T: Element>(buf: &mut [T], root: usize) -> Result<()> {
    with_default("broadcast", |pg| pg.broadcast(buf, root))
}

/// [`ProcessGroup::all_gather_into`] on the default group.
pub fn all_gather_into<T: Element>(input: &[T], output: &mut [T]) -> Result<()> {
    with_default("all_gather", |pg| pg.all_gather_into(input, output))
}

/// [`ProcessGroup::reduce_scatter_into`] on the default group.
pub fn reduce_scatter_into<T: Element>(input: &[T], output: &mut [T], op: ReduceOp) -> Result<()> {
    with_default("reduce_scatter", |pg| {
        pg.reduce_scatter_into(input, output, op)
    })
}

/// [`ProcessGroup::barrier`] on the default group.
pub fn barrier() -> Result<()> {
    with_default("barrier", ProcessGroup::barrier)
}

/// [`ProcessGroup::send`] on the default group.
pub fn send<T: Element>(buf: &[T], dst: usize, tag: u32) -> Result<()> {
    with_default("send", |pg| pg.send(buf, dst, tag))
}

/// [`ProcessGroup::recv`] on the default group.
pub fn recv<T: Element>(buf: &mut [T], src: usize, tag: u32) -> Result<()> {
    with_default("recv", |pg| pg.recv(buf, src, tag))
}

/// [`ProcessGroup::new_group`] on the default group.
pub fn new_group(ranks: &[usize]) -> Result<Option<ProcessGroup>> {
    with_default("new_group", |pg| pg.new_group(ranks))
}
