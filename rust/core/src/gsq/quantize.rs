//! The GSQ-RCO quantizer with its residual calibration optimizer (RCO), one group at a time.
//!
//! For a group's weights w and their importances h (mean squared activation of the input column; 1 without
//! calibration), RCO minimises the importance-weighted error sum_j h_j (w_j - q_j - r_j)^2 over the grid (scale,
//! min), the codes, the choice of dense or sparse mode and the residual slots. Each step: assign every weight its
//! nearest level (in sparse mode, exactly zero when that is nearer); give the `slots` largest weighted errors a
//! residual; refit scale and min by weighted least squares on the weights left to the grid (outliers that got a
//! slot no longer stretch it). The grid is rounded to f16 before codes are assigned, so the error measured is the
//! error stored. Steps stop early once codes and slots stop changing; the best step of each mode is kept.
//!
//! The optimiser does not weigh a weight's error by its column's importance h_j alone but by
//! `h_j * sqrt(sigma2 + w_j^2)`, sigma2 = 2 * mean(w^2) over the row (llama.cpp's regularization of imatrix
//! weights in its k-quants): raw mean squares span orders of magnitude between columns, and unregularized they
//! let a few outlier columns decide a group's grid. The reported errors stay weighted by h alone.

use half::f16;

use super::{level, pack_codes, Layout, RESIDUAL_UNIT};

/// What the quantizer may do besides the layout.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Options {
    /// RCO refinement steps per group and mode (0: the min/max grid only).
    pub steps: usize,
    /// Whether a group may choose sparse mode (code 0 = exact zero).
    pub sparsity: bool,
}

impl Default for Options {
    fn default() -> Options {
        Options { steps: 100, sparsity: true }
    }
}

/// Importance-weighted squared errors of a row (or a sum of rows).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct RowStats {
    /// sum h w^2: the scale the errors below are relative to.
    pub weight: f64,
    /// Plain round-to-nearest on a min/max 8-level grid, no sparsity, no residuals.
    pub err_rtn: f64,
    /// What was stored.
    pub err: f64,
    /// Weights stored as exact zeros (the codes of sparse groups that mean 0).
    pub zeros: usize,
    pub sparse_groups: usize,
    pub slots_used: usize,
}

impl RowStats {
    pub fn add(&mut self, o: &RowStats) {
        self.weight += o.weight;
        self.err_rtn += o.err_rtn;
        self.err += o.err;
        self.zeros += o.zeros;
        self.sparse_groups += o.sparse_groups;
        self.slots_used += o.slots_used;
    }
}

#[derive(Clone)]
struct Candidate {
    scale: f32,
    min: f32,
    sparse: bool,
    codes: Vec<u8>,
    slots: Vec<(u8, i8)>,
    err: f64,
}

fn round_f16(x: f32) -> f32 {
    f16::from_f32(x).to_f32()
}

/// Nearest code of `w` on the grid (dense: 8 levels; sparse: zero or 7 levels).
fn nearest(w: f32, scale: f32, min: f32, sparse: bool) -> u8 {
    let n_levels = if sparse { 7 } else { 8 };
    let k = if scale > 0.0 {
        ((w - min) / scale)
            .round()
            .clamp(0.0, (n_levels - 1) as f32) as u8
    } else {
        0
    };
    let c = k + sparse as u8;
    if sparse && w.abs() < (w - level(c, scale, min, true)).abs() {
        0
    } else {
        c
    }
}

/// Codes, slots and weighted error of a group on a given (already f16-rounded) grid.
fn evaluate(w: &[f32], h: &[f32], scale: f32, min: f32, sparse: bool, n_slots: usize) -> Candidate {
    let codes: Vec<u8> = w.iter().map(|&x| nearest(x, scale, min, sparse)).collect();
    let errs: Vec<f32> = w
        .iter()
        .zip(&codes)
        .map(|(&x, &c)| x - level(c, scale, min, sparse))
        .collect();
    // The n_slots largest weighted errors, largest first, ties to the lower index (a partial insertion sort:
    // n_slots is at most 16, a full sort of the group per step cost more than the rest of the step).
    let key = |j: usize| h[j] as f64 * (errs[j] as f64).powi(2);
    let mut order: Vec<usize> = Vec::with_capacity(n_slots + 1);
    if n_slots > 0 {
        for j in 0..w.len() {
            let kj = key(j);
            if order.len() == n_slots && kj <= key(order[n_slots - 1]) {
                continue; // not above the smallest kept (an equal key loses: the kept index is lower)
            }
            let at = order.iter().position(|&o| kj > key(o)).unwrap_or(order.len());
            order.insert(at, j);
            order.truncate(n_slots);
        }
    }
    let unit = scale * RESIDUAL_UNIT;
    let mut slots = Vec::with_capacity(n_slots);
    for &j in order.iter().take(n_slots) {
        if unit <= 0.0 {
            break;
        }
        let v = (errs[j] / unit).round().clamp(-127.0, 127.0) as i8;
        if v != 0 {
            slots.push((j as u8, v));
        }
    }
    let mut corrected = errs.clone();
    for &(j, v) in &slots {
        corrected[j as usize] -= v as f32 * unit;
    }
    let err = corrected
        .iter()
        .zip(h)
        .map(|(&e, &hj)| hj as f64 * (e as f64).powi(2))
        .sum();
    Candidate {
        scale,
        min,
        sparse,
        codes,
        slots,
        err,
    }
}

/// sum_j h_j (w_j - stored_j)^2 of a candidate.
fn stored_error(w: &[f32], h: &[f32], c: &Candidate) -> f64 {
    let unit = c.scale * RESIDUAL_UNIT;
    let mut e: Vec<f32> = w.iter().zip(&c.codes).map(|(&x, &q)| x - level(q, c.scale, c.min, c.sparse)).collect();
    for &(j, v) in &c.slots {
        e[j as usize] -= v as f32 * unit;
    }
    e.iter().zip(h).map(|(&d, &hj)| hj as f64 * (d as f64).powi(2)).sum()
}

/// Weighted least-squares (min, scale) for the weights on the grid (not zero-coded, not given a slot).
fn refit(w: &[f32], h: &[f32], c: &Candidate) -> Option<(f32, f32)> {
    let in_slot = |j: usize| c.slots.iter().any(|&(p, _)| p as usize == j);
    let (mut s0, mut s1, mut s2, mut t0, mut t1) = (0.0f64, 0.0f64, 0.0f64, 0.0f64, 0.0f64);
    for (j, (&x, &code)) in w.iter().zip(&c.codes).enumerate() {
        if (c.sparse && code == 0) || in_slot(j) {
            continue;
        }
        let q = (code - c.sparse as u8) as f64;
        let hj = h[j] as f64;
        s0 += hj;
        s1 += hj * q;
        s2 += hj * q * q;
        t0 += hj * x as f64;
        t1 += hj * q * x as f64;
    }
    let det = s0 * s2 - s1 * s1;
    if det <= 1e-12 * s0 * s2.max(1e-30) || s0 <= 0.0 {
        return None;
    }
    let scale = (s0 * t1 - s1 * t0) / det;
    let min = (t0 - scale * s1) / s0;
    (scale > 0.0).then_some((min as f32, scale as f32))
}

/// The best candidate of one mode after up to `steps` refinements from the min/max grid.
fn optimise(w: &[f32], h: &[f32], sparse: bool, n_slots: usize, steps: usize) -> Candidate {
    let (lo, hi) = w
        .iter()
        .fold((f32::INFINITY, f32::NEG_INFINITY), |(a, b), &x| {
            (a.min(x), b.max(x))
        });
    let n_levels = if sparse { 7.0 } else { 8.0 };
    let mut min = round_f16(lo);
    let mut scale = round_f16(((hi - min) / (n_levels - 1.0)).max(0.0));
    let mut last = evaluate(w, h, scale, min, sparse, n_slots);
    let mut best = last.clone();
    for _ in 0..steps {
        let Some((m, s)) = refit(w, h, &last) else {
            break;
        };
        min = round_f16(m);
        scale = round_f16(s);
        if scale <= 0.0 {
            break;
        }
        let next = evaluate(w, h, scale, min, sparse, n_slots);
        let settled = next.codes == last.codes && next.slots == last.slots;
        if next.err < best.err {
            best = next.clone();
        }
        last = next;
        if settled {
            break;
        }
    }
    best
}

/// Quantize one row `w` (a whole number of groups) with per-column importances `h` (same length) into `out`
/// (`layout.row_bytes(w.len())` bytes), refining each group for at most `opts.steps` RCO steps.
///
/// # Panics
/// If the lengths do not match the layout (the caller checks them).
pub fn quantize_row(layout: Layout, w: &[f32], h: &[f32], opts: &Options, out: &mut [u8]) -> RowStats {
    assert_eq!(w.len(), h.len(), "weights and importances differ in length");
    assert_eq!(Some(out.len()), layout.row_bytes(w.len()).ok(), "output is not the row's size");
    let g = layout.group;
    let code_bytes = 3 * g / 8;
    let sigma2 = 2.0 * w.iter().map(|&x| x as f64 * x as f64).sum::<f64>() / w.len().max(1) as f64;
    // The optimiser's per-weight weights (see the module documentation).
    let e: Vec<f32> = w.iter().zip(h).map(|(&x, &hj)| hj * (sigma2 + (x as f64).powi(2)).sqrt() as f32).collect();
    let mut stats = RowStats::default();
    for (((wg, hg), eg), rec) in w
        .chunks_exact(g)
        .zip(h.chunks_exact(g))
        .zip(e.chunks_exact(g))
        .zip(out.chunks_exact_mut(layout.record_bytes()))
    {
        stats.weight += wg.iter().zip(hg).map(|(&x, &hj)| hj as f64 * (x as f64).powi(2)).sum::<f64>();
        stats.err_rtn += optimise(wg, hg, false, 0, 0).err;
        let dense = optimise(wg, eg, false, layout.slots, opts.steps);
        let c = if opts.sparsity {
            let sparse = optimise(wg, eg, true, layout.slots, opts.steps);
            if sparse.err < dense.err { sparse } else { dense }
        } else {
            dense
        };
        stats.err += stored_error(wg, hg, &c);
        if c.sparse {
            stats.sparse_groups += 1;
            stats.zeros += c.codes.iter().filter(|&&q| q == 0).count();
        }
        stats.slots_used += c.slots.len();
        let scale_bits = f16::from_f32(c.scale).to_bits() | if c.sparse { 0x8000 } else { 0 };
        rec[0..2].copy_from_slice(&scale_bits.to_le_bytes());
        rec[2..4].copy_from_slice(&f16::from_f32(c.min).to_le_bytes());
        pack_codes(&c.codes, &mut rec[4..4 + code_bytes]);
        let slot_bytes = &mut rec[4 + code_bytes..];
        slot_bytes.fill(0);
        for (k, &(pos, val)) in c.slots.iter().enumerate() {
            slot_bytes[2 * k] = pos;
            slot_bytes[2 * k + 1] = val as u8;
        }
    }
    stats
}
