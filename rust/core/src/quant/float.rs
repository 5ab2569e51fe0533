//! The plain float types: F32, F16 (IEEE half) and BF16 (bfloat16), all little-endian, one element per "block".
//!
//! Conversions to f16/bf16 round to nearest even, as GGML's do (`ggml_compute_fp32_to_fp16` / `_to_bf16`);
//! the `half` crate implements exactly those roundings (including bf16's quieting of NaNs). Widening f16 to f32
//! (exact) is done by [`f16_to_f32`], branch-free plain Rust that inlines and vectorizes, instead of `half`'s
//! per-call CPU-feature dispatch.
//! Dot products accumulate in eight independent f32 lanes, like llama.cpp's SIMD `ggml_vec_dot_f16/f32/bf16`,
//! which also keeps the loops free of a serial dependency on one accumulator.

use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};

/// Number of independent accumulators in the float dot products.
const LANES: usize = 8;

#[inline(always)]
fn f32_le(b: [u8; 4]) -> f32 {
    f32::from_le_bytes(b)
}

#[inline(always)]
fn bf16_le(b: [u8; 2]) -> f32 {
    // bf16 is the upper half of an f32: widening is a shift, exact.
    f32::from_bits((u16::from_le_bytes(b) as u32) << 16)
}

/// IEEE half (as bits) to f32, exactly, without branches (after F. Giesen's `half_to_float`): move exponent
/// and mantissa into place and rebias the exponent; infinities/NaNs get the larger f32 exponent bias, zeros and
/// subnormals are renormalized by an exact f32 subtraction.
#[inline(always)]
pub(super) fn f16_to_f32(h: u16) -> f32 {
    const EXP_MASK: u32 = 0x7c00 << 13; // the f16 exponent field, moved to f32's place
    const REBIAS: u32 = (127 - 15) << 23;
    let h = h as u32;
    let em = (h & 0x7fff) << 13;
    let exp = em & EXP_MASK;
    let normal = em + REBIAS;
    let inf_nan = normal + REBIAS;
    // Subnormal m * 2^-24: build 2^-14 * (1 + m / 1024) and subtract 2^-14.
    let subnormal = (f32::from_bits(normal + (1 << 23)) - f32::from_bits(113 << 23)).to_bits();
    // Select with masks rather than `if`, so the compiler keeps it branch-free and vectorizes it.
    let is_inf_nan = ((exp == EXP_MASK) as u32).wrapping_neg();
    let is_subnormal = ((exp == 0) as u32).wrapping_neg();
    let bits = (normal & !(is_inf_nan | is_subnormal)) | (inf_nan & is_inf_nan) | (subnormal & is_subnormal);
    f32::from_bits(bits | ((h & 0x8000) << 16))
}

/// Read a little-endian IEEE half at the start of `b` as f32 (the `d`/`dmin`/`m`/`s` fields of the blocks).
#[inline(always)]
pub(super) fn f16_at(b: &[u8]) -> f32 {
    f16_to_f32(u16::from_le_bytes([b[0], b[1]]))
}

/// Write `v` rounded to nearest-even IEEE half, little-endian, into the first two bytes of `b`.
#[inline(always)]
pub(super) fn put_f16(b: &mut [u8], v: f32) {
    b[..2].copy_from_slice(&half::f16::from_f32(v).to_le_bytes());
}

#[inline(always)]
fn f16_le(b: [u8; 2]) -> f32 {
    f16_to_f32(u16::from_le_bytes(b))
}

// ---------------------------------------------------------------------------------------------------------------
// Dequantization (bytes -> f32)
// ---------------------------------------------------------------------------------------------------------------

pub(super) fn dequantize_f32(src: &[u8], dst: &mut [f32]) {
    let (elems, _) = src.as_chunks::<4>();
    for (y, &b) in dst.iter_mut().zip(elems) {
        *y = f32_le(b);
    }
}

pub(super) fn dequantize_f16(src: &[u8], dst: &mut [f32]) {
    let (elems, _) = src.as_chunks::<2>();
    for (y, &b) in dst.iter_mut().zip(elems) {
        *y = f16_le(b);
    }
}

pub(super) fn dequantize_bf16(src: &[u8], dst: &mut [f32]) {
    let (elems, _) = src.as_chunks::<2>();
    for (y, &b) in dst.iter_mut().zip(elems) {
        *y = bf16_le(b);
    }
}

// ---------------------------------------------------------------------------------------------------------------
// Quantization (f32 -> bytes)
// ---------------------------------------------------------------------------------------------------------------

pub(super) fn quantize_f32(x: &[f32], dst: &mut [u8]) {
    let (out, _) = dst.as_chunks_mut::<4>();
    for (o, &v) in out.iter_mut().zip(x) {
        *o = v.to_le_bytes();
    }
}

pub(super) fn quantize_f16(x: &[f32], dst: &mut [u8]) {
    let (out, _) = dst.as_chunks_mut::<2>();
    let (out_groups, out_tail) = out.as_chunks_mut::<LANES>();
    let (groups, tail) = x.as_chunks::<LANES>();
    for (o, v) in out_groups.iter_mut().zip(groups) {
        let mut h = [f16::ZERO; LANES];
        h.convert_from_f32_slice(v);
        *o = h.map(f16::to_le_bytes);
    }
    for (o, &v) in out_tail.iter_mut().zip(tail) {
        *o = f16::from_f32(v).to_le_bytes();
    }
}

pub(super) fn quantize_bf16(x: &[f32], dst: &mut [u8]) {
    let (out, _) = dst.as_chunks_mut::<2>();
    for (o, &v) in out.iter_mut().zip(x) {
        *o = bf16::from_f32(v).to_le_bytes();
    }
}

// ---------------------------------------------------------------------------------------------------------------
// Dot products
// ---------------------------------------------------------------------------------------------------------------

/// Elements decoded at a time by the float dot products: a whole group is widened to f32 into a stack buffer
/// first (a simple loop the compiler vectorizes), then multiplied into the lane accumulators.
const GROUP: usize = 64;

/// Dot product of the first `n` elements of two rows of `B`-byte floats decoded by `decode`: groups of
/// [`GROUP`] go through stack buffers into eight lane accumulators, the tail is done one element at a time.
#[inline(always)]
fn dot_rows<const B: usize>(n: usize, w: &[u8], a: &[u8], decode: impl Fn([u8; B]) -> f32 + Copy) -> f32 {
    #[inline(always)]
    fn widen<const B: usize>(src: &[[u8; B]; GROUP], decode: impl Fn([u8; B]) -> f32) -> [f32; GROUP] {
        let mut out = [0.0f32; GROUP];
        for (o, &b) in out.iter_mut().zip(src) {
            *o = decode(b);
        }
        out
    }

    let (w, _) = w.as_chunks::<B>();
    let (a, _) = a.as_chunks::<B>();
    let n = n.min(w.len()).min(a.len());
    let (wg, wt) = w[..n].as_chunks::<GROUP>();
    let (ag, at) = a[..n].as_chunks::<GROUP>();

    let mut acc = [0.0f32; LANES];
    for (wb, ab) in wg.iter().zip(ag) {
        let (x, y) = (widen(wb, decode), widen(ab, decode));
        for (xs, ys) in x.as_chunks::<LANES>().0.iter().zip(y.as_chunks::<LANES>().0) {
            for l in 0..LANES {
                acc[l] += xs[l] * ys[l];
            }
        }
    }
    // Pairwise reduction of the lanes, then the tail.
    let mut sum = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for (&x, &y) in wt.iter().zip(at) {
        sum += decode(x) * decode(y);
    }
    sum
}

pub(super) fn vec_dot_f32(n: usize, w: &[u8], a: &[u8]) -> f32 {
    dot_rows::<4>(n, w, a, f32_le)
}

pub(super) fn vec_dot_f16(n: usize, w: &[u8], a: &[u8]) -> f32 {
    dot_rows::<2>(n, w, a, f16_le)
}

pub(super) fn vec_dot_bf16(n: usize, w: &[u8], a: &[u8]) -> f32 {
    dot_rows::<2>(n, w, a, bf16_le)
}
