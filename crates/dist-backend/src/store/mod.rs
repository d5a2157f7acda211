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
//!
//! Every call has a deadline. The plain methods (`set`, `get`, ...) end by the store's timeout
//! from now; their `_by` forms (`set_by`, `get_by`, ...) end by the deadline the caller gives,
//! so that a store call made for a collective or for init keeps that operation's deadline
//! instead of starting a fresh store timeout. Each of the four stores here honours it in
//! everything the call does, not only in waiting for keys: a TCP store's connecting, queueing
//! for a connection, writing and reading, a file store's taking of the file lock.

use std::time::{Duration, Instant};

#[macro_use]
mod by_deadline;
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

/// The instant `timeout` from now (saturating): the deadline of a plain store call.
pub(crate) fn deadline_in(timeout: Duration) -> Instant {
    crate::deadline_after(Instant::now(), timeout)
}

/// A key-value store shared by every rank of a job, used for rendezvous.
///
/// Keys are strings, values bytes. `get`, `wait` and blocking `queue_pop` wait until the keys
/// exist or the store's timeout passes. Counters made by `add` are stored as decimal ASCII, as
/// torch stores them, so `get` on a counter returns e.g. `b"3"`.
///
/// Each method has a `_by` form that ends by a deadline the caller gives instead of the
/// store's timeout from now (see the [module docs](self)). The stores of this crate implement
/// the `_by` forms and derive the plain ones from them; a store implemented elsewhere gets
/// `_by` forms that call its plain methods, which keep only `wait`'s, `get`'s and
/// `multi_get`'s waiting for keys within the deadline, and should override them.
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

    /// [`set`](Store::set), ending by `deadline`.
    fn set_by(&self, key: &str, value: &[u8], deadline: Instant) -> Result<(), StoreError> {
        let _ = deadline;
        self.set(key, value)
    }
    /// [`get`](Store::get), waiting for the key until `deadline`.
    fn get_by(&self, key: &str, deadline: Instant) -> Result<Vec<u8>, StoreError> {
        self.wait_by(&[key], deadline)?;
        self.get(key)
    }
    /// [`add`](Store::add), ending by `deadline`.
    fn add_by(&self, key: &str, delta: i64, deadline: Instant) -> Result<i64, StoreError> {
        let _ = deadline;
        self.add(key, delta)
    }
    /// [`compare_set`](Store::compare_set), ending by `deadline`.
    fn compare_set_by(
        &self,
        key: &str,
        expected: &[u8],
        desired: &[u8],
        deadline: Instant,
    ) -> Result<Vec<u8>, StoreError> {
        let _ = deadline;
        self.compare_set(key, expected, desired)
    }
    /// [`wait`](Store::wait) until `deadline`.
    fn wait_by(&self, keys: &[&str], deadline: Instant) -> Result<(), StoreError> {
        self.wait(keys, deadline.saturating_duration_since(Instant::now()))
    }
    /// [`check`](Store::check), ending by `deadline`.
    fn check_by(&self, keys: &[&str], deadline: Instant) -> Result<bool, StoreError> {
        let _ = deadline;
        self.check(keys)
    }
    /// [`delete_key`](Store::delete_key), ending by `deadline`.
    fn delete_key_by(&self, key: &str, deadline: Instant) -> Result<bool, StoreError> {
        let _ = deadline;
        self.delete_key(key)
    }
    /// [`num_keys`](Store::num_keys), ending by `deadline`.
    fn num_keys_by(&self, deadline: Instant) -> Result<u64, StoreError> {
        let _ = deadline;
        self.num_keys()
    }
    /// [`append`](Store::append), ending by `deadline`.
    fn append_by(&self, key: &str, value: &[u8], deadline: Instant) -> Result<(), StoreError> {
        let _ = deadline;
        self.append(key, value)
    }
    /// [`multi_get`](Store::multi_get), waiting for the keys until `deadline`.
    fn multi_get_by(&self, keys: &[&str], deadline: Instant) -> Result<Vec<Vec<u8>>, StoreError> {
        self.wait_by(keys, deadline)?;
        self.multi_get(keys)
    }
    /// [`multi_set`](Store::multi_set), ending by `deadline`.
    fn multi_set_by(&self, pairs: &[(&str, &[u8])], deadline: Instant) -> Result<(), StoreError> {
        let _ = deadline;
        self.multi_set(pairs)
    }
    /// [`queue_push`](Store::queue_push), ending by `deadline`.
    fn queue_push_by(&self, key: &str, value: &[u8], deadline: Instant) -> Result<(), StoreError> {
        let _ = deadline;
        self.queue_push(key, value)
    }
    /// [`queue_pop`](Store::queue_pop), waiting for an item (when `block`) until `deadline`.
    fn queue_pop_by(
        &self,
        key: &str,
        block: bool,
        deadline: Instant,
    ) -> Result<Option<Vec<u8>>, StoreError> {
        let _ = deadline;
        self.queue_pop(key, block)
    }
    /// [`queue_len`](Store::queue_len), ending by `deadline`.
    fn queue_len_by(&self, key: &str, deadline: Instant) -> Result<u64, StoreError> {
        let _ = deadline;
        self.queue_len(key)
    }
}
