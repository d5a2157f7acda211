//! `GlooOptions`: the backend's tuning, its measured defaults and the environment that sets it.

use crate::algo::agree;
#[cfg(doc)]
use crate::transport::Transport;
use crate::transport::tcp::MeshOptions;

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
    /// returns. `None` is `true` (`DIST_GLOO_EAGER_ROOT=1` sets `false`). Every rank must use
    /// the same value (checked when the group is built): with lazy roots, the receivers of a
    /// broadcast or scatter that repeats the last rooted call send the root no agreement frame
    /// at all, which an eager root would wait for; such a root looks at what its peers sent
    /// every 33rd of those operations and at close instead.
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
    /// all_reduce buffers of more than 4 KiB and up to this many bytes go through the group's
    /// shared-memory area in two shots (each rank reduces its block of every rank's
    /// publication, then every rank copies the reduced blocks), where the whole group maps one
    /// (every pair of ranks talks through shared-memory rings). `None` picks
    /// [`GlooOptions::auto_area_all_reduce_bytes`] once the mesh is built; `0` turns it off;
    /// `DIST_GLOO_AREA_ALL_REDUCE_BYTES` sets it. Every rank must use the same value (checked
    /// when the group is built).
    pub area_all_reduce_bytes: Option<usize>,
    /// all_gathers whose output is up to this many bytes (and each of whose blocks fits the
    /// area) go through the group's shared-memory area, where the whole group maps one; blocks
    /// of up to 4 KiB go through it whatever this says. `None` picks
    /// [`GlooOptions::auto_area_all_gather_bytes`] once the mesh is built;
    /// `DIST_GLOO_AREA_ALL_GATHER_BYTES` sets it. Every rank must use the same value (checked
    /// when the group is built).
    pub area_all_gather_bytes: Option<usize>,
    /// broadcasts of at least this many bytes go through the group's shared-memory area, in
    /// pieces of a mebibyte, where the whole group maps one. `None` picks
    /// [`GlooOptions::auto_area_broadcast_min_bytes`] once the mesh is built; `usize::MAX`
    /// turns it off; `DIST_GLOO_AREA_BROADCAST_MIN_BYTES` sets it. Every rank must use the
    /// same value (checked when the group is built).
    pub area_broadcast_min_bytes: Option<usize>,
    /// all_to_alls go through the group's shared-memory area where the whole group maps one
    /// and every rank's input is at most this many bytes (and fits the area); a rank whose
    /// input does not fit says so in the area and goes on by messages, and the others, finding
    /// its table of counts without data, follow (see `algo::alltoall::through_shared_memory`).
    /// `None` picks [`GlooOptions::auto_area_all_to_all_bytes`] once the mesh is built; `0`
    /// turns it off; `DIST_GLOO_AREA_ALL_TO_ALL_BYTES` sets it. Every rank must use the same
    /// value (checked when the group is built).
    pub area_all_to_all_bytes: Option<usize>,
    /// all_to_all inputs over [`GlooOptions::area_all_to_all_bytes`] and up to this many
    /// bytes (and that fit the area) go through it or by messages as rank 0 finds faster from
    /// the group's calls (the slowest rank's time); the others follow the choice it publishes
    /// in the area a call ahead (see `backend::area_pace`). `None` picks [`GlooOptions::auto_paced_area_all_to_all_bytes`]
    /// once the mesh is built; 0 turns it off; `DIST_GLOO_PACED_AREA_ALL_TO_ALL_BYTES` sets
    /// it. Only where lending all_to_all inputs is off
    /// ([`GlooOptions::lent_all_to_all_bytes`] resolves to `usize::MAX`). Ranks may differ: a
    /// rank that goes by messages takes the group with it.
    pub paced_area_all_to_all_bytes: Option<usize>,
    /// all_to_all inputs of at least this many bytes that the group area cannot hold
    /// (over [`GlooOptions::area_all_to_all_bytes`]) are lent to the peers by reference
    /// through it, where every peer can read this rank's memory: the area carries the
    /// words to read them, every rank copies its block straight out of the lender's input,
    /// and a second arrival ends the operation (see `algo::alltoall::through_shared_memory`).
    /// `None` picks [`GlooOptions::auto_lent_all_to_all_bytes`] once the mesh is built, and
    /// rank 0 then chooses by pace which calls lend; a value set lends every such input;
    /// `usize::MAX` turns it off; `DIST_GLOO_LENT_ALL_TO_ALL_BYTES` sets it. Ranks may
    /// differ: each chooses for its own input and its peers follow. `area_all_to_all_bytes`
    /// of 0 turns it off too (the tables go through the area).
    pub lent_all_to_all_bytes: Option<usize>,
    /// all_gathers whose output is at least this many bytes, and that the group area does not
    /// take whole ([`GlooOptions::area_all_gather_bytes`]), lend every rank's input by
    /// reference through it, where every rank can read every other's memory (see
    /// `algo::allgather::lent_through_shared_memory`). `None` picks
    /// [`GlooOptions::auto_lent_all_gather_bytes`] once the mesh is built, and rank 0 then
    /// chooses by pace which calls lend; a value set lends every such call; `usize::MAX` turns
    /// it off; `DIST_GLOO_LENT_ALL_GATHER_BYTES` sets it. Every rank must use the same value
    /// (checked when the group is built).
    pub lent_all_gather_bytes: Option<usize>,
    /// all_reduces of buffers of at least this many bytes, and that the group area does not
    /// take ([`GlooOptions::area_all_reduce_bytes`]), run by reference through it, where every
    /// rank can read every other's memory: every rank lends its buffer, reduces its own block
    /// from every rank's, and copies the others' reduced blocks (see
    /// `algo::allreduce::lent_in_two_shots`). `None` picks
    /// [`GlooOptions::auto_lent_all_reduce_bytes`] once the mesh is built, and rank 0 then
    /// chooses by pace which calls lend; a value set lends every such call; `usize::MAX` turns
    /// it off; `DIST_GLOO_LENT_ALL_REDUCE_BYTES` sets it. Every rank must use the same value
    /// (checked when the group is built). On more than two ranks a floating-point sum adds
    /// each block's terms in another order than the ring does, so a buffer's bits depend on
    /// which way its call went (every rank still ends with the same bits): set on such a
    /// group, some calls lend and others not.
    pub lent_all_reduce_bytes: Option<usize>,
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
/// receivers disagreed with it. Operations from 16 KiB run fewer ahead, down to 4, so that
/// about 256 KiB is sent ahead of what was verified.
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

    /// The default of [`GlooOptions::area_all_reduce_bytes`]: 2 MiB where the group's ranks
    /// outnumber the host's CPUs (`cores_shared`, which every rank resolves alike), else off.
    /// Where ranks take turns on the cores, each of the ring's 2(n − 1) waits for a peer costs
    /// a turn, and two shots wait twice per mebibyte: 4 ranks on 2 cores, gloo_bench, 6-8 runs
    /// alternated, medians of the runs (us), two shots against the ring or halving-doubling:
    /// 64 KiB 45.5 against 45.3, 256 KiB 114 against 119, 1 MiB 283 against 425, 2 MiB 537 against
    /// 845. From 4 MiB the ring has caught up since it learnt to run in pieces (it took 2015
    /// us against two shots' 1653 before): 4 MiB 1407 against 1080, 8 MiB 3335 against 3198,
    /// 16 MiB 6360 against 6333. It also bears a slow spell of the host better: in runs where
    /// a plain 8 MiB copy took 0.7-0.9 ms instead of 0.3 (it comes and goes for seconds on
    /// this virtual machine, and hits Open MPI's runs alike), the 16 MiB all_reduce took 18-19
    /// ms in two shots and 10-11 in the ring. With a core per rank the ring's waits are short
    /// and two shots' extra pass over the bytes costs more (2 ranks on 2 cores: 1 MiB 98
    /// against 123); hosts with more cores than ranks were not measured, and keep the ring.
    pub fn auto_area_all_reduce_bytes(cores_shared: bool) -> usize {
        if cores_shared { 2 << 20 } else { 0 }
    }

    /// The default of [`GlooOptions::area_all_gather_bytes`]: outputs of 2 MiB (at 4 ranks,
    /// blocks of 512 KiB) where the group's ranks outnumber the host's CPUs, as for
    /// [`GlooOptions::auto_area_all_reduce_bytes`], else none beyond the 4 KiB blocks.
    /// Measured at 4 ranks on 2 cores (`algo::allgather::through_shared_memory` has the
    /// figures): ahead up to 768 KiB blocks, behind at 1 MiB.
    pub fn auto_area_all_gather_bytes(cores_shared: bool) -> usize {
        if cores_shared { 2 << 20 } else { 0 }
    }

    /// The default of [`GlooOptions::area_all_to_all_bytes`]: inputs of up to 32 KiB where
    /// the group's ranks outnumber the host's CPUs (as for
    /// [`GlooOptions::auto_area_all_reduce_bytes`]), else up to 4 KiB.
    ///
    /// Measured with gloo_bench, runs alternated with the area off or at a lower limit,
    /// medians of the runs (us). 4 ranks on 2 cores, 6 runs: 4 B 7.9 against 12.0, 1 KiB 8.1
    /// against 13.1, 4 KiB 9.1 against 15.2, 16 KiB 13.6 against 19.9. 10 runs: 32 KiB 15.2
    /// against 28.4, and 18.3 (16.1-21.4) against 27.3 (25.9-35.4). Against Open MPI's shared
    /// memory in three invocations (`cargo xtask bench`, 5 rounds), 32 KiB read 1.84-2.19x
    /// through the area and 1.19-1.55x by messages.
    ///
    /// Not 64 KiB, though it is ahead by the median in calm hours (25.5 against 36.2, 29.9
    /// against 38.7, 10 runs each): the area suffers most from the host's slow spells (as for
    /// [`GlooOptions::auto_area_all_reduce_bytes`]). In one set of runs during a spell 64 KiB
    /// took 72.9 against 56.8; against Open MPI in a slow hour it read 0.64x where messages
    /// read 0.89x, and 0.51x in a table of its own. 256 KiB was ahead by the median (50.5
    /// against 64.0) with one run of 270. 2 ranks on 2 cores, 6 runs: 4 B 0.7 against 1.2, 4 KiB 1.2 against 1.6, but
    /// 16 KiB 2.9 against 2.3.
    ///
    /// The slow spells are the host putting the two vCPUs far apart (a cache line's round trip
    /// 331 ns against 55); probed before each of 150 alternated pairs, the area up to 1 MiB
    /// against this limit took 24.3 against 30.2 us at 64 KiB and 49.3 against 64.2 at 256
    /// KiB near, but 59.1 against 54.4 and 216 against 72.2 far (16% of the pairs): weighted,
    /// behind from 256 KiB (docs/BENCHMARKS.md, "A placement probe before every cell").
    ///
    /// A rank whose input is over the limit pays one publication of its table: 4 ranks, 8
    /// runs, 64 B 13.6 against 12.8, 16 KiB 22.8 against 22.2, 64 KiB and 256 KiB even; 2
    /// ranks, 64 KiB 4.7 against 4.6.
    pub fn auto_area_all_to_all_bytes(cores_shared: bool) -> usize {
        if cores_shared { 32 << 10 } else { 4 << 10 }
    }

    /// The default of [`GlooOptions::paced_area_all_to_all_bytes`]: whatever the area holds
    /// (`usize::MAX`) where the group's ranks outnumber the host's CPUs, else none (0).
    ///
    /// Measured with gloo_bench at 4 ranks on 2 cores, 256 KiB per rank, the area up to 1 MiB
    /// alternated with messages, a cache line's round trip between the two vCPUs probed
    /// before each pair (near about 55 ns, far apart 320), us: near the area took 50-67
    /// against 68-91 (paired 1.25-1.96x), far apart 207-217 against 81-90 (0.41-0.71x). With
    /// rank 0's pace against this off (messages), every input rewritten before each call,
    /// paired medians of off's time over the pace's: near (93 pairs) 1.07x at 64 KiB, 1.37x
    /// at 256 KiB, 1.22x at 512 KiB; far apart (19 pairs) 0.92x at 256 KiB and 0.96x at 512
    /// KiB, the looks' cost. At 1 MiB per rank the input does not fit the area, and with a
    /// larger area it gained nothing (1.00x). Where the ranks fit the CPUs, lending paces the
    /// large inputs ([`GlooOptions::auto_lent_all_to_all_bytes`]); the band between was not
    /// measured.
    pub fn auto_paced_area_all_to_all_bytes(cores_shared: bool) -> usize {
        if cores_shared { usize::MAX } else { 0 }
    }

    /// The default of [`GlooOptions::lent_all_to_all_bytes`]: 256 KiB where the group's ranks
    /// fit the host's CPUs, with rank 0 choosing by the pace of its calls each way
    /// (`path_pace`: it lends every so often, and goes on lending once a lent call took
    /// under 0.7x its calls by messages); never (`usize::MAX`) where they outnumber them.
    ///
    /// Measured with gloo_bench on a 2-core VM, lending from 64 KiB always against never,
    /// alternated, with a cache line's round trip between the two vCPUs probed before each
    /// pair (near: about 55 ns; far apart: about 320), paired medians of never's time over
    /// always's. 2 ranks, every input rewritten before each call (`--fresh 1`, as a training
    /// step leaves them): near 0.67x at 64 KiB, 0.81-0.95x from 256 KiB; far apart 1.50x at 64
    /// KiB, 2.33-2.57x at 256 KiB and 1 MiB, 1.18x at 4 MiB, 1.79x at 16 MiB. No fixed
    /// choice wins in both placements, hence the pace. 4 ranks on 2 cores, inputs as left by
    /// the last call: near, 128 KiB to 512 KiB 1.21-1.27x, 1 to 16 MiB 1.06-1.12x, but 64 KiB
    /// 0.65x; far, 0.92-1.13x; with fresh inputs near, 64 KiB to 512 KiB 0.73-0.86x, from 1
    /// MiB 0.99-1.04x: no gain worth a rule.
    ///
    /// With the pace from 1 MiB, 2 ranks, fresh inputs, against never, 14 pairs: near 0.93-1.02x
    /// by the paired median at 1, 4 and 16 MiB (the others wait in the area for rank 0's
    /// choice before going by messages); in the pairs the host moved far apart, 3.4-4.0x. From
    /// 256 KiB, 8 pairs near: 0.96x at 256 KiB, 0.97x at 512 KiB, 0.98x at 1 MiB. Not from 64
    /// KiB, where a lent call took 1.5x near and the wait weighs most.
    pub fn auto_lent_all_to_all_bytes(cores_shared: bool) -> usize {
        if cores_shared { usize::MAX } else { 256 << 10 }
    }

    /// The default of [`GlooOptions::lent_all_gather_bytes`]: outputs of 256 KiB where the
    /// group's ranks fit the host's CPUs, with rank 0 choosing by the pace of its calls each
    /// way, as for [`GlooOptions::auto_lent_all_to_all_bytes`]; never where they outnumber
    /// them (not measured there).
    ///
    /// Measured with gloo_bench on a 2-core VM, 2 ranks, every input rewritten before each
    /// call, alternated with lending off, a cache line's round trip probed before each pair,
    /// paired medians of off's time over this one's (sizes per rank). Lending always, far
    /// apart: 256 KiB 2.43x (52 us against 125), 1 MiB 2.71x, 4 MiB 3.21x, 16 MiB 2.27x. Paced,
    /// far apart, 11 pairs: 256 KiB 2.49-2.92x, 1 MiB 2.59-2.71x, 4 MiB 2.92-3.16x, 16 MiB
    /// 1.87-2.65x; near, 5 pairs: 0.98x at 256 KiB, 1 MiB and 16 MiB, 1.09x at 4 MiB (the
    /// other rank waits in the area for rank 0's choice before going by messages).
    pub fn auto_lent_all_gather_bytes(cores_shared: bool) -> usize {
        if cores_shared { usize::MAX } else { 256 << 10 }
    }

    /// The default of [`GlooOptions::lent_all_reduce_bytes`]: buffers of 4 MiB on two ranks
    /// that fit the host's CPUs, with rank 0 choosing by the pace of its calls each way, as for
    /// [`GlooOptions::auto_lent_all_to_all_bytes`]; never where the ranks outnumber the CPUs
    /// (not measured there) nor on more than two ranks, where the two ways add a block's terms
    /// in different orders and the pace would make a float sum's bits vary from call to call.
    /// On two ranks each block is the sum of two terms, whose order does not change it.
    ///
    /// Measured with gloo_bench on a 2-core VM, 2 ranks, every input rewritten before each
    /// call, alternated with lending off, a cache line's round trip probed before each pair,
    /// paired medians of off's time over this one's. Lending always, buffers in 4 KiB pages:
    /// far apart 1.22x at 1 MiB, 1.38x at 4 MiB, 1.83x at 16 MiB, 2.19x at 64 MiB (15.8 ms
    /// against 34.1); near it lost (0.52-0.56x before it reduced in place, not remeasured
    /// since). In 2 MiB pages: near 0.99x at 4 MiB, 0.84-0.87x at 16 and 64 MiB; far 1.05x,
    /// 1.49x, 3.84x (64 MiB 8.9 ms against 32.6). Paced from 4 MiB, 6 pairs: near 0.99-1.03x
    /// at 4, 16 and 64 MiB; far 1.42x at 4 MiB, 1.04x at 16, 2.04x at 64. Not from 1 MiB: far
    /// apart lending gains less there than the pace's margin to switch.
    pub fn auto_lent_all_reduce_bytes(world_size: usize, cores_shared: bool) -> usize {
        if cores_shared || world_size != 2 {
            usize::MAX
        } else {
            4 << 20
        }
    }

    /// The default of [`GlooOptions::area_broadcast_min_bytes`]: 512 KiB where the group's
    /// ranks outnumber the host's CPUs, as for [`GlooOptions::auto_area_all_reduce_bytes`],
    /// else never (`usize::MAX`). Measured at 4 ranks on 2 cores
    /// (`algo::bcast::through_shared_memory` has the figures): ahead from 512 KiB to 256 MiB,
    /// even at 256 KiB, behind at 64 KiB; with a core per rank, even at best.
    pub fn auto_area_broadcast_min_bytes(cores_shared: bool) -> usize {
        if cores_shared { 512 << 10 } else { usize::MAX }
    }

    /// The default of [`GlooOptions::broadcast_scatter_bytes`]: never (`usize::MAX`) until a
    /// measurement says otherwise.
    pub fn auto_broadcast_scatter_bytes(_world_size: usize) -> usize {
        usize::MAX
    }

    /// Defaults, overridden by `DIST_GLOO_SMALL_BYTES` ([`GlooOptions::small_bytes`]),
    /// `DIST_GLOO_EAGER_ROOT` ([`GlooOptions::lazy_root_verification`]),
    /// `DIST_GLOO_SPIN_US` (busy-poll microseconds before sleeping), `DIST_GLOO_SEGMENT_BYTES`
    /// `DIST_GLOO_SOCKET_BUFFER` (bytes; unset keeps the kernel's autotuning),
    /// `DIST_GLOO_SAME_HOST_CONGESTION` (a congestion control's name, which the mesh then
    /// insists on; empty keeps the system's: see `MeshOptions::same_host_congestion`),
    /// `DIST_GLOO_CMA`
    /// (`0` turns single-copy transfers between local ranks off), `DIST_GLOO_CMA_MIN_BYTES`,
    /// `DIST_GLOO_CMA_OVER_SHM` (`0` or `1`; unset decides by the host's CPUs),
    /// `DIST_GLOO_TRANSPORT` (`auto`, `tcp` or `shm`; anything else fails the mesh),
    /// `DIST_GLOO_BUSY_SPIN_NS`, `DIST_GLOO_SHM_RING_BYTES`, `DIST_GLOO_COPY_HELPER` (`0` or
    /// `1`; unset decides by the host's CPUs), `DIST_GLOO_ADAPTIVE_PATH` (`0` keeps large
    /// messages over shared-memory rings on the fixed rule's way: `MeshOptions::adaptive_path`),
    /// `DIST_GLOO_BCAST_SCATTER_BYTES` ([`GlooOptions::broadcast_scatter_bytes`]),
    /// `DIST_GLOO_HALVING_DOUBLING_BYTES` ([`GlooOptions::halving_doubling_bytes`]),
    /// `DIST_GLOO_RING_PIECE_BYTES` ([`GlooOptions::ring_piece_bytes`]),
    /// `DIST_GLOO_ALLTOALL_PAIRWISE_BYTES` ([`GlooOptions::all_to_all_pairwise_bytes`]),
    /// `DIST_GLOO_AREA_ALL_REDUCE_BYTES` ([`GlooOptions::area_all_reduce_bytes`]),
    /// `DIST_GLOO_AREA_ALL_GATHER_BYTES` ([`GlooOptions::area_all_gather_bytes`]),
    /// `DIST_GLOO_AREA_BROADCAST_MIN_BYTES` ([`GlooOptions::area_broadcast_min_bytes`]),
    /// `DIST_GLOO_AREA_ALL_TO_ALL_BYTES` ([`GlooOptions::area_all_to_all_bytes`]),
    /// `DIST_GLOO_PACED_AREA_ALL_TO_ALL_BYTES` ([`GlooOptions::paced_area_all_to_all_bytes`]),
    /// `DIST_GLOO_LENT_ALL_TO_ALL_BYTES` ([`GlooOptions::lent_all_to_all_bytes`]),
    /// `DIST_GLOO_LENT_ALL_GATHER_BYTES` ([`GlooOptions::lent_all_gather_bytes`]) and
    /// `DIST_GLOO_LENT_ALL_REDUCE_BYTES` ([`GlooOptions::lent_all_reduce_bytes`]).
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
            area_all_reduce_bytes: var("DIST_GLOO_AREA_ALL_REDUCE_BYTES"),
            area_all_gather_bytes: var("DIST_GLOO_AREA_ALL_GATHER_BYTES"),
            area_broadcast_min_bytes: var("DIST_GLOO_AREA_BROADCAST_MIN_BYTES"),
            area_all_to_all_bytes: var("DIST_GLOO_AREA_ALL_TO_ALL_BYTES"),
            paced_area_all_to_all_bytes: var("DIST_GLOO_PACED_AREA_ALL_TO_ALL_BYTES"),
            lent_all_to_all_bytes: var("DIST_GLOO_LENT_ALL_TO_ALL_BYTES"),
            lent_all_gather_bytes: var("DIST_GLOO_LENT_ALL_GATHER_BYTES"),
            lent_all_reduce_bytes: var("DIST_GLOO_LENT_ALL_REDUCE_BYTES"),
            ..Default::default()
        };
        if let Some(v) = var("DIST_GLOO_SPIN_US") {
            o.mesh.spin = std::time::Duration::from_micros(v as u64);
        }
        if let Some(v) = var("DIST_GLOO_SEGMENT_BYTES") {
            o.mesh.segment_bytes = v;
        }
        o.mesh.socket_buffer = var("DIST_GLOO_SOCKET_BUFFER");
        if let Ok(v) = std::env::var("DIST_GLOO_SAME_HOST_CONGESTION") {
            o.mesh.same_host_congestion = Some(v);
        }
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
        if let Some(v) = var("DIST_GLOO_ADAPTIVE_PATH") {
            o.mesh.adaptive_path = v != 0;
        }
        o
    }
}
