//! Prefill tiles with the weight rows in vector lanes: the shared driver of [`super::q4k_gemm`] and
//! [`super::q6k_tiled`].
//!
//! llama.cpp's AVX-512 build gets its prefill speed from weights repacked at load (rows interleaved), so that one
//! 512-bit `vpdpbusd` multiplies 4 codes of each of 16 rows by the same 4 activation quants (broadcast) with no
//! horizontal sums. ninfer keeps the GGUF layout in memory; instead each tile call transposes its weight rows, 16
//! at a time, into a per-super-block [`LaneKernel::Packed`] (4 codes of each row per 32-bit lane, the scales per
//! lane) and then runs every group of up to 4 activation rows over them, so that the transposition is shared by
//! all the call's activation rows (matmul hands these kernels [`SHAPE`] tiles).

use std::arch::x86_64::*;

/// Weight rows per pass: the lanes of a 512-bit vector of i32.
pub(super) const LANES: usize = 16;
/// Activation rows per pass: their accumulators and partial sums fill the vector registers.
pub(super) const TOKENS: usize = 4;
/// The tile shape (weight rows, activation rows) matmul hands these kernels per call: 64 activation rows share
/// each transposition.
pub(super) const SHAPE: (usize, usize) = (LANES, 64);

/// A kernel over transposed weight rows.
pub(super) trait LaneKernel {
    /// One super-block of [`LANES`] weight rows, transposed.
    type Packed: Copy;
    const ZERO: Self::Packed;
    /// Transposes super-block `sb` of `nr` (1..=16) weight rows (`ws` bytes apart from `x`) into `p`; lanes past
    /// `nr` get products that are never read.
    ///
    /// # Safety
    /// The CPU has AVX-512 F/BW/DQ/VL/VNNI; rows `0 .. nr` hold super-block `sb`.
    unsafe fn pack(x: *const u8, ws: usize, nr: usize, sb: usize, p: &mut Self::Packed);
    /// The products of the packed rows `p` (`nb` super-blocks) with `T` activation rows (`ys` bytes apart from
    /// `y`): `out[t]` holds activation row `t`'s products, one per lane (weight row).
    ///
    /// # Safety
    /// The CPU has AVX-512 F/BW/DQ/VL/VNNI; the `T` activation rows hold `nb` Q8_K blocks; `p.len() >= nb`.
    unsafe fn products<const T: usize>(nb: usize, p: &[Self::Packed], y: *const u8, ys: usize) -> [[f32; LANES]; T];
}

/// `K`'s products over a whole tile: `nr` weight rows (16 at a time) by `nc` activation rows (4 at a time) into
/// `out[r * nc + c]`, with `packed` as scratch space.
///
/// # Safety
/// The CPU has AVX-512 F/BW/DQ/VL/VNNI; the tile lies within its weights and activations (`nb` blocks per row)
/// and `out` holds `nr * nc` floats.
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn tile<K: LaneKernel>(
    nb: usize,
    x: *const u8,
    ws: usize,
    nr: usize,
    y: *const u8,
    ys: usize,
    nc: usize,
    out: &mut [f32],
    packed: &mut Vec<K::Packed>,
) {
    packed.resize(nb, K::ZERO);
    for r0 in (0..nr).step_by(LANES) {
        let rows = (nr - r0).min(LANES);
        let xr = x.add(r0 * ws);
        for (sb, p) in packed.iter_mut().enumerate() {
            K::pack(xr, ws, rows, sb, p);
        }
        for c0 in (0..nc).step_by(TOKENS) {
            let yc = y.add(c0 * ys);
            let mut put = |c: usize, v: &[f32; LANES]| {
                for (r, &v) in v.iter().enumerate().take(rows) {
                    out[(r0 + r) * nc + c0 + c] = v;
                }
            };
            match nc - c0 {
                1 => K::products::<1>(nb, packed, yc, ys).iter().enumerate().for_each(|(c, v)| put(c, v)),
                2 => K::products::<2>(nb, packed, yc, ys).iter().enumerate().for_each(|(c, v)| put(c, v)),
                3 => K::products::<3>(nb, packed, yc, ys).iter().enumerate().for_each(|(c, v)| put(c, v)),
                _ => K::products::<4>(nb, packed, yc, ys).iter().enumerate().for_each(|(c, v)| put(c, v)),
            }
        }
    }
}

/// Byte offsets of up to 16 rows `stride` bytes apart, for [`RowOffsets::gather`].
#[derive(Clone, Copy)]
pub(super) struct RowOffsets {
    idx: [__m512i; 2],
    mask: [u8; 2],
}

impl RowOffsets {
    /// Rows `0 .. nr` (1..=16) of `stride` bytes.
    ///
    /// # Safety
    /// The CPU has AVX-512 F/DQ.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma,f16c")]
    pub(super) unsafe fn new(stride: usize, nr: usize) -> RowOffsets {
        // i64 offsets: a row stride times 15 need not fit an i32.
        let lanes = _mm512_set_epi64(7, 6, 5, 4, 3, 2, 1, 0);
        let s = _mm512_set1_epi64(stride as i64);
        let idx = [_mm512_mullo_epi64(lanes, s), _mm512_mullo_epi64(_mm512_add_epi64(lanes, _mm512_set1_epi64(8)), s)];
        let mask = [((1u32 << nr.min(8)) - 1) as u8, (((1u32 << nr.max(8)) - 1) >> 8) as u8];
        RowOffsets { idx, mask }
    }

    /// The dwords at `base + lane * stride` of the rows, as one vector (0 in the lanes past them).
    ///
    /// # Safety
    /// The CPU has AVX-512 F/DQ; the dwords are readable.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma,f16c")]
    pub(super) unsafe fn gather(&self, base: *const u8) -> __m512i {
        let base = base as *const i32;
        let lo = _mm512_mask_i64gather_epi32::<1>(_mm256_setzero_si256(), self.mask[0], self.idx[0], base);
        let hi = _mm512_mask_i64gather_epi32::<1>(_mm256_setzero_si256(), self.mask[1], self.idx[1], base);
        _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi)
    }
}
