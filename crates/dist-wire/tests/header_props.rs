//! Property tests: the frame header round-trips and its decoder never panics.

use dist_wire::{CollectiveOp, DType, FrameHeader, HEADER_LEN, PAYLOAD_REF_LEN, PayloadRef};
use proptest::prelude::*;

fn header() -> impl Strategy<Value = FrameHeader> {
    (
        0u8..10,
        0u8..11,
        0u8..9,
        any::<[u32; 4]>(),
        any::<[u64; 4]>(),
        0u8..3,
    )
        .prop_map(|(op, dt, r, w, d, flags)| FrameHeader {
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
            flags,
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

    #[test]
    fn payload_refs_round_trip(addr in any::<u64>(), offer in 1u64..) {
        let r = PayloadRef { addr, offer };
        prop_assert_eq!(PayloadRef::decode(&r.encode()), Ok(r));
    }

    #[test]
    fn payload_ref_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..2 * PAYLOAD_REF_LEN)) {
        let _ = PayloadRef::decode(&bytes);
    }
}

#[test]
fn unknown_flags_and_reserved_bytes_are_rejected() {
    let h = FrameHeader {
        op: CollectiveOp::AllReduce,
        dtype: DType::F32,
        reduce: 0,
        group: 1,
        sender: 2,
        seq: 3,
        count: 4,
        root: 5,
        tag: 6,
        offset: 0,
        payload_len: 16,
        flags: FrameHeader::REMOTE,
    };
    assert_eq!(h.wire_payload_len(), PAYLOAD_REF_LEN as u64);
    let mut b = h.encode();
    b[56] = 4;
    assert!(FrameHeader::decode(&b).is_err());
    b[56] = FrameHeader::REMOTE | FrameHeader::ACK;
    assert!(FrameHeader::decode(&b).is_err());
    b[56] = 0;
    b[63] = 1;
    assert!(FrameHeader::decode(&b).is_err());
    assert!(
        PayloadRef::decode(&[0u8; PAYLOAD_REF_LEN]).is_err(),
        "offer 0 is never valid"
    );
}
