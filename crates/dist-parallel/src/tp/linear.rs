//! [`TpLinear`]: a linear layer `y = x Wᵀ + b` whose weight is a [`DTensor`] split by a
//! [`ParallelStyle`]. It computes on its shard only; the block around it issues the collective
//! (so that, for instance, the three projections of attention share one all_reduce).

use dist_collective::{DTensor, DeviceMesh};

use super::ParallelStyle;
use super::math::{col_sums, mm_nn, mm_nt, mm_tn};
use crate::{Error, Result};

/// A column- or row-parallel linear layer.
///
/// [`TpLinear`]: a linear layer `y = x Wᵀ + b` whose weight is a [`DTensor`] split by a
/// [`ParallelStyle`]. It computes on its shard only; the block around it issues the collective
/// (so that, for instance, the three projections of attention share one all_reduce).
#[derive(Clone, Debug)]
pub struct TpLinear {
    style: ParallelStyle,
    weight: DTensor<f32>,
    bias: Option<DTensor<f32>>,
    grad_weight: Vec<f32>,
    grad_bias: Vec<f32>,
}

impl TpLinear {
    /// Wraps sharded parameters (from [`ParallelizePlan::distribute`](super::ParallelizePlan)
    /// or [`DTensor::distribute_tensor`]): weight `[out, in]` and bias `[out]` on a 1-D mesh
    /// with the style's placements.
    pub fn new(
        style: ParallelStyle,
        weight: DTensor<f32>,
        bias: Option<DTensor<f32>>,
    ) -> Result<Self> {
        const OP: &str = "TpLinear::new";
        let rank = weight.mesh().group().rank();
        let err = |reason: String| Error::InvalidInput {
            rank,
            op: OP,
            reason,
        };
        if style == ParallelStyle::SequenceParallel {
            return Err(err("a linear layer is Colwise or Rowwise".into()));
        }
        let shape = weight.shape();
        if shape.len() != 2 || weight.placements() != [style.placement("weight")] {
            return Err(err(format!(
                "{style:?} weight must be [out, in] with placements [{}], got {shape:?} with {:?}",
                style.placement("weight"),
                weight.placements()
            )));
        }
        if let Some(b) = &bias
            && (b.shape() != [shape[0]] || b.placements() != [style.placement("bias")])
        {
            return Err(err(format!(
                "{style:?} bias must be [{}] with placements [{}], got {:?} with {:?}",
                shape[0],
                style.placement("bias"),
                b.shape(),
                b.placements()
            )));
        }
        let grad_weight = vec![0.0; weight.to_local().len()];
        let grad_bias = vec![0.0; bias.as_ref().map_or(0, |b| b.to_local().len())];
        Ok(TpLinear {
            style,
            weight,
            bias,
            grad_weight,
            grad_bias,
        })
    }

    /// Shards a full `weight` (`[out, in]`, the same on every rank) and `bias` by `style`.
    pub fn from_full(
        style: ParallelStyle,
        mesh: &DeviceMesh,
        weight: &[f32],
        out_in: [usize; 2],
        bias: Option<&[f32]>,
    ) -> Result<Self> {
        let w = DTensor::distribute_tensor(weight, &out_in, mesh, &[style.placement("weight")])?;
        let b = bias
            .map(|b| DTensor::distribute_tensor(b, &[out_in[0]], mesh, &[style.placement("bias")]))
            .transpose()?;
        Self::new(style, w, b)
    }

    /// The style.
    pub fn style(&self) -> ParallelStyle {
        self.style
    }

    /// The sharded weight.
    pub fn weight(&self) -> &DTensor<f32> {
        &self.weight
    }

    /// The sharded bias.
    pub fn bias(&self) -> Option<&DTensor<f32>> {
        self.bias.as_ref()
    }

    /// Mutable parameters (weight, then bias), for an optimizer step on the local shards.
    pub fn params_mut(&mut self) -> Vec<&mut DTensor<f32>> {
        let mut v = vec![&mut self.weight];
        v.extend(self.bias.as_mut());
        v
    }

    /// Accumulated gradients (weight, then bias) as DTensors with the parameters' layouts:
    /// complete for the sharded parameters; a row-parallel bias gradient is the same on
    /// every rank.
    pub fn grads(&self) -> Result<Vec<DTensor<f32>>> {
        let mut v = vec![DTensor::from_local(
            self.grad_weight.clone(),
            self.weight.shape(),
            self.weight.mesh(),
            self.weight.placements(),
        )?];
        if let Some(b) = &self.bias {
            v.push(DTensor::from_local(
                self.grad_bias.clone(),
                b.shape(),
                b.mesh(),
                b.placements(),
            )?);
        }
        Ok(v)
    }

    /// Zeroes the accumulated gradients.
    pub fn zero_grad(&mut self) {
        self.grad_weight.fill(0.0);
        self.grad_bias.fill(0.0);
    }

    /// `[local out, local in]` of this rank's weight shard.
    pub fn local_out_in(&self) -> [usize; 2] {
        let s = self.weight.local_shape();
        [s[0], s[1]]
    }

    fn rows(&self, op: &'static str, len: usize, width: usize, what: &str) -> Result<usize> {
        if width == 0 && len == 0 {
            return Ok(0);
        }
        if width == 0 || !len.is_multiple_of(width) {
            return Err(Error::InvalidInput {
                rank: self.weight.mesh().group().rank(),
                op,
                reason: format!(
                    "{what} has {len} elements, not a whole number of rows of {width} ({:?} \
                     layer, local weight [out, in] = {:?})",
                    self.style,
                    self.local_out_in()
                ),
            });
        }
        Ok(len / width)
    }

    /// `x_local Wᵀ_local` on `x` (`[rows, local in]`): column-parallel adds its bias shard
    /// (the output is this rank's columns); row-parallel returns a partial sum without the
    /// bias, which [`add_bias`](Self::add_bias) adds once after the reduction.
    pub fn forward_local(&self, x: &[f32]) -> Result<Vec<f32>> {
        let [o, i] = self.local_out_in();
        let rows = self.rows("TpLinear::forward", x.len(), i, "input")?;
        let mut y = mm_nt(x, self.weight.to_local(), rows, i, o);
        if self.style == ParallelStyle::Colwise {
            self.add_bias(&mut y);
        }
        Ok(y)
    }

    /// Adds the (local) bias to every row of `y`.
    pub fn add_bias(&self, y: &mut [f32]) {
        if let Some(b) = &self.bias {
            let b = b.to_local();
            for row in y.chunks_exact_mut(b.len().max(1)) {
                super::math::add_into(row, b);
            }
        }
    }

    /// Accumulates the gradients of the local parameters for the forward on `x` and output
    /// gradient `dy` (`[rows, local out]`, the full output gradient for row-parallel), and
    /// returns the input gradient: partial over the group for column-parallel, this rank's
    /// input columns for row-parallel.
    pub fn backward_local(&mut self, x: &[f32], dy: &[f32]) -> Result<Vec<f32>> {
        let [o, i] = self.local_out_in();
        let rows = self.rows("TpLinear::backward", x.len(), i, "input")?;
        if dy.len() != rows * o {
            return Err(Error::InvalidInput {
                rank: self.weight.mesh().group().rank(),
                op: "TpLinear::backward",
                reason: format!("grad_output has {} elements, want {rows} x {o}", dy.len()),
            });
        }
        super::math::add_into(&mut self.grad_weight, &mm_tn(dy, x, rows, o, i));
        if self.bias.is_some() {
            super::math::add_into(&mut self.grad_bias, &col_sums(dy, o));
        }
        Ok(mm_nn(dy, self.weight.to_local(), rows, o, i))
    }
}
