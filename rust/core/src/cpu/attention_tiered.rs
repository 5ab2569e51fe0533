//! Attention over a tiered KV cache (`kv::tiers`): blocks of mixed precision (f16, q8_0, q4_0 in the L3 ring).
//!
//! Batches of at least `TILED_MIN_ROWS` rows (prefill) attend to every block through the tiled path, which widens
//! each block from its own precision. Other rows attend per (row, head) in two parts: the old part (the sink block
//! and the blocks before L1) and the recent part (the blocks holding the newest `l1` positions). Each part is an
//! online softmax; the two partial results merge by log-sum-exp. At a decode step (a sequence's only row in the
//! batch) with `select` > 0, the old part is cut to the sink and the best `select` tokens' worth of blocks, ranked
//! per KV head over its query heads by the tier settings' `BlockScorer`: the largest q·k over each block's stored
//! keys, or Quest's bound from the block's key summary (element-wise min and max: sum_d max(q_d min_d, q_d max_d)).

use std::collections::HashMap;
use std::sync::Arc;

use rayon::prelude::*;

use crate::cpu::attention::{attention_tiled, dot, in_stored_basis, AttnShape, OnlineSoftmax, TILED_MIN_ROWS};
use crate::cpu::RowOrder;
use crate::kv::{BlockScorer, KvCache, SeqId, Staged};
use crate::quant::simd::{tile_kernel, vec_ops, MatmulPos};
use crate::quant::{dequantize_row, quantize_act, vec_dot, GgmlType};

/// The blocks one (row, KV head) reads: old (sink and chosen older blocks) and recent (L1), each ascending.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct BlockPlan {
    pub old: Vec<usize>,
    pub recent: Vec<usize>,
}

/// out[t, h*dv..] = attention of q[t,h] over the blocks of seq_t up to pos_t that its plan reads (all of them at
/// select 0), for every row t of the batch: `attention::attention` for a tiered cache.
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

/// `attention` with q in the stored (rotated) basis and out left in it.
fn attention_stored(
    kv: &KvCache,
    layer: usize,
    rows: &[(SeqId, usize)],
    q: &[f32],
    shape: AttnShape,
    order: RowOrder,
    out: &mut [f32],
) {
    if rows.len() >= TILED_MIN_ROWS && order != RowOrder::AsSteps {
        return attention_tiled(kv, layer, rows, q, shape, out);
    }
    let AttnShape { n_head, n_head_kv, head_dim: dk, head_dim_v: dv, .. } = shape;
    let group = n_head / n_head_kv;
    let plans: Vec<BlockPlan> = (0..rows.len() * n_head_kv)
        .into_par_iter()
        .map(|i| {
            let (t, g) = (i / n_head_kv, i % n_head_kv);
            let decode = rows.iter().filter(|r| r.0 == rows[t].0).count() == 1;
            let qg = &q[(t * n_head + g * group) * dk..(t * n_head + (g + 1) * group) * dk];
            plan_blocks(kv, layer, rows[t], qg, g, shape, decode)
        })
        .collect();
    // The L3 blocks each sequence reads, dequantized once for all its rows and heads (staged by the prefetch
    // thread when it guessed them at the last step).
    let mut l3: HashMap<SeqId, Vec<usize>> = HashMap::new();
    for (i, plan) in plans.iter().enumerate() {
        let seq = rows[i / n_head_kv].0;
        l3.entry(seq).or_default().extend(plan.old.iter().copied().filter(|&b| kv.in_l3(seq, b)));
    }
    let mut staged: HashMap<(SeqId, usize), Arc<Staged>> = HashMap::new();
    for (seq, blocks) in &mut l3 {
        blocks.sort_unstable();
        blocks.dedup();
        staged.extend(kv.stage_l3(layer, *seq, blocks).into_iter().map(|(b, s)| ((*seq, b), s)));
    }
    out.par_chunks_mut(dv).enumerate().for_each(|(i, o)| {
        let (t, h) = (i / n_head, i % n_head);
        let (seq, pos) = rows[t];
        let qh = &q[(t * n_head + h) * dk..][..dk];
        let plan = &plans[t * n_head_kv + h / group];
        let lo = shape.first_key(pos);
        let parts = Parts { kv, layer, seq, lo, pos, staged: &staged };
        let (m_old, s_old) = parts.attend(&plan.old, qh, h / group, shape, o);
        let mut recent = vec![0.0f32; dv];
        let (m_new, s_new) = parts.attend(&plan.recent, qh, h / group, shape, &mut recent);
        merge_partials(o, (m_old, s_old), &recent, (m_new, s_new));
    });
    // This step's choice is the next step's guess (with selection; all of L3 otherwise, which is not prefetched).
    if kv.tier_config().is_some_and(|t| t.select > 0) {
        for (seq, blocks) in &l3 {
            kv.prefetch_next(layer, *seq, blocks);
        }
    }
}

/// What one (row, head) reads from: the cache, and the L3 blocks already dequantized.
struct Parts<'a> {
    kv: &'a KvCache,
    layer: usize,
    seq: SeqId,
    lo: usize,
    pos: usize,
    staged: &'a HashMap<(SeqId, usize), Arc<Staged>>,
}

impl Parts<'_> {
    fn attend(&self, blocks: &[usize], q: &[f32], g: usize, shape: AttnShape, out: &mut [f32]) -> (f32, f32) {
        attend_blocks(self.kv, self.layer, self.seq, blocks, self.lo, self.pos, q, g, shape, self.staged, out)
    }
}

/// o <- the normalised softmax result of two unnormalised partial results (max, sum) over disjoint keys.
fn merge_partials(o: &mut [f32], (ma, sa): (f32, f32), b: &[f32], (mb, sb): (f32, f32)) {
    let m = ma.max(mb);
    if m == f32::NEG_INFINITY {
        o.fill(0.0);
        return;
    }
    let (wa, wb) = ((ma - m).exp(), (mb - m).exp());
    let s = sa * wa + sb * wb;
    let inv = if s > 0.0 { 1.0 / s } else { 0.0 };
    for (x, &y) in o.iter_mut().zip(b) {
        *x = (*x * wa + y * wb) * inv;
    }
}

/// The blocks a query row at `pos` of `seq` reads for KV head `g`; `qg` holds the group's query heads
/// [group][head_dim]. Selection applies only to decode rows of a cache with `select` > 0.
pub fn plan_blocks(
    kv: &KvCache,
    layer: usize,
    (seq, pos): (SeqId, usize),
    qg: &[f32],
    g: usize,
    shape: AttnShape,
    decode: bool,
) -> BlockPlan {
    let tiers = kv.tier_config().expect("a tiered cache");
    let bs = kv.cfg.block_size;
    let (first, last) = (shape.first_key(pos) / bs, pos / bs);
    // Blocks from here on hold one of the newest l1 positions.
    let recent_start = ((pos + 1).saturating_sub(tiers.l1) / bs).max(first);
    let recent: Vec<usize> = (recent_start..=last).collect();
    let sink = (first == 0 && recent_start > 0).then_some(0);
    let older: Vec<usize> = (first.max(1)..recent_start).collect();
    let budget = tiers.select.div_ceil(bs);
    if !decode || tiers.select == 0 || older.len() <= budget {
        return BlockPlan { old: sink.into_iter().chain(older).collect(), recent };
    }
    let scores = match tiers.scorer {
        BlockScorer::Keys => key_scan(kv, layer, seq, &older, qg, g, shape),
        BlockScorer::Bound => {
            let dk = shape.head_dim;
            let bound = |b: usize| {
                let (lo, hi) = kv.key_summary(layer, seq, b);
                let (lo, hi) = (&lo[g * dk..(g + 1) * dk], &hi[g * dk..(g + 1) * dk]);
                qg.chunks_exact(dk).map(|q| box_bound(q, lo, hi)).fold(f32::NEG_INFINITY, f32::max)
            };
            older.iter().map(|&b| bound(b)).collect()
        }
    };
    let mut scored: Vec<(f32, usize)> = scores.into_iter().zip(older.iter().copied()).collect();
    scored.select_nth_unstable_by(budget - 1, |a, b| b.0.total_cmp(&a.0));
    let mut chosen: Vec<usize> = scored[..budget].iter().map(|&(_, b)| b).collect();
    chosen.sort_unstable();
    BlockPlan { old: sink.into_iter().chain(chosen).collect(), recent }
}

/// Each block's score for KV head `g`: the largest q·k over its keys, as stored (q8_0 in L2, q4_0 in L3, plus the
/// block's K offset), and over the group's query heads `qg` [group][head_dim]. A bound from a block summary (Quest's
/// element-wise min and max) ranks blocks by how wide their keys spread, not by how well they match, and in real
/// text picks the wrong ones; the keys themselves cost one int8 product a key and query head.
fn key_scan(kv: &KvCache, layer: usize, seq: SeqId, blocks: &[usize], qg: &[f32], g: usize, shape: AttnShape) -> Vec<f32> {
    let dk = shape.head_dim;
    let group = qg.len() / dk;
    let acts = |ty: GgmlType| {
        let row = ty.row_bytes(dk).unwrap_or(0);
        let mut a = vec![0u8; row * group];
        for (q, dst) in qg.chunks_exact(dk).zip(a.chunks_exact_mut(row.max(1))) {
            quantize_act(ty, q, dst);
        }
        (a, row)
    };
    let (q8, f16) = (acts(GgmlType::Q8_0), acts(GgmlType::F16));
    let bs = kv.cfg.block_size;
    blocks
        .par_iter()
        .with_min_len(8)
        .map(|&b| {
            let view = kv.block_view(layer, seq, b);
            let (a, a_row) = if view.k_type.act_type() == GgmlType::F16 { &f16 } else { &q8 };
            let k_head_bytes = view.k_type.row_bytes(dk).unwrap_or(0);
            let keys = &view.k[g * k_head_bytes..];
            let mut dots = vec![0.0f32; bs * group];
            match tile_kernel(view.k_type, MatmulPos { w_rows: 1, act_rows: 1, act_row: 0 }) {
                Some(t) => t.run(dk, keys, view.k_row_bytes, bs, a, *a_row, group, &mut dots),
                None => {
                    for (r, d) in dots.chunks_exact_mut(group).enumerate() {
                        let k = &keys[r * view.k_row_bytes..][..k_head_bytes];
                        for (h, x) in d.iter_mut().enumerate() {
                            *x = vec_dot(view.k_type, dk, k, &a[h * a_row..][..*a_row]);
                        }
                    }
                }
            }
            let offset: Vec<f32> = match view.k_offset {
                Some(o) => qg.chunks_exact(dk).map(|q| dot(q, &o[g * dk..(g + 1) * dk])).collect(),
                None => vec![0.0; group],
            };
            dots.chunks_exact(group)
                .flat_map(|d| d.iter().zip(&offset).map(|(x, o)| x + o))
                .fold(f32::NEG_INFINITY, f32::max)
        })
        .collect()
}

/// Quest's bound on q·k over keys k with lo <= k <= hi element-wise: sum_d max(q_d lo_d, q_d hi_d), summed in
/// BOUND_LANES running sums (independent lanes the compiler keeps in vector registers: a decode step takes one bound
/// per older block, KV head and query head; one chain took twice the time, measured with perf at depth 16K).
fn box_bound(q: &[f32], lo: &[f32], hi: &[f32]) -> f32 {
    const BOUND_LANES: usize = 16;
    let mut acc = [0.0f32; BOUND_LANES];
    let (qc, lc, hc) = (q.chunks_exact(BOUND_LANES), lo.chunks_exact(BOUND_LANES), hi.chunks_exact(BOUND_LANES));
    let tail = qc.remainder().iter().zip(lc.remainder().iter().zip(hc.remainder()));
    let tail: f32 = tail.map(|(&x, (&a, &b))| (x * a).max(x * b)).sum();
    for ((x, a), b) in qc.zip(lc).zip(hc) {
        for i in 0..BOUND_LANES {
            acc[i] += (x[i] * a[i]).max(x[i] * b[i]);
        }
    }
    acc.iter().sum::<f32>() + tail
}

/// Online softmax of q (KV head `g`) over the keys of `blocks` (block indices of `seq`) at positions in lo..=pos,
/// each block read in its own precision, into `out`, not yet divided by the returned sum.
/// Returns (running max, sum of exp(score - max)); (-inf, 0) for no keys.
#[allow(clippy::too_many_arguments)]
pub fn attend_blocks(
    kv: &KvCache,
    layer: usize,
    seq: SeqId,
    blocks: &[usize],
    lo: usize,
    pos: usize,
    q: &[f32],
    g: usize,
    shape: AttnShape,
    staged: &HashMap<(SeqId, usize), Arc<Staged>>,
    out: &mut [f32],
) -> (f32, f32) {
    let ops = vec_ops();
    let (dk, dv) = (shape.head_dim, shape.head_dim_v);
    // q in each dot format the tiers use: f16 (L1) and q8_0 (the quantized tiers).
    let mut q_f16 = vec![0u8; GgmlType::F16.row_bytes(dk).unwrap_or(0)];
    let mut q_q8 = vec![0u8; GgmlType::Q8_0.row_bytes(dk).unwrap_or(0)];
    quantize_act(GgmlType::F16, q, &mut q_f16);
    quantize_act(GgmlType::Q8_0, q, &mut q_q8);
    let mut v_buf = vec![0.0f32; dv];
    out.fill(0.0);
    let mut softmax = OnlineSoftmax::new();
    let bs = kv.cfg.block_size;
    let (kd, vd) = (shape.n_head_kv * dk, shape.n_head_kv * dv);
    let mut add = |score: f32, v: &[f32], out: &mut [f32]| {
        let (ms, vs) = softmax.step(score);
        if ms != 1.0 {
            (ops.scale)(out, ms);
        }
        (ops.axpy)(out, v, vs);
    };
    for &b in blocks {
        let view = kv.block_view(layer, seq, b);
        if let Some(st) = staged.get(&(seq, b)) {
            // An L3 block, dequantized: f32 dot products.
            let k_offset = view.k_offset.map_or(0.0, |o| dot(q, &o[g * dk..(g + 1) * dk]));
            for p in (b * bs).max(lo)..=((b + 1) * bs - 1).min(pos) {
                let slot = p - b * bs;
                let score = (dot(q, &st.k[slot * kd + g * dk..][..dk]) + k_offset) * shape.scale;
                add(score, &st.v[slot * vd + g * dv..][..dv], out);
            }
            continue;
        }
        let q_act = if view.k_type.act_type() == GgmlType::F16 { &q_f16 } else { &q_q8 };
        let k_head_bytes = view.k_type.row_bytes(dk).unwrap_or(0);
        let v_head_bytes = view.v_type.row_bytes(dv).unwrap_or(0);
        let k_offset = view.k_offset.map_or(0.0, |o| dot(q, &o[g * dk..(g + 1) * dk]));
        for p in (b * bs).max(lo)..=((b + 1) * bs - 1).min(pos) {
            let slot = p - b * bs;
            let k = &view.k[slot * view.k_row_bytes + g * k_head_bytes..][..k_head_bytes];
            let score = (vec_dot(view.k_type, dk, k, q_act) + k_offset) * shape.scale;
            let v = &view.v[slot * view.v_row_bytes + g * v_head_bytes..][..v_head_bytes];
            let _ = dequantize_row(view.v_type, v, &mut v_buf);
            add(score, &v_buf, out);
        }
    }
    (softmax.m, softmax.s)
}

#[cfg(test)]
mod tests;
