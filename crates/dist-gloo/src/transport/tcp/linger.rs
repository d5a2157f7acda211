//! The last part of closing a mesh: each connection is handed what it is still owed (the rest
//! of a frame, an abort notice, a goodbye), its write side is shut, and it is read (and what
//! arrives discarded) until the peer closes its end too, or the deadline passes.
//!
//! Why: a socket closed while bytes it received are still unread makes the kernel answer with
//! a reset, which throws away whatever this side had written but the peer had not yet
//! received. Reading until the peer's own close means nothing is unread when the socket goes.
//!
//! The engine first writes what each link takes without waiting (usually the whole goodbye),
//! so a peer that looks right after the close finds it; everything else happens on a
//! background thread, so dropping a group returns at once and groups that ranks destroy in
//! different orders cannot wait on each other: writing what is owed waits for the peer to
//! make room (a shared-memory ring holds less than a frame), and a peer that is not reading
//! yet (it destroys its groups later, or in the same thread after this one) held the close
//! for the whole deadline when the writes were made in place. Before the process exits the
//! `dist-backend` exit hook waits for every lingering close ([`wait_all`]), each bounded by
//! the group's timeout.

use std::io::{ErrorKind, Read};
use std::net::TcpStream;
use std::sync::Mutex;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use dist_backend::exit::{ExitStage, at_exit};

use super::link::Link;

/// Threads still lingering on closed connections.
static LINGERING: Mutex<Vec<JoinHandle<()>>> = Mutex::new(Vec::new());

/// A connection being closed: its link and the bytes it is still owed.
pub(super) struct Closing {
    /// The peer at the other end.
    pub(super) peer: usize,
    /// The connection.
    pub(super) link: Link,
    /// What the peer is owed before the end of the stream.
    pub(super) pending: Vec<u8>,
}

/// Writes each connection's `pending` bytes and shuts its write side, then reads it until its
/// peer closes it, it fails, or `deadline` passes; then drops it. In the background when a
/// thread can be started, here otherwise.
pub(super) fn linger(rank: usize, closing: Vec<Closing>, deadline: Instant) {
    if closing.is_empty() {
        return;
    }
    at_exit(ExitStage::Connections, wait_all);
    let (tx, rx) = std::sync::mpsc::channel::<Vec<Closing>>();
    let spawned = std::thread::Builder::new()
        .name(format!("dist-linger-r{rank}"))
        .spawn(move || {
            if let Ok(closing) = rx.recv() {
                finish_all(rank, closing, deadline);
            }
        });
    match spawned {
        Ok(handle) => {
            // The thread holds the receiver until it has the connections, so this send
            // succeeds.
            if let Err(std::sync::mpsc::SendError(closing)) = tx.send(closing) {
                finish_all(rank, closing, deadline);
            }
            LINGERING
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push(handle);
        }
        Err(e) => {
            tracing::debug!(rank, error = %e, "no thread for a lingering close; closing inline");
            finish_all(rank, closing, deadline);
        }
    }
}

/// Hands each connection what it is owed and shuts its write side, then lingers on them all.
fn finish_all(rank: usize, closing: Vec<Closing>, deadline: Instant) {
    let mut streams = Vec::with_capacity(closing.len());
    for Closing {
        peer,
        link,
        pending,
    } in closing
    {
        match link.finish(&pending, &[], deadline) {
            Ok(stream) => streams.push((peer, stream)),
            Err(e) => {
                tracing::debug!(rank, peer, error = %e, "could not say goodbye to a peer");
            }
        }
    }
    drain_until_closed(rank, streams, deadline);
}

/// Waits for every lingering close started so far (each bounded by its own deadline).
pub(crate) fn wait_all() {
    loop {
        let handles = std::mem::take(&mut *LINGERING.lock().unwrap_or_else(|e| e.into_inner()));
        if handles.is_empty() {
            return;
        }
        for h in handles {
            let _ = h.join();
        }
    }
}

fn drain_until_closed(rank: usize, streams: Vec<(usize, TcpStream)>, deadline: Instant) {
    let mut sink = [0u8; 16 << 10];
    for (peer, mut s) in streams {
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                tracing::debug!(
                    rank,
                    peer,
                    "peer did not close its end of the connection before the timeout"
                );
                break;
            }
            if s.set_read_timeout(Some(left.max(Duration::from_millis(1))))
                .is_err()
            {
                break;
            }
            match s.read(&mut sink) {
                Ok(0) => break,
                Ok(_) => {}
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {}
                Err(_) => break,
            }
        }
    }
}
