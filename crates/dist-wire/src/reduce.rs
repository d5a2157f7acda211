//! Reduction kernels.
//!
//! A reducing collective runs in three steps on each rank, so that every algorithm (ring,
//! halving-doubling, tree) shares one definition of every op:
//!
//! 1. [`prepare`] the local input once (`PremulSum` multiplies by its scale here, and `Avg`
//!    of `f16` divides by a first part of the rank count: [`splits_average`]);
//! 2. [`reduce_into`] pairs of partial results with the op's [`ReduceOp::combiner`];
//! 3. [`finalize`] the fully reduced result once (`Avg` divides by the rank count, or what
//!    [`prepare`] left of it, here).
//!
//! The kernels are plain zip loops over typed slices that the compiler vectorises. `f16` and
//! `bf16` go through `dist-simd`, which widens each element to `f32`, applies the op and rounds
//! back to nearest-even in one pass: each pairwise step is therefore correctly rounded, and no
//! intermediate overflows the half range early. They live there, not here, because running at
//! memory speed takes F16C/AVX2 chosen at run time (this build targets baseline x86-64), which
//! takes `unsafe` that this crate forbids; the portable fallback there gives the same bits.
//!
//! Byte buffers that are not aligned for their dtype are handled through an aligned scratch
//! block, so callers never need to care about alignment; aligned buffers take the fast path.

use half::{bf16, f16};

use crate::{DType, Element, ReduceOp, WireError};

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
                // `n` is a rank count, not 0 ([`finalize`] refuses it). One that does not fit
                // the type divides in i128, where every value and `n` do: the quotient, no
                // larger in magnitude than the value, fits back (the type's MIN over a count
                // of -MIN is -1, not 0).
                match <$t>::try_from(n) {
                    Ok(d) if d != 0 => buf.iter_mut().for_each(|x| *x /= d),
                    Ok(_) => {}
                    Err(_) => buf
                        .iter_mut()
                        .for_each(|x| *x = (i128::from(*x) / n as i128) as $t),
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

/// The `dist-simd` kernels of one half type: widen, combine and narrow fused into one pass, so
/// the `f32` op runs on vector lanes between two conversions.
trait HalfKernel: Element {
    fn zip_map(dst: &mut [u16], src: &[u16], f: impl Fn(f32, f32) -> f32 + Copy);
    fn map(buf: &mut [u16], f: impl Fn(f32) -> f32 + Copy);
}

impl HalfKernel for f16 {
    fn zip_map(dst: &mut [u16], src: &[u16], f: impl Fn(f32, f32) -> f32 + Copy) {
        dist_simd::f16::zip_map(dst, src, f);
    }
    fn map(buf: &mut [u16], f: impl Fn(f32) -> f32 + Copy) {
        dist_simd::f16::map(buf, f);
    }
}

impl HalfKernel for bf16 {
    fn zip_map(dst: &mut [u16], src: &[u16], f: impl Fn(f32, f32) -> f32 + Copy) {
        dist_simd::bf16::zip_map(dst, src, f);
    }
    fn map(buf: &mut [u16], f: impl Fn(f32) -> f32 + Copy) {
        dist_simd::bf16::map(buf, f);
    }
}

/// `dst[i] = narrow(f(widen(dst[i]), widen(src[i])))`.
fn zip_half<H: HalfKernel>(dst: &mut [H], src: &[H], f: impl Fn(f32, f32) -> f32 + Copy) {
    H::zip_map(bytemuck::cast_slice_mut(dst), bytemuck::cast_slice(src), f);
}

/// `buf[i] = narrow(f(widen(buf[i])))`.
fn map_half<H: HalfKernel>(buf: &mut [H], f: impl Fn(f32) -> f32 + Copy) {
    H::map(bytemuck::cast_slice_mut(buf), f);
}

macro_rules! half_kernel {
    ($($t:ty),*) => {$(
        impl Kernel for $t {
            fn combine(op: ReduceOp, dst: &mut [Self], src: &[Self]) {
                match op {
                    ReduceOp::Sum | ReduceOp::Avg | ReduceOp::PremulSum(_) => {
                        zip_half(dst, src, |a, b| a + b)
                    }
                    ReduceOp::Product => zip_half(dst, src, |a, b| a * b),
                    ReduceOp::Min => zip_half(dst, src, |a: f32, b| if a < b || a.is_nan() { a } else { b }),
                    ReduceOp::Max => zip_half(dst, src, |a: f32, b| if a > b || a.is_nan() { a } else { b }),
                    ReduceOp::BitAnd | ReduceOp::BitOr | ReduceOp::BitXor => {}
                }
            }
            fn scale(buf: &mut [Self], s: f64) {
                let s = s as f32;
                map_half(buf, |x| x * s);
            }
            fn divide(buf: &mut [Self], n: usize) {
                let n = n as f32;
                map_half(buf, |x| x / n);
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
        dist_simd::copy::bulk(bytemuck::cast_slice_mut::<T, u8>(s), chunk);
        f(s, i * UNALIGNED_BLOCK);
        dist_simd::copy::bulk(chunk, bytemuck::cast_slice(s));
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
                        dist_simd::copy::bulk(bytemuck::cast_slice_mut::<T, u8>(s), run);
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

/// Whether `Avg` over `dtype` divides in two parts, by the first of [`average_divisors`] in
/// [`prepare`] and by the second in [`finalize`], rather than once at the end: `f16` only.
///
/// Why: `f16`'s largest finite value is 65504, so a sum of the ranks' inputs overflows to
/// `inf` where their average is in range (4 ranks of 30000); split, the partial sums reach
/// about √n times the average, not n times. Dividing by the whole rank count
/// first, as NCCL's `ncclAvg` does, would lose small values to underflow instead; the split
/// keeps both ends in range, as torch's FSDP does for its gradients. Its first divisor is a
/// power of two, exact in any float type, so in `bf16`, `f32` and `f64` (the range of `f32` or
/// more) the split would give the same bits as one division at the end, for one more pass
/// over the buffer: those divide once.
pub fn splits_average(dtype: DType) -> bool {
    dtype == DType::F16
}

/// How an average over `nranks` inputs is divided where it is split
/// ([`splits_average`]): by `before` ahead of the sum and by `after` once summed,
/// `before · after = nranks`. `before` is the power of two torch's FSDP picks
/// (`_get_gradient_divide_factors`): doubled from 1 while it divides `nranks` and
/// `nranks / before > before`, so about √nranks (6 ranks give 4 and 1.5; 1 rank 1 and 1).
pub fn average_divisors(nranks: usize) -> (f32, f32) {
    let mut before = 1usize;
    while nranks.is_multiple_of(before) && nranks / before > before {
        before *= 2;
    }
    (before as f32, nranks as f32 / before as f32)
}

/// Whether [`prepare`] changes a rank's input for `op` on `dtype`: a caller whose input must
/// stay as it was (a reduce-scatter's) prepares a copy exactly when this is true.
pub fn prepare_changes_input(op: ReduceOp, dtype: DType) -> bool {
    match op {
        ReduceOp::PremulSum(_) => true,
        ReduceOp::Avg => splits_average(dtype),
        _ => false,
    }
}

/// Step 1: applies the op's per-input transform to a rank's own input, one of `nranks`
/// (`PremulSum`'s scale, and `Avg`'s first division where [`splits_average`]; nothing for
/// every other op).
pub fn prepare(op: ReduceOp, dtype: DType, buf: &mut [u8], nranks: usize) -> Result<(), WireError> {
    op.check(dtype)?;
    check_whole(dtype, buf.len())?;
    match op {
        ReduceOp::PremulSum(s) => {
            dispatch!(dtype, T => with_typed_mut::<T>(buf, |b, _| T::scale(b, s)));
        }
        ReduceOp::Avg if splits_average(dtype) => {
            if nranks == 0 {
                return Err(WireError::NoInputs { op });
            }
            divide_half::<f16>(buf, average_divisors(nranks).0);
        }
        _ => {}
    }
    Ok(())
}

/// Typed form of [`prepare`].
pub fn prepare_slice<T: Element>(
    op: ReduceOp,
    buf: &mut [T],
    nranks: usize,
) -> Result<(), WireError> {
    prepare(op, T::DTYPE, bytemuck::cast_slice_mut(buf), nranks)
}

/// Divides every `H` of `buf` by `by`, rounding once from `f32` (nothing where `by` is 1).
fn divide_half<H: HalfKernel + Kernel>(buf: &mut [u8], by: f32) {
    if by != 1.0 {
        with_typed_mut::<H>(buf, |b, _| map_half(b, move |x| x / by));
    }
}

/// Step 3: applies the op's final transform to a fully reduced result of `nranks` prepared
/// inputs (`Avg`'s division, or its second part where [`splits_average`]; nothing for every
/// other op).
pub fn finalize(
    op: ReduceOp,
    dtype: DType,
    buf: &mut [u8],
    nranks: usize,
) -> Result<(), WireError> {
    op.check(dtype)?;
    check_whole(dtype, buf.len())?;
    if op == ReduceOp::Avg {
        if nranks == 0 {
            return Err(WireError::NoInputs { op });
        }
        if splits_average(dtype) {
            divide_half::<f16>(buf, average_divisors(nranks).1);
        } else {
            dispatch!(dtype, T => with_typed_mut::<T>(buf, |b, _| T::divide(b, nranks)));
        }
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

    /// xorshift64: deterministic test data without a dependency.
    fn xorshift(s: &mut u64) -> u64 {
        *s ^= *s << 13;
        *s ^= *s >> 7;
        *s ^= *s << 17;
        *s
    }

    type Conv = (fn(u16) -> f32, fn(f32) -> u16);

    /// `half`'s scalar conversions for `H`: the reference the kernels must match.
    fn half_conv<H: Element>() -> Conv {
        match H::DTYPE {
            DType::F16 => (
                |h| f16::from_bits(h).to_f32(),
                |x| f16::from_f32(x).to_bits(),
            ),
            _ => (
                |h| bf16::from_bits(h).to_f32(),
                |x| bf16::from_f32(x).to_bits(),
            ),
        }
    }

    /// The scalar definition of every op on a half type: widen both, apply the f32 op, round
    /// once.
    fn half_reference<H: Element>(op: ReduceOp, a: H, b: H) -> H {
        let (to, from) = half_conv::<H>();
        let x = to(bytemuck::cast(a));
        let y = to(bytemuck::cast(b));
        let r = match op {
            ReduceOp::Sum => x + y,
            ReduceOp::Product => x * y,
            ReduceOp::Min => {
                if x < y || x.is_nan() {
                    x
                } else {
                    y
                }
            }
            ReduceOp::Max => {
                if x > y || x.is_nan() {
                    x
                } else {
                    y
                }
            }
            _ => unreachable!("not a combine"),
        };
        bytemuck::cast(from(r))
    }

    fn same_half<H: Element>(a: H, b: H) -> bool {
        let (a, b) = (bytemuck::cast::<H, u16>(a), bytemuck::cast::<H, u16>(b));
        let nan = |h: u16| match H::DTYPE {
            DType::F16 => f16::from_bits(h).is_nan(),
            _ => bf16::from_bits(h).is_nan(),
        };
        a == b || (nan(a) && nan(b))
    }

    /// Random bits (every class: NaN, infinity, subnormal, zero) after every pair of special
    /// values (ties, overflow to infinity, subnormal results).
    fn half_inputs<H: Element>(n_random: usize) -> (Vec<H>, Vec<H>) {
        let special: &[u16] = match H::DTYPE {
            DType::F16 => &[
                0x0000, 0x8000, 0x0001, 0x03ff, 0x0400, 0x7bff, 0x7c00, 0xfc00, 0x7e00, 0x7c01,
                0x3c00, 0x3c01, 0x1000, 0x9000, 0x4c00,
            ],
            _ => &[
                0x0000, 0x8000, 0x0001, 0x007f, 0x0080, 0x7f7f, 0x7f80, 0xff80, 0x7fc0, 0x7f81,
                0x3f80, 0x3f81, 0x3b80, 0xbb80, 0x4180,
            ],
        };
        let mut a: Vec<u16> = special
            .iter()
            .flat_map(|&x| special.iter().map(move |_| x))
            .collect();
        let mut b: Vec<u16> = special
            .iter()
            .flat_map(|_| special.iter().copied())
            .collect();
        let mut s = 0x2545_f491_4f6c_dd1du64;
        for _ in 0..n_random {
            let r = xorshift(&mut s);
            a.push(r as u16);
            b.push((r >> 16) as u16);
        }
        let typed = |v: Vec<u16>| v.into_iter().map(bytemuck::cast).collect();
        (typed(a), typed(b))
    }

    fn check_half_ops<H: Element>() {
        let (a, b) = half_inputs::<H>(5000);
        for op in [
            ReduceOp::Sum,
            ReduceOp::Product,
            ReduceOp::Min,
            ReduceOp::Max,
        ] {
            for len in [0, 1, 7, 8, 9, 31, 1003, a.len()] {
                let want: Vec<H> = (0..len).map(|i| half_reference(op, a[i], b[i])).collect();
                let mut d = a[..len].to_vec();
                reduce_slice(op, &mut d, &b[..len]).unwrap();
                for i in 0..len {
                    assert!(same_half(d[i], want[i]), "{op} {:?} at {i}", H::DTYPE);
                }
                // The same through byte buffers at odd offsets (the scratch-block path).
                let mut raw_d = vec![0u8; len * 2 + 1];
                let mut raw_s = vec![0u8; len * 2 + 3];
                raw_d[1..].copy_from_slice(bytemuck::cast_slice(&a[..len]));
                raw_s[3..].copy_from_slice(bytemuck::cast_slice(&b[..len]));
                reduce_into(op, H::DTYPE, &mut raw_d[1..], &raw_s[3..]).unwrap();
                for i in 0..len {
                    let got: H = bytemuck::pod_read_unaligned(&raw_d[1 + 2 * i..3 + 2 * i]);
                    assert!(
                        same_half(got, want[i]),
                        "unaligned {op} {:?} at {i}",
                        H::DTYPE
                    );
                }
            }
        }
        // PremulSum's scale and Avg's division: one rounding after the f32 op.
        let mut scaled = a.clone();
        prepare_slice(ReduceOp::PremulSum(0.3), &mut scaled, 3).unwrap();
        // An average over 3 inputs of which this is the sum; f16 divides by 2 ahead of it.
        let mut averaged = a.clone();
        finalize_slice(ReduceOp::Avg, &mut averaged, 3).unwrap();
        let (to, from) = half_conv::<H>();
        let after = if H::DTYPE == DType::F16 { 1.5 } else { 3.0 };
        for i in 0..a.len() {
            let x = to(bytemuck::cast(a[i]));
            let want_scaled: H = bytemuck::cast(from(x * 0.3f64 as f32));
            let want_avg: H = bytemuck::cast(from(x / after));
            assert!(same_half(scaled[i], want_scaled), "PremulSum at {i}");
            assert!(same_half(averaged[i], want_avg), "Avg at {i}");
        }
    }

    #[test]
    fn f16_ops_match_the_scalar_definition() {
        check_half_ops::<f16>();
    }

    #[test]
    fn bf16_ops_match_the_scalar_definition() {
        check_half_ops::<bf16>();
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
        prepare_slice(ReduceOp::PremulSum(0.5), &mut f, 4).unwrap();
        assert_eq!(f, [0.5, 1.5]);
        finalize_slice(ReduceOp::Avg, &mut f, 4).unwrap();
        assert_eq!(f, [0.125, 0.375]);
    }

    /// A rank count past the integer type divides exactly (truncating toward zero, as NCCL
    /// does): the type's MIN over -MIN ranks is -1. Before, every value became 0. And an
    /// average over 0 ranks is an error, where floats became inf or NaN and integers stayed.
    #[test]
    fn avg_over_more_ranks_than_the_type_holds_and_over_none() {
        let mut v = [i8::MIN, i8::MAX, -1, 0];
        finalize_slice(ReduceOp::Avg, &mut v, 128).unwrap();
        assert_eq!(v, [-1, 0, 0, 0]);
        let mut w = [i16::MIN, i16::MIN + 1];
        finalize_slice(ReduceOp::Avg, &mut w, 32768).unwrap();
        assert_eq!(w, [-1, 0]);
        let mut u = [u8::MAX];
        finalize_slice(ReduceOp::Avg, &mut u, 256).unwrap();
        assert_eq!(u, [0]);
        let mut f = [1.0f32];
        assert_eq!(
            finalize_slice(ReduceOp::Avg, &mut f, 0),
            Err(WireError::NoInputs { op: ReduceOp::Avg })
        );
        assert_eq!(f, [1.0]);
        // Every other op has nothing to finalize, whatever the count.
        finalize_slice(ReduceOp::Sum, &mut f, 0).unwrap();
    }

    /// Four ranks' f16 inputs of 30000 average to 30000: summed first, as before, they made
    /// `inf` (largest finite f16: 65504). The split keeps small values too: 1e-6 over 64 ranks
    /// comes back within the precision of the subnormals it passes through, where a division by
    /// all of 64 first (NCCL's way) makes 1.6e-8, under half the least subnormal: 0.
    #[test]
    fn f16_avg_divides_around_the_sum_so_a_sum_past_its_range_stays_finite() {
        let average = |inputs: &[Vec<f16>]| {
            let n = inputs.len();
            let mut prepared: Vec<Vec<f16>> = inputs.to_vec();
            for p in &mut prepared {
                prepare_slice(ReduceOp::Avg, p, n).unwrap();
            }
            let mut acc = prepared[0].clone();
            for p in &prepared[1..] {
                reduce_slice(ReduceOp::Avg, &mut acc, p).unwrap();
            }
            finalize_slice(ReduceOp::Avg, &mut acc, n).unwrap();
            acc
        };
        let big = vec![vec![f16::from_f32(30000.0), f16::from_f32(-32000.0)]; 4];
        assert_eq!(
            average(&big),
            [f16::from_f32(30000.0), f16::from_f32(-32000.0)]
        );
        let small = vec![vec![f16::from_f32(1e-6)]; 64];
        let got = average(&small)[0].to_f32();
        assert!((got - 1e-6).abs() < 1e-7, "{got}");
        // Mixed magnitudes over 6 ranks (divisors 4 and 1.5) against the f64 average.
        let mixed: Vec<Vec<f16>> = (0..6)
            .map(|r| {
                vec![
                    f16::from_f32(20000.0 + r as f32 * 1000.0),
                    f16::from_f32(r as f32),
                ]
            })
            .collect();
        let got = average(&mixed);
        assert!((got[0].to_f32() - 22500.0).abs() <= 16.0, "{}", got[0]);
        assert!((got[1].to_f32() - 2.5).abs() <= 2e-3, "{}", got[1]);
        // Only Avg of f16 changes the input in prepare; bf16 and f32 divide once at the end.
        assert!(prepare_changes_input(ReduceOp::Avg, DType::F16));
        assert!(prepare_changes_input(ReduceOp::PremulSum(0.5), DType::F32));
        for d in [DType::BF16, DType::F32, DType::F64, DType::I32] {
            assert!(!prepare_changes_input(ReduceOp::Avg, d), "{d:?}");
        }
        let mut x = [f16::ONE];
        assert_eq!(
            prepare_slice(ReduceOp::Avg, &mut x, 0),
            Err(WireError::NoInputs { op: ReduceOp::Avg })
        );
    }

    #[test]
    fn average_divisors_follow_torch_fsdp_and_multiply_to_n() {
        // torch's `_get_gradient_divide_factors`, by hand.
        for (n, before) in [
            (1, 1.0),
            (2, 2.0),
            (3, 2.0),
            (4, 2.0),
            (6, 4.0),
            (8, 4.0),
            (64, 8.0),
        ] {
            let (b, a) = average_divisors(n);
            assert_eq!(b, before, "{n} ranks");
            assert!((b * a - n as f32).abs() < 1e-6, "{n} ranks: {b} x {a}");
        }
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
