//! The handler pool, which runs jobs and writes their replies, and the control thread,
//! which writes what no caller should wait for.

use super::*;

impl Agent {
    pub(super) fn enqueue_job(&self, job: Job) {
        self.busy_add(1);
        let mut q = lock(&self.pool);
        q.jobs.push_back(job);
        self.peak_queued.fetch_max(q.jobs.len(), Ordering::Relaxed);
        drop(q);
        self.pool_cv.notify_one();
    }

    pub(super) fn pool_loop(self: Arc<Self>) {
        IN_POOL.with(|p| p.set(true));
        loop {
            let job = {
                let mut q = lock(&self.pool);
                loop {
                    if q.stop {
                        return;
                    }
                    if let Some(j) = q.jobs.pop_front() {
                        break j;
                    }
                    q = self.pool_cv.wait(q).unwrap_or_else(|e| e.into_inner());
                }
            };
            let now = self.running.fetch_add(1, Ordering::SeqCst) + 1;
            self.peak_running.fetch_max(now, Ordering::Relaxed);
            // Handlers and the encoding of their results are guarded where they run, so the
            // caller gets an answer; this guard is for what is left (a value's `Drop`, say):
            // no panic may unwind past the counters below and `thread_exited`, or the pool
            // would shrink for good and shutdown would wait out its timeout.
            if let Err(payload) = catch_unwind(AssertUnwindSafe(|| self.run_job(job))) {
                tracing::error!(worker = %self.label, panic = %panic_message(payload.as_ref()), "a job panicked outside its handler");
            }
            self.running.fetch_sub(1, Ordering::SeqCst);
            self.served.fetch_add(1, Ordering::Relaxed);
            self.processed.fetch_add(1, Ordering::Relaxed);
            self.busy_done();
        }
    }

    /// Runs a handler, catching its panic.
    fn invoke(
        self: &Arc<Self>,
        func: &str,
        input: Input,
        forks: Vec<Arc<ForkShared>>,
    ) -> std::result::Result<Output, (FailKind, String)> {
        let Some(h) = self.handlers.get(func) else {
            return Err((
                FailKind::UnknownFunction,
                format!("{} has no function named {func:?}", self.label),
            ));
        };
        let rpc = Rpc {
            agent: self.clone(),
        };
        let res = decoding(forks, || catch_unwind(AssertUnwindSafe(|| h(&rpc, input))));
        match res {
            Ok(Ok(out)) => Ok(out),
            Ok(Err(Failure::User(m))) => Err((FailKind::Handler, m)),
            Ok(Err(Failure::BadArguments(m))) => Err((FailKind::BadArguments, m)),
            Err(payload) => Err((FailKind::Panic, panic_message(payload.as_ref()))),
        }
    }

    fn run_job(self: &Arc<Self>, job: Job) {
        match job {
            Job::Call {
                peer,
                call_id,
                meta,
                input,
                forks,
            } => {
                let func = meta.func;
                let out = self.invoke(&func, input, forks);
                self.reply(peer, call_id, &func, out);
            }
            Job::Create {
                meta,
                input,
                forks,
                cell,
            } => {
                let out = self.invoke(&meta.func, input, forks).map(|o| match o {
                    Output::Value(v) => v,
                    Output::Bytes(b) => Arc::new(b) as Arc<dyn ErasedValue>,
                });
                let waiters = {
                    let mut st = lock(&cell.state);
                    match std::mem::replace(&mut *st, CellState::Gone) {
                        CellState::Pending(w) => {
                            *st = CellState::Ready(out.clone());
                            w
                        }
                        // Every user released it while it was being made: drop the value.
                        _ => Vec::new(),
                    }
                };
                cell.ready.notify_all();
                for (peer, call_id) in waiters {
                    self.enqueue_control(Control::FetchReply {
                        peer,
                        call_id,
                        value: out.clone(),
                    });
                }
            }
        }
    }

    /// Encodes and sends a handler's outcome to the caller.
    pub(super) fn reply(
        self: &Arc<Self>,
        peer: usize,
        call_id: u64,
        func: &str,
        out: std::result::Result<Output, (FailKind, String)>,
    ) {
        let sent = match out {
            Ok(Output::Bytes(b)) => {
                let meta = encode_meta(&ReplyMeta::default());
                self.send(peer, Kind::Reply, call_id, &meta, &[], &b, func)
            }
            Ok(Output::Value(v)) => {
                // The value's `Serialize` is user code: its panic is caught inside the encoding
                // context (so the context is popped and the forks made so far are released)
                // and answered like a handler's panic, instead of unwinding the thread that
                // sends the reply (a pool thread, or the control thread for `to_here`).
                let (body, forks) =
                    encoding(self, peer, || catch_unwind(AssertUnwindSafe(|| v.encode())));
                match body {
                    Err(payload) => {
                        self.release_tokens(&forks);
                        let msg = format!(
                            "{}: encoding the result of {func} panicked: {}",
                            self.label,
                            panic_message(payload.as_ref())
                        );
                        self.send_fail(peer, call_id, func, FailKind::Panic, msg)
                    }
                    Ok(Ok(body)) => {
                        let meta = encode_meta(&ReplyMeta {
                            forks: forks.clone(),
                        });
                        let r = self.send(peer, Kind::Reply, call_id, &meta, &body, &[], func);
                        if r.is_err() {
                            self.release_tokens(&forks);
                        }
                        r
                    }
                    Ok(Err(e)) => {
                        self.release_tokens(&forks);
                        self.send_fail(peer, call_id, func, FailKind::BadResult, e.to_string())
                    }
                }
            }
            Err((kind, msg)) => self.send_fail(peer, call_id, func, kind, msg),
        };
        match sent {
            Ok(()) => {}
            // Refused before a byte was sent (a result too large for one frame): the caller
            // would otherwise wait for a reply that never comes.
            Err(e @ Error::InvalidArgument { .. }) => {
                if let Err(e) =
                    self.send_fail(peer, call_id, func, FailKind::BadResult, e.to_string())
                {
                    tracing::debug!(worker = %self.label, error = %e, "could not send a failure");
                }
            }
            Err(e) => tracing::debug!(worker = %self.label, error = %e, "could not send a reply"),
        }
    }

    fn send_fail(
        self: &Arc<Self>,
        peer: usize,
        call_id: u64,
        func: &str,
        kind: FailKind,
        message: String,
    ) -> Result<()> {
        let meta = encode_meta(&FailMeta { kind, message });
        self.send(peer, Kind::Fail, call_id, &meta, &[], &[], func)
    }

    pub(super) fn control_loop(self: Arc<Self>, rx: mpsc::Receiver<Control>) {
        while let Ok(c) = rx.recv() {
            match c {
                Control::Stop => {
                    self.busy_done();
                    return;
                }
                Control::Delete(t) => {
                    let meta = encode_meta(&RRefMeta { token: t });
                    self.sent.fetch_add(1, Ordering::Relaxed);
                    if let Err(e) = self.send(
                        t.owner,
                        Kind::ForkDelete,
                        0,
                        &meta,
                        &[],
                        &[],
                        "RRef deletion",
                    ) {
                        self.sent.fetch_sub(1, Ordering::Relaxed);
                        tracing::debug!(worker = %self.label, error = %e, "could not tell the owner of a released RRef");
                    }
                }
                Control::FetchReply {
                    peer,
                    call_id,
                    value,
                } => {
                    let out = value.map(Output::Value);
                    // `reply` answers a panicking encoding itself; this guard keeps the one
                    // control thread (and the counters) alive through anything else.
                    let sent = catch_unwind(AssertUnwindSafe(|| {
                        self.reply(peer, call_id, "to_here", out);
                    }));
                    if let Err(payload) = sent {
                        tracing::error!(worker = %self.label, panic = %panic_message(payload.as_ref()), "a fetch reply panicked");
                    }
                    self.processed.fetch_add(1, Ordering::Relaxed);
                }
            }
            self.busy_done();
        }
    }
}

/// A panic's message: its `&str` or `String` payload.
fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a non-string panic payload".to_owned())
}
