//! Typed collectives over real loopback TCP, world sizes 1..=4, several dtypes, empty and
//! uneven buffers, each result checked against an independent computation.

use dist_collective::testing::run_world;
use dist_collective::{Element, Error, ReduceOp};
use dist_wire::bf16;

/// Rank r's input for element i: small integers, exact in every dtype.
fn val(r: usize, i: usize) -> i64 {
    ((r * 7 + i * 3) % 11) as i64 - 3
}

trait FromI64: Element {
    fn from_i64(v: i64) -> Self;
}
impl FromI64 for f32 {
    fn from_i64(v: i64) -> Self {
        v as f32
    }
}
impl FromI64 for f64 {
    fn from_i64(v: i64) -> Self {
        v as f64
    }
}
impl FromI64 for i32 {
    fn from_i64(v: i64) -> Self {
        v as i32
    }
}
impl FromI64 for i64 {
    fn from_i64(v: i64) -> Self {
        v
    }
}
impl FromI64 for bf16 {
    fn from_i64(v: i64) -> Self {
        bf16::from_f32(v as f32)
    }
}

fn input<T: FromI64>(r: usize, n: usize) -> Vec<T> {
    (0..n).map(|i| T::from_i64(val(r, i))).collect()
}

fn check_dtype<T: FromI64>() {
    for w in 1..=4 {
        for n in [0usize, 1, 5, 37] {
            let out = run_world(w, |pg| {
                let r = pg.rank();
                // all_reduce sum and max
                let mut a = input::<T>(r, n);
                pg.all_reduce(&mut a, ReduceOp::Sum)?;
                let mut m = input::<T>(r, n);
                pg.all_reduce(&mut m, ReduceOp::Max)?;
                // broadcast from the last rank
                let mut b = input::<T>(r, n);
                pg.broadcast(&mut b, w - 1)?;
                // reduce to rank 0
                let mut red = input::<T>(r, n);
                pg.reduce(&mut red, ReduceOp::Sum, 0)?;
                // all_gather into and list form
                let mut g = vec![T::from_i64(0); n * w];
                pg.all_gather_into(&input::<T>(r, n), &mut g)?;
                let gl = pg.all_gather(&input::<T>(r, n))?;
                // reduce_scatter: input n*w, output n
                let mut rs = vec![T::from_i64(0); n];
                pg.reduce_scatter_into(&input::<T>(r, n * w), &mut rs, ReduceOp::Sum)?;
                // gather / scatter to root 0
                let mut gat = vec![T::from_i64(0); n * w];
                pg.gather(&input::<T>(r, n), (r == 0).then_some(&mut gat[..]), 0)?;
                let mut sc = vec![T::from_i64(0); n];
                let src = input::<T>(99, n * w);
                pg.scatter((r == 0).then_some(&src[..]), &mut sc, 0)?;
                // all_to_all_single, equal splits
                let mut a2a = vec![T::from_i64(0); n * w];
                pg.all_to_all_single(&mut a2a, &input::<T>(r, n * w), None, None)?;
                pg.barrier()?;
                Ok((a, m, b, red, g, gl, rs, gat, sc, a2a))
            })
            .unwrap_or_else(|e| panic!("{} w={w} n={n}: {e}", std::any::type_name::<T>()));
            for (r, (a, m, b, red, g, gl, rs, gat, sc, a2a)) in out.into_iter().enumerate() {
                let sum: Vec<T> = (0..n)
                    .map(|i| T::from_i64((0..w).map(|q| val(q, i)).sum()))
                    .collect();
                let max: Vec<T> = (0..n)
                    .map(|i| T::from_i64((0..w).map(|q| val(q, i)).max().unwrap()))
                    .collect();
                assert_eq!(a, sum, "all_reduce sum w={w} n={n} rank {r}");
                assert_eq!(m, max, "all_reduce max");
                assert_eq!(b, input::<T>(w - 1, n), "broadcast");
                // Every rank's input in rank order: what gather and all_gather produce.
                let gathered: Vec<T> = (0..w).flat_map(|q| input::<T>(q, n)).collect();
                if r == 0 {
                    assert_eq!(red, sum, "reduce");
                    assert_eq!(gat, gathered, "gather");
                }
                assert_eq!(g, gathered, "all_gather_into");
                assert_eq!(gl.concat(), gathered, "all_gather list");
                assert_eq!(gl.len(), w);
                let rs_want: Vec<T> = (0..n)
                    .map(|i| T::from_i64((0..w).map(|q| val(q, r * n + i)).sum()))
                    .collect();
                assert_eq!(rs, rs_want, "reduce_scatter");
                assert_eq!(
                    sc,
                    input::<T>(99, n * w)[r * n..(r + 1) * n].to_vec(),
                    "scatter"
                );
                let a2a_want: Vec<T> = (0..w)
                    .flat_map(|q| input::<T>(q, n * w)[r * n..(r + 1) * n].to_vec())
                    .collect();
                assert_eq!(a2a, a2a_want, "all_to_all_single");
            }
        }
    }
}

#[test]
fn f32_all_world_sizes() {
    check_dtype::<f32>();
}

#[test]
fn i64_all_world_sizes() {
    check_dtype::<i64>();
}

#[test]
fn bf16_and_i32_and_f64() {
    check_dtype::<bf16>();
    check_dtype::<i32>();
    check_dtype::<f64>();
}

#[test]
fn uneven_forms() {
    for w in 1..=4usize {
        let counts: Vec<usize> = (0..w).map(|r| (r * 3) % 4).collect(); // includes zeros
        let total: usize = counts.iter().sum();
        let c = counts.clone();
        let out = run_world(w, move |pg| {
            let r = pg.rank();
            let mine: Vec<i32> = (0..c[r]).map(|i| (r * 100 + i) as i32).collect();
            let mut g = vec![0i32; total];
            pg.all_gather_into_uneven(&mine, &mut g, &c)?;
            let gl = pg.all_gather_uneven(&mine)?;
            // reduce_scatter uneven: every rank contributes 1..=total
            let full: Vec<i32> = (0..total).map(|i| i as i32 + r as i32).collect();
            let mut rs = vec![0i32; c[r]];
            pg.reduce_scatter_into_uneven(&full, &mut rs, &c, ReduceOp::Sum)?;
            // all_to_all with splits: rank r sends (r + q) % 3 elements to rank q.
            let send: Vec<usize> = (0..w).map(|q| (r + q) % 3).collect();
            let recv: Vec<usize> = (0..w).map(|q| (q + r) % 3).collect();
            let inp: Vec<i32> = (0..w)
                .flat_map(|q| vec![(r * 10 + q) as i32; send[q]])
                .collect();
            let mut out = vec![0i32; recv.iter().sum()];
            pg.all_to_all_single(&mut out, &inp, Some(&recv), Some(&send))?;
            // list form
            let lists: Vec<Vec<i32>> = (0..w).map(|q| vec![r as i32; q]).collect();
            let got = pg.all_to_all(&lists)?;
            Ok((g, gl, rs, out, got))
        })
        .unwrap();
        let want_g: Vec<i32> = (0..w)
            .flat_map(|q| (0..counts[q]).map(move |i| (q * 100 + i) as i32))
            .collect();
        let starts: Vec<usize> = counts
            .iter()
            .scan(0, |a, &c| {
                let s = *a;
                *a += c;
                Some(s)
            })
            .collect();
        for (r, (g, gl, rs, out, got)) in out.into_iter().enumerate() {
            assert_eq!(g, want_g);
            assert_eq!(gl.concat(), want_g);
            assert_eq!(gl.iter().map(Vec::len).collect::<Vec<_>>(), counts);
            let rs_want: Vec<i32> = (0..counts[r])
                .map(|i| (0..w).map(|q| (starts[r] + i) as i32 + q as i32).sum())
                .collect();
            assert_eq!(rs, rs_want);
            let want: Vec<i32> = (0..w)
                .flat_map(|q| vec![(q * 10 + r) as i32; (q + r) % 3])
                .collect();
            assert_eq!(out, want);
            assert_eq!(got, (0..w).map(|q| vec![q as i32; r]).collect::<Vec<_>>());
        }
    }
}

#[test]
fn size_mismatches_are_rejected_before_the_wire() {
    let out = run_world(2, |pg| {
        let mut errs = Vec::new();
        let mut out = vec![0f32; 3];
        errs.push(pg.all_gather_into(&[1.0f32, 2.0], &mut out).unwrap_err());
        let mut small = vec![0f32; 1];
        errs.push(
            pg.reduce_scatter_into(&[1.0f32; 3], &mut small, ReduceOp::Sum)
                .unwrap_err(),
        );
        errs.push(
            pg.all_to_all_single(&mut [0u8; 4], &[0u8; 4], Some(&[2, 1]), None)
                .unwrap_err(),
        );
        errs.push(
            pg.all_gather_into_uneven(&[1u8], &mut [0u8; 3], &[1, 1, 1])
                .unwrap_err(),
        );
        errs.push(pg.broadcast(&mut [0u8; 2], 5).unwrap_err());
        errs.push(pg.all_reduce(&mut [1.0f32], ReduceOp::BitXor).unwrap_err());
        errs.push(pg.send(&[1u8], pg.rank(), 0).unwrap_err());
        // Split sizes whose sum wraps: refused, not wrapped past the length checks.
        errs.push(
            pg.all_gather_into_uneven(&[1u8], &mut [0u8; 0], &[usize::MAX, 1])
                .unwrap_err(),
        );
        errs.push(
            pg.all_to_all_single(&mut [0u8; 4], &[0u8; 4], None, Some(&[usize::MAX, 5]))
                .unwrap_err(),
        );
        // The group is still usable after local errors.
        let mut x = [1u32];
        pg.all_reduce(&mut x, ReduceOp::Sum)?;
        Ok((errs, x[0], pg.rank()))
    })
    .unwrap();
    for (errs, x, rank) in out {
        assert_eq!(x, 2);
        let msg = errs[0].to_string();
        assert!(
            matches!(
                errs[0],
                Error::SizeMismatch {
                    expected: 4,
                    actual: 3,
                    op: "all_gather",
                    ..
                }
            ),
            "{msg}"
        );
        assert!(
            msg.contains(&format!("rank {rank}")) && msg.contains('4') && msg.contains('3'),
            "{msg}"
        );
        assert!(
            matches!(
                errs[1],
                Error::SizeMismatch {
                    expected: 2,
                    actual: 3,
                    ..
                }
            ),
            "{}",
            errs[1]
        );
        assert!(matches!(errs[2], Error::SizeMismatch { .. }), "{}", errs[2]);
        assert!(
            matches!(errs[3], Error::SizeMismatch { what: "counts", .. }),
            "{}",
            errs[3]
        );
        assert!(
            matches!(errs[4], Error::InvalidArgument { .. }),
            "{}",
            errs[4]
        );
        // The wire crate's typed error, wrapped as the backend would report it.
        assert!(
            matches!(
                &errs[5],
                Error::Backend(dist_backend::Error::Wire {
                    op: "all_reduce",
                    source: dist_wire::WireError::InvalidReduceOp { .. },
                    ..
                })
            ),
            "{}",
            errs[5]
        );
        for e in &errs[6..] {
            assert!(matches!(e, Error::InvalidArgument { .. }), "{e}");
        }
        for e in &errs[7..] {
            assert!(e.to_string().contains("largest possible length"), "{e}");
        }
    }
}

#[test]
fn mismatched_counts_across_ranks_fail_not_hang() {
    let err =
        dist_collective::testing::run_world_with(2, std::time::Duration::from_secs(10), |pg| {
            let mut v = vec![1.0f32; 4 + pg.rank()];
            pg.all_reduce(&mut v, ReduceOp::Sum)?;
            Ok(())
        })
        .unwrap_err();
    assert!(matches!(err, Error::Backend(_)), "{err}");
}

#[test]
fn free_functions_need_init() {
    assert!(!dist_collective::is_initialized());
    assert!(matches!(
        dist_collective::all_reduce(&mut [1.0f32], ReduceOp::Sum),
        Err(Error::NotInitialized { .. })
    ));
    assert!(matches!(
        dist_collective::get_rank(),
        Err(Error::NotInitialized { .. })
    ));
}
