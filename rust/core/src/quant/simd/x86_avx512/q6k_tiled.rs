//! Q6_K in the order of llama.cpp's tiled K-quant matmul (prefill of 8 or more tokens; see the AVX2
//! `orders::vec_dot_q6_k_q8_k_tiled`) on AVX-512 VNNI, with the weight rows in vector lanes ([`super::lanes`]).
//!
//! Per super-block, llama.cpp forms one exact integer `isum = sum_s scale_s * dot(code_s, q8_s) - 32 * sum_s
//! scale_s * bsum_s` over the 16 sub-blocks of 16 elements, then `acc += (d * isum) * yd` (a multiply, an FMA).
//! Here, per lane (weight row) and token: a sub-block's `dot` is 4 `vpdpbusd` with the token's 4 quants
//! broadcast, times its scale by `vpmulld` (|isum| < 2^29, so i32 holds it; f32 would round, unlike the Q4_K GEMM's
//! smaller sums); the bias term is 8 `vpmaddwd` of (scale_2i, scale_2i+1) i16 pairs with the token's bsums, which
//! lie in pairs in Q8_K. The i32 `isum` converts to the f32 llama.cpp converts.

use std::arch::x86_64::*;

use super::lanes::{LaneKernel, RowOffsets, LANES, TOKENS};
use crate::quant::format::{Q6_K_BYTES, Q8_K_BYTES, QK_K};

const Q8K_QS: usize = 4;
const Q8K_BSUMS: usize = 4 + QK_K;

/// One super-block of 16 weight rows, transposed: vector `g` of `q` holds codes `4g .. 4g + 4` (0..=63) of each
/// row (one row per lane), `sc[s]` sub-block `s`'s scale per row (i32), `sc_pairs[i]` scales `2i` and `2i + 1`
/// per row (two i16 in each lane), `d` the super-block scale per row. Rows past the tile's end are 0.
#[repr(C, align(64))]
#[derive(Clone, Copy)]
pub(super) struct Q6kPacked {
    q: [[u8; 64]; QK_K / 4],
    sc: [[i32; LANES]; 16],
    sc_pairs: [[u32; LANES]; 8],
    d: [f32; LANES],
}

/// The tiled Q6_K matmul's sums.
pub(super) struct Q6kTiled;

impl LaneKernel for Q6kTiled {
    type Packed = Q6kPacked;
    const ZERO: Q6kPacked =
        Q6kPacked { q: [[0; 64]; QK_K / 4], sc: [[0; LANES]; 16], sc_pairs: [[0; LANES]; 8], d: [0.0; LANES] };

    unsafe fn pack(x: *const u8, ws: usize, nr: usize, sb: usize, p: &mut Q6kPacked) {
        pack(x, ws, nr, sb, p)
    }

    unsafe fn products<const T: usize>(nb: usize, p: &[Q6kPacked], y: *const u8, ys: usize) -> [[f32; LANES]; T] {
        products::<T>(nb, p, y, ys)
    }
}

/// A row's super-block's 256 codes in element order (AVX2's unpacking: per 128 elements, `ql` gives the low 4
/// bits of elements l and l + 64 (low, high nibble of byte l) and of l + 32 and l + 96 (byte l + 32); `qh` byte
/// l gives their high 2 bits, in bits 0-1, 2-3, 4-5 and 6-7 for l, l + 32, l + 64, l + 96).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn unpack_codes(xb: *const u8, out: *mut u8) {
    let (m3, m15) = (_mm256_set1_epi8(3), _mm256_set1_epi8(15));
    for h in 0..QK_K / 128 {
        let ql0 = _mm256_loadu_si256(xb.add(64 * h) as *const __m256i);
        let ql1 = _mm256_loadu_si256(xb.add(64 * h + 32) as *const __m256i);
        let qh = _mm256_loadu_si256(xb.add(128 + 32 * h) as *const __m256i);
        let hi0 = _mm256_slli_epi16::<4>(_mm256_and_si256(qh, m3));
        let hi1 = _mm256_slli_epi16::<2>(_mm256_and_si256(qh, _mm256_set1_epi8(12)));
        let hi2 = _mm256_and_si256(qh, _mm256_set1_epi8(48));
        let hi3 = _mm256_srli_epi16::<2>(_mm256_and_si256(qh, _mm256_set1_epi8(-64)));
        let codes = [
            _mm256_or_si256(_mm256_and_si256(ql0, m15), hi0),
            _mm256_or_si256(_mm256_and_si256(ql1, m15), hi1),
            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16::<4>(ql0), m15), hi2),
            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16::<4>(ql1), m15), hi3),
        ];
        for (k, c) in codes.iter().enumerate() {
            _mm256_storeu_si256(out.add(128 * h + 32 * k) as *mut __m256i, *c);
        }
    }
}

#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn pack(x: *const u8, ws: usize, nr: usize, sb: usize, p: &mut Q6kPacked) {
    debug_assert!((1..=LANES).contains(&nr));
    // The rows' codes in element order, then transposed 4 codes (one dword) at a time.
    let mut codes = [[0u8; QK_K]; LANES];
    for (r, c) in codes.iter_mut().enumerate().take(nr) {
        unpack_codes(x.add(r * ws + sb * Q6_K_BYTES), c.as_mut_ptr());
    }
    let rows = RowOffsets::new(QK_K, nr);
    for g in 0..QK_K / 4 {
        _mm512_store_si512(p.q[g].as_mut_ptr() as *mut __m512i, rows.gather(codes[0].as_ptr().add(4 * g)));
    }
    for r in 0..LANES {
        if r >= nr {
            p.d[r] = 0.0;
            p.sc.iter_mut().for_each(|s| s[r] = 0);
            p.sc_pairs.iter_mut().for_each(|s| s[r] = 0);
            continue;
        }
        let xb = std::slice::from_raw_parts(x.add(r * ws + sb * Q6_K_BYTES), Q6_K_BYTES);
        p.d[r] = half::f16::from_le_bytes([xb[208], xb[209]]).to_f32();
        let sc = |s: usize| xb[192 + s] as i8;
        for s in 0..16 {
            p.sc[s][r] = sc(s) as i32;
        }
        for i in 0..8 {
            p.sc_pairs[i][r] = sc(2 * i) as i16 as u16 as u32 | (sc(2 * i + 1) as i16 as u16 as u32) << 16;
        }
    }
}

#[allow(clippy::needless_range_loop)] // tokens and sub-blocks index several arrays each
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn products<const T: usize>(nb: usize, p: &[Q6kPacked], y: *const u8, ys: usize) -> [[f32; LANES]; T] {
    debug_assert!(T <= TOKENS && p.len() >= nb);
    let mut acc = [_mm512_setzero_ps(); T];
    for (sb, pb) in p.iter().enumerate().take(nb) {
        let mut yb = [std::ptr::null::<u8>(); T];
        let mut isum = [_mm512_setzero_si512(); T];
        for t in 0..T {
            yb[t] = y.add(t * ys + sb * Q8_K_BYTES);
        }
        // Two sub-blocks (32 elements) at a time: 8 independent `vpdpbusd` chains for 4 tokens.
        for s2 in 0..8 {
            let mut dot = [[_mm512_setzero_si512(); 2]; T];
            for k in 0..4 {
                let w0 = _mm512_load_si512(pb.q[8 * s2 + k].as_ptr() as *const __m512i);
                let w1 = _mm512_load_si512(pb.q[8 * s2 + 4 + k].as_ptr() as *const __m512i);
                for t in 0..T {
                    let a = yb[t].add(Q8K_QS + 32 * s2 + 4 * k) as *const i32;
                    dot[t][0] = _mm512_dpbusd_epi32(dot[t][0], w0, _mm512_set1_epi32(a.read_unaligned()));
                    dot[t][1] = _mm512_dpbusd_epi32(dot[t][1], w1, _mm512_set1_epi32(a.add(4).read_unaligned()));
                }
            }
            let sc0 = _mm512_load_si512(pb.sc[2 * s2].as_ptr() as *const __m512i);
            let sc1 = _mm512_load_si512(pb.sc[2 * s2 + 1].as_ptr() as *const __m512i);
            for t in 0..T {
                let s = _mm512_add_epi32(_mm512_mullo_epi32(dot[t][0], sc0), _mm512_mullo_epi32(dot[t][1], sc1));
                isum[t] = _mm512_add_epi32(isum[t], s);
            }
        }
        let d = _mm512_load_ps(pb.d.as_ptr());
        for t in 0..T {
            let bsums = yb[t].add(Q8K_BSUMS) as *const i32;
            let mut bias = _mm512_setzero_si512();
            for i in 0..8 {
                let pairs = _mm512_load_si512(pb.sc_pairs[i].as_ptr() as *const __m512i);
                bias = _mm512_add_epi32(bias, _mm512_madd_epi16(pairs, _mm512_set1_epi32(bsums.add(i).read_unaligned())));
            }
            let total = _mm512_sub_epi32(isum[t], _mm512_slli_epi32::<5>(bias));
            let res = _mm512_mul_ps(d, _mm512_cvtepi32_ps(total));
            let yd = _mm512_set1_ps((yb[t] as *const f32).read_unaligned());
            acc[t] = _mm512_fmadd_ps(res, yd, acc[t]);
        }
    }
    let mut out = [[0.0f32; LANES]; T];
    for t in 0..T {
        _mm512_storeu_ps(out[t].as_mut_ptr(), acc[t]);
    }
    out
}
