//! [`TpMlp`]: `fc2(gelu(fc1(x)))` with `fc1` column-parallel and `fc2` row-parallel, so the
//! hidden activation never leaves its rank: one collective in forward (after `fc2`) and one in
//! backward (after `fc1`'s input gradient).

use dist_collective::DeviceMesh;

use super::comm::{enter, leave, local_tokens};
use super::math::{gelu, gelu_grad};
use super::{ParallelStyle, TpLinear};
use crate::{Error, Result};

/// A Megatron MLP block.
///
/// [`TpMlp`]: `fc2(gelu(fc1(x)))` with `fc1` column-parallel and `fc2` row-parallel, so the
/// hidden activation never leaves its rank: one collective in forward (after `fc2`) and one in
/// backward (after `fc1`'s input gradient).
#[derive(Clone, Debug)]
pub struct TpMlp {
    mesh: DeviceMesh,
    fc1: TpLinear,
    fc2: TpLinear,
    seq_parallel: bool,
    hidden: usize,
}

/// What [`TpMlp::forward`] keeps for the backward.
#[derive(Clone, Debug)]
pub struct MlpSaved {
    x: Vec<f32>,
    pre: Vec<f32>,
    act: Vec<f32>,
    tokens: usize,
}

impl TpMlp {
    /// The block from a column-parallel `fc1` (`[ffn, hidden]`) and a row-parallel `fc2`
    /// (`[hidden, ffn]`) on the same 1-D mesh. With `seq_parallel` the block's input and
    /// output are this rank's run of tokens (`Shard(0)`), else every token (`Replicate`).
    pub fn new(fc1: TpLinear, fc2: TpLinear, seq_parallel: bool) -> Result<Self> {
        let mesh = fc1.weight().mesh().clone();
        let (s1, s2) = (fc1.weight().shape(), fc2.weight().shape());
        if fc1.style() != ParallelStyle::Colwise
            || fc2.style() != ParallelStyle::Rowwise
            || s1[0] != s2[1]
            || s1[1] != s2[0]
            || fc2.weight().mesh().shape() != mesh.shape()
        {
            return Err(Error::InvalidInput {
                rank: mesh.group().rank(),
                op: "TpMlp::new",
                reason: format!(
                    "want fc1 Colwise [ffn, hidden] and fc2 Rowwise [hidden, ffn] on one mesh, \
                     got fc1 {:?} {s1:?} and fc2 {:?} {s2:?}",
                    fc1.style(),
                    fc2.style()
                ),
            });
        }
        let hidden = s1[1];
        Ok(TpMlp {
            mesh,
            fc1,
            fc2,
            seq_parallel,
            hidden,
        })
    }

    /// The first (column-parallel) layer.
    pub fn fc1(&self) -> &TpLinear {
        &self.fc1
    }

    /// The second (row-parallel) layer.
    pub fn fc2(&self) -> &TpLinear {
        &self.fc2
    }

    /// Both layers, mutable (optimizer steps, `zero_grad`).
    pub fn layers_mut(&mut self) -> [&mut TpLinear; 2] {
        [&mut self.fc1, &mut self.fc2]
    }

    /// The block on `x` (`[tokens, hidden]`, or this rank's tokens with sequence
    /// parallelism); every rank of the mesh calls it.
    pub fn forward(&self, x: &[f32], tokens: usize) -> Result<(Vec<f32>, MlpSaved)> {
        check_input(
            &self.mesh,
            "TpMlp::forward",
            x.len(),
            tokens,
            self.hidden,
            self.seq_parallel,
        )?;
        let x = enter(&self.mesh, x, tokens, self.hidden, self.seq_parallel)?;
        let pre = self.fc1.forward_local(&x)?;
        let act: Vec<f32> = pre.iter().map(|&v| gelu(v)).collect();
        let partial = self.fc2.forward_local(&act)?;
        let mut y = leave(&self.mesh, partial, tokens, self.hidden, self.seq_parallel)?;
        self.fc2.add_bias(&mut y);
        Ok((
            y,
            MlpSaved {
                x,
                pre,
                act,
                tokens,
            },
        ))
    }

    /// Accumulates parameter gradients for `dy` (laid out as the forward's output) and
    /// returns the input gradient (laid out as its input).
    pub fn backward(&mut self, saved: &MlpSaved, dy: &[f32]) -> Result<Vec<f32>> {
        let (t, h, sp) = (saved.tokens, self.hidden, self.seq_parallel);
        check_input(&self.mesh, "TpMlp::backward", dy.len(), t, h, sp)?;
        let dy = enter(&self.mesh, dy, t, h, sp)?;
        let mut da = self.fc2.backward_local(&saved.act, &dy)?;
        for (g, &p) in da.iter_mut().zip(&saved.pre) {
            *g *= gelu_grad(p);
        }
        let dx = self.fc1.backward_local(&saved.x, &da)?;
        leave(&self.mesh, dx, t, h, sp)
    }
}

/// `len` must be the `[tokens, hidden]` activation's local size.
pub(crate) fn check_input(
    mesh: &DeviceMesh,
    op: &'static str,
    len: usize,
    tokens: usize,
    hidden: usize,
    seq_parallel: bool,
) -> Result<()> {
    let rows = local_tokens(mesh, tokens, seq_parallel);
    if len != rows * hidden {
        return Err(Error::InvalidInput {
            rank: mesh.group().rank(),
            op,
            reason: format!(
                "activation has {len} elements, want {rows} tokens x {hidden} hidden{}",
                if seq_parallel {
                    format!(" (this rank's share of {tokens} tokens, sequence parallel)")
                } else {
                    String::new()
                }
            ),
        });
    }
    Ok(())
}
