//! broadcast: a binomial tree for small buffers, a pipelined chain for large ones, and a
//! scatter followed by a ring all-gather (van de Geijn) where that wins.

use dist_backend::Result;

use super::{Op, even_blocks, ring, tags};

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
