//! Parallelism layers over `dist-collective`: [`Ddp`], distributed data parallelism in the
//! manner of torch's `DistributedDataParallel`; [`Fsdp`], fully sharded data parallelism in the
//! manner of torch's FSDP2, with [`checkpoint`], a sharded checkpoint that reloads at any world
//! size; [`pipeline`], pipeline parallelism (schedules as data, a validator and simulator, and
//! an executor) in the manner of `torch.distributed.pipelining`; [`tp`], Megatron-style tensor
//! parallelism on DTensor parameters (torch's `parallelize_module`); and [`SyncBatchNorm`].
//!
//! The core is framework-agnostic: a model is described by its parameters ([`ParamInfo`]:
//! name and shape), and DDP reads gradients from, and writes averaged gradients back to,
//! slices the user's framework owns. Any autograd library (candle, burn, a hand-written
//! backward) plugs in by calling [`Ddp::mark_ready`] as each gradient becomes available and
//! [`Ddp::finish`] at the end of the backward pass.
//!
//! ```
//! use dist_collective::testing::run_world;
//! use dist_parallel::{Ddp, DdpOptions, ParamInfo};
//!
//! let out = run_world(2, |pg| {
//!     let params = vec![ParamInfo::new("w", &[2, 2]), ParamInfo::new("b", &[2])];
//!     let mut w = vec![pg.rank() as f32; 4]; // rank 0's values win at construction
//!     let mut b = vec![0.0f32; 2];
//!     let mut ddp = Ddp::new(pg.clone(), params, DdpOptions::default(), &mut [&mut w, &mut b]).unwrap();
//!     assert_eq!(w, [0.0; 4]);
//!     // Backward produced these local gradients (last layer first):
//!     let mut gb = vec![pg.rank() as f32; 2];
//!     let mut gw = vec![1.0 + pg.rank() as f32; 4];
//!     ddp.mark_ready(1, &gb).unwrap();
//!     ddp.mark_ready(0, &gw).unwrap();
//!     ddp.finish(&mut [&mut gw, &mut gb]).unwrap();
//!     Ok((gw, gb))
//! })
//! .unwrap();
//! assert_eq!(out[0], (vec![1.5; 4], vec![0.5; 2]));
//! assert_eq!(out[0], out[1]);
//! ```

#![forbid(unsafe_code)]
#[cfg(feature = "candle")]
pub mod candle_comm;
pub mod checkpoint;
mod ddp;
mod error;
mod fsdp;
pub mod optim;
pub mod pipeline;
pub mod sync_bn;
pub mod tp;

pub use ddp::bucket::{BucketLayout, BucketSpec};
pub use ddp::hooks::{AllReduceMean, Bf16Compress, Bucket, CommHook, Fp16Compress, PowerSgd};
pub use ddp::{Ddp, DdpOptions, ParamInfo, StepStats};
pub use error::{Error, Result};
#[cfg(feature = "candle")]
pub use fsdp::CandleFsdp;
pub use fsdp::precision::{ComputeElement, ReduceDtype};
pub use fsdp::{Fsdp, FsdpMemory, FsdpOptions, FsdpStepStats, ShardMut, StateDict};
#[cfg(feature = "candle")]
pub use sync_bn::CandleSyncBatchNorm;
pub use sync_bn::{BatchNormOptions, BnGrads, BnSaved, SyncBatchNorm};
