//! Copies into an operation's output that nothing reads again within the operation: a rank's
//! own block of an all-gather or all-to-all, and what a shared-memory link copies out of its
//! ring for the data-movement collectives.
//!
//! From a few MiB up the output no longer fits the caches the caller would read it from, and a
//! plain store first reads each destination line from memory: a third of a copy's traffic,
//! which `dist_simd::copy::streaming` (non-temporal stores) does without. Measured on a 2-core
//! AMD EPYC (docs/BENCHMARKS.md): a 64 MiB copy at 17-18 GB/s against 8.7-13 for
//! `copy_from_slice`, a ring-to-output copy at 24-26 against 15-16.

/// The smallest output (or message) copied with stores that bypass the cache.
pub(crate) const STREAMING_BYTES: usize = 8 << 20;

/// Copies `src` into `dst`, which nothing reads again soon: bypassing the cache from
/// [`STREAMING_BYTES`], below with `dist_simd::copy::bulk` (`memcpy` but where it is slow).
pub(crate) fn copy_to_output(dst: &mut [u8], src: &[u8]) {
    if dst.len() >= STREAMING_BYTES {
        dist_simd::copy::streaming(dst, src);
    } else {
        dist_simd::copy::bulk(dst, src);
    }
}
