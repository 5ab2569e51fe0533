//! Prefill tiles of the symmetric 32-element formats (Q4_0, Q5_0, Q8_0 times Q8_0 activations) with two weight
//! rows in the halves of each 512-bit vector.
//!
//! llama.cpp sums each of these dot products as `ggml_vec_dot_q*_0_q8_0` does (arch/x86/quants.c, no AVX-512
//! branch): per block, the 32 int8 products summed four at a time into eight i32 lanes, converted to f32 and
//! added by one `fmadd(d_x * d_y, lanes, acc)` into eight f32 lanes; `hsum_float_8` at the end. Here the eight
//! lanes of row r sit in the low half of a 512-bit accumulator and those of row r + 1 in its high half, so every
//! lane runs exactly the chain of the AVX2 kernel and the sums keep their bits, at half the instructions per
//! product. The lane integers come from one `vpdpbusd` on the unsigned codes (code + offset) started from
//! -offset x (the four activation quants' sum): the same exact integers as the AVX2 kernels' sign trick, without
//! a sign per product.

use std::arch::x86_64::*;

use super::super::x86_avx2::prims::{f16_at, hsum_float_8};
use crate::quant::format::{Q4_0_BYTES, Q5_0_BYTES, Q8_0_BYTES};

/// A symmetric 32-element block format: its codes plus `OFFSET` as unsigned bytes.
pub(super) trait PairBlock {
    /// Bytes per block.
    const WB: usize;
    /// What makes the signed codes unsigned.
    const OFFSET: u8;
    /// Two blocks' 32 unsigned codes each, in the element order of the Q8_0 activation quants: block `a`'s in
    /// the low 256 bits, `b`'s in the high.
    unsafe fn ucodes(a: *const u8, b: *const u8) -> __m512i;
}

pub(super) struct Q4_0;
pub(super) struct Q5_0;
pub(super) struct Q8_0;

/// The 16 bytes at `a` and at `b` as 32 nibbles each (`bytes_from_nibbles_32`: low nibbles in bytes 0..16, high
/// in 16..32), `a`'s in the low 256 bits.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")]
unsafe fn nibbles(a: *const u8, b: *const u8) -> __m512i {
    let ab = _mm256_inserti128_si256::<1>(_mm256_castsi128_si256(_mm_loadu_si128(a as *const __m128i)),
                                          _mm_loadu_si128(b as *const __m128i));
    let w = _mm512_castsi256_si512(ab);
    // 128-bit lanes a, a, b, b; the second of each pair shifted down a nibble
    let twice = _mm512_shuffle_i64x2::<0b01_01_00_00>(w, w);
    let shifted = _mm512_srlv_epi64(twice, _mm512_set_epi64(4, 4, 0, 0, 4, 4, 0, 0));
    _mm512_and_si512(shifted, _mm512_set1_epi8(0x0F))
}

impl PairBlock for Q4_0 {
    const WB: usize = Q4_0_BYTES;
    const OFFSET: u8 = 8;
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")]
    unsafe fn ucodes(a: *const u8, b: *const u8) -> __m512i {
        nibbles(a.add(2), b.add(2))
    }
}

impl PairBlock for Q5_0 {
    const WB: usize = Q5_0_BYTES;
    const OFFSET: u8 = 16;
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")]
    unsafe fn ucodes(a: *const u8, b: *const u8) -> __m512i {
        // The fifth bit of element j is bit j of the little-endian u32 after the scale.
        let high = |p: *const u8| u64::from((p.add(2) as *const u32).read_unaligned());
        _mm512_or_si512(nibbles(a.add(6), b.add(6)), _mm512_maskz_set1_epi8(high(a) | high(b) << 32, 0x10))
    }
}

impl PairBlock for Q8_0 {
    const WB: usize = Q8_0_BYTES;
    const OFFSET: u8 = 128;
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")]
    unsafe fn ucodes(a: *const u8, b: *const u8) -> __m512i {
        let load = |p: *const u8| _mm256_loadu_si256(p.add(2) as *const __m256i);
        let ab = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(load(a)), load(b));
        _mm512_xor_si512(ab, _mm512_set1_epi8(-128))
    }
}

/// The little-endian IEEE halves at `a` and `b`, as f32 (exact): `a`'s in the low eight lanes, `b`'s in the high.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")]
unsafe fn halves(a: *const u8, b: *const u8) -> __m512 {
    let h = |p: *const u8| i32::from((p as *const u16).read_unaligned());
    let two = _mm_cvtph_ps(_mm_cvtsi32_si128(h(a) | h(b) << 16));
    _mm512_permutexvar_ps(_mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0), _mm512_castps128_ps512(two))
}

/// Bytes ahead of the current block that each weight row is prefetched (into L2), as the AVX2 tiles do.
const PREFETCH_AHEAD: usize = 256;

/// `2 * P` weight rows (`x`, `xs` bytes apart; row 2p + 1 may repeat row 2p, see [`tile`]) times `C` activation
/// rows (`y`, `ys` apart) over `nb` blocks: `out[p][half][c]` is row 2p + half's product with activation row c.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")]
unsafe fn pair_tile<F: PairBlock, const P: usize, const C: usize>(
    nb: usize,
    rows: [[*const u8; 2]; P],
    y: *const u8,
    ys: usize,
) -> [[[f32; C]; 2]; P] {
    let mut acc = [[_mm512_setzero_ps(); C]; P];
    let offset = _mm512_set1_epi8(F::OFFSET as i8);
    for i in 0..nb {
        let mut codes = [_mm512_setzero_si512(); P];
        let mut dx = [_mm512_setzero_ps(); P];
        for p in 0..P {
            let (a, b) = (rows[p][0].add(i * F::WB), rows[p][1].add(i * F::WB));
            // A hint: prefetching past the end of the row (or the mapping) never faults.
            _mm_prefetch::<_MM_HINT_T1>(a.wrapping_add(PREFETCH_AHEAD) as *const i8);
            _mm_prefetch::<_MM_HINT_T1>(b.wrapping_add(PREFETCH_AHEAD) as *const i8);
            codes[p] = F::ucodes(a, b);
            dx[p] = halves(a, b);
        }
        for c in 0..C {
            let yb = y.add(c * ys + i * Q8_0_BYTES);
            let qy = _mm512_broadcast_i64x4(_mm256_loadu_si256(yb.add(2) as *const __m256i));
            // -OFFSET x each lane's four quants: where the unsigned codes' products start from.
            let base = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_dpbusd_epi32(_mm512_setzero_si512(), offset, qy));
            let dy = _mm512_set1_ps(f16_at(yb));
            for p in 0..P {
                let lanes = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(base, codes[p], qy));
                acc[p][c] = _mm512_fmadd_ps(_mm512_mul_ps(dx[p], dy), lanes, acc[p][c]);
            }
        }
    }
    let mut out = [[[0.0f32; C]; 2]; P];
    for p in 0..P {
        for c in 0..C {
            out[p][0][c] = hsum_float_8(_mm512_castps512_ps256(acc[p][c]));
            out[p][1][c] = hsum_float_8(_mm512_extractf32x8_ps::<1>(acc[p][c]));
        }
    }
    out
}

/// Activation rows per pass of [`tile`]: the accumulators (rows / 2 x this), the rows' codes and scales and one
/// activation row's vectors fit the 32 vector registers.
pub(super) const COLS: usize = 8;
/// Weight rows per pass of [`tile`].
pub(super) const ROWS: usize = 4;

/// The `nr x nc` products of weight rows `x` (`xs` bytes apart) and activation rows `y` (`ys` apart), `nb`
/// blocks each, into `out[r * nc + c]`: rows in fours (then a pair, then a last row paired with itself),
/// activation rows in eights, fours, pairs and ones.
///
/// # Safety
/// The CPU has the features of `x86_avx512::available`; `nr` weight rows and `nc` activation rows of `nb`
/// blocks lie in bounds; `out` holds `nr * nc` values.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")]
pub(super) unsafe fn tile<F: PairBlock>(nb: usize, x: *const u8, xs: usize, nr: usize, y: *const u8, ys: usize,
                                         nc: usize, out: &mut [f32]) {
    let mut r0 = 0;
    while r0 < nr {
        let left = nr - r0;
        let row = |r: usize| x.add((r0 + r.min(left - 1)) * xs);
        let mut c0 = 0;
        while c0 < nc {
            let k = [8, 4, 2, 1].into_iter().find(|&k| k <= nc - c0).unwrap_or(1);
            let yc = y.add(c0 * ys);
            let mut put = |r: usize, vals: &[f32]| {
                if r < left {
                    out[(r0 + r) * nc + c0..][..vals.len()].copy_from_slice(vals);
                }
            };
            macro_rules! run {
                ($p:literal, $c:literal) => {{
                    let rows: [[*const u8; 2]; $p] = std::array::from_fn(|p| [row(2 * p), row(2 * p + 1)]);
                    let t = pair_tile::<F, $p, $c>(nb, rows, yc, ys);
                    for p in 0..$p {
                        put(2 * p, &t[p][0]);
                        put(2 * p + 1, &t[p][1]);
                    }
                }};
            }
            match (left >= ROWS, k) {
                (true, 8) => run!(2, 8),
                (true, 4) => run!(2, 4),
                (true, 2) => run!(2, 2),
                (true, _) => run!(2, 1),
                (false, 8) => run!(1, 8),
                (false, 4) => run!(1, 4),
                (false, 2) => run!(1, 2),
                (false, _) => run!(1, 1),
            }
            c0 += k;
        }
        r0 += if left >= ROWS { ROWS } else { 2 };
    }
}
