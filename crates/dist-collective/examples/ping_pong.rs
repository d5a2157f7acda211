//! Point-to-point ping-pong between rank 0 and rank 1 (other ranks idle), timing round trips.
//!
//! ```sh
//! for r in 0 1; do RANK=$r WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29501 \
//!     cargo run -p dist-collective --example ping_pong & done; wait
//! ```
//!
//! Without `WORLD_SIZE`, it runs 2 ranks as threads of one process.

use std::time::Instant;

use dist_collective::{InitOptions, ProcessGroup, Result, init_process_group, testing};

const ROUNDS: u32 = 100;

fn main_rank(pg: ProcessGroup) -> Result<()> {
    let mut ball = [0u64; 256];
    let start = Instant::now();
    for round in 0..ROUNDS {
        match pg.rank() {
            0 => {
                ball[0] = u64::from(round);
                pg.send(&ball, 1, 0)?;
                pg.recv(&mut ball, 1, 0)?;
                assert_eq!(ball[0], u64::from(round) + 1);
            }
            1 => {
                pg.recv(&mut ball, 0, 0)?;
                ball[0] += 1;
                pg.send(&ball, 0, 0)?;
            }
            _ => {}
        }
    }
    if pg.rank() == 0 {
        println!(
            "rank 0: {ROUNDS} round trips of {} bytes, {:?} each",
            ball.len() * 8,
            start.elapsed() / ROUNDS
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
