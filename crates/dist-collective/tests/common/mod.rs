//! The typed conformance harness: deterministic per-rank inputs for every element type, the
//! reduction of them computed independently of the library (in `f64`/`i64`, exact for these
//! small values), and a collector of mismatches that never panics, so every rank keeps issuing
//! the same collectives whatever it finds.

#![allow(
    unreachable_pub,
    reason = "a test harness module is private to its test binary"
)]

use std::fmt::Debug;

use dist_collective::{DType, Element, ReduceOp};
use dist_wire::{bf16, f16};

/// An element type the suite runs, with exact conversions for the small values it uses.
pub trait Val: Element + PartialEq + Debug {
    /// Converts a small integer or half-integer value.
    fn from_f64(v: f64) -> Self;
    /// The value as `f64`.
    fn to_f64(self) -> f64;
}

macro_rules! prim_val {
    ($($t:ty),*) => {$(
        impl Val for $t {
            fn from_f64(v: f64) -> Self {
                v as $t
            }
            fn to_f64(self) -> f64 {
                self as f64
            }
        }
    )*};
}
prim_val!(i8, u8, i16, i32, u32, i64, u64, f32, f64);

macro_rules! half_val {
    ($($t:ty),*) => {$(
        impl Val for $t {
            fn from_f64(v: f64) -> Self {
                <$t>::from_f64(v)
            }
            fn to_f64(self) -> f64 {
                <$t>::to_f64(self)
            }
        }
    )*};
}
half_val!(f16, bf16);

fn signed(d: DType) -> bool {
    d.is_float() || matches!(d, DType::I8 | DType::I16 | DType::I32 | DType::I64)
}

/// The logical value of element `i` on rank `r` when reducing with `op`: small integers
/// (Product: 1 or 2, so a product over five ranks fits an `i8`), negative ones where `d` has
/// them, exact in every type.
pub fn value(d: DType, op: ReduceOp, r: usize, i: usize) -> f64 {
    match op {
        ReduceOp::Product => 1.0 + ((r + i) % 2) as f64,
        _ => ((r * 7 + i * 3) % 11) as f64 - if signed(d) { 5.0 } else { 0.0 },
    }
}

/// Rank `r`'s input of `len` elements for `op`.
pub fn input<T: Val>(op: ReduceOp, r: usize, len: usize) -> Vec<T> {
    (0..len)
        .map(|i| T::from_f64(value(T::DTYPE, op, r, i)))
        .collect()
}

/// Element `i` of `op` over ranks `first..first + n`, computed without the library.
pub fn reference(d: DType, op: ReduceOp, first: usize, n: usize, i: usize) -> f64 {
    let vals = (first..first + n).map(|r| value(d, op, r, i));
    let ints = vals.clone().map(|v| v as i64);
    match op {
        ReduceOp::Sum => vals.sum(),
        ReduceOp::Product => vals.product(),
        ReduceOp::Min => vals.fold(f64::INFINITY, f64::min),
        ReduceOp::Max => vals.fold(f64::NEG_INFINITY, f64::max),
        ReduceOp::BitAnd => ints.fold(-1, |a, b| a & b) as f64,
        ReduceOp::BitOr => ints.fold(0, |a, b| a | b) as f64,
        ReduceOp::BitXor => ints.fold(0, |a, b| a ^ b) as f64,
        ReduceOp::Avg if d.is_float() => vals.sum::<f64>() / n as f64,
        // Integer averages truncate toward zero, as integer division does.
        ReduceOp::Avg => (ints.sum::<i64>() / n as i64) as f64,
        ReduceOp::PremulSum(s) => vals.map(|v| v * s).sum(),
        _ => unreachable!("every op of ReduceOp::ALL is listed"),
    }
}

/// How far a result may be from the reference: exact, except a float average, whose division
/// rounds (half types round twice: once in `f32`, once to 16 bits).
pub fn tolerance(d: DType, op: ReduceOp) -> f64 {
    match (op, d) {
        (ReduceOp::Avg, DType::F16) => 1e-3,
        (ReduceOp::Avg, DType::BF16) => 8e-3,
        (ReduceOp::Avg, DType::F32) => 1e-6,
        (ReduceOp::Avg, DType::F64) => 1e-12,
        _ => 0.0,
    }
}

/// Mismatches found on one rank; the first few are kept whole, the rest counted.
#[derive(Debug, Default)]
pub struct Fails {
    /// Kept messages.
    pub kept: Vec<String>,
    /// Every mismatch, kept or not.
    pub count: usize,
}

impl Fails {
    fn push(&mut self, msg: String) {
        self.count += 1;
        if self.kept.len() < 20 {
            self.kept.push(msg);
        }
    }

    /// Checks `got` against `want(i)` within `tol` (relative, at least 1 absolute unit).
    pub fn close<T: Val>(
        &mut self,
        what: &str,
        got: &[T],
        len: usize,
        want: impl Fn(usize) -> f64,
        tol: f64,
    ) {
        if got.len() != len {
            self.push(format!("{what}: {} elements, want {len}", got.len()));
            return;
        }
        for (i, g) in got.iter().enumerate() {
            let (g, w) = (g.to_f64(), want(i));
            if (g - w).abs() > tol * w.abs().max(1.0) {
                self.push(format!("{what}: element {i} is {g}, want {w}"));
                return;
            }
        }
    }

    /// Checks `got == want` element by element.
    pub fn same<T: Val>(&mut self, what: &str, got: &[T], want: &[T]) {
        if got != want {
            let at = got.iter().zip(want).position(|(a, b)| a != b);
            self.push(format!(
                "{what}: {} elements, want {}; first difference at {at:?}",
                got.len(),
                want.len()
            ));
        }
    }
}
