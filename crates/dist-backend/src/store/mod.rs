//! The rendezvous key-value store (torch's c10d `Store`).
//!
//! Four implementations of [`Store`]:
//!
//! * [`HashStore`]: in one process (`Mutex` + `Condvar`);
//! * [`PrefixStore`]: wraps another store and puts `prefix/` before every key;
//! * [`FileStore`]: processes of one host sharing a file (an append-only record log guarded by
//!   `flock`);
//! * [`TcpStore`] (client) and [`TcpStoreServer`]: PyTorch's TCPStore protocol, byte for byte, so
//!   a torch job and a `dist` job can share one store. The server is one `mio` event loop thread.

use std::time::{Duration, Instant};

mod error;
mod file;
mod hash;
mod kv;
mod prefix;
mod tcp;

pub use error::StoreError;
pub use file::FileStore;
pub use hash::HashStore;
pub use prefix::PrefixStore;
pub use tcp::{ServerLimits, TcpStore, TcpStoreOptions, TcpStoreServer};

/// The instant `d` from now, or `None` (no deadline) when that is past what an [`Instant`] can
/// hold: `Duration::MAX` means "no timeout", and `Instant::now() + d` would panic on it.
pub(crate) fn optional_deadline(d: Duration) -> Option<Instant> {
    Instant::now().checked_add(d)
}

/// A key-value store shared by every rank of a job, used for rendezvous.
///
/// Keys are strings, values bytes. `get`, `wait` and blocking `queue_pop` wait until the keys
/// exist or the store's timeout passes. Counters made by `add` are stored as decimal ASCII, as
/// torch stores them, so `get` on a counter returns e.g. `b"3"`.
pub trait Store: Send + Sync {
    /// Sets `key` to `value`, waking any waiter on it.
    fn set(&self, key: &str, value: &[u8]) -> Result<(), StoreError>;
    /// Returns the value of `key`, waiting up to the store's timeout for it to exist.
    fn get(&self, key: &str) -> Result<Vec<u8>, StoreError>;
    /// Adds `delta` to the counter at `key` (created at 0) and returns the new value.
    fn add(&self, key: &str, delta: i64) -> Result<i64, StoreError>;
    /// Sets `key` to `desired` if its value is `expected` (or if it is missing and `expected` is
    /// empty); returns the value after the operation.
    fn compare_set(
        &self,
        key: &str,
        expected: &[u8],
        desired: &[u8],
    ) -> Result<Vec<u8>, StoreError>;
    /// Waits until every key exists, or fails after `timeout`.
    fn wait(&self, keys: &[&str], timeout: Duration) -> Result<(), StoreError>;
    /// True when every key exists; does not wait.
    fn check(&self, keys: &[&str]) -> Result<bool, StoreError>;
    /// Deletes `key`; true when it existed.
    fn delete_key(&self, key: &str) -> Result<bool, StoreError>;
    /// Number of keys in the store.
    fn num_keys(&self) -> Result<u64, StoreError>;
    /// Appends `value` to `key`'s value, creating it if missing.
    fn append(&self, key: &str, value: &[u8]) -> Result<(), StoreError>;
    /// `get` of several keys at once, in order.
    fn multi_get(&self, keys: &[&str]) -> Result<Vec<Vec<u8>>, StoreError>;
    /// `set` of several keys at once.
    fn multi_set(&self, pairs: &[(&str, &[u8])]) -> Result<(), StoreError>;
    /// Pushes `value` at the back of the queue at `key`.
    fn queue_push(&self, key: &str, value: &[u8]) -> Result<(), StoreError>;
    /// Pops the front of the queue at `key`; when `block` is true, waits up to the store's
    /// timeout for an item, otherwise returns `None` at once if it is empty.
    fn queue_pop(&self, key: &str, block: bool) -> Result<Option<Vec<u8>>, StoreError>;
    /// Number of items in the queue at `key`.
    fn queue_len(&self, key: &str) -> Result<u64, StoreError>;
    /// The timeout of `get`, `wait` without an explicit timeout and blocking `queue_pop`.
    fn timeout(&self) -> Duration;
    /// Whether this handle hosts the server other processes reach the store through (the
    /// master of a TCP store), so that dropping it or exiting cuts them off: its owner must
    /// keep it until every rank has left (see `dist-collective`'s teardown).
    fn serves_others(&self) -> bool {
        false
    }
}
