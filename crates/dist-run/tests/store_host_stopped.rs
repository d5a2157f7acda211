//! Node 0's `distrun`, which serves the job's store, is stopped (SIGSTOP: its sockets stay
//! open, nothing answers) while another node waits in the multi-node rendezvous. That node's
//! join must end by the one deadline it took when it started (`--rdzv-timeout`), not by a
//! fresh store timeout from the store call that was in flight when the host stopped.
//!
//! Order comes from the store itself: the test reads the join counter until both started
//! nodes have joined; node 1's join began before that.

use std::io::{BufRead, BufReader, Read};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use dist_backend::Store;
use dist_backend::store::TcpStore;

const DISTRUN: &str = env!("CARGO_BIN_EXE_distrun");
/// `--rdzv-timeout` of every node.
const RDZV: Duration = Duration::from_secs(4);
const SLACK: Duration = Duration::from_secs(1);

/// Every node still running when the test ends is resumed and killed.
struct Nodes(Vec<Child>);

impl Drop for Nodes {
    fn drop(&mut self) {
        for c in &mut self.0 {
            signal(c, libc::SIGCONT);
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn signal(c: &Child, sig: libc::c_int) {
    let pid = libc::pid_t::try_from(c.id()).expect("pid fits pid_t");
    // SAFETY: kill(2) on our own child's pid; it touches no memory of ours.
    let rc = unsafe { libc::kill(pid, sig) };
    assert!(rc == 0 || sig == libc::SIGCONT, "kill({pid}, {sig}) failed");
}

/// Returns once every thread of `c` is stopped: kill(2) only queues SIGSTOP, and a thread
/// running on another core may still answer a request or two.
fn wait_stopped(c: &Child) {
    let tasks = format!("/proc/{}/task", c.id());
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let all = std::fs::read_dir(&tasks)
            .expect("list node 0's threads")
            .all(|t| {
                let stat = std::fs::read_to_string(t.expect("thread entry").path().join("stat"))
                    .unwrap_or_default();
                // The state follows the parenthesised command name.
                stat.rsplit_once(") ")
                    .is_some_and(|(_, rest)| rest.starts_with('T') || rest.starts_with('t'))
            });
        if all {
            return;
        }
        assert!(Instant::now() < deadline, "node 0 did not stop");
        std::thread::yield_now();
    }
}

/// One node of a three-node job (only two are started, so nobody ever gets `go`).
fn node(rank: &str, port: &str) -> Child {
    let rdzv = RDZV.as_secs().to_string();
    Command::new(DISTRUN)
        .args([
            "--nnodes",
            "3",
            "--node-rank",
            rank,
            "--nproc-per-node",
            "1",
            "--master-port",
            port,
            "--rdzv-timeout",
            &rdzv,
            "--",
            "true",
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start distrun")
}

#[test]
fn a_join_ends_by_its_deadline_when_node_0_is_stopped() {
    let mut nodes = Nodes(vec![node("0", "0")]);
    // `distrun: 1 rank(s) on node 0 of 3 (world size 3), store at 127.0.0.1:PORT`
    let mut stderr0 = BufReader::new(nodes.0[0].stderr.take().expect("node 0's stderr"));
    let port = loop {
        let mut line = String::new();
        let n = stderr0.read_line(&mut line).expect("node 0's stderr");
        assert_ne!(n, 0, "node 0 ended before naming its store's port");
        if let Some((_, at)) = line.split_once("store at ") {
            break at.trim().rsplit_once(':').expect("ADDR:PORT").1.to_owned();
        }
    };
    nodes.0.push(node("1", &port));
    let observer = TcpStore::connect("127.0.0.1", port.parse().expect("port"), RDZV)
        .expect("the test's client of node 0's store");
    while observer
        .add("distrun/attempt_0/joined", 0)
        .expect("read the join counter")
        < 2
    {
        std::thread::yield_now();
    }
    // Node 1's join started before this instant, so it must end by RDZV from here.
    let joined = Instant::now();
    // Stopped late in the join, so a store call made then with a timeout of its own (the
    // rendezvous timeout from the call) would overrun the join's deadline by most of that.
    std::thread::sleep(RDZV / 2);
    signal(&nodes.0[0], libc::SIGSTOP);
    wait_stopped(&nodes.0[0]);

    let status = nodes.0[1].wait().expect("node 1's exit");
    let took = joined.elapsed();
    let mut err = String::new();
    nodes.0[1]
        .stderr
        .take()
        .expect("node 1's stderr")
        .read_to_string(&mut err)
        .expect("node 1's stderr");
    eprintln!("node 1 ended {took:?} after both had joined: {err}");
    assert_eq!(status.code(), Some(1), "{err}");
    assert!(err.contains("node 1: joining attempt 0"), "{err}");
    assert!(err.contains(&format!("127.0.0.1:{port}")), "{err}");
    assert!(took <= RDZV + SLACK, "node 1's join took {took:?}: {err}");
}
