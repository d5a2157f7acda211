//! FSDP against an independent computation: one process training the same model on the same
//! global batch (and DDP), at 1, 2, 3 and 4 ranks, in f32, bf16 and f16, sharded and hybrid.

mod mlp;

use dist_collective::testing::run_world;
use dist_collective::{DeviceMesh, ProcessGroup};
use dist_parallel::optim::{AdamW, AdamWState};
use dist_parallel::{
    ComputeElement, Ddp, DdpOptions, Error, Fsdp, FsdpOptions, ParamInfo, ReduceDtype,
};
use half::{bf16, f16};
use mlp::{BATCH, DIMS};

const STEPS: usize = 20;
const SEED: u64 = 7;

fn opt() -> AdamW {
    AdamW {
        lr: 1e-2,
        ..AdamW::default()
    }
}

fn new_fsdp<C: ComputeElement>(pg: &ProcessGroup, opts: FsdpOptions) -> Fsdp<C> {
    let init = mlp::init(&DIMS, SEED);
    let values: Vec<&[f32]> = init.iter().map(Vec::as_slice).collect();
    Fsdp::new(pg.clone(), mlp::units(&DIMS), opts, &values).unwrap()
}

/// Trains `STEPS` steps with FSDP on `world` ranks; every rank returns the full model.
fn train_fsdp<C: ComputeElement>(world: usize, opts: FsdpOptions) -> Vec<Vec<Vec<f32>>> {
    run_world(world, |pg| {
        let mut fsdp = new_fsdp::<C>(&pg, opts.clone());
        let mut st = Vec::new();
        for s in 0..STEPS {
            let (x, t) = mlp::batch(&DIMS, s, BATCH);
            let x = mlp::rows(&x, DIMS[0], pg.rank(), world);
            let t = mlp::rows(&t, DIMS[4], pg.rank(), world);
            mlp::fsdp_forward_backward(&mut fsdp, &DIMS, &x, &t);
            fsdp.finish().unwrap();
            mlp::fsdp_opt_step(&mut fsdp, opt(), &mut st);
        }
        let full = fsdp.full_state_dict(false).unwrap().unwrap();
        Ok(full.into_iter().map(|(_, v)| v).collect())
    })
    .unwrap()
}

#[test]
fn f32_matches_one_process_and_ddp_at_1_2_and_4_ranks() {
    let reference = mlp::train_single(&DIMS, SEED, STEPS, opt());
    let start = mlp::init(&DIMS, SEED);
    assert!(
        mlp::max_diff(&reference, &start) > 1e-2,
        "training must move the parameters"
    );
    // 3 ranks (BATCH is not divisible by 3) in `three_ranks_shard_unevenly_and_still_match`.
    for world in [1, 2, 4] {
        let models = train_fsdp::<f32>(world, FsdpOptions::default());
        for (r, m) in models.iter().enumerate() {
            let d = mlp::max_diff(m, &reference);
            assert!(
                d <= 1e-5,
                "world {world} rank {r}: max |FSDP - one process| = {d}"
            );
        }
        let ddp = run_world(world, |pg| {
            let mut p = mlp::init(&DIMS, SEED);
            let infos: Vec<ParamInfo> = mlp::units(&DIMS).concat();
            let mut st: Vec<AdamWState> = p.iter().map(|v| AdamWState::new(v.len())).collect();
            let mut ddp = {
                let mut vals: Vec<&mut [f32]> = p.iter_mut().map(|v| v.as_mut_slice()).collect();
                Ddp::new(pg.clone(), infos, DdpOptions::default(), &mut vals).unwrap()
            };
            for s in 0..STEPS {
                let (x, t) = mlp::batch(&DIMS, s, BATCH);
                let x = mlp::rows(&x, DIMS[0], pg.rank(), world);
                let t = mlp::rows(&t, DIMS[4], pg.rank(), world);
                mlp::ddp_step(&mut ddp, &DIMS, &mut p, &mut st, &x, &t, opt());
            }
            Ok(p)
        })
        .unwrap();
        let d = mlp::max_diff(&models[0], &ddp[0]);
        let one = mlp::max_diff(&models[0], &reference);
        eprintln!("world {world}: max |FSDP - one process| {one:.2e}, |FSDP - DDP| {d:.2e}");
        assert!(d <= 1e-5, "world {world}: max |FSDP - DDP| = {d}");
    }
}

#[test]
fn three_ranks_shard_unevenly_and_still_match() {
    // BATCH is not divisible by 3, so use a batch of 6 here: the sharding is what is uneven.
    let dims = DIMS;
    let single = {
        let mut p = mlp::init(&dims, SEED);
        let mut st: Vec<AdamWState> = p.iter().map(|v| AdamWState::new(v.len())).collect();
        for s in 0..5 {
            let (x, t) = mlp::batch(&dims, s, 6);
            let (_, g) = mlp::grads(&dims, &p, &x, &t);
            for ((p, g), st) in p.iter_mut().zip(&g).zip(&mut st) {
                opt().step(p, g, st).unwrap();
            }
        }
        p
    };
    let out = run_world(3, |pg| {
        let mut fsdp = new_fsdp::<f32>(&pg, FsdpOptions::default());
        let mut st = Vec::new();
        for s in 0..5 {
            let (x, t) = mlp::batch(&dims, s, 6);
            let x = mlp::rows(&x, dims[0], pg.rank(), 3);
            let t = mlp::rows(&t, dims[4], pg.rank(), 3);
            mlp::fsdp_forward_backward(&mut fsdp, &dims, &x, &t);
            fsdp.finish().unwrap();
            mlp::fsdp_opt_step(&mut fsdp, opt(), &mut st);
        }
        Ok(fsdp.full_state_dict(true).unwrap())
    })
    .unwrap();
    assert!(out[1].is_none() && out[2].is_none(), "rank0_only");
    let full: Vec<Vec<f32>> = out[0]
        .clone()
        .unwrap()
        .into_iter()
        .map(|(_, v)| v)
        .collect();
    let d = mlp::max_diff(&full, &single);
    assert!(d <= 1e-5, "max diff {d}");
}

#[test]
fn bf16_and_f16_compute_stay_within_tolerance() {
    // Parameters rounded to 8 (bf16) or 11 (f16) significant bits for compute, f32 shards and
    // optimizer: after 20 AdamW steps at lr 1e-2 the models stay within 2e-3 (bf16) and
    // 5e-4 (f16) of f32 (measured: 6.7e-4 and 1.0e-4).
    let reference = mlp::train_single(&DIMS, SEED, STEPS, opt());
    for world in [2, 4] {
        for reduce in [ReduceDtype::Compute, ReduceDtype::F32] {
            let opts = FsdpOptions {
                reduce_dtype: reduce,
                ..FsdpOptions::default()
            };
            let b = mlp::max_diff(&train_fsdp::<bf16>(world, opts.clone())[0], &reference);
            let h = mlp::max_diff(&train_fsdp::<f16>(world, opts)[0], &reference);
            eprintln!("world {world} {reduce:?}: max |bf16 - f32 reference| {b:.2e}, f16 {h:.2e}");
            assert!(b <= 2e-3, "bf16, world {world}, {reduce:?}: {b}");
            assert!(h <= 5e-4, "f16, world {world}, {reduce:?}: {h}");
            assert!(b > 0.0, "bf16 must actually round");
        }
    }
}

/// One backward pass of `f`'s single unit with every gradient `g`; this rank's gradient
/// shard after it.
fn backward_with_every_gradient(mut f: Fsdp<f16>, g: f32) -> Vec<f32> {
    f.pre_backward(0).unwrap();
    let len = f.unit_len(0);
    f.post_backward(0, &vec![f16::from_f32(g); len]).unwrap();
    f.finish().unwrap();
    f.shards_mut()
        .into_iter()
        .flat_map(|s| s.grad.to_vec())
        .collect()
}

#[test]
fn f16_gradients_whose_sum_leaves_f16_still_average_to_the_right_value() {
    // Every rank's gradient is g: the average is g, well inside f16 (largest 65504), while
    // the sum over the ranks (80000 at 2 ranks, 120000 at 4) is not. Summing first and
    // dividing at the end (ReduceOp::Avg) gave inf; divided in two halves around the sum
    // (torch FSDP's factors), each partial sum stays in range. Uneven shards (7 elements).
    for (world, g) in [(2, 40000.0f32), (4, 30000.0)] {
        let out = run_world(world, |pg| {
            let units = vec![vec![ParamInfo::new("w", &[7])]];
            let f =
                Fsdp::<f16>::new(pg.clone(), units, FsdpOptions::default(), &[&[0.5; 7]]).unwrap();
            Ok(backward_with_every_gradient(f, g))
        })
        .unwrap();
        let all: Vec<f32> = out.concat();
        assert_eq!(
            all.len(),
            7,
            "world {world}: the shards cover the parameter"
        );
        assert!(all.iter().all(|&v| v == g), "world {world}: {all:?}");
    }
    // Hybrid (2 replicas of 2 shards): averaged over the shards, then over the replicas.
    let g = 40000.0f32;
    let out = run_world(4, |pg| {
        let mesh = DeviceMesh::new(&pg, &[("replicate", 2), ("shard", 2)])?;
        let units = vec![vec![ParamInfo::new("w", &[7])]];
        let f = Fsdp::<f16>::new_hybrid(
            &mesh,
            "replicate",
            "shard",
            units,
            FsdpOptions::default(),
            &[&[0.5; 7]],
        )
        .unwrap();
        Ok(backward_with_every_gradient(f, g))
    })
    .unwrap();
    for (r, v) in out.iter().enumerate() {
        assert!(v.iter().all(|&v| v == g), "hybrid, rank {r}: {v:?}");
    }
}

#[test]
fn keeping_parameters_after_forward_gathers_once_per_unit() {
    let reference = mlp::train_single(&DIMS, SEED, STEPS, opt());
    for (reshard, prefetch) in [(false, 1), (true, 0), (true, 3)] {
        let opts = FsdpOptions {
            reshard_after_forward: reshard,
            prefetch,
            ..FsdpOptions::default()
        };
        let out = run_world(2, |pg| {
            let mut fsdp = new_fsdp::<f32>(&pg, opts.clone());
            let mut st = Vec::new();
            let mut gathers = 0;
            for s in 0..STEPS {
                let (x, t) = mlp::batch(&DIMS, s, BATCH);
                let x = mlp::rows(&x, DIMS[0], pg.rank(), 2);
                let t = mlp::rows(&t, DIMS[4], pg.rank(), 2);
                mlp::fsdp_forward_backward(&mut fsdp, &DIMS, &x, &t);
                let stats = fsdp.finish().unwrap();
                gathers = stats.all_gathers;
                assert_eq!(stats.reduce_scatters, 4);
                assert!((0.0..=1.0).contains(&stats.hidden_fraction()));
                mlp::fsdp_opt_step(&mut fsdp, opt(), &mut st);
            }
            let full = fsdp.full_state_dict(false).unwrap().unwrap();
            Ok((
                gathers,
                full.into_iter().map(|(_, v)| v).collect::<Vec<_>>(),
            ))
        })
        .unwrap();
        // Resharding gathers every unit twice (forward and backward) but the last, whose
        // backward follows its forward; keeping them, once.
        assert_eq!(out[0].0, if reshard { 7 } else { 4 }, "reshard {reshard}");
        let d = mlp::max_diff(&out[0].1, &reference);
        assert!(d <= 1e-5, "reshard {reshard} prefetch {prefetch}: {d}");
    }
}

#[test]
fn hybrid_sharding_on_a_2x2_mesh_matches_one_process() {
    let reference = mlp::train_single(&DIMS, SEED, STEPS, opt());
    let out = run_world(4, |pg| {
        let mesh = DeviceMesh::new(&pg, &[("replicate", 2), ("shard", 2)])?;
        let init = mlp::init(&DIMS, SEED);
        let values: Vec<&[f32]> = init.iter().map(Vec::as_slice).collect();
        let mut fsdp: Fsdp = Fsdp::new_hybrid(
            &mesh,
            "replicate",
            "shard",
            mlp::units(&DIMS),
            FsdpOptions::default(),
            &values,
        )
        .unwrap();
        assert_eq!(fsdp.coordinate(), mesh.coordinate());
        let mut st = Vec::new();
        for s in 0..STEPS {
            let (x, t) = mlp::batch(&DIMS, s, BATCH);
            let x = mlp::rows(&x, DIMS[0], pg.rank(), 4);
            let t = mlp::rows(&t, DIMS[4], pg.rank(), 4);
            mlp::fsdp_forward_backward(&mut fsdp, &DIMS, &x, &t);
            fsdp.finish().unwrap();
            mlp::fsdp_opt_step(&mut fsdp, opt(), &mut st);
        }
        let full = fsdp.full_state_dict(false).unwrap().unwrap();
        Ok(full.into_iter().map(|(_, v)| v).collect::<Vec<_>>())
    })
    .unwrap();
    for (r, m) in out.iter().enumerate() {
        let d = mlp::max_diff(m, &reference);
        assert!(d <= 1e-5, "rank {r}: {d}");
    }
    let e = run_world(4, |pg| {
        let mesh = DeviceMesh::new(&pg, &[("a", 2), ("b", 2)])?;
        let init = mlp::init(&DIMS, SEED);
        let values: Vec<&[f32]> = init.iter().map(Vec::as_slice).collect();
        Ok(Fsdp::<f32>::new_hybrid(
            &mesh,
            "a",
            "nope",
            mlp::units(&DIMS),
            FsdpOptions::default(),
            &values,
        )
        .unwrap_err()
        .to_string())
    })
    .unwrap();
    assert!(e[0].contains("\"nope\""), "{}", e[0]);
}

#[test]
fn no_sync_accumulates_and_clipping_uses_the_global_norm() {
    // Two micro-batches without sync then one with: the shards hold the sum of the three
    // micro-batches' averaged gradients, as one process summing them.
    let p = mlp::init(&DIMS, SEED);
    let mut want: Vec<Vec<f32>> = p.iter().map(|v| vec![0.0; v.len()]).collect();
    for s in 0..3 {
        let (x, t) = mlp::batch(&DIMS, s, BATCH);
        let (_, g) = mlp::grads(&DIMS, &p, &x, &t);
        for (w, g) in want.iter_mut().zip(g) {
            w.iter_mut().zip(g).for_each(|(a, b)| *a += b);
        }
    }
    let norm: f32 = want.iter().flatten().map(|g| g * g).sum::<f32>().sqrt();
    let out = run_world(4, |pg| {
        let mut fsdp = new_fsdp::<f32>(&pg, FsdpOptions::default());
        for s in 0..3 {
            fsdp.set_requires_gradient_sync(s == 2);
            let (x, t) = mlp::batch(&DIMS, s, BATCH);
            let x = mlp::rows(&x, DIMS[0], pg.rank(), 4);
            let t = mlp::rows(&t, DIMS[4], pg.rank(), 4);
            mlp::fsdp_forward_backward(&mut fsdp, &DIMS, &x, &t);
            let stats = fsdp.finish().unwrap();
            assert_eq!(stats.reduce_scatters, if s == 2 { 4 } else { 0 });
            if s < 2 {
                assert!(fsdp.memory().accumulated > 0);
            }
        }
        assert_eq!(fsdp.memory().accumulated, 0);
        let grads: Vec<(String, Vec<usize>, Vec<f32>)> = fsdp
            .shards_mut()
            .into_iter()
            .map(|s| (s.name.to_string(), s.chunk.offsets.clone(), s.grad.to_vec()))
            .collect();
        let got_norm = fsdp.clip_grad_norm(norm / 2.0).unwrap();
        let after = fsdp.clip_grad_norm(f32::MAX).unwrap();
        Ok((grads, got_norm, after))
    })
    .unwrap();
    let names: Vec<String> = mlp::units(&DIMS)
        .concat()
        .into_iter()
        .map(|p| p.name)
        .collect();
    for (grads, got_norm, after) in &out {
        assert!(
            (got_norm - norm).abs() <= 1e-5 * norm,
            "{got_norm} vs {norm}"
        );
        assert!(
            (after - norm / 2.0).abs() <= 1e-4 * norm,
            "{after} vs {}",
            norm / 2.0
        );
        for (name, off, g) in grads {
            let i = names.iter().position(|n| n == name).unwrap();
            let cols = if i % 2 == 0 { DIMS[i / 2] } else { 1 };
            let start = off[0] * cols;
            for (k, v) in g.iter().enumerate() {
                assert!(
                    (v - want[i][start + k]).abs() <= 1e-5,
                    "{name}[{}]",
                    start + k
                );
            }
        }
    }
}

/// A forward-only pass (evaluation) leaves the last unit gathered, or every unit without
/// `reshard_after_forward`. New values written into the shards (an optimizer step, a
/// checkpoint loaded) must reach the next forward: it ran on the gathered copies of the values
/// before. `reshard` frees what a forward-only pass left.
#[test]
fn a_forward_after_the_shards_change_sees_the_new_values() {
    for keep in [false, true] {
        let dir = tempfile::tempdir().unwrap();
        let out = run_world(2, |pg| {
            let opts = FsdpOptions {
                reshard_after_forward: !keep,
                ..FsdpOptions::default()
            };
            let mut fsdp = new_fsdp::<f32>(&pg, opts);
            let n = fsdp.num_units();
            let forward = |fsdp: &mut Fsdp<f32>, k: f32| {
                for u in 0..n {
                    let p = fsdp.pre_forward(u).unwrap();
                    assert!(
                        k.is_nan() || p.iter().all(|&x| x == k),
                        "keep={keep}: unit {u} does not hold {k}"
                    );
                    fsdp.post_forward(u).unwrap();
                }
            };
            forward(&mut fsdp, f32::NAN);
            for s in fsdp.shards_mut() {
                s.param.fill(5.0);
            }
            forward(&mut fsdp, 5.0);
            dist_parallel::checkpoint::save(&pg, dir.path(), fsdp.sharded_state()).unwrap();
            for s in fsdp.shards_mut() {
                s.param.fill(7.0);
            }
            forward(&mut fsdp, 7.0);
            let rank = pg.rank();
            dist_parallel::checkpoint::load(dir.path(), rank, &mut fsdp.sharded_state_mut())
                .unwrap();
            forward(&mut fsdp, 5.0);
            assert!(fsdp.memory().in_flight > 0, "keep={keep}");
            fsdp.reshard().unwrap();
            Ok(fsdp.memory().in_flight)
        })
        .unwrap();
        assert_eq!(
            out,
            vec![0; 2],
            "keep={keep}: reshard frees every gathered unit"
        );
    }
}

#[test]
fn memory_is_a_shard_of_ddps_plus_the_units_in_flight() {
    // A wider model so that padding is small next to the shards.
    let dims = [64, 256, 256, 256, 256, 8];
    let units = mlp::units(&dims);
    let total: usize = units.iter().flatten().map(ParamInfo::numel).sum();
    let largest_unit = units
        .iter()
        .map(|u| u.iter().map(ParamInfo::numel).sum::<usize>())
        .max()
        .unwrap();
    // DDP: parameters, gradients and two AdamW moments, whole, in f32.
    let ddp_bytes = 4 * total * 4;
    for world in [2, 4] {
        let out = run_world(world, |pg| {
            let init = mlp::init(&dims, SEED);
            let values: Vec<&[f32]> = init.iter().map(Vec::as_slice).collect();
            let mut fsdp: Fsdp =
                Fsdp::new(pg.clone(), units.clone(), FsdpOptions::default(), &values).unwrap();
            let (x, t) = mlp::batch(&dims, 0, BATCH);
            let x = mlp::rows(&x, dims[0], pg.rank(), world);
            let t = mlp::rows(&t, dims[5], pg.rank(), world);
            fsdp.reset_peak();
            mlp::fsdp_forward_backward(&mut fsdp, &dims, &x, &t);
            fsdp.finish().unwrap();
            let mut st = Vec::new();
            mlp::fsdp_opt_step(&mut fsdp, opt(), &mut st);
            let moments: usize = st.iter().map(|s: &AdamWState| 8 * s.exp_avg.len()).sum();
            let m = fsdp.memory();
            Ok((m, moments))
        })
        .unwrap();
        for (r, (m, moments)) in out.iter().enumerate() {
            let sharded = m.param_shards + m.grad_shards + moments;
            let ideal = ddp_bytes / world;
            // Padding of each parameter to the largest rank's piece: under 1% here.
            assert!(
                sharded >= ideal * 99 / 100 && sharded <= ideal * 101 / 100,
                "world {world} rank {r}: sharded state {sharded} B vs DDP/N {ideal} B"
            );
            // In flight: at most prefetch + 1 = 2 units gathered (padded buffer while the
            // copy-out runs) and 2 reduce-scatter inputs.
            let bound = 2 * (largest_unit + 1024) * (world + 2) * 4 + 2 * (largest_unit + 1024) * 4;
            assert!(
                m.peak_in_flight > 0 && m.peak_in_flight <= bound,
                "world {world} rank {r}: peak in flight {} B, bound {bound} B",
                m.peak_in_flight
            );
            assert_eq!(m.in_flight, 0, "everything is freed after the step");
            eprintln!(
                "world {world} rank {r}: FSDP state {sharded} B + peak in flight {} B; DDP {ddp_bytes} B",
                m.peak_in_flight
            );
        }
    }
}

#[test]
fn bad_input_is_an_error_naming_the_parameter_or_unit() {
    let out = run_world(2, |pg| {
        let units = vec![
            vec![ParamInfo::new("a.weight", &[3, 2])],
            vec![ParamInfo::new("b.scale", &[])],
        ];
        let e1 = Fsdp::<f32>::new(
            pg.clone(),
            units,
            FsdpOptions::default(),
            &[&[0.0; 6], &[1.0]],
        )
        .unwrap_err()
        .to_string();
        let units = vec![vec![ParamInfo::new("a.weight", &[3, 2])]];
        let e2 = Fsdp::<f32>::new(
            pg.clone(),
            units.clone(),
            FsdpOptions::default(),
            &[&[0.0; 5]],
        )
        .unwrap_err()
        .to_string();
        let mut f =
            Fsdp::<f32>::new(pg.clone(), units, FsdpOptions::default(), &[&[0.0; 6]]).unwrap();
        let e3 = f.pre_forward(1).unwrap_err().to_string();
        f.pre_backward(0).unwrap();
        let e4 = f.post_backward(0, &[0.0; 4]).unwrap_err();
        assert!(matches!(e4, Error::Fsdp { .. }));
        f.post_backward(0, &[1.0; 6]).unwrap();
        f.finish().unwrap();
        let e5 = f.clip_grad_norm(f32::NAN).unwrap_err().to_string();
        Ok((e1, e2, e3, e4.to_string(), e5))
    })
    .unwrap();
    let (e1, e2, e3, e4, e5) = &out[1];
    assert!(
        e1.contains("rank 1") && e1.contains("b.scale") && e1.contains("0-D"),
        "{e1}"
    );
    assert!(
        e2.contains("a.weight") && e2.contains("[3, 2]") && e2.contains('5'),
        "{e2}"
    );
    assert!(e3.contains("unit 1") && e3.contains("1 units"), "{e3}");
    assert!(
        e4.contains("unit 0") && e4.contains("a.weight") && e4.contains("4 gradient"),
        "{e4}"
    );
    assert!(e5.contains("max_norm"), "{e5}");
}
