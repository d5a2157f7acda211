//! The contract every `dist` backend implements, and the rendezvous every job starts with.
//!
//! * [`Backend`]: the object-safe, type-erased set of torch.distributed operations over
//!   [`BufRef`]/[`BufMut`] (host bytes today, device pointers for GPU backends) and a
//!   [`DType`](dist_wire::DType). The typed API lives in `dist-collective`.
//! * [`store`]: the key-value rendezvous (torch's c10d `Store`): a TCP store that speaks
//!   PyTorch's TCPStore protocol, a file store, an in-memory store and a prefix wrapper.
//! * [`init`]: how rank, world size and the store are found from `env://` (torchrun, Slurm,
//!   Open MPI, PMI), `tcp://host:port` and `file:///path`.
//! * [`Error`]: one error type, whose every message names the rank, the operation and what went
//!   wrong.
//!
//! # The contract
//!
//! **What is validated where.** The typed layer (`dist-collective`) checks everything it can
//! see locally before anything goes on the wire: buffer sizes against counts, roots and peers
//! against the world size, reduce op against dtype. A backend re-checks the invariants its own
//! memory safety depends on (buffer lengths) and returns [`Error::InvalidArgument`] rather than
//! panicking. What only the peers can know (that every rank called the same op with the same
//! dtype, count, reduce op, root and split sizes) is checked by the backend on the wire and
//! reported as [`Error::Mismatch`] on the rank that finds it, and as
//! [`Error::MismatchReported`] on every other rank of the group (a backend tells them), so no
//! rank returns Ok from, or waits out the timeout of, a collective its peers disagree on.
//!
//! **Which errors are possible.** Every operation may return `InvalidArgument`, `Mismatch`,
//! `MismatchReported`, `PeerLost` (a peer's connection closed or reset, seen by this rank or
//! reported by another), `Timeout` (a peer did not deliver within [`OpOptions::timeout`]),
//! `Unsupported` (see [`Capabilities`]) and `Io`; device backends also `Device` (their own
//! error, e.g. an aborted NCCL communicator, as the source). Creating a backend whose run-time
//! libraries are missing fails with `Unavailable`, naming the library.
//!
//! **What "returns" means.** For host buffers an operation returns when it is complete on this
//! rank: the output holds the result and the input may be reused. For device buffers
//! ([`DeviceBuffer`]) it returns once the work is *enqueued* on the buffer's stream; the result is
//! ready when that stream reaches it, as with NCCL. After an error the backend's connections are
//! in an unknown state (as Gloo documents): the group must be destroyed and re-created.
//!
//! **Ordering.** Collectives on one backend instance are issued by one caller at a time and in
//! the same order on every rank (`dist-collective` guarantees it with one worker per group).
//! Point-to-point `send`/`recv` may be called from several threads at once.

// The one `unsafe` (registering the exit hook with `atexit`) is allowed where it is.
#![deny(unsafe_code)]
mod backend;
mod buffer;
mod clock;
mod error;
pub mod error_file;
pub mod exit;
pub mod init;
pub mod net;
pub mod store;

pub use backend::{Backend, Capabilities, DEFAULT_TIMEOUT, OpOptions};
pub use buffer::{BufMut, BufRef, DeviceBuffer};
pub use clock::deadline_after;
pub use error::{AlgoStep, Error, OpDesc, Result};
pub use store::{Store, StoreError};
