//! Timeouts over real loopback TCP: the error says which rank finished which collective, the
//! group's first failure dumps its flight recorder once, and publishing progress costs no
//! store traffic while collectives keep completing.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use dist_backend::store::{HashStore, TcpStoreServer};
use dist_backend::{Store, StoreError};
use dist_collective::testing::{run_world_opts, run_world_with};
use dist_collective::{Error, InitOptions, ReduceOp, new_process_group};

/// A barrier for the test's own ranks that gives up (panicking the rank, which `run_world`
/// reports) instead of hanging when a rank never arrives because it failed earlier.
struct Barrier {
    n: usize,
    arrived: Mutex<usize>,
    cv: Condvar,
}

impl Barrier {
    fn new(n: usize) -> Self {
        Barrier {
            n,
            arrived: Mutex::new(0),
            cv: Condvar::new(),
        }
    }

    fn wait(&self) {
        let mut arrived = self.arrived.lock().unwrap_or_else(|e| e.into_inner());
        *arrived += 1;
        self.cv.notify_all();
        let (arrived, timeout) = self
            .cv
            .wait_timeout_while(arrived, Duration::from_secs(120), |a| *a < self.n)
            .unwrap_or_else(|e| e.into_inner());
        assert!(
            !timeout.timed_out(),
            "test barrier: only {} of {} ranks arrived",
            *arrived,
            self.n
        );
    }
}

/// Short enough to keep the tests quick, long enough that a loaded CI box finishes the
/// collectives that are meant to succeed.
const TIMEOUT: Duration = Duration::from_millis(1500);

/// Every rank runs five all-reduces (#0..#4); then rank 1 skips the sixth (#5) and waits, with
/// its group open, until the others have failed. Returns each rank's error on #5.
fn skip_one(async_form: bool) -> Vec<Option<Error>> {
    let failed = Barrier::new(3);
    run_world_with(3, TIMEOUT, |pg| {
        for _ in 0..5 {
            pg.all_reduce(&mut [1u32], ReduceOp::Sum)?;
        }
        let err = if pg.rank() == 1 {
            None
        } else if async_form {
            Some(
                pg.all_reduce_async(vec![1u32], ReduceOp::Sum)?
                    .wait()
                    .map(drop),
            )
        } else {
            Some(pg.all_reduce(&mut [1u32], ReduceOp::Sum))
        };
        // Rank 1 must not drop its connections first: peers would see it leave, not lag.
        failed.wait();
        Ok(err.map(|r| r.expect_err("all_reduce #5 cannot complete without rank 1")))
    })
    .expect("every rank returns")
}

fn check_names_the_lagging_rank(errs: &[Option<Error>]) {
    for (rank, other) in [(0, 2), (2, 0)] {
        let e = errs[rank].as_ref().expect("ranks 0 and 2 fail");
        let msg = e.to_string();
        let Error::CollectiveTimeout {
            rank: r,
            op,
            seq,
            source,
            progress,
            ..
        } = e
        else {
            panic!("rank {rank}: not a CollectiveTimeout: {msg}");
        };
        assert_eq!((*r, *op, *seq), (rank, "all_reduce", 5), "{msg}");
        assert!(
            matches!(source, dist_backend::Error::Timeout { .. }),
            "{msg}"
        );
        assert_eq!(progress.lagging(), [1], "{msg}");
        assert!(
            msg.contains("rank 1 finished all_reduce #4 but did not join #5"),
            "{msg}"
        );
        assert!(
            msg.contains(&format!("rank {other} is in all_reduce #5 too")),
            "{msg}"
        );
        assert!(
            msg.contains(&format!("rank {rank}: all_reduce #5")),
            "{msg}"
        );
    }
    assert!(errs[1].is_none());
}

#[test]
fn a_timeout_says_which_rank_finished_which_collective() {
    check_names_the_lagging_rank(&skip_one(false));
}

#[test]
fn an_async_timeout_says_the_same() {
    check_names_the_lagging_rank(&skip_one(true));
}

fn scratch_dir(what: &str) -> std::path::PathBuf {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    std::env::temp_dir().join(format!("dist-{what}-{}-{nanos}", std::process::id()))
}

#[test]
fn the_first_failure_dumps_the_flight_recorder_once() {
    let dir = scratch_dir("flight");
    let opts = InitOptions::new()
        .timeout(TIMEOUT)
        .flight_recorder_dir(&dir);
    let failed = Barrier::new(2);
    let out = run_world_opts(2, opts, |pg| {
        pg.all_reduce(&mut [1.0f32; 3], ReduceOp::Sum)?;
        pg.broadcast(&mut [0u8; 5], 0)?;
        if pg.rank() == 1 {
            failed.wait();
            return Ok(None);
        }
        // A monitored barrier's failure leaves the group usable: it may dump, but must not use
        // up the dump of the failure that aborts the group.
        let probe = pg
            .monitored_barrier(Duration::from_millis(100), true)
            .expect_err("rank 1 never arrives");
        assert!(matches!(probe, Error::MonitoredBarrier { .. }), "{probe}");
        let first = pg
            .all_reduce(&mut [1i64; 7], ReduceOp::Sum)
            .expect_err("rank 1 never joins");
        // The group is aborted now; this fails too, but must not dump again.
        let second = pg.barrier().expect_err("the group is aborted");
        failed.wait();
        Ok(Some((first.to_string(), second.to_string())))
    })
    .expect("every rank returns");
    let (first, second) = out[0].clone().expect("rank 0 failed");
    let files: Vec<String> = std::fs::read_dir(&dir)
        .expect("the dump directory exists")
        .map(|e| {
            e.expect("dir entry")
                .file_name()
                .to_string_lossy()
                .into_owned()
        })
        .collect();
    assert_eq!(files, ["world.rank0.json"], "only the failing rank dumps");
    let text = std::fs::read_to_string(dir.join("world.rank0.json")).expect("dump readable");
    std::fs::remove_dir_all(&dir).expect("clean up");
    let j: serde_json::Value = serde_json::from_str(&text).expect("the dump is JSON");
    assert_eq!(j["group"], "world");
    assert_eq!(j["rank"], 0);
    assert_eq!(j["world_size"], 2);
    assert_eq!(
        j["error"],
        first.as_str(),
        "the dump names the first failure"
    );
    assert_ne!(first, second);
    let e = j["entries"].as_array().expect("entries");
    assert_eq!(e.len(), 4, "{text}");
    let fields = |i: usize| {
        (
            e[i]["op"].as_str().unwrap_or_default(),
            e[i]["dtype"].as_str().unwrap_or_default(),
            e[i]["counts"].clone(),
            e[i]["seq"].as_u64(),
            e[i]["state"].as_str().unwrap_or_default(),
        )
    };
    assert_eq!(
        fields(0),
        (
            "all_reduce",
            "f32",
            serde_json::json!([3]),
            Some(0),
            "completed"
        )
    );
    assert_eq!(
        fields(1),
        (
            "broadcast",
            "u8",
            serde_json::json!([5]),
            Some(1),
            "completed"
        )
    );
    assert_eq!(e[1]["peer"], 0);
    assert_eq!(
        (fields(2).0, fields(2).3, fields(2).4),
        ("monitored_barrier", Some(2), "failed")
    );
    assert_eq!(
        fields(3),
        (
            "all_reduce",
            "i64",
            serde_json::json!([7]),
            Some(3),
            "failed"
        )
    );
    let err = e[3]["error"]
        .as_str()
        .expect("the failed entry has its error");
    assert!(err.contains("timed out"), "{err}");
    assert!(e[3]["finished_ms"].as_f64() >= e[3]["started_ms"].as_f64());
}

/// A `HashStore` that runs a hook with the keys of every write before making it: to count
/// writes, or to play a store host that is slow to answer them.
struct Hooked<F: Fn(&[&str]) + Send + Sync> {
    inner: HashStore,
    before_write: F,
}

impl<F: Fn(&[&str]) + Send + Sync> Store for Hooked<F> {
    fn set(&self, key: &str, value: &[u8]) -> Result<(), StoreError> {
        (self.before_write)(&[key]);
        self.inner.set(key, value)
    }
    fn get(&self, key: &str) -> Result<Vec<u8>, StoreError> {
        self.inner.get(key)
    }
    fn add(&self, key: &str, delta: i64) -> Result<i64, StoreError> {
        (self.before_write)(&[key]);
        self.inner.add(key, delta)
    }
    fn compare_set(&self, key: &str, exp: &[u8], want: &[u8]) -> Result<Vec<u8>, StoreError> {
        (self.before_write)(&[key]);
        self.inner.compare_set(key, exp, want)
    }
    fn wait(&self, keys: &[&str], timeout: Duration) -> Result<(), StoreError> {
        self.inner.wait(keys, timeout)
    }
    fn check(&self, keys: &[&str]) -> Result<bool, StoreError> {
        self.inner.check(keys)
    }
    fn delete_key(&self, key: &str) -> Result<bool, StoreError> {
        self.inner.delete_key(key)
    }
    fn num_keys(&self) -> Result<u64, StoreError> {
        self.inner.num_keys()
    }
    fn append(&self, key: &str, value: &[u8]) -> Result<(), StoreError> {
        (self.before_write)(&[key]);
        self.inner.append(key, value)
    }
    fn multi_get(&self, keys: &[&str]) -> Result<Vec<Vec<u8>>, StoreError> {
        self.inner.multi_get(keys)
    }
    fn multi_set(&self, pairs: &[(&str, &[u8])]) -> Result<(), StoreError> {
        let keys: Vec<&str> = pairs.iter().map(|(k, _)| *k).collect();
        (self.before_write)(&keys);
        self.inner.multi_set(pairs)
    }
    fn queue_push(&self, key: &str, value: &[u8]) -> Result<(), StoreError> {
        (self.before_write)(&[key]);
        self.inner.queue_push(key, value)
    }
    fn queue_pop(&self, key: &str, block: bool) -> Result<Option<Vec<u8>>, StoreError> {
        self.inner.queue_pop(key, block)
    }
    fn queue_len(&self, key: &str) -> Result<u64, StoreError> {
        self.inner.queue_len(key)
    }
    fn timeout(&self) -> Duration {
        self.inner.timeout()
    }
}

#[test]
fn collectives_that_keep_completing_publish_no_progress() {
    const OPS: usize = 2000;
    let progress_sets = Arc::new(AtomicUsize::new(0));
    let counter = progress_sets.clone();
    let store = Arc::new(Hooked {
        inner: HashStore::new(Duration::from_secs(60)),
        before_write: move |keys: &[&str]| {
            if keys.iter().any(|k| k.contains("progress/")) {
                counter.fetch_add(1, Ordering::Relaxed);
            }
        },
    });
    std::thread::scope(|s| {
        for rank in 0..2 {
            let store: Arc<dyn Store> = store.clone();
            s.spawn(move || {
                let opts = InitOptions::new()
                    .store(store)
                    .rank(rank)
                    .world_size(2)
                    .timeout(Duration::from_secs(16));
                let pg = new_process_group(opts).expect("group");
                for i in 0..OPS {
                    let mut v = [i as u32];
                    pg.all_reduce(&mut v, ReduceOp::Sum).expect("all_reduce");
                    assert_eq!(v[0], 2 * i as u32);
                }
            });
        }
    });
    // A publish needs the rank's state to stay unchanged for 2 s (an eighth of the timeout,
    // capped): while collectives complete back to back there is none, so only idle moments
    // (set-up, the end) publish. Per-collective publishing would make this thousands.
    let sets = progress_sets.load(Ordering::Relaxed);
    assert!(sets <= 8, "{sets} progress writes for {OPS} collectives");
}

#[test]
fn a_receive_that_times_out_names_its_seq_and_peer() {
    let done = Barrier::new(2);
    let out = run_world_with(2, Duration::from_millis(300), |pg| {
        let r = if pg.rank() == 0 {
            pg.all_reduce(&mut [1u8], ReduceOp::Sum)?;
            let work = pg.irecv(vec![0u8; 4], 1, 5)?;
            let seq = work.seq();
            Some((seq, work.wait().expect_err("rank 1 never sends")))
        } else {
            pg.all_reduce(&mut [1u8], ReduceOp::Sum)?;
            None
        };
        done.wait();
        Ok(r)
    })
    .expect("every rank returns");
    let (seq, err) = out[0].as_ref().expect("rank 0 received");
    let msg = err.to_string();
    assert_eq!(*seq, 1, "the receive is the group's second operation");
    assert!(
        matches!(
            err,
            Error::Backend(dist_backend::Error::Timeout { rank: 0, seq: s, missing_peers, .. })
                if s == seq && missing_peers == &[1]
        ),
        "{msg}"
    );
    assert!(
        msg.contains("rank 0") && msg.contains("#1") && msg.contains("[1]"),
        "{msg}"
    );
}

/// Init's deadline, taken when it starts, bounds the Gloo mesh too: a store slow to count the
/// inits (2 s, as a loaded store host may be) leaves the mesh only what is left, instead of a
/// fresh timeout of its own. Rank 1 never comes, so rank 0 fails at init's deadline.
#[test]
fn init_ends_by_its_deadline_when_the_store_was_slow_before_the_mesh() {
    const INIT: Duration = Duration::from_secs(3);
    const SLOW: Duration = Duration::from_secs(2);
    let store = Arc::new(Hooked {
        inner: HashStore::new(Duration::from_secs(60)),
        before_write: |keys: &[&str]| {
            if keys == ["dist/world_inits"] {
                std::thread::sleep(SLOW);
            }
        },
    });
    let opts = InitOptions::new()
        .backend("gloo")
        .store(store)
        .rank(0)
        .world_size(2)
        .timeout(INIT);
    init_fails_in_time(opts, INIT, 0);
}

/// Runs the init `opts` of `rank`, whose other ranks never come: it must fail by `timeout`
/// (+ 1 s) from its call, naming `rank`.
fn init_fails_in_time(opts: InitOptions, timeout: Duration, rank: usize) {
    let start = Instant::now();
    let e = new_process_group(opts).expect_err("the other ranks never join");
    let took = start.elapsed();
    eprintln!("init failed after {took:?}: {e}");
    assert!(
        took <= timeout + Duration::from_secs(1),
        "init took {took:?}: {e}"
    );
    assert!(e.to_string().contains(&format!("rank {rank}")), "{e}");
}

/// Init's deadline is taken when init starts, so the time the store's host takes to answer
/// the first connection (2 s here: its server starts late on a listener bound already, as a
/// loaded host's might) comes out of the same budget as the Gloo mesh, instead of the mesh
/// getting a fresh timeout once the store is up. Rank 0 never comes, so rank 1 fails at
/// init's deadline.
#[test]
fn init_ends_by_its_deadline_when_the_store_host_answered_late() {
    const INIT: Duration = Duration::from_secs(3);
    const SLOW: Duration = Duration::from_secs(2);
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind the store's port");
    let port = listener.local_addr().expect("its address").port();
    let host = std::thread::spawn(move || {
        std::thread::sleep(SLOW);
        TcpStoreServer::from_listener(listener).expect("the store's server")
    });
    let opts = InitOptions::new()
        .backend("gloo")
        .init_method(format!("tcp://127.0.0.1:{port}"))
        .rank(1)
        .world_size(2)
        .timeout(INIT);
    init_fails_in_time(opts, INIT, 1);
    // The server is dropped only after init has given up.
    drop(host.join().expect("the store host thread"));
}
