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

use super::table::{Kernels, Orders, TileFn, VecDotFn};
use crate::gsq::format::{ActQ8, Layout};
use crate::quant::format::{BlockFormat, GgmlType, Q4_0_BYTES, Q8_0_BYTES, Q8_1_BYTES, QK_K, QK_LEGACY};
use crate::quant::format::{Q2_K_BYTES, Q3_K_BYTES, Q4_K_BYTES, Q5_K_BYTES, Q6_K_BYTES, Q8_K_BYTES};

mod float;
mod gsq;
mod kquants;
mod legacy;
mod orders;
pub(super) mod prims;
mod steps;
pub(super) mod vecops;

/// The AVX2 element-wise primitives, or `None` if this CPU lacks AVX2, FMA or F16C.
pub(super) fn detect_vec_ops() -> Option<&'static super::vecops::VecOps> {
    static OPS: super::vecops::VecOps = vecops::AVX2;
    (is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c"))
        .then_some(&OPS)
}

/// The AVX2 kernel table mirroring llama.cpp's matmul paths selected by `orders`, or `None` if this CPU lacks
/// AVX2, FMA or F16C. With `vnni` (the AVX-512 set builds on this table) and a CPU with AVX-512 VNNI and VL, the
/// legacy formats' products use `vpdpbusd`; the results are the same bits.
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
        k.vec_dot_tile_gemv[GgmlType::Q4_K as usize] = Some(tile_q4_k_gemv);
        k.vec_dot_tile_gemv[GgmlType::Q4_0 as usize] = Some(tile_q4_0_gemv);
    }
    k.vec_dot_tile[GgmlType::Q6_K as usize] = Some(tile_q6_k);
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
pub(super) fn tile_fits(nb: usize, wl: usize, ws: usize, nr: usize, wb: usize, al: usize, as_: usize, nc: usize, ab: usize) -> bool {
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
        pub(super) fn $name(nb: usize, w: &[u8], ws: usize, nr: usize, a: &[u8], as_: usize, nc: usize,
                            out: &mut [f32]) {
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

/// A `TileFn` over `$wb`-byte weight blocks and `$ab`-byte activation blocks for a kernel of one weight row and
/// `C` = 2..=8 activation rows (`$kernel::<C>`): row by row, columns in groups of up to 8, a lone column by
/// `$single` (so decode runs the single kernel itself). NaNs for a tile that does not fit its slices.
macro_rules! row_tile_wrapper {
    ($name:ident, $single:path, $kernel:ident, $wb:expr, $ab:expr) => {
        #[allow(clippy::too_many_arguments)]
        fn $name(nb: usize, w: &[u8], ws: usize, nr: usize, a: &[u8], as_: usize, nc: usize, out: &mut [f32]) {
            if !tile_fits(nb, w.len(), ws, nr, $wb, a.len(), as_, nc, $ab) || out.len() < nr * nc {
                out.iter_mut().take(nr * nc).for_each(|o| *o = f32::NAN);
                return;
            }
            for r in 0..nr {
                for c0 in (0..nc).step_by(8) {
                    let k = (nc - c0).min(8);
                    let dst = &mut out[r * nc + c0..r * nc + c0 + k];
                    // SAFETY: reachable only through the checked table; weight row r and activation rows
                    // c0 .. c0 + k hold `nb` blocks each (`tile_fits`).
                    unsafe {
                        let (x, y) = (w.as_ptr().add(r * ws), a.as_ptr().add(c0 * as_));
                        match k {
                            1 => dst[0] = $single(nb, x, y),
                            2 => dst.copy_from_slice(&steps::$kernel::<2>(nb, x, y, as_)),
                            3 => dst.copy_from_slice(&steps::$kernel::<3>(nb, x, y, as_)),
                            4 => dst.copy_from_slice(&steps::$kernel::<4>(nb, x, y, as_)),
                            5 => dst.copy_from_slice(&steps::$kernel::<5>(nb, x, y, as_)),
                            6 => dst.copy_from_slice(&steps::$kernel::<6>(nb, x, y, as_)),
                            7 => dst.copy_from_slice(&steps::$kernel::<7>(nb, x, y, as_)),
                            _ => dst.copy_from_slice(&steps::$kernel::<8>(nb, x, y, as_)),
                        }
                    }
                }
            }
        }
    };
}

// The single-row kernels of repacked Q4_K and Q4_0 (GEMV) and Q6_K over several activation rows: a weight block is
// unpacked once for all of them (speculative decoding's verify rows, `RowOrder::AsSteps`).
row_tile_wrapper!(
    tile_q4_k_gemv,
    orders::vec_dot_q4_k_q8_k_repacked,
    q4_k_repacked_gemv_1xc,
    Q4_K_BYTES,
    Q8_K_BYTES
);
row_tile_wrapper!(tile_q6_k, kquants::vec_dot_q6_k_q8_k, q6_k_1xc, Q6_K_BYTES, Q8_K_BYTES);
row_tile_wrapper!(
    tile_q4_0_gemv,
    legacy::vec_dot_q4_0_q8_0_repacked,
    q4_0_repacked_gemv_1xc,
    Q4_0_BYTES,
    Q8_0_BYTES
);

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
