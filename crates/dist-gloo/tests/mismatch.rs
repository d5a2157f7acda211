//! Ranks that disagree, as threads over real loopback TCP: every rank fails (none returns Ok
//! with the wrong data, none waits for the timeout), each with an error that says mismatch and
//! names two ranks that disagree, with both sides' arguments.

mod common;

use std::time::{Duration, Instant};

use common::{DRIVERS, on_all, shm_rings_transports, tcp_world};
use dist_backend::{Backend, BufMut, BufRef, Error, OpDesc, OpOptions};
use dist_gloo::transport::shm::TransportMode;
use dist_gloo::{GlooBackend, GlooOptions};
use dist_wire::{CollectiveOp, DType, ReduceOp};

/// Long enough that a mismatch found only by timing out is a failed test, not a slow one.
fn opts() -> OpOptions {
    OpOptions::with_timeout(Duration::from_secs(60))
}

/// The two sides a mismatch error names: this rank's (or the reporter's) and the other's.
fn sides(e: &Error) -> (OpDesc, OpDesc) {
    match e {
        Error::Mismatch { ours, theirs } => (*ours, *theirs),
        Error::MismatchReported { found, met, .. } => (*found, *met),
        other => panic!("expected a mismatch, got: {other}"),
    }
}

/// For a rank whose rooted operation returned Ok and whose next one failed: the error names
/// two ranks that disagree, each side as that rank called it (the side that ran `op` with the
/// root `root_of` gave it). Either side may be this rank's next operation, when what it met
/// first was a frame of `op` that it had not expected.
fn assert_names_a_disagreement(e: &Error, op: CollectiveOp, root_of: impl Fn(usize) -> usize) {
    let (a, b) = sides(e);
    for side in [a, b].into_iter().filter(|s| s.op == op) {
        assert_eq!(side.root, Some(root_of(side.rank)), "{e}");
    }
    assert!(a.op != b.op || a.root != b.root, "{e}");
    assert_ne!(a.rank, b.rank, "{e}");
}

/// What one rank's part in a mismatched collective ended with.
struct Outcome {
    /// Its error: from the collective itself, or (`returned`) from its next operation.
    err: Error,
    /// Whether the collective returned Ok: a root does not wait for the others (see
    /// `GlooOptions::lazy_root_verification`), nor a rank whose own data was consistent.
    returned: bool,
}

/// Runs `call` on every rank; a rank whose call returns Ok runs a barrier, which must fail.
fn outcomes<F>(ranks: &[GlooBackend], call: F) -> Vec<Outcome>
where
    F: Fn(&GlooBackend) -> dist_backend::Result<()> + Sync,
{
    outcomes_within(ranks, 1, call)
}

/// [`outcomes`] where a rank whose call returns Ok runs up to `barriers` barriers, one of
/// which must fail: a rank that holds no frame of the disagreement may complete a barrier
/// that the ranks holding one fail once every rank has arrived (through the group area),
/// and hears of it at the next.
fn outcomes_within<F>(ranks: &[GlooBackend], barriers: usize, call: F) -> Vec<Outcome>
where
    F: Fn(&GlooBackend) -> dist_backend::Result<()> + Sync,
{
    on_all(ranks, |b| match call(b) {
        Err(err) => Outcome {
            err,
            returned: false,
        },
        Ok(()) => Outcome {
            err: (0..barriers)
                .find_map(|_| b.barrier(&opts()).err())
                .expect("a rank that disagrees must fail within its next operations"),
            returned: true,
        },
    })
}

/// An f32 `SUM` all_reduce of `count` ones on `b`.
fn sum_ones(b: &GlooBackend, count: usize) -> dist_backend::Result<()> {
    let mut v = vec![1.0f32; count];
    b.all_reduce(
        BufMut::Host(bytemuck::cast_slice_mut(&mut v)),
        DType::F32,
        ReduceOp::Sum,
        &opts(),
    )
}

/// Every rank broadcasts `count` f32 from the root `root_of(rank)`; returns each rank's error.
fn broadcast_roots(n: usize, count: usize, root_of: impl Fn(usize) -> usize + Sync) -> Vec<Error> {
    broadcast_roots_with(&GlooOptions::default(), n, count, root_of)
        .into_iter()
        .map(|o| o.err)
        .collect()
}

/// [`broadcast_roots`] with the given backend options, and whether each rank's broadcast
/// returned (see [`Outcome`]).
fn broadcast_roots_with(
    gopts: &GlooOptions,
    n: usize,
    count: usize,
    root_of: impl Fn(usize) -> usize + Sync,
) -> Vec<Outcome> {
    let ranks = tcp_world(n, gopts);
    outcomes(&ranks, |b| {
        let mut v = vec![b.rank() as f32; count];
        b.broadcast(
            BufMut::Host(bytemuck::cast_slice_mut(&mut v)),
            DType::F32,
            root_of(b.rank()),
            &opts(),
        )
    })
}

/// The root's report one operation later also comes when that operation is the group's
/// destruction: it is logged, and the peers are told (no rank hangs, none is told the root
/// left cleanly), so a disagreement is never silent.
/// The error of a rank's part in a disagreement: `r`'s, or its next operation's.
fn failed_now_or_at_the_next(b: &GlooBackend, r: dist_backend::Result<()>) -> Error {
    match r {
        Err(e) => e,
        Ok(()) => b
            .barrier(&opts())
            .expect_err("a rank that disagrees must fail at its next operation"),
    }
}

/// Every rank but 0 names both roots; rank 0's group, closed after the disagreement, says so.
fn assert_rank_0_closed_after_the_mismatch_the_others_saw(n: usize, errs: &[Error]) {
    for (r, e) in errs.iter().enumerate().skip(1) {
        let (ours, theirs) = sides(e);
        assert_ne!(ours.root, theirs.root, "n={n}: rank {r}: {e}");
    }
    let msg = errs[0].to_string();
    assert!(
        msg.contains("mismatch") || msg.contains(" met rank "),
        "n={n}: rank 0 closed after a mismatch; its group must say so: {msg}"
    );
}

#[test]
fn a_lazy_root_that_disagrees_and_then_closes_aborts_the_group() {
    for n in 2..=4 {
        let ranks = tcp_world(n, &GlooOptions::default());
        let errs = on_all(&ranks, |b| {
            let mut v = vec![0f32; 10];
            // Rank 0 is the root in its own view, everyone else thinks rank 1 is.
            let root = usize::from(b.rank() != 0);
            let r = b.broadcast(
                BufMut::Host(bytemuck::cast_slice_mut(&mut v)),
                DType::F32,
                root,
                &opts(),
            );
            if b.rank() == 0 {
                assert!(r.is_ok(), "the lazy root returns at once: {r:?}");
                Backend::close(b);
                b.barrier(&opts()).expect_err("the group is destroyed")
            } else {
                failed_now_or_at_the_next(b, r)
            }
        });
        assert_rank_0_closed_after_the_mismatch_the_others_saw(n, &errs);
    }
}

/// As above, where the root repeats its last call (every rank ran one broadcast from it
/// before), so that it is owed no agreement frames and reads nothing: it looks at what its
/// peers sent when it closes. Rank 0 closes once every other rank's broadcast has returned,
/// so that what they sent is there to be seen.
#[test]
fn a_root_that_repeats_its_call_and_then_closes_after_a_disagreement_aborts_the_group() {
    for n in 2..=4 {
        let ranks = tcp_world(n, &GlooOptions::default());
        let (returned, others_returned) = std::sync::mpsc::channel::<()>();
        let others_returned = std::sync::Mutex::new(others_returned);
        let errs = on_all(&ranks, |b| {
            let mut v = vec![0f32; 10];
            let mut bcast = |root| {
                b.broadcast(
                    BufMut::Host(bytemuck::cast_slice_mut(&mut v)),
                    DType::F32,
                    root,
                    &opts(),
                )
            };
            // Every rank names root 0, then rank 0 repeats its call and everyone else thinks
            // rank 1 is the root. A rank still in the first may fail there already, on the
            // notice of a rank that found the disagreement in the second.
            let r = bcast(0).and_then(|()| bcast(usize::from(b.rank() != 0)));
            if b.rank() == 0 {
                assert!(r.is_ok(), "the lazy root returns at once: {r:?}");
                let rx = others_returned.lock().unwrap();
                for _ in 1..n {
                    rx.recv_timeout(Duration::from_secs(60))
                        .expect("every other rank's broadcast returns");
                }
                Backend::close(b);
                b.barrier(&opts()).expect_err("the group is destroyed")
            } else {
                returned.send(()).unwrap();
                failed_now_or_at_the_next(b, r)
            }
        });
        assert_rank_0_closed_after_the_mismatch_the_others_saw(n, &errs);
    }
}

#[test]
fn a_broadcast_with_different_roots_fails_on_every_rank_naming_both_roots() {
    every_rank_names_both_roots(&GlooOptions::default(), true);
}

/// Groups larger than `fused_agreement_max_ranks` agree in dissemination rounds before the
/// data instead; forced here at 2 to 4 ranks, the outcome is the same.
#[test]
fn the_dissemination_agreement_of_large_groups_also_names_both_roots() {
    every_rank_names_both_roots(
        &GlooOptions {
            fused_agreement_max_ranks: Some(1),
            ..GlooOptions::default()
        },
        false,
    );
}

/// Ranks whose settings would make them choose different algorithms for the same call (a
/// different `DIST_GLOO_SMALL_BYTES`, segment size, agreement scheme or use of the
/// shared-memory area on one rank) are refused when the group is built, on every rank, naming
/// the setting and a rank that differs: no rank gets as far as a collective that would hang or
/// lose a peer.
#[test]
fn ranks_that_would_choose_different_algorithms_are_refused_at_connect_on_every_rank() {
    type Tweak = fn(&mut GlooOptions);
    // Values that no default resolves to: what is compared is the resolved value.
    let cases: [(&str, Tweak); 12] = [
        ("small_bytes=12345", |o| o.small_bytes = Some(12345)),
        ("segment_bytes=65536", |o| o.mesh.segment_bytes = 64 << 10),
        ("fused_agreement_max_ranks=1", |o| {
            o.fused_agreement_max_ranks = Some(1);
        }),
        ("halving_doubling_bytes=12345", |o| {
            o.halving_doubling_bytes = Some(12345);
        }),
        ("ring_piece_bytes=12345", |o| {
            o.ring_piece_bytes = Some(12345)
        }),
        ("area_all_reduce_bytes=12345", |o| {
            o.area_all_reduce_bytes = Some(12345)
        }),
        ("area_all_gather_bytes=12345", |o| {
            o.area_all_gather_bytes = Some(12345);
        }),
        ("area_broadcast_min_bytes=12345", |o| {
            o.area_broadcast_min_bytes = Some(12345);
        }),
        ("area_all_to_all_bytes=12345", |o| {
            o.area_all_to_all_bytes = Some(12345);
        }),
        ("lent_all_gather_bytes=12345", |o| {
            o.lent_all_gather_bytes = Some(12345);
        }),
        ("lent_all_reduce_bytes=12345", |o| {
            o.lent_all_reduce_bytes = Some(12345);
        }),
        // Lazy roots are owed no frames for repeated small broadcasts; an eager one is.
        ("lazy_root_verification=false", |o| {
            o.lazy_root_verification = Some(false);
        }),
    ];
    for n in 2..=4 {
        for (setting, tweak) in cases {
            let odd = n - 1;
            let store =
                std::sync::Arc::new(dist_backend::store::HashStore::new(Duration::from_secs(30)));
            let prefix = format!("choice-{n}-{setting}");
            let errs: Vec<String> = std::thread::scope(|s| {
                let hs: Vec<_> = (0..n)
                    .map(|r| {
                        let (store, prefix) = (store.clone(), prefix.clone());
                        s.spawn(move || {
                            let mut o = GlooOptions::default();
                            if r == odd {
                                tweak(&mut o);
                            }
                            GlooBackend::connect(&*store, &prefix, r, n, &o)
                                .expect_err("ranks that choose algorithms differently")
                                .to_string()
                        })
                    })
                    .collect();
                hs.into_iter().map(|h| h.join().unwrap()).collect()
            });
            for (r, e) in errs.iter().enumerate() {
                assert!(
                    e.contains("algorithm settings mismatch") && e.contains(&format!("rank {r}")),
                    "n={n}, {setting}: rank {r}: {e}"
                );
                if r == odd {
                    assert!(e.contains("rank 0 has"), "n={n}: rank {r}: {e}");
                } else {
                    assert!(
                        e.contains(&format!("rank {odd} has {setting}")),
                        "n={n}: rank {r}: {e}"
                    );
                }
            }
        }
    }
}

/// A rank that sets, explicitly, the values the others leave to their defaults chooses the
/// same algorithms, so the group is built: the settings are compared once resolved. Before,
/// the defaults that depend on the mesh were compared as `auto`, and a rank that set what they
/// resolve to was refused.
#[test]
fn ranks_that_set_what_the_defaults_resolve_to_are_not_refused() {
    for n in 1..=3 {
        let store =
            std::sync::Arc::new(dist_backend::store::HashStore::new(Duration::from_secs(30)));
        // What the mesh-dependent defaults resolve to on this host, from a group of defaults.
        let resolved = |prefix: &str, tweak: &(dyn Fn(&mut GlooOptions) + Sync)| {
            std::thread::scope(|s| {
                let hs: Vec<_> = (0..n)
                    .map(|r| {
                        let store = store.clone();
                        s.spawn(move || {
                            let mut o = GlooOptions::default();
                            if r == n - 1 {
                                tweak(&mut o);
                            }
                            let b = GlooBackend::connect(&*store, prefix, r, n, &o)
                                .unwrap_or_else(|e| panic!("n={n}: rank {r}: {e}"));
                            let mut x = [r as f32 + 1.0];
                            b.all_reduce(
                                BufMut::Host(bytemuck::cast_slice_mut(&mut x)),
                                DType::F32,
                                ReduceOp::Sum,
                                &opts(),
                            )
                            .unwrap_or_else(|e| panic!("n={n}: rank {r}: {e}"));
                            assert_eq!(x[0], (n * (n + 1) / 2) as f32, "n={n}: rank {r}");
                            (b.one_host(), b.memory_shared_in_group())
                        })
                    })
                    .collect();
                hs.into_iter()
                    .map(|h| h.join().unwrap())
                    .collect::<Vec<_>>()
            })
        };
        let (one_host, shared) = resolved(&format!("defaults-{n}"), &|_| {})[0];
        resolved(&format!("explicit-defaults-{n}"), &|o| {
            o.small_bytes = Some(GlooOptions::auto_small_bytes(n));
            o.halving_doubling_bytes = Some(GlooOptions::auto_halving_doubling_bytes(n, one_host));
            o.ring_piece_bytes = Some(GlooOptions::auto_ring_piece_bytes(n, shared));
            o.all_to_all_pairwise_bytes =
                Some(GlooOptions::auto_all_to_all_pairwise_bytes(n, shared));
            o.lazy_root_verification = Some(true);
        });
    }
}

/// Backends built with `GlooBackend::over` skip the group's agreement on the settings that
/// choose algorithms (`algo/choice.rs`), so ranks with a different `small_bytes` run different
/// algorithms for one call. The rank that meets a foreign step must report it as a mismatch
/// naming both ranks' algorithm steps and send the abort notice every mismatch sends, so every
/// rank fails at once, over every driver, instead of the others waiting for their timeout.
#[test]
fn ranks_over_a_transport_running_different_algorithms_fail_on_every_rank_at_once() {
    for &(driver, make) in DRIVERS {
        for n in 2..=4 {
            let odd = n - 1;
            // All over messages, whatever the host's CPUs
            // (`area_disagreement_fails_on_every_rank_at_once` has the shared-memory area).
            let base = GlooOptions {
                area_all_reduce_bytes: Some(0),
                ..GlooOptions::default()
            };
            // The ring where the others run recursive doubling.
            let ranks = with_odd_last(make(n, &base), &base, |o| o.small_bytes = Some(0));
            // 8 KiB: past what goes through the shared-memory group area in one shot, so
            // every driver runs messages.
            let errs = all_fail_at_once(&ranks, driver, |b| sum_ones(b, 2048));
            for (r, e) in errs.iter().enumerate() {
                let msg = e.to_string();
                let (a, b) = sides(e);
                assert_ne!(a.rank, b.rank, "{driver}, n={n}: rank {r}: {msg}");
                assert!(
                    a.rank == odd || b.rank == odd,
                    "{driver}, n={n}: rank {r} must name rank {odd}: {msg}"
                );
                let (Some(sa), Some(sb)) = (a.step, b.step) else {
                    panic!("{driver}, n={n}: rank {r} must name both algorithm steps: {msg}");
                };
                assert_ne!(sa, sb, "{driver}, n={n}: rank {r}: {msg}");
                assert_eq!(
                    OpDesc { step: None, ..a },
                    OpDesc {
                        step: None,
                        rank: a.rank,
                        ..b
                    },
                    "{driver}, n={n}: rank {r}: only the algorithm differs: {msg}"
                );
                let ring = if a.rank == odd { sa } else { sb };
                assert!(
                    ring.algorithm.starts_with("ring"),
                    "{driver}, n={n}: rank {r}: rank {odd} runs the ring: {msg}"
                );
                assert!(msg.contains(&format!("rank {r}")), "{msg}");
            }
        }
    }
}

/// The same with one rank that sends an all_reduce over messages where the others take it
/// through the shared-memory group area in two shots (`area_all_reduce_bytes`): the ranks
/// waiting in the area read the odd rank's frames and fail on them, and every rank fails at
/// once with a mismatch that names the odd rank.
#[test]
fn area_disagreement_fails_on_every_rank_at_once() {
    for n in 2..=4 {
        let odd = n - 1;
        let base = GlooOptions {
            area_all_reduce_bytes: Some(usize::MAX),
            ..GlooOptions::default()
        };
        let ranks = with_odd_last(shm_rings_transports(n, &base), &base, |o| {
            o.area_all_reduce_bytes = Some(0);
        });
        let errs = all_fail_at_once(&ranks, "area", |b| sum_ones(b, 2048));
        assert_each_names(&errs, odd, n);
    }
}

/// The same for broadcasts through the group area (`area_broadcast_min_bytes`), where the
/// argument agreement rides on the area's headers instead of frames to the root: one rank that
/// goes over messages while the others take the area, and one rank that names another root
/// while every rank takes the area. Every rank fails at once, naming the odd rank, the root
/// included (over messages a lazy root could return first).
#[test]
fn broadcast_area_disagreement_fails_on_every_rank_at_once() {
    let broadcast = |b: &GlooBackend, root: usize| {
        let mut v = vec![b.rank() as f32; 2048];
        b.broadcast(
            BufMut::Host(bytemuck::cast_slice_mut(&mut v)),
            DType::F32,
            root,
            &opts(),
        )
    };
    for n in 2..=4 {
        let odd = n - 1;
        let base = GlooOptions {
            area_broadcast_min_bytes: Some(0),
            ..GlooOptions::default()
        };
        let ranks = with_odd_last(shm_rings_transports(n, &base), &base, |o| {
            o.area_broadcast_min_bytes = Some(usize::MAX);
        });
        let errs = all_fail_at_once(&ranks, "broadcast over messages", |b| broadcast(b, 0));
        assert_each_names(&errs, odd, n);
        let ranks = with_odd_last(shm_rings_transports(n, &base), &base, |_| {});
        let errs = all_fail_at_once(&ranks, "another root", |b| {
            broadcast(b, if b.rank() == odd { odd } else { 0 })
        });
        assert_each_names(&errs, odd, n);
        for (r, e) in errs.iter().enumerate() {
            let (a, b) = sides(e);
            assert_ne!(a.root, b.root, "n={n}: rank {r}: {e}");
        }
    }
}

/// all_to_all through the group area (`area_all_to_all_bytes`) where rank 1 sends rank 2 one
/// element more than rank 2 expects from it: every rank reads every rank's table of counts,
/// so every rank fails at once, naming the same pair with both counts, even the ranks whose
/// own blocks agree. The same counts where rank 1's input is too large for the area (so that
/// the ranks go on by messages after the tables, or, where it lends its input by reference,
/// read it after them) fail the same way.
#[test]
fn all_to_all_counts_that_disagree_fail_every_rank_through_the_area() {
    for (n, big, lent) in [
        (3, 0, None),
        (4, 0, None),
        (3, 2 << 20, None),
        (3, 2 << 20, Some(0)),
        (4, 2 << 20, Some(0)),
    ] {
        let base = GlooOptions {
            area_all_to_all_bytes: Some(usize::MAX),
            lent_all_to_all_bytes: lent,
            ..GlooOptions::default()
        };
        let ranks = with_odd_last(shm_rings_transports(n, &base), &base, |_| {});
        // Rank s sends rank r 2 + s elements (rank 1: `big` more to rank 0); rank 2 expects
        // one fewer from rank 1 than it sends.
        let sends = |s: usize| -> Vec<usize> {
            (0..n)
                .map(|r| 2 + s + if s == 1 && r == 0 { big } else { 0 })
                .collect()
        };
        let recvs = |r: usize| -> Vec<usize> {
            (0..n)
                .map(|s| sends(s)[r] - usize::from(r == 2 && s == 1))
                .collect()
        };
        let errs = all_fail_at_once(&ranks, "all_to_all counts", |b| {
            all_to_all_ones(b, DType::U8, &sends(b.rank()), &recvs(b.rank()))
        });
        for (r, e) in errs.iter().enumerate() {
            let (ours, theirs) = sides(e);
            assert_eq!(
                (ours.rank, ours.count, theirs.rank, theirs.count),
                (2, 2, 1, 3),
                "n={n}, big={big}, lent={lent:?}: rank {r}: {e}"
            );
        }
    }
}

/// A rank whose all_to_all input is too large for the group area publishes its table and goes
/// on by messages without reading anyone's header; the others, waiting in the area, find that
/// its header disagrees with theirs (another element type, or another operation through the
/// area). They must tell it: it waits for their frames, which never come. Every rank fails at
/// once, naming the odd rank.
#[test]
fn a_rank_that_announces_hears_of_the_disagreement_its_header_caused() {
    let area_limit = 4 << 10;
    for n in 2..=4 {
        let odd = n - 1;
        let base = GlooOptions {
            area_all_to_all_bytes: Some(area_limit),
            ..GlooOptions::default()
        };
        let all_to_all = |b: &GlooBackend, dtype: DType, per_peer: usize| {
            let counts = vec![per_peer; n];
            all_to_all_ones(b, dtype, &counts, &counts)
        };
        // The odd rank's input is 4 times the area's limit; the others' 4 elements per peer.
        let big = area_limit / DType::F32.size();
        let ranks = with_odd_last(shm_rings_transports(n, &base), &base, |_| {});
        let errs = all_fail_at_once(&ranks, "another dtype", |b| {
            if b.rank() == odd {
                all_to_all(b, DType::F32, big)
            } else {
                all_to_all(b, DType::I32, 4)
            }
        });
        assert_each_names(&errs, odd, n);
        let ranks = with_odd_last(shm_rings_transports(n, &base), &base, |_| {});
        let errs = all_fail_at_once(&ranks, "another op", |b| {
            if b.rank() == odd {
                all_to_all(b, DType::F32, big)
            } else {
                let input = [1u8; 16];
                let mut output = vec![0u8; 16 * n];
                b.all_gather(
                    BufRef::Host(&input),
                    BufMut::Host(&mut output),
                    DType::U8,
                    &vec![16; n],
                    &opts(),
                )
            }
        });
        assert_each_names(&errs, odd, n);
    }
}

/// A rank that runs an operation over messages, where the others run it through the group
/// area, hears nothing from them (they send no frames); where it only receives, the two sides
/// would wait for each other until the timeout. Before it sleeps it looks at the area: a peer
/// there at this very operation disagrees with it. Cases: rank 0 as the star's root of an
/// all_reduce or all_gather whose count puts it over the area's limit; a reduce's root that
/// repeats its call (no advisory frame) against ranks in a barrier; a broadcast leaf that
/// repeats its call silently against ranks in a barrier; one rank whose options keep its
/// all_to_all off the area (under `GlooBackend::over`, which does not compare them).
#[test]
fn a_rank_over_messages_that_only_receives_finds_the_ranks_in_the_area() {
    let base = GlooOptions {
        area_all_reduce_bytes: Some(0),
        area_all_gather_bytes: Some(0),
        area_broadcast_min_bytes: Some(usize::MAX),
        ..GlooOptions::default()
    };
    let world = |n: usize| with_odd_last(shm_rings_transports(n, &base), &base, |_| {});
    for n in 3..=4 {
        let errs = all_fail_at_once(&world(n), "star root", |b| {
            sum_ones(b, if b.rank() == 0 { 2000 } else { 1000 })
        });
        assert_each_names(&errs, 0, n);
        let errs = all_fail_at_once(&world(n), "all_gather star root", |b| {
            let per = if b.rank() == 0 { 5000 } else { 4096 };
            let input = vec![1u8; per];
            let mut output = vec![0u8; per * n];
            b.all_gather(
                BufRef::Host(&input),
                BufMut::Host(&mut output),
                DType::U8,
                &vec![per; n],
                &opts(),
            )
        });
        assert_each_names(&errs, 0, n);
    }
    let reduce = |b: &GlooBackend| {
        let mut v = vec![1f32; 16];
        b.reduce(
            BufMut::Host(bytemuck::cast_slice_mut(&mut v)),
            DType::F32,
            ReduceOp::Sum,
            0,
            &opts(),
        )
    };
    let broadcast = |b: &GlooBackend| {
        let mut v = vec![0f32; 1024];
        b.broadcast(
            BufMut::Host(bytemuck::cast_slice_mut(&mut v)),
            DType::F32,
            0,
            &opts(),
        )
    };
    for n in 2..=4 {
        let ranks = world(n);
        on_all(&ranks, |b| reduce(b).unwrap());
        let errs = all_fail_at_once(&ranks, "repeating reduce root", |b| {
            if b.rank() == 0 {
                reduce(b)
            } else {
                b.barrier(&opts())
            }
        });
        assert_each_names(&errs, 0, n);
        let ranks = world(n);
        on_all(&ranks, |b| broadcast(b).unwrap());
        let errs = all_fail_at_once(&ranks, "silent receiver", |b| {
            if b.rank() == n - 1 {
                broadcast(b)
            } else {
                b.barrier(&opts())
            }
        });
        assert_each_names(&errs, n - 1, n);
        let area = GlooOptions {
            area_all_to_all_bytes: Some(4 << 10),
            ..GlooOptions::default()
        };
        let ranks = with_odd_last(shm_rings_transports(n, &area), &area, |o| {
            o.area_all_to_all_bytes = Some(0);
        });
        let errs = all_fail_at_once(&ranks, "all_to_all off the area on one rank", |b| {
            let counts = vec![4; n];
            all_to_all_ones(b, DType::U8, &counts, &counts)
        });
        assert_each_names(&errs, n - 1, n);
    }
}

/// An all_to_all on `b` of ones of `dtype`, `send`/`recv` elements to/from each rank.
fn all_to_all_ones(
    b: &GlooBackend,
    dtype: DType,
    send: &[usize],
    recv: &[usize],
) -> dist_backend::Result<()> {
    let input = vec![1u8; send.iter().sum::<usize>() * dtype.size()];
    let mut output = vec![0u8; recv.iter().sum::<usize>() * dtype.size()];
    b.all_to_all(
        BufRef::Host(&input),
        BufMut::Host(&mut output),
        dtype,
        send,
        recv,
        &opts(),
    )
}

/// Each of `errs` (one per rank of `n`) is a mismatch one of whose sides is rank `odd`.
fn assert_each_names(errs: &[Error], odd: usize, n: usize) {
    for (r, e) in errs.iter().enumerate() {
        let (a, b) = sides(e);
        assert!(
            a.rank == odd || b.rank == odd,
            "n={n}: rank {r} must name rank {odd}: {e}"
        );
    }
}

/// Backends over `transports`, the last one with `tweak` applied to `base`.
fn with_odd_last(
    transports: Vec<Box<dyn dist_gloo::transport::Transport>>,
    base: &GlooOptions,
    tweak: impl Fn(&mut GlooOptions),
) -> Vec<GlooBackend> {
    let odd = transports.len() - 1;
    transports
        .into_iter()
        .enumerate()
        .map(|(r, t)| {
            let mut o = base.clone();
            if r == odd {
                tweak(&mut o);
            }
            GlooBackend::over(t, 0, &o)
        })
        .collect()
}

/// Runs `op` (an 8 KiB collective) on every rank of `ranks`, which disagree about it, and
/// returns their errors: every rank must fail, and long before the timeout.
fn all_fail_at_once(
    ranks: &[GlooBackend],
    what: &str,
    op: impl Fn(&GlooBackend) -> dist_backend::Result<()> + Sync,
) -> Vec<Error> {
    let n = ranks.len();
    let t0 = Instant::now();
    let errs = on_all(ranks, |b| {
        op(b).expect_err("ranks that disagree about the operation must not succeed")
    });
    let took = t0.elapsed();
    assert!(
        took < opts().timeout / 2,
        "{what}, n={n}: took {took:?}: {errs:?}"
    );
    errs
}

/// A large broadcast on 4 ranks (the pipelined chain) whose ranks disagree on the count fails
/// on every rank as a mismatch, long before the timeout. The root, lazy, only sends: it may
/// return when the ranks downstream took its whole message before the failure reached it (a
/// chain's first hop keeps reading ahead while its next hop is blocked), and must then fail at
/// its next operation; every other rank fails in the broadcast itself.
#[test]
fn a_large_chain_broadcast_with_a_count_mismatch_fails_on_every_rank() {
    let ranks = tcp_world(4, &GlooOptions::default());
    let t0 = Instant::now();
    let outs = outcomes(&ranks, |b| {
        let count = if b.rank() == 2 {
            (4 << 20) + 1
        } else {
            4 << 20
        };
        let mut v = vec![b.rank() as f32; count];
        b.broadcast(
            BufMut::Host(bytemuck::cast_slice_mut(&mut v)),
            DType::F32,
            0,
            &opts(),
        )
    });
    for (r, o) in outs.iter().enumerate() {
        let e = &o.err;
        assert!(!o.returned || r == 0, "rank {r} returned: {e}");
        let (ours, theirs) = sides(e);
        assert_ne!(ours.count, theirs.count, "rank {r}: {e}");
        assert!(ours.rank == 2 || theirs.rank == 2, "rank {r}: {e}");
    }
    assert!(t0.elapsed() < Duration::from_secs(30), "{:?}", t0.elapsed());
}

/// `may_return`: whether a rank may return from the broadcast and fail at its next operation
/// (the fused agreement: roots, and receivers whose data came from the root they named);
/// with the dissemination agreement every rank fails in the broadcast itself.
fn every_rank_names_both_roots(gopts: &GlooOptions, may_return: bool) {
    for n in 2..=4 {
        for (name, root_of) in [
            (
                "every rank its own root",
                (|r: usize| r) as fn(usize) -> usize,
            ),
            ("rank 0 alone disagrees", |r| usize::from(r != 0)),
            ("the last rank alone disagrees", |r| {
                usize::from(r == 3 || r == 2)
            }),
        ] {
            if name.starts_with("the last") && n != 4 {
                continue;
            }
            let outs = broadcast_roots_with(gopts, n, 100, root_of);
            for (r, o) in outs.iter().enumerate() {
                let (e, msg) = (&o.err, o.err.to_string());
                // With the fused agreement a rank may also hear of it from the rank that
                // found it, or find it at its next operation.
                let second_hand = matches!(e, Error::MismatchReported { .. });
                if o.returned || second_hand {
                    assert!(may_return, "n={n}, {name}: rank {r}: {msg}");
                    assert_names_a_disagreement(e, CollectiveOp::Broadcast, root_of);
                    continue;
                }
                let Error::Mismatch { ours, theirs } = e else {
                    panic!("n={n}, {name}: rank {r}: expected Error::Mismatch, got {msg}");
                };
                assert_eq!((ours.rank, ours.root), (r, Some(root_of(r))), "{msg}");
                if theirs.op != CollectiveOp::Broadcast {
                    // The rank this one waited on moved on to its next operation without
                    // sending to it: it had another root in mind.
                    assert!(theirs.seq > ours.seq, "n={n}, {name}: rank {r}: {msg}");
                    assert_ne!(root_of(theirs.rank), root_of(r), "{msg}");
                    continue;
                }
                let other_root = theirs.root.expect("a broadcast names its root");
                assert_ne!(other_root, root_of(r), "n={n}, {name}: rank {r}: {msg}");
                assert_eq!(other_root, root_of(theirs.rank), "{msg}");
                assert!(
                    msg.contains(&format!("root {}", root_of(r)))
                        && msg.contains(&format!("root {other_root}"))
                        && msg.contains(&format!("met rank {}", theirs.rank)),
                    "n={n}, {name}: rank {r}: {msg}"
                );
            }
        }
    }
}

/// Two would-be roots that only send to each other: below the size a send may wait for its
/// receiver (a socket's worth, or the single-copy threshold) each returns and finds the
/// mismatch at its next operation; from it on each, waiting, judges the other's data frame as
/// it arrives. At every size around that switch, by reference and over TCP only, both fail
/// with a mismatch naming both roots, never a timeout.
#[test]
fn two_would_be_roots_fail_with_a_mismatch_at_every_size_around_the_switch() {
    for cma in [true, false] {
        let mut gopts = GlooOptions::default();
        gopts.mesh.cross_memory = cma;
        for bytes in [
            4,
            16 << 10,
            (48 << 10) - 4,
            48 << 10,
            64 << 10,
            255 << 10,
            1 << 20,
        ] {
            let outs = broadcast_roots_with(&gopts, 2, bytes / 4, |r| r);
            for (r, e) in outs.iter().map(|o| &o.err).enumerate() {
                assert!(
                    !matches!(e, Error::Timeout { .. }),
                    "cma={cma}, {bytes} B: rank {r} timed out: {e}"
                );
                let (ours, theirs) = sides(e);
                assert_eq!(
                    (ours.root, theirs.root),
                    (Some(r), Some(1 - r)),
                    "cma={cma}, {bytes} B: {e}"
                );
            }
        }
    }
}

#[test]
fn a_large_broadcast_with_different_roots_is_a_mismatch_at_once_not_a_timeout() {
    let t0 = Instant::now();
    let errs = broadcast_roots(2, 1 << 20, |r| r);
    for (r, e) in errs.iter().enumerate() {
        let (ours, theirs) = sides(e);
        assert_eq!((ours.root, theirs.root), (Some(r), Some(1 - r)), "{e}");
        assert_eq!(ours.count, 1 << 20);
    }
    // The timeout is 60 s; no data moved, so this is far below it.
    assert!(t0.elapsed() < Duration::from_secs(30), "{:?}", t0.elapsed());
}

#[test]
fn reduce_gather_and_scatter_with_different_roots_fail_on_every_rank() {
    let n = 3;
    let root_of = |r: usize| usize::from(r == 2);
    for op in [
        CollectiveOp::Reduce,
        CollectiveOp::Gather,
        CollectiveOp::Scatter,
    ] {
        // A failed operation aborts the group: a fresh one per op.
        let ranks = tcp_world(n, &GlooOptions::default());
        let t0 = Instant::now();
        let outs = outcomes(&ranks, |b| rooted_call(b, op, root_of(b.rank()), 12));
        // The timeout is 60 s. Every rank hears of the disagreement at once: rank 0, the root
        // of ranks 0 and 1, once waited out the timeout for rank 2's agreement frame after
        // rank 1's notice, though rank 2 sends it only to the rank it takes for the root.
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "{op}: {:?}",
            t0.elapsed()
        );
        assert_every_rank_names_a_disagreement(op, &outs, root_of, "");
    }
}

/// Every way 2 and 3 ranks can disagree about the root of a broadcast, reduce, gather or
/// scatter (2 of 4 and 24 of 27 ways to name a root each), small and (3 ranks) 1 MiB a rank,
/// and small after one call alike (so that some ranks repeat their last call, and exchange
/// no agreement frames for it) or (3 ranks) over TCP only, or both, and a sample of the
/// 4-rank ways: every rank fails, at once or within its next two operations, naming a
/// disagreement, and none waits for its timeout. Among the cases this
/// found: a reduce's or gather's would-be roots each waited for the other's data (roots
/// [0, 1, 2] of a gather), a reduce's root waited its whole timeout for a frame after another
/// rank's notice, and in a reduce with roots [1, 0, 0] every rank sent, none received, and
/// every rank's next barrier through the group area returned Ok.
#[test]
fn every_way_of_disagreeing_about_the_root_fails_every_rank_at_once() {
    let ways = |n: usize| {
        (0..n.pow(n as u32)).map(move |code| {
            (0..n)
                .map(|i| code / n.pow(i as u32) % n)
                .collect::<Vec<usize>>()
        })
    };
    let disagree = |roots: &Vec<usize>| roots.iter().any(|&r| r != roots[0]);
    let mut tcp_only = GlooOptions::default();
    tcp_only.mesh.transport = TransportMode::Tcp;
    tcp_only.mesh.cross_memory = false;
    let default = GlooOptions::default();
    // (roots, bytes a rank, options, whether every rank first runs the op alike from root 0)
    let mut cases: Vec<(Vec<usize>, usize, &GlooOptions, bool)> = Vec::new();
    cases.extend(ways(2).filter(disagree).map(|r| (r, 12, &default, false)));
    for bytes in [12, 1 << 20] {
        cases.extend(
            ways(3)
                .filter(disagree)
                .map(|r| (r, bytes, &default, false)),
        );
    }
    cases.extend(ways(3).filter(disagree).map(|r| (r, 12, &tcp_only, false)));
    // A reduce's or gather's root advises the others only when its call differs from its
    // last; a small broadcast's or scatter's ranks that repeat their last call exchange no
    // agreement frames.
    cases.extend(ways(2).filter(disagree).map(|r| (r, 12, &default, true)));
    cases.extend(ways(3).filter(disagree).map(|r| (r, 12, &default, true)));
    cases.extend(ways(3).filter(disagree).map(|r| (r, 12, &tcp_only, true)));
    // Every 5th of the 256 ways (a step prime to 4, so that every rank's root varies).
    cases.extend(
        ways(4)
            .step_by(5)
            .filter(disagree)
            .map(|r| (r, 12, &default, false)),
    );
    // After a reduce from root 0, one rank naming another root; over TCP their binomial
    // trees waited in a cycle while the rank taken for the root, which only sent, excused the
    // changed rank's frame in its next operation (as a lazy root's deferred one).
    for roots in [vec![0, 0, 0, 1], vec![0, 3, 0, 0]] {
        cases.push((roots.clone(), 12, &tcp_only, true));
        cases.push((roots, 12, &default, true));
    }
    cases.extend(
        ways(4)
            .step_by(5)
            .filter(disagree)
            .map(|r| (r, 12, &tcp_only, true)),
    );
    for (roots, bytes, gopts, after_one_alike) in &cases {
        let root_of = |r: usize| roots[r];
        for op in [
            CollectiveOp::Broadcast,
            CollectiveOp::Reduce,
            CollectiveOp::Gather,
            CollectiveOp::Scatter,
        ] {
            let ranks = tcp_world(roots.len(), gopts);
            if *after_one_alike {
                on_all(&ranks, |b| {
                    rooted_call(b, op, 0, *bytes).expect("ranks agree")
                });
            }
            let t0 = Instant::now();
            let outs =
                outcomes_within(&ranks, 2, |b| rooted_call(b, op, root_of(b.rank()), *bytes));
            let case = format!(
                "roots {roots:?}, {bytes} B, {:?}, after one alike: {after_one_alike}",
                gopts.mesh.transport
            );
            assert!(
                t0.elapsed() < Duration::from_secs(30),
                "{op}, {case}: {:?}",
                t0.elapsed()
            );
            assert_every_rank_names_a_disagreement(op, &outs, root_of, &case);
        }
    }
}

/// Rank `b` runs `op` (a rooted one) from `root` on `bytes` bytes a rank.
fn rooted_call(
    b: &GlooBackend,
    op: CollectiveOp,
    root: usize,
    bytes: usize,
) -> dist_backend::Result<()> {
    let n = b.world_size();
    let mine = vec![1u8; bytes];
    let mut all = vec![0u8; bytes * n];
    let is_root = b.rank() == root;
    match op {
        CollectiveOp::Broadcast => {
            let mut v = mine;
            b.broadcast(BufMut::Host(&mut v), DType::U8, root, &opts())
        }
        CollectiveOp::Reduce => {
            let mut v = mine;
            b.reduce(
                BufMut::Host(&mut v),
                DType::U8,
                ReduceOp::Sum,
                root,
                &opts(),
            )
        }
        CollectiveOp::Gather => b.gather(
            BufRef::Host(&mine),
            is_root.then_some(BufMut::Host(&mut all)),
            DType::U8,
            root,
            &opts(),
        ),
        CollectiveOp::Scatter => {
            let mut out = vec![0u8; bytes];
            b.scatter(
                is_root.then_some(BufRef::Host(&all)),
                BufMut::Host(&mut out),
                DType::U8,
                root,
                &opts(),
            )
        }
        other => panic!("{other} is not rooted"),
    }
}

/// Every rank of a rooted `op` run with the roots `root_of` failed naming a disagreement: a
/// root, or a rank whose own part was consistent, at its next operation or from the rank that
/// found it; any other with its own side and another root.
fn assert_every_rank_names_a_disagreement(
    op: CollectiveOp,
    outs: &[Outcome],
    root_of: impl Fn(usize) -> usize + Copy,
    case: &str,
) {
    for (r, o) in outs.iter().enumerate() {
        let e = &o.err;
        if o.returned || matches!(e, Error::MismatchReported { .. }) {
            assert_names_a_disagreement(e, op, root_of);
            continue;
        }
        let (ours, theirs) = sides(e);
        assert_eq!(ours.op, op, "{op} {case}: rank {r}: {e}");
        assert_eq!(ours.root, Some(root_of(r)), "{op} {case}: rank {r}: {e}");
        assert_ne!(theirs.root, ours.root, "{op} {case}: rank {r}: {e}");
    }
}

/// Ranks 0 and 1 call `mismatched`, ranks 2 and 3 `matching`; every rank's error must say
/// mismatch and name two ranks whose calls differ.
fn two_disagree_with_two(
    what: &str,
    mismatched: impl Fn(&GlooBackend) -> dist_backend::Result<()> + Sync,
    matching: impl Fn(&GlooBackend) -> dist_backend::Result<()> + Sync,
) {
    let ranks = tcp_world(4, &GlooOptions::default());
    let errs = on_all(&ranks, |b| {
        let r = if b.rank() < 2 {
            mismatched(b)
        } else {
            matching(b)
        };
        match r {
            Err(e) => e,
            // The root of a rooted op hears of it at its next operation.
            Ok(()) => b
                .barrier(&opts())
                .expect_err("a rank of a mismatched collective must not succeed"),
        }
    });
    for (r, e) in errs.iter().enumerate() {
        let msg = e.to_string();
        assert!(
            matches!(e, Error::Mismatch { .. } | Error::MismatchReported { .. }),
            "{what}: rank {r} must say mismatch: {msg}"
        );
        let (a, b) = sides(e);
        assert_ne!(a.rank, b.rank, "{what}: rank {r}: {msg}");
        assert_ne!(
            OpDesc { rank: 0, ..a },
            OpDesc { rank: 0, ..b },
            "{what}: rank {r}: the two calls named must differ: {msg}"
        );
        assert!(msg.contains(&format!(" met rank {}", b.rank)), "{msg}");
    }
}

#[test]
fn a_count_mismatch_between_two_ranks_reaches_every_rank() {
    const COUNT: usize = 256 * 1024 / 4;
    two_disagree_with_two(
        "count",
        |b| sum_ones(b, COUNT + 1 + b.rank()),
        |b| sum_ones(b, COUNT),
    );
}

#[test]
fn an_op_mismatch_between_two_ranks_reaches_every_rank() {
    two_disagree_with_two(
        "op",
        |b| {
            let mut v = vec![1.0f32; 4096];
            b.broadcast(
                BufMut::Host(bytemuck::cast_slice_mut(&mut v)),
                DType::F32,
                0,
                &opts(),
            )
        },
        |b| sum_ones(b, 4096),
    );
}

#[test]
fn reduce_op_and_dtype_mismatches_between_two_ranks_reach_every_rank() {
    let all_reduce = |dtype: DType, op: ReduceOp| {
        move |b: &GlooBackend| {
            let mut v = vec![0u8; 64];
            b.all_reduce(BufMut::Host(&mut v), dtype, op, &opts())
        }
    };
    two_disagree_with_two(
        "reduce op",
        all_reduce(DType::F32, ReduceOp::Max),
        all_reduce(DType::F32, ReduceOp::Sum),
    );
    two_disagree_with_two(
        "dtype",
        all_reduce(DType::I32, ReduceOp::Sum),
        all_reduce(DType::F32, ReduceOp::Sum),
    );
}

#[test]
fn split_sizes_that_differ_with_the_same_total_are_a_mismatch() {
    let ranks = tcp_world(2, &GlooOptions::default());
    let errs = on_all(&ranks, |b| {
        // Both ranks gather 6 elements in all, but disagree on who contributes how many.
        let counts: [usize; 2] = if b.rank() == 0 { [2, 4] } else { [4, 2] };
        let input = vec![1u8; counts[b.rank()]];
        let mut output = vec![0u8; 6];
        b.all_gather(
            BufRef::Host(&input),
            BufMut::Host(&mut output),
            DType::U8,
            &counts,
            &opts(),
        )
        .unwrap_err()
    });
    for (r, e) in errs.iter().enumerate() {
        let (ours, theirs) = sides(e);
        assert_eq!((ours.rank, theirs.rank), (r, 1 - r), "{e}");
        assert_ne!(ours.splits, theirs.splits, "{e}");
        assert!(e.to_string().contains("split sizes #"), "{e}");
    }
}

/// `PremulSum` scales that differ between ranks are a mismatch like any other reduce-op one,
/// on every rank, in all_reduce and in reduce (with either agreement scheme); equal scales work.
#[test]
fn premul_sum_scales_that_differ_are_a_mismatch_on_every_rank() {
    let n = 3;
    let scale_of = |r: usize| if r == 2 { 0.25 } else { 0.5 };
    for (what, fused) in [("all_reduce", 16), ("reduce", 16), ("reduce", 1)] {
        let ranks = tcp_world(
            n,
            &GlooOptions {
                fused_agreement_max_ranks: Some(fused),
                ..GlooOptions::default()
            },
        );
        let run = |b: &GlooBackend, scale: f64| {
            let mut v = vec![1f32; 8];
            let buf = BufMut::Host(bytemuck::cast_slice_mut(&mut v));
            let op = ReduceOp::PremulSum(scale);
            let r = if what == "all_reduce" {
                b.all_reduce(buf, DType::F32, op, &opts())
            } else {
                b.reduce(buf, DType::F32, op, 0, &opts())
            };
            r.map(|()| v[0])
        };
        // The same scale everywhere: 3 × 0.5 on every rank (all_reduce) or the root.
        let ok = on_all(&ranks, |b| run(b, 0.5));
        for (r, v) in ok.iter().enumerate() {
            let v = v
                .as_ref()
                .unwrap_or_else(|e| panic!("{what}: rank {r}: {e}"));
            if what == "all_reduce" || r == 0 {
                assert_eq!(*v, 1.5, "{what}: rank {r}");
            }
        }
        // A rank that only sends (reduce's leaves) may return and fail at its next operation.
        let outs = outcomes(&ranks, |b| run(b, scale_of(b.rank())).map(drop));
        for (r, e) in outs.iter().map(|o| &o.err).enumerate() {
            let (ours, theirs) = sides(e);
            assert_ne!(ours.reduce_arg, theirs.reduce_arg, "{what}: rank {r}: {e}");
            assert_eq!((ours.reduce, theirs.reduce), (Some(8), Some(8)), "{e}");
            assert!(e.to_string().contains("scale #"), "{what}: rank {r}: {e}");
        }
    }
}

/// A receiver that waits on a peer that will never send to it (the peer named another root,
/// got its data and returned) finds the disagreement in the frames other ranks sent it, not
/// at the timeout, even while no rank runs another operation: rank 3 names root 1, whose
/// subtree it waits in; ranks 0-2 name root 0 and rank 2 forwards 0's data to rank 3.
#[test]
fn a_waiting_receiver_finds_the_disagreement_in_frames_it_does_not_wait_for() {
    let n = 4;
    let root_of = |r: usize| usize::from(r == 3);
    for round in 0..5 {
        let ranks = tcp_world(n, &GlooOptions::default());
        // No rank starts its next operation before every rank has its broadcast's outcome, so
        // rank 3 cannot learn of it from a frame of that operation.
        let settled = std::sync::Barrier::new(n);
        let t0 = Instant::now();
        let outs = outcomes(&ranks, |b| {
            let mut v = vec![b.rank() as f32; 100];
            let r = b.broadcast(
                BufMut::Host(bytemuck::cast_slice_mut(&mut v)),
                DType::F32,
                root_of(b.rank()),
                &opts(),
            );
            settled.wait();
            r
        });
        assert!(t0.elapsed() < Duration::from_secs(30), "{:?}", t0.elapsed());
        for (r, o) in outs.iter().enumerate() {
            assert!(
                !matches!(o.err, Error::Timeout { .. }),
                "round {round}: rank {r}: {}",
                o.err
            );
            assert_names_a_disagreement(&o.err, CollectiveOp::Broadcast, root_of);
        }
        assert!(!outs[3].returned, "rank 3 never gets data from its root");
        let (a, b) = sides(&outs[3].err);
        let mut roots = [a.root, b.root];
        roots.sort();
        assert_eq!(roots, [Some(0), Some(1)], "round {round}: {}", outs[3].err);
    }
}

/// Runs `f` on every rank, which returns the error its operation must end with; checks that
/// they took less than half of [`opts`]' timeout (a mismatch found by timing out is a failure).
fn errors_long_before_the_timeout(
    ranks: &[GlooBackend],
    what: &str,
    f: impl Fn(&GlooBackend) -> Error + Sync,
) -> Vec<Error> {
    let t0 = Instant::now();
    let errs = on_all(ranks, f);
    assert!(
        t0.elapsed() < opts().timeout / 2,
        "{what}: {:?}",
        t0.elapsed()
    );
    errs
}

/// A rank that runs an all_reduce while the others run a barrier: every rank fails with a
/// mismatch naming a barrier and an all_reduce, over every driver (through shared memory the
/// barrier sends no frame, so the ranks in it must find the all_reduce's frames among what
/// arrives while they wait), and none waits for its timeout.
#[test]
fn a_barrier_met_by_another_operation_fails_every_rank_at_once() {
    for &(driver, make) in DRIVERS {
        for n in 2..=4 {
            let ranks = common::world(make, n, &GlooOptions::default());
            let errs = errors_long_before_the_timeout(&ranks, &format!("{driver} {n}"), |b| {
                if b.rank() == 1 {
                    sum_ones(b, 16).expect_err("the others run a barrier")
                } else {
                    b.barrier(&opts()).expect_err("rank 1 runs an all_reduce")
                }
            });
            for (r, e) in errs.iter().enumerate() {
                let (a, b) = sides(e);
                let mut ops = [a.op, b.op];
                ops.sort_by_key(|op| op.name());
                assert_eq!(
                    ops,
                    [CollectiveOp::AllReduce, CollectiveOp::Barrier],
                    "{driver} {n} ranks, rank {r}: {e}"
                );
            }
        }
    }
}

/// Ranks that disagree on the size of a small all_reduce where one rank's buffer goes through
/// the shared-memory group area (4 KiB) and another's is too large for it and goes over
/// messages: each finds the other's choice (a frame of this very operation, or no arrival and
/// an abort notice), so every rank fails with a mismatch naming both counts, over every driver,
/// and none waits for its timeout.
#[test]
fn an_all_reduce_whose_sizes_straddle_the_shared_memory_area_fails_every_rank_at_once() {
    for &(driver, make) in DRIVERS {
        for n in 2..=4 {
            let ranks = common::world(make, n, &GlooOptions::default());
            let errs = errors_long_before_the_timeout(&ranks, &format!("{driver} {n}"), |b| {
                let count = if b.rank() == 1 { 2000 } else { 1000 };
                sum_ones(b, count).expect_err("the counts differ")
            });
            for (r, e) in errs.iter().enumerate() {
                let (a, b) = sides(e);
                let mut counts = [a.count, b.count];
                counts.sort();
                assert_eq!(counts, [1000, 2000], "{driver} {n} ranks, rank {r}: {e}");
                assert!(
                    a.op == CollectiveOp::AllReduce && b.op == CollectiveOp::AllReduce,
                    "{driver} {n} ranks, rank {r}: {e}"
                );
            }
        }
    }
}
