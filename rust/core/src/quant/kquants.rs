//! The K-quant super-block formats (QK_K = 256 elements per block), GGML's `block_q2_K` .. `block_q8_K`:
//!
//! | type | bytes | layout (in order)                                                              |
//! |------|-------|--------------------------------------------------------------------------------|
//! | Q2_K | 84    | scales: [u8; 16] (low nibble scale, high nibble min), qs: [u8; 64], d, dmin     |
//! | Q3_K | 110   | hmask: [u8; 32], qs: [u8; 64], scales: [u8; 12] (16 x 6 bits), d               |
//! | Q4_K | 144   | d, dmin, scales: [u8; 12] (8 scales + 8 mins, 6 bits each), qs: [u8; 128]       |
//! | Q5_K | 176   | d, dmin, scales: [u8; 12], qh: [u8; 32], qs: [u8; 128]                          |
//! | Q6_K | 210   | ql: [u8; 128], qh: [u8; 64], scales: [i8; 16], d                                |
//! | Q8_K | 292   | d: f32, qs: [i8; 256], bsums: [i16; 16] (sums of 16 quants)                     |
//!
//! (`d`, `dmin`: f16 little-endian, except Q8_K's f32.)
//!
//! Each weight format is handled in two steps: `unpack_*` turns the packed bits of a block into 256 small
//! signed integers in element order (the part shared by dequantization and the dot product), then either
//! - dequantization applies the sub-block scales in f32, with the same operations as llama.cpp's
//!   `dequantize_row_*`, or
//! - the dot product sums `scale * sum(q * q8)` exactly in i32 over the sub-blocks and scales once per
//!   super-block in f32, like `ggml_vec_dot_*_q8_K_generic`; the mins of Q2_K/Q4_K/Q5_K use Q8_K's `bsums`.

use super::float::f16_at;
use super::format::{Q2_K_BYTES, Q3_K_BYTES, Q4_K_BYTES, Q5_K_BYTES, Q6_K_BYTES, Q8_K_BYTES, QK_K};
use super::math::{nearest_int, signed_abs_max, IntDot, ScalarDot};

/// Integer codes of one super-block, in element order.
type Codes = [i8; QK_K];

// ---------------------------------------------------------------------------------------------------------------
// Unpacking the bits of one block
// ---------------------------------------------------------------------------------------------------------------

/// Q2_K: 2-bit codes 0..=3. Byte l of each 32-byte half of `qs` holds, from the low bits up, elements
/// l, l + 32, l + 64 and l + 96 of that half's 128 elements.
#[inline(always)]
fn unpack_q2_k(qs: &[u8], out: &mut Codes) {
    for (q, out) in qs.chunks_exact(32).zip(out.chunks_exact_mut(128)) {
        for (j, out) in out.chunks_exact_mut(32).enumerate() {
            let shift = 2 * j;
            for (o, &b) in out.iter_mut().zip(q) {
                *o = ((b >> shift) & 3) as i8;
            }
        }
    }
}

/// Q3_K: 3-bit signed codes -4..=3: the 2 low bits as in Q2_K, and `hmask` bit (4k + j) of byte l clear
/// means "minus 4" for element 128k + 32j + l.
#[inline(always)]
fn unpack_q3_k(hmask: &[u8], qs: &[u8], out: &mut Codes) {
    for (k, (q, out)) in qs.chunks_exact(32).zip(out.chunks_exact_mut(128)).enumerate() {
        for (j, out) in out.chunks_exact_mut(32).enumerate() {
            let shift = 2 * j;
            let m = 1u8 << (4 * k + j);
            for ((o, &b), &h) in out.iter_mut().zip(q).zip(hmask) {
                *o = ((b >> shift) & 3) as i8 - if h & m != 0 { 0 } else { 4 };
            }
        }
    }
}

/// Q4_K: 4-bit codes 0..=15. Each 32 bytes of `qs` hold 64 elements: the first 32 in the low nibbles, the next
/// 32 in the high nibbles.
#[inline(always)]
fn unpack_q4_k(qs: &[u8], out: &mut Codes) {
    for (q, out) in qs.chunks_exact(32).zip(out.chunks_exact_mut(64)) {
        let (lo, hi) = out.split_at_mut(32);
        for ((l, h), &b) in lo.iter_mut().zip(hi).zip(q) {
            *l = (b & 0x0F) as i8;
            *h = (b >> 4) as i8;
        }
    }
}

/// Q5_K: 5-bit codes 0..=31: the nibbles as in Q4_K plus a fifth bit from `qh`, whose bits 2k and 2k + 1 of
/// byte l belong to elements 64k + l and 64k + 32 + l.
#[inline(always)]
fn unpack_q5_k(qh: &[u8], qs: &[u8], out: &mut Codes) {
    for (k, (q, out)) in qs.chunks_exact(32).zip(out.chunks_exact_mut(64)).enumerate() {
        let (u1, u2) = (1u8 << (2 * k), 2u8 << (2 * k));
        let (lo, hi) = out.split_at_mut(32);
        for (((l, h), &b), &hb) in lo.iter_mut().zip(hi).zip(q).zip(qh) {
            *l = ((b & 0x0F) + if hb & u1 != 0 { 16 } else { 0 }) as i8;
            *h = ((b >> 4) + if hb & u2 != 0 { 16 } else { 0 }) as i8;
        }
    }
}

/// Q6_K: 6-bit codes minus 32 (-32..=31). Per 128 elements, 64 bytes of `ql` (nibbles) and 32 of `qh` (2-bit
/// pairs): element l takes ql[l] low nibble and qh[l] bits 0-1, l + 32 ql[l + 32] low and bits 2-3, l + 64
/// ql[l] high and bits 4-5, l + 96 ql[l + 32] high and bits 6-7.
#[inline(always)]
fn unpack_q6_k(ql: &[u8], qh: &[u8], out: &mut Codes) {
    for ((ql, qh), out) in ql
        .chunks_exact(64)
        .zip(qh.chunks_exact(32))
        .zip(out.chunks_exact_mut(128))
    {
        let (ql0, ql1) = ql.split_at(32);
        let (o01, o23) = out.split_at_mut(64);
        let (o0, o1) = o01.split_at_mut(32);
        let (o2, o3) = o23.split_at_mut(32);
        for l in 0..32 {
            let (a, b, h) = (ql0[l], ql1[l], qh[l]);
            o0[l] = ((a & 0x0F) | ((h & 3) << 4)) as i8 - 32;
            o1[l] = ((b & 0x0F) | (((h >> 2) & 3) << 4)) as i8 - 32;
            o2[l] = ((a >> 4) | (((h >> 4) & 3) << 4)) as i8 - 32;
            o3[l] = ((b >> 4) | (((h >> 6) & 3) << 4)) as i8 - 32;
        }
    }
}

/// The sixteen 6-bit scales of Q3_K, minus 32 (-32..=31). Scale j has its low 4 bits in byte j (j < 8, low
/// nibble) or byte j - 8 (high nibble), and its high 2 bits in byte 8 + j % 4 at bit 2 * (j / 4).
#[inline(always)]
fn q3_k_scales(s: &[u8]) -> [i32; 16] {
    std::array::from_fn(|j| {
        let low = if j < 8 { s[j] & 0x0F } else { s[j - 8] >> 4 };
        let high = (s[8 + j % 4] >> (2 * (j / 4))) & 3;
        (low | (high << 4)) as i32 - 32
    })
}

/// The eight 6-bit scales and eight 6-bit mins of Q4_K/Q5_K (`get_scale_min_k4`): for j < 4 scale j is
/// s[j] & 63 and min j is s[j + 4] & 63; for j >= 4 the low 4 bits come from s[j + 4] (scale: low nibble,
/// min: high nibble) and the high 2 bits from the top bits of s[j - 4] (scale) and s[j] (min).
#[inline(always)]
pub(in crate::quant) fn k4_scales_mins(s: &[u8]) -> ([u8; 8], [u8; 8]) {
    let mut sc = [0u8; 8];
    let mut mn = [0u8; 8];
    for j in 0..4 {
        sc[j] = s[j] & 63;
        mn[j] = s[j + 4] & 63;
        sc[j + 4] = (s[j + 8] & 0x0F) | ((s[j] >> 6) << 4);
        mn[j + 4] = (s[j + 8] >> 4) | ((s[j + 4] >> 6) << 4);
    }
    (sc, mn)
}

// ---------------------------------------------------------------------------------------------------------------
// Block field accessors (offsets from the layout table above)
// ---------------------------------------------------------------------------------------------------------------

/// Q8_K: (d, quants, bsums bytes).
#[inline(always)]
fn q8_k_parts(b: &[u8; Q8_K_BYTES]) -> (f32, &[u8], &[u8]) {
    let d = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
    (d, &b[4..4 + QK_K], &b[4 + QK_K..])
}

/// The 16 `bsums` of a Q8_K block.
#[inline(always)]
fn q8_k_bsums(bytes: &[u8]) -> [i32; 16] {
    std::array::from_fn(|j| i16::from_le_bytes([bytes[2 * j], bytes[2 * j + 1]]) as i32)
}

// ---------------------------------------------------------------------------------------------------------------
// Dequantization
// ---------------------------------------------------------------------------------------------------------------

pub(super) fn dequantize_q2_k(src: &[u8], dst: &mut [f32]) {
    let mut q = [0i8; QK_K];
    let (blocks, _) = src.as_chunks::<Q2_K_BYTES>();
    let (out, _) = dst.as_chunks_mut::<QK_K>();
    for (b, y) in blocks.iter().zip(out) {
        let scales = &b[0..16];
        unpack_q2_k(&b[16..80], &mut q);
        let (d, dmin) = (f16_at(&b[80..82]), f16_at(&b[82..84]));
        for ((y, q), &sc) in y.chunks_exact_mut(16).zip(q.chunks_exact(16)).zip(scales) {
            let dl = d * (sc & 0x0F) as f32;
            let ml = dmin * (sc >> 4) as f32;
            for (y, &q) in y.iter_mut().zip(q) {
                *y = dl * q as f32 - ml;
            }
        }
    }
}

pub(super) fn dequantize_q3_k(src: &[u8], dst: &mut [f32]) {
    let mut q = [0i8; QK_K];
    let (blocks, _) = src.as_chunks::<Q3_K_BYTES>();
    let (out, _) = dst.as_chunks_mut::<QK_K>();
    for (b, y) in blocks.iter().zip(out) {
        unpack_q3_k(&b[0..32], &b[32..96], &mut q);
        let scales = q3_k_scales(&b[96..108]);
        let d = f16_at(&b[108..110]);
        for ((y, q), &sc) in y.chunks_exact_mut(16).zip(q.chunks_exact(16)).zip(&scales) {
            let dl = d * sc as f32;
            for (y, &q) in y.iter_mut().zip(q) {
                *y = dl * q as f32;
            }
        }
    }
}

/// Q4_K and Q5_K share the scale/min scheme: 8 sub-blocks of 32, `y = d * sc * q - dmin * m`.
#[inline(always)]
fn apply_k4_scales(d: f32, dmin: f32, scales: &[u8], q: &Codes, y: &mut [f32; QK_K]) {
    let (sc, mn) = k4_scales_mins(scales);
    for (((y, q), &sc), &m) in y.chunks_exact_mut(32).zip(q.chunks_exact(32)).zip(&sc).zip(&mn) {
        let d1 = d * sc as f32;
        let m1 = dmin * m as f32;
        for (y, &q) in y.iter_mut().zip(q) {
            *y = d1 * q as f32 - m1;
        }
    }
}

pub(super) fn dequantize_q4_k(src: &[u8], dst: &mut [f32]) {
    let mut q = [0i8; QK_K];
    let (blocks, _) = src.as_chunks::<Q4_K_BYTES>();
    let (out, _) = dst.as_chunks_mut::<QK_K>();
    for (b, y) in blocks.iter().zip(out) {
        unpack_q4_k(&b[16..], &mut q);
        apply_k4_scales(f16_at(&b[0..2]), f16_at(&b[2..4]), &b[4..16], &q, y);
    }
}

pub(super) fn dequantize_q5_k(src: &[u8], dst: &mut [f32]) {
    let mut q = [0i8; QK_K];
    let (blocks, _) = src.as_chunks::<Q5_K_BYTES>();
    let (out, _) = dst.as_chunks_mut::<QK_K>();
    for (b, y) in blocks.iter().zip(out) {
        unpack_q5_k(&b[16..48], &b[48..], &mut q);
        apply_k4_scales(f16_at(&b[0..2]), f16_at(&b[2..4]), &b[4..16], &q, y);
    }
}

pub(super) fn dequantize_q6_k(src: &[u8], dst: &mut [f32]) {
    let mut q = [0i8; QK_K];
    let (blocks, _) = src.as_chunks::<Q6_K_BYTES>();
    let (out, _) = dst.as_chunks_mut::<QK_K>();
    for (b, y) in blocks.iter().zip(out) {
        unpack_q6_k(&b[0..128], &b[128..192], &mut q);
        let d = f16_at(&b[208..210]);
        for ((y, q), &sc) in y.chunks_exact_mut(16).zip(q.chunks_exact(16)).zip(&b[192..208]) {
            let dl = d * (sc as i8) as f32;
            for (y, &q) in y.iter_mut().zip(q) {
                *y = dl * q as f32;
            }
        }
    }
}

pub(super) fn dequantize_q8_k(src: &[u8], dst: &mut [f32]) {
    let (blocks, _) = src.as_chunks::<Q8_K_BYTES>();
    let (out, _) = dst.as_chunks_mut::<QK_K>();
    for (b, y) in blocks.iter().zip(out) {
        let (d, qs, _) = q8_k_parts(b);
        for (y, &q) in y.iter_mut().zip(qs) {
            *y = (q as i8) as f32 * d;
        }
    }
}

// ---------------------------------------------------------------------------------------------------------------
// Quantization of activations (llama.cpp's quantize_row_q8_K_ref)
// ---------------------------------------------------------------------------------------------------------------

pub(super) fn quantize_q8_k(x: &[f32], dst: &mut [u8]) {
    let (blocks, _) = dst.as_chunks_mut::<Q8_K_BYTES>();
    let (xs, _) = x.as_chunks::<QK_K>();
    for (b, x) in blocks.iter_mut().zip(xs) {
        let (d_bytes, rest) = b.split_at_mut(4);
        let (qs, bsums) = rest.split_at_mut(QK_K);
        let max = signed_abs_max(x);
        if max == 0.0 {
            d_bytes.fill(0);
            qs.fill(0);
            bsums.fill(0);
            continue;
        }
        // -127/max rather than -128/max, as llama.cpp does (for IQ2_XXS's SIMD code).
        let iscale = -127.0 / max;
        for (q, &v) in qs.iter_mut().zip(x) {
            *q = nearest_int(iscale * v).min(127) as i8 as u8;
        }
        for (s, group) in bsums.chunks_exact_mut(2).zip(qs.chunks_exact(16)) {
            let sum: i32 = group.iter().map(|&q| (q as i8) as i32).sum();
            s.copy_from_slice(&(sum as i16).to_le_bytes());
        }
        d_bytes.copy_from_slice(&(1.0 / iscale).to_le_bytes());
    }
}

// ---------------------------------------------------------------------------------------------------------------
// Dot products with Q8_K activations; `nb` is the number of super-blocks
// ---------------------------------------------------------------------------------------------------------------

/// Zip the first `nb` weight blocks with the first `nb` Q8_K blocks.
#[inline(always)]
fn block_pairs<'a, const WB: usize>(
    nb: usize,
    w: &'a [u8],
    a: &'a [u8],
) -> impl Iterator<Item = (&'a [u8; WB], &'a [u8; Q8_K_BYTES])> {
    w.as_chunks::<WB>().0.iter().zip(a.as_chunks::<Q8_K_BYTES>().0).take(nb)
}

/// Sum over sub-blocks of `GROUP` elements of `scale[g] * dot(q[g], q8[g])`, exact in i32.
#[inline(always)]
fn scaled_dot<D: IntDot, const GROUP: usize>(q: &Codes, q8: &[u8], scales: impl IntoIterator<Item = i32>) -> i32 {
    q.chunks_exact(GROUP)
        .zip(q8.chunks_exact(GROUP))
        .zip(scales)
        .map(|((q, y), s)| s * D::dot(q, y))
        .sum()
}

pub(super) fn vec_dot_q2_k_q8_k(nb: usize, w: &[u8], a: &[u8]) -> f32 {
    vec_dot_q2_k_with::<ScalarDot>(nb, w, a)
}

/// [`vec_dot_q2_k_q8_k`] with the int8 products of `D`.
pub(crate) fn vec_dot_q2_k_with<D: IntDot>(nb: usize, w: &[u8], a: &[u8]) -> f32 {
    let mut q = [0i8; QK_K];
    let mut sumf = 0.0f32;
    for (x, y) in block_pairs::<Q2_K_BYTES>(nb, w, a) {
        let (yd, q8, bsums) = q8_k_parts(y);
        let bsums = q8_k_bsums(bsums);
        let scales = &x[0..16];
        unpack_q2_k(&x[16..80], &mut q);

        // The mins: sum over sub-blocks of min * sum(q8), from the precomputed bsums.
        let summs: i32 = bsums.iter().zip(scales).map(|(&s, &sc)| s * (sc >> 4) as i32).sum();
        let isum = scaled_dot::<D, 16>(&q, q8, scales.iter().map(|&sc| (sc & 0x0F) as i32));

        let dall = yd * f16_at(&x[80..82]);
        let dmin = yd * f16_at(&x[82..84]);
        sumf += dall * isum as f32 - dmin * summs as f32;
    }
    sumf
}

pub(super) fn vec_dot_q3_k_q8_k(nb: usize, w: &[u8], a: &[u8]) -> f32 {
    vec_dot_q3_k_with::<ScalarDot>(nb, w, a)
}

/// [`vec_dot_q3_k_q8_k`] with the int8 products of `D`.
pub(crate) fn vec_dot_q3_k_with<D: IntDot>(nb: usize, w: &[u8], a: &[u8]) -> f32 {
    let mut q = [0i8; QK_K];
    let mut sumf = 0.0f32;
    for (x, y) in block_pairs::<Q3_K_BYTES>(nb, w, a) {
        let (yd, q8, _) = q8_k_parts(y);
        unpack_q3_k(&x[0..32], &x[32..96], &mut q);
        let isum = scaled_dot::<D, 16>(&q, q8, q3_k_scales(&x[96..108]));
        sumf += (f16_at(&x[108..110]) * yd) * isum as f32;
    }
    sumf
}

/// Q4_K and Q5_K after unpacking: 8 sub-blocks of 32 with 6-bit scales and mins.
#[inline(always)]
fn dot_k4_block<D: IntDot>(x_d: f32, x_dmin: f32, scales: &[u8], q: &Codes, y: &[u8; Q8_K_BYTES]) -> f32 {
    let (yd, q8, bsums) = q8_k_parts(y);
    let bsums = q8_k_bsums(bsums);
    let (sc, mn) = k4_scales_mins(scales);
    // Each min covers two 16-element bsums.
    let summs: i32 = bsums.iter().enumerate().map(|(j, &s)| s * mn[j / 2] as i32).sum();
    let isum = scaled_dot::<D, 32>(q, q8, sc.map(i32::from));
    (x_d * yd) * isum as f32 - (x_dmin * yd) * summs as f32
}

pub(super) fn vec_dot_q4_k_q8_k(nb: usize, w: &[u8], a: &[u8]) -> f32 {
    vec_dot_q4_k_with::<ScalarDot>(nb, w, a)
}

/// [`vec_dot_q4_k_q8_k`] with the int8 products of `D`.
pub(crate) fn vec_dot_q4_k_with<D: IntDot>(nb: usize, w: &[u8], a: &[u8]) -> f32 {
    let mut q = [0i8; QK_K];
    let mut sumf = 0.0f32;
    for (x, y) in block_pairs::<Q4_K_BYTES>(nb, w, a) {
        unpack_q4_k(&x[16..], &mut q);
        sumf += dot_k4_block::<D>(f16_at(&x[0..2]), f16_at(&x[2..4]), &x[4..16], &q, y);
    }
    sumf
}

pub(super) fn vec_dot_q5_k_q8_k(nb: usize, w: &[u8], a: &[u8]) -> f32 {
    vec_dot_q5_k_with::<ScalarDot>(nb, w, a)
}

/// [`vec_dot_q5_k_q8_k`] with the int8 products of `D`.
pub(crate) fn vec_dot_q5_k_with<D: IntDot>(nb: usize, w: &[u8], a: &[u8]) -> f32 {
    let mut q = [0i8; QK_K];
    let mut sumf = 0.0f32;
    for (x, y) in block_pairs::<Q5_K_BYTES>(nb, w, a) {
        unpack_q5_k(&x[16..48], &x[48..], &mut q);
        sumf += dot_k4_block::<D>(f16_at(&x[0..2]), f16_at(&x[2..4]), &x[4..16], &q, y);
    }
    sumf
}

pub(super) fn vec_dot_q6_k_q8_k(nb: usize, w: &[u8], a: &[u8]) -> f32 {
    vec_dot_q6_k_with::<ScalarDot>(nb, w, a)
}

/// [`vec_dot_q6_k_q8_k`] with the int8 products of `D`.
pub(crate) fn vec_dot_q6_k_with<D: IntDot>(nb: usize, w: &[u8], a: &[u8]) -> f32 {
    let mut q = [0i8; QK_K];
    let mut sumf = 0.0f32;
    for (x, y) in block_pairs::<Q6_K_BYTES>(nb, w, a) {
        let (yd, q8, _) = q8_k_parts(y);
        unpack_q6_k(&x[0..128], &x[128..192], &mut q);
        let isum = scaled_dot::<D, 16>(&q, q8, x[192..208].iter().map(|&s| (s as i8) as i32));
        sumf += (f16_at(&x[208..210]) * yd) * isum as f32;
    }
    sumf
}

pub(super) fn vec_dot_q8_k_q8_k(nb: usize, w: &[u8], a: &[u8]) -> f32 {
    let mut sumf = 0.0f32;
    for (x, y) in w
        .as_chunks::<Q8_K_BYTES>()
        .0
        .iter()
        .zip(a.as_chunks::<Q8_K_BYTES>().0)
        .take(nb)
    {
        let (xd, xq, _) = q8_k_parts(x);
        let (yd, yq, _) = q8_k_parts(y);
        let sumi: i32 = xq
            .iter()
            .zip(yq)
            .map(|(&p, &q)| (p as i8) as i32 * (q as i8) as i32)
            .sum();
        sumf += (xd * yd) * sumi as f32;
    }
    sumf
}
