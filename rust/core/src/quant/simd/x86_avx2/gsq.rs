//! AVX2 + FMA + F16C dot product of a GSQ-RCO row (docs/gsq-rco.md, format version 2) with int8 activations
//! (`gsq::ActQ8`), the SIMD version of `gsq::dot_row_q8`.
//!
//! Per record and 32 weights: 3-bit codes take their low two bits from one 32-byte load of plane 0 (shift by
//! 2t, mask) and bit 2 from plane 1 (a 16-byte load in both halves: the lower half's bytes hold it at bit 2t, the
//! upper's at 2t + 1, brought to bit 2 by one per-lane shift); 4-bit codes are a nibble mask (and a shift for
//! weights 64..127). `vpmaddubsw` multiplies the codes (0..15) with the activation bytes into 16-bit pairs, `vpmaddwd` with the two sub-blocks' scales into 32-bit
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
    let (bit2, m15) = (_mm256_set1_epi8(4), _mm256_set1_epi8(15));
    let masks: [__m256i; 4] = std::array::from_fn(|t| _mm256_loadu_si256(SCALE_MASKS[t].as_ptr() as *const __m256i));
    // 3-bit plane 1: chunk t's bit sits at 2t in the lower half's bytes and 2t + 1 in the upper's; a 32-bit lane
    // shift by at most 5 moves it to bit 2 without crossing a byte (left by 2 and 1 for t = 0).
    let hshift: [__m256i; 4] = std::array::from_fn(|t| {
        let (a, b) = if t == 0 { (2, 1) } else { (2 * t as i32 - 2, 2 * t as i32 - 1) };
        _mm256_setr_epi32(a, a, a, a, b, b, b, b)
    });
    let (xq, bs) = (x.q.as_ptr(), x.bsums.as_ptr());
    let mut acc = _mm256_setzero_ps();
    let mut acc_m = _mm256_setzero_ps();
    let mut tail = 0.0f32;
    for r in 0..nr {
        let rec = w.add(r * rb);
        // d and dmin by one F16C conversion.
        let dd = _mm_cvtph_ps(_mm_cvtsi32_si128((rec as *const i32).read_unaligned()));
        let dx = *x.d.get_unchecked(r);
        let (d, dmin) = (_mm_cvtss_f32(dd), _mm_cvtss_f32(_mm_movehdup_ps(dd)));
        let sc8 = _mm_loadl_epi64(rec.add(OFF_SCALES) as *const __m128i);
        let scales = _mm256_broadcastsi128_si256(_mm_and_si128(sc8, _mm_set1_epi8(15)));
        // 3-bit: plane 0 and plane 1 (in both halves); 4-bit: the two 32-byte halves of the nibbles.
        let lo = _mm256_loadu_si256(rec.add(OFF_PLANE0) as *const __m256i);
        let hi = if four {
            _mm256_loadu_si256(rec.add(OFF_PLANE0 + 32) as *const __m256i)
        } else {
            _mm256_broadcastsi128_si256(_mm_loadu_si128(rec.add(OFF_PLANE1) as *const __m128i))
        };
        let xr = xq.add(r * GROUP);
        let mut isum = _mm256_setzero_si256();
        for t in 0..4 {
            let c = if four {
                let v = if t % 2 == 0 { lo } else { hi };
                if t < 2 { _mm256_and_si256(v, m15) } else { _mm256_and_si256(_mm256_srli_epi16::<4>(v), m15) }
            } else {
                let c_lo = _mm256_and_si256(_mm256_srl_epi16(lo, _mm_cvtsi32_si128(2 * t as i32)), m3);
                let h = if t == 0 { _mm256_sllv_epi32(hi, hshift[0]) } else { _mm256_srlv_epi32(hi, hshift[t]) };
                _mm256_or_si256(c_lo, _mm256_and_si256(h, bit2))
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
        if layout.slots > 0 {
            // An unused slot has value 0 and adds nothing; a position is masked into the record (the writer
            // never stores one >= 128, and a corrupt one must not read outside the activations).
            let slots = rec.add(layout.slots_offset());
            let mut ssum = 0i32;
            for s in 0..layout.slots {
                let (pos, val) = (*slots.add(2 * s) as usize & (GROUP - 1), *slots.add(2 * s + 1) as i8);
                ssum += val as i32 * (*rec.add(OFF_SCALES + pos / SUB) & 15) as i32 * *xr.add(pos) as i32;
            }
            tail += dx * d * ssum as f32 * RESIDUAL_UNIT;
        }
    }
    let v = _mm256_sub_ps(acc, acc_m);
    let h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    let h = _mm_add_ss(h, _mm_movehdup_ps(h));
    _mm_cvtss_f32(h) + tail
}
