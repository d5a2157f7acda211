//! `Ddp`: the reducer. Gradients are copied into buckets as they become ready; a full bucket is
//! handed at once to the communication thread, which reduces buckets in bucket order (the same
//! order on every rank) while the caller's thread goes on with the backward pass. The thread
//! reduces on a group of its own over the wrapped group's ranks, so the caller may run
//! collectives on the wrapped group meanwhile.

pub(crate) mod bucket;
pub(crate) mod hooks;

use std::sync::Arc;
use std::sync::mpsc::{self, Receiver, Sender};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use dist_collective::ProcessGroup;

use crate::{Error, Result};
use bucket::{BucketLayout, BucketSpec};
use hooks::{AllReduceMean, Bucket, CommHook};

/// One parameter of the model: its name (for error messages) and shape.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParamInfo {
    /// Name, e.g. `"fc1.weight"`.
    pub name: String,
    /// Shape; its product is the element count.
    pub shape: Vec<usize>,
}

impl ParamInfo {
    /// A parameter with this name and shape.
    pub fn new(name: impl Into<String>, shape: &[usize]) -> Self {
        ParamInfo {
            name: name.into(),
            shape: shape.to_vec(),
        }
    }

    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

/// DDP settings; the defaults are torch's.
#[derive(Clone, Debug)]
pub struct DdpOptions {
    /// Bucket size cap in MiB (torch: 25).
    pub bucket_cap_mb: f64,
    /// Cap of the first bucket in MiB (torch: 1), so the first all-reduce starts early.
    pub first_bucket_mb: f64,
    /// Accept parameters that get no gradient in a step (they count as zero).
    pub find_unused_parameters: bool,
    /// Whether [`Ddp::sync_buffers`] broadcasts rank 0's buffers.
    pub broadcast_buffers: bool,
    /// Rebuild the buckets after the first step in the order gradients actually arrived.
    pub rebuild_buckets: bool,
}

impl Default for DdpOptions {
    fn default() -> Self {
        DdpOptions {
            bucket_cap_mb: 25.0,
            first_bucket_mb: 1.0,
            find_unused_parameters: false,
            broadcast_buffers: true,
            rebuild_buckets: true,
        }
    }
}

/// What the last synchronised step cost.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct StepStats {
    /// Buckets reduced.
    pub buckets: usize,
    /// Time the hook spent reducing buckets (on the communication thread).
    pub comm: Duration,
    /// Time [`Ddp::finish`] waited for communication that had not finished by then.
    pub exposed: Duration,
}

impl StepStats {
    /// Share of the communication time hidden behind the backward pass, in [0, 1].
    pub fn hidden_fraction(&self) -> f64 {
        if self.comm.is_zero() {
            return 1.0;
        }
        (1.0 - self.exposed.as_secs_f64() / self.comm.as_secs_f64()).clamp(0.0, 1.0)
    }
}

enum Job {
    Reduce {
        index: usize,
        data: Vec<f32>,
        spec: BucketSpec,
    },
    SetHook(Box<dyn CommHook>),
}

struct Done {
    index: usize,
    data: Vec<f32>,
    result: dist_collective::Result<()>,
    took: Duration,
}

/// Distributed data parallelism over a process group (torch's `DistributedDataParallel`).
///
/// Per step: call [`Ddp::mark_ready`] for each parameter as its gradient becomes available (in
/// any order; reverse registration order is what a backward pass produces), then
/// [`Ddp::finish`], which waits for the buckets and writes the averaged gradients back.
/// Gradients are `f32`.
pub struct Ddp {
    pg: ProcessGroup,
    params: Vec<ParamInfo>,
    opts: DdpOptions,
    layout: BucketLayout,
    /// The layout rebuilt after the first step, applied when the next step starts (so the
    /// current step's reduced gradients stay readable in place until then).
    next_layout: Option<BucketLayout>,
    bufs: Vec<Option<Vec<f32>>>,
    pending: Vec<usize>,
    next_launch: usize,
    marked: Vec<bool>,
    arrival: Vec<usize>,
    sync: bool,
    steps: u64,
    stats: StepStats,
    /// Why this DDP refuses further steps: one ended with parameters unused on this rank
    /// (without `find_unused_parameters`), after which the ranks are out of step.
    failed: Option<String>,
    tx: Option<Sender<Job>>,
    rx: Receiver<Done>,
    thread: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for Ddp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ddp")
            .field("rank", &self.pg.rank())
            .field("buckets", &self.layout.buckets.len())
            .finish()
    }
}

impl Ddp {
    /// Wraps a model: broadcasts rank 0's parameter values into `values` (one slice per
    /// parameter, in `params` order) so every rank starts equal, lays out the buckets in
    /// reverse registration order and starts the communication thread, over a new group of
    /// `pg`'s ranks (a group creation of `pg`: every rank calls this in the same order as its
    /// other group creations).
    pub fn new(
        pg: ProcessGroup,
        params: Vec<ParamInfo>,
        opts: DdpOptions,
        values: &mut [&mut [f32]],
    ) -> Result<Self> {
        let rank = pg.rank();
        // Every rank says whether its own slices are wrong before the broadcast, so that a
        // mistake on one rank fails every rank at once, not only that one while the others
        // wait in the broadcast until their timeout.
        let own = check_slices(rank, "new", &params, values.iter().map(|v| v.len()));
        let mut wrong = [u32::from(own.is_err())];
        pg.all_reduce(&mut wrong, dist_collective::ReduceOp::Max)?;
        own?;
        if wrong[0] != 0 {
            return Err(Error::InvalidArgument {
                rank,
                op: "new",
                reason: "another rank's parameter values do not match the parameter list \
                         (its own error says how)"
                    .into(),
            });
        }
        let mut flat: Vec<f32> = values.iter().flat_map(|v| v.iter().copied()).collect();
        pg.broadcast(&mut flat, 0)?;
        let mut at = 0;
        for v in values.iter_mut() {
            dist_wire::copy::bulk_of(v, &flat[at..at + v.len()]);
            at += v.len();
        }
        let order: Vec<usize> = (0..params.len()).rev().collect();
        let layout = layout_for(&params, &opts, &order);
        let (tx, job_rx) = mpsc::channel::<Job>();
        let (done_tx, rx) = mpsc::channel::<Done>();
        let shapes: Arc<Vec<Vec<usize>>> =
            Arc::new(params.iter().map(|p| p.shape.clone()).collect());
        // The communication thread reduces on a group of its own over the same ranks. On the
        // caller's group its collectives and the caller's own (SyncBatchNorm's in the backward
        // pass, a second model's) would be issued from two threads, in an order that may
        // differ between ranks: a mismatch, or two same-sized reductions silently swapped.
        let everyone: Vec<usize> = (0..pg.world_size()).collect();
        let comm_pg = pg.new_group(&everyone)?.ok_or_else(|| Error::CommThread {
            rank,
            reason: "its group does not hold this rank".into(),
        })?;
        let thread = std::thread::Builder::new()
            .name(format!("dist-ddp-comm-{rank}"))
            .spawn(move || comm_loop(comm_pg, shapes, job_rx, done_tx))
            .map_err(|e| Error::CommThread {
                rank,
                reason: e.to_string(),
            })?;
        let total: usize = params.iter().map(ParamInfo::numel).sum();
        let sizes: Vec<String> = layout
            .buckets
            .iter()
            .map(|b| format!("{:.2}", b.len as f64 * 4.0 / (1 << 20) as f64))
            .collect();
        tracing::info!(
            "DDP initialised: rank {rank}/{world}, backend {backend}, {n} parameters ({total} elements, {mb:.1} MiB), {nb} buckets of [{sizes}] MiB, cap {cap} MiB (first {first} MiB), find_unused_parameters={fu}",
            world = pg.world_size(),
            backend = pg.backend(),
            n = params.len(),
            mb = total as f64 * 4.0 / (1 << 20) as f64,
            nb = layout.buckets.len(),
            sizes = sizes.join(", "),
            cap = opts.bucket_cap_mb,
            first = opts.first_bucket_mb,
            fu = opts.find_unused_parameters,
        );
        let mut ddp = Ddp {
            pg,
            marked: vec![false; params.len()],
            params,
            opts,
            layout,
            next_layout: None,
            bufs: Vec::new(),
            pending: Vec::new(),
            next_launch: 0,
            arrival: Vec::new(),
            sync: true,
            steps: 0,
            stats: StepStats::default(),
            failed: None,
            tx: Some(tx),
            rx,
            thread: Some(thread),
        };
        ddp.reset_step();
        Ok(ddp)
    }

    /// Replaces the communication hook (default [`AllReduceMean`]). Call between steps.
    pub fn register_comm_hook(&mut self, hook: Box<dyn CommHook>) -> Result<()> {
        self.send(Job::SetHook(hook))
    }

    /// The bucket layout the next step uses.
    pub fn layout(&self) -> &BucketLayout {
        self.next_layout.as_ref().unwrap_or(&self.layout)
    }

    /// Statistics of the last synchronised step.
    pub fn last_step(&self) -> StepStats {
        self.stats
    }

    /// The process group.
    pub fn process_group(&self) -> &ProcessGroup {
        &self.pg
    }

    /// One line like torch's DDP init log: world size, backend, buckets, parameters.
    pub fn summary(&self) -> String {
        let total: usize = self.params.iter().map(ParamInfo::numel).sum();
        format!(
            "DDP: world size {}, backend {}, {} parameters ({:.1} MiB), {} buckets (cap {} MiB, first {} MiB)",
            self.pg.world_size(),
            self.pg.backend(),
            self.params.len(),
            total as f64 * 4.0 / (1 << 20) as f64,
            self.layout.buckets.len(),
            self.opts.bucket_cap_mb,
            self.opts.first_bucket_mb
        )
    }

    /// Runs `f` with gradient synchronisation off (torch's `no_sync()`): `mark_ready` and
    /// `finish` do nothing, so gradients accumulate in the caller's buffers and are averaged at
    /// the next synchronised step.
    pub fn no_sync<R>(&mut self, f: impl FnOnce(&mut Self) -> R) -> R {
        let was = std::mem::replace(&mut self.sync, false);
        let r = f(self);
        self.sync = was;
        r
    }

    /// Broadcasts rank 0's buffers (batch-norm statistics and the like) to every rank, if
    /// `broadcast_buffers` is on. Call before the forward pass, as torch does.
    pub fn sync_buffers(&self, buffers: &mut [&mut [f32]]) -> Result<()> {
        if !self.opts.broadcast_buffers {
            return Ok(());
        }
        for b in buffers.iter_mut() {
            self.pg.broadcast(b, 0)?;
        }
        Ok(())
    }

    /// Records that parameter `index`'s gradient is ready and copies it into its bucket; when
    /// the bucket is full (and every earlier bucket has been launched) its reduction starts.
    pub fn mark_ready(&mut self, index: usize, grad: &[f32]) -> Result<()> {
        self.ready("mark_ready", index, Some(grad))
    }

    /// The memory of parameter `index`'s gradient inside its bucket (torch's
    /// `gradient_as_bucket_view`): a framework that writes gradients here and then calls
    /// [`Ddp::mark_ready_in_place`] and [`Ddp::finish_in_place`] saves the copy into the bucket
    /// and the copy back. Its content is whatever was there last (the previous step's averaged
    /// gradient): write the whole gradient.
    pub fn grad_buffer_mut(&mut self, index: usize) -> Result<&mut [f32]> {
        self.begin_step();
        let rank = self.pg.rank();
        let numel = self.param(index, "grad_buffer_mut")?.numel();
        let (b, off) = self.layout.location[index];
        match self.bufs[b].as_mut() {
            Some(buf) if !self.marked[index] => Ok(&mut buf[off..off + numel]),
            _ => Err(Error::InvalidArgument {
                rank,
                op: "grad_buffer_mut",
                reason: format!(
                    "{} is already marked ready in this step",
                    self.params[index].name
                ),
            }),
        }
    }

    /// Like [`Ddp::mark_ready`] for a gradient already written through
    /// [`Ddp::grad_buffer_mut`].
    pub fn mark_ready_in_place(&mut self, index: usize) -> Result<()> {
        self.ready("mark_ready_in_place", index, None)
    }

    /// The averaged gradient of parameter `index` after [`Ddp::finish_in_place`] (until the next
    /// step starts writing).
    pub fn grad(&self, index: usize) -> Option<&[f32]> {
        let (b, off) = *self.layout.location.get(index)?;
        let buf = self.bufs.get(b)?.as_ref()?;
        Some(&buf[off..off + self.params[index].numel()])
    }

    fn param(&self, index: usize, op: &'static str) -> Result<&ParamInfo> {
        self.params
            .get(index)
            .ok_or_else(|| Error::InvalidArgument {
                rank: self.pg.rank(),
                op,
                reason: format!("no parameter {index} (the model has {})", self.params.len()),
            })
    }

    /// Applies a rebuilt layout when a step starts.
    fn begin_step(&mut self) {
        if self.arrival.is_empty()
            && let Some(layout) = self.next_layout.take()
        {
            self.layout = layout;
            self.bufs.clear();
            self.reset_step();
        }
    }

    /// Fails once a step ended in a way that leaves the ranks out of step (`failed`).
    fn check_usable(&self, op: &'static str) -> Result<()> {
        match &self.failed {
            Some(reason) => Err(Error::InvalidArgument {
                rank: self.pg.rank(),
                op,
                reason: reason.clone(),
            }),
            None => Ok(()),
        }
    }

    fn ready(&mut self, op: &'static str, index: usize, grad: Option<&[f32]>) -> Result<()> {
        if !self.sync {
            return Ok(());
        }
        self.check_usable(op)?;
        self.begin_step();
        let rank = self.pg.rank();
        let p = self.param(index, op)?;
        if let Some(g) = grad
            && g.len() != p.numel()
        {
            return Err(Error::InvalidArgument {
                rank,
                op,
                reason: format!(
                    "gradient of {} has {} elements, the parameter has {}",
                    p.name,
                    g.len(),
                    p.numel()
                ),
            });
        }
        if self.marked[index] {
            return Err(Error::InvalidArgument {
                rank,
                op,
                reason: format!("{} was marked ready twice in one step", p.name),
            });
        }
        self.marked[index] = true;
        self.arrival.push(index);
        let (b, off) = self.layout.location[index];
        if let Some(g) = grad {
            let buf = self.bufs[b]
                .as_mut()
                .expect("a bucket is only launched once all its gradients are in");
            dist_wire::copy::bulk_of(&mut buf[off..off + g.len()], g);
        }
        self.pending[b] -= 1;
        self.launch_ready()
    }

    /// Waits for every bucket and writes the averaged gradients into `grads` (one slice per
    /// parameter, in `params` order).
    pub fn finish(&mut self, grads: &mut [&mut [f32]]) -> Result<()> {
        if !self.sync {
            return Ok(());
        }
        check_slices(
            self.pg.rank(),
            "finish",
            &self.params,
            grads.iter().map(|g| g.len()),
        )?;
        self.finish_step(Some(grads))
    }

    /// Like [`Ddp::finish`], leaving the averaged gradients in the buckets, readable through
    /// [`Ddp::grad`] (or the slices of [`Ddp::grad_buffer_mut`]).
    pub fn finish_in_place(&mut self) -> Result<()> {
        if !self.sync {
            return Ok(());
        }
        self.finish_step(None)
    }

    fn finish_step(&mut self, mut grads: Option<&mut [&mut [f32]]>) -> Result<()> {
        self.check_usable("finish")?;
        self.begin_step();
        let rank = self.pg.rank();
        let unused: Vec<usize> = (0..self.params.len())
            .filter(|&i| !self.marked[i])
            .collect();
        if !unused.is_empty() {
            if !self.opts.find_unused_parameters {
                let names: Vec<String> = unused
                    .iter()
                    .map(|&i| self.params[i].name.clone())
                    .collect();
                // Ranks that did use them launched their buckets and wait in reductions this
                // rank never joins: a later step of this rank would meet those, and average
                // one step's gradients with another's wherever the sizes matched.
                self.failed = Some(format!(
                    "an earlier step ended with parameter(s) {names:?} unused on this rank, \
                     while ranks that used them may still be reducing that step; re-create \
                     the group and DDP (find_unused_parameters=true accepts unused parameters)"
                ));
                let drained = self.drain(|_, _| {});
                self.reset_step();
                drained?;
                return Err(Error::UnusedParameters { rank, names });
            }
            // An unused parameter contributes a zero gradient on this rank.
            for i in unused {
                self.grad_buffer_mut(i)?.fill(0.0);
                self.mark_ready_in_place(i)?;
                self.arrival.pop();
            }
        }
        let numels: Vec<usize> = self.params.iter().map(ParamInfo::numel).collect();
        let drained = self.drain(|spec, data| {
            if let Some(grads) = grads.as_deref_mut() {
                for (&p, &off) in spec.params.iter().zip(&spec.offsets) {
                    dist_wire::copy::bulk_of(grads[p], &data[off..off + numels[p]]);
                }
            }
        });
        // A failed step still ends: the next one starts afresh (and fails on the group's
        // own error if the group is aborted), not on "marked ready twice".
        let (comm, exposed) = match drained {
            Ok(times) => times,
            Err(e) => {
                self.reset_step();
                return Err(e);
            }
        };
        self.stats = StepStats {
            buckets: self.layout.buckets.len(),
            comm,
            exposed,
        };
        self.steps += 1;
        if self.steps == 1 && self.opts.rebuild_buckets {
            self.rebuild()?;
        }
        self.reset_step();
        Ok(())
    }

    /// Rebuilds the buckets in the order gradients arrived in the first step, as rank 0 saw it
    /// (broadcast, so every rank builds the same buckets).
    fn rebuild(&mut self) -> Result<()> {
        let mut order: Vec<u64> = self.arrival.iter().map(|&i| i as u64).collect();
        order.resize(self.params.len(), u64::MAX);
        self.pg.broadcast(&mut order, 0)?;
        let order: Vec<usize> = order
            .into_iter()
            .filter(|&i| i != u64::MAX)
            .map(|i| i as usize)
            .collect();
        if order.len() != self.params.len() {
            return Ok(());
        }
        let layout = layout_for(&self.params, &self.opts, &order);
        if layout != self.layout {
            tracing::info!(
                rank = self.pg.rank(),
                buckets = layout.buckets.len(),
                "DDP rebuilt buckets in gradient arrival order"
            );
            self.next_layout = Some(layout);
        }
        Ok(())
    }

    fn reset_step(&mut self) {
        let nb = self.layout.buckets.len();
        if self.bufs.len() != nb {
            self.bufs = self
                .layout
                .buckets
                .iter()
                .map(|b| Some(vec![0.0; b.len]))
                .collect();
        }
        // A bucket whose reduction never came back (its hook panicked and took the
        // communication thread with it) gets a fresh buffer, so that the next step's
        // `mark_ready` reports the thread's end instead of panicking on the missing one.
        for (buf, spec) in self.bufs.iter_mut().zip(&self.layout.buckets) {
            buf.get_or_insert_with(|| vec![0.0; spec.len]);
        }
        self.pending = self.layout.buckets.iter().map(|b| b.params.len()).collect();
        self.next_launch = 0;
        self.marked.iter_mut().for_each(|m| *m = false);
        self.arrival.clear();
    }

    fn launch_ready(&mut self) -> Result<()> {
        while self.next_launch < self.layout.buckets.len() && self.pending[self.next_launch] == 0 {
            let index = self.next_launch;
            let data = self.bufs[index].take().expect("launched once");
            let spec = self.layout.buckets[index].clone();
            self.send(Job::Reduce { index, data, spec })?;
            self.next_launch += 1;
        }
        Ok(())
    }

    /// Collects every launched bucket, in order.
    /// Collects every launched bucket in order, handing each to `on_done` as soon as it
    /// arrives (so copying bucket i back overlaps the reduction of bucket i + 1). Returns the
    /// hooks' total time and the time spent blocked waiting for them.
    fn drain(
        &mut self,
        mut on_done: impl FnMut(&BucketSpec, &[f32]),
    ) -> Result<(Duration, Duration)> {
        let rank = self.pg.rank();
        let mut first_err = None;
        let (mut comm, mut blocked) = (Duration::ZERO, Duration::ZERO);
        for _ in 0..self.next_launch {
            let t0 = Instant::now();
            let d = self.rx.recv().map_err(|_| Error::CommThread {
                rank,
                reason: "it exited".into(),
            })?;
            blocked += t0.elapsed();
            comm += d.took;
            match d.result {
                Err(e) => {
                    first_err.get_or_insert(e);
                }
                Ok(()) if first_err.is_none() => on_done(&self.layout.buckets[d.index], &d.data),
                Ok(()) => {}
            }
            self.bufs[d.index] = Some(d.data);
        }
        self.next_launch = 0;
        match first_err {
            Some(e) => Err(e.into()),
            None => Ok((comm, blocked)),
        }
    }

    fn send(&self, job: Job) -> Result<()> {
        let rank = self.pg.rank();
        self.tx
            .as_ref()
            .and_then(|tx| tx.send(job).ok())
            .ok_or_else(|| Error::CommThread {
                rank,
                reason: "it is not running".into(),
            })
    }
}

impl Drop for Ddp {
    fn drop(&mut self) {
        self.tx = None;
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn layout_for(params: &[ParamInfo], opts: &DdpOptions, order: &[usize]) -> BucketLayout {
    let numels: Vec<usize> = params.iter().map(ParamInfo::numel).collect();
    let mib = |m: f64| ((m * (1 << 20) as f64) as usize).max(4);
    BucketLayout::assign(
        order,
        &numels,
        4,
        mib(opts.first_bucket_mb),
        mib(opts.bucket_cap_mb),
    )
}

fn check_slices(
    rank: usize,
    op: &'static str,
    params: &[ParamInfo],
    lens: impl ExactSizeIterator<Item = usize>,
) -> Result<()> {
    if lens.len() != params.len() {
        return Err(Error::InvalidArgument {
            rank,
            op,
            reason: format!("{} slices for {} parameters", lens.len(), params.len()),
        });
    }
    for (p, len) in params.iter().zip(lens) {
        if len != p.numel() {
            return Err(Error::InvalidArgument {
                rank,
                op,
                reason: format!("{} has {} elements, its slice {len}", p.name, p.numel()),
            });
        }
    }
    Ok(())
}

fn comm_loop(
    pg: ProcessGroup,
    shapes: Arc<Vec<Vec<usize>>>,
    jobs: Receiver<Job>,
    done: Sender<Done>,
) {
    let mut hook: Box<dyn CommHook> = Box::new(AllReduceMean);
    while let Ok(job) = jobs.recv() {
        match job {
            Job::SetHook(h) => hook = h,
            Job::Reduce {
                index,
                mut data,
                spec,
            } => {
                let t0 = Instant::now();
                let mut b = Bucket {
                    index,
                    data: &mut data,
                    params: &spec.params,
                    offsets: &spec.offsets,
                    shapes: &shapes,
                };
                let result = hook.reduce(&pg, &mut b);
                if done
                    .send(Done {
                        index,
                        data,
                        result,
                        took: t0.elapsed(),
                    })
                    .is_err()
                {
                    return;
                }
            }
        }
    }
}
