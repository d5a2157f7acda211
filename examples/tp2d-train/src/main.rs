//! Trains a residual MLP with [candle](https://github.com/huggingface/candle) on a 2-D
//! mesh: tensor parallel within pairs of ranks, FSDP across the pairs. Launch with distrun:
//!
//! ```text
//! cargo build --release -p tp2d-train -p dist-run
//! ./target/release/distrun --nproc-per-node 4 -- ./target/release/tp2d-train
//! ```
//!
//! Environment: `TP2D_STEPS` (default 100), `TP2D_BLOCKS` (default 4), `TP2D_TP` (the
//! tensor-parallel degree, default 2; 1 on a single process).

#![forbid(unsafe_code)]

use std::time::Instant;

use dist_collective::{InitOptions, ProcessGroup, init_process_group};
use tp2d_train::{Config, Res, train};

fn main() -> Res<()> {
    let pg: ProcessGroup =
        init_process_group(InitOptions::new().backend("gloo").init_method("env://"))?;
    let env = |k: &str, d: usize| {
        std::env::var(k)
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(d)
    };
    let world = pg.world_size();
    let tp = env("TP2D_TP", 2.min(world));
    let c = Config {
        steps: env("TP2D_STEPS", 100),
        blocks: env("TP2D_BLOCKS", 4),
        ..Config::default()
    };
    if pg.rank() == 0 {
        println!(
            "tp2d: {world} ranks, mesh [dp {}, tp {tp}], {} blocks, global batch {}",
            world / tp,
            c.blocks,
            c.global_batch
        );
    }
    let started = Instant::now();
    let reports = train(&pg, tp, &c)?;
    if pg.rank() == 0 {
        for (step, r) in reports.iter().enumerate() {
            if step % 10 == 0 || step + 1 == reports.len() {
                println!(
                    "step {step:>4}  loss {:.4}  {:>8.0} samples/s",
                    r.loss, r.samples_per_s
                );
            }
        }
        let secs = started.elapsed().as_secs_f64();
        println!(
            "done: {} steps in {secs:.1} s, {:.0} samples/s overall",
            c.steps,
            (c.steps * c.global_batch) as f64 / secs
        );
    }
    Ok(())
}
