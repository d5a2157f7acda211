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

/// Calls `$then!` with every [`Backend`] operation that takes buffers: its name, its
/// parameters, and the expression (over them) that is true when the device backend serves it.
/// The one list of these operations, shared by [`Dispatch`] and its tests.
macro_rules! buffer_ops {
    ($then:ident) => {
        $then! {
            all_reduce(buf: BufMut<'_>, dtype: DType, op: ReduceOp, opts: &OpOptions)
                by dev_mut(&buf);
            broadcast(buf: BufMut<'_>, dtype: DType, root: usize, opts: &OpOptions)
                by dev_mut(&buf);
            reduce(buf: BufMut<'_>, dtype: DType, op: ReduceOp, root: usize, opts: &OpOptions)
                by dev_mut(&buf);
            all_gather(
                input: BufRef<'_>,
                output: BufMut<'_>,
                dtype: DType,
                counts: &[usize],
                opts: &OpOptions
            ) by dev_ref(&input) || dev_mut(&output);
            reduce_scatter(
                input: BufRef<'_>,
                output: BufMut<'_>,
                dtype: DType,
                op: ReduceOp,
                counts: &[usize],
                opts: &OpOptions
            ) by dev_ref(&input) || dev_mut(&output);
            all_to_all(
                input: BufRef<'_>,
                output: BufMut<'_>,
                dtype: DType,
                send_counts: &[usize],
                recv_counts: &[usize],
                opts: &OpOptions
            ) by dev_ref(&input) || dev_mut(&output);
            all_to_all_even(
                input: BufRef<'_>,
                output: BufMut<'_>,
                dtype: DType,
                count: usize,
                opts: &OpOptions
            ) by dev_ref(&input) || dev_mut(&output);
            // Every rank must pick the same backend, and only the root has the rooted buffer:
            // the buffer every rank passes decides.
            gather(
                input: BufRef<'_>,
                output: Option<BufMut<'_>>,
                dtype: DType,
                root: usize,
                opts: &OpOptions
            ) by dev_ref(&input);
            scatter(
                input: Option<BufRef<'_>>,
                output: BufMut<'_>,
                dtype: DType,
                root: usize,
                opts: &OpOptions
            ) by dev_mut(&output);
            send(buf: BufRef<'_>, dtype: DType, dst: usize, opts: &OpOptions) by dev_ref(&buf);
            recv(buf: BufMut<'_>, dtype: DType, src: usize, opts: &OpOptions) by dev_mut(&buf);
        }
    };
}

/// The [`Backend`] methods of [`Dispatch`] for `buffer_ops`: each hands its arguments to the
/// backend its buffers pick.
macro_rules! forward {
    ($($op:ident($($arg:ident: $ty:ty),* $(,)?) by $device:expr;)*) => {
        $(
            fn $op(&self, $($arg: $ty),*) -> dist_backend::Result<()> {
                self.pick($device).$op($($arg),*)
            }
        )*
    };
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

    buffer_ops!(forward);

    fn barrier(&self, opts: &OpOptions) -> dist_backend::Result<()> {
        self.host.barrier(opts)
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

    /// The [`Backend`] methods of [`Rec`] for `buffer_ops`: each records its name.
    macro_rules! record {
        ($($op:ident($($arg:ident: $ty:ty),* $(,)?) by $device:expr;)*) => {
            $(
                fn $op(&self, $(_: $ty),*) -> dist_backend::Result<()> {
                    self.hit(stringify!($op))
                }
            )*
        };
    }

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
        buffer_ops!(record);
        fn barrier(&self, _: &OpOptions) -> dist_backend::Result<()> {
            self.hit("barrier")
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
        d.all_to_all_even(BufRef::Device(dev), BufMut::Device(dev), DType::U8, 0, &o)
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
            "all_to_all_even",
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
