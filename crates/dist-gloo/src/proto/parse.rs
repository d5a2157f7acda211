//! The receive side of a connection: parsing staged bytes into frames, delivering the ones
//! the step expects and stashing the others.

use dist_wire::{CloseReason, CollectiveOp, FrameHeader, HEADER_LEN};

use super::conn::{Conn, MAX_STASHED_FRAME};
use super::step::Step;
use crate::transport::{Incoming, OnFrame, Verdict, judge};

/// Parses what `conn` has staged: delivers the frames the step expects (into their buffers,
/// then to `on_frame`), stashes the others, notes `Close` frames and corrupt input. Stops at
/// an incomplete frame.
pub(super) fn process(
    conn: &mut Conn,
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
            v[*filled..*filled + k].copy_from_slice(&conn.stage[conn.start..conn.start + k]);
            conn.start += k;
            *filled += k;
            if *filled < v.len() {
                return;
            }
            let (h, v, _) = conn.partial.take().expect("checked above");
            conn.stash.push_back((h, v));
            continue;
        }
        let cur = step.current_recv(recvs, peer);
        if let Some(i) = cur {
            let ctx = step.ctx.expect("a live step has a context");
            let inc = &mut recvs[i];
            let len = inc.buf.len();
            let st = &mut step.rx[i];
            if !st.first && st.got == len && st.cur.is_none() {
                st.done = true;
                continue;
            }
            if let Some((flen, done)) = st.cur {
                let k = conn.staged().min(flen - done);
                let at = st.got + done;
                inc.buf[at..at + k].copy_from_slice(&conn.stage[conn.start..conn.start + k]);
                conn.start += k;
                if done + k < flen {
                    st.cur = Some((flen, done + k));
                    return;
                }
                st.cur = None;
                let r = st.got..st.got + flen;
                st.got = r.end;
                st.first = false;
                if let Err(e) = on_frame(i, r.clone(), &mut inc.buf[r]) {
                    step.fail(e);
                }
                continue;
            }
            // A frame boundary: a frame that came early may be the one wanted.
            let (count, tag, got) = (inc.count, inc.tag, st.got);
            let stashed = conn.stash.iter().position(|(h, _)| {
                !matches!(
                    judge(&ctx, h, peer, count, tag, got, len),
                    Ok(Verdict::Stash)
                )
            });
            if let Some(p) = stashed {
                match judge(&ctx, &conn.stash[p].0, peer, count, tag, got, len) {
                    Ok(Verdict::Expected) => {
                        let (_, payload) = conn.stash.remove(p).expect("position is in range");
                        let r = got..got + payload.len();
                        inc.buf[r.clone()].copy_from_slice(&payload);
                        st.got = r.end;
                        st.first = false;
                        if let Err(e) = on_frame(i, r.clone(), &mut inc.buf[r]) {
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
        if h.flags & (FrameHeader::ACK | FrameHeader::REMOTE) != 0 {
            conn.lose(
                "it sent a frame by reference (or acknowledged one), which this connection never agreed to"
                    .into(),
            );
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
        let verdict = cur.map(|i| {
            let ctx = step.ctx.expect("a live step has a context");
            let inc = &recvs[i];
            judge(
                &ctx,
                &h,
                peer,
                inc.count,
                inc.tag,
                step.rx[i].got,
                inc.buf.len(),
            )
        });
        match verdict {
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

/// Starts stashing a frame whose header has been read.
fn begin_stash(conn: &mut Conn, h: FrameHeader) {
    if h.payload_len > MAX_STASHED_FRAME {
        conn.lose(format!(
            "frame of {} bytes exceeds the {MAX_STASHED_FRAME}-byte limit (corrupt stream?)",
            h.payload_len
        ));
        return;
    }
    conn.partial = Some((h, vec![0; h.payload_len as usize], 0));
}
