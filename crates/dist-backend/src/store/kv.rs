//! The key-value semantics every store shares (torch's libuv TCPStore server semantics): the
//! in-memory store, the file store's replayed state and the TCP server all use [`Kv`].

use std::collections::{HashMap, VecDeque};

/// Keys and values as bytes, plus the queues of `queue_push`/`queue_pop`.
#[derive(Debug, Default)]
pub(crate) struct Kv {
    data: HashMap<Vec<u8>, Vec<u8>>,
    queues: HashMap<Vec<u8>, VecDeque<Vec<u8>>>,
}

/// `add` found a value that is not a decimal integer.
#[derive(Debug)]
pub(crate) struct NotCounter(pub(crate) Vec<u8>);

/// Parses a counter as torch stores it (decimal ASCII).
pub(crate) fn parse_counter(v: &[u8]) -> Option<i64> {
    std::str::from_utf8(v).ok()?.trim().parse().ok()
}

impl Kv {
    pub(crate) fn set(&mut self, key: &[u8], value: &[u8]) {
        match self.data.get_mut(key) {
            Some(v) => {
                v.clear();
                v.extend_from_slice(value);
            }
            None => {
                self.data.insert(key.to_vec(), value.to_vec());
            }
        }
    }

    pub(crate) fn get(&self, key: &[u8]) -> Option<&[u8]> {
        self.data.get(key).map(Vec::as_slice)
    }

    /// Present as a key, or as a non-empty queue (what WAIT and CHECK look for).
    pub(crate) fn contains(&self, key: &[u8]) -> bool {
        self.data.contains_key(key) || self.queues.get(key).is_some_and(|q| !q.is_empty())
    }

    /// torch's compare-set: a missing key with empty `expected` is set to `desired`; a missing
    /// key with non-empty `expected` returns `expected` unchanged; a present key is swapped when
    /// equal. Returns the value after the operation.
    pub(crate) fn compare_set(&mut self, key: &[u8], expected: &[u8], desired: &[u8]) -> Vec<u8> {
        match self.data.get_mut(key) {
            None if expected.is_empty() => {
                self.data.insert(key.to_vec(), desired.to_vec());
                desired.to_vec()
            }
            None => expected.to_vec(),
            Some(cur) if cur.as_slice() == expected => {
                *cur = desired.to_vec();
                desired.to_vec()
            }
            Some(cur) => cur.clone(),
        }
    }

    /// Adds `delta` to the counter at `key` (created at 0), storing decimal ASCII.
    pub(crate) fn add(&mut self, key: &[u8], delta: i64) -> Result<i64, NotCounter> {
        let cur = match self.data.get(key) {
            Some(v) => parse_counter(v).ok_or_else(|| NotCounter(v.clone()))?,
            None => 0,
        };
        let new = cur.wrapping_add(delta);
        self.data.insert(key.to_vec(), new.to_string().into_bytes());
        Ok(new)
    }

    pub(crate) fn delete(&mut self, key: &[u8]) -> bool {
        self.data.remove(key).is_some()
    }

    pub(crate) fn append(&mut self, key: &[u8], value: &[u8]) {
        match self.data.get_mut(key) {
            Some(v) => v.extend_from_slice(value),
            None => {
                self.data.insert(key.to_vec(), value.to_vec());
            }
        }
    }

    pub(crate) fn num_keys(&self) -> usize {
        self.data.len()
    }

    pub(crate) fn keys(&self) -> impl Iterator<Item = &Vec<u8>> {
        self.data.keys()
    }

    pub(crate) fn queue_push(&mut self, key: &[u8], value: &[u8]) {
        self.queues
            .entry(key.to_vec())
            .or_default()
            .push_back(value.to_vec());
    }

    pub(crate) fn queue_pop(&mut self, key: &[u8]) -> Option<Vec<u8>> {
        let q = self.queues.get_mut(key)?;
        let v = q.pop_front();
        if q.is_empty() {
            self.queues.remove(key);
        }
        v
    }

    pub(crate) fn queue_len(&self, key: &[u8]) -> usize {
        self.queues.get(key).map_or(0, VecDeque::len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn compare_set_quirks() {
        let mut kv = Kv::default();
        assert_eq!(kv.compare_set(b"k", b"x", b"y"), b"x");
        assert!(kv.get(b"k").is_none());
        assert_eq!(kv.compare_set(b"k", b"", b"y"), b"y");
        assert_eq!(kv.compare_set(b"k", b"z", b"w"), b"y");
        assert_eq!(kv.compare_set(b"k", b"y", b"w"), b"w");
        assert_eq!(kv.get(b"k"), Some(&b"w"[..]));
    }

    #[test]
    fn add_stores_decimal() {
        let mut kv = Kv::default();
        assert_eq!(kv.add(b"c", 2).unwrap(), 2);
        assert_eq!(kv.add(b"c", -5).unwrap(), -3);
        assert_eq!(kv.get(b"c"), Some(&b"-3"[..]));
        kv.set(b"s", b"abc");
        assert!(kv.add(b"s", 1).is_err());
    }
}
