//! The checkpoint's JSON index and the dtype names it shares with safetensors.

use std::collections::BTreeMap;

use dist_collective::Chunk;
use dist_wire::DType;
use serde::{Deserialize, Serialize};

/// Format version written into every index.
pub(crate) const VERSION: u32 = 1;

/// The whole index: what a complete checkpoint holds.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub(crate) struct Index {
    pub(crate) version: u32,
    /// Unique per save; every file of the save starts with it.
    pub(crate) save_id: String,
    /// Ranks that wrote the checkpoint.
    pub(crate) world_size: usize,
    pub(crate) tensors: BTreeMap<String, TensorEntry>,
}

/// One tensor: its global description and where its pieces are.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub(crate) struct TensorEntry {
    /// safetensors' dtype name (`"F32"`, `"BF16"`, ...).
    pub(crate) dtype: String,
    pub(crate) global_shape: Vec<usize>,
    pub(crate) chunks: Vec<ChunkEntry>,
}

/// One stored piece: a box of the global tensor, saved under the tensor's name in `file`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub(crate) struct ChunkEntry {
    /// File name inside the checkpoint directory.
    pub(crate) file: String,
    #[serde(flatten)]
    pub(crate) chunk: Chunk,
}

/// What one rank reports after writing its file: every piece it wrote.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub(crate) struct Written {
    pub(crate) name: String,
    pub(crate) dtype: String,
    pub(crate) global_shape: Vec<usize>,
    pub(crate) chunk: ChunkEntry,
}

/// safetensors' name of a dtype.
pub(crate) fn dtype_name(d: DType) -> &'static str {
    match d {
        DType::I8 => "I8",
        DType::U8 => "U8",
        DType::I16 => "I16",
        DType::I32 => "I32",
        DType::U32 => "U32",
        DType::I64 => "I64",
        DType::U64 => "U64",
        DType::F16 => "F16",
        DType::BF16 => "BF16",
        DType::F32 => "F32",
        DType::F64 => "F64",
        // DType is non_exhaustive; a new one gets its wire name until safetensors' is added.
        other => other.name(),
    }
}

/// The safetensors crate's dtype for ours (`None` for a dtype this crate does not know yet).
pub(crate) fn st_dtype(d: DType) -> Option<safetensors::Dtype> {
    use safetensors::Dtype as S;
    Some(match d {
        DType::I8 => S::I8,
        DType::U8 => S::U8,
        DType::I16 => S::I16,
        DType::I32 => S::I32,
        DType::U32 => S::U32,
        DType::I64 => S::I64,
        DType::U64 => S::U64,
        DType::F16 => S::F16,
        DType::BF16 => S::BF16,
        DType::F64 => S::F64,
        DType::F32 => S::F32,
        _ => return None,
    })
}
