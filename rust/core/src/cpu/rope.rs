//! Rotary position embedding as ggml's CPU ROPE computes it (ggml-cpu/ops.cpp `ggml_rope_cache_init`,
//! `rope_yarn`, `rotate_pairs`): angles by repeated f32 multiplication, YaRN's ramp between interpolated and
//! extrapolated angles, its magnitude factor on cos and sin, and the rotations with the FMAs gcc emits for ggml's C.
//! Plain RoPE and linear scaling are the case ext_factor = 0, attn_factor = 1, where every step below reduces to
//! `cos(freq_scale * theta)` exactly.

use crate::model::RopeYarn;

/// One layer's RoPE constants, derived once from its base and scale and the model's YaRN settings.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RopeParams {
    /// base^(-2 / rope_dims): the ratio between consecutive pairs' angles.
    pub theta_scale: f32,
    /// Position scaling (1 / the context scale factor); 1.0 = none.
    pub freq_scale: f32,
    /// YaRN's mix of extrapolated angles into the interpolated ones (0: plain interpolation).
    pub ext_factor: f32,
    /// The pairs below corr_dims[0] keep their extrapolated angle, those above corr_dims[1] the interpolated one.
    pub corr_dims: [f32; 2],
    /// Multiplies cos and sin: attn_factor, times YaRN's 1 + 0.1 ln(1 / freq_scale) when ext_factor != 0.
    pub mscale: f32,
}

/// ggml_rope_yarn_corr_dim: the pair whose wavelength makes `n_rot` turns over the original context.
fn corr_dim(n_dims: usize, n_ctx_orig: usize, n_rot: f32, base: f32) -> f32 {
    n_dims as f32 * (n_ctx_orig as f32 / (n_rot * 2.0 * std::f32::consts::PI)).ln() / (2.0 * base.ln())
}

/// ggml_rope_yarn_corr_dims: the first and last pair of YaRN's ramp, clamped to [0, n_dims - 1].
pub fn corr_dims(n_dims: usize, n_ctx_orig: usize, base: f32, beta_fast: f32, beta_slow: f32) -> [f32; 2] {
    let start = corr_dim(n_dims, n_ctx_orig, beta_fast, base).floor();
    let end = corr_dim(n_dims, n_ctx_orig, beta_slow, base).ceil();
    // (ggml's MAX/MIN macros: a NaN bound compares false and takes the second operand, as here)
    let last = (n_dims - 1) as f32;
    [if 0.0 > start { 0.0 } else { start }, if last < end { last } else { end }]
}

/// llama.cpp's context setup (llama-context.cpp): with YaRN mixing on, the attention factor is set to YaRN's
/// magnitude 1 + 0.1 ln(scale) and divided by the same factor, which ggml's rope_yarn multiplies in again: cos and
/// sin carry it once (a given --yarn-attn-factor is replaced, as there), times the model's
/// `rope.scaling.attn_factor`. llama.cpp's library is built without FMA contraction (only its CPU backend gets
/// -march=native), so these are plain multiplies and adds.
pub fn yarn_attn_factor(freq_scale: f32, ext_factor: f32, attn_factor: f32, rope_attn_factor: f32) -> f32 {
    let mut attn = attn_factor;
    if ext_factor != 0.0 {
        let factor = 1.0 / freq_scale;
        let get_mscale = |scale: f32, mscale: f32| if scale <= 1.0 { 1.0 } else { 0.1 * mscale * scale.ln() + 1.0 };
        attn = get_mscale(factor, 1.0);
        attn *= 1.0 / (1.0 + 0.1 * factor.ln());
    }
    attn * rope_attn_factor
}

impl RopeParams {
    pub fn new(base: f32, freq_scale: f32, rope_dims: usize, yarn: &RopeYarn) -> RopeParams {
        let ext_factor = yarn.ext_factor;
        let mut mscale = yarn.attn_factor;
        if ext_factor != 0.0 {
            // rope_yarn's `mscale *= 1.0f + 0.1f * logf(1.0f / freq_scale)`, contracted by gcc.
            mscale *= 0.1f32.mul_add((1.0 / freq_scale).ln(), 1.0);
        }
        RopeParams {
            theta_scale: base.powf(-2.0 / rope_dims as f32),
            freq_scale,
            ext_factor,
            corr_dims: corr_dims(rope_dims, yarn.n_ctx_orig, base, yarn.beta_fast, yarn.beta_slow),
            mscale,
        }
    }
}

/// rope_yarn_ramp for pair i (ggml passes the dimension index 2i and halves it): 1 below the first correction
/// dimension, 0 past the last, linear between.
fn ramp(low: f32, high: f32, pair: usize) -> f32 {
    // (ggml's MAX/MIN macros, spelled out: a NaN compares false the same way)
    let span = high - low;
    let y = (pair as f32 - low) / if 0.001 > span { 0.001 } else { span };
    let y = if 0.0 > y { 0.0 } else { y };
    1.0 - if 1.0 < y { 1.0 } else { y }
}

/// cos/sin of the rotation angles of one position: [rope_dims / 2] pairs.
pub fn rope_angles(pos: usize, p: &RopeParams, rope_dims: usize, cache: &mut Vec<(f32, f32)>) {
    cache.clear();
    let mut theta_extrap = pos as f32;
    for i in 0..rope_dims / 2 {
        let theta_interp = p.freq_scale * theta_extrap;
        let theta = if p.ext_factor != 0.0 {
            let ramp_mix = ramp(p.corr_dims[0], p.corr_dims[1], i) * p.ext_factor;
            // gcc contracts `theta_interp * (1 - ramp_mix) + theta_extrap * ramp_mix` into this FMA.
            theta_interp.mul_add(1.0 - ramp_mix, theta_extrap * ramp_mix)
        } else {
            theta_interp
        };
        cache.push((theta.cos() * p.mscale, theta.sin() * p.mscale));
        theta_extrap *= p.theta_scale;
    }
}

/// Rotate every head of one row in place. `neox` pairs (i, i + rope_dims/2); otherwise (2i, 2i + 1).
pub fn rope_row(row: &mut [f32], head_dim: usize, angles: &[(f32, f32)], neox: bool) {
    let half = angles.len();
    for head in row.chunks_exact_mut(head_dim) {
        for (i, &(c, s)) in angles.iter().enumerate() {
            let (a, b) = if neox { (i, i + half) } else { (2 * i, 2 * i + 1) };
            let (x0, x1) = (head[a], head[b]);
            // gcc contracts ggml's `x0*cos - x1*sin` / `x0*sin + x1*cos` into these FMAs (checked bit for bit
            // against llama.cpp's ROPE output).
            head[a] = x0.mul_add(c, -(x1 * s));
            head[b] = x0.mul_add(s, x1 * c);
        }
    }
}

/// A key bias roped at each slot of a block starting at position 0: rope(b, t) for t in 0..block_size,
/// [block_size][b.len()] (`kv::key_bias`'s c_t).
pub fn roped_bias_slots(bias: &[f32], p: &RopeParams, head_dim: usize, rope_dims: usize, neox: bool, block_size: usize) -> Vec<f32> {
    let mut angles = Vec::new();
    let mut slots = Vec::with_capacity(block_size * bias.len());
    for t in 0..block_size {
        let mut c = bias.to_vec();
        rope_angles(t, p, rope_dims, &mut angles);
        rope_row(&mut c, head_dim, &angles, neox);
        slots.extend(c);
    }
    slots
}

/// cos and sin of the rotary angles of each block start j * block_size below n_ctx, without the magnitude factor
/// (the roped bias rows carry it): [n_blocks][rope_dims / 2] (`kv::key_bias`'s R(p0)).
pub fn block_start_turns(p: &RopeParams, rope_dims: usize, block_size: usize, n_ctx: usize) -> Vec<(f32, f32)> {
    let n_blocks = n_ctx.div_ceil(block_size.max(1)).max(1);
    let mut angles = Vec::new();
    let mut t = Vec::with_capacity(n_blocks * rope_dims / 2);
    for j in 0..n_blocks {
        rope_angles(j * block_size, p, rope_dims, &mut angles);
        t.extend(angles.iter().map(|&(c, s)| (c / p.mscale, s / p.mscale)));
    }
    t
}

#[cfg(test)]
mod tests;
