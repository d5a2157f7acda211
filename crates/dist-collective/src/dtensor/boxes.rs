//! Copying boxes between row-major buffers: the one local data movement redistribution needs
//! (slicing a shard out, packing per-rank comm blocks, placing received blocks).

/// Row-major strides of `shape`.
fn strides(shape: &[usize]) -> Vec<usize> {
    let mut s = vec![1; shape.len()];
    for d in (0..shape.len().saturating_sub(1)).rev() {
        s[d] = s[d + 1] * shape[d + 1];
    }
    s
}

/// Copies the box of extent `extent` starting at `src_off` of the row-major tensor `src` (of
/// `src_shape`) to `dst_off` of `dst` (of `dst_shape`). All shapes have the same rank; a 0-D
/// box is one element. Callers guarantee the box lies inside both tensors.
pub(crate) fn copy_box<T: Copy>(
    src: &[T],
    src_shape: &[usize],
    src_off: &[usize],
    dst: &mut [T],
    dst_shape: &[usize],
    dst_off: &[usize],
    extent: &[usize],
) {
    let nd = extent.len();
    if nd == 0 {
        dst[0] = src[0];
        return;
    }
    if extent.contains(&0) {
        return;
    }
    let (ss, ds) = (strides(src_shape), strides(dst_shape));
    let run = extent[nd - 1];
    let rows: usize = extent[..nd - 1].iter().product();
    // Odometer over every dimension but the last; each step copies one contiguous run.
    let mut idx = vec![0usize; nd - 1];
    for _ in 0..rows {
        let mut s = src_off[nd - 1];
        let mut t = dst_off[nd - 1];
        for d in 0..nd - 1 {
            s += (src_off[d] + idx[d]) * ss[d];
            t += (dst_off[d] + idx[d]) * ds[d];
        }
        dst[t..t + run].copy_from_slice(&src[s..s + run]);
        for d in (0..nd - 1).rev() {
            idx[d] += 1;
            if idx[d] < extent[d] {
                break;
            }
            idx[d] = 0;
        }
    }
}

/// The box of `extent` at `off` of `src` (of `src_shape`) as its own row-major buffer.
pub(crate) fn slice_box<T: Copy + bytemuck::Zeroable>(
    src: &[T],
    src_shape: &[usize],
    off: &[usize],
    extent: &[usize],
) -> Vec<T> {
    let mut out = vec![T::zeroed(); extent.iter().product()];
    let zero = vec![0; extent.len()];
    copy_box(src, src_shape, off, &mut out, extent, &zero, extent);
    out
}

/// `shape` with dimension `dim` replaced by `len`.
pub(crate) fn with_dim(shape: &[usize], dim: usize, len: usize) -> Vec<usize> {
    let mut s = shape.to_vec();
    s[dim] = len;
    s
}

/// An offset vector that is zero except `at` along `dim`.
pub(crate) fn offset_along(ndim: usize, dim: usize, at: usize) -> Vec<usize> {
    let mut o = vec![0; ndim];
    o[dim] = at;
    o
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn boxes_copy_the_right_elements() {
        // 3x4 tensor 0..12; box rows 1..3, cols 1..3.
        let src: Vec<u32> = (0..12).collect();
        assert_eq!(slice_box(&src, &[3, 4], &[1, 1], &[2, 2]), [5, 6, 9, 10]);
        assert_eq!(slice_box(&src, &[3, 4], &[0, 3], &[3, 1]), [3, 7, 11]);
        assert!(slice_box(&src, &[3, 4], &[0, 0], &[0, 4]).is_empty());
        assert_eq!(slice_box(&[7u8], &[], &[], &[]), [7]);
        let mut dst = vec![0u32; 6];
        copy_box(&src, &[3, 4], &[2, 2], &mut dst, &[2, 3], &[1, 1], &[1, 2]);
        assert_eq!(dst, [0, 0, 0, 0, 10, 11]);
        // 3-D: [2, 2, 3], take [.., 1.., 1..].
        let src: Vec<u32> = (0..12).collect();
        assert_eq!(
            slice_box(&src, &[2, 2, 3], &[0, 1, 1], &[2, 1, 2]),
            [4, 5, 10, 11]
        );
    }
}
