//! A distributed checkpoint: every rank writes its slices of the state as one standard
//! [safetensors](https://huggingface.co/docs/safetensors) file, and one JSON index names every
//! tensor's global shape, dtype and which file holds which [`Chunk`] of it (torch's DCP, with
//! safetensors as the storage format).
//!
//! The API is generic over *a named tensor described by a [`ShardLayout`], a mesh coordinate
//! and local data* ([`LocalTensor`] to save, [`LocalTensorMut`] to load into), so FSDP shards,
//! DDP replicas, plain single-process tensors and DTensors all use it, and a checkpoint saved
//! with one layout (FSDP at 4 ranks) loads with any other (FSDP at 3, DDP, one process):
//! each rank reads, of each file, only the byte range its slices need.
//!
//! **Atomic**: each save gets a fresh id; files are written under a temporary name and
//! renamed, and the index (the only thing [`load`](fn@load) trusts) is written last, under a temporary
//! name, then renamed over the previous one. A save killed at any moment leaves the previous
//! checkpoint loadable and nothing that looks complete; files of older saves are removed only
//! after the new index is in place.
//!
//! ```
//! use dist_collective::{ShardLayout, testing::run_world};
//! use dist_parallel::checkpoint::{self, LocalTensor, LocalTensorMut};
//!
//! let dir = tempfile::tempdir().unwrap();
//! let path = dir.path().to_path_buf();
//! // Two ranks save a [4, 2] tensor sharded on dim 0...
//! run_world(2, move |pg| {
//!     let layout = ShardLayout::shard_dim0(&[4, 2], 2).unwrap();
//!     let mine: Vec<f32> = (0..4).map(|i| (pg.rank() * 4 + i) as f32).collect();
//!     let t = LocalTensor::new("w", layout, &[pg.rank()], &mine);
//!     checkpoint::save(&pg, &path, vec![t]).unwrap();
//!     Ok(())
//! })
//! .unwrap();
//! // ...and one process loads it whole.
//! let mut w = vec![0.0f32; 8];
//! let layout = ShardLayout::shard_dim0(&[4, 2], 1).unwrap();
//! checkpoint::load(dir.path(), 0, &mut [LocalTensorMut::new("w", layout, &[0], &mut w)]).unwrap();
//! assert_eq!(w, [0., 1., 2., 3., 4., 5., 6., 7.]);
//! ```

mod dtensor;
mod index;
mod load;
mod save;

use dist_collective::{Chunk, ShardLayout};
use dist_wire::{DType, Element};

pub use load::load;
pub use save::{SaveHandle, save, save_async};

/// Name of the index file in a checkpoint directory.
pub const INDEX_FILE: &str = "index.json";

/// One tensor's local slice, to save: its name, its layout over the mesh, this rank's mesh
/// coordinate and a copy of the local data (row-major, the box
/// `layout.local_chunk(coord)`). Owning a copy is what lets [`save_async`] return at once.
#[derive(Clone, Debug)]
pub struct LocalTensor {
    pub(crate) name: String,
    pub(crate) layout: ShardLayout,
    pub(crate) coord: Vec<usize>,
    pub(crate) dtype: DType,
    pub(crate) data: Vec<u8>,
}

impl LocalTensor {
    /// Copies `data` (any element type) as the slice of tensor `name` held at `coord`.
    pub fn new<T: Element>(
        name: impl Into<String>,
        layout: ShardLayout,
        coord: &[usize],
        data: &[T],
    ) -> Self {
        LocalTensor {
            name: name.into(),
            layout,
            coord: coord.to_vec(),
            dtype: T::DTYPE,
            data: bytemuck::cast_slice(data).to_vec(),
        }
    }

    /// The tensor's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The same data under another name (e.g. `"fc.weight"` → `"fc.weight.exp_avg"`).
    pub fn renamed(mut self, name: impl Into<String>) -> Self {
        self.name = name.into();
        self
    }
}

/// One tensor's local slice, to load into: like [`LocalTensor`], borrowing the destination.
#[derive(Debug)]
pub struct LocalTensorMut<'a> {
    pub(crate) name: String,
    pub(crate) layout: ShardLayout,
    pub(crate) coord: Vec<usize>,
    pub(crate) dtype: DType,
    pub(crate) data: &'a mut [u8],
}

impl<'a> LocalTensorMut<'a> {
    /// Loads tensor `name`'s box `layout.local_chunk(coord)` into `data`.
    pub fn new<T: Element>(
        name: impl Into<String>,
        layout: ShardLayout,
        coord: &[usize],
        data: &'a mut [T],
    ) -> Self {
        LocalTensorMut {
            name: name.into(),
            layout,
            coord: coord.to_vec(),
            dtype: T::DTYPE,
            data: bytemuck::cast_slice_mut(data),
        }
    }

    /// The tensor's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The same destination under another name.
    pub fn renamed(mut self, name: impl Into<String>) -> Self {
        self.name = name.into();
        self
    }
}

/// The box of `layout` at `coord`, or an error naming the tensor when `coord` is not on the
/// mesh.
pub(crate) fn chunk_of(
    rank: usize,
    op: &'static str,
    name: &str,
    layout: &ShardLayout,
    coord: &[usize],
) -> crate::Result<Chunk> {
    let ok = coord.len() == layout.mesh_shape().len()
        && coord.iter().zip(layout.mesh_shape()).all(|(c, n)| c < n);
    if !ok {
        return Err(crate::Error::Checkpoint {
            rank,
            op,
            tensor: name.to_string(),
            reason: format!(
                "mesh coordinate {coord:?} is not on the mesh {:?}",
                layout.mesh_shape()
            ),
        });
    }
    Ok(layout.local_chunk(coord))
}
