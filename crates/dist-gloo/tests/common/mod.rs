//! Shared test harness: worlds of ranks as threads, and reference reductions.

#![allow(dead_code, reason = "each test binary uses part of the harness")]
#![allow(
    unreachable_pub,
    reason = "a test harness module is private to its test binary"
)]

use std::sync::Arc;
use std::time::Duration;

use dist_backend::store::HashStore;
use dist_backend::{Backend, BufMut, BufRef, OpOptions};
use dist_gloo::transport::Transport;
use dist_gloo::transport::mem::MemTransport;
use dist_gloo::transport::shm::TransportMode;
use dist_gloo::transport::tcp::TcpTransport;
use dist_gloo::{GlooBackend, GlooOptions};
use dist_wire::{DType, ReduceOp};

/// `n` ranks connected over real loopback TCP through an in-process store.
pub fn tcp_world(n: usize, opts: &GlooOptions) -> Vec<GlooBackend> {
    tcp_world_with(n, |_| opts.clone())
}

/// [`tcp_world`] with options chosen per rank.
pub fn tcp_world_with(n: usize, opts: impl Fn(usize) -> GlooOptions + Sync) -> Vec<GlooBackend> {
    let store = Arc::new(HashStore::new(Duration::from_secs(30)));
    let prefix = format!("test-{}", std::process::id());
    std::thread::scope(|s| {
        let hs: Vec<_> = (0..n)
            .map(|r| {
                let store = store.clone();
                let prefix = prefix.clone();
                let opts = &opts;
                s.spawn(move || {
                    GlooBackend::connect(&*store, &prefix, r, n, &opts(r)).expect("mesh builds")
                })
            })
            .collect();
        hs.into_iter()
            .map(|h| h.join().expect("rank thread"))
            .collect()
    })
}

/// Builds a world of `n` connected transports, one per rank: what a driver of the peer
/// protocol contributes to the conformance suite, which runs the same bodies over each.
pub type MakeTransports = fn(usize, &GlooOptions) -> Vec<Box<dyn Transport>>;

/// The drivers under the conformance suite, by name. A new transport adds its line here.
pub const DRIVERS: &[(&str, MakeTransports)] = &[
    ("tcp", tcp_only_transports),
    ("shm", shm_transports),
    ("mem", mem_transports),
];

/// `opts` with every pair on `mode`.
fn with_mode(opts: &GlooOptions, mode: TransportMode) -> GlooOptions {
    let mut o = opts.clone();
    o.mesh.transport = mode;
    o
}

/// [`tcp_transports`] with every pair on sockets.
pub fn tcp_only_transports(n: usize, opts: &GlooOptions) -> Vec<Box<dyn Transport>> {
    tcp_transports(n, &with_mode(opts, TransportMode::Tcp))
}

/// [`tcp_transports`] with every pair on shared-memory rings (checked), large messages going
/// by reference where the ranks can read each other (as on a host with fewer CPUs than ranks),
/// broadcast's and scatter's too, read half by a helper thread (as on a host with spare cores).
pub fn shm_transports(n: usize, opts: &GlooOptions) -> Vec<Box<dyn Transport>> {
    let mut o = opts.clone();
    o.mesh.cross_memory_over_rings = Some(true);
    o.mesh.copy_helper = Some(true);
    rings(n, &o)
}

/// [`shm_transports`] with every message through the rings (as on a host with a CPU per
/// rank).
pub fn shm_rings_transports(n: usize, opts: &GlooOptions) -> Vec<Box<dyn Transport>> {
    let mut o = opts.clone();
    o.mesh.cross_memory_over_rings = Some(false);
    rings(n, &o)
}

/// Every pair on shared-memory rings (checked).
fn rings(n: usize, opts: &GlooOptions) -> Vec<Box<dyn Transport>> {
    let ts = tcp_transports(n, &with_mode(opts, TransportMode::Shm));
    for t in &ts {
        let want: Vec<bool> = (0..n).map(|p| p != t.rank()).collect();
        assert_eq!(
            t.shared_memory_peers(),
            want,
            "rank {} uses rings",
            t.rank()
        );
    }
    ts
}

/// `n` TCP transports over loopback, connected through an in-process store.
pub fn tcp_transports(n: usize, opts: &GlooOptions) -> Vec<Box<dyn Transport>> {
    let store = Arc::new(HashStore::new(Duration::from_secs(30)));
    let prefix = format!("transports-{}", std::process::id());
    std::thread::scope(|s| {
        let hs: Vec<_> = (0..n)
            .map(|r| {
                let store = store.clone();
                let prefix = prefix.clone();
                s.spawn(move || -> Box<dyn Transport> {
                    Box::new(
                        TcpTransport::connect(&*store, &prefix, r, n, &opts.mesh)
                            .expect("mesh builds"),
                    )
                })
            })
            .collect();
        hs.into_iter()
            .map(|h| h.join().expect("rank thread"))
            .collect()
    })
}

/// `n` in-memory transports (bounded byte pipes).
pub fn mem_transports(n: usize, opts: &GlooOptions) -> Vec<Box<dyn Transport>> {
    MemTransport::network(n, opts.mesh.segment_bytes)
        .into_iter()
        .map(|t| Box::new(t) as Box<dyn Transport>)
        .collect()
}

/// A world of backends over the transports `make` builds.
pub fn world(make: MakeTransports, n: usize, opts: &GlooOptions) -> Vec<GlooBackend> {
    make(n, opts)
        .into_iter()
        .map(|t| GlooBackend::over(t, 0, opts))
        .collect()
}

/// Runs `f` on every rank concurrently and returns the ranks' results in rank order.
pub fn on_all<R: Send>(ranks: &[GlooBackend], f: impl Fn(&GlooBackend) -> R + Sync) -> Vec<R> {
    std::thread::scope(|s| {
        let hs: Vec<_> = ranks.iter().map(|b| s.spawn(|| f(b))).collect();
        hs.into_iter()
            .map(|h| h.join().expect("rank thread panicked"))
            .collect()
    })
}

/// Whether the type is signed (its test values include negatives).
fn signed(d: DType) -> bool {
    matches!(d, DType::I8 | DType::I16 | DType::I32 | DType::I64) || d.is_float()
}

/// The logical test value of element `i` on rank `r` for `op`.
pub fn value(d: DType, op: ReduceOp, r: usize, i: usize) -> f64 {
    match op {
        ReduceOp::Product => 1.0 + ((r + i) % 2) as f64,
        _ => ((r * 7 + i * 3) % 11) as f64 - if signed(d) { 5.0 } else { 0.0 },
    }
}

/// Encodes logical values as `d` elements.
pub fn encode(d: DType, vals: impl Iterator<Item = f64>) -> Vec<u8> {
    d.encode_f64s(vals)
}

/// Decodes `d` elements to logical values.
pub fn decode(d: DType, bytes: &[u8]) -> Vec<f64> {
    d.decode_f64s(bytes)
}

/// The reduction of element `i` over `n` ranks, computed independently of the library.
pub fn reference(d: DType, op: ReduceOp, n: usize, i: usize) -> f64 {
    let vals: Vec<f64> = (0..n).map(|r| value(d, op, r, i)).collect();
    let ints: Vec<i64> = vals.iter().map(|v| *v as i64).collect();
    match op {
        ReduceOp::Sum => vals.iter().sum(),
        ReduceOp::Product => vals.iter().product(),
        ReduceOp::Min => vals.iter().cloned().fold(f64::INFINITY, f64::min),
        ReduceOp::Max => vals.iter().cloned().fold(f64::NEG_INFINITY, f64::max),
        ReduceOp::BitAnd => ints.iter().fold(-1i64, |a, b| a & b) as f64,
        ReduceOp::BitOr => ints.iter().fold(0i64, |a, b| a | b) as f64,
        ReduceOp::BitXor => ints.iter().fold(0i64, |a, b| a ^ b) as f64,
        ReduceOp::Avg if d.is_float() => vals.iter().sum::<f64>() / n as f64,
        ReduceOp::Avg => (ints.iter().sum::<i64>() / n as i64) as f64,
        ReduceOp::PremulSum(s) => vals.iter().map(|v| v * s).sum(),
        _ => unreachable!("every op is listed"),
    }
}

/// Asserts `got` equals the reference within the dtype's rounding.
pub fn assert_close(d: DType, what: &str, i: usize, got: f64, want: f64) {
    let tol = match d {
        DType::F16 => 1e-3,
        DType::BF16 => 8e-3,
        DType::F32 => 1e-6,
        DType::F64 => 1e-12,
        _ => 0.0,
    };
    assert!(
        (got - want).abs() <= tol * want.abs().max(1.0),
        "{what}: element {i}: got {got}, want {want}"
    );
}

/// Runs `all_to_all` of `d` on every rank, rank `s` sending `split(s, r)` elements to rank `r`
/// (the [`value`]s of a block of its own), and checks that every rank received exactly the
/// blocks meant for it, in sender order. Receive buffers start as `0xA5` bytes, so bytes the
/// collective failed to write show. `what` names the case in a failure.
pub fn check_all_to_all(
    ranks: &[GlooBackend],
    d: DType,
    split: impl Fn(usize, usize) -> usize + Sync,
    opts: &OpOptions,
    what: &str,
) {
    let n = ranks.len();
    let block = |s: usize, r: usize| {
        encode(
            d,
            (0..split(s, r)).map(|i| value(d, ReduceOp::Sum, s * n + r, i)),
        )
    };
    let outs = on_all(ranks, |b| {
        let me = b.rank();
        let send_counts: Vec<usize> = (0..n).map(|r| split(me, r)).collect();
        let recv_counts: Vec<usize> = (0..n).map(|s| split(s, me)).collect();
        let input: Vec<u8> = (0..n).flat_map(|r| block(me, r)).collect();
        let mut out = vec![0xA5u8; recv_counts.iter().sum::<usize>() * d.size()];
        b.all_to_all(
            BufRef::Host(&input),
            BufMut::Host(&mut out),
            d,
            &send_counts,
            &recv_counts,
            opts,
        )
        .unwrap_or_else(|e| panic!("all_to_all ws {n} {d} {what}: {e}"));
        out
    });
    for (r, o) in outs.iter().enumerate() {
        let want: Vec<u8> = (0..n).flat_map(|s| block(s, r)).collect();
        // Not assert_eq: a large mismatch would print megabytes.
        assert!(*o == want, "all_to_all ws {n} {d} {what}: rank {r} differs");
    }
}

/// [`Backend::all_to_all_even`] of `count` elements from every rank to every rank, every rank's
/// output checked block by block against what its sender encoded for it.
pub fn check_all_to_all_even(
    ranks: &[GlooBackend],
    d: DType,
    count: usize,
    opts: &OpOptions,
    what: &str,
) {
    let n = ranks.len();
    let block =
        |s: usize, r: usize| encode(d, (0..count).map(|i| value(d, ReduceOp::Sum, s * n + r, i)));
    let outs = on_all(ranks, |b| {
        let input: Vec<u8> = (0..n).flat_map(|r| block(b.rank(), r)).collect();
        let mut out = vec![0xA5u8; input.len()];
        b.all_to_all_even(BufRef::Host(&input), BufMut::Host(&mut out), d, count, opts)
            .unwrap_or_else(|e| panic!("all_to_all_even ws {n} {d} {what}: {e}"));
        out
    });
    for (r, o) in outs.iter().enumerate() {
        let want: Vec<u8> = (0..n).flat_map(|s| block(s, r)).collect();
        assert!(
            *o == want,
            "all_to_all_even ws {n} {d} {what}: rank {r} differs"
        );
    }
}

/// reduce_scatter of `counts[r]` elements to each rank r, every rank's output checked against
/// [`reference`].
pub fn check_reduce_scatter(ranks: &[GlooBackend], d: DType, op: ReduceOp, counts: &[usize]) {
    let n = ranks.len();
    let total: usize = counts.iter().sum();
    let outs = on_all(ranks, |b| {
        let input = encode(d, (0..total).map(|i| value(d, op, b.rank(), i)));
        let mut out = vec![0xA5u8; counts[b.rank()] * d.size()];
        b.reduce_scatter(
            BufRef::Host(&input),
            BufMut::Host(&mut out),
            d,
            op,
            counts,
            &OpOptions::with_timeout(Duration::from_secs(60)),
        )
        .unwrap_or_else(|e| panic!("reduce_scatter ws {n} {d} {op} {counts:?}: {e}"));
        out
    });
    let mut at = 0;
    for (r, out) in outs.iter().enumerate() {
        for (j, got) in decode(d, out).into_iter().enumerate() {
            assert_close(
                d,
                &format!("reduce_scatter ws {n} {d} {op} counts {counts:?} rank {r}"),
                j,
                got,
                reference(d, op, n, at + j),
            );
        }
        at += counts[r];
    }
}
