//! Two cores wired back to back, one byte stream each way, moved by hand: the rules at the
//! boundaries the simulation (`tests/sim/`) reaches only by chance.

use std::ops::Range;
use std::time::{Duration, Instant};

use dist_backend::Error;
use dist_wire::{CloseReason, CollectiveOp, DType, FrameHeader, HEADER_LEN};

use super::{Core, PeerState, Status, Step};
use crate::transport::{Incoming, OnFrame, Outgoing, StepCtx};

fn ctx(rank: usize, op: CollectiveOp, seq: u64, t0: Instant) -> StepCtx {
    StepCtx::started_at(rank, 1, op, seq, DType::U8, t0, Duration::from_secs(10))
}

/// Moves at most `chunk` bytes at a time of what `a` transmits to `peer` into `b` (whose
/// rank is `peer`), until `a` has nothing more. Returns the bytes moved.
#[allow(
    clippy::too_many_arguments,
    reason = "both ends of one stream, borrowed apart"
)]
fn pump(
    a: &mut Core,
    a_step: &mut Step,
    sends: &[Outgoing<'_>],
    b: &mut Core,
    b_step: &mut Step,
    recvs: &mut [Incoming<'_>],
    chunk: usize,
    on_frame: &mut OnFrame<'_>,
) -> usize {
    let mut moved = 0;
    loop {
        match pump_once(a, a_step, sends, b, b_step, recvs, chunk, on_frame) {
            0 => return moved,
            k => moved += k,
        }
    }
}

/// [`pump`]'s one move: at most `chunk` bytes of what `a` transmits, fed to `b`. Returns the
/// bytes moved (0 when `a` has nothing to send).
#[allow(
    clippy::too_many_arguments,
    reason = "both ends of one stream, borrowed apart"
)]
fn pump_once(
    a: &mut Core,
    a_step: &mut Step,
    sends: &[Outgoing<'_>],
    b: &mut Core,
    b_step: &mut Step,
    recvs: &mut [Incoming<'_>],
    chunk: usize,
    on_frame: &mut OnFrame<'_>,
) -> usize {
    let (from, to) = (a.rank(), b.rank());
    let parts = a.transmit(a_step, sends, to);
    let mut bytes: Vec<u8> = parts.concat();
    bytes.truncate(chunk);
    a.transmitted(a_step, sends, to, bytes.len());
    let mut at = 0;
    while at < bytes.len() {
        let buf = b.read_buf(b_step, recvs, from);
        let k = buf.len().min(bytes.len() - at);
        buf[..k].copy_from_slice(&bytes[at..at + k]);
        b.received(b_step, recvs, from, k, on_frame);
        at += k;
    }
    bytes.len()
}

/// Rank 0 (`.0`, its step `.1`, its send `.2`) about to send rank 1 (`.3`, `.4`, its receive
/// `.5`) all of `data` into `got` in an all_gather step, tag 3, in 16-byte frames.
type Pair<'a> = (Core, Step, [Outgoing<'a>; 1], Core, Step, [Incoming<'a>; 1]);

fn sending<'a>(data: &'a [u8], got: &'a mut [u8], t0: Instant) -> Pair<'a> {
    let (a, b) = (Core::new(0, 2, 16), Core::new(1, 2, 16));
    let count = data.len() as u64;
    let sends = [Outgoing {
        peer: 1,
        data,
        count,
        tag: 3,
    }];
    let recvs = [Incoming {
        peer: 0,
        buf: got,
        count,
        tag: 3,
        streamed: None,
        seq_ahead: 0,
    }];
    let c = ctx(0, CollectiveOp::AllGather, 1, t0);
    let sa = a.begin(c, &sends, &[]);
    let sb = b.begin(StepCtx { rank: 1, ..c }, &[], &recvs);
    (a, sa, sends, b, sb, recvs)
}

#[test]
fn a_message_cut_at_every_byte_arrives_whole_frame_by_frame() {
    let t0 = Instant::now();
    let data: Vec<u8> = (0..100u8).collect();
    for chunk in [1, 7, 64, 1000] {
        let mut got = vec![0u8; 100];
        let (mut a, mut sa, sends, mut b, mut sb, mut recvs) = sending(&data, &mut got, t0);
        let mut frames = Vec::new();
        let mut on_frame = |i: usize, r: Range<usize>, _: &mut [u8]| {
            frames.push((i, r));
            Ok(())
        };
        pump(
            &mut a,
            &mut sa,
            &sends,
            &mut b,
            &mut sb,
            &mut recvs,
            chunk,
            &mut on_frame,
        );
        assert_eq!(
            a.poll(&mut sa, &sends, &mut [], &mut |_, _, _| Ok(()), t0),
            Status::Done
        );
        assert_eq!(
            b.poll(&mut sb, &[], &mut recvs, &mut on_frame, t0),
            Status::Done
        );
        assert_eq!(got, data, "chunk {chunk}");
        let want: Vec<(usize, Range<usize>)> = (0..7)
            .map(|f| (0, f * 16..(f * 16 + 16).min(100)))
            .collect();
        assert_eq!(frames, want, "chunk {chunk}");
    }
}

/// A step that fails while half-way through writing a frame queues its abort notice after the
/// rest of that frame, so the peer reads the frame whole and then the notice naming the
/// culprit; and what a peer said first sticks over the EOF after it.
#[test]
fn an_abort_notice_follows_the_rest_of_a_half_written_frame_and_sticks() {
    let t0 = Instant::now();
    let (mut a, mut b) = (Core::new(0, 3, 64), Core::new(1, 3, 64));
    let data = vec![5u8; 200];
    let sends = [Outgoing {
        peer: 1,
        data: &data,
        count: 200,
        tag: 0,
    }];
    // Rank 0 also waits for rank 2, whose connection then ends without a goodbye.
    let mut from2 = [0u8; 4];
    let mut a_recvs = [Incoming {
        peer: 2,
        buf: &mut from2,
        count: 4,
        tag: 0,
        streamed: None,
        seq_ahead: 0,
    }];
    let c = ctx(0, CollectiveOp::AllReduce, 4, t0);
    let mut sa = a.begin(c, &sends, &a_recvs);
    // Rank 1 is in the next operation already: rank 0's frames are not what it expects.
    let mut idle = Step::idle();
    let parts = a.transmit(&mut sa, &sends, 1);
    let half = parts[0].len() + 10;
    let first: Vec<u8> = parts.concat()[..half].to_vec();
    a.transmitted(&mut sa, &sends, 1, half);
    a.eof(2);
    assert_eq!(
        a.poll(&mut sa, &sends, &mut a_recvs, &mut |_, _, _| Ok(()), t0),
        Status::Failed
    );
    let e = a.finish(&mut sa, &sends, t0).unwrap_err();
    assert!(
        matches!(
            &e,
            Error::PeerLost {
                rank: 0,
                peer: 2,
                ..
            }
        ),
        "{e}"
    );
    // What rank 0 still owes rank 1: the rest of the frame (54 payload bytes), then the notice.
    let rest: Vec<u8> = a.transmit(&mut idle, &[], 1).concat();
    let notice = CloseReason::Lost { culprit: 2 }.encode(0);
    assert_eq!(rest.len(), 64 - 10 + notice.len());
    assert_eq!(&rest[64 - 10..], &notice[..]);
    let mut noop = |_: usize, _: Range<usize>, _: &mut [u8]| Ok(());
    for bytes in [&first[..], &rest[..]] {
        for &byte in bytes {
            let buf = b.read_buf(&idle, &mut [], 0);
            buf[0] = byte;
            b.received(&mut idle, &mut [], 0, 1, &mut noop);
        }
    }
    b.eof(0);
    assert_eq!(
        b.peer_state(0),
        Some(&PeerState::Aborted(CloseReason::Lost { culprit: 2 }))
    );
    // Rank 1 (arriving late in the same step) reads the whole frame, then fails naming the
    // rank that rank 0 lost.
    let mut buf = vec![0u8; 200];
    let mut recvs = [Incoming {
        peer: 0,
        buf: &mut buf,
        count: 200,
        tag: 0,
        streamed: None,
        seq_ahead: 0,
    }];
    let mut sb = b.begin(StepCtx { rank: 1, ..c }, &[], &recvs);
    let mut delivered = Vec::new();
    let mut seen = |_: usize, r: Range<usize>, _: &mut [u8]| {
        delivered.push(r);
        Ok(())
    };
    assert_eq!(
        b.poll(&mut sb, &[], &mut recvs, &mut seen, t0),
        Status::Failed
    );
    match b.finish(&mut sb, &[], t0).unwrap_err() {
        Error::PeerLost {
            rank: 1, peer: 2, ..
        } => {}
        other => panic!("expected PeerLost naming rank 2, got {other}"),
    }
    assert_eq!(delivered, vec![0..64usize]);
    assert_eq!(&buf[..64], &[5u8; 64][..]);
}

/// A peer reads nothing after the first abort notice (the first thing learnt sticks), so a
/// later step of the aborted group that fails too (a root judging, with a deadline already
/// past, what it holds after a relayed disagreement) queues no second one.
#[test]
fn each_peer_is_sent_one_abort_notice() {
    let t0 = Instant::now();
    let mut a = Core::new(0, 3, 64);
    let mut noop = |_: usize, _: Range<usize>, _: &mut [u8]| Ok(());
    let mut idle = Step::idle();
    fn wait_for(peer: usize, buf: &mut [u8; 4]) -> [Incoming<'_>; 1] {
        [Incoming {
            peer,
            buf,
            count: 4,
            tag: 0,
            streamed: None,
            seq_ahead: 0,
        }]
    }
    // Waiting for rank 2, which is lost: rank 1 is told whom to blame.
    let mut from2 = [0u8; 4];
    let mut recvs = wait_for(2, &mut from2);
    let mut s = a.begin(ctx(0, CollectiveOp::AllReduce, 4, t0), &[], &recvs);
    a.eof(2);
    assert_eq!(
        a.poll(&mut s, &[], &mut recvs, &mut noop, t0),
        Status::Failed
    );
    a.finish(&mut s, &[], t0).unwrap_err();
    let notice = a.transmit(&mut idle, &[], 1).concat();
    assert_eq!(notice, CloseReason::Lost { culprit: 2 }.encode(0));
    a.transmitted(&mut idle, &[], 1, notice.len());
    // The next step waits for rank 1 past its deadline: it times out, and says nothing more.
    let mut from1 = [0u8; 4];
    let mut recvs = wait_for(1, &mut from1);
    let mut s = a.begin(ctx(0, CollectiveOp::AllReduce, 5, t0), &[], &recvs);
    let late = t0 + Duration::from_secs(11);
    assert_eq!(
        a.poll(&mut s, &[], &mut recvs, &mut noop, late),
        Status::Failed
    );
    let e = a.finish(&mut s, &[], late).unwrap_err();
    assert!(matches!(e, Error::Timeout { rank: 0, .. }), "{e}");
    assert!(a.transmit(&mut idle, &[], 1).concat().is_empty());
}

/// A point-to-point message for a later tag is stashed, and delivered to the step that wants
/// it, after one the current step wants that came behind it.
#[test]
fn a_message_for_another_tag_waits_in_the_stash() {
    let t0 = Instant::now();
    let (mut a, mut b) = (Core::new(0, 2, 8), Core::new(1, 2, 8));
    let (x, y) = (vec![1u8; 20], vec![2u8; 3]);
    let sends = [
        Outgoing {
            peer: 1,
            data: &x,
            count: 20,
            tag: 10,
        },
        Outgoing {
            peer: 1,
            data: &y,
            count: 3,
            tag: 11,
        },
    ];
    let c = ctx(0, CollectiveOp::SendRecv, 0, t0);
    let mut sa = a.begin(c, &sends, &[]);
    let mut got_y = [0u8; 3];
    let mut recvs = [Incoming {
        peer: 0,
        buf: &mut got_y,
        count: 3,
        tag: 11,
        streamed: None,
        seq_ahead: 0,
    }];
    let mut sb = b.begin(StepCtx { rank: 1, ..c }, &[], &recvs);
    let mut noop = |_: usize, _: Range<usize>, _: &mut [u8]| Ok(());
    pump(
        &mut a, &mut sa, &sends, &mut b, &mut sb, &mut recvs, 5, &mut noop,
    );
    assert_eq!(
        b.poll(&mut sb, &[], &mut recvs, &mut noop, t0),
        Status::Done
    );
    assert!(b.probe(0, 10) && !b.probe(0, 12));
    assert_eq!(got_y, [2; 3]);
    let mut got_x = [0u8; 20];
    let mut recvs = [Incoming {
        peer: 0,
        buf: &mut got_x,
        count: 20,
        tag: 10,
        streamed: None,
        seq_ahead: 0,
    }];
    let mut sb = b.begin(StepCtx { rank: 1, ..c }, &[], &recvs);
    assert_eq!(
        b.poll(&mut sb, &[], &mut recvs, &mut noop, t0),
        Status::Done
    );
    assert_eq!(got_x, [1; 20]);
}

/// Feeds `bytes` from `peer` into `core` outside any step.
fn feed(core: &mut Core, step: &mut Step, recvs: &mut [Incoming<'_>], peer: usize, bytes: &[u8]) {
    let mut noop = |_: usize, _: Range<usize>, _: &mut [u8]| Ok(());
    let mut at = 0;
    while at < bytes.len() {
        let buf = core.read_buf(step, recvs, peer);
        let k = buf.len().min(bytes.len() - at);
        buf[..k].copy_from_slice(&bytes[at..at + k]);
        core.received(step, recvs, peer, k, &mut noop);
        at += k;
    }
}

/// A rank that leaves cleanly is reported as having left on every peer, whichever arrives
/// first at a peer: its own goodbye, or the notice of a rank that met the goodbye and aborted
/// (which says only "lost"). A goodbye from a rank the notice does not blame changes nothing.
#[test]
fn a_goodbye_read_after_a_notice_blaming_its_sender_names_it_as_left() {
    let t0 = Instant::now();
    for (blamed, leaver, want) in [(2, 2, "left the group"), (3, 2, "rank 0 reported it lost")] {
        let mut core = Core::new(1, 4, 64);
        let (mut from0, mut from2) = ([0u8; 1], [0u8; 1]);
        let mut recvs = [
            Incoming {
                peer: 0,
                buf: &mut from0,
                count: 1,
                tag: 0,
                streamed: None,
                seq_ahead: 0,
            },
            Incoming {
                peer: 2,
                buf: &mut from2,
                count: 1,
                tag: 0,
                streamed: None,
                seq_ahead: 0,
            },
        ];
        let mut step = core.begin(ctx(1, CollectiveOp::Barrier, 0, t0), &[], &recvs);
        let notice = CloseReason::Lost {
            culprit: blamed as u32,
        }
        .encode(0);
        feed(&mut core, &mut step, &mut recvs, 0, &notice);
        let mut noop = |_: usize, _: Range<usize>, _: &mut [u8]| Ok(());
        assert_eq!(
            core.poll(&mut step, &[], &mut recvs, &mut noop, t0),
            Status::Failed
        );
        assert!(core.failed_second_hand(&step));
        // What the driver reads before finishing a step failed second-hand.
        let bye = CloseReason::Goodbye.encode(leaver as u32);
        feed(&mut core, &mut step, &mut recvs, leaver, &bye);
        assert_eq!(core.peer_state(leaver), Some(&PeerState::Left));
        match core.finish(&mut step, &[], t0).unwrap_err() {
            Error::PeerLost {
                rank: 1,
                peer,
                reason,
                ..
            } => {
                assert_eq!(peer, blamed, "{reason}");
                assert!(reason.contains(want), "blamed {blamed}: {reason}");
            }
            other => panic!("blamed {blamed}: expected PeerLost, got {other}"),
        }
    }
}

/// A streamed receive hands every frame of a message larger than its window to the callback,
/// at its place in the message, reusing the window; a window that a frame would wrap (the
/// sender cuts frames of another size) is an error naming the sender, not corruption.
#[test]
fn a_streamed_receive_passes_every_frame_through_its_window() {
    let t0 = Instant::now();
    let data: Vec<u8> = (0..100u8).collect();
    for (window, ok) in [(16, true), (32, true), (100, true), (24, false)] {
        let (mut a, mut b) = (Core::new(0, 2, 16), Core::new(1, 2, 16));
        let sends = [Outgoing {
            peer: 1,
            data: &data,
            count: 100,
            tag: 3,
        }];
        let mut win = vec![0u8; window];
        let mut recvs = [Incoming {
            peer: 0,
            buf: &mut win,
            count: 100,
            tag: 3,
            streamed: Some(100),
            seq_ahead: 0,
        }];
        let c = ctx(0, CollectiveOp::AllReduce, 1, t0);
        let mut sa = a.begin(c, &sends, &[]);
        let mut sb = b.begin(StepCtx { rank: 1, ..c }, &[], &recvs);
        let mut got = vec![0u8; 100];
        let mut ranges = Vec::new();
        let mut on_frame = |_: usize, r: Range<usize>, bytes: &mut [u8]| {
            got[r.clone()].copy_from_slice(bytes);
            ranges.push(r);
            Ok(())
        };
        pump(
            &mut a,
            &mut sa,
            &sends,
            &mut b,
            &mut sb,
            &mut recvs,
            7,
            &mut on_frame,
        );
        let status = b.poll(&mut sb, &[], &mut recvs, &mut on_frame, t0);
        if ok {
            assert_eq!(status, Status::Done, "window {window}");
            assert_eq!(got, data, "window {window}");
            assert_eq!(ranges.len(), 7, "window {window}");
        } else {
            assert_eq!(status, Status::Failed, "window {window}");
            let e = b.finish(&mut sb, &[], t0).unwrap_err();
            assert!(e.to_string().contains("would wrap"), "{e}");
            assert_eq!(ranges, vec![0..16], "window {window}");
        }
    }
}

/// One step takes frames of several operations from one peer, each judged as its own
/// operation's (`Incoming::seq_ahead`), in the order they come: three header-only frames of
/// operations 5, 6 and 7 land in receives 0, +1 and +2; a receiver that skips operation 6
/// finds its frame where operation 7's belongs and fails naming both.
#[test]
fn receives_ahead_of_the_step_take_later_operations_frames_in_order() {
    let t0 = Instant::now();
    for skip in [false, true] {
        let (mut a, mut b) = (Core::new(0, 2, 64), Core::new(1, 2, 64));
        let sends = [Outgoing {
            peer: 1,
            data: &[],
            count: 0,
            tag: 9,
        }];
        let aheads: &[u64] = if skip { &[0, 2] } else { &[0, 1, 2] };
        let mut recvs: Vec<Incoming<'_>> = aheads
            .iter()
            .map(|&seq_ahead| Incoming {
                peer: 0,
                buf: &mut [],
                count: 0,
                tag: 9,
                streamed: None,
                seq_ahead,
            })
            .collect();
        let mut sb = b.begin(ctx(1, CollectiveOp::Broadcast, 5, t0), &[], &recvs);
        let mut landed = Vec::new();
        let mut on_frame = |i: usize, _: Range<usize>, _: &mut [u8]| {
            landed.push(i);
            Ok(())
        };
        for seq in 5..8 {
            let mut sa = a.begin(ctx(0, CollectiveOp::Broadcast, seq, t0), &sends, &[]);
            pump(
                &mut a,
                &mut sa,
                &sends,
                &mut b,
                &mut sb,
                &mut recvs,
                1000,
                &mut on_frame,
            );
            assert_eq!(
                a.poll(&mut sa, &sends, &mut [], &mut |_, _, _| Ok(()), t0),
                Status::Done
            );
        }
        let status = b.poll(&mut sb, &[], &mut recvs, &mut on_frame, t0);
        if !skip {
            assert_eq!(status, Status::Done);
            assert_eq!(landed, [0, 1, 2]);
            continue;
        }
        assert_eq!(status, Status::Failed);
        assert_eq!(landed, [0]);
        match b.finish(&mut sb, &[], t0) {
            Err(Error::Mismatch { ours, theirs }) => {
                assert_eq!((ours.seq, theirs.seq), (7, 6), "{ours} against {theirs}");
            }
            other => panic!("expected a mismatch naming operations 7 and 6, got {other:?}"),
        }
    }
}

/// An operation that sends no frames (one through the shared-memory group area) waits only
/// for the ranks its driver names: it is done once they are none; it fails on a frame of this
/// very operation (that peer runs it over messages) with a mismatch naming both sides, while
/// it keeps a later operation's; on the end of a peer it still waits for; and at the deadline,
/// naming the ranks still missing.
#[test]
fn an_operation_without_frames_waits_for_the_ranks_named_and_fails_as_a_step_would() {
    let t0 = Instant::now();
    let c = ctx(1, CollectiveOp::Barrier, 5, t0);
    let frame_of = |op, seq| {
        let mut f = ctx(2, op, seq, t0).header(4, 0, 0, 4).encode().to_vec();
        f.extend_from_slice(&[7; 4]);
        f
    };

    let mut core = Core::new(1, 3, 64);
    let mut step = core.begin(c, &[], &[]);
    let pending = Status::Pending {
        deadline: c.deadline,
    };
    assert_eq!(core.poll_waiting_for(&mut step, 0, &[0, 2], t0), pending);
    // A frame of the next operation from a rank that is ahead waits in the stash.
    feed(
        &mut core,
        &mut step,
        &mut [],
        2,
        &frame_of(CollectiveOp::AllReduce, 6),
    );
    assert_eq!(core.poll_waiting_for(&mut step, 0, &[0], t0), pending);
    assert_eq!(core.poll_waiting_for(&mut step, 0, &[], t0), Status::Done);
    core.finish(&mut step, &[], t0).unwrap();

    // Rank 2 runs the same all_reduce with 4 elements over messages, this rank 2 elements
    // through the area: only the frame's existence says so (stashed frames' counts are not
    // compared, since one operation's messages may differ in count).
    let mut core = Core::new(1, 3, 64);
    let mut step = core.begin(ctx(1, CollectiveOp::AllReduce, 5, t0), &[], &[]);
    feed(
        &mut core,
        &mut step,
        &mut [],
        2,
        &frame_of(CollectiveOp::AllReduce, 5),
    );
    assert_eq!(
        core.poll_waiting_for(&mut step, 2, &[2], t0),
        Status::Failed
    );
    match core.finish(&mut step, &[], t0).unwrap_err() {
        Error::Mismatch { ours, theirs } => {
            assert_eq!(
                (ours.rank, ours.op, ours.count),
                (1, CollectiveOp::AllReduce, 2)
            );
            assert_eq!(
                (theirs.rank, theirs.op, theirs.count),
                (2, CollectiveOp::AllReduce, 4)
            );
        }
        other => panic!("expected a mismatch, got {other}"),
    }

    // An all_to_all that goes on over messages after the area (some rank's input did not
    // fit, which every rank read there): rank 2 has read that and sent its first block while
    // this rank still waits for rank 0's arrival. The frame waits for the step that takes it.
    let a2a = StepCtx {
        area_then_messages: true,
        ..ctx(1, CollectiveOp::AllToAll, 5, t0)
    };
    let mut core = Core::new(1, 3, 64);
    let mut step = core.begin(a2a, &[], &[]);
    feed(
        &mut core,
        &mut step,
        &mut [],
        2,
        &frame_of(CollectiveOp::AllToAll, 5),
    );
    assert_eq!(core.poll_waiting_for(&mut step, 0, &[0], t0), pending);
    assert_eq!(core.poll_waiting_for(&mut step, 0, &[], t0), Status::Done);
    core.finish(&mut step, &[], t0).unwrap();
    assert!(core.holds_stashed(), "the block waits in the stash");
    // Without the flag the same frame says rank 2 runs the operation over messages.
    let mut core = Core::new(1, 3, 64);
    let mut step = core.begin(
        StepCtx {
            area_then_messages: false,
            ..a2a
        },
        &[],
        &[],
    );
    feed(
        &mut core,
        &mut step,
        &mut [],
        2,
        &frame_of(CollectiveOp::AllToAll, 5),
    );
    assert_eq!(
        core.poll_waiting_for(&mut step, 0, &[0], t0),
        Status::Failed
    );
    assert!(matches!(
        core.finish(&mut step, &[], t0),
        Err(Error::Mismatch { .. })
    ));

    let mut core = Core::new(1, 3, 64);
    let mut step = core.begin(c, &[], &[]);
    feed(
        &mut core,
        &mut step,
        &mut [],
        0,
        &CloseReason::Goodbye.encode(0),
    );
    assert_eq!(
        core.poll_waiting_for(&mut step, 0, &[0], t0),
        Status::Failed
    );
    match core.finish(&mut step, &[], t0).unwrap_err() {
        Error::PeerLost {
            rank: 1,
            peer: 0,
            reason,
            ..
        } => assert!(reason.contains("left the group"), "{reason}"),
        other => panic!("expected PeerLost naming rank 0, got {other}"),
    }

    let mut core = Core::new(1, 3, 64);
    let mut step = core.begin(c, &[], &[]);
    let late = c.deadline + Duration::from_millis(1);
    assert_eq!(
        core.poll_waiting_for(&mut step, 0, &[2], late),
        Status::Failed
    );
    match core.finish(&mut step, &[], late).unwrap_err() {
        Error::Timeout {
            rank: 1,
            missing_peers,
            ..
        } => assert_eq!(missing_peers, [2]),
        other => panic!("expected a timeout naming rank 2, got {other}"),
    }
}

/// A look between operations (a root that expects no frames: `Transport::look`) passes over a
/// later operation's frame; fails on a frame of an earlier one, naming this rank's side as
/// its own repeated call when the frame falls in the run of repeats (and as the look's call
/// at the look's sequence number otherwise); and fails on a peer's abort notice, naming the
/// culprit it gives.
#[test]
fn a_look_fails_on_unclaimed_frames_and_abort_notices_and_passes_later_frames() {
    let t0 = Instant::now();
    let mut c = ctx(0, CollectiveOp::Broadcast, 9, t0);
    c.root = 0;
    let frame_of = |seq, root| {
        let mut h = ctx(2, CollectiveOp::Broadcast, seq, t0);
        h.root = root;
        let mut f = h.header(1, 0, 0, 1).encode().to_vec();
        f.push(7);
        f
    };

    let mut core = Core::new(0, 3, 64);
    let mut step = core.begin(c, &[], &[]);
    feed(&mut core, &mut step, &mut [], 2, &frame_of(10, 0));
    assert_eq!(core.look(&mut step, 1, Some(4), t0), Status::Done);
    core.finish(&mut step, &[], t0).unwrap();

    for (run_from, ours_seq) in [(Some(4), 6), (Some(7), 9), (None, 9)] {
        let mut core = Core::new(0, 3, 64);
        let mut step = core.begin(c, &[], &[]);
        feed(&mut core, &mut step, &mut [], 2, &frame_of(6, 1));
        assert_eq!(core.look(&mut step, 1, run_from, t0), Status::Failed);
        match core.finish(&mut step, &[], t0).unwrap_err() {
            Error::Mismatch { ours, theirs } => {
                assert_eq!((ours.seq, ours.root), (ours_seq, Some(0)), "{run_from:?}");
                assert_eq!((theirs.rank, theirs.seq, theirs.root), (2, 6, Some(1)));
            }
            other => panic!("expected a mismatch, got {other}"),
        }
    }

    let mut core = Core::new(0, 3, 64);
    let mut step = core.begin(c, &[], &[]);
    feed(
        &mut core,
        &mut step,
        &mut [],
        1,
        &CloseReason::Lost { culprit: 2 }.encode(1),
    );
    assert_eq!(core.look(&mut step, 1, None, t0), Status::Failed);
    match core.finish(&mut step, &[], t0).unwrap_err() {
        Error::PeerLost {
            rank: 0, peer: 2, ..
        } => {}
        other => panic!("expected PeerLost naming rank 2, got {other}"),
    }
}

/// A step's look at the stash for a peer's frame of its operation that disagrees: a stash in
/// order is read only up to the first frame of a later operation, but one out of order (a
/// peer that numbered its operations otherwise, or frames of two groups) is read whole, so a
/// disagreement stashed behind a later operation's frame is still found.
#[test]
fn a_disagreement_stashed_behind_a_later_operations_frame_is_found() {
    let t0 = Instant::now();
    let mut c = ctx(0, CollectiveOp::Broadcast, 9, t0);
    c.root = 0;
    let frame_of = |group, seq, root| {
        let mut h = StepCtx::started_at(
            2,
            group,
            CollectiveOp::Broadcast,
            seq,
            DType::U8,
            t0,
            Duration::from_secs(10),
        );
        h.root = root;
        let mut f = h.header(1, 0, 0, 1).encode().to_vec();
        f.push(7);
        f
    };
    // (group, sequence number, root) of each frame rank 2 sent, in order; whether the step at
    // sequence number 9 (group 1, root 0) fails on them.
    type Frames = &'static [(u32, u64, u32)];
    let cases: [(Frames, bool); 6] = [
        (&[(1, 9, 0), (1, 10, 1)], false),
        (&[(1, 10, 0), (1, 11, 1)], false),
        (&[(1, 9, 1), (1, 10, 0)], true),
        (&[(1, 10, 0), (1, 9, 1)], true),
        (&[(1, 10, 0), (1, 10, 1), (1, 9, 1)], true),
        (&[(2, 30, 0), (1, 9, 1)], true),
    ];
    for (frames, fails) in cases {
        let mut core = Core::new(0, 3, 64);
        let mut step = core.begin(c, &[], &[]);
        for &(group, seq, root) in frames {
            feed(
                &mut core,
                &mut step,
                &mut [],
                2,
                &frame_of(group, seq, root),
            );
        }
        assert_eq!(core.may_fail_at_once(&step, &[], &[]), fails, "{frames:?}");
    }
}

/// A connection holding [`READ_AHEAD_BYTES`] of frames for later steps is read ahead no more
/// in a collective step (its sender is left to the transport's flow control), still in a
/// point-to-point one (sends stay eager), and again once a step took the frames.
#[test]
fn read_ahead_stops_at_its_bound_until_a_step_takes_the_frames() {
    use super::READ_AHEAD_BYTES;
    let t0 = Instant::now();
    let seg = 1 << 20;
    let (mut a, mut b) = (Core::new(0, 2, seg), Core::new(1, 2, seg));
    let len = READ_AHEAD_BYTES + seg;
    let data: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
    let sends = [Outgoing {
        peer: 1,
        data: &data,
        count: len as u64,
        tag: 5,
    }];
    let later = ctx(0, CollectiveOp::Broadcast, 2, t0);
    let mut sa = a.begin(later, &sends, &[]);
    // Rank 1 is still in an earlier collective that awaits nothing from rank 0.
    let earlier = StepCtx {
        rank: 1,
        ..ctx(1, CollectiveOp::AllReduce, 1, t0)
    };
    let mut sb = b.begin(earlier, &[], &[]);
    assert!(b.reads_ahead(&sb, 0), "nothing is held yet");
    let noop: &mut OnFrame<'_> = &mut |_, _, _| Ok(());
    let mut taken = 0;
    while b.reads_ahead(&sb, 0) {
        let k = pump_once(
            &mut a,
            &mut sa,
            &sends,
            &mut b,
            &mut sb,
            &mut [],
            64 << 10,
            noop,
        );
        assert!(k > 0, "the bound was never reached");
        taken += k;
    }
    assert!(
        taken < len,
        "stopped before the whole message: {taken} of {len}"
    );
    let p2p = b.begin(
        StepCtx {
            rank: 1,
            ..ctx(1, CollectiveOp::SendRecv, 1, t0)
        },
        &[],
        &[],
    );
    assert!(b.reads_ahead(&p2p, 0), "point-to-point steps read on");
    // The step that wants the message takes it: what was held, then the rest.
    let mut got = vec![0u8; len];
    let mut recvs = [Incoming {
        peer: 0,
        buf: &mut got,
        count: len as u64,
        tag: 5,
        streamed: None,
        seq_ahead: 0,
    }];
    let mut sb = b.begin(StepCtx { rank: 1, ..later }, &[], &recvs);
    assert!(b.awaits(&sb, &[], &recvs, 0));
    pump(
        &mut a,
        &mut sa,
        &sends,
        &mut b,
        &mut sb,
        &mut recvs,
        64 << 10,
        noop,
    );
    assert_eq!(b.poll(&mut sb, &[], &mut recvs, noop, t0), Status::Done);
    assert!(got == data, "the message arrived whole and in order");
    assert!(b.reads_ahead(&sb, 0), "nothing is held any more");
}

/// A peer's frame whose length runs past the message by wrapping (2^64 - 12 bytes at offset
/// 16 of a 100-byte message: offset + length is 4 modulo 2^64) fails the step naming the
/// frame, where the unchecked sum wrapped under the message length, passed, and the receive
/// sliced its buffer backwards (a panic in `Incoming::slot`); and a streamed receive's window
/// check does not wrap either.
#[test]
fn a_frame_length_that_wraps_past_the_message_fails_the_step() {
    let t0 = Instant::now();
    let data: Vec<u8> = (0..100u8).collect();
    let mut got = vec![0u8; 100];
    let (mut a, mut sa, sends, mut b, mut sb, mut recvs) = sending(&data, &mut got, t0);
    let mut stream = Vec::new();
    loop {
        let bytes: Vec<u8> = a.transmit(&mut sa, &sends, 1).concat();
        if bytes.is_empty() {
            break;
        }
        a.transmitted(&mut sa, &sends, 1, bytes.len());
        stream.extend(bytes);
    }
    let frame = HEADER_LEN + 16;
    let mut h = FrameHeader::decode(&stream[frame..]).unwrap();
    assert_eq!((h.offset, h.payload_len), (16, 16));
    h.payload_len = u64::MAX - 11;
    feed(&mut b, &mut sb, &mut recvs, 0, &stream[..frame]);
    feed(&mut b, &mut sb, &mut recvs, 0, &h.encode());
    let mut noop = |_: usize, _: Range<usize>, _: &mut [u8]| Ok(());
    assert_eq!(
        b.poll(&mut sb, &[], &mut recvs, &mut noop, t0),
        Status::Failed
    );
    let e = b.finish(&mut sb, &[], t0).unwrap_err().to_string();
    assert!(
        e.contains("expected 100 bytes from rank 0")
            && e.contains("offset 16 of 18446744073709551604 bytes"),
        "{e}"
    );
    let mut window = vec![0u8; 16];
    let streamed = Incoming {
        peer: 0,
        buf: &mut window,
        count: 100,
        tag: 3,
        streamed: Some(100),
        seq_ahead: 0,
    };
    assert!(streamed.fits(16, 16));
    assert!(!streamed.fits(20, usize::MAX - 2));
}
