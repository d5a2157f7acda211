//! DDP over real multi-rank groups (threads over loopback TCP): bucketing and rebuild,
//! no_sync, unused parameters, every hook, and parity with single-process training.

use dist_collective::ProcessGroup;
use dist_collective::testing::run_world;
use dist_parallel::{Bf16Compress, Ddp, DdpOptions, Error, Fp16Compress, ParamInfo, PowerSgd};

/// A two-layer MLP, y = W2 tanh(W1 x + b1) + b2, with a hand-written backward: an independent
/// reference for what DDP must reproduce.
struct Mlp {
    w1: Vec<f32>,
    b1: Vec<f32>,
    w2: Vec<f32>,
    b2: Vec<f32>,
}

const IN: usize = 5;
const HID: usize = 7;
const OUT: usize = 3;

fn params() -> Vec<ParamInfo> {
    vec![
        ParamInfo::new("fc1.weight", &[HID, IN]),
        ParamInfo::new("fc1.bias", &[HID]),
        ParamInfo::new("fc2.weight", &[OUT, HID]),
        ParamInfo::new("fc2.bias", &[OUT]),
    ]
}

fn wave(i: usize, k: f32) -> f32 {
    (i as f32 * 0.37 + k).sin() * 0.5
}

impl Mlp {
    fn init(seed: f32) -> Self {
        Mlp {
            w1: (0..HID * IN).map(|i| wave(i, seed)).collect(),
            b1: (0..HID).map(|i| wave(i, seed + 1.0) * 0.1).collect(),
            w2: (0..OUT * HID).map(|i| wave(i, seed + 2.0)).collect(),
            b2: vec![0.0; OUT],
        }
    }

    /// Mean-squared-error gradients over `xs`/`ys` (rows of IN and OUT values).
    fn grads(&self, xs: &[f32], ys: &[f32]) -> [Vec<f32>; 4] {
        let n = xs.len() / IN;
        let (mut gw1, mut gb1, mut gw2, mut gb2) = (
            vec![0.0; HID * IN],
            vec![0.0; HID],
            vec![0.0; OUT * HID],
            vec![0.0; OUT],
        );
        for s in 0..n {
            let x = &xs[s * IN..(s + 1) * IN];
            let h: Vec<f32> = (0..HID)
                .map(|j| {
                    ((0..IN).map(|i| self.w1[j * IN + i] * x[i]).sum::<f32>() + self.b1[j]).tanh()
                })
                .collect();
            let y: Vec<f32> = (0..OUT)
                .map(|o| (0..HID).map(|j| self.w2[o * HID + j] * h[j]).sum::<f32>() + self.b2[o])
                .collect();
            let dy: Vec<f32> = (0..OUT)
                .map(|o| 2.0 * (y[o] - ys[s * OUT + o]) / (n * OUT) as f32)
                .collect();
            for o in 0..OUT {
                gb2[o] += dy[o];
                for j in 0..HID {
                    gw2[o * HID + j] += dy[o] * h[j];
                }
            }
            for j in 0..HID {
                let dh = (0..OUT).map(|o| dy[o] * self.w2[o * HID + j]).sum::<f32>()
                    * (1.0 - h[j] * h[j]);
                gb1[j] += dh;
                for i in 0..IN {
                    gw1[j * IN + i] += dh * x[i];
                }
            }
        }
        [gw1, gb1, gw2, gb2]
    }

    fn sgd(&mut self, g: &[Vec<f32>; 4], lr: f32) {
        for (p, g) in [&mut self.w1, &mut self.b1, &mut self.w2, &mut self.b2]
            .into_iter()
            .zip(g)
        {
            p.iter_mut().zip(g).for_each(|(p, g)| *p -= lr * g);
        }
    }

    fn slices(&mut self) -> [&mut [f32]; 4] {
        [&mut self.w1, &mut self.b1, &mut self.w2, &mut self.b2]
    }
}

fn data(samples: usize, step: usize) -> (Vec<f32>, Vec<f32>) {
    let xs: Vec<f32> = (0..samples * IN)
        .map(|i| wave(i, step as f32 * 3.1))
        .collect();
    let ys: Vec<f32> = (0..samples * OUT)
        .map(|i| wave(i * 7, step as f32 + 0.5))
        .collect();
    (xs, ys)
}

fn rel_close(a: &[f32], b: &[f32], tol: f32) -> bool {
    a.iter()
        .zip(b)
        .all(|(x, y)| (x - y).abs() <= tol * x.abs().max(y.abs()).max(1e-3))
}

#[test]
fn n_rank_ddp_matches_single_process_training_on_the_global_batch() {
    const STEPS: usize = 6;
    const LOCAL: usize = 4;
    for n in [2, 4] {
        let mut single = Mlp::init(0.3);
        for step in 0..STEPS {
            let (xs, ys) = data(LOCAL * n, step);
            let g = single.grads(&xs, &ys);
            single.sgd(&g, 0.2);
        }
        let out = run_world(n, |pg| {
            // Ranks start from different values: DDP's initial broadcast must make them equal.
            let mut m = Mlp::init(0.3 + pg.rank() as f32);
            // A tiny first bucket gives several buckets even for a small model.
            let opts = DdpOptions {
                first_bucket_mb: 0.0001,
                ..DdpOptions::default()
            };
            let mut ddp = Ddp::new(pg.clone(), params(), opts, &mut m.slices()).unwrap();
            assert_eq!(
                m.w1,
                Mlp::init(0.3).w1,
                "rank {} starts from rank 0's parameters",
                pg.rank()
            );
            for step in 0..STEPS {
                let (xs, ys) = data(LOCAL * n, step);
                let r = pg.rank();
                let mut g = m.grads(
                    &xs[r * LOCAL * IN..(r + 1) * LOCAL * IN],
                    &ys[r * LOCAL * OUT..(r + 1) * LOCAL * OUT],
                );
                for i in (0..4).rev() {
                    ddp.mark_ready(i, &g[i]).unwrap();
                }
                let [a, b, c, d] = &mut g;
                ddp.finish(&mut [a, b, c, d]).unwrap();
                m.sgd(&g, 0.2);
            }
            Ok((m.w1, m.b1, m.w2, m.b2))
        })
        .unwrap();
        for (r, p) in out.iter().enumerate() {
            assert_eq!(p, &out[0], "ws {n}: rank {r} differs from rank 0");
            assert!(
                rel_close(&p.0, &single.w1, 1e-5) && rel_close(&p.1, &single.b1, 1e-5),
                "ws {n}: fc1 differs from single-process"
            );
            assert!(
                rel_close(&p.2, &single.w2, 1e-5) && rel_close(&p.3, &single.b2, 1e-5),
                "ws {n}: fc2 differs from single-process"
            );
        }
    }
}

/// A DDP over `n` zero-initialised parameters, parameter i holding `unit * (i + 1)` floats,
/// with bucket caps given in bytes (the first bucket's, then the others').
fn ddp_with_caps(
    pg: &ProcessGroup,
    n: usize,
    unit: usize,
    first_bytes: usize,
    cap_bytes: usize,
) -> (Vec<ParamInfo>, Ddp) {
    let ps: Vec<ParamInfo> = (0..n)
        .map(|i| ParamInfo::new(format!("p{i}"), &[unit * (i + 1)]))
        .collect();
    let mut vals: Vec<Vec<f32>> = ps.iter().map(|p| vec![0.0; p.numel()]).collect();
    let mib = |b: usize| b as f64 / (1 << 20) as f64;
    let opts = DdpOptions {
        first_bucket_mb: mib(first_bytes),
        bucket_cap_mb: mib(cap_bytes),
        ..DdpOptions::default()
    };
    let mut slices: Vec<&mut [f32]> = vals.iter_mut().map(|v| v.as_mut_slice()).collect();
    let ddp = Ddp::new(pg.clone(), ps.clone(), opts, &mut slices).unwrap();
    (ps, ddp)
}

#[test]
fn buckets_follow_reverse_order_then_rebuild_in_arrival_order() {
    let out = run_world(2, |pg| {
        // Caps of 1 KiB (first bucket) and 2 KiB.
        let (ps, mut ddp) = ddp_with_caps(&pg, 6, 64, 1024, 2048);
        let before: Vec<Vec<usize>> = ddp
            .layout()
            .buckets
            .iter()
            .map(|b| b.params.clone())
            .collect();
        // Gradients arrive in registration order (not the reverse).
        let mut grads: Vec<Vec<f32>> = ps
            .iter()
            .enumerate()
            .map(|(i, p)| vec![(i + pg.rank()) as f32; p.numel()])
            .collect();
        for (i, g) in grads.iter().enumerate() {
            ddp.mark_ready(i, g).unwrap();
        }
        ddp.finish(
            &mut grads
                .iter_mut()
                .map(|v| v.as_mut_slice())
                .collect::<Vec<_>>(),
        )
        .unwrap();
        let after: Vec<Vec<usize>> = ddp
            .layout()
            .buckets
            .iter()
            .map(|b| b.params.clone())
            .collect();
        for (i, g) in grads.iter().enumerate() {
            assert!(g.iter().all(|x| *x == i as f32 + 0.5), "p{i} averaged");
        }
        Ok((before, after))
    })
    .unwrap();
    let (before, after) = &out[0];
    // p_i has 64 (i + 1) floats. First bucket 1 KiB = 256 floats: p5 (384) overflows it and
    // sits alone; then 2 KiB = 512 floats: p4 (320) + p3 would be 576, so p4 alone; p3 + p2 =
    // 448; p1 + p0 = 192.
    assert_eq!(before, &vec![vec![5], vec![4], vec![3, 2], vec![1, 0]]);
    // Arrival order 0..5: p0 + p1 = 192 floats fit 1 KiB; p2 + p3 = 448; p4; p5.
    assert_eq!(after, &vec![vec![0, 1], vec![2, 3], vec![4], vec![5]]);
    assert_eq!(out[0], out[1]);
}

#[test]
fn no_sync_accumulates_locally_and_the_next_step_averages_the_sum() {
    let out = run_world(3, |pg| {
        let ps = vec![ParamInfo::new("w", &[4])];
        let mut w = vec![0.0f32; 4];
        let mut ddp = Ddp::new(pg.clone(), ps, DdpOptions::default(), &mut [&mut w]).unwrap();
        let r = pg.rank() as f32;
        let mut acc = vec![0.0f32; 4];
        for micro in 0..2 {
            let g = vec![r + micro as f32; 4];
            acc.iter_mut().zip(&g).for_each(|(a, g)| *a += g);
            ddp.no_sync(|d| {
                d.mark_ready(0, &g).unwrap();
                d.finish(&mut [&mut acc.clone()]).unwrap();
            });
        }
        let g = vec![10.0f32; 4];
        acc.iter_mut().zip(&g).for_each(|(a, g)| *a += g);
        ddp.mark_ready(0, &acc).unwrap();
        ddp.finish(&mut [&mut acc]).unwrap();
        Ok(acc)
    })
    .unwrap();
    // rank r accumulates r + (r + 1) + 10; the mean over r = 0, 1, 2 is 13.
    assert!(out.iter().all(|a| *a == vec![13.0; 4]), "{out:?}");
}

#[test]
fn an_unused_parameter_is_an_error_naming_it_unless_find_unused_parameters() {
    let errs = run_world(2, |pg| {
        let ps = vec![
            ParamInfo::new("used", &[2]),
            ParamInfo::new("head.unused", &[3]),
        ];
        let (mut a, mut b) = (vec![0.0f32; 2], vec![0.0f32; 3]);
        let mut ddp =
            Ddp::new(pg.clone(), ps, DdpOptions::default(), &mut [&mut a, &mut b]).unwrap();
        ddp.mark_ready(0, &[1.0, 1.0]).unwrap();
        let e = ddp.finish(&mut [&mut a, &mut b]).unwrap_err();
        // Ranks that used the parameter would still be reducing this step: no later step of
        // this DDP may meet their reductions.
        let next = ddp.mark_ready(0, &[1.0, 1.0]).unwrap_err().to_string();
        assert!(next.contains("re-create the group and DDP"), "{next}");
        Ok(e)
    })
    .unwrap();
    for (r, e) in errs.iter().enumerate() {
        assert!(
            matches!(e, Error::UnusedParameters { rank, names } if *rank == r && names == &["head.unused".to_string()]),
            "{e}"
        );
        assert!(e.to_string().contains("find_unused_parameters=true"), "{e}");
    }
    let out = run_world(2, |pg| {
        let ps = vec![
            ParamInfo::new("used", &[2]),
            ParamInfo::new("sometimes", &[3]),
        ];
        let (mut a, mut b) = (vec![0.0f32; 2], vec![0.0f32; 3]);
        let opts = DdpOptions {
            find_unused_parameters: true,
            ..DdpOptions::default()
        };
        let mut ddp = Ddp::new(pg.clone(), ps, opts, &mut [&mut a, &mut b]).unwrap();
        let (mut ga, mut gb) = (vec![2.0f32; 2], vec![4.0f32; 3]);
        // Only rank 1 uses the second parameter this step.
        if pg.rank() == 1 {
            ddp.mark_ready(1, &gb).unwrap();
        }
        ddp.mark_ready(0, &ga).unwrap();
        ddp.finish(&mut [&mut ga, &mut gb]).unwrap();
        Ok((ga, gb))
    })
    .unwrap();
    assert_eq!(out[0], (vec![2.0; 2], vec![2.0; 3]));
    assert_eq!(out[0], out[1]);
}

fn hook_result(
    n: usize,
    hook: impl Fn() -> Box<dyn dist_parallel::CommHook> + Sync,
    grad: impl Fn(usize, usize) -> f32 + Sync,
    shape: &[usize],
) -> Vec<Vec<f32>> {
    run_world(n, |pg| {
        let ps = vec![ParamInfo::new("m", shape)];
        let numel = ps[0].numel();
        let mut w = vec![0.0f32; numel];
        let mut ddp = Ddp::new(pg.clone(), ps, DdpOptions::default(), &mut [&mut w]).unwrap();
        ddp.register_comm_hook(hook()).unwrap();
        let mut g: Vec<f32> = (0..numel).map(|i| grad(pg.rank(), i)).collect();
        ddp.mark_ready(0, &g).unwrap();
        ddp.finish(&mut [&mut g]).unwrap();
        Ok(g)
    })
    .unwrap()
}

#[test]
fn compression_hooks_approximate_the_mean_within_their_precision() {
    let grad = |r: usize, i: usize| ((i * 13 + r * 5) % 17) as f32 * 0.37 - 3.0;
    let exact: Vec<f32> = (0..1000)
        .map(|i| (0..3).map(|r| grad(r, i)).sum::<f32>() / 3.0)
        .collect();
    for (name, tol, out) in [
        (
            "fp16",
            5e-3,
            hook_result(3, || Box::new(Fp16Compress), grad, &[1000]),
        ),
        (
            "bf16",
            3e-2,
            hook_result(3, || Box::new(Bf16Compress), grad, &[1000]),
        ),
    ] {
        for (r, g) in out.iter().enumerate() {
            assert_eq!(g, &out[0], "{name}: rank {r} differs");
        }
        let worst = out[0]
            .iter()
            .zip(&exact)
            .map(|(a, b)| (a - b).abs() / b.abs().max(0.1))
            .fold(0.0f32, f32::max);
        assert!(worst <= tol, "{name}: worst relative error {worst}");
    }
}

#[test]
fn powersgd_recovers_a_low_rank_mean_and_its_error_stays_bounded() {
    // Each rank's gradient is rank one, u_r v_rᵀ (40 × 30); their mean has rank <= 2, so a
    // rank-2 PowerSGD approximation must recover it almost exactly.
    let (rows, cols) = (40, 30);
    let u = |r: usize, i: usize| ((i + 3 * r) as f32 * 0.21).sin();
    let v = |r: usize, k: usize| ((k * (r + 2)) as f32 * 0.13).cos();
    let grad = move |r: usize, idx: usize| u(r, idx / cols) * v(r, idx % cols);
    let mean: Vec<f32> = (0..rows * cols)
        .map(|i| (grad(0, i) + grad(1, i)) / 2.0)
        .collect();
    let out = hook_result(2, || Box::new(PowerSgd::new(2)), grad, &[rows, cols]);
    assert_eq!(out[0], out[1]);
    let num: f32 = out[0]
        .iter()
        .zip(&mean)
        .map(|(a, b)| (a - b) * (a - b))
        .sum::<f32>()
        .sqrt();
    let den: f32 = mean.iter().map(|b| b * b).sum::<f32>().sqrt();
    assert!(num / den < 0.05, "relative Frobenius error {}", num / den);
}

#[test]
fn gradients_as_bucket_views_average_in_place_across_a_rebuild() {
    let out = run_world(3, |pg| {
        let (_, mut ddp) = ddp_with_caps(&pg, 4, 100, 1000, 1600);
        let mut seen = Vec::new();
        for step in 0..3 {
            // Registration order: the first step's arrival differs from the reverse layout.
            for i in 0..4 {
                let g = ddp.grad_buffer_mut(i).unwrap();
                g.iter_mut()
                    .enumerate()
                    .for_each(|(k, x)| *x = (pg.rank() * 10 + i + k % 3 + step) as f32);
                ddp.mark_ready_in_place(i).unwrap();
            }
            ddp.finish_in_place().unwrap();
            seen.push(
                (0..4)
                    .map(|i| ddp.grad(i).unwrap().to_vec())
                    .collect::<Vec<_>>(),
            );
        }
        Ok(seen)
    })
    .unwrap();
    for (step, grads) in out[0].iter().enumerate() {
        for (i, g) in grads.iter().enumerate() {
            // mean over ranks r = 0, 1, 2 of (10 r + i + k % 3 + step) = 10 + i + k % 3 + step
            let want: Vec<f32> = (0..g.len())
                .map(|k| (10 + i + k % 3 + step) as f32)
                .collect();
            assert_eq!(g, &want, "step {step} p{i}");
        }
    }
    assert_eq!(out[0], out[1]);
    assert_eq!(out[0], out[2]);
}

/// A hook whose first reduction fails (on every rank, before any collective) and whose
/// later ones average.
struct FailsOnce(bool);

impl dist_parallel::CommHook for FailsOnce {
    fn name(&self) -> &'static str {
        "fails_once"
    }

    fn reduce(
        &mut self,
        pg: &ProcessGroup,
        bucket: &mut dist_parallel::Bucket<'_>,
    ) -> dist_collective::Result<()> {
        if !std::mem::replace(&mut self.0, true) {
            // A size mismatch of the caller's own making: local, the group stays usable.
            let mut wrong = [0.0f32; 1];
            return pg.all_gather_into(&[1.0f32, 2.0], &mut wrong);
        }
        pg.all_reduce(bucket.data, dist_collective::ReduceOp::Avg)
    }
}

#[test]
fn a_step_whose_reduction_failed_ends_and_the_next_one_runs() {
    let out = run_world(2, |pg| {
        let ps = vec![ParamInfo::new("w", &[3])];
        let mut w = vec![0.0f32; 3];
        let mut ddp = Ddp::new(pg.clone(), ps, DdpOptions::default(), &mut [&mut w]).unwrap();
        ddp.register_comm_hook(Box::new(FailsOnce(false))).unwrap();
        let r = pg.rank() as f32;
        let mut g = vec![r; 3];
        ddp.mark_ready(0, &g).unwrap();
        let first = ddp.finish(&mut [&mut g]).unwrap_err().to_string();
        // The next step: marking the same parameter again is a new step, not a second mark.
        let mut g = vec![r * 2.0; 3];
        ddp.mark_ready(0, &g)
            .expect("a failed step must not leave its marks behind");
        ddp.finish(&mut [&mut g]).unwrap();
        Ok((first, g))
    })
    .unwrap();
    for (first, g) in out {
        assert!(first.contains("all_gather"), "{first}");
        assert_eq!(g, vec![1.0; 3], "the mean of 0 and 2");
    }
}

/// The default hook, slowed on rank 0 by `delay` before its reduction.
struct SlowOnRankZero(std::time::Duration);

impl dist_parallel::CommHook for SlowOnRankZero {
    fn name(&self) -> &'static str {
        "slow_on_rank_zero"
    }

    fn reduce(
        &mut self,
        pg: &ProcessGroup,
        bucket: &mut dist_parallel::Bucket<'_>,
    ) -> dist_collective::Result<()> {
        if pg.rank() == 0 {
            std::thread::sleep(self.0);
        }
        pg.all_reduce(bucket.data, dist_collective::ReduceOp::Avg)
    }
}

/// The caller runs a collective of its own on the wrapped group while a bucket is in flight
/// (SyncBatchNorm's all-reduce in the backward pass does). Here rank 0's bucket reduction is
/// late and rank 1's caller is late, so over one group the two ranks would issue the two
/// collectives in opposite orders (before: a mismatch error on both ranks). Each must get its
/// own result, whatever the order.
#[test]
fn the_callers_collectives_while_a_bucket_is_in_flight_do_not_mix_with_it() {
    let delay = std::time::Duration::from_millis(300);
    let out = run_world(2, |pg| {
        let ps = vec![ParamInfo::new("w", &[3])];
        let mut w = vec![0.0f32; 3];
        let mut ddp = Ddp::new(pg.clone(), ps, DdpOptions::default(), &mut [&mut w]).unwrap();
        ddp.register_comm_hook(Box::new(SlowOnRankZero(delay)))
            .unwrap();
        let r = pg.rank();
        // The only bucket is full: its reduction starts on the communication thread.
        ddp.mark_ready(0, &[r as f32; 3]).unwrap();
        if r == 1 {
            std::thread::sleep(delay);
        }
        let mut x = [r as f64 + 1.0; 5];
        pg.all_reduce(&mut x, dist_collective::ReduceOp::Sum)
            .unwrap();
        let mut g = vec![0.0f32; 3];
        ddp.finish(&mut [&mut g]).unwrap();
        Ok((x, g))
    })
    .unwrap();
    for (x, g) in out {
        assert_eq!(x, [3.0; 5], "the caller's own all_reduce");
        assert_eq!(g, vec![0.5; 3], "the mean of the gradients 0 and 1");
    }
}

/// Parameter values that do not match the parameter list on one rank fail every rank at once:
/// before, that rank returned its error while the others waited in the broadcast of rank 0's
/// values until their timeout.
#[test]
fn values_wrong_on_one_rank_fail_every_rank() {
    let errs = run_world(2, |pg| {
        let ps = vec![ParamInfo::new("w", &[3])];
        let mut w = vec![0.0f32; if pg.rank() == 1 { 2 } else { 3 }];
        Ok(
            Ddp::new(pg.clone(), ps, DdpOptions::default(), &mut [&mut w])
                .unwrap_err()
                .to_string(),
        )
    })
    .unwrap();
    assert!(
        errs[0].contains("rank 0") && errs[0].contains("another rank"),
        "{}",
        errs[0]
    );
    assert!(
        errs[1].contains("rank 1") && errs[1].contains("w has 3 elements"),
        "{}",
        errs[1]
    );
}
