//! [`DTensor`]: a local buffer plus the [`ShardLayout`] that says which part of which global
//! tensor it is, over a [`DeviceMesh`] (torch's `DTensor`).
//!
//! The layout is the same [`ShardLayout`] FSDP and the checkpoint use, so a DTensor's local
//! buffer is exactly the box [`ShardLayout::local_chunk`] names for this rank's mesh
//! coordinate: uneven splits follow `torch.chunk`, and no local buffer is ever padded (only
//! the buffers handed to a collective are, where the collective needs equal blocks).

mod boxes;
mod redistribute;

use dist_wire::{Element, ReduceOp};

use crate::mesh::DeviceMesh;
use crate::placement::{Placement, ShardLayout};
use crate::{Error, Result};

/// A tensor distributed over a [`DeviceMesh`]: this rank's local piece (row-major), the
/// global shape, and one [`Placement`] per mesh dimension.
///
/// ```
/// use dist_collective::{DTensor, DeviceMesh, Placement, testing::run_world};
/// let out = run_world(2, |pg| {
///     let mesh = DeviceMesh::new(&pg, &[("tp", 2)])?;
///     // A [3, 2] tensor, rows split 2 + 1 (torch.chunk sizes).
///     let full: Vec<f32> = (0..6).map(|x| x as f32).collect();
///     let t = DTensor::distribute_tensor(&full, &[3, 2], &mesh, &[Placement::Shard(0)])?;
///     let local = t.to_local().to_vec();
///     // Columns instead of rows: one all_to_all.
///     let t = t.redistribute(&[Placement::Shard(1)])?;
///     Ok((local, t.to_local().to_vec(), t.full_tensor()?))
/// })?;
/// assert_eq!(out[1].0, [4.0, 5.0]);
/// assert_eq!(out[1].1, [1.0, 3.0, 5.0]);
/// assert_eq!(out[0].2, (0..6).map(|x| x as f32).collect::<Vec<_>>());
/// # Ok::<(), dist_collective::Error>(())
/// ```
#[derive(Clone, Debug)]
pub struct DTensor<T: Element> {
    local: Vec<T>,
    layout: ShardLayout,
    mesh: DeviceMesh,
}

impl<T: Element> DTensor<T> {
    /// Wraps this rank's `local` piece of a tensor of `global_shape` placed by `placements`
    /// on `mesh` (torch's `DTensor.from_local`, with the global shape given so that uneven
    /// shards are unambiguous). Nothing is communicated; `local` must hold exactly the box
    /// this rank's coordinate owns.
    pub fn from_local(
        local: Vec<T>,
        global_shape: &[usize],
        mesh: &DeviceMesh,
        placements: &[Placement],
    ) -> Result<Self> {
        const OP: &str = "DTensor::from_local";
        let layout = layout_for(mesh, OP, global_shape, placements)?;
        let want = layout.local_chunk(mesh.coordinate()).numel();
        if local.len() != want {
            return Err(Error::size(
                mesh.group().rank(),
                OP,
                "local tensor",
                want,
                local.len(),
            ));
        }
        Ok(DTensor {
            local,
            layout,
            mesh: mesh.clone(),
        })
    }

    /// Places `full` (the whole tensor of `global_shape`, the same on every rank) by
    /// `placements` without communication: each rank keeps its box; a `Partial` dimension
    /// keeps the value on coordinate 0 and zeros elsewhere for sums (as torch does), and the
    /// value everywhere for idempotent reductions (avg, min, max, and, or).
    pub fn distribute_tensor(
        full: &[T],
        global_shape: &[usize],
        mesh: &DeviceMesh,
        placements: &[Placement],
    ) -> Result<Self> {
        const OP: &str = "DTensor::distribute_tensor";
        let replicated = vec![Placement::Replicate; mesh.ndim()];
        let layout = layout_for(mesh, OP, global_shape, &replicated)?;
        if full.len() != layout.global_numel() {
            return Err(Error::size(
                mesh.group().rank(),
                OP,
                "full tensor",
                layout.global_numel(),
                full.len(),
            ));
        }
        DTensor {
            local: full.to_vec(),
            layout,
            mesh: mesh.clone(),
        }
        .redistribute_as(placements, OP)
    }

    /// [`distribute_tensor`](DTensor::distribute_tensor) from one rank: `src` (a rank of the
    /// mesh's group) passes `Some(full)`, the others `None`; the tensor is broadcast over the
    /// mesh's group and each rank keeps its box (torch's `src_data_rank`).
    pub fn distribute_from(
        full: Option<&[T]>,
        src: usize,
        global_shape: &[usize],
        mesh: &DeviceMesh,
        placements: &[Placement],
    ) -> Result<Self> {
        const OP: &str = "DTensor::distribute_from";
        let pg = mesh.group();
        let numel: usize = global_shape.iter().product();
        let wrong_side = |f: Option<&[T]>, is_src: bool| {
            Error::invalid(
                pg.rank(),
                OP,
                format!(
                    "rank {src} is the source: it passes Some(full) and the others None \
                     (this rank {} and passed {})",
                    if is_src { "is the source" } else { "is not" },
                    if f.is_some() { "Some" } else { "None" }
                ),
            )
        };
        // Check the placements before the broadcast, so a bad call fails on every rank alike.
        layout_for(mesh, OP, global_shape, placements)?;
        // Each rank's own mistake only it can see (the source's tensor of the wrong size or
        // none; another rank's tensor where it must pass none): every rank says whether it
        // made one, before the data, so that all fail together rather than some waiting out
        // their timeout in a broadcast a failed rank never joins.
        let mine: Result<Option<Vec<T>>> = match (pg.rank() == src, full) {
            (true, Some(f)) if f.len() == numel => Ok(Some(f.to_vec())),
            (true, Some(f)) => Err(Error::size(pg.rank(), OP, "full tensor", numel, f.len())),
            (true, None) => Err(wrong_side(None, true)),
            (false, None) => Ok(None),
            (false, Some(f)) => Err(wrong_side(Some(f), false)),
        };
        let from_src = usize::from(pg.rank() == src);
        let mut failed = [0u8; 2];
        if mine.is_err() {
            failed[from_src] = 1;
        }
        pg.all_reduce(&mut failed, ReduceOp::Max)?;
        let mut buf = match mine? {
            _ if failed[1] != 0 => {
                return Err(Error::invalid(
                    pg.rank(),
                    OP,
                    format!(
                        "the source, rank {src}, has no tensor to send (its own error says why)"
                    ),
                ));
            }
            _ if failed[0] != 0 => {
                return Err(Error::invalid(
                    pg.rank(),
                    OP,
                    format!(
                        "a rank other than the source, rank {src}, passed a tensor (its own \
                         error says which)"
                    ),
                ));
            }
            Some(buf) => buf,
            None => vec![T::zeroed(); numel],
        };
        pg.broadcast(&mut buf, src)?;
        Self::distribute_tensor(&buf, global_shape, mesh, placements)
    }

    /// This rank's piece (torch's `to_local`), row-major in [`local_shape`](Self::local_shape).
    pub fn to_local(&self) -> &[T] {
        &self.local
    }

    /// This rank's piece, mutable (its shape cannot change).
    pub fn local_mut(&mut self) -> &mut [T] {
        &mut self.local
    }

    /// This rank's piece, by value.
    pub fn into_local(self) -> Vec<T> {
        self.local
    }

    /// The shape of this rank's piece.
    pub fn local_shape(&self) -> Vec<usize> {
        self.layout.local_chunk(self.mesh.coordinate()).shape
    }

    /// The global tensor's shape.
    pub fn shape(&self) -> &[usize] {
        self.layout.global_shape()
    }

    /// One placement per mesh dimension.
    pub fn placements(&self) -> &[Placement] {
        self.layout.placements()
    }

    /// The layout (global shape, mesh shape, placements).
    pub fn layout(&self) -> &ShardLayout {
        &self.layout
    }

    /// The mesh.
    pub fn mesh(&self) -> &DeviceMesh {
        &self.mesh
    }

    /// The whole tensor on every rank (torch's `full_tensor`): a redistribution to all
    /// `Replicate`.
    pub fn full_tensor(&self) -> Result<Vec<T>> {
        let all = vec![Placement::Replicate; self.mesh.ndim()];
        Ok(self
            .redistribute_as(&all, "DTensor::full_tensor")?
            .into_local())
    }

    /// The same global tensor with `placements` (one per mesh dimension), each mesh
    /// dimension's change done by the cheapest collective over that dimension's group:
    /// `Shard→Replicate` all_gather, `Partial→Replicate` all_reduce, `Partial→Shard`
    /// reduce_scatter, `Shard(i)→Shard(j)` all_to_all, `Replicate→Shard` a local slice,
    /// `Replicate→Partial` a local zeroing. Every rank of the mesh calls it with the same
    /// placements.
    pub fn redistribute(&self, placements: &[Placement]) -> Result<DTensor<T>> {
        self.redistribute_as(placements, "DTensor::redistribute")
    }
}

/// The layout of `global_shape` by `placements` on `mesh`, or an error naming the rank and
/// operation.
fn layout_for(
    mesh: &DeviceMesh,
    op: &'static str,
    global_shape: &[usize],
    placements: &[Placement],
) -> Result<ShardLayout> {
    ShardLayout::new(global_shape, mesh.shape(), placements).map_err(|e| match e {
        Error::InvalidLayout { reason } => Error::invalid(mesh.group().rank(), op, reason),
        other => other,
    })
}

/// How a replicated value becomes `Partial(op)` over `n` ranks: `Some(true)` keeps it on
/// every rank, `Some(false)` keeps it on coordinate 0 and zeros the rest, `None` cannot be
/// done without element arithmetic (product needs ones, premul-sum a division).
fn partition_keeps_all(op: ReduceOp) -> Option<bool> {
    match op {
        ReduceOp::Avg | ReduceOp::Min | ReduceOp::Max | ReduceOp::BitAnd | ReduceOp::BitOr => {
            Some(true)
        }
        ReduceOp::Sum | ReduceOp::BitXor => Some(false),
        _ => None,
    }
}
