//! `GlooBackend`: building it over a transport (the settings every rank agrees on, resolved
//! once the mesh is known) and the one path every operation runs ([`GlooBackend::run`]). The
//! operations themselves are in `ops.rs`, their argument checks in `validate.rs`.

use std::collections::VecDeque;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use dist_backend::{
    Backend, BufMut, BufRef, Capabilities, Error, OpDesc, OpOptions, Result, Store,
};
use dist_wire::{CollectiveOp, DType, NO_ROOT, ReduceOp};

use crate::algo::{
    Op, STAR_MAX_BYTES, agree, allgather, allreduce, alltoall, bcast, blocks_of, choice,
    reducescatter, rooted, takes_star,
};
use crate::options::{FUSED_AGREEMENT_MAX_RANKS, GlooOptions};
use crate::output_copy::{copy_into_output, output_leaves_cache_bytes};
use crate::path_pace::{Paced, PathPace};
use crate::transport::mem::MemTransport;
#[cfg(doc)]
use crate::transport::tcp::MeshOptions;
use crate::transport::tcp::TcpTransport;
use crate::transport::{DeferredSeqs, StepCtx, Transport};
use std::time::Duration;

mod area_pace;
mod ops;
mod validate;

use area_pace::AreaPace;

/// The pure-Rust CPU backend.
pub struct GlooBackend {
    rank: usize,
    world_size: usize,
    group: u32,
    transport: Box<dyn Transport>,
    small_bytes: usize,
    broadcast_scatter_bytes: usize,
    halving_doubling_bytes: usize,
    ring_piece_bytes: usize,
    /// The ring reduce's pieces: `ring_piece_bytes`, or
    /// [`GlooOptions::auto_reduce_piece_bytes`] where that is unset.
    reduce_piece_bytes: usize,
    /// all_gather's ring pieces: `ring_piece_bytes` where no two ranks share memory, else one
    /// piece (the whole ring), resolved once from [`Transport::memory_shared_in_group`].
    all_gather_piece_bytes: usize,
    all_to_all_pairwise_bytes: usize,
    /// [`GlooOptions::area_all_reduce_bytes`], resolved.
    area_all_reduce_bytes: usize,
    /// [`GlooOptions::area_all_gather_bytes`], resolved.
    area_all_gather_bytes: usize,
    /// [`GlooOptions::area_broadcast_min_bytes`], resolved.
    area_broadcast_min_bytes: usize,
    /// [`GlooOptions::area_all_to_all_bytes`], resolved.
    area_all_to_all_bytes: usize,
    /// Where inputs over `area_all_to_all_bytes` may go through the area too
    /// ([`GlooOptions::paced_area_all_to_all_bytes`]): rank 0's pace of them, or a follower's
    /// memory of rank 0's choice.
    area_all_to_all_pace: Option<AreaPace>,
    /// [`GlooOptions::lent_all_to_all_bytes`], resolved. Purely local: ranks may differ.
    lent_all_to_all_bytes: usize,
    /// On rank 0 where the option is unset and lending is on: which all_to_alls it lends,
    /// learnt from how long its calls took each way (`path_pace`). Its choice carries the
    /// group: the others lend whenever their inputs allow, and where rank 0 announces
    /// instead, they follow it by messages (`algo::alltoall::through_shared_memory`).
    all_to_all_pace: Option<LendPace>,
    /// [`GlooOptions::lent_all_gather_bytes`], resolved.
    lent_all_gather_bytes: usize,
    /// As `all_to_all_pace`, for all_gather's lending.
    all_gather_pace: Option<LendPace>,
    /// [`GlooOptions::lent_all_reduce_bytes`], resolved.
    lent_all_reduce_bytes: usize,
    /// As `all_to_all_pace`, for all_reduce's lending.
    all_reduce_pace: Option<LendPace>,
    /// The output size from which this rank's and the other local ranks' outputs together
    /// exceed the host's last-level cache, so that own blocks are copied into outputs with
    /// stores that bypass it (`output_copy`). Purely local: ranks may differ.
    output_leaves_cache_bytes: usize,
    /// reduce_scatter and all_gather up to `small_bytes` run recursive halving
    /// ([`reducescatter::halving`]) and recursive doubling ([`allgather::doubling`]) rather than
    /// one direct exchange: on a power-of-two group of more than two ranks none of which share
    /// memory ([`Transport::memory_shared_in_group`], alike on every rank), as between hosts.
    /// There each of a rank's n − 1 messages in the direct exchange costs a system call and a
    /// socket wake-up, where these send log2 n (Open MPI runs them there too). Measured with
    /// gloo_bench over loopback TCP only on a 2-core host, 4 ranks, alternated 4-5 times, us
    /// (per-rank output). reduce_scatter: 4 B 45.5-46.3 against 66.6-82.5 direct, 1 KiB
    /// 50.4-51.7 against 69.1-70.2, 16 KiB 79.1-83.9 against 97.7-100.7, 64 KiB 186.9-196.8
    /// against 204.4-207.5. all_gather: 64 B 45.4-53.8 against 66.6-90.6, 1 KiB 50.0-60.5
    /// against 68.6-85.5, 16 KiB 71.4-111.5 against 93.5-140.1. Through shared memory the
    /// direct exchange was as fast from 32 KiB per rank and faster below (reduce_scatter of
    /// 1 KiB: 11.6-14.6 against 20.2-25.6), so it stays there.
    pairs_over_sockets: bool,
    fused_agreement_max_ranks: usize,
    /// Whether this rank, as a rooted op's root, verifies the others' agreement frames
    /// lazily ([`GlooOptions::lazy_root_verification`]).
    lazy_root: bool,
    /// The agreement frames the roots of earlier rooted ops left unread (see
    /// [`GlooOptions::lazy_root_verification`]), oldest first: read before anything else.
    deferred: Mutex<VecDeque<agree::Deferred>>,
    /// A root's operations that only sent and read nothing, with no agreement frames owed
    /// ([`agree::repeats_silently`]), since it last looked at what its peers sent
    /// ([`Transport::look`]), and the last of them (judged at close).
    blind: Mutex<Blind>,
    seq: AtomicU64,
    /// This rank's last rooted operation and the first of the run of same calls that ends
    /// with it (see `StepCtx::last_rooted` and `StepCtx::last_rooted_from`).
    last_rooted: Mutex<(Option<OpDesc>, u64)>,
    /// The first error; once set, the group refuses further operations.
    poisoned: Mutex<Option<String>>,
    /// Receive scratch, as `u64` so that typed views of it are aligned.
    scratch: Mutex<Vec<u64>>,
    /// reduce_scatter's copy of its input for the rounds that combine in place
    /// ([`reducescatter::halving`]), kept so that they allocate nothing.
    halving_work: Mutex<Vec<u8>>,
}

/// What a root ran without reading its links ([`GlooBackend::blind`]).
#[derive(Default)]
struct Blind {
    /// Operations since the last look.
    ops: usize,
    /// The last of them, with its count: a look at close judges what came against it.
    last: Option<(StepCtx, u64)>,
    /// The sequence number of the first of the operations, each the same call, that this
    /// rank has run without reading since it last ran anything else: a look names this
    /// rank's side of a frame of any of them as that call.
    run_from: Option<u64>,
}

impl std::fmt::Debug for GlooBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GlooBackend")
            .field("rank", &self.rank)
            .field("world_size", &self.world_size)
            .field("group", &self.group)
            .finish()
    }
}

impl GlooBackend {
    /// Connects a full TCP mesh among `world_size` ranks through `store`, under the key prefix
    /// `prefix` (one prefix per group), within [`MeshOptions::timeout`] from now.
    pub fn connect(
        store: &dyn Store,
        prefix: &str,
        rank: usize,
        world_size: usize,
        opts: &GlooOptions,
    ) -> Result<Self> {
        // One deadline for the whole rendezvous, however many store calls it makes.
        let deadline = dist_backend::deadline_after(Instant::now(), opts.mesh.timeout);
        Self::connect_by(store, prefix, rank, world_size, opts, deadline)
    }

    /// [`GlooBackend::connect`] ending by `deadline`, that of the call it serves (init, a
    /// sub-group's creation), instead of a timeout of its own from now: every store call and
    /// connection of the rendezvous ends by it. [`MeshOptions::timeout`] then only bounds how
    /// long a closed connection lingers for its peer.
    pub fn connect_by(
        store: &dyn Store,
        prefix: &str,
        rank: usize,
        world_size: usize,
        opts: &GlooOptions,
        deadline: Instant,
    ) -> Result<Self> {
        if rank >= world_size {
            return Err(Error::invalid(
                rank,
                "init",
                format!("rank {rank} is not below world size {world_size}"),
            ));
        }
        let t = TcpTransport::connect_by(store, prefix, rank, world_size, &opts.mesh, deadline)?;
        let backend = Self::over(Box::new(t), crate::transport::tcp::group_id(prefix), opts);
        // Compared once resolved, after the mesh: a rank that sets the value another's `auto`
        // resolves to chooses alike and is not refused.
        let mine = backend.algorithm_settings(opts.mesh.segment_bytes);
        let agreeing = || format!("group {prefix}: agreeing on the algorithm settings");
        choice::publish(store, prefix, rank, &mine, deadline)
            .map_err(|e| e.in_store_call(rank, agreeing))?;
        choice::check(store, prefix, rank, world_size, &mine, deadline)
            .map_err(|e| e.in_store_call(rank, agreeing))?;
        Ok(backend)
    }

    /// The settings that choose algorithms, as resolved for this group
    /// ([`choice::settings`]), which every rank must have alike. Not
    /// `all_to_all_pairwise_bytes`: all_to_all's two schedules interoperate, so ranks may
    /// choose differently (`alltoall::by_messages`).
    fn algorithm_settings(&self, segment_bytes: usize) -> String {
        let v = |n: usize| n.to_string();
        choice::settings(&[
            ("small_bytes", v(self.small_bytes)),
            ("segment_bytes", v(segment_bytes)),
            (
                "fused_agreement_max_ranks",
                v(self.fused_agreement_max_ranks),
            ),
            ("broadcast_scatter_bytes", v(self.broadcast_scatter_bytes)),
            ("halving_doubling_bytes", v(self.halving_doubling_bytes)),
            ("ring_piece_bytes", v(self.ring_piece_bytes)),
            ("reduce_piece_bytes", v(self.reduce_piece_bytes)),
            ("area_all_reduce_bytes", v(self.area_all_reduce_bytes)),
            ("area_all_gather_bytes", v(self.area_all_gather_bytes)),
            ("area_broadcast_min_bytes", v(self.area_broadcast_min_bytes)),
            ("area_all_to_all_bytes", v(self.area_all_to_all_bytes)),
            ("lent_all_gather_bytes", v(self.lent_all_gather_bytes)),
            ("lent_all_reduce_bytes", v(self.lent_all_reduce_bytes)),
            // Not an algorithm, but whether a repeated broadcast's receivers send their root an
            // agreement frame (`agree::repeats_silently`), which an eager root waits for.
            ("lazy_root_verification", self.lazy_root.to_string()),
        ])
    }

    /// A backend over any transport (e.g. [`MemTransport::network`] in tests).
    pub fn over(transport: Box<dyn Transport>, group: u32, opts: &GlooOptions) -> Self {
        let world_size = transport.world_size();
        let one_host = transport.one_host();
        let memory_shared = transport.memory_shared_in_group();
        let cores_shared = transport.cores_shared();
        let rank = transport.rank();
        let lent_all_to_all_bytes = opts
            .lent_all_to_all_bytes
            .unwrap_or_else(|| GlooOptions::auto_lent_all_to_all_bytes(cores_shared));
        let lent_all_gather_bytes = opts
            .lent_all_gather_bytes
            .unwrap_or_else(|| GlooOptions::auto_lent_all_gather_bytes(cores_shared));
        let lent_all_reduce_bytes = opts
            .lent_all_reduce_bytes
            .unwrap_or_else(|| GlooOptions::auto_lent_all_reduce_bytes(world_size, cores_shared));
        let area_all_to_all_bytes = opts
            .area_all_to_all_bytes
            .unwrap_or_else(|| GlooOptions::auto_area_all_to_all_bytes(cores_shared));
        let paced_top = opts
            .paced_area_all_to_all_bytes
            .unwrap_or_else(|| GlooOptions::auto_paced_area_all_to_all_bytes(cores_shared))
            .min(alltoall::input_room(
                transport.shared_memory_bytes(),
                world_size,
            ));
        // Lending, where on, takes the inputs the area does not, and paces them itself.
        let area_all_to_all_pace = (world_size > 1
            && area_all_to_all_bytes != 0
            && paced_top > area_all_to_all_bytes
            && lent_all_to_all_bytes == usize::MAX)
            .then(|| AreaPace::new(rank, world_size, area_all_to_all_bytes, paced_top));
        let local_ranks = 1 + transport
            .shared_memory_peers()
            .iter()
            .filter(|&&p| p)
            .count();
        let pieces = |auto: fn(usize, bool) -> usize| match opts.ring_piece_bytes {
            Some(0) => usize::MAX,
            Some(v) => v,
            None => auto(world_size, memory_shared),
        };
        let ring_piece_bytes = pieces(GlooOptions::auto_ring_piece_bytes);
        GlooBackend {
            rank: transport.rank(),
            world_size: transport.world_size(),
            group,
            transport,
            small_bytes: opts
                .small_bytes
                .unwrap_or_else(|| GlooOptions::auto_small_bytes(world_size)),
            broadcast_scatter_bytes: opts
                .broadcast_scatter_bytes
                .unwrap_or_else(|| GlooOptions::auto_broadcast_scatter_bytes(world_size)),
            halving_doubling_bytes: opts
                .halving_doubling_bytes
                .unwrap_or_else(|| GlooOptions::auto_halving_doubling_bytes(world_size, one_host)),
            ring_piece_bytes,
            reduce_piece_bytes: pieces(GlooOptions::auto_reduce_piece_bytes),
            all_gather_piece_bytes: if memory_shared {
                usize::MAX
            } else {
                ring_piece_bytes
            },
            all_to_all_pairwise_bytes: opts.all_to_all_pairwise_bytes.unwrap_or_else(|| {
                GlooOptions::auto_all_to_all_pairwise_bytes(world_size, memory_shared)
            }),
            area_all_reduce_bytes: opts
                .area_all_reduce_bytes
                .unwrap_or_else(|| GlooOptions::auto_area_all_reduce_bytes(cores_shared)),
            area_all_gather_bytes: opts
                .area_all_gather_bytes
                .unwrap_or_else(|| GlooOptions::auto_area_all_gather_bytes(cores_shared)),
            area_broadcast_min_bytes: opts
                .area_broadcast_min_bytes
                .unwrap_or_else(|| GlooOptions::auto_area_broadcast_min_bytes(cores_shared)),
            area_all_to_all_bytes,
            area_all_to_all_pace,
            lent_all_to_all_bytes,
            all_to_all_pace: LendPace::on_rank_zero(
                rank,
                opts.lent_all_to_all_bytes,
                lent_all_to_all_bytes,
            ),
            lent_all_gather_bytes,
            all_gather_pace: LendPace::on_rank_zero(
                rank,
                opts.lent_all_gather_bytes,
                lent_all_gather_bytes,
            ),
            lent_all_reduce_bytes,
            all_reduce_pace: LendPace::on_rank_zero(
                rank,
                opts.lent_all_reduce_bytes,
                lent_all_reduce_bytes,
            ),
            output_leaves_cache_bytes: output_leaves_cache_bytes(local_ranks),
            pairs_over_sockets: !memory_shared && world_size > 2 && world_size.is_power_of_two(),
            fused_agreement_max_ranks: opts
                .fused_agreement_max_ranks
                .unwrap_or(FUSED_AGREEMENT_MAX_RANKS),
            lazy_root: opts.lazy_root_verification.unwrap_or(true),
            deferred: Mutex::new(VecDeque::new()),
            blind: Mutex::new(Blind::default()),
            seq: AtomicU64::new(0),
            last_rooted: Mutex::new((None, 0)),
            poisoned: Mutex::new(None),
            scratch: Mutex::new(Vec::new()),
            halving_work: Mutex::new(Vec::new()),
        }
    }

    /// Messages this rank has sent as single-copy transfers (the receiver copied them out of
    /// this process's memory, see [`MeshOptions::cross_memory`]): for tests and diagnostics.
    pub fn messages_by_reference(&self) -> u64 {
        self.transport.messages_by_reference()
    }

    /// Frames this rank received by reference and copied half on a helper thread
    /// (`MeshOptions::copy_helper`).
    pub fn copies_split(&self) -> u64 {
        self.transport.copies_split()
    }

    /// [`GlooBackend::messages_by_reference`] per receiving rank: which peers this rank shares
    /// memory with in practice (tests check that ranks on different hosts never do).
    pub fn messages_by_reference_per_peer(&self) -> Vec<u64> {
        self.transport.messages_by_reference_per_peer()
    }

    /// Whether the whole group shares memory on one host ([`Transport::one_host`]), which
    /// some algorithm defaults follow: for tests and diagnostics.
    pub fn one_host(&self) -> bool {
        self.transport.one_host()
    }

    /// Whether some two ranks of the group may share memory, through rings or single copy
    /// ([`Transport::memory_shared_in_group`]), which keeps all_to_all's blocks all in flight
    /// at once ([`GlooOptions::auto_all_to_all_pairwise_bytes`]) and all_gather's ring whole.
    pub fn memory_shared_in_group(&self) -> bool {
        self.transport.memory_shared_in_group()
    }

    /// Whether the group's ranks outnumber the CPUs of the one host they share
    /// ([`Transport::cores_shared`]), which some algorithm defaults follow: for tests and
    /// diagnostics.
    pub fn cores_shared(&self) -> bool {
        self.transport.cores_shared()
    }

    /// Operations this rank has run through the group's shared-memory area instead of
    /// messages, one per exchange (barriers, small collectives, and those
    /// [`GlooOptions::area_all_reduce_bytes`], [`GlooOptions::area_all_gather_bytes`] and
    /// [`GlooOptions::area_broadcast_min_bytes`] send there): for tests and diagnostics.
    pub fn shared_memory_exchanges(&self) -> u64 {
        self.transport.shared_memory_exchanges()
    }

    /// The peers this rank reaches through shared-memory rings rather than sockets (indexed by
    /// rank; see [`MeshOptions::transport`]): for tests and diagnostics.
    pub fn shared_memory_peers(&self) -> Vec<bool> {
        self.transport.shared_memory_peers()
    }

    /// `world_size` backends connected in memory, one per rank: the real algorithms with no
    /// sockets.
    pub fn in_memory(world_size: usize, opts: &GlooOptions) -> Vec<GlooBackend> {
        MemTransport::network(world_size, opts.mesh.segment_bytes)
            .into_iter()
            .map(|t| Self::over(Box::new(t), 0, opts))
            .collect()
    }

    /// Sequence number the next collective will carry.
    pub fn next_seq(&self) -> u64 {
        self.seq.load(Ordering::Relaxed)
    }

    /// Runs one operation: refuses if the group is aborted, assigns the next sequence number,
    /// has every rank agree on a rooted op's arguments (see [`agree`]), and aborts the
    /// group if the operation fails (its connections are then in an unknown state, as in
    /// Gloo). `splits` are the per-rank element counts every rank must pass alike, if any.
    #[allow(
        clippy::too_many_arguments,
        reason = "one call site per operation, each naming every field"
    )]
    fn run<R>(
        &self,
        name: CollectiveOp,
        dtype: DType,
        count: usize,
        reduce: Option<ReduceOp>,
        root: Option<usize>,
        splits: Option<&[usize]>,
        opts: &OpOptions,
        f: impl FnOnce(&Op<'_>, &mut Vec<u64>) -> Result<R>,
    ) -> Result<R> {
        if let Some(cause) = self
            .poisoned
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
        {
            return Err(Error::Aborted {
                rank: self.rank,
                op: name.name(),
                cause,
            });
        }
        let seq = match (name, opts.seq) {
            (CollectiveOp::SendRecv, _) => 0,
            (_, Some(seq)) => {
                self.seq.store(seq.saturating_add(1), Ordering::Relaxed);
                seq
            }
            (_, None) => self.seq.fetch_add(1, Ordering::Relaxed),
        };
        let mut ctx = StepCtx::new(self.rank, self.group, name, seq, dtype, opts.timeout);
        ctx.reduce = reduce.map_or(0, |r| r.code());
        ctx.root = root.map_or(NO_ROOT, |r| r as u32);
        ctx.splits = splits.map_or(0, dist_wire::splits_fingerprint);
        ctx.reduce_arg = reduce.map_or(0, |r| r.param_fingerprint());
        let this = ctx.desc(count as u64);
        // Whether this call repeats this rank's last rooted one (see `agree::same_call`);
        // point-to-point calls have none.
        let mut repeat = false;
        if name != CollectiveOp::SendRecv {
            let mut last = self.last_rooted.lock().unwrap_or_else(|e| e.into_inner());
            (ctx.last_rooted, ctx.last_rooted_from) = *last;
            repeat = agree::same_call(ctx.last_rooted.as_ref(), &this);
            if name.rooted() {
                let run_goes_on = repeat && ctx.last_rooted.is_some_and(|l| l.seq + 1 == seq);
                *last = (Some(this), if run_goes_on { last.1 } else { seq });
            }
        }
        // What a root sends of each rooted call: the buffer, or for a scatter every block.
        let root_bytes = count
            * dtype.size()
            * if name == CollectiveOp::Scatter {
                self.world_size
            } else {
                1
            };
        let silent = agree::repeats_silently(name, self.lazy_root, repeat, root_bytes);
        let mut scratch = self.scratch.lock().unwrap_or_else(|e| e.into_inner());
        let lazy = self.lazy_root
            && root == Some(self.rank)
            && self.world_size <= self.fused_agreement_max_ranks;
        // A lazy root that only sends reads nothing this operation: older deferred frames
        // may stay queued. A broadcast through the group area is not one: it waits for every
        // rank's header.
        let sends_only = lazy
            && match name {
                CollectiveOp::Broadcast => !bcast::takes_area(
                    &*self.transport,
                    count * dtype.size(),
                    self.area_broadcast_min_bytes,
                ),
                CollectiveOp::Scatter => true,
                _ => false,
            };
        let keep = if sends_only {
            agree::deferred_keep(root_bytes)
        } else {
            0
        };
        // A root that reads nothing, since no frames are owed to it, looks at what its peers
        // sent after every `agree::LOOK_EVERY` such operations, before the next (after its
        // older deferred frames, which lie ahead of anything else on the connections).
        let look = (name != CollectiveOp::SendRecv)
            .then(|| self.blind_run(&ctx, count as u64, sends_only && silent))
            .flatten();
        let res = self
            .verify_deferred(if look.is_some() { 0 } else { keep }, ctx.deadline)
            .and_then(|left| match look {
                Some(run_from) => self
                    .transport
                    .look(&ctx, count as u64, run_from)
                    .map(|()| left),
                None => Ok(left),
            })
            .and_then(|left| {
                ctx.deferred = left;
                let o = Op::new(&*self.transport, ctx, count as u64);
                if !name.rooted() || self.world_size == 1 {
                    f(&o, &mut scratch)
                } else if self.world_size <= self.fused_agreement_max_ranks {
                    // A reduce's or gather's root advises the others of its view (see
                    // `agree::Pending::new`) when its arguments differ from those of this rank's
                    // last rooted operation: of two ranks that each take themselves for the root,
                    // at most one can be repeating the last one (which every rank ran alike), so
                    // the other's frame reaches it as it waits. Repeats send none: with a frame
                    // on every call (and a pass over the stash on every poll, since narrowed),
                    // 4-rank reduces of 4 B over TCP took 30 us against 13.
                    let root_receives =
                        matches!(name, CollectiveOp::Reduce | CollectiveOp::Gather) && !repeat;
                    let mut pending = agree::Pending::new(
                        self.world_size,
                        self.rank,
                        ctx.root as usize,
                        root_receives,
                        lazy,
                        silent,
                    );
                    if !self
                        .deferred
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .is_empty()
                    {
                        pending.behind_deferred();
                    }
                    *o.agree.borrow_mut() = Some(pending);
                    let r = f(&o, &mut scratch)?;
                    if let Some(d) = o.finish_agreement()? {
                        let mut q = self.deferred.lock().unwrap_or_else(|e| e.into_inner());
                        q.push_back(d);
                    }
                    Ok(r)
                } else {
                    agree::rooted_args(&o).and_then(|()| f(&o, &mut scratch))
                }
            });
        if let Err(e) = &res {
            self.fail(e);
        }
        res
    }

    /// Reads, oldest first, the agreement frames earlier rooted ops' roots left unread, by
    /// `deadline`, once more than `keep` of those ops are left: then down to `keep / 2`, in
    /// one step for each run of ops alike ([`agree::Deferred::joins`]). Why half: a root of
    /// back-to-back broadcasts that read one op's frames before each new one took two steps
    /// per broadcast, and the second cost as much as the first (2 ranks over shared memory,
    /// 4-byte broadcasts: 0.95-1.0 us against 0.7 with no reads at all); reading the older
    /// half of the queue at once costs one step per half a queue of broadcasts (17 of
    /// [`agree::MAX_DEFERRED`] = 32 for small ones; [`agree::deferred_keep`] for large), and
    /// leaves the root `keep / 2` operations ahead of the frames it has read, so that it
    /// seldom waits for its receivers' newest frames. Returns the operations still deferred,
    /// for the next operation's context (`StepCtx::deferred`).
    fn verify_deferred(&self, keep: usize, deadline: Instant) -> Result<DeferredSeqs> {
        let mut q = self.deferred.lock().unwrap_or_else(|e| e.into_inner());
        let left = |q: &VecDeque<agree::Deferred>| {
            let mut seqs = DeferredSeqs::default();
            q.iter().for_each(|d| seqs.insert(d.seq()));
            seqs
        };
        if q.len() <= keep {
            return Ok(left(&q));
        }
        let target = keep / 2;
        while q.len() > target {
            let first = q.front().expect("the queue is longer than its target");
            let run = 1 + q
                .iter()
                .take(q.len() - target)
                .skip(1)
                .take_while(|d| first.joins(d))
                .count();
            let batch: Vec<agree::Deferred> = q.drain(..run).collect();
            agree::verify_deferred(&*self.transport, &batch, deadline)?;
        }
        Ok(left(&q))
    }

    /// Counts operation `ctx` (with `count`) in [`GlooBackend::blind`] when it reads nothing
    /// (`blind`: a root that only sends and is owed no frames), else ends the run of such
    /// operations. `Some(run_from)` (see `Transport::look`) when this one is past
    /// [`agree::LOOK_EVERY`] of them since the last look: look before it.
    fn blind_run(&self, ctx: &StepCtx, count: u64, blind: bool) -> Option<Option<u64>> {
        let mut b = self.blind.lock().unwrap_or_else(|e| e.into_inner());
        if !blind {
            b.run_from = None;
            return None;
        }
        b.ops += 1;
        b.last = Some((*ctx, count));
        b.run_from.get_or_insert(ctx.seq);
        (b.ops > agree::LOOK_EVERY).then(|| {
            b.ops = 0;
            b.run_from
        })
    }

    /// Aborts the group after `e`: its connections are in an unknown state.
    fn fail(&self, e: &Error) {
        tracing::warn!(rank = self.rank, error = %e, "operation failed; the group is aborted");
        self.transport.abort();
        let mut p = self.poisoned.lock().unwrap_or_else(|e| e.into_inner());
        p.get_or_insert_with(|| e.to_string());
    }

    fn prepare(&self, o: &Op<'_>, rop: ReduceOp, data: &mut [u8]) -> Result<()> {
        dist_wire::prepare(rop, o.dtype(), data, self.world_size).map_err(|e| o.wire(e))
    }

    fn finalize(&self, o: &Op<'_>, rop: ReduceOp, data: &mut [u8]) -> Result<()> {
        dist_wire::finalize(rop, o.dtype(), data, self.world_size).map_err(|e| o.wire(e))
    }
}

impl Drop for GlooBackend {
    fn drop(&mut self) {
        Backend::close(self);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::mem::MemTransport;

    fn backend(world_size: usize, opts: &GlooOptions) -> GlooBackend {
        let t = MemTransport::network(world_size, 1 << 20).remove(0);
        GlooBackend::over(Box::new(t), 0, opts)
    }

    #[test]
    fn ring_pieces_follow_whether_ranks_share_memory() {
        // The in-memory network shares no memory between ranks, as TCP between hosts.
        let b = backend(4, &GlooOptions::default());
        assert_eq!(b.ring_piece_bytes, 4 * (512 << 10));
        assert_eq!(b.reduce_piece_bytes, 4 * (512 << 10));
        let b = backend(2, &GlooOptions::default());
        assert_eq!(b.ring_piece_bytes, 2 * (512 << 10));
        assert_eq!(
            b.reduce_piece_bytes,
            2 << 20,
            "the 2-rank reduce keeps 1 MiB per rank"
        );
        assert_eq!(GlooOptions::auto_ring_piece_bytes(4, true), 4 << 20);
        assert_eq!(GlooOptions::auto_reduce_piece_bytes(4, true), 4 << 20);
        let set = GlooOptions {
            ring_piece_bytes: Some(12345),
            ..GlooOptions::default()
        };
        let b = backend(2, &set);
        assert_eq!((b.ring_piece_bytes, b.reduce_piece_bytes), (12345, 12345));
    }
}

/// Rank 0's learning of which calls of one operation lend their inputs through the group area
/// (`path_pace`, over its own calls as one "peer"): its choice carries the group.
#[derive(Debug)]
pub(crate) struct LendPace(Mutex<PathPace>);

impl LendPace {
    /// Rank 0's learning for calls of at least `resolved` bytes, where the user left the
    /// threshold unset (`set`) and it resolved to lending at all; `None` elsewhere: other
    /// ranks follow rank 0, and a threshold set lends every such call.
    fn on_rank_zero(rank: usize, set: Option<usize>, resolved: usize) -> Option<Self> {
        (rank == 0 && set.is_none() && resolved != usize::MAX)
            .then(|| LendPace(Mutex::new(PathPace::with_min_bytes(1, resolved))))
    }

    /// Whether the next call of `len` bytes lends.
    pub(crate) fn lends(&self, len: usize) -> bool {
        self.0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .choose(0, len, false)
    }

    /// Learns from a call of `len` bytes that succeeded in `took`, lent or by messages.
    pub(crate) fn record(&self, len: usize, lent: bool, took: Duration) {
        self.0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .record(&Paced {
                peer: 0,
                len,
                rule_by_ref: false,
                by_ref: lent,
                took: Some(took),
            });
    }
}
