//! Point-to-point operations of [`ProcessGroup`]: they run on the group's separate
//! point-to-point engine (`crate::p2p`), with its own connections, and do not wait for
//! collectives.

use std::time::Instant;

use dist_backend::{Backend, OpOptions};
use dist_wire::Element;

use super::ProcessGroup;
use super::collectives::{bytes, bytes_mut};
use super::run::{finish, info};
use crate::p2p::{Dir, P2pJob};
use crate::work::Work;
use crate::{Error, Result};

/// One operation of [`ProcessGroup::batch_isend_irecv`].
#[derive(Debug)]
#[non_exhaustive]
pub enum P2pOp<T> {
    /// Send `buf` to group rank `peer` with `tag`.
    Send {
        /// The data.
        buf: Vec<T>,
        /// Destination (group rank).
        peer: usize,
        /// Matching tag.
        tag: u32,
    },
    /// Receive into `buf` (its length is the message length) from group rank `peer` with `tag`.
    Recv {
        /// Where the data goes.
        buf: Vec<T>,
        /// Source (group rank).
        peer: usize,
        /// Matching tag.
        tag: u32,
    },
}

impl<T> P2pOp<T> {
    /// A send of `buf` to `peer`.
    pub fn isend(buf: Vec<T>, peer: usize, tag: u32) -> Self {
        P2pOp::Send { buf, peer, tag }
    }

    /// A receive into `buf` from `peer`.
    pub fn irecv(buf: Vec<T>, peer: usize, tag: u32) -> Self {
        P2pOp::Recv { buf, peer, tag }
    }
}

impl ProcessGroup {
    /// Queues a send or receive on the point-to-point engine.
    fn p2p<T: Element>(
        &self,
        dir: Dir,
        buf: Vec<T>,
        peer: usize,
        tag: u32,
    ) -> Result<Work<Vec<T>>> {
        let op = match dir {
            Dir::Send => "send",
            Dir::Recv => "recv",
        };
        self.check_peer(op, peer)?;
        let ctx = self.inner.ctx.clone();
        let seq = ctx
            .recorder
            .issue(info::<T>(op, vec![buf.len()], Some(peer)), None);
        let (work, done) = Work::pending(ctx.rank, op, seq);
        let started = Instant::now();
        let deadline = dist_backend::deadline_after(started, ctx.timeout);
        let mut buf = buf;
        let run = Box::new(move |b: std::result::Result<&dyn Backend, Error>| {
            let t0 = Instant::now();
            let r = match b {
                Ok(b) => {
                    ctx.recorder.started(seq);
                    let mut opts = OpOptions::with_timeout(deadline.saturating_duration_since(t0));
                    opts.tag = tag;
                    match dir {
                        Dir::Send => b.send(bytes(&buf), T::DTYPE, peer, &opts),
                        Dir::Recv => b.recv(bytes_mut(&mut buf), T::DTYPE, peer, &opts),
                    }
                    .map_err(Error::from)
                }
                Err(e) => Err(e),
            };
            finish(&ctx, seq, None, op, t0, r.as_ref().err());
            done.complete(r.map(|()| buf));
        });
        let job = P2pJob {
            dir,
            peer,
            tag,
            seq,
            deadline,
            started,
            run,
        };
        let queue = self.inner.p2p.lock().unwrap_or_else(|e| e.into_inner());
        match queue.as_ref().map(|q| q.submit(job)) {
            Some(Ok(())) => Ok(work),
            _ => Err(Error::Destroyed {
                rank: self.rank(),
                op,
            }),
        }
    }

    /// Sends `buf` to group rank `dst`, matched by `tag` with a [`recv`](ProcessGroup::recv) of
    /// the same length. Returns when the message has been handed to the connection.
    pub fn send<T: Element>(&self, buf: &[T], dst: usize, tag: u32) -> Result<()> {
        self.isend(buf.to_vec(), dst, tag)?.wait().map(drop)
    }

    /// Receives into `buf` from group rank `src`, matched by `tag`; the message must have
    /// `buf.len()` elements.
    pub fn recv<T: Element>(&self, buf: &mut [T], src: usize, tag: u32) -> Result<()> {
        let got = self.irecv(vec![T::zeroed(); buf.len()], src, tag)?.wait()?;
        dist_wire::copy::bulk_of(buf, &got);
        Ok(())
    }

    /// Sends `buf` to `dst` in the background; `wait` gives the buffer back. Sends to one peer
    /// with one tag arrive in issue order.
    pub fn isend<T: Element>(&self, buf: Vec<T>, dst: usize, tag: u32) -> Result<Work<Vec<T>>> {
        self.p2p(Dir::Send, buf, dst, tag)
    }

    /// Receives `buf.len()` elements from `src` in the background; `wait` gives the filled
    /// buffer. Posting receives before the matching sends (on both sides) does not deadlock.
    pub fn irecv<T: Element>(&self, buf: Vec<T>, src: usize, tag: u32) -> Result<Work<Vec<T>>> {
        self.p2p(Dir::Recv, buf, src, tag)
    }

    /// Issues every send and receive of `ops` at once (torch's `batch_isend_irecv`); one
    /// [`Work`] per op, in order. Every op is validated before any is issued.
    pub fn batch_isend_irecv<T: Element>(&self, ops: Vec<P2pOp<T>>) -> Result<Vec<Work<Vec<T>>>> {
        for o in &ops {
            match o {
                P2pOp::Send { peer, .. } => self.check_peer("send", *peer)?,
                P2pOp::Recv { peer, .. } => self.check_peer("recv", *peer)?,
            }
        }
        ops.into_iter()
            .map(|o| match o {
                P2pOp::Send { buf, peer, tag } => self.isend(buf, peer, tag),
                P2pOp::Recv { buf, peer, tag } => self.irecv(buf, peer, tag),
            })
            .collect()
    }
}
