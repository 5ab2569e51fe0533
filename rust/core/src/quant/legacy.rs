//! The legacy 32-element block formats (GGML's `block_q4_0` .. `block_q8_1`):
//!
//! | type | bytes | layout                                         | value of element j             |
//! |------|-------|------------------------------------------------|--------------------------------|
//! | Q4_0 | 18    | d: f16, qs: [u8; 16]                           | d * (nibble - 8)               |
//! | Q4_1 | 20    | d: f16, m: f16, qs: [u8; 16]                   | d * nibble + m                 |
//! | Q5_0 | 22    | d: f16, qh: u32 (LE), qs: [u8; 16]             | d * (nibble + 16*bit - 16)     |
//! | Q5_1 | 24    | d: f16, m: f16, qh: u32 (LE), qs: [u8; 16]     | d * (nibble + 16*bit) + m      |
//! | Q8_0 | 34    | d: f16, qs: [i8; 32]                           | d * q                          |
//! | Q8_1 | 36    | d: f16, s: f16 (= d * sum(qs)), qs: [i8; 32]   | d * q                          |
//!
//! In the 4- and 5-bit formats byte `qs[j]` holds element j in its low nibble and element j + 16 in its high
//! nibble; bit j of `qh` is the fifth bit of element j.
//!
//! Like the K-quants, each block is first unpacked into 32 small integers in element order (`unpack_*`), shared
//! by dequantization and the dot products. The quantizers are llama.cpp's `quantize_row_*_ref` (truncating
//! `(int8_t)` casts, `roundf` for Q8), the dot products its `ggml_vec_dot_*_generic`: an exact i32 sum per
//! block, scaled by the two block scales in f32.

use super::float::{f16_at, put_f16};
use super::format::{Q4_0_BYTES, Q4_1_BYTES, Q5_0_BYTES, Q5_1_BYTES, Q8_0_BYTES, Q8_1_BYTES, QK_LEGACY as QK};
use super::math::{abs_max, dot_i8, nearest_int, signed_abs_max};

const HALF: usize = QK / 2;

/// The 32 four-bit codes of a Q4 block minus `offset` (8 for Q4_0, 0 for Q4_1).
#[inline(always)]
fn unpack_q4(qs: &[u8], offset: i8) -> [i8; QK] {
    let mut q = [0i8; QK];
    let (lo, hi) = q.split_at_mut(HALF);
    for ((l, h), &b) in lo.iter_mut().zip(hi).zip(qs) {
        *l = (b & 0x0F) as i8 - offset;
        *h = (b >> 4) as i8 - offset;
    }
    q
}

/// `SPREAD16[b]`, read as 8 little-endian bytes: byte i is 16 if bit i of `b` is set, else 0. Turns one byte of
/// Q5 `qh` into the fifth bits of 8 elements without per-bit shifts.
const SPREAD16: [u64; 256] = {
    let mut table = [0u64; 256];
    let mut b = 0;
    while b < 256 {
        let mut i = 0;
        while i < 8 {
            if (b >> i) & 1 != 0 {
                table[b] |= 16 << (8 * i);
            }
            i += 1;
        }
        b += 1;
    }
    table
};

/// The 32 five-bit codes of a Q5 block (low nibbles, plus bit j of the little-endian u32 `qh` as bit 4 of
/// element j) minus `offset` (16 for Q5_0, 0 for Q5_1).
#[inline(always)]
fn unpack_q5(qh: &[u8], qs: &[u8], offset: i8) -> [i8; QK] {
    let mut high = [0u8; QK];
    for (h, &b) in high.chunks_exact_mut(8).zip(qh) {
        h.copy_from_slice(&SPREAD16[b as usize].to_le_bytes());
    }
    let mut q = [0i8; QK];
    let (lo, hi) = q.split_at_mut(HALF);
    let (high_lo, high_hi) = high.split_at(HALF);
    for ((((l, h), &b), &bit_l), &bit_h) in lo.iter_mut().zip(hi).zip(qs).zip(high_lo).zip(high_hi) {
        *l = ((b & 0x0F) | bit_l) as i8 - offset;
        *h = ((b >> 4) | bit_h) as i8 - offset;
    }
    q
}

/// Minimum and maximum of `x` as the Q4_1/Q5_1 references compute them.
#[inline(always)]
fn min_max(x: &[f32]) -> (f32, f32) {
    let (mut min, mut max) = (f32::MAX, -f32::MAX);
    for &v in x {
        if v < min {
            min = v;
        }
        if v > max {
            max = v;
        }
    }
    (min, max)
}

#[inline(always)]
fn inverse_or_zero(d: f32) -> f32 {
    if d != 0.0 {
        1.0 / d
    } else {
        0.0
    }
}

// ---------------------------------------------------------------------------------------------------------------
// Dequantization
// ---------------------------------------------------------------------------------------------------------------

/// `y = q * d` over one block (Q4_0, Q5_0).
#[inline(always)]
fn scale_block(q: &[i8; QK], d: f32, y: &mut [f32; QK]) {
    for (y, &q) in y.iter_mut().zip(q) {
        *y = q as f32 * d;
    }
}

/// `y = q * d + m` over one block (Q4_1, Q5_1).
#[inline(always)]
fn scale_min_block(q: &[i8; QK], d: f32, m: f32, y: &mut [f32; QK]) {
    for (y, &q) in y.iter_mut().zip(q) {
        *y = q as f32 * d + m;
    }
}

pub(super) fn dequantize_q4_0(src: &[u8], dst: &mut [f32]) {
    let (blocks, _) = src.as_chunks::<Q4_0_BYTES>();
    let (out, _) = dst.as_chunks_mut::<QK>();
    for (b, y) in blocks.iter().zip(out) {
        scale_block(&unpack_q4(&b[2..], 8), f16_at(&b[0..2]), y);
    }
}

pub(super) fn dequantize_q4_1(src: &[u8], dst: &mut [f32]) {
    let (blocks, _) = src.as_chunks::<Q4_1_BYTES>();
    let (out, _) = dst.as_chunks_mut::<QK>();
    for (b, y) in blocks.iter().zip(out) {
        scale_min_block(&unpack_q4(&b[4..], 0), f16_at(&b[0..2]), f16_at(&b[2..4]), y);
    }
}

pub(super) fn dequantize_q5_0(src: &[u8], dst: &mut [f32]) {
    let (blocks, _) = src.as_chunks::<Q5_0_BYTES>();
    let (out, _) = dst.as_chunks_mut::<QK>();
    for (b, y) in blocks.iter().zip(out) {
        scale_block(&unpack_q5(&b[2..6], &b[6..], 16), f16_at(&b[0..2]), y);
    }
}

pub(super) fn dequantize_q5_1(src: &[u8], dst: &mut [f32]) {
    let (blocks, _) = src.as_chunks::<Q5_1_BYTES>();
    let (out, _) = dst.as_chunks_mut::<QK>();
    for (b, y) in blocks.iter().zip(out) {
        scale_min_block(&unpack_q5(&b[4..8], &b[8..], 0), f16_at(&b[0..2]), f16_at(&b[2..4]), y);
    }
}

/// Shared by Q8_0 and Q8_1 (`OFF` is where the quants start).
#[inline(always)]
fn dequantize_q8<const BYTES: usize, const OFF: usize>(src: &[u8], dst: &mut [f32]) {
    let (blocks, _) = src.as_chunks::<BYTES>();
    let (out, _) = dst.as_chunks_mut::<QK>();
    for (b, y) in blocks.iter().zip(out) {
        let d = f16_at(&b[0..2]);
        for (y, &q) in y.iter_mut().zip(&b[OFF..]) {
            *y = (q as i8) as f32 * d;
        }
    }
}

pub(super) fn dequantize_q8_0(src: &[u8], dst: &mut [f32]) {
    dequantize_q8::<Q8_0_BYTES, 2>(src, dst)
}

pub(super) fn dequantize_q8_1(src: &[u8], dst: &mut [f32]) {
    dequantize_q8::<Q8_1_BYTES, 4>(src, dst)
}

// ---------------------------------------------------------------------------------------------------------------
// Quantization (llama.cpp's quantize_row_*_ref)
// ---------------------------------------------------------------------------------------------------------------

pub(super) fn quantize_q4_0(x: &[f32], dst: &mut [u8]) {
    let (blocks, _) = dst.as_chunks_mut::<Q4_0_BYTES>();
    let (xs, _) = x.as_chunks::<QK>();
    for (b, x) in blocks.iter_mut().zip(xs) {
        let d = signed_abs_max(x) / -8.0;
        let id = inverse_or_zero(d);
        put_f16(&mut b[0..2], d);
        let (lo, hi) = x.split_at(HALF);
        for ((q, &x0), &x1) in b[2..].iter_mut().zip(lo).zip(hi) {
            // C: MIN(15, (int8_t)(x*id + 8.5f)); the cast truncates toward zero.
            let q0 = ((x0 * id + 8.5) as i8).min(15) as u8;
            let q1 = ((x1 * id + 8.5) as i8).min(15) as u8;
            *q = q0 | (q1 << 4);
        }
    }
}

pub(super) fn quantize_q4_1(x: &[f32], dst: &mut [u8]) {
    let (blocks, _) = dst.as_chunks_mut::<Q4_1_BYTES>();
    let (xs, _) = x.as_chunks::<QK>();
    for (b, x) in blocks.iter_mut().zip(xs) {
        let (min, max) = min_max(x);
        let d = (max - min) / 15.0;
        let id = inverse_or_zero(d);
        put_f16(&mut b[0..2], d);
        put_f16(&mut b[2..4], min);
        let (lo, hi) = x.split_at(HALF);
        for ((q, &x0), &x1) in b[4..].iter_mut().zip(lo).zip(hi) {
            let q0 = (((x0 - min) * id + 0.5) as i8).min(15) as u8;
            let q1 = (((x1 - min) * id + 0.5) as i8).min(15) as u8;
            *q = q0 | (q1 << 4);
        }
    }
}

/// Pack 32 five-bit codes into `qh` (fifth bits) and `qs` (nibbles).
#[inline(always)]
fn pack_q5(q: &[u8; QK], qh: &mut [u8], qs: &mut [u8]) {
    let mut bits = 0u32;
    for (j, &v) in q.iter().enumerate() {
        bits |= (((v & 0x10) >> 4) as u32) << j;
    }
    qh[..4].copy_from_slice(&bits.to_le_bytes());
    let (lo, hi) = q.split_at(HALF);
    for ((o, &a), &b) in qs.iter_mut().zip(lo).zip(hi) {
        *o = (a & 0x0F) | ((b & 0x0F) << 4);
    }
}

pub(super) fn quantize_q5_0(x: &[f32], dst: &mut [u8]) {
    let (blocks, _) = dst.as_chunks_mut::<Q5_0_BYTES>();
    let (xs, _) = x.as_chunks::<QK>();
    for (b, x) in blocks.iter_mut().zip(xs) {
        let d = signed_abs_max(x) / -16.0;
        let id = inverse_or_zero(d);
        put_f16(&mut b[0..2], d);
        let q: [u8; QK] = std::array::from_fn(|j| ((x[j] * id + 16.5) as i8).min(31) as u8);
        let (qh, qs) = b[2..].split_at_mut(4);
        pack_q5(&q, qh, qs);
    }
}

pub(super) fn quantize_q5_1(x: &[f32], dst: &mut [u8]) {
    let (blocks, _) = dst.as_chunks_mut::<Q5_1_BYTES>();
    let (xs, _) = x.as_chunks::<QK>();
    for (b, x) in blocks.iter_mut().zip(xs) {
        let (min, max) = min_max(x);
        let d = (max - min) / 31.0;
        let id = inverse_or_zero(d);
        put_f16(&mut b[0..2], d);
        put_f16(&mut b[2..4], min);
        // C: (uint8_t)(x*id + 0.5f), no clamp (the value cannot exceed 31.5).
        let q: [u8; QK] = std::array::from_fn(|j| ((x[j] - min) * id + 0.5) as u8);
        let (qh, qs) = b[4..].split_at_mut(4);
        pack_q5(&q, qh, qs);
    }
}

/// Q8_0/Q8_1 quants of one block as llama.cpp's x86 SIMD path computes them (the path every AVX2 machine runs,
/// for activations and for a q8_0 KV cache alike): `d = amax / 127`, `q = round_half_even(x * (127 / amax))`.
/// Its scalar reference differs (`x * (1 / d)`, ties away from zero) and flips a quant by one now and then,
/// which is enough to change a greedy token, so parity follows the code that actually runs.
/// Returns `d` (in f32, before rounding to f16) and the sum of the quants.
#[inline(always)]
fn quantize_block_q8(x: &[f32; QK], qs: &mut [u8]) -> (f32, i32) {
    let amax = abs_max(x);
    let d = amax / 127.0;
    let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
    let mut sum = 0i32;
    for (q, &v) in qs.iter_mut().zip(x) {
        let r = nearest_int(v * id) as i8;
        sum += r as i32;
        *q = r as u8;
    }
    (d, sum)
}

pub(super) fn quantize_q8_0(x: &[f32], dst: &mut [u8]) {
    let (blocks, _) = dst.as_chunks_mut::<Q8_0_BYTES>();
    let (xs, _) = x.as_chunks::<QK>();
    for (b, x) in blocks.iter_mut().zip(xs) {
        let (d, _) = quantize_block_q8(x, &mut b[2..]);
        put_f16(&mut b[0..2], d);
    }
}

pub(super) fn quantize_q8_1(x: &[f32], dst: &mut [u8]) {
    let (blocks, _) = dst.as_chunks_mut::<Q8_1_BYTES>();
    let (xs, _) = x.as_chunks::<QK>();
    for (b, x) in blocks.iter_mut().zip(xs) {
        let (d, sum) = quantize_block_q8(x, &mut b[4..]);
        put_f16(&mut b[0..2], d);
        put_f16(&mut b[2..4], sum as f32 * d);
    }
}

// ---------------------------------------------------------------------------------------------------------------
// Dot products (weights x Q8_0 / Q8_1 activations); `nb` is the number of blocks
// ---------------------------------------------------------------------------------------------------------------

/// Zip the first `nb` weight blocks with the first `nb` activation blocks.
#[inline(always)]
fn block_pairs<'a, const WB: usize, const AB: usize>(
    nb: usize,
    w: &'a [u8],
    a: &'a [u8],
) -> impl Iterator<Item = (&'a [u8; WB], &'a [u8; AB])> {
    w.as_chunks::<WB>().0.iter().zip(a.as_chunks::<AB>().0).take(nb)
}

pub(super) fn vec_dot_q4_0_q8_0(nb: usize, w: &[u8], a: &[u8]) -> f32 {
    let mut sumf = 0.0f32;
    for (x, y) in block_pairs::<Q4_0_BYTES, Q8_0_BYTES>(nb, w, a) {
        let sumi = dot_i8(&unpack_q4(&x[2..], 8), &y[2..]);
        sumf += sumi as f32 * f16_at(&x[0..2]) * f16_at(&y[0..2]);
    }
    sumf
}

pub(super) fn vec_dot_q4_1_q8_1(nb: usize, w: &[u8], a: &[u8]) -> f32 {
    let mut sumf = 0.0f32;
    for (x, y) in block_pairs::<Q4_1_BYTES, Q8_1_BYTES>(nb, w, a) {
        let sumi = dot_i8(&unpack_q4(&x[4..], 0), &y[4..]);
        // The min contributes m * sum(x_act) = m * s, with s stored in the Q8_1 block.
        sumf += (f16_at(&x[0..2]) * f16_at(&y[0..2])) * sumi as f32 + f16_at(&x[2..4]) * f16_at(&y[2..4]);
    }
    sumf
}

pub(super) fn vec_dot_q5_0_q8_0(nb: usize, w: &[u8], a: &[u8]) -> f32 {
    let mut sumf = 0.0f32;
    for (x, y) in block_pairs::<Q5_0_BYTES, Q8_0_BYTES>(nb, w, a) {
        let sumi = dot_i8(&unpack_q5(&x[2..6], &x[6..], 16), &y[2..]);
        sumf += (f16_at(&x[0..2]) * f16_at(&y[0..2])) * sumi as f32;
    }
    sumf
}

pub(super) fn vec_dot_q5_1_q8_1(nb: usize, w: &[u8], a: &[u8]) -> f32 {
    let mut sumf = 0.0f32;
    for (x, y) in block_pairs::<Q5_1_BYTES, Q8_1_BYTES>(nb, w, a) {
        let sumi = dot_i8(&unpack_q5(&x[4..8], &x[8..], 0), &y[4..]);
        sumf += (f16_at(&x[0..2]) * f16_at(&y[0..2])) * sumi as f32 + f16_at(&x[2..4]) * f16_at(&y[2..4]);
    }
    sumf
}

/// Both rows int8 (Q8_0 x Q8_0 or Q8_1 x Q8_1): `OFF` is where the quants start in a block.
#[inline(always)]
fn vec_dot_q8<const BYTES: usize, const OFF: usize>(nb: usize, w: &[u8], a: &[u8]) -> f32 {
    let mut sumf = 0.0f32;
    for (x, y) in block_pairs::<BYTES, BYTES>(nb, w, a) {
        let xq: &[u8] = &x[OFF..];
        let sumi: i32 = xq
            .iter()
            .zip(&y[OFF..])
            .map(|(&p, &q)| (p as i8) as i32 * (q as i8) as i32)
            .sum();
        sumf += sumi as f32 * (f16_at(&x[0..2]) * f16_at(&y[0..2]));
    }
    sumf
}

pub(super) fn vec_dot_q8_0_q8_0(nb: usize, w: &[u8], a: &[u8]) -> f32 {
    vec_dot_q8::<Q8_0_BYTES, 2>(nb, w, a)
}

pub(super) fn vec_dot_q8_1_q8_1(nb: usize, w: &[u8], a: &[u8]) -> f32 {
    vec_dot_q8::<Q8_1_BYTES, 4>(nb, w, a)
}
