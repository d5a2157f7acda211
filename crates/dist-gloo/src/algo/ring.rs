//! Ring reduce-scatter and all-gather over arbitrary block sizes: the bandwidth-optimal pair
//! that all_reduce, reduce_scatter, all_gather and large reduce are built from.
//!
//! Every step sends one block to the right neighbour and receives one from the left; the
//! transport cuts blocks into segments and the reduction of each received segment runs while
//! the next ones are still on the wire. A block ends up reduced on exactly one rank and is then
//! copied to the others, so every rank holds bitwise identical results.

use std::ops::Range;

use dist_backend::Result;
use dist_wire::ReduceOp;

use super::{Op, split_pair, tags};

/// After it returns, block `rank` of `data` holds the reduction (by `op`'s combiner) of block
/// `rank` of every rank's `data`. Other blocks hold partial results. `scratch` is grown to the
/// largest block.
pub(crate) fn reduce_scatter(
    o: &Op<'_>,
    data: &mut [u8],
    blocks: &[Range<usize>],
    op: ReduceOp,
    scratch: &mut Vec<u64>,
) -> Result<()> {
    let (n, r) = (o.n(), o.rank());
    if n == 1 {
        return Ok(());
    }
    let (right, left) = ((r + 1) % n, (r + n - 1) % n);
    let largest = blocks.iter().map(|b| b.len()).max().unwrap_or(0);
    if scratch.len() * 8 < largest {
        scratch.resize(largest.div_ceil(8), 0);
    }
    for s in 0..n - 1 {
        // Block indices shifted by one so that the last block received is this rank's own.
        let send_b = (r + 2 * n - 1 - s) % n;
        let recv_b = (r + 2 * n - 2 - s) % n;
        let (out, acc) = split_pair(data, blocks[send_b].clone(), blocks[recv_b].clone());
        let tmp = &mut bytemuck::cast_slice_mut::<u64, u8>(scratch)[..acc.len()];
        let tag = tags::RING_RS | s as u32;
        o.step_with(
            &[o.send(right, out, tag)],
            &mut [o.recv(left, tmp, tag)],
            &mut |_, range, bytes| o.combine(op, &mut acc[range], bytes),
        )?;
    }
    Ok(())
}

/// Given that every rank holds its own block `rank` of `data`, fills in every other block.
pub(crate) fn all_gather(o: &Op<'_>, data: &mut [u8], blocks: &[Range<usize>]) -> Result<()> {
    let (n, r) = (o.n(), o.rank());
    if n == 1 {
        return Ok(());
    }
    let (right, left) = ((r + 1) % n, (r + n - 1) % n);
    for s in 0..n - 1 {
        let send_b = (r + n - s) % n;
        let recv_b = (r + 2 * n - 1 - s) % n;
        let (out, into) = split_pair(data, blocks[send_b].clone(), blocks[recv_b].clone());
        let tag = tags::RING_AG | s as u32;
        o.step(&[o.send(right, out, tag)], &mut [o.recv(left, into, tag)])?;
    }
    Ok(())
}
