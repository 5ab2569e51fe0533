//! AVX2 + FMA + F16C dot product of a GSQ-RCO row (docs/gsq-rco.md, format version 2) with int8 activations
//! (`gsq::ActQ8`), the SIMD version of `gsq::dot_row_q8`.
//!
//! Per record and 32 weights: the low two code bits come from one 32-byte load of plane 0 (shift by 2t, mask),
//! the high bit(s) from plane 1 (3-bit: a 16-byte load in both halves, tested against bit 2t of the lower half's
//! bytes and bit 2t + 1 of the upper's; 4-bit: shift and mask as plane 0). `vpmaddubsw` multiplies the codes
//! (0..15) with the activation bytes into 16-bit pairs, `vpmaddwd` with the two sub-blocks' scales into 32-bit
//! sums. Each record's integer sum is scaled once (`dx * d`); the mins use the activations' sums per 16, the
//! slots are scalar. The integers are those of the scalar reference; only the f32 sums' order differs.

use std::arch::x86_64::*;

use crate::gsq::{ActQ8, Layout, GROUP, OFF_PLANE0, OFF_PLANE1, OFF_SCALES, RESIDUAL_UNIT, SUB};

/// `vpshufb` masks spreading scale bytes 2t (lanes 0..7) and 2t + 1 (lanes 8..15) into 16-bit lanes.
static SCALE_MASKS: [[i8; 32]; 4] = {
    let mut m = [[-1i8; 32]; 4];
    let mut t = 0;
    while t < 4 {
        let mut i = 0;
        while i < 32 {
            if i % 2 == 0 {
                m[t][i] = (2 * t + i / 16) as i8;
            }
            i += 1;
        }
        t += 1;
    }
    m
};

/// Dot product of `nr` whole records of `layout` at `w` with the first `nr` blocks of `x`.
///
/// # Safety
/// AVX2, FMA and F16C must be available; `w` must hold `nr * layout.record_bytes()` bytes and `x` at least `nr`
/// blocks (`nr * 128` values, `nr * 8` sums).
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn dot_row(layout: Layout, nr: usize, w: *const u8, x: &ActQ8) -> f32 {
    let rb = layout.record_bytes();
    let four = layout.bits == 4;
    let m3 = _mm256_set1_epi8(3);
    let bit2 = _mm256_set1_epi8(4);
    let masks: [__m256i; 4] = std::array::from_fn(|t| _mm256_loadu_si256(SCALE_MASKS[t].as_ptr() as *const __m256i));
    // 3-bit high plane: lane i < 16 tests bit 2t of byte i, lane i >= 16 bit 2t + 1 of byte i - 16.
    let hbits: [__m256i; 4] = std::array::from_fn(|t| {
        _mm256_set_m128i(_mm_set1_epi8((1u8 << (2 * t + 1)) as i8), _mm_set1_epi8((1u8 << (2 * t)) as i8))
    });
    let (xq, bs) = (x.q.as_ptr(), x.bsums.as_ptr());
    let mut acc = _mm256_setzero_ps();
    let mut acc_m = _mm256_setzero_ps();
    let mut tail = 0.0f32;
    for r in 0..nr {
        let rec = w.add(r * rb);
        let d = crate::quant::float::f16_to_f32((rec as *const u16).read_unaligned());
        let dmin = crate::quant::float::f16_to_f32((rec.add(2) as *const u16).read_unaligned());
        let dx = *x.d.get_unchecked(r);
        let sc8 = _mm_loadl_epi64(rec.add(OFF_SCALES) as *const __m128i);
        let scales = _mm256_broadcastsi128_si256(_mm_and_si128(sc8, _mm_set1_epi8(15)));
        let lo = _mm256_loadu_si256(rec.add(OFF_PLANE0) as *const __m256i);
        let hi = if four {
            _mm256_loadu_si256(rec.add(OFF_PLANE1) as *const __m256i)
        } else {
            _mm256_broadcastsi128_si256(_mm_loadu_si128(rec.add(OFF_PLANE1) as *const __m128i))
        };
        let xr = xq.add(r * GROUP);
        let mut isum = _mm256_setzero_si256();
        for t in 0..4 {
            let shift = _mm_cvtsi32_si128(2 * t as i32);
            let c_lo = _mm256_and_si256(_mm256_srl_epi16(lo, shift), m3);
            let c = if four {
                _mm256_or_si256(c_lo, _mm256_slli_epi16::<2>(_mm256_and_si256(_mm256_srl_epi16(hi, shift), m3)))
            } else {
                let set = _mm256_cmpeq_epi8(_mm256_and_si256(hi, hbits[t]), hbits[t]);
                _mm256_or_si256(c_lo, _mm256_and_si256(set, bit2))
            };
            let xv = _mm256_loadu_si256(xr.add(32 * t) as *const __m256i);
            let p = _mm256_maddubs_epi16(c, xv);
            let sc = _mm256_shuffle_epi8(scales, masks[t]);
            isum = _mm256_add_epi32(isum, _mm256_madd_epi16(p, sc));
        }
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_set1_ps(dx * d), acc);
        // Mins: m_s * bsum_s for the eight sub-blocks.
        let mins = _mm256_cvtepu8_epi32(_mm_srli_epi16::<4>(_mm_and_si128(sc8, _mm_set1_epi8(-16))));
        let bsum = _mm256_loadu_si256(bs.add(r * (GROUP / SUB)) as *const __m256i);
        acc_m = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_mullo_epi32(mins, bsum)), _mm256_set1_ps(dx * dmin), acc_m);
        let slots = rec.add(layout.slots_offset());
        let mut ssum = 0i32;
        for s in 0..layout.slots {
            let (pos, val) = (*slots.add(2 * s) as usize, *slots.add(2 * s + 1) as i8);
            if val != 0 && pos < GROUP {
                ssum += val as i32 * (*rec.add(OFF_SCALES + pos / SUB) & 15) as i32 * *xr.add(pos) as i32;
            }
        }
        tail += dx * d * ssum as f32 * RESIDUAL_UNIT;
    }
    let v = _mm256_sub_ps(acc, acc_m);
    let h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    let h = _mm_add_ss(h, _mm_movehdup_ps(h));
    _mm_cvtss_f32(h) + tail
}
