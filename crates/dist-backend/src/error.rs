//! The one error type of this crate.

use std::fmt;
use std::time::Duration;

use dist_wire::{CollectiveOp, DType, FrameHeader, NO_ROOT, ReduceOp, WireError};

use crate::StoreError;

/// `Result` with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// One rank's view of one operation: `rank 1 all_reduce #12 (f32 × 1000, SUM)`, with every
/// argument that must be the same on all ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OpDesc {
    /// The rank.
    pub rank: usize,
    /// The operation.
    pub op: CollectiveOp,
    /// Its sequence number in the group.
    pub seq: u64,
    /// Element type.
    pub dtype: DType,
    /// Element count.
    pub count: u64,
    /// Reduce op wire code (see [`ReduceOp::code`]), for ops that reduce.
    pub reduce: Option<u8>,
    /// Root rank, for rooted ops.
    pub root: Option<usize>,
    /// Fingerprint of the split sizes ([`dist_wire::splits_fingerprint`]), 0 when none.
    pub splits: u32,
    /// Fingerprint of the reduce op's parameter, `PremulSum`'s scale
    /// ([`ReduceOp::param_fingerprint`]), 0 when none.
    pub reduce_arg: u32,
    /// The algorithm step the rank was in, named only when two ranks met in different
    /// algorithms for the same call (a backend that picks them from local settings), since
    /// every other argument then matches.
    pub step: Option<AlgoStep>,
}

/// One step of a backend's algorithm, as its frames label it: which algorithm, which step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AlgoStep {
    /// The backend's name of the algorithm (`"ring reduce-scatter"`).
    pub algorithm: &'static str,
    /// The label its frames carry (the header's `tag`), naming the step within it.
    pub tag: u32,
}

impl fmt::Display for AlgoStep {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} step {:#x}", self.algorithm, self.tag)
    }
}

impl From<&FrameHeader> for OpDesc {
    fn from(h: &FrameHeader) -> Self {
        OpDesc {
            rank: h.sender as usize,
            op: h.op,
            seq: h.seq,
            dtype: h.dtype,
            count: h.count,
            reduce: h.op.reduces().then_some(h.reduce),
            root: (h.root != NO_ROOT).then_some(h.root as usize),
            splits: h.splits,
            reduce_arg: h.reduce_arg,
            step: None,
        }
    }
}

impl fmt::Display for OpDesc {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "rank {} {} #{} ({} × {}",
            self.rank, self.op, self.seq, self.dtype, self.count
        )?;
        if let Some(code) = self.reduce {
            match ReduceOp::code_name(code) {
                Some(name) => write!(f, ", {name}")?,
                None => write!(f, ", reduce op {code}")?,
            }
        }
        if let Some(root) = self.root {
            write!(f, ", root {root}")?;
        }
        if self.splits != 0 {
            write!(f, ", split sizes #{:08x}", self.splits)?;
        }
        if self.reduce_arg != 0 {
            write!(f, ", scale #{:06x}", self.reduce_arg)?;
        }
        if let Some(step) = self.step {
            write!(f, ", in {step}")?;
        }
        f.write_str(")")
    }
}

/// Everything a backend, a store or init can fail with. Every message names the rank, the
/// operation and what was wrong.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A peer's connection closed or reset during an operation.
    #[error("rank {rank}: peer rank {peer} was lost during {op} #{seq}: {reason}")]
    PeerLost {
        /// This rank.
        rank: usize,
        /// The peer that was lost.
        peer: usize,
        /// The operation in progress.
        op: CollectiveOp,
        /// Its sequence number.
        seq: u64,
        /// What the transport saw (closed by peer, reset, ...).
        reason: String,
    },
    /// Peers did not deliver within the timeout.
    #[error(
        "rank {rank}: {op} #{seq} timed out after {waited:?} waiting for rank(s) {missing_peers:?}"
    )]
    Timeout {
        /// This rank.
        rank: usize,
        /// The operation.
        op: CollectiveOp,
        /// Its sequence number.
        seq: u64,
        /// How long it waited.
        waited: Duration,
        /// Ranks that had not delivered.
        missing_peers: Vec<usize>,
    },
    /// Two ranks called different operations (or the same one with a different dtype, count,
    /// reduce op, root, split sizes or sequence number), as this rank found itself.
    #[error("{ours} met {theirs}")]
    Mismatch {
        /// What this rank called.
        ours: OpDesc,
        /// What the peer called.
        theirs: OpDesc,
    },
    /// Another rank found a mismatch (two ranks calling different operations or passing
    /// different arguments) and aborted the group; this rank learnt it from an abort notice.
    /// `found` (whose `rank` found it) and `met` are the two sides.
    #[error(
        "rank {rank}: {op} #{seq} aborted by a mismatch that rank {reporter} reported: {found} met {met}"
    )]
    MismatchReported {
        /// This rank.
        rank: usize,
        /// The operation this rank was in (or starting) when it heard.
        op: CollectiveOp,
        /// Its sequence number.
        seq: u64,
        /// The rank whose abort notice said so: the one that found it (`found.rank`), or one
        /// that passed its notice on.
        reporter: usize,
        /// One side: what the rank that found the mismatch called.
        found: OpDesc,
        /// The other side: what the rank it disagreed with called.
        met: OpDesc,
    },
    /// The caller passed something invalid.
    #[error("rank {rank}: invalid argument to {op}: {reason}")]
    InvalidArgument {
        /// This rank.
        rank: usize,
        /// The operation.
        op: &'static str,
        /// What was wrong.
        reason: String,
    },
    /// The backend does not serve this operation or buffer kind.
    #[error("rank {rank}: backend {backend} does not support {what}")]
    Unsupported {
        /// This rank.
        rank: usize,
        /// The backend's name.
        backend: &'static str,
        /// What is unsupported.
        what: String,
    },
    /// A reduce op, dtype or frame was rejected by the wire layer.
    #[error("rank {rank}: {op}: {source}")]
    Wire {
        /// This rank.
        rank: usize,
        /// The operation.
        op: &'static str,
        /// The wire error.
        #[source]
        source: WireError,
    },
    /// An earlier operation failed and left the group's connections in an unknown state; the
    /// group must be destroyed and re-created.
    #[error("rank {rank}: {op} refused: the group was aborted by an earlier error: {cause}")]
    Aborted {
        /// This rank.
        rank: usize,
        /// The refused operation.
        op: &'static str,
        /// The first error's message.
        cause: String,
    },
    /// A backend cannot run on this machine: a library it loads at run time (libcuda,
    /// libnccl) is missing or lacks a symbol it needs.
    #[error("backend {backend} is unavailable: {library} could not be loaded: {reason}")]
    Unavailable {
        /// The backend's name.
        backend: &'static str,
        /// The library (`"libcuda"`, `"libnccl"`).
        library: &'static str,
        /// What was tried or what was missing.
        reason: String,
    },
    /// A device backend (NCCL, the CUDA driver) failed. `source` is
    /// that backend's own error (naming the op, its sequence number and the peer state it
    /// knows); downcast it (e.g. to `dist_nccl::Error`) for the details.
    #[error("rank {rank}: backend {backend}: {source}")]
    Device {
        /// This rank.
        rank: usize,
        /// The backend's name.
        backend: &'static str,
        /// The backend's error.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync + 'static>,
    },
    /// The rendezvous store failed.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// A store call this rank made for a larger task (building a backend's connections)
    /// failed: [`Error::Store`] with the rank and the task, added where the task is known.
    #[error("rank {rank}: {context}: {source}")]
    StoreCall {
        /// This rank.
        rank: usize,
        /// What the call was for.
        context: String,
        /// The store's error.
        #[source]
        source: StoreError,
    },
    /// Init could not work out rank, world size or store from the environment or URL.
    #[error("init: {what}")]
    Init {
        /// What was missing or contradictory, naming the variable.
        what: String,
    },
    /// An I/O error outside an operation on a known peer (listening, connecting).
    #[error("rank {rank}: {context}: {source}")]
    Io {
        /// This rank.
        rank: usize,
        /// What was being done.
        context: String,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
}

impl Error {
    /// This error, a bare [`Error::Store`] made into an [`Error::StoreCall`] of `rank` for
    /// `context` (other errors name their rank already).
    pub fn in_store_call(self, rank: usize, context: impl FnOnce() -> String) -> Self {
        match self {
            Error::Store(source) => Error::StoreCall {
                rank,
                context: context(),
                source,
            },
            other => other,
        }
    }

    /// Shorthand for [`Error::InvalidArgument`].
    pub fn invalid(rank: usize, op: &'static str, reason: impl Into<String>) -> Self {
        Error::InvalidArgument {
            rank,
            op,
            reason: reason.into(),
        }
    }
}
