//! Measured step times of every pipeline schedule next to the simulator's prediction.
//!
//! ```sh
//! cargo run --release -p dist-parallel --example pipeline_bench
//! # or one process per rank:
//! cargo build --release -p dist-parallel --example pipeline_bench -p dist-run
//! ./target/release/distrun --nproc-per-node 4 -- ./target/release/examples/pipeline_bench
//! ```
//!
//! Four ranks (threads, each with its own process group over loopback TCP, or processes under
//! a launcher), eight micro-batches. Each stage stands for accelerator work: it sleeps for its cost (forward 4 ms,
//! backward 8 ms of which the weight gradient is 4 ms, per stage of a 4-stage model; half of
//! that per virtual stage of the interleaved 8-stage model), so the rank's thread is idle
//! while "the device" computes, as with a GPU, and the schedule's bubbles are what the step
//! time measures (the host has fewer cores than ranks, so burning CPU would measure the
//! scheduler instead). Activations of 16 Ki floats per micro-batch go over the sockets.
//! `PIPE_BENCH_MODE=spin` spins instead of sleeping, `PIPE_BENCH_STEPS` sets the step count.
//!
//! The step time is the maximum over ranks, from a barrier to the end of the step; each
//! schedule runs `PIPE_BENCH_ROUNDS` times (default 3, interleaved with the others so that a
//! change in the host's load hits all alike), two warm-up steps each, and the median and
//! minimum over all steps are printed. The simulator's makespans are printed beside them,
//! also with the measured one-way latency of one activation message added to each hop.

#![allow(missing_docs, reason = "an example binary")]

use std::time::{Duration, Instant};

use dist_collective::testing::run_world;
use dist_collective::{InitOptions, ProcessGroup, ReduceOp, init_process_group};
use dist_parallel::pipeline::{Pipeline, Schedule, Stage, StageCost, StageResult};

const P: usize = 4;
const M: usize = 8;
const WIDTH: usize = 16 * 1024;
/// Per stage of the 4-stage model, in milliseconds.
const F: f64 = 4.0;
const B: f64 = 8.0;
const W: f64 = 4.0;

/// A stage that "computes" for its cost and passes a scaled copy of its input on.
struct Timed {
    cost: StageCost,
    spin: bool,
}

impl Timed {
    fn work(&self, ms: f64) {
        let d = Duration::from_secs_f64(ms / 1e3);
        if self.spin {
            let t = Instant::now();
            while t.elapsed() < d {
                std::hint::spin_loop();
            }
        } else {
            std::thread::sleep(d);
        }
    }
}

impl Stage for Timed {
    fn input_len(&self) -> usize {
        WIDTH
    }
    fn output_len(&self) -> usize {
        WIDTH
    }
    fn forward(&mut self, _mb: usize, x: &[f32], y: &mut [f32]) -> StageResult {
        y.iter_mut().zip(x).for_each(|(y, x)| *y = 0.5 * x + 1.0);
        self.work(self.cost.forward);
        Ok(())
    }
    fn backward(&mut self, _mb: usize, g: &[f32], gx: &mut [f32]) -> StageResult {
        gx.iter_mut().zip(g).for_each(|(gx, g)| *gx = 0.5 * g);
        self.work(self.cost.backward);
        Ok(())
    }
    fn splits_backward(&self) -> bool {
        true
    }
    fn backward_input(&mut self, _mb: usize, g: &[f32], gx: &mut [f32]) -> StageResult {
        gx.iter_mut().zip(g).for_each(|(gx, g)| *gx = 0.5 * g);
        self.work(self.cost.backward - self.cost.weight);
        Ok(())
    }
    fn backward_weight(&mut self, _mb: usize) -> StageResult {
        self.work(self.cost.weight);
        Ok(())
    }
}

/// One-way latency of a `WIDTH`-float message through the group's point-to-point engine, in
/// ms: the median of ping-pongs between ranks 0 and 1, halved.
fn latency(pg: &ProcessGroup) -> Result<f64, dist_parallel::Error> {
    let mut rtts = Vec::new();
    for i in 0..40u32 {
        let t = Instant::now();
        match pg.rank() {
            0 => {
                pg.isend(vec![0f32; WIDTH], 1, i)?.wait()?;
                pg.irecv(vec![0f32; WIDTH], 1, i)?.wait()?;
            }
            1 => {
                let v = pg.irecv(vec![0f32; WIDTH], 0, i)?.wait()?;
                pg.isend(v, 0, i)?.wait()?;
            }
            _ => {}
        }
        rtts.push(t.elapsed().as_secs_f64() * 1e3);
    }
    let mut rtt = [rtts.split_off(10)];
    rtt[0].sort_by(f64::total_cmp);
    let mut half = [rtt[0][rtt[0].len() / 2] / 2.0];
    pg.broadcast(&mut half, 0)?;
    Ok(half[0])
}

/// One rank's per-step times in ms: step (max over ranks), waiting, computing.
type RankTimes = (Vec<f64>, Vec<f64>, Vec<f64>);

/// One rank: `steps` timed steps (after two warm-up steps); the step times (max over ranks)
/// and this rank's time spent waiting for data and computing.
fn rank_main(
    pg: ProcessGroup,
    schedule: &Schedule,
    cost: StageCost,
    spin: bool,
    steps: usize,
) -> Result<RankTimes, dist_parallel::Error> {
    let rank = pg.rank();
    let stages = schedule
        .stages_of(rank)
        .into_iter()
        .map(|_| Timed { cost, spin })
        .collect();
    let mut pipe = Pipeline::new(pg.clone(), schedule.clone(), stages)?;
    let inputs = vec![1.0f32; M * WIDTH];
    let mut loss = |_mb: usize, y: &[f32], g: &mut [f32]| -> StageResult<f32> {
        g.iter_mut().for_each(|g| *g = 1.0 / WIDTH as f32);
        Ok(y.iter().sum::<f32>() / WIDTH as f32)
    };
    let mut times = Vec::new();
    let mut waits = Vec::new();
    let mut computes = Vec::new();
    for _ in 0..steps + 2 {
        pg.barrier()?;
        let t = Instant::now();
        let out = pipe.step(&inputs, &mut loss)?;
        let mut el = [t.elapsed().as_secs_f64() * 1e3];
        pg.all_reduce(&mut el, ReduceOp::Max)?;
        times.push(el[0]);
        waits.push(out.wait.as_secs_f64() * 1e3);
        computes.push(out.compute.as_secs_f64() * 1e3);
    }
    Ok((
        times.split_off(2),
        waits.split_off(2),
        computes.split_off(2),
    ))
}

/// One run of one schedule: the step times, and waiting and computing per rank per step
/// (means over ranks and steps).
struct Run {
    times: Vec<f64>,
    wait: f64,
    compute: f64,
}

fn mean(v: &[f64]) -> f64 {
    v.iter().sum::<f64>() / v.len().max(1) as f64
}

/// A run from every rank's times (threads: all of them are here).
fn summarise(per_rank: &[RankTimes]) -> Run {
    Run {
        times: per_rank.first().map(|r| r.0.clone()).unwrap_or_default(),
        wait: mean(&per_rank.iter().map(|r| mean(&r.1)).collect::<Vec<_>>()),
        compute: mean(&per_rank.iter().map(|r| mean(&r.2)).collect::<Vec<_>>()),
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let env = |k: &str, d: usize| {
        std::env::var(k)
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(d)
    };
    let spin = std::env::var("PIPE_BENCH_MODE").is_ok_and(|m| m == "spin");
    let steps = env("PIPE_BENCH_STEPS", 12);
    // Rounds interleave the schedules, so that a change in the host's load hits all alike.
    let rounds = env("PIPE_BENCH_ROUNDS", 3);
    let schedules = [
        (Schedule::gpipe(P, M)?, 1.0),
        (Schedule::one_f_one_b(P, M)?, 1.0),
        (Schedule::interleaved_1f1b(P, 2, M)?, 2.0),
        (Schedule::zero_bubble_h1(P, M)?, 1.0),
    ];
    // Under a launcher (distrun, torchrun) this process is one rank; alone, ranks are threads.
    let world = if std::env::var("WORLD_SIZE").is_ok() {
        let pg = init_process_group(InitOptions::new().init_method("env://"))?;
        if pg.size() != P {
            return Err(format!("run with {P} ranks (--nproc-per-node {P})").into());
        }
        Some(pg)
    } else {
        None
    };
    let lat = match &world {
        Some(pg) => latency(pg)?,
        None => run_world(2, |pg| Ok(latency(&pg)))?
            .into_iter()
            .next()
            .ok_or("no rank")??,
    };
    let mut runs: Vec<Vec<Run>> = (0..schedules.len()).map(|_| Vec::new()).collect();
    for _ in 0..rounds {
        for (i, (schedule, v)) in schedules.iter().enumerate() {
            let cost = StageCost::new(F / v, B / v, W / v);
            let run = match &world {
                Some(pg) => {
                    let (times, waits, computes) =
                        rank_main(pg.clone(), schedule, cost, spin, steps)?;
                    let mut sums = [mean(&waits), mean(&computes)];
                    pg.all_reduce(&mut sums, ReduceOp::Sum)?;
                    Run {
                        times,
                        wait: sums[0] / P as f64,
                        compute: sums[1] / P as f64,
                    }
                }
                None => summarise(
                    &run_world(P, |pg| Ok(rank_main(pg, schedule, cost, spin, steps)))?
                        .into_iter()
                        .collect::<Result<Vec<_>, _>>()?,
                ),
            };
            runs[i].push(run);
        }
    }
    if world.as_ref().is_some_and(|pg| pg.rank() != 0) {
        return Ok(());
    }
    println!(
        "p = {P}, m = {M}, per stage F = {F} ms, B = {B} ms (W = {W} ms), {}, ranks as {} \
         ({rounds} runs of {steps} steps each, the schedules' runs interleaved)",
        if spin { "spinning" } else { "sleeping" },
        if world.is_some() {
            "processes"
        } else {
            "threads"
        }
    );
    println!("one-way latency of one {WIDTH}-float message: {lat:.3} ms");
    println!(
        "| schedule | peak act. | simulated step (ms) | simulated bubble | simulated with latency (ms) | measured step, median (ms) | min (ms) | measured bubble (median) | compute/rank (ms) | wait/rank (ms) |"
    );
    println!("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |");
    for ((schedule, v), runs) in schedules.iter().zip(&runs) {
        let cost = StageCost::new(F / v, B / v, W / v);
        let sim = schedule.simulate_uniform(cost)?;
        let sim_lat = schedule.simulate_with_latency(&vec![cost; schedule.num_stages()], lat)?;
        let mut times: Vec<f64> = runs.iter().flat_map(|r| r.times.iter().copied()).collect();
        times.sort_by(f64::total_cmp);
        let median = times.get(times.len() / 2).copied().unwrap_or(f64::NAN);
        let min = times.first().copied().unwrap_or(f64::NAN);
        let busy_per_rank = M as f64 * (F + B);
        println!(
            "| {} | {} | {:.1} | {:.3} | {:.1} | {:.1} | {:.1} | {:.3} | {:.1} | {:.1} |",
            schedule.name(),
            sim.max_peak_activations(),
            sim.makespan,
            sim.bubble,
            sim_lat.makespan,
            median,
            min,
            1.0 - busy_per_rank / median,
            mean(&runs.iter().map(|r| r.compute).collect::<Vec<_>>()),
            mean(&runs.iter().map(|r| r.wait).collect::<Vec<_>>()),
        );
    }
    Ok(())
}
