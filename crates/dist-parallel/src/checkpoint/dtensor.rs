//! [`DTensor`]s in and out of the checkpoint: a DTensor already is "a
//! [`ShardLayout`](dist_collective::ShardLayout), a mesh coordinate and local data", so the
//! adapter only reads those three off it, plus what to do with `Partial` placements.
//!
//! **Saving** reduces `Partial` dimensions to `Replicate` first (one all_reduce per partial
//! mesh dimension, over that dimension's group), because a checkpoint stores values, and a
//! partial value is not one until it is reduced; torch's DCP does the same
//! (`DTensor.full_tensor`/`redistribute` before `save`). **Loading** into a `Partial`
//! DTensor is refused: the stored value could be split into partial addends in more than
//! one way, so the caller loads into `Replicate` (or `Shard`) and redistributes to the
//! partial placement it wants.

use dist_collective::{DTensor, Placement};
use dist_wire::Element;

use super::{LocalTensor, LocalTensorMut};
use crate::{Error, Result};

impl LocalTensor {
    /// This rank's slice of `tensor`, to save as `name`. `Partial` placements are reduced to
    /// `Replicate` first, a collective over those mesh dimensions, so every rank of the
    /// mesh calls it (as it calls [`save`](fn@super::save)); without `Partial` placements
    /// nothing is communicated.
    pub fn from_dtensor<T: Element>(name: impl Into<String>, tensor: &DTensor<T>) -> Result<Self> {
        let name = name.into();
        let coord = tensor.mesh().coordinate();
        if !tensor.placements().iter().any(is_partial) {
            return Ok(LocalTensor::new(
                name,
                tensor.layout().clone(),
                coord,
                tensor.to_local(),
            ));
        }
        let reduced: Vec<Placement> = tensor
            .placements()
            .iter()
            .map(|p| {
                if is_partial(p) {
                    Placement::Replicate
                } else {
                    *p
                }
            })
            .collect();
        let t = tensor.redistribute(&reduced)?;
        Ok(LocalTensor::new(
            name,
            t.layout().clone(),
            coord,
            t.to_local(),
        ))
    }
}

impl<'a> LocalTensorMut<'a> {
    /// `tensor`'s local piece as the destination of tensor `name`: loading fills exactly the
    /// box its placements give this rank, whatever mesh and placements the checkpoint was
    /// saved with. A `Partial` placement is an error naming the rank and the tensor (load
    /// into `Replicate` and redistribute instead).
    pub fn from_dtensor<T: Element>(
        name: impl Into<String>,
        tensor: &'a mut DTensor<T>,
    ) -> Result<Self> {
        let name = name.into();
        if let Some(p) = tensor.placements().iter().find(|p| is_partial(p)) {
            return Err(Error::Checkpoint {
                rank: tensor.mesh().group().rank(),
                op: "load",
                tensor: name,
                reason: format!(
                    "cannot load into placement {p}: a stored value has no unique split into \
                     partial addends; load into Replicate and redistribute"
                ),
            });
        }
        let layout = tensor.layout().clone();
        let coord = tensor.mesh().coordinate().to_vec();
        Ok(LocalTensorMut::new(
            name,
            layout,
            &coord,
            tensor.local_mut(),
        ))
    }
}

fn is_partial(p: &Placement) -> bool {
    matches!(p, Placement::Partial(_))
}
