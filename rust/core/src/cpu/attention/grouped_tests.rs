//! The grouped one-row path against llama.cpp's per-head loop written out directly (ggml-cpu/ops.cpp:
//! `ggml_compute_forward_flash_attn_ext_f16_one_chunk` per query head, and for a single row over at least 512
//! padded cells one chunk per thread merged by `ggml_flash_attn_ext_reduce_partials`): the same bits for every
//! head, GQA group sizes of the Qwen2.5 models, with and without the split, windows and a quantized cache.

use super::*;
use crate::kv::KvConfig;

/// llama.cpp's one-chunk loop for one query head over cells ic_start..ic_end, cells outside lo..=pos masked.
/// Returns (VKQ unnormalised, M, S).
#[allow(clippy::too_many_arguments)]
fn one_chunk(
    kv: &KvCache, seq: SeqId, q: &[f32], g: usize, shape: AttnShape, lo: usize, pos: usize, cells: (usize, usize),
) -> (Vec<f32>, f32, f32) {
    let ops = vec_ops();
    let (dk, dv) = (shape.head_dim, shape.head_dim_v);
    let (k_type, v_type) = (kv.cfg.k_type, kv.cfg.v_type);
    let mut q_act = vec![0u8; k_type.act_type().row_bytes(dk).unwrap()];
    quantize_act(k_type.act_type(), q, &mut q_act);
    let (kb_head, vb_head) = (k_type.row_bytes(dk).unwrap(), v_type.row_bytes(dv).unwrap());
    let (mut m, mut s) = (f32::NEG_INFINITY, 0.0f32);
    let mut vkq = vec![0.0f32; dv];
    let mut v32 = vec![0.0f32; dv];
    let bs = kv.cfg.block_size;
    for ic in cells.0..cells.1 {
        if ic < lo || ic > pos {
            continue; // mask -inf
        }
        let view = kv.block_view(0, seq, ic / bs);
        let slot = ic % bs;
        let off = view.k_offset.map_or(0.0, |o| dot(q, &o[g * dk..(g + 1) * dk]));
        let k = &view.k[slot * view.k_row_bytes + g * kb_head..][..kb_head];
        // (not llama.cpp's: what our cache's sink key lost to quantization)
        let sink = view.k_sink.filter(|_| slot == 0).map_or(0.0, |r| dot(q, &r[g * dk..(g + 1) * dk]));
        let sc = (vec_dot(k_type, dk, k, &q_act) + off + sink) * shape.scale;
        let v = &view.v[slot * view.v_row_bytes + g * vb_head..][..vb_head];
        let (mut ms, mut vs) = (1.0f32, 1.0f32);
        let m_old = m;
        if sc > m {
            m = sc;
            ms = (m_old - m).exp();
        } else {
            vs = (sc - m).exp();
        }
        if v_type == GgmlType::F16 {
            if ms != 1.0 {
                (ops.scale_f16)(&mut vkq, ms);
            }
            (ops.axpy_f16)(&mut vkq, v, vs);
        } else {
            if ms != 1.0 {
                (ops.scale)(&mut vkq, ms);
            }
            dequantize_row(v_type, v, &mut v32).unwrap();
            (ops.axpy)(&mut vkq, &v32, vs);
        }
        s = s.mul_add(ms, vs);
    }
    (vkq, m, s)
}

/// One query head's output as llama.cpp computes it for a batch of `n_rows` rows (split only for a single row).
fn llama_cpp_head(kv: &KvCache, seq: SeqId, pos: usize, q: &[f32], g: usize, shape: AttnShape, n_rows: usize) -> Vec<f32> {
    let lo = shape.first_key(pos);
    let n_kv = (pos + 1).next_multiple_of(256);
    let f16 = kv.cfg.k_type == GgmlType::F16 && kv.cfg.v_type == GgmlType::F16;
    if !(f16 && n_rows == 1 && n_kv >= 512) {
        let (mut o, _, s) = one_chunk(kv, seq, q, g, shape, lo, pos, (0, n_kv));
        (vec_ops().scale)(&mut o, if s == 0.0 { 0.0 } else { 1.0 / s });
        return o;
    }
    let nth = rayon::current_num_threads();
    let chunk = n_kv.div_ceil(nth);
    let (mut m_fin, mut s_fin) = (f32::NEG_INFINITY, 0.0f32);
    let mut o = vec![0.0f32; shape.head_dim_v];
    for ith in 0..nth {
        let start = ith * chunk;
        if start >= n_kv {
            continue;
        }
        let (part, m_c, s_c) = one_chunk(kv, seq, q, g, shape, lo, pos, (start, (start + chunk).min(n_kv)));
        if s_c == 0.0 {
            continue;
        }
        let m_new = m_fin.max(m_c);
        let (so, sn) = ((m_fin - m_new).exp(), (m_c - m_new).exp());
        for (f, &c) in o.iter_mut().zip(&part) {
            *f = f.mul_add(so, c * sn); // gcc contracts VKQ_final*scale_old + VKQ_chunk*scale_new
        }
        s_fin = s_fin.mul_add(so, s_c * sn);
        m_fin = m_new;
    }
    if s_fin != 0.0 {
        (vec_ops().scale)(&mut o, 1.0 / s_fin);
    }
    o
}

fn cache(ty: GgmlType, n_head_kv: usize, hd: usize, n: usize) -> KvCache {
    let mut kv = KvCache::new(KvConfig {
        n_layer: 1, n_head_kv, head_dim_k: hd, head_dim_v: hd, k_type: ty, v_type: ty, block_size: 256,
        n_ctx: 2048, max_blocks: 8,
    })
    .unwrap();
    kv.extend(0, n).unwrap();
    let rows: Vec<(SeqId, usize)> = (0..n).map(|p| (0, p)).collect();
    let row = n_head_kv * hd;
    // Scores spread enough that the running max moves now and then through the sequence.
    let keys: Vec<f32> = crate::test_rng::uniform_floats(5, n * row, 2.0).iter().enumerate()
        .map(|(i, &x)| x * (1.0 + (i / row % 97) as f32 / 40.0)).collect();
    let vals = crate::test_rng::uniform_floats(6, n * row, 2.0);
    kv.write_rows(0, &rows, &keys, &vals).unwrap();
    kv
}

/// Every head of every row equals llama.cpp's per-head loop, bit for bit.
fn check(kv: &KvCache, rows: &[(SeqId, usize)], shape: AttnShape, order: RowOrder, what: &str) {
    let (n_head, hd) = (shape.n_head, shape.head_dim);
    let q = crate::test_rng::uniform_floats(rows.len() as u64 * 31 + 7, rows.len() * n_head * hd, 1.5);
    let mut out = vec![0.0f32; rows.len() * n_head * hd];
    attention(kv, 0, rows, &q, shape, order, &mut out);
    let mut q_stored = q.clone();
    if kv.rotates_k() {
        rotation::rotate(&mut q_stored, hd);
    }
    let n_rows = if order == RowOrder::AsSteps { 1 } else { rows.len() };
    for (t, &(seq, pos)) in rows.iter().enumerate() {
        for h in 0..n_head {
            let qh = &q_stored[(t * n_head + h) * hd..][..hd];
            let mut want = llama_cpp_head(kv, seq, pos, qh, h / (n_head / shape.n_head_kv), shape, n_rows);
            if kv.rotates_v() {
                rotation::rotate(&mut want, hd);
            }
            let got = &out[(t * n_head + h) * hd..][..hd];
            if let Some(d) = (0..hd).find(|&d| got[d].to_bits() != want[d].to_bits()) {
                panic!("{what}: row {t} (pos {pos}) head {h}, column {d}: {} vs llama.cpp's {}", got[d], want[d]);
            }
        }
    }
}

#[test]
fn grouped_path_equals_llama_cpp_per_head_loop() {
    // Qwen2.5-Coder-0.5B's shape (7 heads a KV head, dims 64) and 1.5B's (6, 128: AVX512-FP16's half-precision V
    // accumulation covers all of its columns).
    for (n_head, hd) in [(14, 64), (12, 128)] {
        let kv = cache(GgmlType::F16, 2, hd, 1500);
        for window in [None, Some(600)] {
            let shape = AttnShape { n_head, n_head_kv: 2, head_dim: hd, head_dim_v: hd, scale: 0.125, window };
            for threads in [1, 2, 3] {
                let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
                pool.install(|| {
                    for pos in [0, 40, 300, 511, 700, 1499] {
                        let what = format!("f16 {n_head}x{hd}, window {window:?}, {threads} threads");
                        check(&kv, &[(0, pos)], shape, RowOrder::Batch, &what);
                    }
                    let rows = [(0, 900), (0, 901), (0, 1200)];
                    check(&kv, &rows, shape, RowOrder::Batch, &format!("3 rows, {threads} threads"));
                    check(&kv, &rows, shape, RowOrder::AsSteps, &format!("3 rows as steps, {threads} threads"));
                });
            }
        }
    }
    // A rotated q8_0 cache: q8_0 dots, block offsets, V dequantized and accumulated in f32.
    let kv = cache(GgmlType::Q8_0, 2, 64, 700);
    let shape = AttnShape { n_head: 14, n_head_kv: 2, head_dim: 64, head_dim_v: 64, scale: 0.125, window: None };
    for pos in [5, 300, 699] {
        check(&kv, &[(0, pos)], shape, RowOrder::Batch, "q8_0");
    }
}
