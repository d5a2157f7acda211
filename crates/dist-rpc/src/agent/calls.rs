//! Calls: encoding the arguments, the table of calls in flight, the futures that wait on
//! them, and turning a reply or a failure into the caller's result.

use super::*;

impl Agent {
    /// Sends a request that expects a reply and returns its slot.
    #[allow(
        clippy::too_many_arguments,
        reason = "one internal entry point for every request kind"
    )]
    pub(super) fn request(
        self: &Arc<Self>,
        to: usize,
        kind: Kind,
        func: &str,
        meta: &[u8],
        body: &[u8],
        blob: &[u8],
        forks: &[ForkToken],
    ) -> Result<(u64, Arc<Slot>)> {
        if *lock(&self.life) == Life::Closed {
            self.release_tokens(forks);
            return Err(self.closed_err(func));
        }
        if let Some(e) = self.peer_down(to, func) {
            self.release_tokens(forks);
            return Err(e);
        }
        let call_id = self.next_call.fetch_add(1, Ordering::Relaxed);
        let slot = Arc::new(Slot::new());
        // Registered before the write, so a fast reply finds it.
        self.track_call(
            call_id,
            Pending {
                peer: to,
                slot: slot.clone(),
            },
        );
        // Closed since the look above: `close_by` marks the agent closed before it fails the
        // calls in flight, so one registered after that was missed, and a call to this worker
        // itself (an owner's `to_here`) would go to a pool and control thread that have
        // stopped, and wait out its timeout.
        if *lock(&self.life) == Life::Closed {
            self.forget_call(call_id);
            self.release_tokens(forks);
            return Err(self.closed_err(func));
        }
        self.sent.fetch_add(1, Ordering::Relaxed);
        if let Err(e) = self.send(to, kind, call_id, meta, body, blob, func) {
            // Never delivered: it must not count as sent, or shutdown would wait for it.
            self.sent.fetch_sub(1, Ordering::Relaxed);
            self.forget_call(call_id);
            self.release_tokens(forks);
            return Err(e);
        }
        Ok((call_id, slot))
    }

    /// Puts a call in the table of calls in flight, counted as busy.
    ///
    /// Counted first: whoever takes a call out of the table (its reply, a timeout, the peer's
    /// goodbye or loss, close) takes the count down, so the count must be there before the
    /// call can be found. Put in first and counted after, a goodbye in between took busy down
    /// from 0 (saturating) and the add then left it at 1 for good, and graceful shutdown waited
    /// out its whole timeout. Every path that takes it out again (`forget_call` when the send
    /// fails) goes through the table, so the count is undone exactly once.
    fn track_call(&self, call_id: u64, p: Pending) {
        self.busy_add(1);
        #[cfg(test)]
        tests::BETWEEN_COUNT_AND_INSERT.with(|h| h.take().map(|f| f()));
        lock(&self.pending).insert(call_id, p);
    }

    /// Removes a call from the table (timeout); false when its outcome already arrived.
    pub(crate) fn forget_call(&self, call_id: u64) -> bool {
        let removed = lock(&self.pending).remove(&call_id).is_some();
        if removed {
            self.busy_done();
        }
        removed
    }

    /// Encodes `args` for `to`, collecting the RRef forks inside.
    fn encode_args<A: Serialize>(
        self: &Arc<Self>,
        to: usize,
        func: &str,
        args: &A,
    ) -> Result<(Vec<u8>, Vec<ForkToken>)> {
        let (body, forks) = encoding(self, to, || serde_json::to_vec(args));
        match body {
            Ok(b) => Ok((b, forks)),
            Err(source) => {
                self.release_tokens(&forks);
                Err(Error::Codec {
                    worker: self.label.clone(),
                    peer: self.worker(to).to_string(),
                    func: func.to_owned(),
                    what: "encoding the arguments",
                    source,
                })
            }
        }
    }

    pub(crate) fn call_async<A: Serialize, R: DeserializeOwned>(
        self: &Arc<Self>,
        to: usize,
        func: &str,
        args: &A,
        timeout: Duration,
    ) -> Result<RpcFuture<R>> {
        let (body, forks) = self.encode_args(to, func, args)?;
        let meta = encode_meta(&CallMeta {
            func: func.to_owned(),
            forks: forks.clone(),
            create: None,
            raw: false,
        });
        let start = Instant::now();
        let (call_id, slot) = self.request(to, Kind::Call, func, &meta, &body, &[], &forks)?;
        Ok(self.future(to, func, call_id, slot, start, timeout, decode_typed::<R>))
    }

    pub(crate) fn call_bytes_async(
        self: &Arc<Self>,
        to: usize,
        func: &str,
        bytes: &[u8],
        timeout: Duration,
    ) -> Result<RpcFuture<Vec<u8>>> {
        let meta = encode_meta(&CallMeta {
            func: func.to_owned(),
            forks: Vec::new(),
            create: None,
            raw: true,
        });
        let start = Instant::now();
        let (call_id, slot) = self.request(to, Kind::Call, func, &meta, &[], bytes, &[])?;
        Ok(self.future(to, func, call_id, slot, start, timeout, decode_bytes))
    }

    #[allow(clippy::too_many_arguments, reason = "plain constructor")]
    pub(super) fn future<R>(
        self: &Arc<Self>,
        to: usize,
        func: &str,
        call_id: u64,
        slot: Arc<Slot>,
        start: Instant,
        timeout: Duration,
        decode: fn(&Arc<Agent>, usize, &str, Outcome) -> Result<R>,
    ) -> RpcFuture<R> {
        RpcFuture {
            agent: self.clone(),
            slot,
            call_id,
            peer: to,
            func: func.to_owned(),
            deadline: deadline_after(start, timeout),
            timeout,
            decode,
            _r: std::marker::PhantomData,
        }
    }

    pub(crate) fn remote<A: Serialize, T>(
        self: &Arc<Self>,
        to: usize,
        func: &str,
        args: &A,
    ) -> Result<RRef<T>> {
        if *lock(&self.life) == Life::Closed {
            return Err(self.closed_err(func));
        }
        if let Some(e) = self.peer_down(to, func) {
            return Err(e);
        }
        let (body, forks) = self.encode_args(to, func, args)?;
        let token = ForkToken {
            owner: to,
            rref: self.new_id(),
            fork: self.new_id(),
        };
        let meta = encode_meta(&CallMeta {
            func: func.to_owned(),
            forks: forks.clone(),
            create: Some(token),
            raw: false,
        });
        // Our fork exists from here: the owner learns of it with the creation itself.
        let mine = self.adopt(token);
        self.sent.fetch_add(1, Ordering::Relaxed);
        if let Err(e) = self.send(to, Kind::Remote, 0, &meta, &body, &[], func) {
            self.sent.fetch_sub(1, Ordering::Relaxed);
            // The owner never heard of it: nothing to release there.
            mine.released.store(true, Ordering::SeqCst);
            self.release_tokens(&forks);
            return Err(e);
        }
        Ok(RRef::from_fork(mine))
    }

    /// `to_here`: the value of the RRef `t`, from its owner.
    pub(crate) fn fetch<T: DeserializeOwned>(
        self: &Arc<Self>,
        t: ForkToken,
        timeout: Duration,
    ) -> Result<T> {
        let func = format!("to_here(RRef {})", t.rref);
        let start = Instant::now();
        // The owner fetches from itself through the same frames as any worker (a call to
        // oneself skips only the socket): a value holding RRefs needs the fork bookkeeping of
        // a reply to encode them, and encoding it here, outside a reply, failed.
        let meta = encode_meta(&RRefMeta { token: t });
        let (call_id, slot) = self.request(t.owner, Kind::Fetch, &func, &meta, &[], &[], &[])?;
        let fut = self.future(
            t.owner,
            &func,
            call_id,
            slot,
            start,
            timeout,
            decode_typed::<T>,
        );
        fut.wait().map_err(|e| match e {
            Error::Remote { message, .. } => self.rref_error(t, message),
            other => other,
        })
    }

    /// The owner's value of `t`, waiting until it is made.
    pub(crate) fn local_value(
        &self,
        t: ForkToken,
        timeout: Duration,
    ) -> Result<Arc<dyn ErasedValue>> {
        if t.owner != self.me {
            return Err(self.rref_error(t, "local_value called on a worker that is not the owner"));
        }
        let cell = self
            .owners
            .existing(t.rref)
            .ok_or_else(|| self.rref_error(t, "the owner has deleted it"))?;
        match cell.wait(deadline_after(Instant::now(), timeout)) {
            Some(Ok(v)) => Ok(v),
            Some(Err((kind, msg))) => {
                Err(self.rref_error(t, format!("{}: {msg}", fail_kind_what(kind))))
            }
            None => Err(self.rref_error(
                t,
                format!("the function making the value did not finish within {timeout:?}"),
            )),
        }
    }
}

fn decode_typed<R: DeserializeOwned>(
    agent: &Arc<Agent>,
    peer: usize,
    func: &str,
    o: Outcome,
) -> Result<R> {
    match o {
        Outcome::Reply { body, forks, .. } => decoding(forks, || serde_json::from_slice(&body))
            .map_err(|source| Error::Codec {
                worker: agent.label().to_owned(),
                peer: agent.worker(peer).to_string(),
                func: func.to_owned(),
                what: "decoding the result",
                source,
            }),
        other => Err(outcome_error(agent, peer, func, other)),
    }
}

fn decode_bytes(agent: &Arc<Agent>, peer: usize, func: &str, o: Outcome) -> Result<Vec<u8>> {
    match o {
        Outcome::Reply { blob, .. } => Ok(blob),
        other => Err(outcome_error(agent, peer, func, other)),
    }
}

fn outcome_error(agent: &Agent, peer: usize, func: &str, o: Outcome) -> Error {
    let worker = agent.label().to_owned();
    let peer_name = agent.worker(peer).to_string();
    let func = func.to_owned();
    match o {
        Outcome::Reply { .. } => Error::InvalidArgument {
            worker,
            op: "decode",
            what: "a reply is not an error".into(),
        },
        Outcome::Fail(kind, message) => match kind {
            FailKind::Handler | FailKind::Panic | FailKind::RRefGone | FailKind::ShuttingDown => {
                Error::Remote {
                    worker,
                    peer: peer_name,
                    func,
                    message,
                    panicked: kind == FailKind::Panic,
                }
            }
            FailKind::UnknownFunction => Error::UnknownFunction {
                worker,
                peer: peer_name,
                func,
            },
            FailKind::BadArguments => Error::BadArguments {
                worker,
                peer: peer_name,
                func,
                reason: message,
            },
            FailKind::BadResult => Error::BadResult {
                worker,
                peer: peer_name,
                func,
                reason: message,
            },
        },
        Outcome::Lost(reason) => Error::PeerLost {
            worker,
            peer: peer_name,
            func,
            reason,
        },
        Outcome::PeerShutDown => Error::PeerShutDown {
            worker,
            peer: peer_name,
            func,
        },
        Outcome::ShutDown => Error::ShutDown { worker, op: func },
    }
}

#[cfg(test)]
mod tests {
    use std::cell::Cell;

    use dist_backend::store::HashStore;

    use super::*;

    thread_local! {
        /// Run once by `track_call` between counting a call and putting it in the table: the
        /// place where another thread's goodbye, lost peer or close may run.
        pub(super) static BETWEEN_COUNT_AND_INSERT: Cell<Option<Box<dyn FnOnce()>>> =
            const { Cell::new(None) };
    }

    /// An agent of a job of one worker, over loopback and a store of its own.
    fn one_worker_agent() -> Arc<Agent> {
        let store: Arc<dyn Store> = Arc::new(HashStore::new(Duration::from_secs(30)));
        let opts = RpcOptions::new()
            .listen_ip(std::net::Ipv4Addr::LOCALHOST.into())
            .shutdown_timeout(Duration::from_secs(10));
        let deadline = deadline_after(Instant::now(), Duration::from_secs(30));
        Agent::init("w0", 0, 1, store, opts, deadline).expect("a one-worker agent")
    }

    /// A peer's goodbye (or loss, or a close) fails every call in the table and takes each
    /// one's busy count down. Running it between the two steps of registering a call must
    /// leave busy counting exactly the calls in the table: before, the call went in first
    /// and was counted after, so the failure took busy down from 0 (saturating), the add then
    /// left it at 1 for good, and graceful shutdown waited out its whole timeout.
    #[test]
    fn a_failure_of_every_pending_call_while_one_is_being_sent_leaves_busy_right() {
        let agent = one_worker_agent();
        let weak = Arc::downgrade(&agent);
        BETWEEN_COUNT_AND_INSERT.with(|h| {
            h.set(Some(Box::new(move || {
                if let Some(a) = weak.upgrade() {
                    a.fail_pending_to(None, || Outcome::PeerShutDown);
                }
            })))
        });
        // A call to itself, of a function it does not have.
        let meta = encode_meta(&CallMeta {
            func: "nothing".into(),
            forks: Vec::new(),
            create: None,
            raw: false,
        });
        let (call_id, slot) = agent
            .request(0, Kind::Call, "nothing", &meta, &[], &[], &[])
            .expect("the call is sent");
        let fut = agent.future(
            0,
            "nothing",
            call_id,
            slot,
            Instant::now(),
            Duration::from_secs(30),
            decode_bytes,
        );
        // Failed by the goodbye (found in the table) or answered (put in after it): either
        // way it ended, and the count with it.
        let e = fut.wait().expect_err("no function of that name");
        assert!(
            matches!(
                e,
                Error::UnknownFunction { .. } | Error::PeerShutDown { .. }
            ),
            "{e}"
        );
        agent
            .shutdown(true)
            .expect("nothing left in flight: shutdown does not wait out its timeout");
    }

    /// A close that runs between the look at the agent's life and the call's registration
    /// (after `close_by` failed the calls in flight, before this one was among them) fails
    /// the call at once. Before, the call went on: to itself (an owner's `to_here`) it went to
    /// a control thread that had stopped, and its caller waited out its whole timeout.
    #[test]
    fn a_close_while_a_call_is_being_registered_fails_the_call() {
        let agent = one_worker_agent();
        let weak = Arc::downgrade(&agent);
        BETWEEN_COUNT_AND_INSERT.with(|h| {
            h.set(Some(Box::new(move || {
                if let Some(a) = weak.upgrade() {
                    a.close();
                }
            })))
        });
        let meta = encode_meta(&RRefMeta {
            token: ForkToken {
                rref: GlobalId {
                    worker: 0,
                    local: 1,
                },
                fork: GlobalId {
                    worker: 0,
                    local: 2,
                },
                owner: 0,
            },
        });
        let Err(e) = agent.request(0, Kind::Fetch, "to_here", &meta, &[], &[], &[]) else {
            panic!("the call went on, though the agent closed before it was registered");
        };
        assert!(matches!(e, Error::ShutDown { .. }), "{e}");
        assert_eq!(
            lock(&agent.pending).len(),
            0,
            "the call left in the table of calls in flight"
        );
    }
}
