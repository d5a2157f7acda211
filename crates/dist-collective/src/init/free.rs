//! torch's free functions (`dist.get_rank()`, `dist.all_reduce(t)`, ...): the same operations
//! on the default group, failing with [`Error::NotInitialized`] before there is one.

use dist_wire::{Element, ReduceOp};

use super::default::default_slot;
use crate::group::ProcessGroup;
use crate::{Error, Result};

fn with_default<R>(op: &'static str, f: impl FnOnce(&ProcessGroup) -> Result<R>) -> Result<R> {
    let pg = default_slot().clone().ok_or(Error::NotInitialized { op })?;
    f(&pg)
}

/// Rank of this process in the default group (torch's `get_rank`).
pub fn get_rank() -> Result<usize> {
    with_default("get_rank", |pg| Ok(pg.rank()))
}

/// Size of the default group (torch's `get_world_size`).
pub fn get_world_size() -> Result<usize> {
    with_default("get_world_size", |pg| Ok(pg.world_size()))
}

/// Backend name of the default group (torch's `get_backend`).
pub fn get_backend() -> Result<String> {
    with_default("get_backend", |pg| Ok(pg.backend().to_owned()))
}

/// [`ProcessGroup::all_reduce`] on the default group.
pub fn all_reduce<T: Element>(buf: &mut [T], op: ReduceOp) -> Result<()> {
    with_default("all_reduce", |pg| pg.all_reduce(buf, op))
}

/// [`ProcessGroup::broadcast`] on the default group.
pub fn broadcast<T: Element>(buf: &mut [T], root: usize) -> Result<()> {
    with_default("broadcast", |pg| pg.broadcast(buf, root))
}

/// [`ProcessGroup::all_gather_into`] on the default group.
pub fn all_gather_into<T: Element>(input: &[T], output: &mut [T]) -> Result<()> {
    with_default("all_gather", |pg| pg.all_gather_into(input, output))
}

/// [`ProcessGroup::reduce_scatter_into`] on the default group.
pub fn reduce_scatter_into<T: Element>(input: &[T], output: &mut [T], op: ReduceOp) -> Result<()> {
    with_default("reduce_scatter", |pg| {
        pg.reduce_scatter_into(input, output, op)
    })
}

/// [`ProcessGroup::barrier`] on the default group.
pub fn barrier() -> Result<()> {
    with_default("barrier", ProcessGroup::barrier)
}

/// [`ProcessGroup::send`] on the default group.
pub fn send<T: Element>(buf: &[T], dst: usize, tag: u32) -> Result<()> {
    with_default("send", |pg| pg.send(buf, dst, tag))
}

/// [`ProcessGroup::recv`] on the default group.
pub fn recv<T: Element>(buf: &mut [T], src: usize, tag: u32) -> Result<()> {
    with_default("recv", |pg| pg.recv(buf, src, tag))
}

/// [`ProcessGroup::new_group`] on the default group.
pub fn new_group(ranks: &[usize]) -> Result<Option<ProcessGroup>> {
    with_default("new_group", |pg| pg.new_group(ranks))
}
