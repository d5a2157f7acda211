//! Which slice of a global tensor lives on which rank of a mesh: [`Placement`], [`ShardLayout`]
//! and [`Chunk`].
//!
//! One description serves FSDP (each parameter is `Shard(0)` over the shard dimension, plus
//! `Replicate` over the replicate dimension for HSDP), the distributed checkpoint (which rank
//! wrote which box of which tensor) and DTensor / tensor parallelism (any placement per mesh
//! dimension). It is pure arithmetic: no group, no communication.
//!
//! Uneven sizes follow `torch.chunk`, as torch's DTensor and FSDP2 do: a dimension of length
//! `n` split over `k` ranks gives every rank `ceil(n / k)` elements except the last ones, which
//! get what is left (possibly nothing). `10` over `4` is `3, 3, 3, 1`; `5` over `4` is
//! `2, 2, 1, 0`.

use std::fmt;
use std::ops::Range;
use std::str::FromStr;

use dist_wire::ReduceOp;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::{Error, Result};

/// How a tensor is laid out along one dimension of a device mesh (torch's DTensor placements).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Placement {
    /// Split along tensor dimension `dim` over the mesh dimension's ranks (`torch.chunk` sizes).
    Shard(usize),
    /// A full copy on every rank of the mesh dimension.
    Replicate,
    /// Every rank holds a partial value; the tensor is their reduction with this op.
    Partial(ReduceOp),
}

impl Placement {
    /// True for [`Placement::Shard`].
    pub fn is_shard(&self) -> bool {
        matches!(self, Placement::Shard(_))
    }

    /// The sharded tensor dimension, if this is a [`Placement::Shard`].
    pub fn shard_dim(&self) -> Option<usize> {
        match *self {
            Placement::Shard(d) => Some(d),
            _ => None,
        }
    }
}

/// Written as torch prints placements: `Shard(0)`, `Replicate()`, `Partial(SUM)`.
impl fmt::Display for Placement {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Placement::Shard(d) => write!(f, "Shard({d})"),
            Placement::Replicate => f.write_str("Replicate()"),
            Placement::Partial(ReduceOp::PremulSum(s)) => write!(f, "Partial(PREMUL_SUM:{s})"),
            Placement::Partial(op) => write!(f, "Partial({})", op.name()),
        }
    }
}

impl FromStr for Placement {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        let bad = || Error::InvalidLayout {
            reason: format!(
                "cannot parse placement {s:?} (want Shard(d), Replicate() or Partial(OP))"
            ),
        };
        let inner = |prefix: &str| s.strip_prefix(prefix).and_then(|r| r.strip_suffix(')'));
        if s == "Replicate()" {
            return Ok(Placement::Replicate);
        }
        if let Some(d) = inner("Shard(") {
            return d.parse().map(Placement::Shard).map_err(|_| bad());
        }
        let op = inner("Partial(").ok_or_else(bad)?;
        let op = match op {
            "SUM" => ReduceOp::Sum,
            "PRODUCT" => ReduceOp::Product,
            "MIN" => ReduceOp::Min,
            "MAX" => ReduceOp::Max,
            "BAND" => ReduceOp::BitAnd,
            "BOR" => ReduceOp::BitOr,
            "BXOR" => ReduceOp::BitXor,
            "AVG" => ReduceOp::Avg,
            other => {
                let scale = other.strip_prefix("PREMUL_SUM:").ok_or_else(bad)?;
                ReduceOp::PremulSum(scale.parse().map_err(|_| bad())?)
            }
        };
        Ok(Placement::Partial(op))
    }
}

impl Serialize for Placement {
    fn serialize<S: Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for Placement {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

/// The elements `[start, end)` that part `index` of `parts` gets of a dimension of length
/// `len`, with `torch.chunk` sizes (every part `ceil(len / parts)` long until the elements run
/// out). `parts` must be positive and `index < parts`.
pub fn chunk_range(len: usize, parts: usize, index: usize) -> Range<usize> {
    assert!(
        parts > 0 && index < parts,
        "chunk_range: part {index} of {parts}"
    );
    let size = len.div_ceil(parts);
    let start = (size * index).min(len);
    let end = (start + size).min(len);
    start..end
}

/// The largest part of `len` split `torch.chunk`-style over `parts`: the padded per-rank size a
/// collective buffer uses so that every rank sends the same count.
pub fn padded_chunk_len(len: usize, parts: usize) -> usize {
    len.div_ceil(parts.max(1))
}

/// A box of a global tensor: `offsets[d] .. offsets[d] + shape[d]` along every dimension.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Chunk {
    /// Where the box starts along each dimension of the global tensor.
    pub offsets: Vec<usize>,
    /// The box's extent along each dimension.
    pub shape: Vec<usize>,
}

impl Chunk {
    /// The box covering all of a tensor of `shape`.
    pub fn full(shape: &[usize]) -> Self {
        Chunk {
            offsets: vec![0; shape.len()],
            shape: shape.to_vec(),
        }
    }

    /// Number of elements in the box.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// The part of this box both boxes cover, or `None` when they do not overlap (or either is
    /// empty). Both must have the same number of dimensions.
    pub fn intersect(&self, other: &Chunk) -> Option<Chunk> {
        debug_assert_eq!(self.offsets.len(), other.offsets.len());
        let mut offsets = Vec::with_capacity(self.offsets.len());
        let mut shape = Vec::with_capacity(self.offsets.len());
        for d in 0..self.offsets.len() {
            let lo = self.offsets[d].max(other.offsets[d]);
            let hi = (self.offsets[d] + self.shape[d]).min(other.offsets[d] + other.shape[d]);
            if hi <= lo {
                return None;
            }
            offsets.push(lo);
            shape.push(hi - lo);
        }
        Some(Chunk { offsets, shape })
    }
}

/// How a tensor of `global_shape` is placed over a mesh of `mesh_shape`: one [`Placement`] per
/// mesh dimension, applied in mesh-dimension order (two `Shard(0)` on a 2-D mesh split dim 0 by
/// the first mesh dimension, then each piece again by the second, as torch does).
///
/// ```
/// use dist_collective::{Chunk, Placement, ShardLayout};
/// // A [10, 4] weight, FSDP-style Shard(0) over 4 ranks: rows 3, 3, 3, 1.
/// let layout = ShardLayout::new(&[10, 4], &[4], &[Placement::Shard(0)])?;
/// assert_eq!(layout.local_chunk(&[3]), Chunk { offsets: vec![9, 0], shape: vec![1, 4] });
/// assert_eq!(layout.padded_local_shape(), vec![3, 4]);
/// # Ok::<(), dist_collective::Error>(())
/// ```
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(try_from = "LayoutFields")]
pub struct ShardLayout {
    global_shape: Vec<usize>,
    mesh_shape: Vec<usize>,
    placements: Vec<Placement>,
}

/// A [`ShardLayout`] as read, before [`ShardLayout::new`] checks it: a layout from a file
/// (a checkpoint's) must pass the same checks as one built in code, or `local_chunk` and the
/// like index out of bounds on it.
#[derive(Deserialize)]
struct LayoutFields {
    global_shape: Vec<usize>,
    mesh_shape: Vec<usize>,
    placements: Vec<Placement>,
}

impl TryFrom<LayoutFields> for ShardLayout {
    type Error = Error;

    fn try_from(f: LayoutFields) -> Result<Self> {
        ShardLayout::new(&f.global_shape, &f.mesh_shape, &f.placements)
    }
}

impl ShardLayout {
    /// Checks that there is one placement per mesh dimension and that every `Shard(d)` names a
    /// dimension the tensor has.
    pub fn new(
        global_shape: &[usize],
        mesh_shape: &[usize],
        placements: &[Placement],
    ) -> Result<Self> {
        if mesh_shape.is_empty() || mesh_shape.contains(&0) {
            return Err(Error::InvalidLayout {
                reason: format!(
                    "mesh shape {mesh_shape:?} must have at least one dimension, none of size 0"
                ),
            });
        }
        if placements.len() != mesh_shape.len() {
            return Err(Error::InvalidLayout {
                reason: format!(
                    "{} placements for a {}-D mesh {mesh_shape:?}; give one per mesh dimension",
                    placements.len(),
                    mesh_shape.len()
                ),
            });
        }
        // Every element count and rank count of the layout is a product of these: one past
        // usize wrapped (in release builds) to a layout whose lengths check out falsely.
        for (what, shape) in [("tensor", global_shape), ("mesh", mesh_shape)] {
            if shape
                .iter()
                .try_fold(1usize, |a, &d| a.checked_mul(d))
                .is_none()
            {
                return Err(Error::InvalidLayout {
                    reason: format!("{what} shape {shape:?} has more elements than usize counts"),
                });
            }
        }
        for p in placements {
            if let Placement::Shard(d) = *p
                && d >= global_shape.len()
            {
                return Err(Error::InvalidLayout {
                    reason: format!(
                        "{p} on a tensor of shape {global_shape:?}, which has {} dimension(s)",
                        global_shape.len()
                    ),
                });
            }
        }
        Ok(ShardLayout {
            global_shape: global_shape.to_vec(),
            mesh_shape: mesh_shape.to_vec(),
            placements: placements.to_vec(),
        })
    }

    /// A 1-D layout: `Shard(0)` over `world` ranks (FSDP's layout of one parameter).
    pub fn shard_dim0(global_shape: &[usize], world: usize) -> Result<Self> {
        if global_shape.is_empty() {
            return Err(Error::InvalidLayout {
                reason: "Shard(0) of a 0-D tensor; view a scalar as shape [1]".into(),
            });
        }
        Self::new(global_shape, &[world], &[Placement::Shard(0)])
    }

    /// The global tensor's shape.
    pub fn global_shape(&self) -> &[usize] {
        &self.global_shape
    }

    /// The mesh's shape.
    pub fn mesh_shape(&self) -> &[usize] {
        &self.mesh_shape
    }

    /// One placement per mesh dimension.
    pub fn placements(&self) -> &[Placement] {
        &self.placements
    }

    /// Elements in the global tensor.
    pub fn global_numel(&self) -> usize {
        self.global_shape.iter().product()
    }

    /// The same tensor with placement `placement` on mesh dimension `mesh_dim`.
    pub fn with_placement(&self, mesh_dim: usize, placement: Placement) -> Result<Self> {
        let mut placements = self.placements.clone();
        let slot = placements
            .get_mut(mesh_dim)
            .ok_or_else(|| Error::InvalidLayout {
                reason: format!(
                    "mesh dimension {mesh_dim} of a {}-D mesh",
                    self.mesh_shape.len()
                ),
            })?;
        *slot = placement;
        Self::new(&self.global_shape, &self.mesh_shape, &placements)
    }

    /// The box of the global tensor held by the rank at mesh coordinate `coord` (`Replicate` and
    /// `Partial` dimensions do not split it). Panics if `coord` is outside the mesh.
    pub fn local_chunk(&self, coord: &[usize]) -> Chunk {
        assert_eq!(
            coord.len(),
            self.mesh_shape.len(),
            "coordinate rank vs mesh rank"
        );
        let mut chunk = Chunk::full(&self.global_shape);
        for ((p, &c), &n) in self.placements.iter().zip(coord).zip(&self.mesh_shape) {
            assert!(
                c < n,
                "mesh coordinate {coord:?} outside mesh {:?}",
                self.mesh_shape
            );
            if let Placement::Shard(d) = *p {
                let r = chunk_range(chunk.shape[d], n, c);
                chunk.offsets[d] += r.start;
                chunk.shape[d] = r.len();
            }
        }
        chunk
    }

    /// The local shape every rank would have if uneven pieces were padded to the largest: what a
    /// collective's per-rank buffer holds.
    pub fn padded_local_shape(&self) -> Vec<usize> {
        let mut shape = self.global_shape.clone();
        for (p, &n) in self.placements.iter().zip(&self.mesh_shape) {
            if let Placement::Shard(d) = *p {
                shape[d] = padded_chunk_len(shape[d], n);
            }
        }
        shape
    }

    /// Every mesh coordinate with the box it holds, row-major (the last mesh dimension varies
    /// fastest, matching [`DeviceMesh`](crate::DeviceMesh)'s rank order).
    pub fn all_chunks(&self) -> Vec<(Vec<usize>, Chunk)> {
        let total: usize = self.mesh_shape.iter().product();
        (0..total)
            .map(|mut r| {
                let mut coord = vec![0; self.mesh_shape.len()];
                for d in (0..coord.len()).rev() {
                    coord[d] = r % self.mesh_shape[d];
                    r /= self.mesh_shape[d];
                }
                let chunk = self.local_chunk(&coord);
                (coord, chunk)
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_follow_torch_chunk() {
        let sizes = |len, parts| {
            (0..parts)
                .map(|i| chunk_range(len, parts, i).len())
                .collect::<Vec<_>>()
        };
        assert_eq!(sizes(10, 4), [3, 3, 3, 1]);
        assert_eq!(sizes(5, 4), [2, 2, 1, 0]);
        assert_eq!(sizes(0, 3), [0, 0, 0]);
        assert_eq!(sizes(1, 1), [1]);
        assert_eq!(sizes(8, 4), [2, 2, 2, 2]);
    }

    #[test]
    fn chunks_tile_the_tensor_exactly() {
        for len in 0..40 {
            for parts in 1..9 {
                let mut next = 0;
                for i in 0..parts {
                    let r = chunk_range(len, parts, i);
                    assert_eq!(r.start, next, "len {len} parts {parts} part {i}");
                    assert!(r.len() <= padded_chunk_len(len, parts));
                    next = r.end;
                }
                assert_eq!(next, len);
            }
        }
    }

    #[test]
    fn nested_shards_split_the_local_piece_again() {
        // [8, 6] on a 2x2 mesh: rows over mesh dim 0, then rows of each half over mesh dim 1.
        let l = ShardLayout::new(
            &[8, 6],
            &[2, 2],
            &[Placement::Shard(0), Placement::Shard(0)],
        )
        .unwrap();
        let rows: Vec<_> = l
            .all_chunks()
            .into_iter()
            .map(|(_, c)| (c.offsets[0], c.shape[0]))
            .collect();
        assert_eq!(rows, [(0, 2), (2, 2), (4, 2), (6, 2)]);
        // Shard(1) on the second dimension, Replicate on the first.
        let l = ShardLayout::new(
            &[3, 5],
            &[2, 2],
            &[Placement::Replicate, Placement::Shard(1)],
        )
        .unwrap();
        assert_eq!(
            l.local_chunk(&[1, 1]),
            Chunk {
                offsets: vec![0, 3],
                shape: vec![3, 2]
            }
        );
        assert_eq!(l.padded_local_shape(), vec![3, 3]);
    }

    #[test]
    fn bad_layouts_are_errors_naming_the_problem() {
        let e = ShardLayout::new(&[4], &[2], &[Placement::Shard(1)])
            .unwrap_err()
            .to_string();
        assert!(e.contains("Shard(1)") && e.contains("[4]"), "{e}");
        let e = ShardLayout::new(&[4], &[2, 2], &[Placement::Replicate])
            .unwrap_err()
            .to_string();
        assert!(e.contains("1 placements for a 2-D mesh"), "{e}");
        assert!(ShardLayout::new(&[4], &[0], &[Placement::Replicate]).is_err());
        assert!(ShardLayout::shard_dim0(&[], 2).is_err());
    }

    #[test]
    fn placements_round_trip_through_text_and_json() {
        for p in [
            Placement::Shard(2),
            Placement::Replicate,
            Placement::Partial(ReduceOp::Sum),
            Placement::Partial(ReduceOp::Avg),
            Placement::Partial(ReduceOp::PremulSum(0.25)),
        ] {
            assert_eq!(p.to_string().parse::<Placement>().unwrap(), p);
            let l = ShardLayout::new(&[4, 4, 4], &[2], &[p]).unwrap();
            let json = serde_json::to_string(&l).unwrap();
            assert_eq!(serde_json::from_str::<ShardLayout>(&json).unwrap(), l);
        }
        assert!("Shard(x)".parse::<Placement>().is_err());
        // A layout read from text passes ShardLayout::new's checks, as one built in code.
        for bad in [
            r#"{"global_shape":[4],"mesh_shape":[0],"placements":["Shard(3)"]}"#,
            r#"{"global_shape":[4],"mesh_shape":[2],"placements":["Shard(1)"]}"#,
            r#"{"global_shape":[4],"mesh_shape":[2,2],"placements":["Replicate"]}"#,
            // Products past usize: they wrapped to a layout whose lengths checked out.
            r#"{"global_shape":[4294967296,4294967296],"mesh_shape":[2],"placements":["Replicate"]}"#,
            r#"{"global_shape":[4],"mesh_shape":[4294967296,4294967296],"placements":["Replicate","Replicate"]}"#,
        ] {
            let e = serde_json::from_str::<ShardLayout>(bad).unwrap_err();
            assert!(e.to_string().contains("invalid layout"), "{bad}: {e}");
        }
    }

    #[test]
    fn intersections() {
        let a = Chunk {
            offsets: vec![0, 0],
            shape: vec![4, 4],
        };
        let b = Chunk {
            offsets: vec![2, 3],
            shape: vec![4, 4],
        };
        assert_eq!(
            a.intersect(&b),
            Some(Chunk {
                offsets: vec![2, 3],
                shape: vec![2, 1]
            })
        );
        let c = Chunk {
            offsets: vec![4, 0],
            shape: vec![1, 1],
        };
        assert_eq!(a.intersect(&c), None);
    }
}
