//! `GlooBackend`: validation, sequence numbers and algorithm choice over a transport.

use std::collections::VecDeque;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use dist_backend::{
    Backend, BufMut, BufRef, Capabilities, Error, OpDesc, OpOptions, Result, Store,
};
use dist_wire::{CollectiveOp, DType, NO_ROOT, ReduceOp};

use crate::algo::{
    Op, agree, allgather, allreduce, bcast, blocks_of, choice, reducescatter, rooted,
};
use crate::output_copy::copy_to_output;
use crate::transport::mem::MemTransport;
use crate::transport::tcp::{MeshOptions, TcpTransport};
use crate::transport::{StepCtx, Transport};

/// Tuning of the Gloo backend.
#[derive(Clone, Debug, Default)]
pub struct GlooOptions {
    /// How the TCP mesh is built (address, timeout, segment size, busy-poll time).
    pub mesh: MeshOptions,
    /// Buffers up to this many bytes use the latency-bound algorithms (recursive doubling,
    /// binomial trees); larger ones the bandwidth-bound ones (ring, chain). `None` picks
    /// [`GlooOptions::auto_small_bytes`]. Every rank must use the same value: a disagreement
    /// fails with an error naming the algorithm step.
    pub small_bytes: Option<usize>,
    /// Groups of up to this many ranks check a rooted op's arguments inside its first step
    /// (no extra round); larger ones run a dissemination exchange before the data. `None`
    /// picks [`FUSED_AGREEMENT_MAX_RANKS`]. Every rank must use the same value: a
    /// disagreement fails with an error naming the algorithm step.
    pub fused_agreement_max_ranks: Option<usize>,
    /// Whether the root of a rooted op returns as soon as its data is out, leaving the other
    /// ranks' agreement frames to be verified at the start of its next operation on the
    /// group (or when the group is closed): a disagreement is then reported on the root one
    /// operation later, still naming both sides, and the root no longer waits for every
    /// rank to have entered the operation. `false` makes it read every frame before it
    /// returns. `None` is `true` (`DIST_GLOO_EAGER_ROOT=1` sets `false`). Purely local:
    /// ranks may differ.
    pub lazy_root_verification: Option<bool>,
    /// Broadcasts of at least this many bytes on more than two ranks scatter the buffer and
    /// ring all-gather it (van de Geijn) instead of running the pipelined chain. `None`
    /// picks [`GlooOptions::auto_broadcast_scatter_bytes`]; `DIST_GLOO_BCAST_SCATTER_BYTES`
    /// sets it. Every rank must use the same value (checked when the group is built).
    pub broadcast_scatter_bytes: Option<usize>,
    /// all_reduce buffers of more than [`HALVING_DOUBLING_MIN_BYTES`] and up to this many bytes
    /// run recursive halving and doubling (Rabenseifner) instead of recursive doubling or the
    /// ring. `None` picks [`GlooOptions::auto_halving_doubling_bytes`] once the mesh is built
    /// (it depends on whether the whole group is on one host); `0` turns it off;
    /// `DIST_GLOO_HALVING_DOUBLING_BYTES` sets it. Every rank must use the same value (checked
    /// when the group is built).
    pub halving_doubling_bytes: Option<usize>,
    /// The ring all_reduce runs on consecutive pieces of about this many bytes, each a whole
    /// reduce-scatter and all-gather, so that a piece is still in cache when the all-gather touches
    /// it again; the ring reduce_scatter (on its input) and reduce run on pieces of this size too,
    /// so that no step fills the shared-memory rings or socket buffers with megabytes that leave
    /// the caches before the peer reads them; so does the ring all_gather (on its output) where no
    /// two ranks share memory ([`Transport::memory_shared_in_group`]). `None` picks
    /// [`GlooOptions::auto_ring_piece_bytes`] once the mesh is built (it depends on whether ranks
    /// share memory), and [`GlooOptions::auto_reduce_piece_bytes`] for the reduce;
    /// `DIST_GLOO_RING_PIECE_BYTES` sets it (`0` runs the
    /// whole buffer as one piece). Every rank must use the same value (checked when the group is
    /// built).
    pub ring_piece_bytes: Option<usize>,
    /// On more than two ranks, an all_to_all in which this rank sends or receives a block of at
    /// least this many bytes to or from another rank runs as n − 1 pairwise exchanges (step k: send
    /// to rank + k, receive from rank − k, as Open MPI does for large blocks) instead of every
    /// block in flight at once. `None` picks [`GlooOptions::auto_all_to_all_pairwise_bytes`] once
    /// the mesh is built; `DIST_GLOO_ALLTOALL_PAIRWISE_BYTES` sets it. Purely local: ranks may
    /// differ (with uneven splits they may choose differently anyway), since every block of an
    /// all_to_all carries the same step tag and a rank keeps a block that arrives before the
    /// exchange that takes it.
    pub all_to_all_pairwise_bytes: Option<usize>,
}

/// all_reduce buffers up to this size never run recursive halving and doubling: its 2·log2 n
/// steps cost more than recursive doubling's log2 n while latency dominates (4 ranks over
/// TCP: 16 KiB took 92 us against 83-89 us; from 32 KiB it is ahead).
pub const HALVING_DOUBLING_MIN_BYTES: usize = 16 << 10;

/// The default of [`GlooOptions::fused_agreement_max_ranks`].
pub const FUSED_AGREEMENT_MAX_RANKS: usize = agree::FUSED_MAX_RANKS;

/// How many rooted operations that only send a lazy root
/// ([`GlooOptions::lazy_root_verification`]) may run before it reads its receivers'
/// agreement frames: the bound on how many operations later such a root hears that its
/// receivers disagreed with it.
pub const LAZY_ROOT_MAX_DEFERRED: usize = agree::MAX_DEFERRED;

impl GlooOptions {
    /// The switch point, measured with `cargo xtask bench all_reduce -b 4K -e 4M -f 4` over
    /// loopback on a 2-core host forcing each algorithm in turn (`DIST_GLOO_SMALL_BYTES=0` and
    /// `=100000000`): with two ranks the ring (then one exchange each way per phase) wins from
    /// 16 KiB; with more ranks recursive doubling's log2(n) whole-buffer exchanges win up to
    /// about 256 KiB, where the ring's 2(n-1) latency-bound steps stop dominating.
    pub fn auto_small_bytes(world_size: usize) -> usize {
        if world_size <= 2 { 16 << 10 } else { 256 << 10 }
    }

    /// The default of [`GlooOptions::halving_doubling_bytes`], measured with
    /// `cargo xtask bench all_reduce` on a 2-core host, alternating against recursive doubling
    /// and the ring: at 4 ranks over TCP (`DIST_GLOO_CMA=0 DIST_GLOO_TRANSPORT=tcp`) it took
    /// 0.56-0.72x their time from 64 KiB to 1 MiB, even at 2 MiB, 1.1-1.3x from 8 MiB (the
    /// ring's pipelining wins); over shared memory 0.47-0.8x from 16 KiB to 4 MiB. With 2 or 3
    /// ranks (one exchange pair, the third folded in) it has nothing to halve and loses
    /// (1.2-1.3x at 3 ranks up to 256 KiB): off. When every rank of the group shares memory on
    /// one host (`one_host`; [`Transport::one_host`]), the ring's steps cost no network round
    /// trip, and since the ring learnt to run in pieces it wins from 512 KiB: 4 ranks on 2
    /// cores, alternated with 2 MiB, 512 KiB took 134-144 us against 167-284 and 768 KiB
    /// 183-280 against 277-365 (384 KiB even, 256 KiB and below halving-doubling's), so there
    /// it stops at 256 KiB (measured only with the ranks outnumbering the cores; on a host
    /// with a core per rank the ring's steps are cheaper still).
    pub fn auto_halving_doubling_bytes(world_size: usize, one_host: bool) -> usize {
        match (world_size >= 4, one_host) {
            (false, _) => 0,
            (true, false) => 2 << 20,
            (true, true) => 256 << 10,
        }
    }

    /// The default of [`GlooOptions::ring_piece_bytes`], resolved once the mesh is built: 1 MiB
    /// per rank where some ranks of the group share memory
    /// ([`Transport::memory_shared_in_group`]), 512 KiB per rank where none do (TCP only), so
    /// that each rank's block of a piece, with the socket buffers it passes through, stays in
    /// its share of the L2.
    ///
    /// Measured with gloo_bench on a 2-core host (1 MiB of L2 per core, 32 MiB of L3). Over
    /// shared memory, against one piece: 2 ranks took 0.83x the time at 16 MiB and 0.85x at 64
    /// MiB (pieces of 0.5, 1 and 2 MiB within noise of each other); 4 ranks (two per core) 1.0x
    /// at 16 MiB and 0.8x at 64 MiB, where pieces of 1 MiB (more steps, each a round of context
    /// switches) took 1.1-1.3x, and pieces of 2 MiB were even with 4. Over TCP only
    /// (`DIST_GLOO_TRANSPORT=tcp DIST_GLOO_CMA=0`), 512 KiB blocks against 1 MiB, alternated
    /// (medians of 5-8 runs): 4-rank all_reduce 6.2 against 8.1 ms at 4 MiB, 22.7 against 29
    /// at 16 MiB, 92 against 119 at 64 MiB; 2-rank all_reduce 1.6 against 2.0, 5.8 against
    /// 8.2 and 28 against 32 ms; 4-rank reduce_scatter, all_gather and reduce 0.8-0.95x the
    /// time, 2-rank reduce_scatter and all_gather even or faster. The 2-rank reduce lost
    /// (1.15x), so it keeps 1 MiB per rank ([`GlooOptions::auto_reduce_piece_bytes`]).
    pub fn auto_ring_piece_bytes(world_size: usize, memory_shared: bool) -> usize {
        let per_rank = if memory_shared { 1 << 20 } else { 512 << 10 };
        world_size.saturating_mul(per_rank)
    }

    /// The pieces of the ring reduce where [`GlooOptions::ring_piece_bytes`] is unset:
    /// [`GlooOptions::auto_ring_piece_bytes`], except on two ranks none of which share memory,
    /// where 1 MiB per rank took 0.85-0.89x the time of 512 KiB (TCP only, 4 to 64 MiB, alternated):
    /// each of its pieces ends with the root waiting for the other rank's block, a round trip
    /// that smaller pieces pay more often.
    pub fn auto_reduce_piece_bytes(world_size: usize, memory_shared: bool) -> usize {
        GlooOptions::auto_ring_piece_bytes(world_size, memory_shared || world_size == 2)
    }

    /// The default of [`GlooOptions::all_to_all_pairwise_bytes`]: blocks of 256 KiB when no two
    /// ranks of the group share memory (through rings or single copy;
    /// [`Transport::memory_shared_in_group`]), as between hosts, where every block travels over a
    /// TCP stream; never otherwise, nor on two ranks (one exchange either way). Measured with
    /// gloo_bench over loopback TCP only on a 2-core host, all at once against pairwise,
    /// alternated: 4 ranks, 1 MiB blocks took 4450-4894 us against 2063-3151, 4 MiB blocks
    /// 13.9-15.3 ms against 10.2-10.9, 16 MiB 52-55 ms against 40-42; 3 ranks, 1.3 MiB blocks
    /// 2605-3740 us against 1569-1761. With every block in flight, each rank feeds n − 1 sockets at
    /// once and every receiver is fed by n − 1 senders. Through shared-memory rings all at once was
    /// as fast or faster (4 ranks, 1 MiB blocks 370-507 us against 551-573), and so it was for
    /// blocks sent by reference over TCP on one host (`DIST_GLOO_TRANSPORT=tcp` with single copy
    /// on: 1 MiB blocks 475-490 us against 515-631; its 64 KiB blocks, which go over the sockets,
    /// were faster pairwise, 137-306 against 371-374). Smaller blocks were faster pairwise too over
    /// TCP only (4 ranks, 4 KiB blocks 53-66 us against 76-98), but each exchange is a network
    /// round trip between hosts, which all at once pays only once.
    pub fn auto_all_to_all_pairwise_bytes(world_size: usize, memory_shared: bool) -> usize {
        if world_size <= 2 || memory_shared {
            usize::MAX
        } else {
            256 << 10
        }
    }

    /// The default of [`GlooOptions::broadcast_scatter_bytes`]: never (`usize::MAX`) until a
    /// measurement says otherwise.
    pub fn auto_broadcast_scatter_bytes(_world_size: usize) -> usize {
        usize::MAX
    }

    /// Defaults, overridden by `DIST_GLOO_SMALL_BYTES` ([`GlooOptions::small_bytes`]),
    /// `DIST_GLOO_EAGER_ROOT` ([`GlooOptions::lazy_root_verification`]),
    /// `DIST_GLOO_SPIN_US` (busy-poll microseconds before sleeping), `DIST_GLOO_SEGMENT_BYTES`
    /// `DIST_GLOO_SOCKET_BUFFER` (bytes; unset keeps the kernel's autotuning), `DIST_GLOO_CMA`
    /// (`0` turns single-copy transfers between local ranks off), `DIST_GLOO_CMA_MIN_BYTES`,
    /// `DIST_GLOO_CMA_OVER_SHM` (`0` or `1`; unset decides by the host's CPUs),
    /// `DIST_GLOO_TRANSPORT` (`auto`, `tcp` or `shm`; anything else fails the mesh),
    /// `DIST_GLOO_BUSY_SPIN_NS`, `DIST_GLOO_SHM_RING_BYTES`, `DIST_GLOO_COPY_HELPER` (`0` or
    /// `1`; unset decides by the host's CPUs),
    /// `DIST_GLOO_HALVING_DOUBLING_BYTES` ([`GlooOptions::halving_doubling_bytes`]),
    /// `DIST_GLOO_RING_PIECE_BYTES` ([`GlooOptions::ring_piece_bytes`]) and
    /// `DIST_GLOO_ALLTOALL_PAIRWISE_BYTES` ([`GlooOptions::all_to_all_pairwise_bytes`]).
    pub fn from_env() -> Self {
        fn var(name: &str) -> Option<usize> {
            std::env::var(name).ok().and_then(|v| v.parse().ok())
        }
        let mut o = GlooOptions {
            small_bytes: var("DIST_GLOO_SMALL_BYTES"),
            lazy_root_verification: var("DIST_GLOO_EAGER_ROOT").map(|v| v == 0),
            broadcast_scatter_bytes: var("DIST_GLOO_BCAST_SCATTER_BYTES"),
            halving_doubling_bytes: var("DIST_GLOO_HALVING_DOUBLING_BYTES"),
            ring_piece_bytes: var("DIST_GLOO_RING_PIECE_BYTES"),
            all_to_all_pairwise_bytes: var("DIST_GLOO_ALLTOALL_PAIRWISE_BYTES"),
            ..Default::default()
        };
        if let Some(v) = var("DIST_GLOO_SPIN_US") {
            o.mesh.spin = std::time::Duration::from_micros(v as u64);
        }
        if let Some(v) = var("DIST_GLOO_SEGMENT_BYTES") {
            o.mesh.segment_bytes = v;
        }
        o.mesh.socket_buffer = var("DIST_GLOO_SOCKET_BUFFER");
        if let Some(v) = var("DIST_GLOO_CMA") {
            o.mesh.cross_memory = v != 0;
        }
        if let Some(v) = var("DIST_GLOO_CMA_MIN_BYTES") {
            o.mesh.cross_memory_min_bytes = Some(v);
        }
        if let Some(v) = var("DIST_GLOO_CMA_OVER_SHM") {
            o.mesh.cross_memory_over_rings = Some(v != 0);
        }
        if let Ok(v) = std::env::var("DIST_GLOO_TRANSPORT") {
            match v.parse() {
                Ok(mode) => o.mesh.transport = mode,
                Err(why) => o.mesh.transport_error = Some(why),
            }
        }
        if let Some(v) = var("DIST_GLOO_BUSY_SPIN_NS") {
            o.mesh.busy_spin = Some(std::time::Duration::from_nanos(v as u64));
        }
        if let Some(v) = var("DIST_GLOO_SHM_RING_BYTES") {
            o.mesh.shm_ring_bytes = v;
        }
        if let Some(v) = var("DIST_GLOO_COPY_HELPER") {
            o.mesh.copy_helper = Some(v != 0);
        }
        o
    }
}

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
    seq: AtomicU64,
    /// This rank's last rooted operation (see `StepCtx::last_rooted`).
    last_rooted: Mutex<Option<OpDesc>>,
    /// The first error; once set, the group refuses further operations.
    poisoned: Mutex<Option<String>>,
    /// Receive scratch, as `u64` so that typed views of it are aligned.
    scratch: Mutex<Vec<u64>>,
    /// reduce_scatter's copy of its input for the rounds that combine in place
    /// ([`reducescatter::halving`]), kept so that they allocate nothing.
    halving_work: Mutex<Vec<u8>>,
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
        let mine = choice::settings(&[
            (
                "small_bytes",
                opts.small_bytes
                    .unwrap_or_else(|| GlooOptions::auto_small_bytes(world_size))
                    .to_string(),
            ),
            ("segment_bytes", opts.mesh.segment_bytes.to_string()),
            (
                "fused_agreement_max_ranks",
                opts.fused_agreement_max_ranks
                    .unwrap_or(FUSED_AGREEMENT_MAX_RANKS)
                    .to_string(),
            ),
            (
                "broadcast_scatter_bytes",
                opts.broadcast_scatter_bytes
                    .unwrap_or_else(|| GlooOptions::auto_broadcast_scatter_bytes(world_size))
                    .to_string(),
            ),
            (
                "halving_doubling_bytes",
                // Resolved once the mesh says whether the group is on one host; every rank
                // resolves it alike from the same records.
                opts.halving_doubling_bytes
                    .map_or_else(|| "auto".to_string(), |v| v.to_string()),
            ),
            (
                "ring_piece_bytes",
                // Resolved once the mesh says whether ranks share memory, as above.
                opts.ring_piece_bytes
                    .map_or_else(|| "auto".to_string(), |v| v.to_string()),
            ),
        ]);
        let agreeing = || format!("group {prefix}: agreeing on the algorithm settings");
        choice::publish(store, prefix, rank, &mine, deadline)
            .map_err(|e| e.in_store_call(rank, agreeing))?;
        let t = TcpTransport::connect_by(store, prefix, rank, world_size, &opts.mesh, deadline)?;
        // Every rank published before building its side of the mesh, so all are there now.
        choice::check(store, prefix, rank, world_size, &mine, deadline)
            .map_err(|e| e.in_store_call(rank, agreeing))?;
        Ok(Self::over(
            Box::new(t),
            crate::transport::tcp::group_id(prefix),
            opts,
        ))
    }

    /// A backend over any transport (e.g. [`MemTransport::network`] in tests).
    pub fn over(transport: Box<dyn Transport>, group: u32, opts: &GlooOptions) -> Self {
        let world_size = transport.world_size();
        let one_host = transport.one_host();
        let memory_shared = transport.memory_shared_in_group();
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
            pairs_over_sockets: !memory_shared && world_size > 2 && world_size.is_power_of_two(),
            fused_agreement_max_ranks: opts
                .fused_agreement_max_ranks
                .unwrap_or(FUSED_AGREEMENT_MAX_RANKS),
            lazy_root: opts.lazy_root_verification.unwrap_or(true),
            deferred: Mutex::new(VecDeque::new()),
            seq: AtomicU64::new(0),
            last_rooted: Mutex::new(None),
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

    fn host<'a>(&self, op: CollectiveOp, b: BufMut<'a>) -> Result<&'a mut [u8]> {
        match b {
            BufMut::Host(h) => Ok(h),
            BufMut::Device(_) => Err(self.unsupported(op)),
        }
    }

    fn host_ref<'a>(&self, op: CollectiveOp, b: BufRef<'a>) -> Result<&'a [u8]> {
        match b {
            BufRef::Host(h) => Ok(h),
            BufRef::Device(_) => Err(self.unsupported(op)),
        }
    }

    fn unsupported(&self, op: CollectiveOp) -> Error {
        Error::Unsupported {
            rank: self.rank,
            backend: "gloo",
            what: format!("device buffers (in {op})"),
        }
    }

    fn invalid(&self, op: CollectiveOp, reason: String) -> Error {
        Error::invalid(self.rank, op.name(), reason)
    }

    fn check_len(
        &self,
        op: CollectiveOp,
        what: &str,
        len: usize,
        dtype: DType,
        count: usize,
    ) -> Result<()> {
        if len != count * dtype.size() {
            return Err(self.invalid(
                op,
                format!(
                    "{what} is {len} bytes but {count} × {dtype} needs {}",
                    count * dtype.size()
                ),
            ));
        }
        Ok(())
    }

    fn check_whole(&self, op: CollectiveOp, what: &str, len: usize, dtype: DType) -> Result<usize> {
        if !len.is_multiple_of(dtype.size()) {
            return Err(self.invalid(
                op,
                format!("{what} is {len} bytes, not a whole number of {dtype} elements"),
            ));
        }
        Ok(len / dtype.size())
    }

    fn check_rank(&self, op: CollectiveOp, what: &str, r: usize) -> Result<()> {
        if r >= self.world_size {
            return Err(self.invalid(
                op,
                format!(
                    "{what} {r} is not a rank of this group of {}",
                    self.world_size
                ),
            ));
        }
        Ok(())
    }

    fn check_counts(&self, op: CollectiveOp, what: &str, counts: &[usize]) -> Result<()> {
        if counts.len() != self.world_size {
            return Err(self.invalid(
                op,
                format!(
                    "{what} has {} entries for a group of {}",
                    counts.len(),
                    self.world_size
                ),
            ));
        }
        Ok(())
    }

    fn check_reduce(&self, op: CollectiveOp, rop: ReduceOp, dtype: DType) -> Result<()> {
        rop.check(dtype).map_err(|source| Error::Wire {
            rank: self.rank,
            op: op.name(),
            source,
        })
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
        if name != CollectiveOp::SendRecv {
            let mut last = self.last_rooted.lock().unwrap_or_else(|e| e.into_inner());
            ctx.last_rooted = *last;
            if name.rooted() {
                *last = Some(ctx.desc(count as u64));
            }
        }
        let o = Op::new(&*self.transport, ctx, count as u64);
        let mut scratch = self.scratch.lock().unwrap_or_else(|e| e.into_inner());
        let lazy = self.lazy_root
            && root == Some(self.rank)
            && self.world_size <= self.fused_agreement_max_ranks;
        // A lazy root that only sends reads nothing this operation: older deferred frames
        // may stay queued.
        let sends_only = lazy && matches!(name, CollectiveOp::Broadcast | CollectiveOp::Scatter);
        let keep = if sends_only {
            agree::MAX_DEFERRED - 1
        } else {
            0
        };
        let res = self.verify_deferred(keep, ctx.deadline).and_then(|()| {
            if !name.rooted() || self.world_size == 1 {
                f(&o, &mut scratch)
            } else if self.world_size <= self.fused_agreement_max_ranks {
                let mut pending =
                    agree::Pending::new(self.world_size, self.rank, ctx.root as usize, lazy);
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
    /// [`agree::MAX_DEFERRED`] = 32), and leaves the root `keep / 2` operations ahead of the
    /// frames it has read, so that it seldom waits for its receivers' newest frames.
    fn verify_deferred(&self, keep: usize, deadline: Instant) -> Result<()> {
        let mut q = self.deferred.lock().unwrap_or_else(|e| e.into_inner());
        if q.len() <= keep {
            return Ok(());
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
        Ok(())
    }

    /// Aborts the group after `e`: its connections are in an unknown state.
    fn fail(&self, e: &Error) {
        tracing::warn!(rank = self.rank, error = %e, "operation failed; the group is aborted");
        self.transport.abort();
        let mut p = self.poisoned.lock().unwrap_or_else(|e| e.into_inner());
        p.get_or_insert_with(|| e.to_string());
    }

    fn prepare(&self, o: &Op<'_>, rop: ReduceOp, data: &mut [u8]) -> Result<()> {
        dist_wire::prepare(rop, o.dtype(), data).map_err(|e| o.wire(e))
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

impl Backend for GlooBackend {
    fn name(&self) -> &'static str {
        "gloo"
    }

    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world_size
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities::HOST_ALL
    }

    fn all_reduce(
        &self,
        buf: BufMut<'_>,
        dtype: DType,
        op: ReduceOp,
        opts: &OpOptions,
    ) -> Result<()> {
        let name = CollectiveOp::AllReduce;
        let data = self.host(name, buf)?;
        let count = self.check_whole(name, "the buffer", data.len(), dtype)?;
        self.check_reduce(name, op, dtype)?;
        self.run(
            name,
            dtype,
            count,
            Some(op),
            None,
            None,
            opts,
            |o, scratch| {
                self.prepare(o, op, data)?;
                if let Some(done) = allreduce::through_shared_memory(o, data, op, scratch) {
                    done?;
                    self.finalize(o, op, data)
                } else if data.len() > HALVING_DOUBLING_MIN_BYTES
                    && data.len() <= self.halving_doubling_bytes
                    && count >= self.world_size
                {
                    allreduce::halving_doubling(o, data, op, scratch)
                } else if data.len() <= self.small_bytes || count < self.world_size {
                    allreduce::recursive_doubling(o, data, op, scratch)?;
                    self.finalize(o, op, data)
                } else {
                    allreduce::ring(o, data, op, scratch, self.ring_piece_bytes)
                }
            },
        )
    }

    fn broadcast(
        &self,
        buf: BufMut<'_>,
        dtype: DType,
        root: usize,
        opts: &OpOptions,
    ) -> Result<()> {
        let name = CollectiveOp::Broadcast;
        let data = self.host(name, buf)?;
        let count = self.check_whole(name, "the buffer", data.len(), dtype)?;
        self.check_rank(name, "root", root)?;
        self.run(name, dtype, count, None, Some(root), None, opts, |o, _| {
            if self.world_size == 1 {
                Ok(())
            } else {
                // The chain pays one chunk of latency per hop, so it wins once the buffer has
                // more chunks than there are hops; with two ranks the two are the same.
                let seg = self.transport.segment_bytes();
                let chunks = data.len().div_ceil(seg);
                if data.len() <= self.small_bytes
                    || (self.world_size > 2 && chunks < self.world_size)
                {
                    bcast::tree(o, data, root)
                } else if self.world_size > 2 && data.len() >= self.broadcast_scatter_bytes {
                    bcast::scatter_all_gather(o, data, root)
                } else {
                    bcast::chain(o, data, root, seg)
                }
            }
        })
    }

    fn reduce(
        &self,
        buf: BufMut<'_>,
        dtype: DType,
        op: ReduceOp,
        root: usize,
        opts: &OpOptions,
    ) -> Result<()> {
        let name = CollectiveOp::Reduce;
        let data = self.host(name, buf)?;
        let count = self.check_whole(name, "the buffer", data.len(), dtype)?;
        self.check_rank(name, "root", root)?;
        self.check_reduce(name, op, dtype)?;
        self.run(
            name,
            dtype,
            count,
            Some(op),
            Some(root),
            None,
            opts,
            |o, scratch| {
                self.prepare(o, op, data)?;
                if data.len() <= self.small_bytes || count < self.world_size {
                    rooted::reduce_tree(o, data, op, root, scratch)?;
                } else {
                    rooted::reduce_ring(o, data, op, root, scratch, self.reduce_piece_bytes)?;
                }
                if self.rank == root {
                    self.finalize(o, op, data)
                } else {
                    Ok(())
                }
            },
        )
    }

    fn all_gather(
        &self,
        input: BufRef<'_>,
        output: BufMut<'_>,
        dtype: DType,
        counts: &[usize],
        opts: &OpOptions,
    ) -> Result<()> {
        let name = CollectiveOp::AllGather;
        let (input, output) = (self.host_ref(name, input)?, self.host(name, output)?);
        self.check_counts(name, "counts", counts)?;
        self.check_len(name, "the input", input.len(), dtype, counts[self.rank])?;
        let total: usize = counts.iter().sum();
        self.check_len(name, "the output", output.len(), dtype, total)?;
        self.run(
            name,
            dtype,
            total,
            None,
            None,
            Some(counts),
            opts,
            |o, _| {
                let blocks = blocks_of(counts, dtype.size());
                copy_to_output(&mut output[blocks[self.rank].clone()], input);
                if let Some(done) = allgather::through_shared_memory(o, input, output, &blocks) {
                    done
                } else if output.len() <= self.small_bytes && self.pairs_over_sockets {
                    allgather::doubling(o, output, &blocks)
                } else if output.len() <= self.small_bytes {
                    allgather::direct(o, output, &blocks)
                } else {
                    allgather::ring_in_pieces(o, output, &blocks, self.all_gather_piece_bytes)
                }
            },
        )
    }

    fn reduce_scatter(
        &self,
        input: BufRef<'_>,
        output: BufMut<'_>,
        dtype: DType,
        op: ReduceOp,
        counts: &[usize],
        opts: &OpOptions,
    ) -> Result<()> {
        let name = CollectiveOp::ReduceScatter;
        let (input, output) = (self.host_ref(name, input)?, self.host(name, output)?);
        self.check_counts(name, "counts", counts)?;
        let total: usize = counts.iter().sum();
        self.check_len(name, "the input", input.len(), dtype, total)?;
        self.check_len(name, "the output", output.len(), dtype, counts[self.rank])?;
        self.check_reduce(name, op, dtype)?;
        self.run(
            name,
            dtype,
            total,
            Some(op),
            None,
            Some(counts),
            opts,
            |o, scratch| {
                let blocks = blocks_of(counts, dtype.size());
                let run = |input: &[u8], output: &mut [u8], scratch: &mut Vec<u64>| {
                    if let Some(done) =
                        reducescatter::through_shared_memory(o, input, output, &blocks, op)
                    {
                        done
                    } else if input.len() <= self.small_bytes && self.pairs_over_sockets {
                        let mut work = self.halving_work.lock().unwrap_or_else(|e| e.into_inner());
                        reducescatter::halving(o, input, output, &blocks, op, scratch, &mut work)
                    } else if input.len() <= self.small_bytes {
                        reducescatter::direct(o, input, output, &blocks, op, scratch)
                    } else {
                        reducescatter::ring_in_pieces(
                            o,
                            input,
                            output,
                            &blocks,
                            op,
                            scratch,
                            self.ring_piece_bytes,
                        )
                    }
                };
                if let ReduceOp::PremulSum(_) = op {
                    // The scale must be applied to a copy: the input is the caller's.
                    let mut work = input.to_vec();
                    self.prepare(o, op, &mut work)?;
                    run(&work, output, scratch)?;
                } else {
                    run(input, output, scratch)?;
                }
                self.finalize(o, op, output)
            },
        )
    }

    fn all_to_all(
        &self,
        input: BufRef<'_>,
        output: BufMut<'_>,
        dtype: DType,
        send_counts: &[usize],
        recv_counts: &[usize],
        opts: &OpOptions,
    ) -> Result<()> {
        let name = CollectiveOp::AllToAll;
        let (input, output) = (self.host_ref(name, input)?, self.host(name, output)?);
        self.check_counts(name, "send_counts", send_counts)?;
        self.check_counts(name, "recv_counts", recv_counts)?;
        self.check_len(
            name,
            "the input",
            input.len(),
            dtype,
            send_counts.iter().sum(),
        )?;
        self.check_len(
            name,
            "the output",
            output.len(),
            dtype,
            recv_counts.iter().sum(),
        )?;
        if send_counts[self.rank] != recv_counts[self.rank] {
            return Err(self.invalid(
                name,
                format!(
                    "this rank sends itself {} elements but expects to receive {} from itself",
                    send_counts[self.rank], recv_counts[self.rank]
                ),
            ));
        }
        self.run(name, dtype, 0, None, None, None, opts, |o, _| {
            let pairwise_from = self.all_to_all_pairwise_bytes;
            rooted::all_to_all(o, input, output, send_counts, recv_counts, pairwise_from)
        })
    }

    fn gather(
        &self,
        input: BufRef<'_>,
        output: Option<BufMut<'_>>,
        dtype: DType,
        root: usize,
        opts: &OpOptions,
    ) -> Result<()> {
        let name = CollectiveOp::Gather;
        let input = self.host_ref(name, input)?;
        self.check_rank(name, "root", root)?;
        let count = self.check_whole(name, "the input", input.len(), dtype)?;
        let output = match (output, self.rank == root) {
            (Some(b), true) => {
                let out = self.host(name, b)?;
                self.check_len(
                    name,
                    "the output",
                    out.len(),
                    dtype,
                    count * self.world_size,
                )?;
                Some(out)
            }
            (None, true) => {
                return Err(self.invalid(name, "the root must pass an output buffer".into()));
            }
            (Some(_), false) => {
                return Err(self.invalid(
                    name,
                    format!("only the root (rank {root}) takes an output buffer"),
                ));
            }
            (None, false) => None,
        };
        self.run(name, dtype, count, None, Some(root), None, opts, |o, _| {
            rooted::gather(o, input, output, root)
        })
    }

    fn scatter(
        &self,
        input: Option<BufRef<'_>>,
        output: BufMut<'_>,
        dtype: DType,
        root: usize,
        opts: &OpOptions,
    ) -> Result<()> {
        let name = CollectiveOp::Scatter;
        let output = self.host(name, output)?;
        self.check_rank(name, "root", root)?;
        let count = self.check_whole(name, "the output", output.len(), dtype)?;
        let input = match (input, self.rank == root) {
            (Some(b), true) => {
                let inp = self.host_ref(name, b)?;
                self.check_len(name, "the input", inp.len(), dtype, count * self.world_size)?;
                Some(inp)
            }
            (None, true) => {
                return Err(self.invalid(name, "the root must pass an input buffer".into()));
            }
            (Some(_), false) => {
                return Err(self.invalid(
                    name,
                    format!("only the root (rank {root}) takes an input buffer"),
                ));
            }
            (None, false) => None,
        };
        self.run(name, dtype, count, None, Some(root), None, opts, |o, _| {
            rooted::scatter(o, input, output, root)
        })
    }

    fn barrier(&self, opts: &OpOptions) -> Result<()> {
        self.run(
            CollectiveOp::Barrier,
            DType::U8,
            0,
            None,
            None,
            None,
            opts,
            |o, _| rooted::barrier(o),
        )
    }

    fn send(&self, buf: BufRef<'_>, dtype: DType, dst: usize, opts: &OpOptions) -> Result<()> {
        let name = CollectiveOp::SendRecv;
        let data = self.host_ref(name, buf)?;
        self.check_rank(name, "destination", dst)?;
        if dst == self.rank {
            return Err(self.invalid(name, "a rank cannot send to itself".into()));
        }
        let count = self.check_whole(name, "the buffer", data.len(), dtype)?;
        self.run(name, dtype, count, None, None, None, opts, |o, _| {
            o.step(&[o.send(dst, data, opts.tag)], &mut [])
        })
    }

    fn recv(&self, buf: BufMut<'_>, dtype: DType, src: usize, opts: &OpOptions) -> Result<()> {
        let name = CollectiveOp::SendRecv;
        let data = self.host(name, buf)?;
        self.check_rank(name, "source", src)?;
        if src == self.rank {
            return Err(self.invalid(name, "a rank cannot receive from itself".into()));
        }
        let count = self.check_whole(name, "the buffer", data.len(), dtype)?;
        self.run(name, dtype, count, None, None, None, opts, |o, _| {
            o.step(&[], &mut [o.recv(src, data, opts.tag)])
        })
    }

    fn probe(&self, src: usize, tag: u32) -> Result<bool> {
        let name = CollectiveOp::SendRecv;
        self.check_rank(name, "source", src)?;
        if src == self.rank {
            return Err(self.invalid(name, "a rank cannot receive from itself".into()));
        }
        // A poisoned group fails the `recv` at once: it would not wait.
        if self
            .poisoned
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_some()
        {
            return Ok(true);
        }
        Ok(self.transport.probe(src, tag))
    }

    fn close(&self) {
        // A root's last op may still owe its verification: a disagreement must not go
        // unreported because the group was destroyed right after it.
        let owed = self
            .deferred
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .map(agree::Deferred::timeout)
            .max();
        let clean = self
            .poisoned
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_none();
        if let (Some(timeout), true) = (owed, clean)
            && let Err(e) =
                self.verify_deferred(0, dist_backend::deadline_after(Instant::now(), timeout))
        {
            tracing::error!(rank = self.rank, error = %e, "a rooted operation failed its agreement, found at close");
            self.fail(&e);
        }
        let mut p = self.poisoned.lock().unwrap_or_else(|e| e.into_inner());
        if p.is_none() {
            *p = Some("the group was destroyed".into());
        }
        // Also once aborted: closing then delivers the abort notices the failed step could not
        // write at once, rather than leave them to die with the process. Under the lock, so no
        // operation starts on connections being closed; a second close finds none left.
        self.transport.close();
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
