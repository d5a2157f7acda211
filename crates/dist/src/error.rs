//! [`Error`]: the one error type of the facade.

/// `Result` with the facade's [`Error`]: what a function that uses several `dist` layers
/// returns (`fn main() -> dist::Result<()>`).
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Any error a `dist` call can return. Each layer's error converts into it with `?`, kept
/// whole (never stringified), so a caller can still match on the layer's variants: a rank
/// that was lost is `Error::Collective(collective::Error::Backend(backend::Error::PeerLost {
/// .. }))`. Every message names the rank and the operation.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// From process groups and their collectives (`dist::collective`), which wrap the
    /// backend's errors.
    #[error(transparent)]
    Collective(#[from] dist_collective::Error),
    /// From DDP and the other parallelism layers (`dist::parallel`).
    #[error(transparent)]
    Parallel(#[from] dist_parallel::Error),
    /// From remote calls and remote references (`dist::rpc`).
    #[error(transparent)]
    Rpc(#[from] dist_rpc::Error),
    /// From a backend used directly (`dist::backend::Backend`) or init (`dist::backend::init`).
    #[error(transparent)]
    Backend(#[from] dist_backend::Error),
    /// From a rendezvous store used directly.
    #[error(transparent)]
    Store(#[from] dist_backend::StoreError),
    /// From the sans-IO layer (kernels, codecs) used directly.
    #[error(transparent)]
    Wire(#[from] dist_wire::WireError),
}
