//! `Error`, the crate's one error type: every variant names this worker and, where there is
//! one, the peer and the function.

use std::time::Duration;

use dist_backend::StoreError;

use crate::frame::FrameError;

/// What an RPC operation can fail with.
///
/// `worker` is always this process's worker (`"trainer1 (rank 1)"`), `peer` the other end.
/// Failures of the remote function itself ([`Error::Remote`]) are kept apart from failures to
/// reach it ([`Error::Timeout`], [`Error::PeerLost`], [`Error::PeerShutDown`]), as torch keeps a
/// `RemoteException` apart from a failed future.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// `init_rpc` could not learn rank, world size or the store.
    #[error("rpc init of {worker}: {source}")]
    Init {
        /// This worker.
        worker: String,
        /// What init found wrong.
        #[source]
        source: dist_backend::Error,
    },
    /// A rendezvous-store operation failed.
    #[error("rpc {worker}: store {op}: {source}")]
    Store {
        /// This worker.
        worker: String,
        /// What the store was used for.
        op: &'static str,
        /// The store's error.
        #[source]
        source: StoreError,
    },
    /// Socket I/O with a peer (or the listener) failed.
    #[error("rpc {worker}: {op} with {peer}: {source}")]
    Io {
        /// This worker.
        worker: String,
        /// The peer (or `"listener"`).
        peer: String,
        /// What was being done.
        op: &'static str,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// A caller mistake: a bad option, a duplicate name, an RRef used on the wrong worker.
    #[error("rpc {worker}: {op}: {what}")]
    InvalidArgument {
        /// This worker.
        worker: String,
        /// The operation.
        op: &'static str,
        /// What was wrong.
        what: String,
    },
    /// No worker has this name or rank.
    #[error("rpc {worker}: no worker {name} (workers: {known})")]
    UnknownWorker {
        /// This worker.
        worker: String,
        /// The name or rank asked for.
        name: String,
        /// The workers there are.
        known: String,
    },
    /// The remote function returned an error or panicked.
    #[error("rpc {worker}: {func} on {peer} {}: {message}", if *.panicked { "panicked" } else { "failed" })]
    Remote {
        /// This worker.
        worker: String,
        /// The worker that ran the function.
        peer: String,
        /// The function.
        func: String,
        /// The handler's error message or panic payload.
        message: String,
        /// Whether it panicked.
        panicked: bool,
    },
    /// The peer has no function of this name.
    #[error("rpc {worker}: {peer} has no function named {func:?}")]
    UnknownFunction {
        /// This worker.
        worker: String,
        /// The callee.
        peer: String,
        /// The name called.
        func: String,
    },
    /// The peer could not decode the arguments into its handler's argument type.
    #[error("rpc {worker}: {peer} could not decode the arguments of {func}: {reason}")]
    BadArguments {
        /// This worker.
        worker: String,
        /// The callee.
        peer: String,
        /// The function.
        func: String,
        /// The decoder's message on the callee.
        reason: String,
    },
    /// The peer could not encode its handler's result.
    #[error("rpc {worker}: {peer} could not encode the result of {func}: {reason}")]
    BadResult {
        /// This worker.
        worker: String,
        /// The callee.
        peer: String,
        /// The function.
        func: String,
        /// The encoder's message on the callee.
        reason: String,
    },
    /// Encoding arguments or decoding a result failed on this worker.
    #[error("rpc {worker}: {what} of {func} (with {peer}): {source}")]
    Codec {
        /// This worker.
        worker: String,
        /// The other end.
        peer: String,
        /// The function.
        func: String,
        /// `"encoding the arguments"`, `"decoding the result"`, ...
        what: &'static str,
        /// The serde error.
        #[source]
        source: serde_json::Error,
    },
    /// The call did not complete within its timeout.
    #[error("rpc {worker}: {func} on {peer} (call #{call_id}) timed out after {timeout:?}")]
    Timeout {
        /// This worker.
        worker: String,
        /// The callee.
        peer: String,
        /// The function.
        func: String,
        /// The call's id on this worker.
        call_id: u64,
        /// The call's timeout.
        timeout: Duration,
    },
    /// The connection to the peer broke without a goodbye: it crashed or was killed.
    #[error("rpc {worker}: {peer} was lost during {func}: {reason}")]
    PeerLost {
        /// This worker.
        worker: String,
        /// The lost worker.
        peer: String,
        /// The function (or `"shutdown"`).
        func: String,
        /// What the connection said.
        reason: String,
    },
    /// The peer has shut down RPC: it takes no more calls.
    #[error("rpc {worker}: {func}: {peer} has shut down")]
    PeerShutDown {
        /// This worker.
        worker: String,
        /// The worker that shut down.
        peer: String,
        /// The function called.
        func: String,
    },
    /// This worker has shut down RPC.
    #[error("rpc {worker}: {op} after shutdown")]
    ShutDown {
        /// This worker.
        worker: String,
        /// The operation attempted.
        op: String,
    },
    /// A peer sent a malformed frame.
    #[error("rpc {worker}: malformed frame from {peer}: {source}")]
    Protocol {
        /// This worker.
        worker: String,
        /// The sender.
        peer: String,
        /// What was wrong.
        #[source]
        source: FrameError,
    },
    /// An RRef operation failed (its owner deleted it, it is used on the wrong worker, its
    /// value has another type).
    #[error("rpc {worker}: RRef {rref} owned by {owner}: {what}")]
    RRef {
        /// This worker.
        worker: String,
        /// The RRef id.
        rref: String,
        /// Its owner.
        owner: String,
        /// What went wrong.
        what: String,
    },
    /// Graceful shutdown did not see every worker finish within its timeout.
    #[error("rpc {worker}: shutdown timed out after {timeout:?} waiting for {waiting_for}")]
    ShutdownTimeout {
        /// This worker.
        worker: String,
        /// What it was waiting for.
        waiting_for: String,
        /// The shutdown timeout.
        timeout: Duration,
    },
}

/// `Result` with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;
