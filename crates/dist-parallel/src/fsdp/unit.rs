//! Where each parameter of a unit lives in the unit's communication buffers.
//!
//! Every rank's segment is the concatenation of its `Shard(0)` piece of each parameter, each
//! padded to the largest piece (`torch.chunk` sizes), so that the all-gather and the
//! reduce-scatter move equal counts; the gathered buffer is the ranks' segments one after
//! another. The user sees a different, unpadded buffer: the parameters whole, one after another.
//! Padding therefore lives only inside the communication buffers.

use std::ops::Range;

use dist_collective::{Chunk, ShardLayout, chunk_range, padded_chunk_len};

use crate::ParamInfo;

/// The layout of one unit on one rank.
#[derive(Clone, Debug)]
pub(crate) struct UnitLayout {
    pub(crate) params: Vec<ParamInfo>,
    pub(crate) layouts: Vec<ShardLayout>,
    /// Elements per dim-0 row of each parameter.
    row: Vec<usize>,
    /// Dim-0 length of each parameter.
    rows: Vec<usize>,
    /// Offset of each parameter's padded piece in a rank's segment.
    seg_off: Vec<usize>,
    /// Elements in one rank's segment.
    pub(crate) seg_len: usize,
    /// Offset of each parameter in the unpadded full buffer.
    full_off: Vec<usize>,
    /// Elements in the unpadded full buffer.
    pub(crate) full_len: usize,
    /// Ranks in the shard group, and this rank's index among them.
    world: usize,
    shard_rank: usize,
}

impl UnitLayout {
    /// `layouts[i]` is parameter i's layout; its last mesh dimension is the shard dimension
    /// (`Shard(0)`), any before it replicate.
    pub(crate) fn new(
        params: Vec<ParamInfo>,
        layouts: Vec<ShardLayout>,
        world: usize,
        shard_rank: usize,
    ) -> Self {
        let (mut row, mut rows, mut seg_off, mut full_off) = (vec![], vec![], vec![], vec![]);
        let (mut seg_len, mut full_len) = (0, 0);
        for p in &params {
            let r = p.shape[0];
            let per_row: usize = p.shape[1..].iter().product();
            seg_off.push(seg_len);
            full_off.push(full_len);
            seg_len += padded_chunk_len(r, world) * per_row;
            full_len += r * per_row;
            row.push(per_row);
            rows.push(r);
        }
        UnitLayout {
            params,
            layouts,
            row,
            rows,
            seg_off,
            seg_len,
            full_off,
            full_len,
            world,
            shard_rank,
        }
    }

    /// Parameter `i`'s elements in the unpadded full buffer.
    pub(crate) fn full_range(&self, i: usize) -> Range<usize> {
        self.full_off[i]..self.full_off[i] + self.params[i].numel()
    }

    /// Parameter `i`'s rows held by shard rank `r`.
    fn rows_of(&self, i: usize, r: usize) -> Range<usize> {
        chunk_range(self.rows[i], self.world, r)
    }

    /// Parameter `i`'s local (unpadded) elements in this rank's segment.
    pub(crate) fn local_range(&self, i: usize) -> Range<usize> {
        let n = self.rows_of(i, self.shard_rank).len() * self.row[i];
        self.seg_off[i]..self.seg_off[i] + n
    }

    /// The box of parameter `i` this rank holds, at mesh coordinate `coord`.
    pub(crate) fn local_chunk(&self, i: usize, coord: &[usize]) -> Chunk {
        self.layouts[i].local_chunk(coord)
    }

    /// Shard rank `r`'s segment cut out of a full (unpadded) unit buffer; padding is zero.
    pub(crate) fn segment_of<T: bytemuck::Pod + Default>(
        &self,
        full: &[T],
        r: usize,
        seg: &mut [T],
    ) {
        seg.fill(T::default());
        for i in 0..self.params.len() {
            let rows = self.rows_of(i, r);
            let n = rows.len() * self.row[i];
            let src = self.full_off[i] + rows.start * self.row[i];
            dist_wire::copy::bulk_of(
                &mut seg[self.seg_off[i]..self.seg_off[i] + n],
                &full[src..src + n],
            );
        }
    }

    /// Every rank's segment of `full`, one after another: a reduce-scatter's input.
    pub(crate) fn pack<T: bytemuck::Pod + Default>(&self, full: &[T]) -> Vec<T> {
        let mut out = vec![T::default(); self.seg_len * self.world];
        for (r, seg) in out.chunks_mut(self.seg_len.max(1)).enumerate() {
            if r < self.world {
                self.segment_of(full, r, seg);
            }
        }
        out
    }

    /// The inverse of [`pack`](Self::pack): the unpadded full buffer of an all-gather's output.
    pub(crate) fn unpack<T: bytemuck::Pod + Default>(&self, gathered: &[T]) -> Vec<T> {
        let mut full = vec![T::default(); self.full_len];
        for r in 0..self.world {
            let seg = &gathered[r * self.seg_len..(r + 1) * self.seg_len];
            for i in 0..self.params.len() {
                let rows = self.rows_of(i, r);
                let n = rows.len() * self.row[i];
                let dst = self.full_off[i] + rows.start * self.row[i];
                dist_wire::copy::bulk_of(
                    &mut full[dst..dst + n],
                    &seg[self.seg_off[i]..self.seg_off[i] + n],
                );
            }
        }
        full
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn unit(world: usize, rank: usize) -> UnitLayout {
        let params = vec![
            ParamInfo::new("w", &[5, 3]),
            ParamInfo::new("b", &[2]),
            ParamInfo::new("z", &[0, 4]),
        ];
        let layouts = params
            .iter()
            .map(|p| ShardLayout::shard_dim0(&p.shape, world).unwrap())
            .collect();
        UnitLayout::new(params, layouts, world, rank)
    }

    #[test]
    fn pack_and_unpack_are_inverse_with_padding_only_inside() {
        for world in 1..6 {
            let u = unit(world, 0);
            let full: Vec<f32> = (0..u.full_len).map(|x| x as f32 + 1.0).collect();
            let packed = u.pack(&full);
            assert_eq!(packed.len(), u.seg_len * world);
            // Every non-padding element appears exactly once.
            let nonzero = packed.iter().filter(|&&x| x != 0.0).count();
            assert_eq!(nonzero, full.len(), "world {world}");
            assert_eq!(u.unpack(&packed), full, "world {world}");
        }
    }

    #[test]
    fn local_ranges_match_the_layouts_chunks() {
        for world in 1..6 {
            for rank in 0..world {
                let u = unit(world, rank);
                for i in 0..3 {
                    let c = u.local_chunk(i, &[rank]);
                    assert_eq!(
                        u.local_range(i).len(),
                        c.numel(),
                        "world {world} rank {rank}"
                    );
                }
            }
        }
    }
}
