//! The candle adapter of tensor parallelism (feature `candle`): a candle model's full
//! parameters sharded by a [`ParallelizePlan`] into candle [`Var`]s holding this rank's
//! shards, and MLP and attention blocks that are ordinary candle [`Module`]s. The collectives
//! are candle custom ops ([`copy_to_group`] before the
//! column-parallel layers, [`reduce_from_group`] after
//! the row-parallel one), so candle's autograd gives every shard its gradient with one
//! all_reduce in forward and one in backward per block.
//!
//! Sequence parallelism is on the flat-buffer blocks only ([`TpMlp`](super::TpMlp) with
//! `seq_parallel`); here activations between blocks are replicated.

use std::collections::BTreeMap;

use candle_core::{D, DType, Device, Module, Tensor, Var};
use dist_collective::{DTensor, DeviceMesh, ProcessGroup};

use super::{FullParam, ParallelStyle, ParallelizePlan};
use crate::candle_comm::{copy_to_group, reduce_from_group};
use crate::{Error, Result};

/// A candle model's parameters after [`parallelize_module`]: this rank's shards as
/// [`DTensor`]s, from which the blocks below are built.
#[derive(Debug)]
pub struct Parallelized {
    plan: ParallelizePlan,
    mesh: DeviceMesh,
    params: BTreeMap<String, DTensor<f32>>,
    device: Device,
}

/// Shards the named full parameters of a candle model (the same on every rank, e.g. from a
/// `VarMap` or a safetensors file) by `plan` over the 1-D tensor-parallel `mesh` (torch's
/// `parallelize_module`).
pub fn parallelize_module(
    plan: &ParallelizePlan,
    mesh: &DeviceMesh,
    named: &[(&str, &Tensor)],
) -> Result<Parallelized> {
    let device = named
        .first()
        .map_or(Device::Cpu, |(_, t)| t.device().clone());
    let full = named
        .iter()
        .map(|(n, t)| {
            let v = t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
            Ok((*n, t.dims().to_vec(), v))
        })
        .collect::<Result<Vec<_>>>()?;
    let fp: Vec<FullParam<'_>> = full
        .iter()
        .map(|(name, shape, values)| FullParam {
            name,
            shape,
            values,
        })
        .collect();
    let params = plan.distribute(mesh, &fp)?.into_iter().collect();
    Ok(Parallelized {
        plan: plan.clone(),
        mesh: mesh.clone(),
        params,
        device,
    })
}

impl Parallelized {
    /// The sharded parameter `name`.
    pub fn param(&self, name: &str) -> Option<&DTensor<f32>> {
        self.params.get(name)
    }

    fn err(&self, reason: String) -> Error {
        Error::InvalidInput {
            rank: self.mesh.group().rank(),
            op: "Parallelized",
            reason,
        }
    }

    /// The linear layer `layer` (`<layer>.weight`, optional `<layer>.bias`) with the plan's
    /// style, as candle variables.
    pub fn linear(&self, layer: &str) -> Result<CandleTpLinear> {
        let style = self.plan.style_for(layer);
        let Some(style @ (ParallelStyle::Colwise | ParallelStyle::Rowwise)) = style else {
            return Err(self.err(format!(
                "layer {layer:?} has style {style:?} in the plan; a tensor-parallel linear \
                 layer needs Colwise or Rowwise"
            )));
        };
        let w = self
            .param(&format!("{layer}.weight"))
            .ok_or_else(|| self.err(format!("no parameter {layer}.weight")))?;
        let var = |t: &DTensor<f32>| -> Result<Var> {
            Ok(Var::from_slice(
                t.to_local(),
                t.local_shape(),
                &self.device,
            )?)
        };
        Ok(CandleTpLinear {
            style,
            weight: var(w)?,
            bias: self.param(&format!("{layer}.bias")).map(var).transpose()?,
            global_weight: [w.shape()[0], w.shape()[1]],
            mesh: self.mesh.clone(),
        })
    }

    /// An MLP `fc2(gelu(fc1(x)))` from the layers `fc1` (colwise) and `fc2` (rowwise).
    pub fn mlp(&self, fc1: &str, fc2: &str) -> Result<CandleTpMlp> {
        let (fc1, fc2) = (self.linear(fc1)?, self.linear(fc2)?);
        if fc1.style != ParallelStyle::Colwise || fc2.style != ParallelStyle::Rowwise {
            return Err(self.err("an MLP needs fc1 Colwise and fc2 Rowwise".into()));
        }
        Ok(CandleTpMlp {
            group: self.mesh.dim_group(0).clone(),
            fc1,
            fc2,
        })
    }

    /// Self-attention from the layers `[q, k, v, o]` (colwise, colwise, colwise, rowwise)
    /// with `heads` heads; each rank's share must be whole heads.
    pub fn attention(
        &self,
        layers: [&str; 4],
        heads: usize,
        causal: bool,
    ) -> Result<CandleTpAttention> {
        let [q, k, v, o] = layers.map(|l| self.linear(l));
        let (q, k, v, o) = (q?, k?, v?, o?);
        let hidden = q.global_weight[1];
        let local = q.weight.dims()[0];
        let ok_styles = [&q, &k, &v]
            .iter()
            .all(|l| l.style == ParallelStyle::Colwise)
            && o.style == ParallelStyle::Rowwise;
        if !ok_styles
            || heads == 0
            || !hidden.is_multiple_of(heads)
            || !local.is_multiple_of(hidden / heads)
        {
            return Err(self.err(format!(
                "attention needs q, k, v Colwise and o Rowwise, and this rank's {local} \
                 projection outputs whole heads of {hidden}/{heads}"
            )));
        }
        Ok(CandleTpAttention {
            group: self.mesh.dim_group(0).clone(),
            head_dim: hidden / heads,
            local_heads: local / (hidden / heads),
            causal,
            q,
            k,
            v,
            o,
        })
    }
}

/// A column- or row-parallel linear layer holding this rank's shards as candle variables.
#[derive(Clone, Debug)]
pub struct CandleTpLinear {
    style: ParallelStyle,
    weight: Var,
    bias: Option<Var>,
    global_weight: [usize; 2],
    mesh: DeviceMesh,
}

impl CandleTpLinear {
    /// The variables (weight, then bias) for the optimizer.
    pub fn vars(&self) -> Vec<Var> {
        let mut v = vec![self.weight.clone()];
        v.extend(self.bias.clone());
        v
    }

    /// Tensors shaped like this layer's shards (its variables, or their gradients from a
    /// `GradStore`), weight then bias, as DTensors with the style's placements: to gather the
    /// full tensor or to checkpoint it.
    pub fn to_dtensors(&self, weight: &Tensor, bias: Option<&Tensor>) -> Result<Vec<DTensor<f32>>> {
        let mut out = vec![DTensor::from_local(
            weight.flatten_all()?.to_vec1::<f32>()?,
            &self.global_weight,
            &self.mesh,
            &[self.style.placement("weight")],
        )?];
        if let Some(b) = bias {
            out.push(DTensor::from_local(
                b.flatten_all()?.to_vec1::<f32>()?,
                &[self.global_weight[0]],
                &self.mesh,
                &[self.style.placement("bias")],
            )?);
        }
        Ok(out)
    }

    /// `x W_localᵀ` on 2-D `x`; column-parallel adds its bias shard, row-parallel leaves the
    /// partial sum for the caller to reduce and then [`add_bias`](Self::add_bias).
    fn forward_local(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let y = x.matmul(&self.weight.as_tensor().t()?)?;
        match (&self.bias, self.style) {
            (Some(b), ParallelStyle::Colwise) => y.broadcast_add(b.as_tensor()),
            _ => Ok(y),
        }
    }

    fn add_bias(&self, y: Tensor) -> candle_core::Result<Tensor> {
        match &self.bias {
            Some(b) => y.broadcast_add(b.as_tensor()),
            None => Ok(y),
        }
    }
}

/// `x` (`[..., hidden]`) as `[tokens, hidden]`, with the shape to restore.
fn flatten_tokens(x: &Tensor) -> candle_core::Result<(Tensor, Vec<usize>)> {
    let dims = x.dims().to_vec();
    let h = *dims
        .last()
        .ok_or_else(|| candle_core::Error::Msg("0-D activation".into()))?;
    Ok((x.reshape(((), h))?, dims))
}

/// A tensor-parallel MLP as a candle module; see the [module docs](self).
#[derive(Clone, Debug)]
pub struct CandleTpMlp {
    group: ProcessGroup,
    fc1: CandleTpLinear,
    fc2: CandleTpLinear,
}

impl CandleTpMlp {
    /// The layers, fc1 then fc2.
    pub fn layers(&self) -> [&CandleTpLinear; 2] {
        [&self.fc1, &self.fc2]
    }
}

impl Module for CandleTpMlp {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let (x, dims) = flatten_tokens(x)?;
        let x = copy_to_group(&x, &self.group)?;
        let h = self.fc1.forward_local(&x)?.gelu()?;
        let y = reduce_from_group(&self.fc2.forward_local(&h)?, &self.group)?;
        self.fc2.add_bias(y)?.reshape(dims)
    }
}

/// Tensor-parallel self-attention as a candle module over `[batch, seq, hidden]`; see the
/// [module docs](self).
#[derive(Clone, Debug)]
pub struct CandleTpAttention {
    group: ProcessGroup,
    head_dim: usize,
    local_heads: usize,
    causal: bool,
    q: CandleTpLinear,
    k: CandleTpLinear,
    v: CandleTpLinear,
    o: CandleTpLinear,
}

impl CandleTpAttention {
    /// The projections q, k, v, o.
    pub fn layers(&self) -> [&CandleTpLinear; 4] {
        [&self.q, &self.k, &self.v, &self.o]
    }
}

impl Module for CandleTpAttention {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let (b, s, _) = x.dims3()?;
        let (x2, dims) = flatten_tokens(x)?;
        let x2 = copy_to_group(&x2, &self.group)?;
        let (nh, d) = (self.local_heads, self.head_dim);
        // [b*s, nh*d] -> [b, nh, s, d]
        let heads = |l: &CandleTpLinear| -> candle_core::Result<Tensor> {
            l.forward_local(&x2)?
                .reshape((b, s, nh, d))?
                .transpose(1, 2)?
                .contiguous()
        };
        let (q, k, v) = (heads(&self.q)?, heads(&self.k)?, heads(&self.v)?);
        let mut scores = (q.matmul(&k.t()?.contiguous()?)? / (d as f64).sqrt())?;
        if self.causal {
            let mask: Vec<f32> = (0..s * s)
                .map(|i| {
                    if i % s > i / s {
                        f32::NEG_INFINITY
                    } else {
                        0.0
                    }
                })
                .collect();
            let mask = Tensor::from_vec(mask, (s, s), x.device())?;
            scores = scores.broadcast_add(&mask)?;
        }
        // Softmax over keys; the max is a constant shift, so it carries no gradient.
        let m = scores.max_keepdim(D::Minus1)?.detach();
        let e = scores.broadcast_sub(&m)?.exp()?;
        let p = e.broadcast_div(&e.sum_keepdim(D::Minus1)?)?;
        let ctx = p.matmul(&v)?.transpose(1, 2)?.reshape((b * s, nh * d))?;
        let y = reduce_from_group(&self.o.forward_local(&ctx)?, &self.group)?;
        self.o.add_bias(y)?.reshape(dims)
    }
}
