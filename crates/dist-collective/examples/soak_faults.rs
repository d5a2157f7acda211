//! The rank program of `cargo xtask soak`'s fault scenarios: every rank runs a loop of
//! collectives (a 256 KiB `all_reduce`, then a `broadcast` from a rotating root, results
//! checked) until an operation fails, and reports that failure in files the harness reads.
//!
//! ```sh
//! SOAK_DIR=/tmp/s distrun --nproc-per-node 4 --grace-period 60 -- \
//!     target/release/examples/soak_faults kill|stall|mismatch|store-garbage
//! ```
//!
//! * `$SOAK_DIR/rank<r>.pid`: this process's pid, written once init is done and the first
//!   iteration of the loop completed (every rank is then inside the loop).
//! * `$SOAK_DIR/rank<r>.result`: written on the first error, before exiting with code 1: the
//!   wall-clock time of the error in µs since the UNIX epoch, a space, then the error's
//!   `Display` text (which may span several lines).
//! * `$SOAK_DIR/rank<r>.fault` (`mismatch` only): the wall-clock time (µs) just before this
//!   rank called the mismatched (or, on ranks 2.., the matching) collective.
//! * `$SOAK_DIR/store.addr` (rank 0, `store-garbage` only): `MASTER_ADDR:MASTER_PORT`, so the
//!   harness can send garbage to the rendezvous store.
//!
//! Environment: `SOAK_TIMEOUT_MS` (the group's timeout; default the library's, five minutes),
//! `SOAK_SECONDS` (how long the loop runs before the program exits 0: 4 s for
//! `store-garbage`, else 120 s), `SOAK_MISMATCH_AT` (the iteration of the mismatch, default 5),
//! `SOAK_MISMATCH_KIND` (`count`: ranks 0 and 1 all-reduce a different element count, each
//! its own; `op`: ranks 0 and 1 broadcast where the others all-reduce; `root`: every rank
//! broadcasts, ranks 0 and 1 from root 1, the others from root 0).
//!
//! The program ignores SIGTERM: `distrun` sends it to the surviving ranks as soon as one rank
//! fails, and the survivors must live long enough to report their own error.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use dist_collective::{InitOptions, ProcessGroup, ReduceOp, init_process_group};

/// Elements of the 256 KiB `f32` buffer.
const COUNT: usize = 256 * 1024 / 4;

fn now_us() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_micros())
        .unwrap_or(0)
}

fn env_u64(name: &str) -> Option<u64> {
    std::env::var(name).ok().and_then(|v| v.trim().parse().ok())
}

/// Writes `text` to `path` through a temporary file, so the harness never reads half of it.
fn write_atomic(path: &Path, text: &str) {
    let tmp = path.with_extension("tmp");
    if let Err(e) = std::fs::write(&tmp, text).and_then(|()| std::fs::rename(&tmp, path)) {
        eprintln!("soak_faults: writing {}: {e}", path.display());
    }
}

/// What the program was asked to do.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Scenario {
    Kill,
    Stall,
    Mismatch,
    StoreGarbage,
}

/// Reports `err` (time and text) and exits with code 1.
fn fail(dir: &Path, rank: usize, err: &dyn std::fmt::Display) -> ! {
    let t = now_us();
    write_atomic(
        &dir.join(format!("rank{rank}.result")),
        &format!("{t} {err}\n"),
    );
    eprintln!("soak_faults: rank {rank}: {err}");
    std::process::exit(1);
}

/// Fills `buf` with `v`.
fn fill(buf: &mut [f32], v: f32) {
    buf.iter_mut().for_each(|x| *x = v);
}

/// One loop iteration: an all_reduce of every rank's `rank + 1` and a broadcast from `root`,
/// both checked at both ends of the buffer.
fn iteration(pg: &ProcessGroup, buf: &mut [f32], root: usize) -> Result<(), String> {
    let (rank, n) = (pg.rank(), pg.world_size());
    fill(buf, (rank + 1) as f32);
    pg.all_reduce(buf, ReduceOp::Sum)
        .map_err(|e| e.to_string())?;
    let want = (n * (n + 1) / 2) as f32;
    if buf[0] != want || buf[buf.len() - 1] != want {
        return Err(format!(
            "wrong all_reduce result: {} and {} where {want} was expected",
            buf[0],
            buf[buf.len() - 1]
        ));
    }
    fill(buf, if rank == root { root as f32 } else { -1.0 });
    pg.broadcast(buf, root).map_err(|e| e.to_string())?;
    if buf[0] != root as f32 || buf[buf.len() - 1] != root as f32 {
        return Err(format!(
            "wrong broadcast result from root {root}: {} and {}",
            buf[0],
            buf[buf.len() - 1]
        ));
    }
    Ok(())
}

/// The `mismatch` scenario's collective: ranks 0 and 1 call something the others do not.
fn mismatched(pg: &ProcessGroup, buf: &mut [f32], kind: &str) -> Result<(), String> {
    let rank = pg.rank();
    let r = match (rank, kind) {
        (0 | 1, "op") => pg.broadcast(buf, 0),
        (_, "root") => pg.broadcast(buf, usize::from(rank < 2)),
        (0 | 1, _) => {
            // Each of ranks 0 and 1 its own count, different from everyone's.
            let mut other = vec![1.0f32; COUNT + 1 + rank];
            pg.all_reduce(&mut other, ReduceOp::Sum)
        }
        _ => pg.all_reduce(buf, ReduceOp::Sum),
    };
    r.map_err(|e| e.to_string())?;
    eprintln!("soak_faults: rank {rank}: the mismatched collective ({kind}) returned Ok");
    Ok(())
}

fn main() -> ExitCode {
    // SAFETY: setting SIGTERM's disposition to SIG_IGN installs no handler code, so there is
    // nothing async-signal-safety could be violated by; it happens before any thread starts.
    unsafe {
        libc::signal(libc::SIGTERM, libc::SIG_IGN);
    }
    let scenario = match std::env::args().nth(1).as_deref() {
        Some("kill") => Scenario::Kill,
        Some("stall") => Scenario::Stall,
        Some("mismatch") => Scenario::Mismatch,
        Some("store-garbage") => Scenario::StoreGarbage,
        other => {
            eprintln!(
                "soak_faults: scenario {other:?}: expected kill, stall, mismatch or store-garbage"
            );
            return ExitCode::from(2);
        }
    };
    let Some(dir) = std::env::var_os("SOAK_DIR").map(PathBuf::from) else {
        eprintln!("soak_faults: SOAK_DIR is not set");
        return ExitCode::from(2);
    };
    let env_rank = env_u64("RANK").unwrap_or(0) as usize;

    let mut opts = InitOptions::new();
    if let Some(ms) = env_u64("SOAK_TIMEOUT_MS") {
        opts = opts.timeout(Duration::from_millis(ms));
    }
    let pg = match init_process_group(opts) {
        Ok(pg) => pg,
        Err(e) => fail(&dir, env_rank, &format!("init_process_group: {e}")),
    };
    let (rank, n) = (pg.rank(), pg.world_size());
    let seconds = env_u64("SOAK_SECONDS").unwrap_or(match scenario {
        Scenario::StoreGarbage => 4,
        _ => 120,
    });
    let mismatch_at = env_u64("SOAK_MISMATCH_AT").unwrap_or(5);
    let kind = std::env::var("SOAK_MISMATCH_KIND").unwrap_or_else(|_| "count".to_owned());

    let mut buf = vec![0.0f32; COUNT];
    let start = Instant::now();
    let mut i: u64 = 0;
    loop {
        // Every rank must leave the loop after the same iteration: every 16th, they agree
        // (a max-reduced flag) on whether any rank's time is up.
        if i % 16 == 15 {
            let mut stop = [u8::from(start.elapsed() >= Duration::from_secs(seconds))];
            if let Err(e) = pg.all_reduce(&mut stop, ReduceOp::Max) {
                fail(&dir, rank, &e);
            }
            if stop[0] == 1 {
                break;
            }
        }
        if scenario == Scenario::Mismatch && i == mismatch_at {
            write_atomic(
                &dir.join(format!("rank{rank}.fault")),
                &format!("{}\n", now_us()),
            );
            if let Err(e) = mismatched(&pg, &mut buf, &kind) {
                fail(&dir, rank, &e);
            }
        }
        if let Err(e) = iteration(&pg, &mut buf, (i % n as u64) as usize) {
            fail(&dir, rank, &e);
        }
        // The store must keep serving while (and after) garbage arrives: a monitored barrier
        // goes through it.
        if scenario == Scenario::StoreGarbage
            && i % 16 == 15
            && let Err(e) = pg.monitored_barrier(Duration::from_secs(60), true)
        {
            fail(&dir, rank, &e);
        }
        if i == 0 {
            if rank == 0 && scenario == Scenario::StoreGarbage {
                let addr = std::env::var("MASTER_ADDR").unwrap_or_default();
                let port = std::env::var("MASTER_PORT").unwrap_or_default();
                write_atomic(&dir.join("store.addr"), &format!("{addr}:{port}\n"));
            }
            write_atomic(
                &dir.join(format!("rank{rank}.pid")),
                &format!("{}\n", std::process::id()),
            );
        }
        i += 1;
    }
    if let Err(e) = pg.barrier() {
        fail(&dir, rank, &e);
    }
    if scenario != Scenario::StoreGarbage {
        eprintln!("soak_faults: rank {rank}: no error after {i} iterations ({seconds} s)");
    }
    dist_collective::destroy_process_group();
    ExitCode::SUCCESS
}
