//! How `dist` dtypes and reduce ops map onto NCCL's. Pure, so tested without a GPU.

use cudarc::nccl::sys::{ncclDataType_t, ncclRedOp_t, ncclResult_t};
use dist_wire::{DType, ReduceOp};

/// NCCL's type for a reduction over `dtype`; `None` for I16, which NCCL lacks.
///
/// Operations that only move data (broadcast, gathers, all_to_all, send/recv) do not need
/// this: they move `count × size` bytes as `ncclUint8`, so every dtype works there.
pub(crate) fn nccl_dtype(dtype: DType) -> Option<ncclDataType_t> {
    use ncclDataType_t as N;
    Some(match dtype {
        DType::I8 => N::ncclInt8,
        DType::U8 => N::ncclUint8,
        DType::I32 => N::ncclInt32,
        DType::U32 => N::ncclUint32,
        DType::I64 => N::ncclInt64,
        DType::U64 => N::ncclUint64,
        DType::F16 => N::ncclFloat16,
        DType::BF16 => N::ncclBfloat16,
        DType::F32 => N::ncclFloat32,
        DType::F64 => N::ncclFloat64,
        // I16, and any dtype added later: NCCL cannot reduce it.
        _ => return None,
    })
}

/// How a reduce op is served by NCCL.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum NcclOp {
    /// A built-in NCCL op.
    Builtin(ncclRedOp_t),
    /// `ncclRedOpCreatePreMulSum` with this factor (created per call, destroyed after).
    PreMulSum(f64),
}

/// NCCL's form of `op`; `None` for the bitwise ops, which NCCL lacks. Avg is NCCL's own
/// (`ncclAvg`, since 2.10) for floating types; for integers NCCL's Avg truncates like ours.
pub(crate) fn nccl_op(op: ReduceOp) -> Option<NcclOp> {
    use ncclRedOp_t as R;
    Some(match op {
        ReduceOp::Sum => NcclOp::Builtin(R::ncclSum),
        ReduceOp::Product => NcclOp::Builtin(R::ncclProd),
        ReduceOp::Min => NcclOp::Builtin(R::ncclMin),
        ReduceOp::Max => NcclOp::Builtin(R::ncclMax),
        ReduceOp::Avg => NcclOp::Builtin(R::ncclAvg),
        ReduceOp::PremulSum(f) => NcclOp::PreMulSum(f),
        // The bitwise ops, and any op added later.
        _ => return None,
    })
}

/// The PreMulSum factor as the bytes of one `dtype` element (NCCL reads the scalar in the
/// reduction's type); `None` for dtypes NCCL cannot reduce.
pub(crate) fn premul_scalar(dtype: DType, factor: f64) -> Option<[u8; 8]> {
    let mut out = [0u8; 8];
    let b: &[u8] = match dtype {
        DType::F64 => &factor.to_ne_bytes(),
        DType::F32 => &(factor as f32).to_ne_bytes(),
        DType::F16 => &half::f16::from_f64(factor).to_bits().to_ne_bytes(),
        DType::BF16 => &half::bf16::from_f64(factor).to_bits().to_ne_bytes(),
        DType::I8 => &(factor as i8).to_ne_bytes(),
        DType::U8 => &(factor as u8).to_ne_bytes(),
        DType::I32 => &(factor as i32).to_ne_bytes(),
        DType::U32 => &(factor as u32).to_ne_bytes(),
        DType::I64 => &(factor as i64).to_ne_bytes(),
        DType::U64 => &(factor as u64).to_ne_bytes(),
        _ => return None,
    };
    out[..b.len()].copy_from_slice(b);
    Some(out)
}

/// The name of an NCCL result code, for messages.
pub(crate) fn result_name(r: ncclResult_t) -> String {
    format!("{r:?}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_dtype_but_i16_reduces() {
        for d in DType::ALL {
            assert_eq!(nccl_dtype(d).is_none(), d == DType::I16, "{d:?}");
        }
        assert_eq!(nccl_dtype(DType::BF16), Some(ncclDataType_t::ncclBfloat16));
    }

    #[test]
    fn ops_map_and_bitwise_ones_are_refused() {
        assert_eq!(
            nccl_op(ReduceOp::Avg),
            Some(NcclOp::Builtin(ncclRedOp_t::ncclAvg))
        );
        assert_eq!(
            nccl_op(ReduceOp::PremulSum(0.5)),
            Some(NcclOp::PreMulSum(0.5))
        );
        for op in [ReduceOp::BitAnd, ReduceOp::BitOr, ReduceOp::BitXor] {
            assert!(nccl_op(op).is_none());
        }
    }

    #[test]
    fn the_premul_scalar_has_the_element_type() {
        let s = premul_scalar(DType::F32, 0.25).unwrap();
        assert_eq!(f32::from_ne_bytes(s[..4].try_into().unwrap()), 0.25);
        let s = premul_scalar(DType::BF16, 2.0).unwrap();
        assert_eq!(
            half::bf16::from_bits(u16::from_ne_bytes([s[0], s[1]])).to_f64(),
            2.0
        );
        let s = premul_scalar(DType::I64, 3.0).unwrap();
        assert_eq!(i64::from_ne_bytes(s), 3);
        assert!(premul_scalar(DType::I16, 1.0).is_none());
    }
}
