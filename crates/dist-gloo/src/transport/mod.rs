//! The pair transport the algorithms are written against.
//!
//! An algorithm step is one call to [`Transport::exchange`]: a set of sends and receives, each
//! with one peer, all in flight at once. The transport cuts every send into frames of at most
//! [`Transport::segment_bytes`] bytes, each carrying a [`FrameHeader`], and calls the step's
//! `on_frame` callback as each received frame lands, so an algorithm can reduce segment `k`
//! while segment `k + 1` is still on the wire.
//!
//! Algorithms know nothing of sockets: [`tcp::TcpTransport`] runs them over a full TCP mesh and
//! [`mem::MemTransport`] over bounded in-memory byte pipes (for tests), both by driving the
//! sans-IO peer protocol in [`crate::proto`]; between ranks on one host the TCP mesh carries
//! its frames through shared-memory rings instead ([`shm`]).

use std::ops::Range;
use std::time::{Duration, Instant};

use dist_backend::{Error, OpDesc, Result};
use dist_wire::{CloseReason, CollectiveOp, DType, FrameHeader, NO_ROOT};

use crate::algo::tags;

pub mod mem;
pub mod shm;
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
    /// [`dist_wire::splits_fingerprint`] of the per-rank split sizes, 0 when none.
    pub splits: u32,
    /// [`dist_wire::ReduceOp::param_fingerprint`] of the reduce op (`PremulSum`'s scale), 0
    /// when none.
    pub reduce_arg: u32,
    /// The step exchanges the operation's arguments as values (see `algo::agree`), so that
    /// every rank, not only the pair whose frames disagree, can report a disagreement: the
    /// receiver checks only op, sequence number and step of its frames.
    pub args_in_payload: bool,
    /// This rank's last rooted operation before this one, if any: a frame of it that this
    /// rank never took (it returned before that frame came) is judged against it, so that the
    /// mismatch names both sides of the operation they disagreed on.
    pub last_rooted: Option<OpDesc>,
    /// The first operation of the unbroken run that ends with `last_rooted` and whose every
    /// operation made the same call (back-to-back broadcasts of one buffer from one root): a
    /// frame of any of them is judged against that call.
    pub last_rooted_from: u64,
    /// The operation may go on over messages after an exchange through the group area, on
    /// what every rank read there alike (an all_to_all some rank's input did not fit, or an
    /// operation some rank did not lend its input to, see `algo::alltoall` and `algo::lent`):
    /// the area's wait then keeps a frame of this very operation for the
    /// steps to come instead of taking it for a peer that runs the operation over messages.
    pub area_then_messages: bool,
    /// The earlier operations whose agreement frames this rank, a lazy root, has left unread
    /// (`algo::agree::Deferred`): a header-only frame of one of them that names this rank as
    /// the root is one it will read later, not a disagreement (`transport::stashed_conflict`).
    pub deferred: DeferredSeqs,
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
        Self::started_at(rank, group, op, seq, dtype, Instant::now(), timeout)
    }

    /// Context for an operation that started at `started` (a driver in virtual time passes
    /// its own clock's reading).
    pub fn started_at(
        rank: usize,
        group: u32,
        op: CollectiveOp,
        seq: u64,
        dtype: DType,
        started: Instant,
        timeout: Duration,
    ) -> Self {
        StepCtx {
            rank,
            group,
            op,
            seq,
            dtype,
            reduce: 0,
            root: NO_ROOT,
            splits: 0,
            reduce_arg: 0,
            args_in_payload: false,
            last_rooted: None,
            last_rooted_from: 0,
            area_then_messages: false,
            deferred: DeferredSeqs::default(),
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
            splits: self.splits,
            reduce_arg: self.reduce_arg,
        }
    }

    /// This rank's description of the operation, for mismatch errors.
    pub fn desc(&self, count: u64) -> OpDesc {
        OpDesc::from(&self.header(count, 0, 0, 0))
    }

    /// The two sides of a mismatch with `h`: this rank's view of the operation `h` belongs
    /// to when that is its last rooted one or of the run of same calls that ends with it
    /// ([`StepCtx::last_rooted_from`]), else of this one (with `count`).
    pub(crate) fn mismatch(&self, h: &FrameHeader, count: u64) -> Error {
        let ours = self
            .last_rooted
            .filter(|d| h.seq != self.seq && (self.last_rooted_from..=d.seq).contains(&h.seq))
            .map(|d| OpDesc { seq: h.seq, ..d })
            .unwrap_or_else(|| self.desc(count));
        Error::Mismatch {
            ours,
            theirs: OpDesc::from(h),
        }
    }

    /// The error for peers that had not delivered by the deadline.
    pub fn timeout(&self, missing_peers: Vec<usize>) -> Error {
        self.timeout_at(Instant::now(), missing_peers)
    }

    /// [`StepCtx::timeout`] as seen at `now` (the protocol core is given the time, it never
    /// reads a clock).
    pub fn timeout_at(&self, now: Instant, mut missing_peers: Vec<usize>) -> Error {
        missing_peers.sort_unstable();
        missing_peers.dedup();
        Error::Timeout {
            rank: self.rank,
            op: self.op,
            seq: self.seq,
            waited: now.saturating_duration_since(self.started),
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
    /// Where the bytes go: the whole message (its length is the exact message length), or,
    /// for a [`streamed`](Incoming::streamed) receive, the window its frames pass through.
    pub buf: &'a mut [u8],
    /// Element count the sender must announce.
    pub count: u64,
    /// Tag the sender must use.
    pub tag: u32,
    /// `Some(len)`: the message is `len` bytes and is never whole in memory. Each frame lands
    /// in `buf` at its offset modulo `buf.len()`, which must be a multiple of the segment
    /// size so that no frame wraps, and the step's [`OnFrame`] must be done with it when it
    /// returns. Why: a reduction that combines what it receives into memory of its own needs
    /// no scratch as large as the message, and a window stays in cache where a scratch of
    /// megabytes pushed the data out of it (2-rank all_reduce of 16 MiB: the data and one
    /// 8 MiB scratch per rank are 48 MiB against a 32 MiB L3).
    pub streamed: Option<usize>,
    /// How many operations after the step's own this message belongs to: its frames must
    /// carry sequence number `ctx.seq + seq_ahead` and are judged as that operation's, which
    /// is otherwise the step's. Why: a lazy root reads the agreement frames of several
    /// deferred broadcasts with the same arguments in one step (`algo::agree`), where one step
    /// each cost as much as the broadcast itself. 0 for every other receive.
    pub seq_ahead: u64,
}

impl Incoming<'_> {
    /// The message's length in bytes.
    pub fn message_len(&self) -> usize {
        self.streamed.unwrap_or(self.buf.len())
    }

    /// Where bytes `r` of the message land in [`Incoming::buf`]. For a streamed receive `r`
    /// must lie within one frame that [`Incoming::fits`] accepted.
    pub fn slot(&mut self, r: Range<usize>) -> &mut [u8] {
        if self.streamed.is_none() {
            return &mut self.buf[r];
        }
        if r.is_empty() {
            return &mut [];
        }
        let at = r.start % self.buf.len();
        &mut self.buf[at..at + r.len()]
    }

    /// Whether a frame of `n` bytes at message offset `at` lands in one piece of
    /// [`Incoming::buf`] (always, unless streamed through a window it would wrap).
    pub fn fits(&self, at: usize, n: usize) -> bool {
        let w = self.buf.len();
        self.streamed.is_none() || n == 0 || (w > 0 && n <= w - at % w)
    }
}

/// What a peer needs to read the bytes a rank lent ([`Transport::shared_memory_lend`]):
/// where they lie in the lender's memory, how many, and the offer id the lender publishes
/// while they stand. Three words, for the lender to publish in the group area.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LentWords {
    /// Address of the first byte, in the lender's memory.
    pub addr: u64,
    /// Bytes lent.
    pub len: u64,
    /// The offer id the lender publishes to every peer until it withdraws.
    pub offer: u64,
}

impl LentWords {
    /// The words as published: `[addr, len, offer]`, little-endian.
    pub fn to_le(self) -> [u64; 3] {
        [self.addr.to_le(), self.len.to_le(), self.offer.to_le()]
    }

    /// The words from `[addr, len, offer]` as published ([`LentWords::to_le`]).
    pub fn from_le(words: [u64; 3]) -> Self {
        let [addr, len, offer] = words.map(u64::from_le);
        Self { addr, len, offer }
    }
}

/// Bytes a rank lends its peers ([`Transport::shared_memory_lend`]): the words to publish,
/// and, held inside, the guard that withdraws the offer when this drops. It borrows the lent
/// bytes for as long as it lives: shared from [`Transport::shared_memory_lend`], so that they
/// cannot change while peers may read them; from [`Transport::shared_memory_lend_mut`] the
/// caller gets the bytes back to write, and its protocol keeps the peers off what it writes.
pub struct Lent<'a> {
    /// What a peer passes to [`Transport::shared_memory_read`].
    pub words: LentWords,
    /// Withdraws the offer when dropped.
    withdraw: Box<dyn std::any::Any + Send>,
    _bytes: std::marker::PhantomData<&'a [u8]>,
}

impl Lent<'_> {
    /// Bytes lent as `words`, withdrawn when `withdraw` drops; the caller's signature ties the
    /// lifetime to the bytes' borrow.
    pub(crate) fn new(words: LentWords, withdraw: Box<dyn std::any::Any + Send>) -> Self {
        Self {
            words,
            withdraw,
            _bytes: std::marker::PhantomData,
        }
    }
}

impl Lent<'_> {
    /// The guard alone, to be held by a `Lent` of another lifetime.
    pub(crate) fn into_guard(self) -> Box<dyn std::any::Any + Send> {
        self.withdraw
    }
}

impl std::fmt::Debug for Lent<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Lent").field("words", &self.words).finish()
    }
}

/// Called as each received frame lands: index of the [`Incoming`], the byte range of the frame
/// within its buffer, and those bytes, which the callback may rewrite in place (a reduction
/// that receives a peer's partial result where its own result goes combines it there, with
/// no copy).
pub type OnFrame<'f> = dyn FnMut(usize, Range<usize>, &mut [u8]) -> Result<()> + 'f;

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
    /// Tells every peer this rank is leaving cleanly (or, once aborted, delivers the abort
    /// notices still owed). Best effort.
    fn close(&self);
    /// Marks the group aborted by a failure found outside any step (ranks that disagree, found
    /// by comparing values): closing it then says no goodbye, which would tell the peers that
    /// this rank left cleanly. A failed step marks it by itself.
    fn abort(&self) {}
    /// Fails operation `ctx` with `e`, found outside any step (ranks that disagree, found by
    /// comparing what they published in shared memory), as a failed step would: the group is
    /// aborted, and where `e` blames another rank every peer is told whom and why, so that a
    /// rank that went on by messages and waits for this one fails at once. Returns the error
    /// to report.
    fn fail_with(&self, _ctx: &StepCtx, e: Error) -> Error {
        self.abort();
        e
    }
    /// Bytes a rank may publish in one [`Transport::shared_memory_exchange`]: 0 where the
    /// transport has no memory the whole group maps. Every rank of the group gets the same
    /// answer.
    fn shared_memory_bytes(&self) -> usize {
        0
    }
    /// Runs operation `ctx` through memory every rank of the group maps (where every pair of
    /// the group talks through shared-memory rings): this rank publishes `mine`, its parts one
    /// after the other (at most [`Transport::shared_memory_bytes`] in all), with its header,
    /// announcing `count`, and once every rank has published, `each(p, data)` gets every rank
    /// p's data in rank order, this rank's own included. No messages; the same errors as over
    /// messages (a peer lost or gone, an abort, the deadline naming the ranks that did not
    /// come, ranks that disagree about the operation or its arguments). `None` where the
    /// transport has no such memory or `mine` does not fit, and the caller runs the operation
    /// over messages instead.
    fn shared_memory_exchange(
        &self,
        _ctx: &StepCtx,
        _count: u64,
        _mine: &[&[u8]],
        _each: &mut dyn FnMut(usize, &[u8]) -> Result<()>,
    ) -> Option<Result<()>> {
        None
    }
    /// The first half of [`Transport::shared_memory_exchange`] alone: this rank publishes
    /// `mine` for operation `ctx` and arrives, waking the ranks asleep in the area, but does
    /// not wait for the others or read what they published. Returns whether it published
    /// (false where the transport has no such memory or `mine` does not fit).
    ///
    /// Only for an operation that then goes on by messages and receives a frame from every
    /// other rank: that frame, sent once its rank was done with the operation before, is what
    /// keeps this rank from writing over a slot another may still read (the area holds two
    /// operations per rank). The all_to_all's rank whose input is too large for the area
    /// announces its table of counts this way, so that the ranks waiting there learn at once
    /// to go on by messages, and a group whose every input is too large pays no wait.
    fn shared_memory_announce(&self, _ctx: &StepCtx, _count: u64, _mine: &[&[u8]]) -> bool {
        false
    }
    /// Hands `f` what rank `from` published in the group area for operation `ctx`, this
    /// rank's last there, where `from` has arrived at it; returns whether it did (false where
    /// the transport has no such memory, `from` has not arrived yet, or published for another
    /// operation).
    ///
    /// Only from within operation `ctx`, after this rank announced it
    /// ([`Transport::shared_memory_announce`]) and before it returns: `from` writes that slot
    /// again only two operations on, which it reaches only once this rank has arrived at the
    /// next one or sent it that one's frames. The all_to_all's ranks that went by messages
    /// read this way rank 0's choice for the next call, and rank 0 the others' times
    /// (`backend::area_pace`).
    fn shared_memory_peek(&self, _ctx: &StepCtx, _from: usize, _f: &mut dyn FnMut(&[u8])) -> bool {
        false
    }
    /// Lends `bytes` to every peer of the group for reading by reference
    /// ([`Transport::shared_memory_read`]) until the returned [`Lent`] drops. `None` where the
    /// transport has no group area or some peer cannot read this rank's memory. The caller
    /// publishes [`Lent::words`] in the area, and must not drop the `Lent` before every peer
    /// is done reading (a second operation through the area): a read that races with the
    /// withdrawal fails instead of copying bytes the caller may overwrite.
    fn shared_memory_lend<'a>(&self, _bytes: &'a [u8]) -> Option<Lent<'a>> {
        None
    }
    /// [`Transport::shared_memory_lend`] for a buffer this rank goes on writing while it is
    /// lent, given back with the [`Lent`] for as long as the borrow lasts. The caller's
    /// protocol must keep every peer's reads off the bytes this rank writes meanwhile (the
    /// all_reduce by reference writes only its own block while the peers read theirs, and
    /// theirs once every rank has arrived again): a peer's copy is another process's, so
    /// nothing here can make it wait.
    fn shared_memory_lend_mut<'a>(&self, _bytes: &'a mut [u8]) -> Option<(Lent<'a>, &'a mut [u8])> {
        None
    }
    /// Copies bytes `at..at + dst.len()` of what `peer` lent ([`Transport::shared_memory_lend`],
    /// its `words` as published) into `dst`. Fails with the peer lost where the read fails or
    /// the peer withdrew its offer meanwhile, or where the range lies outside what it lent.
    fn shared_memory_read(
        &self,
        ctx: &StepCtx,
        peer: usize,
        _words: LentWords,
        _at: usize,
        _dst: &mut [u8],
    ) -> Result<()> {
        Err(ctx.peer_lost(
            peer,
            "it lent a buffer by reference, which this transport cannot read",
        ))
    }
    /// Whether a point-to-point message from `peer` with `tag` has begun to arrive, or the peer
    /// is gone. Never blocks: reads ahead what has arrived from `peer` into the stash.
    fn probe(&self, peer: usize, tag: u32) -> bool;
    /// See [`dist_backend::Backend::arrival_waker`]: `None` (the default) where
    /// [`Transport::wait_for_arrival`] cannot sleep.
    fn arrival_waker(&self) -> Option<std::task::Waker> {
        None
    }
    /// See [`dist_backend::Backend::wait_for_arrival`]: returns at once where bytes were read
    /// from some peer's link since the last wait ended (this call reads every link first),
    /// else sleeps until one may have something new to read (or has ended), the arrival waker
    /// is woken, or `timeout` passes. Only transports with an [`Transport::arrival_waker`]
    /// are asked.
    fn wait_for_arrival(&self, timeout: Duration) {
        let _ = timeout;
    }
    /// Between steps, for a rank that expects nothing from anyone (a root that only sends,
    /// with no agreement frames owed: `algo::agree::repeats_silently`): reads what each peer
    /// has sent so far, without waiting, and fails as a step of operation `ctx` (announcing
    /// `count`) would on what that shows: a peer's abort notice, and any collective frame of
    /// this operation or an earlier one, which no step will take (`Core::look`). `run_from`:
    /// the first sequence number from which this rank's operations up to `ctx`'s were all
    /// `ctx`'s call, so that a mismatch with a frame of one of them names that call. A
    /// failure aborts the group and tells the peers, as a failed step does.
    fn look(&self, ctx: &StepCtx, count: u64, run_from: Option<u64>) -> Result<()>;
    /// Messages this rank has sent by reference, copied by the receiver straight out of this
    /// process's memory (0 for transports that never do).
    fn messages_by_reference(&self) -> u64 {
        self.messages_by_reference_per_peer().iter().sum()
    }
    /// The peers whose frames travel through shared memory rather than sockets (indexed by
    /// rank; all false for transports that never use it).
    fn shared_memory_peers(&self) -> Vec<bool> {
        vec![false; self.world_size()]
    }
    /// [`Transport::messages_by_reference`] split by the receiving peer (indexed by rank;
    /// all zero for transports that never send by reference).
    fn messages_by_reference_per_peer(&self) -> Vec<u64> {
        vec![0; self.world_size()]
    }
    /// Frames this rank copied by reference half on its own thread and half on a helper
    /// thread (0 for transports that never do).
    fn copies_split(&self) -> u64 {
        0
    }
    /// Whether every rank of the group published a shared-memory segment with one host id
    /// (some pairs may still talk over TCP), for the algorithm defaults that follow it; every
    /// rank of the group must get the same answer (false for transports that never use shared
    /// memory).
    fn one_host(&self) -> bool {
        false
    }
    /// Whether some two ranks of the group may share memory: talk through shared-memory rings
    /// (they published segments with one host id) or copy messages out of each other's memory
    /// (single copy), for the algorithm defaults that follow it; every rank of the group must
    /// get the same answer (false for transports that never share memory).
    fn memory_shared_in_group(&self) -> bool {
        false
    }
    /// Whether the whole group maps one shared-memory area ([`Transport::shared_memory_bytes`]
    /// is not 0) on a host whose online CPUs its ranks outnumber, so that ranks take turns on
    /// the cores and every wait for a peer costs a turn: the algorithms that need fewest
    /// waits then win (see `GlooOptions::auto_area_all_reduce_bytes`). Every rank of the group
    /// must get the same answer (false for transports without such an area).
    fn cores_shared(&self) -> bool {
        false
    }
    /// Operations this rank has run through the group's shared-memory area
    /// ([`Transport::shared_memory_exchange`]): for tests and diagnostics.
    fn shared_memory_exchanges(&self) -> u64 {
        0
    }
}

/// The tag of an advisory frame: a header-only frame of a collective that no step receives.
/// A rank judges one of the operation it is in as it judges any frame it does not wait for
/// ([`stashed_conflict`]), and drops it once that operation is over. A reduce's or gather's
/// root sends one to every other rank (`algo::agree`), so that two ranks that each take
/// themselves for the root, and each wait for the other's data, learn of it.
pub(crate) const ADVISORY_TAG: u32 = tags::AGREE | 0x4000;

/// Whether `h` is an advisory frame ([`ADVISORY_TAG`]).
pub(crate) fn is_advisory(h: &FrameHeader) -> bool {
    h.tag == ADVISORY_TAG && h.payload_len == 0 && h.op != CollectiveOp::SendRecv
}

/// Whether `h` is an advisory frame of an operation of this group before `ctx`'s: over, so
/// nothing judges it any more and it is dropped.
pub(crate) fn stale_advisory(ctx: &StepCtx, h: &FrameHeader) -> bool {
    is_advisory(h) && h.group == ctx.group && h.seq < ctx.seq
}

/// A set of sequence numbers, those of the operations whose agreement frames a lazy root
/// left unread ([`StepCtx::deferred`]): exact for up to 64 consecutive numbers from the first
/// one inserted, which is what a root's queue of deferred operations spans unless the caller
/// numbers its operations itself; beyond that, or inserted out of order, it answers "maybe",
/// which only excuses a stray frame as the check did before it knew the set.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DeferredSeqs {
    first: u64,
    mask: u64,
    loose: bool,
}

impl DeferredSeqs {
    /// Adds `seq`, the next deferred operation (in increasing order).
    pub fn insert(&mut self, seq: u64) {
        if self.mask == 0 && !self.loose {
            self.first = seq;
        }
        match seq.checked_sub(self.first) {
            Some(d) if d < 64 => self.mask |= 1 << d,
            _ => self.loose = true,
        }
    }

    /// Whether operation `seq` may be one whose frames are deferred.
    pub fn may_hold(&self, seq: u64) -> bool {
        self.loose
            || seq
                .checked_sub(self.first)
                .is_some_and(|d| d < 64 && self.mask >> d & 1 == 1)
    }
}

/// How a received header relates to what a step expects.
pub(crate) enum Verdict {
    /// The next frame of the expected message.
    Expected,
    /// A frame for another point-to-point tag, or a collective frame during point-to-point (or
    /// the reverse): keep it for a later step.
    Stash,
    /// A `Close` frame: the peer left the group, or aborted it (its payload says why).
    Closed,
}

/// Checks a received header against the step's expectation for `recv` after `got` bytes.
pub(crate) fn judge(
    ctx: &StepCtx,
    h: &FrameHeader,
    peer: usize,
    recv: &Incoming<'_>,
    got: usize,
) -> Result<Verdict> {
    let ahead;
    let ctx = if recv.seq_ahead == 0 {
        ctx
    } else {
        ahead = StepCtx {
            seq: ctx.seq + recv.seq_ahead,
            ..*ctx
        };
        &ahead
    };
    let (want_count, want_tag, len) = (recv.count, recv.tag, recv.message_len());
    if h.op == CollectiveOp::Close {
        return Ok(Verdict::Closed);
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
    // Every argument that must be the same on all ranks travels in the header; a step that
    // carries them as values instead compares them itself, on every rank.
    let same_args = ctx.args_in_payload
        || (h.dtype == ctx.dtype
            && h.count == want_count
            && h.reduce == ctx.reduce
            && h.root == ctx.root
            && h.splits == ctx.splits
            && h.reduce_arg == ctx.reduce_arg);
    if h.op != ctx.op || h.seq != ctx.seq || !same_args {
        return Err(ctx.mismatch(h, want_count));
    }
    // Same call, different algorithm: ranks whose settings choose differently (a backend
    // built with `GlooBackend::over` skips the group's agreement on them). A mismatch like
    // any other, so every rank hears of it through the abort notice.
    if h.tag != want_tag {
        return Err(Error::Mismatch {
            ours: OpDesc {
                step: Some(tags::step(want_tag)),
                ..ctx.desc(want_count)
            },
            theirs: OpDesc {
                step: Some(tags::step(h.tag)),
                ..theirs
            },
        });
    }
    // `got <= len`, so `len - got` cannot wrap, where `got + payload_len` could: a peer's
    // length near 2^64 wrapped past the check and sliced the buffer backwards.
    if h.offset != got as u64 || h.payload_len > len.saturating_sub(got) as u64 {
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
    if !recv.fits(got, h.payload_len as usize) {
        return Err(Error::invalid(
            ctx.rank,
            ctx.op.name(),
            format!(
                "{} receives from rank {peer} through a window of {} bytes, which {theirs}'s frame of {} bytes at offset {got} would wrap: do the ranks' segment sizes (DIST_GLOO_SEGMENT_BYTES) differ?",
                ctx.desc(want_count),
                recv.buf.len(),
                h.payload_len
            ),
        ));
    }
    Ok(Verdict::Expected)
}

/// The operation's element count as this step's messages carry it (for errors only): the
/// first receive's, else the first send's, else 0.
pub(crate) fn step_count(sends: &[Outgoing<'_>], recvs: &[Incoming<'_>]) -> u64 {
    recvs
        .first()
        .map(|r| r.count)
        .or_else(|| sends.first().map(|s| s.count))
        .unwrap_or(0)
}

/// Whether `h` belongs to a collective operation, numbered in its group: a peer sends such
/// frames of one group in nondecreasing sequence numbers (it runs the group's operations one
/// at a time, in order), which is what [`stashed_conflict`]'s callers may count on.
pub(crate) fn numbered(h: &FrameHeader) -> bool {
    numbered_op(h.op)
}

/// Whether `op` is a collective operation, numbered in its group (not point-to-point, not a
/// `Close`).
fn numbered_op(op: CollectiveOp) -> bool {
    op != CollectiveOp::SendRecv && op != CollectiveOp::Close
}

/// A frame `peer` sent in this very operation (same group and sequence number) that the
/// step does not wait for, judged as it arrives: `Some` when its operation or arguments
/// differ from this rank's. Why: a rank waits only on the peers its algorithm names, and
/// ranks that disagree about a rooted operation's root send to ranks that wait on someone
/// else (a rooted op's receivers send their agreement frame only to the root they believe
/// in), which would otherwise wait to the timeout with the disagreement in their stash.
/// Counts are not compared (they may differ between the messages of one operation); the
/// frames a step reads compare them. A frame of an earlier operation still unread is one
/// this rank never took (every frame of a collective is received in the operation that sends
/// it), so its sender disagreed with this rank about that operation, unless it is a
/// header-only frame naming this rank as the root of an operation whose agreement frames this
/// rank deferred ([`StepCtx::deferred`]). Excusing every such frame let a rank that another
/// took for a reduce's root, and that only sent, wait in its next operation with the
/// disagreement in its stash: 4 ranks over TCP repeating a reduce from root 0, then rank 3
/// naming root 1, waited in a cycle (0 on 2, 2 on 3, 3 on 0) while rank 1 held rank 3's
/// frame and excused it.
/// `count` is this rank's, for the error only.
pub(crate) fn stashed_conflict(ctx: &StepCtx, h: &FrameHeader, count: u64) -> Option<Error> {
    if !numbered(h) || !numbered_op(ctx.op) || ctx.args_in_payload || h.group != ctx.group {
        return None;
    }
    // No step takes an advisory frame: of an earlier operation, it is only stale.
    if stale_advisory(ctx, h) {
        return None;
    }
    let deferred_agreement =
        h.payload_len == 0 && h.root as usize == ctx.rank && ctx.deferred.may_hold(h.seq);
    let conflict = match h.seq.cmp(&ctx.seq) {
        std::cmp::Ordering::Less => !deferred_agreement,
        std::cmp::Ordering::Equal => {
            h.op != ctx.op
                || h.dtype != ctx.dtype
                || h.reduce != ctx.reduce
                || h.root != ctx.root
                || h.splits != ctx.splits
                || h.reduce_arg != ctx.reduce_arg
        }
        std::cmp::Ordering::Greater => false,
    };
    conflict.then(|| ctx.mismatch(h, count))
}

/// The error, at `now`, for a step that met `peer`'s `Close` frame giving `reason` (or whose
/// connection to `peer` was already closed for it).
pub(crate) fn closed_error_at(
    ctx: &StepCtx,
    now: Instant,
    peer: usize,
    reason: &CloseReason,
) -> Error {
    match *reason {
        CloseReason::Lost { culprit } if culprit as usize != ctx.rank => ctx.peer_lost(
            culprit as usize,
            format!("rank {peer} reported it lost and aborted the group"),
        ),
        // The peer lost its connection to this rank, which is alive: the fault is on its side.
        CloseReason::Lost { .. } => ctx.peer_lost(
            peer,
            "it aborted the group after losing its connection to this rank",
        ),
        // The peer timed out waiting for `culprit`: so does this operation, for the same rank.
        CloseReason::Stalled { culprit } if culprit as usize != ctx.rank => Error::Timeout {
            rank: ctx.rank,
            op: ctx.op,
            seq: ctx.seq,
            waited: now.saturating_duration_since(ctx.started),
            missing_peers: vec![culprit as usize],
        },
        CloseReason::Stalled { .. } => ctx.peer_lost(
            peer,
            "it timed out waiting for this rank and aborted the group",
        ),
        CloseReason::Mismatch { found, met, .. } => Error::MismatchReported {
            rank: ctx.rank,
            op: ctx.op,
            seq: ctx.seq,
            reporter: peer,
            found: notice_desc(&found),
            met: notice_desc(&met),
        },
        _ => ctx.peer_lost(
            peer,
            "it left the group (destroyed its process group) during this operation",
        ),
    }
}

/// After a peer's notice that it timed out waiting for this rank (or this rank's own timeout
/// once such a notice came): a timeout naming the ranks this step is itself still waiting for
/// (`pending`), the peers that gave up on it aside. Reported and passed on, it moves the blame
/// down the chain of waits towards the stalled rank instead of back up it. `gave_up(p)`: peer
/// `p` (of `peers`) aborted the group saying it timed out waiting for this rank.
pub(crate) fn stalled_on(
    ctx: &StepCtx,
    now: Instant,
    e: &Error,
    peers: usize,
    gave_up: impl Fn(usize) -> bool,
    pending: impl Iterator<Item = usize>,
) -> Option<Error> {
    let applies = match e {
        Error::PeerLost { peer, .. } => gave_up(*peer),
        Error::Timeout { .. } => (0..peers).any(&gave_up),
        _ => false,
    };
    if !applies {
        return None;
    }
    let missing: Vec<usize> = pending.filter(|&p| !gave_up(p)).collect();
    (!missing.is_empty()).then(|| ctx.timeout_at(now, missing))
}

/// What this rank tells its peers when a step fails with `e`: whom to blame and why. `None`
/// for failures that say nothing about another rank (a caller's mistake is local).
pub(crate) fn abort_reason(e: &Error) -> Option<CloseReason> {
    match e {
        // The rank it waited for, so that ranks waiting on this one (which now stops) name
        // the stalled rank rather than this one; passed on like the other causes.
        Error::Timeout {
            rank,
            missing_peers,
            ..
        } => missing_peers
            .iter()
            .find(|&&p| p != *rank)
            .map(|&p| CloseReason::Stalled { culprit: p as u32 }),
        Error::PeerLost { peer, .. } => Some(CloseReason::Lost {
            culprit: *peer as u32,
        }),
        Error::Mismatch { ours, theirs } => Some(CloseReason::Mismatch {
            culprit: theirs.rank as u32,
            found: desc_header(ours),
            met: desc_header(theirs),
        }),
        // Passed on, so that a peer the reporter could not reach still hears of it.
        Error::MismatchReported { found, met, .. } => Some(CloseReason::Mismatch {
            culprit: met.rank as u32,
            found: desc_header(found),
            met: desc_header(met),
        }),
        _ => None,
    }
}

/// One side of a mismatch notice: what `h` (written by [`desc_header`]) says.
fn notice_desc(h: &FrameHeader) -> OpDesc {
    OpDesc {
        step: (h.tag != 0).then(|| tags::step(h.tag)),
        ..OpDesc::from(h)
    }
}

/// A header saying what `d` says, for a mismatch notice (read back with [`notice_desc`]): its
/// `tag` is the algorithm step when the two sides differ in that (no step's tag is 0).
fn desc_header(d: &OpDesc) -> FrameHeader {
    FrameHeader {
        op: d.op,
        dtype: d.dtype,
        reduce: d.reduce.unwrap_or(0),
        group: 0,
        sender: d.rank as u32,
        seq: d.seq,
        count: d.count,
        root: d.root.map_or(NO_ROOT, |r| r as u32),
        tag: d.step.map_or(0, |s| s.tag),
        offset: 0,
        payload_len: 0,
        flags: 0,
        splits: d.splits,
        reduce_arg: d.reduce_arg,
    }
}

/// Frame boundaries of a message of `len` bytes cut into `seg`-byte frames (always at least one
/// frame, so even an empty message is checked by its receiver).
pub(crate) fn frames(len: usize, seg: usize) -> impl ExactSizeIterator<Item = Range<usize>> {
    let n = len.div_ceil(seg).max(1);
    (0..n).map(move |i| (i * seg).min(len)..((i + 1) * seg).min(len))
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use dist_backend::Error;
    use dist_wire::{CollectiveOp, DType};

    use super::{DeferredSeqs, StepCtx};

    #[test]
    fn a_frame_of_a_run_of_same_calls_is_judged_against_that_call() {
        let ctx_at = |rank: usize, seq: u64, root: u32| {
            let mut c = StepCtx::new(
                rank,
                7,
                CollectiveOp::Broadcast,
                seq,
                DType::F32,
                Duration::from_secs(1),
            );
            c.root = root;
            c
        };
        // This rank ran broadcasts 2 to 5 from root 0 alike and is now in #6, from root 2;
        // rank 3 took rank 1 for the root.
        let mut now = ctx_at(1, 6, 2);
        now.last_rooted = Some(ctx_at(1, 5, 0).desc(16));
        now.last_rooted_from = 2;
        let ours = |seq: u64| match now.mismatch(&ctx_at(3, seq, 1).header(16, 1, 0, 0), 16) {
            Error::Mismatch { ours, theirs } => {
                assert_eq!((theirs.rank, theirs.seq, theirs.root), (3, seq, Some(1)));
                (ours.seq, ours.root)
            }
            other => panic!("{other}"),
        };
        for seq in 2..=5 {
            assert_eq!(ours(seq), (seq, Some(0)), "#{seq} is in the run");
        }
        for seq in [1, 6] {
            assert_eq!(ours(seq), (6, Some(2)), "#{seq} is not: this operation");
        }
    }

    #[test]
    fn deferred_seqs_are_exact_within_64_of_the_first_and_maybe_beyond() {
        let mut s = DeferredSeqs::default();
        assert!(!s.may_hold(0) && !s.may_hold(7), "empty");
        for seq in [10, 11, 13, 73] {
            s.insert(seq);
        }
        for seq in [10, 11, 13, 73] {
            assert!(s.may_hold(seq), "{seq} was inserted");
        }
        for seq in [0, 9, 12, 14, 72, 74, u64::MAX] {
            assert!(!s.may_hold(seq), "{seq} was not");
        }
        // Past the window: no longer told apart, every number may be held.
        s.insert(74);
        assert!(s.may_hold(74) && s.may_hold(12) && s.may_hold(1000));
        // Out of order: likewise.
        let mut s = DeferredSeqs::default();
        s.insert(5);
        s.insert(4);
        assert!(s.may_hold(4) && s.may_hold(6));
    }
}
