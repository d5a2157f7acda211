//! [`PrefixStore`]: a namespace inside another store.

use std::sync::Arc;
use std::time::Duration;

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
    fn set(&self, key: &str, value: &[u8]) -> Result<(), StoreError> {
        self.inner.set(&self.key(key), value)
    }

    fn get(&self, key: &str) -> Result<Vec<u8>, StoreError> {
        self.inner.get(&self.key(key))
    }

    fn add(&self, key: &str, delta: i64) -> Result<i64, StoreError> {
        self.inner.add(&self.key(key), delta)
    }

    fn compare_set(
        &self,
        key: &str,
        expected: &[u8],
        desired: &[u8],
    ) -> Result<Vec<u8>, StoreError> {
        self.inner.compare_set(&self.key(key), expected, desired)
    }

    fn wait(&self, keys: &[&str], timeout: Duration) -> Result<(), StoreError> {
        self.inner.wait(&refs(&self.keys(keys)), timeout)
    }

    fn check(&self, keys: &[&str]) -> Result<bool, StoreError> {
        self.inner.check(&refs(&self.keys(keys)))
    }

    fn delete_key(&self, key: &str) -> Result<bool, StoreError> {
        self.inner.delete_key(&self.key(key))
    }

    fn num_keys(&self) -> Result<u64, StoreError> {
        self.inner.num_keys()
    }

    fn append(&self, key: &str, value: &[u8]) -> Result<(), StoreError> {
        self.inner.append(&self.key(key), value)
    }

    fn multi_get(&self, keys: &[&str]) -> Result<Vec<Vec<u8>>, StoreError> {
        self.inner.multi_get(&refs(&self.keys(keys)))
    }

    fn multi_set(&self, pairs: &[(&str, &[u8])]) -> Result<(), StoreError> {
        let keys: Vec<String> = pairs.iter().map(|(k, _)| self.key(k)).collect();
        let pairs: Vec<(&str, &[u8])> = keys
            .iter()
            .zip(pairs)
            .map(|(k, (_, v))| (k.as_str(), *v))
            .collect();
        self.inner.multi_set(&pairs)
    }

    fn queue_push(&self, key: &str, value: &[u8]) -> Result<(), StoreError> {
        self.inner.queue_push(&self.key(key), value)
    }

    fn queue_pop(&self, key: &str, block: bool) -> Result<Option<Vec<u8>>, StoreError> {
        self.inner.queue_pop(&self.key(key), block)
    }

    fn queue_len(&self, key: &str) -> Result<u64, StoreError> {
        self.inner.queue_len(&self.key(key))
    }

    fn timeout(&self) -> Duration {
        self.inner.timeout()
    }

    fn serves_others(&self) -> bool {
        self.inner.serves_others()
    }
}
