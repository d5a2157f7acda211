//! Store failures.

use std::time::Duration;

/// What a store operation can fail with.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// Keys did not appear in time.
    #[error("store wait timeout after {waited:?}, keys: {keys:?}")]
    Timeout {
        /// Keys waited for.
        keys: Vec<String>,
        /// How long.
        waited: Duration,
    },
    /// I/O with the store failed.
    #[error("store {op} on {addr}: {source}")]
    Io {
        /// The store operation.
        op: &'static str,
        /// Server address or file path.
        addr: String,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
}
