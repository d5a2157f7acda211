//! Trains a residual MLP of several blocks with [candle](https://github.com/huggingface/candle)
//! and `dist` FSDP, one process per rank, on a data set generated deterministically (labels
//! from a fixed random teacher network, no download). Launch with distrun, like ddp-train:
//!
//! ```text
//! cargo build --release -p fsdp-train -p dist-run
//! ./target/release/distrun --nproc-per-node 4 -- ./target/release/fsdp-train
//! ```
//!
//! Every block is one FSDP unit (the input projection and the head are units too): a unit's
//! parameters are gathered just before its forward and dropped after it, gathered again for
//! its backward, which recomputes the unit from its saved input, and its gradients are
//! reduce-scattered into the shards while earlier units differentiate. AdamW steps only the
//! local shards. Environment: `FSDP_TRAIN_STEPS` (default 100), `FSDP_BLOCKS` (default 6),
//! `FSDP_RESHARD=0` to keep parameters from forward to backward, `FSDP_CKPT_DIR` to save a
//! sharded checkpoint (parameters and AdamW moments) at the end.

#![forbid(unsafe_code)]
use std::path::Path;
use std::time::Instant;

use candle_core::{DType, Device, Tensor, Var};
use dist_collective::{InitOptions, ProcessGroup, ReduceOp, init_process_group};
use dist_parallel::checkpoint::{self, LocalTensor};
use dist_parallel::optim::{AdamW, AdamWState};
use dist_parallel::{CandleFsdp, FsdpOptions};

const FEATURES: usize = 64;
const HIDDEN: usize = 256;
const FFN: usize = 1024;
const CLASSES: usize = 16;
const SAMPLES: usize = 8192;
const LOCAL_BATCH: usize = 64;

type Res<T> = Result<T, Box<dyn std::error::Error>>;

/// Deterministic splitmix64 stream in [-1, 1).
struct Stream(u64);

impl Stream {
    fn uniform(&mut self) -> f32 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^= z >> 31;
        (z >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }

    fn matrix(&mut self, rows: usize, cols: usize, scale: f32) -> Res<Tensor> {
        let v: Vec<f32> = (0..rows * cols).map(|_| self.uniform() * scale).collect();
        Ok(Tensor::from_vec(v, (rows, cols), &Device::Cpu)?)
    }
}

/// Inputs uniform in [-1, 1); each label is the argmax of a fixed random linear teacher.
fn dataset() -> (Vec<f32>, Vec<u32>) {
    let mut s = Stream(0xda7a);
    let teacher: Vec<f32> = (0..FEATURES * CLASSES).map(|_| s.uniform()).collect();
    let xs: Vec<f32> = (0..SAMPLES * FEATURES).map(|_| s.uniform()).collect();
    let ys = xs
        .chunks(FEATURES)
        .map(|x| {
            let score =
                |c: usize| -> f32 { (0..FEATURES).map(|f| x[f] * teacher[f * CLASSES + c]).sum() };
            (0..CLASSES)
                .max_by(|&a, &b| score(a).total_cmp(&score(b)))
                .unwrap_or(0) as u32
        })
        .collect();
    (xs, ys)
}

/// The model as FSDP units of named initial tensors: an input projection, `blocks` residual
/// blocks `h + W2 relu(W1 h + b1) + b2`, and a classifier head.
fn model(blocks: usize) -> Res<Vec<Vec<(String, Tensor)>>> {
    let mut s = Stream(0x5eed);
    let zeros = |n: usize| Tensor::zeros(n, DType::F32, &Device::Cpu);
    let mut units = vec![vec![
        (
            "proj.weight".to_string(),
            s.matrix(HIDDEN, FEATURES, (1.0 / FEATURES as f32).sqrt())?,
        ),
        ("proj.bias".to_string(), zeros(HIDDEN)?),
    ]];
    for b in 0..blocks {
        units.push(vec![
            (
                format!("blocks.{b}.fc1.weight"),
                s.matrix(FFN, HIDDEN, (1.0 / HIDDEN as f32).sqrt())?,
            ),
            (format!("blocks.{b}.fc1.bias"), zeros(FFN)?),
            (
                format!("blocks.{b}.fc2.weight"),
                s.matrix(HIDDEN, FFN, 0.5 / (FFN as f32).sqrt())?,
            ),
            (format!("blocks.{b}.fc2.bias"), zeros(HIDDEN)?),
        ]);
    }
    units.push(vec![
        (
            "head.weight".to_string(),
            s.matrix(CLASSES, HIDDEN, (1.0 / HIDDEN as f32).sqrt())?,
        ),
        ("head.bias".to_string(), zeros(CLASSES)?),
    ]);
    Ok(units)
}

fn linear(x: &Tensor, w: &Var, b: &Var) -> candle_core::Result<Tensor> {
    x.matmul(&w.as_tensor().t()?)?.broadcast_add(b.as_tensor())
}

/// Unit `u`'s forward: projection, residual block or head.
fn unit_forward(u: usize, units: usize, x: &Tensor, v: &[Var]) -> candle_core::Result<Tensor> {
    if u == 0 || u + 1 == units {
        return linear(x, &v[0], &v[1]);
    }
    let h = linear(x, &v[0], &v[1])?.relu()?;
    x + linear(&h, &v[2], &v[3])?
}

fn main() -> Res<()> {
    let pg: ProcessGroup =
        init_process_group(InitOptions::new().backend("gloo").init_method("env://"))?;
    let (rank, world) = (pg.rank(), pg.world_size());
    let env = |k: &str, d: usize| {
        std::env::var(k)
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(d)
    };
    let steps = env("FSDP_TRAIN_STEPS", 100);
    let blocks = env("FSDP_BLOCKS", 6);
    let opts = FsdpOptions {
        reshard_after_forward: env("FSDP_RESHARD", 1) != 0,
        ..FsdpOptions::default()
    };
    let units = model(blocks)?;
    let nparams: usize = units.iter().flatten().map(|(_, t)| t.elem_count()).sum();
    let mut fsdp: CandleFsdp = CandleFsdp::new(pg.clone(), &units, opts.clone(), &Device::Cpu)?;
    drop(units);
    let n = fsdp.inner().num_units();
    if rank == 0 {
        let m = fsdp.inner().memory();
        println!(
            "FSDP: {world} ranks, {n} units, {nparams} parameters ({:.1} MiB), {:.1} MiB of parameter shards per rank, reshard_after_forward={}",
            nparams as f64 * 4.0 / (1 << 20) as f64,
            m.param_shards as f64 / (1 << 20) as f64,
            opts.reshard_after_forward
        );
    }
    let adamw = AdamW {
        lr: 1e-3,
        ..AdamW::default()
    };
    let mut states: Vec<AdamWState> = Vec::new();

    let (xs, ys) = dataset();
    // Each rank reads its own shard of the samples (DistributedSampler).
    let shard: Vec<usize> = (rank..SAMPLES).step_by(world).collect();
    let started = Instant::now();
    for step in 0..steps {
        let t0 = Instant::now();
        let at = (step * LOCAL_BATCH) % (shard.len() - LOCAL_BATCH);
        let idx = &shard[at..at + LOCAL_BATCH];
        let bx: Vec<f32> = idx
            .iter()
            .flat_map(|&i| xs[i * FEATURES..(i + 1) * FEATURES].iter().copied())
            .collect();
        let by: Vec<u32> = idx.iter().map(|&i| ys[i]).collect();
        let x = Tensor::from_vec(bx, (LOCAL_BATCH, FEATURES), &Device::Cpu)?;
        let y = Tensor::from_vec(by, LOCAL_BATCH, &Device::Cpu)?;

        // Forward: keep each unit's input only; the unit's Vars and graph go with it.
        let mut inputs = vec![x];
        for u in 0..n {
            let v = fsdp.pre_forward(u)?;
            let out = unit_forward(u, n, &inputs[u], &v)?;
            fsdp.post_forward(u)?;
            inputs.push(out.detach());
        }
        let loss = candle_nn::loss::cross_entropy(&inputs[n], &y)?.to_scalar::<f32>()?;

        // Backward, last unit first: recompute the unit, differentiate it, hand its gradients
        // to FSDP (the reduce-scatter runs while earlier units go on).
        let mut upstream: Option<Tensor> = None;
        for u in (0..n).rev() {
            let v = fsdp.pre_backward(u)?;
            let xin = Var::from_tensor(&inputs[u])?;
            let out = unit_forward(u, n, xin.as_tensor(), &v)?;
            let objective = match &upstream {
                None => candle_nn::loss::cross_entropy(&out, &y)?,
                Some(g) => (out * g)?.sum_all()?,
            };
            let grads = objective.backward()?;
            fsdp.post_backward(u, &v, &grads)?;
            upstream = grads.get(xin.as_tensor()).map(Tensor::detach);
        }
        let stats = fsdp.finish()?;
        let norm = fsdp.inner_mut().clip_grad_norm(1.0)?;
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
        pg.all_reduce(&mut l, ReduceOp::Avg)?;
        let dt = t0.elapsed().as_secs_f64();
        if rank == 0 && (step % 10 == 0 || step + 1 == steps) {
            println!(
                "step {step:>4}  loss {:.4}  grad norm {norm:>7.3}  {:>8.0} samples/s  comm {:>6.2} ms  hidden behind compute {:>5.1}%",
                l[0],
                (LOCAL_BATCH * world) as f64 / dt,
                stats.comm.as_secs_f64() * 1e3,
                stats.hidden_fraction() * 100.0
            );
        }
    }
    if let Ok(dir) = std::env::var("FSDP_CKPT_DIR") {
        let inner = fsdp.inner_mut();
        let coord = inner.coordinate().to_vec();
        let mut tensors = inner.sharded_state();
        for (s, st) in inner.shards_mut().into_iter().zip(&states) {
            tensors.push(LocalTensor::new(
                format!("{}.exp_avg", s.name),
                s.layout.clone(),
                &coord,
                &st.exp_avg,
            ));
            tensors.push(LocalTensor::new(
                format!("{}.exp_avg_sq", s.name),
                s.layout.clone(),
                &coord,
                &st.exp_avg_sq,
            ));
        }
        let t = Instant::now();
        let pending = checkpoint::save_async(&pg, Path::new(&dir), tensors)?;
        let returned = t.elapsed();
        pending.wait()?;
        if rank == 0 {
            println!(
                "checkpoint: {dir} (save_async returned in {:.1} ms, committed in {:.1} ms)",
                returned.as_secs_f64() * 1e3,
                t.elapsed().as_secs_f64() * 1e3
            );
        }
    }
    if rank == 0 {
        println!(
            "done: {steps} steps, {world} ranks, {:.1} s",
            started.elapsed().as_secs_f64()
        );
    }
    Ok(())
}
