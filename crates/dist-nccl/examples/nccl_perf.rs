//! nccl-tests' `*_perf` for `NcclBackend`: one rank per GPU (threads of this process), each
//! size timed over `-n` iterations after `-w` warm-ups, then checked once; rank 0 prints
//! nccl-tests' table (size, count, type, redop, root, time, algbw, busbw, #wrong), so the
//! numbers compare directly with `all_reduce_perf -g <GPUs>` on the same machine.
//!
//! `cargo xtask bench all_reduce --backend nccl` runs it. Without a CUDA driver and NCCL it
//! prints "skipped: ..." and exits 0.
//!
//! Usage: `nccl_perf <op> [-b bytes] [-e bytes] [-f factor] [-n iters] [-w iters] [-g gpus]
//! [-o sum|prod|min|max|avg] [-d float|half|bfloat16|double|int32|...]`,
//! op: all_reduce broadcast all_gather reduce_scatter all_to_all.

use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use dist_backend::store::HashStore;
use dist_backend::{Backend, BufMut, BufRef, DeviceBuffer, OpOptions, Store};
use dist_nccl::{DeviceAlloc, NcclBackend, NcclOptions};
use dist_wire::{DType, ReduceOp};

struct Args {
    op: String,
    sizes: Vec<usize>,
    iters: usize,
    warmup: usize,
    gpus: Option<usize>,
    redop: (ReduceOp, &'static str),
    dtype: (DType, &'static str),
}

fn size(s: &str) -> Result<usize, String> {
    let (n, m) = match s.chars().last() {
        Some('K' | 'k') => (&s[..s.len() - 1], 1 << 10),
        Some('M' | 'm') => (&s[..s.len() - 1], 1 << 20),
        Some('G' | 'g') => (&s[..s.len() - 1], 1 << 30),
        _ => (s, 1),
    };
    n.parse::<usize>()
        .map(|n| n * m)
        .map_err(|_| format!("`{s}` is not a size"))
}

fn parse() -> Result<Args, String> {
    let mut it = std::env::args().skip(1);
    let op = it.next().ok_or("missing <op>")?;
    let ops = [
        "all_reduce",
        "broadcast",
        "all_gather",
        "reduce_scatter",
        "all_to_all",
    ];
    if !ops.contains(&op.as_str()) {
        return Err(format!("unknown op `{op}` (one of {ops:?})"));
    }
    let (mut b, mut e, mut f) = (8usize, 256usize << 20, 2usize);
    let mut a = Args {
        op,
        sizes: vec![],
        iters: 20,
        warmup: 5,
        gpus: None,
        redop: (ReduceOp::Sum, "sum"),
        dtype: (DType::F32, "float"),
    };
    while let Some(flag) = it.next() {
        let v = it.next().ok_or(format!("{flag} needs a value"))?;
        let num = |v: &str| {
            v.parse::<usize>()
                .map_err(|_| format!("{flag} {v}: not a number"))
        };
        match flag.as_str() {
            "-b" => b = size(&v)?,
            "-e" => e = size(&v)?,
            "-f" => f = num(&v)?.max(2),
            "-n" => a.iters = num(&v)?.max(1),
            "-w" => a.warmup = num(&v)?,
            "-g" => a.gpus = Some(num(&v)?.max(1)),
            "-o" => {
                a.redop = match v.as_str() {
                    "sum" => (ReduceOp::Sum, "sum"),
                    "prod" => (ReduceOp::Product, "prod"),
                    "min" => (ReduceOp::Min, "min"),
                    "max" => (ReduceOp::Max, "max"),
                    "avg" => (ReduceOp::Avg, "avg"),
                    o => return Err(format!("-o {o}: sum, prod, min, max or avg")),
                }
            }
            "-d" => {
                a.dtype = match v.as_str() {
                    "int8" => (DType::I8, "int8"),
                    "uint8" => (DType::U8, "uint8"),
                    "int32" => (DType::I32, "int32"),
                    "uint32" => (DType::U32, "uint32"),
                    "int64" => (DType::I64, "int64"),
                    "uint64" => (DType::U64, "uint64"),
                    "half" => (DType::F16, "half"),
                    "bfloat16" => (DType::BF16, "bfloat16"),
                    "float" => (DType::F32, "float"),
                    "double" => (DType::F64, "double"),
                    d => return Err(format!("-d {d}: not an NCCL type")),
                }
            }
            other => return Err(format!("unknown flag {other}")),
        }
    }
    let mut s = b.max(1);
    while s <= e {
        a.sizes.push(s);
        s *= f;
    }
    Ok(a)
}

/// nccl-tests' bus bandwidth factor: what each rank's link carries per byte of the op's size.
fn bus_factor(op: &str, n: usize) -> f64 {
    let n = n as f64;
    match op {
        "all_reduce" => 2.0 * (n - 1.0) / n,
        "all_gather" | "reduce_scatter" | "all_to_all" => (n - 1.0) / n,
        _ => 1.0,
    }
}

/// One element pattern per rank, exact in every type: rank r holds r + 1 (0 for the timed
/// runs, whose values do not matter and must not overflow over iterations).
fn fill(d: DType, n: usize, v: f64) -> Vec<u8> {
    let one: Vec<u8> = match d {
        DType::I8 => vec![v as i8 as u8],
        DType::U8 => vec![v as u8],
        DType::I32 => (v as i32).to_ne_bytes().to_vec(),
        DType::U32 => (v as u32).to_ne_bytes().to_vec(),
        DType::I64 => (v as i64).to_ne_bytes().to_vec(),
        DType::U64 => (v as u64).to_ne_bytes().to_vec(),
        DType::F16 => half::f16::from_f64(v).to_bits().to_ne_bytes().to_vec(),
        DType::BF16 => half::bf16::from_f64(v).to_bits().to_ne_bytes().to_vec(),
        DType::F64 => v.to_ne_bytes().to_vec(),
        _ => (v as f32).to_ne_bytes().to_vec(),
    };
    one.repeat(n)
}

/// Sizes in bytes of (input, output) per rank for `op` at nccl-tests' `size` (the larger
/// buffer of the op, as nccl-tests reports).
fn shapes(op: &str, size: usize, n: usize, el: usize) -> (usize, usize) {
    let per = (size / el / n).max(1) * el;
    match op {
        "all_gather" => (per, per * n),
        "reduce_scatter" => (per * n, per),
        "all_to_all" => (per * n, per * n),
        _ => (size / el * el, size / el * el),
    }
}

fn buf(a: &DeviceAlloc) -> DeviceBuffer {
    // SAFETY: every allocation lives until after the last operation given it has finished
    // (each rank ends with a barrier, which completes after every earlier op on its stream).
    unsafe { a.buffer() }
}

fn run_op(
    b: &NcclBackend,
    a: &Args,
    i: &DeviceAlloc,
    o: &DeviceAlloc,
    n: usize,
    opts: &OpOptions,
) -> dist_backend::Result<()> {
    let (d, rop) = (a.dtype.0, a.redop.0);
    let el = d.size();
    match a.op.as_str() {
        "all_reduce" => b.all_reduce(BufMut::Device(buf(o)), d, rop, opts),
        "broadcast" => b.broadcast(BufMut::Device(buf(o)), d, 0, opts),
        "all_gather" => b.all_gather(
            BufRef::Device(buf(i)),
            BufMut::Device(buf(o)),
            d,
            &vec![i.len() / el; n],
            opts,
        ),
        "reduce_scatter" => b.reduce_scatter(
            BufRef::Device(buf(i)),
            BufMut::Device(buf(o)),
            d,
            rop,
            &vec![o.len() / el; n],
            opts,
        ),
        _ => {
            let c = vec![i.len() / el / n; n];
            b.all_to_all(
                BufRef::Device(buf(i)),
                BufMut::Device(buf(o)),
                d,
                &c,
                &c,
                opts,
            )
        }
    }
}

/// Elements of `o` that differ from what the checked run must leave (values r + 1).
fn wrong(a: &Args, n: usize, o: &[u8]) -> usize {
    let d = a.dtype.0;
    let el = d.size();
    let sum = (n * (n + 1) / 2) as f64;
    let want_all = match (a.op.as_str(), a.redop.0) {
        ("broadcast", _) => Some(1.0),
        (_, ReduceOp::Sum) => Some(sum),
        (_, ReduceOp::Min) => Some(1.0),
        (_, ReduceOp::Max) => Some(n as f64),
        (_, ReduceOp::Avg) => Some(if d.is_float() {
            sum / n as f64
        } else {
            (sum / n as f64).trunc()
        }),
        _ => None,
    };
    o.chunks_exact(el)
        .enumerate()
        .filter(|(k, c)| {
            let want = match a.op.as_str() {
                "all_gather" => (k * el / (o.len() / n)) as f64 + 1.0,
                "all_to_all" => (k * el / (o.len() / n)) as f64 + 1.0,
                "all_reduce" | "reduce_scatter" | "broadcast" => match want_all {
                    Some(w) => w,
                    None => return false,
                },
                _ => return false,
            };
            **c != *fill(d, 1, want)
        })
        .count()
}

fn main() {
    let a = match parse() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("nccl_perf: {e}");
            std::process::exit(2);
        }
    };
    let n = match dist_nccl::ensure_loaded().and_then(|()| dist_nccl::device_count(0)) {
        Ok(0) => {
            println!("skipped: no CUDA driver/NCCL found (the driver reports no device)");
            return;
        }
        Ok(c) => a.gpus.unwrap_or(c as usize).min(c as usize),
        Err(e) => {
            println!("skipped: no CUDA driver/NCCL found ({e})");
            return;
        }
    };
    let store: Arc<dyn Store> = Arc::new(HashStore::new(Duration::from_secs(120)));
    let a = Arc::new(a);
    let gate = Arc::new(Barrier::new(n));
    let ranks: Vec<_> = (0..n)
        .map(|r| {
            let (store, a, gate) = (store.clone(), a.clone(), gate.clone());
            std::thread::spawn(move || -> Result<(), String> {
                let mut o = NcclOptions::default();
                o.device = Some(r as u32);
                // Enqueue back to back as nccl-tests does; the closing barrier waits for all.
                o.blocking_wait = false;
                let b = NcclBackend::new(store, "nccl_perf", r, n, o).map_err(|e| e.to_string())?;
                let opts = OpOptions::with_timeout(Duration::from_secs(120));
                if r == 0 {
                    println!(
                        "# nccl_perf: dist-nccl {} on {n} GPU(s), {} iterations after {} warm-ups",
                        a.op, a.iters, a.warmup
                    );
                    println!(
                        "#{:>12} {:>12} {:>8} {:>6} {:>6} {:>10} {:>8} {:>8} {:>6}",
                        "size",
                        "count",
                        "type",
                        "redop",
                        "root",
                        "time",
                        "algbw",
                        "busbw",
                        "#wrong"
                    );
                    println!(
                        "#{:>12} {:>12} {:>8} {:>6} {:>6} {:>10} {:>8} {:>8} {:>6}",
                        "(B)", "(elements)", "", "", "", "(us)", "(GB/s)", "(GB/s)", ""
                    );
                }
                let el = a.dtype.0.size();
                for &size in &a.sizes {
                    let (isz, osz) = shapes(&a.op, size, n, el);
                    let i = DeviceAlloc::from_bytes(r as u32, &fill(a.dtype.0, isz / el, 0.0))
                        .map_err(|e| e.to_string())?;
                    let out = DeviceAlloc::from_bytes(r as u32, &fill(a.dtype.0, osz / el, 0.0))
                        .map_err(|e| e.to_string())?;
                    for _ in 0..a.warmup {
                        run_op(&b, &a, &i, &out, n, &opts).map_err(|e| e.to_string())?;
                    }
                    b.barrier(&opts).map_err(|e| e.to_string())?;
                    gate.wait();
                    let t0 = Instant::now();
                    for _ in 0..a.iters {
                        run_op(&b, &a, &i, &out, n, &opts).map_err(|e| e.to_string())?;
                    }
                    b.barrier(&opts).map_err(|e| e.to_string())?;
                    let us = t0.elapsed().as_secs_f64() * 1e6 / a.iters as f64;
                    // The checked run: every element of rank r's input is r + 1.
                    let mut i = i;
                    let mut out = out;
                    i.upload(&fill(a.dtype.0, isz / el, r as f64 + 1.0))
                        .map_err(|e| e.to_string())?;
                    out.upload(&fill(
                        a.dtype.0,
                        osz / el,
                        if a.op == "all_gather" || a.op == "all_to_all" {
                            0.0
                        } else {
                            r as f64 + 1.0
                        },
                    ))
                    .map_err(|e| e.to_string())?;
                    run_op(&b, &a, &i, &out, n, &opts).map_err(|e| e.to_string())?;
                    b.barrier(&opts).map_err(|e| e.to_string())?;
                    let bad = wrong(&a, n, &out.download().map_err(|e| e.to_string())?);
                    if r == 0 {
                        let bytes = size.max(isz.max(osz)) as f64;
                        let algbw = bytes / us / 1e3;
                        let busbw = algbw * bus_factor(&a.op, n);
                        let root = if a.op == "broadcast" { 0 } else { -1 };
                        println!(
                            " {:>12} {:>12} {:>8} {:>6} {:>6} {:>10.1} {:>8.2} {:>8.2} {:>6}",
                            bytes as usize,
                            bytes as usize / el,
                            a.dtype.1,
                            a.redop.1,
                            root,
                            us,
                            algbw,
                            busbw,
                            bad
                        );
                    } else if bad > 0 {
                        return Err(format!("rank {r}: {bad} wrong elements at size {size}"));
                    }
                }
                Ok(())
            })
        })
        .collect();
    let mut failed = false;
    for (r, h) in ranks.into_iter().enumerate() {
        match h.join() {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                eprintln!("nccl_perf: rank {r}: {e}");
                failed = true;
            }
            Err(_) => {
                eprintln!("nccl_perf: rank {r} panicked");
                failed = true;
            }
        }
    }
    if failed {
        std::process::exit(1);
    }
}
