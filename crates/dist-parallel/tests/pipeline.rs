//! The pipeline executor over real multi-rank groups (threads over loopback TCP): every
//! schedule trains a hand-written MLP to the same parameters as one process; a rank that fails
//! or leaves mid-schedule makes every other rank fail naming it; set-up disagreements fail
//! every rank.

mod common;

use std::collections::HashMap;
use std::time::Duration;

use dist_collective::DeviceMesh;
use dist_collective::testing::{run_world, run_world_with};
use dist_parallel::pipeline::{Pipeline, Schedule, Stage, StageResult};
use dist_parallel::{Ddp, DdpOptions, Error, ParamInfo};

/// Layer widths: 8 layers, so that 2, 4 and 8 stages each get whole layers.
const DIMS: [usize; 9] = [6, 8, 7, 8, 9, 8, 7, 8, 4];
const LAYERS: usize = DIMS.len() - 1;
/// Samples per batch: divisible by every micro-batch count tested.
const BATCH: usize = 8;
const STEPS: usize = 10;
const LR: f32 = 0.1;

fn wave(i: usize, k: f32) -> f32 {
    (i as f32 * 0.37 + k).sin() * 0.5
}

/// A fixed pseudo-random value in [-1, 1) (splitmix64): uncorrelated weights keep the
/// gradient alive through eight layers.
fn rnd(k: u64) -> f32 {
    let mut z = k.wrapping_add(1).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^= z >> 31;
    (z >> 40) as f32 / (1u64 << 23) as f32 - 1.0
}

/// Layer `l`'s initial weight (row-major, out × in) and bias: uniform, scaled a little above
/// Xavier's so that tanh does not shrink the gradient layer after layer.
fn init(l: usize) -> (Vec<f32>, Vec<f32>) {
    let (i, o) = (DIMS[l], DIMS[l + 1]);
    let scale = 1.5 * (3.0 / i as f32).sqrt();
    let seed = (l as u64) << 20;
    let w = (0..o * i).map(|k| rnd(seed + k as u64) * scale).collect();
    let b = (0..o).map(|k| rnd(seed + 5000 + k as u64) * 0.1).collect();
    (w, b)
}

fn batch() -> (Vec<f32>, Vec<f32>) {
    let x = (0..BATCH * DIMS[0]).map(|k| wave(k, 0.3) * 2.0).collect();
    let y = (0..BATCH * DIMS[LAYERS]).map(|k| wave(k, 1.7)).collect();
    (x, y)
}

/// The last layer is linear, the others tanh.
fn is_tanh(l: usize) -> bool {
    l + 1 < LAYERS
}

/// One process, whole batch, sample by sample: the independent reference. Returns every
/// layer's (weight, bias) after `STEPS` SGD steps on the mean squared error.
fn reference() -> Vec<(Vec<f32>, Vec<f32>)> {
    let (xs, ys) = batch();
    let mut params: Vec<(Vec<f32>, Vec<f32>)> = (0..LAYERS).map(init).collect();
    for _ in 0..STEPS {
        let mut grads: Vec<(Vec<f32>, Vec<f32>)> = params
            .iter()
            .map(|(w, b)| (vec![0.0; w.len()], vec![0.0; b.len()]))
            .collect();
        for n in 0..BATCH {
            // acts[l] is layer l's input.
            let mut acts = vec![xs[n * DIMS[0]..(n + 1) * DIMS[0]].to_vec()];
            for l in 0..LAYERS {
                let (w, b) = &params[l];
                let a = &acts[l];
                let z: Vec<f32> = (0..DIMS[l + 1])
                    .map(|o| {
                        let s: f32 = (0..DIMS[l]).map(|i| w[o * DIMS[l] + i] * a[i]).sum();
                        if is_tanh(l) {
                            (s + b[o]).tanh()
                        } else {
                            s + b[o]
                        }
                    })
                    .collect();
                acts.push(z);
            }
            let out = &acts[LAYERS];
            let denom = (BATCH * DIMS[LAYERS]) as f32;
            let mut delta: Vec<f32> = (0..DIMS[LAYERS])
                .map(|o| 2.0 * (out[o] - ys[n * DIMS[LAYERS] + o]) / denom)
                .collect();
            for l in (0..LAYERS).rev() {
                let dz: Vec<f32> = if is_tanh(l) {
                    (0..DIMS[l + 1])
                        .map(|o| delta[o] * (1.0 - acts[l + 1][o] * acts[l + 1][o]))
                        .collect()
                } else {
                    delta.clone()
                };
                let (gw, gb) = &mut grads[l];
                for o in 0..DIMS[l + 1] {
                    gb[o] += dz[o];
                    for i in 0..DIMS[l] {
                        gw[o * DIMS[l] + i] += dz[o] * acts[l][i];
                    }
                }
                let w = &params[l].0;
                delta = (0..DIMS[l])
                    .map(|i| (0..DIMS[l + 1]).map(|o| w[o * DIMS[l] + i] * dz[o]).sum())
                    .collect();
            }
        }
        for ((w, b), (gw, gb)) in params.iter_mut().zip(&grads) {
            w.iter_mut().zip(gw).for_each(|(p, g)| *p -= LR * g);
            b.iter_mut().zip(gb).for_each(|(p, g)| *p -= LR * g);
        }
    }
    params
}

/// One buffer per layer of a stage.
type Layers = Vec<Vec<f32>>;

/// Consecutive layers as one pipeline stage, over micro-batches of `rows` samples.
struct MlpStage {
    first: usize,
    w: Vec<Vec<f32>>,
    b: Vec<Vec<f32>>,
    gw: Vec<Vec<f32>>,
    gb: Vec<Vec<f32>>,
    /// Per micro-batch: every layer's input, then the stage's output.
    saved: HashMap<usize, Vec<Vec<f32>>>,
    /// Per micro-batch, between I and W: the layer inputs and pre-activation gradients.
    pending: HashMap<usize, (Layers, Layers)>,
    /// Fail the forward call with this index (counted over the stage's life).
    fail_at: Option<usize>,
    forwards: usize,
}

impl MlpStage {
    fn new(layers: std::ops::Range<usize>) -> Self {
        let (w, b): (Vec<_>, Vec<_>) = layers.clone().map(init).unzip();
        MlpStage {
            first: layers.start,
            gw: w.iter().map(|w| vec![0.0; w.len()]).collect(),
            gb: b.iter().map(|b| vec![0.0; b.len()]).collect(),
            w,
            b,
            saved: HashMap::new(),
            pending: HashMap::new(),
            fail_at: None,
            forwards: 0,
        }
    }

    fn dims(&self, k: usize) -> (usize, usize) {
        (DIMS[self.first + k], DIMS[self.first + k + 1])
    }

    fn sgd(&mut self) {
        for k in 0..self.w.len() {
            for (p, g) in self.w[k].iter_mut().zip(&mut self.gw[k]) {
                *p -= LR * *g;
                *g = 0.0;
            }
            for (p, g) in self.b[k].iter_mut().zip(&mut self.gb[k]) {
                *p -= LR * *g;
                *g = 0.0;
            }
        }
    }
}

impl Stage for MlpStage {
    fn input_len(&self) -> usize {
        DIMS[self.first] * BATCH
    }

    fn output_len(&self) -> usize {
        DIMS[self.first + self.w.len()] * BATCH
    }

    fn forward(&mut self, mb: usize, input: &[f32], output: &mut [f32]) -> StageResult {
        self.forwards += 1;
        if self.fail_at == Some(self.forwards) {
            return Err(format!("injected failure in forward of micro-batch {mb}").into());
        }
        let rows = input.len() / DIMS[self.first];
        let mut acts = vec![input.to_vec()];
        for k in 0..self.w.len() {
            let (i_dim, o_dim) = self.dims(k);
            let a = &acts[k];
            let mut z = vec![0.0f32; rows * o_dim];
            for r in 0..rows {
                for o in 0..o_dim {
                    let mut s = self.b[k][o];
                    for i in 0..i_dim {
                        s += self.w[k][o * i_dim + i] * a[r * i_dim + i];
                    }
                    z[r * o_dim + o] = if is_tanh(self.first + k) { s.tanh() } else { s };
                }
            }
            acts.push(z);
        }
        let y = acts.last().ok_or("no layers")?;
        if y.len() != output.len() {
            return Err("output size".into());
        }
        output.copy_from_slice(y);
        self.saved.insert(mb, acts);
        Ok(())
    }

    fn backward(&mut self, mb: usize, grad_output: &[f32], grad_input: &mut [f32]) -> StageResult {
        self.backward_input(mb, grad_output, grad_input)?;
        self.backward_weight(mb)
    }

    fn splits_backward(&self) -> bool {
        true
    }

    fn backward_input(
        &mut self,
        mb: usize,
        grad_output: &[f32],
        grad_input: &mut [f32],
    ) -> StageResult {
        let acts = self.saved.remove(&mb).ok_or("backward without forward")?;
        let rows = acts[0].len() / DIMS[self.first];
        let mut delta = grad_output.to_vec();
        let mut dzs = vec![Vec::new(); self.w.len()];
        for k in (0..self.w.len()).rev() {
            let (i_dim, o_dim) = self.dims(k);
            let out = &acts[k + 1];
            let dz: Vec<f32> = if is_tanh(self.first + k) {
                delta
                    .iter()
                    .zip(out)
                    .map(|(d, y)| d * (1.0 - y * y))
                    .collect()
            } else {
                delta
            };
            let mut prev = vec![0.0f32; rows * i_dim];
            for r in 0..rows {
                for i in 0..i_dim {
                    prev[r * i_dim + i] = (0..o_dim)
                        .map(|o| self.w[k][o * i_dim + i] * dz[r * o_dim + o])
                        .sum();
                }
            }
            dzs[k] = dz;
            delta = prev;
        }
        grad_input.copy_from_slice(&delta);
        self.pending.insert(mb, (acts, dzs));
        Ok(())
    }

    fn backward_weight(&mut self, mb: usize) -> StageResult {
        let (acts, dzs) = self.pending.remove(&mb).ok_or("W without I")?;
        let rows = acts[0].len() / DIMS[self.first];
        for k in 0..self.w.len() {
            let (i_dim, o_dim) = self.dims(k);
            for r in 0..rows {
                for o in 0..o_dim {
                    let d = dzs[k][r * o_dim + o];
                    self.gb[k][o] += d;
                    for i in 0..i_dim {
                        self.gw[k][o * i_dim + i] += d * acts[k][r * i_dim + i];
                    }
                }
            }
        }
        Ok(())
    }
}

/// Unwraps in a rank's thread: `run_world` reports the panic as that rank's failure.
fn ok<T>(r: Result<T, Error>) -> T {
    r.unwrap_or_else(|e| panic!("{e}"))
}

/// Stage `s` of `n`: its layers.
fn layers_of(s: usize, n: usize) -> std::ops::Range<usize> {
    let per = LAYERS / n;
    s * per..(s + 1) * per
}

/// Per micro-batch sizes: the stage's `input_len` is for the whole batch above; here we fix
/// the micro-batch size instead.
struct Sized {
    inner: MlpStage,
    rows: usize,
}

impl Stage for Sized {
    fn input_len(&self) -> usize {
        self.inner.input_len() / BATCH * self.rows
    }
    fn output_len(&self) -> usize {
        self.inner.output_len() / BATCH * self.rows
    }
    fn forward(&mut self, mb: usize, x: &[f32], y: &mut [f32]) -> StageResult {
        self.inner.forward(mb, x, y)
    }
    fn backward(&mut self, mb: usize, g: &[f32], gx: &mut [f32]) -> StageResult {
        self.inner.backward(mb, g, gx)
    }
    fn splits_backward(&self) -> bool {
        true
    }
    fn backward_input(&mut self, mb: usize, g: &[f32], gx: &mut [f32]) -> StageResult {
        self.inner.backward_input(mb, g, gx)
    }
    fn backward_weight(&mut self, mb: usize) -> StageResult {
        self.inner.backward_weight(mb)
    }
}

fn stages_for(schedule: &Schedule, rank: usize) -> Vec<Sized> {
    let n = schedule.num_stages();
    let rows = BATCH / schedule.num_microbatches();
    schedule
        .stages_of(rank)
        .into_iter()
        .map(|s| Sized {
            inner: MlpStage::new(layers_of(s, n)),
            rows,
        })
        .collect()
}

/// [`MlpStage`]'s parameters for DDP: each layer's weight and bias.
fn param_infos(st: &MlpStage) -> Vec<ParamInfo> {
    (0..st.w.len())
        .flat_map(|k| {
            let (i, o) = st.dims(k);
            let l = st.first + k;
            [
                ParamInfo::new(format!("layer{l}.weight"), &[o, i]),
                ParamInfo::new(format!("layer{l}.bias"), &[o]),
            ]
        })
        .collect()
}

/// Mean squared error over a micro-batch, against its rows of the targets.
fn mse(targets: &[f32]) -> impl FnMut(usize, &[f32], &mut [f32]) -> StageResult<f32> + '_ {
    move |mb, y, g| {
        let t = targets
            .get(mb * y.len()..(mb + 1) * y.len())
            .ok_or("targets")?;
        let n = y.len() as f32;
        let mut l = 0.0;
        for k in 0..y.len() {
            let d = y[k] - t[k];
            l += d * d / n;
            g[k] = 2.0 * d / n;
        }
        Ok(l)
    }
}

/// Trains `STEPS` steps with `schedule` on its ranks; returns every layer's parameters.
fn train(schedule: &Schedule) -> Vec<(Vec<f32>, Vec<f32>)> {
    let (xs, ys) = batch();
    let per_rank = run_world(schedule.num_ranks(), |pg| {
        let rank = pg.rank();
        let mut pipe = ok(Pipeline::new(
            pg,
            schedule.clone(),
            stages_for(schedule, rank),
        ));
        let mut loss = mse(&ys);
        let mut losses = Vec::new();
        for _ in 0..STEPS {
            let out = ok(pipe.step(&xs, &mut loss));
            losses.push(out.loss);
            pipe.stages_mut().iter_mut().for_each(|s| s.inner.sgd());
        }
        let stages: Vec<(usize, Layers, Layers)> = schedule
            .stages_of(rank)
            .into_iter()
            .zip(pipe.stages())
            .map(|(s, st)| (s, st.inner.w.clone(), st.inner.b.clone()))
            .collect();
        Ok((stages, losses))
    })
    .unwrap();
    let mut params = vec![(Vec::new(), Vec::new()); LAYERS];
    let n = schedule.num_stages();
    for (stages, losses) in per_rank {
        // Only the last stage's rank reports a loss, and it went down.
        if let (Some(Some(first)), Some(Some(last))) = (losses.first(), losses.last()) {
            assert!(last < first, "{}: loss {first} -> {last}", schedule.name());
        }
        for (s, w, b) in stages {
            for (k, (w, b)) in w.into_iter().zip(b).enumerate() {
                params[layers_of(s, n).start + k] = (w, b);
            }
        }
    }
    params
}

fn assert_matches_reference(schedule: &Schedule, want: &[(Vec<f32>, Vec<f32>)]) {
    let got = train(schedule);
    let mut worst = 0.0f32;
    for l in 0..LAYERS {
        assert_eq!(got[l].0.len(), want[l].0.len(), "layer {l} missing");
        for (a, b) in got[l]
            .0
            .iter()
            .chain(&got[l].1)
            .zip(want[l].0.iter().chain(&want[l].1))
        {
            worst = worst.max((a - b).abs());
        }
    }
    assert!(
        worst <= 1e-5,
        "{} p={} m={}: max |Δparam| = {worst}",
        schedule.name(),
        schedule.num_ranks(),
        schedule.num_microbatches()
    );
    // The parameters moved, so the comparison is not vacuous.
    let moved = want[0]
        .0
        .iter()
        .zip(&init(0).0)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f32::max);
    assert!(moved > 1e-2, "first layer moved by {moved} only");
}

fn for_each_shape(make: impl Fn(usize, usize) -> Schedule) {
    let want = reference();
    for p in [2, 4] {
        for m in [1, 4, 8] {
            assert_matches_reference(&make(p, m), &want);
        }
    }
}

#[test]
fn gpipe_matches_one_process() {
    for_each_shape(|p, m| Schedule::gpipe(p, m).unwrap());
}

#[test]
fn one_f_one_b_matches_one_process() {
    for_each_shape(|p, m| Schedule::one_f_one_b(p, m).unwrap());
}

#[test]
fn interleaved_1f1b_matches_one_process() {
    for_each_shape(|p, m| Schedule::interleaved_1f1b(p, 2, m).unwrap());
}

#[test]
fn zero_bubble_h1_matches_one_process() {
    for_each_shape(|p, m| Schedule::zero_bubble_h1(p, m).unwrap());
}

#[test]
fn hand_written_schedule_matches_one_process() {
    // Two stages per rank in a "V" (rank 0: stages 0 and 3), written out by hand.
    let s = Schedule::parse(
        "v-shape",
        vec![0, 1, 1, 0],
        2,
        "0F0 0F1 3F0 3B0 3F1 3B1 0B0 0B1\n1F0 2F0 1F1 2F1 2B0 1B0 2B1 1B1",
    )
    .unwrap();
    assert_matches_reference(&s, &reference());
}

/// One executor runs any valid list: random per-rank orders (random stage placement,
/// whole and split backwards mixed, stages of one rank handing over in memory) train to the
/// same parameters as one process.
#[test]
fn random_schedules_match_one_process() {
    let want = reference();
    for seed in 0..8u64 {
        let mut rng = common::Rng::new(seed ^ 0x5eed);
        let p = 2 + rng.below(3);
        let n = [4, 8][rng.below(2)];
        let m = [1, 2, 4, 8][rng.below(4)];
        assert_matches_reference(&common::random_schedule(seed, p, n, m), &want);
    }
}

/// Short group timeout: a failure must surface as an error naming the culprit, long before.
const SHORT: Duration = Duration::from_secs(20);

#[test]
fn a_failing_stage_makes_every_rank_fail_naming_it() {
    for schedule in [
        Schedule::one_f_one_b(4, 8).unwrap(),
        Schedule::interleaved_1f1b(4, 2, 8).unwrap(),
        Schedule::zero_bubble_h1(4, 8).unwrap(),
    ] {
        let (xs, ys) = batch();
        let results = run_world_with(4, SHORT, |pg| {
            let rank = pg.rank();
            let mut stages = stages_for(&schedule, rank);
            if rank == 2 {
                // Second step, third forward of the stage.
                stages[0].inner.fail_at = Some(schedule.num_microbatches() + 3);
            }
            let mut pipe = ok(Pipeline::new(pg, schedule.clone(), stages));
            let mut loss = mse(&ys);
            for _ in 0..4 {
                if let Err(e) = pipe.step(&xs, &mut loss) {
                    // Returning drops the pipeline and its group: the peers learn of it.
                    return Ok(Err(e));
                }
            }
            Ok(Ok(()))
        })
        .unwrap();
        for (rank, r) in results.into_iter().enumerate() {
            let e = r.expect_err("every rank fails");
            assert_eq!(
                e.failed_rank(),
                Some(2),
                "{} rank {rank}: {e}",
                schedule.name()
            );
            if rank == 2 {
                assert!(matches!(e, Error::Stage { step: 1, .. }), "{e}");
            } else {
                assert!(matches!(e, Error::Pipeline { step: 1, .. }), "{e}");
            }
        }
    }
}

#[test]
fn a_rank_leaving_mid_run_makes_every_other_rank_fail_naming_it() {
    let schedule = Schedule::interleaved_1f1b(4, 2, 8).unwrap();
    let (xs, ys) = batch();
    let results = run_world_with(4, SHORT, |pg| {
        let rank = pg.rank();
        let mut pipe = ok(Pipeline::new(
            pg,
            schedule.clone(),
            stages_for(&schedule, rank),
        ));
        let mut loss = mse(&ys);
        // Rank 1 runs one step and leaves (drops its group); the others want three.
        let steps = if rank == 1 { 1 } else { 3 };
        for _ in 0..steps {
            if let Err(e) = pipe.step(&xs, &mut loss) {
                return Ok(Some(e));
            }
        }
        Ok(None)
    })
    .unwrap();
    for (rank, r) in results.into_iter().enumerate() {
        if rank == 1 {
            assert!(r.is_none());
            continue;
        }
        let e = r.expect("every other rank fails");
        assert_eq!(e.failed_rank(), Some(1), "rank {rank}: {e}");
        assert!(matches!(e, Error::Pipeline { step: 1, .. }), "{e}");
    }
}

#[test]
fn setup_disagreements_fail_every_rank() {
    // Rank 1 builds a different schedule.
    let results = run_world(2, |pg| {
        let rank = pg.rank();
        let s = if rank == 0 {
            Schedule::gpipe(2, 4).unwrap()
        } else {
            Schedule::one_f_one_b(2, 4).unwrap()
        };
        let stages = stages_for(&s, rank);
        Ok(Pipeline::new(pg, s, stages).err())
    })
    .unwrap();
    for (rank, e) in results.into_iter().enumerate() {
        let e = e.expect("set-up fails");
        assert!(matches!(e, Error::PipelineSetup { .. }), "{e}");
        assert!(e.to_string().contains(&format!("rank {}", 1 - rank)), "{e}");
    }
    // Rank 1's stage takes a different input size than rank 0's produces.
    let s = Schedule::one_f_one_b(2, 2).unwrap();
    let results = run_world(2, |pg| {
        let rank = pg.rank();
        let mut stages = stages_for(&s, rank);
        if rank == 1 {
            stages[0].rows += 1;
        }
        Ok(Pipeline::new(pg, s.clone(), stages).err())
    })
    .unwrap();
    for e in results {
        let e = e.expect("set-up fails");
        assert!(e.to_string().contains("stage 0 (rank 0) outputs"), "{e}");
    }
    // A zero-bubble schedule, and rank 0's stage cannot split its backward.
    struct Whole(Sized, bool);
    impl Stage for Whole {
        fn input_len(&self) -> usize {
            self.0.input_len()
        }
        fn output_len(&self) -> usize {
            self.0.output_len()
        }
        fn forward(&mut self, mb: usize, x: &[f32], y: &mut [f32]) -> StageResult {
            self.0.forward(mb, x, y)
        }
        fn backward(&mut self, mb: usize, g: &[f32], gx: &mut [f32]) -> StageResult {
            self.0.backward(mb, g, gx)
        }
        fn splits_backward(&self) -> bool {
            self.1
        }
        fn backward_input(&mut self, mb: usize, g: &[f32], gx: &mut [f32]) -> StageResult {
            self.0.backward_input(mb, g, gx)
        }
        fn backward_weight(&mut self, mb: usize) -> StageResult {
            self.0.backward_weight(mb)
        }
    }
    let s = Schedule::zero_bubble_h1(2, 2).unwrap();
    let results = run_world(2, |pg| {
        let rank = pg.rank();
        let stages = stages_for(&s, rank)
            .into_iter()
            .map(|st| Whole(st, rank == 1))
            .collect();
        Ok(Pipeline::new(pg, s.clone(), stages).err())
    })
    .unwrap();
    for (rank, e) in results.into_iter().enumerate() {
        let e = e.expect("set-up fails");
        let want = if rank == 0 {
            "0I0 but stage 0 does not split"
        } else {
            "rank 0 could not"
        };
        assert!(e.to_string().contains(want), "{e}");
    }
}

/// Pipeline × data parallel on a 2-D mesh: 2 replicas of a 2-stage pipeline, each replica on
/// half of the batch, each stage's gradients averaged over its replicas by DDP. Ten steps
/// match one process on the whole batch.
#[test]
fn pipeline_times_ddp_on_a_mesh_matches_one_process() {
    const DP: usize = 2;
    const PP: usize = 2;
    let want = reference();
    for schedule in [
        Schedule::one_f_one_b(PP, 4).unwrap(),
        Schedule::zero_bubble_h1(PP, 2).unwrap(),
        Schedule::interleaved_1f1b(PP, 2, 4).unwrap(),
    ] {
        let (xs, ys) = batch();
        let per_rank = run_world(DP * PP, |pg| {
            // Row-major: ranks 0, 1 form replica 0's pipeline, ranks 2, 3 replica 1's.
            let mesh = DeviceMesh::new(&pg, &[("dp", DP), ("pp", PP)])?;
            let (replica, pp_rank) = (mesh.coordinate()[0], mesh.coordinate()[1]);
            let half = BATCH / DP;
            let xs = &xs[replica * half * DIMS[0]..(replica + 1) * half * DIMS[0]];
            let ys = &ys[replica * half * DIMS[LAYERS]..(replica + 1) * half * DIMS[LAYERS]];
            let rows = half / schedule.num_microbatches();
            let n = schedule.num_stages();
            let stages: Vec<Sized> = schedule
                .stages_of(pp_rank)
                .into_iter()
                .map(|s| Sized {
                    inner: MlpStage::new(layers_of(s, n)),
                    rows,
                })
                .collect();
            let mut pipe = ok(Pipeline::new(
                mesh.dim("pp").clone(),
                schedule.clone(),
                stages,
            ));
            // One DDP per local stage, over the stage's replicas.
            let mut ddps: Vec<Ddp> = pipe
                .stages_mut()
                .iter_mut()
                .map(|st| {
                    let infos = param_infos(&st.inner);
                    let MlpStage { w, b, .. } = &mut st.inner;
                    let mut values: Vec<&mut [f32]> = w
                        .iter_mut()
                        .zip(b.iter_mut())
                        .flat_map(|(w, b)| [w.as_mut_slice(), b.as_mut_slice()])
                        .collect();
                    ok(Ddp::new(
                        mesh.dim("dp").clone(),
                        infos,
                        DdpOptions::default(),
                        &mut values,
                    ))
                })
                .collect();
            let mut loss = mse(ys);
            for _ in 0..STEPS {
                ok(pipe.step(xs, &mut loss));
                for (st, ddp) in pipe.stages_mut().iter_mut().zip(&mut ddps) {
                    let MlpStage { gw, gb, .. } = &mut st.inner;
                    let mut grads: Vec<&mut [f32]> = gw
                        .iter_mut()
                        .zip(gb.iter_mut())
                        .flat_map(|(w, b)| [w.as_mut_slice(), b.as_mut_slice()])
                        .collect();
                    // As a backward pass would: last parameter first.
                    for i in (0..grads.len()).rev() {
                        ok(ddp.mark_ready(i, grads[i]));
                    }
                    ok(ddp.finish(&mut grads));
                    st.inner.sgd();
                }
            }
            let stages: Vec<(usize, Layers, Layers)> = schedule
                .stages_of(pp_rank)
                .into_iter()
                .zip(pipe.stages())
                .map(|(s, st)| (s, st.inner.w.clone(), st.inner.b.clone()))
                .collect();
            Ok(stages)
        })
        .unwrap();
        let n = schedule.num_stages();
        for (rank, stages) in per_rank.into_iter().enumerate() {
            for (s, w, b) in stages {
                for (k, (w, b)) in w.iter().zip(&b).enumerate() {
                    let (ww, wb) = &want[layers_of(s, n).start + k];
                    let worst = w
                        .iter()
                        .chain(b)
                        .zip(ww.iter().chain(wb))
                        .map(|(a, b)| (a - b).abs())
                        .fold(0.0, f32::max);
                    assert!(
                        worst <= 1e-5,
                        "{} rank {rank} stage {s}: max |Δparam| = {worst}",
                        schedule.name()
                    );
                }
            }
        }
    }
}

/// The candle adapter: the same MLP as candle blocks, cut at split points, trains to the
/// same parameters as the hand-written reference.
#[cfg(feature = "candle")]
mod candle_stages {
    use super::*;
    use candle_core::{Device, Tensor, Var};
    use dist_parallel::pipeline::{CandleBlock, CandleStage, split_blocks};

    fn blocks() -> candle_core::Result<Vec<CandleBlock>> {
        (0..LAYERS)
            .map(|l| {
                let (w, b) = init(l);
                let w = Var::from_vec(w, (DIMS[l + 1], DIMS[l]), &Device::Cpu)?;
                let b = Var::from_vec(b, DIMS[l + 1], &Device::Cpu)?;
                // Clones share the variables' storage, so SGD updates reach the closure.
                let (wt, bt) = (w.as_tensor().clone(), b.as_tensor().clone());
                let tanh = is_tanh(l);
                let module = move |x: &Tensor| {
                    let z = x.matmul(&wt.t()?)?.broadcast_add(&bt)?;
                    if tanh { z.tanh() } else { Ok(z) }
                };
                Ok(CandleBlock::new(module, vec![w, b]))
            })
            .collect()
    }

    fn stages(schedule: &Schedule, rank: usize) -> Vec<CandleStage> {
        let n = schedule.num_stages();
        let per = LAYERS / n;
        let points: Vec<usize> = (1..n).map(|i| i * per).collect();
        let rows = BATCH / schedule.num_microbatches();
        let pieces = ok(split_blocks(blocks().unwrap(), &points));
        let mine = schedule.stages_of(rank);
        pieces
            .into_iter()
            .enumerate()
            .filter(|(s, _)| mine.contains(s))
            .map(|(s, piece)| {
                let (first, last) = (s * per, (s + 1) * per);
                CandleStage::new(
                    piece,
                    &[rows, DIMS[first]],
                    &[rows, DIMS[last]],
                    Device::Cpu,
                )
            })
            .collect()
    }

    #[test]
    fn candle_stages_match_one_process() {
        let want = reference();
        let (xs, ys) = batch();
        for schedule in [
            Schedule::gpipe(2, 4).unwrap(),
            Schedule::one_f_one_b(4, 8).unwrap(),
            Schedule::interleaved_1f1b(2, 2, 4).unwrap(),
        ] {
            let n = schedule.num_stages();
            let per_rank = run_world(schedule.num_ranks(), |pg| {
                let rank = pg.rank();
                let mut pipe = ok(Pipeline::new(pg, schedule.clone(), stages(&schedule, rank)));
                let mut loss = mse(&ys);
                for _ in 0..STEPS {
                    ok(pipe.step(&xs, &mut loss));
                    for st in pipe.stages_mut() {
                        st.sgd_step(f64::from(LR)).unwrap();
                    }
                }
                let params: Vec<(usize, Vec<Vec<f32>>)> = schedule
                    .stages_of(rank)
                    .into_iter()
                    .zip(pipe.stages())
                    .map(|(s, st)| {
                        let v = st
                            .vars()
                            .map(|v| v.as_tensor().flatten_all()?.to_vec1::<f32>())
                            .collect::<candle_core::Result<Vec<_>>>()
                            .unwrap();
                        (s, v)
                    })
                    .collect();
                Ok(params)
            })
            .unwrap();
            for (s, vars) in per_rank.into_iter().flatten() {
                for (k, pair) in vars.chunks(2).enumerate() {
                    let l = s * (LAYERS / n) + k;
                    let got = pair[0].iter().chain(&pair[1]);
                    let worst = got
                        .zip(want[l].0.iter().chain(&want[l].1))
                        .map(|(a, b)| (a - b).abs())
                        .fold(0.0, f32::max);
                    assert!(worst <= 1e-5, "{} layer {l}: {worst}", schedule.name());
                }
            }
        }
    }

    #[test]
    fn candle_stages_refuse_zero_bubble_at_setup() {
        let schedule = Schedule::zero_bubble_h1(2, 2).unwrap();
        let errs = run_world(2, |pg| {
            let rank = pg.rank();
            Ok(Pipeline::new(pg, schedule.clone(), stages(&schedule, rank)).err())
        })
        .unwrap();
        for e in errs {
            assert!(matches!(e, Some(Error::PipelineSetup { .. })), "{e:?}");
        }
        assert!(split_blocks(vec![1, 2, 3], &[2, 1]).is_err());
        assert!(split_blocks(vec![1, 2, 3], &[3]).is_err());
        assert_eq!(
            split_blocks(vec![1, 2, 3, 4], &[1, 3]).unwrap(),
            vec![vec![1], vec![2, 3], vec![4]]
        );
    }
}
