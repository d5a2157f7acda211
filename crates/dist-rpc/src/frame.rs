//! The frame protocol between two RPC workers: a fixed 32-byte header, then three sections
//! (meta, body, blob) whose lengths the header gives. Sans-IO: encoding and decoding only.
//!
//! ```text
//! offset  size  field
//!      0     4  magic  b"DRPC"
//!      4     1  version (1)
//!      5     1  kind (see `Kind`)
//!      6     2  reserved, zero
//!      8     8  call id (u64, little-endian; 0 for messages that expect no reply)
//!     16     4  meta length (u32): a small JSON document whose shape depends on the kind
//!     20     4  body length (u32): the serde-encoded arguments or result (JSON)
//!     24     8  blob length (u64): raw bytes (the zero-copy argument and result path)
//! ```
//!
//! A decoder takes any 32 bytes and returns a header or a [`FrameError`]; it never panics and
//! checks every length against [`Limits`] before anyone allocates for it.

use serde::{Deserialize, Serialize};

/// The first four bytes of every frame.
pub(crate) const MAGIC: [u8; 4] = *b"DRPC";
/// The protocol version; a peer speaking another one is refused at the handshake.
pub(crate) const VERSION: u8 = 1;
/// Size of the fixed header.
pub(crate) const HEADER_LEN: usize = 32;

/// What a frame is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    /// First frame on a connection: who the dialer is.
    Hello = 1,
    /// A call of a function by name; a `Reply` or `Fail` with the same call id answers it.
    Call = 2,
    /// The successful result of a call or fetch.
    Reply = 3,
    /// The failure of a call or fetch (meta: [`FailMeta`]).
    Fail = 4,
    /// `remote()`: run a function and keep its result as an owned RRef (no reply).
    Remote = 5,
    /// `to_here()`: send the value of an owned RRef back.
    Fetch = 6,
    /// A new user of an RRef (a fork) exists: sent to the owner before the fork travels.
    ForkNotify = 7,
    /// A user of an RRef (a fork) is gone.
    ForkDelete = 8,
    /// The sender will send nothing more; it is shutting down (not crashing).
    Goodbye = 9,
}

impl Kind {
    fn from_u8(b: u8) -> Option<Kind> {
        Some(match b {
            1 => Kind::Hello,
            2 => Kind::Call,
            3 => Kind::Reply,
            4 => Kind::Fail,
            5 => Kind::Remote,
            6 => Kind::Fetch,
            7 => Kind::ForkNotify,
            8 => Kind::ForkDelete,
            9 => Kind::Goodbye,
            _ => return None,
        })
    }
}

/// How large a frame's sections may be; checked before allocating.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Limits {
    /// Largest meta section.
    pub(crate) max_meta: u32,
    /// Largest body section (serde-encoded arguments or result).
    pub(crate) max_body: u32,
    /// Largest blob section (raw bytes).
    pub(crate) max_blob: u64,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_meta: 16 << 20,
            max_body: u32::MAX,
            max_blob: 16 << 30,
        }
    }
}

/// A malformed frame.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[non_exhaustive]
pub enum FrameError {
    /// The first four bytes are not `DRPC`: not an RPC peer.
    #[error("bad magic {found:02x?} (expected b\"DRPC\")")]
    BadMagic {
        /// The bytes found.
        found: [u8; 4],
    },
    /// The peer speaks another protocol version.
    #[error("protocol version {found}, this build speaks {VERSION}")]
    Version {
        /// The version found.
        found: u8,
    },
    /// The kind byte names no frame kind.
    #[error("unknown frame kind {found}")]
    UnknownKind {
        /// The byte found.
        found: u8,
    },
    /// A section is larger than the limit.
    #[error("{section} section of {len} bytes exceeds the limit of {limit}")]
    TooLarge {
        /// Which section.
        section: &'static str,
        /// Its announced length.
        len: u64,
        /// The limit.
        limit: u64,
    },
    /// A frame arrived that the receiver did not expect here (e.g. a second `Hello`).
    #[error("unexpected {kind} frame: {why}")]
    Unexpected {
        /// The frame kind, as text.
        kind: String,
        /// Why it is wrong here.
        why: String,
    },
    /// The meta section is not the JSON document its kind requires.
    #[error("bad {kind} meta: {reason}")]
    BadMeta {
        /// The frame kind, as text.
        kind: String,
        /// The decoder's message.
        reason: String,
    },
}

/// A decoded frame header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Header {
    pub(crate) kind: Kind,
    pub(crate) call_id: u64,
    pub(crate) meta_len: u32,
    pub(crate) body_len: u32,
    pub(crate) blob_len: u64,
}

impl Header {
    /// The 32 header bytes.
    pub(crate) fn encode(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[0..4].copy_from_slice(&MAGIC);
        b[4] = VERSION;
        b[5] = self.kind as u8;
        b[8..16].copy_from_slice(&self.call_id.to_le_bytes());
        b[16..20].copy_from_slice(&self.meta_len.to_le_bytes());
        b[20..24].copy_from_slice(&self.body_len.to_le_bytes());
        b[24..32].copy_from_slice(&self.blob_len.to_le_bytes());
        b
    }

    /// The header of a frame whose sections have these lengths, checked against the limits
    /// its receiver applies ([`Header::decode`]), so that a frame too large is refused by its
    /// sender, naming the section, instead of being sent whole and then refused by a receiver
    /// that can only drop the connection.
    pub(crate) fn for_sections(
        kind: Kind,
        call_id: u64,
        [meta, body, blob]: [usize; 3],
        limits: &Limits,
    ) -> Result<Header, FrameError> {
        // The limits are at most u32::MAX for meta and body, so the checked lengths fit.
        Ok(Header {
            kind,
            call_id,
            meta_len: within("meta", meta as u64, limits.max_meta.into())? as u32,
            body_len: within("body", body as u64, limits.max_body.into())? as u32,
            blob_len: within("blob", blob as u64, limits.max_blob)?,
        })
    }

    /// Decodes and checks 32 header bytes.
    pub(crate) fn decode(b: &[u8; HEADER_LEN], limits: &Limits) -> Result<Header, FrameError> {
        let magic = [b[0], b[1], b[2], b[3]];
        if magic != MAGIC {
            return Err(FrameError::BadMagic { found: magic });
        }
        if b[4] != VERSION {
            return Err(FrameError::Version { found: b[4] });
        }
        let kind = Kind::from_u8(b[5]).ok_or(FrameError::UnknownKind { found: b[5] })?;
        let u32_at = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        let u64_at = |i: usize| {
            let mut x = [0u8; 8];
            x.copy_from_slice(&b[i..i + 8]);
            u64::from_le_bytes(x)
        };
        let h = Header {
            kind,
            call_id: u64_at(8),
            meta_len: u32_at(16),
            body_len: u32_at(20),
            blob_len: u64_at(24),
        };
        within("meta", h.meta_len.into(), limits.max_meta.into())?;
        within("body", h.body_len.into(), limits.max_body.into())?;
        within("blob", h.blob_len, limits.max_blob)?;
        Ok(h)
    }
}

/// `len` when a section of that length is within `limit`.
fn within(section: &'static str, len: u64, limit: u64) -> Result<u64, FrameError> {
    if len > limit {
        return Err(FrameError::TooLarge {
            section,
            len,
            limit,
        });
    }
    Ok(len)
}

/// Globally unique id of a worker-generated object: the generating worker's rank and a
/// counter local to it (torch's `GloballyUniqueId`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct GlobalId {
    /// Rank of the worker that made the id.
    pub worker: usize,
    /// Its counter value.
    pub local: u64,
}

impl std::fmt::Display for GlobalId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}:{}", self.worker, self.local)
    }
}

/// One user's reference to an RRef, as it travels: the owner, the RRef, and the fork id the
/// holder's reference is counted under.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct ForkToken {
    pub(crate) owner: usize,
    pub(crate) rref: GlobalId,
    pub(crate) fork: GlobalId,
}

/// Meta of `Hello`.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct HelloMeta {
    pub(crate) rank: usize,
    pub(crate) name: String,
    /// Random per job (published through the store), so a stray connection from another job
    /// that reused the port is refused.
    pub(crate) job: String,
}

/// Meta of `Call` and `Remote`.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct CallMeta {
    pub(crate) func: String,
    /// RRef forks travelling inside the arguments; the receiver adopts them all, so a fork
    /// its handler never decodes is still released.
    #[serde(default)]
    pub(crate) forks: Vec<ForkToken>,
    /// For `Remote`: the RRef being created and the creator's fork of it.
    #[serde(default)]
    pub(crate) create: Option<ForkToken>,
    /// Whether the arguments are the blob (raw bytes) rather than the body.
    #[serde(default)]
    pub(crate) raw: bool,
}

/// Meta of `Reply`.
#[derive(Debug, Default, Serialize, Deserialize)]
pub(crate) struct ReplyMeta {
    /// RRef forks travelling inside the result.
    #[serde(default)]
    pub(crate) forks: Vec<ForkToken>,
}

/// Why a call failed on the callee.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) enum FailKind {
    /// The handler returned an error.
    Handler,
    /// The handler panicked.
    Panic,
    /// No function of that name is registered.
    UnknownFunction,
    /// The arguments did not decode into the handler's argument type.
    BadArguments,
    /// The result could not be encoded.
    BadResult,
    /// The RRef asked for no longer exists on its owner.
    RRefGone,
    /// The callee is shutting down and refused the call.
    ShuttingDown,
}

/// Meta of `Fail`.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct FailMeta {
    pub(crate) kind: FailKind,
    pub(crate) message: String,
}

/// Meta of `Fetch`, `ForkNotify` and `ForkDelete`.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct RRefMeta {
    pub(crate) token: ForkToken,
}

/// Decodes a meta section of `kind`.
pub(crate) fn decode_meta<T: for<'de> Deserialize<'de>>(
    kind: Kind,
    meta: &[u8],
) -> Result<T, FrameError> {
    serde_json::from_slice(meta).map_err(|e| FrameError::BadMeta {
        kind: format!("{kind:?}"),
        reason: e.to_string(),
    })
}

/// Encodes a meta section (these types always serialise; an empty object is the fallback).
pub(crate) fn encode_meta<T: Serialize>(meta: &T) -> Vec<u8> {
    serde_json::to_vec(meta).unwrap_or_else(|_| b"{}".to_vec())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_round_trips() {
        let h = Header {
            kind: Kind::Reply,
            call_id: 0x0123_4567_89ab_cdef,
            meta_len: 17,
            body_len: 1 << 20,
            blob_len: 5 << 30,
        };
        let b = h.encode();
        assert_eq!(&b[..4], b"DRPC");
        assert_eq!(Header::decode(&b, &Limits::default()), Ok(h));
    }

    /// A sender refuses what its receiver's [`Header::decode`] would: a blob over the 16 GiB
    /// limit, a body over 4 GiB. Before, a blob over the limit was sent and the receiver
    /// dropped the connection, and a body over 4 GiB was refused only as it was cast.
    #[test]
    fn a_sender_refuses_sections_its_receiver_would() {
        let limits = Limits::default();
        let h = Header::for_sections(Kind::Reply, 7, [3, 1 << 20, 16 << 30], &limits).unwrap();
        assert_eq!(Header::decode(&h.encode(), &limits), Ok(h));
        assert_eq!(
            Header::for_sections(Kind::Reply, 7, [3, 0, (16 << 30) + 1], &limits),
            Err(FrameError::TooLarge {
                section: "blob",
                len: (16 << 30) + 1,
                limit: 16 << 30,
            })
        );
        assert!(matches!(
            Header::for_sections(Kind::Call, 7, [3, 1 << 32, 0], &limits),
            Err(FrameError::TooLarge { section: "body", len, .. }) if len == 1 << 32
        ));
        assert!(matches!(
            Header::for_sections(Kind::Call, 7, [(16 << 20) + 1, 0, 0], &limits),
            Err(FrameError::TooLarge {
                section: "meta",
                ..
            })
        ));
    }

    #[test]
    fn bad_headers_are_errors() {
        let h = Header {
            kind: Kind::Call,
            call_id: 1,
            meta_len: 1,
            body_len: 1,
            blob_len: 1,
        };
        let mut b = h.encode();
        b[0] = b'X';
        assert!(matches!(
            Header::decode(&b, &Limits::default()),
            Err(FrameError::BadMagic { .. })
        ));
        let mut b = h.encode();
        b[4] = 2;
        assert_eq!(
            Header::decode(&b, &Limits::default()),
            Err(FrameError::Version { found: 2 })
        );
        let mut b = h.encode();
        b[5] = 200;
        assert_eq!(
            Header::decode(&b, &Limits::default()),
            Err(FrameError::UnknownKind { found: 200 })
        );
        let small = Limits {
            max_meta: 0,
            ..Limits::default()
        };
        assert!(matches!(
            Header::decode(&h.encode(), &small),
            Err(FrameError::TooLarge {
                section: "meta",
                ..
            })
        ));
    }

    /// Arbitrary bytes never panic the decoders (a deterministic xorshift stream stands in
    /// for a property-test generator, so the crate needs no proptest build).
    #[test]
    fn arbitrary_bytes_never_panic() {
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        let limits = Limits::default();
        let mut ok = 0;
        for i in 0..200_000u32 {
            let mut b = [0u8; HEADER_LEN];
            for c in b.chunks_mut(8) {
                c.copy_from_slice(&next().to_le_bytes()[..c.len()]);
            }
            // Half the cases start valid, so the later checks are reached too.
            if i % 2 == 0 {
                b[..4].copy_from_slice(&MAGIC);
                b[4] = VERSION;
                b[5] = (next() % 11) as u8;
                if i % 4 == 0 {
                    // Small sections, so the length checks pass too.
                    b[18..20].fill(0);
                    b[22..24].fill(0);
                    b[27..32].fill(0);
                }
            }
            if Header::decode(&b, &limits).is_ok() {
                ok += 1;
            }
            let len = (next() % 64) as usize;
            let meta: Vec<u8> = (0..len).map(|_| next() as u8).collect();
            let _ = decode_meta::<CallMeta>(Kind::Call, &meta);
            let _ = decode_meta::<FailMeta>(Kind::Fail, &meta);
            let _ = decode_meta::<RRefMeta>(Kind::Fetch, &meta);
        }
        assert!(ok > 0, "some generated headers are valid");
    }
}
