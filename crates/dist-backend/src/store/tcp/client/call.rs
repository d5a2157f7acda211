//! One call to the server: the request on a lent connection, its reply read by the call's
//! deadline, and every failure named with the operation and its keys.

use super::*;

/// One call of the store API: what errors name, and until when it may wait.
pub(super) struct Call<'k> {
    pub(super) op: &'static str,
    /// The caller's keys.
    pub(super) keys: &'k [&'k str],
    /// Whether the keys travel with [`KEY_PREFIX`] (user keys) or as they are (`init/`).
    pub(super) prefixed: bool,
    pub(super) start: Instant,
    /// `None`: no deadline (a timeout of `Duration::MAX`).
    pub(super) deadline: Option<Instant>,
}

impl<'k> Call<'k> {
    pub(super) fn new(op: &'static str, keys: &'k [&'k str], timeout: Duration) -> Self {
        Self::until(op, keys, optional_deadline(timeout))
    }

    /// A call that ends by `deadline` (`None`: never), the caller's rather than the store's.
    pub(super) fn until(op: &'static str, keys: &'k [&'k str], deadline: Option<Instant>) -> Self {
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
    /// One request and its reply on a connection of its own; `want` picks the value out of the
    /// reply, or hands back a reply of the wrong kind.
    pub(super) fn quick<T>(
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
    pub(super) fn roundtrip<T>(
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

    pub(super) fn io(&self, call: &Call<'_>, source: io::Error) -> StoreError {
        StoreError::Io {
            op: call.op,
            addr: self.addr.clone(),
            keys: key_list(call.keys),
            source,
        }
    }

    pub(super) fn protocol(&self, call: &Call<'_>, reason: String) -> StoreError {
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
    pub(super) fn timed_out(&self, call: &Call<'_>) -> StoreError {
        StoreError::Timeout {
            op: call.op,
            addr: self.addr.clone(),
            keys: call.server_keys(),
            waited: call.start.elapsed(),
        }
    }

    pub(super) fn check_sizes(&self, call: &Call<'_>, req: &Request) -> Result<(), StoreError> {
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
    pub(super) fn present(&self, call: &Call<'_>, raw: &[Vec<u8>]) -> Result<bool, StoreError> {
        let req = Request::Check { keys: raw.to_vec() };
        self.quick(call, &req, |r| match r {
            Response::Flag(b) => Ok(b == CHECK_READY),
            other => Err(other),
        })
    }

    /// WAIT on already-prefixed keys until the call's deadline: true once they all exist;
    /// false when the deadline passed and the wait was cancelled with CANCEL_WAIT, which leaves
    /// the connection in step. An error leaves it out of step (the caller closes it).
    pub(super) fn wait_on(
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
    pub(super) fn when_present<T>(
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
pub(super) fn prefixed(key: &str) -> Vec<u8> {
    let mut k = Vec::with_capacity(KEY_PREFIX.len() + key.len());
    k.extend_from_slice(KEY_PREFIX.as_bytes());
    k.extend_from_slice(key.as_bytes());
    k
}
