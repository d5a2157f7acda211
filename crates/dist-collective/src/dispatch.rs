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

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use dist_backend::DeviceBuffer;

    use super::*;

    /// A backend that records which calls reach it.
    struct Rec(&'static str, Arc<Mutex<Vec<String>>>);

    impl Rec {
        fn hit(&self, op: &str) -> dist_backend::Result<()> {
            self.1.lock().unwrap().push(format!("{}:{op}", self.0));
            Ok(())
        }
    }

    impl Backend for Rec {
        fn name(&self) -> &'static str {
            self.0
        }
        fn rank(&self) -> usize {
            0
        }
        fn world_size(&self) -> usize {
            1
        }
        fn capabilities(&self) -> Capabilities {
            let mut c = Capabilities::HOST_ALL;
            c.device_buffers = self.0 == "device";
            c.host_buffers = self.0 == "host";
            c
        }
        fn all_reduce(
            &self,
            _: BufMut<'_>,
            _: DType,
            _: ReduceOp,
            _: &OpOptions,
        ) -> dist_backend::Result<()> {
            self.hit("all_reduce")
        }
        fn broadcast(
            &self,
            _: BufMut<'_>,
            _: DType,
            _: usize,
            _: &OpOptions,
        ) -> dist_backend::Result<()> {
            self.hit("broadcast")
        }
        fn reduce(
            &self,
            _: BufMut<'_>,
            _: DType,
            _: ReduceOp,
            _: usize,
            _: &OpOptions,
        ) -> dist_backend::Result<()> {
            self.hit("reduce")
        }
        fn all_gather(
            &self,
            _: BufRef<'_>,
            _: BufMut<'_>,
            _: DType,
            _: &[usize],
            _: &OpOptions,
        ) -> dist_backend::Result<()> {
            self.hit("all_gather")
        }
        fn reduce_scatter(
            &self,
            _: BufRef<'_>,
            _: BufMut<'_>,
            _: DType,
            _: ReduceOp,
            _: &[usize],
            _: &OpOptions,
        ) -> dist_backend::Result<()> {
            self.hit("reduce_scatter")
        }
        fn all_to_all(
            &self,
            _: BufRef<'_>,
            _: BufMut<'_>,
            _: DType,
            _: &[usize],
            _: &[usize],
            _: &OpOptions,
        ) -> dist_backend::Result<()> {
            self.hit("all_to_all")
        }
        fn gather(
            &self,
            _: BufRef<'_>,
            _: Option<BufMut<'_>>,
            _: DType,
            _: usize,
            _: &OpOptions,
        ) -> dist_backend::Result<()> {
            self.hit("gather")
        }
        fn scatter(
            &self,
            _: Option<BufRef<'_>>,
            _: BufMut<'_>,
            _: DType,
            _: usize,
            _: &OpOptions,
        ) -> dist_backend::Result<()> {
            self.hit("scatter")
        }
        fn barrier(&self, _: &OpOptions) -> dist_backend::Result<()> {
            self.hit("barrier")
        }
        fn send(
            &self,
            _: BufRef<'_>,
            _: DType,
            _: usize,
            _: &OpOptions,
        ) -> dist_backend::Result<()> {
            self.hit("send")
        }
        fn recv(
            &self,
            _: BufMut<'_>,
            _: DType,
            _: usize,
            _: &OpOptions,
        ) -> dist_backend::Result<()> {
            self.hit("recv")
        }
        fn close(&self) {
            let _ = self.hit("close");
        }
    }

    #[test]
    fn host_buffers_go_to_host_and_calls_without_buffers_too() {
        let log = Arc::new(Mutex::new(Vec::new()));
        let d = Dispatch {
            host: Box::new(Rec("host", log.clone())),
            device: Box::new(Rec("device", log.clone())),
        };
        let o = OpOptions::default();
        let mut a = [0u8; 4];
        let mut b = [0u8; 4];
        d.all_reduce(BufMut::Host(&mut a), DType::F32, ReduceOp::Sum, &o)
            .unwrap();
        d.all_gather(
            BufRef::Host(&b.clone()),
            BufMut::Host(&mut b),
            DType::U8,
            &[4],
            &o,
        )
        .unwrap();
        d.gather(BufRef::Host(&a), None, DType::U8, 0, &o).unwrap();
        d.barrier(&o).unwrap();
        d.close();
        assert_eq!(
            *log.lock().unwrap(),
            [
                "host:all_reduce",
                "host:all_gather",
                "host:gather",
                "host:barrier",
                "host:close",
                "device:close"
            ]
        );
        let c = d.capabilities();
        assert!(c.host_buffers && c.device_buffers);
    }

    #[test]
    fn any_device_buffer_sends_the_call_to_the_device_backend() {
        let log = Arc::new(Mutex::new(Vec::new()));
        let d = Dispatch {
            host: Box::new(Rec("host", log.clone())),
            device: Box::new(Rec("device", log.clone())),
        };
        let o = OpOptions::default();
        let dev = DeviceBuffer::empty(0);
        let mut h = [0u8; 0];
        d.all_reduce(BufMut::Device(dev), DType::F32, ReduceOp::Sum, &o)
            .unwrap();
        d.broadcast(BufMut::Device(dev), DType::F32, 0, &o).unwrap();
        d.reduce(BufMut::Device(dev), DType::F32, ReduceOp::Max, 0, &o)
            .unwrap();
        // Mixed: the device backend decides (and would reject the host side itself).
        d.all_gather(BufRef::Host(&[]), BufMut::Device(dev), DType::U8, &[0], &o)
            .unwrap();
        d.reduce_scatter(
            BufRef::Device(dev),
            BufMut::Host(&mut h),
            DType::U8,
            ReduceOp::Sum,
            &[0],
            &o,
        )
        .unwrap();
        d.all_to_all(
            BufRef::Device(dev),
            BufMut::Device(dev),
            DType::U8,
            &[0],
            &[0],
            &o,
        )
        .unwrap();
        // Rooted ops decide by the buffer every rank passes.
        d.gather(BufRef::Device(dev), None, DType::U8, 0, &o)
            .unwrap();
        d.scatter(None, BufMut::Device(dev), DType::U8, 0, &o)
            .unwrap();
        d.send(BufRef::Device(dev), DType::U8, 0, &o).unwrap();
        d.recv(BufMut::Device(dev), DType::U8, 0, &o).unwrap();
        d.send(BufRef::Host(&[]), DType::U8, 0, &o).unwrap();
        let log = log.lock().unwrap();
        let ops = [
            "all_reduce",
            "broadcast",
            "reduce",
            "all_gather",
            "reduce_scatter",
            "all_to_all",
            "gather",
            "scatter",
            "send",
            "recv",
        ];
        let want: Vec<String> = ops
            .iter()
            .map(|o| format!("device:{o}"))
            .chain(["host:send".to_owned()])
            .collect();
        assert_eq!(*log, want);
    }
}
