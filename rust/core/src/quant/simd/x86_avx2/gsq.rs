//! AVX2 + FMA + F16C dot product of a GSQ-RCO row (docs/gsq-rco.md) with f32 activations, the SIMD version of
//! `gsq::dot_row`.
//!
//! Per group: the eight levels its codes stand for (`min + c * |scale|`, or 0 and `min + (c - 1) * |scale|` in a
//! sparse group) sit in one register; each 3-byte word of codes is broadcast to eight lanes, shifted by 0, 3,
//! ..., 21 and masked, and the lane's code picks its level (`vpermps`), one FMA with eight activations. The
//! residual slots are scalar. Sums differ from the scalar reference's order (tested within a tolerance).

use std::arch::x86_64::*;

use crate::gsq::{Layout, RESIDUAL_UNIT};

/// Dot product of `nr` whole records of `layout` at `w` with `nr * layout.group` activations at `x`.
///
/// # Safety
/// AVX2, FMA and F16C must be available; `w` must hold `nr * layout.record_bytes()` bytes and `x` `nr *
/// layout.group` f32 values.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn dot_row(layout: Layout, nr: usize, w: *const u8, x: *const f32) -> f32 {
    let (g, rb) = (layout.group, layout.record_bytes());
    let words = g / 8;
    let shifts = _mm256_setr_epi32(0, 3, 6, 9, 12, 15, 18, 21);
    let seven = _mm256_set1_epi32(7);
    let steps = _mm256_setr_ps(0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0);
    let (mut acc0, mut acc1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
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
        let code_at = |k: usize| -> __m256i {
            let p = codes.add(3 * k);
            // The word's three bytes (a fourth byte past the codes would be read by a 4-byte load on the last
            // word of a record without slots at the end of the row, so the bytes are assembled).
            let bits = (p as *const u16).read_unaligned() as i32 | (*p.add(2) as i32) << 16;
            _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(bits), shifts), seven)
        };
        let mut k = 0;
        while k + 2 <= words {
            acc0 = _mm256_fmadd_ps(_mm256_permutevar8x32_ps(levels, code_at(k)), _mm256_loadu_ps(xs.add(8 * k)), acc0);
            acc1 = _mm256_fmadd_ps(
                _mm256_permutevar8x32_ps(levels, code_at(k + 1)),
                _mm256_loadu_ps(xs.add(8 * k + 8)),
                acc1,
            );
            k += 2;
        }
        if k < words {
            acc0 = _mm256_fmadd_ps(_mm256_permutevar8x32_ps(levels, code_at(k)), _mm256_loadu_ps(xs.add(8 * k)), acc0);
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
    let v = _mm256_add_ps(acc0, acc1);
    let h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    let h = _mm_add_ss(h, _mm_movehdup_ps(h));
    _mm_cvtss_f32(h) + tail
}
