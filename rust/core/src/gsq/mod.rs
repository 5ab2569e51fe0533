//! GSQ-RCO, ninfer's 3-bit weight format (docs/gsq-rco.md is the specification; format version 1).
//!
//! A row is cut into groups of `group` weights (32, 64, 128 or 256). Each group is one self-contained record:
//!
//! ```text
//! offset 0   f16  scale   |scale| is the grid step; its sign bit marks a sparse group
//! offset 2   f16  min     the grid's first level
//! offset 4   3 * group / 8 bytes of 3-bit codes, 8 codes per 3 bytes, little-endian bit order
//! then       `slots` residual slots of 2 bytes: position (u8), value (i8)
//! ```
//!
//! A dense group's code c in 0..=7 means `min + c * scale`; in a sparse group code 0 means exactly 0.0 and
//! codes 1..=7 mean `min + (c - 1) * scale`. A slot adds `value * |scale| / 16` to the weight at its position
//! (value 0: an unused slot). Records are 4-byte aligned when `slots` is even. Bits per weight:
//! `8 * (4 + 3 * group / 8 + 2 * slots) / group` (3.25 for group 128 without slots, 3.5 with two).

mod quantize;

pub use quantize::{quantize_row, Options, RowStats};

use crate::error::{Error, Result};
use half::f16;

/// The format version written to (and required in) a file's metadata.
pub const FORMAT_VERSION: u32 = 1;
/// A residual slot's value unit, as a fraction of the group's grid step.
pub const RESIDUAL_UNIT: f32 = 1.0 / 16.0;

/// The shape of a tensor's records: weights per group and residual slots per group.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Layout {
    pub group: usize,
    pub slots: usize,
}

impl Layout {
    pub fn new(group: usize, slots: usize) -> Result<Layout> {
        if !matches!(group, 32 | 64 | 128 | 256) {
            return Err(Error::InvalidArgument(format!(
                "GSQ-RCO group size must be 32, 64, 128 or 256, got {group}"
            )));
        }
        if slots > 16 || !slots.is_multiple_of(2) {
            return Err(Error::InvalidArgument(format!(
                "GSQ-RCO residual slots per group must be even and at most 16, got {slots}"
            )));
        }
        Ok(Layout { group, slots })
    }

    /// Bytes of one group's record.
    pub fn record_bytes(&self) -> usize {
        4 + 3 * self.group / 8 + 2 * self.slots
    }

    /// Bytes of a row of `n` weights, or an error when `n` is not a whole number of groups.
    pub fn row_bytes(&self, n: usize) -> Result<usize> {
        if !n.is_multiple_of(self.group) {
            return Err(Error::InvalidArgument(format!(
                "a row of {n} weights is not a whole number of {}-weight groups",
                self.group
            )));
        }
        Ok(n / self.group * self.record_bytes())
    }

    pub fn bits_per_weight(&self) -> f64 {
        8.0 * self.record_bytes() as f64 / self.group as f64
    }
}

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
    use rayon::prelude::*;
    let row_bytes = layout.row_bytes(cols)?;
    if cols == 0 || !w.len().is_multiple_of(cols) || h.len() != cols {
        return Err(Error::InvalidArgument(format!(
            "GSQ-RCO quantization of {} weights in rows of {cols} with {} importances",
            w.len(),
            h.len()
        )));
    }
    let rows = w.len() / cols;
    let mut out = vec![0u8; rows * row_bytes];
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads.max(1))
        .build()
        .map_err(|e| Error::InvalidArgument(format!("cannot start {threads} threads: {e}")))?;
    let per_row: Vec<RowStats> = pool.install(|| {
        out.par_chunks_mut(row_bytes)
            .zip(w.par_chunks(cols))
            .map(|(dst, row)| quantize_row(layout, row, h, opts, dst))
            .collect()
    });
    // Summed in row order, so the totals (written to the file's metadata) do not depend on the thread count.
    let mut stats = RowStats::default();
    per_row.iter().for_each(|r| stats.add(r));
    Ok((out, stats))
}

/// Code i (0-based) of a group's packed codes.
#[inline]
pub(crate) fn code_at(codes: &[u8], i: usize) -> u8 {
    let word = (i / 8) * 3;
    let bits = codes[word] as u32 | (codes[word + 1] as u32) << 8 | (codes[word + 2] as u32) << 16;
    ((bits >> (3 * (i % 8))) & 7) as u8
}

/// Pack codes (each < 8) into 3 bytes per 8.
pub(crate) fn pack_codes(codes: &[u8], out: &mut [u8]) {
    for (chunk, dst) in codes.chunks_exact(8).zip(out.chunks_exact_mut(3)) {
        let bits = chunk
            .iter()
            .enumerate()
            .fold(0u32, |b, (i, &c)| b | ((c as u32 & 7) << (3 * i)));
        dst.copy_from_slice(&bits.to_le_bytes()[..3]);
    }
}

/// The value code `c` stands for in a group with this grid.
#[inline]
pub(crate) fn level(c: u8, scale: f32, min: f32, sparse: bool) -> f32 {
    match (sparse, c) {
        (true, 0) => 0.0,
        (true, c) => min + (c - 1) as f32 * scale,
        (false, c) => min + c as f32 * scale,
    }
}

/// One group's grid: (|scale|, min, sparse).
#[inline]
fn header(rec: &[u8]) -> (f32, f32, bool) {
    let s = f16::from_le_bytes([rec[0], rec[1]]);
    let m = f16::from_le_bytes([rec[2], rec[3]]).to_f32();
    (s.to_f32().abs(), m, s.is_sign_negative())
}

/// Dequantize one row (`dst.len()` weights) from its records.
pub fn dequantize_row(layout: Layout, src: &[u8], dst: &mut [f32]) -> Result<()> {
    let expected = layout.row_bytes(dst.len())?;
    if src.len() != expected {
        return Err(Error::BadModel(format!(
            "a GSQ-RCO row of {} weights takes {expected} bytes, got {}",
            dst.len(),
            src.len()
        )));
    }
    let g = layout.group;
    let code_bytes = 3 * g / 8;
    for (rec, out) in src
        .chunks_exact(layout.record_bytes())
        .zip(dst.chunks_exact_mut(g))
    {
        let (scale, min, sparse) = header(rec);
        let codes = &rec[4..4 + code_bytes];
        // The group's levels once; then 8 codes per 3-byte word.
        let levels: [f32; 8] = std::array::from_fn(|c| level(c as u8, scale, min, sparse));
        for (word, o8) in codes.chunks_exact(3).zip(out.chunks_exact_mut(8)) {
            let bits = word[0] as u32 | (word[1] as u32) << 8 | (word[2] as u32) << 16;
            for (i, o) in o8.iter_mut().enumerate() {
                *o = levels[((bits >> (3 * i)) & 7) as usize];
            }
        }
        for slot in rec[4 + code_bytes..].chunks_exact(2) {
            let (pos, val) = (slot[0] as usize, slot[1] as i8);
            if val != 0 && pos < g {
                out[pos] += val as f32 * scale * RESIDUAL_UNIT;
            }
        }
    }
    Ok(())
}

/// Dot product of one row's records with f32 activations `x` (the scalar reference of the GSQ-RCO kernels):
/// per group, `|scale| * sum(c' * x) + min * sum(x over non-zero codes) + residuals`, summed in f32.
pub fn dot_row(layout: Layout, src: &[u8], x: &[f32]) -> f32 {
    let g = layout.group;
    let code_bytes = 3 * g / 8;
    let mut total = 0.0f32;
    for (rec, xs) in src
        .chunks_exact(layout.record_bytes())
        .zip(x.chunks_exact(g))
    {
        let (scale, min, sparse) = header(rec);
        let codes = &rec[4..4 + code_bytes];
        let (mut qx, mut sx) = (0.0f32, 0.0f32);
        for (i, &xi) in xs.iter().enumerate() {
            let c = code_at(codes, i);
            if sparse && c == 0 {
                continue;
            }
            qx += (c - sparse as u8) as f32 * xi;
            sx += xi;
        }
        let mut acc = scale * qx + min * sx;
        for slot in rec[4 + code_bytes..].chunks_exact(2) {
            let (pos, val) = (slot[0] as usize, slot[1] as i8);
            if val != 0 && pos < g {
                acc += val as f32 * scale * RESIDUAL_UNIT * xs[pos];
            }
        }
        total += acc;
    }
    total
}

#[cfg(test)]
mod tests;
