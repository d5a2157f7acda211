//! A test world: N ranks as threads in one process, each with its own real process group over
//! loopback TCP.

use std::any::Any;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use dist_backend::store::HashStore;

use crate::group::ProcessGroup;
use crate::init::{InitOptions, new_process_group};
use crate::{Error, Result};

/// Timeout of [`run_world`]'s groups: short, so a broken test fails instead of hanging.
pub const RUN_WORLD_TIMEOUT: Duration = Duration::from_secs(60);

/// Runs `f` on `world_size` ranks, each a thread with its own [`ProcessGroup`] over real
/// loopback TCP connections (the same code paths as a multi-process job; only the rendezvous
/// store is in memory), and returns every rank's result in rank order, or the first error
/// (the earliest to happen, which is usually the cause of the others). A panicking rank is
/// reported as [`Error::RankPanicked`].
///
/// ```
/// use dist_collective::{ReduceOp, testing::run_world};
/// let out = run_world(3, |pg| {
///     let mut x = [pg.rank() as i64, 1];
///     pg.all_reduce(&mut x, ReduceOp::Sum)?;
///     Ok(x)
/// })?;
/// assert_eq!(out, vec![[3, 3]; 3]);
/// # Ok::<(), dist_collective::Error>(())
/// ```
pub fn run_world<R, F>(world_size: usize, f: F) -> Result<Vec<R>>
where
    R: Send,
    F: Fn(ProcessGroup) -> Result<R> + Sync,
{
    run_world_with(world_size, RUN_WORLD_TIMEOUT, f)
}

/// [`run_world`] with an explicit per-operation timeout.
pub fn run_world_with<R, F>(world_size: usize, timeout: Duration, f: F) -> Result<Vec<R>>
where
    R: Send,
    F: Fn(ProcessGroup) -> Result<R> + Sync,
{
    run_world_opts(world_size, InitOptions::new().timeout(timeout), f)
}

/// [`run_world`] with explicit options (backend, timeout, debug level); their init method,
/// rank and world size are replaced by the test world's.
pub fn run_world_opts<R, F>(world_size: usize, opts: InitOptions, f: F) -> Result<Vec<R>>
where
    R: Send,
    F: Fn(ProcessGroup) -> Result<R> + Sync,
{
    let timeout = opts.get_timeout();
    if world_size == 0 {
        return Err(Error::invalid(
            0,
            "run_world",
            "a world needs at least one rank",
        ));
    }
    let store = Arc::new(HashStore::new(timeout));
    let first: Mutex<Option<(Instant, Error)>> = Mutex::new(None);
    let results: Vec<Option<R>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..world_size)
            .map(|rank| {
                let store = store.clone();
                let f = &f;
                let opts = &opts;
                let first = &first;
                std::thread::Builder::new()
                    .name(format!("rank-{rank}"))
                    .spawn_scoped(s, move || {
                        let opts = opts.clone().store(store).rank(rank).world_size(world_size);
                        // A clone outlives `f`, so that a rank's error is recorded before its
                        // group says goodbye: otherwise the peers' errors about its leaving could
                        // be recorded first, and reported instead of the cause.
                        let mut keep = None;
                        let r = catch_unwind(AssertUnwindSafe(|| {
                            new_process_group(opts).and_then(|pg| {
                                keep = Some(pg.clone());
                                f(pg)
                            })
                        }))
                        .unwrap_or_else(|p| {
                            Err(Error::RankPanicked {
                                rank,
                                message: panic_message(&*p),
                            })
                        });
                        let out = match r {
                            Ok(v) => Some(v),
                            Err(e) => {
                                let mut g = first.lock().unwrap_or_else(|e| e.into_inner());
                                if g.is_none() {
                                    *g = Some((Instant::now(), e));
                                }
                                None
                            }
                        };
                        drop(keep);
                        out
                    })
            })
            .collect();
        handles
            .into_iter()
            .enumerate()
            .map(|(rank, h)| match h.map(|h| h.join()) {
                // The other ranks fail on their own: their group cannot form without this one.
                Err(e) => {
                    let mut g = first.lock().unwrap_or_else(|e| e.into_inner());
                    if g.is_none() {
                        *g = Some((
                            Instant::now(),
                            Error::invalid(
                                rank,
                                "run_world",
                                format!("cannot start its thread: {e}"),
                            ),
                        ));
                    }
                    None
                }
                Ok(Ok(v)) => v,
                Ok(Err(p)) => {
                    let message = panic_message(&*p);
                    let mut g = first.lock().unwrap_or_else(|e| e.into_inner());
                    if g.is_none() {
                        *g = Some((Instant::now(), Error::RankPanicked { rank, message }));
                    }
                    None
                }
            })
            .collect()
    });
    if let Some((_, e)) = first.into_inner().unwrap_or_else(|e| e.into_inner()) {
        return Err(e);
    }
    Ok(results.into_iter().flatten().collect())
}

fn panic_message(p: &(dyn Any + Send)) -> String {
    p.downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "(non-string panic)".into())
}
