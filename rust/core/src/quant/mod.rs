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
//! Layout of this module:
//! - this file: the type table and the public entry points, which dispatch once on the type;
//! - [`float`]: F32, F16 and BF16 rows;
//! - [`legacy`]: the 32-element block formats Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and Q8_1;
//! - [`kquants`]: the 256-element super-block formats Q2_K .. Q6_K and the activation format Q8_K;
//! - [`math`]: scalar math the layers above share (`ggml_expf`, which the SIMD SiLU and softmax use);
//! - [`simd`]: run-time selected SIMD kernels (AVX2 today); `vec_dot`, `quantize_act`/`quantize_row` and
//!   `dequantize_row` route to them when the CPU has them, the scalar code being the fallback and oracle.
//!
//! All block layouts are GGML's (`ggml-common.h`), read straight from little-endian bytes; the math follows
//! llama.cpp's scalar references (`ggml-quants.c`, `ggml-cpu/quants.c`): integer sums inside a block, then one
//! scaling in f32 per block.

mod float;
mod kquants;
mod legacy;
pub(crate) mod math;
pub mod simd;

#[cfg(test)]
mod tests;

use crate::error::{Error, Result};

/// Elements in a K-quant super-block.
pub const QK_K: usize = 256;
/// Bytes of the packed 6-bit scales and mins of Q4_K and Q5_K (and of the 6-bit scales of Q3_K).
pub const K_SCALE_SIZE: usize = 12;
/// Elements in a block of the legacy formats (Q4_0 .. Q8_1).
pub const QK_LEGACY: usize = 32;

/// A GGML tensor element type the engine knows. The discriminants are GGML's type ids (`enum ggml_type`).
#[allow(non_camel_case_types)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum GgmlType {
    F32 = 0,
    F16 = 1,
    Q4_0 = 2,
    Q4_1 = 3,
    Q5_0 = 6,
    Q5_1 = 7,
    Q8_0 = 8,
    Q8_1 = 9,
    Q2_K = 10,
    Q3_K = 11,
    Q4_K = 12,
    Q5_K = 13,
    Q6_K = 14,
    Q8_K = 15,
    BF16 = 30,
}

impl GgmlType {
    /// Every type of the table, in id order.
    pub const ALL: [GgmlType; 15] = [
        GgmlType::F32,
        GgmlType::F16,
        GgmlType::Q4_0,
        GgmlType::Q4_1,
        GgmlType::Q5_0,
        GgmlType::Q5_1,
        GgmlType::Q8_0,
        GgmlType::Q8_1,
        GgmlType::Q2_K,
        GgmlType::Q3_K,
        GgmlType::Q4_K,
        GgmlType::Q5_K,
        GgmlType::Q6_K,
        GgmlType::Q8_K,
        GgmlType::BF16,
    ];

    /// The type with GGML id `id`, or `None` for ids this engine does not know (including GGML's removed
    /// Q4_2/Q4_3 ids 4 and 5 and the IQ formats).
    pub fn from_id(id: u32) -> Option<GgmlType> {
        GgmlType::ALL.into_iter().find(|t| t.id() == id)
    }

    /// GGML's id of the type (the value stored in GGUF tensor infos).
    pub fn id(self) -> u32 {
        self as u32
    }

    /// The type's name as GGML spells it (`ggml_type_name`).
    pub fn name(self) -> &'static str {
        match self {
            GgmlType::F32 => "F32",
            GgmlType::F16 => "F16",
            GgmlType::Q4_0 => "Q4_0",
            GgmlType::Q4_1 => "Q4_1",
            GgmlType::Q5_0 => "Q5_0",
            GgmlType::Q5_1 => "Q5_1",
            GgmlType::Q8_0 => "Q8_0",
            GgmlType::Q8_1 => "Q8_1",
            GgmlType::Q2_K => "Q2_K",
            GgmlType::Q3_K => "Q3_K",
            GgmlType::Q4_K => "Q4_K",
            GgmlType::Q5_K => "Q5_K",
            GgmlType::Q6_K => "Q6_K",
            GgmlType::Q8_K => "Q8_K",
            GgmlType::BF16 => "BF16",
        }
    }

    /// Elements per block (1 for the plain float types).
    pub fn block_size(self) -> usize {
        match self {
            GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => 1,
            GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q5_0 | GgmlType::Q5_1 | GgmlType::Q8_0 | GgmlType::Q8_1 => {
                QK_LEGACY
            }
            GgmlType::Q2_K | GgmlType::Q3_K | GgmlType::Q4_K | GgmlType::Q5_K | GgmlType::Q6_K | GgmlType::Q8_K => QK_K,
        }
    }

    /// Bytes per block.
    pub fn type_size(self) -> usize {
        match self {
            GgmlType::F32 => 4,
            GgmlType::F16 | GgmlType::BF16 => 2,
            GgmlType::Q4_0 => legacy::Q4_0_BYTES,
            GgmlType::Q4_1 => legacy::Q4_1_BYTES,
            GgmlType::Q5_0 => legacy::Q5_0_BYTES,
            GgmlType::Q5_1 => legacy::Q5_1_BYTES,
            GgmlType::Q8_0 => legacy::Q8_0_BYTES,
            GgmlType::Q8_1 => legacy::Q8_1_BYTES,
            GgmlType::Q2_K => kquants::Q2_K_BYTES,
            GgmlType::Q3_K => kquants::Q3_K_BYTES,
            GgmlType::Q4_K => kquants::Q4_K_BYTES,
            GgmlType::Q5_K => kquants::Q5_K_BYTES,
            GgmlType::Q6_K => kquants::Q6_K_BYTES,
            GgmlType::Q8_K => kquants::Q8_K_BYTES,
        }
    }

    /// Bytes of a row of `n` elements; `Error::BadModel` if `n` is not a whole number of blocks.
    pub fn row_bytes(self, n: usize) -> Result<usize> {
        let bs = self.block_size();
        if !n.is_multiple_of(bs) {
            return Err(Error::BadModel(format!(
                "a row of {n} elements is not a whole number of {} blocks ({bs} elements each)",
                self.name()
            )));
        }
        (n / bs)
            .checked_mul(self.type_size())
            .ok_or_else(|| Error::BadModel(format!("a {} row of {n} elements is too large to address", self.name())))
    }

    /// The type activations are quantized to before a dot product with weights of this type: llama.cpp CPU
    /// backend's `vec_dot_type`. Q8_1 and Q8_K pair with themselves.
    pub fn act_type(self) -> GgmlType {
        match self {
            GgmlType::F32 => GgmlType::F32,
            GgmlType::F16 => GgmlType::F16,
            GgmlType::BF16 => GgmlType::BF16,
            GgmlType::Q4_0 | GgmlType::Q5_0 | GgmlType::Q8_0 => GgmlType::Q8_0,
            GgmlType::Q4_1 | GgmlType::Q5_1 | GgmlType::Q8_1 => GgmlType::Q8_1,
            GgmlType::Q2_K | GgmlType::Q3_K | GgmlType::Q4_K | GgmlType::Q5_K | GgmlType::Q6_K | GgmlType::Q8_K => {
                GgmlType::Q8_K
            }
        }
    }

    /// Whether `quantize_act` accepts this type (it is some type's `act_type`).
    pub fn is_act_type(self) -> bool {
        matches!(
            self,
            GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 | GgmlType::Q8_0 | GgmlType::Q8_1 | GgmlType::Q8_K
        )
    }
}

impl std::fmt::Display for GgmlType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// `Error::BadModel` unless `src_len` bytes are exactly one row of `n` elements of type `ty`.
pub(crate) fn check_row_size(ty: GgmlType, src_len: usize, n: usize) -> Result<()> {
    let expected = ty.row_bytes(n)?;
    if src_len != expected {
        return Err(Error::BadModel(format!("a {ty} row of {n} elements takes {expected} bytes, got {src_len}")));
    }
    Ok(())
}

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

/// The scalar dequantizers (sizes already checked).
fn dequantize_scalar(ty: GgmlType, src: &[u8], dst: &mut [f32]) {
    match ty {
        GgmlType::F32 => float::dequantize_f32(src, dst),
        GgmlType::F16 => float::dequantize_f16(src, dst),
        GgmlType::BF16 => float::dequantize_bf16(src, dst),
        GgmlType::Q4_0 => legacy::dequantize_q4_0(src, dst),
        GgmlType::Q4_1 => legacy::dequantize_q4_1(src, dst),
        GgmlType::Q5_0 => legacy::dequantize_q5_0(src, dst),
        GgmlType::Q5_1 => legacy::dequantize_q5_1(src, dst),
        GgmlType::Q8_0 => legacy::dequantize_q8_0(src, dst),
        GgmlType::Q8_1 => legacy::dequantize_q8_1(src, dst),
        GgmlType::Q2_K => kquants::dequantize_q2_k(src, dst),
        GgmlType::Q3_K => kquants::dequantize_q3_k(src, dst),
        GgmlType::Q4_K => kquants::dequantize_q4_k(src, dst),
        GgmlType::Q5_K => kquants::dequantize_q5_k(src, dst),
        GgmlType::Q6_K => kquants::dequantize_q6_k(src, dst),
        GgmlType::Q8_K => kquants::dequantize_q8_k(src, dst),
    }
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

/// The scalar quantizers (the K-quant weight formats are filtered out by the callers).
fn quantize_scalar(ty: GgmlType, x: &[f32], dst: &mut [u8]) {
    match ty {
        GgmlType::F32 => float::quantize_f32(x, dst),
        GgmlType::F16 => float::quantize_f16(x, dst),
        GgmlType::BF16 => float::quantize_bf16(x, dst),
        GgmlType::Q4_0 => legacy::quantize_q4_0(x, dst),
        GgmlType::Q4_1 => legacy::quantize_q4_1(x, dst),
        GgmlType::Q5_0 => legacy::quantize_q5_0(x, dst),
        GgmlType::Q5_1 => legacy::quantize_q5_1(x, dst),
        GgmlType::Q8_0 => legacy::quantize_q8_0(x, dst),
        GgmlType::Q8_1 => legacy::quantize_q8_1(x, dst),
        GgmlType::Q8_K => kquants::quantize_q8_k(x, dst),
        GgmlType::Q2_K | GgmlType::Q3_K | GgmlType::Q4_K | GgmlType::Q5_K | GgmlType::Q6_K => {
            unreachable!("K-quant weight formats are rejected before dispatch")
        }
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
pub fn vec_dot(ty: GgmlType, n: usize, w: &[u8], act: &[u8]) -> f32 {
    debug_assert!(
        n.is_multiple_of(ty.block_size()),
        "vec_dot: {n} is not a whole number of {ty} blocks"
    );
    debug_assert!(
        w.len() >= n / ty.block_size() * ty.type_size(),
        "vec_dot: {ty} weight row too short"
    );
    debug_assert!(
        act.len() >= n / ty.block_size() * ty.act_type().type_size(),
        "vec_dot: {} activation row too short",
        ty.act_type()
    );
    let nb = n / ty.block_size();
    match simd::kernels().vec_dot(ty) {
        Some(f) => f(nb, w, act),
        None => vec_dot_scalar(ty, nb, w, act),
    }
}

/// The scalar dot products over `nb` blocks (elements for the float types).
fn vec_dot_scalar(ty: GgmlType, nb: usize, w: &[u8], act: &[u8]) -> f32 {
    match ty {
        GgmlType::F32 => float::vec_dot_f32(nb, w, act),
        GgmlType::F16 => float::vec_dot_f16(nb, w, act),
        GgmlType::BF16 => float::vec_dot_bf16(nb, w, act),
        GgmlType::Q4_0 => legacy::vec_dot_q4_0_q8_0(nb, w, act),
        GgmlType::Q4_1 => legacy::vec_dot_q4_1_q8_1(nb, w, act),
        GgmlType::Q5_0 => legacy::vec_dot_q5_0_q8_0(nb, w, act),
        GgmlType::Q5_1 => legacy::vec_dot_q5_1_q8_1(nb, w, act),
        GgmlType::Q8_0 => legacy::vec_dot_q8_0_q8_0(nb, w, act),
        GgmlType::Q8_1 => legacy::vec_dot_q8_1_q8_1(nb, w, act),
        GgmlType::Q2_K => kquants::vec_dot_q2_k_q8_k(nb, w, act),
        GgmlType::Q3_K => kquants::vec_dot_q3_k_q8_k(nb, w, act),
        GgmlType::Q4_K => kquants::vec_dot_q4_k_q8_k(nb, w, act),
        GgmlType::Q5_K => kquants::vec_dot_q5_k_q8_k(nb, w, act),
        GgmlType::Q6_K => kquants::vec_dot_q6_k_q8_k(nb, w, act),
        GgmlType::Q8_K => kquants::vec_dot_q8_k_q8_k(nb, w, act),
    }
}

/// Read a little-endian IEEE half at the start of `b` as f32 (the `d`/`dmin`/`m`/`s` fields of the blocks).
#[inline(always)]
fn f16_at(b: &[u8]) -> f32 {
    float::f16_to_f32(u16::from_le_bytes([b[0], b[1]]))
}

/// Write `v` rounded to nearest-even IEEE half, little-endian, into the first two bytes of `b`.
#[inline(always)]
fn put_f16(b: &mut [u8], v: f32) {
    b[..2].copy_from_slice(&half::f16::from_f32(v).to_le_bytes());
}

/// llama.cpp's `nearest_int`: round to nearest, ties to even, by adding 1.5 * 2^23 and reading the mantissa.
/// Valid for |v| <= 2^22 (the quantizers only use it on values within +-128); no libm call.
#[inline(always)]
pub(super) fn nearest_int(v: f32) -> i32 {
    let biased = v + 12_582_912.0;
    (biased.to_bits() & 0x007f_ffff) as i32 - 0x0040_0000
}

/// Largest |v| of `x` (0 for an empty slice; NaNs are skipped), in eight independent lanes so the compiler
/// vectorizes it. Max is exact, so the grouping does not change the result.
#[inline(always)]
fn abs_max(x: &[f32]) -> f32 {
    #[inline(always)]
    fn max(m: f32, v: f32) -> f32 {
        if v > m {
            v
        } else {
            m
        }
    }
    let (groups, tail) = x.as_chunks::<8>();
    let mut lanes = [0.0f32; 8];
    for g in groups {
        for (m, v) in lanes.iter_mut().zip(g) {
            *m = max(*m, v.abs());
        }
    }
    let m = lanes.into_iter().fold(0.0, max);
    tail.iter().fold(m, |m, v| max(m, v.abs()))
}

/// The value of `x` with the largest |v|, sign included (0 if all are zero): the first such value, as the
/// strict `>` scans of llama.cpp's Q4_0/Q5_0/Q8_K quantizers pick it (the sign of the scale depends on it).
#[inline(always)]
fn signed_abs_max(x: &[f32]) -> f32 {
    let amax = abs_max(x);
    x.iter().copied().find(|v| v.abs() == amax).unwrap_or(0.0)
}

/// The exact int8 dot product of codes and activation quants inside the K-quant dot products: the scalar loop
/// here ([`ScalarDot`], the reference), NEON on aarch64 (`simd::aarch64_neon`).
pub(crate) trait IntDot {
    fn dot(a: &[i8], b: &[u8]) -> i32;
}

pub(crate) struct ScalarDot;

impl IntDot for ScalarDot {
    #[inline(always)]
    fn dot(a: &[i8], b: &[u8]) -> i32 {
        dot_i8(a, b)
    }
}

/// Signed dot product of int8 values (`a`) with int8 values stored as bytes (`b`), over the shorter of the two.
/// Written as a plain reduction so LLVM vectorizes it.
#[inline(always)]
fn dot_i8(a: &[i8], b: &[u8]) -> i32 {
    a.iter().zip(b).map(|(&x, &y)| x as i32 * (y as i8) as i32).sum()
}
