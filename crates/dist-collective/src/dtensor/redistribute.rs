//! The redistribution plan: which collective changes which mesh dimension, in which order.
//!
//! A mesh dimension `i` whose placement changes is handled on its own sub-group. Two phases
//! keep nested shards (several mesh dimensions sharding the same tensor dimension, each
//! splitting the piece the earlier ones left) correct:
//!
//! 1. From the last mesh dimension to the first, every dimension that must change leaves its
//!    `Shard`/`Partial` state: all_gather or all_reduce to `Replicate`, or straight to its
//!    target by reduce_scatter (`Partial→Shard`) or all_to_all (`Shard(a)→Shard(b)`) when no
//!    other mesh dimension touches those tensor dimensions. Inner dimensions go first because
//!    an inner shard is a piece of the outer one: gathering the outer first would interleave.
//! 2. From the first mesh dimension to the last, what is `Replicate` now and must not be takes
//!    its target locally: a slice for `Shard`, a zeroing for `Partial`.
//!
//! A dimension whose placement stays `Shard(d)` must still be redone when an earlier mesh
//! dimension changes how it splits `d`, since its piece is cut from that dimension's piece.

use std::borrow::Cow;

use dist_wire::Element;

use super::boxes::{join_along, take_along, with_dim};
use super::{DTensor, partition_keeps_all};
use crate::group::ProcessGroup;
use crate::placement::{Placement, chunk_range};
use crate::{Error, Result};

impl<T: Element> DTensor<T> {
    pub(super) fn redistribute_as(
        &self,
        target: &[Placement],
        op: &'static str,
    ) -> Result<DTensor<T>> {
        let rank = self.mesh.group().rank();
        let target_layout = super::layout_for(&self.mesh, op, self.shape(), target)?;
        for p in target {
            if let Placement::Partial(rop) = *p {
                rop.check(T::DTYPE)
                    .map_err(|source| crate::group::wire_error(rank, op, source))?;
            }
        }
        let src = self.placements().to_vec();
        let n = src.len();
        // Refuse a partition that cannot be done before anything is sent.
        for (i, &want) in target.iter().enumerate() {
            if let Placement::Partial(rop) = want
                && src[i] != want
                && partition_keeps_all(rop).is_none()
            {
                return Err(Error::invalid(
                    rank,
                    op,
                    format!(
                        "{} to {want} on mesh dimension {i} needs element arithmetic (a \
                         replicated value split into partial values); reduce with another op \
                         or keep it replicated",
                        src[i]
                    ),
                ));
            }
        }
        // Which mesh dims must be (re)done: changed, or a shard cut from a changing piece.
        let touches = |p: Placement, d: usize| p == Placement::Shard(d);
        let changed = |k: usize| src[k] != target[k];
        let redo: Vec<bool> = (0..n)
            .map(|i| {
                let dims: Vec<usize> = [src[i], target[i]]
                    .iter()
                    .filter_map(Placement::shard_dim)
                    .collect();
                changed(i)
                    || dims.iter().any(|&d| {
                        (0..i).any(|k| changed(k) && (touches(src[k], d) || touches(target[k], d)))
                    })
            })
            .collect();
        let unstable = |i: usize| {
            [src[i], target[i]]
                .iter()
                .filter_map(Placement::shard_dim)
                .any(|d| {
                    (0..i).any(|k| changed(k) && (touches(src[k], d) || touches(target[k], d)))
                })
        };
        // Another mesh dim that has, or will have, a shard of tensor dim `d`.
        let others_shard = |i: usize, d: usize| {
            (0..n).any(|k| k != i && (touches(src[k], d) || touches(target[k], d)))
        };

        // Borrowed until a step produces new data: no copy of the input unless needed.
        let mut cur: Cow<'_, DTensor<T>> = Cow::Borrowed(self);
        for i in (0..n).rev() {
            if !redo[i] {
                continue;
            }
            let g = self.mesh.dim_group(i);
            let next = match (src[i], target[i]) {
                (Placement::Shard(a), Placement::Shard(b))
                    if a != b && !unstable(i) && !others_shard(i, a) && !others_shard(i, b) =>
                {
                    cur.all_to_all_dim(g, i, a, b)?
                }
                (Placement::Shard(d), _) => cur.all_gather_dim(g, i, d)?,
                (Placement::Partial(rop), Placement::Shard(d))
                    if !unstable(i) && !others_shard(i, d) =>
                {
                    cur.reduce_scatter_dim(g, i, d, rop)?
                }
                (Placement::Partial(rop), _) => {
                    let mut t = cur.into_owned();
                    g.all_reduce(&mut t.local, rop)?;
                    t.relayout(i, Placement::Replicate)?
                }
                (Placement::Replicate, _) => continue,
            };
            cur = Cow::Owned(next);
        }
        for (i, &want) in target.iter().enumerate() {
            if cur.placements()[i] == want {
                continue;
            }
            debug_assert_eq!(cur.placements()[i], Placement::Replicate);
            let next = match want {
                Placement::Shard(d) => cur.slice_dim(i, d)?,
                Placement::Partial(rop) => {
                    let mut t = cur.into_owned();
                    if partition_keeps_all(rop) == Some(false) && self.mesh.coordinate()[i] != 0 {
                        t.local.fill(T::zeroed());
                    }
                    t.relayout(i, want)?
                }
                Placement::Replicate => unreachable!("phase 1 leaves only Replicate to change"),
            };
            cur = Cow::Owned(next);
        }
        let cur = cur.into_owned();
        debug_assert_eq!(cur.layout, target_layout);
        Ok(cur)
    }

    /// A new local buffer with placement `p` on mesh dim `i`.
    fn with_local(&self, local: Vec<T>, i: usize, p: Placement) -> Result<Self> {
        Ok(DTensor {
            local,
            layout: self.layout.with_placement(i, p)?,
            mesh: self.mesh.clone(),
        })
    }

    /// The same local buffer with placement `p` on mesh dim `i` (the caller moved the data).
    fn relayout(mut self, i: usize, p: Placement) -> Result<Self> {
        self.layout = self.layout.with_placement(i, p)?;
        Ok(self)
    }

    /// Length of tensor dim `d` in the piece mesh dims before `i` leave (what dim `i` splits).
    fn parent_len(&self, i: usize, d: usize) -> usize {
        let mut len = self.shape()[d];
        let outer = self.placements()[..i].iter().zip(self.layout.mesh_shape());
        for ((p, &parts), &c) in outer.zip(self.mesh.coordinate()) {
            if *p == Placement::Shard(d) {
                len = chunk_range(len, parts, c).len();
            }
        }
        len
    }

    /// `Shard(d)` on mesh dim `i` to `Replicate`: an uneven all_gather, then each rank's block
    /// placed at its offset along `d`.
    fn all_gather_dim(&self, g: &ProcessGroup, i: usize, d: usize) -> Result<Self> {
        let parts = self.layout.mesh_shape()[i];
        let shape = self.local_shape();
        let full_d = self.parent_len(i, d);
        let lens: Vec<usize> = (0..parts)
            .map(|r| chunk_range(full_d, parts, r).len())
            .collect();
        let counts: Vec<usize> = lens
            .iter()
            .map(|&l| with_dim(&shape, d, l).iter().product())
            .collect();
        let mut gathered = vec![T::zeroed(); counts.iter().sum()];
        g.all_gather_into_uneven(&self.local, &mut gathered, &counts)?;
        self.with_local(
            join_along(gathered, &shape, d, &lens),
            i,
            Placement::Replicate,
        )
    }

    /// `Partial(op)` on mesh dim `i` to `Shard(d)`: blocks packed per destination rank, one
    /// uneven reduce_scatter.
    fn reduce_scatter_dim(
        &self,
        g: &ProcessGroup,
        i: usize,
        d: usize,
        rop: dist_wire::ReduceOp,
    ) -> Result<Self> {
        let parts = self.layout.mesh_shape()[i];
        let shape = self.local_shape();
        let (packed, counts) = pack_along(&self.local, &shape, d, parts);
        let me = self.mesh.coordinate()[i];
        let mut out = vec![T::zeroed(); counts[me]];
        g.reduce_scatter_into_uneven(&packed, &mut out, &counts, rop)?;
        self.with_local(out, i, Placement::Shard(d))
    }

    /// `Shard(a)` on mesh dim `i` to `Shard(b)`: each rank sends rank r the r-th chunk of its
    /// piece along `b` and places what it receives along `a`.
    fn all_to_all_dim(&self, g: &ProcessGroup, i: usize, a: usize, b: usize) -> Result<Self> {
        let parts = self.layout.mesh_shape()[i];
        let me = self.mesh.coordinate()[i];
        let shape = self.local_shape();
        let (send, send_counts) = pack_along(&self.local, &shape, b, parts);
        let full_a = self.parent_len(i, a);
        let mine_b = chunk_range(shape[b], parts, me).len();
        let recv_shape = with_dim(&shape, b, mine_b);
        let lens: Vec<usize> = (0..parts)
            .map(|r| chunk_range(full_a, parts, r).len())
            .collect();
        let recv_counts: Vec<usize> = lens
            .iter()
            .map(|&l| with_dim(&recv_shape, a, l).iter().product())
            .collect();
        let mut recv = vec![T::zeroed(); recv_counts.iter().sum()];
        g.all_to_all_single(&mut recv, &send, Some(&recv_counts), Some(&send_counts))?;
        let out = join_along(recv, &recv_shape, a, &lens);
        self.with_local(out, i, Placement::Shard(b))
    }

    /// `Replicate` on mesh dim `i` to `Shard(d)`: keep this coordinate's chunk.
    fn slice_dim(&self, i: usize, d: usize) -> Result<Self> {
        let shape = self.local_shape();
        let r = chunk_range(
            shape[d],
            self.layout.mesh_shape()[i],
            self.mesh.coordinate()[i],
        );
        self.with_local(
            take_along(&self.local, &shape, d, &[r]),
            i,
            Placement::Shard(d),
        )
    }
}

/// `local` (of `shape`) cut along `d` into `parts` torch.chunk blocks, each made contiguous,
/// in rank order; with each block's element count. Borrowed when the blocks already are
/// contiguous (nothing precedes `d`).
fn pack_along<'a, T: Element>(
    local: &'a [T],
    shape: &[usize],
    d: usize,
    parts: usize,
) -> (Cow<'a, [T]>, Vec<usize>) {
    let ranges: Vec<_> = (0..parts)
        .map(|r| chunk_range(shape[d], parts, r))
        .collect();
    let counts = ranges
        .iter()
        .map(|r| with_dim(shape, d, r.len()).iter().product())
        .collect();
    let packed = if shape[..d].iter().product::<usize>() == 1 {
        Cow::Borrowed(local)
    } else {
        Cow::Owned(take_along(local, shape, d, &ranges))
    };
    (packed, counts)
}
