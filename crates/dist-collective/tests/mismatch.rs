//! Ranks that disagree on a collective's arguments, through the typed API at every debug level:
//! every rank fails, naming both sides: in the call, or (a root, or a rank whose data came
//! from the root it named) at its next operation.

use std::time::Duration;

use dist_collective::testing::run_world_opts;
use dist_collective::{DebugLevel, Error, InitOptions};

#[test]
fn a_broadcast_with_different_roots_fails_on_every_rank_at_every_debug_level() {
    for level in [DebugLevel::Off, DebugLevel::Info, DebugLevel::Detail] {
        for (n, count) in [(2, 100), (3, 100), (4, 100), (2, 1 << 20)] {
            // Rank 0 broadcasts from root 0, every other rank from root 1.
            let root_of = |r: usize| usize::from(r != 0);
            let opts = InitOptions::new()
                .timeout(Duration::from_secs(60))
                .debug_level(level);
            let out = run_world_opts(n, opts, |pg| {
                let mut v = vec![pg.rank() as f32; count];
                let root = root_of(pg.rank());
                // A rank that thinks it is the root, or whose data came from the root it
                // named, may return Ok (gloo's lazy root verification, its star agreement);
                // its next operation must then fail with the broadcast's mismatch.
                Ok(pg
                    .broadcast(&mut v, root)
                    .and_then(|()| pg.barrier())
                    .map_err(|e| e.to_string()))
            })
            .expect("every rank returns its broadcast's result");
            for (r, res) in out.iter().enumerate() {
                let msg = res
                    .as_ref()
                    .expect_err("a broadcast whose ranks disagree on the root");
                assert!(
                    msg.contains("root 0") && msg.contains("root 1"),
                    "{level:?}, {n} ranks, {count} elements: rank {r} must name both roots: {msg}"
                );
                assert!(
                    !msg.contains("timed out"),
                    "{level:?}, {n} ranks: rank {r} must fail at once: {msg}"
                );
            }
        }
    }
}

#[test]
fn a_reduce_op_mismatch_is_a_backend_mismatch_naming_both_ops() {
    let out = run_world_opts(
        2,
        InitOptions::new().timeout(Duration::from_secs(60)),
        |pg| {
            let mut v = [1.0f32; 8];
            let op = if pg.rank() == 0 {
                dist_collective::ReduceOp::Sum
            } else {
                dist_collective::ReduceOp::Max
            };
            Ok(pg.all_reduce(&mut v, op).unwrap_err())
        },
    )
    .unwrap();
    for (r, e) in out.iter().enumerate() {
        assert!(
            matches!(e, Error::Backend(dist_backend::Error::Mismatch { .. })),
            "rank {r}: {e}"
        );
        let msg = e.to_string();
        assert!(
            msg.contains("SUM") && msg.contains("MAX"),
            "rank {r}: {msg}"
        );
    }
}
