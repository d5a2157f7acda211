//! Rooted-op agreement cost: broadcast and all_reduce over real loopback TCP (ranks as threads),
//! in the same invocation: the fused agreement with a lazy root (the default: the root verifies
//! the others' frames at its next operation), the fused agreement with an eager root (it reads
//! them all before returning), and the dissemination rounds before the data (what groups above
//! `fused_agreement_max_ranks` still run). Each measured batch runs `iters` back-to-back operations on every rank and
//! ends when the last rank is done, so one operation's time is its throughput-bound latency.
#![allow(missing_docs)] // criterion's macros generate undocumented public functions.

use std::sync::Arc;
use std::sync::mpsc::{Receiver, Sender, channel};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use dist_backend::store::HashStore;
use dist_backend::{Backend, BufMut, OpOptions};
use dist_gloo::{GlooBackend, GlooOptions};
use dist_wire::{DType, ReduceOp};

const SIZES: [usize; 6] = [4, 4 << 10, 64 << 10, 1 << 20, 4 << 20, 16 << 20];

#[derive(Clone, Copy)]
enum Kind {
    Broadcast,
    AllReduce,
}

fn run(b: &GlooBackend, kind: Kind, buf: &mut [u8], iters: u64) {
    let opts = OpOptions::with_timeout(Duration::from_secs(60));
    for _ in 0..iters {
        match kind {
            Kind::Broadcast => b.broadcast(BufMut::Host(buf), DType::F32, 0, &opts),
            Kind::AllReduce => b.all_reduce(BufMut::Host(buf), DType::F32, ReduceOp::Sum, &opts),
        }
        .expect("benchmark operation");
    }
}

/// Ranks 1.. of a world, each on a thread waiting for batches to run.
struct World {
    rank0: GlooBackend,
    cmds: Vec<Sender<Option<(Kind, usize, u64)>>>,
    done: Receiver<()>,
    threads: Vec<JoinHandle<()>>,
}

impl World {
    fn new(n: usize, opts: &GlooOptions, name: &str) -> World {
        let store = Arc::new(HashStore::new(Duration::from_secs(30)));
        let prefix = format!("bench-{name}-{n}");
        let mut ranks: Vec<GlooBackend> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..n)
                .map(|r| {
                    let (store, prefix) = (store.clone(), prefix.clone());
                    s.spawn(move || {
                        GlooBackend::connect(&*store, &prefix, r, n, opts).expect("mesh")
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().expect("connect")).collect()
        });
        let (done_tx, done) = channel();
        let mut cmds = Vec::new();
        let mut threads = Vec::new();
        for b in ranks.drain(1..) {
            let (tx, rx) = channel::<Option<(Kind, usize, u64)>>();
            let done_tx = done_tx.clone();
            cmds.push(tx);
            threads.push(std::thread::spawn(move || {
                let mut buf = Vec::new();
                while let Ok(Some((kind, size, iters))) = rx.recv() {
                    buf.resize(size, 0u8);
                    run(&b, kind, &mut buf, iters);
                    done_tx.send(()).expect("driver");
                }
            }));
        }
        World {
            rank0: ranks.pop().expect("rank 0"),
            cmds,
            done,
            threads,
        }
    }

    fn batch(&self, kind: Kind, buf: &mut [u8], iters: u64) -> Duration {
        let t0 = Instant::now();
        for c in &self.cmds {
            c.send(Some((kind, buf.len(), iters))).expect("rank thread");
        }
        run(&self.rank0, kind, buf, iters);
        for _ in &self.cmds {
            self.done.recv().expect("rank thread");
        }
        t0.elapsed()
    }
}

impl Drop for World {
    fn drop(&mut self) {
        for c in &self.cmds {
            let _ = c.send(None);
        }
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

fn agreement(c: &mut Criterion) {
    for n in [2, 4] {
        let base = GlooOptions::from_env();
        let worlds = [
            (
                "dissemination",
                World::new(
                    n,
                    &GlooOptions {
                        fused_agreement_max_ranks: Some(1),
                        ..base.clone()
                    },
                    "dissemination",
                ),
            ),
            (
                "eager",
                World::new(
                    n,
                    &GlooOptions {
                        lazy_root_verification: Some(false),
                        ..base.clone()
                    },
                    "eager",
                ),
            ),
            ("lazy", World::new(n, &base, "lazy")),
        ];
        let mut g = c.benchmark_group(format!("broadcast_ws{n}"));
        g.sample_size(10)
            .warm_up_time(Duration::from_millis(300))
            .measurement_time(Duration::from_secs(2));
        for size in SIZES {
            g.throughput(Throughput::Bytes(size as u64));
            let mut buf = vec![0u8; size];
            for (name, w) in &worlds {
                g.bench_with_input(BenchmarkId::new(*name, size), &size, |b, _| {
                    b.iter_custom(|iters| w.batch(Kind::Broadcast, &mut buf, iters));
                });
            }
        }
        g.finish();
        // all_reduce runs no agreement: the same world's 4-byte all_reduce is the reference
        // a broadcast's latency is compared with.
        let mut g = c.benchmark_group(format!("all_reduce_ws{n}"));
        g.sample_size(10)
            .warm_up_time(Duration::from_millis(300))
            .measurement_time(Duration::from_secs(2));
        let mut buf = vec![0u8; 4];
        g.bench_function("4", |b| {
            b.iter_custom(|iters| worlds[2].1.batch(Kind::AllReduce, &mut buf, iters));
        });
        g.finish();
    }
}

/// Large broadcasts over sockets only (`cross_memory` off, the cross-host path): the pipelined
/// chain beside scatter + ring all-gather, same invocation, 3 and 4 ranks.
fn tcp_broadcast(c: &mut Criterion) {
    for n in [3, 4] {
        let mut base = GlooOptions::from_env();
        base.mesh.cross_memory = false;
        let worlds = [
            (
                "chain",
                World::new(
                    n,
                    &GlooOptions {
                        broadcast_scatter_bytes: Some(usize::MAX),
                        ..base.clone()
                    },
                    "chain",
                ),
            ),
            (
                "scatter_all_gather",
                World::new(
                    n,
                    &GlooOptions {
                        broadcast_scatter_bytes: Some(0),
                        ..base.clone()
                    },
                    "scatter",
                ),
            ),
        ];
        let mut g = c.benchmark_group(format!("broadcast_tcp_ws{n}"));
        g.sample_size(10)
            .warm_up_time(Duration::from_millis(300))
            .measurement_time(Duration::from_secs(3));
        for size in [1 << 20, 4 << 20, 16 << 20, 64 << 20] {
            g.throughput(Throughput::Bytes(size as u64));
            let mut buf = vec![0u8; size];
            for (name, w) in &worlds {
                g.bench_with_input(BenchmarkId::new(*name, size), &size, |b, _| {
                    b.iter_custom(|iters| w.batch(Kind::Broadcast, &mut buf, iters));
                });
            }
        }
        g.finish();
    }
}

criterion_group!(benches, agreement, tcp_broadcast);
criterion_main!(benches);
