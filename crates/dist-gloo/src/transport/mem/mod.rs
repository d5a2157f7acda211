//! An in-process transport for tests: the peer protocol's [`Core`] driven over bounded
//! in-memory byte pipes, so that it follows the same rules as TCP (sends block when the
//! receiver does not read, a peer that leaves or drops its end is seen by every peer, abort
//! notices name the culprit) with no sockets.

mod pipe;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Wake, Waker};
use std::time::{Duration, Instant};

use dist_backend::Result;

use super::{Incoming, OnFrame, Outgoing, StepCtx, Transport};
use crate::proto::{Core, Status, Step};
use pipe::{Bell, Pipe, Read};

/// Bytes each direction of a connection holds before a send blocks (about a loopback
/// socket's buffers).
pub const DEFAULT_PIPE_BYTES: usize = 256 << 10;

/// One rank's end of an in-memory network made by [`MemTransport::network`].
#[derive(Debug)]
pub struct MemTransport {
    rank: usize,
    world_size: usize,
    segment: usize,
    bells: Arc<Vec<Bell>>,
    /// This rank's arrival waker ([`Transport::arrival_waker`]).
    woken: Arc<Woken>,
    inner: Mutex<Inner>,
}

#[derive(Debug)]
struct Inner {
    core: Core,
    /// To each peer (indexed by rank; `None` at this rank and once closed).
    out: Vec<Option<Arc<Pipe>>>,
    /// From each peer.
    inp: Vec<Option<Arc<Pipe>>>,
    /// The input from the peer ended and the core was told.
    eof: Vec<bool>,
    /// Bytes were read from some peer since [`Transport::wait_for_arrival`] last returned.
    read_since_wait: bool,
}

impl MemTransport {
    /// `world_size` connected transports, one per rank, cutting messages into `segment`-byte
    /// frames, with [`DEFAULT_PIPE_BYTES`] pipes.
    pub fn network(world_size: usize, segment: usize) -> Vec<MemTransport> {
        Self::network_with(world_size, segment, DEFAULT_PIPE_BYTES)
    }

    /// [`MemTransport::network`] with pipes of `pipe_bytes` (at least 1) each way.
    pub fn network_with(world_size: usize, segment: usize, pipe_bytes: usize) -> Vec<MemTransport> {
        // pipes[src][dst]
        let pipes: Vec<Vec<Option<Arc<Pipe>>>> = (0..world_size)
            .map(|src| {
                (0..world_size)
                    .map(|dst| (src != dst).then(|| Arc::new(Pipe::new(pipe_bytes.max(1)))))
                    .collect()
            })
            .collect();
        let bells: Arc<Vec<Bell>> = Arc::new((0..world_size).map(|_| Bell::default()).collect());
        (0..world_size)
            .map(|rank| {
                let core = Core::new(rank, world_size, segment);
                MemTransport {
                    rank,
                    world_size,
                    segment: core.segment_bytes(),
                    bells: Arc::clone(&bells),
                    woken: Arc::new(Woken {
                        woken: AtomicBool::new(false),
                        bells: Arc::clone(&bells),
                        rank,
                    }),
                    inner: Mutex::new(Inner {
                        core,
                        out: pipes[rank].clone(),
                        inp: (0..world_size)
                            .map(|src| pipes[src][rank].clone())
                            .collect(),
                        eof: vec![false; world_size],
                        read_since_wait: false,
                    }),
                }
            })
            .collect()
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Inner {
    /// Writes what the core has for `peer` and the pipe takes. Returns whether a byte moved.
    fn write(
        &mut self,
        bells: &[Bell],
        step: &mut Step,
        sends: &[Outgoing<'_>],
        recvs: &mut [Incoming<'_>],
        on_frame: &mut OnFrame<'_>,
        peer: usize,
    ) -> bool {
        let Some(pipe) = self.out[peer].clone() else {
            return false;
        };
        let mut moved = false;
        loop {
            let parts = self.core.transmit(step, sends, peer);
            if parts.iter().all(|p| p.is_empty()) {
                return moved;
            }
            match pipe.write(parts) {
                Ok(0) => return moved,
                Ok(n) => {
                    self.core.transmitted(step, sends, peer, n);
                    bells[peer].ring();
                    moved = true;
                }
                Err(why) => {
                    // The peer may have said why it left before its end went away.
                    self.read(bells, step, sends, recvs, on_frame, peer, usize::MAX, true);
                    self.core.broken(peer, why);
                    return true;
                }
            }
        }
    }

    /// Feeds the core what the pipe from `peer` holds, in at most `reads` reads: while the
    /// step awaits the peer or the core lets it read ahead ([`Core::reads_ahead`]), or
    /// `whatever` it holds (to learn why a peer left, or for a probe). Returns whether a byte
    /// moved.
    #[expect(
        clippy::too_many_arguments,
        reason = "the step's parts, as every driver call takes them"
    )]
    fn read(
        &mut self,
        bells: &[Bell],
        step: &mut Step,
        sends: &[Outgoing<'_>],
        recvs: &mut [Incoming<'_>],
        on_frame: &mut OnFrame<'_>,
        peer: usize,
        mut reads: usize,
        whatever: bool,
    ) -> bool {
        let Some(pipe) = self.inp[peer].clone() else {
            return false;
        };
        let mut moved = false;
        while !self.eof[peer]
            && reads > 0
            && (whatever
                || self.core.reads_ahead(step, peer)
                || self.core.awaits(step, sends, recvs, peer))
        {
            reads -= 1;
            let buf = self.core.read_buf(step, recvs, peer);
            if buf.is_empty() {
                break;
            }
            match pipe.read(buf) {
                Read::Bytes(k) => {
                    self.core.received(step, recvs, peer, k, on_frame);
                    bells[peer].ring();
                    moved = true;
                }
                Read::Empty => break,
                Read::Eof => {
                    self.core.eof(peer);
                    self.eof[peer] = true;
                    moved = true;
                }
            }
        }
        self.read_since_wait |= moved;
        moved
    }

    /// Reads whatever `peer` has sent into the stash, between steps (a probe, a wait for
    /// arrivals).
    fn read_ahead(&mut self, bells: &[Bell], peer: usize) {
        let mut idle = Step::idle();
        self.read(
            bells,
            &mut idle,
            &[],
            &mut [],
            &mut |_, _, _| Ok(()),
            peer,
            usize::MAX,
            true,
        );
    }

    /// Hands each peer what it is owed and closes both directions; `goodbye` first queues the
    /// core's goodbyes (unless aborted). Peers not owed an orderly close see a crash.
    fn shut(&mut self, bells: &[Bell], goodbye: bool) {
        if goodbye {
            self.core.close();
        }
        let mut idle = Step::idle();
        for (peer, bell) in bells.iter().enumerate() {
            if let Some(out) = self.out[peer].take() {
                let mut last = Vec::new();
                if goodbye && self.core.owes_close(peer) {
                    loop {
                        let parts = self.core.transmit(&mut idle, &[], peer);
                        let n: usize = parts.iter().map(|p| p.len()).sum();
                        if n == 0 {
                            break;
                        }
                        parts.iter().for_each(|p| last.extend_from_slice(p));
                        self.core.transmitted(&mut idle, &[], peer, n);
                    }
                }
                out.write_last(&last);
            }
            if let Some(inp) = self.inp[peer].take() {
                inp.close_reader();
            }
            self.core.disconnect(peer);
            bell.ring();
        }
    }
}

impl MemTransport {
    /// Writes the abort notices a failed step queued (what the pipes take now).
    fn write_notices(&self, g: &mut Inner) {
        let mut idle = Step::idle();
        let noop: &mut OnFrame<'_> = &mut |_, _, _| Ok(());
        for peer in (0..self.world_size).filter(|&p| p != self.rank) {
            g.write(&self.bells, &mut idle, &[], &mut [], noop, peer);
        }
    }
}

impl Transport for MemTransport {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world_size
    }

    fn segment_bytes(&self) -> usize {
        self.segment
    }

    fn exchange(
        &self,
        ctx: &StepCtx,
        sends: &[Outgoing<'_>],
        recvs: &mut [Incoming<'_>],
        on_frame: &mut OnFrame<'_>,
    ) -> Result<()> {
        let mut g = self.lock();
        let g = &mut *g;
        let bells = &self.bells[..];
        let mut step = g.core.begin(*ctx, sends, recvs);
        loop {
            let seen = bells[self.rank].count();
            let mut moved = false;
            for peer in (0..self.world_size).filter(|&p| p != self.rank) {
                moved |= g.write(bells, &mut step, sends, recvs, on_frame, peer);
                moved |= g.read(
                    bells,
                    &mut step,
                    sends,
                    recvs,
                    on_frame,
                    peer,
                    usize::MAX,
                    false,
                );
            }
            let now = Instant::now();
            match g.core.poll(&mut step, sends, recvs, on_frame, now) {
                Status::Pending { deadline } => {
                    if !moved {
                        bells[self.rank].wait(seen, deadline);
                    }
                }
                Status::Done => return g.core.finish(&mut step, sends, now),
                Status::Failed => {
                    // What the peers said before the failure may decide whom it blames.
                    for peer in (0..self.world_size).filter(|&p| p != self.rank) {
                        if g.core.reads_after_failure(&step, peer) {
                            g.read(bells, &mut step, sends, recvs, on_frame, peer, 1, true);
                        }
                    }
                    let r = g.core.finish(&mut step, sends, now);
                    self.write_notices(g);
                    return r;
                }
            }
        }
    }

    fn probe(&self, peer: usize, tag: u32) -> bool {
        let mut g = self.lock();
        if peer >= self.world_size || peer == self.rank {
            return false;
        }
        g.read_ahead(&self.bells, peer);
        g.core.probe(peer, tag)
    }

    fn arrival_waker(&self) -> Option<Waker> {
        Some(Waker::from(Arc::clone(&self.woken)))
    }

    /// Reads every peer into the stash, then sleeps on this rank's bell, unless bytes were read
    /// since the last wait ended (by those reads or any before them: news the caller has not
    /// looked at, as in the TCP transport). The bell's count is taken before the reads, so
    /// bytes written after them ring past it, and before the waker's flag is looked at, so a
    /// wake either raised the flag before the look or rings past it.
    fn wait_for_arrival(&self, timeout: Duration) {
        let bell = &self.bells[self.rank];
        let seen = bell.count();
        if self.woken.woken.swap(false, Ordering::SeqCst) {
            return;
        }
        {
            let mut g = self.lock();
            for peer in (0..self.world_size).filter(|&p| p != self.rank) {
                g.read_ahead(&self.bells, peer);
            }
            if std::mem::take(&mut g.read_since_wait) {
                return;
            }
        }
        bell.wait(seen, dist_backend::deadline_after(Instant::now(), timeout));
    }

    fn look(&self, ctx: &StepCtx, count: u64, run_from: Option<u64>) -> Result<()> {
        let mut g = self.lock();
        let g = &mut *g;
        let bells = &self.bells[..];
        let noop: &mut OnFrame<'_> = &mut |_, _, _| Ok(());
        let mut step = g.core.begin(*ctx, &[], &[]);
        for peer in (0..self.world_size).filter(|&p| p != self.rank) {
            g.read(bells, &mut step, &[], &mut [], noop, peer, usize::MAX, true);
        }
        let now = Instant::now();
        let failed = matches!(g.core.look(&mut step, count, run_from, now), Status::Failed);
        let r = g.core.finish(&mut step, &[], now);
        if failed {
            self.write_notices(g);
        }
        r
    }

    fn abort(&self) {
        self.lock().core.abort();
    }

    fn close(&self) {
        self.lock().shut(&self.bells, true);
    }
}

/// The in-memory network's arrival waker: raises its flag, which ends the next wait that
/// has not begun, then rings its rank's bell, as a peer's write does, which ends the one in
/// progress.
#[derive(Debug)]
struct Woken {
    woken: AtomicBool,
    bells: Arc<Vec<Bell>>,
    rank: usize,
}

impl Wake for Woken {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.woken.store(true, Ordering::SeqCst);
        self.bells[self.rank].ring();
    }
}

impl Drop for MemTransport {
    /// A transport dropped without [`Transport::close`] vanishes as a crashed process does:
    /// its peers see its streams end without a goodbye.
    fn drop(&mut self) {
        self.lock().shut(&self.bells, false);
    }
}
