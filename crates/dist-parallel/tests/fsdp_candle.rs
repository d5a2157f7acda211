//! The candle adapter: a candle MLP trained with `CandleFsdp` at 2 and 3 ranks matches the
//! same candle model trained in one process, and a unit mixing dtypes is refused by name.
#![cfg(feature = "candle")]

use candle_core::{DType, Device, Tensor, Var};
use dist_collective::testing::run_world;
use dist_parallel::{CandleFsdp, FsdpOptions};

const DIMS: [usize; 4] = [6, 10, 7, 2];
const BATCH: usize = 6;

fn init() -> Vec<Vec<(String, Tensor)>> {
    let mut seed = 0x1234_5678u64;
    let mut next = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        ((seed >> 40) as f32 / (1u64 << 24) as f32) - 0.5
    };
    (0..DIMS.len() - 1)
        .map(|k| {
            let w: Vec<f32> = (0..DIMS[k] * DIMS[k + 1]).map(|_| next()).collect();
            let b: Vec<f32> = (0..DIMS[k + 1]).map(|_| next() * 0.1).collect();
            vec![
                (
                    format!("l{k}.weight"),
                    Tensor::from_vec(w, (DIMS[k + 1], DIMS[k]), &Device::Cpu).unwrap(),
                ),
                (
                    format!("l{k}.bias"),
                    Tensor::from_vec(b, DIMS[k + 1], &Device::Cpu).unwrap(),
                ),
            ]
        })
        .collect()
}

fn data(step: usize) -> (Tensor, Tensor) {
    let x: Vec<f32> = (0..BATCH * DIMS[0])
        .map(|i| ((i * 7 + step * 3) % 11) as f32 / 11.0 - 0.5)
        .collect();
    let t: Vec<f32> = (0..BATCH * DIMS[3])
        .map(|i| ((i * 5 + step) % 7) as f32 / 7.0)
        .collect();
    (
        Tensor::from_vec(x, (BATCH, DIMS[0]), &Device::Cpu).unwrap(),
        Tensor::from_vec(t, (BATCH, DIMS[3]), &Device::Cpu).unwrap(),
    )
}

fn block(x: &Tensor, w: &Tensor, b: &Tensor, last: bool) -> Tensor {
    let z = x.matmul(&w.t().unwrap()).unwrap().broadcast_add(b).unwrap();
    if last { z } else { z.tanh().unwrap() }
}

fn mse(y: &Tensor, t: &Tensor) -> Tensor {
    let n = y.dim(0).unwrap() as f64;
    ((y - t).unwrap().sqr().unwrap().sum_all().unwrap() * (0.5 / n)).unwrap()
}

#[test]
fn candle_fsdp_matches_one_process() {
    const LR: f64 = 0.1;
    // One process, plain candle autograd.
    let vars: Vec<Vec<Var>> = init()
        .iter()
        .map(|u| {
            u.iter()
                .map(|(_, t)| Var::from_tensor(t).unwrap())
                .collect()
        })
        .collect();
    for s in 0..5 {
        let (x, t) = data(s);
        let mut h = x;
        for (k, v) in vars.iter().enumerate() {
            h = block(&h, v[0].as_tensor(), v[1].as_tensor(), k + 1 == vars.len());
        }
        let g = mse(&h, &t).backward().unwrap();
        for v in vars.iter().flatten() {
            let d = g.get(v.as_tensor()).unwrap();
            v.set(&(v.as_tensor() - (d * LR).unwrap()).unwrap())
                .unwrap();
        }
    }
    let want: Vec<Vec<f32>> = vars
        .iter()
        .flatten()
        .map(|v| v.as_tensor().flatten_all().unwrap().to_vec1().unwrap())
        .collect();
    for world in [2, 3] {
        let got = run_world(world, |pg| {
            let mut f: CandleFsdp =
                CandleFsdp::new(pg.clone(), &init(), FsdpOptions::default(), &Device::Cpu).unwrap();
            let n = DIMS.len() - 1;
            for s in 0..5 {
                let (x, t) = data(s);
                let per = BATCH / world;
                let x = x.narrow(0, pg.rank() * per, per).unwrap();
                let t = t.narrow(0, pg.rank() * per, per).unwrap();
                // Forward keeps only each unit's (detached) input.
                let mut inputs = vec![x];
                for k in 0..n {
                    let v = f.pre_forward(k).unwrap();
                    let y = block(&inputs[k], v[0].as_tensor(), v[1].as_tensor(), k + 1 == n);
                    f.post_forward(k).unwrap();
                    inputs.push(y.detach());
                }
                // Backward recomputes each unit from its input with freshly gathered Vars.
                let mut upstream: Option<Tensor> = None;
                for k in (0..n).rev() {
                    let v = f.pre_backward(k).unwrap();
                    let xin = Var::from_tensor(&inputs[k]).unwrap();
                    let y = block(
                        xin.as_tensor(),
                        v[0].as_tensor(),
                        v[1].as_tensor(),
                        k + 1 == n,
                    );
                    let obj = match &upstream {
                        None => mse(&y, &t),
                        Some(g) => (y * g).unwrap().sum_all().unwrap(),
                    };
                    let grads = obj.backward().unwrap();
                    f.post_backward(k, &v, &grads).unwrap();
                    upstream = grads.get(xin.as_tensor()).map(|g| g.detach());
                }
                f.finish().unwrap();
                for s in f.inner_mut().shards_mut() {
                    s.param
                        .iter_mut()
                        .zip(s.grad.iter())
                        .for_each(|(p, g)| *p -= LR as f32 * g);
                }
                f.inner_mut().zero_grad();
            }
            let full = f.inner().full_state_dict(false).unwrap().unwrap();
            Ok(full.into_iter().map(|(_, v)| v).collect::<Vec<_>>())
        })
        .unwrap();
        for (r, m) in got.iter().enumerate() {
            for (a, b) in m.iter().zip(&want) {
                for (x, y) in a.iter().zip(b) {
                    assert!((x - y).abs() <= 1e-5, "world {world} rank {r}: {x} vs {y}");
                }
            }
        }
    }
}

#[test]
fn a_unit_mixing_dtypes_is_refused_by_name() {
    let e = run_world(2, |pg| {
        let mut units = init();
        units[1][1].1 = units[1][1].1.to_dtype(DType::BF16).unwrap();
        Ok(
            CandleFsdp::<f32>::new(pg.clone(), &units, FsdpOptions::default(), &Device::Cpu)
                .unwrap_err()
                .to_string(),
        )
    })
    .unwrap();
    assert!(
        e[0].contains("l1.bias") && e[0].contains("unit 1") && e[0].contains("BF16"),
        "{}",
        e[0]
    );
}
