//! AVX2 kernels of the 32-element block formats: dot products with Q8_0 / Q8_1 activations, after llama.cpp's
//! `ggml_vec_dot_q{4_0,4_1,5_0,5_1,8_0}_q8_*` (arch/x86/quants.c), and the Q8_0 / Q8_1 activation quantizers
//! (byte-exact with the scalar `legacy::quantize_q8_*`, which follow llama.cpp's AVX2 `quantize_row_q8_*`).
//!
//! Per block, the 32 integer products are summed four at a time into eight i32 lanes, converted to f32 and
//! accumulated with one `fmadd` by the block's combined scale; a final `hsum_float_8`. For the formats with a
//! min (Q4_1, Q5_1), `m * s` is accumulated in a scalar FMA chain and added at the end.

use std::arch::x86_64::*;

use super::prims::{
    abs_max_lanes, bytes_from_bits_32, bytes_from_nibbles_32, f16_at, hmax_ps, hsum_float_8, hsum_i32_8, load256,
    mul_sum_us8_pairs_float, nearest_int, pack_low_bytes, prefetch_ahead, put_f16, sum_i8_groups8,
};
use crate::quant::format::{BlockFormat, Q4_0_BYTES, Q8_0_BYTES, Q8_1_BYTES, QK_LEGACY as QK};

// ---------------------------------------------------------------------------------------------------------------
// Dot products; `nb` blocks, `x` the weight row, `y` the activation row (both in bounds for `nb` blocks)
// ---------------------------------------------------------------------------------------------------------------

pub(super) use crate::quant::format::{Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q8_1};

/// A 32-element block format, as these AVX2 kernels unpack it.
pub(super) trait Block32: BlockFormat {
    /// The block's 32 codes as bytes, in the element order of the activation quants.
    unsafe fn codes(xb: *const u8) -> __m256i;
}

impl Block32 for Q4_0 {
    #[inline(always)]
    unsafe fn codes(xb: *const u8) -> __m256i {
        // Nibbles 0..=15, offset to -8..=7.
        _mm256_sub_epi8(bytes_from_nibbles_32(xb.add(2)), _mm256_set1_epi8(8))
    }
}

impl Block32 for Q4_1 {
    #[inline(always)]
    unsafe fn codes(xb: *const u8) -> __m256i {
        bytes_from_nibbles_32(xb.add(4))
    }
}

impl Block32 for Q5_0 {
    #[inline(always)]
    unsafe fn codes(xb: *const u8) -> __m256i {
        // nibble | (fifth bit clear ? 0xF0 : 0): the code minus 16 as a signed byte.
        let bxhi = _mm256_andnot_si256(bytes_from_bits_32(xb.add(2)), _mm256_set1_epi8(0xF0u8 as i8));
        _mm256_or_si256(bytes_from_nibbles_32(xb.add(6)), bxhi)
    }
}

impl Block32 for Q5_1 {
    #[inline(always)]
    unsafe fn codes(xb: *const u8) -> __m256i {
        let bxhi = _mm256_and_si256(bytes_from_bits_32(xb.add(4)), _mm256_set1_epi8(0x10));
        _mm256_or_si256(bytes_from_nibbles_32(xb.add(8)), bxhi)
    }
}

/// Int8 x int8 blocks (llama.cpp's `ggml_vec_dot_q8_0_q8_0`; Q8_1 x Q8_1 has no llama.cpp kernel and sums the
/// same way).
impl Block32 for Q8_0 {
    #[inline(always)]
    unsafe fn codes(xb: *const u8) -> __m256i {
        load256(xb.add(2))
    }
}

impl Block32 for Q8_1 {
    #[inline(always)]
    unsafe fn codes(xb: *const u8) -> __m256i {
        load256(xb.add(4))
    }
}

/// Bytes ahead of the current block that a multi-row tile prefetches (into L2) for each of its rows. Measured on
/// decode-sized matrices streaming from DRAM (2-core dev VM): without it, tiles of several rows read memory
/// slower than one row at a time (the hardware prefetcher follows one sequential stream better than several
/// interleaved ones); with it, 2-row tiles beat single rows by 10-40%.
const PREFETCH_AHEAD: usize = 256;

/// Defines `$tile` (an R x C tile) and `$single` (one product) for the CPU features `$features`, with
/// `$product` the unsigned-by-signed int8 product summed four per i32 lane. The AVX2 and AVX-512 VNNI variants
/// differ only there, and give the same integers (so the same bits: llama.cpp's VNNI build swaps the same step).
macro_rules! legacy_dot_kernels {
    ($tile:ident, $single:ident, $features:literal, $product:ident) => {
/// `R` weight rows (`x`, `xs` bytes apart) times `C` activation rows (`y`, `ys` bytes apart) over `nb` blocks:
/// `out[r][c]`. Every one of the R x C dot products is summed exactly like llama.cpp's single dot kernel
/// `ggml_vec_dot_*_q8_*` (per block: `fmadd(d_x * d_y, int8 products summed four per lane, acc)`, the min
/// term `m * s` in a scalar FMA chain, `hsum_float_8` at the end), so a tile gives the same bits as R x C
/// separate calls; it only shares the loads and unpacking of each block and overlaps the FMA chains.
        #[inline]
        #[target_feature(enable = $features)]
        pub(super) unsafe fn $tile<F: Block32, const R: usize, const C: usize>(
    nb: usize,
    x: *const u8,
    xs: usize,
    y: *const u8,
    ys: usize,
) -> [[f32; C]; R] {
    let mut acc = [[_mm256_setzero_ps(); C]; R];
    let mut summ = [[0.0f32; C]; R];
    for i in 0..nb {
        let mut dy = [0.0f32; C];
        let mut sy = [0.0f32; C];
        let mut qy = [_mm256_setzero_si256(); C];
        for c in 0..C {
            let yb = y.add(c * ys + i * F::AB);
            dy[c] = f16_at(yb);
            if F::MIN {
                sy[c] = f16_at(yb.add(2));
            }
            qy[c] = load256(yb.add(F::A_QS));
        }
        for r in 0..R {
            let xb = x.add(r * xs + i * F::WB);
            // A hint: prefetching past the end of the row (or the mapping) never faults.
            if R > 1 {
                _mm_prefetch::<_MM_HINT_T1>(xb.wrapping_add(PREFETCH_AHEAD) as *const i8);
            } else if C == 1 {
                prefetch_ahead::<1>(xb);
            }
            let dx = f16_at(xb);
            let qx = F::codes(xb);
            let ax = if F::SIGNED { _mm256_sign_epi8(qx, qx) } else { qx };
            let mx = if F::MIN { f16_at(xb.add(2)) } else { 0.0 };
            for c in 0..C {
                if F::MIN {
                    // GCC contracts llama.cpp's `summs += m * s` into an FMA.
                    summ[r][c] = mx.mul_add(sy[c], summ[r][c]);
                }
                let sy8 = if F::SIGNED { _mm256_sign_epi8(qy[c], qx) } else { qy[c] };
                let p = $product(ax, sy8);
                acc[r][c] = _mm256_fmadd_ps(_mm256_set1_ps(dx * dy[c]), p, acc[r][c]);
            }
        }
    }
    let mut out = [[0.0f32; C]; R];
    for r in 0..R {
        for c in 0..C {
            out[r][c] = if F::MIN { hsum_float_8(acc[r][c]) + summ[r][c] } else { hsum_float_8(acc[r][c]) };
        }
    }
    out
}


        /// One dot product of `nb` blocks: a 1 x 1 tile.
        #[target_feature(enable = $features)]
        pub(super) unsafe fn $single<F: Block32>(nb: usize, x: *const u8, y: *const u8) -> f32 {
            $tile::<F, 1, 1>(nb, x, 0, y, 0)[0][0]
        }

    };
}

legacy_dot_kernels!(dot_tile, vec_dot, "avx2,fma,f16c", mul_sum_us8_pairs_float);
legacy_dot_kernels!(dot_tile_vnni, vec_dot_vnni, "avx2,fma,f16c,avx512vnni,avx512vl", mul_sum_us8_pairs_float_vnni);

/// `mul_sum_us8_pairs_float` with AVX-512 VNNI: one `vpdpbusd` instead of `vpmaddubsw` + `vpmaddwd` (exact: no
/// pair of these products reaches i16 saturation, so both give the same lane sums).
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512vnni,avx512vl")]
unsafe fn mul_sum_us8_pairs_float_vnni(ax: __m256i, sy: __m256i) -> __m256 {
    _mm256_cvtepi32_ps(_mm256_dpbusd_epi32(_mm256_setzero_si256(), ax, sy))
}

/// Q4_0 in the float order of llama.cpp's repacked kernels (`ggml_gemv_q4_0_8x8_q8_0` /
/// `ggml_gemm_q4_0_8x8_q8_0`, arch/x86/repack.cpp), which llama.cpp runs on AVX2 CPUs for Q4_0 weights with a
/// row count divisible by 8 (`CPU_REPACK` buffers, on by default): each output is one lane, and each block's
/// exact integer dot is accumulated in a sequential FMA chain, `acc += isum * (d_x * d_y)`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn vec_dot_q4_0_q8_0_repacked(nb: usize, x: *const u8, y: *const u8) -> f32 {
    // The integer dots of four blocks are reduced together (exact, any grouping), then fed to the sequential
    // FMA chain one block at a time.
    let mut acc = 0.0f32;
    let mut i = 0;
    while i + 4 <= nb {
        let p = [
            q4_0_block_lanes(x.add(i * Q4_0_BYTES), y.add(i * Q8_0_BYTES)),
            q4_0_block_lanes(x.add((i + 1) * Q4_0_BYTES), y.add((i + 1) * Q8_0_BYTES)),
            q4_0_block_lanes(x.add((i + 2) * Q4_0_BYTES), y.add((i + 2) * Q8_0_BYTES)),
            q4_0_block_lanes(x.add((i + 3) * Q4_0_BYTES), y.add((i + 3) * Q8_0_BYTES)),
        ];
        // (A loop, not `map`: closures do not inherit this function's target features.)
        let mut h = [_mm_setzero_si128(); 4];
        for (hk, v) in h.iter_mut().zip(p) {
            *hk = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256::<1>(v));
        }
        let isums = _mm_hadd_epi32(_mm_hadd_epi32(h[0], h[1]), _mm_hadd_epi32(h[2], h[3]));
        let mut isums_f = [0.0f32; 4];
        _mm_storeu_ps(isums_f.as_mut_ptr(), _mm_cvtepi32_ps(isums));
        for (j, &s) in isums_f.iter().enumerate() {
            let (xb, yb) = (x.add((i + j) * Q4_0_BYTES), y.add((i + j) * Q8_0_BYTES));
            acc = s.mul_add(f16_at(xb) * f16_at(yb), acc);
        }
        i += 4;
    }
    for i in i..nb {
        let (xb, yb) = (x.add(i * Q4_0_BYTES), y.add(i * Q8_0_BYTES));
        let isum = hsum_i32_8(q4_0_block_lanes(xb, yb));
        acc = (isum as f32).mul_add(f16_at(xb) * f16_at(yb), acc);
    }
    acc
}

/// Q4_0 x Q8_0, one block: the 32 products summed four at a time into eight i32 lanes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q4_0_block_lanes(xb: *const u8, yb: *const u8) -> __m256i {
    let qx = _mm256_sub_epi8(bytes_from_nibbles_32(xb.add(2)), _mm256_set1_epi8(8));
    let qy = load256(yb.add(2));
    let p16 = _mm256_maddubs_epi16(_mm256_sign_epi8(qx, qx), _mm256_sign_epi8(qy, qx));
    _mm256_madd_epi16(_mm256_set1_epi16(1), p16)
}

// ---------------------------------------------------------------------------------------------------------------
// Activation quantization (byte-exact with the scalar `quantize_block_q8`)
// ---------------------------------------------------------------------------------------------------------------

/// One block: `d = amax / 127`, `q = nearest_int(x * (127 / amax)) as i8` stored at `qs`. Returns `d` (f32)
/// and the quants as a vector.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn quantize_block_q8(x: *const f32, qs: *mut u8) -> (f32, __m256i) {
    let v = [
        _mm256_loadu_ps(x),
        _mm256_loadu_ps(x.add(8)),
        _mm256_loadu_ps(x.add(16)),
        _mm256_loadu_ps(x.add(24)),
    ];
    let amax = hmax_ps(abs_max_lanes(&v, _mm256_setzero_ps()));
    let d = amax / 127.0;
    let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
    let mul = _mm256_set1_ps(id);
    let q = pack_low_bytes([
        nearest_int(_mm256_mul_ps(v[0], mul)),
        nearest_int(_mm256_mul_ps(v[1], mul)),
        nearest_int(_mm256_mul_ps(v[2], mul)),
        nearest_int(_mm256_mul_ps(v[3], mul)),
    ]);
    _mm256_storeu_si256(qs as *mut __m256i, q);
    (d, q)
}

#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn quantize_q8_0(nb: usize, x: *const f32, dst: *mut u8) {
    for i in 0..nb {
        let b = dst.add(i * Q8_0_BYTES);
        let (d, _) = quantize_block_q8(x.add(i * QK), b.add(2));
        put_f16(b, d);
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn quantize_q8_1(nb: usize, x: *const f32, dst: *mut u8) {
    for i in 0..nb {
        let b = dst.add(i * Q8_1_BYTES);
        let (d, q) = quantize_block_q8(x.add(i * QK), b.add(4));
        let sum: i32 = sum_i8_groups8(q).iter().sum();
        put_f16(b, d);
        put_f16(b.add(2), sum as f32 * d);
    }
}
