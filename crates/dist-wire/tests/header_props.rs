//! Property tests: the frame header round-trips and its decoder never panics.

use dist_wire::{
    CloseReason, CollectiveOp, DType, FrameHeader, HEADER_LEN, MAX_CLOSE_PAYLOAD, NO_ROOT,
    PAYLOAD_REF_LEN, PayloadRef, splits_fingerprint,
};
use proptest::prelude::*;

fn header() -> impl Strategy<Value = FrameHeader> {
    (
        0u8..10,
        0u8..11,
        0u8..9,
        any::<[u32; 5]>(),
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
            splits: w[4],
            reduce_arg: d[0] as u32 & 0x00ff_ffff,
        })
}

/// Every reason a `Close` frame can give, with arbitrary data headers for a mismatch.
fn close_reason() -> impl Strategy<Value = CloseReason> {
    prop_oneof![
        Just(CloseReason::Goodbye),
        (0u32..u32::MAX).prop_map(|culprit| CloseReason::Lost { culprit }),
        (0u32..u32::MAX).prop_map(|culprit| CloseReason::Stalled { culprit }),
        (0u32..u32::MAX, header(), header()).prop_map(|(culprit, found, met)| {
            CloseReason::Mismatch {
                culprit,
                found,
                met,
            }
        }),
    ]
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
    fn close_reasons_round_trip(reason in close_reason(), sender in any::<u32>()) {
        let bytes = reason.encode(sender);
        let h = FrameHeader::decode(&bytes).unwrap();
        prop_assert_eq!(h.op, CollectiveOp::Close);
        prop_assert_eq!(h.sender, sender);
        prop_assert_eq!(h.payload_len as usize, bytes.len() - HEADER_LEN);
        prop_assert!(bytes.len() <= HEADER_LEN + MAX_CLOSE_PAYLOAD);
        prop_assert_eq!(CloseReason::decode(&h, &bytes[HEADER_LEN..]), Ok(reason));
    }

    #[test]
    fn close_payload_bytes_never_panic(reason in close_reason(), at in 0usize..HEADER_LEN + MAX_CLOSE_PAYLOAD, byte in any::<u8>(), cut in 0usize..=MAX_CLOSE_PAYLOAD) {
        let mut bytes = reason.encode(1);
        if at < bytes.len() {
            bytes[at] = byte;
        }
        if let Ok(h) = FrameHeader::decode(&bytes) {
            let payload = &bytes[HEADER_LEN..];
            let _ = CloseReason::decode(&h, payload);
            let _ = CloseReason::decode(&h, &payload[..cut.min(payload.len())]);
        }
    }

    #[test]
    fn splits_fingerprints_are_never_zero_and_tell_orders_apart(counts in proptest::collection::vec(0usize..1000, 0..9)) {
        prop_assert_ne!(splits_fingerprint(&counts), 0);
        let mut rev = counts.clone();
        rev.reverse();
        if rev != counts {
            // Not guaranteed for a hash in general, but these short vectors must differ.
            prop_assert_ne!(splits_fingerprint(&rev), splits_fingerprint(&counts));
        }
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
fn unknown_flags_are_rejected_and_the_last_bytes_are_the_reduce_arg() {
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
        splits: 0,
        reduce_arg: 0,
    };
    assert_eq!(h.wire_payload_len(), PAYLOAD_REF_LEN as u64);
    let mut b = h.encode();
    b[56] = 4;
    assert!(FrameHeader::decode(&b).is_err());
    b[56] = FrameHeader::REMOTE | FrameHeader::ACK;
    assert!(FrameHeader::decode(&b).is_err());
    b[56] = 0;
    b[57] = 1;
    assert_eq!(FrameHeader::decode(&b).map(|h| h.splits), Ok(1));
    b[63] = 0xab;
    assert_eq!(
        FrameHeader::decode(&b).map(|h| h.reduce_arg),
        Ok(0x00ab_0000)
    );
    assert!(
        PayloadRef::decode(&[0u8; PAYLOAD_REF_LEN]).is_err(),
        "offer 0 is never valid"
    );
}

#[test]
fn close_frames_with_long_payloads_or_flags_are_rejected_before_reading_them() {
    let mut h = FrameHeader::decode(&CloseReason::Lost { culprit: 2 }.encode(0)).unwrap();
    assert_eq!(h.root, NO_ROOT);
    h.payload_len = MAX_CLOSE_PAYLOAD as u64 + 1;
    let e = FrameHeader::decode(&h.encode()).unwrap_err();
    assert_eq!(
        e.to_string(),
        "close frame payload of 129 bytes exceeds the limit of 128"
    );
    h.payload_len = 0;
    h.flags = FrameHeader::ACK;
    assert!(FrameHeader::decode(&h.encode()).is_err());
    // An unknown cause, and a mismatch notice without its two headers, are errors.
    h.flags = 0;
    h.count = 7;
    assert!(CloseReason::decode(&h, &[]).is_err());
    h.count = CloseReason::MISMATCH;
    assert!(CloseReason::decode(&h, &[]).is_err());
}
