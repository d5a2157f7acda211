//! all_reduce: recursive doubling for small buffers (latency-bound), the ring for large ones
//! (bandwidth-bound).

use dist_backend::Result;
use dist_wire::ReduceOp;

use super::{Op, even_blocks, ring, tags};

/// Reduces `data` in place across all ranks with recursive doubling: ⌈log2 n⌉ exchanges of the
/// whole buffer. A non-power-of-two rank count first folds the extra ranks into the lowest ones
/// and sends them the result at the end. Every rank combines the same partial results in the
/// same tree, so all end with identical bits.
pub(crate) fn recursive_doubling(
    o: &Op<'_>,
    data: &mut [u8],
    op: ReduceOp,
    scratch: &mut Vec<u64>,
) -> Result<()> {
    let (n, r) = (o.n(), o.rank());
    if n == 1 {
        return Ok(());
    }
    if scratch.len() * 8 < data.len() {
        scratch.resize(data.len().div_ceil(8), 0);
    }
    let tmp = &mut bytemuck::cast_slice_mut::<u64, u8>(scratch)[..data.len()];
    let p2 = 1usize << (usize::BITS - 1 - n.leading_zeros());
    let extra = n - p2;
    if r >= p2 {
        o.step(&[o.send(r - p2, data, tags::RD_FOLD)], &mut [])?;
        return o.step(&[], &mut [o.recv(r - p2, data, tags::RD_UNFOLD)]);
    }
    if r < extra {
        o.step(&[], &mut [o.recv(r + p2, tmp, tags::RD_FOLD)])?;
        o.combine(op, data, tmp)?;
    }
    let mut mask = 1;
    let mut step = 0;
    while mask < p2 {
        let partner = r ^ mask;
        let tag = tags::RD_STEP | step;
        o.step(
            &[o.send(partner, data, tag)],
            &mut [o.recv(partner, tmp, tag)],
        )?;
        // The lower rank's partial result goes on the left, so both sides compute a ⊕ b alike.
        if partner < r {
            o.combine(op, tmp, data)?;
            data.copy_from_slice(tmp);
        } else {
            o.combine(op, data, tmp)?;
        }
        mask <<= 1;
        step += 1;
    }
    if r < extra {
        o.step(&[o.send(r + p2, data, tags::RD_UNFOLD)], &mut [])?;
    }
    Ok(())
}

/// Ring all_reduce: reduce-scatter, finalize own block, all-gather.
pub(crate) fn ring(
    o: &Op<'_>,
    data: &mut [u8],
    op: ReduceOp,
    scratch: &mut Vec<u64>,
) -> Result<()> {
    let elem = o.dtype().size();
    let blocks = even_blocks(data.len() / elem, o.n(), elem);
    ring::reduce_scatter(o, data, &blocks, op, scratch)?;
    let own = blocks[o.rank()].clone();
    dist_wire::finalize(op, o.dtype(), &mut data[own], o.n()).map_err(|e| o.wire(e))?;
    ring::all_gather(o, data, &blocks)
}
