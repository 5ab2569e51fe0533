//! Scalar math shared by the layers above: the reference kernels, the SIMD kernels (`simd`) and the CPU ops
//! (`crate::cpu::ops`). It depends on nothing else in the crate, so every layer may import it.

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
