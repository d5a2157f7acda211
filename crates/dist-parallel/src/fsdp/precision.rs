//! Mixed precision: the element types parameters can be gathered in and gradients reduced in,
//! while the shards themselves stay `f32`.

use dist_wire::Element;
use half::{bf16, f16};

/// An element type FSDP can compute in: `f32`, or a 16-bit float whose values are converted
/// from and accumulated into the `f32` shards.
pub trait ComputeElement: Element + Copy + Default {
    /// Rounds an `f32` to this type (round to nearest even).
    fn from_f32(x: f32) -> Self;
    /// Widens to `f32` (exact).
    fn to_f32(self) -> f32;
}

impl ComputeElement for f32 {
    fn from_f32(x: f32) -> Self {
        x
    }
    fn to_f32(self) -> f32 {
        self
    }
}

impl ComputeElement for bf16 {
    fn from_f32(x: f32) -> Self {
        bf16::from_f32(x)
    }
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
}

impl ComputeElement for f16 {
    fn from_f32(x: f32) -> Self {
        f16::from_f32(x)
    }
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
}

/// The type gradients travel in during the reduce-scatter (torch's `reduce_dtype`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ReduceDtype {
    /// The compute type (half the bytes on the wire with bf16/f16; torch's default).
    #[default]
    Compute,
    /// `f32`, for accuracy when computing in 16 bits.
    F32,
}

pub(crate) fn convert<A: ComputeElement, B: ComputeElement>(src: &[A]) -> Vec<B> {
    src.iter().map(|x| B::from_f32(x.to_f32())).collect()
}
