//! AVX2 + F16C kernels of the float rows: F32 / F16 / BF16 dot products after llama.cpp's
//! `ggml_vec_dot_f32` / `ggml_vec_dot_f16` / `ggml_vec_dot_bf16` (ggml-cpu/vec.cpp with the AVX mappings of
//! simd-mappings.h), F16 row conversion both ways (exact widening; round-to-nearest-even narrowing, the same
//! bits as the scalar `half` conversion).
//!
//! The F32 and F16 dots run four accumulators of eight lanes over steps of 32 elements and reduce them with
//! `GGML_F32x8_REDUCE` ((s0 + s2) + (s1 + s3), 128-bit halves added, two `hadd`s); the BF16 dot has its own
//! reduction. The leftovers (n % 32 elements) follow the scalar loops as GCC compiles them.

use std::arch::x86_64::*;

/// Eight halves at `p` widened to f32.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn load_f16x8(p: *const u8) -> __m256 {
    _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i))
}

/// Eight bf16 at `p` widened to f32 (a shift: exact).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn load_bf16x8(p: *const u8) -> __m256 {
    let h = _mm_loadu_si128(p as *const __m128i);
    _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h)))
}

/// One half at `p` (a tail element: no over-read), with the exact scalar conversion.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn f16_at(p: *const u8) -> f32 {
    crate::quant::float::f16_to_f32((p as *const u16).read_unaligned())
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn bf16_at(p: *const u8) -> f32 {
    f32::from_bits(((p as *const u16).read_unaligned() as u32) << 16)
}

/// `GGML_F32x8_REDUCE` over four accumulators.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn reduce4(s: [__m256; 4]) -> f32 {
    let s0 = _mm256_add_ps(s[0], s[2]);
    let s1 = _mm256_add_ps(s[1], s[3]);
    let s0 = _mm256_add_ps(s0, s1);
    let t0 = _mm_add_ps(_mm256_castps256_ps128(s0), _mm256_extractf128_ps::<1>(s0));
    let t1 = _mm_hadd_ps(t0, t0);
    _mm_cvtss_f32(_mm_hadd_ps(t1, t1))
}

/// Four accumulators over the first `n & !31` elements of the rows at `$x` and `$y`; `$load` widens eight
/// elements of `$b` bytes each. (A macro so that the loads inline.)
macro_rules! dot_steps {
    ($n:expr, $x:expr, $y:expr, $b:expr, $load:ident) => {{
        let mut sum = [_mm256_setzero_ps(); 4];
        let np = $n & !31;
        let mut i = 0;
        while i < np {
            for (j, s) in sum.iter_mut().enumerate() {
                let off = (i + 8 * j) * $b;
                *s = _mm256_fmadd_ps($load($x.add(off)), $load($y.add(off)), *s);
            }
            i += 32;
        }
        sum
    }};
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn load_f32x8(p: *const u8) -> __m256 {
    _mm256_loadu_ps(p as *const f32)
}

#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn vec_dot_f32(n: usize, x: *const u8, y: *const u8) -> f32 {
    let np = n & !31;
    let mut sumf = reduce4(dot_steps!(n, x, y, 4, load_f32x8));
    // `sumf += x[i] * y[i]` in f32: GCC vectorizes the leftovers in groups of 8 and 4 (multiply, then in-order
    // adds) and contracts the last n % 4 into FMAs.
    let rem = n - np;
    let fused_from = np + (rem & !3);
    for i in np..n {
        let (a, b) = (f32_at(x.add(4 * i)), f32_at(y.add(4 * i)));
        sumf = if i < fused_from { sumf + a * b } else { a.mul_add(b, sumf) };
    }
    sumf
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn f32_at(p: *const u8) -> f32 {
    (p as *const f32).read_unaligned()
}

#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn vec_dot_f16(n: usize, x: *const u8, y: *const u8) -> f32 {
    let np = n & !31;
    // llama.cpp sums the reduced lanes and the leftovers in double (`ggml_float`).
    let mut sumf = reduce4(dot_steps!(n, x, y, 2, load_f16x8)) as f64;
    for i in np..n {
        sumf += (f16_at(x.add(2 * i)) * f16_at(y.add(2 * i))) as f64;
    }
    sumf as f32
}

#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn vec_dot_bf16(n: usize, x: *const u8, y: *const u8) -> f32 {
    // `c = add(mul(x, y), c)` in the source; GCC contracts it into an FMA.
    let c = dot_steps!(n, x, y, 2, load_bf16x8);
    let c1 = _mm256_add_ps(_mm256_add_ps(c[0], c[2]), _mm256_add_ps(c[1], c[3]));
    let mut g = _mm_add_ps(_mm256_extractf128_ps::<1>(c1), _mm256_castps256_ps128(c1));
    g = _mm_add_ps(g, _mm_movehl_ps(g, g));
    g = _mm_add_ss(g, _mm_movehdup_ps(g));
    let mut sumf = _mm_cvtss_f32(g) as f64;
    for i in n & !31..n {
        sumf += (bf16_at(x.add(2 * i)) * bf16_at(y.add(2 * i))) as f64;
    }
    sumf as f32
}

/// `n` halves at `src` to f32 at `dst`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn dequantize_f16(n: usize, src: *const u8, dst: *mut f32) {
    let n8 = n & !7;
    let mut i = 0;
    while i < n8 {
        _mm256_storeu_ps(dst.add(i), load_f16x8(src.add(2 * i)));
        i += 8;
    }
    for i in n8..n {
        *dst.add(i) = f16_at(src.add(2 * i));
    }
}

/// `n` f32 at `x` to halves (round to nearest even) at `dst`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn quantize_f16(n: usize, x: *const f32, dst: *mut u8) {
    let n8 = n & !7;
    let mut i = 0;
    while i < n8 {
        let h = _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(_mm256_loadu_ps(x.add(i)));
        _mm_storeu_si128(dst.add(2 * i) as *mut __m128i, h);
        i += 8;
    }
    for i in n8..n {
        super::prims::put_f16(dst.add(2 * i), *x.add(i));
    }
}
