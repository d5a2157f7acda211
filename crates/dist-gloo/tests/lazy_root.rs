//! A lazy root (the default) returns once its data is out and verifies the other ranks'
//! agreement frames later: before it next receives anything, after at most
//! [`LAZY_ROOT_MAX_DEFERRED`] operations that only send, or at close; repeats of a small
//! broadcast or scatter owe it no frames, and it looks at what its peers sent every
//! [`LAZY_ROOT_MAX_DEFERRED`] + 1 of them instead. These tests hold that
//! the frames left queued never get in the way of what follows (every op kind after runs of
//! small rooted ops, roots changing), and that a disagreement inside such a run still reaches
//! the root in time.

mod common;

use std::time::Duration;

use common::{on_all, tcp_world};
use dist_backend::{Backend, BufMut, BufRef, Error, OpOptions};
use dist_gloo::{GlooBackend, GlooOptions, LAZY_ROOT_MAX_DEFERRED};
use dist_wire::{DType, ReduceOp};

fn opts() -> OpOptions {
    OpOptions::with_timeout(Duration::from_secs(60))
}

/// More back-to-back operations from one root than the root may leave unverified.
const RUN: usize = LAZY_ROOT_MAX_DEFERRED + 8;

/// One rank's part of a mixed sequence: runs of small broadcasts and scatters from one root,
/// then each kind of operation that receives, with the root moving on each round. Returns
/// what this rank received, in order, for comparison with what the roots sent.
fn mixed_sequence(b: &GlooBackend, count: usize) -> Vec<f32> {
    let (n, me) = (b.world_size(), b.rank());
    let mut seen = Vec::new();
    for round in 0..n + 1 {
        let root = round % n;
        for k in 0..RUN {
            let mut v = if me == root {
                (0..count)
                    .map(|i| (round * 1000 + k * 10 + i) as f32)
                    .collect()
            } else {
                vec![-1f32; count]
            };
            b.broadcast(
                BufMut::Host(bytemuck::cast_slice_mut(&mut v)),
                DType::F32,
                root,
                &opts(),
            )
            .unwrap();
            seen.extend_from_slice(&v);
        }
        let all: Vec<f32> = (0..count * n).map(|i| (round * 7 + i) as f32).collect();
        let mut out = vec![-1f32; count];
        b.scatter(
            (me == root).then_some(BufRef::Host(bytemuck::cast_slice(&all))),
            BufMut::Host(bytemuck::cast_slice_mut(&mut out)),
            DType::F32,
            root,
            &opts(),
        )
        .unwrap();
        seen.extend_from_slice(&out);
        // The root receives in each of these: its queue must be read first.
        let mut v = vec![(me + 1) as f32; count];
        b.reduce(
            BufMut::Host(bytemuck::cast_slice_mut(&mut v)),
            DType::F32,
            ReduceOp::Sum,
            root,
            &opts(),
        )
        .unwrap();
        if me == root {
            seen.extend_from_slice(&v);
        }
        let mut v = vec![me as f32; count];
        b.all_reduce(
            BufMut::Host(bytemuck::cast_slice_mut(&mut v)),
            DType::F32,
            ReduceOp::Max,
            &opts(),
        )
        .unwrap();
        seen.extend_from_slice(&v);
        if n > 1 {
            // Point to point from the next rank to the root.
            let src = (root + 1) % n;
            let mut v = vec![me as f32; count];
            if me == src {
                b.send(
                    BufRef::Host(bytemuck::cast_slice(&v)),
                    DType::F32,
                    root,
                    &opts(),
                )
                .unwrap();
            } else if me == root {
                b.recv(
                    BufMut::Host(bytemuck::cast_slice_mut(&mut v)),
                    DType::F32,
                    src,
                    &opts(),
                )
                .unwrap();
                seen.extend_from_slice(&v);
            }
        }
    }
    b.barrier(&opts()).unwrap();
    seen
}

/// What [`mixed_sequence`] must return on rank `me` of `n`.
fn expected(n: usize, me: usize, count: usize) -> Vec<f32> {
    let mut want = Vec::new();
    for round in 0..n + 1 {
        let root = round % n;
        for k in 0..RUN {
            want.extend((0..count).map(|i| (round * 1000 + k * 10 + i) as f32));
        }
        want.extend((0..count).map(|i| (round * 7 + me * count + i) as f32));
        if me == root {
            let sum: usize = (1..=n).sum();
            want.extend(std::iter::repeat_n(sum as f32, count));
        }
        want.extend(std::iter::repeat_n((n - 1) as f32, count));
        if n > 1 && me == root {
            want.extend(std::iter::repeat_n(((root + 1) % n) as f32, count));
        }
    }
    want
}

#[test]
fn runs_of_small_rooted_ops_interleave_with_every_op_on_1_to_5_ranks() {
    for n in 1..=5 {
        let ranks = tcp_world(n, &GlooOptions::default());
        // 0, 1, uneven, just below and above 48 KiB (where a send may fill the socket and
        // wait for its receiver), and 256 KiB (where the root runs the fewest operations
        // ahead of its verification, `agree::deferred_keep`).
        for count in [0, 1, 7, (12 << 10) - 1, (12 << 10) + 3, 64 << 10] {
            let got = on_all(&ranks, |b| mixed_sequence(b, count));
            for (r, g) in got.iter().enumerate() {
                assert!(
                    *g == expected(n, r, count),
                    "n={n}, count={count}: rank {r} received other values"
                );
            }
        }
    }
}

/// A root that keeps broadcasting small buffers after its receivers disagreed hears of it
/// within [`LAZY_ROOT_MAX_DEFERRED`] + 1 operations of the finder's failure, as a mismatch
/// naming both roots (op 3's). From op 1 on every rank repeats its last call, so no receiver
/// sends the root an agreement frame and the root reads nothing: it looks at what its peers
/// sent every `LAZY_ROOT_MAX_DEFERRED` + 1 operations. Rank 0 starts op 4 only once the last
/// rank has failed, so that the notice is there to be seen however far ahead the root ran.
#[test]
fn a_disagreement_inside_a_run_of_broadcasts_reaches_the_root_within_the_bound() {
    for n in 2..=4 {
        let ranks = tcp_world(n, &GlooOptions::default());
        let (failed, last_failed) = std::sync::mpsc::channel::<()>();
        let last_failed = std::sync::Mutex::new(last_failed);
        let errs = on_all(&ranks, |b| {
            for k in 0..RUN {
                if k == 4 && b.rank() == 0 {
                    last_failed
                        .lock()
                        .unwrap()
                        .recv_timeout(Duration::from_secs(60))
                        .expect("the last rank fails at op 3 or 4 without rank 0");
                }
                let mut v = vec![0f32; 16];
                // At k = 3 the last rank thinks rank 1 is the root.
                let root = usize::from(k == 3 && b.rank() == n - 1);
                let r = b.broadcast(
                    BufMut::Host(bytemuck::cast_slice_mut(&mut v)),
                    DType::F32,
                    root,
                    &opts(),
                );
                if let Err(e) = r {
                    if b.rank() == n - 1 {
                        failed.send(()).unwrap();
                    }
                    return (k, e);
                }
            }
            panic!(
                "n={n}: rank {} ran {RUN} broadcasts without hearing of the mismatch",
                b.rank()
            );
        });
        for (r, (k, e)) in errs.iter().enumerate() {
            // A rank still finishing op 2 may already meet the abort notice of a rank that
            // found the mismatch in op 3; the root, which waited for the last rank's failure
            // before op 4, looks within LAZY_ROOT_MAX_DEFERRED + 1 ops.
            assert!(
                (2..=4 + LAZY_ROOT_MAX_DEFERRED).contains(k),
                "n={n}: rank {r} failed at {k}: {e}"
            );
            let (ours, theirs) = match e {
                Error::Mismatch { ours, theirs } => (ours, theirs),
                Error::MismatchReported { found, met, .. } => (found, met),
                other => panic!("n={n}: rank {r}: expected a mismatch, got {other}"),
            };
            assert_ne!(ours.root, theirs.root, "n={n}: rank {r}: {e}");
            assert_eq!(ours.seq.max(theirs.seq), 3, "n={n}: rank {r}: {e}");
        }
    }
}
