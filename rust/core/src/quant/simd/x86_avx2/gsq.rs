//! AVX2 + FMA + F16C dot product of a GSQ-RCO row (docs/gsq-rco.md) with f32 activations, the SIMD version of
//! `gsq::dot_row`.
//!
//! Per group: the eight levels its codes stand for (`min + c * |scale|`, or 0 and `min + (c - 1) * |scale|` in a
//! sparse group) sit in one register; 32 codes (12 bytes) come with one load, `vpshufb` puts each 3-byte word
//! into all eight lanes, a shift by 0, 3, ..., 21 brings code i to the low bits of lane i, and `vpermps` (which
//! reads only those three bits) picks its level: four instructions per eight weights, with the FMA. The
//! residual slots are scalar. Sums differ from the scalar reference's order (tested within a tolerance).

use std::arch::x86_64::*;

use crate::gsq::{Layout, RESIDUAL_UNIT};

/// `vpshufb` masks putting word k (bytes 3k..3k+2 of a 12-byte chunk of codes) into every 32-bit lane.
static WORD_MASKS: [[i8; 32]; 4] = {
    let mut m = [[-1i8; 32]; 4];
    let mut k = 0;
    while k < 4 {
        let mut i = 0;
        while i < 32 {
            if i % 4 < 3 {
                m[k][i] = (3 * k + i % 4) as i8;
            }
            i += 1;
        }
        k += 1;
    }
    m
};

/// Dot product of `nr` whole records of `layout` at `w` with `nr * layout.group` activations at `x`.
///
/// # Safety
/// AVX2, FMA and F16C must be available; `w` must hold `nr * layout.record_bytes()` bytes and `x` `nr *
/// layout.group` f32 values.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn dot_row(layout: Layout, nr: usize, w: *const u8, x: *const f32) -> f32 {
    let (g, rb) = (layout.group, layout.record_bytes());
    let end = w.add(nr * rb);
    let shifts = _mm256_setr_epi32(0, 3, 6, 9, 12, 15, 18, 21);
    let words: [__m256i; 4] = std::array::from_fn(|k| _mm256_loadu_si256(WORD_MASKS[k].as_ptr() as *const __m256i));
    let steps = _mm256_setr_ps(0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0);
    let mut acc = [_mm256_setzero_ps(); 4];
    let mut tail = 0.0f32;
    for r in 0..nr {
        let rec = w.add(r * rb);
        let xs = x.add(r * g);
        let s_bits = (rec as *const u16).read_unaligned();
        let scale = crate::quant::float::f16_to_f32(s_bits & 0x7fff);
        let min = crate::quant::float::f16_to_f32((rec.add(2) as *const u16).read_unaligned());
        let levels = if s_bits & 0x8000 != 0 {
            // Sparse: code 0 is zero, codes 1..7 the grid from min.
            let l = _mm256_fmadd_ps(_mm256_sub_ps(steps, _mm256_set1_ps(1.0)), _mm256_set1_ps(scale), _mm256_set1_ps(min));
            _mm256_blend_ps::<1>(l, _mm256_setzero_ps())
        } else {
            _mm256_fmadd_ps(steps, _mm256_set1_ps(scale), _mm256_set1_ps(min))
        };
        let codes = rec.add(4);
        for c in 0..g / 32 {
            // Four 3-byte words (32 codes) from a 16-byte load, or from a copy where fewer than 16 bytes of the
            // row are left (the last chunk of the last record when it has fewer than two slots).
            let p = codes.add(12 * c);
            let chunk = if p.add(16) <= end {
                _mm_loadu_si128(p as *const __m128i)
            } else {
                let mut buf = [0u8; 16];
                std::ptr::copy_nonoverlapping(p, buf.as_mut_ptr(), 12);
                _mm_loadu_si128(buf.as_ptr() as *const __m128i)
            };
            let chunk = _mm256_broadcastsi128_si256(chunk);
            let x8 = xs.add(32 * c);
            // Word k in all eight lanes, lane i shifted right by 3i: its low three bits are code i, and vpermps
            // reads only those.
            macro_rules! idx {
                ($k:expr) => {
                    _mm256_srlv_epi32(_mm256_shuffle_epi8(chunk, words[$k]), shifts)
                };
            }
            // Four accumulators: no FMA waits for another in the same chunk.
            acc[0] = _mm256_fmadd_ps(_mm256_permutevar8x32_ps(levels, idx!(0)), _mm256_loadu_ps(x8), acc[0]);
            acc[1] = _mm256_fmadd_ps(_mm256_permutevar8x32_ps(levels, idx!(1)), _mm256_loadu_ps(x8.add(8)), acc[1]);
            acc[2] = _mm256_fmadd_ps(_mm256_permutevar8x32_ps(levels, idx!(2)), _mm256_loadu_ps(x8.add(16)), acc[2]);
            acc[3] = _mm256_fmadd_ps(_mm256_permutevar8x32_ps(levels, idx!(3)), _mm256_loadu_ps(x8.add(24)), acc[3]);
        }
        let unit = scale * RESIDUAL_UNIT;
        let slots = codes.add(3 * g / 8);
        for s in 0..layout.slots {
            let (pos, val) = (*slots.add(2 * s) as usize, *slots.add(2 * s + 1) as i8);
            if val != 0 && pos < g {
                tail += val as f32 * unit * *xs.add(pos);
            }
        }
    }
    let v = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
    let h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    let h = _mm_add_ss(h, _mm_movehdup_ps(h));
    _mm_cvtss_f32(h) + tail
}
