//! reduce_scatter: through the shared-memory group area up to 4 KiB where the whole group has
//! one, else for small buffers a star through rank 0 on 3 to 8 ranks, or one direct exchange
//! (latency-bound; recursive halving on a power-of-two group where every byte crosses a
//! socket), the ring for large ones (bandwidth-bound, [`super::ring::reduce_scatter_into`]).

use std::ops::Range;

use dist_backend::Result;
use dist_wire::ReduceOp;

use super::{AREA_ONE_SHOT_BYTES, Op, ring, split_pair, tags};

/// Reduces block `rank` of every rank's `input` into `output` through memory the whole group
/// maps ([`crate::transport::Transport::shared_memory_exchange`]): each rank publishes its
/// whole input and combines block `rank` of every rank's, in rank order. One arrival per rank
/// instead of a message to and from every other. `None` where the transport has no such memory
/// or the input does not fit (its length is agreed, so every rank decides alike).
pub(crate) fn through_shared_memory(
    o: &Op<'_>,
    input: &[u8],
    output: &mut [u8],
    blocks: &[Range<usize>],
    op: ReduceOp,
) -> Option<Result<()>> {
    if o.n() == 1 || input.len() > AREA_ONE_SHOT_BYTES.min(o.t.shared_memory_bytes()) {
        return None;
    }
    let mine = blocks[o.rank()].clone();
    o.t.shared_memory_exchange(&o.ctx, o.count, &[input], &mut |p, theirs| {
        super::expect_published(o, p, theirs, input.len())?;
        if p == 0 {
            dist_simd::copy::bulk(output, &theirs[mine.clone()]);
            Ok(())
        } else {
            o.combine(op, output, &theirs[mine.clone()])
        }
    })
}

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
        dist_simd::copy::bulk(output, &input[mine]);
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
    dist_simd::copy::bulk(output, part(0));
    for p in 1..n {
        o.combine(op, output, part(p))?;
    }
    Ok(())
}

/// The most bytes rank 0 of a reduce_scatter [`star`] receives in all: every rank's whole input,
/// where halving and the direct exchange move (n − 1)/n of one per rank, so the star pays off
/// only for smaller inputs than all_gather's and all_reduce's. TCP only, 2-core host,
/// gloo_bench, alternated with the schedules before it (medians, us): 4 ranks 2 KiB 50.9
/// against 67.8, 4 KiB 49.0 against 79.8, but 8 KiB (24 KiB to rank 0) 116.7 against 107.5;
/// 3 ranks 16 KiB (32 KiB) even, 82.1 against 81.9; 8 ranks 8 KiB (56 KiB) even, 449 against 449.
pub(crate) const STAR_MAX_INBOUND_BYTES: usize = 16 << 10;

/// Reduces block `rank` of every rank's `input` into `output` through rank 0: every other rank
/// sends rank 0 its whole input, rank 0 combines them in rank order and sends every rank its
/// block of the result. Each rank but rank 0 waits once, where the direct exchange has every
/// rank receive from every other and halving waits log2 n times; see [`super::STAR_MAX_RANKS`],
/// and [`super::takes_star`] with the input's length and [`STAR_MAX_INBOUND_BYTES`] for when.
/// TCP only, alternated with the schedules before it (medians, us): 3 ranks 48 B 27.8 against
/// 54.7, 8 KiB 38.0 against 70.5; 4 ranks 64 B 46.8 against 58.5, 1 KiB 39.2 against 62.8;
/// 8 ranks 64 B 141 against 193, 1 KiB 136 against 221. `scratch` holds the sum and the n − 1
/// received inputs.
pub(crate) fn star(
    o: &Op<'_>,
    input: &[u8],
    output: &mut [u8],
    blocks: &[Range<usize>],
    op: ReduceOp,
    scratch: &mut Vec<u64>,
) -> Result<()> {
    let (n, r, len) = (o.n(), o.rank(), input.len());
    if r != 0 {
        return super::star_leaf(o, input, output);
    }
    let (sum, inbound) = super::scratch_bytes(scratch, len * n).split_at_mut(len);
    dist_simd::copy::bulk(sum, input);
    super::star_reduce_at_root(o, sum, inbound, op)?;
    super::star_release(o, |p| &sum[blocks[p].clone()])?;
    dist_simd::copy::bulk(output, &sum[blocks[0].clone()]);
    Ok(())
}

/// Recursive halving on a power-of-two group: in round k each rank swaps half of the blocks
/// it still reduces with the rank n/2^(k+1) away, keeping the half on its own side of the
/// partner and combining the partner's copy of it as the frames land, so that after log2 n
/// rounds it holds its own block, reduced. Each rank sends (n − 1)/n of the buffer, as in
/// [`direct`], but to one peer at a time: over TCP, every rank feeding all others at once
/// cost n − 1 messages per rank, each a system call and a wake-up (the backend's
/// `pairs_over_sockets` says when, with the figures). The input is copied once into `work`
/// (the caller's, kept between operations so that they allocate nothing), since each round
/// combines into the blocks the rank keeps.
pub(crate) fn halving(
    o: &Op<'_>,
    input: &[u8],
    output: &mut [u8],
    blocks: &[Range<usize>],
    op: ReduceOp,
    scratch: &mut Vec<u64>,
    work: &mut Vec<u8>,
) -> Result<()> {
    work.clear();
    work.extend_from_slice(input);
    halve_in_place(o, work, blocks, op, scratch)?;
    dist_simd::copy::bulk(output, &work[blocks[o.rank()].clone()]);
    Ok(())
}

/// The rounds of [`halving`] on `data`, split into `blocks` (one per rank of a power-of-two
/// group, this rank among them), reducing in place: afterwards block `rank` of `data` holds
/// the reduction of every rank's. Also the reduce-scatter half of Rabenseifner's all_reduce
/// ([`super::allreduce::halving_doubling`]).
pub(crate) fn halve_in_place(
    o: &Op<'_>,
    data: &mut [u8],
    blocks: &[Range<usize>],
    op: ReduceOp,
    scratch: &mut Vec<u64>,
) -> Result<()> {
    let (p2, r) = (blocks.len(), o.rank());
    debug_assert!(p2.is_power_of_two() && r < p2);
    // The byte range of blocks lo..hi (consecutive, so one range).
    let span = |lo: usize, hi: usize| blocks[lo].start..blocks[hi - 1].end;
    // Blocks lo..hi are those this rank still reduces; each round keeps the half on this
    // rank's side of the partner, so rank r ends with block r.
    let (mut lo, mut hi) = (0, p2);
    let mut mask = p2 / 2;
    let mut step = 0;
    while mask > 0 {
        let partner = r ^ mask;
        let mid = lo + (hi - lo) / 2;
        let (keep, give) = if r & mask == 0 {
            ((lo, mid), (mid, hi))
        } else {
            ((mid, hi), (lo, mid))
        };
        let (kept, given) = (span(keep.0, keep.1), span(give.0, give.1));
        let (out, acc) = split_pair(data, given, kept.clone());
        let tag = tags::RH_RS | step;
        o.step_with(
            &[o.send(partner, out, tag)],
            &mut [o.recv_streamed(partner, kept.len(), scratch, tag)],
            &mut |_, range, bytes| o.combine(op, &mut acc[range], bytes),
        )?;
        (lo, hi) = keep;
        mask >>= 1;
        step += 1;
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
