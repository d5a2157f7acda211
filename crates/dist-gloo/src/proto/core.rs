//! [`Core`]: one rank's side of the peer protocol, over all its connections.

use std::time::Instant;

use dist_backend::{Error, Result};
use dist_wire::{CloseReason, CollectiveOp, FrameHeader, HEADER_LEN, PAYLOAD_REF_LEN, PayloadRef};

use super::CopyIn;
use super::conn::{Conn, PeerState, STAGING, Target};
use super::parse::process;
use super::step::{Status, Step};
use crate::transport::{
    Incoming, OnFrame, Outgoing, StepCtx, abort_reason, closed_error_at, is_advisory,
    stale_advisory, stalled_on, step_count,
};

/// How many bytes a connection may hold read ahead of the steps that want them before a
/// driver stops reading it ahead ([`Core::reads_ahead`]): a few frames of the default segment,
/// and about what a loopback TCP socket buffers on its own.
pub const READ_AHEAD_BYTES: usize = 4 << 20;

/// One rank's protocol state with each of its peers: no sockets, threads or clocks.
///
/// A driver owns the byte streams. For each connection it asks [`Core::transmit`] what to
/// write and reports [`Core::transmitted`]; it reads into [`Core::read_buf`] and reports
/// [`Core::received`]; it reports the end of the input ([`Core::eof`]) and errors
/// ([`Core::broken`], after feeding whatever the connection still held, which may say why the
/// peer left). After any input it calls [`Core::poll`], and once that says the step is done
/// or failed, [`Core::finish`], which returns the step's result and queues the abort notices
/// that name the culprit to the other peers. It reads the peers a step awaits
/// ([`Core::awaits`]), and the others while [`Core::reads_ahead`] allows.
#[derive(Debug)]
pub struct Core {
    rank: usize,
    seg: usize,
    /// Indexed by peer rank; `None` at this rank and once disconnected.
    conns: Vec<Option<Conn>>,
    /// A step failed (or the group was aborted from outside): closing says no goodbye.
    aborted: bool,
    /// Copies frames peers send by reference; `None` refuses them.
    copier: Option<Box<dyn CopyIn>>,
}

impl Core {
    /// The core of `rank` in a group of `world_size`, cutting messages into `segment`-byte
    /// frames (rounded down to a multiple of 8, at least 8).
    pub fn new(rank: usize, world_size: usize, segment: usize) -> Self {
        Core {
            rank,
            seg: segment.max(8) / 8 * 8,
            conns: (0..world_size)
                .map(|p| (p != rank).then(Conn::new))
                .collect(),
            aborted: false,
            copier: None,
        }
    }

    /// Accepts frames sent by reference from now on, copying them with `copier`.
    pub fn set_copier(&mut self, copier: Box<dyn CopyIn>) {
        self.copier = Some(copier);
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Ranks in the group.
    pub fn world_size(&self) -> usize {
        self.conns.len()
    }

    /// Largest payload of one frame.
    pub fn segment_bytes(&self) -> usize {
        self.seg
    }

    /// What is known of `peer`'s side (`None` for this rank, an unknown rank, or a
    /// connection this rank dropped).
    pub fn peer_state(&self, peer: usize) -> Option<&PeerState> {
        self.conns.get(peer)?.as_ref().map(|c| &c.state)
    }

    /// Starts a step; pass the same `sends` and `recvs` to every call about it.
    pub fn begin(&self, ctx: StepCtx, sends: &[Outgoing<'_>], recvs: &[Incoming<'_>]) -> Step {
        Step::new(ctx, self.seg, sends, recvs, 0, &|_| false)
    }

    /// [`Core::begin`], sending the messages for which `by_ref` holds by reference: each
    /// frame carries a [`PayloadRef`] to the bytes in this process, tagged `offer`, and the
    /// peer copies them itself. Such a send is done once the peer acknowledges the whole
    /// message. The driver publishes `offer` to those peers before their frames go out and
    /// withdraws it when the step ends, whatever its result, so that a late copy fails.
    pub fn begin_by_ref(
        &self,
        ctx: StepCtx,
        sends: &[Outgoing<'_>],
        recvs: &[Incoming<'_>],
        offer: u64,
        by_ref: &dyn Fn(&Outgoing<'_>) -> bool,
    ) -> Step {
        Step::new(ctx, self.seg, sends, recvs, offer, by_ref)
    }

    /// Messages sent by reference to `peer` so far.
    pub fn offered(&self, peer: usize) -> u64 {
        self.conns
            .get(peer)
            .and_then(Option::as_ref)
            .map_or(0, |c| c.offered)
    }

    /// Whether `step` may fail on what this rank already holds: a peer whose side is not open,
    /// an abort not yet reported, or a stashed frame of this operation that disagrees with it.
    /// A driver settles such a step (one [`Core::poll`]) before it writes any of the step's
    /// frames, so that no peer completes with this rank's data a step this rank fails; every
    /// other step writes first (see the TCP engine). Copies nothing.
    pub fn may_fail_at_once(
        &self,
        step: &Step,
        sends: &[Outgoing<'_>],
        recvs: &[Incoming<'_>],
    ) -> bool {
        let Some(ctx) = step.ctx else {
            return false;
        };
        if step.failed.is_some() {
            return true;
        }
        self.conns
            .iter()
            .flatten()
            .any(|c| c.state != PeerState::Open || c.unreported_abort)
            || self
                .stashed_disagreement(&ctx, step_count(sends, recvs))
                .is_some()
    }

    /// The mismatch a stashed frame of this operation shows, from a peer the step may not
    /// wait for (see `stashed_conflict`): the ranks disagree. `count` is this rank's.
    fn stashed_disagreement(&self, ctx: &StepCtx, count: u64) -> Option<Error> {
        self.conns
            .iter()
            .flatten()
            .find_map(|c| c.first_disagreement(ctx, count))
    }

    /// Whether any connection holds stashed frames (read before a step wanted them).
    pub fn holds_stashed(&self) -> bool {
        self.conns
            .iter()
            .flatten()
            .any(|c| !c.stash.is_empty() || c.partial.is_some())
    }

    /// Whether `step` waits for input from `peer`: a message from it, or its acknowledgement
    /// of one sent by reference. A driver that reads only some connections eagerly reads
    /// these (and the others when they signal).
    pub fn awaits(
        &self,
        step: &Step,
        sends: &[Outgoing<'_>],
        recvs: &[Incoming<'_>],
        peer: usize,
    ) -> bool {
        step.live().is_some()
            && (recvs
                .iter()
                .zip(&step.rx)
                .any(|(r, s)| r.peer == peer && !s.done)
                || sends
                    .iter()
                    .zip(&step.tx)
                    .any(|(s, t)| s.peer == peer && t.written && !t.done))
    }

    /// Whether a driver may read `peer` while `step` does not await it (see [`Core::awaits`]):
    /// to learn of its goodbye, abort or loss at once, and to take frames of later steps off
    /// the connection. Not once the connection holds [`READ_AHEAD_BYTES`] read ahead of the
    /// steps that want them, unless `step` is point-to-point, whose sends stay eager (two
    /// ranks may each send before receiving).
    ///
    /// Why the bound: a rank that runs ahead (a lazy broadcast root, a chain's first links)
    /// can feed a connection as fast as the reader drains it. Read to exhaustion, the reader
    /// copied every later message through its stash and forwarded none: a 4-rank 64 MiB
    /// broadcast over TCP had its second rank hold 900 MB read ahead while the third and
    /// fourth slept out their poller's timeouts, 250-390 ms a broadcast instead of 60-80.
    /// Left in the kernel, the bytes throttle the sender through the transport's own flow
    /// control, and they are read when a step awaits them.
    pub fn reads_ahead(&self, step: &Step, peer: usize) -> bool {
        step.ctx.is_some_and(|c| c.op == CollectiveOp::SendRecv)
            || self
                .conns
                .get(peer)
                .and_then(Option::as_ref)
                .is_none_or(|c| c.read_ahead_bytes() < READ_AHEAD_BYTES)
    }

    /// Makes [`Core::read_buf`] for `peer` ask, between payloads, only for the bytes that
    /// complete the next header (or close frame, or reference): for a driver whose reads cost
    /// a copy rather than a system call (a shared-memory ring), so that a payload that
    /// follows goes straight into its destination instead of through the staging buffer.
    pub fn set_exact_reads(&mut self, peer: usize) {
        if let Some(Some(c)) = self.conns.get_mut(peer) {
            c.exact = true;
        }
    }

    /// Whether `step` failed on something learnt from another rank's notice (rather than seen
    /// by this rank), so that what the peers said since may name a better culprit (see
    /// [`Core::reads_after_failure`]).
    pub(super) fn failed_second_hand(&self, step: &Step) -> bool {
        step.failed.as_ref().is_some_and(|e| self.second_hand(e))
    }

    /// Whether the driver should read `peer` once more (one read, what its stream holds now)
    /// before [`Core::finish`]ing the failed `step`. Only a failure learnt second-hand looks
    /// further (a notice may name a better culprit, or this rank may hold the culprit's own
    /// goodbye), and not at a peer whose payload was coming in: its notice, if any, lies behind
    /// the rest of a message this rank no longer wants. Reading until the streams run dry would
    /// drain the data of senders blocked on this rank and let them complete a step the group
    /// has failed (a chain broadcast's root returned `Ok` while every other rank reported the
    /// mismatch).
    pub fn reads_after_failure(&self, step: &Step, peer: usize) -> bool {
        self.failed_second_hand(step) && !step.mid_payload_from(peer)
    }

    /// Whether send `i` of `step` goes by reference.
    pub fn sends_by_ref(&self, step: &Step, i: usize) -> bool {
        step.tx.get(i).is_some_and(|t| t.by_ref)
    }

    /// Whether send `i` of `step` is done: every frame written and, when it went by
    /// reference, acknowledged.
    pub fn send_done(&self, step: &Step, i: usize) -> bool {
        step.tx.get(i).is_some_and(|t| t.done)
    }

    /// The bytes to write to `peer` next, in order (empty when none): control bytes between
    /// frames, else the rest of the current frame's header and payload, for one vectored
    /// write. Report what was written with [`Core::transmitted`] before any other call.
    pub fn transmit<'a>(
        &'a mut self,
        step: &'a mut Step,
        sends: &'a [Outgoing<'_>],
        peer: usize,
    ) -> [&'a [u8]; 2] {
        let Some(Some(conn)) = self.conns.get_mut(peer) else {
            return [&[], &[]];
        };
        // Nothing more reaches a peer whose connection broke or ended without a word: it is
        // owed nothing (not even the acknowledgements queued for it), and the step that
        // needs it fails in `poll`.
        if matches!(conn.state, PeerState::Lost(_)) {
            return [&[], &[]];
        }
        if !conn.mid_frame && !conn.ctl_pending().is_empty() {
            return [conn.ctl_pending(), &[]];
        }
        let Some(i) = step.current_send(sends, peer) else {
            return [&[], &[]];
        };
        let r = step.frame_range(sends, i);
        let ctx = step.ctx.expect("a live step has a context");
        let s = &sends[i];
        let offer = step.offer;
        let tx = &mut step.tx[i];
        if tx.hdr_done == 0 && tx.payload_done == 0 {
            let mut h = ctx.header(s.count, s.tag, r.start, r.len());
            if tx.by_ref {
                h.flags = FrameHeader::REMOTE;
                let addr = s.data[r.start..].as_ptr() as u64;
                tx.at = PayloadRef { addr, offer }.encode();
            }
            tx.hdr = h.encode();
        }
        if tx.by_ref {
            return [&tx.hdr[tx.hdr_done..], &tx.at[tx.payload_done..]];
        }
        [
            &tx.hdr[tx.hdr_done..],
            &s.data[r.start + tx.payload_done..r.end],
        ]
    }

    /// `n` bytes of what [`Core::transmit`] returned for `peer` were written.
    pub fn transmitted(&mut self, step: &mut Step, sends: &[Outgoing<'_>], peer: usize, n: usize) {
        let Some(Some(conn)) = self.conns.get_mut(peer) else {
            return;
        };
        if n == 0 {
            return;
        }
        if !conn.mid_frame && !conn.ctl_pending().is_empty() {
            conn.ctl_written(n);
            return;
        }
        let Some(i) = step.current_send(sends, peer) else {
            return;
        };
        let nframes = step.frame_count(sends, i);
        let flen = if step.tx[i].by_ref {
            PAYLOAD_REF_LEN
        } else {
            step.frame_range(sends, i).len()
        };
        let tx = &mut step.tx[i];
        let h = n.min(HEADER_LEN - tx.hdr_done);
        tx.hdr_done += h;
        tx.payload_done += n - h;
        debug_assert!(
            tx.payload_done <= flen,
            "more written than transmit offered"
        );
        if tx.hdr_done == HEADER_LEN && tx.payload_done >= flen {
            tx.frame += 1;
            tx.hdr_done = 0;
            tx.payload_done = 0;
            conn.mid_frame = false;
            if tx.frame >= nframes {
                tx.written = true;
                if tx.by_ref {
                    conn.offered += 1;
                    tx.ack_at = conn.offered;
                } else {
                    tx.done = true;
                }
            }
        } else {
            conn.mid_frame = true;
        }
    }

    /// Where the driver's next read from `peer` goes: straight into a receive buffer when a
    /// frame's payload is under way, else a staging buffer. Never empty for a connected peer.
    /// Report what was read with [`Core::received`] before any other call.
    pub fn read_buf<'a>(
        &'a mut self,
        step: &Step,
        recvs: &'a mut [Incoming<'_>],
        peer: usize,
    ) -> &'a mut [u8] {
        let Some(Some(conn)) = self.conns.get_mut(peer) else {
            return &mut [];
        };
        let direct = step.current_recv(recvs, peer).and_then(|i| {
            step.rx[i]
                .cur
                .map(|(flen, done)| (i, step.rx[i].got, flen, done))
        });
        conn.target = if conn.input_done {
            Target::Discard
        } else if conn.staged() > 0 {
            Target::Stage
        } else if conn.partial.is_some() {
            Target::Partial
        } else if let Some((i, ..)) = direct {
            Target::Direct(i)
        } else {
            Target::Stage
        };
        if conn.target == Target::Stage {
            conn.compact();
        }
        let end = conn.end;
        let want = if conn.exact {
            end + conn.unit_rest()
        } else {
            STAGING
        };
        match (conn.target, &mut conn.partial, direct) {
            (Target::Discard, ..) => &mut conn.stage[..],
            (Target::Partial, Some((_, v, filled)), _) => &mut v[*filled..],
            (Target::Direct(i), _, Some((_, at, flen, done))) => {
                recvs[i].slot(at + done..at + flen)
            }
            _ => &mut conn.stage[end..want.min(STAGING)],
        }
    }

    /// `n` bytes were read from `peer` into [`Core::read_buf`]: parses them, delivering whole
    /// frames to `on_frame`.
    pub fn received(
        &mut self,
        step: &mut Step,
        recvs: &mut [Incoming<'_>],
        peer: usize,
        n: usize,
        on_frame: &mut OnFrame<'_>,
    ) {
        let Some(Some(conn)) = self.conns.get_mut(peer) else {
            return;
        };
        match conn.target {
            Target::Direct(i) => {
                if let Some((_, done)) = &mut step.rx[i].cur {
                    *done += n;
                }
            }
            Target::Partial => {
                if let Some((_, _, filled)) = &mut conn.partial {
                    *filled += n;
                }
            }
            Target::Stage => conn.end += n,
            Target::Discard => {}
        }
        conn.target = Target::Stage;
        process(conn, self.copier.as_deref(), step, recvs, peer, on_frame);
    }

    /// `peer`'s input ended (EOF). Everything read before must have been fed.
    pub fn eof(&mut self, peer: usize) {
        if let Some(Some(conn)) = self.conns.get_mut(peer) {
            conn.lose(
                "its connection closed without a goodbye (the process exited or crashed)".into(),
            );
        }
    }

    /// `peer`'s connection failed with `why` (a reset, a write error). Feed what it still
    /// holds first: the peer may have said why it left.
    pub fn broken(&mut self, peer: usize, why: &str) {
        if let Some(Some(conn)) = self.conns.get_mut(peer) {
            conn.lose(format!("connection error: {why}"));
        }
    }

    /// Whether `peer`'s input is over (after `Close`, EOF or an error): reads may stop.
    pub fn input_done(&self, peer: usize) -> bool {
        self.conns
            .get(peer)
            .and_then(Option::as_ref)
            .is_none_or(|c| c.input_done)
    }

    /// Where the step stands at `now`. Call after any input and at the deadline it names.
    pub fn poll(
        &mut self,
        step: &mut Step,
        sends: &[Outgoing<'_>],
        recvs: &mut [Incoming<'_>],
        on_frame: &mut OnFrame<'_>,
        now: Instant,
    ) -> Status {
        let Some(ctx) = step.ctx else {
            return Status::Done;
        };
        // Advisory frames of operations that are over (stashed while this rank was behind).
        // Only where one is stashed: a root's stash may hold many frames of later operations,
        // and a pass over it on every poll took 4-rank gathers of 4 B over TCP from 5 to 7 us.
        for conn in self.conns.iter_mut().flatten() {
            if conn.advisories > 0 {
                conn.stash.retain(|(h, _)| !stale_advisory(&ctx, h));
                conn.advisories = conn.stash.iter().filter(|(h, _)| is_advisory(h)).count();
            }
        }
        // Frames stashed (or bytes staged) before the step began, or before a receive became
        // current; frames that arrive later are parsed as they are received.
        for peer in 0..self.conns.len() {
            if let Some(conn) = self.conns[peer].as_mut()
                && (!conn.stash.is_empty() || conn.staged() > 0 || conn.partial.is_some())
                && step.current_recv(recvs, peer).is_some()
            {
                process(conn, self.copier.as_deref(), step, recvs, peer, on_frame);
            }
        }
        // Messages sent by reference are done once the peer acknowledged them.
        for (s, tx) in sends.iter().zip(&mut step.tx) {
            if tx.written
                && !tx.done
                && matches!(self.conns.get(s.peer), Some(Some(c)) if c.acked >= tx.ack_at)
            {
                tx.done = true;
            }
        }
        if step.failed.is_some() {
            return Status::Failed;
        }
        if step.finished {
            return Status::Done;
        }
        let mut missing = std::mem::take(&mut step.missing);
        step.missing_into(sends, recvs, &mut missing);
        let status = self.check(&ctx, step, sends, recvs, &missing, now);
        step.missing = missing;
        status
    }

    /// [`Core::poll`] for an operation that sends no frames, whose driver learns by other
    /// means which peers it still waits for (`missing`): one through memory the whole group
    /// maps, announcing `count`. It fails as a step waiting for their messages would: a peer
    /// lost, gone or aborted, a stashed frame of this operation that disagrees with it, the
    /// deadline (naming `missing`); on any frame of this very operation, since a peer that
    /// sends one runs it over messages, which the ranks choose alike only when they agree on
    /// its arguments (unless `ctx.area_then_messages`: then every rank goes on over messages
    /// alike, and the frame waits for those steps); and on any frame of an earlier operation,
    /// which no step took. The driver reads each link once after every rank arrived, so that
    /// such a frame is seen.
    pub fn poll_waiting_for(
        &mut self,
        step: &mut Step,
        count: u64,
        missing: &[usize],
        now: Instant,
    ) -> Status {
        let Some(ctx) = step.ctx else {
            return Status::Done;
        };
        if step.failed.is_some() {
            return Status::Failed;
        }
        if step.finished {
            return Status::Done;
        }
        // A frame of this operation, or of an earlier one that no step took. Unlike a step
        // over messages (`stashed_conflict`), this waits for no frame of an earlier
        // operation: the backend reads a lazy root's deferred agreement frames before any
        // operation through the area. Ranks that each took another for a reduce's root all
        // sent, none received, and a barrier through the area let all of them out.
        if let Some(e) = self.unclaimed_frame(&ctx, count) {
            step.fail(e);
            return Status::Failed;
        }
        self.check(&ctx, step, &[], &[], missing, now)
    }

    /// The mismatch shown by a stashed collective frame of operation `ctx` or an earlier one
    /// (but a stale advisory frame), for a rank that expects none: no step will take it.
    fn unclaimed_frame(&self, ctx: &StepCtx, count: u64) -> Option<Error> {
        let this_or_earlier =
            |seq: u64| seq < ctx.seq || (seq == ctx.seq && !ctx.area_then_messages);
        let conflict = |h: &FrameHeader| {
            (this_or_earlier(h.seq)
                && h.group == ctx.group
                && !matches!(h.op, CollectiveOp::SendRecv | CollectiveOp::Close)
                && !stale_advisory(ctx, h))
            .then(|| ctx.mismatch(h, count))
        };
        self.conns
            .iter()
            .flatten()
            .flat_map(Conn::stashed_headers)
            .find_map(conflict)
    }

    /// Judges, for `step` (which sends and receives nothing, begun between two operations by
    /// a rank that expects no frame: see `Transport::look`), what the connections hold once
    /// the driver has read them: fails on a peer's abort notice, and on a stashed collective
    /// frame of the step's operation or an earlier one (`Core::unclaimed_frame`); else done.
    /// A mismatch with a frame of operation `run_from` or later names this rank's side as the
    /// step's call (`Transport::look`). [`Core::finish`] it as any step.
    pub fn look(
        &mut self,
        step: &mut Step,
        count: u64,
        run_from: Option<u64>,
        now: Instant,
    ) -> Status {
        let Some(ctx) = step.ctx else {
            return Status::Done;
        };
        if step.failed.is_some() {
            return Status::Failed;
        }
        if let Some(e) = self.unclaimed_frame(&ctx, count) {
            let e = match e {
                Error::Mismatch { ours, theirs }
                    if run_from.is_some_and(|from| theirs.seq >= from) =>
                {
                    Error::Mismatch {
                        ours: dist_backend::OpDesc {
                            seq: theirs.seq,
                            ..ours
                        },
                        theirs,
                    }
                }
                e => e,
            };
            step.fail(e);
            return Status::Failed;
        }
        for peer in 0..self.conns.len() {
            if let Some(c) = self.conns[peer].as_mut()
                && std::mem::take(&mut c.unreported_abort)
            {
                let e = self.peer_error(&ctx, now, peer, &[]);
                step.fail(e);
                return Status::Failed;
            }
        }
        Status::Done
    }

    /// The rest of [`Core::poll`], for a live step waiting for `missing`.
    fn check(
        &mut self,
        ctx: &StepCtx,
        step: &mut Step,
        sends: &[Outgoing<'_>],
        recvs: &[Incoming<'_>],
        missing: &[usize],
        now: Instant,
    ) -> Status {
        for &peer in missing {
            if let Err(e) = self.usable(ctx, peer, now, missing) {
                step.fail(e);
                return Status::Failed;
            }
        }
        // A step whose every message moved is done, whatever arrived after, once the
        // acknowledgements it owes are out: their senders wait for them.
        let owes = |c: &Conn| c.state == PeerState::Open && !c.ctl_pending().is_empty();
        if missing.is_empty() && !self.conns.iter().flatten().any(owes) {
            return Status::Done;
        }
        // A frame of this operation whose arguments differ from ours, from a peer the step
        // does not wait for: the ranks disagree.
        if let Some(e) = self.stashed_disagreement(ctx, step_count(sends, recvs)) {
            step.fail(e);
            return Status::Failed;
        }
        // A peer this step does not use that aborted the group: the step cannot complete
        // either (a peer that merely left may have finished and exited: not a failure).
        for peer in 0..self.conns.len() {
            if let Some(c) = self.conns[peer].as_mut()
                && std::mem::take(&mut c.unreported_abort)
            {
                let e = self.peer_error(ctx, now, peer, missing);
                step.fail(e);
                return Status::Failed;
            }
        }
        if now >= ctx.deadline {
            // Peers that did not take the acknowledgements owed to them stalled too.
            let mut late = missing.to_vec();
            late.extend(
                (0..self.conns.len()).filter(|&p| self.conns[p].as_ref().is_some_and(owes)),
            );
            step.fail(ctx.timeout_at(now, late));
            return Status::Failed;
        }
        Status::Pending {
            deadline: ctx.deadline,
        }
    }

    /// Ends the step: `Ok` when it completed. When it failed because of another rank (a peer
    /// lost, two ranks that disagree), queues a notice to every other peer saying whom to
    /// blame and why, so that they report that rank and cause rather than this one, whose
    /// connections close when it exits. Transmit what it queues. Call it once per step.
    pub fn finish(&mut self, step: &mut Step, sends: &[Outgoing<'_>], now: Instant) -> Result<()> {
        let was_finished = step.finished;
        step.finished = true;
        let Some(e) = step.failed.take() else {
            return Ok(());
        };
        if was_finished {
            return Err(e);
        }
        let ctx = step.ctx.expect("a failed step has a context");
        Err(self.report_failure(&ctx, e, step, sends, now))
    }

    /// The first report of `step`'s failure `e`: aborts the group, names the rank to blame
    /// where `e` came second hand or from a stall, and queues the notice to every open peer.
    /// Returns the error to report.
    fn report_failure(
        &mut self,
        ctx: &StepCtx,
        e: Error,
        step: &Step,
        sends: &[Outgoing<'_>],
        now: Instant,
    ) -> Error {
        self.aborted = true;
        let e = if self.second_hand(&e) {
            self.first_hand(ctx, now, &e).unwrap_or(e)
        } else {
            e
        };
        let e = self.stalled_on(ctx, now, &e, step, sends).unwrap_or(e);
        if let Some(reason) = abort_reason(&e) {
            self.notify_abort(&reason, step, sends);
        }
        for c in self.conns.iter_mut().flatten() {
            c.unreported_abort = false;
        }
        e
    }

    /// Whether a point-to-point message from `peer` with `tag` has begun to arrive, or the
    /// peer is gone. Feed what the connection holds first.
    pub fn probe(&self, peer: usize, tag: u32) -> bool {
        let Some(Some(c)) = self.conns.get(peer) else {
            return false;
        };
        let wanted = |h: &FrameHeader| h.op == CollectiveOp::SendRecv && h.tag == tag;
        let arrived = c.stash.iter().any(|(h, _)| wanted(h))
            || c.partial.as_ref().is_some_and(|(h, _, _)| wanted(h));
        arrived || c.state != PeerState::Open
    }

    /// Fails operation `ctx` with `e`, found outside any step (by comparing what the ranks
    /// published in shared memory), as a failed step would: the group is aborted and, where
    /// `e` blames another rank, every open peer is sent the notice (transmit it). Returns the
    /// error to report, as [`Core::finish`] does.
    pub fn fail_outside_step(&mut self, ctx: StepCtx, e: Error, now: Instant) -> Error {
        let step = self.begin(ctx, &[], &[]);
        self.report_failure(&ctx, e, &step, &[], now)
    }

    /// Fails `step` with `e`, which the driver found outside the frames (the group area shows
    /// a peer running this operation through it while this rank runs it over messages). The
    /// next [`Core::poll`] says `Failed`, and [`Core::finish`] reports `e` and queues the
    /// abort notices, as for a failure found in a frame.
    pub fn fail_step(&self, step: &mut Step, e: Error) {
        step.fail(e);
    }

    /// Marks the group aborted by a failure found outside any step: closing then says no
    /// goodbye.
    pub fn abort(&mut self) {
        self.aborted = true;
    }

    /// Whether a step failed or [`Core::abort`] was called.
    pub fn aborted(&self) -> bool {
        self.aborted
    }

    /// Leaves the group: queues a goodbye to every peer still connected, unless the group was
    /// aborted, when only the abort notices already queued go out. Afterwards the driver
    /// transmits what [`Core::transmit`] gives with [`Step::idle`] to each peer for which
    /// [`Core::owes_close`] holds, shuts its write side, and drops the rest.
    pub fn close(&mut self) {
        if self.aborted {
            return;
        }
        let bye = CloseReason::Goodbye.encode(self.rank as u32);
        for c in self.conns.iter_mut().flatten() {
            if matches!(c.state, PeerState::Open | PeerState::Left) {
                c.ctl.extend_from_slice(&bye);
            }
        }
    }

    /// After [`Core::close`]: whether `peer` is owed the bytes queued for it and an orderly
    /// shutdown (rather than a plain drop, which it sees as a crash).
    pub fn owes_close(&self, peer: usize) -> bool {
        let Some(Some(c)) = self.conns.get(peer) else {
            return false;
        };
        if self.aborted {
            // A notice already handed to the kernel may still be unread by the peer: closing
            // with unread input could reset the connection and lose it.
            c.state == PeerState::Open && (!c.ctl_pending().is_empty() || c.notified)
        } else {
            matches!(c.state, PeerState::Open | PeerState::Left)
        }
    }

    /// Forgets `peer`'s connection (the driver dropped it): later steps that use it fail.
    pub fn disconnect(&mut self, peer: usize) {
        if let Some(slot) = self.conns.get_mut(peer) {
            *slot = None;
        }
    }

    /// `Ok` when `peer` can still take part in the step, which waits for `missing`.
    fn usable(&self, ctx: &StepCtx, peer: usize, now: Instant, missing: &[usize]) -> Result<()> {
        match self.conns.get(peer) {
            Some(Some(c)) if c.state == PeerState::Open => Ok(()),
            Some(Some(_)) => Err(self.peer_error(ctx, now, peer, missing)),
            _ => Err(Error::invalid(
                ctx.rank,
                ctx.op.name(),
                format!("no connection to rank {peer}"),
            )),
        }
    }

    /// The error for a step waiting for `missing` that cannot go on with `peer`, whose side
    /// is not open. A peer that timed out waiting for `culprit` passes its blame on only to
    /// ranks that wait for it: a rank waiting for others names those instead, since its own
    /// waits lead further down the chain towards the stalled rank than those of a peer it
    /// does not wait for.
    fn peer_error(&self, ctx: &StepCtx, now: Instant, peer: usize, missing: &[usize]) -> Error {
        let Some(Some(c)) = self.conns.get(peer) else {
            return ctx.peer_lost(peer, "its connection is gone");
        };
        if let PeerState::Aborted(CloseReason::Stalled { culprit }) = c.state
            && culprit as usize != ctx.rank
            && !missing.contains(&peer)
        {
            let gave_up = |p: usize| matches!(self.conns.get(p), Some(Some(c)) if matches!(c.state, PeerState::Aborted(CloseReason::Stalled { .. })));
            let own: Vec<usize> = missing.iter().copied().filter(|&p| !gave_up(p)).collect();
            if !own.is_empty() {
                return ctx.timeout_at(now, own);
            }
        }
        lost_or_left(ctx, now, peer, &c.state)
    }

    /// Whether `e` was learnt from another rank's abort notice rather than seen by this rank.
    fn second_hand(&self, e: &Error) -> bool {
        match e {
            Error::MismatchReported { .. } => true,
            // First-hand when this rank's own connection to the lost rank is gone.
            Error::PeerLost { peer, .. } => !matches!(
                self.conns.get(*peer),
                Some(Some(c)) if matches!(c.state, PeerState::Lost(_))
            ),
            _ => false,
        }
    }

    /// After a failure `e` learnt second-hand: a cause this rank saw itself, if it has one,
    /// which it reports instead. A notice is only as good as its sender's view, and says only
    /// "lost": a rank's own EOF from the rank that died is better, and so is its own goodbye
    /// from the very rank the notice blames (the reporter met that rank's goodbye, and a rank
    /// that left cleanly must be reported as having left on every peer, whichever of the two
    /// messages it happened to read first). A goodbye from a rank the notice does not blame is
    /// no cause: ranks may leave while the others go on without them.
    fn first_hand(&self, ctx: &StepCtx, now: Instant, e: &Error) -> Option<Error> {
        let died = self.conns.iter().enumerate().find_map(|(peer, c)| match c {
            Some(Conn {
                state: PeerState::Lost(why),
                ..
            }) => Some(ctx.peer_lost(peer, why.clone())),
            _ => None,
        });
        let blamed = match e {
            Error::PeerLost { peer, .. } => Some(*peer),
            _ => None,
        };
        died.or_else(|| {
            let peer = blamed?;
            let c = self.conns.get(peer)?.as_ref()?;
            (c.state == PeerState::Left)
                .then(|| closed_error_at(ctx, now, peer, &CloseReason::Goodbye))
        })
    }

    /// See [`crate::transport::stalled_on`].
    fn stalled_on(
        &self,
        ctx: &StepCtx,
        now: Instant,
        e: &Error,
        step: &Step,
        sends: &[Outgoing<'_>],
    ) -> Option<Error> {
        let me = CloseReason::Stalled {
            culprit: ctx.rank as u32,
        };
        let gave_up = |p: usize| matches!(self.conns.get(p), Some(Some(c)) if c.state == PeerState::Aborted(me));
        let pending = step.rx.iter().filter(|r| !r.done).map(|r| r.peer).chain(
            sends
                .iter()
                .zip(&step.tx)
                .filter(|(_, t)| !t.done)
                .map(|(s, _)| s.peer),
        );
        stalled_on(ctx, now, e, self.conns.len(), gave_up, pending)
    }

    /// Queues, to every open peer but a lost one, the notice that this rank aborts the group
    /// and why, after whatever this rank owes the peer on the stream (the rest of a frame it
    /// was in the middle of, control bytes), so it always lands on a frame boundary.
    fn notify_abort(&mut self, reason: &CloseReason, step: &Step, sends: &[Outgoing<'_>]) {
        let notice = reason.encode(self.rank as u32);
        let lost = match reason {
            CloseReason::Lost { culprit } => Some(*culprit as usize),
            _ => None,
        };
        for (p, c) in self.conns.iter_mut().enumerate() {
            let Some(c) = c else { continue };
            // A peer reads nothing after the first notice (the first thing learnt sticks): a
            // later step of the aborted group that fails too has nothing to add.
            if Some(p) == lost || c.state != PeerState::Open || c.notified {
                continue;
            }
            let rest = if c.mid_frame {
                // At most one message per peer is under way (the others queue behind it).
                (0..sends.len())
                    .find(|&i| sends[i].peer == p && !step.tx[i].written)
                    .map(|i| {
                        let tx = &step.tx[i];
                        let r = step.frame_range(sends, i);
                        let mut rest = tx.hdr[tx.hdr_done..].to_vec();
                        if tx.by_ref {
                            rest.extend_from_slice(&tx.at[tx.payload_done..]);
                        } else {
                            rest.extend_from_slice(
                                &sends[i].data[r.start + tx.payload_done..r.end],
                            );
                        }
                        rest
                    })
                    .unwrap_or_default()
            } else {
                Vec::new()
            };
            c.queue_notice(&rest, &notice);
        }
    }
}

/// The error for a step that needs `peer`, whose side is in `state`.
fn lost_or_left(ctx: &StepCtx, now: Instant, peer: usize, state: &PeerState) -> Error {
    match state {
        PeerState::Lost(why) => ctx.peer_lost(peer, why.clone()),
        PeerState::Aborted(reason) => closed_error_at(ctx, now, peer, reason),
        PeerState::Left => closed_error_at(ctx, now, peer, &CloseReason::Goodbye),
        PeerState::Open => ctx.peer_lost(peer, "its connection is unusable"),
    }
}
