//! Sub-groups: `new_group`, `new_subgroups`, `split`, each agreed on through the store before
//! any connection is made.

use std::sync::atomic::Ordering;
use std::time::Instant;

use crate::group::ProcessGroup;
use crate::missing::missing_keys;
use crate::{Error, Result};

impl ProcessGroup {
    /// Checks that every rank of this group is making the same creation call (`what`), each
    /// with its own `payload`; returns the creation index and every rank's payload.
    ///
    /// Each rank publishes its call under `create/<index>/<rank>` and reads everyone's: a rank
    /// that calls something else fails at once with [`Error::GroupMismatch`] naming both calls;
    /// one that never calls makes the others fail at `deadline`, naming it. Every store call
    /// ends by `deadline`, the creation's, so a silent store cannot make it wait a store
    /// timeout per call.
    fn agree(
        &self,
        op: &'static str,
        what: &str,
        payload: &str,
        deadline: Instant,
    ) -> Result<(u64, Vec<String>)> {
        let rank = self.rank();
        let index = self.inner.created.fetch_add(1, Ordering::Relaxed);
        let store = self.store();
        let key = |r: usize| format!("create/{index}/{r}");
        store
            .set_by(
                &key(rank),
                format!("{what}\n{payload}").as_bytes(),
                deadline,
            )
            .map_err(|e| Error::store(rank, format!("{op}: publishing creation #{index}"), e))?;
        let keys: Vec<String> = (0..self.world_size()).map(key).collect();
        let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
        if let Err(e) = store.wait_by(&refs, deadline) {
            if e.is_unreachable() {
                // Asking which keys are missing would wait on the silent store again.
                return Err(Error::store(
                    rank,
                    format!("{op}: group creation #{index} ({what}): waiting for the other ranks"),
                    e,
                ));
            }
            let missing = missing_keys(&**store, &refs);
            return Err(Error::store(
                rank,
                format!(
                    "{op}: group creation #{index} ({what}): rank(s) {missing:?} of group {} did not join",
                    self.name()
                ),
                e,
            ));
        }
        let values = store
            .multi_get_by(&refs, deadline)
            .map_err(|e| Error::store(rank, format!("{op}: reading creation #{index}"), e))?;
        let mut payloads = Vec::with_capacity(values.len());
        for (r, v) in values.iter().enumerate() {
            let v = String::from_utf8_lossy(v);
            let (theirs, p) = v.split_once('\n').unwrap_or((&v, ""));
            if theirs != what {
                return Err(Error::GroupMismatch {
                    rank,
                    index,
                    ours: what.to_owned(),
                    other_rank: r,
                    theirs: theirs.to_owned(),
                });
            }
            payloads.push(p.to_owned());
        }
        Ok((index, payloads))
    }

    /// Connects the sub-group of `members` (ranks of this group, in the sub-group's rank order)
    /// under `suffix` by the creation's `deadline`; `None` on non-members.
    fn child(
        &self,
        suffix: &str,
        members: &[usize],
        deadline: Instant,
    ) -> Result<Option<ProcessGroup>> {
        let Some(rank) = members.iter().position(|&m| m == self.rank()) else {
            return Ok(None);
        };
        let globals = members.iter().map(|&m| self.global_ranks()[m]).collect();
        ProcessGroup::connect(
            self.inner.cfg.clone(),
            format!("{}/{suffix}", self.inner.prefix),
            rank,
            globals,
            false,
            deadline,
        )
        .map(Some)
    }

    /// Creates a sub-group of `ranks` (ranks of this group; torch's `new_group`). Every rank of
    /// this group must call it, in the same order as its other group creations, with the same
    /// `ranks`; members get `Some(group)` (ranks ordered as sorted `ranks`), the others `None`.
    pub fn new_group(&self, ranks: &[usize]) -> Result<Option<ProcessGroup>> {
        let mut members = ranks.to_vec();
        members.sort_unstable();
        members.dedup();
        if members.len() != ranks.len() {
            return Err(Error::invalid(
                self.rank(),
                "new_group",
                format!("ranks {ranks:?} repeat a rank"),
            ));
        }
        if let Some(&bad) = members.iter().find(|&&r| r >= self.world_size()) {
            return Err(Error::invalid(
                self.rank(),
                "new_group",
                format!(
                    "rank {bad} is not a rank of this group of {}",
                    self.world_size()
                ),
            ));
        }
        if members.is_empty() {
            return Err(Error::invalid(
                self.rank(),
                "new_group",
                "a group needs at least one rank",
            ));
        }
        let deadline = self.creation_deadline();
        let (index, _) = self.agree(
            "new_group",
            &format!("new_group({members:?})"),
            "",
            deadline,
        )?;
        self.child(&format!("g{index}"), &members, deadline)
    }

    /// Splits this group into consecutive sub-groups of `size` ranks (torch's
    /// `new_subgroups`) and returns this rank's. `size` must divide the world size.
    pub fn new_subgroups(&self, size: usize) -> Result<ProcessGroup> {
        let w = self.world_size();
        if size == 0 || !w.is_multiple_of(size) {
            return Err(Error::invalid(
                self.rank(),
                "new_subgroups",
                format!("group size {size} does not divide the world size {w}"),
            ));
        }
        let deadline = self.creation_deadline();
        let (index, _) = self.agree(
            "new_subgroups",
            &format!("new_subgroups({size})"),
            "",
            deadline,
        )?;
        let first = self.rank() / size * size;
        let members: Vec<usize> = (first..first + size).collect();
        self.child(&format!("g{index}/s{}", first / size), &members, deadline)?
            .ok_or_else(|| {
                Error::invalid(self.rank(), "new_subgroups", "this rank is in no sub-group")
            })
    }

    /// Splits this group by `color` (MPI's `Comm_split`, torch's `split_group`): ranks with the
    /// same color form a sub-group, ordered by `key` and then by rank here; a rank passing
    /// `None` joins none and gets `None`. Every rank of this group must call it.
    pub fn split(&self, color: Option<u32>, key: i64) -> Result<Option<ProcessGroup>> {
        self.split_by("split", color, key, self.creation_deadline())
    }

    /// [`split`](ProcessGroup::split) for the creation `op`, ending by `deadline`: that of a
    /// larger creation making several splits (a [`DeviceMesh`](crate::DeviceMesh)'s), which
    /// the group's timeout bounds as a whole rather than per split, and which its errors name.
    pub(crate) fn split_by(
        &self,
        op: &'static str,
        color: Option<u32>,
        key: i64,
        deadline: Instant,
    ) -> Result<Option<ProcessGroup>> {
        let payload = match color {
            Some(c) => format!("{c} {key}"),
            None => "-".to_owned(),
        };
        let (index, payloads) = self.agree(op, "split", &payload, deadline)?;
        let Some(color) = color else { return Ok(None) };
        let mut members: Vec<(i64, usize)> = Vec::new();
        for (r, p) in payloads.iter().enumerate() {
            let mut it = p.split(' ');
            let (Some(c), Some(k)) = (it.next(), it.next()) else {
                continue;
            };
            let (Ok(c), Ok(k)) = (c.parse::<u32>(), k.parse::<i64>()) else {
                continue;
            };
            if c == color {
                members.push((k, r));
            }
        }
        members.sort_unstable();
        let members: Vec<usize> = members.into_iter().map(|(_, r)| r).collect();
        self.child(&format!("g{index}/c{color}"), &members, deadline)
    }

    /// The deadline of a group creation starting now: the group's timeout bounds the whole
    /// creation (agreement, connecting, the connected agreement), not each store call in it.
    pub(crate) fn creation_deadline(&self) -> Instant {
        dist_backend::deadline_after(Instant::now(), self.timeout())
    }
}
