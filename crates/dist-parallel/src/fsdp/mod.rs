//! `Fsdp`: fully sharded data parallelism in the manner of torch's FSDP2 (`fully_shard`).
//!
//! Each parameter is split on dim 0 over the shard group ([`ShardLayout`] `Shard(0)`, with
//! `Replicate` over a replicate dimension for HSDP). Every rank keeps only its shard of the
//! parameters, the gradients and (the caller's) optimizer state, all `f32`. Parameters are
//! grouped into *units* (a layer, a block): a unit's parameters are all-gathered into one flat
//! buffer just before its forward and backward and freed after them, and its gradients are
//! reduce-scattered (averaged) into the shards after its backward.
//!
//! Like [`Ddp`](crate::Ddp), the core is framework-agnostic and works on flat buffers: the
//! gathered unit is one slice holding its parameters whole, one after another
//! ([`Fsdp::param_range`]), and the backward hands the unit's gradients back in the same
//! layout. The caller drives the schedule:
//!
//! ```text
//! for u in 0..units      { let w = fsdp.pre_forward(u)?;  ...forward...;  fsdp.post_forward(u)?; }
//! for u in (0..units).rev() { let w = fsdp.pre_backward(u)?; ...backward...; fsdp.post_backward(u, &grads)?; }
//! fsdp.finish()?;   // every gradient shard is now averaged
//! for s in fsdp.shards_mut() { optimizer.step(s.param, s.grad) }
//! ```
//!
//! Communication overlaps computation on async [`Work`]: `pre_forward(u)` also issues the
//! all-gathers of the next [`FsdpOptions::prefetch`] units (and `pre_backward` those of the
//! previous ones), and `post_backward` leaves the reduce-scatter running while the backward
//! goes on; at most `prefetch + 1` units are gathered and `prefetch + 1` reduce-scatters in
//! flight, so memory stays bounded.

#[cfg(feature = "candle")]
mod candle;
mod comm;
pub(crate) mod precision;
pub(crate) mod unit;

use std::collections::VecDeque;
use std::marker::PhantomData;
use std::ops::Range;
use std::time::{Duration, Instant};

use dist_collective::{Chunk, DeviceMesh, Placement, ProcessGroup, ReduceOp, ShardLayout, Work};

use crate::checkpoint::{LocalTensor, LocalTensorMut};
use crate::{Error, ParamInfo, Result};
use comm::{Dim, GradWork, busy_time, divided_for_sum};
use precision::{ComputeElement, ReduceDtype, convert};
use unit::UnitLayout;

#[cfg(feature = "candle")]
pub use candle::CandleFsdp;

/// FSDP settings; the defaults are torch's.
#[derive(Clone, Debug)]
pub struct FsdpOptions {
    /// Free a unit's gathered parameters after its forward and gather them again for its
    /// backward (torch: `reshard_after_forward=True`). Off keeps them from the forward to the
    /// backward: less communication, more memory.
    pub reshard_after_forward: bool,
    /// How many units ahead the forward and the backward issue all-gathers (torch prefetches 1).
    /// It also bounds the reduce-scatters in flight to `prefetch + 1`.
    pub prefetch: usize,
    /// The type gradients are reduced in.
    pub reduce_dtype: ReduceDtype,
}

impl Default for FsdpOptions {
    fn default() -> Self {
        FsdpOptions {
            reshard_after_forward: true,
            prefetch: 1,
            reduce_dtype: ReduceDtype::Compute,
        }
    }
}

/// What the last step's communication cost (see [`Fsdp::finish`]).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct FsdpStepStats {
    /// All-gathers issued.
    pub all_gathers: usize,
    /// Reduce-scatters issued (and, for HSDP, as many all-reduces).
    pub reduce_scatters: usize,
    /// Time the groups' workers spent running this step's collectives.
    pub comm: Duration,
    /// Time the caller's thread was blocked waiting for them.
    pub exposed: Duration,
}

impl FsdpStepStats {
    /// Share of the communication time hidden behind computation, in [0, 1].
    pub fn hidden_fraction(&self) -> f64 {
        if self.comm.is_zero() {
            return 1.0;
        }
        (1.0 - self.exposed.as_secs_f64() / self.comm.as_secs_f64()).clamp(0.0, 1.0)
    }
}

/// Bytes held by one rank, counted as they are allocated and freed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FsdpMemory {
    /// Parameter shards (`f32`, padded to the largest rank's piece).
    pub param_shards: usize,
    /// Gradient shards (`f32`, padded likewise).
    pub grad_shards: usize,
    /// Unsharded gradients kept between steps without gradient sync (`no_sync`).
    pub accumulated: usize,
    /// Gathered and reduce-scatter buffers in flight now.
    pub in_flight: usize,
    /// The most `in_flight` has been since the last [`Fsdp::reset_peak`].
    pub peak_in_flight: usize,
}

/// A whole model: `(name, values)` per parameter, in unit order.
pub type StateDict = Vec<(String, Vec<f32>)>;

/// One parameter's local shard, for the optimizer (see [`Fsdp::shards_mut`]).
#[derive(Debug)]
pub struct ShardMut<'a> {
    /// The parameter's name.
    pub name: &'a str,
    /// Its layout over the mesh.
    pub layout: &'a ShardLayout,
    /// The box of the global tensor this rank holds.
    pub chunk: Chunk,
    /// This rank's values (`chunk.numel()` elements, row-major).
    pub param: &'a mut [f32],
    /// This rank's averaged gradient, same layout.
    pub grad: &'a mut [f32],
}

enum Gather<C> {
    Sharded,
    Gathering(Work<Vec<C>>),
    Gathered(Vec<C>),
}

/// Fully sharded data parallelism over a shard group, optionally replicated across a second
/// mesh dimension (HSDP). `C` is the compute type parameters are gathered in (`f32`, or
/// `half::bf16` / `half::f16` for mixed precision); shards are always `f32`.
pub struct Fsdp<C: ComputeElement = f32> {
    shard_pg: ProcessGroup,
    replicate_pg: Option<ProcessGroup>,
    coord: Vec<usize>,
    opts: FsdpOptions,
    units: Vec<UnitLayout>,
    shards: Vec<Vec<f32>>,
    grads: Vec<Vec<f32>>,
    state: Vec<Gather<C>>,
    no_sync_acc: Vec<Option<Vec<f32>>>,
    reduce_scatters: VecDeque<(usize, GradWork<C>)>,
    all_reduces: VecDeque<(usize, GradWork<C>)>,
    sync: bool,
    stats: FsdpStepStats,
    seqs: Vec<(Dim, u64)>,
    mem: FsdpMemory,
    _compute: PhantomData<C>,
}

impl<C: ComputeElement> std::fmt::Debug for Fsdp<C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Fsdp")
            .field("rank", &self.shard_pg.rank())
            .field("units", &self.units.len())
            .field("compute", &C::DTYPE)
            .finish()
    }
}

impl<C: ComputeElement> Fsdp<C> {
    /// Shards a model over `pg`. `units` groups the parameters (each unit's parameters are
    /// gathered together); `values` holds every parameter's initial values, unit by unit, in
    /// order. Rank 0's values are broadcast so every rank starts equal, then each rank keeps
    /// only its shard.
    pub fn new(
        pg: ProcessGroup,
        units: Vec<Vec<ParamInfo>>,
        opts: FsdpOptions,
        values: &[&[f32]],
    ) -> Result<Self> {
        let world = pg.world_size();
        let coord = vec![pg.rank()];
        Self::build(pg.clone(), None, pg, &[world], coord, units, opts, values)
    }

    /// HSDP: shards over mesh dimension `shard_dim` and replicates over `replicate_dim` of a
    /// 2-D mesh (reduce-scatter inside a shard group, all-reduce across replicas). Parameters
    /// are laid out `[Replicate, Shard(0)]` over the mesh `[replicate, shard]`.
    pub fn new_hybrid(
        mesh: &DeviceMesh,
        replicate_dim: &str,
        shard_dim: &str,
        units: Vec<Vec<ParamInfo>>,
        opts: FsdpOptions,
        values: &[&[f32]],
    ) -> Result<Self> {
        let rank = mesh.group().rank();
        let find = |name: &str| {
            mesh.dim_names()
                .iter()
                .position(|n| n == name)
                .ok_or_else(|| Error::Fsdp {
                    rank,
                    op: "new_hybrid",
                    tensor: "<mesh>".into(),
                    reason: format!(
                        "mesh has no dimension {name:?} (it has {:?})",
                        mesh.dim_names()
                    ),
                })
        };
        let (rd, sd) = (find(replicate_dim)?, find(shard_dim)?);
        if mesh.ndim() != 2 || rd == sd {
            return Err(Error::Fsdp {
                rank,
                op: "new_hybrid",
                tensor: "<mesh>".into(),
                reason: format!(
                    "HSDP needs a 2-D mesh and two different dimensions; got mesh {:?} {:?}, replicate {replicate_dim:?}, shard {shard_dim:?}",
                    mesh.dim_names(),
                    mesh.shape()
                ),
            });
        }
        let shape = [mesh.shape()[rd], mesh.shape()[sd]];
        let coord = vec![mesh.coordinate()[rd], mesh.coordinate()[sd]];
        Self::build(
            mesh.dim(shard_dim).clone(),
            Some(mesh.dim(replicate_dim).clone()),
            mesh.group().clone(),
            &shape,
            coord,
            units,
            opts,
            values,
        )
    }

    #[allow(clippy::too_many_arguments)]
    fn build(
        shard_pg: ProcessGroup,
        replicate_pg: Option<ProcessGroup>,
        whole: ProcessGroup,
        mesh_shape: &[usize],
        coord: Vec<usize>,
        units: Vec<Vec<ParamInfo>>,
        opts: FsdpOptions,
        values: &[&[f32]],
    ) -> Result<Self> {
        let rank = whole.rank();
        let bad = |tensor: &str, reason: String| Error::Fsdp {
            rank,
            op: "new",
            tensor: tensor.to_string(),
            reason,
        };
        let nparams: usize = units.iter().map(Vec::len).sum();
        if values.len() != nparams {
            return Err(bad(
                "<model>",
                format!(
                    "{} value slices for {nparams} parameters in {} units",
                    values.len(),
                    units.len()
                ),
            ));
        }
        let placements: Vec<Placement> = if mesh_shape.len() == 2 {
            vec![Placement::Replicate, Placement::Shard(0)]
        } else {
            vec![Placement::Shard(0)]
        };
        let world = shard_pg.world_size();
        let mut layouts = Vec::with_capacity(units.len());
        let mut shards = Vec::with_capacity(units.len());
        let mut at = 0;
        for (u, params) in units.into_iter().enumerate() {
            if params.is_empty() {
                return Err(bad(
                    &format!("unit {u}"),
                    "a unit needs at least one parameter".into(),
                ));
            }
            let mut pl = Vec::with_capacity(params.len());
            for (p, v) in params.iter().zip(&values[at..]) {
                if p.shape.is_empty() {
                    return Err(bad(
                        &p.name,
                        "a 0-D parameter cannot be sharded on dim 0; give a scalar the shape [1]"
                            .into(),
                    ));
                }
                if v.len() != p.numel() {
                    return Err(bad(
                        &p.name,
                        format!(
                            "shape {:?} has {} elements but its values have {}",
                            p.shape,
                            p.numel(),
                            v.len()
                        ),
                    ));
                }
                pl.push(ShardLayout::new(&p.shape, mesh_shape, &placements)?);
            }
            let layout = UnitLayout::new(params, pl, world, shard_pg.rank());
            // One broadcast per unit: every rank starts from rank 0's values, and ranks that
            // disagree on the unit's size fail here, naming the collective.
            let mut full: Vec<f32> = Vec::with_capacity(layout.full_len);
            for v in &values[at..at + layout.params.len()] {
                full.extend_from_slice(v);
            }
            whole.broadcast(&mut full, 0)?;
            let mut seg = vec![0.0; layout.seg_len];
            layout.segment_of(&full, shard_pg.rank(), &mut seg);
            at += layout.params.len();
            shards.push(seg);
            layouts.push(layout);
        }
        let n = layouts.len();
        let grads: Vec<Vec<f32>> = layouts.iter().map(|l| vec![0.0; l.seg_len]).collect();
        let bytes = shards.iter().map(|s| s.len() * 4).sum();
        tracing::info!(
            "FSDP initialised: rank {rank}, shard group of {world}{}, {n} units, {nparams} parameters, {:.1} MiB of shards per rank, compute {:?}",
            replicate_pg
                .as_ref()
                .map(|p| format!(" x {} replicas", p.world_size()))
                .unwrap_or_default(),
            bytes as f64 / (1 << 20) as f64,
            C::DTYPE,
        );
        Ok(Fsdp {
            shard_pg,
            replicate_pg,
            coord,
            opts,
            mem: FsdpMemory {
                param_shards: bytes,
                grad_shards: bytes,
                ..FsdpMemory::default()
            },
            units: layouts,
            shards,
            grads,
            state: (0..n).map(|_| Gather::Sharded).collect(),
            no_sync_acc: vec![None; n],
            reduce_scatters: VecDeque::new(),
            all_reduces: VecDeque::new(),
            sync: true,
            stats: FsdpStepStats::default(),
            seqs: Vec::new(),
            _compute: PhantomData,
        })
    }

    fn rank(&self) -> usize {
        self.shard_pg.rank()
    }

    fn check_unit(&self, op: &'static str, u: usize) -> Result<()> {
        if u < self.units.len() {
            return Ok(());
        }
        Err(Error::Fsdp {
            rank: self.rank(),
            op,
            tensor: format!("unit {u}"),
            reason: format!("the model has {} units", self.units.len()),
        })
    }

    /// Number of units.
    pub fn num_units(&self) -> usize {
        self.units.len()
    }

    /// The parameters of unit `u`, in the order they appear in its gathered buffer.
    pub fn unit_params(&self, u: usize) -> &[ParamInfo] {
        &self.units[u].params
    }

    /// Where parameter `i` of unit `u` lies in the unit's gathered buffer (and in the gradient
    /// buffer handed to [`post_backward`](Self::post_backward)).
    pub fn param_range(&self, u: usize, i: usize) -> Range<usize> {
        self.units[u].full_range(i)
    }

    /// Elements in unit `u`'s gathered buffer.
    pub fn unit_len(&self, u: usize) -> usize {
        self.units[u].full_len
    }

    /// This rank's coordinate on the mesh (`[shard rank]`, or `[replica, shard rank]` for HSDP).
    pub fn coordinate(&self) -> &[usize] {
        &self.coord
    }

    /// Memory held now, and the peak of the buffers in flight.
    pub fn memory(&self) -> FsdpMemory {
        self.mem
    }

    /// Starts a new peak measurement of [`FsdpMemory::peak_in_flight`].
    pub fn reset_peak(&mut self) {
        self.mem.peak_in_flight = self.mem.in_flight;
    }

    fn grow(&mut self, bytes: usize) {
        self.mem.in_flight += bytes;
        self.mem.peak_in_flight = self.mem.peak_in_flight.max(self.mem.in_flight);
    }

    fn shrink(&mut self, bytes: usize) {
        self.mem.in_flight = self.mem.in_flight.saturating_sub(bytes);
    }

    fn issue_gather(&mut self, u: usize) -> Result<()> {
        if !matches!(self.state[u], Gather::Sharded) {
            return Ok(());
        }
        let seg: Vec<C> = self.shards[u].iter().map(|&x| C::from_f32(x)).collect();
        let l = &self.units[u];
        let bytes = l.seg_len * (self.shard_pg.world_size() + 1) * size_of::<C>();
        let work = self.shard_pg.all_gather_async(seg)?;
        self.seqs.push((Dim::Shard, work.seq()));
        self.stats.all_gathers += 1;
        self.state[u] = Gather::Gathering(work);
        self.grow(bytes);
        Ok(())
    }

    fn gathered(&mut self, u: usize) -> Result<&[C]> {
        self.issue_gather(u)?;
        if let Gather::Gathering(_) = self.state[u] {
            let Gather::Gathering(work) = std::mem::replace(&mut self.state[u], Gather::Sharded)
            else {
                unreachable!("matched above")
            };
            let t = Instant::now();
            let flat = work.wait()?;
            self.stats.exposed += t.elapsed();
            let l = &self.units[u];
            let full = l.unpack(&flat);
            let (padded, unpadded) = (l.seg_len * (self.shard_pg.world_size() + 1), l.full_len);
            drop(flat);
            self.grow(unpadded * size_of::<C>());
            self.shrink(padded * size_of::<C>());
            self.state[u] = Gather::Gathered(full);
        }
        match &self.state[u] {
            Gather::Gathered(full) => Ok(full),
            _ => unreachable!("gathered just above"),
        }
    }

    fn free(&mut self, u: usize) {
        match std::mem::replace(&mut self.state[u], Gather::Sharded) {
            Gather::Gathered(full) => self.shrink(full.len() * size_of::<C>()),
            // A prefetch nobody used: the gather still completes (peers take part in it).
            Gather::Gathering(w) => self.state[u] = Gather::Gathering(w),
            Gather::Sharded => {}
        }
    }

    fn prefetch(&mut self, units: impl Iterator<Item = usize>) -> Result<()> {
        for v in units.take(self.opts.prefetch) {
            self.issue_gather(v)?;
        }
        Ok(())
    }

    /// Unit `u`'s parameters, whole, in the compute type, for its forward; issues the
    /// all-gathers of the next units. Every rank calls the same sequence of `pre_*`/`post_*`.
    pub fn pre_forward(&mut self, u: usize) -> Result<&[C]> {
        self.check_unit("pre_forward", u)?;
        self.issue_gather(u)?;
        self.prefetch(u + 1..self.units.len())?;
        self.gathered(u)
    }

    /// After unit `u`'s forward: frees its gathered parameters when `reshard_after_forward`,
    /// except for the last unit, whose backward comes next (as torch keeps the root's).
    pub fn post_forward(&mut self, u: usize) -> Result<()> {
        self.check_unit("post_forward", u)?;
        if self.opts.reshard_after_forward && u + 1 < self.units.len() {
            self.free(u);
        }
        Ok(())
    }

    /// Unit `u`'s parameters for its backward (gathered again if the forward freed them);
    /// issues the all-gathers of the previous units.
    pub fn pre_backward(&mut self, u: usize) -> Result<&[C]> {
        self.check_unit("pre_backward", u)?;
        self.issue_gather(u)?;
        self.prefetch((0..u).rev())?;
        self.gathered(u)
    }

    /// After unit `u`'s backward: `grads` holds the gradient of every parameter of the unit,
    /// laid out like the gathered buffer. Frees the gathered parameters and starts the
    /// reduce-scatter (average) of the gradients into this rank's shard; without gradient sync
    /// ([`set_requires_gradient_sync`](Self::set_requires_gradient_sync)) the gradients are
    /// only accumulated locally.
    pub fn post_backward(&mut self, u: usize, grads: &[C]) -> Result<()> {
        self.check_unit("post_backward", u)?;
        let l = &self.units[u];
        if grads.len() != l.full_len {
            return Err(Error::Fsdp {
                rank: self.rank(),
                op: "post_backward",
                tensor: format!("unit {u} ({}..)", l.params[0].name),
                reason: format!(
                    "{} gradient elements for a unit of {} elements",
                    grads.len(),
                    l.full_len
                ),
            });
        }
        self.free(u);
        if !self.sync {
            let acc = self.no_sync_acc[u].get_or_insert_with(|| vec![0.0; grads.len()]);
            if acc.len() == grads.len() {
                acc.iter_mut()
                    .zip(grads)
                    .for_each(|(a, g)| *a += g.to_f32());
            }
            self.mem.accumulated = self.no_sync_acc.iter().flatten().map(|a| a.len() * 4).sum();
            return Ok(());
        }
        // Bound the reduce-scatters in flight: finish the oldest before starting another.
        while self.reduce_scatters.len() > self.opts.prefetch {
            self.harvest_reduce_scatter()?;
        }
        let acc = self.no_sync_acc[u].take();
        self.mem.accumulated = self.no_sync_acc.iter().flatten().map(|a| a.len() * 4).sum();
        let l = &self.units[u];
        let n = self.shard_pg.world_size();
        // In the compute type, a sum of gradients divided ahead (`dist_wire::average_divisors`).
        let work = match (self.opts.reduce_dtype, acc) {
            (ReduceDtype::Compute, None) => GradWork::Compute(
                self.shard_pg
                    .reduce_scatter_async(divided_for_sum(l.pack(grads), n), ReduceOp::Sum)?,
            ),
            (ReduceDtype::Compute, Some(mut a)) => {
                a.iter_mut().zip(grads).for_each(|(a, g)| *a += g.to_f32());
                let g: Vec<C> = convert(&a);
                GradWork::Compute(
                    self.shard_pg
                        .reduce_scatter_async(divided_for_sum(l.pack(&g), n), ReduceOp::Sum)?,
                )
            }
            (ReduceDtype::F32, acc) => {
                let mut g: Vec<f32> = convert(grads);
                if let Some(a) = acc {
                    g.iter_mut().zip(a).for_each(|(g, a)| *g += a);
                }
                GradWork::F32(
                    self.shard_pg
                        .reduce_scatter_async(l.pack(&g), ReduceOp::Avg)?,
                )
            }
        };
        let bytes = self.units[u].seg_len * self.shard_pg.world_size() * self.reduce_size();
        self.grow(bytes);
        self.seqs.push((Dim::Shard, work.seq()));
        self.stats.reduce_scatters += 1;
        self.reduce_scatters.push_back((u, work));
        Ok(())
    }

    fn reduce_size(&self) -> usize {
        match self.opts.reduce_dtype {
            ReduceDtype::Compute => size_of::<C>(),
            ReduceDtype::F32 => 4,
        }
    }

    /// Waits for the oldest reduce-scatter; adds its result into the gradient shard, or (HSDP)
    /// starts its all-reduce across replicas.
    fn harvest_reduce_scatter(&mut self) -> Result<()> {
        let Some((u, work)) = self.reduce_scatters.pop_front() else {
            return Ok(());
        };
        let (r, waited) = work.wait();
        self.stats.exposed += waited;
        let shard = r?.averaged_over(self.shard_pg.world_size());
        let bytes = self.units[u].seg_len * self.shard_pg.world_size() * self.reduce_size();
        self.shrink(bytes);
        match self.replicate_pg.clone() {
            Some(pg) => {
                self.grow(shard.bytes());
                let work = shard.all_reduce_avg(&pg)?;
                self.seqs.push((Dim::Replicate, work.seq()));
                self.all_reduces.push_back((u, work));
            }
            None => shard.add_into(&mut self.grads[u]),
        }
        Ok(())
    }

    fn harvest_all_reduce(&mut self) -> Result<()> {
        let Some((u, work)) = self.all_reduces.pop_front() else {
            return Ok(());
        };
        let (r, waited) = work.wait();
        self.stats.exposed += waited;
        let n = self
            .replicate_pg
            .as_ref()
            .map_or(1, ProcessGroup::world_size);
        let shard = r?.averaged_over(n);
        self.shrink(shard.bytes());
        shard.add_into(&mut self.grads[u]);
        Ok(())
    }

    /// Ends the backward pass: waits for every reduce-scatter (and HSDP all-reduce), after
    /// which each rank's gradient shards hold the average over all ranks, added to what they
    /// held before (call [`zero_grad`](Self::zero_grad) between steps). Returns what the step's
    /// communication cost.
    pub fn finish(&mut self) -> Result<FsdpStepStats> {
        while !self.reduce_scatters.is_empty() {
            self.harvest_reduce_scatter()?;
        }
        while !self.all_reduces.is_empty() {
            self.harvest_all_reduce()?;
        }
        for u in 0..self.units.len() {
            // A prefetch past the first unit's backward is waited for, so that its buffer is
            // counted free.
            self.release(u)?;
        }
        let seqs = std::mem::take(&mut self.seqs);
        let pick = |d: Dim| {
            seqs.iter()
                .filter(|s| s.0 == d)
                .map(|s| s.1)
                .collect::<Vec<_>>()
        };
        self.stats.comm = busy_time(&self.shard_pg, &pick(Dim::Shard))
            + self
                .replicate_pg
                .as_ref()
                .map(|pg| busy_time(pg, &pick(Dim::Replicate)))
                .unwrap_or_default();
        self.stats.comm = self.stats.comm.max(self.stats.exposed);
        Ok(std::mem::take(&mut self.stats))
    }

    /// Turns gradient synchronisation off (torch's `set_requires_gradient_sync(False)`, DDP's
    /// `no_sync`): `post_backward` then accumulates unsharded gradients locally, and the first
    /// backward with sync on again reduces them together with its own.
    pub fn set_requires_gradient_sync(&mut self, sync: bool) {
        self.sync = sync;
    }

    /// Sets every gradient shard to zero.
    pub fn zero_grad(&mut self) {
        self.grads.iter_mut().for_each(|g| g.fill(0.0));
    }

    /// Scales the gradients so that their global L2 norm (over every parameter, across all
    /// shards) is at most `max_norm`; returns the norm before clipping (torch's
    /// `clip_grad_norm_`). Every rank calls it.
    pub fn clip_grad_norm(&mut self, max_norm: f32) -> Result<f32> {
        if !(max_norm.is_finite() && max_norm >= 0.0) {
            return Err(Error::Fsdp {
                rank: self.rank(),
                op: "clip_grad_norm",
                tensor: "<all>".into(),
                reason: format!("max_norm must be finite and non-negative, got {max_norm}"),
            });
        }
        // Padding is always zero, so it adds nothing; sum in f64 so the order of ranks and the
        // size of the model do not change the result's f32 rounding.
        let local: f64 = self
            .grads
            .iter()
            .flatten()
            .map(|&g| f64::from(g) * f64::from(g))
            .sum();
        let mut total = [local];
        // Replicas hold identical gradient shards: the shard group's sum is the whole model.
        self.shard_pg.all_reduce(&mut total, ReduceOp::Sum)?;
        let norm = total[0].sqrt() as f32;
        let scale = max_norm / (norm + 1e-6);
        if scale < 1.0 {
            self.grads.iter_mut().flatten().for_each(|g| *g *= scale);
        }
        Ok(norm)
    }

    /// Frees every gathered copy of the parameters (the last unit's stays gathered after a
    /// forward pass, and every unit's without `reshard_after_forward`), so that the next
    /// forward gathers again, and waits for the gathers still in flight. [`finish`](Self::finish)
    /// does this at the end of a step; call it after forward-only passes (evaluation), as
    /// torch's `reshard()`. Every rank calls it alike.
    pub fn reshard(&mut self) -> Result<()> {
        let mut first_err = None;
        for u in 0..self.units.len() {
            if let Err(e) = self.release(u) {
                first_err.get_or_insert(e);
            }
        }
        if self.reduce_scatters.is_empty() && self.all_reduces.is_empty() {
            // A forward-only pass has no step to report: its gathers are not kept for one.
            self.seqs.clear();
            self.stats = Default::default();
        }
        first_err.map_or(Ok(()), Err)
    }

    /// Frees unit `u`'s gathered parameters, waiting for its gather if one is in flight; each
    /// state counts its own bytes free.
    fn release(&mut self, u: usize) -> Result<()> {
        match std::mem::replace(&mut self.state[u], Gather::Sharded) {
            Gather::Gathering(w) => {
                let waited = w.wait();
                let padded = self.units[u].seg_len * (self.shard_pg.world_size() + 1);
                self.shrink(padded * size_of::<C>());
                waited?;
            }
            Gather::Gathered(full) => self.shrink(full.len() * size_of::<C>()),
            Gather::Sharded => {}
        }
        Ok(())
    }

    /// Forgets every gathered copy of the parameters, as [`Fsdp::reshard`] but without waiting
    /// for gathers in flight (their result is the shards as they were; the operation completes
    /// in the background, as its peers take part in it): before the shards change, so that no
    /// later forward runs on the values they held before.
    fn forget_gathered(&mut self) {
        for u in 0..self.units.len() {
            match std::mem::replace(&mut self.state[u], Gather::Sharded) {
                Gather::Gathered(full) => self.shrink(full.len() * size_of::<C>()),
                Gather::Gathering(_in_flight) => {
                    let padded = self.units[u].seg_len * (self.shard_pg.world_size() + 1);
                    self.shrink(padded * size_of::<C>());
                }
                Gather::Sharded => {}
            }
        }
    }

    /// Every parameter's local shard with its gradient, for the optimizer, in unit order.
    /// Gathered copies of the parameters are dropped first (a forward after this gathers the
    /// shards as changed), so every rank calls it alike, as it calls `pre_*`/`post_*`.
    pub fn shards_mut(&mut self) -> Vec<ShardMut<'_>> {
        self.forget_gathered();
        let mut out = Vec::new();
        for ((l, s), g) in self.units.iter().zip(&mut self.shards).zip(&mut self.grads) {
            let (mut s, mut g): (&mut [f32], &mut [f32]) = (s, g);
            let mut consumed = 0;
            for i in 0..l.params.len() {
                let r = l.local_range(i);
                let (_, s_rest) = std::mem::take(&mut s).split_at_mut(r.start - consumed);
                let (_, g_rest) = std::mem::take(&mut g).split_at_mut(r.start - consumed);
                let (param, s_rest) = s_rest.split_at_mut(r.len());
                let (grad, g_rest) = g_rest.split_at_mut(r.len());
                consumed = r.end;
                s = s_rest;
                g = g_rest;
                out.push(ShardMut {
                    name: &l.params[i].name,
                    layout: &l.layouts[i],
                    chunk: l.local_chunk(i, &self.coord),
                    param,
                    grad,
                });
            }
        }
        out
    }

    /// The local shards as checkpoint entries (see [`crate::checkpoint`]).
    pub fn sharded_state(&self) -> Vec<LocalTensor> {
        let mut out = Vec::new();
        for (l, s) in self.units.iter().zip(&self.shards) {
            for i in 0..l.params.len() {
                out.push(LocalTensor::new(
                    &l.params[i].name,
                    l.layouts[i].clone(),
                    &self.coord,
                    &s[l.local_range(i)],
                ));
            }
        }
        out
    }

    /// Checkpoint targets for loading into the local shards (see
    /// [`checkpoint::load`](crate::checkpoint::load)); drops gathered copies as
    /// [`Fsdp::shards_mut`] does.
    pub fn sharded_state_mut(&mut self) -> Vec<LocalTensorMut<'_>> {
        let coord = self.coord.clone();
        self.shards_mut()
            .into_iter()
            .map(|s| LocalTensorMut::new(s.name, s.layout.clone(), &coord, s.param))
            .collect()
    }

    /// The whole model, unsharded (`f32`), as `(name, values)` in unit order: on every rank, or
    /// only on rank 0 of the shard group when `rank0_only` (other ranks get `None`). Every rank
    /// calls it; it all-gathers one unit at a time.
    pub fn full_state_dict(&self, rank0_only: bool) -> Result<Option<StateDict>> {
        let mut out = Vec::new();
        let world = self.shard_pg.world_size();
        for (l, s) in self.units.iter().zip(&self.shards) {
            let mut flat = vec![0.0f32; l.seg_len * world];
            self.shard_pg.all_gather_into(s, &mut flat)?;
            let full = l.unpack(&flat);
            for (i, p) in l.params.iter().enumerate() {
                out.push((p.name.clone(), full[l.full_range(i)].to_vec()));
            }
        }
        Ok((!rank0_only || self.rank() == 0).then_some(out))
    }
}
