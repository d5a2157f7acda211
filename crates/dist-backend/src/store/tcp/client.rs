//! [`TcpStore`]: the client of PyTorch's TCPStore protocol.

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use dist_wire::store::{
    INIT_KEY, KEY_PREFIX, Limits, ReplyKind, Request, Response, STOP_WAITING, VALIDATION_MAGIC,
    WAIT_CANCELED, decode_response,
};

use super::server::TcpStoreServer;
use crate::DEFAULT_TIMEOUT;
use crate::store::error::key_list;
use crate::store::{Store, StoreError};

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
    /// Timeout of connecting, `get`, `wait` and waiting for workers.
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
/// the connection usable. Operations from several threads are serialized by a mutex.
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
    conn: Mutex<Option<Conn>>,
    server: Option<TcpStoreServer>,
}

#[derive(Debug)]
struct Conn {
    stream: TcpStream,
    buf: Vec<u8>,
}

/// Why reading a reply stopped.
enum ReadError {
    TimedOut,
    Store(StoreError),
}

impl TcpStore {
    /// Connects to the server at `host:port`, retrying with exponential backoff and jitter until
    /// `timeout`. Does not touch the `init/` counter.
    pub fn connect(host: &str, port: u16, timeout: Duration) -> Result<Self, StoreError> {
        let addr = format!("{host}:{port}");
        let conn = connect_with_retry(host, port, &addr, timeout)?;
        Ok(TcpStore {
            addr,
            host: host.to_owned(),
            port,
            timeout,
            limits: Limits::DEFAULT,
            conn: Mutex::new(Some(conn)),
            server: None,
        })
    }

    /// torch's `TCPStore(host, port, world_size, is_master, timeout, wait_for_workers)`: starts
    /// the server when `is_master`, connects, and with `wait_for_workers` and a world size,
    /// increments `init/` and (on the master) waits until `world_size` clients have.
    pub fn new(opts: &TcpStoreOptions) -> Result<Self, StoreError> {
        let server = if opts.is_master {
            Some(TcpStoreServer::start(opts.port)?)
        } else {
            None
        };
        let port = server.as_ref().map_or(opts.port, TcpStoreServer::port);
        let mut store = TcpStore::connect(&opts.host, port, opts.timeout)?;
        store.server = server;
        if opts.wait_for_workers
            && let Some(world) = opts.world_size
        {
            store.wait_for_workers(world)?;
        }
        Ok(store)
    }

    /// Increments `init/`; on the master, polls it every 10 ms until `world_size` clients have.
    fn wait_for_workers(&self, world_size: usize) -> Result<(), StoreError> {
        let start = Instant::now();
        let mut joined = self.add_raw("wait_for_workers", INIT_KEY, 1)?;
        if self.server.is_none() {
            return Ok(());
        }
        while joined < world_size as i64 {
            let waited = start.elapsed();
            if waited >= self.timeout {
                return Err(StoreError::WorkersMissing {
                    addr: self.addr.clone(),
                    joined,
                    expected: world_size,
                    waited,
                });
            }
            std::thread::sleep(Duration::from_millis(10));
            joined = self.add_raw("wait_for_workers", INIT_KEY, 0)?;
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
        match self.call("list_keys", &[], &Request::ListKeys)? {
            Response::Keys(ks) => Ok(ks
                .into_iter()
                .map(|k| String::from_utf8_lossy(&k).into_owned())
                .collect()),
            other => Err(self.unexpected("list_keys", &[], &other)),
        }
    }

    fn add_raw(&self, op: &'static str, raw_key: &str, delta: i64) -> Result<i64, StoreError> {
        let req = Request::Add {
            key: raw_key.as_bytes().to_vec(),
            delta,
        };
        match self.call(op, &[raw_key], &req)? {
            Response::Int(n) => Ok(n),
            other => Err(self.unexpected(op, &[raw_key], &other)),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Option<Conn>> {
        self.conn.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The connection, reconnecting when an earlier error left none.
    fn conn<'a>(
        &self,
        guard: &'a mut MutexGuard<'_, Option<Conn>>,
    ) -> Result<&'a mut Conn, StoreError> {
        if guard.is_none() {
            **guard = Some(connect_with_retry(
                &self.host,
                self.port,
                &self.addr,
                self.timeout,
            )?);
        }
        guard.as_mut().ok_or_else(|| StoreError::Protocol {
            op: "connect",
            addr: self.addr.clone(),
            keys: Vec::new(),
            reason: "no connection".into(),
        })
    }

    fn io(&self, op: &'static str, keys: &[&str], source: io::Error) -> StoreError {
        StoreError::Io {
            op,
            addr: self.addr.clone(),
            keys: key_list(keys),
            source,
        }
    }

    fn unexpected(&self, op: &'static str, keys: &[&str], got: &Response) -> StoreError {
        StoreError::Protocol {
            op,
            addr: self.addr.clone(),
            keys: key_list(keys),
            reason: format!("unexpected reply {got:?}"),
        }
    }

    fn check_sizes(
        &self,
        op: &'static str,
        keys: &[&str],
        req: &Request,
    ) -> Result<(), StoreError> {
        // Refuse what the server would refuse (and drop us for) before sending it.
        match req.check_limits(&self.limits) {
            Ok(()) => Ok(()),
            Err(source) => Err(StoreError::Wire {
                op,
                addr: self.addr.clone(),
                keys: key_list(keys),
                source,
            }),
        }
    }

    /// Sends `req` and reads its reply (if it has one) within the store timeout. Any failure
    /// drops the connection, so the next call reconnects rather than reading a stale reply.
    fn call(&self, op: &'static str, keys: &[&str], req: &Request) -> Result<Response, StoreError> {
        let mut guard = self.lock();
        let r = self.call_locked(&mut guard, op, keys, req);
        if r.is_err() {
            *guard = None;
        }
        r
    }

    fn call_locked(
        &self,
        guard: &mut MutexGuard<'_, Option<Conn>>,
        op: &'static str,
        keys: &[&str],
        req: &Request,
    ) -> Result<Response, StoreError> {
        let conn = self.conn(guard)?;
        let bytes = req.to_bytes();
        conn.stream
            .write_all(&bytes)
            .map_err(|e| self.io(op, keys, e))?;
        let Some(kind) = req.reply_kind() else {
            return Ok(Response::Flag(0));
        };
        let deadline = Instant::now() + self.timeout;
        match self.read_reply(conn, kind, deadline, op, keys) {
            Ok(r) => Ok(r),
            Err(ReadError::Store(e)) => Err(e),
            Err(ReadError::TimedOut) => Err(StoreError::Timeout {
                op,
                addr: self.addr.clone(),
                keys: key_list(keys),
                waited: self.timeout,
            }),
        }
    }

    fn read_reply(
        &self,
        conn: &mut Conn,
        kind: ReplyKind,
        deadline: Instant,
        op: &'static str,
        keys: &[&str],
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
                        op,
                        addr: self.addr.clone(),
                        keys: key_list(keys),
                        source,
                    }));
                }
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(ReadError::TimedOut);
            }
            conn.stream
                .set_read_timeout(Some(left))
                .map_err(|e| ReadError::Store(self.io(op, keys, e)))?;
            match conn.stream.read(&mut chunk) {
                Ok(0) => {
                    return Err(ReadError::Store(self.io(
                        op,
                        keys,
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
                Err(e) => return Err(ReadError::Store(self.io(op, keys, e))),
            }
        }
    }

    /// WAIT on already-prefixed keys; on timeout, CANCEL_WAIT and keep the connection.
    fn wait_raw(
        &self,
        op: &'static str,
        user_keys: &[&str],
        raw: &[Vec<u8>],
        timeout: Duration,
    ) -> Result<(), StoreError> {
        let mut guard = self.lock();
        let r = self.wait_locked(&mut guard, op, user_keys, raw, timeout);
        if matches!(&r, Err(e) if !e.is_timeout()) {
            *guard = None;
        }
        r
    }

    fn wait_locked(
        &self,
        guard: &mut MutexGuard<'_, Option<Conn>>,
        op: &'static str,
        user_keys: &[&str],
        raw: &[Vec<u8>],
        timeout: Duration,
    ) -> Result<(), StoreError> {
        let start = Instant::now();
        let conn = self.conn(guard)?;
        let req = Request::Wait { keys: raw.to_vec() };
        self.check_sizes(op, user_keys, &req)?;
        conn.stream
            .write_all(&req.to_bytes())
            .map_err(|e| self.io(op, user_keys, e))?;
        let flag = |r: Result<Response, ReadError>| -> Result<Option<u8>, StoreError> {
            match r {
                Ok(Response::Flag(b)) => Ok(Some(b)),
                Ok(other) => Err(self.unexpected(op, user_keys, &other)),
                Err(ReadError::TimedOut) => Ok(None),
                Err(ReadError::Store(e)) => Err(e),
            }
        };
        let first = flag(self.read_reply(conn, ReplyKind::Flag, start + timeout, op, user_keys))?;
        match first {
            Some(STOP_WAITING) => return Ok(()),
            Some(b) => {
                return Err(StoreError::Protocol {
                    op,
                    addr: self.addr.clone(),
                    keys: key_list(user_keys),
                    reason: format!("WAIT answered {b} instead of STOP_WAITING"),
                });
            }
            None => {}
        }
        // Timed out: cancel. The server may have answered STOP_WAITING just before.
        let waited = start.elapsed();
        conn.stream
            .write_all(&Request::CancelWait.to_bytes())
            .map_err(|e| self.io(op, user_keys, e))?;
        let cancel_deadline = Instant::now() + self.timeout.max(Duration::from_secs(1));
        let mut b = flag(self.read_reply(conn, ReplyKind::Flag, cancel_deadline, op, user_keys))?;
        if b == Some(STOP_WAITING) {
            b = flag(self.read_reply(conn, ReplyKind::Flag, cancel_deadline, op, user_keys))?;
        }
        if b != Some(WAIT_CANCELED) {
            return Err(StoreError::Protocol {
                op,
                addr: self.addr.clone(),
                keys: key_list(user_keys),
                reason: format!("CANCEL_WAIT answered {b:?} instead of WAIT_CANCELED"),
            });
        }
        Err(StoreError::Timeout {
            op,
            addr: self.addr.clone(),
            keys: raw
                .iter()
                .map(|k| String::from_utf8_lossy(k).into_owned())
                .collect(),
            waited,
        })
    }

    fn request(
        &self,
        op: &'static str,
        keys: &[&str],
        req: Request,
    ) -> Result<Response, StoreError> {
        self.check_sizes(op, keys, &req)?;
        self.call(op, keys, &req)
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

fn connect_with_retry(
    host: &str,
    port: u16,
    addr: &str,
    timeout: Duration,
) -> Result<Conn, StoreError> {
    let start = Instant::now();
    let mut jitter = Jitter::new();
    let mut delay = Duration::from_millis(10);
    let mut attempts = 0u32;
    loop {
        attempts += 1;
        let left = timeout.saturating_sub(start.elapsed());
        let err = match try_connect(host, port, left.max(Duration::from_millis(10))) {
            Ok(c) => return Ok(c),
            Err(e) => e,
        };
        let waited = start.elapsed();
        if waited >= timeout {
            return Err(StoreError::Connect {
                addr: addr.to_owned(),
                attempts,
                waited,
                source: err,
            });
        }
        let sleep = delay
            .mul_f64(jitter.factor())
            .min(timeout.saturating_sub(waited));
        tracing::debug!(
            "failed to connect/validate to host {addr} - retrying (try={attempts}, \
             timeout={timeout:?}, delay={sleep:?}): {err}"
        );
        std::thread::sleep(sleep);
        delay = (delay * 2).min(Duration::from_secs(1));
    }
}

/// One attempt: TCP connect, VALIDATE, PING with our pid.
fn try_connect(host: &str, port: u16, timeout: Duration) -> io::Result<Conn> {
    let addrs: Vec<SocketAddr> = (host, port).to_socket_addrs()?.collect();
    let mut last = io::Error::new(io::ErrorKind::NotFound, "host resolved to no address");
    for a in addrs {
        match TcpStream::connect_timeout(&a, timeout) {
            Ok(stream) => match handshake(stream, timeout) {
                Ok(c) => return Ok(c),
                Err(e) => last = e,
            },
            Err(e) => last = e,
        }
    }
    Err(last)
}

fn handshake(mut stream: TcpStream, timeout: Duration) -> io::Result<Conn> {
    stream.set_nodelay(true)?;
    let nonce = std::process::id();
    let mut hello = Request::Validate {
        magic: VALIDATION_MAGIC,
    }
    .to_bytes();
    Request::Ping { nonce }.encode(&mut hello);
    stream.write_all(&hello)?;
    stream.set_read_timeout(Some(timeout.max(Duration::from_millis(1))))?;
    let mut pong = [0u8; 4];
    stream.read_exact(&mut pong)?;
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
    fn set(&self, key: &str, value: &[u8]) -> Result<(), StoreError> {
        let req = Request::Set {
            key: prefixed(key),
            value: value.to_vec(),
        };
        self.request("set", &[key], req).map(drop)
    }

    fn get(&self, key: &str) -> Result<Vec<u8>, StoreError> {
        let raw = prefixed(key);
        self.wait_raw("get", &[key], std::slice::from_ref(&raw), self.timeout)?;
        match self.request("get", &[key], Request::Get { key: raw })? {
            Response::Value(v) => Ok(v),
            other => Err(self.unexpected("get", &[key], &other)),
        }
    }

    fn add(&self, key: &str, delta: i64) -> Result<i64, StoreError> {
        match self.request(
            "add",
            &[key],
            Request::Add {
                key: prefixed(key),
                delta,
            },
        )? {
            Response::Int(n) => Ok(n),
            other => Err(self.unexpected("add", &[key], &other)),
        }
    }

    fn compare_set(
        &self,
        key: &str,
        expected: &[u8],
        desired: &[u8],
    ) -> Result<Vec<u8>, StoreError> {
        let req = Request::CompareSet {
            key: prefixed(key),
            expected: expected.to_vec(),
            desired: desired.to_vec(),
        };
        match self.request("compare_set", &[key], req)? {
            Response::Value(v) => Ok(v),
            other => Err(self.unexpected("compare_set", &[key], &other)),
        }
    }

    fn wait(&self, keys: &[&str], timeout: Duration) -> Result<(), StoreError> {
        let raw: Vec<Vec<u8>> = keys.iter().map(|k| prefixed(k)).collect();
        self.wait_raw("wait", keys, &raw, timeout)
    }

    fn check(&self, keys: &[&str]) -> Result<bool, StoreError> {
        let req = Request::Check {
            keys: keys.iter().map(|k| prefixed(k)).collect(),
        };
        match self.request("check", keys, req)? {
            Response::Flag(b) => Ok(b == dist_wire::store::CHECK_READY),
            other => Err(self.unexpected("check", keys, &other)),
        }
    }

    fn delete_key(&self, key: &str) -> Result<bool, StoreError> {
        match self.request(
            "delete_key",
            &[key],
            Request::DeleteKey { key: prefixed(key) },
        )? {
            Response::Int(n) => Ok(n > 0),
            other => Err(self.unexpected("delete_key", &[key], &other)),
        }
    }

    fn num_keys(&self) -> Result<u64, StoreError> {
        match self.request("num_keys", &[], Request::GetNumKeys)? {
            Response::Int(n) => Ok(n.max(0) as u64),
            other => Err(self.unexpected("num_keys", &[], &other)),
        }
    }

    fn append(&self, key: &str, value: &[u8]) -> Result<(), StoreError> {
        let req = Request::Append {
            key: prefixed(key),
            value: value.to_vec(),
        };
        self.request("append", &[key], req).map(drop)
    }

    fn multi_get(&self, keys: &[&str]) -> Result<Vec<Vec<u8>>, StoreError> {
        let raw: Vec<Vec<u8>> = keys.iter().map(|k| prefixed(k)).collect();
        self.wait_raw("multi_get", keys, &raw, self.timeout)?;
        match self.request("multi_get", keys, Request::MultiGet { keys: raw })? {
            Response::Values(vs) => Ok(vs),
            other => Err(self.unexpected("multi_get", keys, &other)),
        }
    }

    fn multi_set(&self, pairs: &[(&str, &[u8])]) -> Result<(), StoreError> {
        let keys: Vec<&str> = pairs.iter().map(|(k, _)| *k).collect();
        let req = Request::MultiSet {
            pairs: pairs
                .iter()
                .map(|(k, v)| (prefixed(k), v.to_vec()))
                .collect(),
        };
        self.request("multi_set", &keys, req).map(drop)
    }

    fn queue_push(&self, key: &str, value: &[u8]) -> Result<(), StoreError> {
        let req = Request::QueuePush {
            key: prefixed(key),
            value: value.to_vec(),
        };
        self.request("queue_push", &[key], req).map(drop)
    }

    fn queue_pop(&self, key: &str, block: bool) -> Result<Option<Vec<u8>>, StoreError> {
        let raw = prefixed(key);
        let start = Instant::now();
        loop {
            if block {
                let left = self.timeout.saturating_sub(start.elapsed());
                self.wait_raw("queue_pop", &[key], std::slice::from_ref(&raw), left)?;
            }
            match self.request("queue_pop", &[key], Request::QueuePop { key: raw.clone() })? {
                Response::Popped(Some(v)) => return Ok(Some(v)),
                Response::Popped(None) if !block => return Ok(None),
                // Another client popped the item between our WAIT and POP: wait again.
                Response::Popped(None) => std::thread::sleep(Duration::from_millis(1)),
                other => return Err(self.unexpected("queue_pop", &[key], &other)),
            }
        }
    }

    fn queue_len(&self, key: &str) -> Result<u64, StoreError> {
        match self.request(
            "queue_len",
            &[key],
            Request::QueueLen { key: prefixed(key) },
        )? {
            Response::Int(n) => Ok(n.max(0) as u64),
            other => Err(self.unexpected("queue_len", &[key], &other)),
        }
    }

    fn timeout(&self) -> Duration {
        self.timeout
    }

    fn serves_others(&self) -> bool {
        self.server.is_some()
    }
}
