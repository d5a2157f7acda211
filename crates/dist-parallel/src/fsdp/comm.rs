//! The collectives a unit has in flight, in whichever element type they travel.

use std::time::{Duration, Instant};

use dist_collective::{ProcessGroup, ReduceOp, Work};

use super::precision::ComputeElement;

/// A reduce-scatter or all-reduce result: in the compute type or in `f32`.
pub(crate) enum Grad<C> {
    Compute(Vec<C>),
    F32(Vec<f32>),
}

impl<C: ComputeElement> Grad<C> {
    pub(crate) fn bytes(&self) -> usize {
        match self {
            Grad::Compute(v) => size_of_val(v.as_slice()),
            Grad::F32(v) => size_of_val(v.as_slice()),
        }
    }

    /// Averages this shard over `pg` (HSDP's replicate dimension), in the type it travels in:
    /// in the compute type as a sum of shards divided by the first of
    /// [`dist_wire::average_divisors`], to be divided by the second once summed
    /// ([`Grad::averaged_over`]).
    ///
    /// Why not `ReduceOp::Avg` in the compute type: how a backend averages `f16` is its own
    /// (gloo splits the division as this does; NCCL's `ncclAvg` divides by all of `n` first,
    /// which loses small gradients to underflow), and a sum of `f16` gradients that are not
    /// divided ahead overflows where their average is in range (64 ranks of gradients near
    /// 1100 gave `inf`). Divided here, the gradients are alike on every backend.
    pub(crate) fn all_reduce_avg(self, pg: &ProcessGroup) -> dist_collective::Result<GradWork<C>> {
        Ok(match self {
            Grad::Compute(mut v) => {
                divide(&mut v, dist_wire::average_divisors(pg.world_size()).0);
                GradWork::Compute(pg.all_reduce_async(v, ReduceOp::Sum)?)
            }
            Grad::F32(v) => GradWork::F32(pg.all_reduce_async(v, ReduceOp::Avg)?),
        })
    }

    /// Ends an average over `n` ranks: a compute-type sum of shards each divided by the first
    /// of [`dist_wire::average_divisors`] is divided by the second; the `f32` form was averaged
    /// by the collective itself.
    pub(crate) fn averaged_over(mut self, n: usize) -> Self {
        if let Grad::Compute(v) = &mut self {
            divide(v, dist_wire::average_divisors(n).1);
        }
        self
    }

    /// Adds this shard into the `f32` gradient shard.
    pub(crate) fn add_into(&self, acc: &mut [f32]) {
        match self {
            Grad::Compute(v) => acc.iter_mut().zip(v).for_each(|(a, g)| *a += g.to_f32()),
            Grad::F32(v) => acc.iter_mut().zip(v).for_each(|(a, g)| *a += g),
        }
    }
}

/// Divides every element by `by`, rounding once from `f32`.
fn divide<C: ComputeElement>(v: &mut [C], by: f32) {
    if by != 1.0 {
        v.iter_mut().for_each(|x| *x = C::from_f32(x.to_f32() / by));
    }
}

/// Packs a unit's gradients for a reduce-scatter that averages over `n` ranks by a sum
/// ([`dist_wire::average_divisors`]).
pub(crate) fn divided_for_sum<C: ComputeElement>(mut packed: Vec<C>, n: usize) -> Vec<C> {
    divide(&mut packed, dist_wire::average_divisors(n).0);
    packed
}

/// An in-flight gradient collective.
pub(crate) enum GradWork<C> {
    Compute(Work<Vec<C>>),
    F32(Work<Vec<f32>>),
}

impl<C: ComputeElement> GradWork<C> {
    pub(crate) fn seq(&self) -> u64 {
        match self {
            GradWork::Compute(w) => w.seq(),
            GradWork::F32(w) => w.seq(),
        }
    }

    /// Waits; also returns how long the caller was blocked.
    pub(crate) fn wait(self) -> (dist_collective::Result<Grad<C>>, Duration) {
        let t = Instant::now();
        let r = match self {
            GradWork::Compute(w) => w.wait().map(Grad::Compute),
            GradWork::F32(w) => w.wait().map(Grad::F32),
        };
        (r, t.elapsed())
    }
}

/// Which group an operation ran on, to find it in that group's flight recorder.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Dim {
    Shard,
    Replicate,
}

/// Time the group's worker spent running the operations `seqs` (from its flight recorder);
/// operations the recorder no longer holds count as zero.
pub(crate) fn busy_time(pg: &ProcessGroup, seqs: &[u64]) -> Duration {
    if seqs.is_empty() {
        return Duration::ZERO;
    }
    let ms: f64 = pg
        .flight_recorder()
        .iter()
        .filter(|e| e.seq.is_some_and(|s| seqs.contains(&s)))
        .filter_map(|e| Some(e.finished_ms? - e.started_ms?))
        .sum();
    Duration::from_secs_f64(ms.max(0.0) / 1e3)
}
