//! Tensor parallelism at 1, 2 and 4 ranks against one process: a plain dense f64 model written
//! here gives the forward, and central finite differences of its loss give every gradient
//! (so the reference shares no backward code with the layers). Also: collectives per step,
//! sequence parallelism with uneven token splits, plan errors.

mod numeric;

use std::collections::BTreeMap;

use dist_collective::testing::run_world;
use dist_collective::{DTensor, DeviceMesh, Placement};
use numeric::{close, values};

use dist_parallel::tp::{
    FullParam, ParallelStyle, ParallelizePlan, TpAttention, TpLayerNorm, TpLinear, TpMlp,
};

type Params = BTreeMap<String, (Vec<usize>, Vec<f64>)>;

fn params(spec: &[(&str, &[usize])], seed: u64) -> Params {
    spec.iter()
        .enumerate()
        .map(|(i, (n, s))| {
            (
                n.to_string(),
                (s.to_vec(), values(s.iter().product(), seed + i as u64)),
            )
        })
        .collect()
}

fn linear(p: &Params, name: &str, x: &[f64]) -> Vec<f64> {
    let (s, w) = &p[&format!("{name}.weight")];
    let b = &p[&format!("{name}.bias")].1;
    let (o, i) = (s[0], s[1]);
    x.chunks(i)
        .flat_map(|row| {
            (0..o).map(move |j| b[j] + (0..i).map(|k| row[k] * w[j * i + k]).sum::<f64>())
        })
        .collect()
}

fn gelu(x: f64) -> f64 {
    0.5 * x * (1.0 + (0.797_884_560_802_865_4 * (x + 0.044715 * x * x * x)).tanh())
}

fn mlp_ref(p: &Params, x: &[f64]) -> Vec<f64> {
    let h: Vec<f64> = linear(p, "fc1", x).into_iter().map(gelu).collect();
    linear(p, "fc2", &h)
}

fn attn_ref(
    p: &Params,
    x: &[f64],
    hidden: usize,
    heads: usize,
    seq: usize,
    causal: bool,
) -> Vec<f64> {
    let (q, k, v) = (linear(p, "q", x), linear(p, "k", x), linear(p, "v", x));
    let d = hidden / heads;
    let t = x.len() / hidden;
    let mut ctx = vec![0.0; t * hidden];
    for b in 0..t / seq {
        for h in 0..heads {
            for i in 0..seq {
                let at = |m: &[f64], r: usize, c: usize| m[(b * seq + r) * hidden + h * d + c];
                let n = if causal { i + 1 } else { seq };
                let sc: Vec<f64> = (0..n)
                    .map(|j| {
                        (0..d).map(|c| at(&q, i, c) * at(&k, j, c)).sum::<f64>() / (d as f64).sqrt()
                    })
                    .collect();
                let m = sc.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let z: f64 = sc.iter().map(|s| (s - m).exp()).sum();
                for c in 0..d {
                    ctx[(b * seq + i) * hidden + h * d + c] =
                        (0..n).map(|j| (sc[j] - m).exp() / z * at(&v, j, c)).sum();
                }
            }
        }
    }
    linear(p, "o", &ctx)
}

fn layer_norm(p: &Params, x: &[f64]) -> Vec<f64> {
    let w = &p["norm.weight"].1;
    let b = &p["norm.bias"].1;
    let h = w.len();
    x.chunks(h)
        .flat_map(|r| {
            let m = r.iter().sum::<f64>() / h as f64;
            let var = r.iter().map(|v| (v - m).powi(2)).sum::<f64>() / h as f64;
            (0..h).map(move |j| (r[j] - m) / (var + 1e-5).sqrt() * w[j] + b[j])
        })
        .collect()
}

/// Gradients of `Σ f(p, x)·r` for every parameter and for `x`, by central differences.
fn fd_grads(
    p: &Params,
    x: &[f64],
    r: &[f64],
    f: &dyn Fn(&Params, &[f64]) -> Vec<f64>,
) -> (Params, Vec<f64>) {
    let loss = |p: &Params, x: &[f64]| f(p, x).iter().zip(r).map(|(a, b)| a * b).sum::<f64>();
    let h = 1e-5;
    let mut grads = p.clone();
    for (name, (_, g)) in grads.iter_mut() {
        for (i, gi) in g.iter_mut().enumerate() {
            let mut pp = p.clone();
            pp.get_mut(name).unwrap().1[i] += h;
            let up = loss(&pp, x);
            pp.get_mut(name).unwrap().1[i] -= 2.0 * h;
            *gi = (up - loss(&pp, x)) / (2.0 * h);
        }
    }
    let dx = (0..x.len())
        .map(|i| {
            let mut xx = x.to_vec();
            xx[i] += h;
            let up = loss(p, &xx);
            xx[i] -= 2.0 * h;
            (up - loss(p, &xx)) / (2.0 * h)
        })
        .collect();
    (grads, dx)
}

fn f32s(v: &[f64]) -> Vec<f32> {
    v.iter().map(|&x| x as f32).collect()
}

/// Shards `p` by `plan` and builds the layers named `names` (in order).
fn layers(plan: &ParallelizePlan, mesh: &DeviceMesh, p: &Params, names: &[&str]) -> Vec<TpLinear> {
    let full: Vec<(String, Vec<usize>, Vec<f32>)> = p
        .iter()
        .map(|(n, (s, v))| (n.clone(), s.clone(), f32s(v)))
        .collect();
    let fp: Vec<FullParam<'_>> = full
        .iter()
        .map(|(n, s, v)| FullParam {
            name: n,
            shape: s,
            values: v,
        })
        .collect();
    let mut sharded: BTreeMap<String, DTensor<f32>> =
        plan.distribute(mesh, &fp).unwrap().into_iter().collect();
    names
        .iter()
        .map(|n| {
            let style = plan.style_for(n).unwrap();
            let w = sharded.remove(&format!("{n}.weight")).unwrap();
            let b = sharded.remove(&format!("{n}.bias"));
            TpLinear::new(style, w, b).unwrap()
        })
        .collect()
}

/// Every gradient of `layer` gathered to the full tensor, keyed as in the reference.
fn full_grads(name: &str, layer: &TpLinear, out: &mut BTreeMap<String, Vec<f32>>) {
    let g = layer.grads().unwrap();
    out.insert(format!("{name}.weight"), g[0].full_tensor().unwrap());
    out.insert(format!("{name}.bias"), g[1].full_tensor().unwrap());
}

fn check_grads(got: &BTreeMap<String, Vec<f32>>, want: &Params, ctx: &str) {
    assert_eq!(got.len(), want.len(), "{ctx}");
    for (n, (_, w)) in want {
        close(&got[n], w, &format!("{ctx} grad {n}"));
    }
}

/// Output, input gradient, gathered parameter gradients and the tp group's collectives of
/// one rank's step.
type RankStep = (
    Vec<f32>,
    Vec<f32>,
    BTreeMap<String, Vec<f32>>,
    Vec<&'static str>,
);

/// Every rank's step against the reference: one all_reduce each way, all values close.
fn check_ranks(out: &[RankStep], y_ref: &[f64], dx_ref: &[f64], g_ref: &Params, what: &str) {
    for (rank, (y, dx, grads, ops)) in out.iter().enumerate() {
        let ctx = format!("{what} rank {rank}");
        assert_eq!(
            ops,
            &["all_reduce", "all_reduce"],
            "{ctx}: collectives per step"
        );
        close(y, y_ref, &format!("{ctx} output"));
        close(dx, dx_ref, &format!("{ctx} grad input"));
        check_grads(grads, g_ref, &ctx);
    }
}

fn tp_ops(mesh: &DeviceMesh, before: usize) -> Vec<&'static str> {
    mesh.dim_group(0).flight_recorder()[before..]
        .iter()
        .map(|e| e.op)
        .collect()
}

#[test]
fn mlp_matches_one_process_and_uses_one_all_reduce_each_way() {
    let (t, h, f) = (6, 8, 10); // ffn 10 splits 3,3,3,1 over 4 ranks
    let p = params(
        &[
            ("fc1.weight", &[f, h]),
            ("fc1.bias", &[f]),
            ("fc2.weight", &[h, f]),
            ("fc2.bias", &[h]),
        ],
        1,
    );
    let x = values(t * h, 10);
    let r = values(t * h, 11);
    let y_ref = mlp_ref(&p, &x);
    let (g_ref, dx_ref) = fd_grads(&p, &x, &r, &mlp_ref);
    let plan = ParallelizePlan::new()
        .with("fc1", ParallelStyle::Colwise)
        .with("fc2", ParallelStyle::Rowwise);
    for world in [1, 2, 4] {
        let out = run_world(world, |pg| {
            let mesh = DeviceMesh::new(&pg, &[("tp", world)])?;
            let [fc1, fc2]: [TpLinear; 2] = layers(&plan, &mesh, &p, &["fc1", "fc2"])
                .try_into()
                .unwrap();
            let mut mlp = TpMlp::new(fc1, fc2, false).unwrap();
            let before = mesh.dim_group(0).flight_recorder().len();
            let (y, saved) = mlp.forward(&f32s(&x), t).unwrap();
            let dx = mlp.backward(&saved, &f32s(&r)).unwrap();
            let ops = tp_ops(&mesh, before);
            let mut grads = BTreeMap::new();
            full_grads("fc1", mlp.fc1(), &mut grads);
            full_grads("fc2", mlp.fc2(), &mut grads);
            Ok((y, dx, grads, ops))
        })
        .unwrap();
        check_ranks(&out, &y_ref, &dx_ref, &g_ref, &format!("mlp world {world}"));
    }
}

#[test]
fn attention_matches_one_process_and_uses_one_all_reduce_each_way() {
    let (batch, seq, h, heads) = (2, 3, 8, 4);
    let t = batch * seq;
    let mut spec: Vec<(String, Vec<usize>)> = Vec::new();
    for n in ["q", "k", "v", "o"] {
        spec.push((format!("{n}.weight"), vec![h, h]));
        spec.push((format!("{n}.bias"), vec![h]));
    }
    let spec: Vec<(&str, &[usize])> = spec.iter().map(|(n, s)| (n.as_str(), &s[..])).collect();
    let p = params(&spec, 20);
    let x = values(t * h, 30);
    let r = values(t * h, 31);
    let plan = ParallelizePlan::new().with("[qkv]", ParallelStyle::Colwise);
    // No character classes in the plan's patterns: list them.
    assert!(plan.style_for("q").is_none());
    let plan = ParallelizePlan::new()
        .with("q", ParallelStyle::Colwise)
        .with("k", ParallelStyle::Colwise)
        .with("v", ParallelStyle::Colwise)
        .with("o", ParallelStyle::Rowwise);
    for causal in [false, true] {
        let f = |p: &Params, x: &[f64]| attn_ref(p, x, h, heads, seq, causal);
        let y_ref = f(&p, &x);
        let (g_ref, dx_ref) = fd_grads(&p, &x, &r, &f);
        for world in [1, 2, 4] {
            let out = run_world(world, |pg| {
                let mesh = DeviceMesh::new(&pg, &[("tp", world)])?;
                let l: [TpLinear; 4] = layers(&plan, &mesh, &p, &["q", "k", "v", "o"])
                    .try_into()
                    .unwrap();
                let mut attn = TpAttention::new(l, heads, causal, false).unwrap();
                let before = mesh.dim_group(0).flight_recorder().len();
                let (y, saved) = attn.forward(&f32s(&x), t, seq).unwrap();
                let dx = attn.backward(&saved, &f32s(&r)).unwrap();
                let ops = tp_ops(&mesh, before);
                let mut grads = BTreeMap::new();
                for (n, l) in ["q", "k", "v", "o"].iter().zip(attn.layers()) {
                    full_grads(n, l, &mut grads);
                }
                Ok((y, dx, grads, ops))
            })
            .unwrap();
            let what = format!("attention causal {causal} world {world}");
            check_ranks(&out, &y_ref, &dx_ref, &g_ref, &what);
        }
    }
}

/// `x + mlp(norm(x))` with the tokens split over the ranks (7 tokens: 4+3, 2+2+2+1).
#[test]
fn sequence_parallel_norm_and_mlp_match_one_process() {
    let (t, h, f) = (7, 6, 8);
    let p = params(
        &[
            ("fc1.weight", &[f, h]),
            ("fc1.bias", &[f]),
            ("fc2.weight", &[h, f]),
            ("fc2.bias", &[h]),
            ("norm.weight", &[h]),
            ("norm.bias", &[h]),
        ],
        40,
    );
    let x = values(t * h, 50);
    let r = values(t * h, 51);
    let block = |p: &Params, x: &[f64]| -> Vec<f64> {
        let y = mlp_ref(p, &layer_norm(p, x));
        y.iter().zip(x).map(|(a, b)| a + b).collect()
    };
    let y_ref = block(&p, &x);
    let (g_ref, dx_ref) = fd_grads(&p, &x, &r, &block);
    let plan = ParallelizePlan::new()
        .with("fc1", ParallelStyle::Colwise)
        .with("fc2", ParallelStyle::Rowwise)
        .with("norm", ParallelStyle::SequenceParallel);
    for world in [1, 2, 4] {
        let out = run_world(world, |pg| {
            let mesh = DeviceMesh::new(&pg, &[("tp", world)])?;
            let rows = dist_collective::chunk_range(t, world, pg.rank());
            let mine = |v: &[f64]| f32s(&v[rows.start * h..rows.end * h]);
            let [fc1, fc2]: [TpLinear; 2] = layers(&plan, &mesh, &p, &["fc1", "fc2"])
                .try_into()
                .unwrap();
            let mut mlp = TpMlp::new(fc1, fc2, true).unwrap();
            let mut norm = TpLayerNorm::new(
                &mesh,
                f32s(&p["norm.weight"].1),
                f32s(&p["norm.bias"].1),
                1e-5,
                true,
            )
            .unwrap();
            let before = mesh.dim_group(0).flight_recorder().len();
            let xl = mine(&x);
            let (n, ns) = norm.forward(&xl).unwrap();
            let (m, ms) = mlp.forward(&n, t).unwrap();
            let y: Vec<f32> = m.iter().zip(&xl).map(|(a, b)| a + b).collect();
            let dy = mine(&r);
            let dn = mlp.backward(&ms, &dy).unwrap();
            let mut dx = norm.backward(&ns, &dn).unwrap();
            for (a, b) in dx.iter_mut().zip(&dy) {
                *a += b;
            }
            let (gw, gb) = norm.reduce_grads().unwrap();
            let ops = tp_ops(&mesh, before);
            let mut grads = BTreeMap::new();
            full_grads("fc1", mlp.fc1(), &mut grads);
            full_grads("fc2", mlp.fc2(), &mut grads);
            grads.insert("norm.weight".into(), gw);
            grads.insert("norm.bias".into(), gb);
            Ok((rows, y, dx, grads, ops))
        })
        .unwrap();
        for (rank, (rows, y, dx, grads, ops)) in out.iter().enumerate() {
            let ctx = format!("sequence parallel world {world} rank {rank}");
            assert_eq!(
                ops,
                &[
                    "all_gather",
                    "reduce_scatter",
                    "all_gather",
                    "reduce_scatter",
                    "all_reduce"
                ],
                "{ctx}"
            );
            let part = rows.start * h..rows.end * h;
            close(y, &y_ref[part.clone()], &format!("{ctx} output"));
            close(dx, &dx_ref[part], &format!("{ctx} grad input"));
            check_grads(grads, &g_ref, &ctx);
        }
    }
}

#[test]
fn bad_plans_and_shapes_are_errors() {
    run_world(2, |pg| {
        let mesh = DeviceMesh::new(&pg, &[("tp", 2)])?;
        let w = vec![0.5f32; 12];
        let b = vec![0.0f32; 4];
        let fp = [
            FullParam {
                name: "fc1.weight",
                shape: &[4, 3],
                values: &w,
            },
            FullParam {
                name: "fc1.bias",
                shape: &[4],
                values: &b,
            },
        ];
        let e = ParallelizePlan::new()
            .with("fc9", ParallelStyle::Colwise)
            .distribute(&mesh, &fp)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains(&format!("rank {}", pg.rank())) && e.contains("\"fc9\" matches no layer"),
            "{e}"
        );
        // A 2-D mesh is refused (tensor parallelism is one mesh dimension).
        let mesh2 = DeviceMesh::new(&pg, &[("dp", 1), ("tp", 2)])?;
        assert!(ParallelizePlan::new().distribute(&mesh2, &fp).is_err());
        // Wrong placements for the style.
        let wt = DTensor::distribute_tensor(&w, &[4, 3], &mesh, &[Placement::Shard(1)])?;
        let e = TpLinear::new(ParallelStyle::Colwise, wt, None)
            .unwrap_err()
            .to_string();
        assert!(e.contains("TpLinear::new") && e.contains("Shard(0)"), "{e}");
        // Wrong activation sizes.
        let fc1 = TpLinear::from_full(ParallelStyle::Colwise, &mesh, &w, [4, 3], Some(&b)).unwrap();
        let w2 = vec![0.5f32; 12];
        let fc2 = TpLinear::from_full(ParallelStyle::Rowwise, &mesh, &w2, [3, 4], None).unwrap();
        let mlp = TpMlp::new(fc1.clone(), fc2.clone(), false).unwrap();
        let e = mlp.forward(&[0.0; 7], 2).unwrap_err().to_string();
        assert!(
            e.contains("TpMlp::forward") && e.contains("7 elements"),
            "{e}"
        );
        assert!(TpMlp::new(fc2, fc1, false).is_err());
        // Heads that straddle ranks: 3 heads of 2 over 2 ranks (chunks of 3 columns).
        let sq = vec![0.1f32; 36];
        let l = |s| TpLinear::from_full(s, &mesh, &sq, [6, 6], None).unwrap();
        let c = ParallelStyle::Colwise;
        let e = TpAttention::new(
            [l(c), l(c), l(c), l(ParallelStyle::Rowwise)],
            3,
            false,
            false,
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("whole heads"), "{e}");
        Ok(())
    })
    .unwrap();
}

/// Data parallel across pairs, tensor parallel within them, on a 2x2 mesh: each `dp` replica
/// runs the TP MLP on its half of the batch over the `tp` sub-mesh, and the parameter
/// gradients are summed over `dp`; the result equals one process over the whole batch.
#[test]
fn mlp_on_a_2d_mesh_dp_by_tp_matches_one_process() {
    let (t, h, f) = (8, 6, 10);
    let p = params(
        &[
            ("fc1.weight", &[f, h]),
            ("fc1.bias", &[f]),
            ("fc2.weight", &[h, f]),
            ("fc2.bias", &[h]),
        ],
        60,
    );
    let x = values(t * h, 70);
    let r = values(t * h, 71);
    let y_ref = mlp_ref(&p, &x);
    let (g_ref, dx_ref) = fd_grads(&p, &x, &r, &mlp_ref);
    let plan = ParallelizePlan::new()
        .with("fc1", ParallelStyle::Colwise)
        .with("fc2", ParallelStyle::Rowwise);
    let out = run_world(4, |pg| {
        let mesh = DeviceMesh::new(&pg, &[("dp", 2), ("tp", 2)])?;
        let tp = mesh.sub_mesh("tp").expect("tp dimension");
        let half = mesh.coordinate()[0] * (t / 2) * h..(mesh.coordinate()[0] + 1) * (t / 2) * h;
        let [fc1, fc2]: [TpLinear; 2] = layers(&plan, &tp, &p, &["fc1", "fc2"]).try_into().unwrap();
        let mut mlp = TpMlp::new(fc1, fc2, false).unwrap();
        let (y, saved) = mlp.forward(&f32s(&x[half.clone()]), t / 2).unwrap();
        let dx = mlp.backward(&saved, &f32s(&r[half.clone()])).unwrap();
        let mut grads = BTreeMap::new();
        for (name, l) in [("fc1", mlp.fc1()), ("fc2", mlp.fc2())] {
            for (leaf, g) in ["weight", "bias"].iter().zip(l.grads().unwrap()) {
                // Sum this shard's gradient over the data-parallel replicas, then gather.
                let mut local = g.to_local().to_vec();
                mesh.dim("dp")
                    .all_reduce(&mut local, dist_collective::ReduceOp::Sum)?;
                let g = DTensor::from_local(local, g.shape(), &tp, g.placements())?;
                grads.insert(format!("{name}.{leaf}"), g.full_tensor()?);
            }
        }
        Ok((half, y, dx, grads))
    })
    .unwrap();
    for (rank, (half, y, dx, grads)) in out.iter().enumerate() {
        let ctx = format!("dp x tp rank {rank}");
        close(y, &y_ref[half.clone()], &format!("{ctx} output"));
        close(dx, &dx_ref[half.clone()], &format!("{ctx} grad input"));
        check_grads(grads, &g_ref, &ctx);
    }
}
