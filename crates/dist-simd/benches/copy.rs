//! `copy::bulk` against `copy_from_slice` (the C library's `memcpy`) for 16 KiB and 256 KiB
//! copies, with the destination's offset within its 4 KiB page equal to the source's, and 16
//! bytes past it: the distance at which glibc's `rep movsb` slows down on AMD Zen CPUs (see
//! `dist_simd::copy::bulk`); and `copy::streaming` against `copy::cached` for 16 MiB at the
//! same two distances. Both run in one binary, so their ratio is independent of the
//! machine's noise. Run: `cargo bench -p dist-simd --bench copy`.

#![allow(
    missing_docs,
    reason = "criterion_group! generates an undocumented public function"
)]

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use std::hint::black_box;

/// The offset that puts `p + offset` at `page_offset` within its 4 KiB page.
fn at_page_offset(p: *const u8, page_offset: usize) -> usize {
    (4096 + page_offset - (p as usize) % 4096) % 4096
}

fn copies(c: &mut Criterion) {
    for len in [16 << 10, 256 << 10] {
        let mut g = c.benchmark_group(format!("copy_{}KiB", len >> 10));
        g.throughput(Throughput::Bytes(len as u64));
        let src = vec![1u8; len + 8192];
        let mut dst = vec![2u8; len + 8192];
        let s = at_page_offset(src.as_ptr(), 0);
        for distance in [0, 16] {
            let d = at_page_offset(dst.as_ptr(), distance);
            g.bench_function(BenchmarkId::new("copy_from_slice", distance), |b| {
                b.iter(|| dst[d..d + len].copy_from_slice(black_box(&src[s..s + len])))
            });
            g.bench_function(BenchmarkId::new("bulk", distance), |b| {
                b.iter(|| dist_simd::copy::bulk(&mut dst[d..d + len], black_box(&src[s..s + len])))
            });
        }
        g.finish();
    }
    // The streaming stores at the distances where they alias (see `dist_simd::copy::streaming`):
    // the kernel itself against the moves through the cache it hands those distances to.
    let len = 16 << 20;
    let mut g = c.benchmark_group("streaming_16MiB");
    g.throughput(Throughput::Bytes(len as u64));
    g.sample_size(10);
    let src = vec![1u8; len + 8192];
    let mut dst = vec![2u8; len + 8192];
    let s = at_page_offset(src.as_ptr(), 0);
    for distance in [0, 16] {
        let d = at_page_offset(dst.as_ptr(), distance);
        g.bench_function(BenchmarkId::new("streaming", distance), |b| {
            b.iter(|| dist_simd::copy::streaming(&mut dst[d..d + len], black_box(&src[s..s + len])))
        });
        g.bench_function(BenchmarkId::new("cached", distance), |b| {
            b.iter(|| dist_simd::copy::cached(&mut dst[d..d + len], black_box(&src[s..s + len])))
        });
    }
    g.finish();
}

criterion_group!(benches, copies);
criterion_main!(benches);
