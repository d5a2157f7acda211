//! Pipeline stages made of [candle](https://github.com/huggingface/candle) modules (feature
//! `candle`): a model given as a list of blocks is cut at split points, and each piece becomes
//! a [`Stage`] whose backward is candle's autograd.

use std::collections::HashMap;

use candle_core::{Device, Module, Tensor, Var};

use crate::{Error, Result};

use super::exec::{Stage, StageResult};

/// One block of a model: a module and the trainable variables it reads.
pub struct CandleBlock {
    module: Box<dyn Module + Send>,
    vars: Vec<Var>,
}

impl CandleBlock {
    /// A block running `module`, whose trainable parameters are `vars`.
    pub fn new(module: impl Module + Send + 'static, vars: Vec<Var>) -> Self {
        CandleBlock {
            module: Box::new(module),
            vars,
        }
    }
}

impl std::fmt::Debug for CandleBlock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CandleBlock")
            .field("vars", &self.vars.len())
            .finish()
    }
}

/// Cuts `blocks` before each of `split_points` (strictly increasing, inside `1..len`): `k`
/// split points give `k + 1` stages, in order.
pub fn split_blocks<B>(blocks: Vec<B>, split_points: &[usize]) -> Result<Vec<Vec<B>>> {
    let n = blocks.len();
    let mut prev = 0;
    for &p in split_points {
        if p <= prev || p >= n {
            return Err(Error::ScheduleConfig {
                schedule: "split_blocks",
                reason: format!(
                    "split points {split_points:?} must increase strictly inside 1..{n} \
                     ({n} blocks)"
                ),
            });
        }
        prev = p;
    }
    let mut rest = blocks;
    let mut out = Vec::with_capacity(split_points.len() + 1);
    for &p in split_points.iter().rev() {
        out.push(rest.split_off(p));
    }
    out.push(rest);
    out.reverse();
    Ok(out)
}

/// A [`Stage`] running candle blocks one after another on micro-batches of a fixed shape.
///
/// Backward is candle's autograd on the surrogate `sum(output · grad_output)`, whose gradient
/// with respect to the input and to every variable is exactly the vector-Jacobian product the
/// pipeline needs; weight gradients are summed across the step's micro-batches in
/// [`CandleStage::grad`]. The backward is not split, so zero-bubble schedules are refused at
/// set-up ([`Stage::splits_backward`]).
pub struct CandleStage {
    blocks: Vec<CandleBlock>,
    input_shape: Vec<usize>,
    output_shape: Vec<usize>,
    device: Device,
    /// Per micro-batch: the input (as a variable, for its gradient) and the output.
    saved: HashMap<usize, (Var, Tensor)>,
    grads: Vec<Option<Tensor>>,
}

impl std::fmt::Debug for CandleStage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CandleStage")
            .field("blocks", &self.blocks.len())
            .field("input_shape", &self.input_shape)
            .field("output_shape", &self.output_shape)
            .finish()
    }
}

impl CandleStage {
    /// A stage of `blocks` taking one micro-batch of `input_shape` and producing
    /// `output_shape` (f32), on `device`.
    pub fn new(
        blocks: Vec<CandleBlock>,
        input_shape: &[usize],
        output_shape: &[usize],
        device: Device,
    ) -> Self {
        let vars = blocks.iter().map(|b| b.vars.len()).sum();
        CandleStage {
            blocks,
            input_shape: input_shape.to_vec(),
            output_shape: output_shape.to_vec(),
            device,
            saved: HashMap::new(),
            grads: vec![None; vars],
        }
    }

    /// The stage's variables, block by block.
    pub fn vars(&self) -> impl Iterator<Item = &Var> {
        self.blocks.iter().flat_map(|b| b.vars.iter())
    }

    /// The gradient accumulated for variable `i` (in [`CandleStage::vars`] order) since the
    /// last [`CandleStage::zero_grad`]; `None` if it received none.
    pub fn grad(&self, i: usize) -> Option<&Tensor> {
        self.grads.get(i).and_then(Option::as_ref)
    }

    /// Forgets the accumulated gradients.
    pub fn zero_grad(&mut self) {
        self.grads.iter_mut().for_each(|g| *g = None);
    }

    /// Plain SGD on the accumulated gradients, then [`CandleStage::zero_grad`].
    pub fn sgd_step(&mut self, lr: f64) -> candle_core::Result<()> {
        let vars: Vec<Var> = self.vars().cloned().collect();
        for (v, g) in vars.iter().zip(&self.grads) {
            if let Some(g) = g {
                v.set(&(v.as_tensor() - (g * lr)?)?)?;
            }
        }
        self.zero_grad();
        Ok(())
    }
}

impl Stage for CandleStage {
    fn input_len(&self) -> usize {
        self.input_shape.iter().product()
    }

    fn output_len(&self) -> usize {
        self.output_shape.iter().product()
    }

    fn forward(&mut self, mb: usize, input: &[f32], output: &mut [f32]) -> StageResult {
        let x = Var::from_tensor(&Tensor::from_slice(
            input,
            self.input_shape.as_slice(),
            &self.device,
        )?)?;
        let mut y = x.as_tensor().clone();
        for b in &self.blocks {
            y = b.module.forward(&y)?;
        }
        if y.dims() != self.output_shape.as_slice() {
            return Err(format!(
                "the blocks produced shape {:?}, the stage declares {:?}",
                y.dims(),
                self.output_shape
            )
            .into());
        }
        let flat = y
            .flatten_all()?
            .to_dtype(candle_core::DType::F32)?
            .to_vec1::<f32>()?;
        output.copy_from_slice(&flat);
        self.saved.insert(mb, (x, y));
        Ok(())
    }

    fn backward(&mut self, mb: usize, grad_output: &[f32], grad_input: &mut [f32]) -> StageResult {
        let (x, y) = self
            .saved
            .remove(&mb)
            .ok_or_else(|| format!("backward of micro-batch {mb} without its forward"))?;
        let g = Tensor::from_slice(grad_output, y.dims(), &self.device)?.to_dtype(y.dtype())?;
        let grads = (&y * &g)?.sum_all()?.backward()?;
        match grads.get(x.as_tensor()) {
            Some(gx) => {
                let flat = gx
                    .flatten_all()?
                    .to_dtype(candle_core::DType::F32)?
                    .to_vec1::<f32>()?;
                grad_input.copy_from_slice(&flat);
            }
            // The output does not depend on the input.
            None => grad_input.fill(0.0),
        }
        let vars: Vec<Var> = self.vars().cloned().collect();
        for (v, acc) in vars.iter().zip(&mut self.grads) {
            if let Some(gv) = grads.get(v.as_tensor()) {
                *acc = Some(match acc.take() {
                    Some(a) => (a + gv)?,
                    None => gv.clone(),
                });
            }
        }
        Ok(())
    }
}
