//! DTensor: every redistribution between placements on 1-D and 2-D meshes, uneven shapes
//! included, checked against boxes cut from the full tensor here (not by DTensor's code); the
//! collective each 1-D transition uses; bad placements as errors.

use dist_collective::testing::run_world;
use dist_collective::{DTensor, DeviceMesh, Error, Placement, ReduceOp, ShardLayout};

/// The global tensor: element i is i + 1 (no zeros, so a lost element shows).
fn global(shape: &[usize]) -> Vec<f64> {
    (0..shape.iter().product::<usize>())
        .map(|i| i as f64 + 1.0)
        .collect()
}

/// The box of `g` (of `shape`) at `off` with extent `ext`, by index arithmetic.
fn cut(g: &[f64], shape: &[usize], off: &[usize], ext: &[usize]) -> Vec<f64> {
    let n: usize = ext.iter().product();
    (0..n)
        .map(|mut j| {
            let mut flat = 0;
            let mut stride = 1;
            for d in (0..shape.len()).rev() {
                flat += (off[d] + j % ext[d]) * stride;
                j /= ext[d];
                stride *= shape[d];
            }
            g[flat]
        })
        .collect()
}

/// This rank's local values for `placements`, built by hand: its box of `g`, and for each
/// `Partial` dimension a perturbation that the reduction cancels (sum: coordinate 0 holds the
/// value, every rank adds an offset summing to zero; max: the others hold smaller values;
/// avg: offsets summing to zero).
fn local_for(
    g: &[f64],
    shape: &[usize],
    mesh: &[usize],
    coord: &[usize],
    pl: &[Placement],
) -> Vec<f64> {
    let l = ShardLayout::new(shape, mesh, pl).unwrap();
    let c = l.local_chunk(coord);
    let mut v = cut(g, shape, &c.offsets, &c.shape);
    let zero_sum_offset = |c: usize, n: usize| {
        if c == 0 {
            -((1..n).sum::<usize>() as f64)
        } else {
            c as f64
        }
    };
    let mut keep = 1.0;
    let mut add = 0.0;
    for (i, p) in pl.iter().enumerate() {
        match p {
            Placement::Partial(ReduceOp::Sum) => {
                if coord[i] != 0 {
                    keep = 0.0;
                }
                add += zero_sum_offset(coord[i], mesh[i]);
            }
            Placement::Partial(ReduceOp::Avg) => add += zero_sum_offset(coord[i], mesh[i]),
            Placement::Partial(ReduceOp::Max) => add -= coord[i] as f64,
            _ => {}
        }
    }
    for x in &mut v {
        *x = *x * keep + add;
    }
    v
}

fn check_all_pairs(mesh_dims: &[(&str, usize)], shape: &[usize], choices: &[Placement]) {
    let world: usize = mesh_dims.iter().map(|d| d.1).product();
    let mesh_shape: Vec<usize> = mesh_dims.iter().map(|d| d.1).collect();
    // Every placement vector over the mesh (one choice per mesh dim); no mixing of different
    // partial ops, whose combined reduction would depend on order.
    let mut all: Vec<Vec<Placement>> = vec![vec![]];
    for _ in 0..mesh_dims.len() {
        all = all
            .into_iter()
            .flat_map(|v| {
                choices.iter().map(move |&p| {
                    let mut w = v.clone();
                    w.push(p);
                    w
                })
            })
            .collect();
    }
    all.retain(|v| {
        let ops: Vec<_> = v
            .iter()
            .filter(|p| matches!(p, Placement::Partial(_)))
            .collect();
        ops.windows(2).all(|w| w[0] == w[1])
    });
    let g = global(shape);
    let pairs = run_world(world, |pg| {
        let mesh = DeviceMesh::new(&pg, mesh_dims)?;
        let coord = mesh.coordinate().to_vec();
        let mut checked = 0;
        for src in &all {
            let local = local_for(&g, shape, &mesh_shape, &coord, src);
            let t = DTensor::from_local(local, shape, &mesh, src)?;
            for dst in &all {
                let ctx = format!(
                    "{src:?} -> {dst:?} shape {shape:?} mesh {mesh_shape:?} coord {coord:?}"
                );
                let r = t.redistribute(dst)?;
                assert_eq!(r.placements(), &dst[..], "{ctx}");
                let want_chunk = ShardLayout::new(shape, &mesh_shape, dst)
                    .unwrap()
                    .local_chunk(&coord);
                assert_eq!(r.local_shape(), want_chunk.shape, "{ctx}");
                if dst.iter().all(|p| !matches!(p, Placement::Partial(_))) {
                    let want = cut(&g, shape, &want_chunk.offsets, &want_chunk.shape);
                    assert_eq!(r.to_local(), &want[..], "{ctx}");
                } else {
                    assert_eq!(r.full_tensor()?, g, "{ctx} (full_tensor)");
                }
                checked += 1;
            }
            assert_eq!(t.full_tensor()?, g, "{src:?} full_tensor");
        }
        Ok(checked)
    })
    .unwrap();
    assert_eq!(pairs[0], all.len() * all.len());
}

const ONE_D: [Placement; 6] = [
    Placement::Shard(0),
    Placement::Shard(1),
    Placement::Replicate,
    Placement::Partial(ReduceOp::Sum),
    Placement::Partial(ReduceOp::Max),
    Placement::Partial(ReduceOp::Avg),
];

#[test]
fn redistribute_every_pair_on_1d_meshes_uneven_shapes() {
    for world in [1, 2, 3, 4] {
        for shape in [&[5, 7][..], &[1, 3], &[0, 3], &[6, 4], &[3, 2, 5]] {
            check_all_pairs(&[("x", world)], shape, &ONE_D);
        }
    }
}

#[test]
fn redistribute_every_pair_on_a_2x2_mesh() {
    let choices = [
        Placement::Shard(0),
        Placement::Shard(1),
        Placement::Replicate,
        Placement::Partial(ReduceOp::Sum),
        Placement::Partial(ReduceOp::Max),
    ];
    for shape in [&[5, 3][..], &[7, 6], &[2, 1]] {
        check_all_pairs(&[("dp", 2), ("tp", 2)], shape, &choices);
    }
    check_all_pairs(
        &[("a", 2), ("b", 2)],
        &[3, 5, 2],
        &[
            Placement::Shard(0),
            Placement::Shard(2),
            Placement::Replicate,
        ],
    );
}

#[test]
fn redistribute_on_a_2x3_mesh_nested_shards() {
    let choices = [
        Placement::Shard(0),
        Placement::Shard(1),
        Placement::Replicate,
        Placement::Partial(ReduceOp::Sum),
    ];
    check_all_pairs(&[("dp", 2), ("tp", 3)], &[7, 5], &choices);
}

/// Each 1-D transition is one collective of the cheapest kind, or none.
#[test]
fn each_transition_uses_the_cheapest_collective() {
    use Placement::*;
    let cases: Vec<(Placement, Placement, Vec<&str>)> = vec![
        (Shard(0), Replicate, vec!["all_gather"]),
        (Shard(1), Replicate, vec!["all_gather"]),
        (Partial(ReduceOp::Sum), Replicate, vec!["all_reduce"]),
        (Partial(ReduceOp::Sum), Shard(1), vec!["reduce_scatter"]),
        (Replicate, Shard(0), vec![]),
        (Replicate, Partial(ReduceOp::Sum), vec![]),
        (Shard(0), Shard(1), vec!["all_to_all"]),
        (Shard(1), Shard(0), vec!["all_to_all"]),
        (Shard(0), Shard(0), vec![]),
    ];
    run_world(3, |pg| {
        let mesh = DeviceMesh::new(&pg, &[("tp", 3)])?;
        let g = global(&[5, 4]);
        let group = mesh.dim_group(0);
        for (from, to, want) in &cases {
            let t = DTensor::distribute_tensor(&g, &[5, 4], &mesh, &[*from])?;
            let before = group.flight_recorder().len();
            let _ = t.redistribute(&[*to])?;
            let ops: Vec<&str> = group.flight_recorder()[before..]
                .iter()
                .map(|e| e.op)
                .collect();
            assert_eq!(&ops, want, "{from} -> {to}");
        }
        Ok(())
    })
    .unwrap();
}

#[test]
fn distribute_from_one_rank_and_replicate_to_partial_zeros_the_others() {
    let out = run_world(4, |pg| {
        let mesh = DeviceMesh::new(&pg, &[("dp", 2), ("tp", 2)])?;
        // The tp row alone, over the existing group: a 1-D DTensor on it.
        let tp = mesh.sub_mesh("tp").expect("tp");
        assert!(mesh.sub_mesh("pp").is_none());
        assert_eq!(
            (tp.shape(), tp.coordinate()),
            (&[2][..], &[pg.rank() % 2][..])
        );
        let row = DTensor::distribute_tensor(&[1.0, 2.0, 3.0], &[3], &tp, &[Placement::Shard(0)])?;
        assert_eq!(row.full_tensor()?, [1.0, 2.0, 3.0]);
        let g = global(&[5, 3]);
        let full = (pg.rank() == 2).then_some(&g[..]);
        let t = DTensor::distribute_from(
            full,
            2,
            &[5, 3],
            &mesh,
            &[Placement::Shard(0), Placement::Shard(1)],
        )?;
        let p = DTensor::distribute_tensor(
            &g,
            &[5, 3],
            &mesh,
            &[Placement::Replicate, Placement::Partial(ReduceOp::Sum)],
        )?;
        Ok((
            t.local_shape(),
            t.full_tensor()?,
            p.to_local().iter().sum::<f64>(),
        ))
    })
    .unwrap();
    let g = global(&[5, 3]);
    let shapes: Vec<_> = out.iter().map(|o| o.0.clone()).collect();
    assert_eq!(shapes, [vec![3, 2], vec![3, 1], vec![2, 2], vec![2, 1]]);
    assert!(out.iter().all(|o| o.1 == g));
    let total: f64 = g.iter().sum();
    let sums: Vec<f64> = out.iter().map(|o| o.2).collect();
    assert_eq!(sums, [total, 0.0, total, 0.0]);
}

/// The source's own mistakes (a full tensor of the wrong size, or none) fail every rank at
/// once: the others hear it from the source before the data, instead of waiting out their
/// timeout (60 s: a wait would end in timeouts, which the kinds asserted rule out); the
/// group stays usable.
#[test]
fn a_source_without_the_right_tensor_fails_every_rank_naming_it() {
    let out =
        dist_collective::testing::run_world_with(3, std::time::Duration::from_secs(60), |pg| {
            let mesh = DeviceMesh::new(&pg, &[("dp", 3)])?;
            let short = [1.0f32; 5];
            let e1 = DTensor::distribute_from(
                (pg.rank() == 1).then_some(&short[..]),
                1,
                &[2, 3],
                &mesh,
                &[Placement::Shard(0)],
            )
            .unwrap_err();
            let e2 =
                DTensor::<f32>::distribute_from(None, 2, &[2, 3], &mesh, &[Placement::Shard(0)])
                    .unwrap_err();
            // Rank 0 passes a tensor too, where only the source, rank 1, may: before, rank 0
            // returned at once and ranks 1 and 2 went on into the broadcasts without it.
            let full = [1.0f32; 6];
            let e3 = DTensor::distribute_from(
                (pg.rank() <= 1).then_some(&full[..]),
                1,
                &[2, 3],
                &mesh,
                &[Placement::Shard(0)],
            )
            .unwrap_err();
            pg.barrier()?;
            Ok([e1, e2, e3])
        })
        .unwrap();
    for (r, errs) in out.iter().enumerate() {
        let msg = errs[2].to_string();
        if r == 0 {
            assert!(
                msg.contains("this rank is not and passed Some"),
                "rank {r}: {msg}"
            );
        } else {
            assert!(
                msg.contains("a rank other than the source, rank 1, passed a tensor"),
                "rank {r}: {msg}"
            );
        }
        for (e, src) in errs[..2].iter().zip([1, 2]) {
            let msg = e.to_string();
            if r == src {
                assert!(
                    matches!(
                        e,
                        Error::SizeMismatch { .. } | Error::InvalidArgument { .. }
                    ),
                    "rank {r}: {msg}"
                );
            } else {
                assert!(
                    msg.contains(&format!("the source, rank {src}, has no tensor to send")),
                    "rank {r}: {msg}"
                );
            }
        }
    }
}

#[test]
fn bad_placements_are_errors_naming_rank_and_op() {
    run_world(2, |pg| {
        let mesh = DeviceMesh::new(&pg, &[("tp", 2)])?;
        let r = pg.rank();
        let e = DTensor::<f32>::distribute_tensor(&[0.0; 4], &[4], &mesh, &[Placement::Shard(1)])
            .unwrap_err();
        let s = e.to_string();
        assert!(matches!(e, Error::InvalidArgument { .. }), "{s}");
        assert!(
            s.contains(&format!("rank {r}"))
                && s.contains("distribute_tensor")
                && s.contains("Shard(1)"),
            "{s}"
        );
        // One placement per mesh dimension.
        let e =
            DTensor::<f32>::distribute_tensor(&[0.0; 4], &[4], &mesh, &[Placement::Replicate; 2])
                .unwrap_err()
                .to_string();
        assert!(e.contains("2 placements for a 1-D mesh"), "{e}");
        // Local size not matching the layout.
        let e =
            DTensor::from_local(vec![0.0f32; 3], &[4], &mesh, &[Placement::Shard(0)]).unwrap_err();
        assert!(
            matches!(
                e,
                Error::SizeMismatch {
                    expected: 2,
                    actual: 3,
                    ..
                }
            ),
            "{e}"
        );
        assert!(e.to_string().contains("from_local"), "{e}");
        // Full tensor of the wrong size.
        assert!(
            DTensor::distribute_tensor(&[0.0f32; 5], &[4], &mesh, &[Placement::Replicate]).is_err()
        );
        // Redistribute to a dim the tensor lacks, or to a partial that needs arithmetic.
        let t = DTensor::distribute_tensor(&[1.0f32; 4], &[4], &mesh, &[Placement::Shard(0)])?;
        let e = t
            .redistribute(&[Placement::Shard(3)])
            .unwrap_err()
            .to_string();
        assert!(e.contains("redistribute") && e.contains("Shard(3)"), "{e}");
        let e = t
            .redistribute(&[Placement::Partial(ReduceOp::Product)])
            .unwrap_err()
            .to_string();
        assert!(e.contains("Partial(PRODUCT)"), "{e}");
        // Bitwise reductions of floats are refused before anything is sent.
        assert!(
            t.redistribute(&[Placement::Partial(ReduceOp::BitAnd)])
                .is_err()
        );
        // The DTensor is still usable afterwards.
        assert_eq!(t.full_tensor()?, [1.0; 4]);
        Ok(())
    })
    .unwrap();
}
