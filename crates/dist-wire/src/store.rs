//! Codec of the rendezvous store protocol (PyTorch's TCPStore wire format).
//!
//! Owned by the store work; see the crate docs.
