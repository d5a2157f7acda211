//! [`Dispatch`]: one backend per buffer kind (`"cpu:gloo,cuda:nccl"`), chosen per call by
//! where its buffers live.

use dist_backend::{Backend, BufMut, BufRef, Capabilities, OpOptions};
use dist_wire::{DType, ReduceOp};

/// Serves each call with the host backend when all its buffers are host memory and with the
/// device backend when any is device memory (which then rejects a host buffer it cannot
/// serve). Calls without buffers (barrier, probe) go to the host backend: it needs no GPU.
/// A backend string naming one backend gets that backend alone, not a `Dispatch`.
pub(crate) struct Dispatch {
    pub(crate) host: Box<dyn Backend>,
    pub(crate) device: Box<dyn Backend>,
}

impl Dispatch {
    fn pick(&self, device: bool) -> &dyn Backend {
        if device { &*self.device } else { &*self.host }
    }
}

fn dev_ref(b: &BufRef<'_>) -> bool {
    matches!(b, BufRef::Device(_))
}

fn dev_mut(b: &BufMut<'_>) -> bool {
    matches!(b, BufMut::Device(_))
}

impl Backend for Dispatch {
    fn name(&self) -> &'static str {
        self.host.name()
    }

    fn rank(&self) -> usize {
        self.host.rank()
    }

    fn world_size(&self) -> usize {
        self.host.world_size()
    }

    fn capabilities(&self) -> Capabilities {
        let mut c = self.host.capabilities();
        let d = self.device.capabilities();
        c.device_buffers |= d.device_buffers;
        c
    }

    fn all_reduce(
        &self,
        buf: BufMut<'_>,
        dtype: DType,
        op: ReduceOp,
        opts: &OpOptions,
    ) -> dist_backend::Result<()> {
        self.pick(dev_mut(&buf)).all_reduce(buf, dtype, op, opts)
    }

    fn broadcast(
        &self,
        buf: BufMut<'_>,
        dtype: DType,
        root: usize,
        opts: &OpOptions,
    ) -> dist_backend::Result<()> {
        self.pick(dev_mut(&buf)).broadcast(buf, dtype, root, opts)
    }

    fn reduce(
        &self,
        buf: BufMut<'_>,
        dtype: DType,
        op: ReduceOp,
        root: usize,
        opts: &OpOptions,
    ) -> dist_backend::Result<()> {
        self.pick(dev_mut(&buf)).reduce(buf, dtype, op, root, opts)
    }

    fn all_gather(
        &self,
        input: BufRef<'_>,
        output: BufMut<'_>,
        dtype: DType,
        counts: &[usize],
        opts: &OpOptions,
    ) -> dist_backend::Result<()> {
        let d = dev_ref(&input) || dev_mut(&output);
        self.pick(d).all_gather(input, output, dtype, counts, opts)
    }

    fn reduce_scatter(
        &self,
        input: BufRef<'_>,
        output: BufMut<'_>,
        dtype: DType,
        op: ReduceOp,
        counts: &[usize],
        opts: &OpOptions,
    ) -> dist_backend::Result<()> {
        let d = dev_ref(&input) || dev_mut(&output);
        self.pick(d)
            .reduce_scatter(input, output, dtype, op, counts, opts)
    }

    fn all_to_all(
        &self,
        input: BufRef<'_>,
        output: BufMut<'_>,
        dtype: DType,
        send_counts: &[usize],
        recv_counts: &[usize],
        opts: &OpOptions,
    ) -> dist_backend::Result<()> {
        let d = dev_ref(&input) || dev_mut(&output);
        self.pick(d)
            .all_to_all(input, output, dtype, send_counts, recv_counts, opts)
    }

    fn gather(
        &self,
        input: BufRef<'_>,
        output: Option<BufMut<'_>>,
        dtype: DType,
        root: usize,
        opts: &OpOptions,
    ) -> dist_backend::Result<()> {
        // Every rank must pick the same backend, and only the root has an output: the input
        // decides.
        self.pick(dev_ref(&input))
            .gather(input, output, dtype, root, opts)
    }

    fn scatter(
        &self,
        input: Option<BufRef<'_>>,
        output: BufMut<'_>,
        dtype: DType,
        root: usize,
        opts: &OpOptions,
    ) -> dist_backend::Result<()> {
        // As in gather: the output, which every rank has, decides.
        self.pick(dev_mut(&output))
            .scatter(input, output, dtype, root, opts)
    }

    fn barrier(&self, opts: &OpOptions) -> dist_backend::Result<()> {
        self.host.barrier(opts)
    }

    fn send(
        &self,
        buf: BufRef<'_>,
        dtype: DType,
        dst: usize,
        opts: &OpOptions,
    ) -> dist_backend::Result<()> {
        self.pick(dev_ref(&buf)).send(buf, dtype, dst, opts)
    }

    fn recv(
        &self,
        buf: BufMut<'_>,
        dtype: DType,
        src: usize,
        opts: &OpOptions,
    ) -> dist_backend::Result<()> {
        self.pick(dev_mut(&buf)).recv(buf, dtype, src, opts)
    }

    fn probe(&self, src: usize, tag: u32) -> dist_backend::Result<bool> {
        self.host.probe(src, tag)
    }

    fn close(&self) {
        self.host.close();
        self.device.close();
    }
}
