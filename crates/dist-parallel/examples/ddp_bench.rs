//! Gradient synchronisation through DDP versus one all-reduce of the same bytes.
//!
//! ```sh
//! cargo build --release -p dist-parallel --example ddp_bench -p dist-run
//! ./target/release/distrun --nproc-per-node 2 -- ./target/release/examples/ddp_bench
//! ```
//!
//! A 100M-parameter f32 model (`DDP_BENCH_PARAMS` to change it) made of 1M-element tensors.
//! Each iteration times, on every rank, (a) one `all_reduce(Avg)` of a flat buffer of all
//! gradients and (b) a DDP step: every gradient marked ready in reverse order, then `finish`
//! (bucket copies, bucketed all-reduces, copies back). The two alternate, the per-iteration
//! maximum over ranks is taken, and rank 0 prints the medians and their ratio. (c) is the same
//! DDP step with the gradients already in the buckets (`grad_buffer_mut`, torch's
//! `gradient_as_bucket_view`, which saves the two copies): DDP's sync cost proper. (d) writes
//! each gradient into its bucket and marks it ready at once, as a backward pass does, and (e)
//! only writes the gradients: (d) − (e) is the communication left exposed after overlap. (f) runs
//! the same bucket-sized all-reduces without DDP, to separate bucketing from DDP's machinery.

#![allow(missing_docs, reason = "an example binary")]

use std::time::Instant;

use dist_collective::{InitOptions, ReduceOp, init_process_group};
use dist_parallel::{Ddp, DdpOptions, ParamInfo};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let pg = init_process_group(InitOptions::new().backend("gloo").init_method("env://"))?;
    let total: usize = std::env::var("DDP_BENCH_PARAMS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(100_000_000);
    let iters: usize = std::env::var("DDP_BENCH_ITERS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(5);
    let per = 1 << 20;
    let n = total.div_ceil(per);
    let infos: Vec<ParamInfo> = (0..n)
        .map(|i| ParamInfo::new(format!("p{i}"), &[per.min(total - i * per)]))
        .collect();
    let mut values: Vec<Vec<f32>> = infos.iter().map(|p| vec![0.0; p.numel()]).collect();
    let mut ddp = Ddp::new(
        pg.clone(),
        infos.clone(),
        DdpOptions {
            bucket_cap_mb: std::env::var("DDP_BENCH_BUCKET_MB")
                .ok()
                .and_then(|s| s.parse().ok())
                .unwrap_or(25.0),
            ..DdpOptions::default()
        },
        &mut values
            .iter_mut()
            .map(|v| v.as_mut_slice())
            .collect::<Vec<_>>(),
    )?;
    let mut grads: Vec<Vec<f32>> = infos
        .iter()
        .map(|p| vec![pg.rank() as f32; p.numel()])
        .collect();
    let mut flat = vec![pg.rank() as f32; total];
    const K: usize = 6;
    let mut loose: Vec<Vec<f32>> = Vec::new();
    let mut times = vec![0f64; K * iters];
    for it in 0..=iters {
        let t0 = Instant::now();
        pg.all_reduce(&mut flat, ReduceOp::Avg)?;
        let a = t0.elapsed().as_secs_f64();
        let t0 = Instant::now();
        for i in (0..n).rev() {
            ddp.mark_ready(i, &grads[i])?;
        }
        ddp.finish(
            &mut grads
                .iter_mut()
                .map(|g| g.as_mut_slice())
                .collect::<Vec<_>>(),
        )?;
        let b = t0.elapsed().as_secs_f64();
        for i in 0..n {
            ddp.grad_buffer_mut(i)?.fill(pg.rank() as f32);
        }
        pg.barrier()?;
        let t0 = Instant::now();
        for i in (0..n).rev() {
            ddp.mark_ready_in_place(i)?;
        }
        ddp.finish_in_place()?;
        let c = t0.elapsed().as_secs_f64();
        pg.barrier()?;
        let t0 = Instant::now();
        for i in (0..n).rev() {
            // A framework with bucket views computes the gradient into this memory.
            ddp.grad_buffer_mut(i)?.fill(pg.rank() as f32);
            ddp.mark_ready_in_place(i)?;
        }
        ddp.finish_in_place()?;
        let d = t0.elapsed().as_secs_f64();
        pg.barrier()?;
        let t0 = Instant::now();
        for g in grads.iter_mut().rev() {
            g.fill(pg.rank() as f32);
        }
        let e = t0.elapsed().as_secs_f64();
        pg.barrier()?;
        // The same all-reduces DDP issues, straight from this thread on bucket-sized buffers:
        // what the bucketing itself costs, DDP's machinery aside.
        if loose.len() != ddp.layout().buckets.len() {
            loose = ddp
                .layout()
                .buckets
                .iter()
                .map(|b| vec![pg.rank() as f32; b.len])
                .collect();
        }
        let t0 = Instant::now();
        for l in &mut loose {
            pg.all_reduce(l, ReduceOp::Avg)?;
        }
        let f = t0.elapsed().as_secs_f64();
        if it > 0 {
            // Iteration 0 is the warm-up (and DDP's bucket rebuild).
            times[K * (it - 1)..K * it].copy_from_slice(&[a, b, c, d, e, f]);
        }
    }
    pg.all_reduce(&mut times, ReduceOp::Max)?;
    if pg.rank() == 0 {
        let median = |mut v: Vec<f64>| {
            v.sort_by(f64::total_cmp);
            v[v.len() / 2]
        };
        let col = |k: usize| median(times.iter().skip(k).step_by(K).copied().collect());
        let (ar, dd, dv, bw, fill, lo) = (col(0), col(1), col(2), col(3), col(4), col(5));
        println!(
            "ddp_bench: world {} | {} parameters ({:.0} MB) in {} buckets | all_reduce median {:.1} ms | DDP sync, copy in/out {:.1} ms (ratio {:.3}) | DDP sync, bucket views {:.1} ms (ratio {:.3}) | backward-like write+sync {:.1} ms, write alone {:.1} ms, exposed {:.1} ms (ratio {:.3})",
            pg.world_size(),
            total,
            total as f64 * 4.0 / 1e6,
            ddp.layout().buckets.len(),
            ar * 1e3,
            dd * 1e3,
            dd / ar,
            dv * 1e3,
            dv / ar,
            bw * 1e3,
            fill * 1e3,
            (bw - fill) * 1e3,
            (bw - fill) / ar
        );
        println!(
            "ddp_bench: the bucket-sized all_reduces without DDP {:.1} ms (ratio {:.3})",
            lo * 1e3,
            lo / ar
        );
    }
    Ok(())
}
