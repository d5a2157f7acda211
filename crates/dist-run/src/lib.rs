//! `distrun`: start the ranks of a `dist` job, the way `torchrun` starts a PyTorch job.
//!
//! ```sh
//! distrun --nproc-per-node 4 -- ./target/release/train --epochs 3
//! distrun --nnodes 2 --node-rank 0 --master-addr 10.0.0.1 --master-port 29500 \
//!         --nproc-per-node 8 -- ./train          # and --node-rank 1 on the other host
//! distrun --nproc-per-node 2 -- sh -c 'echo $RANK'   # any program works
//! ```
//!
//! * Every child gets torchrun's environment ([`Job::child_env`]): `RANK`, `LOCAL_RANK`,
//!   `WORLD_SIZE`, `LOCAL_WORLD_SIZE`, `GROUP_RANK`, `ROLE_RANK`, `ROLE_WORLD_SIZE`,
//!   `MASTER_ADDR`, `MASTER_PORT`, `TORCHELASTIC_RESTART_COUNT` (also as `DIST_RESTART_COUNT`),
//!   `TORCHELASTIC_MAX_RESTARTS`, `TORCHELASTIC_USE_AGENT_STORE=True`, and `OMP_NUM_THREADS=1`
//!   unless it is set.
//! * On node 0, `distrun` itself serves the rendezvous store (a
//!   [`TcpStoreServer`], speaking PyTorch's TCPStore
//!   protocol) for the whole job, so every rank, rank 0 included, connects to it as a client
//!   (`dist_backend::init` honours `TORCHELASTIC_USE_AGENT_STORE`, as torch does, and puts the
//!   keys of restart `n` under `/worker/attempt_<n>`). `--master-port 0`, the default on one node,
//!   lets the server pick a free port, so two jobs on one machine never collide. With several
//!   nodes, node 0 may be given `--master-port 0` too: it prints the port it picked
//!   (`distrun: ... store at ADDR:PORT` on stderr), and the other nodes must be given that port.
//! * Each line a child prints, on stdout or stderr, is printed on the same stream of `distrun`
//!   prefixed with `[rank R] `; so is each redraw of a progress bar (text ending in `\r`), as
//!   it is drawn, and output without either line end in pieces of 64 KiB. With `--tee` (or
//!   `--log-dir`) it is also written, unprefixed, to
//!   `<log-dir>/attempt_<n>/rank_<r>/{stdout,stderr}.log`.
//! * When a rank fails (non-zero exit or a signal), the others are stopped (SIGTERM to each
//!   child's process group, SIGKILL after `--grace-period`) and a summary names the rank that
//!   failed first (the one whose error came first by the ranks' error files, often not the
//!   first to exit: see `root_cause.rs`), its exit code or signal, the error it wrote to its
//!   `TORCHELASTIC_ERROR_FILE` (torch's `@record` file, which `dist` writes for a panic, see
//!   `dist_backend::error_file`), and the last lines it printed. Each rank gets its own file,
//!   beside its logs with `--log-dir`, else in a directory of the run's own that goes with it;
//!   a `distrun` started with `TORCHELASTIC_ERROR_FILE` set writes the root cause there, with
//!   the exit code, as torchrun's agent does. `--max-restarts K` restarts the whole job up to
//!   `K` times. The exit code is 0 when every rank succeeds, else that of the rank that failed
//!   first (`128 + signal` for a signal), or, where another rank was the first to exit, of
//!   that rank.
//! * With `--nnodes M > 1`, the `distrun` of each node joins the others through the store on
//!   node 0 before every attempt; a failure on one node stops the ranks of every node, and the
//!   restart decision is the same everywhere.
//! * SIGINT, SIGTERM and SIGHUP sent to `distrun` are forwarded to the ranks (SIGKILL after the
//!   grace period); `distrun` then exits with `128 + signal`, without restarting, and so it
//!   does when one comes while it waits for the other nodes: to end an attempt (it reports
//!   the attempt failed first, so that their ranks stop) or to start one (it takes its
//!   arrival back, so that the same node started again arrives once). A signal
//!   `distrun` was started ignoring stays ignored, for the ranks too: `nohup distrun ... &`
//!   outlives the logout.
//! * Each local rank is bound to its own share of the CPUs where they are at least as many as
//!   the ranks: whole physical cores of one socket where the ranks are no more than the cores
//!   (`DIST_RUN_BIND=none` leaves them unbound).
//!
//! This is its own crate, not a binary of the `dist` facade, because a launcher has its own
//! dependencies (`clap`, `libc`) that a library user of `dist` should not have to compile. It
//! depends only on `dist-backend` (for the store server); it neither knows nor loads any
//! backend.

// `unsafe` is allowed only at the few libc calls that have no safe wrapper.
#![deny(unsafe_code)]
mod agents;
mod bind;
mod cli;
mod env;
mod error_files;
#[allow(
    unsafe_code,
    reason = "waitid with WNOWAIT, which std does not offer; each call has a SAFETY comment"
)]
mod exits;
#[allow(
    unsafe_code,
    reason = "pre_exec for PR_SET_PDEATHSIG and the CPU binding, with SAFETY comments"
)]
mod group;
mod root_cause;
#[allow(
    unsafe_code,
    reason = "signal and kill, which libc alone offers; each call has a SAFETY comment"
)]
mod signals;

pub use cli::Args;
pub use env::Job;

use std::path::PathBuf;
use std::time::Duration;

use dist_backend::store::TcpStoreServer;

use crate::agents::Agents;
use crate::group::{Attempt, Outcome};

/// torchrun's default master port when several nodes must agree on one.
pub const DEFAULT_MULTI_NODE_PORT: u16 = 29500;

/// Runs the job described by `args` to its end and returns the exit code `distrun` should
/// exit with. Errors of `distrun` itself (bad arguments, a port in use, an unreachable node 0)
/// are printed and give 1, or `128 + signal` where a signal ended the wait that failed.
///
/// Call it from the main thread: children are spawned with `PR_SET_PDEATHSIG` on Linux, which
/// fires when the spawning thread exits.
pub fn run(args: &Args) -> i32 {
    match run_job(args) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("distrun: error: {e}");
            // A scheduler tells an interrupted job from a failed one by this code.
            signals::pending().map_or(1, |sig| 128 + sig)
        }
    }
}

fn run_job(args: &Args) -> Result<i32, String> {
    args.validate()?;
    signals::install();
    let port = args.master_port.unwrap_or(if args.nnodes == 1 {
        0
    } else {
        DEFAULT_MULTI_NODE_PORT
    });
    // Node 0 serves the store for the whole job, across restarts.
    let server = if args.node_rank == 0 {
        Some(
            TcpStoreServer::start(port)
                .map_err(|e| format!("could not start the rendezvous store on port {port}: {e}"))?,
        )
    } else {
        None
    };
    let port = server.as_ref().map_or(port, TcpStoreServer::port);
    let job = Job {
        nproc_per_node: args.nproc_per_node,
        nnodes: args.nnodes,
        node_rank: args.node_rank,
        master_addr: args.master_addr.clone(),
        master_port: port,
        max_restarts: args.max_restarts,
        run_id: args.run_id.clone(),
    };
    eprintln!(
        "distrun: {} rank(s) on node {} of {} (world size {}), store at {}:{}",
        job.nproc_per_node,
        job.node_rank,
        job.nnodes,
        job.world_size(),
        job.master_addr,
        job.master_port
    );
    let agents = if job.nnodes > 1 {
        let host = if server.is_some() {
            "127.0.0.1"
        } else {
            job.master_addr.as_str()
        };
        Some(Agents::connect(
            host,
            port,
            job.nnodes,
            job.node_rank,
            args.rdzv_timeout,
        )?)
    } else {
        None
    };
    let log_dir = log_dir(args);
    if let Some(d) = &log_dir {
        eprintln!("distrun: logs in {}", d.display());
    }
    let error_files = error_files::ErrorFiles::new(log_dir.as_deref(), &args.run_id);

    let mut attempt = 0;
    loop {
        if let Some(a) = &agents
            && let Err(e) = a.join(attempt)
        {
            if signals::pending().is_some() {
                a.withdraw(attempt);
            }
            return Err(e);
        }
        let att = Attempt {
            job: &job,
            command: &args.command,
            restart: attempt,
            grace: args.grace_period,
            tail_lines: args.tail_lines,
            log_dir: log_dir.as_deref(),
            agents: agents.as_ref(),
            error_files: &error_files,
        };
        let outcome = group::run_attempt(&att)?;
        let mut failure = match outcome {
            Outcome::Interrupted(sig) => {
                eprintln!(
                    "distrun: received {}: stopped every rank",
                    signals::name(sig)
                );
                if let Some(a) = &agents {
                    a.abandon(
                        attempt,
                        128 + sig,
                        &format!(
                            "node {} was interrupted by {}",
                            job.node_rank,
                            signals::name(sig)
                        ),
                    );
                }
                return Ok(128 + sig);
            }
            Outcome::Success => None,
            Outcome::Failed(f) => {
                eprint!("{}", f.summary(args.tail_lines));
                Some((f.exit_code(), f.one_line(), f.error().cloned()))
            }
            Outcome::RemoteFailed(code, what) => {
                eprintln!("distrun: stopped this node's ranks: {what}");
                Some((code, what, None))
            }
        };
        if let Some(a) = &agents {
            if failure.is_none() {
                // As torchrun's agent says it: a node that ended well may wait long for the
                // others, and should say why it has not exited.
                eprintln!(
                    "distrun: node {}'s ranks ended well; waiting for the other nodes",
                    job.node_rank
                );
            }
            // Every node decides the same: restart or end, with the first failure's code.
            let finished = a.finish(attempt, args.grace_period).inspect_err(|_| {
                // The others may still run ranks, which an interrupted job must stop.
                if let Some(sig) = signals::pending() {
                    let what = format!(
                        "node {} was interrupted by {} while it waited for the other nodes \
                         to end attempt {attempt}",
                        job.node_rank,
                        signals::name(sig)
                    );
                    a.abandon_finished(attempt, 128 + sig, &what);
                }
            })?;
            if let Some((code, what)) = finished
                && failure.is_none()
            {
                eprintln!("distrun: the job failed on another node: {what}");
                failure = Some((code, what, None));
            }
        }
        match failure {
            None => {
                if let Some(a) = &agents {
                    a.leave();
                }
                return Ok(0);
            }
            Some((code, what, error)) if attempt >= args.max_restarts => {
                // A launcher above this one learns the root cause as torchrun's agent tells it.
                if let Some(outer) = error_files::outer() {
                    error_files::pass_on(&outer, error.as_ref(), code, &what);
                }
                if args.max_restarts > 0 {
                    eprintln!(
                        "distrun: giving up after {} restart(s) (--max-restarts {})",
                        attempt, args.max_restarts
                    );
                }
                if let Some(a) = &agents {
                    a.leave();
                }
                return Ok(code);
            }
            Some(_) => {
                // A signal that came while the failed attempt's ranks were being stopped must
                // not start the next attempt: its ranks would be stopped as they start. With
                // other nodes, the wait in `finish` above saw it and ended this node; the
                // others restart as after any failure, and wait in the next rendezvous for
                // this node or one started in its place, within --rdzv-timeout, as torchrun's
                // agents do.
                if agents.is_none()
                    && let Some(sig) = signals::pending()
                {
                    eprintln!("distrun: received {}: not restarting", signals::name(sig));
                    return Ok(128 + sig);
                }
                attempt += 1;
                eprintln!(
                    "distrun: restarting the job (restart {attempt} of {})",
                    args.max_restarts
                );
            }
        }
    }
}

/// `--log-dir`, or with `--tee` alone a fresh directory under the system's temporary one.
fn log_dir(args: &Args) -> Option<PathBuf> {
    if let Some(d) = &args.log_dir {
        return Some(d.clone());
    }
    if !args.tee {
        return None;
    }
    Some(fresh_temp_dir("distrun", &args.run_id))
}

/// A path of this run's own under the system's temporary directory:
/// `<kind>-<run id>-<pid>-<ms since the epoch>`.
fn fresh_temp_dir(kind: &str, run_id: &str) -> PathBuf {
    let stamp = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or(Duration::ZERO)
        .as_millis();
    std::env::temp_dir().join(format!("{kind}-{run_id}-{}-{stamp}", std::process::id()))
}
