//! x86-64 AVX2 + FMA + F16C kernels.
//!
//! Wheels are built for baseline x86-64, so every kernel is an `unsafe fn` with
//! `#[target_feature(enable = "avx2,fma,f16c")]`, reached only through the table [`detect`] returns after
//! checking the three features. The table holds safe wrappers (below) that clamp the block count to what the
//! slices hold and then call the kernels on raw pointers; they are private to this module, so the only way to
//! reach them is the checked table.
//!
//! Numerics: the integer parts are exact (the same `maddubs`/`madd` lane layout as llama.cpp, so even the
//! per-lane partial sums are the same), and the float parts repeat llama.cpp's AVX2 code step by step
//! (`ggml-cpu/arch/x86/quants.c`, `ggml-cpu/vec.cpp`, compiled by GCC with `-march=native`, which also fuses
//! the scalar `a += b * c` accumulations into FMAs): one `fmadd` per block into eight f32 lanes and the same
//! horizontal sums. Activation quantizers are byte-exact with the scalar ones.

use std::arch::x86_64::*;

use super::{Kernels, Orders, TileFn, VecDotFn};
use crate::gsq::format::{ActQ8, Layout};
use crate::quant::format::{BlockFormat, GgmlType, Q4_0_BYTES, Q8_0_BYTES, Q8_1_BYTES, QK_K, QK_LEGACY};
use crate::quant::format::{Q2_K_BYTES, Q3_K_BYTES, Q4_K_BYTES, Q5_K_BYTES, Q6_K_BYTES, Q8_K_BYTES};

mod float;
mod gsq;
mod kquants;
mod legacy;
mod orders;
mod vecops;

/// The AVX2 element-wise primitives, or `None` if this CPU lacks AVX2, FMA or F16C.
pub(super) fn detect_vec_ops() -> Option<&'static super::vecops::VecOps> {
    static OPS: super::vecops::VecOps = vecops::AVX2;
    (is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c"))
        .then_some(&OPS)
}

/// The AVX2 kernel table mirroring llama.cpp's matmul paths selected by `orders`, or `None` if this CPU lacks
/// AVX2, FMA or F16C. With `vnni` and a CPU with AVX-512 VNNI (and VL), the legacy formats' products use
/// `vpdpbusd` (table name "avx2+avx512vnni"); the results are the same bits.
pub(super) fn detect(orders: Orders, vnni: bool) -> Option<Kernels> {
    if !(is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c")) {
        return None;
    }
    let mut k = Kernels::SCALAR;
    k.name = "avx2";
    k.repacked_q4 = orders.repacked_q4;
    let dots: [(GgmlType, VecDotFn); 15] = [
        (GgmlType::F32, vec_dot_f32),
        (GgmlType::F16, vec_dot_f16),
        (GgmlType::BF16, vec_dot_bf16),
        (GgmlType::Q4_0, vec_dot_q4_0),
        (GgmlType::Q4_1, vec_dot_q4_1),
        (GgmlType::Q5_0, vec_dot_q5_0),
        (GgmlType::Q5_1, vec_dot_q5_1),
        (GgmlType::Q8_0, vec_dot_q8_0),
        (GgmlType::Q8_1, vec_dot_q8_1),
        (GgmlType::Q2_K, vec_dot_q2_k),
        (GgmlType::Q3_K, vec_dot_q3_k),
        (GgmlType::Q4_K, vec_dot_q4_k),
        (GgmlType::Q5_K, vec_dot_q5_k),
        (GgmlType::Q6_K, vec_dot_q6_k),
        (GgmlType::Q8_K, vec_dot_q8_k),
    ];
    for (ty, f) in dots {
        k.vec_dot[ty as usize] = Some(f);
    }
    if orders.repacked_q4 {
        // Decode (GEMV) order by default; the plain kernels for matrices llama.cpp leaves unpacked.
        for (ty, gemv, plain) in [
            (GgmlType::Q4_0, vec_dot_q4_0_repacked as VecDotFn, vec_dot_q4_0 as VecDotFn),
            (GgmlType::Q4_K, vec_dot_q4_k_repacked, vec_dot_q4_k),
        ] {
            k.vec_dot[ty as usize] = Some(gemv);
            k.vec_dot_unpacked[ty as usize] = Some(plain);
        }
        // Q4_0's GEMM sums like its GEMV (one step per 32-element block); Q4_K's does not.
        k.vec_dot_gemm4[GgmlType::Q4_K as usize] = Some(vec_dot_q4_k_repacked_gemm);
    }
    if orders.tiled {
        let tiled: [(GgmlType, VecDotFn); 5] = [
            (GgmlType::Q2_K, vec_dot_q2_k_tiled),
            (GgmlType::Q3_K, vec_dot_q3_k_tiled),
            (GgmlType::Q4_K, vec_dot_q4_k_tiled),
            (GgmlType::Q5_K, vec_dot_q5_k_tiled),
            (GgmlType::Q6_K, vec_dot_q6_k_tiled),
        ];
        for (ty, f) in tiled {
            k.vec_dot_tiled[ty as usize] = Some(f);
        }
    }
    let tiles: [(GgmlType, TileFn); 6] = [
        (GgmlType::Q4_0, tile_q4_0),
        (GgmlType::Q4_1, tile_q4_1),
        (GgmlType::Q5_0, tile_q5_0),
        (GgmlType::Q5_1, tile_q5_1),
        (GgmlType::Q8_0, tile_q8_0),
        (GgmlType::Q8_1, tile_q8_1),
    ];
    for (ty, f) in tiles {
        k.vec_dot_tile[ty as usize] = Some(f);
    }
    if orders.repacked_q4 {
        k.vec_dot_tile_gemm4[GgmlType::Q4_K as usize] = Some(tile_q4_k_gemm);
    }
    if orders.tiled {
        k.vec_dot_tile_tiled[GgmlType::Q6_K as usize] = Some(tile_q6_k_tiled);
    }
    if vnni && is_x86_feature_detected!("avx512vnni") && is_x86_feature_detected!("avx512vl") {
        use_vnni(&mut k);
    }
    k.quantize[GgmlType::Q8_0 as usize] = Some(quantize_q8_0);
    k.quantize[GgmlType::Q8_1 as usize] = Some(quantize_q8_1);
    k.quantize[GgmlType::Q8_K as usize] = Some(quantize_q8_k);
    k.quantize[GgmlType::F16 as usize] = Some(quantize_f16);
    k.dequantize[GgmlType::F16 as usize] = Some(dequantize_f16);
    k.gsq_dot = Some(gsq_dot);
    k.gsq_quantize = Some(gsq_quantize);
    Some(k)
}

/// Swap the legacy formats' plain products and tiles for their AVX-512 VNNI versions.
fn use_vnni(k: &mut Kernels) {
    k.name = "avx2+avx512vnni";
    let kernels: [(GgmlType, VecDotFn, TileFn); 6] = [
        (GgmlType::Q4_0, vec_dot_q4_0_vnni, tile_q4_0_vnni),
        (GgmlType::Q4_1, vec_dot_q4_1_vnni, tile_q4_1_vnni),
        (GgmlType::Q5_0, vec_dot_q5_0_vnni, tile_q5_0_vnni),
        (GgmlType::Q5_1, vec_dot_q5_1_vnni, tile_q5_1_vnni),
        (GgmlType::Q8_0, vec_dot_q8_0_vnni, tile_q8_0_vnni),
        (GgmlType::Q8_1, vec_dot_q8_1_vnni, tile_q8_1_vnni),
    ];
    for (ty, dot, tile) in kernels {
        let t = ty as usize;
        // A repacked Q4_0 keeps its GEMV kernel in `vec_dot` and the plain one in `vec_dot_unpacked`.
        if k.vec_dot_unpacked[t].is_some() {
            k.vec_dot_unpacked[t] = Some(dot);
        } else {
            k.vec_dot[t] = Some(dot);
        }
        k.vec_dot_tile[t] = Some(tile);
    }
}

// ---------------------------------------------------------------------------------------------------------------
// Safe wrappers (only reachable through the table above, i.e. after the feature check)
// ---------------------------------------------------------------------------------------------------------------

/// A `VecDotFn` over `nb` blocks of `$wb` weight bytes and `$ab` activation bytes, calling `$kernel`.
macro_rules! dot_wrapper {
    ($name:ident, $kernel:path, $wb:expr, $ab:expr) => {
        fn $name(nb: usize, w: &[u8], a: &[u8]) -> f32 {
            let nb = nb.min(w.len() / $wb).min(a.len() / $ab);
            // SAFETY: the table holding this wrapper exists only on CPUs with AVX2, FMA and F16C; `nb` whole
            // blocks are in bounds of both slices.
            unsafe { $kernel(nb, w.as_ptr(), a.as_ptr()) }
        }
    };
}

dot_wrapper!(vec_dot_f32, float::vec_dot_f32, 4, 4);
dot_wrapper!(vec_dot_f16, float::vec_dot_f16, 2, 2);
dot_wrapper!(vec_dot_bf16, float::vec_dot_bf16, 2, 2);

/// A `VecDotFn` for a legacy format: `$kernel` over the format's blocks.
macro_rules! legacy_dot {
    ($name:ident, $kernel:ident, $fmt:ty) => {
        dot_wrapper!($name, legacy::$kernel::<$fmt>, <$fmt as BlockFormat>::WB, <$fmt as BlockFormat>::AB);
    };
}

legacy_dot!(vec_dot_q4_0, vec_dot, legacy::Q4_0);
dot_wrapper!(vec_dot_q4_0_repacked, legacy::vec_dot_q4_0_q8_0_repacked, Q4_0_BYTES, Q8_0_BYTES);
legacy_dot!(vec_dot_q4_1, vec_dot, legacy::Q4_1);
legacy_dot!(vec_dot_q5_0, vec_dot, legacy::Q5_0);
legacy_dot!(vec_dot_q5_1, vec_dot, legacy::Q5_1);
legacy_dot!(vec_dot_q8_0, vec_dot, legacy::Q8_0);
legacy_dot!(vec_dot_q8_1, vec_dot, legacy::Q8_1);
legacy_dot!(vec_dot_q4_0_vnni, vec_dot_vnni, legacy::Q4_0);
legacy_dot!(vec_dot_q4_1_vnni, vec_dot_vnni, legacy::Q4_1);
legacy_dot!(vec_dot_q5_0_vnni, vec_dot_vnni, legacy::Q5_0);
legacy_dot!(vec_dot_q5_1_vnni, vec_dot_vnni, legacy::Q5_1);
legacy_dot!(vec_dot_q8_0_vnni, vec_dot_vnni, legacy::Q8_0);
legacy_dot!(vec_dot_q8_1_vnni, vec_dot_vnni, legacy::Q8_1);
dot_wrapper!(vec_dot_q2_k, kquants::vec_dot_q2_k_q8_k, Q2_K_BYTES, Q8_K_BYTES);
dot_wrapper!(vec_dot_q3_k, kquants::vec_dot_q3_k_q8_k, Q3_K_BYTES, Q8_K_BYTES);
dot_wrapper!(vec_dot_q4_k, kquants::vec_dot_q4_k_q8_k, Q4_K_BYTES, Q8_K_BYTES);
dot_wrapper!(vec_dot_q4_k_repacked, orders::vec_dot_q4_k_q8_k_repacked, Q4_K_BYTES, Q8_K_BYTES);
dot_wrapper!(vec_dot_q4_k_repacked_gemm, orders::vec_dot_q4_k_q8_k_repacked_gemm, Q4_K_BYTES, Q8_K_BYTES);
dot_wrapper!(vec_dot_q5_k, kquants::vec_dot_q5_k_q8_k, Q5_K_BYTES, Q8_K_BYTES);
dot_wrapper!(vec_dot_q6_k, kquants::vec_dot_q6_k_q8_k, Q6_K_BYTES, Q8_K_BYTES);
dot_wrapper!(vec_dot_q8_k, kquants::vec_dot_q8_k_q8_k, Q8_K_BYTES, Q8_K_BYTES);
dot_wrapper!(vec_dot_q2_k_tiled, orders::vec_dot_q2_k_q8_k_tiled, Q2_K_BYTES, Q8_K_BYTES);
dot_wrapper!(vec_dot_q3_k_tiled, orders::vec_dot_q3_k_q8_k_tiled, Q3_K_BYTES, Q8_K_BYTES);
dot_wrapper!(vec_dot_q4_k_tiled, orders::vec_dot_q4_k_q8_k_tiled, Q4_K_BYTES, Q8_K_BYTES);
dot_wrapper!(vec_dot_q5_k_tiled, orders::vec_dot_q5_k_q8_k_tiled, Q5_K_BYTES, Q8_K_BYTES);
dot_wrapper!(vec_dot_q6_k_tiled, orders::vec_dot_q6_k_q8_k_tiled, Q6_K_BYTES, Q8_K_BYTES);

fn gsq_dot(layout: Layout, w: &[u8], stride: usize, x: &ActQ8, out: &mut [f32]) {
    use crate::gsq::format::{GROUP, SUB};
    let rows = out.len();
    if rows == 0 {
        return;
    }
    let nr = (stride.min(w.len()) / layout.record_bytes()).min(x.blocks());
    assert!(w.len() >= (rows - 1) * stride + nr * layout.record_bytes(), "GSQ-RCO rows out of bounds");
    assert!(x.q.len() >= nr * GROUP && x.qx.len() >= nr * GROUP && x.bsums.len() >= nr * GROUP / SUB);
    // SAFETY: the table holding this wrapper exists only on CPUs with AVX2, FMA and F16C; `rows` rows of `nr`
    // whole records, their activations and the outputs are in bounds (checked above).
    unsafe { gsq::dot_rows(layout, nr, rows, w.as_ptr(), stride, x, out.as_mut_ptr()) }
}

fn gsq_quantize(x: &[f32], a: &mut ActQ8) {
    // SAFETY: the table holding this wrapper exists only on CPUs with AVX2, FMA and F16C.
    unsafe { gsq::quantize(x, a) }
}

/// Whether a tile of `nr` weight rows (`ws` bytes apart) and `nc` activation rows (`as_` apart) of `nb` blocks
/// lies within its slices.
#[allow(clippy::too_many_arguments)]
fn tile_fits(nb: usize, wl: usize, ws: usize, nr: usize, wb: usize, al: usize, as_: usize, nc: usize, ab: usize) -> bool {
    let fits = |len: usize, stride: usize, rows: usize, bb: usize| {
        rows >= 1 && stride >= nb * bb && len >= (rows - 1) * stride + nb * bb
    };
    fits(wl, ws, nr, wb) && fits(al, as_, nc, ab)
}

/// A `TileFn` over `$wb`-byte weight blocks and `$ab`-byte activation blocks: checks the tile's extent (NaNs if
/// it does not fit), runs the tile kernel instanced for its shape, or else row by row, or else `$single` once
/// per product.
macro_rules! tile_wrapper {
    ($name:ident, $single:path, $wb:expr, $ab:expr, [$(($r:literal, $c:literal) => $kernel:path),* $(,)?]) => {
        #[allow(clippy::too_many_arguments)]
        fn $name(nb: usize, w: &[u8], ws: usize, nr: usize, a: &[u8], as_: usize, nc: usize, out: &mut [f32]) {
            if !tile_fits(nb, w.len(), ws, nr, $wb, a.len(), as_, nc, $ab) || out.len() < nr * nc {
                out.iter_mut().take(nr * nc).for_each(|o| *o = f32::NAN);
                return;
            }
            let (x, y) = (w.as_ptr(), a.as_ptr());
            // SAFETY: reachable only through the checked table; every row of both tiles holds `nb` blocks.
            unsafe {
                match (nr, nc) {
                    $(($r, $c) => {
                        let t = $kernel(nb, x, ws, y, as_);
                        for r in 0..$r {
                            out[r * $c..(r + 1) * $c].copy_from_slice(&t[r]);
                        }
                    })*
                    // A shape without an instance of its own: columns in groups of 4, then row by row, then
                    // one product at a time.
                    _ if nc > 4 && nr <= 4 => {
                        for c0 in (0..nc).step_by(4) {
                            let k = (nc - c0).min(4);
                            let mut tmp = [0.0f32; 16];
                            $name(nb, w, ws, nr, &a[c0 * as_..], as_, k, &mut tmp[..nr * k]);
                            for r in 0..nr {
                                out[r * nc + c0..r * nc + c0 + k].copy_from_slice(&tmp[r * k..(r + 1) * k]);
                            }
                        }
                    }
                    _ if nr > 1 => {
                        for r in 0..nr {
                            $name(nb, &w[r * ws..], ws, 1, a, as_, nc, &mut out[r * nc..(r + 1) * nc]);
                        }
                    }
                    _ => {
                        for c in 0..nc {
                            out[c] = $single(nb, x, y.add(c * as_));
                        }
                    }
                }
            }
        }
    };
}

/// The legacy formats' tiles: 4 activation rows (and 2 x 4) for prefill; 2 weight rows for decode where that
/// measured faster than single rows streaming from DRAM (`cpu::matmul`). Measured on the 2-core Zen 3 dev VM,
/// best of 5, one thread: Q4_1 (576 columns) 6.8 vs 5.8 GB/s, Q5_0 (896) 5.4 vs 5.1 GB/s, but Q8_0 (896 columns,
/// Qwen2.5-0.5B's 151936-row output) 4.3 vs 6.1 GB/s, so Q8_0 / Q8_1 decode one row at a time.
macro_rules! legacy_tiles {
    ($name:ident, $fmt:ty, $tile:ident, $single:ident $(, $decode:literal)?) => {
        tile_wrapper!($name, legacy::$single::<$fmt>, <$fmt as BlockFormat>::WB, <$fmt as BlockFormat>::AB, [
            $(($decode, 1) => legacy::$tile::<$fmt, $decode, 1>,)?
            (1, 4) => legacy::$tile::<$fmt, 1, 4>,
            (2, 4) => legacy::$tile::<$fmt, 2, 4>,
            (1, 2) => legacy::$tile::<$fmt, 1, 2>,
        ]);
    };
}

legacy_tiles!(tile_q4_0, legacy::Q4_0, dot_tile, vec_dot, 2);
legacy_tiles!(tile_q4_1, legacy::Q4_1, dot_tile, vec_dot, 2);
legacy_tiles!(tile_q5_0, legacy::Q5_0, dot_tile, vec_dot, 2);
legacy_tiles!(tile_q5_1, legacy::Q5_1, dot_tile, vec_dot, 2);
legacy_tiles!(tile_q8_0, legacy::Q8_0, dot_tile, vec_dot);
legacy_tiles!(tile_q8_1, legacy::Q8_1, dot_tile, vec_dot);
// The same with AVX-512 VNNI's int8 products (only reachable through the table `detect` builds after checking
// avx512vnni and avx512vl).
legacy_tiles!(tile_q4_0_vnni, legacy::Q4_0, dot_tile_vnni, vec_dot_vnni, 2);
legacy_tiles!(tile_q4_1_vnni, legacy::Q4_1, dot_tile_vnni, vec_dot_vnni, 2);
legacy_tiles!(tile_q5_0_vnni, legacy::Q5_0, dot_tile_vnni, vec_dot_vnni, 2);
legacy_tiles!(tile_q5_1_vnni, legacy::Q5_1, dot_tile_vnni, vec_dot_vnni, 2);
legacy_tiles!(tile_q8_0_vnni, legacy::Q8_0, dot_tile_vnni, vec_dot_vnni);
legacy_tiles!(tile_q8_1_vnni, legacy::Q8_1, dot_tile_vnni, vec_dot_vnni);

tile_wrapper!(tile_q4_k_gemm, orders::vec_dot_q4_k_q8_k_repacked_gemm, Q4_K_BYTES, Q8_K_BYTES, [
    (1, 8) => orders::q4_k_repacked_gemm_1xc::<8>,
    (1, 4) => orders::q4_k_repacked_gemm_1xc::<4>,
]);
// No decode (R x 1) tiles for the K-quants: a super-block holds enough independent work to hide the FMA
// latency, and interleaving two rows' reads measured 15-65% slower than one sequential stream from DRAM.
tile_wrapper!(tile_q6_k_tiled, orders::vec_dot_q6_k_q8_k_tiled, Q6_K_BYTES, Q8_K_BYTES, [
    (1, 4) => orders::q6_k_tiled_1x4,
]);

/// A `QuantizeFn` writing whole blocks of `$qk` elements / `$bytes` bytes with `$kernel`.
macro_rules! quantize_wrapper {
    ($name:ident, $kernel:path, $qk:expr, $bytes:expr) => {
        fn $name(x: &[f32], dst: &mut [u8]) {
            let nb = (x.len() / $qk).min(dst.len() / $bytes);
            // SAFETY: as in `dot_wrapper`; `nb` whole blocks fit both slices.
            unsafe { $kernel(nb, x.as_ptr(), dst.as_mut_ptr()) }
        }
    };
}

quantize_wrapper!(quantize_q8_0, legacy::quantize_q8_0, QK_LEGACY, Q8_0_BYTES);
quantize_wrapper!(quantize_q8_1, legacy::quantize_q8_1, QK_LEGACY, Q8_1_BYTES);
quantize_wrapper!(quantize_q8_k, kquants::quantize_q8_k, QK_K, Q8_K_BYTES);
quantize_wrapper!(quantize_f16, float::quantize_f16, 1, 2);

fn dequantize_f16(src: &[u8], dst: &mut [f32]) {
    let n = (src.len() / 2).min(dst.len());
    // SAFETY: as in `dot_wrapper`; `n` elements fit both slices.
    unsafe { float::dequantize_f16(n, src.as_ptr(), dst.as_mut_ptr()) }
}

// ---------------------------------------------------------------------------------------------------------------
// Shared helpers (llama.cpp's names, from arch/x86/quants.c)
// ---------------------------------------------------------------------------------------------------------------

/// Bytes past the current block that the single-row (decode) kernels prefetch: their weights stream from DRAM.
/// Measured on the dev VM: 1 KiB ahead took Qwen2.5-1.5B decode from 0.94x to 1.1x llama.cpp (BENCHMARKS.md).
const DECODE_PREFETCH: usize = 1024;

/// Prefetch into L1 the `LINES` cache lines from `DECODE_PREFETCH` bytes past `p` (a hint: never faults, even
/// past the end of a row or of the mapping).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn prefetch_ahead<const LINES: usize>(p: *const u8) {
    for i in 0..LINES {
        _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(DECODE_PREFETCH + 64 * i) as *const i8);
    }
}

/// Unaligned 32-byte load.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn load256(p: *const u8) -> __m256i {
    _mm256_loadu_si256(p as *const __m256i)
}

/// Unaligned 16-byte load.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn load128(p: *const u8) -> __m128i {
    _mm_loadu_si128(p as *const __m128i)
}

/// The little-endian IEEE half at `p`, widened (exactly) to f32; `p .. p + 8` must be readable.
///
/// Converted from a full 8-byte load: a 2-byte insert into a vector register leaves a false dependency on
/// that register's old value, and LLVM happily picks one from an accumulator chain, serializing the block loop
/// (measured: 3x slower Q4_1 dots).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn f16_at(p: *const u8) -> f32 {
    _mm_cvtss_f32(f16x4_at(p))
}

/// [`f16_at`] for a half at the end of a block: reads `p - 6 .. p + 2`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn f16_at_tail(p: *const u8) -> f32 {
    let v = f16x4_at(p.sub(6));
    _mm_cvtss_f32(_mm_shuffle_ps::<0b11_11_11_11>(v, v))
}

/// The four little-endian halves at `p .. p + 8`, widened to f32.
///
/// Inline assembly because with intrinsics LLVM narrows the load to the one half a caller uses and emits
/// `vpinsrw` into whatever register it likes (the false dependency described at [`f16_at`]).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn f16x4_at(p: *const u8) -> __m128 {
    let r: __m128;
    std::arch::asm!(
        "vcvtph2ps {r}, qword ptr [{p}]",
        p = in(reg) p,
        r = out(xmm_reg) r,
        options(pure, readonly, nostack, preserves_flags),
    );
    r
}

/// `v` rounded to nearest-even half, as little-endian bytes at `p` (F16C: the same bits as `half`'s
/// conversion, which uses F16C itself on these CPUs).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn put_f16(p: *mut u8, v: f32) {
    let h = _mm_cvtsi128_si32(_mm_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(_mm_set_ss(v))) as u16;
    (p as *mut [u8; 2]).write_unaligned(h.to_le_bytes());
}

/// `hsum_float_8`: ((a0+a4) + (a2+a6)) + ((a1+a5) + (a3+a7)).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn hsum_float_8(x: __m256) -> f32 {
    let mut res = _mm_add_ps(_mm256_extractf128_ps::<1>(x), _mm256_castps256_ps128(x));
    res = _mm_add_ps(res, _mm_movehl_ps(res, res));
    res = _mm_add_ss(res, _mm_movehdup_ps(res));
    _mm_cvtss_f32(res)
}

/// `sum_i16_pairs_float`: adjacent i16 pairs summed to i32, as f32.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn sum_i16_pairs_float(x: __m256i) -> __m256 {
    _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_set1_epi16(1), x))
}

/// `mul_sum_us8_pairs_float`: unsigned bytes of `ax` times signed bytes of `sy`, four adjacent products per
/// i32 lane, as f32.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn mul_sum_us8_pairs_float(ax: __m256i, sy: __m256i) -> __m256 {
    sum_i16_pairs_float(_mm256_maddubs_epi16(ax, sy))
}

/// `bytes_from_nibbles_32`: the 16 bytes at `p` as 32 nibbles: low nibbles in bytes 0..16, high in 16..32.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn bytes_from_nibbles_32(p: *const u8) -> __m256i {
    let tmp = load128(p);
    let bytes = _mm256_set_m128i(_mm_srli_epi16::<4>(tmp), tmp);
    _mm256_and_si256(_mm256_set1_epi8(0xF), bytes)
}

/// `bytes_from_bits_32`: the 32 bits of the little-endian u32 at `p` spread to 32 bytes of 0x00 / 0xFF.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn bytes_from_bits_32(p: *const u8) -> __m256i {
    let x32 = (p as *const u32).read_unaligned();
    let shuf_mask = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0);
    let bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(x32 as i32), shuf_mask);
    let bytes = _mm256_or_si256(bytes, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));
    _mm256_cmpeq_epi8(bytes, _mm256_set1_epi64x(-1))
}

/// Largest |v| of four vectors, NaNs skipped, exactly as the scalar `abs_max` (`if v > m { v } else { m }`
/// per lane from 0; `max_ps(v, m)` returns `m` when `v` is NaN). Max is exact, so lane order is irrelevant.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn abs_max_lanes(v: &[__m256], mut m: __m256) -> __m256 {
    let sign = _mm256_set1_ps(-0.0);
    for &v in v {
        m = _mm256_max_ps(_mm256_andnot_ps(sign, v), m);
    }
    m
}

/// Sum of eight i32 lanes (wrapping, like llama.cpp's `hsum_i32_8`; the sums here never overflow).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn hsum_i32_8(a: __m256i) -> i32 {
    hsum_i32_4(_mm_add_epi32(_mm256_castsi256_si128(a), _mm256_extracti128_si256::<1>(a)))
}

/// Sum of four i32 lanes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn hsum_i32_4(a: __m128i) -> i32 {
    let hi64 = _mm_unpackhi_epi64(a, a);
    let sum64 = _mm_add_epi32(hi64, a);
    let hi32 = _mm_shuffle_epi32::<0b10_11_00_01>(sum64);
    _mm_cvtsi128_si32(_mm_add_epi32(sum64, hi32))
}

/// Horizontal max of eight NaN-free lanes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn hmax_ps(m: __m256) -> f32 {
    let mut m4 = _mm_max_ps(_mm256_extractf128_ps::<1>(m), _mm256_castps256_ps128(m));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    _mm_cvtss_f32(m4)
}

/// The scalar `nearest_int` on eight lanes: add 1.5 * 2^23 and read the mantissa (round half to even for
/// |v| <= 2^22, and the same bits as the scalar code for every other input).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn nearest_int(v: __m256) -> __m256i {
    let biased = _mm256_castps_si256(_mm256_add_ps(v, _mm256_set1_ps(12_582_912.0)));
    _mm256_sub_epi32(
        _mm256_and_si256(biased, _mm256_set1_epi32(0x007f_ffff)),
        _mm256_set1_epi32(0x0040_0000),
    )
}

/// The low bytes of 4 x 8 i32 lanes, in element order (the `as i8` truncation of the scalar code; masking to
/// 0..=255 first keeps the saturating packs exact).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn pack_low_bytes(i: [__m256i; 4]) -> __m256i {
    let ff = _mm256_set1_epi32(0xff);
    let a = _mm256_packs_epi32(_mm256_and_si256(i[0], ff), _mm256_and_si256(i[1], ff));
    let b = _mm256_packs_epi32(_mm256_and_si256(i[2], ff), _mm256_and_si256(i[3], ff));
    // Lanes now hold elements 0-3, 8-11, 16-19, 24-27 | 4-7, 12-15, 20-23, 28-31: put the dwords in order.
    _mm256_permutevar8x32_epi32(_mm256_packus_epi16(a, b), _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7))
}

/// Sums of the signed bytes of `q` over its four 8-byte groups (i64 lanes), via `sad_epu8` on `q ^ 0x80`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn sum_i8_groups8(q: __m256i) -> [i32; 4] {
    let sad = _mm256_sad_epu8(_mm256_xor_si256(q, _mm256_set1_epi8(-128)), _mm256_setzero_si256());
    let s: [i64; 4] = std::mem::transmute(sad);
    s.map(|v| v as i32 - 8 * 128)
}
