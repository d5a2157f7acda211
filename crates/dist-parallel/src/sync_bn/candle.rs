//! [`CandleSyncBatchNorm`]: [`SyncBatchNorm`](super::SyncBatchNorm) as a candle [`Module`]
//! (feature `candle`), built from candle ops around one differentiable all_reduce
//! ([`all_reduce_sum`]) of `(Σx, Σx², count)`, so candle's autograd derives the backward and
//! it has exactly one all_reduce (of the statistics' gradients). Statistics are computed in
//! `f64`. [`CandleSyncBatchNorm::convert`] turns a batch norm's state (candle-nn's `BatchNorm`
//! tensors, or a flat [`SyncBatchNorm`](super::SyncBatchNorm)) into one.

use std::sync::Mutex;

use candle_core::{DType, Device, Module, Tensor, Var};
use dist_collective::ProcessGroup;

use super::{BatchNormOptions, SyncBatchNorm};
use crate::candle_comm::all_reduce_sum;
use crate::{Error, Result};

/// Synchronised batch norm as a candle module.
///
/// [`CandleSyncBatchNorm`]: [`SyncBatchNorm`](super::SyncBatchNorm) as a candle [`Module`]
/// (feature `candle`), built from candle ops around one differentiable all_reduce
/// ([`all_reduce_sum`]) of `(Σx, Σx², count)`, so candle's autograd derives the backward and
/// it has exactly one all_reduce (of the statistics' gradients). Statistics are computed in
/// `f64`. [`CandleSyncBatchNorm::convert`] turns a batch norm's state (candle-nn's `BatchNorm`
/// tensors, or a flat [`SyncBatchNorm`](super::SyncBatchNorm)) into one.
#[derive(Debug)]
pub struct CandleSyncBatchNorm {
    group: ProcessGroup,
    opts: BatchNormOptions,
    weight: Option<Var>,
    bias: Option<Var>,
    /// Running mean, running var, batches tracked (updated by training forwards).
    running: Mutex<(Vec<f32>, Vec<f32>, u64)>,
    channels: usize,
    training: bool,
}

impl CandleSyncBatchNorm {
    /// Converts a flat [`SyncBatchNorm`]'s state (torch's `convert_sync_batchnorm` for one
    /// layer; build the flat layer from a candle-nn `BatchNorm`'s tensors with
    /// [`SyncBatchNorm::from_batch_norm`]).
    pub fn convert(bn: &SyncBatchNorm, device: &Device) -> Result<Self> {
        let channels = bn.weight.len().max(bn.running_mean.len());
        let var = |v: &[f32]| -> Result<Option<Var>> {
            Ok((!v.is_empty())
                .then(|| Var::from_slice(v, v.len(), device))
                .transpose()?)
        };
        Ok(CandleSyncBatchNorm {
            group: bn.group.clone(),
            opts: bn.opts,
            weight: var(&bn.weight)?,
            bias: var(&bn.bias)?,
            running: Mutex::new((
                bn.running_mean.clone(),
                bn.running_var.clone(),
                bn.num_batches_tracked,
            )),
            channels,
            training: true,
        })
    }

    /// Training (batch statistics over the group) or eval (running statistics) mode.
    pub fn train(&mut self, training: bool) {
        self.training = training;
    }

    /// Weight and bias variables (absent without affine), for the optimizer.
    pub fn vars(&self) -> Vec<Var> {
        self.weight.iter().chain(&self.bias).cloned().collect()
    }

    /// Running mean, running (unbiased) variance and batches tracked.
    pub fn running_stats(&self) -> (Vec<f32>, Vec<f32>, u64) {
        self.running
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    fn bad(&self, reason: String) -> candle_core::Error {
        candle_core::Error::wrap(Error::InvalidInput {
            rank: self.group.rank(),
            op: "CandleSyncBatchNorm::forward",
            reason,
        })
    }

    /// Batch `(mean, biased var)` over the group as `[C]` f64 tensors, via one all_reduce.
    fn batch_stats(
        &self,
        x: &Tensor,
        count_local: usize,
    ) -> candle_core::Result<(Tensor, Tensor, f64)> {
        let sum = x.sum_keepdim(2)?.sum_keepdim(0)?.flatten_all()?;
        let sumsq = x.sqr()?.sum_keepdim(2)?.sum_keepdim(0)?.flatten_all()?;
        let count = Tensor::new(&[count_local as f64], x.device())?;
        let all = all_reduce_sum(&Tensor::cat(&[&sum, &sumsq, &count], 0)?, &self.group)?;
        let c = self.channels;
        let n = all.narrow(0, 2 * c, 1)?.to_vec1::<f64>()?[0];
        if n <= 1.0 && self.training {
            return Err(self.bad(format!(
                "expected more than 1 value per channel when training over the group, got {n}"
            )));
        }
        let mean = (all.narrow(0, 0, c)? / n)?;
        let var = ((all.narrow(0, c, c)? / n)? - mean.sqr()?)?.relu()?;
        Ok((mean, var, n))
    }
}

impl Module for CandleSyncBatchNorm {
    /// Normalises `x` (`[N, C, *spatial]`); in training mode every rank of the group calls it.
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let dims = x.dims().to_vec();
        if dims.len() < 2 || dims[1] != self.channels {
            return Err(self.bad(format!(
                "input of shape {dims:?}; want [N, {}, *spatial]",
                self.channels
            )));
        }
        let c = self.channels;
        let x64 = x.to_dtype(DType::F64)?.reshape((dims[0], c, ()))?;
        let (n, s) = (dims[0], x64.dims()[2]);
        let use_batch = self.training || !self.opts.track_running_stats;
        let (mean, var) = if use_batch {
            let (mean, var, count) = self.batch_stats(&x64, n * s)?;
            if self.training && self.opts.track_running_stats {
                let (m, v) = (mean.to_vec1::<f64>()?, var.to_vec1::<f64>()?);
                let mut run = self.running.lock().unwrap_or_else(|e| e.into_inner());
                run.2 += 1;
                let mom = self.opts.momentum.unwrap_or(1.0 / run.2 as f64);
                for k in 0..c {
                    run.0[k] = ((1.0 - mom) * run.0[k] as f64 + mom * m[k]) as f32;
                    let unbiased = v[k] * count / (count - 1.0);
                    run.1[k] = ((1.0 - mom) * run.1[k] as f64 + mom * unbiased) as f32;
                }
            }
            (mean, var)
        } else {
            let run = self.running.lock().unwrap_or_else(|e| e.into_inner());
            let t = |v: &[f32]| {
                Tensor::from_vec(
                    v.iter().map(|&x| x as f64).collect::<Vec<_>>(),
                    c,
                    x.device(),
                )
            };
            (t(&run.0)?, t(&run.1)?)
        };
        let col = |t: &Tensor| t.reshape((1, c, 1));
        let invstd = (var + self.opts.eps)?.sqrt()?.recip()?;
        let mut y = x64
            .broadcast_sub(&col(&mean)?)?
            .broadcast_mul(&col(&invstd)?)?;
        if let (Some(w), Some(b)) = (&self.weight, &self.bias) {
            let w = col(&w.as_tensor().to_dtype(DType::F64)?)?;
            let b = col(&b.as_tensor().to_dtype(DType::F64)?)?;
            y = y.broadcast_mul(&w)?.broadcast_add(&b)?;
        }
        y.to_dtype(x.dtype())?.reshape(dims)
    }
}
