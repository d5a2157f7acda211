//! The progress engine: drives every send and receive of a step over non-blocking sockets
//! until all are done, a peer fails, or the deadline passes.

use std::io::{self, IoSlice, Write};
use std::time::{Duration, Instant};

use dist_backend::{Error, Result};
use dist_wire::{CollectiveOp, FrameHeader, HEADER_LEN, PAYLOAD_REF_LEN, PayloadRef};
use mio::{Events, Poll};

use super::cma::Cma;
use super::conn::{Conn, Io, Payload, PeerState};
use super::linger;
use crate::transport::{Incoming, OnFrame, Outgoing, StepCtx, Verdict, frames, judge};

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
    /// Single-copy transfers with the peers on this host, when they are possible.
    pub(super) cma: Option<Cma>,
    /// How long closing waits for each peer to close its end (the group's timeout).
    pub(super) linger: Duration,
}

/// Whether message `i` must wait for an earlier, unfinished message with the same peer.
fn queued_behind(i: usize, peer: impl Fn(usize) -> usize, done: impl Fn(usize) -> bool) -> bool {
    (0..i).any(|j| peer(j) == peer(i) && !done(j))
}

fn lost_or_left(ctx: &StepCtx, peer: usize, state: &PeerState) -> Error {
    match state {
        PeerState::Lost(why) => ctx.peer_lost(peer, why.clone()),
        PeerState::Aborted { culprit } if *culprit != ctx.rank => ctx.peer_lost(
            *culprit,
            format!("rank {peer} reported it lost and aborted the group"),
        ),
        PeerState::Aborted { .. } => ctx.peer_lost(
            peer,
            "it aborted the group because of this rank (a mismatched operation, or a \
             connection it lost)",
        ),
        _ => ctx.peer_lost(
            peer,
            "it left the group (destroyed its process group) before this operation",
        ),
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

    /// Runs one step (see [`Engine::run_step`]); when it fails because a peer was lost, tells
    /// every other peer which rank was lost before returning, so that they report the rank
    /// that actually died rather than this one, whose sockets close when it exits.
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
        let r = self.run_step(ctx, seg, sends, recvs, on_frame, &mut mid_frame);
        // Every peer must learn that this rank gives up, even one this step does not involve
        // (it ignores an uninvolved peer's EOF, which may be a clean exit) and one that
        // caused it.
        match &r {
            Err(Error::PeerLost { peer, .. }) => self.notify_abort(ctx.rank, *peer, &mid_frame),
            Err(Error::Mismatch { theirs, .. }) => {
                self.notify_abort(ctx.rank, theirs.rank, &mid_frame);
            }
            _ => {}
        }
        // Whatever happened, the caller gets its buffers back now: `_withdraw` makes sure no
        // peer may copy them after this. (After the abort notice, so that a peer whose copy
        // fails on the withdrawal finds the notice naming the rank that was really lost.)
        r
    }

    fn run_step(
        &mut self,
        ctx: &StepCtx,
        seg: usize,
        sends: &[Outgoing<'_>],
        recvs: &mut [Incoming<'_>],
        on_frame: &mut OnFrame<'_>,
        mid_frame: &mut [bool],
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
        let mut tx: Vec<SendState> = sends
            .iter()
            .map(|s| SendState {
                frame: 0,
                hdr: [0; HEADER_LEN],
                hdr_done: 0,
                payload_done: 0,
                by_ref: cma.is_some_and(|c| c.by_reference(s.peer, s.data.len())),
                at: [0; PAYLOAD_REF_LEN],
                written: false,
                ack_at: None,
                done: false,
            })
            .collect();
        if let Some(cma) = cma {
            for (s, st) in sends.iter().zip(&tx) {
                if st.by_ref {
                    cma.publish(s.peer, offer);
                }
            }
        }
        let mut rx: Vec<RecvState> = recvs
            .iter()
            .map(|_| RecvState {
                got: 0,
                cur: None,
                first: true,
                by_ref: false,
                done: false,
            })
            .collect();
        let mut spin_until: Option<Instant> = None;
        loop {
            let mut progress = false;
            let mut pending = false;
            for i in 0..sends.len() {
                if tx[i].done {
                    continue;
                }
                pending = true;
                if tx[i].written {
                    progress |= self.await_ack(ctx, &sends[i], &mut tx[i], recvs, &rx)?;
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
                continue;
            }
            let now = Instant::now();
            if now >= ctx.deadline {
                let mut missing: Vec<usize> = recvs
                    .iter()
                    .zip(&rx)
                    .filter(|(_, s)| !s.done)
                    .map(|(r, _)| r.peer)
                    .collect();
                missing.extend(
                    sends
                        .iter()
                        .zip(&tx)
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
                std::thread::yield_now();
                continue;
            }
            self.wait(ctx, recvs, &rx, ctx.deadline - now)?;
        }
    }

    /// Sleeps in the poller until some socket is ready, draining sockets the step does not
    /// receive from and failing if one of them turns out lost.
    fn wait(
        &mut self,
        ctx: &StepCtx,
        recvs: &[Incoming<'_>],
        rx: &[RecvState],
        timeout: Duration,
    ) -> Result<()> {
        // Cap each sleep so a lost wake-up can only cost latency, never a hang.
        let timeout = timeout.min(Duration::from_millis(100));
        if let Err(e) = self.poll.poll(&mut self.events, Some(timeout))
            && e.kind() != io::ErrorKind::Interrupted
        {
            return Err(Error::Io {
                rank: ctx.rank,
                context: format!("{} #{}: polling sockets", ctx.op, ctx.seq),
                source: e,
            });
        }
        let ready: Vec<usize> = self.events.iter().map(|ev| ev.token().0).collect();
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
                    PeerState::Aborted { .. } => return Err(lost_or_left(ctx, peer, &c.state)),
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
            match c.stream.write_vectored(&bufs) {
                Ok(0) => {
                    c.state = PeerState::Lost("the connection accepts no more bytes".into());
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
                            c.state =
                                PeerState::Lost(format!("it sent bytes that are not a frame: {e}"));
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
                                c.state = PeerState::Lost(why);
                                return Err(lost_or_left(ctx, peer, &c.state));
                            }
                        }
                        Verdict::Closed(tag) if tag != 0 => {
                            c.state = PeerState::closed(tag);
                            return Err(lost_or_left(ctx, peer, &c.state));
                        }
                        Verdict::Closed(_) => {
                            c.state = PeerState::Left;
                            return Err(ctx.peer_lost(peer, "it left the group (destroyed its process group) during this operation"));
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
                        on_frame(idx, r.clone(), &inc.buf[r])?;
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

    /// Best-effort notice to every open peer not in the middle of a frame from us (the culprit
    /// included, when it is still there, as after a mismatch): this rank is aborting because of
    /// `culprit`.
    fn notify_abort(&mut self, rank: usize, culprit: usize, mid_frame: &[bool]) {
        let h = close_frame(rank, culprit as u32 + 1);
        for (p, c) in self.conns.iter_mut().enumerate() {
            if let Some(c) = c
                && c.state == PeerState::Open
                && !mid_frame.get(p).copied().unwrap_or(true)
                && (!c.out_mid_frame() || c.flush_out().unwrap_or(false))
            {
                let _ = c.stream.write(&h);
            }
        }
    }

    /// Says goodbye to every peer still connected: writes what is queued for it and a `Close`
    /// frame, shuts down the write side, then hands the connection to [`linger`] to be read
    /// until the peer closes its end (at most [`Engine::linger`]). Connections to peers that
    /// are gone are dropped.
    pub(super) fn close(&mut self, rank: usize) {
        let deadline = dist_backend::deadline_after(Instant::now(), self.linger);
        let bye = close_frame(rank, 0);
        let mut streams = Vec::new();
        for (peer, slot) in self.conns.iter_mut().enumerate() {
            let Some(c) = slot.take() else { continue };
            let say_bye = matches!(c.state, PeerState::Open | PeerState::Left);
            let (mut stream, pending) = c.into_parts();
            let _ = self.poll.registry().deregister(&mut stream);
            let mut stream = std::net::TcpStream::from(stream);
            if !say_bye {
                continue;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            let said = stream
                .set_nonblocking(false)
                .and_then(|()| stream.set_write_timeout(Some(left.max(Duration::from_millis(1)))))
                .and_then(|()| stream.write_all(&pending))
                .and_then(|()| stream.write_all(&bye))
                .and_then(|()| stream.shutdown(std::net::Shutdown::Write));
            match said {
                Ok(()) => streams.push((peer, stream)),
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
    on_frame(idx, r.clone(), &inc.buf[r])
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
        if c.state == PeerState::Open {
            c.state = PeerState::Lost(why);
        }
        lost_or_left(ctx, peer, &c.state)
    })
}

/// A `Close` frame: tag 0 for a clean exit, `q + 1` for an abort after losing rank q.
fn close_frame(rank: usize, tag: u32) -> [u8; HEADER_LEN] {
    FrameHeader {
        op: CollectiveOp::Close,
        dtype: dist_wire::DType::U8,
        reduce: 0,
        group: 0,
        sender: rank as u32,
        seq: 0,
        count: 0,
        root: dist_wire::NO_ROOT,
        tag,
        offset: 0,
        payload_len: 0,
        flags: 0,
    }
    .encode()
}
