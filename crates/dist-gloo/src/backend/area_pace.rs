//! Which all_to_alls between the group area's fixed limit and what it holds go through it,
//! chosen by rank 0 from how fast its calls went each way, one call ahead, and followed by
//! the others.
//!
//! Why: where the ranks outnumber the CPUs, the area beats messages near and loses badly far
//! apart. 4 ranks on 2 cores, 256 KiB per rank, gloo_bench alternated with a cache line's
//! round trip between the vCPUs probed before each pair (near about 55 ns, far 320): near the
//! area took 50-67 us against messages' 68-91, far 207-217 against 81-90 (a rank's stores
//! into lines a far core read last call each wait for that core). With streaming stores into
//! the area it took 95 near and 85 far: no better than messages anywhere. No fixed limit wins
//! in both placements, so rank 0 paces it (`path_pace`, its own calls as one "peer"), as it
//! paces lending.
//!
//! Unlike lending's, these followers cannot wait in the area for rank 0's choice cheaply: to
//! take part in an exchange there a rank copies its input in first, which is wasted where
//! rank 0 then goes by messages (4 ranks, 256 KiB, near: 88.6 against 68.0 us), and far apart,
//! where that copy is slowest, it would also spoil rank 0's timing of messages. So rank 0
//! chooses one call ahead: its table in the area carries the way of the group's next call
//! ([`AreaCall::next_in_area`]), looks included, and every rank takes that way. A follower reads
//! it in the exchange where the call went through the area, and otherwise in rank 0's
//! announcement once its own messages are done (`Transport::shared_memory_peek`: by then rank
//! 0 has published, since it publishes before it sends). A follower that could not read it
//! keeps its last view.
//!
//! Rank 0 times the group's calls, not its own: its own may end long before the others' (far
//! apart at 256 KiB, its calls through the area took 152 us by the median while the slowest
//! rank's took about 220). So every rank publishes in its table how long its previous call
//! took, and rank 0 learns from the slowest of them, one call late: it reads the tables where
//! the call went through the area, and otherwise once its messages are done, as the
//! followers read its choice.
//!
//! Nothing here decides what data a rank gets: a rank whose input goes by messages says so in
//! the area, and the whole group then follows it (`algo::alltoall::through_shared_memory`),
//! so ranks that choose differently cost time, never correctness.

use std::sync::Mutex;
use std::time::Duration;

use crate::algo::alltoall::Heard;
use crate::path_pace::{Paced, PathPace};

/// Calls a look at the way rank 0 does not prefer lasts, of which only the last is timed: the
/// first calls the other way pay for the change. 4 ranks, 256 KiB, far apart, runs of 16
/// calls each way alternated, the slowest rank's time by the median: the first call by
/// messages after calls through the area 210 us, the ones after it 191-196; the first
/// through the area after messages 319, the second 253, from the third 213-228.
const LOOK_CALLS: u32 = 3;

/// A look switches to the other way when its timed call took under this fraction of the
/// preferred way's time. Higher than for the rings against by reference (`path_pace`): the
/// two ways' times differ less here in either placement (near, the area 50-67 us against
/// messages' 68-91; far apart, messages 81-90 against 207-217).
const SWITCH_BELOW: f64 = 0.85;

/// How one all_to_all's input goes, as [`AreaPace::begin`] chose it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct AreaCall {
    /// The input's bytes.
    len: usize,
    /// Whether the input lies in the paced band (over the fixed limit, within what the area
    /// holds).
    in_band: bool,
    /// Whether it goes to the area.
    inline: bool,
    /// On rank 0, whether this call is part of a look at the way it does not prefer.
    look: bool,
    /// Whether this call is the look's last, the one timed.
    timed_look: bool,
    /// The largest input that goes to the area on this call: the band's top where `inline`,
    /// else the fixed limit.
    pub(crate) max_input: usize,
    /// What rank 0 publishes as the way of the group's next call (others publish false).
    pub(crate) next_in_area: bool,
    /// What this rank publishes as its previous call's time.
    pub(crate) last_took: Duration,
}

/// The group's pace of the all_to_all area band, one per rank: rank 0's learning, or a
/// follower's memory of rank 0's choice.
#[derive(Debug)]
pub(crate) struct AreaPace {
    /// Inputs up to this many bytes go to the area whatever the pace.
    fixed: usize,
    /// Inputs over `fixed` and up to this many bytes are paced.
    top: usize,
    /// The other ranks of the group.
    peers: usize,
    state: Mutex<State>,
}

#[derive(Debug)]
struct State {
    /// Rank 0's learning (true: the area); `None` on the others.
    pace: Option<PathPace>,
    /// The way of this rank's next call: on rank 0 what it published last, on the others
    /// what they read of it. Every rank starts in the area.
    next_in_area: bool,
    /// On rank 0, whether its next call is part of a look, and its last.
    next_is_look: (bool, bool),
    /// On rank 0, the calls of the look under way after the next.
    look_left: u32,
    /// This rank's previous call's time.
    last_took: Duration,
    /// On rank 0, its previous call and whether it went through the area, to time once the
    /// others' times for it are heard.
    previous: Option<(AreaCall, bool)>,
}

impl AreaPace {
    /// The pace of rank `rank` of `world` for inputs over `fixed` bytes and up to `top`.
    pub(crate) fn new(rank: usize, world: usize, fixed: usize, top: usize) -> Self {
        AreaPace {
            fixed,
            top,
            peers: world.saturating_sub(1),
            state: Mutex::new(State {
                pace: (rank == 0).then(|| {
                    PathPace::with_min_bytes(1, fixed.saturating_add(1))
                        .switching_below(SWITCH_BELOW)
                }),
                next_in_area: true,
                next_is_look: (false, false),
                look_left: 0,
                last_took: Duration::ZERO,
                previous: None,
            }),
        }
    }

    /// How this rank's next all_to_all, with an input of `len` bytes, goes, and on rank 0 the
    /// way it publishes for the call after.
    pub(crate) fn begin(&self, len: usize) -> AreaCall {
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let (inline, (look, timed_look)) = (s.next_in_area, s.next_is_look);
        let mut next_in_area = false;
        if let Some(pace) = &s.pace {
            let current = pace.current(0, len, true);
            // A look is learnt from a call after its last: until then the calls go the
            // preferred way, rather than look again.
            let unlearnt = look || s.previous.is_some_and(|(c, _)| c.look);
            let (next, next_look) = if s.look_left > 0 {
                s.look_left -= 1;
                (!current, (true, s.look_left == 0))
            } else if unlearnt {
                (current, (false, false))
            } else if pace.choose(0, len, true) != current {
                s.look_left = LOOK_CALLS - 1;
                (!current, (true, LOOK_CALLS == 1))
            } else {
                (current, (false, false))
            };
            next_in_area = next;
            s.next_in_area = next;
            s.next_is_look = next_look;
        }
        let in_band = len > self.fixed && len <= self.top;
        AreaCall {
            len,
            in_band,
            inline,
            look,
            timed_look,
            max_input: if inline { self.top } else { self.fixed },
            next_in_area,
            last_took: s.last_took,
        }
    }

    /// Learns from a call `begin` chose as `call`, which succeeded in `took` on this rank,
    /// through the area (`through_area`) or by messages, and what this rank `heard` of the
    /// others' tables: a follower rank 0's choice of the next call's way, rank 0 the others'
    /// times of the call before, which it learns from with its own.
    pub(crate) fn end(&self, call: AreaCall, through_area: bool, heard: Heard, took: Duration) {
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let mine_before = std::mem::replace(&mut s.last_took, took);
        let previous = match s.pace {
            Some(_) => s.previous.replace((call, through_area)),
            None => None,
        };
        let Some(pace) = &mut s.pace else {
            if let Some(next) = heard.rank_zero_next_in_area {
                s.next_in_area = next;
            }
            return;
        };
        let Some((call, through_area)) = previous else {
            return;
        };
        if heard.ranks < self.peers {
            return;
        }
        // Only a call that went the way rank 0 chose times that way (not one it took to the
        // area while a follower went by messages); of a look, only its last call; off a look,
        // only the preferred way (the call right after a look that switched went the old way).
        let chosen = call.in_band && through_area == call.inline;
        let preferred = !call.look && call.inline == pace.current(0, call.len, true);
        if chosen && (call.timed_look || preferred) {
            pace.record(&Paced {
                peer: 0,
                len: call.len,
                rule_by_ref: true,
                by_ref: through_area,
                took: Some(mine_before.max(heard.slowest_last)),
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const FIXED: usize = 32 << 10;
    const TOP: usize = 1 << 20;
    const LEN: usize = 256 << 10;

    /// Runs `calls` all_to_alls of `LEN` bytes on a group of rank 0 and one follower, the area
    /// taking `area_us` and messages `msgs_us`, the follower reading rank 0's choice in each
    /// call where `reads`; returns the calls that went through the area and those on which
    /// the follower copied its input there in vain.
    fn run(
        group: &(AreaPace, AreaPace),
        calls: usize,
        area_us: u64,
        msgs_us: u64,
        reads: bool,
    ) -> (usize, usize) {
        let (zero, follower) = group;
        let (mut area, mut vain) = (0, 0);
        for _ in 0..calls {
            let (a, b) = (zero.begin(LEN), follower.begin(LEN));
            let through = a.inline && b.inline;
            area += usize::from(through);
            vain += usize::from(b.inline && !through);
            let took = Duration::from_micros(if through { area_us } else { msgs_us });
            let heard = |from: &AreaCall, next| Heard {
                rank_zero_next_in_area: next,
                slowest_last: from.last_took,
                ranks: 1,
            };
            zero.end(a, through, heard(&b, None), took);
            let next = reads.then_some(a.next_in_area);
            follower.end(b, through, heard(&a, next), took);
        }
        (area, vain)
    }

    fn group() -> (AreaPace, AreaPace) {
        (
            AreaPace::new(0, 2, FIXED, TOP),
            AreaPace::new(1, 2, FIXED, TOP),
        )
    }

    fn prefers_area(p: &AreaPace) -> Option<bool> {
        let s = p.state.lock().unwrap();
        s.pace.as_ref().map(|pace| pace.current(0, LEN, true))
    }

    #[test]
    fn every_rank_starts_in_the_area_and_the_band_follows_the_limits() {
        let (zero, follower) = group();
        for p in [&zero, &follower] {
            let first = p.begin(LEN);
            assert!(first.inline && first.in_band);
            assert_eq!(first.max_input, TOP);
            assert!(!p.begin(FIXED).in_band);
            assert!(!p.begin(TOP + 1).in_band);
        }
    }

    #[test]
    fn near_the_group_stays_in_the_area_and_looks_at_messages_together() {
        let g = group();
        // Near: the area 50 us, messages 87.
        let (area, vain) = run(&g, 320, 50, 87, true);
        // PathPace's looks after 4, 8, 16, 32, 64, 64... calls, each three calls long and
        // learnt a call after its last: 6-9 looks, 18-27 calls by messages in 320.
        assert!(
            (320 - 27..=320 - 15).contains(&area),
            "{area} of 320 in the area"
        );
        assert_eq!(vain, 0, "the follower copied in vain");
        assert_eq!(prefers_area(&g.0), Some(true));
    }

    #[test]
    fn far_apart_the_group_goes_by_messages_within_a_few_calls_and_back_near() {
        let g = group();
        run(&g, 64, 50, 87, true);
        // Far apart: the area 210 us, messages 90.
        let (area, vain) = run(&g, 320, 210, 90, true);
        // Two slow calls bring a look forward, which switches once learnt, a call after its
        // three: about seven calls. Then looks at the area after 4, 8, 16, 32, 64, 64...
        // calls, three calls each: about 24.
        assert!(area <= 36, "{area} of 320 in the area");
        assert_eq!(vain, 0, "the follower copied in vain");
        assert_eq!(prefers_area(&g.0), Some(false), "rank 0 prefers messages");
        // Back near: the next look at the area switches, within 65 calls.
        run(&g, 66, 50, 87, true);
        let (area, _) = run(&g, 32, 50, 87, true);
        // Then looks at messages after 4 and 8 calls again, three calls each.
        assert!(area >= 24, "{area} of 32 in the area once near again");
    }

    #[test]
    fn a_follower_that_reads_nothing_keeps_its_last_view_and_data_stays_whole() {
        let g = group();
        // The follower never reads rank 0's choice: it stays in the area while rank 0 moves
        // to messages far apart, so the calls go by messages (one announcement suffices)
        // with the follower's copies in vain, and rank 0 times no call it chose the area for.
        run(&g, 64, 50, 87, true);
        let (area, _) = run(&g, 64, 210, 90, false);
        assert!(area <= 16, "{area} of 64 in the area");
        assert_eq!(prefers_area(&g.0), Some(false));
    }
}
