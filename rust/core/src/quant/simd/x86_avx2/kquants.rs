//! AVX2 kernels of the K-quant formats: dot products with Q8_K activations after llama.cpp's
//! `ggml_vec_dot_q{2,3,4,5,6}_K_q8_K` (arch/x86/quants.c), and the Q8_K activation quantizer (byte-exact with
//! the scalar `kquants::quantize_q8_k`, llama.cpp's `quantize_row_q8_K_ref`, which its x86 build also runs).
//!
//! Per super-block the integer part is summed exactly into eight i32 lanes with the lane layout of llama.cpp
//! (`maddubs` pairs, then `madd` with the sub-block scales), converted to f32 once, and accumulated with one
//! `fmadd` by `d`; the mins go through Q8_K's `bsums` in the same lane/scalar shape as llama.cpp's.
//!
//! Block layouts (see `quant/kquants.rs`): Q2_K scales@0 qs@16 d@80 dmin@82; Q3_K hmask@0 qs@32 scales@96
//! d@108; Q4_K d@0 dmin@2 scales@4 qs@16; Q5_K d@0 dmin@2 scales@4 qh@16 qs@48; Q6_K ql@0 qh@128 scales@192
//! d@208; Q8_K d(f32)@0 qs@4 bsums(i16)@260.

use std::arch::x86_64::*;

use super::prims::{
    abs_max_lanes, f16_at, f16_at_tail, hmax_ps, hsum_float_8, hsum_i32_4, load128, load256, nearest_int,
    pack_low_bytes, prefetch_ahead, sum_i8_groups8,
};
use crate::quant::format::{Q2_K_BYTES, Q3_K_BYTES, Q4_K_BYTES, Q5_K_BYTES, Q6_K_BYTES, Q8_K_BYTES, QK_K};

const Q8K_QS: usize = 4;
const Q8K_BSUMS: usize = 4 + QK_K;

/// `get_scale_shuffle_q3k`: row i picks i16 scale 2i for the low 128-bit lane and 2i + 1 for the high one.
static SHUFFLE_Q3K: [[u8; 32]; 4] = {
    let mut t = [[0u8; 32]; 4];
    let mut i = 0;
    while i < 4 {
        let mut b = 0;
        while b < 32 {
            let s = 2 * i + b / 16;
            t[i][b] = (2 * s + b % 2) as u8;
            b += 1;
        }
        i += 1;
    }
    t
};

/// `get_scale_shuffle_k4`: row i broadcasts i16 scale i to every lane.
static SHUFFLE_K4: [[u8; 32]; 8] = {
    let mut t = [[0u8; 32]; 8];
    let mut i = 0;
    while i < 8 {
        let mut b = 0;
        while b < 32 {
            t[i][b] = (2 * i + b % 2) as u8;
            b += 1;
        }
        i += 1;
    }
    t
};

/// `get_scale_shuffle`: row i repeats byte 2i eight times, then byte 2i + 1 eight times.
static SHUFFLE_Q6K: [[u8; 16]; 8] = {
    let mut t = [[0u8; 16]; 8];
    let mut i = 0;
    while i < 8 {
        let mut b = 0;
        while b < 16 {
            t[i][b] = (2 * i + b / 8) as u8;
            b += 1;
        }
        i += 1;
    }
    t
};

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn u32_at(p: *const u8) -> u32 {
    (p as *const u32).read_unaligned()
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn f32_at(p: *const u8) -> f32 {
    f32::from_bits(u32_at(p))
}

/// The 16 i16 scales (or mins) `s` as two vectors repeating scales 0..8 and 8..16 in both 128-bit lanes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn split_scales(all: __m256i) -> [__m256i; 2] {
    let l = _mm256_extracti128_si256::<0>(all);
    let h = _mm256_extracti128_si256::<1>(all);
    [_mm256_set_m128i(l, l), _mm256_set_m128i(h, h)]
}

/// `madd` of the i16 products `p` (16 elements per 128-bit lane) with the scales picked by `SHUFFLE_Q3K[k]`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn scale_q3k(scales: __m256i, k: usize, p: __m256i) -> __m256i {
    let shuffle = load256(SHUFFLE_Q3K[k].as_ptr());
    _mm256_madd_epi16(_mm256_shuffle_epi8(scales, shuffle), p)
}

/// Q2_K, one super-block: (`sum_j scale_j * dot_j` in llama.cpp's eight i32 lanes, `min_j * bsum_j` products
/// in eight lanes).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn q2_k_ints(xb: *const u8, yb: *const u8) -> (__m256i, __m256i) {
    let m3 = _mm256_set1_epi8(3);
    let m4 = _mm_set1_epi8(0xF);
    let mins_and_scales = load128(xb);
    let scales8 = _mm_and_si128(mins_and_scales, m4);
    let mins8 = _mm_and_si128(_mm_srli_epi16::<4>(mins_and_scales), m4);
    let mins = _mm256_cvtepi8_epi16(mins8);
    let prod = _mm256_madd_epi16(mins, load256(yb.add(Q8K_BSUMS)));

    let scales = split_scales(_mm256_cvtepi8_epi16(scales8));
    let mut sumi = _mm256_setzero_si256();
    for (j, &sc) in scales.iter().enumerate() {
        let q2bits = load256(xb.add(16 + 32 * j));
        let q8 = yb.add(Q8K_QS + 128 * j);
        let q2 = [
            _mm256_and_si256(q2bits, m3),
            _mm256_and_si256(_mm256_srli_epi16::<2>(q2bits), m3),
            _mm256_and_si256(_mm256_srli_epi16::<4>(q2bits), m3),
            _mm256_and_si256(_mm256_srli_epi16::<6>(q2bits), m3),
        ];
        let mut p = [_mm256_setzero_si256(); 4];
        for k in 0..4 {
            p[k] = scale_q3k(sc, k, _mm256_maddubs_epi16(q2[k], load256(q8.add(32 * k))));
        }
        sumi = _mm256_add_epi32(
            sumi,
            _mm256_add_epi32(_mm256_add_epi32(p[0], p[1]), _mm256_add_epi32(p[2], p[3])),
        );
    }
    (sumi, prod)
}

#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn vec_dot_q2_k_q8_k(nb: usize, x: *const u8, y: *const u8) -> f32 {
    let mut acc = _mm256_setzero_ps();
    for i in 0..nb {
        let (xb, yb) = (x.add(i * Q2_K_BYTES), y.add(i * Q8_K_BYTES));
        let yd = f32_at(yb);
        let d = yd * f16_at_tail(xb.add(80));
        let dmin = -yd * f16_at_tail(xb.add(82));
        let (sumi, prod) = q2_k_ints(xb, yb);
        acc = _mm256_fmadd_ps(_mm256_set1_ps(dmin), _mm256_cvtepi32_ps(prod), acc);
        acc = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi), acc);
    }
    hsum_float_8(acc)
}

/// Q3_K, one super-block: `sum_j scale_j * dot_j` (codes -4..=3, scales -32..=31) in llama.cpp's eight lanes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn q3_k_ints(xb: *const u8, yb: *const u8) -> __m256i {
    const KMASK1: u32 = 0x0303_0303;
    const KMASK2: u32 = 0x0f0f_0f0f;
    let m3 = _mm256_set1_epi8(3);
    let four = _mm256_set1_epi8(4);
    let zero = _mm256_setzero_si256();

    // The sixteen 6-bit scales, minus 32.
    let aux = [u32_at(xb.add(96)), u32_at(xb.add(100)), u32_at(xb.add(104))];
    let scales128 = _mm_set_epi32(
        (((aux[1] >> 4) & KMASK2) | (((aux[2] >> 6) & KMASK1) << 4)) as i32,
        (((aux[0] >> 4) & KMASK2) | (((aux[2] >> 4) & KMASK1) << 4)) as i32,
        ((aux[1] & KMASK2) | (((aux[2] >> 2) & KMASK1) << 4)) as i32,
        ((aux[0] & KMASK2) | ((aux[2] & KMASK1) << 4)) as i32,
    );
    let scales128 = _mm_sub_epi8(scales128, _mm_set1_epi8(32));
    let scales = split_scales(_mm256_cvtepi8_epi16(scales128));

    let hbits = load256(xb);
    let mut sumi = _mm256_setzero_si256();
    for (j, &sc) in scales.iter().enumerate() {
        let q3bits = load256(xb.add(32 + 32 * j));
        let q8 = yb.add(Q8K_QS + 128 * j);
        let q3l = [
            _mm256_and_si256(q3bits, m3),
            _mm256_and_si256(_mm256_srli_epi16::<2>(q3bits), m3),
            _mm256_and_si256(_mm256_srli_epi16::<4>(q3bits), m3),
            _mm256_and_si256(_mm256_srli_epi16::<6>(q3bits), m3),
        ];
        let mut p = [_mm256_setzero_si256(); 4];
        for k in 0..4 {
            // 4 where the high bit (bit 4j + k of each hmask byte) is clear: the "minus 4" part, multiplied
            // separately so both factors of maddubs stay unsigned.
            let m = _mm256_set1_epi8((1u8 << (4 * j + k)) as i8);
            let q3h = _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(hbits, m), zero), four);
            let q8k = load256(q8.add(32 * k));
            let p16 = _mm256_sub_epi16(_mm256_maddubs_epi16(q3l[k], q8k), _mm256_maddubs_epi16(q3h, q8k));
            p[k] = scale_q3k(sc, k, p16);
        }
        sumi = _mm256_add_epi32(
            sumi,
            _mm256_add_epi32(_mm256_add_epi32(p[0], p[1]), _mm256_add_epi32(p[2], p[3])),
        );
    }
    sumi
}

#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn vec_dot_q3_k_q8_k(nb: usize, x: *const u8, y: *const u8) -> f32 {
    let mut acc = _mm256_setzero_ps();
    for i in 0..nb {
        let (xb, yb) = (x.add(i * Q3_K_BYTES), y.add(i * Q8_K_BYTES));
        let d = f32_at(yb) * f16_at_tail(xb.add(108));
        let sumi = q3_k_ints(xb, yb);
        acc = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi), acc);
    }
    hsum_float_8(acc)
}

/// Q4_K / Q5_K: the 8 scales and 8 mins (6 bits each) of `scales` as 16 i16 (scales first), llama.cpp's
/// `utmp` shuffle.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn k4_mins_and_scales(s: *const u8) -> __m256i {
    const KMASK1: u32 = 0x3f3f_3f3f;
    const KMASK2: u32 = 0x0f0f_0f0f;
    const KMASK3: u32 = 0x0303_0303;
    let mut u = [u32_at(s), u32_at(s.add(4)), u32_at(s.add(8)), 0];
    u[3] = ((u[2] >> 4) & KMASK2) | (((u[1] >> 6) & KMASK3) << 4);
    let uaux = u[1] & KMASK1;
    u[1] = (u[2] & KMASK2) | (((u[0] >> 6) & KMASK3) << 4);
    u[2] = uaux;
    u[0] &= KMASK1;
    _mm256_cvtepu8_epi16(_mm_set_epi32(u[3] as i32, u[2] as i32, u[1] as i32, u[0] as i32))
}

/// Q4_K / Q5_K: the four i32 `min[j] * (bsums[2j] + bsums[2j + 1])`-pair sums llama.cpp forms for the mins.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn k4_min_prod(mins_and_scales: __m256i, bsums: *const u8) -> __m128i {
    let q8sums = load256(bsums);
    let q8s = _mm_hadd_epi16(_mm256_extracti128_si256::<0>(q8sums), _mm256_extracti128_si256::<1>(q8sums));
    _mm_madd_epi16(_mm256_extracti128_si256::<1>(mins_and_scales), q8s)
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn shuffle_k4(scales: __m256i, i: usize) -> __m256i {
    _mm256_shuffle_epi8(scales, load256(SHUFFLE_K4[i].as_ptr()))
}

/// Q4_K: `sum_j scale_j * dot(q4_j, q8_j)` of one super-block in llama.cpp's eight i32 lanes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn q4_k_block_sumi(xb: *const u8, yb: *const u8, mins_and_scales: __m256i) -> __m256i {
    let m4 = _mm256_set1_epi8(0xF);
    let sc128 = _mm256_extracti128_si256::<0>(mins_and_scales);
    let scales = _mm256_set_m128i(sc128, sc128);
    let mut sumi = _mm256_setzero_si256();
    for j in 0..QK_K / 64 {
        let scale_l = shuffle_k4(scales, 2 * j);
        let scale_h = shuffle_k4(scales, 2 * j + 1);
        let q4bits = load256(xb.add(16 + 32 * j));
        let q4l = _mm256_and_si256(q4bits, m4);
        let q4h = _mm256_and_si256(_mm256_srli_epi16::<4>(q4bits), m4);
        let q8 = yb.add(Q8K_QS + 64 * j);
        let p16l = _mm256_madd_epi16(scale_l, _mm256_maddubs_epi16(q4l, load256(q8)));
        let p16h = _mm256_madd_epi16(scale_h, _mm256_maddubs_epi16(q4h, load256(q8.add(32))));
        sumi = _mm256_add_epi32(sumi, _mm256_add_epi32(p16l, p16h));
    }
    sumi
}

#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn vec_dot_q4_k_q8_k(nb: usize, x: *const u8, y: *const u8) -> f32 {
    let mut acc = _mm256_setzero_ps();
    let mut acc_m = _mm_setzero_ps();
    for i in 0..nb {
        let (xb, yb) = (x.add(i * Q4_K_BYTES), y.add(i * Q8_K_BYTES));
        let yd = f32_at(yb);
        let d = yd * f16_at(xb);
        let dmin = -yd * f16_at(xb.add(2));

        let mins_and_scales = k4_mins_and_scales(xb.add(4));
        let prod = k4_min_prod(mins_and_scales, yb.add(Q8K_BSUMS));
        acc_m = _mm_fmadd_ps(_mm_set1_ps(dmin), _mm_cvtepi32_ps(prod), acc_m);

        let sumi = q4_k_block_sumi(xb, yb, mins_and_scales);
        acc = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi), acc);
    }
    acc_m = _mm_add_ps(acc_m, _mm_movehl_ps(acc_m, acc_m));
    acc_m = _mm_add_ss(acc_m, _mm_movehdup_ps(acc_m));
    hsum_float_8(acc) + _mm_cvtss_f32(acc_m)
}

/// Q5_K, one super-block: `sum_j scale_j * dot_j` in llama.cpp's eight i32 lanes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn q5_k_block_sumi(xb: *const u8, yb: *const u8, mins_and_scales: __m256i) -> __m256i {
    let m4 = _mm256_set1_epi8(0xF);
    let sixteen = _mm256_set1_epi8(16);
    let zero = _mm256_setzero_si256();
    let sc128 = _mm256_extracti128_si256::<0>(mins_and_scales);
    let scales = _mm256_set_m128i(sc128, sc128);
    let hbits = load256(xb.add(16));
    let mut sumi = _mm256_setzero_si256();
    for j in 0..QK_K / 64 {
        let scale_0 = shuffle_k4(scales, 2 * j);
        let scale_1 = shuffle_k4(scales, 2 * j + 1);
        let q5bits = load256(xb.add(48 + 32 * j));
        // Fifth bits: bit 2j of each qh byte for the low nibbles, bit 2j + 1 for the high ones (+16 each).
        let h0 = _mm256_set1_epi8((1u8 << (2 * j)) as i8);
        let h1 = _mm256_set1_epi8((2u8 << (2 * j)) as i8);
        let q5h_0 = _mm256_andnot_si256(_mm256_cmpeq_epi8(_mm256_and_si256(hbits, h0), zero), sixteen);
        let q5h_1 = _mm256_andnot_si256(_mm256_cmpeq_epi8(_mm256_and_si256(hbits, h1), zero), sixteen);
        let q5_0 = _mm256_add_epi8(_mm256_and_si256(q5bits, m4), q5h_0);
        let q5_1 = _mm256_add_epi8(_mm256_and_si256(_mm256_srli_epi16::<4>(q5bits), m4), q5h_1);
        let q8 = yb.add(Q8K_QS + 64 * j);
        let p16_0 = _mm256_madd_epi16(scale_0, _mm256_maddubs_epi16(q5_0, load256(q8)));
        let p16_1 = _mm256_madd_epi16(scale_1, _mm256_maddubs_epi16(q5_1, load256(q8.add(32))));
        sumi = _mm256_add_epi32(sumi, _mm256_add_epi32(p16_0, p16_1));
    }
    sumi
}

#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn vec_dot_q5_k_q8_k(nb: usize, x: *const u8, y: *const u8) -> f32 {
    let mut acc = _mm256_setzero_ps();
    let mut summs = 0.0f32;
    for i in 0..nb {
        let (xb, yb) = (x.add(i * Q5_K_BYTES), y.add(i * Q8_K_BYTES));
        let yd = f32_at(yb);
        let d = yd * f16_at(xb);
        let dmin = -yd * f16_at(xb.add(2));

        let mins_and_scales = k4_mins_and_scales(xb.add(4));
        let prod = k4_min_prod(mins_and_scales, yb.add(Q8K_BSUMS));
        // GCC contracts llama.cpp's `summs += dmin * sum` into an FMA.
        summs = dmin.mul_add(hsum_i32_4(prod) as f32, summs);

        let sumi = q5_k_block_sumi(xb, yb, mins_and_scales);
        acc = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi), acc);
    }
    hsum_float_8(acc) + summs
}

/// Q6_K, one super-block: (`sum_j scale_j * dot(code_j + 32, q8_j)` in llama.cpp's eight i32 lanes, the
/// `32 * scale * bsum` lanes to subtract for the codes' offset of 32).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn q6_k_ints(xb: *const u8, yb: *const u8) -> (__m256i, __m256i) {
    q6_k_ints_unpacked(&q6_k_unpack(xb), yb)
}

/// A Q6_K block's 256 codes (0..=63, as bytes, in the order of the Q8_K quants they multiply), its 16 scales as
/// i16, and the scale of each 32-element product as i16 lanes.
pub(super) struct Q6kUnpacked {
    q: [__m256i; 8],
    scale: [__m256i; 8],
    scales_16: __m256i,
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn q6_k_unpack(xb: *const u8) -> Q6kUnpacked {
    let m3 = _mm256_set1_epi8(3);
    let m15 = _mm256_set1_epi8(15);
    let scales = load128(xb.add(192));
    let mut q = [_mm256_setzero_si256(); 8];
    let mut scale = [_mm256_setzero_si256(); 8];
    for j in 0..QK_K / 128 {
        let ql = xb.add(64 * j);
        let q4bits1 = load256(ql);
        let q4bits2 = load256(ql.add(32));
        let q4bits_h = load256(xb.add(128 + 32 * j));
        let q4h_0 = _mm256_slli_epi16::<4>(_mm256_and_si256(q4bits_h, m3));
        let q4h_1 = _mm256_slli_epi16::<2>(_mm256_and_si256(q4bits_h, _mm256_set1_epi8(12)));
        let q4h_2 = _mm256_and_si256(q4bits_h, _mm256_set1_epi8(48));
        let q4h_3 = _mm256_srli_epi16::<2>(_mm256_and_si256(q4bits_h, _mm256_set1_epi8(-64)));
        q[4 * j] = _mm256_or_si256(_mm256_and_si256(q4bits1, m15), q4h_0);
        q[4 * j + 1] = _mm256_or_si256(_mm256_and_si256(q4bits2, m15), q4h_1);
        q[4 * j + 2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16::<4>(q4bits1), m15), q4h_2);
        q[4 * j + 3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16::<4>(q4bits2), m15), q4h_3);
        for k in 0..4 {
            let s = _mm_shuffle_epi8(scales, load128(SHUFFLE_Q6K[4 * j + k].as_ptr()));
            scale[4 * j + k] = _mm256_cvtepi8_epi16(s);
        }
    }
    Q6kUnpacked { q, scale, scales_16: _mm256_cvtepi8_epi16(scales) }
}

/// Q6_K x Q8_K, one super-block from its unpacked codes: (sum of scale * code * q8 in eight i32 lanes,
/// 32 * sum of scale * bsum: the offset of the codes' bias of 32).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn q6_k_ints_unpacked(w: &Q6kUnpacked, yb: *const u8) -> (__m256i, __m256i) {
    let q8sclsub = _mm256_slli_epi32::<5>(_mm256_madd_epi16(load256(yb.add(Q8K_BSUMS)), w.scales_16));
    let mut sumi = _mm256_setzero_si256();
    for j in 0..QK_K / 128 {
        let q8 = yb.add(Q8K_QS + 128 * j);
        let mut p = [_mm256_setzero_si256(); 4];
        for (k, pk) in p.iter_mut().enumerate() {
            let p16 = _mm256_maddubs_epi16(w.q[4 * j + k], load256(q8.add(32 * k)));
            *pk = _mm256_madd_epi16(w.scale[4 * j + k], p16);
        }
        sumi = _mm256_add_epi32(sumi, _mm256_add_epi32(p[0], p[1]));
        sumi = _mm256_add_epi32(sumi, _mm256_add_epi32(p[2], p[3]));
    }
    (sumi, q8sclsub)
}

#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn vec_dot_q6_k_q8_k(nb: usize, x: *const u8, y: *const u8) -> f32 {
    let mut acc = _mm256_setzero_ps();
    for i in 0..nb {
        let (xb, yb) = (x.add(i * Q6_K_BYTES), y.add(i * Q8_K_BYTES));
        prefetch_ahead::<3>(xb); // a 210-byte block
        let d = f32_at(yb) * f16_at_tail(xb.add(208));
        let (sumi, q8sclsub) = q6_k_ints(xb, yb);
        let sumi = _mm256_sub_epi32(sumi, q8sclsub);
        acc = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi), acc);
    }
    hsum_float_8(acc)
}

/// Q8_K x Q8_K (no llama.cpp kernel; not a weight format of real models): per block, exact i32 sums in eight
/// lanes, one `fmadd` by `d_x * d_y`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn vec_dot_q8_k_q8_k(nb: usize, x: *const u8, y: *const u8) -> f32 {
    let ones = _mm256_set1_epi16(1);
    let mut acc = _mm256_setzero_ps();
    for i in 0..nb {
        let (xb, yb) = (x.add(i * Q8_K_BYTES), y.add(i * Q8_K_BYTES));
        let d = _mm256_set1_ps(f32_at(xb) * f32_at(yb));
        let mut sumi = _mm256_setzero_si256();
        for k in 0..QK_K / 32 {
            let qx = load256(xb.add(Q8K_QS + 32 * k));
            let qy = load256(yb.add(Q8K_QS + 32 * k));
            let p16 = _mm256_maddubs_epi16(_mm256_sign_epi8(qx, qx), _mm256_sign_epi8(qy, qx));
            sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(ones, p16));
        }
        acc = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(sumi), acc);
    }
    hsum_float_8(acc)
}

// ---------------------------------------------------------------------------------------------------------------
// Activation quantization (byte-exact with the scalar `quantize_q8_k`)
// ---------------------------------------------------------------------------------------------------------------

/// `min(nearest_int(v * mul), 127)` on eight lanes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q8_k_lanes(v: __m256, mul: __m256) -> __m256i {
    _mm256_min_epi32(nearest_int(_mm256_mul_ps(v, mul)), _mm256_set1_epi32(127))
}

#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn quantize_q8_k(nb: usize, x: *const f32, dst: *mut u8) {
    let sign = _mm256_set1_ps(-0.0);
    for i in 0..nb {
        let xb = x.add(i * QK_K);
        let b = dst.add(i * Q8_K_BYTES);
        // Vector k of the block: elements 8k .. 8k + 8.
        macro_rules! v {
            ($k:expr) => {
                _mm256_loadu_ps(xb.add(8 * ($k)))
            };
        }

        let mut m = _mm256_setzero_ps();
        for k in 0..QK_K / 32 {
            m = abs_max_lanes(&[v!(4 * k), v!(4 * k + 1), v!(4 * k + 2), v!(4 * k + 3)], m);
        }
        let amax = hmax_ps(m);
        if amax == 0.0 {
            std::ptr::write_bytes(b, 0, Q8_K_BYTES);
            continue;
        }
        // The first element with |v| == amax, sign included (the scalar `signed_abs_max`).
        let target = _mm256_set1_ps(amax);
        let mut max = amax;
        for k in 0..QK_K / 8 {
            let eq = _mm256_cmp_ps::<_CMP_EQ_OQ>(_mm256_andnot_ps(sign, v!(k)), target);
            let mask = _mm256_movemask_ps(eq);
            if mask != 0 {
                max = *xb.add(8 * k + mask.trailing_zeros() as usize);
                break;
            }
        }
        let iscale = -127.0 / max;
        let mul = _mm256_set1_ps(iscale);
        let bsums = b.add(Q8K_BSUMS);
        for k in 0..QK_K / 32 {
            let q = pack_low_bytes([
                q8_k_lanes(v!(4 * k), mul),
                q8_k_lanes(v!(4 * k + 1), mul),
                q8_k_lanes(v!(4 * k + 2), mul),
                q8_k_lanes(v!(4 * k + 3), mul),
            ]);
            _mm256_storeu_si256(b.add(Q8K_QS + 32 * k) as *mut __m256i, q);
            let s = sum_i8_groups8(q);
            let pair = [((s[0] + s[1]) as i16).to_le_bytes(), ((s[2] + s[3]) as i16).to_le_bytes()];
            (bsums.add(4 * k) as *mut [[u8; 2]; 2]).write_unaligned(pair);
        }
        (b as *mut [u8; 4]).write_unaligned((1.0 / iscale).to_le_bytes());
    }
}
