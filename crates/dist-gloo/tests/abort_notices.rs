//! Faults among real rank processes that exit as soon as they fail (as a training job's ranks
//! do): every rank's error names the cause and the rank behind it, whichever rank saw it first
//! and however soon that rank's sockets went away. Mismatches (count, op, root) must reach
//! every rank as mismatches naming both sides; after a SIGKILL every survivor must name the
//! dead rank, with single-copy transfers off (everything on the sockets) and on. The test
//! binary re-runs itself as the ranks.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use dist_backend::store::{TcpStore, TcpStoreServer};
use dist_backend::{Backend, BufMut, OpOptions};
use dist_gloo::{GlooBackend, GlooOptions};
use dist_wire::{DType, ReduceOp};

/// Elements of the loop's 256 KiB `f32` buffer (as in `soak_faults`).
const COUNT: usize = 256 * 1024 / 4;
/// The iteration at which the mismatch scenarios call the mismatched collective.
const MISMATCH_AT: usize = 3;

/// Writes a line straight to the process's stdout: the test harness captures `println!`.
fn say(line: &str) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}

/// One iteration of the ranks' loop: a 256 KiB all_reduce, then a broadcast from `root`.
fn iteration(
    b: &GlooBackend,
    buf: &mut [f32],
    root: usize,
    opts: &OpOptions,
) -> dist_backend::Result<()> {
    b.all_reduce(
        BufMut::Host(bytemuck::cast_slice_mut(buf)),
        DType::F32,
        ReduceOp::Sum,
        opts,
    )?;
    b.broadcast(
        BufMut::Host(bytemuck::cast_slice_mut(buf)),
        DType::F32,
        root,
        opts,
    )
}

fn f32s(v: &mut [f32]) -> BufMut<'_> {
    BufMut::Host(bytemuck::cast_slice_mut(v))
}

/// The collective of a mismatch scenario; ranks 0 and 1 call something the others do not.
fn mismatched(
    b: &GlooBackend,
    scenario: &str,
    buf: &mut [f32],
    opts: &OpOptions,
) -> dist_backend::Result<()> {
    let rank = b.rank();
    match (scenario, rank) {
        ("count", 0 | 1) => {
            let mut other = vec![1.0f32; COUNT + 1 + rank];
            b.all_reduce(f32s(&mut other), DType::F32, ReduceOp::Sum, opts)
        }
        ("op", 0 | 1) => b.broadcast(f32s(buf), DType::F32, 0, opts),
        ("count" | "op", _) => b.all_reduce(f32s(buf), DType::F32, ReduceOp::Sum, opts),
        ("root", _) => {
            let mut small = vec![1.0f32; 100];
            b.broadcast(f32s(&mut small), DType::F32, usize::from(rank < 2), opts)
        }
        ("root-large", _) => {
            let mut large = vec![1.0f32; 1 << 20];
            b.broadcast(f32s(&mut large), DType::F32, rank, opts)
        }
        _ => panic!("unknown scenario {scenario}"),
    }
}

/// Worker entry: runs only when the parent test starts this binary with `DIST_TEST_WORKER`
/// (`scenario,rank,world,port`). Prints `READY` once inside its loop and `ERR <error>` on its
/// first error, then closes its backend (delivering what it owes its peers, as a process
/// group's exit hook does) and exits at once with code 3.
#[test]
#[ignore = "a worker rank started by the tests of this file"]
fn worker() {
    let Ok(spec) = std::env::var("DIST_TEST_WORKER") else {
        return;
    };
    let parts: Vec<&str> = spec.split(',').collect();
    let scenario = parts[0];
    let num = |i: usize| parts[i].parse::<usize>().expect("numeric worker spec");
    let (rank, world, port) = (num(1), num(2), num(3) as u16);
    let store = TcpStore::connect("127.0.0.1", port, Duration::from_secs(30)).expect("store");
    let b = GlooBackend::connect(&store, "faults", rank, world, &GlooOptions::from_env())
        .expect("mesh");
    let opts = OpOptions::with_timeout(Duration::from_secs(60));
    let mut buf = vec![1.0f32; COUNT];
    for i in 0.. {
        let r = if scenario != "kill" && i == MISMATCH_AT {
            mismatched(&b, scenario, &mut buf, &opts)
        } else {
            iteration(&b, &mut buf, i % world, &opts)
        };
        if let Err(e) = r {
            say(&format!("ERR {e}"));
            drop(b);
            std::process::exit(3);
        }
        if i == 0 {
            say("READY");
        }
        if scenario != "kill" && i > MISMATCH_AT {
            say("OK");
            std::process::exit(0);
        }
    }
}

/// Kills every worker still running when the test ends, passed or failed.
struct Workers(Vec<Child>);

impl Drop for Workers {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Starts `world` workers of `scenario` (with `env` added) and returns them with the channel
/// their `READY`/`ERR`/`OK` lines arrive on.
fn start(
    scenario: &str,
    world: usize,
    env: &[(&str, &str)],
) -> (Workers, mpsc::Receiver<(usize, String)>, TcpStoreServer) {
    let server = TcpStoreServer::start(0).expect("store server");
    let exe = std::env::current_exe().expect("test binary path");
    let (tx, rx) = mpsc::channel();
    let workers = (0..world)
        .map(|rank| {
            let mut cmd = Command::new(&exe);
            cmd.args([
                "--ignored",
                "--exact",
                "worker",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(
                "DIST_TEST_WORKER",
                format!("{scenario},{rank},{world},{}", server.port()),
            )
            .stdout(Stdio::piped())
            .stderr(Stdio::null());
            // The scenario's settings, not the ones the test runner was started with (a run
            // under `DIST_GLOO_TRANSPORT=tcp` must not turn the shared-memory case into TCP).
            for (k, _) in std::env::vars().filter(|(k, _)| k.starts_with("DIST_GLOO_")) {
                cmd.env_remove(k);
            }
            for (k, v) in env {
                cmd.env(k, v);
            }
            let mut child = cmd.spawn().expect("spawn worker");
            let out = BufReader::new(child.stdout.take().expect("piped stdout"));
            let tx = tx.clone();
            std::thread::spawn(move || {
                // The harness may print "test worker ... " on the same line before ours.
                for line in out.lines().map_while(Result::ok) {
                    let at = ["READY", "ERR ", "OK"].iter().find_map(|p| line.find(p));
                    if let Some(at) = at {
                        let _ = tx.send((rank, line[at..].to_string()));
                    }
                }
            });
            child
        })
        .collect();
    (Workers(workers), rx, server)
}

/// Collects one line per rank in `ranks` other than `READY`, failing the test on a rank that
/// says nothing for a minute (every error below comes well before the ranks' 60 s timeout).
fn outcomes(rx: &mpsc::Receiver<(usize, String)>, ranks: &[usize]) -> Vec<(usize, String)> {
    let mut seen: Vec<(usize, String)> = Vec::new();
    while seen.len() < ranks.len() {
        let (rank, line) = rx
            .recv_timeout(Duration::from_secs(60))
            .unwrap_or_else(|_| panic!("ranks {ranks:?} did not all report; so far: {seen:?}"));
        if line != "READY" && ranks.contains(&rank) {
            seen.push((rank, line));
        }
    }
    seen.sort();
    seen
}

/// The ranks a line names as the other side of a mismatch (`met rank N`).
fn met(line: &str) -> Vec<usize> {
    line.match_indices(" met rank ")
        .filter_map(|(i, m)| {
            let d: String = line[i + m.len()..]
                .chars()
                .take_while(char::is_ascii_digit)
                .collect();
            d.parse().ok()
        })
        .collect()
}

fn mismatch_reaches_every_rank(scenario: &str, world: usize, check: impl Fn(usize, &str)) {
    let (_workers, rx, _server) = start(scenario, world, &[]);
    let all: Vec<usize> = (0..world).collect();
    for (rank, line) in outcomes(&rx, &all) {
        eprintln!("{scenario}: rank {rank}: {line}");
        assert!(
            line.starts_with("ERR "),
            "{scenario}: rank {rank} did not fail: {line}"
        );
        assert!(
            line.contains("mismatch") || line.contains(" met rank "),
            "{scenario}: rank {rank} must say mismatch: {line}"
        );
        assert!(
            !met(&line).is_empty(),
            "{scenario}: rank {rank} names no other side: {line}"
        );
        check(rank, &line);
    }
}

#[test]
fn a_count_mismatch_between_two_of_four_ranks_is_reported_as_one_by_every_rank() {
    mismatch_reaches_every_rank("count", 4, |rank, line| {
        // Two sides with different counts: 65537 or 65538 elements (ranks 0, 1) met another.
        assert!(
            line.contains(&format!("f32 × {}", COUNT + 1))
                || line.contains(&format!("f32 × {}", COUNT + 2)),
            "rank {rank}: {line}"
        );
    });
}

#[test]
fn an_op_mismatch_between_two_of_four_ranks_is_reported_as_one_by_every_rank() {
    mismatch_reaches_every_rank("op", 4, |rank, line| {
        // A broadcast receiver whose own data was consistent returns and runs its next
        // all_reduce (see docs/GLOO_INTERNALS.md, on the rooted ops' agreement); an all_reduce
        // rank waiting for it may read that next frame first, and then reports the other side
        // one op ahead.
        let ran_ahead = |k: u32| {
            line.contains(&format!("all_reduce #{k} "))
                && line.contains(&format!("all_reduce #{} ", k + 1))
        };
        assert!(
            (line.contains("broadcast") && line.contains("all_reduce")) || (0..64).any(ran_ahead),
            "rank {rank}: {line}"
        );
    });
}

#[test]
fn a_broadcast_with_different_roots_fails_on_every_rank_naming_both_roots() {
    mismatch_reaches_every_rank("root", 4, |rank, line| {
        assert!(
            line.contains("root 0") && line.contains("root 1"),
            "rank {rank}: {line}"
        );
    });
    mismatch_reaches_every_rank("root-large", 2, |rank, line| {
        assert!(
            line.contains("root 0") && line.contains("root 1") && line.contains("× 1048576"),
            "rank {rank}: {line}"
        );
    });
}

/// SIGKILL of each rank in turn while every rank loops on collectives; every survivor (which
/// exits as soon as it fails) must name the dead rank.
fn every_survivor_names_the_killed_rank(env: &[(&str, &str)]) {
    let world = 4;
    for victim in 0..world {
        let (mut workers, rx, _server) = start("kill", world, env);
        let mut ready = 0;
        while ready < world {
            let (rank, line) = rx
                .recv_timeout(Duration::from_secs(60))
                .expect("every worker reports READY");
            assert_eq!(line, "READY", "rank {rank} failed before the kill");
            ready += 1;
        }
        // Shared memory is the default between processes of one host.
        let shm = !env.contains(&("DIST_GLOO_TRANSPORT", "tcp"));
        for (rank, w) in workers.0.iter().enumerate() {
            let (memfd, named) = shared_mappings(w.id());
            assert_eq!(
                memfd, shm,
                "rank {rank} maps a shared-memory segment: {memfd}"
            );
            assert!(
                named.is_empty(),
                "rank {rank} maps named shared memory: {named:?}"
            );
        }
        workers.0[victim].kill().expect("kill the victim");
        let _ = workers.0[victim].wait();
        let survivors: Vec<usize> = (0..world).filter(|&r| r != victim).collect();
        let seen = outcomes(&rx, &survivors);
        eprintln!("kill {env:?} victim {victim}: {seen:?}");
        for (rank, line) in &seen {
            assert!(
                line.contains(&format!("peer rank {victim} was lost")),
                "{env:?}: rank {rank} must name killed rank {victim}: {line}\nall: {seen:?}"
            );
        }
    }
}

/// Whether process `pid` maps a dist-gloo `memfd` segment, and the `/dev/shm` files it maps
/// (which would outlive a `kill -9`; there must be none).
fn shared_mappings(pid: u32) -> (bool, Vec<String>) {
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).expect("read maps");
    let memfd = maps.contains("/memfd:dist-gloo-shm");
    let named = maps
        .lines()
        .filter(|l| l.contains("/dev/shm/"))
        .map(str::to_string)
        .collect();
    (memfd, named)
}

/// `/dev/shm` as it is now.
fn dev_shm() -> std::collections::BTreeSet<String> {
    std::fs::read_dir("/dev/shm")
        .map(|d| {
            d.filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default()
}

#[test]
fn after_a_kill_every_survivor_names_the_dead_rank_on_plain_tcp() {
    every_survivor_names_the_killed_rank(&[("DIST_GLOO_CMA", "0"), ("DIST_GLOO_TRANSPORT", "tcp")]);
}

/// Every frame through the rings; the survivors learn of the death from the doorbell
/// connection's end, and the segments (memfds, never named) leave nothing in `/dev/shm`.
#[test]
fn after_a_kill_every_survivor_names_the_dead_rank_over_shared_memory() {
    let before = dev_shm();
    every_survivor_names_the_killed_rank(&[("DIST_GLOO_CMA", "0"), ("DIST_GLOO_TRANSPORT", "shm")]);
    every_survivor_names_the_killed_rank(&[("DIST_GLOO_TRANSPORT", "shm")]);
    // Other programs on the machine may come and go in /dev/shm: ours would carry the name
    // of the segment.
    let left: Vec<String> = dev_shm()
        .difference(&before)
        .filter(|n| n.contains("dist"))
        .cloned()
        .collect();
    assert!(left.is_empty(), "left in /dev/shm: {left:?}");
}

#[test]
fn after_a_kill_every_survivor_names_the_dead_rank_with_single_copy_transfers() {
    every_survivor_names_the_killed_rank(&[]);
}
