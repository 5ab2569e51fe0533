//! K-quant tiles with 512-bit integer products: the same exact integer sums as the AVX2 tiles, two activation
//! rows per instruction, then the AVX2 tiles' float steps, so every product keeps its kernel's bits.

use std::arch::x86_64::*;

use crate::quant::format::{Q4_K_BYTES, Q8_K_BYTES, QK_K};
use crate::quant::simd::x86_avx2::kquants::{f32_at, k4_min_prod, k4_mins_and_scales, shuffle_k4};
use crate::quant::simd::x86_avx2::orders::{hsums_4x8, transpose4};
use crate::quant::simd::x86_avx2::prims::{f16_at, load256};

const Q8K_QS: usize = 4;
const Q8K_BSUMS: usize = 4 + QK_K;

/// The 32-byte loads at `p0` and `p1` side by side.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c")]
unsafe fn load_pair(p0: *const u8, p1: *const u8) -> __m512i {
    _mm512_inserti64x4::<1>(_mm512_castsi256_si512(load256(p0)), load256(p1))
}

/// The repacked Q4_K GEMM order (`vec_dot_q4_k_q8_k_repacked_gemm`) for one weight row and `C` activation rows
/// (`ys` bytes apart; C = 4 or 8), as the AVX2 `q4_k_repacked_gemm_1xc` but with each pair of activation rows'
/// `maddubs`/`madd` products in one 512-bit instruction (the weight's nibbles and scales broadcast to both
/// halves). The per-64-element integer sums are exact, so they and the FMA chains after them are the AVX2 tile's.
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c")]
pub(super) unsafe fn q4_k_repacked_gemm_1xc<const C: usize>(
    nb: usize,
    x: *const u8,
    _xs: usize,
    y: *const u8,
    ys: usize,
) -> [[f32; C]; 1] {
    let m4 = _mm256_set1_epi8(0xF);
    let mut acc = [[_mm_setzero_ps(); 2]; 2]; // [group of 4 columns][acc, acc_min]; C <= 8
    debug_assert!(C.is_multiple_of(4) && C <= 8);
    for i in 0..nb {
        let xb = x.add(i * Q4_K_BYTES);
        let ms = k4_mins_and_scales(xb.add(4)); // 8 scales, then 8 mins (i16)
        let sc128 = _mm256_castsi256_si128(ms);
        let scales = _mm256_set_m128i(sc128, sc128);
        let mut q = [_mm512_setzero_si512(); 8];
        let mut sc = [_mm512_setzero_si512(); 8];
        for j in 0..QK_K / 64 {
            let bits = load256(xb.add(16 + 32 * j));
            q[2 * j] = _mm512_broadcast_i64x4(_mm256_and_si256(bits, m4));
            q[2 * j + 1] = _mm512_broadcast_i64x4(_mm256_and_si256(_mm256_srli_epi16::<4>(bits), m4));
            sc[2 * j] = _mm512_broadcast_i64x4(shuffle_k4(scales, 2 * j));
            sc[2 * j + 1] = _mm512_broadcast_i64x4(shuffle_k4(scales, 2 * j + 1));
        }
        let (dw, dminw) = (_mm_set1_ps(f16_at(xb)), _mm_set1_ps(f16_at(xb.add(2))));
        for (g, acc) in acc.iter_mut().enumerate().take(C / 4) {
            let mut isum = [_mm_setzero_si128(); 4];
            let mut imin = [_mm_setzero_si128(); 4];
            let mut yd = [0.0f32; 4];
            for pair in 0..2 {
                let c = 2 * pair;
                let (y0, y1) = (y.add((4 * g + c) * ys + i * Q8_K_BYTES), y.add((4 * g + c + 1) * ys + i * Q8_K_BYTES));
                let mut u = [_mm512_setzero_si512(); 4];
                for (j, uj) in u.iter_mut().enumerate() {
                    let (k0, k1) = (2 * j, 2 * j + 1);
                    let a0 = load_pair(y0.add(Q8K_QS + 32 * k0), y1.add(Q8K_QS + 32 * k0));
                    let a1 = load_pair(y0.add(Q8K_QS + 32 * k1), y1.add(Q8K_QS + 32 * k1));
                    let p0 = _mm512_maddubs_epi16(q[k0], a0);
                    let p1 = _mm512_maddubs_epi16(q[k1], a1);
                    *uj = _mm512_add_epi32(_mm512_madd_epi16(sc[k0], p0), _mm512_madd_epi16(sc[k1], p1));
                }
                // (Plain loops: a closure would not inherit this function's target features, nor inline.)
                let (mut lo, mut hi) = ([_mm256_setzero_si256(); 4], [_mm256_setzero_si256(); 4]);
                for j in 0..4 {
                    lo[j] = _mm512_castsi512_si256(u[j]);
                    hi[j] = _mm512_extracti64x4_epi64::<1>(u[j]);
                }
                isum[c] = hsums_4x8(lo);
                isum[c + 1] = hsums_4x8(hi);
                for (k, yb) in [(c, y0), (c + 1, y1)] {
                    yd[k] = f32_at(yb);
                    imin[k] = k4_min_prod(ms, yb.add(Q8K_BSUMS));
                }
            }
            let (isum, imin) = (transpose4(isum), transpose4(imin));
            let ydv = _mm_loadu_ps(yd.as_ptr());
            let (d, dmin) = (_mm_mul_ps(dw, ydv), _mm_mul_ps(dminw, ydv));
            for j in 0..QK_K / 64 {
                acc[0] = _mm_fmadd_ps(_mm_cvtepi32_ps(isum[j]), d, acc[0]);
                acc[1] = _mm_fmadd_ps(_mm_cvtepi32_ps(imin[j]), dmin, acc[1]);
            }
        }
    }
    let mut out = [[0.0f32; C]; 1];
    for (g, acc) in acc.iter().enumerate().take(C / 4) {
        _mm_storeu_ps(out[0][4 * g..].as_mut_ptr(), _mm_sub_ps(acc[0], acc[1]));
    }
    out
}
