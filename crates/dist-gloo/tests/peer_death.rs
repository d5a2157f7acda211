//! A real peer process killed mid-collective: every other rank fails with `PeerLost` naming it
//! within one second, over messages, with every all_reduce lent by reference through the
//! group area, and with all_to_alls whose way rank 0 paces between the area and messages.
//! The test binary re-runs itself as the worker ranks.

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use dist_backend::store::{TcpStore, TcpStoreServer};
use dist_backend::{Backend, BufMut, BufRef, OpOptions};
use dist_gloo::{GlooBackend, GlooOptions};
use dist_wire::{DType, ReduceOp};

const WORLD: usize = 3;
const VICTIM: usize = 2;

/// Worker entry: runs only when the parent test starts this binary with `DIST_TEST_WORKER`.
#[test]
#[ignore = "a worker rank started by killed_peer_is_lost_everywhere"]
fn worker() {
    let Ok(spec) = std::env::var("DIST_TEST_WORKER") else {
        return;
    };
    let mut it = spec
        .split(',')
        .map(|s| s.parse::<usize>().expect("numeric worker spec"));
    let (rank, port, mode) = (
        it.next().unwrap(),
        it.next().unwrap() as u16,
        Mode::ALL[it.next().unwrap()],
    );
    let store = TcpStore::connect("127.0.0.1", port, Duration::from_secs(20)).expect("store");
    let mut o = GlooOptions::default();
    match mode {
        Mode::Messages => {}
        Mode::LentAllReduce => {
            // Every all_reduce by reference through the area (where the area is, and memory
            // can be read across), none of it in two shots through the area's slots.
            o.lent_all_reduce_bytes = Some(0);
            o.area_all_reduce_bytes = Some(0);
        }
        Mode::PacedAllToAll => {
            // Inputs of 240 KiB over the area's fixed limit: rank 0 paces them between the
            // area and messages, and the others read its choice in the area or, after a
            // call by messages, in its announcement.
            o.area_all_to_all_bytes = Some(4 << 10);
            o.paced_area_all_to_all_bytes = Some(usize::MAX);
            o.lent_all_to_all_bytes = Some(usize::MAX);
        }
    }
    let b = GlooBackend::connect(&store, "death", rank, WORLD, &o).expect("mesh");
    let mut v = vec![1.0f32; 1 << 20];
    let input = vec![1.0f32; 3 * 20_480];
    let counts = [20_480; WORLD];
    let opts = OpOptions::with_timeout(Duration::from_secs(30));
    for i in 0.. {
        let done = match mode {
            Mode::PacedAllToAll => b.all_to_all(
                BufRef::Host(bytemuck::cast_slice(&input)),
                BufMut::Host(bytemuck::cast_slice_mut(&mut v[..input.len()])),
                DType::F32,
                &counts,
                &counts,
                &opts,
            ),
            _ => b.all_reduce(
                BufMut::Host(bytemuck::cast_slice_mut(&mut v)),
                DType::F32,
                ReduceOp::Max,
                &opts,
            ),
        };
        if let Err(e) = done {
            say(&format!("ERR {e}"));
            // Stay up a moment, as a program that logs its error would: the ranks that are
            // still finding out then hear this rank's abort notice naming the victim, not the
            // reset of its sockets (that cascade is covered in the closing note).
            std::thread::sleep(Duration::from_secs(2));
            std::process::exit(3);
        }
        if i == 0 {
            // Whether the large messages went single-copy between these processes.
            say(&format!("READY by_ref={}", b.messages_by_reference() > 0));
        }
    }
}

/// What the workers run, and how.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    /// all_reduce by messages.
    Messages,
    /// all_reduce lent by reference through the group area.
    LentAllReduce,
    /// all_to_all through the area or by messages as rank 0 paces it.
    PacedAllToAll,
}

impl Mode {
    /// Every mode, indexed by the number a worker is passed.
    const ALL: [Mode; 3] = [Mode::Messages, Mode::LentAllReduce, Mode::PacedAllToAll];

    /// The collective the workers loop over.
    fn op(self) -> &'static str {
        match self {
            Mode::PacedAllToAll => "all_to_all",
            _ => "all_reduce",
        }
    }
}

/// Writes a line straight to the process's stdout: the test harness captures `println!`.
fn say(line: &str) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}

/// Kills every worker still running when the test ends, passed or failed.
struct Workers(Vec<std::process::Child>);

impl Drop for Workers {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

#[test]
fn a_killed_peer_is_peer_lost_on_every_other_rank_within_one_second() {
    killed_peer_is_lost_everywhere(Mode::Messages);
}

/// The same with every all_reduce lent: the kill lands while ranks copy out of each other's
/// buffers between the area's arrivals, and a rank that copies from a survivor that gave up
/// first must still name the victim, from that survivor's abort notice.
#[test]
fn a_killed_peer_mid_lent_all_reduce_is_peer_lost_on_every_other_rank() {
    killed_peer_is_lost_everywhere(Mode::LentAllReduce);
}

/// The same with all_to_alls that rank 0 paces: the kill lands in calls through the area, in
/// calls by messages, or in a survivor's read of another's table after its messages.
#[test]
fn a_killed_peer_mid_paced_all_to_all_is_peer_lost_on_every_other_rank() {
    killed_peer_is_lost_everywhere(Mode::PacedAllToAll);
}

/// Starts `WORLD` worker processes running `mode`, kills `VICTIM` once all run, and checks
/// that every other rank reports it lost within a second.
fn killed_peer_is_lost_everywhere(mode: Mode) {
    let server = TcpStoreServer::start(0).expect("store server");
    let exe = std::env::current_exe().expect("test binary path");
    let (tx, rx) = mpsc::channel::<(usize, String, Instant)>();
    let mut workers = Workers(
        (0..WORLD)
            .map(|rank| {
                let mut child = Command::new(&exe)
                    .args([
                        "--ignored",
                        "--exact",
                        "worker",
                        "--nocapture",
                        "--test-threads=1",
                    ])
                    .env(
                        "DIST_TEST_WORKER",
                        format!("{rank},{},{}", server.port(), mode as usize),
                    )
                    .stdout(Stdio::piped())
                    .stderr(Stdio::null())
                    .spawn()
                    .expect("spawn worker");
                let out = BufReader::new(child.stdout.take().expect("piped stdout"));
                let tx = tx.clone();
                std::thread::spawn(move || {
                    // The harness may print "test worker ... " on the same line before ours.
                    for line in out.lines().map_while(Result::ok) {
                        if let Some(at) = line.find("READY").or_else(|| line.find("ERR ")) {
                            let _ = tx.send((rank, line[at..].to_string(), Instant::now()));
                        }
                    }
                });
                child
            })
            .collect(),
    );
    let children = &mut workers.0;
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut ready = 0;
    let mut lines = Vec::new();
    while ready < WORLD {
        let (rank, line, _) = rx
            .recv_timeout(deadline - Instant::now())
            .expect("every worker reports READY");
        assert!(
            line.starts_with("READY"),
            "rank {rank} failed before the kill: {line}"
        );
        lines.push(line);
        ready += 1;
    }
    // Where processes may read each other's memory (the probe decides, the same for every
    // pair here) the kill lands while ranks copy out of each other, not only on sockets.
    assert!(lines.iter().all(|l| l == &lines[0]), "{lines:?}");
    std::thread::sleep(Duration::from_millis(200));
    children[VICTIM].kill().expect("kill the victim");
    let killed = Instant::now();
    let _ = children[VICTIM].wait();
    let mut seen = Vec::new();
    while seen.len() < WORLD - 1 {
        let (rank, line, at) = rx
            .recv_timeout(Duration::from_secs(10))
            .expect("survivors report an error");
        seen.push((rank, line, at - killed));
    }
    for (rank, line, took) in &seen {
        assert!(
            line.contains(&format!("peer rank {VICTIM} was lost during {}", mode.op())),
            "rank {rank}: {line}\nall: {seen:?}"
        );
        assert!(
            *took < Duration::from_secs(1),
            "rank {rank} took {took:?} to notice: {line}"
        );
    }
    for (rank, c) in children.iter_mut().enumerate() {
        if rank != VICTIM {
            let status = c.wait().expect("worker exits");
            assert_eq!(status.code(), Some(3), "rank {rank}");
        }
    }
}
