//! nccl-tests-style benchmark of the Gloo backend: one process per rank, launched by
//! `cargo xtask bench` (or any launcher that sets RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT).
//!
//! Conventions follow `../shared/anchors/anchor_common.py` so that results compare directly
//! with torch's Gloo and Open MPI: each iteration is timed on every rank with no barrier in
//! between, the per-iteration maximum over ranks is taken, and the median of those is
//! reported. Bus bandwidth uses nccl-tests' factors. `#wrong` comes from a real check.
//!
//! Arguments (all optional): `--ops a,b,c` `--sizes bytes,...` `-n iters` `-w warmup`
//! `-c 0|1` `--json path` `--budget seconds`.

#![allow(missing_docs, reason = "an example binary")]

use std::time::{Duration, Instant};

use dist_backend::{Backend, BufMut, BufRef, OpOptions};
use dist_gloo::{GlooBackend, GlooOptions};
use dist_wire::{DType, ReduceOp};

struct Args {
    ops: Vec<String>,
    sizes: Vec<usize>,
    iters: usize,
    warmup: usize,
    check: bool,
    json: Option<String>,
    budget: f64,
}

fn parse() -> Args {
    let mut a = Args {
        ops: [
            "barrier",
            "allreduce_4B",
            "all_reduce",
            "broadcast",
            "all_gather",
            "reduce_scatter",
            "all_to_all",
        ]
        .map(String::from)
        .to_vec(),
        sizes: vec![4 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20],
        iters: 0,
        warmup: 3,
        check: true,
        json: None,
        budget: 1.5,
    };
    let argv: Vec<String> = std::env::args().skip(1).collect();
    let mut i = 0;
    while i < argv.len() {
        let v = argv.get(i + 1).cloned().unwrap_or_default();
        match argv[i].as_str() {
            "--ops" => a.ops = v.split(',').map(String::from).collect(),
            "--sizes" => {
                a.sizes = v
                    .split(',')
                    .map(|s| s.parse().expect("--sizes takes byte counts"))
                    .collect()
            }
            "-n" => a.iters = v.parse().expect("-n takes a count"),
            "-w" => a.warmup = v.parse().expect("-w takes a count"),
            "-c" => a.check = v != "0",
            "--json" => a.json = Some(v),
            "--budget" => a.budget = v.parse().expect("--budget takes seconds"),
            other => panic!("unknown argument {other}"),
        }
        i += 2;
    }
    a
}

fn bus_factor(op: &str, n: usize) -> Option<f64> {
    let n = n as f64;
    match op {
        "all_reduce" => Some(2.0 * (n - 1.0) / n),
        "all_gather" | "reduce_scatter" | "all_to_all" => Some((n - 1.0) / n),
        "broadcast" => Some(1.0),
        _ => None,
    }
}

fn total_bytes(op: &str, size: usize, n: usize) -> usize {
    match op {
        "all_gather" | "reduce_scatter" => size * n,
        "allreduce_4B" => 4,
        "barrier" => 0,
        _ => size,
    }
}

/// Buffers for one op and size, and the closure that runs it once.
struct Case {
    a: Vec<f32>,
    b: Vec<f32>,
}

fn run_once(pg: &GlooBackend, op: &str, c: &mut Case, opts: &OpOptions) {
    let n = pg.world_size();
    let r = match op {
        "barrier" => pg.barrier(opts),
        "all_reduce" | "allreduce_4B" => pg.all_reduce(
            BufMut::Host(bytemuck::cast_slice_mut(&mut c.a)),
            DType::F32,
            ReduceOp::Sum,
            opts,
        ),
        "broadcast" => pg.broadcast(
            BufMut::Host(bytemuck::cast_slice_mut(&mut c.a)),
            DType::F32,
            0,
            opts,
        ),
        "all_gather" => pg.all_gather(
            BufRef::Host(bytemuck::cast_slice(&c.a)),
            BufMut::Host(bytemuck::cast_slice_mut(&mut c.b)),
            DType::F32,
            &vec![c.a.len(); n],
            opts,
        ),
        "reduce_scatter" => {
            let counts = vec![c.b.len(); n];
            pg.reduce_scatter(
                BufRef::Host(bytemuck::cast_slice(&c.a)),
                BufMut::Host(bytemuck::cast_slice_mut(&mut c.b)),
                DType::F32,
                ReduceOp::Sum,
                &counts,
                opts,
            )
        }
        "all_to_all" => {
            let per = c.a.len() / n;
            pg.all_to_all(
                BufRef::Host(bytemuck::cast_slice(&c.a)),
                BufMut::Host(bytemuck::cast_slice_mut(&mut c.b)),
                DType::F32,
                &vec![per; n],
                &vec![per; n],
                opts,
            )
        }
        other => panic!("unknown op {other}"),
    };
    r.unwrap_or_else(|e| panic!("{op}: {e}"));
}

fn setup(op: &str, size: usize, n: usize, rank: usize) -> Case {
    let elems = (size / 4).max(1);
    let fill = |len: usize| {
        (0..len)
            .map(|i| ((rank * 31 + i) % 13) as f32)
            .collect::<Vec<f32>>()
    };
    match op {
        "barrier" => Case {
            a: vec![],
            b: vec![],
        },
        "allreduce_4B" => Case {
            a: fill(1),
            b: vec![],
        },
        "all_gather" => Case {
            a: fill(elems),
            b: vec![0.0; elems * n],
        },
        "reduce_scatter" => Case {
            a: fill(elems * n),
            b: vec![0.0; elems],
        },
        "all_to_all" => {
            let e = elems / n * n;
            Case {
                a: fill(e),
                b: vec![0.0; e],
            }
        }
        _ => Case {
            a: fill(elems),
            b: vec![],
        },
    }
}

/// Number of elements of the result that differ from an independent computation.
fn wrong(op: &str, c: &Case, n: usize, rank: usize) -> u64 {
    let v = |r: usize, i: usize| ((r * 31 + i) % 13) as f32;
    let count = |got: &[f32], want: &dyn Fn(usize) -> f32| {
        got.iter()
            .enumerate()
            .filter(|(i, g)| **g != want(*i))
            .count() as u64
    };
    match op {
        "all_reduce" | "allreduce_4B" => count(&c.a, &|i| (0..n).map(|r| v(r, i)).sum()),
        "broadcast" => count(&c.a, &|i| v(0, i)),
        "all_gather" => {
            let e = c.a.len();
            count(&c.b, &|i| v(i / e, i % e))
        }
        "reduce_scatter" => {
            let e = c.b.len();
            count(&c.b, &|i| (0..n).map(|r| v(r, rank * e + i)).sum())
        }
        "all_to_all" => {
            let per = c.a.len() / n;
            count(&c.b, &|i| v(i / per.max(1), rank * per + i % per.max(1)))
        }
        _ => 0,
    }
}

fn main() {
    let args = parse();
    let info = dist_backend::init::init_from_url("env://", None, None, Duration::from_secs(60))
        .expect("init from env://");
    let (rank, n) = (info.rank, info.world_size);
    let pg = GlooBackend::connect(&*info.store, "bench", rank, n, &GlooOptions::from_env())
        .expect("mesh");
    let opts = OpOptions::with_timeout(Duration::from_secs(120));
    let mut rows = Vec::new();
    if rank == 0 {
        println!("# dist-gloo benchmark: world_size {n}, float32, sum, root 0");
        println!("#");
        println!(
            "# {:>12} {:>12} {:>8} {:>6} {:>6} {:>10} {:>8} {:>8} {:>6}",
            "size", "count", "type", "redop", "root", "time", "algbw", "busbw", "#wrong"
        );
        println!(
            "# {:>12} {:>12} {:>8} {:>6} {:>6} {:>10} {:>8} {:>8} {:>6}",
            "(B)", "(elements)", "", "", "", "(us)", "(GB/s)", "(GB/s)", ""
        );
    }
    let mut wrong_total = 0u64;
    let mut bw_sum = 0.0;
    let mut bw_n = 0;
    for op in &args.ops {
        let sizes: Vec<usize> = match op.as_str() {
            "barrier" => vec![0],
            "allreduce_4B" => vec![4],
            _ => args.sizes.clone(),
        };
        for &size in &sizes {
            let mut c = setup(op, size, n, rank);
            for _ in 0..args.warmup {
                run_once(&pg, op, &mut c, &opts);
            }
            // Iteration count: fixed by -n, or fitted to the time budget (agreed through an
            // all_reduce so every rank runs the same number).
            let iters = if args.iters > 0 {
                args.iters
            } else {
                let t = Instant::now();
                run_once(&pg, op, &mut c, &opts);
                let mut est = [t.elapsed().as_secs_f64()];
                pg.all_reduce(
                    BufMut::Host(bytemuck::cast_slice_mut(&mut est)),
                    DType::F64,
                    ReduceOp::Max,
                    &opts,
                )
                .expect("agree on iterations");
                ((args.budget / est[0].max(1e-7)) as usize).clamp(5, 2000)
            };
            let mut times = vec![0f64; iters];
            for t in times.iter_mut() {
                let t0 = Instant::now();
                run_once(&pg, op, &mut c, &opts);
                *t = t0.elapsed().as_secs_f64();
            }
            pg.all_reduce(
                BufMut::Host(bytemuck::cast_slice_mut(&mut times)),
                DType::F64,
                ReduceOp::Max,
                &opts,
            )
            .expect("collect times");
            let mut bad = [0u64];
            if args.check {
                c = setup(op, size, n, rank);
                run_once(&pg, op, &mut c, &opts);
                bad[0] = wrong(op, &c, n, rank);
                pg.all_reduce(
                    BufMut::Host(bytemuck::cast_slice_mut(&mut bad)),
                    DType::U64,
                    ReduceOp::Sum,
                    &opts,
                )
                .expect("collect #wrong");
            }
            wrong_total += bad[0];
            if rank == 0 {
                times.sort_by(f64::total_cmp);
                let med = times[times.len() / 2];
                let tb = total_bytes(op, size, n) as f64;
                let algbw = if tb > 0.0 { tb / med / 1e9 } else { 0.0 };
                let busbw = bus_factor(op, n).map(|f| algbw * f);
                if let Some(b) = busbw {
                    bw_sum += b;
                    bw_n += 1;
                }
                let count = if op == "barrier" { 0 } else { size.max(4) / 4 };
                println!(
                    "  {:>12} {:>12} {:>8} {:>6} {:>6} {:>10.1} {:>8.3} {:>8.3} {:>6}   {op}",
                    size,
                    count,
                    "float",
                    if op.contains("reduce") { "sum" } else { "none" },
                    if op == "broadcast" { "0" } else { "-1" },
                    med * 1e6,
                    algbw,
                    busbw.unwrap_or(0.0),
                    if args.check {
                        bad[0].to_string()
                    } else {
                        "N/A".into()
                    }
                );
                rows.push(format!(
                    "{{\"op\":\"{op}\",\"bytes_per_rank\":{size},\"total_bytes\":{tb},\"iters\":{iters},\"median_us\":{},\"min_us\":{},\"algbw_GBps\":{},\"busbw_GBps\":{},\"wrong\":{}}}",
                    med * 1e6, times[0] * 1e6, if tb > 0.0 { algbw.to_string() } else { "null".into() },
                    busbw.map_or("null".into(), |b| b.to_string()), bad[0]
                ));
            }
        }
    }
    if rank == 0 {
        println!(
            "# Out of bounds values : {wrong_total} {}",
            if wrong_total == 0 { "OK" } else { "FAILED" }
        );
        println!(
            "# Avg bus bandwidth    : {:.4}",
            if bw_n > 0 { bw_sum / bw_n as f64 } else { 0.0 }
        );
        println!("#");
        if let Some(path) = &args.json {
            let body = format!(
                "{{\"meta\":{{\"system\":\"dist-gloo\",\"world_size\":{n}}},\"results\":[{}]}}\n",
                rows.join(",")
            );
            std::fs::write(path, body).expect("write --json");
        }
    }
    if wrong_total > 0 {
        std::process::exit(1);
    }
}
