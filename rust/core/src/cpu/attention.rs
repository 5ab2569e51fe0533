//! Fused decode/prefill attention over the paged KV cache: for each (token, head), one pass over the KV blocks
//! with an online softmax (running max and sum), so no [n_kv] score vector is materialised. GQA: query head h
//! reads KV head h / (n_head / n_head_kv).
//!
//! Precision follows llama.cpp's CPU flash attention, which greedy parity is measured against. It has two paths:
//! - few query rows (decode, short prompts) or a quantized cache: q is converted to the cache's dot format (f16,
//!   or q8_0 for a quantized cache) and, for an f16 V cache, the weighted sum of V is accumulated in f16;
//! - batches of at least `TILED_MIN_ROWS` rows with an f16 cache: q stays f32, K and V are widened to f32, and
//!   everything accumulates in f32.

use rayon::prelude::*;

use crate::kv::{KvCache, SeqId};
use crate::quant::{dequantize_row, quantize_act, vec_dot, GgmlType};

/// Query rows from which llama.cpp switches to its tiled f32 path (GGML_FA_TILE_Q).
pub const TILED_MIN_ROWS: usize = 64;

#[derive(Clone, Copy, Debug)]
pub struct AttnShape {
    pub n_head: usize,
    pub n_head_kv: usize,
    pub head_dim: usize,
    pub head_dim_v: usize,
    /// Multiplies q·k before the softmax.
    pub scale: f32,
    /// Keys a query may see, itself included; None = all previous positions.
    pub window: Option<usize>,
}

/// out[t, h*dv..] = softmax(q[t,h] · K[seq_t, 0..=pos_t]) V for every row t of the batch.
/// rows: (sequence, position) of each query row; q: [n, n_head * head_dim]; out: [n, n_head * head_dim_v].
pub fn attention(kv: &KvCache, layer: usize, rows: &[(SeqId, usize)], q: &[f32], shape: AttnShape, out: &mut [f32]) {
    let AttnShape { n_head, n_head_kv, head_dim: dk, head_dim_v: dv, .. } = shape;
    let group = n_head / n_head_kv;
    let f16_cache = kv.cfg.k_type == GgmlType::F16 && kv.cfg.v_type == GgmlType::F16;
    let wide = f16_cache && rows.len() >= TILED_MIN_ROWS;
    out.par_chunks_mut(dv).enumerate().for_each(|(i, o)| {
        let (t, h) = (i / n_head, i % n_head);
        let (seq, pos) = rows[t];
        attend_one(kv, layer, seq, pos, &q[(t * n_head + h) * dk..][..dk], h / group, shape, wide, o);
    });
}

/// Round to the nearest f16 and back: the f16 accumulator of llama.cpp's decode path.
#[inline(always)]
fn f16_round(x: f32) -> f32 {
    half::f16::from_f32(x).to_f32()
}

#[allow(clippy::too_many_arguments)]
fn attend_one(
    kv: &KvCache,
    layer: usize,
    seq: SeqId,
    pos: usize,
    q: &[f32],
    g: usize,
    shape: AttnShape,
    wide: bool,
    out: &mut [f32],
) {
    let (dk, dv) = (shape.head_dim, shape.head_dim_v);
    let (k_type, v_type) = (kv.cfg.k_type, kv.cfg.v_type);
    let q_type = if wide { GgmlType::F32 } else { k_type.act_type() };
    let mut q_act = vec![0u8; q_type.row_bytes(dk).unwrap_or(0)];
    quantize_act(q_type, q, &mut q_act);
    let mut k_buf = vec![0.0f32; if wide { dk } else { 0 }];
    let f16_acc = !wide && v_type == GgmlType::F16;
    let k_head_bytes = k_type.row_bytes(dk).unwrap_or(0);
    let v_head_bytes = v_type.row_bytes(dv).unwrap_or(0);
    let (k_rb, v_rb) = (kv.k_row_bytes(), kv.v_row_bytes());
    let mut v_buf = vec![0.0f32; dv];
    out.fill(0.0);
    let (mut m, mut s) = (f32::NEG_INFINITY, 0.0f32);

    let lo = shape.window.map_or(0, |w| (pos + 1).saturating_sub(w));
    let bs = kv.cfg.block_size;
    for b in lo / bs..=pos / bs {
        let (kb, vb) = kv.block_view(layer, seq, b);
        let first = (b * bs).max(lo);
        let last = ((b + 1) * bs - 1).min(pos);
        for p in first..=last {
            let slot = p - b * bs;
            let k = &kb[slot * k_rb + g * k_head_bytes..][..k_head_bytes];
            let score = if wide {
                let _ = dequantize_row(k_type, k, &mut k_buf);
                k_buf.iter().zip(q).map(|(a, b)| a * b).sum::<f32>() * shape.scale
            } else {
                vec_dot(k_type, dk, k, &q_act) * shape.scale
            };
            let v = &vb[slot * v_rb + g * v_head_bytes..][..v_head_bytes];
            if v_type == GgmlType::F32 {
                for (d, c) in v_buf.iter_mut().zip(v.chunks_exact(4)) {
                    *d = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
                }
            } else {
                // Sizes were validated when the cache was built.
                let _ = dequantize_row(v_type, v, &mut v_buf);
            }
            // Online softmax: rescale what was accumulated when a new maximum appears.
            let (ms, vs) = if score > m {
                let ms = (m - score).exp();
                m = score;
                (ms, 1.0)
            } else {
                (1.0, (score - m).exp())
            };
            if f16_acc {
                if ms != 1.0 {
                    out.iter_mut().for_each(|o| *o = f16_round(*o * ms));
                }
                for (o, &x) in out.iter_mut().zip(&v_buf) {
                    *o = f16_round(x.mul_add(vs, *o));
                }
            } else {
                if ms != 1.0 {
                    out.iter_mut().for_each(|o| *o *= ms);
                }
                for (o, &x) in out.iter_mut().zip(&v_buf) {
                    *o += x * vs;
                }
            }
            s = s * ms + vs;
        }
    }
    let inv = if s > 0.0 { 1.0 / s } else { 0.0 };
    out.iter_mut().for_each(|o| *o *= inv);
}
