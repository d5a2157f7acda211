//! Trains a three-layer MLP classifier with [candle](https://github.com/huggingface/candle)
//! and `dist` DDP, one process per rank, on a data set generated deterministically (Gaussian
//! clusters, no download). Launch with distrun (the README's first command):
//!
//! ```text
//! cargo build --release -p ddp-train -p dist-run
//! ./target/release/distrun --nproc-per-node 4 -- ./target/release/ddp-train
//! ```
//!
//! Candle is the autograd framework because it is the most used pure-Rust one, builds on CPU
//! with no native libraries, and exposes gradients per variable, which is all DDP needs.
//!
//! The backward pass runs layer by layer (each layer's output is cut from the graph and its
//! gradient fed back), so DDP can launch a bucket's all-reduce while earlier layers are still
//! differentiating: the per-step line reports how much of the communication that hid.

#![forbid(unsafe_code)]
use std::time::Instant;

use candle_core::{DType, Device, Tensor, Var};
use candle_nn::{Linear, Module, VarBuilder, VarMap};
use dist_collective::{InitOptions, ProcessGroup, ReduceOp, init_process_group};
use dist_parallel::{Ddp, DdpOptions, ParamInfo};

const FEATURES: usize = 32;
const HIDDEN: usize = 512;
const CLASSES: usize = 10;
const SAMPLES: usize = 16_384;
const LOCAL_BATCH: usize = 64;
const LR: f64 = 0.05;
const MOMENTUM: f32 = 0.9;

type Res<T> = Result<T, Box<dyn std::error::Error>>;

/// The whole data set, identical on every rank: sample i belongs to class i % CLASSES and sits
/// near that class's centre.
fn dataset() -> (Vec<f32>, Vec<u32>) {
    toy_data::clusters(SAMPLES, FEATURES, CLASSES, 6.0)
}

struct Layer {
    lin: Linear,
    weight: Var,
    bias: Var,
}

fn layer(vm: &VarMap, vb: &VarBuilder<'_>, name: &str, i: usize, o: usize) -> Res<Layer> {
    let lin = candle_nn::linear(i, o, vb.pp(name))?;
    let data = vm.data().lock().map_err(|_| "var map poisoned")?;
    let get = |k: &str| {
        data.get(&format!("{name}.{k}"))
            .cloned()
            .ok_or(format!("no variable {name}.{k}"))
    };
    Ok(Layer {
        lin,
        weight: get("weight")?,
        bias: get("bias")?,
    })
}

fn flat(t: &Tensor) -> Res<Vec<f32>> {
    Ok(t.flatten_all()?.to_vec1::<f32>()?)
}

fn main() -> Res<()> {
    let pg: ProcessGroup =
        init_process_group(InitOptions::new().backend("gloo").init_method("env://"))?;
    let (rank, world) = (pg.rank(), pg.world_size());
    let steps: usize = std::env::var("DDP_TRAIN_STEPS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(200);
    let dev = Device::Cpu;
    let vm = VarMap::new();
    let vb = VarBuilder::from_varmap(&vm, DType::F32, &dev);
    let layers = [
        layer(&vm, &vb, "fc1", FEATURES, HIDDEN)?,
        layer(&vm, &vb, "fc2", HIDDEN, HIDDEN)?,
        layer(&vm, &vb, "fc3", HIDDEN, CLASSES)?,
    ];
    let vars: Vec<&Var> = layers.iter().flat_map(|l| [&l.weight, &l.bias]).collect();
    let infos: Vec<ParamInfo> = ["fc1", "fc2", "fc3"]
        .iter()
        .zip(&layers)
        .flat_map(|(n, l)| {
            [
                ParamInfo::new(format!("{n}.weight"), l.weight.dims()),
                ParamInfo::new(format!("{n}.bias"), l.bias.dims()),
            ]
        })
        .collect();
    let mut values: Vec<Vec<f32>> = vars
        .iter()
        .map(|v| flat(v.as_tensor()))
        .collect::<Res<_>>()?;
    let mut slices: Vec<&mut [f32]> = values.iter_mut().map(|v| v.as_mut_slice()).collect();
    let mut ddp = Ddp::new(
        pg.clone(),
        infos.clone(),
        DdpOptions::default(),
        &mut slices,
    )?;
    for (v, val) in vars.iter().zip(&values) {
        v.set(&Tensor::from_slice(val, v.dims(), &dev)?)?;
    }
    if rank == 0 {
        println!("{}", ddp.summary());
    }

    let (xs, ys) = dataset();
    // Each rank reads its own shard: samples rank, rank + world, ... (DistributedSampler).
    let shard: Vec<usize> = (rank..SAMPLES).step_by(world).collect();
    let mut momentum: Vec<Vec<f32>> = values.iter().map(|v| vec![0.0; v.len()]).collect();
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
        let x = Tensor::from_slice(&bx, (LOCAL_BATCH, FEATURES), &dev)?;
        let y = Tensor::from_slice(&by, LOCAL_BATCH, &dev)?;

        // Forward, cutting the graph after each hidden layer so backward can run per layer.
        let h1 = layers[0].lin.forward(&x)?.relu()?;
        let h1_in = Var::from_tensor(&h1.detach())?;
        let h2 = layers[1].lin.forward(h1_in.as_tensor())?.relu()?;
        let h2_in = Var::from_tensor(&h2.detach())?;
        let logits = layers[2].lin.forward(h2_in.as_tensor())?;
        let loss = candle_nn::loss::cross_entropy(&logits, &y)?;

        // Backward, last layer first; each layer's gradients go to DDP as soon as they exist.
        let mut grads: Vec<Vec<f32>> = vec![Vec::new(); vars.len()];
        let mut upstream = loss.backward()?;
        let mut feed = [
            (Some(&h2_in), Some(h2)),
            (Some(&h1_in), Some(h1)),
            (None, None),
        ];
        for (li, l) in layers.iter().enumerate().rev() {
            for (pi, var) in [(2 * li, &l.weight), (2 * li + 1, &l.bias)] {
                let g = upstream.get(var.as_tensor()).ok_or("missing gradient")?;
                grads[pi] = flat(g)?;
                ddp.mark_ready(pi, &grads[pi])?;
            }
            if let (Some(cut), Some(out)) = std::mem::take(&mut feed[2 - li]) {
                let g_out = upstream
                    .get(cut.as_tensor())
                    .ok_or("missing activation gradient")?;
                upstream = (out * g_out.detach())?.sum_all()?.backward()?;
            }
        }
        let mut gs: Vec<&mut [f32]> = grads.iter_mut().map(|g| g.as_mut_slice()).collect();
        ddp.finish(&mut gs)?;

        // SGD with momentum on the averaged gradients, identical on every rank.
        for ((var, g), m) in vars.iter().zip(&grads).zip(momentum.iter_mut()) {
            m.iter_mut()
                .zip(g)
                .for_each(|(m, g)| *m = MOMENTUM * *m + g);
            let upd = Tensor::from_slice(m, var.dims(), &dev)?;
            var.set(&(var.as_tensor() - (upd * LR)?)?)?;
        }

        let mut l = [loss.to_scalar::<f32>()?];
        pg.all_reduce(&mut l, ReduceOp::Avg)?;
        let dt = t0.elapsed().as_secs_f64();
        let s = ddp.last_step();
        if rank == 0 && (step % 20 == 0 || step + 1 == steps) {
            println!(
                "step {step:>4}  loss {:.4}  {:>8.0} samples/s  comm {:>6.2} ms  hidden behind backward {:>5.1}%",
                l[0],
                (LOCAL_BATCH * world) as f64 / dt,
                s.comm.as_secs_f64() * 1e3,
                s.hidden_fraction() * 100.0
            );
        }
    }
    // Every rank must hold the same parameters: check it the way a user would.
    let mut mine: Vec<f32> = vars
        .iter()
        .map(|v| flat(v.as_tensor()))
        .collect::<Res<Vec<_>>>()?
        .concat();
    let theirs = mine.clone();
    pg.broadcast(&mut mine, 0)?;
    let same = mine == theirs;
    if rank == 0 {
        println!(
            "done: {steps} steps, {world} ranks, {:.1} s, parameters identical on every rank: {same}",
            started.elapsed().as_secs_f64()
        );
    }
    if !same {
        return Err(format!("rank {rank}: parameters diverged from rank 0").into());
    }
    Ok(())
}
