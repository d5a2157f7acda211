//! `cargo xtask test --netns`: two hosts for real, on one machine.
//!
//! Two network namespaces joined by a veth pair with netem delay and a rate limit stand for two
//! hosts; each "host" also gets its own pid and UTS namespace (its own hostname, and no way to
//! read the other's memory), as two machines would. `distrun` node 0 runs in the first, node 1
//! in the second, 2 ranks each, so every job crosses the link and every rendezvous goes over it.
//! Checked:
//!
//! * rendezvous through the store on the other host, and every collective at 4 B, 4 KiB + 4 and
//!   1 MiB + 4 with results checked (`gloo_bench -c 1`);
//! * single-copy (shared-memory) transfers happen between ranks of one host and never across
//!   the link (each rank prints its per-peer count);
//! * a rank of the second host killed with SIGKILL mid-job: every survivor, on both hosts,
//!   fails with an error that names it.
//!
//! Needs root, `ip`, `tc` and `unshare`; without them it says why it skipped and succeeds.

use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use crate::soak::{blamed, descendants, signal};
use crate::util::{build_release, project_root};

/// Ranks per simulated host.
const PER_HOST: usize = 2;
/// The link between the hosts: a LAN-like delay and rate, so latency-bound code paths show.
const NETEM: [&str; 4] = ["delay", "1ms", "rate", "2gbit"];
/// Addresses of the hosts on the veth link.
const ADDR: [&str; 2] = ["10.213.0.1", "10.213.0.2"];
/// How long a whole job may take before it counts as hung.
const JOB_DEADLINE: Duration = Duration::from_secs(300);
/// The kill job's group timeout (the survivors see the dead rank's connections close well
/// before it).
const KILL_TIMEOUT_MS: &str = "20000";
/// The stall job's group timeout: survivors must time out within it plus a second.
const STALL_TIMEOUT_MS: &str = "3000";

/// Runs the two-host checks, or explains why it cannot here.
pub(crate) fn run_netns() -> Result<(), String> {
    if let Err(why) = preflight() {
        println!("xtask test --netns: skipped: {why}");
        return Ok(());
    }
    build_release(
        &["dist-run", "dist-gloo", "dist-collective"],
        &["gloo_bench", "soak_faults"],
    )?;
    let bin = project_root().join("target/release");
    let hosts = Hosts::create()?;
    println!(
        "==> netns: every collective across two hosts (2 x {PER_HOST} ranks, netem {NETEM:?})"
    );
    collectives(&hosts, &bin)?;
    println!("==> netns: SIGKILL of a rank on the second host");
    fault(&hosts, &bin, "KILL", KILL_TIMEOUT_MS)?;
    println!(
        "==> netns: SIGSTOP of a rank on the second host (group timeout {STALL_TIMEOUT_MS} ms)"
    );
    fault(&hosts, &bin, "STOP", STALL_TIMEOUT_MS)?;
    println!("xtask test --netns: passed");
    Ok(())
}

/// Why this machine cannot run the checks, if it cannot.
fn preflight() -> Result<(), String> {
    let uid = Command::new("id")
        .arg("-u")
        .output()
        .map_err(|e| format!("cannot run `id`: {e}"))?;
    if String::from_utf8_lossy(&uid.stdout).trim() != "0" {
        return Err("network namespaces need root".into());
    }
    for tool in ["ip", "tc", "unshare", "hostname"] {
        let found = Command::new(tool)
            .arg("-V")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok();
        if !found {
            return Err(format!("`{tool}` is not installed (iproute2, util-linux)"));
        }
    }
    // Root inside a container may still lack CAP_SYS_ADMIN, or the kernel namespaces.
    let probe = format!("dist{}probe", std::process::id());
    sh("ip", &["netns", "add", &probe])
        .map_err(|e| format!("cannot make a network namespace here: {e}"))?;
    let pid_ns = Command::new("ip")
        .args([
            "netns",
            "exec",
            &probe,
            "unshare",
            "--pid",
            "--fork",
            "--mount-proc",
            "--uts",
            "true",
        ])
        .output();
    let _ = sh("ip", &["netns", "del", &probe]);
    match pid_ns {
        Ok(o) if o.status.success() => Ok(()),
        Ok(o) => Err(format!(
            "cannot make pid and UTS namespaces here: {}",
            String::from_utf8_lossy(&o.stderr).trim()
        )),
        Err(e) => Err(format!("cannot run unshare: {e}")),
    }
}

/// Runs `ip`/`tc` and fails with its stderr.
fn sh(program: &str, args: &[&str]) -> Result<(), String> {
    let out = Command::new(program)
        .args(args)
        .output()
        .map_err(|e| format!("{program}: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "`{program} {}` failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// The two namespaces and the link between them; deleting the namespaces (on drop) removes
/// the veth pair with them.
struct Hosts {
    ns: [String; 2],
}

impl Hosts {
    fn create() -> Result<Self, String> {
        let id = std::process::id();
        let hosts = Hosts {
            ns: [format!("dist{id}a"), format!("dist{id}b")],
        };
        let veth = [format!("dv{id}a"), format!("dv{id}b")];
        for ns in &hosts.ns {
            sh("ip", &["netns", "add", ns])?;
        }
        sh(
            "ip",
            &[
                "link",
                "add",
                &veth[0],
                "netns",
                &hosts.ns[0],
                "type",
                "veth",
                "peer",
                "name",
                &veth[1],
                "netns",
                &hosts.ns[1],
            ],
        )?;
        for i in 0..2 {
            let ns = hosts.ns[i].as_str();
            let dev = veth[i].as_str();
            sh(
                "ip",
                &[
                    "-n",
                    ns,
                    "addr",
                    "add",
                    &format!("{}/24", ADDR[i]),
                    "dev",
                    dev,
                ],
            )?;
            sh("ip", &["-n", ns, "link", "set", "lo", "up"])?;
            sh("ip", &["-n", ns, "link", "set", dev, "up"])?;
            shape(ns, dev);
        }
        Ok(hosts)
    }

    /// Starts `distrun` as node `node` of a 2-node job in host `node`'s namespaces, running
    /// `prog args`. Node 0 picks the store's port (`port` None) and node 1 is given it.
    fn launch(
        &self,
        node: usize,
        port: Option<u16>,
        prog: &Path,
        args: &[&str],
        env: &[(&str, &str)],
    ) -> Result<Node, String> {
        let distrun = project_root().join("target/release/distrun");
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", &self.ns[node]])
            // A pid namespace of its own: ranks of different hosts cannot read each other's
            // memory, as on two machines. /proc is mounted anew for it, as a container does, so
            // that the pids a rank publishes (for its shared-memory segment) mean the same to the
            // ranks of its host. The shell names the host, then becomes distrun.
            .args([
                "unshare",
                "--pid",
                "--fork",
                "--kill-child",
                "--mount-proc",
                "--uts",
                "--",
            ])
            .args(["sh", "-c", "hostname \"$0\" && exec \"$@\""])
            .arg(format!("host-{node}"))
            .arg(distrun)
            .args(["--nnodes", "2", "--node-rank", &node.to_string()])
            .args(["--nproc-per-node", &PER_HOST.to_string()])
            .args(["--master-addr", ADDR[0], "--master-port"])
            .arg(port.unwrap_or(0).to_string())
            .args(["--grace-period", "30", "--"])
            .arg(prog)
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        for (k, v) in env {
            cmd.env(k, v);
        }
        let mut child = cmd
            .spawn()
            .map_err(|e| format!("starting node {node}: {e}"))?;
        let (port_tx, port_rx) = mpsc::channel();
        let stderr = child.stderr.take().ok_or("no stderr pipe")?;
        let err_reader = std::thread::spawn(move || {
            let mut all = String::new();
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                if let Some(p) = store_port(&line) {
                    let _ = port_tx.send(p);
                }
                all.push_str(&line);
                all.push('\n');
            }
            all
        });
        let mut stdout = child.stdout.take().ok_or("no stdout pipe")?;
        let out_reader = std::thread::spawn(move || {
            let mut all = String::new();
            let _ = stdout.read_to_string(&mut all);
            all
        });
        Ok(Node {
            child,
            port: port_rx,
            out: Some(out_reader),
            err: Some(err_reader),
        })
    }
}

impl Drop for Hosts {
    fn drop(&mut self) {
        for ns in &self.ns {
            if let Err(e) = sh("ip", &["netns", "del", ns]) {
                eprintln!("xtask test --netns: cleaning up: {e}");
            }
        }
    }
}

/// Puts netem's delay and rate on `dev`; a kernel without `sch_netem` (common in containers
/// and small VMs) gets a token-bucket rate limit alone, and says so.
fn shape(ns: &str, dev: &str) {
    let qdisc = |kind: &[&str]| {
        let mut args = vec![
            "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root",
        ];
        args.extend(kind);
        sh("ip", &args)
    };
    let mut netem = vec!["netem"];
    netem.extend(NETEM);
    let Err(e) = qdisc(&netem) else { return };
    println!("    note: no netem on {dev} ({e}); rate limit only (tbf 2gbit), no added delay");
    if let Err(e) = qdisc(&["tbf", "rate", "2gbit", "burst", "256kb", "latency", "50ms"]) {
        println!("    note: no rate limit on {dev} either ({e}): an unshaped veth link");
    }
}

/// The port in distrun's `... store at ADDR:PORT` line.
fn store_port(line: &str) -> Option<u16> {
    let at = line.split("store at ").nth(1)?;
    at.trim().rsplit(':').next()?.parse().ok()
}

/// One node's `distrun`, its output collected by two reader threads.
struct Node {
    child: Child,
    port: mpsc::Receiver<u16>,
    out: Option<std::thread::JoinHandle<String>>,
    err: Option<std::thread::JoinHandle<String>>,
}

/// What a finished node said and how it ended.
struct Finished {
    ok: bool,
    stdout: String,
    stderr: String,
}

impl Node {
    /// Waits until `deadline`; a node still running then is killed with everything below it.
    fn finish(mut self, deadline: Instant) -> Finished {
        let ok = loop {
            match self.child.try_wait() {
                Ok(Some(st)) => break st.success(),
                Ok(None) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(50));
                }
                _ => {
                    self.kill_tree();
                    let _ = self.child.wait();
                    break false;
                }
            }
        };
        let join = |h: Option<std::thread::JoinHandle<String>>| {
            h.and_then(|h| h.join().ok()).unwrap_or_default()
        };
        Finished {
            ok,
            stdout: join(self.out.take()),
            stderr: join(self.err.take()),
        }
    }

    fn kill_tree(&self) {
        let mut pids: Vec<String> = descendants(self.child.id())
            .iter()
            .map(u32::to_string)
            .collect();
        pids.push(self.child.id().to_string());
        signal("KILL", &pids);
    }

    /// The pid, in this (the host's) namespace, of the rank with global rank `rank` below
    /// this node: its environment says `RANK=<rank>`.
    fn rank_pid(&self, rank: usize, prog_name: &str) -> Option<u32> {
        let want = format!("RANK={rank}");
        descendants(self.child.id()).into_iter().find(|pid| {
            let cmd = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
            let env = std::fs::read(format!("/proc/{pid}/environ")).unwrap_or_default();
            String::from_utf8_lossy(&cmd).contains(prog_name)
                && env.split(|&b| b == 0).any(|kv| kv == want.as_bytes())
        })
    }
}

/// Starts both nodes of a job: node 0 first, then node 1 once node 0 has said its port.
fn launch_pair(
    hosts: &Hosts,
    prog: &Path,
    args: &[&str],
    env: &[(&str, &str)],
) -> Result<[Node; 2], String> {
    let first = hosts.launch(0, None, prog, args, env)?;
    let port = match first.port.recv_timeout(Duration::from_secs(60)) {
        Ok(p) => p,
        Err(_) => {
            let f = first.finish(Instant::now());
            return Err(format!("node 0 never said its store port:\n{}", f.stderr));
        }
    };
    let second = hosts.launch(1, Some(port), prog, args, env)?;
    Ok([first, second])
}

/// Every collective across the link, results checked, and where single-copy transfers went.
fn collectives(hosts: &Hosts, bin: &Path) -> Result<(), String> {
    let prog = bin.join("examples/gloo_bench");
    let ops = "barrier,allreduce_4B,all_reduce,broadcast,all_gather,reduce_scatter,all_to_all";
    let args = [
        "--ops",
        ops,
        "--sizes",
        "4,4100,1048580",
        "-n",
        "3",
        "-w",
        "1",
        "-c",
        "1",
    ];
    // Large messages over the rings go by reference only when a host's ranks outnumber its
    // CPUs: ask for it, so that where single-copy transfers may go is checked on any machine.
    let nodes = launch_pair(hosts, &prog, &args, &[("DIST_GLOO_CMA_OVER_SHM", "1")])?;
    let deadline = Instant::now() + JOB_DEADLINE;
    let done = nodes.map(|n| n.finish(deadline));
    for (i, f) in done.iter().enumerate() {
        if !f.ok {
            return Err(format!(
                "node {i} failed:\n{}\n{}",
                tail(&f.stdout),
                tail(&f.stderr)
            ));
        }
    }
    let world = 2 * PER_HOST;
    let mut within = [0u64; 2];
    let mut ring_lines = 0;
    for f in &done {
        for line in f.stdout.lines() {
            if let Some((rank, rings)) = per_peer_line(line, "# shared-memory rings to ranks: [") {
                // Rings exactly between the ranks of one namespace: the host id tells hosts
                // apart by network namespace, not by hostname.
                for (peer, &r) in rings.iter().enumerate() {
                    let same_host = peer / PER_HOST == rank / PER_HOST;
                    if peer != rank && (r == 1) != same_host {
                        return Err(format!(
                            "rank {rank} {} shared-memory rings with rank {peer} ({}): {line}",
                            if r == 1 { "uses" } else { "does not use" },
                            if same_host { "same host" } else { "other host" },
                        ));
                    }
                }
                ring_lines += 1;
                continue;
            }
            let Some((rank, counts)) = single_copy_line(line) else {
                continue;
            };
            if counts.len() != world || rank >= world {
                return Err(format!("unexpected single-copy line: {line}"));
            }
            for (peer, &c) in counts.iter().enumerate() {
                let same_host = peer / PER_HOST == rank / PER_HOST;
                if !same_host && c > 0 {
                    return Err(format!(
                        "rank {rank} sent {c} message(s) by reference to rank {peer} on the other host"
                    ));
                }
                if same_host {
                    within[rank / PER_HOST] += c;
                }
            }
        }
    }
    if ring_lines != world {
        return Err(format!(
            "expected a shared-memory line from each of {world} ranks, got {ring_lines}"
        ));
    }
    if within.contains(&0) {
        return Err(format!(
            "ranks of one host never shared memory (single-copy messages per host: {within:?})"
        ));
    }
    println!(
        "    ok: results checked; shared-memory rings and single-copy messages ({within:?}) within each host only"
    );
    Ok(())
}

/// `[rank R] # single-copy messages to ranks: [a, b, ...]` as (R, counts).
fn single_copy_line(line: &str) -> Option<(usize, Vec<u64>)> {
    per_peer_line(line, "# single-copy messages to ranks: [")
}

/// `[rank R] <what>a, b, ...]` as (R, [a, b, ...]).
fn per_peer_line(line: &str, what: &str) -> Option<(usize, Vec<u64>)> {
    let rest = line.strip_prefix("[rank ")?;
    let (rank, rest) = rest.split_once(']')?;
    let list = rest.trim().strip_prefix(what)?;
    let counts = list
        .trim_end_matches(']')
        .split(',')
        .map(|s| s.trim().parse().ok())
        .collect::<Option<Vec<u64>>>()?;
    Some((rank.parse().ok()?, counts))
}

/// `SIG<sig>` (KILL or STOP) to the last rank (second host) once every rank is in its loop;
/// every survivor must fail naming it, within the group timeout plus a second.
fn fault(hosts: &Hosts, bin: &Path, sig: &str, timeout_ms: &str) -> Result<(), String> {
    let dir = std::env::temp_dir().join(format!("dist-netns-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
    let dir_s = dir.display().to_string();
    let env = [
        ("SOAK_DIR", dir_s.as_str()),
        ("SOAK_TIMEOUT_MS", timeout_ms),
        ("SOAK_SECONDS", "120"),
    ];
    let prog = bin.join("examples/soak_faults");
    let scenario = if sig == "STOP" { "stall" } else { "kill" };
    let nodes = launch_pair(hosts, &prog, &[scenario], &env)?;
    let world = 2 * PER_HOST;
    let victim = world - 1;
    let result = (|| {
        let deadline = Instant::now() + Duration::from_secs(120);
        while (0..world).any(|r| !rank_file(&dir, r, "pid").exists()) {
            if Instant::now() > deadline {
                return Err("the ranks never all reached their loop".to_string());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let pid = nodes[1]
            .rank_pid(victim, "soak_faults")
            .ok_or(format!("could not find rank {victim}'s process"))?;
        let killed_at = Instant::now();
        let killed_us = now_us();
        signal(sig, &[pid.to_string()]);
        let timeout = Duration::from_millis(timeout_ms.parse().unwrap_or(20_000));
        let deadline = killed_at + timeout + Duration::from_secs(1);
        let survivors: Vec<usize> = (0..victim).collect();
        while survivors
            .iter()
            .any(|&r| !rank_file(&dir, r, "result").exists())
        {
            if Instant::now() > deadline {
                let missing: Vec<_> = survivors
                    .iter()
                    .filter(|&&r| !rank_file(&dir, r, "result").exists())
                    .collect();
                return Err(format!(
                    "survivors {missing:?} reported nothing {timeout:?} + 1 s after SIG{sig}"
                ));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let mut delays_ms = Vec::new();
        for r in survivors {
            let text = std::fs::read_to_string(rank_file(&dir, r, "result")).unwrap_or_default();
            if !blamed(&text).contains(&victim) {
                return Err(format!(
                    "rank {r}'s error does not name rank {victim}: {text}"
                ));
            }
            // The file starts with the error's wall-clock time in µs.
            let at: i128 = text
                .split_whitespace()
                .next()
                .and_then(|t| t.parse().ok())
                .unwrap_or(0);
            delays_ms.push((at - killed_us) / 1000);
        }
        println!(
            "    ok: every survivor named rank {victim}; error delays after SIG{sig} {delays_ms:?} ms"
        );
        Ok(())
    })();
    for n in &nodes {
        n.kill_tree();
    }
    for n in nodes {
        let _ = n.finish(Instant::now());
    }
    let _ = std::fs::remove_dir_all(&dir);
    result
}

fn now_us() -> i128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_micros() as i128)
        .unwrap_or(0)
}

fn rank_file(dir: &Path, rank: usize, ext: &str) -> PathBuf {
    dir.join(format!("rank{rank}.{ext}"))
}

fn tail(text: &str) -> String {
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(30)..].join("\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn distrun_and_bench_lines_parse() {
        assert_eq!(
            store_port(
                "distrun: 2 rank(s) on node 0 of 2 (world size 4), store at 10.213.0.1:4711"
            ),
            Some(4711)
        );
        assert_eq!(store_port("something else"), None);
        assert_eq!(
            single_copy_line("[rank 3] # single-copy messages to ranks: [0, 0, 12, 0]"),
            Some((3, vec![0, 0, 12, 0]))
        );
        assert_eq!(single_copy_line("[rank 3] # Avg bus bandwidth : 1.0"), None);
        assert_eq!(
            per_peer_line(
                "[rank 1] # shared-memory rings to ranks: [1, 0, 0, 1]",
                "# shared-memory rings to ranks: ["
            ),
            Some((1, vec![1, 0, 0, 1]))
        );
    }
}
