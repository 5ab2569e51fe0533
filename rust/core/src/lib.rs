//! ninfer-core: the pure Rust part of ninfer (no Python here; `cargo test` runs it alone).

pub mod cpu;
pub mod error;
pub mod gguf;
pub mod gsq;
pub mod kv;
pub mod model;
pub mod quant;
pub mod sampler;
#[cfg(test)]
mod test_rng;

pub use error::{Error, Result};
