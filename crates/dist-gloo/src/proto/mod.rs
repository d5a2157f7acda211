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
//! Drivers: [`crate::transport::mem::MemTransport`] (bounded in-memory byte pipes) runs over
//! it, and the simulation tests (`tests/sim.rs`) drive many cores through a seeded network
//! with virtual time. Frames sent by reference (single-copy) are still the TCP engine's own:
//! this core refuses them.
//!
//! Architecture invariant: nothing under `proto/` performs I/O, starts a thread or reads a
//! clock (`cargo xtask check-layers` enforces it).

mod conn;
mod core;
mod parse;
mod step;

pub use conn::PeerState;
pub use core::Core;
pub use step::{Status, Step};

#[cfg(test)]
mod tests;
