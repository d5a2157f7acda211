//! Which way a large message to a peer on this host travels, learnt from how fast each way
//! went: through the shared-memory rings (the sender copies in, the receiver out, on two
//! cores at once) or by reference (the receiver alone copies, `process_vm_readv`).
//!
//! Why: a virtual machine's host places its vCPUs near each other (sharing a cache) or far
//! apart, and moves them within seconds (`cargo xtask placement` times it: about 55 ns for a
//! cache line's round trip near, 330 far). The rings pass every line from core to core, so
//! far apart they slow 7-14x; a copy by reference streams, and slows 5x at 1 MiB but at most
//! 1.1x from 16 MiB. 2 ranks,
//! broadcast from huge pages with each input rewritten before each call (`gloo_bench
//! --fresh 1`), us: the rings near 27 / 665 / 3968 at 1 / 16 / 64 MiB, far 378 / 6876 /
//! 27841; by reference 101 / 1190-1670 / 5041-6180 near, 541 / 1297 / 6181 far; Open MPI's
//! shared memory 80 / 950-1110 / 4350-5060 near, 287 / 1864-2028 / 5055-6910 far. No
//! fixed rule wins in both placements, so the sender watches: each frame already says how
//! its payload travels, and the sender alone picks, so each rank learns on its own, without
//! a word to its peers.
//!
//! The rule ([`PathPace`]): messages from twice the ring's size keep the way the fixed rule
//! (`SingleCopyRule`) picks until the other way has been tried and found faster. Every so
//! many messages (4 at first, doubling to 64 while the other way stays slower) one goes the
//! other way; one that takes under [`SWITCH_BELOW`] of the current way's pace (the median of
//! its last three messages' times per byte) makes it the current way. Two messages in a row
//! on the current way slow enough that the other way's pace would have switched bring the
//! next look forward to the next message, so that a move far apart is followed within a few
//! messages, and a move back near within 65. A look is one message: a slow one (held up by
//! something else) only puts the next look off, and a lucky one switches until the next look,
//! 4 messages on, switches back.
//!
//! A message's time is the sender's, from the step's start until the message is written and,
//! by reference, acknowledged, per byte of the whole message. Through the rings the last
//! ring-full is still unread when the sender is done, and the next step's time pays for it
//! when steps follow each other. With time between steps nobody pays for it, and the rings
//! are timed up to a ring-full short: a bias towards the rings, the fixed rule's way for the
//! ops timed, and only messages of at least two ring-fulls are timed, so that it is at most
//! half. Only steps that send alone are timed (see the engine): in an exchange, a send's time
//! hangs on the peer's own sends.
//!
//! The same rule, kept by rank 0 over its own calls (one "peer"), picks which all_to_alls,
//! all_gathers and all_reduces lend their inputs by reference through the group area
//! (`algo::lent`, `backend::LendPace`): its choice carries the group, which follows it in the
//! area; and which all_to_alls over the group area's fixed limit go through it
//! (`backend::area_pace`).

use std::time::Duration;

/// A look at the other way switches to it when it took less than this fraction of the
/// current way's time per byte: near even, the current way stays. Near, by reference takes
/// about 1.6x the rings' time; far apart the rings take 2x by reference's at 4 MiB, 4-5x from
/// 16 MiB.
const SWITCH_BELOW: f64 = 0.7;

/// Messages on the current way before the first look at the other, and after a switch.
const FIRST_LOOK: u32 = 4;

/// The most messages between two looks, reached by doubling while the other way stays slower:
/// a look at the rings far apart costs up to 8x one message, once in 64.
const LAST_LOOK: u32 = 64;

/// Size classes kept apart per peer (each a power of two from the smallest timed size; the
/// last takes everything larger): a way's fixed costs weigh differently on 4 and 256 MiB.
const CLASSES: usize = 8;

/// The last times per byte (nanoseconds) of one way, whose median is taken as its pace: one
/// message held up by something else (a peer late to the step, a core taken away for a
/// while) does not move the median of three.
#[derive(Clone, Copy, Debug, Default)]
struct Recent {
    ns: [f64; 3],
    len: usize,
    next: usize,
}

impl Recent {
    fn push(&mut self, ns: f64) {
        self.ns[self.next] = ns;
        self.next = (self.next + 1) % self.ns.len();
        self.len = (self.len + 1).min(self.ns.len());
    }

    /// Forgets all but `ns`: a look's time stands alone, since the way's older times may be
    /// from another placement.
    fn only(&mut self, ns: f64) {
        *self = Recent::default();
        self.push(ns);
    }

    /// The median of the times kept (of two, their mean).
    fn pace(&self) -> Option<f64> {
        let mut kept = self.ns;
        let kept = &mut kept[..self.len];
        kept.sort_by(f64::total_cmp);
        match kept {
            [] => None,
            [one] => Some(*one),
            [a, b] => Some((*a + *b) / 2.0),
            [_, mid, ..] => Some(*mid),
        }
    }

    /// Whether the last two times are both over `bound`.
    fn last_two_over(&self, bound: f64) -> bool {
        let n = self.ns.len();
        self.len >= 2
            && [1, 2]
                .iter()
                .all(|back| self.ns[(self.next + n - back) % n] > bound)
    }
}

/// One size class's learning about one peer.
#[derive(Clone, Copy, Debug, Default)]
struct ClassPace {
    /// The way messages go now (true: by reference); `None` until a look switched, which
    /// leaves the fixed rule's choice.
    by_ref: Option<bool>,
    /// Each way's recent times (index 1 by reference): the current way's last messages, the
    /// other's last look (or its last messages while it was current).
    recent: [Recent; 2],
    /// Messages on the current way until the next look at the other.
    until_look: u32,
    /// Messages between looks now.
    look_every: u32,
}

/// What each rank has learnt of each way's pace to each peer, by size class.
#[derive(Debug)]
pub(crate) struct PathPace {
    /// The smallest message timed: twice a ring's data bytes.
    min_bytes: usize,
    /// A look switches when it took under this fraction of the current way's time:
    /// [`SWITCH_BELOW`] unless [`PathPace::switching_below`] says otherwise.
    switch_below: f64,
    /// Indexed by peer, then size class; a peer's classes are made at its first timed
    /// message, so that a large group whose ranks are mostly on other hosts costs a pointer
    /// for each of those.
    classes: Vec<Option<Box<[ClassPace; CLASSES]>>>,
}

/// What a step sends one peer, whose way [`PathPace`] chose, until its time is recorded: a
/// message, or a chain's chunks, counted as one.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Paced {
    /// The peer it goes to.
    pub(crate) peer: usize,
    /// Its bytes.
    pub(crate) len: usize,
    /// The fixed rule's way for it.
    pub(crate) rule_by_ref: bool,
    /// The way it went.
    pub(crate) by_ref: bool,
    /// How long after the step's start all of it was written and, by reference,
    /// acknowledged.
    pub(crate) took: Option<Duration>,
}

impl PathPace {
    /// Learning for `peers` peers whose rings hold `ring_bytes` data bytes each.
    pub(crate) fn new(peers: usize, ring_bytes: usize) -> Self {
        PathPace::with_min_bytes(peers, ring_bytes.saturating_mul(2))
    }

    /// Whether a message of `len` bytes is timed and its way chosen here.
    pub(crate) fn times(&self, len: usize) -> bool {
        len >= self.min_bytes
    }

    /// Learning for `peers` peers, timing messages from `min_bytes`.
    pub(crate) fn with_min_bytes(peers: usize, min_bytes: usize) -> Self {
        PathPace {
            min_bytes: min_bytes.max(1),
            switch_below: SWITCH_BELOW,
            classes: vec![None; peers],
        }
    }

    /// This learning with looks that switch under `fraction` of the current way's time
    /// rather than [`SWITCH_BELOW`]: for ways whose times differ by less in either placement.
    pub(crate) fn switching_below(self, fraction: f64) -> Self {
        PathPace {
            switch_below: fraction,
            ..self
        }
    }

    fn class(&self, len: usize) -> usize {
        let doublings = (len / self.min_bytes).max(1).ilog2() as usize;
        doublings.min(CLASSES - 1)
    }

    fn at(&self, peer: usize, len: usize) -> Option<&ClassPace> {
        let classes = self.classes.get(peer)?.as_deref()?;
        Some(&classes[self.class(len)])
    }

    /// The way (true: by reference) messages of `len` bytes to `peer` go now, which the fixed
    /// rule sends by reference when `rule_by_ref`, looks aside: [`PathPace::choose`] less the
    /// look.
    pub(crate) fn current(&self, peer: usize, len: usize, rule_by_ref: bool) -> bool {
        self.at(peer, len)
            .filter(|_| self.times(len))
            .and_then(|c| c.by_ref)
            .unwrap_or(rule_by_ref)
    }

    /// The way (true: by reference) of the next message of `len` bytes to `peer`, which the
    /// fixed rule sends by reference when `rule_by_ref`: the current way, or the other when a
    /// look is due. Changes nothing: [`PathPace::record`] counts the message.
    pub(crate) fn choose(&self, peer: usize, len: usize, rule_by_ref: bool) -> bool {
        let Some(c) = self.at(peer, len).filter(|_| self.times(len)) else {
            return rule_by_ref;
        };
        let current = c.by_ref.unwrap_or(rule_by_ref);
        if c.look_every != 0 && c.until_look == 0 {
            !current
        } else {
            current
        }
    }

    /// Learns from message `m`, sent whole in a step that succeeded.
    pub(crate) fn record(&mut self, m: &Paced) {
        let Some(took) = m.took else { return };
        if !self.times(m.len) {
            return;
        }
        let ns = took.as_nanos() as f64 / m.len as f64;
        let class = self.class(m.len);
        let Some(slot) = self.classes.get_mut(m.peer) else {
            return;
        };
        let c = &mut slot.get_or_insert_with(Box::default)[class];
        if c.look_every == 0 {
            c.look_every = FIRST_LOOK;
            c.until_look = FIRST_LOOK;
        }
        let current = c.by_ref.unwrap_or(m.rule_by_ref);
        let (mine, other) = (usize::from(m.by_ref), usize::from(!m.by_ref));
        if m.by_ref == current {
            c.recent[mine].push(ns);
            c.until_look = c.until_look.saturating_sub(1);
            // The last two slower than the other way's pace by the margin that would switch:
            // the placement may have moved, look again at once.
            let other_pace = c.recent[other].pace();
            if other_pace.is_some_and(|o| c.recent[mine].last_two_over(o / self.switch_below)) {
                c.until_look = 0;
            }
            return;
        }
        // A look at the other way.
        c.recent[mine].only(ns);
        let faster = c.recent[other]
            .pace()
            .is_none_or(|cur| ns < self.switch_below * cur);
        if faster {
            c.by_ref = Some(m.by_ref);
            c.look_every = FIRST_LOOK;
        } else {
            c.look_every = (c.look_every * 2).min(LAST_LOOK);
        }
        c.until_look = c.look_every;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const RING: usize = 2 << 20;
    const LEN: usize = 16 << 20;

    /// Sends `calls` messages of `LEN` to peer 1, each taking `ring_us` through the rings or
    /// `ref_us` by reference; returns how many went by reference.
    fn run(p: &mut PathPace, calls: usize, rule: bool, ring_us: u64, ref_us: u64) -> usize {
        let mut by_ref = 0;
        for _ in 0..calls {
            let way = p.choose(1, LEN, rule);
            by_ref += usize::from(way);
            let us = if way { ref_us } else { ring_us };
            p.record(&Paced {
                peer: 1,
                len: LEN,
                rule_by_ref: rule,
                by_ref: way,
                took: Some(Duration::from_micros(us)),
            });
        }
        by_ref
    }

    #[test]
    fn small_messages_keep_the_fixed_rule() {
        let p = PathPace::new(2, RING);
        assert!(!p.times(2 * RING - 1));
        assert!(p.times(2 * RING));
        assert!(p.choose(1, RING, true));
        assert!(!p.choose(1, RING, false));
    }

    #[test]
    fn rings_near_stay_with_rare_looks_by_reference() {
        let mut p = PathPace::new(2, RING);
        // Near: rings 665 us, by reference 1190.
        let by_ref = run(&mut p, 400, false, 665, 1190);
        // Looks after 4, 8, 16, 32, 64, 64... messages: about 9 in 400.
        assert!((5..=12).contains(&by_ref), "{by_ref} looks in 400");
        assert!(!p.choose(1, LEN, false));
    }

    #[test]
    fn a_move_far_apart_switches_on_the_third_message_and_back_near_within_65() {
        let mut p = PathPace::new(2, RING);
        run(&mut p, 100, false, 665, 1190);
        // Far apart: the rings take 6876 us, by reference 1297. Two slow messages bring a look
        // forward, which switches.
        let mut ways = Vec::new();
        for _ in 0..4 {
            let way = p.choose(1, LEN, false);
            ways.push(way);
            run_one(&mut p, way, 6876, 1297);
        }
        assert_eq!(
            ways,
            [false, false, true, true],
            "switched on the third message"
        );
        // 100 messages far apart: the rings are looked at ever more rarely.
        let on_rings = 100 - run(&mut p, 100, false, 6876, 1297);
        assert!(on_rings <= 5, "{on_rings} looks at the rings in 100");
        // Near again: back on the rings within 65 messages.
        let mut back = None;
        for i in 0..65 {
            let way = p.choose(1, LEN, false);
            run_one(&mut p, way, 665, 1297);
            if !way {
                back = Some(i);
                break;
            }
        }
        assert!(
            back.is_some(),
            "still by reference 65 messages after moving near"
        );
        assert_eq!(run(&mut p, 3, false, 665, 1297), 0, "stays on the rings");
    }

    fn run_one(p: &mut PathPace, way: bool, ring_us: u64, ref_us: u64) {
        p.record(&Paced {
            peer: 1,
            len: LEN,
            rule_by_ref: false,
            by_ref: way,
            took: Some(Duration::from_micros(if way { ref_us } else { ring_us })),
        });
    }

    #[test]
    fn one_slow_message_neither_switches_nor_brings_a_look_forward() {
        let mut p = PathPace::new(2, RING);
        run(&mut p, 100, false, 665, 1190);
        let looks_before = run(&mut p, 64, false, 665, 1190);
        // Every 8th message held up 4x (its peer late, a core taken away).
        let mut looks = 0;
        for i in 0..64 {
            let way = p.choose(1, LEN, false);
            looks += usize::from(way);
            let ring_us = if i % 8 == 0 { 2660 } else { 665 };
            run_one(&mut p, way, ring_us, 1190);
        }
        assert!(
            looks <= looks_before.max(1),
            "{looks} looks against {looks_before}"
        );
        assert!(!p.choose(1, LEN, false), "still on the rings");
    }

    #[test]
    fn a_way_near_even_does_not_switch() {
        let mut p = PathPace::new(2, RING);
        // By reference 10% faster: under the switch margin.
        let (ring_us, ref_us) = (1000, 900);
        let by_ref = run(&mut p, 200, false, ring_us, ref_us);
        assert!(by_ref <= 8, "{by_ref} of 200 by reference");
    }

    #[test]
    fn peers_and_size_classes_learn_apart() {
        let mut p = PathPace::new(3, RING);
        run(&mut p, 20, false, 6876, 1297);
        assert!(p.choose(1, LEN, false), "peer 1 learnt by reference");
        assert!(!p.choose(2, LEN, false), "peer 2 has not");
        assert!(!p.choose(1, 4 * LEN, false), "nor has a larger size class");
        assert!(!p.choose(7, LEN, false), "an unknown peer keeps the rule");
    }

    #[test]
    fn an_unfinished_message_teaches_nothing() {
        let mut p = PathPace::new(2, RING);
        for _ in 0..10 {
            p.record(&Paced {
                peer: 1,
                len: LEN,
                rule_by_ref: false,
                by_ref: false,
                took: None,
            });
        }
        assert!(
            !p.choose(1, LEN, false),
            "no look is due without a timed message"
        );
    }
}
