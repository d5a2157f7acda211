//! Sub-groups and a 2-D device mesh: even/odd groups, consecutive pairs, and `dp` × `tp` dims.
//!
//! ```sh
//! for r in 0 1 2 3; do RANK=$r WORLD_SIZE=4 MASTER_ADDR=127.0.0.1 MASTER_PORT=29502 \
//!     cargo run -p dist-collective --example subgroups & done; wait
//! ```
//!
//! Without `WORLD_SIZE`, it runs 4 ranks as threads of one process. Needs an even world size.

use dist_collective::{
    DeviceMesh, InitOptions, ProcessGroup, ReduceOp, Result, init_process_group, testing,
};

fn main_rank(pg: ProcessGroup) -> Result<()> {
    let w = pg.world_size();
    let rank = pg.rank();
    // Every rank calls new_group for every group, in the same order; members get Some.
    let evens: Vec<usize> = (0..w).step_by(2).collect();
    let odds: Vec<usize> = (1..w).step_by(2).collect();
    let even = pg.new_group(&evens)?;
    let odd = pg.new_group(&odds)?;
    let mine = even.or(odd).expect("every rank is even or odd");
    let mut x = [rank as i64];
    mine.all_reduce(&mut x, ReduceOp::Sum)?;
    println!("rank {rank}: sum over {:?} = {}", mine.global_ranks(), x[0]);

    let pair = pg.new_subgroups(2)?;
    let mut y = [rank as i64];
    pair.all_reduce(&mut y, ReduceOp::Max)?;
    println!(
        "rank {rank}: max over pair {:?} = {}",
        pair.global_ranks(),
        y[0]
    );

    let mesh = DeviceMesh::new(&pg, &[("dp", w / 2), ("tp", 2)])?;
    let mut z = [1u32];
    mesh.dim("dp").all_reduce(&mut z, ReduceOp::Sum)?;
    println!(
        "rank {rank}: mesh coordinate {:?}, dp size {}",
        mesh.coordinate(),
        z[0]
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
