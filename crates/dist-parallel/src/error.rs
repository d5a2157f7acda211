//! The one error type of this crate.

/// `Result` with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

use crate::pipeline::{Action, StageError};

/// Everything DDP and pipelines can fail with.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A collective failed; the inner error names the rank and operation.
    #[error(transparent)]
    Collective(#[from] dist_collective::Error),
    /// Parameters received no gradient in a step while `find_unused_parameters` is off.
    #[error(
        "rank {rank}: DDP: parameter(s) {names:?} received no gradient in this step; set \
         find_unused_parameters=true if the model has parameters that do not take part in \
         every forward pass"
    )]
    UnusedParameters {
        /// This rank.
        rank: usize,
        /// The parameters' names.
        names: Vec<String>,
    },
    /// The caller passed something inconsistent with the parameter list.
    #[error("rank {rank}: DDP {op}: {reason}")]
    InvalidArgument {
        /// This rank.
        rank: usize,
        /// The DDP call.
        op: &'static str,
        /// What was wrong.
        reason: String,
    },
    /// A tensor-parallel layer, parallelize plan or SyncBatchNorm got input it cannot use (a
    /// shape that does not match, a feature count not divisible as the plan needs, ...).
    #[error("rank {rank}: {op}: {reason}")]
    InvalidInput {
        /// This rank.
        rank: usize,
        /// The layer call (`"SyncBatchNorm::forward"`, `"ColwiseLinear::new"`, ...).
        op: &'static str,
        /// What was wrong.
        reason: String,
    },
    /// candle failed while building or reading a tensor (feature `candle`).
    #[cfg(feature = "candle")]
    #[error("candle: {0}")]
    Candle(#[from] candle_core::Error),
    /// The communication thread stopped (a hook panicked or the process group was destroyed).
    #[error("rank {rank}: DDP communication thread stopped: {reason}")]
    CommThread {
        /// This rank.
        rank: usize,
        /// Why.
        reason: String,
    },
    /// A pipeline schedule is malformed: the action at `position` of rank `rank`'s list is
    /// wrong (for a missing action, `position` is the end of the list of the rank that should
    /// run it). Found before anything runs.
    #[error(
        "invalid pipeline schedule: rank {rank}, position {position}, action {action}: {reason}"
    )]
    InvalidSchedule {
        /// The rank whose list is wrong.
        rank: usize,
        /// Index in that rank's list.
        position: usize,
        /// The wrong (or missing) action.
        action: Action,
        /// What is wrong with it.
        reason: String,
    },
    /// A schedule generator or the simulator got impossible sizes or costs.
    #[error("pipeline schedule {schedule}: {reason}")]
    ScheduleConfig {
        /// The generator or function.
        schedule: &'static str,
        /// What was wrong.
        reason: String,
    },
    /// Ranks disagree at pipeline set-up (schedule, stage count or sizes); every rank fails.
    #[error("rank {rank}: pipeline set-up: {reason}")]
    PipelineSetup {
        /// This rank.
        rank: usize,
        /// What disagrees, naming the rank at fault.
        reason: String,
    },
    /// Moving a pipeline step's activations or gradients failed; `source` names the peer
    /// (see [`Error::failed_rank`]).
    #[error("rank {rank}: pipeline step {step}, position {position} ({action}): {what}: {source}")]
    Pipeline {
        /// This rank.
        rank: usize,
        /// The step (counted from 0 by this pipeline).
        step: u64,
        /// Index of the action in this rank's list.
        position: usize,
        /// The action.
        action: Action,
        /// What it was doing.
        what: &'static str,
        /// The collective error.
        #[source]
        source: dist_collective::Error,
    },
    /// A stage or loss function of this rank failed.
    #[error(
        "rank {rank}: pipeline step {step}, position {position} ({action}): stage failed: {source}"
    )]
    Stage {
        /// This rank.
        rank: usize,
        /// The step.
        step: u64,
        /// Index of the action in this rank's list.
        position: usize,
        /// The action.
        action: Action,
        /// The stage's error.
        #[source]
        source: StageError,
    },
    /// An FSDP call got input inconsistent with the units it was built with (`tensor` names
    /// the parameter or unit at fault).
    #[error("rank {rank}: FSDP {op}: {tensor}: {reason}")]
    Fsdp {
        /// This rank.
        rank: usize,
        /// The FSDP call.
        op: &'static str,
        /// The parameter or unit concerned.
        tensor: String,
        /// What was wrong.
        reason: String,
    },
    /// A checkpoint could not be saved or loaded: a tensor missing from the index or the
    /// model, a shape or dtype that does not match, slices that do not cover a tensor.
    #[error("rank {rank}: checkpoint {op}: tensor {tensor:?}: {reason}")]
    Checkpoint {
        /// This rank.
        rank: usize,
        /// `"save"` or `"load"`.
        op: &'static str,
        /// The tensor concerned (empty when the problem is the checkpoint as a whole).
        tensor: String,
        /// What was wrong.
        reason: String,
    },
    /// Reading or writing a checkpoint file failed.
    #[error("rank {rank}: checkpoint {op}: tensor {tensor:?}: {path}: {source}")]
    CheckpointIo {
        /// This rank.
        rank: usize,
        /// `"save"` or `"load"`.
        op: &'static str,
        /// The tensor being read or written (empty for the index and whole files).
        tensor: String,
        /// The file.
        path: std::path::PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// A candle operation of the FSDP adapter failed.
    #[cfg(feature = "candle")]
    #[error("rank {rank}: FSDP {op}: {tensor}: candle: {source}")]
    FsdpCandle {
        /// This rank.
        rank: usize,
        /// The adapter call.
        op: &'static str,
        /// The parameter or unit concerned.
        tensor: String,
        /// Candle's error.
        #[source]
        source: candle_core::Error,
    },
    /// An optimizer step got slices of different lengths (a local computation: no rank).
    #[error("optimizer {op}: {reason}")]
    Optimizer {
        /// The optimizer call.
        op: &'static str,
        /// What was wrong.
        reason: String,
    },
    /// The safetensors crate refused to write a shard file.
    #[error("rank {rank}: checkpoint save: {path}: {source}")]
    Safetensors {
        /// This rank.
        rank: usize,
        /// The file.
        path: std::path::PathBuf,
        /// The crate's error.
        #[source]
        source: safetensors::SafeTensorError,
    },
}

impl Error {
    /// The rank whose failure caused this error, when it is known: this rank for a failed
    /// stage; the lost peer for a communication error (gloo passes the original culprit
    /// along, so a rank two hops away still names the rank that died); the first peer that
    /// did not deliver for a timeout.
    pub fn failed_rank(&self) -> Option<usize> {
        match self {
            Error::Stage { rank, .. } => Some(*rank),
            Error::Pipeline { source, .. } | Error::Collective(source) => culprit(source),
            _ => None,
        }
    }
}

fn culprit(e: &dist_collective::Error) -> Option<usize> {
    use dist_backend::Error as B;
    use dist_collective::Error as C;
    match e {
        C::Backend(B::PeerLost { peer, .. }) => Some(*peer),
        C::Backend(B::Timeout { missing_peers, .. })
        | C::CollectiveTimeout {
            source: B::Timeout { missing_peers, .. },
            ..
        } => missing_peers.first().copied(),
        _ => None,
    }
}
