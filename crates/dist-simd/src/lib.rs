//! Element-wise kernels over 16-bit floats (`f16`, `bf16`) stored as `u16` bits, computed in
//! `f32`, and dispatched at run time to the widest instructions the CPU has; and bulk copies
//! that keep their destination in cache ([`copy::cached`]) or bypass it ([`copy::streaming`]).
//!
//! `dist-wire` reduces half-precision buffers by widening each element to `f32`, combining, and
//! rounding back once. Written portably, that costs more than the memory traffic it rides on:
//! a baseline x86-64 build cannot assume F16C (the instructions that convert 8 halves at once)
//! or AVX2, and `dist-wire` forbids the `unsafe` that calling them through runtime detection
//! needs. This crate is where that `unsafe` lives, kept to one kind (calling a
//! `#[target_feature]` function after checking the CPU has the feature), so that the crates
//! above it stay `#![forbid(unsafe_code)]`.
//!
//! Paths, chosen per call:
//!
//! * `f16` on x86 with F16C: `vcvtph2ps`/`vcvtps2ph`, 8 lanes;
//! * `bf16` on x86 with AVX2: the portable bit algorithms at 8 lanes;
//! * everywhere else: the portable bit algorithms at whatever width the target guarantees.
//!
//! Every path gives the same bits: widening is exact, narrowing rounds to nearest even (overflow
//! to infinity, subnormals kept), and a NaN stays a NaN with the top of its payload, quieted,
//! exactly as `half`'s scalar conversions do. The tests hold the conversions to `half` on every
//! `f16` and `bf16` value and around every rounding boundary, and each kernel path to `half` on
//! special values, random bits and lengths around the vector width.
//!
//! The crate is sans-IO like `dist-wire`: no threads, sockets or clocks.
//!
//! ```
//! // 1.5 + 2.25 in f16, combined in f32 and rounded once.
//! let mut acc = [0x3e00u16];
//! dist_simd::f16::zip_map(&mut acc, &[0x4080], |a, b| a + b);
//! assert_eq!(acc, [0x4380]); // 3.75
//! ```

// `unsafe` is allowed only in `x86.rs`, where the runtime-dispatched kernels are called.
#![deny(unsafe_code)]
mod portable;
#[cfg(any(target_arch = "x86", target_arch = "x86_64"))]
#[allow(
    unsafe_code,
    reason = "the runtime-dispatched kernel calls, each with a SAFETY comment"
)]
mod x86;

macro_rules! format_module {
    ($name:ident, $what:literal, $widen:path, $narrow:path, $x86_zip:ident, $x86_map:ident) => {
        #[doc = concat!("Kernels over ", $what, " bits.")]
        pub mod $name {
            use crate::portable;

            /// Widens one value to `f32`, exactly (a signalling NaN may stay signalling).
            #[inline]
            pub fn widen(bits: u16) -> f32 {
                $widen(bits)
            }

            /// Narrows one `f32`, rounding to nearest even; overflow goes to infinity and a NaN
            /// stays a NaN (quieted, with the top of its payload).
            #[inline]
            pub fn narrow(x: f32) -> u16 {
                $narrow(x)
            }

            /// `dst[i] = narrow(f(widen(dst[i]), widen(src[i])))` for every `i`.
            ///
            /// `f` runs on vectors of lanes: keep it a branch-free expression (selects are
            /// fine) so that it vectorises with the conversions around it.
            ///
            /// # Panics
            ///
            /// If the slices differ in length.
            #[inline]
            pub fn zip_map(dst: &mut [u16], src: &[u16], f: impl Fn(f32, f32) -> f32 + Copy) {
                assert_eq!(
                    dst.len(),
                    src.len(),
                    "zip_map over slices of different lengths"
                );
                #[cfg(any(target_arch = "x86", target_arch = "x86_64"))]
                if crate::x86::$x86_zip(dst, src, f) {
                    return;
                }
                portable::zip_map(dst, src, |a, b| $narrow(f($widen(a), $widen(b))));
            }

            /// `buf[i] = narrow(f(widen(buf[i])))` for every `i`.
            #[inline]
            pub fn map(buf: &mut [u16], f: impl Fn(f32) -> f32 + Copy) {
                #[cfg(any(target_arch = "x86", target_arch = "x86_64"))]
                if crate::x86::$x86_map(buf, f) {
                    return;
                }
                portable::map(buf, |a| $narrow(f($widen(a))));
            }
        }
    };
}

format_module!(
    f16,
    "IEEE binary16 (`f16`)",
    portable::h2f,
    portable::f2h,
    f16_zip_map,
    f16_map
);
format_module!(
    bf16,
    "bfloat16 (`bf16`)",
    portable::b2f,
    portable::f2b,
    bf16_zip_map,
    bf16_map
);

/// Bulk copies.
pub mod copy {
    /// The smallest copy [`bulk`] may make with [`cached`]'s vector moves: the C library's
    /// `memcpy` switches to `rep movsb` at 4 KiB (glibc's `rep_movsb_threshold` with 32-byte
    /// vectors).
    pub const BULK_MIN_BYTES: usize = 4096;

    /// The end of the sizes [`bulk`] may copy with [`cached`]'s moves: glibc stops using
    /// `rep movsb` on AMD CPUs at their L2 size (512 KiB measured here; 1 MiB on newer
    /// models), and from there `memcpy` ran at full speed at every distance.
    pub const BULK_MAX_BYTES: usize = 1 << 20;

    /// How far past the source, within a 4 KiB page, a destination slows `rep movsb` (see
    /// [`bulk`]): 1-31 bytes measured here, and 0 too on other AMD models (glibc bug 30994),
    /// with a margin.
    const SLOW_DISTANCES: core::ops::Range<usize> = 0..64;

    /// How far past the source, within a 4 KiB page, a destination slows the streaming stores
    /// (see [`streaming`]): 4-28 bytes measured at about 2x, 32-56 within noise of the moves
    /// through the cache, 96 and beyond at full speed.
    const ALIASED_STREAMING_DISTANCES: core::ops::Range<usize> = 1..64;

    /// How many bytes past the source's offset within its 4 KiB page the destination's lies,
    /// given their addresses: what decides whether `rep movsb` and the streaming stores run at
    /// full speed. The source may be an address in another process (a single-copy read).
    ///
    /// ```
    /// assert_eq!(dist_simd::copy::page_distance(0x1010, 0x2000), 16);
    /// assert_eq!(dist_simd::copy::page_distance(0x2000, 0x1010), 4080);
    /// ```
    pub fn page_distance(dst: usize, src: usize) -> usize {
        dst.wrapping_sub(src) % 4096
    }

    /// Copies `src` into `dst` as `copy_from_slice` does, except where the C library's
    /// `memcpy` may be slow: from [`BULK_MIN_BYTES`] up to [`BULK_MAX_BYTES`], when the
    /// destination's offset within its 4 KiB page lies 0 to 63 bytes past the source's, it
    /// copies with [`cached`]'s vector moves. Use it for every copy of user data whose size is
    /// not known to be small.
    ///
    /// Why: glibc's `memcpy` (2.36, Debian 12) moves 4 KiB up to a few hundred KiB with
    /// `rep movsb`, and on the AMD EPYC this project is measured on that ran 15-28x slower when
    /// the destination's page offset was 1 to 31 bytes past the source's (`benches/copy.rs`:
    /// 256 KiB 94.3 us against 6.6, 16 KiB 7.3 us against 0.18). Two buffers from `malloc`,
    /// whose chunks carry 16-byte headers, sit at such distances often: a 2-rank all_gather of
    /// 256 KiB through shared memory took 110-240 us once its buffers came from the heap,
    /// 25-45 us while they were fresh mappings. At those distances the vector moves took 7.9
    /// and 0.43 us. glibc's bug 30994 reports the same on other AMD models, with the same
    /// page offset (distance 0) slow as well; here distance 0 ran `memcpy` at full speed and
    /// the vector moves within 2% of it. Elsewhere `memcpy` is as fast or faster (16 KiB in
    /// L1: 0.18 us against 0.24), so it keeps those copies.
    ///
    /// # Panics
    ///
    /// If the slices differ in length.
    ///
    /// ```
    /// let src: Vec<u8> = (0..=255u8).cycle().take(10_000).collect();
    /// let mut dst = vec![0u8; 10_016];
    /// dist_simd::copy::bulk(&mut dst[16..], &src);
    /// assert_eq!(&dst[16..], &src[..]);
    /// ```
    pub fn bulk(dst: &mut [u8], src: &[u8]) {
        assert_eq!(
            dst.len(),
            src.len(),
            "bulk copy between slices of different lengths"
        );
        let distance = page_distance(dst.as_ptr() as usize, src.as_ptr() as usize);
        if (BULK_MIN_BYTES..BULK_MAX_BYTES).contains(&dst.len())
            && SLOW_DISTANCES.contains(&distance)
        {
            cached(dst, src);
        } else {
            dst.copy_from_slice(src);
        }
    }

    /// Copies `src` into `dst` by 128-byte moves through the cache, for copies whose
    /// destination is read again soon (a shared-memory ring, a buffer reduced into next).
    ///
    /// `copy_from_slice` calls the C library's `memcpy`, which on x86 moves a few KiB and more
    /// with `rep movsb`; on the AMD EPYC this project is measured on that ran at 16-20 GB/s
    /// for 64 KiB pieces of a 16 MiB buffer in the last-level cache, where these moves ran at
    /// 23-28 GB/s, and no slower out of memory. Short copies gain nothing: below a few hundred
    /// bytes use `copy_from_slice`.
    ///
    /// # Panics
    ///
    /// If the slices differ in length.
    ///
    /// ```
    /// let src: Vec<u8> = (0..=255u8).cycle().take(1000).collect();
    /// let mut dst = vec![0u8; 1000];
    /// dist_simd::copy::cached(&mut dst, &src);
    /// assert_eq!(dst, src);
    /// ```
    pub fn cached(dst: &mut [u8], src: &[u8]) {
        assert_eq!(
            dst.len(),
            src.len(),
            "cached copy between slices of different lengths"
        );
        #[cfg(any(target_arch = "x86", target_arch = "x86_64"))]
        if crate::x86::copy_cached(dst, src) {
            return;
        }
        crate::portable::copy_cached(dst, src);
    }

    /// [`bulk`] over slices of any plain-old-data element type (`f32` gradients, say).
    ///
    /// # Panics
    ///
    /// If the slices differ in length.
    ///
    /// ```
    /// let src = vec![1.5f32; 3000];
    /// let mut dst = vec![0f32; 3000];
    /// dist_simd::copy::bulk_of(&mut dst, &src);
    /// assert_eq!(dst, src);
    /// ```
    pub fn bulk_of<T: bytemuck::Pod>(dst: &mut [T], src: &[T]) {
        bulk(bytemuck::cast_slice_mut(dst), bytemuck::cast_slice(src));
    }

    /// Copies `src` into `dst` with stores that bypass the cache where the CPU has them
    /// (non-temporal `movntdq` on x86-64), and with a plain copy elsewhere.
    ///
    /// For a destination larger than the caches that nothing reads again soon, such as the
    /// output of an all-gather: a plain store first reads each destination line from memory,
    /// so a streaming copy moves a third less. A destination read right after (reduced into,
    /// or small enough to stay in cache) is better served by `copy_from_slice`. When this
    /// returns, the bytes are ordered before later stores exactly as a plain copy's are.
    ///
    /// Where the destination's offset within its 4 KiB page lies 1 to 63 bytes past the
    /// source's, it copies with [`cached`]'s moves instead. There 16 MiB took 1.7-2.1 ms
    /// against 0.8-1.0 at other distances, where [`cached`] took 0.85-1.0 at all of them
    /// (`benches/copy.rs` has the case). The likely cause is 4K aliasing: a load whose address
    /// matches a pending store's in its low 12 bits waits for that store.
    ///
    /// # Panics
    ///
    /// If the slices differ in length.
    ///
    /// ```
    /// let src: Vec<u8> = (0..100u8).collect();
    /// let mut dst = vec![0u8; 100];
    /// dist_simd::copy::streaming(&mut dst, &src);
    /// assert_eq!(dst, src);
    /// ```
    pub fn streaming(dst: &mut [u8], src: &[u8]) {
        assert_eq!(
            dst.len(),
            src.len(),
            "streaming copy between slices of different lengths"
        );
        let distance = page_distance(dst.as_ptr() as usize, src.as_ptr() as usize);
        if ALIASED_STREAMING_DISTANCES.contains(&distance) {
            cached(dst, src);
            return;
        }
        #[cfg(target_arch = "x86_64")]
        crate::x86::copy_streaming(dst, src);
        #[cfg(not(target_arch = "x86_64"))]
        dst.copy_from_slice(src);
    }
}

#[cfg(test)]
mod tests;
