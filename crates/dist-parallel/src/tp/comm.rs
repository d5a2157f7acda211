//! The two boundary operators of a Megatron block over a `[tokens, hidden]` activation, as
//! DTensor redistributions on the 1-D tensor-parallel mesh.
//!
//! Without sequence parallelism the activation is `Replicate` outside a block: entering is
//! free and leaving reduces the block's `Partial` output with one all_reduce (Megatron's `f`
//! and `g`). With it the activation is `Shard(0)` (a run of tokens per rank) outside: entering
//! all-gathers the tokens, leaving reduce-scatters them. Backward swaps the two: the gradient
//! of "enter" is "leave" and vice versa, so a block costs one collective each way (two with
//! sequence parallelism, moving the same bytes as one all_reduce).

use dist_collective::{DTensor, DeviceMesh, Placement, ReduceOp};

use crate::Result;

/// The activation layout outside blocks.
fn outside(seq_parallel: bool) -> Placement {
    if seq_parallel {
        Placement::Shard(0)
    } else {
        Placement::Replicate
    }
}

/// The full `[tokens, hidden]` activation a block computes on, from what lies outside it.
pub(crate) fn enter(
    mesh: &DeviceMesh,
    x: &[f32],
    tokens: usize,
    hidden: usize,
    seq_parallel: bool,
) -> Result<Vec<f32>> {
    if !seq_parallel {
        return Ok(x.to_vec());
    }
    let t = DTensor::from_local(x.to_vec(), &[tokens, hidden], mesh, &[outside(true)])?;
    Ok(t.redistribute(&[Placement::Replicate])?.into_local())
}

/// A block's partial `[tokens, hidden]` output reduced into the layout outside blocks.
pub(crate) fn leave(
    mesh: &DeviceMesh,
    partial: Vec<f32>,
    tokens: usize,
    hidden: usize,
    seq_parallel: bool,
) -> Result<Vec<f32>> {
    let t = DTensor::from_local(
        partial,
        &[tokens, hidden],
        mesh,
        &[Placement::Partial(ReduceOp::Sum)],
    )?;
    Ok(t.redistribute(&[outside(seq_parallel)])?.into_local())
}

/// This rank's token rows of a `[tokens, hidden]` activation under sequence parallelism.
pub(crate) fn local_tokens(mesh: &DeviceMesh, tokens: usize, seq_parallel: bool) -> usize {
    if seq_parallel {
        dist_collective::chunk_range(tokens, mesh.shape()[0], mesh.coordinate()[0]).len()
    } else {
        tokens
    }
}
