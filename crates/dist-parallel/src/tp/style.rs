//! [`ParallelStyle`] and [`ParallelizePlan`]: which layer is split how (torch's
//! `parallelize_module` plan), and the sharding of a model's full parameters by it.

use dist_collective::{DTensor, DeviceMesh, Placement};

use crate::{Error, Result};

/// How one layer is split over the tensor-parallel mesh dimension (torch's
/// `ColwiseParallel`, `RowwiseParallel`, `SequenceParallel`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ParallelStyle {
    /// A linear layer's output features are split: weight `[out, in]` is `Shard(0)`, bias
    /// `Shard(0)`; the input is replicated, the output sharded on its last dimension.
    Colwise,
    /// A linear layer's input features are split: weight `Shard(1)`, bias `Replicate`; the
    /// input is sharded on its last dimension, the output partial until reduced.
    Rowwise,
    /// A norm that runs on a shard of the sequence: its parameters are replicated and their
    /// gradients partial (reduced over the tensor-parallel group at the end of backward).
    SequenceParallel,
}

impl ParallelStyle {
    /// Placements of a parameter named `leaf` (`"weight"` or `"bias"`) of a layer with this
    /// style on a 1-D tensor-parallel mesh.
    pub fn placement(self, leaf: &str) -> Placement {
        match (self, leaf) {
            (ParallelStyle::Colwise, _) => Placement::Shard(0),
            (ParallelStyle::Rowwise, "weight") => Placement::Shard(1),
            _ => Placement::Replicate,
        }
    }
}

/// Layer-name patterns mapped to styles, as torch's `parallelize_module` takes them:
/// `"layers.*.mlp.fc1"` (`*` matches any run of characters, dots included). A parameter's
/// layer is its name without the last segment (`"mlp.fc1.weight"` belongs to `"mlp.fc1"`).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ParallelizePlan {
    entries: Vec<(String, ParallelStyle)>,
}

/// One parameter of the full (unsharded) model: its name, shape and values, the same on
/// every rank.
#[derive(Clone, Copy, Debug)]
pub struct FullParam<'a> {
    /// Dotted name, `"<layer>.<weight|bias>"`.
    pub name: &'a str,
    /// Shape (`[out, in]` for a linear weight).
    pub shape: &'a [usize],
    /// Row-major values.
    pub values: &'a [f32],
}

impl ParallelizePlan {
    /// An empty plan (every parameter replicated).
    pub fn new() -> Self {
        Self::default()
    }

    /// The plan with layers matching `pattern` split by `style` (the first matching entry
    /// wins).
    pub fn with(mut self, pattern: &str, style: ParallelStyle) -> Self {
        self.entries.push((pattern.to_owned(), style));
        self
    }

    /// The style of layer `layer`, if a pattern matches it.
    pub fn style_for(&self, layer: &str) -> Option<ParallelStyle> {
        self.entries
            .iter()
            .find(|(p, _)| glob(p.as_bytes(), layer.as_bytes()))
            .map(|e| e.1)
    }

    /// Shards every parameter of `params` over the 1-D tensor-parallel `mesh` by its layer's
    /// style (a local slice, no communication), in the order given. A pattern that matches no
    /// layer, a parameter name without a layer, or a style on a parameter of the wrong shape
    /// is an error: a typo in a plan would otherwise leave a layer silently replicated.
    pub fn distribute(
        &self,
        mesh: &DeviceMesh,
        params: &[FullParam<'_>],
    ) -> Result<Vec<(String, DTensor<f32>)>> {
        const OP: &str = "ParallelizePlan::distribute";
        let rank = mesh.group().rank();
        let err = |reason: String| Error::InvalidInput {
            rank,
            op: OP,
            reason,
        };
        if mesh.ndim() != 1 {
            return Err(err(format!(
                "tensor parallelism takes a 1-D mesh, got shape {:?}; pass mesh.sub_mesh(\"tp\")",
                mesh.shape()
            )));
        }
        for (p, _) in &self.entries {
            let used = params.iter().any(|q| {
                q.name
                    .rsplit_once('.')
                    .is_some_and(|(l, _)| glob(p.as_bytes(), l.as_bytes()))
            });
            if !used {
                return Err(err(format!("plan pattern {p:?} matches no layer")));
            }
        }
        params
            .iter()
            .map(|q| {
                let (layer, leaf) = q.name.rsplit_once('.').ok_or_else(|| {
                    err(format!(
                        "parameter {:?} has no layer name before its leaf",
                        q.name
                    ))
                })?;
                let placement = match self.style_for(layer) {
                    Some(s @ (ParallelStyle::Colwise | ParallelStyle::Rowwise)) => {
                        let want = if leaf == "weight" { 2 } else { 1 };
                        if q.shape.len() != want || !matches!(leaf, "weight" | "bias") {
                            return Err(err(format!(
                                "{s:?} on {:?} of shape {:?}: a linear layer has weight [out, in] \
                                 and bias [out]",
                                q.name, q.shape
                            )));
                        }
                        s.placement(leaf)
                    }
                    _ => Placement::Replicate,
                };
                let t = DTensor::distribute_tensor(q.values, q.shape, mesh, &[placement])?;
                Ok((q.name.to_owned(), t))
            })
            .collect()
    }
}

/// `fnmatch`-style match with `*` only.
fn glob(pat: &[u8], s: &[u8]) -> bool {
    match pat.split_first() {
        None => s.is_empty(),
        Some((b'*', rest)) => (0..=s.len()).any(|i| glob(rest, &s[i..])),
        Some((c, rest)) => s.first() == Some(c) && glob(rest, &s[1..]),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn patterns_match_like_fnmatch() {
        let plan = ParallelizePlan::new()
            .with("layers.*.mlp.fc1", ParallelStyle::Colwise)
            .with("*.fc2", ParallelStyle::Rowwise)
            .with("norm", ParallelStyle::SequenceParallel);
        assert_eq!(
            plan.style_for("layers.3.mlp.fc1"),
            Some(ParallelStyle::Colwise)
        );
        assert_eq!(
            plan.style_for("layers.3.mlp.fc2"),
            Some(ParallelStyle::Rowwise)
        );
        assert_eq!(
            plan.style_for("norm"),
            Some(ParallelStyle::SequenceParallel)
        );
        assert_eq!(plan.style_for("norm2"), None);
        assert_eq!(plan.style_for("layers.3.mlp.fc1x"), None);
        assert_eq!(
            ParallelStyle::Rowwise.placement("bias"),
            Placement::Replicate
        );
    }
}
