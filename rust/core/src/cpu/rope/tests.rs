use super::*;

/// ggml-cpu/ops.cpp's rope_yarn_ramp, rope_yarn and ggml_rope_cache_init transcribed line by line (ramp and
/// magnitude evaluated per pair with ggml's dimension index i0 = 2 * pair, as there), with the contractions gcc
/// makes in that file: the reference the precomputed `RopeParams` path must equal bit for bit. (i: pair, cos, sin)
fn ggml_cache(pos: i64, base: f32, freq_scale: f32, n_dims: usize, yarn: &RopeYarn) -> Vec<(f32, f32)> {
    let rope_yarn_ramp = |low: f32, high: f32, i0: i32| -> f32 {
        let y = ((i0 / 2) as f32 - low) / if 0.001f32 > high - low { 0.001 } else { high - low };
        let max0 = if 0.0 > y { 0.0 } else { y };
        1.0 - if 1.0 < max0 { 1.0 } else { max0 }
    };
    let corr = corr_dims(n_dims, yarn.n_ctx_orig, base, yarn.beta_fast, yarn.beta_slow);
    let theta_scale = base.powf(-2.0 / n_dims as f32);
    let mut theta = pos as f32;
    let mut cache = Vec::new();
    for i0 in (0..n_dims as i32).step_by(2) {
        let theta_extrap = theta;
        let theta_interp = freq_scale * theta_extrap;
        let mut th = theta_interp;
        let mut mscale = yarn.attn_factor;
        if yarn.ext_factor != 0.0 {
            let ramp_mix = rope_yarn_ramp(corr[0], corr[1], i0) * yarn.ext_factor;
            th = theta_interp.mul_add(1.0 - ramp_mix, theta_extrap * ramp_mix);
            mscale *= 0.1f32.mul_add((1.0 / freq_scale).ln(), 1.0);
        }
        cache.push((th.cos() * mscale, th.sin() * mscale));
        theta *= theta_scale;
    }
    cache
}

/// YaRN as `--rope-scaling yarn --rope-scale <scale> --yarn-orig-ctx <n_ctx_orig>` sets it.
fn yarn(scale: f32, n_ctx_orig: usize) -> (f32, RopeYarn) {
    let freq_scale = 1.0 / scale;
    let attn_factor = yarn_attn_factor(freq_scale, 1.0, 1.0, 1.0);
    (freq_scale, RopeYarn { ext_factor: 1.0, attn_factor, beta_fast: 32.0, beta_slow: 1.0, n_ctx_orig })
}

fn bits(cache: &[(f32, f32)]) -> Vec<(u32, u32)> {
    cache.iter().map(|&(c, s)| (c.to_bits(), s.to_bits())).collect()
}

#[test]
fn rope_rotates_pairs_by_position() {
    let mut angles = Vec::new();
    let p = RopeParams::new(10000.0, 1.0, 4, &RopeYarn::default());
    rope_angles(1, &p, 4, &mut angles);
    let mut a = [1.0f32, 0.0, 1.0, 0.0];
    rope_row(&mut a, 4, &angles, false);
    assert!((a[0] - 1f32.cos()).abs() < 1e-6 && (a[1] - 1f32.sin()).abs() < 1e-6);
    let mut b = [1.0f32, 1.0, 0.0, 0.0];
    rope_row(&mut b, 4, &angles, true);
    assert!((b[0] - 1f32.cos()).abs() < 1e-6 && (b[2] - 1f32.sin()).abs() < 1e-6);
    assert!((b[3] - 0.01f32.sin()).abs() < 1e-6, "second pair turns by base^(-2/4)");
}

#[test]
fn plain_and_linear_rope_are_cos_of_the_scaled_angle_exactly() {
    // Without YaRN nothing is mixed or scaled: the angles the engine always computed, to the bit.
    for freq_scale in [1.0f32, 0.5, 0.25] {
        let p = RopeParams::new(1e6, freq_scale, 64, &RopeYarn::default());
        assert_eq!(p.mscale, 1.0);
        let mut angles = Vec::new();
        rope_angles(12345, &p, 64, &mut angles);
        let mut theta = 12345f32;
        for &(c, s) in &angles {
            let t = freq_scale * theta;
            assert_eq!((c.to_bits(), s.to_bits()), (t.cos().to_bits(), t.sin().to_bits()));
            theta *= p.theta_scale;
        }
    }
}

#[test]
fn yarn_angles_equal_ggml_formula_per_pair() {
    let mut angles = Vec::new();
    for (base, dims, scale, n_ctx_orig) in
        [(1e6f32, 64usize, 4.0f32, 32768usize), (1e5, 64, 4.0, 8192), (1e6, 128, 8.0, 32768), (1e4, 64, 1.0, 4096)]
    {
        for ext_factor in [1.0f32, 0.5] {
            let (freq_scale, mut y) = yarn(scale, n_ctx_orig);
            y.ext_factor = ext_factor;
            let p = RopeParams::new(base, freq_scale, dims, &y);
            for pos in [0usize, 1, 17, 4095, 32767, 131071, 163839] {
                rope_angles(pos, &p, dims, &mut angles);
                let want = ggml_cache(pos as i64, base, freq_scale, dims, &y);
                assert_eq!(bits(&angles), bits(&want), "base {base} dims {dims} scale {scale} pos {pos}");
            }
        }
    }
}

// cos and sin of Qwen2.5's 32 pairs (base 1e6) at position 100307 with freq_scale 0.25, ext_factor 1, attn_factor
// 1, n_ctx_orig 32768, betas 32 / 1: the output of ggml_rope_ext (NeoX) of llama.cpp's CPU backend (the
// llama-cpp-python 0.3.36 build, -march=native, AVX2) on a row of ones and zeros. They pin the FMAs gcc makes of
// rope_yarn: computed without them, 51 of 1,600 such values differ.
const GGML_COS: [u32; 32] = [
    0xbf327a2f, 0x3f8ce598, 0x3f5d17f0, 0xbe8efb4c, 0x3f74b546, 0xbf8e3880, 0x3f1f8f9c, 0xbf7855f1,
    0x3f17ef5d, 0x3f0fb8dc, 0x3f5e615f, 0x3cfff484, 0xbe9b8b56, 0xbf7e2ce3, 0xbf64289c, 0xbf5fc368,
    0xbedf3b96, 0x3eeca171, 0x3ec5a385, 0xbf8c83e5, 0xbe91f2e9, 0xbf8d5d65, 0xbeb1ac4d, 0x3ec7b46d,
    0x3f4c8ab9, 0x3f7dafdf, 0x3f89abd5, 0x3f8e5257, 0x3f904c3f, 0x3f912247, 0x3f917ca9, 0x3f91a2cb,
];
const GGML_SIN: [u32; 32] = [
    0x3f6675bd, 0xbe951b71, 0x3f3df4ef, 0xbf8d4b09, 0xbf1e60fd, 0xbe7ed75d, 0x3f73f05f, 0x3f18a0c1,
    0xbf78c2a0, 0xbf7d980b, 0xbf3c72da, 0x3f91b08f, 0x3f8c7612, 0xbf0eb0fa, 0x3f3568f1, 0x3f3acdf0,
    0x3f86a2e2, 0x3f8532d3, 0xbf891d1a, 0x3e9ac311, 0xbf8d1a77, 0x3e8dd7d9, 0x3f8acf9f, 0x3f88ed2c,
    0x3f4fac92, 0x3f0f8ec8, 0x3ebf5648, 0x3e7b357a, 0x3e23e00f, 0x3dd53e6c, 0x3d8a96b2, 0x3d340e22,
];

#[test]
fn yarn_angles_equal_llama_cpp_output() {
    let y = RopeYarn { ext_factor: 1.0, attn_factor: 1.0, beta_fast: 32.0, beta_slow: 1.0, n_ctx_orig: 32768 };
    let p = RopeParams::new(1e6, 0.25, 64, &y);
    let mut angles = Vec::new();
    rope_angles(100307, &p, 64, &mut angles);
    let want: Vec<(u32, u32)> = GGML_COS.iter().copied().zip(GGML_SIN.iter().copied()).collect();
    assert_eq!(bits(&angles), want);
    // NeoX rotation of (1, 0) pairs gives back exactly cos and sin, as ggml's output holds them.
    let mut row: Vec<f32> = (0..64).map(|i| if i < 32 { 1.0 } else { 0.0 }).collect();
    rope_row(&mut row, 64, &angles, true);
    assert_eq!(row[..32].iter().map(|v| v.to_bits()).collect::<Vec<_>>(), GGML_COS);
    assert_eq!(row[32..].iter().map(|v| v.to_bits()).collect::<Vec<_>>(), GGML_SIN);
}

#[test]
fn corr_dims_and_attention_factor() {
    // Qwen2.5 (64 rotated dims, base 1e6) over 32,768 trained positions: 32 turns at pair 11.8, one turn at 19.8:
    // the pairs 11..20 ramp, those below keep their trained angles, those above are interpolated.
    assert_eq!(corr_dims(64, 32768, 1e6, 32.0, 1.0), [11.0, 20.0]);
    let f64_dim = |n_rot: f64| 64.0 * (32768.0 / (n_rot * 2.0 * std::f64::consts::PI)).ln() / (2.0 * 1e6f64.ln());
    assert!((f64_dim(32.0) - 11.80).abs() < 1e-2 && (f64_dim(1.0) - 19.82).abs() < 1e-2);
    // Clamped to the dimensions there are (ggml clamps the start below only, the end above only).
    assert_eq!(corr_dims(64, 1 << 30, 10.0, 32.0, 1.0)[1], 63.0);
    assert_eq!(corr_dims(64, 8, 1e6, 32.0, 1.0)[0], 0.0);
    // llama.cpp sets the attention factor to YaRN's magnitude and divides out the one rope_yarn multiplies in
    // again: that factor is 1 within rounding, and cos and sin carry 1 + 0.1 ln(scale) once.
    for scale in [1.0f32, 2.0, 4.0, 5.0, 8.0, 32.0] {
        let (freq_scale, y) = yarn(scale, 32768);
        assert!((y.attn_factor - 1.0).abs() <= f32::EPSILON, "scale {scale}: attn_factor {}", y.attn_factor);
        let p = RopeParams::new(1e6, freq_scale, 64, &y);
        let want = 1.0 + 0.1 * (scale as f64).ln();
        assert!((p.mscale as f64 - want).abs() <= 2e-7, "scale {scale}: mscale {}", p.mscale);
    }
    // Without YaRN mixing the factors pass through.
    assert_eq!(yarn_attn_factor(0.25, 0.0, 0.9, 1.0), 0.9);
    assert_eq!(yarn_attn_factor(0.25, 0.0, 1.0, 1.5), 1.5);
}
