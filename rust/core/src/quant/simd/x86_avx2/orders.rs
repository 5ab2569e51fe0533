//! K-quant dot products in the float summation orders of llama.cpp's matmul paths other than
//! `ggml_vec_dot_*` (on AVX2 CPUs, with default settings):
//!
//! - repacked Q4_K (`CPU_REPACK` buffers, used for Q4_K weights with a row count divisible by 8 unless
//!   llama.cpp runs with `--no-repack`): `ggml_gemv_q4_K_8x8_q8_K` for single activation rows and
//!   `ggml_gemm_q4_K_8x8_q8_K` for activation rows in groups of four (arch/x86/repack.cpp);
//! - the "tiled" K-quant matmul (ggml-cpu/tiled/, used for non-repacked Q2_K .. Q6_K weights when a matmul has
//!   8 or more activation rows, unless `GGML_CPU_TILED_MM=0`).
//!
//! All of them keep one f32 accumulator per output and add each block's exact integer sums in a sequential
//! FMA chain; the integer sums are those of the `ggml_vec_dot_*` kernels (shared helpers in `kquants.rs`).

use std::arch::x86_64::*;

use super::kquants::{
    f32_at, k4_min_prod, k4_mins_and_scales, q2_k_ints, q3_k_ints, q4_k_block_sumi, q5_k_block_sumi, q6_k_ints,
    q6_k_ints_unpacked, q6_k_unpack, shuffle_k4,
};
use super::prims::{f16_at, f16_at_tail, hsum_i32_4, hsum_i32_8, load256, prefetch_ahead};
use crate::quant::format::{Q2_K_BYTES, Q3_K_BYTES, Q4_K_BYTES, Q5_K_BYTES, Q6_K_BYTES, Q8_K_BYTES, QK_K};

const Q8K_QS: usize = 4;
const Q8K_BSUMS: usize = 4 + QK_K;

// ---------------------------------------------------------------------------------------------------------------
// Repacked Q4_K
// ---------------------------------------------------------------------------------------------------------------

/// `ggml_gemv_q4_K_8x8_q8_K`: per super-block, `acc += isum * (d * yd)` and `acc_min += isum_min * (dmin * yd)`
/// (FMAs); the result is `acc - acc_min`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn vec_dot_q4_k_q8_k_repacked(nb: usize, x: *const u8, y: *const u8) -> f32 {
    let mut acc = 0.0f32;
    let mut acc_min = 0.0f32;
    for i in 0..nb {
        let (xb, yb) = (x.add(i * Q4_K_BYTES), y.add(i * Q8_K_BYTES));
        prefetch_ahead::<2>(xb); // a 144-byte block
        let yd = f32_at(yb);
        let mins_and_scales = k4_mins_and_scales(xb.add(4));
        let isum_min = hsum_i32_4(k4_min_prod(mins_and_scales, yb.add(Q8K_BSUMS)));
        let isum = hsum_i32_8(q4_k_block_sumi(xb, yb, mins_and_scales));
        acc = (isum as f32).mul_add(f16_at(xb) * yd, acc);
        acc_min = (isum_min as f32).mul_add(f16_at(xb.add(2)) * yd, acc_min);
    }
    acc - acc_min
}

/// `ggml_gemm_q4_K_8x8_q8_K`: like [`vec_dot_q4_k_q8_k_repacked`], but the two FMA chains take one step per 64
/// elements (two sub-blocks) instead of one per super-block.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn vec_dot_q4_k_q8_k_repacked_gemm(nb: usize, x: *const u8, y: *const u8) -> f32 {
    let m4 = _mm256_set1_epi8(0xF);
    let ones = _mm256_set1_epi16(1);
    let mut acc = 0.0f32;
    let mut acc_min = 0.0f32;
    for i in 0..nb {
        let (xb, yb) = (x.add(i * Q4_K_BYTES), y.add(i * Q8_K_BYTES));
        let yd = f32_at(yb);
        let (d, dmin) = (f16_at(xb) * yd, f16_at(xb.add(2)) * yd);
        // 8 scales then 8 mins, as i16.
        let mut sm = [0i16; 16];
        _mm256_storeu_si256(sm.as_mut_ptr() as *mut __m256i, k4_mins_and_scales(xb.add(4)));
        let mut bs = [0i16; 16];
        _mm256_storeu_si256(bs.as_mut_ptr() as *mut __m256i, load256(yb.add(Q8K_BSUMS)));
        let (sm, bs) = (sm.map(i32::from), bs.map(i32::from));
        for j in 0..QK_K / 64 {
            let q4bits = load256(xb.add(16 + 32 * j));
            let q8 = yb.add(Q8K_QS + 64 * j);
            let lo = _mm256_maddubs_epi16(_mm256_and_si256(q4bits, m4), load256(q8));
            let hi = _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16::<4>(q4bits), m4), load256(q8.add(32)));
            let dot_lo = hsum_i32_8(_mm256_madd_epi16(lo, ones));
            let dot_hi = hsum_i32_8(_mm256_madd_epi16(hi, ones));
            let isum = sm[2 * j] * dot_lo + sm[2 * j + 1] * dot_hi;
            let isum_min =
                sm[8 + 2 * j] * (bs[4 * j] + bs[4 * j + 1]) + sm[9 + 2 * j] * (bs[4 * j + 2] + bs[4 * j + 3]);
            acc = (isum as f32).mul_add(d, acc);
            acc_min = (isum_min as f32).mul_add(dmin, acc_min);
        }
    }
    acc - acc_min
}

// ---------------------------------------------------------------------------------------------------------------
// Tiled K-quant matmul (`tiled_run_microtile`, AVX2 + FMA build): per super-block
// `res = d * isum`, `res = res - dmin * isum_min` (one FMA), `acc += res * yd` (FMA)
// ---------------------------------------------------------------------------------------------------------------

/// One step of the tiled chain.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tiled_step(acc: f32, d: f32, isum: i32, dmin_isum_min: Option<(f32, i32)>, yd: f32) -> f32 {
    let mut res = d * isum as f32;
    if let Some((dmin, isum_min)) = dmin_isum_min {
        res = (-dmin).mul_add(isum_min as f32, res);
    }
    res.mul_add(yd, acc)
}

#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn vec_dot_q2_k_q8_k_tiled(nb: usize, x: *const u8, y: *const u8) -> f32 {
    let mut acc = 0.0f32;
    for i in 0..nb {
        let (xb, yb) = (x.add(i * Q2_K_BYTES), y.add(i * Q8_K_BYTES));
        let (sumi, prod) = q2_k_ints(xb, yb);
        let min = (f16_at_tail(xb.add(82)), hsum_i32_8(prod));
        acc = tiled_step(acc, f16_at_tail(xb.add(80)), hsum_i32_8(sumi), Some(min), f32_at(yb));
    }
    acc
}

#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn vec_dot_q3_k_q8_k_tiled(nb: usize, x: *const u8, y: *const u8) -> f32 {
    let mut acc = 0.0f32;
    for i in 0..nb {
        let (xb, yb) = (x.add(i * Q3_K_BYTES), y.add(i * Q8_K_BYTES));
        acc = tiled_step(acc, f16_at_tail(xb.add(108)), hsum_i32_8(q3_k_ints(xb, yb)), None, f32_at(yb));
    }
    acc
}

#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn vec_dot_q4_k_q8_k_tiled(nb: usize, x: *const u8, y: *const u8) -> f32 {
    let mut acc = 0.0f32;
    for i in 0..nb {
        let (xb, yb) = (x.add(i * Q4_K_BYTES), y.add(i * Q8_K_BYTES));
        let mins_and_scales = k4_mins_and_scales(xb.add(4));
        let min = (f16_at(xb.add(2)), hsum_i32_4(k4_min_prod(mins_and_scales, yb.add(Q8K_BSUMS))));
        let isum = hsum_i32_8(q4_k_block_sumi(xb, yb, mins_and_scales));
        acc = tiled_step(acc, f16_at(xb), isum, Some(min), f32_at(yb));
    }
    acc
}

#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn vec_dot_q5_k_q8_k_tiled(nb: usize, x: *const u8, y: *const u8) -> f32 {
    let mut acc = 0.0f32;
    for i in 0..nb {
        let (xb, yb) = (x.add(i * Q5_K_BYTES), y.add(i * Q8_K_BYTES));
        let mins_and_scales = k4_mins_and_scales(xb.add(4));
        let min = (f16_at(xb.add(2)), hsum_i32_4(k4_min_prod(mins_and_scales, yb.add(Q8K_BSUMS))));
        let isum = hsum_i32_8(q5_k_block_sumi(xb, yb, mins_and_scales));
        acc = tiled_step(acc, f16_at(xb), isum, Some(min), f32_at(yb));
    }
    acc
}

#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn vec_dot_q6_k_q8_k_tiled(nb: usize, x: *const u8, y: *const u8) -> f32 {
    let mut acc = 0.0f32;
    for i in 0..nb {
        let (xb, yb) = (x.add(i * Q6_K_BYTES), y.add(i * Q8_K_BYTES));
        let (sumi, q8sclsub) = q6_k_ints(xb, yb);
        let isum = hsum_i32_8(_mm256_sub_epi32(sumi, q8sclsub));
        acc = tiled_step(acc, f16_at_tail(xb.add(208)), isum, None, f32_at(yb));
    }
    acc
}

// ---------------------------------------------------------------------------------------------------------------
// Tiles: several dot products per call, each summed exactly as the single kernel above sums it
// ---------------------------------------------------------------------------------------------------------------

/// The four i32 of `v[0]`, `v[1]`, `v[2]`, `v[3]` transposed: result `j` holds lane `j` of each.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn transpose4(v: [__m128i; 4]) -> [__m128i; 4] {
    let t0 = _mm_unpacklo_epi32(v[0], v[1]);
    let t1 = _mm_unpacklo_epi32(v[2], v[3]);
    let t2 = _mm_unpackhi_epi32(v[0], v[1]);
    let t3 = _mm_unpackhi_epi32(v[2], v[3]);
    [_mm_unpacklo_epi64(t0, t1), _mm_unpackhi_epi64(t0, t1), _mm_unpacklo_epi64(t2, t3), _mm_unpackhi_epi64(t2, t3)]
}

/// The lane sums of four i32 vectors: [sum v0, sum v1, sum v2, sum v3]. Exact.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn hsums_4x8(v: [__m256i; 4]) -> __m128i {
    let s = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
    _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256::<1>(s))
}

/// [`vec_dot_q4_k_q8_k_repacked_gemm`] for one weight row and `C` activation rows (`ys` bytes apart; C a
/// multiple of 4): the weight's nibbles and scales are unpacked once per super-block; per column, each 32-element
/// product is scaled in its `madd` and the four 64-element integer sums come out of one reduction; the FMA chains
/// of four columns run side by side in the lanes of one vector (each lane the same sequential chain as the single
/// kernel).
#[target_feature(enable = "avx2,fma,f16c")]
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
        let mut q = [_mm256_setzero_si256(); 8];
        let mut sc = [_mm256_setzero_si256(); 8];
        for j in 0..QK_K / 64 {
            let bits = load256(xb.add(16 + 32 * j));
            q[2 * j] = _mm256_and_si256(bits, m4);
            q[2 * j + 1] = _mm256_and_si256(_mm256_srli_epi16::<4>(bits), m4);
            sc[2 * j] = shuffle_k4(scales, 2 * j);
            sc[2 * j + 1] = shuffle_k4(scales, 2 * j + 1);
        }
        let (dw, dminw) = (_mm_set1_ps(f16_at(xb)), _mm_set1_ps(f16_at(xb.add(2))));
        for (g, acc) in acc.iter_mut().enumerate().take(C / 4) {
            let mut isum = [_mm_setzero_si128(); 4];
            let mut imin = [_mm_setzero_si128(); 4];
            let mut yd = [0.0f32; 4];
            for c in 0..4 {
                let yb = y.add((4 * g + c) * ys + i * Q8_K_BYTES);
                yd[c] = f32_at(yb);
                // isum_j = scale[2j] * dot(lo nibbles) + scale[2j + 1] * dot(hi nibbles), j = 0..4. (Plain
                // loops: a closure here would not inherit this function's target features, nor inline.)
                let mut u = [_mm256_setzero_si256(); 4];
                for (j, uj) in u.iter_mut().enumerate() {
                    let (k0, k1) = (2 * j, 2 * j + 1);
                    let p0 = _mm256_maddubs_epi16(q[k0], load256(yb.add(Q8K_QS + 32 * k0)));
                    let p1 = _mm256_maddubs_epi16(q[k1], load256(yb.add(Q8K_QS + 32 * k1)));
                    *uj = _mm256_add_epi32(_mm256_madd_epi16(sc[k0], p0), _mm256_madd_epi16(sc[k1], p1));
                }
                isum[c] = hsums_4x8(u);
                imin[c] = k4_min_prod(ms, yb.add(Q8K_BSUMS));
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

/// [`vec_dot_q6_k_q8_k_tiled`] for one weight row and four activation rows (`ys` bytes apart): the 6-bit codes
/// and scales are unpacked once per super-block, the four columns' integer sums come out of one reduction, and
/// their `tiled_step` chains run in the lanes of one vector.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn q6_k_tiled_1x4(nb: usize, x: *const u8, _xs: usize, y: *const u8, ys: usize) -> [[f32; 4]; 1] {
    let mut acc = _mm_setzero_ps();
    for i in 0..nb {
        let xb = x.add(i * Q6_K_BYTES);
        let w = q6_k_unpack(xb);
        let mut isums = [_mm256_setzero_si256(); 4];
        let mut yd = [0.0f32; 4];
        for (c, s) in isums.iter_mut().enumerate() {
            let yb = y.add(c * ys + i * Q8_K_BYTES);
            yd[c] = f32_at(yb);
            let (sumi, q8sclsub) = q6_k_ints_unpacked(&w, yb);
            *s = _mm256_sub_epi32(sumi, q8sclsub);
        }
        let isum = _mm_cvtepi32_ps(hsums_4x8(isums));
        let res = _mm_mul_ps(_mm_set1_ps(f16_at_tail(xb.add(208))), isum);
        acc = _mm_fmadd_ps(res, _mm_loadu_ps(yd.as_ptr()), acc);
    }
    let mut out = [[0.0f32; 4]; 1];
    _mm_storeu_ps(out[0].as_mut_ptr(), acc);
    out
}

