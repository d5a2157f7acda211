//! FSDP for [candle](https://github.com/huggingface/candle) models (feature `candle`): a unit's
//! gathered parameters come back as fresh candle `Var`s, and candle's gradients of them go
//! back to FSDP, so a candle model becomes FSDP with a few lines.
//!
//! The `Var`s live only while the unit is gathered: drop them (and any graph that holds them)
//! after the unit's forward, and build the unit again from [`CandleFsdp::pre_backward`]'s
//! `Var`s to differentiate it (per-unit activation checkpointing, which is what lets resharding
//! after the forward actually free memory in a framework whose graph keeps its inputs alive).

use candle_core::backprop::GradStore;
use candle_core::{Device, Tensor, Var, WithDType};

use super::precision::ComputeElement;
use super::{Fsdp, FsdpOptions, FsdpStepStats};
use crate::{Error, ParamInfo, Result};

/// [`Fsdp`] over candle tensors. `C` is the compute type (`f32`, `half::bf16`, `half::f16`).
pub struct CandleFsdp<C: ComputeElement + WithDType = f32> {
    inner: Fsdp<C>,
    device: Device,
}

impl<C: ComputeElement + WithDType> std::fmt::Debug for CandleFsdp<C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CandleFsdp")
            .field("inner", &self.inner)
            .finish()
    }
}

impl<C: ComputeElement + WithDType> CandleFsdp<C> {
    /// Shards a model given as units of named `f32` tensors (their initial values; rank 0's
    /// win). Gathered `Var`s are created on `device`. A unit whose tensors are not all `f32`
    /// is an error naming the tensor.
    pub fn new(
        pg: dist_collective::ProcessGroup,
        units: &[Vec<(String, Tensor)>],
        opts: FsdpOptions,
        device: &Device,
    ) -> Result<Self> {
        let rank = pg.rank();
        let mut infos = Vec::with_capacity(units.len());
        let mut values = Vec::new();
        for (u, unit) in units.iter().enumerate() {
            let mut unit_infos = Vec::with_capacity(unit.len());
            for (name, t) in unit {
                if t.dtype() != candle_core::DType::F32 {
                    let first = unit.first().map(|(n, t)| format!("{n} is {:?}", t.dtype()));
                    return Err(Error::Fsdp {
                        rank,
                        op: "new",
                        tensor: name.clone(),
                        reason: format!(
                            "unit {u} mixes dtypes ({}, this one is {:?}); FSDP shards hold f32 parameters, give every tensor as f32 and choose the compute type with CandleFsdp<C>",
                            first.unwrap_or_default(),
                            t.dtype()
                        ),
                    });
                }
                let v = t
                    .flatten_all()
                    .and_then(|t| t.to_vec1::<f32>())
                    .map_err(|source| Error::FsdpCandle {
                        rank,
                        op: "new",
                        tensor: name.clone(),
                        source,
                    })?;
                unit_infos.push(ParamInfo::new(name.clone(), t.dims()));
                values.push(v);
            }
            infos.push(unit_infos);
        }
        let slices: Vec<&[f32]> = values.iter().map(Vec::as_slice).collect();
        Ok(CandleFsdp {
            inner: Fsdp::new(pg, infos, opts, &slices)?,
            device: device.clone(),
        })
    }

    fn vars(&self, u: usize, op: &'static str, flat: &[C]) -> Result<Vec<Var>> {
        let rank = self.inner.coordinate().last().copied().unwrap_or(0);
        self.inner
            .unit_params(u)
            .iter()
            .enumerate()
            .map(|(i, p)| {
                Tensor::from_slice(
                    &flat[self.inner.param_range(u, i)],
                    p.shape.as_slice(),
                    &self.device,
                )
                .and_then(|t| Var::from_tensor(&t))
                .map_err(|source| Error::FsdpCandle {
                    rank,
                    op,
                    tensor: p.name.clone(),
                    source,
                })
            })
            .collect()
    }

    /// Unit `u`'s parameters for its forward, as fresh `Var`s in the unit's order.
    pub fn pre_forward(&mut self, u: usize) -> Result<Vec<Var>> {
        let flat = self.inner.pre_forward(u)?.to_vec();
        self.vars(u, "pre_forward", &flat)
    }

    /// After unit `u`'s forward (see [`Fsdp::post_forward`]).
    pub fn post_forward(&mut self, u: usize) -> Result<()> {
        self.inner.post_forward(u)
    }

    /// Unit `u`'s parameters for its backward, as fresh `Var`s.
    pub fn pre_backward(&mut self, u: usize) -> Result<Vec<Var>> {
        let flat = self.inner.pre_backward(u)?.to_vec();
        self.vars(u, "pre_backward", &flat)
    }

    /// Hands unit `u`'s gradients to FSDP: `vars` are the `Var`s its backward used (from
    /// [`pre_backward`](Self::pre_backward)), `grads` candle's result; a parameter with no
    /// gradient counts as zero.
    pub fn post_backward(&mut self, u: usize, vars: &[Var], grads: &GradStore) -> Result<()> {
        let rank = self.inner.coordinate().last().copied().unwrap_or(0);
        let params = self.inner.unit_params(u);
        if vars.len() != params.len() {
            return Err(Error::Fsdp {
                rank,
                op: "post_backward",
                tensor: format!("unit {u}"),
                reason: format!(
                    "{} vars for a unit of {} parameters",
                    vars.len(),
                    params.len()
                ),
            });
        }
        let mut flat: Vec<C> = Vec::with_capacity(self.inner.unit_len(u));
        for (v, p) in vars.iter().zip(params) {
            match grads.get(v.as_tensor()) {
                Some(g) => {
                    let g = g
                        .flatten_all()
                        .and_then(|g| g.to_dtype(<C as WithDType>::DTYPE))
                        .and_then(|g| g.to_vec1::<C>())
                        .map_err(|source| Error::FsdpCandle {
                            rank,
                            op: "post_backward",
                            tensor: p.name.clone(),
                            source,
                        })?;
                    flat.extend_from_slice(&g);
                }
                None => flat.extend(std::iter::repeat_n(C::default(), p.numel())),
            }
        }
        self.inner.post_backward(u, &flat)
    }

    /// Ends the backward pass (see [`Fsdp::finish`]).
    pub fn finish(&mut self) -> Result<FsdpStepStats> {
        self.inner.finish()
    }

    /// The flat-buffer core: shards for the optimizer, the checkpoint, clipping, no_sync.
    pub fn inner(&self) -> &Fsdp<C> {
        &self.inner
    }

    /// The flat-buffer core, mutably.
    pub fn inner_mut(&mut self) -> &mut Fsdp<C> {
        &mut self.inner
    }
}
