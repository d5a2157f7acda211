//! [`ProcessGroup`]: a set of ranks with its own connections, worker thread and flight recorder.
//!
//! This file holds the type and its life cycle (accessors, the flight recorder, teardown); the
//! rest of the group lives in one file per job:
//!
//! * `connect.rs`: creating a group (its backends, threads and the agreement that every rank
//!   finished connecting);
//! * `run.rs`: how an operation runs in its place in the group's order, and what it leaves in
//!   the flight recorder, the progress table and the logs;
//! * `fingerprint.rs`: the `DIST_DEBUG=DETAIL` cross-rank check of each collective's arguments;
//! * `check.rs`: the local argument checks (ranks, lengths, reduce ops);
//! * `collectives.rs`: the typed collectives;
//! * `point_to_point.rs`: `send`/`recv` and their batched and background forms.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::Sender;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use dist_backend::Store;

use crate::debug::{DebugLevel, FailureDump, FlightEntry, FlightRecorder, dump_json};
use crate::exec::Exec;
use crate::p2p::P2pQueue;
use crate::progress::Progress;

mod check;
mod collectives;
mod connect;
mod fingerprint;
mod point_to_point;
mod run;

pub(crate) use check::{checked_sum, wire_error};
pub(crate) use collectives::split_by;
pub(crate) use fingerprint::fingerprint;
pub use point_to_point::P2pOp;

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
    p2p: Mutex<Option<P2pQueue>>,
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
    /// Operations issued afterwards fail with [`Error::Destroyed`](crate::Error::Destroyed).
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
/// (see [`Work`](crate::Work)). Point-to-point operations run on a separate engine with its own connections
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

impl ProcessGroup {
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
}
