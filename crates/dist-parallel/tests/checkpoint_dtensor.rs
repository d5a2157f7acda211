//! DTensors through the checkpoint: saved on a 2x2 mesh, loaded on other mesh shapes and
//! placements (1-D at 4 and 3 ranks, one rank, Replicate), uneven shapes, `Partial` reduced
//! on save and refused on load. Every loaded piece is compared with the box cut from the
//! full tensor by plain index arithmetic here, not by the layout code.

use std::path::Path;

use dist_collective::testing::run_world;
use dist_collective::{DTensor, DeviceMesh, Placement};
use dist_parallel::checkpoint::{self, LocalTensor, LocalTensorMut};
use dist_wire::ReduceOp;

/// Uneven on every split used here: 5 rows over 2 and 3, 7 columns over 2, 3 and 4.
const SHAPE: [usize; 2] = [5, 7];
/// A 1-D tensor whose length does not divide by the mesh either.
const BIAS: [usize; 1] = [3];

fn full(shape: &[usize], salt: f32) -> Vec<f32> {
    let n: usize = shape.iter().product();
    (0..n).map(|i| i as f32 * 0.25 + salt).collect()
}

/// torch.chunk's piece `k` of `len` split `parts` ways, as a range.
fn chunk(len: usize, parts: usize, k: usize) -> std::ops::Range<usize> {
    let size = len.div_ceil(parts);
    (k * size).min(len)..((k + 1) * size).min(len)
}

/// The rows `r` and columns `c` of the [`SHAPE`] matrix `m`, row-major.
fn cut(m: &[f32], r: std::ops::Range<usize>, c: std::ops::Range<usize>) -> Vec<f32> {
    r.flat_map(|i| c.clone().map(move |j| m[i * SHAPE[1] + j]))
        .collect()
}

/// Saves `w` (a [`SHAPE`] matrix, [Shard(0), Shard(1)]) and `b` ([`BIAS`], [Shard(0),
/// Replicate]) from a 2x2 mesh; `w` is saved as `Partial(Sum)` on the first mesh dimension
/// when `partial_w` (each row of the mesh holds half of the value).
fn save_2x2(dir: &Path, partial_w: bool) {
    let dir = dir.to_path_buf();
    run_world(4, move |pg| {
        let mesh = DeviceMesh::new(&pg, &[("dp", 2), ("tp", 2)])?;
        let w = if partial_w {
            let half: Vec<f32> = full(&SHAPE, 1.0).iter().map(|x| x / 2.0).collect();
            let all = [Placement::Replicate, Placement::Shard(1)];
            let t = DTensor::distribute_tensor(&half, &SHAPE, &mesh, &all)?;
            // Both dp rows hold half: as Partial(Sum) they add up to the full value.
            let p = [Placement::Partial(ReduceOp::Sum), Placement::Shard(1)];
            DTensor::from_local(t.into_local(), &SHAPE, &mesh, &p)?
        } else {
            let p = [Placement::Shard(0), Placement::Shard(1)];
            DTensor::distribute_tensor(&full(&SHAPE, 1.0), &SHAPE, &mesh, &p)?
        };
        let bp = [Placement::Shard(0), Placement::Replicate];
        let b = DTensor::distribute_tensor(&full(&BIAS, -3.0), &BIAS, &mesh, &bp)?;
        let tensors = vec![
            LocalTensor::from_dtensor("w", &w).unwrap(),
            LocalTensor::from_dtensor("b", &b).unwrap(),
        ];
        checkpoint::save(&pg, &dir, tensors).unwrap();
        Ok(())
    })
    .unwrap();
}

/// Loads `w` and `b` at `world` ranks on a 1-D mesh with `w` placed by `wp` and `b`
/// replicated; returns each rank's pieces.
fn load_1d(dir: &Path, world: usize, wp: Placement) -> Vec<(Vec<f32>, Vec<f32>)> {
    let dir = dir.to_path_buf();
    run_world(world, move |pg| {
        let mesh = DeviceMesh::new(&pg, &[("x", world)])?;
        let zeros = |shape: &[usize], p| {
            let n: usize = shape.iter().product();
            let t = DTensor::distribute_tensor(&vec![0.0f32; n], shape, &mesh, &[p])?;
            // NaN, so an element that loading forgot cannot pass for a zero.
            let len = t.to_local().len();
            DTensor::from_local(vec![f32::NAN; len], shape, &mesh, &[p])
        };
        let mut w = zeros(&SHAPE, wp)?;
        let mut b = zeros(&BIAS, Placement::Replicate)?;
        checkpoint::load(
            &dir,
            pg.rank(),
            &mut [
                LocalTensorMut::from_dtensor("w", &mut w).unwrap(),
                LocalTensorMut::from_dtensor("b", &mut b).unwrap(),
            ],
        )
        .unwrap();
        Ok((w.into_local(), b.into_local()))
    })
    .unwrap()
}

fn check(got: &[(Vec<f32>, Vec<f32>)], wp: Placement) {
    let (w, b) = (full(&SHAPE, 1.0), full(&BIAS, -3.0));
    let n = got.len();
    for (r, (gw, gb)) in got.iter().enumerate() {
        let want = match wp {
            Placement::Shard(0) => cut(&w, chunk(SHAPE[0], n, r), 0..SHAPE[1]),
            Placement::Shard(1) => cut(&w, 0..SHAPE[0], chunk(SHAPE[1], n, r)),
            _ => w.clone(),
        };
        assert_eq!(gw, &want, "w on rank {r} of {n}, {wp:?}");
        assert_eq!(gb, &b, "b on rank {r} of {n}");
    }
}

#[test]
fn saved_on_2x2_sharded_twice_loads_on_every_other_mesh_shape() {
    let dir = tempfile::tempdir().unwrap();
    save_2x2(dir.path(), false);
    for (world, wp) in [
        (4, Placement::Shard(1)),
        (3, Placement::Shard(1)),
        (3, Placement::Shard(0)),
        (1, Placement::Shard(0)),
        (4, Placement::Replicate),
        (2, Placement::Replicate),
    ] {
        check(&load_1d(dir.path(), world, wp), wp);
    }
}

#[test]
fn saved_on_2x2_loads_back_on_2x2_with_other_placements() {
    let dir = tempfile::tempdir().unwrap();
    save_2x2(dir.path(), false);
    let path = dir.path().to_path_buf();
    let w = full(&SHAPE, 1.0);
    let got = run_world(4, move |pg| {
        let mesh = DeviceMesh::new(&pg, &[("dp", 2), ("tp", 2)])?;
        // Transposed: columns over dp, rows over tp.
        let p = [Placement::Shard(1), Placement::Shard(0)];
        let n = DTensor::<f32>::distribute_tensor(&[0.0; 35], &SHAPE, &mesh, &p)?
            .to_local()
            .len();
        let mut t = DTensor::from_local(vec![f32::NAN; n], &SHAPE, &mesh, &p)?;
        checkpoint::load(
            &path,
            pg.rank(),
            &mut [LocalTensorMut::from_dtensor("w", &mut t).unwrap()],
        )
        .unwrap();
        Ok((mesh.coordinate().to_vec(), t.into_local()))
    })
    .unwrap();
    for (coord, local) in got {
        let want = cut(
            &w,
            chunk(SHAPE[0], 2, coord[1]),
            chunk(SHAPE[1], 2, coord[0]),
        );
        assert_eq!(local, want, "coordinate {coord:?}");
    }
}

#[test]
fn partial_is_reduced_on_save_and_refused_on_load() {
    let dir = tempfile::tempdir().unwrap();
    save_2x2(dir.path(), true);
    // The sum of the two halves: the full value, whatever the mesh it loads on.
    check(
        &load_1d(dir.path(), 3, Placement::Shard(1)),
        Placement::Shard(1),
    );
    check(
        &load_1d(dir.path(), 1, Placement::Replicate),
        Placement::Replicate,
    );
    let errs = run_world(2, |pg| {
        let mesh = DeviceMesh::new(&pg, &[("x", 2)])?;
        let p = [Placement::Partial(ReduceOp::Sum)];
        let mut t = DTensor::from_local(vec![0.0f32; 35], &SHAPE, &mesh, &p)?;
        Ok(LocalTensorMut::from_dtensor("w", &mut t)
            .unwrap_err()
            .to_string())
    })
    .unwrap();
    for (r, e) in errs.iter().enumerate() {
        let want =
            format!("rank {r}: checkpoint load: tensor \"w\": cannot load into placement Partial(");
        assert!(e.starts_with(&want), "{e}");
    }
}
