//! The last part of closing a mesh: after its goodbye, each connection is read (and what
//! arrives discarded) until the peer closes its end too, or the deadline passes.
//!
//! Why: a socket closed while bytes it received are still unread makes the kernel answer with
//! a reset, which throws away whatever this side had written but the peer had not yet
//! received. Reading until the peer's own close means nothing is unread when the socket goes.
//!
//! Lingering happens on a background thread, so dropping a group returns at once and groups
//! that ranks destroy in different orders cannot wait on each other. Before the process exits
//! the `dist-backend` exit hook waits for every lingering close ([`wait_all`]), each bounded by
//! the group's timeout.

use std::io::{ErrorKind, Read};
use std::net::TcpStream;
use std::sync::Mutex;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use dist_backend::exit::{ExitStage, at_exit};

/// Threads still lingering on closed connections.
static LINGERING: Mutex<Vec<JoinHandle<()>>> = Mutex::new(Vec::new());

/// Reads each of `streams` (whose write side is already shut down) until its peer closes it,
/// it fails, or `deadline` passes; then drops it. In the background when a thread can be
/// started, here otherwise.
pub(super) fn linger(rank: usize, streams: Vec<(usize, TcpStream)>, deadline: Instant) {
    if streams.is_empty() {
        return;
    }
    at_exit(ExitStage::Connections, wait_all);
    let (tx, rx) = std::sync::mpsc::channel::<Vec<(usize, TcpStream)>>();
    let spawned = std::thread::Builder::new()
        .name(format!("dist-linger-r{rank}"))
        .spawn(move || {
            if let Ok(streams) = rx.recv() {
                drain_until_closed(rank, streams, deadline);
            }
        });
    match spawned {
        Ok(handle) => {
            // The thread holds the receiver until it has the streams, so this send succeeds.
            if let Err(std::sync::mpsc::SendError(streams)) = tx.send(streams) {
                drain_until_closed(rank, streams, deadline);
            }
            LINGERING
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push(handle);
        }
        Err(e) => {
            tracing::debug!(rank, error = %e, "no thread for a lingering close; closing inline");
            drain_until_closed(rank, streams, deadline);
        }
    }
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
