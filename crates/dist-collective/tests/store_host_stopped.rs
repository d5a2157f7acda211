//! The process that hosts the job's TCP store is stopped (SIGSTOP: its sockets stay open,
//! nothing answers) while the ranks are in `init_process_group`, `new_group`/`new_subgroups`/
//! `split`/`DeviceMesh::new`, `monitored_barrier` or `destroy_process_group` (of the world
//! alone, or of a sub-group and then the world). Every rank must come back (with an error
//! naming the store, and for sub-group creation the operation, where the call returns one)
//! within its configured timeout + 1 s.
//!
//! The test binary re-runs itself as the store host and as the ranks. Order comes from pipes:
//! the host prints its port, each rank prints `READY` when it is about to make the call, and
//! the parent stops the host before it writes `go` to every rank; a rank times its call from
//! reading `go` to the call's return.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::Arc;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use dist_backend::Store;
use dist_backend::store::{TcpStore, TcpStoreServer};
use dist_collective::{DeviceMesh, InitOptions, destroy_process_group, init_process_group};

const WORLD: usize = 2;
/// The ranks' configured timeout (process group and store).
const TIMEOUT: Duration = Duration::from_secs(3);

/// Child entry: runs only when a test starts this binary with `DIST_STOPPED_STORE`.
#[test]
#[ignore = "a store host or rank process started by the tests of this file"]
fn child() {
    let Ok(spec) = std::env::var("DIST_STOPPED_STORE") else {
        return;
    };
    let parts: Vec<&str> = spec.split(',').collect();
    match parts[..] {
        ["host"] => host(),
        [scenario, rank, port] => rank_main(
            scenario,
            rank.parse().expect("rank"),
            port.parse().expect("port"),
        ),
        _ => panic!("bad DIST_STOPPED_STORE {spec:?}"),
    }
}

/// Serves the store until the parent closes stdin (or kills it).
fn host() {
    let server = TcpStoreServer::start(0).expect("store server");
    say(&format!("PORT {}", server.port()));
    let mut line = String::new();
    let _ = std::io::stdin().read_line(&mut line);
    drop(server);
}

fn rank_main(scenario: &str, rank: usize, port: u16) {
    let store = Arc::new(TcpStore::connect("127.0.0.1", port, TIMEOUT).expect("store"));
    let opts = InitOptions::new()
        .backend("gloo")
        .store(store)
        .rank(rank)
        .world_size(WORLD)
        .timeout(TIMEOUT);
    let pg = if scenario == "init" {
        None
    } else {
        Some(init_process_group(opts.clone()).expect("init before the store stops"))
    };
    // A sub-group made while the store answers, for the scenarios that tear one down.
    let sub = (scenario == "destroy_subgroup").then(|| {
        pg.as_ref()
            .expect("group")
            .new_group(&[0, 1])
            .expect("new_group before the store stops")
            .expect("both ranks are members")
    });
    say("READY");
    let mut go = String::new();
    std::io::stdin().read_line(&mut go).expect("go");
    let mut start = Instant::now();
    let outcome: Result<(), String> = match scenario {
        "init" => init_process_group(opts)
            .map(drop)
            .map_err(|e| e.to_string()),
        "new_group" => pg
            .as_ref()
            .expect("group")
            .new_group(&[0, 1])
            .map(drop)
            .map_err(|e| e.to_string()),
        "new_subgroups" => pg
            .as_ref()
            .expect("group")
            .new_subgroups(WORLD)
            .map(drop)
            .map_err(|e| e.to_string()),
        "mesh" => DeviceMesh::new(pg.as_ref().expect("group"), &[("dp", 1), ("tp", WORLD)])
            .map(drop)
            .map_err(|e| e.to_string()),
        "split" => pg
            .as_ref()
            .expect("group")
            .split(Some(0), rank as i64)
            .map(drop)
            .map_err(|e| e.to_string()),
        "monitored_barrier" => pg
            .as_ref()
            .expect("group")
            .monitored_barrier(TIMEOUT, true)
            .map_err(|e| e.to_string()),
        "destroy" => {
            drop(pg);
            destroy_process_group();
            Ok(())
        }
        "destroy_while_publishing" => {
            // A collective changes this rank's progress; its watchdog publishes the new state
            // once it has held for an eighth of the timeout, to the stopped store, and is
            // still waiting on it when the group is destroyed. The wait is what makes the
            // publish be in flight, not an ordering the assertion relies on: too short a
            // wait only leaves nothing in flight.
            pg.as_ref()
                .expect("group")
                .barrier()
                .expect("barrier over gloo");
            std::thread::sleep(TIMEOUT / 8 + TIMEOUT / 4);
            start = Instant::now();
            drop(pg);
            destroy_process_group();
            Ok(())
        }
        "destroy_subgroup" => {
            if let Some(sub) = sub {
                sub.destroy();
            }
            drop(pg);
            destroy_process_group();
            Ok(())
        }
        other => panic!("unknown scenario {other}"),
    };
    let ms = start.elapsed().as_millis();
    match outcome {
        Ok(()) => say(&format!("DONE {ms} ok")),
        Err(e) => say(&format!("DONE {ms} err {}", e.replace('\n', " | "))),
    }
    // Exit without destructors: the default group's teardown would talk to the stopped store.
    std::process::exit(0);
}

/// Writes a line straight to the process's stdout: the test harness captures `println!`.
fn say(line: &str) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}

/// Every child still running when a test ends is resumed and killed.
struct Children(Vec<Child>);

impl Drop for Children {
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
            .expect("list the host's threads")
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
        assert!(Instant::now() < deadline, "the store host did not stop");
        std::thread::yield_now();
    }
}

/// Starts this binary as `spec`, forwarding the lines of its stdout that start with one of
/// our markers to `tx` tagged with `who`.
fn spawn(spec: &str, who: usize, tx: &mpsc::Sender<(usize, String)>) -> (Child, ChildStdin) {
    let exe = std::env::current_exe().expect("test binary path");
    let mut child = Command::new(exe)
        .args([
            "--ignored",
            "--exact",
            "child",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("DIST_STOPPED_STORE", spec)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn child");
    let stdin = child.stdin.take().expect("piped stdin");
    let out = BufReader::new(child.stdout.take().expect("piped stdout"));
    let tx = tx.clone();
    std::thread::spawn(move || {
        // The harness may print "test child ... " on the same line before ours.
        for line in out.lines().map_while(Result::ok) {
            for marker in ["PORT ", "READY", "DONE "] {
                if let Some(at) = line.find(marker) {
                    let _ = tx.send((who, line[at..].to_string()));
                    break;
                }
            }
        }
    });
    (child, stdin)
}

/// Runs `scenario` on every rank with the store host stopped; returns each rank that went with
/// its time and outcome (`ok` or `err <message>`), and the store's address.
fn run(scenario: &str) -> (Vec<(usize, Duration, String)>, String) {
    run_with(scenario, &[0, 1], None)
}

/// Runs `scenario` on the ranks `goers` only (the others stay ready, and are killed at the
/// end). With `stop_after`, the host is stopped midway: once the key (as the ranks name it)
/// exists, i.e. once the goers are past their first store write and into the waits that
/// follow it, which the parent sees through a store client of its own.
fn run_with(
    scenario: &str,
    goers: &[usize],
    stop_after: Option<&str>,
) -> (Vec<(usize, Duration, String)>, String) {
    let (tx, rx) = mpsc::channel();
    let generous = Duration::from_secs(60);
    let (host, _host_in) = spawn("host", WORLD, &tx);
    let mut children = Children(vec![host]);
    let (_, line) = rx
        .recv_timeout(generous)
        .expect("the host reports its port");
    let port: u16 = line["PORT ".len()..].trim().parse().expect("port");
    let mut inputs = Vec::new();
    for rank in 0..WORLD {
        let (c, stdin) = spawn(&format!("{scenario},{rank},{port}"), rank, &tx);
        children.0.push(c);
        inputs.push(stdin);
    }
    for _ in 0..WORLD {
        let (rank, line) = rx.recv_timeout(generous).expect("every rank gets ready");
        assert_eq!(line, "READY", "rank {rank}");
    }
    if stop_after.is_none() {
        signal(&children.0[0], libc::SIGSTOP);
        wait_stopped(&children.0[0]);
    }
    for &rank in goers {
        writeln!(inputs[rank], "go").expect("tell a rank to go");
    }
    if let Some(key) = stop_after {
        let watcher = TcpStore::connect("127.0.0.1", port, generous).expect("watcher");
        watcher
            .wait(&[key], generous)
            .expect("the goers write their key");
        signal(&children.0[0], libc::SIGSTOP);
        wait_stopped(&children.0[0]);
    }
    let mut results = vec![None; WORLD];
    for _ in goers {
        let (rank, line) = rx
            .recv_timeout(TIMEOUT + generous)
            .expect("every rank returns");
        let rest = line["DONE ".len()..].to_string();
        let (ms, outcome) = rest.split_once(' ').expect("DONE <ms> <outcome>");
        let took = Duration::from_millis(ms.parse().expect("ms"));
        results[rank] = Some((took, outcome.to_string()));
    }
    let results = results
        .into_iter()
        .enumerate()
        .filter_map(|(rank, r)| r.map(|(took, outcome)| (rank, took, outcome)))
        .collect();
    (results, format!("127.0.0.1:{port}"))
}

/// Every rank failed within the timeout + 1 s with an error that names the store.
fn assert_store_error(scenario: &str) {
    let (results, addr) = run(scenario);
    assert_failed_naming(scenario, &results, &[&addr]);
}

/// Every rank failed within the timeout + 1 s with an error that names the store and the
/// operation `op` (the error's context says which call of the program failed).
fn assert_store_error_naming_op(scenario: &str, op: &str) {
    let (results, addr) = run(scenario);
    assert_failed_naming(scenario, &results, &[&addr]);
    for (rank, _, outcome) in &results {
        assert!(
            outcome.contains(op),
            "{scenario}: rank {rank} should name {op:?}: {outcome}"
        );
    }
}

/// Every rank that went failed within the timeout + 1 s with an error that contains one of
/// `names` (the store's address, or a rank that never came).
fn assert_failed_naming(scenario: &str, results: &[(usize, Duration, String)], names: &[&str]) {
    for (rank, took, outcome) in results {
        eprintln!("{scenario}: rank {rank} returned after {took:?}: {outcome}");
        assert!(
            *took <= TIMEOUT + Duration::from_secs(1),
            "{scenario}: rank {rank} took {took:?}: {outcome}"
        );
        assert!(
            outcome.starts_with("err ") && names.iter().any(|n| outcome.contains(n)),
            "{scenario}: rank {rank} should fail naming one of {names:?}: {outcome}"
        );
    }
}

#[test]
fn init_fails_in_time_when_the_store_host_is_stopped() {
    assert_store_error("init");
}

#[test]
fn new_group_fails_in_time_when_the_store_host_is_stopped() {
    assert_store_error_naming_op("new_group", "new_group");
}

#[test]
fn split_fails_in_time_when_the_store_host_is_stopped() {
    assert_store_error_naming_op("split", "split");
}

#[test]
fn new_subgroups_fails_in_time_naming_it_when_the_store_host_is_stopped() {
    assert_store_error_naming_op("new_subgroups", "new_subgroups");
}

/// A mesh makes one split per dimension: together they keep one deadline (before, each had
/// its own), and the error names the mesh's creation, not an inner split.
#[test]
fn device_mesh_fails_in_time_naming_it_when_the_store_host_is_stopped() {
    assert_store_error_naming_op("mesh", "DeviceMesh::new");
}

#[test]
fn monitored_barrier_fails_in_time_when_the_store_host_is_stopped() {
    assert_store_error("monitored_barrier");
}

/// `destroy_process_group` returns nothing: every rank must leave within the timeout + 1 s.
#[test]
fn teardown_returns_in_time_when_the_store_host_is_stopped() {
    let (results, _) = run("destroy");
    for (rank, took, outcome) in &results {
        eprintln!("destroy: rank {rank} returned after {took:?}: {outcome}");
        assert!(
            *took <= TIMEOUT + Duration::from_secs(1),
            "destroy: rank {rank} took {took:?}"
        );
    }
}

/// As [`teardown_returns_in_time_when_the_store_host_is_stopped`], with the watchdog's
/// publish of a new state waiting on the stopped store as the group is destroyed: it waited
/// up to the whole timeout, and teardown joined it before its own leave (about twice the
/// timeout).
#[test]
fn teardown_returns_in_time_with_a_progress_publish_in_flight() {
    let (results, _) = run("destroy_while_publishing");
    for (rank, took, outcome) in &results {
        eprintln!("destroy_while_publishing: rank {rank} returned after {took:?}: {outcome}");
        assert!(
            *took <= TIMEOUT + Duration::from_secs(1),
            "destroy_while_publishing: rank {rank} took {took:?}"
        );
    }
}

/// A sub-group, then the world group, are torn down with the store's host stopped: every rank
/// returns within the timeout + 1 s (teardown returns nothing; its goodbye and wait share one
/// deadline).
#[test]
fn subgroup_teardown_returns_in_time_when_the_store_host_is_stopped() {
    let (results, _) = run("destroy_subgroup");
    assert_eq!(results.len(), WORLD, "every rank returns");
    for (rank, took, outcome) in &results {
        eprintln!("destroy_subgroup: rank {rank} returned after {took:?}: {outcome}");
        assert!(
            *took <= TIMEOUT + Duration::from_secs(1),
            "destroy_subgroup: rank {rank} took {took:?}"
        );
    }
}

/// Rank 0 alone splits into sub-groups; the host stops while it waits for rank 1's call. It
/// fails by the creation's deadline, naming the call.
#[test]
fn new_subgroups_alone_fails_in_time_when_the_store_host_stops_during_its_wait() {
    let (results, addr) = run_with("new_subgroups", &[0], Some("world/create/0/0"));
    assert_failed_naming("new_subgroups alone", &results, &[&addr]);
    assert!(
        results.iter().all(|(_, _, o)| o.contains("new_subgroups")),
        "{results:?}"
    );
}

/// Rank 0 alone creates a group: it publishes its call, then waits for rank 1's, and the host
/// stops during that wait. Rank 0 fails by its own deadline, not a second timeout for the
/// WAIT's cancellation nor one per rank asking who is missing.
#[test]
fn new_group_alone_fails_in_time_when_the_store_host_stops_during_its_wait() {
    let (results, addr) = run_with("new_group", &[0], Some("world/create/0/0"));
    assert_failed_naming("new_group alone", &results, &[&addr]);
}

/// Rank 1 alone enters the barrier and waits for rank 0's result; the host stops during that
/// wait. Rank 1 fails within the barrier's timeout + 1 s naming the store (before, the silent
/// store made it wait twice the timeout and then blame rank 0).
#[test]
fn monitored_barrier_waiter_fails_in_time_when_the_store_host_stops_during_its_wait() {
    let (results, addr) = run_with(
        "monitored_barrier",
        &[1],
        Some("world/monitored_barrier/0/arrived/1"),
    );
    assert_failed_naming("monitored_barrier waiter", &results, &[&addr]);
}

/// Rank 0 alone in init: the host stops once it has counted itself in. Depending on how far
/// it got, it fails on the silent store or on rank 1, which never came to connect its mesh;
/// either way in time.
#[test]
fn init_alone_fails_in_time_when_the_store_host_stops_during_its_wait() {
    let (results, addr) = run_with("init", &[0], Some("dist/world_inits"));
    assert_failed_naming("init alone", &results, &[&addr, "rank(s) [1]"]);
}
