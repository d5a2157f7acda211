//! FSDP against DDP: the step time of the same model (the tests' hand-written MLP, wider) at 2
//! and 4 ranks over real TCP, DDP being the baseline measured in the same invocation; and the
//! per-rank memory of a 100M-parameter model, counted by FSDP as it allocates.
//!
//! `cargo bench -p dist-parallel --bench fsdp`. Each sample builds the world once
//! (`iter_custom`) and times `iters` whole steps (forward, backward with communication,
//! AdamW); the slowest rank's time counts.

#![allow(
    missing_docs,
    reason = "criterion_group! generates an undocumented public function"
)]

#[path = "../tests/mlp/mod.rs"]
mod mlp;

use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};
use dist_collective::testing::run_world;
use dist_parallel::optim::{AdamW, AdamWState};
use dist_parallel::{Ddp, DdpOptions, Fsdp, FsdpOptions, ParamInfo};

const DIMS: [usize; 6] = [128, 384, 384, 384, 384, 16];
const LOCAL_BATCH: usize = 16;

#[derive(Clone, Copy)]
enum Kind {
    Ddp,
    /// FSDP; `true`: reshard after forward (gather twice per step), torch's default.
    Fsdp(bool),
}

fn steps(world: usize, iters: u64, kind: Kind) -> Duration {
    let times = run_world(world, |pg| {
        let init = mlp::init(&DIMS, 1);
        let (x, t) = mlp::batch(&DIMS, 0, LOCAL_BATCH * world);
        let x = mlp::rows(&x, DIMS[0], pg.rank(), world);
        let t = mlp::rows(&t, DIMS[5], pg.rank(), world);
        let opt = AdamW::default();
        match kind {
            Kind::Ddp => {
                let mut p = init.clone();
                let mut st: Vec<AdamWState> = p.iter().map(|v| AdamWState::new(v.len())).collect();
                let infos: Vec<ParamInfo> = mlp::units(&DIMS).concat();
                let mut ddp = {
                    let mut v: Vec<&mut [f32]> = p.iter_mut().map(|v| v.as_mut_slice()).collect();
                    Ddp::new(pg.clone(), infos, DdpOptions::default(), &mut v).unwrap()
                };
                mlp::ddp_step(&mut ddp, &DIMS, &mut p, &mut st, &x, &t, opt);
                pg.barrier()?;
                let t0 = Instant::now();
                for _ in 0..iters {
                    mlp::ddp_step(&mut ddp, &DIMS, &mut p, &mut st, &x, &t, opt);
                }
                Ok(t0.elapsed())
            }
            Kind::Fsdp(reshard) => {
                let values: Vec<&[f32]> = init.iter().map(Vec::as_slice).collect();
                let opts = FsdpOptions {
                    reshard_after_forward: reshard,
                    ..FsdpOptions::default()
                };
                let mut fsdp: Fsdp =
                    Fsdp::new(pg.clone(), mlp::units(&DIMS), opts, &values).unwrap();
                let mut st = Vec::new();
                let mut step = |fsdp: &mut Fsdp| {
                    mlp::fsdp_forward_backward(fsdp, &DIMS, &x, &t);
                    fsdp.finish().unwrap();
                    mlp::fsdp_opt_step(fsdp, opt, &mut st);
                };
                step(&mut fsdp);
                pg.barrier()?;
                let t0 = Instant::now();
                for _ in 0..iters {
                    step(&mut fsdp);
                }
                Ok(t0.elapsed())
            }
        }
    })
    .unwrap();
    times.into_iter().max().unwrap_or_default()
}

fn step_time(c: &mut Criterion) {
    let mut g = c.benchmark_group("fsdp_vs_ddp_step");
    g.sample_size(10);
    g.measurement_time(Duration::from_secs(10));
    for world in [2, 4] {
        g.bench_with_input(BenchmarkId::new("ddp", world), &world, |b, &w| {
            b.iter_custom(|iters| steps(w, iters, Kind::Ddp))
        });
        g.bench_with_input(BenchmarkId::new("fsdp", world), &world, |b, &w| {
            b.iter_custom(|iters| steps(w, iters, Kind::Fsdp(true)))
        });
        g.bench_with_input(BenchmarkId::new("fsdp_keep", world), &world, |b, &w| {
            b.iter_custom(|iters| steps(w, iters, Kind::Fsdp(false)))
        });
    }
    g.finish();
}

/// Six [4096, 4096] layers with biases: 100.7M parameters. One step with synthetic gradients
/// (the figure is about bytes, not compute); prints what each rank held.
fn memory_100m(_c: &mut Criterion) {
    const D: usize = 4096;
    const LAYERS: usize = 6;
    let units: Vec<Vec<ParamInfo>> = (0..LAYERS)
        .map(|k| {
            vec![
                ParamInfo::new(format!("l{k}.weight"), &[D, D]),
                ParamInfo::new(format!("l{k}.bias"), &[D]),
            ]
        })
        .collect();
    let total: usize = units.iter().flatten().map(ParamInfo::numel).sum();
    // DDP holds parameters, gradients and two AdamW moments, all whole, in f32.
    let ddp = 16 * total;
    for world in [2, 4] {
        let out = run_world(world, |pg| {
            let w = vec![0.01f32; D * D];
            let b = vec![0.0f32; D];
            let values: Vec<&[f32]> = (0..LAYERS)
                .flat_map(|_| [w.as_slice(), b.as_slice()])
                .collect();
            let mut fsdp: Fsdp =
                Fsdp::new(pg.clone(), units.clone(), FsdpOptions::default(), &values).unwrap();
            drop(values);
            drop((w, b));
            let grad = vec![1e-3f32; D * D + D];
            fsdp.reset_peak();
            for u in 0..LAYERS {
                fsdp.pre_forward(u).unwrap();
                fsdp.post_forward(u).unwrap();
            }
            for u in (0..LAYERS).rev() {
                fsdp.pre_backward(u).unwrap();
                fsdp.post_backward(u, &grad).unwrap();
            }
            fsdp.finish().unwrap();
            let st: Vec<AdamWState> = fsdp
                .shards_mut()
                .iter()
                .map(|s| AdamWState::new(s.param.len()))
                .collect();
            let moments: usize = st.iter().map(|s| 8 * s.exp_avg.len()).sum();
            Ok((fsdp.memory(), moments))
        })
        .unwrap();
        let (m, moments) = out[0];
        let state = m.param_shards + m.grad_shards + moments;
        let mib = |b: usize| b as f64 / (1 << 20) as f64;
        println!(
            "memory, {:.1}M parameters, {world} ranks, rank 0: FSDP parameters+gradients+AdamW {:.0} MiB + peak in flight {:.0} MiB (one unit {:.0} MiB) = {:.0} MiB; DDP {:.0} MiB ({:.2}x)",
            total as f64 / 1e6,
            mib(state),
            mib(m.peak_in_flight),
            mib((D * D + D) * 4),
            mib(state + m.peak_in_flight),
            mib(ddp),
            (state + m.peak_in_flight) as f64 / ddp as f64,
        );
    }
}

criterion_group!(benches, memory_100m, step_time);
criterion_main!(benches);
