//! Single copy by reference over shared-memory rings follows the sender's pages: with the
//! ranks fitting the host's CPUs, all_to_all, all_gather, all_reduce and reduce_scatter send a
//! large message by reference exactly when its bytes lie in huge pages (checked against
//! `/proc/self/smaps`), and the results are right either way. Buffers at different offsets
//! within their pages arrive whole by reference, through the bounce buffer where the kernel's
//! copy would be slow and straight elsewhere. Where each way's pace decides
//! (`MeshOptions::adaptive_path`), the first large messages to a peer go the rule's way and the
//! fifth the other, and results stay right as the ways alternate.
#![cfg(target_os = "linux")]

mod common;

use std::sync::Mutex;
use std::time::Duration;

use common::{on_all, tcp_world};
use dist_backend::{Backend, BufMut, BufRef, OpOptions};
use dist_gloo::transport::shm::{TransportMode, online_cpus};
use dist_gloo::transport::tcp::cross_memory_available;
use dist_gloo::{GlooBackend, GlooOptions};
use dist_wire::{DType, ReduceOp};
use memmap2::{Advice, MmapMut};

const LEN: usize = 8 << 20;
const HUGE: usize = 2 << 20;

/// Both ranks' 8 MiB buffers, back to back from a 2 MiB boundary in one mapping advised as
/// `advice`, every byte written. One mapping, so that the kernel cannot merge the ranks'
/// buffers into one area of smaps (two advised alike side by side would be); 4 KiB short of
/// 2 MiB longer than the buffers, so that its only whole 2 MiB stretches are theirs and
/// smaps's count of its huge bytes is theirs.
struct Buffers {
    map: MmapMut,
    skip: usize,
}

impl Buffers {
    fn new(advice: Advice, fill: impl Fn(usize, usize) -> f32) -> Self {
        let map = MmapMut::map_anon(2 * LEN + HUGE - 4096).unwrap();
        let skip = (map.as_ptr() as usize).next_multiple_of(HUGE) - map.as_ptr() as usize;
        // Advice is a hint the kernel may not take (THP `never`); the test reads what it did.
        let _ = map.advise(advice);
        let mut b = Buffers { map, skip };
        for (r, buf) in b.split().into_iter().enumerate() {
            for (i, x) in bytemuck::cast_slice_mut::<u8, f32>(buf)
                .iter_mut()
                .enumerate()
            {
                *x = fill(r, i);
            }
        }
        b
    }

    /// Rank 0's buffer and rank 1's.
    fn split(&mut self) -> Vec<&mut [u8]> {
        let (a, b) = self.map[self.skip..self.skip + 2 * LEN].split_at_mut(LEN);
        vec![a, b]
    }

    /// How many of the buffers' bytes smaps counts as in huge pages. The area must be the
    /// mapping exactly (only one such mapping lives at a time, so none is merged into it).
    fn huge_bytes(&self) -> usize {
        let at = self.map.as_ptr() as usize;
        let area = format!("{:x}-{:x} ", at, at + self.map.len());
        let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
        let mut lines = smaps.lines().skip_while(|l| !l.starts_with(&area)).skip(1);
        lines
            .find_map(|l| l.strip_prefix("AnonHugePages:"))
            .and_then(|kb| {
                kb.trim()
                    .trim_end_matches("kB")
                    .trim()
                    .parse::<usize>()
                    .ok()
            })
            .expect("smaps lists the buffers' mapping")
            << 10
    }
}

/// What ranks that sent `sent` messages by reference from buffers with `huge` bytes in huge
/// pages must have done: by reference if every byte is in huge pages, through the rings if
/// none is (buffers in part can go either way: a message may lie in either part).
fn check_sent(what: &str, sent: &[u64], huge: usize) {
    if huge == 2 * LEN {
        assert!(
            sent.iter().all(|&s| s > 0),
            "{what}: buffers all in huge pages, sent by reference {sent:?}"
        );
    } else if huge == 0 {
        assert_eq!(
            sent,
            [0, 0],
            "{what}: buffers with no huge page, sent by reference"
        );
    }
}

/// Checks every rank's f32 output (`outs[r]`) element by element against `want(r, i)`.
fn expect_each<'a>(
    what: &str,
    outs: impl IntoIterator<Item = &'a [u8]>,
    want: impl Fn(usize, usize) -> f32,
) {
    for (r, out) in outs.into_iter().enumerate() {
        for (i, &g) in bytemuck::cast_slice::<u8, f32>(out).iter().enumerate() {
            assert_eq!(g, want(r, i), "{what}: rank {r} element {i}");
        }
    }
}

/// A 2-rank all_to_all of `LEN`-byte f32 `input`s: each rank sends the other the half of its
/// input that is the other's and keeps its own; returns this rank's output.
fn swap_halves(b: &GlooBackend, input: &[u8], opts: &OpOptions) -> Vec<u8> {
    let half = LEN / 8;
    let mut out = vec![0u8; LEN];
    b.all_to_all(
        BufRef::Host(input),
        BufMut::Host(&mut out),
        DType::F32,
        &[half; 2],
        &[half; 2],
        opts,
    )
    .unwrap();
    out
}

/// Checks [`swap_halves`]'s outputs from inputs filled with [`value`]: rank r's output holds
/// the r-th half of every rank's input, in rank order.
fn expect_swapped(what: &str, outs: &[Vec<u8>]) {
    let half = LEN / 8;
    expect_each(what, outs.iter().map(Vec::as_slice), |r, i| {
        value(i / half, r * half + i % half)
    });
}

/// Two ranks over shared-memory rings, with the pace of each way on or off (`adaptive`).
fn shm_pair(adaptive: bool) -> Vec<GlooBackend> {
    let mut o = GlooOptions::default();
    o.mesh.transport = TransportMode::Shm;
    o.mesh.timeout = Duration::from_secs(60);
    o.mesh.adaptive_path = adaptive;
    tcp_world(2, &o)
}

fn value(rank: usize, i: usize) -> f32 {
    (rank * 1_000_003 + i) as f32
}

fn by_reference(ranks: &[GlooBackend]) -> Vec<u64> {
    ranks
        .iter()
        .map(GlooBackend::messages_by_reference)
        .collect()
}

/// Runs `op` on every rank, then, where the pages decide (`pages_decide`), checks with
/// [`check_sent`] which messages went by reference from buffers with `huge` bytes in huge
/// pages.
fn on_all_by_pages<R: Send>(
    ranks: &[GlooBackend],
    what: &str,
    huge: usize,
    pages_decide: bool,
    op: impl Fn(&GlooBackend) -> R + Sync,
) -> Vec<R> {
    let before = by_reference(ranks);
    let out = on_all(ranks, op);
    if pages_decide {
        check_sent(what, &sent_since(ranks, &before), huge);
    }
    out
}

/// Messages each rank sent by reference since `before` ([`by_reference`]).
fn sent_since(ranks: &[GlooBackend], before: &[u64]) -> Vec<u64> {
    by_reference(ranks)
        .iter()
        .zip(before)
        .map(|(a, b)| a - b)
        .collect()
}

#[test]
fn large_messages_go_by_reference_exactly_from_huge_pages() {
    // The fixed rule alone: its choices, not what each way's pace teaches.
    let ranks = shm_pair(false);
    // With fewer CPUs than ranks every large message goes by reference: another rule.
    let pages_decide = online_cpus().is_some_and(|n| n >= 2) && cross_memory_available();
    let opts = OpOptions::with_timeout(Duration::from_secs(60));
    let (count, half) = (LEN / 4, LEN / 8);
    for advice in [Advice::NoHugePage, Advice::HugePage] {
        // all_to_all: each rank sends one half of its input to the other.
        let mut inputs = Buffers::new(advice, value);
        let huge = inputs.huge_bytes();
        if advice == Advice::NoHugePage {
            assert_eq!(huge, 0, "advised against huge pages");
        }
        let ins: Vec<&[u8]> = inputs.split().into_iter().map(|b| &*b).collect();
        let outs = on_all_by_pages(
            &ranks,
            &format!("all_to_all {advice:?}"),
            huge,
            pages_decide,
            |b| swap_halves(b, ins[b.rank()], &opts),
        );
        expect_swapped(&format!("all_to_all {advice:?}"), &outs);
        drop(ins);
        drop(inputs);

        // all_gather: each rank's own block of its output goes out.
        let mut outputs = Buffers::new(advice, |_, _| f32::NAN);
        let huge = outputs.huge_bytes();
        let slots: Mutex<Vec<Option<&mut [u8]>>> =
            Mutex::new(outputs.split().into_iter().map(Some).collect());
        on_all_by_pages(
            &ranks,
            &format!("all_gather {advice:?}"),
            huge,
            pages_decide,
            |b| {
                let input: Vec<f32> = (0..count / 2).map(|i| value(b.rank(), i)).collect();
                let out = slots.lock().unwrap()[b.rank()].take().unwrap();
                b.all_gather(
                    BufRef::Host(bytemuck::cast_slice(&input)),
                    BufMut::Host(out),
                    DType::F32,
                    &[count / 2; 2],
                    &opts,
                )
                .unwrap();
            },
        );
        expect_each(
            &format!("all_gather {advice:?}"),
            outputs.split().into_iter().map(|b| &*b),
            |_, i| value(i / (count / 2), i % (count / 2)),
        );
        drop(outputs);

        // all_reduce, in place (8 MiB, in messages of 1 MiB): both halves of the ring go out
        // of the caller's buffer. The sums are exact in f32 at these magnitudes.
        let mut bufs = Buffers::new(advice, value);
        let huge = bufs.huge_bytes();
        let slots: Mutex<Vec<Option<&mut [u8]>>> =
            Mutex::new(bufs.split().into_iter().map(Some).collect());
        on_all_by_pages(
            &ranks,
            &format!("all_reduce {advice:?}"),
            huge,
            pages_decide,
            |b| {
                let buf = slots.lock().unwrap()[b.rank()].take().unwrap();
                b.all_reduce(BufMut::Host(buf), DType::F32, ReduceOp::Sum, &opts)
                    .unwrap();
            },
        );
        expect_each(
            &format!("all_reduce {advice:?}"),
            bufs.split().into_iter().map(|b| &*b),
            |_, i| value(0, i) + value(1, i),
        );
        drop(bufs);

        // reduce_scatter: each rank sends the other's half of its input.
        let mut inputs = Buffers::new(advice, value);
        let huge = inputs.huge_bytes();
        let ins: Vec<&[u8]> = inputs.split().into_iter().map(|b| &*b).collect();
        let outs = on_all_by_pages(
            &ranks,
            &format!("reduce_scatter {advice:?}"),
            huge,
            pages_decide,
            |b| {
                let mut out = vec![0u8; LEN / 2];
                b.reduce_scatter(
                    BufRef::Host(ins[b.rank()]),
                    BufMut::Host(&mut out),
                    DType::F32,
                    ReduceOp::Sum,
                    &[half; 2],
                    &opts,
                )
                .unwrap();
                out
            },
        );
        expect_each(
            &format!("reduce_scatter {advice:?}"),
            outs.iter().map(Vec::as_slice),
            |r, i| value(0, r * half + i) + value(1, r * half + i),
        );
    }
}

/// `bytes` copied `at` bytes into a fresh page-aligned mapping: a buffer whose offset within
/// its pages the test chooses.
fn placed(bytes: &[u8], at: usize) -> MmapMut {
    let mut map = MmapMut::map_anon(at + bytes.len().max(1)).unwrap();
    map[at..at + bytes.len()].copy_from_slice(bytes);
    map
}

/// Ranks whose buffers sit at different offsets within their pages (rank r's `8 * r` bytes in)
/// read each other by reference at page distances of 8-24 bytes either way: those a rank reads
/// at 1-31 bytes past the source go through the bounce buffer (`cma::kernel_copy_slow`), the
/// others straight. Every op's result is checked element by element.
#[test]
fn buffers_at_different_page_offsets_arrive_whole_by_reference() {
    if !cross_memory_available() {
        eprintln!("skipped: this process may not read its own memory by cross-memory attach");
        return;
    }
    let n = 4;
    let ranks = common::world(common::shm_transports, n, &GlooOptions::default());
    let opts = OpOptions::with_timeout(Duration::from_secs(60));
    let shift = |r: usize| 8 * r;
    // Elements per rank's block: not a multiple of a page, so that blocks start off the pages'
    // boundaries too.
    let count = (1 << 18) + 3;
    let f32s = |r: usize, len: usize| -> Vec<u8> {
        bytemuck::cast_slice(&(0..len).map(|i| value(r, i)).collect::<Vec<f32>>()).to_vec()
    };
    let before = by_reference(&ranks);

    // all_gather: rank r contributes `count` elements.
    let outs = on_all(&ranks, |b| {
        let r = b.rank();
        let input = placed(&f32s(r, count), shift(r));
        let mut out = placed(&vec![0u8; 4 * n * count], shift(r));
        let at = shift(r);
        b.all_gather(
            BufRef::Host(&input[at..at + 4 * count]),
            BufMut::Host(&mut out[at..at + 4 * n * count]),
            DType::F32,
            &[count; 4],
            &opts,
        )
        .unwrap();
        out[at..at + 4 * n * count].to_vec()
    });
    expect_each("all_gather", outs.iter().map(Vec::as_slice), |_, i| {
        value(i / count, i % count)
    });

    // all_to_all: rank s sends elements [r * count, (r + 1) * count) of its input to rank r.
    let outs = on_all(&ranks, |b| {
        let r = b.rank();
        let at = shift(r);
        let input = placed(&f32s(r, n * count), at);
        let mut out = placed(&vec![0u8; 4 * n * count], at);
        b.all_to_all(
            BufRef::Host(&input[at..at + 4 * n * count]),
            BufMut::Host(&mut out[at..at + 4 * n * count]),
            DType::F32,
            &[count; 4],
            &[count; 4],
            &opts,
        )
        .unwrap();
        out[at..at + 4 * n * count].to_vec()
    });
    expect_each("all_to_all", outs.iter().map(Vec::as_slice), |r, i| {
        value(i / count, r * count + i % count)
    });

    // all_reduce (sum) of `n * count` elements.
    let outs = on_all(&ranks, |b| {
        let r = b.rank();
        let at = shift(r);
        let mut buf = placed(&f32s(r, n * count), at);
        b.all_reduce(
            BufMut::Host(&mut buf[at..at + 4 * n * count]),
            DType::F32,
            ReduceOp::Sum,
            &opts,
        )
        .unwrap();
        buf[at..at + 4 * n * count].to_vec()
    });
    expect_each("all_reduce", outs.iter().map(Vec::as_slice), |_, i| {
        (0..n).map(|s| value(s, i)).sum()
    });

    let sent = sent_since(&ranks, &before);
    assert!(
        sent.iter().all(|&s| s > 0),
        "every rank sent its large messages by reference: {sent:?}"
    );
}

/// Large messages (from two ring-fulls) follow each way's pace (`path_pace`) where the ranks
/// fit the CPUs: the first four of a size to a peer go the fixed rule's way, the fifth the
/// other way (a look), and what follows goes whichever was faster. Broadcasts and gathers of
/// 8 MiB from `Vec`s (the rule for them does not ask about huge pages), every result checked
/// element by element, whichever way each went.
#[test]
fn large_messages_look_at_the_other_way_on_the_fifth_and_stay_right() {
    let ranks = shm_pair(true);
    let opts = OpOptions::with_timeout(Duration::from_secs(60));
    let count = LEN / 4;
    let f32s = |r: usize, len: usize| -> Vec<u8> {
        bytemuck::cast_slice(&(0..len).map(|i| value(r, i)).collect::<Vec<f32>>()).to_vec()
    };
    let broadcast = |iteration: usize| {
        let outs = on_all(&ranks, |b| {
            let mut buf = if b.rank() == 0 {
                f32s(iteration, count)
            } else {
                vec![0u8; LEN]
            };
            b.broadcast(BufMut::Host(&mut buf), DType::F32, 0, &opts)
                .unwrap();
            buf
        });
        expect_each(
            &format!("broadcast {iteration}"),
            outs.iter().map(Vec::as_slice),
            |_, i| value(iteration, i),
        );
    };
    // gather to rank 0: rank 1 sends its input.
    let gather = |iteration: usize| {
        let outs = on_all(&ranks, |b| {
            let input = f32s(b.rank() + iteration, count);
            let mut out = vec![0u8; if b.rank() == 0 { 2 * LEN } else { 0 }];
            let output = (b.rank() == 0).then_some(BufMut::Host(&mut out));
            b.gather(BufRef::Host(&input), output, DType::F32, 0, &opts)
                .unwrap();
            out
        });
        expect_each(
            &format!("gather {iteration}"),
            outs[..1].iter().map(Vec::as_slice),
            |_, i| value(i / count + iteration, i % count),
        );
    };
    // Each op with the rank that sends in it: the pace times steps that only send.
    let broadcast: &dyn Fn(usize) = &broadcast;
    let gather: &dyn Fn(usize) = &gather;
    for (what, sender, op) in [("broadcast", 0, broadcast), ("gather", 1, gather)] {
        let start = by_reference(&ranks);
        for i in 0..4 {
            op(i);
        }
        let after_four = sent_since(&ranks, &start);
        op(4);
        let fifth = sent_since(&ranks, &start);
        // The pace decides only where the ranks fit the CPUs.
        if cross_memory_available() && online_cpus().is_some_and(|n| n >= 2) {
            // The rule sent the first four all one way (by reference or not, by the host's
            // CPUs); the fifth went the other.
            let (four, five) = (after_four[sender], fifth[sender] - after_four[sender]);
            assert!(
                (four == 0) != (five == 0),
                "{what}: by reference in the first four {four}, in the fifth {five}"
            );
        }
        for i in 5..24 {
            op(i);
        }
    }
}

/// With the pace on, exchanges and point-to-point keep the fixed rule: six all_to_alls of
/// 8 MiB per rank from memory advised against huge pages (where the rule sends nothing by
/// reference while the ranks fit the CPUs) and six sends of 8 MiB each way (point-to-point
/// never goes by reference) send nothing by reference, though the pace would look at the
/// other way on the fifth message of a step that only sends.
#[test]
fn exchanges_and_point_to_point_keep_the_fixed_rule_with_the_pace_on() {
    let ranks = shm_pair(true);
    let opts = OpOptions::with_timeout(Duration::from_secs(60));
    let pages_decide = online_cpus().is_some_and(|n| n >= 2) && cross_memory_available();
    let mut inputs = Buffers::new(Advice::NoHugePage, value);
    assert_eq!(inputs.huge_bytes(), 0, "advised against huge pages");
    let ins: Vec<&[u8]> = inputs.split().into_iter().map(|b| &*b).collect();
    let start = by_reference(&ranks);
    for i in 0..6 {
        let outs = on_all(&ranks, |b| swap_halves(b, ins[b.rank()], &opts));
        expect_swapped(&format!("all_to_all {i}"), &outs);
    }
    for i in 0..6 {
        let outs = on_all(&ranks, |b| {
            let (me, peer) = (b.rank(), 1 - b.rank());
            let mut got = vec![0u8; LEN];
            // Rank 0 sends first and rank 1 receives first: point-to-point sends are eager.
            if me == 0 {
                b.send(BufRef::Host(ins[me]), DType::F32, peer, &opts)
                    .unwrap();
                b.recv(BufMut::Host(&mut got), DType::F32, peer, &opts)
                    .unwrap();
            } else {
                b.recv(BufMut::Host(&mut got), DType::F32, peer, &opts)
                    .unwrap();
                b.send(BufRef::Host(ins[me]), DType::F32, peer, &opts)
                    .unwrap();
            }
            got
        });
        expect_each(
            &format!("send/recv {i}"),
            outs.iter().map(Vec::as_slice),
            |r, i| value(1 - r, i),
        );
    }
    if pages_decide {
        assert_eq!(
            sent_since(&ranks, &start),
            [0, 0],
            "exchanges and point-to-point sent by reference"
        );
    }
}
