//! Schedules as data: [`Action`], [`Schedule`] (validated on construction) and the generators
//! for GPipe, 1F1B, interleaved 1F1B and ZB-H1.

use std::collections::HashMap;
use std::fmt;
use std::str::FromStr;

use crate::{Error, Result};

use super::sim;

/// One compute action of a rank's schedule. Communication is implied by the stage layout: a
/// forward of stage `s > 0` receives its input from stage `s - 1` (from another rank, or handed
/// over on this one), and its output goes to stage `s + 1`; a backward receives its output
/// gradient from stage `s + 1` and sends its input gradient to stage `s - 1`. Keeping sends and
/// receives implied means a hand-written list cannot forget one or pair them wrongly.
///
/// Printed (and parsed) in torch's notation: `2F0` is the forward of stage 2 on micro-batch 0;
/// `B`, `I` and `W` are the full backward, its input-gradient half and its weight-gradient half.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Action {
    /// Forward of `stage` on micro-batch `mb`.
    Forward {
        /// The stage.
        stage: usize,
        /// The micro-batch.
        mb: usize,
    },
    /// Full backward (input and weight gradients) of `stage` on `mb`.
    Backward {
        /// The stage.
        stage: usize,
        /// The micro-batch.
        mb: usize,
    },
    /// Input-gradient half of the backward (zero-bubble schedules): what the previous stage
    /// waits for.
    BackwardInput {
        /// The stage.
        stage: usize,
        /// The micro-batch.
        mb: usize,
    },
    /// Weight-gradient half of the backward, after [`Action::BackwardInput`]; nobody waits
    /// for it, so it can fill a bubble.
    BackwardWeight {
        /// The stage.
        stage: usize,
        /// The micro-batch.
        mb: usize,
    },
}

impl Action {
    /// The stage it runs.
    pub fn stage(&self) -> usize {
        match *self {
            Action::Forward { stage, .. }
            | Action::Backward { stage, .. }
            | Action::BackwardInput { stage, .. }
            | Action::BackwardWeight { stage, .. } => stage,
        }
    }

    /// Its micro-batch.
    pub fn mb(&self) -> usize {
        match *self {
            Action::Forward { mb, .. }
            | Action::Backward { mb, .. }
            | Action::BackwardInput { mb, .. }
            | Action::BackwardWeight { mb, .. } => mb,
        }
    }

    /// The letter of torch's notation: `F`, `B`, `I` or `W`.
    pub fn letter(&self) -> char {
        match self {
            Action::Forward { .. } => 'F',
            Action::Backward { .. } => 'B',
            Action::BackwardInput { .. } => 'I',
            Action::BackwardWeight { .. } => 'W',
        }
    }

    fn with(letter: char, stage: usize, mb: usize) -> Option<Action> {
        Some(match letter {
            'F' => Action::Forward { stage, mb },
            'B' => Action::Backward { stage, mb },
            'I' => Action::BackwardInput { stage, mb },
            'W' => Action::BackwardWeight { stage, mb },
            _ => return None,
        })
    }
}

impl fmt::Display for Action {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}{}{}", self.stage(), self.letter(), self.mb())
    }
}

impl FromStr for Action {
    type Err = Error;

    /// Parses torch's notation (`2F0`, `0B3`, `1I2`, `1W2`).
    fn from_str(s: &str) -> Result<Action> {
        let bad = || Error::ScheduleConfig {
            schedule: "Action::from_str",
            reason: format!("{s:?} is not an action like 2F0, 0B3, 1I2 or 1W2"),
        };
        let at = s.find(|c: char| c.is_ascii_alphabetic()).ok_or_else(bad)?;
        let letter = s[at..].chars().next().ok_or_else(bad)?;
        let stage = s[..at].parse().map_err(|_| bad())?;
        let mb = s[at + letter.len_utf8()..].parse().map_err(|_| bad())?;
        Action::with(letter, stage, mb).ok_or_else(bad)
    }
}

/// A validated pipeline schedule: for each rank, the ordered list of compute actions it runs
/// in one training step, plus which rank holds which stage.
///
/// Only [`Schedule::new`] and the generators build one, and both validate, so an executor
/// given a `Schedule` never meets a malformed one: every (stage, micro-batch) has its forward
/// and its backward (whole, or split into input and weight halves) exactly once, on the rank
/// that holds the stage, after what it depends on, and the ranks' orders cannot deadlock.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Schedule {
    name: String,
    stage_to_rank: Vec<usize>,
    microbatches: usize,
    actions: Vec<Vec<Action>>,
}

impl Schedule {
    /// Validates a schedule: `actions[r]` is rank `r`'s order, `stage_to_rank[s]` the rank
    /// holding stage `s`, `microbatches` the number of micro-batches per step.
    ///
    /// A malformed schedule is [`Error::InvalidSchedule`], naming the rank, the position in its
    /// list and the action that is wrong (for a missing action: the action, at the end of the
    /// list of the rank that should run it). Bad sizes are [`Error::ScheduleConfig`].
    pub fn new(
        name: impl Into<String>,
        stage_to_rank: Vec<usize>,
        microbatches: usize,
        actions: Vec<Vec<Action>>,
    ) -> Result<Schedule> {
        let s = Schedule {
            name: name.into(),
            stage_to_rank,
            microbatches,
            actions,
        };
        s.validate()?;
        Ok(s)
    }

    /// Parses one line per rank of whitespace-separated actions in torch's notation (`0F0 0F1
    /// 0B0 0B1`), then validates as [`Schedule::new`] does.
    pub fn parse(
        name: impl Into<String>,
        stage_to_rank: Vec<usize>,
        microbatches: usize,
        text: &str,
    ) -> Result<Schedule> {
        let actions = text
            .lines()
            .filter(|l| !l.trim().is_empty())
            .map(|l| {
                l.split_whitespace()
                    .map(str::parse)
                    .collect::<Result<Vec<_>>>()
            })
            .collect::<Result<Vec<_>>>()?;
        Schedule::new(name, stage_to_rank, microbatches, actions)
    }

    /// GPipe: every forward, then every backward. Holds all `m` micro-batches' activations.
    pub fn gpipe(ranks: usize, microbatches: usize) -> Result<Schedule> {
        check_sizes("gpipe", ranks, microbatches, 1)?;
        let actions = (0..ranks)
            .map(|r| {
                let f = (0..microbatches).map(|mb| Action::Forward { stage: r, mb });
                let b = (0..microbatches).map(|mb| Action::Backward { stage: r, mb });
                f.chain(b).collect()
            })
            .collect();
        Schedule::new("gpipe", (0..ranks).collect(), microbatches, actions)
    }

    /// 1F1B: rank `r` runs `min(m, p - r)` forwards, then alternates backward and forward,
    /// then drains the backwards. Same bubble as GPipe, at most `p - r` activations held.
    pub fn one_f_one_b(ranks: usize, microbatches: usize) -> Result<Schedule> {
        check_sizes("1f1b", ranks, microbatches, 1)?;
        let actions = (0..ranks)
            .map(|r| {
                let warmup = microbatches.min(ranks - r);
                let mut list: Vec<Action> = (0..warmup)
                    .map(|mb| Action::Forward { stage: r, mb })
                    .collect();
                for mb in 0..microbatches {
                    list.push(Action::Backward { stage: r, mb });
                    if mb + warmup < microbatches {
                        list.push(Action::Forward {
                            stage: r,
                            mb: mb + warmup,
                        });
                    }
                }
                list
            })
            .collect();
        Schedule::new("1f1b", (0..ranks).collect(), microbatches, actions)
    }

    /// Interleaved 1F1B (Megatron-LM, generalised as torch's `ScheduleInterleaved1F1B`):
    /// `virtual_stages` stages per rank, stage `s` on rank `s mod p`. Micro-batches go through
    /// the local stages in groups of `g = m / max(1, m / p)` (so `m` must be a multiple of
    /// `max(1, m / p)`); rank `r` warms up with `(v - 1)·g + 2(p - 1 - r)` forwards, then
    /// alternates forward and backward. The bubble shrinks by `v` at `v`× the messages.
    pub fn interleaved_1f1b(
        ranks: usize,
        virtual_stages: usize,
        microbatches: usize,
    ) -> Result<Schedule> {
        check_sizes("interleaved_1f1b", ranks, microbatches, virtual_stages)?;
        let rounds = (microbatches / ranks).max(1);
        if !microbatches.is_multiple_of(rounds) {
            return Err(Error::ScheduleConfig {
                schedule: "interleaved_1f1b",
                reason: format!(
                    "{microbatches} micro-batches do not split into {rounds} equal rounds \
                     (m must be a multiple of max(1, m / p) with p = {ranks})"
                ),
            });
        }
        let group = microbatches / rounds;
        let (p, v, m) = (ranks, virtual_stages, microbatches);
        let total = v * m;
        let fwd = |r: usize, k: usize| {
            let chunk = (k / group) % v;
            let mb = (k / (group * v)) * group + k % group;
            Action::Forward {
                stage: chunk * p + r,
                mb,
            }
        };
        let bwd = |r: usize, k: usize| {
            let chunk = v - 1 - (k / group) % v;
            let mb = (k / (group * v)) * group + k % group;
            Action::Backward {
                stage: chunk * p + r,
                mb,
            }
        };
        let actions = (0..p)
            .map(|r| {
                let warmup = ((v - 1) * group + 2 * (p - 1 - r)).min(total);
                let mut list: Vec<Action> = (0..warmup).map(|k| fwd(r, k)).collect();
                for k in 0..total - warmup {
                    list.push(fwd(r, k + warmup));
                    list.push(bwd(r, k));
                }
                list.extend((total - warmup..total).map(|k| bwd(r, k)));
                list
            })
            .collect();
        let stage_to_rank = (0..p * v).map(|s| s % p).collect();
        Schedule::new("interleaved_1f1b", stage_to_rank, m, actions)
    }

    /// ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", 2024): 1F1B with each backward
    /// split into its input half (`I`, which the previous stage waits for) and its weight half
    /// (`W`, which nobody waits for). Rank `r` runs `min(m, p - r)` forwards, then per
    /// micro-batch an `I`, a `W` whenever more than `r` are pending, and the next forward;
    /// the deferred `W`s fill what would be the cool-down bubble. Peak activations as 1F1B.
    pub fn zero_bubble_h1(ranks: usize, microbatches: usize) -> Result<Schedule> {
        check_sizes("zb_h1", ranks, microbatches, 1)?;
        let actions = (0..ranks)
            .map(|r| {
                let stage = r;
                let warmup = microbatches.min(ranks - r);
                let mut list: Vec<Action> = (0..warmup)
                    .map(|mb| Action::Forward { stage, mb })
                    .collect();
                let mut next_w = 0;
                for mb in 0..microbatches {
                    list.push(Action::BackwardInput { stage, mb });
                    if mb + 1 - next_w > r {
                        list.push(Action::BackwardWeight { stage, mb: next_w });
                        next_w += 1;
                    }
                    if mb + warmup < microbatches {
                        list.push(Action::Forward {
                            stage,
                            mb: mb + warmup,
                        });
                    }
                }
                list.extend((next_w..microbatches).map(|mb| Action::BackwardWeight { stage, mb }));
                list
            })
            .collect();
        Schedule::new("zb_h1", (0..ranks).collect(), microbatches, actions)
    }

    /// The schedule's name (`"1f1b"`, or what [`Schedule::new`] was given).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Number of ranks.
    pub fn num_ranks(&self) -> usize {
        self.actions.len()
    }

    /// Number of stages.
    pub fn num_stages(&self) -> usize {
        self.stage_to_rank.len()
    }

    /// Micro-batches per step.
    pub fn num_microbatches(&self) -> usize {
        self.microbatches
    }

    /// The rank holding `stage`, if it exists.
    pub fn rank_of(&self, stage: usize) -> Option<usize> {
        self.stage_to_rank.get(stage).copied()
    }

    /// The stages held by `rank`, ascending.
    pub fn stages_of(&self, rank: usize) -> Vec<usize> {
        (0..self.num_stages())
            .filter(|&s| self.stage_to_rank[s] == rank)
            .collect()
    }

    /// Rank `rank`'s actions in order (empty for a rank out of range).
    pub fn actions(&self, rank: usize) -> &[Action] {
        self.actions.get(rank).map_or(&[], Vec::as_slice)
    }

    /// A fingerprint of the whole schedule (FNV-1a over its layout and every action), the same
    /// on every rank that built the same schedule: executors compare it once at set-up.
    pub fn fingerprint(&self) -> u64 {
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        let mut eat = |x: u64| {
            for b in x.to_le_bytes() {
                h ^= u64::from(b);
                h = h.wrapping_mul(0x0100_0000_01b3);
            }
        };
        eat(self.microbatches as u64);
        eat(self.stage_to_rank.len() as u64);
        for &r in &self.stage_to_rank {
            eat(r as u64);
        }
        for list in &self.actions {
            eat(u64::MAX);
            for a in list {
                eat(a.letter() as u64);
                eat(a.stage() as u64);
                eat(a.mb() as u64);
            }
        }
        h
    }

    fn validate(&self) -> Result<()> {
        let (p, n, m) = (self.num_ranks(), self.num_stages(), self.microbatches);
        let config = |reason: String| Error::ScheduleConfig {
            schedule: "Schedule::new",
            reason,
        };
        if p == 0 || n == 0 || m == 0 {
            return Err(config(format!(
                "a schedule needs at least one rank, stage and micro-batch ({p} ranks, {n} \
                 stages, {m} micro-batches)"
            )));
        }
        if let Some((s, &r)) = self
            .stage_to_rank
            .iter()
            .enumerate()
            .find(|&(_, &r)| r >= p)
        {
            return Err(config(format!(
                "stage {s} is mapped to rank {r}, but the schedule has {p} ranks"
            )));
        }
        // Where each (stage, mb)'s F, B, I and W sit in their rank's list. A map, not a dense
        // table: `m` is the caller's number and may be absurd; the lists' lengths are real.
        let mut seen: HashMap<(usize, usize), [Option<usize>; 4]> = HashMap::new();
        for (r, list) in self.actions.iter().enumerate() {
            for (pos, &a) in list.iter().enumerate() {
                let bad = |reason: String| Error::InvalidSchedule {
                    rank: r,
                    position: pos,
                    action: a,
                    reason,
                };
                let (s, mb) = (a.stage(), a.mb());
                if s >= n {
                    return Err(bad(format!("the schedule has {n} stages")));
                }
                if mb >= m {
                    return Err(bad(format!("the schedule has {m} micro-batches")));
                }
                if self.stage_to_rank[s] != r {
                    return Err(bad(format!(
                        "stage {s} is held by rank {}, not this rank",
                        self.stage_to_rank[s]
                    )));
                }
                let e = seen.entry((s, mb)).or_default();
                let [f, b, inp, _] = *e;
                let (slot, name) = match a {
                    Action::Forward { .. } => (0, "forward"),
                    Action::Backward { .. } => (1, "backward"),
                    Action::BackwardInput { .. } => (2, "input backward"),
                    Action::BackwardWeight { .. } => (3, "weight backward"),
                };
                if let Some(q) = e[slot] {
                    return Err(bad(format!(
                        "duplicate: this micro-batch's {name} already runs at position {q}"
                    )));
                }
                match a {
                    Action::Forward { .. } => {}
                    Action::Backward { .. } | Action::BackwardInput { .. } => {
                        if let Some(q) = b.or(inp) {
                            return Err(bad(format!(
                                "duplicate: this micro-batch's backward already runs at position {q}"
                            )));
                        }
                        if f.is_none() {
                            return Err(bad(
                                "backward before its forward (no earlier forward of this stage \
                                 and micro-batch on this rank)"
                                    .into(),
                            ));
                        }
                    }
                    Action::BackwardWeight { .. } => {
                        if let Some(q) = b {
                            return Err(bad(format!(
                                "the full backward at position {q} already computed the weight \
                                 gradient"
                            )));
                        }
                        if inp.is_none() {
                            return Err(
                                bad("weight backward before its input backward (I)".into()),
                            );
                        }
                    }
                }
                e[slot] = Some(pos);
            }
        }
        // Stops at the first gap, which comes within the first `seen.len() + 1` pairs: never
        // a walk over an absurd `n · m`.
        for s in 0..n {
            let r = self.stage_to_rank[s];
            for mb in 0..m {
                let [f, b, inp, w] = seen.get(&(s, mb)).copied().unwrap_or_default();
                let missing = if f.is_none() {
                    Some((Action::Forward { stage: s, mb }, "forward"))
                } else if b.is_none() && inp.is_none() {
                    Some((Action::Backward { stage: s, mb }, "backward"))
                } else if inp.is_some() && w.is_none() {
                    Some((Action::BackwardWeight { stage: s, mb }, "weight backward"))
                } else {
                    None
                };
                if let Some((action, what)) = missing {
                    return Err(Error::InvalidSchedule {
                        rank: r,
                        position: self.actions(r).len(),
                        action,
                        reason: format!(
                            "missing: the {what} of stage {s}, micro-batch {mb} never runs"
                        ),
                    });
                }
            }
        }
        // Every local order is now consistent; what is left is the cross-rank order.
        sim::run(self, None, 0.0).map(drop)
    }
}

fn check_sizes(schedule: &'static str, ranks: usize, microbatches: usize, v: usize) -> Result<()> {
    // Up to three actions per (stage, micro-batch), and the executor's point-to-point tags
    // are 32-bit: refuse what could not run anyway instead of trying to allocate it.
    let actions = ranks
        .checked_mul(v)
        .and_then(|x| x.checked_mul(microbatches))
        .and_then(|x| x.checked_mul(4));
    if actions.is_none_or(|x| x > u32::MAX as usize) {
        return Err(Error::ScheduleConfig {
            schedule,
            reason: format!(
                "{ranks} ranks × {v} stages per rank × {microbatches} micro-batches is too large"
            ),
        });
    }
    if ranks == 0 || microbatches == 0 || v == 0 {
        return Err(Error::ScheduleConfig {
            schedule,
            reason: format!(
                "needs at least one rank, micro-batch and virtual stage (got {ranks}, \
                 {microbatches}, {v})"
            ),
        });
    }
    Ok(())
}
