//! Single-row kernels over several activation rows: one weight row against `C` activation rows (2..=8), each
//! product summed exactly as the single-row (decode) kernel sums it, for matmuls whose every row must equal a
//! decode step (speculative decoding's verify pass, `RowOrder::AsSteps`) and for the rows llama.cpp's batch
//! paths also hand to the single-row kernel.
//!
//! Per super-block the weight block is unpacked once (nibbles or 6-bit codes, scales, mins) and applied to every
//! column; per column the integer products are the single kernel's (`maddubs` pairs, `madd` with the same scale
//! lanes; the integer sums are exact whatever their grouping) and the float steps are its own on the same
//! values, in lanes side by side (repacked Q4_K and Q4_0) or in a register per column (Q6_K), with the same horizontal
//! reductions at the end.

use std::arch::x86_64::*;

use super::kquants::{f32_at, k4_min_prod, k4_mins_and_scales, q6_k_ints_unpacked, q6_k_unpack, shuffle_k4};
use super::prims::{bytes_from_nibbles_32, f16_at, f16_at_tail, hsum_float_8, load256, prefetch_ahead};
use crate::quant::format::{Q4_0_BYTES, Q4_K_BYTES, Q6_K_BYTES, Q8_0_BYTES, Q8_K_BYTES, QK_K};

const Q8K_QS: usize = 4;
const Q8K_BSUMS: usize = 4 + QK_K;

/// The lane sums of four i32 vectors: [sum v0, sum v1, sum v2, sum v3]. Exact.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn hsums_4x8(v: [__m256i; 4]) -> __m128i {
    let s = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
    _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256::<1>(s))
}

/// The lane sums of four 4-lane i32 vectors: [sum v0, sum v1, sum v2, sum v3]. Exact.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn hsums_4x4(v: [__m128i; 4]) -> __m128i {
    _mm_hadd_epi32(_mm_hadd_epi32(v[0], v[1]), _mm_hadd_epi32(v[2], v[3]))
}

/// [`super::orders::vec_dot_q4_k_q8_k_repacked`] (llama.cpp's `ggml_gemv_q4_K_8x8_q8_K`) for one weight row and
/// `C` activation rows (`ys` bytes apart, 1 <= C <= 8): per super-block the nibbles, scales and mins are unpacked
/// once; per column the super-block's integer sum and mins sum are exact, and the two FMA chains
/// (`acc += isum * (d * yd)`, `acc_min += isum_min * (dmin * yd)`) of four columns run in the lanes of one
/// vector, each lane the single kernel's sequential chain; the result is `acc - acc_min` per lane.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn q4_k_repacked_gemv_1xc<const C: usize>(
    nb: usize,
    x: *const u8,
    y: *const u8,
    ys: usize,
) -> [f32; C] {
    debug_assert!((1..=8).contains(&C));
    let m4 = _mm256_set1_epi8(0xF);
    let mut acc = [[_mm_setzero_ps(); 2]; 2]; // [group of 4 columns][acc, acc_min]
    for i in 0..nb {
        let xb = x.add(i * Q4_K_BYTES);
        prefetch_ahead::<2>(xb); // a 144-byte block, as the single kernel
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
        for (g, acc) in acc.iter_mut().enumerate().take(C.div_ceil(4)) {
            // Lanes past C stay zero (zero sums times a zero scale).
            let mut isum = [_mm256_setzero_si256(); 4];
            let mut imin = [_mm_setzero_si128(); 4];
            let mut yd = [0.0f32; 4];
            for c in 0..(C - 4 * g).min(4) {
                let yb = y.add((4 * g + c) * ys + i * Q8_K_BYTES);
                yd[c] = f32_at(yb);
                // The single kernel's `q4_k_block_sumi` lanes on the unpacked nibbles.
                let mut s = _mm256_setzero_si256();
                for j in 0..QK_K / 64 {
                    let q8 = yb.add(Q8K_QS + 64 * j);
                    let p0 = _mm256_madd_epi16(sc[2 * j], _mm256_maddubs_epi16(q[2 * j], load256(q8)));
                    let p1 = _mm256_madd_epi16(sc[2 * j + 1], _mm256_maddubs_epi16(q[2 * j + 1], load256(q8.add(32))));
                    s = _mm256_add_epi32(s, _mm256_add_epi32(p0, p1));
                }
                isum[c] = s;
                imin[c] = k4_min_prod(ms, yb.add(Q8K_BSUMS));
            }
            let ydv = _mm_loadu_ps(yd.as_ptr());
            let (d, dmin) = (_mm_mul_ps(dw, ydv), _mm_mul_ps(dminw, ydv));
            acc[0] = _mm_fmadd_ps(_mm_cvtepi32_ps(hsums_4x8(isum)), d, acc[0]);
            acc[1] = _mm_fmadd_ps(_mm_cvtepi32_ps(hsums_4x4(imin)), dmin, acc[1]);
        }
    }
    let mut all = [0.0f32; 8];
    for (g, acc) in acc.iter().enumerate().take(C.div_ceil(4)) {
        _mm_storeu_ps(all[4 * g..].as_mut_ptr(), _mm_sub_ps(acc[0], acc[1]));
    }
    let mut out = [0.0f32; C];
    out.copy_from_slice(&all[..C]);
    out
}

/// [`super::kquants::vec_dot_q6_k_q8_k`] (llama.cpp's `ggml_vec_dot_q6_K_q8_K`) for one weight row and `C`
/// activation rows (`ys` bytes apart, 1 <= C <= 8): per super-block the 6-bit codes and scales are unpacked
/// once; per column the same eight i32 lanes, the same `fmadd` by `d` into its own eight f32 lanes, and the same
/// horizontal sum at the end.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn q6_k_1xc<const C: usize>(nb: usize, x: *const u8, y: *const u8, ys: usize) -> [f32; C] {
    debug_assert!((1..=8).contains(&C));
    let mut acc = [_mm256_setzero_ps(); C];
    for i in 0..nb {
        let xb = x.add(i * Q6_K_BYTES);
        prefetch_ahead::<3>(xb); // a 210-byte block, as the single kernel
        let w = q6_k_unpack(xb);
        let dx = f16_at_tail(xb.add(208));
        for (c, acc) in acc.iter_mut().enumerate() {
            let yb = y.add(c * ys + i * Q8_K_BYTES);
            let d = f32_at(yb) * dx;
            let (sumi, q8sclsub) = q6_k_ints_unpacked(&w, yb);
            let sumi = _mm256_sub_epi32(sumi, q8sclsub);
            *acc = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi), *acc);
        }
    }
    let mut out = [0.0f32; C];
    for (o, &a) in out.iter_mut().zip(&acc) {
        *o = hsum_float_8(a);
    }
    out
}

/// [`super::legacy::vec_dot_q4_0_q8_0_repacked`] (llama.cpp's `ggml_gemv_q4_0_8x8_q8_0`, which its GEMM
/// repeats) for one weight row and `C` activation rows (`ys` bytes apart, 1 <= C <= 8): per block the nibbles
/// are unpacked once; per column the block's integer dot is exact (the single kernel's `sign`/`maddubs`/`madd`
/// lanes), and the sequential chains `acc += isum * (d_x * d_y)` of four columns run in the lanes of one vector.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn q4_0_repacked_gemv_1xc<const C: usize>(
    nb: usize,
    x: *const u8,
    y: *const u8,
    ys: usize,
) -> [f32; C] {
    debug_assert!((1..=8).contains(&C));
    let ones = _mm256_set1_epi16(1);
    let mut acc = [_mm_setzero_ps(); 2]; // per group of 4 columns
    for i in 0..nb {
        let xb = x.add(i * Q4_0_BYTES);
        let qx = _mm256_sub_epi8(bytes_from_nibbles_32(xb.add(2)), _mm256_set1_epi8(8));
        let ax = _mm256_sign_epi8(qx, qx);
        let dx = _mm_set1_ps(f16_at(xb));
        for (g, acc) in acc.iter_mut().enumerate().take(C.div_ceil(4)) {
            // Lanes past C stay zero (zero sums times a zero scale).
            let mut isum = [_mm256_setzero_si256(); 4];
            let mut dy = [0.0f32; 4];
            for c in 0..(C - 4 * g).min(4) {
                let yb = y.add((4 * g + c) * ys + i * Q8_0_BYTES);
                dy[c] = f16_at(yb);
                let p16 = _mm256_maddubs_epi16(ax, _mm256_sign_epi8(load256(yb.add(2)), qx));
                isum[c] = _mm256_madd_epi16(ones, p16);
            }
            let d = _mm_mul_ps(dx, _mm_loadu_ps(dy.as_ptr()));
            *acc = _mm_fmadd_ps(_mm_cvtepi32_ps(hsums_4x8(isum)), d, *acc);
        }
    }
    let mut all = [0.0f32; 8];
    for (g, acc) in acc.iter().enumerate().take(C.div_ceil(4)) {
        _mm_storeu_ps(all[4 * g..].as_mut_ptr(), *acc);
    }
    let mut out = [0.0f32; C];
    out.copy_from_slice(&all[..C]);
    out
}
