//! The init URLs: `env://`, `tcp://host:port` and `file:///path`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::connect::tcp_store;
use super::env::num;
use super::{InitConfig, InitInfo, init_err};
use crate::Result;
use crate::store::FileStore;

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
    let deadline = crate::deadline_after(Instant::now(), timeout);
    init_url(url, rank, world_size, timeout, deadline, env)
}

/// [`init_from_url`] ending by `deadline`, that of the init it serves, instead of `timeout`
/// from now: connecting to the store and waiting for the other ranks to join it end by it, so
/// the time the store takes to come up is not added to the rest of that init. `timeout` stays
/// the store's timeout for later calls.
pub fn init_from_url_by(
    url: &str,
    rank: Option<usize>,
    world_size: Option<usize>,
    timeout: Duration,
    deadline: Instant,
) -> Result<InitInfo> {
    init_url(url, rank, world_size, timeout, deadline, &|k| {
        std::env::var(k).ok()
    })
}

fn init_url(
    url: &str,
    rank: Option<usize>,
    world_size: Option<usize>,
    timeout: Duration,
    deadline: Instant,
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
            cfg.connect_by(timeout, deadline)
        }
        "tcp" => {
            let (host, port) = host_port(body, url)?;
            let cfg = explicit(env, rank, world_size, url)?;
            let store = tcp_store(&host, port, cfg.rank, cfg.world_size, timeout, deadline)?;
            Ok(cfg.info(store))
        }
        "file" => {
            if body.is_empty() {
                return Err(init_err(format!("{url:?} names no file")));
            }
            let cfg = explicit(env, rank, world_size, url)?;
            // One handle per rank: the last to close deletes the file, as torch's does.
            let store = FileStore::for_workers(body, timeout, cfg.world_size)?;
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
pub(super) fn host_port(s: &str, url: &str) -> Result<(String, u16)> {
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
