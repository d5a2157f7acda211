//! The peer protocol as a sans-IO state machine: the rules by which two ranks exchange framed
//! messages, with no sockets, threads or clocks.
//!
//! [`Core`] holds one rank's state with each peer: the bytes received and not yet parsed, the
//! frames that arrived before the step that wants them (the stash), what each peer said about
//! leaving (a goodbye, or an abort notice naming a culprit and a cause), and the control
//! bytes owed to it. A [`Step`] is one [`crate::transport::Transport::exchange`] in progress.
//! Bytes, end of input, errors and the time go in; bytes to transmit, delivered frames (the
//! step's `on_frame`), and the step's [`Status`] and result come out.
//!
//! The rules, in one place:
//! * a message is cut into frames of at most [`Core::segment_bytes`] bytes, each with a
//!   [`dist_wire::FrameHeader`]; messages to (from) one peer go out (come in) whole, in order;
//! * a received frame is judged against the receive it would serve
//!   (`crate::transport::judge`): the next frame, one for a later step (stashed), or a
//!   disagreement (the step fails with both sides named);
//! * a `Close` frame is a goodbye or an abort notice; the first thing learnt of a peer sticks
//!   (a notice is not overwritten by the EOF after it);
//! * a step that needs a peer that left, was lost or aborted fails naming it; a peer the step
//!   does not need that aborts fails it too, one that merely leaves does not;
//! * a failed step tells every other open peer whom to blame and why, after the rest of any
//!   half-written frame; blame learnt second-hand yields to a loss this rank saw itself, and a
//!   peer's "timed out waiting for you" moves the blame down the chain of waits;
//! * closing says goodbye, unless the group was aborted.
//!
//! * a message may go by reference (single-copy): its frames carry a
//!   [`dist_wire::PayloadRef`] to the sender's bytes, which the receiver copies through the
//!   driver's [`CopyIn`], then acknowledges the whole message between its own frames; the
//!   send is done only once acknowledged. A copy that fails (the sender gave up and withdrew
//!   its offer) delivers nothing more from that peer, and waits for the notice or the end of
//!   the stream that says why.
//!
//! One protocol, three drivers: [`crate::transport::mem::MemTransport`] (bounded in-memory
//! byte pipes), the TCP transport's engine ([`crate::transport::tcp::TcpTransport`]: sockets,
//! and shared-memory rings between ranks on one host, with the cross-memory copy as its
//! [`CopyIn`]), and the simulation tests (`tests/sim/`), which drive many cores through a
//! seeded network with virtual time, by-reference messages included. A driver moves bytes and
//! reports EOF, errors and the time; it never parses a header or decides whom to blame.
//!
//! Architecture invariant: nothing under `proto/` performs I/O, starts a thread or reads a
//! clock (`cargo xtask check-layers` enforces it).

mod conn;
mod core;
mod parse;
mod step;

use std::fmt;

use dist_wire::{CollectiveOp, PayloadRef};

pub use conn::PeerState;
pub use core::{Core, READ_AHEAD_BYTES};
pub use step::{Status, Step};

/// How a driver copies a frame a peer sent by reference: the one piece of I/O the core asks
/// for by callback, since where the bytes lie (another process's memory, read through
/// `process_vm_readv`) is the driver's business.
pub trait CopyIn: Send + Sync + fmt::Debug {
    /// Copies the `dst.len()` bytes `peer` offers at `at` into `dst`, a frame of `op`, then
    /// checks that the offer still stands. The error says why not, for the peer's loss. (A
    /// driver may copy some operations' frames differently: the TCP transport splits large
    /// ones of broadcast, scatter and gather between two threads.)
    fn copy_in(
        &self,
        peer: usize,
        op: CollectiveOp,
        at: PayloadRef,
        dst: &mut [u8],
    ) -> Result<(), String>;
}

#[cfg(test)]
mod tests;
