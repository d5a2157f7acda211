//! The conversions as branch-free bit algorithms, and the loops built from them.
//!
//! They are the only path on CPUs without the x86 extensions (and on other architectures), so
//! they are written for the auto-vectoriser: every branch is a select, every constant a splat.
//! They also run inside the AVX2 `bf16` kernel, where no conversion instruction exists.
//!
//! Each returns the same bits as `half`'s scalar `to_f32`/`from_f32` (and so as F16C) for
//! every input, NaN payloads included, except that `b2f` leaves a signalling NaN signalling:
//! the narrowing that always follows it quiets it.

#[inline(always)]
pub(crate) fn h2f(h: u16) -> f32 {
    let h = u32::from(h);
    let m = h & 0x7fff;
    // Normal, infinite and NaN inputs: rebias by +224, then scale by 2^-112 in f32, so exponent
    // 31 lands on 255 and the multiply quiets a signalling NaN (as F16C does). No operand is an
    // f32 subnormal, which some CPUs handle in microcode.
    let normal = f32::from_bits((m << 13) + (224 << 23)) * f32::from_bits((127 - 112) << 23);
    // Subnormal inputs: 0.5 with the mantissa in its low bits is 0.5 + m * 2^-24, exactly.
    let subnormal = f32::from_bits(m | (126 << 23)) - 0.5;
    let r = if m < 0x400 { subnormal } else { normal };
    f32::from_bits(r.to_bits() | ((h & 0x8000) << 16))
}

#[inline(always)]
pub(crate) fn f2h(x: f32) -> u16 {
    let w = x.to_bits();
    let shl1 = w.wrapping_add(w);
    // Scaling up then down sends everything that rounds past 65504 to infinity.
    let base = (x.abs() * f32::from_bits((127 + 112) << 23)) * f32::from_bits((127 - 110) << 23);
    // Adding a power of two 2^13 above the (scaled) value makes the FPU round it to f16
    // precision, to nearest even; the floor at 2^-14's exponent gives subnormals their fixed
    // ulp. The exponent and mantissa then sit where f16 wants them, up to one carry.
    let bias = (shl1 & 0xff00_0000).max(0x7100_0000);
    let bits = (f32::from_bits((bias >> 1) + 0x0780_0000) + base).to_bits();
    let nonsign = ((bits >> 13) & 0x7c00) + (bits & 0x0fff);
    // A NaN keeps the top of its payload and gets the quiet bit, like F16C.
    let r = if x.is_nan() {
        0x7e00 | ((w >> 13) & 0x3ff)
    } else {
        nonsign
    };
    (r | ((w >> 16) & 0x8000)) as u16
}

#[inline(always)]
pub(crate) fn b2f(b: u16) -> f32 {
    f32::from_bits(u32::from(b) << 16)
}

#[inline(always)]
pub(crate) fn f2b(x: f32) -> u16 {
    let bits = x.to_bits();
    // NaN stays NaN (quieted), instead of rounding into infinity.
    let r = if x.is_nan() {
        bits | 0x0040_0000
    } else {
        bits.wrapping_add(0x7fff + ((bits >> 16) & 1))
    };
    (r >> 16) as u16
}

/// `dst[i] = f(dst[i], src[i])`; a plain zip is the shape the auto-vectoriser handles best.
#[inline(always)]
pub(crate) fn zip_map(dst: &mut [u16], src: &[u16], f: impl Fn(u16, u16) -> u16) {
    for (d, s) in dst.iter_mut().zip(src) {
        *d = f(*d, *s);
    }
}

/// `buf[i] = f(buf[i])`.
#[inline(always)]
pub(crate) fn map(buf: &mut [u16], f: impl Fn(u16) -> u16) {
    for x in buf {
        *x = f(*x);
    }
}

/// `dst.copy_from_slice(src)` in 128-byte moves (see `copy::cached`); at whatever vector width
/// the build targets, or AVX2's when called from a function compiled for it.
#[inline(always)]
pub(crate) fn copy_cached(dst: &mut [u8], src: &[u8]) {
    let (d, d_tail) = dst.as_chunks_mut::<128>();
    let (s, s_tail) = src.as_chunks::<128>();
    for (d, s) in d.iter_mut().zip(s) {
        *d = *s;
        // LLVM would turn this loop back into one `memcpy` call; an opaque use of each chunk
        // keeps it 128-byte moves.
        core::hint::black_box(&*d);
    }
    d_tail.copy_from_slice(s_tail);
}
