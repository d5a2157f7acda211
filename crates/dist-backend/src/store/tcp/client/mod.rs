//! [`TcpStore`]: the client of PyTorch's TCPStore protocol. This file holds its options and
//! its construction (joining the `init/` counter, waiting for workers); `pool.rs` the
//! connections it lends, `call.rs` one request and its reply, `connect.rs` opening a
//! connection, `store_impl.rs` the [`Store`] operations.

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use dist_wire::store::{
    CHECK_READY, INIT_KEY, KEY_PREFIX, Limits, ReplyKind, Request, Response, STOP_WAITING,
    VALIDATION_MAGIC, WAIT_CANCELED, decode_response,
};

use super::server::TcpStoreServer;
use crate::DEFAULT_TIMEOUT;
use crate::store::error::key_list;
use crate::store::{Store, StoreError, optional_deadline};

mod call;
mod connect;
mod pool;
mod store_impl;

use call::{Call, prefixed};
use connect::connect_with_retry;
use pool::{Conn, Pool, Use};

/// How a [`TcpStore`] is made; the fields of torch's
/// `TCPStore(host_name, port, world_size, is_master, timeout, wait_for_workers)`.
#[derive(Clone, Debug)]
pub struct TcpStoreOptions {
    /// Host of the server.
    pub host: String,
    /// Port of the server; with `is_master`, 0 picks a free one.
    pub port: u16,
    /// Number of clients (workers) expected; `None` skips the `init/` counter.
    pub world_size: Option<usize>,
    /// Start the server in this process.
    pub is_master: bool,
    /// Timeout of connecting, `get`, `wait` and waiting for workers; `Duration::MAX` waits
    /// forever.
    pub timeout: Duration,
    /// Every client increments `init/`; the master waits until `world_size` have.
    pub wait_for_workers: bool,
}

impl TcpStoreOptions {
    /// Options with torch's defaults: no world size, not master, 300 s, wait for workers.
    pub fn new(host: impl Into<String>, port: u16) -> Self {
        TcpStoreOptions {
            host: host.into(),
            port,
            world_size: None,
            is_master: false,
            timeout: DEFAULT_TIMEOUT,
            wait_for_workers: true,
        }
    }
}

/// A client of a TCPStore server (ours or torch's): user keys travel as `/key`, every `get`
/// waits for its key first, and a `wait` that times out is cancelled with `CANCEL_WAIT`, leaving
/// the connection usable.
///
/// Many threads may use one store at once (a watchdog publishing progress, a barrier polling,
/// a thread blocked in `get`): the store keeps a small pool of connections, at most
/// [`MAX_CONNECTIONS`](Self::MAX_CONNECTIONS), each lent to one call at a time, because the
/// protocol answers in order and a connection inside a `WAIT` can carry nothing else until it
/// ends. Calls that may block (`wait`, and `get`, `multi_get` or blocking `queue_pop` whose keys
/// are still missing) hold at most `MAX_CONNECTIONS - 1` connections together, so a `set`,
/// `add` or `get` of a key that exists never queues behind them (a CHECK first tells whether a
/// call needs to block at all). Further blocking calls queue, within their own timeout, and
/// look again now and then whether their keys appeared meanwhile. A connection is opened when
/// a call finds none idle and the pool is not full; one that failed is closed (never lent
/// again, so no stale reply is read), and the next call opens another. Past
/// [`MAX_IDLE`](Self::MAX_IDLE) idle connections, one given back is closed.
///
/// When made with `is_master` (see [`TcpStore::new`]) it also owns the [`TcpStoreServer`], which
/// stops when the store is dropped.
#[derive(Debug)]
pub struct TcpStore {
    addr: String,
    host: String,
    port: u16,
    timeout: Duration,
    limits: Limits,
    pool: Mutex<Pool>,
    /// Signalled whenever a connection (or room for one) is given back to the pool.
    freed: Condvar,
    // Declared last, so that the connections close before the server stops.
    server: Option<TcpStoreServer>,
}

impl TcpStore {
    /// The most connections one store opens to its server. One of them is always left to
    /// requests that do not block, so at most `MAX_CONNECTIONS - 1` blocking waits are on the
    /// wire at once; more queue for a connection.
    pub const MAX_CONNECTIONS: usize = 8;

    /// The most idle connections a store keeps once its calls give them back (one for the
    /// main thread, one for a watchdog's or monitor's calls); the others are closed, and
    /// opened again when calls at once need more.
    pub const MAX_IDLE: usize = 2;

    /// Connects to the server at `host:port`, retrying with exponential backoff and jitter until
    /// `timeout`. Does not touch the `init/` counter. The first connection is made here, so
    /// that an unreachable server is reported at once; the others are opened when needed.
    pub fn connect(host: &str, port: u16, timeout: Duration) -> Result<Self, StoreError> {
        Self::connect_until(host, port, timeout, optional_deadline(timeout))
    }

    /// [`connect`](Self::connect), retrying until `deadline` (`None`: forever) rather than
    /// `timeout` from now; `timeout` stays the store's timeout for later calls.
    fn connect_until(
        host: &str,
        port: u16,
        timeout: Duration,
        deadline: Option<Instant>,
    ) -> Result<Self, StoreError> {
        let addr = format!("{host}:{port}");
        let conn = connect_with_retry(host, port, &addr, deadline)?;
        Ok(TcpStore {
            addr,
            host: host.to_owned(),
            port,
            timeout,
            limits: Limits::DEFAULT,
            pool: Mutex::new(Pool {
                idle: vec![conn],
                open: 1,
                blocking: 0,
                peak: 1,
            }),
            freed: Condvar::new(),
            server: None,
        })
    }

    /// torch's `TCPStore(host, port, world_size, is_master, timeout, wait_for_workers)`: starts
    /// the server when `is_master`, connects, and with `wait_for_workers` and a world size,
    /// increments `init/` and (on the master) waits until `world_size` clients have.
    pub fn new(opts: &TcpStoreOptions) -> Result<Self, StoreError> {
        Self::new_until(opts, optional_deadline(opts.timeout))
    }

    /// [`new`](Self::new) ending by `deadline`, that of the call it serves (init's), instead
    /// of `opts.timeout` from now: connecting and waiting for the workers end by it, so the
    /// time the store takes to come up is not added to the rest of that call. `opts.timeout`
    /// stays the store's timeout for later calls.
    pub fn new_by(opts: &TcpStoreOptions, deadline: Instant) -> Result<Self, StoreError> {
        Self::new_until(opts, Some(deadline))
    }

    fn new_until(opts: &TcpStoreOptions, deadline: Option<Instant>) -> Result<Self, StoreError> {
        if opts.is_master {
            return TcpStore::with_server_until(TcpStoreServer::start(opts.port)?, opts, deadline);
        }
        let store = TcpStore::connect_until(&opts.host, opts.port, opts.timeout, deadline)?;
        store.join(opts, deadline)?;
        Ok(store)
    }

    /// The master's store over a server the caller started, as torch's `master_listen_fd`
    /// allows: e.g. on a listener bound to port 0 whose port was passed to the workers first,
    /// so that no other process can take the port in between. Connects to `opts.host` at the
    /// server's port (`opts.port` and `opts.is_master` are not used), owns the server, and
    /// waits for workers as [`new`](Self::new) does.
    pub fn with_server(server: TcpStoreServer, opts: &TcpStoreOptions) -> Result<Self, StoreError> {
        Self::with_server_until(server, opts, optional_deadline(opts.timeout))
    }

    /// [`with_server`](Self::with_server) ending by `deadline` (see [`new_by`](Self::new_by)).
    pub fn with_server_by(
        server: TcpStoreServer,
        opts: &TcpStoreOptions,
        deadline: Instant,
    ) -> Result<Self, StoreError> {
        Self::with_server_until(server, opts, Some(deadline))
    }

    fn with_server_until(
        server: TcpStoreServer,
        opts: &TcpStoreOptions,
        deadline: Option<Instant>,
    ) -> Result<Self, StoreError> {
        let mut store = TcpStore::connect_until(&opts.host, server.port(), opts.timeout, deadline)?;
        store.server = Some(server);
        store.join(opts, deadline)?;
        Ok(store)
    }

    /// With `wait_for_workers` and a world size, joins the `init/` counter by `deadline`.
    fn join(&self, opts: &TcpStoreOptions, deadline: Option<Instant>) -> Result<(), StoreError> {
        if opts.wait_for_workers
            && let Some(world) = opts.world_size
        {
            self.wait_for_workers(world, deadline)?;
        }
        Ok(())
    }

    /// Increments `init/`; on the master, polls it every 10 ms until `world_size` clients have.
    /// Every request of the join shares one deadline, so that a server that stops answering
    /// midway fails the join by it, not one timeout per poll.
    fn wait_for_workers(
        &self,
        world_size: usize,
        deadline: Option<Instant>,
    ) -> Result<(), StoreError> {
        let start = Instant::now();
        let mut joined = self.add_raw("wait_for_workers", INIT_KEY, 1, deadline)?;
        if self.server.is_none() {
            return Ok(());
        }
        while joined < world_size as i64 {
            let waited = start.elapsed();
            if deadline.is_some_and(|d| Instant::now() >= d) {
                return Err(StoreError::WorkersMissing {
                    addr: self.addr.clone(),
                    joined,
                    expected: world_size,
                    waited,
                });
            }
            std::thread::sleep(Duration::from_millis(10));
            joined = self.add_raw("wait_for_workers", INIT_KEY, 0, deadline)?;
        }
        Ok(())
    }

    /// The server's port (the one picked when the master started with port 0).
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The server's host as given.
    pub fn host(&self) -> &str {
        &self.host
    }

    /// The server this store started, when it is the master.
    pub fn server(&self) -> Option<&TcpStoreServer> {
        self.server.as_ref()
    }

    /// Every key in the store as the server holds it (`/k` for user keys, `init/`).
    pub fn list_keys(&self) -> Result<Vec<String>, StoreError> {
        let call = Call::new("list_keys", &[], self.timeout);
        self.quick(&call, &Request::ListKeys, |r| match r {
            Response::Keys(ks) => Ok(ks
                .into_iter()
                .map(|k| String::from_utf8_lossy(&k).into_owned())
                .collect()),
            other => Err(other),
        })
    }

    /// Connections open now (idle, lent out or connecting). For tests of the pool.
    #[doc(hidden)]
    pub fn open_connections(&self) -> usize {
        self.lock().open
    }

    /// The most connections that were open at once. For tests of the pool.
    #[doc(hidden)]
    pub fn peak_connections(&self) -> usize {
        self.lock().peak
    }

    fn add_raw(
        &self,
        op: &'static str,
        raw_key: &str,
        delta: i64,
        deadline: Option<Instant>,
    ) -> Result<i64, StoreError> {
        let keys = [raw_key];
        let mut call = Call::new(op, &keys, self.timeout);
        call.prefixed = false;
        call.deadline = deadline;
        let req = Request::Add {
            key: raw_key.as_bytes().to_vec(),
            delta,
        };
        self.quick(&call, &req, |r| match r {
            Response::Int(n) => Ok(n),
            other => Err(other),
        })
    }
}
