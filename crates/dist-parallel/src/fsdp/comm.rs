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
    /// in the compute type as a sum of shards divided by the first of [`divide_factors`], to be
    /// divided by the second once summed ([`Grad::averaged_over`]).
    pub(crate) fn all_reduce_avg(self, pg: &ProcessGroup) -> dist_collective::Result<GradWork<C>> {
        Ok(match self {
            Grad::Compute(mut v) => {
                divide(&mut v, divide_factors(pg.world_size()).0);
                GradWork::Compute(pg.all_reduce_async(v, ReduceOp::Sum)?)
            }
            Grad::F32(v) => GradWork::F32(pg.all_reduce_async(v, ReduceOp::Avg)?),
        })
    }

    /// Ends an average over `n` ranks: a compute-type sum of shards each divided by the first
    /// of [`divide_factors`] is divided by the second; the `f32` form was averaged by the
    /// collective itself.
    pub(crate) fn averaged_over(mut self, n: usize) -> Self {
        if let Grad::Compute(v) = &mut self {
            divide(v, divide_factors(n).1);
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

/// How a gradient in the compute type is averaged over `n` ranks: divided by `before` ahead
/// of a sum and by `after` once summed, `before · after = n`, `before` the power of two torch's
/// FSDP picks: doubled from 1 while it divides `n` and `n / before > before`, so about √n
/// (it need not divide `n`: 6 ranks give 4 and 1.5).
///
/// Why not `ReduceOp::Avg`: it sums first and divides at the end, and in `f16` (largest
/// finite value 65504) the partial sums overflowed where the average itself was fine: 64 ranks
/// of gradients near 1100 gave `inf`. Dividing by all of `n` first would lose small gradients
/// to underflow instead; splitting the division keeps both ends in range, as torch does for
/// reduce types that NCCL cannot average. `before` is a power of two, so in `f32` and `bf16`
/// the first division is exact.
pub(crate) fn divide_factors(n: usize) -> (f32, f32) {
    let mut before = 1usize;
    while n.is_multiple_of(before) && n / before > before {
        before *= 2;
    }
    (before as f32, n as f32 / before as f32)
}

/// Divides every element by `by`, rounding once from `f32`.
fn divide<C: ComputeElement>(v: &mut [C], by: f32) {
    if by != 1.0 {
        v.iter_mut().for_each(|x| *x = C::from_f32(x.to_f32() / by));
    }
}

/// Packs a unit's gradients for a reduce-scatter that averages over `n` ranks by a sum
/// ([`divide_factors`]).
pub(crate) fn divided_for_sum<C: ComputeElement>(mut packed: Vec<C>, n: usize) -> Vec<C> {
    divide(&mut packed, divide_factors(n).0);
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

#[cfg(test)]
mod tests {
    use super::divide_factors;

    #[test]
    fn divide_factors_follow_torch_fsdp_and_multiply_to_n() {
        // torch's `_get_gradient_divide_factors`, by hand.
        for (n, before) in [
            (1, 1.0),
            (2, 2.0),
            (3, 2.0),
            (4, 2.0),
            (6, 4.0),
            (8, 4.0),
            (64, 8.0),
        ] {
            let (b, a) = divide_factors(n);
            assert_eq!(b, before, "{n} ranks");
            assert!((b * a - n as f32).abs() < 1e-6, "{n} ranks: {b} x {a}");
        }
    }
}
