//! Sending: one frame to one peer under its writer lock, refused with the reason once
//! the peer is gone or this agent is closing; and resolving worker names and ranks.

use super::*;

impl Agent {
    /// Why a frame could not be sent.
    pub(super) fn peer_down(&self, to: usize, func: &str) -> Option<Error> {
        let peer = self.peers.get(to)?.as_ref()?;
        let st = lock(&peer.state).clone();
        match st {
            PeerState::Up => None,
            PeerState::ShutDown => Some(Error::PeerShutDown {
                worker: self.label.clone(),
                peer: self.worker(to).to_string(),
                func: func.to_owned(),
            }),
            PeerState::Lost(reason) => Some(Error::PeerLost {
                worker: self.label.clone(),
                peer: self.worker(to).to_string(),
                func: func.to_owned(),
                reason,
            }),
        }
    }

    /// Writes one frame to `to` (to this worker itself: handles it in place). The blob is
    /// written straight from the caller's slice, after the header, with no copy.
    #[allow(
        clippy::too_many_arguments,
        reason = "the frame's fields, passed by reference so the blob is never copied"
    )]
    pub(super) fn send(
        self: &Arc<Self>,
        to: usize,
        kind: Kind,
        call_id: u64,
        meta: &[u8],
        body: &[u8],
        blob: &[u8],
        func: &str,
    ) -> Result<()> {
        let h = Header::for_sections(
            kind,
            call_id,
            [meta.len(), body.len(), blob.len()],
            &Limits::default(),
        )
        .map_err(|e| Error::InvalidArgument {
            worker: self.label.clone(),
            op: "send",
            what: format!("{func}: too large for one frame: {e}"),
        })?;
        if to == self.me {
            // Calls to oneself take the same path as a peer's, minus the socket.
            self.on_frame(to, h, meta.to_vec(), body.to_vec(), blob.to_vec());
            return Ok(());
        }
        let Some(Some(peer)) = self.peers.get(to) else {
            return Err(Error::UnknownWorker {
                worker: self.label.clone(),
                name: format!("rank {to}"),
                known: self.known(),
            });
        };
        if let Some(e) = self.peer_down(to, func) {
            return Err(e);
        }
        let mut w = lock(&peer.writer);
        if w.closed {
            drop(w);
            return Err(self
                .peer_down(to, func)
                .unwrap_or_else(|| self.closed_err(func)));
        }
        let mut head = Vec::with_capacity(HEADER_LEN + meta.len() + body.len());
        head.extend_from_slice(&h.encode());
        head.extend_from_slice(meta);
        head.extend_from_slice(body);
        let res = w.stream.write_all(&head).and_then(|()| {
            if blob.is_empty() {
                Ok(())
            } else {
                w.stream.write_all(blob)
            }
        });
        if let Err(source) = res {
            // The reader will see the broken connection too; closing both halves makes sure it
            // does at once, so every call waiting on this peer fails now.
            w.closed = true;
            let _ = w.stream.shutdown(Shutdown::Both);
            drop(w);
            if let Some(e) = self.peer_down(to, func) {
                return Err(e);
            }
            return Err(Error::Io {
                worker: self.label.clone(),
                peer: self.worker(to).to_string(),
                op: "sending a frame",
                source,
            });
        }
        Ok(())
    }

    fn known(&self) -> String {
        self.workers
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join(", ")
    }

    pub(crate) fn resolve_name(&self, name: &str) -> Result<usize> {
        self.workers
            .iter()
            .position(|w| w.name == name)
            .ok_or_else(|| Error::UnknownWorker {
                worker: self.label.clone(),
                name: format!("{name:?}"),
                known: self.known(),
            })
    }

    pub(crate) fn resolve_rank(&self, rank: usize) -> Result<usize> {
        if rank < self.workers.len() {
            Ok(rank)
        } else {
            Err(Error::UnknownWorker {
                worker: self.label.clone(),
                name: format!("rank {rank}"),
                known: self.known(),
            })
        }
    }
}
