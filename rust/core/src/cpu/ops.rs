//! Element-wise and per-row kernels of the layer loop. The arithmetic follows ggml's CPU ops (sum of squares in
//! f64 for RMSNorm, GELU through the f16 table; RoPE is rope.rs) so that greedy tokens match
//! llama.cpp's, not only approximately.

use std::sync::OnceLock;

use half::f16;

/// y = x / sqrt(mean(x^2) + eps) * w, row by row. x, y: [n, w.len()].
pub fn rms_norm(x: &[f32], w: &[f32], eps: f32, y: &mut [f32]) {
    let d = w.len();
    for (xr, yr) in x.chunks_exact(d).zip(y.chunks_exact_mut(d)) {
        let sum: f64 = xr.iter().map(|&v| (v * v) as f64).sum();
        let scale = 1.0 / ((sum / d as f64) as f32 + eps).sqrt();
        for ((o, &v), &g) in yr.iter_mut().zip(xr).zip(w) {
            *o = v * scale * g;
        }
    }
}

/// In-place RMSNorm of every w.len()-long slice of x: whole rows, or each head of each row (q/k norms).
pub fn rms_norm_in_place(x: &mut [f32], w: &[f32], eps: f32) {
    let d = w.len();
    for head in x.chunks_exact_mut(d) {
        let sum: f64 = head.iter().map(|&v| (v * v) as f64).sum();
        let scale = 1.0 / ((sum / d as f64) as f32 + eps).sqrt();
        for (v, &g) in head.iter_mut().zip(w) {
            *v = *v * scale * g;
        }
    }
}

#[inline]
fn gelu_tanh(x: f32) -> f32 {
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    // gcc contracts ggml's `1.0f + GELU_COEF_A*x*x` into fma(GELU_COEF_A*x, x, 1) when it builds the table.
    0.5 * x * (1.0 + (SQRT_2_OVER_PI * x * (0.044715 * x).mul_add(x, 1.0)).tanh())
}

/// GELU evaluated on every f16 value, as ggml's table: the input is rounded to f16 and so is the result.
fn gelu_table() -> &'static [f16] {
    static TABLE: OnceLock<Vec<f16>> = OnceLock::new();
    TABLE.get_or_init(|| (0..=u16::MAX).map(|b| f16::from_f32(gelu_tanh(f16::from_bits(b).to_f32()))).collect())
}

/// gate <- silu(gate) * up.
pub fn swiglu(gate: &mut [f32], up: &[f32]) {
    (crate::quant::simd::vec_ops().swiglu)(gate, up);
}

/// gate <- gelu(gate) * up, with ggml's f16 GELU table and its clamps at +-10.
pub fn geglu(gate: &mut [f32], up: &[f32]) {
    let table = gelu_table();
    for (g, &u) in gate.iter_mut().zip(up) {
        let x = *g;
        *g = if x <= -10.0 {
            0.0
        } else if x >= 10.0 {
            x * u
        } else {
            table[f16::from_f32(x).to_bits() as usize].to_f32() * u
        };
    }
}

pub fn add_in_place(x: &mut [f32], y: &[f32]) {
    for (a, &b) in x.iter_mut().zip(y) {
        *a += b;
    }
}

/// Add a bias vector to every row.
pub fn add_bias(x: &mut [f32], bias: &[f32]) {
    for row in x.chunks_exact_mut(bias.len()) {
        add_in_place(row, bias);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rms_norm_normalises() {
        let x = [3.0f32, 4.0];
        let mut y = [0.0; 2];
        rms_norm(&x, &[1.0, 2.0], 0.0, &mut y);
        let r = (12.5f32).sqrt();
        assert!((y[0] - 3.0 / r).abs() < 1e-6 && (y[1] - 8.0 / r).abs() < 1e-6);
    }

    #[test]
    fn activations() {
        let mut g = [0.0f32, 20.0, -20.0, 1.0];
        geglu(&mut g, &[1.0, 2.0, 3.0, 1.0]);
        assert_eq!(&g[..3], &[0.0, 40.0, 0.0]);
        assert!((g[3] - 0.8412).abs() < 1e-3);
        let mut s = [1.0f32];
        swiglu(&mut s, &[2.0]);
        assert!((s[0] - 2.0 * 0.731_058_6).abs() < 1e-6);
    }
}
