//! `dist`: distributed-training communication for Rust, in the spirit of `torch.distributed`.
//!
//! This is the facade. It adds no code of its own but one error type, [`Error`] (with
//! [`Result`]), into which every layer's error converts: it re-exports each `dist-*` crate whole
//! under a short module name, plus a curated flat list of the types nearly every user names.
//! Reach for the modules for everything else.
//!
//! | module | crate | what it holds |
//! | --- | --- | --- |
//! | [`wire`] | `dist-wire` | dtypes, reduce ops and kernels, the frame header, store codec (sans-IO) |
//! | [`backend`] | `dist-backend` | the [`Backend`] contract, rendezvous [`Store`]s, `env://` init |
//! | [`gloo`] | `dist-gloo` | the pure-Rust CPU backend: TCP between hosts, shared memory within one |
//! | `nccl` | `dist-nccl` | the GPU backend over NCCL, loaded at run time (feature `nccl`) |
//! | [`collective`] | `dist-collective` | process groups, typed collectives, async [`Work`], sub-groups, [`DeviceMesh`] |
//! | [`parallel`] | `dist-parallel` | DDP, FSDP and the sharded checkpoint, pipeline and tensor parallelism, SyncBatchNorm |
//! | [`rpc`] | `dist-rpc` | remote calls by name, remote references (`RRef`), graceful shutdown |
//!
//! # When a rank fails
//!
//! Under a launcher (`distrun`, torchrun) a process group records the rank's first panic in
//! the launcher's error file (`TORCHELASTIC_ERROR_FILE`), and the launcher reports it as the
//! job's root cause; [`record`] (torch's `@record`) also records an error `main` returns:
//! `fn main() -> Result<(), Box<dyn std::error::Error>> { dist::record(train) }`.
//!
//! The flat names read like `import torch.distributed as dist`:
//!
//! ```
//! use dist::ReduceOp;
//!
//! // In a job: `let pg = dist::init_process_group(dist::InitOptions::new())?;` on every rank.
//! // Here, three ranks as threads of this process:
//! let sums = dist::run_world(3, |pg| {
//!     let mut t = [1.0f32, pg.rank() as f32];
//!     pg.all_reduce(&mut t, ReduceOp::Sum)?;
//!     Ok(t)
//! })?;
//! assert_eq!(sums, vec![[3.0, 3.0]; 3]);
//! # Ok::<(), dist::Error>(())
//! ```
//!
//! # Semver
//!
//! Re-exporting a crate whole makes its public API part of this one: a breaking release of any
//! re-exported `dist-*` crate is a breaking release of `dist`. The crates are versioned in
//! lock-step (one `version` in the workspace manifest) so this stays easy to follow.
//!
//! # Example
//!
//! Reduction kernels need no process group, so they run anywhere:
//!
//! ```
//! use dist::{DType, Element, ReduceOp};
//!
//! let mut acc = [1.0f32, 2.0, 3.0];
//! dist::wire::reduce_slice(ReduceOp::Max, &mut acc, &[0.5, 5.0, 3.0])?;
//! assert_eq!(acc, [1.0, 5.0, 3.0]);
//!
//! assert_eq!(<f32 as Element>::DTYPE, DType::F32);
//! // Bitwise ops are integer-only; asking for one on floats is a typed error, not a panic.
//! assert!(ReduceOp::BitXor.check(DType::BF16).is_err());
//! # Ok::<(), dist::WireError>(())
//! ```

#![forbid(unsafe_code)]

/// The sans-IO core: element types, reduce ops and kernels, frame header, store codec.
///
/// Re-export of the `dist-wire` crate.
pub use dist_wire as wire;

/// The backend contract, rendezvous stores and launcher-agnostic init.
///
/// Re-export of the `dist-backend` crate.
pub use dist_backend as backend;

/// The pure-Rust CPU backend (TCP full mesh, ring and halving-doubling collectives).
///
/// Re-export of the `dist-gloo` crate.
pub use dist_gloo as gloo;

/// The GPU backend over NCCL (feature `nccl`; libcuda and libnccl are loaded at run time).
///
/// Re-export of the `dist-nccl` crate.
#[cfg(feature = "nccl")]
pub use dist_nccl as nccl;

/// The typed, torch-shaped API: process groups, collectives, async work, sub-groups, meshes.
///
/// Re-export of the `dist-collective` crate.
pub use dist_collective as collective;

/// Parallelism layers: DDP (bucketed, overlapped gradient all-reduce and its hooks), FSDP and
/// the sharded checkpoint (`parallel::checkpoint`), pipeline parallelism
/// (`parallel::pipeline`), tensor parallelism (`parallel::tp`) and SyncBatchNorm.
///
/// Re-export of the `dist-parallel` crate.
pub use dist_parallel as parallel;

pub use dist_parallel::{Ddp, DdpOptions, Fsdp, FsdpOptions, ParamInfo};

/// Remote procedure calls and remote references, after `torch.distributed.rpc`: `init_rpc`,
/// `rpc_sync`/`rpc_async`/`remote` by function name, `RRef` with distributed reference
/// counting, graceful `shutdown`.
///
/// Re-export of the `dist-rpc` crate.
pub use dist_rpc as rpc;

pub use dist_collective::testing::run_world;
pub use dist_collective::{
    DTensor, DeviceMesh, InitOptions, P2pOp, Placement, ProcessGroup, ShardLayout, Work,
    destroy_process_group, get_rank, get_world_size, init_process_group, is_initialized, new_group,
};

mod error;

pub use error::{Error, Result};

pub use dist_backend::error_file::{record, record_panics};
pub use dist_backend::{Backend, BufMut, BufRef, Capabilities, OpOptions, Store, StoreError};
pub use dist_wire::{DType, Element, ReduceOp, WireError, bf16, f16};
