//! [`InitMethod`] and [`InitOptions`]: torch's keyword arguments of `init_process_group`.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use dist_backend::{DEFAULT_TIMEOUT, Store};

use crate::debug::DebugLevel;

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

/// Options of [`init_process_group`](crate::init_process_group) (torch's keyword arguments), built with chained setters.
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
    pub(super) backend: String,
    pub(super) method: InitMethod,
    pub(super) rank: Option<usize>,
    pub(super) world_size: Option<usize>,
    pub(super) timeout: Duration,
    pub(super) debug: Option<DebugLevel>,
    pub(super) flight_dir: Option<PathBuf>,
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
    /// per group and rank, see [`ProcessGroup::dump_flight_recorder`](crate::ProcessGroup::dump_flight_recorder)), instead of
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
