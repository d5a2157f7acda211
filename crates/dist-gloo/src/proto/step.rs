//! The progress of one step: where each send and receive stands, and the first failure.

use std::ops::Range;
use std::time::Instant;

use dist_backend::Error;
use dist_wire::{CollectiveOp, HEADER_LEN, PAYLOAD_REF_LEN};

use crate::transport::{Incoming, Outgoing, StepCtx, frames};

/// Progress of one outgoing message.
#[derive(Debug, Clone)]
pub(super) struct Tx {
    pub(super) frame: usize,
    pub(super) hdr: [u8; HEADER_LEN],
    pub(super) hdr_done: usize,
    pub(super) payload_done: usize,
    /// Sent by reference: each frame's body is a [`dist_wire::PayloadRef`] to the data.
    pub(super) by_ref: bool,
    /// The body of the by-reference frame being written.
    pub(super) at: [u8; PAYLOAD_REF_LEN],
    /// Every frame is written.
    pub(super) written: bool,
    /// For a message sent by reference: the peer's acknowledgement count that covers it.
    pub(super) ack_at: u64,
    /// Written and, when sent by reference, acknowledged.
    pub(super) done: bool,
}

/// Progress of one incoming message.
#[derive(Debug, Clone)]
pub(super) struct Rx {
    pub(super) peer: usize,
    pub(super) got: usize,
    /// Payload length and bytes in of the frame being received.
    pub(super) cur: Option<(usize, usize)>,
    pub(super) first: bool,
    /// Some frame came by reference: the message is acknowledged once whole.
    pub(super) by_ref: bool,
    pub(super) done: bool,
}

/// What a step is waiting for, returned by [`crate::proto::Core::poll`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Status {
    /// More bytes must move; call again after the next input, or at `deadline` at the latest.
    Pending {
        /// When the step times out.
        deadline: Instant,
    },
    /// Every send is transmitted and every receive delivered: call
    /// [`crate::proto::Core::finish`].
    Done,
    /// The step failed: feed what the connections still hold, then call
    /// [`crate::proto::Core::finish`] for the error (and the abort notices it queues).
    Failed,
}

/// One step in progress (or, from [`Step::idle`], none). The messages themselves stay with the
/// caller, who passes the same `sends` and `recvs` to every call about this step.
#[derive(Debug)]
pub struct Step {
    pub(super) ctx: Option<StepCtx>,
    pub(super) seg: usize,
    /// The offer id this step's by-reference frames carry.
    pub(super) offer: u64,
    pub(super) tx: Vec<Tx>,
    pub(super) rx: Vec<Rx>,
    pub(super) failed: Option<Error>,
    pub(super) finished: bool,
    /// Scratch for [`Step::missing_into`], kept so that polling allocates nothing.
    pub(super) missing: Vec<usize>,
}

impl Step {
    /// No step: the state between steps, in which received frames are stashed and only
    /// control bytes are transmitted.
    pub fn idle() -> Self {
        Step {
            ctx: None,
            seg: 1,
            offer: 0,
            tx: Vec::new(),
            rx: Vec::new(),
            failed: None,
            finished: true,
            missing: Vec::new(),
        }
    }

    pub(super) fn new(
        ctx: StepCtx,
        seg: usize,
        sends: &[Outgoing<'_>],
        recvs: &[Incoming<'_>],
        offer: u64,
        by_ref: &dyn Fn(&Outgoing<'_>) -> bool,
    ) -> Self {
        let tx = |s: &Outgoing<'_>| Tx {
            frame: 0,
            hdr: [0; HEADER_LEN],
            hdr_done: 0,
            payload_done: 0,
            by_ref: !s.data.is_empty() && by_ref(s),
            at: [0; PAYLOAD_REF_LEN],
            written: false,
            ack_at: 0,
            done: false,
        };
        let rx = |r: &Incoming<'_>| Rx {
            peer: r.peer,
            got: 0,
            cur: None,
            first: true,
            by_ref: false,
            done: false,
        };
        Step {
            ctx: Some(ctx),
            seg,
            offer,
            tx: sends.iter().map(tx).collect(),
            rx: recvs.iter().map(rx).collect(),
            failed: None,
            finished: false,
            missing: Vec::with_capacity(sends.len() + recvs.len()),
        }
    }

    /// Whether the step failed (and [`crate::proto::Core::finish`] has not yet taken the
    /// error): a driver stops reading, so as not to drain peers blocked on this rank.
    pub fn has_failed(&self) -> bool {
        self.failed.is_some()
    }

    /// Whether a frame's payload from `peer` was coming straight into a receive buffer when
    /// the step stopped: reading on would skip the rest of it and parse what follows.
    pub(super) fn mid_payload_from(&self, peer: usize) -> bool {
        self.rx.iter().any(|r| r.peer == peer && r.cur.is_some())
    }

    /// The step's context while it still moves data.
    pub(super) fn live(&self) -> Option<&StepCtx> {
        self.ctx
            .as_ref()
            .filter(|_| !self.finished && self.failed.is_none())
    }

    /// Records `e` unless an earlier failure did.
    pub(super) fn fail(&mut self, e: Error) {
        if !self.finished && self.failed.is_none() {
            self.failed = Some(e);
        }
    }

    /// The message to `peer` now going out: messages to one peer go out whole, in list order
    /// (one sent by reference need not be acknowledged before the next starts).
    pub(super) fn current_send(&self, sends: &[Outgoing<'_>], peer: usize) -> Option<usize> {
        self.live()?;
        (0..sends.len()).find(|&i| sends[i].peer == peer && !self.tx[i].written)
    }

    /// The operation this step belongs to (`None` between steps).
    pub fn op(&self) -> Option<CollectiveOp> {
        self.ctx.as_ref().map(|c| c.op)
    }

    /// The length of the message now coming in from `peer`, if the step expects one.
    pub fn incoming_len(&self, recvs: &[Incoming<'_>], peer: usize) -> Option<usize> {
        self.current_recv(recvs, peer).map(|i| recvs[i].buf.len())
    }

    /// The message from `peer` now coming in: messages from one peer arrive in list order.
    pub(super) fn current_recv(&self, recvs: &[Incoming<'_>], peer: usize) -> Option<usize> {
        self.live()?;
        (0..recvs.len()).find(|&i| recvs[i].peer == peer && !self.rx[i].done)
    }

    /// The byte range of send `i`'s current frame.
    pub(super) fn frame_range(&self, sends: &[Outgoing<'_>], i: usize) -> Range<usize> {
        let len = sends[i].data.len();
        let f = self.tx[i].frame;
        (f * self.seg).min(len)..((f + 1) * self.seg).min(len)
    }

    /// Frames in send `i`.
    pub(super) fn frame_count(&self, sends: &[Outgoing<'_>], i: usize) -> usize {
        frames(sends[i].data.len(), self.seg).len()
    }

    /// Into `m` (its allocation reused), the peers this step still waits for: receives not
    /// delivered and sends not transmitted (or, by reference, not acknowledged).
    pub(super) fn missing_into(
        &self,
        sends: &[Outgoing<'_>],
        recvs: &[Incoming<'_>],
        m: &mut Vec<usize>,
    ) {
        m.clear();
        for (r, st) in recvs.iter().zip(&self.rx) {
            if !st.done {
                m.push(r.peer);
            }
        }
        for (s, st) in sends.iter().zip(&self.tx) {
            if !st.done {
                m.push(s.peer);
            }
        }
        m.sort_unstable();
        m.dedup();
    }
}
