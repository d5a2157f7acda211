//! Reduction kernels.
//!
//! A reducing collective runs in three steps on each rank, so that every algorithm (ring,
//! halving-doubling, tree) shares one definition of every op:
//!
//! 1. [`prepare`] the local input once (`PremulSum` multiplies by its scale here);
//! 2. [`reduce_into`] pairs of partial results with the op's [`ReduceOp::combiner`];
//! 3. [`finalize`] the fully reduced result once (`Avg` divides by the rank count here).
//!
//! The kernels are plain zip loops over typed slices that the compiler vectorises. `f16` and
//! `bf16` are widened to `f32` in blocks of [`HALF_BLOCK`] elements (with F16C where the CPU has
//! it), combined in `f32`, and rounded back to nearest-even once per combine: each pairwise step
//! is therefore correctly rounded, and no intermediate overflows the half range early.
//!
//! Byte buffers that are not aligned for their dtype are handled through an aligned scratch
//! block, so callers never need to care about alignment; aligned buffers take the fast path.

use half::{bf16, f16};

use crate::halfconv::HalfConv;
use crate::{DType, Element, ReduceOp, WireError};

/// Elements widened at a time when reducing `f16`/`bf16`.
const HALF_BLOCK: usize = 512;
/// Elements copied at a time through the aligned scratch block for unaligned byte buffers.
const UNALIGNED_BLOCK: usize = 1024;

/// Per-type implementation of the three steps. Callers have already validated op and dtype.
trait Kernel: Element + Default {
    fn combine(op: ReduceOp, dst: &mut [Self], src: &[Self]);
    fn scale(buf: &mut [Self], s: f64);
    fn divide(buf: &mut [Self], n: usize);
}

#[inline(always)]
fn zip_apply<T: Copy>(dst: &mut [T], src: &[T], f: impl Fn(T, T) -> T) {
    for (d, s) in dst.iter_mut().zip(src) {
        *d = f(*d, *s);
    }
}

macro_rules! int_kernel {
    ($($t:ty),*) => {$(
        impl Kernel for $t {
            fn combine(op: ReduceOp, dst: &mut [Self], src: &[Self]) {
                match op {
                    ReduceOp::Sum | ReduceOp::Avg | ReduceOp::PremulSum(_) => {
                        zip_apply(dst, src, <$t>::wrapping_add)
                    }
                    ReduceOp::Product => zip_apply(dst, src, <$t>::wrapping_mul),
                    ReduceOp::Min => zip_apply(dst, src, |a, b| a.min(b)),
                    ReduceOp::Max => zip_apply(dst, src, |a, b| a.max(b)),
                    ReduceOp::BitAnd => zip_apply(dst, src, |a, b| a & b),
                    ReduceOp::BitOr => zip_apply(dst, src, |a, b| a | b),
                    ReduceOp::BitXor => zip_apply(dst, src, |a, b| a ^ b),
                }
            }
            fn scale(_buf: &mut [Self], _s: f64) {
                // Unreachable by validation: PremulSum is float-only.
            }
            fn divide(buf: &mut [Self], n: usize) {
                // `n` is a rank count; one that does not fit the type leaves every value
                // smaller in magnitude than n, whose truncated quotient is 0.
                match <$t>::try_from(n) {
                    Ok(d) if d != 0 => buf.iter_mut().for_each(|x| *x /= d),
                    Ok(_) => {}
                    Err(_) => buf.iter_mut().for_each(|x| *x = 0),
                }
            }
        }
    )*};
}
int_kernel!(i8, u8, i16, i32, u32, i64, u64);

macro_rules! float_kernel {
    ($($t:ty),*) => {$(
        impl Kernel for $t {
            fn combine(op: ReduceOp, dst: &mut [Self], src: &[Self]) {
                match op {
                    ReduceOp::Sum | ReduceOp::Avg | ReduceOp::PremulSum(_) => {
                        zip_apply(dst, src, |a, b| a + b)
                    }
                    ReduceOp::Product => zip_apply(dst, src, |a, b| a * b),
                    // NaN-propagating, branch-free selects.
                    ReduceOp::Min => zip_apply(dst, src, |a, b| if a < b || a.is_nan() { a } else { b }),
                    ReduceOp::Max => zip_apply(dst, src, |a, b| if a > b || a.is_nan() { a } else { b }),
                    ReduceOp::BitAnd | ReduceOp::BitOr | ReduceOp::BitXor => {}
                }
            }
            fn scale(buf: &mut [Self], s: f64) {
                let s = s as $t;
                buf.iter_mut().for_each(|x| *x *= s);
            }
            fn divide(buf: &mut [Self], n: usize) {
                let n = n as $t;
                buf.iter_mut().for_each(|x| *x /= n);
            }
        }
    )*};
}
float_kernel!(f32, f64);

/// Runs `f` over `f32` widenings of `buf` block by block, writing the results back.
fn widen_in_place<H: HalfConv>(buf: &mut [H], mut f: impl FnMut(&mut [f32])) {
    let mut wide = [0f32; HALF_BLOCK];
    for block in buf.chunks_mut(HALF_BLOCK) {
        let w = &mut wide[..block.len()];
        H::widen(block, w);
        f(w);
        H::narrow(w, block);
    }
}

macro_rules! half_kernel {
    ($($t:ty),*) => {$(
        impl Kernel for $t {
            fn combine(op: ReduceOp, dst: &mut [Self], src: &[Self]) {
                let mut wide_src = [0f32; HALF_BLOCK];
                for (d, s) in dst.chunks_mut(HALF_BLOCK).zip(src.chunks(HALF_BLOCK)) {
                    let ws = &mut wide_src[..s.len()];
                    <$t>::widen(s, ws);
                    widen_in_place(d, |wd| f32::combine(op, wd, ws));
                }
            }
            fn scale(buf: &mut [Self], s: f64) {
                widen_in_place(buf, |w| f32::scale(w, s));
            }
            fn divide(buf: &mut [Self], n: usize) {
                widen_in_place(buf, |w| f32::divide(w, n));
            }
        }
    )*};
}
half_kernel!(f16, bf16);

/// Calls `$body` with `$t` bound to the Rust type of `$dtype`.
macro_rules! dispatch {
    ($dtype:expr, $t:ident => $body:expr) => {
        match $dtype {
            DType::I8 => {
                type $t = i8;
                $body
            }
            DType::U8 => {
                type $t = u8;
                $body
            }
            DType::I16 => {
                type $t = i16;
                $body
            }
            DType::I32 => {
                type $t = i32;
                $body
            }
            DType::U32 => {
                type $t = u32;
                $body
            }
            DType::I64 => {
                type $t = i64;
                $body
            }
            DType::U64 => {
                type $t = u64;
                $body
            }
            DType::F16 => {
                type $t = f16;
                $body
            }
            DType::BF16 => {
                type $t = bf16;
                $body
            }
            DType::F32 => {
                type $t = f32;
                $body
            }
            DType::F64 => {
                type $t = f64;
                $body
            }
        }
    };
}

/// Applies `f` to `bytes` viewed as `[T]`, through an aligned scratch block if needed.
fn with_typed_mut<T: Kernel>(bytes: &mut [u8], mut f: impl FnMut(&mut [T], usize)) {
    if let Ok(typed) = bytemuck::try_cast_slice_mut::<u8, T>(bytes) {
        f(typed, 0);
        return;
    }
    let mut scratch = [T::default(); UNALIGNED_BLOCK];
    let step = UNALIGNED_BLOCK * size_of::<T>();
    for (i, chunk) in bytes.chunks_mut(step).enumerate() {
        let n = chunk.len() / size_of::<T>();
        let s = &mut scratch[..n];
        bytemuck::cast_slice_mut::<T, u8>(s).copy_from_slice(chunk);
        f(s, i * UNALIGNED_BLOCK);
        chunk.copy_from_slice(bytemuck::cast_slice(s));
    }
}

fn check_whole(dtype: DType, len: usize) -> Result<(), WireError> {
    if len.is_multiple_of(dtype.size()) {
        Ok(())
    } else {
        Err(WireError::PartialElement { len, dtype })
    }
}

/// Combines `src` into `dst` element-wise: `dst[i] = dst[i] ⊕ src[i]`, with `⊕` the op's
/// [`ReduceOp::combiner`]. Both are byte views of `dtype` elements; any alignment is accepted.
pub fn reduce_into(
    op: ReduceOp,
    dtype: DType,
    dst: &mut [u8],
    src: &[u8],
) -> Result<(), WireError> {
    op.check(dtype)?;
    if dst.len() != src.len() {
        return Err(WireError::LengthMismatch {
            dst: dst.len(),
            src: src.len(),
        });
    }
    check_whole(dtype, dst.len())?;
    dispatch!(dtype, T => {
        match bytemuck::try_cast_slice::<u8, T>(src) {
            Ok(s) => with_typed_mut::<T>(dst, |d, at| T::combine(op, d, &s[at..at + d.len()])),
            Err(_) => {
                let mut scratch = [T::default(); UNALIGNED_BLOCK];
                with_typed_mut::<T>(dst, |d, at| {
                    let bytes = &src[at * size_of::<T>()..(at + d.len()) * size_of::<T>()];
                    for (piece, run) in d.chunks_mut(UNALIGNED_BLOCK).zip(bytes.chunks(UNALIGNED_BLOCK * size_of::<T>())) {
                        let s = &mut scratch[..piece.len()];
                        bytemuck::cast_slice_mut::<T, u8>(s).copy_from_slice(run);
                        T::combine(op, piece, s);
                    }
                });
            }
        }
    });
    Ok(())
}

/// Typed form of [`reduce_into`].
pub fn reduce_slice<T: Element>(op: ReduceOp, dst: &mut [T], src: &[T]) -> Result<(), WireError> {
    reduce_into(
        op,
        T::DTYPE,
        bytemuck::cast_slice_mut(dst),
        bytemuck::cast_slice(src),
    )
}

/// Step 1: applies the op's per-input transform to a rank's own input (the `PremulSum` scale;
/// a no-op for every other op).
pub fn prepare(op: ReduceOp, dtype: DType, buf: &mut [u8]) -> Result<(), WireError> {
    op.check(dtype)?;
    check_whole(dtype, buf.len())?;
    if let ReduceOp::PremulSum(s) = op {
        dispatch!(dtype, T => with_typed_mut::<T>(buf, |b, _| T::scale(b, s)));
    }
    Ok(())
}

/// Typed form of [`prepare`].
pub fn prepare_slice<T: Element>(op: ReduceOp, buf: &mut [T]) -> Result<(), WireError> {
    prepare(op, T::DTYPE, bytemuck::cast_slice_mut(buf))
}

/// Step 3: applies the op's final transform to a fully reduced result of `nranks` inputs (the
/// `Avg` division; a no-op for every other op).
pub fn finalize(
    op: ReduceOp,
    dtype: DType,
    buf: &mut [u8],
    nranks: usize,
) -> Result<(), WireError> {
    op.check(dtype)?;
    check_whole(dtype, buf.len())?;
    if op == ReduceOp::Avg {
        dispatch!(dtype, T => with_typed_mut::<T>(buf, |b, _| T::divide(b, nranks)));
    }
    Ok(())
}

/// Typed form of [`finalize`].
pub fn finalize_slice<T: Element>(
    op: ReduceOp,
    buf: &mut [T],
    nranks: usize,
) -> Result<(), WireError> {
    finalize(op, T::DTYPE, bytemuck::cast_slice_mut(buf), nranks)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn integer_ops_match_scalar_definitions() {
        let a = [5i32, -3, i32::MAX, 12];
        let b = [2i32, 7, 1, 10];
        let cases: [(ReduceOp, [i32; 4]); 7] = [
            (ReduceOp::Sum, [7, 4, i32::MIN, 22]),
            (ReduceOp::Product, [10, -21, i32::MAX, 120]),
            (ReduceOp::Min, [2, -3, 1, 10]),
            (ReduceOp::Max, [5, 7, i32::MAX, 12]),
            (ReduceOp::BitAnd, [0, 5, 1, 8]),
            (ReduceOp::BitOr, [7, -1, i32::MAX, 14]),
            (ReduceOp::BitXor, [7, -6, i32::MAX - 1, 6]),
        ];
        for (op, want) in cases {
            let mut d = a;
            reduce_slice(op, &mut d, &b).unwrap();
            assert_eq!(d, want, "{op}");
        }
    }

    #[test]
    fn float_min_max_propagate_nan_from_either_side() {
        for op in [ReduceOp::Min, ReduceOp::Max] {
            let mut d = [f32::NAN, 1.0, 2.0];
            reduce_slice(op, &mut d, &[0.0, f32::NAN, 3.0]).unwrap();
            assert!(d[0].is_nan() && d[1].is_nan(), "{op}");
        }
        let mut d = [1.0f64, -0.5];
        reduce_slice(ReduceOp::Max, &mut d, &[2.0, -1.0]).unwrap();
        assert_eq!(d, [2.0, -0.5]);
    }

    #[test]
    fn half_sum_rounds_once_per_combine() {
        let n = 2000; // crosses block boundaries
        let a: Vec<f16> = (0..n).map(|i| f16::from_f32(i as f32 * 0.25)).collect();
        let b: Vec<f16> = (0..n)
            .map(|i| f16::from_f32(1.0 / (i as f32 + 1.0)))
            .collect();
        let mut d = a.clone();
        reduce_slice(ReduceOp::Sum, &mut d, &b).unwrap();
        for i in 0..n {
            assert_eq!(
                d[i],
                f16::from_f32(a[i].to_f32() + b[i].to_f32()),
                "index {i}"
            );
        }
        let mut bd: Vec<bf16> = a.iter().map(|x| bf16::from_f32(x.to_f32())).collect();
        let bs: Vec<bf16> = b.iter().map(|x| bf16::from_f32(x.to_f32())).collect();
        let want: Vec<bf16> = bd
            .iter()
            .zip(&bs)
            .map(|(x, y)| bf16::from_f32(x.to_f32() * y.to_f32()))
            .collect();
        reduce_slice(ReduceOp::Product, &mut bd, &bs).unwrap();
        assert_eq!(bd, want);
    }

    #[test]
    fn unaligned_byte_buffers_reduce_like_aligned_ones() {
        let n = 3000;
        let a: Vec<f64> = (0..n).map(|i| i as f64).collect();
        let b: Vec<f64> = (0..n).map(|i| (i * 3) as f64).collect();
        let mut raw_d = vec![0u8; n * 8 + 1];
        let mut raw_s = vec![0u8; n * 8 + 3];
        raw_d[1..].copy_from_slice(bytemuck::cast_slice(&a));
        raw_s[3..].copy_from_slice(bytemuck::cast_slice(&b));
        reduce_into(ReduceOp::Sum, DType::F64, &mut raw_d[1..], &raw_s[3..]).unwrap();
        let got: Vec<f64> = raw_d[1..]
            .chunks(8)
            .map(bytemuck::pod_read_unaligned)
            .collect();
        let want: Vec<f64> = (0..n).map(|i| (i * 4) as f64).collect();
        assert_eq!(got, want);
    }

    #[test]
    fn avg_truncates_integers_and_premul_scales_floats() {
        let mut v = [7i64, -7, 9];
        finalize_slice(ReduceOp::Avg, &mut v, 2).unwrap();
        assert_eq!(v, [3, -3, 4]);
        let mut f = [1.0f32, 3.0];
        prepare_slice(ReduceOp::PremulSum(0.5), &mut f).unwrap();
        assert_eq!(f, [0.5, 1.5]);
        finalize_slice(ReduceOp::Avg, &mut f, 4).unwrap();
        assert_eq!(f, [0.125, 0.375]);
    }

    #[test]
    fn bad_input_is_a_typed_error() {
        let mut d = [0u8; 6];
        assert_eq!(
            reduce_into(ReduceOp::Sum, DType::F32, &mut d, &[0u8; 6]),
            Err(WireError::PartialElement {
                len: 6,
                dtype: DType::F32
            })
        );
        assert!(matches!(
            reduce_into(ReduceOp::Sum, DType::U8, &mut d, &[0u8; 5]),
            Err(WireError::LengthMismatch { dst: 6, src: 5 })
        ));
        assert!(reduce_into(ReduceOp::BitOr, DType::BF16, &mut d, &[0u8; 6]).is_err());
    }
}
