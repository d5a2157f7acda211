//! The 2-D job's model and training loop, shared by the binary (launched by distrun) and the
//! test that holds it to one process.
//!
//! The mesh is `[("dp", world / tp), ("tp", tp)]`. Each residual block `h + W2 gelu(W1 h + b1)
//! + b2` is tensor parallel over its `tp` row (Megatron: `W1`, `b1` split by rows, `W2` by
//! columns, one all_reduce forward and one backward, through [`copy_to_group`] and
//! [`reduce_from_group`]); each rank's TP shards are then FSDP units over its `dp` column,
//! so FSDP gathers, reduce-scatters (averages) and steps only the TP shard its pair owns.
//! The input projection and the head are replicated over `tp` and sharded over `dp`.
//!
//! Gradients clipping is left out: FSDP's norm would count only the `dp` column, while the
//! TP shards of a pair hold different parts of the same parameters.

#![forbid(unsafe_code)]

use std::time::Instant;

use candle_core::{DType, Device, Tensor, Var};
use dist_collective::{DeviceMesh, ProcessGroup, ReduceOp};
use dist_parallel::candle_comm::{copy_to_group, reduce_from_group};
use dist_parallel::optim::{AdamW, AdamWState};
use dist_parallel::{CandleFsdp, FsdpOptions};
use toy_data::Rng;

/// The example's error type: any library error, boxed.
pub type Res<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

/// Sizes of the model and the run.
#[derive(Clone, Debug)]
pub struct Config {
    /// Input features.
    pub features: usize,
    /// Width of the residual stream.
    pub hidden: usize,
    /// Width inside each block (divisible by the tensor-parallel degree).
    pub ffn: usize,
    /// Output classes.
    pub classes: usize,
    /// Residual blocks.
    pub blocks: usize,
    /// Samples per step over all data-parallel ranks (divisible by their count).
    pub global_batch: usize,
    /// Samples in the generated data set.
    pub samples: usize,
    /// Training steps.
    pub steps: usize,
    /// Learning rate of AdamW.
    pub lr: f32,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            features: 64,
            hidden: 256,
            ffn: 1024,
            classes: 16,
            blocks: 4,
            global_batch: 128,
            samples: 8192,
            steps: 100,
            lr: 1e-3,
        }
    }
}

/// What one step reports.
#[derive(Clone, Copy, Debug)]
pub struct StepReport {
    /// Mean loss over the global batch.
    pub loss: f32,
    /// Global samples per second of this step.
    pub samples_per_s: f64,
}

/// Weights in `[-scale, scale)`, `rows x cols`, from `rng`.
fn matrix(rng: &mut Rng, rows: usize, cols: usize, scale: f32) -> Res<Tensor> {
    let v: Vec<f32> = (0..rows * cols).map(|_| rng.next_f32() * scale).collect();
    Ok(Tensor::from_vec(v, (rows, cols), &Device::Cpu)?)
}

/// The full model (the same on every rank) as units of named tensors: projection, blocks,
/// head.
fn full_model(c: &Config) -> Res<Vec<Vec<(String, Tensor)>>> {
    let mut s = Rng::new(0x5eed);
    let zeros = |n: usize| Tensor::zeros(n, DType::F32, &Device::Cpu);
    let (f, h, ffn) = (c.features as f32, c.hidden as f32, c.ffn as f32);
    let mut units = vec![vec![
        (
            "proj.weight".into(),
            matrix(&mut s, c.hidden, c.features, (1.0 / f).sqrt())?,
        ),
        ("proj.bias".into(), zeros(c.hidden)?),
    ]];
    for b in 0..c.blocks {
        units.push(vec![
            (
                format!("blocks.{b}.fc1.weight"),
                matrix(&mut s, c.ffn, c.hidden, (1.0 / h).sqrt())?,
            ),
            (format!("blocks.{b}.fc1.bias"), zeros(c.ffn)?),
            (
                format!("blocks.{b}.fc2.weight"),
                matrix(&mut s, c.hidden, c.ffn, 0.5 / ffn.sqrt())?,
            ),
            (format!("blocks.{b}.fc2.bias"), zeros(c.hidden)?),
        ]);
    }
    units.push(vec![
        (
            "head.weight".into(),
            matrix(&mut s, c.classes, c.hidden, (1.0 / h).sqrt())?,
        ),
        ("head.bias".into(), zeros(c.classes)?),
    ]);
    Ok(units)
}

/// This tensor-parallel rank's shard of each block (fc1 rows and bias, fc2 columns; fc2's
/// bias is added after the reduction, so every rank keeps it whole).
fn tp_shard(
    c: &Config,
    units: Vec<Vec<(String, Tensor)>>,
    tp: usize,
    r: usize,
) -> Res<Vec<Vec<(String, Tensor)>>> {
    let part = c.ffn / tp;
    let last = units.len() - 1;
    units
        .into_iter()
        .enumerate()
        .map(|(u, unit)| {
            if u == 0 || u == last {
                return Ok(unit);
            }
            unit.into_iter()
                .enumerate()
                .map(|(i, (name, t))| {
                    let t = match i {
                        0 | 1 => t.narrow(0, r * part, part)?.contiguous()?,
                        2 => t.narrow(1, r * part, part)?.contiguous()?,
                        _ => t,
                    };
                    Ok((name, t))
                })
                .collect()
        })
        .collect()
}

fn linear(x: &Tensor, w: &Var, b: &Var) -> candle_core::Result<Tensor> {
    x.matmul(&w.as_tensor().t()?)?.broadcast_add(b.as_tensor())
}

/// Unit `u`'s forward: projection, tensor-parallel residual block over `tp`, or head.
fn unit_forward(
    u: usize,
    units: usize,
    x: &Tensor,
    v: &[Var],
    tp: &ProcessGroup,
) -> candle_core::Result<Tensor> {
    if u == 0 || u + 1 == units {
        return linear(x, &v[0], &v[1]);
    }
    let h = linear(&copy_to_group(x, tp)?, &v[0], &v[1])?.gelu_erf()?;
    let partial = h.matmul(&v[2].as_tensor().t()?)?;
    x + reduce_from_group(&partial, tp)?.broadcast_add(v[3].as_tensor())?
}

/// Trains on the mesh `[("dp", world / tp), ("tp", tp)]` over `pg` and returns every step's
/// report (the same on every rank). `tp` must divide the world size and `config.ffn`.
pub fn train(pg: &ProcessGroup, tp: usize, c: &Config) -> Res<Vec<StepReport>> {
    let world = pg.world_size();
    if tp == 0 || !world.is_multiple_of(tp) || !c.ffn.is_multiple_of(tp) {
        return Err(format!(
            "rank {}: tp2d train: tp degree {tp} must divide the world size {world} and ffn {}",
            pg.rank(),
            c.ffn
        )
        .into());
    }
    let dp = world / tp;
    if !c.global_batch.is_multiple_of(dp) || c.global_batch > c.samples {
        return Err(format!(
            "rank {}: tp2d train: global batch {} must divide by dp {dp} and fit in {} samples",
            pg.rank(),
            c.global_batch,
            c.samples
        )
        .into());
    }
    let mesh = DeviceMesh::new(pg, &[("dp", dp), ("tp", tp)])?;
    let (dp_group, tp_group) = (mesh.dim("dp").clone(), mesh.dim("tp").clone());
    let (d, r) = (mesh.coordinate()[0], mesh.coordinate()[1]);
    let units = tp_shard(c, full_model(c)?, tp, r)?;
    let mut fsdp: CandleFsdp = CandleFsdp::new(
        dp_group.clone(),
        &units,
        FsdpOptions::default(),
        &Device::Cpu,
    )?;
    drop(units);
    let n = fsdp.inner().num_units();
    let adamw = AdamW {
        lr: c.lr,
        ..AdamW::default()
    };
    let mut states: Vec<AdamWState> = Vec::new();
    let (xs, ys) = toy_data::clusters(c.samples, c.features, c.classes, 6.0);
    let local = c.global_batch / dp;
    let mut reports = Vec::with_capacity(c.steps);
    for step in 0..c.steps {
        let t0 = Instant::now();
        // The global batch is consecutive samples; dp rank d reads its chunk of it, and both
        // ranks of a tp pair read the same one.
        let start = (step * c.global_batch) % (c.samples - c.global_batch + 1) + d * local;
        let x = Tensor::from_slice(
            &xs[start * c.features..(start + local) * c.features],
            (local, c.features),
            &Device::Cpu,
        )?;
        let y = Tensor::from_slice(&ys[start..start + local], local, &Device::Cpu)?;

        let mut inputs = vec![x];
        for u in 0..n {
            let v = fsdp.pre_forward(u)?;
            let out = unit_forward(u, n, &inputs[u], &v, &tp_group)?;
            fsdp.post_forward(u)?;
            inputs.push(out.detach());
        }
        let loss = candle_nn::loss::cross_entropy(&inputs[n], &y)?.to_scalar::<f32>()?;

        // Backward unit by unit from the saved inputs, as in fsdp-train.
        let mut upstream: Option<Tensor> = None;
        for u in (0..n).rev() {
            let v = fsdp.pre_backward(u)?;
            let xin = Var::from_tensor(&inputs[u])?;
            let out = unit_forward(u, n, xin.as_tensor(), &v, &tp_group)?;
            let objective = match &upstream {
                None => candle_nn::loss::cross_entropy(&out, &y)?,
                Some(g) => (out * g)?.sum_all()?,
            };
            let grads = objective.backward()?;
            fsdp.post_backward(u, &v, &grads)?;
            upstream = grads.get(xin.as_tensor()).map(Tensor::detach);
        }
        fsdp.finish()?;
        let shards = fsdp.inner_mut().shards_mut();
        if states.is_empty() {
            states = shards
                .iter()
                .map(|s| AdamWState::new(s.param.len()))
                .collect();
        }
        for (s, st) in shards.into_iter().zip(&mut states) {
            adamw.step(s.param, s.grad, st)?;
        }
        fsdp.inner_mut().zero_grad();

        let mut l = [loss];
        dp_group.all_reduce(&mut l, ReduceOp::Avg)?;
        reports.push(StepReport {
            loss: l[0],
            samples_per_s: c.global_batch as f64 / t0.elapsed().as_secs_f64(),
        });
    }
    Ok(reports)
}
