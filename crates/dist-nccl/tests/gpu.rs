//! The GPU suite: every op, every dtype and every size class against a host reference, a
//! rank that stops answering (the watchdog aborts and names the op), and split. One rank per
//! GPU, as threads of this process over one in-memory store.
//!
//! It runs where libcuda and libnccl load and a GPU is present (`cargo xtask test --gpu`);
//! elsewhere each test prints "skipped: no CUDA driver/NCCL found" and passes.

use std::sync::Arc;
use std::time::Duration;

use dist_backend::store::HashStore;
use dist_backend::{Backend, BufMut, BufRef, OpOptions, Store};
use dist_nccl::{DeviceAlloc, NcclBackend, NcclOptions};
use dist_wire::{DType, ReduceOp};

/// The GPUs to use, or `None` (printing why) when this machine has none.
fn gpus() -> Option<usize> {
    let n = dist_nccl::ensure_loaded().and_then(|()| dist_nccl::device_count(0));
    match n {
        Ok(n) if n > 0 => Some(n as usize),
        Ok(_) => {
            println!("skipped: no CUDA driver/NCCL found (the driver reports no device)");
            None
        }
        Err(e) => {
            println!("skipped: no CUDA driver/NCCL found ({e})");
            None
        }
    }
}

/// Runs `f(rank, backend)` on `world` threads, rank r on GPU r, and returns their results.
fn world<R: Send + 'static>(
    world: usize,
    opts: NcclOptions,
    f: impl Fn(usize, NcclBackend) -> R + Send + Sync + 'static,
) -> Vec<R> {
    let store: Arc<dyn Store> = Arc::new(HashStore::new(Duration::from_secs(60)));
    let f = Arc::new(f);
    let handles: Vec<_> = (0..world)
        .map(|r| {
            let (store, f, mut o) = (store.clone(), f.clone(), opts.clone());
            o.device = Some(r as u32);
            std::thread::spawn(move || {
                let b = NcclBackend::new(store, "gpu-test", r, world, o).expect("backend");
                f(r, b)
            })
        })
        .collect();
    handles
        .into_iter()
        .map(|h| h.join().expect("rank thread"))
        .collect()
}

fn encode(d: DType, v: &[f64]) -> Vec<u8> {
    let mut out = Vec::with_capacity(v.len() * d.size());
    for &x in v {
        match d {
            DType::I8 => out.extend((x as i8).to_ne_bytes()),
            DType::U8 => out.extend((x as u8).to_ne_bytes()),
            DType::I16 => out.extend((x as i16).to_ne_bytes()),
            DType::I32 => out.extend((x as i32).to_ne_bytes()),
            DType::U32 => out.extend((x as u32).to_ne_bytes()),
            DType::I64 => out.extend((x as i64).to_ne_bytes()),
            DType::U64 => out.extend((x as u64).to_ne_bytes()),
            DType::F16 => out.extend(half::f16::from_f64(x).to_bits().to_ne_bytes()),
            DType::BF16 => out.extend(half::bf16::from_f64(x).to_bits().to_ne_bytes()),
            DType::F32 => out.extend((x as f32).to_ne_bytes()),
            DType::F64 => out.extend(x.to_ne_bytes()),
            other => panic!("no encoding for {other}"),
        }
    }
    out
}

fn decode(d: DType, b: &[u8]) -> Vec<f64> {
    b.chunks_exact(d.size())
        .map(|c| match d {
            DType::I8 => i8::from_ne_bytes([c[0]]) as f64,
            DType::U8 => c[0] as f64,
            DType::I16 => i16::from_ne_bytes([c[0], c[1]]) as f64,
            DType::I32 => i32::from_ne_bytes(c.try_into().unwrap()) as f64,
            DType::U32 => u32::from_ne_bytes(c.try_into().unwrap()) as f64,
            DType::I64 => i64::from_ne_bytes(c.try_into().unwrap()) as f64,
            DType::U64 => u64::from_ne_bytes(c.try_into().unwrap()) as f64,
            DType::F16 => half::f16::from_bits(u16::from_ne_bytes([c[0], c[1]])).to_f64(),
            DType::BF16 => half::bf16::from_bits(u16::from_ne_bytes([c[0], c[1]])).to_f64(),
            DType::F32 => f32::from_ne_bytes(c.try_into().unwrap()) as f64,
            DType::F64 => f64::from_ne_bytes(c.try_into().unwrap()),
            other => panic!("no decoding for {other}"),
        })
        .collect()
}

/// Rank r's element i: small non-negative integers, exact in every dtype and in every sum.
fn value(r: usize, i: usize) -> f64 {
    ((i * 7 + r * 3) % 5) as f64
}

/// The Product operand made of an element: 1 or 2, so that products stay exact in i8.
fn pv(x: f64) -> f64 {
    if x >= 3.0 { 2.0 } else { 1.0 }
}

fn data(r: usize, n: usize) -> Vec<f64> {
    (0..n).map(|i| value(r, i)).collect()
}

fn reduce_ref(op: ReduceOp, d: DType, world: usize, n: usize) -> Vec<f64> {
    (0..n)
        .map(|i| {
            let xs = (0..world).map(|r| value(r, i));
            let v = match op {
                ReduceOp::Sum => xs.sum(),
                ReduceOp::Product => xs.map(pv).product(),
                ReduceOp::Min => xs.fold(f64::INFINITY, f64::min),
                ReduceOp::Max => xs.fold(0.0, f64::max),
                ReduceOp::Avg => xs.sum::<f64>() / world as f64,
                ReduceOp::PremulSum(f) => xs.map(|x| f * x).sum(),
                other => panic!("no reference for {other:?}"),
            };
            if d.is_float() { v } else { v.trunc() }
        })
        .collect()
}

fn close(d: DType, got: &[f64], want: &[f64], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let tol = match d {
        DType::F16 | DType::BF16 => 3e-2,
        DType::F32 => 1e-5,
        _ => 0.0,
    };
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= tol * w.abs().max(1.0),
            "{what}: element {i} is {g}, want {w}"
        );
    }
}

const SIZES: [usize; 4] = [0, 1, 1003, 1 << 20];
const REDUCE_DTYPES: [DType; 10] = [
    DType::I8,
    DType::U8,
    DType::I32,
    DType::U32,
    DType::I64,
    DType::U64,
    DType::F16,
    DType::BF16,
    DType::F32,
    DType::F64,
];

fn ops_for(d: DType) -> Vec<ReduceOp> {
    let f = if d.is_float() { 0.5 } else { 2.0 };
    vec![
        ReduceOp::Sum,
        ReduceOp::Product,
        ReduceOp::Min,
        ReduceOp::Max,
        ReduceOp::Avg,
        ReduceOp::PremulSum(f),
    ]
}

/// A backend's view of `a`. Every operation in this suite blocks until the GPU has finished
/// (the default `blocking_wait`), and each allocation lives until after the operations given
/// it, so the contract of `DeviceBuffer::from_raw` holds.
fn dbuf(a: &DeviceAlloc) -> dist_backend::DeviceBuffer {
    // SAFETY: see above; `a` is owned device memory of its device, on the default stream.
    unsafe { a.buffer() }
}

/// Device data for rank r (kept alive by the caller).
fn up(r: usize, d: DType, v: &[f64]) -> DeviceAlloc {
    DeviceAlloc::from_bytes(r as u32, &encode(d, v)).expect("upload")
}

#[test]
fn reductions_every_dtype_op_and_size() {
    let Some(n) = gpus() else { return };
    world(n, NcclOptions::default(), move |r, b| {
        let o = OpOptions::default();
        for d in REDUCE_DTYPES {
            for op in ops_for(d) {
                // 2^world must fit in i8.
                if matches!(op, ReduceOp::Product) && n > 6 {
                    continue;
                }
                for size in SIZES {
                    let input: Vec<f64> = if matches!(op, ReduceOp::Product) {
                        data(r, size).into_iter().map(pv).collect()
                    } else {
                        data(r, size)
                    };
                    let want = reduce_ref(op, d, n, size);
                    let what = format!("rank {r} {d} {op:?} × {size}");
                    let a = up(r, d, &input);
                    b.all_reduce(BufMut::Device(dbuf(&a)), d, op, &o)
                        .expect(&what);
                    close(
                        d,
                        &decode(d, &a.download().unwrap()),
                        &want,
                        &format!("all_reduce {what}"),
                    );
                    let a = up(r, d, &input);
                    b.reduce(BufMut::Device(dbuf(&a)), d, op, n - 1, &o)
                        .expect(&what);
                    if r == n - 1 {
                        close(
                            d,
                            &decode(d, &a.download().unwrap()),
                            &want,
                            &format!("reduce {what}"),
                        );
                    }
                    // reduce_scatter: every rank's share is `size` elements (even) ...
                    let full: Vec<f64> = (0..n).flat_map(|_| input.iter().copied()).collect();
                    let i = up(r, d, &full);
                    let out = up(r, d, &vec![0.0; size]);
                    let counts = vec![size; n];
                    b.reduce_scatter(
                        BufRef::Device(dbuf(&i)),
                        BufMut::Device(dbuf(&out)),
                        d,
                        op,
                        &counts,
                        &o,
                    )
                    .expect(&what);
                    close(
                        d,
                        &decode(d, &out.download().unwrap()),
                        &want,
                        &format!("reduce_scatter {what}"),
                    );
                }
            }
        }
        // ... and uneven: rank q's share is q + 1 elements of the same pattern.
        let d = DType::F32;
        let counts: Vec<usize> = (0..n).map(|q| q + 1).collect();
        let total: usize = counts.iter().sum();
        let i = up(r, d, &data(r, total));
        let out = up(r, d, &vec![0.0; counts[r]]);
        b.reduce_scatter(
            BufRef::Device(dbuf(&i)),
            BufMut::Device(dbuf(&out)),
            d,
            ReduceOp::Sum,
            &counts,
            &o,
        )
        .unwrap();
        let off: usize = counts[..r].iter().sum();
        let want: Vec<f64> = reduce_ref(ReduceOp::Sum, d, n, total)[off..off + counts[r]].to_vec();
        close(
            d,
            &decode(d, &out.download().unwrap()),
            &want,
            "uneven reduce_scatter",
        );
    });
}

#[test]
fn data_movement_every_dtype_and_size() {
    let Some(n) = gpus() else { return };
    world(n, NcclOptions::default(), move |r, b| {
        let o = OpOptions::default();
        for d in DType::ALL {
            for size in SIZES {
                let what = format!("rank {r} {d} × {size}");
                // broadcast from the last rank
                let root = n - 1;
                let a = up(r, d, &data(r, size));
                b.broadcast(BufMut::Device(dbuf(&a)), d, root, &o)
                    .expect(&what);
                close(
                    d,
                    &decode(d, &a.download().unwrap()),
                    &data(root, size),
                    &format!("broadcast {what}"),
                );
                // all_gather, even
                let i = up(r, d, &data(r, size));
                let out = up(r, d, &vec![0.0; size * n]);
                b.all_gather(
                    BufRef::Device(dbuf(&i)),
                    BufMut::Device(dbuf(&out)),
                    d,
                    &vec![size; n],
                    &o,
                )
                .expect(&what);
                let want: Vec<f64> = (0..n).flat_map(|q| data(q, size)).collect();
                close(
                    d,
                    &decode(d, &out.download().unwrap()),
                    &want,
                    &format!("all_gather {what}"),
                );
                // all_to_all, uneven: rank r sends (q + size) % 3 + size elements to q
                let cnt = |from: usize, to: usize| (from + to + size) % 3 + size;
                let sc: Vec<usize> = (0..n).map(|q| cnt(r, q)).collect();
                let rc: Vec<usize> = (0..n).map(|q| cnt(q, r)).collect();
                let block = |from: usize, to: usize| -> Vec<f64> {
                    (0..cnt(from, to))
                        .map(|k| ((from * 31 + to * 7 + k) % 5) as f64)
                        .collect()
                };
                let send: Vec<f64> = (0..n).flat_map(|q| block(r, q)).collect();
                let want: Vec<f64> = (0..n).flat_map(|q| block(q, r)).collect();
                let i = up(r, d, &send);
                let out = up(r, d, &vec![0.0; want.len()]);
                b.all_to_all(
                    BufRef::Device(dbuf(&i)),
                    BufMut::Device(dbuf(&out)),
                    d,
                    &sc,
                    &rc,
                    &o,
                )
                .expect(&what);
                close(
                    d,
                    &decode(d, &out.download().unwrap()),
                    &want,
                    &format!("all_to_all {what}"),
                );
                // gather and scatter at root 0
                let i = up(r, d, &data(r, size));
                let out = (r == 0).then(|| up(r, d, &vec![0.0; size * n]));
                let ob = out.as_ref().map(|a| BufMut::Device(dbuf(a)));
                b.gather(BufRef::Device(dbuf(&i)), ob, d, 0, &o)
                    .expect(&what);
                if let Some(out) = &out {
                    let want: Vec<f64> = (0..n).flat_map(|q| data(q, size)).collect();
                    close(
                        d,
                        &decode(d, &out.download().unwrap()),
                        &want,
                        &format!("gather {what}"),
                    );
                }
                let src = (r == 0).then(|| {
                    up(
                        r,
                        d,
                        &(0..n).flat_map(|q| data(q + 1, size)).collect::<Vec<_>>(),
                    )
                });
                let out = up(r, d, &vec![0.0; size]);
                let ib = src.as_ref().map(|a| BufRef::Device(dbuf(a)));
                b.scatter(ib, BufMut::Device(dbuf(&out)), d, 0, &o)
                    .expect(&what);
                close(
                    d,
                    &decode(d, &out.download().unwrap()),
                    &data(r + 1, size),
                    &format!("scatter {what}"),
                );
            }
        }
        // uneven all_gather and send/recv around a ring, then a barrier
        let d = DType::F32;
        let counts: Vec<usize> = (0..n).map(|q| 2 * q + 1).collect();
        let i = up(r, d, &data(r, counts[r]));
        let out = up(r, d, &vec![0.0; counts.iter().sum()]);
        b.all_gather(
            BufRef::Device(dbuf(&i)),
            BufMut::Device(dbuf(&out)),
            d,
            &counts,
            &o,
        )
        .unwrap();
        let want: Vec<f64> = (0..n).flat_map(|q| data(q, counts[q])).collect();
        close(
            d,
            &decode(d, &out.download().unwrap()),
            &want,
            "uneven all_gather",
        );
        if n > 1 {
            let s = up(r, d, &data(r, 1000));
            let rv = up(r, d, &vec![0.0; 1000]);
            // Even ranks send first so the blocking pairs never wait on each other in a cycle.
            let (to, from) = ((r + 1) % n, (r + n - 1) % n);
            let (sb, rb) = (dbuf(&s), dbuf(&rv));
            if r % 2 == 0 {
                b.send(BufRef::Device(sb), d, to, &o).unwrap();
                b.recv(BufMut::Device(rb), d, from, &o).unwrap();
            } else {
                b.recv(BufMut::Device(rb), d, from, &o).unwrap();
                b.send(BufRef::Device(sb), d, to, &o).unwrap();
            }
            close(
                d,
                &decode(d, &rv.download().unwrap()),
                &data(from, 1000),
                "send/recv",
            );
        }
        b.barrier(&o).unwrap();
        assert!(b.flight_records().iter().any(|f| f.op == "barrier"));
    });
}

#[test]
fn bad_input_is_an_error_not_a_panic() {
    let Some(_) = gpus() else { return };
    world(1, NcclOptions::default(), |_, b| {
        let o = OpOptions::default();
        let e = b
            .all_reduce(BufMut::Host(&mut [0u8; 4]), DType::F32, ReduceOp::Sum, &o)
            .unwrap_err();
        assert!(e.to_string().contains("host memory"), "{e}");
        let a = up(0, DType::I16, &[1.0, 2.0]);
        let e = b
            .all_reduce(BufMut::Device(dbuf(&a)), DType::I16, ReduceOp::Sum, &o)
            .unwrap_err();
        assert!(e.to_string().contains("NCCL cannot reduce"), "{e}");
        let e = b
            .all_reduce(BufMut::Device(dbuf(&a)), DType::I16, ReduceOp::BitAnd, &o)
            .unwrap_err();
        assert!(
            e.to_string().contains("BAND") || e.to_string().contains("NCCL"),
            "{e}"
        );
        let e = b
            .broadcast(BufMut::Device(dbuf(&a)), DType::I16, 3, &o)
            .unwrap_err();
        assert!(e.to_string().contains("root 3"), "{e}");
        // A closed backend refuses later operations rather than making a new communicator.
        b.barrier(&o).unwrap();
        b.close();
        let e = b.barrier(&o).unwrap_err();
        assert!(e.to_string().contains("was closed"), "{e}");
    });
}

#[test]
fn a_silent_rank_makes_the_watchdog_abort_and_name_the_op() {
    let Some(n) = gpus() else { return };
    if n < 2 {
        println!("skipped: the abort test needs two GPUs (NCCL puts one rank per GPU)");
        return;
    }
    let mut opts = NcclOptions::default();
    opts.watchdog_interval = Duration::from_millis(20);
    let errs = world(2, opts, |r, b| {
        let o = OpOptions::with_timeout(Duration::from_secs(3));
        let a = up(r, DType::F32, &data(r, 1 << 16));
        b.all_reduce(BufMut::Device(dbuf(&a)), DType::F32, ReduceOp::Sum, &o)
            .unwrap();
        if r == 1 {
            // Rank 1 stops taking part (as a killed rank would), keeping its GPU memory.
            std::thread::sleep(Duration::from_secs(6));
            return None;
        }
        let e = b
            .all_reduce(BufMut::Device(dbuf(&a)), DType::F32, ReduceOp::Sum, &o)
            .unwrap_err();
        let later = b
            .broadcast(BufMut::Device(dbuf(&a)), DType::F32, 0, &o)
            .unwrap_err();
        // Closing after the abort does not drain the failed op for the group's timeout
        // (300 s by default; it did, in close and again on drop).
        let closing = std::time::Instant::now();
        b.close();
        drop(b);
        assert!(
            closing.elapsed() < Duration::from_secs(60),
            "close took {:?}",
            closing.elapsed()
        );
        Some((e.to_string(), later.to_string()))
    });
    let (e, later) = errs[0].clone().unwrap();
    assert!(e.contains("all_reduce #2 failed"), "{e}");
    assert!(
        e.contains("all_reduce #2 did not complete within 3s"),
        "{e}"
    );
    assert!(e.contains("completed up to #1"), "{e}");
    assert!(
        later.contains("broadcast #3 failed") && later.contains("all_reduce #2 did not complete"),
        "{later}"
    );
}

/// A first operation without a buffer (a barrier) takes the launcher's local rank modulo the
/// devices: under Slurm with one visible GPU per task, local rank 3 is device 0.
#[test]
fn a_barrier_first_takes_the_local_rank_modulo_the_devices() {
    let Some(n) = gpus() else { return };
    let store: Arc<dyn Store> = Arc::new(HashStore::new(Duration::from_secs(60)));
    let mut o = NcclOptions::default();
    o.local_rank = Some(2 * n as u32 - 1);
    let b = NcclBackend::new(store, "local-rank", 0, 1, o).expect("backend");
    b.barrier(&OpOptions::default()).unwrap();
    assert_eq!(b.device(), Some(n as u32 - 1));
}

#[test]
fn split_makes_working_sub_communicators() {
    let Some(n) = gpus() else { return };
    world(n, NcclOptions::default(), move |r, b| {
        let color = (r % 2) as u32;
        let sub = b.split(Some(color), r).unwrap().expect("a member");
        let members: Vec<usize> = (0..n).filter(|q| q % 2 == r % 2).collect();
        assert_eq!(sub.world_size(), members.len());
        assert_eq!(sub.rank(), members.iter().position(|&q| q == r).unwrap());
        let a = up(r, DType::F64, &data(r, 100));
        sub.all_reduce(
            BufMut::Device(dbuf(&a)),
            DType::F64,
            ReduceOp::Sum,
            &OpOptions::default(),
        )
        .unwrap();
        let want: Vec<f64> = (0..100)
            .map(|i| members.iter().map(|&q| value(q, i)).sum())
            .collect();
        close(
            DType::F64,
            &decode(DType::F64, &a.download().unwrap()),
            &want,
            "split all_reduce",
        );
        let none = b.split(None, r).unwrap();
        assert!(none.is_none());
    });
}
