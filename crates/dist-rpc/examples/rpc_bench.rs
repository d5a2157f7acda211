//! Latency and throughput of `rpc_sync` between two processes: rank 0 calls rank 1 and prints
//! medians (and the 90th percentile) of
//!
//! * a small typed call (`add((i64, i64)) -> i64`, JSON both ways): the round trip;
//! * 1 MiB of raw bytes to a bytes handler that answers 8 bytes (`rpc_sync_bytes`);
//! * 1 MiB of raw bytes echoed back (1 MiB each way);
//! * 1 MiB as a serde `Vec<f32>` (262,144 floats as JSON) answered by their sum, to show what
//!   the raw path saves.
//!
//! ```sh
//! cargo build --release -p dist-rpc --example rpc_bench -p dist-run
//! ./target/release/distrun --nproc-per-node 2 -- ./target/release/examples/rpc_bench
//! ```

use std::time::{Duration, Instant};

use dist_rpc::{Handlers, Rpc, RpcOptions, init_rpc};

fn stats(mut v: Vec<Duration>) -> (Duration, Duration) {
    v.sort();
    let at = |q: f64| v[((v.len() - 1) as f64 * q).round() as usize];
    (at(0.5), at(0.9))
}

fn time(iters: usize, warmup: usize, mut f: impl FnMut()) -> (Duration, Duration) {
    for _ in 0..warmup {
        f();
    }
    let samples = (0..iters)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed()
        })
        .collect();
    stats(samples)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let rank: usize = std::env::var("RANK")?.parse()?;
    let h = Handlers::new();
    h.register("add", |(a, b): (i64, i64)| Ok(a + b));
    h.register_bytes("len", |_: &Rpc, b: Vec<u8>| {
        Ok((b.len() as u64).to_le_bytes().to_vec())
    });
    h.register_bytes("echo", |_: &Rpc, b: Vec<u8>| Ok(b));
    h.register("sum_f32", |v: Vec<f32>| Ok(v.iter().sum::<f32>()));
    let rpc = init_rpc(
        &format!("w{rank}"),
        None,
        None,
        RpcOptions::new().handlers(h),
    )?;
    if rank == 0 {
        let mib = 1usize << 20;
        let bytes: Vec<u8> = (0..mib).map(|i| i as u8).collect();
        let floats: Vec<f32> = (0..mib / 4).map(|i| i as f32).collect();
        let mut err: Option<dist_rpc::Error> = None;
        let mut keep = |r: dist_rpc::Result<()>| {
            if let Err(e) = r {
                err.get_or_insert(e);
            }
        };
        let small = time(5000, 500, || {
            keep(rpc.rpc_sync::<_, i64>("w1", "add", &(1i64, 2i64)).map(drop))
        });
        let to = time(300, 30, || {
            keep(rpc.rpc_sync_bytes("w1", "len", &bytes).map(drop))
        });
        let echo = time(300, 30, || {
            keep(rpc.rpc_sync_bytes("w1", "echo", &bytes).map(drop))
        });
        let json = time(30, 3, || {
            keep(rpc.rpc_sync::<_, f32>("w1", "sum_f32", &floats).map(drop))
        });
        if let Some(e) = err {
            return Err(e.into());
        }
        let mbps = |d: Duration, n: usize| n as f64 / d.as_secs_f64() / 1e6;
        println!("| call | median | p90 | throughput (median) |");
        println!("| --- | --- | --- | --- |");
        println!(
            "| small rpc_sync round trip | {:.1} µs | {:.1} µs | |",
            small.0.as_secs_f64() * 1e6,
            small.1.as_secs_f64() * 1e6
        );
        println!(
            "| 1 MiB raw bytes in, 8 bytes back | {:.0} µs | {:.0} µs | {:.0} MB/s |",
            to.0.as_secs_f64() * 1e6,
            to.1.as_secs_f64() * 1e6,
            mbps(to.0, mib)
        );
        println!(
            "| 1 MiB raw bytes echoed (2 MiB moved) | {:.0} µs | {:.0} µs | {:.0} MB/s |",
            echo.0.as_secs_f64() * 1e6,
            echo.1.as_secs_f64() * 1e6,
            mbps(echo.0, 2 * mib)
        );
        println!(
            "| 1 MiB as serde Vec<f32> (JSON), f32 back | {:.0} µs | {:.0} µs | {:.0} MB/s |",
            json.0.as_secs_f64() * 1e6,
            json.1.as_secs_f64() * 1e6,
            mbps(json.0, mib)
        );
    }
    rpc.shutdown()?;
    Ok(())
}
