//! Communication hooks: how a full bucket of gradients is reduced across ranks.
//!
//! A hook runs on DDP's communication thread, one bucket at a time in bucket order, while the
//! caller's thread continues the backward pass. It must leave in the bucket the average over
//! ranks of every rank's gradient (or an approximation of it, for compressing hooks).

use std::collections::HashMap;

use dist_collective::{ProcessGroup, Result};
use dist_wire::ReduceOp;
use half::{bf16, f16};

/// One bucket handed to a hook.
#[derive(Debug)]
pub struct Bucket<'a> {
    /// Bucket index (reduction order).
    pub index: usize,
    /// The flattened gradients.
    pub data: &'a mut [f32],
    /// Parameter indices in the bucket.
    pub params: &'a [usize],
    /// Element offset of each parameter in `data` (parallel to `params`).
    pub offsets: &'a [usize],
    /// Shape of every parameter of the model (indexed by parameter index).
    pub shapes: &'a [Vec<usize>],
}

/// A way to reduce a bucket (torch's DDP communication hook).
pub trait CommHook: Send {
    /// Short name for logs.
    fn name(&self) -> &'static str;
    /// Replaces `bucket.data` by the average over ranks of every rank's `bucket.data`. `pg` is
    /// DDP's own group over the wrapped group's ranks (same ranks and order), on which only
    /// the communication thread runs collectives.
    fn reduce(&mut self, pg: &ProcessGroup, bucket: &mut Bucket<'_>) -> Result<()>;
}

/// The default: one all-reduce with `ReduceOp::Avg` per bucket.
#[derive(Debug, Default)]
pub struct AllReduceMean;

impl CommHook for AllReduceMean {
    fn name(&self) -> &'static str {
        "allreduce"
    }

    fn reduce(&mut self, pg: &ProcessGroup, bucket: &mut Bucket<'_>) -> Result<()> {
        pg.all_reduce(bucket.data, ReduceOp::Avg)
    }
}

/// Divides by the world size, narrows to `H`, all-reduces the sum, widens back: dividing first
/// keeps the sum in range.
fn compressed_mean<H: dist_wire::Element>(
    pg: &ProcessGroup,
    data: &mut [f32],
    narrow: impl Fn(f32) -> H,
    widen: impl Fn(H) -> f32,
) -> Result<()> {
    let n = pg.world_size() as f32;
    let mut c: Vec<H> = data.iter().map(|x| narrow(x / n)).collect();
    pg.all_reduce(&mut c, ReduceOp::Sum)?;
    data.iter_mut().zip(c).for_each(|(d, s)| *d = widen(s));
    Ok(())
}

/// Halves the bytes on the wire: the mean is computed in `f16` (torch's `fp16_compress_hook`).
#[derive(Debug, Default)]
pub struct Fp16Compress;

impl CommHook for Fp16Compress {
    fn name(&self) -> &'static str {
        "fp16_compress"
    }

    fn reduce(&mut self, pg: &ProcessGroup, bucket: &mut Bucket<'_>) -> Result<()> {
        compressed_mean(pg, bucket.data, f16::from_f32, f16::to_f32)
    }
}

/// As [`Fp16Compress`] with `bf16`: the same range as `f32`, less precision.
#[derive(Debug, Default)]
pub struct Bf16Compress;

impl CommHook for Bf16Compress {
    fn name(&self) -> &'static str {
        "bf16_compress"
    }

    fn reduce(&mut self, pg: &ProcessGroup, bucket: &mut Bucket<'_>) -> Result<()> {
        compressed_mean(pg, bucket.data, bf16::from_f32, bf16::to_f32)
    }
}

/// PowerSGD (Vogels et al., 2019), torch's `powerSGD_hook`: each matrix-shaped gradient M
/// (rows × cols) is replaced by a rank-`r` approximation P Qᵀ found with one step of subspace
/// iteration warm-started from the previous step's Q, so only (rows + cols) × r numbers per
/// matrix cross the wire. Error feedback adds what the approximation missed to the next step's
/// gradient, so nothing is lost over time. Vectors and matrices too small to gain are reduced
/// uncompressed.
#[derive(Debug)]
pub struct PowerSgd {
    rank: usize,
    /// Per parameter: Q (cols × r, row-major) and the error-feedback residual.
    state: HashMap<usize, (Vec<f32>, Vec<f32>)>,
}

impl PowerSgd {
    /// A hook with approximation rank `rank` (torch's `matrix_approximation_rank`).
    pub fn new(rank: usize) -> Self {
        PowerSgd {
            rank: rank.max(1),
            state: HashMap::new(),
        }
    }

    fn dims(&self, shape: &[usize]) -> Option<(usize, usize)> {
        if shape.len() < 2 {
            return None;
        }
        let rows = shape[0];
        let cols = shape[1..].iter().product::<usize>();
        // Compress only when it sends fewer numbers than the matrix itself.
        ((rows + cols) * self.rank < rows * cols).then_some((rows, cols))
    }
}

/// Deterministic pseudo-random values in [-1, 1), identical on every rank.
fn seeded(len: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

/// Orthonormalises the `r` columns of a row-major rows × r matrix (modified Gram-Schmidt).
fn orthonormalize(p: &mut [f32], rows: usize, r: usize) {
    for j in 0..r {
        for k in 0..j {
            let dot: f32 = (0..rows).map(|i| p[i * r + j] * p[i * r + k]).sum();
            (0..rows).for_each(|i| p[i * r + j] -= dot * p[i * r + k]);
        }
        let norm = (0..rows)
            .map(|i| p[i * r + j] * p[i * r + j])
            .sum::<f32>()
            .sqrt()
            .max(1e-8);
        (0..rows).for_each(|i| p[i * r + j] /= norm);
    }
}

impl CommHook for PowerSgd {
    fn name(&self) -> &'static str {
        "powersgd"
    }

    fn reduce(&mut self, pg: &ProcessGroup, bucket: &mut Bucket<'_>) -> Result<()> {
        let r = self.rank;
        // (param, offset, rows, cols) of the compressed matrices; the rest goes uncompressed.
        let mut mats = Vec::new();
        let mut plain = Vec::new();
        for (&p, &off) in bucket.params.iter().zip(bucket.offsets) {
            match self.dims(&bucket.shapes[p]) {
                Some((rows, cols)) => mats.push((p, off, rows, cols)),
                None => plain.push((off, bucket.shapes[p].iter().product::<usize>())),
            }
        }
        let mut flat: Vec<f32> = plain
            .iter()
            .flat_map(|&(off, len)| bucket.data[off..off + len].to_vec())
            .collect();
        pg.all_reduce(&mut flat, ReduceOp::Avg)?;
        let mut at = 0;
        for &(off, len) in &plain {
            dist_wire::copy::bulk_of(&mut bucket.data[off..off + len], &flat[at..at + len]);
            at += len;
        }
        if mats.is_empty() {
            return Ok(());
        }
        // M = gradient + residual; P = M Q for every matrix, all-reduced together.
        let mut ms: Vec<Vec<f32>> = Vec::with_capacity(mats.len());
        let mut ps: Vec<f32> = Vec::new();
        for &(p, off, rows, cols) in &mats {
            let (q, err) = self
                .state
                .entry(p)
                .or_insert_with(|| (seeded(cols * r, p as u64 + 1), vec![0.0; rows * cols]));
            let m: Vec<f32> = bucket.data[off..off + rows * cols]
                .iter()
                .zip(err.iter())
                .map(|(g, e)| g + e)
                .collect();
            for i in 0..rows {
                for j in 0..r {
                    ps.push((0..cols).map(|k| m[i * cols + k] * q[k * r + j]).sum());
                }
            }
            ms.push(m);
        }
        pg.all_reduce(&mut ps, ReduceOp::Avg)?;
        // Orthonormalise each P, then Q = Mᵀ P, all-reduced together.
        let mut qs: Vec<f32> = Vec::new();
        let mut at = 0;
        for (&(_, _, rows, cols), m) in mats.iter().zip(&ms) {
            let p = &mut ps[at..at + rows * r];
            orthonormalize(p, rows, r);
            for k in 0..cols {
                for j in 0..r {
                    qs.push((0..rows).map(|i| m[i * cols + k] * p[i * r + j]).sum());
                }
            }
            at += rows * r;
        }
        pg.all_reduce(&mut qs, ReduceOp::Avg)?;
        // M̂ = P Qᵀ into the bucket; the residual keeps M − M̂; Q warm-starts the next step.
        let (mut pa, mut qa) = (0, 0);
        for (&(p, off, rows, cols), m) in mats.iter().zip(&ms) {
            let (q_state, err) = self.state.get_mut(&p).expect("state made above");
            let (pm, qm) = (&ps[pa..pa + rows * r], &qs[qa..qa + cols * r]);
            for i in 0..rows {
                for k in 0..cols {
                    let v: f32 = (0..r).map(|j| pm[i * r + j] * qm[k * r + j]).sum();
                    bucket.data[off + i * cols + k] = v;
                    err[i * cols + k] = m[i * cols + k] - v;
                }
            }
            q_state.copy_from_slice(qm);
            pa += rows * r;
            qa += cols * r;
        }
        Ok(())
    }
}
