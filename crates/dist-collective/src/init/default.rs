//! The default group (torch's `group.WORLD`): one per process, set by
//! [`init_process_group`] and emptied by [`destroy_process_group`] or at exit.

use std::sync::Mutex;

use super::options::InitOptions;
use super::world::new_process_group;
use crate::group::ProcessGroup;
use crate::{Error, Result};

static DEFAULT: Mutex<Option<ProcessGroup>> = Mutex::new(None);

pub(super) fn default_slot() -> std::sync::MutexGuard<'static, Option<ProcessGroup>> {
    DEFAULT.lock().unwrap_or_else(|e| e.into_inner())
}

/// Initialises the default process group (torch's `init_process_group`) and returns a handle
/// on it. Every rank of the job calls it.
///
/// Fails with [`Error::AlreadyInitialized`] if a default group exists (destroy it first).
pub fn init_process_group(opts: InitOptions) -> Result<ProcessGroup> {
    if let Some(pg) = default_slot().as_ref() {
        return Err(Error::AlreadyInitialized {
            rank: pg.rank(),
            world_size: pg.world_size(),
        });
    }
    let pg = new_process_group(opts)?;
    let mut slot = default_slot();
    if let Some(existing) = slot.as_ref() {
        return Err(Error::AlreadyInitialized {
            rank: existing.rank(),
            world_size: existing.world_size(),
        });
    }
    *slot = Some(pg.clone());
    Ok(pg)
}

/// True once [`init_process_group`] has run (and [`destroy_process_group`] has not).
pub fn is_initialized() -> bool {
    default_slot().is_some()
}

/// The default group (torch's `group.WORLD`).
pub fn default_group() -> Result<ProcessGroup> {
    default_slot().clone().ok_or(Error::NotInitialized {
        op: "default_group",
    })
}

/// Destroys the default group (torch's `destroy_process_group()`): waits for its queued
/// operations, says goodbye to every peer, and returns once each peer has closed its end of
/// the connections (or the group's timeout has passed); on the rank that hosts the store, once
/// every rank has left. Handles still held on it (from [`init_process_group`] or
/// [`default_group`]) then fail with [`Error::Destroyed`]. No-op if there is none.
///
/// Calling it is optional: a process that returns from `main` (or calls
/// `std::process::exit`) tears down every group it still has in an exit hook, which is the
/// same goodbye, so no other rank sees it as a crash.
pub fn destroy_process_group() {
    let pg = default_slot().take();
    if let Some(pg) = pg {
        pg.inner.teardown();
        drop(pg);
        dist_backend::exit::run_stage(dist_backend::exit::ExitStage::Connections);
    }
}

/// Empties the default slot (at exit; the group itself is torn down by the caller).
pub(crate) fn forget_default() {
    let pg = default_slot().take();
    drop(pg);
}
