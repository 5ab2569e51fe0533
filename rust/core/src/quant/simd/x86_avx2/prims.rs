//! Shared helpers of the AVX2 kernels (llama.cpp's names, from `arch/x86/quants.c`): loads, f16 reads and
//! writes, horizontal sums, prefetching. Every kernel file of `x86_avx2` imports them; they import nothing of
//! the crate, so the kernel files and the table in `x86_avx2/mod.rs` do not import each other both ways.

use std::arch::x86_64::*;

/// Bytes past the current block that the single-row (decode) kernels prefetch: their weights stream from DRAM.
/// Measured on the dev VM: 1 KiB ahead took Qwen2.5-1.5B decode from 0.94x to 1.1x llama.cpp (BENCHMARKS.md).
pub(super) const DECODE_PREFETCH: usize = 1024;

/// Prefetch into L1 the `LINES` cache lines from `DECODE_PREFETCH` bytes past `p` (a hint: never faults, even
/// past the end of a row or of the mapping).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn prefetch_ahead<const LINES: usize>(p: *const u8) {
    for i in 0..LINES {
        _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(DECODE_PREFETCH + 64 * i) as *const i8);
    }
}

/// Unaligned 32-byte load.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn load256(p: *const u8) -> __m256i {
    _mm256_loadu_si256(p as *const __m256i)
}

/// Unaligned 16-byte load.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn load128(p: *const u8) -> __m128i {
    _mm_loadu_si128(p as *const __m128i)
}

/// The little-endian IEEE half at `p`, widened (exactly) to f32; `p .. p + 8` must be readable.
///
/// Converted from a full 8-byte load: a 2-byte insert into a vector register leaves a false dependency on
/// that register's old value, and LLVM happily picks one from an accumulator chain, serializing the block loop
/// (measured: 3x slower Q4_1 dots).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(in crate::quant::simd) unsafe fn f16_at(p: *const u8) -> f32 {
    _mm_cvtss_f32(f16x4_at(p))
}

/// [`f16_at`] for a half at the end of a block: reads `p - 6 .. p + 2`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn f16_at_tail(p: *const u8) -> f32 {
    let v = f16x4_at(p.sub(6));
    _mm_cvtss_f32(_mm_shuffle_ps::<0b11_11_11_11>(v, v))
}

/// The four little-endian halves at `p .. p + 8`, widened to f32.
///
/// Inline assembly because with intrinsics LLVM narrows the load to the one half a caller uses and emits
/// `vpinsrw` into whatever register it likes (the false dependency described at [`f16_at`]).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(in crate::quant::simd) unsafe fn f16x4_at(p: *const u8) -> __m128 {
    let r: __m128;
    std::arch::asm!(
        "vcvtph2ps {r}, qword ptr [{p}]",
        p = in(reg) p,
        r = out(xmm_reg) r,
        options(pure, readonly, nostack, preserves_flags),
    );
    r
}

/// `v` rounded to nearest-even half, as little-endian bytes at `p` (F16C: the same bits as `half`'s
/// conversion, which uses F16C itself on these CPUs).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn put_f16(p: *mut u8, v: f32) {
    let h = _mm_cvtsi128_si32(_mm_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(_mm_set_ss(v))) as u16;
    (p as *mut [u8; 2]).write_unaligned(h.to_le_bytes());
}

/// `hsum_float_8`: ((a0+a4) + (a2+a6)) + ((a1+a5) + (a3+a7)).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(in crate::quant::simd) unsafe fn hsum_float_8(x: __m256) -> f32 {
    let mut res = _mm_add_ps(_mm256_extractf128_ps::<1>(x), _mm256_castps256_ps128(x));
    res = _mm_add_ps(res, _mm_movehl_ps(res, res));
    res = _mm_add_ss(res, _mm_movehdup_ps(res));
    _mm_cvtss_f32(res)
}

/// `sum_i16_pairs_float`: adjacent i16 pairs summed to i32, as f32.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn sum_i16_pairs_float(x: __m256i) -> __m256 {
    _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_set1_epi16(1), x))
}

/// `mul_sum_us8_pairs_float`: unsigned bytes of `ax` times signed bytes of `sy`, four adjacent products per
/// i32 lane, as f32.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn mul_sum_us8_pairs_float(ax: __m256i, sy: __m256i) -> __m256 {
    sum_i16_pairs_float(_mm256_maddubs_epi16(ax, sy))
}

/// `bytes_from_nibbles_32`: the 16 bytes at `p` as 32 nibbles: low nibbles in bytes 0..16, high in 16..32.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn bytes_from_nibbles_32(p: *const u8) -> __m256i {
    let tmp = load128(p);
    let bytes = _mm256_set_m128i(_mm_srli_epi16::<4>(tmp), tmp);
    _mm256_and_si256(_mm256_set1_epi8(0xF), bytes)
}

/// `bytes_from_bits_32`: the 32 bits of the little-endian u32 at `p` spread to 32 bytes of 0x00 / 0xFF.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn bytes_from_bits_32(p: *const u8) -> __m256i {
    let x32 = (p as *const u32).read_unaligned();
    let shuf_mask = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0);
    let bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(x32 as i32), shuf_mask);
    let bytes = _mm256_or_si256(bytes, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));
    _mm256_cmpeq_epi8(bytes, _mm256_set1_epi64x(-1))
}

/// Largest |v| of four vectors, NaNs skipped, exactly as the scalar `abs_max` (`if v > m { v } else { m }`
/// per lane from 0; `max_ps(v, m)` returns `m` when `v` is NaN). Max is exact, so lane order is irrelevant.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn abs_max_lanes(v: &[__m256], mut m: __m256) -> __m256 {
    let sign = _mm256_set1_ps(-0.0);
    for &v in v {
        m = _mm256_max_ps(_mm256_andnot_ps(sign, v), m);
    }
    m
}

/// Sum of eight i32 lanes (wrapping, like llama.cpp's `hsum_i32_8`; the sums here never overflow).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn hsum_i32_8(a: __m256i) -> i32 {
    hsum_i32_4(_mm_add_epi32(_mm256_castsi256_si128(a), _mm256_extracti128_si256::<1>(a)))
}

/// Sum of four i32 lanes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn hsum_i32_4(a: __m128i) -> i32 {
    let hi64 = _mm_unpackhi_epi64(a, a);
    let sum64 = _mm_add_epi32(hi64, a);
    let hi32 = _mm_shuffle_epi32::<0b10_11_00_01>(sum64);
    _mm_cvtsi128_si32(_mm_add_epi32(sum64, hi32))
}

/// Horizontal max of eight NaN-free lanes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn hmax_ps(m: __m256) -> f32 {
    let mut m4 = _mm_max_ps(_mm256_extractf128_ps::<1>(m), _mm256_castps256_ps128(m));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    _mm_cvtss_f32(m4)
}

/// The scalar `nearest_int` on eight lanes: add 1.5 * 2^23 and read the mantissa (round half to even for
/// |v| <= 2^22, and the same bits as the scalar code for every other input).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn nearest_int(v: __m256) -> __m256i {
    let biased = _mm256_castps_si256(_mm256_add_ps(v, _mm256_set1_ps(12_582_912.0)));
    _mm256_sub_epi32(
        _mm256_and_si256(biased, _mm256_set1_epi32(0x007f_ffff)),
        _mm256_set1_epi32(0x0040_0000),
    )
}

/// The low bytes of 4 x 8 i32 lanes, in element order (the `as i8` truncation of the scalar code; masking to
/// 0..=255 first keeps the saturating packs exact).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn pack_low_bytes(i: [__m256i; 4]) -> __m256i {
    let ff = _mm256_set1_epi32(0xff);
    let a = _mm256_packs_epi32(_mm256_and_si256(i[0], ff), _mm256_and_si256(i[1], ff));
    let b = _mm256_packs_epi32(_mm256_and_si256(i[2], ff), _mm256_and_si256(i[3], ff));
    // Lanes now hold elements 0-3, 8-11, 16-19, 24-27 | 4-7, 12-15, 20-23, 28-31: put the dwords in order.
    _mm256_permutevar8x32_epi32(_mm256_packus_epi16(a, b), _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7))
}

/// Sums of the signed bytes of `q` over its four 8-byte groups (i64 lanes), via `sad_epu8` on `q ^ 0x80`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn sum_i8_groups8(q: __m256i) -> [i32; 4] {
    let sad = _mm256_sad_epu8(_mm256_xor_si256(q, _mm256_set1_epi8(-128)), _mm256_setzero_si256());
    let s: [i64; 4] = std::mem::transmute(sad);
    s.map(|v| v as i32 - 8 * 128)
}
