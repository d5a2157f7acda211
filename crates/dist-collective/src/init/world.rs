//! [`new_process_group`]: the group of every rank of the job, from [`InitOptions`].

use std::path::PathBuf;

use super::options::{InitMethod, InitOptions};
use crate::debug::DebugLevel;
use crate::group::{GroupConfig, ProcessGroup};
use crate::{Error, Result};

/// Creates a process group over all ranks of the job **without** making it the default one
/// (what [`crate::testing::run_world`] uses; most programs call [`init_process_group`](crate::init_process_group)).
///
/// Under a launcher that names an error file (`TORCHELASTIC_ERROR_FILE`: torchrun, `distrun`),
/// it also makes a panic write that file ([`dist_backend::error_file::record_panics`]), so the
/// launcher reports the panic as the job's root cause.
pub fn new_process_group(opts: InitOptions) -> Result<ProcessGroup> {
    dist_backend::error_file::record_panics();
    // A bad or uncompiled backend fails here, before any rendezvous.
    crate::backend_spec::BackendSpec::parse(&opts.backend)?
        .check_available(&opts.backend, crate::group::AVAILABLE_BACKENDS)?;
    // One deadline for the whole init, taken before the store is made: the time the store
    // takes to come up (rank 0 waits for every rank to connect) comes out of the same budget
    // as the count of inits, the backends' meshes and the connected agreement below.
    let deadline = dist_backend::deadline_after(std::time::Instant::now(), opts.timeout);
    let (rank, world_size, store) = match &opts.method {
        InitMethod::Env => {
            let i = dist_backend::init::init_from_url_by(
                "env://",
                opts.rank,
                opts.world_size,
                opts.timeout,
                deadline,
            )?;
            (i.rank, i.world_size, i.store)
        }
        InitMethod::Url(u) => {
            let i = dist_backend::init::init_from_url_by(
                u,
                opts.rank,
                opts.world_size,
                opts.timeout,
                deadline,
            )?;
            (i.rank, i.world_size, i.store)
        }
        InitMethod::Store(s) => {
            let (Some(r), Some(w)) = (opts.rank, opts.world_size) else {
                return Err(Error::Backend(dist_backend::Error::Init {
                    what: "init with an explicit store needs rank and world_size".into(),
                }));
            };
            if w == 0 || r >= w {
                return Err(Error::Backend(dist_backend::Error::Init {
                    what: format!("rank {r} is not below world_size {w}"),
                }));
            }
            (r, w, s.clone())
        }
    };
    let prefix = world_prefix(&*store, rank, world_size, deadline)?;
    let cfg = GroupConfig {
        backend: opts.backend,
        timeout: opts.timeout,
        root_store: store,
        debug: opts.debug.unwrap_or_else(DebugLevel::from_env),
        flight_dir: opts.flight_dir.or_else(|| {
            std::env::var_os("DIST_FLIGHT_RECORDER_DIR")
                .filter(|d| !d.is_empty())
                .map(PathBuf::from)
        }),
    };
    ProcessGroup::connect(cfg, prefix, rank, (0..world_size).collect(), true, deadline)
}

/// The namespace of this init over `store`: each init over one store gets its own, so a job
/// may destroy and re-create its world. Every rank of one generation increments a counter
/// before any rank can start the next (the mesh of the first needs them all), so
/// `(count - 1) / world_size` numbers the generations alike on every rank. The counter is one
/// per world size: over one counter, a world of another size after the first (an explicit
/// store reused, a job re-created smaller) started at a count its size does not divide, and its
/// ranks derived different generations. The first size to init over the store keeps `world`,
/// `world.1`...; another size `n` takes `world.n<n>.<generation>`, so no two sizes share keys.
/// Store calls end by `deadline`, the init's, not the store's own timeout (an explicit store
/// may have another).
fn world_prefix(
    store: &dyn dist_backend::Store,
    rank: usize,
    world_size: usize,
    deadline: std::time::Instant,
) -> Result<String> {
    let counting = |e| Error::store(rank, "init_process_group: counting inits", e);
    let size = world_size.to_string();
    // The first size to init claims the plain names; later calls read it back unchanged.
    let first = store
        .compare_set_by("dist/world_inits_size", b"", size.as_bytes(), deadline)
        .map_err(counting)?;
    let first = first == size.as_bytes();
    let counter = if first {
        "dist/world_inits".to_owned()
    } else {
        format!("dist/world_inits/{size}")
    };
    let n = store.add_by(&counter, 1, deadline).map_err(counting)?;
    let generation = (n.max(1) as u64 - 1) / world_size as u64;
    Ok(match (first, generation) {
        (true, 0) => "world".to_owned(),
        (true, g) => format!("world.{g}"),
        (false, g) => format!("world.n{size}.{g}"),
    })
}
