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
    // llama.cpp's decode of a single query row over at least SPLIT_KV_MIN padded cache cells splits the cells
    // into one chunk per thread and merges the chunks' partial softmaxes (ggml_flash_attn_ext_reduce_partials).
    let split = if f16_cache && rows.len() == 1 {
        let n_kv = (rows[0].1 + 1).next_multiple_of(KV_PAD).max(KV_PAD);
        (n_kv >= SPLIT_KV_MIN).then(|| n_kv.div_ceil(rayon::current_num_threads().max(1)))
    } else {
        None
    };
    out.par_chunks_mut(dv).enumerate().for_each(|(i, o)| {
        let (t, h) = (i / n_head, i % n_head);
        let (seq, pos) = rows[t];
        let qh = &q[(t * n_head + h) * dk..][..dk];
        let lo = shape.window.map_or(0, |w| (pos + 1).saturating_sub(w));
        match split {
            None => {
                let s = if wide {
                    attend_tiled(kv, layer, seq, lo, pos, qh, h / group, shape, o)
                } else {
                    attend_range(kv, layer, seq, lo, pos, qh, h / group, shape, false, o).1
                };
                let inv = if s > 0.0 { 1.0 / s } else { 0.0 };
                o.iter_mut().for_each(|x| *x *= inv);
            }
            Some(chunk) => {
                let mut part = vec![0.0f32; dv];
                let (mut m_fin, mut s_fin) = (f32::NEG_INFINITY, 0.0f32);
                o.fill(0.0);
                let mut start = 0;
                while start <= pos {
                    let (a, b) = (start.max(lo), (start + chunk - 1).min(pos));
                    start += chunk;
                    if a > b {
                        continue;
                    }
                    let (m_c, s_c) = attend_range(kv, layer, seq, a, b, qh, h / group, shape, wide, &mut part);
                    if s_c == 0.0 {
                        continue;
                    }
                    let m_new = m_fin.max(m_c);
                    let (so, sn) = ((m_fin - m_new).exp(), (m_c - m_new).exp());
                    for (f, &c) in o.iter_mut().zip(&part) {
                        *f = f.mul_add(so, c * sn);
                    }
                    s_fin = s_fin.mul_add(so, s_c * sn);
                    m_fin = m_new;
                }
                if s_fin != 0.0 {
                    let inv = 1.0 / s_fin;
                    o.iter_mut().for_each(|x| *x *= inv);
                }
            }
        }
    });
}

/// llama.cpp pads the number of cache cells attention looks at to a multiple of this.
const KV_PAD: usize = 256;
/// Padded cells from which a single-row decode takes llama.cpp's split-KV path.
const SPLIT_KV_MIN: usize = 512;

/// Round to the nearest f16 and back: the f16 accumulator of llama.cpp's decode path.
#[inline(always)]
fn f16_round(x: f32) -> f32 {
    half::f16::from_f32(x).to_f32()
}

/// Online softmax over the keys at positions lo..=hi into `out`, not yet divided by the returned sum.
/// Returns (running max, sum of exp(score - max)).
#[allow(clippy::too_many_arguments)]
fn attend_range(
    kv: &KvCache,
    layer: usize,
    seq: SeqId,
    lo: usize,
    pos: usize,
    q: &[f32],
    g: usize,
    shape: AttnShape,
    wide: bool,
    out: &mut [f32],
) -> (f32, f32) {
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
                    *o = x.mul_add(vs, *o); // ggml_vec_mad_f32: FMA
                }
            }
            s = s.mul_add(ms, vs); // gcc contracts ggml's `S*ms + vs`
        }
    }
    (m, s)
}

/// KV tile of llama.cpp's tiled f32 flash attention (GGML_FA_TILE_KV).
const KV_TILE: usize = 64;

/// llama.cpp's tiled path (ggml_compute_forward_flash_attn_ext_tiled) for one query row and head: keys in tiles
/// of KV_TILE cells; scores are sequential FMA chains over the head dimension (its simd_gemm), the softmax is
/// taken per tile with ggml_v_expf and summed 8 lanes at a time into a double, and V is accumulated with one
/// FMA per key in order. Writes the unnormalised sum into `out` and returns the softmax sum.
#[allow(clippy::too_many_arguments)]
fn attend_tiled(
    kv: &KvCache,
    layer: usize,
    seq: SeqId,
    lo: usize,
    pos: usize,
    q: &[f32],
    g: usize,
    shape: AttnShape,
    out: &mut [f32],
) -> f32 {
    let (dk, dv) = (shape.head_dim, shape.head_dim_v);
    let (k_type, v_type) = (kv.cfg.k_type, kv.cfg.v_type);
    let k_head_bytes = k_type.row_bytes(dk).unwrap_or(0);
    let v_head_bytes = v_type.row_bytes(dv).unwrap_or(0);
    let (k_rb, v_rb) = (kv.k_row_bytes(), kv.v_row_bytes());
    let bs = kv.cfg.block_size;
    let mut k_buf = vec![0.0f32; dk];
    let mut v_buf = vec![0.0f32; dv];
    let mut score = [f32::NEG_INFINITY; KV_TILE];
    out.fill(0.0);
    let (mut m, mut s) = (f32::NEG_INFINITY, 0.0f32);
    let mut t0 = lo / KV_TILE * KV_TILE;
    while t0 <= pos {
        let (a, b) = (t0.max(lo), (t0 + KV_TILE - 1).min(pos));
        score.fill(f32::NEG_INFINITY);
        let mut tile_max = f32::NEG_INFINITY;
        for p in a..=b {
            let (kb, _) = kv.block_view(layer, seq, p / bs);
            let k = &kb[(p % bs) * k_rb + g * k_head_bytes..][..k_head_bytes];
            let _ = dequantize_row(k_type, k, &mut k_buf);
            let dot = q.iter().zip(&k_buf).fold(0.0f32, |acc, (&x, &y)| x.mul_add(y, acc));
            let sc = dot * shape.scale;
            score[p - t0] = sc;
            tile_max = tile_max.max(sc);
        }
        let m_new = m.max(tile_max);
        if m_new > m {
            let ms = (m - m_new).exp();
            out.iter_mut().for_each(|o| *o *= ms);
            s *= ms;
        }
        m = m_new;
        let mut sum = 0.0f64;
        for lanes in score.chunks_exact_mut(8) {
            for x in lanes.iter_mut() {
                *x = if *x == f32::NEG_INFINITY { 0.0 } else { crate::cpu::ops::ggml_expf(*x - m_new) };
            }
            let l = &*lanes;
            let (v0, v1, v2, v3) = (l[0] + l[4], l[1] + l[5], l[2] + l[6], l[3] + l[7]);
            sum += ((v0 + v2) + (v1 + v3)) as f64;
        }
        s = (s as f64 + sum) as f32;
        for p in a..=b {
            let (_, vb) = kv.block_view(layer, seq, p / bs);
            let v = &vb[(p % bs) * v_rb + g * v_head_bytes..][..v_head_bytes];
            let _ = dequantize_row(v_type, v, &mut v_buf);
            let w = score[p - t0];
            for (o, &x) in out.iter_mut().zip(&v_buf) {
                *o = w.mul_add(x, *o);
            }
        }
        t0 += KV_TILE;
    }
    s
}
