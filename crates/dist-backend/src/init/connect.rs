//! Making the job's TCP store from an [`InitConfig`]: served by rank 0, or by the launcher's
//! agent.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::{InitConfig, InitInfo, init_err};
use crate::Result;
use crate::store::{PrefixStore, Store, TcpStore, TcpStoreOptions, TcpStoreServer};

impl InitConfig {
    /// Makes the TCP store at `master_addr:master_port`: rank 0 starts the server there (and
    /// waits until every rank has joined), the others connect. With
    /// [`agent_store`](Self::agent_store) every rank connects and the store is a
    /// [`PrefixStore`] under `/worker/attempt_<n>`.
    pub fn connect(&self, timeout: Duration) -> Result<InitInfo> {
        self.connect_by(timeout, crate::deadline_after(Instant::now(), timeout))
    }

    /// [`connect`](Self::connect) ending by `deadline`, that of the init it serves, instead of
    /// `timeout` from now (connecting, and rank 0's wait for every rank to join); `timeout`
    /// stays the store's timeout for later calls.
    pub fn connect_by(&self, timeout: Duration, deadline: Instant) -> Result<InitInfo> {
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
            let store = tcp_store(&addr, port, self.rank, self.world_size, timeout, deadline)?;
            return Ok(self.info(store));
        };
        // torch's `_create_c10d_store` with `TORCHELASTIC_USE_AGENT_STORE`: a client on every
        // rank, namespaced by attempt.
        crate::net::note_rendezvous_host(&addr);
        let opts = TcpStoreOptions {
            host: addr,
            port,
            world_size: Some(self.world_size),
            is_master: false,
            timeout,
            wait_for_workers: true,
        };
        let inner: Arc<dyn Store> = Arc::new(TcpStore::new_by(&opts, deadline)?);
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
        crate::net::note_rendezvous_host(host);
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

    pub(super) fn info(&self, store: Arc<dyn Store>) -> InitInfo {
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

/// The job's TCP store at `host:port` (served by rank 0), up by `deadline`; `timeout` is its
/// timeout for later calls.
pub(super) fn tcp_store(
    host: &str,
    port: u16,
    rank: usize,
    world_size: usize,
    timeout: Duration,
    deadline: Instant,
) -> Result<Arc<dyn Store>> {
    crate::net::note_rendezvous_host(host);
    let opts = TcpStoreOptions {
        host: host.to_owned(),
        port,
        world_size: Some(world_size),
        is_master: rank == 0,
        timeout,
        wait_for_workers: true,
    };
    Ok(Arc::new(TcpStore::new_by(&opts, deadline)?))
}
