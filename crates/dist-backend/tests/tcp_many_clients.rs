//! 1024 clients against one server, in a test binary of its own so that the thread count of
//! the process is this test's alone.

use std::sync::{Arc, Barrier};
use std::thread;
use std::time::Duration;

use dist_backend::Store;
use dist_backend::store::{TcpStore, TcpStoreServer};

const T: Duration = Duration::from_secs(20);

fn threads() -> usize {
    std::fs::read_dir("/proc/self/task").map_or(0, |d| d.count())
}

/// Threads whose name starts with `prefix` (names are cut to 15 bytes by the kernel).
fn threads_named(prefix: &str) -> usize {
    let Ok(dir) = std::fs::read_dir("/proc/self/task") else {
        return 0;
    };
    dir.filter_map(|e| std::fs::read_to_string(e.ok()?.path().join("comm")).ok())
        .filter(|n| n.trim_end().starts_with(prefix))
        .count()
}

/// Whether `cond` holds within `T`. A thread that was joined can still be listed in
/// `/proc/self/task` for a moment: the kernel wakes the joiner before it removes the task.
fn settles(cond: impl Fn() -> bool) -> bool {
    let deadline = std::time::Instant::now() + T;
    while !cond() {
        if std::time::Instant::now() >= deadline {
            return false;
        }
        thread::sleep(Duration::from_millis(1));
    }
    true
}

fn fd_limit() -> usize {
    std::fs::read_to_string("/proc/self/limits")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("Max open files"))
                .and_then(|l| l.split_whitespace().nth(3)?.parse().ok())
        })
        .unwrap_or(1024)
}

#[test]
fn thousand_clients_rendezvous_on_one_server_thread() {
    // Each client costs two descriptors in this process (client and server side).
    let n = 1024.min(fd_limit().saturating_sub(200) / 2);
    assert!(
        n >= 256,
        "open file limit too low for this test: {}",
        fd_limit()
    );
    let before = threads();
    let server = TcpStoreServer::start(0).unwrap();
    let port = server.port();
    let name = format!("tcpstore-{port}");
    // The server thread names itself before it runs its loop, so once a client has been
    // answered (connecting validates and pings) the name is there.
    let probe = TcpStore::connect("127.0.0.1", port, T).unwrap();
    assert_eq!(threads_named(&name), 1);
    let with_server = threads();
    assert_eq!(with_server, before + 1);
    // 32 client threads, each driving n/32 connections.
    let per = n / 32;
    let n = per * 32;
    let go = Arc::new(Barrier::new(32));
    let hs: Vec<_> = (0..32)
        .map(|t| {
            let go = Arc::clone(&go);
            thread::spawn(move || {
                go.wait();
                let clients: Vec<TcpStore> = (0..per)
                    .map(|_| TcpStore::connect("127.0.0.1", port, T).unwrap())
                    .collect();
                for (i, c) in clients.iter().enumerate() {
                    let rank = t * per + i;
                    c.set(&format!("rank/{rank}"), rank.to_string().as_bytes())
                        .unwrap();
                    if c.add("joined", 1).unwrap() == n as i64 {
                        c.set("all_joined", b"").unwrap();
                    }
                }
                for (i, c) in clients.iter().enumerate() {
                    c.wait(&["all_joined"], T).unwrap();
                    let rank = t * per + i;
                    let peer = (rank * 7 + 13) % n;
                    assert_eq!(
                        c.get(&format!("rank/{peer}")).unwrap(),
                        peer.to_string().as_bytes()
                    );
                }
                clients
            })
        })
        .collect();
    let clients: Vec<Vec<TcpStore>> = hs.into_iter().map(|h| h.join().unwrap()).collect();
    assert_eq!(clients.iter().map(Vec::len).sum::<usize>(), n);
    // Every client still connected, and the server still has one thread (once the joined
    // client threads are gone from /proc too).
    assert!(
        settles(|| threads() == with_server),
        "{} threads",
        threads()
    );
    assert_eq!(threads_named(&name), 1);
    let c = &clients[0][0];
    assert_eq!(c.get("joined").unwrap(), n.to_string().as_bytes());
    assert_eq!(c.num_keys().unwrap(), n as u64 + 2);
    drop(clients);
    drop(probe);
    drop(server);
    assert!(settles(|| threads_named(&name) == 0 && threads() == before));
}
