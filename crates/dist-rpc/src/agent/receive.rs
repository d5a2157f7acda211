//! Receiving: a reader thread per peer, what each frame does (completing calls, queueing
//! jobs, the RRef bookkeeping), and a peer's goodbye or loss failing what waited on it.

use super::*;

impl Agent {
    pub(super) fn reader_loop(self: Arc<Self>, peer: usize, stream: TcpStream) {
        let mut r = BufReader::with_capacity(64 << 10, stream);
        let mut said_goodbye = false;
        let reason = loop {
            let mut hb = [0u8; HEADER_LEN];
            if let Err(e) = r.read_exact(&mut hb) {
                break if e.kind() == std::io::ErrorKind::UnexpectedEof {
                    "connection closed without a goodbye".to_owned()
                } else {
                    e.to_string()
                };
            }
            let h = match Header::decode(&hb, &self.limits) {
                Ok(h) => h,
                Err(e) => break self.protocol_error(peer, e),
            };
            // Into reserved capacity through `take`: the kernel fills the buffer directly,
            // with no zeroing pass first (what a 1 MiB argument would otherwise pay).
            let read = |r: &mut BufReader<TcpStream>, n: u64| -> std::io::Result<Vec<u8>> {
                // Capacity up front only up to 64 MiB: a header may lie about its length, and
                // bytes that really arrive grow the buffer as they come.
                let mut v = Vec::with_capacity(n.min(64 << 20) as usize);
                r.by_ref().take(n).read_to_end(&mut v)?;
                if v.len() as u64 != n {
                    return Err(std::io::ErrorKind::UnexpectedEof.into());
                }
                Ok(v)
            };
            let frame = read(&mut r, h.meta_len.into()).and_then(|m| {
                let b = read(&mut r, h.body_len.into())?;
                let x = read(&mut r, h.blob_len)?;
                Ok((m, b, x))
            });
            let (meta, body, blob) = match frame {
                Ok(f) => f,
                Err(e) => break format!("connection broke inside a frame: {e}"),
            };
            if h.kind == Kind::Goodbye {
                said_goodbye = true;
                self.peer_said_goodbye(peer);
                continue;
            }
            if said_goodbye {
                continue;
            }
            if let Err(e) = self.on_frame_checked(peer, h, meta, body, blob) {
                break self.protocol_error(peer, e);
            }
        };
        if !said_goodbye {
            self.peer_lost(peer, reason);
        }
        let mut left = lock(&self.readers_left);
        *left = left.saturating_sub(1);
        self.readers_cv.notify_all();
    }

    fn protocol_error(&self, peer: usize, e: FrameError) -> String {
        let err = Error::Protocol {
            worker: self.label.clone(),
            peer: self.worker(peer).to_string(),
            source: e,
        };
        tracing::error!(error = %err, "closing the connection");
        err.to_string()
    }

    /// A frame from a peer (or from this worker to itself); never blocks.
    pub(super) fn on_frame(
        self: &Arc<Self>,
        peer: usize,
        h: Header,
        meta: Vec<u8>,
        body: Vec<u8>,
        blob: Vec<u8>,
    ) {
        if let Err(e) = self.on_frame_checked(peer, h, meta, body, blob) {
            let _ = self.protocol_error(peer, e);
        }
    }

    fn on_frame_checked(
        self: &Arc<Self>,
        peer: usize,
        h: Header,
        meta: Vec<u8>,
        body: Vec<u8>,
        blob: Vec<u8>,
    ) -> std::result::Result<(), FrameError> {
        match h.kind {
            Kind::Call => {
                let m: CallMeta = decode_meta(h.kind, &meta)?;
                let forks = m.forks.iter().map(|&t| self.adopt(t)).collect();
                let raw = m.raw;
                self.enqueue_job(Job::Call {
                    peer,
                    call_id: h.call_id,
                    meta: m,
                    input: Input { body, blob, raw },
                    forks,
                });
            }
            Kind::Remote => {
                let m: CallMeta = decode_meta(h.kind, &meta)?;
                let Some(t) = m.create else {
                    return Err(FrameError::Unexpected {
                        kind: "Remote".into(),
                        why: "no RRef to create".into(),
                    });
                };
                if t.owner != self.me {
                    return Err(FrameError::Unexpected {
                        kind: "Remote".into(),
                        why: format!(
                            "RRef {} is owned by rank {}, not this worker",
                            t.rref, t.owner
                        ),
                    });
                }
                // The creator's fork is registered here, in arrival order, before anything
                // the creator sends later on this connection (its deletion, say) is read.
                let (cell, deleted) = self.owners.create(t);
                if let Some(d) = deleted {
                    self.after_delete(t.rref, d);
                }
                let forks = m.forks.iter().map(|&t| self.adopt(t)).collect();
                let raw = m.raw;
                self.enqueue_job(Job::Create {
                    meta: m,
                    input: Input { body, blob, raw },
                    forks,
                    cell,
                });
            }
            Kind::Reply => {
                let m: ReplyMeta = decode_meta(h.kind, &meta)?;
                let forks = m.forks.iter().map(|&t| self.adopt(t)).collect();
                self.complete(h.call_id, Outcome::Reply { body, blob, forks });
            }
            Kind::Fail => {
                let m: FailMeta = decode_meta(h.kind, &meta)?;
                self.complete(h.call_id, Outcome::Fail(m.kind, m.message));
            }
            Kind::Fetch => {
                let m: RRefMeta = decode_meta(h.kind, &meta)?;
                let rref = m.token.rref;
                // An id the table lacks is either deleted or not made yet (a fetch by a
                // worker that got a fork from someone else may overtake the creator's
                // `remote`, on another connection). It cannot be still to come when the
                // fetcher is the creator (its `remote` went first on this connection, read in
                // order) or this worker made it itself (registered before its RRef existed).
                let creation_arrived = rref.worker == peer || rref.worker == self.me;
                let Some(cell) = self.owners.cell_for_fetch(rref, creation_arrived) else {
                    self.enqueue_control(Control::FetchReply {
                        peer,
                        call_id: h.call_id,
                        value: Err(self.gone(rref)),
                    });
                    return Ok(());
                };
                let mut st = lock(&cell.state);
                match &mut *st {
                    CellState::Pending(waiters) => waiters.push((peer, h.call_id)),
                    CellState::Ready(v) => {
                        let value = v.clone();
                        drop(st);
                        self.enqueue_control(Control::FetchReply {
                            peer,
                            call_id: h.call_id,
                            value,
                        });
                    }
                    CellState::Gone => {
                        drop(st);
                        self.enqueue_control(Control::FetchReply {
                            peer,
                            call_id: h.call_id,
                            value: Err(self.gone(rref)),
                        });
                    }
                }
            }
            Kind::ForkNotify => {
                let m: RRefMeta = decode_meta(h.kind, &meta)?;
                if let Some(d) = self.owners.add_fork(m.token) {
                    self.after_delete(m.token.rref, d);
                }
                self.processed.fetch_add(1, Ordering::Relaxed);
            }
            Kind::ForkDelete => {
                let m: RRefMeta = decode_meta(h.kind, &meta)?;
                if let Some(d) = self.owners.del_fork(m.token) {
                    self.after_delete(m.token.rref, d);
                }
                self.processed.fetch_add(1, Ordering::Relaxed);
            }
            Kind::Hello | Kind::Goodbye => {
                return Err(FrameError::Unexpected {
                    kind: format!("{:?}", h.kind),
                    why: "only the first frame of a connection may be a Hello".into(),
                });
            }
        }
        Ok(())
    }

    fn complete(&self, call_id: u64, o: Outcome) {
        let p = lock(&self.pending).remove(&call_id);
        match p {
            Some(p) => {
                p.slot.complete(o);
                self.busy_done();
            }
            // A call that timed out: its reply (and any forks in it, dropped here) is late.
            None => {
                tracing::debug!(worker = %self.label, call_id, "reply to a call no one waits for")
            }
        }
    }

    pub(super) fn fail_pending_to(&self, peer: Option<usize>, o: impl Fn() -> Outcome) {
        let failed: Vec<Pending> = {
            let mut p = lock(&self.pending);
            let ids: Vec<u64> = p
                .iter()
                .filter(|(_, c)| peer.is_none_or(|x| c.peer == x))
                .map(|(&id, _)| id)
                .collect();
            ids.into_iter().filter_map(|id| p.remove(&id)).collect()
        };
        for c in failed {
            c.slot.complete(o());
            self.busy_done();
        }
    }

    fn peer_said_goodbye(&self, peer: usize) {
        let Some(Some(p)) = self.peers.get(peer) else {
            return;
        };
        {
            let mut st = lock(&p.state);
            if *st == PeerState::Up {
                *st = PeerState::ShutDown;
            }
        }
        tracing::debug!(worker = %self.label, peer = %self.worker(peer), "peer said goodbye");
        self.fail_pending_to(Some(peer), || Outcome::PeerShutDown);
        // Our half of the close: the peer's reader then sees our end and finishes.
        let mut w = lock(&p.writer);
        if !w.closed {
            let _ = w.stream.write_all(
                &Header {
                    kind: Kind::Goodbye,
                    call_id: 0,
                    meta_len: 0,
                    body_len: 0,
                    blob_len: 0,
                }
                .encode(),
            );
            w.closed = true;
            let _ = w.stream.shutdown(Shutdown::Write);
        }
    }

    fn peer_lost(&self, peer: usize, reason: String) {
        let Some(Some(p)) = self.peers.get(peer) else {
            return;
        };
        {
            let mut st = lock(&p.state);
            if *st != PeerState::Up {
                return;
            }
            *st = PeerState::Lost(reason.clone());
        }
        self.lost_any.store(true, Ordering::SeqCst);
        {
            let mut w = lock(&p.writer);
            w.closed = true;
            let _ = w.stream.shutdown(Shutdown::Both);
        }
        tracing::warn!(worker = %self.label, peer = %self.worker(peer), %reason, "peer lost");
        self.fail_pending_to(Some(peer), || Outcome::Lost(reason.clone()));
    }
}
