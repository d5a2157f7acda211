//! TCP store latency: one client's set/get round trip, and the time for N clients to rendezvous
//! (connect + add + wait on a barrier key) against one server thread.
#![allow(missing_docs)] // criterion's macros generate undocumented public functions.

use std::hint::black_box;
use std::sync::atomic::{AtomicU64, Ordering};
use std::thread;
use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion, SamplingMode, criterion_group, criterion_main};
use dist_backend::Store;
use dist_backend::store::{TcpStore, TcpStoreServer};

const T: Duration = Duration::from_secs(30);
/// Client threads of the rendezvous benchmark; each drives N / THREADS connections.
const THREADS: usize = 16;

fn round_trip(c: &mut Criterion) {
    let server = TcpStoreServer::start(0).expect("start server");
    let client = TcpStore::connect("127.0.0.1", server.port(), T).expect("connect");
    let mut g = c.benchmark_group("tcp_store");
    let value = vec![7u8; 64];
    g.bench_function("set_get_64B", |b| {
        b.iter(|| {
            client.set("bench/key", &value).expect("set");
            black_box(client.get("bench/key").expect("get"));
        });
    });
    g.bench_function("add", |b| {
        b.iter(|| black_box(client.add("bench/ctr", 1).expect("add")));
    });
    g.finish();
}

fn rendezvous_once(port: u16, n: usize, round: u64) {
    let per = n / THREADS;
    let joined = format!("rdzv/{round}/joined");
    let barrier = format!("rdzv/{round}/go");
    let hs: Vec<_> = (0..THREADS)
        .map(|_| {
            let (joined, barrier) = (joined.clone(), barrier.clone());
            thread::spawn(move || {
                let clients: Vec<TcpStore> = (0..per)
                    .map(|_| TcpStore::connect("127.0.0.1", port, T).expect("connect"))
                    .collect();
                for c in &clients {
                    if c.add(&joined, 1).expect("add") == n as i64 {
                        c.set(&barrier, b"").expect("set");
                    }
                }
                for c in &clients {
                    c.wait(&[barrier.as_str()], T).expect("wait");
                }
            })
        })
        .collect();
    for h in hs {
        h.join().expect("client thread");
    }
}

fn rendezvous(c: &mut Criterion) {
    let server = TcpStoreServer::start(0).expect("start server");
    let port = server.port();
    let round = AtomicU64::new(0);
    let mut g = c.benchmark_group("tcp_store_rendezvous");
    g.sampling_mode(SamplingMode::Flat);
    g.sample_size(10);
    for n in [64usize, 256, 1024] {
        g.bench_with_input(BenchmarkId::from_parameter(n), &n, |b, &n| {
            b.iter_custom(|iters| {
                let start = Instant::now();
                for _ in 0..iters {
                    rendezvous_once(port, n, round.fetch_add(1, Ordering::Relaxed));
                }
                start.elapsed()
            });
        });
    }
    g.finish();
}

criterion_group!(benches, round_trip, rendezvous);
criterion_main!(benches);
