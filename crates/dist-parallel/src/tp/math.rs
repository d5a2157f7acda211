//! The dense kernels the tensor-parallel layers run on their local shards: three matmul
//! shapes (accumulating in f64, so sharding a reduction changes nothing measurable) and GeLU.

/// `a [m, k] · bᵀ` for `b [n, k]`: a linear layer's `x Wᵀ`.
pub(crate) fn mm_nt(a: &[f32], b: &[f32], m: usize, k: usize, n: usize) -> Vec<f32> {
    let mut out = vec![0f32; m * n];
    for i in 0..m {
        let row = &a[i * k..(i + 1) * k];
        for j in 0..n {
            let col = &b[j * k..(j + 1) * k];
            out[i * n + j] = row
                .iter()
                .zip(col)
                .map(|(&x, &y)| x as f64 * y as f64)
                .sum::<f64>() as f32;
        }
    }
    out
}

/// `a [m, k] · b [k, n]`: an input gradient `dy W`.
pub(crate) fn mm_nn(a: &[f32], b: &[f32], m: usize, k: usize, n: usize) -> Vec<f32> {
    let mut acc = vec![0f64; m * n];
    for i in 0..m {
        for p in 0..k {
            let x = a[i * k + p] as f64;
            for (o, &y) in acc[i * n..(i + 1) * n]
                .iter_mut()
                .zip(&b[p * n..(p + 1) * n])
            {
                *o += x * y as f64;
            }
        }
    }
    acc.into_iter().map(|v| v as f32).collect()
}

/// `aᵀ · b` for `a [k, m]`, `b [k, n]`: a weight gradient `dyᵀ x`.
pub(crate) fn mm_tn(a: &[f32], b: &[f32], k: usize, m: usize, n: usize) -> Vec<f32> {
    let mut acc = vec![0f64; m * n];
    for p in 0..k {
        for i in 0..m {
            let x = a[p * m + i] as f64;
            for (o, &y) in acc[i * n..(i + 1) * n]
                .iter_mut()
                .zip(&b[p * n..(p + 1) * n])
            {
                *o += x * y as f64;
            }
        }
    }
    acc.into_iter().map(|v| v as f32).collect()
}

/// Column sums of `a [m, n]`: a bias gradient.
pub(crate) fn col_sums(a: &[f32], n: usize) -> Vec<f32> {
    let mut acc = vec![0f64; n];
    for row in a.chunks_exact(n.max(1)) {
        for (o, &v) in acc.iter_mut().zip(row) {
            *o += v as f64;
        }
    }
    acc.into_iter().map(|v| v as f32).collect()
}

const GELU_C: f64 = 0.797_884_560_802_865_4; // sqrt(2 / pi)

/// GeLU, tanh approximation (torch's `gelu(approximate="tanh")`).
pub(crate) fn gelu(x: f32) -> f32 {
    let x = x as f64;
    (0.5 * x * (1.0 + (GELU_C * (x + 0.044715 * x * x * x)).tanh())) as f32
}

/// Derivative of [`gelu`].
pub(crate) fn gelu_grad(x: f32) -> f32 {
    let x = x as f64;
    let u = GELU_C * (x + 0.044715 * x * x * x);
    let t = u.tanh();
    let du = GELU_C * (1.0 + 3.0 * 0.044715 * x * x);
    (0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * du) as f32
}

/// `a += b`, elementwise.
pub(crate) fn add_into(a: &mut [f32], b: &[f32]) {
    for (x, &y) in a.iter_mut().zip(b) {
        *x += y;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matmuls_agree_with_each_other() {
        // a [2, 3], b [4, 3]: a bᵀ = a (bᵀ), and (a bᵀ)ᵀ = b aᵀ.
        let a: Vec<f32> = (0..6).map(|v| v as f32 - 2.0).collect();
        let b: Vec<f32> = (0..12).map(|v| (v as f32) * 0.5).collect();
        let abt = mm_nt(&a, &b, 2, 3, 4);
        let mut bt = vec![0f32; 12];
        for i in 0..4 {
            for j in 0..3 {
                bt[j * 4 + i] = b[i * 3 + j];
            }
        }
        assert_eq!(abt, mm_nn(&a, &bt, 2, 3, 4));
        let mut at = vec![0f32; 6];
        for i in 0..2 {
            for j in 0..3 {
                at[j * 2 + i] = a[i * 3 + j];
            }
        }
        assert_eq!(abt, mm_tn(&at, &bt, 3, 2, 4));
        assert_eq!(col_sums(&a, 3), [-1.0, 1.0, 3.0]);
    }

    #[test]
    fn gelu_grad_matches_a_finite_difference() {
        for x in [-3.0f32, -0.5, 0.0, 0.7, 2.5] {
            let h = 1e-3;
            let fd = (gelu(x + h) as f64 - gelu(x - h) as f64) / (2.0 * h as f64);
            assert!((fd - gelu_grad(x) as f64).abs() < 1e-3, "{x}");
        }
    }
}
