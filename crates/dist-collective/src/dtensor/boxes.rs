//! Cutting and joining row-major buffers along one dimension: the only local data movement
//! redistribution needs (slicing a shard out, packing per-rank comm blocks, joining received
//! blocks). A tensor viewed as `[outer, len_d, inner]` makes every piece a run of `outer`
//! contiguous slabs, so both are `extend_from_slice` loops with no zero-filling.

use std::ops::Range;

/// `(product of the dims before d, product of the dims after d)`.
fn outer_inner(shape: &[usize], d: usize) -> (usize, usize) {
    (shape[..d].iter().product(), shape[d + 1..].iter().product())
}

/// The parts `ranges` of `src` (of `shape`) along `d`, each made contiguous, in order.
pub(crate) fn take_along<T: Copy>(
    src: &[T],
    shape: &[usize],
    d: usize,
    ranges: &[Range<usize>],
) -> Vec<T> {
    let (outer, inner) = outer_inner(shape, d);
    let row = shape[d] * inner;
    let total: usize = ranges.iter().map(|r| r.len() * outer * inner).sum();
    let mut out = Vec::with_capacity(total);
    for r in ranges {
        for o in 0..outer {
            let at = o * row + r.start * inner;
            out.extend_from_slice(&src[at..at + r.len() * inner]);
        }
    }
    out
}

/// Contiguous blocks laid one after another, block `i` being `shape` with `lens[i]` along `d`
/// (`shape[d]` itself is ignored), joined along `d` into one tensor (no copy when nothing
/// precedes `d`: the blocks are then already in place).
pub(crate) fn join_along<T: Copy>(
    blocks: Vec<T>,
    shape: &[usize],
    d: usize,
    lens: &[usize],
) -> Vec<T> {
    let (outer, inner) = outer_inner(shape, d);
    if outer == 1 {
        return blocks;
    }
    let mut starts = Vec::with_capacity(lens.len());
    let mut at = 0;
    for &l in lens {
        starts.push(at);
        at += l * outer * inner;
    }
    let mut out = Vec::with_capacity(blocks.len());
    for o in 0..outer {
        for (&l, &s) in lens.iter().zip(&starts) {
            let n = l * inner;
            out.extend_from_slice(&blocks[s + o * n..s + (o + 1) * n]);
        }
    }
    out
}

/// `shape` with dimension `dim` replaced by `len`.
pub(crate) fn with_dim(shape: &[usize], dim: usize, len: usize) -> Vec<usize> {
    let mut s = shape.to_vec();
    s[dim] = len;
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    #[allow(clippy::single_range_in_vec_init)] // one part, on purpose
    fn take_and_join_are_inverse_along_any_dim() {
        // 3x4 tensor 0..12.
        let src: Vec<u32> = (0..12).collect();
        assert_eq!(take_along(&src, &[3, 4], 1, &[1..3]), [1, 2, 5, 6, 9, 10]);
        assert_eq!(take_along(&src, &[3, 4], 0, &[2..3]), [8, 9, 10, 11]);
        assert!(take_along(&src, &[3, 4], 1, &[4..4]).is_empty());
        let parts = [0..3, 3..4];
        let packed = take_along(&src, &[3, 4], 1, &parts);
        assert_eq!(packed, [0, 1, 2, 4, 5, 6, 8, 9, 10, 3, 7, 11]);
        assert_eq!(join_along(packed.clone(), &[3, 4], 1, &[3, 1]), src);
        // 3-D [2, 3, 2], split the middle dim 2 + 0 + 1.
        let src: Vec<u32> = (0..12).collect();
        let parts = [0..2, 2..2, 2..3];
        let packed = take_along(&src, &[2, 3, 2], 1, &parts);
        assert_eq!(join_along(packed.clone(), &[2, 3, 2], 1, &[2, 0, 1]), src);
    }
}
