//! [`TcpStoreServer`]: one `mio` event-loop thread serving every client.

use std::collections::{HashMap, VecDeque};
use std::io::{self, Read, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use dist_wire::WireError;
use dist_wire::store::{
    CHECK_NOT_READY, CHECK_READY, Limits, Request, RequestDecoder, Response, STOP_WAITING,
    VALIDATION_MAGIC, WAIT_CANCELED,
};
use mio::net::{TcpListener, TcpStream};
use mio::{Events, Interest, Poll, Token, Waker};

use crate::store::StoreError;
use crate::store::kv::Kv;

const LISTENER: Token = Token(0);
const WAKER: Token = Token(1);
const FIRST_CLIENT: usize = 2;
/// torch's libuv server uses the same backlog.
const BACKLOG: i32 = 16384;
/// Bytes read from a socket at a time (each chunk is decoded before the next is read, so no
/// connection buffers more than one request and one chunk).
const READ_CHUNK: usize = 64 * 1024;
/// How long the event loop waits before accepting again after running out of descriptors.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);

/// The resources a [`TcpStoreServer`] may spend on its clients, so that no client, however
/// broken or hostile, can exhaust its memory or descriptors and lock out the others. Each limit
/// that is hit closes the offending connection with a `warn` event naming the client and the
/// limit. Build one as `ServerLimits { field: .., ..ServerLimits::DEFAULT }`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ServerLimits {
    /// What one request may hold (key, value and list lengths, whole message).
    pub decode: Limits,
    /// Most clients connected at once (default 65536). Past it, a new connection first evicts
    /// the oldest connection that has not validated yet; if there is none it is refused. A
    /// job has a client per rank and per launcher agent, and a rank a second one while its
    /// progress watchdog publishes during a blocking call: 4096 refused jobs of 2048 ranks.
    /// The server raises its process's soft open-file limit to the hard one when it starts,
    /// since the usual soft limit (1024) is what ran out first.
    pub max_connections: usize,
    /// Most bytes of partly received requests held for all clients together (default 512 MiB).
    /// The connection whose bytes would pass it is closed.
    pub max_buffered_total: usize,
    /// Most bytes of replies a client has not read yet (default 256 MiB).
    pub max_pending_output: usize,
    /// Most bytes a connection may send before its VALIDATE (default 64; VALIDATE is 5).
    pub max_unvalidated_bytes: usize,
    /// How long a connection may stay without validating (default 30 s).
    pub validation_timeout: Duration,
}

impl ServerLimits {
    /// The default limits.
    pub const DEFAULT: ServerLimits = ServerLimits {
        decode: Limits::DEFAULT,
        max_connections: 65536,
        max_buffered_total: 512 * 1024 * 1024,
        max_pending_output: 256 * 1024 * 1024,
        max_unvalidated_bytes: 64,
        validation_timeout: Duration::from_secs(30),
    };
}

impl Default for ServerLimits {
    fn default() -> Self {
        ServerLimits::DEFAULT
    }
}

/// A TCPStore server speaking PyTorch's protocol: one thread, one `mio` event loop, any number
/// of clients. Waiters are kept per key. Dropping the server stops the thread (through a
/// `mio::Waker`) and closes every connection.
///
/// A client that sends bytes the protocol does not allow (no VALIDATE first, an unknown query,
/// a length over the [`Limits`], a connection closed mid-request) or passes one of the
/// [`ServerLimits`] is disconnected with a `tracing::warn!` naming the reason; every other
/// client and every key are unaffected. Running out of file descriptors evicts connections that
/// never validated and retries, so well-behaved clients still get in.
#[derive(Debug)]
pub struct TcpStoreServer {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    /// Connected clients, kept by the event loop.
    clients: Arc<AtomicUsize>,
    waker: Arc<Waker>,
    thread: Option<JoinHandle<()>>,
}

impl TcpStoreServer {
    /// Starts a server on `port` of every interface (`[::]`, falling back to `0.0.0.0`), as
    /// torch does. Port 0 picks a free port: see [`port`](Self::port).
    pub fn start(port: u16) -> Result<Self, StoreError> {
        let v6 = SocketAddr::new(IpAddr::V6(Ipv6Addr::UNSPECIFIED), port);
        match bind(v6) {
            Ok(l) => Self::serve(l, ServerLimits::DEFAULT),
            Err(e6) => {
                tracing::debug!("tcp store: binding {v6} failed ({e6}); trying 0.0.0.0");
                let v4 = SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), port);
                let l = bind(v4).map_err(|e| bind_error(v4, e))?;
                Self::serve(l, ServerLimits::DEFAULT)
            }
        }
    }

    /// Starts a server on exactly `addr` with the given limits.
    pub fn start_on(addr: SocketAddr, limits: ServerLimits) -> Result<Self, StoreError> {
        let l = bind(addr).map_err(|e| bind_error(addr, e))?;
        Self::serve(l, limits)
    }

    /// Serves on a socket the caller bound and listens on, as torch's `master_listen_fd`
    /// allows: a launcher (or a test) binds port 0, passes the port on, then hands the socket
    /// over, so that no other process can take the port in between.
    pub fn from_listener(listener: std::net::TcpListener) -> Result<Self, StoreError> {
        Self::serve(listener, ServerLimits::DEFAULT)
    }

    fn serve(listener: std::net::TcpListener, limits: ServerLimits) -> Result<Self, StoreError> {
        let addr = listener
            .local_addr()
            .map_err(|e| io_err("listen", "?".into(), e))?;
        // mio polls the listener: accepting must not block the event loop.
        listener
            .set_nonblocking(true)
            .map_err(|e| io_err("listen", addr.to_string(), e))?;
        let poll = Poll::new().map_err(|e| io_err("listen", addr.to_string(), e))?;
        let waker = Arc::new(
            Waker::new(poll.registry(), WAKER)
                .map_err(|e| io_err("listen", addr.to_string(), e))?,
        );
        let mut listener = TcpListener::from_std(listener);
        poll.registry()
            .register(&mut listener, LISTENER, Interest::READABLE)
            .map_err(|e| io_err("listen", addr.to_string(), e))?;
        check_somaxconn();
        raise_open_file_limit();
        let stop = Arc::new(AtomicBool::new(false));
        let clients = Arc::new(AtomicUsize::new(0));
        let mut lp = EventLoop {
            poll,
            listener,
            conns: HashMap::new(),
            next_token: FIRST_CLIENT,
            kv: Kv::default(),
            waiters: HashMap::new(),
            limits,
            stop: Arc::clone(&stop),
            clients: Arc::clone(&clients),
            dirty: Vec::new(),
            unvalidated: VecDeque::new(),
            buffered_total: 0,
            accept_again: None,
        };
        let thread = std::thread::Builder::new()
            .name(format!("tcpstore-{}", addr.port()))
            .spawn(move || lp.run())
            .map_err(|e| io_err("spawn server thread", addr.to_string(), e))?;
        tracing::debug!("tcp store: serving on {addr}");
        Ok(TcpStoreServer {
            addr,
            stop,
            clients,
            waker,
            thread: Some(thread),
        })
    }

    /// The port the server listens on (the one picked when started with port 0).
    pub fn port(&self) -> u16 {
        self.addr.port()
    }

    /// The address the server listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Clients connected now (as the event loop last saw them: a client that just connected
    /// or left may not be counted yet).
    pub fn num_clients(&self) -> usize {
        self.clients.load(Ordering::Relaxed)
    }
}

impl Drop for TcpStoreServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Err(e) = self.waker.wake() {
            tracing::warn!("tcp store: could not wake the server thread to stop it: {e}");
            return;
        }
        if let Some(t) = self.thread.take()
            && t.join().is_err()
        {
            tracing::warn!("tcp store: the server thread panicked");
        }
    }
}

/// `EMFILE`/`ENFILE`: the process or the system has no descriptor left for a new connection.
fn is_out_of_descriptors(e: &io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::EMFILE | libc::ENFILE))
}

fn io_err(op: &'static str, addr: String, source: io::Error) -> StoreError {
    StoreError::Io {
        op,
        addr,
        keys: Vec::new(),
        source,
    }
}

fn bind_error(addr: SocketAddr, source: io::Error) -> StoreError {
    let errno = source.raw_os_error().unwrap_or(0);
    let mut reason = source.to_string();
    if let Some(i) = reason.find(" (os error") {
        reason.truncate(i);
    }
    StoreError::Bind {
        addr: addr.to_string(),
        errno,
        reason,
        source,
    }
}

fn bind(addr: SocketAddr) -> io::Result<std::net::TcpListener> {
    use socket2::{Domain, Protocol, Socket, Type};
    let socket = Socket::new(Domain::for_address(addr), Type::STREAM, Some(Protocol::TCP))?;
    if addr.is_ipv6() {
        // Dual-stack, so IPv4 clients reach `[::]` too.
        socket.set_only_v6(false)?;
    }
    socket.set_reuse_address(true)?;
    socket.set_nonblocking(true)?;
    socket.bind(&addr.into())?;
    socket.listen(BACKLOG)?;
    Ok(socket.into())
}

fn check_somaxconn() {
    if let Ok(s) = std::fs::read_to_string("/proc/sys/net/core/somaxconn")
        && let Ok(n) = s.trim().parse::<i32>()
        && n < 1024
    {
        tracing::warn!(
            "tcp store: /proc/sys/net/core/somaxconn is {n}: many clients connecting at once may \
             be refused and retry"
        );
    }
}

/// Raises this process's soft limit on open files to its hard limit (as Go's runtime does at
/// start): a store server holds a descriptor per client, and the soft limit of 1024 most
/// systems set would refuse the clients of a job of a thousand ranks. The hard limit is left
/// alone; where it is low, the server warns.
#[allow(
    unsafe_code,
    reason = "getrlimit and setrlimit have no safe std equivalent"
)]
fn raise_open_file_limit() {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `getrlimit` writes one `rlimit` into `lim`, a valid, writable value.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0 {
        return;
    }
    if lim.rlim_cur < lim.rlim_max {
        let raised = libc::rlimit {
            rlim_cur: lim.rlim_max,
            rlim_max: lim.rlim_max,
        };
        // SAFETY: `setrlimit` only reads `raised`, a valid `rlimit`; raising the soft limit up
        // to the hard one needs no privilege.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } == 0 {
            lim.rlim_cur = lim.rlim_max;
        }
    }
    if lim.rlim_cur < 4096 {
        tracing::warn!(
            "tcp store: this process may open {} files: a job of more clients than that cannot \
             rendezvous through this server (raise `ulimit -n`)",
            lim.rlim_cur
        );
    }
}

/// One client connection.
struct Conn {
    stream: TcpStream,
    peer: String,
    dec: RequestDecoder,
    /// `dec.buffered()` as counted in [`EventLoop::buffered_total`].
    counted: usize,
    out: Vec<u8>,
    out_pos: usize,
    validated: bool,
    /// The outstanding WAIT: its keys (for cancellation) and how many are still missing.
    wait: Option<Wait>,
}

struct Wait {
    keys: Vec<Vec<u8>>,
    missing: usize,
}

struct EventLoop {
    poll: Poll,
    listener: TcpListener,
    conns: HashMap<Token, Conn>,
    next_token: usize,
    kv: Kv,
    /// key → connections waiting on it (once per occurrence of the key in their WAIT).
    waiters: HashMap<Vec<u8>, Vec<Token>>,
    limits: ServerLimits,
    stop: Arc<AtomicBool>,
    /// `conns.len()`, for [`TcpStoreServer::num_clients`].
    clients: Arc<AtomicUsize>,
    /// Connections with new output to flush.
    dirty: Vec<Token>,
    /// Connections not validated yet, oldest first, with the time they must have validated by
    /// (entries of connections that validated or left are skipped when met).
    unvalidated: VecDeque<(Instant, Token)>,
    /// Bytes of partly received requests, all connections together.
    buffered_total: usize,
    /// Accepting stopped for lack of descriptors; try again at this time (the listener is
    /// edge-triggered: connections already queued raise no new event).
    accept_again: Option<Instant>,
}

impl EventLoop {
    fn run(&mut self) {
        let mut events = Events::with_capacity(1024);
        let mut scratch = vec![0u8; READ_CHUNK];
        loop {
            let timeout = self
                .next_timer()
                .map(|at| at.saturating_duration_since(Instant::now()));
            if let Err(e) = self.poll.poll(&mut events, timeout) {
                if e.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                tracing::error!("tcp store: poll failed, the server stops: {e}");
                return;
            }
            for ev in &events {
                match ev.token() {
                    WAKER => {}
                    LISTENER => self.accept(),
                    t => {
                        if ev.is_readable() || ev.is_read_closed() || ev.is_error() {
                            self.read(t, &mut scratch);
                        }
                        if ev.is_writable() {
                            self.dirty.push(t);
                        }
                    }
                }
            }
            if self.stop.load(Ordering::SeqCst) {
                tracing::debug!("tcp store: server stopping");
                return;
            }
            self.expire_unvalidated();
            if self.accept_again.is_some_and(|at| Instant::now() >= at) {
                self.accept_again = None;
                self.accept();
            }
            self.flush_dirty();
        }
    }

    /// The earliest of the timers the loop keeps: a validation deadline, an accept retry.
    fn next_timer(&self) -> Option<Instant> {
        let validation = self.unvalidated.front().map(|&(at, _)| at);
        match (validation, self.accept_again) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// Closes the connections that did not validate in time.
    fn expire_unvalidated(&mut self) {
        let now = Instant::now();
        while let Some(&(at, t)) = self.unvalidated.front() {
            if self.conns.get(&t).is_none_or(|c| c.validated) {
                self.unvalidated.pop_front();
                continue;
            }
            if at > now {
                break;
            }
            self.unvalidated.pop_front();
            let reason = format!(
                "no VALIDATE within {:?} of connecting",
                self.limits.validation_timeout
            );
            self.close(t, &reason, true);
        }
    }

    /// Closes the oldest connection that has not validated yet, to make room; false if there
    /// is none.
    fn evict_unvalidated(&mut self, why: &str) -> bool {
        while let Some((_, t)) = self.unvalidated.pop_front() {
            if self.conns.get(&t).is_some_and(|c| !c.validated) {
                self.close(t, &format!("evicted before validating: {why}"), true);
                return true;
            }
        }
        false
    }

    fn accept(&mut self) {
        loop {
            match self.listener.accept() {
                Ok((mut stream, peer)) => {
                    if self.conns.len() >= self.limits.max_connections
                        && !self.evict_unvalidated("the server is at its connection limit")
                    {
                        tracing::warn!(
                            %peer,
                            "tcp store: refusing a client: {} clients connected (the limit)",
                            self.conns.len()
                        );
                        continue;
                    }
                    if let Err(e) = stream.set_nodelay(true) {
                        tracing::debug!("tcp store: TCP_NODELAY on {peer}: {e}");
                    }
                    let token = Token(self.next_token);
                    self.next_token += 1;
                    if let Err(e) = self.poll.registry().register(
                        &mut stream,
                        token,
                        Interest::READABLE | Interest::WRITABLE,
                    ) {
                        tracing::warn!("tcp store: cannot register client {peer}: {e}");
                        continue;
                    }
                    self.conns.insert(
                        token,
                        Conn {
                            stream,
                            peer: peer.to_string(),
                            dec: RequestDecoder::new(self.limits.decode),
                            counted: 0,
                            out: Vec::new(),
                            out_pos: 0,
                            validated: false,
                            wait: None,
                        },
                    );
                    self.clients.store(self.conns.len(), Ordering::Relaxed);
                    let deadline =
                        crate::deadline_after(Instant::now(), self.limits.validation_timeout);
                    self.unvalidated.push_back((deadline, token));
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if is_out_of_descriptors(&e) => {
                    // Make room by dropping a connection that never validated, else back off
                    // and retry: the pending connections stay in the backlog meanwhile.
                    if self.evict_unvalidated("the server ran out of file descriptors") {
                        continue;
                    }
                    tracing::warn!("tcp store: accept failed, retrying shortly: {e}");
                    self.accept_again = Some(crate::deadline_after(Instant::now(), ACCEPT_BACKOFF));
                    return;
                }
                Err(e) => {
                    tracing::warn!("tcp store: accept failed: {e}");
                    return;
                }
            }
        }
    }

    /// Reads what `t` has sent, a chunk at a time, handling every complete request after each
    /// chunk, so that a connection never holds more than one partial request plus a chunk, and
    /// the budgets of [`ServerLimits`] are checked as the bytes arrive.
    fn read(&mut self, t: Token, scratch: &mut [u8]) {
        loop {
            let Some(c) = self.conns.get_mut(&t) else {
                return;
            };
            let n = match c.stream.read(scratch) {
                Ok(0) => return self.end_of_stream(t),
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    let reason = format!("read error: {e}");
                    self.close(t, &reason, false);
                    return;
                }
            };
            c.dec.feed(&scratch[..n]);
            if !self.handle_buffered(t) {
                return;
            }
        }
    }

    /// Handles every complete request `t` has buffered, then checks what is left against the
    /// budgets. False when the connection was closed.
    fn handle_buffered(&mut self, t: Token) -> bool {
        loop {
            let next = match self.conns.get_mut(&t) {
                Some(c) => c.dec.next_request(),
                None => return false,
            };
            match next {
                Ok(Some(req)) => {
                    // Pipelined requests answered before any flush: each reply is checked
                    // against the output budget as it is added, not only once written.
                    if let Err(reason) = self
                        .handle(t, req)
                        .and_then(|()| self.check_reply_room(t, 0))
                    {
                        self.close(t, &reason, true);
                        return false;
                    }
                }
                Ok(None) => break,
                Err(e) => {
                    self.close(t, &format!("undecodable request: {e}"), true);
                    return false;
                }
            }
        }
        let Some(c) = self.conns.get_mut(&t) else {
            return false;
        };
        let held = c.dec.buffered();
        self.buffered_total = self.buffered_total - c.counted + held;
        c.counted = held;
        if !c.validated && held > self.limits.max_unvalidated_bytes {
            let reason = format!(
                "{held} bytes sent before VALIDATE (at most {} allowed)",
                self.limits.max_unvalidated_bytes
            );
            self.close(t, &reason, true);
            return false;
        }
        if self.buffered_total > self.limits.max_buffered_total {
            let reason = format!(
                "partly received requests of all clients reached {} bytes (limit {}); this \
                 client holds {held}",
                self.buffered_total, self.limits.max_buffered_total
            );
            self.close(t, &reason, true);
            return false;
        }
        true
    }

    /// The client closed its side: a partial request left is an error; otherwise flush what
    /// is owed (it may have only shut down its write side) and drop it.
    fn end_of_stream(&mut self, t: Token) {
        let left = self.conns.get(&t).map_or(0, |c| c.dec.buffered());
        if left > 0 {
            let e = WireError::Truncated {
                what: "store request",
                needed: left + 1,
                have: left,
            };
            self.close(t, &format!("connection closed mid-request: {e}"), true);
        } else {
            self.flush(t);
            self.close(t, "closed by client", false);
        }
    }

    /// Drops a client and every wait registration it had.
    fn close(&mut self, t: Token, reason: &str, warn: bool) {
        let Some(mut c) = self.conns.remove(&t) else {
            return;
        };
        self.buffered_total -= c.counted;
        self.clients.store(self.conns.len(), Ordering::Relaxed);
        if warn {
            tracing::warn!(peer = %c.peer, "tcp store: dropping client: {reason}");
        } else {
            tracing::trace!(peer = %c.peer, "tcp store: client gone: {reason}");
        }
        if let Some(w) = c.wait.take() {
            self.unregister_waits(t, &w.keys);
        }
        let _ = self.poll.registry().deregister(&mut c.stream);
    }

    fn unregister_waits(&mut self, t: Token, keys: &[Vec<u8>]) {
        for k in keys {
            if let Some(list) = self.waiters.get_mut(k) {
                list.retain(|x| *x != t);
                if list.is_empty() {
                    self.waiters.remove(k);
                }
            }
        }
    }

    /// Refuses a reply of `size` bytes that would take `t`'s unsent output past
    /// `max_pending_output`: the connection is closed instead (the error names why).
    fn check_reply_room(&self, t: Token, size: usize) -> Result<(), String> {
        let pending = self.conns.get(&t).map_or(0, |c| c.out.len() - c.out_pos);
        if pending.saturating_add(size) > self.limits.max_pending_output {
            return Err(format!(
                "a reply of {size} bytes on top of {pending} unsent would pass the output \
                 limit of {} bytes",
                self.limits.max_pending_output
            ));
        }
        Ok(())
    }

    fn reply(&mut self, t: Token, r: &Response) {
        if let Some(c) = self.conns.get_mut(&t) {
            r.encode(&mut c.out);
            self.dirty.push(t);
        }
    }

    /// Tells every waiter on `key` that it exists now.
    fn wake(&mut self, key: &[u8]) {
        if !self.kv.contains(key) {
            return;
        }
        let Some(list) = self.waiters.remove(key) else {
            return;
        };
        for t in list {
            let Some(c) = self.conns.get_mut(&t) else {
                continue;
            };
            if let Some(w) = &mut c.wait {
                w.missing = w.missing.saturating_sub(1);
                if w.missing == 0 {
                    c.wait = None;
                    c.out.push(STOP_WAITING);
                    self.dirty.push(t);
                }
            }
        }
    }

    fn handle(&mut self, t: Token, req: Request) -> Result<(), String> {
        let validated = self.conns.get(&t).is_some_and(|c| c.validated);
        if !validated {
            return match req {
                Request::Validate { magic } if magic == VALIDATION_MAGIC => {
                    if let Some(c) = self.conns.get_mut(&t) {
                        c.validated = true;
                    }
                    Ok(())
                }
                Request::Validate { magic } => Err(format!(
                    "bad VALIDATE magic {magic:#010x} (expected {VALIDATION_MAGIC:#010x})"
                )),
                other => Err(format!(
                    "first request is {} instead of VALIDATE",
                    other.query_type().name()
                )),
            };
        }
        match req {
            Request::Validate { magic } => {
                if magic != VALIDATION_MAGIC {
                    return Err(format!("bad VALIDATE magic {magic:#010x}"));
                }
            }
            Request::Set { key, value } => {
                self.kv.set(&key, &value);
                self.wake(&key);
            }
            Request::CompareSet {
                key,
                expected,
                desired,
            } => {
                let v = self.kv.compare_set(&key, &expected, &desired);
                self.reply(t, &Response::Value(v));
                self.wake(&key);
            }
            Request::Get { key } => {
                let v = self.kv.get(&key).unwrap_or_default().to_vec();
                self.reply(t, &Response::Value(v));
            }
            Request::Add { key, delta } => match self.kv.add(&key, delta) {
                Ok(n) => {
                    self.reply(t, &Response::Int(n));
                    self.wake(&key);
                }
                Err(e) => {
                    return Err(format!(
                        "ADD on key {:?} whose value {:?} is not a decimal integer",
                        String::from_utf8_lossy(&key),
                        crate::store::error::show_value(&e.0)
                    ));
                }
            },
            Request::Check { keys } => {
                let ready = keys.iter().all(|k| self.kv.contains(k));
                let flag = if ready { CHECK_READY } else { CHECK_NOT_READY };
                self.reply(t, &Response::Flag(flag));
            }
            Request::Wait { keys } => self.wait(t, keys)?,
            Request::GetNumKeys => {
                let n = self.kv.num_keys() as i64;
                self.reply(t, &Response::Int(n));
            }
            Request::DeleteKey { key } => {
                let n = i64::from(self.kv.delete(&key));
                self.reply(t, &Response::Int(n));
            }
            Request::Append { key, value } => {
                // A value past the decoder's limit could never be read back: every client's
                // GET of it would fail to decode the reply.
                let had = self.kv.get(&key).map_or(0, <[u8]>::len);
                let would = had.saturating_add(value.len());
                if would as u64 > self.limits.decode.max_value_len {
                    return Err(format!(
                        "APPEND to key {:?} would make its value {would} bytes, past the {} \
                         a client can read back",
                        String::from_utf8_lossy(&key),
                        self.limits.decode.max_value_len
                    ));
                }
                self.kv.append(&key, &value);
                self.wake(&key);
            }
            Request::MultiGet { keys } => {
                // Sized before it is built: one request naming a large value many times
                // would otherwise clone it past any memory before the output budget saw it.
                let size = keys.iter().fold(0usize, |acc, k| {
                    acc.saturating_add(8 + self.kv.get(k).map_or(0, <[u8]>::len))
                });
                self.check_reply_room(t, size)?;
                let vs = keys
                    .iter()
                    .map(|k| self.kv.get(k).unwrap_or_default().to_vec())
                    .collect();
                self.reply(t, &Response::Values(vs));
            }
            Request::MultiSet { pairs } => {
                for (k, v) in &pairs {
                    self.kv.set(k, v);
                }
                for (k, _) in &pairs {
                    self.wake(k);
                }
            }
            Request::CancelWait => {
                let w = self.conns.get_mut(&t).and_then(|c| c.wait.take());
                if let Some(w) = w {
                    self.unregister_waits(t, &w.keys);
                }
                self.reply(t, &Response::Flag(WAIT_CANCELED));
            }
            Request::Ping { nonce } => self.reply(t, &Response::Pong(nonce)),
            Request::QueuePush { key, value } => {
                self.kv.queue_push(&key, &value);
                self.wake(&key);
            }
            Request::QueuePop { key } => {
                let v = self.kv.queue_pop(&key);
                self.reply(t, &Response::Popped(v));
            }
            Request::QueueLen { key } => {
                let n = self.kv.queue_len(&key) as i64;
                self.reply(t, &Response::Int(n));
            }
            Request::ListKeys => {
                let keys = self.kv.keys().cloned().collect();
                self.reply(t, &Response::Keys(keys));
            }
            other => {
                return Err(format!("query {} is not served", other.query_type().name()));
            }
        }
        Ok(())
    }

    fn wait(&mut self, t: Token, keys: Vec<Vec<u8>>) -> Result<(), String> {
        if self.conns.get(&t).is_some_and(|c| c.wait.is_some()) {
            return Err("WAIT while another WAIT of the same connection is outstanding".into());
        }
        let missing: Vec<&Vec<u8>> = keys.iter().filter(|k| !self.kv.contains(k)).collect();
        if missing.is_empty() {
            self.reply(t, &Response::Flag(STOP_WAITING));
            return Ok(());
        }
        for k in &missing {
            self.waiters.entry((*k).clone()).or_default().push(t);
        }
        let n = missing.len();
        if let Some(c) = self.conns.get_mut(&t) {
            c.wait = Some(Wait { keys, missing: n });
        }
        Ok(())
    }

    fn flush_dirty(&mut self) {
        let mut dirty = std::mem::take(&mut self.dirty);
        dirty.sort_unstable();
        dirty.dedup();
        for t in dirty.drain(..) {
            self.flush(t);
        }
        // Keep the allocation.
        if self.dirty.is_empty() {
            self.dirty = dirty;
        }
    }

    fn flush(&mut self, t: Token) {
        let Some(c) = self.conns.get_mut(&t) else {
            return;
        };
        while c.out_pos < c.out.len() {
            match c.stream.write(&c.out[c.out_pos..]) {
                Ok(0) => {
                    self.close(t, "connection closed while writing", false);
                    return;
                }
                Ok(n) => c.out_pos += n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => {
                    let reason = format!("write error: {e}");
                    self.close(t, &reason, false);
                    return;
                }
            }
        }
        if c.out_pos == c.out.len() {
            c.out.clear();
            c.out_pos = 0;
        } else if c.out.len() - c.out_pos > self.limits.max_pending_output {
            let reason = format!(
                "client does not read its replies ({} bytes pending, limit {})",
                c.out.len() - c.out_pos,
                self.limits.max_pending_output
            );
            self.close(t, &reason, true);
        } else if c.out_pos > 64 * 1024 {
            c.out.drain(..c.out_pos);
            c.out_pos = 0;
        }
    }
}
