//! Pipeline schedules without any I/O: the generators against hand-written reference orders,
//! the simulator against the closed-form bubble and memory formulas, and the validator on
//! malformed lists.

mod common;

use dist_parallel::Error;
use dist_parallel::pipeline::{Action, Schedule, StageCost};

/// F = B per stage, no split weight gradient: the setting of the textbook bubble formulas.
const EQUAL: StageCost = StageCost {
    forward: 1.0,
    backward: 1.0,
    weight: 0.0,
};

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() < 1e-12
}

#[test]
fn gpipe_and_1f1b_bubble_is_p_minus_1_over_m_plus_p_minus_1() {
    for p in 1..=8 {
        for m in [1, 2, 3, 4, 5, 8, 16, 32] {
            let want = (p - 1) as f64 / (m + p - 1) as f64;
            for s in [
                Schedule::gpipe(p, m).unwrap(),
                Schedule::one_f_one_b(p, m).unwrap(),
            ] {
                let r = s.simulate_uniform(EQUAL).unwrap();
                assert!(
                    close(r.bubble, want),
                    "{} p={p} m={m}: bubble {} != {want}",
                    s.name(),
                    r.bubble
                );
                // Every rank does m forwards and m backwards of one stage.
                assert!(r.busy.iter().all(|&b| close(b, 2.0 * m as f64)));
            }
        }
    }
}

#[test]
fn interleaved_bubble_is_p_minus_1_over_vm_plus_p_minus_1() {
    for p in [2, 3, 4, 8] {
        for v in [2, 3, 4] {
            for m in [p, 2 * p, 4 * p] {
                let s = Schedule::interleaved_1f1b(p, v, m).unwrap();
                assert_eq!(s.num_stages(), p * v);
                // A stage of the interleaved model is 1/v of a plain stage; the formula is
                // independent of the unit, so take 1 per virtual stage.
                let r = s.simulate_uniform(EQUAL).unwrap();
                let want = (p - 1) as f64 / (v * m + p - 1) as f64;
                assert!(
                    close(r.bubble, want),
                    "p={p} v={v} m={m}: bubble {} != {want}",
                    r.bubble
                );
                // And with backward twice the forward, as in the reference timeline.
                let r = s.simulate_uniform(StageCost::new(1.0, 2.0, 0.0)).unwrap();
                assert!(
                    close(r.bubble, want),
                    "p={p} v={v} m={m}, B=2F: {}",
                    r.bubble
                );
            }
        }
    }
}

#[test]
fn zero_bubble_h1_beats_1f1b_and_matches_the_paper() {
    // F = I = W (B = I + W): the paper's ZB-H1 bubble is (p-1)(T_F + T_B - T_W), its T_B
    // being our input half I, a third of 1F1B's (p-1)(F + I + W).
    let cost = StageCost::new(1.0, 2.0, 1.0);
    for p in 2..=8 {
        for m in [p, p + 1, 2 * p, 4 * p] {
            let zb = Schedule::zero_bubble_h1(p, m)
                .unwrap()
                .simulate_uniform(cost)
                .unwrap();
            let ofob = Schedule::one_f_one_b(p, m)
                .unwrap()
                .simulate_uniform(cost)
                .unwrap();
            assert!(
                zb.bubble < ofob.bubble,
                "p={p} m={m}: {} vs {}",
                zb.bubble,
                ofob.bubble
            );
            assert!(close(ofob.makespan, 3.0 * (m + p - 1) as f64));
            assert!(
                close(zb.makespan, 3.0 * m as f64 + (p - 1) as f64),
                "p={p} m={m}: ZB-H1 makespan {}",
                zb.makespan
            );
            // Same memory as 1F1B.
            assert_eq!(zb.peak_activations, ofob.peak_activations);
        }
    }
}

#[test]
fn peak_activations_1f1b_at_most_p_gpipe_m() {
    for p in 1..=8 {
        for m in [1, 2, 4, 8, 16] {
            let g = Schedule::gpipe(p, m)
                .unwrap()
                .simulate_uniform(EQUAL)
                .unwrap();
            assert_eq!(g.peak_activations, vec![m; p], "gpipe p={p} m={m}");
            let o = Schedule::one_f_one_b(p, m)
                .unwrap()
                .simulate_uniform(EQUAL)
                .unwrap();
            let want: Vec<usize> = (0..p).map(|r| (p - r).min(m)).collect();
            assert_eq!(o.peak_activations, want, "1f1b p={p} m={m}");
            assert!(o.max_peak_activations() <= p);
        }
    }
}

/// The orders of the reference fact sheet (`parallel.md`, p = 2, m = 4), written out by hand.
#[test]
fn generators_reproduce_the_reference_timelines() {
    let ofob = Schedule::parse(
        "ref",
        vec![0, 1],
        4,
        "0F0 0F1 0B0 0F2 0B1 0F3 0B2 0B3\n1F0 1B0 1F1 1B1 1F2 1B2 1F3 1B3",
    )
    .unwrap();
    let generated = Schedule::one_f_one_b(2, 4).unwrap();
    for r in 0..2 {
        assert_eq!(generated.actions(r), ofob.actions(r));
    }
    let r = generated
        .simulate_uniform(StageCost::new(1.0, 2.0, 0.0))
        .unwrap();
    assert!(close(r.makespan, 15.0));

    let zb = Schedule::parse(
        "ref",
        vec![0, 1],
        4,
        "0F0 0F1 0I0 0W0 0F2 0I1 0W1 0F3 0I2 0W2 0I3 0W3\n\
         1F0 1I0 1F1 1I1 1W0 1F2 1I2 1W1 1F3 1I3 1W2 1W3",
    )
    .unwrap();
    let generated = Schedule::zero_bubble_h1(2, 4).unwrap();
    for r in 0..2 {
        assert_eq!(generated.actions(r), zb.actions(r));
    }
    let r = generated
        .simulate_uniform(StageCost::new(1.0, 2.0, 1.0))
        .unwrap();
    assert!(close(r.makespan, 13.0));

    // Interleaved, v = 2: rank 0 holds stages 0 and 2 (F/f in the sheet), rank 1 stages 1, 3.
    let il = Schedule::parse(
        "ref",
        vec![0, 1, 0, 1],
        4,
        "0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1 2B2 2B3 0B2 0B3\n\
         1F0 1F1 3F0 3B0 3F1 3B1 1F2 1B0 1F3 1B1 3F2 3B2 3F3 3B3 1B2 1B3",
    )
    .unwrap();
    let generated = Schedule::interleaved_1f1b(2, 2, 4).unwrap();
    for r in 0..2 {
        assert_eq!(generated.actions(r), il.actions(r), "rank {r}");
    }
    let r = generated
        .simulate_uniform(StageCost::new(1.0, 2.0, 0.0))
        .unwrap();
    assert!(close(r.makespan, 27.0));
}

#[test]
fn every_generator_validates_for_many_shapes() {
    for p in 1..=6 {
        for m in 1..=12 {
            Schedule::gpipe(p, m).unwrap();
            Schedule::one_f_one_b(p, m).unwrap();
            Schedule::zero_bubble_h1(p, m).unwrap();
            for v in 1..=3 {
                match Schedule::interleaved_1f1b(p, v, m) {
                    Ok(s) => {
                        let r = s.simulate_uniform(EQUAL).unwrap();
                        assert!(r.busy.iter().all(|&b| close(b, (2 * v * m) as f64)));
                    }
                    // Only sizes that do not split into equal rounds are refused.
                    Err(Error::ScheduleConfig { .. }) => assert!(!m.is_multiple_of((m / p).max(1))),
                    Err(e) => panic!("p={p} v={v} m={m}: {e}"),
                }
            }
        }
    }
}

fn invalid(r: Result<Schedule, Error>) -> (usize, usize, Action, String) {
    match r {
        Err(Error::InvalidSchedule {
            rank,
            position,
            action,
            reason,
        }) => (rank, position, action, reason),
        other => panic!("expected InvalidSchedule, got {other:?}"),
    }
}

#[test]
fn missing_backward_is_named() {
    let (rank, pos, action, reason) = invalid(Schedule::parse(
        "bad",
        vec![0, 1],
        2,
        "0F0 0F1 0B0\n1F0 1B0 1F1 1B1",
    ));
    assert_eq!((rank, pos), (0, 3));
    assert_eq!(action, Action::Backward { stage: 0, mb: 1 });
    assert!(reason.contains("missing"), "{reason}");
}

#[test]
fn backward_before_forward_is_named() {
    let (rank, pos, action, reason) = invalid(Schedule::parse(
        "bad",
        vec![0, 1],
        2,
        "0F0 0F1 0B0 0B1\n1F0 1B1 1B0 1F1",
    ));
    assert_eq!((rank, pos), (1, 1));
    assert_eq!(action, Action::Backward { stage: 1, mb: 1 });
    assert!(reason.contains("before its forward"), "{reason}");
}

#[test]
fn cross_rank_deadlock_is_named() {
    // Rank 1 wants micro-batch 1 first, which rank 0 only sends after 0B0, which needs 1B0.
    let (rank, pos, action, reason) = invalid(Schedule::parse(
        "bad",
        vec![0, 1],
        2,
        "0F0 0B0 0F1 0B1\n1F1 1F0 1B0 1B1",
    ));
    assert_eq!((rank, pos), (0, 1));
    assert_eq!(action, Action::Backward { stage: 0, mb: 0 });
    assert!(
        reason.contains("deadlock") && reason.contains("rank 1"),
        "{reason}"
    );
    assert!(reason.contains("1F1"), "{reason}");
}

#[test]
fn duplicates_wrong_rank_and_split_misuse_are_named() {
    let (rank, pos, action, _) = invalid(Schedule::parse("bad", vec![0], 2, "0F0 0F1 0F1 0B0 0B1"));
    assert_eq!(
        (rank, pos, action),
        (0, 2, Action::Forward { stage: 0, mb: 1 })
    );
    let (rank, pos, action, reason) =
        invalid(Schedule::parse("bad", vec![0, 1], 1, "0F0 1F0 0B0\n1B0"));
    assert_eq!(
        (rank, pos, action),
        (0, 1, Action::Forward { stage: 1, mb: 0 })
    );
    assert!(reason.contains("held by rank 1"), "{reason}");
    // W before its I; W after a full B; I without W.
    let (_, pos, action, _) = invalid(Schedule::parse("bad", vec![0], 1, "0F0 0W0 0I0"));
    assert_eq!(
        (pos, action),
        (1, Action::BackwardWeight { stage: 0, mb: 0 })
    );
    let (_, pos, _, _) = invalid(Schedule::parse("bad", vec![0], 1, "0F0 0B0 0W0"));
    assert_eq!(pos, 2);
    let (_, pos, action, _) = invalid(Schedule::parse("bad", vec![0], 1, "0F0 0I0"));
    assert_eq!(
        (pos, action),
        (2, Action::BackwardWeight { stage: 0, mb: 0 })
    );
    // Out of range.
    let (_, pos, _, reason) = invalid(Schedule::parse("bad", vec![0], 1, "0F0 0B0 0F5"));
    assert_eq!(pos, 2);
    assert!(reason.contains("1 micro-batches"), "{reason}");
}

#[test]
fn sizes_and_text_are_checked() {
    assert!(matches!(
        Schedule::gpipe(0, 4),
        Err(Error::ScheduleConfig { .. })
    ));
    assert!(matches!(
        Schedule::parse("bad", vec![0], 1, "0F0 0X0"),
        Err(Error::ScheduleConfig { .. })
    ));
    assert!(matches!(
        Schedule::new("bad", vec![3], 1, vec![vec![]]),
        Err(Error::ScheduleConfig { .. })
    ));
    let s = Schedule::gpipe(2, 2).unwrap();
    assert!(s.simulate(&[EQUAL]).is_err());
    assert!(
        s.simulate_uniform(StageCost::new(1.0, f64::NAN, 0.0))
            .is_err()
    );
    for a in ["0F0", "12B3", "1I2", "7W0"] {
        assert_eq!(a.parse::<Action>().unwrap().to_string(), a);
    }
}

#[test]
fn hand_written_schedules_run_through_the_simulator() {
    // A 2-rank "eager backward" order that is neither GPipe nor 1F1B but valid.
    let s = Schedule::parse(
        "mine",
        vec![0, 1],
        3,
        "0F0 0F1 0F2 0B0 0B1 0B2\n1F0 1B0 1F1 1B1 1F2 1B2",
    )
    .unwrap();
    let r = s.simulate_uniform(EQUAL).unwrap();
    // Rank 1 runs F0 B0 back to back as soon as F0 arrives at t=1; rank 0's B0 can start at 3.
    assert!(close(r.makespan, 8.0), "{}", r.makespan);
    assert_eq!(r.peak_activations, vec![3, 1]);
}

#[test]
fn latency_lands_on_the_critical_path_of_each_schedule() {
    let cost = StageCost::new(1.0, 2.0, 1.0);
    for (p, m) in [(2, 4), (4, 8)] {
        let s = Schedule::gpipe(p, m).unwrap();
        // GPipe: the forward wave crosses p-1 links, the backward wave p-1 more.
        let r = s.simulate_with_latency(&vec![cost; p], 0.5).unwrap();
        let base = s.simulate_uniform(cost).unwrap();
        assert!(close(
            r.makespan,
            base.makespan + 2.0 * (p - 1) as f64 * 0.5
        ));
        // Stages on one rank hand over for free: one rank, no latency at all.
        let one = Schedule::interleaved_1f1b(1, 4, m).unwrap();
        let r = one.simulate_with_latency(&[cost; 4], 10.0).unwrap();
        assert!(close(r.makespan, (4 * m) as f64 * 3.0));
    }
    assert!(
        Schedule::gpipe(2, 2)
            .unwrap()
            .simulate_with_latency(&[cost; 2], -1.0)
            .is_err()
    );
}

#[test]
fn absurd_sizes_are_errors_not_hangs_or_panics() {
    for r in [
        Schedule::gpipe(usize::MAX, 2),
        Schedule::one_f_one_b(2, usize::MAX),
        Schedule::interleaved_1f1b(4, usize::MAX / 2, 8),
        Schedule::zero_bubble_h1(1 << 40, 1 << 40),
    ] {
        assert!(matches!(r, Err(Error::ScheduleConfig { .. })), "{r:?}");
    }
    // A hand-written list claiming usize::MAX micro-batches is missing the second one.
    let (rank, pos, action, _) = invalid(Schedule::parse("big", vec![0], usize::MAX, "0F0 0B0"));
    assert_eq!(
        (rank, pos, action),
        (0, 2, Action::Forward { stage: 0, mb: 1 })
    );
}

/// Any sequential order cut into per-rank lists validates, simulates to a makespan no shorter
/// than a rank's work, and loses validity when any one action is removed: the error names
/// that action's stage and micro-batch.
#[test]
fn random_schedules_validate_and_any_deletion_is_named() {
    for seed in 0..200u64 {
        let mut rng = common::Rng::new(seed ^ 0xabc);
        let p = 1 + rng.below(4);
        let n = p + rng.below(2 * p);
        let m = 1 + rng.below(5);
        let s = common::random_schedule(seed, p, n, m);
        let r = s.simulate_uniform(StageCost::new(1.0, 2.0, 1.0)).unwrap();
        let most_busy = r.busy.iter().copied().fold(0.0, f64::max);
        assert!(r.makespan >= most_busy - 1e-9);
        let total: f64 = r.busy.iter().sum();
        assert!(close(total, (n * m) as f64 * 3.0), "seed {seed}");
        // Delete one action at random.
        let rank = (0..p)
            .cycle()
            .skip(rng.below(p))
            .find(|&q| !s.actions(q).is_empty())
            .unwrap();
        let pos = rng.below(s.actions(rank).len());
        let gone = s.actions(rank)[pos];
        let lists: Vec<Vec<Action>> = (0..p)
            .map(|q| {
                let mut l = s.actions(q).to_vec();
                if q == rank {
                    l.remove(pos);
                }
                l
            })
            .collect();
        let stage_to_rank = (0..n).map(|st| s.rank_of(st).unwrap()).collect();
        let (_, _, action, reason) = invalid(Schedule::new("cut", stage_to_rank, m, lists));
        assert_eq!(
            (action.stage(), action.mb()),
            (gone.stage(), gone.mb()),
            "seed {seed}: removed {gone}, error names {action}: {reason}"
        );
    }
}
