//! The `DIST_DEBUG=DETAIL` check: before each collective, the ranks all-gather a fingerprint
//! of its arguments and fail, naming the other rank, when any differs.

use dist_backend::{Backend, BufMut, BufRef, OpOptions};

use super::OpCtx;
use crate::{Error, Result};

/// A fingerprint of one collective, compared across ranks at `DIST_DEBUG=DETAIL`.
pub(crate) type Fingerprint = [u64; 4];

pub(crate) fn fingerprint(
    op: &'static str,
    dtype: Option<dist_wire::DType>,
    count: usize,
    root: Option<usize>,
) -> Fingerprint {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in op.bytes() {
        h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
    }
    [
        h,
        dtype.map_or(u64::MAX, |d| u64::from(d.code())),
        count as u64,
        root.map_or(u64::MAX, |r| r as u64),
    ]
}

pub(super) fn check_fingerprint(
    ctx: &OpCtx,
    b: &dyn Backend,
    op: &'static str,
    fp: Fingerprint,
) -> Result<()> {
    let mut all = vec![0u64; 4 * ctx.world_size];
    let counts = vec![4; ctx.world_size];
    b.all_gather(
        BufRef::Host(bytemuck::cast_slice(&fp)),
        BufMut::Host(bytemuck::cast_slice_mut(&mut all)),
        dist_wire::DType::U64,
        &counts,
        &OpOptions::with_timeout(ctx.timeout),
    )?;
    for (r, theirs) in all.chunks_exact(4).enumerate() {
        if theirs != fp {
            return Err(Error::invalid(
                ctx.rank,
                op,
                format!(
                    "DIST_DEBUG=DETAIL fingerprint check: this rank called {op} (dtype code {}, count {}, root {}) but rank {r} called an operation with fingerprint (op hash {:#x}, dtype code {}, count {}, root {})",
                    fp[1] as i64,
                    fp[2],
                    fp[3] as i64,
                    theirs[0],
                    theirs[1] as i64,
                    theirs[2],
                    theirs[3] as i64
                ),
            ));
        }
    }
    Ok(())
}
