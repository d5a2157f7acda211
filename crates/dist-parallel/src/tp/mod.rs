//! Tensor (model) parallelism in the Megatron style, on [`DTensor`](dist_collective::DTensor)
//! parameters over a 1-D tensor-parallel [`DeviceMesh`](dist_collective::DeviceMesh).
//!
//! A [`ParallelizePlan`] maps layer names to a [`ParallelStyle`] (torch's
//! `parallelize_module`) and shards a model's full parameters accordingly. [`TpLinear`]
//! computes on its shard; the blocks put the collectives where Megatron does:
//!
//! | block | forward | backward |
//! |---|---|---|
//! | [`TpMlp`] (`fc1` colwise, `fc2` rowwise) | 1 all_reduce | 1 all_reduce |
//! | [`TpAttention`] (`q, k, v` colwise, `o` rowwise) | 1 all_reduce | 1 all_reduce |
//! | either, sequence parallel | all_gather + reduce_scatter | all_gather + reduce_scatter |
//!
//! With sequence parallelism the activations between blocks are split by tokens (`Shard(0)`),
//! so norms ([`TpLayerNorm`]) and residual adds run on `1/tp` of the tokens; their parameter
//! gradients are reduced once per step ([`TpLayerNorm::reduce_grads`]).
//!
//! Everything is `f32` on flat row-major buffers; activations are `[tokens, hidden]`.

mod attention;
#[cfg(feature = "candle")]
pub mod candle;
mod comm;
mod linear;
mod math;
mod mlp;
mod norm;
mod style;

pub use attention::{AttnSaved, TpAttention};
pub use linear::TpLinear;
pub use mlp::{MlpSaved, TpMlp};
pub use norm::{NormSaved, TpLayerNorm};
pub use style::{FullParam, ParallelStyle, ParallelizePlan};
