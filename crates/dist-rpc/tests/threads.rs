//! Workers as threads of one process, each with its own `init_rpc` (listener, TCP connections,
//! handler pool): calls, errors, timeouts, RRefs and shutdown over real loopback sockets.

mod common;

use std::time::{Duration, Instant};

use common::{Gated, Tracked, drops, open_gate, thread_world, wait_drops, wait_entered};
use dist_rpc::{Error, RRef, RpcOptions};

/// Polls `cond` until it holds (bounded): waits for asynchronous RRef deletions.
fn eventually(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn sync_async_and_self_calls_return_the_handlers_results() {
    let out = thread_world(3, RpcOptions::new(), |rpc| {
        let me = rpc.worker_info().id as i64;
        // Every worker calls every worker (itself included), by name and by rank.
        let mut sums = Vec::new();
        for to in 0..3usize {
            let by_rank: i64 = rpc.rpc_sync(to, "add", &(me, 100 * to as i64)).unwrap();
            let name = format!("w{to}");
            let by_name: i64 = rpc
                .rpc_async(name.as_str(), "add", &(me, 1000))
                .unwrap()
                .wait()
                .unwrap();
            sums.push((by_rank, by_name));
        }
        assert_eq!(rpc.get_worker_info("w2").unwrap().id, 2);
        assert!(matches!(
            rpc.get_worker_info("nobody"),
            Err(Error::UnknownWorker { .. })
        ));
        rpc.shutdown().unwrap();
        sums
    });
    for (me, sums) in out.iter().enumerate() {
        let me = me as i64;
        let want: Vec<(i64, i64)> = (0..3).map(|to| (me + 100 * to, me + 1000)).collect();
        assert_eq!(sums, &want);
    }
}

#[test]
fn remote_errors_panics_unknown_names_and_bad_arguments_name_the_worker_and_function() {
    thread_world(2, RpcOptions::new(), |rpc| {
        if rpc.worker_info().id == 0 {
            let e = rpc
                .rpc_sync::<_, ()>("w1", "fail", &"out of cheese")
                .unwrap_err();
            assert!(
                matches!(&e, Error::Remote { panicked: false, message, .. } if message == "out of cheese"),
                "{e}"
            );
            let s = e.to_string();
            assert!(s.contains("w1 (rank 1)") && s.contains("fail"), "{s}");

            let e = rpc
                .rpc_sync::<_, ()>("w1", "panic", &"boom at step 7")
                .unwrap_err();
            assert!(
                matches!(&e, Error::Remote { panicked: true, message, .. } if message.contains("boom at step 7")),
                "{e}"
            );
            assert!(e.to_string().contains("panicked"), "{e}");

            let e = rpc.rpc_sync::<_, i64>("w1", "no_such_fn", &1).unwrap_err();
            assert!(
                matches!(&e, Error::UnknownFunction { func, .. } if func == "no_such_fn"),
                "{e}"
            );
            assert!(e.to_string().contains("w1 (rank 1)"), "{e}");

            let e = rpc
                .rpc_sync::<_, i64>("w1", "add", &"not a pair")
                .unwrap_err();
            assert!(
                matches!(&e, Error::BadArguments { func, .. } if func == "add"),
                "{e}"
            );

            // A result that does not decode into the caller's type is the caller's codec error.
            let e = rpc.rpc_sync::<_, String>("w1", "add", &(1, 2)).unwrap_err();
            assert!(
                matches!(
                    &e,
                    Error::Codec {
                        what: "decoding the result",
                        ..
                    }
                ),
                "{e}"
            );

            // The worker still serves after all that.
            assert_eq!(rpc.rpc_sync::<_, i64>("w1", "add", &(2, 2)).unwrap(), 4);
        }
        rpc.shutdown().unwrap();
    });
}

/// A result whose encoding panics (on the pool, for a call; on the control thread, for a
/// `to_here`) comes back as a remote panic naming the worker and the function, and the callee
/// keeps its one pool thread and its control thread: later calls and fetches are served and
/// graceful shutdown finds nothing left in flight. Before, the panic unwound the thread past
/// its counters: the caller waited out its timeout and shutdown its `shutdown_timeout`.
#[test]
fn a_panic_while_encoding_a_result_is_a_remote_panic_and_the_worker_keeps_serving() {
    const WAIT: Duration = Duration::from_secs(20);
    let opts = RpcOptions::new()
        .num_worker_threads(1)
        .shutdown_timeout(WAIT);
    thread_world(2, opts, |rpc| {
        if rpc.worker_info().id == 0 {
            for _ in 0..2 {
                let e = rpc
                    .rpc_async_timeout::<_, String>("w1", "encode_panics", &"bad serialize", WAIT)
                    .unwrap()
                    .wait()
                    .unwrap_err();
                assert!(
                    matches!(&e, Error::Remote { panicked: true, func, message, .. }
                        if func == "encode_panics" && message.contains("bad serialize")
                            && message.contains("w1 (rank 1)")
                            && message.contains("encoding the result of encode_panics")),
                    "{e}"
                );
            }
            // The one pool thread still serves.
            let sum = rpc
                .rpc_async_timeout::<_, i64>("w1", "add", &(2, 2), WAIT)
                .unwrap()
                .wait()
                .unwrap();
            assert_eq!(sum, 4);
            // A value whose encoding panics, fetched: the control thread answers and lives.
            let bad: RRef<common::EncodePanics> = rpc
                .remote("w1", "encode_panics", &"bad value serialize")
                .unwrap();
            for _ in 0..2 {
                let e = bad.to_here_timeout(WAIT).unwrap_err();
                let s = e.to_string();
                assert!(
                    matches!(&e, Error::RRef { .. })
                        && s.contains("bad value serialize")
                        && s.contains("panicked")
                        && s.contains("w1 (rank 1)"),
                    "{e}"
                );
            }
            let good: RRef<Tracked> = rpc
                .remote("w1", "make_tracked", &("encode-panics-good", 3u64))
                .unwrap();
            assert_eq!(good.to_here_timeout(WAIT).unwrap().data, vec![0, 1, 2]);
        }
        rpc.shutdown().unwrap();
    });
}

#[test]
fn a_call_past_its_timeout_fails_with_timeout_and_the_worker_recovers() {
    thread_world(2, RpcOptions::new(), |rpc| {
        if rpc.worker_info().id == 0 {
            let key = "timeout-test".to_owned();
            let fut = rpc
                .rpc_async_timeout::<_, String>("w1", "block", &key, Duration::from_secs(2))
                .unwrap();
            let e = fut.wait().unwrap_err();
            assert!(
                matches!(&e, Error::Timeout { func, .. } if func == "block"),
                "{e}"
            );
            rpc.rpc_sync::<_, ()>("w1", "release", &key).unwrap();
            assert_eq!(rpc.rpc_sync::<_, i64>("w1", "add", &(40, 2)).unwrap(), 42);
        }
        rpc.shutdown().unwrap();
    });
}

#[test]
fn raw_bytes_round_trip_a_mebibyte() {
    thread_world(2, RpcOptions::new(), |rpc| {
        if rpc.worker_info().id == 1 {
            let data: Vec<u8> = (0..(1usize << 20) + 3)
                .map(|i| (i * 7 % 251) as u8)
                .collect();
            let back = rpc.rpc_sync_bytes("w0", "inc_bytes", &data).unwrap();
            let want: Vec<u8> = data.iter().map(|x| x.wrapping_add(1)).collect();
            assert!(back == want, "bytes differ");
            // A typed call to a bytes handler (and the reverse) is a clear error.
            let e = rpc
                .rpc_sync::<_, Vec<u8>>("w0", "inc_bytes", &vec![1u8])
                .unwrap_err();
            assert!(matches!(e, Error::BadArguments { .. }), "{e}");
            let e = rpc.rpc_sync_bytes("w0", "add", &[1, 2]).unwrap_err();
            assert!(matches!(e, Error::BadArguments { .. }), "{e}");
        }
        rpc.shutdown().unwrap();
    });
}

#[test]
fn rref_to_here_local_value_and_a_failed_creation() {
    let tag = "rref-basic";
    let out = thread_world(2, RpcOptions::new(), |rpc| {
        let me = rpc.worker_info().id;
        if me == 0 {
            let r: RRef<Tracked> = rpc.remote("w1", "make_tracked", &(tag, 10u64)).unwrap();
            assert_eq!(r.owner().name, "w1");
            assert!(!r.is_owner());
            assert_eq!(r.to_here().unwrap().data, (0..10).collect::<Vec<u64>>());
            assert!(r.local_value().is_err(), "local_value off the owner");
            // A creation that fails shows in to_here, with the owner's message.
            let bad: RRef<Tracked> = rpc.remote("w1", "make_tracked", &"wrong args").unwrap();
            let e = bad.to_here().unwrap_err();
            assert!(e.to_string().contains("w1 (rank 1)"), "{e}");
            // A self-owned RRef.
            let mine: RRef<Tracked> = rpc
                .remote("w0", "make_tracked", &("rref-self", 4u64))
                .unwrap();
            assert!(mine.is_owner());
            assert_eq!(mine.local_value().unwrap().data, vec![0, 1, 2, 3]);
            assert_eq!(mine.to_here().unwrap().data, vec![0, 1, 2, 3]);
        }
        rpc.shutdown().unwrap();
        rpc.stats()
    });
    // Every user released (by drop or at shutdown): both owners deleted what they owned.
    assert_eq!(out[1].owned_rrefs, 0);
    assert_eq!(out[1].rrefs_deleted, 2);
    assert_eq!(out[0].rrefs_deleted, 1);
    assert_eq!(drops(tag), 1);
    assert_eq!(drops("rref-self"), 1);
}

/// The owner's own `to_here` of a value that holds an RRef returns a working copy of it, as
/// any other worker's does. Before, the owner encoded the value outside a reply, where an
/// RRef cannot be serialised, and failed with a codec error.
#[test]
fn the_owners_to_here_of_a_value_holding_an_rref_works() {
    let tag = "owner-fetches-rref-of-rref";
    thread_world(2, RpcOptions::new(), |rpc| {
        if rpc.worker_info().id == 0 {
            let inner: RRef<Tracked> = rpc.remote("w1", "make_tracked", &(tag, 6u64)).unwrap();
            // Owned here, holding an RRef owned by w1.
            let outer: RRef<RRef<Tracked>> = rpc.remote("w0", "bounce_rref", &inner).unwrap();
            assert!(outer.is_owner());
            let copy = outer.to_here().unwrap();
            assert_eq!(copy.id(), inner.id());
            assert_eq!(copy.to_here().unwrap().data, (0..6).collect::<Vec<u64>>());
            // The same from the other side of the value: w1 owns the inner one.
            let here: u64 = rpc.rpc_sync("w1", "sum_rref", &copy).unwrap();
            assert_eq!(here, (0..6u64).sum::<u64>());
        }
        rpc.shutdown().unwrap();
    });
    assert_eq!(drops(tag), 1, "deleted exactly once");
}

/// A fetch of an RRef its owner has already deleted is answered at once with an error naming
/// the owner and the RRef, instead of parking on a placeholder that no creation will ever fill
/// (the caller waited out its timeout, and the owner kept the entry for good).
///
/// w0 made `r` on w1 and still holds it in a second thread when its shutdown releases every
/// fork; w1 deletes `r`. w1's own shutdown is held (between its two quiet rounds, so w0 cannot
/// close either) by the drop of a value it owns itself, until w0 has fetched.
#[test]
fn a_fetch_of_an_rref_its_owner_deleted_fails_at_once_naming_owner_and_rref() {
    let tag = "fetch-after-delete";
    let gate = "fetch-after-delete-gate";
    let opts = RpcOptions::new().shutdown_timeout(Duration::from_secs(30));
    thread_world(2, opts, |rpc| {
        if rpc.worker_info().id == 1 {
            let hold: RRef<Gated> = rpc.remote("w1", "make_gated", &gate).unwrap();
            drop(hold.local_value().unwrap());
            rpc.shutdown().unwrap();
            return;
        }
        let r: RRef<Tracked> = rpc.remote("w1", "make_tracked", &(tag, 5u64)).unwrap();
        assert_eq!(r.to_here().unwrap().data.len(), 5);
        let id = r.id();
        std::thread::scope(|s| {
            let fetcher = s.spawn(move || {
                wait_drops(tag, 1);
                let got = r.to_here_timeout(Duration::from_secs(20));
                open_gate(gate);
                got
            });
            rpc.shutdown().unwrap();
            let e = fetcher.join().unwrap().unwrap_err();
            let s = e.to_string();
            assert!(
                matches!(&e, Error::RRef { owner, what, .. }
                    if owner == "w1 (rank 1)" && what.contains("gone")
                        && what.contains(&id.to_string()) && what.contains("w1 (rank 1)")),
                "{e}"
            );
            assert!(s.contains(&id.to_string()), "{s}");
        });
    });
    assert_eq!(drops(tag), 1);
}

#[test]
fn an_rref_forked_through_three_workers_is_freed_exactly_once() {
    let tag = "rref-fork-chain";
    let n = 1000u64;
    let want: u64 = (0..n).sum();
    thread_world(4, RpcOptions::new(), |rpc| {
        let me = rpc.worker_info().id;
        if me == 0 {
            // Owner w1; w0 forks to w2, which forks to w3 (a fork of a fork), which fetches.
            let r: RRef<Tracked> = rpc.remote("w1", "make_tracked", &(tag, n)).unwrap();
            let s: u64 = rpc
                .rpc_sync("w2", "forward_rref", &(r.clone(), 3usize))
                .unwrap();
            assert_eq!(s, want);
            // w3 keeps a fork; w0 drops its own; the value must survive for w3.
            rpc.rpc_sync::<_, ()>("w3", "stash", &(tag, r.clone()))
                .unwrap();
            // An RRef travelling back inside a result, then to the owner itself.
            let back: RRef<Tracked> = rpc.rpc_sync("w2", "bounce_rref", &r).unwrap();
            assert_eq!(back.id(), r.id());
            let s: u64 = rpc.rpc_sync("w1", "sum_rref", &back).unwrap();
            assert_eq!(s, want);
            drop(back);
            drop(r);
            assert_eq!(
                rpc.rpc_sync::<_, u64>("w3", "unstash_sum", &tag).unwrap(),
                want
            );
        }
        if me == 1 {
            // The owner deletes the value once every fork on every worker is gone, before
            // any shutdown releases anything.
            eventually("the owner to delete the RRef", || {
                rpc.stats().rrefs_deleted == 1
            });
            assert_eq!(rpc.stats().owned_rrefs, 0);
            assert_eq!(drops(tag), 1);
        }
        rpc.shutdown().unwrap();
        if me == 1 {
            assert_eq!(rpc.stats().rrefs_deleted, 1);
        }
    });
    assert_eq!(drops(tag), 1, "deleted exactly once");
}

#[test]
fn graceful_shutdown_waits_for_calls_in_flight() {
    let out = thread_world(3, RpcOptions::new(), |rpc| {
        let me = rpc.worker_info().id;
        let mut futs = Vec::new();
        if me != 0 {
            for i in 0..20i64 {
                futs.push(
                    rpc.rpc_async::<_, i64>("w0", "slow_add", &(i, 1000 * me as i64, 50))
                        .unwrap(),
                );
            }
        }
        // Shut down with every call still in flight: shutdown returns only once they are done.
        rpc.shutdown().unwrap();
        assert!(
            futs.iter().all(|f| f.is_completed()),
            "shutdown returned before its calls completed"
        );
        let got: Vec<i64> = futs.into_iter().map(|f| f.wait().unwrap()).collect();
        // After shutdown, calls fail at once.
        let e = rpc.rpc_sync::<_, i64>(0usize, "add", &(1, 1)).unwrap_err();
        assert!(matches!(e, Error::ShutDown { .. }), "{e}");
        (got, rpc.stats())
    });
    for (me, (got, _)) in out.iter().enumerate().skip(1) {
        let want: Vec<i64> = (0..20).map(|i| i + 1000 * me as i64).collect();
        assert_eq!(got, &want);
    }
    assert_eq!(out[0].1.calls_served, 40);
}

#[test]
fn a_call_to_a_worker_that_shut_down_fails_at_once() {
    thread_world(2, RpcOptions::new(), |rpc| {
        let me = rpc.worker_info().id;
        if me == 1 {
            // A call of w0 is blocked in w1's pool when w1 leaves without waiting.
            wait_entered("shut-down-peer", 1);
            rpc.shutdown_now().unwrap();
            return;
        }
        let blocked = rpc
            .rpc_async::<_, String>("w1", "block", &"shut-down-peer")
            .unwrap();
        let start = Instant::now();
        let e = blocked.wait().unwrap_err();
        assert!(matches!(e, Error::PeerShutDown { .. }), "{e}");
        // Fails at once, not after the 60 s default timeout.
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "took {:?}",
            start.elapsed()
        );
        let e = rpc.rpc_sync::<_, i64>("w1", "add", &(1, 1)).unwrap_err();
        assert!(matches!(e, Error::PeerShutDown { .. }), "{e}");
        // Unblock w1's pool thread (the gate is process-wide): its shutdown joins it.
        rpc.rpc_sync::<_, ()>("w0", "release", &"shut-down-peer")
            .unwrap();
        rpc.shutdown_now().unwrap();
    });
}

#[test]
fn ten_thousand_concurrent_calls_from_three_workers_run_on_a_bounded_pool() {
    let per = 3334i64;
    let out = thread_world(4, RpcOptions::new(), |rpc| {
        let me = rpc.worker_info().id as i64;
        let mut sum = 0i64;
        if me != 0 {
            let futs: Vec<_> = (0..per)
                .map(|i| rpc.rpc_async::<_, i64>("w0", "add", &(i, me)).unwrap())
                .collect();
            for f in futs {
                sum += f.wait().unwrap();
            }
        }
        rpc.shutdown().unwrap();
        (sum, rpc.stats())
    });
    for me in 1..4i64 {
        assert_eq!(out[me as usize].0, (0..per).map(|i| i + me).sum::<i64>());
    }
    let s = out[0].1;
    assert_eq!(s.calls_served, 3 * per as u64);
    assert_eq!(s.pool_threads, 16);
    assert!(s.peak_running <= 16, "{s:?}");
}

#[test]
fn rpc_can_be_started_again_after_shutdown_over_the_same_store() {
    let store = std::sync::Arc::new(dist_backend::store::HashStore::new(Duration::from_secs(60)));
    let out: Vec<i64> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..2usize)
            .map(|r| {
                let store = store.clone();
                s.spawn(move || {
                    let mut got = 0;
                    for round in 0..3i64 {
                        let opts = RpcOptions::new()
                            .store(store.clone())
                            .handlers(common::handlers());
                        let rpc =
                            dist_rpc::init_rpc(&format!("w{r}"), Some(r), Some(2), opts).unwrap();
                        got += rpc.rpc_sync::<_, i64>(1 - r, "add", &(round, 10)).unwrap();
                        rpc.shutdown().unwrap();
                    }
                    got
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(out, vec![33, 33]);
}

#[test]
fn many_rrefs_relayed_concurrently_between_four_workers_are_each_freed_exactly_once() {
    let per = 24usize;
    let n = 40u64;
    let want: u64 = (0..n).sum();
    let tag = |w: usize, k: usize| format!("stress-{w}-{k}");
    // Each hop's handler blocks on the next hop, holding a pool thread: with 4 chains in
    // flight per worker (16 in all, at most 2 hops of a chain on one worker) and a creation
    // job each, 48 threads can never all be blocked (a bigger burst of blocking nested calls
    // can exhaust any fixed pool, in torch as here).
    let opts = RpcOptions::new().num_worker_threads(48);
    let out = thread_world(4, opts, |rpc| {
        let w = rpc.worker_info().id;
        for batch in (0..per).collect::<Vec<_>>().chunks(4) {
            let mut inflight = Vec::new();
            for &k in batch {
                // Owners rotate over every worker, this one included.
                let owner = (w + 1 + k) % 4;
                let r: RRef<Tracked> = rpc.remote(owner, "make_tracked", &(tag(w, k), n)).unwrap();
                let path = vec![(w + 2) % 4, (w + 3) % 4, owner];
                let fut = rpc
                    .rpc_async::<_, (u64, RRef<Tracked>)>((w + 1) % 4, "relay", &(r.clone(), path))
                    .unwrap();
                // Half the creators drop their own reference while the forks are in flight.
                inflight.push((if k % 2 == 0 { None } else { Some(r) }, fut));
            }
            for (r, fut) in inflight {
                let (sum, back) = fut.wait().unwrap();
                assert_eq!(sum, want);
                if let Some(r) = r {
                    assert_eq!(back.id(), r.id());
                }
            }
        }
        // Every reference is gone (none stashed): owners delete without shutdown's help,
        // once the other workers' chains (which create values here too) are done.
        let mine = (0..4)
            .flat_map(|c| (0..per).map(move |k| (c + 1 + k) % 4))
            .filter(|&o| o == w)
            .count() as u64;
        let deadline = Instant::now() + Duration::from_secs(60);
        while rpc.stats().owned_rrefs > 0 || rpc.stats().rrefs_deleted < mine {
            assert!(
                Instant::now() < deadline,
                "w{w} still owns {:?}",
                rpc.stats()
            );
            std::thread::sleep(Duration::from_millis(5));
        }
        let deleted_before_shutdown = rpc.stats().rrefs_deleted;
        rpc.shutdown().unwrap();
        (deleted_before_shutdown, rpc.stats().rrefs_deleted)
    });
    let total: u64 = out.iter().map(|o| o.0).sum();
    assert_eq!(total, 4 * per as u64, "{out:?}");
    assert!(out.iter().all(|o| o.0 == o.1), "{out:?}");
    for w in 0..4 {
        for k in 0..per {
            assert_eq!(drops(&tag(w, k)), 1, "{}", tag(w, k));
        }
    }
}

#[test]
fn a_dropped_future_and_a_shutdown_inside_a_handler_do_not_hang_shutdown() {
    let out = thread_world(2, RpcOptions::new(), |rpc| {
        if rpc.worker_info().id == 0 {
            let key = "dropped-future".to_owned();
            // Fire and forget: the call stays in flight on w1 until released.
            drop(rpc.rpc_async::<_, String>("w1", "block", &key).unwrap());
            wait_entered(&key, 1);
            rpc.rpc_sync::<_, ()>("w1", "release", &key).unwrap();
            let msg: String = rpc.rpc_sync("w1", "shutdown_inside", &()).unwrap();
            assert!(msg.contains("called from inside an RPC handler"), "{msg}");
        }
        rpc.shutdown().unwrap();
        rpc.stats().calls_served
    });
    // w1 served block, release and shutdown_inside: the dropped call ran to its end.
    assert_eq!(out, vec![0, 3]);
}

/// Graceful shutdown ends by its one deadline: a handler that never returns makes both
/// workers' quiet rounds time out, and the close that follows gets what is left of the same
/// deadline to join the threads (nothing, here: the blocked pool thread is left running)
/// instead of a fresh `shutdown_timeout`, which took the blocked worker to twice the timeout.
#[test]
fn a_shutdown_that_times_out_ends_by_its_one_deadline() {
    const TIMEOUT: Duration = Duration::from_secs(5);
    let key = "shutdown-one-deadline";
    let opts = RpcOptions::new().shutdown_timeout(TIMEOUT);
    let took = thread_world(2, opts, |rpc| {
        if rpc.worker_info().id == 0 {
            drop(rpc.rpc_async::<_, String>("w1", "block", &key).unwrap());
        }
        wait_entered(key, 1);
        let start = Instant::now();
        let e = rpc.shutdown().unwrap_err();
        let took = start.elapsed();
        // w1 waits on its own handler until the deadline; w0 either too, or, when w1 closed
        // first (its goodbye ends w0's call), sees w1 leave without publishing.
        assert!(
            matches!(e, Error::ShutdownTimeout { .. })
                || (rpc.worker_info().id == 0 && matches!(e, Error::PeerShutDown { .. })),
            "{e}"
        );
        took
    });
    // The handler's thread was left running: let it finish.
    open_gate(key);
    for (w, took) in took.iter().enumerate() {
        assert!(
            *took < TIMEOUT + Duration::from_millis(2500),
            "w{w}'s shutdown took {took:?} with a {TIMEOUT:?} timeout"
        );
    }
}

/// Init's deadline is taken when `init_rpc` starts, so the time the store's host takes to
/// answer (2 s here: its server starts late on a listener bound already, as a loaded host's
/// might) comes out of the same budget as the workers' rendezvous instead of coming before a
/// fresh `init_timeout`. Worker 0 never comes, so worker 1 fails by init's deadline.
#[test]
fn init_ends_by_its_deadline_when_the_store_host_answered_late() {
    const INIT: Duration = Duration::from_secs(3);
    const SLOW: Duration = Duration::from_secs(2);
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind the store's port");
    let port = listener.local_addr().expect("its address").port();
    let host = std::thread::spawn(move || {
        std::thread::sleep(SLOW);
        dist_backend::store::TcpStoreServer::from_listener(listener).expect("the store's server")
    });
    let opts = RpcOptions::new()
        .init_method(format!("tcp://127.0.0.1:{port}"))
        .init_timeout(INIT);
    let start = Instant::now();
    let Err(e) = dist_rpc::init_rpc("w1", Some(1), Some(2), opts) else {
        panic!("worker 0 never comes, so init must fail");
    };
    let took = start.elapsed();
    assert!(
        took <= INIT + Duration::from_secs(1),
        "init took {took:?}: {e}"
    );
    assert!(e.to_string().contains("w1"), "{e}");
    // The server is dropped only after init has given up.
    drop(host.join().expect("the store host thread"));
}
