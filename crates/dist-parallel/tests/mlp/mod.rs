//! A deep MLP with a hand-written backward, the independent computation FSDP and DDP are
//! checked against: block k is `tanh(h W_k^T + b_k)` (the last block without tanh), the loss
//! is `0.5 * mean_batch ||y - t||^2`. Each block is one FSDP unit.
#![allow(dead_code)]

use dist_parallel::optim::{AdamW, AdamWState};
use dist_parallel::{ComputeElement, Ddp, Fsdp, ParamInfo};

/// Layer widths: 4 blocks whose rows split unevenly over 2, 3 and 4 ranks (9 over 4 leaves a
/// rank with none, 3 over 4 too).
pub(crate) const DIMS: [usize; 5] = [5, 9, 7, 9, 3];
/// Global batch (divisible by 1, 2 and 4).
pub(crate) const BATCH: usize = 8;

/// The parameters of each unit: weight then bias.
pub(crate) fn units(dims: &[usize]) -> Vec<Vec<ParamInfo>> {
    (0..dims.len() - 1)
        .map(|k| {
            vec![
                ParamInfo::new(format!("blocks.{k}.weight"), &[dims[k + 1], dims[k]]),
                ParamInfo::new(format!("blocks.{k}.bias"), &[dims[k + 1]]),
            ]
        })
        .collect()
}

/// A small deterministic generator (xorshift64*).
pub(crate) struct Rng(u64);

impl Rng {
    pub(crate) fn new(seed: u64) -> Self {
        Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1)
    }
    /// Uniform in [-1, 1).
    pub(crate) fn next(&mut self) -> f32 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        let x = (self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 40) as f32 / (1u64 << 24) as f32;
        2.0 * x - 1.0
    }
}

/// Initial values of every parameter, in unit order (weight, bias per block).
pub(crate) fn init(dims: &[usize], seed: u64) -> Vec<Vec<f32>> {
    let mut rng = Rng::new(seed);
    let mut out = Vec::new();
    for k in 0..dims.len() - 1 {
        let scale = 1.0 / (dims[k] as f32).sqrt();
        out.push(
            (0..dims[k] * dims[k + 1])
                .map(|_| rng.next() * scale)
                .collect(),
        );
        out.push((0..dims[k + 1]).map(|_| rng.next() * 0.1).collect());
    }
    out
}

/// Step `s`'s global batch: inputs `[BATCH, dims[0]]` and targets `[BATCH, dims.last()]`.
pub(crate) fn batch(dims: &[usize], s: usize, batch: usize) -> (Vec<f32>, Vec<f32>) {
    let mut rng = Rng::new(1000 + s as u64);
    let x = (0..batch * dims[0]).map(|_| rng.next()).collect();
    let t = (0..batch * dims[dims.len() - 1])
        .map(|_| rng.next())
        .collect();
    (x, t)
}

/// Rows `part` of `parts` of a `[batch, width]` matrix.
pub(crate) fn rows(m: &[f32], width: usize, part: usize, parts: usize) -> Vec<f32> {
    let n = m.len() / width / parts;
    m[part * n * width..(part + 1) * n * width].to_vec()
}

/// `tanh(h W^T + b)` (or without tanh), `h` is `[batch, din]`.
pub(crate) fn forward(
    w: &[f32],
    b: &[f32],
    h: &[f32],
    din: usize,
    dout: usize,
    act: bool,
) -> Vec<f32> {
    let batch = h.len() / din;
    let mut out = vec![0.0; batch * dout];
    for i in 0..batch {
        for j in 0..dout {
            let mut z = b[j];
            for k in 0..din {
                z += h[i * din + k] * w[j * din + k];
            }
            out[i * dout + j] = if act { z.tanh() } else { z };
        }
    }
    out
}

/// Gradients of one block: `(dW, db, dh)` from its input `h`, output `a` and `da`.
pub(crate) fn backward(
    w: &[f32],
    h: &[f32],
    a: &[f32],
    da: &[f32],
    din: usize,
    dout: usize,
    act: bool,
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let batch = h.len() / din;
    let dz: Vec<f32> = if act {
        da.iter().zip(a).map(|(g, y)| g * (1.0 - y * y)).collect()
    } else {
        da.to_vec()
    };
    let mut dw = vec![0.0; dout * din];
    let mut db = vec![0.0; dout];
    let mut dh = vec![0.0; batch * din];
    for i in 0..batch {
        for j in 0..dout {
            let g = dz[i * dout + j];
            db[j] += g;
            for k in 0..din {
                dw[j * din + k] += g * h[i * din + k];
                dh[i * din + k] += g * w[j * din + k];
            }
        }
    }
    (dw, db, dh)
}

/// Loss and gradient of the loss w.r.t. the output, for a batch that is `1/parts` of the
/// global one (so the ranks' average is the global mean's gradient).
pub(crate) fn loss(y: &[f32], t: &[f32], local_batch: usize) -> (f32, Vec<f32>) {
    let l = 0.5 * y.iter().zip(t).map(|(a, b)| (a - b) * (a - b)).sum::<f32>() / local_batch as f32;
    let g = y
        .iter()
        .zip(t)
        .map(|(a, b)| (a - b) / local_batch as f32)
        .collect();
    (l, g)
}

/// Forward and backward of the whole model on full parameters: loss and every gradient.
pub(crate) fn grads(dims: &[usize], p: &[Vec<f32>], x: &[f32], t: &[f32]) -> (f32, Vec<Vec<f32>>) {
    let n = dims.len() - 1;
    let mut acts = vec![x.to_vec()];
    for k in 0..n {
        let a = forward(
            &p[2 * k],
            &p[2 * k + 1],
            &acts[k],
            dims[k],
            dims[k + 1],
            k + 1 < n,
        );
        acts.push(a);
    }
    let (l, mut da) = loss(&acts[n], t, x.len() / dims[0]);
    let mut g = vec![Vec::new(); 2 * n];
    for k in (0..n).rev() {
        let (dw, db, dh) = backward(
            &p[2 * k],
            &acts[k],
            &acts[k + 1],
            &da,
            dims[k],
            dims[k + 1],
            k + 1 < n,
        );
        g[2 * k] = dw;
        g[2 * k + 1] = db;
        da = dh;
    }
    (l, g)
}

/// One process trains `steps` steps on the global batch with AdamW: the reference.
pub(crate) fn train_single(dims: &[usize], seed: u64, steps: usize, opt: AdamW) -> Vec<Vec<f32>> {
    let mut p = init(dims, seed);
    let mut st: Vec<AdamWState> = p.iter().map(|v| AdamWState::new(v.len())).collect();
    for s in 0..steps {
        let (x, t) = batch(dims, s, BATCH);
        let (_, g) = grads(dims, &p, &x, &t);
        for ((p, g), st) in p.iter_mut().zip(&g).zip(&mut st) {
            opt.step(p, g, st).unwrap();
        }
    }
    p
}

/// One FSDP forward and backward on this rank's batch `x`, `t`; returns the local loss.
pub(crate) fn fsdp_forward_backward<C: ComputeElement>(
    fsdp: &mut Fsdp<C>,
    dims: &[usize],
    x: &[f32],
    t: &[f32],
) -> f32 {
    let n = dims.len() - 1;
    let unit = |fsdp: &mut Fsdp<C>, u: usize, fwd: bool| -> (Vec<f32>, Vec<f32>) {
        let full: Vec<f32> = if fwd {
            fsdp.pre_forward(u)
                .unwrap()
                .iter()
                .map(|v| v.to_f32())
                .collect()
        } else {
            fsdp.pre_backward(u)
                .unwrap()
                .iter()
                .map(|v| v.to_f32())
                .collect()
        };
        (
            full[fsdp.param_range(u, 0)].to_vec(),
            full[fsdp.param_range(u, 1)].to_vec(),
        )
    };
    let mut acts = vec![x.to_vec()];
    for k in 0..n {
        let (w, b) = unit(fsdp, k, true);
        acts.push(forward(&w, &b, &acts[k], dims[k], dims[k + 1], k + 1 < n));
        fsdp.post_forward(k).unwrap();
    }
    let (l, mut da) = loss(&acts[n], t, x.len() / dims[0]);
    for k in (0..n).rev() {
        let (w, _) = unit(fsdp, k, false);
        let (dw, db, dh) = backward(
            &w,
            &acts[k],
            &acts[k + 1],
            &da,
            dims[k],
            dims[k + 1],
            k + 1 < n,
        );
        let g: Vec<C> = dw.iter().chain(&db).map(|&v| C::from_f32(v)).collect();
        fsdp.post_backward(k, &g).unwrap();
        da = dh;
    }
    l
}

/// AdamW on every local shard; `st` is created on first use.
pub(crate) fn fsdp_opt_step<C: ComputeElement>(
    fsdp: &mut Fsdp<C>,
    opt: AdamW,
    st: &mut Vec<AdamWState>,
) {
    let shards = fsdp.shards_mut();
    if st.is_empty() {
        st.extend(shards.iter().map(|s| AdamWState::new(s.param.len())));
    }
    for (s, st) in shards.into_iter().zip(st.iter_mut()) {
        opt.step(s.param, s.grad, st).unwrap();
    }
    fsdp.zero_grad();
}

/// One DDP step (forward, backward with gradients marked last layer first, AdamW).
pub(crate) fn ddp_step(
    ddp: &mut Ddp,
    dims: &[usize],
    p: &mut [Vec<f32>],
    st: &mut [AdamWState],
    x: &[f32],
    t: &[f32],
    opt: AdamW,
) {
    let (_, mut g) = grads(dims, p, x, t);
    for i in (0..g.len()).rev() {
        ddp.mark_ready(i, &g[i]).unwrap();
    }
    let mut gs: Vec<&mut [f32]> = g.iter_mut().map(|v| v.as_mut_slice()).collect();
    ddp.finish(&mut gs).unwrap();
    for ((p, g), st) in p.iter_mut().zip(&g).zip(st.iter_mut()) {
        opt.step(p, g, st).unwrap();
    }
}

/// Largest absolute difference between two models.
pub(crate) fn max_diff(a: &[Vec<f32>], b: &[Vec<f32>]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .flat_map(|(x, y)| {
            assert_eq!(x.len(), y.len());
            x.iter().zip(y).map(|(p, q)| (p - q).abs())
        })
        .fold(0.0, f32::max)
}
