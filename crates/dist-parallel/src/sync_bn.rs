//! [`SyncBatchNorm`]: batch normalisation whose batch statistics cover the whole process group
//! (torch's `nn.SyncBatchNorm`), on flat `f32` buffers of shape `[N, C, *spatial]`.
//!
//! Forward reduces each channel's sum, sum of squares and the element count in ONE all_reduce
//! (`2C + 1` values, accumulated and reduced in `f64` so that large batches lose nothing to
//! `E[x²] - E[x]²`); backward reduces the two per-channel gradient sums (`Σdy`, `Σdy·x̂`) in one
//! more. The weight and bias gradients stay local, as torch's do: the data-parallel wrapper
//! (DDP) reduces them with every other parameter gradient. Running statistics follow torch:
//! `running_mean ← (1 - m)·running_mean + m·mean`, `running_var` the same with the *unbiased*
//! batch variance, and with `momentum: None` a cumulative average over `num_batches_tracked`.

use dist_collective::{ProcessGroup, ReduceOp};

#[cfg(feature = "candle")]
mod candle;
#[cfg(feature = "candle")]
pub use candle::CandleSyncBatchNorm;

use crate::{Error, Result};

/// Settings of a [`SyncBatchNorm`], torch's defaults by [`Default`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BatchNormOptions {
    /// Added to the variance before the square root (`1e-5`).
    pub eps: f64,
    /// Weight of the new batch in the running statistics (`Some(0.1)`); `None` keeps a
    /// cumulative average.
    pub momentum: Option<f64>,
    /// Learnable per-channel scale and shift (`true`).
    pub affine: bool,
    /// Keep running statistics and use them in eval mode (`true`).
    pub track_running_stats: bool,
}

impl Default for BatchNormOptions {
    fn default() -> Self {
        BatchNormOptions {
            eps: 1e-5,
            momentum: Some(0.1),
            affine: true,
            track_running_stats: true,
        }
    }
}

/// What a training forward keeps for its backward.
#[derive(Clone, Debug)]
pub struct BnSaved {
    /// The normalised input `x̂`, same shape as the input.
    xhat: Vec<f32>,
    /// `1 / sqrt(var + eps)` per channel.
    invstd: Vec<f64>,
    /// Elements per channel over the whole group.
    count: f64,
    /// The input's `[N, C, S]` view.
    dims: [usize; 3],
}

/// Gradients of one [`SyncBatchNorm::backward`]: the input's (complete) and the weight's and
/// bias's (this rank's part; sum them over the data-parallel group, as DDP does).
#[derive(Clone, Debug, PartialEq)]
pub struct BnGrads {
    /// Gradient of the input.
    pub input: Vec<f32>,
    /// This rank's part of the weight gradient (empty without `affine`).
    pub weight: Vec<f32>,
    /// This rank's part of the bias gradient (empty without `affine`).
    pub bias: Vec<f32>,
}

/// Batch normalisation over a process group; see the [module docs](self).
#[derive(Clone, Debug)]
pub struct SyncBatchNorm {
    group: ProcessGroup,
    opts: BatchNormOptions,
    /// Per-channel scale (ones at construction).
    pub weight: Vec<f32>,
    /// Per-channel shift (zeros at construction).
    pub bias: Vec<f32>,
    /// Running mean (zeros at construction).
    pub running_mean: Vec<f32>,
    /// Running unbiased variance (ones at construction).
    pub running_var: Vec<f32>,
    /// Training batches seen.
    pub num_batches_tracked: u64,
    training: bool,
}

impl SyncBatchNorm {
    /// A fresh layer over `num_features` channels, in training mode.
    pub fn new(group: ProcessGroup, num_features: usize, opts: BatchNormOptions) -> Self {
        let affine = if opts.affine { num_features } else { 0 };
        let stats = if opts.track_running_stats {
            num_features
        } else {
            0
        };
        SyncBatchNorm {
            group,
            opts,
            weight: vec![1.0; affine],
            bias: vec![0.0; affine],
            running_mean: vec![0.0; stats],
            running_var: vec![1.0; stats],
            num_batches_tracked: 0,
            training: true,
        }
    }

    /// Converts an ordinary batch norm's state (torch's `convert_sync_batchnorm` for one
    /// layer): `weight`/`bias` empty without affine, `running_*` empty without running stats.
    pub fn from_batch_norm(
        group: ProcessGroup,
        weight: Vec<f32>,
        bias: Vec<f32>,
        running_mean: Vec<f32>,
        running_var: Vec<f32>,
        num_batches_tracked: u64,
        opts: BatchNormOptions,
    ) -> Result<Self> {
        let c = weight.len().max(running_mean.len());
        let want = |on: bool| if on { c } else { 0 };
        let lens = [
            weight.len(),
            bias.len(),
            running_mean.len(),
            running_var.len(),
        ];
        let wants = [
            want(opts.affine),
            want(opts.affine),
            want(opts.track_running_stats),
            want(opts.track_running_stats),
        ];
        if lens != wants || c == 0 {
            return Err(Error::InvalidInput {
                rank: group.rank(),
                op: "SyncBatchNorm::from_batch_norm",
                reason: format!(
                    "weight, bias, running_mean, running_var have {lens:?} elements; with \
                     affine={} and track_running_stats={} they need {wants:?} (and C > 0)",
                    opts.affine, opts.track_running_stats
                ),
            });
        }
        Ok(SyncBatchNorm {
            group,
            opts,
            weight,
            bias,
            running_mean,
            running_var,
            num_batches_tracked,
            training: true,
        })
    }

    /// Training mode (batch statistics over the group) or eval mode (running statistics, no
    /// communication; only with running stats tracked).
    pub fn train(&mut self, training: bool) {
        self.training = training;
    }

    /// The settings.
    pub fn options(&self) -> &BatchNormOptions {
        &self.opts
    }

    fn err(&self, op: &'static str, reason: String) -> Error {
        Error::InvalidInput {
            rank: self.group.rank(),
            op,
            reason,
        }
    }

    /// `shape` (`[N, C, *spatial]`) as `[N, C, S]`, checked against `len` and the channels.
    fn dims(&self, op: &'static str, shape: &[usize], len: usize) -> Result<[usize; 3]> {
        let c = self.weight.len().max(self.running_mean.len());
        if shape.len() < 2 || shape[1] != c || shape.iter().product::<usize>() != len {
            return Err(self.err(
                op,
                format!(
                    "input of shape {shape:?} with {len} elements; want [N, {c}, *spatial] \
                     matching the buffer"
                ),
            ));
        }
        Ok([shape[0], c, shape[2..].iter().product()])
    }

    /// Normalises `x` (of `shape` `[N, C, *spatial]`, this rank's part of the batch). In
    /// training mode every rank of the group must call it (one all_reduce) and the batch
    /// statistics and running statistics are the whole group's; the returned [`BnSaved`]
    /// feeds [`backward`](Self::backward). In eval mode nothing is communicated.
    pub fn forward(&mut self, x: &[f32], shape: &[usize]) -> Result<(Vec<f32>, BnSaved)> {
        const OP: &str = "SyncBatchNorm::forward";
        let [n, c, s] = self.dims(OP, shape, x.len())?;
        let use_batch = self.training || !self.opts.track_running_stats;
        let (mean, var, count) = if use_batch {
            // [sum_0..C, sumsq_0..C, count]: one all_reduce.
            let mut stats = vec![0f64; 2 * c + 1];
            for (i, &v) in x.iter().enumerate() {
                let ch = (i / s) % c;
                stats[ch] += v as f64;
                stats[c + ch] += (v as f64) * (v as f64);
            }
            stats[2 * c] = (n * s) as f64;
            self.group.all_reduce(&mut stats, ReduceOp::Sum)?;
            let count = stats[2 * c];
            if count <= 1.0 && self.training {
                return Err(self.err(
                    OP,
                    format!(
                        "expected more than 1 value per channel when training over the group, \
                         got {count} (input {shape:?})"
                    ),
                ));
            }
            let mean: Vec<f64> = stats[..c].iter().map(|&t| t / count).collect();
            let var: Vec<f64> = (0..c)
                .map(|k| (stats[c + k] / count - mean[k] * mean[k]).max(0.0))
                .collect();
            (mean, var, count)
        } else {
            let mean = self.running_mean.iter().map(|&v| v as f64).collect();
            let var = self.running_var.iter().map(|&v| v as f64).collect();
            (mean, var, 0.0)
        };
        if self.training && self.opts.track_running_stats {
            self.num_batches_tracked += 1;
            let m = self
                .opts
                .momentum
                .unwrap_or(1.0 / self.num_batches_tracked as f64);
            let unbiased = count / (count - 1.0);
            for k in 0..c {
                let rm = &mut self.running_mean[k];
                *rm = ((1.0 - m) * *rm as f64 + m * mean[k]) as f32;
                let rv = &mut self.running_var[k];
                *rv = ((1.0 - m) * *rv as f64 + m * var[k] * unbiased) as f32;
            }
        }
        let invstd: Vec<f64> = var
            .iter()
            .map(|&v| 1.0 / (v + self.opts.eps).sqrt())
            .collect();
        let mut xhat = vec![0f32; x.len()];
        let mut y = vec![0f32; x.len()];
        for (i, &v) in x.iter().enumerate() {
            let ch = (i / s) % c;
            let h = (v as f64 - mean[ch]) * invstd[ch];
            xhat[i] = h as f32;
            y[i] = if self.opts.affine {
                (h * self.weight[ch] as f64 + self.bias[ch] as f64) as f32
            } else {
                h as f32
            };
        }
        Ok((
            y,
            BnSaved {
                xhat,
                invstd,
                count,
                dims: [n, c, s],
            },
        ))
    }

    /// Gradients for `grad_out` (same shape as the forward's input) of the training forward
    /// that returned `saved`: one all_reduce of `Σdy` and `Σdy·x̂` per channel. Every rank of
    /// the group calls it. In eval mode the statistics are constants and nothing is
    /// communicated.
    pub fn backward(&self, saved: &BnSaved, grad_out: &[f32]) -> Result<BnGrads> {
        const OP: &str = "SyncBatchNorm::backward";
        let [_, c, s] = saved.dims;
        if grad_out.len() != saved.xhat.len() {
            return Err(self.err(
                OP,
                format!(
                    "grad_out has {} elements, the forward's input had {}",
                    grad_out.len(),
                    saved.xhat.len()
                ),
            ));
        }
        let mut sums = vec![0f64; 2 * c];
        for (i, (&dy, &h)) in grad_out.iter().zip(&saved.xhat).enumerate() {
            let ch = (i / s) % c;
            sums[ch] += dy as f64;
            sums[c + ch] += dy as f64 * h as f64;
        }
        let (weight, bias) = if self.opts.affine {
            (
                sums[c..].iter().map(|&v| v as f32).collect(),
                sums[..c].iter().map(|&v| v as f32).collect(),
            )
        } else {
            (Vec::new(), Vec::new())
        };
        // Batch statistics depend on the input; running ones (eval) do not.
        let batch_stats = saved.count > 0.0;
        if batch_stats {
            self.group.all_reduce(&mut sums, ReduceOp::Sum)?;
        }
        let input = grad_out
            .iter()
            .zip(&saved.xhat)
            .enumerate()
            .map(|(i, (&dy, &h))| {
                let ch = (i / s) % c;
                let scale = saved.invstd[ch]
                    * if self.opts.affine {
                        self.weight[ch] as f64
                    } else {
                        1.0
                    };
                let g = if batch_stats {
                    let mean_dy = sums[ch] / saved.count;
                    let mean_dy_xhat = sums[c + ch] / saved.count;
                    dy as f64 - mean_dy - h as f64 * mean_dy_xhat
                } else {
                    dy as f64
                };
                (g * scale) as f32
            })
            .collect();
        Ok(BnGrads {
            input,
            weight,
            bias,
        })
    }
}
