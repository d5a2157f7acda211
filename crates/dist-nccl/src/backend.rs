//! [`NcclBackend`]: the `Backend` contract over NCCL for device buffers.

use std::ffi::c_int;
use std::sync::{Arc, Mutex};

use cudarc::nccl::sys::{self as nccl, ncclComm_t, ncclDataType_t};
use dist_backend::{Backend, BufMut, BufRef, Capabilities, DeviceBuffer, OpOptions, Store};
use dist_wire::{DType, ReduceOp};

use crate::comm::{Comm, RedOp, check, reduce_fns};
use crate::cuda::{Device, device_count};
use crate::live::{Call, Live, at, grouped};
use crate::types::{NcclOp, nccl_dtype, nccl_op, premul_scalar};
use crate::watchdog::FlightRecord;
use crate::{Error, NcclOptions, Result};

/// Bytes travel as `ncclUint8` in operations that do not reduce, so every dtype works there.
const BYTES: ncclDataType_t = ncclDataType_t::ncclUint8;

/// The NCCL backend of one group: one communicator, created lazily on the device of the first
/// buffer it is given (as torch does), its unique id exchanged through the group's store.
///
/// Operations accept [`BufRef::Device`]/[`BufMut::Device`] only (host buffers are
/// `Unsupported`: use `"cpu:gloo,cuda:nccl"` or host staging). Each runs on the
/// communicator's own stream fenced by events both ways with the buffer's stream; with
/// [`NcclOptions::blocking_wait`] (the default) it returns once the GPU has finished.
/// `send`/`recv` match by order per peer: NCCL has no tags, so `opts.tag` is ignored.
///
/// `Send + Sync`: every NCCL call is serialised inside.
pub struct NcclBackend {
    rank: usize,
    world_size: usize,
    store: Option<Arc<dyn Store>>,
    prefix: String,
    opts: NcclOptions,
    live: Mutex<Option<Result<Arc<Live>>>>,
}

impl std::fmt::Debug for NcclBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclBackend")
            .field("rank", &self.rank)
            .field("world_size", &self.world_size)
            .field("prefix", &self.prefix)
            .finish()
    }
}

/// Refuses a split `color` or `key` past NCCL's non-negative `int`, naming which.
fn check_split_args(rank: usize, color: Option<u32>, key: usize) -> Result<()> {
    let past = |what: &str, v: u64| Error::Unsupported {
        rank,
        op: "split",
        reason: format!(
            "{what} {v} does not fit NCCL's non-negative int (at most {})",
            i32::MAX
        ),
    };
    if let Some(c) = color.filter(|&c| c > i32::MAX as u32) {
        return Err(past("color", u64::from(c)));
    }
    if key > i32::MAX as usize {
        return Err(past("key", key as u64));
    }
    Ok(())
}

/// The device a backend takes when its first operation names none (a barrier): this process's
/// rank on its host modulo the host's `devices`, as torch's `LOCAL_RANK` convention has it
/// (under Slurm with one visible GPU per task that is always device 0); without a local rank,
/// the group rank modulo `devices`, as torch's `ProcessGroupNCCL` guesses.
pub(crate) fn default_ordinal(local_rank: Option<u32>, rank: usize, devices: u32) -> u32 {
    match local_rank {
        Some(lr) => lr % devices,
        None => (rank % devices as usize) as u32,
    }
}

impl NcclBackend {
    /// A backend for `rank` of `world_size`, rendezvousing under `prefix` in `store` when it
    /// first needs its communicator. Fails at once with [`Error::Unavailable`] (naming the
    /// library) when libcuda or libnccl cannot be loaded.
    pub fn new(
        store: Arc<dyn Store>,
        prefix: &str,
        rank: usize,
        world_size: usize,
        opts: NcclOptions,
    ) -> Result<NcclBackend> {
        crate::loader::ensure_loaded()?;
        if rank >= world_size {
            return Err(Error::Unsupported {
                rank,
                op: "init",
                reason: format!("rank {rank} is not below world_size {world_size}"),
            });
        }
        Ok(NcclBackend {
            rank,
            world_size,
            store: Some(store),
            prefix: prefix.to_owned(),
            opts,
            live: Mutex::new(None),
        })
    }

    /// `ncclCommSplit` (torch's `new_group` with `split_from`): every rank of this backend
    /// calls it; the ranks passing the same `color` form a new backend, ordered by `key`
    /// (`None`: this rank joins none and gets `None`). Creates this backend's communicator
    /// first if needed.
    /// `color` and `key` must fit NCCL's non-negative `int` (up to `i32::MAX`): larger ones are
    /// refused, where they would have merged distinct colors and reordered ranks.
    pub fn split(&self, color: Option<u32>, key: usize) -> Result<Option<NcclBackend>> {
        check_split_args(self.rank, color, key)?;
        let live = self.live(None)?;
        let Some((comm, rank, size)) = live.exclusive("split", |c| c.split(color, key))? else {
            return Ok(None);
        };
        let new = Live::start(rank, live.device(), comm, &self.opts)?;
        Ok(Some(NcclBackend {
            rank,
            world_size: size,
            store: None,
            prefix: format!("{}/split", self.prefix),
            opts: self.opts.clone(),
            live: Mutex::new(Some(Ok(Arc::new(new)))),
        }))
    }

    /// The flight recorder: the last finished operations (completed or failed) and the ones
    /// still pending, with seq, op, bytes and how long each took (empty before the
    /// communicator exists).
    pub fn flight_records(&self) -> Vec<FlightRecord> {
        match &*self.live.lock().unwrap_or_else(|e| e.into_inner()) {
            Some(Ok(l)) => l.records(),
            _ => Vec::new(),
        }
    }

    /// The device of the communicator, once it exists.
    pub fn device(&self) -> Option<u32> {
        match &*self.live.lock().unwrap_or_else(|e| e.into_inner()) {
            Some(Ok(l)) => Some(l.ordinal()),
            _ => None,
        }
    }

    fn default_device(&self) -> Result<u32> {
        if let Some(d) = self.opts.device {
            return Ok(d);
        }
        let n = device_count(self.rank)?;
        if n == 0 {
            return Err(Error::Unavailable {
                library: "libcuda",
                reason: "the driver loaded but reports no CUDA device".into(),
            });
        }
        Ok(default_ordinal(self.opts.local_rank, self.rank, n))
    }

    /// The communicator, created on first use (on `device`, or the default one). A failed
    /// creation is sticky once the rendezvous began (peers are then in an unknown state);
    /// choosing and binding the device involves no peer, so a failure there (a device this
    /// process cannot see) is returned and the next call tries again.
    fn live(&self, device: Option<u32>) -> Result<Arc<Live>> {
        let mut slot = self.live.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(r) = &*slot {
            return r.clone();
        }
        let ordinal = match device {
            Some(d) => d,
            None => self.default_device()?,
        };
        let dev = Device::primary(self.rank, ordinal)?;
        dev.bind(self.rank, "init")?;
        let r = self.create(dev).map(Arc::new);
        *slot = Some(r.clone());
        r
    }

    fn create(&self, dev: Device) -> Result<Live> {
        let Some(store) = &self.store else {
            return Err(Error::Unsupported {
                rank: self.rank,
                op: "init",
                reason: "a split backend has no store to create a communicator with".into(),
            });
        };
        let comm = Comm::init(
            &**store,
            &self.prefix,
            self.rank,
            self.world_size,
            self.opts.timeout,
        )?;
        Live::start(self.rank, dev, comm, &self.opts)
    }

    fn err(&self, e: Error) -> dist_backend::Error {
        e.into_backend(self.rank)
    }

    fn host(&self, op: &'static str) -> dist_backend::Error {
        dist_backend::Error::Unsupported {
            rank: self.rank,
            backend: "nccl",
            what: format!(
                "{op} on host memory (use backend \"cpu:gloo,cuda:nccl\" to serve host buffers)"
            ),
        }
    }

    fn dev_ref(&self, op: &'static str, b: BufRef<'_>) -> dist_backend::Result<DeviceBuffer> {
        match b {
            BufRef::Device(d) => Ok(d),
            BufRef::Host(_) => Err(self.host(op)),
        }
    }

    fn dev_mut(&self, op: &'static str, b: BufMut<'_>) -> dist_backend::Result<DeviceBuffer> {
        match b {
            BufMut::Device(d) => Ok(d),
            BufMut::Host(_) => Err(self.host(op)),
        }
    }

    fn check_len(
        &self,
        op: &'static str,
        what: &str,
        b: &DeviceBuffer,
        count: usize,
        dtype: DType,
    ) -> dist_backend::Result<()> {
        let want = count.checked_mul(dtype.size()).ok_or_else(|| {
            dist_backend::Error::invalid(self.rank, op, format!("{count} elements overflow"))
        })?;
        if b.len() != want {
            return Err(dist_backend::Error::invalid(
                self.rank,
                op,
                format!(
                    "{what} holds {} bytes but {count} × {dtype} = {want} are needed",
                    b.len()
                ),
            ));
        }
        Ok(())
    }

    /// The root's extra buffer of a gather or scatter (`what`: "input" or "output"): required
    /// on the root, refused on every other rank.
    fn root_only<T>(
        &self,
        op: &'static str,
        what: &str,
        buf: Option<T>,
        root: usize,
    ) -> dist_backend::Result<Option<T>> {
        match (buf, self.rank == root) {
            (Some(b), true) => Ok(Some(b)),
            (None, false) => Ok(None),
            (None, true) => Err(dist_backend::Error::invalid(
                self.rank,
                op,
                format!("the root must pass an {what}"),
            )),
            (Some(_), false) => Err(dist_backend::Error::invalid(
                self.rank,
                op,
                format!("only the root ({root}) passes an {what}"),
            )),
        }
    }

    fn check_rank(&self, op: &'static str, what: &str, r: usize) -> dist_backend::Result<()> {
        if r >= self.world_size {
            return Err(dist_backend::Error::invalid(
                self.rank,
                op,
                format!(
                    "{what} {r} is not a rank of this group of {}",
                    self.world_size
                ),
            ));
        }
        Ok(())
    }

    fn check_counts(
        &self,
        op: &'static str,
        what: &str,
        counts: &[usize],
    ) -> dist_backend::Result<usize> {
        if counts.len() != self.world_size {
            return Err(dist_backend::Error::invalid(
                self.rank,
                op,
                format!(
                    "{what} has {} entries for {} ranks",
                    counts.len(),
                    self.world_size
                ),
            ));
        }
        counts
            .iter()
            .try_fold(0usize, |a, &c| a.checked_add(c))
            .ok_or_else(|| dist_backend::Error::invalid(self.rank, op, format!("{what} overflow")))
    }

    /// Runs one operation on the buffers' device and stream.
    fn run(
        &self,
        op: &'static str,
        opts: &OpOptions,
        bufs: &[DeviceBuffer],
        bytes: usize,
        f: impl FnOnce(ncclComm_t, nccl::cudaStream_t, u64) -> Result<()>,
    ) -> dist_backend::Result<()> {
        let first = bufs.first();
        if let Some(b) = first
            && let Some(o) = bufs
                .iter()
                .find(|o| o.device() != b.device() || o.stream() != b.stream())
        {
            return Err(dist_backend::Error::invalid(
                self.rank,
                op,
                format!(
                    "buffers on device {} stream {:#x} and device {} stream {:#x}: an operation's buffers must share one device and stream",
                    b.device(),
                    b.stream(),
                    o.device(),
                    o.stream()
                ),
            ));
        }
        let live = self
            .live(first.map(DeviceBuffer::device))
            .map_err(|e| self.err(e))?;
        if let Some(b) = first
            && b.device() != live.ordinal()
        {
            return Err(self.err(Error::Unsupported {
                rank: self.rank,
                op,
                reason: format!(
                    "a buffer on device {} but this group's communicator is on device {} (one device per rank and group)",
                    b.device(),
                    live.ordinal()
                ),
            }));
        }
        let call = Call {
            op,
            seq: opts.seq,
            timeout: opts.timeout,
            bytes,
            force_wait: bufs.is_empty(),
        };
        live.enqueue(call, first.map_or(0, DeviceBuffer::stream), f)
            .map_err(|e| self.err(e))
    }

    fn reduce_args(
        &self,
        op: &'static str,
        dtype: DType,
        rop: ReduceOp,
    ) -> dist_backend::Result<(ncclDataType_t, NcclOp)> {
        let unsupported = |what: String| dist_backend::Error::Unsupported {
            rank: self.rank,
            backend: "nccl",
            what: format!("{op} with {what}"),
        };
        let dt = nccl_dtype(dtype)
            .ok_or_else(|| unsupported(format!("dtype {dtype} (NCCL cannot reduce it)")))?;
        let o = nccl_op(rop).ok_or_else(|| {
            unsupported(format!(
                "reduce op {} (NCCL has no bitwise ops)",
                rop.name()
            ))
        })?;
        Ok((dt, o))
    }
}

/// A reduction's element type, as ours and as NCCL's, and its op.
#[derive(Clone, Copy)]
struct Red {
    dtype: DType,
    dt: ncclDataType_t,
    op: NcclOp,
}

/// Runs `f` with NCCL's handle for `red.op` (creating and destroying a PreMulSum op around
/// it).
fn with_redop(
    rank: usize,
    name: &'static str,
    seq: u64,
    comm: ncclComm_t,
    red: Red,
    f: impl FnOnce(RedOp) -> Result<()>,
) -> Result<()> {
    let Red { dtype, dt, op } = red;
    match op {
        NcclOp::Builtin(o) => f(o as u32 as RedOp),
        NcclOp::PreMulSum(factor) => {
            let fns = reduce_fns()?;
            let mut scalar = premul_scalar(dtype, factor).ok_or_else(|| Error::Unsupported {
                rank,
                op: name,
                reason: format!("PreMulSum over {dtype}"),
            })?;
            let mut h: RedOp = 0;
            // SAFETY: `h` is a valid out-pointer; the scalar is one element of `dt`, read
            // during this call (host-immediate residence); `comm` is live.
            let r = unsafe {
                (fns.create_premul_sum)(
                    &mut h,
                    scalar.as_mut_ptr().cast(),
                    dt,
                    nccl::ncclScalarResidence_t::ncclScalarHostImmediate,
                    comm,
                )
            };
            check(r, rank, name, seq, "ncclRedOpCreatePreMulSum")?;
            let out = f(h);
            // SAFETY: `h` was created on `comm` above; NCCL allows destroying it once the
            // calls using it are enqueued.
            let d = check(
                unsafe { (fns.destroy_op)(h, comm) },
                rank,
                name,
                seq,
                "ncclRedOpDestroy",
            );
            if let (Ok(()), Err(e)) = (&out, d) {
                // The operation is enqueued and must be watched and fenced like any other:
                // failing it here left its kernel running unordered with the caller's stream.
                // What leaks is one reduction handle.
                tracing::warn!(rank, op = name, seq, error = %e, "dist-nccl: could not destroy a PreMulSum handle");
            }
            out
        }
    }
}

impl Backend for NcclBackend {
    fn name(&self) -> &'static str {
        "nccl"
    }

    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world_size
    }

    fn capabilities(&self) -> Capabilities {
        let mut c = Capabilities::HOST_ALL;
        c.host_buffers = false;
        c.device_buffers = true;
        c.bitwise_ops = false;
        c.probe = false;
        c
    }

    fn all_reduce(
        &self,
        buf: BufMut<'_>,
        dtype: DType,
        op: ReduceOp,
        opts: &OpOptions,
    ) -> dist_backend::Result<()> {
        const OP: &str = "all_reduce";
        let b = self.dev_mut(OP, buf)?;
        let count = b.len() / dtype.size();
        self.check_len(OP, "buf", &b, count, dtype)?;
        let (dt, rop) = self.reduce_args(OP, dtype, op)?;
        let rank = self.rank;
        self.run(OP, opts, &[b], b.len(), |c, s, seq| {
            let fns = reduce_fns()?;
            with_redop(rank, OP, seq, c, Red { dtype, dt, op: rop }, |o| {
                // SAFETY: `b` is device memory of `count` elements on the bound device,
                // vouched for by `DeviceBuffer::from_raw`; in place is allowed; `c` and `s`
                // are live.
                let r = unsafe { (fns.all_reduce)(at(&b, 0), at(&b, 0), count, dt, o, c, s) };
                check(r, rank, OP, seq, "ncclAllReduce")
            })
        })
    }

    fn broadcast(
        &self,
        buf: BufMut<'_>,
        dtype: DType,
        root: usize,
        opts: &OpOptions,
    ) -> dist_backend::Result<()> {
        const OP: &str = "broadcast";
        let b = self.dev_mut(OP, buf)?;
        self.check_rank(OP, "root", root)?;
        let _ = dtype;
        let rank = self.rank;
        self.run(OP, opts, &[b], b.len(), |c, s, seq| {
            // SAFETY: as in `all_reduce`, `b.len()` bytes.
            let r = unsafe {
                nccl::ncclBroadcast(at(&b, 0), at(&b, 0), b.len(), BYTES, root as c_int, c, s)
            };
            check(r, rank, OP, seq, "ncclBroadcast")
        })
    }

    fn reduce(
        &self,
        buf: BufMut<'_>,
        dtype: DType,
        op: ReduceOp,
        root: usize,
        opts: &OpOptions,
    ) -> dist_backend::Result<()> {
        const OP: &str = "reduce";
        let b = self.dev_mut(OP, buf)?;
        self.check_rank(OP, "root", root)?;
        let count = b.len() / dtype.size();
        self.check_len(OP, "buf", &b, count, dtype)?;
        let (dt, rop) = self.reduce_args(OP, dtype, op)?;
        let rank = self.rank;
        self.run(OP, opts, &[b], b.len(), |c, s, seq| {
            let fns = reduce_fns()?;
            with_redop(rank, OP, seq, c, Red { dtype, dt, op: rop }, |o| {
                // SAFETY: as in `all_reduce`.
                let r = unsafe {
                    (fns.reduce)(at(&b, 0), at(&b, 0), count, dt, o, root as c_int, c, s)
                };
                check(r, rank, OP, seq, "ncclReduce")
            })
        })
    }

    fn all_gather(
        &self,
        input: BufRef<'_>,
        output: BufMut<'_>,
        dtype: DType,
        counts: &[usize],
        opts: &OpOptions,
    ) -> dist_backend::Result<()> {
        const OP: &str = "all_gather";
        let i = self.dev_ref(OP, input)?;
        let o = self.dev_mut(OP, output)?;
        let total = self.check_counts(OP, "counts", counts)?;
        self.check_len(OP, "input", &i, counts[self.rank], dtype)?;
        self.check_len(OP, "output", &o, total, dtype)?;
        let sz = dtype.size();
        let rank = self.rank;
        let even = counts.iter().all(|&c| c == counts[0]);
        let counts = counts.to_vec();
        self.run(OP, opts, &[i, o], i.len(), |c, s, seq| {
            if even {
                // SAFETY: `i` holds `counts[0] * sz` bytes and `o` world_size times that.
                let r = unsafe {
                    nccl::ncclAllGather(at(&i, 0), at(&o, 0), counts[0] * sz, BYTES, c, s)
                };
                return check(r, rank, OP, seq, "ncclAllGather");
            }
            // Uneven: one broadcast per rank into its slice, in one group (torch's
            // all_gather_v).
            grouped(rank, OP, seq, || {
                let mut off = 0;
                for (r, &n) in counts.iter().enumerate() {
                    if n > 0 {
                        let src = if r == rank { at(&i, 0) } else { at(&o, off) };
                        // SAFETY: slice `off..off + n*sz` of `o` is within it (sum of counts
                        // checked); `src` is only read on rank r, where it is `i`.
                        let res = unsafe {
                            nccl::ncclBroadcast(src, at(&o, off), n * sz, BYTES, r as c_int, c, s)
                        };
                        check(res, rank, OP, seq, "ncclBroadcast")?;
                    }
                    off += n * sz;
                }
                Ok(())
            })
        })
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
        const OP: &str = "reduce_scatter";
        let i = self.dev_ref(OP, input)?;
        let o = self.dev_mut(OP, output)?;
        let total = self.check_counts(OP, "counts", counts)?;
        self.check_len(OP, "input", &i, total, dtype)?;
        self.check_len(OP, "output", &o, counts[self.rank], dtype)?;
        let (dt, rop) = self.reduce_args(OP, dtype, op)?;
        let sz = dtype.size();
        let rank = self.rank;
        let even = counts.iter().all(|&c| c == counts[0]);
        let counts = counts.to_vec();
        self.run(OP, opts, &[i, o], i.len(), |c, s, seq| {
            let fns = reduce_fns()?;
            with_redop(rank, OP, seq, c, Red { dtype, dt, op: rop }, |ro| {
                if even {
                    // SAFETY: `i` holds world_size × counts[0] elements, `o` counts[0].
                    let r = unsafe {
                        (fns.reduce_scatter)(at(&i, 0), at(&o, 0), counts[0], dt, ro, c, s)
                    };
                    return check(r, rank, OP, seq, "ncclReduceScatter");
                }
                // Uneven: one reduce per rank of its slice, rooted at it, in one group.
                grouped(rank, OP, seq, || {
                    let mut off = 0;
                    for (r, &n) in counts.iter().enumerate() {
                        if n > 0 {
                            // The receive buffer is only written on the root.
                            let dst = if r == rank { at(&o, 0) } else { at(&i, off) };
                            // SAFETY: slice `off..off + n*sz` of `i` is within it; `o` holds
                            // `n` elements on rank r.
                            let res = unsafe {
                                (fns.reduce)(at(&i, off), dst, n, dt, ro, r as c_int, c, s)
                            };
                            check(res, rank, OP, seq, "ncclReduce")?;
                        }
                        off += n * sz;
                    }
                    Ok(())
                })
            })
        })
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
        const OP: &str = "all_to_all";
        let i = self.dev_ref(OP, input)?;
        let o = self.dev_mut(OP, output)?;
        let st = self.check_counts(OP, "send_counts", send_counts)?;
        let rt = self.check_counts(OP, "recv_counts", recv_counts)?;
        self.check_len(OP, "input", &i, st, dtype)?;
        self.check_len(OP, "output", &o, rt, dtype)?;
        let rank = self.rank;
        // NCCL would pair a self-send and a self-receive of different sizes (an error or a
        // hang of its own); gloo refuses the same.
        if send_counts[rank] != recv_counts[rank] {
            return Err(dist_backend::Error::invalid(
                rank,
                OP,
                format!(
                    "this rank sends itself {} elements but expects to receive {} from itself",
                    send_counts[rank], recv_counts[rank]
                ),
            ));
        }
        let sz = dtype.size();
        let (sc, rc) = (send_counts.to_vec(), recv_counts.to_vec());
        self.run(OP, opts, &[i, o], i.len(), |c, s, seq| {
            // One group of send+recv per peer, zero sizes skipped (torch's all2all).
            grouped(rank, OP, seq, || {
                let p = Pieces::new(c, s, rank, OP, seq);
                let (mut so, mut ro) = (0, 0);
                for r in 0..sc.len() {
                    p.send(&i, so, sc[r] * sz, r)?;
                    p.recv(&o, ro, rc[r] * sz, r)?;
                    so += sc[r] * sz;
                    ro += rc[r] * sz;
                }
                Ok(())
            })
        })
    }

    fn gather(
        &self,
        input: BufRef<'_>,
        output: Option<BufMut<'_>>,
        dtype: DType,
        root: usize,
        opts: &OpOptions,
    ) -> dist_backend::Result<()> {
        const OP: &str = "gather";
        self.check_rank(OP, "root", root)?;
        let i = self.dev_ref(OP, input)?;
        let n = i.len() / dtype.size();
        self.check_len(OP, "input", &i, n, dtype)?;
        let o = match self.root_only(OP, "output", output, root)? {
            Some(o) => {
                let o = self.dev_mut(OP, o)?;
                self.check_len(OP, "output", &o, n * self.world_size, dtype)?;
                Some(o)
            }
            None => None,
        };
        let mut bufs = vec![i];
        bufs.extend(o);
        let (rank, world) = (self.rank, self.world_size);
        let bytes = i.len();
        self.run(OP, opts, &bufs, bytes, |c, s, seq| {
            grouped(rank, OP, seq, || {
                let p = Pieces::new(c, s, rank, OP, seq);
                if let Some(o) = &o {
                    for r in 0..world {
                        p.recv(o, r * bytes, bytes, r)?;
                    }
                }
                p.send(&i, 0, bytes, root)
            })
        })
    }

    fn scatter(
        &self,
        input: Option<BufRef<'_>>,
        output: BufMut<'_>,
        dtype: DType,
        root: usize,
        opts: &OpOptions,
    ) -> dist_backend::Result<()> {
        const OP: &str = "scatter";
        self.check_rank(OP, "root", root)?;
        let o = self.dev_mut(OP, output)?;
        let n = o.len() / dtype.size();
        self.check_len(OP, "output", &o, n, dtype)?;
        let i = match self.root_only(OP, "input", input, root)? {
            Some(i) => {
                let i = self.dev_ref(OP, i)?;
                self.check_len(OP, "input", &i, n * self.world_size, dtype)?;
                Some(i)
            }
            None => None,
        };
        let mut bufs = vec![o];
        bufs.extend(i);
        let (rank, world) = (self.rank, self.world_size);
        let bytes = o.len();
        self.run(OP, opts, &bufs, bytes, |c, s, seq| {
            grouped(rank, OP, seq, || {
                let p = Pieces::new(c, s, rank, OP, seq);
                if let Some(i) = &i {
                    for r in 0..world {
                        p.send(i, r * bytes, bytes, r)?;
                    }
                }
                p.recv(&o, 0, bytes, root)
            })
        })
    }

    fn barrier(&self, opts: &OpOptions) -> dist_backend::Result<()> {
        const OP: &str = "barrier";
        let live = self.live(None).map_err(|e| self.err(e))?;
        let scratch = live.scratch().map_err(|e| self.err(e))?;
        let rank = self.rank;
        // A one-element all-reduce on the communicator's device, always waited for (torch's
        // barrier does the same).
        self.run(OP, opts, &[], 0, |c, s, seq| {
            let fns = reduce_fns()?;
            // SAFETY: `scratch` is 8 bytes of device memory owned by `live`, on its device.
            let r = unsafe {
                (fns.all_reduce)(
                    scratch as usize as *const _,
                    scratch as usize as *mut _,
                    1,
                    ncclDataType_t::ncclFloat32,
                    0,
                    c,
                    s,
                )
            };
            check(r, rank, OP, seq, "ncclAllReduce")
        })
    }

    fn send(
        &self,
        buf: BufRef<'_>,
        dtype: DType,
        dst: usize,
        opts: &OpOptions,
    ) -> dist_backend::Result<()> {
        const OP: &str = "send";
        let b = self.dev_ref(OP, buf)?;
        self.check_rank(OP, "dst", dst)?;
        let _ = dtype;
        let rank = self.rank;
        self.run(OP, opts, &[b], b.len(), |c, s, seq| {
            // SAFETY: `b` holds `b.len()` bytes.
            let r = unsafe { nccl::ncclSend(at(&b, 0), b.len(), BYTES, dst as c_int, c, s) };
            check(r, rank, OP, seq, "ncclSend")
        })
    }

    fn recv(
        &self,
        buf: BufMut<'_>,
        dtype: DType,
        src: usize,
        opts: &OpOptions,
    ) -> dist_backend::Result<()> {
        const OP: &str = "recv";
        let b = self.dev_mut(OP, buf)?;
        self.check_rank(OP, "src", src)?;
        let _ = dtype;
        let rank = self.rank;
        self.run(OP, opts, &[b], b.len(), |c, s, seq| {
            // SAFETY: `b` holds `b.len()` writable bytes.
            let r = unsafe { nccl::ncclRecv(at(&b, 0), b.len(), BYTES, src as c_int, c, s) };
            check(r, rank, OP, seq, "ncclRecv")
        })
    }

    fn close(&self) {
        // Later operations fail instead of creating a new communicator.
        let closed = Some(Err(Error::Closed { rank: self.rank }));
        let live = std::mem::replace(
            &mut *self.live.lock().unwrap_or_else(|e| e.into_inner()),
            closed,
        );
        if let Some(Ok(l)) = live {
            l.close();
        }
    }
}

impl Drop for NcclBackend {
    fn drop(&mut self) {
        self.close();
    }
}

/// The point-to-point pieces of one grouped NCCL call (gather, scatter, all_to_all): each piece
/// is a byte range of a device buffer sent to or received from one peer.
struct Pieces {
    comm: ncclComm_t,
    stream: nccl::cudaStream_t,
    rank: usize,
    op: &'static str,
    seq: u64,
}

impl Pieces {
    fn new(
        comm: ncclComm_t,
        stream: nccl::cudaStream_t,
        rank: usize,
        op: &'static str,
        seq: u64,
    ) -> Self {
        Pieces {
            comm,
            stream,
            rank,
            op,
            seq,
        }
    }

    /// `ncclSend` of `b[offset..offset + len]` to `peer`; nothing when `len` is 0.
    fn send(&self, b: &DeviceBuffer, offset: usize, len: usize, peer: usize) -> Result<()> {
        self.piece(true, b, offset, len, peer)
    }

    /// `ncclRecv` into `b[offset..offset + len]` from `peer`; nothing when `len` is 0.
    fn recv(&self, b: &DeviceBuffer, offset: usize, len: usize, peer: usize) -> Result<()> {
        self.piece(false, b, offset, len, peer)
    }

    fn piece(
        &self,
        send: bool,
        b: &DeviceBuffer,
        offset: usize,
        len: usize,
        peer: usize,
    ) -> Result<()> {
        if len == 0 {
            return Ok(());
        }
        // The callers checked every length against the buffers before the call; this keeps
        // the range argument below local.
        assert!(
            offset + len <= b.len(),
            "{}: piece {offset}..{} outside a {}-byte buffer",
            self.op,
            offset + len,
            b.len()
        );
        let (ptr, peer) = (at(b, offset), peer as c_int);
        // SAFETY: `offset..offset + len` lies within `b` (asserted above), whose `len()` bytes
        // from `ptr()` are device memory valid on the communicator's device for this call
        // (`DeviceBuffer::from_raw`'s contract); NCCL reads (send) or writes (recv) only them.
        let res = unsafe {
            if send {
                nccl::ncclSend(ptr, len, BYTES, peer, self.comm, self.stream)
            } else {
                nccl::ncclRecv(ptr, len, BYTES, peer, self.comm, self.stream)
            }
        };
        let call = if send { "ncclSend" } else { "ncclRecv" };
        check(res, self.rank, self.op, self.seq, call)
    }
}

#[cfg(test)]
mod tests {
    use super::{check_split_args, default_ordinal};

    #[test]
    fn split_colors_and_keys_past_nccls_int_are_refused() {
        check_split_args(0, Some(i32::MAX as u32), i32::MAX as usize).unwrap();
        check_split_args(0, None, 0).unwrap();
        let e = check_split_args(2, Some(u32::MAX), 0)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("rank 2") && e.contains("color 4294967295"),
            "{e}"
        );
        let e = check_split_args(1, Some(0), 1 << 31)
            .unwrap_err()
            .to_string();
        assert!(e.contains("key 2147483648"), "{e}");
    }

    #[test]
    fn the_default_device_wraps_the_local_rank_and_falls_back_to_the_rank() {
        // Slurm with one visible GPU per task: local rank 3 is device 0, not 3.
        assert_eq!(default_ordinal(Some(3), 11, 1), 0);
        assert_eq!(default_ordinal(Some(3), 11, 2), 1);
        assert_eq!(default_ordinal(Some(1), 5, 8), 1);
        assert_eq!(default_ordinal(None, 5, 4), 1);
        assert_eq!(
            default_ordinal(None, usize::MAX, 3),
            (usize::MAX % 3) as u32
        );
    }
}
