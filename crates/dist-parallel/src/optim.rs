//! AdamW on flat `f32` slices (torch's `torch.optim.AdamW`), so a sharded model can keep its
//! optimizer state sharded: each rank steps only the slices it holds, and the moments are
//! saved and resharded by the [`checkpoint`](crate::checkpoint) like the parameters.

use crate::{Error, Result};

/// AdamW's hyper-parameters; the defaults are torch's.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamW {
    /// Learning rate.
    pub lr: f32,
    /// Decay of the first moment.
    pub beta1: f32,
    /// Decay of the second moment.
    pub beta2: f32,
    /// Added to the denominator.
    pub eps: f32,
    /// Decoupled weight decay.
    pub weight_decay: f32,
}

impl Default for AdamW {
    fn default() -> Self {
        AdamW {
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 1e-2,
        }
    }
}

/// One parameter slice's AdamW state: the two moments (same length as the slice) and the
/// step count.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct AdamWState {
    /// Steps taken.
    pub step: u64,
    /// First moment (torch's `exp_avg`).
    pub exp_avg: Vec<f32>,
    /// Second moment (torch's `exp_avg_sq`).
    pub exp_avg_sq: Vec<f32>,
}

impl AdamWState {
    /// Zero state for a slice of `len` elements.
    pub fn new(len: usize) -> Self {
        AdamWState {
            step: 0,
            exp_avg: vec![0.0; len],
            exp_avg_sq: vec![0.0; len],
        }
    }
}

impl AdamW {
    /// One step of `param` with `grad` (equal lengths, and `state` made for that length).
    /// Element-wise, so stepping the shards of a tensor equals stepping the whole tensor.
    pub fn step(&self, param: &mut [f32], grad: &[f32], state: &mut AdamWState) -> Result<()> {
        let n = param.len();
        if grad.len() != n || state.exp_avg.len() != n || state.exp_avg_sq.len() != n {
            return Err(Error::Optimizer {
                op: "AdamW::step",
                reason: format!(
                    "param has {n} elements, grad {}, state moments {} and {}",
                    grad.len(),
                    state.exp_avg.len(),
                    state.exp_avg_sq.len()
                ),
            });
        }
        state.step += 1;
        let t = state.step as i32;
        let bc1 = 1.0 - self.beta1.powi(t);
        let bc2 = 1.0 - self.beta2.powi(t);
        let step_size = self.lr / bc1;
        let bc2_sqrt = bc2.sqrt();
        let decay = 1.0 - self.lr * self.weight_decay;
        for (((p, &g), m), v) in param
            .iter_mut()
            .zip(grad)
            .zip(&mut state.exp_avg)
            .zip(&mut state.exp_avg_sq)
        {
            *p *= decay;
            *m = self.beta1 * *m + (1.0 - self.beta1) * g;
            *v = self.beta2 * *v + (1.0 - self.beta2) * g * g;
            let denom = v.sqrt() / bc2_sqrt + self.eps;
            *p -= step_size * *m / denom;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_step_matches_torch_formula_and_bad_lengths_are_errors() {
        let opt = AdamW {
            lr: 0.1,
            ..AdamW::default()
        };
        let mut p = [1.0f32, -2.0];
        let mut st = AdamWState::new(2);
        opt.step(&mut p, &[0.5, -0.25], &mut st).unwrap();
        // First step: m̂ = g, v̂ = g², so the update is lr·sign(g) (eps aside) after decay.
        let want = [
            1.0 * (1.0 - 0.1 * 0.01) - 0.1,
            -2.0 * (1.0 - 0.1 * 0.01) + 0.1,
        ];
        for (a, b) in p.iter().zip(want) {
            assert!((a - b).abs() < 1e-6, "{a} vs {b}");
        }
        let e = opt.step(&mut p, &[0.0], &mut st).unwrap_err().to_string();
        assert!(e.contains("AdamW::step") && e.contains("grad 1"), "{e}");
    }
}
