//! AVX-512 versions of the element-wise primitives of `simd::vecops` where llama.cpp's AVX-512 build computes
//! differently from its AVX2 one (ggml-cpu/vec.h, vec.cpp, simd-mappings.h):
//! - SiLU and the softmax use its `__AVX512F__ && __AVX512DQ__` `ggml_v_expf` (a different polynomial tail and
//!   `vscalefps`, [`crate::quant::math::ggml_expf_avx512`]), sixteen lanes at a time; the softmax sums each group
//!   of sixteen with `_mm512_reduce_add_ps` into a double;
//! - with AVX512-FP16 (`__AVX512FP16__`, e.g. Sapphire Rapids), `ggml_vec_mad_f16` / `ggml_vec_scale_f16` run in
//!   half precision on the first `n & !127` elements: `y = fma(x, f16(v), y)` and `y = y * f16(v)`, each rounded
//!   once to f16; the rest as before (f32 FMA or multiply, then f16 rounding).
//!
//! The other primitives sum per element in the same order whatever the width, so the AVX2 ones serve.

use std::arch::asm;
use std::arch::x86_64::*;

use super::float::reduce_add_ps;
use crate::quant::math::ggml_expf_avx512;
use crate::quant::simd::vecops::{self, VecOps};

/// The primitives of llama.cpp's AVX-512 build without AVX512-FP16 (Zen 4, Ice Lake).
pub(in crate::quant::simd) const AVX512: VecOps =
    VecOps { name: "avx512", exp_shifted, swiglu, ..crate::quant::simd::x86_avx2::vecops::AVX2 };

/// ... and with AVX512-FP16 (Sapphire Rapids and later).
pub(in crate::quant::simd) const AVX512_FP16: VecOps =
    VecOps { name: "avx512fp16", axpy_f16, scale_f16, ..AVX512 };

// The safe wrappers below are only reachable through the tables above, which `simd::vec_ops` hands out after
// checking the features (AVX512-FP16 for the second); every loop stays within the lengths of its slices.

fn exp_shifted(x: &mut [f32], m: f32) -> f64 {
    // SAFETY: see above.
    unsafe { exp_shifted_k(x.len(), x.as_mut_ptr(), m) }
}

fn swiglu(gate: &mut [f32], up: &[f32]) {
    let n = gate.len().min(up.len());
    // SAFETY: see above.
    unsafe { swiglu_k(n, gate.as_mut_ptr(), up.as_ptr()) }
}

fn axpy_f16(y: &mut [f32], x: &[u8], a: f32) {
    let n = y.len().min(x.len() / 2);
    let np = n & !127;
    // SAFETY: see above.
    unsafe { axpy_ph_k(np, y.as_mut_ptr(), x.as_ptr(), a) }
    (crate::quant::simd::x86_avx2::vecops::AVX2.axpy_f16)(&mut y[np..n], &x[2 * np..2 * n], a);
}

fn scale_f16(y: &mut [f32], a: f32) {
    let np = y.len() & !127;
    // SAFETY: see above.
    unsafe { scale_ph_k(np, y.as_mut_ptr(), a) }
    (crate::quant::simd::x86_avx2::vecops::AVX2.scale_f16)(&mut y[np..], a);
}

/// `ggml_v_expf` of llama.cpp's AVX-512 build.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c")]
unsafe fn v_expf(x: __m512) -> __m512 {
    let c = |bits: u32| _mm512_set1_ps(f32::from_bits(bits));
    let r = c(0x4b40_0000);
    let z = _mm512_fmadd_ps(x, c(0x3fb8_aa3b), r);
    let n = _mm512_sub_ps(z, r);
    let b = _mm512_fnmadd_ps(n, c(0x35bf_be8e), _mm512_fnmadd_ps(n, c(0x3f31_7200), x));
    let d = _mm512_cmp_ps_mask::<_CMP_GT_OQ>(_mm512_abs_ps(n), _mm512_set1_ps(192.0));
    let u = _mm512_mul_ps(b, b);
    let j = _mm512_fmadd_ps(
        _mm512_fmadd_ps(_mm512_fmadd_ps(c(0x3c07_2010), b, c(0x3d2b_9f17)), u, _mm512_fmadd_ps(c(0x3e2a_af33), b, c(0x3eff_fedb))),
        u,
        _mm512_fmadd_ps(c(0x3f7f_fff6), b, _mm512_set1_ps(1.0)),
    );
    let res = _mm512_scalef_ps(j, n);
    if d == 0 {
        return res;
    }
    let le0 = _mm512_cmp_ps_mask::<_CMP_LE_OQ>(n, _mm512_setzero_ps());
    let alt = _mm512_mask_blend_ps(le0, _mm512_set1_ps(f32::INFINITY), _mm512_setzero_ps());
    _mm512_mask_blend_ps(d, res, alt)
}

/// `ggml_vec_soft_max_f32`'s loop: sixteen exps at a time, each group's `_mm512_reduce_add_ps` added to a double.
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c")]
unsafe fn exp_shifted_k(n: usize, x: *mut f32, m: f32) -> f64 {
    let mv = _mm512_set1_ps(m);
    let ninf = _mm512_set1_ps(f32::NEG_INFINITY);
    let mut sum = 0.0f64;
    let mut i = 0;
    while i + 16 <= n {
        let v = _mm512_loadu_ps(x.add(i));
        let masked = _mm512_cmp_ps_mask::<_CMP_EQ_OQ>(v, ninf);
        let e = _mm512_maskz_mov_ps(!masked, v_expf(_mm512_sub_ps(v, mv)));
        _mm512_storeu_ps(x.add(i), e);
        sum += reduce_add_ps(e) as f64;
        i += 16;
    }
    for i in i..n {
        let v = *x.add(i);
        let e = if v == f32::NEG_INFINITY { 0.0 } else { ggml_expf_avx512(v - m) };
        *x.add(i) = e;
        sum += e as f64;
    }
    sum
}

#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c")]
unsafe fn swiglu_k(n: usize, gate: *mut f32, up: *const f32) {
    let one = _mm512_set1_ps(1.0);
    let mut i = 0;
    while i + 16 <= n {
        let x = _mm512_loadu_ps(gate.add(i));
        let e = v_expf(_mm512_sub_ps(_mm512_setzero_ps(), x));
        let s = _mm512_div_ps(x, _mm512_add_ps(one, e));
        _mm512_storeu_ps(gate.add(i), _mm512_mul_ps(s, _mm512_loadu_ps(up.add(i))));
        i += 16;
    }
    for i in i..n {
        *gate.add(i) = vecops::silu_avx512(*gate.add(i)) * *up.add(i);
    }
}

/// `ggml_vec_mad_f16` under AVX512-FP16 over `np` (a multiple of 16) elements: `vfmadd231ph` with `f16(a)`.
/// `y` holds f16 values as f32 (exactly), so the round trip through halves is exact.
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512fp16,avx2,fma,f16c")]
unsafe fn axpy_ph_k(np: usize, y: *mut f32, x: *const u8, a: f32) {
    let ah = _mm256_set1_epi16(half::f16::from_f32(a).to_bits() as i16);
    let mut i = 0;
    while i < np {
        let mut yh = _mm512_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(_mm512_loadu_ps(y.add(i)));
        let xh = _mm256_loadu_si256(x.add(2 * i) as *const __m256i);
        // yh = xh * ah + yh, one rounding (the intrinsic is not stable in Rust).
        asm!("vfmadd231ph {y}, {x}, {a}", y = inout(ymm_reg) yh, x = in(ymm_reg) xh, a = in(ymm_reg) ah,
             options(pure, nomem, nostack));
        _mm512_storeu_ps(y.add(i), _mm512_cvtph_ps(yh));
        i += 16;
    }
}

/// `ggml_vec_scale_f16` under AVX512-FP16 over `np` elements: `y * f16(a)` rounded once to f16. The product of
/// two halves is exact in f32, so an f32 multiply and one f16 rounding give the same bits as `vmulph`.
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c")]
unsafe fn scale_ph_k(np: usize, y: *mut f32, a: f32) {
    let av = _mm512_set1_ps(half::f16::from_f32(a).to_f32());
    let mut i = 0;
    while i < np {
        let v = _mm512_mul_ps(_mm512_loadu_ps(y.add(i)), av);
        let h = _mm512_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(v);
        _mm512_storeu_ps(y.add(i), _mm512_cvtph_ps(h));
        i += 16;
    }
}
