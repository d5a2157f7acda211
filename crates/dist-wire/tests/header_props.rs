//! Property tests: the frame header round-trips and its decoder never panics.

use dist_wire::{CollectiveOp, DType, FrameHeader, HEADER_LEN};
use proptest::prelude::*;

fn header() -> impl Strategy<Value = FrameHeader> {
    (
        0u8..10,
        0u8..11,
        0u8..9,
        any::<[u32; 4]>(),
        any::<[u64; 4]>(),
    )
        .prop_map(|(op, dt, r, w, d)| FrameHeader {
            op: CollectiveOp::from_code(op).unwrap(),
            dtype: DType::from_code(dt).unwrap(),
            reduce: r,
            group: w[0],
            sender: w[1],
            root: w[2],
            tag: w[3],
            seq: d[0],
            count: d[1],
            offset: d[2],
            payload_len: d[3],
        })
}

proptest! {
    #[test]
    fn round_trips(h in header()) {
        prop_assert_eq!(FrameHeader::decode(&h.encode()), Ok(h));
    }

    #[test]
    fn random_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..128)) {
        let _ = FrameHeader::decode(&bytes);
    }

    #[test]
    fn mutated_headers_decode_or_fail_cleanly(h in header(), at in 0usize..HEADER_LEN, byte in any::<u8>(), cut in 0usize..=HEADER_LEN) {
        let mut b = h.encode();
        b[at] = byte;
        match FrameHeader::decode(&b) {
            Ok(d) => prop_assert_eq!(&d.encode()[..], &b[..]),
            Err(e) => prop_assert!(!e.to_string().is_empty()),
        }
        prop_assert!(FrameHeader::decode(&b[..cut]).is_err() || cut == HEADER_LEN);
    }
}
