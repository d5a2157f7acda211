//! broadcast: a binomial tree for small buffers, a pipelined chain for large ones.

use dist_backend::Result;

use super::{Op, tags};

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
