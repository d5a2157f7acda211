//! The typed, `torch.distributed`-shaped API of `dist`: process groups, typed collectives over
//! slices, async work handles, sub-groups and device meshes.
//!
//! ```
//! use dist_collective::{ReduceOp, testing::run_world};
//!
//! // Four ranks, each a thread with its own process group over loopback TCP. In a real job
//! // each rank is a process: `let pg = init_process_group(InitOptions::new())?;` (env://).
//! let results = run_world(4, |pg| {
//!     // all_reduce in place, like `dist.all_reduce(t)`.
//!     let mut grad = vec![pg.rank() as f32; 3];
//!     pg.all_reduce(&mut grad, ReduceOp::Sum)?;
//!
//!     // The async form owns its buffer and gives it back on wait().
//!     let work = pg.all_reduce_async(vec![1u64; 2], ReduceOp::Sum)?;
//!     let ones = work.wait()?;
//!
//!     // Sub-groups: every rank calls new_group; members get Some.
//!     let evens = pg.new_group(&[0, 2])?;
//!     if let Some(g) = &evens {
//!         g.barrier()?;
//!     }
//!     Ok((grad, ones, evens.is_some()))
//! })?;
//! assert_eq!(results[3], (vec![6.0; 3], vec![4, 4], false));
//! assert!(results[2].2);
//! # Ok::<(), dist_collective::Error>(())
//! ```
//!
//! # Process groups
//!
//! [`init_process_group`] creates the default group over every rank of the job from
//! [`InitOptions`] (backend `"gloo"`, `"nccl"` or torch's `"cpu:gloo,cuda:nccl"`; init method `env://`, `tcp://host:port`, `file:///path`, or
//! an explicit [`Store`](dist_backend::Store)); [`destroy_process_group`] forgets it. Explicit
//! [`ProcessGroup`] values are cheap to clone and `Send + Sync`. Sub-groups come from
//! [`ProcessGroup::new_group`], [`ProcessGroup::new_subgroups`] and [`ProcessGroup::split`];
//! every rank of the parent calls them in the same order (a disagreement is an
//! [`Error::GroupMismatch`], not a hang). [`DeviceMesh`] names the dimensions of an n-D layout.
//!
//! # Collectives
//!
//! Typed over `T: Element` (`f32`, `bf16`, `i64`, ...): `all_reduce`, `broadcast`, `reduce`,
//! `all_gather_into` (and list and uneven forms), `reduce_scatter_into` (and uneven),
//! `all_to_all_single`, `all_to_all`, `gather`, `scatter`, `barrier`, `send`/`recv`. Sizes are
//! checked on this rank before anything goes on the wire ([`Error::SizeMismatch`] names the rank,
//! the operation and both sizes). Object collectives (`broadcast_object`, ...) go through serde
//! and are the slow path.
//!
//! # Distributed tensors
//!
//! [`Placement`] and [`ShardLayout`] describe which box of a global tensor each mesh coordinate
//! holds (`torch.chunk` sizes); [`DTensor`] pairs a local buffer with one and redistributes it
//! between any placements, each mesh dimension's change by one collective on that dimension's
//! group.
//!
//! # Ordering and threads
//!
//! Each group has one worker thread: `*_async` operations queue on it and blocking operations
//! take their turn in the same issue order, so every rank issues the group's collectives in the
//! same order. Different groups progress concurrently. Point-to-point operations (`isend`,
//! `irecv`, `batch_isend_irecv`) run on a separate engine with its own connections; receives
//! posted before the matching sends, on both sides, do not deadlock.
//!
//! # Debugging
//!
//! `DIST_DEBUG=INFO|DETAIL` turns on `tracing` events (and, at `DETAIL`, a cross-rank check of
//! every collective's op, dtype and count). Each group keeps a flight recorder of its last
//! operations ([`ProcessGroup::dump_flight_recorder`]); a group's first failure dumps it once,
//! as JSON, into `DIST_FLIGHT_RECORDER_DIR` (or [`InitOptions::flight_recorder_dir`]) or a
//! `warn` event. A collective that times out fails with [`Error::CollectiveTimeout`], whose
//! [`ProgressReport`] says which ranks finished which collective (`rank 1 finished all_reduce
//! #4 but did not join #5`). [`ProcessGroup::monitored_barrier`] names the ranks that did not
//! arrive.
//!
//! # Features
//!
//! `gloo` (default): the pure-Rust CPU backend. Without it no backend is compiled in and
//! [`init_process_group`] fails with [`Error::UnknownBackend`].
//!
//! `nccl` (off): the GPU backend (`dist-nccl`), for device buffers ([`ProcessGroup`]'s
//! `*_device` collectives over [`DeviceBuffer`](dist_backend::DeviceBuffer)). It loads libcuda
//! and libnccl at run time: building needs no CUDA, and a machine without them gets
//! `dist_backend::Error::Unavailable` naming the library when a group is created. With
//! `"cpu:gloo,cuda:nccl"` one group serves each call by where its buffers live; `"cuda:gloo"`
//! serves device buffers with Gloo through pinned host memory (opt-in: it is slow). Without the
//! feature, `"nccl"` is [`Error::UnknownBackend`].

#![forbid(unsafe_code)]
mod backend_spec;
mod debug;
mod device;
mod dispatch;
mod dtensor;
mod error;
mod exec;
mod group;
mod init;
mod mesh;
mod missing;
mod monitor;
mod object;
mod p2p;
mod placement;
mod progress;
mod subgroup;
mod teardown;
pub mod testing;
mod work;

pub use debug::{DEFAULT_FLIGHT_RECORDER_SIZE, DebugLevel, FlightEntry, OpState};
pub use dist_wire::{DType, Element, ReduceOp};
pub use dtensor::DTensor;
pub use error::{Error, Result};
pub use group::{AVAILABLE_BACKENDS, P2pOp, ProcessGroup};
pub use init::{
    InitMethod, InitOptions, all_gather_into, all_reduce, barrier, broadcast, default_group,
    destroy_process_group, get_backend, get_rank, get_world_size, init_process_group,
    is_initialized, new_group, new_process_group, recv, reduce_scatter_into, send,
};
pub use mesh::DeviceMesh;
pub use placement::{Chunk, Placement, ShardLayout, chunk_range, padded_chunk_len};
pub use progress::{CollectiveRef, ProgressReport, RankProgress, RankState};
pub use work::Work;
