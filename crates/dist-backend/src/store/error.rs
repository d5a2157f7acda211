//! Store failures.

use std::time::Duration;

use dist_wire::WireError;

/// What a store operation can fail with. Every message names the operation, the key(s) and the
/// store's address (`host:port` of a TCP store, the path of a file store, `memory` for a
/// [`HashStore`](super::HashStore)).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// Keys did not appear in time.
    #[error("store {op} on {addr}: wait timeout after {waited:?}, keys: {keys:?}")]
    Timeout {
        /// The store operation (`wait`, `get`, `queue_pop`, ...).
        op: &'static str,
        /// Server address or file path.
        addr: String,
        /// Keys waited for, as the store saw them (with any prefix).
        keys: Vec<String>,
        /// How long.
        waited: Duration,
    },
    /// The server took a request but did not answer it before the call's deadline: its host is
    /// stopped (SIGSTOP, a debugger), hung or overloaded. Unlike [`StoreError::Timeout`] this
    /// says nothing about the keys, and further calls are likely to fail the same way.
    #[error(
        "store {op} on {addr} (keys: {keys:?}): the store server did not answer within {waited:?} \
         (its host may be stopped or hung)"
    )]
    Unresponsive {
        /// The store operation.
        op: &'static str,
        /// Server address.
        addr: String,
        /// Keys of the operation, as the server sees them.
        keys: Vec<String>,
        /// How long the call had been running when it gave up.
        waited: Duration,
    },
    /// A [`FileStore`](super::FileStore) call could not take the file's lock before its
    /// deadline: another process holds it and does not let go (stopped by SIGSTOP or a
    /// debugger, or hung while holding it).
    #[error(
        "store {op} on {addr} (keys: {keys:?}): the store file's lock was still held by another \
         process after {waited:?} (its holder may be stopped or hung)"
    )]
    LockHeld {
        /// The store operation.
        op: &'static str,
        /// The store file, as `file://<path>`.
        addr: String,
        /// Keys of the operation.
        keys: Vec<String>,
        /// How long the call tried to take the lock.
        waited: Duration,
    },
    /// I/O with the store failed.
    #[error("store {op} on {addr} (keys: {keys:?}): {source}")]
    Io {
        /// The store operation.
        op: &'static str,
        /// Server address or file path.
        addr: String,
        /// Keys of the operation (empty when it has none).
        keys: Vec<String>,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// The TCP store server could not bind its listening socket.
    #[error("store server failed to bind to {addr} (errno {errno}: {reason})")]
    Bind {
        /// The address tried last (`0.0.0.0:29500`).
        addr: String,
        /// The OS error number (0 when there was none).
        errno: i32,
        /// The OS error message.
        reason: String,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// A client could not connect to the store server before its timeout.
    #[error(
        "failed to connect to store at {addr} after {attempts} attempt(s) in {waited:?}: {source}"
    )]
    Connect {
        /// The server address.
        addr: String,
        /// Connection attempts made.
        attempts: u32,
        /// How long it tried.
        waited: Duration,
        /// The last error.
        #[source]
        source: std::io::Error,
    },
    /// The server sent bytes that are not the reply expected, or a key or value is too large
    /// to be sent.
    #[error("store {op} on {addr} (keys: {keys:?}): protocol error: {reason}")]
    Protocol {
        /// The store operation.
        op: &'static str,
        /// Server address.
        addr: String,
        /// Keys of the operation.
        keys: Vec<String>,
        /// What was wrong.
        reason: String,
    },
    /// A wire codec error (oversized or malformed message).
    #[error("store {op} on {addr} (keys: {keys:?}): {source}")]
    Wire {
        /// The store operation.
        op: &'static str,
        /// Server address.
        addr: String,
        /// Keys of the operation.
        keys: Vec<String>,
        /// The codec error.
        #[source]
        source: WireError,
    },
    /// `add` on a key whose value is not a decimal integer.
    #[error("store add on {addr}: key {key:?} holds {value:?}, which is not a decimal integer")]
    NotACounter {
        /// Store address.
        addr: String,
        /// The key.
        key: String,
        /// Its value, lossily decoded (at most 64 bytes).
        value: String,
    },
    /// Not every worker joined the store (`init/` counter) before the timeout.
    #[error(
        "store on {addr}: timed out after {waited:?} waiting for clients: {joined}/{expected} clients joined"
    )]
    WorkersMissing {
        /// Server address.
        addr: String,
        /// Clients that joined.
        joined: i64,
        /// Clients expected (the world size).
        expected: usize,
        /// How long the server waited.
        waited: Duration,
    },
    /// A store file holds bytes that are not store records.
    #[error("store {op} on {addr}: corrupt store file at byte {offset}: {source}")]
    Corrupt {
        /// The store operation.
        op: &'static str,
        /// File path.
        addr: String,
        /// Byte offset of the bad record.
        offset: u64,
        /// The codec error.
        #[source]
        source: WireError,
    },
}

impl StoreError {
    /// The operation the error happened in, when it names one.
    pub fn op(&self) -> Option<&'static str> {
        match self {
            StoreError::Timeout { op, .. }
            | StoreError::Unresponsive { op, .. }
            | StoreError::LockHeld { op, .. }
            | StoreError::Io { op, .. }
            | StoreError::Protocol { op, .. }
            | StoreError::Wire { op, .. }
            | StoreError::Corrupt { op, .. } => Some(op),
            StoreError::NotACounter { .. } => Some("add"),
            _ => None,
        }
    }

    /// True for [`StoreError::Timeout`].
    pub fn is_timeout(&self) -> bool {
        matches!(self, StoreError::Timeout { .. })
    }

    /// True when the store itself failed to answer in time ([`StoreError::Unresponsive`],
    /// or [`StoreError::LockHeld`] for a file store) or could not be reached
    /// ([`StoreError::Connect`]): asking it anything else now (which keys are missing, say)
    /// would only wait again.
    pub fn is_unreachable(&self) -> bool {
        matches!(
            self,
            StoreError::Unresponsive { .. }
                | StoreError::LockHeld { .. }
                | StoreError::Connect { .. }
        )
    }
}

/// Keys as owned strings, for error messages.
pub(crate) fn key_list(keys: &[&str]) -> Vec<String> {
    keys.iter().map(|k| (*k).to_owned()).collect()
}

/// A value, lossily decoded and cut to 64 bytes, for error messages.
pub(crate) fn show_value(v: &[u8]) -> String {
    String::from_utf8_lossy(&v[..v.len().min(64)]).into_owned()
}
