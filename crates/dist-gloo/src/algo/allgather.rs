//! all_gather: through the shared-memory group area for blocks up to 4 KiB where the whole
//! group has one (and larger ones where its ranks share cores), else for small buffers a star
//! through rank 0 on 3 to 8 ranks, or one direct exchange (latency-bound; recursive doubling on
//! a power-of-two group where every byte crosses a socket), the ring for large ones
//! (bandwidth-bound, [`super::ring::all_gather`]), run in pieces where every byte crosses a
//! socket.

use std::ops::Range;

use dist_backend::Result;

use super::lent::{LENT_WORDS, publish_all, read_then_close};
use super::{
    AREA_ONE_SHOT_BYTES, Op, piece_first_step, pieces_of, ring, split_blocks, split_pair, tags,
};

/// Every rank's `input` into its block of `output` through memory the whole group maps
/// ([`crate::transport::Transport::shared_memory_exchange`]): each rank publishes its block
/// and copies every other. One arrival per rank instead of a message to and from every other
/// (4 ranks on 2 cores, see `docs/BENCHMARKS.md`). Taken where every block is at most
/// [`AREA_ONE_SHOT_BYTES`], or the output at most `max_output` and every block fits the area.
/// `None` otherwise or where the transport has no such memory (the counts are agreed, so every
/// rank decides alike).
///
/// Why `max_output`: where the ranks outnumber the cores every message costs a wait for a
/// peer's turn on a core, as for the all_reduce ([`super::allreduce::in_two_shots`]). 4 ranks
/// on 2 cores, gloo_bench, 4 runs alternated (us, per-rank block): 64 KiB 119 over messages
/// against 50 here, 256 KiB 276-293 against 155-162, 512 KiB 547 against 332, 768 KiB 712
/// against 589; at 1 MiB 570 against 963-1026, where every rank's output and the area's
/// slots no longer fit the 32 MiB last-level cache together.
pub(crate) fn through_shared_memory(
    o: &Op<'_>,
    input: &[u8],
    output: &mut [u8],
    blocks: &[Range<usize>],
    max_output: usize,
) -> Option<Result<()>> {
    let largest = blocks.iter().map(Range::len).max().unwrap_or(0);
    let fits = largest <= AREA_ONE_SHOT_BYTES
        || (output.len() <= max_output && largest <= o.t.shared_memory_bytes());
    if o.n() == 1 || !fits || o.t.shared_memory_bytes() == 0 {
        return None;
    }
    let me = o.rank();
    o.t.shared_memory_exchange(&o.ctx, o.count, &[input], &mut |p, theirs| {
        super::expect_published(o, p, theirs, blocks[p].len())?;
        if p != me {
            dist_simd::copy::bulk(&mut output[blocks[p].clone()], theirs);
        }
        Ok(())
    })
}

/// Every rank's `input` into its block of every rank's `output`, each read by reference
/// straight out of its rank's input: every rank lends its input
/// ([`crate::transport::Transport::shared_memory_lend`]) and publishes the words to read it in
/// the group area; once every rank has, each copies every other's block into place, and a
/// second arrival ends the call (`lent::read_then_close`). One copy of each block and two
/// arrivals, where through the rings every block is copied twice, each line passing from core
/// to core: far apart, that is what the rings pay most for (the figures are at
/// [`GlooOptions::auto_lent_all_gather_bytes`](crate::GlooOptions::auto_lent_all_gather_bytes)).
///
/// Every rank whose output is at least the agreed threshold calls this (the caller's test,
/// alike on every rank). A rank that does not `lend` (rank 0 where its pace says messages), or
/// cannot (some peer cannot read its memory), announces so without waiting and returns `None`;
/// the others, finding its announcement, return `None` too, before reading anything, and the
/// caller goes on by messages. The blocks this rank's own output already holds are left alone.
pub(crate) fn lent_through_shared_memory(
    o: &Op<'_>,
    input: &[u8],
    output: &mut [u8],
    blocks: &[Range<usize>],
    lend: bool,
) -> Option<Result<()>> {
    let (n, me) = (o.n(), o.rank());
    if n == 1 || o.t.shared_memory_bytes() < 8 * (1 + LENT_WORDS) {
        return None;
    }
    let lent = lend.then(|| o.t.shared_memory_lend(input)).flatten();
    let lenders = match publish_all(o, lent.as_ref().map(|l| l.words))? {
        Ok(lenders) => lenders,
        Err(e) => return Some(Err(e)),
    };
    let reads = split_blocks(output, blocks)
        .into_iter()
        .enumerate()
        .filter(|&(p, _)| p != me)
        .map(|(p, part)| (p, lenders[p], 0, part));
    let done = read_then_close(o, reads);
    drop(lent);
    Some(done)
}

/// Given that every rank holds its own block `rank` of `data`, fills in every other block in
/// one step: each rank sends its block to every other and receives theirs in place. One
/// round instead of the ring's n − 1, each rank still sending and receiving (n − 1)/n of the
/// buffer; for buffers small enough that the rounds' wake-ups, not the bytes, bound the time
/// (Open MPI uses recursive doubling or Bruck there for the same reason). The lists are
/// staggered as in `all_to_all`, so that no receiver is fed by every sender at once.
pub(crate) fn direct(o: &Op<'_>, data: &mut [u8], blocks: &[Range<usize>]) -> Result<()> {
    let (n, r) = (o.n(), o.rank());
    if n == 1 {
        return Ok(());
    }
    let mut parts: Vec<Option<&mut [u8]>> =
        split_blocks(data, blocks).into_iter().map(Some).collect();
    let own: &[u8] = parts[r].take().unwrap_or_default();
    let sends: Vec<_> = (1..n)
        .map(|k| o.send((r + k) % n, own, tags::DIRECT))
        .collect();
    let mut recvs: Vec<_> = (1..n)
        .map(|k| (r + n - k) % n)
        .filter_map(|p| parts[p].take().map(|buf| o.recv(p, buf, tags::DIRECT)))
        .collect();
    o.step(&sends, &mut recvs)
}

/// Fills every rank's `output` through rank 0: every other rank sends rank 0 its `input`, which
/// rank 0 receives into its output, then rank 0 sends every rank the whole output. Each rank
/// but rank 0 waits once, where the direct exchange has every rank receive from every other
/// and doubling waits log2 n times; see [`super::STAR_MAX_RANKS`], and [`super::takes_star`]
/// with the output's length and [`super::STAR_MAX_BYTES`] for when. Rank 0 must already hold
/// its own block, as in [`direct`]; the others receive theirs back with the rest.
///
/// Why: TCP only (`DIST_GLOO_TRANSPORT=tcp DIST_GLOO_CMA=0`), 2-core host, gloo_bench, runs
/// alternated with doubling (the choice there), medians (us): 4 ranks 4 B per rank 52.2 against
/// 64.5, 1 KiB 52.4 against 68.2, 4 KiB 55.6 against 85.1 (6 runs); 8 ranks 4 B 144 against
/// 187, 1 KiB 140 against 219 (4 runs).
pub(crate) fn star(
    o: &Op<'_>,
    input: &[u8],
    output: &mut [u8],
    blocks: &[Range<usize>],
) -> Result<()> {
    if o.rank() != 0 {
        return super::star_leaf(o, input, output);
    }
    {
        let mut recvs: Vec<_> = split_blocks(output, blocks)
            .into_iter()
            .enumerate()
            .skip(1)
            .map(|(p, theirs)| o.recv(p, theirs, tags::STAR))
            .collect();
        o.step(&[], &mut recvs)?;
    }
    super::star_release(o, |_| output)
}

/// Given that every rank of a power-of-two group holds its own block `rank` of `data` (split
/// into `blocks`, one per rank), fills in the others by recursive doubling: in round k each
/// rank swaps the run of 2^k blocks it holds with the rank 2^k away, which holds the run beside
/// it, so after log2 n rounds every rank holds all. Each rank sends (n − 1)/n of the buffer, as
/// in [`direct`], in log2 n messages instead of n − 1 (over TCP each costs a system call and a
/// wake-up: the backend's `pairs_over_sockets` says when, with the figures). Also the
/// all-gather half of Rabenseifner's all_reduce ([`super::allreduce::halving_doubling`]),
/// after its reduce-scatter by [`super::reducescatter::halve_in_place`].
pub(crate) fn doubling(o: &Op<'_>, data: &mut [u8], blocks: &[Range<usize>]) -> Result<()> {
    let (p2, r) = (blocks.len(), o.rank());
    debug_assert!(p2.is_power_of_two() && r < p2);
    // The byte range of blocks lo..hi (consecutive, so one range).
    let span = |lo: usize, hi: usize| blocks[lo].start..blocks[hi - 1].end;
    let (mut lo, mut hi) = (r, r + 1);
    let mut mask = 1;
    let mut step = 0;
    while mask < p2 {
        let partner = r ^ mask;
        // The partner holds the sibling of this rank's run of blocks.
        let width = hi - lo;
        let theirs = if r & mask == 0 {
            (hi, hi + width)
        } else {
            (lo - width, lo)
        };
        let (out, into) = split_pair(data, span(lo, hi), span(theirs.0, theirs.1));
        let tag = tags::RD_AG | step;
        o.step(
            &[o.send(partner, out, tag)],
            &mut [o.recv(partner, into, tag)],
        )?;
        (lo, hi) = (lo.min(theirs.0), hi.max(theirs.1));
        mask <<= 1;
        step += 1;
    }
    Ok(())
}

/// The ring all-gather run on consecutive pieces of about `piece_bytes` of the output, each
/// piece a whole ring over part of every block: a rank forwards a part while it is still in
/// the cache from its arrival, where the whole ring forwards blocks received a whole block
/// earlier. Over TCP only (4 ranks on 2 cores, pieces of 4 MiB, alternated with the whole
/// ring): 16 MiB per rank took 32.9-35.3 ms against 37.4-53.5, 64 MiB 127-137 ms against
/// 145-197.
/// Where ranks share memory the whole ring stays (one piece, `piece_bytes` of `usize::MAX`):
/// large blocks go by reference in one step each, which pieces would cut up (2 ranks, 4 MiB:
/// 2.0 ms in pieces against 0.35). A buffer no larger than a piece runs the whole ring.
pub(crate) fn ring_in_pieces(
    o: &Op<'_>,
    data: &mut [u8],
    blocks: &[Range<usize>],
    piece_bytes: usize,
) -> Result<()> {
    let len = data.len();
    for (j, part) in pieces_of(blocks, len, piece_bytes, o.dtype().size()).enumerate() {
        ring::all_gather(o, data, &part, piece_first_step(j, o.n()))?;
    }
    Ok(())
}
