//! x86-64 AVX-512 kernel set: what llama.cpp built with `-march=native` computes on a CPU with AVX-512 F, BW,
//! DQ, VL and VNNI (Zen 4/5, Ice Lake and later Xeons), where that differs from its AVX2 build.
//!
//! The set starts from the AVX2 table with AVX-512 VNNI's int8 products (`vpdpbusd`, the same integers) and
//! overrides only what sums or rounds differently in llama.cpp's AVX-512 build, found by reading its `__AVX512*__`
//! branches and checked against its native build token for token:
//! - `ggml_vec_dot_f16` (the attention's K·q) runs sixteen lanes ([`float`]);
//! - SiLU and the softmax use its AVX-512 `ggml_v_expf`; with AVX512-FP16 the f16 V accumulation runs in half
//!   precision ([`vecops`]).
//!
//! The quantized dot products of `arch/x86/quants.c` have no AVX-512 branches of their own (only VNNI), and its
//! AVX-512 repacked Q4_K GEMM and VNNI tiled K-quant microkernels add the same exact integers in the same float
//! steps as the AVX2 ones (read from the source; the greedy references of tests/data, whose prompts take both
//! paths, agree), so those sums stay. What changes is speed: the repacked Q4_K GEMM of prefill runs 16 weight
//! rows x 4 tokens per pass in the lanes of 512-bit VNNI products ([`q4k_gemm`]), as llama.cpp's AVX-512 build
//! does; matmul hands it 16 x 64 tiles (`Kernels::tile_shape_gemm4`). The Q4_0, Q5_0 and Q8_0 prefill tiles put
//! two weight rows' eight-lane sums in the halves of each 512-bit vector ([`legacy_pairs`], 4 x 8 tiles).
//!
//! Every kernel is an `unsafe fn` with `#[target_feature]`, reached only through the tables [`detect`] and
//! [`detect_vec_ops`] return after checking the features.

use std::cell::RefCell;

use super::table::{Kernels, Orders, TileFn, VecDotFn};
use super::vecops::VecOps;
use super::x86_avx2::tile_fits;
use crate::quant::format::{GgmlType, Q4_0_BYTES, Q4_K_BYTES, Q5_0_BYTES, Q6_K_BYTES, Q8_0_BYTES, Q8_K_BYTES};

mod float;
mod lanes;
mod legacy_pairs;
mod q4k_gemm;
mod q6k_tiled;
mod vecops;
#[cfg(test)]
mod tests;

/// Whether this CPU has what the AVX-512 set needs (and the AVX2 set it builds on).
pub(super) fn available() -> bool {
    is_x86_feature_detected!("avx2")
        && is_x86_feature_detected!("fma")
        && is_x86_feature_detected!("f16c")
        && is_x86_feature_detected!("avx512f")
        && is_x86_feature_detected!("avx512bw")
        && is_x86_feature_detected!("avx512dq")
        && is_x86_feature_detected!("avx512vl")
        && is_x86_feature_detected!("avx512vnni")
}

/// Whether llama.cpp's native build on this CPU has `__AVX512FP16__` (half-precision vector arithmetic).
fn has_fp16() -> bool {
    is_x86_feature_detected!("avx512fp16")
}

/// The AVX-512 kernel table, or `None` if this CPU lacks one of the features of [`available`]. Named
/// "avx512fp16" on CPUs with AVX512-FP16, "avx512" otherwise.
pub(super) fn detect(orders: Orders) -> Option<Kernels> {
    if !available() {
        return None;
    }
    let mut k = super::x86_avx2::detect(orders, true)?;
    k.name = if has_fp16() { "avx512fp16" } else { "avx512" };
    k.vec_dot[GgmlType::F16 as usize] = Some(vec_dot_f16 as VecDotFn);
    let (q4_k, q6_k) = (GgmlType::Q4_K as usize, GgmlType::Q6_K as usize);
    if k.vec_dot_tile_gemm4[q4_k].is_some() {
        k.vec_dot_tile_gemm4[q4_k] = Some(tile_q4_k_gemm);
        k.tile_shape_gemm4[q4_k] = Some(lanes::SHAPE);
    }
    if k.vec_dot_tile_tiled[q6_k].is_some() {
        k.vec_dot_tile_tiled[q6_k] = Some(tile_q6_k_tiled);
        k.tile_shape_tiled[q6_k] = Some(lanes::SHAPE);
    }
    for (ty, tile) in [(GgmlType::Q4_0, tile_q4_0_pairs as TileFn), (GgmlType::Q5_0, tile_q5_0_pairs),
                       (GgmlType::Q8_0, tile_q8_0_pairs)] {
        k.vec_dot_tile[ty as usize] = Some(tile);
        k.tile_shape_plain[ty as usize] = Some((legacy_pairs::ROWS, legacy_pairs::COLS));
    }
    Some(k)
}

/// The AVX-512 element-wise primitives, or `None` if this CPU lacks a feature of [`available`].
pub(super) fn detect_vec_ops() -> Option<&'static VecOps> {
    static OPS: VecOps = vecops::AVX512;
    static OPS_FP16: VecOps = vecops::AVX512_FP16;
    if !available() {
        return None;
    }
    Some(if has_fp16() { &OPS_FP16 } else { &OPS })
}

fn vec_dot_f16(n: usize, w: &[u8], a: &[u8]) -> f32 {
    let n = n.min(w.len() / 2).min(a.len() / 2);
    // SAFETY: the table holding this wrapper exists only on CPUs with the features of `available`; `n` halves
    // are in bounds of both slices.
    unsafe { float::vec_dot_f16(n, w.as_ptr(), a.as_ptr()) }
}

/// A `TileFn` running the `lanes::LaneKernel` `$kernel` over `$wb`-byte weight blocks (Q8_K activations), with
/// a per-thread scratch space for its transposed rows (so that a prefill matmul does not allocate and clear it at
/// every tile); NaNs for a tile that does not fit its slices.
macro_rules! lane_tile {
    ($name:ident, $kernel:ty, $wb:expr) => {
        #[allow(clippy::too_many_arguments)]
        fn $name(nb: usize, w: &[u8], ws: usize, nr: usize, a: &[u8], as_: usize, nc: usize, out: &mut [f32]) {
            thread_local! {
                static PACKED: RefCell<Vec<<$kernel as lanes::LaneKernel>::Packed>> = const { RefCell::new(Vec::new()) };
            }
            if !tile_fits(nb, w.len(), ws, nr, $wb, a.len(), as_, nc, Q8_K_BYTES) || out.len() < nr * nc {
                out.iter_mut().take(nr * nc).for_each(|o| *o = f32::NAN);
                return;
            }
            PACKED.with(|packed| {
                // SAFETY: the table holding this wrapper exists only on CPUs with the features of `available`; the
                // tile lies within both slices (`tile_fits`) and `out` holds its `nr * nc` products.
                unsafe {
                    lanes::tile::<$kernel>(nb, w.as_ptr(), ws, nr, a.as_ptr(), as_, nc, out, &mut packed.borrow_mut())
                }
            });
        }
    };
}

lane_tile!(tile_q4_k_gemm, q4k_gemm::Q4kGemm, Q4_K_BYTES);
lane_tile!(tile_q6_k_tiled, q6k_tiled::Q6kTiled, Q6_K_BYTES);

/// A `TileFn` of the paired-row prefill tiles (`legacy_pairs`) for the format `$fmt`, with `$decode` (the AVX2 set's
/// VNNI tile, the same bits) for one activation row: decode streams its rows from memory, where the AVX2 tiles'
/// prefetching was measured. NaNs for a tile that does not fit its slices.
macro_rules! pair_tile {
    ($name:ident, $fmt:ty, $wb:expr, $decode:path) => {
        #[allow(clippy::too_many_arguments)]
        fn $name(nb: usize, w: &[u8], ws: usize, nr: usize, a: &[u8], as_: usize, nc: usize, out: &mut [f32]) {
            if nc == 1 {
                return $decode(nb, w, ws, nr, a, as_, nc, out);
            }
            if !tile_fits(nb, w.len(), ws, nr, $wb, a.len(), as_, nc, Q8_0_BYTES) || out.len() < nr * nc {
                out.iter_mut().take(nr * nc).for_each(|o| *o = f32::NAN);
                return;
            }
            // SAFETY: the table holding this wrapper exists only on CPUs with the features of `available`; the
            // tile lies within both slices (`tile_fits`) and `out` holds its `nr * nc` products.
            unsafe { legacy_pairs::tile::<$fmt>(nb, w.as_ptr(), ws, nr, a.as_ptr(), as_, nc, out) }
        }
    };
}

pair_tile!(tile_q4_0_pairs, legacy_pairs::Q4_0, Q4_0_BYTES, super::x86_avx2::tile_q4_0_vnni);
pair_tile!(tile_q5_0_pairs, legacy_pairs::Q5_0, Q5_0_BYTES, super::x86_avx2::tile_q5_0_vnni);
pair_tile!(tile_q8_0_pairs, legacy_pairs::Q8_0, Q8_0_BYTES, super::x86_avx2::tile_q8_0_vnni);
