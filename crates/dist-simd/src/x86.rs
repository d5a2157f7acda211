//! x86 kernels, compiled for AVX2 (`bf16`) and AVX with F16C (`f16`) and entered only after
//! the CPU has been checked for them.
//!
//! The `unsafe` here is of two kinds. Calling a `#[target_feature]` function, whose only
//! precondition is that the CPU supports the features it enables: inside those functions the
//! intrinsics used take no pointers (safe to call there since Rust 1.87), and vectors move to
//! and from arrays through `bytemuck` casts. And one non-temporal store (`copy_streaming`),
//! whose intrinsic takes a pointer: it is given one into a `&mut` slice, aligned as it needs.

#[cfg(target_arch = "x86")]
use core::arch::x86::{
    __m128i, __m256, _MM_FROUND_TO_NEAREST_INT, _mm256_cvtph_ps, _mm256_cvtps_ph,
};
#[cfg(target_arch = "x86_64")]
use core::arch::x86_64::{
    __m128i, __m256, _MM_FROUND_TO_NEAREST_INT, _mm256_cvtph_ps, _mm256_cvtps_ph,
};

use crate::portable;

/// Lanes per F16C conversion.
const LANES: usize = 8;

/// Whether the `f16` kernels below may run (cached by std after the first call). F16C's
/// 256-bit conversions use the YMM registers, whose state only AVX detection checks the OS
/// saves (std reports `f16c` from the CPU's bit alone): a kernel booted with `noxsave`, or a
/// VM that masks AVX but passes the F16C bit through, would fault on them.
#[inline]
fn has_f16c() -> bool {
    std::arch::is_x86_feature_detected!("avx") && std::arch::is_x86_feature_detected!("f16c")
}

/// Whether the `bf16` kernels below may run.
#[inline]
fn has_avx2() -> bool {
    std::arch::is_x86_feature_detected!("avx2")
}

/// Widens 8 `f16` with `vcvtph2ps`: exact, NaN quieted with its payload kept.
#[target_feature(enable = "avx,f16c")]
#[inline]
fn widen8(h: [u16; LANES]) -> [f32; LANES] {
    bytemuck::cast::<__m256, _>(_mm256_cvtph_ps(bytemuck::cast::<_, __m128i>(h)))
}

/// Narrows 8 `f32` with `vcvtps2ph`, rounding to nearest even whatever MXCSR says.
#[target_feature(enable = "avx,f16c")]
#[inline]
fn narrow8(x: [f32; LANES]) -> [u16; LANES] {
    let v = bytemuck::cast::<_, __m256>(x);
    bytemuck::cast::<__m128i, _>(_mm256_cvtps_ph::<{ _MM_FROUND_TO_NEAREST_INT }>(v))
}

#[target_feature(enable = "avx,f16c")]
fn f16_zip_map_f16c(dst: &mut [u16], src: &[u16], f: impl Fn(f32, f32) -> f32) {
    let (d8, d_tail) = dst.as_chunks_mut::<LANES>();
    let (s8, s_tail) = src.as_chunks::<LANES>();
    let lanes = |d: [u16; LANES], s: [u16; LANES]| {
        let (a, b) = (widen8(d), widen8(s));
        narrow8(core::array::from_fn(|i| f(a[i], b[i])))
    };
    for (d, s) in d8.iter_mut().zip(s8) {
        *d = lanes(*d, *s);
    }
    // The tail through one zero-padded vector, so every element takes the same instructions.
    if !d_tail.is_empty() {
        let (mut d, mut s) = ([0; LANES], [0; LANES]);
        d[..d_tail.len()].copy_from_slice(d_tail);
        s[..s_tail.len()].copy_from_slice(s_tail);
        d_tail.copy_from_slice(&lanes(d, s)[..d_tail.len()]);
    }
}

#[target_feature(enable = "avx,f16c")]
fn f16_map_f16c(buf: &mut [u16], f: impl Fn(f32) -> f32) {
    let (b8, tail) = buf.as_chunks_mut::<LANES>();
    let lanes = |b: [u16; LANES]| {
        let a = widen8(b);
        narrow8(core::array::from_fn(|i| f(a[i])))
    };
    for b in b8 {
        *b = lanes(*b);
    }
    if !tail.is_empty() {
        let mut b = [0; LANES];
        b[..tail.len()].copy_from_slice(tail);
        tail.copy_from_slice(&lanes(b)[..tail.len()]);
    }
}

// bf16 needs no conversion instruction (its widening is a shift): the portable loops, compiled
// with AVX2, vectorise at 8 lanes instead of SSE2's 4.

#[target_feature(enable = "avx2")]
fn bf16_zip_map_avx2(dst: &mut [u16], src: &[u16], f: impl Fn(f32, f32) -> f32) {
    portable::zip_map(dst, src, |a, b| {
        portable::f2b(f(portable::b2f(a), portable::b2f(b)))
    });
}

#[target_feature(enable = "avx2")]
fn bf16_map_avx2(buf: &mut [u16], f: impl Fn(f32) -> f32) {
    portable::map(buf, |a| portable::f2b(f(portable::b2f(a))));
}

/// Runs the F16C kernel and returns `true`, or returns `false` on a CPU without F16C.
pub(crate) fn f16_zip_map(dst: &mut [u16], src: &[u16], f: impl Fn(f32, f32) -> f32) -> bool {
    if !has_f16c() {
        return false;
    }
    // SAFETY: the CPU and OS support AVX and F16C (checked just above), the features the
    // callee enables.
    unsafe { f16_zip_map_f16c(dst, src, f) };
    true
}

/// Runs the F16C kernel and returns `true`, or returns `false` on a CPU without F16C.
pub(crate) fn f16_map(buf: &mut [u16], f: impl Fn(f32) -> f32) -> bool {
    if !has_f16c() {
        return false;
    }
    // SAFETY: the CPU and OS support AVX and F16C (checked just above), the features the
    // callee enables.
    unsafe { f16_map_f16c(buf, f) };
    true
}

/// Runs the AVX2 kernel and returns `true`, or returns `false` on a CPU without AVX2.
pub(crate) fn bf16_zip_map(dst: &mut [u16], src: &[u16], f: impl Fn(f32, f32) -> f32) -> bool {
    if !has_avx2() {
        return false;
    }
    // SAFETY: the CPU supports AVX2 (checked just above), the one feature the callee enables.
    unsafe { bf16_zip_map_avx2(dst, src, f) };
    true
}

/// Runs the AVX2 kernel and returns `true`, or returns `false` on a CPU without AVX2.
pub(crate) fn bf16_map(buf: &mut [u16], f: impl Fn(f32) -> f32) -> bool {
    if !has_avx2() {
        return false;
    }
    // SAFETY: the CPU supports AVX2 (checked just above), the one feature the callee enables.
    unsafe { bf16_map_avx2(buf, f) };
    true
}

/// Copies `src` into `dst` (equal lengths) with `movntdq`, stores that go to memory without
/// first reading each destination line into the cache, then `sfence`s so that the bytes are
/// ordered before any later store, as a plain copy's are. SSE2 is part of x86-64, so there is
/// nothing to detect.
#[cfg(target_arch = "x86_64")]
pub(crate) fn copy_streaming(dst: &mut [u8], src: &[u8]) {
    use core::arch::x86_64::{__m128i, _mm_sfence, _mm_stream_si128};
    const W: usize = size_of::<__m128i>();
    debug_assert_eq!(dst.len(), src.len());
    // Plain copies up to the first 16-byte boundary of `dst` and after the last.
    let head = dst.as_ptr().align_offset(W).min(dst.len());
    let body = (dst.len() - head) / W * W;
    let (d_head, rest) = dst.split_at_mut(head);
    let (d_body, d_tail) = rest.split_at_mut(body);
    let (s_head, rest) = src.split_at(head);
    let (s_body, s_tail) = rest.split_at(body);
    d_head.copy_from_slice(s_head);
    for (d, s) in d_body.chunks_exact_mut(W).zip(s_body.chunks_exact(W)) {
        let v: __m128i = bytemuck::pod_read_unaligned(s);
        // SAFETY: `d` is 16 bytes of `dst`, which the `&mut` borrow lets us write, and starts
        // at a 16-byte boundary (the head above ends at one), the alignment `movntdq` needs.
        unsafe { _mm_stream_si128(d.as_mut_ptr().cast::<__m128i>(), v) };
    }
    d_tail.copy_from_slice(s_tail);
    // SAFETY: `sfence` needs SSE, which every x86-64 CPU has.
    unsafe { _mm_sfence() };
}

#[target_feature(enable = "avx2")]
fn copy_cached_avx2(dst: &mut [u8], src: &[u8]) {
    portable::copy_cached(dst, src);
}

/// Runs the AVX2 copy (32-byte moves) and returns `true`, or returns `false` on a CPU without
/// AVX2.
pub(crate) fn copy_cached(dst: &mut [u8], src: &[u8]) -> bool {
    if !has_avx2() {
        return false;
    }
    // SAFETY: the CPU supports AVX2 (checked just above), the one feature the callee enables.
    unsafe { copy_cached_avx2(dst, src) };
    true
}
