//! Choosing shared memory: `DIST_GLOO_TRANSPORT=shm` where it is impossible (ranks on other
//! hosts, a rank that takes no part) fails the mesh on the ranks that asked for it, naming the
//! peer and why, instead of falling back silently.

use std::sync::Arc;
use std::time::Duration;

use dist_backend::store::HashStore;
use dist_backend::{Backend, BufMut, Error, OpOptions};
use dist_gloo::transport::shm::TransportMode;
use dist_gloo::{GlooBackend, GlooOptions};
use dist_wire::{DType, ReduceOp};

/// Connects `n` ranks as threads with per-rank options; each rank's outcome.
fn connect_all(
    n: usize,
    opts: impl Fn(usize) -> GlooOptions + Sync,
) -> Vec<Result<GlooBackend, Error>> {
    let store = Arc::new(HashStore::new(Duration::from_secs(30)));
    std::thread::scope(|s| {
        let hs: Vec<_> = (0..n)
            .map(|r| {
                let store = store.clone();
                let opts = &opts;
                s.spawn(move || GlooBackend::connect(&*store, "sel", r, n, &opts(r)))
            })
            .collect();
        hs.into_iter()
            .map(|h| h.join().expect("rank thread"))
            .collect()
    })
}

fn opts(mode: TransportMode, host: &str) -> GlooOptions {
    let mut o = GlooOptions::default();
    o.mesh.transport = mode;
    o.mesh.host_id = Some(host.to_string());
    o.mesh.timeout = Duration::from_secs(30);
    o
}

#[test]
fn shm_between_hosts_is_an_error_naming_the_peer_on_every_rank() {
    let hosts = ["x", "x", "y"];
    let outs = connect_all(3, |r| opts(TransportMode::Shm, hosts[r]));
    for (r, out) in outs.iter().enumerate() {
        let e = out
            .as_ref()
            .expect_err("shm across hosts must fail")
            .to_string();
        let peer = if r == 2 { 0 } else { 2 };
        assert!(
            e.contains(&format!("rank {r}"))
                && e.contains(&format!("with rank {peer}"))
                && e.contains("another host"),
            "rank {r}: {e}"
        );
    }
}

#[test]
fn shm_with_a_rank_that_chose_tcp_is_an_error_naming_it() {
    let outs = connect_all(3, |r| {
        let mode = if r == 1 {
            TransportMode::Tcp
        } else {
            TransportMode::Shm
        };
        opts(mode, "x")
    });
    for r in [0, 2] {
        let e = outs[r].as_ref().expect_err("must fail").to_string();
        assert!(
            e.contains(&format!("rank {r}"))
                && e.contains("with rank 1")
                && e.contains("it takes no part"),
            "rank {r}: {e}"
        );
    }
    // The rank that chose TCP fails too, naming a rank that asked for shared memory, rather
    // than waiting for peers that gave up.
    let e = outs[1].as_ref().expect_err("must fail").to_string();
    assert!(
        e.contains("rank 1") && e.contains("rank 0 asked for DIST_GLOO_TRANSPORT=shm"),
        "rank 1: {e}"
    );
}

#[test]
fn auto_falls_back_to_tcp_where_a_peer_takes_no_part() {
    let outs = connect_all(3, |r| {
        let mode = if r == 1 {
            TransportMode::Tcp
        } else {
            TransportMode::Auto
        };
        opts(mode, "x")
    });
    let peers: Vec<Vec<bool>> = outs
        .iter()
        .map(|o| o.as_ref().expect("auto builds").shared_memory_peers())
        .collect();
    assert_eq!(
        peers,
        vec![
            vec![false, false, true],
            vec![false, false, false],
            vec![true, false, false]
        ]
    );
}

/// A group is on one host (which moves all_reduce's switch from halving-doubling to the ring
/// down to 256 KiB) only when every rank shares memory on it; every rank must agree, or their
/// all_reduce of a size between the two switches would run different algorithms. Whether some
/// two ranks share memory through rings at all (which keeps all_to_all's blocks all in flight
/// at once and all_gather's ring whole) is read from the same records, alike on every rank;
/// single copy is off here, since threads of one process read each other wherever the system
/// call is allowed.
#[test]
fn every_rank_agrees_whether_the_group_is_on_one_host() {
    type Case = (
        &'static str,
        [&'static str; 4],
        [TransportMode; 4],
        bool,
        bool,
    );
    let cases: [Case; 6] = [
        ("one host", ["x"; 4], [TransportMode::Auto; 4], true, true),
        (
            "two hosts",
            ["x", "x", "y", "y"],
            [TransportMode::Auto; 4],
            false,
            true,
        ),
        // Host ids that a space would have cut to one word in the published records.
        (
            "host ids with spaces",
            ["a b", "a b", "a", "a"],
            [TransportMode::Auto; 4],
            false,
            true,
        ),
        (
            "rank 2 on TCP",
            ["x"; 4],
            [
                TransportMode::Auto,
                TransportMode::Auto,
                TransportMode::Tcp,
                TransportMode::Auto,
            ],
            false,
            true,
        ),
        (
            "a host each",
            ["w", "x", "y", "z"],
            [TransportMode::Auto; 4],
            false,
            false,
        ),
        (
            "one host, all on TCP",
            ["x"; 4],
            [TransportMode::Tcp; 4],
            false,
            false,
        ),
    ];
    for (what, hosts, modes, want, want_rings) in cases {
        let outs = connect_all(4, |r| {
            let mut o = opts(modes[r], hosts[r]);
            o.mesh.cross_memory = false;
            o
        });
        let ranks: Vec<GlooBackend> = outs
            .into_iter()
            .map(|o| o.unwrap_or_else(|e| panic!("{what}: {e}")))
            .collect();
        for b in &ranks {
            assert_eq!(b.one_host(), want, "{what}: rank {}", b.rank());
            assert_eq!(
                b.memory_shared_in_group(),
                want_rings,
                "{what}: rank {}",
                b.rank()
            );
        }
        // 512 KiB lies between the two switches: every rank runs the same algorithm or fails.
        std::thread::scope(|s| {
            for b in &ranks {
                s.spawn(move || {
                    let count = 128 << 10;
                    let mut buf: Vec<u8> = (0..count)
                        .flat_map(|i| ((i % 7 + b.rank()) as f32).to_ne_bytes())
                        .collect();
                    b.all_reduce(
                        BufMut::Host(&mut buf),
                        DType::F32,
                        ReduceOp::Sum,
                        &OpOptions::default(),
                    )
                    .unwrap_or_else(|e| panic!("{what}: {e}"));
                    for (i, v) in buf.chunks_exact(4).enumerate() {
                        let want = (4 * (i % 7) + 6) as f32;
                        assert_eq!(f32::from_ne_bytes(v.try_into().unwrap()), want, "{what}");
                    }
                });
            }
        });
    }
}

#[test]
fn an_unknown_transport_is_refused_when_read() {
    let e = "udp".parse::<TransportMode>().expect_err("unknown");
    assert!(e.contains("DIST_GLOO_TRANSPORT=\"udp\"") && e.contains("auto, tcp or shm"));
    assert_eq!("SHM".parse::<TransportMode>(), Ok(TransportMode::Shm));
    assert_eq!("tcp".parse::<TransportMode>(), Ok(TransportMode::Tcp));
    assert_eq!("auto".parse::<TransportMode>(), Ok(TransportMode::Auto));
}

/// Ranks that can read each other's memory (single copy) share memory as much as ranks joined
/// by rings: with every pair on TCP and single copy on, every rank says so where this host lets
/// a process read itself (the ranks are threads of one process), the rank that turned single
/// copy off included, and no rank says so with single copy off everywhere.
#[test]
fn single_copy_counts_as_shared_memory_on_every_rank() {
    let available = dist_gloo::transport::tcp::cross_memory_available();
    let cases: [([bool; 3], bool); 3] = [
        ([true; 3], available),
        ([false, true, true], available),
        ([false; 3], false),
    ];
    for (cross_memory, want) in cases {
        let ranks: Vec<GlooBackend> = connect_all(3, |r| {
            let mut o = opts(TransportMode::Tcp, ["x", "y", "z"][r]);
            o.mesh.cross_memory = cross_memory[r];
            o
        })
        .into_iter()
        .map(|o| o.expect("mesh builds"))
        .collect();
        for b in &ranks {
            assert_eq!(
                b.memory_shared_in_group(),
                want,
                "single copy {cross_memory:?}: rank {}",
                b.rank()
            );
        }
    }
}
