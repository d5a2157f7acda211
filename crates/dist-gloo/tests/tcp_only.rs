//! The cross-host path: broadcast and all_to_all with single-copy transfers off, so every byte
//! goes through the sockets, on 1..=5 ranks, every root, sizes 0, 1, uneven and large (many
//! segments, so the chain broadcast's pipeline and the staggered all_to_all both run with
//! several frames in flight per peer), all_to_all's two schedules mixed rank by rank, over
//! sockets and by reference, all_gather's ring in pieces, recursive doubling and star, and
//! reduce_scatter's star and recursive halving. Checked against the values each rank was built from
//! (reduce_scatter against the independent reference).

mod common;

use common::{
    check_all_to_all, check_all_to_all_even, check_reduce_scatter, encode, on_all, tcp_world, value,
};
use dist_backend::{Backend, BufMut, BufRef, OpOptions};
use dist_gloo::transport::tcp::cross_memory_available;
use dist_gloo::{GlooBackend, GlooOptions};
use dist_wire::{DType, ReduceOp};

/// 0, 1, uneven (not a multiple of the ranks or the segment), past the tree/chain switch, and
/// many segments.
const COUNTS: [usize; 5] = [0, 1, 7, (16 << 10) + 5, (1 << 20) + 3];

fn opts() -> OpOptions {
    OpOptions::with_timeout(std::time::Duration::from_secs(60))
}

/// Sockets only, and 64 KiB segments so that the large counts span many frames.
fn tcp_only_world(n: usize) -> Vec<GlooBackend> {
    let mut o = GlooOptions::default();
    o.mesh.cross_memory = false;
    o.mesh.segment_bytes = 64 << 10;
    tcp_world(n, &o)
}

fn check_broadcast(ranks: &[GlooBackend]) {
    let n = ranks.len();
    for d in [DType::U8, DType::F32] {
        for count in COUNTS {
            for root in 0..n {
                let mine = |r: usize| encode(d, (0..count).map(|i| value(d, ReduceOp::Sum, r, i)));
                let outs = on_all(ranks, |b| {
                    let mut buf = if b.rank() == root {
                        mine(root)
                    } else {
                        vec![0xA5u8; count * d.size()]
                    };
                    b.broadcast(BufMut::Host(&mut buf), d, root, &opts())
                        .unwrap();
                    buf
                });
                for (r, o) in outs.iter().enumerate() {
                    assert!(
                        *o == mine(root),
                        "broadcast ws {n} {d} count {count} root {root}: rank {r} differs"
                    );
                }
            }
        }
    }
}

fn check_uneven_all_to_all(ranks: &[GlooBackend]) {
    let n = ranks.len();
    for d in [DType::U8, DType::F32] {
        for count in COUNTS {
            // Uneven splits, some of them empty: rank s sends split(s, r) elements to rank r.
            let split = |s: usize, r: usize| {
                if (s + 2 * r) % 3 == 1 {
                    0
                } else {
                    count + s * n + r
                }
            };
            check_all_to_all(ranks, d, split, &opts(), &format!("count {count}"));
        }
    }
}

fn over_sockets(n: usize) {
    let ranks = tcp_only_world(n);
    check_broadcast(&ranks);
    check_uneven_all_to_all(&ranks);
    let by_ref: u64 = ranks.iter().map(GlooBackend::messages_by_reference).sum();
    assert_eq!(
        by_ref, 0,
        "ws {n}: every byte must have gone through the sockets"
    );
}

#[test]
fn world_size_1_over_sockets_only() {
    over_sockets(1);
}

#[test]
fn world_size_2_over_sockets_only() {
    over_sockets(2);
}

#[test]
fn world_size_3_over_sockets_only() {
    over_sockets(3);
}

#[test]
fn world_size_4_over_sockets_only() {
    over_sockets(4);
}

#[test]
fn world_size_5_over_sockets_only() {
    over_sockets(5);
}

/// The scatter + ring all-gather broadcast (van de Geijn), forced for every size but empty
/// (which stays on the tree) over sockets only: every root, 1 to 5 ranks (on 1 and 2 the
/// chain and tree still run), counts 1, uneven (fewer elements than ranks, and not a multiple
/// of them) and many segments.
#[test]
fn scatter_all_gather_broadcast_over_sockets_on_1_to_5_ranks() {
    for n in 1..=5 {
        let mut o = GlooOptions {
            small_bytes: Some(0),
            broadcast_scatter_bytes: Some(0),
            ..GlooOptions::default()
        };
        o.mesh.cross_memory = false;
        o.mesh.segment_bytes = 64 << 10;
        check_broadcast(&tcp_world(n, &o));
    }
}

/// all_to_all's two schedules (every block at once, and pairwise exchanges) interoperate:
/// ranks that choose differently, here by their own `all_to_all_pairwise_bytes` (with uneven
/// splits a shared threshold splits them by their largest block the same way), still deliver
/// every block. Over sockets only and, with single copy on, with the large blocks sent by
/// reference (where this host lets threads read each other), whose senders wait for the
/// receiver's copy; 3 to 5 ranks, every other rank pairwise, then every rank. Pairing a
/// pairwise step's send with the wrong receive makes this time out, so the pairwise schedule
/// does run here.
#[test]
fn all_to_all_schedules_mix_over_sockets_and_by_reference() {
    for cross_memory in [false, true] {
        for n in 3..=5 {
            for pairwise_ranks in [2, 1] {
                let ranks = common::tcp_world_with(n, |r| {
                    let mut o = GlooOptions {
                        all_to_all_pairwise_bytes: Some(if r % pairwise_ranks == 0 {
                            0
                        } else {
                            usize::MAX
                        }),
                        ..GlooOptions::default()
                    };
                    o.mesh.transport = dist_gloo::transport::shm::TransportMode::Tcp;
                    o.mesh.cross_memory = cross_memory;
                    o.mesh.segment_bytes = 64 << 10;
                    o
                });
                check_uneven_all_to_all(&ranks);
                let by_ref: u64 = ranks.iter().map(GlooBackend::messages_by_reference).sum();
                assert_eq!(
                    by_ref > 0,
                    cross_memory && cross_memory_available(),
                    "ws {n}: blocks by reference only with single copy on"
                );
            }
        }
    }
}

/// all_gather where every byte crosses a socket (no two ranks sharing memory): the ring in
/// pieces of 64 KiB so that the large counts run many; for 16 KiB + 5 one-byte elements on 4
/// and 8 ranks, recursive doubling; for the smallest counts on 3 to 5 and 8 ranks, the star
/// through rank 0. Even and uneven blocks (some empty, and with the large counts
/// one of 3 elements, fewer than there are pieces, so that most pieces carry an empty part of
/// it) on 1 to 5 and 8 ranks.
#[test]
fn all_gather_in_pieces_over_sockets_on_1_to_5_and_8_ranks() {
    for n in (1..=5).chain([8]) {
        let mut o = GlooOptions {
            ring_piece_bytes: Some(64 << 10),
            ..GlooOptions::default()
        };
        o.mesh.transport = dist_gloo::transport::shm::TransportMode::Tcp;
        o.mesh.cross_memory = false;
        o.mesh.segment_bytes = 16 << 10;
        let ranks = tcp_world(n, &o);
        assert!(ranks.iter().all(|b| !b.memory_shared_in_group()));
        for d in [DType::U8, DType::F32] {
            for count in COUNTS {
                for uneven in [false, true] {
                    let counts: Vec<usize> = (0..n)
                        .map(|r| match (uneven, r % 3) {
                            (false, _) => count,
                            (true, 0) => count + r,
                            (true, 1) => 0,
                            (true, _) => count.min(3),
                        })
                        .collect();
                    let block =
                        |r: usize| encode(d, (0..counts[r]).map(|i| value(d, ReduceOp::Sum, r, i)));
                    let want: Vec<u8> = (0..n).flat_map(block).collect();
                    let outs = on_all(&ranks, |b| {
                        let mut out = vec![0xA5u8; want.len()];
                        b.all_gather(
                            BufRef::Host(&block(b.rank())),
                            BufMut::Host(&mut out),
                            d,
                            &counts,
                            &opts(),
                        )
                        .unwrap_or_else(|e| panic!("all_gather ws {n} {d} {counts:?}: {e}"));
                        out
                    });
                    for (r, got) in outs.iter().enumerate() {
                        assert!(
                            *got == want,
                            "all_gather ws {n} {d} {counts:?}: rank {r} differs"
                        );
                    }
                }
            }
        }
    }
}

/// reduce_scatter where no two ranks share memory on a power-of-two group: the star through
/// rank 0 for the small counts, recursive halving for 3001 elements per rank (past the star's
/// bound on 4 and 8 ranks). Every dtype and reduce op, on 4 and 8 ranks, with even, uneven and
/// skewed splits (empty blocks, one of 3 elements) and 16 KiB segments, so that the larger
/// halves stream through their receive windows in several frames. Checked against the
/// independent reference.
#[test]
fn reduce_scatter_by_star_and_halving_over_sockets_on_4_and_8_ranks() {
    for n in [4, 8] {
        let mut o = GlooOptions::default();
        o.mesh.transport = dist_gloo::transport::shm::TransportMode::Tcp;
        o.mesh.cross_memory = false;
        o.mesh.segment_bytes = 16 << 10;
        let ranks = tcp_world(n, &o);
        assert!(ranks.iter().all(|b| !b.memory_shared_in_group()));
        for d in DType::ALL {
            for op in ReduceOp::ALL.into_iter().filter(|op| op.check(d).is_ok()) {
                for count in [0, 1, 7, 3001] {
                    let splits: [Vec<usize>; 3] = [
                        vec![count; n],
                        (0..n).map(|r| count + r % 3).collect(),
                        (0..n)
                            .map(|r| match r % 4 {
                                0 => 0,
                                1 => count.min(3),
                                _ => count + r,
                            })
                            .collect(),
                    ];
                    for counts in &splits {
                        check_reduce_scatter(&ranks, d, op, counts);
                    }
                }
            }
        }
    }
}

/// The even all_to_all where no two ranks share memory: through rank 0 on 3 to 8 ranks while
/// rank 0 receives at most 64 KiB in all, by messages past that and on 9 ranks. Every dtype on
/// 8 ranks (the star's largest group) and 9 (the smallest past it), and counts on both sides
/// of the star's bound on 4 ranks (f32 blocks of 1365 and 1366 elements: 65520 and 65568
/// bytes to rank 0), each between uneven calls, so that the forms' frames follow one another.
/// Checked against the values each rank encoded for each receiver.
#[test]
fn even_all_to_all_through_rank_zero_and_by_messages_over_sockets() {
    let mut o = GlooOptions::default();
    o.mesh.transport = dist_gloo::transport::shm::TransportMode::Tcp;
    o.mesh.cross_memory = false;
    o.mesh.segment_bytes = 16 << 10;
    for n in [8, 9] {
        let ranks = tcp_world(n, &o);
        for d in DType::ALL {
            for count in [0, 1, 7] {
                check_all_to_all_even(&ranks, d, count, &opts(), "small");
                check_all_to_all(&ranks, d, |s, r| count + (s + r) % 3, &opts(), "uneven");
            }
        }
    }
    let ranks = tcp_world(4, &o);
    for count in [256, 1365, 1366, 4096] {
        check_all_to_all_even(&ranks, DType::F32, count, &opts(), "around the bound");
        check_all_to_all(&ranks, DType::F32, |_, _| count, &opts(), "uneven form");
    }
}

/// Ranks that call the even all_to_all where others call the uneven form with the same counts
/// (through rank 0 against the direct exchange) fail, every one of them, with a mismatch
/// naming both algorithms, not a timeout; the group then refuses further operations.
#[test]
fn even_and_uneven_all_to_all_mixed_fail_every_rank_with_a_mismatch() {
    let mut o = GlooOptions::default();
    o.mesh.transport = dist_gloo::transport::shm::TransportMode::Tcp;
    let n = 4;
    let ranks = tcp_world(n, &o);
    let errs = on_all(&ranks, |b| {
        let input = vec![1u8; n * 4];
        let mut out = vec![0u8; n * 4];
        let (i, o) = (BufRef::Host(&input), BufMut::Host(&mut out));
        let r = if b.rank() == 2 {
            b.all_to_all(i, o, DType::F32, &[1; 4], &[1; 4], &opts())
        } else {
            b.all_to_all_even(i, o, DType::F32, 1, &opts())
        };
        r.expect_err("mixed forms must fail")
    });
    for (r, e) in errs.iter().enumerate() {
        let text = e.to_string();
        assert!(
            matches!(
                e,
                dist_backend::Error::Mismatch { .. }
                    | dist_backend::Error::MismatchReported { .. }
                    | dist_backend::Error::Aborted { .. }
            ),
            "rank {r}: {text}"
        );
        assert!(text.contains("star through rank 0"), "rank {r}: {text}");
    }
}
