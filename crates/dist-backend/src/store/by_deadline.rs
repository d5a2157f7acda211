//! `plain_calls_by_deadline!`: the plain [`Store`](super::Store) methods of the stores in this
//! crate, each its `_by` form with the deadline the store's timeout from now. Written once here
//! so that the four stores implement every call once, with a deadline.

/// Expands, inside `impl Store for X`, to the plain methods that have a `_by` form, each
/// calling it with the deadline [`Store::timeout`](super::Store::timeout) from now (`wait`:
/// its own timeout from now).
macro_rules! plain_calls_by_deadline {
    () => {
        fn set(&self, key: &str, value: &[u8]) -> Result<(), $crate::store::StoreError> {
            self.set_by(
                key,
                value,
                $crate::store::deadline_in($crate::store::Store::timeout(self)),
            )
        }
        fn get(&self, key: &str) -> Result<Vec<u8>, $crate::store::StoreError> {
            self.get_by(
                key,
                $crate::store::deadline_in($crate::store::Store::timeout(self)),
            )
        }
        fn add(&self, key: &str, delta: i64) -> Result<i64, $crate::store::StoreError> {
            self.add_by(
                key,
                delta,
                $crate::store::deadline_in($crate::store::Store::timeout(self)),
            )
        }
        fn compare_set(
            &self,
            key: &str,
            expected: &[u8],
            desired: &[u8],
        ) -> Result<Vec<u8>, $crate::store::StoreError> {
            self.compare_set_by(
                key,
                expected,
                desired,
                $crate::store::deadline_in($crate::store::Store::timeout(self)),
            )
        }
        fn wait(
            &self,
            keys: &[&str],
            timeout: std::time::Duration,
        ) -> Result<(), $crate::store::StoreError> {
            self.wait_by(
                keys,
                $crate::deadline_after(std::time::Instant::now(), timeout),
            )
        }
        fn check(&self, keys: &[&str]) -> Result<bool, $crate::store::StoreError> {
            self.check_by(
                keys,
                $crate::store::deadline_in($crate::store::Store::timeout(self)),
            )
        }
        fn delete_key(&self, key: &str) -> Result<bool, $crate::store::StoreError> {
            self.delete_key_by(
                key,
                $crate::store::deadline_in($crate::store::Store::timeout(self)),
            )
        }
        fn num_keys(&self) -> Result<u64, $crate::store::StoreError> {
            self.num_keys_by($crate::store::deadline_in($crate::store::Store::timeout(
                self,
            )))
        }
        fn append(&self, key: &str, value: &[u8]) -> Result<(), $crate::store::StoreError> {
            self.append_by(
                key,
                value,
                $crate::store::deadline_in($crate::store::Store::timeout(self)),
            )
        }
        fn multi_get(&self, keys: &[&str]) -> Result<Vec<Vec<u8>>, $crate::store::StoreError> {
            self.multi_get_by(
                keys,
                $crate::store::deadline_in($crate::store::Store::timeout(self)),
            )
        }
        fn multi_set(&self, pairs: &[(&str, &[u8])]) -> Result<(), $crate::store::StoreError> {
            self.multi_set_by(
                pairs,
                $crate::store::deadline_in($crate::store::Store::timeout(self)),
            )
        }
        fn queue_push(&self, key: &str, value: &[u8]) -> Result<(), $crate::store::StoreError> {
            self.queue_push_by(
                key,
                value,
                $crate::store::deadline_in($crate::store::Store::timeout(self)),
            )
        }
        fn queue_pop(
            &self,
            key: &str,
            block: bool,
        ) -> Result<Option<Vec<u8>>, $crate::store::StoreError> {
            self.queue_pop_by(
                key,
                block,
                $crate::store::deadline_in($crate::store::Store::timeout(self)),
            )
        }
        fn queue_len(&self, key: &str) -> Result<u64, $crate::store::StoreError> {
            self.queue_len_by(
                key,
                $crate::store::deadline_in($crate::store::Store::timeout(self)),
            )
        }
    };
}
