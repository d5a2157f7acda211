//! One `TcpStore` shared by many threads: a blocking `wait` or `get` must not hold up the
//! other threads' calls, and the store's connections stay within its cap.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, mpsc};
use std::thread;
use std::time::Duration;

use dist_backend::store::{FileStore, HashStore, TcpStore, TcpStoreOptions, TcpStoreServer};
use dist_backend::{Store, StoreError};

/// Long enough never to pass in a healthy run: the tests end by releasing their waits.
const LONG: Duration = Duration::from_secs(30);

fn store(server: &TcpStoreServer, timeout: Duration) -> Arc<TcpStore> {
    Arc::new(TcpStore::connect("127.0.0.1", server.port(), timeout).unwrap())
}

#[test]
fn blocking_wait_does_not_hold_up_other_threads() {
    let server = TcpStoreServer::start(0).unwrap();
    let s = store(&server, LONG);
    let (about_to_wait, waiting) = mpsc::channel();
    let returned = Arc::new(AtomicBool::new(false));
    let a = thread::spawn({
        let s = Arc::clone(&s);
        let returned = Arc::clone(&returned);
        move || {
            about_to_wait.send(()).unwrap();
            // Only the test sets this key, once B is done: A cannot return Ok before that.
            let r = s.wait(&["released"], LONG);
            returned.store(true, Ordering::SeqCst);
            r
        }
    });
    waiting.recv().unwrap();
    // B: calls on the same store, on keys that exist or need no waiting, while A waits.
    let b = thread::spawn({
        let s = Arc::clone(&s);
        move || {
            s.set("k", b"v").unwrap();
            assert_eq!(s.get("k").unwrap(), b"v");
            assert_eq!(s.add("n", 5).unwrap(), 5);
            assert_eq!(s.add("n", 1).unwrap(), 6);
            assert!(s.check(&["k", "n"]).unwrap());
            assert!(!s.check(&["released"]).unwrap());
            s.wait(&["k"], LONG).unwrap();
            assert_eq!(
                s.multi_get(&["k", "n"]).unwrap(),
                [b"v".to_vec(), b"6".to_vec()]
            );
        }
    });
    b.join().unwrap();
    assert!(
        !returned.load(Ordering::SeqCst),
        "A's wait returned before its key existed: {:?}",
        a.join()
    );
    s.set("released", b"").unwrap();
    a.join().unwrap().unwrap();
    assert!(s.peak_connections() <= TcpStore::MAX_CONNECTIONS);
}

#[test]
fn blocking_get_does_not_hold_up_other_threads() {
    let server = TcpStoreServer::start(0).unwrap();
    let s = store(&server, LONG);
    let (about_to_get, getting) = mpsc::channel();
    let a = thread::spawn({
        let s = Arc::clone(&s);
        move || {
            about_to_get.send(()).unwrap();
            s.get("later")
        }
    });
    getting.recv().unwrap();
    for i in 0..20 {
        s.set(&format!("k{i}"), b"x").unwrap();
        assert_eq!(s.get(&format!("k{i}")).unwrap(), b"x");
    }
    assert!(!a.is_finished(), "get returned before its key existed");
    s.set("later", b"done").unwrap();
    assert_eq!(a.join().unwrap().unwrap(), b"done");
}

#[test]
fn writes_are_seen_by_the_next_call_on_any_connection() {
    // SET, APPEND, MULTI_SET and QUEUE_PUSH have no reply; with several connections a later
    // call could overtake them at the server unless the store waits until they are applied.
    let server = TcpStoreServer::start(0).unwrap();
    let s = store(&server, LONG);
    let hs: Vec<_> = (0..4)
        .map(|t| {
            let s = Arc::clone(&s);
            thread::spawn(move || {
                for j in 0..200 {
                    let k = format!("t{t}/{j}");
                    s.set(&k, b"").unwrap();
                    assert!(s.check(&[&k]).unwrap(), "{k} not there after set");
                    s.append(&format!("log{t}"), b"x").unwrap();
                    assert_eq!(s.get(&format!("log{t}")).unwrap().len(), j + 1);
                    s.multi_set(&[(&format!("m{t}"), j.to_string().as_bytes())])
                        .unwrap();
                    assert_eq!(s.get(&format!("m{t}")).unwrap(), j.to_string().as_bytes());
                    s.queue_push(&format!("q{t}"), b"i").unwrap();
                    assert_eq!(s.queue_len(&format!("q{t}")).unwrap(), j as u64 + 1);
                }
            })
        })
        .collect();
    for h in hs {
        h.join().unwrap();
    }
    // A write on one thread is seen by another thread that it told.
    let (tx, rx) = mpsc::channel::<String>();
    let reader = thread::spawn({
        let s = Arc::clone(&s);
        move || {
            for k in rx {
                assert!(s.check(&[&k]).unwrap(), "{k} not there after set");
            }
        }
    });
    for j in 0..200 {
        let k = format!("told{j}");
        s.set(&k, b"").unwrap();
        tx.send(k).unwrap();
    }
    drop(tx);
    reader.join().unwrap();
}

#[test]
fn many_waiters_share_a_bounded_pool() {
    const WAITERS: usize = 16;
    let server = TcpStoreServer::start(0).unwrap();
    let s = store(&server, LONG);
    let (ready, all_ready) = mpsc::channel();
    let waiters: Vec<_> = (0..WAITERS)
        .map(|i| {
            let s = Arc::clone(&s);
            let ready = ready.clone();
            thread::spawn(move || {
                ready.send(()).unwrap();
                s.wait(&[&format!("key{i}")], LONG)?;
                s.get(&format!("key{i}"))
            })
        })
        .collect();
    for _ in 0..WAITERS {
        all_ready.recv().unwrap();
    }
    // More waits than connections: the setter, on the same store, still gets through.
    let setter = thread::spawn({
        let s = Arc::clone(&s);
        move || {
            for i in 0..WAITERS {
                s.set(&format!("key{i}"), i.to_string().as_bytes()).unwrap();
            }
        }
    });
    setter.join().unwrap();
    for (i, w) in waiters.into_iter().enumerate() {
        assert_eq!(w.join().unwrap().unwrap(), i.to_string().as_bytes());
    }
    // The burst over, the store keeps only a few connections idle, and closes the rest.
    let open = s.open_connections();
    assert!(open <= TcpStore::MAX_IDLE, "{open} connections still open");
    let peak = s.peak_connections();
    assert!(
        peak <= TcpStore::MAX_CONNECTIONS,
        "{peak} connections at once"
    );
    // The server sees the closes (asynchronously: it counts a client gone once it reads the
    // end of its stream).
    let give_up = std::time::Instant::now() + LONG;
    while server.num_clients() > open {
        assert!(
            std::time::Instant::now() < give_up,
            "the server still counts {} clients, the store {open}",
            server.num_clients()
        );
        thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn chained_waits_beyond_the_cap_all_finish() {
    // Thread i waits for key i, then sets key i+1: the waits of the threads whose keys come
    // last can take every blocking connection, and the threads before them queue. Queued
    // calls look again whether their keys appeared, so the chain does not stall.
    const THREADS: usize = 16;
    let server = TcpStoreServer::start(0).unwrap();
    let s = store(&server, LONG);
    let (ready, all_ready) = mpsc::channel();
    let hs: Vec<_> = (0..THREADS)
        .rev()
        .map(|i| {
            let s = Arc::clone(&s);
            let ready = ready.clone();
            thread::spawn(move || {
                ready.send(()).unwrap();
                let v = s.get(&format!("link{i}"))?;
                s.set(&format!("link{}", i + 1), b"")?;
                Ok::<_, StoreError>(v)
            })
        })
        .collect();
    for _ in 0..THREADS {
        all_ready.recv().unwrap();
    }
    s.set("link0", b"start").unwrap();
    for h in hs {
        h.join().unwrap().unwrap();
    }
    s.wait(&[&format!("link{THREADS}")], LONG).unwrap();
    assert!(s.peak_connections() <= TcpStore::MAX_CONNECTIONS);
}

#[test]
fn blocking_queue_pops_beyond_the_cap_all_get_an_item() {
    const POPPERS: usize = 12;
    let server = TcpStoreServer::start(0).unwrap();
    let s = store(&server, LONG);
    let (ready, all_ready) = mpsc::channel();
    let hs: Vec<_> = (0..POPPERS)
        .map(|_| {
            let s = Arc::clone(&s);
            let ready = ready.clone();
            thread::spawn(move || {
                ready.send(()).unwrap();
                s.queue_pop("jobs", true)
            })
        })
        .collect();
    for _ in 0..POPPERS {
        all_ready.recv().unwrap();
    }
    for i in 0..POPPERS {
        s.queue_push("jobs", &[i as u8]).unwrap();
    }
    let mut got: Vec<u8> = hs
        .into_iter()
        .map(|h| h.join().unwrap().unwrap().unwrap()[0])
        .collect();
    got.sort_unstable();
    assert_eq!(got, (0..POPPERS as u8).collect::<Vec<_>>());
    assert_eq!(s.queue_len("jobs").unwrap(), 0);
    assert!(s.peak_connections() <= TcpStore::MAX_CONNECTIONS);
}

#[test]
fn queued_wait_times_out_while_the_pool_is_full() {
    let server = TcpStoreServer::start(0).unwrap();
    let s = store(&server, LONG);
    // Fill every place blocking calls may take.
    let blockers = TcpStore::MAX_CONNECTIONS - 1;
    let (ready, all_ready) = mpsc::channel();
    let hs: Vec<_> = (0..blockers)
        .map(|i| {
            let s = Arc::clone(&s);
            let ready = ready.clone();
            thread::spawn(move || {
                ready.send(()).unwrap();
                s.wait(&[&format!("hold{i}")], LONG)
            })
        })
        .collect();
    for _ in 0..blockers {
        all_ready.recv().unwrap();
    }
    // Whether it queued or got a connection, a short wait ends in time, as a timeout naming
    // its key, and the store goes on working.
    let e = s.wait(&["short"], Duration::from_millis(200)).unwrap_err();
    match &e {
        StoreError::Timeout { op, keys, .. } => {
            assert_eq!(*op, "wait");
            assert_eq!(keys, &["/short"]);
        }
        other => panic!("{other}"),
    }
    s.set("after", b"1").unwrap();
    assert_eq!(s.get("after").unwrap(), b"1");
    for i in 0..blockers {
        s.set(&format!("hold{i}"), b"").unwrap();
    }
    for h in hs {
        h.join().unwrap().unwrap();
    }
    assert!(s.peak_connections() <= TcpStore::MAX_CONNECTIONS);
}

#[test]
fn failed_connections_give_their_places_back() {
    let server = TcpStoreServer::start(0).unwrap();
    let s = store(&server, Duration::from_millis(300));
    // Open a few connections at once.
    let hs: Vec<_> = (0..4)
        .map(|i| {
            let s = Arc::clone(&s);
            thread::spawn(move || s.wait(&[&format!("w{i}")], Duration::from_millis(100)))
        })
        .collect();
    for h in hs {
        assert!(h.join().unwrap().unwrap_err().is_timeout());
    }
    let open = s.open_connections();
    assert!((1..=4).contains(&open), "{open}");
    drop(server);
    // Each call fails on a dead connection (closing it), the last on connecting again; none
    // keeps its place. `set` too, though SET has no reply: its confirming PING has none.
    for _ in 0..=open {
        assert!(s.set("x", b"1").is_err());
    }
    assert_eq!(s.open_connections(), 0);
}

#[test]
fn no_timeout_means_waiting_for_ever_without_panicking() {
    let server = TcpStoreServer::start(0).unwrap();
    let s = store(&server, Duration::MAX);
    assert_eq!(s.timeout(), Duration::MAX);
    s.set("k", b"v").unwrap();
    assert_eq!(s.get("k").unwrap(), b"v");
    s.wait(&["k"], Duration::MAX).unwrap();
    assert_eq!(s.multi_get(&["k"]).unwrap(), [b"v".to_vec()]);
    s.queue_push("q", b"item").unwrap();
    assert_eq!(s.queue_pop("q", true).unwrap().unwrap(), b"item");
    // A key that appears later, through a wait with no deadline.
    let h = thread::spawn({
        let s = Arc::clone(&s);
        move || s.get("later")
    });
    s.set("later", b"x").unwrap();
    assert_eq!(h.join().unwrap().unwrap(), b"x");

    // The master's path too (connect, init/ counter).
    let mut o = TcpStoreOptions::new("127.0.0.1", 0);
    o.is_master = true;
    o.world_size = Some(1);
    o.timeout = Duration::MAX;
    let m = TcpStore::new(&o).unwrap();
    m.set("a", b"b").unwrap();
    assert_eq!(m.get("a").unwrap(), b"b");

    // The other stores.
    let dir = tempfile::tempdir().unwrap();
    let stores: [Arc<dyn Store>; 2] = [
        Arc::new(HashStore::new(Duration::MAX)),
        Arc::new(FileStore::new(dir.path().join("f"), Duration::MAX).unwrap()),
    ];
    for s in stores {
        s.set("k", b"v").unwrap();
        assert_eq!(s.get("k").unwrap(), b"v");
        s.wait(&["k"], Duration::MAX).unwrap();
    }
}
