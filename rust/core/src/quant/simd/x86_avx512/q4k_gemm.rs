//! Repacked Q4_K GEMM on AVX-512 VNNI, with the weight rows in vector lanes ([`super::lanes`]): each product
//! summed exactly as `ggml_gemm_q4_K_8x8_q8_K` sums it (one FMA step per 64 elements, see the AVX2
//! `orders::vec_dot_q4_k_q8_k_repacked_gemm`).
//!
//! Per lane (weight row) and token, a sub-block's integer dot product is 8 `vpdpbusd` with the token's 4 quants
//! broadcast; `isum = scale_lo * dot_lo + scale_hi * dot_hi` is formed in f32, which is exact (|dot| <= 32 * 15 *
//! 128, scales < 64, so |isum| < 2^23), so the converted value is the one llama.cpp converts from its i32 sum. The
//! mins' products `min_lo * (bsums 0 + 1) + min_hi * (bsums 2 + 3)` are one `vpmaddwd` of (min_lo, min_hi) i16
//! pairs with the token's pair of bsum sums. Then, as llama.cpp: `acc += isum * (d * yd)`, `acc_min += imin *
//! (dmin * yd)` per 64 elements, and `acc - acc_min` at the end.

use std::arch::x86_64::*;

use super::lanes::{LaneKernel, RowOffsets, LANES, TOKENS};
use crate::quant::format::{Q4_K_BYTES, Q8_K_BYTES, QK_K};
use crate::quant::kquants::k4_scales_mins;

const Q8K_QS: usize = 4;
const Q8K_BSUMS: usize = 4 + QK_K;

/// One super-block of 16 weight rows, transposed: vector `g` of `q` holds codes `4g .. 4g + 4` of each row (one
/// row per lane), `sc[s]` sub-block `s`'s scale per row (f32), `mins[j]` the mins of sub-blocks `2j` and `2j + 1`
/// per row (two i16 in each lane), `d` and `dmin` the super-block scales per row. Rows past the tile's end are 0.
#[repr(C, align(64))]
#[derive(Clone, Copy)]
pub(super) struct Q4kPacked {
    q: [[u8; 64]; QK_K / 4],
    sc: [[f32; LANES]; 8],
    mins: [[u32; LANES]; 4],
    d: [f32; LANES],
    dmin: [f32; LANES],
}

/// The repacked Q4_K GEMM (`ggml_gemm_q4_K_8x8_q8_K`'s sums).
pub(super) struct Q4kGemm;

impl LaneKernel for Q4kGemm {
    type Packed = Q4kPacked;
    const ZERO: Q4kPacked = Q4kPacked {
        q: [[0; 64]; QK_K / 4],
        sc: [[0.0; LANES]; 8],
        mins: [[0; LANES]; 4],
        d: [0.0; LANES],
        dmin: [0.0; LANES],
    };

    unsafe fn pack(x: *const u8, ws: usize, nr: usize, sb: usize, p: &mut Q4kPacked) {
        pack(x, ws, nr, sb, p)
    }

    unsafe fn products<const T: usize>(nb: usize, p: &[Q4kPacked], y: *const u8, ys: usize) -> [[f32; LANES]; T] {
        products::<T>(nb, p, y, ys)
    }
}

#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn pack(x: *const u8, ws: usize, nr: usize, sb: usize, p: &mut Q4kPacked) {
    debug_assert!((1..=LANES).contains(&nr));
    let m4 = _mm512_set1_epi8(0x0F);
    let rows = RowOffsets::new(ws, nr);
    let qs = x.add(sb * Q4_K_BYTES + 16);
    for j in 0..QK_K / 64 {
        for k in 0..8 {
            // Packed bytes 32j + 4k .. + 4 of every row: low nibbles are codes 64j + 4k .., high ones 64j + 32 + 4k ..
            let v = rows.gather(qs.add(32 * j + 4 * k));
            _mm512_store_si512(p.q[16 * j + k].as_mut_ptr() as *mut __m512i, _mm512_and_si512(v, m4));
            let high = _mm512_and_si512(_mm512_srli_epi16::<4>(v), m4);
            _mm512_store_si512(p.q[16 * j + 8 + k].as_mut_ptr() as *mut __m512i, high);
        }
    }
    for r in 0..LANES {
        if r >= nr {
            p.d[r] = 0.0;
            p.dmin[r] = 0.0;
            p.sc.iter_mut().for_each(|s| s[r] = 0.0);
            p.mins.iter_mut().for_each(|m| m[r] = 0);
            continue;
        }
        let xb = std::slice::from_raw_parts(x.add(r * ws + sb * Q4_K_BYTES), Q4_K_BYTES);
        p.d[r] = half::f16::from_le_bytes([xb[0], xb[1]]).to_f32();
        p.dmin[r] = half::f16::from_le_bytes([xb[2], xb[3]]).to_f32();
        let (sc, mn) = k4_scales_mins(&xb[4..16]);
        for (s, &v) in sc.iter().enumerate() {
            p.sc[s][r] = v as f32;
        }
        for j in 0..4 {
            p.mins[j][r] = mn[2 * j] as u32 | (mn[2 * j + 1] as u32) << 16;
        }
    }
}

#[allow(clippy::needless_range_loop)] // tokens and sub-blocks index several arrays each
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn products<const T: usize>(nb: usize, p: &[Q4kPacked], y: *const u8, ys: usize) -> [[f32; LANES]; T] {
    debug_assert!(T <= TOKENS && p.len() >= nb);
    let mut acc = [_mm512_setzero_ps(); T];
    let mut acc_min = [_mm512_setzero_ps(); T];
    for (sb, pb) in p.iter().enumerate().take(nb) {
        let (d, dmin) = (_mm512_load_ps(pb.d.as_ptr()), _mm512_load_ps(pb.dmin.as_ptr()));
        let mut yb = [std::ptr::null::<u8>(); T];
        let mut dyd = [_mm512_setzero_ps(); T];
        let mut dminyd = [_mm512_setzero_ps(); T];
        let mut bsum_pairs = [[0u32; 4]; T];
        for t in 0..T {
            yb[t] = y.add(t * ys + sb * Q8_K_BYTES);
            let yd = _mm512_set1_ps((yb[t] as *const f32).read_unaligned());
            dyd[t] = _mm512_mul_ps(d, yd);
            dminyd[t] = _mm512_mul_ps(dmin, yd);
            let bs = yb[t].add(Q8K_BSUMS) as *const i16;
            for (j, pair) in bsum_pairs[t].iter_mut().enumerate() {
                // As llama.cpp's `hadd_epi16`: i16 sums of two bsums (each within +-2048, so no wrap).
                let s = |i: usize| bs.add(i).read_unaligned();
                let (lo, hi) = (s(4 * j).wrapping_add(s(4 * j + 1)), s(4 * j + 2).wrapping_add(s(4 * j + 3)));
                *pair = lo as u16 as u32 | (hi as u16 as u32) << 16;
            }
        }
        for j in 0..QK_K / 64 {
            let mut dot = [[_mm512_setzero_si512(); 2]; T];
            for k in 0..8 {
                let w0 = _mm512_load_si512(pb.q[16 * j + k].as_ptr() as *const __m512i);
                let w1 = _mm512_load_si512(pb.q[16 * j + 8 + k].as_ptr() as *const __m512i);
                for t in 0..T {
                    let a = yb[t].add(Q8K_QS + 64 * j + 4 * k) as *const i32;
                    dot[t][0] = _mm512_dpbusd_epi32(dot[t][0], w0, _mm512_set1_epi32(a.read_unaligned()));
                    dot[t][1] = _mm512_dpbusd_epi32(dot[t][1], w1, _mm512_set1_epi32(a.add(8).read_unaligned()));
                }
            }
            let (sc0, sc1) = (_mm512_load_ps(pb.sc[2 * j].as_ptr()), _mm512_load_ps(pb.sc[2 * j + 1].as_ptr()));
            let mins = _mm512_load_si512(pb.mins[j].as_ptr() as *const __m512i);
            for t in 0..T {
                let isum = _mm512_fmadd_ps(
                    _mm512_cvtepi32_ps(dot[t][1]),
                    sc1,
                    _mm512_mul_ps(_mm512_cvtepi32_ps(dot[t][0]), sc0),
                );
                acc[t] = _mm512_fmadd_ps(isum, dyd[t], acc[t]);
                let imin = _mm512_madd_epi16(mins, _mm512_set1_epi32(bsum_pairs[t][j] as i32));
                acc_min[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(imin), dminyd[t], acc_min[t]);
            }
        }
    }
    let mut out = [[0.0f32; LANES]; T];
    for t in 0..T {
        _mm512_storeu_ps(out[t].as_mut_ptr(), _mm512_sub_ps(acc[t], acc_min[t]));
    }
    out
}
