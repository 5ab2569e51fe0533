//! aarch64 NEON kernels: the dot products of the 32-element block formats (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q8_1)
//! with their Q8_0 / Q8_1 activations, of the K-quants (Q2_K..Q6_K) with Q8_K activations, and of GSQ-RCO rows
//! (`gsq`). F16/BF16/F32 rows, and the quantization of GSQ-RCO activations, use the scalar code on aarch64.
//!
//! The K-quant kernels are the reference code (`quant::kquants`, scalar unpacking and float combination) with
//! its exact int8 products done by NEON, so they give the reference's bits.
//!
//! Per block, the 32 int8 products are formed exactly (widening `smull`, pairwise adds into four i32 lanes),
//! converted to f32 and accumulated with one FMA by the block's combined scale into four f32 lanes; the min
//! term `m * s` of Q4_1 / Q5_1 in a scalar FMA chain. Integer parts are exact; the float sums are in their own
//! order (tested against the scalar reference to float tolerance). Not bit-mirrored: llama.cpp's NEON kernels
//! (two blocks per step, dot-product and i8mm variants), so greedy parity with llama.cpp on ARM is not claimed.
//!
//! NEON is part of the aarch64 baseline; the table is still built only after `is_aarch64_feature_detected!`.

mod gsq;

use std::arch::aarch64::*;

use super::table::{Kernels, VecDotFn};
use crate::quant::format::{BlockFormat, GgmlType, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q8_1};
use crate::quant::kquants;
use crate::quant::math::IntDot;

/// The NEON kernel table, or `None` without NEON.
pub(super) fn detect() -> Option<Kernels> {
    if !std::arch::is_aarch64_feature_detected!("neon") {
        return None;
    }
    let mut k = Kernels::SCALAR;
    k.name = "neon";
    let dots: [(GgmlType, VecDotFn); 11] = [
        (GgmlType::Q2_K, kquants::vec_dot_q2_k_with::<NeonDot>),
        (GgmlType::Q3_K, kquants::vec_dot_q3_k_with::<NeonDot>),
        (GgmlType::Q4_K, kquants::vec_dot_q4_k_with::<NeonDot>),
        (GgmlType::Q5_K, kquants::vec_dot_q5_k_with::<NeonDot>),
        (GgmlType::Q6_K, kquants::vec_dot_q6_k_with::<NeonDot>),
        (GgmlType::Q4_0, vec_dot_q4_0),
        (GgmlType::Q4_1, vec_dot_q4_1),
        (GgmlType::Q5_0, vec_dot_q5_0),
        (GgmlType::Q5_1, vec_dot_q5_1),
        (GgmlType::Q8_0, vec_dot_q8_0),
        (GgmlType::Q8_1, vec_dot_q8_1),
    ];
    for (ty, f) in dots {
        k.vec_dot[ty as usize] = Some(f);
    }
    k.gsq_dot = Some(gsq::dot_rows);
    Some(k)
}

/// A 32-element block format, as these NEON kernels unpack it.
trait Block32: BlockFormat {
    /// The 32 codes as signed bytes (elements 0..16, 16..32), in the order of the activation quants.
    unsafe fn codes(xb: *const u8) -> (int8x16_t, int8x16_t);
}

/// Low and high nibbles of the 16 bytes at `p`: elements 0..16 and 16..32.
#[inline(always)]
unsafe fn nibbles(p: *const u8) -> (uint8x16_t, uint8x16_t) {
    let b = vld1q_u8(p);
    (vandq_u8(b, vdupq_n_u8(0x0F)), vshrq_n_u8::<4>(b))
}

/// The 32 bits of the little-endian u32 at `p` as 0x10 (bit set) or 0 per element: elements 0..16, 16..32.
#[inline(always)]
unsafe fn fifth_bits(p: *const u8) -> (uint8x16_t, uint8x16_t) {
    let qh = vreinterpretq_u8_u32(vdupq_n_u32((p as *const u32).read_unaligned()));
    const LO: [u8; 16] = [0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1];
    const HI: [u8; 16] = [2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3];
    const BIT: [u8; 16] = [1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128];
    let bit = vld1q_u8(BIT.as_ptr());
    let sixteen = vdupq_n_u8(0x10);
    let lo = vandq_u8(vtstq_u8(vqtbl1q_u8(qh, vld1q_u8(LO.as_ptr())), bit), sixteen);
    let hi = vandq_u8(vtstq_u8(vqtbl1q_u8(qh, vld1q_u8(HI.as_ptr())), bit), sixteen);
    (lo, hi)
}

impl Block32 for Q4_0 {
    #[inline(always)]
    unsafe fn codes(xb: *const u8) -> (int8x16_t, int8x16_t) {
        let (lo, hi) = nibbles(xb.add(2));
        let eight = vdupq_n_s8(8);
        (vsubq_s8(vreinterpretq_s8_u8(lo), eight), vsubq_s8(vreinterpretq_s8_u8(hi), eight))
    }
}

impl Block32 for Q4_1 {
    #[inline(always)]
    unsafe fn codes(xb: *const u8) -> (int8x16_t, int8x16_t) {
        let (lo, hi) = nibbles(xb.add(4));
        (vreinterpretq_s8_u8(lo), vreinterpretq_s8_u8(hi))
    }
}

impl Block32 for Q5_0 {
    #[inline(always)]
    unsafe fn codes(xb: *const u8) -> (int8x16_t, int8x16_t) {
        let (lo, hi) = nibbles(xb.add(6));
        let (blo, bhi) = fifth_bits(xb.add(2));
        let sixteen = vdupq_n_s8(16);
        (
            vsubq_s8(vreinterpretq_s8_u8(vorrq_u8(lo, blo)), sixteen),
            vsubq_s8(vreinterpretq_s8_u8(vorrq_u8(hi, bhi)), sixteen),
        )
    }
}

impl Block32 for Q5_1 {
    #[inline(always)]
    unsafe fn codes(xb: *const u8) -> (int8x16_t, int8x16_t) {
        let (lo, hi) = nibbles(xb.add(8));
        let (blo, bhi) = fifth_bits(xb.add(4));
        (vreinterpretq_s8_u8(vorrq_u8(lo, blo)), vreinterpretq_s8_u8(vorrq_u8(hi, bhi)))
    }
}

impl Block32 for Q8_0 {
    #[inline(always)]
    unsafe fn codes(xb: *const u8) -> (int8x16_t, int8x16_t) {
        (vld1q_s8(xb.add(2) as *const i8), vld1q_s8(xb.add(18) as *const i8))
    }
}

impl Block32 for Q8_1 {
    #[inline(always)]
    unsafe fn codes(xb: *const u8) -> (int8x16_t, int8x16_t) {
        (vld1q_s8(xb.add(4) as *const i8), vld1q_s8(xb.add(20) as *const i8))
    }
}

#[inline(always)]
fn f16_at(p: *const u8) -> f32 {
    // SAFETY: callers pass pointers inside a block.
    half::f16::from_bits(unsafe { (p as *const u16).read_unaligned() }).to_f32()
}

/// Sum of the 16 products of two int8x16 vectors into four i32 lanes (exact: every product fits i16).
#[inline(always)]
unsafe fn dot16(x: int8x16_t, y: int8x16_t) -> int32x4_t {
    let lo = vmull_s8(vget_low_s8(x), vget_low_s8(y));
    let hi = vmull_high_s8(x, y);
    vaddq_s32(vpaddlq_s16(lo), vpaddlq_s16(hi))
}

/// One weight row of `nb` blocks dotted with one activation row.
#[inline(always)]
unsafe fn dot<F: Block32>(nb: usize, x: *const u8, y: *const u8) -> f32 {
    let mut acc = vdupq_n_f32(0.0);
    let mut summ = 0.0f32;
    for i in 0..nb {
        let (xb, yb) = (x.add(i * F::WB), y.add(i * F::AB));
        let (c0, c1) = F::codes(xb);
        let q = yb.add(F::A_QS) as *const i8;
        let isum = vaddq_s32(dot16(c0, vld1q_s8(q)), dot16(c1, vld1q_s8(q.add(16))));
        acc = vfmaq_n_f32(acc, vcvtq_f32_s32(isum), f16_at(xb) * f16_at(yb));
        if F::MIN {
            summ = f16_at(xb.add(2)).mul_add(f16_at(yb.add(2)), summ);
        }
    }
    vaddvq_f32(acc) + summ
}

/// A `VecDotFn` over `nb` blocks of format `$fmt`, clamped to the whole blocks both slices hold.
macro_rules! dot_wrapper {
    ($name:ident, $fmt:ty) => {
        fn $name(nb: usize, w: &[u8], a: &[u8]) -> f32 {
            let nb = nb.min(w.len() / <$fmt>::WB).min(a.len() / <$fmt>::AB);
            // SAFETY: NEON was detected (`detect`); `nb` whole blocks are in bounds of both slices.
            unsafe { dot::<$fmt>(nb, w.as_ptr(), a.as_ptr()) }
        }
    };
}

dot_wrapper!(vec_dot_q4_0, Q4_0);
dot_wrapper!(vec_dot_q4_1, Q4_1);
dot_wrapper!(vec_dot_q5_0, Q5_0);
dot_wrapper!(vec_dot_q5_1, Q5_1);
dot_wrapper!(vec_dot_q8_0, Q8_0);
dot_wrapper!(vec_dot_q8_1, Q8_1);

/// NEON int8 products for the K-quant reference code: 16 elements per step, the rest scalar.
struct NeonDot;

impl IntDot for NeonDot {
    #[inline(always)]
    fn dot(a: &[i8], b: &[u8]) -> i32 {
        let n = a.len().min(b.len());
        let n16 = n - n % 16;
        let mut acc = 0i32;
        // SAFETY: NEON is part of the aarch64 baseline; every load reads 16 bytes below n16.
        unsafe {
            let mut v = vdupq_n_s32(0);
            let mut i = 0;
            while i < n16 {
                v = vaddq_s32(v, dot16(vld1q_s8(a.as_ptr().add(i)), vld1q_s8(b.as_ptr().add(i) as *const i8)));
                i += 16;
            }
            acc += vaddvq_s32(v);
        }
        acc + a[n16..n].iter().zip(&b[n16..n]).map(|(&x, &y)| x as i32 * (y as i8) as i32).sum::<i32>()
    }
}
