//! init_process_group through each init method, the default group, re-init over one store,
//! and the DIST_DEBUG=DETAIL fingerprint check.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use dist_backend::init::InitConfig;
use dist_backend::store::{HashStore, TcpStoreServer};
use dist_collective::testing::run_world_opts;
use dist_collective::{DebugLevel, Error, InitOptions, ReduceOp, new_process_group};

fn sum_over(w: usize, make: impl Fn(usize) -> InitOptions + Sync) -> Vec<u32> {
    std::thread::scope(|s| {
        let hs: Vec<_> = (0..w)
            .map(|r| {
                let make = &make;
                s.spawn(move || {
                    let pg = new_process_group(make(r)).unwrap();
                    assert_eq!((pg.rank(), pg.world_size(), pg.backend()), (r, w, "gloo"));
                    let mut v = [r as u32 + 1];
                    pg.all_reduce(&mut v, ReduceOp::Sum).unwrap();
                    v[0]
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

#[test]
fn tcp_file_and_store_init() {
    let t = Duration::from_secs(20);
    // tcp://: the store's server is bound to port 0 before its port goes into the URL (a port
    // found free and bound again later could be taken in between). Rank 0 serves the store on
    // it, as `tcp://` makes rank 0 do, and ranks 1 and 2 join through the URL.
    let server = TcpStoreServer::start(0).unwrap();
    let url = format!("tcp://127.0.0.1:{}", server.port());
    let server = Mutex::new(Some(server));
    assert_eq!(
        sum_over(3, |r| {
            let opts = InitOptions::new().rank(r).world_size(3).timeout(t);
            if r == 0 {
                let server = server.lock().unwrap().take().unwrap();
                let info = InitConfig::resolve(&|_| None, Some(0), Some(3))
                    .unwrap()
                    .connect_with_server(server, t)
                    .unwrap();
                opts.store(info.store)
            } else {
                opts.init_method(url.clone())
            }
        }),
        vec![6; 3]
    );
    let dir = std::env::temp_dir().join(format!("dist-collective-init-{}", std::process::id()));
    let _ = std::fs::remove_file(&dir);
    let url = format!("file://{}", dir.display());
    // The last rank's store deletes the file, as torch's does, so the same URL serves again.
    for job in 0..2 {
        assert_eq!(
            sum_over(2, |r| InitOptions::new()
                .init_method(url.clone())
                .rank(r)
                .world_size(2)
                .timeout(t)),
            vec![3; 2]
        );
        assert!(!dir.exists(), "the file store's file outlived job {job}");
    }
    // One store, worlds in a row (destroy and re-create), of two sizes: a world of 3 after two
    // of 2 started at a count of 4, and its ranks numbered their generation 1, 1 and 2 over
    // one counter, so the init failed at its deadline.
    let store: Arc<dyn dist_backend::Store> = Arc::new(HashStore::new(t));
    for w in [2, 2, 3, 3, 2] {
        assert_eq!(
            sum_over(w, |r| InitOptions::new()
                .store(store.clone())
                .rank(r)
                .world_size(w)
                .timeout(t)),
            vec![(w * (w + 1) / 2) as u32; w],
            "a world of {w} over a store used before"
        );
    }
}

#[test]
fn default_group_lifecycle() {
    let store: Arc<dyn dist_backend::Store> = Arc::new(HashStore::new(Duration::from_secs(10)));
    let opts = InitOptions::new()
        .store(store.clone())
        .rank(0)
        .world_size(1);
    let pg = dist_collective::init_process_group(opts.clone()).unwrap();
    assert!(dist_collective::is_initialized());
    assert_eq!(dist_collective::get_rank().unwrap(), 0);
    assert_eq!(dist_collective::get_world_size().unwrap(), 1);
    assert_eq!(dist_collective::get_backend().unwrap(), "gloo");
    let mut v = [3.0f64];
    dist_collective::all_reduce(&mut v, ReduceOp::Sum).unwrap();
    assert_eq!(v, [3.0]);
    dist_collective::barrier().unwrap();
    assert!(matches!(
        dist_collective::init_process_group(opts.clone()),
        Err(Error::AlreadyInitialized { .. })
    ));
    drop(pg);
    dist_collective::destroy_process_group();
    assert!(!dist_collective::is_initialized());
    let pg = dist_collective::init_process_group(opts).unwrap();
    pg.barrier().unwrap();
    dist_collective::destroy_process_group();
    let bad = new_process_group(
        InitOptions::new()
            .backend("mpi")
            .store(store)
            .rank(0)
            .world_size(1),
    );
    assert!(matches!(bad, Err(Error::UnknownBackend { .. })));
}

#[test]
fn detail_fingerprint_names_both_sides() {
    let opts = InitOptions::new()
        .timeout(Duration::from_secs(10))
        .debug_level(DebugLevel::Detail);
    // Same byte count on the wire, different ops: only the fingerprint tells them apart.
    let err = run_world_opts(2, opts, |pg| {
        let mut v = [1u32; 4];
        if pg.rank() == 0 {
            pg.all_reduce(&mut v, ReduceOp::Sum)?;
        } else {
            pg.broadcast(&mut v, 0)?;
        }
        Ok(())
    })
    .unwrap_err();
    let msg = err.to_string();
    assert!(msg.contains("fingerprint") && msg.contains("rank"), "{msg}");
}
