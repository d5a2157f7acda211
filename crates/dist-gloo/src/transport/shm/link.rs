//! One peer's shared-memory link: the pair's two rings, read and written as a byte stream,
//! and the pair's TCP connection as doorbell and liveness signal.
//!
//! Everything this rank sends goes into the ring; the only bytes on the TCP connection are
//! doorbells (their value means nothing: a doorbell says "look at the rings"), so either
//! direction of the one connection wakes the other side, whether it sleeps for bytes to read
//! or for room to write. The connection's EOF (or reset) is the peer's exit; since a peer
//! publishes into the ring before it closes, the ring is read once more after the EOF, so a
//! goodbye or abort notice written just before exiting is never lost.

use std::io::{self, IoSlice, Read, Write};
use std::time::Instant;

use super::Rings;

/// A peer reached through shared memory.
#[derive(Debug)]
pub(crate) struct ShmLink {
    /// Doorbell and liveness signal (registered with the engine's poller).
    pub(crate) stream: mio::net::TcpStream,
    rings: Rings,
    /// The connection has ended: what the ring still holds is all there is.
    eof: bool,
    /// Reads that found the ring empty since it last had bytes.
    idle: u32,
}

/// Bytes of doorbells read per call.
const DOORBELLS: usize = 64;

/// An empty ring is read in a tight loop while the engine spins; the connection (a system
/// call, longer than a small message's whole trip through the ring) is looked at only on
/// every this many empty reads, and before every sleep ([`ShmLink::arm`]).
const IDLE_READS_PER_CHECK: u32 = 64;

impl ShmLink {
    /// A link over `rings`, with `stream` the pair's connection.
    pub(crate) fn new(stream: mio::net::TcpStream, rings: Rings) -> Self {
        ShmLink {
            stream,
            rings,
            eof: false,
            idle: 0,
        }
    }

    /// Wakes the peer. A full socket buffer already holds doorbells it has not read, and a
    /// broken connection shows as EOF on the read side, so neither is an error here.
    fn ring_doorbell(&mut self) {
        let _ = self.stream.write(&[1]);
    }

    /// Reads the doorbells that have arrived. `Ok(false)` when the connection has ended.
    fn read_doorbells(&mut self) -> io::Result<bool> {
        if self.eof {
            return Ok(false);
        }
        let mut sink = [0u8; DOORBELLS];
        loop {
            match self.stream.read(&mut sink) {
                Ok(0) => break,
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(true),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                // A peer that exits with our doorbells unread resets the connection: an end.
                Err(e) if e.kind() == io::ErrorKind::ConnectionReset => break,
                Err(e) => return Err(e),
            }
        }
        self.eof = true;
        Ok(false)
    }

    /// Before the engine sleeps: raises this side's flags (the reader's always, the writer's
    /// when its ring is full) and reports whether the rings changed meanwhile, in which case
    /// it must not sleep. See [`super::ring`] for why no wake-up is lost.
    pub(crate) fn arm(&mut self) -> io::Result<bool> {
        // The doorbells that woke the last sleep are read here, so that the next doorbell
        // makes the connection readable again; an end found here is news for the engine.
        let was_open = !self.eof;
        let ended = !self.read_doorbells()?;
        let mut ready = self.rings.rx.arm()? || (was_open && ended);
        if self.rings.tx.full()? {
            ready |= self.rings.tx.arm()?;
        }
        Ok(ready)
    }

    /// After sleeping: lowers the flags.
    pub(crate) fn disarm(&mut self) {
        self.rings.rx.disarm();
        self.rings.tx.disarm();
    }

    /// Writes `pending` then `bye` into the ring, waiting (until `deadline`) for room, then
    /// shuts the connection's write side so the peer sees the end after them. Returns the
    /// connection, to be read until the peer closes (see `linger`).
    pub(crate) fn finish(
        mut self,
        pending: &[u8],
        bye: &[u8],
        deadline: Instant,
    ) -> io::Result<std::net::TcpStream> {
        let mut stream = std::net::TcpStream::from(self.stream);
        stream.set_nonblocking(false)?;
        for buf in [pending, bye] {
            let mut done = 0;
            while done < buf.len() {
                let w = self.rings.tx.write(&[IoSlice::new(&buf[done..])])?;
                if w.wake {
                    let _ = stream.write(&[1]);
                }
                done += w.n;
                if w.n > 0 || self.rings.tx.arm()? {
                    self.rings.tx.disarm();
                    continue;
                }
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return Err(io::ErrorKind::TimedOut.into());
                }
                stream.set_read_timeout(Some(left))?;
                let mut sink = [0u8; DOORBELLS];
                match stream.read(&mut sink) {
                    Ok(0) => return Err(io::ErrorKind::BrokenPipe.into()),
                    Ok(_) => {}
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                        return Err(io::ErrorKind::TimedOut.into());
                    }
                    Err(e) => return Err(e),
                }
                self.rings.tx.disarm();
            }
        }
        stream.shutdown(std::net::Shutdown::Write)?;
        Ok(stream)
    }
}

impl Read for ShmLink {
    /// Bytes from the ring; `WouldBlock` when it is empty, `Ok(0)` once it is empty and the
    /// connection has ended.
    fn read(&mut self, dst: &mut [u8]) -> io::Result<usize> {
        if dst.is_empty() {
            return Ok(0);
        }
        loop {
            let (k, wake) = self.rings.rx.read(dst)?;
            if wake {
                self.ring_doorbell();
            }
            if k > 0 {
                self.idle = 0;
                return Ok(k);
            }
            if self.eof {
                return Ok(0);
            }
            self.idle = self.idle.wrapping_add(1);
            if !self.idle.is_multiple_of(IDLE_READS_PER_CHECK) {
                return Err(io::ErrorKind::WouldBlock.into());
            }
            // Empty for a while: the connection tells whether the peer is still there. After
            // its EOF the ring is read once more (the peer wrote before it closed).
            if self.read_doorbells()? && self.rings.rx.ready()? == 0 {
                return Err(io::ErrorKind::WouldBlock.into());
            }
        }
    }
}

impl Write for ShmLink {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.write_vectored(&[IoSlice::new(buf)])
    }

    /// Copies what fits into the ring; `WouldBlock` when it is full, `BrokenPipe` when it is
    /// full and the peer has gone.
    fn write_vectored(&mut self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        let w = self.rings.tx.write(bufs)?;
        if w.wake {
            self.ring_doorbell();
        }
        if w.n > 0 || bufs.iter().all(|b| b.is_empty()) {
            return Ok(w.n);
        }
        if self.read_doorbells()? {
            Err(io::ErrorKind::WouldBlock.into())
        } else {
            Err(io::ErrorKind::BrokenPipe.into())
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}
