//! RRef forks: adopting, forking and releasing references to values this worker owns or
//! holds, and the control thread's queue that sends their deletions.

use super::*;

impl Agent {
    /// Makes a counted fork for a token that arrived (or that this worker created).
    pub(super) fn adopt(self: &Arc<Self>, token: ForkToken) -> Arc<ForkShared> {
        let f = Arc::new(ForkShared {
            agent: self.clone(),
            token,
            released: AtomicBool::new(false),
        });
        lock(&self.live_forks).insert(token.fork, Arc::downgrade(&f));
        f
    }

    /// A new fork of `t` that will travel to `dest`: registered with the owner before it
    /// leaves (directly when this worker is the owner, else by a notice on the connection to
    /// the owner, ahead of anything this worker sends the owner later, in particular ahead of
    /// the deletion of `t` itself).
    pub(crate) fn fork_for(self: &Arc<Self>, t: ForkToken, _dest: usize) -> Result<ForkToken> {
        let child = ForkToken {
            fork: self.new_id(),
            ..t
        };
        if t.owner == self.me {
            if let Some(d) = self.owners.add_fork(child) {
                self.after_delete(t.rref, d);
            }
        } else {
            let meta = encode_meta(&RRefMeta { token: child });
            self.sent.fetch_add(1, Ordering::Relaxed);
            if let Err(e) = self.send(
                t.owner,
                Kind::ForkNotify,
                0,
                &meta,
                &[],
                &[],
                "RRef fork notice",
            ) {
                self.sent.fetch_sub(1, Ordering::Relaxed);
                return Err(e);
            }
        }
        Ok(child)
    }

    /// Releases forks that were made for a frame that was never sent.
    pub(super) fn release_tokens(self: &Arc<Self>, forks: &[ForkToken]) {
        for &t in forks {
            drop(self.adopt(t));
        }
    }

    /// A fork is dropped (or released at shutdown): tell the owner, once.
    pub(crate) fn release_fork(&self, t: ForkToken, released: &AtomicBool) {
        if released.swap(true, Ordering::SeqCst) {
            return;
        }
        lock(&self.live_forks).remove(&t.fork);
        if t.owner == self.me {
            if let Some(d) = self.owners.del_fork(t) {
                self.after_delete(t.rref, d);
            }
            return;
        }
        if *lock(&self.life) == Life::Closed {
            return;
        }
        self.enqueue_control(Control::Delete(t));
    }

    /// Fails the fetches that waited for a value its users released before it was made.
    pub(super) fn after_delete(&self, rref: GlobalId, d: Deleted) {
        for (peer, call_id) in d.waiters {
            self.enqueue_control(Control::FetchReply {
                peer,
                call_id,
                value: Err(self.gone(rref)),
            });
        }
    }

    /// The answer to a fetch of a value this worker deleted, naming the RRef and the owner.
    pub(super) fn gone(&self, rref: GlobalId) -> (FailKind, String) {
        (
            FailKind::RRefGone,
            format!(
                "RRef {rref} is gone: its owner {} deleted it once every reference was released",
                self.label
            ),
        )
    }

    pub(super) fn enqueue_control(&self, c: Control) {
        let tx = lock(&self.control).clone();
        if let Some(tx) = tx {
            self.busy_add(1);
            if tx.send(c).is_err() {
                self.busy_done();
            }
        }
    }
}
