//! How an operation runs: in its place in the group's order (on the caller's thread or the
//! worker), recorded in the flight recorder and the progress table others read on a timeout,
//! and logged; a timeout becomes a report of where every rank is.

use std::time::{Duration, Instant};

use dist_backend::{Backend, OpOptions};
use dist_wire::Element;

use super::fingerprint::{Fingerprint, check_fingerprint};
use super::{OpCtx, ProcessGroup};
use crate::debug::{DebugLevel, OpInfo, dump_json};
use crate::work::{Completer, Work};
use crate::{Error, Result};

/// Runs one operation on `b` as the group's collective `seq` (flight recorder entry `id`),
/// keeping the flight recorder, the progress others read on a timeout, and the logs.
#[allow(
    clippy::too_many_arguments,
    reason = "one internal helper that every collective calls; a struct would only rename them"
)]
pub(super) fn run_op<R>(
    ctx: &OpCtx,
    id: u64,
    seq: u64,
    op: &'static str,
    fp: Option<Fingerprint>,
    b: &dyn Backend,
    f: impl FnOnce(&dyn Backend, &OpOptions) -> Result<R>,
) -> Result<R> {
    ctx.recorder.started(id);
    ctx.progress.started(seq, op);
    let t0 = Instant::now();
    if ctx.debug >= DebugLevel::Detail {
        tracing::info!(rank = ctx.rank, group = %ctx.name, op, seq, "operation started");
    }
    let mut opts = OpOptions::with_timeout(ctx.timeout);
    opts.seq = Some(seq);
    let r = match fp {
        Some(fp) if ctx.debug >= DebugLevel::Detail && checks_on_host(ctx, b) => {
            check_fingerprint(ctx, b, op, fp).and_then(|()| f(b, &opts))
        }
        _ => f(b, &opts),
    };
    let r = r.map_err(|e| with_progress(ctx, op, seq, e));
    match &r {
        Ok(_) => ctx.progress.finished(seq, op),
        Err(_) => ctx.progress.failed(seq, op),
    }
    finish(ctx, id, Some(seq), op, t0, r.as_ref().err());
    r
}

/// Whether `b` can carry the `DIST_DEBUG=DETAIL` fingerprint check, which all-gathers it
/// from host memory. A backend that takes only device buffers (`"nccl"` alone) cannot: the
/// check failed every device collective and barrier with "unsupported" instead of checking
/// them. Such groups skip it, saying so once per process; `"cpu:gloo,cuda:nccl"` checks on
/// Gloo. (torch checks through a Gloo group of its own there.)
fn checks_on_host(ctx: &OpCtx, b: &dyn Backend) -> bool {
    static SAID: std::sync::Once = std::sync::Once::new();
    let host = b.capabilities().host_buffers;
    if !host {
        SAID.call_once(|| {
            tracing::warn!(
                rank = ctx.rank,
                group = %ctx.name,
                backend = b.name(),
                "DIST_DEBUG=DETAIL: the fingerprint check needs host buffers, which this backend does not take; skipped"
            );
        });
    }
    host
}

/// The longest a timed-out collective spends gathering its progress report, so that the error
/// comes within a second of the timeout even when the store does not answer.
pub(super) const PROGRESS_REPORT_BUDGET: Duration = Duration::from_millis(600);

/// Turns a backend timeout into [`Error::CollectiveTimeout`], which says where every rank of
/// the group is; other errors pass through.
pub(super) fn with_progress(ctx: &OpCtx, op: &'static str, cseq: u64, e: Error) -> Error {
    match e {
        Error::Backend(source @ dist_backend::Error::Timeout { .. }) => Error::CollectiveTimeout {
            rank: ctx.rank,
            group: ctx.name.clone(),
            op,
            seq: cseq,
            progress: ctx.progress.report_within(op, cseq, PROGRESS_REPORT_BUDGET),
            source,
        },
        other => other,
    }
}

pub(super) fn finish(
    ctx: &OpCtx,
    id: u64,
    seq: Option<u64>,
    op: &'static str,
    t0: Instant,
    err: Option<&Error>,
) {
    ctx.recorder.finished(id, err.map(ToString::to_string));
    match err {
        Some(e) => {
            // A monitored barrier fails through the store and leaves the group usable.
            let aborts = !matches!(e, Error::MonitoredBarrier { .. });
            let dumped = ctx.dump.on_failure(&ctx.name, ctx.rank, aborts, || {
                let error = e.to_string();
                dump_json(
                    &ctx.name,
                    ctx.rank,
                    ctx.world_size,
                    &ctx.recorder.entries(),
                    Some(&error),
                )
            });
            tracing::warn!(rank = ctx.rank, group = %ctx.name, op, ?seq, error = %e, first_failure = dumped, "operation failed");
        }
        None if ctx.debug >= DebugLevel::Detail => {
            tracing::info!(rank = ctx.rank, group = %ctx.name, op, ?seq, elapsed = ?t0.elapsed(), "operation completed");
        }
        None if ctx.debug >= DebugLevel::Info => {
            tracing::debug!(rank = ctx.rank, group = %ctx.name, op, ?seq, elapsed = ?t0.elapsed(), "operation completed");
        }
        None => {}
    }
}

pub(super) fn info<T: Element>(
    op: &'static str,
    counts: Vec<usize>,
    peer: Option<usize>,
) -> OpInfo {
    OpInfo {
        op,
        dtype: Some(T::DTYPE.to_string()),
        counts,
        peer,
    }
}

impl ProcessGroup {
    /// Runs a collective on this thread in its place in the group's order.
    pub(crate) fn coll<R>(
        &self,
        info: OpInfo,
        fp: Option<Fingerprint>,
        f: impl FnOnce(&dyn Backend, &OpOptions) -> Result<R>,
    ) -> Result<R> {
        let op = info.op;
        let ctx = &self.inner.ctx;
        let id = std::cell::Cell::new(0);
        self.inner
            .exec
            .run_inline(
                |seq| id.set(ctx.recorder.issue(info, Some(seq))),
                |b, seq| run_op(ctx, id.get(), seq, op, fp, b, f),
            )
            .unwrap_or_else(|| Err(self.destroyed(op)))
    }

    /// Runs a group-level step (no backend operation) on this thread in its place in the
    /// group's order, recorded in the flight recorder.
    pub(crate) fn ordered<R>(&self, info: OpInfo, f: impl FnOnce() -> Result<R>) -> Result<R> {
        self.coll(info, None, |_, _| f())
    }

    /// Queues a collective on the group's worker.
    pub(crate) fn coll_async<R: Send + 'static>(
        &self,
        info: OpInfo,
        fp: Option<Fingerprint>,
        f: impl FnOnce(&dyn Backend, &OpOptions) -> Result<R> + Send + 'static,
    ) -> Result<Work<R>> {
        let op = info.op;
        let ctx = self.inner.ctx.clone();
        let mut work = None;
        self.inner
            .exec
            .submit(|seq| {
                let id = ctx.recorder.issue(info, Some(seq));
                let (w, done): (Work<R>, Completer<R>) = Work::pending(ctx.rank, op, seq);
                work = Some(w);
                Box::new(move |b: &dyn Backend, seq| {
                    done.complete(run_op(&ctx, id, seq, op, fp, b, f));
                })
            })
            .ok_or_else(|| self.destroyed(op))?;
        work.ok_or_else(|| self.destroyed(op))
    }

    pub(super) fn destroyed(&self, op: &'static str) -> Error {
        Error::Destroyed {
            rank: self.rank(),
            op,
        }
    }
}
