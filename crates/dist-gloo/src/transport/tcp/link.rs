//! What a [`super::conn::Conn`] reads and writes its peer's byte stream through: the TCP
//! connection itself, or a shared-memory link that keeps the connection as its doorbell.

use std::io::{self, IoSlice, Read, Write};
use std::time::{Duration, Instant};

use crate::transport::shm::link::ShmLink;

/// A peer's byte stream.
#[derive(Debug)]
pub(super) enum Link {
    /// Frames on the TCP connection.
    Tcp(mio::net::TcpStream),
    /// Frames in shared-memory rings; the connection carries doorbells.
    Shm(Box<ShmLink>),
}

impl Link {
    /// The connection registered with the poller (the doorbell, for a shared-memory link).
    pub(super) fn stream_mut(&mut self) -> &mut mio::net::TcpStream {
        match self {
            Link::Tcp(s) => s,
            Link::Shm(l) => &mut l.stream,
        }
    }

    /// Before the engine sleeps in the poller: `Ok(true)` when the link has bytes or room that
    /// appeared without a poller event, so the engine must look again instead of sleeping.
    /// A TCP connection's readiness is all in the poller.
    pub(super) fn arm(&mut self) -> io::Result<bool> {
        match self {
            Link::Tcp(_) => Ok(false),
            Link::Shm(l) => l.arm(),
        }
    }

    /// Whether a read may find bytes now: a shared-memory link's ring holds some (looked at
    /// without the read's periodic look at the connection when it finds none, a system call);
    /// a TCP connection may, for all this knows. A broken ring says yes, so that the read
    /// reports it.
    pub(super) fn may_have_input(&mut self) -> bool {
        match self {
            Link::Tcp(_) => true,
            Link::Shm(l) => l.may_have_input(),
        }
    }

    /// After the engine's sleep (see [`Link::arm`]).
    pub(super) fn disarm(&mut self) {
        if let Link::Shm(l) = self {
            l.disarm();
        }
    }

    /// Sends `pending` and `bye` (blocking, until `deadline`) and shuts down the write side;
    /// returns the connection, to be read until the peer closes its end.
    pub(super) fn finish(
        self,
        pending: &[u8],
        bye: &[u8],
        deadline: Instant,
    ) -> io::Result<std::net::TcpStream> {
        match self {
            Link::Tcp(s) => {
                let mut stream = std::net::TcpStream::from(s);
                let left = deadline.saturating_duration_since(Instant::now());
                stream.set_nonblocking(false)?;
                stream.set_write_timeout(Some(left.max(Duration::from_millis(1))))?;
                stream.write_all(pending)?;
                stream.write_all(bye)?;
                stream.shutdown(std::net::Shutdown::Write)?;
                Ok(stream)
            }
            Link::Shm(l) => l.finish(pending, bye, deadline),
        }
    }
}

impl Link {
    /// Wakes the peer if it sleeps in its poller: a doorbell on a shared-memory link; nothing
    /// on a TCP one, whose peer wakes for the bytes themselves.
    pub(super) fn doorbell(&mut self) {
        if let Link::Shm(l) = self {
            l.ring_doorbell();
        }
    }

    /// [`Read::read`]; `streaming` says the bytes go where nothing reads them again soon, so
    /// that a shared-memory link may copy them out of its ring bypassing the cache (the
    /// kernel makes a socket's copy, so TCP ignores it).
    pub(super) fn read_hinted(&mut self, buf: &mut [u8], streaming: bool) -> io::Result<usize> {
        match self {
            Link::Tcp(s) => s.read(buf),
            Link::Shm(l) => l.read_hinted(buf, streaming),
        }
    }
}

impl Read for Link {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Link::Tcp(s) => s.read(buf),
            Link::Shm(l) => l.read(buf),
        }
    }
}

impl Write for Link {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Link::Tcp(s) => s.write(buf),
            Link::Shm(l) => l.write(buf),
        }
    }

    fn write_vectored(&mut self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        match self {
            Link::Tcp(s) => s.write_vectored(bufs),
            Link::Shm(l) => l.write_vectored(bufs),
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        match self {
            Link::Tcp(s) => s.flush(),
            Link::Shm(l) => l.flush(),
        }
    }
}
