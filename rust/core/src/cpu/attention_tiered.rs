//! Attention over a tiered KV cache (`kv::tiers`): blocks of mixed precision (f16, q8_0, q4_0 in the L3 ring).
//!
//! Batches of at least `TILED_MIN_ROWS` rows (prefill) attend to every block through the tiled path, which widens
//! each block from its own precision. Other rows attend per (row, KV head) over two parts: the old part (the sink
//! block and the blocks before L1) and the recent part (the blocks holding the newest `l1` positions), in runs of
//! blocks each read once for the group's query heads; the runs' online softmaxes merge by log-sum-exp. At a decode
//! step (a sequence's only row in the batch) with `select` > 0, the old part is cut to the sink and the best
//! `select` tokens' worth of blocks, ranked
//! per KV head over its query heads by the tier settings' `BlockScorer`: the largest q·k over each block's stored
//! keys, or Quest's bound from the block's key summary (element-wise min and max: sum_d max(q_d min_d, q_d max_d)):
//! every older block once every `rescan` steps, and between only that ranking's shortlist and the blocks that
//! became older since (`kv::shortlist`).

use std::collections::HashMap;

use rayon::prelude::*;

use crate::cpu::attention::{attention_tiled, in_stored_basis, AttnShape, KeyBiasScores, OnlineSoftmax, TILED_MIN_ROWS};
use crate::cpu::RowOrder;
use crate::kv::shortlist::SHORTLIST_BUDGETS;
use crate::kv::{BlockScorer, KvCache, SeqId, Shortlist};
use crate::quant::simd::{tile_kernel, vec_ops, MatmulPos};
use crate::quant::math::dot_lanes;
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
    // The L3 blocks each sequence reads, counted with the prefetch thread (read in place either way).
    let mut l3: HashMap<SeqId, Vec<usize>> = HashMap::new();
    for (i, plan) in plans.iter().enumerate() {
        let seq = rows[i / n_head_kv].0;
        l3.entry(seq).or_default().extend(plan.old.iter().copied().filter(|&b| kv.in_l3(seq, b)));
    }
    for (seq, blocks) in &mut l3 {
        blocks.sort_unstable();
        blocks.dedup();
        kv.take_l3(layer, *seq, blocks);
    }
    // A KV head's blocks in runs, each attended by the group's query heads together (its keys and values read
    // once for all of them), then the runs' partial results merged by log-sum-exp.
    let runs: Vec<(usize, usize, &[usize])> = plans
        .iter()
        .enumerate()
        .flat_map(|(i, plan)| {
            let (t, g) = (i / n_head_kv, i % n_head_kv);
            plan.old.chunks(RUN_BLOCKS).chain(plan.recent.chunks(RUN_BLOCKS)).map(move |c| (t, g, c))
        })
        .collect();
    let partials: Vec<GroupPartial> = runs
        .par_iter()
        .map(|&(t, g, blocks)| {
            let (seq, pos) = rows[t];
            let qg = &q[(t * n_head + g * group) * dk..][..group * dk];
            attend_group(kv, layer, seq, blocks, (shape.first_key(pos), pos), qg, g, shape)
        })
        .collect();
    let mut merged: Vec<GroupPartial> = (0..plans.len()).map(|_| GroupPartial::new(group, dv)).collect();
    for (&(t, g, _), p) in runs.iter().zip(&partials) {
        merged[t * n_head_kv + g].merge(p);
    }
    for (i, m) in merged.iter().enumerate() {
        let (t, g) = (i / n_head_kv, i % n_head_kv);
        m.write(&mut out[(t * n_head + g * group) * dv..][..group * dv]);
    }
    // This step's choice is the next step's guess (with selection; all of L3 otherwise, which is not prefetched).
    if kv.tier_config().is_some_and(|t| t.select > 0) {
        for (seq, blocks) in &l3 {
            kv.prefetch_next(layer, *seq, blocks);
        }
    }
}

/// Blocks a run of one KV head's attention takes (a unit of parallel work at a decode step).
const RUN_BLOCKS: usize = 8;

/// A group of query heads' online softmax over some keys: running max, sum of exp(score - max) and the unnormalised
/// output, per head.
struct GroupPartial {
    m: Vec<f32>,
    s: Vec<f32>,
    acc: Vec<f32>,
}

impl GroupPartial {
    fn new(group: usize, dv: usize) -> Self {
        GroupPartial { m: vec![f32::NEG_INFINITY; group], s: vec![0.0; group], acc: vec![0.0; group * dv] }
    }

    /// Adds another partial result over disjoint keys.
    fn merge(&mut self, o: &GroupPartial) {
        let dv = self.acc.len() / self.m.len();
        for h in 0..self.m.len() {
            let m = self.m[h].max(o.m[h]);
            if m == f32::NEG_INFINITY {
                continue;
            }
            let (wa, wb) = ((self.m[h] - m).exp(), (o.m[h] - m).exp());
            self.s[h] = self.s[h] * wa + o.s[h] * wb;
            let (a, b) = (&mut self.acc[h * dv..(h + 1) * dv], &o.acc[h * dv..(h + 1) * dv]);
            a.iter_mut().zip(b).for_each(|(x, &y)| *x = *x * wa + y * wb);
            self.m[h] = m;
        }
    }

    /// The normalised outputs [group][dv] (zeros for a head that saw no key).
    fn write(&self, out: &mut [f32]) {
        let dv = self.acc.len() / self.m.len();
        for (h, o) in out.chunks_exact_mut(dv).enumerate() {
            let inv = if self.s[h] > 0.0 { 1.0 / self.s[h] } else { 0.0 };
            o.iter_mut().zip(&self.acc[h * dv..]).for_each(|(x, &y)| *x = y * inv);
        }
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
    // Between rankings of every older block (every `rescan` steps), the last one's shortlist and the blocks that
    // have become older since.
    let listed = kv.shortlist(layer, seq, g, pos).map(|list| {
        let older_range = first.max(1)..recent_start;
        let mut blocks: Vec<usize> = list.blocks.into_iter().filter(|b| older_range.contains(b)).collect();
        blocks.extend(list.end.max(older_range.start)..recent_start);
        blocks.sort_unstable();
        blocks.dedup();
        blocks
    });
    let (candidates, full) = match listed {
        Some(blocks) if blocks.len() > budget => (blocks, false),
        _ => (older, true),
    };
    let scores = match tiers.scorer {
        BlockScorer::Keys => key_scan(kv, layer, seq, &candidates, qg, g, shape),
        BlockScorer::Bound => {
            let dk = shape.head_dim;
            let bound = |b: usize| {
                let (lo, hi) = kv.key_summary(layer, seq, b);
                let (lo, hi) = (&lo[g * dk..(g + 1) * dk], &hi[g * dk..(g + 1) * dk]);
                qg.chunks_exact(dk).map(|q| box_bound(q, lo, hi)).fold(f32::NEG_INFINITY, f32::max)
            };
            candidates.iter().map(|&b| bound(b)).collect()
        }
    };
    let mut scored: Vec<(f32, usize)> = scores.into_iter().zip(candidates.iter().copied()).collect();
    let by_score = |a: &(f32, usize), b: &(f32, usize)| b.0.total_cmp(&a.0);
    if full && kv.keeps_shortlists() {
        let n = (budget * SHORTLIST_BUDGETS).min(scored.len());
        scored.select_nth_unstable_by(n - 1, by_score);
        let blocks = scored[..n].iter().map(|&(_, b)| b).collect();
        kv.keep_shortlist(layer, seq, g, Shortlist { pos, end: recent_start, blocks });
        scored.truncate(n);
    }
    scored.select_nth_unstable_by(budget - 1, by_score);
    let mut chosen: Vec<usize> = scored[..budget].iter().map(|&(_, b)| b).collect();
    chosen.sort_unstable();
    BlockPlan { old: sink.into_iter().chain(chosen).collect(), recent }
}

/// Each block's score for KV head `g`: the largest q·k over its keys, as stored (q8_0 in L2, q4_0 in L3, plus the
/// block's K offset and, for keys stored without the key bias, q·the block's mean bias), and over the group's query
/// heads `qg` [group][head_dim]. A bound from a block summary (Quest's
/// element-wise min and max) ranks blocks by how wide their keys spread, not by how well they match, and in real
/// text picks the wrong ones; the keys themselves cost one int8 product a key and query head.
fn key_scan(kv: &KvCache, layer: usize, seq: SeqId, blocks: &[usize], qg: &[f32], g: usize, shape: AttnShape) -> Vec<f32> {
    let dk = shape.head_dim;
    let group = qg.len() / dk;
    let acts = GroupActs::new(qg, dk);
    let bs = kv.cfg.block_size;
    blocks
        .par_iter()
        .with_min_len(8)
        .map_init(
            || (vec![0.0f32; bs * group], vec![0.0f32; group], KeyBiasScores::new(qg, dk), vec![0.0f32; group]),
            |(dots, best, bias, mean_share), &b| {
                let view = kv.block_view(layer, seq, b);
                let (a, a_row) = acts.for_keys(view.k_type);
                let k_head_bytes = view.k_type.row_bytes(dk).unwrap_or(0);
                group_dots(view.k_type, dk, &view.k[g * k_head_bytes..], view.k_row_bytes, bs, a, a_row, group, dots);
                best.fill(f32::NEG_INFINITY);
                for d in dots.chunks_exact(group) {
                    best.iter_mut().zip(d).for_each(|(m, &x)| *m = m.max(x));
                }
                // A block whose keys lack the key bias: its mean share (each key's own share costs as much as the
                // scan itself: a 0.5B decode step at 16K 15% slower).
                if bias.block_mean(view.k_bias, g, mean_share) {
                    best.iter_mut().zip(mean_share.iter()).for_each(|(m, &b)| *m += b);
                }
                let offset = offset_dots(view.k_offset, qg, g, dk);
                best.iter().zip(&offset).map(|(m, o)| m + o).fold(f32::NEG_INFINITY, f32::max)
            },
        )
        .collect()
}

/// Each query head of `qg` [group][dk] dotted with KV head `g`'s part of a block's K offset (zeros without one).
fn offset_dots(k_offset: Option<&[f32]>, qg: &[f32], g: usize, dk: usize) -> Vec<f32> {
    match k_offset {
        Some(o) => qg.chunks_exact(dk).map(|q| dot_lanes(q, &o[g * dk..(g + 1) * dk])).collect(),
        None => vec![0.0; qg.len() / dk],
    }
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

/// The query heads `qg` [group][head_dim] of KV head `g` over the keys of `blocks` (block indices of `seq`) at
/// positions in lo..=pos, each block read in its own precision and once for the whole group: an int8 (or f16)
/// tile of products a block, one dequantized value row a key.
#[allow(clippy::too_many_arguments)]
fn attend_group(
    kv: &KvCache,
    layer: usize,
    seq: SeqId,
    blocks: &[usize],
    (lo, pos): (usize, usize),
    qg: &[f32],
    g: usize,
    shape: AttnShape,
) -> GroupPartial {
    let ops = vec_ops();
    let (dk, dv) = (shape.head_dim, shape.head_dim_v);
    let group = qg.len() / dk;
    let acts = GroupActs::new(qg, dk);
    let mut part = GroupPartial::new(group, dv);
    let mut softmax: Vec<OnlineSoftmax> = (0..group).map(|_| OnlineSoftmax::new()).collect();
    let bs = kv.cfg.block_size;
    let mut dots = vec![0.0f32; bs * group];
    let mut bias = KeyBiasScores::new(qg, dk);
    let mut v_buf = vec![0.0f32; dv];
    let mut add = |scores: &mut dyn Iterator<Item = f32>, v: &[f32], acc: &mut [f32]| {
        for ((sm, score), a) in softmax.iter_mut().zip(scores).zip(acc.chunks_exact_mut(dv)) {
            let (ms, vs) = sm.step(score);
            if ms != 1.0 {
                (ops.scale)(a, ms);
            }
            (ops.axpy)(a, v, vs);
        }
    };
    for &b in blocks {
        let (first, last) = ((b * bs).max(lo), ((b + 1) * bs - 1).min(pos));
        if first > last {
            continue;
        }
        let view = kv.block_view(layer, seq, b);
        let offset = offset_dots(view.k_offset, qg, g, dk);
        let bias = bias.for_block(view.k_bias, g, bs);
        let (a, a_row) = acts.for_keys(view.k_type);
        let k_head_bytes = view.k_type.row_bytes(dk).unwrap_or(0);
        let v_head_bytes = view.v_type.row_bytes(dv).unwrap_or(0);
        let (s0, n) = (first - b * bs, last - first + 1);
        group_dots(view.k_type, dk, &view.k[s0 * view.k_row_bytes + g * k_head_bytes..], view.k_row_bytes, n, a, a_row,
                   group, &mut dots[..n * group]);
        for (r, d) in dots[..n * group].chunks_exact(group).enumerate() {
            let v = &view.v[(s0 + r) * view.v_row_bytes + g * v_head_bytes..][..v_head_bytes];
            let _ = dequantize_row(view.v_type, v, &mut v_buf);
            let v = &v_buf[..];
            let b = |h: usize| bias.as_ref().map_or(0.0, |bias| bias.score(h, s0 + r));
            let mut scores = d.iter().zip(&offset).enumerate().map(|(h, (x, o))| (x + o + b(h)) * shape.scale);
            add(&mut scores, v, &mut part.acc);
        }
    }
    for (h, sm) in softmax.iter().enumerate() {
        (part.m[h], part.s[h]) = (sm.m, sm.s);
    }
    part
}

/// The group's query heads [group][dk] in each dot format the tiers' keys use: f16 (L1) and q8_0 (L2, L3).
struct GroupActs {
    f16: (Vec<u8>, usize),
    q8: (Vec<u8>, usize),
}

impl GroupActs {
    fn new(qg: &[f32], dk: usize) -> Self {
        let acts = |ty: GgmlType| {
            let row = ty.row_bytes(dk).unwrap_or(0);
            let mut a = vec![0u8; row * qg.len() / dk];
            for (q, dst) in qg.chunks_exact(dk).zip(a.chunks_exact_mut(row.max(1))) {
                quantize_act(ty, q, dst);
            }
            (a, row)
        };
        GroupActs { f16: acts(GgmlType::F16), q8: acts(GgmlType::Q8_0) }
    }

    /// The rows (one a query head) and their bytes for keys of `k_type`.
    fn for_keys(&self, k_type: GgmlType) -> (&[u8], usize) {
        let (a, row) = if k_type.act_type() == GgmlType::F16 { &self.f16 } else { &self.q8 };
        (a, *row)
    }
}

/// out[r * group + h] = key row r (of `n`, `stride` bytes apart, type `ty`) · query act row h: the tile kernel
/// where this CPU has one, else one product at a time.
#[allow(clippy::too_many_arguments)]
fn group_dots(ty: GgmlType, dk: usize, keys: &[u8], stride: usize, n: usize, acts: &[u8], act_row: usize, group: usize,
              out: &mut [f32]) {
    match tile_kernel(ty, MatmulPos { w_rows: 1, act_rows: 1, act_row: 0 }) {
        Some(t) => t.run(dk, keys, stride, n, acts, act_row, group, out),
        None => {
            let k_bytes = ty.row_bytes(dk).unwrap_or(0);
            for (r, d) in out.chunks_exact_mut(group).enumerate() {
                let k = &keys[r * stride..][..k_bytes];
                for (h, x) in d.iter_mut().enumerate() {
                    *x = vec_dot(ty, dk, k, &acts[h * act_row..][..act_row]);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests;
