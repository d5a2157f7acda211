//! The progress engine: drives every send and receive of a step over non-blocking sockets
//! until all are done, a peer fails, or the deadline passes.

use std::io::{self, IoSlice, Write};
use std::time::{Duration, Instant};

use dist_backend::{Error, Result};
use dist_wire::{CloseReason, CollectiveOp, FrameHeader, HEADER_LEN, PAYLOAD_REF_LEN, PayloadRef};
use mio::{Events, Poll};

use super::cma::Cma;
use super::conn::{Conn, Io, Payload, PeerState};
use super::linger;
use crate::transport::{
    Incoming, OnFrame, Outgoing, StepCtx, Verdict, abort_reason, closed_error, frames, judge,
    stalled_on, stashed_conflict, step_count,
};

/// The longest an aborted mesh spends, when it is closed, delivering its abort notices and
/// waiting for the peers to close their ends (each bounded also by the group's timeout): long
/// enough for peers that are still running to read the notice, short enough that a rank
/// whose peer is stopped does not hang on its way out.
const ABORT_LINGER: Duration = Duration::from_secs(10);

/// Progress state of one outgoing message.
struct SendState {
    frame: usize,
    hdr: [u8; HEADER_LEN],
    hdr_done: usize,
    payload_done: usize,
    /// Sent by reference: each frame's body is a [`PayloadRef`] to the data, not the data.
    by_ref: bool,
    /// The reference of the frame being written.
    at: [u8; PAYLOAD_REF_LEN],
    /// Every frame is written.
    written: bool,
    /// For a message sent by reference: the peer's acknowledgement count that covers it.
    ack_at: Option<u64>,
    /// Written and, when sent by reference, acknowledged.
    done: bool,
}

/// Progress state of one incoming message.
struct RecvState {
    got: usize,
    /// Payload length and bytes read of the frame being received.
    cur: Option<(usize, usize)>,
    first: bool,
    /// Some frame came by reference: the message must be acknowledged once whole.
    by_ref: bool,
    done: bool,
}

#[derive(Debug)]
pub(super) struct Engine {
    pub(super) poll: Poll,
    pub(super) events: Events,
    /// Indexed by peer rank; `None` at this rank.
    pub(super) conns: Vec<Option<Conn>>,
    /// How long to keep retrying before sleeping in the poller: waking a sleeping process costs
    /// more than the whole of a small message's round trip.
    pub(super) spin: Duration,
    /// The first part of `spin`, busy-waiting without yielding the core.
    pub(super) busy_spin: Duration,
    /// Single-copy transfers with the peers on this host, when they are possible.
    pub(super) cma: Option<Cma>,
    /// Large messages over shared-memory rings go by reference too (see
    /// [`Engine::single_copy_pays`] and `MeshOptions::cross_memory_over_rings`).
    pub(super) single_copy_over_rings: bool,
    /// How long closing waits for each peer to close its end (the group's timeout).
    pub(super) linger: Duration,
    /// A step failed: the connections are in an unknown state, and closing only delivers the
    /// abort notices queued on them (no goodbye, which would tell peers this was a clean exit).
    pub(super) aborted: bool,
}

/// Whether message `i` must wait for an earlier, unfinished message with the same peer.
fn queued_behind(i: usize, peer: impl Fn(usize) -> usize, done: impl Fn(usize) -> bool) -> bool {
    (0..i).any(|j| peer(j) == peer(i) && !done(j))
}

fn lost_or_left(ctx: &StepCtx, peer: usize, state: &PeerState) -> Error {
    match state {
        PeerState::Lost(why) => ctx.peer_lost(peer, why.clone()),
        PeerState::Aborted(reason) => closed_error(ctx, peer, reason),
        _ => ctx.peer_lost(
            peer,
            "it left the group (destroyed its process group) before this operation",
        ),
    }
}

/// Whether `e` was learnt from another rank's abort notice rather than seen by this rank.
fn second_hand(e: &Error, conns: &[Option<Conn>]) -> bool {
    match e {
        Error::MismatchReported { .. } => true,
        // First-hand when this rank's own connection to the lost rank is gone.
        Error::PeerLost { peer, .. } => !matches!(
            conns.get(*peer),
            Some(Some(c)) if matches!(c.state, PeerState::Lost(_))
        ),
        _ => false,
    }
}

impl Engine {
    fn conn(&mut self, ctx: &StepCtx, peer: usize) -> Result<&mut Conn> {
        match self.conns.get_mut(peer) {
            Some(Some(c)) => Ok(c),
            _ => Err(Error::invalid(
                ctx.rank,
                ctx.op.name(),
                format!("no connection to rank {peer}"),
            )),
        }
    }

    /// Runs one step (see [`Engine::run_step`]). When it fails because of another rank (a
    /// peer lost, two ranks that disagree), tells every other peer whom to blame and why
    /// before returning, so that they report that rank and cause rather than this rank, whose
    /// sockets close when it exits.
    pub(super) fn run(
        &mut self,
        ctx: &StepCtx,
        seg: usize,
        sends: &[Outgoing<'_>],
        recvs: &mut [Incoming<'_>],
        on_frame: &mut OnFrame<'_>,
    ) -> Result<()> {
        // Declared first so it runs last, after the abort notice, and on unwinding too.
        let _withdraw = self.cma.as_ref().map(Cma::withdrawal);
        let mut mid_frame = vec![false; self.conns.len()];
        let mut tx: Vec<SendState> = Vec::with_capacity(sends.len());
        let mut rx: Vec<RecvState> = Vec::with_capacity(recvs.len());
        let r = self.run_step(
            ctx,
            seg,
            sends,
            recvs,
            on_frame,
            &mut mid_frame,
            &mut tx,
            &mut rx,
        );
        let Err(e) = r else { return Ok(()) };
        self.aborted = true;
        let e = if second_hand(&e, &self.conns) {
            self.first_hand(ctx, recvs, &rx).unwrap_or(e)
        } else {
            e
        };
        let e = self
            .stalled_on(ctx, &e, sends, recvs, &tx, &rx)
            .unwrap_or(e);
        if let Some(reason) = abort_reason(&e) {
            self.notify_abort(ctx.rank, &reason, seg, sends, &tx);
        }
        // Whatever happened, the caller gets its buffers back now: `_withdraw` makes sure no
        // peer may copy them after this. (After the abort notice, so that a peer whose copy
        // fails on the withdrawal finds the notice naming the rank that was really lost.)
        Err(e)
    }

    /// After a failure learnt second-hand: a cause this rank saw itself, if it has one (the
    /// connection of a peer that died without a goodbye), which it reports instead. A notice
    /// is only as good as its sender's view; a rank's own EOF from the rank that died is not.
    /// Reads what has arrived on every connection not in the middle of a message's payload.
    fn first_hand(
        &mut self,
        ctx: &StepCtx,
        recvs: &[Incoming<'_>],
        rx: &[RecvState],
    ) -> Option<Error> {
        for (peer, c) in self.conns.iter_mut().enumerate() {
            let Some(c) = c else { continue };
            let mid_payload = recvs
                .iter()
                .zip(rx)
                .any(|(r, st)| r.peer == peer && st.cur.is_some());
            if c.state == PeerState::Open && !mid_payload {
                c.drain();
            }
            if let PeerState::Lost(why) = &c.state {
                return Some(ctx.peer_lost(peer, why.clone()));
            }
        }
        None
    }

    /// See [`crate::transport::stalled_on`].
    fn stalled_on(
        &self,
        ctx: &StepCtx,
        e: &Error,
        sends: &[Outgoing<'_>],
        recvs: &[Incoming<'_>],
        tx: &[SendState],
        rx: &[RecvState],
    ) -> Option<Error> {
        let me = CloseReason::Stalled {
            culprit: ctx.rank as u32,
        };
        let gave_up = |p: usize| matches!(self.conns.get(p), Some(Some(c)) if c.state == PeerState::Aborted(me));
        let pending = recvs
            .iter()
            .zip(rx)
            .filter(|(_, s)| !s.done)
            .map(|(r, _)| r.peer)
            .chain(
                sends
                    .iter()
                    .zip(tx)
                    .filter(|(_, s)| !s.done)
                    .map(|(s, _)| s.peer),
            );
        stalled_on(ctx, Instant::now(), e, self.conns.len(), gave_up, pending)
    }

    #[allow(
        clippy::too_many_arguments,
        reason = "the step's state lives in `run`, which reads it after a failure"
    )]
    fn run_step(
        &mut self,
        ctx: &StepCtx,
        seg: usize,
        sends: &[Outgoing<'_>],
        recvs: &mut [Incoming<'_>],
        on_frame: &mut OnFrame<'_>,
        mid_frame: &mut [bool],
        tx: &mut Vec<SendState>,
        rx: &mut Vec<RecvState>,
    ) -> Result<()> {
        // Point-to-point stays eager: a user's `send` must not wait for the matching `recv`
        // (send-then-receive on both sides is a common, valid pattern). In every collective
        // algorithm the receive matching a send is reached without the sender progressing
        // further (the same step, or a step its receiver reaches on its own), so collectives
        // may rendezvous. The cost: two groups whose large collectives are issued in crossed
        // orders now wait for each other (until the timeout) where socket buffers used to
        // absorb them; MPI calls such programs erroneous.
        let cma = self
            .cma
            .as_ref()
            .filter(|_| ctx.op != CollectiveOp::SendRecv);
        let offer = cma.map_or(0, |_| Cma::next_step_offer());
        tx.extend(sends.iter().map(|s| SendState {
            frame: 0,
            hdr: [0; HEADER_LEN],
            hdr_done: 0,
            payload_done: 0,
            by_ref: cma.is_some_and(|c| c.by_reference(s.peer, s.data.len()))
                && self.single_copy_pays(ctx, s.peer),
            at: [0; PAYLOAD_REF_LEN],
            written: false,
            ack_at: None,
            done: false,
        }));
        if let Some(cma) = cma {
            for (s, st) in sends.iter().zip(tx.iter()) {
                if st.by_ref {
                    cma.publish(s.peer, offer);
                }
            }
        }
        rx.extend(recvs.iter().map(|_| RecvState {
            got: 0,
            cur: None,
            first: true,
            by_ref: false,
            done: false,
        }));
        let mut spin_until: Option<Instant> = None;
        let mut idle_since: Option<Instant> = None;
        loop {
            let mut progress = false;
            let mut pending = false;
            for i in 0..sends.len() {
                if tx[i].done {
                    continue;
                }
                pending = true;
                if tx[i].written {
                    progress |= self.await_ack(ctx, &sends[i], &mut tx[i], recvs, rx)?;
                    continue;
                }
                // Messages to one peer go out whole and in order: never interleave their bytes.
                if queued_behind(i, |j| sends[j].peer, |j| tx[j].written) {
                    continue;
                }
                let moved = self.drive_send(ctx, seg, &sends[i], &mut tx[i], offer);
                let st = &tx[i];
                if let Some(m) = mid_frame.get_mut(sends[i].peer) {
                    *m = !st.written && (st.hdr_done > 0 || st.payload_done > 0);
                }
                progress |= moved?;
            }
            for i in 0..recvs.len() {
                if rx[i].done {
                    continue;
                }
                pending = true;
                // Messages from one peer arrive whole and in order: receive them in turn.
                if queued_behind(i, |j| recvs[j].peer, |j| rx[j].done) {
                    continue;
                }
                progress |= self.drive_recv(ctx, i, &mut recvs[i], &mut rx[i], on_frame)?;
            }
            // Acknowledgements go out between our own frames to the peer, never inside one.
            for (peer, c) in self.conns.iter_mut().enumerate() {
                if let Some(c) = c
                    && c.has_out()
                {
                    pending = true;
                    if !mid_frame.get(peer).copied().unwrap_or(false) {
                        match c.flush_out() {
                            Ok(done) => progress |= done,
                            Err(e) => {
                                c.broken(&e);
                                return Err(lost_or_left(ctx, peer, &c.state));
                            }
                        }
                    }
                }
            }
            if !pending {
                return Ok(());
            }
            if progress {
                spin_until = None;
                idle_since = None;
                continue;
            }
            let now = Instant::now();
            if now >= ctx.deadline {
                let mut missing: Vec<usize> = recvs
                    .iter()
                    .zip(rx.iter())
                    .filter(|(_, s)| !s.done)
                    .map(|(r, _)| r.peer)
                    .collect();
                missing.extend(
                    sends
                        .iter()
                        .zip(tx.iter())
                        .filter(|(_, s)| !s.done)
                        .map(|(s, _)| s.peer),
                );
                // Peers whose socket did not take our acknowledgements stalled too.
                missing.extend(
                    self.conns
                        .iter()
                        .enumerate()
                        .filter(|(_, c)| c.as_ref().is_some_and(Conn::has_out))
                        .map(|(p, _)| p),
                );
                return Err(ctx.timeout(missing));
            }
            let until = *spin_until.get_or_insert(dist_backend::deadline_after(now, self.spin));
            if now < until {
                // A CPU spin first (see `MeshOptions::busy_spin`): a peer on another core
                // answers through shared memory within a microsecond, while a yield on a busy
                // host may hand the core to another process for a whole time slice. Then
                // yields, which let a peer that shares this core run.
                if now.duration_since(*idle_since.get_or_insert(now)) < self.busy_spin {
                    std::hint::spin_loop();
                } else {
                    std::thread::yield_now();
                }
                continue;
            }
            let count = step_count(sends, recvs);
            self.wait(ctx, recvs, rx, count, ctx.deadline - now)?;
        }
    }

    /// Whether a message large enough to go by reference to `peer` should, in this step.
    /// Over TCP, always: one copy instead of two and no network stack. Over shared-memory
    /// rings, the two copies (the sender's in, the receiver's out) run on two cores at once,
    /// through a ring that stays in cache and with no pages to pin, so while this host's ranks
    /// fit its CPUs the rings win: `cargo xtask bench all` at 2 ranks from 256 KiB to 64 MiB,
    /// rings against by reference, took 0.25-0.7x the time for broadcast, 0.4-0.95x for
    /// all_gather, all_to_all and all_reduce. The exception is reduce_scatter from 4 MiB
    /// (1.3-1.5x; about 1.35x after it learnt to combine where it receives), not worth a rule
    /// of its own on figures this noisy.
    /// When the ranks outnumber the cores the two copies cannot run at once, and by reference
    /// wins (4 ranks on 2 cores: all_to_all 0.55-0.88x), except for broadcast and scatter,
    /// whose one-way pipelines keep the rings ahead there too (0.6-0.85x).
    fn single_copy_pays(&self, ctx: &StepCtx, peer: usize) -> bool {
        let shm = matches!(self.conns.get(peer), Some(Some(c)) if c.is_shm());
        !shm || (self.single_copy_over_rings
            && !matches!(ctx.op, CollectiveOp::Broadcast | CollectiveOp::Scatter))
    }

    /// Sleeps in the poller until some socket is ready, draining sockets the step does not
    /// receive from and failing if one of them turns out lost, or holds a frame of this
    /// operation whose arguments differ from ours (see [`stashed_conflict`]; `count` is
    /// ours, for its error).
    fn wait(
        &mut self,
        ctx: &StepCtx,
        recvs: &[Incoming<'_>],
        rx: &[RecvState],
        count: u64,
        timeout: Duration,
    ) -> Result<()> {
        // Checked before sleeping too: such a frame may have been stashed before this
        // operation began (its sender ran ahead).
        if let Some(e) = self.stashed_conflict(ctx, count) {
            return Err(e);
        }
        // Cap each sleep so a lost wake-up can only cost latency, never a hang.
        let timeout = timeout.min(Duration::from_millis(100));
        // Shared-memory links say they sleep first, then look once more (no wake-up lost);
        // one that changed meanwhile is treated as a poller event, without sleeping.
        let awake = self.arm_links();
        let polled = if awake.is_empty() {
            self.poll.poll(&mut self.events, Some(timeout))
        } else {
            self.events.clear();
            Ok(())
        };
        self.disarm_links();
        if let Err(e) = polled
            && e.kind() != io::ErrorKind::Interrupted
        {
            return Err(Error::Io {
                rank: ctx.rank,
                context: format!("{} #{}: polling sockets", ctx.op, ctx.seq),
                source: e,
            });
        }
        let mut ready: Vec<usize> = self.events.iter().map(|ev| ev.token().0).collect();
        ready.extend(awake);
        for peer in ready {
            let receiving = recvs.iter().zip(rx).any(|(r, s)| r.peer == peer && !s.done);
            if receiving {
                continue;
            }
            if let Some(Some(c)) = self.conns.get_mut(peer) {
                let before = c.state.clone();
                c.drain();
                match &c.state {
                    // A peer that aborted the group: this step cannot complete either.
                    PeerState::Aborted(_) => return Err(lost_or_left(ctx, peer, &c.state)),
                    // A peer this step does not need has gone (it may simply have finished and
                    // exited): an event, not a failure. A step that needs it fails on its own,
                    // naming it.
                    PeerState::Lost(why) if before == PeerState::Open => {
                        tracing::debug!(rank = ctx.rank, peer, op = %ctx.op, seq = ctx.seq, reason = %why, "a peer this step does not use went away");
                    }
                    _ => {}
                }
            }
        }
        Ok(())
    }

    /// The first frame of this operation in any connection's stash whose arguments differ
    /// from this rank's, as a mismatch error.
    fn stashed_conflict(&self, ctx: &StepCtx, count: u64) -> Option<Error> {
        self.conns
            .iter()
            .flatten()
            .flat_map(Conn::stashed_headers)
            .find_map(|h| stashed_conflict(ctx, h, count))
    }

    /// Arms every shared-memory link before a sleep (see `Link::arm`): the peers whose link
    /// changed meanwhile (then the engine must not sleep). A link whose rings are corrupt is
    /// lost.
    fn arm_links(&mut self) -> Vec<usize> {
        let mut awake = Vec::new();
        for (peer, c) in self.conns.iter_mut().enumerate() {
            let Some(c) = c else { continue };
            match c.link.arm() {
                Ok(false) => {}
                Ok(true) => awake.push(peer),
                Err(e) => {
                    c.broken(&e);
                    awake.push(peer);
                }
            }
        }
        awake
    }

    /// Lowers what [`Engine::arm_links`] raised.
    fn disarm_links(&mut self) {
        for c in self.conns.iter_mut().flatten() {
            c.link.disarm();
        }
    }

    /// For a message sent by reference and fully written: checks for the peer's
    /// acknowledgement, reading the connection when no receive of this step does.
    fn await_ack(
        &mut self,
        ctx: &StepCtx,
        s: &Outgoing<'_>,
        st: &mut SendState,
        recvs: &[Incoming<'_>],
        rx: &[RecvState],
    ) -> Result<bool> {
        let want = st.ack_at.unwrap_or(0);
        let c = self.conn(ctx, s.peer)?;
        if c.acked < want {
            let receiving = recvs
                .iter()
                .zip(rx)
                .any(|(r, st)| r.peer == s.peer && !st.done);
            if !receiving {
                c.drain();
            }
        }
        if c.acked >= want {
            st.done = true;
            return Ok(true);
        }
        if c.state != PeerState::Open {
            return Err(lost_or_left(ctx, s.peer, &c.state));
        }
        Ok(false)
    }

    /// Writes as much of one message as the socket takes. Returns whether any byte moved.
    fn drive_send(
        &mut self,
        ctx: &StepCtx,
        seg: usize,
        s: &Outgoing<'_>,
        st: &mut SendState,
        offer: u64,
    ) -> Result<bool> {
        let c = self.conn(ctx, s.peer)?;
        if c.state != PeerState::Open {
            return Err(lost_or_left(ctx, s.peer, &c.state));
        }
        let len = s.data.len();
        let nframes = frames(len, seg).len();
        let mut moved = false;
        while st.frame < nframes {
            let r = (st.frame * seg).min(len)..((st.frame + 1) * seg).min(len);
            if st.hdr_done == 0 && st.payload_done == 0 {
                // A frame boundary: the only place queued acknowledgements may go out.
                match c.flush_out() {
                    Ok(true) => {}
                    Ok(false) => return Ok(moved),
                    Err(e) => {
                        c.broken(&e);
                        return Err(lost_or_left(ctx, s.peer, &c.state));
                    }
                }
                let mut h = ctx.header(s.count, s.tag, r.start, r.len());
                if st.by_ref {
                    h.flags = FrameHeader::REMOTE;
                    let addr = s.data[r.start..].as_ptr() as u64;
                    st.at = PayloadRef { addr, offer }.encode();
                }
                st.hdr = h.encode();
            }
            let body = if st.by_ref {
                &st.at[st.payload_done..]
            } else {
                &s.data[r.start + st.payload_done..r.end]
            };
            let body_len = if st.by_ref { PAYLOAD_REF_LEN } else { r.len() };
            let bufs = [IoSlice::new(&st.hdr[st.hdr_done..]), IoSlice::new(body)];
            match c.link.write_vectored(&bufs) {
                Ok(0) => {
                    c.lose("the connection accepts no more bytes".into());
                    return Err(lost_or_left(ctx, s.peer, &c.state));
                }
                Ok(mut n) => {
                    moved = true;
                    let h = n.min(HEADER_LEN - st.hdr_done);
                    st.hdr_done += h;
                    n -= h;
                    st.payload_done += n;
                    if st.hdr_done == HEADER_LEN && st.payload_done == body_len {
                        st.frame += 1;
                        st.hdr_done = 0;
                        st.payload_done = 0;
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(moved),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => {
                    // The peer may have said why it left before its socket died (a clean
                    // `Close` or an abort naming the rank it lost): read that first.
                    c.drain();
                    c.broken(&e);
                    return Err(lost_or_left(ctx, s.peer, &c.state));
                }
            }
        }
        st.written = true;
        if st.by_ref {
            c.offered += 1;
            st.ack_at = Some(c.offered);
        } else {
            st.done = true;
        }
        Ok(true)
    }

    /// Reads as much of one message as the socket has, calling `on_frame` per complete frame.
    /// Returns whether any byte moved.
    fn drive_recv(
        &mut self,
        ctx: &StepCtx,
        idx: usize,
        inc: &mut Incoming<'_>,
        st: &mut RecvState,
        on_frame: &mut OnFrame<'_>,
    ) -> Result<bool> {
        let peer = inc.peer;
        let len = inc.buf.len();
        let cma = self.cma.as_ref();
        let Some(Some(c)) = self.conns.get_mut(peer) else {
            return Err(Error::invalid(
                ctx.rank,
                ctx.op.name(),
                format!("no connection to rank {peer}"),
            ));
        };
        let mut moved = false;
        loop {
            if !st.first && st.got == len && st.cur.is_none() {
                st.done = true;
                return Ok(true);
            }
            if c.has_partial() {
                match c.finish_stash() {
                    Ok(Io::Ready(true)) => moved = true,
                    Ok(Io::Ready(false)) => {
                        c.eof();
                        return Err(lost_or_left(ctx, peer, &c.state));
                    }
                    Ok(Io::WouldBlock) => return Ok(moved),
                    Err(e) => {
                        c.broken(&e);
                        return Err(lost_or_left(ctx, peer, &c.state));
                    }
                }
            }
            match st.cur {
                None => {
                    let stashed = c.stash.iter().position(|(h, _)| {
                        !matches!(
                            judge(ctx, h, peer, inc.count, inc.tag, st.got, len),
                            Ok(Verdict::Stash)
                        )
                    });
                    if let Some(p) = stashed {
                        let (h, payload) = c.stash.remove(p).expect("position is in range");
                        judge(ctx, &h, peer, inc.count, inc.tag, st.got, len)?;
                        let r = st.got..st.got + h.payload_len as usize;
                        match payload {
                            Payload::Inline(bytes) => inc.buf[r.clone()].copy_from_slice(&bytes),
                            Payload::Remote(at) => {
                                copy_by_ref(ctx, cma, c, peer, at, &mut inc.buf[r.clone()])?;
                                st.by_ref = true;
                            }
                        }
                        deliver(idx, inc, st, c, &h, r, on_frame)?;
                        moved = true;
                        continue;
                    }
                    if c.state != PeerState::Open && c.staged() == 0 {
                        return Err(lost_or_left(ctx, peer, &c.state));
                    }
                    let (h, at) = match c.read_header() {
                        Ok(Io::WouldBlock) => return Ok(moved),
                        Ok(Io::Ready(None)) => {
                            c.eof();
                            return Err(lost_or_left(ctx, peer, &c.state));
                        }
                        Ok(Io::Ready(Some(Ok(frame)))) => frame,
                        Ok(Io::Ready(Some(Err(e)))) => {
                            c.lose(format!("it sent bytes that are not a frame: {e}"));
                            return Err(lost_or_left(ctx, peer, &c.state));
                        }
                        Err(e) => {
                            c.broken(&e);
                            return Err(lost_or_left(ctx, peer, &c.state));
                        }
                    };
                    moved = true;
                    match judge(ctx, &h, peer, inc.count, inc.tag, st.got, len)? {
                        Verdict::Expected => match at {
                            None => st.cur = Some((h.payload_len as usize, 0)),
                            Some(at) => {
                                let r = st.got..st.got + h.payload_len as usize;
                                copy_by_ref(ctx, cma, c, peer, at, &mut inc.buf[r.clone()])?;
                                st.by_ref = true;
                                deliver(idx, inc, st, c, &h, r, on_frame)?;
                            }
                        },
                        Verdict::Stash => {
                            if let Err(why) = c.begin_stash((h, at)) {
                                c.lose(why);
                                return Err(lost_or_left(ctx, peer, &c.state));
                            }
                        }
                        // `read_header` noted the reason in the connection's state.
                        Verdict::Closed => {
                            return Err(match &c.state {
                                PeerState::Aborted(reason) => closed_error(ctx, peer, reason),
                                _ => closed_error(ctx, peer, &CloseReason::Goodbye),
                            });
                        }
                    }
                }
                Some((flen, done)) => {
                    let at = st.got + done;
                    let k = match c.read_payload(&mut inc.buf[at..st.got + flen]) {
                        Ok(Io::Ready(0)) if flen > done => {
                            c.eof();
                            return Err(lost_or_left(ctx, peer, &c.state));
                        }
                        Ok(Io::Ready(k)) => k,
                        Ok(Io::WouldBlock) => return Ok(moved),
                        Err(e) => {
                            c.broken(&e);
                            return Err(lost_or_left(ctx, peer, &c.state));
                        }
                    };
                    moved |= k > 0;
                    if done + k == flen {
                        let r = st.got..st.got + flen;
                        on_frame(idx, r.clone(), &mut inc.buf[r])?;
                        st.got += flen;
                        st.first = false;
                        st.cur = None;
                    } else {
                        st.cur = Some((flen, done + k));
                    }
                }
            }
        }
    }

    /// See [`crate::transport::Transport::probe`]. Between steps every connection is at a
    /// frame boundary (or mid-way through a stashed frame), so draining it is always safe.
    pub(super) fn probe(&mut self, peer: usize, tag: u32) -> bool {
        let Some(Some(c)) = self.conns.get_mut(peer) else {
            return false;
        };
        c.drain();
        let arrived = c
            .stash
            .iter()
            .any(|(h, _)| h.op == CollectiveOp::SendRecv && h.tag == tag);
        arrived || c.state != PeerState::Open
    }

    /// Tells every open peer (but a lost one) that this rank aborts the group, and why. The
    /// notice goes after whatever this rank owes the peer on the stream (the rest of a frame
    /// it was in the middle of, queued acknowledgements), so it always lands on a frame
    /// boundary; what the socket does not take now, [`Engine::close`] delivers.
    fn notify_abort(
        &mut self,
        rank: usize,
        reason: &CloseReason,
        seg: usize,
        sends: &[Outgoing<'_>],
        tx: &[SendState],
    ) {
        let notice = reason.encode(rank as u32);
        let lost = match reason {
            CloseReason::Lost { culprit } => Some(*culprit as usize),
            _ => None,
        };
        for (p, c) in self.conns.iter_mut().enumerate() {
            let Some(c) = c else { continue };
            if Some(p) == lost || c.state != PeerState::Open {
                continue;
            }
            // At most one message per peer is under way (the others queue behind it).
            let rest = sends
                .iter()
                .zip(tx)
                .find(|(s, st)| {
                    s.peer == p && !st.written && (st.hdr_done > 0 || st.payload_done > 0)
                })
                .map(|(s, st)| {
                    let mut rest = st.hdr[st.hdr_done..].to_vec();
                    if st.by_ref {
                        rest.extend_from_slice(&st.at[st.payload_done..]);
                    } else {
                        let len = s.data.len();
                        let end = ((st.frame + 1) * seg).min(len);
                        let at = (st.frame * seg).min(len) + st.payload_done;
                        rest.extend_from_slice(&s.data[at..end]);
                    }
                    rest
                })
                .unwrap_or_default();
            c.queue_notice(&rest, &notice);
            if let Err(e) = c.flush_out() {
                c.broken(&e);
            }
        }
    }

    /// Says goodbye to every peer still connected: writes what is queued for it and a `Close`
    /// frame, shuts down the write side, then hands the connection to [`linger`] to be read
    /// until the peer closes its end (at most [`Engine::linger`]). Connections to peers that
    /// are gone are dropped. An aborted mesh says no goodbye: it only delivers the abort
    /// notices still queued (within [`ABORT_LINGER`]) and drops the other connections, which
    /// its peers then see end without a goodbye, as after a crash.
    pub(super) fn close(&mut self, rank: usize) {
        let linger = if self.aborted {
            self.linger.min(ABORT_LINGER)
        } else {
            self.linger
        };
        let deadline = dist_backend::deadline_after(Instant::now(), linger);
        let bye = if self.aborted {
            Vec::new()
        } else {
            CloseReason::Goodbye.encode(rank as u32)
        };
        let mut streams = Vec::new();
        for (peer, slot) in self.conns.iter_mut().enumerate() {
            let Some(c) = slot.take() else { continue };
            // A notice already handed to the kernel may still sit in its send queue (the peer's
            // window full): a close with unread input would reset the connection and lose it,
            // so every notified peer gets the lingering close too.
            let say_bye = if self.aborted {
                c.state == PeerState::Open && (c.has_out() || c.notified)
            } else {
                matches!(c.state, PeerState::Open | PeerState::Left)
            };
            let (mut link, pending) = c.into_parts();
            let _ = self.poll.registry().deregister(link.stream_mut());
            if !say_bye {
                continue;
            }
            match link.finish(&pending, &bye, deadline) {
                Ok(stream) => streams.push((peer, stream)),
                Err(e) => {
                    tracing::debug!(rank, peer, error = %e, "could not say goodbye to a peer");
                }
            }
        }
        linger::linger(rank, streams, deadline);
    }
}

/// Hands a frame that is whole in `inc.buf[r]` to `on_frame`; once a message that came by
/// reference is whole, queues its acknowledgement so the sender can reuse its buffer.
fn deliver(
    idx: usize,
    inc: &mut Incoming<'_>,
    st: &mut RecvState,
    c: &mut Conn,
    h: &FrameHeader,
    r: std::ops::Range<usize>,
    on_frame: &mut OnFrame<'_>,
) -> Result<()> {
    st.got = r.end;
    st.first = false;
    if st.by_ref && st.got == inc.buf.len() {
        c.queue_ack(h);
    }
    on_frame(idx, r.clone(), &mut inc.buf[r])
}

/// Copies a frame `peer` sent by reference; a failure means the peer is gone or gave up.
fn copy_by_ref(
    ctx: &StepCtx,
    cma: Option<&Cma>,
    c: &mut Conn,
    peer: usize,
    at: PayloadRef,
    dst: &mut [u8],
) -> Result<()> {
    let r = match cma {
        Some(cma) => cma.copy_in(peer, at, dst),
        None => Err("it sent a frame by reference, which this rank never agreed to".into()),
    };
    r.map_err(|why| {
        // A sender that gives up after losing another rank says so on the socket before it
        // withdraws its offer: read that notice, if any, so the error names the lost rank.
        c.drain();
        c.lose(why);
        lost_or_left(ctx, peer, &c.state)
    })
}
