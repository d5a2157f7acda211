//! Misuse and failure between threads over real TCP: mismatched operations, a stalled peer, and
//! a group that refuses work after an error.

mod common;

use std::time::{Duration, Instant};

use common::{on_all, tcp_world};
use dist_backend::{Backend, BufMut, BufRef, Error, OpOptions};
use dist_gloo::{GlooBackend, GlooOptions};
use dist_wire::{CollectiveOp, DType, ReduceOp};

fn quick(timeout_ms: u64) -> OpOptions {
    OpOptions::with_timeout(Duration::from_millis(timeout_ms))
}

#[test]
fn different_ops_fail_on_both_sides_with_both_named() {
    let ranks = tcp_world(2, &GlooOptions::default());
    let errs = on_all(&ranks, |b| {
        // Past the 4 KiB an all_reduce may put through the shared-memory group area, so that
        // rank 1 sends frames (see mismatch.rs for the area's own cases).
        let mut v = vec![0u8; 8000];
        // Both ranks are at sequence 0; rank 0 broadcasts, rank 1 all-reduces.
        let r = if b.rank() == 0 {
            b.broadcast(BufMut::Host(&mut v), DType::F32, 0, &quick(5000))
                .and_then(|_| {
                    b.all_reduce(
                        BufMut::Host(&mut v),
                        DType::F32,
                        ReduceOp::Sum,
                        &quick(5000),
                    )
                })
        } else {
            b.all_reduce(
                BufMut::Host(&mut v),
                DType::F32,
                ReduceOp::Sum,
                &quick(5000),
            )
        };
        r.unwrap_err()
    });
    let msg1 = errs[1].to_string();
    assert!(matches!(errs[1], Error::Mismatch { .. }), "{msg1}");
    assert_eq!(
        msg1,
        "rank 1 all_reduce #0 (f32 × 2000, SUM) met rank 0 broadcast #0 (f32 × 2000, root 0)"
    );
    // Rank 0 reads rank 1's all_reduce frame (which comes before rank 1's abort notice on the
    // connection) in its broadcast's first step.
    let msg0 = errs[0].to_string();
    assert!(matches!(errs[0], Error::Mismatch { .. }), "{msg0}");
    assert_eq!(
        msg0,
        "rank 0 broadcast #0 (f32 × 2000, root 0) met rank 1 all_reduce #0 (f32 × 2000, SUM)"
    );
}

/// A rank that gives up (times out) on a collective whose large messages it offered by
/// reference withdraws the offer: the stalled peer that later copies them gets an error, never
/// the stale bytes of a buffer its owner has taken back.
#[test]
fn a_late_peer_cannot_copy_a_buffer_whose_sender_gave_up() {
    if let Some(opts) = by_reference(false) {
        a_late_peer_cannot_copy(&opts, |b, v, o| {
            b.all_reduce(BufMut::Host(v), DType::U8, ReduceOp::Sum, o)
        });
    }
}

/// The same for a broadcast whose receiver splits its copies with a helper thread: both halves
/// of a frame are read before the offer is checked, so the withdrawal is seen either way.
#[test]
fn a_late_peer_splitting_its_copies_cannot_copy_a_buffer_whose_sender_gave_up() {
    if let Some(opts) = by_reference(true) {
        a_late_peer_cannot_copy(&opts, |b, v, o| {
            b.broadcast(BufMut::Host(v), DType::U8, 0, o)
        });
    }
}

/// Options that send large messages by reference over the rings too (a host with a CPU per
/// rank would send nothing that way), receivers splitting their copies if `split`; `None`
/// (the test skips) where this sandbox forbids cross-memory attach.
fn by_reference(split: bool) -> Option<GlooOptions> {
    if !dist_gloo::transport::tcp::cross_memory_available() {
        eprintln!("skipped: this sandbox forbids cross-memory attach, nothing goes by reference");
        return None;
    }
    let mut opts = GlooOptions::default();
    opts.mesh.cross_memory_over_rings = Some(true);
    opts.mesh.copy_helper = Some(split);
    Some(opts)
}

/// Rank 1 comes to `op` (4 MiB) long after rank 0 timed out on it and scribbled on its buffer.
fn a_late_peer_cannot_copy(
    opts: &GlooOptions,
    op: impl Fn(&GlooBackend, &mut [u8], &OpOptions) -> dist_backend::Result<()> + Sync,
) {
    let ranks = tcp_world(2, opts);
    let timeout = Duration::from_millis(400);
    let out = on_all(&ranks, |b| {
        let mut v = vec![1u8; 4 << 20];
        if b.rank() == 1 {
            std::thread::sleep(timeout * 3);
        }
        let r = op(b, &mut v, &OpOptions::with_timeout(timeout));
        // The sender's caller owns its buffer again: scribble on it, and keep it mapped so
        // that only the withdrawn offer can tell the late reader.
        v.fill(0xee);
        (r, v)
    });
    assert!(
        matches!(out[0].0, Err(Error::Timeout { .. })),
        "rank 0: {:?}",
        out[0].0
    );
    let late = out[1]
        .0
        .as_ref()
        .expect_err("the late rank must not succeed");
    // The copy finds the offer withdrawn; the notice the sender queued before withdrawing it
    // (it timed out waiting for this rank) explains why, when it has arrived.
    let msg = late.to_string();
    assert!(
        msg.contains("withdrew its offer") || msg.contains("timed out waiting for this rank"),
        "rank 1: {late}"
    );
    assert!(ranks[0].messages_by_reference() > 0);
}

#[test]
fn after_an_error_the_group_refuses_work_with_the_cause() {
    let ranks = tcp_world(2, &GlooOptions::default());
    let errs = on_all(&ranks, |b| {
        let mut v = vec![0u8; 8];
        if b.rank() == 1 {
            std::thread::sleep(Duration::from_millis(600));
            return String::new();
        }
        b.barrier(&quick(200)).unwrap_err();
        b.all_reduce(BufMut::Host(&mut v), DType::F64, ReduceOp::Sum, &quick(200))
            .unwrap_err()
            .to_string()
    });
    assert!(errs[0].starts_with("rank 0: all_reduce refused: the group was aborted by an earlier error: rank 0: barrier #0 timed out"), "{}", errs[0]);
}

#[test]
fn invalid_arguments_are_rejected_before_the_wire_and_name_rank_op_and_sizes() {
    let ranks = tcp_world(2, &GlooOptions::default());
    let b = &ranks[0];
    let mut v = vec![0u8; 6];
    let e = b
        .all_reduce(BufMut::Host(&mut v), DType::F32, ReduceOp::Sum, &quick(100))
        .unwrap_err()
        .to_string();
    assert_eq!(
        e,
        "rank 0: invalid argument to all_reduce: the buffer is 6 bytes, not a whole number of f32 elements"
    );
    let e = b
        .broadcast(BufMut::Host(&mut v), DType::U8, 2, &quick(100))
        .unwrap_err()
        .to_string();
    assert_eq!(
        e,
        "rank 0: invalid argument to broadcast: root 2 is not a rank of this group of 2"
    );
    let e = b
        .all_reduce(
            BufMut::Host(&mut v),
            DType::BF16,
            ReduceOp::BitOr,
            &quick(100),
        )
        .unwrap_err()
        .to_string();
    assert_eq!(
        e,
        "rank 0: all_reduce: reduce op BOR is not defined for dtype bf16"
    );
    // Counts whose sum, or whose size in bytes, does not fit a usize: refused, where the
    // wrapped sums passed the length checks and the block arithmetic panicked.
    let e = b
        .all_gather(
            BufRef::Host(&v[..1]),
            BufMut::Host(&mut []),
            DType::U8,
            &[1, usize::MAX],
            &quick(100),
        )
        .unwrap_err()
        .to_string();
    assert_eq!(
        e,
        "rank 0: invalid argument to all_gather: counts sum past any buffer"
    );
    let e = b
        .all_to_all(
            BufRef::Host(&v[..4]),
            BufMut::Host(&mut v.clone()[..4]),
            DType::F32,
            &[1, 0],
            &[1, usize::MAX / 2],
            &quick(100),
        )
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("the output is 4 bytes but") && e.contains("is past any buffer"),
        "{e}"
    );
    // None of these consumed a sequence number or aborted the group.
    assert_eq!(b.next_seq(), 0);
    on_all(&ranks, |b| b.barrier(&quick(5000)).unwrap());
}

#[test]
fn an_ipv6_mesh_works_when_the_host_has_ipv6_loopback() {
    if std::net::TcpListener::bind("[::1]:0").is_err() {
        eprintln!("skipped: no IPv6 loopback on this host");
        return;
    }
    let mut o = GlooOptions::default();
    o.mesh.ip = Some("::1".parse().unwrap());
    let ranks = tcp_world(3, &o);
    let out = on_all(&ranks, |b| {
        let mut v = [b.rank() as u64 + 1; 3];
        b.all_reduce(
            BufMut::Host(bytemuck::cast_slice_mut(&mut v)),
            DType::U64,
            ReduceOp::Product,
            &quick(5000),
        )
        .unwrap();
        v
    });
    assert!(out.iter().all(|v| *v == [6; 3]));
}

/// A rank whose collective times out tells its peers which rank it waited for, so ranks that
/// wait on it (not on the stalled rank) name the stalled rank too, long before their own
/// (much longer) timeouts. 4 ranks, recursive doubling: rank 2 waits on the stalled rank 3
/// first and has the short timeout; rank 0 waits only on rank 2, rank 1 on 3 in round two.
#[test]
fn a_timeout_is_passed_on_naming_the_stalled_rank() {
    let n = 4;
    let ranks = tcp_world(n, &GlooOptions::default());
    let long = Duration::from_secs(30);
    let released = std::sync::Barrier::new(n);
    let out = on_all(&ranks, |b| {
        let mut v = vec![1u8; 4];
        if b.rank() == 3 {
            // Stalls until every other rank has failed, then finds the group aborted: at once,
            // or one op later (the peers' frames of this one were sent before they gave up,
            // and the notices queue behind them).
            released.wait();
            let e = b
                .all_reduce(BufMut::Host(&mut v), DType::U8, ReduceOp::Sum, &quick(5000))
                .and_then(|()| b.barrier(&quick(5000)))
                .expect_err("the stalled rank joins an aborted group");
            return (e, Duration::ZERO);
        }
        let timeout = if b.rank() == 2 {
            Duration::from_secs(1)
        } else {
            long
        };
        let t0 = Instant::now();
        let e = b
            .all_reduce(
                BufMut::Host(&mut v),
                DType::U8,
                ReduceOp::Sum,
                &OpOptions::with_timeout(timeout),
            )
            .expect_err("a group with a stalled rank fails");
        let took = t0.elapsed();
        released.wait();
        (e, took)
    });
    for (r, (e, took)) in out.iter().enumerate().take(3) {
        match e {
            Error::Timeout {
                rank,
                op,
                missing_peers,
                ..
            } => {
                assert_eq!((*rank, *op), (r, CollectiveOp::AllReduce), "{e}");
                assert_eq!(missing_peers, &[3], "rank {r}: {e}");
            }
            other => panic!("rank {r}: expected a timeout naming rank 3, got {other}"),
        }
        assert!(*took < long / 2, "rank {r} took {took:?}: {e}");
    }
    // The stalled rank hears that a peer gave up on it.
    assert!(
        out[3]
            .0
            .to_string()
            .contains("timed out waiting for this rank"),
        "rank 3: {}",
        out[3].0
    );
}
