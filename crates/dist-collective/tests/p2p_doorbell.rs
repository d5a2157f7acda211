//! Point-to-point through the store doorbells, the path a backend without
//! `Backend::probe` takes (forced with `DIST_P2P_DOORBELL=1`; this test binary sets it before any
//! group exists, and runs nothing else).

use dist_collective::testing::run_world;

#[test]
fn doorbell_path_matches_tags_and_does_not_deadlock() {
    // SAFETY: set before any thread of this process exists that could read the environment
    // (the only test in this binary, at its start).
    unsafe { std::env::set_var("DIST_P2P_DOORBELL", "1") };
    for n in [1usize, 1 << 20] {
        let out = run_world(2, move |pg| {
            let peer = 1 - pg.rank();
            // Both ranks post the receive first: only the doorbell lets the send go ahead.
            let r = pg.irecv(vec![0u32; n], peer, 7)?;
            let early = pg.irecv(vec![0u8; 3], peer, 9)?;
            pg.send(&[pg.rank() as u8; 3], peer, 9)?;
            pg.send(&vec![pg.rank() as u32 + 10; n], peer, 7)?;
            Ok((r.wait()?, early.wait()?))
        })
        .unwrap();
        assert_eq!(out[0], (vec![11u32; n], vec![1u8; 3]));
        assert_eq!(out[1], (vec![10u32; n], vec![0u8; 3]));
    }
}
