//! [`HashStore`]: the in-process store.

use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::error::{key_list, show_value};
use super::kv::Kv;
use super::{Store, StoreError};
use crate::DEFAULT_TIMEOUT;

const ADDR: &str = "memory";

/// A store inside one process (threads share it through an `Arc`), like torch's `HashStore`.
#[derive(Debug)]
pub struct HashStore {
    kv: Mutex<Kv>,
    changed: Condvar,
    timeout: Duration,
}

impl Default for HashStore {
    fn default() -> Self {
        HashStore::new(DEFAULT_TIMEOUT)
    }
}

impl HashStore {
    /// An empty store whose `get`/`wait` wait up to `timeout`.
    pub fn new(timeout: Duration) -> Self {
        HashStore {
            kv: Mutex::new(Kv::default()),
            changed: Condvar::new(),
            timeout,
        }
    }

    fn lock(&self) -> MutexGuard<'_, Kv> {
        // A panic while holding the lock cannot leave `Kv` half-updated in a way that matters
        // more than losing the store, so recover the guard.
        self.kv.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Locks, waits until every key is present (or the deadline passes), and returns the guard.
    fn wait_locked(
        &self,
        op: &'static str,
        keys: &[&str],
        deadline: Instant,
    ) -> Result<MutexGuard<'_, Kv>, StoreError> {
        self.wait_until(op, keys, deadline, |kv| {
            keys.iter().all(|k| kv.contains(k.as_bytes()))
        })
    }

    /// Locks and waits until `ready` holds (or the deadline passes); returns the guard.
    fn wait_until(
        &self,
        op: &'static str,
        keys: &[&str],
        deadline: Instant,
        ready: impl Fn(&Kv) -> bool,
    ) -> Result<MutexGuard<'_, Kv>, StoreError> {
        let start = Instant::now();
        let mut kv = self.lock();
        loop {
            if ready(&kv) {
                return Ok(kv);
            }
            let waited = start.elapsed();
            let left = deadline.saturating_duration_since(Instant::now());
            let Some(left) = Some(left).filter(|d| !d.is_zero()) else {
                return Err(StoreError::Timeout {
                    op,
                    addr: ADDR.to_owned(),
                    keys: key_list(keys),
                    waited,
                });
            };
            kv = self
                .changed
                .wait_timeout(kv, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    fn mutate<T>(&self, f: impl FnOnce(&mut Kv) -> T) -> T {
        let r = f(&mut self.lock());
        self.changed.notify_all();
        r
    }
}

impl Store for HashStore {
    plain_calls_by_deadline!();

    // The in-process store's calls other than waits take a mutex held only for a map
    // operation, so they have nothing to bound by the deadline.

    fn set_by(&self, key: &str, value: &[u8], _: Instant) -> Result<(), StoreError> {
        self.mutate(|kv| kv.set(key.as_bytes(), value));
        Ok(())
    }

    fn get_by(&self, key: &str, deadline: Instant) -> Result<Vec<u8>, StoreError> {
        let kv = self.wait_locked("get", &[key], deadline)?;
        Ok(kv.get(key.as_bytes()).unwrap_or_default().to_vec())
    }

    fn add_by(&self, key: &str, delta: i64, _: Instant) -> Result<i64, StoreError> {
        self.mutate(|kv| kv.add(key.as_bytes(), delta))
            .map_err(|e| StoreError::NotACounter {
                addr: ADDR.to_owned(),
                key: key.to_owned(),
                value: show_value(&e.0),
            })
    }

    fn compare_set_by(
        &self,
        key: &str,
        expected: &[u8],
        desired: &[u8],
        _: Instant,
    ) -> Result<Vec<u8>, StoreError> {
        Ok(self.mutate(|kv| kv.compare_set(key.as_bytes(), expected, desired)))
    }

    fn wait_by(&self, keys: &[&str], deadline: Instant) -> Result<(), StoreError> {
        self.wait_locked("wait", keys, deadline).map(drop)
    }

    fn check_by(&self, keys: &[&str], _: Instant) -> Result<bool, StoreError> {
        let kv = self.lock();
        Ok(keys.iter().all(|k| kv.contains(k.as_bytes())))
    }

    fn delete_key_by(&self, key: &str, _: Instant) -> Result<bool, StoreError> {
        Ok(self.mutate(|kv| kv.delete(key.as_bytes())))
    }

    fn num_keys_by(&self, _: Instant) -> Result<u64, StoreError> {
        Ok(self.lock().num_keys() as u64)
    }

    fn append_by(&self, key: &str, value: &[u8], _: Instant) -> Result<(), StoreError> {
        self.mutate(|kv| kv.append(key.as_bytes(), value));
        Ok(())
    }

    fn multi_get_by(&self, keys: &[&str], deadline: Instant) -> Result<Vec<Vec<u8>>, StoreError> {
        let kv = self.wait_locked("multi_get", keys, deadline)?;
        Ok(keys
            .iter()
            .map(|k| kv.get(k.as_bytes()).unwrap_or_default().to_vec())
            .collect())
    }

    fn multi_set_by(&self, pairs: &[(&str, &[u8])], _: Instant) -> Result<(), StoreError> {
        self.mutate(|kv| {
            for (k, v) in pairs {
                kv.set(k.as_bytes(), v);
            }
        });
        Ok(())
    }

    fn queue_push_by(&self, key: &str, value: &[u8], _: Instant) -> Result<(), StoreError> {
        self.mutate(|kv| kv.queue_push(key.as_bytes(), value));
        Ok(())
    }

    fn queue_pop_by(
        &self,
        key: &str,
        block: bool,
        deadline: Instant,
    ) -> Result<Option<Vec<u8>>, StoreError> {
        if block {
            let mut kv = self.wait_until("queue_pop", &[key], deadline, |kv| {
                kv.queue_len(key.as_bytes()) > 0
            })?;
            Ok(kv.queue_pop(key.as_bytes()))
        } else {
            Ok(self.lock().queue_pop(key.as_bytes()))
        }
    }

    fn queue_len_by(&self, key: &str, _: Instant) -> Result<u64, StoreError> {
        Ok(self.lock().queue_len(key.as_bytes()) as u64)
    }

    fn timeout(&self) -> Duration {
        self.timeout
    }
}
