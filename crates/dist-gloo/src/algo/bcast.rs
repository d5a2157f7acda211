//! broadcast: through the shared-memory group area where the group's ranks share cores and
//! the buffer is large enough, else a binomial tree for small buffers, a pipelined chain for
//! large ones, and a scatter followed by a ring all-gather (van de Geijn) where that wins.

use dist_backend::Result;

use super::{Op, even_blocks, ring, tags};
use crate::transport::Transport;

/// Whether a broadcast of `len` bytes goes through memory the whole group maps
/// ([`through_shared_memory`]): the transport has such memory and the buffer is at least
/// `min_bytes` (`GlooOptions::area_broadcast_min_bytes`, resolved). Every rank answers alike
/// for the same call, since the settings are agreed and ranks that pass different lengths
/// disagree in their headers too, whichever way each goes.
pub(crate) fn takes_area(t: &dyn Transport, len: usize, min_bytes: usize) -> bool {
    t.world_size() > 1 && t.shared_memory_bytes() > 0 && len >= min_bytes
}

/// Broadcasts `data` from `root` through memory the whole group maps
/// ([`crate::transport::Transport::shared_memory_exchange`]), in pieces of up to
/// [`crate::transport::Transport::shared_memory_bytes`]: the root publishes each piece, every
/// other rank publishes only its header and copies the piece out. `None` where
/// [`takes_area`] says no, and the caller goes over messages.
///
/// Why: where the ranks outnumber the cores, every message costs a wait for a peer's turn on
/// a core, and the tree or chain over messages waits at every hop; here each piece costs one
/// wait for every rank, and the root writes the next piece while the others copy this one
/// (its slots alternate). 4 ranks on 2 cores, gloo_bench, 4 runs alternated (us): 512 KiB 180
/// over messages against 68 here, 1 MiB 207 against 128, 4 MiB 521 against 394, 16 MiB 3766
/// against 2629, 64 MiB 18573 against 15134, 256 MiB 73436 against 50981 (3 runs); 256 KiB
/// even (bimodal over messages: 19-78 against 38-51), 64 KiB behind (5.5 against 14.4: a
/// root over messages runs ahead of its receivers, here it waits for them). 3 ranks: 1 MiB 129
/// against 110, 4 MiB 553 against 320, 64 MiB 13757 against 9257; 8 ranks: 1 MiB 683 against
/// 239, 16 MiB 14001 against 5884. With a core per rank (2 ranks) the two are even from 1 to
/// 256 MiB and messages lead below.
///
/// Where `output_leaves_cache` (the host's ranks' buffers together outgrow its last-level
/// cache) the copies out bypass the cache (`output_copy`), which keeps the area's slots in it:
/// 4 ranks, 5 runs alternated (us), 12 MiB 3962 against 3101 streamed, 16 MiB 3009 against
/// 2621, 32 MiB 6651 against 5177, 64 MiB 13346 against 10429; 8 MiB even.
///
/// Every rank reads every rank's header, which carries the root, count and type, so ranks
/// that disagree about them all fail at once, and the fused agreement (`agree`) owes nothing
/// afterwards: the caller drops it ([`Op::agreement_settled`]).
pub(crate) fn through_shared_memory(
    o: &Op<'_>,
    data: &mut [u8],
    root: usize,
    min_bytes: usize,
    output_leaves_cache: bool,
) -> Option<Result<()>> {
    if !takes_area(o.t, data.len(), min_bytes) {
        return None;
    }
    let piece_bytes = o.t.shared_memory_bytes();
    let (r, len) = (o.rank(), data.len());
    // One exchange even for an empty buffer, so that every rank still meets every other.
    let mut at = 0;
    loop {
        let piece = at..(at + piece_bytes).min(len);
        let size = |p: usize| if p == root { piece.len() } else { 0 };
        let published = if r == root {
            o.t.shared_memory_exchange(
                &o.ctx,
                o.count,
                &[&data[piece.clone()]],
                &mut |p, theirs| super::expect_published(o, p, theirs, size(p)),
            )
        } else {
            let into = &mut data[piece.clone()];
            o.t.shared_memory_exchange(&o.ctx, o.count, &[], &mut |p, theirs| {
                super::expect_published(o, p, theirs, size(p))?;
                if p == root {
                    crate::output_copy::copy_into_output(into, theirs, output_leaves_cache);
                }
                Ok(())
            })
        };
        if let Err(e) = super::unwrap_area(o, published) {
            return Some(Err(e));
        }
        at = piece.end;
        if at == len {
            break;
        }
    }
    o.agreement_settled();
    Some(Ok(()))
}

/// Binomial tree rooted at `root`: ⌈log2 n⌉ rounds, each rank receives once and forwards to
/// its subtrees.
pub(crate) fn tree(o: &Op<'_>, data: &mut [u8], root: usize) -> Result<()> {
    let (n, r) = (o.n(), o.rank());
    let vr = (r + n - root) % n;
    let mut mask = 1;
    while mask < n {
        if vr & mask != 0 {
            let parent = (vr - mask + root) % n;
            o.step(&[], &mut [o.recv(parent, data, tags::TREE)])?;
            break;
        }
        mask <<= 1;
    }
    let mut sends = Vec::new();
    mask >>= 1;
    while mask > 0 {
        if vr + mask < n {
            sends.push(o.send((vr + mask + root) % n, data, tags::TREE));
        }
        mask >>= 1;
    }
    o.step(&sends, &mut [])
}

/// Pipelined chain root → root+1 → ...: the buffer is cut into `seg`-byte chunks; the root
/// sends them all in one step, each middle rank forwards chunk k while it receives chunk k+1,
/// and the last rank receives them all in one step. The whole buffer crosses every link once
/// and the chain's depth costs one chunk's latency per hop.
pub(crate) fn chain(o: &Op<'_>, data: &mut [u8], root: usize, seg: usize) -> Result<()> {
    let (n, r) = (o.n(), o.rank());
    let vr = (r + n - root) % n;
    let prev = (r + n - 1) % n;
    let next = (r + 1) % n;
    let len = data.len();
    let nseg = len.div_ceil(seg).max(1);
    let range = |k: usize| (k * seg).min(len)..((k + 1) * seg).min(len);
    let tag = |k: usize| tags::CHAIN | (k as u32 & 0xffff);
    if vr == 0 {
        let sends: Vec<_> = (0..nseg)
            .map(|k| o.send(next, &data[range(k)], tag(k)))
            .collect();
        return o.step(&sends, &mut []);
    }
    if vr == n - 1 {
        let mut recvs: Vec<_> = data
            .chunks_mut(seg)
            .enumerate()
            .map(|(k, c)| o.recv(prev, c, tag(k)))
            .collect();
        if recvs.is_empty() {
            recvs.push(o.recv(prev, &mut [], tag(0)));
        }
        return o.step(&[], &mut recvs);
    }
    for k in 0..=nseg {
        // Chunk k-1 (forwarded) lies before chunk k (received): split between them.
        let at = if k < nseg { range(k).start } else { len };
        let (done, rest) = data.split_at_mut(at);
        let sends: Vec<_> = if k >= 1 {
            vec![o.send(next, &done[range(k - 1)], tag(k - 1))]
        } else {
            vec![]
        };
        let mut recvs: Vec<_> = if k < nseg {
            vec![o.recv(prev, &mut rest[..range(k).len()], tag(k))]
        } else {
            vec![]
        };
        o.step(&sends, &mut recvs)?;
    }
    Ok(())
}

/// Scatter, then ring all-gather (van de Geijn): the root sends block p (of n near-equal
/// blocks) to rank p, then every rank passes blocks round the ring until each has all n.
/// Every link carries (n − 1)/n of the buffer in the all-gather, all links at once, instead of
/// the chain's whole buffer over one path; the root sends only (n − 1)/n of it in all.
pub(crate) fn scatter_all_gather(o: &Op<'_>, data: &mut [u8], root: usize) -> Result<()> {
    let (n, r, elem) = (o.n(), o.rank(), o.dtype().size());
    let blocks = even_blocks(data.len() / elem, n, elem);
    if r == root {
        let sends: Vec<_> = (1..n)
            .map(|d| (root + d) % n)
            .map(|p| o.send(p, &data[blocks[p].clone()], tags::SCATTER))
            .collect();
        o.step(&sends, &mut [])?;
    } else {
        let mine = blocks[r].clone();
        o.step(&[], &mut [o.recv(root, &mut data[mine], tags::SCATTER)])?;
    }
    ring::all_gather(o, data, &blocks, 0)
}
