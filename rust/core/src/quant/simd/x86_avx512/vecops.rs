//! AVX-512 versions of the element-wise primitives of `simd::vecops` where llama.cpp's AVX-512 build computes
//! differently from its AVX2 one (ggml-cpu/vec.h, vec.cpp, simd-mappings.h):
//! - SiLU and the softmax use its `__AVX512F__ && __AVX512DQ__` `ggml_v_expf` (a different polynomial tail and
//!   `vscalefps`, [`crate::quant::math::ggml_expf_avx512`]), sixteen lanes at a time; the softmax sums each group
//!   of sixteen with `_mm512_reduce_add_ps` into a double;
//! - with AVX512-FP16 (`__AVX512FP16__`, e.g. Sapphire Rapids), `ggml_vec_mad_f16` / `ggml_vec_scale_f16` run in
//!   half precision on the first `n & !127` elements: `y = fma(x, f16(v), y)` and `y = y * f16(v)`, each rounded
//!   once to f16; the rest as before (f32 FMA or multiply, then f16 rounding).
//!
//! The other primitives sum per element in the same order whatever the width, so the AVX2 ones serve, except
//! `accumulate_f16`, whose point is its register blocking: sixteen columns of up to eight query heads stay in
//! registers while the keys go by, each V row widened once for all of them.

use std::arch::asm;
use std::arch::x86_64::*;

use super::float::reduce_add_ps;
use crate::quant::math::ggml_expf_avx512;
use crate::quant::simd::vecops::{self, VecOps};

/// The primitives of llama.cpp's AVX-512 build without AVX512-FP16 (Zen 4, Ice Lake).
pub(in crate::quant::simd) const AVX512: VecOps =
    VecOps { name: "avx512", exp_shifted, swiglu, accumulate_f16, ..crate::quant::simd::x86_avx2::vecops::AVX2 };

/// ... and with AVX512-FP16 (Sapphire Rapids and later).
pub(in crate::quant::simd) const AVX512_FP16: VecOps =
    VecOps { name: "avx512fp16", axpy_f16, scale_f16, accumulate_f16: accumulate_f16_fp16, ..AVX512 };

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

/// The shape of an `accumulate_f16` call: `heads` accumulators of `n` columns over `keys` V rows, or `None` when
/// the slices do not hold them (the call then does nothing, as the scalar definition would index out of range).
fn accumulate_shape(ys: &[f32], n: usize, v: &[u8], v_stride: usize, ms: &[f32], vs: &[f32]) -> Option<(usize, usize)> {
    let heads = ys.len().checked_div(n)?;
    let keys = ms.len().checked_div(heads)?;
    let fits = ms.len() == vs.len() && keys.checked_sub(1).is_none_or(|k| k * v_stride + 2 * n <= v.len());
    (heads > 0 && fits).then_some((heads, keys))
}

fn accumulate_f16(ys: &mut [f32], n: usize, v: &[u8], v_stride: usize, ms: &[f32], vs: &[f32]) {
    let Some((heads, keys)) = accumulate_shape(ys, n, v, v_stride, ms, vs) else { return };
    // SAFETY: see above; the shape was checked against the slices.
    unsafe { accumulate_ps_k(0, n, heads, keys, ys.as_mut_ptr(), n, v.as_ptr(), v_stride, ms.as_ptr(), vs.as_ptr()) }
}

/// With AVX512-FP16 the first `n & !127` columns accumulate in half precision, as `axpy_f16` and `scale_f16` do.
fn accumulate_f16_fp16(ys: &mut [f32], n: usize, v: &[u8], v_stride: usize, ms: &[f32], vs: &[f32]) {
    let Some((heads, keys)) = accumulate_shape(ys, n, v, v_stride, ms, vs) else { return };
    let np = n & !127;
    // SAFETY: see above; the shape was checked against the slices.
    unsafe {
        accumulate_ph_k(np, heads, keys, ys.as_mut_ptr(), n, v.as_ptr(), v_stride, ms.as_ptr(), vs.as_ptr());
        accumulate_ps_k(np, n, heads, keys, ys.as_mut_ptr(), n, v.as_ptr(), v_stride, ms.as_ptr(), vs.as_ptr());
    }
}

/// Sixteen floats rounded to f16 and back.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c")]
unsafe fn f16_round16(x: __m512) -> __m512 {
    _mm512_cvtph_ps(_mm512_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(x))
}

/// Sixteen copies of f16(a).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c")]
unsafe fn half16(a: f32) -> __m256i {
    _mm256_set1_epi16(half::f16::from_f32(a).to_bits() as i16)
}

/// Heads whose sixteen columns stay in registers together.
const HEADS_PER_PASS: usize = 8;

/// Columns c0..c1 of `accumulate_f16` in f32 with f16 rounding (AVX2's `scale_f16` / `axpy_f16` per element,
/// sixteen lanes at a time), the last c1 % 16 columns in scalar. `ys` rows are `ys_stride` floats apart.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c")]
unsafe fn accumulate_ps_k(
    c0: usize,
    c1: usize,
    heads: usize,
    keys: usize,
    ys: *mut f32,
    ys_stride: usize,
    v: *const u8,
    v_stride: usize,
    ms: *const f32,
    vs: *const f32,
) {
    for h0 in (0..heads).step_by(HEADS_PER_PASS) {
        let hn = HEADS_PER_PASS.min(heads - h0);
        let mut c = c0;
        while c + 16 <= c1 {
            let mut acc = [_mm512_setzero_ps(); HEADS_PER_PASS];
            for (i, a) in acc.iter_mut().enumerate().take(hn) {
                *a = _mm512_loadu_ps(ys.add((h0 + i) * ys_stride + c));
            }
            for j in 0..keys {
                let x = _mm512_cvtph_ps(_mm256_loadu_si256(v.add(j * v_stride + 2 * c) as *const __m256i));
                for (i, a) in acc.iter_mut().enumerate().take(hn) {
                    let k = j * heads + h0 + i;
                    let m = *ms.add(k);
                    if m != 1.0 {
                        *a = f16_round16(_mm512_mul_ps(*a, _mm512_set1_ps(m)));
                    }
                    *a = f16_round16(_mm512_fmadd_ps(x, _mm512_set1_ps(*vs.add(k)), *a));
                }
            }
            for (i, a) in acc.iter().enumerate().take(hn) {
                _mm512_storeu_ps(ys.add((h0 + i) * ys_stride + c), *a);
            }
            c += 16;
        }
        for c in c..c1 {
            for j in 0..keys {
                let x = half::f16::from_bits((v.add(j * v_stride + 2 * c) as *const u16).read_unaligned()).to_f32();
                for i in 0..hn {
                    let k = j * heads + h0 + i;
                    let y = ys.add((h0 + i) * ys_stride + c);
                    let m = *ms.add(k);
                    if m != 1.0 {
                        *y = vecops::f16_round(*y * m);
                    }
                    *y = vecops::f16_round(x.mul_add(*vs.add(k), *y));
                }
            }
        }
    }
}

/// Columns 0..np (a multiple of 16) of `accumulate_f16` in half precision: `vmulph` by f16(ms) (the product of two
/// halves rounded once, as `scale_ph_k`) and `vfmadd231ph` with f16(vs), as `axpy_ph_k`.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512fp16,avx2,fma,f16c")]
unsafe fn accumulate_ph_k(
    np: usize,
    heads: usize,
    keys: usize,
    ys: *mut f32,
    ys_stride: usize,
    v: *const u8,
    v_stride: usize,
    ms: *const f32,
    vs: *const f32,
) {
    for h0 in (0..heads).step_by(HEADS_PER_PASS) {
        let hn = HEADS_PER_PASS.min(heads - h0);
        let mut c = 0;
        while c < np {
            let mut acc = [_mm256_setzero_si256(); HEADS_PER_PASS];
            for (i, a) in acc.iter_mut().enumerate().take(hn) {
                *a = _mm512_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(_mm512_loadu_ps(ys.add((h0 + i) * ys_stride + c)));
            }
            for j in 0..keys {
                let xh = _mm256_loadu_si256(v.add(j * v_stride + 2 * c) as *const __m256i);
                for (i, a) in acc.iter_mut().enumerate().take(hn) {
                    let k = j * heads + h0 + i;
                    let m = *ms.add(k);
                    let mut yh = *a;
                    if m != 1.0 {
                        asm!("vmulph {y}, {y}, {m}", y = inout(ymm_reg) yh, m = in(ymm_reg) half16(m),
                             options(pure, nomem, nostack));
                    }
                    asm!("vfmadd231ph {y}, {x}, {a}", y = inout(ymm_reg) yh, x = in(ymm_reg) xh, a = in(ymm_reg) half16(*vs.add(k)),
                         options(pure, nomem, nostack));
                    *a = yh;
                }
            }
            for (i, a) in acc.iter().enumerate().take(hn) {
                _mm512_storeu_ps(ys.add((h0 + i) * ys_stride + c), _mm512_cvtph_ps(*a));
            }
            c += 16;
        }
    }
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
