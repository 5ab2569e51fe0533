//! The CPU backend: kernels and the layer loop.

pub mod attention;
pub mod forward;
pub mod matmul;
pub mod ops;
pub mod profile;
