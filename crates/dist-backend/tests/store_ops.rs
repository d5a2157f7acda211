//! Every store operation, written once over `Arc<dyn Store>` and run on all four stores.

use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use dist_backend::store::{FileStore, HashStore, PrefixStore, TcpStore, TcpStoreServer};
use dist_backend::{Store, StoreError};

const SHORT: Duration = Duration::from_millis(200);
const TIMEOUT: Duration = Duration::from_secs(10);

/// Makes a fresh store with the given timeout, returned as a maker of handles to it: each call
/// gives another handle (another client, another file descriptor) to the same store, so the
/// tests that use several threads also cover several clients.
type Handles = Box<dyn Fn() -> Arc<dyn Store>>;
type Factory<'a> = &'a dyn Fn(Duration) -> Handles;

fn run_all(family: Factory<'_>) {
    // Keep every family alive (a TCP family owns its server) until the end.
    let keep = std::cell::RefCell::new(Vec::new());
    let make = |t: Duration| {
        let h = family(t);
        let s = h();
        keep.borrow_mut().push(h);
        s
    };
    set_get_overwrite(&*make(TIMEOUT));
    add_counts_in_decimal(&*make(TIMEOUT));
    compare_set_follows_torch(&*make(TIMEOUT));
    check_wait_delete(&*make(TIMEOUT));
    wait_times_out_naming_the_key(&*make(TIMEOUT));
    get_times_out(&*make(SHORT));
    num_keys_counts_sets(&*make(TIMEOUT));
    append_creates_and_extends(&*make(TIMEOUT));
    multi_set_and_get(&*make(TIMEOUT));
    queues(&*make(TIMEOUT));
    blocking_pop_times_out(&*make(SHORT));
    add_on_text_fails_and_store_survives(&*make(TIMEOUT));
    by_deadline_forms_do_what_the_plain_ones_do(&*make(TIMEOUT));
    by_deadline_waits_end_by_the_callers_deadline(&*make(TIMEOUT));
    get_waits_for_another_thread(family(TIMEOUT));
    blocking_pop_gets_item_from_another_thread(family(TIMEOUT));
    concurrent_adds(family(TIMEOUT));
}

fn set_get_overwrite(s: &dyn Store) {
    s.set("a", b"1").unwrap();
    assert_eq!(s.get("a").unwrap(), b"1");
    s.set("a", b"two").unwrap();
    assert_eq!(s.get("a").unwrap(), b"two");
    s.set("empty", b"").unwrap();
    assert_eq!(s.get("empty").unwrap(), b"");
    let big = vec![0xabu8; 1 << 20];
    s.set("big", &big).unwrap();
    assert_eq!(s.get("big").unwrap(), big);
    s.set("ünï/cödé key", b"x").unwrap();
    assert_eq!(s.get("ünï/cödé key").unwrap(), b"x");
}

fn add_counts_in_decimal(s: &dyn Store) {
    assert_eq!(s.add("c", 1).unwrap(), 1);
    assert_eq!(s.add("c", 41).unwrap(), 42);
    assert_eq!(s.add("c", -50).unwrap(), -8);
    assert_eq!(s.get("c").unwrap(), b"-8");
    assert_eq!(s.add("c", 0).unwrap(), -8);
    s.set("n", b"100").unwrap();
    assert_eq!(s.add("n", 5).unwrap(), 105);
}

fn compare_set_follows_torch(s: &dyn Store) {
    // Missing key, non-empty expected: nothing set, `expected` returned.
    assert_eq!(s.compare_set("k", b"x", b"y").unwrap(), b"x");
    assert!(!s.check(&["k"]).unwrap());
    // Missing key, empty expected: set.
    assert_eq!(s.compare_set("k", b"", b"v1").unwrap(), b"v1");
    assert_eq!(s.get("k").unwrap(), b"v1");
    // Present, mismatch: current returned, unchanged.
    assert_eq!(s.compare_set("k", b"zz", b"v2").unwrap(), b"v1");
    assert_eq!(s.get("k").unwrap(), b"v1");
    // Present, match: swapped.
    assert_eq!(s.compare_set("k", b"v1", b"v2").unwrap(), b"v2");
    assert_eq!(s.get("k").unwrap(), b"v2");
}

fn check_wait_delete(s: &dyn Store) {
    assert!(!s.check(&["x"]).unwrap());
    s.set("x", b"1").unwrap();
    s.set("y", b"2").unwrap();
    assert!(s.check(&["x", "y"]).unwrap());
    assert!(!s.check(&["x", "nope"]).unwrap());
    assert!(s.check(&[]).unwrap());
    s.wait(&["x", "y"], SHORT).unwrap();
    assert!(s.delete_key("x").unwrap());
    assert!(!s.delete_key("x").unwrap());
    assert!(!s.check(&["x"]).unwrap());
    assert!(s.check(&["y"]).unwrap());
}

fn wait_times_out_naming_the_key(s: &dyn Store) {
    s.set("present", b"").unwrap();
    let t = Instant::now();
    let e = s.wait(&["present", "never"], SHORT).unwrap_err();
    let el = t.elapsed();
    assert!(e.is_timeout(), "{e}");
    assert!(el >= SHORT, "returned after {el:?}");
    // The wait's own timeout, not the store's (TIMEOUT, 10 s), with seconds of slack.
    assert!(el < Duration::from_secs(5), "returned after {el:?}");
    let msg = e.to_string();
    assert!(msg.contains("never") && msg.contains("wait"), "{msg}");
    // The store is still usable after a timed-out wait.
    s.set("never", b"now").unwrap();
    s.wait(&["present", "never"], SHORT).unwrap();
    assert_eq!(s.get("never").unwrap(), b"now");
}

fn get_times_out(s: &dyn Store) {
    assert_eq!(s.timeout(), SHORT);
    let e = s.get("missing").unwrap_err();
    assert!(e.is_timeout(), "{e}");
    assert!(e.to_string().contains("missing"), "{e}");
    s.set("missing", b"found").unwrap();
    assert_eq!(s.get("missing").unwrap(), b"found");
}

fn num_keys_counts_sets(s: &dyn Store) {
    let n0 = s.num_keys().unwrap();
    s.set("nk1", b"").unwrap();
    s.set("nk2", b"").unwrap();
    s.set("nk1", b"again").unwrap();
    s.add("nk3", 1).unwrap();
    assert_eq!(s.num_keys().unwrap(), n0 + 3);
    s.delete_key("nk2").unwrap();
    assert_eq!(s.num_keys().unwrap(), n0 + 2);
}

fn append_creates_and_extends(s: &dyn Store) {
    s.append("log", b"ab").unwrap();
    s.append("log", b"cd").unwrap();
    assert_eq!(s.get("log").unwrap(), b"abcd");
}

fn multi_set_and_get(s: &dyn Store) {
    s.multi_set(&[("m1", b"one"), ("m2", b""), ("m3", b"three")])
        .unwrap();
    assert_eq!(
        s.multi_get(&["m3", "m1", "m2"]).unwrap(),
        vec![b"three".to_vec(), b"one".to_vec(), Vec::new()]
    );
    assert_eq!(s.multi_get(&[]).unwrap(), Vec::<Vec<u8>>::new());
}

fn queues(s: &dyn Store) {
    assert_eq!(s.queue_len("q").unwrap(), 0);
    assert_eq!(s.queue_pop("q", false).unwrap(), None);
    s.queue_push("q", b"first").unwrap();
    s.queue_push("q", b"second").unwrap();
    assert_eq!(s.queue_len("q").unwrap(), 2);
    assert!(s.check(&["q"]).unwrap());
    assert_eq!(s.queue_pop("q", false).unwrap().unwrap(), b"first");
    assert_eq!(s.queue_pop("q", true).unwrap().unwrap(), b"second");
    assert_eq!(s.queue_len("q").unwrap(), 0);
    assert_eq!(s.queue_pop("q", false).unwrap(), None);
}

fn blocking_pop_times_out(s: &dyn Store) {
    let e = s.queue_pop("emptyq", true).unwrap_err();
    assert!(e.is_timeout(), "{e}");
    s.queue_push("emptyq", b"x").unwrap();
    assert_eq!(s.queue_pop("emptyq", true).unwrap().unwrap(), b"x");
}

fn by_deadline_forms_do_what_the_plain_ones_do(s: &dyn Store) {
    let d = || Instant::now() + TIMEOUT;
    s.set_by("a", b"1", d()).unwrap();
    assert_eq!(s.get_by("a", d()).unwrap(), b"1");
    assert_eq!(s.add_by("n", 5, d()).unwrap(), 5);
    assert_eq!(s.add_by("n", -2, d()).unwrap(), 3);
    assert_eq!(s.compare_set_by("a", b"1", b"2", d()).unwrap(), b"2");
    s.wait_by(&["a", "n"], d()).unwrap();
    assert!(s.check_by(&["a", "n"], d()).unwrap());
    assert!(!s.check_by(&["a", "zz"], d()).unwrap());
    s.append_by("a", b"3", d()).unwrap();
    s.multi_set_by(&[("x", b"7"), ("y", b"8")], d()).unwrap();
    assert_eq!(
        s.multi_get_by(&["a", "x", "y"], d()).unwrap(),
        vec![b"23".to_vec(), b"7".to_vec(), b"8".to_vec()]
    );
    assert_eq!(s.num_keys_by(d()).unwrap(), s.num_keys().unwrap());
    assert!(s.delete_key_by("x", d()).unwrap());
    assert!(!s.delete_key_by("x", d()).unwrap());
    s.queue_push_by("q", b"i", d()).unwrap();
    assert_eq!(s.queue_len_by("q", d()).unwrap(), 1);
    assert_eq!(s.queue_pop_by("q", true, d()).unwrap().unwrap(), b"i");
    assert_eq!(s.queue_pop_by("q", false, d()).unwrap(), None);
}

/// The store's timeout is 10 s; each call's own deadline, `SHORT` from now, ends it.
fn by_deadline_waits_end_by_the_callers_deadline(s: &dyn Store) {
    assert_eq!(s.timeout(), TIMEOUT);
    type Call<'a> = &'a dyn Fn(Instant) -> Result<(), StoreError>;
    let calls: [(&str, Call<'_>); 4] = [
        ("get", &|d| s.get_by("missing", d).map(drop)),
        ("wait", &|d| s.wait_by(&["missing"], d)),
        ("multi_get", &|d| {
            s.multi_get_by(&["missing", "other"], d).map(drop)
        }),
        ("queue_pop", &|d| {
            s.queue_pop_by("missingq", true, d).map(drop)
        }),
    ];
    for (op, call) in calls {
        let t = Instant::now();
        let e = call(t + SHORT).unwrap_err();
        let el = t.elapsed();
        assert!(e.is_timeout(), "{op}: {e}");
        assert_eq!(e.op(), Some(op), "{e}");
        assert!(e.to_string().contains("missing"), "{op}: {e}");
        assert!(el >= SHORT, "{op} returned after {el:?}");
        // Not the store's 10 s, with seconds of slack.
        assert!(el < Duration::from_secs(5), "{op} returned after {el:?}");
    }
    // A deadline already past still answers what needs no waiting.
    s.set("here", b"1").unwrap();
    assert_eq!(s.get_by("here", Instant::now()).unwrap(), b"1");
}

fn add_on_text_fails_and_store_survives(s: &dyn Store) {
    s.set("text", b"hello").unwrap();
    let e = s.add("text", 1).unwrap_err();
    // Every store names the key and its value, the TCP store too, whose server can only close
    // the connection (as torch's does).
    assert!(
        matches!(&e, StoreError::NotACounter { key, value, .. }
            if key.ends_with("text") && value == "hello"),
        "{e:?}"
    );
    assert_eq!(e.op(), Some("add"));
    assert!(e.to_string().contains("not a decimal integer"), "{e}");
    assert_eq!(s.get("text").unwrap(), b"hello");
    assert_eq!(s.add("fine", 2).unwrap(), 2);
}

fn get_waits_for_another_thread(handles: Handles) {
    let s = handles();
    let s2 = handles();
    let h = thread::spawn(move || {
        // Usually sets the key while `get` waits; set first, `get` finds it at once: the
        // result is the same, so the timing does not matter.
        thread::sleep(Duration::from_millis(50));
        s2.set("late", b"arrived").unwrap();
    });
    assert_eq!(s.get("late").unwrap(), b"arrived");
    h.join().unwrap();
}

fn blocking_pop_gets_item_from_another_thread(handles: Handles) {
    let s = handles();
    let s2 = handles();
    let h = thread::spawn(move || {
        // Usually pushes while the pop blocks; pushed first, the pop finds it at once: the
        // result is the same, so the timing does not matter.
        thread::sleep(Duration::from_millis(50));
        s2.queue_push("jobs", b"job").unwrap();
    });
    assert_eq!(s.queue_pop("jobs", true).unwrap().unwrap(), b"job");
    h.join().unwrap();
}

fn concurrent_adds(handles: Handles) {
    let s = handles();
    let hs: Vec<_> = (0..8)
        .map(|_| {
            let s = handles();
            thread::spawn(move || {
                for _ in 0..50 {
                    s.add("total", 1).unwrap();
                }
            })
        })
        .collect();
    for h in hs {
        h.join().unwrap();
    }
    assert_eq!(s.get("total").unwrap(), b"400");
}

#[test]
fn hash_store_ops() {
    run_all(&|t| {
        let s: Arc<dyn Store> = Arc::new(HashStore::new(t));
        Box::new(move || Arc::clone(&s))
    });
}

#[test]
fn prefix_over_hash_store_ops() {
    run_all(&|t| {
        let inner: Arc<dyn Store> = Arc::new(HashStore::new(t));
        Box::new(move || Arc::new(PrefixStore::new("pg0", Arc::clone(&inner))))
    });
}

#[test]
fn prefix_store_puts_keys_under_prefix() {
    let inner: Arc<dyn Store> = Arc::new(HashStore::new(SHORT));
    let a = PrefixStore::new("a", Arc::clone(&inner));
    let b = PrefixStore::new("b", Arc::clone(&inner));
    a.set("k", b"1").unwrap();
    b.set("k", b"2").unwrap();
    assert_eq!(inner.get("a/k").unwrap(), b"1");
    assert_eq!(inner.get("b/k").unwrap(), b"2");
    assert_eq!(a.get("k").unwrap(), b"1");
    assert!(!a.check(&["other"]).unwrap());
    let e = a.wait(&["never"], SHORT).unwrap_err();
    assert!(e.to_string().contains("a/never"), "{e}");
}

#[test]
fn file_store_ops() {
    let dir = tempfile::tempdir().unwrap();
    let n = std::sync::atomic::AtomicUsize::new(0);
    let path = dir.path().to_path_buf();
    run_all(&move |t| {
        let i = n.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let file = path.join(format!("store{i}"));
        Box::new(move || Arc::new(FileStore::new(&file, t).unwrap()))
    });
}

#[test]
fn file_store_ops_across_handles() {
    // Every operation goes through a different handle (own fd, own flock) of the same file.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("shared");
    let a = FileStore::new(&path, TIMEOUT).unwrap();
    let b = FileStore::new(&path, TIMEOUT).unwrap();
    a.set("k", b"v").unwrap();
    assert_eq!(b.get("k").unwrap(), b"v");
    b.add("c", 2).unwrap();
    assert_eq!(a.add("c", 3).unwrap(), 5);
    a.queue_push("q", b"1").unwrap();
    assert_eq!(b.queue_pop("q", false).unwrap().unwrap(), b"1");
    assert_eq!(a.queue_pop("q", false).unwrap(), None);
    assert!(b.delete_key("k").unwrap());
    assert!(!a.check(&["k"]).unwrap());
    assert_eq!(a.num_keys().unwrap(), b.num_keys().unwrap());

    // Concurrent adds from separate handles, each with its own file descriptor.
    let hs: Vec<_> = (0..4)
        .map(|_| {
            let path = path.clone();
            thread::spawn(move || {
                let s = FileStore::new(&path, TIMEOUT).unwrap();
                for _ in 0..50 {
                    s.add("sum", 1).unwrap();
                }
            })
        })
        .collect();
    for h in hs {
        h.join().unwrap();
    }
    assert_eq!(a.get("sum").unwrap(), b"200");
}

/// The last of a job's handles deletes the file, as torch's `FileStore(path, world_size)`
/// does, so that a later job given the same path starts empty; the count of closed handles
/// is no key of the job's. Before, the file stayed and the next job replayed this one's keys.
#[test]
fn file_store_of_a_job_is_deleted_by_its_last_handle() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("job");
    let handles: Vec<_> = (0..3)
        .map(|_| FileStore::for_workers(&path, TIMEOUT, 3).unwrap())
        .collect();
    handles[0].set("rank0", b"up").unwrap();
    handles[1].add("arrived", 1).unwrap();
    let mut handles = handles.into_iter();
    drop(handles.next());
    drop(handles.next());
    let last = handles.next().unwrap();
    assert!(path.exists(), "deleted before the last handle closed");
    // The two closed count themselves in a key of their own, which is not the job's.
    assert_eq!(last.num_keys().unwrap(), 2);
    assert_eq!(last.get("rank0").unwrap(), b"up");
    drop(last);
    assert!(!path.exists(), "the last handle left the file");
    let next_job = FileStore::for_workers(&path, SHORT, 1).unwrap();
    assert_eq!(next_job.num_keys().unwrap(), 0);
    assert!(!next_job.check(&["rank0"]).unwrap());
    drop(next_job);
    assert!(!path.exists());

    // Plain handles never delete it, and a job's handle dropped after the file was removed
    // does not bring it back.
    FileStore::new(&path, SHORT)
        .unwrap()
        .set("k", b"v")
        .unwrap();
    assert!(path.exists());
    let late = FileStore::for_workers(&path, SHORT, 1).unwrap();
    std::fs::remove_file(&path).unwrap();
    drop(late);
    assert!(!path.exists());

    // Nor does one whose path names another file by then (a new job's).
    let old = FileStore::for_workers(&path, SHORT, 1).unwrap();
    std::fs::remove_file(&path).unwrap();
    FileStore::new(&path, SHORT)
        .unwrap()
        .set("new", b"job")
        .unwrap();
    drop(old);
    assert_eq!(
        FileStore::new(&path, SHORT).unwrap().get("new").unwrap(),
        b"job"
    );
    std::fs::remove_file(&path).unwrap();
}

/// A rank that closes and opens its handle again (a group destroyed and re-created on the
/// same path) keeps the file for the others: it is deleted only once no handle is open, not
/// after as many closes as workers. Before, the second close of a two-rank job deleted it
/// under the re-opened handle, and the next rank to open the path made a file of its own.
#[test]
fn file_store_of_a_job_outlives_a_rank_that_reopens_it() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("job");
    let rank0 = FileStore::for_workers(&path, TIMEOUT, 2).unwrap();
    let rank1 = FileStore::for_workers(&path, TIMEOUT, 2).unwrap();
    drop(rank0);
    let rank0 = FileStore::for_workers(&path, TIMEOUT, 2).unwrap();
    rank0.set("second", b"world").unwrap();
    drop(rank1);
    assert!(
        path.exists(),
        "deleted while rank 0's second handle is open"
    );
    let rank1 = FileStore::for_workers(&path, TIMEOUT, 2).unwrap();
    assert_eq!(rank1.get("second").unwrap(), b"world");
    drop(rank0);
    assert!(path.exists());
    drop(rank1);
    assert!(!path.exists(), "the last handle left the file");
}

#[test]
fn file_store_cuts_a_torn_record() {
    use std::io::Write;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("torn");
    let a = FileStore::new(&path, SHORT).unwrap();
    a.set("before", b"1").unwrap();
    // A writer that crashed half-way through a SET record.
    let mut f = std::fs::OpenOptions::new()
        .append(true)
        .open(&path)
        .unwrap();
    f.write_all(&[1, 6, 0, 0, 0, 0, 0, 0, 0, b'/']).unwrap();
    drop(f);
    let b = FileStore::new(&path, SHORT).unwrap();
    assert_eq!(b.get("before").unwrap(), b"1");
    b.set("after", b"2").unwrap();
    assert_eq!(a.get("after").unwrap(), b"2");
    assert_eq!(FileStore::new(&path, SHORT).unwrap().num_keys().unwrap(), 2);
}

#[test]
fn file_store_reports_corruption() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("bad");
    std::fs::write(&path, [0x7f, 1, 2, 3]).unwrap();
    let s = FileStore::new(&path, SHORT).unwrap();
    let e = s.num_keys().unwrap_err();
    assert!(matches!(e, StoreError::Corrupt { offset: 0, .. }), "{e}");
    assert!(e.to_string().contains("bad"), "{e}");
}

#[test]
fn tcp_store_ops() {
    // One server per store of the family, so that keys of one test do not leak into another.
    run_all(&|t| {
        let server = Arc::new(TcpStoreServer::start(0).unwrap());
        Box::new(move || {
            let _keep = &server;
            Arc::new(TcpStore::connect("127.0.0.1", server.port(), t).unwrap())
        })
    });
}

#[test]
fn prefix_over_tcp_store_ops() {
    run_all(&|t| {
        let server = Arc::new(TcpStoreServer::start(0).unwrap());
        Box::new(move || {
            let inner: Arc<dyn Store> =
                Arc::new(TcpStore::connect("localhost", server.port(), t).unwrap());
            Arc::new(PrefixStore::new("pg", inner))
        })
    });
}
