//! [`DeviceMesh`]: an n-dimensional layout of a group's ranks with a named sub-group per
//! dimension.

use crate::group::ProcessGroup;
use crate::{Error, Result};

/// An n-D mesh of the ranks of a group, each dimension named and backed by a sub-group (torch's
/// `DeviceMesh`): the layout data, tensor and pipeline parallelism use.
///
/// Ranks are laid out row-major (the last dimension varies fastest): on a `[("dp", 2), ("tp",
/// 2)]` mesh of 4 ranks, ranks 0 and 1 share a `tp` group, ranks 0 and 2 a `dp` group.
///
/// ```
/// use dist_collective::{DeviceMesh, ReduceOp, testing::run_world};
/// let sums = run_world(4, |pg| {
///     let mesh = DeviceMesh::new(&pg, &[("dp", 2), ("tp", 2)])?;
///     let mut x = [pg.rank() as u32];
///     mesh.dim("tp").all_reduce(&mut x, ReduceOp::Sum)?;
///     Ok(x[0])
/// })?;
/// assert_eq!(sums, vec![1, 1, 5, 5]);
/// # Ok::<(), dist_collective::Error>(())
/// ```
#[derive(Clone, Debug)]
pub struct DeviceMesh {
    group: ProcessGroup,
    names: Vec<String>,
    shape: Vec<usize>,
    coord: Vec<usize>,
    dims: Vec<ProcessGroup>,
}

impl DeviceMesh {
    /// Lays `group`'s ranks out as `dims` (name, size) and creates one sub-group per dimension.
    /// Every rank of `group` calls it with the same `dims`; the sizes must multiply to the
    /// group's world size.
    pub fn new(group: &ProcessGroup, dims: &[(&str, usize)]) -> Result<Self> {
        let rank = group.rank();
        // A product past usize::MAX counts as no size at all: wrapped, [2^63 + 1, 2] passed
        // for 2 ranks.
        let total = dims
            .iter()
            .try_fold(1usize, |p, d| p.checked_mul(d.1))
            .unwrap_or(usize::MAX);
        if dims.is_empty() || total != group.world_size() {
            return Err(Error::size(
                rank,
                "DeviceMesh::new",
                "mesh (product of dims)",
                group.world_size(),
                total,
            ));
        }
        for (i, (n, _)) in dims.iter().enumerate() {
            if dims[..i].iter().any(|(m, _)| m == n) {
                return Err(Error::invalid(
                    rank,
                    "DeviceMesh::new",
                    format!("dimension name {n:?} repeats"),
                ));
            }
        }
        let shape: Vec<usize> = dims.iter().map(|d| d.1).collect();
        let mut coord = vec![0; shape.len()];
        let mut rest = rank;
        for d in (0..shape.len()).rev() {
            coord[d] = rest % shape[d];
            rest /= shape[d];
        }
        // One creation: the group's timeout bounds all the dimensions' splits together.
        let deadline = group.creation_deadline();
        let mut groups = Vec::with_capacity(shape.len());
        for d in 0..shape.len() {
            // Ranks that agree on every other coordinate share the dimension-d group.
            let mut color = 0usize;
            for (e, (&c, &s)) in coord.iter().zip(&shape).enumerate() {
                if e != d {
                    color = color * s + c;
                }
            }
            let pg = group
                .split_by(
                    "DeviceMesh::new",
                    Some(color as u32),
                    coord[d] as i64,
                    deadline,
                )?
                .ok_or_else(|| {
                    Error::invalid(rank, "DeviceMesh::new", "split returned no group")
                })?;
            groups.push(pg);
        }
        Ok(DeviceMesh {
            group: group.clone(),
            names: dims.iter().map(|d| d.0.to_owned()).collect(),
            shape,
            coord,
            dims: groups,
        })
    }

    /// The sub-group of dimension `name`.
    ///
    /// # Panics
    ///
    /// If the mesh has no such dimension (like indexing a map); see
    /// [`get_dim`](DeviceMesh::get_dim).
    pub fn dim(&self, name: &str) -> &ProcessGroup {
        self.get_dim(name).unwrap_or_else(|| {
            panic!(
                "DeviceMesh has no dimension {name:?} (dimensions: {:?})",
                self.names
            )
        })
    }

    /// The sub-group of dimension `name`, or `None`.
    pub fn get_dim(&self, name: &str) -> Option<&ProcessGroup> {
        self.index(name).map(|i| &self.dims[i])
    }

    /// The sub-group of dimension `index` (its group rank is this rank's coordinate there).
    ///
    /// # Panics
    ///
    /// If `index >= ndim()`.
    pub fn dim_group(&self, index: usize) -> &ProcessGroup {
        &self.dims[index]
    }

    /// The 1-D mesh of dimension `name` alone (torch's `mesh["tp"]`): this rank's row along
    /// that dimension, over the dimension's existing group (no communication), or `None` if
    /// the mesh has no such dimension. Tensor parallelism takes such a mesh.
    pub fn sub_mesh(&self, name: &str) -> Option<DeviceMesh> {
        let i = self.index(name)?;
        Some(DeviceMesh {
            group: self.dims[i].clone(),
            names: vec![self.names[i].clone()],
            shape: vec![self.shape[i]],
            coord: vec![self.coord[i]],
            dims: vec![self.dims[i].clone()],
        })
    }

    /// The whole mesh's group.
    pub fn group(&self) -> &ProcessGroup {
        &self.group
    }

    /// Dimension names, in order.
    pub fn dim_names(&self) -> &[String] {
        &self.names
    }

    /// Dimension sizes, in order.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// Number of dimensions.
    pub fn ndim(&self) -> usize {
        self.shape.len()
    }

    /// Size of dimension `name`, or `None`.
    pub fn size(&self, name: &str) -> Option<usize> {
        self.index(name).map(|i| self.shape[i])
    }

    /// This rank's coordinate along each dimension.
    pub fn coordinate(&self) -> &[usize] {
        &self.coord
    }

    fn index(&self, name: &str) -> Option<usize> {
        self.names.iter().position(|n| n == name)
    }
}
