//! Collectives as candle custom ops with their adjoints, so candle's autograd puts the
//! backward collective where Megatron and SyncBatchNorm need it (feature `candle`).
//!
//! | op | forward | backward |
//! |---|---|---|
//! | [`copy_to_group`] (Megatron's `f`) | identity | all_reduce |
//! | [`reduce_from_group`] (Megatron's `g`) | all_reduce | identity |
//! | [`all_reduce_sum`] | all_reduce | all_reduce |
//!
//! The adjoint of a sum over ranks is a sum over ranks: every rank's loss depends on the
//! reduced value, so each rank's input gradient is the sum of all ranks' output gradients.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp1, Layout, Shape, Tensor};
use dist_collective::{Element, ProcessGroup, ReduceOp};

#[derive(Clone, Copy, Debug, PartialEq)]
enum Kind {
    Copy,
    Reduce,
    AllReduce,
}

#[derive(Clone, Debug)]
struct GroupOp {
    group: ProcessGroup,
    kind: Kind,
}

/// All-reduces a contiguous run of `storage` in place of a copy.
fn reduced<T: Element>(group: &ProcessGroup, all: &[T], l: &Layout) -> candle_core::Result<Vec<T>> {
    let (start, end) = l
        .contiguous_offsets()
        .ok_or_else(|| candle_core::Error::Msg("collective on a non-contiguous tensor".into()))?;
    let mut v = all[start..end].to_vec();
    group
        .all_reduce(&mut v, ReduceOp::Sum)
        .map_err(candle_core::Error::wrap)?;
    Ok(v)
}

impl CustomOp1 for GroupOp {
    fn name(&self) -> &'static str {
        match self.kind {
            Kind::Copy => "copy_to_group",
            Kind::Reduce => "reduce_from_group",
            Kind::AllReduce => "all_reduce_sum",
        }
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let copy = self.kind == Kind::Copy;
        let out = match s {
            CpuStorage::F32(v) if copy => CpuStorage::F32(contiguous(v, l)?),
            CpuStorage::F64(v) if copy => CpuStorage::F64(contiguous(v, l)?),
            CpuStorage::F32(v) => CpuStorage::F32(reduced(&self.group, v, l)?),
            CpuStorage::F64(v) => CpuStorage::F64(reduced(&self.group, v, l)?),
            other => {
                return Err(candle_core::Error::Msg(format!(
                    "rank {}: {} takes f32 or f64 tensors, got {:?}",
                    self.group.rank(),
                    self.name(),
                    other.dtype()
                )));
            }
        };
        Ok((out, l.shape().clone()))
    }

    fn bwd(
        &self,
        _arg: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<Option<Tensor>> {
        let g = match self.kind {
            Kind::Reduce => grad.clone(),
            Kind::Copy | Kind::AllReduce => all_reduce_sum(grad, &self.group)?,
        };
        Ok(Some(g))
    }
}

fn contiguous<T: Copy>(all: &[T], l: &Layout) -> candle_core::Result<Vec<T>> {
    let (start, end) = l
        .contiguous_offsets()
        .ok_or_else(|| candle_core::Error::Msg("collective on a non-contiguous tensor".into()))?;
    Ok(all[start..end].to_vec())
}

fn apply(x: &Tensor, group: &ProcessGroup, kind: Kind) -> candle_core::Result<Tensor> {
    x.contiguous()?.apply_op1(GroupOp {
        group: group.clone(),
        kind,
    })
}

/// Megatron's `f`: the identity forward, an all_reduce of the gradient backward (the input
/// of column-parallel layers).
pub fn copy_to_group(x: &Tensor, group: &ProcessGroup) -> candle_core::Result<Tensor> {
    apply(x, group, Kind::Copy)
}

/// Megatron's `g`: an all_reduce forward (the partial output of row-parallel layers), the
/// identity backward.
pub fn reduce_from_group(x: &Tensor, group: &ProcessGroup) -> candle_core::Result<Tensor> {
    apply(x, group, Kind::Reduce)
}

/// A sum over the group whose gradient is the sum over the group of the gradients (the
/// statistics of SyncBatchNorm).
pub fn all_reduce_sum(x: &Tensor, group: &ProcessGroup) -> candle_core::Result<Tensor> {
    apply(x, group, Kind::AllReduce)
}
