//! Agreement on what chooses the algorithms, once per group, when its mesh is built.
//!
//! Why: each rank picks an operation's algorithm from the buffer size and its own settings
//! (`small_bytes`, `segment_bytes`, `fused_agreement_max_ranks`, `broadcast_scatter_bytes`,
//! `halving_doubling_bytes`, `ring_piece_bytes`, the `area_*_bytes`), and whether roots
//! verify lazily.
//! Ranks whose settings differ would run different algorithms for the same call; the frames'
//! step tags catch that (a mismatch naming both ranks' algorithm steps, passed to every rank
//! by the abort notice, which is all a backend built with `GlooBackend::over` gets), but only
//! at the first call whose size the settings split differently, which may be hours into a
//! job. Every rank compares every rank's settings through the store when the group is built
//! instead, so every rank refuses the group at once, naming the setting and a rank that
//! differs. The values compared are the resolved ones (an unset setting takes a default that
//! depends on the mesh), so a rank that sets the value the others' default resolves to agrees.

use std::time::Instant;

use dist_backend::{Error, Result, Store};

/// The settings that choose algorithms, as space-separated `name=value` pairs (in the order
/// given, which every rank must use alike).
pub(crate) fn settings(pairs: &[(&str, String)]) -> String {
    pairs
        .iter()
        .map(|(name, v)| format!("{name}={v}"))
        .collect::<Vec<_>>()
        .join(" ")
}

fn key(prefix: &str, rank: usize) -> String {
    format!("{prefix}/gloo-algorithms/{rank}")
}

/// Publishes this rank's [`settings`] for [`check`].
pub(crate) fn publish(
    store: &dyn Store,
    prefix: &str,
    rank: usize,
    mine: &str,
    deadline: Instant,
) -> Result<()> {
    store.set_by(&key(prefix, rank), mine.as_bytes(), deadline)?;
    Ok(())
}

/// Fails unless every rank published the same settings as `mine`; the error names the first
/// setting and rank that differ. Waits until `deadline` for every rank to have published.
pub(crate) fn check(
    store: &dyn Store,
    prefix: &str,
    rank: usize,
    world_size: usize,
    mine: &str,
    deadline: Instant,
) -> Result<()> {
    let keys: Vec<String> = (0..world_size).map(|r| key(prefix, r)).collect();
    let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
    let all = store.multi_get_by(&refs, deadline)?;
    for (r, theirs) in all.iter().enumerate() {
        let theirs = String::from_utf8_lossy(theirs);
        if theirs == mine {
            continue;
        }
        let differs = mine
            .split(' ')
            .zip(theirs.split(' '))
            .find(|(a, b)| a != b)
            .map_or_else(
                || format!("{theirs:?} against this rank's {mine:?}"),
                |(a, b)| format!("{b} against this rank's {a}"),
            );
        return Err(Error::invalid(
            rank,
            "init",
            format!(
                "algorithm settings mismatch: rank {r} has {differs}; ranks that choose algorithms \
                 differently would run different algorithms for the same call (set \
                 DIST_GLOO_SMALL_BYTES, DIST_GLOO_SEGMENT_BYTES, DIST_GLOO_BCAST_SCATTER_BYTES, \
                 DIST_GLOO_HALVING_DOUBLING_BYTES, DIST_GLOO_RING_PIECE_BYTES, \
                 DIST_GLOO_AREA_ALL_REDUCE_BYTES, \
                 DIST_GLOO_AREA_ALL_GATHER_BYTES, DIST_GLOO_AREA_BROADCAST_MIN_BYTES, \
                 DIST_GLOO_AREA_ALL_TO_ALL_BYTES, \
                 DIST_GLOO_EAGER_ROOT and GlooOptions alike on every rank)"
            ),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use dist_backend::store::HashStore;

    use super::*;

    #[test]
    fn the_first_setting_that_differs_is_named_with_the_rank() {
        let store = HashStore::new(Duration::from_secs(5));
        let soon = Instant::now() + Duration::from_secs(5);
        let a = settings(&[
            ("small_bytes", "16384".into()),
            ("halving_doubling_bytes", "65536".into()),
        ]);
        let b = settings(&[
            ("small_bytes", "0".into()),
            ("halving_doubling_bytes", "65536".into()),
        ]);
        publish(&store, "g", 0, &a, soon).unwrap();
        publish(&store, "g", 1, &b, soon).unwrap();
        publish(&store, "g", 2, &a, soon).unwrap();
        let e = check(&store, "g", 0, 3, &a, soon).unwrap_err().to_string();
        assert!(
            e.contains("rank 1 has small_bytes=0 against this rank's small_bytes=16384"),
            "{e}"
        );
        let e = check(&store, "g", 1, 3, &b, soon).unwrap_err().to_string();
        assert!(e.contains("rank 0 has small_bytes=16384"), "{e}");
        publish(&store, "h", 0, &a, soon).unwrap();
        check(&store, "h", 0, 1, &a, soon).unwrap();
    }
}
