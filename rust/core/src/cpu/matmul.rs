//! Matrix products on quantized weights: activations are quantized once per call to the weight type's dot-product
//! format (q8_0, q8_1, q8_K, f16 ... as llama.cpp does), then every output is an integer-heavy dot product over the
//! weight's blocks (ARCHITECTURE.md, decision 2: weights are never expanded).
//!
//! Work is split by weight rows over the rayon pool the caller installed. With several tokens (prefill) each
//! task takes a tile of rows and runs it against every token, so a tile of weights is read from memory once per
//! batch instead of once per token.

use rayon::prelude::*;

use crate::model::weights::Matrix;
use crate::quant::quantize_act;
use crate::quant::simd::{vec_dot_matmul, MatmulPos};

/// Rows per task: large enough to amortise scheduling, small enough to balance 2..64 threads.
const ROWS_PER_TASK: usize = 16;

/// Activations of `n` tokens quantized for one weight's dot-product format.
pub struct QuantizedActs {
    pub bytes: Vec<u8>,
    pub row_bytes: usize,
    pub n: usize,
}

pub fn quantize_acts(w: &Matrix, x: &[f32], n: usize) -> QuantizedActs {
    let k = w.n_cols;
    let act_ty = w.ty.act_type();
    let row_bytes = act_ty.row_bytes(k).expect("weight row length fits its activation type");
    let mut bytes = vec![0u8; row_bytes * n];
    if n == 1 {
        quantize_act(act_ty, &x[..k], &mut bytes);
    } else {
        bytes.par_chunks_mut(row_bytes).zip(x.par_chunks(k)).for_each(|(dst, src)| quantize_act(act_ty, src, dst));
    }
    QuantizedActs { bytes, row_bytes, n }
}

/// out[t, r] = W[r, :] · x[t, :] for n tokens. x: [n, w.n_cols], out: [n, w.n_rows].
pub fn matmul(w: &Matrix, x: &[f32], n: usize, out: &mut [f32]) {
    let acts = quantize_acts(w, x, n);
    matmul_quantized(w, &acts, out);
}

/// As `matmul`, reusing activations already quantized for `w`'s format (q, k and v share theirs).
pub fn matmul_quantized(w: &Matrix, acts: &QuantizedActs, out: &mut [f32]) {
    let (k, m, n) = (w.n_cols, w.n_rows, acts.n);
    debug_assert_eq!(out.len(), m * n);
    let data = w.data();
    let rb = w.row_bytes();
    // Each dot product is summed the way llama.cpp's CPU backend sums the one at the same place of the same
    // matmul (its kernel choice depends on the matrix and batch shape), which greedy parity relies on.
    let dot = |r: usize, t: usize| {
        let pos = MatmulPos { w_rows: m, act_rows: n, act_row: t };
        let a = &acts.bytes[t * acts.row_bytes..(t + 1) * acts.row_bytes];
        vec_dot_matmul(w.ty, k, &data[r * rb..(r + 1) * rb], a, pos)
    };
    if n == 1 {
        out.par_chunks_mut(ROWS_PER_TASK).enumerate().for_each(|(c, chunk)| {
            for (i, o) in chunk.iter_mut().enumerate() {
                *o = dot(c * ROWS_PER_TASK + i, 0);
            }
        });
        return;
    }
    // Tiles of rows, each against every token: [m, n] row-major, transposed into out afterwards.
    let mut tmp = vec![0.0f32; m * n];
    tmp.par_chunks_mut(ROWS_PER_TASK * n).enumerate().for_each(|(c, tile)| {
        let r0 = c * ROWS_PER_TASK;
        let rows = tile.len() / n;
        for t in 0..n {
            for i in 0..rows {
                tile[i * n + t] = dot(r0 + i, t);
            }
        }
    });
    for (r, col) in tmp.chunks_exact(n).enumerate() {
        for (t, &v) in col.iter().enumerate() {
            out[t * m + r] = v;
        }
    }
}
