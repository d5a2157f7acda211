//! Every path against `half`'s scalar conversions, the reference the rest of dist relies on.

use half::{bf16, f16};

use crate::portable::{b2f, f2b, f2h, h2f};

/// xorshift64: deterministic, dependency-free test data.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

#[test]
fn f16_widening_matches_half_on_every_value() {
    for h in 0..=u16::MAX {
        let want = f16::from_bits(h).to_f32();
        assert_eq!(h2f(h).to_bits(), want.to_bits(), "{h:#06x}");
    }
}

#[test]
fn f16_narrowing_matches_half_around_every_value() {
    for h in 0..=u16::MAX {
        let x = f16::from_bits(h).to_f32();
        // The value, its f32 neighbours, and the midpoint to the next f16 (a tie). Around
        // infinity the neighbours are NaNs with small payloads.
        let next = f16::from_bits(h.wrapping_add(1)).to_f32();
        let mid = (f64::from(x) + f64::from(next)) / 2.0;
        for v in [
            x,
            f32::from_bits(x.to_bits().wrapping_add(1)),
            f32::from_bits(x.to_bits().wrapping_sub(1)),
            mid as f32,
        ] {
            let want = f16::from_f32(v).to_bits();
            assert_eq!(f2h(v), want, "{v:e} ({:#010x})", v.to_bits());
        }
    }
    let mut rng = Rng(0x0fed_cba9_8765_4321);
    for _ in 0..1_000_000 {
        let v = f32::from_bits(rng.next() as u32);
        assert_eq!(f2h(v), f16::from_f32(v).to_bits(), "{:#010x}", v.to_bits());
    }
    for v in [
        1e10f32,
        -1e10,
        65520.0,
        65519.0,
        1e-10,
        -0.0,
        f32::MIN_POSITIVE,
    ] {
        assert_eq!(f2h(v), f16::from_f32(v).to_bits(), "{v:e}");
    }
}

#[test]
fn bf16_matches_half_in_both_directions() {
    for b in 0..=u16::MAX {
        let want = bf16::from_bits(b).to_f32();
        // `half` quiets a signalling NaN when widening; the kernels leave that to narrowing.
        let got = b2f(b).to_bits() | if want.is_nan() { 0x0040_0000 } else { 0 };
        assert_eq!(got, want.to_bits(), "{b:#06x}");
    }
    let mut rng = Rng(0x1234_5678_9abc_def0);
    for _ in 0..1_000_000 {
        let v = f32::from_bits(rng.next() as u32);
        assert_eq!(f2b(v), bf16::from_f32(v).to_bits(), "{:#010x}", v.to_bits());
    }
}

/// Widens with `half`, applies `f`, narrows with `half`: the definition every path must meet.
fn reference(is_f16: bool, a: u16, b: u16, f: impl Fn(f32, f32) -> f32) -> u16 {
    if is_f16 {
        let r = f(f16::from_bits(a).to_f32(), f16::from_bits(b).to_f32());
        f16::from_f32(r).to_bits()
    } else {
        let r = f(bf16::from_bits(a).to_f32(), bf16::from_bits(b).to_f32());
        bf16::from_f32(r).to_bits()
    }
}

fn is_nan(is_f16: bool, h: u16) -> bool {
    if is_f16 {
        f16::from_bits(h).is_nan()
    } else {
        bf16::from_bits(h).is_nan()
    }
}

/// Zero, subnormals, normals at the edges, infinities, NaNs (quiet, signalling, with payload),
/// and operands whose sum is an exact tie or overflows.
fn specials(is_f16: bool) -> Vec<u16> {
    let base: &[u16] = if is_f16 {
        // 0, min/max subnormal, min normal, max, inf, qNaN, sNaN, NaN with payload, 1,
        // 1 + ulp, half an ulp of 1 (2^-11), 2^15, 16.
        &[
            0x0000, 0x0001, 0x03ff, 0x0400, 0x7bff, 0x7c00, 0x7e00, 0x7c01, 0x7d55, 0x3c00, 0x3c01,
            0x1000, 0x7800, 0x4c00,
        ]
    } else {
        &[
            0x0000, 0x0001, 0x007f, 0x0080, 0x7f7f, 0x7f80, 0x7fc0, 0x7f81, 0x7fa5, 0x3f80, 0x3f81,
            0x3b80, 0x7f00, 0x4180,
        ]
    };
    base.iter().flat_map(|&h| [h, h | 0x8000]).collect()
}

type Op = fn(f32, f32) -> f32;

const OPS: [(&str, Op); 4] = [
    ("add", |a, b| a + b),
    ("mul", |a, b| a * b),
    ("min", |a, b| if a < b || a.is_nan() { a } else { b }),
    ("max", |a, b| if a > b || a.is_nan() { a } else { b }),
];

/// Inputs for one kernel check: every pair of specials, then random bits.
fn inputs(is_f16: bool, rng: &mut Rng, random: usize) -> (Vec<u16>, Vec<u16>) {
    let s = specials(is_f16);
    let mut a: Vec<u16> = s.iter().flat_map(|&x| s.iter().map(move |_| x)).collect();
    let mut b: Vec<u16> = s.iter().flat_map(|_| s.iter().copied()).collect();
    for _ in 0..random {
        let r = rng.next();
        a.push(r as u16);
        b.push((r >> 16) as u16);
    }
    (a, b)
}

/// Checks the public kernels (whichever path this CPU takes) and the portable one against
/// [`reference`], on lengths around the vector width.
fn check_kernels(
    is_f16: bool,
    public_zip: fn(&mut [u16], &[u16], Op),
    portable_zip: fn(&mut [u16], &[u16], Op),
    public_map: fn(&mut [u16], f32),
    portable_map: fn(&mut [u16], f32),
) {
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let (a, b) = inputs(is_f16, &mut rng, 20_000);
    for (name, op) in OPS {
        for zip in [public_zip, portable_zip] {
            for len in [0, 1, 7, 8, 9, 31, 1003, a.len()] {
                let mut d = a[..len].to_vec();
                zip(&mut d, &b[..len], op);
                for i in 0..len {
                    let want = reference(is_f16, a[i], b[i], op);
                    let ok = d[i] == want || (is_nan(is_f16, d[i]) && is_nan(is_f16, want));
                    assert!(
                        ok,
                        "{name} {:#06x} {:#06x}: {:#06x} vs {want:#06x}",
                        a[i], b[i], d[i]
                    );
                }
            }
        }
    }
    for (s, map) in [0.5f32, 3.0, 1.0 / 3.0, 1e-6]
        .into_iter()
        .flat_map(|s| [(s, public_map), (s, portable_map)])
    {
        for len in [0, 1, 9, 1003, a.len()] {
            let mut d = a[..len].to_vec();
            map(&mut d, s);
            for i in 0..len {
                let want = reference(is_f16, a[i], 0, |x, _| x * s);
                assert!(d[i] == want || (is_nan(is_f16, d[i]) && is_nan(is_f16, want)));
            }
        }
    }
}

#[test]
fn f16_kernels_match_half() {
    if cfg!(any(target_arch = "x86", target_arch = "x86_64")) {
        eprintln!("f16c: {}", std::arch::is_x86_feature_detected!("f16c"));
    }
    check_kernels(
        true,
        crate::f16::zip_map,
        |d, s, op| crate::portable::zip_map(d, s, |a, b| f2h(op(h2f(a), h2f(b)))),
        |d, k| crate::f16::map(d, |x| x * k),
        |d, k| crate::portable::map(d, |h| f2h(h2f(h) * k)),
    );
}

#[test]
fn bf16_kernels_match_half() {
    check_kernels(
        false,
        crate::bf16::zip_map,
        |d, s, op| crate::portable::zip_map(d, s, |a, b| f2b(op(b2f(a), b2f(b)))),
        |d, k| crate::bf16::map(d, |x| x * k),
        |d, k| crate::portable::map(d, |h| f2b(b2f(h) * k)),
    );
}

#[test]
#[should_panic(expected = "different lengths")]
fn zip_map_rejects_slices_of_different_lengths() {
    crate::f16::zip_map(&mut [0; 3], &[0; 2], |a, b| a + b);
}

#[test]
fn every_copy_equals_copy_from_slice_at_every_length_and_alignment() {
    let mut rng = Rng(0x5eed);
    let src: Vec<u8> = (0..9000 + 64).map(|_| rng.next() as u8).collect();
    let mut dst = vec![0u8; src.len()];
    type Copy = fn(&mut [u8], &[u8]);
    let copies: [(&str, Copy); 3] = [
        ("streaming", crate::copy::streaming),
        ("cached", crate::copy::cached),
        ("bulk", crate::copy::bulk),
    ];
    for (name, copy) in copies {
        // 4095/4096 and 9000 straddle `bulk`'s switch to the vector moves.
        for len in (0..300).chain([1000, 4095, 4096, 9000]) {
            for d_off in 0..17 {
                for s_off in [0, 1, 7, 16] {
                    dst.fill(0xaa);
                    copy(&mut dst[d_off..d_off + len], &src[s_off..s_off + len]);
                    let what = format!("{name}: len {len}, offsets {d_off}/{s_off}");
                    assert_eq!(&dst[d_off..d_off + len], &src[s_off..s_off + len], "{what}");
                    // Nothing outside the destination moved.
                    assert!(dst[..d_off].iter().all(|&b| b == 0xaa), "{what}");
                    assert!(dst[d_off + len..].iter().all(|&b| b == 0xaa), "{what}");
                }
            }
        }
    }
}

#[test]
#[should_panic(expected = "different lengths")]
fn streaming_copy_rejects_slices_of_different_lengths() {
    crate::copy::streaming(&mut [0u8; 3], &[0u8; 4]);
}

/// `bulk` at the page-offset distances where it takes the vector moves instead of `memcpy`
/// (0-63 bytes past the source) and around them.
#[test]
fn bulk_copies_whole_at_every_page_offset_distance() {
    let mut rng = Rng(0xb01c);
    let len = 8192 + 3;
    let src: Vec<u8> = (0..len + 4096).map(|_| rng.next() as u8).collect();
    let mut dst = vec![0u8; len + 8192];
    let s = 5;
    let src_offset = (src.as_ptr() as usize + s) % 4096;
    for distance in [0, 1, 16, 31, 32, 63, 64, 100, 4095] {
        // The index of `dst` whose page offset is `distance` past the source's.
        let d = (4096 + src_offset + distance - dst.as_ptr() as usize % 4096) % 4096;
        dst.fill(0xaa);
        crate::copy::bulk(&mut dst[d..d + len], &src[s..s + len]);
        assert_eq!(&dst[d..d + len], &src[s..s + len], "distance {distance}");
        assert!(dst[..d].iter().all(|&b| b == 0xaa), "distance {distance}");
        assert!(
            dst[d + len..].iter().all(|&b| b == 0xaa),
            "distance {distance}"
        );
    }
}

#[test]
#[should_panic(expected = "different lengths")]
fn bulk_copy_rejects_slices_of_different_lengths() {
    crate::copy::bulk(&mut [0u8; 5000], &[0u8; 4999]);
}

#[test]
#[should_panic(expected = "different lengths")]
fn cached_copy_rejects_slices_of_different_lengths() {
    crate::copy::cached(&mut [0u8; 300], &[0u8; 299]);
}
