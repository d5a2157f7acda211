//! What DTensor's redistribution costs over the bare collective it runs: each transition
//! beside the same collective on the same bytes, at 2 ranks (threads over loopback TCP), in
//! one invocation so the ratio is like for like. The difference is DTensor's local copies
//! (packing blocks, placing gathered pieces along a dimension other than 0).
#![allow(missing_docs)] // criterion's macros generate undocumented public functions.

use std::sync::mpsc::{Receiver, Sender, channel};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};
use dist_collective::testing::run_world;
use dist_collective::{DTensor, DeviceMesh, Placement};

const WORLD: usize = 2;

#[derive(Clone, Copy, Debug)]
enum Case {
    /// The bare all_gather_into of a Shard(0) piece.
    RawAllGather,
    /// Shard(0) -> Replicate through DTensor.
    GatherDim0,
    /// Shard(1) -> Replicate through DTensor (pieces placed along dim 1).
    GatherDim1,
    /// The bare all_to_all_single of a Shard(0) piece.
    RawAllToAll,
    /// Shard(0) -> Shard(1) through DTensor.
    ShardToShard,
}

/// One command to every rank: run `case` on a `[rows, rows]` tensor `iters` times.
type Cmd = Option<(Case, usize, u64)>;

/// A persistent world: each rank thread runs commands and rank 0 reports its elapsed time, so
/// criterion's `iter_custom` drives all ranks in lockstep.
struct World {
    cmds: Vec<Sender<Cmd>>,
    done: Receiver<Duration>,
    handle: Option<thread::JoinHandle<()>>,
}

impl World {
    fn start() -> Self {
        let (cmds, rxs): (Vec<_>, Vec<_>) = (0..WORLD).map(|_| channel::<Cmd>()).unzip();
        let rxs: Arc<Vec<Mutex<Receiver<Cmd>>>> =
            Arc::new(rxs.into_iter().map(Mutex::new).collect());
        let (done_tx, done) = channel();
        let done_tx = Mutex::new(done_tx);
        let handle = thread::spawn(move || {
            run_world(WORLD, |pg| {
                let mesh = DeviceMesh::new(&pg, &[("x", WORLD)])?;
                let rx = rxs[pg.rank()].lock().expect("receiver");
                while let Ok(Some((case, rows, iters))) = rx.recv() {
                    let shape = [rows, rows];
                    let full = vec![1.0f32; rows * rows];
                    let t0 =
                        DTensor::distribute_tensor(&full, &shape, &mesh, &[Placement::Shard(0)])?;
                    let t1 =
                        DTensor::distribute_tensor(&full, &shape, &mesh, &[Placement::Shard(1)])?;
                    let local = t0.to_local().to_vec();
                    let mut out = vec![0.0f32; rows * rows];
                    let mut out_a2a = vec![0.0f32; local.len()];
                    pg.barrier()?;
                    let start = Instant::now();
                    for _ in 0..iters {
                        match case {
                            Case::RawAllGather => pg.all_gather_into(&local, &mut out)?,
                            Case::GatherDim0 => drop(t0.redistribute(&[Placement::Replicate])?),
                            Case::GatherDim1 => drop(t1.redistribute(&[Placement::Replicate])?),
                            Case::RawAllToAll => {
                                pg.all_to_all_single(&mut out_a2a, &local, None, None)?
                            }
                            Case::ShardToShard => drop(t0.redistribute(&[Placement::Shard(1)])?),
                        }
                    }
                    let took = start.elapsed();
                    if pg.rank() == 0 {
                        done_tx.lock().expect("sender").send(took).expect("send");
                    }
                }
                Ok(())
            })
            .expect("bench world");
        });
        World {
            cmds,
            done,
            handle: Some(handle),
        }
    }

    fn run(&self, case: Case, rows: usize, iters: u64) -> Duration {
        for c in &self.cmds {
            c.send(Some((case, rows, iters))).expect("command");
        }
        self.done.recv().expect("result")
    }
}

impl Drop for World {
    fn drop(&mut self) {
        for c in &self.cmds {
            let _ = c.send(None);
        }
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}

fn redistribute(c: &mut Criterion) {
    let world = World::start();
    for rows in [256usize, 1024] {
        let mut g = c.benchmark_group(format!("dtensor_{rows}x{rows}_f32_2ranks"));
        g.sample_size(20);
        for case in [
            Case::RawAllGather,
            Case::GatherDim0,
            Case::GatherDim1,
            Case::RawAllToAll,
            Case::ShardToShard,
        ] {
            g.bench_with_input(
                BenchmarkId::new(format!("{case:?}"), rows),
                &rows,
                |b, &rows| b.iter_custom(|iters| world.run(case, rows, iters)),
            );
        }
        g.finish();
    }
}

criterion_group!(benches, redistribute);
criterion_main!(benches);
