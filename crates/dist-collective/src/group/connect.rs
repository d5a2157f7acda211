//! Creating a group: its backends (one per device type, behind [`Dispatch`] when there are
//! two), its worker, point-to-point and watchdog threads, and the agreement that every rank
//! finished connecting.

use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use dist_backend::store::PrefixStore;
use dist_backend::{Backend, Store};

use super::{AVAILABLE_BACKENDS, GroupConfig, GroupInner, OpCtx, ProcessGroup};
use crate::backend_spec::{BackendSpec, Engine};
use crate::debug::{DebugLevel, FailureDump, FlightRecorder};
use crate::dispatch::Dispatch;
use crate::exec::Exec;
use crate::p2p;
use crate::progress::{self, Progress};
use crate::{Error, Result};

/// The group's backends under `prefix`, connected by `deadline`, the creation's.
fn connect_backend(
    cfg: &GroupConfig,
    prefix: &str,
    rank: usize,
    world_size: usize,
    deadline: Instant,
) -> Result<Box<dyn Backend>> {
    let spec = BackendSpec::parse(&cfg.backend)?;
    spec.check_available(&cfg.backend, AVAILABLE_BACKENDS)?;
    let host = match spec.host {
        // Host backends keep the group's own prefix (their store keys predate dispatch).
        Some(e) => Some(connect_engine(e, cfg, prefix, rank, world_size, deadline)?),
        None => None,
    };
    let device = match spec.device {
        Some(e) => Some(connect_device(
            e,
            cfg,
            &format!("{prefix}/cuda"),
            rank,
            world_size,
            deadline,
        )?),
        None => None,
    };
    match (host, device) {
        (Some(host), Some(device)) => Ok(Box::new(Dispatch { host, device })),
        (Some(one), None) | (None, Some(one)) => Ok(one),
        (None, None) => Err(Error::InvalidBackend {
            spec: cfg.backend.clone(),
            reason: "it names no backend".into(),
        }),
    }
}

/// The backend serving device buffers: NCCL, or a host backend behind host staging.
fn connect_device(
    engine: Engine,
    cfg: &GroupConfig,
    prefix: &str,
    rank: usize,
    world_size: usize,
    deadline: Instant,
) -> Result<Box<dyn Backend>> {
    let b = connect_engine(engine, cfg, prefix, rank, world_size, deadline)?;
    if engine == Engine::Nccl {
        return Ok(b);
    }
    #[cfg(feature = "nccl")]
    {
        let staged = dist_nccl::HostStaging::new(b).map_err(|e| e.into_backend(rank))?;
        Ok(Box::new(staged))
    }
    #[cfg(not(feature = "nccl"))]
    {
        // check_available refused this spec already; kept for the compiler.
        drop(b);
        Err(Error::UnknownBackend {
            name: format!("{} (needs nccl)", cfg.backend),
            available: AVAILABLE_BACKENDS,
        })
    }
}

/// One backend. Gloo builds its mesh by `deadline`; NCCL makes no store call here (its
/// communicator is created at the first operation on a device, by that operation's timeout).
fn connect_engine(
    engine: Engine,
    cfg: &GroupConfig,
    prefix: &str,
    rank: usize,
    world_size: usize,
    deadline: Instant,
) -> Result<Box<dyn Backend>> {
    let _ = (prefix, rank, world_size, deadline);
    match engine {
        #[cfg(feature = "gloo")]
        Engine::Gloo => {
            let mut o = dist_gloo::GlooOptions::from_env();
            // The mesh's own timeout is then only how long its connections linger at close.
            o.mesh.timeout = cfg.timeout;
            Ok(Box::new(dist_gloo::GlooBackend::connect_by(
                &*cfg.root_store,
                prefix,
                rank,
                world_size,
                &o,
                deadline,
            )?))
        }
        #[cfg(feature = "nccl")]
        Engine::Nccl => {
            let mut o = dist_nccl::NcclOptions::from_env();
            o.timeout = cfg.timeout;
            let b =
                dist_nccl::NcclBackend::new(cfg.root_store.clone(), prefix, rank, world_size, o)
                    .map_err(|e| e.into_backend(rank))?;
            Ok(Box::new(b))
        }
        #[allow(
            unreachable_patterns,
            reason = "reached only in builds without a backend"
        )]
        other => Err(Error::UnknownBackend {
            name: format!("{other:?}").to_lowercase(),
            available: AVAILABLE_BACKENDS,
        }),
    }
}

/// Ends the creation of a group with an agreement that every rank has finished it: no rank
/// returns (and so may leave, or exit) while another is still connecting, so none of them
/// meets a half-built mesh or a store whose host has gone. It ends by `deadline`, the
/// creation's (init's or the sub-group call's), so a store that stops answering after the
/// write does not give the wait a second timeout, nor the creation a fresh one.
fn agree_connected(
    store: &dyn Store,
    rank: usize,
    world_size: usize,
    deadline: Instant,
) -> Result<()> {
    let key = |r: usize| format!("connected/{r}");
    let store_err = |e| {
        Error::store(
            rank,
            "creating the group: agreeing that every rank finished",
            e,
        )
    };
    store
        .set_by(&key(rank), b"1", deadline)
        .map_err(store_err)?;
    let keys: Vec<String> = (0..world_size).map(key).collect();
    let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
    store.wait_by(&keys, deadline).map_err(store_err)
}

impl ProcessGroup {
    /// Connects a new group: `rank` of `world_size`, under `prefix` in the job's store. Its
    /// store calls end by `deadline`, that of the call creating it (init, `new_group`, ...).
    pub(crate) fn connect(
        cfg: GroupConfig,
        prefix: String,
        rank: usize,
        global_ranks: Vec<usize>,
        world: bool,
        deadline: Instant,
    ) -> Result<ProcessGroup> {
        let world_size = global_ranks.len();
        let coll = connect_backend(&cfg, &format!("{prefix}/coll"), rank, world_size, deadline)?;
        let p2p_backend =
            connect_backend(&cfg, &format!("{prefix}/p2p"), rank, world_size, deadline)?;
        let store: Arc<dyn Store> =
            Arc::new(PrefixStore::new(prefix.clone(), cfg.root_store.clone()));
        agree_connected(&*store, rank, world_size, deadline)?;
        let short = prefix.rsplit('/').next().unwrap_or("g").to_owned();
        let no_thread = |what: &str| {
            let context = format!("process group {prefix}: starting its {what} thread");
            move |source| {
                Error::Backend(dist_backend::Error::Io {
                    rank,
                    context,
                    source,
                })
            }
        };
        let (exec, worker) =
            Exec::start(coll, format!("dist-{short}-r{rank}")).map_err(no_thread("worker"))?;
        // From here on, a failure stops the threads already started.
        let started = p2p::start(
            p2p_backend,
            store.clone(),
            format!("dist-{short}-p2p-r{rank}"),
        )
        .map_err(no_thread("point-to-point"));
        let (tx, p2p_thread) = match started {
            Ok(t) => t,
            Err(e) => {
                exec.close();
                let _ = worker.join();
                return Err(e);
            }
        };
        let progress = Arc::new(Progress::new(rank, world_size, store.clone(), cfg.timeout));
        let started =
            progress::start_watchdog(progress.clone(), format!("dist-{short}-wd-r{rank}"))
                .map_err(no_thread("watchdog"));
        let (stop_watchdog, watchdog) = match started {
            Ok(t) => t,
            Err(e) => {
                exec.close();
                drop(tx);
                let _ = worker.join();
                let _ = p2p_thread.join();
                return Err(e);
            }
        };
        if cfg.debug >= DebugLevel::Info {
            tracing::info!(rank, world_size, group = %prefix, backend = %cfg.backend, "process group created");
        }
        let inner = Arc::new(GroupInner {
            ctx: Arc::new(OpCtx {
                rank,
                world_size,
                name: prefix.clone(),
                timeout: cfg.timeout,
                debug: cfg.debug,
                recorder: FlightRecorder::from_env(),
                progress,
                dump: FailureDump::new(cfg.flight_dir.clone()),
            }),
            cfg,
            prefix,
            store,
            global_ranks,
            created: AtomicU64::new(0),
            monitored: AtomicU64::new(0),
            exec,
            p2p: Mutex::new(Some(tx)),
            watchdog: Mutex::new(Some(stop_watchdog)),
            threads: Mutex::new(vec![worker, p2p_thread, watchdog]),
            world,
            torn_down: AtomicBool::new(false),
        });
        crate::teardown::register(&inner);
        Ok(ProcessGroup { inner })
    }
}
