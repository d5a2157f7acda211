//! Trains a deep MLP classifier with [candle](https://github.com/huggingface/candle) and a
//! `dist` pipeline, one process per rank, on Gaussian clusters generated deterministically (no
//! download). Launched like the main job:
//!
//! ```text
//! cargo build --release -p pp-train -p dist-run
//! ./target/release/distrun --nproc-per-node 4 -- ./target/release/pp-train
//! ```
//!
//! The model is a list of blocks (linear + tanh, a linear head) cut at even split points into
//! two stages per rank, run by the interleaved 1F1B schedule (`PP_SCHEDULE=gpipe|1f1b|
//! interleaved`; the candle stages do not split their backward, so zero-bubble schedules are
//! refused at set-up). The rank holding the head prints the loss, accuracy and samples per
//! second every 20 steps (`PP_TRAIN_STEPS` sets the count) and fails if the loss did not fall.

#![forbid(unsafe_code)]
use std::time::Instant;

use candle_core::{Device, Tensor, Var};
use dist_collective::{InitOptions, init_process_group};
use dist_parallel::pipeline::{
    CandleBlock, CandleStage, Pipeline, Schedule, StageResult, split_blocks,
};

const FEATURES: usize = 32;
const HIDDEN: usize = 128;
const CLASSES: usize = 10;
/// Hidden layers plus the head.
const LAYERS: usize = 8;
const SAMPLES: usize = 8192;
const BATCH: usize = 256;
const MICROBATCHES: usize = 8;
const LR: f64 = 0.05;

type Res<T> = Result<T, Box<dyn std::error::Error>>;

/// The data set, identical on every rank: sample i belongs to class i % CLASSES.
fn dataset() -> (Vec<f32>, Vec<usize>) {
    let (xs, ys) = toy_data::clusters(SAMPLES, FEATURES, CLASSES, 4.0);
    (xs, ys.into_iter().map(|y| y as usize).collect())
}

fn width(l: usize) -> usize {
    match l {
        0 => FEATURES,
        l if l == LAYERS => CLASSES,
        _ => HIDDEN,
    }
}

/// Every block of the model, built the same way on every rank (same seed), so no
/// broadcast of the initial parameters is needed.
fn blocks() -> Res<Vec<CandleBlock>> {
    let mut rng = toy_data::Rng::new(0x0dd_ba11_cafe_f00d);
    (0..LAYERS)
        .map(|l| {
            let (i, o) = (width(l), width(l + 1));
            let scale = (3.0 / i as f32).sqrt();
            let w: Vec<f32> = (0..o * i).map(|_| rng.next_f32() * scale).collect();
            let w = Var::from_vec(w, (o, i), &Device::Cpu)?;
            let b = Var::zeros(o, candle_core::DType::F32, &Device::Cpu)?;
            // Clones share the variables' storage: SGD updates reach the module.
            let (wt, bt) = (w.as_tensor().clone(), b.as_tensor().clone());
            let head = l + 1 == LAYERS;
            let module = move |x: &Tensor| {
                let z = x.matmul(&wt.t()?)?.broadcast_add(&bt)?;
                if head { Ok(z) } else { z.tanh() }
            };
            Ok(CandleBlock::new(module, vec![w, b]))
        })
        .collect()
}

fn main() -> Res<()> {
    let pg = init_process_group(InitOptions::new().init_method("env://"))?;
    let (rank, p) = (pg.rank(), pg.size());
    let steps: usize = std::env::var("PP_TRAIN_STEPS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(100);
    let kind = std::env::var("PP_SCHEDULE").unwrap_or_else(|_| "interleaved".into());
    let schedule = match kind.as_str() {
        "gpipe" => Schedule::gpipe(p, MICROBATCHES)?,
        "1f1b" => Schedule::one_f_one_b(p, MICROBATCHES)?,
        "interleaved" => Schedule::interleaved_1f1b(p, 2, MICROBATCHES)?,
        other => return Err(format!("PP_SCHEDULE={other}: use gpipe, 1f1b or interleaved").into()),
    };
    let n = schedule.num_stages();
    if !LAYERS.is_multiple_of(n) {
        return Err(format!("{LAYERS} layers do not split into {n} stages").into());
    }
    let per = LAYERS / n;
    let points: Vec<usize> = (1..n).map(|s| s * per).collect();
    let rows = BATCH / MICROBATCHES;
    let mine = schedule.stages_of(rank);
    let stages: Vec<CandleStage> = split_blocks(blocks()?, &points)?
        .into_iter()
        .enumerate()
        .filter(|(s, _)| mine.contains(s))
        .map(|(s, piece)| {
            let (i, o) = (width(s * per), width((s + 1) * per));
            CandleStage::new(piece, &[rows, i], &[rows, o], Device::Cpu)
        })
        .collect();
    let last = schedule.rank_of(n - 1) == Some(rank);
    let mut pipe = Pipeline::new(pg, schedule, stages)?;

    let (xs, ys) = dataset();
    let (mut first_loss, mut loss_sum, mut correct, mut seen) = (None, 0.0f32, 0usize, 0usize);
    let mut t = Instant::now();
    for step in 0..steps {
        let at = (step * BATCH) % SAMPLES;
        let inputs = &xs[at * FEATURES..(at + BATCH) * FEATURES];
        let labels = &ys[at..at + BATCH];
        // Softmax cross-entropy, mean over the micro-batch's rows.
        let mut loss = |mb: usize, logits: &[f32], grad: &mut [f32]| -> StageResult<f32> {
            let mut total = 0.0;
            for r in 0..rows {
                let z = &logits[r * CLASSES..(r + 1) * CLASSES];
                let label = labels[mb * rows + r];
                let max = z.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let sum: f32 = z.iter().map(|v| (v - max).exp()).sum();
                total += sum.ln() + max - z[label];
                let best = (0..CLASSES).max_by(|&a, &b| z[a].total_cmp(&z[b]));
                correct += usize::from(best == Some(label));
                for c in 0..CLASSES {
                    let soft = (z[c] - max).exp() / sum;
                    grad[r * CLASSES + c] = (soft - f32::from(c == label)) / rows as f32;
                }
            }
            Ok(total / rows as f32)
        };
        let out = pipe.step(inputs, &mut loss)?;
        for st in pipe.stages_mut() {
            st.sgd_step(LR)?;
        }
        if let Some(l) = out.loss {
            first_loss.get_or_insert(l);
            loss_sum += l;
            seen += BATCH;
        }
        if last && (step + 1) % 20 == 0 {
            let el = t.elapsed().as_secs_f64();
            println!(
                "step {:4}: loss {:.4}, accuracy {:.3}, {:.0} samples/s",
                step + 1,
                loss_sum / 20.0,
                correct as f64 / seen.max(1) as f64,
                seen as f64 / el
            );
            if step + 1 == steps
                && let Some(f) = first_loss
                && loss_sum / 20.0 >= f
            {
                return Err(format!("the loss did not fall: {f} -> {}", loss_sum / 20.0).into());
            }
            (loss_sum, correct, seen) = (0.0, 0, 0);
            t = Instant::now();
        }
    }
    Ok(())
}
