//! Throughput of the reduction kernels on 64 MiB buffers.
//!
//! The baseline is `f32 a += b` written as the plainest possible loop in this same binary, so
//! the ratio between the two is independent of the machine's noise. `../shared/anchors/memcpy_bench.c`
//! measures the same loop in C (run both in one invocation: `cargo xtask bench kernels`).

#![allow(
    missing_docs,
    reason = "criterion_group! generates an undocumented public function"
)]

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use dist_wire::{DType, ReduceOp, bf16, f16, reduce_into, reduce_slice};
use std::hint::black_box;

const BYTES: usize = 64 << 20;

fn kernels(c: &mut Criterion) {
    let mut g = c.benchmark_group("reduce_64MiB");
    g.throughput(Throughput::Bytes(BYTES as u64));
    g.sample_size(20);

    let n = BYTES / 4;
    let src = vec![1.5f32; n];
    let mut dst = vec![0.25f32; n];
    g.bench_function("baseline_f32_add_assign", |b| {
        b.iter(|| {
            for (d, s) in dst.iter_mut().zip(&src) {
                *d += *s;
            }
            black_box(&mut dst);
        })
    });
    g.bench_function(BenchmarkId::new("reduce_slice", "f32_sum"), |b| {
        b.iter(|| reduce_slice(ReduceOp::Sum, black_box(&mut dst), black_box(&src)).unwrap())
    });
    for (name, dtype) in [("f16_sum", DType::F16), ("bf16_sum", DType::BF16)] {
        let n = BYTES / 2;
        let mut d = vec![0u8; BYTES];
        let s: Vec<u8> = match dtype {
            DType::F16 => bytemuck::cast_slice(&vec![f16::from_f32(0.5); n]).to_vec(),
            _ => bytemuck::cast_slice(&vec![bf16::from_f32(0.5); n]).to_vec(),
        };
        g.bench_function(BenchmarkId::new("reduce_into", name), |b| {
            b.iter(|| reduce_into(ReduceOp::Sum, dtype, black_box(&mut d), black_box(&s)).unwrap())
        });
    }
    g.finish();
}

criterion_group!(benches, kernels);
criterion_main!(benches);
