//! Collective algorithms, written once against [`Transport`].
//!
//! Each function runs one operation's steps; tags label the step so that ranks running
//! different algorithms (say, a different size threshold) fail with a clear error instead of
//! exchanging garbage.

use std::cell::RefCell;
use std::ops::Range;

use dist_backend::{Error, Result};
use dist_wire::{DType, ReduceOp};

use crate::transport::{Incoming, OnFrame, Outgoing, StepCtx, Transport};

pub(crate) mod agree;
pub(crate) mod allgather;
pub(crate) mod allreduce;
pub(crate) mod alltoall;
pub(crate) mod bcast;
pub(crate) mod choice;
pub(crate) mod lent;
pub(crate) mod reducescatter;
pub(crate) mod ring;
pub(crate) mod rooted;

/// Tag spaces of the algorithms' steps (upper 16 bits), the step number in the lower 16.
pub(crate) mod tags {
    pub(crate) const RING_RS: u32 = 1 << 16;
    pub(crate) const RING_AG: u32 = 2 << 16;
    pub(crate) const RD_FOLD: u32 = 3 << 16;
    pub(crate) const RD_STEP: u32 = 4 << 16;
    pub(crate) const RD_UNFOLD: u32 = 5 << 16;
    pub(crate) const TREE: u32 = 6 << 16;
    pub(crate) const CHAIN: u32 = 7 << 16;
    pub(crate) const DIRECT: u32 = 8 << 16;
    pub(crate) const BARRIER: u32 = 9 << 16;
    pub(crate) const GATHER: u32 = 10 << 16;
    pub(crate) const AGREE: u32 = 11 << 16;
    pub(crate) const SCATTER: u32 = 12 << 16;
    pub(crate) const RH_RS: u32 = 13 << 16;
    pub(crate) const RD_AG: u32 = 14 << 16;
    pub(crate) const STAR: u32 = 15 << 16;

    /// The step a frame's `tag` labels, with its algorithm's name, for the error of ranks
    /// that met in different algorithms (and for reading the tags of another build's notice).
    pub(crate) fn step(tag: u32) -> dist_backend::AlgoStep {
        let algorithm = match tag & !0xffff {
            RING_RS => "ring reduce-scatter",
            RING_AG => "ring all-gather",
            RD_FOLD => "recursive doubling (fold)",
            RD_STEP => "recursive doubling",
            RD_UNFOLD => "recursive doubling (unfold)",
            TREE => "binomial tree",
            CHAIN => "pipelined chain",
            DIRECT => "pairwise exchange",
            BARRIER => "barrier rounds",
            GATHER => "direct gather",
            AGREE => "argument agreement",
            SCATTER => "scatter + all-gather",
            RH_RS => "recursive halving (reduce-scatter)",
            RD_AG => "recursive doubling (all-gather)",
            STAR => "star through rank 0",
            _ => "an unknown algorithm",
        };
        dist_backend::AlgoStep { algorithm, tag }
    }
}

/// The largest group whose barrier and small all_reduces, all_gathers and reduce_scatters go
/// over messages as a star through rank 0 (from 3 ranks): every rank sends rank 0 what it has,
/// and rank 0 answers them all once every one has. Each rank but rank 0 waits once, where ⌈log2 n⌉ rounds cost every rank a wait
/// each, and where ranks share cores every wait is a turn on a core. Past this size rank 0's
/// share, which grows with the group, outweighs the rounds, which grow with its logarithm.
/// Open MPI runs its linear barrier from 4 to 7 ranks.
pub(crate) const STAR_MAX_RANKS: usize = 8;

/// The most bytes rank 0 receives, or sends, in all in an all_reduce or all_gather star: its
/// transfers to and from the group's other ranks come one after another, where the rounds and
/// the direct exchange run on every link at once, so larger buffers stay on those.
/// (reduce_scatter's star, whose rank 0 receives every rank's whole input, has its own, lower
/// bound: `reducescatter::STAR_MAX_INBOUND_BYTES`.)
pub(crate) const STAR_MAX_BYTES: usize = 64 << 10;

/// Whether a star of `n` ranks fits: 3 to [`STAR_MAX_RANKS`] ranks, and at most `max_bytes`
/// through rank 0 when it receives or sends `each` bytes from or to each other rank. Every rank
/// answers alike for the same call (ranks that pass different lengths disagree in their
/// frames' headers whichever way each goes).
pub(crate) fn takes_star(n: usize, each: usize, max_bytes: usize) -> bool {
    (3..=STAR_MAX_RANKS).contains(&n) && each.saturating_mul(n - 1) <= max_bytes
}

/// A star seen from any rank but rank 0, both its steps in one: sends rank 0 `mine` and
/// receives what rank 0 sends back into `back`.
pub(crate) fn star_leaf(o: &Op<'_>, mine: &[u8], back: &mut [u8]) -> Result<()> {
    o.step(
        &[o.send(0, mine, tags::STAR)],
        &mut [o.recv(0, back, tags::STAR | 1)],
    )
}

/// Rank 0's last step of a star: sends every other rank p `part(p)`, which its
/// [`star_leaf`] receives.
pub(crate) fn star_release<'a>(o: &Op<'_>, part: impl Fn(usize) -> &'a [u8]) -> Result<()> {
    let sends: Vec<_> = (1..o.n())
        .map(|p| o.send(p, part(p), tags::STAR | 1))
        .collect();
    o.step(&sends, &mut [])
}

/// Rank 0's first step of a star whose every other rank sends `len` bytes: rank p's land in
/// `inbound[(p − 1)·len..p·len]` (`inbound` holds at least (n − 1)·len bytes).
fn star_receive(o: &Op<'_>, inbound: &mut [u8], len: usize) -> Result<()> {
    let mut recvs = Vec::with_capacity(o.n() - 1);
    let mut rest = inbound;
    for p in 1..o.n() {
        let (theirs, tail) = std::mem::take(&mut rest).split_at_mut(len);
        recvs.push(o.recv(p, theirs, tags::STAR));
        rest = tail;
    }
    o.step(&[], &mut recvs)
}

/// Rank 0's part of a reducing star: receives every other rank's `len` bytes into `inbound`
/// ([`star_receive`]) and combines them into `acc`, which holds rank 0's own, in rank order.
/// One rank combines everything, so every rank that gets a part of `acc` gets the same bits.
pub(crate) fn star_reduce_at_root(
    o: &Op<'_>,
    acc: &mut [u8],
    inbound: &mut [u8],
    op: ReduceOp,
) -> Result<()> {
    let len = acc.len();
    star_receive(o, inbound, len)?;
    for theirs in inbound.chunks_exact(len.max(1)).take(o.n() - 1) {
        o.combine(op, acc, &theirs[..len])?;
    }
    Ok(())
}

/// The window a `len`-byte message streams through with `seg`-byte frames: the message itself
/// when no larger, else one frame (the core hands each frame to the callback before the next
/// one lands, so one is enough, and it stays in the L2 cache).
fn stream_window(len: usize, seg: usize) -> usize {
    len.min(seg.max(8))
}

/// Everything an algorithm needs about the operation it runs.
pub(crate) struct Op<'a> {
    pub(crate) t: &'a dyn Transport,
    pub(crate) ctx: StepCtx,
    /// Element count announced in every frame (agreed by all ranks).
    pub(crate) count: u64,
    /// The argument agreement's frames still to send or read, carried by the steps the
    /// algorithm runs (see [`agree::fused_step`]); `None` when the op needs none.
    pub(crate) agree: RefCell<Option<agree::Pending>>,
}

impl<'a> Op<'a> {
    pub(crate) fn rank(&self) -> usize {
        self.t.rank()
    }

    pub(crate) fn n(&self) -> usize {
        self.t.world_size()
    }

    pub(crate) fn dtype(&self) -> DType {
        self.ctx.dtype
    }

    /// An operation whose frames carry `count`, with no agreement pending.
    pub(crate) fn new(t: &'a dyn Transport, ctx: StepCtx, count: u64) -> Self {
        Op {
            t,
            ctx,
            count,
            agree: RefCell::new(None),
        }
    }

    /// One step with no frame callback.
    pub(crate) fn step(&self, sends: &[Outgoing<'_>], recvs: &mut [Incoming<'_>]) -> Result<()> {
        self.step_with(sends, recvs, &mut |_, _, _| Ok(()))
    }

    /// One step with a frame callback. While an agreement is pending the step also carries
    /// its frames, each ahead of the step's own on its connection (see [`agree::fused_step`]).
    pub(crate) fn step_with(
        &self,
        sends: &[Outgoing<'_>],
        recvs: &mut [Incoming<'_>],
        on_frame: &mut OnFrame<'_>,
    ) -> Result<()> {
        if let Some(p) = self.agree.borrow_mut().as_mut()
            && !p.done()
        {
            return agree::fused_step(self, p, sends, recvs, on_frame, false);
        }
        self.t.exchange(&self.ctx, sends, recvs, on_frame)
    }

    /// Reads (and sends, if no step did) what is left of a pending agreement, once the
    /// algorithm's own steps are done.
    ///
    /// A lazy root reads nothing more: what is left is returned, for its next operation to
    /// verify (see [`agree::Pending::deferred`]).
    pub(crate) fn finish_agreement(&self) -> Result<Option<agree::Deferred>> {
        if let Some(p) = self.agree.borrow_mut().as_mut()
            && !p.done()
        {
            if p.may_defer() {
                return Ok(p.deferred(self));
            }
            agree::fused_step(self, p, &[], &mut [], &mut |_, _, _| Ok(()), true)?;
        }
        Ok(None)
    }

    /// Drops what is left of a pending agreement once the operation ran through the group
    /// area: every rank read every rank's header there, which carries the arguments the
    /// agreement compares, so nothing is owed to anyone and nothing is left to verify.
    pub(crate) fn agreement_settled(&self) {
        *self.agree.borrow_mut() = None;
    }

    pub(crate) fn send<'b>(&self, peer: usize, data: &'b [u8], tag: u32) -> Outgoing<'b> {
        Outgoing {
            peer,
            data,
            count: self.count,
            tag,
        }
    }

    pub(crate) fn recv<'b>(&self, peer: usize, buf: &'b mut [u8], tag: u32) -> Incoming<'b> {
        Incoming {
            peer,
            buf,
            count: self.count,
            tag,
            streamed: None,
            seq_ahead: 0,
        }
    }

    /// A receive of a `len`-byte message that streams through a window taken from
    /// `scratch` (see [`Incoming::streamed`]), for a step whose frame callback consumes each
    /// frame: a whole message when it is no longer than the window would be.
    pub(crate) fn recv_streamed<'b>(
        &self,
        peer: usize,
        len: usize,
        scratch: &'b mut Vec<u64>,
        tag: u32,
    ) -> Incoming<'b> {
        let window = stream_window(len, self.t.segment_bytes());
        if scratch.len() * 8 < window {
            scratch.resize(window.div_ceil(8), 0);
        }
        let buf = &mut bytemuck::cast_slice_mut::<u64, u8>(scratch)[..window];
        Incoming {
            streamed: (window < len).then_some(len),
            ..self.recv(peer, buf, tag)
        }
    }

    /// `dst ⊕= src` with the op's combiner, errors named for this rank and op.
    pub(crate) fn combine(&self, op: ReduceOp, dst: &mut [u8], src: &[u8]) -> Result<()> {
        dist_wire::reduce_into(op.combiner(), self.ctx.dtype, dst, src)
            .map_err(|source| self.wire(source))
    }

    pub(crate) fn wire(&self, source: dist_wire::WireError) -> Error {
        Error::Wire {
            rank: self.ctx.rank,
            op: self.ctx.op.name(),
            source,
        }
    }
}

/// The first `len` bytes of `scratch`, grown to hold them (kept as `u64` so that typed views
/// of it are aligned).
pub(crate) fn scratch_bytes(scratch: &mut Vec<u64>, len: usize) -> &mut [u8] {
    if scratch.len() * 8 < len {
        scratch.resize(len.div_ceil(8), 0);
    }
    &mut bytemuck::cast_slice_mut::<u64, u8>(scratch)[..len]
}

/// The largest all_reduce buffer, all_gather block and reduce_scatter input that goes through
/// the group area ([`crate::transport::Transport::shared_memory_exchange`]) in one shot (every
/// rank reads every rank's publication whole) wherever the group has one. At 4 ranks on
/// 2 cores a 4 KiB all_reduce took 8.6-12.5 us this way against 15.3-15.7 over messages; at
/// 2 ranks the two are even from 1 KiB to 4 KiB (0.7 against 0.8 us, 1.3 against 1.2).
pub(crate) const AREA_ONE_SHOT_BYTES: usize = 4096;

/// Checks that rank `p` published `len` bytes through the group area
/// ([`crate::transport::Transport::shared_memory_exchange`]): headers that agree imply it, so
/// anything else is a corrupt area, reported rather than indexed with.
pub(crate) fn expect_published(o: &Op<'_>, p: usize, theirs: &[u8], len: usize) -> Result<()> {
    if theirs.len() == len {
        return Ok(());
    }
    Err(Error::invalid(
        o.rank(),
        o.ctx.op.name(),
        format!(
            "rank {p} published {} bytes in the shared-memory group area where its header says {len}",
            theirs.len()
        ),
    ))
}

/// The result of an exchange through the group area that the caller checked would fit: the
/// transport answering that it has no area for it breaks its own contract, reported as such
/// rather than a panic.
pub(crate) fn unwrap_area(o: &Op<'_>, done: Option<Result<()>>) -> Result<()> {
    done.unwrap_or_else(|| {
        Err(Error::Unsupported {
            rank: o.rank(),
            backend: "gloo",
            what: format!(
                "{} through the shared-memory group area, which its transport refused though \
                 the publication fits",
                o.ctx.op.name()
            ),
        })
    })
}

/// Splits `count` elements into `n` blocks whose sizes differ by at most one, as byte ranges.
pub(crate) fn even_blocks(count: usize, n: usize, elem: usize) -> Vec<Range<usize>> {
    (0..n).map(|i| even_block(count, n, i, elem)).collect()
}

/// Block `i` of [`even_blocks`]`(count, n, elem)`, computed alone.
fn even_block(count: usize, n: usize, i: usize, elem: usize) -> Range<usize> {
    let (q, r) = (count / n, count % n);
    let start = (i * q + i.min(r)) * elem;
    start..start + (q + usize::from(i < r)) * elem
}

/// The step number piece `i` of a ring of `n` ranks run in pieces starts at, so that each
/// piece's steps are labelled apart from the others' (the labels wrap; they only name steps).
pub(crate) fn piece_first_step(i: usize, n: usize) -> u32 {
    (i as u32).wrapping_mul((n as u32).saturating_sub(1))
}

/// A buffer of `len` bytes cut into consecutive pieces of about `piece_bytes` for a ring of
/// `n` ranks to run one after another (as byte ranges). Each piece keeps at least one element
/// per rank, so that no ring block is empty.
pub(crate) fn ring_pieces(
    len: usize,
    n: usize,
    piece_bytes: usize,
    elem: usize,
) -> Vec<Range<usize>> {
    let count = len / elem;
    let pieces = len
        .div_ceil(piece_bytes.max(1))
        .clamp(1, (count / n).max(1));
    even_blocks(count, pieces, elem)
}

/// `blocks` (byte ranges of a buffer of `len` bytes) cut alike into pieces of about
/// `piece_bytes` of the buffer: piece `j` is part `j` of every block (some parts empty where a
/// block has fewer elements than there are pieces). One piece, `blocks` itself, when the
/// buffer is no larger than a piece. The parts are computed as each piece is taken, so a tiny
/// piece size costs steps but no table of every piece's parts.
pub(crate) fn pieces_of<'b>(
    blocks: &'b [Range<usize>],
    len: usize,
    piece_bytes: usize,
    elem: usize,
) -> impl Iterator<Item = Vec<Range<usize>>> + 'b {
    let largest = blocks.iter().map(|b| b.len() / elem).max().unwrap_or(0);
    let pieces = len.div_ceil(piece_bytes.max(1)).clamp(1, largest.max(1));
    (0..pieces).map(move |j| {
        blocks
            .iter()
            .map(|b| {
                let part = even_block(b.len() / elem, pieces, j, elem);
                b.start + part.start..b.start + part.end
            })
            .collect()
    })
}

/// Byte ranges of consecutive blocks of `counts[i]` elements.
pub(crate) fn blocks_of(counts: &[usize], elem: usize) -> Vec<Range<usize>> {
    let mut at = 0;
    counts
        .iter()
        .map(|c| {
            let b = at..at + c * elem;
            at += c * elem;
            b
        })
        .collect()
}

/// A shared view of range `a` and a mutable view of range `b` of one buffer; they must not
/// overlap.
pub(crate) fn split_pair(buf: &mut [u8], a: Range<usize>, b: Range<usize>) -> (&[u8], &mut [u8]) {
    debug_assert!(a.end <= b.start || b.end <= a.start);
    if a.end <= b.start {
        let (lo, hi) = buf.split_at_mut(b.start);
        (&lo[a], &mut hi[..b.end - b.start])
    } else {
        let (lo, hi) = buf.split_at_mut(a.start);
        (&hi[..a.end - a.start], &mut lo[b])
    }
}

/// Mutable views of disjoint, ascending byte ranges of one buffer.
pub(crate) fn split_blocks<'b>(
    mut buf: &'b mut [u8],
    blocks: &[Range<usize>],
) -> Vec<&'b mut [u8]> {
    let mut out = Vec::with_capacity(blocks.len());
    let mut at = 0;
    for b in blocks {
        let rest = std::mem::take(&mut buf);
        let (_, tail) = rest.split_at_mut(b.start - at);
        let (mine, tail) = tail.split_at_mut(b.end - b.start);
        out.push(mine);
        buf = tail;
        at = b.end;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_cover_the_buffer_and_differ_by_at_most_one_element() {
        for (count, n) in [(0, 3), (1, 4), (7, 3), (1_048_579, 5)] {
            let b = even_blocks(count, n, 4);
            assert_eq!(b.len(), n);
            assert_eq!(b.last().map(|r| r.end), Some(count * 4));
            let lens: Vec<usize> = b.iter().map(|r| r.len()).collect();
            assert!(lens.iter().max().unwrap() - lens.iter().min().unwrap() <= 4);
        }
    }

    #[test]
    fn pieces_cut_every_block_alike_into_consecutive_parts() {
        // Blocks of 0, 3, 10 and 11 four-byte elements; pieces of 8 bytes of the 96-byte
        // buffer would be 12, capped at the largest block's 11 elements.
        let blocks = blocks_of(&[0, 3, 10, 11], 4);
        for (piece_bytes, want) in [(usize::MAX, 1), (40, 3), (8, 11)] {
            let pieces: Vec<_> = pieces_of(&blocks, 96, piece_bytes, 4).collect();
            assert_eq!(pieces.len(), want);
            for (b, block) in blocks.iter().enumerate() {
                let parts: Vec<_> = pieces.iter().map(|p| p[b].clone()).collect();
                let expect: Vec<_> = even_blocks(block.len() / 4, want, 4)
                    .into_iter()
                    .map(|p| block.start + p.start..block.start + p.end)
                    .collect();
                assert_eq!(parts, expect, "block {b}, {want} pieces");
            }
        }
    }

    #[test]
    fn split_pair_returns_the_asked_ranges_either_way_round() {
        let mut v: Vec<u8> = (0..10).collect();
        let (a, b) = split_pair(&mut v, 6..9, 1..3);
        assert_eq!((a, &*b), (&[6u8, 7, 8][..], &[1u8, 2][..]));
        let (a, b) = split_pair(&mut v, 0..2, 4..5);
        assert_eq!((a, &*b), (&[0u8, 1][..], &[4u8][..]));
        let blocks = split_blocks(&mut v, &[1..2, 2..2, 5..7]);
        assert_eq!(
            blocks.iter().map(|b| b.to_vec()).collect::<Vec<_>>(),
            vec![vec![1], vec![], vec![5, 6]]
        );
    }
}
