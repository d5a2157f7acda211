//! The GPU backend of `dist`: collectives over NCCL on device buffers, loaded at run time.
//!
//! * [`NcclBackend`] implements [`dist_backend::Backend`] for [`dist_backend::DeviceBuffer`]s:
//!   all_reduce, broadcast, reduce, all_gather, reduce_scatter, all_to_all (each with uneven
//!   counts), gather and scatter (grouped send/recv, as torch does), barrier and send/recv;
//!   every dtype (reductions: every one NCCL has, so all but I16), Sum, Product, Min, Max, Avg
//!   and PreMulSum.
//! * [`HostStaging`] lets a host backend (Gloo) serve device buffers by copying through
//!   pinned host memory; it is opt-in (`"cuda:gloo"` in `dist-collective`'s backend string).
//! * Nothing is linked: libcuda and libnccl are opened when a backend is created
//!   ([`ensure_loaded`]); a missing library or symbol is [`Error::Unavailable`] naming it,
//!   never a panic, so a build and its CPU tests need no CUDA.
//!
//! # Communicators, streams, completion
//! One communicator per backend (per group), created on first use on the device of the first
//! buffer (torch's lazy init): rank 0's unique id goes through the group's store, and every
//! rank waits for all to arrive (within the timeout) before `ncclCommInitRank`, which cannot
//! time out itself. [`NcclBackend::split`] is `ncclCommSplit`. Each operation runs on the
//! communicator's own stream, which first waits for an event on the buffer's stream; an end
//! event recorded after it makes the buffer's stream wait in turn. With
//! [`NcclOptions::blocking_wait`] (default) the call returns when the end event has passed, so
//! a `dist-collective` `Work` completes when the GPU has finished.
//!
//! # Failures
//! A watchdog thread per communicator polls every pending operation's end event,
//! `ncclCommGetAsyncError` and each operation's deadline (`OpOptions::timeout`). The first
//! failure aborts the communicator (`ncclCommAbort`, which also frees kernels waiting for a
//! dead peer), and every pending and later operation fails with [`Error::CommAborted`] naming
//! its op and seq, the first failure's, and what this rank had completed. The flight recorder
//! ([`NcclBackend::flight_records`]) keeps the last operations with their state; the group's
//! own recorder in `dist-collective` covers them as it does Gloo's.
//!
//! # Safety
//! Device buffers come from [`dist_backend::DeviceBuffer::from_raw`], which is `unsafe` with
//! its contract stated; every `unsafe` block here says why it holds.

mod alloc;
mod backend;
mod comm;
mod cuda;
mod error;
mod live;
mod loader;
mod options;
mod staging;
mod types;
mod watchdog;

pub use alloc::DeviceAlloc;
pub use backend::NcclBackend;
pub use cuda::device_count;
pub use error::{AbortCause, Error, Result};
pub use loader::ensure_loaded;
pub use options::NcclOptions;
pub use staging::HostStaging;
pub use watchdog::{FlightRecord, OpState};
