//! Codec of the rendezvous store protocol (PyTorch's TCPStore wire format, as torch 2.15 speaks
//! it).
//!
//! There is no length-prefixed envelope: each request is a [`QueryType`] code byte followed by
//! command-specific fields. All integers are little-endian; a string (key or value) is a `u64`
//! length followed by that many bytes; a list is a `u64` count followed by its items.
//!
//! * [`Request`]: one query, with [`Request::encode`] and the incremental [`RequestDecoder`]
//!   (feed it partial byte slices, take complete requests out) used by servers.
//! * [`Response`]: one reply, with [`Response::encode`] for servers and [`decode_response`] for
//!   clients, which know the [`ReplyKind`] they expect ([`Request::reply_kind`]).
//! * [`Limits`]: the largest key, value, list and request the decoders accept. An oversized
//!   length is a [`WireError::TooLong`] *before* anything is allocated for it.
//!
//! ```
//! use dist_wire::store::{Request, RequestDecoder};
//! let req = Request::Add { key: b"/counter".to_vec(), delta: 3 };
//! let bytes = req.to_bytes();
//! let mut dec = RequestDecoder::default();
//! dec.feed(&bytes[..5]);
//! assert_eq!(dec.next_request(), Ok(None)); // needs more bytes
//! dec.feed(&bytes[5..]);
//! assert_eq!(dec.next_request(), Ok(Some(req)));
//! ```

use crate::WireError;

mod scan;

/// The magic number of the VALIDATE query every connection starts with.
pub const VALIDATION_MAGIC: u32 = 0x3C85_F7CE;

/// The reply byte to WAIT once every key exists (`STOP_WAITING`).
pub const STOP_WAITING: u8 = 0;
/// The reply byte to CANCEL_WAIT (`WAIT_CANCELED`).
pub const WAIT_CANCELED: u8 = 1;
/// The reply byte to CHECK when every key exists (`READY`).
pub const CHECK_READY: u8 = 0;
/// The reply byte to CHECK when some key is missing (`NOT_READY`).
pub const CHECK_NOT_READY: u8 = 1;

/// The key prefix the TCPStore client puts before every user key (`k` travels as `/k`).
pub const KEY_PREFIX: &str = "/";
/// The raw key of the worker counter every client increments on connect.
pub const INIT_KEY: &str = "init/";

/// The query code byte that starts every request.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
#[non_exhaustive]
pub enum QueryType {
    /// `VALIDATE` (0): the magic number, first on every connection.
    Validate = 0x00,
    /// `SET` (1).
    Set = 0x01,
    /// `COMPARE_SET` (2).
    CompareSet = 0x02,
    /// `GET` (3).
    Get = 0x03,
    /// `ADD` (4).
    Add = 0x04,
    /// `CHECK` (5).
    Check = 0x05,
    /// `WAIT` (6).
    Wait = 0x06,
    /// `GETNUMKEYS` (7).
    GetNumKeys = 0x07,
    /// `DELETE_KEY` (8).
    DeleteKey = 0x08,
    /// `APPEND` (9).
    Append = 0x09,
    /// `MULTI_GET` (10).
    MultiGet = 0x0a,
    /// `MULTI_SET` (11).
    MultiSet = 0x0b,
    /// `CANCEL_WAIT` (12).
    CancelWait = 0x0c,
    /// `PING` (13).
    Ping = 0x0d,
    /// `QUEUE_PUSH` (14).
    QueuePush = 0x0e,
    /// `QUEUE_POP` (15).
    QueuePop = 0x0f,
    /// `QUEUE_LEN` (16).
    QueueLen = 0x10,
    /// `LIST_KEYS` (17).
    ListKeys = 0x11,
}

impl QueryType {
    /// Every query type, in code order.
    pub const ALL: [QueryType; 18] = [
        QueryType::Validate,
        QueryType::Set,
        QueryType::CompareSet,
        QueryType::Get,
        QueryType::Add,
        QueryType::Check,
        QueryType::Wait,
        QueryType::GetNumKeys,
        QueryType::DeleteKey,
        QueryType::Append,
        QueryType::MultiGet,
        QueryType::MultiSet,
        QueryType::CancelWait,
        QueryType::Ping,
        QueryType::QueuePush,
        QueryType::QueuePop,
        QueryType::QueueLen,
        QueryType::ListKeys,
    ];

    /// The code byte.
    pub const fn code(self) -> u8 {
        self as u8
    }

    /// The query type of a code byte, if it has one.
    pub fn from_code(code: u8) -> Option<Self> {
        Self::ALL.get(usize::from(code)).copied()
    }

    /// torch's name of the query (`"COMPARE_SET"`).
    pub const fn name(self) -> &'static str {
        match self {
            QueryType::Validate => "VALIDATE",
            QueryType::Set => "SET",
            QueryType::CompareSet => "COMPARE_SET",
            QueryType::Get => "GET",
            QueryType::Add => "ADD",
            QueryType::Check => "CHECK",
            QueryType::Wait => "WAIT",
            QueryType::GetNumKeys => "GETNUMKEYS",
            QueryType::DeleteKey => "DELETE_KEY",
            QueryType::Append => "APPEND",
            QueryType::MultiGet => "MULTI_GET",
            QueryType::MultiSet => "MULTI_SET",
            QueryType::CancelWait => "CANCEL_WAIT",
            QueryType::Ping => "PING",
            QueryType::QueuePush => "QUEUE_PUSH",
            QueryType::QueuePop => "QUEUE_POP",
            QueryType::QueueLen => "QUEUE_LEN",
            QueryType::ListKeys => "LIST_KEYS",
        }
    }
}

/// The largest lengths a decoder accepts. Defaults follow torch's libuv server for keys and
/// lists, with a larger value limit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Longest key in bytes (default 8 KiB).
    pub max_key_len: u64,
    /// Longest value in bytes (default 64 MiB).
    pub max_value_len: u64,
    /// Most items in one list (default 128 Ki).
    pub max_list_len: u64,
    /// Most bytes in one request or reply, everything included (default 256 MiB).
    pub max_message_len: u64,
}

impl Limits {
    /// The default limits.
    pub const DEFAULT: Limits = Limits {
        max_key_len: 8 * 1024,
        max_value_len: 64 * 1024 * 1024,
        max_list_len: 128 * 1024,
        max_message_len: 256 * 1024 * 1024,
    };
}

impl Default for Limits {
    fn default() -> Self {
        Limits::DEFAULT
    }
}

/// One query from a client to the server. Keys travel as bytes exactly as given (the client adds
/// the `/` prefix before building the request).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Request {
    /// `VALIDATE magic`; the server checks `magic == VALIDATION_MAGIC`. No reply.
    Validate {
        /// The magic sent.
        magic: u32,
    },
    /// `SET key value`. No reply.
    Set {
        /// Key.
        key: Vec<u8>,
        /// Value.
        value: Vec<u8>,
    },
    /// `COMPARE_SET key expected desired`. Reply: [`Response::Value`].
    CompareSet {
        /// Key.
        key: Vec<u8>,
        /// Expected current value.
        expected: Vec<u8>,
        /// Value to set.
        desired: Vec<u8>,
    },
    /// `GET key`. Reply: [`Response::Value`].
    Get {
        /// Key.
        key: Vec<u8>,
    },
    /// `ADD key delta`. Reply: [`Response::Int`], the new value.
    Add {
        /// Key.
        key: Vec<u8>,
        /// Increment.
        delta: i64,
    },
    /// `CHECK keys`. Reply: [`Response::Flag`] ([`CHECK_READY`] or [`CHECK_NOT_READY`]).
    Check {
        /// Keys.
        keys: Vec<Vec<u8>>,
    },
    /// `WAIT keys`. Reply: [`Response::Flag`] ([`STOP_WAITING`]) once every key exists.
    Wait {
        /// Keys.
        keys: Vec<Vec<u8>>,
    },
    /// `GETNUMKEYS`. Reply: [`Response::Int`].
    GetNumKeys,
    /// `DELETE_KEY key`. Reply: [`Response::Int`], the number deleted.
    DeleteKey {
        /// Key.
        key: Vec<u8>,
    },
    /// `APPEND key value`. No reply.
    Append {
        /// Key.
        key: Vec<u8>,
        /// Bytes to append.
        value: Vec<u8>,
    },
    /// `MULTI_GET keys`. Reply: [`Response::Values`] with one value per key.
    MultiGet {
        /// Keys.
        keys: Vec<Vec<u8>>,
    },
    /// `MULTI_SET pairs`. No reply.
    MultiSet {
        /// `(key, value)` pairs.
        pairs: Vec<(Vec<u8>, Vec<u8>)>,
    },
    /// `CANCEL_WAIT`. Reply: [`Response::Flag`] ([`WAIT_CANCELED`]).
    CancelWait,
    /// `PING nonce`. Reply: [`Response::Pong`] with the same nonce.
    Ping {
        /// The nonce (torch's client sends its pid).
        nonce: u32,
    },
    /// `QUEUE_PUSH key value`. No reply.
    QueuePush {
        /// Queue key.
        key: Vec<u8>,
        /// Item.
        value: Vec<u8>,
    },
    /// `QUEUE_POP key`. Reply: [`Response::Popped`].
    QueuePop {
        /// Queue key.
        key: Vec<u8>,
    },
    /// `QUEUE_LEN key`. Reply: [`Response::Int`].
    QueueLen {
        /// Queue key.
        key: Vec<u8>,
    },
    /// `LIST_KEYS`. Reply: [`Response::Keys`].
    ListKeys,
}

/// The shape of the reply a client expects to a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ReplyKind {
    /// A string: COMPARE_SET, GET.
    Value,
    /// An `i64`: ADD, GETNUMKEYS, DELETE_KEY, QUEUE_LEN.
    Int,
    /// One byte: CHECK, WAIT, CANCEL_WAIT.
    Flag,
    /// A `u32`: PING.
    Pong,
    /// This many strings, with no count on the wire: MULTI_GET.
    Values(usize),
    /// An `i64` count, then a string when it is not 0: QUEUE_POP.
    Popped,
    /// An `i64` count, then that many strings: LIST_KEYS.
    Keys,
}

/// One reply from the server to a client.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Response {
    /// A string (COMPARE_SET, GET).
    Value(Vec<u8>),
    /// An `i64` (ADD, GETNUMKEYS, DELETE_KEY, QUEUE_LEN).
    Int(i64),
    /// One byte (CHECK, WAIT, CANCEL_WAIT).
    Flag(u8),
    /// The echoed nonce of PING.
    Pong(u32),
    /// Strings without a count (MULTI_GET).
    Values(Vec<Vec<u8>>),
    /// A queue item or `None` when the queue was empty (QUEUE_POP).
    Popped(Option<Vec<u8>>),
    /// Keys with a count (LIST_KEYS).
    Keys(Vec<Vec<u8>>),
}

fn put_u64(out: &mut Vec<u8>, v: u64) {
    out.extend_from_slice(&v.to_le_bytes());
}

fn put_str(out: &mut Vec<u8>, s: &[u8]) {
    put_u64(out, s.len() as u64);
    out.extend_from_slice(s);
}

fn put_list(out: &mut Vec<u8>, items: &[Vec<u8>]) {
    put_u64(out, items.len() as u64);
    for item in items {
        put_str(out, item);
    }
}

impl Request {
    /// The query type of this request.
    pub fn query_type(&self) -> QueryType {
        match self {
            Request::Validate { .. } => QueryType::Validate,
            Request::Set { .. } => QueryType::Set,
            Request::CompareSet { .. } => QueryType::CompareSet,
            Request::Get { .. } => QueryType::Get,
            Request::Add { .. } => QueryType::Add,
            Request::Check { .. } => QueryType::Check,
            Request::Wait { .. } => QueryType::Wait,
            Request::GetNumKeys => QueryType::GetNumKeys,
            Request::DeleteKey { .. } => QueryType::DeleteKey,
            Request::Append { .. } => QueryType::Append,
            Request::MultiGet { .. } => QueryType::MultiGet,
            Request::MultiSet { .. } => QueryType::MultiSet,
            Request::CancelWait => QueryType::CancelWait,
            Request::Ping { .. } => QueryType::Ping,
            Request::QueuePush { .. } => QueryType::QueuePush,
            Request::QueuePop { .. } => QueryType::QueuePop,
            Request::QueueLen { .. } => QueryType::QueueLen,
            Request::ListKeys => QueryType::ListKeys,
        }
    }

    /// The reply the server sends to this request, or `None` for requests without one
    /// (VALIDATE, SET, APPEND, MULTI_SET, QUEUE_PUSH).
    pub fn reply_kind(&self) -> Option<ReplyKind> {
        match self {
            Request::Validate { .. }
            | Request::Set { .. }
            | Request::Append { .. }
            | Request::MultiSet { .. }
            | Request::QueuePush { .. } => None,
            Request::CompareSet { .. } | Request::Get { .. } => Some(ReplyKind::Value),
            Request::Add { .. }
            | Request::GetNumKeys
            | Request::DeleteKey { .. }
            | Request::QueueLen { .. } => Some(ReplyKind::Int),
            Request::Check { .. } | Request::Wait { .. } | Request::CancelWait => {
                Some(ReplyKind::Flag)
            }
            Request::Ping { .. } => Some(ReplyKind::Pong),
            Request::MultiGet { keys } => Some(ReplyKind::Values(keys.len())),
            Request::QueuePop { .. } => Some(ReplyKind::Popped),
            Request::ListKeys => Some(ReplyKind::Keys),
        }
    }

    /// Appends the encoding of this request to `out`.
    pub fn encode(&self, out: &mut Vec<u8>) {
        out.push(self.query_type().code());
        match self {
            Request::Validate { magic } => out.extend_from_slice(&magic.to_le_bytes()),
            Request::Ping { nonce } => out.extend_from_slice(&nonce.to_le_bytes()),
            Request::Set { key, value }
            | Request::Append { key, value }
            | Request::QueuePush { key, value } => {
                put_str(out, key);
                put_str(out, value);
            }
            Request::CompareSet {
                key,
                expected,
                desired,
            } => {
                put_str(out, key);
                put_str(out, expected);
                put_str(out, desired);
            }
            Request::Get { key }
            | Request::DeleteKey { key }
            | Request::QueuePop { key }
            | Request::QueueLen { key } => put_str(out, key),
            Request::Add { key, delta } => {
                put_str(out, key);
                out.extend_from_slice(&delta.to_le_bytes());
            }
            Request::Check { keys } | Request::Wait { keys } | Request::MultiGet { keys } => {
                put_list(out, keys);
            }
            Request::MultiSet { pairs } => {
                put_u64(out, pairs.len() as u64);
                for (k, v) in pairs {
                    put_str(out, k);
                    put_str(out, v);
                }
            }
            Request::GetNumKeys | Request::CancelWait | Request::ListKeys => {}
        }
    }

    /// The encoding of this request as a new vector.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::new();
        self.encode(&mut out);
        out
    }

    /// Checks every key, value and list of this request, and its encoded length, against
    /// `limits` (what a decoder with those limits would refuse), without encoding it.
    pub fn check_limits(&self, limits: &Limits) -> Result<(), WireError> {
        let check = |what: &'static str, len: usize, limit: u64| {
            if len as u64 > limit {
                Err(WireError::TooLong {
                    what,
                    len: len as u64,
                    limit,
                })
            } else {
                Ok(())
            }
        };
        let key = |k: &[u8]| check("store key", k.len(), limits.max_key_len);
        let value = |v: &[u8]| check("store value", v.len(), limits.max_value_len);
        let mut total = 1usize;
        match self {
            Request::Set { key: k, value: v }
            | Request::Append { key: k, value: v }
            | Request::QueuePush { key: k, value: v } => {
                key(k)?;
                value(v)?;
                total += 16 + k.len() + v.len();
            }
            Request::CompareSet {
                key: k,
                expected,
                desired,
            } => {
                key(k)?;
                value(expected)?;
                value(desired)?;
                total += 24 + k.len() + expected.len() + desired.len();
            }
            Request::Get { key: k }
            | Request::DeleteKey { key: k }
            | Request::QueuePop { key: k }
            | Request::QueueLen { key: k } => {
                key(k)?;
                total += 8 + k.len();
            }
            Request::Add { key: k, .. } => {
                key(k)?;
                total += 16 + k.len();
            }
            Request::Check { keys } | Request::Wait { keys } | Request::MultiGet { keys } => {
                check("store key list", keys.len(), limits.max_list_len)?;
                total += 8;
                for k in keys {
                    key(k)?;
                    total += 8 + k.len();
                }
            }
            Request::MultiSet { pairs } => {
                check("store pair list", pairs.len(), limits.max_list_len)?;
                total += 8;
                for (k, v) in pairs {
                    key(k)?;
                    value(v)?;
                    total += 16 + k.len() + v.len();
                }
            }
            Request::Validate { .. } | Request::Ping { .. } => total += 4,
            Request::GetNumKeys | Request::CancelWait | Request::ListKeys => {}
        }
        check("store message", total, limits.max_message_len)
    }

    /// Decodes one request from the start of `buf`.
    ///
    /// Returns `Ok(Some((request, consumed)))` when `buf` starts with a complete request,
    /// `Ok(None)` when more bytes are needed, and an error when the bytes can never become a
    /// valid request (unknown code, a length over `limits`).
    pub fn decode(buf: &[u8], limits: &Limits) -> Result<Option<(Request, usize)>, WireError> {
        let mut r = Reader::new(buf, limits);
        match parse_request(&mut r) {
            Ok(req) => Ok(Some((req, r.pos))),
            Err(Stop::Need) => Ok(None),
            Err(Stop::Err(e)) => Err(e),
        }
    }
}

impl Response {
    /// The shape of this reply.
    pub fn kind(&self) -> ReplyKind {
        match self {
            Response::Value(_) => ReplyKind::Value,
            Response::Int(_) => ReplyKind::Int,
            Response::Flag(_) => ReplyKind::Flag,
            Response::Pong(_) => ReplyKind::Pong,
            Response::Values(v) => ReplyKind::Values(v.len()),
            Response::Popped(_) => ReplyKind::Popped,
            Response::Keys(_) => ReplyKind::Keys,
        }
    }

    /// Appends the encoding of this reply to `out`.
    pub fn encode(&self, out: &mut Vec<u8>) {
        match self {
            Response::Value(v) => put_str(out, v),
            Response::Int(i) => out.extend_from_slice(&i.to_le_bytes()),
            Response::Flag(b) => out.push(*b),
            Response::Pong(n) => out.extend_from_slice(&n.to_le_bytes()),
            Response::Values(vs) => {
                for v in vs {
                    put_str(out, v);
                }
            }
            Response::Popped(None) => out.extend_from_slice(&0i64.to_le_bytes()),
            Response::Popped(Some(v)) => {
                out.extend_from_slice(&1i64.to_le_bytes());
                put_str(out, v);
            }
            Response::Keys(ks) => {
                out.extend_from_slice(&(ks.len() as i64).to_le_bytes());
                for k in ks {
                    put_str(out, k);
                }
            }
        }
    }

    /// The encoding of this reply as a new vector.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::new();
        self.encode(&mut out);
        out
    }
}

/// Decodes one reply of the expected `kind` from the start of `buf`.
///
/// Returns `Ok(Some((response, consumed)))` when complete, `Ok(None)` when more bytes are
/// needed, and an error when a length is over `limits` or a count is invalid.
pub fn decode_response(
    kind: ReplyKind,
    buf: &[u8],
    limits: &Limits,
) -> Result<Option<(Response, usize)>, WireError> {
    let mut r = Reader::new(buf, limits);
    match parse_response(kind, &mut r) {
        Ok(resp) => Ok(Some((resp, r.pos))),
        Err(Stop::Need) => Ok(None),
        Err(Stop::Err(e)) => Err(e),
    }
}

/// Incremental request decoder: [`feed`](Self::feed) it bytes as they arrive, in pieces of any
/// size, and take complete requests out with [`next_request`](Self::next_request).
///
/// It allocates for a key or value only once the length field has been checked against its
/// [`Limits`], and parses a request once, when all of it has arrived: until then it walks on
/// over the length fields that arrived since the last call, so a request costs the same in any
/// number of pieces. After an error the decoder stays failed: the connection should be closed.
#[derive(Debug, Default)]
pub struct RequestDecoder {
    buf: Vec<u8>,
    start: usize,
    /// How far the walk over the request at `start` has come.
    scan: scan::Scan,
    limits: Limits,
    failed: Option<WireError>,
}

impl RequestDecoder {
    /// A decoder with the given limits.
    pub fn new(limits: Limits) -> Self {
        RequestDecoder {
            limits,
            ..RequestDecoder::default()
        }
    }

    /// The limits of this decoder.
    pub fn limits(&self) -> &Limits {
        &self.limits
    }

    /// Appends received bytes.
    pub fn feed(&mut self, bytes: &[u8]) {
        if self.start > 0 && self.start == self.buf.len() {
            self.buf.clear();
            self.start = 0;
        }
        self.buf.extend_from_slice(bytes);
    }

    /// Bytes received but not yet consumed by a complete request.
    pub fn buffered(&self) -> usize {
        self.buf.len() - self.start
    }

    /// The next complete request, `Ok(None)` when more bytes are needed, or the error that
    /// makes the stream undecodable (returned again on every later call).
    pub fn next_request(&mut self) -> Result<Option<Request>, WireError> {
        if let Some(e) = &self.failed {
            return Err(e.clone());
        }
        let avail = &self.buf[self.start..];
        // The parser reads only the request the walk found complete (no byte of the next one),
        // or, where the walk found the bytes invalid, what arrived, to name what is wrong.
        let upto = match self.scan.advance(avail, &self.limits) {
            scan::Scanned::Incomplete => return Ok(None),
            scan::Scanned::Complete(len) => len,
            scan::Scanned::Invalid => avail.len(),
        };
        let mut r = Reader::new(&avail[..upto], &self.limits);
        match parse_request(&mut r) {
            Ok(req) => {
                self.scan.reset();
                self.start += r.pos;
                // Compact once the consumed prefix dominates the buffer.
                if self.start == self.buf.len() {
                    self.buf.clear();
                    self.start = 0;
                } else if self.start > 4096 && self.start * 2 > self.buf.len() {
                    self.buf.drain(..self.start);
                    self.start = 0;
                }
                Ok(Some(req))
            }
            Err(Stop::Need) => Ok(None),
            Err(Stop::Err(e)) => {
                self.failed = Some(e.clone());
                Err(e)
            }
        }
    }
}

/// Why parsing stopped.
enum Stop {
    /// More bytes are needed.
    Need,
    /// The bytes are invalid.
    Err(WireError),
}

type Parse<T> = Result<T, Stop>;

/// A cursor over a byte slice that checks lengths against [`Limits`] before taking bytes.
struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
    limits: &'a Limits,
}

impl<'a> Reader<'a> {
    fn new(buf: &'a [u8], limits: &'a Limits) -> Self {
        Reader {
            buf,
            pos: 0,
            limits,
        }
    }

    /// Checks that `n` more bytes fit in one message and are buffered.
    fn ensure(&self, n: u64) -> Parse<()> {
        let end = (self.pos as u64).saturating_add(n);
        if end > self.limits.max_message_len {
            return Err(Stop::Err(WireError::TooLong {
                what: "store message",
                len: end,
                limit: self.limits.max_message_len,
            }));
        }
        if end > self.buf.len() as u64 {
            return Err(Stop::Need);
        }
        Ok(())
    }

    fn take(&mut self, n: usize) -> Parse<&'a [u8]> {
        self.ensure(n as u64)?;
        let s = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    fn array<const N: usize>(&mut self) -> Parse<[u8; N]> {
        let s = self.take(N)?;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Ok(a)
    }

    fn u8(&mut self) -> Parse<u8> {
        Ok(self.array::<1>()?[0])
    }

    fn u32(&mut self) -> Parse<u32> {
        Ok(u32::from_le_bytes(self.array()?))
    }

    fn u64(&mut self) -> Parse<u64> {
        Ok(u64::from_le_bytes(self.array()?))
    }

    fn i64(&mut self) -> Parse<i64> {
        Ok(i64::from_le_bytes(self.array()?))
    }

    /// A length-prefixed string of at most `limit` bytes.
    fn bytes(&mut self, what: &'static str, limit: u64) -> Parse<Vec<u8>> {
        let len = self.u64()?;
        if len > limit {
            return Err(Stop::Err(WireError::TooLong { what, len, limit }));
        }
        self.ensure(len)?;
        #[cfg(test)]
        tests::COPIED.with(|c| c.set(c.get() + len));
        Ok(self.take(len as usize)?.to_vec())
    }

    fn key(&mut self) -> Parse<Vec<u8>> {
        self.bytes("store key", self.limits.max_key_len)
    }

    fn value(&mut self) -> Parse<Vec<u8>> {
        self.bytes("store value", self.limits.max_value_len)
    }

    /// A list count, checked against the list limit.
    fn count(&mut self, what: &'static str) -> Parse<usize> {
        let n = self.u64()?;
        self.check_count(what, n)
    }

    fn check_count(&self, what: &'static str, n: u64) -> Parse<usize> {
        if n > self.limits.max_list_len {
            return Err(Stop::Err(WireError::TooLong {
                what,
                len: n,
                limit: self.limits.max_list_len,
            }));
        }
        // Every item needs at least its 8-byte length: fail fast on short input.
        self.ensure(n.saturating_mul(8))?;
        Ok(n as usize)
    }

    fn keys(&mut self) -> Parse<Vec<Vec<u8>>> {
        let n = self.count("store key list")?;
        (0..n).map(|_| self.key()).collect()
    }
}

fn parse_request(r: &mut Reader<'_>) -> Parse<Request> {
    let code = r.u8()?;
    let Some(qt) = QueryType::from_code(code) else {
        return Err(Stop::Err(WireError::UnknownCode {
            field: "store query",
            value: u64::from(code),
        }));
    };
    Ok(match qt {
        QueryType::Validate => Request::Validate { magic: r.u32()? },
        QueryType::Set => Request::Set {
            key: r.key()?,
            value: r.value()?,
        },
        QueryType::CompareSet => Request::CompareSet {
            key: r.key()?,
            expected: r.value()?,
            desired: r.value()?,
        },
        QueryType::Get => Request::Get { key: r.key()? },
        QueryType::Add => Request::Add {
            key: r.key()?,
            delta: r.i64()?,
        },
        QueryType::Check => Request::Check { keys: r.keys()? },
        QueryType::Wait => Request::Wait { keys: r.keys()? },
        QueryType::GetNumKeys => Request::GetNumKeys,
        QueryType::DeleteKey => Request::DeleteKey { key: r.key()? },
        QueryType::Append => Request::Append {
            key: r.key()?,
            value: r.value()?,
        },
        QueryType::MultiGet => Request::MultiGet { keys: r.keys()? },
        QueryType::MultiSet => {
            let n = r.count("store pair list")?;
            let mut pairs = Vec::with_capacity(n.min(1024));
            for _ in 0..n {
                pairs.push((r.key()?, r.value()?));
            }
            Request::MultiSet { pairs }
        }
        QueryType::CancelWait => Request::CancelWait,
        QueryType::Ping => Request::Ping { nonce: r.u32()? },
        QueryType::QueuePush => Request::QueuePush {
            key: r.key()?,
            value: r.value()?,
        },
        QueryType::QueuePop => Request::QueuePop { key: r.key()? },
        QueryType::QueueLen => Request::QueueLen { key: r.key()? },
        QueryType::ListKeys => Request::ListKeys,
    })
}

fn parse_response(kind: ReplyKind, r: &mut Reader<'_>) -> Parse<Response> {
    Ok(match kind {
        ReplyKind::Value => Response::Value(r.value()?),
        ReplyKind::Int => Response::Int(r.i64()?),
        ReplyKind::Flag => Response::Flag(r.u8()?),
        ReplyKind::Pong => Response::Pong(r.u32()?),
        ReplyKind::Values(n) => {
            let n = r.check_count("store value list", n as u64)?;
            let mut vs = Vec::with_capacity(n.min(1024));
            for _ in 0..n {
                vs.push(r.value()?);
            }
            Response::Values(vs)
        }
        ReplyKind::Popped => match r.i64()? {
            0 => Response::Popped(None),
            1 => Response::Popped(Some(r.value()?)),
            n => {
                return Err(Stop::Err(WireError::UnknownCode {
                    field: "queue pop count",
                    value: n as u64,
                }));
            }
        },
        ReplyKind::Keys => {
            let n = r.i64()?;
            if n < 0 {
                return Err(Stop::Err(WireError::UnknownCode {
                    field: "key list count",
                    value: n as u64,
                }));
            }
            let n = r.check_count("store key list", n as u64)?;
            let mut ks = Vec::with_capacity(n.min(1024));
            for _ in 0..n {
                ks.push(r.key()?);
            }
            Response::Keys(ks)
        }
    })
}

#[cfg(test)]
mod tests {
    use std::cell::Cell;

    use super::*;

    thread_local! {
        /// Bytes of keys and values the parser copied out of its buffer on this thread.
        pub(super) static COPIED: Cell<u64> = const { Cell::new(0) };
    }

    #[test]
    fn a_list_request_arriving_in_pieces_is_copied_out_once() {
        let pairs: Vec<(Vec<u8>, Vec<u8>)> = (0..300u32)
            .map(|i| (format!("/k{i}").into_bytes(), vec![i as u8; 500]))
            .collect();
        let payload: u64 = pairs.iter().map(|(k, v)| (k.len() + v.len()) as u64).sum();
        let req = Request::MultiSet { pairs };
        let mut bytes = req.to_bytes();
        Request::Get {
            key: b"/next".to_vec(),
        }
        .encode(&mut bytes);
        let mut d = RequestDecoder::default();
        COPIED.with(|c| c.set(0));
        let mut got = vec![];
        for piece in bytes.chunks(97) {
            d.feed(piece);
            while let Some(r) = d.next_request().unwrap() {
                got.push(r);
            }
        }
        assert_eq!(
            got,
            [
                req,
                Request::Get {
                    key: b"/next".to_vec()
                }
            ]
        );
        // Restarted from the request's first byte on every piece, the parser copied each item
        // again each time a later one arrived: hundreds of times this.
        assert_eq!(COPIED.with(Cell::get), payload + 5);
    }

    #[test]
    fn validate_bytes_match_torch() {
        let b = Request::Validate {
            magic: VALIDATION_MAGIC,
        }
        .to_bytes();
        assert_eq!(b, [0x00, 0xce, 0xf7, 0x85, 0x3c]);
    }

    #[test]
    fn codes_match_torch() {
        for (i, qt) in QueryType::ALL.iter().enumerate() {
            assert_eq!(usize::from(qt.code()), i);
            assert_eq!(QueryType::from_code(qt.code()), Some(*qt));
        }
        assert_eq!(QueryType::ListKeys.code(), 0x11);
        assert_eq!(QueryType::from_code(0x12), None);
    }

    #[test]
    fn set_layout() {
        let b = Request::Set {
            key: b"/k".to_vec(),
            value: b"v".to_vec(),
        }
        .to_bytes();
        let mut want = vec![1u8];
        want.extend_from_slice(&2u64.to_le_bytes());
        want.extend_from_slice(b"/k");
        want.extend_from_slice(&1u64.to_le_bytes());
        want.push(b'v');
        assert_eq!(b, want);
    }

    #[test]
    fn oversized_key_fails_before_bytes_arrive() {
        let mut b = vec![QueryType::Get.code()];
        b.extend_from_slice(&u64::MAX.to_le_bytes());
        let e = Request::decode(&b, &Limits::DEFAULT).unwrap_err();
        assert!(matches!(
            e,
            WireError::TooLong {
                what: "store key",
                ..
            }
        ));
    }

    #[test]
    fn huge_list_count_fails() {
        let mut b = vec![QueryType::Wait.code()];
        b.extend_from_slice(&(1u64 << 40).to_le_bytes());
        let e = Request::decode(&b, &Limits::DEFAULT).unwrap_err();
        assert!(matches!(e, WireError::TooLong { .. }));
    }

    #[test]
    fn message_limit_applies() {
        let limits = Limits {
            max_message_len: 64,
            ..Limits::DEFAULT
        };
        let b = Request::Set {
            key: b"k".to_vec(),
            value: vec![0; 100],
        }
        .to_bytes();
        assert!(matches!(
            Request::decode(&b[..20], &limits),
            Err(WireError::TooLong {
                what: "store message",
                ..
            })
        ));
    }

    #[test]
    fn decoder_skips_reparse_until_enough_bytes() {
        let req = Request::Set {
            key: b"/big".to_vec(),
            value: vec![7; 100_000],
        };
        let bytes = req.to_bytes();
        let mut d = RequestDecoder::default();
        for chunk in bytes.chunks(1000) {
            assert_eq!(d.next_request(), Ok(None));
            d.feed(chunk);
        }
        assert_eq!(d.next_request(), Ok(Some(req)));
        assert_eq!(d.buffered(), 0);
    }

    #[test]
    fn popped_and_keys_round_trip() {
        for resp in [
            Response::Popped(None),
            Response::Popped(Some(b"x".to_vec())),
            Response::Keys(vec![b"/a".to_vec(), b"init/".to_vec()]),
            Response::Values(vec![b"1".to_vec(), Vec::new()]),
        ] {
            let b = resp.to_bytes();
            let got = decode_response(resp.kind(), &b, &Limits::DEFAULT).unwrap();
            assert_eq!(got, Some((resp, b.len())));
        }
    }
}
