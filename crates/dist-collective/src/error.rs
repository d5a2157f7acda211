//! The one error type of this crate.

use std::time::Duration;

use crate::progress::ProgressReport;

/// `Result` with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything the typed API can fail with.
///
/// Caller mistakes found locally ([`Error::SizeMismatch`], [`Error::InvalidArgument`]) are
/// reported before anything goes on the wire and leave the group usable. Errors from the
/// backend ([`Error::Backend`]) keep their own variant (`PeerLost`, `Mismatch`, ...), except
/// that a collective's `Timeout` comes wrapped in [`Error::CollectiveTimeout`] with every
/// rank's progress: after a peer failure the group's connections are in an unknown state and
/// the group must be destroyed and re-created, as in Gloo.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The backend, store or init failed; the inner error names the rank and operation.
    #[error(transparent)]
    Backend(#[from] dist_backend::Error),
    /// A collective did not complete within the group's timeout. `source` is the backend's
    /// error (naming the peers that did not deliver); `progress` says where every rank of the
    /// group last reported being, so the message names who finished what, e.g. `rank 1
    /// finished all_reduce #4 but did not join #5`.
    #[error("rank {rank}: {op} #{seq} in group {group} timed out ({source})\n{progress}")]
    CollectiveTimeout {
        /// This rank (in the group).
        rank: usize,
        /// The group's name.
        group: String,
        /// The operation.
        op: &'static str,
        /// Its sequence number among the group's collectives (the same on every rank).
        seq: u64,
        /// The backend's timeout.
        #[source]
        source: dist_backend::Error,
        /// Every rank's progress, as last published.
        progress: ProgressReport,
    },
    /// A buffer's length does not match what the operation needs on this rank.
    #[error("rank {rank}: {op}: {what} has {actual} elements but {expected} are needed")]
    SizeMismatch {
        /// This rank (in the group).
        rank: usize,
        /// The operation.
        op: &'static str,
        /// Which buffer or argument (`"output"`, `"output_split_sizes"`, ...).
        what: &'static str,
        /// What the operation needs.
        expected: usize,
        /// What was passed.
        actual: usize,
    },
    /// The caller passed something invalid (a root out of range, a rank not in the group, ...).
    #[error("rank {rank}: invalid argument to {op}: {reason}")]
    InvalidArgument {
        /// This rank (in the group).
        rank: usize,
        /// The operation.
        op: &'static str,
        /// What was wrong.
        reason: String,
    },
    /// A [`ShardLayout`](crate::ShardLayout) or [`Placement`](crate::Placement) that cannot
    /// apply (a shard of a dimension the tensor lacks, one placement too few for the mesh, ...).
    /// Pure layout arithmetic knows no rank; operations on a group report such problems as
    /// [`Error::InvalidArgument`] with the rank.
    #[error("invalid layout: {reason}")]
    InvalidLayout {
        /// What was wrong.
        reason: String,
    },
    /// The default process group is not initialised (call [`crate::init_process_group`]).
    #[error("{op}: the default process group is not initialised; call init_process_group first")]
    NotInitialized {
        /// The operation that needed it.
        op: &'static str,
    },
    /// [`crate::init_process_group`] was called twice without `destroy_process_group`.
    #[error(
        "init_process_group: the default process group is already initialised (rank {rank} of {world_size})"
    )]
    AlreadyInitialized {
        /// Rank of the existing default group.
        rank: usize,
        /// Its world size.
        world_size: usize,
    },
    /// The backend named in [`crate::InitOptions`] is unknown or not compiled in.
    #[error("init_process_group: backend {name:?} is not available (compiled in: {available:?})")]
    UnknownBackend {
        /// The requested name.
        name: String,
        /// The backends this build has.
        available: &'static [&'static str],
    },
    /// The backend string cannot be parsed (torch's syntax: `"gloo"`, `"nccl"`,
    /// `"cpu:gloo,cuda:nccl"`).
    #[error("init_process_group: backend string {spec:?}: {reason}")]
    InvalidBackend {
        /// The string given.
        spec: String,
        /// What is wrong with it.
        reason: String,
    },
    /// Ranks created sub-groups in a different order or with different arguments.
    #[error(
        "rank {rank}: group creation #{index} disagrees: this rank called {ours}, rank {other_rank} called {theirs}"
    )]
    GroupMismatch {
        /// This rank (in the parent group).
        rank: usize,
        /// Index of the creation call in the parent group.
        index: u64,
        /// What this rank called.
        ours: String,
        /// The first rank that disagrees.
        other_rank: usize,
        /// What it called.
        theirs: String,
    },
    /// A [`crate::Work`] did not complete within `wait_timeout`'s limit (the operation itself
    /// goes on; see [`crate::Work`]).
    #[error("rank {rank}: {op} #{seq} not completed after waiting {waited:?}")]
    WaitTimeout {
        /// This rank (in the group).
        rank: usize,
        /// The operation.
        op: &'static str,
        /// Its issue number in the group's flight recorder.
        seq: u64,
        /// How long the caller waited.
        waited: Duration,
    },
    /// `monitored_barrier` found ranks that did not arrive in time.
    #[error(
        "rank {rank}: monitored_barrier #{seq} timed out after {timeout:?}: rank(s) {missing:?} did not arrive"
    )]
    MonitoredBarrier {
        /// This rank (in the group).
        rank: usize,
        /// The barrier's number in the group.
        seq: u64,
        /// The timeout.
        timeout: Duration,
        /// Group ranks that had not arrived (only the first unless `wait_all_ranks`).
        missing: Vec<usize>,
    },
    /// An object could not be serialised or deserialised (object collectives).
    #[error("rank {rank}: {op}: object (de)serialisation failed: {source}")]
    Object {
        /// This rank (in the group).
        rank: usize,
        /// The operation.
        op: &'static str,
        /// The serde_json error.
        #[source]
        source: serde_json::Error,
    },
    /// The rendezvous store failed during a group-level step (sub-group creation, monitored
    /// barrier, point-to-point signalling).
    #[error("rank {rank}: {context}: {source}")]
    Store {
        /// This rank (in the group).
        rank: usize,
        /// What was being done.
        context: String,
        /// The store error.
        #[source]
        source: dist_backend::StoreError,
    },
    /// The group was destroyed (or its worker stopped) before the operation ran.
    #[error("rank {rank}: {op}: the process group was destroyed before the operation completed")]
    Destroyed {
        /// This rank (in the group).
        rank: usize,
        /// The operation.
        op: &'static str,
    },
    /// A rank's closure panicked in [`crate::testing::run_world`].
    #[error("rank {rank} panicked: {message}")]
    RankPanicked {
        /// The rank whose thread panicked.
        rank: usize,
        /// The panic message.
        message: String,
    },
}

impl Error {
    pub(crate) fn invalid(rank: usize, op: &'static str, reason: impl Into<String>) -> Self {
        Error::InvalidArgument {
            rank,
            op,
            reason: reason.into(),
        }
    }

    pub(crate) fn size(
        rank: usize,
        op: &'static str,
        what: &'static str,
        expected: usize,
        actual: usize,
    ) -> Self {
        Error::SizeMismatch {
            rank,
            op,
            what,
            expected,
            actual,
        }
    }

    pub(crate) fn store(
        rank: usize,
        context: impl Into<String>,
        source: dist_backend::StoreError,
    ) -> Self {
        Error::Store {
            rank,
            context: context.into(),
            source,
        }
    }
}
