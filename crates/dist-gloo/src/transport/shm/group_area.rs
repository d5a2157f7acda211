//! The group area: two slots per rank after the rings in rank 0's segment, which every rank
//! maps when every pair of the group talks through rings, for operations that send no message:
//! the barrier, and small all_reduces, all_gathers and reduce_scatters (each rank publishes its
//! buffer or block; every rank reads them all, and reductions combine them in rank order), and,
//! where the ranks outnumber the host's CPUs, larger all_gathers, the all_reduce in two shots
//! (`algo::allreduce::in_two_shots`) and broadcasts in pieces (`algo::bcast`).
//!
//! Why: with four ranks on two cores, a barrier of messages (two dissemination rounds, each a
//! frame written into a ring and read by the engine) took 9.8 us against Open MPI's 4.7. A
//! process waiting on a core it shares yields it to the other at every look, so what a
//! barrier costs is how many looks it takes and how long each is. Here each rank stores one
//! word and looks at one cache line until every rank has stored: a C probe of both shapes on
//! this host read 3.4 us for the words against 4.8 for the dissemination rounds (median of
//! the per-iteration maximum over ranks, as the benchmarks measure).
//!
//! Layout (offsets from the area's start, which is 64-byte aligned):
//!
//! | offset | field | written by |
//! | --: | --- | --- |
//! | 8 r | `arrived[r]`: u64, rank r's operation count, with [`BARRIER`] for a barrier | rank r |
//! | `arrivals_bytes` + 4 r | `sleeping[r]`: u32, rank r sleeps in its poller until woken | rank r |
//! | `slots_at` + `SLOT_BYTES` (2 r + k mod 2) | rank r's header and data for its k-th operation | rank r |
//!
//! A rank's k-th operation through the area writes its slot of parity k mod 2, then stores k
//! in its own arrival word (release), so the counts only grow and never need resetting; the
//! operation is done once every word holds at least k, and what each slot holds is then that
//! rank's publication (acquire). A barrier also sets [`BARRIER`] in the word: when every word
//! reads exactly k with that bit, every rank is in barrier k and no header need be read (at 2
//! ranks the peer's header line was a quarter of a barrier's time). Two slots per rank are
//! enough: a rank that writes its slot for operation k + 2 has seen every rank arrive at
//! k + 1, and each read its slots of k before it arrived there. One operation publishes
//! without waiting: the rank of an all_to_all whose input is too large for the area publishes
//! its table of counts and goes on by messages
//! ([`crate::transport::Transport::shared_memory_announce`]). It then receives a frame of
//! k + 1 from every rank, each sent once its sender was done with k; and until it is done with
//! k itself (no rank writes its slot of k again before this rank arrives at k + 1 or sends it
//! frames of k + 1), it may read another rank's publication of k once that rank has arrived
//! there ([`GroupArea::has_arrived`], `Transport::shared_memory_peek`). A rank that found the
//! others missing for its whole spin raises its `sleeping` flag, looks once more, and sleeps in
//! the poller over its links; a rank that arrives rings the doorbell of every rank whose flag
//! is up. Both sides store, issue a `SeqCst` fence, then load what the other stored (as the
//! rings' sleep flags, see `ring`), so either the sleeper sees the arrival or the arriving rank
//! sees the flag: no wake-up is lost.
//!
//! The words come from other processes of the group; nothing here indexes memory with them, so
//! a corrupt word can only end a barrier early or late, never touch memory outside the area.

#![allow(
    unsafe_code,
    reason = "the area lives in memory shared with the other processes of the group"
)]

use std::io;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering, fence};

use dist_wire::HEADER_LEN;
use memmap2::MmapRaw;

/// Data bytes a rank may publish in one operation. Which operations go through the area, and
/// up to what size, the algorithms decide (`algo`): the smallest all_reduces, all_gathers and
/// reduce_scatters everywhere, and, where the group's ranks outnumber the host's CPUs, the
/// all_reduce in two shots and broadcasts in pieces of this size, and all_gathers of larger
/// blocks.
///
/// Why a mebibyte: at 4 ranks on 2 cores the two-shot all_reduce of 4 and 16 MiB took about as
/// long in pieces of 512 KiB and 1 MiB, and longer in pieces of 2 MiB (gloo_bench, 3 runs
/// each). The area holds two slots per rank, 8 MiB at 4 ranks, in rank 0's `memfd`, whose
/// pages exist only once written: groups that never publish large data never touch more than
/// the first page of each slot.
pub(crate) const AREA_DATA_BYTES: usize = 1 << 20;

/// The bit of an arrival word that says the operation is a barrier; the count lies below it
/// (2^56 operations: centuries at millions a second).
const BARRIER: u64 = 1 << 56;

/// The count in an arrival word.
const COUNT: u64 = BARRIER - 1;

/// Bytes of one slot: the publisher's frame header, then its data, in whole pages, so that
/// every slot's data starts at the same offset in its page (a copy's speed depends on the
/// distance between its ends' offsets, see `dist_simd::copy`).
const SLOT_BYTES: usize = (HEADER_LEN + AREA_DATA_BYTES).next_multiple_of(4096);

/// Bytes of the arrival words of `world` ranks, a whole number of 128-byte lines.
fn arrivals_bytes(world: usize) -> usize {
    (world * 8).next_multiple_of(128)
}

/// Where the slots begin: after the arrival words and the sleep flags, each on lines of their
/// own (a sleeper's flag store must not invalidate the line every waiter reads).
fn slots_at(world: usize) -> usize {
    arrivals_bytes(world) + (world * 4).next_multiple_of(128)
}

/// Bytes of the area for `world` ranks.
pub(crate) fn area_bytes(world: usize) -> usize {
    slots_at(world) + world * 2 * SLOT_BYTES
}

/// One group's area, seen from one rank.
#[derive(Debug)]
pub(crate) struct GroupArea {
    map: Arc<MmapRaw>,
    /// Offset of the area in `map`.
    at: usize,
    world: usize,
}

impl GroupArea {
    /// The area of `world` ranks at offset `at` of `map`, checked to fit and to be aligned for
    /// its atomics.
    pub(crate) fn new(map: Arc<MmapRaw>, at: usize, world: usize) -> io::Result<Self> {
        let end = at.checked_add(area_bytes(world));
        if !at.is_multiple_of(64)
            || !(map.as_ptr() as usize).is_multiple_of(64)
            || end.is_none_or(|e| e > map.len())
        {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "a group area for {world} ranks at offset {at} does not fit a mapping of {} bytes",
                    map.len()
                ),
            ));
        }
        Ok(GroupArea { map, at, world })
    }

    /// The atomic at byte `off` of the area.
    ///
    /// # Safety
    ///
    /// `off` is a multiple of `T`'s alignment (at most 8), `off + size_of::<T>()` is within
    /// `area_bytes(self.world)`, and `T` is an atomic integer type.
    unsafe fn atomic_at<T>(&self, off: usize) -> &T {
        debug_assert!(off + size_of::<T>() <= area_bytes(self.world));
        // SAFETY: `new` checked that the area lies inside the live mapping `self.map` at a
        // 64-aligned offset of a 64-aligned mapping, and the caller that `off` is in the area
        // and aligned for `T`; the mapping lives as long as `self`. The other processes touch
        // the area only atomically (this code in them), so an atomic view of it is sound.
        unsafe { &*self.map.as_mut_ptr().add(self.at + off).cast::<T>() }
    }

    fn arrived(&self, rank: usize) -> &AtomicU64 {
        assert!(
            rank < self.world,
            "rank {rank} outside a group of {}",
            self.world
        );
        // SAFETY: the arrival words are the area's first `world` u64s; `8 * rank` is in them.
        unsafe { self.atomic_at(8 * rank) }
    }

    fn sleeping(&self, rank: usize) -> &AtomicU32 {
        assert!(
            rank < self.world,
            "rank {rank} outside a group of {}",
            self.world
        );
        // SAFETY: the flags are `world` u32s after the arrival words (`arrivals_bytes` is a
        // multiple of 128, so each flag is 4-aligned), within `area_bytes`.
        unsafe { self.atomic_at(arrivals_bytes(self.world) + 4 * rank) }
    }

    /// The number of `rank`'s next operation through the area (1 for the first).
    pub(crate) fn next_mark(&self, rank: usize) -> u64 {
        (self.arrived(rank).load(Ordering::Relaxed) & COUNT) + 1
    }

    /// Writes `header` and then `parts` one after the other (at most [`AREA_DATA_BYTES`] in
    /// all) into `rank`'s slot for its operation `mark`, before it arrives there. In parts so
    /// that a publication that puts a few bytes of its own in front of a caller's buffer (the
    /// all_to_all's table of counts) need not first copy the two together.
    pub(crate) fn publish(
        &self,
        rank: usize,
        mark: u64,
        header: &[u8; HEADER_LEN],
        parts: &[&[u8]],
    ) {
        let len: usize = parts.iter().map(|p| p.len()).sum();
        assert!(len <= AREA_DATA_BYTES, "{len} bytes");
        let at = self.slot_at(rank, mark);
        // SAFETY: `slot_at` is a slot inside the area `new` checked to lie in the live mapping,
        // `SLOT_BYTES` long, which `HEADER_LEN + len` does not exceed. Only this rank writes
        // it, and no rank reads it between this write and the arrival store that follows (see
        // the module docs), so nothing reads the bytes while they change. The two views are
        // disjoint, end with this function, and alias none of `header` and `parts`, which are
        // this process's own memory, not the mapping.
        let (head, mut body) = unsafe {
            let dst = self.map.as_mut_ptr().add(at);
            (
                std::slice::from_raw_parts_mut(dst, HEADER_LEN),
                std::slice::from_raw_parts_mut(dst.add(HEADER_LEN), len),
            )
        };
        head.copy_from_slice(header);
        for part in parts {
            let (here, rest) = body.split_at_mut(part.len());
            dist_simd::copy::bulk(here, part);
            body = rest;
        }
    }

    /// Copies `rank`'s header for operation `mark`, at which `rank` has arrived (the caller saw
    /// its word) and which this rank has not passed: every rank arrived there, or, before a
    /// step over messages sleeps, `mark` is this rank's next (`Engine::in_area_instead`).
    /// Either way `rank` writes that slot again only after this rank arrives at `mark + 1`.
    pub(crate) fn read_header(&self, rank: usize, mark: u64, header: &mut [u8; HEADER_LEN]) {
        self.read_slot(rank, mark, 0, header);
    }

    /// Runs `f` on the first `len` bytes of `rank`'s data for operation `mark` (which every
    /// rank has arrived at), where they lie: a copy out of the area would cost as much as what
    /// `f` does with them.
    pub(crate) fn with_data<R>(
        &self,
        rank: usize,
        mark: u64,
        len: usize,
        f: impl FnOnce(&[u8]) -> R,
    ) -> R {
        assert!(len <= AREA_DATA_BYTES, "{len} bytes");
        let at = self.slot_at(rank, mark) + HEADER_LEN;
        // SAFETY: `HEADER_LEN + len` lies within the slot (asserted above), which lies in the
        // live mapping (`new`). The writer arrived at `mark` after writing (the caller saw its
        // word with acquire ordering) and writes this slot again only after every rank has
        // arrived at `mark + 1`, which this one does not do before `f` returns and the view
        // ends, so the bytes do not change while `f` reads them.
        let slot = unsafe { std::slice::from_raw_parts(self.map.as_ptr().add(at), len) };
        f(slot)
    }

    fn read_slot(&self, rank: usize, mark: u64, from: usize, out: &mut [u8]) {
        debug_assert!(from + out.len() <= SLOT_BYTES);
        let at = self.slot_at(rank, mark) + from;
        // SAFETY: as in `publish`: `from + out.len()` lies within the slot (the callers bound
        // it). The writer arrived at `mark` after writing (the caller saw its word with acquire
        // ordering) and writes this slot again only after every rank has arrived at
        // `mark + 1`, which this one has not, so the bytes do not change while they are copied.
        // The view ends with this function; `out` is this process's memory, not the mapping.
        let slot = unsafe { std::slice::from_raw_parts(self.map.as_ptr().add(at), out.len()) };
        dist_simd::copy::bulk(out, slot);
    }

    fn slot_at(&self, rank: usize, mark: u64) -> usize {
        assert!(
            rank < self.world,
            "rank {rank} outside a group of {}",
            self.world
        );
        self.at + slots_at(self.world) + (2 * rank + (mark % 2) as usize) * SLOT_BYTES
    }

    /// Marks `rank` arrived at its operation `mark` (from [`GroupArea::next_mark`], its slot
    /// already written), a `barrier` or not, and puts into `sleepers` the ranks asleep waiting
    /// for an arrival, whose doorbells the caller must ring.
    pub(crate) fn arrive(&self, rank: usize, mark: u64, barrier: bool, sleepers: &mut Vec<usize>) {
        let kind = if barrier { BARRIER } else { 0 };
        self.arrived(rank).store(mark | kind, Ordering::SeqCst);
        // Pairs with the fence in `sleep`: see the module docs.
        fence(Ordering::SeqCst);
        sleepers.clear();
        sleepers.extend(
            (0..self.world).filter(|&p| p != rank && self.sleeping(p).load(Ordering::SeqCst) != 0),
        );
    }

    /// Whether `rank` has arrived at its operation `mark` (its publication for it is then in
    /// its slot, acquire).
    pub(crate) fn has_arrived(&self, rank: usize, mark: u64) -> bool {
        self.arrived(rank).load(Ordering::Acquire) & COUNT >= mark
    }

    /// Puts into `missing` the ranks that have not arrived at operation `mark`, and returns
    /// whether every rank is at exactly `mark` and arrived there through a barrier (a rank
    /// already past it says nothing of what `mark` was, so it counts as not).
    pub(crate) fn missing_into(&self, mark: u64, missing: &mut Vec<usize>) -> bool {
        missing.clear();
        let mut barriers = true;
        for p in 0..self.world {
            let word = self.arrived(p).load(Ordering::Acquire);
            if word & COUNT < mark {
                missing.push(p);
            }
            barriers &= word == mark | BARRIER;
        }
        barriers
    }

    /// Raises `rank`'s sleep flag before it sleeps waiting for barrier `mark`, and returns
    /// whether every rank has arrived meanwhile (then it must not sleep; the flag is lowered).
    pub(crate) fn sleep(&self, rank: usize, mark: u64) -> bool {
        self.sleeping(rank).store(1, Ordering::SeqCst);
        // Pairs with the fence in `arrive`.
        fence(Ordering::SeqCst);
        let all = (0..self.world).all(|p| self.arrived(p).load(Ordering::SeqCst) & COUNT >= mark);
        if all {
            self.wake(rank);
        }
        all
    }

    /// Raises `rank`'s sleep flag before it sleeps in a step over messages, and puts into
    /// `arrived` the other ranks already at its operation `mark` (its next through the area):
    /// from then on, a rank that arrives there rings its doorbell. Lower the flag with
    /// [`GroupArea::wake`] once awake.
    ///
    /// Why: a rank that runs an operation over messages while the others run it through the
    /// area hears nothing from them, since they send no frames; where it only receives (a
    /// star's root, a tree's leaf, a repeated root) the two sides would each wait for the
    /// other until the timeout. The headers of the ranks at `mark` say what they run.
    pub(crate) fn sleep_watching(&self, rank: usize, mark: u64, arrived: &mut Vec<usize>) {
        self.sleeping(rank).store(1, Ordering::SeqCst);
        // Pairs with the fence in `arrive`, as in `sleep`.
        fence(Ordering::SeqCst);
        arrived.clear();
        arrived.extend(
            (0..self.world)
                .filter(|&p| p != rank && self.arrived(p).load(Ordering::SeqCst) & COUNT >= mark),
        );
    }

    /// Lowers `rank`'s sleep flag after it woke.
    pub(crate) fn wake(&self, rank: usize) {
        self.sleeping(rank).store(0, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn area(world: usize) -> (GroupArea, GroupArea) {
        let map = Arc::new(MmapRaw::from(
            memmap2::MmapOptions::new()
                .len(4096 + area_bytes(world))
                .map_anon()
                .unwrap(),
        ));
        (
            GroupArea::new(map.clone(), 4096, world).unwrap(),
            GroupArea::new(map, 4096, world).unwrap(),
        )
    }

    /// `rank` arrives at its next operation, a barrier, with nothing published; returns its
    /// number.
    fn arrive(area: &GroupArea, rank: usize, sleepers: &mut Vec<usize>) -> u64 {
        let mark = area.next_mark(rank);
        area.arrive(rank, mark, true, sleepers);
        mark
    }

    #[test]
    fn what_a_rank_publishes_for_an_operation_stays_until_every_rank_is_past_it() {
        let (a, b) = area(2);
        let mut sleepers = Vec::new();
        let (mut h, mut out) = ([0u8; HEADER_LEN], [0u8; 5]);
        for (rank, area) in [(0, &a), (1, &b)] {
            let mark = area.next_mark(rank);
            area.publish(
                rank,
                mark,
                &[rank as u8 + 1; HEADER_LEN],
                &[&[10 + rank as u8; 2], &[10 + rank as u8; 3]],
            );
            area.arrive(rank, mark, false, &mut sleepers);
        }
        // Rank 0 goes on to its second operation: its first publication is still there.
        let mark = a.next_mark(0);
        assert_eq!(mark, 2);
        a.publish(0, mark, &[9; HEADER_LEN], &[&[99; 5]]);
        for rank in 0..2 {
            b.read_header(rank, 1, &mut h);
            b.with_data(rank, 1, 5, |d| out.copy_from_slice(d));
            assert_eq!(
                (h, out),
                ([rank as u8 + 1; HEADER_LEN], [10 + rank as u8; 5])
            );
        }
        a.read_header(0, 2, &mut h);
        a.with_data(0, 2, 5, |d| out.copy_from_slice(d));
        assert_eq!((h, out), ([9; HEADER_LEN], [99; 5]));
    }

    #[test]
    fn a_barrier_is_done_only_once_every_rank_arrived_at_it() {
        let (a, b) = area(3);
        let mut sleepers = Vec::new();
        let mut missing = Vec::new();
        assert_eq!(arrive(&a, 0, &mut sleepers), 1);
        a.missing_into(1, &mut missing);
        assert_eq!(missing, [1, 2]);
        assert_eq!(arrive(&b, 2, &mut sleepers), 1);
        b.missing_into(1, &mut missing);
        assert_eq!(missing, [1]);
        assert_eq!(arrive(&b, 1, &mut sleepers), 1);
        a.missing_into(1, &mut missing);
        assert!(missing.is_empty());
        // Rank 0 runs ahead into barrier 2: the others are missing there, not in barrier 1.
        assert_eq!(arrive(&a, 0, &mut sleepers), 2);
        b.missing_into(1, &mut missing);
        assert!(missing.is_empty());
        b.missing_into(2, &mut missing);
        assert_eq!(missing, [1, 2]);
    }

    #[test]
    fn only_every_rank_at_exactly_this_barrier_is_all_barriers() {
        let (a, b) = area(2);
        let mut sleepers = Vec::new();
        let mut missing = Vec::new();
        assert_eq!(arrive(&a, 0, &mut sleepers), 1);
        assert!(!a.missing_into(1, &mut missing), "rank 1 has not arrived");
        // Rank 1 arrives at operation 1, but not through a barrier: a mismatch the headers
        // must show.
        b.arrive(1, 1, false, &mut sleepers);
        assert!(!a.missing_into(1, &mut missing));
        assert!(missing.is_empty());
        // Both at barrier 2.
        assert_eq!(arrive(&a, 0, &mut sleepers), 2);
        assert_eq!(b.next_mark(1), 2);
        b.arrive(1, 2, true, &mut sleepers);
        assert!(a.missing_into(2, &mut missing));
        assert!(missing.is_empty());
        // Rank 1 already in its next operation: operation 2 is done, but its word no longer
        // says what 2 was.
        assert_eq!(arrive(&b, 1, &mut sleepers), 3);
        assert!(!a.missing_into(2, &mut missing));
        assert!(missing.is_empty());
    }

    #[test]
    fn an_arriving_rank_learns_who_sleeps_and_a_sleeper_does_not_sleep_past_the_last_arrival() {
        let (a, b) = area(3);
        let mut sleepers = Vec::new();
        arrive(&a, 0, &mut sleepers);
        assert!(sleepers.is_empty());
        assert!(!a.sleep(0, 1), "ranks 1 and 2 have not arrived");
        arrive(&b, 1, &mut sleepers);
        assert_eq!(sleepers, [0]);
        arrive(&b, 2, &mut sleepers);
        assert_eq!(sleepers, [0]);
        a.wake(0);
        arrive(&b, 1, &mut sleepers);
        assert!(sleepers.is_empty(), "rank 0 woke");
        // Everyone is at barrier 1 now: a rank about to sleep for it finds it done instead.
        assert!(a.sleep(0, 1));
        assert!(!a.sleep(0, 2), "rank 0 and 2 are not at barrier 2");
    }

    #[test]
    fn an_area_that_does_not_fit_its_mapping_is_refused() {
        let map = Arc::new(MmapRaw::from(
            memmap2::MmapOptions::new().len(4096).map_anon().unwrap(),
        ));
        assert!(
            GroupArea::new(map.clone(), 0, 1).is_err(),
            "two slots do not fit"
        );
        let map = Arc::new(MmapRaw::from(
            memmap2::MmapOptions::new()
                .len(area_bytes(2) + 64)
                .map_anon()
                .unwrap(),
        ));
        assert!(GroupArea::new(map.clone(), 128, 2).is_err(), "past the end");
        assert!(GroupArea::new(map.clone(), 8, 2).is_err(), "misaligned");
        assert!(GroupArea::new(map, 64, 2).is_ok());
    }
}
