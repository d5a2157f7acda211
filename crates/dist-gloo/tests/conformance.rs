//! The conformance suite: the same test bodies over every driver of the peer protocol
//! ([`common::DRIVERS`]: real loopback TCP between threads, shared-memory rings under that TCP
//! mesh, and the in-memory pipes).
//!
//! Data: every operation × world size 1..=5 × counts {0, 1, 7, 1 MiB + 3} × every dtype (and
//! every valid reduce op), checked against an independent reference. Faults: ranks that
//! disagree, a stalled rank, a crashed rank, a rank that leaves, and a send nobody receives,
//! each with the error every rank must report. Point-to-point: tags matched out of order, and
//! sleeping for arrivals woken by a message or the arrival waker.

mod common;

use common::{
    DRIVERS, MakeTransports, assert_close, check_all_to_all, check_all_to_all_even,
    check_reduce_scatter, decode, encode, on_all, reference, shm_rings_transports, shm_transports,
    tcp_world, tcp_world_with, value, world,
};
use std::sync::Barrier;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use dist_backend::{Backend, BufMut, BufRef, Error, OpOptions};
use dist_gloo::transport::shm::TransportMode;
use dist_gloo::transport::tcp::cross_memory_available;
use dist_gloo::{GlooBackend, GlooOptions};
use dist_wire::{CollectiveOp, DType, ReduceOp};

const COUNTS: [usize; 4] = [0, 1, 7, (1 << 20) + 3];

fn opts() -> OpOptions {
    OpOptions::with_timeout(Duration::from_secs(60))
}

/// Smaller segments than the default so that the big count crosses many frames and the ring's
/// segment pipeline is exercised; the small-message switch is kept at its default. The ring
/// all_reduce runs the big count in pieces of a size that divides nothing evenly. all_reduce
/// and all_gather go over messages beyond the 4 KiB the group area always takes, and
/// broadcast always, whatever the host's CPUs (their defaults follow them), and no input is
/// lent through it: [`through_the_area`] has the other way, and the tests of lending their own.
fn gloo_opts() -> GlooOptions {
    let mut o = GlooOptions::default();
    o.mesh.segment_bytes = 256 << 10;
    o.ring_piece_bytes = Some(1_777_777);
    o.area_all_reduce_bytes = Some(0);
    o.area_all_gather_bytes = Some(0);
    o.area_broadcast_min_bytes = Some(usize::MAX);
    o.area_all_to_all_bytes = Some(0);
    o.lent_all_to_all_bytes = Some(usize::MAX);
    o.lent_all_gather_bytes = Some(usize::MAX);
    o.lent_all_reduce_bytes = Some(usize::MAX);
    o
}

/// [`gloo_opts`] with every all_reduce over 4 KiB in two shots through the group area, every
/// all_gather whose blocks fit the area through it, every broadcast through it, and every
/// all_to_all through it (by messages after it where an input does not fit).
fn through_the_area() -> GlooOptions {
    let mut o = gloo_opts();
    o.area_all_reduce_bytes = Some(usize::MAX);
    o.area_all_gather_bytes = Some(usize::MAX);
    o.area_broadcast_min_bytes = Some(0);
    o.area_all_to_all_bytes = Some(usize::MAX);
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
                check_one_all_reduce(ranks, d, op, count);
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
                // reduce_scatter with uneven counts: rank r gets count + r % 2 elements, and
                // for the big count also a skewed split (rank 0 none, rank 1 three elements
                // where there are more than two ranks, the others about a megabyte), which the
                // ring's pieces cut into parts some of them empty.
                if count > 7 && (op != ReduceOp::Sum || d != DType::F32) {
                    continue;
                }
                let mut splits = vec![(0..n).map(|r| count + r % 2).collect::<Vec<usize>>()];
                if count > 7 && n > 1 {
                    splits.push(
                        (0..n)
                            .map(|r| match r {
                                0 => 0,
                                1 if n > 2 => 3,
                                _ => count + r,
                            })
                            .collect(),
                    );
                }
                for counts in splits {
                    check_reduce_scatter(ranks, d, op, &counts);
                }
            }
        }
    }
}

/// One all_reduce of `count` elements of the suite's values: every rank bitwise alike, and
/// alike to the reference.
fn check_one_all_reduce(ranks: &[GlooBackend], d: DType, op: ReduceOp, count: usize) {
    let n = ranks.len();
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
}

/// One all_gather of the suite's values, rank r contributing `counts[r]` elements: every
/// rank's output is every contribution in rank order.
fn check_one_all_gather(ranks: &[GlooBackend], d: DType, counts: &[usize]) {
    let n = ranks.len();
    let contrib = |r: usize| encode(d, (0..counts[r]).map(|i| value(d, ReduceOp::Sum, r, i)));
    let want: Vec<u8> = (0..n).flat_map(contrib).collect();
    let outs = on_all(ranks, |b| {
        let mut out = vec![0u8; want.len()];
        b.all_gather(
            BufRef::Host(&contrib(b.rank())),
            BufMut::Host(&mut out),
            d,
            counts,
            &opts(),
        )
        .unwrap();
        out
    });
    assert!(
        outs.iter().all(|o| *o == want),
        "all_gather ws {n} {d} counts {:?}..",
        &counts[..1]
    );
}

/// One broadcast of `count` elements of rank `root`'s values: every rank ends with them.
fn check_one_broadcast(ranks: &[GlooBackend], d: DType, count: usize, root: usize) {
    let n = ranks.len();
    let values = encode(d, (0..count).map(|i| value(d, ReduceOp::Sum, root, i)));
    let outs = on_all(ranks, |b| {
        let mut buf = if b.rank() == root {
            values.clone()
        } else {
            vec![0u8; values.len()]
        };
        b.broadcast(BufMut::Host(&mut buf), d, root, &opts())
            .unwrap();
        buf
    });
    assert!(
        outs.iter().all(|o| *o == values),
        "broadcast ws {n} {d} count {count} root {root}"
    );
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
            check_one_broadcast(ranks, d, count, root);
            // all_gather, uneven: rank r contributes count + r elements
            let counts: Vec<usize> = (0..n).map(|r| count + r).collect();
            check_one_all_gather(ranks, d, &counts);
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
            check_all_to_all(ranks, d, split, &opts(), &format!("count {count}"));
            // and even, through rank 0 from 3 ranks where small
            check_all_to_all_even(ranks, d, count, &opts(), &format!("count {count}"));
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

/// Sleeping for arrivals (the process group's point-to-point engine, between its receives)
/// ends on the arrival waker, woken before the wait or during it, and on a peer's message. A
/// lost wake-up shows as a wait that runs to its timeout, far longer than the rest of the
/// suite.
fn check_arrival_wait(ranks: &[GlooBackend]) {
    const LONG: Duration = Duration::from_secs(120);
    let n = ranks.len();
    if n < 2 {
        return;
    }
    let ends = |b: &GlooBackend, what: &str| {
        let began = Instant::now();
        b.wait_for_arrival(LONG).unwrap();
        assert!(
            began.elapsed() < LONG / 2,
            "rank {}: the wait for arrivals ran to its timeout, {what}",
            b.rank()
        );
    };
    let sent = Barrier::new(n);
    on_all(ranks, |b| {
        let (r, right, left) = (b.rank(), (b.rank() + 1) % n, (b.rank() + n - 1) % n);
        // A message one probe read while looking for another, after its own probe found
        // nothing: the wait must not sleep on it (the process group's engine probes its
        // receives in turn, then waits). First a short wait takes in what the operations
        // before read.
        b.wait_for_arrival(Duration::from_millis(1)).unwrap();
        let first = OpOptions { tag: 21, ..opts() };
        if r == 1 {
            assert!(!b.probe(0, 21).unwrap(), "nothing sent yet");
        }
        sent.wait();
        if r == 0 {
            b.send(BufRef::Host(&[21u8; 2]), DType::U8, 1, &first)
                .unwrap();
        }
        sent.wait();
        let mut waited = Duration::ZERO;
        if r == 1 {
            assert!(!b.probe(0, 22).unwrap(), "no message with tag 22");
            let began = Instant::now();
            b.wait_for_arrival(LONG).unwrap();
            waited = began.elapsed();
            assert!(b.probe(0, 21).unwrap(), "the message read");
            let mut got = [0u8; 2];
            b.recv(BufMut::Host(&mut got), DType::U8, 0, &first)
                .unwrap();
            assert_eq!(got, [21u8; 2]);
        }
        // Rank 0's next sends would wake that wait, so they wait for it (and a failed wait is
        // reported past the barrier, so as not to leave rank 0 at it).
        sent.wait();
        assert!(
            waited < LONG / 2,
            "rank {r}: the wait for arrivals ran to its timeout, with a message a probe for \
             another read"
        );
        let waker = b.arrival_waker().expect("every driver sleeps for arrivals");
        waker.wake_by_ref();
        ends(b, "woken before it began");
        std::thread::scope(|s| {
            s.spawn(|| waker.wake_by_ref());
            ends(b, "woken from another thread");
        });
        let tag = OpOptions { tag: 11, ..opts() };
        b.send(BufRef::Host(&[r as u8; 3]), DType::U8, right, &tag)
            .unwrap();
        // Returns early are allowed: the caller probes again.
        while !b.probe(left, 11).unwrap() {
            ends(b, "with a message on its way");
        }
        let mut got = [0u8; 3];
        b.recv(BufMut::Host(&mut got), DType::U8, left, &tag)
            .unwrap();
        assert_eq!(got, [left as u8; 3]);
        // Sent before the wait began, while rank 1 ran no step that could read ahead, and read
        // by no probe: over shared-memory rings such bytes come with no doorbell, so only the
        // wait's own look can see them.
        let tag = OpOptions { tag: 12, ..opts() };
        sent.wait();
        if r == 0 {
            b.send(BufRef::Host(&[5u8; 5]), DType::U8, 1, &tag).unwrap();
        }
        sent.wait();
        if r == 1 {
            ends(b, "with a message sent before it began");
            assert!(b.probe(0, 12).unwrap(), "the message the wait read");
            let mut got = [0u8; 5];
            b.recv(BufMut::Host(&mut got), DType::U8, 0, &tag).unwrap();
            assert_eq!(got, [5u8; 5]);
        }
    });
}

/// The whole data suite over `driver`'s transports.
fn over(driver: &str, make: MakeTransports, n: usize) {
    let ranks = world(make, n, &gloo_opts());
    check_all_reduce(&ranks);
    check_movement(&ranks);
    check_p2p(&ranks);
    check_arrival_wait(&ranks);
    // Threads of one process read each other wherever the system call is allowed: then the
    // big counts went single-copy (only the TCP mesh, over sockets or rings, offers by
    // reference, and over rings only when told to).
    let by_ref: u64 = ranks.iter().map(GlooBackend::messages_by_reference).sum();
    assert_eq!(
        by_ref > 0,
        !matches!(driver, "mem" | "shm-rings") && n > 1 && cross_memory_available(),
        "{driver} ws {n}: {by_ref} messages sent by reference"
    );
    // On the shared-memory driver, the large broadcasts and scatters went by reference and
    // their receivers read each frame half on a helper thread.
    let split: u64 = ranks.iter().map(GlooBackend::copies_split).sum();
    assert_eq!(
        split > 0,
        driver == "shm" && n > 1 && cross_memory_available(),
        "{driver} ws {n}: {split} frames copied half by a helper"
    );
}

/// [`over`] for every driver, and for shared memory with large messages through the rings.
fn over_every_driver(n: usize) {
    let rings: (&str, MakeTransports) = ("shm-rings", shm_rings_transports);
    for &(driver, make) in DRIVERS.iter().chain([&rings]) {
        over(driver, make, n);
    }
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

/// Every byte through the rings, the large counts included.
#[test]
fn world_size_3_over_shm_without_cross_memory() {
    let mut o = gloo_opts();
    o.mesh.transport = TransportMode::Shm;
    o.mesh.cross_memory = false;
    let ranks = tcp_world(3, &o);
    for b in &ranks {
        let want: Vec<bool> = (0..3).map(|p| p != b.rank()).collect();
        assert_eq!(b.shared_memory_peers(), want);
    }
    check_all_reduce(&ranks);
    check_movement(&ranks);
    check_p2p(&ranks);
    let by_ref: u64 = ranks.iter().map(GlooBackend::messages_by_reference).sum();
    assert_eq!(by_ref, 0, "every byte must have gone through the rings");
}

/// Messages from 8 MiB, which the rings copy into an all-gather's, gather's or all-to-all's
/// output with stores that bypass the cache (as each rank's own block is copied), arrive
/// whole at uneven lengths and offsets, on 2 and 3 ranks.
#[test]
fn outputs_large_enough_to_bypass_the_cache_arrive_whole_over_the_rings() {
    let big = (8 << 20) + 5;
    for n in [2, 3] {
        let ranks = tcp_world(n, &{
            let mut o = gloo_opts();
            o.mesh.transport = TransportMode::Shm;
            o.mesh.cross_memory = false;
            o
        });
        let d = DType::U8;
        let counts: Vec<usize> = (0..n).map(|r| big + 3 * r).collect();
        let contrib = |r: usize| encode(d, (0..counts[r]).map(|i| value(d, ReduceOp::Sum, r, i)));
        let want: Vec<u8> = (0..n).flat_map(contrib).collect();
        let outs = on_all(&ranks, |b| {
            // One byte in, so that the output's blocks start off the 16-byte boundaries.
            let mut out = vec![0u8; want.len() + 1];
            b.all_gather(
                BufRef::Host(&contrib(b.rank())),
                BufMut::Host(&mut out[1..]),
                d,
                &counts,
                &opts(),
            )
            .unwrap();
            out
        });
        for (r, o) in outs.iter().enumerate() {
            assert!(o[1..] == want[..], "all_gather ws {n}: rank {r} differs");
        }
        let mine = |r: usize| contrib(r)[..big].to_vec();
        let outs = on_all(&ranks, |b| {
            let mut out = vec![0u8; n * big];
            let o = (b.rank() == 0).then_some(BufMut::Host(&mut out));
            b.gather(BufRef::Host(&mine(b.rank())), o, d, 0, &opts())
                .unwrap();
            out
        });
        assert!(
            outs[0] == (0..n).flat_map(mine).collect::<Vec<u8>>(),
            "gather ws {n}"
        );
        check_all_to_all(&ranks, d, |s, r| big + s + 2 * r, &opts(), "8 MiB blocks");
        let by_ref: u64 = ranks.iter().map(GlooBackend::messages_by_reference).sum();
        assert_eq!(by_ref, 0, "every byte must have gone through the rings");
    }
}

/// A rank that opts out of single-copy transfers neither sends nor is sent anything by
/// reference, while the others still use it between themselves.
#[test]
fn a_rank_without_cross_memory_mixes_with_ranks_that_have_it() {
    let ranks = tcp_world_with(3, |r| {
        let mut o = gloo_opts();
        o.mesh.cross_memory = r != 1;
        // Over the rings too, however many CPUs this host has.
        o.mesh.cross_memory_over_rings = Some(true);
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
    let mut o = gloo_opts();
    o.mesh.cross_memory = false;
    let ranks = tcp_world(3, &o);
    check_all_reduce(&ranks);
    check_movement(&ranks);
    check_p2p(&ranks);
    let by_ref: u64 = ranks.iter().map(GlooBackend::messages_by_reference).sum();
    assert_eq!(by_ref, 0, "every byte must have gone through the sockets");
}

#[test]
fn world_size_1() {
    over_every_driver(1);
}

#[test]
fn world_size_2() {
    over_every_driver(2);
}

#[test]
fn world_size_3() {
    over_every_driver(3);
}

#[test]
fn world_size_4() {
    over_every_driver(4);
}

#[test]
fn world_size_5() {
    over_every_driver(5);
}

/// f16 averages whose sums pass f16's range (largest finite 65504): 4 ranks of about 30000,
/// on every driver, over messages and through the group area, at a count that takes the small
/// algorithms and one that takes the ring or the area's pieces. all_reduce, reduce and
/// reduce_scatter each come back within f16's rounding of the f64 average, where summing first
/// made `inf`; reduce_scatter leaves its input as it was (its first division is on a copy).
#[test]
fn f16_averages_whose_sums_pass_its_range_come_back_finite() {
    let n = 4;
    let d = DType::F16;
    let v = |r: usize, i: usize| 30000.0 + ((i * 7 + r * 3) % 11) as f64 * 64.0;
    let average = |i: usize| (0..n).map(|r| v(r, i)).sum::<f64>() / n as f64;
    let check = |what: &str, out: &[u8], from: usize| {
        for (j, got) in decode(d, out).into_iter().enumerate() {
            assert_close(d, what, from + j, got, average(from + j));
        }
    };
    for &(driver, make) in DRIVERS {
        for (way, o) in [("messages", gloo_opts()), ("area", through_the_area())] {
            let ranks = world(make, n, &o);
            for count in [7, 300_003] {
                let what = |op: &str| format!("{driver} {way} {op} of {count}");
                let input = |r: usize| encode(d, (0..count).map(|i| v(r, i)));
                let outs = on_all(&ranks, |b| {
                    let mut buf = input(b.rank());
                    b.all_reduce(BufMut::Host(&mut buf), d, ReduceOp::Avg, &opts())
                        .unwrap();
                    buf
                });
                for out in &outs {
                    check(&what("all_reduce"), out, 0);
                }
                let outs = on_all(&ranks, |b| {
                    let mut buf = input(b.rank());
                    b.reduce(BufMut::Host(&mut buf), d, ReduceOp::Avg, 1, &opts())
                        .unwrap();
                    buf
                });
                check(&what("reduce"), &outs[1], 0);
                let counts: Vec<usize> = (0..n)
                    .map(|r| count / n + usize::from(r < count % n))
                    .collect();
                let outs = on_all(&ranks, |b| {
                    let mine = input(b.rank());
                    let mut out = vec![0u8; counts[b.rank()] * d.size()];
                    b.reduce_scatter(
                        BufRef::Host(&mine),
                        BufMut::Host(&mut out),
                        d,
                        ReduceOp::Avg,
                        &counts,
                        &opts(),
                    )
                    .unwrap();
                    assert_eq!(
                        mine,
                        input(b.rank()),
                        "{}: input changed",
                        what("reduce_scatter")
                    );
                    out
                });
                let mut at = 0;
                for (r, out) in outs.iter().enumerate() {
                    check(&what("reduce_scatter"), out, at);
                    at += counts[r];
                }
            }
        }
    }
}

/// all_reduce in two shots through the group area, and all_gather, broadcast and all_to_all
/// through it, on 2 to 5 ranks: the suite's data checks (every type and op; the big count in
/// up to five pieces of the area, the last one short), then counts the area's exchanges: two
/// per piece of an all_reduce, one per all_gather, one per piece of a broadcast, one per
/// all_to_all (also where an input is too large for it), and none for any once the options
/// turn the area off.
#[test]
fn all_reduce_all_gather_broadcast_and_all_to_all_through_the_group_area() {
    let exchanges = |ranks: &[GlooBackend]| -> Vec<u64> {
        ranks
            .iter()
            .map(GlooBackend::shared_memory_exchanges)
            .collect()
    };
    for n in 2..=5 {
        let ranks = world(shm_rings_transports, n, &through_the_area());
        check_all_reduce(&ranks);
        check_movement(&ranks);
        // 3 MiB and 20 bytes of f32: pieces of 1 MiB, the last one 20 bytes, which 5 ranks
        // split into blocks of 4 bytes and 4 ranks into 8, 4, 4, 4.
        let count = (3 << 20) / 4 + 5;
        let (d, op) = (DType::F32, ReduceOp::Sum);
        let before = exchanges(&ranks);
        check_one_all_reduce(&ranks, d, op, count);
        let counts: Vec<usize> = (0..n).map(|r| 50_000 + r).collect();
        check_one_all_gather(&ranks, d, &counts);
        let root = n - 1;
        check_one_broadcast(&ranks, d, count, root);
        // all_to_all with uneven splits: through the area, then with rank 0's input too
        // large for it, by messages once the others have found its table without data.
        let small = |s: usize, r: usize| 3 + s + 2 * r + usize::from(s == r);
        check_all_to_all(&ranks, d, small, &opts(), "through the area");
        let large = |s: usize, r: usize| if s == 0 { 140_000 + r } else { small(s, r) };
        check_all_to_all(&ranks, d, large, &opts(), "too large for the area");
        // Every input too large: each rank announces its table and goes on by messages
        // without waiting. Twice, so that every slot of the area is written again, then
        // through the area once more, which must read this operation's tables, not those.
        let every_large = |s: usize, r: usize| 140_000 + s + r;
        check_all_to_all(&ranks, d, every_large, &opts(), "every input too large");
        check_all_to_all(
            &ranks,
            d,
            every_large,
            &opts(),
            "every input too large again",
        );
        check_all_to_all(&ranks, d, small, &opts(), "through the area after that");
        for (r, (a, b)) in exchanges(&ranks).iter().zip(before).enumerate() {
            assert_eq!(
                a - b,
                2 * 4 + 1 + 4 + 5,
                "ws {n} rank {r}: exchanges through the area"
            );
        }
        // Turned off, the same calls go over messages.
        let ranks = world(shm_rings_transports, n, &gloo_opts());
        let before = exchanges(&ranks);
        check_one_all_reduce(&ranks, d, op, count);
        check_one_all_gather(&ranks, d, &counts);
        check_one_broadcast(&ranks, d, count, root);
        check_all_to_all(&ranks, d, |s, r| 3 + s + r, &opts(), "area off");
        assert_eq!(
            exchanges(&ranks),
            before,
            "ws {n}: the area turned off was used"
        );
    }
}

/// Each rank's exchanges through the group area and messages sent by reference so far.
fn area_and_references(ranks: &[GlooBackend]) -> Vec<(u64, u64)> {
    ranks
        .iter()
        .map(|b| (b.shared_memory_exchanges(), b.messages_by_reference()))
        .collect()
}

/// all_to_all with inputs lent by reference through the group area
/// (`GlooOptions::lent_all_to_all_bytes`), on 2 to 5 ranks: every input lent, with blocks of
/// every size and some empty; one rank's input in the area and the others' lent; and one
/// rank's input under the lending threshold and over the area's limit, so that it announces
/// and every rank goes on by messages. Each checked against the reference, and the way it
/// went by the area's exchanges (two for a lent operation, one otherwise) and the messages by
/// reference (none where lent). Where this host forbids reading another process's memory, no
/// rank can lend: every call goes by messages, and only the data is checked.
#[test]
fn all_to_all_lends_large_inputs_through_the_group_area() {
    /// Elements rank s sends rank r.
    type Split = dyn Fn(usize, usize) -> usize + Sync;
    let lends = cross_memory_available();
    let d = DType::F32;
    let mut o = gloo_opts();
    o.area_all_to_all_bytes = Some(4 << 10);
    o.lent_all_to_all_bytes = Some(64 << 10);
    for n in 2..=5 {
        let ranks = world(shm_rings_transports, n, &o);
        // Blocks of 0 to about 1 MiB, every input over the lending threshold.
        let every_lent = |s: usize, r: usize| match (s + 2 * r) % 4 {
            0 => 0,
            1 => 3,
            2 => 20_000 + s,
            _ => 250_001 + r,
        };
        // Rank 0's input fits the area (6 + 4 r bytes per block); the others' are lent.
        let first_inline = |s: usize, r: usize| if s == 0 { 1 + r } else { 17_000 + s + r };
        // Rank 1's input (4.7 KiB to 12 KiB) is over the area's limit and under the
        // threshold: it announces, and the whole group goes by messages.
        let one_announces = |s: usize, r: usize| match s {
            1 => 600 + r,
            _ => 17_000 + s + r,
        };
        let cases: [(&str, &Split, bool); 3] = [
            ("every input lent", &every_lent, lends),
            ("rank 0 in the area, the others lent", &first_inline, lends),
            ("rank 1 announces", &one_announces, false),
        ];
        for (what, split, lent) in cases {
            let before = area_and_references(&ranks);
            check_all_to_all(&ranks, d, split, &opts(), what);
            for (r, (a, b)) in area_and_references(&ranks)
                .into_iter()
                .zip(before)
                .enumerate()
            {
                let exchanges = if lent { 2 } else { 1 };
                assert_eq!(a.0 - b.0, exchanges, "ws {n} {what}: rank {r}'s exchanges");
                if lent {
                    assert_eq!(
                        a.1, b.1,
                        "ws {n} {what}: rank {r} sent messages by reference"
                    );
                }
            }
        }
        // Twice more in a row, so that every slot of the area is written again.
        check_all_to_all(&ranks, d, every_lent, &opts(), "lent again");
        check_all_to_all(&ranks, d, first_inline, &opts(), "mixed again");
    }
}

/// all_to_all with lending left to rank 0's pace (`lent_all_to_all_bytes` unset) on 2 ranks
/// whose host has a CPU for each: the first four calls of 1 MiB go by messages (rank 0
/// announces, the other follows), the fifth is rank 0's look at lending, whatever the times;
/// every call's data checked. Where the ranks outnumber the CPUs or memory cannot be read
/// across, nothing is lent.
#[test]
fn rank_zero_paces_all_to_all_lending_and_looks_at_the_fifth_call() {
    let mut o = gloo_opts();
    o.area_all_to_all_bytes = Some(4 << 10);
    o.lent_all_to_all_bytes = None;
    let ranks = world(shm_rings_transports, 2, &o);
    let paced = cross_memory_available()
        && std::thread::available_parallelism().is_ok_and(|c| c.get() >= 2);
    let split = |s: usize, r: usize| (1 << 17) + 3 * s + r;
    let exchanges = |ranks: &[GlooBackend]| ranks[0].shared_memory_exchanges();
    for call in 1..=5 {
        let before = exchanges(&ranks);
        check_all_to_all(&ranks, DType::F32, split, &opts(), &format!("call {call}"));
        let want = if paced && call == 5 { 2 } else { 1 };
        assert_eq!(exchanges(&ranks) - before, want, "call {call}: exchanges");
    }
}

/// all_to_all over the area's fixed limit with rank 0 pacing the band above it
/// (`GlooOptions::paced_area_all_to_all_bytes`), on 2 to 4 ranks: rank 0 prefers the area
/// until it has looked at messages, chooses each call's way one call ahead, and learns each
/// call's time a call late (once the others' times for it are heard); its first look falls
/// due after four timed calls and lasts three, so, whatever the times, the first six calls
/// go through the area, the next three (the look) by messages with every rank, and the two
/// after them through the area again (until the look is learnt, the calls go the preferred
/// way). Every call's data checked, and the way by the messages
/// sent by reference (single copy from one byte on: none through the area, some by messages
/// where memory can be read across).
#[test]
fn rank_zero_paces_the_area_all_to_all_and_the_group_looks_together() {
    let mut o = gloo_opts();
    o.area_all_to_all_bytes = Some(4 << 10);
    o.paced_area_all_to_all_bytes = Some(usize::MAX);
    o.mesh.cross_memory_min_bytes = Some(1);
    let by_reference = cross_memory_available();
    let references = |ranks: &[GlooBackend]| -> u64 {
        ranks.iter().map(GlooBackend::messages_by_reference).sum()
    };
    for n in 2..=4 {
        let ranks = world(shm_transports, n, &o);
        let split = |s: usize, r: usize| 5_000 + 3 * s + r;
        for call in 1..=11 {
            let before = references(&ranks);
            let what = format!("ws {n} call {call}");
            check_all_to_all(&ranks, DType::F32, split, &opts(), &what);
            let sent = references(&ranks) - before;
            if !(7..=9).contains(&call) {
                assert_eq!(sent, 0, "{what}: through the area, yet sent by reference");
            } else if by_reference {
                assert!(sent > 0, "{what}: rank 0's look went through the area");
            }
        }
    }
}

/// all_gather with every rank's input lent by reference through the group area
/// (`GlooOptions::lent_all_gather_bytes`), on 2 to 5 ranks: blocks of uneven sizes, some
/// empty, then again so that every slot of the area is written again; each checked against
/// the reference, and the way it went by the area's exchanges (two per call) and the messages
/// by reference (none). Under the threshold, by messages and no exchange. Where this host
/// forbids reading another process's memory, every rank announces and the calls go by
/// messages (one exchange each): only the data is checked for the way.
#[test]
fn all_gather_lends_inputs_through_the_group_area() {
    let lends = cross_memory_available();
    let d = DType::F32;
    let mut o = gloo_opts();
    o.lent_all_gather_bytes = Some(256 << 10);
    for n in 2..=5 {
        let ranks = world(shm_rings_transports, n, &o);
        let uneven: Vec<usize> = (0..n)
            .map(|r| if r == 1 { 0 } else { 70_001 + 13 * r })
            .collect();
        let small: Vec<usize> = (0..n).map(|r| 2_000 + r).collect();
        for (what, counts, exchanges) in [
            ("lent", &uneven, if lends { 2 } else { 1 }),
            ("lent again", &uneven, if lends { 2 } else { 1 }),
            ("under the threshold", &small, 0),
        ] {
            let before = area_and_references(&ranks);
            check_one_all_gather(&ranks, d, counts);
            for (r, (a, b)) in area_and_references(&ranks)
                .into_iter()
                .zip(before)
                .enumerate()
            {
                assert_eq!(a.0 - b.0, exchanges, "ws {n} {what}: rank {r}'s exchanges");
                if lends && exchanges == 2 {
                    assert_eq!(
                        a.1, b.1,
                        "ws {n} {what}: rank {r} sent messages by reference"
                    );
                }
            }
        }
    }
}

/// all_gather with lending left to rank 0's pace on 2 ranks whose host has a CPU for each:
/// the first four calls of 1 MiB go by messages after one exchange (rank 0 announces, the
/// other follows), the fifth is rank 0's look at lending (two), whatever the times.
#[test]
fn rank_zero_paces_all_gather_lending_and_looks_at_the_fifth_call() {
    let mut o = gloo_opts();
    o.lent_all_gather_bytes = None;
    let ranks = world(shm_rings_transports, 2, &o);
    let paced = cross_memory_available()
        && std::thread::available_parallelism().is_ok_and(|c| c.get() >= 2);
    let counts = [1 << 17, (1 << 17) + 5];
    fifth_call_looks(&ranks, paced, 2, || {
        check_one_all_gather(&ranks, DType::F32, &counts);
    });
}

/// all_reduce by reference through the group area (`GlooOptions::lent_all_reduce_bytes`), on 2
/// to 5 ranks: every type of each width and kind with the ops whose kernels differ most, at a
/// count that no rank count divides and over several of the pieces each rank reduces at a
/// time, every rank bitwise alike and close to the reference; three exchanges per call where
/// lent (one where memory cannot be read across: then by messages), none under the threshold.
#[test]
fn all_reduce_by_reference_through_the_group_area() {
    let lends = cross_memory_available();
    let mut o = gloo_opts();
    o.lent_all_reduce_bytes = Some(64 << 10);
    let count = (1 << 20) / 4 + 7;
    for n in 2..=5 {
        let ranks = world(shm_rings_transports, n, &o);
        for d in [DType::U8, DType::BF16, DType::F32, DType::I64] {
            for op in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max] {
                if op.check(d).is_err() {
                    continue;
                }
                let len = count / d.size() * 4;
                let before = area_and_references(&ranks);
                check_one_all_reduce(&ranks, d, op, len);
                // 8 KiB: over the area's one shot, under the threshold: by messages.
                check_one_all_reduce(&ranks, d, op, 8192 / d.size());
                for (r, (a, b)) in area_and_references(&ranks)
                    .into_iter()
                    .zip(before)
                    .enumerate()
                {
                    let want = if lends { 3 } else { 1 };
                    assert_eq!(a.0 - b.0, want, "ws {n} {d} {op}: rank {r}'s exchanges");
                    if lends {
                        assert_eq!(a.1, b.1, "ws {n} {d} {op}: rank {r} sent by reference");
                    }
                }
            }
        }
    }
}

/// all_reduce with lending left to rank 0's pace on 2 ranks whose host has a CPU for each:
/// the first four calls of 4 MiB go by messages after one exchange, the fifth is rank 0's look
/// at lending (three), whatever the times.
#[test]
fn rank_zero_paces_all_reduce_lending_and_looks_at_the_fifth_call() {
    let mut o = gloo_opts();
    o.lent_all_reduce_bytes = None;
    let ranks = world(shm_rings_transports, 2, &o);
    let paced = cross_memory_available()
        && std::thread::available_parallelism().is_ok_and(|c| c.get() >= 2);
    fifth_call_looks(&ranks, paced, 3, || {
        check_one_all_reduce(&ranks, DType::F32, ReduceOp::Sum, 1 << 20);
    });
}

/// Makes five calls with `call` (each checks its data) on 2 ranks whose rank 0 paces lending:
/// rank 1's exchanges through the area are one per call (rank 0's announcement) where `paced`,
/// then `lent` on the fifth, rank 0's first look; none where not paced.
fn fifth_call_looks(ranks: &[GlooBackend], paced: bool, lent: u64, call: impl Fn()) {
    for n in 1..=5 {
        let before = ranks[1].shared_memory_exchanges();
        call();
        let want = if paced && n == 5 {
            lent
        } else {
            u64::from(paced)
        };
        assert_eq!(
            ranks[1].shared_memory_exchanges() - before,
            want,
            "call {n}: exchanges"
        );
    }
}

/// `probe` answers without blocking: false until the tagged message starts to arrive, true once
/// it has (before the `recv`), and true for a peer that is gone (its `recv` would fail at once).
#[test]
fn probe_sees_a_tagged_message_before_its_recv_and_a_departed_peer() {
    for &(_, make) in DRIVERS {
        let ranks = world(make, 2, &gloo_opts());
        let tagged = |tag| OpOptions { tag, ..opts() };
        let (a, b) = (&ranks[0], &ranks[1]);
        assert!(!b.probe(0, 7).unwrap(), "nothing sent yet");
        a.send(BufRef::Host(&[1, 2, 3, 4]), DType::U8, 1, &tagged(7))
            .unwrap();
        let t0 = Instant::now();
        while !b.probe(0, 7).unwrap() {
            assert!(t0.elapsed() < Duration::from_secs(10), "never seen");
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
        let t0 = Instant::now();
        while !ranks[0].probe(0, 9).unwrap() {
            assert!(
                t0.elapsed() < Duration::from_secs(10),
                "departure never seen"
            );
            std::thread::yield_now();
        }
    }
}

fn quick(timeout: Duration) -> OpOptions {
    OpOptions::with_timeout(timeout)
}

/// Two ranks that pass different counts both fail at once, each naming both counts.
#[test]
fn a_count_mismatch_names_both_counts_on_both_sides() {
    for &(driver, make) in DRIVERS {
        let ranks = world(make, 2, &gloo_opts());
        let errs = on_all(&ranks, |b| {
            let mut v = vec![0u8; if b.rank() == 0 { 40 } else { 44 }];
            b.all_reduce(
                BufMut::Host(&mut v),
                DType::I32,
                ReduceOp::Max,
                &quick(Duration::from_secs(30)),
            )
            .unwrap_err()
            .to_string()
        });
        assert_eq!(
            errs[0],
            "rank 0 all_reduce #0 (i32 × 10, MAX) met rank 1 all_reduce #0 (i32 × 11, MAX)",
            "{driver}"
        );
        assert_eq!(
            errs[1],
            "rank 1 all_reduce #0 (i32 × 11, MAX) met rank 0 all_reduce #0 (i32 × 10, MAX)",
            "{driver}"
        );
    }
}

/// A rank that never joins an operation: the others time out within their timeout plus a
/// second, naming ranks they waited for, and the stalled rank among them.
#[test]
fn a_stalled_rank_is_a_timeout_naming_it_on_every_other_rank() {
    for &(driver, make) in DRIVERS {
        let n = 3;
        let ranks = world(make, n, &gloo_opts());
        let timeout = Duration::from_secs(1);
        let released = Barrier::new(n);
        let out = on_all(&ranks, |b| {
            let mut v = vec![1u8; 4096];
            if b.rank() == 2 {
                released.wait();
                return None;
            }
            let t0 = Instant::now();
            let e = b
                .all_reduce(
                    BufMut::Host(&mut v),
                    DType::U8,
                    ReduceOp::Sum,
                    &quick(timeout),
                )
                .unwrap_err();
            let took = t0.elapsed();
            released.wait();
            Some((e, took))
        });
        assert_timeouts_name_the_stalled_rank(driver, CollectiveOp::AllReduce, out, 2, timeout);
    }
}

/// `out` holds, for every rank but `stalled`, the error of `op` and how long it took: each is
/// a timeout within `timeout` plus a second naming ranks it waited for, not itself, and some
/// rank names `stalled`. Which deadline fires first is a race; the rank waiting for the
/// stalled one names it (itself, or told by a peer that gave up on it).
fn assert_timeouts_name_the_stalled_rank(
    driver: &str,
    op: CollectiveOp,
    out: Vec<Option<(Error, Duration)>>,
    stalled: usize,
    timeout: Duration,
) {
    let mut named = false;
    for (r, o) in out.into_iter().enumerate().filter(|(r, _)| *r != stalled) {
        let (e, took) = o.expect("the other ranks fail");
        assert!(
            took < timeout + Duration::from_secs(1),
            "{driver} rank {r} took {took:?}"
        );
        match &e {
            Error::Timeout {
                rank,
                op: failed,
                missing_peers,
                ..
            } => {
                assert_eq!((*rank, *failed), (r, op), "{driver}: {e}");
                assert!(
                    !missing_peers.is_empty() && !missing_peers.contains(&r),
                    "{driver} rank {r}: {e}"
                );
                named |= missing_peers.contains(&stalled);
            }
            other => panic!("{driver} rank {r}: expected a timeout, got {other}"),
        }
    }
    assert!(named, "{driver}: no rank named the stalled rank {stalled}");
}

/// A rank whose process dies (here: its transport aborted and dropped, which closes its
/// connections without a goodbye) makes every survivor fail with `PeerLost` naming it.
#[test]
fn a_crashed_rank_is_peer_lost_naming_it_on_every_survivor() {
    for &(driver, make) in DRIVERS {
        let n = 4;
        let errs = while_the_last_rank_dies(make, n, |b| {
            let mut v = vec![1u8; 1 << 20];
            b.all_reduce(
                BufMut::Host(&mut v),
                DType::U8,
                ReduceOp::Sum,
                &quick(Duration::from_secs(30)),
            )
            .unwrap_err()
        });
        assert_peer_lost_on_every_survivor(driver, &errs, n - 1);
    }
}

/// A barrier lets no rank out before every rank is in: each round a different rank comes
/// last (after a pause longer than a waiting rank spins, so the others go to sleep and must
/// be woken), and every rank, on leaving, counts the ranks that entered that round. Where no
/// group area holds the barrier, 2 ranks run one pairwise round, 3 to 8 a star, 9
/// dissemination rounds and 16 pairwise ones.
#[test]
fn a_barrier_lets_no_rank_out_before_the_last_one_enters() {
    for &(driver, make) in DRIVERS {
        for n in [2, 3, 4, 8, 9, 16] {
            let ranks = world(make, n, &gloo_opts());
            let entered: Vec<AtomicUsize> = (0..3 * n).map(|_| AtomicUsize::new(0)).collect();
            on_all(&ranks, |b| {
                for (round, count) in entered.iter().enumerate() {
                    if b.rank() == round % n {
                        std::thread::sleep(Duration::from_millis(2));
                    }
                    count.fetch_add(1, Ordering::SeqCst);
                    b.barrier(&opts()).unwrap();
                    assert_eq!(
                        count.load(Ordering::SeqCst),
                        n,
                        "{driver}, {n} ranks, round {round}: rank {} left early",
                        b.rank()
                    );
                }
            });
        }
    }
}

/// A rank that never comes to a barrier: the others time out within their timeout plus a
/// second, each naming ranks it waited for, and the stalled rank among them.
#[test]
fn a_rank_that_never_comes_to_a_barrier_is_a_timeout_naming_it() {
    for &(driver, make) in DRIVERS {
        let n = 4;
        let ranks = world(make, n, &gloo_opts());
        let timeout = Duration::from_secs(1);
        let released = Barrier::new(n);
        let out = on_all(&ranks, |b| {
            if b.rank() == 2 {
                released.wait();
                return None;
            }
            let t0 = Instant::now();
            let e = b.barrier(&quick(timeout)).unwrap_err();
            let took = t0.elapsed();
            released.wait();
            Some((e, took))
        });
        assert_timeouts_name_the_stalled_rank(driver, CollectiveOp::Barrier, out, 2, timeout);
    }
}

/// A rank that dies while the others wait in a barrier: every survivor fails with `PeerLost`
/// naming it, long before its timeout.
#[test]
fn a_rank_that_dies_during_a_barrier_is_peer_lost_naming_it_on_every_survivor() {
    for &(driver, make) in DRIVERS {
        let n = 4;
        let errs = while_the_last_rank_dies(make, n, |b| b.barrier(&opts()).unwrap_err());
        assert_peer_lost_on_every_survivor(driver, &errs, n - 1);
    }
}

/// Runs `f` on the first `n - 1` of `n` ranks while the last one dies (its transport aborted
/// and dropped, which closes its connections without a goodbye); returns their results.
fn while_the_last_rank_dies<R: Send>(
    make: MakeTransports,
    n: usize,
    f: impl Fn(&GlooBackend) -> R + Sync,
) -> Vec<R> {
    let mut ts = make(n, &gloo_opts());
    let dead = ts.pop().expect("a rank");
    let ranks: Vec<GlooBackend> = ts
        .into_iter()
        .map(|t| GlooBackend::over(t, 0, &gloo_opts()))
        .collect();
    std::thread::scope(|s| {
        let h = s.spawn(|| on_all(&ranks, &f));
        dead.abort();
        drop(dead);
        h.join().expect("survivors")
    })
}

/// Every survivor's error in `errs` (indexed by rank) is `PeerLost` naming `dead`.
fn assert_peer_lost_on_every_survivor(driver: &str, errs: &[Error], dead: usize) {
    for (r, e) in errs.iter().enumerate() {
        match e {
            Error::PeerLost { rank, peer, .. } => {
                assert_eq!((*rank, *peer), (r, dead), "{driver}: {e}");
            }
            other => panic!("{driver} rank {r}: expected PeerLost naming rank {dead}, got {other}"),
        }
    }
}

/// A rank that leaves cleanly is no failure for peers that do not need it (they may exchange
/// among themselves), and an operation that needs it fails naming it as gone.
#[test]
fn a_rank_that_leaves_is_seen_by_every_peer_and_fails_only_what_needs_it() {
    for &(driver, make) in DRIVERS {
        let ranks = world(make, 3, &gloo_opts());
        let left = Barrier::new(3);
        let out = on_all(&ranks, |b| {
            if b.rank() == 2 {
                Backend::close(b);
                left.wait();
                return None;
            }
            left.wait();
            let o = quick(Duration::from_secs(30));
            let mut v = [b.rank() as u8; 8];
            let peer = 1 - b.rank();
            let ok = |r: dist_backend::Result<()>| r.unwrap_or_else(|e| panic!("{driver}: {e}"));
            if b.rank() == 0 {
                ok(b.send(BufRef::Host(&v), DType::U8, peer, &o));
                ok(b.recv(BufMut::Host(&mut v), DType::U8, peer, &o));
            } else {
                ok(b.recv(BufMut::Host(&mut v), DType::U8, peer, &o));
                assert_eq!(v, [0; 8], "{driver}");
                ok(b.send(BufRef::Host(&v), DType::U8, peer, &o));
            }
            Some(b.barrier(&o).unwrap_err())
        });
        for (r, e) in out.into_iter().enumerate().take(2) {
            let e = e.expect("ranks 0 and 1 ran the barrier");
            match &e {
                Error::PeerLost {
                    rank, peer, reason, ..
                } => {
                    assert_eq!((*rank, *peer), (r, 2), "{driver}: {e}");
                    assert!(reason.contains("left the group"), "{driver}: {e}");
                }
                other => panic!("{driver} rank {r}: expected PeerLost naming rank 2, got {other}"),
            }
        }
    }
}

/// Sends are bounded: a large message to a rank that does not receive it cannot complete, and
/// the sender times out naming that rank (no transport buffers it whole).
#[test]
fn a_large_send_nobody_receives_times_out_naming_the_receiver() {
    for &(driver, make) in DRIVERS {
        let ranks = world(make, 2, &gloo_opts());
        let done = Barrier::new(2);
        let out = on_all(&ranks, |b| {
            if b.rank() == 1 {
                done.wait();
                return None;
            }
            let big = vec![7u8; 64 << 20];
            let e = b
                .send(
                    BufRef::Host(&big),
                    DType::U8,
                    1,
                    &quick(Duration::from_secs(1)),
                )
                .unwrap_err();
            done.wait();
            Some(e)
        });
        match out[0].as_ref().expect("rank 0 sent") {
            Error::Timeout {
                rank: 0,
                missing_peers,
                ..
            } => assert_eq!(missing_peers, &[1], "{driver}"),
            other => panic!("{driver}: expected a timeout naming rank 1, got {other}"),
        }
    }
}
