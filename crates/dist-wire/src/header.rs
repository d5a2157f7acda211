//! The frame header every data message between ranks carries.
//!
//! Layout (all integers little-endian, [`HEADER_LEN`] = 64 bytes):
//!
//! | bytes | field |
//! | --- | --- |
//! | 0..4 | magic `b"DST1"` as u32 |
//! | 4 | version |
//! | 5 | collective op code |
//! | 6 | dtype code |
//! | 7 | reduce op code |
//! | 8..12 | group id |
//! | 12..16 | sender rank |
//! | 16..24 | sequence number of the op within the group |
//! | 24..32 | element count of the whole op (as the sender sees it) |
//! | 32..36 | root or peer rank (`u32::MAX` when none) |
//! | 36..40 | tag |
//! | 40..48 | offset in bytes of this chunk within the op's buffer |
//! | 48..56 | payload length in bytes (of the data, wherever it lies) |
//! | 56 | flags: [`FrameHeader::REMOTE`], [`FrameHeader::ACK`] |
//! | 57..61 | split-sizes fingerprint ([`splits_fingerprint`]; 0 when the op has none) |
//! | 61..64 | reduce-op parameter fingerprint ([`crate::ReduceOp::param_fingerprint`], 24 bits; 0 when none) |
//!
//! A frame's payload normally follows its header. A [`FrameHeader::REMOTE`] frame carries a
//! [`PayloadRef`] (16 bytes) instead: the receiver copies the data straight out of the
//! sender's memory (one copy instead of two through the kernel's socket buffers) and answers
//! with an [`FrameHeader::ACK`] frame once it has the whole message, after which the sender may
//! reuse its buffer.
//!
//! The receiver compares op, dtype, count, reduce op (with its parameter, `PremulSum`'s
//! scale), root, split sizes and sequence number with what it expects, so two ranks that
//! disagree fail fast with both sides named instead of exchanging garbage.
//!
//! A [`CollectiveOp::Close`] frame is not data: it says why the sender leaves the group, as a
//! [`CloseReason`] (a clean goodbye, or an abort naming the rank to blame and the cause). Its
//! `tag` is 0 for a goodbye and `culprit + 1` for an abort, its `count` the cause code
//! ([`CloseReason::LOST`], [`CloseReason::MISMATCH`], [`CloseReason::STALLED`]), and an abort for a mismatch carries the
//! two headers that disagreed as its payload ([`MAX_CLOSE_PAYLOAD`] bytes at most).

use std::fmt;

use crate::{DType, WireError};

/// Frame magic: `b"DST1"` read as a little-endian u32.
pub const MAGIC: u32 = u32::from_le_bytes(*b"DST1");
/// The protocol version this build speaks.
pub const VERSION: u8 = 4;
/// Encoded size of a [`FrameHeader`].
pub const HEADER_LEN: usize = 64;
/// Encoded size of a [`PayloadRef`].
pub const PAYLOAD_REF_LEN: usize = 16;
/// Root/peer value meaning "no root".
pub const NO_ROOT: u32 = u32::MAX;
/// The largest payload a [`CollectiveOp::Close`] frame may carry: the two headers of a
/// mismatch. A longer one is rejected by [`FrameHeader::decode`], before anything is read.
pub const MAX_CLOSE_PAYLOAD: usize = 2 * HEADER_LEN;

/// The operation a frame belongs to, named as torch names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum CollectiveOp {
    /// `all_reduce`.
    AllReduce,
    /// `broadcast`.
    Broadcast,
    /// `reduce`.
    Reduce,
    /// `all_gather` (equal or uneven counts).
    AllGather,
    /// `reduce_scatter` (equal or uneven counts).
    ReduceScatter,
    /// `all_to_all` (equal or with split sizes).
    AllToAll,
    /// `gather`.
    Gather,
    /// `scatter`.
    Scatter,
    /// `barrier`.
    Barrier,
    /// Point-to-point `send`/`recv`.
    SendRecv,
    /// Not an operation: sent once by a rank that leaves the group cleanly, so that its peers
    /// can tell a clean exit from a crash.
    Close,
}

impl CollectiveOp {
    const ALL: [CollectiveOp; 11] = [
        CollectiveOp::AllReduce,
        CollectiveOp::Broadcast,
        CollectiveOp::Reduce,
        CollectiveOp::AllGather,
        CollectiveOp::ReduceScatter,
        CollectiveOp::AllToAll,
        CollectiveOp::Gather,
        CollectiveOp::Scatter,
        CollectiveOp::Barrier,
        CollectiveOp::SendRecv,
        CollectiveOp::Close,
    ];

    /// torch's name for the op.
    pub const fn name(self) -> &'static str {
        match self {
            CollectiveOp::AllReduce => "all_reduce",
            CollectiveOp::Broadcast => "broadcast",
            CollectiveOp::Reduce => "reduce",
            CollectiveOp::AllGather => "all_gather",
            CollectiveOp::ReduceScatter => "reduce_scatter",
            CollectiveOp::AllToAll => "all_to_all",
            CollectiveOp::Gather => "gather",
            CollectiveOp::Scatter => "scatter",
            CollectiveOp::Barrier => "barrier",
            CollectiveOp::SendRecv => "send/recv",
            CollectiveOp::Close => "close",
        }
    }

    /// The one-byte wire code.
    pub fn code(self) -> u8 {
        Self::ALL.iter().position(|&o| o == self).unwrap_or(0) as u8
    }

    /// Inverse of [`CollectiveOp::code`].
    pub fn from_code(code: u8) -> Option<Self> {
        Self::ALL.get(usize::from(code)).copied()
    }

    /// Whether the op takes a reduce op (which then must be the same on every rank).
    pub const fn reduces(self) -> bool {
        matches!(
            self,
            CollectiveOp::AllReduce | CollectiveOp::Reduce | CollectiveOp::ReduceScatter
        )
    }

    /// Whether the op takes a root (which then must be the same on every rank).
    pub const fn rooted(self) -> bool {
        matches!(
            self,
            CollectiveOp::Broadcast
                | CollectiveOp::Reduce
                | CollectiveOp::Gather
                | CollectiveOp::Scatter
        )
    }
}

/// A fingerprint of per-rank element counts (`all_gather`/`reduce_scatter` split sizes) for
/// [`FrameHeader::splits`]: FNV-1a over the counts, never 0 (0 means "no split sizes"), so
/// that ranks passing different split sizes with the same total are caught on the first frame.
pub fn splits_fingerprint(counts: &[usize]) -> u32 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for c in counts {
        for b in (*c as u64).to_le_bytes() {
            h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
        }
    }
    let folded = (h ^ (h >> 32)) as u32;
    folded.max(1)
}

impl fmt::Display for CollectiveOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The decoded header of one data frame.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FrameHeader {
    /// The operation.
    pub op: CollectiveOp,
    /// Element type.
    pub dtype: DType,
    /// Reduce op wire code (see [`crate::ReduceOp::code`]); 0 when the op does not reduce.
    pub reduce: u8,
    /// Group the op runs in.
    pub group: u32,
    /// Rank that sent the frame.
    pub sender: u32,
    /// Sequence number of the op within the group.
    pub seq: u64,
    /// Element count of the whole op as the sender sees it.
    pub count: u64,
    /// Root or peer rank, [`NO_ROOT`] when none.
    pub root: u32,
    /// User tag (point-to-point) or algorithm step.
    pub tag: u32,
    /// Offset in bytes of this chunk within the op's buffer.
    pub offset: u64,
    /// Payload bytes of this frame: following the header, or in the sender's memory when
    /// the frame is [`FrameHeader::REMOTE`].
    pub payload_len: u64,
    /// [`FrameHeader::REMOTE`] and [`FrameHeader::ACK`] bits; 0 for an ordinary frame.
    pub flags: u8,
    /// [`splits_fingerprint`] of the op's per-rank split sizes, 0 when it has none.
    pub splits: u32,
    /// [`crate::ReduceOp::param_fingerprint`] of the reduce op's parameter (`PremulSum`'s
    /// scale), 0 when it has none. Only the low 24 bits travel.
    pub reduce_arg: u32,
}

impl FrameHeader {
    /// Flag: a [`PayloadRef`] follows the header instead of the payload.
    pub const REMOTE: u8 = 1;
    /// Flag: not data but the receiver's acknowledgement that it copied a whole message sent
    /// as [`FrameHeader::REMOTE`] frames (the header names that message); no payload follows.
    pub const ACK: u8 = 2;
    const KNOWN_FLAGS: u8 = Self::REMOTE | Self::ACK;

    /// Bytes that follow this header on the wire.
    pub fn wire_payload_len(&self) -> u64 {
        if self.flags & Self::ACK != 0 {
            0
        } else if self.flags & Self::REMOTE != 0 {
            PAYLOAD_REF_LEN as u64
        } else {
            self.payload_len
        }
    }

    /// Writes the header's [`HEADER_LEN`] bytes.
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[0..4].copy_from_slice(&MAGIC.to_le_bytes());
        b[4] = VERSION;
        b[5] = self.op.code();
        b[6] = self.dtype.code();
        b[7] = self.reduce;
        b[8..12].copy_from_slice(&self.group.to_le_bytes());
        b[12..16].copy_from_slice(&self.sender.to_le_bytes());
        b[16..24].copy_from_slice(&self.seq.to_le_bytes());
        b[24..32].copy_from_slice(&self.count.to_le_bytes());
        b[32..36].copy_from_slice(&self.root.to_le_bytes());
        b[36..40].copy_from_slice(&self.tag.to_le_bytes());
        b[40..48].copy_from_slice(&self.offset.to_le_bytes());
        b[48..56].copy_from_slice(&self.payload_len.to_le_bytes());
        b[56] = self.flags;
        b[57..61].copy_from_slice(&self.splits.to_le_bytes());
        b[61..64].copy_from_slice(&self.reduce_arg.to_le_bytes()[..3]);
        b
    }

    /// Decodes a header from the start of `bytes`. Never panics: any input gives a header or a
    /// typed error.
    pub fn decode(bytes: &[u8]) -> Result<Self, WireError> {
        let Some(b) = bytes.get(..HEADER_LEN) else {
            return Err(WireError::Truncated {
                what: "frame header",
                needed: HEADER_LEN,
                have: bytes.len(),
            });
        };
        let u32_at = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        let u64_at = |i: usize| {
            let mut a = [0u8; 8];
            a.copy_from_slice(&b[i..i + 8]);
            u64::from_le_bytes(a)
        };
        let magic = u32_at(0);
        if magic != MAGIC {
            return Err(WireError::BadMagic {
                found: magic,
                expected: MAGIC,
            });
        }
        if b[4] != VERSION {
            return Err(WireError::UnsupportedVersion {
                found: b[4],
                supported: VERSION,
            });
        }
        let op = CollectiveOp::from_code(b[5]).ok_or(WireError::UnknownCode {
            field: "collective op",
            value: u64::from(b[5]),
        })?;
        let dtype = DType::from_code(b[6]).ok_or(WireError::UnknownCode {
            field: "dtype",
            value: u64::from(b[6]),
        })?;
        if b[7] > 8 {
            return Err(WireError::UnknownCode {
                field: "reduce op",
                value: u64::from(b[7]),
            });
        }
        let flags = b[56];
        if flags & !Self::KNOWN_FLAGS != 0 || flags == Self::KNOWN_FLAGS {
            return Err(WireError::UnknownCode {
                field: "frame flags",
                value: u64::from(flags),
            });
        }
        if op == CollectiveOp::Close {
            // Checked here, before anyone reads (or allocates for) the payload.
            let len = u64_at(48);
            if flags != 0 {
                return Err(WireError::UnknownCode {
                    field: "close frame flags",
                    value: u64::from(flags),
                });
            }
            if len > MAX_CLOSE_PAYLOAD as u64 {
                return Err(WireError::TooLong {
                    what: "close frame payload",
                    len,
                    limit: MAX_CLOSE_PAYLOAD as u64,
                });
            }
        }
        Ok(FrameHeader {
            op,
            dtype,
            reduce: b[7],
            group: u32_at(8),
            sender: u32_at(12),
            seq: u64_at(16),
            count: u64_at(24),
            root: u32_at(32),
            tag: u32_at(36),
            offset: u64_at(40),
            payload_len: u64_at(48),
            flags,
            splits: u32_at(57),
            reduce_arg: u32::from_le_bytes([b[61], b[62], b[63], 0]),
        })
    }
}

/// What a [`CollectiveOp::Close`] frame announces: why its sender leaves the group.
///
/// A rank that aborts a group tells every peer whom to blame and why, so that a rank which
/// did not see the failure itself reports the rank that caused it (and, for a mismatch, the two
/// calls that disagreed) rather than the rank whose connection it saw close.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum CloseReason {
    /// The sender leaves cleanly (it destroyed the group or exited).
    Goodbye,
    /// The sender aborted because it lost rank `culprit` (its connection closed without a
    /// goodbye, or broke), saw it lost itself or was told so.
    Lost {
        /// The rank that was lost.
        culprit: u32,
    },
    /// The sender aborted because two ranks called different collectives (or one with
    /// different arguments): `found` is what the reporting rank called (as its frames would
    /// have said) and `met` the frame it received, from `culprit`. Their `tag`s are 0, or,
    /// when the two ranks differed only in the algorithm they ran for the call, the two
    /// algorithm steps that met.
    Mismatch {
        /// The rank whose frame disagreed with the reporter's call.
        culprit: u32,
        /// The reporter's side: the header it would have sent.
        found: FrameHeader,
        /// The other side: the header it received.
        met: FrameHeader,
    },
    /// The sender aborted because its operation timed out waiting for rank `culprit` (which
    /// may be stopped or stuck rather than gone), saw it itself or was told so.
    Stalled {
        /// The rank the sender was waiting for.
        culprit: u32,
    },
}

impl CloseReason {
    /// Cause code (in `count`) of an abort after losing a rank.
    pub const LOST: u64 = 0;
    /// Cause code (in `count`) of an abort after a mismatch.
    pub const MISMATCH: u64 = 1;
    /// Cause code (in `count`) of an abort after a timeout.
    pub const STALLED: u64 = 2;

    /// The whole `Close` frame from `sender`: header, then payload.
    pub fn encode(&self, sender: u32) -> Vec<u8> {
        let (tag, count, payload): (u32, u64, Vec<u8>) = match self {
            CloseReason::Goodbye => (0, 0, Vec::new()),
            CloseReason::Lost { culprit } => (culprit.saturating_add(1), Self::LOST, Vec::new()),
            CloseReason::Stalled { culprit } => {
                (culprit.saturating_add(1), Self::STALLED, Vec::new())
            }
            CloseReason::Mismatch {
                culprit,
                found,
                met,
            } => {
                let mut p = found.encode().to_vec();
                p.extend_from_slice(&met.encode());
                (culprit.saturating_add(1), Self::MISMATCH, p)
            }
        };
        let h = FrameHeader {
            op: CollectiveOp::Close,
            dtype: DType::U8,
            reduce: 0,
            group: 0,
            sender,
            seq: 0,
            count,
            root: NO_ROOT,
            tag,
            offset: 0,
            payload_len: payload.len() as u64,
            flags: 0,
            splits: 0,
            reduce_arg: 0,
        };
        let mut out = h.encode().to_vec();
        out.extend_from_slice(&payload);
        out
    }

    /// Decodes the reason of a `Close` frame from its header and its `h.payload_len` payload
    /// bytes. Never panics.
    pub fn decode(h: &FrameHeader, payload: &[u8]) -> Result<Self, WireError> {
        if h.op != CollectiveOp::Close {
            return Err(WireError::UnknownCode {
                field: "close frame op",
                value: u64::from(h.op.code()),
            });
        }
        if payload.len() as u64 != h.payload_len {
            return Err(WireError::Truncated {
                what: "close frame payload",
                needed: h.payload_len.min(MAX_CLOSE_PAYLOAD as u64) as usize,
                have: payload.len(),
            });
        }
        if h.tag == 0 {
            return Ok(CloseReason::Goodbye);
        }
        let culprit = h.tag - 1;
        match h.count {
            Self::LOST => Ok(CloseReason::Lost { culprit }),
            Self::STALLED => Ok(CloseReason::Stalled { culprit }),
            Self::MISMATCH => {
                if payload.len() != MAX_CLOSE_PAYLOAD {
                    return Err(WireError::Truncated {
                        what: "mismatch notice",
                        needed: MAX_CLOSE_PAYLOAD,
                        have: payload.len(),
                    });
                }
                Ok(CloseReason::Mismatch {
                    culprit,
                    found: FrameHeader::decode(&payload[..HEADER_LEN])?,
                    met: FrameHeader::decode(&payload[HEADER_LEN..])?,
                })
            }
            other => Err(WireError::UnknownCode {
                field: "close cause",
                value: other,
            }),
        }
    }
}

/// Where the payload of a [`FrameHeader::REMOTE`] frame lies in the sender's memory.
///
/// `offer` names the sender's offer: the receiver checks, after copying, that the sender still
/// publishes that offer, so a copy that raced with the sender giving up (after a timeout) is
/// detected rather than used.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PayloadRef {
    /// Address of the first payload byte in the sender's address space.
    pub addr: u64,
    /// The sender's offer id (never 0).
    pub offer: u64,
}

impl PayloadRef {
    /// Writes the [`PAYLOAD_REF_LEN`] bytes.
    pub fn encode(&self) -> [u8; PAYLOAD_REF_LEN] {
        let mut b = [0u8; PAYLOAD_REF_LEN];
        b[..8].copy_from_slice(&self.addr.to_le_bytes());
        b[8..].copy_from_slice(&self.offer.to_le_bytes());
        b
    }

    /// Decodes from the start of `bytes`. Never panics.
    pub fn decode(bytes: &[u8]) -> Result<Self, WireError> {
        let Some(b) = bytes.get(..PAYLOAD_REF_LEN) else {
            return Err(WireError::Truncated {
                what: "payload reference",
                needed: PAYLOAD_REF_LEN,
                have: bytes.len(),
            });
        };
        let mut a = [0u8; 8];
        a.copy_from_slice(&b[..8]);
        let addr = u64::from_le_bytes(a);
        a.copy_from_slice(&b[8..]);
        let offer = u64::from_le_bytes(a);
        if offer == 0 {
            return Err(WireError::UnknownCode {
                field: "payload offer",
                value: 0,
            });
        }
        Ok(PayloadRef { addr, offer })
    }
}

impl fmt::Display for FrameHeader {
    /// `rank 1 all_reduce #12 (f32 × 1000)`: the form used in mismatch errors.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "rank {} {} #{} ({} × {})",
            self.sender, self.op, self.seq, self.dtype, self.count
        )
    }
}
