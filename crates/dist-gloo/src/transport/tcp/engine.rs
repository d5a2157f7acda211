//! The progress engine: a driver of the peer protocol's [`Core`] over non-blocking sockets
//! and shared-memory rings. It moves bytes between each link and the core, and decides when
//! to spin, yield or sleep in the poller; every rule of what the bytes mean is the core's.

use std::io::{self, IoSlice, Write};
use std::sync::Arc;
use std::time::{Duration, Instant};

use dist_backend::{Error, Result};
use dist_wire::{CollectiveOp, FrameHeader, HEADER_LEN};
use mio::{Events, Poll};

use super::by_reference::SingleCopyRule;
use super::cma::Cma;
use super::conn::Conn;
use super::idle::{Idle, SpinWindow};
use super::linger;
use crate::output_copy::STREAMING_BYTES;
use crate::path_pace::{Paced, PathPace};
use crate::proto::{Core, Status, Step};
use crate::transport::shm::group_area::{AREA_DATA_BYTES, GroupArea};
use crate::transport::{Incoming, OnFrame, Outgoing, StepCtx};

/// The longest an aborted mesh spends, when it is closed, delivering its abort notices and
/// waiting for the peers to close their ends (each bounded also by the group's timeout): long
/// enough for peers that are still running to read the notice, short enough that a rank
/// whose peer is stopped does not hang on its way out.
const ABORT_LINGER: Duration = Duration::from_secs(10);

/// The longest one sleep in the poller lasts, so that a lost wake-up can only cost latency,
/// never a hang.
const MAX_SLEEP: Duration = Duration::from_millis(100);

/// Whether `op`'s messages from [`STREAMING_BYTES`] are copied out of a shared-memory ring
/// with stores that bypass the cache (see `crate::output_copy`): those of the collectives that
/// receive from several peers straight into an output nothing reads again within the step.
/// A reduction combines into what it receives, which is cheapest while it is in cache; a
/// broadcast's or scatter's receiver copies no faster than its one sender fills the ring (the
/// fences cost 1.7x there); point-to-point data is the caller's to read at once.
fn streams_output(op: CollectiveOp) -> bool {
    matches!(
        op,
        CollectiveOp::AllGather | CollectiveOp::AllToAll | CollectiveOp::Gather
    )
}

/// Whether a step of `ctx` over messages watches the group area before it sleeps
/// ([`Engine::in_area_instead`]). Not point-to-point or closing: they have no sequence number,
/// and a peer may be in a collective meanwhile. Not the argument agreement's rounds
/// (`args_in_payload`): a peer done with them may already be in the area for the same
/// operation's data.
fn watches_area(ctx: &StepCtx) -> bool {
    !matches!(ctx.op, CollectiveOp::SendRecv | CollectiveOp::Close) && !ctx.args_in_payload
}

#[derive(Debug)]
pub(super) struct Engine {
    pub(super) poll: Poll,
    pub(super) events: Events,
    /// The protocol state with every peer.
    pub(super) core: Core,
    /// Indexed by peer rank; `None` at this rank and once closed.
    pub(super) conns: Vec<Option<Conn>>,
    /// How long to keep retrying before sleeping in the poller (waking a sleeping process costs
    /// more than the whole of a small message's round trip), and which part busy-waits without
    /// yielding the core; it adapts to how soon the sleeps end.
    pub(super) spin: SpinWindow,
    /// Single-copy transfers with the peers on this host, when they are possible (the core
    /// copies through it too).
    pub(super) cma: Option<Arc<Cma>>,
    /// Which messages to peers that can read this rank's memory go by reference.
    pub(super) single_copy: SingleCopyRule,
    /// What this rank learnt of each way's pace to each peer on this host, where large
    /// messages to them take the faster (`None`: the rule alone decides).
    pub(super) pace: Option<PathPace>,
    /// How long closing waits for each peer to close its end (the group's timeout).
    pub(super) linger: Duration,
    /// Bytes were read from some link since [`Engine::wait_for_arrival`] last returned.
    pub(super) read_since_wait: bool,
}

/// The tag of every operation through the group area, in the headers the ranks publish.
const AREA_TAG: u32 = 0;

/// The least a step receives that makes it an exchange, whose sends the pace of each way
/// does not time (see [`Engine::run`]): far above the argument agreement's frames.
const EXCHANGE_BYTES: usize = 64 << 10;

/// What a step sends one peer whose way the pace chose ([`Engine::run`]), and how far the
/// engine has seen its sends done.
struct Timed {
    paced: Paced,
    /// The first of the step's sends not yet seen done (or to another peer, skipped).
    next: usize,
    /// The step's last send with bytes to the peer.
    last: usize,
}

impl Timed {
    /// The first send with bytes to `peer`, at index `i`, of `len` bytes; its ways are set
    /// once the peer is known to be timed.
    fn new(peer: usize, len: usize, i: usize) -> Self {
        Timed {
            paced: Paced {
                peer,
                len,
                rule_by_ref: false,
                by_ref: false,
                took: None,
            },
            next: i,
            last: i,
        }
    }
}

/// How many times an operation through the group area looks at the arrival words alone
/// between two full passes (links, failures, clock).
const QUICK_LOOKS: u32 = 32;

impl Engine {
    /// Runs one step to its end: moves bytes until the core says it is done or failed, then
    /// returns its result. A failed step's abort notices (which say whom to blame) are
    /// written before the step's offers by reference are withdrawn, so that a peer whose copy
    /// fails on the withdrawal finds the notice after the frame. Before it sleeps, a step of
    /// a group with an `area` looks there for peers running this very operation through it
    /// ([`Engine::in_area_instead`]).
    pub(super) fn run(
        &mut self,
        ctx: &StepCtx,
        sends: &[Outgoing<'_>],
        recvs: &mut [Incoming<'_>],
        on_frame: &mut OnFrame<'_>,
        area: Option<&GroupArea>,
    ) -> Result<()> {
        // Declared first so it runs last, after the abort notice, and on unwinding too.
        let _withdraw = self.cma.as_ref().map(|c| c.withdrawal());
        // Point-to-point stays eager: a user's `send` must not wait for the matching `recv`
        // (send-then-receive on both sides is a common, valid pattern). In every collective
        // algorithm the receive matching a send is reached without the sender progressing
        // further (the same step, or a step its receiver reaches on its own), so collectives
        // may rendezvous. The cost: two groups whose large collectives are issued in crossed
        // orders now wait for each other (until the timeout) where socket buffers used to
        // absorb them; MPI calls such programs erroneous.
        let cma = self
            .cma
            .as_deref()
            .filter(|_| ctx.op != CollectiveOp::SendRecv);
        let offer = cma.map_or(0, |_| Cma::next_step_offer());
        let shm = |peer: usize| matches!(self.conns.get(peer), Some(Some(c)) if c.is_shm());
        let readable = |peer: usize| cma.is_some_and(|c| c.peer_reads(peer));
        let rule = |s: &Outgoing<'_>| {
            readable(s.peer)
                && self.single_copy.pays(
                    shm(s.peer),
                    ctx.op,
                    s.data,
                    (s.count as usize).saturating_mul(ctx.dtype.size()),
                )
        };
        // Where this step sends a peer through the rings many bytes that could go either
        // way, and receives little, they take the way their pace to that peer has shown
        // faster (see `path_pace`), judged on all the step sends it (a chain broadcast's root
        // sends its chunks in one step), every send to the peer alike but those under the
        // rule's smallest by reference. Not in an exchange: there a send's time hangs on the
        // peer's own sends, each rank's choice misleads the other's, and the pace misled (2
        // ranks, all_reduce of 4 MiB: 1658 us against 226 in two rounds of three, all_gather
        // and all_to_all alike). A step may receive the argument agreement's few bytes.
        // The sends' total first: most steps are small and stop there.
        let pace = self.pace.as_ref().filter(|p| {
            let received = recvs.iter().map(|r| r.streamed.unwrap_or(r.buf.len()));
            p.times(sends.iter().map(|s| s.data.len()).sum())
                && cma.is_some()
                && received.sum::<usize>() < EXCHANGE_BYTES
        });
        let mut timed: Vec<Timed> = Vec::new();
        if let Some(p) = pace {
            for (i, s) in sends.iter().enumerate().filter(|(_, s)| !s.data.is_empty()) {
                match timed.iter_mut().find(|t| t.paced.peer == s.peer) {
                    Some(t) => {
                        t.paced.len += s.data.len();
                        t.last = i;
                    }
                    None => timed.push(Timed::new(s.peer, s.data.len(), i)),
                }
            }
            timed.retain(|t| shm(t.paced.peer) && readable(t.paced.peer) && p.times(t.paced.len));
            // The rule asks only about the peers kept (it may read the page tables).
            for t in &mut timed {
                let m = &mut t.paced;
                m.rule_by_ref = rule(&sends[t.next]);
                m.by_ref = p.choose(m.peer, m.len, m.rule_by_ref);
            }
        }
        let floor = self.single_copy.floor();
        let by_ref = |s: &Outgoing<'_>| match timed.iter().find(|t| t.paced.peer == s.peer) {
            Some(t) => t.paced.by_ref && s.data.len() >= floor,
            None => rule(s),
        };
        let mut step = self.core.begin_by_ref(*ctx, sends, recvs, offer, &by_ref);
        // The way the peer's first send took, which the floor may have kept on the rings.
        for t in &mut timed {
            t.paced.by_ref = self.core.sends_by_ref(&step, t.next);
        }
        let begun = (!timed.is_empty()).then(Instant::now);
        if let Some(cma) = cma {
            for (i, s) in sends.iter().enumerate() {
                if self.core.sends_by_ref(&step, i) {
                    cma.publish(s.peer, offer);
                }
            }
        }
        let peers = self.conns.len();
        let mut idle = Idle::default();
        // Read again only after a pass that moved nothing: while bytes flow, the deadline
        // cannot pass (a step that progresses does not time out), and reading the clock each
        // pass was a tenth of a 4-byte all-reduce's time.
        let mut now = Instant::now();
        // This rank's frames go out before it takes any: taking a frame sent by reference is a
        // copy of up to a segment, and a peer waiting for this rank's offers would wait
        // through all of them (2 ranks, all_reduce of 16 MiB by reference: the two ranks took
        // turns, each copying while the other slept, 3.6 ms against 1.5 with both copying).
        // Unless the step may fail on what this rank holds: then it settles that first.
        if !self.core.may_fail_at_once(&step, sends, recvs) {
            for peer in 0..peers {
                self.write(&mut step, sends, recvs, on_frame, peer);
            }
        }
        // Frames stashed before the step began (a lazy root's verification replies come in
        // ahead of the step that checks them) are delivered before anything is read: the
        // first pass would otherwise read every awaited peer, a system call each over TCP,
        // for messages already here (at 4 ranks over TCP, three reads per broadcast).
        match self.core.poll(&mut step, sends, recvs, on_frame, now) {
            Status::Done => return self.finish_timed(&mut step, sends, now, &mut timed, begun),
            Status::Failed => return self.fail(&mut step, sends, recvs, on_frame, now),
            Status::Pending { .. } => {}
        }
        loop {
            let mut progress = false;
            // Every peer's frames are written before any is read (see above); after reading a
            // peer, what the reading queued for it (acknowledgements) goes out at once.
            for peer in 0..peers {
                progress |= self.write(&mut step, sends, recvs, on_frame, peer);
            }
            for peer in 0..peers {
                if self.read(&mut step, sends, recvs, on_frame, peer) {
                    progress = true;
                    self.write(&mut step, sends, recvs, on_frame, peer);
                }
            }
            if let Some(begun) = begun {
                self.time_sends(&step, sends, &mut timed, begun);
            }
            match self.core.poll(&mut step, sends, recvs, on_frame, now) {
                Status::Done => {
                    return self.finish_timed(&mut step, sends, now, &mut timed, begun);
                }
                Status::Failed => return self.fail(&mut step, sends, recvs, on_frame, now),
                Status::Pending { deadline } => {
                    if progress {
                        idle.reset();
                        continue;
                    }
                    now = Instant::now();
                    if idle.spin(now, &self.spin) {
                        continue;
                    }
                    let watched = area.filter(|_| watches_area(ctx));
                    if let Some(area) = watched {
                        let count = recvs
                            .first()
                            .map_or_else(|| sends.first().map_or(0, |s| s.count), |r| r.count);
                        if let Some(e) = self.in_area_instead(ctx, area, count) {
                            area.wake(ctx.rank);
                            self.core.fail_step(&mut step, e);
                            return self.fail(&mut step, sends, recvs, on_frame, now);
                        }
                    }
                    let slept = self.wait(deadline.saturating_duration_since(now));
                    if let Some(area) = watched {
                        area.wake(ctx.rank);
                    }
                    self.check_slept(ctx, slept)?;
                }
            }
        }
    }

    /// Notes when the `timed` sends of `step`, begun at `begun`, to each peer are all done.
    /// Each send is looked at until it is done, then never again (`Timed::next`), so a chain's
    /// thousand chunks cost a thousand looks in all, not a thousand per pass.
    fn time_sends(&self, step: &Step, sends: &[Outgoing<'_>], timed: &mut [Timed], begun: Instant) {
        let mut now = None;
        for t in timed.iter_mut().filter(|t| t.paced.took.is_none()) {
            while t.next <= t.last
                && (sends[t.next].peer != t.paced.peer || self.core.send_done(step, t.next))
            {
                t.next += 1;
            }
            if t.next > t.last {
                t.paced.took = Some(now.get_or_insert_with(Instant::now).duration_since(begun));
            }
        }
    }

    /// Finishes a step whose every send and receive is through, and teaches the pace of each
    /// way ([`PathPace`]) what its `timed` sends took, if it succeeded: those not yet seen
    /// done took until now.
    fn finish_timed(
        &mut self,
        step: &mut Step,
        sends: &[Outgoing<'_>],
        now: Instant,
        timed: &mut [Timed],
        begun: Option<Instant>,
    ) -> Result<()> {
        let result = self.core.finish(step, sends, now);
        if let (Ok(()), Some(begun), Some(pace)) = (&result, begun, self.pace.as_mut()) {
            let end = Instant::now().duration_since(begun);
            for t in timed.iter_mut() {
                t.paced.took.get_or_insert(end);
                pace.record(&t.paced);
            }
        }
        result
    }

    /// Operation `ctx` through the group `area` (every peer is on a shared-memory link):
    /// this rank publishes its header (announcing `count`) and `mine`, stores its arrival,
    /// wakes the ranks asleep waiting for one, and waits until every rank has arrived,
    /// spinning, yielding, then sleeping in the poller as [`Engine::run`] does. Meanwhile it
    /// reads every link that signals, as a step does, so that a peer that dies, leaves, aborts
    /// or runs another operation fails it as it fails an operation over messages, and the
    /// deadline fails it naming the ranks that have not arrived. Then it checks every rank's
    /// header against its own (ranks that disagree fail as a mismatch, every one of them,
    /// since all read the same headers, and send the abort notice for a rank that only
    /// announced) and hands `each` every rank's data in rank order.
    pub(super) fn through_area(
        &mut self,
        ctx: &StepCtx,
        area: &GroupArea,
        count: u64,
        mine: &[&[u8]],
        each: &mut dyn FnMut(usize, &[u8]) -> Result<()>,
    ) -> Result<()> {
        let noop: &mut OnFrame<'_> = &mut |_, _, _| Ok(());
        let mut step = self.core.begin(*ctx, &[], &[]);
        let peers = self.conns.len();
        let mut missing: Vec<usize> = (0..peers).filter(|&p| p != ctx.rank).collect();
        let mut now = Instant::now();
        // An operation that must fail on what this rank already holds fails before it
        // arrives, so that no peer completes one this rank fails.
        if self.core.may_fail_at_once(&step, &[], &[])
            && let Status::Failed = self.core.poll_waiting_for(&mut step, count, &missing, now)
        {
            return self.fail(&mut step, &[], &mut [], noop, now);
        }
        let (header, mark) = self.arrive_in_area(ctx, area, count, mine);
        let mut idle = Idle::default();
        let mut quick = 0;
        let mut all_barriers;
        loop {
            let before = missing.len();
            all_barriers = area.missing_into(mark, &mut missing);
            if missing.len() < before {
                // Ranks are arriving: spin on for the rest.
                idle.reset();
            }
            // Between passes over the links and the clock, only the arrival words are looked
            // at: the pass costs more than an arrival takes to show from another core.
            if !missing.is_empty() && quick < QUICK_LOOKS {
                quick += 1;
                if self.spin.busy().is_zero() {
                    std::thread::yield_now();
                } else {
                    std::hint::spin_loop();
                }
                continue;
            }
            if missing.is_empty() {
                // Every rank arrived at this operation, so it ran nowhere else: nothing the
                // links could hold now would fail it (a peer's failure or a frame of this
                // operation sent over messages would have kept that peer from arriving).
                break;
            }
            quick = 0;
            for peer in 0..peers {
                self.write(&mut step, &[], &mut [], noop, peer);
                self.read(&mut step, &[], &mut [], noop, peer);
            }
            match self.core.poll_waiting_for(&mut step, count, &missing, now) {
                Status::Done => break,
                Status::Failed => return self.fail(&mut step, &[], &mut [], noop, now),
                Status::Pending { deadline } => {
                    now = Instant::now();
                    if idle.spin(now, &self.spin) || area.sleep(ctx.rank, mark) {
                        continue;
                    }
                    let slept = self.wait(deadline.saturating_duration_since(now));
                    area.wake(ctx.rank);
                    now = Instant::now();
                    self.check_slept(ctx, slept)?;
                }
            }
        }
        // Every rank arrived, so none ran this operation elsewhere; but a frame an earlier
        // operation left unread may still lie on a link (ranks that each took another for a
        // reduce's root all sent and none received), and it would otherwise go unread through
        // any number of operations through the area. What the peers sent before arriving is
        // in their rings now: one read of each ring that holds bytes, then the stash is
        // judged (if anything is stashed).
        let read = self.core.holds_stashed() | self.read_each(&mut step, 1);
        if read && let Status::Failed = self.core.poll_waiting_for(&mut step, count, &[], now) {
            return self.fail(&mut step, &[], &mut [], noop, now);
        }
        self.core.finish(&mut step, &[], now)?;
        if all_barriers {
            // Every rank's word says it is in this very barrier: the headers would agree (a
            // barrier's holds no count, dtype or root, and ranks at one operation count are at
            // one sequence number, as every collective runs on every rank), and none
            // publishes data.
            return Ok(());
        }
        let mut theirs = [0u8; HEADER_LEN];
        let mut result = Ok(());
        for p in 0..peers {
            // This rank's own publication is `mine`: no need to read it back.
            let agrees = if p == ctx.rank {
                Ok(Ok(None))
            } else {
                area.read_header(p, mark, &mut theirs);
                FrameHeader::decode(&theirs).map(|h| {
                    // Ranks may publish different lengths (an all_gather's blocks); everything
                    // else in the headers must be alike.
                    let as_ours = FrameHeader {
                        sender: header.sender,
                        payload_len: header.payload_len,
                        ..h
                    };
                    (as_ours == header && h.payload_len as usize <= AREA_DATA_BYTES)
                        .then_some(Some(h.payload_len as usize))
                        .ok_or(h)
                })
            };
            let header_error = match agrees {
                Ok(Ok(None)) => {
                    result = match mine {
                        [] => each(p, &[]),
                        [whole] => each(p, whole),
                        // In parts: read back whole from the area.
                        _ => area.with_data(p, mark, header.payload_len as usize, |d| each(p, d)),
                    };
                    None
                }
                Ok(Ok(Some(len))) => {
                    result = area.with_data(p, mark, len, |d| each(p, d));
                    None
                }
                Ok(Err(h)) => Some(ctx.mismatch(&h, count)),
                Err(source) => Some(Error::Wire {
                    rank: ctx.rank,
                    op: ctx.op.name(),
                    source,
                }),
            };
            if let Some(e) = header_error {
                // Every rank that waited here reads the same headers and fails alike, but a
                // rank that only announced (an all_to_all too large for the area) reads none
                // and waits for frames by messages: it learns of the failure from the notice.
                return Err(self.fail_with(ctx, e));
            }
            if result.is_err() {
                // The caller's verdict on what the ranks published, which every rank that
                // waited reaches alike; a caller whose peers may have gone on by messages
                // tells them itself (`Transport::fail_with`). The group is done.
                self.core.abort();
                break;
            }
        }
        result
    }

    /// Publishes `mine` with this rank's header for operation `ctx` (announcing `count`) in
    /// its next slot, stores its arrival, and rings the doorbell of every rank asleep in the
    /// area. Returns the header and the operation's mark. The first half of
    /// [`Engine::through_area`], and alone
    /// [`crate::transport::Transport::shared_memory_announce`].
    pub(super) fn arrive_in_area(
        &mut self,
        ctx: &StepCtx,
        area: &GroupArea,
        count: u64,
        mine: &[&[u8]],
    ) -> (FrameHeader, u64) {
        let len = mine.iter().map(|p| p.len()).sum();
        let header = ctx.header(count, AREA_TAG, 0, len);
        let mark = area.next_mark(ctx.rank);
        area.publish(ctx.rank, mark, &header.encode(), mine);
        let mut sleepers = Vec::new();
        let barrier = ctx.op == CollectiveOp::Barrier && len == 0;
        area.arrive(ctx.rank, mark, barrier, &mut sleepers);
        for &p in &sleepers {
            if let Some(Some(c)) = self.conns.get_mut(p) {
                c.link.doorbell();
            }
        }
        (header, mark)
    }

    /// Before a step over messages of operation `ctx` sleeps: raises this rank's sleep flag in
    /// the group `area` (so that a rank arriving there rings its doorbell), and returns the
    /// mismatch if a peer already there runs this very operation (its header's sequence
    /// number), which this rank runs over messages. `count` is this step's, for the error.
    ///
    /// Why: ranks choose the area or messages alike for a call they agree on, so a peer in the
    /// area at this operation disagrees with this rank. The ranks in the area send no frames,
    /// so a rank over messages that only receives (a star's root, a tree's leaf, a root that
    /// repeats its call) would otherwise wait for them until the timeout, and they for it.
    /// The ranks there hear of it from the abort notice, which they read while they wait.
    /// A peer already past this operation is at this rank's next mark with a later sequence
    /// number: this rank sleeps, and is woken at most once by each such arrival.
    fn in_area_instead(&mut self, ctx: &StepCtx, area: &GroupArea, count: u64) -> Option<Error> {
        let mark = area.next_mark(ctx.rank);
        let mut arrived = Vec::new();
        area.sleep_watching(ctx.rank, mark, &mut arrived);
        let mut theirs = [0u8; HEADER_LEN];
        arrived.into_iter().find_map(|p| {
            area.read_header(p, mark, &mut theirs);
            // A header that does not decode is for the ranks that read it there to report.
            FrameHeader::decode(&theirs)
                .ok()
                .filter(|h| h.seq == ctx.seq && h.op != CollectiveOp::SendRecv)
                .map(|h| ctx.mismatch(&h, count))
        })
    }

    /// See [`crate::transport::Transport::fail_with`]: [`Core::fail_outside_step`], then what
    /// each link takes of the notices at once (the rest goes out at close).
    pub(super) fn fail_with(&mut self, ctx: &StepCtx, e: Error) -> Error {
        let e = self.core.fail_outside_step(*ctx, e, Instant::now());
        self.write_owed(&mut |_, _, _| Ok(()));
        e
    }

    /// Up to `reads` reads of each link that may hold input (a shared-memory ring that holds
    /// bytes, any socket), whatever the core holds read ahead, stopping where one would
    /// block: for `step`, which waits for nothing. Returns whether a byte moved.
    fn read_each(&mut self, step: &mut Step, reads: usize) -> bool {
        let noop: &mut OnFrame<'_> = &mut |_, _, _| Ok(());
        let mut read = false;
        for peer in 0..self.conns.len() {
            if let Some(Some(c)) = self.conns.get_mut(peer)
                && c.link.may_have_input()
            {
                c.readable = true;
                read |= self.read_some(step, &[], &mut [], noop, peer, reads, true);
            }
        }
        read
    }

    /// See [`crate::transport::Transport::look`]: reads each link dry, then the core's
    /// verdict ([`Core::look`]); a failure ends as a failed step does ([`Engine::fail`]).
    pub(super) fn look(&mut self, ctx: &StepCtx, count: u64, run_from: Option<u64>) -> Result<()> {
        let noop: &mut OnFrame<'_> = &mut |_, _, _| Ok(());
        let mut step = self.core.begin(*ctx, &[], &[]);
        // Every link until it would block: a ring's reads take one header or payload each.
        self.read_each(&mut step, usize::MAX);
        let now = Instant::now();
        match self.core.look(&mut step, count, run_from, now) {
            Status::Failed => self.fail(&mut step, &[], &mut [], noop, now),
            _ => self.core.finish(&mut step, &[], now),
        }
    }

    /// A failed sleep in the poller ends the group: the step cannot know what it missed.
    fn check_slept(&mut self, ctx: &StepCtx, slept: io::Result<()>) -> Result<()> {
        slept.map_err(|source| {
            self.core.abort();
            Error::Io {
                rank: ctx.rank,
                context: format!("{} #{}: polling sockets", ctx.op, ctx.seq),
                source,
            }
        })
    }

    /// Ends a failed step: reads what the peers have said (a notice may name the real
    /// culprit), takes the core's verdict, and writes the abort notices it queued as far as
    /// the links take them now; [`Engine::close`] delivers the rest.
    fn fail(
        &mut self,
        step: &mut Step,
        sends: &[Outgoing<'_>],
        recvs: &mut [Incoming<'_>],
        on_frame: &mut OnFrame<'_>,
        now: Instant,
    ) -> Result<()> {
        for peer in 0..self.conns.len() {
            if self.core.reads_after_failure(step, peer)
                && let Some(Some(c)) = self.conns.get_mut(peer)
            {
                c.readable = true;
                self.read_some(step, sends, recvs, on_frame, peer, 1, true);
            }
        }
        let r = self.core.finish(step, sends, now);
        self.write_owed(on_frame);
        r
    }

    /// Writes to every peer what the core holds for it outside any step (abort notices,
    /// acknowledgements) while each link takes it; the rest goes out at close.
    fn write_owed(&mut self, on_frame: &mut OnFrame<'_>) {
        let mut idle = Step::idle();
        for peer in 0..self.conns.len() {
            self.write(&mut idle, &[], &mut [], on_frame, peer);
        }
    }

    /// Writes what the core has for `peer` while the link takes it. Returns whether a byte
    /// moved (or the connection was found broken).
    fn write(
        &mut self,
        step: &mut Step,
        sends: &[Outgoing<'_>],
        recvs: &mut [Incoming<'_>],
        on_frame: &mut OnFrame<'_>,
        peer: usize,
    ) -> bool {
        let Some(Some(c)) = self.conns.get_mut(peer) else {
            return false;
        };
        let mut moved = false;
        loop {
            let [a, b] = self.core.transmit(step, sends, peer);
            if a.is_empty() && b.is_empty() {
                return moved;
            }
            match c.link.write_vectored(&[IoSlice::new(a), IoSlice::new(b)]) {
                Ok(0) => {
                    self.core
                        .broken(peer, "the connection accepts no more bytes");
                    return true;
                }
                Ok(n) => {
                    self.core.transmitted(step, sends, peer, n);
                    moved = true;
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return moved,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => {
                    // The peer may have said why it left before its socket died (a clean
                    // `Close` or an abort naming the rank it lost): read that first.
                    if let Some(Some(c)) = self.conns.get_mut(peer) {
                        c.readable = true;
                    }
                    self.read_some(step, sends, recvs, on_frame, peer, usize::MAX, true);
                    self.core.broken(peer, &e.to_string());
                    return true;
                }
            }
        }
    }

    /// Feeds the core what the link from `peer` holds: while the step waits for the peer's
    /// input, or the poller said the link is readable and the core lets it read ahead
    /// ([`Core::reads_ahead`]), until it would block. Not further: a
    /// message for a later step read now only goes through the stash (a copy more), and a
    /// sender whose message this rank drains that way may complete a step the group fails.
    /// Returns whether a byte moved (or the input ended).
    fn read(
        &mut self,
        step: &mut Step,
        sends: &[Outgoing<'_>],
        recvs: &mut [Incoming<'_>],
        on_frame: &mut OnFrame<'_>,
        peer: usize,
    ) -> bool {
        self.read_some(step, sends, recvs, on_frame, peer, usize::MAX, false)
    }

    /// [`Engine::read`], in at most `reads` reads; `whatever` reads a readable link however
    /// much the core holds read ahead of it (to learn why a peer left, or for a probe).
    #[expect(
        clippy::too_many_arguments,
        reason = "the step's parts, as every driver call takes them"
    )]
    fn read_some(
        &mut self,
        step: &mut Step,
        sends: &[Outgoing<'_>],
        recvs: &mut [Incoming<'_>],
        on_frame: &mut OnFrame<'_>,
        peer: usize,
        mut reads: usize,
        whatever: bool,
    ) -> bool {
        let Some(Some(c)) = self.conns.get_mut(peer) else {
            return false;
        };
        // A peer the step waits for is read only while it does: what follows is for a later
        // step, which reads it then. Draining it now (its poller event still pending) would
        // copy every message of a stream such as the ring's through the stash.
        if self.core.awaits(step, sends, recvs, peer) {
            c.readable = false;
        }
        let streaming = step.op().is_some_and(streams_output)
            && step
                .incoming_len(recvs, peer)
                .is_some_and(|len| len >= STREAMING_BYTES);
        let mut moved = false;
        // A peer not awaited is read while it signals and the core lets it read ahead; one
        // held back keeps its readiness for the pass whose step awaits it.
        while !c.ended
            && reads > 0
            && ((c.readable && (whatever || self.core.reads_ahead(step, peer)))
                || self.core.awaits(step, sends, recvs, peer))
        {
            reads -= 1;
            let buf = self.core.read_buf(step, recvs, peer);
            match c.link.read_hinted(buf, streaming) {
                Ok(0) => {
                    self.core.eof(peer);
                    c.ended = true;
                    moved = true;
                }
                Ok(k) => {
                    self.core.received(step, recvs, peer, k, on_frame);
                    moved = true;
                    if step.has_failed() {
                        // What is left may be a sender's data, blocked on this rank: it must
                        // see the failure, not have its message drained into the stash.
                        break;
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    c.readable = false;
                    break;
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => {
                    self.core.broken(peer, &format!("connection error: {e}"));
                    c.ended = true;
                    moved = true;
                }
            }
        }
        self.read_since_wait |= moved;
        moved
    }

    /// Sleeps in the poller until some link is ready or `timeout` passes (at most
    /// [`MAX_SLEEP`]), marking the links that are; how long it slept adapts the spin of the
    /// next waits ([`SpinWindow::slept`]).
    fn wait(&mut self, timeout: Duration) -> io::Result<()> {
        let began = Instant::now();
        // Shared-memory links say they sleep first, then look once more (no wake-up lost);
        // one that changed meanwhile is treated as a poller event, without sleeping.
        let mut awake = false;
        for (peer, slot) in self.conns.iter_mut().enumerate() {
            // Not a link whose input has ended: nothing more is read from it, and one whose
            // ring is corrupt failed its arm every time, so every later wait skipped the
            // poller and the engine spun until the group closed.
            let Some(c) = slot.as_mut().filter(|c| !c.ended) else {
                continue;
            };
            match c.link.arm() {
                Ok(false) => {}
                Ok(true) => {
                    c.readable = true;
                    awake = true;
                }
                Err(e) => {
                    self.core
                        .broken(peer, &format!("its shared-memory rings: {e}"));
                    c.ended = true;
                    awake = true;
                }
            }
        }
        let polled = if awake {
            self.events.clear();
            Ok(())
        } else {
            self.poll
                .poll(&mut self.events, Some(timeout.min(MAX_SLEEP)))
        };
        for c in self.conns.iter_mut().flatten() {
            c.link.disarm();
        }
        for ev in self.events.iter() {
            if let Some(Some(c)) = self.conns.get_mut(ev.token().0) {
                c.readable = true;
            }
        }
        self.spin.slept(began.elapsed());
        match polled {
            Err(e) if e.kind() != io::ErrorKind::Interrupted => Err(e),
            _ => Ok(()),
        }
    }

    /// See [`crate::transport::Transport::probe`]: reads what `peer` sent so far (between
    /// steps every frame is stashed), then asks the core.
    pub(super) fn probe(&mut self, peer: usize, tag: u32) -> bool {
        if !matches!(self.conns.get(peer), Some(Some(_))) {
            return false;
        }
        self.read_ahead(peer);
        self.core.probe(peer, tag)
    }

    /// Reads whatever `peer` has sent into the stash, between steps (a probe, a wait for
    /// arrivals); nothing where it has no link.
    fn read_ahead(&mut self, peer: usize) {
        let Some(Some(c)) = self.conns.get_mut(peer) else {
            return;
        };
        c.readable = true;
        let mut idle = Step::idle();
        let noop: &mut OnFrame<'_> = &mut |_, _, _| Ok(());
        self.read_some(&mut idle, &[], &mut [], noop, peer, usize::MAX, true);
    }

    /// See [`crate::transport::Transport::wait_for_arrival`]. Every link is read into the
    /// stash first, as a probe reads its peer: a ring with unread bytes ends every sleep at
    /// once (its arm reports bytes, not news), and a socket read to its end is the one whose
    /// next bytes the edge-triggered poller reports. Bytes read since the last wait ended, by
    /// those reads or any before them ([`Engine::read_since_wait`]), are news and end the wait
    /// at once: a ring's bytes written while its reader's flag was down come with no
    /// doorbell, and a probe for one message may have read another, whose own probe came
    /// first and found nothing. Otherwise it sleeps, past [`MAX_SLEEP`] where `timeout` is
    /// longer, until the poller reports a link or the waker ([`super::arrival::WAKE_TOKEN`]),
    /// or a ring changed. A poller error ends the wait early; the caller probes and waits
    /// again.
    pub(super) fn wait_for_arrival(&mut self, timeout: Duration) {
        for peer in 0..self.conns.len() {
            self.read_ahead(peer);
        }
        if std::mem::take(&mut self.read_since_wait) {
            return;
        }
        let deadline = dist_backend::deadline_after(Instant::now(), timeout);
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() || self.wait(left).is_err() {
                return;
            }
            // The reads above left every open link unreadable: one readable now is news.
            let news = !self.events.is_empty()
                || self.conns.iter().flatten().any(|c| c.readable && !c.ended);
            if news {
                return;
            }
        }
    }

    /// Leaves the group: the core queues a goodbye to every peer still connected (or, for an
    /// aborted group, only the abort notices already queued); each peer owed bytes gets them
    /// and a shutdown of the write side, then [`linger`] reads its connection until the peer
    /// closes its end (at most [`Engine::linger`], or [`ABORT_LINGER`] when aborted). The
    /// other connections are dropped, which their peers see as a crash, as they should after
    /// an abort.
    pub(super) fn close(&mut self, rank: usize) {
        self.core.close();
        let linger = if self.core.aborted() {
            self.linger.min(ABORT_LINGER)
        } else {
            self.linger
        };
        let deadline = dist_backend::deadline_after(Instant::now(), linger);
        let mut idle = Step::idle();
        let mut closing = Vec::new();
        for (peer, slot) in self.conns.iter_mut().enumerate() {
            let Some(c) = slot.take() else { continue };
            let owed = self.core.owes_close(peer);
            let mut pending = Vec::new();
            loop {
                let [a, b] = self.core.transmit(&mut idle, &[], peer);
                let n = a.len() + b.len();
                if n == 0 {
                    break;
                }
                pending.extend_from_slice(a);
                pending.extend_from_slice(b);
                self.core.transmitted(&mut idle, &[], peer, n);
            }
            self.core.disconnect(peer);
            let mut link = c.link;
            let _ = self.poll.registry().deregister(link.stream_mut());
            if !owed {
                continue;
            }
            // What the link takes now goes out before `close` returns, so that a peer that
            // looks right after (told of this close by a third rank, say) finds the goodbye
            // and names this rank as having left; only what does not fit (a full ring or
            // socket) waits for the background thread, which must not block this one.
            let sent = write_now(&mut link, &pending);
            pending.drain(..sent);
            closing.push(linger::Closing {
                peer,
                link,
                pending,
            });
        }
        linger::linger(rank, closing, deadline);
    }
}

/// Writes as much of `bytes` to `link` as it takes without waiting; returns how much. A link
/// that refuses (full, or broken) is left to the lingering close, which waits or reports.
fn write_now(link: &mut super::link::Link, bytes: &[u8]) -> usize {
    let mut done = 0;
    while done < bytes.len() {
        match link.write(&bytes[done..]) {
            Ok(0) => break,
            Ok(n) => done += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(_) => break,
        }
    }
    done
}
