//! A parameter server: rank 0 (`ps`) holds the weights of a linear model, ranks 1..=3
//! (`trainer1`..) each fit their own data shard, pulling the weights and pushing gradients as
//! raw `f32` bytes (asynchronous SGD, as in torch's parameter-server tutorial). At the end
//! `trainer1` asks the server for a snapshot kept there as an `RRef`, and passes that RRef to
//! the other trainers, which fetch it from the server to score it on their shards.
//!
//! ```sh
//! cargo build --release -p dist-rpc --example param_server -p dist-run
//! ./target/release/distrun --nproc-per-node 4 -- ./target/release/examples/param_server
//! ```

use std::sync::{Arc, Mutex};

use dist_rpc::{Handlers, RRef, Rpc, RpcOptions, init_rpc};

const DIM: usize = 256;
const SAMPLES: usize = 512;
const STEPS: usize = 200;
const LR: f32 = 0.3;

/// The true weights every shard is generated from.
fn w_true() -> Vec<f32> {
    (0..DIM).map(|i| (i as f32 * 0.1).sin()).collect()
}

/// Trainer `rank`'s shard: features uniform in [-1, 1] from a seeded xorshift, exact targets.
fn shard(rank: usize) -> (Vec<f32>, Vec<f32>) {
    let mut s = 0x2545_f491_4f6c_dd1d_u64 ^ (rank as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    let mut next = || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        (s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
    };
    let x: Vec<f32> = (0..SAMPLES * DIM).map(|_| next()).collect();
    let w = w_true();
    let y = (0..SAMPLES)
        .map(|n| dot(&x[n * DIM..(n + 1) * DIM], &w))
        .collect();
    (x, y)
}

/// `f32`s from received bytes (a copy: a `Vec<u8>` is not aligned for `f32`).
fn f32s(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

fn dot(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// Mean squared error of `w` on a shard, and its gradient.
fn loss_and_grad(x: &[f32], y: &[f32], w: &[f32]) -> (f64, Vec<f32>) {
    let mut grad = vec![0.0f32; DIM];
    let mut loss = 0.0f64;
    for n in 0..SAMPLES {
        let row = &x[n * DIM..(n + 1) * DIM];
        let err = dot(row, w) - y[n];
        loss += f64::from(err * err);
        for (g, xi) in grad.iter_mut().zip(row) {
            *g += 2.0 * err * xi / SAMPLES as f32;
        }
    }
    (loss / SAMPLES as f64, grad)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let rank: usize = std::env::var("RANK")?.parse()?;
    let world: usize = std::env::var("WORLD_SIZE")?.parse()?;
    if world < 2 {
        return Err("run with at least 2 processes: 1 server and trainers".into());
    }
    let handlers = Handlers::new();
    let name = if rank == 0 {
        "ps".to_owned()
    } else {
        format!("trainer{rank}")
    };
    let params = Arc::new(Mutex::new(vec![0.0f32; DIM]));
    let pushes = Arc::new(Mutex::new(0usize));
    if rank == 0 {
        let p = params.clone();
        handlers.register_bytes("get_params", move |_: &Rpc, _| {
            let w = p.lock().map_err(|e| e.to_string())?;
            Ok(bytemuck::cast_slice(&w).to_vec())
        });
        let (p, n) = (params.clone(), pushes.clone());
        handlers.register_bytes("push_grad", move |_: &Rpc, bytes| {
            if bytes.len() != DIM * 4 {
                return Err(format!(
                    "a gradient has {DIM} f32s, got {} bytes",
                    bytes.len()
                ));
            }
            let grad: Vec<f32> = f32s(&bytes);
            let mut w = p.lock().map_err(|e| e.to_string())?;
            for (wi, g) in w.iter_mut().zip(&grad) {
                *wi -= LR * g;
            }
            *n.lock().map_err(|e| e.to_string())? += 1;
            Ok(Vec::new())
        });
        let p = params.clone();
        handlers.register("snapshot", move |(): ()| {
            Ok(p.lock().map_err(|e| e.to_string())?.clone())
        });
    } else {
        // Scores a snapshot the server keeps, given as an RRef by another trainer.
        handlers.register("score", move |snap: RRef<Vec<f32>>| {
            let w = snap.to_here().map_err(|e| e.to_string())?;
            let (x, y) = shard(rank);
            Ok(loss_and_grad(&x, &y, &w).0)
        });
    }
    let rpc = init_rpc(&name, None, None, RpcOptions::new().handlers(handlers))?;

    if rank != 0 {
        let (x, y) = shard(rank);
        let mut first = None;
        let mut last = 0.0;
        for step in 0..STEPS {
            let bytes = rpc.rpc_sync_bytes("ps", "get_params", &[])?;
            let w: Vec<f32> = f32s(&bytes);
            let (loss, grad) = loss_and_grad(&x, &y, &w);
            first.get_or_insert(loss);
            last = loss;
            if step % 50 == 0 {
                println!("{name} step {step:>3}: loss {loss:.3e}");
            }
            rpc.rpc_sync_bytes("ps", "push_grad", bytemuck::cast_slice(&grad))?;
        }
        println!(
            "{name} done: loss {:.3e} -> {last:.3e}",
            first.unwrap_or(0.0)
        );
        if rank == 1 {
            let snap: RRef<Vec<f32>> = rpc.remote("ps", "snapshot", &())?;
            for t in 2..world {
                let to = format!("trainer{t}");
                let loss: f64 = rpc.rpc_sync(to.as_str(), "score", &snap)?;
                println!("{name}: the snapshot scores {loss:.3e} on {to}'s shard");
            }
        }
    }
    rpc.shutdown()?;
    if rank == 0 {
        let w = params.lock().map_err(|e| e.to_string())?;
        let dist: f32 = w
            .iter()
            .zip(w_true())
            .map(|(a, b)| (a - b) * (a - b))
            .sum::<f32>()
            .sqrt();
        let pushes = *pushes.lock().map_err(|e| e.to_string())?;
        println!(
            "ps: {pushes} gradients applied; |w - w_true| = {dist:.5} (from {:.5})",
            w_true().iter().map(|v| v * v).sum::<f32>().sqrt()
        );
        if pushes != (world - 1) * STEPS || dist > 0.1 {
            return Err(
                format!("training did not converge: {pushes} pushes, distance {dist}").into(),
            );
        }
        println!("ps: OK, {} snapshots still owned", rpc.stats().owned_rrefs);
    }
    Ok(())
}
