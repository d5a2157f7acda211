//! The typed collectives of [`ProcessGroup`]: blocking forms on the caller's thread, `*_async`
//! forms on the group's worker.

use dist_backend::{Backend, BufMut, BufRef, OpOptions};
use dist_wire::{Element, ReduceOp};

use super::ProcessGroup;
use super::fingerprint::fingerprint;
use super::run::info;
use crate::debug::OpInfo;
use crate::work::Work;
use crate::{Error, Result};

pub(super) fn bytes<T: Element>(s: &[T]) -> BufRef<'_> {
    BufRef::Host(bytemuck::cast_slice(s))
}

pub(super) fn bytes_mut<T: Element>(s: &mut [T]) -> BufMut<'_> {
    BufMut::Host(bytemuck::cast_slice_mut(s))
}

impl ProcessGroup {
    /// Runs the in-place collective `op` (one buffer, the same length on every rank) on
    /// this thread in the group's order; `run` calls the backend on the buffer's bytes.
    fn in_place<T: Element>(
        &self,
        op: &'static str,
        root: Option<usize>,
        buf: &mut [T],
        run: impl FnOnce(&dyn Backend, BufMut<'_>, &OpOptions) -> dist_backend::Result<()>,
    ) -> Result<()> {
        let fp = fingerprint(op, Some(T::DTYPE), buf.len(), root);
        self.coll(info::<T>(op, vec![buf.len()], root), Some(fp), |b, o| {
            Ok(run(b, bytes_mut(buf), o)?)
        })
    }

    /// [`in_place`](Self::in_place) on the worker, owning the buffer, which `wait` gives back.
    fn in_place_async<T: Element>(
        &self,
        op: &'static str,
        root: Option<usize>,
        mut buf: Vec<T>,
        run: impl FnOnce(&dyn Backend, BufMut<'_>, &OpOptions) -> dist_backend::Result<()>
        + Send
        + 'static,
    ) -> Result<Work<Vec<T>>> {
        let fp = fingerprint(op, Some(T::DTYPE), buf.len(), root);
        self.coll_async(
            info::<T>(op, vec![buf.len()], root),
            Some(fp),
            move |b, o| {
                run(b, bytes_mut(&mut buf), o)?;
                Ok(buf)
            },
        )
    }

    /// Reduces `buf` across the group in place; every rank ends with the same values.
    pub fn all_reduce<T: Element>(&self, buf: &mut [T], op: ReduceOp) -> Result<()> {
        self.check_reduce::<T>("all_reduce", op)?;
        self.in_place("all_reduce", None, buf, |b, buf, o| {
            b.all_reduce(buf, T::DTYPE, op, o)
        })
    }

    /// [`all_reduce`](ProcessGroup::all_reduce) on the worker; `wait` gives back the reduced
    /// buffer.
    pub fn all_reduce_async<T: Element>(&self, buf: Vec<T>, op: ReduceOp) -> Result<Work<Vec<T>>> {
        self.check_reduce::<T>("all_reduce", op)?;
        self.in_place_async("all_reduce", None, buf, move |b, buf, o| {
            b.all_reduce(buf, T::DTYPE, op, o)
        })
    }

    /// Copies `root`'s `buf` into every other rank's `buf` (same length on every rank).
    pub fn broadcast<T: Element>(&self, buf: &mut [T], root: usize) -> Result<()> {
        self.check_root("broadcast", root)?;
        self.in_place("broadcast", Some(root), buf, |b, buf, o| {
            b.broadcast(buf, T::DTYPE, root, o)
        })
    }

    /// [`broadcast`](ProcessGroup::broadcast) on the worker; `wait` gives back the buffer.
    pub fn broadcast_async<T: Element>(&self, buf: Vec<T>, root: usize) -> Result<Work<Vec<T>>> {
        self.check_root("broadcast", root)?;
        self.in_place_async("broadcast", Some(root), buf, move |b, buf, o| {
            b.broadcast(buf, T::DTYPE, root, o)
        })
    }

    /// Reduces `buf` across the group into `root`'s `buf`; other ranks' buffers are left in an
    /// unspecified state (as in torch).
    pub fn reduce<T: Element>(&self, buf: &mut [T], op: ReduceOp, root: usize) -> Result<()> {
        self.check_root("reduce", root)?;
        self.check_reduce::<T>("reduce", op)?;
        self.in_place("reduce", Some(root), buf, |b, buf, o| {
            b.reduce(buf, T::DTYPE, op, root, o)
        })
    }

    /// [`reduce`](ProcessGroup::reduce) on the worker; `wait` gives back the buffer.
    pub fn reduce_async<T: Element>(
        &self,
        buf: Vec<T>,
        op: ReduceOp,
        root: usize,
    ) -> Result<Work<Vec<T>>> {
        self.check_root("reduce", root)?;
        self.check_reduce::<T>("reduce", op)?;
        self.in_place_async("reduce", Some(root), buf, move |b, buf, o| {
            b.reduce(buf, T::DTYPE, op, root, o)
        })
    }

    /// Gathers every rank's `input` (equal lengths) into `output`, rank by rank (torch's
    /// `all_gather_into_tensor`). `output.len()` must be `input.len() * world_size`.
    pub fn all_gather_into<T: Element>(&self, input: &[T], output: &mut [T]) -> Result<()> {
        let w = self.world_size();
        self.check_len("all_gather", "output", input.len() * w, output.len())?;
        let counts = vec![input.len(); w];
        let fp = fingerprint("all_gather", Some(T::DTYPE), output.len(), None);
        self.coll(
            info::<T>("all_gather", counts.clone(), None),
            Some(fp),
            |b, o| Ok(b.all_gather(bytes(input), bytes_mut(output), T::DTYPE, &counts, o)?),
        )
    }

    /// Gathers every rank's `input` (equal lengths) into one vector per rank (torch's
    /// `all_gather` list form).
    pub fn all_gather<T: Element>(&self, input: &[T]) -> Result<Vec<Vec<T>>> {
        let mut out = vec![T::zeroed(); input.len() * self.world_size()];
        self.all_gather_into(input, &mut out)?;
        Ok(split_by(&out, &vec![input.len(); self.world_size()]))
    }

    /// [`all_gather_into`](ProcessGroup::all_gather_into) on the worker; `wait` gives the
    /// gathered vector (`input.len() * world_size` elements, rank by rank).
    pub fn all_gather_async<T: Element>(&self, input: Vec<T>) -> Result<Work<Vec<T>>> {
        let w = self.world_size();
        let counts = vec![input.len(); w];
        let fp = fingerprint("all_gather", Some(T::DTYPE), input.len() * w, None);
        self.coll_async(
            info::<T>("all_gather", counts.clone(), None),
            Some(fp),
            move |b, o| {
                let mut out = vec![T::zeroed(); input.len() * counts.len()];
                b.all_gather(bytes(&input), bytes_mut(&mut out), T::DTYPE, &counts, o)?;
                Ok(out)
            },
        )
    }

    /// Uneven all-gather: rank r contributes `counts[r]` elements; `input.len()` must be
    /// `counts[rank]` and `output.len()` their sum. Every rank passes the same `counts`.
    pub fn all_gather_into_uneven<T: Element>(
        &self,
        input: &[T],
        output: &mut [T],
        counts: &[usize],
    ) -> Result<()> {
        let total = self.check_counts("all_gather", "counts", counts)?;
        self.check_len("all_gather", "input", counts[self.rank()], input.len())?;
        self.check_len("all_gather", "output", total, output.len())?;
        let fp = fingerprint("all_gather", Some(T::DTYPE), output.len(), None);
        self.coll(
            info::<T>("all_gather", counts.to_vec(), None),
            Some(fp),
            |b, o| Ok(b.all_gather(bytes(input), bytes_mut(output), T::DTYPE, counts, o)?),
        )
    }

    /// Uneven all-gather without known counts: exchanges the lengths first, then the data; one
    /// vector per rank.
    pub fn all_gather_uneven<T: Element>(&self, input: &[T]) -> Result<Vec<Vec<T>>> {
        let lens = self.all_gather(&[input.len() as u64])?;
        let counts: Vec<usize> = lens.iter().map(|l| l[0] as usize).collect();
        let mut out = vec![T::zeroed(); counts.iter().sum()];
        self.all_gather_into_uneven(input, &mut out, &counts)?;
        Ok(split_by(&out, &counts))
    }

    // ---- reduce_scatter -----------------------------------------------------------------------

    /// Reduces `input` (`output.len() * world_size` elements: rank r's share is the r-th
    /// block) across the group and leaves this rank's reduced share in `output` (torch's
    /// `reduce_scatter_tensor`).
    pub fn reduce_scatter_into<T: Element>(
        &self,
        input: &[T],
        output: &mut [T],
        op: ReduceOp,
    ) -> Result<()> {
        let w = self.world_size();
        self.check_len("reduce_scatter", "input", output.len() * w, input.len())?;
        let counts = vec![output.len(); w];
        self.reduce_scatter_into_uneven(input, output, &counts, op)
    }

    /// Uneven reduce-scatter: rank r's share is `counts[r]` elements; `input.len()` must be
    /// their sum and `output.len()` `counts[rank]`.
    pub fn reduce_scatter_into_uneven<T: Element>(
        &self,
        input: &[T],
        output: &mut [T],
        counts: &[usize],
        op: ReduceOp,
    ) -> Result<()> {
        let total = self.check_counts("reduce_scatter", "counts", counts)?;
        self.check_len("reduce_scatter", "input", total, input.len())?;
        self.check_len(
            "reduce_scatter",
            "output",
            counts[self.rank()],
            output.len(),
        )?;
        self.check_reduce::<T>("reduce_scatter", op)?;
        let fp = fingerprint("reduce_scatter", Some(T::DTYPE), input.len(), None);
        self.coll(
            info::<T>("reduce_scatter", counts.to_vec(), None),
            Some(fp),
            |b, o| {
                Ok(b.reduce_scatter(bytes(input), bytes_mut(output), T::DTYPE, op, counts, o)?)
            },
        )
    }

    /// [`reduce_scatter_into`](ProcessGroup::reduce_scatter_into) on the worker: `input` must
    /// hold a multiple of `world_size` elements; `wait` gives this rank's reduced share.
    pub fn reduce_scatter_async<T: Element>(
        &self,
        input: Vec<T>,
        op: ReduceOp,
    ) -> Result<Work<Vec<T>>> {
        let w = self.world_size();
        if !input.len().is_multiple_of(w) {
            return Err(self.invalid(
                "reduce_scatter",
                format!(
                    "input has {} elements, not a multiple of the world size {w}",
                    input.len()
                ),
            ));
        }
        self.check_reduce::<T>("reduce_scatter", op)?;
        let counts = vec![input.len() / w; w];
        let fp = fingerprint("reduce_scatter", Some(T::DTYPE), input.len(), None);
        self.coll_async(
            info::<T>("reduce_scatter", counts.clone(), None),
            Some(fp),
            move |b, o| {
                let mut out = vec![T::zeroed(); counts[0]];
                b.reduce_scatter(bytes(&input), bytes_mut(&mut out), T::DTYPE, op, &counts, o)?;
                Ok(out)
            },
        )
    }

    // ---- all_to_all ---------------------------------------------------------------------------

    /// Sends block r of `input` to rank r and receives rank r's block for this rank into block r
    /// of `output` (torch's `all_to_all_single`). Without split sizes, both buffers are cut into
    /// `world_size` equal blocks; with them, `output_split_sizes[r]`/`input_split_sizes[r]` give
    /// block r's length, and each must sum to its buffer's length. Every rank passes split
    /// sizes, or none does (as in torch, whose Gloo runs the two forms differently): the even
    /// form may run an algorithm that needs every rank's counts, and a rank of the other form
    /// then fails it and its peers with a mismatch.
    pub fn all_to_all_single<T: Element>(
        &self,
        output: &mut [T],
        input: &[T],
        output_split_sizes: Option<&[usize]>,
        input_split_sizes: Option<&[usize]>,
    ) -> Result<()> {
        let op = "all_to_all";
        let w = self.world_size();
        let even = |len: usize, what: &'static str| -> Result<Vec<usize>> {
            if !len.is_multiple_of(w) {
                return Err(self.invalid(
                    op,
                    format!("{what} has {len} elements, not a multiple of the world size {w}"),
                ));
            }
            Ok(vec![len / w; w])
        };
        let recv = match output_split_sizes {
            Some(s) => {
                let total = self.check_counts(op, "output_split_sizes", s)?;
                self.check_len(op, "output", total, output.len())?;
                s.to_vec()
            }
            None => even(output.len(), "output")?,
        };
        let send = match input_split_sizes {
            Some(s) => {
                let total = self.check_counts(op, "input_split_sizes", s)?;
                self.check_len(op, "input", total, input.len())?;
                s.to_vec()
            }
            None => even(input.len(), "input")?,
        };
        let r = self.rank();
        if send[r] != recv[r] {
            return Err(Error::size(
                r,
                op,
                "output block from this rank itself",
                send[r],
                recv[r],
            ));
        }
        // Without split sizes on either side every rank's counts are alike (if a peer passed
        // some, the backend may fail both with a mismatch), which the backend may use.
        let even_count =
            (output_split_sizes.is_none() && input_split_sizes.is_none()).then(|| send[r]);
        self.coll(info::<T>(op, send.clone(), None), None, |b, o| {
            Ok(match even_count {
                Some(count) => {
                    b.all_to_all_even(bytes(input), bytes_mut(output), T::DTYPE, count, o)
                }
                None => b.all_to_all(bytes(input), bytes_mut(output), T::DTYPE, &send, &recv, o),
            }?)
        })
    }

    /// List form of all-to-all: `inputs[r]` goes to rank r; returns what each rank sent here.
    /// Lengths may differ; they are exchanged first.
    pub fn all_to_all<T: Element>(&self, inputs: &[Vec<T>]) -> Result<Vec<Vec<T>>> {
        self.check_counts("all_to_all", "inputs", &vec![0; inputs.len()])?;
        let send: Vec<usize> = inputs.iter().map(Vec::len).collect();
        let send64: Vec<u64> = send.iter().map(|&n| n as u64).collect();
        let mut recv64 = vec![0u64; self.world_size()];
        self.all_to_all_single(&mut recv64, &send64, None, None)?;
        let recv: Vec<usize> = recv64.iter().map(|&n| n as usize).collect();
        let flat: Vec<T> = inputs.concat();
        let mut out = vec![T::zeroed(); recv.iter().sum()];
        self.all_to_all_single(&mut out, &flat, Some(&recv), Some(&send))?;
        Ok(split_by(&out, &recv))
    }

    // ---- gather, scatter, barrier ------------------------------------------------------------

    /// Gathers every rank's `input` (equal lengths) into `root`'s `output` (`input.len() *
    /// world_size` elements, rank by rank). `output` is `Some` on the root and `None` elsewhere.
    pub fn gather<T: Element>(
        &self,
        input: &[T],
        output: Option<&mut [T]>,
        root: usize,
    ) -> Result<()> {
        let op = "gather";
        self.check_root(op, root)?;
        self.check_root_buffer(
            op,
            "output",
            root,
            output.as_ref().map(|o| o.len()),
            input.len() * self.world_size(),
        )?;
        let fp = fingerprint(op, Some(T::DTYPE), input.len(), Some(root));
        self.coll(
            info::<T>(op, vec![input.len()], Some(root)),
            Some(fp),
            |b, o| Ok(b.gather(bytes(input), output.map(bytes_mut), T::DTYPE, root, o)?),
        )
    }

    /// Scatters `root`'s `input` (`output.len() * world_size` elements, rank r's share is block
    /// r) into every rank's `output`. `input` is `Some` on the root and `None` elsewhere.
    pub fn scatter<T: Element>(
        &self,
        input: Option<&[T]>,
        output: &mut [T],
        root: usize,
    ) -> Result<()> {
        let op = "scatter";
        self.check_root(op, root)?;
        self.check_root_buffer(
            op,
            "input",
            root,
            input.map(<[T]>::len),
            output.len() * self.world_size(),
        )?;
        let fp = fingerprint(op, Some(T::DTYPE), output.len(), Some(root));
        self.coll(
            info::<T>(op, vec![output.len()], Some(root)),
            Some(fp),
            |b, o| Ok(b.scatter(input.map(bytes), bytes_mut(output), T::DTYPE, root, o)?),
        )
    }

    /// Returns once every rank of the group has entered the barrier.
    pub fn barrier(&self) -> Result<()> {
        let fp = fingerprint("barrier", None, 0, None);
        self.coll(
            OpInfo {
                op: "barrier",
                dtype: None,
                counts: vec![],
                peer: None,
            },
            Some(fp),
            |b, o| Ok(b.barrier(o)?),
        )
    }

    /// [`barrier`](ProcessGroup::barrier) on the worker.
    pub fn barrier_async(&self) -> Result<Work<()>> {
        let fp = fingerprint("barrier", None, 0, None);
        self.coll_async(
            OpInfo {
                op: "barrier",
                dtype: None,
                counts: vec![],
                peer: None,
            },
            Some(fp),
            |b, o| Ok(b.barrier(o)?),
        )
    }
}

/// Cuts `flat` into consecutive vectors of `counts[i]` elements.
pub(crate) fn split_by<T: Clone>(flat: &[T], counts: &[usize]) -> Vec<Vec<T>> {
    let mut at = 0;
    counts
        .iter()
        .map(|&n| {
            let v = flat[at..at + n].to_vec();
            at += n;
            v
        })
        .collect()
}
