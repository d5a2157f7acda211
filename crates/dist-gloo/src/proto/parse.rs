//! The receive side of a connection: parsing staged bytes into frames, delivering the ones
//! the step expects and stashing the others.

use std::ops::Range;

use dist_backend::Result;
use dist_wire::{CloseReason, CollectiveOp, FrameHeader, HEADER_LEN, PAYLOAD_REF_LEN, PayloadRef};

use super::CopyIn;
use super::conn::{Conn, MAX_STASHED_FRAME, Payload};
use super::step::{Rx, Step};
use crate::transport::{Incoming, OnFrame, Verdict, is_advisory, judge, stale_advisory};

/// Parses what `conn` has staged: delivers the frames the step expects (into their buffers,
/// copying those sent by reference with `copier`, then to `on_frame`), stashes the others,
/// counts acknowledgements, notes `Close` frames and corrupt input. Stops at an incomplete
/// frame.
pub(super) fn process(
    conn: &mut Conn,
    copier: Option<&dyn CopyIn>,
    step: &mut Step,
    recvs: &mut [Incoming<'_>],
    peer: usize,
    on_frame: &mut OnFrame<'_>,
) {
    if step.live().is_none() {
        // A failed step leaves a frame it was reading half read: the rest of its payload is
        // skipped, so that the stream stays readable for the notices after it.
        for rx in step.rx.iter_mut().filter(|r| r.peer == peer) {
            if let Some((flen, done)) = rx.cur.take() {
                conn.skip += flen - done;
            }
        }
    }
    loop {
        if conn.skip > 0 {
            let k = conn.skip.min(conn.staged());
            conn.start += k;
            conn.skip -= k;
            if conn.skip > 0 {
                return;
            }
        }
        if let Some((_, v, filled)) = &mut conn.partial {
            let k = conn.end.saturating_sub(conn.start).min(v.len() - *filled);
            dist_simd::copy::bulk(
                &mut v[*filled..*filled + k],
                &conn.stage[conn.start..conn.start + k],
            );
            conn.start += k;
            *filled += k;
            if *filled < v.len() {
                return;
            }
            let (h, v, _) = conn.partial.take().expect("checked above");
            conn.stash.push_back((h, Payload::Inline(v)));
            continue;
        }
        // Nothing more is delivered from a peer whose offer vanished under a copy.
        let cur = if conn.suspect.is_some() {
            None
        } else {
            step.current_recv(recvs, peer)
        };
        if let Some(i) = cur {
            let ctx = step.ctx.expect("a live step has a context");
            let inc = &mut recvs[i];
            let len = inc.message_len();
            let st = &mut step.rx[i];
            if !st.first && st.got == len && st.cur.is_none() {
                st.done = true;
                continue;
            }
            if let Some((flen, done)) = st.cur {
                let k = conn.staged().min(flen - done);
                let at = st.got + done;
                dist_simd::copy::bulk(
                    inc.slot(at..at + k),
                    &conn.stage[conn.start..conn.start + k],
                );
                conn.start += k;
                if done + k < flen {
                    st.cur = Some((flen, done + k));
                    return;
                }
                st.cur = None;
                let r = st.got..st.got + flen;
                if let Err(e) = deliver(conn, st, inc, i, None, r, on_frame) {
                    step.fail(e);
                }
                continue;
            }
            // A frame boundary: a frame that came early may be the one wanted.
            let got = st.got;
            let stashed = conn.stash.iter().position(|(h, _)| {
                !is_advisory(h) && !matches!(judge(&ctx, h, peer, inc, got), Ok(Verdict::Stash))
            });
            if let Some(p) = stashed {
                match judge(&ctx, &conn.stash[p].0, peer, inc, got) {
                    Ok(Verdict::Expected) => {
                        let (h, payload) = conn.stash.remove(p).expect("position is in range");
                        let r = got..got + h.payload_len as usize;
                        let by_ref = match payload {
                            Payload::Inline(bytes) => {
                                dist_simd::copy::bulk(inc.slot(r.clone()), &bytes);
                                None
                            }
                            Payload::Remote(at) => {
                                match copy(copier, peer, h.op, at, inc.slot(r.clone())) {
                                    Ok(()) => Some(h),
                                    Err(why) => {
                                        conn.suspect = Some(why);
                                        continue;
                                    }
                                }
                            }
                        };
                        if let Err(e) = deliver(conn, st, inc, i, by_ref, r, on_frame) {
                            step.fail(e);
                        }
                    }
                    Err(e) => step.fail(e),
                    // `Close` is never stashed, and `Stash` was filtered out.
                    Ok(Verdict::Stash | Verdict::Closed) => {}
                }
                continue;
            }
        }
        // Nothing follows a `Close` (or the end of the input) but what was stashed before it.
        if conn.input_done {
            conn.start = conn.end;
            return;
        }
        if conn.staged() < HEADER_LEN {
            return;
        }
        let h = match FrameHeader::decode(&conn.stage[conn.start..conn.end]) {
            Ok(h) => h,
            Err(e) => {
                conn.lose(format!("it sent bytes that are not a frame: {e}"));
                continue;
            }
        };
        if h.flags & FrameHeader::ACK != 0 {
            if conn.acked >= conn.offered {
                conn.lose("it acknowledged a message this rank never sent by reference".into());
                continue;
            }
            conn.acked += 1;
            conn.start += HEADER_LEN;
            continue;
        }
        if h.flags & FrameHeader::REMOTE != 0 && h.op != CollectiveOp::Close {
            if copier.is_none() {
                conn.lose(
                    "it sent a frame by reference, which this connection never agreed to".into(),
                );
                continue;
            }
            // Consumed only together with its reference.
            if conn.staged() < HEADER_LEN + PAYLOAD_REF_LEN {
                return;
            }
            let body = conn.start + HEADER_LEN;
            let at = match PayloadRef::decode(&conn.stage[body..conn.end]) {
                Ok(at) => at,
                Err(e) => {
                    conn.lose(format!("its frame by reference is corrupt: {e}"));
                    continue;
                }
            };
            conn.start += HEADER_LEN + PAYLOAD_REF_LEN;
            match verdict(step, recvs, cur, &h, peer) {
                Some(Ok(Verdict::Expected)) => {
                    let i = cur.expect("a verdict needs a receive");
                    let (inc, st) = (&mut recvs[i], &mut step.rx[i]);
                    let r = st.got..st.got + h.payload_len as usize;
                    if let Err(why) = copy(copier, peer, h.op, at, inc.slot(r.clone())) {
                        conn.suspect = Some(why);
                        continue;
                    }
                    if let Err(e) = deliver(conn, st, inc, i, Some(h), r, on_frame) {
                        step.fail(e);
                    }
                }
                Some(Err(e)) => {
                    conn.push_stashed(h, Payload::Remote(at));
                    step.fail(e);
                }
                Some(Ok(Verdict::Stash | Verdict::Closed)) | None => {
                    conn.push_stashed(h, Payload::Remote(at));
                }
            }
            continue;
        }
        if is_advisory(&h) {
            // No receive takes it: kept for the judgement of the operation it belongs to
            // (`stashed_conflict`), dropped when that one is over.
            conn.start += HEADER_LEN;
            if !step.ctx.is_some_and(|c| stale_advisory(&c, &h)) {
                conn.push_stashed(h, Payload::Inline(Vec::new()));
                conn.advisories += 1;
            }
            continue;
        }
        if h.op == CollectiveOp::Close {
            // Read whole (its payload is at most `MAX_CLOSE_PAYLOAD` bytes, which the decoder
            // checked), so that the reason is known the moment the frame is.
            let len = HEADER_LEN + h.payload_len as usize;
            if conn.staged() < len {
                return;
            }
            let reason =
                CloseReason::decode(&h, &conn.stage[conn.start + HEADER_LEN..conn.start + len]);
            conn.start += len;
            match reason {
                Ok(r) => conn.closed(r),
                Err(e) => conn.lose(format!("its close frame is corrupt: {e}")),
            }
            continue;
        }
        conn.start += HEADER_LEN;
        match verdict(step, recvs, cur, &h, peer) {
            Some(Ok(Verdict::Expected)) => {
                let i = cur.expect("a verdict needs a receive");
                step.rx[i].cur = Some((h.payload_len as usize, 0));
            }
            Some(Err(e)) => {
                // Kept whole, so that the stream stays readable for the notices after it.
                begin_stash(conn, h);
                step.fail(e);
            }
            Some(Ok(Verdict::Stash | Verdict::Closed)) | None => begin_stash(conn, h),
        }
    }
}

/// How the header `h` from `peer` fits receive `cur` of the step, if it has one.
fn verdict(
    step: &Step,
    recvs: &[Incoming<'_>],
    cur: Option<usize>,
    h: &FrameHeader,
    peer: usize,
) -> Option<Result<Verdict>> {
    let i = cur?;
    let ctx = step.ctx.expect("a live step has a context");
    let inc = &recvs[i];
    let got = step.rx[i].got;
    Some(judge(&ctx, h, peer, inc, got))
}

/// Hands the frame now whole in `inc.slot(r)` (receive `i`) to `on_frame`. `by_ref` is the
/// header of a frame that came by reference: once such a message is whole, its
/// acknowledgement is queued so that the sender may reuse its buffer.
fn deliver(
    conn: &mut Conn,
    st: &mut Rx,
    inc: &mut Incoming<'_>,
    i: usize,
    by_ref: Option<FrameHeader>,
    r: Range<usize>,
    on_frame: &mut OnFrame<'_>,
) -> Result<()> {
    st.got = r.end;
    st.first = false;
    st.by_ref |= by_ref.is_some();
    if st.by_ref
        && st.got == inc.message_len()
        && let Some(h) = by_ref
    {
        conn.queue_ack(&h);
    }
    on_frame(i, r.clone(), inc.slot(r))
}

/// Copies a frame `peer` sent by reference.
fn copy(
    copier: Option<&dyn CopyIn>,
    peer: usize,
    op: CollectiveOp,
    at: PayloadRef,
    dst: &mut [u8],
) -> std::result::Result<(), String> {
    match copier {
        Some(c) => c.copy_in(peer, op, at, dst),
        None => Err("it sent a frame by reference, which this rank never agreed to".into()),
    }
}

/// Starts stashing a frame whose header has been read.
fn begin_stash(conn: &mut Conn, h: FrameHeader) {
    if h.payload_len > MAX_STASHED_FRAME {
        conn.lose(format!(
            "frame of {} bytes exceeds the {MAX_STASHED_FRAME}-byte limit (corrupt stream?)",
            h.payload_len
        ));
        return;
    }
    conn.note_stashed(&h);
    conn.partial = Some((h, vec![0; h.payload_len as usize], 0));
}
