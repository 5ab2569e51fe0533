//! ninfer-core: the pure Rust part of ninfer (no Python here; `cargo test` runs it alone).
//!
//! # Layers of the formats and kernels
//!
//! `quant`, `gsq`, `kv` and `cpu` are layered: a file imports only files of its own layer or of the layers below it,
//! and no two files import each other, directly or around a cycle (`layering_tests` checks both on the source).
//! As in candle's quantized formats, the formats are data and the kernels depend on them, never the reverse.
//!
//! 0. math: `quant::math` (`ggml_expf`, the quantizers' rounding and max scans, the int8 dot product) and
//!    `error`; they import nothing else of the crate.
//! 1. formats, as data: `quant::format` (GGML type table, block sizes and layouts) and `gsq::format` (GSQ-RCO
//!    record layout, `Layout`, `ActQ8`, its scalar reference dequantization and dot products).
//! 2. scalar code: `quant::{float, legacy, kquants, scalar}` (the GGML reference kernels, the oracle of the SIMD
//!    ones) and `gsq::quantize` (the GSQ-RCO quantizer; it imports the formats, which never import it).
//! 3. SIMD kernels: `quant::simd` (`table`, `x86_avx2`, `aarch64_neon`, `vecops`); never `cpu`, never an entry
//!    point.
//! 4. entry points: `quant/mod.rs` (`dequantize_row`, `quantize_act`, `vec_dot`, ...) and `gsq/mod.rs` (public
//!    paths, whole-matrix quantization, `ActQ8::from_f32`); both re-export their formats' public types.
//! 5. `kv`: the paged KV cache. `kv::blocks` keeps the books (block tables, free list, reference counts, each
//!    block's home) and imports only `error`; `kv::cache` is the CPU's storage, which quantizes rows through the
//!    entry points and executes the books' block copies.
//! 6. `cpu`: ops, matmuls, attention and the layer loop; it may also import `model` and the rest.

pub mod cpu;
pub mod error;
pub mod gguf;
pub mod gsq;
pub mod kv;
pub mod model;
pub mod quant;
pub mod sampler;
#[cfg(test)]
mod layering_tests;
#[cfg(test)]
mod test_rng;

pub use error::{Error, Result};
