//! Every operation × world size 1..=5 × counts {0, 1, 7, 1 MiB + 3} × every dtype (and every
//! valid reduce op), over real loopback TCP between threads, checked against an independent
//! reference.

mod common;

use common::{assert_close, decode, encode, on_all, reference, tcp_world, tcp_world_with, value};
use dist_backend::{Backend, BufMut, BufRef, OpOptions};
use dist_gloo::transport::shm::TransportMode;
use dist_gloo::transport::tcp::cross_memory_available;
use dist_gloo::{GlooBackend, GlooOptions};
use dist_wire::{DType, ReduceOp};

const COUNTS: [usize; 4] = [0, 1, 7, (1 << 20) + 3];

fn opts() -> OpOptions {
    OpOptions::with_timeout(std::time::Duration::from_secs(60))
}

/// Smaller segments than the default so that the big count crosses many frames and the ring's
/// segment pipeline is exercised; the small-message switch is kept at its default.
fn gloo_opts() -> GlooOptions {
    let mut o = GlooOptions::default();
    o.mesh.segment_bytes = 256 << 10;
    o
}

fn check_all_reduce(ranks: &[GlooBackend]) {
    let n = ranks.len();
    for d in DType::ALL {
        for op in ReduceOp::ALL.into_iter().filter(|op| op.check(d).is_ok()) {
            for count in COUNTS {
                // The big count runs for one type of each width and kind and the ops whose kernels
                // differ most; the small counts run everything. Keeps the suite in CI's budget.
                let big_types = [DType::U8, DType::BF16, DType::F32, DType::I64];
                if count > 7
                    && !(big_types.contains(&d) && matches!(op, ReduceOp::Sum | ReduceOp::Avg))
                {
                    continue;
                }
                let outs = on_all(ranks, |b| {
                    let mut buf = encode(d, (0..count).map(|i| value(d, op, b.rank(), i)));
                    b.all_reduce(BufMut::Host(&mut buf), d, op, &opts())
                        .unwrap();
                    buf
                });
                for (r, out) in outs.iter().enumerate() {
                    assert_eq!(
                        out, &outs[0],
                        "ws {n} {d} {op} count {count}: rank {r} differs bitwise from rank 0"
                    );
                }
                for (i, got) in decode(d, &outs[0]).into_iter().enumerate() {
                    assert_close(
                        d,
                        &format!("all_reduce ws {n} {d} {op} count {count}"),
                        i,
                        got,
                        reference(d, op, n, i),
                    );
                }
                // reduce to the last rank, same op
                let root = n - 1;
                let outs = on_all(ranks, |b| {
                    let mut buf = encode(d, (0..count).map(|i| value(d, op, b.rank(), i)));
                    b.reduce(BufMut::Host(&mut buf), d, op, root, &opts())
                        .unwrap();
                    buf
                });
                for (i, got) in decode(d, &outs[root]).into_iter().enumerate() {
                    assert_close(
                        d,
                        &format!("reduce ws {n} {d} {op} count {count}"),
                        i,
                        got,
                        reference(d, op, n, i),
                    );
                }
                // reduce_scatter with uneven counts: rank r gets count + r elements
                if count > 7 && (op != ReduceOp::Sum || d != DType::F32) {
                    continue;
                }
                let counts: Vec<usize> = (0..n).map(|r| count + r % 2).collect();
                let total: usize = counts.iter().sum();
                let outs = on_all(ranks, |b| {
                    let input = encode(d, (0..total).map(|i| value(d, op, b.rank(), i)));
                    let mut out = vec![0u8; counts[b.rank()] * d.size()];
                    b.reduce_scatter(
                        BufRef::Host(&input),
                        BufMut::Host(&mut out),
                        d,
                        op,
                        &counts,
                        &opts(),
                    )
                    .unwrap();
                    out
                });
                let mut at = 0;
                for (r, out) in outs.iter().enumerate() {
                    for (j, got) in decode(d, out).into_iter().enumerate() {
                        assert_close(
                            d,
                            &format!("reduce_scatter ws {n} {d} {op} rank {r}"),
                            j,
                            got,
                            reference(d, op, n, at + j),
                        );
                    }
                    at += counts[r];
                }
            }
        }
    }
}

fn check_movement(ranks: &[GlooBackend]) {
    let n = ranks.len();
    for d in DType::ALL {
        for count in COUNTS {
            if count > 7 && !matches!(d, DType::U8 | DType::F32) {
                continue;
            }
            let mine = |r: usize| encode(d, (0..count).map(|i| value(d, ReduceOp::Sum, r, i)));
            let root = 1 % n;
            // broadcast
            let outs = on_all(ranks, |b| {
                let mut buf = if b.rank() == root {
                    mine(root)
                } else {
                    vec![0u8; count * d.size()]
                };
                b.broadcast(BufMut::Host(&mut buf), d, root, &opts())
                    .unwrap();
                buf
            });
            assert!(
                outs.iter().all(|o| *o == mine(root)),
                "broadcast ws {n} {d} count {count}"
            );
            // all_gather, uneven: rank r contributes count + r elements
            let counts: Vec<usize> = (0..n).map(|r| count + r).collect();
            let contrib =
                |r: usize| encode(d, (0..counts[r]).map(|i| value(d, ReduceOp::Sum, r, i)));
            let want: Vec<u8> = (0..n).flat_map(contrib).collect();
            let outs = on_all(ranks, |b| {
                let mut out = vec![0u8; want.len()];
                b.all_gather(
                    BufRef::Host(&contrib(b.rank())),
                    BufMut::Host(&mut out),
                    d,
                    &counts,
                    &opts(),
                )
                .unwrap();
                out
            });
            assert!(
                outs.iter().all(|o| *o == want),
                "all_gather ws {n} {d} count {count}"
            );
            // gather and scatter at `root`
            let outs = on_all(ranks, |b| {
                let mut out = vec![0u8; n * count * d.size()];
                let o = (b.rank() == root).then_some(BufMut::Host(&mut out));
                b.gather(BufRef::Host(&mine(b.rank())), o, d, root, &opts())
                    .unwrap();
                out
            });
            let all: Vec<u8> = (0..n).flat_map(mine).collect();
            assert_eq!(outs[root], all, "gather ws {n} {d} count {count}");
            let outs = on_all(ranks, |b| {
                let mut out = vec![0u8; count * d.size()];
                let i = (b.rank() == root).then_some(BufRef::Host(&all));
                b.scatter(i, BufMut::Host(&mut out), d, root, &opts())
                    .unwrap();
                out
            });
            for (r, o) in outs.iter().enumerate() {
                assert_eq!(*o, mine(r), "scatter ws {n} {d} count {count} rank {r}");
            }
            // all_to_all with split sizes: rank s sends count + s + r elements to rank r
            let split = |s: usize, r: usize| count + s + r;
            let block = |s: usize, r: usize| {
                encode(
                    d,
                    (0..split(s, r)).map(|i| value(d, ReduceOp::Sum, s * n + r, i)),
                )
            };
            let outs = on_all(ranks, |b| {
                let me = b.rank();
                let send_counts: Vec<usize> = (0..n).map(|r| split(me, r)).collect();
                let recv_counts: Vec<usize> = (0..n).map(|s| split(s, me)).collect();
                let input: Vec<u8> = (0..n).flat_map(|r| block(me, r)).collect();
                let mut out = vec![0u8; recv_counts.iter().sum::<usize>() * d.size()];
                b.all_to_all(
                    BufRef::Host(&input),
                    BufMut::Host(&mut out),
                    d,
                    &send_counts,
                    &recv_counts,
                    &opts(),
                )
                .unwrap();
                out
            });
            for (r, o) in outs.iter().enumerate() {
                let want: Vec<u8> = (0..n).flat_map(|s| block(s, r)).collect();
                assert_eq!(*o, want, "all_to_all ws {n} {d} count {count} rank {r}");
            }
        }
    }
    on_all(ranks, |b| b.barrier(&opts()).unwrap());
}

fn check_p2p(ranks: &[GlooBackend]) {
    let n = ranks.len();
    if n < 2 {
        return;
    }
    // Every rank sends two tagged messages to its right neighbour in one order; the receiver
    // takes them in the other order, so the tag matching is exercised.
    on_all(ranks, |b| {
        let (r, right, left) = (b.rank(), (b.rank() + 1) % n, (b.rank() + n - 1) % n);
        let a: Vec<u8> = encode(DType::I32, (0..1000).map(|i| (i + r) as f64));
        let c: Vec<u8> = encode(DType::I32, (0..3).map(|i| (i * 100 + r) as f64));
        let tag = |t| OpOptions { tag: t, ..opts() };
        b.send(BufRef::Host(&a), DType::I32, right, &tag(7))
            .unwrap();
        b.send(BufRef::Host(&c), DType::I32, right, &tag(9))
            .unwrap();
        let mut got_c = vec![0u8; c.len()];
        let mut got_a = vec![0u8; a.len()];
        b.recv(BufMut::Host(&mut got_c), DType::I32, left, &tag(9))
            .unwrap();
        b.recv(BufMut::Host(&mut got_a), DType::I32, left, &tag(7))
            .unwrap();
        assert_eq!(
            got_a,
            encode(DType::I32, (0..1000).map(|i| (i + left) as f64))
        );
        assert_eq!(
            got_c,
            encode(DType::I32, (0..3).map(|i| (i * 100 + left) as f64))
        );
    });
}

/// Every check on `n` ranks whose pairs all use `mode`, with or without single-copy transfers.
fn over(n: usize, mode: TransportMode, cross_memory: bool) {
    let mut o = gloo_opts();
    o.mesh.transport = mode;
    o.mesh.cross_memory = cross_memory;
    let ranks = tcp_world(n, &o);
    for b in &ranks {
        let want: Vec<bool> = (0..n)
            .map(|p| p != b.rank() && mode == TransportMode::Shm)
            .collect();
        assert_eq!(
            b.shared_memory_peers(),
            want,
            "ws {n} {mode:?}: rank {}",
            b.rank()
        );
    }
    check_all_reduce(&ranks);
    check_movement(&ranks);
    check_p2p(&ranks);
    // Threads of one process read each other wherever the system call is allowed: then the
    // big counts went single-copy.
    let by_ref: u64 = ranks.iter().map(GlooBackend::messages_by_reference).sum();
    assert_eq!(
        by_ref > 0,
        n > 1 && cross_memory && cross_memory_available(),
        "ws {n}: {by_ref} messages sent by reference"
    );
}

fn over_tcp(n: usize) {
    over(n, TransportMode::Tcp, true);
}

fn over_shm(n: usize) {
    over(n, TransportMode::Shm, true);
}

/// Ranks playing two hosts in one process (host ids a, a, b, b, a): rings within each host,
/// sockets between them, in one group, and every check passes across the mix.
#[test]
fn a_mixed_group_uses_shared_memory_within_a_host_and_tcp_between_hosts() {
    let hosts = ["a", "a", "b", "b", "a"];
    let ranks = tcp_world_with(hosts.len(), |r| {
        let mut o = gloo_opts();
        o.mesh.host_id = Some(hosts[r].to_string());
        o
    });
    for b in &ranks {
        let me = b.rank();
        let want: Vec<bool> = (0..hosts.len())
            .map(|p| p != me && hosts[p] == hosts[me])
            .collect();
        assert_eq!(b.shared_memory_peers(), want, "rank {me}");
    }
    check_all_reduce(&ranks);
    check_movement(&ranks);
    check_p2p(&ranks);
}

/// A rank that opts out of single-copy transfers neither sends nor is sent anything by
/// reference, while the others still use it between themselves.
#[test]
fn a_rank_without_cross_memory_mixes_with_ranks_that_have_it() {
    let ranks = tcp_world_with(3, |r| {
        let mut o = gloo_opts();
        o.mesh.cross_memory = r != 1;
        o
    });
    let n = ranks.len();
    let count = (1 << 20) + 3;
    let outs = on_all(&ranks, |b| {
        let mut buf = encode(
            DType::F32,
            (0..count).map(|i| value(DType::F32, ReduceOp::Sum, b.rank(), i)),
        );
        b.all_reduce(BufMut::Host(&mut buf), DType::F32, ReduceOp::Sum, &opts())
            .unwrap();
        buf
    });
    for out in &outs {
        for (i, got) in decode(DType::F32, out).into_iter().enumerate() {
            assert_close(
                DType::F32,
                "mixed all_reduce",
                i,
                got,
                reference(DType::F32, ReduceOp::Sum, n, i),
            );
        }
    }
    assert_eq!(ranks[1].messages_by_reference(), 0);
    // Ring: rank 0 sends to rank 1 (inline), rank 2 sends to rank 0 (by reference).
    assert_eq!(
        ranks[2].messages_by_reference() > 0,
        cross_memory_available()
    );
}

#[test]
fn world_size_3_over_tcp_without_cross_memory() {
    over(3, TransportMode::Tcp, false);
}

/// Every byte through the rings, the large counts included.
#[test]
fn world_size_3_over_shm_without_cross_memory() {
    over(3, TransportMode::Shm, false);
}

#[test]
fn world_size_1_over_tcp() {
    over_tcp(1);
}

#[test]
fn world_size_2_over_tcp() {
    over_tcp(2);
}

#[test]
fn world_size_3_over_tcp() {
    over_tcp(3);
}

#[test]
fn world_size_4_over_tcp() {
    over_tcp(4);
}

#[test]
fn world_size_5_over_tcp() {
    over_tcp(5);
}

#[test]
fn world_size_1_over_shm() {
    over_shm(1);
}

#[test]
fn world_size_2_over_shm() {
    over_shm(2);
}

#[test]
fn world_size_3_over_shm() {
    over_shm(3);
}

#[test]
fn world_size_4_over_shm() {
    over_shm(4);
}

#[test]
fn world_size_5_over_shm() {
    over_shm(5);
}

#[test]
fn algorithms_agree_over_the_in_memory_transport() {
    for n in [1, 3, 4] {
        let ranks = GlooBackend::in_memory(n, &gloo_opts());
        check_movement(&ranks);
        check_p2p(&ranks);
    }
}

/// `probe` answers without blocking: false until the tagged message starts to arrive, true once
/// it has (before the `recv`), and true for a peer that is gone (its `recv` would fail at once).
#[test]
fn probe_sees_a_tagged_message_before_its_recv_and_a_departed_peer() {
    for ranks in [
        tcp_world(2, &gloo_opts()),
        GlooBackend::in_memory(2, &gloo_opts()),
    ] {
        let tagged = |tag| OpOptions { tag, ..opts() };
        let (a, b) = (&ranks[0], &ranks[1]);
        assert!(!b.probe(0, 7).unwrap(), "nothing sent yet");
        a.send(BufRef::Host(&[1, 2, 3, 4]), DType::U8, 1, &tagged(7))
            .unwrap();
        let t0 = std::time::Instant::now();
        while !b.probe(0, 7).unwrap() {
            assert!(
                t0.elapsed() < std::time::Duration::from_secs(10),
                "never seen"
            );
            std::thread::yield_now();
        }
        assert!(!b.probe(0, 8).unwrap(), "another tag has not arrived");
        let mut got = [0u8; 4];
        b.recv(BufMut::Host(&mut got), DType::U8, 0, &tagged(7))
            .unwrap();
        assert_eq!(got, [1, 2, 3, 4]);
        assert!(b.probe(1, 7).is_err(), "probing oneself is an error");
        let mut ranks = ranks;
        drop(ranks.remove(0));
        let t0 = std::time::Instant::now();
        while !ranks[0].probe(0, 9).unwrap() {
            assert!(
                t0.elapsed() < std::time::Duration::from_secs(10),
                "departure never seen"
            );
            std::thread::yield_now();
        }
    }
}
