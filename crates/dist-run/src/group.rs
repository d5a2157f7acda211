//! One attempt: this node's ranks, from spawn to the last one's end.

use std::collections::VecDeque;
use std::fmt::Write as _;
use std::fs::File;
use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::Path;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use crate::agents::{Agents, Silence};
use crate::env::Job;
use crate::error_files::{self, ErrorFiles, RankError};
use crate::root_cause::{Candidate, root_cause};
use crate::{exits, signals};

/// How often children (and the other nodes) are polled.
const POLL: Duration = Duration::from_millis(10);
/// How long, after the first failure is seen, the ranks still running may take to end before
/// the root cause is named (see [`settle`]).
const SETTLE: Duration = Duration::from_secs(1);
/// How often the store is asked whether another node failed.
const REMOTE_POLL: Duration = Duration::from_millis(100);
/// How long output still in the pipes may take to drain after the ranks ended.
const DRAIN: Duration = Duration::from_secs(2);
/// The most characters of a rank's error in one-line reports.
const ONE_LINE_ERROR: usize = 200;

/// What one attempt needs.
pub(crate) struct Attempt<'a> {
    pub(crate) job: &'a Job,
    pub(crate) command: &'a [String],
    pub(crate) restart: u32,
    pub(crate) grace: Duration,
    pub(crate) tail_lines: usize,
    pub(crate) log_dir: Option<&'a Path>,
    pub(crate) agents: Option<&'a Agents>,
    /// Where the ranks write their errors.
    pub(crate) error_files: &'a ErrorFiles,
}

/// How an attempt ended.
pub(crate) enum Outcome {
    /// Every rank of this node exited 0.
    Success,
    /// A rank of this node failed first; the others were stopped.
    Failed(Failure),
    /// Another node reported a failure (exit code, description); this node's ranks were stopped.
    RemoteFailed(i32, String),
    /// `distrun` received this signal; the ranks were stopped.
    Interrupted(i32),
}

/// The first rank that failed.
pub(crate) struct Failure {
    rank: u32,
    local_rank: u32,
    node_rank: u32,
    pid: u32,
    status: ExitStatus,
    tail: Vec<String>,
    stopped: Vec<u32>,
    /// What the rank wrote in its error file, if anything.
    error: Option<RankError>,
    /// Where the rank's error came first but another rank was the first seen to exit failing
    /// (it had not exited yet): that rank, whose exit `status` is.
    first_exit: Option<u32>,
}

impl Failure {
    /// `exit code 7` or `killed by SIGSEGV`, and which rank's exit that was where another rank
    /// was the first to exit.
    fn how(&self) -> String {
        let status = match (self.status.code(), self.status.signal()) {
            (Some(c), _) => format!("exit code {c}"),
            (None, Some(s)) => format!("killed by {}", signals::name(s)),
            _ => format!("{}", self.status),
        };
        match self.first_exit {
            Some(r) => {
                format!("its error came first (rank {r} was the first to exit, {status})")
            }
            None => status,
        }
    }

    /// The code `distrun` exits with: the rank's, or `128 + signal`.
    pub(crate) fn exit_code(&self) -> i32 {
        match (self.status.code(), self.status.signal()) {
            (Some(c), _) => c,
            (None, Some(s)) => 128 + s,
            _ => 1,
        }
    }

    /// The failure in one line, for the other nodes and the launcher above.
    pub(crate) fn one_line(&self) -> String {
        let mut line = format!(
            "rank {} (node {}, local rank {}) failed: {}",
            self.rank,
            self.node_rank,
            self.local_rank,
            self.how()
        );
        if let Some(e) = &self.error {
            let _ = write!(line, ": {}", e.headline(ONE_LINE_ERROR));
        }
        line
    }

    /// What the rank wrote in its error file.
    pub(crate) fn error(&self) -> Option<&RankError> {
        self.error.as_ref()
    }

    /// The multi-line summary printed when the job fails.
    pub(crate) fn summary(&self, tail_lines: usize) -> String {
        let mut s = String::new();
        let _ = writeln!(
            s,
            "distrun: rank {} failed first (node {}, local rank {}, pid {}): {}",
            self.rank,
            self.node_rank,
            self.local_rank,
            self.pid,
            self.how()
        );
        if let Some(e) = &self.error {
            let _ = writeln!(s, "distrun: rank {}'s error (its error file):", self.rank);
            for l in e.message.lines() {
                let _ = writeln!(s, "distrun:   {l}");
            }
            // As many lines of the trace as of the tail.
            let lines = e.trace_past_message();
            if !lines.is_empty() {
                let shown = &lines[..lines.len().min(tail_lines)];
                let _ = writeln!(
                    s,
                    "distrun: its trace ({} of {} line(s)):",
                    shown.len(),
                    lines.len()
                );
                for l in shown {
                    let _ = writeln!(s, "distrun:   {l}");
                }
            }
        }
        if self.tail.is_empty() {
            let _ = writeln!(s, "distrun: rank {} printed nothing", self.rank);
        } else {
            let _ = writeln!(
                s,
                "distrun: last {} line(s) of rank {} (at most {tail_lines}):",
                self.tail.len(),
                self.rank
            );
            for l in &self.tail {
                let _ = writeln!(s, "distrun:   {l}");
            }
        }
        if !self.stopped.is_empty() {
            let list: Vec<String> = self.stopped.iter().map(u32::to_string).collect();
            let _ = writeln!(s, "distrun: stopped rank(s) {}", list.join(", "));
        }
        s
    }
}

/// One running rank.
struct Rank {
    rank: u32,
    local_rank: u32,
    child: Child,
    status: Option<ExitStatus>,
    tail: Arc<Mutex<VecDeque<String>>>,
    /// Where the rank writes its error (`TORCHELASTIC_ERROR_FILE`).
    error_file: std::path::PathBuf,
}

/// Runs one attempt of this node's ranks.
pub(crate) fn run_attempt(a: &Attempt<'_>) -> Result<Outcome, String> {
    let (done_tx, done_rx) = mpsc::channel::<u32>();
    let mut ranks = Vec::new();
    let mut readers = 0;
    let cpus = crate::bind::plan(a.job.nproc_per_node as usize);
    for local_rank in 0..a.job.nproc_per_node {
        let share = cpus.as_ref().map(|c| c[local_rank as usize].as_slice());
        match spawn(a, local_rank, share, &done_tx) {
            Ok((r, n)) => {
                ranks.push(r);
                readers += n;
            }
            Err(e) => {
                stop(&mut ranks, libc::SIGTERM, a.grace);
                return Err(e);
            }
        }
    }
    drop(done_tx);

    // When the last poll that found no rank failed started (see `root_cause`).
    let mut quiet: Option<SystemTime> = None;
    let mut last_remote_check = Instant::now();
    // Since when node 0's store has not answered a look for failures.
    let mut store_silence = Silence::default();
    let outcome = loop {
        if let Some(sig) = signals::pending() {
            stop(&mut ranks, sig, a.grace);
            break Outcome::Interrupted(sig);
        }
        let poll_started = SystemTime::now();
        let mut running = 0;
        let mut failed_now = Vec::new();
        for (i, r) in ranks.iter_mut().enumerate() {
            if r.status.is_some() {
                continue;
            }
            match exits::exited(&r.child) {
                Ok(Some(st)) => {
                    r.status = Some(st);
                    if !st.success() {
                        failed_now.push(i);
                    }
                }
                Ok(None) => running += 1,
                Err(e) => {
                    eprintln!("distrun: waiting for rank {}: {e}", r.rank);
                    running += 1;
                }
            }
        }
        if let Some(&seen_first) = failed_now.first() {
            settle(&mut ranks, &mut failed_now);
            // Every rank's error file, each whole once it exists (written aside and renamed).
            let mut errors: Vec<Option<RankError>> = ranks
                .iter()
                .map(|r| error_files::read(&r.error_file))
                .collect();
            let i = root_cause_of(&ranks, &errors, &failed_now, quiet);
            let r = &ranks[i];
            // The root cause may still be tearing down (its peers heard of its error and
            // exited first): distrun then exits with the code of the first rank seen to fail.
            let (status, first_exit) = match r.status {
                Some(st) if !st.success() => (st, None),
                _ => {
                    let first = &ranks[seen_first];
                    let st = first.status.unwrap_or_else(|| ExitStatus::from_raw(1 << 8));
                    (st, Some(first.rank))
                }
            };
            let error = errors[i].take();
            let report = a.agents.map(|ag| {
                let f = Failure {
                    rank: r.rank,
                    local_rank: r.local_rank,
                    node_rank: a.job.node_rank,
                    pid: r.child.id(),
                    status,
                    tail: Vec::new(),
                    stopped: Vec::new(),
                    error: error.clone(),
                    first_exit,
                };
                let (code, line) = (f.exit_code(), f.one_line());
                // First as one look: a store that does not answer (node 0 stopped) must not
                // keep this node's other ranks running for the rendezvous timeout.
                let told = ag.report_failure_soon(a.restart, code, &line);
                (ag, code, line, told)
            });
            let stopped = stop(&mut ranks, libc::SIGTERM, a.grace);
            if let Some((ag, code, line, false)) = report {
                ag.report_failure(a.restart, code, &line);
            }
            let r = &ranks[i];
            // The failed rank's last words may still be in its pipes.
            drain(&done_rx, &mut readers);
            let tail = r
                .tail
                .lock()
                .map(|t| t.iter().cloned().collect())
                .unwrap_or_default();
            break Outcome::Failed(Failure {
                rank: r.rank,
                local_rank: r.local_rank,
                node_rank: a.job.node_rank,
                pid: r.child.id(),
                status,
                tail,
                stopped,
                error,
                first_exit,
            });
        }
        quiet = Some(poll_started);
        if running == 0 {
            break Outcome::Success;
        }
        if let Some(ag) = a.agents
            && last_remote_check.elapsed() >= REMOTE_POLL
        {
            last_remote_check = Instant::now();
            match ag.look_for_failure(a.restart, &mut store_silence) {
                Ok(None) => {}
                Ok(Some((code, what))) => {
                    stop(&mut ranks, libc::SIGTERM, a.grace);
                    break Outcome::RemoteFailed(code, what);
                }
                // The job's store is gone (node 0 died), or has not answered for the
                // rendezvous timeout (stopped): this node's ranks are stopped as on any
                // failure, with the grace period and their groups, rather than left to the
                // parent-death signal once distrun returns.
                Err(e) => {
                    stop(&mut ranks, libc::SIGTERM, a.grace);
                    drain(&done_rx, &mut readers);
                    return Err(e);
                }
            }
        }
        std::thread::sleep(POLL);
    };
    if matches!(outcome, Outcome::Success) {
        // Every rank exited (unreaped, see `exits`); `stop` reaped them on the other ends.
        exits::reap(ranks.iter_mut().map(|r| &mut r.child));
    }
    drain(&done_rx, &mut readers);
    Ok(outcome)
}

/// After the first failure is seen, polls the ranks still running for up to [`SETTLE`] (until
/// every rank has ended, or one is seen killed by a signal), adding those that fail to
/// `failed_now`, before the root cause is named and the rest are stopped.
///
/// Why: a rank killed by a signal may be seen to end after the peers that failed because of
/// it. In one run of 120 of `cargo xtask soak`'s kill scenario, distrun saw rank 1 exit (it
/// had read rank 0's connection close and written its error) while rank 0, SIGKILLed before,
/// could not yet be waited for; it named rank 1 and stopped rank 0 itself. Ranks that end on
/// their own after a failure do so within milliseconds, so the wait costs little; a rank that
/// does not (a stalled one) is stopped [`SETTLE`] later.
fn settle(ranks: &mut [Rank], failed_now: &mut Vec<usize>) {
    let crashed =
        |ranks: &[Rank], i: usize| ranks[i].status.is_some_and(|st| st.signal().is_some());
    let until = Instant::now() + SETTLE;
    while !failed_now.iter().any(|&i| crashed(ranks, i))
        && ranks.iter().any(|r| r.status.is_none())
        && Instant::now() < until
    {
        std::thread::sleep(POLL);
        for (i, r) in ranks.iter_mut().enumerate() {
            if r.status.is_some() {
                continue;
            }
            if let Ok(Some(st)) = exits::exited(&r.child) {
                r.status = Some(st);
                if !st.success() {
                    failed_now.push(i);
                }
            }
        }
    }
}

/// The index of the rank whose failure caused the others' (see [`root_cause`]), when the ranks
/// at `failed_now` were just seen to fail and the ranks' error files read `errors`.
fn root_cause_of(
    ranks: &[Rank],
    errors: &[Option<RankError>],
    failed_now: &[usize],
    quiet: Option<SystemTime>,
) -> usize {
    let candidates: Vec<Candidate> = ranks
        .iter()
        .zip(errors)
        .enumerate()
        .map(|(i, (r, error))| {
            let now = failed_now.contains(&i);
            Candidate {
                written: error.as_ref().and_then(|e| e.written),
                failed_now: now,
                // Nobody has been signalled yet: a signal now is the rank's own crash.
                crashed: now && r.status.is_some_and(|st| st.signal().is_some()),
            }
        })
        .collect();
    root_cause(&candidates, quiet)
}

/// Waits until `left` more output threads have finished (their pipes closed), for at most
/// [`DRAIN`]: a process the rank left behind may hold a pipe open forever. `left` counts down.
fn drain(done: &mpsc::Receiver<u32>, left: &mut usize) {
    let deadline = dist_backend::deadline_after(Instant::now(), DRAIN);
    while *left > 0 {
        let wait = deadline.saturating_duration_since(Instant::now());
        match done.recv_timeout(wait) {
            Ok(_) => *left -= 1,
            Err(_) => break,
        }
    }
}

/// Starts local rank `local_rank`: its own process group, torchrun's environment, and two
/// threads pumping its stdout and stderr, bound to `cpus` when given (see [`crate::bind`]).
/// Returns the rank and its number of reader threads.
fn spawn(
    a: &Attempt<'_>,
    local_rank: u32,
    cpus: Option<&[usize]>,
    done: &mpsc::Sender<u32>,
) -> Result<(Rank, usize), String> {
    let rank = a.job.rank(local_rank);
    let (prog, args) = a.command.split_first().ok_or("no command to run")?;
    let error_file = a.error_files.prepare(a.restart, rank)?;
    let mut cmd = Command::new(prog);
    cmd.args(args)
        .envs(a.job.child_env(local_rank, a.restart, |k| {
            std::env::var_os(k).map(|_| String::new())
        }))
        .env(error_files::VAR, &error_file)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0);
    #[cfg(target_os = "linux")]
    {
        // CPUs past what a `cpu_set_t` holds (1024) are left out: libc's `CPU_SET` indexes
        // past the set's end for them and panics.
        let fits = 8 * size_of::<libc::cpu_set_t>();
        // SAFETY: an all-zero `cpu_set_t` is the empty set (a plain array of words), and every
        // CPU given to `CPU_SET` is below the set's size in bits.
        let set = cpus.map(|cpus| unsafe {
            let mut set: libc::cpu_set_t = std::mem::zeroed();
            for &c in cpus.iter().filter(|&&c| c < fits) {
                libc::CPU_SET(c, &mut set);
            }
            set
        });
        // SAFETY: the closure runs in the child between fork and exec, and only calls `prctl`,
        // `sched_setaffinity` (on a set built before the fork) and `getppid`, which are
        // async-signal-safe and allocate nothing.
        unsafe {
            let parent = libc::getpid();
            cmd.pre_exec(move || {
                // Die with distrun, even if it is SIGKILLed.
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                // Best effort: a rank that cannot be bound runs unbound.
                if let Some(set) = &set {
                    libc::sched_setaffinity(0, size_of::<libc::cpu_set_t>(), set);
                }
                if libc::getppid() != parent {
                    libc::_exit(137);
                }
                Ok(())
            });
        }
    }
    let tail = Arc::new(Mutex::new(VecDeque::with_capacity(a.tail_lines)));
    let logs = match a.log_dir {
        Some(dir) => {
            let d = dir
                .join(format!("attempt_{}", a.restart))
                .join(format!("rank_{rank}"));
            std::fs::create_dir_all(&d)
                .map_err(|e| format!("could not create log directory {}: {e}", d.display()))?;
            let open = |name: &str| {
                let p = d.join(name);
                File::create(&p).map_err(|e| format!("could not create {}: {e}", p.display()))
            };
            Some((open("stdout.log")?, open("stderr.log")?))
        }
        None => None,
    };
    let (out_log, err_log) = match logs {
        Some((o, e)) => (Some(o), Some(e)),
        None => (None, None),
    };
    // The logs are made before the rank starts: a rank started and then left out of the
    // ranks `stop` sees would run on, unstopped, with whatever it started.
    let mut child = cmd
        .spawn()
        .map_err(|e| format!("could not start rank {rank} ({prog:?}): {e}"))?;
    let readers = match start_pumps(
        &mut child,
        rank,
        &tail,
        a.tail_lines,
        (out_log, err_log),
        done,
    ) {
        Ok(n) => n,
        Err(e) => {
            signals::kill_group(child.id(), libc::SIGKILL);
            let _ = child.wait();
            return Err(e);
        }
    };
    Ok((
        Rank {
            rank,
            local_rank,
            child,
            status: None,
            tail,
            error_file,
        },
        readers,
    ))
}

/// Starts the threads that forward `child`'s stdout and stderr; returns how many.
fn start_pumps(
    child: &mut Child,
    rank: u32,
    tail: &Arc<Mutex<VecDeque<String>>>,
    tail_lines: usize,
    (out_log, err_log): (Option<File>, Option<File>),
    done: &mpsc::Sender<u32>,
) -> Result<usize, String> {
    let mut readers = 0;
    if let Some(out) = child.stdout.take() {
        pump(
            out,
            rank,
            false,
            Arc::clone(tail),
            tail_lines,
            out_log,
            done.clone(),
        )?;
        readers += 1;
    }
    if let Some(err) = child.stderr.take() {
        pump(
            err,
            rank,
            true,
            Arc::clone(tail),
            tail_lines,
            err_log,
            done.clone(),
        )?;
        readers += 1;
    }
    Ok(readers)
}

/// A thread copying `src` line by line to our stdout (or stderr) with a `[rank R] ` prefix,
/// to `log` unprefixed, and into the rank's `tail`.
fn pump(
    src: impl Read + Send + 'static,
    rank: u32,
    to_stderr: bool,
    tail: Arc<Mutex<VecDeque<String>>>,
    tail_lines: usize,
    mut log: Option<File>,
    done: mpsc::Sender<u32>,
) -> Result<(), String> {
    let prefix = format!("[rank {rank}] ");
    std::thread::Builder::new()
        .name(format!(
            "distrun-rank{rank}-{}",
            if to_stderr { "err" } else { "out" }
        ))
        .spawn(move || {
            let mut src = BufReader::new(src);
            let mut line = Vec::new();
            let mut out = Vec::new();
            // The last segment ended with a carriage return: a progress bar's redraw, which
            // the next segment replaces, in the terminal and in the tail.
            let mut after_cr = false;
            loop {
                line.clear();
                match next_segment(&mut src, &mut line, MAX_SEGMENT) {
                    Ok(0) => break,
                    Ok(_) => {}
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                    Err(_) => break,
                }
                if let Some(f) = log.as_mut() {
                    let _ = f.write_all(&line);
                }
                out.clear();
                let redraw = line.ends_with(b"\r");
                if after_cr && line == b"\n" {
                    // The `\n` of a `\r\n` that arrived apart: ends the bar's line.
                    out.push(b'\n');
                } else {
                    let text = line.strip_suffix(b"\n").unwrap_or(&line);
                    let text = text.strip_suffix(b"\r").unwrap_or(text);
                    out.extend_from_slice(prefix.as_bytes());
                    out.extend_from_slice(text);
                    out.push(if redraw { b'\r' } else { b'\n' });
                }
                // One write per segment under the lock, so ranks' lines never interleave. A
                // closed stdout is not a reason to stop draining the rank's pipe.
                let _ = if to_stderr {
                    std::io::stderr().lock().write_all(&out)
                } else {
                    let mut o = std::io::stdout().lock();
                    o.write_all(&out).and_then(|()| o.flush())
                };
                if tail_lines > 0
                    && out.len() > 1
                    && let Ok(mut t) = tail.lock()
                {
                    if after_cr {
                        // The bar's previous redraw gives way to this segment.
                        t.pop_back();
                    } else if t.len() == tail_lines {
                        t.pop_front();
                    }
                    t.push_back(String::from_utf8_lossy(&out[..out.len() - 1]).into_owned());
                }
                after_cr = redraw;
            }
            let _ = done.send(rank);
        })
        .map(|_| ())
        .map_err(|e| format!("could not start an output thread for rank {rank}: {e}"))
}

/// The most bytes of a rank's output held before they are forwarded without a line end: a
/// rank that writes megabytes without one (binary output, a very long line) must not grow
/// distrun's memory, nor keep its output back for the whole run.
const MAX_SEGMENT: usize = 64 << 10;

/// Reads the next segment of a rank's output into `seg`: up to and including the first `\n`
/// or `\r` (a progress bar redraws its line with `\r`, and writes `\n` only when it
/// closes; `\r\n` stays one segment where both have arrived), or `max` bytes, or what is
/// left at the end. Returns the segment's length, 0 at the end.
fn next_segment(src: &mut impl BufRead, seg: &mut Vec<u8>, max: usize) -> std::io::Result<usize> {
    loop {
        let avail = match src.fill_buf() {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        if avail.is_empty() {
            return Ok(seg.len());
        }
        let room = max.saturating_sub(seg.len()).max(1);
        let window = &avail[..avail.len().min(room)];
        match window.iter().position(|&b| b == b'\n' || b == b'\r') {
            Some(i) => {
                let mut end = i + 1;
                if avail[i] == b'\r' && avail.get(end) == Some(&b'\n') {
                    end += 1;
                }
                seg.extend_from_slice(&avail[..end]);
                src.consume(end);
                return Ok(seg.len());
            }
            None => {
                let n = window.len();
                seg.extend_from_slice(window);
                src.consume(n);
                if seg.len() >= max {
                    return Ok(seg.len());
                }
            }
        }
    }
}

/// Stops every rank still running: `sig` to its process group, then SIGKILL to the ones left
/// after `grace`, and reaps every rank, the ones that had exited too (their group ids stay
/// theirs until then, see `exits`). Returns the ranks that were still running.
fn stop(ranks: &mut [Rank], sig: i32, grace: Duration) -> Vec<u32> {
    let mut stopped = Vec::new();
    for r in ranks.iter_mut() {
        if r.status.is_none() {
            if let Ok(Some(st)) = exits::exited(&r.child) {
                r.status = Some(st);
            } else {
                stopped.push(r.rank);
            }
        }
        // Also the groups of ranks that exited: what they started dies with the job.
        signals::kill_group(r.child.id(), sig);
    }
    let deadline = dist_backend::deadline_after(Instant::now(), grace);
    loop {
        let mut running = false;
        for r in ranks.iter_mut().filter(|r| r.status.is_none()) {
            match exits::exited(&r.child) {
                Ok(Some(st)) => r.status = Some(st),
                _ => running = true,
            }
        }
        if !running || Instant::now() >= deadline {
            break;
        }
        std::thread::sleep(POLL);
    }
    for r in ranks.iter_mut() {
        // Exited ranks' groups too: what a rank started (an `sh -c` child, data loaders)
        // outlives it there. The rank is not reaped yet, so the group id is still its own.
        signals::kill_group(r.child.id(), libc::SIGKILL);
        if r.status.is_none() {
            // And the rank itself: one that left its group (setsid, a nested launcher) and
            // ignored SIGTERM would otherwise keep `wait` from returning.
            let _ = r.child.kill();
            r.status = r.child.wait().ok();
        }
    }
    exits::reap(ranks.iter_mut().map(|r| &mut r.child));
    stopped
}

#[cfg(test)]
mod segment_tests {
    use super::next_segment;

    fn segments(input: &[u8], max: usize, chunk: usize) -> Vec<Vec<u8>> {
        // A reader that returns at most `chunk` bytes per fill, as a pipe does.
        let reader = std::io::BufReader::with_capacity(chunk, input);
        let mut src = reader;
        let mut all = Vec::new();
        loop {
            let mut seg = Vec::new();
            if next_segment(&mut src, &mut seg, max).unwrap() == 0 {
                return all;
            }
            all.push(seg);
        }
    }

    #[test]
    fn output_splits_at_line_ends_and_carriage_returns_and_never_grows_past_the_cap() {
        let s = |v: &[&str]| v.iter().map(|x| x.as_bytes().to_vec()).collect::<Vec<_>>();
        assert_eq!(
            segments(b"a\nstep1\rstep2\r\nend", 64, 64),
            s(&["a\n", "step1\r", "step2\r\n", "end"])
        );
        // Split across fills, the \r\n comes apart (the pump then ends the bar's line).
        assert_eq!(segments(b"ab\r\n", 64, 3), s(&["ab\r", "\n"]));
        // Without line ends, pieces of at most `max` bytes.
        let long = vec![b'x'; 1000];
        let got = segments(&long, 64, 100);
        assert!(
            got.iter().all(|g| g.len() <= 64),
            "{:?}",
            got.iter().map(Vec::len).collect::<Vec<_>>()
        );
        assert_eq!(got.concat(), long);
        assert_eq!(segments(b"", 64, 8), Vec::<Vec<u8>>::new());
    }
}
