//! Per-channel key scales for a KV cache that stores 4-bit keys (q4_0, or the tiered cache's L3), made from the
//! weights at load.
//!
//! A key's 4-bit error reaches a score as q·Δk, so it costs most in the channels the queries weigh most, while the
//! Hadamard rotation spreads it evenly over all channels. Keys stored as s ⊙ k and queries read as q / s leave every
//! score unchanged and move the error towards the channels the queries barely read: for isotropic error the
//! weighted error Σ q_i² Δk_i² is least at s_i² ∝ rms(q_i) / rms(k_i). Simulated on Qwen2.5-Coder-0.5B
//! (docs/journal/kv-q4-keys.md), the scales cut the q4_0 cache's KL by a third with its key bias out; on SmolLM2,
//! whose channels are more even, they round to 1 almost everywhere.
//!
//! The RMS of each channel is estimated from the weights alone, for an isotropic input after the layer's norm:
//! the squared row norms of W ⊙ attn_norm (the query bias included; the key bias is left out, as q4_0 keys store
//! k less their bias). A GQA group's query heads are pooled, and each rotary pair's two channels share one scale so
//! that the scaling commutes with RoPE (it may be applied before or after it, and to the key bias alike). Scales
//! are powers of two, so s ⊙ k and q / s are exact in floating point and the f16 tier loses nothing by them.

/// The largest |log2 s|: a channel whose weights are all but zero must not set an extreme scale.
const MAX_EXP: i32 = 8;

/// Per layer, [n_head_kv * head_dim] scales (None: a layer left unscaled, every scale 1 or a norm in the way).
pub struct KeyScales {
    n_head_kv: usize,
    head_dim: usize,
    layers: Vec<Option<Vec<f32>>>,
}

impl KeyScales {
    pub fn new(n_head_kv: usize, head_dim: usize, layers: Vec<Option<Vec<f32>>>) -> KeyScales {
        assert!(layers.iter().flatten().all(|s| s.len() == n_head_kv * head_dim), "a scale a key channel");
        KeyScales { n_head_kv, head_dim, layers }
    }

    pub fn layer(&self, il: usize) -> Option<&[f32]> {
        self.layers.get(il).and_then(|s| s.as_deref())
    }

    pub fn n_layer(&self) -> usize {
        self.layers.len()
    }

    /// Whether any layer is scaled.
    pub fn any(&self) -> bool {
        self.layers.iter().any(Option::is_some)
    }

    /// Rows of keys (`k`, [n][n_head_kv * head_dim]) times layer il's scales, and rows of queries (`q`,
    /// [n][n_head * head_dim]) divided by their KV head's (exact: powers of two). No-op for an unscaled layer.
    pub fn apply(&self, il: usize, q: &mut [f32], k: &mut [f32]) {
        let Some(s) = self.layer(il) else { return };
        let hd = self.head_dim;
        let kd = self.n_head_kv * hd;
        for row in k.chunks_exact_mut(kd) {
            row.iter_mut().zip(s).for_each(|(x, m)| *x *= m);
        }
        let n_rows = k.len() / kd;
        if n_rows == 0 {
            return;
        }
        let q_dim = q.len() / n_rows;
        let group = q_dim / kd;
        for row in q.chunks_exact_mut(q_dim) {
            for (h, head) in row.chunks_exact_mut(hd).enumerate() {
                let g = h / group;
                head.iter_mut().zip(&s[g * hd..(g + 1) * hd]).for_each(|(x, m)| *x /= m);
            }
        }
    }
}

/// Layer scales from the mean squared activation of each query channel (`eq`, [n_head * head_dim]) and key channel
/// (`ek`, [n_head_kv * head_dim]): s = (eq / ek)^(1/4) with the group's query heads and each rotary pair pooled,
/// each KV head's scales divided by their geometric mean, rounded to a power of two. None where every scale is 1.
pub fn layer_scales(eq: &[f64], ek: &[f64], n_head_kv: usize, head_dim: usize, rope_dims: usize, neox: bool)
                    -> Option<Vec<f32>> {
    let kd = n_head_kv * head_dim;
    assert!(ek.len() == kd && eq.len() % kd == 0, "energies of whole heads");
    let group = eq.len() / kd;
    let half = rope_dims / 2;
    let mut out = vec![1.0f32; kd];
    for g in 0..n_head_kv {
        let q_energy = |e: usize| (0..group).map(|j| eq[((g * group + j) * head_dim) + e]).sum::<f64>() / group as f64;
        let k_energy = |e: usize| ek[g * head_dim + e];
        let mut ratio: Vec<f64> = (0..head_dim).map(|e| q_energy(e) / k_energy(e).max(f64::MIN_POSITIVE)).collect();
        for i in 0..half {
            let (a, b) = super::key_bias::pair(i, half, neox);
            let qe = q_energy(a) + q_energy(b);
            let ke = (k_energy(a) + k_energy(b)).max(f64::MIN_POSITIVE);
            ratio[a] = qe / ke;
            ratio[b] = qe / ke;
        }
        // log2 s = log2(ratio) / 4, less the head's mean (a common factor changes nothing); bounded first, so that
        // a dead channel's extreme ratio does not move the mean the other channels are set against
        let bound = MAX_EXP as f64;
        let logs: Vec<f64> =
            ratio.iter().map(|r| (r.max(f64::MIN_POSITIVE).log2() / 4.0).clamp(-bound, bound)).collect();
        let mean = logs.iter().sum::<f64>() / head_dim as f64;
        for (e, l) in logs.iter().enumerate() {
            let exp = ((l - mean).round() as i32).clamp(-MAX_EXP, MAX_EXP);
            out[g * head_dim + e] = (exp as f32).exp2();
        }
    }
    out.iter().any(|&s| s != 1.0).then_some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scales_follow_the_query_to_key_energy_ratio_pooled_by_pair_and_group() {
        // one KV head of 4 channels (2 rotary pairs, neox: (0, 2) and (1, 3)), two query heads
        let ek = [1.0, 1.0, 1.0, 1.0];
        // pair (0, 2): query energy 256 (ratio 256 -> log2 s = 2); pair (1, 3): 1 (log2 s = 0); mean 1
        let eq = [256.0, 1.0, 256.0, 1.0, 256.0, 1.0, 256.0, 1.0];
        let s = layer_scales(&eq, &ek, 1, 4, 4, true).expect("scaled");
        assert_eq!(s, vec![2.0, 0.5, 2.0, 0.5]);
        // the same pairs, llama's (0, 1) and (2, 3): channel 0 and 1 pooled
        let s = layer_scales(&eq, &ek, 1, 4, 4, false);
        assert_eq!(s, None, "every pair pools to the same ratio");
    }

    #[test]
    fn an_even_layer_and_a_dead_channel() {
        assert_eq!(layer_scales(&[3.0; 8], &[3.0; 8], 2, 4, 4, true), None);
        // pair (0, 2) has no key energy: its scale is bounded, and pair (1, 3)'s is set against a bounded mean
        let s = layer_scales(&[1.0; 4], &[0.0, 1.0, 0.0, 1.0], 1, 4, 4, true).expect("scaled");
        assert_eq!(s, vec![16.0, 1.0 / 16.0, 16.0, 1.0 / 16.0]);
    }

    #[test]
    fn scaled_scores_are_exactly_the_same() {
        let ks = KeyScales::new(1, 4, vec![Some(vec![4.0, 0.25, 4.0, 0.25])]);
        let (q0, k0) = (vec![0.3f32, -1.7, 2.5, 0.01, 1.0, 2.0, 3.0, 4.0], vec![1.1f32, 0.2, -0.7, 5.0]);
        let (mut q, mut k) = (q0.clone(), k0.clone());
        ks.apply(0, &mut q, &mut k);
        assert_eq!(k, vec![4.4, 0.05, -2.8, 1.25]);
        for h in 0..2 {
            let dot = |a: &[f32], b: &[f32]| a.iter().zip(b).map(|(x, y)| x * y).sum::<f32>();
            assert_eq!(dot(&q[h * 4..h * 4 + 4], &k), dot(&q0[h * 4..h * 4 + 4], &k0));
        }
    }
}
