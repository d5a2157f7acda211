//! Which ranks' keys are missing from the store, asked once an operation's wait for them has
//! failed: a diagnostic for the error, so it gets one short deadline for all its checks
//! rather than a store timeout per rank.

use std::time::{Duration, Instant};

use dist_backend::Store;

/// How long the checks of one diagnosis may take together: past the operation's deadline
/// already, they must not stretch its failure by more than this.
const GRACE: Duration = Duration::from_millis(500);

/// The indices of `keys` that the store does not hold; a key whose check fails (the store
/// stopped answering meanwhile, the grace passed) counts as missing.
pub(crate) fn missing_keys(store: &dyn Store, keys: &[&str]) -> Vec<usize> {
    let deadline = dist_backend::deadline_after(Instant::now(), GRACE);
    keys.iter()
        .enumerate()
        .filter(|(_, k)| !store.check_by(&[k], deadline).unwrap_or(false))
        .map(|(i, _)| i)
        .collect()
}
