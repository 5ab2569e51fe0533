//! GSQ-RCO, ninfer's 3-bit weight format (docs/gsq-rco.md is the specification; format version 2).
//!
//! - `format`: the record layout (in its module docs), [`Layout`], the activations [`ActQ8`] and the scalar
//!   reference (dequantization, dot products): data, importing nothing above it;
//! - `quantize`: the quantizer with its residual calibration optimizer (RCO), one record at a time; it builds on
//!   `format` (and `quant::format` for Q2_K), and `format` never imports it;
//! - this file: the public paths, whole matrices on a thread pool, and [`ActQ8::from_f32`] (which runs the SIMD
//!   kernel of `quant::simd`, a layer above `format`).

pub(crate) mod format;
mod quantize;

pub use format::{dequantize_row, dot_row, dot_row_q8, ActQ8, Layout, FORMAT_VERSION, GROUP, RESIDUAL_UNIT, SUB};
pub use quantize::{quantize_row, quantize_row_q2_k, Options, RowStats};

use crate::error::{Error, Result};

/// Quantize a whole matrix (`w`: rows of `cols` weights, row-major) on `threads` worker threads, rows in
/// parallel. The result does not depend on the thread count: each row is quantized alone.
pub fn quantize_matrix(
    layout: Layout,
    w: &[f32],
    cols: usize,
    h: &[f32],
    opts: &Options,
    threads: usize,
) -> Result<(Vec<u8>, RowStats)> {
    check_matrix(w, cols, h)?;
    let row_bytes = layout.row_bytes(cols)?;
    quantize_rows(w, cols, row_bytes, threads, |row, dst| quantize_row(layout, row, h, opts, dst))
}

/// [`quantize_matrix`] to llama.cpp's Q2_K (rows of whole 256-weight blocks) by the same optimiser.
pub fn quantize_matrix_q2_k(w: &[f32], cols: usize, h: &[f32], opts: &Options, threads: usize) -> Result<(Vec<u8>, RowStats)> {
    check_matrix(w, cols, h)?;
    use crate::quant::{GgmlType, QK_K};
    if !cols.is_multiple_of(QK_K) {
        return Err(Error::InvalidArgument(format!("a row of {cols} weights is not a whole number of {QK_K}-weight Q2_K blocks")));
    }
    let row_bytes = GgmlType::Q2_K.row_bytes(cols)?;
    quantize_rows(w, cols, row_bytes, threads, |row, dst| quantize_row_q2_k(row, h, opts, dst))
}

fn check_matrix(w: &[f32], cols: usize, h: &[f32]) -> Result<()> {
    if cols == 0 || !w.len().is_multiple_of(cols) || h.len() != cols {
        return Err(Error::InvalidArgument(format!(
            "quantization of {} weights in rows of {cols} with {} importances",
            w.len(),
            h.len()
        )));
    }
    Ok(())
}

/// Rows of `cols` weights through `quantize` into `row_bytes` each, on a pool of `threads`; the statistics summed
/// in row order, so the totals (written to the file's metadata) do not depend on the thread count.
fn quantize_rows(
    w: &[f32],
    cols: usize,
    row_bytes: usize,
    threads: usize,
    quantize: impl Fn(&[f32], &mut [u8]) -> RowStats + Sync,
) -> Result<(Vec<u8>, RowStats)> {
    use rayon::prelude::*;
    let rows = w.len() / cols;
    let mut out = vec![0u8; rows * row_bytes];
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads.max(1))
        .build()
        .map_err(|e| Error::InvalidArgument(format!("cannot start {threads} threads: {e}")))?;
    let per_row: Vec<RowStats> = pool.install(|| {
        out.par_chunks_mut(row_bytes).zip(w.par_chunks(cols)).map(|(dst, row)| quantize(row, dst)).collect()
    });
    let mut stats = RowStats::default();
    per_row.iter().for_each(|r| stats.add(r));
    Ok((out, stats))
}

impl ActQ8 {
    /// `x` quantized by this CPU's kernel (`quant::simd::gsq_quantize`; the same bytes as `quantize`).
    pub fn from_f32(x: &[f32]) -> ActQ8 {
        let mut a = ActQ8::default();
        crate::quant::simd::gsq_quantize(x, &mut a);
        a
    }
}

#[cfg(test)]
mod tests;
