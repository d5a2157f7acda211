//! nccl-tests-style benchmark of the Gloo backend: one process per rank, launched by
//! `cargo xtask bench` (or any launcher that sets RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT).
//!
//! Conventions follow `../shared/anchors/anchor_common.py` so that results compare directly
//! with torch's Gloo and Open MPI: each iteration is timed on every rank with no barrier in
//! between, the per-iteration maximum over ranks is taken, and the median of those is
//! reported (the JSON also carries their mean). Bus bandwidth uses nccl-tests' factors.
//! `#wrong` comes from a real check.
//!
//! Arguments (all optional): `--ops a,b,c` `--sizes bytes,...` `-n iters` `-w warmup`
//! `-c 0|1` `--json path` `--budget seconds`, and nccl-tests' `-d` (int8, uint8, int32,
//! uint32, int64, uint64, half, bfloat16, float, double), `-o` (sum, prod, min, max, avg) and
//! `-r` (the root of broadcast, reduce, gather and scatter), and `--huge-pages 0|1`: buffers
//! from 4 MiB in memory advised to use transparent huge pages, as numpy (the Open MPI peer's
//! buffers) does (see [`Buf`]). Besides the default ops, `--ops` takes `reduce`, `gather` and
//! `scatter` (a size is then one rank's block, as for all_gather). `--shift B` starts every
//! buffer of the odd ranks B bytes into its memory, so that ranks' buffers sit at different
//! offsets within their pages, as two programs' (or one program's heap) buffers may.
//! `--per-rank 1` also prints each rank's own times (10th, 50th and 90th percentile and mean)
//! before the maximum over ranks is taken: where one rank runs ahead, the two differ.
//! `--fresh 1` writes every cache line of each rank's input before each timed call, outside
//! its time, as a training step leaves the gradients it reduces (see [`rewrite`]).

#![allow(missing_docs, reason = "an example binary")]

use std::time::{Duration, Instant};

use dist_backend::{Backend, BufMut, BufRef, OpOptions};
use dist_gloo::{GlooBackend, GlooOptions};
use dist_wire::{DType, ReduceOp};

/// What `--help` prints (the module documentation has the details).
const USAGE: &str = "usage: gloo_bench [--ops a,b,...] [--sizes bytes,...] [-n iters] [-w warmup] \
[-c 0|1] [--json path] [--budget seconds] [-d dtype] [-o sum|prod|min|max|avg] [-r root] \
[--huge-pages 0|1] [--shift bytes] [--per-rank 0|1] [--fresh 0|1]
ops: barrier allreduce_4B all_reduce broadcast all_gather reduce_scatter all_to_all reduce gather \
scatter; sizes are plain byte counts (one rank's block for all_gather, gather and scatter).
Run one process per rank under a launcher: distrun --nproc-per-node N -- gloo_bench ...";

struct Args {
    ops: Vec<String>,
    sizes: Vec<usize>,
    iters: usize,
    warmup: usize,
    check: bool,
    json: Option<String>,
    budget: f64,
    dtype: DType,
    dtype_name: String,
    redop: ReduceOp,
    redop_name: String,
    root: usize,
    huge_pages: bool,
    shift: usize,
    per_rank: bool,
    fresh: bool,
}

/// nccl-tests' datatype names.
fn dtype_named(s: &str) -> DType {
    match s {
        "int8" => DType::I8,
        "uint8" => DType::U8,
        "int32" => DType::I32,
        "uint32" => DType::U32,
        "int64" => DType::I64,
        "uint64" => DType::U64,
        "half" => DType::F16,
        "bfloat16" => DType::BF16,
        "float" => DType::F32,
        "double" => DType::F64,
        other => panic!("-d {other}: not an nccl-tests datatype"),
    }
}

/// nccl-tests' reduce op names.
fn redop_named(s: &str) -> ReduceOp {
    match s {
        "sum" => ReduceOp::Sum,
        "prod" => ReduceOp::Product,
        "min" => ReduceOp::Min,
        "max" => ReduceOp::Max,
        "avg" => ReduceOp::Avg,
        other => panic!("-o {other}: not an nccl-tests reduce op"),
    }
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
        dtype: DType::F32,
        dtype_name: "float".into(),
        redop: ReduceOp::Sum,
        redop_name: "sum".into(),
        root: 0,
        huge_pages: false,
        shift: 0,
        per_rank: false,
        fresh: false,
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
            "-d" => {
                a.dtype = dtype_named(&v);
                a.dtype_name = v;
            }
            "-o" => {
                a.redop = redop_named(&v);
                a.redop_name = v;
            }
            "-r" => a.root = v.parse().expect("-r takes a rank"),
            "--huge-pages" => a.huge_pages = v != "0",
            "--shift" => a.shift = v.parse().expect("--shift takes a byte count"),
            "--per-rank" => a.per_rank = v != "0",
            "--fresh" => a.fresh = v != "0",
            "-h" | "--help" => {
                println!("{USAGE}");
                std::process::exit(0);
            }
            other => {
                eprintln!("gloo_bench: unknown argument {other}\n{USAGE}");
                std::process::exit(2);
            }
        }
        i += 2;
    }
    a
}

/// One rank's own iteration times (seconds) as a line: percentiles and mean, in us.
fn own_times(rank: usize, op: &str, size: usize, times: &[f64]) -> String {
    let mut v = times.to_vec();
    v.sort_by(f64::total_cmp);
    let at = |q: usize| v[(v.len() * q / 100).min(v.len() - 1)] * 1e6;
    let mean = v.iter().sum::<f64>() / v.len() as f64 * 1e6;
    format!(
        "# rank {rank} {op} {size} B, own times over {} iterations: p10 {:.1} median {:.1} p90 {:.1} mean {mean:.1} us",
        v.len(),
        at(10),
        at(50),
        at(90),
    )
}

fn bus_factor(op: &str, n: usize) -> Option<f64> {
    let n = n as f64;
    match op {
        "all_reduce" => Some(2.0 * (n - 1.0) / n),
        "all_gather" | "reduce_scatter" | "all_to_all" | "gather" | "scatter" => {
            Some((n - 1.0) / n)
        }
        "broadcast" | "reduce" => Some(1.0),
        _ => None,
    }
}

fn total_bytes(op: &str, size: usize, n: usize) -> usize {
    match op {
        "all_gather" | "reduce_scatter" | "gather" | "scatter" => size * n,
        "allreduce_4B" => 4,
        "barrier" => 0,
        _ => size,
    }
}

/// What one op and size runs on.
struct Case {
    a: Buf,
    b: Buf,
}

/// The size from which numpy advises the kernel to back an array with transparent huge pages
/// (`MADV_HUGEPAGE`, numpy's `_set_madvise_hugepage`).
const HUGE_PAGES_FROM: usize = 4 << 20;

/// A benchmark buffer: a `Vec`, as a Rust user's tensor would be, or, with `--huge-pages 1`
/// and from [`HUGE_PAGES_FROM`] bytes, an anonymous mapping advised to use transparent huge
/// pages, as numpy's arrays are. With THP in `madvise` mode (this host's default) only advised
/// memory gets huge pages, so the two differ in page size: Open MPI's shared-memory all_gather
/// of 64 MiB took 9.8-10.4 ms from numpy's arrays and 16.3-18.4 ms with numpy's advice off.
/// `cargo xtask bench --vs mpi-*` passes `--huge-pages 1` so both sides' pages match.
///
/// The second field is how many bytes into its memory the buffer starts (`--shift`).
enum Buf {
    Plain(Vec<u8>, usize),
    #[cfg(target_os = "linux")]
    Huge(memmap2::MmapMut, usize),
}

impl Buf {
    /// `bytes`, in memory of the kind `huge` asks for, starting `shift` bytes into it.
    fn new(bytes: Vec<u8>, huge: bool, shift: usize) -> Buf {
        #[cfg(target_os = "linux")]
        if huge && bytes.len() >= HUGE_PAGES_FROM {
            let mut m =
                memmap2::MmapMut::map_anon(shift + bytes.len()).expect("an anonymous mapping");
            // Advised before the first write, so that the pages are huge from their first fault.
            m.advise(memmap2::Advice::HugePage)
                .expect("madvise(MADV_HUGEPAGE)");
            m[shift..].copy_from_slice(&bytes);
            return Buf::Huge(m, shift);
        }
        let _ = huge;
        if shift == 0 {
            return Buf::Plain(bytes, 0);
        }
        let mut shifted = vec![0u8; shift];
        shifted.extend_from_slice(&bytes);
        Buf::Plain(shifted, shift)
    }
}

impl std::ops::Deref for Buf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            Buf::Plain(v, at) => &v[*at..],
            #[cfg(target_os = "linux")]
            Buf::Huge(m, at) => &m[*at..],
        }
    }
}

impl std::ops::DerefMut for Buf {
    fn deref_mut(&mut self) -> &mut [u8] {
        match self {
            Buf::Plain(v, at) => &mut v[*at..],
            #[cfg(target_os = "linux")]
            Buf::Huge(m, at) => &mut m[*at..],
        }
    }
}

/// Writes one byte of every 64-byte cache line of `buf` with the value it holds (`--fresh`),
/// as a training step writes the gradients it then reduces: the lines are then dirty in this
/// core's cache. A benchmark that never writes its input finds them clean, and a copy by
/// reference then reads lines that stay cached near the reader from one call to the next.
fn rewrite(buf: &mut [u8]) {
    for i in (0..buf.len()).step_by(64) {
        buf[i] = std::hint::black_box(buf[i]);
    }
}

fn run_once(pg: &GlooBackend, op: &str, c: &mut Case, args: &Args, opts: &OpOptions) {
    let n = pg.world_size();
    let (d, size) = (args.dtype, args.dtype.size());
    let r = match op {
        "barrier" => pg.barrier(opts),
        "all_reduce" | "allreduce_4B" => pg.all_reduce(BufMut::Host(&mut c.a), d, args.redop, opts),
        "broadcast" => pg.broadcast(BufMut::Host(&mut c.a), d, args.root, opts),
        "reduce" => pg.reduce(BufMut::Host(&mut c.a), d, args.redop, args.root, opts),
        "all_gather" => pg.all_gather(
            BufRef::Host(&c.a),
            BufMut::Host(&mut c.b),
            d,
            &vec![c.a.len() / size; n],
            opts,
        ),
        "reduce_scatter" => {
            let counts = vec![c.b.len() / size; n];
            pg.reduce_scatter(
                BufRef::Host(&c.a),
                BufMut::Host(&mut c.b),
                d,
                args.redop,
                &counts,
                opts,
            )
        }
        // The even form, as the peers' `all_to_all_single` without splits and `Alltoall`.
        "all_to_all" => {
            let per = c.a.len() / size / n;
            pg.all_to_all_even(BufRef::Host(&c.a), BufMut::Host(&mut c.b), d, per, opts)
        }
        // Every rank's block is the size given, as for all_gather.
        "gather" => pg.gather(
            BufRef::Host(&c.a),
            (pg.rank() == args.root).then_some(BufMut::Host(&mut c.b)),
            d,
            args.root,
            opts,
        ),
        "scatter" => pg.scatter(
            (pg.rank() == args.root).then_some(BufRef::Host(&c.a)),
            BufMut::Host(&mut c.b),
            d,
            args.root,
            opts,
        ),
        other => panic!("unknown op {other}"),
    };
    r.unwrap_or_else(|e| panic!("{op}: {e}"));
}

/// Element `i` of rank `r`'s input: small integers every dtype holds exactly, and for
/// products 1s and 2s, so sums and products of a few ranks stay exact too.
fn value(redop: ReduceOp, r: usize, i: usize) -> f64 {
    match redop {
        ReduceOp::Product => (1 + (r + i) % 2) as f64,
        _ => ((r * 31 + i) % 13) as f64,
    }
}

fn setup(op: &str, size: usize, n: usize, rank: usize, args: &Args) -> Case {
    let d = args.dtype;
    let elems = (size / d.size()).max(1);
    let huge = args.huge_pages;
    let shift = if rank % 2 == 1 { args.shift } else { 0 };
    let fill = |len: usize| {
        Buf::new(
            d.encode_f64s((0..len).map(|i| value(args.redop, rank, i))),
            huge,
            shift,
        )
    };
    let zeros = |len: usize| Buf::new(vec![0u8; len * d.size()], huge, shift);
    let none = || Buf::Plain(Vec::new(), 0);
    match op {
        "barrier" => Case {
            a: none(),
            b: none(),
        },
        "allreduce_4B" => Case {
            a: fill(1),
            b: none(),
        },
        "all_gather" | "gather" => Case {
            a: fill(elems),
            b: zeros(elems * n),
        },
        "reduce_scatter" | "scatter" => Case {
            a: fill(elems * n),
            b: zeros(elems),
        },
        "all_to_all" => {
            let e = elems / n * n;
            Case {
                a: fill(e),
                b: zeros(e),
            }
        }
        _ => Case {
            a: fill(elems),
            b: none(),
        },
    }
}

/// The reduction of element `i` over `n` ranks, computed in `f64` independently of the library.
fn reduced(redop: ReduceOp, d: DType, n: usize, i: usize) -> f64 {
    let vals = (0..n).map(|r| value(redop, r, i));
    match redop {
        ReduceOp::Product => vals.product(),
        ReduceOp::Min => vals.fold(f64::INFINITY, f64::min),
        ReduceOp::Max => vals.fold(f64::NEG_INFINITY, f64::max),
        ReduceOp::Avg if d.is_integer() => (vals.sum::<f64>() / n as f64).trunc(),
        ReduceOp::Avg => vals.sum::<f64>() / n as f64,
        _ => vals.sum(),
    }
}

/// Number of elements of the result that differ from an independent computation (beyond the
/// dtype's rounding).
fn wrong(op: &str, c: &Case, n: usize, rank: usize, args: &Args) -> u64 {
    let (d, redop, root) = (args.dtype, args.redop, args.root);
    let v = |r: usize, i: usize| value(redop, r, i);
    let tol = match d {
        DType::F16 => 1e-3,
        DType::BF16 => 8e-3,
        DType::F32 => 1e-6,
        _ => 0.0,
    };
    let count = |got: &[u8], want: &dyn Fn(usize) -> f64| {
        d.decode_f64s(got)
            .into_iter()
            .enumerate()
            .filter(|&(i, g)| (g - want(i)).abs() > tol * want(i).abs().max(1.0))
            .count() as u64
    };
    let size = d.size();
    match op {
        "all_reduce" | "allreduce_4B" => count(&c.a, &|i| reduced(redop, d, n, i)),
        "broadcast" => count(&c.a, &|i| v(root, i)),
        // Only the root's buffer holds the result; the others hold partial ones.
        "reduce" if rank == root => count(&c.a, &|i| reduced(redop, d, n, i)),
        "reduce" => 0,
        "all_gather" => {
            let e = c.a.len() / size;
            count(&c.b, &|i| v(i / e, i % e))
        }
        "reduce_scatter" => {
            let e = c.b.len() / size;
            count(&c.b, &|i| reduced(redop, d, n, rank * e + i))
        }
        "all_to_all" => {
            let per = (c.a.len() / size / n).max(1);
            count(&c.b, &|i| v(i / per, rank * per + i % per))
        }
        "gather" if rank == root => {
            let e = c.a.len() / size;
            count(&c.b, &|i| v(i / e, i % e))
        }
        "scatter" => {
            let e = c.b.len() / size;
            count(&c.b, &|i| v(root, rank * e + i))
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
        println!(
            "# dist-gloo benchmark: world_size {n}, {}, {}, root {}",
            args.dtype, args.redop_name, args.root
        );
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
            let mut c = setup(op, size, n, rank, &args);
            for _ in 0..args.warmup {
                run_once(&pg, op, &mut c, &args, &opts);
            }
            // Iteration count: fixed by -n, or fitted to the time budget (agreed through an
            // all_reduce so every rank runs the same number).
            let iters = if args.iters > 0 {
                args.iters
            } else {
                let t = Instant::now();
                run_once(&pg, op, &mut c, &args, &opts);
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
                if args.fresh {
                    rewrite(&mut c.a);
                }
                let t0 = Instant::now();
                run_once(&pg, op, &mut c, &args, &opts);
                *t = t0.elapsed().as_secs_f64();
            }
            if args.per_rank {
                println!("{}", own_times(rank, op, size, &times));
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
                c = setup(op, size, n, rank, &args);
                run_once(&pg, op, &mut c, &args, &opts);
                bad[0] = wrong(op, &c, n, rank, &args);
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
                // The mean of the per-iteration maxima is the throughput of back-to-back calls:
                // a root that runs ahead of its receivers (a lazy broadcast root into large
                // socket buffers) makes most iterations fast and a few long, which the median
                // does not see.
                let mean = times.iter().sum::<f64>() / times.len() as f64;
                times.sort_by(f64::total_cmp);
                let med = times[times.len() / 2];
                let tb = total_bytes(op, size, n) as f64;
                let algbw = if tb > 0.0 { tb / med / 1e9 } else { 0.0 };
                let busbw = bus_factor(op, n).map(|f| algbw * f);
                if let Some(b) = busbw {
                    bw_sum += b;
                    bw_n += 1;
                }
                let es = args.dtype.size();
                let count = match op.as_str() {
                    "barrier" => 0,
                    "allreduce_4B" => 1,
                    _ => size.max(es) / es,
                };
                println!(
                    "  {:>12} {:>12} {:>8} {:>6} {:>6} {:>10.1} {:>8.3} {:>8.3} {:>6}   {op}",
                    size,
                    count,
                    args.dtype_name,
                    if op.contains("reduce") {
                        args.redop_name.as_str()
                    } else {
                        "none"
                    },
                    if matches!(op.as_str(), "broadcast" | "reduce" | "gather" | "scatter") {
                        args.root.to_string()
                    } else {
                        "-1".into()
                    },
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
                    "{{\"op\":\"{op}\",\"bytes_per_rank\":{size},\"total_bytes\":{tb},\"iters\":{iters},\"median_us\":{},\"min_us\":{},\"mean_us\":{},\"algbw_GBps\":{},\"busbw_GBps\":{},\"wrong\":{}}}",
                    med * 1e6, times[0] * 1e6, mean * 1e6, if tb > 0.0 { algbw.to_string() } else { "null".into() },
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
    // Every rank, so a harness can check which pairs shared memory (`cargo xtask test --netns`).
    println!(
        "# single-copy messages to ranks: {:?}",
        pg.messages_by_reference_per_peer()
    );
    let rings: Vec<u64> = pg
        .shared_memory_peers()
        .into_iter()
        .map(u64::from)
        .collect();
    println!("# shared-memory rings to ranks: {rings:?}");
    if wrong_total > 0 {
        std::process::exit(1);
    }
}
