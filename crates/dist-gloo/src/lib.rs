//! A pure-Rust CPU backend for `dist`: every collective over a full TCP mesh, with shared-memory
//! rings between the ranks of one host.
//!
//! [`GlooBackend`] implements [`dist_backend::Backend`] for host buffers. Its algorithms
//! (`algo`) are written once against the [`transport::Transport`] trait and run over
//! [`transport::tcp::TcpTransport`] between processes and hosts, or over
//! [`transport::mem::MemTransport`] inside one process for tests. Between ranks on one host
//! that may read each other's memory, large collective messages skip the sockets: the receiver
//! copies them straight out of the sender's buffer (Linux cross-memory attach; see
//! [`transport::tcp::MeshOptions::cross_memory`]). `docs/ARCHITECTURE.md` maps the crate and
//! `docs/GLOO_INTERNALS.md` says how each rule works and why.
//!
//! * all_reduce: through the group's shared memory where every rank maps it (small buffers, or
//!   larger ones in two shots where the ranks outnumber the cores); else a star through rank 0
//!   (3 to 8 ranks, tiny buffers) or recursive doubling up to [`GlooOptions::small_bytes`],
//!   recursive halving and doubling up to [`GlooOptions::halving_doubling_bytes`], and a ring
//!   in pieces above (the reduction of one frame overlapping the transfer of the next);
//! * broadcast: binomial tree / pipelined chain; reduce: binomial tree / ring reduce-scatter +
//!   gather; all_gather and reduce_scatter (equal and uneven): one direct exchange up to
//!   `small_bytes` (a star through rank 0 on 3 to 8 ranks for the smallest), ring above (all_gather's in pieces where no two ranks share memory);
//!   gather, scatter: direct, all transfers in flight at once; all_to_all: the same, or n − 1
//!   pairwise exchanges from [`GlooOptions::all_to_all_pairwise_bytes`] (the even form,
//!   `Backend::all_to_all_even`, a star through rank 0 on 3 to 8 ranks for the smallest);
//!   barrier:
//!   through the group's shared memory where every rank maps it, else a star through rank 0
//!   (3 to 8 ranks), recursive doubling (2 ranks and larger power-of-two groups) or
//!   dissemination rounds.
//!
//! Every frame carries a [`dist_wire::FrameHeader`]; ranks that call different operations (or
//! pass different arguments, the root included: rooted operations agree on them first) fail
//! with [`dist_backend::Error::Mismatch`] naming both sides, and the rank that finds it tells
//! every other rank, whose error is [`dist_backend::Error::MismatchReported`]. A peer whose
//! process dies makes every rank still waiting on the group fail with `PeerLost` naming it
//! (the first rank to see it tells the others whom to blame); one that stalls, with `Timeout`
//! naming the op, its sequence number and the ranks that did not deliver.
//!
//! ```
//! use dist_backend::{Backend, BufMut, OpOptions};
//! use dist_gloo::{GlooBackend, GlooOptions};
//! use dist_wire::{DType, ReduceOp};
//!
//! let ranks = GlooBackend::in_memory(3, &GlooOptions::default());
//! std::thread::scope(|s| {
//!     for b in &ranks {
//!         s.spawn(move || {
//!             let mut v = [b.rank() as f32 + 1.0; 4];
//!             let bytes = bytemuck::cast_slice_mut(&mut v);
//!             b.all_reduce(BufMut::Host(bytes), DType::F32, ReduceOp::Sum, &OpOptions::default()).unwrap();
//!             assert_eq!(v, [6.0; 4]);
//!         });
//!     }
//! });
//! ```

// Denied, not forbidden: a few modules allow it, each saying why at its top: the shared-memory
// rings and group area (memory shared with other processes, which no safe API can share),
// the page-table query of `huge_pages` (an ioctl), and `read_helper` (a thread writing its half
// of a caller's buffer).
#![deny(unsafe_code)]
mod algo;
mod backend;
mod options;
mod output_copy;
mod path_pace;
pub mod proto;
pub mod transport;

pub use backend::GlooBackend;
pub use options::{
    FUSED_AGREEMENT_MAX_RANKS, GlooOptions, HALVING_DOUBLING_MIN_BYTES, LAZY_ROOT_MAX_DEFERRED,
};
