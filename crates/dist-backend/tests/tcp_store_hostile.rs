//! A TCP store under hostile or broken clients keeps serving the good ones: connections that
//! never validate are closed, partly sent requests are bounded in memory, and running out of
//! file descriptors evicts idle unvalidated connections instead of locking everyone out.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::{Command, Stdio};
use std::time::Duration;

use dist_backend::Store;
use dist_backend::store::{ServerLimits, TcpStore, TcpStoreServer};

/// Long enough never to fire on a loaded machine; the assertions do not depend on it.
const CLIENT_TIMEOUT: Duration = Duration::from_secs(30);

fn loopback() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 0))
}

/// True once the server has closed `s` (EOF or reset), waiting at most `CLIENT_TIMEOUT`.
fn closed_by_server(s: &mut TcpStream) -> bool {
    s.set_read_timeout(Some(CLIENT_TIMEOUT)).expect("timeout");
    let mut buf = [0u8; 4096];
    loop {
        match s.read(&mut buf) {
            Ok(0) => return true,
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => {
                return !matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                );
            }
        }
    }
}

/// True once the server has closed one of `streams`, waiting at most `CLIENT_TIMEOUT`.
fn any_closed_by_server(streams: &mut [TcpStream]) -> bool {
    let deadline = std::time::Instant::now() + CLIENT_TIMEOUT;
    let mut buf = [0u8; 4096];
    while std::time::Instant::now() < deadline {
        for s in streams.iter_mut() {
            s.set_read_timeout(Some(Duration::from_millis(50)))
                .expect("timeout");
            match s.read(&mut buf) {
                Ok(0) => return true,
                Ok(_) => {}
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock
                            | std::io::ErrorKind::TimedOut
                            | std::io::ErrorKind::Interrupted
                    ) => {}
                Err(_) => return true,
            }
        }
    }
    false
}

/// A VALIDATE request (query 0, magic 0x3C85F7CE).
fn validate() -> Vec<u8> {
    let mut v = vec![0u8];
    v.extend_from_slice(&0x3C85_F7CEu32.to_le_bytes());
    v
}

/// The start of a SET of `key` whose value is announced as `len` bytes.
fn set_header(key: &[u8], len: u64) -> Vec<u8> {
    let mut v = vec![1u8];
    v.extend_from_slice(&(key.len() as u64).to_le_bytes());
    v.extend_from_slice(key);
    v.extend_from_slice(&len.to_le_bytes());
    v
}

fn good_client_works(port: u16, tag: &str) {
    let store = TcpStore::connect("127.0.0.1", port, CLIENT_TIMEOUT).expect("good client connects");
    for i in 0..20i64 {
        let key = format!("{tag}/{i}");
        store.set(&key, key.as_bytes()).expect("set");
        assert_eq!(store.get(&key).expect("get"), key.as_bytes());
        assert_eq!(store.add(&format!("{tag}/n"), 1).expect("add"), i + 1);
    }
}

#[test]
fn garbage_and_unvalidated_connections_are_closed_while_good_clients_work() {
    let limits = ServerLimits {
        validation_timeout: Duration::from_secs(1),
        ..ServerLimits::DEFAULT
    };
    let server = TcpStoreServer::start_on(loopback(), limits).expect("server");
    let addr = server.local_addr();
    // Random bytes (query byte 0xAB is no query), a huge length before any VALIDATE, and an
    // idle connection that never sends anything.
    let mut garbage = TcpStream::connect(addr).expect("connect");
    garbage.write_all(&[0xAB; 1000]).expect("write");
    let mut huge = TcpStream::connect(addr).expect("connect");
    huge.write_all(&set_header(b"k", u64::MAX)).expect("write");
    let mut idle = TcpStream::connect(addr).expect("connect");
    good_client_works(server.port(), "during");
    assert!(
        closed_by_server(&mut garbage),
        "garbage connection left open"
    );
    assert!(
        closed_by_server(&mut huge),
        "unvalidated huge request left open"
    );
    assert!(
        closed_by_server(&mut idle),
        "idle unvalidated connection left open"
    );
    good_client_works(server.port(), "after");
}

#[test]
fn partly_sent_requests_are_bounded_in_memory() {
    let limits = ServerLimits {
        max_buffered_total: 4 << 20,
        ..ServerLimits::DEFAULT
    };
    let server = TcpStoreServer::start_on(loopback(), limits).expect("server");
    let addr = server.local_addr();
    // Two validated clients each announce a 60 MiB value and send 3 MiB of it, then hold:
    // together they pass the 4 MiB budget, so the server must close at least one.
    let chunk = vec![7u8; 3 << 20];
    let mut holders: Vec<TcpStream> = (0..2)
        .map(|i| {
            let mut s = TcpStream::connect(addr).expect("connect");
            s.write_all(&validate()).expect("validate");
            s.write_all(&set_header(format!("big{i}").as_bytes(), 60 << 20))
                .expect("header");
            // The write fails once the server has closed the connection: that is fine.
            let _ = s.write_all(&chunk);
            s
        })
        .collect();
    assert!(
        any_closed_by_server(&mut holders),
        "the server kept 6 MiB of partial requests under a 4 MiB budget"
    );
    good_client_works(server.port(), "budget");
}

/// Set by the parent to make `server_with_128_descriptors` serve instead of returning.
const CHILD_ENV: &str = "DIST_TEST_FD_LIMITED_STORE";

/// The child half of `a_full_descriptor_table_does_not_lock_out_good_clients`: a store server
/// in a process limited to 128 open files. Prints its port, serves until stdin closes.
#[test]
fn server_with_128_descriptors() {
    if std::env::var_os(CHILD_ENV).is_none() {
        return;
    }
    let lim = libc::rlimit {
        rlim_cur: 128,
        rlim_max: 128,
    };
    // SAFETY: setrlimit reads the struct we pass and has no other memory effect.
    let rc = unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &lim) };
    assert_eq!(rc, 0, "setrlimit");
    let limits = ServerLimits {
        validation_timeout: Duration::from_secs(2),
        ..ServerLimits::DEFAULT
    };
    let server = TcpStoreServer::start_on(loopback(), limits).expect("server");
    println!("PORT {}", server.port());
    std::io::stdout().flush().expect("flush");
    let mut sink = String::new();
    let _ = std::io::stdin().read_to_string(&mut sink);
}

#[test]
fn a_full_descriptor_table_does_not_lock_out_good_clients() {
    let exe = std::env::current_exe().expect("test binary");
    let mut child = Command::new(exe)
        .args(["--exact", "server_with_128_descriptors", "--nocapture"])
        .env(CHILD_ENV, "1")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("child server");
    let stdout = child.stdout.take().expect("stdout");
    // Read the port, then keep draining: the child's test harness prints after it.
    let (tx, rx) = std::sync::mpsc::channel::<u16>();
    let drain = std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if let Some(p) = line
                .strip_prefix("PORT ")
                .and_then(|p| p.trim().parse().ok())
            {
                let _ = tx.send(p);
            }
        }
    });
    let port = rx.recv().expect("the child's port");
    // 200 connections that never validate: more than the child has descriptors.
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    let idle: Vec<TcpStream> = (0..200)
        .filter_map(|_| TcpStream::connect(addr).ok())
        .collect();
    assert!(
        idle.len() >= 128,
        "only {} idle connections made",
        idle.len()
    );
    good_client_works(port, "crowded");
    drop(idle);
    drop(child.stdin.take());
    let status = child.wait().expect("child exit");
    drain.join().expect("drain");
    assert!(status.success(), "child server failed: {status}");
}

/// xorshift64*: reproducible random bytes without a dependency.
fn random_bytes(seed: u64, n: usize) -> Vec<u8> {
    let mut x = seed | 1;
    (0..n)
        .map(|_| {
            x ^= x >> 12;
            x ^= x << 25;
            x ^= x >> 27;
            (x.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 56) as u8
        })
        .collect()
}

#[test]
fn random_bytes_from_many_connections_never_disturb_good_clients() {
    let server = TcpStoreServer::start_on(loopback(), ServerLimits::DEFAULT).expect("server");
    let addr = server.local_addr();
    let port = server.port();
    std::thread::scope(|s| {
        for t in 0..16u64 {
            s.spawn(move || {
                for i in 0..25u64 {
                    let seed = t * 1000 + i + 1;
                    let Ok(mut c) = TcpStream::connect(addr) else {
                        continue;
                    };
                    // Half of them validate first, so the garbage reaches the request decoder.
                    if seed % 2 == 0 {
                        let _ = c.write_all(&validate());
                    }
                    let len = 1 + (seed as usize * 7919) % 4096;
                    let _ = c.write_all(&random_bytes(seed, len));
                    // Dropped here: closed mid-request, or left for the server to close.
                }
            });
        }
        s.spawn(move || good_client_works(port, "amid-garbage"));
    });
    good_client_works(port, "after-garbage");
}

/// A `str` on the wire: u64 length, then the bytes.
fn wire_str(v: &mut Vec<u8>, s: &[u8]) {
    v.extend_from_slice(&(s.len() as u64).to_le_bytes());
    v.extend_from_slice(s);
}

/// Reads what the server sends `s` until it closes it; `None` if it does not within
/// `CLIENT_TIMEOUT`.
fn bytes_until_closed(s: &mut TcpStream) -> Option<usize> {
    s.set_read_timeout(Some(CLIENT_TIMEOUT)).expect("timeout");
    let (mut got, mut buf) = (0, vec![0u8; 1 << 16]);
    loop {
        match s.read(&mut buf) {
            Ok(0) => return Some(got),
            Ok(n) => got += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                return None;
            }
            Err(_) => return Some(got),
        }
    }
}

/// Requests whose replies would pass the output budget are refused before the replies are
/// built: one MULTI_GET naming a large value many times (which cloned it that many times
/// first: 131,072 names of a 64 MiB value asked for 8 TiB), or GETs pipelined in one write.
/// The connection is closed with nothing sent, and good clients go on.
#[test]
fn replies_past_the_output_budget_are_refused_before_they_are_built() {
    let limits = ServerLimits {
        max_pending_output: 1 << 20,
        ..ServerLimits::DEFAULT
    };
    let server = TcpStoreServer::start_on(loopback(), limits).expect("server");
    let good = TcpStore::connect("127.0.0.1", server.port(), CLIENT_TIMEOUT).expect("connect");
    good.set("big", &vec![7u8; 600 << 10]).expect("set");
    let mut multi = validate();
    multi.push(0x0a);
    multi.extend_from_slice(&4u64.to_le_bytes());
    for _ in 0..4 {
        wire_str(&mut multi, b"/big");
    }
    let mut gets = validate();
    for _ in 0..4 {
        gets.push(0x03);
        wire_str(&mut gets, b"/big");
    }
    for (what, req) in [("multi_get", multi), ("pipelined gets", gets)] {
        let mut s = TcpStream::connect(server.local_addr()).expect("connect");
        s.write_all(&req).expect("write");
        assert_eq!(bytes_until_closed(&mut s), Some(0), "{what}");
        good_client_works(server.port(), what);
    }
    // Within the budget, the same requests are answered.
    assert_eq!(
        good.multi_get(&["big"]).expect("multi_get")[0].len(),
        600 << 10
    );
}

/// Set by the parent to make `server_with_a_soft_limit_of_128` serve instead of returning.
const SOFT_CHILD_ENV: &str = "DIST_TEST_SOFT_LIMITED_STORE";

/// The child half of `a_low_soft_open_file_limit_does_not_cap_the_clients`: a store server in
/// a process whose soft open-file limit is 128 under a higher hard one (as most systems set
/// 1024 under a higher hard limit). Prints its port and its soft limit once the server runs,
/// then serves until stdin closes.
#[test]
fn server_with_a_soft_limit_of_128() {
    if std::env::var_os(SOFT_CHILD_ENV).is_none() {
        return;
    }
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes one rlimit into `lim`; setrlimit only reads its argument.
    unsafe {
        assert_eq!(libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim), 0);
        lim.rlim_cur = 128;
        assert_eq!(libc::setrlimit(libc::RLIMIT_NOFILE, &lim), 0, "setrlimit");
    }
    let server = TcpStoreServer::start_on(loopback(), ServerLimits::DEFAULT).expect("server");
    // SAFETY: as above.
    unsafe { assert_eq!(libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim), 0) };
    println!("PORT {} SOFT {}", server.port(), lim.rlim_cur);
    std::io::stdout().flush().expect("flush");
    let mut sink = String::new();
    let _ = std::io::stdin().read_to_string(&mut sink);
}

/// A server whose process starts with a soft limit of 128 open files serves 400 clients at
/// once: it raises the soft limit to the hard one. Before, the clients past the limit were
/// refused until their timeout.
#[test]
fn a_low_soft_open_file_limit_does_not_cap_the_clients() {
    let mut hard = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes one rlimit into `hard`.
    unsafe { assert_eq!(libc::getrlimit(libc::RLIMIT_NOFILE, &mut hard), 0) };
    if hard.rlim_max < 1024 || hard.rlim_cur < 1024 {
        eprintln!(
            "skipped: this process may open {} files (hard {}); the test needs 1024",
            hard.rlim_cur, hard.rlim_max
        );
        return;
    }
    let exe = std::env::current_exe().expect("test binary");
    let mut child = Command::new(exe)
        .args(["--exact", "server_with_a_soft_limit_of_128", "--nocapture"])
        .env(SOFT_CHILD_ENV, "1")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("child server");
    let stdout = child.stdout.take().expect("stdout");
    let (tx, rx) = std::sync::mpsc::channel::<(u16, u64)>();
    let drain = std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            let mut words = line.split_whitespace();
            if let (Some("PORT"), Some(p), Some("SOFT"), Some(s)) =
                (words.next(), words.next(), words.next(), words.next())
                && let (Ok(p), Ok(s)) = (p.parse(), s.parse())
            {
                let _ = tx.send((p, s));
            }
        }
    });
    let (port, soft) = rx.recv().expect("the child's port");
    assert!(soft > 128, "the server left the soft limit at {soft}");
    let clients: Vec<TcpStore> = (0..400)
        .map(|i| {
            let s = TcpStore::connect("127.0.0.1", port, CLIENT_TIMEOUT)
                .unwrap_or_else(|e| panic!("client {i} of 400: {e}"));
            s.set(&format!("k{i}"), b"v").expect("set");
            s
        })
        .collect();
    assert_eq!(clients[0].get("k399").expect("get"), b"v");
    drop(clients);
    drop(child.stdin.take());
    let status = child.wait().expect("child exit");
    drain.join().expect("drain");
    assert!(status.success(), "child server failed: {status}");
}

/// APPEND that would make a value larger than a client can read back is refused (the
/// connection closed, with a warning), and the value stays readable.
#[test]
fn an_append_past_the_readable_size_is_refused() {
    let server = TcpStoreServer::start_on(loopback(), ServerLimits::DEFAULT).expect("server");
    let store =
        TcpStore::connect("127.0.0.1", server.port(), CLIENT_TIMEOUT).expect("client connects");
    let chunk = vec![7u8; 40 << 20];
    store.append("big", &chunk).expect("first append");
    // APPEND has no reply: the refusal shows as the connection closing under the next call,
    // which on the same connection comes after it.
    let second =
        TcpStore::connect("127.0.0.1", server.port(), CLIENT_TIMEOUT).expect("client connects");
    let _ = second.append("big", &chunk);
    let _ = second.get("big");
    let fresh =
        TcpStore::connect("127.0.0.1", server.port(), CLIENT_TIMEOUT).expect("client connects");
    assert_eq!(fresh.get("big").expect("get").len(), 40 << 20);
    assert_eq!(store.get("big").expect("get").len(), 40 << 20);
}
