//! The checks of a group operation's arguments that need no other rank: ranks in range,
//! buffer lengths, reduce ops valid for the element type.

use dist_wire::{Element, ReduceOp};

use super::ProcessGroup;
use crate::{Error, Result};

impl ProcessGroup {
    pub(crate) fn invalid(&self, op: &'static str, reason: impl Into<String>) -> Error {
        Error::invalid(self.rank(), op, reason)
    }

    pub(super) fn check_len(
        &self,
        op: &'static str,
        what: &'static str,
        expected: usize,
        actual: usize,
    ) -> Result<()> {
        if expected != actual {
            return Err(Error::size(self.rank(), op, what, expected, actual));
        }
        Ok(())
    }

    pub(crate) fn check_root(&self, op: &'static str, root: usize) -> Result<()> {
        if root >= self.world_size() {
            return Err(self.invalid(
                op,
                format!(
                    "root {root} is not a rank of this group of {}",
                    self.world_size()
                ),
            ));
        }
        Ok(())
    }

    /// Checks a buffer only the root passes (`given` is its length when passed): present with
    /// `expected` elements on the root, absent elsewhere.
    pub(super) fn check_root_buffer(
        &self,
        op: &'static str,
        what: &'static str,
        root: usize,
        given: Option<usize>,
        expected: usize,
    ) -> Result<()> {
        match (given, self.rank() == root) {
            (Some(len), true) => self.check_len(op, what, expected, len),
            (None, true) => Err(self.invalid(op, format!("the root must pass an {what} buffer"))),
            (Some(_), false) => Err(self.invalid(
                op,
                format!("only the root (rank {root}) passes an {what} buffer"),
            )),
            (None, false) => Ok(()),
        }
    }

    pub(super) fn check_peer(&self, op: &'static str, peer: usize) -> Result<()> {
        if peer >= self.world_size() {
            return Err(self.invalid(
                op,
                format!(
                    "peer {peer} is not a rank of this group of {}",
                    self.world_size()
                ),
            ));
        }
        if peer == self.rank() {
            return Err(self.invalid(op, format!("rank {peer} cannot {op} itself")));
        }
        Ok(())
    }

    pub(super) fn check_reduce<T: Element>(&self, op: &'static str, rop: ReduceOp) -> Result<()> {
        rop.check(T::DTYPE)
            .map_err(|source| wire_error(self.rank(), op, source))
    }

    /// Checks that `counts` has one entry per rank and returns their sum. A sum past
    /// `usize::MAX` is refused: wrapped, it passed the length checks and panicked in the
    /// backend's block arithmetic (in a debug build, here).
    pub(super) fn check_counts(
        &self,
        op: &'static str,
        what: &'static str,
        counts: &[usize],
    ) -> Result<usize> {
        self.check_len(op, what, self.world_size(), counts.len())?;
        checked_sum(counts)
            .ok_or_else(|| self.invalid(op, format!("{what} sum past the largest possible length")))
    }
}

/// The sum of `counts`, `None` where it does not fit a `usize`.
pub(crate) fn checked_sum(counts: &[usize]) -> Option<usize> {
    counts.iter().try_fold(0usize, |acc, &c| acc.checked_add(c))
}

/// A reduce op the element type cannot take, as the backend reports it (the wire crate's
/// typed error, wrapped rather than stringified).
pub(crate) fn wire_error(rank: usize, op: &'static str, source: dist_wire::WireError) -> Error {
    Error::Backend(dist_backend::Error::Wire { rank, op, source })
}
