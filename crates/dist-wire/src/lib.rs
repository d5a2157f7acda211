//! The sans-IO core of `dist`: everything two ranks must agree on, and nothing that moves bytes.
//!
//! This crate contains no networking code, starts no threads and never reads a clock. It holds:
//!
//! * [`DType`] and the [`Element`] trait that maps Rust types (including [`half::f16`] and
//!   [`half::bf16`]) to it, built on [`bytemuck::Pod`] so byte views need no `unsafe`;
//! * [`ReduceOp`], the rules on which op is valid for which dtype, and the reduction kernels
//!   ([`reduce_into`], [`reduce_slice`]);
//! * [`FrameHeader`], the fixed little-endian header every data message between ranks carries;
//! * [`store`], the incremental codec of the rendezvous store protocol (PyTorch's TCPStore).
//!
//! Decoders in this crate accept any byte string and return a value or a typed [`WireError`];
//! they never panic (property tests in `tests/` hold them to it).
//!
//! ```
//! use dist_wire::{reduce_slice, ReduceOp};
//! let mut acc = [1.0f32, 2.0, 3.0];
//! reduce_slice(ReduceOp::Sum, &mut acc, &[10.0, 20.0, 30.0]).unwrap();
//! assert_eq!(acc, [11.0, 22.0, 33.0]);
//! ```

#![forbid(unsafe_code)]

mod dtype;
mod error;
mod header;
mod op;
mod reduce;
pub mod store;

pub use dtype::{DType, Element};
pub use error::WireError;
pub use header::{
    CloseReason, CollectiveOp, FrameHeader, HEADER_LEN, MAGIC, MAX_CLOSE_PAYLOAD, NO_ROOT,
    PAYLOAD_REF_LEN, PayloadRef, VERSION, splits_fingerprint,
};
pub use op::ReduceOp;
pub use reduce::{
    average_divisors, finalize, finalize_slice, prepare, prepare_changes_input, prepare_slice,
    reduce_into, reduce_slice, splits_average,
};

pub use half::{bf16, f16};

/// The bulk copies of `dist-simd`, for the crates above that may not depend on it directly:
/// [`copy::bulk_of`] for every copy of user data whose size is not known to be small (it
/// steers clear of `memcpy`'s slow distances on AMD CPUs).
pub use dist_simd::copy;
