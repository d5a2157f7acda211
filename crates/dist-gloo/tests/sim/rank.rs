//! One simulated rank: a protocol core running a planned sequence of steps over the
//! simulated network, then closing (with a goodbye, or only the abort notices it owes),
//! lingering until its owed bytes are out; or killed, or stalled, when the seed says so.

use std::ops::Range;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use dist_backend::Error;
use dist_gloo::proto::{CopyIn, Core, Status, Step};
use dist_gloo::transport::{Incoming, OnFrame, Outgoing, StepCtx};
use dist_wire::{CollectiveOp, DType, PayloadRef};

use crate::net::{Got, Net, Rng};

/// How long every operation may take (virtual time).
pub(crate) const TIMEOUT: Duration = Duration::from_secs(100);
/// How long a closed rank keeps delivering what it owes.
const LINGER: Duration = Duration::from_secs(5);

/// One message of a step, as one side sees it.
#[derive(Debug, Clone)]
pub(crate) struct Msg {
    pub(crate) peer: usize,
    pub(crate) len: usize,
    pub(crate) tag: u32,
    /// The bytes (what is sent, or what must arrive).
    pub(crate) data: Vec<u8>,
}

/// One rank's view of one operation.
#[derive(Debug, Clone)]
pub(crate) struct OpPlan {
    pub(crate) op: CollectiveOp,
    pub(crate) seq: u64,
    /// Per step: (sends, receives).
    pub(crate) steps: Vec<(Vec<Msg>, Vec<Msg>)>,
}

/// How a rank's run ended.
#[derive(Debug)]
pub(crate) enum Fate {
    Running,
    /// Completed every operation (or left early, as planned) at this time.
    Done(Duration),
    /// A step failed with this error at this time, in an operation due by the deadline.
    Failed {
        /// Boxed: a mismatch's two sides make `Error` the bulk of the enum.
        error: Box<Error>,
        at: Duration,
        deadline: Duration,
    },
    Killed,
    Stalled,
}

impl std::fmt::Display for Fate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Fate::Running => write!(f, "still running"),
            Fate::Done(at) => write!(f, "done at {at:?}"),
            Fate::Failed {
                error,
                at,
                deadline,
            } => write!(f, "failed at {at:?} (deadline {deadline:?}): {error}"),
            Fate::Killed => write!(f, "killed"),
            Fate::Stalled => write!(f, "stalled"),
        }
    }
}

/// What each rank offers by reference now, as a process's memory would hold it: per rank,
/// the step's offer id and, per message, the address of its bytes and the bytes. A rank's
/// entry goes when its step ends (its offer is withdrawn) or it is killed (its memory is gone).
#[derive(Debug, Default)]
pub(crate) struct Offers {
    by_rank: Vec<Option<(u64, Vec<Offered>)>>,
    next: u64,
}

/// One message offered by reference: the address of its bytes, and the bytes.
type Offered = (u64, Vec<u8>);

/// Shared between the ranks of one run, as the host's memory is.
pub(crate) type SharedOffers = Arc<Mutex<Offers>>;

impl Offers {
    /// A registry for `n` ranks.
    pub(crate) fn shared(n: usize) -> SharedOffers {
        Arc::new(Mutex::new(Offers {
            by_rank: vec![None; n],
            next: 1,
        }))
    }
}

fn lock(o: &SharedOffers) -> std::sync::MutexGuard<'_, Offers> {
    o.lock().unwrap_or_else(|e| e.into_inner())
}

/// A rank's copier: reads a peer's offered bytes out of the registry, failing as
/// `process_vm_readv` plus the offer-word check would once the peer withdrew.
#[derive(Debug)]
struct Copier(SharedOffers);

impl CopyIn for Copier {
    fn copy_in(
        &self,
        peer: usize,
        _op: CollectiveOp,
        at: PayloadRef,
        dst: &mut [u8],
    ) -> Result<(), String> {
        let o = lock(&self.0);
        let Some(Some((offer, msgs))) = o.by_rank.get(peer) else {
            return Err("its memory is gone, or it withdrew its offer".into());
        };
        if *offer != at.offer {
            return Err(format!("it withdrew its offer {} (now {offer})", at.offer));
        }
        let src = msgs.iter().find_map(|(addr, bytes)| {
            let off = at.addr.checked_sub(*addr)? as usize;
            bytes.get(off..off + dst.len())
        });
        match src {
            Some(src) => {
                dst.copy_from_slice(src);
                Ok(())
            }
            None => Err(format!("no offered bytes at {:#x}", at.addr)),
        }
    }
}

struct Cur {
    step: Step,
    sends: Vec<Msg>,
    /// Receive buffers, and the bytes delivered so far to `on_frame`.
    bufs: Vec<Vec<u8>>,
    delivered: Vec<usize>,
    /// With a receive window: where each message lands (a window for those longer than it,
    /// streamed), `on_frame` copying every frame on into `bufs`.
    wins: Vec<Vec<u8>>,
}

pub(crate) struct RankSim {
    pub(crate) rank: usize,
    core: Core,
    plan: Vec<OpPlan>,
    op_i: usize,
    step_i: usize,
    op_started: Duration,
    cur: Option<Cur>,
    pub(crate) fate: Fate,
    /// Per peer, while closing: still owed bytes and an orderly FIN.
    owed: Vec<bool>,
    linger_until: Option<Duration>,
    eof: Vec<bool>,
    pumps: u64,
    /// The pending step's deadline.
    pub(crate) deadline: Option<Duration>,
    /// Faults planned for this rank: dies (with a reset or not) or stalls at its n-th pump;
    /// leaves (destroys its group) before this operation.
    pub(crate) kill_at: Option<(u64, bool)>,
    pub(crate) stall_at: Option<u64>,
    pub(crate) leave_before: Option<usize>,
    /// A completed step delivered wrong data.
    pub(crate) violation: Option<String>,
    /// Where ranks offer messages by reference, and the smallest message this rank sends so
    /// (`None`: every message goes inline).
    offers: SharedOffers,
    by_ref_min: Option<usize>,
    /// Receives stream through a window of this many bytes (a multiple of the segment) when
    /// longer (`None`: every message lands whole in its buffer).
    window: Option<usize>,
}

impl RankSim {
    pub(crate) fn new(
        rank: usize,
        n: usize,
        seg: usize,
        plan: Vec<OpPlan>,
        offers: SharedOffers,
        by_ref_min: Option<usize>,
        window: Option<usize>,
    ) -> Self {
        let mut core = Core::new(rank, n, seg);
        core.set_copier(Box::new(Copier(Arc::clone(&offers))));
        RankSim {
            rank,
            core,
            plan,
            op_i: 0,
            step_i: 0,
            op_started: Duration::ZERO,
            cur: None,
            fate: Fate::Running,
            owed: vec![false; n],
            linger_until: None,
            eof: vec![false; n],
            pumps: 0,
            deadline: None,
            kill_at: None,
            stall_at: None,
            leave_before: None,
            violation: None,
            offers,
            by_ref_min,
            window,
        }
    }

    /// Withdraws this rank's offer: its step ended, or it died.
    fn withdraw(&self) {
        lock(&self.offers).by_rank[self.rank] = None;
    }

    /// Whether it still has work: running, or closing with bytes owed.
    pub(crate) fn busy(&self) -> bool {
        matches!(self.fate, Fate::Running) || self.owed.iter().any(|&o| o)
    }

    /// When it next needs the time to move: its step's deadline, or the end of its linger.
    pub(crate) fn wake_at(&self) -> Option<Duration> {
        match self.fate {
            Fate::Running => self.deadline,
            Fate::Done(_) | Fate::Failed { .. } if self.owed.iter().any(|&o| o) => {
                self.linger_until
            }
            _ => None,
        }
    }

    /// Moves whatever can move at `now`. Returns whether anything did.
    pub(crate) fn pump(
        &mut self,
        net: &mut Net,
        rng: &mut Rng,
        base: Instant,
        now: Duration,
    ) -> bool {
        self.pumps += 1;
        if matches!(self.fate, Fate::Running) {
            if self.kill_at.is_some_and(|(at, _)| self.pumps >= at) {
                net.kill(self.rank, self.kill_at.is_some_and(|(_, reset)| reset));
                self.withdraw();
                self.fate = Fate::Killed;
                self.owed.fill(false);
                return true;
            }
            if self.stall_at.is_some_and(|at| self.pumps >= at) {
                self.fate = Fate::Stalled;
                return true;
            }
        }
        match self.fate {
            Fate::Running => self.run(net, rng, base, now),
            Fate::Done(_) | Fate::Failed { .. } => self.linger(net, rng, now),
            Fate::Killed | Fate::Stalled => false,
        }
    }

    fn run(&mut self, net: &mut Net, rng: &mut Rng, base: Instant, now: Duration) -> bool {
        if self.cur.is_none() {
            if self.leave_before == Some(self.op_i) || self.op_i == self.plan.len() {
                self.core.close();
                self.fate = Fate::Done(now);
                self.begin_close(net, now);
                return true;
            }
            let op = &self.plan[self.op_i];
            if self.step_i == 0 {
                self.op_started = now;
            }
            let (sends, recvs) = op.steps[self.step_i].clone();
            let ctx = self.ctx(base);
            let outs: Vec<Outgoing<'_>> = outgoing(&sends);
            let mut bufs: Vec<Vec<u8>> = recvs.iter().map(|m| vec![0xEE; m.len]).collect();
            let mut wins: Vec<Vec<u8>> = match self.window {
                Some(w) => recvs.iter().map(|m| vec![0xEE; m.len.min(w)]).collect(),
                None => Vec::new(),
            };
            let ins = match self.window {
                Some(_) => incoming(&recvs, &mut wins),
                None => incoming(&recvs, &mut bufs),
            };
            let min = self.by_ref_min;
            let by_ref = |o: &Outgoing<'_>| min.is_some_and(|m| o.data.len() >= m);
            let offer = {
                let mut o = lock(&self.offers);
                o.next += 1;
                o.next
            };
            let step = self.core.begin_by_ref(ctx, &outs, &ins, offer, &by_ref);
            drop(ins);
            let offered: Vec<Offered> = (0..outs.len())
                .filter(|&i| self.core.sends_by_ref(&step, i))
                .map(|i| (outs[i].data.as_ptr() as u64, outs[i].data.to_vec()))
                .collect();
            drop(outs);
            lock(&self.offers).by_rank[self.rank] = Some((offer, offered));
            self.cur = Some(Cur {
                step,
                sends,
                bufs,
                delivered: vec![0; recvs.len()],
                wins,
            });
        }
        let rank = self.rank;
        let recv_plan = &self.plan[self.op_i].steps[self.step_i].1;
        let Cur {
            step,
            sends,
            bufs,
            delivered,
            wins,
        } = self.cur.as_mut().expect("set above");
        let outs = outgoing(sends);
        let (mut ins, mut copy_to) = if self.window.is_some() {
            (incoming(recv_plan, wins), Some(&mut *bufs))
        } else {
            (incoming(recv_plan, bufs), None)
        };
        let mut on_frame =
            |i: usize, r: Range<usize>, bytes: &mut [u8]| -> dist_backend::Result<()> {
                if r.start != delivered[i] {
                    return Err(Error::invalid(
                        rank,
                        "sim",
                        format!(
                            "receive {i}: frame {r:?} delivered after {} bytes",
                            delivered[i]
                        ),
                    ));
                }
                delivered[i] = r.end;
                if let Some(bufs) = copy_to.as_mut() {
                    bufs[i][r].copy_from_slice(bytes);
                }
                Ok(())
            };
        // Reads what peer `p` has sent into this step, as a socket's reads would.
        macro_rules! read_peer {
            ($p:expr, $whatever:expr) => {
                read_from(
                    &mut self.core,
                    net,
                    rng,
                    step,
                    &outs,
                    &mut ins,
                    &mut on_frame,
                    &mut self.eof,
                    rank,
                    $p,
                    $whatever,
                )
            };
        }
        let mut moved = false;
        for p in peers_in_random_order(rng, self.eof.len(), rank) {
            loop {
                let parts = self.core.transmit(step, &outs, p);
                if parts.iter().all(|x| x.is_empty()) {
                    break;
                }
                match net.write(rng, now, rank, p, parts) {
                    Ok(0) => break,
                    Ok(k) => {
                        self.core.transmitted(step, &outs, p, k);
                        moved = true;
                    }
                    Err(why) => {
                        read_peer!(p, true);
                        self.core.broken(p, why);
                        moved = true;
                        break;
                    }
                }
            }
            moved |= read_peer!(p, false);
        }
        let at = base + now;
        match self.core.poll(step, &outs, &mut ins, &mut on_frame, at) {
            Status::Pending { deadline } => {
                self.deadline = Some(deadline - base);
                moved
            }
            Status::Done => {
                if let Err(e) = self.core.finish(step, &outs, at) {
                    self.violation = Some(format!("a step that was done failed: {e}"));
                }
                lock(&self.offers).by_rank[rank] = None;
                drop(ins);
                for (i, m) in recv_plan.iter().enumerate() {
                    if bufs[i] != m.data || delivered[i] != m.len {
                        self.violation = Some(format!(
                            "rank {rank} op {} step {}: message {i} from rank {} arrived wrong ({} of {} bytes delivered)",
                            self.op_i, self.step_i, m.peer, delivered[i], m.len
                        ));
                    }
                }
                self.cur = None;
                self.deadline = None;
                self.step_i += 1;
                if self.step_i == self.plan[self.op_i].steps.len() {
                    self.step_i = 0;
                    self.op_i += 1;
                }
                true
            }
            Status::Failed => {
                for p in (0..self.eof.len()).filter(|&p| p != rank) {
                    read_peer!(p, true);
                }
                let error = match self.core.finish(step, &outs, at) {
                    Err(e) => e,
                    Ok(()) => Error::invalid(rank, "sim", "a failed step finished Ok"),
                };
                lock(&self.offers).by_rank[rank] = None;
                drop(ins);
                self.cur = None;
                self.fate = Fate::Failed {
                    error: Box::new(error),
                    at: now,
                    deadline: self.op_started + TIMEOUT,
                };
                self.core.close();
                self.begin_close(net, now);
                true
            }
        }
    }

    fn ctx(&self, base: Instant) -> StepCtx {
        let op = &self.plan[self.op_i];
        StepCtx::started_at(
            self.rank,
            7,
            op.op,
            op.seq,
            DType::U8,
            base + self.op_started,
            TIMEOUT,
        )
    }

    fn begin_close(&mut self, net: &mut Net, now: Duration) {
        for p in (0..self.owed.len()).filter(|&p| p != self.rank) {
            self.owed[p] = self.core.owes_close(p);
            if !self.owed[p] {
                net.fin(self.rank, p);
            }
        }
        self.linger_until = Some(now + LINGER);
    }

    /// Closed: delivers what it owes each peer, then closes the stream in order; reads and
    /// drops whatever arrives meanwhile.
    fn linger(&mut self, net: &mut Net, rng: &mut Rng, now: Duration) -> bool {
        net.discard_input(self.rank);
        let expired = self.linger_until.is_some_and(|t| now >= t);
        let mut idle = Step::idle();
        let mut moved = false;
        for p in 0..self.owed.len() {
            if !self.owed[p] {
                continue;
            }
            loop {
                let parts = self.core.transmit(&mut idle, &[], p);
                if parts.iter().all(|x| x.is_empty()) || expired {
                    self.owed[p] = false;
                    net.fin(self.rank, p);
                    moved = true;
                    break;
                }
                match net.write(rng, now, self.rank, p, parts) {
                    Ok(0) => break,
                    Ok(k) => {
                        self.core.transmitted(&mut idle, &[], p, k);
                        moved = true;
                    }
                    Err(_) => {
                        self.owed[p] = false;
                        moved = true;
                        break;
                    }
                }
            }
        }
        moved
    }
}

fn outgoing(sends: &[Msg]) -> Vec<Outgoing<'_>> {
    sends
        .iter()
        .map(|m| Outgoing {
            peer: m.peer,
            data: &m.data,
            count: m.len as u64,
            tag: m.tag,
        })
        .collect()
}

fn incoming<'a>(plan: &[Msg], bufs: &'a mut [Vec<u8>]) -> Vec<Incoming<'a>> {
    plan.iter()
        .zip(bufs.iter_mut())
        .map(|(m, b)| Incoming {
            peer: m.peer,
            streamed: (b.len() < m.len).then_some(m.len),
            buf: b,
            count: m.len as u64,
            tag: m.tag,
            seq_ahead: 0,
        })
        .collect()
}

fn peers_in_random_order(rng: &mut Rng, n: usize, me: usize) -> Vec<usize> {
    let mut v: Vec<usize> = (0..n).filter(|&p| p != me).collect();
    for i in (1..v.len()).rev() {
        v.swap(i, rng.range(0, i));
    }
    v
}

/// Feeds the core what has arrived from `p`, as the real drivers do: while the step awaits
/// `p` or the core lets it read ahead, or `whatever` has arrived (to learn why a peer left).
/// Returns whether anything moved.
#[allow(
    clippy::too_many_arguments,
    reason = "the pieces of one rank, borrowed apart"
)]
fn read_from(
    core: &mut Core,
    net: &mut Net,
    rng: &mut Rng,
    step: &mut Step,
    outs: &[Outgoing<'_>],
    ins: &mut [Incoming<'_>],
    on_frame: &mut OnFrame<'_>,
    eof: &mut [bool],
    me: usize,
    p: usize,
    whatever: bool,
) -> bool {
    let mut moved = false;
    while !eof[p] && (whatever || core.reads_ahead(step, p) || core.awaits(step, outs, ins, p)) {
        let buf = core.read_buf(step, ins, p);
        if buf.is_empty() {
            break;
        }
        match net.read(rng, p, me, buf) {
            Got::Bytes(k) => {
                core.received(step, ins, p, k, on_frame);
                moved = true;
            }
            Got::Empty => break,
            Got::Eof => {
                core.eof(p);
                eof[p] = true;
                moved = true;
            }
            Got::Error(why) => {
                core.broken(p, why);
                eof[p] = true;
                moved = true;
            }
        }
    }
    moved
}
