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

/// Pipelined chain root → root+1 → ...: each rank forwards segment k while it receives segment
/// k+1, so the whole buffer crosses every link once and the chain's depth costs only one
/// segment's latency per hop.
pub(crate) fn chain(o: &Op<'_>, data: &mut [u8], root: usize, seg: usize) -> Result<()> {
    let (n, r) = (o.n(), o.rank());
    let vr = (r + n - root) % n;
    let prev = (r + n - 1) % n;
    let next = (vr + 1 < n).then_some((r + 1) % n);
    let nseg = data.len().div_ceil(seg).max(1);
    let len = data.len();
    let range = |k: usize| (k * seg).min(len)..((k + 1) * seg).min(len);
    if vr == 0 {
        if let Some(next) = next {
            for k in 0..nseg {
                o.step(
                    &[o.send(next, &data[range(k)], tags::CHAIN | (k as u32 & 0xffff))],
                    &mut [],
                )?;
            }
        }
        return Ok(());
    }
    for k in 0..=nseg {
        // Segment k-1 (forwarded) lies before segment k (received): split between them.
        let at = if k < nseg { range(k).start } else { len };
        let (done, rest) = data.split_at_mut(at);
        let sends: Vec<_> = match (k, next) {
            (1.., Some(next)) => vec![o.send(
                next,
                &done[range(k - 1)],
                tags::CHAIN | ((k - 1) as u32 & 0xffff),
            )],
            _ => vec![],
        };
        let mut recvs: Vec<_> = if k < nseg {
            let len = range(k).len();
            vec![o.recv(prev, &mut rest[..len], tags::CHAIN | (k as u32 & 0xffff))]
        } else {
            vec![]
        };
        o.step(&sends, &mut recvs)?;
    }
    Ok(())
}
