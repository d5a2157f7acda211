//! [`TcpStore`]: the client of PyTorch's TCPStore protocol.

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
/// again, so no stale reply is read), and the next call opens another.
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

#[derive(Debug)]
struct Conn {
    stream: TcpStream,
    buf: Vec<u8>,
}

/// The connections of a [`TcpStore`].
#[derive(Debug, Default)]
struct Pool {
    /// Connections in step with the server, waiting for a call.
    idle: Vec<Conn>,
    /// Connections that exist or are being opened: idle, lent out, or connecting.
    open: usize,
    /// Of those, the ones lent to calls that may block.
    blocking: usize,
    /// The most `open` has been, for tests.
    peak: usize,
}

/// What a call wants a connection for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Use {
    /// One request and its reply, answered at once by the server.
    Quick,
    /// A `WAIT`, which may hold the connection until its timeout.
    Blocking,
}

/// A connection's place in the pool while a call holds it. Dropping the slot without
/// [`give_back`](Slot::give_back) (an error, a panic) frees the place, and the connection, which
/// may be out of step with the server, is closed with it.
struct Slot<'a> {
    store: &'a TcpStore,
    use_: Use,
    returned: bool,
}

impl Slot<'_> {
    /// Returns a connection that is in step with the server to the idle ones.
    fn give_back(mut self, conn: Conn) {
        self.returned = true;
        self.store.release(Some(conn), self.use_);
    }
}

impl Drop for Slot<'_> {
    fn drop(&mut self) {
        if !self.returned {
            self.store.release(None, self.use_);
        }
    }
}

/// One call of the store API: what errors name, and until when it may wait.
struct Call<'k> {
    op: &'static str,
    /// The caller's keys.
    keys: &'k [&'k str],
    /// Whether the keys travel with [`KEY_PREFIX`] (user keys) or as they are (`init/`).
    prefixed: bool,
    start: Instant,
    /// `None`: no deadline (a timeout of `Duration::MAX`).
    deadline: Option<Instant>,
}

impl<'k> Call<'k> {
    fn new(op: &'static str, keys: &'k [&'k str], timeout: Duration) -> Self {
        Self::until(op, keys, optional_deadline(timeout))
    }

    /// A call that ends by `deadline` (`None`: never), the caller's rather than the store's.
    fn until(op: &'static str, keys: &'k [&'k str], deadline: Option<Instant>) -> Self {
        Call {
            op,
            keys,
            prefixed: true,
            start: Instant::now(),
            deadline,
        }
    }

    /// Until when a reply to a request sent now may be read: the call's deadline, or a moment
    /// past it for a request sent at its very end (the GET after a WAIT that ended just in
    /// time), so that a healthy server is not called unresponsive for the caller's slowness.
    fn reply_deadline(&self) -> Option<Instant> {
        self.deadline
            .map(|d| d.max(crate::deadline_after(Instant::now(), REPLY_GRACE)))
    }

    /// The keys as the server sees them, for timeout errors.
    fn server_keys(&self) -> Vec<String> {
        let prefix = if self.prefixed { KEY_PREFIX } else { "" };
        self.keys.iter().map(|k| format!("{prefix}{k}")).collect()
    }
}

/// How long past its deadline a call still reads the reply to a request it sent in time.
const REPLY_GRACE: Duration = Duration::from_millis(100);

/// How long a WAIT that timed out waits for the server to confirm its CANCEL_WAIT. A live
/// server answers at once; one that does not is stopped or hung, and the call fails as
/// [`StoreError::Unresponsive`] instead of waiting a second timeout.
const CANCEL_GRACE: Duration = Duration::from_millis(500);

/// Why reading a reply stopped.
enum ReadError {
    TimedOut,
    Store(StoreError),
}

impl TcpStore {
    /// The most connections one store opens to its server. One of them is always left to
    /// requests that do not block, so at most `MAX_CONNECTIONS - 1` blocking waits are on the
    /// wire at once; more queue for a connection.
    pub const MAX_CONNECTIONS: usize = 8;

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

    fn lock(&self) -> MutexGuard<'_, Pool> {
        // The pool's counts are updated in single statements: a panic elsewhere cannot leave
        // them half-changed, so a poisoned lock is still good.
        self.pool.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Lends a connection for `use_`: an idle one, else a new one while the pool has room, else
    /// the first one given back, waiting until the call's deadline.
    fn checkout(&self, use_: Use, call: &Call<'_>) -> Result<(Slot<'_>, Conn), StoreError> {
        self.try_checkout(use_, call.deadline, call)?
            .ok_or_else(|| self.timed_out(call))
    }

    /// A connection for a call that may block, or `None` when its keys (`raw`) appeared while
    /// it queued for one. Every place blocking calls may take can be held by waits on keys that
    /// appear only once this call returns (thread 1 waits for `b`, which thread 2 sets after
    /// its own wait for `a`), so a queued call looks again, with backoff, whether its keys
    /// exist.
    fn checkout_blocking(
        &self,
        call: &Call<'_>,
        raw: &[Vec<u8>],
    ) -> Result<Option<(Slot<'_>, Conn)>, StoreError> {
        let mut pause = Duration::from_millis(5);
        loop {
            let until = earlier(call.deadline, optional_deadline(pause));
            if let Some(lent) = self.try_checkout(Use::Blocking, until, call)? {
                return Ok(Some(lent));
            }
            if call.deadline.is_some_and(|d| Instant::now() >= d) {
                return Err(self.timed_out(call));
            }
            if self.present(call, raw)? {
                return Ok(None);
            }
            pause = (pause * 2).min(Duration::from_millis(200));
        }
    }

    /// [`checkout`](Self::checkout) until `until` (`None`: for ever); `Ok(None)` when it passed
    /// with no place free. A new connection is opened within the call's own deadline.
    fn try_checkout(
        &self,
        use_: Use,
        until: Option<Instant>,
        call: &Call<'_>,
    ) -> Result<Option<(Slot<'_>, Conn)>, StoreError> {
        let mut pool = self.lock();
        loop {
            // Blocking calls leave the last place to quick ones, so that a `set` never waits
            // for a key some other thread waits for.
            let allowed = use_ == Use::Quick || pool.blocking + 1 < Self::MAX_CONNECTIONS;
            if allowed && (!pool.idle.is_empty() || pool.open < Self::MAX_CONNECTIONS) {
                if use_ == Use::Blocking {
                    pool.blocking += 1;
                }
                let slot = Slot {
                    store: self,
                    use_,
                    returned: false,
                };
                if let Some(conn) = pool.idle.pop() {
                    return Ok(Some((slot, conn)));
                }
                pool.open += 1;
                pool.peak = pool.peak.max(pool.open);
                drop(pool);
                // Connect without the lock, so that other calls go on meanwhile. On failure
                // the slot's drop gives the place back.
                let conn = connect_with_retry(&self.host, self.port, &self.addr, call.deadline)?;
                return Ok(Some((slot, conn)));
            }
            pool = match until {
                None => self.freed.wait(pool).unwrap_or_else(|e| e.into_inner()),
                Some(until) => {
                    let left = until.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        return Ok(None);
                    }
                    self.freed
                        .wait_timeout(pool, left)
                        .unwrap_or_else(|e| e.into_inner())
                        .0
                }
            };
        }
    }

    /// Takes back a lent connection: `Some` to lend again, `None` when it was closed.
    fn release(&self, conn: Option<Conn>, use_: Use) {
        let mut pool = self.lock();
        if use_ == Use::Blocking {
            pool.blocking -= 1;
        }
        match conn {
            Some(c) => pool.idle.push(c),
            None => pool.open -= 1,
        }
        drop(pool);
        // Every waiter re-checks: a quick call may take a place a blocking one may not.
        self.freed.notify_all();
    }

    /// One request and its reply on a connection of its own; `want` picks the value out of the
    /// reply, or hands back a reply of the wrong kind.
    fn quick<T>(
        &self,
        call: &Call<'_>,
        req: &Request,
        want: impl FnOnce(Response) -> Result<T, Response>,
    ) -> Result<T, StoreError> {
        // Refuse what the server would refuse (and drop us for) before taking a connection.
        self.check_sizes(call, req)?;
        let (slot, mut conn) = self.checkout(Use::Quick, call)?;
        let v = self.roundtrip(&mut conn, call, req, want)?;
        slot.give_back(conn);
        Ok(v)
    }

    /// Sends `req` on `conn` and reads its reply within the store timeout. A request the
    /// protocol does not answer (`SET`, `APPEND`, `MULTI_SET`, `QUEUE_PUSH`) goes out with a
    /// `PING` behind it, and returns once the `PONG` is back: the server has then applied it,
    /// so a later call of any thread, on any connection of the pool, sees it (with one
    /// connection, TCP's order gave that for free).
    fn roundtrip<T>(
        &self,
        conn: &mut Conn,
        call: &Call<'_>,
        req: &Request,
        want: impl FnOnce(Response) -> Result<T, Response>,
    ) -> Result<T, StoreError> {
        let mut bytes = req.to_bytes();
        let (kind, fence) = match req.reply_kind() {
            Some(kind) => (kind, None),
            None => {
                let nonce = std::process::id();
                Request::Ping { nonce }.encode(&mut bytes);
                (ReplyKind::Pong, Some(nonce))
            }
        };
        self.write_by(conn, call, &bytes)?;
        // The server answers these at once: one that has not by the call's deadline is
        // stopped or hung, whatever the keys.
        let reply = match self.read_reply(conn, kind, call.reply_deadline(), call) {
            Ok(r) => r,
            Err(ReadError::Store(e)) => return Err(e),
            Err(ReadError::TimedOut) => return Err(self.unresponsive(call)),
        };
        match (fence, reply) {
            (None, reply) => want(reply).map_err(|got| self.unexpected(call, &got)),
            (Some(nonce), Response::Pong(n)) if n == nonce => {
                want(Response::Pong(n)).map_err(|got| self.unexpected(call, &got))
            }
            (Some(_), got) => Err(self.unexpected(call, &got)),
        }
    }

    fn send(&self, conn: &mut Conn, call: &Call<'_>, req: &Request) -> Result<(), StoreError> {
        self.write_by(conn, call, &req.to_bytes())
    }

    /// Writes `bytes` before the call's reply deadline: a server that has stopped reading
    /// fills its socket buffer, and the write would otherwise block for ever. The socket's
    /// write timeout restarts with every partial write, so it is set to what is left before
    /// each one.
    fn write_by(&self, conn: &mut Conn, call: &Call<'_>, bytes: &[u8]) -> Result<(), StoreError> {
        let deadline = call.reply_deadline();
        let mut rest = bytes;
        while !rest.is_empty() {
            let left = match deadline {
                None => None,
                Some(d) => {
                    let left = d.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        return Err(self.unresponsive(call));
                    }
                    Some(left)
                }
            };
            conn.stream
                .set_write_timeout(left)
                .map_err(|e| self.io(call, e))?;
            match conn.stream.write(rest) {
                Ok(0) => {
                    return Err(self.io(
                        call,
                        io::Error::new(
                            io::ErrorKind::WriteZero,
                            "the store connection took no bytes",
                        ),
                    ));
                }
                Ok(n) => rest = &rest[n..],
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                    ) =>
                {
                    return Err(self.unresponsive(call));
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(self.io(call, e)),
            }
        }
        Ok(())
    }

    /// The server did not take or answer a request before the call's deadline.
    fn unresponsive(&self, call: &Call<'_>) -> StoreError {
        StoreError::Unresponsive {
            op: call.op,
            addr: self.addr.clone(),
            keys: call.server_keys(),
            waited: call.start.elapsed(),
        }
    }

    fn io(&self, call: &Call<'_>, source: io::Error) -> StoreError {
        StoreError::Io {
            op: call.op,
            addr: self.addr.clone(),
            keys: key_list(call.keys),
            source,
        }
    }

    fn protocol(&self, call: &Call<'_>, reason: String) -> StoreError {
        StoreError::Protocol {
            op: call.op,
            addr: self.addr.clone(),
            keys: key_list(call.keys),
            reason,
        }
    }

    fn unexpected(&self, call: &Call<'_>, got: &Response) -> StoreError {
        self.protocol(call, format!("unexpected reply {got:?}"))
    }

    /// The call's keys did not appear (or no connection came free) before its deadline.
    fn timed_out(&self, call: &Call<'_>) -> StoreError {
        StoreError::Timeout {
            op: call.op,
            addr: self.addr.clone(),
            keys: call.server_keys(),
            waited: call.start.elapsed(),
        }
    }

    fn check_sizes(&self, call: &Call<'_>, req: &Request) -> Result<(), StoreError> {
        req.check_limits(&self.limits)
            .map_err(|source| StoreError::Wire {
                op: call.op,
                addr: self.addr.clone(),
                keys: key_list(call.keys),
                source,
            })
    }

    fn read_reply(
        &self,
        conn: &mut Conn,
        kind: ReplyKind,
        deadline: Option<Instant>,
        call: &Call<'_>,
    ) -> Result<Response, ReadError> {
        let mut chunk = [0u8; 16 * 1024];
        loop {
            match decode_response(kind, &conn.buf, &self.limits) {
                Ok(Some((r, used))) => {
                    conn.buf.drain(..used);
                    return Ok(r);
                }
                Ok(None) => {}
                Err(source) => {
                    return Err(ReadError::Store(StoreError::Wire {
                        op: call.op,
                        addr: self.addr.clone(),
                        keys: key_list(call.keys),
                        source,
                    }));
                }
            }
            let left = match deadline {
                None => None,
                Some(d) => {
                    let left = d.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        return Err(ReadError::TimedOut);
                    }
                    Some(left)
                }
            };
            conn.stream
                .set_read_timeout(left)
                .map_err(|e| ReadError::Store(self.io(call, e)))?;
            match conn.stream.read(&mut chunk) {
                Ok(0) => {
                    return Err(ReadError::Store(self.io(
                        call,
                        io::Error::new(
                            io::ErrorKind::UnexpectedEof,
                            "the store server closed the connection",
                        ),
                    )));
                }
                Ok(n) => conn.buf.extend_from_slice(&chunk[..n]),
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                    ) =>
                {
                    return Err(ReadError::TimedOut);
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(ReadError::Store(self.io(call, e))),
            }
        }
    }

    /// A one-byte reply before `deadline`; `None` when the deadline passed.
    fn read_flag(
        &self,
        conn: &mut Conn,
        deadline: Option<Instant>,
        call: &Call<'_>,
    ) -> Result<Option<u8>, StoreError> {
        match self.read_reply(conn, ReplyKind::Flag, deadline, call) {
            Ok(Response::Flag(b)) => Ok(Some(b)),
            Ok(other) => Err(self.unexpected(call, &other)),
            Err(ReadError::TimedOut) => Ok(None),
            Err(ReadError::Store(e)) => Err(e),
        }
    }

    /// CHECK on a quick connection: true when every key exists already, so the call needs no
    /// blocking connection.
    fn present(&self, call: &Call<'_>, raw: &[Vec<u8>]) -> Result<bool, StoreError> {
        let req = Request::Check { keys: raw.to_vec() };
        self.quick(call, &req, |r| match r {
            Response::Flag(b) => Ok(b == CHECK_READY),
            other => Err(other),
        })
    }

    /// WAIT on already-prefixed keys until the call's deadline: true once they all exist;
    /// false when the deadline passed and the wait was cancelled with CANCEL_WAIT, which leaves
    /// the connection in step. An error leaves it out of step (the caller closes it).
    fn wait_on(
        &self,
        conn: &mut Conn,
        call: &Call<'_>,
        raw: &[Vec<u8>],
    ) -> Result<bool, StoreError> {
        self.send(conn, call, &Request::Wait { keys: raw.to_vec() })?;
        match self.read_flag(conn, call.deadline, call)? {
            Some(STOP_WAITING) => return Ok(true),
            Some(b) => {
                return Err(
                    self.protocol(call, format!("WAIT answered {b} instead of STOP_WAITING"))
                );
            }
            None => {}
        }
        // Timed out: cancel. The server may have answered STOP_WAITING just before, and then
        // the keys are there after all.
        self.send(conn, call, &Request::CancelWait)?;
        let cancel_deadline = optional_deadline(CANCEL_GRACE);
        let mut b = self.read_flag(conn, cancel_deadline, call)?;
        let arrived = b == Some(STOP_WAITING);
        if arrived {
            b = self.read_flag(conn, cancel_deadline, call)?;
        }
        if b.is_none() {
            // No answer at all: the server is stopped or hung (the connection, out of step
            // now, is closed by the caller's slot).
            return Err(self.unresponsive(call));
        }
        if b != Some(WAIT_CANCELED) {
            return Err(self.protocol(
                call,
                format!("CANCEL_WAIT answered {b:?} instead of WAIT_CANCELED"),
            ));
        }
        Ok(arrived)
    }

    /// Waits until every key in `raw` exists, then sends `then` on the same connection and
    /// returns what `want` makes of its reply: `get` and `multi_get`, which wait for their keys
    /// first as torch's client does. Keys that exist already cost a quick CHECK, and no
    /// connection that could block.
    fn when_present<T>(
        &self,
        call: &Call<'_>,
        raw: &[Vec<u8>],
        then: &Request,
        want: impl FnOnce(Response) -> Result<T, Response>,
    ) -> Result<T, StoreError> {
        self.check_sizes(call, then)?;
        if self.present(call, raw)? {
            return self.quick(call, then, want);
        }
        let Some((slot, mut conn)) = self.checkout_blocking(call, raw)? else {
            return self.quick(call, then, want);
        };
        if !self.wait_on(&mut conn, call, raw)? {
            slot.give_back(conn);
            return Err(self.timed_out(call));
        }
        let v = self.roundtrip(&mut conn, call, then, want)?;
        slot.give_back(conn);
        Ok(v)
    }
}

/// `/key`, as torch's client sends user keys.
fn prefixed(key: &str) -> Vec<u8> {
    let mut k = Vec::with_capacity(KEY_PREFIX.len() + key.len());
    k.extend_from_slice(KEY_PREFIX.as_bytes());
    k.extend_from_slice(key.as_bytes());
    k
}

/// A small xorshift generator seeded from the pid and the clock, for backoff jitter.
struct Jitter(u64);

impl Jitter {
    fn new() -> Self {
        let t = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        Jitter((u64::from(std::process::id()) << 32 ^ t) | 1)
    }

    /// A factor in [0.5, 1.5).
    fn factor(&mut self) -> f64 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        0.5 + (x >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// Connects and handshakes, retrying with backoff until `deadline` (`None`: for ever). Every
/// attempt, the TCP connect and the VALIDATE/PING exchange, ends by the deadline: a stopped
/// server's kernel still completes the TCP handshake, but nobody answers the PING.
fn connect_with_retry(
    host: &str,
    port: u16,
    addr: &str,
    deadline: Option<Instant>,
) -> Result<Conn, StoreError> {
    let start = Instant::now();
    let mut jitter = Jitter::new();
    let mut delay = Duration::from_millis(10);
    let mut attempts = 0u32;
    let left = || deadline.map(|d| d.saturating_duration_since(Instant::now()));
    loop {
        attempts += 1;
        // An attempt with no time left still gets a moment, so that a deadline that passed
        // while queueing for the pool reports why connecting failed.
        let budget = left().map(|l| l.max(Duration::from_millis(10)));
        let err = match try_connect(host, port, budget) {
            Ok(c) => return Ok(c),
            Err(e) => e,
        };
        let waited = start.elapsed();
        if left().is_some_and(|l| l.is_zero()) {
            return Err(StoreError::Connect {
                addr: addr.to_owned(),
                attempts,
                waited,
                source: err,
            });
        }
        let sleep = delay.mul_f64(jitter.factor());
        let sleep = left().map_or(sleep, |l| sleep.min(l));
        tracing::debug!(
            "failed to connect/validate to host {addr} - retrying (try={attempts}, \
             waited={waited:?}, delay={sleep:?}): {err}"
        );
        std::thread::sleep(sleep);
        delay = (delay * 2).min(Duration::from_secs(1));
    }
}

/// One attempt: TCP connect, VALIDATE, PING with our pid, all within `timeout` (`None`: no
/// limit).
fn try_connect(host: &str, port: u16, timeout: Option<Duration>) -> io::Result<Conn> {
    let addrs: Vec<SocketAddr> = (host, port).to_socket_addrs()?.collect();
    let mut last = io::Error::new(io::ErrorKind::NotFound, "host resolved to no address");
    for a in addrs {
        let stream = match timeout {
            Some(t) => TcpStream::connect_timeout(&a, t),
            None => TcpStream::connect(a),
        };
        match stream {
            Ok(stream) => match handshake(stream, timeout) {
                Ok(c) => return Ok(c),
                Err(e) => last = e,
            },
            Err(e) => last = e,
        }
    }
    Err(last)
}

fn handshake(mut stream: TcpStream, timeout: Option<Duration>) -> io::Result<Conn> {
    stream.set_nodelay(true)?;
    let timeout = timeout.map(|t| t.max(Duration::from_millis(1)));
    stream.set_write_timeout(timeout)?;
    let nonce = std::process::id();
    let mut hello = Request::Validate {
        magic: VALIDATION_MAGIC,
    }
    .to_bytes();
    Request::Ping { nonce }.encode(&mut hello);
    stream.write_all(&hello)?;
    stream.set_read_timeout(timeout)?;
    let mut pong = [0u8; 4];
    stream.read_exact(&mut pong).map_err(|e| {
        if matches!(
            e.kind(),
            io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
        ) {
            // The kernel of a stopped host still completes the TCP handshake.
            io::Error::new(
                io::ErrorKind::TimedOut,
                "the server accepted the connection but did not answer its PING \
                 (its host may be stopped or hung)",
            )
        } else {
            e
        }
    })?;
    if u32::from_le_bytes(pong) != nonce {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!(
                "PING answered {} instead of our nonce {nonce}",
                u32::from_le_bytes(pong)
            ),
        ));
    }
    Ok(Conn {
        stream,
        buf: Vec::new(),
    })
}

impl Store for TcpStore {
    plain_calls_by_deadline!();

    fn set_by(&self, key: &str, value: &[u8], deadline: Instant) -> Result<(), StoreError> {
        let keys = [key];
        let call = Call::until("set", &keys, Some(deadline));
        let req = Request::Set {
            key: prefixed(key),
            value: value.to_vec(),
        };
        self.quick(&call, &req, no_reply)
    }

    fn get_by(&self, key: &str, deadline: Instant) -> Result<Vec<u8>, StoreError> {
        let keys = [key];
        let call = Call::until("get", &keys, Some(deadline));
        let raw = prefixed(key);
        let req = Request::Get { key: raw.clone() };
        self.when_present(&call, &[raw], &req, |r| match r {
            Response::Value(v) => Ok(v),
            other => Err(other),
        })
    }

    fn add_by(&self, key: &str, delta: i64, deadline: Instant) -> Result<i64, StoreError> {
        let keys = [key];
        let call = Call::until("add", &keys, Some(deadline));
        let req = Request::Add {
            key: prefixed(key),
            delta,
        };
        self.quick(&call, &req, |r| match r {
            Response::Int(n) => Ok(n),
            other => Err(other),
        })
    }

    fn compare_set_by(
        &self,
        key: &str,
        expected: &[u8],
        desired: &[u8],
        deadline: Instant,
    ) -> Result<Vec<u8>, StoreError> {
        let keys = [key];
        let call = Call::until("compare_set", &keys, Some(deadline));
        let req = Request::CompareSet {
            key: prefixed(key),
            expected: expected.to_vec(),
            desired: desired.to_vec(),
        };
        self.quick(&call, &req, |r| match r {
            Response::Value(v) => Ok(v),
            other => Err(other),
        })
    }

    fn wait_by(&self, keys: &[&str], deadline: Instant) -> Result<(), StoreError> {
        let call = Call::until("wait", keys, Some(deadline));
        let raw: Vec<Vec<u8>> = keys.iter().map(|k| prefixed(k)).collect();
        self.check_sizes(&call, &Request::Wait { keys: raw.clone() })?;
        // Keys that exist already need no connection that could block.
        if self.present(&call, &raw)? {
            return Ok(());
        }
        let Some((slot, mut conn)) = self.checkout_blocking(&call, &raw)? else {
            return Ok(());
        };
        let arrived = self.wait_on(&mut conn, &call, &raw)?;
        slot.give_back(conn);
        if arrived {
            Ok(())
        } else {
            Err(self.timed_out(&call))
        }
    }

    fn check_by(&self, keys: &[&str], deadline: Instant) -> Result<bool, StoreError> {
        let call = Call::until("check", keys, Some(deadline));
        let raw: Vec<Vec<u8>> = keys.iter().map(|k| prefixed(k)).collect();
        self.present(&call, &raw)
    }

    fn delete_key_by(&self, key: &str, deadline: Instant) -> Result<bool, StoreError> {
        let keys = [key];
        let call = Call::until("delete_key", &keys, Some(deadline));
        let req = Request::DeleteKey { key: prefixed(key) };
        self.quick(&call, &req, |r| match r {
            Response::Int(n) => Ok(n > 0),
            other => Err(other),
        })
    }

    fn num_keys_by(&self, deadline: Instant) -> Result<u64, StoreError> {
        let call = Call::until("num_keys", &[], Some(deadline));
        self.quick(&call, &Request::GetNumKeys, |r| match r {
            Response::Int(n) => Ok(n.max(0) as u64),
            other => Err(other),
        })
    }

    fn append_by(&self, key: &str, value: &[u8], deadline: Instant) -> Result<(), StoreError> {
        let keys = [key];
        let call = Call::until("append", &keys, Some(deadline));
        let req = Request::Append {
            key: prefixed(key),
            value: value.to_vec(),
        };
        self.quick(&call, &req, no_reply)
    }

    fn multi_get_by(&self, keys: &[&str], deadline: Instant) -> Result<Vec<Vec<u8>>, StoreError> {
        let call = Call::until("multi_get", keys, Some(deadline));
        let raw: Vec<Vec<u8>> = keys.iter().map(|k| prefixed(k)).collect();
        let req = Request::MultiGet { keys: raw.clone() };
        self.when_present(&call, &raw, &req, |r| match r {
            Response::Values(vs) => Ok(vs),
            other => Err(other),
        })
    }

    fn multi_set_by(&self, pairs: &[(&str, &[u8])], deadline: Instant) -> Result<(), StoreError> {
        let keys: Vec<&str> = pairs.iter().map(|(k, _)| *k).collect();
        let call = Call::until("multi_set", &keys, Some(deadline));
        let req = Request::MultiSet {
            pairs: pairs
                .iter()
                .map(|(k, v)| (prefixed(k), v.to_vec()))
                .collect(),
        };
        self.quick(&call, &req, no_reply)
    }

    fn queue_push_by(&self, key: &str, value: &[u8], deadline: Instant) -> Result<(), StoreError> {
        let keys = [key];
        let call = Call::until("queue_push", &keys, Some(deadline));
        let req = Request::QueuePush {
            key: prefixed(key),
            value: value.to_vec(),
        };
        self.quick(&call, &req, no_reply)
    }

    fn queue_pop_by(
        &self,
        key: &str,
        block: bool,
        deadline: Instant,
    ) -> Result<Option<Vec<u8>>, StoreError> {
        let keys = [key];
        let call = Call::until("queue_pop", &keys, Some(deadline));
        let raw = prefixed(key);
        let pop = Request::QueuePop { key: raw.clone() };
        let popped = |r| match r {
            Response::Popped(v) => Ok(v),
            other => Err(other),
        };
        let raw = std::slice::from_ref(&raw);
        loop {
            // Try at once: the queue usually has an item, or the caller does not block.
            if let Some(v) = self.quick(&call, &pop, popped)? {
                return Ok(Some(v));
            }
            if !block {
                return Ok(None);
            }
            // `None`: an item came while queued for a connection: pop again.
            let Some((slot, mut conn)) = self.checkout_blocking(&call, raw)? else {
                continue;
            };
            loop {
                // WAIT ends once the queue is non-empty.
                if !self.wait_on(&mut conn, &call, raw)? {
                    slot.give_back(conn);
                    return Err(self.timed_out(&call));
                }
                // `None`: another client popped the item first; wait for the next.
                if let Some(v) = self.roundtrip(&mut conn, &call, &pop, popped)? {
                    slot.give_back(conn);
                    return Ok(Some(v));
                }
            }
        }
    }

    fn queue_len_by(&self, key: &str, deadline: Instant) -> Result<u64, StoreError> {
        let keys = [key];
        let call = Call::until("queue_len", &keys, Some(deadline));
        let req = Request::QueueLen { key: prefixed(key) };
        self.quick(&call, &req, |r| match r {
            Response::Int(n) => Ok(n.max(0) as u64),
            other => Err(other),
        })
    }

    fn timeout(&self) -> Duration {
        self.timeout
    }

    fn serves_others(&self) -> bool {
        self.server.is_some()
    }
}

/// The earlier of two deadlines, `None` being none.
fn earlier(a: Option<Instant>, b: Option<Instant>) -> Option<Instant> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, None) => a,
        (None, b) => b,
    }
}

/// `want` for requests without a reply of their own ([`TcpStore::roundtrip`] passes the
/// `PONG` that confirmed them).
fn no_reply(_: Response) -> Result<(), Response> {
    Ok(())
}
