//! The [`Store`] operations over the protocol's requests.

use super::*;
use crate::store::error::show_value;
use crate::store::kv::parse_counter;

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
        .map_err(|e| self.why_add_failed(key, deadline, e))
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

/// How long an `add` that failed on a closed connection may spend finding out why.
const WHY_ADD_FAILED_WITHIN: Duration = Duration::from_millis(500);

impl TcpStore {
    /// What to report for an `add` that failed with `err`. The protocol has no error reply
    /// (torch's server answers a bad `ADD` by closing the connection, and ours does as it
    /// does), so a closed connection is all the client sees when the key holds text. Where the
    /// key then holds a value that is not a decimal integer, that is said, as the file and
    /// hash stores say it; otherwise `err` stands, as it does where the server does not answer
    /// within [`WHY_ADD_FAILED_WITHIN`] or the value read back is empty (a GET of a key
    /// deleted since the CHECK reads so too, and nothing would be said rather than a wrong
    /// thing).
    fn why_add_failed(&self, key: &str, deadline: Instant, err: StoreError) -> StoreError {
        let closed = matches!(&err, StoreError::Io { source, .. } if matches!(
            source.kind(),
            io::ErrorKind::UnexpectedEof | io::ErrorKind::ConnectionReset
        ));
        if !closed {
            return err;
        }
        let keys = [key];
        // Briefly: a closed connection is also what a dead server leaves, and the CHECK may
        // need a new connection, which would retry until the add's own deadline. A live server
        // answers these two in far less; one that does not leaves `err` standing.
        let quick = deadline.min(crate::deadline_after(Instant::now(), WHY_ADD_FAILED_WITHIN));
        let call = Call::until("add", &keys, Some(quick));
        let raw = prefixed(key);
        // CHECK before GET: the server answers a GET of a missing key with an empty value,
        // which would read as text.
        if !matches!(self.present(&call, std::slice::from_ref(&raw)), Ok(true)) {
            return err;
        }
        match self.quick(&call, &Request::Get { key: raw }, |r| match r {
            Response::Value(v) => Ok(v),
            other => Err(other),
        }) {
            Ok(v) if !v.is_empty() && parse_counter(&v).is_none() => StoreError::NotACounter {
                addr: self.addr.clone(),
                key: key.to_owned(),
                value: show_value(&v),
            },
            _ => err,
        }
    }
}

/// `want` for requests without a reply of their own ([`TcpStore::roundtrip`] passes the
/// `PONG` that confirmed them).
fn no_reply(_: Response) -> Result<(), Response> {
    Ok(())
}
