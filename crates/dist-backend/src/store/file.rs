//! [`FileStore`]: processes of one host sharing a file.
//!
//! The file is an append-only log of records, each encoded like the TCPStore request that has
//! the same effect (`SET`, `APPEND`, `DELETE_KEY`, `MULTI_SET`, `QUEUE_PUSH`, `QUEUE_POP`), so
//! the store reuses [`dist_wire::store`]'s codec. Every handle keeps the state replayed so far
//! and the offset it has read to:
//!
//! * a read takes a shared `flock` on the file (only when the file has grown since the last
//!   read), replays the new records and answers from memory;
//! * a write takes an exclusive `flock`, replays what others appended, computes its records
//!   from the up-to-date state (an `add` writes the new absolute value), and appends them in one
//!   `write`. Readers never see a half-written record, because writers hold the lock while they
//!   write; a record torn by a crashed writer is cut off by the next writer.
//! * `wait`/`get` poll the file's length with a short backoff (1 ms, growing to 16 ms).
//!
//! The log is never compacted: rendezvous writes few, small keys.

use std::fs::{File, OpenOptions};
use std::io::{self, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use dist_wire::WireError;
use dist_wire::store::{Limits, Request};

use super::error::{key_list, show_value};
use super::kv::Kv;
use super::{Store, StoreError};

/// Limits of records in the file: larger than the TCP protocol's, but still checked so that a
/// corrupt length cannot make a reader buffer the whole disk.
const FILE_LIMITS: Limits = Limits {
    max_key_len: 1 << 20,
    max_value_len: 1 << 32,
    max_list_len: 1 << 24,
    max_message_len: u64::MAX,
};

/// A store shared through a file by the processes of one host, like torch's `FileStore`.
#[derive(Debug)]
pub struct FileStore {
    path: PathBuf,
    addr: String,
    timeout: Duration,
    state: Mutex<State>,
}

#[derive(Debug)]
struct State {
    file: File,
    kv: Kv,
    /// Bytes of the file replayed into `kv`.
    offset: u64,
}

/// Unlocks the file on drop.
struct Flock<'a>(&'a File);

impl Drop for Flock<'_> {
    fn drop(&mut self) {
        // Closing the handle would release the lock too; an unlock error leaves nothing to do.
        let _ = self.0.unlock();
    }
}

impl FileStore {
    /// Opens (creating if missing) the store file at `path`; `get`/`wait` wait up to `timeout`.
    pub fn new(path: impl AsRef<Path>, timeout: Duration) -> Result<Self, StoreError> {
        let path = path.as_ref().to_path_buf();
        let addr = format!("file://{}", path.display());
        let file = OpenOptions::new()
            .read(true)
            .append(true)
            .create(true)
            .open(&path)
            .map_err(|source| StoreError::Io {
                op: "open",
                addr: addr.clone(),
                keys: Vec::new(),
                source,
            })?;
        Ok(FileStore {
            path,
            addr,
            timeout,
            state: Mutex::new(State {
                file,
                kv: Kv::default(),
                offset: 0,
            }),
        })
    }

    /// The path of the store file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    fn io(&self, op: &'static str, keys: &[&str], source: io::Error) -> StoreError {
        StoreError::Io {
            op,
            addr: self.addr.clone(),
            keys: key_list(keys),
            source,
        }
    }

    fn lock_state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Replays records appended since the last call. With `exclusive`, a torn record at the end
    /// (a writer crashed mid-write) is cut off so that new records follow a valid one.
    fn catch_up(
        &self,
        file: &File,
        kv: &mut Kv,
        offset: &mut u64,
        op: &'static str,
        keys: &[&str],
        exclusive: bool,
    ) -> Result<(), StoreError> {
        let len = file.metadata().map_err(|e| self.io(op, keys, e))?.len();
        if len < *offset {
            // The file was truncated or replaced by someone else: start over.
            *kv = Kv::default();
            *offset = 0;
        }
        if len == *offset {
            return Ok(());
        }
        let mut buf = Vec::with_capacity((len - *offset) as usize);
        let mut reader = file;
        reader
            .seek(SeekFrom::Start(*offset))
            .map_err(|e| self.io(op, keys, e))?;
        reader
            .take(len - *offset)
            .read_to_end(&mut buf)
            .map_err(|e| self.io(op, keys, e))?;
        let mut pos = 0;
        let result = loop {
            match Request::decode(&buf[pos..], &FILE_LIMITS) {
                Ok(Some((rec, used))) => {
                    if let Err(e) = apply(kv, &rec) {
                        break Err((pos, e));
                    }
                    pos += used;
                }
                Ok(None) => break Ok(()),
                Err(e) => break Err((pos, e)),
            }
        };
        let at = *offset + pos as u64;
        *offset = at;
        if let Err((_, source)) = result {
            return Err(StoreError::Corrupt {
                op,
                addr: self.addr.clone(),
                offset: at,
                source,
            });
        }
        if exclusive && pos < buf.len() {
            tracing::warn!(
                path = %self.path.display(),
                offset = at,
                "file store: cutting off a torn record left by a crashed writer"
            );
            file.set_len(at).map_err(|e| self.io(op, keys, e))?;
        }
        Ok(())
    }

    /// Brings the state up to date and runs `f` on it.
    fn read<T>(
        &self,
        op: &'static str,
        keys: &[&str],
        f: impl FnOnce(&Kv) -> T,
    ) -> Result<T, StoreError> {
        let mut st = self.lock_state();
        self.refresh(&mut st, op, keys)?;
        Ok(f(&st.kv))
    }

    /// Replays new records under a shared lock; skips the lock when the file has not grown.
    fn refresh(&self, st: &mut State, op: &'static str, keys: &[&str]) -> Result<(), StoreError> {
        let State { file, kv, offset } = st;
        let len = file.metadata().map_err(|e| self.io(op, keys, e))?.len();
        if len == *offset {
            return Ok(());
        }
        file.lock_shared().map_err(|e| self.io(op, keys, e))?;
        let _unlock = Flock(file);
        self.catch_up(file, kv, offset, op, keys, false)
    }

    /// Runs `f` on the up-to-date state under the exclusive lock; `f` mutates the state and
    /// returns the records to append, which are written before the lock is released.
    fn write<T>(
        &self,
        op: &'static str,
        keys: &[&str],
        f: impl FnOnce(&mut Kv) -> Result<(T, Vec<Request>), StoreError>,
    ) -> Result<T, StoreError> {
        let mut guard = self.lock_state();
        let State { file, kv, offset } = &mut *guard;
        file.lock().map_err(|e| self.io(op, keys, e))?;
        let _unlock = Flock(file);
        self.catch_up(file, kv, offset, op, keys, true)?;
        let (out, records) = f(kv)?;
        if records.is_empty() {
            return Ok(out);
        }
        let mut bytes = Vec::new();
        for r in &records {
            r.encode(&mut bytes);
        }
        let mut writer: &File = file;
        if let Err(e) = writer.write_all(&bytes) {
            // Our state already holds the change: forget it and replay from the file next time,
            // after cutting off what was half-written.
            let _ = file.set_len(*offset);
            *kv = Kv::default();
            *offset = 0;
            return Err(self.io(op, keys, e));
        }
        *offset += bytes.len() as u64;
        Ok(out)
    }

    fn check_len(
        &self,
        op: &'static str,
        keys: &[&str],
        what: &'static str,
        len: usize,
        limit: u64,
    ) -> Result<(), StoreError> {
        if len as u64 > limit {
            return Err(StoreError::Wire {
                op,
                addr: self.addr.clone(),
                keys: key_list(keys),
                source: WireError::TooLong {
                    what,
                    len: len as u64,
                    limit,
                },
            });
        }
        Ok(())
    }

    fn check_key(&self, op: &'static str, key: &str) -> Result<(), StoreError> {
        self.check_len(op, &[key], "store key", key.len(), FILE_LIMITS.max_key_len)
    }

    fn check_value(&self, op: &'static str, key: &str, v: &[u8]) -> Result<(), StoreError> {
        self.check_key(op, key)?;
        self.check_len(
            op,
            &[key],
            "store value",
            v.len(),
            FILE_LIMITS.max_value_len,
        )
    }

    /// Polls until `ready` holds on the up-to-date state, then calls `f` (without the state
    /// lock); returns its value, or keeps polling when it returns `None`.
    fn wait_then<T>(
        &self,
        op: &'static str,
        keys: &[&str],
        timeout: Duration,
        ready: impl Fn(&Kv) -> bool,
        mut f: impl FnMut() -> Result<Option<T>, StoreError>,
    ) -> Result<T, StoreError> {
        let start = Instant::now();
        let mut backoff = Duration::from_millis(1);
        loop {
            if self.read(op, keys, &ready)?
                && let Some(v) = f()?
            {
                return Ok(v);
            }
            let waited = start.elapsed();
            if waited >= timeout {
                return Err(StoreError::Timeout {
                    op,
                    addr: self.addr.clone(),
                    keys: key_list(keys),
                    waited,
                });
            }
            std::thread::sleep(backoff.min(timeout - waited));
            backoff = (backoff * 2).min(Duration::from_millis(16));
        }
    }

    fn wait_keys(
        &self,
        op: &'static str,
        keys: &[&str],
        timeout: Duration,
    ) -> Result<(), StoreError> {
        self.wait_then(
            op,
            keys,
            timeout,
            |kv| keys.iter().all(|k| kv.contains(k.as_bytes())),
            || Ok(Some(())),
        )
    }
}

/// Applies one record of the log.
fn apply(kv: &mut Kv, rec: &Request) -> Result<(), WireError> {
    match rec {
        Request::Set { key, value } => kv.set(key, value),
        Request::Append { key, value } => kv.append(key, value),
        Request::DeleteKey { key } => {
            kv.delete(key);
        }
        Request::MultiSet { pairs } => {
            for (k, v) in pairs {
                kv.set(k, v);
            }
        }
        Request::QueuePush { key, value } => kv.queue_push(key, value),
        Request::QueuePop { key } => {
            kv.queue_pop(key);
        }
        other => {
            return Err(WireError::UnknownCode {
                field: "file store record",
                value: u64::from(other.query_type().code()),
            });
        }
    }
    Ok(())
}

impl Store for FileStore {
    fn set(&self, key: &str, value: &[u8]) -> Result<(), StoreError> {
        self.check_value("set", key, value)?;
        self.write("set", &[key], |kv| {
            kv.set(key.as_bytes(), value);
            Ok((
                (),
                vec![Request::Set {
                    key: key.as_bytes().to_vec(),
                    value: value.to_vec(),
                }],
            ))
        })
    }

    fn get(&self, key: &str) -> Result<Vec<u8>, StoreError> {
        self.wait_keys("get", &[key], self.timeout)?;
        self.read("get", &[key], |kv| {
            kv.get(key.as_bytes()).unwrap_or_default().to_vec()
        })
    }

    fn add(&self, key: &str, delta: i64) -> Result<i64, StoreError> {
        self.check_key("add", key)?;
        self.write("add", &[key], |kv| {
            let new = kv
                .add(key.as_bytes(), delta)
                .map_err(|e| StoreError::NotACounter {
                    addr: self.addr.clone(),
                    key: key.to_owned(),
                    value: show_value(&e.0),
                })?;
            Ok((
                new,
                vec![Request::Set {
                    key: key.as_bytes().to_vec(),
                    value: new.to_string().into_bytes(),
                }],
            ))
        })
    }

    fn compare_set(
        &self,
        key: &str,
        expected: &[u8],
        desired: &[u8],
    ) -> Result<Vec<u8>, StoreError> {
        self.check_value("compare_set", key, desired)?;
        self.write("compare_set", &[key], |kv| {
            let before = kv.get(key.as_bytes()).map(<[u8]>::to_vec);
            let after = kv.compare_set(key.as_bytes(), expected, desired);
            let records = if kv.get(key.as_bytes()) == before.as_deref() {
                Vec::new()
            } else {
                vec![Request::Set {
                    key: key.as_bytes().to_vec(),
                    value: after.clone(),
                }]
            };
            Ok((after, records))
        })
    }

    fn wait(&self, keys: &[&str], timeout: Duration) -> Result<(), StoreError> {
        self.wait_keys("wait", keys, timeout)
    }

    fn check(&self, keys: &[&str]) -> Result<bool, StoreError> {
        self.read("check", keys, |kv| {
            keys.iter().all(|k| kv.contains(k.as_bytes()))
        })
    }

    fn delete_key(&self, key: &str) -> Result<bool, StoreError> {
        self.write("delete_key", &[key], |kv| {
            let existed = kv.delete(key.as_bytes());
            let records = if existed {
                vec![Request::DeleteKey {
                    key: key.as_bytes().to_vec(),
                }]
            } else {
                Vec::new()
            };
            Ok((existed, records))
        })
    }

    fn num_keys(&self) -> Result<u64, StoreError> {
        self.read("num_keys", &[], |kv| kv.num_keys() as u64)
    }

    fn append(&self, key: &str, value: &[u8]) -> Result<(), StoreError> {
        self.check_value("append", key, value)?;
        self.write("append", &[key], |kv| {
            kv.append(key.as_bytes(), value);
            Ok((
                (),
                vec![Request::Append {
                    key: key.as_bytes().to_vec(),
                    value: value.to_vec(),
                }],
            ))
        })
    }

    fn multi_get(&self, keys: &[&str]) -> Result<Vec<Vec<u8>>, StoreError> {
        self.wait_keys("multi_get", keys, self.timeout)?;
        self.read("multi_get", keys, |kv| {
            keys.iter()
                .map(|k| kv.get(k.as_bytes()).unwrap_or_default().to_vec())
                .collect()
        })
    }

    fn multi_set(&self, pairs: &[(&str, &[u8])]) -> Result<(), StoreError> {
        let keys: Vec<&str> = pairs.iter().map(|(k, _)| *k).collect();
        for (k, v) in pairs {
            self.check_value("multi_set", k, v)?;
        }
        self.write("multi_set", &keys, |kv| {
            for (k, v) in pairs {
                kv.set(k.as_bytes(), v);
            }
            Ok((
                (),
                vec![Request::MultiSet {
                    pairs: pairs
                        .iter()
                        .map(|(k, v)| (k.as_bytes().to_vec(), v.to_vec()))
                        .collect(),
                }],
            ))
        })
    }

    fn queue_push(&self, key: &str, value: &[u8]) -> Result<(), StoreError> {
        self.check_value("queue_push", key, value)?;
        self.write("queue_push", &[key], |kv| {
            kv.queue_push(key.as_bytes(), value);
            Ok((
                (),
                vec![Request::QueuePush {
                    key: key.as_bytes().to_vec(),
                    value: value.to_vec(),
                }],
            ))
        })
    }

    fn queue_pop(&self, key: &str, block: bool) -> Result<Option<Vec<u8>>, StoreError> {
        let pop = || -> Result<Option<Vec<u8>>, StoreError> {
            self.write("queue_pop", &[key], |kv| {
                let v = kv.queue_pop(key.as_bytes());
                let records = if v.is_some() {
                    vec![Request::QueuePop {
                        key: key.as_bytes().to_vec(),
                    }]
                } else {
                    Vec::new()
                };
                Ok((v, records))
            })
        };
        if !block {
            return pop();
        }
        let pop = || pop().map(|v| v.map(Some));
        self.wait_then(
            "queue_pop",
            &[key],
            self.timeout,
            |kv| kv.queue_len(key.as_bytes()) > 0,
            // Another process may pop the item first: then keep waiting.
            pop,
        )
    }

    fn queue_len(&self, key: &str) -> Result<u64, StoreError> {
        self.read("queue_len", &[key], |kv| {
            kv.queue_len(key.as_bytes()) as u64
        })
    }

    fn timeout(&self) -> Duration {
        self.timeout
    }
}
