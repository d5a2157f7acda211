//! The one error type of this crate.

/// `Result` with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything DDP can fail with.
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
    /// The communication thread stopped (a hook panicked or the process group was destroyed).
    #[error("rank {rank}: DDP communication thread stopped: {reason}")]
    CommThread {
        /// This rank.
        rank: usize,
        /// Why.
        reason: String,
    },
}
