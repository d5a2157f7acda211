//! Finding rank, world size and the store from a launcher's environment or a URL.
//!
//! * `env://` ([`InitConfig::from_env`]): torchrun's `MASTER_ADDR`, `MASTER_PORT`, `RANK`,
//!   `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`; else Slurm's `SLURM_PROCID`,
//!   `SLURM_NTASKS`, `SLURM_LOCALID`, `SLURM_NTASKS_PER_NODE` with the master on the first host
//!   of `SLURM_JOB_NODELIST`; else Open MPI's `OMPI_COMM_WORLD_RANK`/`_SIZE`/`_LOCAL_RANK`/
//!   `_LOCAL_SIZE`; else PMI's `PMI_RANK`/`PMI_SIZE` (with MPICH's `MPI_LOCALRANKID`/
//!   `MPI_LOCALNRANKS` when set). Rank 0 hosts the [`TcpStore`] server on
//!   `MASTER_ADDR:MASTER_PORT`, as torch does; the others connect. When the launcher runs the
//!   store itself (torchrun and `distrun` set `TORCHELASTIC_USE_AGENT_STORE=True`), rank 0
//!   connects as a client too, and every key lives under `/worker/attempt_<n>` with `n` from
//!   `TORCHELASTIC_RESTART_COUNT`, as in torch, so a restarted job does not see the keys of
//!   the attempt before it.
//! * `tcp://host:port`: the same TCP store, with rank and world size given explicitly (as
//!   arguments or `?rank=..&world_size=..`).
//! * `file:///path`: a [`FileStore`] at that path.
//!
//! The environment is read through a lookup function, so tests (and embedders) pass a map
//! instead of mutating the process environment.
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
use std::time::Duration;

use crate::store::{FileStore, PrefixStore, Store, TcpStore, TcpStoreOptions, TcpStoreServer};
use crate::{Error, Result};

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

/// Reads variable `name` as a non-negative integer; `Ok(None)` when it is not set.
fn num(env: &dyn Fn(&str) -> Option<String>, name: &str) -> Result<Option<usize>> {
    match env(name) {
        None => Ok(None),
        Some(v) => v
            .trim()
            .parse::<usize>()
            .map(Some)
            .map_err(|_| init_err(format!("{name}={v:?} is not a non-negative integer"))),
    }
}

/// The leading integer of a Slurm tasks-per-node value such as `4(x2),3`.
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

const LAUNCHERS: [Vars; 4] = [
    Vars {
        launcher: Launcher::Torchrun,
        rank: "RANK",
        size: "WORLD_SIZE",
        local_rank: &["LOCAL_RANK"],
        local_size: &["LOCAL_WORLD_SIZE"],
    },
    Vars {
        launcher: Launcher::Slurm,
        rank: "SLURM_PROCID",
        size: "SLURM_NTASKS",
        local_rank: &["SLURM_LOCALID"],
        local_size: &["SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE"],
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
];

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
        let vars = LAUNCHERS
            .iter()
            .find(|v| env(v.rank).is_some() || env(v.size).is_some());
        let (launcher, env_rank, env_size, local_rank, local_size) = match vars {
            Some(v) => {
                let mut lr = None;
                for name in v.local_rank {
                    if let Some(x) = num(env, name)? {
                        lr = Some((x, *name));
                        break;
                    }
                }
                let mut ls = None;
                for name in v.local_size {
                    if let Some(x) = leading_num(env, name)? {
                        ls = Some((x, *name));
                        break;
                    }
                }
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
                match env("SLURM_JOB_NODELIST").or_else(|| env("SLURM_NODELIST")) {
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
            // Slurm jobs without MASTER_PORT: a port derived from the job id, the same on
            // every rank of the job and unlikely to collide with another job's.
            None if launcher == Launcher::Slurm => {
                num(env, "SLURM_JOB_ID")?.map(|id| 15000 + (id % 20000) as u16)
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

    /// Makes the TCP store at `master_addr:master_port`: rank 0 starts the server there (and
    /// waits until every rank has joined), the others connect. With
    /// [`agent_store`](Self::agent_store) every rank connects and the store is a
    /// [`PrefixStore`] under `/worker/attempt_<n>`.
    pub fn connect(&self, timeout: Duration) -> Result<InitInfo> {
        let addr = self.master_addr.clone().ok_or_else(|| {
            init_err(format!(
                "MASTER_ADDR is not set (launcher {}, rank {})",
                self.launcher, self.rank
            ))
        })?;
        let port = self.master_port.ok_or_else(|| {
            init_err(format!(
                "MASTER_PORT is not set (launcher {}, rank {})",
                self.launcher, self.rank
            ))
        })?;
        let Some(attempt) = self.agent_store else {
            let store = tcp_store(&addr, port, self.rank, self.world_size, timeout)?;
            return Ok(self.info(store));
        };
        // torch's `_create_c10d_store` with `TORCHELASTIC_USE_AGENT_STORE`: a client on every
        // rank, namespaced by attempt.
        let opts = TcpStoreOptions {
            host: addr,
            port,
            world_size: Some(self.world_size),
            is_master: false,
            timeout,
            wait_for_workers: true,
        };
        let inner: Arc<dyn Store> = Arc::new(TcpStore::new(&opts)?);
        let store = PrefixStore::new(format!("/worker/attempt_{attempt}"), inner);
        Ok(self.info(Arc::new(store)))
    }

    /// [`connect`](Self::connect) for the process that serves the store on `server`, started
    /// by the caller: e.g. on a listener bound to port 0 before its port went to the other
    /// ranks, so that no other process can take the port in between (torch's
    /// `master_listen_fd`). The store owns the server and waits until every rank has joined;
    /// it is reached at `master_addr` (`127.0.0.1` when unset) on the server's port, and
    /// `master_port` is not used. Fails with [`agent_store`](Self::agent_store), where the
    /// launcher serves the store.
    pub fn connect_with_server(
        &self,
        server: TcpStoreServer,
        timeout: Duration,
    ) -> Result<InitInfo> {
        if self.agent_store.is_some() {
            return Err(init_err(format!(
                "rank {} was given a store server, but the launcher serves the store \
                 (TORCHELASTIC_USE_AGENT_STORE)",
                self.rank
            )));
        }
        let host = self.master_addr.as_deref().unwrap_or("127.0.0.1");
        let opts = TcpStoreOptions {
            host: host.to_owned(),
            port: server.port(),
            world_size: Some(self.world_size),
            is_master: true,
            timeout,
            wait_for_workers: true,
        };
        let store = TcpStore::with_server(server, &opts)?;
        Ok(self.info(Arc::new(store)))
    }

    fn info(&self, store: Arc<dyn Store>) -> InitInfo {
        InitInfo {
            rank: self.rank,
            world_size: self.world_size,
            local_rank: self.local_rank,
            local_world_size: self.local_world_size,
            launcher: self.launcher,
            store,
        }
    }
}

fn tcp_store(
    host: &str,
    port: u16,
    rank: usize,
    world_size: usize,
    timeout: Duration,
) -> Result<Arc<dyn Store>> {
    let opts = TcpStoreOptions {
        host: host.to_owned(),
        port,
        world_size: Some(world_size),
        is_master: rank == 0,
        timeout,
        wait_for_workers: true,
    };
    Ok(Arc::new(TcpStore::new(&opts)?))
}

/// Init from a URL (`env://`, `tcp://host:port`, `file:///path`) reading the process
/// environment. `rank`/`world_size` override the environment and are required for `tcp://` and
/// `file://` unless the URL's query gives them (`?rank=0&world_size=2`).
pub fn init_from_url(
    url: &str,
    rank: Option<usize>,
    world_size: Option<usize>,
    timeout: Duration,
) -> Result<InitInfo> {
    init_from_url_with(url, rank, world_size, timeout, &|k| std::env::var(k).ok())
}

/// [`init_from_url`] reading variables through `env`.
pub fn init_from_url_with(
    url: &str,
    rank: Option<usize>,
    world_size: Option<usize>,
    timeout: Duration,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<InitInfo> {
    let (scheme, rest) = url.split_once("://").ok_or_else(|| {
        init_err(format!(
            "init URL {url:?} has no scheme (env://, tcp://, file://)"
        ))
    })?;
    let (body, query) = match rest.split_once('?') {
        Some((b, q)) => (b, Some(q)),
        None => (rest, None),
    };
    let mut rank = rank;
    let mut world_size = world_size;
    for pair in query
        .into_iter()
        .flat_map(|q| q.split('&'))
        .filter(|p| !p.is_empty())
    {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        let parse = |v: &str| {
            v.parse::<usize>().map_err(|_| {
                init_err(format!(
                    "{k}={v:?} in {url:?} is not a non-negative integer"
                ))
            })
        };
        match k {
            "rank" => rank = rank.or(Some(parse(v)?)),
            "world_size" => world_size = world_size.or(Some(parse(v)?)),
            _ => {}
        }
    }
    match scheme {
        "env" => {
            let mut cfg = InitConfig::resolve(env, rank, world_size)?;
            // `env://host:port` names the master explicitly.
            if !body.is_empty() {
                let (h, p) = host_port(body, url)?;
                cfg.master_addr = Some(h);
                cfg.master_port = Some(p);
            }
            cfg.connect(timeout)
        }
        "tcp" => {
            let (host, port) = host_port(body, url)?;
            let cfg = explicit(env, rank, world_size, url)?;
            let store = tcp_store(&host, port, cfg.rank, cfg.world_size, timeout)?;
            Ok(cfg.info(store))
        }
        "file" => {
            if body.is_empty() {
                return Err(init_err(format!("{url:?} names no file")));
            }
            let cfg = explicit(env, rank, world_size, url)?;
            let store = FileStore::new(body, timeout)?;
            Ok(cfg.info(Arc::new(store)))
        }
        other => Err(init_err(format!(
            "unsupported init scheme {other:?} in {url:?} (expected env://, tcp:// or file://)"
        ))),
    }
}

/// Rank and world size given explicitly; local values from the environment when present.
fn explicit(
    env: &dyn Fn(&str) -> Option<String>,
    rank: Option<usize>,
    world_size: Option<usize>,
    url: &str,
) -> Result<InitConfig> {
    let (Some(rank), Some(world_size)) = (rank, world_size) else {
        return Err(init_err(format!(
            "{url:?} needs an explicit rank and world_size (arguments or ?rank=&world_size=)"
        )));
    };
    let local = |name: &str| num(env, name);
    let mut cfg = InitConfig::resolve(&|_| None, Some(rank), Some(world_size))?;
    if let (Some(lr), Some(ls)) = (local("LOCAL_RANK")?, local("LOCAL_WORLD_SIZE")?) {
        if lr >= ls || ls > world_size {
            return Err(init_err(format!(
                "LOCAL_RANK={lr} and LOCAL_WORLD_SIZE={ls} do not fit world_size={world_size}"
            )));
        }
        cfg.local_rank = lr;
        cfg.local_world_size = ls;
    }
    Ok(cfg)
}

/// Splits `host:port`, `[v6]:port`.
fn host_port(s: &str, url: &str) -> Result<(String, u16)> {
    let s = s.trim_end_matches('/');
    let (host, port) = if let Some(rest) = s.strip_prefix('[') {
        let (h, p) = rest
            .split_once(']')
            .ok_or_else(|| init_err(format!("unclosed '[' in {url:?}")))?;
        (h, p.strip_prefix(':').unwrap_or(""))
    } else {
        s.rsplit_once(':')
            .ok_or_else(|| init_err(format!("{url:?} has no port (host:port)")))?
    };
    if host.is_empty() {
        return Err(init_err(format!("{url:?} has no host")));
    }
    let port = port
        .parse::<u16>()
        .map_err(|_| init_err(format!("port {port:?} in {url:?} is not a port number")))?;
    Ok((host.to_owned(), port))
}

/// The most hosts [`expand_nodelist`] produces.
const MAX_HOSTS: usize = 1 << 20;

/// Expands a Slurm host list: `node[01-04,07],gpu1` →
/// `node01 node02 node03 node04 node07 gpu1`; several bracket groups in one name multiply
/// (`r[1-2]n[1-2]` → `r1n1 r1n2 r2n1 r2n2`). Zero padding follows the range's first bound.
pub fn expand_nodelist(list: &str) -> Result<Vec<String>> {
    let mut out = Vec::new();
    for item in split_top(list)? {
        let item = item.trim();
        if item.is_empty() {
            continue;
        }
        expand_item(item, list, &mut out)?;
    }
    if out.is_empty() {
        return Err(init_err(format!(
            "SLURM_JOB_NODELIST={list:?} names no host"
        )));
    }
    Ok(out)
}

/// The first host of a Slurm host list.
pub fn first_host(list: &str) -> Result<String> {
    // Expand only the first item, so a huge list costs nothing more.
    let first = split_top(list)?
        .into_iter()
        .map(str::trim)
        .find(|s| !s.is_empty())
        .ok_or_else(|| init_err(format!("SLURM_JOB_NODELIST={list:?} names no host")))?;
    let mut out = Vec::new();
    expand_item(first, list, &mut out)?;
    out.into_iter()
        .next()
        .ok_or_else(|| init_err(format!("SLURM_JOB_NODELIST={list:?} names no host")))
}

/// Splits at commas outside brackets.
fn split_top(list: &str) -> Result<Vec<&str>> {
    let mut items = Vec::new();
    let mut depth = 0usize;
    let mut start = 0;
    for (i, c) in list.char_indices() {
        match c {
            '[' => depth += 1,
            ']' => {
                depth = depth.checked_sub(1).ok_or_else(|| {
                    init_err(format!("SLURM_JOB_NODELIST={list:?}: unbalanced ']'"))
                })?;
            }
            ',' if depth == 0 => {
                items.push(&list[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    if depth != 0 {
        return Err(init_err(format!(
            "SLURM_JOB_NODELIST={list:?}: unclosed '['"
        )));
    }
    items.push(&list[start..]);
    Ok(items)
}

fn expand_item(item: &str, list: &str, out: &mut Vec<String>) -> Result<()> {
    let Some(open) = item.find('[') else {
        if out.len() >= MAX_HOSTS {
            return Err(init_err(format!(
                "SLURM_JOB_NODELIST={list:?}: too many hosts"
            )));
        }
        out.push(item.to_owned());
        return Ok(());
    };
    let close = item[open..]
        .find(']')
        .map(|c| open + c)
        .ok_or_else(|| init_err(format!("SLURM_JOB_NODELIST={list:?}: unclosed '['")))?;
    let prefix = &item[..open];
    let rest = &item[close + 1..];
    for part in item[open + 1..close].split(',') {
        let part = part.trim();
        let bad = || init_err(format!("SLURM_JOB_NODELIST={list:?}: bad range {part:?}"));
        let (lo_s, hi_s) = part.split_once('-').unwrap_or((part, part));
        if lo_s.is_empty() || !lo_s.bytes().all(|b| b.is_ascii_digit()) {
            return Err(bad());
        }
        let lo: u64 = lo_s.parse().map_err(|_| bad())?;
        let hi: u64 = hi_s.parse().map_err(|_| bad())?;
        if hi < lo || hi - lo >= MAX_HOSTS as u64 {
            return Err(bad());
        }
        let width = lo_s.len();
        for n in lo..=hi {
            expand_item(&format!("{prefix}{n:0width$}{rest}"), list, out)?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let m: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        move |k| m.get(k).cloned()
    }

    fn init_msg(r: Result<InitConfig>) -> String {
        match r {
            Err(Error::Init { what }) => what,
            other => panic!("expected Error::Init, got {other:?}"),
        }
    }

    #[test]
    fn torchrun_variables() {
        let c = InitConfig::from_lookup(env(&[
            ("RANK", "3"),
            ("WORLD_SIZE", "8"),
            ("LOCAL_RANK", "1"),
            ("LOCAL_WORLD_SIZE", "2"),
            ("MASTER_ADDR", "host0"),
            ("MASTER_PORT", "29500"),
        ]))
        .unwrap();
        assert_eq!(
            c,
            InitConfig {
                rank: 3,
                world_size: 8,
                local_rank: 1,
                local_world_size: 2,
                master_addr: Some("host0".into()),
                master_port: Some(29500),
                launcher: Launcher::Torchrun,
                agent_store: None,
            }
        );
    }

    #[test]
    fn agent_store_variables() {
        let base = [("RANK", "0"), ("WORLD_SIZE", "2")];
        let with = |extra: &[(&'static str, &'static str)]| {
            let mut v = base.to_vec();
            v.extend_from_slice(extra);
            InitConfig::from_lookup(env(&v))
        };
        assert_eq!(with(&[]).unwrap().agent_store, None);
        let c = with(&[("TORCHELASTIC_USE_AGENT_STORE", "False")]).unwrap();
        assert_eq!(c.agent_store, None);
        let c = with(&[("TORCHELASTIC_USE_AGENT_STORE", "True")]).unwrap();
        assert_eq!(c.agent_store, Some(0));
        let c = with(&[
            ("TORCHELASTIC_USE_AGENT_STORE", "True"),
            ("TORCHELASTIC_RESTART_COUNT", "3"),
        ])
        .unwrap();
        assert_eq!(c.agent_store, Some(3));
        let m = init_msg(with(&[
            ("TORCHELASTIC_USE_AGENT_STORE", "True"),
            ("TORCHELASTIC_RESTART_COUNT", "x"),
        ]));
        assert!(m.contains("TORCHELASTIC_RESTART_COUNT"), "{m}");
    }

    #[test]
    fn contradictions_name_the_variable() {
        let m = init_msg(InitConfig::from_lookup(env(&[
            ("RANK", "4"),
            ("WORLD_SIZE", "4"),
        ])));
        assert!(m.contains("RANK=4") && m.contains("WORLD_SIZE=4"), "{m}");
        let m = init_msg(InitConfig::from_lookup(env(&[("RANK", "0")])));
        assert!(m.contains("WORLD_SIZE"), "{m}");
        let m = init_msg(InitConfig::from_lookup(env(&[("WORLD_SIZE", "2")])));
        assert!(m.contains("RANK"), "{m}");
        let m = init_msg(InitConfig::from_lookup(env(&[
            ("RANK", "x1"),
            ("WORLD_SIZE", "2"),
        ])));
        assert!(m.contains("RANK=\"x1\""), "{m}");
        let m = init_msg(InitConfig::from_lookup(env(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "0"),
        ])));
        assert!(m.contains("WORLD_SIZE=0"), "{m}");
        let m = init_msg(InitConfig::from_lookup(env(&[
            ("RANK", "1"),
            ("WORLD_SIZE", "4"),
            ("LOCAL_RANK", "2"),
            ("LOCAL_WORLD_SIZE", "2"),
        ])));
        assert!(m.contains("LOCAL_RANK=2"), "{m}");
        let m = init_msg(InitConfig::from_lookup(env(&[
            ("RANK", "1"),
            ("WORLD_SIZE", "4"),
            ("MASTER_PORT", "99999"),
        ])));
        assert!(m.contains("MASTER_PORT"), "{m}");
        let m = init_msg(InitConfig::from_lookup(env(&[])));
        assert!(m.contains("RANK"), "{m}");
    }

    #[test]
    fn slurm_variables_and_nodelist() {
        let c = InitConfig::from_lookup(env(&[
            ("SLURM_PROCID", "5"),
            ("SLURM_NTASKS", "8"),
            ("SLURM_LOCALID", "1"),
            ("SLURM_NTASKS_PER_NODE", "4(x2)"),
            ("SLURM_JOB_NODELIST", "gpu[07-08,10],cpu1"),
            ("SLURM_JOB_ID", "123456"),
        ]))
        .unwrap();
        assert_eq!(c.launcher, Launcher::Slurm);
        assert_eq!(
            (c.rank, c.world_size, c.local_rank, c.local_world_size),
            (5, 8, 1, 4)
        );
        assert_eq!(c.master_addr.as_deref(), Some("gpu07"));
        assert_eq!(c.master_port, Some(15000 + (123_456 % 20000) as u16));
        // MASTER_ADDR/PORT win over Slurm's.
        let c = InitConfig::from_lookup(env(&[
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "1"),
            ("SLURM_JOB_NODELIST", "n1"),
            ("MASTER_ADDR", "m"),
            ("MASTER_PORT", "1234"),
        ]))
        .unwrap();
        assert_eq!(c.master_addr.as_deref(), Some("m"));
        assert_eq!(c.master_port, Some(1234));
        let m = init_msg(InitConfig::from_lookup(env(&[
            ("SLURM_PROCID", "8"),
            ("SLURM_NTASKS", "8"),
        ])));
        assert!(
            m.contains("SLURM_PROCID=8") && m.contains("SLURM_NTASKS=8"),
            "{m}"
        );
    }

    #[test]
    fn mpi_and_pmi_variables() {
        let c = InitConfig::from_lookup(env(&[
            ("OMPI_COMM_WORLD_RANK", "2"),
            ("OMPI_COMM_WORLD_SIZE", "4"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "0"),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "2"),
        ]))
        .unwrap();
        assert_eq!(c.launcher, Launcher::OpenMpi);
        assert_eq!(
            (c.rank, c.world_size, c.local_rank, c.local_world_size),
            (2, 4, 0, 2)
        );
        let c = InitConfig::from_lookup(env(&[("PMI_RANK", "1"), ("PMI_SIZE", "3")])).unwrap();
        assert_eq!(c.launcher, Launcher::Pmi);
        assert_eq!(
            (c.rank, c.world_size, c.local_rank, c.local_world_size),
            (1, 3, 1, 3)
        );
        // torchrun's variables take precedence over a surrounding launcher's.
        let c = InitConfig::from_lookup(env(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "2"),
            ("PMI_RANK", "1"),
            ("PMI_SIZE", "3"),
        ]))
        .unwrap();
        assert_eq!(c.launcher, Launcher::Torchrun);
        assert_eq!((c.rank, c.world_size), (0, 2));
    }

    #[test]
    fn explicit_arguments_override() {
        let c = InitConfig::resolve(&env(&[("RANK", "3"), ("WORLD_SIZE", "4")]), Some(1), None)
            .unwrap();
        assert_eq!((c.rank, c.world_size), (1, 4));
        let c = InitConfig::resolve(&env(&[]), Some(0), Some(2)).unwrap();
        assert_eq!(c.launcher, Launcher::Explicit);
        assert_eq!((c.local_rank, c.local_world_size), (0, 2));
        let e = InitConfig::resolve(&env(&[]), Some(2), Some(2)).unwrap_err();
        assert!(e.to_string().contains("rank=2"), "{e}");
    }

    #[test]
    fn nodelists() {
        assert_eq!(
            expand_nodelist("node[01-04,07],gpu1").unwrap(),
            ["node01", "node02", "node03", "node04", "node07", "gpu1"]
        );
        assert_eq!(
            expand_nodelist("r[1-2]n[8-9]").unwrap(),
            ["r1n8", "r1n9", "r2n8", "r2n9"]
        );
        assert_eq!(expand_nodelist("a,b").unwrap(), ["a", "b"]);
        assert_eq!(expand_nodelist("x[9-11]").unwrap(), ["x9", "x10", "x11"]);
        assert_eq!(first_host("node[001-999999],z").unwrap(), "node001");
        assert_eq!(first_host(" ,host-a.example").unwrap(), "host-a.example");
        for bad in ["n[1-", "n]", "n[4-2]", "n[a-b]", "", "n[-3]"] {
            assert!(expand_nodelist(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn host_ports() {
        assert_eq!(host_port("h:1", "u").unwrap(), ("h".into(), 1));
        assert_eq!(
            host_port("[::1]:29500", "u").unwrap(),
            ("::1".into(), 29500)
        );
        assert!(host_port("h", "u").is_err());
        assert!(host_port(":5", "u").is_err());
        assert!(host_port("h:70000", "u").is_err());
    }

    #[test]
    fn urls_need_rank_and_world_size() {
        let none = |_: &str| None;
        let t = Duration::from_millis(100);
        let e = init_from_url_with("tcp://127.0.0.1:1", None, Some(2), t, &none).unwrap_err();
        assert!(e.to_string().contains("rank"), "{e}");
        let e = init_from_url_with("bogus://x", Some(0), Some(1), t, &none).unwrap_err();
        assert!(e.to_string().contains("bogus"), "{e}");
        let e = init_from_url_with("no-scheme", Some(0), Some(1), t, &none).unwrap_err();
        assert!(matches!(e, Error::Init { .. }), "{e}");
        let e = init_from_url_with(
            "env://",
            None,
            None,
            t,
            &env(&[("RANK", "0"), ("WORLD_SIZE", "1")]),
        )
        .unwrap_err();
        assert!(e.to_string().contains("MASTER_ADDR"), "{e}");
    }
}
