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

use dist_wire::Element;

use super::boxes::{copy_box, offset_along, slice_box, with_dim};
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
                    .map_err(|e| Error::invalid(rank, op, format!("{p}: {e}")))?;
            }
        }
        let src = self.placements().to_vec();
        let n = src.len();
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

        let mut cur = self.clone();
        for i in (0..n).rev() {
            if !redo[i] {
                continue;
            }
            let g = self.mesh.dim_group(i);
            cur = match (src[i], target[i]) {
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
                    g.all_reduce(&mut cur.local, rop)?;
                    cur.relayout(i, Placement::Replicate)?
                }
                (Placement::Replicate, _) => cur,
            };
        }
        for (i, &want) in target.iter().enumerate() {
            if cur.placements()[i] == want {
                continue;
            }
            debug_assert_eq!(cur.placements()[i], Placement::Replicate);
            cur = match want {
                Placement::Shard(d) => cur.slice_dim(i, d)?,
                Placement::Partial(rop) => {
                    let keep_all = partition_keeps_all(rop).ok_or_else(|| {
                        Error::invalid(
                            rank,
                            op,
                            format!(
                                "Replicate() to {want} on mesh dimension {i} needs element \
                                 arithmetic; reduce with another op or keep it replicated"
                            ),
                        )
                    })?;
                    if !keep_all && self.mesh.coordinate()[i] != 0 {
                        cur.local.fill(T::zeroed());
                    }
                    cur.relayout(i, want)?
                }
                Placement::Replicate => unreachable!("phase 1 leaves only Replicate to change"),
            };
        }
        debug_assert_eq!(cur.layout, target_layout);
        Ok(cur)
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
    fn all_gather_dim(mut self, g: &ProcessGroup, i: usize, d: usize) -> Result<Self> {
        let parts = self.layout.mesh_shape()[i];
        let shape = self.local_shape();
        let full_d = self.parent_len(i, d);
        let block = |r: usize| with_dim(&shape, d, chunk_range(full_d, parts, r).len());
        let counts: Vec<usize> = (0..parts).map(|r| block(r).iter().product()).collect();
        let mut gathered = vec![T::zeroed(); counts.iter().sum()];
        g.all_gather_into_uneven(&self.local, &mut gathered, &counts)?;
        let out_shape = with_dim(&shape, d, full_d);
        // Blocks along the outermost non-trivial dim are already in place.
        self.local = if shape[..d].iter().all(|&s| s == 1) {
            gathered
        } else {
            let mut out = vec![T::zeroed(); gathered.len()];
            let mut at = 0;
            for (r, &c) in counts.iter().enumerate() {
                let b = block(r);
                let off = offset_along(shape.len(), d, chunk_range(full_d, parts, r).start);
                let zero = vec![0; b.len()];
                copy_box(
                    &gathered[at..at + c],
                    &b,
                    &zero,
                    &mut out,
                    &out_shape,
                    &off,
                    &b,
                );
                at += c;
            }
            out
        };
        self.relayout(i, Placement::Replicate)
    }

    /// `Partial(op)` on mesh dim `i` to `Shard(d)`: blocks packed per destination rank, one
    /// uneven reduce_scatter.
    fn reduce_scatter_dim(
        mut self,
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
        self.local = out;
        self.relayout(i, Placement::Shard(d))
    }

    /// `Shard(a)` on mesh dim `i` to `Shard(b)`: each rank sends rank r the r-th chunk of its
    /// piece along `b` and places what it receives along `a`.
    fn all_to_all_dim(mut self, g: &ProcessGroup, i: usize, a: usize, b: usize) -> Result<Self> {
        let parts = self.layout.mesh_shape()[i];
        let me = self.mesh.coordinate()[i];
        let shape = self.local_shape();
        let (send, send_counts) = pack_along(&self.local, &shape, b, parts);
        let full_a = self.parent_len(i, a);
        let mine_b = chunk_range(shape[b], parts, me).len();
        let recv_block = |r: usize| {
            with_dim(
                &with_dim(&shape, b, mine_b),
                a,
                chunk_range(full_a, parts, r).len(),
            )
        };
        let recv_counts: Vec<usize> = (0..parts).map(|r| recv_block(r).iter().product()).collect();
        let mut recv = vec![T::zeroed(); recv_counts.iter().sum()];
        g.all_to_all_single(&mut recv, &send, Some(&recv_counts), Some(&send_counts))?;
        let out_shape = with_dim(&with_dim(&shape, b, mine_b), a, full_a);
        let mut out = vec![T::zeroed(); recv.len()];
        let mut at = 0;
        for (r, &c) in recv_counts.iter().enumerate() {
            let blk = recv_block(r);
            let off = offset_along(shape.len(), a, chunk_range(full_a, parts, r).start);
            let zero = vec![0; blk.len()];
            copy_box(
                &recv[at..at + c],
                &blk,
                &zero,
                &mut out,
                &out_shape,
                &off,
                &blk,
            );
            at += c;
        }
        self.local = out;
        self.relayout(i, Placement::Shard(b))
    }

    /// `Replicate` on mesh dim `i` to `Shard(d)`: keep this coordinate's chunk.
    fn slice_dim(mut self, i: usize, d: usize) -> Result<Self> {
        let shape = self.local_shape();
        let r = chunk_range(
            shape[d],
            self.layout.mesh_shape()[i],
            self.mesh.coordinate()[i],
        );
        let off = offset_along(shape.len(), d, r.start);
        self.local = slice_box(&self.local, &shape, &off, &with_dim(&shape, d, r.len()));
        self.relayout(i, Placement::Shard(d))
    }
}

/// `local` (of `shape`) cut along `d` into `parts` torch.chunk blocks, each made contiguous,
/// in rank order; with each block's element count.
fn pack_along<T: Element>(
    local: &[T],
    shape: &[usize],
    d: usize,
    parts: usize,
) -> (Vec<T>, Vec<usize>) {
    let mut packed = vec![T::zeroed(); local.len()];
    let mut counts = Vec::with_capacity(parts);
    let mut at = 0;
    for r in 0..parts {
        let range = chunk_range(shape[d], parts, r);
        let blk = with_dim(shape, d, range.len());
        let c: usize = blk.iter().product();
        let zero = vec![0; blk.len()];
        let off = offset_along(shape.len(), d, range.start);
        copy_box(
            local,
            shape,
            &off,
            &mut packed[at..at + c],
            &blk,
            &zero,
            &blk,
        );
        counts.push(c);
        at += c;
    }
    (packed, counts)
}
