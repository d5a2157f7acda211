//! all_gather: one direct exchange for small buffers (latency-bound), the ring for large ones
//! (bandwidth-bound, [`super::ring::all_gather`]), run in pieces where every byte crosses a
//! socket.

use std::ops::Range;

use dist_backend::Result;

use super::{Op, piece_first_step, pieces_of, ring, split_blocks, tags};

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
