//! How groups end: the goodbye, the store host's wait for every rank to leave, and the exit
//! hook that does both for groups a program never destroyed.
//!
//! A group is torn down when its last handle is dropped, by [`crate::destroy_process_group`],
//! or at process exit. Tearing down finishes the queued operations, closes both backends (each
//! sends every peer a `Close` frame and drains its connections, see `dist-gloo`), and for a
//! group made by `init_process_group`/`new_process_group` marks this rank as having left in
//! the job's store. The rank that hosts the store's server (rank 0 under `env://`, unless the
//! launcher serves it) then keeps serving until every rank has left, or the timeout passes
//! (ten seconds at most once the group has failed, since a crashed rank never leaves), as
//! torch's TCPStore does. A launcher-hosted store (`distrun`, torchrun's agent store) is
//! unaffected: no rank serves it.
//!
//! Every group registers here when created; the `dist-backend` exit hook tears down, newest
//! first, those still alive when the process exits (returning from `main`, `process::exit`,
//! or a panic leaving `main`), so a rank that just returns from `main` never makes another
//! rank fail.

use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use dist_backend::exit::{ExitStage, at_exit};

use crate::group::GroupInner;
use crate::missing::missing_keys;

/// Every group created in this process and not yet dropped, oldest first.
static LIVE: Mutex<Vec<Weak<GroupInner>>> = Mutex::new(Vec::new());

/// How long the store's host waits for the others to leave a group that has failed.
const FAILED_GROUP_LEAVE_WAIT: Duration = Duration::from_secs(10);

/// Registers a new group for teardown at exit.
pub(crate) fn register(g: &Arc<GroupInner>) {
    {
        let mut live = LIVE.lock().unwrap_or_else(|e| e.into_inner());
        live.retain(|w| w.strong_count() > 0);
        live.push(Arc::downgrade(g));
    }
    at_exit(ExitStage::Groups, teardown_all);
}

/// Tears down every group still alive, newest first (sub-groups before their parents).
fn teardown_all() {
    // Held before the default slot lets go of its handle: were that the world's last handle,
    // dropping it would tear the world down first, before its sub-groups.
    let live: Vec<Arc<GroupInner>> =
        std::mem::take(&mut *LIVE.lock().unwrap_or_else(|e| e.into_inner()))
            .iter()
            .filter_map(Weak::upgrade)
            .collect();
    crate::init::forget_default();
    for g in live.iter().rev() {
        g.teardown();
    }
}

/// The store keys by which the ranks of a world group say they have left.
fn left_key(prefix: &str, rank: usize) -> String {
    format!("{prefix}/left/{rank}")
}

/// This rank leaves the world group `g`; on the rank that serves the store, waits for every
/// other rank to leave too. Leaving is one life-cycle step: its store calls end together by
/// one deadline (the group's timeout, or less for a failed group), so a silent store cannot
/// make the goodbye and the wait each take a store timeout.
pub(crate) fn leave(g: &GroupInner) {
    let rank = g.ctx.rank;
    let store = &g.cfg.root_store;
    let wait = if g.ctx.dump.aborted() {
        g.ctx.timeout.min(FAILED_GROUP_LEAVE_WAIT)
    } else {
        g.ctx.timeout
    };
    let deadline = dist_backend::deadline_after(Instant::now(), wait);
    if let Err(e) = store.set_by(&left_key(&g.prefix, rank), b"1", deadline) {
        tracing::debug!(rank, group = %g.ctx.name, error = %e, "could not record leaving the group in the store");
        if e.is_unreachable() {
            // Waiting for the others through the same silent store would wait again.
            return;
        }
    }
    if !store.serves_others() {
        return;
    }
    let keys: Vec<String> = (0..g.ctx.world_size)
        .map(|r| left_key(&g.prefix, r))
        .collect();
    let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
    if let Err(e) = store.wait_by(&keys, deadline) {
        if e.is_unreachable() {
            tracing::warn!(rank, group = %g.ctx.name, error = %e, "stopping the store without knowing who left: it does not answer");
            return;
        }
        let missing = missing_keys(&**store, &keys);
        tracing::warn!(rank, group = %g.ctx.name, ?missing, error = %e, "stopping the store before every rank left the group");
    }
}
