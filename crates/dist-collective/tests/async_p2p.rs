//! Async work handles (ownership, ordering, dropped handles, concurrent groups) and
//! point-to-point patterns that must not deadlock.

use std::sync::Arc;
use std::time::{Duration, Instant};

use dist_backend::Store;
use dist_backend::store::HashStore;
use dist_collective::testing::{run_world, run_world_with};
use dist_collective::{Error, InitOptions, OpState, P2pOp, ReduceOp, new_process_group};

/// How long a rank waits for another's signal through a test's own store before failing.
const GATE: Duration = Duration::from_secs(60);

#[test]
fn async_forms_return_their_buffers_in_issue_order() {
    for w in 1..=4usize {
        let out = run_world(w, |pg| {
            let r = pg.rank();
            // Many ops in flight at once, mixed with a blocking one in the middle.
            let a = pg.all_reduce_async(vec![r as i64 + 1; 1000], ReduceOp::Sum)?;
            let b = pg.broadcast_async(vec![r as u8; 17], 0)?;
            let mut blocking = [r as f32];
            pg.all_reduce(&mut blocking, ReduceOp::Max)?;
            let c = pg.all_gather_async(vec![r as u32; 3])?;
            let d = pg.reduce_scatter_async(vec![1i32; 2 * w], ReduceOp::Sum)?;
            let e = pg.barrier_async()?;
            let f = pg.reduce_async(vec![2u64; 4], ReduceOp::Product, 0)?;
            // Waiting out of order is fine: they complete in issue order.
            e.wait()?;
            assert!(a.is_completed() && b.is_completed() && c.is_completed() && d.is_completed());
            Ok((
                a.wait()?,
                b.wait()?,
                blocking[0],
                c.wait()?,
                d.wait()?,
                f.wait()?,
            ))
        })
        .unwrap();
        let sum: i64 = (1..=w as i64).sum();
        for (r, (a, b, m, c, d, f)) in out.into_iter().enumerate() {
            assert_eq!(a, vec![sum; 1000]);
            assert_eq!(b, vec![0u8; 17]);
            assert_eq!(m, (w - 1) as f32);
            assert_eq!(c, (0..w as u32).flat_map(|q| [q; 3]).collect::<Vec<_>>());
            assert_eq!(d, vec![w as i32; 2]);
            if r == 0 {
                assert_eq!(f, vec![1u64 << w; 4]);
            }
        }
    }
}

#[test]
fn wait_timeout_and_is_completed() {
    // Rank 1 joins each op only once rank 0 says (through this store) that it has seen the
    // op unfinished, so rank 0's waits time out whatever the threads' timing.
    let gate = HashStore::new(GATE);
    run_world(2, |pg| {
        if pg.rank() == 0 {
            // Rank 1 has not joined the all_reduce: a short wait times out, the handle stays
            // usable with wait_for, and the op completes.
            let w = pg.all_reduce_async(vec![1u32; 8], ReduceOp::Sum)?;
            assert!(!w.is_completed());
            assert!(!w.wait_for(Duration::from_millis(50)));
            gate.set("all_reduce_waited", b"").unwrap();
            assert_eq!(w.wait()?, vec![2; 8]);
            let w2 = pg.barrier_async()?;
            let err = w2.wait_timeout(Duration::from_millis(30)).unwrap_err();
            assert!(
                matches!(err, Error::WaitTimeout { op: "barrier", .. }),
                "{err}"
            );
            gate.set("barrier_waited", b"").unwrap();
            // The barrier still completes in the background; the next op sees a sane group.
            let mut x = [5u8];
            pg.broadcast(&mut x, 1)?;
            assert_eq!(x, [7]);
        } else {
            gate.wait(&["all_reduce_waited"], GATE).unwrap();
            let mut v = vec![1u32; 8];
            pg.all_reduce(&mut v, ReduceOp::Sum)?;
            gate.wait(&["barrier_waited"], GATE).unwrap();
            pg.barrier()?;
            let mut x = [7u8];
            pg.broadcast(&mut x, 1)?;
        }
        Ok(())
    })
    .unwrap();
}

#[test]
fn dropped_handles_still_complete_in_order() {
    let out = run_world(3, |pg| {
        for i in 0..20u32 {
            // Dropped at once: the op still runs, in its place in the order.
            drop(pg.all_reduce_async(vec![i; 1 << 12], ReduceOp::Sum)?);
        }
        let last = pg
            .all_reduce_async(vec![pg.rank() as u32; 4], ReduceOp::Sum)?
            .wait()?;
        let rec = pg.flight_recorder();
        assert!(
            rec.iter()
                .take(20)
                .all(|e| e.state == OpState::Completed && e.op == "all_reduce")
        );
        Ok(last)
    })
    .unwrap();
    assert_eq!(out, vec![vec![3u32; 4]; 3]);
}

#[test]
fn several_groups_progress_concurrently() {
    // Two independent worlds' worth of groups per rank: a world group and a sub-group spanning
    // all ranks, each driven from its own thread with interleaved async ops.
    let out = run_world(3, |pg| {
        let g2 = pg.new_group(&[0, 1, 2])?.expect("member");
        let (a, b) = std::thread::scope(|s| {
            let h1 = s.spawn(|| -> dist_collective::Result<u64> {
                let mut acc = 0;
                for i in 0..30u64 {
                    acc += pg.all_reduce_async(vec![i; 64], ReduceOp::Sum)?.wait()?[0];
                }
                Ok(acc)
            });
            let h2 = s.spawn(|| -> dist_collective::Result<u64> {
                let mut acc = 0;
                for i in 0..30u64 {
                    let mut v = vec![i; 64];
                    g2.all_reduce(&mut v, ReduceOp::Max)?;
                    acc += v[0];
                }
                Ok(acc)
            });
            (h1.join().unwrap(), h2.join().unwrap())
        });
        Ok((a?, b?))
    })
    .unwrap();
    let s: u64 = (0..30).sum();
    assert_eq!(out, vec![(3 * s, s); 3]);
}

#[test]
fn both_ranks_irecv_then_send() {
    for n in [1usize, 100, 1 << 20] {
        let out = run_world(2, move |pg| {
            let peer = 1 - pg.rank();
            let r = pg.irecv(vec![0u32; n], peer, 7)?;
            pg.send(&vec![pg.rank() as u32 + 10; n], peer, 7)?;
            r.wait()
        })
        .unwrap();
        assert_eq!(out[0], vec![11u32; n]);
        assert_eq!(out[1], vec![10u32; n]);
    }
}

/// The point-to-point engine sleeps in the backend's poller while a receive waits; a send
/// issued meanwhile must wake it. A lost wake-up holds the send until the receive's deadline,
/// and rank 1's receive of it times out.
#[test]
fn a_send_issued_while_a_receive_waits_goes_at_once() {
    let out = run_world_with(2, Duration::from_secs(60), |pg| {
        if pg.rank() == 0 {
            let pending = pg.irecv(vec![0u32; 4], 1, 5)?;
            // Not for ordering (any timing is correct): past the engine's spin, so that the
            // send below finds it asleep.
            std::thread::sleep(Duration::from_millis(20));
            pg.send(&[7u32; 4], 1, 6)?;
            pending.wait()
        } else {
            let mut got = [0u32; 4];
            pg.recv(&mut got, 0, 6)?;
            pg.send(&got.map(|x| x + 1), 0, 5)?;
            Ok(got.to_vec())
        }
    })
    .unwrap();
    assert_eq!(out, [vec![8u32; 4], vec![7u32; 4]]);
}

/// Destroying a group fails its pending receive with `Destroyed` at once, though the engine
/// sleeps in the poller for it: dropping the engine's queue wakes it. Rank 1 keeps its group
/// until then, so that rank 0 does not see it leave instead. (Groups of their own: the test
/// harness keeps a clone of each, which a `destroy` would leave alive.)
#[test]
fn destroying_a_group_fails_its_waiting_receive_at_once() {
    let store: Arc<dyn Store> = Arc::new(HashStore::new(GATE));
    let gate = HashStore::new(GATE);
    std::thread::scope(|s| {
        for rank in 0..2 {
            let (store, gate) = (store.clone(), &gate);
            s.spawn(move || {
                let opts = InitOptions::new()
                    .store(store)
                    .rank(rank)
                    .world_size(2)
                    .timeout(Duration::from_secs(120));
                let pg = new_process_group(opts).expect("group");
                if rank == 1 {
                    gate.wait(&["rank0_done"], GATE).unwrap();
                    return;
                }
                let pending = pg.irecv(vec![0u8; 4], 1, 3).unwrap();
                // Not for ordering (any timing is correct): past the engine's spin, so that it
                // sleeps in the poller.
                std::thread::sleep(Duration::from_millis(20));
                let began = Instant::now();
                pg.destroy();
                let err = pending.wait().unwrap_err();
                let took = began.elapsed();
                gate.set("rank0_done", b"").unwrap();
                assert!(matches!(err, Error::Destroyed { .. }), "{err}");
                assert!(
                    took < Duration::from_secs(30),
                    "the receive failed only at its deadline: {took:?}"
                );
            });
        }
    });
}

#[test]
fn both_ranks_send_then_recv_large() {
    // Large blocking sends in both directions at once (MPI's "unsafe" pattern).
    let n = 4 << 20;
    let out = run_world(2, move |pg| {
        let peer = 1 - pg.rank();
        let s = pg.isend(vec![pg.rank() as u8 + 1; n], peer, 0)?;
        let mut got = vec![0u8; n];
        pg.recv(&mut got, peer, 0)?;
        s.wait()?;
        Ok(got[n - 1])
    })
    .unwrap();
    assert_eq!(out, vec![2, 1]);
}

#[test]
fn ring_exchange_with_batch_isend_irecv() {
    for w in 2..=4usize {
        let out = run_world(w, move |pg| {
            let r = pg.rank();
            let next = (r + 1) % w;
            let prev = (r + w - 1) % w;
            let works = pg.batch_isend_irecv(vec![
                P2pOp::irecv(vec![0i64; 1000], prev, 3),
                P2pOp::irecv(vec![0i64; 10], next, 4),
                P2pOp::isend(vec![r as i64; 1000], next, 3),
                P2pOp::isend(vec![-(r as i64); 10], prev, 4),
            ])?;
            let mut res = Vec::new();
            for wk in works {
                res.push(wk.wait()?);
            }
            Ok(res)
        })
        .unwrap();
        for (r, res) in out.into_iter().enumerate() {
            assert_eq!(res[0], vec![((r + w - 1) % w) as i64; 1000]);
            assert_eq!(res[1], vec![-(((r + 1) % w) as i64); 10]);
        }
    }
}

#[test]
fn tags_match_out_of_order_and_fifo_per_tag() {
    let out = run_world(2, |pg| {
        if pg.rank() == 0 {
            pg.send(&[1i16], 1, 1)?;
            pg.send(&[2i16], 1, 2)?;
            pg.send(&[3i16], 1, 1)?;
            Ok(vec![])
        } else {
            // Receive tag 2 first, then both tag-1 messages in send order.
            let mut a = [0i16];
            pg.recv(&mut a, 0, 2)?;
            let mut b = [0i16];
            pg.recv(&mut b, 0, 1)?;
            let mut c = [0i16];
            pg.recv(&mut c, 0, 1)?;
            Ok(vec![a[0], b[0], c[0]])
        }
    })
    .unwrap();
    assert_eq!(out[1], vec![2, 1, 3]);
}

#[test]
fn p2p_does_not_wait_for_collectives() {
    // Rank 0 has a collective queued that rank 1 only joins after a p2p round trip.
    let out = run_world(2, |pg| {
        if pg.rank() == 0 {
            let c = pg.all_reduce_async(vec![1u8; 4], ReduceOp::Sum)?;
            pg.send(&[42u32], 1, 0)?;
            let mut back = [0u32];
            pg.recv(&mut back, 1, 0)?;
            Ok((c.wait()?, back[0]))
        } else {
            let mut x = [0u32];
            pg.recv(&mut x, 0, 0)?;
            pg.send(&[x[0] + 1], 0, 0)?;
            let mut v = vec![1u8; 4];
            pg.all_reduce(&mut v, ReduceOp::Sum)?;
            Ok((v, x[0]))
        }
    })
    .unwrap();
    assert_eq!(out[0], (vec![2; 4], 43));
    assert_eq!(out[1], (vec![2; 4], 42));
}

#[test]
fn unmatched_recv_times_out_naming_the_peer() {
    // Rank 0 keeps its group (and so its connections) until rank 1's receive has returned,
    // so that it fails by timing out, not by seeing rank 0 leave.
    let gate = HashStore::new(GATE);
    let err = run_world_with(2, Duration::from_millis(300), |pg| {
        if pg.rank() == 1 {
            let mut x = [0u8];
            let r = pg.recv(&mut x, 0, 9);
            gate.set("recv_returned", b"").unwrap();
            r?;
        } else {
            gate.wait(&["recv_returned"], GATE).unwrap();
        }
        Ok(())
    })
    .unwrap_err();
    let msg = err.to_string();
    assert!(msg.contains("timed out") && msg.contains("[0]"), "{msg}");
}

#[test]
fn a_rank_error_does_not_hang_the_others() {
    let err = run_world_with(3, Duration::from_secs(20), |pg| {
        if pg.rank() == 2 {
            return Err(Error::RankPanicked {
                rank: 2,
                message: "simulated failure".into(),
            });
        }
        let mut v = [1u8];
        pg.all_reduce(&mut v, ReduceOp::Sum)?;
        Ok(())
    })
    .unwrap_err();
    assert!(err.to_string().contains("simulated failure"), "{err}");
}
