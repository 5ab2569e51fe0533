//! The scalar reference code, dispatched once on the type: the oracle every SIMD kernel is tested against and
//! the fallback where a CPU has none. Sizes are checked by the callers (the entry points in `quant/mod.rs` and
//! `simd`'s `*_scalar` functions).

use super::format::GgmlType;
use super::{float, kquants, legacy};

/// The scalar dequantizers (sizes already checked).
pub(super) fn dequantize_scalar(ty: GgmlType, src: &[u8], dst: &mut [f32]) {
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

/// The scalar quantizers (the K-quant weight formats are filtered out by the callers).
pub(super) fn quantize_scalar(ty: GgmlType, x: &[f32], dst: &mut [u8]) {
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

/// The scalar dot products over `nb` blocks (elements for the float types).
pub(super) fn vec_dot_scalar(ty: GgmlType, nb: usize, w: &[u8], act: &[u8]) -> f32 {
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
