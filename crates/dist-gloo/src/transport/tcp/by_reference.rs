//! Which messages go by reference (the receiver copies straight out of the sender's memory,
//! `cma`) rather than through the link: a rule of the sender alone, since every frame says
//! how its payload travels.
//!
//! Over TCP, every message from [`SINGLE_COPY_MIN_BYTES`]: one copy instead of two and no
//! network stack. Over shared-memory rings, the two copies (the sender's in, the receiver's
//! out) run on two cores at once, through a ring that stays in cache and with no pages to pin,
//! so while this host's ranks fit its CPUs the rings win: `cargo xtask bench all` at 2 ranks
//! from 256 KiB to 64 MiB, rings against by reference, took 0.25-0.7x the time for broadcast,
//! 0.4-0.95x for all_gather, all_to_all and all_reduce. The exception is reduce_scatter from
//! 4 MiB (1.3-1.5x; about 1.35x after it learnt to combine where it receives), not worth a
//! rule of its own on figures this noisy.
//!
//! When the ranks outnumber the cores the two copies cannot run at once, and by reference
//! wins (4 ranks on 2 cores: all_to_all 0.55-0.88x), except for broadcast and scatter, whose
//! one-way pipelines keep the rings ahead there too (0.6-0.85x), and reduce_scatter
//! ([`OverRings::SharedCores`]). Its rings against by reference, 4 ranks on 2 cores, gloo_bench
//! alternated (us): unbound, 16 MiB 16052-19531 against 21490-34948, 1 and 4 MiB even; bound
//! two to a core, 4 MiB 4386-5579 against 6902-9634, 16 MiB 17534-22466 against 28158-38178.
//! all_reduce and reduce gained as much bound and at 16 MiB unbound, but in runs of one size
//! each (as `cargo xtask bench --interleave` runs them) lost at 1-4 MiB (all_reduce 4 MiB
//! 1723-2255 against 953-1096, reduce 4 MiB 1230-1351 against 875-957): the placement the
//! scheduler settles on favours one or the other, and they stay by reference.
//!
//! Those figures were taken from buffers in 4 KiB pages, every one of which the kernel pins
//! for a copy by reference. From buffers in 2 MiB pages, at 2 ranks, by reference took
//! 0.82-0.89x the rings' time for all_gather and all_to_all at 4 and 16 MiB and was even from
//! 64 MiB (from 4 KiB pages: 1.07-1.27x). Once a step wrote its offers before copying its
//! peer's (the engine, 2026-11-26), the reductions gained too, from messages of 1 MiB:
//! all_reduce 2 MiB 112-113 us against 122-124, 16 MiB 1396-1524 against 1653-1790, even at
//! 32 MiB and 1.05x at 64 MiB (hence [`ALL_REDUCE_FROM_HUGE_PAGES_MAX_BYTES`]); reduce_scatter
//! 1 MiB per rank 67-68 against 71-72, 4 MiB 351-375 against 425-450, 64 MiB 8873-12630
//! against 12303-13674; with messages of 256 and 512 KiB they lost 1.4-2.4x (the
//! acknowledgement's round trip). reduce lost at 64 MiB (9353-10366 against 6925-7144) and
//! stays on the rings. So these ops ask the page tables about each message's buffer
//! ([`OverRings::FromHugePages`]).
//!
//! Where the receivers split their copies with a helper thread (a host with two CPUs per local
//! rank, `read_helper`), broadcast's and scatter's messages from 1 MiB go by reference over
//! the rings too ([`SingleCopyRule::split_reads`]): two cores copy each message straight into
//! place. On a lent 16-core VM, broadcast of 64 MiB from buffers in huge pages: 2 ranks
//! 10.2-10.7 ms through the rings, 3.6-4.0 by reference split; 4 ranks 17.8-27.9 against
//! 7.3-8.3 (from 4 KiB pages, 2 ranks 9.9 against 8.5-8.8).

use dist_wire::CollectiveOp;

/// Which large messages to a peer reached through shared-memory rings go by reference.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum OverRings {
    /// None (`cross_memory_over_rings: Some(false)`).
    Never,
    /// All but broadcast's and scatter's, and theirs from 1 MiB where the receivers split
    /// their copies (`cross_memory_over_rings: Some(true)`).
    Always,
    /// All but broadcast's, scatter's and reduce_scatter's, all_to_all's from a lower size:
    /// unset, and this host's ranks outnumber its CPUs.
    SharedCores,
    /// Those of all_gather, all_to_all, all_reduce and reduce_scatter whose bytes lie wholly
    /// in huge pages, and broadcast's, scatter's and gather's from 1 MiB where the receivers
    /// split their copies: unset, and this host's ranks fit its CPUs. From [`HUGE_PAGE_BYTES`] for
    /// the first two, [`REDUCTION_FROM_HUGE_PAGES_MIN_BYTES`] for the reductions, and for
    /// all_reduce only up to [`ALL_REDUCE_FROM_HUGE_PAGES_MAX_BYTES`] of buffer.
    FromHugePages,
}

/// The smallest message of all_gather and all_to_all that [`OverRings::FromHugePages`]
/// considers: one that spans a huge page.
const HUGE_PAGE_BYTES: usize = 2 << 20;

/// The smallest message of all_reduce and reduce_scatter that [`OverRings::FromHugePages`]
/// considers: smaller ones lost to the rings (2 ranks from huge pages, us: all_reduce of 1 MiB,
/// in messages of 512 KiB, 108.9-112.3 against 65.1-66.3; reduce_scatter of 256 KiB per rank
/// 28.7-36.5 against 20.4-20.7).
const REDUCTION_FROM_HUGE_PAGES_MIN_BYTES: usize = 1 << 20;

/// The largest all_reduce (its whole buffer) whose messages [`OverRings::FromHugePages`]
/// sends by reference. Measured on a host with 32 MiB of L3: by reference was 0.8x the rings'
/// time at 16 MiB, even at 32 MiB and 1.05x at 64 MiB, where neither rank's buffer is in the
/// cache any more and the kernel's copy, slower than the rings' from memory, sets the pace.
const ALL_REDUCE_FROM_HUGE_PAGES_MAX_BYTES: usize = 32 << 20;

/// The smallest message that goes by reference unless `MeshOptions::cross_memory_min_bytes`
/// says otherwise: below it the acknowledgement's round trip costs more than the copy saved.
pub(super) const SINGLE_COPY_MIN_BYTES: usize = 256 << 10;

/// The same for all_to_all's messages over shared-memory rings when this host's ranks
/// outnumber its CPUs ([`OverRings::SharedCores`]). There every copy saved gives time back to a
/// rank that shares the core, and all_to_all's messages are all in flight at once, so no
/// rank waits on one acknowledgement before its next copy. At 4 ranks on 2 cores, alternated
/// with 256 KiB (gloo_bench, us): 256 KiB per rank (64 KiB messages) 72-75 against 145-165,
/// 512 KiB 108-151 against 243-316 (Open MPI's shared memory: 65-68 and 107). The same
/// threshold for all_reduce cost 1.6-2x at 256 KiB (halving-doubling's exchanges each wait
/// for the other's acknowledgement), and all_gather gained nothing. Down from 64 KiB
/// (2026-11-28), against the build before, alternated, 8 runs, medians of the runs: 128 KiB
/// per rank (32 KiB messages) 46.5 against 53.6, 192 KiB 51.7 against 81.0 (ranges 49-57
/// against 77-95), 256 KiB even (62.6 against 63.8); with 16 KiB messages too, 64 KiB per
/// rank was even (41.4 against 40.4).
pub(super) const ALL_TO_ALL_SHARED_CORES_MIN_BYTES: usize = 32 << 10;

/// The smallest message of broadcast and scatter (and, where the ranks fit the CPUs, of
/// gather) that goes by reference over shared-memory rings, where receivers split their copies with a helper thread (`split_reads`): then two
/// cores copy each message straight into place, where the rings' pipeline runs at one
/// core's pace on a machine whose cores each stream a fraction of its memory (a lent 16-core
/// VM, 2 ranks, broadcast of 64 MiB: the rings 12-14 ms, one thread by reference 9.6, two
/// 4.0-4.5).
const SPLIT_PIPELINE_MIN_BYTES: usize = 1 << 20;

/// The sender's rule for which messages go by reference, to peers that can read its memory.
#[derive(Clone, Copy, Debug)]
pub(super) struct SingleCopyRule {
    /// Which messages over shared-memory rings (`MeshOptions::cross_memory_over_rings`).
    pub(super) over_rings: OverRings,
    /// The smallest message (`MeshOptions::cross_memory_min_bytes`); `None` picks
    /// [`SINGLE_COPY_MIN_BYTES`], or [`ALL_TO_ALL_SHARED_CORES_MIN_BYTES`] where it applies.
    pub(super) min_bytes: Option<usize>,
    /// The receivers on this host read large messages by reference half on a helper thread
    /// (`MeshOptions::copy_helper`): broadcast's and scatter's go by reference over the rings
    /// too, from [`SPLIT_PIPELINE_MIN_BYTES`], and gather's even where the ranks fit the
    /// CPUs.
    pub(super) split_reads: bool,
}

impl SingleCopyRule {
    /// The smallest message that goes by reference at all: `min_bytes`, else
    /// [`SINGLE_COPY_MIN_BYTES`]. The pace of each way (`path_pace`) sends nothing smaller
    /// that way, so that a user's `cross_memory_min_bytes` holds.
    pub(super) fn floor(&self) -> usize {
        self.min_bytes.unwrap_or(SINGLE_COPY_MIN_BYTES).max(1)
    }

    /// Whether `data`, a message of `op` to a peer reached through shared-memory rings
    /// (`shm`) or TCP, goes by reference; `op_bytes` is the size of the operation's buffer as
    /// its frames announce it (element count times element size).
    pub(super) fn pays(&self, shm: bool, op: CollectiveOp, data: &[u8], op_bytes: usize) -> bool {
        let at_least = |auto: usize| data.len() >= self.min_bytes.unwrap_or(auto).max(1);
        if !shm {
            return at_least(SINGLE_COPY_MIN_BYTES);
        }
        let pipeline_split = self.split_reads && at_least(SPLIT_PIPELINE_MIN_BYTES);
        match self.over_rings {
            OverRings::Never => false,
            OverRings::Always => match op {
                CollectiveOp::Broadcast | CollectiveOp::Scatter => pipeline_split,
                _ => at_least(SINGLE_COPY_MIN_BYTES),
            },
            OverRings::SharedCores => match op {
                CollectiveOp::Broadcast | CollectiveOp::Scatter | CollectiveOp::ReduceScatter => {
                    false
                }
                CollectiveOp::AllToAll => at_least(ALL_TO_ALL_SHARED_CORES_MIN_BYTES),
                _ => at_least(SINGLE_COPY_MIN_BYTES),
            },
            OverRings::FromHugePages => {
                let wanted = match op {
                    CollectiveOp::AllGather | CollectiveOp::AllToAll => {
                        data.len() >= HUGE_PAGE_BYTES
                    }
                    CollectiveOp::ReduceScatter => {
                        data.len() >= REDUCTION_FROM_HUGE_PAGES_MIN_BYTES
                    }
                    CollectiveOp::AllReduce => {
                        data.len() >= REDUCTION_FROM_HUGE_PAGES_MIN_BYTES
                            && op_bytes <= ALL_REDUCE_FROM_HUGE_PAGES_MAX_BYTES
                    }
                    CollectiveOp::Broadcast | CollectiveOp::Scatter | CollectiveOp::Gather => {
                        return pipeline_split;
                    }
                    _ => false,
                };
                wanted && at_least(SINGLE_COPY_MIN_BYTES) && super::huge_pages::in_huge_pages(data)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An operation's size that none of these cases depends on.
    const ANY_OP: usize = 1 << 20;

    fn rule(over_rings: OverRings, min_bytes: Option<usize>) -> SingleCopyRule {
        SingleCopyRule {
            over_rings,
            min_bytes,
            split_reads: false,
        }
    }

    #[test]
    fn with_split_reads_broadcast_and_scatter_go_by_reference_over_rings_from_a_mebibyte() {
        let buf = vec![0u8; SPLIT_PIPELINE_MIN_BYTES];
        let (at, below) = (&buf[..], &buf[1..]);
        for over in [OverRings::Always, OverRings::FromHugePages] {
            let split = SingleCopyRule {
                split_reads: true,
                ..rule(over, None)
            };
            for op in [CollectiveOp::Broadcast, CollectiveOp::Scatter] {
                assert!(split.pays(true, op, at, ANY_OP), "{over:?} {op}");
                assert!(!split.pays(true, op, below, ANY_OP), "{over:?} {op}");
                assert!(
                    !rule(over, None).pays(true, op, at, ANY_OP),
                    "{over:?} {op}"
                );
            }
        }
        // Gather's root copies every block while the senders wait: where the ranks fit the
        // CPUs it goes by reference only when split (told to, it always does).
        let split = SingleCopyRule {
            split_reads: true,
            ..rule(OverRings::FromHugePages, None)
        };
        assert!(split.pays(true, CollectiveOp::Gather, at, ANY_OP));
        assert!(!split.pays(true, CollectiveOp::Gather, below, ANY_OP));
        let whole = rule(OverRings::FromHugePages, None);
        assert!(!whole.pays(true, CollectiveOp::Gather, at, ANY_OP));
        // Never means never; a user's minimum holds.
        let never = SingleCopyRule {
            split_reads: true,
            ..rule(OverRings::Never, None)
        };
        assert!(!never.pays(true, CollectiveOp::Broadcast, at, ANY_OP));
        let higher = SingleCopyRule {
            split_reads: true,
            ..rule(OverRings::Always, Some(2 * SPLIT_PIPELINE_MIN_BYTES))
        };
        assert!(!higher.pays(true, CollectiveOp::Broadcast, at, ANY_OP));
    }

    #[test]
    fn over_tcp_every_op_goes_by_reference_from_the_minimum() {
        let buf = vec![0u8; SINGLE_COPY_MIN_BYTES];
        let (at, below) = (&buf[..], &buf[1..]);
        for over in [
            OverRings::Never,
            OverRings::Always,
            OverRings::SharedCores,
            OverRings::FromHugePages,
        ] {
            for op in [
                CollectiveOp::Broadcast,
                CollectiveOp::AllToAll,
                CollectiveOp::AllReduce,
            ] {
                assert!(
                    rule(over, None).pays(false, op, at, ANY_OP),
                    "{over:?} {op}"
                );
                assert!(
                    !rule(over, None).pays(false, op, below, ANY_OP),
                    "{over:?} {op}"
                );
            }
        }
        assert!(rule(OverRings::Never, Some(10)).pays(
            false,
            CollectiveOp::AllReduce,
            &buf[..10],
            ANY_OP
        ));
        assert!(!rule(OverRings::Never, Some(10)).pays(
            false,
            CollectiveOp::AllReduce,
            &buf[..9],
            ANY_OP
        ));
        // A minimum of 0 still keeps empty messages inline.
        assert!(!rule(OverRings::Never, Some(0)).pays(false, CollectiveOp::AllReduce, &[], ANY_OP));
    }

    #[test]
    fn over_rings_with_shared_cores_all_to_all_goes_by_reference_from_its_own_minimum() {
        let shared = rule(OverRings::SharedCores, None);
        let buf = vec![0u8; SINGLE_COPY_MIN_BYTES];
        let small = &buf[..ALL_TO_ALL_SHARED_CORES_MIN_BYTES];
        let smaller = &buf[..ALL_TO_ALL_SHARED_CORES_MIN_BYTES - 1];
        assert!(shared.pays(true, CollectiveOp::AllToAll, small, ANY_OP));
        assert!(!shared.pays(true, CollectiveOp::AllToAll, smaller, ANY_OP));
        for op in [
            CollectiveOp::AllGather,
            CollectiveOp::Gather,
            CollectiveOp::AllReduce,
            CollectiveOp::Reduce,
        ] {
            assert!(!shared.pays(true, op, small, ANY_OP), "{op}");
            assert!(shared.pays(true, op, &buf, ANY_OP), "{op}");
        }
        for op in [
            CollectiveOp::ReduceScatter,
            CollectiveOp::Broadcast,
            CollectiveOp::Scatter,
        ] {
            assert!(!shared.pays(true, op, &buf, ANY_OP), "{op}");
        }
        // A minimum set by the user holds for all_to_all too.
        let set = rule(OverRings::SharedCores, Some(SINGLE_COPY_MIN_BYTES));
        assert!(!set.pays(true, CollectiveOp::AllToAll, small, ANY_OP));
        assert!(set.pays(true, CollectiveOp::AllToAll, &buf, ANY_OP));
    }

    #[test]
    fn over_rings_when_told_every_op_but_the_pipelines_goes_by_reference() {
        let always = rule(OverRings::Always, None);
        let buf = vec![0u8; SINGLE_COPY_MIN_BYTES];
        for op in [
            CollectiveOp::AllReduce,
            CollectiveOp::ReduceScatter,
            CollectiveOp::AllToAll,
            CollectiveOp::AllGather,
        ] {
            assert!(always.pays(true, op, &buf, ANY_OP), "{op}");
            assert!(!always.pays(true, op, &buf[1..], ANY_OP), "{op}");
        }
        assert!(!always.pays(true, CollectiveOp::Broadcast, &buf, ANY_OP));
        assert!(!always.pays(true, CollectiveOp::Scatter, &buf, ANY_OP));
    }

    #[test]
    fn over_rings_otherwise_only_huge_messages_or_none_go_by_reference() {
        let buf = vec![0u8; SINGLE_COPY_MIN_BYTES];
        for op in [CollectiveOp::AllToAll, CollectiveOp::AllGather] {
            assert!(!rule(OverRings::Never, None).pays(true, op, &buf, ANY_OP));
            // Shorter than a huge page: never, whatever the minimum.
            assert!(!rule(OverRings::FromHugePages, Some(1)).pays(true, op, &buf, ANY_OP));
        }
        // The reductions only from huge pages, and small messages not even there.
        let big = vec![0u8; 2 * HUGE_PAGE_BYTES];
        assert!(!rule(OverRings::FromHugePages, None).pays(
            true,
            CollectiveOp::AllReduce,
            &big[..REDUCTION_FROM_HUGE_PAGES_MIN_BYTES - 1],
            ANY_OP
        ));
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn from_huge_pages_the_reductions_go_by_reference_within_their_sizes() {
        // Advised and cut at a 2 MiB boundary; the kernel backs it with huge pages only while
        // it has free ones, so each case is checked against what the page walk says of the
        // slice it passes.
        let in_huge = super::super::huge_pages::in_huge_pages;
        let len = 2 * HUGE_PAGE_BYTES;
        let mut map = memmap2::MmapMut::map_anon(len + HUGE_PAGE_BYTES).unwrap();
        let skip =
            (map.as_ptr() as usize).next_multiple_of(HUGE_PAGE_BYTES) - map.as_ptr() as usize;
        let _ = map.advise(memmap2::Advice::HugePage);
        map.fill(1);
        let buf = &map[skip..skip + len];
        let from_huge = rule(OverRings::FromHugePages, None);
        let msg = &buf[..REDUCTION_FROM_HUGE_PAGES_MIN_BYTES];
        let max = ALL_REDUCE_FROM_HUGE_PAGES_MAX_BYTES;
        let pays = |op, data, op_bytes| from_huge.pays(true, op, data, op_bytes);
        assert_eq!(pays(CollectiveOp::AllReduce, msg, max), in_huge(msg));
        assert_eq!(
            pays(CollectiveOp::ReduceScatter, msg, 4 * max),
            in_huge(msg)
        );
        assert_eq!(pays(CollectiveOp::AllGather, buf, 4 * max), in_huge(buf));
        // Past the cache, all_reduce stays on the rings; reduce and broadcast always do.
        assert!(!pays(CollectiveOp::AllReduce, msg, max + 1));
        assert!(!pays(CollectiveOp::Reduce, msg, max));
        assert!(!pays(CollectiveOp::Broadcast, buf, max));
        // Messages shorter than the reductions' minimum stay on the rings.
        let short = &msg[..msg.len() - 1];
        assert!(!pays(CollectiveOp::AllReduce, short, max));
        assert!(!pays(CollectiveOp::ReduceScatter, short, max));

        // Memory advised against huge pages never has them: the reductions stay on the rings.
        let mut small = memmap2::MmapMut::map_anon(len).unwrap();
        small.advise(memmap2::Advice::NoHugePage).unwrap();
        small.fill(1);
        let small_msg = &small[..REDUCTION_FROM_HUGE_PAGES_MIN_BYTES];
        assert!(!pays(CollectiveOp::AllReduce, small_msg, max));
        assert!(!pays(CollectiveOp::ReduceScatter, small_msg, max));
    }
}
