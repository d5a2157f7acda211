//! An in-process transport over channels, for tests: the same algorithms, no sockets.

use std::collections::VecDeque;
use std::sync::Mutex;
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::time::Instant;

use dist_backend::Result;
use dist_wire::{CloseReason, CollectiveOp, FrameHeader};

use super::{
    Incoming, OnFrame, Outgoing, StepCtx, Transport, Verdict, closed_error, frames, judge,
};

type Frame = (FrameHeader, Vec<u8>);

/// One rank's end of an in-memory network made by [`MemTransport::network`].
#[derive(Debug)]
pub struct MemTransport {
    rank: usize,
    segment: usize,
    to: Vec<Sender<Frame>>,
    from: Vec<Mutex<Receiver<Frame>>>,
    stash: Mutex<Vec<VecDeque<Frame>>>,
}

impl MemTransport {
    /// `world_size` connected transports, one per rank, cutting messages into `segment`-byte
    /// frames.
    pub fn network(world_size: usize, segment: usize) -> Vec<MemTransport> {
        // channels[src][dst]
        let mut senders: Vec<Vec<Option<Sender<Frame>>>> = Vec::new();
        let mut receivers: Vec<Vec<Option<Receiver<Frame>>>> =
            (0..world_size).map(|_| Vec::new()).collect();
        for _src in 0..world_size {
            let mut row = Vec::new();
            for rx_row in receivers.iter_mut() {
                let (tx, rx) = mpsc::channel();
                row.push(Some(tx));
                rx_row.push(Some(rx));
            }
            senders.push(row);
        }
        (0..world_size)
            .map(|rank| MemTransport {
                rank,
                segment: segment.max(8) / 8 * 8,
                to: senders[rank]
                    .iter_mut()
                    .map(|s| s.take().expect("each sender taken once"))
                    .collect(),
                from: receivers[rank]
                    .iter_mut()
                    .map(|r| Mutex::new(r.take().expect("each receiver taken once")))
                    .collect(),
                stash: Mutex::new((0..world_size).map(|_| VecDeque::new()).collect()),
            })
            .collect()
    }
}

impl Transport for MemTransport {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.to.len()
    }

    fn segment_bytes(&self) -> usize {
        self.segment
    }

    fn exchange(
        &self,
        ctx: &StepCtx,
        sends: &[Outgoing<'_>],
        recvs: &mut [Incoming<'_>],
        on_frame: &mut OnFrame<'_>,
    ) -> Result<()> {
        for s in sends {
            for r in frames(s.data.len(), self.segment) {
                let h = ctx.header(s.count, s.tag, r.start, r.len());
                // A peer that is gone shows up on the receiving side; sending cannot fail here.
                let _ = self.to[s.peer].send((h, s.data[r].to_vec()));
            }
        }
        let mut stash = self.stash.lock().unwrap_or_else(|e| e.into_inner());
        for (i, inc) in recvs.iter_mut().enumerate() {
            let mut got = 0;
            let mut first = true;
            while first || got < inc.buf.len() {
                let stashed = stash[inc.peer].iter().position(|(h, _)| {
                    matches!(
                        judge(ctx, h, inc.peer, inc.count, inc.tag, got, inc.buf.len()),
                        Ok(Verdict::Expected) | Err(_)
                    )
                });
                let (h, payload) = match stashed.and_then(|p| stash[inc.peer].remove(p)) {
                    Some(f) => f,
                    None => {
                        let rx = self.from[inc.peer]
                            .lock()
                            .unwrap_or_else(|e| e.into_inner());
                        let wait = ctx.deadline.saturating_duration_since(Instant::now());
                        match rx.recv_timeout(wait) {
                            Ok(f) => f,
                            Err(RecvTimeoutError::Timeout) => {
                                return Err(ctx.timeout(vec![inc.peer]));
                            }
                            Err(RecvTimeoutError::Disconnected) => {
                                return Err(ctx.peer_lost(inc.peer, "its transport was dropped"));
                            }
                        }
                    }
                };
                match judge(ctx, &h, inc.peer, inc.count, inc.tag, got, inc.buf.len())? {
                    Verdict::Stash => stash[inc.peer].push_back((h, payload)),
                    Verdict::Closed => {
                        return Err(match CloseReason::decode(&h, &payload) {
                            Ok(CloseReason::Goodbye) => {
                                ctx.peer_lost(inc.peer, "it left the group")
                            }
                            Ok(reason) => closed_error(ctx, inc.peer, &reason),
                            Err(e) => {
                                ctx.peer_lost(inc.peer, format!("its close frame is corrupt: {e}"))
                            }
                        });
                    }
                    Verdict::Expected => {
                        let r = got..got + payload.len();
                        inc.buf[r.clone()].copy_from_slice(&payload);
                        on_frame(i, r.clone(), &inc.buf[r])?;
                        got += payload.len();
                        first = false;
                    }
                }
            }
        }
        Ok(())
    }

    fn probe(&self, peer: usize, tag: u32) -> bool {
        let Some(from) = self.from.get(peer) else {
            return false;
        };
        // Same lock order as `exchange`: stash, then the channel.
        let mut stash = self.stash.lock().unwrap_or_else(|e| e.into_inner());
        let rx = from.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            match rx.try_recv() {
                Ok(f) => stash[peer].push_back(f),
                Err(mpsc::TryRecvError::Empty) => break,
                Err(mpsc::TryRecvError::Disconnected) => return true,
            }
        }
        stash[peer].iter().any(|(h, _)| {
            (h.op == CollectiveOp::SendRecv && h.tag == tag) || h.op == CollectiveOp::Close
        })
    }

    fn close(&self) {
        let ctx = StepCtx::new(
            self.rank,
            0,
            CollectiveOp::Close,
            0,
            dist_wire::DType::U8,
            std::time::Duration::ZERO,
        );
        for (peer, tx) in self.to.iter().enumerate() {
            if peer != self.rank {
                let _ = tx.send((ctx.header(0, 0, 0, 0), Vec::new()));
            }
        }
    }
}
