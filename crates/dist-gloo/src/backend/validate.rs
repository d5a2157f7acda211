//! Argument checks every operation runs before any data moves: each failure names this
//! rank, the operation and what was wrong.

use dist_backend::{BufMut, BufRef, Error, Result};
use dist_wire::{CollectiveOp, DType, ReduceOp};

use super::GlooBackend;

impl GlooBackend {
    pub(super) fn host<'a>(&self, op: CollectiveOp, b: BufMut<'a>) -> Result<&'a mut [u8]> {
        match b {
            BufMut::Host(h) => Ok(h),
            BufMut::Device(_) => Err(self.unsupported(op)),
        }
    }

    pub(super) fn host_ref<'a>(&self, op: CollectiveOp, b: BufRef<'a>) -> Result<&'a [u8]> {
        match b {
            BufRef::Host(h) => Ok(h),
            BufRef::Device(_) => Err(self.unsupported(op)),
        }
    }

    pub(super) fn unsupported(&self, op: CollectiveOp) -> Error {
        Error::Unsupported {
            rank: self.rank,
            backend: "gloo",
            what: format!("device buffers (in {op})"),
        }
    }

    pub(super) fn invalid(&self, op: CollectiveOp, reason: String) -> Error {
        Error::invalid(self.rank, op.name(), reason)
    }

    pub(super) fn check_len(
        &self,
        op: CollectiveOp,
        what: &str,
        len: usize,
        dtype: DType,
        count: usize,
    ) -> Result<()> {
        match count.checked_mul(dtype.size()) {
            Some(needed) if needed == len => Ok(()),
            Some(needed) => Err(self.invalid(
                op,
                format!("{what} is {len} bytes but {count} × {dtype} needs {needed}"),
            )),
            None => Err(self.invalid(
                op,
                format!("{what} is {len} bytes but {count} × {dtype} is past any buffer"),
            )),
        }
    }

    pub(super) fn check_whole(
        &self,
        op: CollectiveOp,
        what: &str,
        len: usize,
        dtype: DType,
    ) -> Result<usize> {
        if !len.is_multiple_of(dtype.size()) {
            return Err(self.invalid(
                op,
                format!("{what} is {len} bytes, not a whole number of {dtype} elements"),
            ));
        }
        Ok(len / dtype.size())
    }

    pub(super) fn check_rank(&self, op: CollectiveOp, what: &str, r: usize) -> Result<()> {
        if r >= self.world_size {
            return Err(self.invalid(
                op,
                format!(
                    "{what} {r} is not a rank of this group of {}",
                    self.world_size
                ),
            ));
        }
        Ok(())
    }

    /// Checks that `counts` has an entry per rank and returns their sum, refusing one past
    /// `usize::MAX` (wrapped, it passed the length checks and the block arithmetic panicked).
    pub(super) fn check_counts(
        &self,
        op: CollectiveOp,
        what: &str,
        counts: &[usize],
    ) -> Result<usize> {
        if counts.len() != self.world_size {
            return Err(self.invalid(
                op,
                format!(
                    "{what} has {} entries for a group of {}",
                    counts.len(),
                    self.world_size
                ),
            ));
        }
        counts
            .iter()
            .try_fold(0usize, |acc, &c| acc.checked_add(c))
            .ok_or_else(|| self.invalid(op, format!("{what} sum past any buffer")))
    }

    pub(super) fn check_reduce(&self, op: CollectiveOp, rop: ReduceOp, dtype: DType) -> Result<()> {
        rop.check(dtype).map_err(|source| Error::Wire {
            rank: self.rank,
            op: op.name(),
            source,
        })
    }
}
