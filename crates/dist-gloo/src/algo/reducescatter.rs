//! reduce_scatter: one direct exchange for small buffers (latency-bound), the ring for large
//! ones (bandwidth-bound, [`super::ring::reduce_scatter_into`]).

use std::ops::Range;

use dist_backend::Result;
use dist_wire::ReduceOp;

use super::{Op, ring, tags};

/// Reduces block `rank` of every rank's `input` into `output` in one step: each rank sends
/// block p of its input to rank p and receives its own block from every other rank, then
/// combines them in rank order. One round instead of the ring's n − 1, each rank still
/// sending and receiving (n − 1)/n of the buffer; for buffers small enough that the rounds'
/// wake-ups, not the bytes, bound the time. `scratch` holds the n − 1 received blocks.
pub(crate) fn direct(
    o: &Op<'_>,
    input: &[u8],
    output: &mut [u8],
    blocks: &[Range<usize>],
    op: ReduceOp,
    scratch: &mut Vec<u64>,
) -> Result<()> {
    let (n, r) = (o.n(), o.rank());
    let mine = blocks[r].clone();
    let len = mine.len();
    if n == 1 {
        output.copy_from_slice(&input[mine]);
        return Ok(());
    }
    // One 8-byte-aligned slot per peer: slot (p − r − 1) mod n holds rank p's block.
    let stride = len.div_ceil(8).max(1) * 8;
    if scratch.len() * 8 < stride * (n - 1) {
        scratch.resize(stride * (n - 1) / 8, 0);
    }
    let tmp = &mut bytemuck::cast_slice_mut::<u64, u8>(scratch)[..stride * (n - 1)];
    let slot_of = |p: usize| (p + n - r - 1) % n;
    {
        let mut slots: Vec<Option<&mut [u8]>> = tmp
            .chunks_mut(stride)
            .map(|c| Some(&mut c[..len]))
            .collect();
        let sends: Vec<_> = (1..n)
            .map(|k| (r + k) % n)
            .map(|p| o.send(p, &input[blocks[p].clone()], tags::DIRECT))
            .collect();
        let mut recvs: Vec<_> = (1..n)
            .map(|k| (r + n - k) % n)
            .filter_map(|p| slots[slot_of(p)].take().map(|b| o.recv(p, b, tags::DIRECT)))
            .collect();
        o.step(&sends, &mut recvs)?;
    }
    let part = |p: usize| -> &[u8] {
        if p == r {
            &input[mine.clone()]
        } else {
            let at = slot_of(p) * stride;
            &tmp[at..at + len]
        }
    };
    output.copy_from_slice(part(0));
    for p in 1..n {
        o.combine(op, output, part(p))?;
    }
    Ok(())
}

/// The ring reduce-scatter ([`ring::reduce_scatter_into`]) run on pieces of about
/// `piece_bytes` of the input one after another: piece `j` is sub-block `j` of every rank's
/// block, so each piece's output is the `j`-th part of this rank's output.
///
/// Why pieces: the ring moves a whole block per step, and a step of megabytes keeps the
/// shared-memory rings full, so the ring's bytes leave the caches before the peer copies them
/// out; a piece's steps move little enough that they do not.
pub(crate) fn ring_in_pieces(
    o: &Op<'_>,
    input: &[u8],
    output: &mut [u8],
    blocks: &[Range<usize>],
    op: ReduceOp,
    scratch: &mut Vec<u64>,
    piece_bytes: usize,
) -> Result<()> {
    let (n, r) = (o.n(), o.rank());
    let mine_start = blocks[r].start;
    for (j, sub) in super::pieces_of(blocks, input.len(), piece_bytes, o.dtype().size()).enumerate()
    {
        let out = sub[r].start - mine_start..sub[r].end - mine_start;
        let first_step = super::piece_first_step(j, n);
        ring::reduce_scatter_into(o, input, &mut output[out], &sub, op, scratch, first_step)?;
    }
    Ok(())
}
