//! The executor: runs any validated [`Schedule`] over a [`ProcessGroup`], calling the user's
//! [`Stage`]s and moving activations and gradients with async point-to-point.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use dist_collective::{ProcessGroup, Work};

use crate::{Error, Result};

use super::schedule::{Action, Schedule};

/// What a stage or loss function may fail with: any error, kept whole as the source of
/// [`Error::Stage`].
pub type StageError = Box<dyn std::error::Error + Send + Sync>;

/// `Result` of a stage or loss function.
pub type StageResult<T = ()> = std::result::Result<T, StageError>;

/// One pipeline stage over flat `f32` buffers, per micro-batch.
///
/// The stage keeps what its backward needs (inputs, pre-activations) itself, keyed by
/// micro-batch, and accumulates its weight gradients across a step's micro-batches; the
/// executor never sees parameters, so any framework or hand-written code fits.
pub trait Stage {
    /// Values one micro-batch's input holds (agreed across ranks once, at set-up).
    fn input_len(&self) -> usize;
    /// Values one micro-batch's output holds.
    fn output_len(&self) -> usize;
    /// Computes `output` from `input` for micro-batch `mb`, saving what backward needs.
    fn forward(&mut self, mb: usize, input: &[f32], output: &mut [f32]) -> StageResult;
    /// The whole backward of `mb`: writes the input gradient into `grad_input` and adds the
    /// weight gradients to the stage's accumulators; frees what forward saved.
    fn backward(&mut self, mb: usize, grad_output: &[f32], grad_input: &mut [f32]) -> StageResult;
    /// Whether [`Stage::backward_input`] and [`Stage::backward_weight`] are implemented
    /// (needed by zero-bubble schedules; checked at set-up).
    fn splits_backward(&self) -> bool {
        false
    }
    /// The input-gradient half of backward; keeps what [`Stage::backward_weight`] needs.
    fn backward_input(
        &mut self,
        mb: usize,
        grad_output: &[f32],
        grad_input: &mut [f32],
    ) -> StageResult {
        let _ = (mb, grad_output, grad_input);
        Err("this stage does not split its backward".into())
    }
    /// The weight-gradient half of backward, after [`Stage::backward_input`] of the same `mb`.
    fn backward_weight(&mut self, mb: usize) -> StageResult {
        let _ = mb;
        Err("this stage does not split its backward".into())
    }
}

/// The loss on the last stage: for micro-batch `mb`'s `output`, returns the loss (its mean
/// over the micro-batch) and writes its gradient with respect to `output` into `grad_output`.
/// The executor scales that gradient by `1/m`, so that accumulated weight gradients equal one
/// batch's gradient of the mean loss.
pub trait Loss {
    /// See the trait docs.
    fn loss(&mut self, mb: usize, output: &[f32], grad_output: &mut [f32]) -> StageResult<f32>;
}

impl<F> Loss for F
where
    F: FnMut(usize, &[f32], &mut [f32]) -> StageResult<f32>,
{
    fn loss(&mut self, mb: usize, output: &[f32], grad_output: &mut [f32]) -> StageResult<f32> {
        self(mb, output, grad_output)
    }
}

/// The point-to-point tags the executor uses start here (activations and gradients of each
/// (stage, micro-batch) get their own tag), so user messages on the same group with smaller
/// tags never meet them.
pub const PIPELINE_TAG_BASE: u32 = 1 << 30;

/// What one step measured on this rank.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PipelineStep {
    /// Mean loss over the step's micro-batches, on the rank holding the last stage.
    pub loss: Option<f32>,
    /// Time spent in stage and loss functions.
    pub compute: Duration,
    /// Time spent waiting for activations, gradients and the step's last sends.
    pub wait: Duration,
}

/// Runs a [`Schedule`] on this rank: owns the rank's stages (in [`Schedule::stages_of`]
/// order) and the group.
///
/// Build it with the same schedule on every rank; [`Pipeline::new`] checks that (a
/// fingerprint) and agrees every stage's input and output sizes once, so messages carry no
/// shapes. Each [`Pipeline::step`] posts every receive the rank's list implies up front, runs
/// the actions in order (stages on one rank hand data over in memory), posts each send as soon
/// as its data exists and waits for the sends at the end. Every wait is bounded by the group's
/// timeout; a peer that dies fails the step with an error naming it
/// ([`Error::failed_rank`]). After a failed step the group and the pipeline must be
/// re-created; dropping the pipeline (its group) is what tells the other ranks.
///
/// Memory: the activations a stage keeps between forward and backward follow the schedule
/// ([`SimReport::peak_activations`](super::SimReport::peak_activations): at most `p` for
/// 1F1B); the receive buffers, posted at the start of the step so that no rank's
/// point-to-point engine ever waits on a receive not yet posted, are one per incoming
/// message of the step (`m` per neighbouring stage and direction).
#[derive(Debug)]
pub struct Pipeline<S> {
    pg: ProcessGroup,
    schedule: Schedule,
    stages: Vec<S>,
    /// Stage id → index in `stages`, for the stages this rank holds.
    local: Vec<Option<usize>>,
    /// Every stage's (input, output) length.
    shapes: Vec<(usize, usize)>,
    step: u64,
    failed: bool,
}

/// A posted send or receive: the position and action it belongs to, and its handle.
type Pending = (usize, Action, Work<Vec<f32>>);

/// Once one operation of the group's point-to-point engine fails (a peer lost), gloo refuses
/// every later one with `Aborted`, whose cause is only text. When `e` names no culprit, the
/// operation that failed first is among this step's other sends and receives, already
/// complete: report that one instead, so the error names the rank that died.
fn root_cause(
    e: Error,
    recvs: &mut HashMap<(usize, usize, usize), Pending>,
    sends: &mut Vec<Pending>,
) -> Error {
    if e.failed_rank().is_some() {
        return e;
    }
    let Error::Pipeline { rank, step, .. } = e else {
        return e;
    };
    let done: Vec<Pending> = recvs
        .drain()
        .map(|(_, p)| p)
        .chain(sends.drain(..))
        .filter(|(_, _, w)| w.is_completed())
        .collect();
    for (position, action, w) in done {
        if let Err(source) = w.wait() {
            let cause = Error::Pipeline {
                rank,
                step,
                position,
                action,
                what: "a send or receive of this step",
                source,
            };
            if cause.failed_rank().is_some() {
                return cause;
            }
        }
    }
    e
}

/// Tag kinds: the activation into a stage, the gradient of a stage's output.
const ACT: usize = 0;
const GRAD: usize = 1;

impl<S: Stage> Pipeline<S> {
    /// Sets up the pipeline; a collective over `pg` (every rank calls it). `stages` are the
    /// stages this rank holds, in [`Schedule::stages_of`] order.
    ///
    /// Every rank fails together (naming the rank at fault) when the schedules differ, a rank
    /// passed the wrong number of stages or a stage without split backward for a zero-bubble
    /// schedule, or neighbouring stages disagree on sizes.
    pub fn new(pg: ProcessGroup, schedule: Schedule, stages: Vec<S>) -> Result<Self> {
        let rank = pg.rank();
        let n = schedule.num_stages();
        let mine = schedule.stages_of(rank);
        let local_problem = if schedule.num_ranks() != pg.size() {
            Some(format!(
                "the schedule has {} ranks but the group has {}",
                schedule.num_ranks(),
                pg.size()
            ))
        } else if stages.len() != mine.len() {
            Some(format!(
                "this rank holds stages {mine:?} but {} stage objects were given",
                stages.len()
            ))
        } else if (n * schedule.num_microbatches())
            .checked_mul(2)
            .is_none_or(|k| k >= (u32::MAX - PIPELINE_TAG_BASE) as usize)
        {
            Some("too many stages × micro-batches for the point-to-point tag space".into())
        } else {
            schedule.actions(rank).iter().find_map(|a| {
                let split = matches!(
                    a,
                    Action::BackwardInput { .. } | Action::BackwardWeight { .. }
                );
                let i = mine.iter().position(|&s| s == a.stage())?;
                (split && !stages[i].splits_backward()).then(|| {
                    format!(
                        "the schedule runs {a} but stage {} does not split its backward",
                        a.stage()
                    )
                })
            })
        };
        let setup = |reason: String| Error::PipelineSetup { rank, reason };
        // Phase 1: everyone learns whether everyone can go on, with one fixed-size exchange.
        let fp = schedule.fingerprint() as i64;
        let mut all = vec![0i64; 2 * pg.size()];
        pg.all_gather_into(&[fp, i64::from(local_problem.is_some())], &mut all)?;
        if let Some(reason) = local_problem {
            return Err(setup(reason));
        }
        if let Some(q) = (0..pg.size()).find(|&q| all[2 * q] != fp) {
            return Err(setup(format!(
                "rank {q} built a different schedule (fingerprint {:#x}, this rank {:#x}); \
                 every rank must build the same one",
                all[2 * q] as u64,
                fp as u64
            )));
        }
        if let Some(q) = (0..pg.size()).find(|&q| all[2 * q + 1] != 0) {
            return Err(setup(format!("rank {q} could not set up its stages")));
        }
        // Phase 2: every stage's sizes, from the rank holding it.
        let mut sizes = vec![0i64; 2 * n];
        for (i, &s) in mine.iter().enumerate() {
            sizes[2 * s] = stages[i].input_len() as i64;
            sizes[2 * s + 1] = stages[i].output_len() as i64;
        }
        let mut gathered = vec![0i64; 2 * n * pg.size()];
        pg.all_gather_into(&sizes, &mut gathered)?;
        let shapes: Vec<(usize, usize)> = (0..n)
            .map(|s| {
                let q = schedule.rank_of(s).unwrap_or(0);
                let at = q * 2 * n + 2 * s;
                (gathered[at] as usize, gathered[at + 1] as usize)
            })
            .collect();
        for s in 0..n.saturating_sub(1) {
            if shapes[s].1 != shapes[s + 1].0 {
                return Err(setup(format!(
                    "stage {s} (rank {}) outputs {} values per micro-batch but stage {} (rank {}) \
                     takes {}",
                    schedule.rank_of(s).unwrap_or(0),
                    shapes[s].1,
                    s + 1,
                    schedule.rank_of(s + 1).unwrap_or(0),
                    shapes[s + 1].0
                )));
            }
        }
        let mut local = vec![None; n];
        for (i, &s) in mine.iter().enumerate() {
            local[s] = Some(i);
        }
        Ok(Pipeline {
            pg,
            schedule,
            stages,
            local,
            shapes,
            step: 0,
            failed: false,
        })
    }

    /// The schedule it runs.
    pub fn schedule(&self) -> &Schedule {
        &self.schedule
    }

    /// The group it runs over.
    pub fn group(&self) -> &ProcessGroup {
        &self.pg
    }

    /// This rank's stages (to read or update parameters between steps).
    pub fn stages(&self) -> &[S] {
        &self.stages
    }

    /// This rank's stages, mutably (the optimizer step, zeroing gradients).
    pub fn stages_mut(&mut self) -> &mut [S] {
        &mut self.stages
    }

    /// Gives the stages and the group back.
    pub fn into_parts(self) -> (ProcessGroup, Vec<S>) {
        (self.pg, self.stages)
    }

    /// Runs one step: the forward and backward of every micro-batch, accumulating weight
    /// gradients in the stages. `inputs` is the whole batch (`m` micro-batches of stage 0's
    /// input size, one after another) on the rank holding stage 0, and is ignored elsewhere;
    /// `loss` runs on the rank holding the last stage.
    pub fn step(&mut self, inputs: &[f32], loss: &mut dyn Loss) -> Result<PipelineStep> {
        let rank = self.pg.rank();
        if self.failed {
            return Err(Error::InvalidArgument {
                rank,
                op: "Pipeline::step",
                reason: "an earlier step failed; re-create the group and the pipeline".into(),
            });
        }
        let m = self.schedule.num_microbatches();
        if self.local[0].is_some() && inputs.len() != m * self.shapes[0].0 {
            // The other ranks go into the step and wait for this one's activations until the
            // group's timeout fails them: the pipeline is out of step on every rank after.
            self.failed = true;
            return Err(Error::InvalidArgument {
                rank,
                op: "Pipeline::step",
                reason: format!(
                    "inputs hold {} values; {m} micro-batches of {} were expected",
                    inputs.len(),
                    self.shapes[0].0
                ),
            });
        }
        let r = self.run_step(inputs, loss);
        self.step += 1;
        if r.is_err() {
            self.failed = true;
        }
        r
    }

    fn tag(&self, kind: usize, stage: usize, mb: usize) -> u32 {
        let m = self.schedule.num_microbatches();
        // In range: `new` checked 2·stages·m against the tag space.
        PIPELINE_TAG_BASE + ((stage * m + mb) * 2 + kind) as u32
    }

    fn run_step(&mut self, inputs: &[f32], loss: &mut dyn Loss) -> Result<PipelineStep> {
        let rank = self.pg.rank();
        let step = self.step;
        let n = self.schedule.num_stages();
        let m = self.schedule.num_microbatches();
        let actions = self.schedule.actions(rank).to_vec();
        let here = |s: usize| self.schedule.rank_of(s) == Some(rank);
        let comm = |position: usize, action: Action, what: &'static str| {
            move |source| Error::Pipeline {
                rank,
                step,
                position,
                action,
                what,
                source,
            }
        };
        // Every receive this step implies, posted now so that no sender ever waits on us.
        let mut recvs: HashMap<(usize, usize, usize), Pending> = HashMap::new();
        for (pos, &a) in actions.iter().enumerate() {
            let (s, mb) = (a.stage(), a.mb());
            let (kind, from, len) = match a {
                Action::Forward { .. } if s > 0 && !here(s - 1) => (ACT, s - 1, self.shapes[s].0),
                Action::Backward { .. } | Action::BackwardInput { .. }
                    if s + 1 < n && !here(s + 1) =>
                {
                    (GRAD, s + 1, self.shapes[s].1)
                }
                _ => continue,
            };
            let peer = self.schedule.rank_of(from).unwrap_or(0);
            let w = self
                .pg
                .irecv(vec![0f32; len], peer, self.tag(kind, s, mb))
                .map_err(comm(pos, a, "posting a receive"))?;
            recvs.insert((kind, s, mb), (pos, a, w));
        }
        // Data handed between stages on this rank, and the last stage's loss gradients.
        let mut acts: HashMap<(usize, usize), Vec<f32>> = HashMap::new();
        let mut grads: HashMap<(usize, usize), Vec<f32>> = HashMap::new();
        let mut sends: Vec<Pending> = Vec::new();
        let mut out = PipelineStep::default();
        let mut loss_sum = 0.0f32;
        let scale = 1.0 / m as f32;
        for (pos, &a) in actions.iter().enumerate() {
            let (s, mb) = (a.stage(), a.mb());
            let stage_err = |source: StageError| Error::Stage {
                rank,
                step,
                position: pos,
                action: a,
                source,
            };
            let Some(li) = self.local.get(s).copied().flatten() else {
                // Validation put every action on the rank holding its stage.
                return Err(stage_err("stage not held by this rank".into()));
            };
            // Takes the data `a` needs: from this rank, or from its posted receive.
            let mut take = |kind: usize,
                            map: &mut HashMap<(usize, usize), Vec<f32>>,
                            out: &mut PipelineStep|
             -> Result<Vec<f32>> {
                if let Some(v) = map.remove(&(s, mb)) {
                    return Ok(v);
                }
                let Some((_, _, w)) = recvs.remove(&(kind, s, mb)) else {
                    return Err(stage_err("its input was never produced".into()));
                };
                let t = Instant::now();
                let what = if kind == ACT {
                    "receiving its input activations"
                } else {
                    "receiving its output gradient"
                };
                match w.wait() {
                    Ok(v) => {
                        out.wait += t.elapsed();
                        Ok(v)
                    }
                    Err(e) => Err(root_cause(comm(pos, a, what)(e), &mut recvs, &mut sends)),
                }
            };
            match a {
                Action::Forward { .. } => {
                    let (in_len, out_len) = self.shapes[s];
                    let owned;
                    let input: &[f32] = if s == 0 {
                        &inputs[mb * in_len..(mb + 1) * in_len]
                    } else {
                        owned = take(ACT, &mut acts, &mut out)?;
                        &owned
                    };
                    let mut y = vec![0f32; out_len];
                    let t = Instant::now();
                    self.stages[li]
                        .forward(mb, input, &mut y)
                        .map_err(stage_err)?;
                    if s + 1 == n {
                        let mut g = vec![0f32; out_len];
                        loss_sum += loss.loss(mb, &y, &mut g).map_err(stage_err)?;
                        g.iter_mut().for_each(|x| *x *= scale);
                        grads.insert((s, mb), g);
                        out.compute += t.elapsed();
                    } else {
                        out.compute += t.elapsed();
                        if here(s + 1) {
                            acts.insert((s + 1, mb), y);
                        } else {
                            let peer = self.schedule.rank_of(s + 1).unwrap_or(0);
                            let w = self
                                .pg
                                .isend(y, peer, self.tag(ACT, s + 1, mb))
                                .map_err(comm(pos, a, "sending its output activations"))?;
                            sends.push((pos, a, w));
                        }
                    }
                }
                Action::Backward { .. } | Action::BackwardInput { .. } => {
                    let g = take(GRAD, &mut grads, &mut out)?;
                    let mut gin = vec![0f32; self.shapes[s].0];
                    let t = Instant::now();
                    let st = &mut self.stages[li];
                    if matches!(a, Action::Backward { .. }) {
                        st.backward(mb, &g, &mut gin)
                    } else {
                        st.backward_input(mb, &g, &mut gin)
                    }
                    .map_err(stage_err)?;
                    out.compute += t.elapsed();
                    if s > 0 {
                        if here(s - 1) {
                            grads.insert((s - 1, mb), gin);
                        } else {
                            let peer = self.schedule.rank_of(s - 1).unwrap_or(0);
                            let w = self
                                .pg
                                .isend(gin, peer, self.tag(GRAD, s - 1, mb))
                                .map_err(comm(pos, a, "sending its input gradient"))?;
                            sends.push((pos, a, w));
                        }
                    }
                }
                Action::BackwardWeight { .. } => {
                    let t = Instant::now();
                    self.stages[li].backward_weight(mb).map_err(stage_err)?;
                    out.compute += t.elapsed();
                }
            }
        }
        let t = Instant::now();
        while !sends.is_empty() {
            let (pos, a, w) = sends.remove(0);
            if let Err(e) = w.wait() {
                let e = comm(pos, a, "completing a send")(e);
                return Err(root_cause(e, &mut recvs, &mut sends));
            }
        }
        out.wait += t.elapsed();
        if self.local[n - 1].is_some() {
            out.loss = Some(loss_sum * scale);
        }
        Ok(out)
    }
}
