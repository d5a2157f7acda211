//! The one error type of this crate.

use crate::{DType, ReduceOp};

/// Everything that can go wrong while checking, reducing or decoding.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum WireError {
    /// A reduce op was asked of a dtype it is not defined for.
    #[error("reduce op {op} is not defined for dtype {dtype}")]
    InvalidReduceOp {
        /// The op.
        op: ReduceOp,
        /// The dtype.
        dtype: DType,
    },
    /// A result was to be finalized as the reduction of no inputs (a rank count of 0), which
    /// has no average.
    #[error("reduce op {op} over 0 ranks: an average needs at least one input")]
    NoInputs {
        /// The op.
        op: ReduceOp,
    },
    /// Two buffers that must have the same length do not.
    #[error("buffer lengths differ: destination has {dst} bytes, source has {src}")]
    LengthMismatch {
        /// Destination length in bytes.
        dst: usize,
        /// Source length in bytes.
        src: usize,
    },
    /// A byte buffer's length is not a whole number of elements.
    #[error("{len} bytes is not a whole number of {dtype} elements ({} bytes each)", dtype.size())]
    PartialElement {
        /// Length in bytes.
        len: usize,
        /// The dtype.
        dtype: DType,
    },
    /// Fewer bytes than a complete message needs.
    #[error("truncated {what}: need {needed} bytes, have {have}")]
    Truncated {
        /// What was being decoded.
        what: &'static str,
        /// Bytes needed.
        needed: usize,
        /// Bytes available.
        have: usize,
    },
    /// The first bytes are not the frame magic: the peer is not speaking this protocol.
    #[error(
        "bad frame magic {found:#010x} (expected {expected:#010x}): the peer is not a dist rank"
    )]
    BadMagic {
        /// The magic read.
        found: u32,
        /// The magic expected.
        expected: u32,
    },
    /// The peer speaks another protocol version.
    #[error("unsupported frame version {found} (this build speaks {supported})")]
    UnsupportedVersion {
        /// The version read.
        found: u8,
        /// The version this build speaks.
        supported: u8,
    },
    /// A code byte has no meaning.
    #[error("unknown {field} code {value}")]
    UnknownCode {
        /// Which field.
        field: &'static str,
        /// The value read.
        value: u64,
    },
    /// A length field exceeds the limit the decoder was given.
    #[error("{what} of {len} bytes exceeds the limit of {limit}")]
    TooLong {
        /// What was too long.
        what: &'static str,
        /// Its length.
        len: u64,
        /// The limit.
        limit: u64,
    },
}
