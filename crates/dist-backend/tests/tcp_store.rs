//! The TCP store against its protocol: raw bytes as torch sends them, cancelled waits, bad
//! clients, many clients, and the server's thread count.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::thread;
use std::time::{Duration, Instant};

use dist_backend::store::{TcpStore, TcpStoreOptions, TcpStoreServer};
use dist_backend::{Store, StoreError};
use socket2::{Domain, Protocol, Socket, Type};

const T: Duration = Duration::from_secs(10);

/// A raw, validated connection.
fn raw(port: u16) -> TcpStream {
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(T)).unwrap();
    s.write_all(&[0x00, 0xce, 0xf7, 0x85, 0x3c]).unwrap();
    s
}

fn str_(b: &[u8]) -> Vec<u8> {
    let mut v = (b.len() as u64).to_le_bytes().to_vec();
    v.extend_from_slice(b);
    v
}

/// True when the server closed `s` (read returns 0 or a reset) within the timeout.
fn closed_by_server(s: &mut TcpStream) -> bool {
    let mut b = [0u8; 64];
    loop {
        match s.read(&mut b) {
            Ok(0) => return true,
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return true,
            Err(_) => return false,
        }
    }
}

#[test]
fn raw_bytes_match_torch() {
    let server = TcpStoreServer::start(0).unwrap();
    let mut s = raw(server.port());
    // PING with a nonce echoes it.
    s.write_all(&[0x0d, 0x78, 0x56, 0x34, 0x12]).unwrap();
    let mut b4 = [0u8; 4];
    s.read_exact(&mut b4).unwrap();
    assert_eq!(u32::from_le_bytes(b4), 0x1234_5678);
    // ADD on the raw init/ key.
    let mut add = vec![0x04];
    add.extend(str_(b"init/"));
    add.extend(1i64.to_le_bytes());
    s.write_all(&add).unwrap();
    let mut b8 = [0u8; 8];
    s.read_exact(&mut b8).unwrap();
    assert_eq!(i64::from_le_bytes(b8), 1);

    // A client's user key travels as "/k".
    let client = TcpStore::connect("127.0.0.1", server.port(), T).unwrap();
    client.set("k", b"hello").unwrap();
    client.add("ctr", 3).unwrap();
    let mut get = vec![0x03];
    get.extend(str_(b"/k"));
    s.write_all(&get).unwrap();
    s.read_exact(&mut b8).unwrap();
    assert_eq!(u64::from_le_bytes(b8), 5);
    let mut v = [0u8; 5];
    s.read_exact(&mut v).unwrap();
    assert_eq!(&v, b"hello");
    // The counter is stored as decimal ASCII.
    let mut get = vec![0x03];
    get.extend(str_(b"/ctr"));
    s.write_all(&get).unwrap();
    s.read_exact(&mut b8).unwrap();
    assert_eq!(u64::from_le_bytes(b8), 1);
    s.read_exact(&mut v[..1]).unwrap();
    assert_eq!(v[0], b'3');
    // GETNUMKEYS counts init/ too.
    assert_eq!(client.num_keys().unwrap(), 3);
    let mut keys = client.list_keys().unwrap();
    keys.sort();
    assert_eq!(keys, ["/ctr", "/k", "init/"]);
    // CHECK answers 0 when ready, 1 when not.
    let mut check = vec![0x05];
    check.extend(1u64.to_le_bytes());
    check.extend(str_(b"/k"));
    check.push(0x05);
    check.extend(1u64.to_le_bytes());
    check.extend(str_(b"/nope"));
    s.write_all(&check).unwrap();
    let mut b2 = [0u8; 2];
    s.read_exact(&mut b2).unwrap();
    assert_eq!(b2, [0, 1]);
}

#[test]
fn raw_wait_and_cancel() {
    let server = TcpStoreServer::start(0).unwrap();
    let mut s = raw(server.port());
    let mut wait = vec![0x06];
    wait.extend(2u64.to_le_bytes());
    wait.extend(str_(b"/a"));
    wait.extend(str_(b"/b"));
    s.write_all(&wait).unwrap();
    let other = TcpStore::connect("127.0.0.1", server.port(), T).unwrap();
    other.set("a", b"").unwrap();
    other.set("b", b"").unwrap();
    let mut b = [0u8; 1];
    s.read_exact(&mut b).unwrap();
    assert_eq!(b[0], 0, "STOP_WAITING once both keys exist");
    // Wait, then cancel: only WAIT_CANCELED comes back.
    let mut wait = vec![0x06];
    wait.extend(1u64.to_le_bytes());
    wait.extend(str_(b"/never"));
    s.write_all(&wait).unwrap();
    s.write_all(&[0x0c]).unwrap();
    s.read_exact(&mut b).unwrap();
    assert_eq!(b[0], 1);
    // The cancelled wait is forgotten: setting the key sends nothing more.
    other.set("never", b"x").unwrap();
    s.write_all(&[0x0d, 9, 0, 0, 0]).unwrap();
    let mut b4 = [0u8; 4];
    s.read_exact(&mut b4).unwrap();
    assert_eq!(b4, [9, 0, 0, 0]);
}

#[test]
fn wait_timeout_cancels_and_connection_stays_usable() {
    let server = TcpStoreServer::start(0).unwrap();
    let c = TcpStore::connect("127.0.0.1", server.port(), T).unwrap();
    let t0 = Instant::now();
    let e = c.wait(&["never"], Duration::from_millis(300)).unwrap_err();
    assert!(t0.elapsed() >= Duration::from_millis(300));
    // The wait's own timeout, not the store's (T, 10 s), with seconds of slack.
    assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
    match &e {
        StoreError::Timeout { op, keys, addr, .. } => {
            assert_eq!(*op, "wait");
            assert_eq!(keys, &["/never"]);
            assert!(addr.contains(&server.port().to_string()));
        }
        other => panic!("{other}"),
    }
    assert!(e.to_string().contains("wait timeout after"), "{e}");
    // Same connection, still in sync.
    c.set("x", b"1").unwrap();
    assert_eq!(c.get("x").unwrap(), b"1");
    assert_eq!(c.add("n", 2).unwrap(), 2);
    // A wait that another client satisfies.
    let port = server.port();
    let h = thread::spawn(move || {
        // Usually sets the key while `c` waits; set first, the wait returns at once: either way
        // it succeeds, so the timing does not matter.
        thread::sleep(Duration::from_millis(100));
        TcpStore::connect("127.0.0.1", port, T)
            .unwrap()
            .set("never", b"")
            .unwrap();
    });
    c.wait(&["never", "x"], T).unwrap();
    h.join().unwrap();
}

#[test]
fn bad_clients_are_dropped_and_others_keep_their_keys() {
    let server = TcpStoreServer::start(0).unwrap();
    let port = server.port();
    let good = TcpStore::connect("127.0.0.1", port, T).unwrap();
    good.set("keep", b"safe").unwrap();
    // A waiter that must survive the bad clients.
    let waiter = thread::spawn(move || {
        let w = TcpStore::connect("127.0.0.1", port, T).unwrap();
        w.get("later").unwrap()
    });

    // 1. Garbage without VALIDATE.
    let mut g = TcpStream::connect(("127.0.0.1", port)).unwrap();
    g.set_read_timeout(Some(T)).unwrap();
    g.write_all(b"GET / HTTP/1.1\r\n\r\n").unwrap();
    assert!(closed_by_server(&mut g));
    // 2. Wrong magic.
    let mut g = TcpStream::connect(("127.0.0.1", port)).unwrap();
    g.set_read_timeout(Some(T)).unwrap();
    g.write_all(&[0x00, 1, 2, 3, 4]).unwrap();
    assert!(closed_by_server(&mut g));
    // 3. Unknown query code after VALIDATE.
    let mut g = raw(port);
    g.write_all(&[0x7f]).unwrap();
    assert!(closed_by_server(&mut g));
    // 4. Oversized key length.
    let mut g = raw(port);
    let mut req = vec![0x01];
    req.extend((1u64 << 40).to_le_bytes());
    g.write_all(&req).unwrap();
    assert!(closed_by_server(&mut g));
    // 5. Oversized list count.
    let mut g = raw(port);
    let mut req = vec![0x06];
    req.extend(u64::MAX.to_le_bytes());
    g.write_all(&req).unwrap();
    assert!(closed_by_server(&mut g));
    // 6. Truncated frame, then the client goes away.
    let mut g = raw(port);
    let mut req = vec![0x01];
    req.extend(str_(b"/keep"));
    req.extend(100u64.to_le_bytes());
    req.extend(b"partial");
    g.write_all(&req).unwrap();
    drop(g);
    // 7. ADD on a key that holds text.
    let mut g = raw(port);
    let mut req = vec![0x04];
    req.extend(str_(b"/keep"));
    req.extend(1i64.to_le_bytes());
    g.write_all(&req).unwrap();
    assert!(closed_by_server(&mut g));
    // 8. Random bytes, many times.
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    for _ in 0..20 {
        let mut g = raw(port);
        let bytes: Vec<u8> = (0..64)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                (x >> 56) as u8 | 0x80
            })
            .collect();
        let _ = g.write_all(&bytes);
        assert!(closed_by_server(&mut g));
    }

    // The good client, its keys and the waiter are unaffected.
    assert_eq!(good.get("keep").unwrap(), b"safe");
    good.set("later", b"done").unwrap();
    assert_eq!(waiter.join().unwrap(), b"done");
    assert_eq!(good.num_keys().unwrap(), 2);
    let fresh = TcpStore::connect("127.0.0.1", port, T).unwrap();
    assert_eq!(fresh.get("keep").unwrap(), b"safe");
}

#[test]
fn client_refuses_oversized_values_before_sending() {
    let server = TcpStoreServer::start(0).unwrap();
    let c = TcpStore::connect("127.0.0.1", server.port(), T).unwrap();
    let key = "k".repeat(9000);
    let e = c.set(&key, b"").unwrap_err();
    assert!(matches!(e, StoreError::Wire { op: "set", .. }), "{e}");
    c.set("small", b"ok").unwrap();
    assert_eq!(c.get("small").unwrap(), b"ok");
}

#[test]
fn bind_error_names_address_and_errno() {
    let server = TcpStoreServer::start(0).unwrap();
    let e = TcpStoreServer::start(server.port()).unwrap_err();
    let msg = e.to_string();
    assert!(matches!(e, StoreError::Bind { errno: 98, .. }), "{msg}");
    assert!(msg.contains(&format!("0.0.0.0:{}", server.port())), "{msg}");
    assert!(msg.contains("errno 98"), "{msg}");
}

/// A socket bound to a free port of 127.0.0.1 that does not listen yet: connecting to it is
/// refused, and no other process can take the port while the socket is held.
fn bound_not_listening() -> (Socket, u16) {
    let sock = Socket::new(Domain::IPV4, Type::STREAM, Some(Protocol::TCP)).unwrap();
    sock.bind(&SocketAddr::from(([127, 0, 0, 1], 0)).into())
        .unwrap();
    let port = sock.local_addr().unwrap().as_socket().unwrap().port();
    (sock, port)
}

/// Starts a server on a socket from [`bound_not_listening`].
fn serve_on(sock: Socket) -> TcpStoreServer {
    sock.listen(128).unwrap();
    TcpStoreServer::from_listener(sock.into()).unwrap()
}

#[test]
fn connect_retries_until_the_server_is_up() {
    // The port is ours from the start; the server listens on it only after the client began
    // connecting (and was refused).
    let (sock, port) = bound_not_listening();
    let h = thread::spawn(move || {
        // Usually listens after the client was refused a few times; listening first, the
        // client connects at once: either way it succeeds, so the timing does not matter.
        thread::sleep(Duration::from_millis(300));
        serve_on(sock)
    });
    let c = TcpStore::connect("127.0.0.1", port, T).unwrap();
    c.set("up", b"1").unwrap();
    assert_eq!(c.get("up").unwrap(), b"1");
    drop(c);
    drop(h.join().unwrap());
}

#[test]
fn connect_gives_up_after_timeout() {
    let (_sock, port) = bound_not_listening();
    let t0 = Instant::now();
    let e = TcpStore::connect("127.0.0.1", port, Duration::from_millis(300)).unwrap_err();
    // It gave up once its 300 ms were spent, not sooner, and did not hang.
    assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
    match &e {
        StoreError::Connect { waited, .. } => {
            assert!(*waited >= Duration::from_millis(300), "{e}")
        }
        other => panic!("{other}"),
    }
    assert!(e.to_string().contains(&format!("127.0.0.1:{port}")), "{e}");
}

#[test]
fn master_waits_for_workers() {
    let (sock, port) = bound_not_listening();
    let mut opts = TcpStoreOptions::new("127.0.0.1", port);
    opts.world_size = Some(4);
    opts.timeout = T;
    let mut mo = opts.clone();
    mo.is_master = true;
    // The master blocks until all four clients incremented init/; workers retry until it is up.
    let master = thread::spawn(move || TcpStore::with_server(serve_on(sock), &mo).unwrap());
    let workers: Vec<_> = (0..3)
        .map(|_| {
            let o = opts.clone();
            thread::spawn(move || TcpStore::new(&o).unwrap())
        })
        .collect();
    let workers: Vec<TcpStore> = workers.into_iter().map(|w| w.join().unwrap()).collect();
    let m = master.join().unwrap();
    assert_eq!(m.port(), port);
    assert!(m.server().is_some());
    workers[0].set("from_worker", b"1").unwrap();
    assert_eq!(m.get("from_worker").unwrap(), b"1");
    let mut raw_get = raw(port);
    let mut get = vec![0x03];
    get.extend(str_(b"init/"));
    raw_get.write_all(&get).unwrap();
    let mut b = [0u8; 9];
    raw_get.read_exact(&mut b).unwrap();
    assert_eq!(b[8], b'4');

    // A real master with port 0 and world size 1 needs nobody else.
    let mut o = TcpStoreOptions::new("127.0.0.1", 0);
    o.is_master = true;
    o.world_size = Some(1);
    o.timeout = T;
    let m = TcpStore::new(&o).unwrap();
    assert_ne!(m.port(), 0);
    assert_eq!(m.server().unwrap().port(), m.port());
    m.set("x", b"y").unwrap();
    let w = TcpStore::connect("127.0.0.1", m.port(), T).unwrap();
    assert_eq!(w.get("x").unwrap(), b"y");
}

#[test]
fn master_reports_missing_workers() {
    let mut o = TcpStoreOptions::new("127.0.0.1", 0);
    o.is_master = true;
    o.world_size = Some(3);
    o.timeout = Duration::from_millis(300);
    let e = TcpStore::new(&o).unwrap_err();
    assert!(
        matches!(
            e,
            StoreError::WorkersMissing {
                joined: 1,
                expected: 3,
                ..
            }
        ),
        "{e}"
    );
    assert!(e.to_string().contains("1/3 clients joined"), "{e}");
}

#[test]
fn an_add_after_the_server_is_gone_fails_long_before_the_timeout() {
    // A closed connection on `add` makes the client look at the key, to say whether it held
    // text; with the server gone, that look must not retry its connection for the timeout.
    let timeout = Duration::from_secs(60);
    let server = TcpStoreServer::start(0).unwrap();
    let c = TcpStore::connect("127.0.0.1", server.port(), timeout).unwrap();
    assert_eq!(c.add("n", 1).unwrap(), 1);
    drop(server);
    let t0 = Instant::now();
    let e = c.add("n", 1).unwrap_err();
    assert!(!matches!(e, StoreError::NotACounter { .. }), "{e:?}");
    assert!(t0.elapsed() < timeout / 4, "{:?}: {e}", t0.elapsed());
}

#[test]
fn server_stops_on_drop() {
    let server = TcpStoreServer::start(0).unwrap();
    let port = server.port();
    let c = TcpStore::connect("127.0.0.1", port, T).unwrap();
    c.set("a", b"1").unwrap();
    let t0 = Instant::now();
    drop(server);
    // Dropping wakes the event loop and joins it: no wait for a timeout or a client.
    assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
    assert!(c.get("a").is_err());
}

#[test]
fn concurrent_clients_on_one_server() {
    let server = TcpStoreServer::start(0).unwrap();
    let port = server.port();
    let hs: Vec<_> = (0..16)
        .map(|i| {
            thread::spawn(move || {
                let c = TcpStore::connect("127.0.0.1", port, T).unwrap();
                for j in 0..50 {
                    c.add("hits", 1).unwrap();
                    c.set(&format!("k{i}/{j}"), format!("{i}:{j}").as_bytes())
                        .unwrap();
                }
                c.get(&format!("k{}/49", (i + 1) % 16)).unwrap()
            })
        })
        .collect();
    for (i, h) in hs.into_iter().enumerate() {
        assert_eq!(h.join().unwrap(), format!("{}:49", (i + 1) % 16).as_bytes());
    }
    let c = TcpStore::connect("127.0.0.1", port, T).unwrap();
    assert_eq!(c.get("hits").unwrap(), b"800");
    assert_eq!(c.num_keys().unwrap(), 1 + 16 * 50);
}
