//! Workers as real processes, started the way `distrun` starts them (torchrun's environment,
//! the store served by the launcher, here the test): RRefs forked through three processes,
//! remote panics, a worker killed with SIGKILL, shutdown with calls in flight, and 10,000
//! concurrent calls. The test binary re-runs itself as the workers.

mod common;

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use common::{Tracked, drops, handlers, wait_entered};
use dist_backend::store::TcpStoreServer;
use dist_rpc::{Error, RRef, Rpc, RpcOptions, init_rpc};

/// Writes a line straight to stdout (the harness captures `println!`).
fn say(line: &str) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}

fn proc_status(field: &str) -> u64 {
    let s = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    s.lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or(0)
}

/// Worker entry: runs only when a test below starts this binary with `DIST_RPC_SCENARIO`.
#[test]
#[ignore = "a worker process started by the other tests of this file"]
fn worker() {
    let Ok(scenario) = std::env::var("DIST_RPC_SCENARIO") else {
        return;
    };
    let rank: usize = std::env::var("RANK").unwrap().parse().unwrap();
    // Rank and world size from the launcher's environment, as under distrun.
    let rpc = init_rpc(
        &format!("w{rank}"),
        None,
        None,
        RpcOptions::new().handlers(handlers()),
    )
    .unwrap_or_else(|e| panic!("init: {e}"));
    match scenario.as_str() {
        "rref_chain" => rref_chain(&rpc, rank),
        "killed" => killed(&rpc, rank),
        "shutdown_inflight" => shutdown_inflight(&rpc, rank),
        "burst" => burst(&rpc, rank),
        "exit_without_shutdown" => exit_without_shutdown(&rpc, rank),
        other => panic!("unknown scenario {other}"),
    }
}

fn rref_chain(rpc: &Rpc, rank: usize) {
    let tag = "proc-chain";
    let n = 5000u64;
    let want: u64 = (0..n).sum();
    if rank == 0 {
        let r: RRef<Tracked> = rpc.remote("w1", "make_tracked", &(tag, n)).unwrap();
        // w0 -> w2 -> w3: a fork of a fork, fetched from the owner w1 by w3.
        assert_eq!(
            rpc.rpc_sync::<_, u64>("w2", "forward_rref", &(r.clone(), 3usize))
                .unwrap(),
            want
        );
        rpc.rpc_sync::<_, ()>("w3", "stash", &(tag, r.clone()))
            .unwrap();
        assert_eq!(r.to_here().unwrap().data.len(), n as usize);
        drop(r);
        // w3's fork keeps the value alive after w0 dropped its own.
        assert_eq!(
            rpc.rpc_sync::<_, u64>("w3", "unstash_sum", &tag).unwrap(),
            want
        );
        // A panic in another process comes back with its message and the worker's name.
        let e = rpc
            .rpc_sync::<_, ()>("w2", "panic", &"kaboom in w2")
            .unwrap_err();
        assert!(matches!(&e, Error::Remote { panicked: true, .. }), "{e}");
        let text = e.to_string();
        assert!(
            text.contains("w2 (rank 2)") && text.contains("kaboom in w2"),
            "{text}"
        );
        say(&format!("RESULT panic {text}"));
        // A mebibyte of raw bytes across processes.
        let data: Vec<u8> = (0..1usize << 20).map(|i| (i % 253) as u8).collect();
        let back = rpc.rpc_sync_bytes("w3", "inc_bytes", &data).unwrap();
        assert!(
            back.iter().zip(&data).all(|(b, d)| *b == d.wrapping_add(1))
                && back.len() == data.len()
        );
    }
    if rank == 1 {
        let deadline = Instant::now() + Duration::from_secs(60);
        while rpc.stats().rrefs_deleted == 0 {
            assert!(
                Instant::now() < deadline,
                "the owner never deleted the RRef"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
        say(&format!(
            "RESULT owner deleted={} drops={} owned={}",
            rpc.stats().rrefs_deleted,
            drops(tag),
            rpc.stats().owned_rrefs
        ));
    }
    rpc.shutdown().unwrap();
    if rank == 1 {
        say(&format!(
            "RESULT after-shutdown deleted={} drops={}",
            rpc.stats().rrefs_deleted,
            drops(tag)
        ));
    }
}

fn killed(rpc: &Rpc, rank: usize) {
    let key = "killed";
    if rank == 1 {
        // The victim: say when both callers' calls are blocked in its pool, then wait to die.
        wait_entered(key, 6);
        say("READY");
        wait_entered("never", 1);
        return;
    }
    let futs: Vec<_> = (0..3)
        .map(|_| {
            rpc.rpc_async_timeout::<_, String>("w1", "block", &key, Duration::from_secs(60))
                .unwrap()
        })
        .collect();
    for f in futs {
        let start = Instant::now();
        let e = f.wait().unwrap_err();
        assert!(
            matches!(&e, Error::PeerLost { peer, .. } if peer == "w1 (rank 1)"),
            "{e}"
        );
        say(&format!("RESULT lost {} {e}", start.elapsed().as_millis()));
    }
    // A new call to the dead worker fails at once; the survivors still talk to each other.
    let e = rpc.rpc_sync::<_, i64>("w1", "add", &(1, 1)).unwrap_err();
    assert!(matches!(e, Error::PeerLost { .. }), "{e}");
    let other = if rank == 0 { "w2" } else { "w0" };
    assert_eq!(rpc.rpc_sync::<_, i64>(other, "add", &(20, 22)).unwrap(), 42);
    // Graceful shutdown cannot wait for a dead worker: it fails naming it.
    let e = rpc.shutdown().unwrap_err();
    assert!(
        matches!(&e, Error::PeerLost { peer, .. } if peer == "w1 (rank 1)"),
        "{e}"
    );
    say(&format!("RESULT shutdown {e}"));
}

fn shutdown_inflight(rpc: &Rpc, rank: usize) {
    let mut futs = Vec::new();
    if rank != 0 {
        for i in 0..30i64 {
            futs.push(
                rpc.rpc_async::<_, i64>("w0", "slow_add", &(i, 100 * rank as i64, 20))
                    .unwrap(),
            );
        }
    }
    rpc.shutdown().unwrap();
    assert!(futs.iter().all(|f| f.is_completed()));
    let got: Vec<i64> = futs.into_iter().map(|f| f.wait().unwrap()).collect();
    let want: Vec<i64> = if rank == 0 {
        vec![]
    } else {
        (0..30).map(|i| i + 100 * rank as i64).collect()
    };
    assert_eq!(got, want);
    say(&format!(
        "RESULT served={} completed={}",
        rpc.stats().calls_served,
        got.len()
    ));
}

fn burst(rpc: &Rpc, rank: usize) {
    let threads_before = proc_status("Threads:");
    let total = 10_000i64;
    if rank != 0 {
        let mine: Vec<i64> = (0..total)
            .filter(|i| (i % 3) as usize == rank - 1)
            .collect();
        // All in flight before any is waited for.
        let futs: Vec<_> = mine
            .iter()
            .map(|&i| rpc.rpc_async::<_, i64>("w0", "add", &(i, 7)).unwrap())
            .collect();
        let mut n = 0;
        for (f, &i) in futs.into_iter().zip(&mine) {
            assert_eq!(f.wait().unwrap(), i + 7);
            n += 1;
        }
        say(&format!("RESULT completed {n}"));
    }
    let threads_after = proc_status("Threads:");
    rpc.shutdown().unwrap();
    if rank == 0 {
        let s = rpc.stats();
        say(&format!(
            "RESULT server served={} peak_running={} peak_queued={} pool={} threads_before={threads_before} threads_after={threads_after} vm_hwm_kib={}",
            s.calls_served,
            s.peak_running,
            s.peak_queued,
            s.pool_threads,
            proc_status("VmHWM:")
        ));
    }
}

fn exit_without_shutdown(rpc: &Rpc, rank: usize) {
    if rank == 1 {
        // Returns (and the process exits) without shutdown: the exit hook says goodbye.
        return;
    }
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut ok = 0u64;
    let e = loop {
        match rpc.rpc_sync::<_, i64>("w1", "add", &(1, 2)) {
            Ok(v) => {
                assert_eq!(v, 3);
                ok += 1;
            }
            Err(e) => break e,
        }
        assert!(Instant::now() < deadline, "w1 never went away");
    };
    // An exit is not a crash: the peer is shut down, not lost.
    assert!(matches!(e, Error::PeerShutDown { .. }), "{e}");
    say(&format!("RESULT calls before the exit={ok}; then: {e}"));
    // A graceful shutdown cannot wait for a worker that left without one: it says so at once.
    let e = rpc.shutdown().unwrap_err();
    assert!(
        matches!(&e, Error::PeerShutDown { peer, .. } if peer == "w1 (rank 1)"),
        "{e}"
    );
}

/// A job of worker processes; kills whatever still runs when dropped.
struct Job {
    children: Vec<Child>,
    lines: mpsc::Receiver<(usize, String)>,
    _store: TcpStoreServer,
}

impl Job {
    fn start(scenario: &str, world: usize) -> Job {
        let store = TcpStoreServer::start(0).expect("store server");
        let exe = std::env::current_exe().expect("test binary");
        let (tx, rx) = mpsc::channel();
        let children = (0..world)
            .map(|rank| {
                let mut c = Command::new(&exe)
                    .args([
                        "--ignored",
                        "--exact",
                        "worker",
                        "--nocapture",
                        "--test-threads=1",
                    ])
                    .env("DIST_RPC_SCENARIO", scenario)
                    .env("RANK", rank.to_string())
                    .env("WORLD_SIZE", world.to_string())
                    .env("LOCAL_RANK", rank.to_string())
                    .env("LOCAL_WORLD_SIZE", world.to_string())
                    .env("MASTER_ADDR", "127.0.0.1")
                    .env("MASTER_PORT", store.port().to_string())
                    .env("TORCHELASTIC_USE_AGENT_STORE", "True")
                    .env("TORCHELASTIC_RESTART_COUNT", "0")
                    .stdout(Stdio::piped())
                    .stderr(Stdio::piped())
                    .spawn()
                    .expect("spawn worker");
                for out in [
                    Box::new(c.stdout.take().unwrap()) as Box<dyn std::io::Read + Send>,
                    Box::new(c.stderr.take().unwrap()),
                ] {
                    let tx = tx.clone();
                    std::thread::spawn(move || {
                        for line in BufReader::new(out).lines().map_while(Result::ok) {
                            let _ = tx.send((rank, line));
                        }
                    });
                }
                c
            })
            .collect();
        Job {
            children,
            lines: rx,
            _store: store,
        }
    }

    /// Collects output until every worker has exited (bounded); returns statuses and lines.
    fn finish(
        mut self,
        mut on_line: impl FnMut(&mut Job, usize, &str),
    ) -> (Vec<ExitStatus>, Vec<(usize, String)>) {
        let deadline = Instant::now() + Duration::from_secs(120);
        let mut all = Vec::new();
        let mut status: Vec<Option<ExitStatus>> = vec![None; self.children.len()];
        loop {
            while let Ok((rank, line)) = self.lines.recv_timeout(Duration::from_millis(20)) {
                on_line(&mut self, rank, &line);
                all.push((rank, line));
            }
            for (r, c) in self.children.iter_mut().enumerate() {
                if status[r].is_none() {
                    status[r] = c.try_wait().expect("try_wait");
                }
            }
            if status.iter().all(Option::is_some) {
                // The readers may still hold the last lines.
                while let Ok((rank, line)) = self.lines.recv_timeout(Duration::from_millis(200)) {
                    all.push((rank, line));
                }
                break;
            }
            assert!(
                Instant::now() < deadline,
                "workers hung; output so far:\n{}",
                show(&all)
            );
        }
        (status.into_iter().map(Option::unwrap).collect(), all)
    }
}

impl Drop for Job {
    fn drop(&mut self) {
        for c in &mut self.children {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn show(lines: &[(usize, String)]) -> String {
    lines.iter().map(|(r, l)| format!("[w{r}] {l}\n")).collect()
}

/// The `RESULT` lines of one rank (the harness may print on the same line before ours).
fn results(lines: &[(usize, String)], rank: usize) -> Vec<String> {
    lines
        .iter()
        .filter(|(r, _)| *r == rank)
        .filter_map(|(_, l)| l.find("RESULT ").map(|at| l[at + 7..].to_owned()))
        .collect()
}

fn assert_all_ok(status: &[ExitStatus], lines: &[(usize, String)]) {
    for (r, s) in status.iter().enumerate() {
        assert!(
            s.success(),
            "w{r} exited with {s}; output:\n{}",
            show(lines)
        );
    }
}

#[test]
fn an_rref_forked_through_three_processes_is_freed_exactly_once_and_a_remote_panic_names_its_worker()
 {
    let (status, lines) = Job::start("rref_chain", 4).finish(|_, _, _| {});
    assert_all_ok(&status, &lines);
    assert_eq!(
        results(&lines, 1),
        vec![
            "owner deleted=1 drops=1 owned=0",
            "after-shutdown deleted=1 drops=1"
        ],
        "{}",
        show(&lines)
    );
    assert_eq!(results(&lines, 0).len(), 1, "{}", show(&lines));
}

#[test]
fn a_worker_killed_with_sigkill_fails_every_pending_call_to_it_at_once() {
    let mut killed_at = None;
    let (status, lines) = Job::start("killed", 3).finish(|job, rank, line| {
        if rank == 1 && line.contains("READY") && killed_at.is_none() {
            job.children[1].kill().expect("SIGKILL the victim");
            killed_at = Some(Instant::now());
        }
    });
    assert!(
        killed_at.is_some(),
        "the victim never got ready:\n{}",
        show(&lines)
    );
    assert!(!status[1].success());
    for r in [0, 2] {
        assert!(status[r].success(), "w{r}: {}\n{}", status[r], show(&lines));
        let res = results(&lines, r);
        assert_eq!(res.len(), 4, "{}", show(&lines));
        eprintln!("killed, w{r}: {res:?}");
        for l in &res[..3] {
            let ms: u64 = l.split_whitespace().nth(1).unwrap().parse().unwrap();
            // "At once": the connection's end, far inside the 60 s call timeout.
            assert!(ms < 30_000, "{l}");
        }
    }
}

#[test]
fn graceful_shutdown_across_processes_finishes_the_calls_in_flight() {
    let (status, lines) = Job::start("shutdown_inflight", 3).finish(|_, _, _| {});
    assert_all_ok(&status, &lines);
    assert_eq!(
        results(&lines, 0),
        vec!["served=60 completed=0"],
        "{}",
        show(&lines)
    );
    assert_eq!(results(&lines, 1), vec!["served=0 completed=30"]);
    assert_eq!(results(&lines, 2), vec!["served=0 completed=30"]);
}

#[test]
fn ten_thousand_concurrent_calls_from_three_processes_use_a_fixed_pool() {
    let (status, lines) = Job::start("burst", 4).finish(|_, _, _| {});
    assert_all_ok(&status, &lines);
    let server = results(&lines, 0);
    assert_eq!(server.len(), 1, "{}", show(&lines));
    let field = |name: &str| -> u64 {
        server[0]
            .split_whitespace()
            .find_map(|kv| kv.strip_prefix(&format!("{name}=")))
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("{name} in {}", server[0]))
    };
    assert_eq!(field("served"), 10_000);
    assert!(field("peak_running") <= field("pool"), "{}", server[0]);
    assert_eq!(
        field("threads_after"),
        field("threads_before"),
        "threads were spawned: {}",
        server[0]
    );
    // Bounded memory: the queued calls are small; a leak per call would show here.
    assert!(field("vm_hwm_kib") < 512 * 1024, "{}", server[0]);
    eprintln!("burst server: {}", server[0]);
    let completed: u64 = (1..4)
        .map(|r| {
            results(&lines, r)[0]
                .strip_prefix("completed ")
                .unwrap()
                .parse::<u64>()
                .unwrap()
        })
        .sum();
    assert_eq!(completed, 10_000);
}

#[test]
fn a_worker_that_exits_without_shutdown_is_seen_as_shut_down_not_lost() {
    let (status, lines) = Job::start("exit_without_shutdown", 2).finish(|_, _, _| {});
    assert_all_ok(&status, &lines);
    assert_eq!(results(&lines, 0).len(), 1, "{}", show(&lines));
}
