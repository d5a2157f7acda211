//! A store server that stops answering while its connections stay open (its host SIGSTOPped):
//! every blocking call of the client, on a connection it has or on one it opens, fails by the
//! call's own deadline (+ 1 s), naming the server, and never waits a second timeout.
//!
//! The frozen host is a proxy in front of a real server: while frozen it still accepts TCP
//! connections (as a stopped process's kernel does) and forwards nothing.

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use dist_backend::Store;
use dist_backend::store::{StoreError, TcpStore, TcpStoreServer};

const T: Duration = Duration::from_secs(2);
const SLACK: Duration = Duration::from_secs(1);

/// A TCP proxy that can be frozen: bytes already in its hands are held, none move on.
struct Proxy {
    port: u16,
    frozen: Arc<AtomicBool>,
    /// Writes forwarded from clients to the server: each request the client sends (after the
    /// handshake's one) waits for its reply, so this counts requests on the wire.
    forwarded: Arc<AtomicUsize>,
    /// Every socket it made, shut down when the test ends so its threads exit.
    sockets: Arc<Mutex<Vec<TcpStream>>>,
    _server: TcpStoreServer,
}

impl Proxy {
    fn start() -> Proxy {
        let server = TcpStoreServer::start(0).unwrap();
        let target = server.port();
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let frozen = Arc::new(AtomicBool::new(false));
        let sockets = Arc::new(Mutex::new(Vec::new()));
        let forwarded = Arc::new(AtomicUsize::new(0));
        let (f, s, n) = (frozen.clone(), sockets.clone(), forwarded.clone());
        thread::spawn(move || {
            for client in listener.incoming() {
                let Ok(client) = client else { return };
                if f.load(Ordering::SeqCst) {
                    // Held open, never served.
                    s.lock().unwrap().push(client);
                    continue;
                }
                let Ok(upstream) = TcpStream::connect(("127.0.0.1", target)) else {
                    return;
                };
                let mut socks = s.lock().unwrap();
                socks.push(client.try_clone().unwrap());
                socks.push(upstream.try_clone().unwrap());
                drop(socks);
                let up = (client.try_clone().unwrap(), upstream.try_clone().unwrap());
                pump(up.0, up.1, f.clone(), Some(n.clone()));
                pump(upstream, client, f.clone(), None);
            }
        });
        Proxy {
            port,
            frozen,
            forwarded,
            sockets,
            _server: server,
        }
    }

    fn freeze(&self) {
        self.frozen.store(true, Ordering::SeqCst);
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        for s in self.sockets.lock().unwrap().iter() {
            let _ = s.shutdown(Shutdown::Both);
        }
    }
}

/// Copies `from` to `to` until either closes or the proxy freezes. The proxy keeps a handle on
/// every socket, so a pump that stops leaves its connection open and unread: the client's
/// requests sit in socket buffers, as they would at a stopped host.
fn pump(
    mut from: TcpStream,
    mut to: TcpStream,
    frozen: Arc<AtomicBool>,
    count: Option<Arc<AtomicUsize>>,
) {
    thread::spawn(move || {
        let mut buf = [0u8; 64 * 1024];
        loop {
            match from.read(&mut buf) {
                Ok(0) | Err(_) => return,
                // Read just as the freeze came: drop the bytes, as a stopped host never
                // gets to them.
                Ok(_) if frozen.load(Ordering::SeqCst) => return,
                Ok(n) => {
                    if to.write_all(&buf[..n]).is_err() {
                        return;
                    }
                    if let Some(c) = &count {
                        c.fetch_add(1, Ordering::SeqCst);
                    }
                }
            }
        }
    });
}

/// Runs `call` against a store whose server froze after `prepare`; asserts it fails within
/// `T` + 1 s naming the server, and returns the error.
fn frozen_call<R: std::fmt::Debug>(
    what: &str,
    prepare: impl FnOnce(&TcpStore),
    call: impl FnOnce(&TcpStore) -> Result<R, StoreError>,
) -> StoreError {
    let proxy = Proxy::start();
    let store = TcpStore::connect("127.0.0.1", proxy.port, T).unwrap();
    prepare(&store);
    proxy.freeze();
    let start = Instant::now();
    let e = call(&store).expect_err(what);
    let took = start.elapsed();
    eprintln!("{what}: failed after {took:?}: {e}");
    assert!(took <= T + SLACK, "{what} took {took:?}: {e}");
    assert!(
        e.to_string().contains(&format!("127.0.0.1:{}", proxy.port)),
        "{what}: {e}"
    );
    e
}

#[test]
fn every_call_fails_in_time_when_the_server_stops_answering() {
    let e = frozen_call("set", |_| {}, |s| s.set("k", b"v"));
    assert!(e.is_unreachable(), "{e}");
    frozen_call("add", |_| {}, |s| s.add("n", 1));
    frozen_call("compare_set", |_| {}, |s| s.compare_set("k", b"", b"v"));
    frozen_call("check", |_| {}, |s| s.check(&["k"]));
    frozen_call("get", |_| {}, |s| s.get("k"));
    frozen_call("multi_get", |_| {}, |s| s.multi_get(&["a", "b"]));
    frozen_call("queue_pop", |_| {}, |s| s.queue_pop("q", true));
    frozen_call("wait", |_| {}, |s| s.wait(&["k"], T));
    // A large value fills the socket buffers: the write itself must give up.
    let big = vec![7u8; 32 << 20];
    frozen_call("set of 32 MiB", |_| {}, |s| s.set("big", &big));
}

/// A wait on a key that is missing: the CHECK is answered, the WAIT is on the wire when the
/// server freezes. The call ends by its deadline plus the short cancel grace, not after a
/// second timeout for CANCEL_WAIT.
#[test]
fn a_wait_in_progress_ends_in_time_when_the_server_freezes() {
    let proxy = Proxy::start();
    let store = Arc::new(TcpStore::connect("127.0.0.1", proxy.port, T).unwrap());
    let s = store.clone();
    let start = Instant::now();
    let waiter = thread::spawn(move || {
        let r = s.wait(&["never"], T);
        (r, start.elapsed())
    });
    // Handshake, CHECK, WAIT: the third write reached the server, so the WAIT is pending.
    while proxy.forwarded.load(Ordering::SeqCst) < 3 {
        assert!(start.elapsed() < T, "the waiter never sent its WAIT");
        thread::yield_now();
    }
    proxy.freeze();
    let (r, took) = waiter.join().unwrap();
    let e = r.unwrap_err();
    eprintln!("wait in progress: failed after {took:?}: {e}");
    assert!(took <= T + SLACK, "{took:?}: {e}");
    assert!(e.is_unreachable(), "{e}");
}

/// Connecting to a host whose kernel completes the TCP handshake but whose process answers
/// nothing: `connect` fails within its timeout (the pool opens its connections the same way,
/// with the call's deadline).
#[test]
fn connecting_to_a_frozen_server_fails_in_time() {
    let proxy = Proxy::start();
    proxy.freeze();
    let start = Instant::now();
    let e = TcpStore::connect("127.0.0.1", proxy.port, T).unwrap_err();
    let took = start.elapsed();
    eprintln!("connect: failed after {took:?}: {e}");
    assert!(took <= T + SLACK, "{took:?}: {e}");
    assert!(e.is_unreachable(), "{e}");
}

/// The `_by` forms keep the caller's deadline, not the store's timeout: with a store timeout
/// of a minute, each call against the frozen server fails by its own deadline (`T` from now)
/// + 1 s.
#[test]
fn by_deadline_calls_keep_the_callers_deadline_when_the_server_freezes() {
    const LONG: Duration = Duration::from_secs(60);
    type CallBy = fn(&TcpStore, Instant) -> Result<(), StoreError>;
    let calls: [(&str, CallBy); 6] = [
        ("set_by", |s, d| s.set_by("k", b"v", d)),
        ("add_by", |s, d| s.add_by("n", 1, d).map(drop)),
        ("get_by", |s, d| s.get_by("k", d).map(drop)),
        ("wait_by", |s, d| s.wait_by(&["k"], d)),
        ("multi_set_by", |s, d| s.multi_set_by(&[("a", b"1")], d)),
        ("queue_pop_by", |s, d| {
            s.queue_pop_by("q", true, d).map(drop)
        }),
    ];
    for (what, call) in calls {
        let proxy = Proxy::start();
        let store = TcpStore::connect("127.0.0.1", proxy.port, LONG).unwrap();
        proxy.freeze();
        let start = Instant::now();
        let e = call(&store, start + T).expect_err(what);
        let took = start.elapsed();
        eprintln!("{what}: failed after {took:?}: {e}");
        assert!(took <= T + SLACK, "{what} took {took:?}: {e}");
        assert!(e.is_unreachable(), "{what}: {e}");
        assert!(
            e.to_string().contains(&format!("127.0.0.1:{}", proxy.port)),
            "{what}: {e}"
        );
    }
}

/// A deadline on a live server bounds the wait for a missing key, whatever the store timeout.
#[test]
fn by_deadline_waits_end_by_the_callers_deadline() {
    let server = TcpStoreServer::start(0).unwrap();
    let store = TcpStore::connect("127.0.0.1", server.port(), Duration::from_secs(60)).unwrap();
    let start = Instant::now();
    let e = store.get_by("missing", start + T).unwrap_err();
    let took = start.elapsed();
    assert!(e.is_timeout(), "{e}");
    assert!(took >= T && took <= T + SLACK, "{took:?}: {e}");
    store.set_by("present", b"x", Instant::now() + T).unwrap();
    assert_eq!(store.get_by("present", Instant::now() + T).unwrap(), b"x");
}
