//! Scalar math shared by the layers above: the reference kernels, the SIMD kernels (`simd`) and the CPU ops
//! (`crate::cpu::ops`). It depends on nothing else in the crate, so every layer may import it.
//!
//! - [`ggml_expf`]: ggml's exp, under the SiLU and the softmax (scalar `simd::vecops` and the AVX2 tails);
//! - llama.cpp's rounding and max scans of the quantizers ([`nearest_int`], [`abs_max`], [`signed_abs_max`]);
//! - the exact int8 dot product inside the K-quant dot products ([`IntDot`], [`ScalarDot`]);
//! - an f32 dot product in vector-friendly running sums ([`dot_lanes`]).

/// exp(x) as ggml's vectorised `ggml_v_expf` computes it (range reduction to 2^n * e^b, degree-5 polynomial),
/// one element at a time with the same fused multiply-adds. llama.cpp evaluates SiLU through it on every x86
/// machine with AVX2, and the SmolLM2/Qwen models amplify a last-bit difference here into a different token.
#[inline]
pub(crate) fn ggml_expf(x: f32) -> f32 {
    let c = f32::from_bits;
    let r = c(0x4b40_0000); // 0x1.8p23
    let z = x.mul_add(c(0x3fb8_aa3b), r); // x * log2(e) + r: n rounded into the low mantissa bits
    let n = z - r;
    let b = (-n).mul_add(c(0x35bf_be8e), (-n).mul_add(c(0x3f31_7200), x)); // x - n * ln(2), in two parts
    let e = z.to_bits() << 23;
    let k = c(e.wrapping_add(1.0f32.to_bits()));
    let u = b * b;
    let j = c(0x3c07_2010)
        .mul_add(b, c(0x3d2b_9f17))
        .mul_add(u, c(0x3e2a_af33).mul_add(b, c(0x3eff_fedb)))
        .mul_add(u, c(0x3f7f_fff6) * b);
    if n.abs() <= 126.0 {
        return j.mul_add(k, k);
    }
    // |n| > 126: scale in two steps so 2^n neither overflows nor flushes early.
    let g: u32 = if n <= 0.0 { 0x8200_0000 } else { 0 };
    let s1 = c(g.wrapping_add(0x7f00_0000));
    let s2 = c(e.wrapping_sub(g));
    if n.abs() > 192.0 {
        s1 * s1
    } else {
        s2.mul_add(j, s2) * s1
    }
}

/// exp(x) as the `ggml_v_expf` of llama.cpp's AVX-512 build (`__AVX512F__ && __AVX512DQ__`) computes it: the
/// same range reduction as [`ggml_expf`], but the polynomial ends in `fma(c0, b, 1)` and the result is
/// `vscalefps(j, n)` (j * 2^n rounded once), 0 or infinity past |n| > 192. One element at a time with the same
/// fused multiply-adds.
pub(crate) fn ggml_expf_avx512(x: f32) -> f32 {
    let c = f32::from_bits;
    let r = c(0x4b40_0000);
    let z = x.mul_add(c(0x3fb8_aa3b), r);
    let n = z - r;
    let b = (-n).mul_add(c(0x35bf_be8e), (-n).mul_add(c(0x3f31_7200), x));
    if n.abs() > 192.0 {
        return if n <= 0.0 { 0.0 } else { f32::INFINITY };
    }
    let u = b * b;
    let j = c(0x3c07_2010)
        .mul_add(b, c(0x3d2b_9f17))
        .mul_add(u, c(0x3e2a_af33).mul_add(b, c(0x3eff_fedb)))
        .mul_add(u, c(0x3f7f_fff6).mul_add(b, 1.0));
    // j * 2^n is exact in f64 (|n| <= 192); the conversion rounds it once, as vscalefps does.
    (j as f64 * 2f64.powi(n as i32)) as f32
}

/// llama.cpp's `nearest_int`: round to nearest, ties to even, by adding 1.5 * 2^23 and reading the mantissa.
/// Valid for |v| <= 2^22 (the quantizers only use it on values within +-128); no libm call.
#[inline(always)]
pub(super) fn nearest_int(v: f32) -> i32 {
    let biased = v + 12_582_912.0;
    (biased.to_bits() & 0x007f_ffff) as i32 - 0x0040_0000
}

/// Largest |v| of `x` (0 for an empty slice; NaNs are skipped), in eight independent lanes so the compiler
/// vectorizes it. Max is exact, so the grouping does not change the result.
#[inline(always)]
pub(super) fn abs_max(x: &[f32]) -> f32 {
    #[inline(always)]
    fn max(m: f32, v: f32) -> f32 {
        if v > m {
            v
        } else {
            m
        }
    }
    let (groups, tail) = x.as_chunks::<8>();
    let mut lanes = [0.0f32; 8];
    for g in groups {
        for (m, v) in lanes.iter_mut().zip(g) {
            *m = max(*m, v.abs());
        }
    }
    let m = lanes.into_iter().fold(0.0, max);
    tail.iter().fold(m, |m, v| max(m, v.abs()))
}

/// The value of `x` with the largest |v|, sign included (0 if all are zero): the first such value, as the
/// strict `>` scans of llama.cpp's Q4_0/Q5_0/Q8_K quantizers pick it (the sign of the scale depends on it).
#[inline(always)]
pub(super) fn signed_abs_max(x: &[f32]) -> f32 {
    let amax = abs_max(x);
    x.iter().copied().find(|v| v.abs() == amax).unwrap_or(0.0)
}

/// The exact int8 dot product of codes and activation quants inside the K-quant dot products: the scalar loop
/// here ([`ScalarDot`], the reference), NEON on aarch64 (`simd::aarch64_neon`).
pub(crate) trait IntDot {
    fn dot(a: &[i8], b: &[u8]) -> i32;
}

pub(crate) struct ScalarDot;

impl IntDot for ScalarDot {
    #[inline(always)]
    fn dot(a: &[i8], b: &[u8]) -> i32 {
        dot_i8(a, b)
    }
}

/// Signed dot product of int8 values (`a`) with int8 values stored as bytes (`b`), over the shorter of the two.
/// Written as a plain reduction so LLVM vectorizes it.
#[inline(always)]
pub(super) fn dot_i8(a: &[i8], b: &[u8]) -> i32 {
    a.iter().zip(b).map(|(&x, &y)| x as i32 * (y as i8) as i32).sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ggml_expf_is_close_to_exp_everywhere() {
        for i in -1000..=1000 {
            let x = i as f32 * 0.0871;
            let (got, want) = (ggml_expf(x), x.exp());
            assert!((got - want).abs() <= 4.0 * f32::EPSILON * want, "exp({x}) = {got}, libm {want}");
        }
        assert_eq!(ggml_expf(-200.0), 0.0);
        assert_eq!(ggml_expf(100.0), f32::INFINITY);
    }
}

/// q·x in f32, summed in LANES running sums (independent lanes the compiler keeps in vector registers, as in
/// `cpu::attention_tiered::box_bound`): a query head against a block's K offset or a key bias row.
pub fn dot_lanes(q: &[f32], x: &[f32]) -> f32 {
    const LANES: usize = 16;
    let mut acc = [0.0f32; LANES];
    let (qc, xc) = (q.chunks_exact(LANES), x.chunks_exact(LANES));
    let tail: f32 = qc.remainder().iter().zip(xc.remainder()).map(|(a, b)| a * b).sum();
    for (a, b) in qc.zip(xc) {
        for i in 0..LANES {
            acc[i] += a[i] * b[i];
        }
    }
    acc.iter().sum::<f32>() + tail
}
