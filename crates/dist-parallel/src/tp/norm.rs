//! [`TpLayerNorm`]: layer norm over the hidden dimension of whatever tokens this rank holds.
//! Under sequence parallelism it runs on this rank's run of tokens only, so its parameter
//! gradients are partial sums over the tensor-parallel group, reduced in one all_reduce by
//! [`TpLayerNorm::reduce_grads`]; without it every rank sees every token and the gradients are
//! already complete.

use dist_collective::{DTensor, DeviceMesh, Placement, ReduceOp};

use crate::{Error, Result};

/// A layer norm with weight and bias over `hidden`.
///
/// [`TpLayerNorm`]: layer norm over the hidden dimension of whatever tokens this rank holds.
/// Under sequence parallelism it runs on this rank's run of tokens only, so its parameter
/// gradients are partial sums over the tensor-parallel group, reduced in one all_reduce by
/// [`TpLayerNorm::reduce_grads`]; without it every rank sees every token and the gradients are
/// already complete.
#[derive(Clone, Debug)]
pub struct TpLayerNorm {
    mesh: DeviceMesh,
    /// Scale per hidden unit (replicated).
    pub weight: Vec<f32>,
    /// Shift per hidden unit (replicated).
    pub bias: Vec<f32>,
    eps: f64,
    seq_parallel: bool,
    grad_weight: Vec<f32>,
    grad_bias: Vec<f32>,
}

/// What [`TpLayerNorm::forward`] keeps for the backward.
#[derive(Clone, Debug)]
pub struct NormSaved {
    xhat: Vec<f32>,
    invstd: Vec<f64>,
}

impl TpLayerNorm {
    /// A layer norm with the given (replicated) parameters.
    pub fn new(
        mesh: &DeviceMesh,
        weight: Vec<f32>,
        bias: Vec<f32>,
        eps: f64,
        seq_parallel: bool,
    ) -> Result<Self> {
        if weight.len() != bias.len() || weight.is_empty() {
            return Err(Error::InvalidInput {
                rank: mesh.group().rank(),
                op: "TpLayerNorm::new",
                reason: format!(
                    "weight has {} and bias {} elements; want the same hidden size, above 0",
                    weight.len(),
                    bias.len()
                ),
            });
        }
        let h = weight.len();
        Ok(TpLayerNorm {
            mesh: mesh.clone(),
            weight,
            bias,
            eps,
            seq_parallel,
            grad_weight: vec![0.0; h],
            grad_bias: vec![0.0; h],
        })
    }

    fn hidden(&self) -> usize {
        self.weight.len()
    }

    fn check(&self, op: &'static str, len: usize) -> Result<()> {
        if !len.is_multiple_of(self.hidden()) {
            return Err(Error::InvalidInput {
                rank: self.mesh.group().rank(),
                op,
                reason: format!(
                    "{len} elements are not rows of hidden size {}",
                    self.hidden()
                ),
            });
        }
        Ok(())
    }

    /// Normalises each row of `x` (`[rows, hidden]`); no communication.
    pub fn forward(&self, x: &[f32]) -> Result<(Vec<f32>, NormSaved)> {
        self.check("TpLayerNorm::forward", x.len())?;
        let h = self.hidden();
        let mut y = vec![0f32; x.len()];
        let mut xhat = vec![0f32; x.len()];
        let mut invstd = Vec::with_capacity(x.len() / h);
        for (r, row) in x.chunks_exact(h).enumerate() {
            let mean = row.iter().map(|&v| v as f64).sum::<f64>() / h as f64;
            let var = row.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / h as f64;
            let inv = 1.0 / (var + self.eps).sqrt();
            invstd.push(inv);
            for (j, &v) in row.iter().enumerate() {
                let n = (v as f64 - mean) * inv;
                xhat[r * h + j] = n as f32;
                y[r * h + j] = (n * self.weight[j] as f64 + self.bias[j] as f64) as f32;
            }
        }
        Ok((y, NormSaved { xhat, invstd }))
    }

    /// Accumulates this rank's parameter gradients and returns the input gradient; no
    /// communication.
    pub fn backward(&mut self, saved: &NormSaved, dy: &[f32]) -> Result<Vec<f32>> {
        if dy.len() != saved.xhat.len() {
            return Err(Error::InvalidInput {
                rank: self.mesh.group().rank(),
                op: "TpLayerNorm::backward",
                reason: format!(
                    "grad_output has {} elements, the input had {}",
                    dy.len(),
                    saved.xhat.len()
                ),
            });
        }
        let h = self.hidden();
        let mut dx = vec![0f32; dy.len()];
        for (r, (g, xh)) in dy
            .chunks_exact(h)
            .zip(saved.xhat.chunks_exact(h))
            .enumerate()
        {
            // dx = inv/H · (H·ĝ - Σĝ - x̂·Σ(ĝ·x̂)) with ĝ = dy·w.
            let gh: Vec<f64> = g
                .iter()
                .zip(&self.weight)
                .map(|(&a, &w)| a as f64 * w as f64)
                .collect();
            let s1: f64 = gh.iter().sum();
            let s2: f64 = gh.iter().zip(xh).map(|(&a, &b)| a * b as f64).sum();
            for j in 0..h {
                self.grad_weight[j] += (g[j] as f64 * xh[j] as f64) as f32;
                self.grad_bias[j] += g[j];
                let v = saved.invstd[r] / h as f64 * (h as f64 * gh[j] - s1 - xh[j] as f64 * s2);
                dx[r * h + j] = v as f32;
            }
        }
        Ok(dx)
    }

    /// The complete parameter gradients (weight, bias): with sequence parallelism the ranks'
    /// partial sums reduced in one all_reduce (every rank calls it), else this rank's, which
    /// are already complete.
    pub fn reduce_grads(&self) -> Result<(Vec<f32>, Vec<f32>)> {
        let h = self.hidden();
        if !self.seq_parallel {
            return Ok((self.grad_weight.clone(), self.grad_bias.clone()));
        }
        let both = [&self.grad_weight[..], &self.grad_bias[..]].concat();
        let t = DTensor::from_local(
            both,
            &[2 * h],
            &self.mesh,
            &[Placement::Partial(ReduceOp::Sum)],
        )?;
        let mut full = t.redistribute(&[Placement::Replicate])?.into_local();
        let bias = full.split_off(h);
        Ok((full, bias))
    }

    /// Zeroes the accumulated gradients.
    pub fn zero_grad(&mut self) {
        self.grad_weight.fill(0.0);
        self.grad_bias.fill(0.0);
    }
}
