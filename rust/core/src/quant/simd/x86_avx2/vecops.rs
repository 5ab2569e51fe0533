//! AVX2 + FMA + F16C versions of the element-wise primitives of `simd::vecops`, eight lanes at a time with the
//! scalar definition's rounding per element (so the same bits); tails run the scalar definition.

use std::arch::x86_64::*;

use crate::quant::simd::vecops::{accumulate_f16_with, f16_round, silu, VecOps};

pub(in crate::quant::simd) const AVX2: VecOps = VecOps {
    name: "avx2",
    axpy,
    axpy_rows,
    axpy_f16,
    scale,
    scale_f16,
    accumulate_f16,
    dot_cols,
    exp_shifted,
    swiglu,
};

// The safe wrappers below are only reachable through `AVX2`, which `simd::vec_ops` hands out after checking
// AVX2, FMA and F16C; every loop stays within the lengths of its slices.

fn axpy(y: &mut [f32], x: &[f32], a: f32) {
    let n = y.len().min(x.len());
    // SAFETY: see above.
    unsafe { axpy_k(n, y.as_mut_ptr(), x.as_ptr(), a) }
}

fn axpy_rows(y: &mut [f32], rows: &[f32], w: &[f32]) {
    let n = y.len();
    let k = w.len().min(rows.len().checked_div(n).unwrap_or(0));
    // SAFETY: see above; rows holds k rows of n.
    unsafe { axpy_rows_k(n, k, y.as_mut_ptr(), rows.as_ptr(), w.as_ptr()) }
}

fn axpy_f16(y: &mut [f32], x: &[u8], a: f32) {
    let n = y.len().min(x.len() / 2);
    // SAFETY: see above.
    unsafe { axpy_f16_k(n, y.as_mut_ptr(), x.as_ptr(), a) }
}

fn scale(y: &mut [f32], a: f32) {
    // SAFETY: see above.
    unsafe { scale_k::<false>(y.len(), y.as_mut_ptr(), a) }
}

fn scale_f16(y: &mut [f32], a: f32) {
    // SAFETY: see above.
    unsafe { scale_k::<true>(y.len(), y.as_mut_ptr(), a) }
}

fn accumulate_f16(ys: &mut [f32], n: usize, v: &[u8], v_stride: usize, ms: &[f32], vs: &[f32]) {
    accumulate_f16_with(scale_f16, axpy_f16, ys, n, v, v_stride, ms, vs);
}

fn dot_cols(q: &[f32], kt: &[f32], out: &mut [f32]) {
    let w = out.len();
    let dk = q.len().min(kt.len().checked_div(w).unwrap_or(0));
    // SAFETY: see above; kt holds dk rows of w.
    unsafe { dot_cols_k(dk, w, q.as_ptr(), kt.as_ptr(), out.as_mut_ptr()) }
}

fn exp_shifted(x: &mut [f32], m: f32) -> f64 {
    // SAFETY: see above.
    unsafe { exp_shifted_k(x.len(), x.as_mut_ptr(), m) }
    crate::quant::simd::vecops::sum_groups8(x)
}

fn swiglu(gate: &mut [f32], up: &[f32]) {
    let n = gate.len().min(up.len());
    // SAFETY: see above.
    unsafe { swiglu_k(n, gate.as_mut_ptr(), up.as_ptr()) }
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn f16_round8(v: __m256) -> __m256 {
    _mm256_cvtph_ps(_mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(v))
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn axpy_k(n: usize, y: *mut f32, x: *const f32, a: f32) {
    let av = _mm256_set1_ps(a);
    let mut i = 0;
    while i + 8 <= n {
        _mm256_storeu_ps(y.add(i), _mm256_fmadd_ps(_mm256_loadu_ps(x.add(i)), av, _mm256_loadu_ps(y.add(i))));
        i += 8;
    }
    for i in i..n {
        *y.add(i) = (*x.add(i)).mul_add(a, *y.add(i));
    }
}

/// Up to 64 elements of y stay in registers while all k rows are added in order.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn axpy_rows_k(n: usize, k: usize, y: *mut f32, rows: *const f32, w: *const f32) {
    let mut i = 0;
    while i + 64 <= n {
        let mut acc = [_mm256_setzero_ps(); 8];
        for (u, a) in acc.iter_mut().enumerate() {
            *a = _mm256_loadu_ps(y.add(i + 8 * u));
        }
        for j in 0..k {
            let wj = _mm256_set1_ps(*w.add(j));
            let row = rows.add(j * n + i);
            for (u, a) in acc.iter_mut().enumerate() {
                *a = _mm256_fmadd_ps(_mm256_loadu_ps(row.add(8 * u)), wj, *a);
            }
        }
        for (u, a) in acc.iter().enumerate() {
            _mm256_storeu_ps(y.add(i + 8 * u), *a);
        }
        i += 64;
    }
    for j in 0..k {
        axpy_k(n - i, y.add(i), rows.add(j * n + i), *w.add(j));
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn axpy_f16_k(n: usize, y: *mut f32, x: *const u8, a: f32) {
    let av = _mm256_set1_ps(a);
    let mut i = 0;
    while i + 8 <= n {
        let xv = _mm256_cvtph_ps(_mm_loadu_si128(x.add(2 * i) as *const __m128i));
        _mm256_storeu_ps(y.add(i), f16_round8(_mm256_fmadd_ps(xv, av, _mm256_loadu_ps(y.add(i)))));
        i += 8;
    }
    for i in i..n {
        let xi = half::f16::from_bits((x.add(2 * i) as *const u16).read_unaligned()).to_f32();
        *y.add(i) = f16_round(xi.mul_add(a, *y.add(i)));
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn scale_k<const F16: bool>(n: usize, y: *mut f32, a: f32) {
    let av = _mm256_set1_ps(a);
    let mut i = 0;
    while i + 8 <= n {
        let v = _mm256_mul_ps(_mm256_loadu_ps(y.add(i)), av);
        _mm256_storeu_ps(y.add(i), if F16 { f16_round8(v) } else { v });
        i += 8;
    }
    for i in i..n {
        let v = *y.add(i) * a;
        *y.add(i) = if F16 { f16_round(v) } else { v };
    }
}

/// Four vectors of eight columns at a time (32 independent FMA chains hide the FMA latency), then single
/// vectors, then scalar columns.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_cols_k(dk: usize, w: usize, q: *const f32, kt: *const f32, out: *mut f32) {
    let mut j = 0;
    while j + 32 <= w {
        let mut acc = [_mm256_setzero_ps(); 4];
        for d in 0..dk {
            let qd = _mm256_set1_ps(*q.add(d));
            let row = kt.add(d * w + j);
            for (u, a) in acc.iter_mut().enumerate() {
                *a = _mm256_fmadd_ps(qd, _mm256_loadu_ps(row.add(8 * u)), *a);
            }
        }
        for (u, a) in acc.iter().enumerate() {
            _mm256_storeu_ps(out.add(j + 8 * u), *a);
        }
        j += 32;
    }
    while j + 8 <= w {
        let mut acc = _mm256_setzero_ps();
        for d in 0..dk {
            acc = _mm256_fmadd_ps(_mm256_set1_ps(*q.add(d)), _mm256_loadu_ps(kt.add(d * w + j)), acc);
        }
        _mm256_storeu_ps(out.add(j), acc);
        j += 8;
    }
    for j in j..w {
        let mut acc = 0.0f32;
        for d in 0..dk {
            acc = (*q.add(d)).mul_add(*kt.add(d * w + j), acc);
        }
        *out.add(j) = acc;
    }
}

/// ggml's `ggml_v_expf` (ggml-cpu/vec.h, AVX2): the same operations as the scalar `ggml_expf`, lane-wise.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn v_expf(x: __m256) -> __m256 {
    let c = |bits: u32| _mm256_set1_ps(f32::from_bits(bits));
    let r = c(0x4b40_0000);
    let z = _mm256_fmadd_ps(x, c(0x3fb8_aa3b), r);
    let n = _mm256_sub_ps(z, r);
    let b = _mm256_fnmadd_ps(n, c(0x35bf_be8e), _mm256_fnmadd_ps(n, c(0x3f31_7200), x));
    let e = _mm256_slli_epi32::<23>(_mm256_castps_si256(z));
    let k = _mm256_castsi256_ps(_mm256_add_epi32(e, _mm256_castps_si256(_mm256_set1_ps(1.0))));
    let abs_n = _mm256_andnot_ps(_mm256_set1_ps(-0.0), n);
    let big = _mm256_cmp_ps::<_CMP_GT_OQ>(abs_n, _mm256_set1_ps(126.0));
    let u = _mm256_mul_ps(b, b);
    let j = _mm256_fmadd_ps(
        _mm256_fmadd_ps(_mm256_fmadd_ps(c(0x3c07_2010), b, c(0x3d2b_9f17)), u, _mm256_fmadd_ps(c(0x3e2a_af33), b, c(0x3eff_fedb))),
        u,
        _mm256_mul_ps(c(0x3f7f_fff6), b),
    );
    if _mm256_movemask_ps(big) == 0 {
        return _mm256_fmadd_ps(j, k, k);
    }
    let g = _mm256_and_si256(
        _mm256_castps_si256(_mm256_cmp_ps::<_CMP_LE_OQ>(n, _mm256_setzero_ps())),
        _mm256_set1_epi32(0x8200_0000u32 as i32),
    );
    let s1 = _mm256_castsi256_ps(_mm256_add_epi32(g, _mm256_set1_epi32(0x7f00_0000)));
    let s2 = _mm256_castsi256_ps(_mm256_sub_epi32(e, g));
    let huge = _mm256_cmp_ps::<_CMP_GT_OQ>(abs_n, _mm256_set1_ps(192.0));
    _mm256_or_ps(
        _mm256_and_ps(huge, _mm256_mul_ps(s1, s1)),
        _mm256_andnot_ps(
            huge,
            _mm256_or_ps(
                _mm256_and_ps(big, _mm256_mul_ps(_mm256_fmadd_ps(s2, j, s2), s1)),
                _mm256_andnot_ps(big, _mm256_fmadd_ps(k, j, k)),
            ),
        ),
    )
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn exp_shifted_k(n: usize, x: *mut f32, m: f32) {
    let mv = _mm256_set1_ps(m);
    let ninf = _mm256_set1_ps(f32::NEG_INFINITY);
    let mut i = 0;
    while i + 8 <= n {
        let v = _mm256_loadu_ps(x.add(i));
        let e = v_expf(_mm256_sub_ps(v, mv));
        let masked = _mm256_cmp_ps::<_CMP_EQ_OQ>(v, ninf);
        _mm256_storeu_ps(x.add(i), _mm256_andnot_ps(masked, e));
        i += 8;
    }
    for i in i..n {
        let v = *x.add(i);
        *x.add(i) = if v == f32::NEG_INFINITY { 0.0 } else { crate::quant::math::ggml_expf(v - m) };
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn swiglu_k(n: usize, gate: *mut f32, up: *const f32) {
    let one = _mm256_set1_ps(1.0);
    let mut i = 0;
    while i + 8 <= n {
        let x = _mm256_loadu_ps(gate.add(i));
        let e = v_expf(_mm256_sub_ps(_mm256_setzero_ps(), x));
        let s = _mm256_div_ps(x, _mm256_add_ps(one, e));
        _mm256_storeu_ps(gate.add(i), _mm256_mul_ps(s, _mm256_loadu_ps(up.add(i))));
        i += 8;
    }
    for i in i..n {
        *gate.add(i) = silu(*gate.add(i)) * *up.add(i);
    }
}
