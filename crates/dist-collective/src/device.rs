//! Collectives on device buffers ([`DeviceBuffer`]): the entry point of a group whose backend
//! serves them (`"nccl"`, `"cpu:gloo,cuda:nccl"`, or `"cuda:gloo"` staging). They take the
//! group's place in its order like every collective, and are recorded in the flight recorder.

use dist_backend::{BufMut, BufRef, DeviceBuffer};
use dist_wire::{DType, ReduceOp};

use crate::debug::OpInfo;
use crate::group::fingerprint;
use crate::work::Work;
use crate::{ProcessGroup, Result};

fn info(op: &'static str, dtype: DType, counts: Vec<usize>, peer: Option<usize>) -> OpInfo {
    OpInfo {
        op,
        dtype: Some(dtype.to_string()),
        counts,
        peer,
    }
}

impl ProcessGroup {
    /// The element count of a device buffer, or an error if its length is not a whole number
    /// of `dtype` elements.
    fn elements(
        &self,
        op: &'static str,
        what: &str,
        b: &DeviceBuffer,
        dtype: DType,
    ) -> Result<usize> {
        if !b.len().is_multiple_of(dtype.size()) {
            return Err(self.invalid(
                op,
                format!(
                    "{what} holds {} bytes, not a whole number of {dtype} elements",
                    b.len()
                ),
            ));
        }
        Ok(b.len() / dtype.size())
    }

    fn check_device_reduce(&self, op: &'static str, dtype: DType, rop: ReduceOp) -> Result<()> {
        rop.check(dtype)
            .map_err(|source| crate::group::wire_error(self.rank(), op, source))
    }

    /// [`all_reduce`](ProcessGroup::all_reduce) on device memory: returns when the backend
    /// has finished it (NCCL: when the GPU has, by default; see `dist_nccl::NcclOptions`).
    pub fn all_reduce_device(&self, buf: DeviceBuffer, dtype: DType, op: ReduceOp) -> Result<()> {
        const OP: &str = "all_reduce";
        let n = self.elements(OP, "buf", &buf, dtype)?;
        self.check_device_reduce(OP, dtype, op)?;
        self.coll(
            info(OP, dtype, vec![n], None),
            Some(fingerprint(OP, Some(dtype), n, None)),
            |b, o| Ok(b.all_reduce(BufMut::Device(buf), dtype, op, o)?),
        )
    }

    /// [`all_reduce_device`](ProcessGroup::all_reduce_device) on the group's worker; the
    /// `Work` completes when the operation has (the buffer must stay valid until then, as
    /// [`DeviceBuffer::from_raw`] requires).
    pub fn all_reduce_device_async(
        &self,
        buf: DeviceBuffer,
        dtype: DType,
        op: ReduceOp,
    ) -> Result<Work<()>> {
        const OP: &str = "all_reduce";
        let n = self.elements(OP, "buf", &buf, dtype)?;
        self.check_device_reduce(OP, dtype, op)?;
        self.coll_async(
            info(OP, dtype, vec![n], None),
            Some(fingerprint(OP, Some(dtype), n, None)),
            move |b, o| Ok(b.all_reduce(BufMut::Device(buf), dtype, op, o)?),
        )
    }

    /// [`broadcast`](ProcessGroup::broadcast) on device memory.
    pub fn broadcast_device(&self, buf: DeviceBuffer, dtype: DType, root: usize) -> Result<()> {
        const OP: &str = "broadcast";
        let n = self.elements(OP, "buf", &buf, dtype)?;
        self.check_root(OP, root)?;
        self.coll(
            info(OP, dtype, vec![n], Some(root)),
            Some(fingerprint(OP, Some(dtype), n, Some(root))),
            |b, o| Ok(b.broadcast(BufMut::Device(buf), dtype, root, o)?),
        )
    }

    /// [`reduce`](ProcessGroup::reduce) on device memory: the result is in `root`'s `buf`.
    pub fn reduce_device(
        &self,
        buf: DeviceBuffer,
        dtype: DType,
        op: ReduceOp,
        root: usize,
    ) -> Result<()> {
        const OP: &str = "reduce";
        let n = self.elements(OP, "buf", &buf, dtype)?;
        self.check_root(OP, root)?;
        self.check_device_reduce(OP, dtype, op)?;
        self.coll(
            info(OP, dtype, vec![n], Some(root)),
            Some(fingerprint(OP, Some(dtype), n, Some(root))),
            |b, o| Ok(b.reduce(BufMut::Device(buf), dtype, op, root, o)?),
        )
    }

    /// [`all_gather_into`](ProcessGroup::all_gather_into) on device memory: `output` holds
    /// `world_size` times `input`, rank by rank.
    pub fn all_gather_device(
        &self,
        input: DeviceBuffer,
        output: DeviceBuffer,
        dtype: DType,
    ) -> Result<()> {
        const OP: &str = "all_gather";
        let n = self.elements(OP, "input", &input, dtype)?;
        let m = self.elements(OP, "output", &output, dtype)?;
        if m != n * self.world_size() {
            return Err(self.invalid(
                OP,
                format!(
                    "output has {m} elements but {} × {n} are needed",
                    self.world_size()
                ),
            ));
        }
        let counts = vec![n; self.world_size()];
        self.coll(
            info(OP, dtype, vec![n], None),
            Some(fingerprint(OP, Some(dtype), n, None)),
            |b, o| {
                Ok(b.all_gather(
                    BufRef::Device(input),
                    BufMut::Device(output),
                    dtype,
                    &counts,
                    o,
                )?)
            },
        )
    }

    /// [`reduce_scatter_into`](ProcessGroup::reduce_scatter_into) on device memory: `input`
    /// holds `world_size` times `output`.
    pub fn reduce_scatter_device(
        &self,
        input: DeviceBuffer,
        output: DeviceBuffer,
        dtype: DType,
        op: ReduceOp,
    ) -> Result<()> {
        const OP: &str = "reduce_scatter";
        let n = self.elements(OP, "output", &output, dtype)?;
        let m = self.elements(OP, "input", &input, dtype)?;
        if m != n * self.world_size() {
            return Err(self.invalid(
                OP,
                format!(
                    "input has {m} elements but {} × {n} are needed",
                    self.world_size()
                ),
            ));
        }
        self.check_device_reduce(OP, dtype, op)?;
        let counts = vec![n; self.world_size()];
        self.coll(
            info(OP, dtype, vec![n], None),
            Some(fingerprint(OP, Some(dtype), n, None)),
            |b, o| {
                Ok(b.reduce_scatter(
                    BufRef::Device(input),
                    BufMut::Device(output),
                    dtype,
                    op,
                    &counts,
                    o,
                )?)
            },
        )
    }

    /// [`all_to_all_single`](ProcessGroup::all_to_all_single)'s uneven form on device memory:
    /// `send_counts[r]` elements of `input` go to rank r, `recv_counts[r]` come from it.
    pub fn all_to_all_device(
        &self,
        input: DeviceBuffer,
        output: DeviceBuffer,
        dtype: DType,
        send_counts: &[usize],
        recv_counts: &[usize],
    ) -> Result<()> {
        const OP: &str = "all_to_all";
        let n = self.elements(OP, "input", &input, dtype)?;
        let m = self.elements(OP, "output", &output, dtype)?;
        for (what, counts, have) in [
            ("send_counts", send_counts, n),
            ("recv_counts", recv_counts, m),
        ] {
            if counts.len() != self.world_size() {
                return Err(self.invalid(
                    OP,
                    format!(
                        "{what} has {} entries for {} ranks",
                        counts.len(),
                        self.world_size()
                    ),
                ));
            }
            match crate::group::checked_sum(counts) {
                Some(sum) if sum == have => {}
                Some(sum) => {
                    return Err(self.invalid(
                        OP,
                        format!("{what} sum to {sum} but the buffer holds {have} elements"),
                    ));
                }
                None => {
                    return Err(
                        self.invalid(OP, format!("{what} sum past the largest possible length"))
                    );
                }
            }
        }
        self.coll(info(OP, dtype, vec![n, m], None), None, |b, o| {
            Ok(b.all_to_all(
                BufRef::Device(input),
                BufMut::Device(output),
                dtype,
                send_counts,
                recv_counts,
                o,
            )?)
        })
    }
}
