//! Fused decode/prefill attention over the paged KV cache: for each (token, head), one pass over the KV blocks
//! with an online softmax (running max and sum), so no [n_kv] score vector is materialised. GQA: query head h
//! reads KV head h / (n_head / n_head_kv).
//!
//! Precision follows llama.cpp's CPU flash attention, which greedy parity is measured against. It has two paths:
//! - few query rows (decode, short prompts) or a quantized cache: q is converted to the cache's dot format (f16,
//!   or q8_0 for a quantized cache) and, for an f16 V cache, the weighted sum of V is accumulated in f16;
//! - batches of at least `TILED_MIN_ROWS` rows with an f16 cache: q stays f32, K and V are widened to f32, and
//!   everything accumulates in f32.
//!
//! A single row (decode) over a long cache also splits the cells into one chunk per thread, as llama.cpp does.
//! The one-chunk path runs all query heads of a KV head together (see `attention_stored`), each head's arithmetic
//! unchanged.
//! Under `RowOrder::AsSteps` every row of a batch takes the path it would take alone.

use rayon::prelude::*;

use crate::cpu::RowOrder;
use crate::kv::{rotation, BiasTerm, KvCache, SeqId};
use crate::quant::simd::vec_ops;
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

impl AttnShape {
    /// The first key position a query at `pos` sees.
    pub fn first_key(&self, pos: usize) -> usize {
        self.window.map_or(0, |w| (pos + 1).saturating_sub(w))
    }
}

/// Divide an unnormalised attention output by its softmax sum (none: zeros, as llama.cpp).
fn normalize(o: &mut [f32], sum: f32) {
    (vec_ops().scale)(o, if sum > 0.0 { 1.0 / sum } else { 0.0 });
}

/// out[t, h*dv..] = softmax(q[t,h] · K[seq_t, 0..=pos_t]) V for every row t of the batch, over a plain (untiered)
/// cache; a tiered one is `attention_tiered::attention`.
/// rows: (sequence, position) of each query row; q: [n, n_head * head_dim]; out: [n, n_head * head_dim_v].
/// Under [`RowOrder::AsSteps`] each row takes the path a one-row batch at its position would take.
pub fn attention(
    kv: &KvCache,
    layer: usize,
    rows: &[(SeqId, usize)],
    q: &[f32],
    shape: AttnShape,
    order: RowOrder,
    out: &mut [f32],
) {
    in_stored_basis(kv, q, shape, out, |q, out| attention_stored(kv, layer, rows, q, shape, order, out));
}

/// Run `f(q, out)` with q in the basis the cache stores keys in and out taken from the basis of its values: a
/// quantized or tiered cache stores rows Hadamard-rotated, so the queries are rotated the same way and the
/// outputs back.
pub(crate) fn in_stored_basis(kv: &KvCache, q: &[f32], shape: AttnShape, out: &mut [f32], f: impl FnOnce(&[f32], &mut [f32])) {
    let rotated_q = kv.rotates_k().then(|| {
        let mut r = q.to_vec();
        rotation::rotate(&mut r, shape.head_dim);
        r
    });
    f(rotated_q.as_deref().unwrap_or(q), out);
    if kv.rotates_v() {
        rotation::rotate(out, shape.head_dim_v);
    }
}

/// `attention` with q already in the basis the cache stores keys in, and `out` left in the basis of its values.
///
/// Rows below `TILED_MIN_ROWS` (and every row under `RowOrder::AsSteps`) run llama.cpp's one-chunk path, as work
/// items of one (row, KV head, key chunk) each: every query head of the KV head's group over the chunk's keys, so
/// each K and V row is read once for the group. Each head's arithmetic is that of llama.cpp's per-head loop.
fn attention_stored(
    kv: &KvCache,
    layer: usize,
    rows: &[(SeqId, usize)],
    q: &[f32],
    shape: AttnShape,
    order: RowOrder,
    out: &mut [f32],
) {
    let AttnShape { n_head, n_head_kv, head_dim: dk, head_dim_v: dv, .. } = shape;
    let group = n_head / n_head_kv;
    let f16_cache = kv.cfg.k_type == GgmlType::F16 && kv.cfg.v_type == GgmlType::F16;
    let as_steps = order == RowOrder::AsSteps;
    if f16_cache && rows.len() >= TILED_MIN_ROWS && !as_steps {
        return attention_tiled(kv, layer, rows, q, shape, out);
    }
    // llama.cpp's decode of a single query row over at least SPLIT_KV_MIN padded cache cells splits the cells
    // into one chunk per thread (chunk i: cells [i * chunk, (i + 1) * chunk)) and merges the chunks' partial
    // softmaxes in chunk order (ggml_flash_attn_ext_reduce_partials). The chunk size for a row at `pos`, when it
    // takes that path:
    let threads = rayon::current_num_threads().max(1);
    let split_at = |pos: usize| {
        let n_kv = (pos + 1).next_multiple_of(KV_PAD).max(KV_PAD);
        (f16_cache && (rows.len() == 1 || as_steps) && n_kv >= SPLIT_KV_MIN).then(|| n_kv.div_ceil(threads))
    };
    // Work items (row, KV head, first key, last key), a row's chunks of one KV head consecutive and in order.
    let mut items: Vec<(usize, usize, usize, usize)> = Vec::new();
    for (t, &(_, pos)) in rows.iter().enumerate() {
        let lo = shape.first_key(pos);
        let chunk = split_at(pos).unwrap_or(pos + 1);
        for g in 0..n_head_kv {
            for start in (0..=pos).step_by(chunk) {
                let (a, b) = (start.max(lo), (start + chunk - 1).min(pos));
                if a <= b {
                    items.push((t, g, a, b));
                }
            }
        }
    }
    let partials: Vec<Partial> = items
        .par_iter()
        .map(|&(t, g, a, b)| {
            let qg = &q[(t * n_head + g * group) * dk..(t * n_head + (g + 1) * group) * dk];
            attend_group(kv, layer, rows[t].0, a, b, qg, g, shape)
        })
        .collect();
    let mut next = 0;
    for (t, &(_, pos)) in rows.iter().enumerate() {
        for g in 0..n_head_kv {
            let n_chunks = items[next..].iter().take_while(|it| (it.0, it.1) == (t, g)).count();
            let parts = &partials[next..next + n_chunks];
            next += n_chunks;
            for hg in 0..group {
                let o = &mut out[(t * n_head + g * group + hg) * dv..][..dv];
                match split_at(pos) {
                    // One chunk: normalised as llama.cpp's one-chunk path does.
                    None => {
                        o.copy_from_slice(&parts[0].out[hg * dv..(hg + 1) * dv]);
                        normalize(o, parts[0].s[hg]);
                    }
                    Some(_) => reduce_partials(parts, hg, dv, o),
                }
            }
        }
    }
}

/// llama.cpp pads the number of cache cells attention looks at to a multiple of this.
const KV_PAD: usize = 256;
/// Padded cells from which a single-row decode takes llama.cpp's split-KV path.
const SPLIT_KV_MIN: usize = 512;
/// Keys scored together before their values are accumulated.
const KEY_BLOCK: usize = 32;

/// The unnormalised result of one work item: per query head of the group, its output [group][dv], running max
/// and sum of exp(score - max).
struct Partial {
    out: Vec<f32>,
    m: Vec<f32>,
    s: Vec<f32>,
}

/// o <- head `hg`'s chunks merged in order and normalised, as ggml_flash_attn_ext_reduce_partials does.
fn reduce_partials(parts: &[Partial], hg: usize, dv: usize, o: &mut [f32]) {
    let (mut m_fin, mut s_fin) = (f32::NEG_INFINITY, 0.0f32);
    o.fill(0.0);
    for p in parts {
        let (m_c, s_c) = (p.m[hg], p.s[hg]);
        if s_c == 0.0 {
            continue;
        }
        let m_new = m_fin.max(m_c);
        let (so, sn) = ((m_fin - m_new).exp(), (m_c - m_new).exp());
        for (f, &c) in o.iter_mut().zip(&p.out[hg * dv..(hg + 1) * dv]) {
            *f = f.mul_add(so, c * sn);
        }
        s_fin = s_fin.mul_add(so, s_c * sn);
        m_fin = m_new;
    }
    if s_fin != 0.0 {
        (vec_ops().scale)(o, 1.0 / s_fin);
    }
}

/// Online softmax of each query head of `qg` ([group][head_dim], the heads of KV head `g`) over the keys at
/// positions lo..=hi: llama.cpp's one-chunk path per head (q converted to the cache's dot format; an f16 V cache
/// accumulated in f16), with each K and V row read once for the whole group. Keys go in blocks of up to
/// KEY_BLOCK: the block's scores first, then each head's softmax steps in key order, then the values.
#[allow(clippy::too_many_arguments)]
fn attend_group(
    kv: &KvCache,
    layer: usize,
    seq: SeqId,
    lo: usize,
    hi: usize,
    qg: &[f32],
    g: usize,
    shape: AttnShape,
) -> Partial {
    let ops = vec_ops();
    let (dk, dv) = (shape.head_dim, shape.head_dim_v);
    let group = qg.len() / dk;
    let (k_type, v_type) = (kv.cfg.k_type, kv.cfg.v_type);
    let q_type = k_type.act_type();
    let q_bytes = q_type.row_bytes(dk).unwrap_or(0);
    let mut q_act = vec![0u8; group * q_bytes];
    for (qh, act) in qg.chunks_exact(dk).zip(q_act.chunks_exact_mut(q_bytes.max(1))) {
        quantize_act(q_type, qh, act);
    }
    let f16_acc = v_type == GgmlType::F16;
    let k_head_bytes = k_type.row_bytes(dk).unwrap_or(0);
    let v_head_bytes = v_type.row_bytes(dv).unwrap_or(0);
    let mut v_buf = vec![0.0f32; dv];
    let mut out = vec![0.0f32; group * dv];
    let mut softmax: Vec<OnlineSoftmax> = (0..group).map(|_| OnlineSoftmax::new()).collect();
    // Per key of a block and head: [key][head].
    let mut score = vec![0.0f32; KEY_BLOCK * group];
    let (mut ms, mut vs) = (vec![0.0f32; KEY_BLOCK * group], vec![0.0f32; KEY_BLOCK * group]);
    let (mut k_offset, mut sink_share) = (vec![0.0f32; group], vec![0.0f32; group]);
    let mut bias = KeyBiasScores::new(qg, dk);

    let bs = kv.cfg.block_size;
    for b in lo / bs..=hi / bs {
        let view = kv.block_view(layer, seq, b);
        let (kb, vb, k_rb, v_rb) = (view.k, view.v, view.k_row_bytes, view.v_row_bytes);
        // What the block's stored keys lack (a rotated cache's offset): the same q·offset for each of its keys.
        for ((off, sink), qh) in k_offset.iter_mut().zip(&mut sink_share).zip(qg.chunks_exact(dk)) {
            *off = view.k_offset.map_or(0.0, |o| dot(qh, &o[g * dk..(g + 1) * dk]));
            *sink = view.k_sink.map_or(0.0, |r| dot(qh, &r[g * dk..(g + 1) * dk]));
        }
        let bias = bias.for_block(view.k_bias, g, bs);
        let (first, last) = ((b * bs).max(lo) - b * bs, ((b + 1) * bs - 1).min(hi) - b * bs);
        for s0 in (first..=last).step_by(KEY_BLOCK) {
            let n = KEY_BLOCK.min(last + 1 - s0);
            for j in 0..n {
                let k = &kb[(s0 + j) * k_rb + g * k_head_bytes..][..k_head_bytes];
                for h in 0..group {
                    let act = &q_act[h * q_bytes..(h + 1) * q_bytes];
                    let b = bias.as_ref().map_or(0.0, |bias| bias.score(h, s0 + j));
                    let sink = if s0 + j == 0 { sink_share[h] } else { 0.0 };
                    score[j * group + h] = (vec_dot(k_type, dk, k, act) + k_offset[h] + b + sink) * shape.scale;
                }
            }
            for (h, sm) in softmax.iter_mut().enumerate() {
                for j in 0..n {
                    (ms[j * group + h], vs[j * group + h]) = sm.step(score[j * group + h]);
                }
            }
            let v = &vb[s0 * v_rb + g * v_head_bytes..];
            if f16_acc {
                (ops.accumulate_f16)(&mut out, dv, v, v_rb, &ms[..n * group], &vs[..n * group]);
                continue;
            }
            for j in 0..n {
                // Sizes were validated when the cache was built.
                let _ = dequantize_row(v_type, &v[j * v_rb..][..v_head_bytes], &mut v_buf);
                for (h, o) in out.chunks_exact_mut(dv).enumerate() {
                    if ms[j * group + h] != 1.0 {
                        (ops.scale)(o, ms[j * group + h]);
                    }
                    (ops.axpy)(o, &v_buf, vs[j * group + h]); // ggml_vec_mad_f32: FMA
                }
            }
        }
    }
    Partial { out, m: softmax.iter().map(|s| s.m).collect(), s: softmax.iter().map(|s| s.s).collect() }
}

/// The running max and sum of llama.cpp's one-chunk online softmax, one key at a time.
pub(crate) struct OnlineSoftmax {
    pub m: f32,
    pub s: f32,
}

impl OnlineSoftmax {
    pub(crate) fn new() -> Self {
        OnlineSoftmax { m: f32::NEG_INFINITY, s: 0.0 }
    }

    /// One more key of `score`: returns (the factor the output accumulated so far is scaled by, the key's weight),
    /// rescaling when a new maximum appears, and adds the weight to the sum as ggml does (`S*ms + vs`, which gcc
    /// contracts to an FMA).
    #[inline(always)]
    pub(crate) fn step(&mut self, score: f32) -> (f32, f32) {
        let (ms, vs) = if score > self.m {
            let ms = (self.m - score).exp();
            self.m = score;
            (ms, 1.0)
        } else {
            (1.0, (score - self.m).exp())
        };
        self.s = self.s.mul_add(ms, vs);
        (ms, vs)
    }
}

/// The key bias' share of the scores of one KV head's query heads (`kv::key_bias`): the heads taken back to the
/// unrotated basis once, turned by each block's start, and their shares for every slot of the block at once.
pub(crate) struct KeyBiasScores {
    /// The query heads [group][dk] unrotated (made at the first block with a bias) and turned for the current one.
    plain: Option<Vec<f32>>,
    turned: Vec<f32>,
    qg: Vec<f32>,
    dk: usize,
    /// The current block's shares [group][block_size].
    shares: Vec<f32>,
}

/// A block's shares, from `KeyBiasScores::for_block`.
pub(crate) struct BlockBias<'a> {
    shares: &'a [f32],
    block_size: usize,
}

impl KeyBiasScores {
    /// For the query heads `qg` [group][dk] in the stored (rotated) basis.
    pub(crate) fn new(qg: &[f32], dk: usize) -> Self {
        KeyBiasScores { plain: None, turned: vec![0.0; qg.len()], qg: qg.to_vec(), dk, shares: Vec::new() }
    }

    /// The scores' shares for KV head g's keys in a block that lacks `term` (None: nothing to add).
    pub(crate) fn for_block(&mut self, term: Option<BiasTerm<'_>>, g: usize, block_size: usize) -> Option<BlockBias<'_>> {
        let term = term?;
        let dk = self.dk;
        self.plain();
        let plain = self.plain.as_deref().expect("made above");
        self.shares.resize(self.qg.len() / dk * block_size, 0.0);
        for ((q, t), out) in plain.chunks_exact(dk).zip(self.turned.chunks_exact_mut(dk)).zip(self.shares.chunks_exact_mut(block_size)) {
            term.turn_query(q, t);
            term.shares(t, g, out);
        }
        Some(BlockBias { shares: &self.shares, block_size })
    }

    /// Each query head's share of a block's mean bias into `out` [group] (zeros without `term`): what selection adds
    /// to a block's best stored product, as the K offset adds the rest of its mean (`attention_tiered::key_scan`).
    pub(crate) fn block_mean(&mut self, term: Option<BiasTerm<'_>>, g: usize, out: &mut [f32]) -> bool {
        let Some(term) = term else { return false };
        let dk = self.dk;
        self.plain();
        let plain = self.plain.as_deref().expect("made above");
        for ((q, t), o) in plain.chunks_exact(dk).zip(self.turned.chunks_exact_mut(dk)).zip(out.iter_mut()) {
            term.turn_query(q, t);
            *o = term.mean_share(t, g);
        }
        true
    }

    /// Make the unrotated query heads (once).
    fn plain(&mut self) {
        if self.plain.is_none() {
            let mut p = self.qg.clone();
            rotation::rotate(&mut p, self.dk);
            self.plain = Some(p);
        }
    }
}

impl BlockBias<'_> {
    /// Query head h's share for the key at `slot` of the block.
    #[inline]
    pub(crate) fn score(&self, h: usize, slot: usize) -> f32 {
        self.shares[h * self.block_size + slot]
    }
}

/// q·x in f32 (a block's key offset).
pub(crate) fn dot(q: &[f32], x: &[f32]) -> f32 {
    q.iter().zip(x).map(|(a, b)| a * b).sum()
}

/// KV tile of llama.cpp's tiled f32 flash attention (GGML_FA_TILE_KV).
const KV_TILE: usize = 64;
/// Query rows of one sequence that share each dequantized K/V tile in the tiled path.
const ROW_BLOCK: usize = 16;

/// llama.cpp's tiled path (ggml_compute_forward_flash_attn_ext_tiled), for batches of at least
/// `TILED_MIN_ROWS` rows over an f16 cache. Keys go in tiles of KV_TILE cells aligned to multiples of KV_TILE;
/// per (row, head): scores are sequential FMA chains over the head dimension (its simd_gemm), the softmax is
/// taken per tile with ggml_v_expf and summed a vector at a time into a double (`VecOps::exp_shifted`), and V is accumulated with one FMA
/// per key in order.
///
/// The work is split into (KV head, block of up to ROW_BLOCK rows of one sequence): each K and V tile is widened
/// to f32 once per block and used by all its rows and all query heads of the KV head; the sums of each
/// (row, head) are the same operations in the same order as computing it alone.
pub(crate) fn attention_tiled(kv: &KvCache, layer: usize, rows: &[(SeqId, usize)], q: &[f32], shape: AttnShape, out: &mut [f32]) {
    let AttnShape { n_head, n_head_kv, head_dim: dk, head_dim_v: dv, .. } = shape;
    let group = n_head / n_head_kv;
    let mut blocks: Vec<(usize, usize)> = Vec::new(); // row ranges [start, end)
    for (t, &(seq, _)) in rows.iter().enumerate() {
        match blocks.last_mut() {
            Some((s, e)) if *e == t && t - *s < ROW_BLOCK && rows[*s].0 == seq => *e += 1,
            _ => blocks.push((t, t + 1)),
        }
    }
    let items: Vec<(usize, (usize, usize))> =
        (0..n_head_kv).flat_map(|g| blocks.iter().map(move |&b| (g, b))).collect();
    let results: Vec<Vec<f32>> = items
        .par_iter()
        .map(|&(g, (r0, r1))| attend_block_tiled(kv, layer, &rows[r0..r1], &q[r0 * n_head * dk..r1 * n_head * dk], g, shape))
        .collect();
    // Each block's output is [row][head in group][dv]; scatter it into out [row][head][dv].
    for (&(g, (r0, r1)), res) in items.iter().zip(&results) {
        for (i, t) in (r0..r1).enumerate() {
            let src = &res[i * group * dv..(i + 1) * group * dv];
            out[(t * n_head + g * group) * dv..][..group * dv].copy_from_slice(src);
        }
    }
}

/// One (KV head `g`, row block) work item of `attention_tiled`; q holds the block's rows [row][n_head][dk].
/// Returns the normalised outputs [row][head in group][dv].
fn attend_block_tiled(kv: &KvCache, layer: usize, rows: &[(SeqId, usize)], q: &[f32], g: usize, shape: AttnShape) -> Vec<f32> {
    let ops = vec_ops();
    let (dk, dv, n_head) = (shape.head_dim, shape.head_dim_v, shape.n_head);
    let group = n_head / shape.n_head_kv;
    let bs = kv.cfg.block_size;
    let seq = rows[0].0;
    let lo_min = rows.iter().map(|&(_, p)| shape.first_key(p)).min().unwrap_or(0);
    let hi_max = rows.iter().map(|&(_, p)| p).max().unwrap_or(0);

    let n_out = rows.len() * group;
    let mut out = vec![0.0f32; n_out * dv];
    let mut m = vec![f32::NEG_INFINITY; n_out];
    let mut s = vec![0.0f32; n_out];
    let mut kt = vec![0.0f32; dk * KV_TILE]; // [d][cell]
    let mut vt = vec![0.0f32; KV_TILE * dv]; // [cell][d]
    let (mut k_row, mut bias_row) = (vec![0.0f32; dk], vec![0.0f32; dk]);
    let mut score = [0.0f32; KV_TILE];

    let mut t0 = lo_min / KV_TILE * KV_TILE;
    while t0 <= hi_max {
        let (a, b) = (t0.max(lo_min), (t0 + KV_TILE - 1).min(hi_max));
        // Widen the tile's keys (transposed) and values once for the whole block.
        let mut p = a;
        while p <= b {
            // (Types per block: a tiered cache's blocks differ.)
            let view = kv.block_view(layer, seq, p / bs);
            let (kb, vb, k_rb, v_rb, k_type, v_type) =
                (view.k, view.v, view.k_row_bytes, view.v_row_bytes, view.k_type, view.v_type);
            let k_head_bytes = k_type.row_bytes(dk).unwrap_or(0);
            let v_head_bytes = v_type.row_bytes(dv).unwrap_or(0);
            let end = b.min((p / bs + 1) * bs - 1);
            for p in p..=end {
                let slot = p % bs;
                let _ = dequantize_row(k_type, &kb[slot * k_rb + g * k_head_bytes..][..k_head_bytes], &mut k_row);
                if let Some(o) = view.k_offset {
                    k_row.iter_mut().zip(&o[g * dk..(g + 1) * dk]).for_each(|(x, &o)| *x += o);
                }
                if let Some(r) = view.k_sink.filter(|_| slot == 0) {
                    k_row.iter_mut().zip(&r[g * dk..(g + 1) * dk]).for_each(|(x, &r)| *x += r);
                }
                if let Some(term) = &view.k_bias {
                    term.rotated_bias(slot, g, &mut bias_row);
                    k_row.iter_mut().zip(&bias_row).for_each(|(x, &b)| *x += b);
                }
                for (d, &x) in k_row.iter().enumerate() {
                    kt[d * KV_TILE + (p - t0)] = x;
                }
                let v = &vb[slot * v_rb + g * v_head_bytes..][..v_head_bytes];
                let _ = dequantize_row(v_type, v, &mut vt[(p - t0) * dv..(p - t0 + 1) * dv]);
            }
            p = end + 1;
        }
        for (i, &(_, pos)) in rows.iter().enumerate() {
            let (ra, rb) = (t0.max(shape.first_key(pos)), (t0 + KV_TILE - 1).min(pos));
            if ra > rb {
                continue; // this row sees no key of the tile
            }
            for hg in 0..group {
                let h = g * group + hg;
                let j = i * group + hg;
                (ops.dot_cols)(&q[(i * n_head + h) * dk..][..dk], &kt, &mut score);
                let mut tile_max = f32::NEG_INFINITY;
                for (c, sc) in score.iter_mut().enumerate() {
                    let p = t0 + c;
                    if p < ra || p > rb {
                        *sc = f32::NEG_INFINITY;
                    } else {
                        *sc *= shape.scale;
                        tile_max = tile_max.max(*sc);
                    }
                }
                let o = &mut out[j * dv..(j + 1) * dv];
                let m_new = m[j].max(tile_max);
                if m_new > m[j] {
                    let ms = (m[j] - m_new).exp();
                    (ops.scale)(o, ms);
                    s[j] *= ms;
                }
                m[j] = m_new;
                let sum = (ops.exp_shifted)(&mut score, m_new);
                s[j] = (s[j] as f64 + sum) as f32;
                let (ca, cb) = (ra - t0, rb - t0 + 1);
                (ops.axpy_rows)(o, &vt[ca * dv..cb * dv], &score[ca..cb]);
            }
        }
        t0 += KV_TILE;
    }
    for (o, &sj) in out.chunks_exact_mut(dv).zip(&s) {
        normalize(o, sj);
    }
    out
}

#[cfg(test)]
mod grouped_tests;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::KvConfig;

    fn pseudo(seed: u64, n: usize) -> Vec<f32> {
        crate::test_rng::uniform_floats(seed, n, 2.0)
    }

    /// softmax(q·k * scale) V in f64 from the f16-rounded cache contents.
    fn reference(
        keys: &[Vec<f32>], vals: &[Vec<f32>], q: &[f32], lo: usize, pos: usize, g: usize, shape: AttnShape,
    ) -> Vec<f32> {
        let (dk, dv) = (shape.head_dim, shape.head_dim_v);
        let r = |x: f32| half::f16::from_f32(x).to_f32() as f64;
        let scores: Vec<f64> = (lo..=pos)
            .map(|p| (0..dk).map(|d| q[d] as f64 * r(keys[p][g * dk + d])).sum::<f64>() * shape.scale as f64)
            .collect();
        let mx = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let w: Vec<f64> = scores.iter().map(|s| (s - mx).exp()).collect();
        let z: f64 = w.iter().sum();
        (0..dv)
            .map(|d| ((lo..=pos).zip(&w).map(|(p, wi)| wi * r(vals[p][g * dv + d])).sum::<f64>() / z) as f32)
            .collect()
    }

    /// Both paths (one-chunk for short batches, tiled for >= TILED_MIN_ROWS rows), two interleaved sequences
    /// whose lengths straddle tiles and cache blocks, GQA and a sliding window: every output row equals softmax
    /// attention computed directly.
    #[test]
    fn paths_equal_direct_softmax_attention() {
        let (n_head, n_head_kv, hd) = (6, 2, 64);
        let mut kv = KvCache::new(KvConfig {
            n_layer: 1, n_head_kv, head_dim_k: hd, head_dim_v: hd, k_type: GgmlType::F16, v_type: GgmlType::F16,
            block_size: 32, n_ctx: 512, max_blocks: 64,
        })
        .unwrap();
        for window in [None, Some(50)] {
            for (n0, n1) in [(3usize, 2usize), (90, 75)] {
                kv.remove(0);
                kv.remove(1);
                let mut rows = Vec::new();
                let (mut keys, mut vals) = (vec![Vec::new(), Vec::new()], vec![Vec::new(), Vec::new()]);
                for (seq, n) in [(0u32, n0), (1, n1)] {
                    kv.extend(seq, n).unwrap();
                    for p in 0..n {
                        let k = pseudo((seq as u64) << 20 | p as u64, n_head_kv * hd);
                        let v = pseudo((seq as u64) << 20 | p as u64 | 1 << 19, n_head_kv * hd);
                        kv.write(0, seq, p, &k, &v).unwrap();
                        keys[seq as usize].push(k);
                        vals[seq as usize].push(v);
                        rows.push((seq, p));
                    }
                }
                let shape = AttnShape { n_head, n_head_kv, head_dim: hd, head_dim_v: hd, scale: 0.125, window };
                let q = pseudo(99, rows.len() * n_head * hd);
                let mut out = vec![0.0f32; rows.len() * n_head * hd];
                attention(&kv, 0, &rows, &q, shape, RowOrder::Batch, &mut out);
                for (t, &(seq, pos)) in rows.iter().enumerate() {
                    let lo = window.map_or(0, |w| (pos + 1).saturating_sub(w));
                    for h in 0..n_head {
                        let qh = &q[(t * n_head + h) * hd..][..hd];
                        let want = reference(&keys[seq as usize], &vals[seq as usize], qh, lo, pos, h / 3, shape);
                        let got = &out[(t * n_head + h) * hd..][..hd];
                        for (a, b) in got.iter().zip(&want) {
                            assert!((a - b).abs() < 4e-3, "rows {n0}+{n1}, window {window:?}, row {t} head {h}: {a} vs {b}");
                        }
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod rotated_tests;
