//! Ten steps of the 2-D job (tensor parallel in pairs, FSDP across them) at 4 ranks, and of
//! tensor parallelism alone at 2, give the losses one process gives on the same global
//! batches, within 1e-4 relative: the ranks only reorder floating-point sums (the matmul split
//! over the ffn columns, the all_reduce and the gradient average).

use dist_collective::testing::run_world;
use tp2d_train::{Config, train};

const TOL: f32 = 1e-4;

fn config() -> Config {
    Config {
        features: 16,
        hidden: 32,
        ffn: 64,
        classes: 8,
        blocks: 3,
        global_batch: 24,
        samples: 512,
        steps: 10,
        lr: 3e-3,
    }
}

fn losses(world: usize, tp: usize) -> Vec<f32> {
    let per_rank = run_world(world, move |pg| {
        Ok(train(&pg, tp, &config())
            .unwrap()
            .iter()
            .map(|r| r.loss)
            .collect::<Vec<f32>>())
    })
    .unwrap();
    for (r, l) in per_rank.iter().enumerate() {
        assert_eq!(l, &per_rank[0], "rank {r} reports other losses than rank 0");
    }
    per_rank[0].clone()
}

fn assert_close(got: &[f32], want: &[f32], what: &str) {
    assert_eq!(got.len(), 10);
    let worst = got
        .iter()
        .zip(want)
        .map(|(g, w)| (g - w).abs() / w.abs().max(1.0))
        .fold(0.0f32, f32::max);
    eprintln!("{what}: largest relative loss difference over 10 steps {worst:e}");
    for (s, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= TOL * w.abs().max(1.0),
            "{what}, step {s}: {g} vs one process {w}"
        );
    }
}

#[test]
fn ten_steps_at_2x2_and_tp2_match_one_process() {
    let one = losses(1, 1);
    // It trains: the loss of the last step is below the first.
    assert!(one[9] < one[0], "{one:?}");
    assert_close(&losses(4, 2), &one, "dp 2 x tp 2");
    assert_close(&losses(2, 2), &one, "tp 2");
    assert_close(&losses(2, 1), &one, "dp 2");
}

#[test]
fn a_tp_degree_that_does_not_divide_is_an_error_naming_the_rank() {
    let errs = run_world(2, |pg| {
        Ok(train(&pg, 3, &config()).unwrap_err().to_string())
    })
    .unwrap();
    for (r, e) in errs.iter().enumerate() {
        assert!(
            e.starts_with(&format!("rank {r}: tp2d train: tp degree 3")),
            "{e}"
        );
    }
}
