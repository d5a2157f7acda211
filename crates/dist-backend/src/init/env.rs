//! Reading rank, world size, local rank and the master's address from the variables of
//! torchrun, Slurm, Open MPI or PMI.

use super::slurm::first_host;
use super::{InitConfig, Launcher, init_err};
use crate::Result;

/// Reads variable `name` as a non-negative integer; `Ok(None)` when it is not set.
pub(super) fn num(env: &dyn Fn(&str) -> Option<String>, name: &str) -> Result<Option<usize>> {
    match env(name) {
        None => Ok(None),
        Some(v) => v
            .trim()
            .parse::<usize>()
            .map(Some)
            .map_err(|_| init_err(format!("{name}={v:?} is not a non-negative integer"))),
    }
}

/// The port a Slurm step without `MASTER_PORT` rendezvous on: 15000 plus the job id and
/// 4999 per step, modulo 20000 (step 0 keeps the job's own port).
fn slurm_port(job: usize, step: usize) -> u16 {
    (15000 + (job % 20000 + (step % 20000) * 4999) % 20000) as u16
}

/// This node's count in a Slurm tasks-per-node value such as `2(x3),1` (nodes 0-2 run 2
/// tasks, node 3 runs 1), the node being `SLURM_NODEID` (0 when unset). The leading count
/// alone was wrong on every node whose count differs from the first's, and init then refused
/// a local rank past it on those nodes only.
fn slurm_tasks_here(env: &dyn Fn(&str) -> Option<String>, name: &str) -> Result<Option<usize>> {
    let Some(v) = env(name) else {
        return Ok(None);
    };
    let node = num(env, "SLURM_NODEID")?.unwrap_or(0);
    let bad = || init_err(format!("{name}={v:?} is not a Slurm tasks-per-node list"));
    let mut first = 0usize;
    for entry in v.trim().split(',') {
        let (count, times) = match entry.split_once("(x") {
            Some((c, rest)) => (c, rest.strip_suffix(')').ok_or_else(bad)?),
            None => (entry, "1"),
        };
        let count: usize = count.trim().parse().map_err(|_| bad())?;
        let times: usize = times.trim().parse().map_err(|_| bad())?;
        first = first.saturating_add(times);
        if node < first {
            return Ok(Some(count));
        }
    }
    Err(init_err(format!(
        "{name}={v:?} lists {first} nodes, but SLURM_NODEID={node}"
    )))
}

/// The leading integer of a local-size value (what follows it is not read).
fn leading_num(env: &dyn Fn(&str) -> Option<String>, name: &str) -> Result<Option<usize>> {
    match env(name) {
        None => Ok(None),
        Some(v) => {
            let digits: String = v.trim().chars().take_while(char::is_ascii_digit).collect();
            digits
                .parse::<usize>()
                .map(Some)
                .map_err(|_| init_err(format!("{name}={v:?} does not start with an integer")))
        }
    }
}

/// Names of (rank, world size, local rank, local world size) variables per launcher.
struct Vars {
    launcher: Launcher,
    rank: &'static str,
    size: &'static str,
    local_rank: &'static [&'static str],
    local_size: &'static [&'static str],
}

/// In order of precedence: the launcher closest to the process first. Slurm comes last
/// because its variables outlive it: `mpirun` inside an `sbatch` script leaves the batch
/// step's `SLURM_PROCID=0` in every process it starts, and reading Slurm's first made every
/// rank rank 0. (Under `srun --mpi=pmi2` both say the same.)
const LAUNCHERS: [Vars; 4] = [
    Vars {
        launcher: Launcher::Torchrun,
        rank: "RANK",
        size: "WORLD_SIZE",
        local_rank: &["LOCAL_RANK"],
        local_size: &["LOCAL_WORLD_SIZE"],
    },
    Vars {
        launcher: Launcher::OpenMpi,
        rank: "OMPI_COMM_WORLD_RANK",
        size: "OMPI_COMM_WORLD_SIZE",
        local_rank: &["OMPI_COMM_WORLD_LOCAL_RANK"],
        local_size: &["OMPI_COMM_WORLD_LOCAL_SIZE"],
    },
    Vars {
        launcher: Launcher::Pmi,
        rank: "PMI_RANK",
        size: "PMI_SIZE",
        local_rank: &["MPI_LOCALRANKID", "PMI_LOCAL_RANK"],
        local_size: &["MPI_LOCALNRANKS", "PMI_LOCAL_SIZE"],
    },
    Vars {
        launcher: Launcher::Slurm,
        rank: "SLURM_PROCID",
        size: "SLURM_NTASKS",
        local_rank: &["SLURM_LOCALID"],
        local_size: &["SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE"],
    },
];

/// The variables of the launcher that set the environment read through `env`: the first of
/// [`LAUNCHERS`] whose rank or size is set.
fn launcher_vars(env: &dyn Fn(&str) -> Option<String>) -> Option<&'static Vars> {
    LAUNCHERS
        .iter()
        .find(|v| env(v.rank).is_some() || env(v.size).is_some())
}

/// This process's rank among the ranks on its host, as the launcher that set the environment
/// read through `env` says (the same launcher and variables [`InitConfig::from_env`] reads);
/// `None` where no launcher's variables are set, or it gives no local rank, or the value is not
/// a number. For a device choice before (or without) a full init.
pub fn local_rank_from_lookup(env: &dyn Fn(&str) -> Option<String>) -> Option<usize> {
    let v = launcher_vars(env)?;
    let v = if v.local_rank.iter().all(|name| env(name).is_none()) && slurm_task_alike(env, v) {
        SLURM
    } else {
        v
    };
    v.local_rank
        .iter()
        .find_map(|name| num(env, name).ok().flatten())
}

/// A value with the variable it was read from.
type Named = (usize, &'static str);

/// Slurm's variables, which [`local_of`] falls back on.
const SLURM: &Vars = &LAUNCHERS[3];

/// The local rank and local world size `v`'s launcher gives, each with the variable it came
/// from. Where it gives no local rank and the process is a task of an `srun` step that Slurm
/// numbers as the launcher does ([`slurm_task_alike`]), Slurm's.
fn local_of(
    env: &dyn Fn(&str) -> Option<String>,
    v: &'static Vars,
) -> Result<(Option<Named>, Option<Named>)> {
    let mut lr = None;
    for name in v.local_rank {
        if let Some(x) = num(env, name)? {
            lr = Some((x, *name));
            break;
        }
    }
    let mut ls = None;
    for name in v.local_size {
        let here = if v.launcher == Launcher::Slurm {
            slurm_tasks_here(env, name)?
        } else {
            leading_num(env, name)?
        };
        if let Some(x) = here {
            ls = Some((x, *name));
            break;
        }
    }
    if lr.is_none() && slurm_task_alike(env, v) {
        let (slurm_lr, slurm_ls) = local_of(env, SLURM)?;
        return Ok((slurm_lr, ls.or(slurm_ls)));
    }
    Ok((lr, ls))
}

/// Whether `v` is another launcher than Slurm and this process a task of an `srun` step that
/// Slurm numbers as `v` does: `srun --mpi=pmi2` sets `PMI_RANK` and `PMI_SIZE` but no local
/// rank, which then fell back to the global rank, wrong on every node but the first. (The
/// batch step's leftover variables, under an `mpirun` in an `sbatch` script, are no step's.)
fn slurm_task_alike(env: &dyn Fn(&str) -> Option<String>, v: &Vars) -> bool {
    let same = |a: &str, b: &str| {
        let (a, b) = (env(a), env(b));
        a.is_some() && a.as_deref().map(str::trim) == b.as_deref().map(str::trim)
    };
    v.launcher != Launcher::Slurm
        && in_srun_step(env)
        && same(v.rank, SLURM.rank)
        && same(v.size, SLURM.size)
}

/// Whether this process is a task of an `srun` step: `srun` sets these, the batch script and
/// an `salloc` shell (which Slurm starts once, with the job's `SLURM_NTASKS` and
/// `SLURM_PROCID=0`) have none of them.
fn in_srun_step(env: &dyn Fn(&str) -> Option<String>) -> bool {
    [
        "SLURM_STEP_ID",
        "SLURM_STEPID",
        "SLURM_STEP_NUM_TASKS",
        "SLURM_STEP_NODELIST",
    ]
    .iter()
    .any(|k| env(k).is_some())
}

impl InitConfig {
    /// Reads the process environment (see the module docs for the variables).
    pub fn from_env() -> Result<Self> {
        Self::from_lookup(|k| std::env::var(k).ok())
    }

    /// Reads the variables through `env` instead of the process environment.
    pub fn from_lookup(env: impl Fn(&str) -> Option<String>) -> Result<Self> {
        Self::resolve(&env, None, None)
    }

    /// Like [`from_lookup`](Self::from_lookup), with `rank`/`world_size` given explicitly
    /// overriding the environment's.
    pub fn resolve(
        env: &dyn Fn(&str) -> Option<String>,
        rank: Option<usize>,
        world_size: Option<usize>,
    ) -> Result<Self> {
        let vars = launcher_vars(env);
        let (launcher, env_rank, env_size, local_rank, local_size) = match vars {
            Some(v) => {
                let (lr, ls) = local_of(env, v)?;
                (
                    v.launcher,
                    num(env, v.rank)?.map(|r| (r, v.rank)),
                    num(env, v.size)?.map(|s| (s, v.size)),
                    lr,
                    ls,
                )
            }
            None => (Launcher::Explicit, None, None, None, None),
        };
        let launcher = if rank.is_some() && world_size.is_some() && vars.is_none() {
            Launcher::Explicit
        } else {
            launcher
        };
        let (rank, rank_name) = match (rank, env_rank) {
            (Some(r), _) => (r, "rank"),
            (None, Some((r, n))) => (r, n),
            (None, None) => {
                return Err(init_err(match vars {
                    Some(v) => format!("{} is not set (launcher {})", v.rank, v.launcher),
                    None => "RANK is not set and no launcher (torchrun, Slurm, Open MPI, PMI) \
                             was detected"
                        .to_owned(),
                }));
            }
        };
        let (world_size, size_name) = match (world_size, env_size) {
            (Some(w), _) => (w, "world_size"),
            (None, Some((w, n))) => (w, n),
            (None, None) => {
                return Err(init_err(match vars {
                    Some(v) => format!("{} is not set (launcher {})", v.size, v.launcher),
                    None => "WORLD_SIZE is not set".to_owned(),
                }));
            }
        };
        if world_size == 0 {
            return Err(init_err(format!("{size_name}=0: the world needs a rank")));
        }
        // A program run straight from an `sbatch` script reads the batch step's variables, in
        // which it is rank 0 of the job's tasks, and would wait out its timeout for ranks that
        // nothing starts (torch fails at once there, on a missing `RANK`).
        if launcher == Launcher::Slurm
            && size_name == SLURM.size
            && world_size > 1
            && !in_srun_step(env)
        {
            return Err(init_err(format!(
                "{size_name}={world_size}, but this process is not a task of an srun step (none \
                 of SLURM_STEP_ID, SLURM_STEPID, SLURM_STEP_NUM_TASKS, SLURM_STEP_NODELIST is \
                 set: it is the batch script or an salloc shell, which Slurm starts once); start \
                 the ranks with `srun`, or with distrun, torchrun or mpirun inside the allocation"
            )));
        }
        if rank >= world_size {
            return Err(init_err(format!(
                "{rank_name}={rank} is not below {size_name}={world_size}"
            )));
        }
        // Without local information, assume one host.
        let (local_rank, lr_name) = local_rank.unwrap_or((rank, rank_name));
        let (local_world_size, ls_name) = local_size.unwrap_or((world_size, size_name));
        if local_world_size == 0 || local_world_size > world_size {
            return Err(init_err(format!(
                "{ls_name}={local_world_size} must be between 1 and {size_name}={world_size}"
            )));
        }
        if local_rank >= local_world_size {
            return Err(init_err(format!(
                "{lr_name}={local_rank} is not below {ls_name}={local_world_size}"
            )));
        }
        let master_addr = match env("MASTER_ADDR").filter(|s| !s.trim().is_empty()) {
            Some(a) => Some(a.trim().to_owned()),
            None if launcher == Launcher::Slurm => {
                // The step's nodes, where rank 0 of the step runs (and serves the store); the
                // job's whole allocation only outside a step. A step on part of the allocation
                // looked for its store on the allocation's first node.
                let list = env("SLURM_STEP_NODELIST")
                    .or_else(|| env("SLURM_JOB_NODELIST"))
                    .or_else(|| env("SLURM_NODELIST"));
                match list {
                    Some(list) => Some(first_host(&list)?),
                    None => None,
                }
            }
            None => None,
        };
        let master_port = match env("MASTER_PORT") {
            Some(p) => Some(
                p.trim()
                    .parse::<u16>()
                    .map_err(|_| init_err(format!("MASTER_PORT={p:?} is not a port number")))?,
            ),
            // Slurm jobs without MASTER_PORT: a port derived from the job and step ids, the
            // same on every rank of the step and unlikely to collide with another job's or
            // with another step of this job (two steps at once on one node took one port).
            // The batch step's id is not a number (or unset): step 0.
            None if launcher == Launcher::Slurm => {
                let step = env("SLURM_STEP_ID")
                    .and_then(|v| v.trim().parse::<usize>().ok())
                    .unwrap_or(0);
                num(env, "SLURM_JOB_ID")?.map(|id| slurm_port(id, step))
            }
            None => None,
        };
        let agent_store = match env("TORCHELASTIC_USE_AGENT_STORE") {
            Some(v) if matches!(v.trim(), "True" | "true" | "1") => {
                Some(num(env, "TORCHELASTIC_RESTART_COUNT")?.unwrap_or(0) as u64)
            }
            _ => None,
        };
        Ok(InitConfig {
            rank,
            world_size,
            local_rank,
            local_world_size,
            master_addr,
            master_port,
            launcher,
            agent_store,
        })
    }
}
