//! Device-buffer collectives through a process group on real GPUs:
//! * host staging over Gloo (`"cpu:gloo,cuda:gloo"`) on 1-4 ranks sharing GPU 0, the one
//!   multi-rank device path a single-GPU machine can run;
//! * NCCL (`"cpu:gloo,cuda:nccl"`), one rank per GPU, host and device collectives mixed in one
//!   group;
//! * two NCCL ranks on one GPU, which NCCL refuses: both ranks must get an error, not hang.
//!
//! Every result is checked against a host computation. Where libcuda and libnccl do not load
//! or there is no GPU, each test prints "skipped: ..." and passes (`cargo xtask test --gpu`
//! runs them where there is one).
#![cfg(feature = "nccl")]

use std::time::Duration;

use dist_backend::DeviceBuffer;
use dist_collective::testing::run_world_opts;
use dist_collective::{DType, InitOptions, ProcessGroup, ReduceOp};
use dist_nccl::DeviceAlloc;

/// The number of GPUs, or `None` (printing why) where there are none.
fn gpus() -> Option<usize> {
    match dist_nccl::ensure_loaded().and_then(|()| dist_nccl::device_count(0)) {
        Ok(n) if n > 0 => Some(n as usize),
        Ok(_) => {
            println!("skipped: the CUDA driver reports no device");
            None
        }
        Err(e) => {
            println!("skipped: no CUDA driver/NCCL found ({e})");
            None
        }
    }
}

fn opts(backend: &str) -> InitOptions {
    InitOptions::new()
        .backend(backend)
        .timeout(Duration::from_secs(60))
}

/// Rank `r`'s element `i`: small integers, so every f32 sum below is exact.
fn value(r: usize, i: usize) -> f32 {
    (r * 7 + i % 13) as f32
}

fn data(r: usize, n: usize) -> Vec<f32> {
    (0..n).map(|i| value(r, i)).collect()
}

fn upload(device: usize, v: &[f32]) -> DeviceAlloc {
    DeviceAlloc::from_bytes(device as u32, bytemuck::cast_slice(v)).expect("upload")
}

fn download(a: &DeviceAlloc) -> Vec<f32> {
    let bytes = a.download().expect("download");
    bytes
        .chunks_exact(4)
        .map(|c| f32::from_ne_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

/// `a` as a buffer for the group.
#[allow(
    unsafe_code,
    reason = "a device buffer is a raw address, as DeviceBuffer::from_raw says"
)]
fn dev(a: &DeviceAlloc) -> DeviceBuffer {
    // SAFETY: every call given it returns once the operation has finished (blocking device
    // collectives), before `a` is dropped, and nothing else uses `a` meanwhile.
    unsafe { a.buffer() }
}

/// all_reduce, broadcast, all_gather, reduce_scatter and all_to_all of `len` f32 per rank on
/// device `device`, then a host all_reduce in the same group, each checked.
fn every_op(pg: &ProcessGroup, device: usize, len: usize) -> dist_collective::Result<()> {
    let (r, n) = (pg.rank(), pg.world_size());
    let what = |op: &str| format!("{op}, rank {r} of {n}, {len} elements");

    let a = upload(device, &data(r, len));
    pg.all_reduce_device(dev(&a), DType::F32, ReduceOp::Sum)?;
    let summed: Vec<f32> = (0..len)
        .map(|i| (0..n).map(|q| value(q, i)).sum())
        .collect();
    assert_eq!(download(&a), summed, "{}", what("all_reduce"));

    let root = n - 1;
    let b = upload(device, &data(r + 10, len));
    pg.broadcast_device(dev(&b), DType::F32, root)?;
    assert_eq!(download(&b), data(root + 10, len), "{}", what("broadcast"));

    let input = upload(device, &data(r, len));
    let gathered = upload(device, &vec![-1.0; len * n]);
    pg.all_gather_device(dev(&input), dev(&gathered), DType::F32)?;
    let want: Vec<f32> = (0..n).flat_map(|q| data(q, len)).collect();
    assert_eq!(download(&gathered), want, "{}", what("all_gather"));

    // reduce_scatter: rank q's input holds n blocks of len; block j goes to rank j.
    let input = upload(device, &data(r, len * n));
    let out = upload(device, &vec![-1.0; len]);
    pg.reduce_scatter_device(dev(&input), dev(&out), DType::F32, ReduceOp::Sum)?;
    let want: Vec<f32> = (0..len)
        .map(|i| (0..n).map(|q| value(q, r * len + i)).sum())
        .collect();
    assert_eq!(download(&out), want, "{}", what("reduce_scatter"));

    // all_to_all with uneven blocks: rank q sends q + j + (len % 3) elements to rank j.
    let count = |from: usize, to: usize| from + to + len % 3;
    let send: Vec<usize> = (0..n).map(|j| count(r, j)).collect();
    let recv: Vec<usize> = (0..n).map(|j| count(j, r)).collect();
    let block = |from: usize, to: usize| -> Vec<f32> {
        (0..count(from, to))
            .map(|i| (from * 100 + to * 10 + i) as f32)
            .collect()
    };
    let input = upload(
        device,
        &(0..n).flat_map(|j| block(r, j)).collect::<Vec<_>>(),
    );
    let out = upload(device, &vec![-1.0; recv.iter().sum()]);
    pg.all_to_all_device(dev(&input), dev(&out), DType::F32, &send, &recv)?;
    let want: Vec<f32> = (0..n).flat_map(|j| block(j, r)).collect();
    assert_eq!(download(&out), want, "{}", what("all_to_all"));

    let mut host = data(r, len);
    pg.all_reduce(&mut host, ReduceOp::Sum)?;
    assert_eq!(host, summed, "{}", what("host all_reduce"));
    Ok(())
}

/// Lengths: empty, one element, one that no rank count divides, and 4 MiB plus a few.
const LENS: [usize; 4] = [0, 1, 1001, (1 << 20) + 3];

#[test]
fn staged_gloo_serves_device_buffers_on_1_to_4_ranks_of_one_gpu() {
    if gpus().is_none() {
        return;
    }
    for world in 1..=4 {
        run_world_opts(world, opts("cpu:gloo,cuda:gloo"), |pg| {
            for len in LENS {
                every_op(&pg, 0, len)?;
            }
            Ok(())
        })
        .unwrap_or_else(|e| panic!("cuda:gloo on {world} ranks: {e}"));
        println!("cuda:gloo on {world} ranks of GPU 0: every op and size checked");
    }
}

#[test]
fn nccl_serves_device_buffers_beside_gloo_one_rank_per_gpu() {
    let Some(gpus) = gpus() else { return };
    let world = gpus.min(4);
    run_world_opts(world, opts("cpu:gloo,cuda:nccl"), |pg| {
        let device = pg.rank();
        for len in LENS {
            every_op(&pg, device, len)?;
        }
        Ok(())
    })
    .unwrap_or_else(|e| panic!("cpu:gloo,cuda:nccl on {world} ranks: {e}"));
    println!("cpu:gloo,cuda:nccl on {world} rank(s), one per GPU: every op and size checked");
}

#[test]
fn two_nccl_ranks_on_one_gpu_fail_on_both_instead_of_hanging() {
    let Some(gpus) = gpus() else { return };
    if gpus > 1 {
        println!("skipped: this machine has a GPU per rank");
        return;
    }
    let results = std::sync::Mutex::new(Vec::new());
    let outcome = run_world_opts(2, opts("nccl").timeout(Duration::from_secs(20)), |pg| {
        let a = upload(0, &data(pg.rank(), 16));
        let r = pg.all_reduce_device(dev(&a), DType::F32, ReduceOp::Sum);
        let text = match &r {
            Ok(()) => format!("ok: {:?}", download(&a)),
            Err(e) => format!("error: {e}"),
        };
        results.lock().unwrap().push((pg.rank(), text));
        r
    });
    let results = results.into_inner().unwrap();
    println!("two NCCL ranks on GPU 0: {results:?}");
    match outcome {
        // Should a later NCCL accept it, the result must still be right on both ranks.
        Ok(_) => {
            let want: Vec<f32> = (0..16).map(|i| value(0, i) + value(1, i)).collect();
            for (_, text) in &results {
                assert_eq!(text, &format!("ok: {want:?}"));
            }
        }
        Err(e) => {
            let e = e.to_string();
            assert!(e.contains("rank"), "the error names no rank: {e}");
            assert_eq!(results.len(), 2, "a rank did not return: {results:?}");
            assert!(
                results.iter().all(|(_, t)| t.starts_with("error")),
                "one rank failed and the other did not: {results:?}"
            );
        }
    }
}
