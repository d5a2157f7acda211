//! The candle adapters: a tensor-parallel candle MLP and attention block at 1, 2 and 4 ranks
//! against the same model in plain candle on one process (forward and every gradient), and
//! the candle SyncBatchNorm against the flat one over the global batch on one rank (itself
//! checked against a textbook batch norm in tests/sync_bn.rs); collectives per step counted.
#![cfg(feature = "candle")]

mod numeric;

use std::collections::BTreeMap;

use candle_core::{D, Device, Module, Tensor, Var};
use dist_collective::testing::run_world;
use dist_collective::{DeviceMesh, ReduceOp, chunk_range};
use dist_parallel::tp::ParallelStyle;
use dist_parallel::tp::ParallelizePlan;
use dist_parallel::tp::candle::{CandleTpLinear, Parallelized, parallelize_module};
use dist_parallel::{BatchNormOptions, CandleSyncBatchNorm};
use numeric::{close, fresh_bn, values_f32 as values};

fn model(spec: &[(&str, Vec<usize>)], seed: u64) -> BTreeMap<String, Tensor> {
    spec.iter()
        .enumerate()
        .map(|(i, (n, s))| {
            let v = values(s.iter().product(), seed + i as u64);
            (
                n.to_string(),
                Tensor::from_vec(v, s.clone(), &Device::Cpu).unwrap(),
            )
        })
        .collect()
}

fn flat(t: &Tensor) -> Vec<f32> {
    t.flatten_all().unwrap().to_vec1().unwrap()
}

/// The plain, single-process model: a forward over full weights held as variables.
type Reference = dyn Fn(&BTreeMap<String, Var>, &Tensor) -> candle_core::Result<Tensor>;

fn linear(p: &BTreeMap<String, Var>, n: &str, x: &Tensor) -> candle_core::Result<Tensor> {
    x.broadcast_matmul(&p[&format!("{n}.weight")].as_tensor().t()?)?
        .broadcast_add(p[&format!("{n}.bias")].as_tensor())
}

/// Builds the tensor-parallel block and names its layers.
type Build = dyn Fn(&Parallelized) -> (Box<dyn Module>, Vec<(String, CandleTpLinear)>) + Sync;

/// Runs `tp_block` on `world` ranks and the reference on one, loss `Σ y·r`, and compares.
fn compare(
    world: usize,
    full: &BTreeMap<String, Tensor>,
    plan: &ParallelizePlan,
    x_shape: &[usize],
    build: &Build,
    reference: &Reference,
    what: &str,
) {
    let dev = Device::Cpu;
    let xv = values(x_shape.iter().product(), 7);
    let rv = values(x_shape.iter().product(), 8);
    let r = Tensor::from_vec(rv.clone(), x_shape, &dev).unwrap();
    // Reference.
    let vars: BTreeMap<String, Var> = full
        .iter()
        .map(|(n, t)| (n.clone(), Var::from_tensor(t).unwrap()))
        .collect();
    let x = Var::from_slice(&xv, x_shape, &dev).unwrap();
    let y_ref = reference(&vars, x.as_tensor()).unwrap();
    let g = (&y_ref * &r)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    let dx_ref = flat(g.get(x.as_tensor()).unwrap());
    let grads_ref: BTreeMap<String, Vec<f32>> = vars
        .iter()
        .map(|(n, v)| (n.clone(), flat(g.get(v.as_tensor()).unwrap())))
        .collect();
    let y_ref = flat(&y_ref);
    let out = run_world(world, |pg| {
        let mesh = DeviceMesh::new(&pg, &[("tp", world)])?;
        let named: Vec<(&str, &Tensor)> = full.iter().map(|(n, t)| (n.as_str(), t)).collect();
        let par = parallelize_module(plan, &mesh, &named).unwrap();
        let (block, layers) = build(&par);
        let x = Var::from_slice(&xv, x_shape, &dev).unwrap();
        let r = Tensor::from_vec(rv.clone(), x_shape, &dev).unwrap();
        let before = mesh.dim_group(0).flight_recorder().len();
        let y = block.forward(x.as_tensor()).unwrap();
        let g = (&y * &r).unwrap().sum_all().unwrap().backward().unwrap();
        let ops: Vec<&str> = mesh.dim_group(0).flight_recorder()[before..]
            .iter()
            .map(|e| e.op)
            .collect();
        let mut grads = BTreeMap::new();
        for (name, l) in &layers {
            let v = l.vars();
            let gw = g.get(v[0].as_tensor()).unwrap();
            let gb = g.get(v[1].as_tensor()).unwrap();
            let d = l.to_dtensors(gw, Some(gb)).unwrap();
            grads.insert(format!("{name}.weight"), d[0].full_tensor()?);
            grads.insert(format!("{name}.bias"), d[1].full_tensor()?);
        }
        Ok((flat(&y), flat(g.get(x.as_tensor()).unwrap()), grads, ops))
    })
    .unwrap();
    for (rank, (y, dx, grads, ops)) in out.iter().enumerate() {
        let ctx = format!("{what} world {world} rank {rank}");
        assert_eq!(
            ops,
            &["all_reduce", "all_reduce"],
            "{ctx}: one all_reduce each way"
        );
        close(y, &y_ref, &format!("{ctx} output"));
        close(dx, &dx_ref, &format!("{ctx} grad input"));
        assert_eq!(grads.len(), grads_ref.len(), "{ctx}");
        for (n, w) in &grads_ref {
            close(&grads[n], w, &format!("{ctx} grad {n}"));
        }
    }
}

#[test]
fn candle_mlp_matches_one_process() {
    let (h, f) = (8, 10);
    let full = model(
        &[
            ("mlp.fc1.weight", vec![f, h]),
            ("mlp.fc1.bias", vec![f]),
            ("mlp.fc2.weight", vec![h, f]),
            ("mlp.fc2.bias", vec![h]),
        ],
        1,
    );
    let plan = ParallelizePlan::new()
        .with("*.fc1", ParallelStyle::Colwise)
        .with("*.fc2", ParallelStyle::Rowwise);
    let build = |p: &Parallelized| {
        let m = p.mlp("mlp.fc1", "mlp.fc2").unwrap();
        let [a, b] = m.layers();
        let layers = vec![
            ("mlp.fc1".to_string(), a.clone()),
            ("mlp.fc2".to_string(), b.clone()),
        ];
        (Box::new(m) as Box<dyn Module>, layers)
    };
    let reference = |p: &BTreeMap<String, Var>, x: &Tensor| {
        linear(p, "mlp.fc2", &linear(p, "mlp.fc1", x)?.gelu()?)
    };
    for world in [1, 2, 4] {
        compare(
            world,
            &full,
            &plan,
            &[2, 3, h],
            &build,
            &reference,
            "candle mlp",
        );
    }
}

#[test]
fn candle_attention_matches_one_process() {
    let (h, heads, seq) = (8, 4, 5);
    let mut spec = Vec::new();
    for n in ["q", "k", "v", "o"] {
        spec.push((format!("attn.{n}.weight"), vec![h, h]));
        spec.push((format!("attn.{n}.bias"), vec![h]));
    }
    let spec: Vec<(&str, Vec<usize>)> = spec.iter().map(|(n, s)| (n.as_str(), s.clone())).collect();
    let full = model(&spec, 20);
    let plan = ParallelizePlan::new()
        .with("attn.q", ParallelStyle::Colwise)
        .with("attn.k", ParallelStyle::Colwise)
        .with("attn.v", ParallelStyle::Colwise)
        .with("attn.o", ParallelStyle::Rowwise);
    for causal in [false, true] {
        let build = move |p: &Parallelized| {
            let a = p
                .attention(["attn.q", "attn.k", "attn.v", "attn.o"], heads, causal)
                .unwrap();
            let layers = ["attn.q", "attn.k", "attn.v", "attn.o"]
                .iter()
                .zip(a.layers())
                .map(|(n, l)| (n.to_string(), l.clone()))
                .collect();
            (Box::new(a) as Box<dyn Module>, layers)
        };
        let reference =
            move |p: &BTreeMap<String, Var>, x: &Tensor| -> candle_core::Result<Tensor> {
                let (b, s, _) = x.dims3()?;
                let d = h / heads;
                let split = |n: &str| {
                    linear(p, n, x)?
                        .reshape((b, s, heads, d))?
                        .transpose(1, 2)?
                        .contiguous()
                };
                let (q, k, v) = (split("attn.q")?, split("attn.k")?, split("attn.v")?);
                let mut sc = (q.matmul(&k.t()?.contiguous()?)? / (d as f64).sqrt())?;
                if causal {
                    let m: Vec<f32> = (0..s * s)
                        .map(|i| if i % s > i / s { -1e30 } else { 0.0 })
                        .collect();
                    sc = sc.broadcast_add(&Tensor::from_vec(m, (s, s), x.device())?)?;
                }
                let e = sc.exp()?;
                let pr = e.broadcast_div(&e.sum_keepdim(D::Minus1)?)?;
                let ctx = pr.matmul(&v)?.transpose(1, 2)?.reshape((b, s, h))?;
                linear(p, "attn.o", &ctx)
            };
        for world in [1, 2, 4] {
            compare(
                world,
                &full,
                &plan,
                &[2, seq, h],
                &build,
                &reference,
                &format!("candle attention causal {causal}"),
            );
        }
    }
}

#[test]
fn candle_sync_batch_norm_matches_the_flat_one_over_the_global_batch() {
    let (n, c, s) = (7usize, 3usize, 4usize);
    let per = c * s;
    let w: Vec<f32> = (0..c).map(|k| 0.5 + k as f32).collect();
    let b: Vec<f32> = (0..c).map(|k| k as f32 - 1.0).collect();
    let opts = BatchNormOptions::default();
    let steps = 2;
    // The flat layer on one rank over the whole batch.
    let want = run_world(1, |pg| {
        let mut bn = fresh_bn(pg, &w, &b, opts);
        let mut out = Vec::new();
        for step in 0..steps {
            let (y, saved) = bn.forward(&values(n * per, step), &[n, c, s]).unwrap();
            let g = bn.backward(&saved, &values(n * per, 50 + step)).unwrap();
            out.push((y, g, bn.running_mean.clone(), bn.running_var.clone()));
        }
        Ok(out)
    })
    .unwrap()
    .remove(0);
    for world in [2, 4] {
        let got = run_world(world, |pg| {
            let flat_bn = fresh_bn(pg.clone(), &w, &b, opts);
            let bn = CandleSyncBatchNorm::convert(&flat_bn, &Device::Cpu).unwrap();
            let rows = chunk_range(n, world, pg.rank());
            let mut out = Vec::new();
            for step in 0..steps {
                let part = rows.start * per..rows.end * per;
                let x = Var::from_slice(
                    &values(n * per, step)[part.clone()],
                    (rows.len(), c, s),
                    &Device::Cpu,
                )
                .unwrap();
                let dy = Tensor::from_slice(
                    &values(n * per, 50 + step)[part],
                    (rows.len(), c, s),
                    &Device::Cpu,
                )
                .unwrap();
                let before = pg.flight_recorder().len();
                let y = bn.forward(x.as_tensor()).unwrap();
                let g = (&y * &dy).unwrap().sum_all().unwrap().backward().unwrap();
                let ops: Vec<&str> = pg.flight_recorder()[before..]
                    .iter()
                    .map(|e| e.op)
                    .collect();
                assert_eq!(ops, ["all_reduce", "all_reduce"], "one all_reduce each way");
                let v = bn.vars();
                let mut dw = flat(g.get(v[0].as_tensor()).unwrap());
                let mut db = flat(g.get(v[1].as_tensor()).unwrap());
                pg.all_reduce(&mut dw, ReduceOp::Sum)?;
                pg.all_reduce(&mut db, ReduceOp::Sum)?;
                let (rm, rv, _) = bn.running_stats();
                out.push((
                    rows.clone(),
                    flat(&y),
                    flat(g.get(x.as_tensor()).unwrap()),
                    dw,
                    db,
                    rm,
                    rv,
                ));
            }
            Ok(out)
        })
        .unwrap();
        for (rank, steps_out) in got.iter().enumerate() {
            for (step, (rows, y, dx, dw, db, rm, rv)) in steps_out.iter().enumerate() {
                let (wy, wg, wrm, wrv) = &want[step];
                let part = rows.start * per..rows.end * per;
                let ctx = format!("candle bn world {world} rank {rank} step {step}");
                close(y, &wy[part.clone()], &format!("{ctx} output"));
                close(dx, &wg.input[part], &format!("{ctx} grad input"));
                close(dw, &wg.weight, &format!("{ctx} grad weight"));
                close(db, &wg.bias, &format!("{ctx} grad bias"));
                close(rm, wrm, &format!("{ctx} running_mean"));
                close(rv, wrv, &format!("{ctx} running_var"));
            }
        }
    }
}
