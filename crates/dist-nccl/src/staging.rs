//! [`HostStaging`]: a host backend (Gloo) serving device buffers through pinned host memory.

use dist_backend::{Backend, BufMut, BufRef, Capabilities, DeviceBuffer, OpOptions};
use dist_wire::{DType, ReduceOp};

use crate::cuda::{Device, PinnedBuf};
use crate::{Error, Result};

/// Wraps a host backend so that it also accepts device buffers: each device buffer is copied
/// (on its stream) into pinned host memory, the host backend runs, and written buffers are
/// copied back before the call returns. Host buffers pass straight through.
///
/// It costs two PCIe copies per buffer and a stream synchronisation, which is why
/// `dist-collective` only uses it when asked (`"cuda:gloo"`); NCCL is the fast path.
pub struct HostStaging {
    inner: Box<dyn Backend>,
}

impl std::fmt::Debug for HostStaging {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostStaging")
            .field("inner", &self.inner.name())
            .finish()
    }
}

/// One buffer as the host backend sees it.
enum Staged<'a> {
    Host(&'a [u8]),
    HostMut(&'a mut [u8]),
    Pinned(PinnedBuf, DeviceBuffer),
}

impl Staged<'_> {
    fn as_ref(&mut self) -> BufRef<'_> {
        match self {
            Staged::Host(b) => BufRef::Host(b),
            Staged::HostMut(b) => BufRef::Host(b),
            Staged::Pinned(p, _) => BufRef::Host(p.as_mut_slice()),
        }
    }

    fn as_mut(&mut self) -> BufMut<'_> {
        match self {
            Staged::Host(_) => BufMut::Host(&mut []),
            Staged::HostMut(b) => BufMut::Host(b),
            Staged::Pinned(p, _) => BufMut::Host(p.as_mut_slice()),
        }
    }
}

impl HostStaging {
    /// Wraps `inner`. Fails with [`Error::Unavailable`] when the CUDA driver cannot be loaded.
    pub fn new(inner: Box<dyn Backend>) -> Result<HostStaging> {
        crate::loader::ensure_loaded()?;
        Ok(HostStaging { inner })
    }

    fn err(&self, e: Error) -> dist_backend::Error {
        e.into_backend(self.inner.rank())
    }

    fn pin(&self, op: &'static str, d: DeviceBuffer) -> dist_backend::Result<Staged<'static>> {
        let rank = self.inner.rank();
        let run = || -> Result<Staged<'static>> {
            Device::primary(rank, d.device())?.bind(rank, op)?;
            let mut p = PinnedBuf::new(d.len(), rank, op)?;
            if !d.is_empty() {
                p.copy_from_device(d.ptr(), d.stream() as usize as *mut _, rank, op)?;
            }
            Ok(Staged::Pinned(p, d))
        };
        run().map_err(|e| self.err(e))
    }

    fn stage_ref<'a>(&self, op: &'static str, b: BufRef<'a>) -> dist_backend::Result<Staged<'a>> {
        match b {
            BufRef::Host(h) => Ok(Staged::Host(h)),
            BufRef::Device(d) => self.pin(op, d),
        }
    }

    fn stage_mut<'a>(&self, op: &'static str, b: BufMut<'a>) -> dist_backend::Result<Staged<'a>> {
        match b {
            BufMut::Host(h) => Ok(Staged::HostMut(h)),
            BufMut::Device(d) => self.pin(op, d),
        }
    }

    /// Copies a written buffer back to the device.
    fn unstage(&self, op: &'static str, s: Staged<'_>) -> dist_backend::Result<()> {
        let Staged::Pinned(mut p, d) = s else {
            return Ok(());
        };
        if d.is_empty() {
            return Ok(());
        }
        let rank = self.inner.rank();
        Device::primary(rank, d.device())
            .and_then(|dev| dev.bind(rank, op))
            .and_then(|()| p.copy_to_device(d.ptr(), d.stream() as usize as *mut _, rank, op))
            .map_err(|e| self.err(e))
    }
}

impl Backend for HostStaging {
    fn name(&self) -> &'static str {
        self.inner.name()
    }

    fn rank(&self) -> usize {
        self.inner.rank()
    }

    fn world_size(&self) -> usize {
        self.inner.world_size()
    }

    fn capabilities(&self) -> Capabilities {
        let mut c = self.inner.capabilities();
        c.device_buffers = true;
        c
    }

    fn all_reduce(
        &self,
        buf: BufMut<'_>,
        dtype: DType,
        op: ReduceOp,
        opts: &OpOptions,
    ) -> dist_backend::Result<()> {
        let mut b = self.stage_mut("all_reduce", buf)?;
        self.inner.all_reduce(b.as_mut(), dtype, op, opts)?;
        self.unstage("all_reduce", b)
    }

    fn broadcast(
        &self,
        buf: BufMut<'_>,
        dtype: DType,
        root: usize,
        opts: &OpOptions,
    ) -> dist_backend::Result<()> {
        let mut b = self.stage_mut("broadcast", buf)?;
        self.inner.broadcast(b.as_mut(), dtype, root, opts)?;
        self.unstage("broadcast", b)
    }

    fn reduce(
        &self,
        buf: BufMut<'_>,
        dtype: DType,
        op: ReduceOp,
        root: usize,
        opts: &OpOptions,
    ) -> dist_backend::Result<()> {
        let mut b = self.stage_mut("reduce", buf)?;
        self.inner.reduce(b.as_mut(), dtype, op, root, opts)?;
        self.unstage("reduce", b)
    }

    fn all_gather(
        &self,
        input: BufRef<'_>,
        output: BufMut<'_>,
        dtype: DType,
        counts: &[usize],
        opts: &OpOptions,
    ) -> dist_backend::Result<()> {
        let mut i = self.stage_ref("all_gather", input)?;
        let mut o = self.stage_mut("all_gather", output)?;
        self.inner
            .all_gather(i.as_ref(), o.as_mut(), dtype, counts, opts)?;
        self.unstage("all_gather", o)
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
        let mut i = self.stage_ref("reduce_scatter", input)?;
        let mut o = self.stage_mut("reduce_scatter", output)?;
        self.inner
            .reduce_scatter(i.as_ref(), o.as_mut(), dtype, op, counts, opts)?;
        self.unstage("reduce_scatter", o)
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
        let mut i = self.stage_ref("all_to_all", input)?;
        let mut o = self.stage_mut("all_to_all", output)?;
        self.inner.all_to_all(
            i.as_ref(),
            o.as_mut(),
            dtype,
            send_counts,
            recv_counts,
            opts,
        )?;
        self.unstage("all_to_all", o)
    }

    fn gather(
        &self,
        input: BufRef<'_>,
        output: Option<BufMut<'_>>,
        dtype: DType,
        root: usize,
        opts: &OpOptions,
    ) -> dist_backend::Result<()> {
        let mut i = self.stage_ref("gather", input)?;
        let mut o = output.map(|o| self.stage_mut("gather", o)).transpose()?;
        self.inner.gather(
            i.as_ref(),
            o.as_mut().map(Staged::as_mut),
            dtype,
            root,
            opts,
        )?;
        o.map_or(Ok(()), |o| self.unstage("gather", o))
    }

    fn scatter(
        &self,
        input: Option<BufRef<'_>>,
        output: BufMut<'_>,
        dtype: DType,
        root: usize,
        opts: &OpOptions,
    ) -> dist_backend::Result<()> {
        let mut i = input.map(|i| self.stage_ref("scatter", i)).transpose()?;
        let mut o = self.stage_mut("scatter", output)?;
        self.inner.scatter(
            i.as_mut().map(Staged::as_ref),
            o.as_mut(),
            dtype,
            root,
            opts,
        )?;
        self.unstage("scatter", o)
    }

    fn barrier(&self, opts: &OpOptions) -> dist_backend::Result<()> {
        self.inner.barrier(opts)
    }

    fn send(
        &self,
        buf: BufRef<'_>,
        dtype: DType,
        dst: usize,
        opts: &OpOptions,
    ) -> dist_backend::Result<()> {
        let mut b = self.stage_ref("send", buf)?;
        self.inner.send(b.as_ref(), dtype, dst, opts)
    }

    fn recv(
        &self,
        buf: BufMut<'_>,
        dtype: DType,
        src: usize,
        opts: &OpOptions,
    ) -> dist_backend::Result<()> {
        let mut b = self.stage_mut("recv", buf)?;
        self.inner.recv(b.as_mut(), dtype, src, opts)?;
        self.unstage("recv", b)
    }

    fn probe(&self, src: usize, tag: u32) -> dist_backend::Result<bool> {
        self.inner.probe(src, tag)
    }

    fn close(&self) {
        self.inner.close();
    }
}
