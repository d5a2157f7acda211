//! Reduce operations and which dtypes each one accepts.

use std::fmt;

use crate::{DType, WireError};

/// How a reducing collective combines the ranks' values.
///
/// Which op is valid for which dtype is decided by [`ReduceOp::check`]:
///
/// * `BitAnd`, `BitOr`, `BitXor` accept integer dtypes only.
/// * `Avg` is a sum divided by the number of contributing ranks. On integer dtypes the division
///   truncates toward zero, which is what NCCL's `ncclAvg` (the op behind torch's `ReduceOp.AVG`)
///   does for integers. On `f16` the division is split around the sum (a power of two about
///   √n before it, the rest after: [`crate::splits_average`]), so that a sum past 65504 does not
///   turn an average in range into `inf`.
/// * `PremulSum(s)` multiplies every rank's input by `s` before summing (torch's
///   `ReduceOp.PREMUL_SUM`); it accepts floating-point dtypes only, since a fractional scale
///   cannot be applied to an integer without inventing a rounding rule.
/// * Integer `Sum` and `Product` wrap on overflow, as torch's integer tensors do.
/// * Floating-point `Min` and `Max` propagate NaN (like `torch.minimum`/`torch.maximum`): if any
///   rank holds NaN at a position, the result there is NaN.
#[derive(Clone, Copy, Debug, PartialEq)]
#[non_exhaustive]
pub enum ReduceOp {
    /// Element-wise sum.
    Sum,
    /// Element-wise product.
    Product,
    /// Element-wise minimum.
    Min,
    /// Element-wise maximum.
    Max,
    /// Bitwise AND (integers only).
    BitAnd,
    /// Bitwise OR (integers only).
    BitOr,
    /// Bitwise XOR (integers only).
    BitXor,
    /// Sum divided by the number of ranks.
    Avg,
    /// Each input multiplied by the scale, then summed (floats only).
    PremulSum(f64),
}

impl ReduceOp {
    /// The op's name as torch spells it (`SUM`, `PREMUL_SUM`, ...).
    pub const fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "SUM",
            ReduceOp::Product => "PRODUCT",
            ReduceOp::Min => "MIN",
            ReduceOp::Max => "MAX",
            ReduceOp::BitAnd => "BAND",
            ReduceOp::BitOr => "BOR",
            ReduceOp::BitXor => "BXOR",
            ReduceOp::Avg => "AVG",
            ReduceOp::PremulSum(_) => "PREMUL_SUM",
        }
    }

    /// Returns an error when this op is not defined for `dtype`.
    pub fn check(self, dtype: DType) -> Result<(), WireError> {
        let ok = match self {
            ReduceOp::BitAnd | ReduceOp::BitOr | ReduceOp::BitXor => dtype.is_integer(),
            ReduceOp::PremulSum(s) => dtype.is_float() && s.is_finite(),
            _ => true,
        };
        if ok {
            Ok(())
        } else {
            Err(WireError::InvalidReduceOp { op: self, dtype })
        }
    }

    /// The pairwise combine this op uses between ranks (`Avg` and `PremulSum` combine by sum).
    pub const fn combiner(self) -> ReduceOp {
        match self {
            ReduceOp::Avg | ReduceOp::PremulSum(_) => ReduceOp::Sum,
            other => other,
        }
    }

    /// A fingerprint of the op's parameter, for headers: for `PremulSum(s)` FNV-1a over the
    /// bits of `s` folded to 24 bits and never 0 (so two ranks whose scales differ disagree
    /// unless they collide, one chance in 2^24); 0 for ops without one.
    pub fn param_fingerprint(&self) -> u32 {
        let ReduceOp::PremulSum(s) = self else {
            return 0;
        };
        let mut h: u32 = 0x811c_9dc5;
        for b in s.to_bits().to_le_bytes() {
            h = (h ^ u32::from(b)).wrapping_mul(0x0100_0193);
        }
        let folded = (h >> 24) ^ (h & 0x00ff_ffff);
        if folded == 0 { 1 } else { folded }
    }

    /// The one-byte wire code (the scale of `PremulSum` travels as
    /// [`ReduceOp::param_fingerprint`]).
    pub const fn code(self) -> u8 {
        match self {
            ReduceOp::Sum => 0,
            ReduceOp::Product => 1,
            ReduceOp::Min => 2,
            ReduceOp::Max => 3,
            ReduceOp::BitAnd => 4,
            ReduceOp::BitOr => 5,
            ReduceOp::BitXor => 6,
            ReduceOp::Avg => 7,
            ReduceOp::PremulSum(_) => 8,
        }
    }

    /// The name of the op with wire code `code` (as [`ReduceOp::name`]), for messages about
    /// headers, which carry only the code.
    pub fn code_name(code: u8) -> Option<&'static str> {
        Self::ALL
            .iter()
            .find(|o| o.code() == code)
            .map(|o| o.name())
    }

    /// Every op without a parameter, plus `PremulSum(0.5)`: handy for exhaustive tests.
    pub const ALL: [ReduceOp; 9] = [
        ReduceOp::Sum,
        ReduceOp::Product,
        ReduceOp::Min,
        ReduceOp::Max,
        ReduceOp::BitAnd,
        ReduceOp::BitOr,
        ReduceOp::BitXor,
        ReduceOp::Avg,
        ReduceOp::PremulSum(0.5),
    ];
}

impl fmt::Display for ReduceOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ReduceOp::PremulSum(s) => write!(f, "PREMUL_SUM({s})"),
            other => f.write_str(other.name()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_premul_sum_has_a_parameter_fingerprint_and_it_tells_scales_apart() {
        let fp = |s: f64| ReduceOp::PremulSum(s).param_fingerprint();
        let scales = [0.5, 0.25, 1.0, -1.0, 0.0, -0.0, 1e-300, 3.0, 1.0 / 3.0];
        for (i, a) in scales.iter().enumerate() {
            assert!(fp(*a) != 0 && fp(*a) < 1 << 24, "{a}");
            for b in &scales[i + 1..] {
                assert_ne!(fp(*a), fp(*b), "{a} and {b}");
            }
        }
        assert_eq!(fp(0.5), fp(0.5));
        assert_eq!(ReduceOp::Sum.param_fingerprint(), 0);
        assert_eq!(ReduceOp::Avg.param_fingerprint(), 0);
    }

    #[test]
    fn bitwise_ops_reject_floats_and_premul_rejects_integers() {
        assert!(ReduceOp::BitXor.check(DType::I32).is_ok());
        let err = ReduceOp::BitAnd.check(DType::F32).unwrap_err();
        assert_eq!(
            err.to_string(),
            "reduce op BAND is not defined for dtype f32"
        );
        assert!(ReduceOp::PremulSum(2.0).check(DType::I64).is_err());
        assert!(ReduceOp::PremulSum(f64::NAN).check(DType::F32).is_err());
        assert!(ReduceOp::Avg.check(DType::U8).is_ok());
    }
}
