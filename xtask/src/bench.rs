//! `cargo xtask bench`: nccl-tests-style collective benchmarks, optionally side by side with
//! torch's Gloo or Open MPI run in the same invocation (every performance claim is made so).
//!
//! The rank processes are `crates/dist-gloo/examples/gloo_bench.rs`, built in release mode and
//! launched through `distrun --master-port 0` (whose store takes a port no other process
//! holds); rank 0's table is printed without distrun's `[rank 0] ` prefix, the other ranks'
//! output is dropped. With `--vs`, the peer's script from `xtask/peers/` runs right after with
//! the same ops and sizes, and a table of both and their ratio follows: torch's Gloo, or Open
//! MPI over TCP (the fair peer across hosts) or over shared memory (the fair peer on one host).
//! A line under each table lists the cells where we are behind the peer, by the median or the
//! mean.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use serde_json::Value;

use crate::placement;
use crate::util::{build_release, display, project_root, run};

pub(crate) const HELP: &str = "\
cargo xtask bench <OP>|all|latency [FLAGS]

OP: all_reduce broadcast all_gather reduce_scatter all_to_all barrier allreduce_4B
FLAGS (nccl-tests' names):
    -b <size>         smallest size in bytes per rank (K, M, G suffixes), default 4K
    -e <size>         largest size, default 64M
    -f <factor>       multiplication factor between sizes, default 16
    -n <iters>        timed iterations (default: fitted to a 1.5 s budget per size)
    -w <iters>        warm-up iterations, default 3
    -c <0|1>          check results (#wrong), default 1
    -o <op>           reduce op: sum (default), prod, min, max, avg
    -d <type>         int8 uint8 int32 uint32 int64 uint64 half bfloat16 float (default) double
    -r <root>         broadcast root, default 0 (--vs compares only -o sum -d float -r 0)
    --world-size <n[,n..]> ranks (processes on this host), default 2,4
    --backend gloo|nccl  the backend (default gloo). nccl: one rank per GPU as threads
                      of one process (crates/dist-nccl/examples/nccl_perf.rs), so
                      --world-size, -c and --vs do not apply; compare with nccl-tests'
                      `all_reduce_perf -g <GPUs> -b .. -e .. -f ..` on the same machine.
                      Says \"skipped\" where no CUDA driver and NCCL load.
    -J <file>         write our results as JSON (one file per world size: file.wsN.json)
    --vs <peer>       also run a peer with the same ops and sizes, then print both and
                      their ratio: torch (torch.distributed Gloo), mpi-tcp (Open MPI,
                      btl tcp), mpi-shm (Open MPI, btl vader: shared memory); `mpi` is
                      mpi-tcp. Install: `pip install torch --index-url
                      https://download.pytorch.org/whl/cpu` or `apt-get install
                      python3-torch`; `apt-get install openmpi-bin python3-mpi4py`.
                      DIST_PEER_PYTHON picks the interpreter (default python3).
                      Against mpi-*, our buffers from 4 MiB get transparent huge pages
                      as numpy's do (gloo_bench --huge-pages 1)
    --rounds <n>      with --vs: run ours and the peer n times, alternated, and compare
                      each side's median over the rounds, with its range (default 1).
                      This 2-core host has had windows of seconds in which everything
                      ran 4-7x slower: a single round can put one side in such a window
    --interleave      with --vs: alternate ours and the peer for each op and size (the
                      side that goes first alternating too) instead of whole runs: the
                      host's memory bandwidth drifts by 1.5x over seconds, and a cell's two
                      sides then meet the same drift. Starts two processes per cell
    --fresh           every rank writes each cache line of its input before each timed
                      call, outside its time (ours and the peer's), as a training step
                      leaves its gradients: without it the input stays clean and cached,
                      and copies by reference read it from near the reader
Before each cell (each round without --interleave) a cache line's round trip between two
threads pinned to CPU 0 and 1 is timed (`cargo xtask placement`); the table gives it per cell
and marks rounds met with the vCPUs far apart, when copies from core to core slow 3-16x
";

const OPS: [&str; 5] = [
    "all_reduce",
    "broadcast",
    "all_gather",
    "reduce_scatter",
    "all_to_all",
];
/// What `--vs` accepts (`mpi` is `mpi-tcp`).
const PEERS: [&str; 4] = ["torch", "mpi-tcp", "mpi-shm", "mpi"];
const LATENCY: [&str; 2] = ["barrier", "allreduce_4B"];

#[derive(Clone, Debug)]
struct Flags {
    ops: Vec<String>,
    sizes: Vec<u64>,
    iters: Option<String>,
    warmup: String,
    check: String,
    world_sizes: Vec<usize>,
    json: Option<String>,
    vs: Option<String>,
    redop: String,
    dtype: String,
    root: String,
    backend: String,
    rounds: usize,
    interleave: bool,
    fresh: bool,
}

const REDOPS: [&str; 5] = ["sum", "prod", "min", "max", "avg"];
const DTYPES: [&str; 10] = [
    "int8", "uint8", "int32", "uint32", "int64", "uint64", "half", "bfloat16", "float", "double",
];

fn one_of(v: String, set: &[&str], flag: &str) -> Result<String, String> {
    if set.contains(&v.as_str()) {
        Ok(v)
    } else {
        Err(format!("{flag} {v}: expected one of {}", set.join(", ")))
    }
}

fn parse_size(s: &str) -> Result<u64, String> {
    let (num, mul) = match s.chars().last() {
        Some('K' | 'k') => (&s[..s.len() - 1], 1u64 << 10),
        Some('M' | 'm') => (&s[..s.len() - 1], 1 << 20),
        Some('G' | 'g') => (&s[..s.len() - 1], 1 << 30),
        _ => (s, 1),
    };
    num.parse::<u64>()
        .map(|n| n * mul)
        .map_err(|_| format!("`{s}` is not a size"))
}

fn parse(args: &[String]) -> Result<Flags, String> {
    let Some((op, rest)) = args.split_first() else {
        return Err(format!("missing <OP>\n\n{HELP}"));
    };
    let ops: Vec<String> = match op.as_str() {
        "all" => LATENCY
            .iter()
            .chain(OPS.iter())
            .map(|s| s.to_string())
            .collect(),
        "latency" => LATENCY.iter().map(|s| s.to_string()).collect(),
        o if OPS.contains(&o) || LATENCY.contains(&o) => vec![o.to_string()],
        o => return Err(format!("unknown op `{o}`\n\n{HELP}")),
    };
    let (mut b, mut e, mut f) = (4u64 << 10, 64u64 << 20, 16u64);
    let mut fl = Flags {
        ops,
        sizes: vec![],
        iters: None,
        warmup: "3".into(),
        check: "1".into(),
        world_sizes: vec![2, 4],
        json: None,
        vs: None,
        redop: "sum".into(),
        dtype: "float".into(),
        root: "0".into(),
        backend: "gloo".into(),
        rounds: 1,
        interleave: false,
        fresh: false,
    };
    let mut it = rest.iter();
    while let Some(flag) = it.next() {
        let mut val = || {
            it.next()
                .cloned()
                .ok_or_else(|| format!("{flag} needs a value"))
        };
        match flag.as_str() {
            "-b" | "--minbytes" => b = parse_size(&val()?)?,
            "-e" | "--maxbytes" => e = parse_size(&val()?)?,
            "-f" | "--stepfactor" => {
                f = val()?
                    .parse()
                    .map_err(|_| "-f takes an integer".to_string())?
            }
            "-n" | "--iters" => fl.iters = Some(val()?),
            "-w" | "--warmup_iters" => fl.warmup = val()?,
            "-c" | "--check" => fl.check = val()?,
            "-o" | "--op" => fl.redop = one_of(val()?, &REDOPS, "-o")?,
            "-d" | "--datatype" => fl.dtype = one_of(val()?, &DTYPES, "-d")?,
            "-r" | "--root" => {
                fl.root = val()?;
                fl.root
                    .parse::<usize>()
                    .map_err(|_| format!("-r {}: not a rank", fl.root))?;
            }
            "--backend" => fl.backend = one_of(val()?, &["gloo", "nccl"], "--backend")?,
            "--world-size" => {
                fl.world_sizes = val()?
                    .split(',')
                    .map(|s| s.parse().map_err(|_| format!("bad world size `{s}`")))
                    .collect::<Result<_, _>>()?
            }
            "-J" | "--output_file" => fl.json = Some(val()?),
            "--vs" => fl.vs = Some(val()?),
            "--rounds" => {
                let v = val()?;
                fl.rounds = v
                    .parse()
                    .ok()
                    .filter(|&r| r > 0)
                    .ok_or_else(|| format!("--rounds {v}: expected a count of at least 1"))?;
            }
            "--interleave" => fl.interleave = true,
            "--fresh" => fl.fresh = true,
            other => return Err(format!("unknown flag `{other}`\n\n{HELP}")),
        }
    }
    if let Some(peer) = &fl.vs
        && !PEERS.contains(&peer.as_str())
    {
        return Err(format!("--vs {peer}: expected one of {}", PEERS.join(", ")));
    }
    if fl.vs.is_some() && (fl.redop != "sum" || fl.dtype != "float" || fl.root != "0") {
        return Err("--vs: the peers are measured with -o sum -d float -r 0 only".into());
    }
    if let Some(&n) = fl
        .world_sizes
        .iter()
        .find(|&&n| fl.root.parse::<usize>().is_ok_and(|r| r >= n))
    {
        return Err(format!("-r {}: not a rank of world size {n}", fl.root));
    }
    if f < 2 || b == 0 || b > e {
        return Err("sizes: need 0 < -b <= -e and -f >= 2".into());
    }
    let mut s = b;
    while s <= e {
        fl.sizes.push(s);
        s *= f;
    }
    Ok(fl)
}

/// The peers' benchmark scripts, kept in this repository so that a clone alone can rerun
/// every comparison.
fn peers_dir() -> PathBuf {
    project_root().join("xtask/peers")
}

fn peer_python() -> String {
    std::env::var("DIST_PEER_PYTHON").unwrap_or_else(|_| "python3".into())
}

fn sizes_arg(fl: &Flags) -> String {
    fl.sizes
        .iter()
        .map(u64::to_string)
        .collect::<Vec<_>>()
        .join(",")
}

/// Runs our ranks under `distrun` (`distrun_exe`), which picks the store's port, stops every
/// rank when one fails and exits with the first failure's code; returns the parsed JSON
/// results.
fn run_ours(
    fl: &Flags,
    n: usize,
    distrun_exe: &Path,
    exe: &Path,
    out: &Path,
) -> Result<Value, String> {
    let mut cmd = Command::new(distrun_exe);
    cmd.args([
        "--nproc-per-node",
        &n.to_string(),
        "--master-port",
        "0",
        "--",
    ])
    .arg(exe)
    .args([
        "--ops",
        &fl.ops.join(","),
        "--sizes",
        &sizes_arg(fl),
        "-w",
        &fl.warmup,
        "-c",
        &fl.check,
        "-o",
        &fl.redop,
        "-d",
        &fl.dtype,
        "-r",
        &fl.root,
        "--json",
    ])
    .arg(out);
    // numpy (Open MPI's peer script) advises huge pages for its arrays from 4 MiB; with THP in
    // `madvise` mode our `Vec`s would get 4 KiB pages, and the two sides would differ in that
    // (Open MPI's shared-memory all_gather of 64 MiB: 10 ms from numpy's arrays, 16-18 ms
    // with numpy's advice off). torch's tensors are not advised, nor are ours without a peer.
    if fl.vs.as_deref().is_some_and(|p| p.starts_with("mpi")) {
        cmd.args(["--huge-pages", "1"]);
    }
    if let Some(i) = &fl.iters {
        cmd.args(["-n", i]);
    }
    if fl.fresh {
        cmd.args(["--fresh", "1"]);
    }
    let shown = display(&cmd);
    let mut job = cmd
        .stdout(Stdio::piped())
        .spawn()
        .map_err(|e| format!("could not start `{shown}`: {e}"))?;
    // Rank 0 prints the table; distrun prefixes each line with its rank.
    if let Some(stdout) = job.stdout.take() {
        for line in BufReader::new(stdout).lines() {
            let line = line.map_err(|e| format!("reading `{shown}`'s output: {e}"))?;
            if let Some(l) = line.strip_prefix("[rank 0] ") {
                println!("{l}");
            }
        }
    }
    let st = job.wait().map_err(|e| e.to_string())?;
    if !st.success() {
        return Err(format!("`{shown}` failed with {st}"));
    }
    let text =
        std::fs::read_to_string(out).map_err(|e| format!("reading {}: {e}", out.display()))?;
    serde_json::from_str(&text).map_err(|e| format!("parsing {}: {e}", out.display()))
}

fn run_peer(fl: &Flags, n: usize, peer: &str, out: &Path) -> Result<Value, String> {
    let dir = peers_dir();
    let mut cmd = match peer {
        "torch" => {
            let mut c = Command::new(peer_python());
            c.arg(dir.join("torch_gloo.py"))
                .args(["--world-size", &n.to_string()]);
            c
        }
        "mpi" | "mpi-tcp" | "mpi-shm" => {
            let (btl, label) = if peer == "mpi-shm" {
                ("vader,self", "shm")
            } else {
                ("tcp,self", "tcp")
            };
            let mut c = Command::new("mpirun");
            c.args([
                "--allow-run-as-root",
                "--oversubscribe",
                "-np",
                &n.to_string(),
            ])
            .args(["--mca", "pml", "ob1", "--mca", "btl", btl])
            .args(["--mca", "oob_tcp_if_include", "lo"])
            .args(["--mca", "btl_tcp_if_include", "lo"])
            .arg(peer_python())
            .arg(dir.join("mpi.py"))
            .args(["--label", label]);
            c
        }
        other => {
            return Err(format!("--vs {other}: expected torch, mpi-tcp or mpi-shm"));
        }
    };
    cmd.args([
        "--sizes",
        &sizes_arg(fl),
        "--ops",
        &fl.ops.join(","),
        "--out",
    ])
    .arg(out)
    .stdout(Stdio::null());
    if fl.fresh {
        cmd.arg("--fresh");
    }
    run(&mut cmd).map_err(|e| {
        format!("{e}\n(is the peer installed? `cargo xtask bench --help` says how)")
    })?;
    let text =
        std::fs::read_to_string(out).map_err(|e| format!("reading {}: {e}", out.display()))?;
    serde_json::from_str(&text).map_err(|e| format!("parsing {}: {e}", out.display()))
}

fn find<'a>(v: &'a Value, op: &str, size: u64) -> Option<&'a Value> {
    v["results"].as_array()?.iter().find(|r| {
        r["op"] == op && (LATENCY.contains(&op) || r["bytes_per_rank"].as_u64() == Some(size))
    })
}

/// The row for `op` at `size` of the round whose time is the median over `runs` (the lower
/// middle for an even count), and the range of the rounds' times.
fn median_row<'a>(runs: &'a [Value], op: &str, size: u64) -> Option<(&'a Value, f64, f64)> {
    let mut rows: Vec<(&Value, f64)> = runs
        .iter()
        .map(|v| find(v, op, size).map(|r| (r, r["median_us"].as_f64().unwrap_or(f64::NAN))))
        .collect::<Option<_>>()?;
    rows.sort_by(|a, b| a.1.total_cmp(&b.1));
    let (lo, hi) = (rows.first()?.1, rows.last()?.1);
    Some((rows[(rows.len() - 1) / 2].0, lo, hi))
}

/// The peer's time over ours round by round, for `op` at `size`: the median of those ratios
/// (the lower middle for an even count) and their range, or `None` where a round lacks the
/// cell on either side. A round runs the two sides back to back, so a slow spell of the host,
/// which can last seconds and make every copy take three times as long, falls on both or
/// neither more often than on the two sides' median rounds, which may come from different
/// rounds (see docs/BENCHMARKS.md, "The host's slow spells").
fn paired(ours: &[Value], theirs: &[Value], op: &str, size: u64) -> Option<(f64, f64, f64)> {
    paired_where(ours, theirs, op, size, |_| true)
}

/// [`paired`] over the rounds whose row of ours `keep` accepts only (the rounds that met the
/// vCPUs near each other, say), or `None` where it accepts none.
fn paired_where(
    ours: &[Value],
    theirs: &[Value],
    op: &str,
    size: u64,
    keep: impl Fn(&Value) -> bool,
) -> Option<(f64, f64, f64)> {
    let time = |r: &Value| r["median_us"].as_f64();
    let mut ratios = Vec::new();
    for (a, b) in ours.iter().zip(theirs) {
        let (a, b) = (find(a, op, size)?, find(b, op, size)?);
        if keep(a) {
            ratios.push(time(b)? / time(a)?);
        }
    }
    ratios.sort_by(f64::total_cmp);
    Some((
        ratios[(ratios.len().checked_sub(1)?) / 2],
        *ratios.first()?,
        *ratios.last()?,
    ))
}

/// Stamps every row of a result with the placement probe's reading taken before it ran
/// (see [`crate::placement`]); a row without one (one CPU) has none.
fn stamp(result: &mut Value, probe: Option<f64>) {
    let (Some(ns), Some(rows)) = (probe, result["results"].as_array_mut()) else {
        return;
    };
    for row in rows {
        row["probe_ns"] = serde_json::json!(ns);
    }
}

/// The lowest placement reading over every row of `runs`: the near placement's time, against
/// which a cell's readings count as far ([`placement::is_far`]).
fn lowest_probe(runs: &[Value]) -> Option<f64> {
    runs.iter()
        .filter_map(|v| v["results"].as_array())
        .flatten()
        .filter_map(|r| r["probe_ns"].as_f64())
        .min_by(f64::total_cmp)
}

/// A cell's placement across rounds: the readings' range, how many of its rounds met far
/// placement, and the paired ratio over the other rounds. `None` where no round was probed.
fn placement_of(
    ours: &[Value],
    theirs: &[Value],
    op: &str,
    size: u64,
    lowest: f64,
) -> Option<Placement> {
    let readings: Vec<f64> = ours
        .iter()
        .filter_map(|v| find(v, op, size)?["probe_ns"].as_f64())
        .collect();
    let lo = readings.iter().copied().min_by(f64::total_cmp)?;
    let hi = readings.iter().copied().max_by(f64::total_cmp)?;
    let far = readings
        .iter()
        .filter(|&&ns| placement::is_far(ns, lowest))
        .count();
    let near_paired = paired_where(ours, theirs, op, size, |row| {
        row["probe_ns"]
            .as_f64()
            .is_some_and(|ns| !placement::is_far(ns, lowest))
    })
    .map(|(m, ..)| m);
    Some(Placement {
        lo,
        hi,
        far,
        rounds: readings.len(),
        near_paired,
    })
}

/// What [`placement_of`] found for one cell.
#[derive(Debug, PartialEq)]
struct Placement {
    lo: f64,
    hi: f64,
    far: usize,
    rounds: usize,
    near_paired: Option<f64>,
}

impl Placement {
    /// The table's column: the readings' range and the rounds met far apart, if any.
    fn column(&self) -> String {
        let range = format!("{:.0}-{:.0}", self.lo, self.hi);
        if self.far == 0 {
            format!("{range:>9}")
        } else {
            format!("{range:>9} far {}/{}", self.far, self.rounds)
        }
    }

    /// What a cell behind the peer adds to its entry in the list: how many rounds met far
    /// placement and the paired ratio over the rest, which says whether the cell is behind
    /// with the vCPUs near each other.
    fn caveat(&self) -> String {
        if self.far == 0 {
            return String::new();
        }
        let near = self.near_paired.map_or("no round near".to_string(), |r| {
            format!("paired over the near rounds {r:.2}x")
        });
        format!(
            " [far placement in {} of {} rounds; {near}]",
            self.far, self.rounds
        )
    }
}

/// The mean columns of a row: each side's mean of the per-iteration maxima and their ratio
/// (the peer's time over ours, so that above 1 is ahead, as the median's ratio), or dashes
/// where a side reported none.
fn means(ours: &Value, theirs: &Value) -> String {
    let (a, b) = (ours["mean_us"].as_f64(), theirs["mean_us"].as_f64());
    match (a, b, mean_ratio(ours, theirs)) {
        (Some(a), Some(b), Some(r)) => format!("{a:>9.1} {b:>9.1} {r:>5.2}x"),
        _ => {
            let us = |t: Option<f64>| t.map_or("-".to_string(), |t| format!("{t:.1}"));
            format!("{:>9} {:>9} {:>6}", us(a), us(b), "-")
        }
    }
}

/// The peer's mean over ours (above 1 is ahead), where both sides reported a mean.
fn mean_ratio(ours: &Value, theirs: &Value) -> Option<f64> {
    match (ours["mean_us"].as_f64(), theirs["mean_us"].as_f64()) {
        (Some(a), Some(b)) if a > 0.0 => Some(b / a),
        _ => None,
    }
}

/// A cell for the list under a table of the cells where we are behind the peer, by the median's
/// ratio or the mean's: `op size ratio` (and the mean's ratio where there is one), or `None`
/// where we are not behind by either. In a table of 70 rows, the few that fall short are what a
/// reader looks for; a ratio that is not a number (a side without the op) is not behind.
fn behind(op: &str, size: u64, ratio: f64, mean: Option<f64>) -> Option<String> {
    if !(ratio < 1.0 || mean.is_some_and(|m| m < 1.0)) {
        return None;
    }
    Some(match mean {
        Some(m) => format!("{op} {size} {ratio:.2}x (mean {m:.2}x)"),
        None => format!("{op} {size} {ratio:.2}x"),
    })
}

fn compare(fl: &Flags, n: usize, peer: &str, ours: &[Value], theirs: &[Value]) {
    let rounds = ours.len().min(theirs.len());
    let how = if rounds > 1 {
        let unit = if fl.interleave {
            "rounds alternated per op and size"
        } else {
            "alternated rounds"
        };
        format!(
            "{rounds} {unit}, each side's median round; range: its rounds' times; paired: the \
             median and range over rounds of the peer's time over ours in the same round, run \
             back to back"
        )
    } else {
        "same invocation".to_string()
    };
    let inputs = if fl.fresh {
        "; inputs rewritten before each call (--fresh)"
    } else {
        ""
    };
    println!(
        "\n# world_size {n}: dist-gloo vs {peer} ({how}{inputs}; busbw in GB/s, time = median of per-iteration max over ranks; mean: their mean, the throughput of back-to-back calls and the time nccl-tests and the OSU benchmarks report, which the median hides where a rank runs ahead and waits in a few long iterations)"
    );
    let lowest = lowest_probe(ours);
    if let Some(ns) = lowest {
        println!(
            "# probe ns: a cache line's round trip between CPU 0 and 1 before each cell (before \
             each round's run of ours without --interleave), its range over rounds; far: over \
             {}x the lower of this invocation's lowest, {ns:.0} ns, and {} ns, the host having \
             put the vCPUs far apart, which slows copies from core to core 3-16x",
            placement::FAR_FACTOR,
            placement::NEAR_NS
        );
    }
    println!(
        "# {:>15} {:>10} | {:>10} {:>8} | {:>10} {:>8} | {:>8} | {:>9} {:>9} {:>6}{}{}",
        "op",
        "bytes",
        "ours us",
        "busbw",
        "peer us",
        "busbw",
        "ratio",
        "ours mean",
        "peer mean",
        "ratio",
        if rounds > 1 {
            " | ours range us | peer range us | paired"
        } else {
            ""
        },
        if lowest.is_some() { " | probe ns" } else { "" }
    );
    let mut behind_cells = Vec::new();
    for op in &fl.ops {
        let sizes: Vec<u64> = if LATENCY.contains(&op.as_str()) {
            vec![0]
        } else {
            fl.sizes.clone()
        };
        for s in sizes {
            let (Some((a, a_lo, a_hi)), Some((b, b_lo, b_hi))) =
                (median_row(ours, op, s), median_row(theirs, op, s))
            else {
                println!(
                    "  {op:>15} {s:>10} | (missing on one side{})",
                    theirs
                        .iter()
                        .find_map(|t| find(t, op, s))
                        .map_or(String::new(), |r| format!(": {}", r["note"]))
                );
                continue;
            };
            let (ta, tb) = (
                a["median_us"].as_f64().unwrap_or(f64::NAN),
                b["median_us"].as_f64().unwrap_or(f64::NAN),
            );
            let (ba, bb) = (a["busbw_GBps"].as_f64(), b["busbw_GBps"].as_f64());
            // Bandwidth ops compare bus bandwidth (higher is better); latency ops compare time.
            let ratio = match (ba, bb) {
                (Some(x), Some(y)) if y > 0.0 => x / y,
                _ => tb / ta,
            };
            let bw = |b: Option<f64>| b.map_or("-".to_string(), |b| format!("{b:.3}"));
            let ranges = if rounds > 1 {
                let pair = paired(ours, theirs, op, s).map_or("-".to_string(), |(m, lo, hi)| {
                    format!("{m:.2}x ({lo:.2}-{hi:.2})")
                });
                format!(" | {a_lo:>6.1}-{a_hi:<7.1} | {b_lo:>6.1}-{b_hi:<7.1} | {pair}")
            } else {
                String::new()
            };
            let place = lowest.and_then(|l| placement_of(ours, theirs, op, s, l));
            println!(
                "  {op:>15} {s:>10} | {ta:>10.1} {:>8} | {tb:>10.1} {:>8} | {ratio:>7.2}x | {}{ranges}{}",
                bw(ba),
                bw(bb),
                means(a, b),
                place
                    .as_ref()
                    .map_or(String::new(), |p| format!(" | {}", p.column()))
            );
            behind_cells.extend(
                behind(op, s, ratio, mean_ratio(a, b))
                    .map(|c| c + &place.as_ref().map_or(String::new(), Placement::caveat)),
            );
        }
    }
    println!(
        "# behind {peer} (under 1.00x by the median or the mean): {}",
        if behind_cells.is_empty() {
            "none".to_string()
        } else {
            behind_cells.join(", ")
        }
    );
}

pub(crate) fn run_bench(args: &[String]) -> Result<(), String> {
    let fl = parse(args)?;
    if fl.backend == "nccl" {
        return run_nccl(&fl);
    }
    build_release(&["dist-run", "dist-gloo"], &["gloo_bench"])?;
    let distrun = project_root().join("target/release/distrun");
    let exe = project_root().join("target/release/examples/gloo_bench");
    let tmp = std::env::temp_dir();
    for &n in &fl.world_sizes {
        let (mut ours, mut theirs) = (Vec::new(), Vec::new());
        if let (true, Some(peer)) = (fl.interleave, &fl.vs) {
            for round in 0..fl.rounds {
                let (o, t) = interleaved_round(&fl, n, peer, round, &distrun, &exe)?;
                ours.push(o);
                theirs.push(t);
            }
            compare(&fl, n, peer, &ours, &theirs);
            continue;
        }
        for round in 0..fl.rounds {
            // One file per round when there are several, so none overwrites another.
            let tag = if fl.rounds > 1 {
                format!(".r{round}")
            } else {
                String::new()
            };
            let ours_path = match &fl.json {
                Some(j) => PathBuf::from(format!("{j}.ws{n}{tag}.json")),
                None => tmp.join(format!(
                    "dist-bench-ours-{}-ws{n}{tag}.json",
                    std::process::id()
                )),
            };
            let probe = placement::round_trip_ns();
            let mut o = run_ours(&fl, n, &distrun, &exe, &ours_path)?;
            stamp(&mut o, probe);
            ours.push(o);
            if let Some(peer) = &fl.vs {
                theirs.push(run_peer(
                    &fl,
                    n,
                    peer,
                    &tmp.join(format!(
                        "dist-bench-{peer}-{}-ws{n}{tag}.json",
                        std::process::id()
                    )),
                )?);
            }
        }
        if let Some(peer) = &fl.vs {
            compare(&fl, n, peer, &ours, &theirs);
        }
    }
    Ok(())
}

/// One round of `--interleave`: each op and size run alone, ours and the peer back to back
/// (the peer first in odd rounds), the cells' rows gathered into one result per side.
fn interleaved_round(
    fl: &Flags,
    n: usize,
    peer: &str,
    round: usize,
    distrun: &Path,
    exe: &Path,
) -> Result<(Value, Value), String> {
    let tmp = std::env::temp_dir();
    let (mut ours, mut theirs) = (Vec::new(), Vec::new());
    // Each cell's file is read once and removed: an interleaved run writes hundreds.
    let rows = |v: Result<Value, String>, at: &Path| {
        let _ = std::fs::remove_file(at);
        v.map(|v| v["results"].as_array().cloned().unwrap_or_default())
    };
    for op in &fl.ops {
        // A latency op takes no size: one cell.
        let sizes = if LATENCY.contains(&op.as_str()) {
            fl.sizes[..1].to_vec()
        } else {
            fl.sizes.clone()
        };
        for s in sizes {
            let cell = Flags {
                ops: vec![op.clone()],
                sizes: vec![s],
                json: None,
                ..fl.clone()
            };
            let path = |side: &str| {
                tmp.join(format!(
                    "dist-bench-{side}-{}-ws{n}.r{round}.{op}.{s}.json",
                    std::process::id()
                ))
            };
            let (ours_at, theirs_at) = (path("ours"), path(peer));
            let probe = placement::round_trip_ns();
            let stamped = |mut v: Value| {
                stamp(&mut v, probe);
                v
            };
            let run_o = || {
                rows(
                    run_ours(&cell, n, distrun, exe, &ours_at).map(stamped),
                    &ours_at,
                )
            };
            let run_t = || {
                rows(
                    run_peer(&cell, n, peer, &theirs_at).map(stamped),
                    &theirs_at,
                )
            };
            if round.is_multiple_of(2) {
                ours.extend(run_o()?);
                theirs.extend(run_t()?);
            } else {
                theirs.extend(run_t()?);
                ours.extend(run_o()?);
            }
        }
    }
    Ok((
        serde_json::json!({ "results": ours }),
        serde_json::json!({ "results": theirs }),
    ))
}

/// `--backend nccl`: nccl_perf once per op, its table printed as it comes.
fn run_nccl(fl: &Flags) -> Result<(), String> {
    if fl.vs.is_some() {
        return Err("--vs compares CPU backends; for nccl run nccl-tests on the same GPUs".into());
    }
    build_release(&["dist-nccl"], &["nccl_perf"])?;
    let exe = project_root().join("target/release/examples/nccl_perf");
    let (first, last) = match (fl.sizes.first(), fl.sizes.last()) {
        (Some(&a), Some(&b)) => (a, b),
        _ => return Err("no sizes".into()),
    };
    let factor = fl.sizes.get(1).map_or(2, |&s| s / first);
    for op in &fl.ops {
        if LATENCY.contains(&op.as_str()) {
            println!("# {op}: not measured for nccl (use all_reduce -b 4 -e 4)");
            continue;
        }
        let mut cmd = Command::new(&exe);
        cmd.arg(op)
            .args(["-b", &first.to_string(), "-e", &last.to_string()])
            .args(["-f", &factor.to_string(), "-w", &fl.warmup])
            .args(["-o", &fl.redop, "-d", &fl.dtype]);
        if let Some(n) = &fl.iters {
            cmd.args(["-n", n]);
        }
        run(&mut cmd).map_err(|e| format!("nccl_perf {op}: {e}"))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(s: &str) -> Vec<String> {
        s.split_whitespace().map(String::from).collect()
    }

    #[test]
    fn the_mean_columns_give_the_peers_time_over_ours_and_dashes_for_a_side_without_one() {
        let ours = serde_json::json!({"mean_us": 50.0});
        let peer = serde_json::json!({"mean_us": 75.0});
        let cols = means(&ours, &peer);
        assert_eq!(
            cols.split_whitespace().collect::<Vec<_>>(),
            ["50.0", "75.0", "1.50x"]
        );
        let old_peer = serde_json::json!({"median_us": 75.0});
        assert_eq!(
            means(&ours, &old_peer)
                .split_whitespace()
                .collect::<Vec<_>>(),
            ["50.0", "-", "-"]
        );
    }

    #[test]
    fn the_cells_behind_the_peer_by_median_or_mean_are_listed_and_no_others() {
        assert_eq!(behind("broadcast", 4, 1.20, Some(1.10)), None);
        assert_eq!(
            behind("broadcast", 1024, 0.63, Some(0.75)).as_deref(),
            Some("broadcast 1024 0.63x (mean 0.75x)")
        );
        // Ahead by the median but behind by the mean, or behind with no mean to say.
        assert_eq!(
            behind("all_to_all", 67108864, 1.03, Some(0.99)).as_deref(),
            Some("all_to_all 67108864 1.03x (mean 0.99x)")
        );
        assert_eq!(
            behind("barrier", 0, 0.69, None).as_deref(),
            Some("barrier 0 0.69x")
        );
        // A side without the op (torch has no reduce_scatter) is not behind.
        assert_eq!(behind("reduce_scatter", 4, f64::NAN, None), None);
        let (ours, peer) = (
            serde_json::json!({"mean_us": 50.0}),
            serde_json::json!({"mean_us": 40.0}),
        );
        assert_eq!(mean_ratio(&ours, &peer), Some(0.8));
        assert_eq!(mean_ratio(&ours, &serde_json::json!({})), None);
    }

    #[test]
    fn rounds_compare_the_median_round_and_report_the_range() {
        let run = |us: f64| {
            serde_json::json!({"results": [
                {"op": "all_reduce", "bytes_per_rank": 4096, "median_us": us, "busbw_GBps": 1.0 / us}
            ]})
        };
        let runs = [run(30.0), run(10.0), run(500.0)];
        let (row, lo, hi) = median_row(&runs, "all_reduce", 4096).unwrap();
        assert_eq!(
            (row["median_us"].as_f64(), lo, hi),
            (Some(30.0), 10.0, 500.0)
        );
        // An even count takes the lower middle; a size missing from a round is missing.
        let (row, ..) = median_row(&runs[..2], "all_reduce", 4096).unwrap();
        assert_eq!(row["median_us"].as_f64(), Some(10.0));
        assert!(median_row(&runs, "all_reduce", 8192).is_none());
    }

    #[test]
    fn paired_ratios_divide_each_rounds_times_and_take_their_median() {
        let run = |us: f64| {
            serde_json::json!({"results": [
                {"op": "all_reduce", "bytes_per_rank": 4096, "median_us": us}
            ]})
        };
        // Round 3 is a slow spell for both sides: by the sides' median rounds the peer leads
        // (30 against 40), round by round we do.
        let ours = [run(20.0), run(40.0), run(90.0)];
        let theirs = [run(30.0), run(20.0), run(100.0)];
        let (m, lo, hi) = paired(&ours, &theirs, "all_reduce", 4096).unwrap();
        assert_eq!((m, lo, hi), (100.0 / 90.0, 0.5, 1.5));
        assert!(paired(&ours, &theirs, "all_reduce", 8192).is_none());
        assert!(paired(&[], &[], "all_reduce", 4096).is_none());
    }

    #[test]
    fn a_cell_met_far_apart_in_some_rounds_says_so_and_pairs_the_near_rounds_alone() {
        let run = |us: f64, probe: Option<f64>| {
            let mut v = serde_json::json!({"results": [
                {"op": "all_reduce", "bytes_per_rank": 4096, "median_us": us},
                {"op": "broadcast", "bytes_per_rank": 4096, "median_us": us}
            ]});
            stamp(&mut v, probe);
            v
        };
        // Round 2 met the vCPUs far apart (331 ns against 55): ours took 4x as long there.
        let ours = [
            run(10.0, Some(60.0)),
            run(40.0, Some(331.0)),
            run(10.0, Some(55.0)),
        ];
        let theirs = [run(12.0, None), run(14.0, None), run(11.0, None)];
        let lowest = lowest_probe(&ours).unwrap();
        assert_eq!(lowest, 55.0);
        let p = placement_of(&ours, &theirs, "all_reduce", 4096, lowest).unwrap();
        assert_eq!((p.lo, p.hi, p.far, p.rounds), (55.0, 331.0, 1, 3));
        // Over all three rounds the median ratio is 1.1x; over the near two, 1.1x and 1.2x.
        assert_eq!(p.near_paired, Some(1.1));
        assert_eq!(p.column().trim(), "55-331 far 1/3");
        assert_eq!(
            p.caveat(),
            " [far placement in 1 of 3 rounds; paired over the near rounds 1.10x]"
        );
        // All near: no caveat; never probed (one CPU): no placement at all.
        let near = [run(10.0, Some(60.0)), run(10.0, Some(55.0))];
        let p = placement_of(&near, &theirs[..2], "all_reduce", 4096, 55.0).unwrap();
        assert_eq!((p.far, p.caveat()), (0, String::new()));
        let unprobed = [run(10.0, None)];
        assert_eq!(lowest_probe(&unprobed), None);
        assert_eq!(
            placement_of(&unprobed, &theirs[..1], "all_reduce", 4096, 55.0),
            None
        );
    }

    #[test]
    fn nccl_tests_type_op_and_root_flags_parse_and_bad_ones_are_named() {
        let fl = parse(&args("all_reduce -d bfloat16 -o avg -r 1 -b 1K -e 4K -f 2")).unwrap();
        assert_eq!((fl.dtype.as_str(), fl.redop.as_str()), ("bfloat16", "avg"));
        assert_eq!(
            (fl.root.as_str(), fl.sizes.clone()),
            ("1", vec![1024, 2048, 4096])
        );
        let e = parse(&args("all_reduce -d float16")).unwrap_err();
        assert!(e.starts_with("-d float16: expected one of"), "{e}");
        let e = parse(&args("all_reduce -o mean")).unwrap_err();
        assert!(e.starts_with("-o mean: expected one of"), "{e}");
        let e = parse(&args("broadcast -r 2 --world-size 2,4")).unwrap_err();
        assert_eq!(e, "-r 2: not a rank of world size 2");
        let e = parse(&args("all_reduce -d half --vs mpi")).unwrap_err();
        assert!(e.contains("-o sum -d float -r 0 only"), "{e}");
        let e = parse(&args("all_reduce --vs nccl")).unwrap_err();
        assert!(e.starts_with("--vs nccl: expected one of torch"), "{e}");
        assert!(parse(&args("all_reduce --vs mpi-shm")).is_ok());
        assert_eq!(parse(&args("all_reduce --rounds 3")).unwrap().rounds, 3);
        assert!(
            parse(&args("all_reduce --vs mpi --interleave"))
                .unwrap()
                .interleave
        );
        assert!(
            parse(&args("all_reduce --vs mpi-shm --fresh"))
                .unwrap()
                .fresh
        );
        assert!(!parse(&args("all_reduce --vs mpi-shm")).unwrap().fresh);
        let e = parse(&args("all_reduce --rounds 0")).unwrap_err();
        assert_eq!(e, "--rounds 0: expected a count of at least 1");
    }
}
