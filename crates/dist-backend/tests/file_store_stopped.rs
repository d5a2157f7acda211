//! A process that holds a [`FileStore`]'s lock is stopped (SIGSTOP, as a debugger or a job
//! control stop would): every call of the other processes must end by its deadline (+ 1 s)
//! with [`StoreError::LockHeld`] naming the file and the operation, the `_by` forms by the
//! caller's deadline rather than the store's timeout, and the store must work again once the
//! holder lets go.
//!
//! The test binary re-runs itself as the holder: it takes the lock on the store file (as a
//! `FileStore` writer does for the length of one call) and stops itself with SIGSTOP; the
//! parent learns of the stop from `waitpid(WUNTRACED)`. Once resumed, the holder waits for a
//! line on stdin and exits.

use std::fs::OpenOptions;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use dist_backend::Store;
use dist_backend::store::{FileStore, StoreError};

/// The store timeout of the plain calls, and the per-call deadline of the `_by` ones.
const T: Duration = Duration::from_secs(2);
const SLACK: Duration = Duration::from_secs(1);
/// A store timeout the `_by` calls must not wait for.
const LONG: Duration = Duration::from_secs(60);

/// Child entry: runs only when a test starts this binary with `DIST_FILE_LOCK_HOLDER`.
#[test]
#[ignore = "a lock holder process started by the tests of this file"]
fn child() {
    let Ok(spec) = std::env::var("DIST_FILE_LOCK_HOLDER") else {
        return;
    };
    let (mode, path) = spec.split_once(',').expect("mode,path");
    let file = OpenOptions::new()
        .read(true)
        .append(true)
        .open(path)
        .expect("open the store file");
    match mode {
        "exclusive" => file.lock().expect("exclusive lock"),
        "shared" => file.lock_shared().expect("shared lock"),
        other => panic!("unknown mode {other}"),
    }
    // Stopped with the lock held, until the parent resumes it.
    // SAFETY: raise(3) sends a signal to this process; it touches no memory.
    let rc = unsafe { libc::raise(libc::SIGSTOP) };
    assert_eq!(rc, 0, "raise(SIGSTOP)");
    let mut line = String::new();
    let _ = std::io::stdin().read_line(&mut line);
    // Exiting closes the file, which releases the lock.
}

/// The holder process; resumed and killed when dropped.
struct Holder {
    child: Child,
    stdin: Option<ChildStdin>,
}

impl Holder {
    /// Starts a holder of `mode` (`exclusive`, `shared`) on `path`; returns once it has taken
    /// the lock and stopped itself.
    fn stopped(mode: &str, path: &Path) -> Holder {
        let exe = std::env::current_exe().expect("test binary path");
        let mut child = Command::new(exe)
            .args(["--ignored", "--exact", "child", "--test-threads=1"])
            .env(
                "DIST_FILE_LOCK_HOLDER",
                format!("{mode},{}", path.display()),
            )
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn the holder");
        let stdin = child.stdin.take();
        let pid = libc::pid_t::try_from(child.id()).expect("pid fits pid_t");
        let mut status = 0;
        // SAFETY: waitpid(2) on our own child, writing only to `status`, a local we own. With
        // WUNTRACED it reports the child's stop without reaping it, so `Child` still owns it.
        let rc = unsafe { libc::waitpid(pid, &mut status, libc::WUNTRACED) };
        assert_eq!(rc, pid, "waitpid on the holder");
        assert!(
            libc::WIFSTOPPED(status),
            "the holder ended before it stopped with the lock (status {status:#x})"
        );
        Holder { child, stdin }
    }

    fn resume(&self) {
        let pid = libc::pid_t::try_from(self.child.id()).expect("pid fits pid_t");
        // SAFETY: kill(2) on our own child's pid; it touches no memory of ours. A child that
        // has exited already makes it fail harmlessly.
        let _ = unsafe { libc::kill(pid, libc::SIGCONT) };
    }

    /// Resumes the holder and lets it exit, which releases the lock; returns once it has.
    fn release(mut self) {
        self.resume();
        if let Some(mut stdin) = self.stdin.take() {
            let _ = writeln!(stdin, "go");
        }
        let status = self.child.wait().expect("wait for the holder");
        assert!(status.success(), "holder: {status}");
    }
}

impl Drop for Holder {
    fn drop(&mut self) {
        self.resume();
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A store file with a key, a counter and a queue item, written before any holder comes.
fn prepared(dir: &Path) -> PathBuf {
    let path = dir.join("store");
    let s = FileStore::new(&path, T).unwrap();
    s.set("k", b"v").unwrap();
    s.add("n", 1).unwrap();
    s.queue_push("q", b"item").unwrap();
    path
}

type Call = fn(&FileStore) -> Result<(), StoreError>;
type CallBy = fn(&FileStore, Instant) -> Result<(), StoreError>;
/// A call as a thread runs it, with its operation's name.
type Named = (
    &'static str,
    Box<dyn Fn(&FileStore) -> Result<(), StoreError> + Send>,
);

/// Every store call, plain (bounded by the store's timeout).
const PLAIN: [(&str, Call); 15] = [
    ("set", |s| s.set("k", b"w")),
    ("get", |s| s.get("k").map(drop)),
    ("add", |s| s.add("n", 1).map(drop)),
    ("compare_set", |s| s.compare_set("k", b"v", b"x").map(drop)),
    ("wait", |s| s.wait(&["k"], T)),
    ("check", |s| s.check(&["k"]).map(drop)),
    ("delete_key", |s| s.delete_key("k").map(drop)),
    ("num_keys", |s| s.num_keys().map(drop)),
    ("append", |s| s.append("k", b"+")),
    ("multi_get", |s| s.multi_get(&["k", "n"]).map(drop)),
    ("multi_set", |s| s.multi_set(&[("a", b"1")])),
    ("queue_push", |s| s.queue_push("q", b"x")),
    ("queue_pop", |s| s.queue_pop("q", false).map(drop)),
    ("queue_pop", |s| s.queue_pop("q", true).map(drop)),
    ("queue_len", |s| s.queue_len("q").map(drop)),
];

/// Deadline `T` from when the call starts, on a store whose own timeout is [`LONG`].
fn by(
    f: fn(&FileStore, Instant) -> Result<(), StoreError>,
) -> impl Fn(&FileStore) -> Result<(), StoreError> {
    move |s| f(s, Instant::now() + T)
}

const BY: [(&str, CallBy); 6] = [
    ("set", |s, d| s.set_by("k", b"w", d)),
    ("get", |s, d| s.get_by("k", d).map(drop)),
    ("add", |s, d| s.add_by("n", 1, d).map(drop)),
    ("wait", |s, d| s.wait_by(&["k"], d)),
    ("num_keys", |s, d| s.num_keys_by(d).map(drop)),
    ("queue_pop", |s, d| s.queue_pop_by("q", true, d).map(drop)),
];

/// Runs every call at once, each on its own fresh handle (which has replayed nothing, so its
/// reads need the lock too) and thread; returns each call's name, time and result.
fn run_all(
    path: &Path,
    timeout: Duration,
    calls: Vec<Named>,
) -> Vec<(&'static str, Duration, Result<(), StoreError>)> {
    let path = Arc::new(path.to_path_buf());
    let threads: Vec<_> = calls
        .into_iter()
        .map(|(op, call)| {
            let path = path.clone();
            thread::spawn(move || {
                let s = FileStore::new(&*path, timeout).unwrap();
                let start = Instant::now();
                let r = call(&s);
                (op, start.elapsed(), r)
            })
        })
        .collect();
    threads.into_iter().map(|t| t.join().unwrap()).collect()
}

/// Asserts that the call failed by its deadline `T` (+ 1 s) with `LockHeld`, naming the store
/// file and the operation.
fn assert_lock_held(path: &Path, (op, took, r): &(&'static str, Duration, Result<(), StoreError>)) {
    let e = r.as_ref().expect_err(op);
    eprintln!("{op}: failed after {took:?}: {e}");
    assert!(*took >= T, "{op} gave up early, after {took:?}: {e}");
    assert!(*took <= T + SLACK, "{op} took {took:?}: {e}");
    assert!(matches!(e, StoreError::LockHeld { .. }), "{op}: {e}");
    assert!(e.is_unreachable(), "{op}: {e}");
    assert_eq!(e.op(), Some(*op), "{e}");
    let msg = e.to_string();
    assert!(msg.contains(&path.display().to_string()), "{op}: {msg}");
    assert!(msg.contains("lock"), "{op}: {msg}");
}

#[test]
fn every_call_ends_by_its_deadline_while_a_stopped_process_holds_the_lock() {
    let dir = tempfile::tempdir().unwrap();
    let path = prepared(dir.path());
    let holder = Holder::stopped("exclusive", &path);

    let plain = PLAIN
        .iter()
        .map(|&(op, f)| -> Named { (op, Box::new(f)) })
        .collect();
    for r in run_all(&path, T, plain) {
        assert_lock_held(&path, &r);
    }
    // The `_by` forms on a store whose timeout is a minute: the caller's deadline ends them.
    let by_calls = BY
        .iter()
        .map(|&(op, f)| -> Named { (op, Box::new(by(f))) })
        .collect();
    for r in run_all(&path, LONG, by_calls) {
        assert_lock_held(&path, &r);
    }

    // Once the holder lets go, a handle that failed works again and sees the old state.
    let s = FileStore::new(&path, T).unwrap();
    assert!(matches!(s.set("k", b"w"), Err(StoreError::LockHeld { .. })));
    holder.release();
    s.set("k", b"w").unwrap();
    assert_eq!(s.get("k").unwrap(), b"w");
    assert_eq!(s.add("n", 1).unwrap(), 2);
    assert_eq!(s.queue_pop("q", true).unwrap().unwrap(), b"item");
}

#[test]
fn a_stopped_reader_blocks_writers_but_not_readers() {
    let dir = tempfile::tempdir().unwrap();
    let path = prepared(dir.path());
    let holder = Holder::stopped("shared", &path);

    let reader = FileStore::new(&path, T).unwrap();
    assert_eq!(reader.get("k").unwrap(), b"v");
    assert!(reader.check(&["k", "n"]).unwrap());
    assert_eq!(reader.queue_len("q").unwrap(), 1);

    let writes: Vec<Named> = vec![
        ("set", Box::new(|s: &FileStore| s.set("k", b"w"))),
        ("add", Box::new(|s: &FileStore| s.add("n", 1).map(drop))),
        (
            "queue_pop",
            Box::new(|s: &FileStore| s.queue_pop("q", true).map(drop)),
        ),
    ];
    for r in run_all(&path, T, writes) {
        assert_lock_held(&path, &r);
    }
    holder.release();
    reader.set("k", b"w").unwrap();
    assert_eq!(FileStore::new(&path, T).unwrap().get("k").unwrap(), b"w");
}

/// A writer that finds the lock taken keeps trying until its deadline: when the holder lets
/// go in time, the call succeeds.
#[test]
fn a_writer_takes_the_lock_once_the_holder_lets_go() {
    let dir = tempfile::tempdir().unwrap();
    let path = prepared(dir.path());
    let holder = Holder::stopped("exclusive", &path);
    let p = path.clone();
    let writer = thread::spawn(move || {
        let s = FileStore::new(&p, LONG).unwrap();
        s.set_by("k", b"late", Instant::now() + Duration::from_secs(30))
    });
    holder.release();
    writer.join().unwrap().unwrap();
    assert_eq!(FileStore::new(&path, T).unwrap().get("k").unwrap(), b"late");
}
