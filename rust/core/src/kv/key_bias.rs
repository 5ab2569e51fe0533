//! A key bias taken out of 4-bit keys before they are quantized, and its share of each score added back exactly.
//!
//! Qwen2's keys are W x + b_k, roped: their stored form holds rope(b_k, pos), a vector turning with the position.
//! Its fast-turning pairs do not average out over a block, so a block's mean key (its K offset) leaves them in every
//! key, where they set the 4-bit steps (docs/journal/kv-q4-keys.md: on Qwen2.5-Coder-0.5B they are most of the
//! q4_0 cache's perplexity cost, and the tiered cache's lost needles). So a q4_0 key row holds k - bias(pos), and
//! attention adds q·bias(pos) to its score.
//!
//! bias(pos) is computed one way on both sides, so what is taken out is exactly what is added back: with p0 the
//! start of pos's block and t = pos - p0, bias(pos) = R(p0) c_t, where c_t = rope(b_k, t) is tabled once per layer
//! (block_size rows) and R(p0) is the rotation by the angles of p0 without RoPE's magnitude factor (c_t carries
//! it; the angles are linear in the position, so this is rope(b_k, pos) up to rounding). A score's share is then
//! q·R(p0) c_t = (R(p0)^T q)·c_t: the query turned back once per block, then one f32 dot product per key.

/// The share of a KV head's bias variation within a block (about the block's mean) that `settle_slow_pairs` keeps
/// per position.
const KEPT_VARIATION: f64 = 0.999;

/// Qwen2's key bias lies almost all in slowly turning rotary pairs, which barely move within a block; only its
/// fast pairs need a value per position. Per KV head of `slots` ([block_size][n_head_kv * head_dim], c_t), the
/// rotary pairs outside the smallest set holding KEPT_VARIATION of the slots' variation about their block mean,
/// and the elements past the rotary ones, take their mean over the block in every slot. bias(pos) then keeps that
/// part constant within a block: a score's share of it is one product a block, and the per-key products run over
/// the fast pairs alone (the GPU's `kbias_dots`). A stored key keeps the rest of the slow pairs' turning, under
/// 0.1% of the variation that was taken out. Returns each KV head's fast pairs, ascending.
pub fn settle_slow_pairs(slots: &mut [f32], n_head_kv: usize, head_dim: usize, rope_dims: usize, neox: bool,
                         block_size: usize) -> Vec<Vec<usize>> {
    let kd = n_head_kv * head_dim;
    assert_eq!(slots.len(), block_size * kd, "a bias row a slot and KV head");
    let half = rope_dims / 2;
    let mut fast_pairs = Vec::with_capacity(n_head_kv);
    for g in 0..n_head_kv {
        let base = g * head_dim;
        let mean: Vec<f64> = (0..head_dim)
            .map(|e| slots.chunks_exact(kd).map(|r| r[base + e] as f64).sum::<f64>() / block_size as f64)
            .collect();
        let spread = |e: usize| slots.chunks_exact(kd).map(|r| (r[base + e] as f64 - mean[e]).powi(2)).sum::<f64>();
        // each pair's squared distance from its block mean, summed over the slots
        let mut variation: Vec<(f64, usize)> = (0..half)
            .map(|i| {
                let (a, b) = pair(i, half, neox);
                (spread(a) + spread(b), i)
            })
            .collect();
        variation.sort_by(|x, y| y.0.total_cmp(&x.0).then(x.1.cmp(&y.1)));
        let total: f64 = variation.iter().map(|v| v.0).sum();
        let mut fast = Vec::new();
        let mut held = 0.0;
        for &(v, i) in &variation {
            if held >= KEPT_VARIATION * total || v == 0.0 {
                break;
            }
            held += v;
            fast.push(i);
        }
        fast.sort_unstable();
        let mut turning = vec![false; head_dim];
        for &i in &fast {
            let (a, b) = pair(i, half, neox);
            (turning[a], turning[b]) = (true, true);
        }
        for e in (0..head_dim).filter(|&e| !turning[e]) {
            slots.chunks_exact_mut(kd).for_each(|r| r[base + e] = mean[e] as f32);
        }
        fast_pairs.push(fast);
    }
    fast_pairs
}

/// The key bias of every layer that has one (and no key norm, which would not let it through unchanged).
pub struct KeyBias {
    kd: usize,
    head_dim: usize,
    neox: bool,
    block_size: usize,
    /// Rotary pairs per head (rope_dims / 2).
    half: usize,
    /// Per layer: None without a bias.
    layers: Vec<Option<LayerBias>>,
}

struct LayerBias {
    /// c_t = rope(b_k, t) for t in 0..block_size: [block_size][n_head_kv * head_dim], unrotated basis.
    slots: Vec<f32>,
    /// The same transposed per KV head, [n_head_kv][head_dim][block_size]: a block's shares for all its slots
    /// come from one `dot_cols` (vectorised across the slots).
    columns: Vec<f32>,
    /// The mean of c_t over the slots, [n_head_kv * head_dim]: R(p0) of it is a block's mean bias.
    mean: Vec<f32>,
    /// Per block start p0 = j * block_size: cos and sin of its rotary angles without the magnitude factor,
    /// [n_blocks][rope_dims / 2]; shared by layers of one RoPE setting.
    starts: std::sync::Arc<Vec<(f32, f32)>>,
}

/// The bias of one layer for the keys of one block (positions p0 .. p0 + block_size).
#[derive(Clone, Copy)]
pub struct BiasTerm<'a> {
    slots: &'a [f32],
    columns: &'a [f32],
    mean: &'a [f32],
    block_size: usize,
    turn: &'a [(f32, f32)],
    kd: usize,
    head_dim: usize,
    neox: bool,
}

/// Where rotary pair i's two elements sit in a head.
#[inline(always)]
pub fn pair(i: usize, half: usize, neox: bool) -> (usize, usize) {
    if neox {
        (i, i + half)
    } else {
        (2 * i, 2 * i + 1)
    }
}

/// The mean of c_t over a block's slots (`slots` [block_size][kd]), [kd]: R(p0) of it is a block's mean bias (the
/// keys scorer's share for a block whose keys lack the bias; the CUDA backend's table too).
pub fn slot_mean(slots: &[f32], kd: usize, block_size: usize) -> Vec<f32> {
    let mut mean = vec![0.0f32; kd];
    for row in slots.chunks_exact(kd) {
        mean.iter_mut().zip(row).for_each(|(m, &x)| *m += x / block_size as f32);
    }
    mean
}

/// One layer's key bias as `KeyBias::new` takes it, roped by the model's RoPE (`Model::key_bias`).
pub struct LayerBiasTables {
    /// rope(b_k, t) for t in 0..block_size: [block_size][n_head_kv * head_dim].
    pub slots: Vec<f32>,
    /// Per block start j * block_size (j up to the cache's blocks): cos and sin of its rotary angles without
    /// RoPE's magnitude factor, [n_blocks][rope_dims / 2]; layers of one RoPE setting may share one.
    pub starts: std::sync::Arc<Vec<(f32, f32)>>,
}

impl KeyBias {
    /// `layers[l]`: layer l's tables, None without a bias. None when no layer has one.
    pub fn new(layers: Vec<Option<LayerBiasTables>>, n_head_kv: usize, head_dim: usize, rope_dims: usize, neox: bool,
               block_size: usize) -> Option<KeyBias> {
        if layers.iter().all(Option::is_none) || block_size == 0 {
            return None;
        }
        let kd = n_head_kv * head_dim;
        let layers = layers
            .into_iter()
            .map(|l| {
                let l = l?;
                assert_eq!(l.slots.len(), block_size * kd, "a bias row a slot and KV head");
                let mut columns = vec![0.0f32; l.slots.len()];
                for (t, row) in l.slots.chunks_exact(kd).enumerate() {
                    for (e, &x) in row.iter().enumerate() {
                        columns[e * block_size + t] = x; // (e = g * head_dim + d)
                    }
                }
                let mean = slot_mean(&l.slots, kd, block_size);
                Some(LayerBias { slots: l.slots, columns, mean, starts: l.starts })
            })
            .collect();
        Some(KeyBias { kd, head_dim, neox, block_size, half: rope_dims / 2, layers })
    }

    /// Layer `layer`'s bias for the block at `block_index` of a sequence; None if the layer has none (or the
    /// block lies past the tabled positions, which the cache's n_ctx does not allow).
    pub fn term(&self, layer: usize, block_index: usize) -> Option<BiasTerm<'_>> {
        let l = self.layers.get(layer)?.as_ref()?;
        let turn = l.starts.get(block_index * self.half..(block_index + 1) * self.half)?;
        Some(BiasTerm {
            slots: &l.slots,
            columns: &l.columns,
            mean: &l.mean,
            block_size: self.block_size,
            turn,
            kd: self.kd,
            head_dim: self.head_dim,
            neox: self.neox,
        })
    }

    /// Positions a block of the tables holds (the cache's block size they were made for).
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Whether `layer` has a bias to take out.
    pub fn has(&self, layer: usize) -> bool {
        self.layers.get(layer).is_some_and(Option::is_some)
    }
}

impl BiasTerm<'_> {
    /// `out` = R(p0)^T q for one unrotated query head: then q·bias(p0 + t) of KV head g for every slot t
    /// of the block is `shares(out, g, ..)`.
    pub fn turn_query(&self, q: &[f32], out: &mut [f32]) {
        out.copy_from_slice(q);
        let half = self.turn.len();
        for (i, &(c, s)) in self.turn.iter().enumerate() {
            let (a, b) = pair(i, half, self.neox);
            out[a] = q[a] * c + q[b] * s;
            out[b] = q[b] * c - q[a] * s;
        }
    }

    /// turned·c_t for KV head g and every slot t of the block into `out` [block_size].
    pub fn shares(&self, turned: &[f32], g: usize, out: &mut [f32]) {
        let cols = &self.columns[g * self.head_dim * self.block_size..][..self.head_dim * self.block_size];
        (crate::quant::simd::vec_ops().dot_cols)(turned, cols, out);
    }

    /// turned·(the mean of c_t) for KV head g: the block's mean share, q·(its mean bias).
    pub fn mean_share(&self, turned: &[f32], g: usize) -> f32 {
        crate::quant::math::dot_lanes(turned, &self.mean[g * self.head_dim..(g + 1) * self.head_dim])
    }

    /// bias(p0 + t) of KV head g into `out` [head_dim] in the basis rotated rows are stored in
    /// (`rotation::rotate`): what a stored key at slot t lacks.
    pub fn rotated_bias(&self, t: usize, g: usize, out: &mut [f32]) {
        self.bias(t, g, out);
        crate::kv::rotation::rotate(out, self.head_dim);
    }

    /// bias(p0 + t) of KV head g into `out` [head_dim], unrotated: R(p0) c_t.
    pub fn bias(&self, t: usize, g: usize, out: &mut [f32]) {
        let c = &self.slots[t * self.kd + g * self.head_dim..][..self.head_dim];
        out.copy_from_slice(c);
        let half = self.turn.len();
        for (i, &(co, s)) in self.turn.iter().enumerate() {
            let (a, b) = pair(i, half, self.neox);
            out[a] = c[a] * co - c[b] * s;
            out[b] = c[a] * s + c[b] * co;
        }
    }
}

#[cfg(test)]
mod tests;
