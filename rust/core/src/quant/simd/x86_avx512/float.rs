//! AVX-512 kernel of the f16 rows (the attention's K cache): llama.cpp's `ggml_vec_dot_f16` as its AVX-512 build
//! compiles them (ggml-cpu/vec.cpp with the `__AVX512F__` mappings of simd-mappings.h): four accumulators of
//! sixteen lanes over steps of 64 elements, reduced by `GGML_F32x16_REDUCE` ((s0 + s2) + (s1 + s3), then
//! GCC's `_mm512_reduce_add_ps`), the reduced lanes and the leftovers (n % 64) summed in double (`ggml_float`).
//! With AVX512-FP16 it still widens to f32 (`GGML_F16_DOT_*`).

use std::arch::x86_64::*;

/// GCC 12's `_mm512_reduce_add_ps`: the 256-bit halves added, then the 128-bit halves, then lanes (0 + 2) and
/// (1 + 3), then those two.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c")]
pub(super) unsafe fn reduce_add_ps(x: __m512) -> f32 {
    let t3 = _mm256_add_ps(_mm512_extractf32x8_ps::<1>(x), _mm512_castps512_ps256(x));
    let t6 = _mm_add_ps(_mm256_extractf128_ps::<1>(t3), _mm256_castps256_ps128(t3));
    let t8 = _mm_add_ps(t6, _mm_movehl_ps(t6, t6));
    _mm_cvtss_f32(t8) + _mm_cvtss_f32(_mm_movehdup_ps(t8))
}

/// `GGML_F32x16_REDUCE` of four accumulators.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c")]
unsafe fn reduce4(s: [__m512; 4]) -> f32 {
    let s0 = _mm512_add_ps(s[0], s[2]);
    let s1 = _mm512_add_ps(s[1], s[3]);
    reduce_add_ps(_mm512_add_ps(s0, s1))
}

#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c")]
unsafe fn load_f16x16(p: *const u8) -> __m512 {
    _mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i))
}

/// Four accumulators over the first `n & !63` elements; `$load` widens sixteen elements of `$b` bytes each.
macro_rules! dot_steps {
    ($n:expr, $x:expr, $y:expr, $b:expr, $load:ident) => {{
        let mut sum = [_mm512_setzero_ps(); 4];
        let mut i = 0;
        while i < $n & !63 {
            for (j, s) in sum.iter_mut().enumerate() {
                let off = (i + 16 * j) * $b;
                *s = _mm512_fmadd_ps($load($x.add(off)), $load($y.add(off)), *s);
            }
            i += 64;
        }
        sum
    }};
}

#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c")]
pub(super) unsafe fn vec_dot_f16(n: usize, x: *const u8, y: *const u8) -> f32 {
    let mut sumf = reduce4(dot_steps!(n, x, y, 2, load_f16x16)) as f64;
    for i in n & !63..n {
        let (a, b) = ((x.add(2 * i) as *const u16).read_unaligned(), (y.add(2 * i) as *const u16).read_unaligned());
        sumf += (crate::quant::float::f16_to_f32(a) * crate::quant::float::f16_to_f32(b)) as f64;
    }
    sumf as f32
}
