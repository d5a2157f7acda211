//! What the core knows of one peer connection: the bytes received and not yet parsed, the
//! frames that arrived before the step that wants them, what the peer said about leaving, and
//! the control bytes (goodbyes, abort notices) owed to it.

use std::collections::VecDeque;

use dist_backend::Error;
use dist_wire::{CloseReason, CollectiveOp, FrameHeader, HEADER_LEN, PAYLOAD_REF_LEN, PayloadRef};

use crate::transport::{StepCtx, numbered, stashed_conflict};

/// Receive staging size: headers and small frames are parsed out of it, many per read.
pub(super) const STAGING: usize = 64 << 10;
/// Largest frame kept in the stash; a bigger length is taken as corruption, not allocated.
pub(super) const MAX_STASHED_FRAME: u64 = 256 << 20;

/// What is known of the peer's side of the connection. The first thing learnt sticks: a peer
/// that aborted and then exited is remembered for its abort notice, not for the EOF after it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PeerState {
    /// Connected.
    Open,
    /// Sent `Close`: left the group cleanly.
    Left,
    /// The connection ended without `Close`, broke, or carried bytes that are not frames.
    Lost(String),
    /// The peer aborted the group and said why in its `Close` (never
    /// [`CloseReason::Goodbye`]).
    Aborted(CloseReason),
}

/// The payload of a stashed frame.
#[derive(Debug)]
pub(super) enum Payload {
    /// The bytes, as read.
    Inline(Vec<u8>),
    /// Where the bytes lie in the sender's memory (a [`FrameHeader::REMOTE`] frame): copied
    /// by the driver's [`super::CopyIn`] once a receive wants them.
    Remote(PayloadRef),
}

/// Where the bytes of the driver's next read go (decided by `read_buf`, honoured by
/// `received`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Target {
    /// Straight into the payload of the frame the step's receive `i` is reading.
    Direct(usize),
    /// Into the payload of the stashed frame being read.
    Partial,
    /// Into the staging buffer.
    Stage,
    /// Nowhere: the peer said `Close`, or the connection ended; later bytes are dropped.
    Discard,
}

/// One peer connection's protocol state.
#[derive(Debug)]
pub(super) struct Conn {
    pub(super) stage: Box<[u8]>,
    pub(super) start: usize,
    pub(super) end: usize,
    /// A stashed frame still being read: its header, its payload buffer and how much is in.
    pub(super) partial: Option<(FrameHeader, Vec<u8>, usize)>,
    /// Payload bytes of a frame a failed step was reading, to be dropped.
    pub(super) skip: usize,
    pub(super) stash: VecDeque<(FrameHeader, Payload)>,
    /// The collective frames stashed (`stash`, then `partial`) are of one group and in
    /// nondecreasing sequence numbers, as a peer sends them: a scan for frames of operations
    /// up to the current one may stop at the first of a later one. A root running ahead
    /// leaves thousands of its later operations' frames in its receivers' stashes, and a scan
    /// of them all on every poll took a quarter of a 4-rank broadcast's receivers' time.
    pub(super) stash_in_order: bool,
    /// The group and sequence number of the last collective frame stashed, while any is.
    pub(super) last_stashed: Option<(u32, u64)>,
    /// How many of the stashed frames are advisory (`transport::ADVISORY_TAG`), at most.
    pub(super) advisories: usize,
    pub(super) state: PeerState,
    /// Messages this rank sent by reference on this connection, and how many of them the
    /// peer acknowledged (acknowledgements arrive in order).
    pub(super) offered: u64,
    pub(super) acked: u64,
    /// A copy by reference from the peer failed, for this reason: its offer was withdrawn
    /// (it gave up on the step) or its memory is gone. Nothing more is delivered from it; the
    /// stream is still read, since the peer's abort notice, which says whom to blame, follows
    /// on it, or the end of the stream does.
    pub(super) suspect: Option<String>,
    /// A `Close` frame was read or the input ended: nothing more is parsed.
    pub(super) input_done: bool,
    /// The peer aborted the group and no step has failed on it yet.
    pub(super) unreported_abort: bool,
    /// Control bytes owed to the peer (goodbye, abort notice), and how much of them is out.
    pub(super) ctl: Vec<u8>,
    pub(super) ctl_done: usize,
    /// A data frame is half transmitted: nothing else may start on the stream.
    pub(super) mid_frame: bool,
    /// An abort notice was queued: a driver closing the connection must deliver it first.
    pub(super) notified: bool,
    pub(super) target: Target,
    /// Staging reads stop at the end of the next header (see `Core::set_exact_reads`).
    pub(super) exact: bool,
}

impl Conn {
    /// The headers of every frame stashed, the one still being read included.
    pub(super) fn stashed_headers(&self) -> impl Iterator<Item = &FrameHeader> {
        let partial = self.partial.as_ref().map(|(h, _, _)| h);
        self.stash.iter().map(|(h, _)| h).chain(partial)
    }

    /// Notes that `h` is about to enter the stash (pushed, or begun as `partial`), keeping
    /// [`Conn::stash_in_order`]: an empty stash starts afresh.
    pub(super) fn note_stashed(&mut self, h: &FrameHeader) {
        if !numbered(h) {
            return;
        }
        if self.stash.is_empty() && self.partial.is_none() {
            self.stash_in_order = true;
            self.last_stashed = None;
        }
        if let Some((group, seq)) = self.last_stashed
            && (group != h.group || h.seq < seq)
        {
            self.stash_in_order = false;
        }
        self.last_stashed = Some((h.group, h.seq));
    }

    /// Stashes a whole frame (header `h`, `payload`) as it arrives.
    pub(super) fn push_stashed(&mut self, h: FrameHeader, payload: Payload) {
        self.note_stashed(&h);
        self.stash.push_back((h, payload));
    }

    /// The first stashed frame that shows this rank's operation `ctx` disagreeing with the
    /// peer ([`stashed_conflict`]; `count` is this rank's, for the error). Frames of later
    /// operations cannot: where the stash is in order, the scan ends at the first of them.
    pub(super) fn first_disagreement(&self, ctx: &StepCtx, count: u64) -> Option<Error> {
        for h in self.stashed_headers() {
            if let Some(e) = stashed_conflict(ctx, h, count) {
                return Some(e);
            }
            if self.stash_in_order && numbered(h) && h.group == ctx.group && h.seq > ctx.seq {
                return None;
            }
        }
        None
    }

    pub(super) fn new() -> Self {
        Conn {
            stage: vec![0u8; STAGING].into_boxed_slice(),
            start: 0,
            end: 0,
            partial: None,
            skip: 0,
            stash: VecDeque::new(),
            stash_in_order: true,
            last_stashed: None,
            advisories: 0,
            state: PeerState::Open,
            offered: 0,
            acked: 0,
            suspect: None,
            input_done: false,
            unreported_abort: false,
            ctl: Vec::new(),
            ctl_done: 0,
            mid_frame: false,
            notified: false,
            target: Target::Stage,
            exact: false,
        }
    }

    pub(super) fn staged(&self) -> usize {
        self.end - self.start
    }

    /// Bytes read ahead of the step that wants them: stashed payloads, the stashed frame
    /// still being read, and what is staged. A payload sent by reference counts nothing: it
    /// stays in the sender's memory until a receive copies it.
    pub(super) fn read_ahead_bytes(&self) -> usize {
        let stashed: usize = self
            .stash
            .iter()
            .map(|(_, p)| match p {
                Payload::Inline(bytes) => bytes.len(),
                Payload::Remote(_) => 0,
            })
            .sum();
        stashed + self.partial.as_ref().map_or(0, |(_, buf, _)| buf.len()) + self.staged()
    }

    /// How many more bytes the staging buffer needs before the parser can take its next
    /// step: the rest of a skipped payload, of a header, or of a close frame or reference that
    /// is read whole with its header. At least 1.
    pub(super) fn unit_rest(&self) -> usize {
        let staged = self.staged();
        if self.skip > 0 {
            return self.skip.saturating_sub(staged).max(1);
        }
        if staged < HEADER_LEN {
            return HEADER_LEN - staged;
        }
        let unit = match FrameHeader::decode(&self.stage[self.start..self.end]) {
            Ok(h) if h.op == CollectiveOp::Close => HEADER_LEN + h.payload_len as usize,
            Ok(h) if h.flags & FrameHeader::REMOTE != 0 => HEADER_LEN + PAYLOAD_REF_LEN,
            _ => HEADER_LEN,
        };
        unit.saturating_sub(staged).max(1)
    }

    /// Moves the staged bytes to the front, so that the free end of the staging buffer is
    /// never empty while the staged bytes are fewer than [`STAGING`].
    pub(super) fn compact(&mut self) {
        if self.start > 0 {
            self.stage.copy_within(self.start..self.end, 0);
            self.end -= self.start;
            self.start = 0;
        }
    }

    /// Notes the reason of the peer's `Close` frame, unless something was learnt before.
    pub(super) fn closed(&mut self, reason: CloseReason) {
        self.input_done = true;
        if self.state == PeerState::Open {
            self.state = match reason {
                CloseReason::Goodbye => PeerState::Left,
                other => {
                    self.unreported_abort = true;
                    PeerState::Aborted(other)
                }
            };
        }
    }

    /// Notes that the connection is unusable for `why`, unless something was learnt before.
    pub(super) fn lose(&mut self, why: String) {
        self.input_done = true;
        if self.state == PeerState::Open {
            self.state = PeerState::Lost(why);
        }
    }

    /// Queues the acknowledgement of a message received by reference (`h` is its last frame),
    /// after the control bytes already queued.
    pub(super) fn queue_ack(&mut self, h: &FrameHeader) {
        let ack = FrameHeader {
            flags: FrameHeader::ACK,
            payload_len: 0,
            ..*h
        };
        self.ctl.extend_from_slice(&ack.encode());
    }

    /// Control bytes still to write.
    pub(super) fn ctl_pending(&self) -> &[u8] {
        &self.ctl[self.ctl_done..]
    }

    /// Marks `n` control bytes written.
    pub(super) fn ctl_written(&mut self, n: usize) {
        self.ctl_done += n;
        if self.ctl_done >= self.ctl.len() {
            self.ctl.clear();
            self.ctl_done = 0;
        }
    }

    /// Queues an abort notice after `rest` (the unwritten remainder of a data frame this rank
    /// was in the middle of sending: a frame cut short would make the peer read the notice as
    /// payload) and after the control bytes already queued, in wire order.
    pub(super) fn queue_notice(&mut self, rest: &[u8], notice: &[u8]) {
        // Control bytes and data frames exclude each other on the stream: when a frame is half
        // out no control byte has started, so the rest goes first.
        let mut out = Vec::with_capacity(rest.len() + self.ctl_pending().len() + notice.len());
        out.extend_from_slice(rest);
        out.extend_from_slice(self.ctl_pending());
        out.extend_from_slice(notice);
        self.ctl = out;
        self.ctl_done = 0;
        self.mid_frame = false;
        self.notified = true;
    }
}
