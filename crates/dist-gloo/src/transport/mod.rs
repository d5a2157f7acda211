//! The pair transport the algorithms are written against.
//!
//! An algorithm step is one call to [`Transport::exchange`]: a set of sends and receives, each
//! with one peer, all in flight at once. The transport cuts every send into frames of at most
//! [`Transport::segment_bytes`] bytes, each carrying a [`FrameHeader`], and calls the step's
//! `on_frame` callback as each received frame lands, so an algorithm can reduce segment `k`
//! while segment `k + 1` is still on the wire.
//!
//! Algorithms know nothing of sockets: [`tcp::TcpTransport`] runs them over a full TCP mesh and
//! [`mem::MemTransport`] over in-process channels (for tests); a shared-memory transport can be
//! added without touching them.

use std::ops::Range;
use std::time::{Duration, Instant};

use dist_backend::{Error, OpDesc, Result};
use dist_wire::{CollectiveOp, DType, FrameHeader, NO_ROOT};

pub mod mem;
pub mod tcp;

/// Frames per segment: Gloo's `kMaxSegmentSize`.
pub const DEFAULT_SEGMENT_BYTES: usize = 1 << 20;

/// What every frame of one step carries, and how long the step may take.
#[derive(Clone, Copy, Debug)]
pub struct StepCtx {
    /// This rank.
    pub rank: usize,
    /// Group id (a hash of the group's store prefix).
    pub group: u32,
    /// The operation.
    pub op: CollectiveOp,
    /// Its sequence number in the group (for point-to-point: 0).
    pub seq: u64,
    /// Element type.
    pub dtype: DType,
    /// Reduce op wire code, 0 when the op does not reduce.
    pub reduce: u8,
    /// Root or peer, [`NO_ROOT`] when none.
    pub root: u32,
    /// When the whole operation started (for `Timeout::waited`).
    pub started: Instant,
    /// When the whole operation must be done.
    pub deadline: Instant,
}

impl StepCtx {
    /// Context for an operation that starts now.
    pub fn new(
        rank: usize,
        group: u32,
        op: CollectiveOp,
        seq: u64,
        dtype: DType,
        timeout: Duration,
    ) -> Self {
        let started = Instant::now();
        StepCtx {
            rank,
            group,
            op,
            seq,
            dtype,
            reduce: 0,
            root: NO_ROOT,
            started,
            deadline: dist_backend::deadline_after(started, timeout),
        }
    }

    /// The header of the frame at `offset` of a message with `count` and `tag`.
    pub fn header(&self, count: u64, tag: u32, offset: usize, payload_len: usize) -> FrameHeader {
        FrameHeader {
            op: self.op,
            dtype: self.dtype,
            reduce: self.reduce,
            group: self.group,
            sender: self.rank as u32,
            seq: self.seq,
            count,
            root: self.root,
            tag,
            offset: offset as u64,
            payload_len: payload_len as u64,
            flags: 0,
        }
    }

    /// This rank's description of the operation, for mismatch errors.
    pub fn desc(&self, count: u64) -> OpDesc {
        OpDesc {
            rank: self.rank,
            op: self.op,
            seq: self.seq,
            dtype: self.dtype,
            count,
        }
    }

    /// The error for peers that had not delivered by the deadline.
    pub fn timeout(&self, mut missing_peers: Vec<usize>) -> Error {
        missing_peers.sort_unstable();
        missing_peers.dedup();
        Error::Timeout {
            rank: self.rank,
            op: self.op,
            seq: self.seq,
            waited: self.started.elapsed(),
            missing_peers,
        }
    }

    /// The error for a peer whose connection is gone.
    pub fn peer_lost(&self, peer: usize, reason: impl Into<String>) -> Error {
        Error::PeerLost {
            rank: self.rank,
            peer,
            op: self.op,
            seq: self.seq,
            reason: reason.into(),
        }
    }
}

/// One message to send in a step.
#[derive(Debug)]
pub struct Outgoing<'a> {
    /// Destination rank.
    pub peer: usize,
    /// The bytes.
    pub data: &'a [u8],
    /// Element count the receiver must expect (checked on arrival).
    pub count: u64,
    /// Tag: the user tag for point-to-point, the algorithm's step label for collectives.
    pub tag: u32,
}

/// One message to receive in a step.
#[derive(Debug)]
pub struct Incoming<'a> {
    /// Source rank.
    pub peer: usize,
    /// Where the bytes go; its length is the exact message length.
    pub buf: &'a mut [u8],
    /// Element count the sender must announce.
    pub count: u64,
    /// Tag the sender must use.
    pub tag: u32,
}

/// Called as each received frame lands: index of the [`Incoming`], the byte range of the frame
/// within its buffer, and those bytes.
pub type OnFrame<'f> = dyn FnMut(usize, Range<usize>, &[u8]) -> Result<()> + 'f;

/// A transport between the ranks of one group.
pub trait Transport: Send + Sync {
    /// This rank.
    fn rank(&self) -> usize;
    /// Ranks in the group.
    fn world_size(&self) -> usize;
    /// Largest payload of one frame.
    fn segment_bytes(&self) -> usize;
    /// Runs one step: every send and receive in flight at once, `on_frame` called for each
    /// received frame, returning when all are done or on the first error. Several messages
    /// to (or from) one peer go out (or are received) whole, in list order.
    fn exchange(
        &self,
        ctx: &StepCtx,
        sends: &[Outgoing<'_>],
        recvs: &mut [Incoming<'_>],
        on_frame: &mut OnFrame<'_>,
    ) -> Result<()>;
    /// Tells every peer this rank is leaving cleanly. Best effort.
    fn close(&self);
    /// Whether a point-to-point message from `peer` with `tag` has begun to arrive, or the peer
    /// is gone. Never blocks: reads ahead what has arrived from `peer` into the stash.
    fn probe(&self, peer: usize, tag: u32) -> bool;
    /// Messages this rank has sent by reference, copied by the receiver straight out of this
    /// process's memory (0 for transports that never do).
    fn messages_by_reference(&self) -> u64 {
        0
    }
}

/// How a received header relates to what a step expects.
pub(crate) enum Verdict {
    /// The next frame of the expected message.
    Expected,
    /// A frame for another point-to-point tag, or a collective frame during point-to-point (or
    /// the reverse): keep it for a later step.
    Stash,
    /// The peer left the group: cleanly (tag 0), or aborting after it lost rank `tag - 1`.
    Closed(u32),
}

/// Checks a received header against the step's expectation for `recv` after `got` bytes.
pub(crate) fn judge(
    ctx: &StepCtx,
    h: &FrameHeader,
    peer: usize,
    want_count: u64,
    want_tag: u32,
    got: usize,
    len: usize,
) -> Result<Verdict> {
    if h.op == CollectiveOp::Close {
        return Ok(Verdict::Closed(h.tag));
    }
    let p2p = ctx.op == CollectiveOp::SendRecv;
    if (h.op == CollectiveOp::SendRecv) != p2p || (p2p && h.tag != want_tag) {
        return Ok(Verdict::Stash);
    }
    let theirs = OpDesc::from(h);
    if h.sender as usize != peer || h.group != ctx.group {
        return Err(Error::invalid(
            ctx.rank,
            ctx.op.name(),
            format!(
                "frame from rank {peer} claims to be {theirs} of group {:#x} (expected group {:#x}): crossed connections",
                h.group, ctx.group
            ),
        ));
    }
    if h.op != ctx.op
        || h.seq != ctx.seq
        || h.dtype != ctx.dtype
        || h.count != want_count
        || h.tag != want_tag
        || h.reduce != ctx.reduce
        || h.root != ctx.root
    {
        let ours = ctx.desc(want_count);
        if h.op == ctx.op && h.seq == ctx.seq && h.dtype == ctx.dtype && h.count == want_count {
            // Same op and shape: the difference is in the reduce op, root or algorithm step.
            return Err(Error::invalid(
                ctx.rank,
                ctx.op.name(),
                format!(
                    "{ours} (reduce op {}, root {}, step {want_tag:#x}) met {theirs} (reduce op {}, root {}, step {:#x}): the ranks disagree on arguments",
                    ctx.reduce, ctx.root as i64, h.reduce, h.root as i64, h.tag
                ),
            ));
        }
        return Err(Error::Mismatch { ours, theirs });
    }
    let end = got as u64 + h.payload_len;
    if h.offset != got as u64 || end > len as u64 {
        return Err(Error::invalid(
            ctx.rank,
            ctx.op.name(),
            format!(
                "{} expected {len} bytes from rank {peer}; {theirs} sent a frame at offset {} of {} bytes (received so far: {got})",
                ctx.desc(want_count),
                h.offset,
                h.payload_len
            ),
        ));
    }
    Ok(Verdict::Expected)
}

/// Frame boundaries of a message of `len` bytes cut into `seg`-byte frames (always at least one
/// frame, so even an empty message is checked by its receiver).
pub(crate) fn frames(len: usize, seg: usize) -> impl ExactSizeIterator<Item = Range<usize>> {
    let n = len.div_ceil(seg).max(1);
    (0..n).map(move |i| (i * seg).min(len)..((i + 1) * seg).min(len))
}
