//! Property tests of the TCPStore codec: every request and reply round-trips, decoding in pieces
//! equals decoding at once, and random or mutated bytes never panic.

use dist_wire::WireError;
use dist_wire::store::{
    Limits, ReplyKind, Request, RequestDecoder, Response, VALIDATION_MAGIC, decode_response,
};
use proptest::prelude::*;

fn bytes(max: usize) -> impl Strategy<Value = Vec<u8>> {
    proptest::collection::vec(any::<u8>(), 0..max)
}

fn keys() -> impl Strategy<Value = Vec<Vec<u8>>> {
    proptest::collection::vec(bytes(16), 0..6)
}

fn request() -> impl Strategy<Value = Request> {
    prop_oneof![
        any::<u32>().prop_map(|magic| Request::Validate { magic }),
        Just(Request::Validate {
            magic: VALIDATION_MAGIC
        }),
        (bytes(16), bytes(64)).prop_map(|(key, value)| Request::Set { key, value }),
        (bytes(16), bytes(32), bytes(32)).prop_map(|(key, expected, desired)| {
            Request::CompareSet {
                key,
                expected,
                desired,
            }
        }),
        bytes(16).prop_map(|key| Request::Get { key }),
        (bytes(16), any::<i64>()).prop_map(|(key, delta)| Request::Add { key, delta }),
        keys().prop_map(|keys| Request::Check { keys }),
        keys().prop_map(|keys| Request::Wait { keys }),
        Just(Request::GetNumKeys),
        bytes(16).prop_map(|key| Request::DeleteKey { key }),
        (bytes(16), bytes(64)).prop_map(|(key, value)| Request::Append { key, value }),
        keys().prop_map(|keys| Request::MultiGet { keys }),
        proptest::collection::vec((bytes(16), bytes(32)), 0..5)
            .prop_map(|pairs| Request::MultiSet { pairs }),
        Just(Request::CancelWait),
        any::<u32>().prop_map(|nonce| Request::Ping { nonce }),
        (bytes(16), bytes(64)).prop_map(|(key, value)| Request::QueuePush { key, value }),
        bytes(16).prop_map(|key| Request::QueuePop { key }),
        bytes(16).prop_map(|key| Request::QueueLen { key }),
        Just(Request::ListKeys),
    ]
}

fn response() -> impl Strategy<Value = Response> {
    prop_oneof![
        bytes(64).prop_map(Response::Value),
        any::<i64>().prop_map(Response::Int),
        any::<u8>().prop_map(Response::Flag),
        any::<u32>().prop_map(Response::Pong),
        keys().prop_map(Response::Values),
        proptest::option::of(bytes(64)).prop_map(Response::Popped),
        keys().prop_map(Response::Keys),
    ]
}

fn reply_kind() -> impl Strategy<Value = ReplyKind> {
    prop_oneof![
        Just(ReplyKind::Value),
        Just(ReplyKind::Int),
        Just(ReplyKind::Flag),
        Just(ReplyKind::Pong),
        (0usize..8).prop_map(ReplyKind::Values),
        Just(ReplyKind::Popped),
        Just(ReplyKind::Keys),
    ]
}

/// The limits `decode_chunked` decodes with.
const SMALL: Limits = Limits {
    max_key_len: 64,
    max_value_len: 256,
    max_list_len: 16,
    max_message_len: 4096,
};

/// What decoding `data` request by request with the stateless [`Request::decode`] yields, as
/// [`decode_chunked`] returns it: the reference the incremental decoder must agree with.
fn decode_whole(data: &[u8]) -> (Vec<Request>, Option<WireError>) {
    let mut out = Vec::new();
    let mut rest = data;
    loop {
        match Request::decode(rest, &SMALL) {
            Ok(Some((r, used))) => {
                out.push(r);
                rest = &rest[used..];
            }
            Ok(None) => return (out, None),
            Err(e) => return (out, Some(e)),
        }
    }
}

/// Feeds `data` in the given chunk sizes and collects every request until `Ok(None)` at the end
/// or the first error.
fn decode_chunked(
    data: &[u8],
    chunks: impl Iterator<Item = usize>,
) -> (Vec<Request>, Option<WireError>) {
    let mut d = RequestDecoder::new(SMALL);
    let mut out = Vec::new();
    let mut rest = data;
    let mut chunks = chunks.peekable();
    loop {
        loop {
            match d.next_request() {
                Ok(Some(r)) => out.push(r),
                Ok(None) => break,
                Err(e) => return (out, Some(e)),
            }
        }
        if rest.is_empty() {
            return (out, None);
        }
        let n = chunks.next().unwrap_or(rest.len()).clamp(1, rest.len());
        d.feed(&rest[..n]);
        rest = &rest[n..];
    }
}

proptest! {
    #[test]
    fn request_round_trips(req in request()) {
        let b = req.to_bytes();
        prop_assert_eq!(Request::decode(&b, &Limits::DEFAULT), Ok(Some((req.clone(), b.len()))));
        // Every strict prefix needs more bytes.
        for cut in 0..b.len() {
            prop_assert_eq!(Request::decode(&b[..cut], &Limits::DEFAULT), Ok(None));
        }
    }

    #[test]
    fn response_round_trips(resp in response()) {
        let b = resp.to_bytes();
        prop_assert_eq!(
            decode_response(resp.kind(), &b, &Limits::DEFAULT),
            Ok(Some((resp.clone(), b.len())))
        );
        for cut in 0..b.len() {
            prop_assert_eq!(decode_response(resp.kind(), &b[..cut], &Limits::DEFAULT), Ok(None));
        }
    }

    #[test]
    fn request_stream_byte_by_byte_equals_at_once(reqs in proptest::collection::vec(request(), 0..8)) {
        let mut data = Vec::new();
        for r in &reqs {
            r.encode(&mut data);
        }
        let (at_once, e1) = decode_chunked(&data, std::iter::empty());
        let (one_by_one, e2) = decode_chunked(&data, std::iter::repeat(1));
        prop_assert_eq!(&at_once, &reqs);
        prop_assert_eq!(&one_by_one, &reqs);
        prop_assert_eq!(e1, None);
        prop_assert_eq!(e2, None);
    }

    #[test]
    fn random_chunking_matches(
        data in bytes(512),
        chunks in proptest::collection::vec(1usize..40, 0..64),
    ) {
        let at_once = decode_chunked(&data, std::iter::empty());
        let pieces = decode_chunked(&data, chunks.into_iter());
        let bytewise = decode_chunked(&data, std::iter::repeat(1));
        prop_assert_eq!(&at_once, &pieces);
        prop_assert_eq!(&at_once, &bytewise);
    }

    #[test]
    fn random_bytes_never_panic(data in bytes(256), kind in reply_kind()) {
        let _ = Request::decode(&data, &Limits::DEFAULT);
        let _ = decode_response(kind, &data, &Limits::DEFAULT);
        let mut d = RequestDecoder::default();
        d.feed(&data);
        for _ in 0..64 {
            if !matches!(d.next_request(), Ok(Some(_))) {
                break;
            }
        }
    }

    #[test]
    fn mutated_requests_never_panic(
        reqs in proptest::collection::vec(request(), 1..4),
        flips in proptest::collection::vec((any::<usize>(), any::<u8>()), 1..6),
    ) {
        let mut data = Vec::new();
        for r in &reqs {
            r.encode(&mut data);
        }
        for (i, b) in flips {
            let i = i % data.len();
            data[i] = b;
        }
        let whole = decode_chunked(&data, std::iter::empty());
        let bytewise = decode_chunked(&data, std::iter::repeat(1));
        prop_assert_eq!(&whole, &bytewise);
        prop_assert_eq!(&whole, &decode_whole(&data));
    }

    #[test]
    fn the_decoder_in_pieces_agrees_with_the_stateless_parser(
        data in bytes(512),
        chunks in proptest::collection::vec(1usize..40, 0..64),
    ) {
        // Random bytes: mostly errors, each of which must be the parser's.
        prop_assert_eq!(decode_chunked(&data, chunks.into_iter()), decode_whole(&data));
    }

    #[test]
    fn oversized_lengths_are_typed_errors(len in 65u64.., code in prop_oneof![Just(1u8), Just(3), Just(4), Just(8)]) {
        let mut data = vec![code];
        data.extend_from_slice(&len.to_le_bytes());
        let (reqs, err) = decode_chunked(&data, std::iter::repeat(1));
        prop_assert!(reqs.is_empty());
        let is_too_long = matches!(err, Some(WireError::TooLong { .. }));
        prop_assert!(is_too_long, "{:?}", err);
    }

    #[test]
    fn check_limits_agrees_with_the_decoder(req in request(), key in 0u64..20, value in 0u64..70, list in 0u64..7, message in 0u64..300) {
        // A message limit around the sizes `request()` makes, so that an estimate of the
        // encoded length off by a few bytes either way is caught.
        let limits = Limits { max_key_len: key, max_value_len: value, max_list_len: list, max_message_len: message };
        let b = req.to_bytes();
        let decoded = Request::decode(&b, &limits);
        match req.check_limits(&limits) {
            Ok(()) => prop_assert_eq!(decoded, Ok(Some((req.clone(), b.len())))),
            Err(e) => {
                let is_too_long = matches!(e, WireError::TooLong { .. });
                prop_assert!(is_too_long);
                let decode_too_long = matches!(decoded, Err(WireError::TooLong { .. }));
                prop_assert!(decode_too_long, "{:?}", decoded);
            }
        }
    }
}
