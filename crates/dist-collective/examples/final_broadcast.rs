//! The shortest real job: one 1 MiB broadcast from rank 0, checked, then `main` returns
//! without any teardown call (no `destroy_process_group`, the handle simply goes out of scope).
//!
//! A rank that leaves first must not make any other rank fail: the default group says goodbye
//! to its peers at process exit (see `dist_collective::init_process_group`). `cargo xtask test`
//! runs it at every world size; `cargo xtask soak` runs it in a loop.
//!
//! ```sh
//! cargo build --release -p dist-run -p dist-collective --examples
//! ./target/release/distrun --nproc-per-node 4 -- ./target/release/examples/final_broadcast
//! ```

use dist_collective::{InitOptions, Result, init_process_group};

/// 1 MiB of `f32`.
const LEN: usize = 1 << 18;

fn main() -> Result<()> {
    let pg = init_process_group(InitOptions::new())?;
    let mut buf: Vec<f32> = if pg.rank() == 0 {
        (0..LEN).map(|i| i as f32).collect()
    } else {
        vec![-1.0; LEN]
    };
    pg.broadcast(&mut buf, 0)?;
    if let Some(i) = (0..LEN).find(|&i| buf[i] != i as f32) {
        eprintln!(
            "rank {}: element {i} is {} after broadcast",
            pg.rank(),
            buf[i]
        );
        std::process::exit(1);
    }
    Ok(())
}
