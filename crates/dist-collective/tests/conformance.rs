//! The conformance suite through the typed API, over real loopback TCP: every collective ×
//! world sizes 1..=5 × counts {0, 1, 7} × every dtype (and every valid reduce op), every root,
//! uneven and split forms, the `*_async` forms, send/recv, plus a large uneven count for a
//! subset, two overlapping sub-groups used at once from the same ranks, and device-mesh
//! dimensions. Each result is checked against an independent computation (`common`).
//!
//! Every rank issues the same collectives whatever it finds, and mismatches are collected, not
//! panicked on, so a wrong result fails the test instead of hanging the other ranks. One world
//! per world size keeps the mesh set-up cost off the per-case budget.

mod common;

use common::{Fails, Val, input, reference, tolerance};
use dist_collective::testing::run_world;
use dist_collective::{DeviceMesh, P2pOp, ProcessGroup, ReduceOp, Result};
use dist_wire::{bf16, f16};

const SMALL: [usize; 3] = [0, 1, 7];

/// Large, odd and not a multiple of any world size: crosses many frames and leaves ragged
/// blocks in the ring algorithms.
const BIG: usize = (1 << 20) + 3;

fn zeros<T: Val>(len: usize) -> Vec<T> {
    vec![T::from_f64(0.0); len]
}

/// Data rank `r` of a group holds in movement tests; `salt` tells groups apart.
fn mine<T: Val>(salt: usize, r: usize, len: usize) -> Vec<T> {
    input(ReduceOp::Sum, salt + r, len)
}

/// Every reduction of `T` on `pg`. Rank `r` contributes `input(op, salt + r, ..)`.
fn reductions<T: Val>(pg: &ProcessGroup, salt: usize, f: &mut Fails) -> Result<()> {
    let (n, r, d) = (pg.world_size(), pg.rank(), T::DTYPE);
    let me = salt + r;
    for op in ReduceOp::ALL.into_iter().filter(|op| op.check(d).is_ok()) {
        let tol = tolerance(d, op);
        let want = |i: usize| reference(d, op, salt, n, i);
        for count in SMALL {
            let what = |name: &str| {
                format!(
                    "{} ws {n} rank {r} {d} {op} count {count}: {name}",
                    pg.name()
                )
            };
            let mut buf = input::<T>(op, me, count);
            pg.all_reduce(&mut buf, op)?;
            f.close(&what("all_reduce"), &buf, count, want, tol);
            let buf = pg.all_reduce_async(input::<T>(op, me, count), op)?.wait()?;
            f.close(&what("all_reduce_async"), &buf, count, want, tol);
            for root in 0..n {
                let mut buf = input::<T>(op, me, count);
                pg.reduce(&mut buf, op, root)?;
                if r == root {
                    f.close(&what("reduce"), &buf, count, want, tol);
                }
            }
            let buf = pg
                .reduce_async(input::<T>(op, me, count), op, n - 1)?
                .wait()?;
            if r == n - 1 {
                f.close(&what("reduce_async"), &buf, count, want, tol);
            }
            let share = |j: usize| reference(d, op, salt, n, r * count + j);
            let mut out = zeros::<T>(count);
            pg.reduce_scatter_into(&input::<T>(op, me, count * n), &mut out, op)?;
            f.close(&what("reduce_scatter"), &out, count, share, tol);
            let out = pg
                .reduce_scatter_async(input::<T>(op, me, count * n), op)?
                .wait()?;
            f.close(&what("reduce_scatter_async"), &out, count, share, tol);
            // Uneven: rank q's share is count + q % 2 elements.
            let counts: Vec<usize> = (0..n).map(|q| count + q % 2).collect();
            let at: usize = counts[..r].iter().sum();
            let mut out = zeros::<T>(counts[r]);
            let full = input::<T>(op, me, counts.iter().sum());
            pg.reduce_scatter_into_uneven(&full, &mut out, &counts, op)?;
            let uneven = |j: usize| reference(d, op, salt, n, at + j);
            f.close(&what("reduce_scatter uneven"), &out, counts[r], uneven, tol);
        }
    }
    Ok(())
}

/// Every data-movement collective of `T` on `pg`.
fn movement<T: Val>(pg: &ProcessGroup, salt: usize, f: &mut Fails) -> Result<()> {
    let (n, r, d) = (pg.world_size(), pg.rank(), T::DTYPE);
    for count in SMALL {
        let what = |name: &str| format!("{} ws {n} rank {r} {d} count {count}: {name}", pg.name());
        for root in 0..n {
            let mut buf = if r == root {
                mine::<T>(salt, root, count)
            } else {
                zeros(count)
            };
            pg.broadcast(&mut buf, root)?;
            f.same(&what("broadcast"), &buf, &mine(salt, root, count));
        }
        let start = if r == 0 {
            mine::<T>(salt, 0, count)
        } else {
            zeros(count)
        };
        let buf = pg.broadcast_async(start, 0)?.wait()?;
        f.same(&what("broadcast_async"), &buf, &mine(salt, 0, count));

        let all: Vec<T> = (0..n).flat_map(|q| mine(salt, q, count)).collect();
        let mut out = zeros::<T>(count * n);
        pg.all_gather_into(&mine::<T>(salt, r, count), &mut out)?;
        f.same(&what("all_gather_into"), &out, &all);
        let lists = pg.all_gather(&mine::<T>(salt, r, count))?;
        f.same(&what("all_gather list"), &lists.concat(), &all);
        if lists.len() != n {
            f.same(
                &what("all_gather list count"),
                &[lists.len() as u32],
                &[n as u32],
            );
        }
        let out = pg.all_gather_async(mine::<T>(salt, r, count))?.wait()?;
        f.same(&what("all_gather_async"), &out, &all);
        // Uneven: rank q contributes count + q elements.
        let counts: Vec<usize> = (0..n).map(|q| count + q).collect();
        let uneven: Vec<T> = (0..n).flat_map(|q| mine(salt, q, counts[q])).collect();
        let mut out = zeros::<T>(uneven.len());
        pg.all_gather_into_uneven(&mine::<T>(salt, r, counts[r]), &mut out, &counts)?;
        f.same(&what("all_gather uneven"), &out, &uneven);
        let lists = pg.all_gather_uneven(&mine::<T>(salt, r, counts[r]))?;
        f.same(&what("all_gather_uneven"), &lists.concat(), &uneven);
        let lens: Vec<u32> = lists.iter().map(|l| l.len() as u32).collect();
        let want_lens: Vec<u32> = counts.iter().map(|&c| c as u32).collect();
        f.same(&what("all_gather_uneven lengths"), &lens, &want_lens);

        for root in 0..n {
            let mut out = zeros::<T>(count * n);
            pg.gather(
                &mine::<T>(salt, r, count),
                (r == root).then_some(&mut out[..]),
                root,
            )?;
            if r == root {
                f.same(&what("gather"), &out, &all);
            }
            let src = mine::<T>(salt + 100, root, count * n);
            let mut out = zeros::<T>(count);
            pg.scatter((r == root).then_some(&src[..]), &mut out, root)?;
            f.same(&what("scatter"), &out, &src[r * count..(r + 1) * count]);
        }

        // Rank s's block for rank q; its length is given by each form.
        let block = |s: usize, q: usize, len: usize| mine::<T>(salt + 1000 * (s + 1), q, len);
        let inp: Vec<T> = (0..n).flat_map(|q| block(r, q, count)).collect();
        let mut out = zeros::<T>(count * n);
        pg.all_to_all_single(&mut out, &inp, None, None)?;
        let want: Vec<T> = (0..n).flat_map(|s| block(s, r, count)).collect();
        f.same(&what("all_to_all_single"), &out, &want);
        let split = |s: usize, q: usize| count + s + 2 * q;
        let send: Vec<usize> = (0..n).map(|q| split(r, q)).collect();
        let recv: Vec<usize> = (0..n).map(|s| split(s, r)).collect();
        let inp: Vec<T> = (0..n).flat_map(|q| block(r, q, split(r, q))).collect();
        let mut out = zeros::<T>(recv.iter().sum());
        pg.all_to_all_single(&mut out, &inp, Some(&recv), Some(&send))?;
        let want: Vec<T> = (0..n).flat_map(|s| block(s, r, split(s, r))).collect();
        f.same(&what("all_to_all_single with splits"), &out, &want);
        let len = |s: usize, q: usize| count + (s + 2 * q) % 3;
        let lists: Vec<Vec<T>> = (0..n).map(|q| block(r, q, len(r, q))).collect();
        let got = pg.all_to_all(&lists)?;
        let want: Vec<T> = (0..n).flat_map(|s| block(s, r, len(s, r))).collect();
        f.same(&what("all_to_all list"), &got.concat(), &want);
    }
    Ok(())
}

/// Tagged sends to the right neighbour received out of order, a blocking pair, and a batch to
/// and from every other rank.
fn point_to_point<T: Val>(pg: &ProcessGroup, f: &mut Fails) -> Result<()> {
    let (n, r, d) = (pg.world_size(), pg.rank(), T::DTYPE);
    if n < 2 {
        return Ok(());
    }
    let what = |name: &str| format!("{} ws {n} rank {r} {d}: {name}", pg.name());
    let (right, left) = ((r + 1) % n, (r + n - 1) % n);
    let long = pg.isend(mine::<T>(0, r, 1000), right, 7)?;
    let short = pg.isend(mine::<T>(50, r, 3), right, 9)?;
    // Tags, not arrival order, decide which receive gets which message.
    let mut got_short = zeros::<T>(3);
    pg.recv(&mut got_short, left, 9)?;
    let got_long = pg.irecv(zeros::<T>(1000), left, 7)?.wait()?;
    f.same(&what("isend/recv by tag"), &got_short, &mine(50, left, 3));
    f.same(&what("isend/irecv by tag"), &got_long, &mine(0, left, 1000));
    f.same(
        &what("isend gives its buffer back"),
        &long.wait()?,
        &mine(0, r, 1000),
    );
    short.wait()?;
    if r == 0 {
        pg.send(&mine::<T>(7, 0, 11), n - 1, 1)?;
    } else if r == n - 1 {
        let mut got = zeros::<T>(11);
        pg.recv(&mut got, 0, 1)?;
        f.same(&what("send/recv"), &got, &mine(7, 0, 11));
    }
    let len = |s: usize, q: usize| s + 2 * q + 1;
    let mut ops = Vec::new();
    for q in (0..n).filter(|&q| q != r) {
        ops.push(P2pOp::irecv(zeros::<T>(len(q, r)), q, 3));
        ops.push(P2pOp::isend(mine::<T>(100 * r, q, len(r, q)), q, 3));
    }
    let works = pg.batch_isend_irecv(ops)?;
    // One Work per op, in order: the receive from the k-th peer is result 2k.
    let mut results = Vec::new();
    for w in works {
        results.push(w.wait()?);
    }
    for (k, q) in (0..n).filter(|&q| q != r).enumerate() {
        f.same(
            &what(&format!("batch_isend_irecv from {q}")),
            &results[2 * k],
            &mine(100 * q, r, len(q, r)),
        );
    }
    Ok(())
}

fn typed<T: Val>(pg: &ProcessGroup, salt: usize, f: &mut Fails) -> Result<()> {
    reductions::<T>(pg, salt, f)?;
    movement::<T>(pg, salt, f)?;
    point_to_point::<T>(pg, f)
}

fn every_dtype(pg: &ProcessGroup, salt: usize, f: &mut Fails) -> Result<()> {
    typed::<i8>(pg, salt, f)?;
    typed::<u8>(pg, salt, f)?;
    typed::<i16>(pg, salt, f)?;
    typed::<i32>(pg, salt, f)?;
    typed::<u32>(pg, salt, f)?;
    typed::<i64>(pg, salt, f)?;
    typed::<u64>(pg, salt, f)?;
    typed::<f16>(pg, salt, f)?;
    typed::<bf16>(pg, salt, f)?;
    typed::<f32>(pg, salt, f)?;
    typed::<f64>(pg, salt, f)
}

/// The large uneven count, for one type of each kind and width class and the ops whose kernels
/// differ most; the backend-level suite covers the rest at this size.
fn big(pg: &ProcessGroup, f: &mut Fails) -> Result<()> {
    let (n, r) = (pg.world_size(), pg.rank());
    let what = |name: &str| format!("ws {n} rank {r} count {BIG}: {name}");
    fn all_reduce_big<T: Val>(pg: &ProcessGroup, op: ReduceOp, f: &mut Fails) -> Result<()> {
        let (n, r, d) = (pg.world_size(), pg.rank(), T::DTYPE);
        let mut buf = input::<T>(op, r, BIG);
        pg.all_reduce(&mut buf, op)?;
        let want = |i: usize| reference(d, op, 0, n, i);
        let what = format!("ws {n} rank {r} {d} {op} count {BIG}: all_reduce");
        f.close(&what, &buf, BIG, want, tolerance(d, op));
        Ok(())
    }
    all_reduce_big::<f32>(pg, ReduceOp::Sum, f)?;
    all_reduce_big::<bf16>(pg, ReduceOp::Avg, f)?;
    all_reduce_big::<u8>(pg, ReduceOp::Sum, f)?;
    all_reduce_big::<i64>(pg, ReduceOp::Max, f)?;
    let buf = pg
        .all_reduce_async(input::<f64>(ReduceOp::Sum, r, BIG), ReduceOp::Sum)?
        .wait()?;
    let want = |i: usize| reference(dist_collective::DType::F64, ReduceOp::Sum, 0, n, i);
    f.close(&what("all_reduce_async f64"), &buf, BIG, want, 0.0);

    // Uneven reduce-scatter and all-gather: rank q's share is BIG / n + q.
    let counts: Vec<usize> = (0..n).map(|q| BIG / n + q).collect();
    let at: usize = counts[..r].iter().sum();
    let full = input::<f32>(ReduceOp::Sum, r, counts.iter().sum());
    let mut out = zeros::<f32>(counts[r]);
    pg.reduce_scatter_into_uneven(&full, &mut out, &counts, ReduceOp::Sum)?;
    let want = |j: usize| reference(dist_collective::DType::F32, ReduceOp::Sum, 0, n, at + j);
    f.close(
        &what("reduce_scatter uneven f32"),
        &out,
        counts[r],
        want,
        0.0,
    );
    let uneven: Vec<u8> = (0..n).flat_map(|q| mine(0, q, counts[q])).collect();
    let mut out = zeros::<u8>(uneven.len());
    pg.all_gather_into_uneven(&mine::<u8>(0, r, counts[r]), &mut out, &counts)?;
    f.same(&what("all_gather uneven u8"), &out, &uneven);

    let root = n - 1;
    let mut buf = if r == root {
        mine::<f32>(0, root, BIG)
    } else {
        zeros(BIG)
    };
    pg.broadcast(&mut buf, root)?;
    f.same(&what("broadcast f32"), &buf, &mine(0, root, BIG));

    let split = |s: usize, q: usize| BIG / (n * n) + s + 2 * q;
    let block = |s: usize, q: usize| mine::<u8>(1000 * (s + 1), q, split(s, q));
    let send: Vec<usize> = (0..n).map(|q| split(r, q)).collect();
    let recv: Vec<usize> = (0..n).map(|s| split(s, r)).collect();
    let inp: Vec<u8> = (0..n).flat_map(|q| block(r, q)).collect();
    let mut out = zeros::<u8>(recv.iter().sum());
    pg.all_to_all_single(&mut out, &inp, Some(&recv), Some(&send))?;
    let want: Vec<u8> = (0..n).flat_map(|s| block(s, r)).collect();
    f.same(&what("all_to_all_single with splits u8"), &out, &want);
    Ok(())
}

/// Two overlapping sub-groups (all ranks but the last, all but the first) driven at the same
/// time from two threads of every rank, with different data, blocking and async forms mixed.
fn overlapping_subgroups(pg: &ProcessGroup, f: &mut Fails) -> Result<()> {
    let n = pg.world_size();
    if n < 3 {
        return Ok(());
    }
    let a = pg.new_group(&(0..n - 1).collect::<Vec<_>>())?;
    let b = pg.new_group(&(1..n).collect::<Vec<_>>())?;
    let run = |g: &Option<ProcessGroup>, salt: usize, float: bool| -> Result<Fails> {
        let mut f = Fails::default();
        if let Some(g) = g {
            if float {
                reductions::<f32>(g, salt, &mut f)?;
                movement::<bf16>(g, salt, &mut f)?;
            } else {
                reductions::<i32>(g, salt, &mut f)?;
                movement::<u64>(g, salt, &mut f)?;
            }
        }
        Ok(f)
    };
    let (fa, fb) = std::thread::scope(|s| {
        let ha = s.spawn(|| run(&a, 10, true));
        let hb = s.spawn(|| run(&b, 20, false));
        (ha.join(), hb.join())
    });
    for sub in [fa, fb] {
        let sub = sub.unwrap_or_else(|p| std::panic::resume_unwind(p))?;
        f.count += sub.count;
        f.kept.extend(sub.kept);
    }
    Ok(())
}

/// A device mesh over the world (2 × 2 at four ranks, a size-1 dimension at odd sizes): each
/// dimension's group holds the ranks a row-major layout puts there, and reduces correctly.
fn mesh(pg: &ProcessGroup, f: &mut Fails) -> Result<()> {
    let n = pg.world_size();
    let shape = match n {
        4 => [2, 2],
        _ if n.is_multiple_of(2) => [2, n / 2],
        _ => [1, n],
    };
    let mesh = DeviceMesh::new(pg, &[("dp", shape[0]), ("tp", shape[1])])?;
    let coord = [pg.rank() / shape[1], pg.rank() % shape[1]];
    for (d, name) in ["dp", "tp"].into_iter().enumerate() {
        let g = mesh.dim(name);
        let want: Vec<u32> = (0..shape[d])
            .map(|k| {
                let mut c = coord;
                c[d] = k;
                (c[0] * shape[1] + c[1]) as u32
            })
            .collect();
        let got: Vec<u32> = g.global_ranks().iter().map(|&x| x as u32).collect();
        let what = format!("ws {n} rank {} mesh dim {name}", pg.rank());
        f.same(&format!("{what}: global ranks"), &got, &want);
        f.same(
            &format!("{what}: coordinate"),
            &[mesh.coordinate()[d] as u32],
            &[coord[d] as u32],
        );
        // The salt names the group (its first global rank), so groups of one dimension differ.
        reductions::<f32>(g, 100 * (d + 1) + g.global_ranks()[0], f)?;
    }
    Ok(())
}

fn suite(n: usize) {
    let fails = run_world(n, |pg| {
        let mut f = Fails::default();
        every_dtype(&pg, 0, &mut f)?;
        big(&pg, &mut f)?;
        pg.barrier()?;
        pg.barrier_async()?.wait()?;
        overlapping_subgroups(&pg, &mut f)?;
        mesh(&pg, &mut f)?;
        Ok(f)
    })
    .unwrap_or_else(|e| panic!("world size {n}: {e}"));
    let total: usize = fails.iter().map(|f| f.count).sum();
    let first: Vec<&String> = fails.iter().flat_map(|f| &f.kept).take(20).collect();
    assert_eq!(total, 0, "world size {n}: {total} mismatches: {first:#?}");
}

#[test]
fn world_size_1() {
    suite(1);
}

#[test]
fn world_size_2() {
    suite(2);
}

#[test]
fn world_size_3() {
    suite(3);
}

#[test]
fn world_size_4() {
    suite(4);
}

#[test]
fn world_size_5() {
    suite(5);
}
