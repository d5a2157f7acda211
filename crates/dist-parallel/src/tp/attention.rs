//! [`TpAttention`]: multi-head self-attention with the query, key and value projections
//! column-parallel (each rank owns whole heads) and the output projection row-parallel. Heads
//! never leave their rank: one collective in forward (after the output projection) and one in
//! backward (the three projections' input gradients summed locally, then reduced once).

use dist_collective::DeviceMesh;

use super::comm::{enter, leave};
use super::math::{add_into, mm_nn, mm_nt, mm_tn};
use super::mlp::check_input;
use super::{ParallelStyle, TpLinear};
use crate::{Error, Result};

/// A Megatron attention block.
///
/// [`TpAttention`]: multi-head self-attention with the query, key and value projections
/// column-parallel (each rank owns whole heads) and the output projection row-parallel. Heads
/// never leave their rank: one collective in forward (after the output projection) and one in
/// backward (the three projections' input gradients summed locally, then reduced once).
#[derive(Clone, Debug)]
pub struct TpAttention {
    mesh: DeviceMesh,
    q: TpLinear,
    k: TpLinear,
    v: TpLinear,
    o: TpLinear,
    head_dim: usize,
    hidden: usize,
    causal: bool,
    seq_parallel: bool,
}

/// What [`TpAttention::forward`] keeps for the backward.
#[derive(Clone, Debug)]
pub struct AttnSaved {
    x: Vec<f32>,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    probs: Vec<f32>,
    ctx: Vec<f32>,
    tokens: usize,
    seq_len: usize,
}

impl TpAttention {
    /// The block from column-parallel `q`, `k`, `v` and a row-parallel `o`, all `[hidden,
    /// hidden]` on one 1-D mesh, with `heads` heads. Each rank's share of the projections'
    /// outputs must be whole heads (torch.chunk of `hidden` over the mesh lands on head
    /// boundaries, e.g. `heads` divisible by the mesh size).
    pub fn new(
        [q, k, v, o]: [TpLinear; 4],
        heads: usize,
        causal: bool,
        seq_parallel: bool,
    ) -> Result<Self> {
        let mesh = q.weight().mesh().clone();
        let hidden = q.weight().shape()[1];
        let err = |reason: String| Error::InvalidInput {
            rank: mesh.group().rank(),
            op: "TpAttention::new",
            reason,
        };
        let cols = [&q, &k, &v];
        if cols.iter().any(|l| l.style() != ParallelStyle::Colwise)
            || o.style() != ParallelStyle::Rowwise
        {
            return Err(err("want q, k, v Colwise and o Rowwise".into()));
        }
        if [&q, &k, &v, &o]
            .iter()
            .any(|l| l.weight().shape() != [hidden, hidden])
        {
            return Err(err(format!(
                "every projection must be [{hidden}, {hidden}]"
            )));
        }
        if heads == 0 || !hidden.is_multiple_of(heads) {
            return Err(err(format!(
                "{heads} heads do not divide hidden size {hidden}"
            )));
        }
        let head_dim = hidden / heads;
        let local = q.local_out_in()[0];
        if !local.is_multiple_of(head_dim) || o.local_out_in()[1] != local {
            return Err(err(format!(
                "this rank's {local} projection outputs are not whole heads of {head_dim} \
                 ({heads} heads over a mesh of {:?}); use a head count divisible by the mesh size",
                mesh.shape()
            )));
        }
        Ok(TpAttention {
            mesh,
            q,
            k,
            v,
            o,
            head_dim,
            hidden,
            causal,
            seq_parallel,
        })
    }

    /// The projections q, k, v, o.
    pub fn layers(&self) -> [&TpLinear; 4] {
        [&self.q, &self.k, &self.v, &self.o]
    }

    /// The projections q, k, v, o, mutable.
    pub fn layers_mut(&mut self) -> [&mut TpLinear; 4] {
        [&mut self.q, &mut self.k, &mut self.v, &mut self.o]
    }

    fn local_heads(&self) -> usize {
        self.q.local_out_in()[0] / self.head_dim
    }

    /// Attention over `x` (`[tokens, hidden]` with tokens = batch × `seq_len`, sequences
    /// contiguous; with sequence parallelism this rank's run of the tokens).
    pub fn forward(
        &self,
        x: &[f32],
        tokens: usize,
        seq_len: usize,
    ) -> Result<(Vec<f32>, AttnSaved)> {
        const OP: &str = "TpAttention::forward";
        check_input(
            &self.mesh,
            OP,
            x.len(),
            tokens,
            self.hidden,
            self.seq_parallel,
        )?;
        if seq_len == 0 || !tokens.is_multiple_of(seq_len) {
            return Err(Error::InvalidInput {
                rank: self.mesh.group().rank(),
                op: OP,
                reason: format!("{tokens} tokens are not whole sequences of {seq_len}"),
            });
        }
        let x = enter(&self.mesh, x, tokens, self.hidden, self.seq_parallel)?;
        let (q, k, v) = (
            self.q.forward_local(&x)?,
            self.k.forward_local(&x)?,
            self.v.forward_local(&x)?,
        );
        let (s, d, nh) = (seq_len, self.head_dim, self.local_heads());
        let width = nh * d;
        let scale = 1.0 / (d as f64).sqrt();
        let mut probs = Vec::with_capacity(tokens * s * nh);
        let mut ctx = vec![0f32; tokens * width];
        for b in 0..tokens / s {
            for h in 0..nh {
                let (qh, kh, vh) = (
                    head(&q, b, h, s, d, width),
                    head(&k, b, h, s, d, width),
                    head(&v, b, h, s, d, width),
                );
                let mut p = mm_nt(&qh, &kh, s, d, s);
                for (i, row) in p.chunks_exact_mut(s).enumerate() {
                    softmax_row(row, scale, if self.causal { i + 1 } else { s });
                }
                put_head(&mut ctx, &mm_nn(&p, &vh, s, s, d), b, h, s, d, width);
                probs.extend_from_slice(&p);
            }
        }
        let partial = self.o.forward_local(&ctx)?;
        let mut y = leave(&self.mesh, partial, tokens, self.hidden, self.seq_parallel)?;
        self.o.add_bias(&mut y);
        Ok((
            y,
            AttnSaved {
                x,
                q,
                k,
                v,
                probs,
                ctx,
                tokens,
                seq_len,
            },
        ))
    }

    /// Accumulates parameter gradients for `dy` (laid out as the forward's output) and
    /// returns the input gradient (laid out as its input).
    pub fn backward(&mut self, saved: &AttnSaved, dy: &[f32]) -> Result<Vec<f32>> {
        let (t, hd, sp) = (saved.tokens, self.hidden, self.seq_parallel);
        check_input(&self.mesh, "TpAttention::backward", dy.len(), t, hd, sp)?;
        let dy = enter(&self.mesh, dy, t, hd, sp)?;
        let dctx = self.o.backward_local(&saved.ctx, &dy)?;
        let (s, d, nh) = (saved.seq_len, self.head_dim, self.local_heads());
        let width = nh * d;
        let scale = 1.0 / (d as f64).sqrt();
        let (mut dq, mut dk, mut dv) = (
            vec![0f32; t * width],
            vec![0f32; t * width],
            vec![0f32; t * width],
        );
        for b in 0..t / s {
            for h in 0..nh {
                let at = (b * nh + h) * s * s;
                let p = &saved.probs[at..at + s * s];
                let (qh, kh, vh) = (
                    head(&saved.q, b, h, s, d, width),
                    head(&saved.k, b, h, s, d, width),
                    head(&saved.v, b, h, s, d, width),
                );
                let doh = head(&dctx, b, h, s, d, width);
                put_head(&mut dv, &mm_tn(p, &doh, s, s, d), b, h, s, d, width);
                let dp = mm_nt(&doh, &vh, s, d, s);
                // Softmax backward: dS = P ⊙ (dP - Σ_j dP·P), times the score scale.
                let mut ds = vec![0f32; s * s];
                for i in 0..s {
                    let (pr, dr) = (&p[i * s..(i + 1) * s], &dp[i * s..(i + 1) * s]);
                    let dot: f64 = pr.iter().zip(dr).map(|(&a, &b)| a as f64 * b as f64).sum();
                    for j in 0..s {
                        ds[i * s + j] = (pr[j] as f64 * (dr[j] as f64 - dot) * scale) as f32;
                    }
                }
                put_head(&mut dq, &mm_nn(&ds, &kh, s, s, d), b, h, s, d, width);
                put_head(&mut dk, &mm_tn(&ds, &qh, s, s, d), b, h, s, d, width);
            }
        }
        let mut dx = self.q.backward_local(&saved.x, &dq)?;
        add_into(&mut dx, &self.k.backward_local(&saved.x, &dk)?);
        add_into(&mut dx, &self.v.backward_local(&saved.x, &dv)?);
        leave(&self.mesh, dx, t, hd, sp)
    }
}

/// Head `h` of sequence `b` of a `[tokens, width]` projection, as a contiguous `[s, d]`.
fn head(a: &[f32], b: usize, h: usize, s: usize, d: usize, width: usize) -> Vec<f32> {
    (0..s)
        .flat_map(|i| {
            let at = (b * s + i) * width + h * d;
            a[at..at + d].iter().copied()
        })
        .collect()
}

/// Writes a contiguous `[s, d]` head back into a `[tokens, width]` buffer.
fn put_head(a: &mut [f32], src: &[f32], b: usize, h: usize, s: usize, d: usize, width: usize) {
    for i in 0..s {
        let at = (b * s + i) * width + h * d;
        a[at..at + d].copy_from_slice(&src[i * d..(i + 1) * d]);
    }
}

/// Softmax of `row * scale` over its first `keep` entries (the rest masked to 0).
fn softmax_row(row: &mut [f32], scale: f64, keep: usize) {
    let max = row[..keep]
        .iter()
        .map(|&v| v as f64 * scale)
        .fold(f64::NEG_INFINITY, f64::max);
    let mut sum = 0.0;
    let e: Vec<f64> = row[..keep]
        .iter()
        .map(|&v| (v as f64 * scale - max).exp())
        .collect();
    for &x in &e {
        sum += x;
    }
    for (j, r) in row.iter_mut().enumerate() {
        *r = if j < keep { (e[j] / sum) as f32 } else { 0.0 };
    }
}
