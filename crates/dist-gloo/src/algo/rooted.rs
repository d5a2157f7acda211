//! reduce, gather, scatter and barrier.

use dist_backend::Result;
use dist_wire::ReduceOp;

use super::{Op, STAR_MAX_RANKS, blocks_of, even_blocks, ring, split_blocks, tags};
use crate::output_copy::{copy_into_output, copy_to_output};

/// Binomial-tree reduce into `root` (small buffers). Non-root buffers end up holding partial
/// results.
pub(crate) fn reduce_tree(
    o: &Op<'_>,
    data: &mut [u8],
    op: ReduceOp,
    root: usize,
    scratch: &mut Vec<u64>,
) -> Result<()> {
    let (n, r) = (o.n(), o.rank());
    let tmp = super::scratch_bytes(scratch, data.len());
    let vr = (r + n - root) % n;
    let mut mask = 1;
    while mask < n {
        if vr & mask != 0 {
            return o.step(&[o.send((vr - mask + root) % n, data, tags::TREE)], &mut []);
        }
        if vr + mask < n {
            o.step(&[], &mut [o.recv((vr + mask + root) % n, tmp, tags::TREE)])?;
            o.combine(op, data, tmp)?;
        }
        mask <<= 1;
    }
    Ok(())
}

/// Ring reduce-scatter, then every rank sends its reduced block to `root` (large buffers),
/// on consecutive pieces of about `piece_bytes` (see [`super::ring_pieces`]), so that no
/// step holds megabytes in flight (as `reducescatter::ring_in_pieces`).
pub(crate) fn reduce_ring(
    o: &Op<'_>,
    data: &mut [u8],
    op: ReduceOp,
    root: usize,
    scratch: &mut Vec<u64>,
    piece_bytes: usize,
) -> Result<()> {
    let (n, r, elem) = (o.n(), o.rank(), o.dtype().size());
    if n == 1 {
        return Ok(());
    }
    for (i, piece) in super::ring_pieces(data.len(), n, piece_bytes, elem)
        .into_iter()
        .enumerate()
    {
        let data = &mut data[piece];
        let blocks = even_blocks(data.len() / elem, n, elem);
        ring::reduce_scatter(o, data, &blocks, op, scratch, super::piece_first_step(i, n))?;
        if r != root {
            o.step(
                &[o.send(root, &data[blocks[r].clone()], tags::GATHER)],
                &mut [],
            )?;
        } else {
            recv_blocks_from_all(o, &mut split_blocks(data, &blocks))?;
        }
    }
    Ok(())
}

/// Every rank's `input` into `root`'s `output`, rank by rank, with all receives in flight at
/// once. The root's own block bypasses the cache where its output is at least
/// `output_leaves_cache_from` bytes (`output_copy::output_leaves_cache_bytes`).
pub(crate) fn gather(
    o: &Op<'_>,
    input: &[u8],
    output: Option<&mut [u8]>,
    root: usize,
    output_leaves_cache_from: usize,
) -> Result<()> {
    let (n, r) = (o.n(), o.rank());
    let Some(output) = output else {
        return o.step(&[o.send(root, input, tags::GATHER)], &mut []);
    };
    let blocks = blocks_of(&vec![input.len(); n], 1);
    let leaves_cache = output.len() >= output_leaves_cache_from;
    let mut parts = split_blocks(output, &blocks);
    copy_into_output(parts[r], input, leaves_cache);
    recv_blocks_from_all(o, &mut parts)
}

/// One step receiving block p from every rank p other than this one, all in flight at once.
fn recv_blocks_from_all(o: &Op<'_>, parts: &mut [&mut [u8]]) -> Result<()> {
    let me = o.rank();
    let mut recvs: Vec<_> = parts
        .iter_mut()
        .enumerate()
        .filter(|(p, _)| *p != me)
        .map(|(p, b)| o.recv(p, b, tags::GATHER))
        .collect();
    o.step(&[], &mut recvs)
}

/// `root`'s `input`, cut into n equal blocks, to every rank's `output`.
pub(crate) fn scatter(
    o: &Op<'_>,
    input: Option<&[u8]>,
    output: &mut [u8],
    root: usize,
) -> Result<()> {
    let (n, r) = (o.n(), o.rank());
    let Some(input) = input else {
        return o.step(&[], &mut [o.recv(root, output, tags::GATHER)]);
    };
    let blocks = blocks_of(&vec![output.len(); n], 1);
    copy_to_output(output, &input[blocks[r].clone()]);
    let sends: Vec<_> = (0..n)
        .filter(|&p| p != r)
        .map(|p| o.send(p, &input[blocks[p].clone()], tags::GATHER))
        .collect();
    o.step(&sends, &mut [])
}

/// Barrier: through memory the whole group maps where the transport has it (an exchange of
/// nothing, [`crate::transport::Transport::shared_memory_exchange`]), else as a star for 3 to
/// [`STAR_MAX_RANKS`] ranks, else in ⌈log2 n⌉ rounds after which every rank has
/// transitively heard from all. With a power-of-two group round k is a pairwise exchange with
/// rank XOR 2^k (recursive doubling); otherwise dissemination: each rank signals rank + 2^k and
/// waits for rank − 2^k.
///
/// Why the star: TCP only (`DIST_GLOO_TRANSPORT=tcp DIST_GLOO_CMA=0`), 2-core host, gloo_bench,
/// runs alternated with the rounds, medians (us): 4 ranks 44.9 against 58.1 (8 runs), 3 ranks
/// 27.4 against 33.9, 8 ranks 130 against 197 (6 runs each). With 2 ranks the one pairwise
/// round wins (8.9 against 13.9).
///
/// Why pairs where they fit (power-of-two groups past the star's sizes): each round then
/// waits on the one peer it signalled, so a rank that is descheduled delays only its partner's
/// round, not a third rank's. Measured at 4 ranks over TCP only on a 2-core host, before the
/// star, alternated run by run: medians 60.4 against 73.6 us for dissemination (20 runs each),
/// 86 against 89 in a slower hour, 78.5 against 82.2 (30 runs; the 4-byte all_reduce beside
/// it, unchanged, 80.5 against 81.5).
pub(crate) fn barrier(o: &Op<'_>) -> Result<()> {
    if o.n() > 1
        && let Some(done) =
            o.t.shared_memory_exchange(&o.ctx, 0, &[], &mut |_, _| Ok(()))
    {
        return done;
    }
    let (n, r) = (o.n(), o.rank());
    if (3..=STAR_MAX_RANKS).contains(&n) {
        // The arrivals are the star's step 0, the releases its step 1.
        if r == 0 {
            let mut arrivals: Vec<_> = (1..n).map(|p| o.recv(p, &mut [], tags::STAR)).collect();
            o.step(&[], &mut arrivals)?;
            return super::star_release(o, |_| &[]);
        }
        return super::star_leaf(o, &[], &mut []);
    }
    let mut dist = 1;
    let mut round = 0;
    while dist < n {
        let tag = tags::BARRIER | round;
        let (to, from) = if n.is_power_of_two() {
            (r ^ dist, r ^ dist)
        } else {
            ((r + dist) % n, (r + n - dist) % n)
        };
        o.step(&[o.send(to, &[], tag)], &mut [o.recv(from, &mut [], tag)])?;
        dist <<= 1;
        round += 1;
    }
    Ok(())
}
