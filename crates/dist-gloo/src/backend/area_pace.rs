//! Which all_to_alls between the group area's fixed limit and what it holds go through it,
//! chosen by rank 0 from how fast its calls went each way and followed by the others.
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
//! Unlike lending, a follower cannot wait for rank 0's choice cheaply: to take part in an
//! exchange through the area it must copy its input there first, and where rank 0 then goes
//! by messages that copy is wasted (88.6 against 68.0 us near, 4 ranks, 256 KiB). So the
//! followers follow rank 0's last published choice instead, which its table in the area
//! carries ([`AreaPace::begin`]'s `area_preferred`), and every rank goes to the area on the
//! same scheduled calls ([`LOOK_EVERY`]), the only ones on which rank 0 may look at the other
//! way: a look at the area needs every rank there. On the call after a look rank 0 publishes
//! what it learnt, and a follower that found rank 0 in the area on the look comes to the
//! area again to read it. Near, every rank stays in the area and sees each publication;
//! far, the followers copy in vain on two calls of [`LOOK_EVERY`] at most.
//!
//! Nothing here decides what data a rank gets: a rank whose input goes by messages says so in
//! the area, and the whole group then follows it (`algo::alltoall::through_shared_memory`),
//! so ranks that choose differently cost time, never correctness.

use std::sync::Mutex;
use std::time::Duration;

use crate::algo::alltoall::RankZeroSaid;
use crate::path_pace::{Paced, PathPace};

/// Calls of all_to_all (counted alike on every rank) between two on which every rank goes to
/// the area and rank 0 may look at the way it does not take: far apart, two of every
/// `LOOK_EVERY` calls may cost the followers a copy in vain (about a third of a call each at
/// 256 KiB, so 4% in all), and a move near is followed within `LOOK_EVERY` calls.
pub(crate) const LOOK_EVERY: u64 = 16;

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
    /// The largest input that goes to the area on this call: the band's top where `inline`,
    /// else the fixed limit.
    pub(crate) max_input: usize,
    /// What rank 0 publishes as its choice for the calls to come (others publish false).
    pub(crate) area_preferred: bool,
}

/// The group's pace of the all_to_all area band, one per rank: rank 0's learning, or a
/// follower's memory of rank 0's last choice.
#[derive(Debug)]
pub(crate) struct AreaPace {
    /// Inputs up to this many bytes go to the area whatever the pace.
    fixed: usize,
    /// Inputs over `fixed` and up to this many bytes are paced.
    top: usize,
    state: Mutex<State>,
}

#[derive(Debug)]
struct State {
    /// all_to_all calls so far.
    calls: u64,
    /// Rank 0's learning (true: the area); `None` on the others.
    pace: Option<PathPace>,
    /// A follower's view of rank 0's choice: its last published preference, or that it went
    /// to the area on a look (so that the call after, which publishes the look's outcome, is
    /// read in the area too).
    follow_area: bool,
}

impl AreaPace {
    /// The pace of rank `rank` for inputs over `fixed` bytes and up to `top`.
    pub(crate) fn new(rank: usize, fixed: usize, top: usize) -> Self {
        AreaPace {
            fixed,
            top,
            state: Mutex::new(State {
                calls: 0,
                pace: (rank == 0).then(|| PathPace::with_min_bytes(1, fixed.saturating_add(1))),
                follow_area: true,
            }),
        }
    }

    /// How this rank's next all_to_all, with an input of `len` bytes, goes; every rank calls
    /// this once per all_to_all, so that the calls are counted alike.
    pub(crate) fn begin(&self, len: usize) -> AreaCall {
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let call = s.calls;
        s.calls += 1;
        let in_band = len > self.fixed && len <= self.top;
        let scheduled = call.is_multiple_of(LOOK_EVERY);
        match &s.pace {
            Some(pace) => {
                let current = pace.current(0, len, true);
                let wanted = pace.choose(0, len, true);
                // A look waits for the next scheduled call, when every rank is in the area.
                let inline = if scheduled { wanted } else { current };
                self.call(len, in_band, inline, current)
            }
            None => self.call(len, in_band, scheduled || s.follow_area, false),
        }
    }

    fn call(&self, len: usize, in_band: bool, inline: bool, area_preferred: bool) -> AreaCall {
        AreaCall {
            len,
            in_band,
            inline: !in_band || inline,
            max_input: if inline { self.top } else { self.fixed },
            area_preferred,
        }
    }

    /// Learns from a call `begin` chose as `call`, which succeeded in `took`: through the area
    /// (`through_area`) or by messages, and, where this rank read it, what rank 0 published.
    pub(crate) fn end(
        &self,
        call: AreaCall,
        through_area: bool,
        rank_zero: Option<RankZeroSaid>,
        took: Duration,
    ) {
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(pace) = &mut s.pace {
            // Only a call that went the way rank 0 chose times that way: one it took to the
            // area while a follower went by messages times neither.
            if call.in_band && through_area == call.inline {
                pace.record(&Paced {
                    peer: 0,
                    len: call.len,
                    rule_by_ref: true,
                    by_ref: through_area,
                    took: Some(took),
                });
            }
        } else if let Some(said) = rank_zero {
            s.follow_area = said.area_preferred || said.inline;
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
    /// taking `area_us` and messages `msgs_us`; returns the calls that went through the area
    /// and those on which the follower copied its input there in vain.
    fn run(
        zero: &AreaPace,
        follower: &AreaPace,
        calls: usize,
        area_us: u64,
        msgs_us: u64,
    ) -> (usize, usize) {
        let (mut area, mut vain) = (0, 0);
        for _ in 0..calls {
            let (a, b) = (zero.begin(LEN), follower.begin(LEN));
            let through = a.inline && b.inline;
            area += usize::from(through);
            vain += usize::from(b.inline && !through);
            let took = Duration::from_micros(if through { area_us } else { msgs_us });
            let said = RankZeroSaid {
                inline: a.inline,
                area_preferred: a.area_preferred,
            };
            // The follower reads rank 0's publication only where it went to the area.
            zero.end(a, through, None, took);
            follower.end(b, through, b.inline.then_some(said), took);
        }
        (area, vain)
    }

    fn pair() -> (AreaPace, AreaPace) {
        (AreaPace::new(0, FIXED, TOP), AreaPace::new(1, FIXED, TOP))
    }

    #[test]
    fn inputs_outside_the_band_keep_the_fixed_rule() {
        let (zero, follower) = pair();
        for p in [&zero, &follower] {
            assert!(p.begin(FIXED).inline, "under the fixed limit: the area");
            assert!(
                p.begin(TOP + 1).inline,
                "over the band: the area's own check refuses it"
            );
            assert!(!p.begin(TOP + 1).in_band);
        }
    }

    #[test]
    fn near_the_group_stays_in_the_area_and_looks_at_messages_on_scheduled_calls() {
        let (zero, follower) = pair();
        // Near: the area 50 us, messages 87.
        let (area, vain) = run(&zero, &follower, 320, 50, 87);
        // PathPace's looks come due after 4, 8, 16, 32, 64 calls, each taken at the next
        // scheduled call: 5-7 looks by messages in 320 calls.
        assert!(
            (320 - 8..=320 - 4).contains(&area),
            "{area} of 320 in the area"
        );
        // The follower went to the area every time: in vain only on rank 0's looks.
        assert_eq!(area + vain, 320, "the follower went by messages near");
    }

    #[test]
    fn far_apart_the_group_goes_by_messages_and_the_follower_rarely_copies_in_vain() {
        let (zero, follower) = pair();
        run(&zero, &follower, 64, 50, 87);
        // Far apart: the area 210 us, messages 90.
        let (area, vain) = run(&zero, &follower, 320, 210, 90);
        // Rank 0 switches within two scheduled calls (two slow calls bring its look forward),
        // then looks at the area on one scheduled call of four at most.
        assert!(area <= 24, "{area} of 320 in the area");
        let scheduled = 320 / LOOK_EVERY as usize;
        assert!(vain <= 2 * scheduled, "{vain} copies in vain");
        let prefers = |p: &AreaPace| {
            let s = p.state.lock().unwrap();
            s.pace.as_ref().map(|pace| pace.current(0, LEN, true))
        };
        assert_eq!(
            prefers(&zero),
            Some(false),
            "rank 0 prefers messages far apart"
        );
        // And back near: both go to the area again within a few scheduled calls.
        run(&zero, &follower, 160, 50, 87);
        let (area, _) = run(&zero, &follower, 32, 50, 87);
        assert!(area >= 28, "{area} of 32 in the area once near again");
    }
}
