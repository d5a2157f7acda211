//! Copies into an operation's output that nothing reads again within the operation: a rank's
//! own block of an all-gather, gather or all-to-all, and what a shared-memory link copies out
//! of its ring for the data-movement collectives.
//!
//! From a few MiB up the output no longer fits the caches the caller would read it from, and a
//! plain store first reads each destination line from memory: a third of a copy's traffic,
//! which `dist_simd::copy::streaming` (non-temporal stores) does without. Measured on a 2-core
//! AMD EPYC (docs/BENCHMARKS.md): a 64 MiB copy at 17-18 GB/s against 8.7-13 for
//! `copy_from_slice`, a ring-to-output copy at 24-26 against 15-16.
//!
//! What leaves the caches is the outputs of every rank on the host together, not one copy:
//! 4 ranks on that host (32 MiB of last-level cache), each with a 16 MiB output, lose it even
//! where a rank's own block is 4 MiB. There, streaming the own block took all_gather of 4 MiB
//! per rank from 5969 to 5355 us and all_to_all of 16 MiB from 6899 to 6057 (8 MiB: 2615 to
//! 2292), medians of 6 runs alternated; 2 ranks with 8 MiB outputs, which fit together, lost
//! (all_gather of 4 MiB: 630 against 910).

use std::sync::OnceLock;

/// The smallest output (or message) copied with stores that bypass the cache.
pub(crate) const STREAMING_BYTES: usize = 8 << 20;

/// The smallest own block that [`copy_into_output`] streams for its output's sake: below it
/// the copy is too short for the stores' cost to matter either way.
const OWN_BLOCK_STREAMING_MIN_BYTES: usize = 64 << 10;

/// Copies `src` into `dst`, which nothing reads again soon: bypassing the cache from
/// [`STREAMING_BYTES`], below with `dist_simd::copy::bulk` (`memcpy` but where it is slow).
pub(crate) fn copy_to_output(dst: &mut [u8], src: &[u8]) {
    copy_into_output(dst, src, false);
}

/// [`copy_to_output`] of one block of an output that `output_leaves_cache` (see
/// [`output_leaves_cache_bytes`]): then bypassing the cache from
/// [`OWN_BLOCK_STREAMING_MIN_BYTES`] too.
pub(crate) fn copy_into_output(dst: &mut [u8], src: &[u8], output_leaves_cache: bool) {
    let stream = dst.len() >= STREAMING_BYTES
        || (output_leaves_cache && dst.len() >= OWN_BLOCK_STREAMING_MIN_BYTES);
    if stream {
        dist_simd::copy::streaming(dst, src);
    } else {
        dist_simd::copy::bulk(dst, src);
    }
}

/// The size of one rank's output from which the outputs of `local_ranks` ranks on this host
/// together exceed its last-level cache; `usize::MAX` where the cache's size is unknown.
pub(crate) fn output_leaves_cache_bytes(local_ranks: usize) -> usize {
    last_level_cache_bytes().map_or(usize::MAX, |c| c.div_ceil(local_ranks.max(1)))
}

/// The size of the highest-level cache of CPU 0, read once from sysfs.
fn last_level_cache_bytes() -> Option<usize> {
    static CACHE: OnceLock<Option<usize>> = OnceLock::new();
    *CACHE.get_or_init(|| {
        let dir = std::fs::read_dir("/sys/devices/system/cpu/cpu0/cache").ok()?;
        dir.filter_map(|e| {
            let path = e.ok()?.path();
            let read = |f: &str| std::fs::read_to_string(path.join(f)).ok();
            let level: u32 = read("level")?.trim().parse().ok()?;
            Some((level, parse_cache_size(&read("size")?)?))
        })
        .max()
        .map(|(_, bytes)| bytes)
    })
}

/// A sysfs cache size (`32768K`, `8M`, `512`) in bytes.
fn parse_cache_size(s: &str) -> Option<usize> {
    let s = s.trim();
    let (digits, unit) = match s.char_indices().find(|(_, c)| !c.is_ascii_digit()) {
        Some((i, _)) => s.split_at(i),
        None => (s, ""),
    };
    let n: usize = digits.parse().ok()?;
    match unit {
        "" => Some(n),
        "K" => n.checked_mul(1 << 10),
        "M" => n.checked_mul(1 << 20),
        "G" => n.checked_mul(1 << 30),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sysfs_cache_sizes_parse_in_bytes() {
        assert_eq!(parse_cache_size("32768K\n"), Some(32 << 20));
        assert_eq!(parse_cache_size("8M"), Some(8 << 20));
        assert_eq!(parse_cache_size("512"), Some(512));
        assert_eq!(parse_cache_size("12X"), None);
        assert_eq!(parse_cache_size(""), None);
    }

    #[test]
    fn outputs_leave_the_cache_sooner_the_more_ranks_share_it() {
        let one = output_leaves_cache_bytes(1);
        let four = output_leaves_cache_bytes(4);
        assert!(four <= one);
        if one != usize::MAX {
            assert_eq!(four, one.div_ceil(4));
        }
        assert_eq!(output_leaves_cache_bytes(0), one);
    }
}
