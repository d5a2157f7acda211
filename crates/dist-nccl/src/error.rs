//! The one error type of this crate.

use std::time::Duration;

/// `Result` with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything NCCL, the CUDA driver or the watchdog can fail with. Each message names the
/// rank (where one is known), the operation and what went wrong.
///
/// [`crate::NcclBackend`]'s `Backend` methods return these wrapped in
/// [`dist_backend::Error::Device`] (never stringified), so callers can downcast to them.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A library the backend loads at run time is missing, or lacks a symbol it needs.
    #[error("backend nccl is unavailable: {library} could not be loaded: {reason}")]
    Unavailable {
        /// `"libcuda"` (the CUDA driver) or `"libnccl"`.
        library: &'static str,
        /// What was tried or what was missing.
        reason: String,
    },
    /// A CUDA driver call failed.
    #[error("rank {rank}: {op}: CUDA driver call {call} failed: {code}")]
    Cuda {
        /// This rank.
        rank: usize,
        /// The operation being served.
        op: &'static str,
        /// The driver function.
        call: &'static str,
        /// The driver's error name (`CUDA_ERROR_...`).
        code: String,
    },
    /// An NCCL call returned an error.
    #[error("rank {rank}: {op} #{seq}: {call} failed: {code}")]
    Nccl {
        /// This rank.
        rank: usize,
        /// The operation.
        op: &'static str,
        /// Its sequence number in the group (0 for set-up calls).
        seq: u64,
        /// The NCCL function.
        call: &'static str,
        /// The result code's name (`ncclRemoteError`, ...).
        code: String,
    },
    /// The watchdog aborted the communicator: an operation outran its timeout, or NCCL reported
    /// an asynchronous error. Every operation pending then, and every later one, fails with it.
    #[error(
        "rank {rank}: {op} #{seq} failed: the communicator was aborted because {cause}; {peers}"
    )]
    CommAborted {
        /// This rank.
        rank: usize,
        /// The operation that fails with it.
        op: &'static str,
        /// Its sequence number.
        seq: u64,
        /// Why the watchdog aborted (the first failure, with its own op and seq).
        cause: AbortCause,
        /// What is known about the peers (NCCL hides which peer stalled; the last op every
        /// rank completed is in the group's progress report).
        peers: String,
    },
    /// The backend was closed (`Backend::close`, group teardown); later operations fail.
    #[error("rank {rank}: the nccl backend was closed")]
    Closed {
        /// This rank.
        rank: usize,
    },
    /// The caller passed something the backend cannot serve (host memory to NCCL, I16 to a
    /// reduction, a bitwise reduce op, a buffer on another device than the communicator's).
    #[error("rank {rank}: {op}: {reason}")]
    Unsupported {
        /// This rank.
        rank: usize,
        /// The operation.
        op: &'static str,
        /// What is unsupported.
        reason: String,
    },
}

/// Why a communicator was aborted: the watchdog's first finding, kept (sticky) for every
/// later error.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum AbortCause {
    /// An operation did not complete on the GPU within its timeout.
    #[error("{op} #{seq} did not complete within {timeout:?}")]
    Timeout {
        /// The operation that timed out.
        op: &'static str,
        /// Its sequence number.
        seq: u64,
        /// Its timeout.
        timeout: Duration,
    },
    /// `ncclCommGetAsyncError` reported an error (a peer died, a network failure).
    #[error("NCCL reported {code} while {op} #{seq} was pending")]
    AsyncError {
        /// The result code's name.
        code: String,
        /// The oldest pending operation.
        op: &'static str,
        /// Its sequence number.
        seq: u64,
    },
    /// The backend was closed (or dropped) with operations still pending.
    #[error("the backend was closed")]
    Closed,
    /// An operation's NCCL calls were enqueued but its end event could not be recorded or
    /// waited for, so nothing would order it with the caller's stream or see it finish.
    #[error("{op} #{seq} was enqueued but could not be fenced: {error}")]
    Unfenced {
        /// The operation.
        op: &'static str,
        /// Its sequence number.
        seq: u64,
        /// The CUDA failure, as reported.
        error: String,
    },
}

impl Error {
    /// This error as the `Backend` trait's (what `dist-collective` reports): `Unavailable`
    /// and `Unsupported` become dist-backend's own variants, field by field; every other error
    /// is kept whole as the source of [`dist_backend::Error::Device`]. `rank` names this rank
    /// where the error does not.
    pub fn into_backend(self, rank: usize) -> dist_backend::Error {
        match self {
            Error::Unavailable { library, reason } => dist_backend::Error::Unavailable {
                backend: "nccl",
                library,
                reason,
            },
            Error::Unsupported { rank, reason, .. } => dist_backend::Error::Unsupported {
                rank,
                backend: "nccl",
                what: reason,
            },
            other => dist_backend::Error::Device {
                rank,
                backend: "nccl",
                source: Box::new(other),
            },
        }
    }
}
