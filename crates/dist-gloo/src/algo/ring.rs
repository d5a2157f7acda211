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
/// `rank` of every rank's `data`. Other blocks hold partial results. Each received frame is
/// combined as it lands, in a window of one frame taken from `scratch`.
pub(crate) fn reduce_scatter(
    o: &Op<'_>,
    data: &mut [u8],
    blocks: &[Range<usize>],
    op: ReduceOp,
    scratch: &mut Vec<u64>,
    first_step: u32,
) -> Result<()> {
    let (n, r) = (o.n(), o.rank());
    if n == 1 {
        return Ok(());
    }
    let (right, left) = ((r + 1) % n, (r + n - 1) % n);
    for s in 0..n - 1 {
        // Block indices shifted by one so that the last block received is this rank's own.
        let send_b = (r + 2 * n - 1 - s) % n;
        let recv_b = (r + 2 * n - 2 - s) % n;
        let (out, acc) = split_pair(data, blocks[send_b].clone(), blocks[recv_b].clone());
        let tag = tags::RING_RS | (first_step.wrapping_add(s as u32) & 0xffff);
        o.step_with(
            &[o.send(right, out, tag)],
            &mut [o.recv_streamed(left, acc.len(), scratch, tag)],
            &mut |_, range, bytes| o.combine(op, &mut acc[range], bytes),
        )?;
    }
    Ok(())
}

/// Given that every rank holds its own block `rank` of `data`, fills in every other block.
pub(crate) fn all_gather(
    o: &Op<'_>,
    data: &mut [u8],
    blocks: &[Range<usize>],
    first_step: u32,
) -> Result<()> {
    let (n, r) = (o.n(), o.rank());
    if n == 1 {
        return Ok(());
    }
    let (right, left) = ((r + 1) % n, (r + n - 1) % n);
    for s in 0..n - 1 {
        let send_b = (r + n - s) % n;
        let recv_b = (r + 2 * n - 1 - s) % n;
        let (out, into) = split_pair(data, blocks[send_b].clone(), blocks[recv_b].clone());
        let tag = tags::RING_AG | (first_step.wrapping_add(s as u32) & 0xffff);
        o.step(&[o.send(right, out, tag)], &mut [o.recv(left, into, tag)])?;
    }
    Ok(())
}

/// Reduce-scatter from an input buffer that must not be modified into `output` (block `rank`):
/// the same ring as [`reduce_scatter`], but partial results live in two alternating carry
/// buffers of one block each, so no copy of the whole input is made. Each step receives the
/// left neighbour's partial result straight into the carry (or `output`) it produces and
/// combines this rank's input block into it there, frame by frame: one pass over the block
/// besides the receive, where receiving into scratch and combining into a copy of the input
/// block took three.
pub(crate) fn reduce_scatter_into(
    o: &Op<'_>,
    input: &[u8],
    output: &mut [u8],
    blocks: &[Range<usize>],
    op: ReduceOp,
    scratch: &mut Vec<u64>,
    first_step: u32,
) -> Result<()> {
    let (n, r) = (o.n(), o.rank());
    if n == 1 {
        dist_simd::copy::bulk(output, &input[blocks[0].clone()]);
        return Ok(());
    }
    let (right, left) = ((r + 1) % n, (r + n - 1) % n);
    let largest = blocks.iter().map(|b| b.len()).max().unwrap_or(0);
    // Two ranks need no carry: their one step produces into `output`.
    let words = if n > 2 { largest.div_ceil(8) } else { 0 };
    if scratch.len() < 2 * words {
        scratch.resize(2 * words, 0);
    }
    let (carry_a, carry_b) = scratch[..2 * words].split_at_mut(words);
    let mut carry: [&mut [u8]; 2] = [
        bytemuck::cast_slice_mut(carry_a),
        bytemuck::cast_slice_mut(carry_b),
    ];
    for s in 0..n - 1 {
        let send_b = (r + 2 * n - 1 - s) % n;
        let recv_b = (r + 2 * n - 2 - s) % n;
        let (slen, rlen) = (blocks[send_b].len(), blocks[recv_b].len());
        let [ca, cb] = &mut carry;
        // Step s sends what step s-1 produced (or the raw input at step 0) and produces into the
        // other carry, or into `output` at the last step.
        let (prev, next): (&[u8], &mut [u8]) = if s % 2 == 0 {
            (&ca[..], &mut cb[..])
        } else {
            (&cb[..], &mut ca[..])
        };
        let out: &[u8] = if s == 0 {
            &input[blocks[send_b].clone()]
        } else {
            &prev[..slen]
        };
        let dst: &mut [u8] = if s == n - 2 {
            &mut *output
        } else {
            &mut next[..rlen]
        };
        let mine = &input[blocks[recv_b].clone()];
        let tag = tags::RING_RS | (first_step.wrapping_add(s as u32) & 0xffff);
        // Combining this rank's block into the received partial, rather than the other way
        // round, gives the same value: every combiner is commutative (min and max may pick
        // the other of two equal zeros or two NaNs), and one rank alone computes each block.
        o.step_with(
            &[o.send(right, out, tag)],
            &mut [o.recv(left, &mut dst[..rlen], tag)],
            &mut |_, range, bytes| o.combine(op, bytes, &mine[range]),
        )?;
    }
    Ok(())
}
