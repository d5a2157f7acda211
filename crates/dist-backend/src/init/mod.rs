//! Finding rank, world size and the store from a launcher's environment or a URL.
//!
//! * `env://` ([`InitConfig::from_env`]): torchrun's `MASTER_ADDR`, `MASTER_PORT`, `RANK`,
//!   `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`; else Open MPI's
//!   `OMPI_COMM_WORLD_RANK`/`_SIZE`/`_LOCAL_RANK`/`_LOCAL_SIZE`; else PMI's
//!   `PMI_RANK`/`PMI_SIZE` (with MPICH's `MPI_LOCALRANKID`/`MPI_LOCALNRANKS` when set, else
//!   Slurm's local rank under `srun --mpi=pmi2`); else
//!   Slurm's `SLURM_PROCID`, `SLURM_NTASKS`, `SLURM_LOCALID`, `SLURM_NTASKS_PER_NODE` (or this
//!   node's entry of `SLURM_TASKS_PER_NODE`) with the master on the first host of
//!   `SLURM_STEP_NODELIST` or `SLURM_JOB_NODELIST` (last: `mpirun` inside `sbatch` leaves
//!   the batch step's Slurm variables in every process; the batch script itself, not a task of
//!   an `srun` step, is refused when the job has several tasks). Rank 0 hosts the [`TcpStore`](crate::store::TcpStore) server on
//!   `MASTER_ADDR:MASTER_PORT`, as torch does; the others connect. When the launcher runs the
//!   store itself (torchrun and `distrun` set `TORCHELASTIC_USE_AGENT_STORE=True`), rank 0
//!   connects as a client too, and every key lives under `/worker/attempt_<n>` with `n` from
//!   `TORCHELASTIC_RESTART_COUNT`, as in torch, so a restarted job does not see the keys of
//!   the attempt before it.
//! * `tcp://host:port`: the same TCP store, with rank and world size given explicitly (as
//!   arguments or `?rank=..&world_size=..`).
//! * `file:///path`: a [`FileStore`](crate::store::FileStore) at that path.
//!
//! The environment is read through a lookup function, so tests (and embedders) pass a map
//! instead of mutating the process environment.
//!
//! This file holds the types; `env.rs` reads the launchers' variables, `slurm.rs` expands
//! Slurm node lists, `url.rs` parses the init URLs, `connect.rs` makes the store.
//!
//! ```
//! use dist_backend::init::InitConfig;
//! let env = [("RANK", "1"), ("WORLD_SIZE", "4"), ("MASTER_ADDR", "10.0.0.1"),
//!            ("MASTER_PORT", "29500"), ("LOCAL_RANK", "1"), ("LOCAL_WORLD_SIZE", "2")];
//! let cfg = InitConfig::from_lookup(|k| {
//!     env.iter().find(|(n, _)| *n == k).map(|(_, v)| v.to_string())
//! }).unwrap();
//! assert_eq!((cfg.rank, cfg.world_size, cfg.local_rank, cfg.local_world_size), (1, 4, 1, 2));
//! assert_eq!(cfg.master_addr.as_deref(), Some("10.0.0.1"));
//! ```

use std::fmt;
use std::sync::Arc;

use crate::Error;
use crate::store::Store;

mod connect;
mod env;
mod slurm;
mod url;

pub use env::local_rank_from_lookup;
pub use slurm::{expand_nodelist, first_host};
pub use url::{init_from_url, init_from_url_by, init_from_url_with};

/// Which launcher the rank information came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Launcher {
    /// torchrun (or anything that sets `RANK`/`WORLD_SIZE`).
    Torchrun,
    /// Slurm's `srun`.
    Slurm,
    /// Open MPI's `mpirun`.
    OpenMpi,
    /// A PMI launcher (MPICH's hydra, Intel MPI).
    Pmi,
    /// Rank and world size given explicitly.
    Explicit,
}

impl fmt::Display for Launcher {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Launcher::Torchrun => "torchrun",
            Launcher::Slurm => "slurm",
            Launcher::OpenMpi => "open-mpi",
            Launcher::Pmi => "pmi",
            Launcher::Explicit => "explicit",
        })
    }
}

/// What a launcher says about this process, before any store is made.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InitConfig {
    /// Global rank.
    pub rank: usize,
    /// Number of ranks.
    pub world_size: usize,
    /// Rank among the processes of this host.
    pub local_rank: usize,
    /// Number of processes on this host.
    pub local_world_size: usize,
    /// Host of the store server (`MASTER_ADDR`, or Slurm's first node), if known.
    pub master_addr: Option<String>,
    /// Port of the store server (`MASTER_PORT`), if known.
    pub master_port: Option<u16>,
    /// Where the values came from.
    pub launcher: Launcher,
    /// `Some(restart count)` when the launcher serves the store itself
    /// (`TORCHELASTIC_USE_AGENT_STORE=True`, restart count from `TORCHELASTIC_RESTART_COUNT`,
    /// default 0): then rank 0 connects as a client instead of starting the server, and keys
    /// are prefixed with `/worker/attempt_<count>`.
    pub agent_store: Option<u64>,
}

/// The outcome of init: who this process is and the store every rank shares.
#[derive(Clone)]
pub struct InitInfo {
    /// Global rank.
    pub rank: usize,
    /// Number of ranks.
    pub world_size: usize,
    /// Rank among the processes of this host.
    pub local_rank: usize,
    /// Number of processes on this host.
    pub local_world_size: usize,
    /// Where the values came from.
    pub launcher: Launcher,
    /// The rendezvous store (rank 0 of a TCP store also runs its server inside it).
    pub store: Arc<dyn Store>,
}

impl fmt::Debug for InitInfo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("InitInfo")
            .field("rank", &self.rank)
            .field("world_size", &self.world_size)
            .field("local_rank", &self.local_rank)
            .field("local_world_size", &self.local_world_size)
            .field("launcher", &self.launcher)
            .finish_non_exhaustive()
    }
}

fn init_err(what: impl Into<String>) -> Error {
    Error::Init { what: what.into() }
}

#[cfg(test)]
mod tests;
