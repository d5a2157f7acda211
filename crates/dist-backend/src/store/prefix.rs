//! [`PrefixStore`]: a namespace inside another store.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::{Store, StoreError};

/// Wraps a store and puts `prefix/` before every key, as torch's `PrefixStore` does, so that
/// several groups can share one store without their keys colliding.
///
/// `num_keys` is the inner store's (torch does the same).
#[derive(Clone)]
pub struct PrefixStore {
    prefix: String,
    inner: Arc<dyn Store>,
}

impl std::fmt::Debug for PrefixStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PrefixStore")
            .field("prefix", &self.prefix)
            .finish_non_exhaustive()
    }
}

impl PrefixStore {
    /// Keys of this store go to `inner` as `prefix/key`.
    pub fn new(prefix: impl Into<String>, inner: Arc<dyn Store>) -> Self {
        PrefixStore {
            prefix: prefix.into(),
            inner,
        }
    }

    /// The prefix (without the `/`).
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// The wrapped store.
    pub fn inner(&self) -> &Arc<dyn Store> {
        &self.inner
    }

    fn key(&self, key: &str) -> String {
        let mut k = String::with_capacity(self.prefix.len() + 1 + key.len());
        k.push_str(&self.prefix);
        k.push('/');
        k.push_str(key);
        k
    }

    fn keys(&self, keys: &[&str]) -> Vec<String> {
        keys.iter().map(|k| self.key(k)).collect()
    }
}

fn refs(keys: &[String]) -> Vec<&str> {
    keys.iter().map(String::as_str).collect()
}

impl Store for PrefixStore {
    plain_calls_by_deadline!();

    fn set_by(&self, key: &str, value: &[u8], deadline: Instant) -> Result<(), StoreError> {
        self.inner.set_by(&self.key(key), value, deadline)
    }

    fn get_by(&self, key: &str, deadline: Instant) -> Result<Vec<u8>, StoreError> {
        self.inner.get_by(&self.key(key), deadline)
    }

    fn add_by(&self, key: &str, delta: i64, deadline: Instant) -> Result<i64, StoreError> {
        self.inner.add_by(&self.key(key), delta, deadline)
    }

    fn compare_set_by(
        &self,
        key: &str,
        expected: &[u8],
        desired: &[u8],
        deadline: Instant,
    ) -> Result<Vec<u8>, StoreError> {
        self.inner
            .compare_set_by(&self.key(key), expected, desired, deadline)
    }

    fn wait_by(&self, keys: &[&str], deadline: Instant) -> Result<(), StoreError> {
        self.inner.wait_by(&refs(&self.keys(keys)), deadline)
    }

    fn check_by(&self, keys: &[&str], deadline: Instant) -> Result<bool, StoreError> {
        self.inner.check_by(&refs(&self.keys(keys)), deadline)
    }

    fn delete_key_by(&self, key: &str, deadline: Instant) -> Result<bool, StoreError> {
        self.inner.delete_key_by(&self.key(key), deadline)
    }

    fn num_keys_by(&self, deadline: Instant) -> Result<u64, StoreError> {
        self.inner.num_keys_by(deadline)
    }

    fn append_by(&self, key: &str, value: &[u8], deadline: Instant) -> Result<(), StoreError> {
        self.inner.append_by(&self.key(key), value, deadline)
    }

    fn multi_get_by(&self, keys: &[&str], deadline: Instant) -> Result<Vec<Vec<u8>>, StoreError> {
        self.inner.multi_get_by(&refs(&self.keys(keys)), deadline)
    }

    fn multi_set_by(&self, pairs: &[(&str, &[u8])], deadline: Instant) -> Result<(), StoreError> {
        let keys: Vec<String> = pairs.iter().map(|(k, _)| self.key(k)).collect();
        let pairs: Vec<(&str, &[u8])> = keys
            .iter()
            .zip(pairs)
            .map(|(k, (_, v))| (k.as_str(), *v))
            .collect();
        self.inner.multi_set_by(&pairs, deadline)
    }

    fn queue_push_by(&self, key: &str, value: &[u8], deadline: Instant) -> Result<(), StoreError> {
        self.inner.queue_push_by(&self.key(key), value, deadline)
    }

    fn queue_pop_by(
        &self,
        key: &str,
        block: bool,
        deadline: Instant,
    ) -> Result<Option<Vec<u8>>, StoreError> {
        self.inner.queue_pop_by(&self.key(key), block, deadline)
    }

    fn queue_len_by(&self, key: &str, deadline: Instant) -> Result<u64, StoreError> {
        self.inner.queue_len_by(&self.key(key), deadline)
    }

    fn timeout(&self) -> Duration {
        self.inner.timeout()
    }

    fn serves_others(&self) -> bool {
        self.inner.serves_others()
    }
}
