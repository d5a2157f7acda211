//! all_reduce: through the shared-memory group area up to 4 KiB where the whole group has one
//! (and in two shots through it further where its ranks share cores), else recursive doubling
//! for small buffers (latency-bound), recursive halving and doubling (Rabenseifner) for
//! mid-sized ones, the ring for large ones (bandwidth-bound).

use dist_backend::Result;
use dist_wire::ReduceOp;

use super::lent::{LENT_WORDS, publish_all, read_then_close};
use super::{
    AREA_ONE_SHOT_BYTES, Op, even_blocks, piece_first_step, ring, ring_pieces, split_blocks, tags,
};
use crate::transport::LentWords;

/// Reduces `data` in place across all ranks through memory the whole group maps
/// ([`crate::transport::Transport::shared_memory_exchange`]): every rank publishes its buffer
/// and reduces all of them, in rank order, so all end with identical bits. One arrival per
/// rank instead of ⌈log2 n⌉ exchanges, whose count is what small buffers cost: 4 bytes on 4
/// ranks sharing 2 cores took 5.2-7.9 us this way against 11.5-18.3 by recursive doubling
/// (see `docs/BENCHMARKS.md`). `None` where the transport has no such memory or the buffer
/// does not fit, and the caller reduces over messages.
pub(crate) fn through_shared_memory(
    o: &Op<'_>,
    data: &mut [u8],
    op: ReduceOp,
    scratch: &mut Vec<u64>,
) -> Option<Result<()>> {
    if o.n() == 1 || data.len() > AREA_ONE_SHOT_BYTES.min(o.t.shared_memory_bytes()) {
        return None;
    }
    let acc = super::scratch_bytes(scratch, data.len());
    let done =
        o.t.shared_memory_exchange(&o.ctx, o.count, &[data], &mut |p, theirs| {
            super::expect_published(o, p, theirs, acc.len())?;
            if p == 0 {
                dist_simd::copy::bulk(acc, theirs);
                Ok(())
            } else {
                o.combine(op, acc, theirs)
            }
        })?;
    Some(done.map(|()| dist_simd::copy::bulk(data, acc)))
}

/// Reduces `data` in place across all ranks through memory the whole group maps, in two shots
/// per piece of up to [`crate::transport::Transport::shared_memory_bytes`]: every rank
/// publishes the piece and reduces its own block of it from every rank's publication, in rank
/// order; then every rank publishes its reduced block and copies every other rank's into
/// place. One rank reduces each block, so all end with identical bits. `None` where the
/// transport has no such memory, or the buffer is not larger than [`AREA_ONE_SHOT_BYTES`] (go
/// through [`through_shared_memory`]) or is larger than `max_bytes`.
///
/// Why: the ring takes 2(n − 1) steps (halving-doubling 2·log2 n), and every one waits for a
/// peer's message. Where the ranks outnumber the cores, a waiting rank gives its core away and
/// the peer it waits for must be scheduled first, so the waits, not the bytes, set the pace up
/// to megabytes: 4 ranks on 2 cores, gloo_bench, 4 runs alternated (us), 64 KiB 60.5 over
/// messages against 45.8 here, 256 KiB 141 against 88, 1 MiB 589 against 306, 4 MiB 1756
/// against 1432 (`docs/BENCHMARKS.md` has more). From 4 MiB the ring in pieces has since
/// caught up, and bears the host's slow spells better
/// ([`crate::GlooOptions::auto_area_all_reduce_bytes`] has the figures). Two shots move
/// every byte three times through the cache (in, reduced, out), where the ring by reference
/// moves it twice through the kernel's copy, so with a core per rank (2 ranks on 2 cores) it
/// lost: 1 MiB 98 against 123, 16 MiB 2917 against 3311.
pub(crate) fn in_two_shots(
    o: &Op<'_>,
    data: &mut [u8],
    op: ReduceOp,
    scratch: &mut Vec<u64>,
    max_bytes: usize,
) -> Option<Result<()>> {
    let (n, elem) = (o.n(), o.dtype().size());
    let piece_bytes = o.t.shared_memory_bytes() / elem * elem;
    if n == 1 || piece_bytes == 0 || data.len() <= AREA_ONE_SHOT_BYTES || data.len() > max_bytes {
        return None;
    }
    for piece in data.chunks_mut(piece_bytes) {
        if let Err(e) = two_shots(o, piece, op, scratch) {
            return Some(Err(e));
        }
    }
    Some(Ok(()))
}

/// One piece of [`in_two_shots`], which checked that it fits the area.
fn two_shots(o: &Op<'_>, piece: &mut [u8], op: ReduceOp, scratch: &mut Vec<u64>) -> Result<()> {
    let (n, r, elem) = (o.n(), o.rank(), o.dtype().size());
    let blocks = even_blocks(piece.len() / elem, n, elem);
    let mine = blocks[r].clone();
    let acc = super::scratch_bytes(scratch, mine.len());
    let whole = piece.len();
    let published =
        o.t.shared_memory_exchange(&o.ctx, o.count, &[piece], &mut |p, theirs| {
            super::expect_published(o, p, theirs, whole)?;
            let theirs = &theirs[mine.clone()];
            if p == 0 {
                dist_simd::copy::bulk(acc, theirs);
                Ok(())
            } else {
                o.combine(op, acc, theirs)
            }
        });
    super::unwrap_area(o, published)?;
    let gathered =
        o.t.shared_memory_exchange(&o.ctx, o.count, &[acc], &mut |p, theirs| {
            super::expect_published(o, p, theirs, blocks[p].len())?;
            if p != r {
                dist_simd::copy::bulk(&mut piece[blocks[p].clone()], theirs);
            }
            Ok(())
        });
    super::unwrap_area(o, gathered)?;
    dist_simd::copy::bulk(&mut piece[mine], acc);
    Ok(())
}

/// Reduces `data` in place across all ranks, each reading the others' buffers by reference
/// ([`crate::transport::Transport::shared_memory_lend_mut`]): every rank lends its buffer
/// and publishes the words to read it in the group area; once every rank has, each reduces
/// its own block (of [`even_blocks`]) in place from every rank's buffer, a piece of
/// [`LENT_PIECE_BYTES`] at a time; after a second arrival each copies
/// every other rank's reduced block into place; a third ends the call, so that no rank takes
/// its buffer back while a peer reads it. One rank reduces each block, so all end with
/// identical bits. Each rank writes only its own block while the others read theirs, and the
/// others' blocks only once every rank is done with them.
///
/// Every rank whose buffer is at least the agreed threshold calls this (the caller's test,
/// alike everywhere). A rank that does not `lend` (rank 0 where its pace says messages) or
/// cannot (a peer cannot read its memory) announces so without waiting and returns `None`;
/// the others, finding its announcement, return `None` before reading anything, and the
/// caller goes on by messages, `data` untouched.
///
/// Why: each block crosses from core to core once each way, in the kernel's streaming copy,
/// where the ring passes every line through a ring buffer twice; far apart (vCPUs that share
/// no cache) that is what the rings pay most for. The figures are at
/// [`GlooOptions::auto_lent_all_reduce_bytes`](crate::GlooOptions::auto_lent_all_reduce_bytes).
pub(crate) fn lent_in_two_shots(
    o: &Op<'_>,
    data: &mut [u8],
    op: ReduceOp,
    scratch: &mut Vec<u64>,
    lend: bool,
) -> Option<Result<()>> {
    let (n, r, elem) = (o.n(), o.rank(), o.dtype().size());
    if n == 1 || o.t.shared_memory_bytes() < 8 * (1 + LENT_WORDS) {
        return None;
    }
    let lent = if lend {
        o.t.shared_memory_lend_mut(data)
    } else {
        None
    };
    let (lent, data) = match lent {
        Some((lent, data)) => (Some(lent), data),
        None => (None, &mut [][..]),
    };
    let lenders = match publish_all(o, lent.as_ref().map(|l| l.words))? {
        Ok(lenders) => lenders,
        Err(e) => return Some(Err(e)),
    };
    let done = reduce_lent(o, data, op, scratch, &lenders).and_then(|()| {
        let blocks = even_blocks(data.len() / elem, n, elem);
        let reads = split_blocks(data, &blocks)
            .into_iter()
            .enumerate()
            .filter(|&(p, _)| p != r)
            .map(|(p, part)| (p, lenders[p], blocks[p].start, part));
        read_then_close(o, reads)
    });
    drop(lent);
    Some(done)
}

/// Bytes of this rank's block reduced at a time by [`lent_in_two_shots`]: each peer's piece is
/// read into a buffer that stays in the core's L2 while it is combined.
pub(crate) const LENT_PIECE_BYTES: usize = 256 << 10;

/// The first shot of [`lent_in_two_shots`]: this rank's block reduced in place from every
/// rank's buffer (`lenders`' words), its own first, then the others' in rank order, then the
/// second arrival, after which every rank's block is reduced. Only this rank reduces its
/// block, so any fixed order gives every rank the same bits; own first spares a copy.
fn reduce_lent(
    o: &Op<'_>,
    data: &mut [u8],
    op: ReduceOp,
    scratch: &mut Vec<u64>,
    lenders: &[LentWords],
) -> Result<()> {
    let (n, r, elem) = (o.n(), o.rank(), o.dtype().size());
    let mine = even_blocks(data.len() / elem, n, elem)[r].clone();
    let piece_bytes = (LENT_PIECE_BYTES / elem).max(1) * elem;
    let theirs = super::scratch_bytes(scratch, piece_bytes.min(mine.len()));
    let mut at = mine.start;
    while at < mine.end {
        let len = piece_bytes.min(mine.end - at);
        let (acc, theirs) = (&mut data[at..at + len], &mut theirs[..len]);
        for (p, words) in lenders.iter().enumerate().filter(|&(p, _)| p != r) {
            o.t.shared_memory_read(&o.ctx, p, *words, at, theirs)?;
            // The others wait at the next arrival: tell them.
            o.combine(op, acc, theirs)
                .map_err(|e| o.t.fail_with(&o.ctx, e))?;
        }
        at += len;
    }
    // The peers read this block by reference once they pass the next arrival, which sees no
    // pointer to it: the writes must all be in memory before it, not sunk past it.
    std::hint::black_box(&mut data[mine]);
    super::unwrap_area(
        o,
        o.t.shared_memory_exchange(&o.ctx, o.count, &[], &mut |_, _| Ok(())),
    )
}

/// Reduces `data` in place through rank 0: every other rank sends it its buffer, rank 0
/// combines them in rank order and sends every rank the result, so all end with identical
/// bits. Two steps for rank 0, one for the others; [`super::takes_star`] with the buffer's
/// length and [`super::STAR_MAX_BYTES`] says when.
///
/// Why: TCP only (`DIST_GLOO_TRANSPORT=tcp DIST_GLOO_CMA=0`), 2-core host, gloo_bench against
/// recursive doubling, runs alternated, medians (us): 4 ranks 4 B 44.2 against 67.1, 1 KiB 47.6
/// against 69.4, 8 KiB 53.8 against 87.0 (6 runs); 8 ranks 4 B 110 against 192, 8 KiB 141
/// against 219 (4 runs); 3 ranks even (28 against 28: one exchange and a fold there).
pub(crate) fn star(
    o: &Op<'_>,
    data: &mut [u8],
    op: ReduceOp,
    scratch: &mut Vec<u64>,
) -> Result<()> {
    let (n, r, len) = (o.n(), o.rank(), data.len());
    if r != 0 {
        let result = super::scratch_bytes(scratch, len);
        super::star_leaf(o, data, result)?;
        dist_simd::copy::bulk(data, result);
        return Ok(());
    }
    let inbound = super::scratch_bytes(scratch, len * (n - 1));
    super::star_reduce_at_root(o, data, inbound, op)?;
    super::star_release(o, |_| data)
}

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
    let Some((p2, extra)) = fold(o, data, op, scratch)? else {
        return Ok(());
    };
    let tmp = super::scratch_bytes(scratch, data.len());
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
            dist_simd::copy::bulk(data, tmp);
        } else {
            o.combine(op, data, tmp)?;
        }
        mask <<= 1;
        step += 1;
    }
    unfold(o, data, p2, extra)
}

/// Rabenseifner's all_reduce: a reduce-scatter by recursive halving (in round k each rank
/// swaps half of the blocks it still holds with the rank 2^(m-1-k) away and reduces the half it
/// keeps), then an all-gather by recursive doubling (the same pairs in reverse order, each
/// round doubling the blocks a rank holds). 2·log2 n steps moving 2(n − 1)/n of the buffer,
/// as the ring does in 2(n − 1) steps, where recursive doubling moves log2(n) whole buffers.
/// A non-power-of-two rank count folds as [`recursive_doubling`] does. Each block is reduced
/// on one rank and copied to the others, so every rank ends with identical bits.
pub(crate) fn halving_doubling(
    o: &Op<'_>,
    data: &mut [u8],
    op: ReduceOp,
    scratch: &mut Vec<u64>,
) -> Result<()> {
    let (n, r, elem) = (o.n(), o.rank(), o.dtype().size());
    if n == 1 {
        return dist_wire::finalize(op, o.dtype(), data, n).map_err(|e| o.wire(e));
    }
    let Some((p2, extra)) = fold(o, data, op, scratch)? else {
        return Ok(());
    };
    let blocks = even_blocks(data.len() / elem, p2, elem);
    super::reducescatter::halve_in_place(o, data, &blocks, op, scratch)?;
    let own = blocks[r].clone();
    dist_wire::finalize(op, o.dtype(), &mut data[own], n).map_err(|e| o.wire(e))?;
    super::allgather::doubling(o, data, &blocks)?;
    unfold(o, data, p2, extra)
}

/// Folds a group whose size is not a power of two onto its largest power of two `p2`: rank
/// `p2 + i` hands its data to rank `i`, which combines it, and gets the result back from
/// [`unfold`]. Returns `(p2, extra)` on the ranks that go on, `None` on a folded-out rank once
/// it holds the result.
fn fold(
    o: &Op<'_>,
    data: &mut [u8],
    op: ReduceOp,
    scratch: &mut Vec<u64>,
) -> Result<Option<(usize, usize)>> {
    let (n, r) = (o.n(), o.rank());
    let p2 = 1usize << (usize::BITS - 1 - n.leading_zeros());
    let extra = n - p2;
    if r >= p2 {
        o.step(&[o.send(r - p2, data, tags::RD_FOLD)], &mut [])?;
        o.step(&[], &mut [o.recv(r - p2, data, tags::RD_UNFOLD)])?;
        return Ok(None);
    }
    if r < extra {
        o.step_with(
            &[],
            &mut [o.recv_streamed(r + p2, data.len(), scratch, tags::RD_FOLD)],
            &mut |_, range, bytes| o.combine(op, &mut data[range], bytes),
        )?;
    }
    Ok(Some((p2, extra)))
}

/// Sends the result to the rank [`fold`] folded into this one.
fn unfold(o: &Op<'_>, data: &[u8], p2: usize, extra: usize) -> Result<()> {
    let r = o.rank();
    if r < extra {
        o.step(&[o.send(r + p2, data, tags::RD_UNFOLD)], &mut [])?;
    }
    Ok(())
}

/// Ring all_reduce: reduce-scatter, finalize own block, all-gather, run on pieces of the buffer
/// of about `piece_bytes` one after another.
///
/// Why pieces: the ring touches every byte twice (reduce-scatter, then all-gather) and a whole
/// buffer larger than the caches is gone from them by the second touch. A piece's second
/// touch comes while it is still cached, so a buffer of any size moves through memory about
/// once: on a 2-core host with 2 MiB of L2 per core and 32 MiB of L3, 2 ranks' 16 MiB over
/// shared memory fell off the cache cliff at the ring's full size.
pub(crate) fn ring(
    o: &Op<'_>,
    data: &mut [u8],
    op: ReduceOp,
    scratch: &mut Vec<u64>,
    piece_bytes: usize,
) -> Result<()> {
    let (n, elem) = (o.n(), o.dtype().size());
    for (i, piece) in ring_pieces(data.len(), n, piece_bytes, elem)
        .into_iter()
        .enumerate()
    {
        let data = &mut data[piece];
        let blocks = even_blocks(data.len() / elem, n, elem);
        let first_step = piece_first_step(i, n);
        ring::reduce_scatter(o, data, &blocks, op, scratch, first_step)?;
        let own = blocks[o.rank()].clone();
        dist_wire::finalize(op, o.dtype(), &mut data[own], n).map_err(|e| o.wire(e))?;
        ring::all_gather(o, data, &blocks, first_step)?;
    }
    Ok(())
}
