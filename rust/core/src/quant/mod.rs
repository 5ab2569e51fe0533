//! GGML block formats: type table, scalar reference dequantization, activation quantization and the
//! quantized dot products the matmuls run on (weights stay in their blocks; see ARCHITECTURE.md, decision 2).
//!
//! Contract used by the rest of the core:
//! - `GgmlType` with `from_id`, `name`, `block_size`, `type_size`, `row_bytes`, `act_type`.
//! - `dequantize_row(ty, src, dst)`: scalar reference, the oracle for every other path.
//! - `quantize_act(act_ty, x, dst)`: quantize an f32 activation row to `act_ty` (Q8_0, Q8_1, Q8_K, F16, BF16, F32),
//!   exactly as llama.cpp does, so the integer dot products give llama.cpp's numbers.
//! - `vec_dot(ty, n, w, act)`: dot product of one weight row of type `ty` (n elements) with an activation row
//!   quantized to `ty.act_type()`.
//! - `quantize_row(ty, x, dst)` for the KV cache types (F16, Q8_0, Q4_0).
//!
//! Layout of this module, from the bottom up (a file imports only the ones above it in this list; see the
//! layering in `lib.rs`):
//! - `math`: scalar math the layers above share (`ggml_expf`, which the SIMD SiLU and softmax use, and the
//!   quantizers' rounding and int8 helpers);
//! - `format`: the type table, block sizes and block layouts, as data;
//! - [`float`]: F32, F16 and BF16 rows;
//! - [`legacy`]: the 32-element block formats Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and Q8_1;
//! - [`kquants`]: the 256-element super-block formats Q2_K .. Q6_K and the activation format Q8_K;
//! - `scalar`: the scalar reference code of all of them, dispatched on the type;
//! - [`simd`]: run-time selected SIMD kernels (AVX2 today); `vec_dot`, `quantize_act`/`quantize_row` and
//!   `dequantize_row` route to them when the CPU has them, the scalar code being the fallback and oracle;
//! - this file: the public entry points, which dispatch once on the type (and re-export the type table).
//!
//! All block layouts are GGML's (`ggml-common.h`), read straight from little-endian bytes; the math follows
//! llama.cpp's scalar references (`ggml-quants.c`, `ggml-cpu/quants.c`): integer sums inside a block, then one
//! scaling in f32 per block.

mod float;
pub(crate) mod format;
mod kquants;
mod legacy;
pub(crate) mod math;
mod scalar;
pub mod simd;

#[cfg(test)]
mod tests;

pub use format::{GgmlType, K_SCALE_SIZE, QK_K, QK_LEGACY};

use crate::error::{Error, Result};
use format::check_row_size;
use scalar::{dequantize_scalar, quantize_scalar};

/// Dequantize one row: `src` holds `dst.len()` elements of type `ty` in GGML block layout.
///
/// This is the scalar reference every faster path is checked against; each element is computed with the same
/// f32 operations, in the same order, as llama.cpp's `dequantize_row_*` (and gguf-py's numpy dequantizers).
/// Every type of the table is supported. `Error::BadModel` if `dst.len()` is not a whole number of blocks or
/// `src` is not exactly the row's size.
pub fn dequantize_row(ty: GgmlType, src: &[u8], dst: &mut [f32]) -> Result<()> {
    check_row_size(ty, src.len(), dst.len())?;
    match simd::kernels().dequantize(ty) {
        Some(f) => f(src, dst),
        None => dequantize_scalar(ty, src, dst),
    }
    Ok(())
}

/// Quantize an f32 activation row `x` to `act_ty` into `dst`, bit-exact with llama.cpp's reference
/// (`quantize_row_q8_0_ref`, `quantize_row_q8_1_ref`, `quantize_row_q8_K_ref`, and round-to-nearest-even
/// f16/bf16 conversion).
///
/// The caller guarantees `x.len()` is a whole number of blocks and `dst.len() == act_ty.row_bytes(x.len())`
/// (checked in debug builds; in release only the whole blocks that fit both are written).
///
/// # Panics
/// If `act_ty` is not an activation type (`!act_ty.is_act_type()`): that is a bug in the caller.
pub fn quantize_act(act_ty: GgmlType, x: &[f32], dst: &mut [u8]) {
    assert!(act_ty.is_act_type(), "{act_ty} is not an activation type");
    debug_assert_eq!(
        act_ty.row_bytes(x.len()).ok(),
        Some(dst.len()),
        "quantize_act: {act_ty} row size mismatch"
    );
    quantize_into(act_ty, x, dst);
}

/// Quantize a row `x` to `ty` into `dst`, with llama.cpp's reference quantizers (`quantize_row_*_ref`); used
/// for KV-cache storage. Supported: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q8_1 and Q8_K
/// (`Error::UnsupportedType` for the other K-quants, whose quantizers search for scales and are not needed
/// at run time). `Error::InvalidArgument` if `x` is not a whole number of blocks or `dst` is not the row's size.
pub fn quantize_row(ty: GgmlType, x: &[f32], dst: &mut [u8]) -> Result<()> {
    if matches!(
        ty,
        GgmlType::Q2_K | GgmlType::Q3_K | GgmlType::Q4_K | GgmlType::Q5_K | GgmlType::Q6_K
    ) {
        return Err(Error::UnsupportedType(format!(
            "quantizing rows to {ty} is not supported"
        )));
    }
    let expected = ty
        .row_bytes(x.len())
        .map_err(|e| Error::InvalidArgument(format!("cannot quantize a row to {ty}: {e}")))?;
    if dst.len() != expected {
        return Err(Error::InvalidArgument(format!(
            "a {ty} row of {} elements takes {expected} bytes, the destination has {}",
            x.len(),
            dst.len()
        )));
    }
    quantize_into(ty, x, dst);
    Ok(())
}

/// Shared dispatch of `quantize_act` and `quantize_row`; the K-quant weight formats are filtered out by both
/// callers.
fn quantize_into(ty: GgmlType, x: &[f32], dst: &mut [u8]) {
    match simd::kernels().quantize(ty) {
        Some(f) => f(x, dst),
        None => quantize_scalar(ty, x, dst),
    }
}

/// Dot product of the first `n` elements of weight row `w` (type `ty`) with activation row `act`, quantized to
/// `ty.act_type()` by [`quantize_act`].
///
/// Follows llama.cpp's `ggml_vec_dot_<type>_<acttype>` math: exact integer sums inside each block, scaled once
/// per block in f32. Float rows (F32/F16/BF16) are summed in eight f32 lanes, like llama.cpp's SIMD paths.
/// Every type of the table is supported (Q8_1 and Q8_K pair with themselves). Where the CPU has them, SIMD
/// kernels ([`simd`]) run instead, with the float summation order of llama.cpp's own SIMD kernels (the last
/// bits may differ from the scalar code): for one activation row, as in decoding. For a matmul over several
/// activation rows, [`simd::vec_dot_matmul`] gives the order llama.cpp uses at each position.
///
/// The caller guarantees `n` is a whole number of blocks and both rows hold at least `n` elements (checked in
/// debug builds; in release a short row is treated as ending early, never read past).
#[inline]
pub fn vec_dot(ty: GgmlType, n: usize, w: &[u8], act: &[u8]) -> f32 {
    simd::vec_dot(ty, n, w, act)
}
