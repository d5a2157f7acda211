//! How groups end: the rank that serves the TCP store keeps serving until every rank has left,
//! and a group torn down by one rank does not make the others fail.

use std::sync::Arc;
use std::sync::mpsc::{TryRecvError, channel};
use std::time::Duration;

use dist_backend::Store;
use dist_backend::store::{TcpStore, TcpStoreOptions, TcpStoreServer};
use dist_collective::{InitOptions, ReduceOp, new_process_group};

const WORLD: usize = 4;
const TIMEOUT: Duration = Duration::from_secs(60);

fn options(rank: usize, store: Arc<dyn Store>) -> InitOptions {
    InitOptions::new()
        .store(store)
        .rank(rank)
        .world_size(WORLD)
        .timeout(TIMEOUT)
}

/// Rank 0 serves the store and leaves first; the others still use the store afterwards, and
/// rank 0's teardown returns only once all of them have left.
#[test]
fn the_store_host_serves_until_every_rank_has_left() {
    let server = TcpStoreServer::start(0).expect("store server on port 0");
    let port = server.port();
    let (leaving_tx, leaving_rx) = channel::<()>();
    let (left_tx, left_rx) = channel::<()>();
    let (left_rx, leaving_rx) = (
        std::sync::Mutex::new(left_rx),
        std::sync::Mutex::new(leaving_rx),
    );
    let (left_rx, leaving_rx) = (&left_rx, &leaving_rx);
    std::thread::scope(|s| {
        s.spawn(move || {
            let opts = TcpStoreOptions {
                timeout: TIMEOUT,
                ..TcpStoreOptions::new("127.0.0.1", port)
            };
            let store: Arc<dyn Store> =
                Arc::new(TcpStore::with_server(server, &opts).expect("master store"));
            assert!(store.serves_others());
            let pg = new_process_group(options(0, store.clone())).expect("rank 0 group");
            let mut x = [1.0f32];
            pg.all_reduce(&mut x, ReduceOp::Sum).expect("all_reduce");
            assert_eq!(x, [WORLD as f32]);
            for _ in 1..WORLD {
                leaving_tx.send(()).expect("announce");
            }
            // Returns once ranks 1.. have left: until then the store must keep serving them.
            drop(pg);
            drop(store);
            left_tx.send(()).expect("report");
        });
        for rank in 1..WORLD {
            s.spawn(move || {
                let store: Arc<dyn Store> =
                    Arc::new(TcpStore::connect("127.0.0.1", port, TIMEOUT).expect("client store"));
                let pg = new_process_group(options(rank, store.clone())).expect("group");
                let mut x = [1.0f32];
                pg.all_reduce(&mut x, ReduceOp::Sum).expect("all_reduce");
                leaving_rx.lock().unwrap().recv().expect("rank 0 leaves");
                // Rank 0 is inside its teardown now; its store still answers.
                let key = format!("after-rank-0-left/{rank}");
                store
                    .set(&key, b"still here")
                    .expect("set after rank 0 left");
                assert_eq!(store.get(&key).expect("get"), b"still here");
                assert_eq!(
                    left_rx.lock().unwrap().try_recv(),
                    Err(TryRecvError::Empty),
                    "rank 0 finished leaving while rank {rank} had not left"
                );
                drop(pg);
            });
        }
    });
    left_rx.lock().unwrap().recv().expect("rank 0 left");
}

/// A rank whose part is done tears down its group while the others still run collectives
/// among themselves on a sub-group: they must not notice.
#[test]
fn a_rank_leaving_early_does_not_fail_the_others() {
    let store: Arc<dyn Store> = Arc::new(dist_backend::store::HashStore::new(TIMEOUT));
    std::thread::scope(|s| {
        for rank in 0..WORLD {
            let store = store.clone();
            s.spawn(move || {
                let pg = new_process_group(options(rank, store)).expect("group");
                let rest = pg.new_group(&[1, 2, 3]).expect("new_group");
                let mut x = vec![rank as u64; 1 << 16];
                pg.all_reduce(&mut x, ReduceOp::Sum).expect("all_reduce");
                assert!(x.iter().all(|&v| v == 6));
                let Some(rest) = rest else {
                    // Rank 0: done; its connections close while the others go on.
                    drop(pg);
                    return;
                };
                for i in 0..50u64 {
                    let mut y = vec![i; 1 << 14];
                    rest.all_reduce(&mut y, ReduceOp::Sum)
                        .expect("sub-group all_reduce");
                    assert!(y.iter().all(|&v| v == 3 * i));
                }
                drop(rest);
                drop(pg);
            });
        }
    });
}
