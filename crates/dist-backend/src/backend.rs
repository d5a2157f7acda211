//! The `Backend` trait.

use std::time::Duration;

use dist_wire::{DType, ReduceOp};

use crate::{BufMut, BufRef, Result};

/// Default time an operation waits for its peers (torch's default for Gloo is 30 min; ours is
/// shorter because a silent hang is the failure users hate most).
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);

/// Per-operation options.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OpOptions {
    /// How long to wait for peers before failing with `Timeout`.
    pub timeout: Duration,
    /// Tag that matches a `send` with its `recv`; ignored by collectives.
    pub tag: u32,
    /// The collective's sequence number in its group, when the caller numbers them (the
    /// process group's one counter, shared by its executor, errors and flight recorder): the
    /// backend puts it in frame headers and errors instead of counting on its own. Every rank
    /// must number the same collective alike. `None`: the backend counts its collectives.
    pub seq: Option<u64>,
}

impl Default for OpOptions {
    fn default() -> Self {
        OpOptions {
            timeout: DEFAULT_TIMEOUT,
            tag: 0,
            seq: None,
        }
    }
}

impl OpOptions {
    /// Options with the given timeout and tag 0.
    pub fn with_timeout(timeout: Duration) -> Self {
        OpOptions {
            timeout,
            tag: 0,
            seq: None,
        }
    }
}

/// What a backend can serve.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Capabilities {
    /// Accepts [`BufRef::Host`]/[`BufMut::Host`].
    pub host_buffers: bool,
    /// Accepts [`BufRef::Device`]/[`BufMut::Device`].
    pub device_buffers: bool,
    /// Supports the bitwise reduce ops.
    pub bitwise_ops: bool,
    /// Supports `ReduceOp::PremulSum`.
    pub premul_sum: bool,
    /// Supports `send`/`recv`.
    pub point_to_point: bool,
    /// Answers [`Backend::probe`].
    pub probe: bool,
}

impl Capabilities {
    /// What a CPU backend that serves everything reports.
    pub const HOST_ALL: Capabilities = Capabilities {
        host_buffers: true,
        device_buffers: false,
        bitwise_ops: true,
        premul_sum: true,
        point_to_point: true,
        probe: true,
    };
}

/// The operations of torch.distributed over type-erased buffers.
///
/// Counts are in elements of `dtype`; buffers are byte views whose lengths must equal
/// count × `dtype.size()`. See the crate docs for the contract.
pub trait Backend: Send + Sync {
    /// Short name: `"gloo"`, `"nccl"`.
    fn name(&self) -> &'static str;
    /// This process's rank in the group.
    fn rank(&self) -> usize;
    /// Number of ranks in the group.
    fn world_size(&self) -> usize;
    /// What this backend serves.
    fn capabilities(&self) -> Capabilities;

    /// Reduces `buf` across all ranks in place; every rank ends with the same bits.
    fn all_reduce(
        &self,
        buf: BufMut<'_>,
        dtype: DType,
        op: ReduceOp,
        opts: &OpOptions,
    ) -> Result<()>;

    /// Copies `root`'s `buf` into every other rank's `buf`.
    fn broadcast(&self, buf: BufMut<'_>, dtype: DType, root: usize, opts: &OpOptions)
    -> Result<()>;

    /// Reduces `buf` across all ranks into `root`'s `buf`; other ranks' buffers are left in an
    /// unspecified state (as in torch).
    fn reduce(
        &self,
        buf: BufMut<'_>,
        dtype: DType,
        op: ReduceOp,
        root: usize,
        opts: &OpOptions,
    ) -> Result<()>;

    /// Gathers every rank's `input` into `output`, rank by rank. `counts[r]` is rank r's element
    /// count (all equal for torch's `all_gather_into_tensor`); `input` holds `counts[rank]`.
    fn all_gather(
        &self,
        input: BufRef<'_>,
        output: BufMut<'_>,
        dtype: DType,
        counts: &[usize],
        opts: &OpOptions,
    ) -> Result<()>;

    /// Reduces `input` (the concatenation of every rank's share, `counts[r]` elements for rank
    /// r) across ranks and leaves this rank's share in `output`.
    fn reduce_scatter(
        &self,
        input: BufRef<'_>,
        output: BufMut<'_>,
        dtype: DType,
        op: ReduceOp,
        counts: &[usize],
        opts: &OpOptions,
    ) -> Result<()>;

    /// Sends `send_counts[r]` elements of `input` (in rank order) to each rank r and receives
    /// `recv_counts[r]` elements from each rank r into `output` (in rank order).
    fn all_to_all(
        &self,
        input: BufRef<'_>,
        output: BufMut<'_>,
        dtype: DType,
        send_counts: &[usize],
        recv_counts: &[usize],
        opts: &OpOptions,
    ) -> Result<()>;

    /// [`all_to_all`](Backend::all_to_all) where every rank sends every rank `count` elements
    /// (torch's `all_to_all_single` without split sizes, `MPI_Alltoall`), and every rank of
    /// the group calls this form for this operation. Then every rank knows every other rank's
    /// counts, so a backend may run an algorithm that needs them (the uneven form's counts
    /// are known only to the ranks they concern). A rank that calls the uneven form where
    /// another calls this one may fail both with a mismatch. The default runs the uneven form
    /// with even counts.
    fn all_to_all_even(
        &self,
        input: BufRef<'_>,
        output: BufMut<'_>,
        dtype: DType,
        count: usize,
        opts: &OpOptions,
    ) -> Result<()> {
        let counts = vec![count; self.world_size()];
        self.all_to_all(input, output, dtype, &counts, &counts, opts)
    }

    /// Gathers every rank's `input` (equal counts) into `root`'s `output`; `output` is `None` on
    /// every other rank.
    fn gather(
        &self,
        input: BufRef<'_>,
        output: Option<BufMut<'_>>,
        dtype: DType,
        root: usize,
        opts: &OpOptions,
    ) -> Result<()>;

    /// Scatters `root`'s `input` (world_size equal shares) into every rank's `output`; `input` is
    /// `None` on every other rank.
    fn scatter(
        &self,
        input: Option<BufRef<'_>>,
        output: BufMut<'_>,
        dtype: DType,
        root: usize,
        opts: &OpOptions,
    ) -> Result<()>;

    /// Returns once every rank has entered the barrier.
    fn barrier(&self, opts: &OpOptions) -> Result<()>;

    /// Sends `buf` to rank `dst`, matched by `opts.tag`.
    fn send(&self, buf: BufRef<'_>, dtype: DType, dst: usize, opts: &OpOptions) -> Result<()>;

    /// Receives into `buf` from rank `src`, matched by `opts.tag`.
    fn recv(&self, buf: BufMut<'_>, dtype: DType, src: usize, opts: &OpOptions) -> Result<()>;

    /// Whether a `recv` from `src` with `tag` would start without waiting for the sender: a
    /// message with that tag has begun to arrive, or the connection to `src` is gone (so the
    /// `recv` fails at once). Never blocks; reads ahead whatever has arrived (MPI's `Iprobe`).
    /// Backends that cannot tell report [`Capabilities::probe`] `false` and return
    /// [`crate::Error::Unsupported`].
    fn probe(&self, src: usize, tag: u32) -> Result<bool> {
        let _ = (src, tag);
        Err(crate::Error::Unsupported {
            rank: self.rank(),
            backend: self.name(),
            what: "probe".into(),
        })
    }

    /// A handle that ends a [`Backend::wait_for_arrival`] in progress (or the next one, if none
    /// is) from any thread: a caller that waits for messages on one thread and is handed new
    /// work on another wakes the first with it. `None` where the backend cannot wait for
    /// arrivals ([`Backend::wait_for_arrival`] is then unsupported), as is the default.
    fn arrival_waker(&self) -> Option<std::task::Waker> {
        None
    }

    /// Sleeps until something may have arrived from some peer (a message worth a
    /// [`Backend::probe`], or a peer gone), the [`Backend::arrival_waker`] is woken, or `timeout`
    /// passes; it may also return early for no reason, so callers probe again and decide.
    /// Bytes read from any peer since the last wait ended (by probes, by operations, or by
    /// this call's own look at every link) end it at once: a probe for one message may read
    /// another whose own probe came first and found nothing, so a caller that probes each
    /// receive it waits for between waits never sleeps on a message already here (MPI's
    /// blocking `Probe`, without saying which message). Backends without an arrival waker
    /// return [`crate::Error::Unsupported`].
    fn wait_for_arrival(&self, timeout: Duration) -> Result<()> {
        let _ = timeout;
        Err(crate::Error::Unsupported {
            rank: self.rank(),
            backend: self.name(),
            what: "waiting for arrivals".into(),
        })
    }

    /// Leaves the group: says goodbye to every peer (so that they can tell this exit from a
    /// crash) and starts closing the connections; later operations fail. Idempotent;
    /// dropping the backend does the same. A backend that failed (and so aborted its group)
    /// only releases its connections. The default does nothing.
    fn close(&self) {}
}
