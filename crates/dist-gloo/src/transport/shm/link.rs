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
    /// The last write found the ring full: the engine waits for room.
    write_blocked: bool,
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
            write_blocked: false,
        }
    }

    /// Wakes the peer. A full socket buffer already holds doorbells it has not read, and a
    /// broken connection shows as EOF on the read side, so neither is an error here.
    pub(crate) fn ring_doorbell(&mut self) {
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
    /// when its last write found the ring full) and reports whether the rings changed since
    /// the engine last looked, in which case it must not sleep. See [`super::ring`] for why no
    /// wake-up is lost.
    pub(crate) fn arm(&mut self) -> io::Result<bool> {
        // The doorbells that woke the last sleep are read here, so that the next doorbell
        // makes the connection readable again; an end found here is news for the engine.
        let was_open = !self.eof;
        let ended = !self.read_doorbells()?;
        let mut ready = self.rings.rx.arm()? || (was_open && ended);
        // Keyed on the failed write, not on the ring being full now: room the reader freed
        // between that write and this call came without a doorbell (the flag was down), so
        // the engine must try again rather than sleep on it.
        if self.write_blocked {
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
    /// connection, to be read until the peer closes (see `linger`). While it waits it empties
    /// (and discards) the incoming ring, so that a peer closing too, and waiting for room in
    /// it, gets on to read this ring in turn instead of both waiting to the deadline.
    pub(crate) fn finish(
        mut self,
        pending: &[u8],
        bye: &[u8],
        deadline: Instant,
    ) -> io::Result<std::net::TcpStream> {
        let mut stream = std::net::TcpStream::from(self.stream);
        stream.set_nonblocking(false)?;
        // Only a ring that fills up needs somewhere to discard the incoming bytes.
        let mut sink_buf = Vec::new();
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
                let mut discarded = false;
                sink_buf.resize(64 << 10, 0);
                loop {
                    let (k, wake) = self.rings.rx.read(&mut sink_buf, false)?;
                    if wake {
                        let _ = stream.write(&[1]);
                    }
                    if k == 0 {
                        break;
                    }
                    discarded = true;
                }
                if discarded {
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
        self.read_hinted(dst, false)
    }
}

impl ShmLink {
    /// Whether the ring holds bytes to read, or is broken (the read then says how); unlike an
    /// empty read, never looks at the connection.
    pub(crate) fn may_have_input(&mut self) -> bool {
        !matches!(self.rings.rx.ready(), Ok(0))
    }

    /// [`Read::read`], with stores that bypass the cache when `streaming` (`dst` is not read
    /// again soon) and the copy is large.
    pub(crate) fn read_hinted(&mut self, dst: &mut [u8], streaming: bool) -> io::Result<usize> {
        if dst.is_empty() {
            return Ok(0);
        }
        loop {
            let (k, wake) = self.rings.rx.read(dst, streaming)?;
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
            self.write_blocked = false;
            return Ok(w.n);
        }
        self.write_blocked = true;
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

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use memmap2::MmapRaw;

    use super::*;
    use crate::transport::shm::ring::{CONTROL_BYTES, RxRing, TxRing};

    /// Two links joined by a pair of `cap`-byte rings in one anonymous mapping and a loopback
    /// connection.
    fn pair(cap: usize) -> (ShmLink, ShmLink) {
        let map = Arc::new(
            memmap2::MmapOptions::new()
                .len(2 * (CONTROL_BYTES + cap))
                .map_anon()
                .map(MmapRaw::from)
                .expect("map"),
        );
        let second = CONTROL_BYTES + cap;
        let ring = |at| {
            (
                TxRing::new(map.clone(), at, cap).expect("tx"),
                RxRing::new(map.clone(), at, cap).expect("rx"),
            )
        };
        let ((a_tx, b_rx), (b_tx, a_rx)) = (ring(0), ring(second));
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let a =
            std::net::TcpStream::connect(listener.local_addr().expect("addr")).expect("connect");
        let (b, _) = listener.accept().expect("accept");
        let stream = |s: std::net::TcpStream| {
            s.set_nonblocking(true).expect("nonblocking");
            mio::net::TcpStream::from_std(s)
        };
        (
            ShmLink::new(stream(a), Rings { rx: a_rx, tx: a_tx }),
            ShmLink::new(stream(b), Rings { rx: b_rx, tx: b_tx }),
        )
    }

    /// The lost wake-up that stalled large two-way exchanges for the engine's 100 ms sleep
    /// cap: the writer's ring is full, the reader frees room before the writer arms (so no
    /// flag is up and no doorbell comes), and the writer must not sleep on it.
    #[test]
    fn room_freed_before_the_writer_arms_keeps_it_awake() {
        let (mut a, mut b) = pair(256);
        let data = [7u8; 300];
        assert_eq!(a.write(&data).expect("write"), 256);
        let full = a.write(&data[256..]).expect_err("the ring is full");
        assert_eq!(full.kind(), io::ErrorKind::WouldBlock);
        let mut got = [0u8; 100];
        assert_eq!(b.read(&mut got).expect("read"), 100);
        assert!(
            a.arm().expect("arm"),
            "room is there: the writer must retry, not sleep"
        );
        a.disarm();
        assert_eq!(a.write(&data[256..]).expect("write"), 44);
        assert!(
            !a.arm().expect("arm"),
            "nothing to read, no write waiting: sleep"
        );
        a.disarm();
    }
}
