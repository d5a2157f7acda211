//! Point-to-point ping-pong between rank 0 and rank 1 (other ranks idle), timing round trips.
//!
//! ```sh
//! for r in 0 1; do RANK=$r WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29501 \
//!     cargo run -p dist-collective --example ping_pong & done; wait
//! ```
//!
//! Without `WORLD_SIZE`, it runs 2 ranks as threads of one process.
//!
//! `PING_PONG_WORK_US=N` makes each rank compute (spin) for N microseconds before it sends,
//! as a pipeline stage does between receiving its input and sending its output: the receive is
//! then posted long before its message arrives, and the time printed beside the round trip is
//! what the two messages cost on top of the work.

use std::time::{Duration, Instant};

use dist_collective::{InitOptions, ProcessGroup, Result, init_process_group, testing};

const ROUNDS: u32 = 100;

/// Stands in for a stage's compute: busy, as a core running a model is.
fn work(d: Duration) {
    let until = Instant::now() + d;
    while Instant::now() < until {
        std::hint::spin_loop();
    }
}

fn main_rank(pg: ProcessGroup) -> Result<()> {
    let gap = Duration::from_micros(
        std::env::var("PING_PONG_WORK_US")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(0),
    );
    let mut ball = [0u64; 256];
    let start = Instant::now();
    for round in 0..ROUNDS {
        match pg.rank() {
            0 => {
                ball[0] = u64::from(round);
                work(gap);
                pg.send(&ball, 1, 0)?;
                pg.recv(&mut ball, 1, 0)?;
                assert_eq!(ball[0], u64::from(round) + 1);
            }
            1 => {
                pg.recv(&mut ball, 0, 0)?;
                ball[0] += 1;
                work(gap);
                pg.send(&ball, 0, 0)?;
            }
            _ => {}
        }
    }
    if pg.rank() == 0 {
        let each = start.elapsed() / ROUNDS;
        println!(
            "rank 0: {ROUNDS} round trips of {} bytes, {each:?} each ({:?} beyond {gap:?} of work on each side)",
            ball.len() * 8,
            each.saturating_sub(2 * gap)
        );
    }
    pg.barrier()
}

fn main() -> Result<()> {
    if std::env::var_os("WORLD_SIZE").is_some() {
        let pg = init_process_group(InitOptions::new())?;
        main_rank(pg)?;
        dist_collective::destroy_process_group();
    } else {
        testing::run_world(2, main_rank)?;
    }
    Ok(())
}
