//! Where a request that is still arriving ends: a walk over its length fields that resumes
//! where the last one stopped, so that [`super::RequestDecoder`] parses each request once,
//! when all of it is buffered.
//!
//! Why: parsing copies every key and value out of the buffer. A parser restarted from the
//! request's first byte on every read re-copies every item received so far each time one more
//! arrives, so a MULTI_SET of 1000 values of 64 KiB (arriving in reads of 64 KiB) cost about
//! 32 GB of copying on the store server's one thread, stalling every other client. The walk
//! reads each length field once, whatever the pieces the request arrives in.

use super::{Limits, QueryType};

/// One field of a request's layout.
#[derive(Clone, Copy, Debug)]
enum Field {
    /// A fixed number of bytes (an integer).
    Fixed(u64),
    /// A key: its `u64` length, then its bytes.
    Key,
    /// A value: its `u64` length, then its bytes.
    Value,
}

/// A request's fields after its code byte: `head`, then, where `list` is given, a `u64` count
/// and that many items, each of `list`'s fields.
#[derive(Clone, Copy, Debug)]
struct Layout {
    head: &'static [Field],
    list: Option<&'static [Field]>,
}

/// The layout of each query, as `parse_request` reads it.
fn layout(qt: QueryType) -> Layout {
    use Field::{Fixed, Key, Value};
    let head = |head| Layout { head, list: None };
    let list = |items| Layout {
        head: &[],
        list: Some(items),
    };
    match qt {
        QueryType::Validate | QueryType::Ping => head(&[Fixed(4)]),
        QueryType::Set | QueryType::Append | QueryType::QueuePush => head(&[Key, Value]),
        QueryType::CompareSet => head(&[Key, Value, Value]),
        QueryType::Get | QueryType::DeleteKey | QueryType::QueuePop | QueryType::QueueLen => {
            head(&[Key])
        }
        QueryType::Add => head(&[Key, Fixed(8)]),
        QueryType::Check | QueryType::Wait | QueryType::MultiGet => list(&[Key]),
        QueryType::MultiSet => list(&[Key, Value]),
        QueryType::GetNumKeys | QueryType::CancelWait | QueryType::ListKeys => head(&[]),
    }
}

/// What the walk found.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Scanned {
    /// The request is the first this many bytes.
    Complete(usize),
    /// More bytes are needed.
    Incomplete,
    /// The bytes break a rule of the layout or of the [`Limits`]: the parser names which.
    Invalid,
}

/// How far the walk over the request at the start of the buffer has come.
#[derive(Debug, Default)]
pub(super) struct Scan {
    /// Bytes of the request walked over.
    pos: u64,
    /// Known once the code byte is read.
    layout: Option<Layout>,
    /// The next field of `layout.head`, then of the current list item.
    field: usize,
    /// The list's items not yet walked over, once its count is read.
    items_left: Option<u64>,
}

impl Scan {
    /// Walks on over `buf`, which holds the request from its first byte (and what was walked
    /// over before, unchanged). Call [`Scan::reset`] once the request is taken.
    pub(super) fn advance(&mut self, buf: &[u8], limits: &Limits) -> Scanned {
        match self.walk(buf, limits) {
            Ok(true) => Scanned::Complete(self.pos as usize),
            Ok(false) => Scanned::Incomplete,
            Err(Invalid) => Scanned::Invalid,
        }
    }

    /// Starts over, for the next request.
    pub(super) fn reset(&mut self) {
        *self = Scan::default();
    }

    fn walk(&mut self, buf: &[u8], limits: &Limits) -> Result<bool, Invalid> {
        let layout = match self.layout {
            Some(l) => l,
            None => {
                let Some(&code) = buf.first() else {
                    return Ok(false);
                };
                let l = layout(QueryType::from_code(code).ok_or(Invalid)?);
                self.pos = 1;
                *self.layout.insert(l)
            }
        };
        // Once the list's count is read, `field` indexes the list item's fields.
        while self.items_left.is_none()
            && let Some(&f) = layout.head.get(self.field)
        {
            if !self.field_at(f, buf, limits)? {
                return Ok(false);
            }
            self.field += 1;
        }
        let Some(items) = layout.list else {
            return Ok(true);
        };
        let mut left = match self.items_left {
            Some(n) => n,
            None => {
                let Some(n) = self.u64_at(buf, limits)? else {
                    return Ok(false);
                };
                // As the parser checks a count: against the list limit, and the least its
                // items take (8 bytes each) against the message limit.
                if n > limits.max_list_len
                    || self
                        .pos
                        .saturating_add(8)
                        .saturating_add(n.saturating_mul(8))
                        > limits.max_message_len
                {
                    return Err(Invalid);
                }
                self.pos += 8;
                self.field = 0;
                *self.items_left.insert(n)
            }
        };
        while left > 0 {
            while let Some(&f) = items.get(self.field) {
                if !self.field_at(f, buf, limits)? {
                    self.items_left = Some(left);
                    return Ok(false);
                }
                self.field += 1;
            }
            self.field = 0;
            left -= 1;
        }
        self.items_left = Some(0);
        Ok(true)
    }

    /// Walks over field `f` at `pos` if all of it is buffered: `Ok(false)` where it is not.
    fn field_at(&mut self, f: Field, buf: &[u8], limits: &Limits) -> Result<bool, Invalid> {
        let limit = match f {
            Field::Fixed(n) => {
                if !self.fits(n, buf, limits)? {
                    return Ok(false);
                }
                self.pos += n;
                return Ok(true);
            }
            Field::Key => limits.max_key_len,
            Field::Value => limits.max_value_len,
        };
        let Some(len) = self.u64_at(buf, limits)? else {
            return Ok(false);
        };
        if len > limit {
            return Err(Invalid);
        }
        let whole = len.saturating_add(8);
        if !self.fits(whole, buf, limits)? {
            return Ok(false);
        }
        self.pos += whole;
        Ok(true)
    }

    /// The `u64` at `pos`, where it is buffered (it is not walked over).
    fn u64_at(&self, buf: &[u8], limits: &Limits) -> Result<Option<u64>, Invalid> {
        if !self.fits(8, buf, limits)? {
            return Ok(None);
        }
        let at = self.pos as usize;
        let bytes: [u8; 8] = buf[at..at + 8].try_into().map_err(|_| Invalid)?;
        Ok(Some(u64::from_le_bytes(bytes)))
    }

    /// Whether `n` bytes from `pos` are buffered; an error where they would pass the message
    /// limit (checked first, as the parser does, so that a request that can never fit fails
    /// before its bytes arrive).
    fn fits(&self, n: u64, buf: &[u8], limits: &Limits) -> Result<bool, Invalid> {
        let end = self.pos.saturating_add(n);
        if end > limits.max_message_len {
            return Err(Invalid);
        }
        Ok(end <= buf.len() as u64)
    }
}

/// The bytes cannot become a request.
struct Invalid;

#[cfg(test)]
mod tests {
    use super::super::Request;
    use super::*;

    #[test]
    fn a_list_request_fed_in_pieces_is_walked_once_and_found_complete_at_its_end() {
        let req = Request::MultiSet {
            pairs: (0..50u8).map(|i| (vec![i; 3], vec![i; 100])).collect(),
        };
        let b = req.to_bytes();
        let mut s = Scan::default();
        for end in 0..b.len() {
            assert_eq!(
                s.advance(&b[..end], &Limits::DEFAULT),
                Scanned::Incomplete,
                "{end}"
            );
        }
        assert_eq!(s.advance(&b, &Limits::DEFAULT), Scanned::Complete(b.len()));
        // With what follows it buffered too.
        let mut more = b.clone();
        more.extend_from_slice(&Request::ListKeys.to_bytes());
        s.reset();
        assert_eq!(
            s.advance(&more, &Limits::DEFAULT),
            Scanned::Complete(b.len())
        );
    }

    #[test]
    fn lengths_past_the_limits_are_invalid_before_their_bytes_arrive() {
        let limits = Limits {
            max_key_len: 4,
            max_value_len: 8,
            max_list_len: 2,
            max_message_len: 64,
        };
        let mut key_too_long = vec![QueryType::Get.code()];
        key_too_long.extend_from_slice(&5u64.to_le_bytes());
        let mut list_too_long = vec![QueryType::Wait.code()];
        list_too_long.extend_from_slice(&3u64.to_le_bytes());
        let mut message_too_long = vec![QueryType::Set.code()];
        message_too_long.extend_from_slice(&4u64.to_le_bytes());
        message_too_long.extend_from_slice(b"/key");
        message_too_long.extend_from_slice(&8u64.to_le_bytes());
        let small = Limits {
            max_message_len: 24,
            ..limits
        };
        for (bytes, limits) in [
            (vec![0xff], limits),
            (key_too_long, limits),
            (list_too_long, limits),
            (message_too_long, small),
        ] {
            let mut s = Scan::default();
            assert_eq!(s.advance(&bytes, &limits), Scanned::Invalid, "{bytes:?}");
        }
    }
}
