//! The simulator: replays a schedule's per-rank orders against each other with given stage
//! times, to find deadlocks (for validation) and to compute makespan, bubble fraction and peak
//! in-flight activations. Pure: no I/O, no clocks.

use crate::{Error, Result};

use super::schedule::{Action, Schedule};

/// How long one stage's work takes for one micro-batch, in any unit.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StageCost {
    /// Forward.
    pub forward: f64,
    /// The whole backward (input and weight gradients), as [`Action::Backward`] runs it.
    pub backward: f64,
    /// The weight-gradient part of `backward` ([`Action::BackwardWeight`]); the input part
    /// ([`Action::BackwardInput`]) takes `backward - weight`.
    pub weight: f64,
}

impl StageCost {
    /// A stage taking `forward`, `backward` (of which `weight` is the weight half).
    pub fn new(forward: f64, backward: f64, weight: f64) -> Self {
        StageCost {
            forward,
            backward,
            weight,
        }
    }

    fn of(&self, a: &Action) -> f64 {
        match a {
            Action::Forward { .. } => self.forward,
            Action::Backward { .. } => self.backward,
            Action::BackwardInput { .. } => self.backward - self.weight,
            Action::BackwardWeight { .. } => self.weight,
        }
    }
}

/// What a simulated step looks like.
#[derive(Clone, Debug, PartialEq)]
pub struct SimReport {
    /// Time from the first action's start to the last one's end.
    pub makespan: f64,
    /// Share of rank-time spent idle: `1 - Σ busy / (ranks · makespan)`.
    pub bubble: f64,
    /// Each rank's busy time.
    pub busy: Vec<f64>,
    /// Each rank's peak number of (stage, micro-batch) activations held: a forward adds one,
    /// its backward (or input backward) releases it.
    pub peak_activations: Vec<usize>,
    /// Each rank's actions with their start and end times, in its order.
    pub timeline: Vec<Vec<(Action, f64, f64)>>,
}

impl SimReport {
    /// The largest of [`SimReport::peak_activations`].
    pub fn max_peak_activations(&self) -> usize {
        self.peak_activations.iter().copied().max().unwrap_or(0)
    }
}

impl Schedule {
    /// Simulates one step with `costs[s]` the cost of stage `s` (one entry per stage) and
    /// instantaneous communication.
    pub fn simulate(&self, costs: &[StageCost]) -> Result<SimReport> {
        self.simulate_with_latency(costs, 0.0)
    }

    /// [`Schedule::simulate`] where data crossing ranks arrives `latency` after it was
    /// produced (stages on one rank hand over at once): the schedules differ in how much of
    /// it lands on their critical path.
    pub fn simulate_with_latency(&self, costs: &[StageCost], latency: f64) -> Result<SimReport> {
        let bad = |reason: String| Error::ScheduleConfig {
            schedule: "simulate",
            reason,
        };
        if costs.len() != self.num_stages() {
            return Err(bad(format!(
                "{} stage costs given for {} stages",
                costs.len(),
                self.num_stages()
            )));
        }
        if let Some((s, c)) = costs.iter().enumerate().find(|(_, c)| {
            ![c.forward, c.backward, c.weight]
                .iter()
                .all(|x| x.is_finite() && *x >= 0.0)
                || c.weight > c.backward
        }) {
            return Err(bad(format!(
                "stage {s}: costs must be finite, non-negative and weight ≤ backward: {c:?}"
            )));
        }
        if !(latency.is_finite() && latency >= 0.0) {
            return Err(bad(format!(
                "latency must be finite and non-negative: {latency}"
            )));
        }
        run(self, Some(costs), latency)
    }

    /// [`Schedule::simulate`] with every stage costing the same.
    pub fn simulate_uniform(&self, cost: StageCost) -> Result<SimReport> {
        self.simulate(&vec![cost; self.num_stages()])
    }
}

/// Replays the schedule; unit costs when `costs` is `None` (validation only needs the order).
/// A deadlock is [`Error::InvalidSchedule`] naming the first stuck rank, its position and
/// action, and what it waits for.
pub(crate) fn run(s: &Schedule, costs: Option<&[StageCost]>, latency: f64) -> Result<SimReport> {
    let (p, n, m) = (s.num_ranks(), s.num_stages(), s.num_microbatches());
    let unit = StageCost::new(1.0, 2.0, 1.0);
    let cost = |a: &Action| costs.and_then(|c| c.get(a.stage())).unwrap_or(&unit).of(a);
    let idx = |st: usize, mb: usize| st * m + mb;
    // Finish times of each (stage, mb)'s forward and of its input gradient (B or I).
    let mut fin_f: Vec<Option<f64>> = vec![None; n * m];
    let mut fin_b: Vec<Option<f64>> = vec![None; n * m];
    let mut ptr = vec![0usize; p];
    let mut free = vec![0.0f64; p];
    let mut timeline: Vec<Vec<(Action, f64, f64)>> = vec![Vec::new(); p];
    // When `a`'s inputs are ready, or None while they are not: the upstream forward, or the
    // downstream input gradient (local prerequisites are guaranteed by validation order).
    let ready = |a: &Action, fin_f: &[Option<f64>], fin_b: &[Option<f64>]| -> Option<f64> {
        let (st, mb) = (a.stage(), a.mb());
        let hop = |other: usize| {
            if s.rank_of(other) == s.rank_of(st) {
                0.0
            } else {
                latency
            }
        };
        match a {
            Action::Forward { .. } if st > 0 => Some(fin_f[idx(st - 1, mb)]? + hop(st - 1)),
            Action::Backward { .. } | Action::BackwardInput { .. } if st + 1 < n => {
                let up = fin_b[idx(st + 1, mb)]? + hop(st + 1);
                Some(up.max(fin_f[idx(st, mb)].unwrap_or(0.0)))
            }
            _ => Some(0.0),
        }
    };
    loop {
        let mut progressed = false;
        for r in 0..p {
            let list = s.actions(r);
            while let Some(a) = list.get(ptr[r]) {
                let Some(t) = ready(a, &fin_f, &fin_b) else {
                    break;
                };
                let start = free[r].max(t);
                let end = start + cost(a);
                free[r] = end;
                timeline[r].push((*a, start, end));
                let i = idx(a.stage(), a.mb());
                match a {
                    Action::Forward { .. } => fin_f[i] = Some(end),
                    Action::Backward { .. } | Action::BackwardInput { .. } => fin_b[i] = Some(end),
                    Action::BackwardWeight { .. } => {}
                }
                ptr[r] += 1;
                progressed = true;
            }
        }
        if !progressed {
            break;
        }
    }
    if let Some(r) = (0..p).find(|&r| ptr[r] < s.actions(r).len()) {
        let pos = ptr[r];
        let a = s.actions(r)[pos];
        let (st, mb) = (a.stage(), a.mb());
        let (needs, holder) = match a {
            Action::Forward { .. } => (format!("{}F{mb}", st - 1), st - 1),
            _ => (format!("{}B{mb} or {}I{mb}", st + 1, st + 1), st + 1),
        };
        let q = s.rank_of(holder).unwrap_or(0);
        let theirs = s.actions(q).get(ptr[q]).map_or("finished".to_owned(), |b| {
            format!("at position {}, {b}", ptr[q])
        });
        let what = if matches!(a, Action::Forward { .. }) {
            "the forward of stage"
        } else {
            "the input gradient from stage"
        };
        return Err(Error::InvalidSchedule {
            rank: r,
            position: pos,
            action: a,
            reason: format!(
                "deadlock: waits for {what} {holder} (micro-batch {mb}, {needs} on rank {q}), \
                 which never runs before it: rank {q} is stuck {theirs}"
            ),
        });
    }
    let makespan = free.iter().copied().fold(0.0, f64::max);
    let busy: Vec<f64> = timeline
        .iter()
        .map(|t| t.iter().map(|(_, a, b)| b - a).sum())
        .collect();
    let bubble = if makespan > 0.0 {
        1.0 - busy.iter().sum::<f64>() / (p as f64 * makespan)
    } else {
        0.0
    };
    let peak_activations = (0..p)
        .map(|r| {
            let (mut live, mut peak) = (0usize, 0usize);
            for a in s.actions(r) {
                match a {
                    Action::Forward { .. } => {
                        live += 1;
                        peak = peak.max(live);
                    }
                    Action::Backward { .. } | Action::BackwardInput { .. } => {
                        live = live.saturating_sub(1);
                    }
                    Action::BackwardWeight { .. } => {}
                }
            }
            peak
        })
        .collect();
    Ok(SimReport {
        makespan,
        bubble,
        busy,
        peak_activations,
        timeline,
    })
}
