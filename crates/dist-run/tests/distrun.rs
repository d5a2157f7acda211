//! `distrun` as users run it: real processes, real signals, real ports.
//!
//! Ranks are `sh -c` scripts, or this test binary itself re-run as a worker (the `worker`
//! test, which does nothing unless `DISTRUN_TEST_WORKER` is set) that rendezvouses through
//! `dist_backend::init`'s `env://` path.

use std::collections::{BTreeMap, BTreeSet};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

const DISTRUN: &str = env!("CARGO_BIN_EXE_distrun");

fn distrun(args: &[&str]) -> Command {
    let mut c = Command::new(DISTRUN);
    c.args(args).stdin(Stdio::null());
    c
}

fn run(args: &[&str]) -> Output {
    distrun(args).output().expect("run distrun")
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// Runs this test binary's `worker` test under distrun's environment.
fn worker_cmd() -> Vec<String> {
    vec![
        std::env::current_exe().unwrap().display().to_string(),
        "worker".into(),
        "--exact".into(),
        "--nocapture".into(),
        "--test-threads=1".into(),
    ]
}

/// A rank: rendezvous through the launcher's store (`env://`), then print what it saw.
#[test]
fn worker() {
    if std::env::var_os("DISTRUN_TEST_WORKER").is_none() {
        return;
    }
    let info = dist_backend::init::init_from_url("env://", None, None, Duration::from_secs(20))
        .expect("env:// init under distrun");
    let keys: Vec<String> = (0..info.world_size).map(|r| format!("hello/{r}")).collect();
    let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
    info.store
        .set(&keys[info.rank], info.rank.to_string().as_bytes())
        .unwrap();
    info.store.wait(&refs, Duration::from_secs(20)).unwrap();
    println!(
        "RENDEZVOUS rank={} world={} launcher={} port={}",
        info.rank,
        info.world_size,
        info.launcher,
        std::env::var("MASTER_PORT").unwrap()
    );
}

#[test]
fn children_get_torchruns_environment() {
    let script = "echo ENV RANK=$RANK LOCAL_RANK=$LOCAL_RANK WORLD_SIZE=$WORLD_SIZE \
                  LOCAL_WORLD_SIZE=$LOCAL_WORLD_SIZE GROUP_RANK=$GROUP_RANK ROLE_RANK=$ROLE_RANK \
                  ROLE_WORLD_SIZE=$ROLE_WORLD_SIZE MASTER_ADDR=$MASTER_ADDR \
                  MASTER_PORT=$MASTER_PORT TORCHELASTIC_RESTART_COUNT=$TORCHELASTIC_RESTART_COUNT \
                  DIST_RESTART_COUNT=$DIST_RESTART_COUNT \
                  TORCHELASTIC_MAX_RESTARTS=$TORCHELASTIC_MAX_RESTARTS \
                  TORCHELASTIC_USE_AGENT_STORE=$TORCHELASTIC_USE_AGENT_STORE \
                  OMP_NUM_THREADS=$OMP_NUM_THREADS";
    let out = distrun(&[
        "--nproc-per-node",
        "3",
        "--max-restarts",
        "2",
        "--",
        "sh",
        "-c",
        script,
    ])
    .env_remove("OMP_NUM_THREADS")
    .output()
    .unwrap();
    assert!(out.status.success(), "{out:?}");
    let stdout = text(&out.stdout);
    let mut seen = BTreeMap::new();
    for line in stdout.lines() {
        let Some(rest) = line.split_once("ENV ").map(|(_, r)| r) else {
            continue;
        };
        let vars: BTreeMap<&str, &str> = rest
            .split_whitespace()
            .filter_map(|kv| kv.split_once('='))
            .collect();
        let rank: usize = vars["RANK"].parse().unwrap();
        assert!(line.starts_with(&format!("[rank {rank}] ENV ")), "{line}");
        assert_eq!(vars["LOCAL_RANK"], rank.to_string());
        assert_eq!(vars["ROLE_RANK"], rank.to_string());
        assert_eq!(vars["WORLD_SIZE"], "3");
        assert_eq!(vars["LOCAL_WORLD_SIZE"], "3");
        assert_eq!(vars["ROLE_WORLD_SIZE"], "3");
        assert_eq!(vars["GROUP_RANK"], "0");
        assert_eq!(vars["MASTER_ADDR"], "127.0.0.1");
        let port: u16 = vars["MASTER_PORT"].parse().unwrap();
        assert_ne!(port, 0, "the store's real port, not 0");
        assert_eq!(vars["TORCHELASTIC_RESTART_COUNT"], "0");
        assert_eq!(vars["DIST_RESTART_COUNT"], "0");
        assert_eq!(vars["TORCHELASTIC_MAX_RESTARTS"], "2");
        assert_eq!(vars["TORCHELASTIC_USE_AGENT_STORE"], "True");
        assert_eq!(vars["OMP_NUM_THREADS"], "1");
        seen.insert(rank, port);
    }
    assert_eq!(
        seen.keys().copied().collect::<Vec<_>>(),
        [0, 1, 2],
        "{stdout}"
    );
    assert_eq!(seen.values().collect::<BTreeSet<_>>().len(), 1);
    // A user's OMP_NUM_THREADS is kept.
    let out = distrun(&["--", "sh", "-c", "echo omp=$OMP_NUM_THREADS"])
        .env("OMP_NUM_THREADS", "6")
        .output()
        .unwrap();
    assert!(text(&out.stdout).contains("[rank 0] omp=6"), "{out:?}");
}

#[test]
fn output_lines_are_prefixed_by_rank() {
    let out = run(&[
        "--nproc-per-node",
        "2",
        "--",
        "sh",
        "-c",
        "echo out$RANK; echo err$RANK >&2; echo two$RANK; printf 'no newline'",
    ]);
    assert!(out.status.success(), "{out:?}");
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    for r in 0..2 {
        for l in [
            format!("out{r}"),
            format!("two{r}"),
            "no newline".to_owned(),
        ] {
            assert!(
                stdout.lines().any(|x| x == format!("[rank {r}] {l}")),
                "{l}: {stdout}"
            );
        }
        assert!(
            stderr.lines().any(|x| x == format!("[rank {r}] err{r}")),
            "{stderr}"
        );
        assert!(!stdout.contains(&format!("err{r}")), "{stdout}");
    }
    // Every line of the children carries a prefix.
    assert!(stdout.lines().all(|l| l.starts_with("[rank ")), "{stdout}");
}

#[test]
fn first_failure_stops_the_others() {
    // Rank 1's `sleep 0.2` only spaces its two lines; the others sleep far longer than the
    // test takes, so rank 1 fails first whatever the timing.
    let start = Instant::now();
    let out = run(&[
        "--nproc-per-node",
        "3",
        "--",
        "sh",
        "-c",
        "if [ $RANK = 1 ]; then echo about to fail; sleep 0.2; echo last words >&2; exit 7; fi; \
         sleep 60",
    ]);
    let took = start.elapsed();
    assert!(took < Duration::from_secs(15), "took {took:?}");
    assert_eq!(out.status.code(), Some(7), "{out:?}");
    let stderr = text(&out.stderr);
    assert!(
        stderr.contains("rank 1 failed first") && stderr.contains("exit code 7"),
        "{stderr}"
    );
    assert!(
        stderr.contains("distrun:   [rank 1] about to fail"),
        "{stderr}"
    );
    assert!(
        stderr.contains("distrun:   [rank 1] last words"),
        "{stderr}"
    );
    assert!(stderr.contains("stopped rank(s) 0, 2"), "{stderr}");
}

#[test]
fn ranks_that_ignore_sigterm_are_killed_after_the_grace_period() {
    // Rank 0 crashes only once rank 1 has said (with a file) that it ignores SIGTERM, so rank
    // 1 is stopped by the SIGKILL after the grace period, not by SIGTERM. Rank 0 gives up
    // waiting after about 20 s, which fails the time bound below rather than hanging.
    let dir = std::env::temp_dir().join(format!("distrun-test-{}-sigterm", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let start = Instant::now();
    let out = distrun(&[
        "--nproc-per-node",
        "2",
        "--grace-period",
        "0.5",
        "--",
        "sh",
        "-c",
        "if [ $RANK = 0 ]; then i=0; \
         while [ ! -e \"$TEST_DIR/trapped\" ] && [ $i -lt 2000 ]; do sleep 0.01; i=$((i+1)); done; \
         kill -SEGV $$; fi; \
         trap '' TERM; touch \"$TEST_DIR/trapped\"; sleep 60",
    ])
    .env("TEST_DIR", &dir)
    .output()
    .unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    assert!(start.elapsed() < Duration::from_secs(15));
    // A signal is reported by name, and the exit code is 128 + its number.
    assert_eq!(out.status.code(), Some(128 + 11), "{out:?}");
    let stderr = text(&out.stderr);
    assert!(stderr.contains("rank 0 failed first"), "{stderr}");
    assert!(stderr.contains("killed by SIGSEGV"), "{stderr}");
}

/// A rank killed by a signal that distrun sees end after a peer that failed because of it is
/// still named the root cause: distrun waits for the ranks still running before naming one
/// (a SIGKILLed rank can close its connections before it can be waited for). Rank 1 exits 1
/// as a peer that lost its connection would; rank 0 kills itself 50 ms after rank 1 has gone,
/// five polls after distrun can have seen rank 1 exit.
#[test]
fn a_crash_seen_after_its_peers_exit_is_still_the_root_cause() {
    let dir = std::env::temp_dir().join(format!("distrun-test-{}-settle", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let out = distrun(&[
        "--nproc-per-node",
        "2",
        "--",
        "sh",
        "-c",
        "if [ $RANK = 1 ]; then touch \"$TEST_DIR/gone\"; exit 1; fi; i=0; \
         while [ ! -e \"$TEST_DIR/gone\" ] && [ $i -lt 2000 ]; do sleep 0.01; i=$((i+1)); done; \
         sleep 0.05; kill -KILL $$",
    ])
    .env("TEST_DIR", &dir)
    .output()
    .unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    let stderr = text(&out.stderr);
    assert!(stderr.contains("rank 0 failed first"), "{stderr}");
    assert!(stderr.contains("killed by SIGKILL"), "{stderr}");
    assert_eq!(out.status.code(), Some(128 + 9), "{stderr}");
}

#[test]
fn max_restarts_restarts_the_job() {
    // Rank 1 fails on the first attempt only.
    let script = "echo attempt $DIST_RESTART_COUNT; \
                  if [ $RANK = 1 ] && [ $TORCHELASTIC_RESTART_COUNT = 0 ]; then exit 3; fi";
    let out = run(&[
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "1",
        "--",
        "sh",
        "-c",
        script,
    ]);
    assert!(out.status.success(), "{out:?}");
    let stdout = text(&out.stdout);
    assert!(stdout.contains("[rank 0] attempt 1"), "{stdout}");
    assert!(stdout.contains("[rank 1] attempt 1"), "{stdout}");
    let stderr = text(&out.stderr);
    assert!(
        stderr.contains("restarting the job (restart 1 of 1)"),
        "{stderr}"
    );
    // Without restarts the same job fails with rank 1's code.
    let out = run(&["--nproc-per-node", "2", "--", "sh", "-c", script]);
    assert_eq!(out.status.code(), Some(3), "{out:?}");
    // A rank that always fails uses up the restarts.
    let out = run(&["--max-restarts", "2", "--", "sh", "-c", "exit 5"]);
    assert_eq!(out.status.code(), Some(5), "{out:?}");
    assert!(
        text(&out.stderr).contains("giving up after 2 restart(s)"),
        "{out:?}"
    );
}

/// Ranks rendezvous through distrun's store (rank 0 as a client too), in every attempt.
fn rendezvous_lines(out: &Output) -> BTreeMap<usize, String> {
    text(&out.stdout)
        .lines()
        .filter_map(|l| {
            let rest = l.split_once("RENDEZVOUS ")?.1;
            let rank = rest.split_once("rank=")?.1.split_whitespace().next()?;
            Some((rank.parse().ok()?, rest.to_owned()))
        })
        .collect()
}

#[test]
fn port_zero_gives_concurrent_jobs_their_own_store() {
    let jobs: Vec<_> = (0..2)
        .map(|_| {
            let mut c = distrun(&["--nproc-per-node", "3", "--master-port", "0", "--"]);
            c.args(worker_cmd())
                .env("DISTRUN_TEST_WORKER", "1")
                .stdout(Stdio::piped())
                .stderr(Stdio::piped());
            c.spawn().unwrap()
        })
        .collect();
    let mut ports = BTreeSet::new();
    for j in jobs {
        let out = j.wait_with_output().unwrap();
        assert!(out.status.success(), "{out:?}");
        let seen = rendezvous_lines(&out);
        assert_eq!(seen.len(), 3, "{out:?}");
        let job_ports: BTreeSet<&str> = seen
            .values()
            .map(|l| l.rsplit_once("port=").unwrap().1)
            .collect();
        assert_eq!(job_ports.len(), 1);
        assert!(seen.values().all(|l| l.contains("launcher=torchrun")));
        ports.insert(job_ports.into_iter().next().unwrap().to_owned());
    }
    assert_eq!(ports.len(), 2, "two jobs, two ports: {ports:?}");
}

/// Runs `cmd` as a job of two nodes with two ranks each, and returns each node's output.
/// Node 0 is given `--master-port 0`, so its store takes a port no other process holds, and
/// prints it; node 1 is started with that port once node 0 has printed it.
fn two_nodes(cmd: &[String]) -> [Output; 2] {
    use std::io::{BufRead, BufReader, Read};
    let node = |rank: &str, port: &str| {
        let mut c = distrun(&[
            "--nnodes",
            "2",
            "--node-rank",
            rank,
            "--nproc-per-node",
            "2",
            "--master-port",
            port,
            "--rdzv-timeout",
            "20",
            "--",
        ]);
        c.args(cmd)
            .env("DISTRUN_TEST_WORKER", "1")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        c.spawn().unwrap()
    };
    let mut node0 = node("0", "0");
    let mut stderr0 = BufReader::new(node0.stderr.take().unwrap());
    // `distrun: 2 rank(s) on node 0 of 2 (world size 4), store at 127.0.0.1:PORT`
    let mut head = String::new();
    let port = loop {
        let mut line = String::new();
        let n = stderr0.read_line(&mut line).unwrap();
        assert_ne!(n, 0, "node 0 ended before naming its store's port: {head}");
        head.push_str(&line);
        if let Some((_, at)) = line.split_once("store at ") {
            break at.trim().rsplit_once(':').unwrap().1.to_owned();
        }
    };
    assert_ne!(port, "0", "{head}");
    let rest0 = std::thread::spawn(move || {
        let mut rest = String::new();
        stderr0.read_to_string(&mut rest).unwrap();
        rest
    });
    let node1 = std::thread::spawn({
        let node1 = node("1", &port);
        move || node1.wait_with_output().unwrap()
    });
    let mut out0 = node0.wait_with_output().unwrap();
    out0.stderr = (head + &rest0.join().unwrap()).into_bytes();
    [out0, node1.join().unwrap()]
}

#[test]
fn two_nodes_rendezvous_and_share_a_failure() {
    let mut all = BTreeMap::new();
    for out in two_nodes(&worker_cmd()) {
        assert!(out.status.success(), "{out:?}");
        all.extend(rendezvous_lines(&out));
    }
    assert_eq!(all.keys().copied().collect::<Vec<_>>(), [0, 1, 2, 3]);
    assert!(all.values().all(|l| l.contains("world=4")), "{all:?}");

    // Rank 3 (node 1) fails: node 0's ranks are stopped too, and both exit with its code;
    // node 0 prints the error rank 3 wrote to its error file.
    let sh = |s: &str| vec!["sh".to_owned(), "-c".to_owned(), s.to_owned()];
    let script = r#"if [ $RANK = 3 ]; then
            printf '{"message": "no data shard for rank 3"}' > "$TORCHELASTIC_ERROR_FILE"
            exit 4
        fi
        sleep 60"#;
    let start = Instant::now();
    let outs = two_nodes(&sh(script));
    assert!(start.elapsed() < Duration::from_secs(15));
    for out in &outs {
        assert_eq!(out.status.code(), Some(4), "{out:?}");
    }
    assert!(
        text(&outs[0].stderr).contains(
            "rank 3 (node 1, local rank 1) failed: exit code 4: no data shard for rank 3"
        ),
        "{}",
        text(&outs[0].stderr)
    );
}

#[test]
fn sigterm_to_distrun_stops_every_rank() {
    use std::io::{BufRead, BufReader};
    let mut job = distrun(&[
        "--nproc-per-node",
        "2",
        "--",
        "sh",
        "-c",
        "echo pid $$; sleep 60",
    ])
    .stdout(Stdio::piped())
    .stderr(Stdio::piped())
    .spawn()
    .unwrap();
    let mut lines = BufReader::new(job.stdout.take().unwrap()).lines();
    let mut pids = Vec::new();
    while pids.len() < 2 {
        let l = lines.next().expect("a line").unwrap();
        pids.push(l.rsplit_once(' ').unwrap().1.to_owned());
    }
    let start = Instant::now();
    let killed = Command::new("kill")
        .args(["-TERM", &job.id().to_string()])
        .status()
        .unwrap();
    assert!(killed.success());
    let status = job.wait().unwrap();
    assert!(start.elapsed() < Duration::from_secs(10));
    assert_eq!(status.code(), Some(128 + 15));
    for p in pids {
        // Reaped by distrun: gone, not a zombie.
        assert!(
            !std::path::Path::new(&format!("/proc/{p}")).exists(),
            "rank process {p} survived"
        );
    }
}

/// `nohup distrun ...`: SIGHUP was ignored when distrun started, so the hang-up at logout
/// stops neither distrun nor its ranks, which inherit the ignoring. Each rank hangs up on
/// distrun and on itself, then finishes a second later: a distrun that caught the signal
/// would have stopped them by then and exited 129.
#[test]
fn a_job_started_under_nohup_outlives_sighup() {
    let out = Command::new("nohup")
        .arg(DISTRUN)
        .args([
            "--nproc-per-node",
            "2",
            "--",
            "sh",
            "-c",
            "kill -HUP $PPID; kill -HUP $$; sleep 1; echo done",
        ])
        .stdin(Stdio::null())
        .output()
        .expect("run nohup distrun");
    let stdout = text(&out.stdout);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{stdout}\n{}",
        text(&out.stderr)
    );
    for r in 0..2 {
        assert!(stdout.contains(&format!("[rank {r}] done")), "{stdout}");
    }
}

/// A progress bar (`\r` redraws, no line end until it closes) reaches the terminal as it is
/// drawn, not when its line ends: the rank waits for the test to have seen its first redraw
/// (up to 30 s) before it ends the line.
#[test]
fn a_progress_bar_is_shown_before_its_line_ends() {
    use std::io::Read;
    let dir = std::env::temp_dir().join(format!("distrun-bar-{}", std::process::id()));
    let _ = std::fs::remove_file(&dir);
    let seen = dir.display().to_string();
    let script = format!(
        "printf 'step1\\r'; i=0; while [ ! -e {seen} ] && [ $i -lt 300 ]; do sleep 0.1; \
         i=$((i+1)); done; if [ -e {seen} ]; then echo found; else echo timeout; fi"
    );
    let mut job = distrun(&["--nproc-per-node", "1", "--", "sh", "-c", &script])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdout = job.stdout.take().unwrap();
    let mut got = Vec::new();
    let mut buf = [0u8; 256];
    while !String::from_utf8_lossy(&got).contains("step1") {
        let n = stdout.read(&mut buf).unwrap();
        assert!(n > 0, "output ended before the bar: {}", text(&got));
        got.extend_from_slice(&buf[..n]);
    }
    std::fs::write(&dir, b"").unwrap();
    stdout.read_to_end(&mut got).unwrap();
    let status = job.wait().unwrap();
    let _ = std::fs::remove_file(&dir);
    let got = text(&got);
    assert!(status.success(), "{got}");
    assert!(got.starts_with("[rank 0] step1\r"), "{got:?}");
    assert!(got.contains("[rank 0] found\n"), "{got:?}");
}

/// A SIGINT that arrives while a failed attempt's ranks are being stopped ends the job: no
/// restart, whose ranks the signal would stop as they start. Rank 1 says (a line) when
/// distrun's SIGTERM has reached it, that is, during the grace period; then distrun is
/// interrupted.
#[test]
fn a_signal_during_the_grace_period_stops_the_restarts() {
    use std::io::{BufRead, BufReader};
    let dir = std::env::temp_dir().join(format!("distrun-test-{}-graceint", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut job = distrun(&[
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "2",
        // Long enough that the SIGINT surely comes within it; the job then takes that long.
        "--grace-period",
        "10",
        "--",
        "sh",
        "-c",
        "if [ $RANK = 0 ]; then i=0; \
         while [ ! -e \"$TEST_DIR/trapped\" ] && [ $i -lt 2000 ]; do sleep 0.01; i=$((i+1)); done; \
         exit 3; fi; \
         trap 'echo term' TERM; touch \"$TEST_DIR/trapped\"; while :; do sleep 0.1; done",
    ])
    .env("TEST_DIR", &dir)
    .stdout(Stdio::piped())
    .stderr(Stdio::piped())
    .spawn()
    .unwrap();
    let mut lines = BufReader::new(job.stdout.take().unwrap()).lines();
    loop {
        let l = lines.next().expect("rank 1 says it got SIGTERM").unwrap();
        if l == "[rank 1] term" {
            break;
        }
    }
    let sent = Command::new("kill")
        .args(["-INT", &job.id().to_string()])
        .status()
        .unwrap();
    assert!(sent.success());
    let out = job.wait_with_output().unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(128 + 2), "{stderr}");
    assert!(!stderr.contains("restarting the job"), "{stderr}");
    assert!(stderr.contains("received SIGINT"), "{stderr}");
}

/// Node `rank` of a two-node job of one rank each, running `script` under `sh -c`, its
/// output piped; `port` is node 0's store port (`"0"` for node 0 itself: a port of its own).
fn one_rank_node(rank: &str, port: &str, script: &str) -> std::process::Child {
    one_rank_node_of("2", "20", rank, port, script)
}

/// [`one_rank_node`] of a job of `nnodes` nodes whose rendezvous timeout is `timeout`
/// seconds.
fn one_rank_node_of(
    nnodes: &str,
    timeout: &str,
    rank: &str,
    port: &str,
    script: &str,
) -> std::process::Child {
    distrun(&[
        "--nnodes",
        nnodes,
        "--node-rank",
        rank,
        "--nproc-per-node",
        "1",
        "--master-port",
        port,
        "--rdzv-timeout",
        timeout,
        "--",
        "sh",
        "-c",
        script,
    ])
    .stdout(Stdio::piped())
    .stderr(Stdio::piped())
    .spawn()
    .unwrap()
}

/// The port node 0 prints for its store, and a thread draining the rest of its stderr (so
/// that it never blocks on a full pipe), which returns what it read.
fn store_port(node0: &mut std::process::Child) -> (String, std::thread::JoinHandle<String>) {
    // A mark no line holds.
    let (port, drain) = store_port_until(node0, "\0");
    (port, drain.rest)
}

/// `child`'s exit status once it ends by itself, or `None` after a minute, far past what
/// the tests need, when it is killed: a regression fails the test instead of hanging it.
fn ends_by_itself(child: &mut std::process::Child) -> Option<std::process::ExitStatus> {
    let start = Instant::now();
    loop {
        if let Some(s) = child.try_wait().unwrap() {
            return Some(s);
        }
        if start.elapsed() > Duration::from_secs(60) {
            let _ = child.kill();
            let _ = child.wait();
            return None;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The first line node `node`'s rank prints.
fn first_rank_line(node: &mut std::process::Child) -> String {
    use std::io::{BufRead, BufReader};
    let mut lines = BufReader::new(node.stdout.take().unwrap()).lines();
    lines.next().expect("the rank starts").unwrap()
}

/// Node 1's `distrun` is interrupted while both nodes' ranks run: it reports the failure and
/// counts itself finished on its way out, so node 0 stops its ranks and ends with node 1's
/// code. Before, node 0 waited for node 1 to finish the attempt forever.
#[test]
fn a_node_interrupted_mid_job_ends_the_other_node_too() {
    let script = "echo up; sleep 60";
    let mut node0 = one_rank_node("0", "0", script);
    let (port, drain) = store_port(&mut node0);
    let mut node1 = one_rank_node("1", &port, script);
    // Once node 1's rank runs, both nodes are past the rendezvous.
    assert!(first_rank_line(&mut node1).ends_with("up"));
    let killed = Command::new("kill")
        .args(["-TERM", &node1.id().to_string()])
        .status()
        .unwrap();
    assert!(killed.success());
    assert_eq!(node1.wait().unwrap().code(), Some(128 + 15));
    let status = ends_by_itself(&mut node0);
    let err0 = drain.join().unwrap();
    let status = status.unwrap_or_else(|| panic!("node 0 never ended: {err0}"));
    assert_eq!(status.code(), Some(128 + 15), "{err0}");
    assert!(err0.contains("node 1 was interrupted by SIGTERM"), "{err0}");
}

/// Node 0's `distrun` (the job's store) dies mid-job: node 1 stops its ranks as on any
/// failure, their process groups included, before it returns the store's error. Before, it
/// returned at once and left its ranks to the parent-death signal, which reaches a rank but
/// not what the rank started (here a `sleep`, which outlived the job).
#[test]
fn a_node_whose_store_died_stops_its_ranks_and_what_they_started() {
    let script = "sleep 60 & echo child $!; wait";
    let mut node0 = one_rank_node("0", "0", script);
    let (port, _drain) = store_port(&mut node0);
    let mut node1 = one_rank_node("1", &port, script);
    let line = first_rank_line(&mut node1);
    let sleeper = line.rsplit_once(' ').unwrap().1.to_owned();
    node0.kill().unwrap();
    node0.wait().unwrap();
    // Node 1 ends by itself: its poll of the store fails.
    let status = ends_by_itself(&mut node1).expect("node 1 never ended");
    assert!(!status.success(), "{status:?}");
    // The sleep the rank started is gone (reaped by init once killed; allow it a moment).
    let gone = |pid: &str| {
        std::fs::read_to_string(format!("/proc/{pid}/stat")).map_or(true, |s| {
            s.rsplit_once(") ").is_some_and(|(_, r)| r.starts_with('Z'))
        })
    };
    let start = Instant::now();
    while !gone(&sleeper) && start.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(
        gone(&sleeper),
        "the rank's child {sleeper} outlived node 1's distrun"
    );
}

/// Ctrl-C while a node is still trying to reach node 0's store stops it at once, not after
/// the rendezvous timeout. Node 0's "store" here is a listener that never answers (bound and
/// kept, so no other process can take its port).
#[test]
fn a_node_waiting_for_node_0_stops_on_sigint() {
    use std::io::Read;
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = silent.local_addr().unwrap().port().to_string();
    let mut node1 = distrun(&[
        "--nnodes",
        "2",
        "--node-rank",
        "1",
        "--nproc-per-node",
        "1",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        &port,
        "--rdzv-timeout",
        "120",
        "--",
        "true",
    ])
    .stdout(Stdio::null())
    .stderr(Stdio::piped())
    .spawn()
    .unwrap();
    // Once it has connected, its attempts are under way (the listener's backlog takes them).
    let _first = silent.accept().unwrap();
    let start = Instant::now();
    let sent = Command::new("kill")
        .args(["-INT", &node1.id().to_string()])
        .status()
        .unwrap();
    assert!(sent.success());
    let status = ends_by_itself(&mut node1).expect("node 1 ignored SIGINT for a minute");
    let mut err = String::new();
    node1
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut err)
        .unwrap();
    assert!(!status.success(), "{err}");
    assert!(
        start.elapsed() < Duration::from_secs(20),
        "{:?}: {err}",
        start.elapsed()
    );
    assert!(err.contains("interrupted by SIGINT"), "{err}");
}

/// Three nodes. Node 0's rank ends well, so node 0 waits for the others. Then node 2's host
/// "dies" (its `distrun` is killed with SIGKILL, so it never counts itself finished, and its
/// rank goes with it), and only then does node 1's rank fail. Node 0 hears of the failure
/// while it waits and ends with that code within the rendezvous timeout and grace period.
/// Before, it looked for a failure only as its wait began, and waited for node 2 forever.
#[test]
fn a_failure_reported_while_a_node_waits_bounds_its_wait_for_a_dead_node() {
    use std::io::{BufRead, BufReader};
    let go = std::env::temp_dir().join(format!("distrun-test-{}-late-failure", std::process::id()));
    let _ = std::fs::remove_file(&go);
    // Bounded, so that a test that fails before creating `go` leaves no rank behind.
    let fail_on_go = format!(
        "echo up; i=0; while [ ! -e '{}' ] && [ $i -lt 1200 ]; do sleep 0.05; i=$((i+1)); \
         done; exit 3",
        go.display()
    );
    let mut nodes = Killed(vec![one_rank_node_of("3", "10", "0", "0", "exit 0")]);
    let (port, drain) = store_port_until(&mut nodes.0[0], "ranks ended well; waiting");
    nodes
        .0
        .push(one_rank_node_of("3", "10", "1", &port, &fail_on_go));
    // `exec`: the rank is the sleep itself, which the parent-death signal then reaches.
    nodes.0.push(one_rank_node_of(
        "3",
        "10",
        "2",
        &port,
        "echo up; exec sleep 60",
    ));
    assert!(first_rank_line(&mut nodes.0[1]).ends_with("up"));
    let mut lines2 = BufReader::new(nodes.0[2].stdout.take().unwrap()).lines();
    assert!(
        lines2
            .next()
            .expect("node 2's rank starts")
            .unwrap()
            .ends_with("up")
    );
    // Node 0 is in its wait for the other nodes.
    let waiting = drain.waited.recv_timeout(Duration::from_secs(60));
    assert!(waiting.is_ok(), "node 0 never said it waits");
    nodes.0[2].kill().unwrap();
    nodes.0[2].wait().unwrap();
    std::fs::write(&go, b"").unwrap();
    let status0 = ends_by_itself(&mut nodes.0[0]);
    let status1 = ends_by_itself(&mut nodes.0[1]);
    let _ = std::fs::remove_file(&go);
    let err0 = drain.rest.join().unwrap();
    let status0 = status0.unwrap_or_else(|| panic!("node 0 never ended: {err0}"));
    assert_eq!(status0.code(), Some(3), "{err0}");
    assert!(err0.contains("not every node ended attempt 0"), "{err0}");
    assert!(
        err0.contains("rank 1 (node 1, local rank 0) failed"),
        "{err0}"
    );
    assert_eq!(status1.expect("node 1 never ended").code(), Some(3));
}

/// Child processes killed (if still running) and reaped when the test ends, however it ends.
struct Killed(Vec<std::process::Child>);

impl Drop for Killed {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// What [`store_port_until`] leaves reading node 0's stderr.
struct Drain {
    /// Sent once when the line marked went by.
    waited: std::sync::mpsc::Receiver<()>,
    /// Everything read after the port, once stderr closes.
    rest: std::thread::JoinHandle<String>,
}

/// [`store_port`], whose drain also says when a line containing `mark` went by.
fn store_port_until(node0: &mut std::process::Child, mark: &'static str) -> (String, Drain) {
    use std::io::{BufRead, BufReader};
    let mut stderr0 = BufReader::new(node0.stderr.take().unwrap());
    let port = loop {
        let mut line = String::new();
        let n = stderr0.read_line(&mut line).unwrap();
        assert_ne!(n, 0, "node 0 ended early");
        if let Some((_, at)) = line.split_once("store at ") {
            break at.trim().rsplit_once(':').unwrap().1.to_owned();
        }
    };
    let (tx, waited) = std::sync::mpsc::channel();
    let rest = std::thread::spawn(move || {
        let mut rest = String::new();
        for line in stderr0.lines().map_while(Result::ok) {
            if line.contains(mark) {
                let _ = tx.send(());
            }
            rest.push_str(&line);
            rest.push('\n');
        }
        rest
    });
    (port, Drain { waited, rest })
}

/// Reads `node`'s stderr until a line containing `mark` and returns what it read; a thread
/// drains the rest (so that the node never blocks on a full pipe) and returns it.
fn stderr_until(
    node: &mut std::process::Child,
    mark: &str,
) -> (String, std::thread::JoinHandle<String>) {
    use std::io::{BufRead, BufReader, Read};
    let mut err = BufReader::new(node.stderr.take().unwrap());
    let mut seen = String::new();
    while !seen.lines().any(|l| l.contains(mark)) {
        let n = err.read_line(&mut seen).unwrap();
        assert_ne!(n, 0, "the node ended before it said {mark:?}: {seen}");
    }
    let rest = std::thread::spawn(move || {
        let mut rest = String::new();
        let _ = err.read_to_string(&mut rest);
        rest
    });
    (seen, rest)
}

/// Sends SIGTERM to `node` (as `kill` does from a shell) and returns its exit status, as
/// [`ends_by_itself`] does.
fn sigterm_and_wait(node: &mut std::process::Child) -> Option<std::process::ExitStatus> {
    let sent = Command::new("kill")
        .args(["-TERM", &node.id().to_string()])
        .status()
        .unwrap();
    assert!(sent.success());
    ends_by_itself(node)
}

/// Node 1's `distrun` is interrupted while it waits for node 0 to end the attempt (its own
/// rank ended well): it exits with `128 + signal`, and tells node 0, which stops its rank and
/// ends with that code. Before, node 1 exited with 1 and node 0's rank ran on.
#[test]
fn a_node_interrupted_while_it_waits_for_the_others_to_end_exits_with_the_signal() {
    let mut nodes = Killed(vec![one_rank_node("0", "0", "echo up; exec sleep 60")]);
    let (port, drain) = store_port(&mut nodes.0[0]);
    nodes.0.push(one_rank_node("1", &port, "exit 0"));
    assert!(first_rank_line(&mut nodes.0[0]).ends_with("up"));
    let (_, rest1) = stderr_until(&mut nodes.0[1], "ranks ended well; waiting");
    let status1 = sigterm_and_wait(&mut nodes.0[1]);
    let err1 = rest1.join().unwrap();
    assert_eq!(status1.and_then(|s| s.code()), Some(128 + 15), "{err1}");
    assert!(err1.contains("interrupted by SIGTERM"), "{err1}");
    let status0 = ends_by_itself(&mut nodes.0[0]);
    let err0 = drain.join().unwrap();
    assert_eq!(status0.and_then(|s| s.code()), Some(128 + 15), "{err0}");
    assert!(
        err0.contains("node 1 was interrupted by SIGTERM while it waited for the other nodes"),
        "{err0}"
    );
}

/// Node 1's `distrun` is interrupted while it waits for a third node to join: it exits with
/// `128 + signal` and takes its arrival back, so that node 1 started again and node 2 make
/// a job that ends well. Before, it exited with 1 (and a node that left marked would have
/// been counted by the others as present).
#[test]
fn a_node_interrupted_while_joining_exits_with_the_signal_and_can_join_again() {
    use dist_backend::Store;
    use dist_backend::store::TcpStore;
    let mut nodes = Killed(vec![one_rank_node_of("3", "120", "0", "0", "exit 0")]);
    let (port, drain) = store_port(&mut nodes.0[0]);
    nodes
        .0
        .push(one_rank_node_of("3", "120", "1", &port, "exit 0"));
    let observer = TcpStore::connect(
        "127.0.0.1",
        port.parse().expect("port"),
        Duration::from_secs(30),
    )
    .expect("the test's client of node 0's store");
    let mark = "distrun/attempt_0/joined/1";
    let started = Instant::now();
    while !observer.check(&[mark]).expect("read the arrivals") {
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "node 1 never joined"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    let status1 = sigterm_and_wait(&mut nodes.0[1]);
    let mut err1 = String::new();
    std::io::Read::read_to_string(&mut nodes.0[1].stderr.take().unwrap(), &mut err1).unwrap();
    assert_eq!(status1.and_then(|s| s.code()), Some(128 + 15), "{err1}");
    assert!(err1.contains("interrupted by SIGTERM"), "{err1}");
    assert!(
        !observer.check(&[mark]).unwrap(),
        "node 1's arrival is still marked"
    );
    // Node 1 again, and node 2: the job runs and ends well on every node.
    nodes
        .0
        .push(one_rank_node_of("3", "120", "1", &port, "exit 0"));
    nodes
        .0
        .push(one_rank_node_of("3", "120", "2", &port, "exit 0"));
    for i in [2, 3] {
        let status = ends_by_itself(&mut nodes.0[i]);
        assert_eq!(status.and_then(|s| s.code()), Some(0), "node {}", i - 1);
    }
    let status0 = ends_by_itself(&mut nodes.0[0]);
    let err0 = drain.join().unwrap();
    assert_eq!(status0.and_then(|s| s.code()), Some(0), "{err0}");
}
