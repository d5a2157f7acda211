//! Helpers shared by the tensor-parallel and batch-norm tests: deterministic values, a
//! closeness check, a batch norm with given parameters. Each test crate uses a part.
#![allow(dead_code)]

use dist_collective::ProcessGroup;
use dist_parallel::{BatchNormOptions, SyncBatchNorm};

/// `n` deterministic values in [-1, 1) from `seed` (xorshift64*), rounded to f32 so an f32
/// model and an f64 reference start from exactly the same numbers.
pub(crate) fn values(n: usize, seed: u64) -> Vec<f64> {
    let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|_| {
            s ^= s >> 12;
            s ^= s << 25;
            s ^= s >> 27;
            let u = (s.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 40) as f64 / (1u64 << 24) as f64;
            ((u * 2.0 - 1.0) as f32) as f64
        })
        .collect()
}

/// [`values`] as f32.
pub(crate) fn values_f32(n: usize, seed: u64) -> Vec<f32> {
    values(n, seed).into_iter().map(|v| v as f32).collect()
}

/// Asserts `got` is within 1e-5 of `want` (relative above magnitude 1).
pub(crate) fn close<W: Copy + Into<f64>>(got: &[f32], want: &[W], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let w: f64 = w.into();
        assert!(
            (g as f64 - w).abs() <= 1e-5 * w.abs().max(1.0),
            "{what}[{i}]: {g} vs {w}"
        );
    }
}

/// A batch norm over `pg` with fresh running statistics and weight `w`, bias `b`.
pub(crate) fn fresh_bn(
    pg: ProcessGroup,
    w: &[f32],
    b: &[f32],
    opts: BatchNormOptions,
) -> SyncBatchNorm {
    let mut bn = SyncBatchNorm::new(pg, w.len(), opts);
    bn.weight = w.to_vec();
    bn.bias = b.to_vec();
    bn
}
