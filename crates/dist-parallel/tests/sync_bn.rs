//! SyncBatchNorm at 1, 2 and 4 ranks (uneven batch splits) against a plain two-pass batch norm
//! over the global batch computed here in f64: outputs, gradients, running statistics; one
//! all_reduce in forward and one in backward; bad input as errors.

mod numeric;

use dist_collective::chunk_range;
use dist_collective::testing::run_world;
use dist_parallel::{BatchNormOptions, SyncBatchNorm};
use numeric::{close, fresh_bn};

/// Deterministic values in [-2, 2) with a per-channel offset, so channels differ in mean.
fn data(len: usize, seed: u64) -> Vec<f32> {
    let mut s = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..len)
        .map(|i| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 4.0 - 2.0 + (i % 3) as f32
        })
        .collect()
}

struct Reference {
    y: Vec<f64>,
    dx: Vec<f64>,
    dw: Vec<f64>,
    db: Vec<f64>,
    mean: Vec<f64>,
    var_unbiased: Vec<f64>,
}

/// Batch norm over the whole `[n, c, s]` batch with weight `w`, bias `b`, upstream gradient
/// `dy`: the textbook two-pass formulas.
fn reference(
    x: &[f32],
    dy: &[f32],
    [n, c, s]: [usize; 3],
    w: &[f32],
    b: &[f32],
    eps: f64,
) -> Reference {
    let idx = |i: usize, k: usize, j: usize| (i * c + k) * s + j;
    let m = (n * s) as f64;
    let mut r = Reference {
        y: vec![0.0; x.len()],
        dx: vec![0.0; x.len()],
        dw: vec![0.0; c],
        db: vec![0.0; c],
        mean: vec![0.0; c],
        var_unbiased: vec![0.0; c],
    };
    for k in 0..c {
        let all: Vec<usize> = (0..n)
            .flat_map(|i| (0..s).map(move |j| idx(i, k, j)))
            .collect();
        let mean = all.iter().map(|&p| x[p] as f64).sum::<f64>() / m;
        let var = all
            .iter()
            .map(|&p| (x[p] as f64 - mean).powi(2))
            .sum::<f64>()
            / m;
        let inv = 1.0 / (var + eps).sqrt();
        r.mean[k] = mean;
        r.var_unbiased[k] = var * m / (m - 1.0);
        let xhat = |p: usize| (x[p] as f64 - mean) * inv;
        for &p in &all {
            r.y[p] = xhat(p) * w[k] as f64 + b[k] as f64;
            r.db[k] += dy[p] as f64;
            r.dw[k] += dy[p] as f64 * xhat(p);
        }
        for &p in &all {
            // dx = w·inv·(dy - mean(dy) - x̂·mean(dy·x̂))
            r.dx[p] = w[k] as f64 * inv * (dy[p] as f64 - r.db[k] / m - xhat(p) * r.dw[k] / m);
        }
    }
    r
}

fn check(world: usize, n: usize, c: usize, spatial: &[usize], momentum: Option<f64>) {
    let s: usize = spatial.iter().product();
    let per = c * s;
    let steps = 3;
    let w: Vec<f32> = (0..c).map(|k| 0.5 + k as f32).collect();
    let b: Vec<f32> = (0..c).map(|k| k as f32 - 1.0).collect();
    let opts = BatchNormOptions {
        momentum,
        ..Default::default()
    };
    let out = run_world(world, |pg| {
        let mut bn = fresh_bn(pg.clone(), &w, &b, opts);
        let rows = chunk_range(n, world, pg.rank());
        let mut shape = vec![rows.len(), c];
        shape.extend_from_slice(spatial);
        let mut per_step = Vec::new();
        for step in 0..steps {
            let x = data(n * per, step as u64);
            let dy = data(n * per, 100 + step as u64);
            let xs = &x[rows.start * per..rows.end * per];
            let dys = &dy[rows.start * per..rows.end * per];
            let before = pg.flight_recorder().len();
            let (y, saved) = bn.forward(xs, &shape).unwrap();
            let g = bn.backward(&saved, dys).unwrap();
            let ops: Vec<&str> = pg.flight_recorder()[before..]
                .iter()
                .map(|e| e.op)
                .collect();
            assert_eq!(
                ops,
                ["all_reduce", "all_reduce"],
                "one in forward, one in backward"
            );
            // Weight and bias gradients are per-rank parts; DDP would sum them.
            let (mut dw, mut db) = (g.weight.clone(), g.bias.clone());
            pg.all_reduce(&mut dw, dist_collective::ReduceOp::Sum)?;
            pg.all_reduce(&mut db, dist_collective::ReduceOp::Sum)?;
            per_step.push((
                y,
                g.input,
                dw,
                db,
                bn.running_mean.clone(),
                bn.running_var.clone(),
            ));
        }
        Ok((rows, per_step))
    })
    .unwrap();
    let (mut rm, mut rv) = (vec![0.0f64; c], vec![1.0f64; c]);
    for step in 0..steps {
        let x = data(n * per, step as u64);
        let dy = data(n * per, 100 + step as u64);
        let r = reference(&x, &dy, [n, c, s], &w, &b, 1e-5);
        let m = momentum.unwrap_or(1.0 / (step + 1) as f64);
        for k in 0..c {
            rm[k] = (1.0 - m) * rm[k] + m * r.mean[k];
            rv[k] = (1.0 - m) * rv[k] + m * r.var_unbiased[k];
        }
        for (rank, (rows, per_step)) in out.iter().enumerate() {
            let (y, dx, dw, db, run_m, run_v) = &per_step[step];
            let part = rows.start * per..rows.end * per;
            let ctx = format!("world {world} rank {rank} step {step}");
            close(y, &r.y[part.clone()], &format!("{ctx} output"));
            close(dx, &r.dx[part], &format!("{ctx} grad input"));
            close(dw, &r.dw, &format!("{ctx} grad weight"));
            close(db, &r.db, &format!("{ctx} grad bias"));
            close(run_m, &rm, &format!("{ctx} running_mean"));
            close(run_v, &rv, &format!("{ctx} running_var"));
        }
    }
}

#[test]
fn matches_batch_norm_over_the_global_batch() {
    for world in [1, 2, 4] {
        // Uneven splits (7 over 4 is 2, 2, 2, 1), a 2-D input, and a rank with no rows.
        check(world, 7, 3, &[2, 3], Some(0.1));
        check(world, 9, 2, &[], None);
        check(world, 3, 4, &[5], Some(0.3));
    }
}

#[test]
fn eval_mode_uses_running_stats_without_communication() {
    run_world(2, |pg| {
        // A converted batch norm's state (as from a trained model).
        let mut bn = SyncBatchNorm::from_batch_norm(
            pg.clone(),
            vec![1.0; 2],
            vec![0.0; 2],
            vec![1.0, -1.0],
            vec![4.0, 0.25],
            5,
            BatchNormOptions::default(),
        )
        .unwrap();
        bn.train(false);
        let before = pg.flight_recorder().len();
        let (y, saved) = bn.forward(&[3.0, 0.0], &[1, 2]).unwrap();
        let g = bn.backward(&saved, &[1.0, 1.0]).unwrap();
        assert_eq!(pg.flight_recorder().len(), before);
        let inv = |v: f64| 1.0 / (v + 1e-5f64).sqrt();
        close(&y, &[2.0 * inv(4.0), inv(0.25)], "eval output");
        close(&g.input, &[inv(4.0), inv(0.25)], "eval grad");
        assert_eq!(bn.num_batches_tracked, 5);
        Ok(())
    })
    .unwrap();
}

#[test]
fn bad_input_is_an_error_naming_rank_and_op() {
    run_world(2, |pg| {
        let r = pg.rank();
        let mut bn = SyncBatchNorm::new(pg.clone(), 3, BatchNormOptions::default());
        let e = bn.forward(&[0.0; 6], &[2, 2]).unwrap_err().to_string();
        assert!(
            e.contains(&format!("rank {r}"))
                && e.contains("SyncBatchNorm::forward")
                && e.contains("[N, 3"),
            "{e}"
        );
        let e = bn.forward(&[0.0; 5], &[2, 3]).unwrap_err().to_string();
        assert!(e.contains("5 elements"), "{e}");
        // One value per channel over the whole group: every rank fails alike (rank 1 has none).
        let rows = if r == 0 { 1 } else { 0 };
        let e = bn
            .forward(&vec![1.0; 3 * rows], &[rows, 3])
            .unwrap_err()
            .to_string();
        assert!(e.contains("more than 1 value per channel"), "{e}");
        let (_, saved) = bn
            .forward(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0], &[2, 3])
            .unwrap();
        assert!(bn.backward(&saved, &[0.0; 2]).is_err());
        assert!(
            SyncBatchNorm::from_batch_norm(
                pg.clone(),
                vec![1.0; 2],
                vec![0.0; 3],
                vec![],
                vec![],
                0,
                BatchNormOptions::default()
            )
            .is_err()
        );
        Ok(())
    })
    .unwrap();
}
