//! NEON dot products of GSQ-RCO rows (docs/gsq-rco.md, format version 2) with int8 activations (`gsq::ActQ8`):
//! `gsq::dot_row_q8` with its code sums, `sum_s sc_s * sum(c * q)`, done 16 codes at a time. Each sub-block's
//! codes come out as bytes (3-bit: plane 0's two bits and plane 1's bit s of sub-block s; 4-bit: a nibble mask),
//! `smull` multiplies them with the activation bytes into 16-bit products (|c q| <= 15 * 127), a pairwise add
//! keeps 16 bits (two products), and `smlal` by the sub-block's scale accumulates four 32-bit lanes. The mins, the
//! residual slots and the f32 combination are the reference's own code (`gsq::dot_row_q8_with`), so a row's result
//! is the scalar reference's to the bit.

use std::arch::aarch64::*;

use crate::gsq::format::{self as gsq, ActQ8, Layout, GROUP, OFF_PLANE0, OFF_PLANE1, SUB};

/// 16 codes (bytes < 16) times 16 activation bytes, times the sub-block's scale, added to `acc`.
#[inline(always)]
unsafe fn add_sub(acc: int32x4_t, codes: uint8x16_t, q: *const i8, sc: u8) -> int32x4_t {
    let c = vreinterpretq_s8_u8(codes);
    let x = vld1q_s8(q);
    let pairs = vaddq_s16(vmull_s8(vget_low_s8(c), vget_low_s8(x)), vmull_high_s8(c, x));
    let sc = sc as i16;
    vmlal_high_n_s16(vmlal_n_s16(acc, vget_low_s16(pairs), sc), pairs, sc)
}

/// Sub-block `s` of a 3-bit record: bits 0-1 from plane 0 (its half `p0`, shifted right by `LO` = 2 (s / 2)) and
/// bit 2 from plane 1 (`p1`, bit `HI` = s). (Shifts by a constant vector: `ushr` takes no shift of 0.)
#[inline(always)]
unsafe fn codes3<const LO: i8, const HI: i8>(p0: uint8x16_t, p1: uint8x16_t) -> uint8x16_t {
    let lo = vandq_u8(vshlq_u8(p0, vdupq_n_s8(-LO)), vdupq_n_u8(3));
    let hi = vandq_u8(vshlq_u8(p1, vdupq_n_s8(2 - HI)), vdupq_n_u8(4));
    vorrq_u8(lo, hi)
}

/// `sum_s sc_s * sum(c * q)` of the record at `rec` with the activation bytes at `q` (128 of them).
#[inline(always)]
unsafe fn code_sum(bits: usize, rec: *const u8, q: *const i8, sm: &[(u8, u8); GROUP / SUB]) -> i32 {
    let mut acc = vdupq_n_s32(0);
    if bits == 3 {
        // sub-block s = 2t + half: weights 32t + 16 half + j, plane 0 byte 16 half + j bits 2t..2t+1, plane 1
        // byte j bit s
        let (a, b) = (vld1q_u8(rec.add(OFF_PLANE0)), vld1q_u8(rec.add(OFF_PLANE0 + 16)));
        let p1 = vld1q_u8(rec.add(OFF_PLANE1));
        acc = add_sub(acc, codes3::<0, 0>(a, p1), q, sm[0].0);
        acc = add_sub(acc, codes3::<0, 1>(b, p1), q.add(16), sm[1].0);
        acc = add_sub(acc, codes3::<2, 2>(a, p1), q.add(32), sm[2].0);
        acc = add_sub(acc, codes3::<2, 3>(b, p1), q.add(48), sm[3].0);
        acc = add_sub(acc, codes3::<4, 4>(a, p1), q.add(64), sm[4].0);
        acc = add_sub(acc, codes3::<4, 5>(b, p1), q.add(80), sm[5].0);
        acc = add_sub(acc, codes3::<6, 6>(a, p1), q.add(96), sm[6].0);
        acc = add_sub(acc, codes3::<6, 7>(b, p1), q.add(112), sm[7].0);
    } else {
        // byte j: code of weight j (low nibble) and of weight 64 + j (high)
        for k in 0..4 {
            let b = vld1q_u8(rec.add(OFF_PLANE0 + 16 * k));
            acc = add_sub(acc, vandq_u8(b, vdupq_n_u8(15)), q.add(16 * k), sm[k].0);
            acc = add_sub(acc, vshrq_n_u8::<4>(b), q.add(64 + 16 * k), sm[k + 4].0);
        }
    }
    vaddvq_s32(acc)
}

/// `out.len()` rows `stride` bytes apart (the last one the rest of `w`) dotted with `x`: `quant::simd::GsqDotFn`.
pub(super) fn dot_rows(layout: Layout, w: &[u8], stride: usize, x: &ActQ8, out: &mut [f32]) {
    for (i, o) in out.iter_mut().enumerate() {
        let row = &w[i * stride..((i + 1) * stride).min(w.len())];
        *o = gsq::dot_row_q8_with(layout, row, x, |rec, q, sm| {
            // SAFETY: NEON is part of the aarch64 baseline (and was detected); `rec` holds a whole record (its
            // code bytes end at or before the slots) and `q` 128 bytes, all that the loads read.
            unsafe { code_sum(layout.bits, rec.as_ptr(), q.as_ptr(), sm) }
        });
    }
}
