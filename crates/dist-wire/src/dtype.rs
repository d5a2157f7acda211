//! Element types that travel between ranks.

use std::fmt;

/// The element type of a buffer on the wire: the NCCL set plus `i16`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum DType {
    /// Signed 8-bit integer.
    I8,
    /// Unsigned 8-bit integer.
    U8,
    /// Signed 16-bit integer.
    I16,
    /// Signed 32-bit integer.
    I32,
    /// Unsigned 32-bit integer.
    U32,
    /// Signed 64-bit integer.
    I64,
    /// Unsigned 64-bit integer.
    U64,
    /// IEEE 754 binary16.
    F16,
    /// bfloat16: the upper half of an `f32`.
    BF16,
    /// IEEE 754 binary32.
    F32,
    /// IEEE 754 binary64.
    F64,
}

impl DType {
    /// Every dtype, in wire-code order.
    pub const ALL: [DType; 11] = [
        DType::I8,
        DType::U8,
        DType::I16,
        DType::I32,
        DType::U32,
        DType::I64,
        DType::U64,
        DType::F16,
        DType::BF16,
        DType::F32,
        DType::F64,
    ];

    /// Size of one element in bytes.
    pub const fn size(self) -> usize {
        match self {
            DType::I8 | DType::U8 => 1,
            DType::I16 | DType::F16 | DType::BF16 => 2,
            DType::I32 | DType::U32 | DType::F32 => 4,
            DType::I64 | DType::U64 | DType::F64 => 8,
        }
    }

    /// True for the floating-point types.
    pub const fn is_float(self) -> bool {
        matches!(self, DType::F16 | DType::BF16 | DType::F32 | DType::F64)
    }

    /// True for the integer types.
    pub const fn is_integer(self) -> bool {
        !self.is_float()
    }

    /// The name torch gives this type (`float32`, `bfloat16`, ...).
    pub const fn name(self) -> &'static str {
        match self {
            DType::I8 => "int8",
            DType::U8 => "uint8",
            DType::I16 => "int16",
            DType::I32 => "int32",
            DType::U32 => "uint32",
            DType::I64 => "int64",
            DType::U64 => "uint64",
            DType::F16 => "float16",
            DType::BF16 => "bfloat16",
            DType::F32 => "float32",
            DType::F64 => "float64",
        }
    }

    /// The one-byte wire code.
    pub const fn code(self) -> u8 {
        match self {
            DType::I8 => 0,
            DType::U8 => 1,
            DType::I16 => 2,
            DType::I32 => 3,
            DType::U32 => 4,
            DType::I64 => 5,
            DType::U64 => 6,
            DType::F16 => 7,
            DType::BF16 => 8,
            DType::F32 => 9,
            DType::F64 => 10,
        }
    }

    /// Inverse of [`DType::code`].
    pub fn from_code(code: u8) -> Option<DType> {
        DType::ALL.get(usize::from(code)).copied()
    }

    /// Encodes values as little-endian elements of this type: Rust's saturating `as` casts for
    /// integers, round to nearest for floats. For tests, benchmarks and debugging (values go
    /// through `f64`), not for hot paths.
    pub fn encode_f64s(self, values: impl IntoIterator<Item = f64>) -> Vec<u8> {
        let mut out = Vec::new();
        for v in values {
            match self {
                DType::I8 => out.extend_from_slice(&(v as i8).to_le_bytes()),
                DType::U8 => out.extend_from_slice(&(v as u8).to_le_bytes()),
                DType::I16 => out.extend_from_slice(&(v as i16).to_le_bytes()),
                DType::I32 => out.extend_from_slice(&(v as i32).to_le_bytes()),
                DType::U32 => out.extend_from_slice(&(v as u32).to_le_bytes()),
                DType::I64 => out.extend_from_slice(&(v as i64).to_le_bytes()),
                DType::U64 => out.extend_from_slice(&(v as u64).to_le_bytes()),
                DType::F16 => out.extend_from_slice(&half::f16::from_f64(v).to_le_bytes()),
                DType::BF16 => out.extend_from_slice(&half::bf16::from_f64(v).to_le_bytes()),
                DType::F32 => out.extend_from_slice(&(v as f32).to_le_bytes()),
                DType::F64 => out.extend_from_slice(&v.to_le_bytes()),
            }
        }
        out
    }

    /// Decodes little-endian elements of this type to `f64` (exact except for 64-bit
    /// integers beyond 2^53); a trailing partial element is ignored. The inverse of
    /// [`DType::encode_f64s`] for values the type holds.
    pub fn decode_f64s(self, bytes: &[u8]) -> Vec<f64> {
        fn arr<const N: usize>(c: &[u8]) -> [u8; N] {
            let mut a = [0u8; N];
            a.copy_from_slice(c);
            a
        }
        bytes
            .chunks_exact(self.size())
            .map(|c| match self {
                DType::I8 => f64::from(i8::from_le_bytes(arr(c))),
                DType::U8 => f64::from(c[0]),
                DType::I16 => f64::from(i16::from_le_bytes(arr(c))),
                DType::I32 => f64::from(i32::from_le_bytes(arr(c))),
                DType::U32 => f64::from(u32::from_le_bytes(arr(c))),
                DType::I64 => i64::from_le_bytes(arr(c)) as f64,
                DType::U64 => u64::from_le_bytes(arr(c)) as f64,
                DType::F16 => half::f16::from_le_bytes(arr(c)).to_f64(),
                DType::BF16 => half::bf16::from_le_bytes(arr(c)).to_f64(),
                DType::F32 => f64::from(f32::from_le_bytes(arr(c))),
                DType::F64 => f64::from_le_bytes(arr(c)),
            })
            .collect()
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Short names read better in error messages: "f32 × 1000".
        let s = match self {
            DType::I8 => "i8",
            DType::U8 => "u8",
            DType::I16 => "i16",
            DType::I32 => "i32",
            DType::U32 => "u32",
            DType::I64 => "i64",
            DType::U64 => "u64",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::F32 => "f32",
            DType::F64 => "f64",
        };
        f.write_str(s)
    }
}

/// A Rust type that can travel as a [`DType`].
///
/// Built on [`bytemuck::Pod`], so any `&[T]` views as `&[u8]` without `unsafe`. Implemented for
/// the primitive integers and floats listed in [`DType`], and for [`half::f16`] and
/// [`half::bf16`].
pub trait Element: bytemuck::Pod + Send + Sync + PartialEq + fmt::Debug + 'static {
    /// The wire type of `Self`.
    const DTYPE: DType;
}

macro_rules! element {
    ($($t:ty => $d:ident),* $(,)?) => {
        $(impl Element for $t { const DTYPE: DType = DType::$d; })*
    };
}

element! {
    i8 => I8, u8 => U8, i16 => I16, i32 => I32, u32 => U32, i64 => I64, u64 => U64,
    half::f16 => F16, half::bf16 => BF16, f32 => F32, f64 => F64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_round_trip_and_sizes_match_rust_types() {
        for d in DType::ALL {
            assert_eq!(DType::from_code(d.code()), Some(d));
        }
        assert_eq!(DType::from_code(11), None);
        assert_eq!(
            <half::bf16 as Element>::DTYPE.size(),
            size_of::<half::bf16>()
        );
        assert_eq!(<u64 as Element>::DTYPE.size(), size_of::<u64>());
        assert_eq!(<i16 as Element>::DTYPE.size(), size_of::<i16>());
    }

    #[test]
    fn f64_encoding_round_trips_values_every_type_holds() {
        let vals = [0.0f64, 1.0, 7.0, 100.0, 127.0, 0.5];
        for d in DType::ALL {
            let want: Vec<f64> = vals
                .iter()
                .map(|&v| if d.is_float() { v } else { v.trunc() })
                .collect();
            let bytes = d.encode_f64s(vals);
            assert_eq!(bytes.len(), vals.len() * d.size(), "{d}");
            assert_eq!(d.decode_f64s(&bytes), want, "{d}");
            // A trailing partial element is ignored.
            assert_eq!(
                d.decode_f64s(&bytes[..bytes.len() - 1]).len(),
                vals.len() - 1,
                "{d}"
            );
        }
        assert_eq!(
            DType::I8.encode_f64s([-3.0, 300.0]),
            [253, 127],
            "saturating casts"
        );
        assert_eq!(DType::F32.encode_f64s([1.5]), 1.5f32.to_le_bytes());
    }
}
