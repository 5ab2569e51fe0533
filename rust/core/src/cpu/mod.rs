//! The CPU backend: kernels and the layer loop.

pub mod attention;
pub mod attention_tiered;
pub mod forward;
pub mod matmul;
pub mod ops;
pub mod profile;
pub mod rope;

/// How the rows (tokens) of one forward pass are computed. llama.cpp's CPU kernels, and so the float summation
/// order of each product, depend on how many rows a matmul (or attention) has; [`RowOrder::AsSteps`] gives up
/// that batch-shaped arithmetic so that each row comes out exactly as a one-row batch (a decode step) at the
/// same position over the same cache would compute it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum RowOrder {
    /// Every matmul and attention takes the path llama.cpp takes for the whole batch's shape (its parity).
    #[default]
    Batch,
    /// Each row is summed as a single-row decode step sums it, bit for bit, while every weight matrix is still
    /// read once for all rows: speculative decoding's verify pass, whose greedy output must equal plain decoding.
    AsSteps,
}
