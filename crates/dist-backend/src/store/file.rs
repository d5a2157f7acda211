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
//! * every call ends by its deadline, also while another process holds the lock: the lock is
//!   taken without blocking and retried with the same backoff, so a holder that is stopped
//!   (SIGSTOP, a debugger) makes the others fail with [`StoreError::LockHeld`] instead of
//!   waiting for ever. The handle's own mutex (threads of one process) is taken the same way.
//!
//! The log is never compacted: rendezvous writes few, small keys.
//!
//! A store opened with [`FileStore::for_workers`] (as `file://` init opens it, with the world
//! size) deletes its file when the last of the job's handles closes, as torch's `FileStore`
//! does: handles count themselves open and closed in two keys of their own, and the one that
//! closes when none is open any more and at least the number of workers have closed removes
//! the file (if the path still names the file it has open). A later job given the same path
//! then starts from an empty store instead of replaying this job's keys (its counters, its
//! barriers' arrivals), which would let its ranks through rendezvous before their peers.
//! Counting the open ones too keeps the file while a rank re-initialises on the same path,
//! or holds a second handle (an RPC agent beside its process group).

use std::fs::{File, OpenOptions};
use std::io::{self, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard, TryLockError};
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
    /// With [`FileStore::for_workers`]: how many handles the job opens; the last to close
    /// deletes the file.
    workers: Option<u64>,
}

/// The keys in which [`FileStore::for_workers`] handles count themselves closed, and open.
/// Their NUL keeps them apart from the keys of torch and of this workspace, which are text;
/// `num_keys` leaves them out.
const CLOSED_KEY: &str = "\0dist/file-store/closed";
const OPEN_KEY: &str = "\0dist/file-store/open";

/// The longest a closing handle waits to count itself closed (less when the store's timeout
/// is shorter): a drop must not hang on a lock held by a stopped process.
const CLOSE_WAIT: Duration = Duration::from_secs(10);

#[derive(Debug)]
struct State {
    file: File,
    kv: Kv,
    /// Bytes of the file replayed into `kv`.
    offset: u64,
}

/// The first pause between tries to take a lock, and the longest: short enough that a lock
/// freed is taken within a few milliseconds, long enough that a waiter costs nothing.
const FIRST_PAUSE: Duration = Duration::from_millis(1);
const LONGEST_PAUSE: Duration = Duration::from_millis(16);

/// Pauses between tries, doubling from [`FIRST_PAUSE`] to [`LONGEST_PAUSE`], never past the
/// deadline; `false` once the deadline has passed.
struct Backoff {
    pause: Duration,
    deadline: Instant,
}

impl Backoff {
    fn new(deadline: Instant) -> Self {
        Backoff {
            pause: FIRST_PAUSE,
            deadline,
        }
    }

    fn pause(&mut self) -> bool {
        let left = self.deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return false;
        }
        std::thread::sleep(self.pause.min(left));
        self.pause = (self.pause * 2).min(LONGEST_PAUSE);
        true
    }
}

/// Which `flock` a call takes.
#[derive(Clone, Copy)]
enum LockKind {
    Shared,
    Exclusive,
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
    /// The file outlives the store; [`FileStore::for_workers`] deletes it once a job is done.
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
            workers: None,
        })
    }

    /// [`FileStore::new`] for one of the `num_workers` handles a job opens on `path` (one per
    /// rank, as torch's `FileStore(path, world_size)`): the last of them to be dropped deletes
    /// the file, so that the path can serve a later job. A handle dropped without the others
    /// (its process crashed, or they never opened theirs) leaves the file, as torch's does.
    pub fn for_workers(
        path: impl AsRef<Path>,
        timeout: Duration,
        num_workers: usize,
    ) -> Result<Self, StoreError> {
        let deadline = crate::deadline_after(Instant::now(), timeout);
        loop {
            let mut store = FileStore::new(path.as_ref(), timeout)?;
            store.add_by(OPEN_KEY, 1, deadline)?;
            // The last handle of an earlier job deletes the file under the lock: where that
            // came between this open and the count, this handle counted itself in an
            // unlinked file, and opens the path again.
            if store.path_names_our_file() {
                store.workers = Some(num_workers as u64);
                return Ok(store);
            }
            if Instant::now() >= deadline {
                return Err(store.io(
                    "open",
                    &[],
                    io::Error::other("the file was deleted or replaced every time it was opened"),
                ));
            }
        }
    }

    /// Counts this handle closed (and no longer open) in one record; the last one (none open
    /// any more, and at least `workers` closed) deletes the file instead, under the same
    /// exclusive lock. Deleting after the lock is released would let a handle opened in
    /// between count itself open in a file about to be unlinked, and work on it alone.
    fn count_closed(&self, workers: u64, deadline: Instant) -> Result<(), StoreError> {
        let keys = [CLOSED_KEY, OPEN_KEY];
        self.write_with_file("close", &keys, deadline, |kv, file| {
            let mut counted = [0i64; 2];
            for (n, (key, delta)) in counted.iter_mut().zip(keys.iter().zip([1, -1])) {
                *n = kv
                    .add(key.as_bytes(), delta)
                    .map_err(|e| StoreError::NotACounter {
                        addr: self.addr.clone(),
                        key: (*key).to_owned(),
                        value: show_value(&e.0),
                    })?;
            }
            let [closed, open] = counted;
            let last = open <= 0 && u64::try_from(closed).is_ok_and(|c| c >= workers);
            if last && names(&self.path, file) {
                match std::fs::remove_file(&self.path) {
                    Ok(()) => return Ok(((), Vec::new())),
                    Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                    Err(e) => tracing::warn!(
                        path = %self.path.display(),
                        error = %e,
                        "file store: the last handle could not delete the file"
                    ),
                }
            }
            let records = keys
                .iter()
                .zip(counted)
                .map(|(key, n)| (key.as_bytes().to_vec(), n.to_string().into_bytes()))
                .collect();
            Ok(((), vec![Request::MultiSet { pairs: records }]))
        })
    }

    /// Whether `path` still names the file this handle has open: another job may have
    /// removed it and made a new one there, which is not this handle's to delete.
    fn path_names_our_file(&self) -> bool {
        let st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        names(&self.path, &st.file)
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

    /// The handle's state, waiting for another thread of this process until `deadline`.
    fn lock_state(
        &self,
        op: &'static str,
        keys: &[&str],
        deadline: Instant,
    ) -> Result<MutexGuard<'_, State>, StoreError> {
        self.retry(op, keys, deadline, || match self.state.try_lock() {
            Ok(g) => Ok(Some(g)),
            // A thread that panicked holding it left nothing half-done that matters.
            Err(TryLockError::Poisoned(e)) => Ok(Some(e.into_inner())),
            Err(TryLockError::WouldBlock) => Ok(None),
        })
    }

    /// Takes the file's `flock` without blocking, retrying until `deadline`: a holder that is
    /// stopped never lets go, and a blocking `flock` would wait for it for ever.
    fn flock<'f>(
        &self,
        file: &'f File,
        kind: LockKind,
        op: &'static str,
        keys: &[&str],
        deadline: Instant,
    ) -> Result<Flock<'f>, StoreError> {
        self.retry(op, keys, deadline, || {
            let tried = match kind {
                LockKind::Shared => file.try_lock_shared(),
                LockKind::Exclusive => file.try_lock(),
            };
            match tried {
                Ok(()) => Ok(Some(Flock(file))),
                Err(std::fs::TryLockError::WouldBlock) => Ok(None),
                Err(std::fs::TryLockError::Error(e)) => Err(self.io(op, keys, e)),
            }
        })
    }

    /// Runs `attempt` until it takes what it tries to (`Some`), pausing between tries, or
    /// fails with [`StoreError::LockHeld`] once `deadline` has passed.
    fn retry<T>(
        &self,
        op: &'static str,
        keys: &[&str],
        deadline: Instant,
        mut attempt: impl FnMut() -> Result<Option<T>, StoreError>,
    ) -> Result<T, StoreError> {
        let start = Instant::now();
        let mut backoff = Backoff::new(deadline);
        loop {
            if let Some(taken) = attempt()? {
                return Ok(taken);
            }
            if !backoff.pause() {
                return Err(self.lock_held(op, keys, start));
            }
        }
    }

    fn lock_held(&self, op: &'static str, keys: &[&str], start: Instant) -> StoreError {
        StoreError::LockHeld {
            op,
            addr: self.addr.clone(),
            keys: key_list(keys),
            waited: start.elapsed(),
        }
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
        deadline: Instant,
        f: impl FnOnce(&Kv) -> T,
    ) -> Result<T, StoreError> {
        let mut st = self.lock_state(op, keys, deadline)?;
        self.refresh(&mut st, op, keys, deadline)?;
        Ok(f(&st.kv))
    }

    /// Replays new records under a shared lock; skips the lock when the file has not grown.
    fn refresh(
        &self,
        st: &mut State,
        op: &'static str,
        keys: &[&str],
        deadline: Instant,
    ) -> Result<(), StoreError> {
        let State { file, kv, offset } = st;
        let len = file.metadata().map_err(|e| self.io(op, keys, e))?.len();
        if len == *offset {
            return Ok(());
        }
        let _unlock = self.flock(file, LockKind::Shared, op, keys, deadline)?;
        self.catch_up(file, kv, offset, op, keys, false)
    }

    /// Runs `f` on the up-to-date state under the exclusive lock; `f` mutates the state and
    /// returns the records to append, which are written before the lock is released.
    fn write<T>(
        &self,
        op: &'static str,
        keys: &[&str],
        deadline: Instant,
        f: impl FnOnce(&mut Kv) -> Result<(T, Vec<Request>), StoreError>,
    ) -> Result<T, StoreError> {
        self.write_with_file(op, keys, deadline, |kv, _| f(kv))
    }

    /// [`FileStore::write`], `f` also given the locked file.
    fn write_with_file<T>(
        &self,
        op: &'static str,
        keys: &[&str],
        deadline: Instant,
        f: impl FnOnce(&mut Kv, &File) -> Result<(T, Vec<Request>), StoreError>,
    ) -> Result<T, StoreError> {
        let mut guard = self.lock_state(op, keys, deadline)?;
        let State { file, kv, offset } = &mut *guard;
        let _unlock = self.flock(file, LockKind::Exclusive, op, keys, deadline)?;
        self.catch_up(file, kv, offset, op, keys, true)?;
        let (out, records) = f(kv, file)?;
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
        deadline: Instant,
        ready: impl Fn(&Kv) -> bool,
        mut f: impl FnMut() -> Result<Option<T>, StoreError>,
    ) -> Result<T, StoreError> {
        let start = Instant::now();
        let mut backoff = Backoff::new(deadline);
        loop {
            if self.read(op, keys, deadline, &ready)?
                && let Some(v) = f()?
            {
                return Ok(v);
            }
            if !backoff.pause() {
                return Err(StoreError::Timeout {
                    op,
                    addr: self.addr.clone(),
                    keys: key_list(keys),
                    waited: start.elapsed(),
                });
            }
        }
    }

    fn wait_keys(
        &self,
        op: &'static str,
        keys: &[&str],
        deadline: Instant,
    ) -> Result<(), StoreError> {
        self.wait_then(
            op,
            keys,
            deadline,
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

/// Whether `path` names the file `file` has open (the same device and inode).
fn names(path: &Path, file: &File) -> bool {
    use std::os::unix::fs::MetadataExt;
    match (file.metadata(), std::fs::metadata(path)) {
        (Ok(ours), Ok(there)) => (ours.dev(), ours.ino()) == (there.dev(), there.ino()),
        _ => false,
    }
}

impl Drop for FileStore {
    fn drop(&mut self) {
        let Some(workers) = self.workers else {
            return;
        };
        // Removed already, or replaced (a test's directory cleaned up, a new job's file):
        // counting would only write to the unlinked file.
        if !self.path_names_our_file() {
            return;
        }
        let deadline = crate::deadline_after(Instant::now(), self.timeout.min(CLOSE_WAIT));
        if let Err(e) = self.count_closed(workers, deadline) {
            tracing::warn!(
                path = %self.path.display(),
                error = %e,
                "file store: a closing handle could not count itself closed, so the file \
                 will not be deleted"
            );
        }
    }
}

impl Store for FileStore {
    plain_calls_by_deadline!();

    fn set_by(&self, key: &str, value: &[u8], deadline: Instant) -> Result<(), StoreError> {
        self.check_value("set", key, value)?;
        self.write("set", &[key], deadline, |kv| {
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

    fn get_by(&self, key: &str, deadline: Instant) -> Result<Vec<u8>, StoreError> {
        self.wait_keys("get", &[key], deadline)?;
        self.read("get", &[key], deadline, |kv| {
            kv.get(key.as_bytes()).unwrap_or_default().to_vec()
        })
    }

    fn add_by(&self, key: &str, delta: i64, deadline: Instant) -> Result<i64, StoreError> {
        self.check_key("add", key)?;
        self.write("add", &[key], deadline, |kv| {
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

    fn compare_set_by(
        &self,
        key: &str,
        expected: &[u8],
        desired: &[u8],
        deadline: Instant,
    ) -> Result<Vec<u8>, StoreError> {
        self.check_value("compare_set", key, desired)?;
        self.write("compare_set", &[key], deadline, |kv| {
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

    fn wait_by(&self, keys: &[&str], deadline: Instant) -> Result<(), StoreError> {
        self.wait_keys("wait", keys, deadline)
    }

    fn check_by(&self, keys: &[&str], deadline: Instant) -> Result<bool, StoreError> {
        self.read("check", keys, deadline, |kv| {
            keys.iter().all(|k| kv.contains(k.as_bytes()))
        })
    }

    fn delete_key_by(&self, key: &str, deadline: Instant) -> Result<bool, StoreError> {
        self.write("delete_key", &[key], deadline, |kv| {
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

    fn num_keys_by(&self, deadline: Instant) -> Result<u64, StoreError> {
        self.read("num_keys", &[], deadline, |kv| {
            let ours = [CLOSED_KEY, OPEN_KEY]
                .iter()
                .filter(|k| kv.contains(k.as_bytes()))
                .count();
            (kv.num_keys() - ours) as u64
        })
    }

    fn append_by(&self, key: &str, value: &[u8], deadline: Instant) -> Result<(), StoreError> {
        self.check_value("append", key, value)?;
        self.write("append", &[key], deadline, |kv| {
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

    fn multi_get_by(&self, keys: &[&str], deadline: Instant) -> Result<Vec<Vec<u8>>, StoreError> {
        self.wait_keys("multi_get", keys, deadline)?;
        self.read("multi_get", keys, deadline, |kv| {
            keys.iter()
                .map(|k| kv.get(k.as_bytes()).unwrap_or_default().to_vec())
                .collect()
        })
    }

    fn multi_set_by(&self, pairs: &[(&str, &[u8])], deadline: Instant) -> Result<(), StoreError> {
        let keys: Vec<&str> = pairs.iter().map(|(k, _)| *k).collect();
        for (k, v) in pairs {
            self.check_value("multi_set", k, v)?;
        }
        self.write("multi_set", &keys, deadline, |kv| {
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

    fn queue_push_by(&self, key: &str, value: &[u8], deadline: Instant) -> Result<(), StoreError> {
        self.check_value("queue_push", key, value)?;
        self.write("queue_push", &[key], deadline, |kv| {
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

    fn queue_pop_by(
        &self,
        key: &str,
        block: bool,
        deadline: Instant,
    ) -> Result<Option<Vec<u8>>, StoreError> {
        let pop = || -> Result<Option<Vec<u8>>, StoreError> {
            self.write("queue_pop", &[key], deadline, |kv| {
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
            deadline,
            |kv| kv.queue_len(key.as_bytes()) > 0,
            // Another process may pop the item first: then keep waiting.
            pop,
        )
    }

    fn queue_len_by(&self, key: &str, deadline: Instant) -> Result<u64, StoreError> {
        self.read("queue_len", &[key], deadline, |kv| {
            kv.queue_len(key.as_bytes()) as u64
        })
    }

    fn timeout(&self) -> Duration {
        self.timeout
    }
}
