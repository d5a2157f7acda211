//! Agreement on a rooted operation's arguments.
//!
//! Why: in `broadcast`, `reduce`, `gather` and `scatter` data flows only away from or towards
//! the root, so ranks that disagree about the root may never exchange a frame whose header
//! would show it (two ranks that each think they are the root only send), and a root that
//! only sends returns before anyone could tell it that something was wrong. Every other
//! collective makes each rank's result depend on every other rank's frames, so a disagreement
//! always reaches every rank through the headers (and the abort notices of the ranks that see
//! it); these four need this extra exchange.
//!
//! Up to [`FUSED_MAX_RANKS`] ranks it costs no round of its own ([`fused_step`]): in the
//! operation's first step every rank but the root also sends one header-only frame to the
//! rank it takes for the root, ahead of anything else it sends this operation. Every frame
//! header carries root, count, dtype, reduce op (with `PremulSum`'s scale) and split sizes,
//! and a receiver compares them with its own, so the data frames already show most
//! disagreements to the rank that receives them; the root's frames show it to its
//! receivers. Two more rules close the rest:
//! - the frames to the root tell it of ranks that name it while it names another (so two
//!   ranks that each think the other is the root, and only receive, fail at once), and a root
//!   checks them all, at the latest one operation later;
//! - a rank that waits judges every frame of its operation that arrives on any connection,
//!   not only those it waits for (see `transport::stashed_conflict`): ranks that disagree
//!   about the root send their data down different trees, and some rank that does not share
//!   the sender's view always receives from it (the first rank on the sender's tree that
//!   names another root), so the one that would otherwise wait on a peer that never sends
//!   fails naming the other side;
//! - in `reduce` and `gather`, whose root receives, a root whose call differs from its last
//!   rooted call also sends every other rank an advisory frame in its first step
//!   (`transport::ADVISORY_TAG`), which no step waits for: a rank judges one of its own
//!   operation as it judges any frame it does not wait for, and drops it otherwise. Without it
//!   two would-be roots each waited for the other's data and nothing that flowed showed
//!   either of them the disagreement (a gather whose 3 ranks each took themselves for the root
//!   timed out on all three). Every rank ran the last rooted call alike, so of two would-be
//!   roots at most one repeats it, and the other's frame reaches it as it waits (the rule is
//!   applied in `GlooBackend::run`). Waiting for the frame instead (every other rank reading
//!   it) made 4-rank reduces and gathers of 4 B over TCP take 57-83 us instead of 11-17, as a
//!   rank whose data the root takes could no longer return before the root had started.
//!
//! A rank whose own data was consistent returns without waiting for anyone else's frame, and
//! hears of a disagreement elsewhere from the rank that found it (its abort notice), or from a
//! frame it did not expect, at its next operation on the group; a receiver may already have
//! written into its buffer when it fails, whose content is then unspecified (as in torch).
//! No data waits for a round trip, and no rank waits for ranks it exchanges no data with: a
//! small broadcast costs one small write per receiver more than with no agreement at all (see
//! docs/BENCHMARKS.md), where every rank reading every other's frame made each one a barrier.
//!
//! The root need not wait for its frames either (`GlooOptions::lazy_root_verification`, the
//! default): it returns once its data is out and leaves them to a later operation
//! ([`Deferred`], [`verify_deferred`]), judged there against the operation they belong to,
//! before it receives anything else: at its next operation, unless that one only sends too
//! (then after at most [`MAX_DEFERRED`] of them), or at close. A root's send that waits for
//! its receiver (by reference, or on a full socket) does not need that receiver's frame to
//! end: a receiver that disagrees is waiting, or a second would-be root sending too, and
//! either way the frames that reach a waiting rank show it, so two would-be roots of a large
//! buffer fail at once rather than time out.
//!
//! What no rank can shed in a first call is the receivers' frames to the root: with two ranks
//! that each think the other is the root, both only receive, and only that frame tells either
//! of them; a receiver cannot tell that case from agreement before it has sent it. A repeat can
//! shed them: a small broadcast or scatter whose call is the rank's last rooted call again
//! runs with no agreement frames at all ([`repeats_silently`]), and its root looks at what its
//! peers sent every [`LOOK_EVERY`] + 1 such operations instead ([`LOOK_EVERY`]).
//!
//! Above that, n − 1 frames per rank cost more than a few serial rounds, and
//! [`rooted_args`] runs a dissemination exchange before the data: in round k each rank sends
//! to rank + 2^k and receives from rank − 2^k the lowest and the highest argument signature
//! (root, count, dtype, reduce op and its parameter, split sizes; ties broken by rank) it has
//! heard of, so after ⌈log2 n⌉ rounds of 64-byte messages every rank knows the same two. If
//! they differ every rank fails alike, before any data moves, naming itself and a rank that
//! disagrees with it. Data never moving matters for large buffers: a send by reference waits
//! for a receiver that, disagreeing, would never receive it, and the step would only end at
//! the timeout.

use std::cmp::Ordering;

use dist_backend::{Error, OpDesc, Result};
use dist_wire::{DType, NO_ROOT};

use super::{Op, tags};
use crate::transport::{Incoming, OnFrame, Outgoing};

/// Largest group whose rooted ops agree inside their own steps ([`fused_step`]) by default;
/// larger groups run [`rooted_args`] first. A judgement, not a measurement: n − 1 header-only
/// frames per rank against ⌈log2 n⌉ serial rounds; `benches/rooted.rs` compares the two at 2
/// and 4 ranks.
pub(crate) const FUSED_MAX_RANKS: usize = 16;

/// The tag of the fused agreement's frames, unlike any dissemination round's, so that ranks
/// configured differently fail naming the step.
const FUSED_TAG: u32 = tags::AGREE | 0x8000;

/// What is left of a fused agreement on one rank.
pub(crate) struct Pending {
    /// Whether this rank's frames have gone out.
    sent: bool,
    /// Per peer rank: its frame is still to be read.
    unread: Vec<bool>,
    /// The root receives (reduce, gather): it sends every other rank an advisory frame too
    /// (see the module's documentation).
    root_receives: bool,
    /// This rank is the root and leaves the frames of the peers it does not receive from to a
    /// later operation ([`Deferred`]) instead of reading them before it returns.
    lazy_root: bool,
    /// Earlier operations' deferred frames are still queued ahead of this one's on the
    /// connections ([`Pending::behind_deferred`]).
    behind_deferred: bool,
}

impl Pending {
    /// Nothing sent or read yet, in a group of `n` ranks, on rank `rank`, for an operation
    /// rooted at `root`: the root is owed every other rank's frame, a receiver none; a root
    /// that receives (`root_receives`: reduce, gather) sends every other rank an advisory
    /// frame; `lazy_root` as in [`Pending::lazy_root`]. A `repeat` (a broadcast or scatter
    /// whose call is this rank's last rooted one again, among ranks whose roots are lazy)
    /// sends no frame and is owed none: see [`repeats_silently`].
    pub(crate) fn new(
        n: usize,
        rank: usize,
        root: usize,
        root_receives: bool,
        lazy_root: bool,
        repeat: bool,
    ) -> Self {
        Pending {
            sent: repeat,
            unread: (0..n)
                .map(|p| rank == root && p != rank && !repeat)
                .collect(),
            root_receives,
            lazy_root,
            behind_deferred: false,
        }
    }

    /// Notes that a lazy root's earlier deferred frames are still unread: they come first on
    /// their connections, so this operation's own frames cannot be read before them (a
    /// failure then keeps the notice it heard rather than read the wrong frame for its own
    /// first-hand cause; the deferred ones are judged at the next operation or at close).
    pub(crate) fn behind_deferred(&mut self) {
        self.behind_deferred = true;
    }

    /// Whether every frame has been sent and read.
    pub(crate) fn done(&self) -> bool {
        self.sent && !self.unread.contains(&true)
    }

    /// Whether what is left may wait for a later operation: a lazy root's frames have
    /// gone out, and it reads the others' then ([`Pending::deferred`]).
    pub(crate) fn may_defer(&self) -> bool {
        self.sent && self.lazy_root
    }

    /// The frames a lazy root left unread, to be verified by [`verify_deferred`] before
    /// this rank receives anything else; `None` when there are none.
    pub(crate) fn deferred(&self, o: &Op<'_>) -> Option<Deferred> {
        let unread: Vec<usize> = (0..self.unread.len()).filter(|&p| self.unread[p]).collect();
        (self.lazy_root && !unread.is_empty()).then_some(Deferred {
            ctx: o.ctx,
            count: o.count,
            unread,
        })
    }
}

/// Whether `this` call makes the same call as `last` (this rank's last rooted one): the same
/// operation and arguments, whatever the sequence number.
pub(crate) fn same_call(last: Option<&OpDesc>, this: &OpDesc) -> bool {
    let blank = |d: &OpDesc| OpDesc {
        rank: 0,
        seq: 0,
        step: None,
        ..*d
    };
    last.is_some_and(|l| blank(l) == blank(this))
}

/// Whether a broadcast or scatter runs without the fused agreement's frames: its call
/// repeats this rank's last rooted call (`repeat`, [`same_call`]), the group's roots are
/// lazy (`lazy_roots`, agreed when the group is built), and the root sends at most
/// [`SILENT_MAX_BYTES`] (`root_bytes`, which every rank that repeats computes alike). Then
/// no receiver sends the root a frame and the root expects none.
///
/// Why it is safe: every rank ran the last rooted call alike (or a disagreement in it is
/// already on its way to every rank). A rank that repeats it therefore disagrees with exactly
/// the ranks that do not, and those send their frames and expect theirs as usual; the
/// headers of the data a repeating receiver takes name the root and arguments of the rank
/// that sent them first. The frames a repeating receiver would have sent could only tell a
/// root that agrees, or one that does not repeat and so has other evidence on its way (a
/// non-repeating rank's frame, or the repeaters' data). What is given up: a repeating root
/// reads nothing, so it hears of a disagreement found elsewhere from the finder's abort
/// notice, at its next operation that receives, at the look it takes after every
/// [`LOOK_EVERY`] such operations, or at close, rather than by reading its receivers' frames
/// within [`MAX_DEFERRED`] operations.
///
/// Why: those frames were a 4-rank TCP broadcast's cost against Open MPI's (4 B: 12.0 us
/// with them, 6.8 without, Open MPI 7.5; docs/BENCHMARKS.md), and back-to-back broadcasts
/// from one root with one buffer (a training loop's) repeat every call after the first.
/// An eager root (`lazy_roots` false) keeps every frame: it promises to have read them.
pub(crate) fn repeats_silently(
    op: dist_wire::CollectiveOp,
    lazy_roots: bool,
    repeat: bool,
    root_bytes: usize,
) -> bool {
    use dist_wire::CollectiveOp::{Broadcast, Scatter};
    lazy_roots && repeat && root_bytes <= SILENT_MAX_BYTES && matches!(op, Broadcast | Scatter)
}

/// The most a root may send per operation and still run [`repeats_silently`]. Why a bound:
/// the frames it reads are also what keeps a lazy root within [`deferred_keep`] operations
/// of its receivers; without them it runs ahead as far as the sockets take, which costs the
/// receivers reads from memory rather than cache once the operations are large. 4 ranks over
/// TCP, broadcasts of 16 KiB: mean of the per-iteration maximum 58.8 us silent against 49.8
/// with frames (medians 17.9 and 19.6).
pub(crate) const SILENT_MAX_BYTES: usize = 4 << 10;

/// How many operations that only send, and run without the agreement's frames
/// ([`repeats_silently`]), a root runs between two looks at what its peers sent
/// (`Transport::look`, taken at the start of the next such operation): the bound on how late
/// it hears of a disagreement found elsewhere once the finder's notice has arrived. One look
/// costs a non-blocking read or two per peer.
pub(crate) const LOOK_EVERY: usize = MAX_DEFERRED;

/// The most rooted ops a lazy root may run ahead of its verification: past this many
/// deferred agreements, the older half of them is read (in one step where they are alike)
/// before the next operation starts. It bounds how late a root hears of a disagreement when
/// it only sends (back-to-back small broadcasts from one root), and the header-only frames
/// waiting in its sockets (32 of 64 bytes per receiver); any operation in which the root may
/// receive reads them all first. 32 rather than 8: 2 ranks over shared memory, back-to-back
/// broadcasts of 64 B took 0.8 us against 1.0-1.1 with 8 (1 KiB: 0.9-1.0 against 1.5; 4
/// ranks, 1 KiB: 1.1-1.3 against 1.6-1.8), as the root waits less often for its receivers'
/// newest frames.
pub(crate) const MAX_DEFERRED: usize = 32;

/// How much data a lazy root of back-to-back sends-only operations may send ahead of its
/// verification, at most: see [`deferred_keep`].
pub(crate) const RUN_AHEAD_BYTES: usize = 256 << 10;

/// The deferred operations a lazy root keeps queued while it only sends operations of `bytes`
/// each: [`MAX_DEFERRED`] − 1 for small ones, fewer from 16 KiB so that what it runs ahead
/// stays near [`RUN_AHEAD_BYTES`], at least 3. Why: a root 32 large broadcasts ahead of its
/// receivers leaves megabytes in the sockets, which they read back from memory, not cache.
/// 4 ranks over TCP, means of the per-iteration maximum over 4 runs (us), 3 against 31:
/// broadcast 64 KiB 80 against 110, 256 KiB 220 against 449, 1 MiB 911 against 1271; scatter
/// 256 KiB 242 against 281 (medians: 31 against 40, 157 against 149, 776 against 965, 206
/// against 255). Below 16 KiB the bound stays: there the queue's length, not its bytes, is
/// what the median sees (2 ranks over shared memory, 64 B: 0.9 against 1.1 with 3).
pub(crate) fn deferred_keep(bytes: usize) -> usize {
    (RUN_AHEAD_BYTES / bytes.max(1)).clamp(3, MAX_DEFERRED - 1)
}

/// A root's agreement frames left unread when its operation returned: the operation's own
/// context (every frame is judged against it) and the peers whose frames are still owed.
#[derive(Debug)]
pub(crate) struct Deferred {
    ctx: crate::transport::StepCtx,
    count: u64,
    unread: Vec<usize>,
}

impl Deferred {
    /// The operation's sequence number.
    pub(crate) fn seq(&self) -> u64 {
        self.ctx.seq
    }

    /// The timeout the operation was given, which its late verification gets again.
    pub(crate) fn timeout(&self) -> std::time::Duration {
        self.ctx
            .deadline
            .saturating_duration_since(self.ctx.started)
    }

    /// Whether `next`'s frames may be read in the same step as this one's
    /// ([`verify_deferred`]): the same operation, arguments and peers owed, a later sequence
    /// number. Back-to-back broadcasts of one buffer from one root all join.
    pub(crate) fn joins(&self, next: &Deferred) -> bool {
        let (a, b) = (&self.ctx, &next.ctx);
        b.seq > a.seq
            && (a.op, a.dtype, a.reduce, a.root, a.splits, a.reduce_arg)
                == (b.op, b.dtype, b.reduce, b.root, b.splits, b.reduce_arg)
            && a.args_in_payload == b.args_in_payload
            && self.count == next.count
            && self.unread == next.unread
    }
}

/// Reads the frames a lazy root left unread in `ds` (oldest first, each joining the first:
/// [`Deferred::joins`]), judged against the operation each belongs to, by `deadline` (the
/// operation now starting), all in one step. They are the first thing each peer sent in
/// their operations, so on each connection they come in the order of `ds`, before anything
/// of a later operation, and each peer's receives are listed in that order. A peer that
/// disagreed fails this read with [`Error::Mismatch`] naming both sides (the earlier
/// operation's arguments, so both roots); the step's failure sends the abort notices.
pub(crate) fn verify_deferred(
    t: &dyn crate::transport::Transport,
    ds: &[Deferred],
    deadline: std::time::Instant,
) -> Result<()> {
    let Some(first) = ds.first() else {
        return Ok(());
    };
    debug_assert!(ds.iter().all(|d| std::ptr::eq(d, first) || first.joins(d)));
    let mut ctx = first.ctx;
    ctx.deadline = deadline;
    let o = Op::new(t, ctx, first.count);
    // Index i holds peer `order[i]`'s frame of the operation `ahead[i]` after the first.
    let (order, ahead): (Vec<usize>, Vec<u64>) = ds
        .iter()
        .flat_map(|d| d.unread.iter().map(|&p| (p, d.ctx.seq - first.ctx.seq)))
        .unzip();
    let mut recvs: Vec<Incoming<'_>> = order
        .iter()
        .zip(&ahead)
        .map(|(&p, &seq_ahead)| Incoming {
            seq_ahead,
            ..o.recv(p, &mut [], FUSED_TAG)
        })
        .collect();
    let mut read = vec![false; order.len()];
    let res = o.t.exchange(&o.ctx, &[], &mut recvs, &mut |i, _, _| {
        read[i] = true;
        Ok(())
    });
    match res {
        Err(e @ Error::MismatchReported { .. }) => {
            // Each peer's first frame still unread (its frames come in the order listed).
            let mut next: Vec<Option<u64>> = vec![None; o.n()];
            for i in (0..order.len()).rev().filter(|&i| !read[i]) {
                next[order[i]] = Some(ahead[i]);
            }
            Err(first_hand_at(&o, &next).unwrap_or(e))
        }
        res => res,
    }
}

/// Runs `sends` and `recvs` as one step that also carries what is left of the agreement: a
/// receiver's header-only frame to the root (in the first step, ahead of anything else it
/// sends this operation) and, on the root, the frame of every peer the step receives from
/// (ahead of that peer's data: its frame is the first thing it sent) or sends to by a send
/// that may wait for it (which, disagreeing, might never take it: its frame says so). An
/// eager root reads the rest in the `last` step; a lazy one leaves them to a later operation.
/// Frame indices passed to `on_frame` are those of `recvs`.
pub(crate) fn fused_step(
    o: &Op<'_>,
    pending: &mut Pending,
    sends: &[Outgoing<'_>],
    recvs: &mut [Incoming<'_>],
    on_frame: &mut OnFrame<'_>,
    last: bool,
) -> Result<()> {
    let (n, r, root) = (o.n(), o.rank(), o.ctx.root as usize);
    let mut all_sends: Vec<Outgoing<'_>> = Vec::with_capacity(1 + sends.len());
    if !pending.sent {
        if r != root {
            all_sends.push(o.send(root, &[], FUSED_TAG));
        } else if pending.root_receives {
            all_sends.extend(
                (0..n)
                    .filter(|&p| p != r)
                    .map(|p| o.send(p, &[], crate::transport::ADVISORY_TAG)),
            );
        }
        pending.sent = true;
    }
    all_sends.extend(sends.iter().map(|s| Outgoing {
        peer: s.peer,
        data: s.data,
        count: s.count,
        tag: s.tag,
    }));
    // A lazy root waits only where its data waits anyway: for peers it receives from. A
    // send that waits for a receiver that disagrees and never takes it (a by-reference copy,
    // a full socket) ends by the other side's frames, which the wait judges as they come
    // (see `transport::stashed_conflict`), not by this frame.
    let lazy = pending.lazy_root;
    let agree_from: Vec<usize> = (0..n)
        .filter(|&p| {
            pending.unread[p]
                && ((last && !lazy)
                    || recvs.iter().any(|x| x.peer == p)
                    || (!lazy && sends.iter().any(|s| s.peer == p)))
        })
        .collect();
    let k = agree_from.len();
    let mut all_recvs: Vec<Incoming<'_>> = Vec::with_capacity(k + recvs.len());
    all_recvs.extend(agree_from.iter().map(|&p| o.recv(p, &mut [], FUSED_TAG)));
    all_recvs.extend(recvs.iter_mut().map(|x| Incoming {
        peer: x.peer,
        buf: &mut *x.buf,
        count: x.count,
        tag: x.tag,
        streamed: x.streamed,
        seq_ahead: 0,
    }));
    let res = o.t.exchange(
        &o.ctx,
        &all_sends,
        &mut all_recvs,
        &mut |i, range, bytes| {
            if i < k {
                pending.unread[agree_from[i]] = false;
                Ok(())
            } else {
                on_frame(i - k, range, bytes)
            }
        },
    );
    match res {
        Err(e @ Error::MismatchReported { .. }) if !pending.behind_deferred => {
            Err(first_hand(o, &pending.unread).unwrap_or(e))
        }
        res => res,
    }
}

/// After a disagreement learnt from another rank's abort notice: this rank's own, if a rank
/// whose agreement frame it had not read yet disagrees with it; a rank that can name the other
/// side itself says so rather than relay what it heard.
fn first_hand(o: &Op<'_>, unread: &[bool]) -> Option<Error> {
    let next: Vec<Option<u64>> = unread.iter().map(|&u| u.then_some(0)).collect();
    first_hand_at(o, &next)
}

/// [`first_hand`] where `next[p]`, when `Some(ahead)`, says peer p's next unread agreement
/// frame is of the operation `ahead` after `o`'s ([`Incoming::seq_ahead`]).
///
/// It judges only the frames already here (the failed step read what its connections held),
/// and waits for none: a rank that disagrees about the root sends its frame to the rank it
/// takes for the root, or none if it takes itself for it, and a rank that has read this
/// rank's abort notice says nothing more to it. Waiting for their frames ran to the deadline:
/// in a 3-rank reduce whose ranks 0 and 1 named root 0 and rank 2 root 1, rank 0 heard of the
/// disagreement from rank 1 at once and then waited 60 s for rank 2's frame.
fn first_hand_at(o: &Op<'_>, next: &[Option<u64>]) -> Option<Error> {
    let mut rest: Vec<Incoming<'_>> = (0..o.n())
        .filter_map(|p| next[p].map(|seq_ahead| (p, seq_ahead)))
        .map(|(p, seq_ahead)| Incoming {
            seq_ahead,
            ..o.recv(p, &mut [], FUSED_TAG)
        })
        .collect();
    // A deadline already past: the step delivers what is stashed, then fails.
    let mut ctx = o.ctx;
    ctx.deadline = std::time::Instant::now();
    match o.t.exchange(&ctx, &[], &mut rest, &mut |_, _, _| Ok(())) {
        Err(e @ Error::Mismatch { .. }) => Some(e),
        _ => None,
    }
}

/// One rank's arguments, ordered by the arguments first and the rank last.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Sig {
    root: u32,
    count: u64,
    dtype: u8,
    reduce: u8,
    splits: u32,
    reduce_arg: u32,
    rank: u32,
}

impl Sig {
    fn key(&self) -> (u32, u64, u8, u8, u32, u32) {
        (
            self.root,
            self.count,
            self.dtype,
            self.reduce,
            self.splits,
            self.reduce_arg,
        )
    }

    fn words(&self) -> [u64; 4] {
        [
            u64::from(self.root),
            self.count,
            u64::from(self.dtype) << 40 | u64::from(self.reduce) << 32 | u64::from(self.splits),
            u64::from(self.reduce_arg) << 32 | u64::from(self.rank),
        ]
    }

    /// The inverse of [`Sig::words`]; `None` for words no rank could have sent.
    fn from_words(w: &[u64]) -> Option<Sig> {
        let sig = Sig {
            root: u32::try_from(w[0]).ok()?,
            count: w[1],
            dtype: (w[2] >> 40) as u8,
            reduce: (w[2] >> 32) as u8,
            splits: w[2] as u32,
            reduce_arg: (w[3] >> 32) as u32,
            rank: w[3] as u32,
        };
        DType::from_code(sig.dtype)?;
        (w[2] >> 48 == 0 && w[3] >> 56 == 0).then_some(sig)
    }
}

impl Ord for Sig {
    fn cmp(&self, other: &Self) -> Ordering {
        (self.key(), self.rank).cmp(&(other.key(), other.rank))
    }
}

impl PartialOrd for Sig {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

/// Fails on every rank alike, with [`Error::Mismatch`] naming this rank and one that
/// disagrees, unless every rank passed the same root, count, dtype, reduce op and split sizes.
pub(crate) fn rooted_args(o: &Op<'_>) -> Result<()> {
    let (n, r) = (o.n(), o.rank());
    if n == 1 {
        return Ok(());
    }
    let ctx = &o.ctx;
    let me = Sig {
        root: ctx.root,
        count: o.count,
        dtype: ctx.dtype.code(),
        reduce: ctx.reduce,
        splits: ctx.splits,
        reduce_arg: ctx.reduce_arg,
        rank: r as u32,
    };
    let (mut lo, mut hi) = (me, me);
    // The frames carry this rank's real op, dtype and count (so that a rank running another
    // collective meets a header naming this one), but the receiver compares the arguments as
    // values, below, rather than fail on the first frame that differs.
    let mut step_ctx = *ctx;
    step_ctx.args_in_payload = true;
    let step = Op::new(o.t, step_ctx, o.count);
    let (mut dist, mut round) = (1, 0);
    while dist < n {
        let mut out = [0u64; 8];
        out[..4].copy_from_slice(&lo.words());
        out[4..].copy_from_slice(&hi.words());
        let mut got = [0u64; 8];
        let tag = tags::AGREE | round;
        step.step(
            &[step.send((r + dist) % n, bytemuck::cast_slice(&out), tag)],
            &mut [step.recv((r + n - dist) % n, bytemuck::cast_slice_mut(&mut got), tag)],
        )?;
        let (Some(their_lo), Some(their_hi)) =
            (Sig::from_words(&got[..4]), Sig::from_words(&got[4..]))
        else {
            return Err(Error::invalid(
                r,
                ctx.op.name(),
                format!(
                    "rank {} sent an argument agreement that no rank could have sent: {got:x?}",
                    (r + n - dist) % n
                ),
            ));
        };
        lo = lo.min(their_lo);
        hi = hi.max(their_hi);
        dist <<= 1;
        round += 1;
    }
    if lo.key() == hi.key() {
        return Ok(());
    }
    let other = if me.key() == lo.key() { hi } else { lo };
    Err(Error::Mismatch {
        ours: ctx.desc(o.count),
        theirs: OpDesc {
            rank: other.rank as usize,
            op: ctx.op,
            seq: ctx.seq,
            dtype: DType::from_code(other.dtype).unwrap_or(ctx.dtype),
            count: other.count,
            reduce: ctx.op.reduces().then_some(other.reduce),
            root: (other.root != NO_ROOT).then_some(other.root as usize),
            splits: other.splits,
            reduce_arg: other.reduce_arg,
            step: None,
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lazy_root_runs_32_small_operations_ahead_and_about_256_kib_of_large_ones() {
        for small in [0, 4, 1 << 10, 8 << 10] {
            assert_eq!(deferred_keep(small), MAX_DEFERRED - 1, "{small} bytes");
        }
        assert_eq!(deferred_keep(16 << 10), 16);
        assert_eq!(deferred_keep(64 << 10), 4);
        for large in [128 << 10, 256 << 10, 64 << 20, usize::MAX] {
            assert_eq!(deferred_keep(large), 3, "{large} bytes");
        }
    }

    #[test]
    fn signatures_round_trip_and_order_by_arguments_before_rank() {
        let a = Sig {
            root: 1,
            count: 100,
            dtype: DType::F32.code(),
            reduce: 3,
            splits: 0xdead_beef,
            reduce_arg: 0x00ab_cdef,
            rank: 7,
        };
        let mut w = [0u64; 4];
        w.copy_from_slice(&a.words());
        assert_eq!(Sig::from_words(&w), Some(a));
        let b = Sig {
            root: 0,
            rank: 9,
            ..a
        };
        assert!(b < a, "root 0 sorts first whatever the rank");
        let c = Sig { rank: 8, ..a };
        assert!(a < c && a.key() == c.key());
        // A dtype code no build has, or a scale fingerprint beyond 24 bits, is refused.
        let mut bad = w;
        bad[2] |= 0xff << 40;
        assert_eq!(Sig::from_words(&bad), None);
        bad = w;
        bad[3] |= 0xff << 56;
        assert_eq!(Sig::from_words(&bad), None);
    }
}
