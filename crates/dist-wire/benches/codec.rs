//! Encode/decode cost of the frame header and the store protocol codec.

#![allow(
    missing_docs,
    reason = "criterion_group! generates an undocumented public function"
)]

use std::hint::black_box;

use criterion::{Criterion, criterion_group, criterion_main};
use dist_wire::store::{Limits, Request, RequestDecoder};
use dist_wire::{CollectiveOp, DType, FrameHeader, NO_ROOT};

fn codec(c: &mut Criterion) {
    let h = FrameHeader {
        op: CollectiveOp::AllReduce,
        dtype: DType::F32,
        reduce: 0,
        group: 7,
        sender: 3,
        seq: 182,
        count: 1 << 20,
        root: NO_ROOT,
        tag: 1 << 16,
        offset: 4096,
        payload_len: 1 << 20,
        flags: 0,
        splits: 0,
        reduce_arg: 0,
    };
    c.bench_function("frame_header/encode", |b| {
        b.iter(|| black_box(black_box(&h).encode()))
    });
    let bytes = h.encode();
    c.bench_function("frame_header/decode", |b| {
        b.iter(|| FrameHeader::decode(black_box(&bytes)).unwrap())
    });

    let req = Request::Set {
        key: b"/rendezvous/addr/17".to_vec(),
        value: b"10.0.0.17:40123".to_vec(),
    };
    let mut out = Vec::with_capacity(64);
    c.bench_function("store/encode_set", |b| {
        b.iter(|| {
            out.clear();
            black_box(&req).encode(&mut out);
        })
    });
    let wire = req.to_bytes();
    let limits = Limits::default();
    c.bench_function("store/decode_set_incremental", |b| {
        b.iter(|| {
            let mut d = RequestDecoder::new(limits);
            // Two partial reads, as a socket delivers them.
            d.feed(&wire[..7]);
            assert!(d.next_request().unwrap().is_none());
            d.feed(&wire[7..]);
            black_box(d.next_request().unwrap().unwrap())
        })
    });
}

criterion_group!(benches, codec);
criterion_main!(benches);
