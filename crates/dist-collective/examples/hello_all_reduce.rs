//! Hello world: every rank contributes its rank; all_reduce sums them.
//!
//! As N processes (env://, what torchrun or `distrun` sets):
//!
//! ```sh
//! for r in 0 1 2 3; do RANK=$r WORLD_SIZE=4 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 \
//!     cargo run -p dist-collective --example hello_all_reduce & done; wait
//! ```
//!
//! Without `WORLD_SIZE`, it runs 4 ranks as threads of one process.

use dist_collective::{InitOptions, ProcessGroup, ReduceOp, Result, init_process_group, testing};

fn main_rank(pg: ProcessGroup) -> Result<()> {
    let mut t = vec![pg.rank() as f32; 4];
    pg.all_reduce(&mut t, ReduceOp::Sum)?;
    let n = pg.world_size() as f32;
    assert_eq!(t, vec![n * (n - 1.0) / 2.0; 4]);
    println!(
        "rank {} of {}: all_reduce -> {t:?}",
        pg.rank(),
        pg.world_size()
    );
    Ok(())
}

fn main() -> Result<()> {
    if std::env::var_os("WORLD_SIZE").is_some() {
        let pg = init_process_group(InitOptions::new())?;
        main_rank(pg)?;
        dist_collective::destroy_process_group();
    } else {
        testing::run_world(4, main_rank)?;
    }
    Ok(())
}
