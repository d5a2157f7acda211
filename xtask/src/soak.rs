//! `cargo xtask soak`: runs the README's main job many times, then injects faults into a job
//! of collectives, and prints how often everything behaved as promised (a markdown table whose
//! numbers can be quoted).
//!
//! Every job is launched through `distrun`, which picks the store's port and serves the store
//! itself. The fault scenarios run `crates/dist-collective/examples/soak_faults.rs` as the
//! ranks; each rank writes its pid once it is inside its loop of collectives, and the time and
//! text of its first error when it gets one (see that file). The rank program ignores SIGTERM
//! and `distrun` gets a long `--grace-period`, so the survivors of a fault live long enough to
//! report although `distrun` tries to stop them as soon as one rank fails. The harness takes
//! the wall-clock time just before it sends a fault (the ranks run on this host, so their
//! clocks are the same clock) and computes the delays from those files.
//!
//! Signals go through the `kill` command (this crate uses std only); the fault time is taken
//! before it is spawned, so delays include its start-up (a few ms), never the other way round.

use std::fs::File;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use crate::util::{build_release, project_root};

pub(crate) const HELP: &str = "\
cargo xtask soak [FLAGS]

Soak and fault-injection runs; prints a markdown table and exits non-zero if anything failed.

  main           the README's main job, `distrun --nproc-per-node 4 -- ddp-train`, --runs times
                 (a run fails on a non-zero exit, hangs past --hang-limit)
  kill           SIGKILL of a random rank (rank 0 included) at a random moment while every rank
                 is in a loop of collectives (256 KiB all_reduce + broadcast), default timeout:
                 every survivor must error within 1 s, naming the dead rank
  stall          SIGSTOP of a random rank, group timeout --stall-timeout: every survivor must
                 error within timeout + 1 s, naming the stalled rank
  mismatch       ranks 0 and 1 call a different collective (count, op or root) than ranks 2..:
                 every rank must error (never hang, never return Ok), saying mismatch and naming
                 a rank it disagrees with (`met rank N`)
  store-garbage  random bytes and huge length prefixes sent to the rendezvous store from
                 several connections while the job runs: the job must exit 0

FLAGS:
    --runs N              main-job runs, default 50
    --exit-runs N         runs of the exit scenario, default 100
    --fault-runs M        runs of each fault scenario, default 20
    --world-size N        ranks of the fault scenarios, default 4 (at least 3)
    --seed S              seed of the random choices (default: from the clock; printed)
    --hang-limit SECS     a main-job run past this is killed and counted as a hang, default 180
    --stall-timeout SECS  the group timeout of the stall scenario, default 3
    --only LIST           comma-separated subset of: main,exit,kill,stall,mismatch,store-garbage
";

const SCENARIOS: [&str; 6] = ["main", "exit", "kill", "stall", "mismatch", "store-garbage"];

/// Lines of output kept for a failed run.
const TAIL_LINES: usize = 20;
/// Failed runs whose details are printed per scenario.
const SHOWN_FAILURES: usize = 3;
/// How long the ranks of a fault scenario may take to start and enter their loop.
const START_LIMIT: Duration = Duration::from_secs(60);
/// How long a fault run may go on after the fault before it counts as a hang.
const FAULT_LIMIT: Duration = Duration::from_secs(20);
/// How long `distrun` may take to exit once every rank that should report has reported.
const EXIT_LIMIT: Duration = Duration::from_secs(20);
/// The grace period `distrun` gives ranks after a failure (they ignore its SIGTERM).
const GRACE: &str = "60";
/// How long the store-garbage job runs its loop.
const GARBAGE_JOB_SECS: u64 = 4;
/// Polling period of files and children.
const POLL: Duration = Duration::from_millis(5);

#[derive(Debug)]
struct Flags {
    runs: usize,
    exit_runs: usize,
    fault_runs: usize,
    world_size: usize,
    seed: u64,
    hang_limit: Duration,
    stall_timeout: Duration,
    only: Vec<String>,
}

fn parse(args: &[String]) -> Result<Flags, String> {
    let mut fl = Flags {
        runs: 50,
        exit_runs: 100,
        fault_runs: 20,
        world_size: 4,
        seed: 0,
        hang_limit: Duration::from_secs(180),
        stall_timeout: Duration::from_secs(3),
        only: SCENARIOS.iter().map(|s| s.to_string()).collect(),
    };
    let mut seed = None;
    let mut it = args.iter();
    while let Some(flag) = it.next() {
        let mut val = || {
            it.next()
                .cloned()
                .ok_or_else(|| format!("{flag} needs a value"))
        };
        let num = |v: String| -> Result<u64, String> {
            v.parse::<u64>()
                .map_err(|_| format!("{flag} {v}: not a number"))
        };
        match flag.as_str() {
            "--runs" => fl.runs = num(val()?)? as usize,
            "--exit-runs" => fl.exit_runs = num(val()?)? as usize,
            "--fault-runs" => fl.fault_runs = num(val()?)? as usize,
            "--world-size" => fl.world_size = num(val()?)? as usize,
            "--seed" => seed = Some(num(val()?)?),
            "--hang-limit" => fl.hang_limit = Duration::from_secs(num(val()?)?),
            "--stall-timeout" => fl.stall_timeout = Duration::from_secs(num(val()?)?),
            "--only" => {
                fl.only = val()?.split(',').map(str::to_string).collect();
                if let Some(bad) = fl.only.iter().find(|s| !SCENARIOS.contains(&s.as_str())) {
                    return Err(format!(
                        "--only {bad}: expected one of {}",
                        SCENARIOS.join(", ")
                    ));
                }
            }
            other => return Err(format!("unknown flag `{other}`\n\n{HELP}")),
        }
    }
    if fl.world_size < 3 {
        return Err("--world-size: at least 3 (mismatch needs ranks 0, 1 and another)".into());
    }
    if fl.hang_limit.is_zero() || fl.stall_timeout.is_zero() {
        return Err("--hang-limit and --stall-timeout must be at least 1 s".into());
    }
    fl.seed = seed.unwrap_or_else(|| {
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(1)
    });
    Ok(fl)
}

/// xorshift64*: enough randomness to pick ranks, moments and garbage, reproducible by seed.
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Self {
        // Never zero (xorshift's fixed point), and distinct seeds give distinct streams.
        Rng((seed ^ 0x9E37_79B9_7F4A_7C15) | 1)
    }

    fn next_u64(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// Uniform in `0..n` (`n > 0`; the modulo bias is negligible for our small `n`).
    fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n.max(1)
    }

    fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.next_u64() as u8).collect()
    }
}

fn now_us() -> i128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_micros() as i128)
        .unwrap_or(0)
}

/// Sends `sig` (`KILL`, `STOP`, `CONT`) to `targets` (pids, or `-pgid`) with the `kill`
/// command; errors (a process already gone) are ignored.
pub(crate) fn signal(sig: &str, targets: &[String]) {
    if targets.is_empty() {
        return;
    }
    let _ = Command::new("kill")
        .arg(format!("-{sig}"))
        .arg("--")
        .args(targets)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status();
}

/// The parent pid of `pid`, from `/proc/<pid>/stat`.
fn ppid(pid: u32) -> Option<u32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // `pid (comm) state ppid ...`; comm may contain spaces and parentheses.
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_whitespace().nth(1)?.parse().ok()
}

/// Every live descendant of `root` (children first found, then theirs).
pub(crate) fn descendants(root: u32) -> Vec<u32> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return vec![];
    };
    let pids: Vec<(u32, u32)> = dir
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter_map(|p| Some((p, ppid(p)?)))
        .collect();
    let mut out = vec![];
    let mut frontier = vec![root];
    while let Some(p) = frontier.pop() {
        for &(child, parent) in &pids {
            if parent == p && !out.contains(&child) {
                out.push(child);
                frontier.push(child);
            }
        }
    }
    out
}

/// One launched job: `distrun` (leading its own process group) and the directory its ranks
/// report into.
struct Job {
    child: Child,
    dir: PathBuf,
    log: PathBuf,
    started: Instant,
    status: Option<ExitStatus>,
}

impl Job {
    fn launch(
        distrun: &Path,
        n: usize,
        dir: &Path,
        prog: &[String],
        env: &[(&str, String)],
    ) -> Result<Job, String> {
        std::fs::create_dir_all(dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
        let log = dir.join("output.log");
        let out = File::create(&log).map_err(|e| format!("creating {}: {e}", log.display()))?;
        let err = out.try_clone().map_err(|e| e.to_string())?;
        let mut cmd = Command::new(distrun);
        cmd.args([
            "--nproc-per-node",
            &n.to_string(),
            "--grace-period",
            GRACE,
            "--",
        ])
        .args(prog)
        .env("SOAK_DIR", dir)
        .stdin(Stdio::null())
        .stdout(out)
        .stderr(err)
        .process_group(0);
        for (k, v) in env {
            cmd.env(k, v);
        }
        let child = cmd
            .spawn()
            .map_err(|e| format!("starting {}: {e}", distrun.display()))?;
        Ok(Job {
            child,
            dir: dir.to_path_buf(),
            log,
            started: Instant::now(),
            status: None,
        })
    }

    /// Whether `distrun` has exited (and its status is recorded).
    fn exited(&mut self) -> bool {
        if self.status.is_none()
            && let Ok(Some(st)) = self.child.try_wait()
        {
            self.status = Some(st);
        }
        self.status.is_some()
    }

    /// Waits for `distrun` to exit until `deadline`; false if it did not.
    fn wait_until(&mut self, deadline: Instant) -> bool {
        while !self.exited() {
            if Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(POLL);
        }
        true
    }

    /// SIGKILLs `distrun`, its process group and every process below it (each rank leads its
    /// own process group), continues stopped ones, and reaps `distrun`.
    fn kill_all(&mut self) {
        let pid = self.child.id();
        let mut targets: Vec<String> = descendants(pid).iter().map(u32::to_string).collect();
        targets.push(pid.to_string());
        targets.push(format!("-{pid}"));
        signal("KILL", &targets);
        signal("CONT", &targets);
        if self.status.is_none() {
            self.status = self.child.wait().ok();
        }
    }

    fn tail(&self) -> Vec<String> {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(TAIL_LINES)..]
            .iter()
            .map(|l| l.to_string())
            .collect()
    }

    fn rank_file(&self, rank: usize, ext: &str) -> Option<String> {
        std::fs::read_to_string(self.dir.join(format!("rank{rank}.{ext}"))).ok()
    }

    fn pid(&self, rank: usize) -> Option<u32> {
        self.rank_file(rank, "pid")?.trim().parse().ok()
    }

    /// A rank's reported error: (wall-clock µs, text).
    fn result(&self, rank: usize) -> Option<(i128, String)> {
        let s = self.rank_file(rank, "result")?;
        let (t, text) = s.split_once(' ')?;
        Some((t.parse().ok()?, text.trim_end().to_string()))
    }

    /// Waits until every rank wrote its pid (it is inside its loop); `Err` if the job ended
    /// first or took longer than [`START_LIMIT`].
    fn wait_pids(&mut self, n: usize) -> Result<Vec<u32>, String> {
        loop {
            let pids: Vec<u32> = (0..n).filter_map(|r| self.pid(r)).collect();
            if pids.len() == n {
                return Ok(pids);
            }
            if self.exited() {
                return Err(format!(
                    "the job ended ({}) before every rank entered its loop",
                    self.status.map_or("?".into(), |s| s.to_string())
                ));
            }
            if self.started.elapsed() > START_LIMIT {
                return Err(format!(
                    "not every rank entered its loop within {START_LIMIT:?}"
                ));
            }
            std::thread::sleep(POLL);
        }
    }

    /// Waits until each of `ranks` reported an error, the job exited, or `deadline`.
    /// Returns whether every one of them reported.
    fn wait_results(&mut self, ranks: &[usize], deadline: Instant) -> bool {
        loop {
            if ranks.iter().all(|&r| self.result(r).is_some()) {
                return true;
            }
            if self.exited() || Instant::now() >= deadline {
                // A last look: the job may have ended right after the last report.
                return ranks.iter().all(|&r| self.result(r).is_some());
            }
            std::thread::sleep(POLL);
        }
    }
}

/// The ranks an error text blames: `peer rank N`, `rank(s) [..]`, `met rank N` (a mismatch's
/// other side), and progress-report lines of ranks that `did not join` the collective or
/// `published no progress`.
pub(crate) fn blamed(text: &str) -> Vec<usize> {
    let mut out = Vec::new();
    let mut push = |r: usize| {
        if !out.contains(&r) {
            out.push(r);
        }
    };
    let leading_num = |s: &str| -> Option<usize> {
        let d: String = s.chars().take_while(char::is_ascii_digit).collect();
        d.parse().ok()
    };
    for pat in ["peer rank ", "met rank "] {
        for (i, _) in text.match_indices(pat) {
            if let Some(r) = leading_num(&text[i + pat.len()..]) {
                push(r);
            }
        }
    }
    for (i, _) in text.match_indices("rank(s) [") {
        let rest = &text[i + "rank(s) [".len()..];
        let list = rest.split(']').next().unwrap_or("");
        list.split(',')
            .filter_map(|s| s.trim().parse().ok())
            .for_each(&mut push);
    }
    for line in text.lines() {
        let l = line.trim_start();
        if !(l.contains("did not join") || l.contains("published no progress")) {
            continue;
        }
        if let Some(rest) = l.strip_prefix("rank ") {
            if let Some(r) = leading_num(rest) {
                push(r);
            }
        } else if let Some(rest) = l.strip_prefix("ranks ") {
            // `ranks 0, 2-5 are ...`
            let list: String = rest
                .chars()
                .take_while(|c| c.is_ascii_digit() || matches!(c, ',' | ' ' | '-'))
                .collect();
            for part in list.split(',') {
                let part = part.trim();
                match part.split_once('-') {
                    Some((a, b)) => {
                        if let (Ok(a), Ok(b)) =
                            (a.trim().parse::<usize>(), b.trim().parse::<usize>())
                        {
                            (a..=b).for_each(&mut push);
                        }
                    }
                    None => {
                        if let Ok(r) = part.parse() {
                            push(r);
                        }
                    }
                }
            }
        }
    }
    out
}

/// Whether an error text says the ranks called different collectives.
fn says_mismatch(text: &str) -> bool {
    let t = text.to_ascii_lowercase();
    t.contains("mismatch") || t.contains(" met rank ") || t.contains("different collectives")
}

/// One run of a scenario.
#[derive(Default)]
struct Run {
    /// Why it failed (a survivor that did not error, errored late, did not name the culprit,
    /// a job that did not exit 0, ...); empty if it did not.
    problems: Vec<String>,
    hang: bool,
    /// Fault-to-error delays of the survivors, or the run's duration for the main job (ms).
    times_ms: Vec<f64>,
    /// Errors that named the culprit, of those judged.
    named: usize,
    judged: usize,
    tail: Vec<String>,
}

impl Run {
    fn ok(&self) -> bool {
        self.problems.is_empty() && !self.hang
    }
}

/// One row of the table.
struct Row {
    name: String,
    /// Unit of `times` (`ms` from fault to error, or `s` of a whole run).
    unit: &'static str,
    runs: Vec<Run>,
}

impl Row {
    fn failures(&self) -> usize {
        self.runs
            .iter()
            .filter(|r| !r.hang && !r.problems.is_empty())
            .count()
    }

    fn hangs(&self) -> usize {
        self.runs.iter().filter(|r| r.hang).count()
    }

    fn ok(&self) -> usize {
        self.runs.iter().filter(|r| r.ok()).count()
    }

    fn times(&self) -> (String, String) {
        let mut t: Vec<f64> = self
            .runs
            .iter()
            .flat_map(|r| r.times_ms.iter().copied())
            .collect();
        if t.is_empty() {
            return ("-".into(), "-".into());
        }
        t.sort_by(f64::total_cmp);
        let median = if t.len() % 2 == 1 {
            t[t.len() / 2]
        } else {
            (t[t.len() / 2 - 1] + t[t.len() / 2]) / 2.0
        };
        let max = t[t.len() - 1];
        let f = |v: f64| match self.unit {
            "s" => format!("{:.1} s", v / 1000.0),
            _ => format!("{v:.0} ms"),
        };
        (f(median), f(max))
    }

    fn named(&self) -> String {
        let (named, judged) = self
            .runs
            .iter()
            .fold((0, 0), |(a, b), r| (a + r.named, b + r.judged));
        if judged == 0 {
            "-".into()
        } else {
            format!(
                "{named}/{judged} ({:.0}%)",
                100.0 * named as f64 / judged as f64
            )
        }
    }

    /// The first failed runs' reasons and output tails.
    fn print_failures(&self) {
        for (i, r) in self
            .runs
            .iter()
            .enumerate()
            .filter(|(_, r)| !r.ok())
            .take(SHOWN_FAILURES)
        {
            println!(
                "\n--- {} run {}: {}",
                self.name,
                i + 1,
                if r.hang { "HANG" } else { "FAILED" }
            );
            for p in &r.problems {
                for (j, line) in p.lines().enumerate() {
                    println!("{}{line}", if j == 0 { "  * " } else { "      " });
                }
            }
            println!("  last {} line(s) of output:", r.tail.len());
            for l in &r.tail {
                println!("  | {l}");
            }
        }
    }
}

/// Paths of the programs.
struct Progs {
    distrun: PathBuf,
    ddp_train: PathBuf,
    final_broadcast: PathBuf,
    faults: PathBuf,
}

/// One run of a job that must exit 0 (`main`: the README's main job; `exit`: a final
/// broadcast, then every rank returns from `main` with no teardown call).
fn clean_run(p: &Progs, fl: &Flags, dir: &Path, program: &Path) -> Run {
    let mut run = Run::default();
    let prog = [program.display().to_string()];
    let mut job = match Job::launch(&p.distrun, 4, dir, &prog, &[]) {
        Ok(j) => j,
        Err(e) => {
            run.problems.push(e);
            return run;
        }
    };
    if job.wait_until(job.started + fl.hang_limit) {
        let st = job.status.expect("exited");
        if st.success() {
            run.times_ms
                .push(job.started.elapsed().as_secs_f64() * 1000.0);
        } else {
            run.problems.push(format!("distrun exited with {st}"));
        }
    } else {
        job.kill_all();
        run.hang = true;
        run.problems
            .push(format!("still running after {:?}: killed", fl.hang_limit));
    }
    if !run.ok() {
        run.tail = job.tail();
    }
    run
}

/// The signal scenarios: `KILL` or `STOP` of a random rank at a random moment in the loop.
fn signal_run(p: &Progs, fl: &Flags, rng: &mut Rng, dir: &Path, sig: &str) -> Run {
    let n = fl.world_size;
    let mut run = Run::default();
    let mut env = vec![];
    // Within 1 s of a kill at the default timeout; within timeout + 1 s of a stall.
    let limit = if sig == "STOP" {
        env.push(("SOAK_TIMEOUT_MS", fl.stall_timeout.as_millis().to_string()));
        fl.stall_timeout + Duration::from_secs(1)
    } else {
        Duration::from_secs(1)
    };
    let prog = [
        p.faults.display().to_string(),
        if sig == "STOP" { "stall" } else { "kill" }.into(),
    ];
    let mut job = match Job::launch(&p.distrun, n, dir, &prog, &env) {
        Ok(j) => j,
        Err(e) => {
            run.problems.push(e);
            return run;
        }
    };
    let pids = match job.wait_pids(n) {
        Ok(p) => p,
        Err(e) => {
            run.problems.push(e);
            job.kill_all();
            run.tail = job.tail();
            return run;
        }
    };
    let victim = rng.below(n as u64) as usize;
    std::thread::sleep(Duration::from_micros(rng.below(1_000_000)));
    let t_fault = now_us();
    let fault_at = Instant::now();
    signal(sig, &[pids[victim].to_string()]);
    let survivors: Vec<usize> = (0..n).filter(|&r| r != victim).collect();
    let reported = job.wait_results(&survivors, fault_at + limit + FAULT_LIMIT);
    if sig == "STOP" {
        // Nothing may be left behind: the stalled rank goes.
        signal("KILL", &[pids[victim].to_string()]);
        signal("CONT", &[pids[victim].to_string()]);
    }
    let what = if sig == "STOP" { "stalled" } else { "killed" };
    for &r in &survivors {
        match job.result(r) {
            Some((t, text)) => {
                let ms = (t - t_fault) as f64 / 1000.0;
                run.times_ms.push(ms);
                run.judged += 1;
                let named = blamed(&text).contains(&victim);
                if named {
                    run.named += 1;
                } else {
                    run.problems.push(format!(
                        "rank {r}'s error does not name {what} rank {victim}: {text}"
                    ));
                }
                if ms > limit.as_secs_f64() * 1000.0 {
                    run.problems.push(format!(
                        "rank {r} errored {ms:.0} ms after rank {victim} was {what} (limit {} ms)",
                        limit.as_millis()
                    ));
                }
            }
            None if job.exited() => run.problems.push(format!(
                "rank {r} exited without an error after rank {victim} was {what}"
            )),
            None => {}
        }
    }
    if !reported {
        let missing: Vec<usize> = survivors
            .iter()
            .copied()
            .filter(|&r| job.result(r).is_none())
            .collect();
        if !job.exited() {
            run.hang = true;
            run.problems.push(format!(
                "rank(s) {missing:?} had not errored {:?} after rank {victim} was {what}: killed",
                limit + FAULT_LIMIT
            ));
        }
    } else if !job.wait_until(Instant::now() + EXIT_LIMIT) {
        run.hang = true;
        run.problems.push(format!(
            "every survivor reported, but the job had not exited {EXIT_LIMIT:?} later: killed"
        ));
    } else if sig == "KILL" {
        // distrun's summary must name the rank that was killed, not a survivor that exited
        // in the same poll after hearing of it.
        let log = std::fs::read_to_string(&job.log).unwrap_or_default();
        let named = format!("distrun: rank {victim} failed first");
        if !log.lines().any(|l| l.starts_with(&named)) {
            let first = log.lines().find(|l| l.contains("failed first"));
            run.problems.push(format!(
                "distrun did not name killed rank {victim} as the first failure: {first:?}"
            ));
        }
    }
    job.kill_all();
    if !run.ok() {
        run.tail = job.tail();
    }
    run
}

fn mismatch_run(p: &Progs, fl: &Flags, rng: &mut Rng, dir: &Path) -> Run {
    let n = fl.world_size;
    let mut run = Run::default();
    let kind = ["count", "op", "root"][rng.below(3) as usize];
    let at = 2 + rng.below(30);
    let env = [
        ("SOAK_MISMATCH_KIND", kind.to_string()),
        ("SOAK_MISMATCH_AT", at.to_string()),
    ];
    let prog = [p.faults.display().to_string(), "mismatch".into()];
    let mut job = match Job::launch(&p.distrun, n, dir, &prog, &env) {
        Ok(j) => j,
        Err(e) => {
            run.problems.push(e);
            return run;
        }
    };
    let all: Vec<usize> = (0..n).collect();
    let reported = job.wait_results(&all, job.started + START_LIMIT + FAULT_LIMIT);
    // The mismatch can be seen once every rank has entered its collective.
    let fault = (0..n)
        .filter_map(|r| job.rank_file(r, "fault")?.trim().parse::<i128>().ok())
        .max();
    for r in 0..n {
        match job.result(r) {
            Some((t, text)) => {
                if let Some(f) = fault {
                    run.times_ms.push((t - f) as f64 / 1000.0);
                }
                // Every rank, not only the two that called something else, must be told why.
                run.judged += 1;
                if says_mismatch(&text) && !blamed(&text).is_empty() {
                    run.named += 1;
                } else {
                    run.problems.push(format!(
                        "rank {r}'s error does not say mismatch naming the other side ({kind} \
                         mismatch at iteration {at}): {text}"
                    ));
                }
            }
            None if job.exited() => run.problems.push(format!(
                "rank {r} exited without an error ({kind} mismatch at iteration {at})"
            )),
            None => {}
        }
    }
    if !reported && !job.exited() {
        let missing: Vec<usize> = all
            .iter()
            .copied()
            .filter(|&r| job.result(r).is_none())
            .collect();
        run.hang = true;
        run.problems.push(format!(
            "rank(s) {missing:?} had not errored {:?} after the start ({kind} mismatch at iteration {at}): killed",
            START_LIMIT + FAULT_LIMIT
        ));
    } else if reported && !job.wait_until(Instant::now() + EXIT_LIMIT) {
        run.hang = true;
        run.problems.push(format!(
            "every rank reported, but the job had not exited {EXIT_LIMIT:?} later: killed"
        ));
    }
    job.kill_all();
    if !run.ok() {
        run.tail = job.tail();
    }
    run
}

/// One garbage connection's bytes: random ones, or a plausible start with a huge length.
fn garbage(rng: &mut Rng) -> Vec<u8> {
    const MAGIC: u32 = 0x3C85_F7CE; // VALIDATE's magic number
    let mut b = vec![0u8];
    b.extend_from_slice(&MAGIC.to_le_bytes());
    match rng.below(6) {
        // Random bytes, up to 64 KiB.
        0 => {
            let len = 1 + rng.below(64 * 1024) as usize;
            b = rng.bytes(len);
        }
        // SET with a key length of 2^64 - 1, no validation first.
        1 => {
            b = vec![1];
            b.extend_from_slice(&u64::MAX.to_le_bytes());
            b.extend(rng.bytes(64));
        }
        // Validated, then SET with a key of 2^62 bytes.
        2 => {
            b.push(1);
            b.extend_from_slice(&(1u64 << 62).to_le_bytes());
            b.extend(rng.bytes(1024));
        }
        // Validated, then SET of a 60 MiB value (under the limit) that never arrives.
        3 => {
            b.push(1);
            b.extend_from_slice(&5u64.to_le_bytes());
            b.extend_from_slice(b"/soak");
            b.extend_from_slice(&(60u64 << 20).to_le_bytes());
            b.extend(rng.bytes(4096));
        }
        // Validated, then MULTI_GET of 2^40 keys.
        4 => {
            b.push(0x0a);
            b.extend_from_slice(&(1u64 << 40).to_le_bytes());
        }
        // Validated, then random bytes.
        _ => {
            let len = 1 + rng.below(4096) as usize;
            b.extend(rng.bytes(len));
        }
    }
    b
}

fn garbage_run(p: &Progs, fl: &Flags, rng: &mut Rng, dir: &Path) -> Run {
    let n = fl.world_size;
    let mut run = Run::default();
    let prog = [p.faults.display().to_string(), "store-garbage".into()];
    let env = [("SOAK_SECONDS", GARBAGE_JOB_SECS.to_string())];
    let mut job = match Job::launch(&p.distrun, n, dir, &prog, &env) {
        Ok(j) => j,
        Err(e) => {
            run.problems.push(e);
            return run;
        }
    };
    if let Err(e) = job.wait_pids(n) {
        run.problems.push(e);
    } else {
        let addr = std::fs::read_to_string(dir.join("store.addr")).unwrap_or_default();
        let addr = addr.trim();
        // Several connections over most of the job's loop, kept open (some idle) till the end.
        let mut conns = Vec::new();
        let until = Instant::now() + Duration::from_millis(GARBAGE_JOB_SECS * 1000 * 3 / 4);
        let mut sent = 0usize;
        while Instant::now() < until && !job.exited() {
            match TcpStream::connect(addr) {
                Ok(mut s) => {
                    let _ = s.set_write_timeout(Some(Duration::from_millis(500)));
                    let _ = s.set_read_timeout(Some(Duration::from_millis(1)));
                    if rng.below(5) != 0 {
                        let _ = s.write_all(&garbage(rng));
                    }
                    let mut sink = [0u8; 256];
                    let _ = s.read(&mut sink);
                    conns.push(s);
                    sent += 1;
                }
                Err(e) => {
                    run.problems
                        .push(format!("connecting to the store at {addr:?}: {e}"));
                    break;
                }
            }
            std::thread::sleep(Duration::from_millis(50 + rng.below(150)));
        }
        if sent < 2 && run.problems.is_empty() {
            run.problems
                .push(format!("only {sent} garbage connection(s) could be made"));
        }
        drop(conns);
    }
    if job.wait_until(job.started + START_LIMIT + FAULT_LIMIT) {
        let st = job.status.expect("exited");
        if !st.success() {
            run.problems.push(format!("distrun exited with {st}"));
        }
    } else {
        run.hang = true;
        run.problems.push(format!(
            "the job had not ended {:?} after its start: killed",
            START_LIMIT + FAULT_LIMIT
        ));
    }
    job.kill_all();
    if !run.ok() {
        run.tail = job.tail();
    }
    run
}

pub(crate) fn run_soak(args: &[String]) -> Result<(), String> {
    let fl = parse(args)?;
    build_release(
        &["dist-run", "ddp-train", "dist-collective"],
        &["soak_faults", "final_broadcast"],
    )?;
    let bin = project_root().join("target/release");
    let p = Progs {
        distrun: bin.join("distrun"),
        ddp_train: bin.join("ddp-train"),
        final_broadcast: bin.join("examples/final_broadcast"),
        faults: bin.join("examples/soak_faults"),
    };
    let root = std::env::temp_dir().join(format!("dist-soak-{}", std::process::id()));
    println!(
        "xtask soak: seed {} (rerun with --seed {}), world size {} for the faults, files under {}",
        fl.seed,
        fl.seed,
        fl.world_size,
        root.display()
    );
    let mut rng = Rng::new(fl.seed);
    let mut rows: Vec<Row> = Vec::new();
    for &scenario in SCENARIOS.iter().filter(|s| fl.only.iter().any(|o| o == *s)) {
        let (name, unit, count) = match scenario {
            "main" => ("main: distrun -n 4 ddp-train".to_string(), "s", fl.runs),
            "exit" => (
                "exit: 1 MiB broadcast, return from main (-n 4)".to_string(),
                "s",
                fl.exit_runs,
            ),
            "kill" => (
                "kill (SIGKILL, default timeout)".to_string(),
                "ms",
                fl.fault_runs,
            ),
            "stall" => (
                format!("stall (SIGSTOP, timeout {} s)", fl.stall_timeout.as_secs()),
                "ms",
                fl.fault_runs,
            ),
            "mismatch" => ("mismatch (ranks 0, 1)".to_string(), "ms", fl.fault_runs),
            _ => ("store-garbage".to_string(), "ms", fl.fault_runs),
        };
        let mut row = Row {
            name,
            unit,
            runs: Vec::new(),
        };
        for i in 0..count {
            let dir = root.join(format!("{scenario}-{}", i + 1));
            let t = Instant::now();
            let r = match scenario {
                "main" => clean_run(&p, &fl, &dir, &p.ddp_train),
                "exit" => clean_run(&p, &fl, &dir, &p.final_broadcast),
                "kill" => signal_run(&p, &fl, &mut rng, &dir, "KILL"),
                "stall" => signal_run(&p, &fl, &mut rng, &dir, "STOP"),
                "mismatch" => mismatch_run(&p, &fl, &mut rng, &dir),
                _ => garbage_run(&p, &fl, &mut rng, &dir),
            };
            println!(
                "{scenario} {}/{count}: {} in {:.1} s{}",
                i + 1,
                if r.hang {
                    "HANG"
                } else if r.ok() {
                    "ok"
                } else {
                    "FAILED"
                },
                t.elapsed().as_secs_f64(),
                r.problems.first().map_or(String::new(), |p| format!(
                    ": {}",
                    p.lines().next().unwrap_or("")
                )),
            );
            if r.ok() {
                // Keep the files of failed runs only.
                let _ = std::fs::remove_dir_all(&dir);
            }
            row.runs.push(r);
        }
        row.print_failures();
        rows.push(row);
    }
    let _ = std::fs::remove_dir(&root);

    println!(
        "\n| scenario | runs | ok | failures | hangs | median | max | errors naming the culprit |"
    );
    println!("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |");
    for row in &rows {
        let (median, max) = row.times();
        println!(
            "| {} | {} | {} | {} | {} | {median} | {max} | {} |",
            row.name,
            row.runs.len(),
            row.ok(),
            row.failures(),
            row.hangs(),
            row.named()
        );
    }
    println!(
        "\nmedian/max: the run time of the main job; for the faults, the time from the fault to \
         each survivor's error\n(kill, stall: from just before the signal is sent; mismatch: from \
         when the last rank entered the mismatched collective).\nmismatch: the last column counts \
         the errors (of every rank) that say mismatch and name the other side. Seed {}.",
        fl.seed
    );
    let bad: usize = rows.iter().map(|r| r.failures() + r.hangs()).sum();
    if bad > 0 {
        return Err(format!(
            "{bad} run(s) failed or hung (their files are under {})",
            root.display()
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blamed_ranks_are_read_from_every_error_shape() {
        assert_eq!(
            blamed("rank 2: peer rank 0 was lost during all_reduce #5: connection reset"),
            vec![0]
        );
        assert_eq!(
            blamed(
                "rank 0: all_reduce #5 in group world timed out (rank 0: all_reduce #5 timed out \
                 after 3s waiting for rank(s) [1])\nprogress of the other ranks (as last \
                 published):\n  rank 1 is in all_reduce #5 too\n  rank 3 published no progress \
                 (gone, never created this group, or cannot reach the store)\n  rank 2 finished \
                 all_reduce #4 but did not join #5"
            ),
            vec![1, 3, 2]
        );
        assert_eq!(
            blamed("x\n  ranks 0, 2-4 finished all_reduce #4 but did not join #5"),
            vec![0, 2, 3, 4]
        );
        assert_eq!(
            blamed("rank 0 all_reduce #5 (f32 × 3) met rank 2 all_reduce #5 (f32 × 4)"),
            vec![2]
        );
        assert!(blamed("rank 3: store: connection refused").is_empty());
        assert!(says_mismatch(
            "rank 0 all_reduce #5 (f32 × 3) met rank 2 all_reduce #5 (f32 × 4)"
        ));
        assert!(!says_mismatch("rank 2: peer rank 0 was lost"));
        let told = "rank 3: all_reduce #5 aborted by a mismatch that rank 2 reported: rank 1 \
                    all_reduce #5 (f32 × 3, SUM) met rank 0 all_reduce #5 (f32 × 4, SUM)";
        assert!(says_mismatch(told));
        assert_eq!(blamed(told), vec![0]);
    }

    #[test]
    fn flags_parse_and_bad_ones_are_named() {
        let a = |s: &str| s.split_whitespace().map(String::from).collect::<Vec<_>>();
        let fl = parse(&a("--runs 3 --fault-runs 2 --seed 7 --only kill,stall")).unwrap();
        assert_eq!((fl.runs, fl.fault_runs, fl.seed), (3, 2, 7));
        assert_eq!(fl.only, vec!["kill", "stall"]);
        assert!(parse(&a("--only nope")).unwrap_err().contains("nope"));
        assert!(parse(&a("--world-size 2")).is_err());
        assert!(parse(&a("--runs")).unwrap_err().contains("needs a value"));
        let (mut x, mut y) = (Rng::new(1), Rng::new(1));
        assert_eq!(x.next_u64(), y.next_u64());
        assert!(x.below(4) < 4);
    }
}
