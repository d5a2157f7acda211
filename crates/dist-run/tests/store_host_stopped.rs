//! Node 0's `distrun`, which serves the job's store, is stopped (SIGSTOP: its sockets stay
//! open, nothing answers) while another node waits in the multi-node rendezvous. That node's
//! join must end by the one deadline it took when it started (`--rdzv-timeout`), not by a
//! fresh store timeout from the store call that was in flight when the host stopped.
//!
//! Order comes from the store itself (the test reads the join counter until both started
//! nodes have joined; node 1's join began before that) and from `waitpid`, which reports
//! node 0 stopped once every thread of it is.

use std::io::{BufRead, BufReader, Read};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use dist_backend::Store;
use dist_backend::store::TcpStore;

const DISTRUN: &str = env!("CARGO_BIN_EXE_distrun");
/// `--rdzv-timeout` of every node.
const RDZV: Duration = Duration::from_secs(4);
const SLACK: Duration = Duration::from_secs(1);

/// A node's `distrun`, resumed and killed when the test ends, however it ends.
struct Node(Child);

impl Drop for Node {
    fn drop(&mut self) {
        send(&self.0, libc::SIGCONT);
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Sends `sig` to our child `c`; one that has exited already makes it fail harmlessly.
fn send(c: &Child, sig: libc::c_int) {
    let pid = libc::pid_t::try_from(c.id()).expect("pid fits pid_t");
    // SAFETY: kill(2) on our own child's pid; it touches no memory of ours.
    let _ = unsafe { libc::kill(pid, sig) };
}

/// Stops `c` and returns once all of it has stopped: kill(2) only queues SIGSTOP, and the
/// kernel reports the stop to the parent when the last of the process's threads has stopped.
fn stop(c: &Child) {
    send(c, libc::SIGSTOP);
    let pid = libc::pid_t::try_from(c.id()).expect("pid fits pid_t");
    let mut status = 0;
    // SAFETY: waitpid(2) on our own child, writing only to `status`, a local we own. With
    // WUNTRACED it reports the stop without reaping the child, so `Child` still owns it.
    let rc = unsafe { libc::waitpid(pid, &mut status, libc::WUNTRACED) };
    assert_eq!(rc, pid, "waitpid on node 0");
    assert!(
        libc::WIFSTOPPED(status),
        "node 0 ended instead of stopping (status {status:#x})"
    );
}

/// One node of a three-node job (only two are started, so nobody ever gets `go`).
fn node(rank: &str, port: &str) -> Node {
    let rdzv = RDZV.as_secs().to_string();
    node_of("3", &rdzv, "1", rank, port, &["true"])
}

/// Node `rank` of a job of `nnodes` nodes of `nproc` ranks each running `command`, with a
/// rendezvous timeout of `rdzv` seconds; stdout and stderr piped.
fn node_of(
    nnodes: &str,
    rdzv: &str,
    nproc: &str,
    rank: &str,
    port: &str,
    command: &[&str],
) -> Node {
    Command::new(DISTRUN)
        .args([
            "--nnodes",
            nnodes,
            "--node-rank",
            rank,
            "--nproc-per-node",
            nproc,
            "--master-port",
            port,
            "--rdzv-timeout",
            rdzv,
            "--",
        ])
        .args(command)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map(Node)
        .expect("start distrun")
}

/// What a node's `distrun` wrote to stderr, read to its end.
fn rest_of_stderr(node: &mut Node) -> String {
    let mut err = String::new();
    node.0
        .stderr
        .take()
        .expect("the node's stderr")
        .read_to_string(&mut err)
        .expect("the node's stderr");
    err
}

/// The port node 0's `distrun` prints for its store (it keeps the rest of its stderr).
fn store_port(node0: &mut Node) -> String {
    // `distrun: 1 rank(s) on node 0 of 3 (world size 3), store at 127.0.0.1:PORT`
    let mut stderr0 = BufReader::new(node0.0.stderr.take().expect("node 0's stderr"));
    let port = loop {
        let mut line = String::new();
        let n = stderr0.read_line(&mut line).expect("node 0's stderr");
        assert_ne!(n, 0, "node 0 ended before naming its store's port");
        if let Some((_, at)) = line.split_once("store at ") {
            break at.trim().rsplit_once(':').expect("ADDR:PORT").1.to_owned();
        }
    };
    // Node 0's later lines stay in the pipe, which holds far more than it writes.
    node0.0.stderr = Some(stderr0.into_inner());
    port
}

#[test]
fn a_join_ends_by_its_deadline_when_node_0_is_stopped() {
    let mut node0 = node("0", "0");
    let port = store_port(&mut node0);
    let mut node1 = node("1", &port);
    let observer = TcpStore::connect("127.0.0.1", port.parse().expect("port"), RDZV)
        .expect("the test's client of node 0's store");
    let started = Instant::now();
    while !observer
        .check(&["distrun/attempt_0/joined/0", "distrun/attempt_0/joined/1"])
        .expect("read the arrivals")
    {
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "node 1 never joined"
        );
        std::thread::yield_now();
    }
    // Node 1's join started before this instant, so it must end by RDZV from here.
    let joined = Instant::now();
    // Stopped late in the join, so a store call made then with a timeout of its own (the
    // rendezvous timeout from the call) would overrun the join's deadline by most of that.
    std::thread::sleep(RDZV / 2);
    stop(&node0.0);

    let status = node1.0.wait().expect("node 1's exit");
    let took = joined.elapsed();
    let err = rest_of_stderr(&mut node1);
    eprintln!("node 1 ended {took:?} after both had joined: {err}");
    assert_eq!(status.code(), Some(1), "{err}");
    assert!(err.contains("node 1: joining attempt 0"), "{err}");
    assert!(err.contains(&format!("127.0.0.1:{port}")), "{err}");
    assert!(took <= RDZV + SLACK, "node 1's join took {took:?}: {err}");
}

/// Node `rank` of a two-node job of one rank each whose rank says `up` and sleeps, with a
/// rendezvous timeout far longer than the test may take.
fn running_node(rank: &str, port: &str) -> Node {
    node_of(
        "2",
        "100",
        "1",
        rank,
        port,
        &["sh", "-c", "echo up; sleep 60"],
    )
}

/// Node 0 (the job's store) is stopped while both nodes' ranks run, then node 1's `distrun`
/// is sent SIGTERM: it stops its rank and ends within seconds. Before, its look for failures
/// was one store call bounded by the rendezvous timeout (100 s here), which a stopped store
/// never answers, so neither the signal nor its ranks were looked at until then; and on its
/// way out it told the others through the same store with the same bound. Now each look
/// waits at most a second, and a node that was interrupted tells the others within 5 s.
#[test]
fn a_node_whose_store_is_stopped_still_stops_on_sigterm() {
    let mut node0 = running_node("0", "0");
    let port = store_port(&mut node0);
    let mut node1 = running_node("1", &port);
    let mut up = String::new();
    BufReader::new(node1.0.stdout.take().expect("node 1's stdout"))
        .read_line(&mut up)
        .expect("node 1's rank output");
    assert!(up.trim_end().ends_with("up"), "{up:?}");
    stop(&node0.0);
    let signalled = Instant::now();
    send(&node1.0, libc::SIGTERM);
    let status = loop {
        if let Some(s) = node1.0.try_wait().expect("node 1's status") {
            break s;
        }
        assert!(
            signalled.elapsed() < Duration::from_secs(60),
            "node 1 still runs 60 s after SIGTERM"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    let took = signalled.elapsed();
    let err = rest_of_stderr(&mut node1);
    eprintln!("node 1 ended {took:?} after SIGTERM: {err}");
    assert_eq!(status.code(), Some(128 + 15), "{err}");
    assert!(
        took < Duration::from_secs(30),
        "node 1 took {took:?}: {err}"
    );
}

/// Node 0 (the job's store) is stopped, then a rank of node 1 fails: node 1 stops its other
/// rank within seconds. Before, it first reported the failure through the store, in one call
/// bounded by the rendezvous timeout (100 s here), which a stopped store never answers, and
/// its other rank ran on until then. Now the report is tried for a second first, the ranks
/// are stopped, and the report is made after.
#[test]
fn a_rank_failing_while_the_store_is_stopped_stops_its_nodes_other_ranks() {
    let go = std::env::temp_dir().join(format!("distrun-test-{}-fail-stopped", std::process::id()));
    let _ = std::fs::remove_file(&go);
    // Rank 2 (node 1) fails once `go` exists (bounded, so that nothing outlives a failed
    // test); rank 3 (node 1) names its pid and sleeps; node 0's ranks sleep.
    let script = format!(
        "case $RANK in \
           2) i=0; while [ ! -e '{}' ] && [ $i -lt 1200 ]; do sleep 0.05; i=$((i+1)); done; \
              exit 3;; \
           3) echo pid $$; exec sleep 60;; \
           *) exec sleep 60;; \
         esac",
        go.display()
    );
    let command = ["sh", "-c", script.as_str()];
    let mut node0 = node_of("2", "100", "2", "0", "0", &command);
    let port = store_port(&mut node0);
    let mut node1 = node_of("2", "100", "2", "1", &port, &command);
    let mut line = String::new();
    BufReader::new(node1.0.stdout.take().expect("node 1's stdout"))
        .read_line(&mut line)
        .expect("rank 3's output");
    let (_, pid) = line
        .trim_end()
        .rsplit_once("pid ")
        .expect("rank 3 names its pid");
    let pid = pid.to_owned();
    stop(&node0.0);
    std::fs::write(&go, b"").unwrap();
    let failed = Instant::now();
    // Gone, or a zombie not reaped yet.
    let gone = || {
        std::fs::read_to_string(format!("/proc/{pid}/stat")).map_or(true, |s| {
            s.rsplit_once(") ").is_some_and(|(_, r)| r.starts_with('Z'))
        })
    };
    while !gone() && failed.elapsed() < Duration::from_secs(60) {
        std::thread::sleep(Duration::from_millis(50));
    }
    let took = failed.elapsed();
    let _ = std::fs::remove_file(&go);
    eprintln!("rank 3 ended {took:?} after rank 2 failed");
    assert!(gone(), "rank 3 still runs 60 s after rank 2 failed");
    assert!(
        took < Duration::from_secs(30),
        "rank 3 ended {took:?} after rank 2 failed"
    );
}
