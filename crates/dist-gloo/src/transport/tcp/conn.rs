//! One peer's byte stream as the engine drives it: the link, and what the engine knows of its
//! readiness. The rules of what flows on it live in [`crate::proto::Core`].

use super::link::Link;
use crate::transport::shm::{Rings, link::ShmLink};

/// One peer connection's I/O side.
#[derive(Debug)]
pub(super) struct Conn {
    /// The peer's byte stream: the TCP connection, or shared-memory rings.
    pub(super) link: Link,
    /// The poller (or a shared-memory link) said there may be bytes to read: read it until it
    /// would block, even when the step does not wait for it (it may carry an abort notice).
    pub(super) readable: bool,
    /// The input ended (EOF or an error) and the core was told: nothing more is read.
    pub(super) ended: bool,
}

impl Conn {
    pub(super) fn new(stream: mio::net::TcpStream) -> Self {
        Conn {
            link: Link::Tcp(stream),
            readable: false,
            ended: false,
        }
    }

    /// Moves the peer's frames onto shared-memory `rings`, keeping the connection as their
    /// doorbell (when the mesh is built, before any frame).
    pub(super) fn use_rings(mut self, rings: Rings) -> Self {
        self.link = match self.link {
            Link::Tcp(stream) => Link::Shm(Box::new(ShmLink::new(stream, rings))),
            shm @ Link::Shm(_) => shm,
        };
        self
    }

    /// Whether the peer's frames travel through shared memory.
    pub(super) fn is_shm(&self) -> bool {
        matches!(self.link, Link::Shm(_))
    }
}
