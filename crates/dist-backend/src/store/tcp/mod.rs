//! PyTorch's TCPStore: the [`TcpStoreServer`] event loop and the [`TcpStore`] client.

mod client;
mod server;

pub use client::{TcpStore, TcpStoreOptions};
pub use server::{ServerLimits, TcpStoreServer};
